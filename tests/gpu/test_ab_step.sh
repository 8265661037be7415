#!/usr/bin/env bash
# test_ab_step.sh AB_STEP — tests/gpu/ab_step.sh against a stand-in for
# test_decode_gpu that prints its two `profile` lines (digest and step
# time from STUB_DIGEST / STUB_MS), so its parsing, its environment per
# side and its exit status are checked without a GPU.
set -uo pipefail
ab=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

cat >"$tmp/stub" <<'STUB'
#!/usr/bin/env bash
[ "$1" = profile ] || exit 2
[ -n "${STUB_SILENT:-}" ] && exit 1
echo "   profile: last graphed step's logits digest ${STUB_DIGEST:-1a6b48f8e0acf8bc}"
echo "| profile | flash widths, $2 layers | batch $3, 64-token prompts | fast kernels, PDL on" \
     "| plain step 3.50 ms | graphed step 3.20 ms (logits to the host)" \
     "| graphed + GPU sampling ${STUB_MS:-3.07} ms | step graph: 700 kernels, 700 nodes |"
STUB
chmod +x "$tmp/stub"

# check NAME WANT_STATUS PATTERN... -- COMMAND...: the command's exit status
# and every pattern (grep -E) in its output
check() {
    local name=$1 want=$2 out st
    shift 2
    local -a pats=()
    while [ "$1" != -- ]; do pats+=("$1"); shift; done
    shift
    out=$("$@" 2>&1)
    st=$?
    if [ "$st" != "$want" ]; then
        echo "FAIL $name: exit $st, expected $want"; echo "$out"; fail=1; return
    fi
    for p in "${pats[@]}"; do
        if ! grep -qE -- "$p" <<<"$out"; then
            echo "FAIL $name: no /$p/ in"; echo "$out"; fail=1; return
        fi
    done
    echo "ok   $name"
}

check same 0 'batch 1: digests A 1a6b48f8e0acf8bc, B 1a6b48f8e0acf8bc \(same\)' \
    'batch 16 pair 2: A 3.07 ms, B 3.07 ms' 'batch 16: A mean 3.070 ms, min 3.07 ms' -- \
    "$ab" "$tmp/stub" "$tmp/stub" 4 "1 16" 2
check env_b 0 'batch 1: A mean 3.070 ms, min 3.07 ms; B mean 2.500 ms, min 2.50 ms' -- \
    env AB_ENV_B="STUB_MS=2.50" "$ab" "$tmp/stub" "$tmp/stub" 4 1 3
check digests_differ 1 'digests A 1a6b48f8e0acf8bc, B 00000000000000ff \(DIFFERENT\)' -- \
    env AB_ENV_B="STUB_DIGEST=00000000000000ff" "$ab" "$tmp/stub" "$tmp/stub" 4 1 1
check digests_reported 0 '\(DIFFERENT\)' -- \
    env AB_SAME=0 AB_ENV_A="STUB_DIGEST=00000000000000aa" "$ab" "$tmp/stub" "$tmp/stub" 4 1 1
check no_figure 1 'no digest from A \(1a6b48f8e0acf8bc\) or B \(-\)' -- \
    env AB_ENV_B="STUB_SILENT=1" "$ab" "$tmp/stub" "$tmp/stub" 4 1 1
check usage 2 'usage' -- "$ab" "$tmp/stub"
check bad_layers 2 'numbers' -- "$ab" "$tmp/stub" "$tmp/stub" four

[ $fail -eq 0 ] && echo "test_ab_step: PASS"
exit $fail
