#!/usr/bin/env bash
# Downloads flash-linear-attention's wheels (pure Python and Triton, no
# dependencies fetched) into gpu-bundle/wheels/, for a GPU machine without
# internet: scripts/bench_delta_fla.py installs them there from the bundle
# (`pip install --no-deps --no-index gpu-bundle/wheels/*.whl`). PyTorch and
# Triton are expected on that machine already. scripts/cuda_bundle.sh runs
# it (after starting gpu-bundle/ afresh).
#
#   scripts/fla_wheels.sh            # the latest release
#   FLA_VERSION=0.4.1 scripts/fla_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest=gpu-bundle/wheels
mkdir -p "$dest"
spec() {
  if [ -n "${FLA_VERSION:-}" ]; then echo "$1==$FLA_VERSION"; else echo "$1"; fi
}
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  -d "$dest" "$(spec flash-linear-attention)" "$(spec fla-core)"
ls -1 "$dest"
