#!/usr/bin/env bash
# analyze.sh — clang's static analyzer (scan-build, Debian's clang-tools)
# over the CPU build: every C file of the tree, CUDA off (nvcc sources are
# not analysed), then one line a report: file:line, the checker's message.
#
#   tools/analyze.sh [BUILDDIR]         default build-analyze
#
# The HTML reports (each with its path) stay under BUILDDIR/meson-logs/
# scanbuild/.  For one file's path as text:
#   clang --analyze -Xanalyzer -analyzer-output=text <its flags from
#   BUILDDIR/compile_commands.json> FILE
# Not part of CI (about six minutes on two cores) and no threshold: known
# false positives remain (the sys/queue.h TAILQ loops, whose head's
# tqe_prev the analyzer does not follow; tests whose cmocka assertions it
# does not take as the end of a path).  common/err.h shows it what
# dsv4_err_set returns.  Its first run (session 57) found a crash on a
# malformed checkpoint index (7dc37aa).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-analyze}

tools/setup.sh >/dev/null
if ! command -v scan-build >/dev/null; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "analyze: installing clang-tools"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clang-tools >/dev/null
fi
if [ ! -f "$dir/build.ninja" ]; then
    CC=clang meson setup "$dir" -Dcuda=disabled >"$dir.setup.log" 2>&1 ||
        { cat "$dir.setup.log"; exit 1; }
fi
rm -rf "$dir/meson-logs/scanbuild"
ninja -C "$dir" scan-build >"$dir/analyze.log" 2>&1 || { tail -30 "$dir/analyze.log"; exit 1; }
for r in "$dir"/meson-logs/scanbuild/*/report-*.html; do
    [ -e "$r" ] || continue
    file=$(sed -n 's/^<!-- BUGFILE \(.*\) -->$/\1/p' "$r")
    line=$(sed -n 's/^<!-- BUGLINE \(.*\) -->$/\1/p' "$r")
    desc=$(sed -n 's/^<!-- BUGDESC \(.*\) -->$/\1/p' "$r")
    printf '%s:%s: %s\n' "${file##*"$PWD"/}" "$line" "$desc"
done | sort
echo "analyze: $(ls "$dir"/meson-logs/scanbuild/*/report-*.html 2>/dev/null | wc -l) reports" \
    "(HTML under $dir/meson-logs/scanbuild/)"
