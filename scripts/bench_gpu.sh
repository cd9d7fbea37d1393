#!/usr/bin/env bash
# The GPU benchmark: hybridgen on the
# `bench-hybrid-moe` preset on 1 GPU (EP 1, no communication) and on 2 GPUs
# (EP 2, ZeRO-3), each with the overlap and the plain schedule, then PyTorch's rows
# of the same model (the PyTorch baseline's folder named by TORCH_REF, its
# `fast` stage) in the same run, and one table: step ms (median of 10 after
# 3 warm-up steps), tokens/s per GPU, TFLOP/s per GPU, MFU, GPU memory, exposed
# communication (a 2-GPU step minus the 1-GPU step) and each row's ratio to
# PyTorch's matching row measured here; last, the wall time of a whole
# one-step run with a warm kernel cache (start-up).
#
# Here (no GPU needed), with a copy of the PyTorch baseline's folder if you
# have one (it is not part of this repository):
#   scripts/cuda_bundle.sh && cp -r /path/to/torch_ref gpu-bundle/
# There (2 x H200; the bundle carries this script):
#   TORCH_REF=$PWD/gpu-bundle/torch_ref bash gpu-bundle/bench_gpu.sh LOGDIR  # everything, about 10 minutes
#   bash gpu-bundle/bench_gpu.sh LOGDIR                  # hybridgen's rows only
#   ROWS="hybridgen-1gpu hybridgen-1gpu-plain" TORCH_REF=... bash gpu-bundle/bench_gpu.sh LOGDIR
#                                                        # only the rows named (and PyTorch's)
# With TORCH_REF unset (or `none`) PyTorch's rows are skipped, with a
# message, and the `vs torch` column stays empty.
# On a machine with one GPU the 2-GPU rows say they were skipped, and of
# PyTorch's stage only its 1-GPU `--fast` row runs, TORCH_RUNS times
# (default 3; about 2 minutes the first, 30 s each after it): its step time
# moves by a quarter or more between runs, so the table lists every run and
# the 1-GPU ratios divide by the fastest.
#
# The rows train as the baseline does: AdamW at 1e-4 with weight decay
# 0.1, no gradient clipping, bf16 with f32 master weights, ZeRO-3.
#
# FLOPs are the baseline's count for this model, 3,031,695,360 a token
# (the baseline's README, section 3; dsl/tests/plan.rs checks that the preset
# is that model, and dsl/src/flops.rs, which gives every run's summary its
# `flops_per_token`, gives that figure for it), against the H200's 989
# TFLOP/s of dense bf16; the 9B rows (`nemotron-nano-9b-v2` at 4,096
# tokens) take their own count from their summaries (model FLOPs: a
# recomputed forward is not counted). Memory, three ways, so that rows
# compare like with like: `alloc` is the most the run's buffers held at
# once (hybridgen: its arenas' peak in use, rank 0; PyTorch:
# `torch.cuda.max_memory_allocated`); `held` what the allocator held from
# the device (hybridgen: its arenas at the end; PyTorch:
# `max_memory_reserved`); `smi` the most `nvidia-smi` saw in use on any
# GPU during the row, sampled every 0.2 s (the process: context, libraries
# and allocator together).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/bench-logs}
mkdir -p "$out"
torch_ref=${TORCH_REF:-none}
torch_runs=${TORCH_RUNS:-3}
. "$here/env.sh"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
: > "$out/rows.jsonl"

