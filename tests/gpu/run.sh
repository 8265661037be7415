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
# Logs go to $OUT (default /tmp/out); the summary table is printed last.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.carry/lib PATH=$PWD/.carry/bin:$PATH
OUT=${OUT:-/tmp/out}
SEED=${SEED:-$(date +%s)}
STEPS=${STEPS:-256}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

timeout 200 test_ops_gpu "$SEED" > "$OUT/ops.log" 2>&1
ops_rc=$?
grep -E "^(FAIL|==)" "$OUT/ops.log"
tail -1 "$OUT/ops.log"

dsv4-mkmodel --preset tiny --seed 3 --out /tmp/ck_tiny > /dev/null || exit 1
timeout 300 test_forward_gpu /tmp/ck_tiny "$STEPS" 48 > "$OUT/forward.log" 2>&1
fwd_rc=$?

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

echo
echo "command: SEED=$SEED STEPS=$STEPS MEMCHECK=${MEMCHECK:-0} tests/gpu/run.sh"
echo "op checks (seed $SEED): $(grep -c '^ok' "$OUT/ops.log") ok, $(grep -c '^FAIL' "$OUT/ops.log") failed (exit $ops_rc); memcheck: $mc_rc"
cat "$OUT/forward.log"
[ "$ops_rc" = 0 ] && [ "$fwd_rc" = 0 ] && { [ "$mc_rc" = skipped ] ||
    [ "$mc_rc" = "memcheck exit 0, racecheck exit 0" ]; }
