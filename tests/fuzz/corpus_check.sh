#!/bin/sh
# corpus_check.sh TEST_PROTO CORPUS_DIR — the committed fuzz seeds
# (tests/fuzz/corpus/{cli,rank,ctl}; tok/ is hand-written) are exactly what `test_proto
# --write-corpus` writes from today's samples: a message added or changed in
# tests/ipc/samples.c without its seed fails here.  Refresh with
#   test_proto --write-corpus tests/fuzz/corpus
# (after removing the old seeds when a sample was renamed or dropped).
set -eu
proto=$1
corpus=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/cli" "$tmp/rank" "$tmp/ctl"
"$proto" --write-corpus "$tmp"
st=0
for d in cli rank ctl; do
    diff -r "$tmp/$d" "$corpus/$d" || st=1
done
if [ $st -ne 0 ]; then
    echo "corpus_check: the seeds in $corpus are not today's samples' encodings"
    echo "corpus_check: refresh them with: $proto --write-corpus $corpus"
    exit 1
fi
echo "corpus_check: $(find "$tmp" -type f | wc -l) seeds match the samples"
