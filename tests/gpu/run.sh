#!/usr/bin/env bash
# run.sh — the CUDA backend checks, run on the GPU machine from the
# repository root.  Builds nothing: the binaries come packed in .carry/ by
#   tools/gpu-pack.sh BUILDDIR tests/test_ops_gpu tests/test_forward_gpu \
#       tools/mkmodel/dsv4-mkmodel
# and the device tool carries .carry along (carry [".carry"]).
#
#   1. test_ops_gpu: every op on both backends, fresh random inputs (SEED,
#      default the clock), per-op bounds (tests/gpu/test_ops_gpu.c);
#   2. test_forward_gpu on the `tiny` checkpoint (dsv4-mkmodel --preset tiny
#      --seed 3): prefill + STEPS (256) greedy decode steps, two sequences;
#   3. with MEMCHECK=1, compute-sanitizer memcheck and racecheck on the op
#      tests.
#   4. test_decode_gpu long on the tiny checkpoint: five sequences of mixed
#      lengths, STEPS_LONG (1000) decode steps, CPU vs CUDA with decode graphs
#      vs CUDA without (graph replay bit-identical to plain steps);
#   5. test_decode_gpu synth: synthetic weights vs the loaded tiny checkpoint
#      (layout, value statistics), then the `flash` widths with 4 layers built
#      on the GPU (prefill, decode timing at batch 16 and 1, graph == plain);
#   6. the rank daemons on the CUDA backend: the rank smoke test (test
#      scheduler, prefill + decode ranks, tokens vs the CPU forward) with
#      --backend cuda, and dsv4-decode --synthetic-weights start-up with
#      its STATUS= lines.
#   7. optional, when tests/bench_fast is packed: the fast decode kernels
#      against the exact ones and their speed (tests/gpu/bench_fast.c), log
#      in $OUT/fast.log; a numerical failure there fails the script.
# Binaries for 4-6: tests/test_decode_gpu tests/test_rank_smoke
#   daemons/rank/dsv4-prefill daemons/rank/dsv4-decode.  SKIP_OPS=1 skips 1.
# Logs go to $OUT (default /tmp/out); the summary table is printed last.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.carry/lib PATH=$PWD/.carry/bin:$PATH
OUT=${OUT:-/tmp/out}
SEED=${SEED:-$(date +%s)}
STEPS=${STEPS:-256}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

if [ "${SKIP_OPS:-0}" = 1 ]; then
    echo "ok skipped" > "$OUT/ops.log"; ops_rc=0
else
    timeout 200 test_ops_gpu "$SEED" > "$OUT/ops.log" 2>&1
    ops_rc=$?
fi
grep -E "^(FAIL|==)" "$OUT/ops.log"
tail -1 "$OUT/ops.log"

dsv4-mkmodel --preset tiny --seed 3 --out /tmp/ck_tiny > /dev/null || exit 1
timeout 300 test_forward_gpu /tmp/ck_tiny "$STEPS" 48 > "$OUT/forward.log" 2>&1
fwd_rc=$?

rest_rc=0
if command -v test_decode_gpu > /dev/null; then
    timeout 200 test_decode_gpu long /tmp/ck_tiny "${STEPS_LONG:-1000}" > "$OUT/long.log" 2>&1 ||
        rest_rc=1
    timeout 200 test_decode_gpu synth /tmp/ck_tiny 4 32 > "$OUT/synth.log" 2>&1 || rest_rc=1
    # rank daemons with --backend cuda (appended: getopt_long permutes)
    mkdir -p /tmp/cudabin
    for r in prefill decode; do
        printf '#!/bin/sh\nexec %s "$@" --backend cuda\n' "$(command -v dsv4-$r)" \
            > /tmp/cudabin/dsv4-$r
        chmod +x /tmp/cudabin/dsv4-$r
    done
    dsv4-mkmodel --preset tiny --seed 5 --out /tmp/ck_tiny5 > /dev/null
    timeout 200 test_rank_smoke /tmp/ck_tiny5 /tmp/cudabin/dsv4-prefill /tmp/cudabin/dsv4-decode \
        > "$OUT/rank.log" 2>&1
    rank_rc=$?
    [ $rank_rc = 0 ] || rest_rc=1
    # synthetic-weights start-up of a decode rank, STATUS= captured
    python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind("/tmp/dsv4-notify.sock")
