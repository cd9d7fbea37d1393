#!/usr/bin/env bash
# Builds every GPU test and the `hybridgen` binary here (no GPU or CUDA
# needed: CUDA, NVRTC, cuBLAS and NCCL load at run time) and collects them,
# stripped, into gpu-bundle/ with run.sh, which runs them on a GPU machine
# (no cargo there): every GPU test, then the GPU benchmarks, then a short
# table of both.
#
#   scripts/cuda_bundle.sh                 # here: build and collect
#   bash gpu-bundle/run.sh LOGDIR          # there: tests and benchmarks
#   bash gpu-bundle/run.sh LOGDIR tests    # only the tests
#   TESTS="cuda_backend cuda_training" bash gpu-bundle/run.sh LOGDIR tests
#                                          # only those test binaries
#   bash gpu-bundle/run.sh LOGDIR bench    # only the benchmarks
#   bash gpu-bundle/run.sh LOGDIR launch   # only the launch-mode checks
#   bash gpu-bundle/run.sh LOGDIR profile  # where a step's time goes (1 GPU)
#   bash gpu-bundle/run.sh LOGDIR roofline # each kernel against its floor (1 GPU, ncu)
#   gpu-bundle/bench/expert_gemm           # the experts' GEMMs, cuBLAS vs grouped
#   gpu-bundle/bench/delta_rule            # G's gated delta rule kernels, timed
#   gpu-bundle/bench/sparse_attention      # D against dense flash attention, 4k-32k tokens
#   python3 gpu-bundle/bench_delta_fla.py  # the same against flash-linear-attention
#                                          # (its wheels in gpu-bundle/wheels)
#
# Tests that need more GPUs than the machine has say so and pass; so do the
# benchmarks' two-GPU rows.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/models"

# Copies, stripped, into folder $2 the executables of kind $1 (test,
# bench) that cargo's JSON messages on stdin name.
collect() {
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == [sys.argv[1]]:
        print(m["target"]["name"], m["executable"])
' "$1" | while read -r name exe; do
    cp "$exe" "$2/$name"
    strip "$2/$name"
  done
}

# Every test whose name starts with cuda_ (the GPU tests among them are
# #[ignore]d, so a machine without a GPU reports them ignored).
tests=()
for file in runtime/tests/cuda_*.rs; do
  tests+=(--test "$(basename "$file" .rs)")
done
cargo test --release --no-run -p hybridgen-runtime "${tests[@]}" --message-format=json \
  | collect test "$bundle/bin"
# The GPU micro-benchmarks, under bench/ so that run.sh's test loop does
# not take them for tests (they say why and exit without a GPU).
mkdir -p "$bundle/bench"
cargo bench --no-run -p hybridgen-runtime --bench expert_gemm --bench delta_rule --bench sparse_attention --message-format=json \
  | collect bench "$bundle/bench"
