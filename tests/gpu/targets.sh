#!/usr/bin/env bash
# targets.sh — issue 7's "must show" figures through the service set, in one
# run, with their targets and their ratios to the bandwidth floor: the
# table docs/perf.md records.  Run on the GPU machine from the repository
# root with the binaries tests/gpu/service.sh needs packed in .carry/.
#
#   tests/gpu/targets.sh                      # 2 GPUs, all 43 layers (the issue's case)
#   LAYERS=20 GPUS=1 tests/gpu/targets.sh     # what fits one H200
#   BACKEND=cpu LAYERS=2 GPUS=1 ... tests/gpu/targets.sh   # dry run of the script, no GPU
#
# One service set (tests/gpu/service.sh: dsv4-sched, a prefill and a decode
# group of GPUS ranks, synthetic weights of flash cut to LAYERS layers,
# prefill under MPS at MPS_PREFILL% of the SMs unless MPS=0, and with
# BURST=1 (the default) a burst prefill group at BURST_MPS% (0: all SMs)
# that takes the prompts arriving while no stream decodes, and those that
# would wait for the busy plain group while a decode slot is free:
# burst_free_slots, 1 by default, BURST_FREE=N passed to service.sh), three
# dsv4-bench runs, then kill -9 of a decode rank under C=16 load (KILL=0:
# not):
#   1. C=1, TTFT_PROMPT (2,048)-token prompts, 1 output token: TTFT p50;
#   2. C=1, ITL_PROMPT (256) / ITL_OUT (256): inter-token latency p50;
#   3. C=16, C16_PROMPT (1,024) / C16_OUT (512), N_C16 (32) measured
#      requests after 16 of warm-up: aggregate output tok/s.
# With MTP=1 a second service set with mtp = yes runs 2. and 3. again and
# reports the drafts' acceptance (synthetic weights make it meaningless);
# where one GPU holds the model (GPUS=1) test_decode_gpu spec LAYERS adds
# the verify step's cost and the tok/s at assumed acceptances (run.sh step
# 13 runs it too).  Requests are greedy unless TEMP says otherwise.
#
# The floor (DESIGN.md §7, scaled to LAYERS of 43 layers and split over GPUS
# GPUs at BW TB/s each: DESIGN.md §7's measured device copy of an H200, 4.3,
# unless BW gives the machine's own, e.g. tests/gpu/copy_bw.py's figure on
# an H100): a batch-16 step reads 46.5 GB of experts and 6.7
# GB of dense weights times LAYERS / 43 plus the 1.06 GB head, a batch-1
# step 3.5 GB of experts instead (43 layers on 2 GPUs: 6.3 ms ≈ 2,550
# tok/s and 1.3 ms).  Throughput ratio = measured / floor; latency ratio =
# floor / measured.
#
# Writes $OUT/targets.md (also printed), $OUT/service/ (service.sh's
# files: bench.json, bench2.json, bench3.json, kill.json, launch.log) and
# $OUT/mtp/ with MTP=1.  Exit status: 0 when every run ended without a
# failed request (the targets themselves are reported, not enforced), 1
# otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/targets}
export LAYERS=${LAYERS:-43} GPUS=${GPUS:-2} TEMP=${TEMP:-0}
if [ "${BACKEND:-cuda}" = cuda ]; then
    export MPS=${MPS:-1}
    # measured best shares (docs/perf.md runs 36 and 53): 80% with a GPU
    # per rank pair of a 2-GPU group, 40% when one GPU holds both daemons
    if [ "$GPUS" = 1 ]; then
        export MPS_PREFILL=${MPS_PREFILL:-40}
    else
        export MPS_PREFILL=${MPS_PREFILL:-80}
    fi
else
    export MPS=0
    # the tiny checkpoint's vocabulary (1,024 ids)
    export TOKENS=${TOKENS:---token-range 10:1000}
fi
# a burst prefill group beside the plain one (docs/operations.md "Burst
# prefill"): the C=1 prompts find the GPU idle and get all of it
export BURST=${BURST:-1} BURST_MPS=${BURST_MPS:-0}
tp=${TTFT_PROMPT:-2048} ip=${ITL_PROMPT:-256} io=${ITL_OUT:-256}
cp_=${C16_PROMPT:-1024} co=${C16_OUT:-512} n1=${N_C1:-8} n16=${N_C16:-32}
rm -rf "$OUT" && mkdir -p "$OUT"
rc=0

