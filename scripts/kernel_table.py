#!/usr/bin/env python3
"""GPU time per kernel from Nsight Compute's per-kernel summary.

    ncu --metrics gpu__time_duration.sum --print-summary per-kernel --csv \
        hybridgen train ... > kernels.csv
    python3 scripts/kernel_table.py kernels.csv [TOP]

Groups the rows by kernel name (a name launched with several grid shapes
has a row per shape), multiplies each row's invocations by its average
duration, and prints the names by total time, with their share of all
kernel time: where a step's GPU time goes, kernel by kernel. Lines that are
not CSV rows of that summary (the program's own output, ncu's notes) are
skipped.
"""
import csv
import sys
from collections import defaultdict


def number(text):
    return float(text.replace(",", ""))


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: kernel_table.py NCU_SUMMARY.csv [TOP]")
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(sys.argv[1], newline="") as f:
        lines = [line for line in f if line.startswith('"') or line.startswith("Process ID")]
    header, total, calls = None, defaultdict(float), defaultdict(int)
    for row in csv.reader(lines):
        if "Kernel Name" in row:
            header = row
            continue
        if header is None or len(row) != len(header):
            continue
        r = dict(zip(header, row))
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}.get(
            r.get("Metric Unit", "ns"), 1e-6)
        n = int(number(r["Invocations"]))
        total[r["Kernel Name"]] += n * number(r["Average"]) * scale
        calls[r["Kernel Name"]] += n
    if not total:
        sys.exit(f"{sys.argv[1]}: no per-kernel gpu__time_duration.sum rows")
    everything = sum(total.values())
    print(f"{everything:10.2f} ms of kernel time, {sum(calls.values())} launches")
    print(f"{'ms':>10} {'share':>6} {'calls':>6}  kernel")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{ms:10.2f} {100 * ms / everything:5.1f}% {calls[name]:6d}  {name[:90]}")


if __name__ == "__main__":
    main()
