#!/usr/bin/env bash
# Checkpoint timings on one GPU with the benchmark model (10.8 GB of state):
# a streamed save, a resume from a cold page cache (caches dropped when run
# as root, else each file's pages advised out), then 200 steps saving every
# 100, streamed and with --async-save, side by side. With BASE=hybridgen-old
# (another build in the bundle) its resume runs first, for a before/after.
#
#   bash gpu-bundle/checkpoint_gpu.sh LOGDIR [DIR]   # DIR: scratch, default /tmp/hybridgen-ckpt
#
# MODEL="..." replaces the model and device flags (they must include --format json).
# Prints one line a run: steps, median step (after 3), the time the steps
# waited on saves (save_s), the resume's load time and the run's wall clock.
set -uf
here=$(cd "$(dirname "$0")" && pwd)
logs=${1:?usage: checkpoint_gpu.sh LOGDIR [DIR]}
dir=${2:-/tmp/hybridgen-ckpt}
mkdir -p "$logs"
[ -f "$here/env.sh" ] && . "$here/env.sh"
model="${MODEL:---device cuda --preset bench-hybrid-moe --ranks 1 --ep 1 --micro-batches 4 --micro-batch-size 1 --lr 1e-4 --weight-decay 0.1 --clip-grad 0 --format json}"

cold() {
  sync
  if [ "$(id -u)" = 0 ]; then echo 3 > /proc/sys/vm/drop_caches; fi
  python3 - "$1" <<'PY'
import os, sys
for d, _, files in os.walk(sys.argv[1]):
    for f in files:
        fd = os.open(os.path.join(d, f), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
PY
}

line() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, statistics, sys
name, path, wall = sys.argv[1], sys.argv[2], sys.argv[3]
steps, s = [], {}
for text in open(path):
    try:
        j = json.loads(text)
    except ValueError:
        continue
    if "summary" in j:
        s = j["summary"]
    elif "step" in j:
        steps.append(j["step_ms"])
kept = steps[3:] or steps
print(f"{name}: {len(steps)} steps, median {statistics.median(kept) if kept else 0:.1f} ms, "
      f"save_s {s.get('save_s', 0):.2f}, resume_s {s.get('startup_s', {}).get('resume', 0):.2f}, wall {wall} s, "
      f"hash {s.get('param_hash')}")
PY
}

run() {
  local name=$1 bin=$2; shift 2
  local t0; t0=$(date +%s)
  "$here/$bin" train $model "$@" > "$logs/$name.jsonl" 2> "$logs/$name.err" || { echo "$name: failed"; tail -3 "$logs/$name.err"; return; }
  line "$name" "$logs/$name.jsonl" $(( $(date +%s) - t0 ))
}

rm -rf "$dir" && mkdir -p "$dir"
run streamed-save-3-steps hybridgen --steps 3 --save "$dir/three"
for bin in ${BASE:-} hybridgen; do
  cold "$dir/three"
  run "resume-cold-$bin" "$bin" --steps 4 --resume "$dir/three"
done
rm -rf "$dir/three"
run streamed-every-100 hybridgen --steps 200 --save-every 100 --keep-last 1 --save "$dir/streamed"
rm -rf "$dir/streamed"
run async-every-100 hybridgen --steps 200 --save-every 100 --keep-last 1 --save "$dir/async" --async-save
rm -rf "$dir"