echo "== service set: $LAYERS layers, $GPUS GPU(s) a group, backend ${BACKEND:-cuda}, MPS $MPS (prefill ${MPS_PREFILL:-all}%), burst prefill group $BURST (burst_free_slots ${BURST_FREE:-default})"
# MTP=0 here: MTP=1 in this script's environment is for the second set
OUT=$OUT/service MTP=0 BENCH="-c 1 -p $tp -l 1 -n $n1 -w 1;-c 1 -p $ip -l $io -n $n1 -w 1;-c 16 -p $cp_ -l $co -n $n16 -w 16" \
    KILL=${KILL:-1} KILL_BENCH=${KILL_BENCH:--c 16 -p 256 -l 256 -n 48} \
    bash tests/gpu/service.sh > "$OUT/service.txt" 2>&1 || rc=1
tail -25 "$OUT/service.txt"
if [ "${MTP:-0}" = 1 ]; then
    echo "== service set with mtp = yes"
    OUT=$OUT/mtp MTP=1 KILL=0 BENCH="-c 1 -p $ip -l $io -n $n1 -w 1;-c 16 -p $cp_ -l $co -n $n16 -w 16" \
        bash tests/gpu/service.sh > "$OUT/mtp.txt" 2>&1 || rc=1
    tail -8 "$OUT/mtp.txt"
    # the verify step's cost at assumed acceptances (model level; the whole
    # model on one GPU, so only where one GPU holds it)
    if [ "${BACKEND:-cuda}" = cuda ] && [ "$GPUS" = 1 ] && command -v test_decode_gpu > /dev/null; then
        DSV4_CUDA_KERNELS=fast timeout 300 test_decode_gpu spec "$LAYERS" > "$OUT/spec.log" 2>&1 ||
            rc=1
    fi
fi

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
python3 - "$OUT" "$LAYERS" "$GPUS" "${MTP:-0}" "$tp" "$ip/$io" "$cp_/$co" "${BW:-4.3}" \
    "${gpu_name:-no GPU}" << 'EOF' || rc=1
import json, os, re, sys

out, layers, gpus, mtp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
ttft_len, itl_len, c16_len = sys.argv[5], sys.argv[6], sys.argv[7]
bw, gpu_name = float(sys.argv[8]), sys.argv[9]
f = layers / 43.0
b16 = (46.5 * f + 6.7 * f + 1.06) / gpus / bw   # ms a batch-16 step (GB / TB/s)
b1 = (3.5 * f + 6.7 * f + 1.06) / gpus / bw     # ms a batch-1 step
tok_floor = 16 / b16 * 1000
failed = 0


