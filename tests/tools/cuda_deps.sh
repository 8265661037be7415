#!/bin/sh
# cuda_deps.sh BUILDDIR OBJECT HEADER — the build knows that a CUDA object
# depends on a header it includes (tools/nvcc-deps.sh; without it a header
# change rebuilt no CUDA object and an incremental build could link objects
# of two struct layouts).  Exit 0 when `ninja -t deps` lists HEADER for OBJECT.
build=$1 obj=$2 hdr=$3
deps=$(ninja -C "$build" -t deps "$obj" 2>&1)
if printf '%s\n' "$deps" | grep -q -- "$hdr"; then
    echo "ok: $obj depends on $hdr"
    exit 0
fi
echo "FAIL: ninja records no dependency of $obj on $hdr (set it up with tools/nvcc-deps.sh --native-args, see that script):"
printf '%s\n' "$deps" | head -5
exit 1
