#!/usr/bin/env bash
# profile.sh — per-kernel GPU times of one decode step (docs/perf.md,
# "Per-kernel breakdown"), on the GPU machine from the repository root with
# the binaries packed in .carry/ (tools/gpu-pack.sh BUILD tests/test_decode_gpu).
#
#   tests/gpu/profile.sh LAYERS BATCH KERNELS OUTFILE
#
# Runs `test_decode_gpu profile LAYERS BATCH` (flash widths cut to LAYERS
# layers, synthetic weights; KERNELS exact|fast) under Nsight Compute, which
# times every kernel of the one decode step between cudaProfilerStart/Stop
# (each kernel replayed alone: the sum is the step's GPU time without launch
# gaps).  OUTFILE gets ncu's CSV (one row per kernel launch, metric
# gpu__time_duration.sum in ns); tests/gpu/profile_sum.py groups it by op.
set -euo pipefail
export LD_LIBRARY_PATH=$PWD/.carry/lib PATH=$PWD/.carry/bin:$PATH
layers=$1 batch=$2 kernels=$3 out=$4
DSV4_CUDA_KERNELS=$kernels ncu --profile-from-start off --metrics gpu__time_duration.sum \
    --csv --print-units base test_decode_gpu profile "$layers" "$batch" > "$out"
grep -E "^\| profile" "$out" || true