def run(path):
    """runs[0] of a dsv4-bench JSON file, or None."""
    global failed
    try:
        r = json.load(open(path))["runs"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    failed += r["failed"]
    return r


def p50(r, key):
    return r[key]["p50"] if r is not None and r[key]["p50"] is not None else None


def text(path):
    try:
        return open(path, errors="replace").read()
    except OSError:
        return ""


rows = []
svc = os.path.join(out, "service")
r1, r2, r3 = (run(os.path.join(svc, n)) for n in ("bench.json", "bench2.json", "bench3.json"))
tok = r3["output_tok_s"] if r3 else None
ttft, itl = p50(r1, "ttft_ms"), p50(r2, "itl_ms")
fmt = lambda v, d=1: "n/a" if v is None else f"{v:,.{d}f}"
rows.append((f"C=16, {c16_len}: output tok/s", fmt(tok), "≥ 2,000",
             f"{tok_floor:,.0f} tok/s", fmt(tok / tok_floor if tok else None, 2)))
rows.append((f"C=1 ITL p50 ({itl_len})", fmt(itl, 2) + " ms", "≤ 2.5 ms", f"{b1:.2f} ms",
             fmt(b1 / itl if itl else None, 2)))
rows.append((f"TTFT p50, {ttft_len}-token prompt, C=1", fmt(ttft) + " ms", "≤ 100 ms", "—", "—"))
log = text(os.path.join(out, "service.txt"))
m = re.search(r"handoff +(\d+) measured, mean ([0-9.]+) ms", log)
# the scheduler's handoff time: PREFILL_DONE to the decode group's KV_RELEASE,
# so it includes the wait for the decode rank's next step boundary; the
# transfer itself (the <= 1 ms target at 8,192 tokens) is test_kv_cudaipc's
rows.append(("handoff, scheduler's view (PREFILL_DONE to KV_RELEASE, with the wait for a step)",
             f"{m.group(2)} ms ({m.group(1)} handoffs)" if m else "n/a",
             "transfer ≤ 1 ms at 8,192 tokens: test_kv_cudaipc (run.sh step 11)", "—", "—"))
kill = re.search(r"kill -9 to group re-formed \(serving again\): ([0-9.]+) s", log)
if kill:
    kept = re.search(r"survivor decode@0 kept its process: (.*)", log)
    kr = run(os.path.join(svc, "kill.json"))
    lost = "n/a" if kr is None else f"{kr['done']} done, {kr['failed']} failed"
    rows.append(("kill -9 of a decode rank under C=16: serving again",
                 f"{kill.group(1)} s; survivor kept: {kept.group(1) if kept else 'n/a'}; {lost}",
                 "no request lost", "—", "—"))
elif "kill -9 decode@" in log or "kill -9:" in log:
    # asked for, but no figure (the rank was not running, or the group did
    # not serve again within service.sh's wait): say so instead of a time
    why = re.search(r"kill -9(?: decode@\d+)?: (.*)", log)
    rows.append(("kill -9 of a decode rank under C=16: serving again",
                 "no figure: " + (why.group(1) if why else "see service.txt"),
                 "no request lost", "—", "—"))
if mtp:
    mt = os.path.join(out, "mtp")
    m1, m16 = run(os.path.join(mt, "bench.json")), run(os.path.join(mt, "bench2.json"))
    st = re.findall(r"mtp drafts (\d+) accepted (\d+)", text(os.path.join(mt, "notify.log")))
    acc = "n/a"
    if st:
        d, a = (int(x) for x in st[-1])
        acc = f"{a} of {d} drafts ({a / d:.2f})" if d else "no drafts"
    rows.append(("MTP: C=1 output tok/s / C=16 output tok/s",
                 f"{fmt(m1['output_tok_s'] if m1 else None)} / {fmt(m16['output_tok_s'] if m16 else None)}",
                 "reported", "—", "—"))
    rows.append(("MTP: acceptance (decode@0's last STATUS)", acc, "reported", "—", "—"))

# prompts per prefill rank (service.sh's last `dsv4ctl ranks`: PLACED)
placed = {}
for l in log.splitlines():
    pm = re.match(r"(prefill@\d+) +\d+/\d+ +\S+ +\S+ +\d+ +\d+ +(\d+) .*?( burst prefill)?$", l)
    if pm:
        placed[pm.group(1)] = pm.group(2) + (" (burst)" if pm.group(3) else "")
md = [f"# Issue 7 targets: {layers} layers, {gpus} GPU(s) a group",
      "",
      f"Floor (DESIGN.md §7 scaled to {layers}/43 layers on {gpus} GPU(s) at {bw} TB/s; "
      f"GPU: {gpu_name}): "
      f"batch 16 {b16:.2f} ms a step = {tok_floor:,.0f} tok/s, batch 1 {b1:.2f} ms.",
      f"Failed measured requests: {failed}.",
      "Prompts placed per prefill rank (the whole run): " +
      (", ".join(f"{k} {v}" for k, v in sorted(placed.items())) or "n/a") + ".",
      "",
      "| figure | measured | target | floor | ratio to floor |",
      "|---|---|---|---|---|"]
md += [f"| {' | '.join(r)} |" for r in rows]
spec = [l for l in text(os.path.join(out, "spec.log")).splitlines() if l.startswith("|")]
if spec:
    md += ["", "MTP verify step at assumed acceptances a (`test_decode_gpu spec`, model level):", ""]
    md += spec
open(os.path.join(out, "targets.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
sys.exit(1 if failed or tok is None or itl is None or ttft is None else 0)
EOF
exit $rc
