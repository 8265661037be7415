#!/usr/bin/env bash
# run_sh.sh SRCDIR BUILDDIR — the README's run command, tools/run.sh, against
# this build: it checks the dependencies (tools/setup.sh), finds the build up
# to date, makes the `small` checkpoint in BUILDDIR/model-small when there is
# none, starts the service set under dsv4-launch, serves one request with
# dsv4-generate and stops.  Passes when run.sh exits 0 and the request came
# back with as many tokens as it asked for (finish=length), so a change that
# breaks the first command a new user types fails CI.
set -uo pipefail
src=$1
build=$2
n=8

# a prompt of several words, the first like an option: joined, and passed
# after -- (it was taken as an option of dsv4-generate, after the whole
# set had started)
out=$(DSV4_BUILD="$build" DSV4_MAX_TOKENS=$n "$src/tools/run.sh" -5 degrees, world 2>&1)
status=$?
echo "$out"
if [ $status -ne 0 ]; then
    echo "run_sh.sh: tools/run.sh exited $status"
    exit 1
fi
if ! grep -q "finish=length prompt_tokens=[0-9]* completion_tokens=$n\$" <<<"$out"; then
    echo "run_sh.sh: no 'finish=length ... completion_tokens=$n' line in tools/run.sh's output"
    exit 1
fi
grep -q '^run.sh: done (status 0)$' <<<"$out" || { echo "run_sh.sh: no 'done (status 0)'"; exit 1; }
grep -q '^run.sh: prompt: -5 degrees, world$' <<<"$out" || { echo "run_sh.sh: the prompt not joined"; exit 1; }
echo "run_sh.sh: PASS"