cargo build --release --bin hybridgen
cp "${CARGO_TARGET_DIR:-target}/release/hybridgen" "$bundle/hybridgen"
strip "$bundle/hybridgen"
cp examples/models/*.toml "$bundle/models/"
cp scripts/trace_breakdown.py scripts/kernel_table.py scripts/bench_gpu.sh scripts/ab_gpu.sh scripts/checkpoint_gpu.sh \
  scripts/run_log.py scripts/timeline_gaps.py scripts/timeline_kernels.py scripts/kernel_roofline.py \
  scripts/bench_delta_fla.py "$bundle/"
# flash-linear-attention's wheels for bench_delta_fla.py (the GPU machine
# has no internet); skipped, saying so, where they cannot be fetched.
scripts/fla_wheels.sh >/dev/null \
  || echo "cuda_bundle: flash-linear-attention's wheels could not be fetched: bench_delta_fla.py needs fla installed there" >&2

# The CUPTI timeline library (`run.sh LOGDIR timeline`), compiled here
# against the headers of NVIDIA's CUPTI and CRT wheels (fetched once into
# target/cupti); skipped, saying so, where they cannot be fetched.
cupti=target/cupti
if [ ! -f "$cupti/nvidia/cu13/include/cupti.h" ] || [ ! -f "$cupti/nvidia/cu13/include/crt/host_defines.h" ]; then
  rm -rf "$cupti.wheels" && mkdir -p "$cupti.wheels" "$cupti"
  if python3 -m pip download -q --no-deps -d "$cupti.wheels" \
      "nvidia-cuda-cupti==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*"; then
    for wheel in "$cupti.wheels"/*.whl; do
      python3 -m zipfile -e "$wheel" "$cupti"
    done
  fi
fi
if [ -f "$cupti/nvidia/cu13/include/cupti.h" ]; then
  gcc -O2 -shared -fPIC -Wall -Wextra -Werror -I "$cupti/nvidia/cu13/include" \
    scripts/cupti_timeline.c -o "$bundle/libcupti_timeline.so" \
    -L "$cupti/nvidia/cu13/lib" -l:libcupti.so.13
  cp "$cupti/nvidia/cu13/lib/libcupti.so.13" "$bundle/"
else
  echo "cuda_bundle: no CUPTI headers (pip download failed): run.sh timeline will be unavailable" >&2
fi

# What every script of the bundle runs under on the GPU machine (sourced
# with $out set): NVLink multicast off (shared GPUs), CUDA's libraries and
# headers, the kernel cache under the logs, and NCCL.
cat > "$bundle/env.sh" <<'ENV'
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH="$PATH:/usr/local/cuda/bin"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export HYBRIDGEN_CUDA_INCLUDE="${HYBRIDGEN_CUDA_INCLUDE:-/usr/local/cuda/include}"
export HYBRIDGEN_KERNEL_CACHE="${HYBRIDGEN_KERNEL_CACHE:-$out/kernel-cache}"
# NCCL (libnccl.so.2): the system's, else the one Python's nvidia-nccl wheel
# ships.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2'; then
  for dir in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    found=$(find "$dir" -name 'libnccl.so.2' 2>/dev/null | head -1)
    if [ -n "$found" ]; then
      export LD_LIBRARY_PATH="$(dirname "$found"):$LD_LIBRARY_PATH"
      break
    fi
  done
fi
ENV

cat > "$bundle/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs this bundle's GPU tests and benchmarks; logs go to $1 (default
# ./logs); $2 is `tests` (with the launch-mode checks), `launch` (only
# those), `bench`, `profile` (where one GPU's step goes), `timeline` (where
# its GPU waits), `roofline` (each kernel against its floor) or `all`
# (default, without the profile, timeline and roofline). NVLink multicast
# stays off (shared GPUs).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/logs}
what=${2:-all}
mkdir -p "$out"
. "$here/env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > "$out/nvidia-smi.txt" 2>&1
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
status=0
: > "$out/summary.txt"

if [ "$what" = all ] || [ "$what" = tests ]; then
  for test in "$here"/bin/*; do
    name=$(basename "$test")
    if [ -n "${TESTS:-}" ] && [[ " $TESTS " != *" $name "* ]]; then
      continue
    fi
    start=$(date +%s%N)
    # Buffers allocated without zeroing are poisoned (all bits set), so a
    # kernel reading what nothing wrote fails its test.
    # The GPU tests are #[ignore]d where they are built: run them too. Tests
    # that need two GPUs carry `two_gpus` in their names; on one GPU they
    # are left out by name (and counted below), never run to pass unrun.
    skip=()
    if [ "$gpus" -lt 2 ]; then
      skip=(--skip two_gpus)
    fi
    HYBRIDGEN_POISON_UNINIT=1 "$test" --nocapture --test-threads=1 --include-ignored "${skip[@]}" > "$out/$name.log" 2>&1
    rc=$?
    end=$(date +%s%N)
    printf 'test  %-22s exit %d  %6d ms  %s\n' "$name" "$rc" "$(( (end - start) / 1000000 ))" \
      "$(grep -E '^test result:' "$out/$name.log" | tail -1 | sed 's/test result: //; s/; finished.*//')" >> "$out/summary.txt"
    if [ "$gpus" -lt 2 ]; then
      two=$("$test" --list 2>/dev/null | grep -c 'two_gpus.*: test$')
      [ "$two" -eq 0 ] || printf '      %d two-GPU tests not run: they need 2 GPUs, %d here\n' "$two" "$gpus" >> "$out/summary.txt"
    fi
    [ "$rc" -eq 0 ] || status=1
  done
fi

# One benchmark: `hybridgen train --format json` and its summary's figures.
bench() {
  local name=$1 ranks=$2
  shift 2
  if [ "$gpus" -lt "$ranks" ]; then
    printf 'bench %-22s skipped: needs %d GPUs, %d here\n' "$name" "$ranks" "$gpus" >> "$out/summary.txt"
    return
  fi
  "$here/hybridgen" train --device cuda --ranks "$ranks" --format json "$@" > "$out/bench-$name.jsonl" 2> "$out/bench-$name.err"
  local rc=$?
  local line
  line=$(grep '"summary"' "$out/bench-$name.jsonl" | tail -1)
  if [ "$rc" -ne 0 ] || [ -z "$line" ]; then
    printf 'bench %-22s FAILED (exit %d): %s\n' "$name" "$rc" "$(tail -c 300 "$out/bench-$name.jsonl" "$out/bench-$name.err" | tr '\n' ' ')" >> "$out/summary.txt"
    status=1
    return
  fi
  field() { echo "$line" | grep -o "\"$1\":[^,}]*" | head -1 | cut -d: -f2; }
  # Steady state: the median step time after the first step (which also
  # compiles kernels, sizes the arenas and warms cuBLAS).
  local step_ms
  step_ms=$(grep '"step":' "$out/bench-$name.jsonl" | grep -o '"step_ms":[0-9.e+-]*' | tail -n +2 \
    | cut -d: -f2 | sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print 0 }')
  awk -v n="$name" -v r="$ranks" -v ms="$step_ms" -v tokens="$(field tokens)" -v steps="$(field steps)" \
    -v hid="$(field hidden_fraction)" -v loss="$(field final_loss)" 'BEGIN {
      per_step = steps > 0 ? tokens / steps : 0
      tps = ms > 0 ? per_step / (ms / 1000) / r : 0
      printf "bench %-22s %d GPU  step %9.1f ms  %9.0f tokens/s/GPU  comm hidden %5.1f%%  loss %.3f\n",
        n, r, ms, tps, 100 * hid, loss }' >> "$out/summary.txt"
}

