#!/usr/bin/env python3
"""Where the GPU waits: reads the CSV that scripts/cupti_timeline.c writes
and reports, over the last whole training step (between the last two groups
of `adam_update` kernels), how busy the GPU was, its idle gaps, and what the
host thread that launched the work after each gap did in the meantime:
CUDA calls (by name) or its own code between calls; then the idle time by
the pair of activities around each gap (what ended last, what came next),
which finds the same wait repeated at every layer. Then start-up: from
the first CUDA call to the first step's first kernel (`embedding_forward`),
the CUDA calls that took the time, per thread.

    python3 timeline_gaps.py timeline.csv [--gap-us 5] [--top 25]
"""
import argparse
import bisect
import collections
import csv
import sys


def load(path):
    gpu, api = [], {}
    by_thread = collections.defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if len(row) < 6:
                continue
            kind, start, end, where, corr = row[0], int(row[1]), int(row[2]), int(row[3]), int(row[4])
            name = ",".join(row[5:])
            if kind in "KCS":
                label = name if kind == "K" else {"C": "memcpy", "S": "memset"}[kind] + f" {name} B"
                gpu.append((start, end, where, corr, label))
            else:
                call = (start, end, where, corr, name)
                api[corr] = call
                by_thread[where].append(call)
    gpu.sort()
    for calls in by_thread.values():
        calls.sort()
    return gpu, api, by_thread


