#!/usr/bin/env bash
# gpu-pack.sh — copy built binaries and the shared libraries the GPU machine
# lacks (json-c, ZeroMQ, msgpack-c, cmocka, ...) into .carry/ (git-ignored),
# which the device tool carries along.  On the GPU machine:
#   export LD_LIBRARY_PATH=$PWD/.carry/lib PATH=$PWD/.carry/bin:$PATH
#
# usage: tools/gpu-pack.sh [--xz] BUILDDIR [binary-path-inside-builddir | /abs/path ...]
#        tools/gpu-pack.sh --unpack          (on the GPU machine)
#
# --xz: strip the binaries and pack bin/ and lib/ into .carry/pack.tar.xz.
# The device tool carries at most 64 MiB; each CUDA binary is ~10 MB
# stripped, so six of them with their libraries do not fit unpacked, and
# xz makes them ~6x smaller (70 MB -> 11 MB).  On the GPU machine
# `tools/gpu-pack.sh --unpack` (tar and xz are in its base system) puts
# bin/ and lib/ back; it does nothing without a pack.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --unpack ]; then
    [ -f .carry/pack.tar.xz ] || exit 0
    tar -xJf .carry/pack.tar.xz -C .carry
    exit 0
fi
xz=0
if [ "${1:-}" = --xz ]; then xz=1; shift; fi
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
    echo "usage: tools/gpu-pack.sh [--xz] BUILDDIR [binary ...] | --unpack" >&2
    exit 2
fi
build=$1; shift
# a build whose CUDA objects have no header dependencies may link objects of
# two struct layouts (tools/nvcc-deps.sh; docs/perf.md run 38): refuse it
obj=kernels/libdsv4kernels.a.p/cuda_cuda_share.cu.o
if [ -f "$build/$obj" ] && ! tests/tools/cuda_deps.sh "$build" "$obj" common/weights.h >/dev/null; then
    echo "gpu-pack.sh: $build was configured without tools/nvcc-deps.sh (CUDA objects may be" \
         "stale); set it up again with tools/nvcc-deps.sh --native-args" >&2
    exit 1
fi
rm -rf .carry && mkdir -p .carry/bin .carry/lib
# libraries present on the GPU machine (Ubuntu 24.04 base + CUDA): not carried
skip='linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libgcc_s|libstdc\+\+|libcuda\.so|libcudart|libcublas|libnccl'
for b in "$@"; do
    # an absolute path (e.g. the previous build's test_decode_gpu, renamed
    # for tests/gpu/ab_step.sh) is taken as it is, not from BUILDDIR
    case $b in /*) ;; *) b=$build/$b;; esac
    cp "$b" .carry/bin/
    ldd "$b" | awk '/=> \//{print $3}' | { grep -vE "$skip" || true; } | while read -r lib; do
        cp -L "$lib" .carry/lib/
    done
done
if [ $xz = 1 ]; then
    strip .carry/bin/*
    tar -cf - -C .carry bin lib | xz -T0 -6 > .carry/pack.tar.xz
    rm -rf .carry/bin .carry/lib
fi
du -sh .carry
