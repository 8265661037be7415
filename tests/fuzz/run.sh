#!/usr/bin/env bash
# run.sh [SECONDS] — build the protocol fuzz targets, the safetensors
# reader's (fuzz_st.c), a checkpoint index's (fuzz_ckpt.c), a checkpoint's
# config.json's (fuzz_mconf.c), the configuration reader's (fuzz_conf.c),
# the tokenizer's (fuzz_tok.c) and the gateway's request bodies'
# (fuzz_gwreq.c) with clang's libFuzzer (+ ASan + UBSan) and
# run each for SECONDS (default $FUZZ_SECONDS or 20) on a scratch copy of its
# committed seed corpus (tests/fuzz/corpus/<target>/).
# First replays every saved crash (tests/fuzz/crashes/<target>-*) as a
# regression test.  New crash inputs are written to tests/fuzz/crashes/ and
# fail the run.  Exits 77 (skipped) when clang cannot build a libFuzzer
# program on this machine.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
secs=${1:-${FUZZ_SECONDS:-20}}
cc=${FUZZ_CC:-clang}
work=$(mktemp -d /tmp/dsv4-fuzz-XXXXXX)
trap 'rm -rf "$work"' EXIT

flags=(-g -O1 -std=c11 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=undefined -I"$root")
printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' \
    >"$work/probe.c"
if ! "$cc" "${flags[@]}" "$work/probe.c" -o "$work/probe" 2>/dev/null; then
    echo "run.sh: $cc cannot build libFuzzer targets here: skip"
    exit 77
fi

export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
failed=0

# fuzz T: replay the saved crashes of target T ($work/fuzz_T), then fuzz it
# for $secs seconds from its seeds
fuzz() {
    local t=$1 bin="$work/fuzz_$1" crash
    for crash in "$here"/crashes/"$t"-*; do
        [ -e "$crash" ] || continue
        if ! "$bin" "$crash" >"$work/replay.log" 2>&1; then
            tail -30 "$work/replay.log"
            echo "run.sh: fuzz_$t: saved crash $crash still crashes"
            failed=1
        fi
    done
    mkdir -p "$work/corpus_$t"
    if ! "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 \
            -artifact_prefix="$here/crashes/$t-" "$work/corpus_$t" "$here/corpus/$t" \
            >"$work/$t.log" 2>&1; then
        tail -40 "$work/$t.log"
        echo "run.sh: fuzz_$t found a failure; input saved under tests/fuzz/crashes/"
        failed=1
    else
        echo "run.sh: fuzz_$t: $(grep -Eo 'Done [0-9]+ runs' "$work/$t.log" | tail -1) in ${secs}s, no crash"
    fi
}

n=1
for t in cli rank ctl; do
    if ! "$cc" "${flags[@]}" -DFUZZ_SUB=$n "$here/fuzz_proto.c" "$root/ipc/proto.c" \
            "$root/common/err.c" -lmsgpackc -lm -o "$work/fuzz_$t"; then
        echo "run.sh: building fuzz_$t failed"
        exit 1
    fi
    n=$((n + 1))
    fuzz $t
done

# The safetensors reader on any file (fuzz_st.c).
if ! "$cc" "${flags[@]}" "$here/fuzz_st.c" "$root/common/safetensors.c" \
        "$root/common/file_open.c" \
        "$root/common/json_keys.c" "$root/common/err.c" -ljson-c -lm -o "$work/fuzz_st"; then
    echo "run.sh: building fuzz_st failed"
    exit 1
fi
fuzz st

# A sharded checkpoint's index on any bytes, beside three valid shards
# (fuzz_ckpt.c).
if ! "$cc" "${flags[@]}" "$here/fuzz_ckpt.c" "$root/common/safetensors.c" \
        "$root/common/file_open.c" \
        "$root/common/json_keys.c" "$root/common/err.c" -ljson-c -lm -o "$work/fuzz_ckpt"; then
    echo "run.sh: building fuzz_ckpt failed"
    exit 1
fi
fuzz ckpt

# A checkpoint's config.json and the inventory it implies (fuzz_mconf.c).
if ! "$cc" "${flags[@]}" "$here/fuzz_mconf.c" "$root/common/model_config.c" \
        "$root/common/model_tensors.c" "$root/common/safetensors.c" \
        "$root/common/file_open.c" \
        "$root/common/json_keys.c" "$root/common/err.c" -ljson-c -lm -o "$work/fuzz_mconf"; then
    echo "run.sh: building fuzz_mconf failed"
    exit 1
fi
fuzz mconf

# The configuration file reader on any file (fuzz_conf.c).
if ! "$cc" "${flags[@]}" "$here/fuzz_conf.c" "$root/common/config_file.c" \
        "$root/common/err.c" -lm -o "$work/fuzz_conf"; then
    echo "run.sh: building fuzz_conf failed"
    exit 1
fi
fuzz conf

# The tokenizer on any bytes (fuzz_tok.c's properties), with the DeepSeek-V4
# tokenizer.json tools/setup.sh installs, else the tests' tiny one.
if ! "$cc" "${flags[@]}" "$here/fuzz_tok.c" "$root"/common/tokenizer.c \
        "$root"/common/tokenizer_load.c "$root"/common/tokenizer_encode.c \
        "$root"/common/tokenizer_chat.c "$root/common/err.c" -lpcre2-8 -ljson-c -lm \
        -o "$work/fuzz_tok"; then
    echo "run.sh: building fuzz_tok failed"
    exit 1
fi
tokjson=${FUZZ_TOKENIZER:-${DSV4_TOKENIZER:-/usr/local/share/dsv4/tokenizer.json}}
[ -r "$tokjson" ] || tokjson=$root/tests/tokenizer/tiny_tokenizer.json
export FUZZ_TOKENIZER=$tokjson
echo "run.sh: fuzz_tok on $tokjson"
fuzz tok

# The gateway's request bodies on both routes (fuzz_gwreq.c), with the same
# tokenizer; libdsv4client's sources for its parameter defaults.
if ! "$cc" "${flags[@]}" -I"$root/ipc" "$here/fuzz_gwreq.c" "$root/daemons/gateway/gw_req.c" \
        "$root"/common/tokenizer.c "$root"/common/tokenizer_load.c \
        "$root"/common/tokenizer_encode.c "$root"/common/tokenizer_chat.c \
        "$root/common/err.c" "$root/common/unix_sock.c" "$root/ipc/client.c" "$root/ipc/zsock.c" \
        "$root/ipc/proto.c" \
        -lpcre2-8 -ljson-c -lzmq -lmsgpackc -lm -o "$work/fuzz_gwreq"; then
    echo "run.sh: building fuzz_gwreq failed"
    exit 1
fi
fuzz gwreq
exit $failed
