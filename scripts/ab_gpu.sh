#!/usr/bin/env bash
# Two (or more) builds of hybridgen on the benchmark's 1-GPU row, run in
# turn, so that the machine's drift falls on all of them alike: how the
# README's "alternated runs of the old and new binaries" were measured.
# Each run is the bench's (`bench_gpu.sh`): `bench-hybrid-moe`, 4
# micro-batches of one 4,096-token sequence, 13 steps, AdamW at 1e-4; a
# line per run gives the median step of steps 4-13, the last loss and the
# parameter hash (a change that should keep the bits must keep the hash).
#
# Here (no GPU needed): build each version and put it in the bundle under
# its own name, the bundle first (cuda_bundle.sh empties gpu-bundle/), e.g.
# against commit BASE:
#   scripts/cuda_bundle.sh                      # the new build: gpu-bundle/hybridgen
#   git worktree add /tmp/base BASE && (cd /tmp/base && CARGO_TARGET_DIR="$OLDPWD/target" \
#     cargo build --release --bin hybridgen) && cp target/release/hybridgen gpu-bundle/hybridgen-base
# (the shared target folder reuses the dependencies' builds; the next
# `cargo build` here rebuilds the workspace's own crates).
# There:
#   ROUNDS=2 bash gpu-bundle/ab_gpu.sh hybridgen-base hybridgen
# Extra flags for every run go in EXTRA (e.g. EXTRA="--schedule plain");
# flags for one entry follow its name after a colon, comma-separated, so
# one build can be weighed against itself with another option:
#   bash gpu-bundle/ab_gpu.sh hybridgen hybridgen:--expert-gemm=grouped
# MODEL replaces the model's flags (default `--preset bench-hybrid-moe`) and
# STEPS the steps (default 13), e.g. the 9B's first 29 layers, every layer
# kept (the plain schedule fits them):
#   MODEL="--preset nemotron-nano-9b-v2 --pattern M-M-M-MM-M-M-M*-M-M-M*-M-M-M- \
#     --seq-len 4096" EXTRA="--schedule plain" STEPS=7 bash gpu-bundle/ab_gpu.sh hybridgen-base hybridgen
set -uo pipefail
# No globbing: MODEL's pattern (`*` is attention) goes to hybridgen as typed.
set -f
here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: ab_gpu.sh BINARY[:FLAG,...]... (names in the bundle)" >&2; exit 2; }
log=$(mktemp -d)
# env.sh keeps the kernel cache under $out: one cache for every run, so only
# the first run of each build compiles.
out=$log
. "$here/env.sh"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for entry in "$@"; do
    binary=${entry%%:*}
    flags=""
    if [[ "$entry" == *:* ]]; then
      flags=${entry#*:}
      flags=${flags//,/ }
    fi
    name=$(printf '%s' "$entry" | tr -c 'A-Za-z0-9_.=-' '_')
    # shellcheck disable=SC2086 # EXTRA, MODEL and the entry's flags are word lists
    "$here/$binary" train --device cuda --ranks 1 --ep 1 ${MODEL:---preset bench-hybrid-moe} \
      --micro-batch-size 1 --micro-batches 4 --steps "${STEPS:-13}" --lr 1e-4 --weight-decay 0.1 \
      --clip-grad 0 --format json ${EXTRA:-} $flags > "$log/$name-$round.jsonl" 2> "$log/$name-$round.err"
    rc=$?
    python3 - "$here" "$entry" "$round" "$rc" "$log/$name-$round.jsonl" <<'PY'
import statistics, sys
sys.path.insert(0, sys.argv[1])
from run_log import read
name, round_, rc, path = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
steps, loss, summary = read(path)
if rc != 0 or len(steps) < 4:
    print(f"{name:20s} round {round_}: failed (exit {rc}, {len(steps)} steps)")
else:
    median = statistics.median(steps[3:])
    print(f"{name:20s} round {round_}: median {median:.1f} ms, last loss {loss:.6f}, "
          f"hash {summary.get('param_hash')}")
PY
    [ "$rc" -eq 0 ] || tail -3 "$log/$name-$round.err"
  done
done
