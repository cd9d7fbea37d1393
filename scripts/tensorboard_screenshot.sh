#!/usr/bin/env bash
# Makes docs/img/tensorboard.png: 200 steps of the default model with
# --tensorboard-dir, shown by TensorBoard (the `tensorboard` Python package)
# and photographed by headless Chromium (Debian's `chromium` package).
#
#   bash scripts/tensorboard_screenshot.sh [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/img/tensorboard.png}
runs=$(mktemp -d)
port=${PORT:-6006}
cargo run -q --release -- train --device cpu --steps 200 --eval-every 20 \
  --tensorboard-dir "$runs/tiny" > /dev/null
tensorboard --logdir "$runs" --port "$port" > "$runs/tensorboard.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$runs"' EXIT
for _ in $(seq 60); do
  curl -sf "http://localhost:$port/" > /dev/null && break
  sleep 1
done
chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1500,950 \
  --virtual-time-budget=15000 --screenshot="$out" \
  "http://localhost:$port/?darkMode=false#scalars&tagFilter=loss%7Clearning-rate%7Cgrad-norm"
echo "wrote $out"
