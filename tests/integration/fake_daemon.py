#!/usr/bin/env python3
"""fake_daemon.py — stands in for dsv4-sched / dsv4-prefill / dsv4-decode in
the dsv4-launch tests: speaks the notify protocol, reports what it was given
(argv, LISTEN_* fds with their bound addresses, WATCHDOG_USEC) as one JSON
line appended to $FAKE_REPORT, pings the watchdog unless $FAKE_NO_WATCHDOG,
exits with $FAKE_EXIT after $FAKE_EXIT_AFTER_S seconds if set, on SIGHUP
appends its pid to $FAKE_REPORT.hup and sends RELOADING=1 then READY=1 (a
reload), and on SIGTERM sends STOPPING=1 and exits 0.  For the launcher's
timeouts: $FAKE_EXTEND_USEC sends EXTEND_TIMEOUT_USEC= with it at start,
$FAKE_READY_AFTER_S holds READY=1 back that long (pinging nothing before;
$FAKE_EXIT_AFTER_S still applies), $FAKE_EXIT_AT_READY exits 0 at once
after READY=1, $FAKE_IGNORE_TERM ignores SIGTERM (only SIGKILL ends it),
and on SIGTERM $FAKE_STOP_EXTEND_USEC sends EXTEND_TIMEOUT_USEC= with it
after STOPPING=1 and $FAKE_STOP_AFTER_S waits that long before exiting.
A rank (argv has --rank) takes $FAKE_RANK_X, where set, for $FAKE_X: the
scheduler and the ranks of one set can behave apart."""
import json, os, signal, socket, sys, time


def env(name, default=None):
    """$name, or for a rank $FAKE_RANK_... in its place where set."""
    if "--rank" in sys.argv:
        v = os.environ.get("FAKE_RANK_" + name[len("FAKE_"):])
        if v is not None:
            return v
    return os.environ.get(name, default)


def notify(msg):
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(msg.encode(), path)
    s.close()


def main():
    stop = []
    if env("FAKE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))

    def on_hup(*a):
        with open(os.environ["FAKE_REPORT"] + ".hup", "a") as f:
            f.write("%d\n" % os.getpid())
        notify("RELOADING=1")
        notify("READY=1")
    signal.signal(signal.SIGHUP, on_hup)
    fds = []
    if os.environ.get("LISTEN_PID") == str(os.getpid()):
        n = int(os.environ["LISTEN_FDS"])
        names = os.environ.get("LISTEN_FDNAMES", "").split(":")
        for i in range(n):
            s = socket.socket(fileno=3 + i)
            fds.append({"fd": 3 + i, "name": names[i],
                        "addr": s.getsockname(),
                        "listening": s.getsockopt(socket.SOL_SOCKET,
                                                  socket.SO_ACCEPTCONN)})
            s.detach()
    rep = {"argv": sys.argv, "pid": os.getpid(), "fds": fds,
           "watchdog_usec": os.environ.get("WATCHDOG_USEC"),
           "watchdog_pid_ok": os.environ.get("WATCHDOG_PID") == str(os.getpid())}
    with open(os.environ["FAKE_REPORT"], "a") as f:
        f.write(json.dumps(rep) + "\n")
    notify("STATUS=loading")
    if env("FAKE_EXTEND_USEC"):
        notify("EXTEND_TIMEOUT_USEC=" + env("FAKE_EXTEND_USEC"))
    t0 = time.monotonic()
    exit_after = float(env("FAKE_EXIT_AFTER_S", "0"))
    ready_at = t0 + float(env("FAKE_READY_AFTER_S", "0"))
    while time.monotonic() < ready_at and not stop:
        time.sleep(0.02)
        if exit_after and time.monotonic() - t0 > exit_after:
            sys.exit(int(env("FAKE_EXIT", "0")))
    if not stop:
        notify("READY=1")
        if env("FAKE_EXIT_AT_READY"):
            os._exit(0)   # no interpreter teardown: the exit follows the datagram
    wd = int(os.environ.get("WATCHDOG_USEC") or 0) / 2e6
    while not stop:
        time.sleep(min(wd, 0.05) if wd else 0.05)
        if wd and not env("FAKE_NO_WATCHDOG"):
            notify("WATCHDOG=1")
        if exit_after and time.monotonic() - t0 > exit_after:
            sys.exit(int(env("FAKE_EXIT", "0")))
    notify("STOPPING=1")
    if env("FAKE_STOP_EXTEND_USEC"):
        notify("EXTEND_TIMEOUT_USEC=" + env("FAKE_STOP_EXTEND_USEC"))
    time.sleep(float(env("FAKE_STOP_AFTER_S", "0")))
    sys.exit(0)


main()
