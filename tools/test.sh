#!/usr/bin/env bash
# test.sh — the project's test command (README): install dependencies, build,
# run every test suite, then run them again in an ASan+UBSan build.  Ends with
# one line "N passed, N failed" (totals over both builds).
#
#   tools/test.sh            everything
#   tools/test.sh --quick    normal build only (no sanitizer pass)
set -uo pipefail
cd "$(dirname "$0")/.."

quick=0
case "$#:${1:-}" in
0:) ;;
1:--quick) quick=1 ;;
*)  echo "usage: tools/test.sh [--quick]  (everything; --quick: no sanitizer pass)" >&2
    exit 2 ;;
esac

tools/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

jobs=$(nproc)
passed=0
failed=0
skipped=0

# run_suite BUILDDIR [meson setup args...]
run_suite() {
    local dir=$1; shift
    if [ ! -f "$dir/build.ninja" ]; then
        # nvcc with header dependencies (tools/nvcc-deps.sh)
        local native
        mapfile -t native < <(tools/nvcc-deps.sh --native-args "$dir.nvcc.ini")
        meson setup "${native[@]}" "$dir" "$@" >"$dir.setup.log" 2>&1 || { cat "$dir.setup.log"; failed=$((failed + 1)); return; }
    fi
    if ! ninja -C "$dir" -j "$jobs" >"$dir.build.log" 2>&1; then
        tail -50 "$dir.build.log"
        echo "test.sh: build failed in $dir"
        failed=$((failed + 1))
        return
    fi
    local json="$dir/meson-logs/testlog.json"
    local p f s rc
    rm -f "$json"
    meson test -C "$dir" --num-processes "$jobs" --print-errorlogs
    rc=$?
    if [ ! -s "$json" ]; then
        echo "test.sh: $dir: meson test left no log (exit $rc)"
        failed=$((failed + 1))
        return
    fi
    p=$(grep -c '"result": "OK"' "$json" || true)
    f=$(grep -cE '"result": "(FAIL|TIMEOUT|ERROR|UNEXPECTEDPASS)"' "$json" || true)
    s=$(grep -c '"result": "SKIP"' "$json" || true)
    if [ "$rc" -ne 0 ] && [ "${f:-0}" -eq 0 ]; then
        echo "test.sh: $dir: meson test exited $rc with no failed test in its log"
        f=1
    fi
    # skipped tests (no GPU, no network for the oracles, ...) are neither
    echo "test.sh: $dir: ${p:-0} passed, ${f:-0} failed, ${s:-0} skipped"
    passed=$((passed + ${p:-0}))
    failed=$((failed + ${f:-0}))
    skipped=$((skipped + ${s:-0}))
}

run_suite build-test
if [ $quick -eq 0 ]; then
    # ASan + UBSan; CUDA off (nvcc objects are not instrumented and the CUDA
    # code is compiled and linked by the first build).
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        run_suite build-asan -Db_sanitize=address,undefined -Dcuda=disabled -Db_lundef=false
fi

echo "test.sh: $skipped skipped (not counted)"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
