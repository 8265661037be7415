#!/bin/sh
# nvcc-deps.sh — nvcc, plus the dependency file ninja expects beside each
# object.  Meson 1.0 (Debian's) declares a depfile for CUDA objects
# (OBJECT.d) but asks nvcc for none, so a header change rebuilt no .cu
# object that includes it: an incremental build could link objects built
# against an older struct layout (docs/perf.md run 38: a rank daemon read
# struct dsv4_weights.priv at its old offset and crashed).
#
#   nvcc-deps.sh --native-args FILE   where nvcc is: write a Meson machine
#                                     file naming this script (by absolute
#                                     path: Meson 1.0 takes the CUDA compiler
#                                     from a machine file only) as the CUDA
#                                     compiler, and print the `meson setup`
#                                     arguments that use it, one a line
#                                     (--native-file, FILE); else nothing
#   meson setup $(tools/nvcc-deps.sh --native-args build.nvcc.ini) build
#
# tools/test.sh and tools/run.sh set their builds up so.  As the compiler:
# calls that compile one object (-c ... -o OBJECT) get -MD -MF OBJECT.d;
# every other call (Meson's probes, links) goes to nvcc unchanged.
if [ "${1:-}" = "--native-args" ]; then
    command -v nvcc >/dev/null || exit 0
    self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
    printf "[binaries]\ncuda = '%s'\n" "$self" > "$2" || exit 1
    printf -- "--native-file\n%s\n" "$2"
    exit
fi
out=""
compile=0
prev=""
for a in "$@"; do
    [ "$prev" = "-o" ] && out=$a
    [ "$a" = "-c" ] && compile=1
    prev=$a
done
if [ "$compile" = 1 ] && [ -n "$out" ]; then
    exec nvcc "$@" -MD -MF "$out.d"
fi
exec nvcc "$@"
