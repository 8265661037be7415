#!/usr/bin/env bash
# gw_cli.sh DSV4_GATEWAY TOKENIZER_JSON — dsv4-gateway's configuration check
# (-n, and the same checks at a real start): the configuration file, -o and
# -l overrides, the bearer keys file and the tokenizer, each with the
# message and exit status an operator sees for a bad value.  Nothing is
# bound or served.
set -uo pipefail
gw=$1
tok=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

printf 'tokenizer = %s\n' "$tok" >"$tmp/dsv4.conf"
printf '# two keys\n  key-one  \n\nkey-two\n' >"$tmp/keys"
chmod 0640 "$tmp/keys"
printf '# none\n\n' >"$tmp/nokeys"
chmod 0640 "$tmp/nokeys"
head -c 300 /dev/zero | tr '\0' k >"$tmp/longkey"
chmod 0640 "$tmp/longkey"
printf 'key-one\n' >"$tmp/openkeys"
chmod 0644 "$tmp/openkeys"

# expect NAME STATUS PATTERN -- ARGS...: dsv4-gateway -n -f CONF ARGS's exit
# status and PATTERN (grep -E) in its output (stdout and log together)
expect() {
    local name=$1 want=$2 pat=$3 st
    shift 4
    "$gw" -n -f "$tmp/dsv4.conf" "$@" >"$tmp/out" 2>&1
    st=$?
    if [ "$st" != "$want" ]; then
        echo "FAIL $name: exit $st, expected $want: $(head -c 400 "$tmp/out")"; fail=1
    elif ! grep -qE -- "$pat" "$tmp/out"; then
        echo "FAIL $name: no /$pat/ in: $(head -c 400 "$tmp/out")"; fail=1
    else
        echo "ok   $name"
    fi
}

expect defaults 0 "configuration OK \($tmp/dsv4.conf\); 0 bearer key\(s\); tokenizer $tok; listen 127.0.0.1:8000" --
expect keys 0 '2 bearer key\(s\)' -- -o "gateway_keys=$tmp/keys"
expect keys_missing 6 "cannot use the keys file $tmp/nothere" -- -o "gateway_keys=$tmp/nothere"
expect keys_none 6 'holds no key' -- -o "gateway_keys=$tmp/nokeys"
expect key_too_long 6 'keys are < 256 bytes' -- -o "gateway_keys=$tmp/longkey"
expect keys_world_readable 0 'configuration OK' -- -o "gateway_keys=$tmp/openkeys"
grep -q 'readable by everyone' "$tmp/out" && echo "ok   keys_world_readable_warns" ||
    { echo "FAIL keys_world_readable_warns: $(cat "$tmp/out")"; fail=1; }
expect listen_ok 0 'listen 127.0.0.1:8123' -- -l 127.0.0.1:8123
expect listen_ipv6 0 'listen \[::1\]:8123' -- -l '[::1]:8123'
expect listen_no_port 6 'expected HOST:PORT' -- -l nonsense
expect listen_bad_port 6 'gateway_listen "127.0.0.1:notaport" cannot be listened on' -- -l 127.0.0.1:notaport
# (getaddrinfo took 65536 as port 0: a random port, the log naming 65536)
expect listen_port_65536 6 'the port is not a number 1 ... 65535' -- -l 127.0.0.1:65536
expect listen_port_0 6 'the port is not a number 1 ... 65535' -- -l 127.0.0.1:0
expect tokenizer_none 6 'the gateway needs a tokenizer' -- -o tokenizer=none
expect unknown_key 6 'unknown key "bogus"' -- -o bogus=1
expect client_endpoint_bad 6 'client_endpoint: abc: not ipc://PATH' -- -o client_endpoint=abc
expect admin_endpoint_tcp_no_key 6 "admin_endpoint: CURVE key $tmp/server.pub" -- -o admin_endpoint=tcp://127.0.0.1:5556 -o "key_dir=$tmp"
expect tokenizer_missing 6 'tokenizer: ' -- -o "tokenizer=$tmp/nothere.json"
# a tokenizer without the chat format's <think> marker: every chat request
# would fail (each blamed on its client), so the gateway does not start
sed 's/"content": "<think>"/"content": "<thinq>"/' "$tok" >"$tmp/nothink.json"
expect tokenizer_no_marker 6 'marker <think> is not an added token' -- \
    -o "tokenizer=$tmp/nothink.json"
expect conf_missing 6 "$tmp/nothere.conf" -- -f "$tmp/nothere.conf"
expect unknown_flag 2 'usage' -- -Z
expect stray_argument 2 'usage' -- extra

# expect_start NAME PATTERN -- ARGS...: a real start (no -n) refused for its
# configuration: exit 6 and PATTERN before anything is served (a gateway
# that starts serving instead is stopped by the timeout: exit 124)
expect_start() {
    local name=$1 pat=$2 st
    shift 3
    timeout 20 "$gw" -f "$tmp/dsv4.conf" -l 127.0.0.1:0 "$@" >"$tmp/out" 2>&1
    st=$?
    if [ "$st" != 6 ]; then
        echo "FAIL start_$name: exit $st, expected 6: $(head -c 400 "$tmp/out")"; fail=1
    elif ! grep -qE -- "$pat" "$tmp/out"; then
        echo "FAIL start_$name: no /$pat/ in: $(head -c 400 "$tmp/out")"; fail=1
    else
        echo "ok   start_$name"
    fi
}

# The unit has no ExecStartPre= check (systemd restarts a unit whose
# ExecStartPre= fails, whatever RestartPreventExitStatus= says), so the
# start itself must refuse what -n refuses.
expect_start client_endpoint_bad 'client_endpoint: abc: not ipc://PATH' -- -o client_endpoint=abc
expect_start admin_endpoint_tcp_no_key "admin_endpoint: CURVE key $tmp/server.pub" -- -o admin_endpoint=tcp://127.0.0.1:5556 -o "key_dir=$tmp"
expect_start tokenizer_missing 'tokenizer: ' -- -o "tokenizer=$tmp/nothere.json"
expect_start keys_missing "cannot use the keys file $tmp/nothere" -- -o "gateway_keys=$tmp/nothere"

[ $fail -eq 0 ] && echo "gw_cli: PASS"
exit $fail
