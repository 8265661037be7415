#!/bin/sh
# verify_units.sh UNITS_SRC_DIR SCHED PREFILL DECODE — `systemd-analyze
# verify` on the units of units/*.in, filled in with a bin directory holding
# the built daemons (verify checks that ExecStart= programs exist), plus an
# instance of each template.  Passes only when verify exits 0 and prints
# nothing at all (warnings such as unknown keys count as failures).
set -eu
src=$1; shift
command -v systemd-analyze >/dev/null || { echo "systemd-analyze missing"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/units"
for exe in "$@"; do
    ln -s "$(realpath "$exe")" "$tmp/bin/$(basename "$exe")"
done
for f in "$src"/*.in; do
    out="$tmp/units/$(basename "$f" .in)"
    sed -e "s|@bindir@|$tmp/bin|g" -e "s|@sbindir@|$tmp/bin|g" -e "s|@docdir@|/usr/share/doc/dsv4|g" "$f" > "$out"
    if grep -q '@[a-z]*@' "$out"; then
        echo "unsubstituted variable in $out"; exit 1
    fi
done
# Every daemon restarted on failure is not restarted after the exit statuses
# common/cli.h gives a usage or configuration fault (a start would repeat it).
cli=$src/../common/cli.h
usage=$(sed -n 's/^#define DSV4_EXIT_USAGE \([0-9]*\).*/\1/p' "$cli")
conf=$(sed -n 's/^#define DSV4_EXIT_CONFIG \([0-9]*\).*/\1/p' "$cli")
[ -n "$usage" ] && [ -n "$conf" ] || { echo "no DSV4_EXIT_USAGE / DSV4_EXIT_CONFIG in $cli"; exit 1; }
for f in "$tmp"/units/*.service; do
    grep -q '^Restart=on-failure$' "$f" || continue
    grep -qx "RestartPreventExitStatus=$usage $conf" "$f" ||
        { echo "$(basename "$f"): Restart=on-failure without RestartPreventExitStatus=$usage $conf"; exit 1; }
done
# systemd applies RestartPreventExitStatus= to the main process only: a
# failing ExecStartPre= is restarted until the start limit.  So no unit runs
# a dsv4 program there (its checks belong to the main process's start).
for f in "$tmp"/units/*.service; do
    if grep -E '^ExecStartPre=[-@:+!]*'"$tmp"'/bin/' "$f" >/dev/null; then
        echo "$(basename "$f"): a dsv4 program as ExecStartPre= (its exit status 6 would be restarted)"
        exit 1
    fi
done
# A unit that restricts address families and may use the network keeps
# AF_NETLINK: getifaddrs() needs it, and libzmq (binding tcp://IP:PORT: an
# assertion abort), UCX (no tcp device) and NCCL (no bootstrap interface)
# call it.
for f in "$tmp"/units/*.service; do
    line=$(grep '^RestrictAddressFamilies=' "$f" || true)
    case "$line" in
    "" | *AF_NETLINK*) ;;
    *AF_INET*) echo "$(basename "$f"): RestrictAddressFamilies= allows AF_INET but not AF_NETLINK"
        exit 1 ;;
    esac
done
cd "$tmp/units"
cp dsv4-prefill@.service dsv4-prefill@0.service
cp dsv4-decode@.service dsv4-decode@1.service
# Units whose ExecStart programs exist only as templates are checked as
# instances too.
set +e
out=$(systemd-analyze verify --man=no --recursive-errors=no \
    "$tmp"/units/*.socket "$tmp"/units/*.service "$tmp"/units/*.target 2>&1)
rc=$?
set -e
if [ $rc -ne 0 ] || [ -n "$out" ]; then
    echo "systemd-analyze verify: rc=$rc"
    echo "$out"
    exit 1
fi
echo "units verified: $(ls "$tmp/units" | tr '\n' ' ')"
