#!/usr/bin/env bash
# dry_run.sh — the GPU machine's measuring scripts (tests/gpu/targets.sh and
# the tests/gpu/service.sh it drives) on the CPU backend with the tiny
# checkpoint, so CI keeps them working between GPU sessions (meson test
# `gpu-scripts-dry`).
#
#   tests/gpu/dry_run.sh BUILDDIR
#
# The scripts take their binaries from .carry/bin under the directory they
# run in (tools/gpu-pack.sh on the GPU machine): here a scratch copy of
# tests/gpu gets a .carry/bin of links to BUILDDIR's binaries, so a
# developer's own .carry/ is never used.  Small sizes (64-token prompts, 16
# output tokens), MTP on in the second set, kill -9 of the decode rank under
# C=16.  Passes when targets.sh exits 0 (every measured request done and the
# three service figures present) and its table has every row: the figures
# are the CPU's and mean nothing.  Then service.sh's KILL_SCHED=1: kill -9
# of dsv4-sched under load, where no request may fail and some must have
# been resumed.
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d /tmp/dsv4dry.XXXX)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/tests/gpu" "$tmp/tools" "$tmp/.carry/bin" "$tmp/.carry/lib"
cp "$src/tests/gpu/service.sh" "$src/tests/gpu/targets.sh" "$tmp/tests/gpu/"
cp "$src/tools/gpu-pack.sh" "$tmp/tools/"   # service.sh's --unpack (no pack here)
for b in tools/launch/dsv4-launch daemons/sched/dsv4-sched daemons/rank/dsv4-prefill \
         daemons/rank/dsv4-decode tools/bench/dsv4-bench tools/dsv4ctl/dsv4ctl \
         tools/mkmodel/dsv4-mkmodel; do
    [ -x "$build/$b" ] || { echo "dry_run.sh: $build/$b not built"; exit 1; }
    ln -s "$build/$b" "$tmp/.carry/bin/"
done
BACKEND=cpu LAYERS=2 GPUS=1 MTP=1 OUT="$tmp/out" TTFT_PROMPT=64 ITL_PROMPT=32 ITL_OUT=16 \
    C16_PROMPT=64 C16_OUT=16 N_C1=2 N_C16=16 KILL_BENCH="-c 16 -p 32 -l 64 -n 32" \
    bash "$tmp/tests/gpu/targets.sh" > "$tmp/targets.log" 2>&1 ||
    { cat "$tmp/targets.log"; echo "dry_run.sh: targets.sh failed"; exit 1; }
md=$tmp/out/targets.md
cat "$md"
for row in "C=16, 64/16: output tok/s" "C=1 ITL p50" "TTFT p50" "handoff" \
           "kill -9 of a decode rank" "MTP: C=1 output tok/s" "MTP: acceptance"; do
    grep -qF "| $row" "$md" || { echo "dry_run.sh: no row '$row'"; exit 1; }
done
# nothing lost under the kill, and the figures are numbers
grep -qE "^\| kill -9 .*; [0-9]+ done, 0 failed \|" "$md" ||
    { echo "dry_run.sh: requests lost under the kill"; exit 1; }
grep -qE "^\| C=1 ITL p50 .*\| [0-9.]+ ms \|" "$md" ||
    { echo "dry_run.sh: no C=1 ITL"; exit 1; }
# the burst prefill rank (BURST=1, targets.sh's default) took the prompts
# of the idle service (the C=1 runs), the plain one the rest
grep -qE "^Prompts placed per prefill rank .*prefill@0 [1-9][0-9]*, prefill@1 [1-9][0-9]* \(burst\)" "$md" ||
    { echo "dry_run.sh: the burst prefill rank took no prompt"; exit 1; }
# kill -9 of the scheduler under load (KILL_SCHED=1): the clients resume
# (service.sh runs from the repository root: the scratch copy's)
(cd "$tmp" && BACKEND=cpu LAYERS=2 GPUS=1 MPS=0 OUT="$tmp/ksched" \
    BENCH="-c 1 -p 8 -l 4 -n 1 -w 0" TOKENS="--token-range 10:1000" KILL=1 KILL_SCHED=1 \
    KILL_AFTER=1 KILL_BENCH="-c 8 -p 16 -l 256 -n 32" \
    bash tests/gpu/service.sh) > "$tmp/ksched.log" 2>&1 ||
    { cat "$tmp/ksched.log"; echo "dry_run.sh: service.sh KILL_SCHED=1 failed"; exit 1; }
sed -n '/^kill -9/,/^bench under/p' "$tmp/ksched.log"
for want in "kill -9 to every rank registered again" "bench under the kill: exit 0"; do
    grep -qF "$want" "$tmp/ksched.log" ||
        { cat "$tmp/ksched.log"; echo "dry_run.sh: KILL_SCHED=1: no '$want'"; exit 1; }
done
grep -qE "^requests resumed \(the scheduler's log\): [1-9]" "$tmp/ksched.log" ||
    { cat "$tmp/ksched.log"; echo "dry_run.sh: KILL_SCHED=1: no request was resumed"; exit 1; }
echo "dry_run.sh: ok"
