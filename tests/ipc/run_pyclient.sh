#!/usr/bin/env bash
# run_pyclient.sh FAKE_SCHED PYCLIENT — start the stand-in scheduler on
# ipc:// in a temporary directory and run the Python client's self-check
# against it.  Exits 77 (skipped) when pyzmq or msgpack is not installed.
set -u
fake=$1
py=$2
python3 -c 'import zmq, msgpack' 2>/dev/null || { echo "pyzmq/msgpack missing: skip"; exit 77; }
dir=$(mktemp -d /tmp/dsv4-py-XXXXXX)
"$fake" "ipc://$dir/client.sock" &
pid=$!
python3 "$py" --check "ipc://$dir/client.sock"
rc=$?
kill "$pid"
wait "$pid"
rm -rf "$dir"
exit $rc
