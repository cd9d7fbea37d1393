#!/usr/bin/env bash
# The README's `cargo check` figure: how long `cargo check` takes for a crate
# that declares both Nemotron presets with `hybridgen::model!`, once its
# dependencies are checked (the edit-check loop of a user of the macro).
#
#   scripts/cargo_check_figure.sh [RUNS]     # default 5 runs
#
# Builds a throwaway crate under target/cargo-check-figure/ (its own target
# directory, with the workspace's Cargo.lock and toolchain), checks it once
# to check the dependencies, then RUNS times touches its lib.rs and times
# `cargo check`: the macro expands both models again each time. Prints every
# run, the best and the median, with the machine's core count and load.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
runs=${1:-5}
case "$runs" in
  '' | *[!0-9]* | 0) echo "usage: $0 [RUNS]  (RUNS: a whole number of at least 1)" >&2; exit 2 ;;
esac

crate="$repo/target/cargo-check-figure"
mkdir -p "$crate/src"
# `[workspace]`: a package of its own, not a member the root would refuse.
cat > "$crate/Cargo.toml.tmp" <<EOF
[package]
name = "cargo-check-figure"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
hybridgen = { path = "$repo" }

[workspace]
EOF
mv "$crate/Cargo.toml.tmp" "$crate/Cargo.toml"
cat > "$crate/src/lib.rs.tmp" <<'EOF'
hybridgen::model! {
    /// Nemotron Nano 9B v2.
    pub struct NemotronNano9bV2 {
        preset: "nemotron-nano-9b-v2",
    }
}

hybridgen::model! {
    /// Nemotron 3 Nano 30B-A3B, experts over 8 ranks.
    pub struct Nemotron3Nano30bA3b {
        preset: "nemotron-3-nano-30b-a3b",
        ep: 8,
    }
}
EOF
mv "$crate/src/lib.rs.tmp" "$crate/src/lib.rs"
cp "$repo/Cargo.lock" "$crate/Cargo.lock"
# rust-toolchain.toml is found by walking up from the crate: the repo's pin.

export CARGO_TARGET_DIR="$crate/target"
echo "checking the dependencies once (not timed)..." >&2
(cd "$crate" && cargo check --quiet)

times=()
for run in $(seq 1 "$runs"); do
  touch "$crate/src/lib.rs"
  start=$(date +%s.%N)
  (cd "$crate" && cargo check --quiet)
  end=$(date +%s.%N)
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')
  times+=("$seconds")
  printf 'run %d: %.2f s\n' "$run" "$seconds"
done

sorted=$(printf '%s\n' "${times[@]}" | sort -g)
best=$(echo "$sorted" | head -n 1)
median=$(echo "$sorted" | sed -n "$(((runs + 1) / 2))p")
printf 'cargo check, both Nemotron presets via model!: best %.2f s, median %.2f s of %d runs (%s cores, load average %s)\n' \
  "$best" "$median" "$runs" "$(nproc)" "$(cut -d' ' -f1-3 /proc/loadavg)"
