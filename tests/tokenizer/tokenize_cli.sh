#!/usr/bin/env bash
# tokenize_cli.sh DSV4_TOKENIZE TOKENIZER_JSON — dsv4-tokenize on the command
# line (tools/tokenize/tokenize.c) with the tiny test tokenizer: encode and
# decode lines, --hex round trips of bytes with newlines, --special, the
# benchmark on a file and on a pipe, and a clear error and exit status for
# each kind of bad input.
set -uo pipefail
tk=$1
json=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

ok() { echo "ok   $1"; }
bad() { echo "FAIL $1: $2"; fail=1; }

# expect NAME STATUS STDERR_PATTERN -- COMMAND... (stdin from $in)
expect() {
    local name=$1 want=$2 pat=$3 st
    shift 4
    "$@" <"$in" >"$tmp/out" 2>"$tmp/err"
    st=$?
    if [ "$st" != "$want" ]; then
        bad "$name" "exit $st, expected $want; stderr: $(head -c 300 "$tmp/err")"
    elif [ -n "$pat" ] && ! grep -qE -- "$pat" "$tmp/err"; then
        bad "$name" "stderr lacks /$pat/: $(head -c 300 "$tmp/err")"
    else
        ok "$name"
    fi
}

# encode, then decode: the same lines back
printf 'hello world\nabc\n\n' >"$tmp/text"
"$tk" --tokenizer "$json" <"$tmp/text" >"$tmp/ids" || bad encode "exit $?"
# a line of ids per line of text, the empty line's empty (the first: the
# tiny tokenizer's ids, tests/tokenizer/test_tokenizer.c's vocabulary)
[ "$(wc -l <"$tmp/ids")" = 3 ] && [ "$(sed -n 1p "$tmp/ids")" = "259 262 108 100" ] &&
    [ -z "$(sed -n 3p "$tmp/ids")" ] && ok encode || bad encode "ids: $(cat "$tmp/ids")"
"$tk" --decode --tokenizer "$json" <"$tmp/ids" >"$tmp/back"
cmp -s "$tmp/back" "$tmp/text" && ok decode || bad decode "got: $(cat "$tmp/back")"

# --hex: any bytes, newlines and invalid UTF-8 included, round trip
hex=$(printf 'line one\nline two\t\xff end' | od -An -tx1 | tr -d ' \n')
hids=$("$tk" --hex --tokenizer "$json" <<<"$hex")
hback=$("$tk" --decode --hex --tokenizer "$json" <<<"$hids")
[ "$hback" = "$hex" ] && ok hex_round_trip || bad hex_round_trip "$hex -> $hids -> $hback"

# --special: an added token is one id (its id in the json) only with the flag
uid=$(python3 -c 'import json,sys; print([a["id"] for a in json.load(open(sys.argv[1]))["added_tokens"] if a["content"] == "<｜User｜>"][0])' "$json")
with=$(printf '<｜User｜>hi\n' | "$tk" --special --tokenizer "$json")
without=$(printf '<｜User｜>hi\n' | "$tk" --tokenizer "$json")
[ "${with%% *}" = "$uid" ] && [ "${without%% *}" != "$uid" ] && ok special ||
    bad special "with: $with; without: $without; id $uid"

# the benchmark: a file, and a pipe (which has no size to ask for)
printf 'hello world\0abc abc\0' >"$tmp/docs"
in=/dev/null
expect bench_file 0 '' -- "$tk" --bench "$tmp/docs" --repeat 2 --tokenizer "$json"
grep -qE '^.*: 20 bytes, [0-9]+ tokens, 2 runs, ' "$tmp/out" && ok bench_file_line ||
    bad bench_file_line "$(cat "$tmp/out")"
in=$tmp/docs
expect bench_pipe 0 '' -- sh -c 'cat | "$0" --bench /dev/stdin --repeat 1 --tokenizer "$1"' "$tk" "$json"
grep -qE '^/dev/stdin: 20 bytes, [0-9]+ tokens, 1 runs, ' "$tmp/out" && ok bench_pipe_line ||
    bad bench_pipe_line "$(cat "$tmp/out")"

# bad input: a message and the documented exit status
printf '12 x4\n' >"$tmp/badids"
in=$tmp/badids
expect decode_bad_id 1 'bad id' -- "$tk" --decode --tokenizer "$json"
printf 'abc\n' >"$tmp/badhex"
in=$tmp/badhex
expect encode_bad_hex 1 'bad hex line' -- "$tk" --hex --tokenizer "$json"
in=/dev/null
expect no_tokenizer 1 'dsv4-tokenize: ' -- "$tk" --tokenizer "$tmp/nonexistent.json"
expect bench_no_file 1 'nonexistent' -- "$tk" --bench "$tmp/nonexistent" --tokenizer "$json"
expect repeat_not_number 2 'repeat wants a count' -- "$tk" --bench "$tmp/docs" --repeat abc
expect repeat_zero 2 'repeat wants a count' -- "$tk" --bench "$tmp/docs" --repeat 0
expect repeat_overflow 2 'repeat wants a count' -- "$tk" --bench "$tmp/docs" --repeat 99999999999999999999
expect unknown_option 2 'usage' -- "$tk" --frobnicate
expect stray_argument 2 'usage' -- "$tk" --tokenizer "$json" extra
# an option outside its mode is a usage fault (it was silently ignored)
expect repeat_without_bench 2 'repeat does nothing without --bench' -- "$tk" --repeat 2 --tokenizer "$json"
expect decode_with_bench 2 'decode does nothing with --bench' -- "$tk" --bench "$tmp/docs" --decode --tokenizer "$json"
expect hex_with_bench 2 'hex does nothing with --bench' -- "$tk" --bench "$tmp/docs" --hex --tokenizer "$json"
expect special_with_decode 2 'special does nothing with --decode' -- "$tk" --decode --special --tokenizer "$json"
expect pypkg_with_decode 2 'pypkg does nothing with --decode' -- "$tk" --decode --pypkg --tokenizer "$json"
# output that cannot be written: 1 with the reason (it was 1 in silence)
printf 'hi\n' >"$tmp/hi"
if "$tk" --tokenizer "$json" <"$tmp/hi" >/dev/full 2>"$tmp/err"; then
    bad full_stdout "exit 0 with a full standard output"
elif ! grep -q 'standard output: No space left' "$tmp/err"; then
    bad full_stdout "stderr: $(head -c 300 "$tmp/err")"
else
    ok full_stdout
fi

[ $fail -eq 0 ] && echo "tokenize_cli: PASS"
exit $fail
