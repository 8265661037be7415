#!/usr/bin/env python3
"""profile_sum.py — group Nsight Compute's per-kernel times (tests/gpu/profile.sh)
by kernel name: launches, total microseconds, share of the step.

usage: profile_sum.py NCU_CSV [NCU_CSV ...]
"""
import csv
import io
import sys


def rows(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"ID"')
    if start < 0:
        return []
    return list(csv.DictReader(io.StringIO(text[start:])))


def main():
    for path in sys.argv[1:]:
        agg = {}
        for r in rows(path):
            if r.get("Metric Name") != "gpu__time_duration.sum":
                continue
            name = r["Kernel Name"].split("(")[0].split("<")[0].strip()
            ns = float(r["Metric Value"].replace(",", ""))
            n, t = agg.get(name, (0, 0.0))
            agg[name] = (n + 1, t + ns / 1000.0)
        total = sum(t for _, t in agg.values())
        print(f"## {path}: {sum(n for n, _ in agg.values())} launches, {total:.1f} us")
        print("| kernel | launches | us | share |")
        print("|---|---|---|---|")
        for name, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"| {name} | {n} | {t:.1f} | {t / total:.1%} |")


if __name__ == "__main__":
    main()
