#!/usr/bin/env bash
# gpu-pack.sh — copy built binaries and the shared libraries the GPU machine
# lacks (json-c, ZeroMQ, msgpack-c, cmocka, ...) into .carry/ (git-ignored),
# which the device tool carries along.  On the GPU machine:
#   export LD_LIBRARY_PATH=$PWD/.carry/lib PATH=$PWD/.carry/bin:$PATH
#
# usage: tools/gpu-pack.sh BUILDDIR [binary-path-inside-builddir ...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1; shift
rm -rf .carry && mkdir -p .carry/bin .carry/lib
# libraries present on the GPU machine (Ubuntu 24.04 base + CUDA): not carried
skip='linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libgcc_s|libstdc\+\+|libcuda\.so|libcudart|libcublas|libnccl'
for b in "$@"; do
    cp "$build/$b" .carry/bin/
    ldd "$build/$b" | awk '/=> \//{print $3}' | { grep -vE "$skip" || true; } | while read -r lib; do
        cp -L "$lib" .carry/lib/
    done
done
du -sh .carry