# One hybridgen row: 13 steps, the median step time of the last 10. The
# model is the benchmark's with EP = ranks unless `row_model` says
# otherwise (the flags naming the model and its layout); the ranks run a
# GPU each unless `row_gpus` says fewer (the copy transport's shared GPUs).
# A multi-rank row's `exposed` is its step minus the `row_base` row's
# (the same model on one rank) times the ranks a GPU; none without a base.
row_model=()
row_gpus=
row_base=hybridgen-1gpu
# nvidia-smi's memory in use, every 0.2 s, into file $1 until stop_sampler.
start_sampler() {
  : > "$1"
  (while true; do
     nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits >> "$1" 2>/dev/null
     sleep 0.2
   done) &
  sampler=$!
}
stop_sampler() {
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
}
row() {
  local name=$1 ranks=$2
  shift 2
  # ROWS="name ..." runs only the rows it names.
  if [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $name "* ]]; then
    return
  fi
  local used=${row_gpus:-$ranks}
  if [ "$gpus" -lt "$used" ]; then
    echo "{\"row\": \"$name\", \"skipped\": \"needs $used GPUs, $gpus here\"}" >> "$out/rows.jsonl"
    return
  fi
  local peak_file="$out/$name.memory"
  start_sampler "$peak_file"
  local model=("${row_model[@]}")
  if [ ${#model[@]} -eq 0 ]; then
    model=(--preset bench-hybrid-moe --ep "$ranks")
  fi
  "$here/hybridgen" train --device cuda "${model[@]}" --ranks "$ranks" \
    --micro-batches 4 --micro-batch-size 1 --steps 13 --lr 1e-4 --weight-decay 0.1 --clip-grad 0 \
    --format json "$@" > "$out/$name.jsonl" 2> "$out/$name.err"
  local rc=$?
  stop_sampler
  python3 - "$here" "$name" "$ranks" "$rc" "$out/$name.jsonl" "$peak_file" "$used" "$row_base" \
    >> "$out/rows.jsonl" <<'PY'
import json, statistics, sys
sys.path.insert(0, sys.argv[1])
from run_log import read
name, ranks, rc, log, peak = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
gpus, base = int(sys.argv[7]), sys.argv[8]
steps, _, summary = read(log)
used = [float(v) for v in open(peak).read().split() if v.strip()]
row = {"row": name, "ranks": ranks, "gpus": gpus}
if base and base != name:
    row["base"] = base
# The run's own model FLOPs a token and tokens a GPU step (other models
# than the benchmark's carry theirs).
if summary.get("flops_per_token") and summary.get("steps"):
    row["flops_per_token"] = summary["flops_per_token"]
    row["tokens_per_gpu_step"] = summary["tokens"] / summary["steps"] / gpus
if summary.get("recomputed_layers") is not None:
    row["recomputed"] = summary["recomputed_layers"]
if summary.get("ideal_bubble") is not None:
    row["stage_waits"] = summary.get("stage_waits")
    row["ideal_bubble"] = summary["ideal_bubble"]
if rc != 0 or len(steps) < 13:
    row["failed"] = f"exit {rc}, {len(steps)} steps; see {log}"
else:
    row["step_ms"] = statistics.median(steps[3:13])
    row["smi_gib"] = max(used) / 1024 if used else None
    if summary.get("peak_allocated_bytes"):
        row["alloc_gib"] = summary["peak_allocated_bytes"] / 2**30
        row["held_gib"] = summary["reserved_bytes"] / 2**30
print(json.dumps(row))
PY
}

row hybridgen-1gpu 1 --schedule overlap
# One GPU has no communication to hide: the plain schedule (one micro-batch
# in flight) shows what the overlap schedule's interleaving costs there.
row hybridgen-1gpu-plain 1 --schedule plain
row hybridgen-2gpu-overlap 2 --schedule overlap
row hybridgen-2gpu-plain 2 --schedule plain
# Two ranks sharing one GPU over the copy transport (EP 2, ZeRO-3): the
# 2-GPU rows' collectives run, all on one device; its `exposed` is the
# step minus two 1-GPU steps (the same work without communication).
row_gpus=1
row hybridgen-copy-2rk-1gpu 2 --schedule overlap --transport copy
row hybridgen-copy-2rk-plain 2 --schedule plain --transport copy
# Two pipeline stages sharing one GPU over the copy transport (pp 2, 8
# layers a stage, 1F1B over 4 micro-batches): its `exposed` is the step
# minus the 1-GPU step (the stages split one model's work), and the row
# carries each stage's measured bubble
# (the share of the run its compute waited on the other stage) beside
# 1F1B's (p - 1) / (m + p - 1) = 20%.
row_model=(--preset bench-hybrid-moe --ep 1)
row hybridgen-copy-pp2-1gpu 2 --pp 2 --schedule overlap --transport copy
row hybridgen-copy-pp2-plain 2 --pp 2 --schedule plain --transport copy
row_model=() row_gpus=

# Real scale: the 9B Nemotron-H at 4,096 tokens on 2 GPUs under ZeRO-3,
# recomputing the fewest layers that fit (`--recompute auto`): with the
# plain schedule none (one micro-batch in flight, 113 GiB a GPU by the
# memory plan), with the overlap schedule some (its two micro-batches in
# flight would need 147 GiB a GPU kept: `hybridgen plan --preset
# nemotron-nano-9b-v2 --dp 2 --seq-len 4096`). A dense model has no
# expert all-to-all for the overlap schedule to hide. No 1-GPU row holds
# it. The `recomp` column is the layers each row recomputed.
row_model=(--preset nemotron-nano-9b-v2 --ep 1 --seq-len 4096 --recompute auto)
row_base=
row nemotron-9b-2gpu 2 --schedule plain
row nemotron-9b-2gpu-overlap 2 --schedule overlap
# Its real dimensions on one GPU: the first 29 layers of its pattern (5.2 B
# parameters; `hybridgen plan PATTERN --preset nemotron-nano-9b-v2`), one
# rank with each schedule, then two ranks sharing the GPU over the copy
# transport under ZeRO-3 with the plain schedule (the overlap schedule's
# second micro-batch in flight does not fit half a GPU even recomputed,
# and the run's memory check says so). The two ranks recompute layers
# the one rank keeps, so their step is not compared with it (no
# `exposed`).
row_model=(--preset nemotron-nano-9b-v2 --pattern "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-" --ep 1
  --seq-len 4096 --recompute auto)
row nemotron-9b-half-1gpu 1 --schedule plain
row nemotron-9b-half-overlap 1 --schedule overlap
row_gpus=1
row nemotron-9b-half-copy-2rk 2 --schedule plain --transport copy
row_model=() row_gpus= row_base=hybridgen-1gpu

# Start-up with a warm kernel cache (the rows above filled it): a whole
# one-step run on 1 GPU. The issue's target (under 10 s) is start-up and
# the first step: the run's own clock from the command's start to the
# first step's report. The wall time from the process's start to its exit
# adds the final parameter hash and freeing the device.
if [ -z "${ROWS:-}" ] || [[ " $ROWS " == *" startup-warm-cache "* ]]; then
start=$(date +%s%N)
"$here/hybridgen" train --device cuda --preset bench-hybrid-moe --ranks 1 --ep 1 \
  --micro-batches 4 --micro-batch-size 1 --steps 1 --format json > "$out/startup.jsonl" 2>&1
startup_rc=$?
end=$(date +%s%N)
echo "{\"row\": \"startup-warm-cache\", \"ranks\": 1, \"wall_s\": $(( (end - start) / 1000000 ))e-3, \"rc\": $startup_rc}" \
  >> "$out/rows.jsonl"
fi

if [ "$torch_ref" = none ]; then
  echo "TORCH_REF is not set: skipping PyTorch's rows (set TORCH_REF=/path/to/torch_ref to run them)" >&2
elif [ ! -f "$torch_ref/run_device.sh" ]; then
  echo "TORCH_REF=$torch_ref has no run_device.sh: skipping PyTorch's rows" >&2
else
  if [ "$gpus" -ge 2 ]; then
    OUT="$out/torch" bash "$torch_ref/run_device.sh" fast > "$out/torch.log" 2>&1
  else
    # One GPU: the stage's 2-GPU rows cannot run, so only its main 1-GPU
    # row (`--fast`, the same command the stage runs), `torch_runs` times
    # (bench.py appends a line a run), for a same-run ratio of the 1-GPU
    # row against the fastest.
    mkdir -p "$out/torch"
    : > "$out/torch.log"
    start_sampler "$out/torch/smi.memory"
    for run in $(seq 1 "$torch_runs"); do
      (export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
         PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=4 TRITON_CACHE_AUTOTUNING=1
       CUDA_VISIBLE_DEVICES=0 timeout 240 python3 "$torch_ref/bench.py" --mode single --fast \
         --out "$out/torch/results.jsonl") >> "$out/torch.log" 2>&1
    done
    stop_sampler
  fi
fi

python3 - "$out/rows.jsonl" "$out/torch/results.jsonl" "$out/startup.jsonl" <<'PY'
import json, os, sys
FLOPS_PER_TOKEN = 3_031_695_360
TOKENS_PER_GPU_STEP = 4 * 4096
PEAK = 989e12
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
# PyTorch's rows: the 2-GPU stage's main row is the first of its kind it
# writes; the 1-GPU row is the fastest of its runs (every run is listed).
torch, torch_1gpu = {}, []
if os.path.exists(sys.argv[2]):
    for line in open(sys.argv[2]):
        r = json.loads(line)
        if r.get("fast") and not r.get("tiny") and "step_ms_median" in r:
            if r.get("world", 1) == 1:
                torch_1gpu.append(r)
            else:
                torch.setdefault("2gpu", r)
if torch_1gpu:
    torch["1gpu"] = min(torch_1gpu, key=lambda r: r["step_ms_median"])
smi_file = os.path.join(os.path.dirname(sys.argv[2]), "smi.memory")
torch_smi = [float(v) for v in open(smi_file).read().split()] if os.path.exists(smi_file) else []
listed = [(f"pytorch-fast-1gpu-run{i + 1}" if len(torch_1gpu) > 1 else "pytorch-fast-1gpu", 1, r)
          for i, r in enumerate(torch_1gpu)]
listed += [("pytorch-fast-2gpu", 2, torch["2gpu"])] if "2gpu" in torch else []
for name, ranks, r in listed:
    rows.append({"row": name, "ranks": ranks,
                 "step_ms": r["step_ms_median"],
                 "alloc_gib": max(r.get("peak_mem_alloc_gib_per_rank") or [0.0]),
                 "held_gib": r.get("peak_mem_reserved_gib_max"),
                 # Sampled around the 1-GPU runs only (the 2-GPU stage runs
                 # several rows in one command).
                 "smi_gib": max(torch_smi) / 1024 if torch_smi and ranks == 1 else None})
step_of = {r["row"]: r.get("step_ms") for r in rows}
print(f"{'row':26} {'step ms':>9} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU':>6} {'alloc GiB':>9} "
      f"{'held GiB':>8} {'smi GiB':>7} {'exposed':>8} {'vs torch':>8} {'recomp':>6}")
for r in rows:
    if "wall_s" in r:
        if r["rc"] != 0:
            print(f"{r['row']:26} FAILED (exit {r['rc']})")
            continue
        # The run's own account: the command's clock to the end of the
        # first step, phase by phase, then what came after it.
        try:
            lines = [json.loads(l) for l in open(sys.argv[3]) if l.startswith("{")]
            s = next(l["summary"] for l in lines if "summary" in l)
            first = next(l["step_ms"] for l in lines if l.get("step") == 1)
            t, c = s["startup_s"], s["clock_s"]
            print(f"{r['row']:26} to the end of the first step {c['first_step']:.1f} s: "
                  f"checks {c['prepared']:.1f} s, platform {t['platform']:.1f} s, "
                  f"device {t['device']:.1f} s, parameters {t['params']:.1f} s "
                  f"(drawn {t['params_drawn']:.1f} s), optimizer {t['optimizer']:.1f} s, "
                  f"first step {first / 1e3:.1f} s")
            print(f"{'':26} the whole run {r['wall_s']:.1f} s: after the step, the hash "
                  f"{s['hash_s']:.1f} s, the run's end {c['trained'] - c['first_step']:.1f} s, "
                  f"then the process's exit {r['wall_s'] - c['trained']:.1f} s (with its start)")
        except (OSError, StopIteration, KeyError, ValueError, TypeError):
            print(f"{r['row']:26} whole one-step run: {r['wall_s']:.1f} s")
        continue
    if "step_ms" not in r:
        print(f"{r['row']:26} {r.get('skipped') or r.get('failed')}")
        continue
    ms = r["step_ms"]
    tokens = r.get("tokens_per_gpu_step", TOKENS_PER_GPU_STEP)
    tps = tokens / (ms / 1e3)
    tflops = r.get("flops_per_token", FLOPS_PER_TOKEN) * tokens / (ms / 1e3) / 1e12
    # What the same work costs without communication: its base row's
    # 1-rank step a GPU, or one a rank where ranks share a GPU.
    one = step_of.get(r.get("base"))
    # A pipeline's ranks split one model's work: the same work is one
    # 1-rank step, not one a rank.
    share = 1 if r.get("ideal_bubble") is not None else r["ranks"] / r.get("gpus", r["ranks"])
    alone = one * share if one else None
    exposed = f"{ms - alone:8.1f}" if r["ranks"] > 1 and alone else f"{'':8}"
    ref = torch.get("1gpu" if r["ranks"] == 1 else "2gpu") if r.get("gpus", r["ranks"]) == r["ranks"] else None
    ratio = f"{ms / ref['step_ms_median']:8.2f}" if ref and r["row"].startswith("hybridgen") else f"{'':8}"
    gib = lambda key, width: f"{r[key]:{width}.1f}" if r.get(key) else " " * width
    peak = f"{gib('alloc_gib', 9)} {gib('held_gib', 8)} {gib('smi_gib', 7)}"
    recomputed = f"{r['recomputed']:6d}" if r.get("recomputed") is not None else f"{'':6}"
    print(f"{r['row']:26} {ms:9.1f} {tps:10.0f} {tflops:8.1f} {100 * tflops * 1e12 / PEAK:5.1f}% "
          f"{peak} {exposed} {ratio} {recomputed}")
    if r.get("ideal_bubble") is not None:
        waits = ", ".join(f"stage {i} {100 * w:.0f}%" for i, w in enumerate(r.get("stage_waits") or []))
        print(f"{'':26} bubble measured: {waits}; 1F1B's (p-1)/(m+p-1): {100 * r['ideal_bubble']:.0f}%")
PY