# Both launch modes compute the same bits: the run of one process driving
# every GPU, and the same run as one process per GPU started the way
# torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).
launch_modes() {
  local ranks=$1 common=(train --device cuda --format json --steps 3 --micro-batches 3
    --micro-batch-size 2 --seq-len 32 --pattern '[M*E][M*E]/*E')
  if [ "$gpus" -lt "$ranks" ]; then
    printf 'check launch modes, %d GPU%-6s skipped: needs %d GPUs, %d here\n' "$ranks" "" "$ranks" "$gpus" >> "$out/summary.txt"
    return
  fi
  "$here/hybridgen" "${common[@]}" --ranks "$ranks" > "$out/launch-single-$ranks.jsonl" 2>&1
  local r pids=()
  for ((r = 0; r < ranks; r++)); do
    RANK=$r WORLD_SIZE=$ranks LOCAL_RANK=$r LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$((29500 + ranks)) "$here/hybridgen" "${common[@]}" --ranks "$ranks" \
      > "$out/launch-proc-$ranks-$r.jsonl" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  local hashes
  hashes=$(cat "$out/launch-single-$ranks.jsonl" "$out"/launch-proc-$ranks-*.jsonl \
    | grep -o '"param_hash":"[0-9a-f]*"' | sort | uniq -c)
  if [ "$(echo "$hashes" | wc -l)" -eq 1 ] && [ "$(echo "$hashes" | awk '{print $1}')" -eq $((ranks + 1)) ]; then
    printf 'check launch modes, %d GPU%-6s same bits: %s\n' "$ranks" "" "$(echo "$hashes" | awk '{print $2}')" >> "$out/summary.txt"
  else
    printf 'check launch modes, %d GPU%-6s FAILED: %s\n' "$ranks" "" "$(echo "$hashes" | tr '\n' ' ')" >> "$out/summary.txt"
    status=1
  fi
}

# Where a step's time goes on one GPU: the benchmark model's trace summed
# by layer piece (scripts/trace_breakdown.py), and a kernel table from
# Nsight Systems where the machine has it.
# The run both look at: the benchmark model on one GPU (SCHEDULE picks the
# schedule; EXTRA adds flags, e.g. EXTRA="--dependent-launch off"; MODEL
# replaces the model's flags, e.g. the 9B's first 29 layers: MODEL="--preset
# nemotron-nano-9b-v2 --pattern M-M-M-MM-M-M-M*-M-M-M*-M-M-M- --seq-len 4096"
# SCHEDULE=plain). Globbing is off while the words are split, so a
# pattern's `*` stays as typed.
set -f
# shellcheck disable=SC2206 # EXTRA and MODEL are word lists
profile_args=(train --device cuda --ranks 1 --ep 1 --format json ${MODEL:---preset bench-hybrid-moe}
  --micro-batch-size 1 --lr 3e-4 --warmup 4 --schedule "${SCHEDULE:-plain}" ${EXTRA:-})