def step_window(gpu):
    """From the end of the second-to-last group of optimizer kernels to the
    end of the last: one whole step."""
    ends = [e for s, e, _, _, n in gpu if "adam_update" in n or "sgd_update" in n]
    groups = []
    for e in ends:
        if groups and e - groups[-1][-1] < 20_000_000:
            groups[-1].append(e)
        else:
            groups.append([e])
    if len(groups) < 2:
        sys.exit("timeline_gaps: fewer than two optimizer steps in the timeline; run 3 or more steps")
    return groups[-2][-1], groups[-1][-1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--gap-us", type=float, default=5.0, help="smallest idle gap listed (µs)")
    p.add_argument("--top", type=int, default=25, help="gaps listed, largest first")
    a = p.parse_args()
    gpu, api, by_thread = load(a.csv)
    lo, hi = step_window(gpu)
    inside = [g for g in gpu if g[0] >= lo and g[1] <= hi]

    # Busy time: the union of every activity's interval.
    # Each gap also notes the activity that ended last before it.
    busy, gaps, cursor, last = 0, [], lo, "-"
    kernel_time, kernel_calls = collections.Counter(), collections.Counter()
    between = collections.Counter()
    between_n = collections.Counter()
    for i, (s, e, _, corr, name) in enumerate(inside):
        kernel_time[name] += e - s
        kernel_calls[name] += 1
        if s > cursor:
            gaps.append((s - cursor, cursor, i))
            pair = (last[:40], name[:40])
            between[pair] += s - cursor
            between_n[pair] += 1
        busy += max(0, e - max(s, cursor))
        if e > cursor:
            cursor, last = e, name
    span = hi - lo
    print(f"one step: {span / 1e6:.1f} ms, GPU busy {busy / 1e6:.1f} ms ({100 * busy / span:.1f}%), "
          f"{len(inside)} GPU activities, idle {(span - busy) / 1e6:.1f} ms in {len(gaps)} gaps")

    # Each gap: the host thread that launched the next activity, and what it
    # did between the gap's start and that launch.
    blame = collections.Counter()
    listed = []
    for width, start, i in gaps:
        corr = inside[i][3]
        launch = api.get(corr)
        if launch is None:
            blame["(launch not recorded)"] += width
            continue
        calls = by_thread[launch[2]]
        first = bisect.bisect_left(calls, (start,)) - 1
        in_api = collections.Counter()
        for s, e, _, _, name in calls[max(first, 0):]:
            if s >= launch[0]:
                break
            overlap = min(e, launch[0]) - max(s, start)
            if overlap > 0:
                in_api[name] += overlap
        host = max(0, (launch[0] - start) - sum(in_api.values()))
        late = max(0, launch[0] - start)
        # Share the gap between the calls and the host code in proportion.
        parts = dict(in_api)
        parts["(host code between CUDA calls)"] = host
        total = sum(parts.values()) or 1
        for name, t in parts.items():
            blame[name] += width * t / total if late else 0
        if not late:
            blame["(launched before the gap: waits on the GPU)"] += width
        listed.append((width, start, i, launch, in_api, host))

    print("\nidle time by what the launching thread was doing (ms a step):")
    for name, t in blame.most_common(15):
        print(f"  {t / 1e6:8.2f}  {name}")

    print("\nidle time by the activities around it (ms a step, gaps; the one that ended last -> the next):")
    for (before, after), t in between.most_common(15):
        print(f"  {t / 1e6:8.3f} {between_n[(before, after)]:5d}  {before} -> {after}")

    print(f"\nthe {a.top} largest gaps (µs from the step's start):")
    listed.sort(reverse=True)
    for width, start, i, launch, in_api, host in listed[: a.top]:
        if width < a.gap_us * 1e3:
            break
        before = inside[i - 1][4] if i > 0 else "-"
        after = inside[i][4]
        calls = ", ".join(f"{n} {t / 1e3:.0f}" for n, t in in_api.most_common(3))
        print(f"  {width / 1e3:8.1f} µs at {(start - lo) / 1e3:9.1f}: {before[:40]} -> {after[:40]}; "
              f"host code {host / 1e3:.0f} µs; calls: {calls or '-'}")

    print("\nhost API time a step, by thread and call (ms):")
    for thread, calls in sorted(by_thread.items()):
        per = collections.Counter()
        n = collections.Counter()
        for s, e, _, _, name in calls:
            if s >= lo and e <= hi:
                per[name] += e - s
                n[name] += 1
        if per:
            top = ", ".join(f"{k} {v / 1e6:.1f} ({n[k]})" for k, v in per.most_common(6))
            print(f"  thread {thread}: {top}")

    print("\nGPU time a step by family (ms, calls):")
    kinds, calls = collections.Counter(), collections.Counter()
    for name, t in kernel_time.items():
        kinds[activity_kind(name)] += t
    for name, n in kernel_calls.items():
        calls[activity_kind(name)] += n
    for kind, t in kinds.most_common():
        print(f"  {t / 1e6:8.2f}  {kind} ({calls[kind]})")

    print("\nGPU time a step by activity (ms, calls; top 40):")
    for name, t in kernel_time.most_common(40):
        print(f"  {t / 1e6:8.2f}  {name[:90]} ({kernel_calls[name]})")

    startup(gpu, by_thread)


def activity_kind(name):
    """The family a GPU activity belongs to (the per-family table that
    docs/benchmarks.md puts against each family's roofline): hybridgen's
    grouped expert GEMMs, cuBLAS's GEMMs, then hybridgen's kernel families
    by their names' prefixes, copies and fills, and the rest."""
    if name.startswith("grouped_gemm"):
        return "grouped expert GEMMs"
    if name.startswith(("nvjet", "sm90_", "sm80_", "cutlass", "gemm", "gemv")) or "gemm" in name.lower():
        return "GEMM (cuBLAS)"
    families = [
        (("flash_",), "attention (flash)"),
        (("ssd_",), "Mamba scan"),
        (("delta_",), "gated delta rule"),
        (("dsa_",), "sparse attention"),
        (("adam_", "sgd_", "sum_squares"), "optimizer and gradient norm"),
        (("rmsnorm", "column_sum"), "norms"),
        (("unary_", "silu_mul"), "activations"),
        (("moe_", "gather_rows"), "MoE routing and permutes"),
        (("conv1d",), "conv1d"),
        (("memcpy", "memset"), "copies and fills"),
    ]
    for prefixes, family in families:
        if name.startswith(prefixes):
            return family
    return "other kernels"


def startup(gpu, by_thread):
    first_call = min((c[0] for calls in by_thread.values() for c in calls), default=None)
    first_step = next((s for s, _, _, _, n in gpu if "embedding_forward" in n), None)
    if first_call is None or first_step is None:
        return
    span = first_step - first_call
    print(f"\nstart-up: {span / 1e9:.2f} s from the first CUDA call to the first step's first kernel")
    for thread, calls in sorted(by_thread.items()):
        per, n = collections.Counter(), collections.Counter()
        for s, e, _, _, name in calls:
            if s < first_step:
                per[name] += min(e, first_step) - s
                n[name] += 1
        if not per:
            continue
        in_api = sum(per.values())
        top = ", ".join(f"{k} {v / 1e9:.2f} s ({n[k]})" for k, v in per.most_common(6))
        print(f"  thread {thread}: {in_api / 1e9:.2f} s in CUDA calls: {top}")

if __name__ == "__main__":
    main()
