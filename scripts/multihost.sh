#!/usr/bin/env bash
# Several "hosts" on this machine for MPI fault tests: Linux network namespaces h1..hN on a bridge in
# a namespace `fthead` (10.78.0.1; host I is 10.78.0.(10+I)), nothing routed beyond it. mpirun runs
# in `fthead` and starts its daemons through this script's `exec` (in place of ssh), each in its
# host's namespace with the host's name. Needs root, iproute2, util-linux and openmpi-bin.
#
#   multihost.sh up N            create N hosts (removing what an earlier run left)
#   multihost.sh down            remove every host and process it made
#   multihost.sh mpirun ARGS...  mpirun in `fthead` with the settings the hosts need
#   multihost.sh exec HOST CMD   (mpirun's launch agent) run CMD on HOST
#   multihost.sh kill HOST       kill -9 every process of HOST (a host dying)
#   multihost.sh cut HOST        take HOST's link down (its runtime and MPI traffic stop)
#   multihost.sh partition A B   drop the MPI data traffic between hosts A and B only (their runtime
#                                links, and their traffic with every other host, stay up)
#   multihost.sh shape HOST RATE shape HOST's link both ways (tc tbf), e.g. 1gbit
set -euo pipefail
HEAD=fthead
NET=10.78.0
STATE=/run/ferrotron-multihost.hosts
HERE=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
# MPI's data traffic (the TCP BTL) is kept to these ports, below the kernel's ephemeral range where
# the runtime's own (OOB) ports fall, so that a partition can drop the data traffic alone.
BTL_PORT=30000
BTL_RANGE=200

hosts() { cat "$STATE" 2>/dev/null | grep -v "^$HEAD$" || true; }

down() {
  local ns pids
  for ns in $( { cat "$STATE" 2>/dev/null || true; echo $HEAD; } | sort -u); do
    [ -e "/run/netns/$ns" ] || continue
    for _ in $(seq 25); do
      pids=$(ip netns pids "$ns")
      [ -z "$pids" ] && break
      kill -9 $pids 2>/dev/null || true
      sleep 0.2
    done
    ip netns del "$ns"
    rm -rf "/etc/netns/$ns"
  done
  rm -f "$STATE"
}

up() {
  local n=$1 i ns
  down
  echo $HEAD >"$STATE"
  ip netns add $HEAD
  ip -n $HEAD link set lo up
  ip -n $HEAD link add br0 type bridge
  ip -n $HEAD addr add $NET.1/24 dev br0
  ip -n $HEAD link set br0 up
  local names="127.0.0.1 localhost
$NET.1 $HEAD"
  for i in $(seq 1 "$n"); do
    ns=h$i
    echo "$ns" >>"$STATE"
    names="$names
$NET.$((10 + i)) $ns"
    ip netns add "$ns"
    ip link add "veth-$ns" netns $HEAD type veth peer name eth0 netns "$ns"
    ip -n $HEAD link set "veth-$ns" master br0 up
    ip -n "$ns" addr add "$NET.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  for ns in $HEAD $(hosts); do
    mkdir -p "/etc/netns/$ns"
    echo "$names" >"/etc/netns/$ns/hosts"
  done

}

case "${1:-}" in
  up) up "${2:?up N}" ;;
  down) down ;;
  mpirun)
    # The hosts share this machine's cores: each host's daemon would bind its first rank to core 0,
    # so ranks on different hosts would share one core; --bind-to none leaves placement to the kernel.
    shift
    exec ip netns exec $HEAD mpirun --allow-run-as-root --oversubscribe \
      --mca plm_rsh_agent "$HERE exec" \
      --mca pml ob1 --mca btl tcp,self \
      --bind-to none \
      --mca btl_tcp_if_include $NET.0/24 --mca oob_tcp_if_include $NET.0/24 \
      --mca btl_tcp_port_min_v4 $BTL_PORT --mca btl_tcp_port_range_v4 $BTL_RANGE \
      --mca mpi_yield_when_idle 1 \
      --mca oob_tcp_keepalive_time 2 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 2 \
      "$@"
    ;;
  exec)
    # mpirun calls `AGENT HOST orted ARGS…`, the arguments joined and re-parsed as ssh would.
    shift
    ns=$1
    shift
    exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && eval "$1"' "$ns" "$*"
    ;;
  kill)
    pids=$(ip netns pids "${2:?kill HOST}")
    [ -z "$pids" ] || kill -9 $pids
    ;;
  cut) ip -n $HEAD link set "veth-${2:?cut HOST}" down ;;
  partition)
    a=${2:?partition A B}
    b=${3:?partition A B}
    addr=$NET.$((10 + ${b#h}))
    last=$((BTL_PORT + BTL_RANGE - 1))
    ip netns exec "$a" nft add table inet partition
    ip netns exec "$a" nft add chain inet partition out '{ type filter hook output priority 0; }'
    ip netns exec "$a" nft add chain inet partition in '{ type filter hook input priority 0; }'
    for port in dport sport; do
      ip netns exec "$a" nft add rule inet partition out ip daddr "$addr" tcp "$port" "$BTL_PORT-$last" drop
      ip netns exec "$a" nft add rule inet partition in ip saddr "$addr" tcp "$port" "$BTL_PORT-$last" drop
    done
    ;;
  shape)
    ns=${2:?shape HOST RATE}
    rate=${3:?shape HOST RATE}
    ip netns exec $HEAD tc qdisc replace dev "veth-$ns" root tbf rate "$rate" burst 32kbit latency 400ms
    ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst 32kbit latency 400ms
    ;;
  *)
    echo "usage: $0 up N | down | mpirun ARGS... | exec HOST CMD | kill HOST | cut HOST | partition A B | shape HOST RATE" >&2
    exit 2
    ;;
esac
