#!/usr/bin/env bash
# run_generate.sh FAKE_SCHED DSV4_GENERATE — dsv4-generate against the
# stand-in scheduler (whose output echoes the prompt, see fake_sched.h):
# text prompt, token ids with a stop id, stdin prompt, refusals.
set -u
fake=$1
gen=$2
dir=$(mktemp -d /tmp/dsv4-gen-XXXXXX)
ep="ipc://$dir/client.sock"
"$fake" "$ep" &
pid=$!
fail=0
check() { # check NAME EXPECTED ACTUAL
    if [ "$2" != "$3" ]; then echo "FAIL $1: expected [$2] got [$3]"; fail=1; else echo "ok $1"; fi
}
check text "abcab" "$("$gen" -e "$ep" -n 5 abc)"
check ids "[5][6][7]" "$("$gen" -e "$ep" --ids --stop-id 7 '5,6 7 8')"
check stdin "hi hi" "$(printf 'hi ' | "$gen" -e "$ep" -n 5)"
check usage "finish=length prompt_tokens=2 completion_tokens=3" \
    "$("$gen" -e "$ep" -n 3 --usage xy 2>&1 >/dev/null)"
# (checked here: a bad option value, 2, not the server's 401 and 1)
"$gen" -e "$ep" -t 11 x >/dev/null 2>&1; check bad-temperature 2 $?
"$gen" -e "$ep" __busy__ >/dev/null 2>&1; check busy 1 $?
"$gen" -e "$ep" -n 0 x >/dev/null 2>&1; check usage-error 2 $?
"$gen" -e "ipc://$dir/nobody.sock" --connect-timeout 100 x >/dev/null 2>&1; check unreachable 1 $?
# a completion that cannot be written is a failure
"$gen" -e "$ep" -n 5 abc >/dev/full 2>/dev/null; check full-stdout 1 $?
# a reader gone (a pipe whose read end is closed): 1 with the reason, not
# death by SIGPIPE (141)
check closed-pipe "1 True" "$(python3 -c '
import os, subprocess, sys
r, w = os.pipe()
os.close(r)
p = subprocess.run(sys.argv[1:], stdout=w, stderr=subprocess.PIPE)
print(p.returncode, b"standard output: Broken pipe" in p.stderr)' "$gen" -e "$ep" -n 5 abc)"
# the completion's newline before --usage's line on one shared file
check usage-order "abc
finish=length prompt_tokens=3 completion_tokens=3" "$("$gen" -e "$ep" -n 3 --usage abc 2>&1)"
# a 17th --stop: 2 with the reason (it was the bare usage); an endpoint of
# no form: 2, a usage error, not 1
"$gen" -e "$ep" $(printf -- '-S x %.0s' $(seq 17)) x >/dev/null 2>"$dir/err"
check stop-limit "2 at most 16 --stop" "$? $(grep -o 'at most 16 --stop' "$dir/err")"
"$gen" -e bogus x >/dev/null 2>&1; check bad-endpoint 2 $?
# wait_live N: until the stand-in holds N requests ("__count__" answers
# "live N"); dsv4-generate takes SIGINT before it submits
wait_live() {
    for _ in $(seq 1 3000); do
        "$gen" -e "$ep" __count__ 2>&1 | grep -q "live $1\b" && return 0
        sleep 0.01
    done
    echo "FAIL: the stand-in never held $1 requests"; fail=1
}
# Ctrl-C: the cancel's DONE ends it with 130
"$gen" -e "$ep" __stall__ >/dev/null 2>&1 &
g=$!; wait_live 1; kill -INT "$g"; wait "$g"; check sigint 130 $?
# a second Ctrl-C leaves when the scheduler does not answer the cancel
"$gen" -e "$ep" __stall__ >/dev/null 2>&1 &
g=$!; wait_live 1; kill -STOP "$pid"; kill -INT "$g"; sleep 0.3; kill -INT "$g"
( sleep 10; kill -KILL "$g" 2>/dev/null ) & guard=$!
wait "$g"; check second-sigint 130 $?
kill "$guard" 2>/dev/null; kill -CONT "$pid"
kill "$pid"
wait "$pid"
rm -rf "$dir"
exit $fail
