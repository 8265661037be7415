#!/usr/bin/env bash
# coverage.sh — line coverage of the CPU build's code by the test suites:
# a build with gcc's --coverage and CUDA off (nvcc objects carry no
# counters), every meson test, then a per-file table from gcovr (Debian's
# package: installed here when missing, like tools/setup.sh's packages),
# the tests themselves left out.
#
#   tools/coverage.sh [BUILDDIR]        default build-cov
#
# Writes BUILDDIR/coverage.txt (the table: lines, covered, percent, the
# missed line numbers) and BUILDDIR/coverage.html (per-line detail), and
# prints the table's total and its twenty least covered files.  A run
# takes about as long as one pass of tools/test.sh.  Not part of CI and no
# threshold: the table is a map of what no test reaches (its first run
# found dsv4-tokenize's --bench overflowing on pipes and dsv4-gateway -n
# passing any listen address).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-cov}

tools/setup.sh >/dev/null
if ! command -v gcovr >/dev/null; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "coverage: installing gcovr"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcovr >/dev/null
fi
if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" -Db_coverage=true -Dcuda=disabled >"$dir.setup.log" 2>&1 ||
        { cat "$dir.setup.log"; exit 1; }
fi
ninja -C "$dir" >/dev/null
find "$dir" -name '*.gcda' -delete   # counts of this run only
status=0
meson test -C "$dir" --num-processes "$(nproc)" >"$dir/coverage-tests.log" 2>&1 || status=$?
tail -8 "$dir/coverage-tests.log" | grep -E '^(Ok|Fail|Skipped|Timeout):' || true
[ $status -eq 0 ] || echo "coverage: some tests failed (see $dir/coverage-tests.log); counting anyway"
# (options of Debian 12's gcovr 5.2)
gcovr -r . "$dir" --exclude 'tests/' --exclude "$dir/" --gcov-ignore-parse-errors \
    --txt "$dir/coverage.txt" --html-details "$dir/coverage.html" >/dev/null
grep -E '^TOTAL' "$dir/coverage.txt"
echo "least covered (file, lines, covered, percent):"
awk '$4 ~ /%$/ && $1 != "TOTAL" { p = $4; sub(/%$/, "", p); print p, $1, $2, $3 }' \
    "$dir/coverage.txt" | sort -n | head -20 |
    awk '{ printf "  %-40s %6s %6s %5s%%\n", $2, $3, $4, $1 }'
echo "coverage: $dir/coverage.txt, $dir/coverage.html"
