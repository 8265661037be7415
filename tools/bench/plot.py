#!/usr/bin/env python3
"""plot.py — draw dsv4-bench results (tools/bench/; schema: docs/perf.md).

  plot.py -o OUT.png RESULT.json [RESULT.json ...]    ("-" reads stdin)
  plot.py --check      exit 0 when a plot can be made (matplotlib is there)

One PNG with four panels against concurrency: aggregate output tok/s, and
the p50/p90/p99 of TTFT, inter-token latency and end-to-end latency.  Each
input file is one series (its "label", else its file name); a file holding
a sweep gives one point per concurrency level.

Needs matplotlib (Debian: python3-matplotlib).  When the python3 first on
PATH lacks it, the script re-runs itself with /usr/bin/python3.
"""
import argparse
import json
import os
import sys

try:
    import matplotlib
except ImportError:
    if (os.path.exists("/usr/bin/python3") and
            os.path.realpath(sys.executable) != os.path.realpath("/usr/bin/python3") and
            not os.environ.get("DSV4_PLOT_REEXEC")):
        os.environ["DSV4_PLOT_REEXEC"] = "1"
        os.execv("/usr/bin/python3", ["/usr/bin/python3", os.path.abspath(__file__)] +
                 sys.argv[1:])
    sys.exit("plot.py: matplotlib is not installed (apt-get install python3-matplotlib)")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if sys.argv[1:] == ["--check"]:
    sys.exit(0)

PCTS = (("p50", "-"), ("p90", "--"), ("p99", ":"))
PANELS = (("ttft_ms", "time to first token (ms)"),
          ("itl_ms", "inter-token latency (ms)"),
          ("e2e_ms", "end-to-end latency (ms)"))


def load(path):
    if path == "-":
        doc = json.load(sys.stdin)
        name = "stdin"
    else:
        with open(path) as f:
            doc = json.load(f)
        name = os.path.splitext(os.path.basename(path))[0]
    if doc.get("tool") != "dsv4-bench" or not isinstance(doc.get("runs"), list):
        sys.exit("plot.py: %s is not a dsv4-bench result" % path)
    runs = sorted(doc["runs"], key=lambda r: r["concurrency"])
    return doc.get("label") or name, doc, runs


def main():
    ap = argparse.ArgumentParser(description="plot dsv4-bench results")
    ap.add_argument("-o", "--out", required=True, help="PNG to write")
    ap.add_argument("results", nargs="+", help="dsv4-bench JSON files ('-' = stdin)")
    args = ap.parse_args()
    series = [load(p) for p in args.results]

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax_tp = axes[0][0]
    levels = set()
    for i, (label, doc, runs) in enumerate(series):
        color = "C%d" % (i % 10)
        xs = [r["concurrency"] for r in runs]
        levels.update(xs)
        ax_tp.plot(xs, [r["output_tok_s"] for r in runs], "o-", color=color, label=label)
        for ax, (key, _) in zip((axes[0][1], axes[1][0], axes[1][1]), PANELS):
            for pct, style in PCTS:
                pts = [(r["concurrency"], r[key][pct]) for r in runs
                       if r[key].get(pct) is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".",
                            color=color, label="%s %s" % (label, pct))
    ax_tp.set_ylabel("output tokens/s (aggregate)")
    ax_tp.set_title("throughput")
    for ax, (_, title) in zip((axes[0][1], axes[1][0], axes[1][1]), PANELS):
        ax.set_ylabel(title)
        ax.set_title(title.split(" (")[0])
    ticks = sorted(levels)
    for ax in (ax_tp, axes[0][1], axes[1][0], axes[1][1]):
        if len(ticks) > 1 and ticks[-1] / ticks[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.set_xlabel("concurrency (closed-loop clients)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    cfg = series[0][1].get("config", {})
    fig.suptitle("dsv4-bench: prompt %s, output %s tokens; %s" %
                 (cfg.get("prompt_len", "?"), cfg.get("output_len", "?"),
                  series[0][1].get("date", "")))
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
