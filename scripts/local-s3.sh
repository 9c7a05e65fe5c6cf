#!/usr/bin/env bash
# A real S3-compatible server on this machine (s3s-fs: objects are files under DIR/data), for the
# tests and for trying ferrotron's s3:// paths locally.
#
#   scripts/local-s3.sh start DIR [BUCKET...]   starts it on 127.0.0.1 (a free port from 9000 on, or
#                                               $PORT), creates the buckets, prints `export AWS_…=…`
#   scripts/local-s3.sh stop DIR                stops it
#
#   eval "$(scripts/local-s3.sh start /tmp/s3 models)"
#
# The server is installed with: cargo install s3s-fs@0.14.1 --features binary --locked
set -euo pipefail

usage() {
  echo "usage: $0 start DIR [BUCKET...] | stop DIR" >&2
  exit 2
}
[ $# -ge 2 ] || usage
cmd=$1
dir=$2
shift 2

server=${S3S_FS:-s3s-fs}
if ! command -v "$server" >/dev/null; then
  for candidate in "$HOME/.cargo/bin/s3s-fs" /usr/local/bin/s3s-fs; do
    [ -x "$candidate" ] && server=$candidate && break
  done
fi

case "$cmd" in
start)
  if ! command -v "$server" >/dev/null && [ ! -x "$server" ]; then
    echo "s3s-fs is not installed: cargo install s3s-fs@0.14.1 --features binary --locked" >&2
    exit 1
  fi
  mkdir -p "$dir/data"
  dir=$(cd "$dir" && pwd)
  if [ -f "$dir/server.pid" ] && kill -0 "$(cat "$dir/server.pid")" 2>/dev/null; then
    echo "a server already runs for $dir (pid $(cat "$dir/server.pid")): stop it first" >&2
    exit 1
  fi
  free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
  key=ferrotron
  secret=ferrotron-local-secret
  for bucket in "$@"; do mkdir -p "$dir/data/$bucket"; done
  port=${PORT:-9000}
  # Another server may take a free port between the check and the bind (two starts at once): this
  # one then exits, and the next free port is tried (unless $PORT was asked for).
  for _ in $(seq 20); do
    if [ -z "${PORT:-}" ]; then
      while ! free "$port"; do port=$((port + 1)); done
    fi
    nohup "$server" --host 127.0.0.1 --port "$port" --access-key "$key" --secret-key "$secret" \
      "$dir/data" >"$dir/server.log" 2>&1 &
    echo $! >"$dir/server.pid"
    echo "$port" >"$dir/server.port"
    for _ in $(seq 100); do
      # Open, and by this server: one that lost the port to another process has exited.
      if ! free "$port" && sleep 0.2 && kill -0 "$(cat "$dir/server.pid")" 2>/dev/null; then
        cat <<EOF
export AWS_ENDPOINT_URL=http://127.0.0.1:$port
export AWS_ACCESS_KEY_ID=$key
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=us-east-1
export AWS_ALLOW_HTTP=true
EOF
        exit 0
      fi
      if ! kill -0 "$(cat "$dir/server.pid")" 2>/dev/null; then break; fi
      sleep 0.1
    done
    [ -z "${PORT:-}" ] && grep -q "Address already in use" "$dir/server.log" || break
    port=$((port + 1))
  done
  echo "the server did not start; its log ($dir/server.log):" >&2
  cat "$dir/server.log" >&2
  exit 1
  ;;
stop)
  if [ -f "$dir/server.pid" ]; then
    kill "$(cat "$dir/server.pid")" 2>/dev/null || true
    rm -f "$dir/server.pid"
  fi
  ;;
*) usage ;;
esac