s.settimeout(120)
with open(sys.argv[1], "w") as f:
    while True:
        try: d = s.recv(4096)
        except Exception: break
        f.write(d.decode() + "\n"); f.flush()
' "$OUT/notify.log" &
    npid=$!
    sleep 1
    NOTIFY_SOCKET=/tmp/dsv4-notify.sock timeout 120 dsv4-decode -f /dev/null --backend cuda \
        --synthetic-weights 3 --preset flash --set num_hidden_layers=4 \
        --set 'compress_ratios=[0,0,4,128,0]' --max-seq 4096 --slots 16 \
        --sched ipc:///tmp/dsv4-nosched.sock -v > "$OUT/rank_synth.log" 2>&1 &
    dpid=$!
    for i in $(seq 1 110); do
        grep -q " up (" "$OUT/rank_synth.log" && break
        kill -0 $dpid 2> /dev/null || break
        sleep 1
    done
    grep -q " up (" "$OUT/rank_synth.log" && synth_up=yes || { synth_up=NO; rest_rc=1; }
    kill $dpid 2> /dev/null; wait $dpid 2> /dev/null
    kill $npid 2> /dev/null
fi

mc_rc=skipped
if [ "${MEMCHECK:-0}" = 1 ]; then
    timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 test_ops_gpu "$SEED" \
        > "$OUT/memcheck.log" 2>&1
    mc_rc=$?
    timeout 240 compute-sanitizer --tool racecheck --error-exitcode 3 test_ops_gpu "$SEED" \
        > "$OUT/racecheck.log" 2>&1
    rc_rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL" "$OUT/memcheck.log" "$OUT/racecheck.log" \
        | tail -6
    mc_rc="memcheck exit $mc_rc, racecheck exit $rc_rc"
    [ "$rc_rc" = 0 ] || mc_rc="$mc_rc FAIL"
fi

fast_rc=skipped
if command -v bench_fast > /dev/null; then
    timeout 300 bench_fast > "$OUT/fast.log" 2>&1
    fast_rc=$?
fi

echo
echo "command: SEED=$SEED STEPS=$STEPS MEMCHECK=${MEMCHECK:-0} tests/gpu/run.sh"
echo "op checks (seed $SEED): $(grep -c '^ok' "$OUT/ops.log") ok, $(grep -c '^FAIL' "$OUT/ops.log") failed (exit $ops_rc); memcheck: $mc_rc"
cat "$OUT/forward.log"
if command -v test_decode_gpu > /dev/null; then
    echo
    cat "$OUT/long.log" | grep -vE "^   step" | tail -4
    grep -cE "^   step" "$OUT/long.log" | sed 's/^/long: detail lines (token differences): /'
    cat "$OUT/synth.log"
    echo "rank smoke with --backend cuda: exit $rank_rc; $(tail -1 "$OUT/rank.log")"
    echo "dsv4-decode --synthetic-weights (flash, 4 layers) up: $synth_up"
    grep -E "synthetic|up \(" "$OUT/rank_synth.log" | tail -3
    grep STATUS "$OUT/notify.log" | tail -4
fi
if [ "$fast_rc" != skipped ]; then
    echo "bench_fast (fast decode kernels): exit $fast_rc"
    grep -E "^(FAIL|summary|bench_fast)" "$OUT/fast.log"
fi
[ "$fast_rc" = skipped ] || [ "$fast_rc" = 0 ] || exit 1
[ "$ops_rc" = 0 ] && [ "$fwd_rc" = 0 ] && [ "$rest_rc" = 0 ] && { [ "$mc_rc" = skipped ] ||
    [ "$mc_rc" = "memcheck exit 0, racecheck exit 0" ]; }
