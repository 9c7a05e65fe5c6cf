#!/usr/bin/env bash
# Makes the pictures in docs/profile.md of the reports: a profile of dp=2,tp=2,pp=2 on llama-small, a plan of
# Llama-3-70B on 64 A100s, and a short training run with --report, each rendered in headless
# Chromium (`apt-get install chromium`) and saved under docs/images/.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q
bin=target/release/ferrotron
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
browser=${FERROTRON_CHROMIUM:-chromium}
mkdir -p docs/images

shot() { # page, picture, height in pixels
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --user-data-dir="$work/chromium" --window-size="1280,$3" \
    --screenshot="$2" "file://$1" 2>/dev/null
  echo "wrote $2"
}

"$bin" profile --model llama-small --layout dp=2,tp=2,pp=2,zero=1,mbs=2 --out "$work/profile" >/dev/null
"$bin" plan --model llama3-70b --cluster dgx-a100-80g,nodes=8 --seq 4096 --global-batch 512 \
  --out "$work/plan" >/dev/null
"$bin" train --steps 40 --eval-every 10 --layout dp=2,pp=2 --batch-size 8 --seq-len 64 \
  --report --out-dir "$work/train" >/dev/null 2>&1
shot "$work/profile/report.html" docs/images/profile-report.png 3900
shot "$work/plan/report.html" docs/images/plan-report.png 2900
shot "$work/train/report.html" docs/images/train-report.png 2100
