#!/usr/bin/env bash
# Builds the CUDA test binaries here (no GPU or CUDA needed: CUDA, NVRTC,
# cuBLAS and NCCL load at run time) and collects them, stripped, into
# gpu-bundle/ with run.sh, which runs them on a GPU machine (no cargo there)
# and prints a short summary last:
#
#   scripts/cuda_bundle.sh            # here: build and collect
#   bash gpu-bundle/run.sh LOGDIR     # there: run, logs into LOGDIR
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle/bin"

tests=(cuda_kernels_run cuda_probe cuda_nccl)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo test --release --no-run -p hybridgen-runtime "${args[@]}" --message-format=json \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do
  cp "$exe" "$bundle/bin/$name"
  strip "$bundle/bin/$name"
done

cat > "$bundle/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs every CUDA test binary of this bundle; logs go to $1 (default
# ./logs). NVLink multicast stays off (shared GPUs).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export HYBRIDGEN_CUDA_INCLUDE="${HYBRIDGEN_CUDA_INCLUDE:-/usr/local/cuda/include}"
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
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > "$out/nvidia-smi.txt" 2>&1
status=0
: > "$out/summary.txt"
for test in "$here"/bin/*; do
  name=$(basename "$test")
  start=$(date +%s%N)
  "$test" --nocapture --test-threads=1 > "$out/$name.log" 2>&1
  rc=$?
  end=$(date +%s%N)
  printf '%-20s exit %d  %d ms  %s\n' "$name" "$rc" "$(( (end - start) / 1000000 ))" \
    "$(grep -E '^test result:|^skipped:' "$out/$name.log" | tail -1)" >> "$out/summary.txt"
  [ "$rc" -eq 0 ] || status=1
done
cat "$out/nvidia-smi.txt"
for log in "$out"/*.log; do
  echo "== $(basename "$log"): first lines, failures, totals"
  grep -E '^(cuda:|sm_|compute_|driver|no usable|skipped)' "$log" | head -8
  grep -E 'FAIL|panicked|passed, [0-9]+ failed' "$log" | head -40
done
cat "$out/summary.txt"
exit $status
RUN
chmod +x "$bundle/run.sh"
du -sh "$bundle"
ls -l "$bundle/bin"
