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
    cp "$build/$b" .carry/bin/
    ldd "$build/$b" | awk '/=> \//{print $3}' | { grep -vE "$skip" || true; } | while read -r lib; do
        cp -L "$lib" .carry/lib/
    done
done
du -sh .carry
