#!/usr/bin/env bash
# run.sh — the project's run command (README): install dependencies, build,
# make a `small` synthetic checkpoint with dsv4-mkmodel if there is none,
# start the service set (dsv4-sched, one dsv4-prefill, one dsv4-decode) under
# dsv4-launch — on the GPU (CUDA backend) when the build has CUDA and a GPU is
# present, else on the CPU backend — serve one request with dsv4-generate,
# print it, and stop everything.
#
#   tools/run.sh [PROMPT...]      (several words are joined by spaces)
#
# Environment: DSV4_BUILD (build directory, default build), DSV4_MODEL
# (checkpoint directory, default $DSV4_BUILD/model-small, made there when
# missing; one named here must hold a checkpoint), DSV4_MAX_TOKENS
# (default 32), DSV4_BACKEND (cpu or cuda; default: cuda when nvidia-smi lists
# a GPU and the build has CUDA, else cpu).  The weights are random, so the text is not meaningful; the
# point is the whole path: tokenizer, scheduler, prefill, decode-state
# handoff, batched decode, streaming.  docs/operations.md runs the same set
# under systemd.
set -euo pipefail

# paths given relative to the caller's directory, before the cd below
abs() { case $1 in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
[ -n "${DSV4_BUILD:-}" ] && DSV4_BUILD=$(abs "$DSV4_BUILD")
[ -n "${DSV4_MODEL:-}" ] && DSV4_MODEL=$(abs "$DSV4_MODEL")
cd "$(dirname "$0")/.."

build=${DSV4_BUILD:-$PWD/build}
prompt="$*"
[ -n "$prompt" ] || prompt="The capital of France is"
max_tokens=${DSV4_MAX_TOKENS:-32}

# run_logged LOG CMD...: CMD's output into LOG; on failure its tail and exit 1
run_logged() {
    local log=$1; shift
    if ! "$@" >"$log" 2>&1; then
        tail -40 "$log"
        echo "run.sh: '$*' failed (the whole output: $log)" >&2
        exit 1
    fi
}

tools/setup.sh
if [ ! -f "$build/build.ninja" ]; then
    # nvcc with header dependencies (tools/nvcc-deps.sh)
    mapfile -t native < <(tools/nvcc-deps.sh --native-args "$build.nvcc.ini")
    run_logged "$build.setup.log" meson setup "${native[@]}" "$build"
fi
echo "run.sh: building in $build"
run_logged "$build/run.sh-build.log" ninja -C "$build"

# config.json is what dsv4-mkmodel writes last: a run stopped while it made
# the model leaves none, and the model is made again.
model=${DSV4_MODEL:-$build/model-small}
if [ ! -f "$model/config.json" ]; then
    if [ -n "${DSV4_MODEL:-}" ]; then
        echo "run.sh: DSV4_MODEL=$model holds no checkpoint (no config.json)" >&2
        exit 2
    fi
    echo "run.sh: making a small checkpoint in $model"
    rm -rf "$model"
    run_logged "$build/run.sh-mkmodel.log" "$build/tools/mkmodel/dsv4-mkmodel" --preset small \
        --out "$model"
fi

backend=cpu
if nvidia-smi -L >/dev/null 2>&1 && grep -q -- '-DDSV4_HAVE_CUDA' "$build/build.ninja"; then
    backend=cuda
fi
backend=${DSV4_BACKEND:-$backend}

run=$(mktemp -d "${TMPDIR:-/tmp}/dsv4-run.XXXXXX")
trap 'rm -rf "$run"' EXIT
cat >"$run/dsv4.conf" <<CONF
client_endpoint = ipc://$run/client.sock
rank_endpoint = ipc://$run/rank.sock
admin_endpoint = ipc://$run/ctl.sock
checkpoint = $(realpath "$model")
backend = $backend
max_seq = 1024
CONF

echo "run.sh: starting dsv4-sched + dsv4-prefill@0 + dsv4-decode@0 ($backend backend)"
echo "run.sh: prompt: $prompt"
status=0
"$build/tools/launch/dsv4-launch" -f "$run/dsv4.conf" -P 1 -D 1 \
    --sched-bin "$build/daemons/sched/dsv4-sched" \
    --prefill-bin "$build/daemons/rank/dsv4-prefill" \
    --decode-bin "$build/daemons/rank/dsv4-decode" \
    -- "$build/tools/generate/dsv4-generate" -n "$max_tokens" -t 0 --usage \
    -- "$prompt" || status=$?
echo
echo "run.sh: done (status $status)"
exit $status
