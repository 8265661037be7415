#!/usr/bin/env bash
# ab_step.sh — the decode step of two builds (or of two settings of one
# build) in turn, in one call on the GPU machine: the comparison every
# same-bits change in docs/perf.md rests on.  A call after an idle gap may
# land on another machine whose step differs by a few percent, so compare
# only within one call.
#
#   tests/gpu/ab_step.sh A_BIN B_BIN [LAYERS] [BATCHES] [PAIRS]
#
# A_BIN, B_BIN: test_decode_gpu binaries (packed with tools/gpu-pack.sh; the
# previous build's copied in beside).  For a switch, give one binary twice
# and the settings in AB_ENV_A / AB_ENV_B (e.g. AB_ENV_B="DSV4_CUDA_X=0":
# space-separated NAME=VALUE words).  LAYERS: default 20; BATCHES: default
# "1 16"; PAIRS: default 4.  The environment passes through (set
# DSV4_CUDA_KERNELS=fast, LD_LIBRARY_PATH, NCCL_NVLS_ENABLE=0 first).
#
# For each batch: both sides' logits digests (`test_decode_gpu profile
# LAYERS B`: the last graphed step's), then PAIRS rounds of A then B, each
# the graphed step with GPU sampling in ms, and each side's mean and
# minimum.  Exit status: 0; 1 when a run printed no figure or the digests
# differ (AB_SAME=0: digests only reported, for changes of rounding);
# 2 on bad use.
set -uo pipefail

if [ $# -lt 2 ] || [ ! -x "$1" ] || [ ! -x "$2" ]; then
    echo "usage: ab_step.sh A_BIN B_BIN [LAYERS] [BATCHES] [PAIRS] (binaries executable)" >&2
    exit 2
fi
a_bin=$1 b_bin=$2 layers=${3:-20} batches=${4:-1 16} pairs=${5:-4}
case "$layers$pairs" in *[!0-9]*|'') echo "ab_step.sh: LAYERS and PAIRS are numbers" >&2; exit 2;; esac
read -r -a env_a <<<"${AB_ENV_A:-}"
read -r -a env_b <<<"${AB_ENV_B:-}"
status=0

# run SIDE B: one `profile` run of side A or B; prints "DIGEST MS" (- for a
# figure the output lacked)
run() {
    local bin=$a_bin out dig ms
    local -a env=("${env_a[@]}")
    if [ "$1" = B ]; then bin=$b_bin env=("${env_b[@]}"); fi
    out=$(env "${env[@]}" timeout 300 "$bin" profile "$layers" "$2" 2>&1)
    dig=$(grep -oE 'logits digest [0-9a-f]+' <<<"$out" | tail -1 | awk '{print $3}')
    ms=$(grep -oE 'GPU sampling [0-9.]+ ms' <<<"$out" | tail -1 | awk '{print $3}')
    echo "${dig:--} ${ms:--}"
}

# stats "MS MS ...": mean and minimum
stats() {
    awk '{ s = 0; m = $1; for (i = 1; i <= NF; i++) { s += $i; if ($i < m) m = $i }
           printf "mean %.3f ms, min %.2f ms", s / NF, m }' <<<"$1"
}

echo "ab_step: A = $a_bin ${AB_ENV_A:-}; B = $b_bin ${AB_ENV_B:-}; $layers layers, $pairs pairs"
for b in $batches; do
    read -r da _ <<<"$(run A "$b")"
    read -r db _ <<<"$(run B "$b")"
    if [ "$da" = - ] || [ "$db" = - ]; then
        echo "batch $b: no digest from A ($da) or B ($db)"
        status=1
        continue
    fi
    same=same
    if [ "$da" != "$db" ]; then
        same=DIFFERENT
        [ "${AB_SAME:-1}" = 0 ] || status=1
    fi
    echo "batch $b: digests A $da, B $db ($same)"
    msa="" msb=""
    for ((i = 1; i <= pairs; i++)); do
        read -r _ ma <<<"$(run A "$b")"
        read -r _ mb <<<"$(run B "$b")"
        echo "batch $b pair $i: A $ma ms, B $mb ms"
        if [ "$ma" = - ] || [ "$mb" = - ]; then
            status=1
            continue
        fi
        msa="$msa $ma" msb="$msb $mb"
    done
    if [ -n "$msa" ]; then
        echo "batch $b: A $(stats "$msa"); B $(stats "$msb")"
    fi
done
exit $status