set +f
profile() {
  local args=("${profile_args[@]}")
  "$here/hybridgen" "${args[@]}" --micro-batches 4 --steps 4 --trace "$out/profile-trace.json" > "$out/profile.jsonl" 2>&1
  python3 "$here/trace_breakdown.py" "$out/profile-trace.json" > "$out/profile-breakdown.txt" 2>&1
  rm -f "$out/profile-trace.json"
  # Per-kernel GPU time: Nsight Systems over 2 steps where the machine has
  # it, else Nsight Compute timing one pass of each kernel of one
  # micro-batch's step (it serialises and replays every launch: slow).
  if command -v nsys >/dev/null 2>&1; then
    nsys profile -o "$out/profile" --force-overwrite true --stats=false \
      "$here/hybridgen" "${args[@]}" --micro-batches 4 --steps 2 > /dev/null 2>&1
    nsys stats --report cuda_gpu_kern_sum --format csv "$out/profile.nsys-rep" \
      > "$out/profile-kernels.csv" 2>&1
    rm -f "$out/profile.nsys-rep" "$out/profile.sqlite"
  elif command -v ncu >/dev/null 2>&1; then
    timeout 400 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel --csv \
      "$here/hybridgen" "${args[@]}" --micro-batches 1 --steps 1 > "$out/profile-kernels.csv" \
      2> "$out/profile-ncu.err"
    python3 "$here/kernel_table.py" "$out/profile-kernels.csv" > "$out/profile-kernels.txt" 2>&1
  else
    echo "no nsys or ncu on this machine" > "$out/profile-kernels.csv"
  fi
  printf 'profile written: profile-breakdown.txt, profile-kernels.txt\n' >> "$out/summary.txt"
}

# A GPU timeline of the same run (CUPTI: every kernel and CUDA call), and
# where the GPU sat idle in its last step, and why (timeline-gaps.txt).
timeline() {
  if [ ! -f "$here/libcupti_timeline.so" ]; then
    echo "timeline: this bundle has no libcupti_timeline.so (see cuda_bundle.sh)" | tee -a "$out/summary.txt"
    return
  fi
  local args=("${profile_args[@]}")
  LD_LIBRARY_PATH="$here:$LD_LIBRARY_PATH" CUDA_INJECTION64_PATH="$here/libcupti_timeline.so" \
    TIMELINE_OUT="$out/timeline.csv" \
    "$here/hybridgen" "${args[@]}" --micro-batches 4 --steps 3 > "$out/timeline.jsonl" 2>&1
  python3 "$here/timeline_gaps.py" "$out/timeline.csv" > "$out/timeline-gaps.txt" 2>&1
  gzip -f "$out/timeline.csv"
  printf 'timeline written: timeline-gaps.txt, timeline.csv.gz\n' >> "$out/summary.txt"
}

# Every kernel of one step against its floor (bytes at the memory's
# bandwidth, tensor-core operations at their peak), by family then by
# kernel: Nsight Compute replays each kernel of a step of
# ROOFLINE_MICRO_BATCHES micro-batches (default 1) of the profile's run
# and scripts/kernel_roofline.py tallies them (roofline.txt). A ncu without
# the tensor-core counter gets the bytes alone.
roofline() {
  if ! command -v ncu >/dev/null 2>&1; then
    echo "roofline: no ncu on this machine" | tee -a "$out/summary.txt"
    return
  fi
  local args=("${profile_args[@]}" --micro-batches "${ROOFLINE_MICRO_BATCHES:-1}" --steps 1)
  local bytes=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  for metrics in "$bytes,sm__ops_path_tensor_src_bf16_dst_fp32.sum" "$bytes"; do
    timeout 900 ncu --clock-control none --csv --page raw --metrics "$metrics" \
      "$here/hybridgen" "${args[@]}" > "$out/roofline.csv" 2> "$out/roofline-ncu.err"
    grep -q '"Kernel Name"' "$out/roofline.csv" && break
  done
  python3 "$here/kernel_roofline.py" "$out/roofline.csv" --gpu "$gpu" > "$out/roofline.txt" 2>&1
  gzip -f "$out/roofline.csv"
  printf 'roofline written: roofline.txt, roofline.csv.gz\n' >> "$out/summary.txt"
}

if [ "$what" = profile ]; then
  profile
fi
if [ "$what" = roofline ]; then
  roofline
fi
if [ "$what" = timeline ]; then
  timeline
fi

if [ "$what" = all ] || [ "$what" = tests ] || [ "$what" = launch ]; then
  launch_modes 1
  launch_modes 2
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  # A learning rate this width trains at (the tiny model's 3e-3 diverges).
  realistic=(--model "$here/models/hybrid-2048.toml" --micro-batch-size 1 --micro-batches 4
    --steps 8 --lr 3e-4 --warmup 4)
  for schedule in overlap plain; do
    bench "default-$schedule" 1 --ep 1 --schedule "$schedule"
    bench "default-$schedule" 2 --ep 2 --schedule "$schedule"
    bench "hybrid2048-$schedule" 1 --ep 1 --schedule "$schedule" "${realistic[@]}"
    bench "hybrid2048-$schedule" 2 --ep 2 --schedule "$schedule" "${realistic[@]}"
  done
fi

cat "$out/nvidia-smi.txt"
for log in "$out"/*.log; do
  [ -e "$log" ] || continue
  echo "== $(basename "$log"): failures"
  grep -E -A3 'FAIL|panicked|skipped' "$log" | head -40
done
cat "$out/summary.txt"
exit $status
RUN
chmod +x "$bundle/run.sh"
du -sh "$bundle"
