#!/usr/bin/env bash
# run_with_ckpt.sh MKMODEL TEST [mkmodel args...] [-- test args...]
# Generate a checkpoint with dsv4-mkmodel into a temporary directory, run TEST
# with the directory as its first argument (then any test args), clean up.
set -u
mk=$1 test=$2; shift 2
mkargs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do mkargs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$mk" "${mkargs[@]}" --out "$dir" >/dev/null || exit 1

"$test" "$dir" "$@"
