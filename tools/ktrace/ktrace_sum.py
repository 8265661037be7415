#!/usr/bin/env python3
"""ktrace_sum.py — per-kernel cost of the steps of a ktrace timeline
(tools/ktrace/ktrace.c).

A step is the run of kernels from one embed_kernel to the next (a decode
step of the forward).  Steps of exactly --kernels kernels on --device (and,
with --with NAME, holding a kernel whose mangled name contains NAME: the
batch-16 and batch-1 steps of test_tp_gpu have the same count, only the
former runs fm5_kernel) are selected, the first --skip of them dropped and
the next --steps kept.  Each
kernel is charged the time from the end of the kernel before it to its own
end (with programmatic dependent launch a kernel starts before its
predecessor ends, so start-to-end times overlap); the sums by kernel name
(demangled with c++filt when present) are printed per step.

--chain prints instead the kernels of the first selected step in launch
order, each with the time charged to it (a layer's chain of small kernels).

usage: ktrace_sum.py TRACE [--device D] [--kernels N] [--with NAME] [--skip S] [--steps K]
                     [--chain]
"""
import argparse
import re
import shutil
import subprocess


def demangle(names):
    if shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                         text=True).stdout.split("\n")
    return {n: re.sub(r"^void ", "", re.sub(r"\(.*", "", d)) for n, d in zip(names, out)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--kernels", type=int, default=0, help="kernels per step (0: any)")
    ap.add_argument("--with", dest="with_name", default=None,
                    help="only steps holding a kernel whose name contains this")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--chain", action="store_true",
                    help="the first selected step's kernels in order, each with its time")
    a = ap.parse_args()
    rows = []
    with open(a.trace) as f:
        for line in f:
            p = line.split()
            if len(p) >= 7 and int(p[0]) == a.device:
                rows.append((int(p[2]), int(p[3]), p[6]))
    rows.sort()
    starts = [i for i, r in enumerate(rows) if "embed_kernel" in r[2]] + [len(rows)]
    steps = [(s, e) for s, e in zip(starts, starts[1:]) if a.kernels in (0, e - s) and
             (a.with_name is None or any(a.with_name in r[2] for r in rows[s:e]))]
    steps = steps[a.skip:a.skip + a.steps]
    if not steps:
        print("no step of that shape")
        return
    names = demangle(sorted({r[2] for s, e in steps for r in rows[s:e]}))
    if a.chain:
        s, e = steps[0]
        prev = rows[s][0]
        print(f"step of {e - s} kernels, {(rows[e - 1][1] - rows[s][0]) / 1e3:.1f} us")
        print("| # | kernel | us |")
        print("|---|---|---|")
        for i, (t0, t1, n) in enumerate(rows[s:e]):
            print(f"| {i} | {names[n]} | {(t1 - prev) / 1e3:.2f} |")
            prev = t1
        return
    agg, span = {}, 0.0
    for s, e in steps:
        prev = rows[s][0]
        span += (rows[e - 1][1] - rows[s][0]) / 1e3
        for t0, t1, n in rows[s:e]:
            k = names[n]
            c = agg.setdefault(k, [0, 0.0])
            c[0] += 1
            c[1] += (t1 - prev) / 1e3
            prev = t1
    ns = len(steps)
    print(f"{ns} steps of {steps[0][1] - steps[0][0]} kernels, {span / ns:.1f} us per step")
    print("| kernel | per step | us per step | us each |")
    print("|---|---|---|---|")
    for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"| {k} | {n / ns:g} | {us / ns:.1f} | {us / n:.2f} |")


if __name__ == "__main__":
    main()
