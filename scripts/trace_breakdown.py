#!/usr/bin/env python3
"""Where a step's time goes: sums a `hybridgen train --trace` file's spans.

    python3 scripts/trace_breakdown.py trace.json [--skip-steps 1] [--top 40]

Spans are grouped by lane and by name with the layer index kept (so each
layer's forward and backward pieces are rows of their own), summed over the
micro-batches and the steps after the skipped ones (the first step compiles
kernels and sizes arenas), and divided by the steps counted: milliseconds
per step. A second table sums by category (forward, backward, gather,
reduce, a2a, optimizer, ...). On GPUs the spans are GPU-timed (CUDA events
around each work item), so this is device time, not host time.
"""
import argparse
import collections
import json
import re
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--skip-steps", type=int, default=1)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    lanes = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") == args.rank:
            lanes[e["tid"]] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid") == args.rank]
    spans.sort(key=lambda e: e["ts"])
    # Steps are delimited by the optimizer's "optimizer step N" spans.
    step_ends = [e["ts"] + e["dur"] for e in spans if re.match(r"optimizer step \d+", e["name"])]
    if len(step_ends) <= args.skip_steps:
        sys.exit(f"{args.trace}: {len(step_ends)} optimizer steps, need more than --skip-steps {args.skip_steps}")
    start = step_ends[args.skip_steps - 1] if args.skip_steps else 0
    counted = len(step_ends) - args.skip_steps
    by_name = collections.defaultdict(float)
    by_category = collections.defaultdict(float)
    for e in spans:
        if e["ts"] < start:
            continue
        lane = lanes.get(e["tid"], str(e["tid"]))
        name = re.sub(r"\bmb\d+\b|micro-batch \d+", "", e["name"]).strip()
        name = re.sub(r"optimizer step \d+", "optimizer step", name)
        by_name[(lane, name)] += e["dur"] / 1000.0
        by_category[(lane, e.get("cat", "?"))] += e["dur"] / 1000.0
    wall = (step_ends[-1] - start) / 1000.0 / counted
    print(f"{args.trace}: rank {args.rank}, {counted} steps counted, {wall:.1f} ms a step (wall)")
    print(f"{'lane':<10} {'category':<12} {'ms/step':>9} {'share':>6}")
    for (lane, cat), ms in sorted(by_category.items(), key=lambda kv: -kv[1]):
        print(f"{lane:<10} {cat:<12} {ms / counted:9.2f} {100 * ms / counted / wall:5.1f}%")
    print()
    print(f"{'lane':<10} {'ms/step':>9} {'share':>6}  name")
    for (lane, name), ms in sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{lane:<10} {ms / counted:9.2f} {100 * ms / counted / wall:5.1f}%  {name}")


if __name__ == "__main__":
    main()
