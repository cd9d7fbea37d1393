#!/usr/bin/env python3
"""Each kernel family's time against its own floor, from Nsight Compute.

    ncu --clock-control none --csv --page raw --metrics \
        gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__ops_path_tensor_src_bf16_dst_fp32.sum \
        hybridgen train ... > roofline.csv
    python3 scripts/kernel_roofline.py roofline.csv --gpu "NVIDIA H100 80GB HBM3" [--top N]

A kernel's floor is the longer of two times: the bytes it moved to and
from device memory at the memory's bandwidth, and the bf16 tensor-core
operations it ran (`sm__ops_path_tensor_src_bf16_dst_fp32`, taken as
FLOPs) at the tensor cores' dense peak, where the file has that counter.
Its time over the floor is
what a faster kernel could win at most. The families are those of
`timeline_gaps.py` (one rule for both reports); each family's floor is the
sum of its kernels' floors, so a family of GEMMs and a family of memory
passes are each measured against what bounds them. Families and then
kernels print by time over the floor, largest first: the levers in order.

Nsight Compute serialises the kernels and replays each one, so a kernel's
time here is its own, without the overlap of the run, and the bytes are
what it alone moved. `--gpu` takes the peaks from the GPU's name (H100 SXM:
3.35 TB/s, H200: 4.8 TB/s; both 989 TFLOP/s of dense bf16); `--hbm` and
`--tensor` set them by hand. Rows that are not the raw page's (the
program's own output, ncu's notes) are skipped.
"""
import argparse
import csv
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline_gaps import activity_kind as family  # noqa: E402  (one family rule for both reports)

TIME = "gpu__time_duration.sum"
READ = "dram__bytes_read.sum"
WRITE = "dram__bytes_write.sum"
TENSOR = "sm__ops_path_tensor_src_bf16_dst_fp32.sum"

# Peaks by a substring of the GPU's name: (HBM TB/s, dense bf16 TFLOP/s).
PEAKS = [("H200", (4.8, 989.0)), ("H100", (3.35, 989.0))]

UNIT_SCALE = {
    # to nanoseconds
    "nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9,
    # to bytes
    "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
    "KB": 1e3, "MB": 1e6, "GB": 1e9,
    "": 1.0,
}


def number(text):
    text = text.strip().replace(",", "")
    return float(text) if text and text != "n/a" else 0.0


def read_rows(path):
    """The raw page's kernel rows as dicts of scaled numbers: time in ns,
    bytes in bytes, tensor operations as counted."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    reader = csv.reader(lines)
    header, units = None, None
    rows = []
    for row in reader:
        if header is None:
            if "Kernel Name" in row and TIME in row:
                header = row
            continue
        if units is None:
            units = row
            continue
        if len(row) != len(header):
            continue
        r = dict(zip(header, row))
        u = dict(zip(header, units))
        kernel = {"name": r["Kernel Name"].split("(")[0].strip()}
        for metric in (TIME, READ, WRITE, TENSOR):
            if metric in r:
                unit = u.get(metric, "")
                if unit not in UNIT_SCALE:
                    sys.exit(f"{path}: unknown unit `{unit}` of {metric}")
                kernel[metric] = number(r[metric]) * UNIT_SCALE[unit]
        rows.append(kernel)
    if header is None:
        sys.exit(f"{path}: no raw-page header with `Kernel Name` and {TIME} (ncu --csv --page raw --metrics {TIME},...)")
    return rows, TENSOR in header


def peaks(args):
    hbm, tensor = args.hbm, args.tensor
    if args.gpu:
        for key, (h, t) in PEAKS:
            if key in args.gpu:
                hbm = hbm or h
                tensor = tensor or t
                break
    if not hbm or not tensor:
        sys.exit("the peaks are unknown: give --gpu NAME (H100 or H200) or both --hbm TB/s and --tensor TFLOP/s")
    return hbm, tensor


class Tally:
    def __init__(self):
        self.calls = 0
        self.ns = 0.0
        self.bytes = 0.0
        self.ops = 0.0
        self.floor_ns = 0.0

    def add(self, k, hbm, tensor):
        moved = k.get(READ, 0.0) + k.get(WRITE, 0.0)
        ops = k.get(TENSOR, 0.0)
        self.calls += 1
        self.ns += k[TIME]
        self.bytes += moved
        self.ops += ops
        # 1 TB/s moves 1e3 bytes a nanosecond; 1 TFLOP/s, 1e3 operations.
        self.floor_ns += max(moved / (hbm * 1e3), ops / (tensor * 1e3))

    def line(self, label, steps, has_tensor):
        ms = self.ns / 1e6 / steps
        floor = self.floor_ns / 1e6 / steps
        tbs = self.bytes / self.ns / 1e3 if self.ns else 0.0
        cells = [f"{ms:9.2f}", f"{floor:9.2f}", f"{ms - floor:9.2f}", f"{self.calls / steps:7.0f}",
                 f"{self.bytes / 1e9 / steps:8.2f}", f"{tbs:6.2f}"]
        if has_tensor:
            tflops = self.ops / self.ns / 1e3 if self.ns else 0.0
            cells += [f"{self.ops / 1e12 / steps:7.2f}", f"{tflops:7.0f}"]
        return " ".join(cells) + f"  {label}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--gpu", help="the GPU's name, as nvidia-smi prints it")
    p.add_argument("--hbm", type=float, help="device memory bandwidth, TB/s")
    p.add_argument("--tensor", type=float, help="dense bf16 tensor-core peak, TFLOP/s")
    p.add_argument("--steps", type=float, default=1.0, help="divide every total by this (the run's steps)")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    args = p.parse_args()
    hbm, tensor = peaks(args)
    rows, has_tensor = read_rows(args.csv)
    rows = [k for k in rows if TIME in k]
    if not rows:
        sys.exit(f"{args.csv}: no kernel rows")
    families, kernels, total = defaultdict(Tally), defaultdict(Tally), Tally()
    for k in rows:
        families[family(k["name"])].add(k, hbm, tensor)
        kernels[k["name"]].add(k, hbm, tensor)
        total.add(k, hbm, tensor)
    head = f"{'ms':>9} {'floor':>9} {'over':>9} {'calls':>7} {'GB':>8} {'TB/s':>6}"
    if has_tensor:
        head += f" {'TFLOP':>7} {'TFLOP/s':>7}"
    print(f"peaks: {hbm} TB/s device memory, {tensor} TFLOP/s dense bf16; "
          f"a floor is the longer of bytes/bandwidth and tensor operations/peak"
          + ("" if has_tensor else " (no tensor counter in the file: bytes only)"))
    print(f"\nby family, per step (over: time above the floor)\n{head}  family")
    for name, t in sorted(families.items(), key=lambda kv: -(kv[1].ns - kv[1].floor_ns)):
        print(t.line(name, args.steps, has_tensor))
    print(total.line("all kernels", args.steps, has_tensor))
    print(f"\nby kernel, the {args.top} furthest over their floors\n{head}  kernel")
    for name, t in sorted(kernels.items(), key=lambda kv: -(kv[1].ns - kv[1].floor_ns))[: args.top]:
        print(t.line(name[:80], args.steps, has_tensor))


if __name__ == "__main__":
    main()
