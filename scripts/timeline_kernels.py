#!/usr/bin/env python3
"""GPU time per kernel from a CUPTI timeline (libcupti_timeline.so's CSV).

    LD_LIBRARY_PATH=$PWD/gpu-bundle:$LD_LIBRARY_PATH TIMELINE_OUT=tl.csv \
        CUDA_INJECTION64_PATH=$PWD/gpu-bundle/libcupti_timeline.so gpu-bundle/bench/delta_rule
    python3 scripts/timeline_kernels.py tl.csv [TOP]

Groups the kernel rows (`K,start_ns,end_ns,stream,correlation,name`) by
name and prints, largest total first, each kernel's calls, its mean time a
call and its total: kernel by kernel, where a program's GPU time goes.
"""
import sys
from collections import defaultdict


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: timeline_kernels.py TIMELINE.csv [TOP]")
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    total, calls = defaultdict(float), defaultdict(int)
    with open(sys.argv[1]) as f:
        for line in f:
            fields = line.rstrip("\n").split(",", 5)
            if len(fields) < 6 or fields[0] != "K":
                continue
            name = fields[5].split("(")[0]
            total[name] += (int(fields[2]) - int(fields[1])) / 1e6
            calls[name] += 1
    print(f"{'kernel':60} {'calls':>7} {'ms a call':>10} {'ms':>10}")
    for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name[:60]:60} {calls[name]:7d} {ms / calls[name]:10.4f} {ms:10.2f}")


if __name__ == "__main__":
    main()
