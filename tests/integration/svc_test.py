#!/usr/bin/env python3
"""svc_test.py — integration tests of the dsv4 service set on the CPU backend
(issue 5, "Must show").  One scenario per run:

  svc_test.py SCENARIO --build BUILD_DIR [--src SRC_DIR]

Scenarios:
  launch          dsv4-launch with stand-in daemons (tests/integration/
                  fake_daemon.py): listeners passed as LISTEN_FDS client:admin,
                  notify ordering, Restart=on-failure after kill -9, no restart
                  after a clean exit, watchdog kill, start limit, none after exit
                  2 or 6, stop on SIGTERM.
  greedy16        16 concurrent greedy streams through sched + 2 prefill + 2
                  decode ranks == the single-process forward (svc_client
                  --reference) for every prompt; the decode ranks' step
                  reports in STATUS= account for every token they emitted;
                  every rank ran its start-up warm-up calls.
  batch64         64 submitted at once (1 decode rank, decode.warmup = no:
                  no warm-up steps) are all served and never more than 16
                  decode at a time (admin protocol).
  socket_activate dsv4-sched under systemd-socket-activate with a NOTIFY_SOCKET
                  listener: STATUS.. READY=1 WATCHDOG=1 .. STOPPING=1, and the
                  passed listeners are the ones served.
  kill_decode, kill_prefill, kill_sched
                  kill -9 in the middle of 16 streams; dsv4-launch restarts the
                  process; every stream == the undisturbed output (after a
                  scheduler death, libdsv4client resumes each request on the
                  new scheduler); then no leaked state.
  restart_sched   SIGTERM to the scheduler under 16 streams (stop_timeout_ms =
                  200): what it has not finished it answers with 302 and
                  exits 0; the clients' reconnect starts it again (dsv4-launch
                  keeps the listeners), each 302'd request is resumed there,
                  every stream == the undisturbed output; no leaked state.
  cancel1000      1,000 requests cancelled at random moments: every request
                  ends, output is a prefix of the reference, no leaked state.
  drain           drain of a decode rank under load finishes its streams,
                  admits nothing new there, new work runs elsewhere; global
                  drain answers 301; undrain restores service.
  stop_drain      SIGTERM to decode@0 while it streams and a prompt booked on
                  it is held in prefill (prefill@0 stopped) (stop_drain_s):
                  it says how many it finishes, the scheduler shows it
                  draining, it waits for the booked prompt past its own
                  streams, all end there (no re-run), it exits 0; new work
                  sent meanwhile runs on decode@1.  Then the whole set is
                  stopped (SIGTERM to dsv4-launch) under 16 streams: those
                  under way finish, the scheduler stops after the ranks.  Every stream == the
                  single-process forward, nothing fails.
  group2          model groups (group_size = 2: one prefill group and one
                  decode group of two ranks each, shm communicator): 16 greedy
                  streams == the single-process forward; then kill -9 of
                  decode@1 mid-stream: dsv4-launch restarts it, the group
                  re-forms with a new communicator while decode@0 keeps
                  running (same pid), every stream == the undisturbed output.
                  Every rank warms up in its group's first join; the new
                  decode@1 owes its warm-up, so the re-formed group runs it
                  together (decode@0 twice); the prefill group once.
  group_break     groups of two on the CPU backend with test-only fault
                  injection (daemons/rank/rank.h): decode@1 starts its first
                  communicator join later than the liveness window: both
                  decode ranks are shown joining and none is taken for dead;
                  then one forward call of decode@1 and one of prefill@0
                  report a collective failure: each group breaks with every
                  rank alive (GROUP_BROKEN), the scheduler re-forms it and
                  re-runs what it held there, every stream == the
                  single-process forward, no process restarts, no rank death,
                  and no second warm-up (the same processes owe none).
  group_mismatch  a decode group of two ranks of 16 and 8 slots: the failed
                  joins say why (the shm communicator's sizes differ), the
                  failing rank registers again after a growing pause (5
                  failures, at most 8 epochs), no rank restarts, the set
                  stops cleanly.
  model_mismatch  a decode rank started on another checkpoint (same config,
                  another seed) beside a running set: its READY is refused
                  with both models' fingerprints, the set serves on, every
                  stream == the single-process forward.
  join_stop       the set is stopped while decode@1 waits in its first join
                  (delayed 60 s by test-only injection, longer than the
                  launcher's 20 s stop timeout): decode@1 gives the join up
                  and exits 0, as does every child, and dsv4-launch exits 0.
  group_rejoin    a decode group of two whose decode@1 is killed -9 while
                  the group forms (its join delayed by test-only injection):
                  decode@0 gives up the join of the dead peer's epoch as
                  soon as the next epoch comes (not after the join's 60 s),
                  the group forms with the restarted decode@1 and serves
                  streams == the single-process forward; decode@0 is kept.
  prefill_nomem   a prefill rank's second forward call after its start-up
                  warm-up reports that the device ran out of memory
                  (test-only injection): the rank
                  stays up (same pid, no restart), the prompts of that call
                  run again (re-run "prefill rank out of memory"), every
                  stream == the single-process forward, no leaked state.
  export_nomem    decode-state exports that run out of device memory (test-only
                  injection): prefill@0's start-up warm-up export (the rank
                  gives back its working memory, halves its rows per call
                  256 -> 128 and warms up again, started once) and
                  prefill@1's first prompt's export (the prompt re-runs:
                  "prefill rank out of memory"); every stream == the
                  single-process forward, no rank death, no failure.
  decode_nomem    the 5th step of decode@0 (plain) and of decode@1 (mtp)
                  reports that the device ran out of memory (test-only
                  injection): each rank stays up, the step's streams re-run
                  ("decode rank out of memory"), every stream == the
                  single-process forward, no rank death, no failure.
  prefill_warmup  a prefill rank's start-up warm-up call (256 rows) reports
                  that the device ran out of memory (test-only injection):
                  the rank lowers its rows per call to 128 (log, STATUS=),
                  starts once, and prompts of 150-199 tokens == the
                  single-process forward.
  mtp             mtp = yes (speculative decoding with the MTP layer, one draft
                  per stream and step): 16 greedy streams through 2 prefill +
                  2 decode ranks == the single-process forward, and the decode
                  ranks report drafts proposed / accepted in STATUS=.

Leaked state is checked through the admin socket (SHOW_REQUESTS empty,
every rank's `active` 0, STATUS n_queued/n_running 0), with dsv4ctl --json
(both the scheduler's books and each rank's own count), with dsv4ctl
--json when it is built, and in /dev/shm (no decode-state export left).

A scenario that fails keeps its scratch directory (configuration, logs,
notify log) and prints the last 60 lines of each daemon's log (dsv4-launch
runs them with -v; their stderr is launch.err, split here by process tag),
the lines without a tag (sanitizer reports) and the notify log to stderr, so
that a CI failure can be diagnosed from the CI output alone.  SVC_TEST_KEEP=1
keeps the directory of a passing run too.

The client side is tests/integration/svc_client (libdsv4client); the admin
side speaks docs/protocol.md §7 with pyzmq + msgpack (installed with pip
when missing).
"""
import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

try:
    import msgpack
    import zmq
except ImportError:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "--break-system-packages", "pyzmq", "msgpack"], check=False)
    import msgpack
    import zmq

WAIT_S = 60          # bound on waiting for a condition (never a pass/fail timing)
MAX_TOKENS = 24
TIMEOUT_MS = 120000  # per-request timeout given to the service (sanitizer
                     # builds are ~10x slower; a timeout is a failure here)

ARGS = None
LOG_TAIL = 60        # lines of each daemon's log shown when a scenario fails

# Scratch directories of the scenario: removed when it passes (unless
# SVC_TEST_KEEP is set), kept (and the logs in them shown on stderr) when it
# fails, so that a CI failure can be diagnosed from the CI output alone.
SCRATCH = []


def log(*a):
    print("svc_test:", *a, flush=True)


def scratch_dir(prefix):
    d = tempfile.mkdtemp(prefix=prefix)
    SCRATCH.append(d)
    return d


def tail_lines(lines, n=LOG_TAIL):
    return lines[-n:] if len(lines) > n else lines


# "2024-01-01T00:00:00.000Z W decode/1: message" (common/log.c)
LOG_LINE = re.compile(r"^\S+Z [A-Z] ([^:\s]+): ")


def dump_launch_log(path, out):
    """The last LOG_TAIL lines of each process's messages in a dsv4-launch
    stderr file (the daemons inherit it; lines carry the process's tag), and
    of the lines without a tag (sanitizer reports, exec errors)."""
    by_tag = {}
    for line in readf(path).splitlines():
        m = LOG_LINE.match(line)
        by_tag.setdefault(m.group(1) if m else "(untagged)", []).append(line)
    for tag in sorted(by_tag):
        lines = by_tag[tag]
        out.write("----- %s: last %d of %d lines of %s -----\n" %
                  (tag, min(len(lines), LOG_TAIL), len(lines), path))
        out.write("\n".join(tail_lines(lines)) + "\n")


def dump_scratch(out=sys.stderr):
    """Show the logs of the kept scratch directories (on failure)."""
    for d in SCRATCH:
        if not os.path.isdir(d):
            continue
        out.write("svc_test: kept %s\n" % d)
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if not os.path.isfile(path):
                continue
            if name == "launch.err":
                dump_launch_log(path, out)
            elif name.endswith((".log", ".err")) or name in ("n", "n2", "n3", "n4", "err"):
                lines = readf(path).splitlines()
                out.write("----- %s: last %d of %d lines -----\n" %
                          (path, min(len(lines), LOG_TAIL), len(lines)))
                out.write("\n".join(tail_lines(lines)) + "\n")
    out.flush()


def remove_scratch():
    for d in SCRATCH:
        shutil.rmtree(d, ignore_errors=True)
    SCRATCH.clear()


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def wait_for(pred, what, timeout=WAIT_S, step=0.05):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise Fail("gave up waiting for " + what)
        time.sleep(step)


def exe(rel):
    p = os.path.join(ARGS.build, rel)
    check(os.access(p, os.X_OK), "missing executable " + p)
    return p


# --- admin protocol (docs/protocol.md §7) ------------------------------------

A_SHOW_STATUS, A_STATUS, A_SHOW_RANKS, A_RANK, A_RANKS_END = 1, 2, 3, 4, 5
A_SHOW_REQUESTS, A_REQUEST, A_REQUESTS_END = 6, 7, 8
A_DRAIN, A_UNDRAIN, A_RESULT = 9, 10, 11
A_RELOAD = 13


class Admin:
    def __init__(self, endpoint):
        self.ctx = zmq.Context.instance()
        self.endpoint = endpoint
        self.s = None

    def _sock(self):
        if self.s is None:
            self.s = self.ctx.socket(zmq.DEALER)
            self.s.setsockopt(zmq.LINGER, 0)
            self.s.connect(self.endpoint)
        return self.s

    def call(self, cmd, body=None, finals=(), timeout=10.0, retry=False):
        """Send one admin request; return (items, final body, final cmd).
        retry (a listing, which asks nothing of the scheduler): once more on
        a new connection when no reply came (a request written within ms of
        a scheduler's kill -9 went into the dead connection)."""
        s = self._sock()
        s.send_multipart([b"", b"DSV4A1", bytes([cmd]), msgpack.packb(body or {})])
        items = []
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0 or not s.poll(int(left * 1000)):
                self.s.close()
                self.s = None
                if retry:
                    return self.call(cmd, body, finals, timeout)
                raise Fail("admin: no reply to command %d" % cmd)
            fr = s.recv_multipart()
            c, m = fr[2][0], msgpack.unpackb(fr[3], raw=False)
            if c in finals:
                return items, m, c
            items.append(m)

    def status(self):
        return self.call(A_SHOW_STATUS, finals=(A_STATUS, A_RESULT), retry=True)[1]

    def ranks(self):
        items, end, _ = self.call(A_SHOW_RANKS, finals=(A_RANKS_END, A_RESULT), retry=True)
        return items

    def requests(self):
        items, end, _ = self.call(A_SHOW_REQUESTS, finals=(A_REQUESTS_END, A_RESULT),
                                  retry=True)
        return items

    def drain(self, target, timeout_ms=0, timeout=WAIT_S * 2):
        return self.call(A_DRAIN, {"target": target, "timeout_ms": timeout_ms},
                         finals=(A_RESULT,), timeout=timeout)[1]

    def undrain(self, target):
        return self.call(A_UNDRAIN, {"target": target}, finals=(A_RESULT,))[1]

    def reload(self):
        return self.call(A_RELOAD, finals=(A_RESULT,))[1]

    def close(self):
        if self.s is not None:
            self.s.close()
            self.s = None


# --- the service under dsv4-launch -----------------------------------------


def make_prompts(path, n, seed, lo=3, hi=40, vocab=1024):
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(" ".join(str(r.randrange(2, vocab))
                             for _ in range(r.randrange(lo, hi))) + "\n")


def parse_outputs(text):
    """svc_client output -> list of (status, detail, [tokens])."""
    out = []
    for line in text.splitlines():
        f = line.split()
        check(len(f) >= 4 and int(f[0]) == len(out), "bad svc_client line: " + line)
        toks = [int(t) for t in f[4:]]
        check(len(toks) == int(f[3]), "token count mismatch: " + line)
        out.append((f[1], f[2], toks))
    return out


class Service:
    """A tmp dir with a tiny checkpoint, a config, and dsv4-launch running the
    set with a NOTIFY_SOCKET of the test's own."""

    def __init__(self, n_prefill=1, n_decode=1, extra_conf="", env=None, wait=True,
                 heartbeat=(500, 10)):
        self.dir = scratch_dir("dsv4-it-")
        self.model = os.path.join(self.dir, "model")
        subprocess.run([exe("tools/mkmodel/dsv4-mkmodel"), "--preset", "tiny",
                        "--out", self.model], check=True, stdout=subprocess.DEVNULL)
        self.client_ep = "ipc://%s/client.sock" % self.dir
        self.admin_ep = "ipc://%s/ctl.sock" % self.dir
        self.rank_ep = "ipc://%s/rank.sock" % self.dir   # shm_exports
        self.conf = os.path.join(self.dir, "dsv4.conf")
        with open(self.conf, "w") as f:
            f.write(f"""# integration test configuration
client_endpoint = {self.client_ep}
rank_endpoint = {self.rank_ep}
admin_endpoint = {self.admin_ep}
heartbeat_ms = {heartbeat[0]}
liveness = {heartbeat[1]}
checkpoint = {self.model}
threads = 1
slots = 16
max_batch = 16
max_seq = 256
prefill_chunk = 16
{extra_conf}
""")
        self.notify_log = os.path.join(self.dir, "notify.log")
        self.nsock_path = os.path.join(self.dir, "launch.notify")
        self.nsock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.nsock.bind(self.nsock_path)
        env = dict(os.environ, NOTIFY_SOCKET=self.nsock_path, **(env or {}))
        self.stderr = open(os.path.join(self.dir, "launch.err"), "w")
        self.proc = subprocess.Popen(
            [exe("tools/launch/dsv4-launch"), "-v", "-f", self.conf,
             "-P", str(n_prefill), "-D", str(n_decode), "-r", "200", "-w", "20",
             "-T", "120", "-t", "20",
             "--sched-bin", exe("daemons/sched/dsv4-sched"),
             "--prefill-bin", exe("daemons/rank/dsv4-prefill"),
             "--decode-bin", exe("daemons/rank/dsv4-decode"),
             "--notify-log", self.notify_log],
            env=env, stderr=self.stderr)
        self.admin = Admin(self.admin_ep)
        self.killed = set()
        self.stopped = set()   # children the test sent SIGTERM: exit 0 expected
        self.wait_notify("READY=1")
        if wait:
            self.wait_ranks(n_prefill + n_decode)

    def wait_notify(self, what):
        # short waits, so that a set that stopped (a bad configuration) is
        # reported at once and not after the whole bound
        self.nsock.settimeout(0.5)
        end = time.monotonic() + WAIT_S * 2
        while True:
            if self.proc.poll() is not None:
                raise Fail("dsv4-launch exited with %d before %s; log:\n%s" %
                           (self.proc.returncode, what, self.errlog()))
            try:
                msg = self.nsock.recv(4096).decode()
            except socket.timeout:
                if time.monotonic() > end:
                    raise Fail("dsv4-launch never sent " + what + "\n" + self.errlog())
                continue
            if what in msg.split("\n"):
                return

    def wait_ranks(self, n):
        wait_for(lambda: sum(1 for r in self.admin.ranks() if r["state"] == "ready") == n,
                 "%d ranks ready" % n)

    def errlog(self):
        if not self.stderr.closed:   # closed by stop
            self.stderr.flush()
        with open(os.path.join(self.dir, "launch.err")) as f:
            return f.read()[-6000:]

    def pid(self, name):
        """Current pid of child `name` (sched, prefill@0, decode@1)."""
        pid = None
        with open(self.notify_log) as f:
            for line in f:
                m = re.match(r"(\S+) START pid=(\d+)", line)
                if m and m.group(1) == name:
                    pid = int(m.group(2))
        return pid

    def count(self, name, what):
        with open(self.notify_log) as f:
            return sum(1 for line in f if line.startswith(name + " ") and what in line)

    def client(self, prompts, max_tokens=MAX_TOKENS, extra=(), progress=None,
               timeout_ms=TIMEOUT_MS):
        cmd = [exe("tests/integration/svc_client"), "-e", self.client_ep,
               "-p", prompts, "-n", str(max_tokens), "--timeout", str(timeout_ms)]
        if progress:
            cmd += ["--progress", progress]
        return subprocess.Popen(cmd + list(extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def kill9(self, name):
        pid = self.pid(name)
        check(pid is not None, "no pid for " + name)
        log("kill -9 %s pid=%d" % (name, pid))
        self.killed.add(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def pids(self, *names):
        """{name: pid} of the named ranks now (check_kept's argument)."""
        return {n: self.pid(n) for n in names}

    def check_kept(self, pids):
        """Each rank of `pids` (Service.pids) still runs as that process,
        started once."""
        for n, pid in pids.items():
            check(self.pid(n) == pid and self.count(n, "READY=1") == 1, "%s was restarted" % n)

    def check_reruns(self, least, what):
        """The status after a fault the ranks survive: no rank death, at
        least `least` re-runs, no failed request; the status."""
        st = self.admin.status()
        check(st["rank_deaths"] == 0 and st["reruns"] >= least and st["n_failed"] == 0,
              "after %s: %s" % (what, st))
        return st

    def exits(self):
        """[(child, status)] of every child exit so far ("exit=0",
        "signal=9", ...), from the notify log."""
        return re.findall(r"^(\S+) EXIT (\S+)", readf(self.notify_log), re.M)

    def check_exits(self, killed=()):
        """Every child exit so far was one the test caused (kill -9, or a
        SIGTERM that ends with exit 0: self.stopped)."""
        bad = ["%s EXIT %s" % (name, st) for name, st in self.exits()
               if not (name in killed and st == "signal=9") and
               not (name in self.stopped and st == "exit=0")]
        check(not bad, "unexpected child exits: %s\n%s" % (bad, self.errlog()))

    def check_no_leaks(self):
        """Wait until the books are empty; fail with the state otherwise."""
        self.check_exits(self.killed)
        def clean():
            st = self.admin.status()
            reqs = self.admin.requests()
            ranks = self.admin.ranks()
            # a dead rank's rank_active is its last HEARTBEAT's (stale)
            busy = [r for r in ranks if r["active"] != 0 or
                    (r.get("rank_active", 0) != 0 and r["state"] != "dead")]
            shm = shm_exports(getattr(self, "rank_ep", None))
            self.last = (st, reqs, ranks, shm)
            return (not reqs and not busy and st["n_queued"] == 0 and
                    st["n_running"] == 0 and not shm)
        try:
            wait_for(clean, "no leaked state", step=0.2)
        except Fail:
            st, reqs, ranks, shm = self.last
            raise Fail("leaked state: status=%s requests=%s ranks=%s shm=%s" %
                       (st, reqs[:5], ranks, shm[:5]))
        ctl = os.path.join(ARGS.build, "tools/dsv4ctl/dsv4ctl")
        if os.access(ctl, os.X_OK):
            for what in ("requests", "ranks", "status"):
                r = subprocess.run([ctl, "--admin", self.admin_ep, "--json", what],
                                   capture_output=True, text=True, timeout=30)
                check(r.returncode == 0, "dsv4ctl %s: %s" % (what, r.stderr))
                check_ctl_json(what, r.stdout)
        log("no leaked state")

    def stop(self):
        self.admin.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        if rc != 0:
            log("dsv4-launch exit %d; log tail:\n%s" % (rc, self.errlog()))
        self.stderr.close()
        self.nsock.close()
        return rc


def stop_checked(svc):
    """Stop the set (a scenario's `finally`): dsv4-launch must exit 0, unless
    the scenario is failing already; that failure is then the one reported,
    not the exit status it may have caused."""
    rc = svc.stop()
    if sys.exc_info()[0] is None:
        check(rc == 0, "dsv4-launch did not stop cleanly")


def check_ctl_json(what, text):
    """dsv4ctl --json output: no request, every rank idle, nothing running."""
    doc = json.loads(text)
    if what == "requests":
        items = doc if isinstance(doc, list) else doc.get("requests", [])
        check(len(items) == 0, "dsv4ctl requests shows %s" % items[:3])
    elif what == "ranks":
        items = doc if isinstance(doc, list) else doc.get("ranks", [])
        check(all(r.get("active", 0) == 0 and r.get("rank_active", 0) == 0 for r in items),
              "dsv4ctl ranks: %s" % items)
    else:
        check(doc.get("n_running", 0) == 0 and doc.get("n_queued", 0) == 0,
              "dsv4ctl status: %s" % doc)


def shm_exports(rank_ep=None):
    """The decode-state regions in /dev/shm; with rank_ep, only those of the
    ranks registering there (their names carry the FNV-1a hash of it,
    daemons/rank/rank_kv.c kv_open), so that another deployment or test on
    the machine does not count."""
    prefix = "dsv4kv-"
    if rank_ep is not None:
        h = 2166136261
        for c in rank_ep.encode():
            h = ((h ^ c) * 16777619) & 0xffffffff
        prefix += "%08x-" % h
    try:
        return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def read_prompts(path):
    """make_prompts' file as lists of token ids."""
    with open(path) as f:
        return [[int(t) for t in line.split()] for line in f]


def reference(svc, prompts, max_tokens=MAX_TOKENS):
    r = subprocess.run([exe("tests/integration/svc_client"), "--reference", svc.model,
                        "-p", prompts, "-n", str(max_tokens)],
                       capture_output=True, text=True, check=True)
    return parse_outputs(r.stdout)


def finish(p, svc=None):
    """Wait for svc_client; fail at once if dsv4-launch gave up meanwhile."""
    end = time.monotonic() + WAIT_S * 5
    while p.poll() is None and svc is not None:
        if svc.proc.poll() is not None:
            p.kill()
            p.communicate()
            raise Fail("dsv4-launch exited (%d) under load:\n%s" %
                       (svc.proc.returncode, svc.errlog()))
        if time.monotonic() > end:
            p.kill()
            p.communicate()
            raise Fail("svc_client did not finish:\n" + svc.errlog())
        time.sleep(0.05)
    out, err = p.communicate(timeout=WAIT_S * 5)
    if p.returncode != 0:
        log("svc_client exit %d: %s" % (p.returncode, err[-2000:]))
    return parse_outputs(out), p.returncode, err


def compare(got, ref, what, errors=""):
    check(len(got) == len(ref), "%s: %d outputs for %d prompts" % (what, len(got), len(ref)))
    bad = []
    for i, (g, r) in enumerate(zip(got, ref)):
        if g[0] != "done" or g[2] != r[2] or g[1] != r[1]:
            bad.append("#%d got %s %s %s\n    want %s" % (i, g[0], g[1], g[2], r[2]))
    check(not bad, "%s: %d of %d streams differ from the single-process forward:\n%s%s" %
          (what, len(bad), len(got), "\n".join(bad[:4]),
           "\nclient: " + errors[-1500:] if errors else ""))
    log("%s: %d streams identical to the single-process forward" % (what, len(got)))


def serve_compared(svc, name, n, seed, what, max_tokens=MAX_TOKENS, lo=3, hi=40):
    """n prompts (make_prompts with seed, lo, hi) in svc.dir/name through
    the service at once: svc_client must succeed and every stream equal the
    single-process forward's.  Returns (got, ref)."""
    prompts = os.path.join(svc.dir, name)
    make_prompts(prompts, n, seed=seed, lo=lo, hi=hi)
    ref = reference(svc, prompts, max_tokens)
    got, rc, err = finish(svc.client(prompts, max_tokens), svc)
    check(rc == 0, "svc_client failed: " + err[-500:])
    compare(got, ref, what, err)
    return got, ref


def wait_progress(path, pred, what):
    """Wait until the svc_client progress file satisfies pred(counts)."""
    def ok():
        counts = {}
        try:
            with open(path) as f:
                for line in f:
                    i, n = line.split()
                    counts[int(i)] = int(n)
        except FileNotFoundError:
            return False
        return pred(counts)
    wait_for(ok, what, step=0.01)


# --- scenarios -----------------------------------------------------------------


def step_reports(svc):
    """The decode ranks' step reports in STATUS= (daemons/rank/rank_decode.c
    decode_stats): per rank a list of (steps, stream-steps, forward ms a
    step, us a step outside it)."""
    out = {}
    pat = (r"(decode@\d+) NOTIFY .*STATUS=serving as .*; (\d+) steps \((\d+) stream-steps\) "
           r"in [0-9.]+ s, forward ([0-9.]+) ms a step, ([0-9.]+) us a step outside it")
    for line in readf(svc.notify_log).splitlines():
        m = re.match(pat, line)
        if m:
            out.setdefault(m.group(1), []).append(
                (int(m.group(2)), int(m.group(3)), float(m.group(4)), float(m.group(5))))
    return out


def sc_greedy16():
    svc = Service(n_prefill=2, n_decode=2)
    try:
        got, _ = serve_compared(svc, "p16.txt", 16, 16, "16 concurrent greedy streams")
        check_warmups(svc, 2, 2)
        svc.check_no_leaks()
        # every decode step is reported by the time the ranks are idle: the
        # stream-steps are the tokens the decode ranks emitted, all but the
        # first of each stream (the prefill's)
        want = sum(len(g[2]) for g in got) - len(got)
        seen = {}

        def all_reported():
            seen["rep"] = step_reports(svc)
            return sum(n for r in seen["rep"].values() for _, n, _, _ in r) == want
        try:
            wait_for(all_reported, "the decode ranks' step reports", timeout=30, step=0.2)
        except Fail:
            raise Fail("step reports in STATUS= %s: not %d stream-steps" % (seen["rep"], want))
        rep = seen["rep"]
        check(all(s > 0 and n >= s and f > 0 and o >= 0 for r in rep.values()
                  for s, n, f, o in r), "step reports: %s" % rep)
    finally:
        stop_checked(svc)


def check_warmups(svc, n_prefill, n_decode, mtp=False):
    """Every rank ran its start-up warm-up (daemons/rank: prefill_warmup,
    decode_warmup) before it served: a call of 256 rows (the larger of 256
    and prefill_chunk, at most max_seq) and the export of its state on each
    prefill rank, a step of 16 streams (slots) on each decode rank."""
    # the daemons' logs: launch.err, or launch-HOST.err of each host
    # (tests/multihost/mh_test.py)
    text = "".join(readf(f) for f in glob.glob(os.path.join(svc.dir, "launch*.err")))
    for i in range(n_prefill):
        check(re.search(r"prefill/%d: prefill_warmup: a forward call of 256 rows took [0-9.]+ ms"
                        % i, text), "prefill@%d: no warm-up call" % i)
        # and its state's export (through shm on the cpu backend), released
        check(re.search(r"prefill/%d: prefill_warmup: a decode-state export of 256 tokens "
                        r"into a region for 256 \([1-9][0-9]* bytes, shm\) took [0-9.]+ ms" % i,
                        text),
              "prefill@%d: no warm-up export" % i)
    for i in range(n_decode):
        check(re.search(r"decode/%d: decode_warmup: a step of 16 streams%s in [0-9.]+ ms" %
                        (i, re.escape(" (verify and draft)") if mtp else ""), text),
              "decode@%d: no warm-up steps" % i)


def warmup_counts(svc):
    """Warm-ups run per rank ("prefill/0": n, ...), as launch.err logs them."""
    text = readf(os.path.join(svc.dir, "launch.err"))
    n = {}
    for m in re.finditer(r"(prefill|decode)/(\d+): (prefill_warmup: a forward call of \d+ rows "
                         r"took|decode_warmup: a step of \d+ streams.* in [0-9.]+ ms)", text):
        name = "%s/%s" % (m.group(1), m.group(2))
        n[name] = n.get(name, 0) + 1
    return n


def mtp_counters(svc, name):
    """The last (drafts, accepted) a rank reported in STATUS=, or None."""
    last = None
    for line in readf(svc.notify_log).splitlines():
        m = re.match(re.escape(name) + r" NOTIFY .*STATUS=.*mtp drafts (\d+) accepted (\d+)",
                     line)
        if m:
            last = (int(m.group(1)), int(m.group(2)))
    return last


def ctl_run(svc, *what):
    """stdout of `dsv4ctl --admin <the set's admin endpoint> WHAT...`, which
    must exit 0."""
    r = subprocess.run([exe("tools/dsv4ctl/dsv4ctl"), "--admin", svc.admin_ep] + list(what),
                       capture_output=True, text=True, timeout=30)
    check(r.returncode == 0, "dsv4ctl %s: %s" % (" ".join(what), r.stderr))
    return r.stdout


def ctl_mtp(svc, counts):
    """dsv4ctl shows the decode ranks' MTP counters (carried by their
    HEARTBEATs): per rank equal to the rank's own final STATUS= counts, "-"
    and no keys for prefill ranks, totals the sum (one rank per group)."""
    def run(*what):
        return ctl_run(svc, *what)
    want = {"decode@%d" % i: c for i, c in enumerate(counts)}
    seen = {}

    def reported():
        ranks = json.loads(run("--json", "ranks"))
        st = json.loads(run("--json", "status"))
        got = {r["name"]: (r.get("mtp_drafts"), r.get("mtp_accepted")) for r in ranks}
        seen["last"] = (got, st)
        if any(got.get(n) != c for n, c in want.items()):
            return None
        tot = (sum(d for d, _ in counts), sum(a for _, a in counts))
        if (st.get("mtp_drafts"), st.get("mtp_accepted")) != tot:
            return None
        return got, st
    try:
        got, st = wait_for(reported, "dsv4ctl reporting the MTP counters", step=0.2)
    except Fail:
        raise Fail("dsv4ctl MTP counters (ranks, status) %s, the ranks' STATUS= %s" %
                   (seen.get("last"), want))
    check(st["mtp_drafts"] > 0, "dsv4ctl status: no MTP drafts: %s" % st)
    for name, (d, a) in got.items():
        if name.startswith("prefill"):
            check(d is None and a is None, "%s reports MTP counters" % name)
    text = run("status")
    check(re.search(r"^mtp +drafts %d, accepted %d \(\d+\.\d%%\)$" %
                    (st["mtp_drafts"], st["mtp_accepted"]), text, re.M) is not None,
          "dsv4ctl status: no mtp line:\n" + text)
    text = run("ranks")
    for line in text.splitlines()[1:]:
        name = line.split()[0]
        if name in want:
            d, a = want[name]
            # the MTP column (a rank's suffixes may follow it)
            check(re.search(r" %s(  |$)" % re.escape("%d/%d (%.1f%%)" % (
                a, d, 100.0 * a / d if d else 0.0)), line) is not None,
                  "dsv4ctl ranks: %s" % line)
        else:
            check(line.endswith(" -"), "dsv4ctl ranks: %s" % line)
    log("dsv4ctl: mtp drafts %d accepted %d" % (st["mtp_drafts"], st["mtp_accepted"]))


def check_graphs(svc, want):
    """The decode ranks' kinds of step without a CUDA graph (HEARTBEAT
    graphs_refused; `want` {name: n}, the test-only count of
    DSV4_TEST_GRAPHS_REFUSED, as the cpu backend has no graphs): the rank
    warns, dsv4ctl shows them (text and --json), prefill ranks have none."""
    text = readf(os.path.join(svc.dir, "launch.err"))
    for name, n in want.items():
        pat = (r"%s: decode: %d kind\(s\) of step \(batch sizes\) now run without a CUDA "
               r"graph \(counted for a test" % (re.escape(name.replace("@", "/")), n))
        check((re.search(pat, text) is not None) == (n > 0),
              "%s: the warning of %d kinds of step without a graph" % (name, n))

    def reported():
        got = {r["name"]: r.get("graphs_refused") for r in
               json.loads(ctl_run(svc, "--json", "ranks"))}
        return got if all(got.get(k) == v for k, v in want.items()) else None
    try:
        got = wait_for(reported, "dsv4ctl showing the kinds of step without a graph", step=0.2)
    except Fail:
        raise Fail("dsv4ctl --json ranks: graphs_refused not %s" % want)
    for name, n in got.items():
        check(name in want or (name.startswith("prefill") and n is None),
              "dsv4ctl --json ranks: %s graphs_refused %s" % (name, n))
    for line in ctl_run(svc, "ranks").splitlines()[1:]:
        n = want.get(line.split()[0], 0)
        suffix = "  %d batch size%s without a graph" % (n, "" if n == 1 else "s")
        check(line.endswith(suffix) if n > 0 else "without a graph" not in line,
              "dsv4ctl ranks: %s" % line)
    log("dsv4ctl: kinds of step without a graph %s" % want)


def sc_mtp():
    # decode@1 counts 3 kinds of step without a CUDA graph (test only)
    svc = Service(n_prefill=2, n_decode=2, extra_conf="decode.mtp = yes",
                  env={"DSV4_TEST_GRAPHS_REFUSED": "decode@1:3"})
    try:
        _, ref = serve_compared(svc, "p16.txt", 16, 16, "16 greedy streams with MTP drafts")
        check_warmups(svc, 2, 2, mtp=True)
        check_graphs(svc, {"decode@0": 0, "decode@1": 3})
        svc.check_no_leaks()
        # every decode step of a stream after its first had a draft, and a
        # step emits 1 + accepted tokens: a stream of n output tokens (the
        # first from the prefill) counts drafts + accepted >= n - 2
        want = sum(max(0, len(r[2]) - 2) for r in ref)

        def counted():
            c = [mtp_counters(svc, "decode@%d" % i) for i in range(2)]
            if any(x is None for x in c):
                return None
            return c if sum(d + a for d, a in c) >= want else None
        c = wait_for(counted, "decode ranks reporting their MTP drafts")
        for i, (d, a) in enumerate(c):
            log("decode@%d: %d drafts proposed, %d accepted" % (i, d, a))
            check(0 <= a <= d, "decode@%d: %d accepted of %d drafts" % (i, a, d))
        ctl_mtp(svc, c)
    finally:
        stop_checked(svc)


def sc_batch64():
    # and a decode rank that skips its warm-up (warmup = no): the graphs
    # are recorded by the first steps of each size instead
    svc = Service(n_prefill=1, n_decode=1, extra_conf="decode.warmup = no")
    try:
        text = readf(os.path.join(svc.dir, "launch.err"))
        check("decode/0: main: warmup = no: no warm-up calls" in text and
              "decode_warmup:" not in text and "prefill_warmup:" in text,
              "decode.warmup = no: the decode rank warmed up, or the prefill rank did not")
        prompts = os.path.join(svc.dir, "p64.txt")
        make_prompts(prompts, 64, seed=64, lo=3, hi=20)
        ref = reference(svc, prompts)
        seen = {"max_decoding": 0, "max_active": 0, "max_reported": 0, "polls": 0}
        stop = threading.Event()
        poll_err = []

        def poll():
            adm = Admin(svc.admin_ep)
            try:
                while not stop.is_set():
                    reqs = adm.requests()
                    n = sum(1 for r in reqs if r["state"] in ("decoding", "handoff"))
                    dec = [r for r in adm.ranks() if r["role"] == "decode"]
                    act = max([r["active"] for r in dec] or [0])
                    # what the rank itself said in its last HEARTBEAT, sent
                    # at least once a heartbeat interval while it is busy
                    rep = max([r.get("rank_active", 0) for r in dec] or [0])
                    seen["max_decoding"] = max(seen["max_decoding"], n)
                    seen["max_active"] = max(seen["max_active"], act)
                    seen["max_reported"] = max(seen["max_reported"], rep)
                    seen["polls"] += 1
            except Exception as e:  # reported below
                poll_err.append(e)
            finally:
                adm.close()
        t = threading.Thread(target=poll)
        t.start()
        got, rc, err = finish(svc.client(prompts), svc)
        stop.set()
        t.join()
        # (poll_err apart from svc_client's stderr `err`: one name for both
        # let the thread's failures go unseen)
        check(not poll_err, "admin polling failed: %s" % poll_err)
        check(seen["polls"] > 0, "the admin poller never completed a poll")
        check(rc == 0, "svc_client failed")
        compare(got, ref, "64 submitted at once", err)
        log("max decoding at once: %d (scheduler), %d (rank active), %d (the rank's "
            "HEARTBEAT), %d polls" % (seen["max_decoding"], seen["max_active"],
                                      seen["max_reported"], seen["polls"]))
        check(seen["max_decoding"] <= 16, "%d requests decoding at once" % seen["max_decoding"])
        check(seen["max_active"] <= 16, "decode rank held %d streams" % seen["max_active"])
        check(1 <= seen["max_reported"] <= 16,
              "the decode rank's HEARTBEATs said %d streams at most while it served" %
              seen["max_reported"])
        check(seen["max_decoding"] >= 1, "never saw a request decoding")
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def kill_during_streams(victim):
    svc = Service(n_prefill=1, n_decode=1)
    try:
        prompts = os.path.join(svc.dir, "pk.txt")
        make_prompts(prompts, 16, seed=7)
        # The scheduler's kill wants four streams part-way and still going:
        # prompts are prefilled one at a time, so the first stream runs
        # ahead, and at 32 tokens it could end before the kill lands (one
        # CI run saw three resumes).
        n_out = 64 if victim == "sched" else 32
        ref = reference(svc, prompts, n_out)
        progress = os.path.join(svc.dir, "progress")
        p = svc.client(prompts, n_out, progress=progress, timeout_ms=TIMEOUT_MS)
        if victim == "prefill@0":
            # Mid-stream and mid-prefill: some stream has tokens and some
            # request is still being prefilled.
            def mid():
                reqs = svc.admin.requests()
                return (any(r["state"] == "prefilling" for r in reqs) and
                        any(r["completion_tokens"] > 0 for r in reqs))
            wait_for(mid, "a request prefilling while others stream", step=0.01)
        elif victim == "sched":
            # several streams part-way: each must resume where it was
            wait_progress(progress, lambda c: sum(n >= 2 for n in c.values()) >= 4,
                          "four streams under way")
        else:
            wait_progress(progress, lambda c: any(n >= 4 for n in c.values()),
                          "streams under way")
        old = svc.kill9(victim)
        got, rc, err = finish(p, svc)
        wait_for(lambda: svc.pid(victim) not in (None, old) and
                 svc.count(victim, "READY=1") >= 2, victim + " restarted")
        log("%s restarted as pid %d" % (victim, svc.pid(victim)))
        # A scheduler death too: libdsv4client resumes every request on the
        # restarted scheduler (docs/protocol.md §4.6), so each one completes
        # with the undisturbed output, no token twice, none missing.
        check(rc == 0, "svc_client failed: " + err[-500:])
        compare(got, ref, "16 streams across a kill -9 of " + victim, err)
        if victim == "sched":
            svc.stderr.flush()
            resumed = re.findall(r"resumes after (\d+) tokens",
                                 readf(os.path.join(svc.dir, "launch.err")))
            check(len(resumed) >= 4, "%d requests resumed with tokens, want >= 4" %
                  len(resumed))
            log("scheduler death: %d requests resumed (%s tokens had arrived)" %
                (len(resumed), ",".join(resumed)))
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_group2():
    svc = Service(n_prefill=2, n_decode=2, extra_conf="group_size = 2")
    try:
        ranks = svc.admin.ranks()
        groups = sorted((r["role"], r["group"], r["group_rank"]) for r in ranks)
        check(groups == [("decode", 0, 0), ("decode", 0, 1), ("prefill", 0, 0),
                         ("prefill", 0, 1)], "ranks are not two groups of two: %s" % groups)
        prompts = os.path.join(svc.dir, "pg.txt")
        make_prompts(prompts, 16, seed=21)
        ref = reference(svc, prompts, 32)
        wait_for(lambda: len(re.findall(r"group_comm: joined group 0 as rank",
                                        readf(os.path.join(svc.dir, "launch.err")))) == 4,
                 "both groups formed (every rank joined)")
        got, rc, err = finish(svc.client(prompts, 32), svc)
        check(rc == 0, "svc_client failed: " + err[-500:])
        compare(got, ref, "16 streams through a prefill group and a decode group", err)
        check_warmups(svc, 2, 2)   # together, in the groups' first joins
        # kill one decode rank of the group mid-stream
        progress = os.path.join(svc.dir, "progress")
        p = svc.client(prompts, 32, progress=progress)
        wait_progress(progress, lambda c: any(n >= 4 for n in c.values()), "streams under way")
        survivor = svc.pid("decode@0")
        old = svc.kill9("decode@1")
        got, rc, err = finish(p, svc)
        check(rc == 0, "svc_client failed: " + err[-500:])
        compare(got, ref, "16 streams across a kill -9 of decode@1 (group of 2)", err)
        wait_for(lambda: svc.pid("decode@1") not in (None, old) and
                 svc.count("decode@1", "READY=1") >= 2, "decode@1 restarted")
        check(svc.pid("decode@0") == survivor, "decode@0 was restarted too")
        check(svc.count("decode@0", "READY=1") == 1, "decode@0 started more than once")
        log("decode@1 restarted as pid %d; decode@0 kept pid %d" % (svc.pid("decode@1"),
                                                                   survivor))
        # the re-formed group serves again
        got2, rc2, err2 = finish(svc.client(prompts, 32), svc)
        check(rc2 == 0, "svc_client after the re-forming failed")
        compare(got2, ref, "16 streams after the group re-formed", err2)
        # the new decode@1 owed its warm-up: the re-formed group ran it
        # together (decode@0 a second time); the prefill group did not
        n = warmup_counts(svc)
        check(n == {"prefill/0": 1, "prefill/1": 1, "decode/0": 2, "decode/1": 2},
              "warm-ups per rank: %s" % n)
        check(re.search(r"decode/0: group_join: epoch \d+: the group's warm-up calls \(a peer "
                        r"owes them\)", readf(os.path.join(svc.dir, "launch.err"))),
              "decode@0 did not warm up for its peer")
        log("the re-formed decode group warmed up together for the new decode@1: %s" % n)
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_group_break():
    """Groups of two whose communicator breaks with every rank alive, and a
    slow join (test-only fault injection, daemons/rank/rank.h)."""
    hb_ms, liveness = 500, 10               # Service's default: a forward call of a
                                            # sanitizer build may take seconds
    delay_ms = hb_ms * liveness + 1000      # longer than the liveness window
    env = {"DSV4_TEST_JOIN_DELAY_MS": "decode@1:%d" % delay_ms,
           "DSV4_TEST_GROUP_BREAK": "decode@1:10,prefill@0:2"}
    svc = Service(n_prefill=2, n_decode=2, extra_conf="group_size = 2", env=env, wait=False,
                  heartbeat=(hb_ms, liveness))
    try:
        # 1. decode@1 starts its first join late; decode@0 waits for it in
        # its own join.  Both keep heartbeating: shown joining, never dead.
        def joining():
            st = {(r["role"], r["index"]): r["state"] for r in svc.admin.ranks()}
            return st.get(("decode", 0)) == "joining" and st.get(("decode", 1)) == "joining"
        wait_for(joining, "decode@0 and decode@1 shown joining", step=0.02)
        svc.wait_ranks(4)
        text = readf(os.path.join(svc.dir, "launch.err"))
        check("test-only delay of %d ms" % delay_ms in text, "the join was not delayed")
        silent = re.findall(r"rank \S+ lost: no message within the liveness interval", text)
        check(not silent, "taken for dead during the slow join: %s" % silent)
        log("slow join (%d ms > liveness %d ms): ranks shown joining, none dead" %
            (delay_ms, hb_ms * liveness))
        # 2. decode@1's 10th and prefill@0's 2nd forward call fail: each
        # group breaks mid-work with every rank alive and re-forms.
        # The requests re-run after a break run on the re-formed group, so
        # their output shows that it serves again.
        pids = svc.pids("prefill@0", "prefill@1", "decode@0", "decode@1")
        serve_compared(svc, "pb.txt", 8, 33, "8 streams across a break of each group", 24)
        text = readf(os.path.join(svc.dir, "launch.err"))
        for g in ("prefill/0", "decode/0"):
            check(re.search(r"group %s: communicator of epoch \d+ broke" % g, text),
                  "group %s did not break and re-form" % g)
        svc.check_reruns(1, "the breaks")
        svc.check_kept(pids)
        svc.check_exits()
        # every rank warmed up once: a re-forming of the same processes owes none
        n = warmup_counts(svc)
        check(n == {"prefill/0": 1, "prefill/1": 1, "decode/0": 1, "decode/1": 1},
              "warm-ups per rank: %s" % n)
        log("both groups broke and re-formed without a restart or a rank death")
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_group_rejoin():
    """A decode group's rank killed while the group forms: the survivor,
    waiting in the join for its dead peer, gives that join up when the
    restarted peer's epoch comes, and the group forms and serves."""
    delay_ms = 8000   # decode@1's joins (each process's first) wait this long
    env = {"DSV4_TEST_JOIN_DELAY_MS": "decode@1:%d" % delay_ms}
    svc = Service(n_prefill=1, n_decode=2, extra_conf="decode.group_size = 2", env=env,
                  wait=False)
    try:
        launch_err = os.path.join(svc.dir, "launch.err")
        wait_for(lambda: "decode/1: group_join: test-only delay" in readf(launch_err),
                 "decode@1 in its delayed join")
        survivor = svc.pids("decode@0")
        old = svc.kill9("decode@1")
        # decode@0 waited in the old epoch's communicator for decode@1
        wait_for(lambda: re.search(r"decode/0: group_join: epoch \d+ given up \(.*the join was "
                                   r"stopped\)", readf(launch_err)),
                 "decode@0 giving its join up")
        text = readf(launch_err)
        check("did not assemble" not in text, "a join waited out its deadline")
        wait_for(lambda: svc.pid("decode@1") not in (None, old), "decode@1 restarted")
        svc.wait_ranks(3)
        serve_compared(svc, "pj.txt", 4, 46, "4 streams after the group formed again", 16)
        svc.check_kept(survivor)
        log("decode@1 killed in its join: decode@0 gave the join up at once and the group "
            "formed with the new decode@1")
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_join_stop():
    """The set stopped while a rank waits in its join: the wait ends at
    the stop, and every child exits cleanly."""
    env = {"DSV4_TEST_JOIN_DELAY_MS": "decode@1:60000"}   # > the stop timeout (-t 20)
    svc = Service(n_prefill=1, n_decode=2, extra_conf="decode.group_size = 2", env=env,
                  wait=False)
    launch_err = os.path.join(svc.dir, "launch.err")
    try:
        wait_for(lambda: "decode/1: group_join: test-only delay" in readf(launch_err),
                 "decode@1 in its delayed join")
    except Fail:
        svc.stop()
        raise
    rc = svc.stop()
    text = readf(launch_err)
    check(re.search(r"decode/1: group_join: giving up the join of epoch \d+ \(the link is "
                    r"left or the rank stops\)", text),
          "decode@1 did not give its join up")
    check("SIGKILL" not in text, "a child had to be killed:\n%s" % text[-6000:])
    exits = svc.exits()
    check(len(exits) == 4 and all(st == "exit=0" for _, st in exits),
          "child exits at the stop: %s" % exits)
    check(rc == 0, "dsv4-launch did not stop cleanly")
    log("stopped during decode@1's 60 s join: the join was given up, every child exited 0")


def sc_group_mismatch():
    """A decode group whose ranks differ in slots cannot run the same calls:
    the rank whose join fails says why, registers again with a growing
    pause (not hundreds of epochs a second), the other group serves on, and
    the set stops cleanly.  One whose ranks differ in numerics is refused by
    the join's exchange, with the reason."""
    svc = Service(n_prefill=1, n_decode=2,
                  extra_conf="decode.group_size = 2\ndecode@1.slots = 8", wait=False)
    try:
        launch_err = os.path.join(svc.dir, "launch.err")
        wait_for(lambda: "decode/1: group_join: 5 joins failed in a row; registering again in "
                 "2000 ms" in readf(launch_err), "decode@1 backing off")
        text = readf(launch_err)
        check(re.search(r"decode/1: group_join: epoch \d+: comm shm: \S+: the ranks' largest "
                        r"calls differ \(\d+ bytes at rank 0, \d+ here\)", text),
              "the failed join does not say why")
        n = len(re.findall(r"group decode/0 complete \(epoch", text))
        check(n <= 8, "%d epochs of the decode group by its 5th failed join" % n)
        check(not re.search(r"decode/\d: group_comm: joined", text),
              "the decode group formed with different slots")
        check(svc.count("decode@0", "READY=1") == 1 and svc.count("decode@1", "READY=1") == 1,
              "a decode rank restarted")
        svc.wait_ranks(1)   # prefill@0, alone
        log("a decode group of 16 and 8 slots: its joins fail with the reason, %d epochs by "
            "the 5th failure (backing off)" % n)
    finally:
        stop_checked(svc)
    # The same calls' sizes but another layout (numerics: the ranks' shares
    # would not be of one model; mtp or the split would make other
    # collectives): the join's exchange refuses it, naming what to align.
    svc = Service(n_prefill=1, n_decode=2,
                  extra_conf="decode.group_size = 2\ndecode@1.numerics = hf", wait=False)
    try:
        launch_err = os.path.join(svc.dir, "launch.err")
        wait_for(lambda: "group: its ranks differ in mtp, group_split, DSV4_MOE_LOCAL or "
                 "numerics" in readf(launch_err), "the layouts' refusal")
        check(not re.search(r"decode/\d: group_comm: joined", readf(launch_err)),
              "the decode group formed with different numerics")
        log("a decode group of ref and hf numerics: its joins fail with the reason")
    finally:
        stop_checked(svc)


def sc_model_mismatch():
    """A decode rank started on another checkpoint (same config, another
    seed) beside a running set: its READY is refused with both models'
    fingerprints and the checkpoint the scheduler reads, and it backs off;
    the set serves on, every stream equal to the single-process forward (no
    stream mixes models)."""
    other = os.path.join(scratch_dir("dsv4-other-"), "model")
    subprocess.run([exe("tools/mkmodel/dsv4-mkmodel"), "--preset", "tiny", "--seed", "99",
                    "--out", other], check=True, stdout=subprocess.DEVNULL)
    svc = Service(n_prefill=1, n_decode=1)
    err = open(os.path.join(svc.dir, "decode1.err"), "w")
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    odd = subprocess.Popen([exe("daemons/rank/dsv4-decode"), "-v", "-f", svc.conf, "--rank",
                            "1", "--checkpoint", other], stderr=err, env=env)
    try:
        pat = (r"link_lost: READY refused \(2 in a row\): model ([0-9a-f]{16}) differs from "
               r"the model ([0-9a-f]{16}) of checkpoint %s, which this scheduler is "
               r"configured with" % re.escape(svc.model))
        odd_log = os.path.join(svc.dir, "decode1.err")
        wait_for(lambda: re.search(pat, readf(odd_log)), "the odd decode@1 refused twice")
        m = re.search(pat, readf(odd_log))
        text = readf(os.path.join(svc.dir, "launch.err"))
        check(m.group(1) != m.group(2), "the same fingerprint twice: %s" % m.group(0))
        check("rank_init: model fingerprint %s" % m.group(1) in readf(odd_log),
              "decode@1's own fingerprint is not %s" % m.group(1))
        for who in ("decode/0", "prefill/0"):
            check("%s: rank_init: model fingerprint %s" % (who, m.group(2)) in text,
                  "%s's fingerprint is not %s" % (who, m.group(2)))
        check("sched: model %s (checkpoint %s)" % (m.group(2), svc.model) in text,
              "the scheduler did not log its reference model")
        check(not any((r["role"], r["index"]) == ("decode", 1) for r in svc.admin.ranks()),
              "decode@1 registered")
        # the admin protocol says the reference and each rank's model
        st, ranks = svc.admin.status(), svc.admin.ranks()
        check(st.get("model") == m.group(2), "STATUS model %s, want the checkpoint's %s" %
              (st.get("model"), m.group(2)))
        check(len(ranks) == 2 and all(r.get("model") == m.group(2) for r in ranks),
              "RANK models: %s" % [r.get("model") for r in ranks])
        serve_compared(svc, "pm.txt", 6, 23, "6 streams beside a refused decode rank")
        odd.terminate()
        check(odd.wait(30) == 0, "the refused decode@1's exit status %s" % odd.returncode)
        log("a decode rank of another checkpoint refused (%s against %s); 6 streams served "
            "by the set" % (m.group(1), m.group(2)))
        svc.check_no_leaks()
    finally:
        if odd.poll() is None:
            odd.kill()
            odd.wait()
        err.close()
        stop_checked(svc)


def sc_prefill_nomem():
    """A prefill rank's forward call that runs out of device memory (test-only
    injection, daemons/rank/rank.h): the rank stays up and its prompts run
    again."""
    env = {"DSV4_TEST_FORWARD_NOMEM": "prefill@0:3"}   # the warm-up is call 1
    svc = Service(n_prefill=1, n_decode=1, env=env)
    try:
        # prompts of 3-39 tokens in chunks of 16: the second forward call
        # holds prompts part-way through, whose slots must start clean again
        pids = svc.pids("prefill@0")
        serve_compared(svc, "pn.txt", 6, 44, "6 streams across an out-of-memory forward call", 16)
        text = readf(os.path.join(svc.dir, "launch.err"))
        check(re.search(r"prefill_work: forward of \d+ rows: out of device memory injected "
                        r"for a test .*go back to the scheduler", text),
              "the failed forward call was not logged")
        check(re.search(r"req_rerun: .*\(prefill rank out of memory\)", text),
              "no re-run after the failed forward call")
        st = svc.check_reruns(1, "the failed forward call")
        svc.check_kept(pids)
        svc.check_exits()
        log("a forward call out of device memory: prefill@0 kept, %d re-run(s), outputs "
            "equal to the oracle's" % st["reruns"])
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_decode_nomem():
    """A decode step that runs out of device memory (test-only injection,
    daemons/rank/rank.h), on a plain decode rank and on one with MTP: each
    rank stays up and gives the step's streams back, which re-run."""
    env = {"DSV4_TEST_FORWARD_NOMEM": "decode@0:5,decode@1:5"}   # the 5th step each
    svc = Service(n_prefill=1, n_decode=2, extra_conf="decode@1.mtp = yes", env=env)
    try:
        pids = svc.pids("decode@0", "decode@1")
        serve_compared(svc, "dn.txt", 8, 47, "8 streams across a step out of memory on each "
                       "decode rank", 24)
        text = readf(os.path.join(svc.dir, "launch.err"))
        for what in (r"decode/0: decode_work: forward of \d+ streams",
                     r"decode/1: decode_work_spec: verify and draft of \d+ streams"):
            check(re.search(what + r": out of device memory injected for a test .*they go "
                            r"back to the scheduler", text), "not logged: %s" % what)
        check(re.search(r"req_rerun: .*\(decode rank out of memory\)", text),
              "no re-run after the failed steps")
        st = svc.check_reruns(2, "the failed steps")
        svc.check_kept(pids)
        svc.check_exits()
        log("a step out of device memory on each decode rank: both kept, %d re-run(s), "
            "outputs equal to the oracle's" % st["reruns"])
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def check_lowered(svc):
    """prefill@0 lowered its rows per call at its warm-up (256 -> 128) and
    started once; the scheduler knows (READY call_rows), logs it, and shows it
    in dsv4ctl (text and --json) and the other ranks as not lowered."""
    check(svc.count("prefill@0", "STATUS=serving as prefill@0 (1 slots, 128 rows a call)")
          >= 1, "prefill@0's STATUS= does not say 128 rows a call")
    check(svc.count("prefill@0", "READY=1") == 1, "prefill@0 started more than once")
    check(re.search(r"rank prefill@0 runs prompts in forward calls of 128 rows, lowered from "
                    r"256 \(its warm-up ran out of device memory\)",
                    readf(os.path.join(svc.dir, "launch.err"))),
          "the scheduler did not log prefill@0's lowered rows")
    def run(*what):
        return ctl_run(svc, *what)
    for r in json.loads(run("--json", "ranks")):
        rows = (r.get("call_rows"), r.get("call_rows_full"))
        if r["name"] == "prefill@0":
            check(rows == (128, 256), "dsv4ctl --json ranks: prefill@0 %s" % r)
        elif r["role"] == "prefill":
            check(rows == (256, 256), "dsv4ctl --json ranks: %s" % r)
        else:
            check(rows == (None, None), "dsv4ctl --json ranks: a decode rank %s" % r)
    for line in run("ranks").splitlines()[1:]:
        lowered = line.endswith("  rows 128 of 256 a call")
        check(lowered == line.startswith("prefill@0 "), "dsv4ctl ranks: %s" % line)


def sc_prefill_warmup():
    """A prefill rank's start-up warm-up call that runs out of device memory
    (test-only injection): the rank halves its rows per call, starts once,
    and serves prompts longer than the new call size in several calls."""
    env = {"DSV4_TEST_FORWARD_NOMEM": "prefill@0:1"}
    svc = Service(n_prefill=1, n_decode=1, extra_conf="prefill.prefill_chunk = 256", env=env)
    try:
        text = readf(os.path.join(svc.dir, "launch.err"))
        check(re.search(r"prefill_warmup: a forward call of 256 rows: out of device memory "
                        r"injected for a test .*rows per call lowered to 128", text),
              "the failed warm-up call was not logged")
        check(re.search(r"prefill_warmup: a forward call of 128 rows took [0-9.]+ ms", text),
              "no warm-up call of 128 rows")
        check_lowered(svc)
        # prompts of 150-199 tokens: two forward calls each at 128 rows
        serve_compared(svc, "pw.txt", 4, 45, "4 long prompts after a lowered warm-up", 16,
                       lo=150, hi=200)
        st = svc.admin.status()
        check(st["rank_deaths"] == 0 and st["n_failed"] == 0, "after the warm-up: %s" % st)
        svc.check_exits()
        log("warm-up out of device memory: rows per call 256 -> 128, prefill@0 started once, "
            "4 long prompts equal to the oracle's")
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_export_nomem():
    """Decode-state exports out of device memory: at the warm-up the rank
    lowers its calls; while serving the prompt runs again."""
    env = {"DSV4_TEST_EXPORT_NOMEM": "prefill@0:1,prefill@1:2"}
    svc = Service(n_prefill=2, n_decode=1, extra_conf="prefill.prefill_chunk = 256", env=env)
    try:
        text = readf(os.path.join(svc.dir, "launch.err"))
        check(re.search(r"prefill/0: prefill_warmup: the decode-state export of 256 tokens "
                        r"into a region for 256 \(\d+ bytes, shm\): out of device memory "
                        r"injected for a test \(DSV4_TEST_EXPORT_NOMEM\); rows per call lowered "
                        r"to 128", text),
              "the failed warm-up export was not logged")
        # the region is the longest prompt's still (max_seq = 256)
        check(re.search(r"prefill/0: prefill_warmup: a decode-state export of 128 tokens into a "
                        r"region for 256 \(", text), "no warm-up export of 128 tokens")
        check_lowered(svc)
        check(svc.count("prefill@1", "STATUS=serving as prefill@1 (1 slots, 256 rows a call)")
              >= 1, "prefill@1's STATUS= does not say 256 rows a call")
        # prompts of 150-199 tokens: two calls each on prefill@0
        serve_compared(svc, "pe.txt", 8, 47, "8 long prompts across failed exports", 16,
                       lo=150, hi=200)
        text = readf(os.path.join(svc.dir, "launch.err"))
        check(re.search(r"prefill/1: kv_export: req=\d+ bytes=\d+: out of device memory "
                        r"injected for a test", text), "prefill@1's export did not fail")
        svc.check_reruns(1, "an export out of memory")
        svc.check_exits()
        log("exports out of device memory: at the warm-up rows per call 256 -> 128 (started "
            "once); while serving the prompt re-ran; 8 streams equal to the oracle's")
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_kill_decode():
    kill_during_streams("decode@0")


def sc_kill_prefill():
    kill_during_streams("prefill@0")


def sc_kill_sched():
    kill_during_streams("sched")


def sc_restart_sched():
    """A scheduler stopped on purpose (SIGTERM) under 16 streams while its
    ranks serve on, as `systemctl restart dsv4-sched`: it finishes for
    stop_timeout_ms, then answers what is left with 302 and exits 0; the
    clients' reconnect starts it again (dsv4-launch keeps its listeners, as
    dsv4-sched.socket does), libdsv4client resumes each 302'd request there,
    and every stream == the undisturbed output, none failed."""
    svc = Service(n_prefill=1, n_decode=1, extra_conf="stop_timeout_ms = 600\n")
    try:
        prompts = os.path.join(svc.dir, "pr.txt")
        make_prompts(prompts, 16, seed=11)
        ref = reference(svc, prompts, 64)
        prompts2 = os.path.join(svc.dir, "pr2.txt")
        make_prompts(prompts2, 4, seed=12)
        ref2 = reference(svc, prompts2, 16)
        progress = os.path.join(svc.dir, "progress")
        p = svc.client(prompts, 64, progress=progress, timeout_ms=TIMEOUT_MS)
        wait_progress(progress, lambda c: sum(n >= 2 for n in c.values()) >= 4,
                      "four streams under way")
        old = svc.pid("sched")
        log("SIGTERM sched pid=%d" % old)
        svc.stopped.add("sched")
        os.kill(old, signal.SIGTERM)
        # new requests sent while it stops (302 at once) or while it is
        # down: the next scheduler serves them
        p2 = svc.client(prompts2, 16, timeout_ms=TIMEOUT_MS)
        got, rc, err = finish(p, svc)
        check(rc == 0, "svc_client failed: " + err[-500:])
        compare(got, ref, "16 streams across a restart of the scheduler", err)
        got2, rc2, err2 = finish(p2, svc)
        check(rc2 == 0, "svc_client (sent during the restart) failed: " + err2[-500:])
        compare(got2, ref2, "4 streams sent during the restart", err2)
        check(svc.pid("sched") != old and svc.count("sched", "READY=1") >= 2,
              "the scheduler was not started again")
        check(("sched", "exit=0") in svc.exits(), "the stopped scheduler's exit: %s" %
              svc.exits())
        svc.stderr.flush()
        text = readf(os.path.join(svc.dir, "launch.err"))
        left = re.findall(r"stopping: (\d+) requests left: 302 ", text)
        check(left and int(left[0]) > 0, "the stopping scheduler answered no request "
              "with 302:\n" + svc.errlog())
        check("starting the scheduler again (socket activation)" in text,
              "dsv4-launch did not start the scheduler on the clients' reconnect")
        resumed = re.findall(r"resumes after (\d+) tokens", text)
        check(len(resumed) >= 1, "no request resumed with tokens")
        log("scheduler restart: %s requests left at the stop timeout (302), %d resumed "
            "with tokens, all 16 == the undisturbed output" % (left[0], len(resumed)))
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_cancel1000():
    svc = Service(n_prefill=1, n_decode=1)
    try:
        prompts = os.path.join(svc.dir, "pc.txt")
        make_prompts(prompts, 10, seed=1000, lo=3, hi=12)
        ref = reference(svc, prompts, 16)
        got, rc, err = finish(svc.client(prompts, 16, extra=["-r", "100", "-w", "64",
                                                            "--cancel", "4242"]), svc)
        check(rc == 0, "svc_client failed: " + err[-500:])
        check(len(got) == 1000, "%d results" % len(got))
        n_cancelled = 0
        for i, g in enumerate(got):
            r = ref[i % 10]
            check(g[0] == "done", "#%d ended with %s %s" % (i, g[0], g[1]))
            check(g[2] == r[2][:len(g[2])], "#%d output is not a prefix of the reference" % i)
            if g[1] == "cancelled":
                n_cancelled += 1
            else:
                check(g[2] == r[2], "#%d finished (%s) with a short output" % (i, g[1]))
        log("1000 requests: %d cancelled, %d finished" % (n_cancelled, 1000 - n_cancelled))
        check(n_cancelled > 0, "no request was cancelled")
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_ctl_cancel():
    """dsv4ctl cancel: of two requests held in the queue (their prefill rank
    drained), the one cancelled from the admin socket ends "cancelled" without
    a token; the other runs once the rank is undrained and matches the
    single-process forward.  An id not in flight is 404 (exit 1), a word a
    usage error (exit 2); nothing leaks."""
    svc = Service(n_prefill=1, n_decode=1)
    ctl = [exe("tools/dsv4ctl/dsv4ctl"), "--admin", svc.admin_ep]

    def run_ctl(*args):
        r = subprocess.run(ctl + list(args), capture_output=True, text=True, timeout=30)
        return r.returncode, r.stdout, r.stderr
    try:
        prompts = os.path.join(svc.dir, "pq.txt")
        make_prompts(prompts, 2, seed=31)
        ref = reference(svc, prompts, 8)
        check(svc.admin.drain("prefill@0", 60000)["code"] == 200, "drain prefill@0 failed")
        p = svc.client(prompts, 8)
        wait_for(lambda: [r["state"] for r in svc.admin.requests()] == ["queued", "queued"],
                 "two requests queued")
        victim = max(r["req"] for r in svc.admin.requests())
        rc, out, err = run_ctl("cancel", str(victim))
        check(rc == 0 and "request %d cancelled" % victim in out,
              "dsv4ctl cancel %d: exit %d, %s%s" % (victim, rc, out, err))
        left = [r["req"] for r in svc.admin.requests()]
        check(len(left) == 1 and left[0] != victim, "listed after the cancel: %s" % left)
        check(svc.admin.status().get("n_cancelled") == 1, "status does not count the cancel")
        rc, out, err = run_ctl("cancel", str(victim))
        check(rc == 1 and "404" in err, "a second cancel: exit %d, %s%s" % (rc, out, err))
        rc, out, err = run_ctl("--json", "cancel", "18446744073709551615")
        check(rc == 1 and json.loads(out)["code"] == 404,
              "cancel of an unknown id: exit %d, %s%s" % (rc, out, err))
        for word in ("x1", "0", "-3", "18446744073709551616", ""):
            rc, out, err = run_ctl("cancel", word)   # "-3" is taken as an option
            check(rc == 2 and ("not a request id" in err or "invalid option" in err),
                  "dsv4ctl cancel '%s': exit %d, %s" % (word, rc, err))
        check(svc.admin.undrain("prefill@0")["code"] == 200, "undrain failed")
        got, rc, err = finish(p, svc)
        check(rc == 0, "svc_client failed: " + err[-500:])
        cancelled = [i for i, g in enumerate(got) if g[1] == "cancelled"]
        check(len(cancelled) == 1 and got[cancelled[0]][0] == "done" and
              not got[cancelled[0]][2], "outcomes %s" % [g[:2] for g in got])
        kept = 1 - cancelled[0]
        compare([got[kept]], [ref[kept]], "the request left in the queue", err)
        log("dsv4ctl cancel: a queued request cancelled, the other served; 404 and usage")
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_drain():
    svc = Service(n_prefill=1, n_decode=2)
    try:
        prompts = os.path.join(svc.dir, "pd.txt")
        make_prompts(prompts, 16, seed=99)
        ref = reference(svc, prompts, 32)
        p1 = svc.client(prompts, 32)

        def d0():
            return [r for r in svc.admin.ranks() if r["role"] == "decode" and r["index"] == 0][0]
        wait_for(lambda: d0()["active"] > 0, "decode@0 streaming", step=0.01)
        result = {}

        def do_drain():
            adm = Admin(svc.admin_ep)
            try:
                result["r"] = adm.drain("decode@0")
                result["after"] = [r for r in adm.ranks()
                                   if r["role"] == "decode" and r["index"] == 0][0]
            finally:
                adm.close()
        t = threading.Thread(target=do_drain)
        t.start()
        wait_for(lambda: d0()["state"] in ("draining", "drained"), "decode@0 draining")
        # (placements are counted at dispatch, in the loop that set the
        # state: none may follow once it reads draining)
        placed_draining = d0()["placed"]
        # New work while draining: must not land on decode@0.
        p2 = svc.client(prompts, 32)
        actives = []
        while t.is_alive():
            actives.append(d0()["active"])
            time.sleep(0.02)
        t.join()
        check(result["r"]["code"] == 200, "drain answered %s" % result["r"])
        check(result["after"]["active"] == 0 and result["after"]["state"] == "drained",
              "after drain returned decode@0 is %s" % result["after"])
        check(all(a >= b for a, b in zip(actives, actives[1:])),
              "decode@0 took new streams while draining: %s" % actives)
        # ... and by count, which the samples above miss when the drain ends
        # between two of them or a new stream replaces a finished one
        check(result["after"]["placed"] == placed_draining,
              "decode@0 placed %d while draining (%d when it read draining, %d at the end)" %
              (result["after"]["placed"] - placed_draining, placed_draining,
               result["after"]["placed"]))
        log("decode@0 active while draining: %s" % sorted(set(actives), reverse=True))
        got1, rc1, err1 = finish(p1, svc)
        got2, rc2, err2 = finish(p2, svc)
        check(rc1 == 0 and rc2 == 0, "svc_client failed")
        compare(got1, ref, "streams running when the drain started", err1)
        compare(got2, ref, "streams submitted during the drain", err2)
        # nothing was placed on decode@0 from the drain's end on (its
        # `active` is 0 once every client is done, whatever happened)
        check(d0()["placed"] == result["after"]["placed"],
              "decode@0 got work after its drain: placed %d, %d when the drain returned" %
              (d0()["placed"], result["after"]["placed"]))
        check(svc.admin.undrain("decode@0")["code"] == 200, "undrain failed")
        wait_for(lambda: d0()["state"] == "ready", "decode@0 ready again")
        # Global drain: admits nothing (301), undrain restores.
        check(svc.admin.drain("all", 60000)["code"] == 200, "drain all failed")
        one = os.path.join(svc.dir, "one.txt")
        make_prompts(one, 1, seed=1)
        got3, _, _ = finish(svc.client(one, 4), svc)
        check(got3[0][0] == "error" and got3[0][1] == "301",
              "request during global drain: %s" % (got3[0][:2],))
        check(svc.admin.undrain("all")["code"] == 200, "undrain all failed")
        got4, rc4, _ = finish(svc.client(one, 4), svc)
        check(rc4 == 0 and got4[0][0] == "done", "request after undrain: %s" % (got4[0][:2],))
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sc_stop_drain():
    svc = Service(n_prefill=1, n_decode=2)
    try:
        prompts = os.path.join(svc.dir, "ps.txt")
        make_prompts(prompts, 16, seed=77)
        n_out = 96
        ref = reference(svc, prompts, n_out)
        ref8 = reference(svc, prompts, 8)
        p1 = svc.client(prompts, n_out)

        def d0():
            r = [r for r in svc.admin.ranks() if r["role"] == "decode" and r["index"] == 0]
            return r[0] if r else None

        def booked_d0():
            return [r for r in svc.admin.requests()
                    if r["state"] == "prefilling" and r.get("decode_group") == 0]
        # decode@0 streams, and a prompt booked on it is held in prefill
        # (prefill@0 stopped): the stopping rank must wait for it too
        pre = svc.pid("prefill@0")
        wait_for(lambda: d0() is not None and d0()["active"] >= 1, "decode@0 streaming",
                 step=0.01)
        for _ in range(200):
            os.kill(pre, signal.SIGSTOP)
            if booked_d0():
                break
            os.kill(pre, signal.SIGCONT)
            time.sleep(0.02)
        else:
            raise Fail("no prompt booked on decode@0 while in prefill")
        try:
            os.kill(svc.pid("decode@0"), signal.SIGTERM)
            svc.stopped.add("decode@0")
            wait_for(lambda: d0()["state"] == "draining", "decode@0 draining: %s" % d0(), step=0.01)
            # its own streams end; the booked prompt keeps it
            wait_for(lambda: d0()["rank_active"] == 0, "decode@0's own streams done")
            time.sleep(1.0)
            check("decode@0 EXIT" not in readf(svc.notify_log),
                  "decode@0 stopped with a prompt booked on it still in prefill")
            check(d0()["state"] == "draining" and d0()["active"] >= 1,
                  "decode@0 while its booked prompt waits: %s" % d0())
        finally:
            os.kill(pre, signal.SIGCONT)
        # new work meanwhile: to decode@1 only
        p2 = svc.client(prompts, 8)
        wait_for(lambda: "decode@0 EXIT" in readf(svc.notify_log), "decode@0 exits")
        got1, rc1, err1 = finish(p1, svc)
        got2, rc2, err2 = finish(p2, svc)
        check(rc1 == 0 and rc2 == 0, "svc_client failed: %s %s" % (err1[-300:], err2[-300:]))
        compare(got1, ref, "streams running when decode@0 got SIGTERM", err1)
        compare(got2, ref8, "streams sent while decode@0 stopped", err2)
        svc.stderr.flush()
        text = readf(os.path.join(svc.dir, "launch.err"))
        m = re.search(r"decode/0: rank_signal: Terminated: finishing its requests \((\d+) here\) "
                      r"and those booked on its group \(at most 20 s\) before stopping", text)
        check(m is not None, "no 'finishing' line: %s" % text[-1500:])
        check("decode/0: rank_loop: done, stopping" in text, "decode@0 did not end idle")
        check(re.search(r"rank decode@0: stopping; it finishes its \d+ requests", text),
              "the scheduler did not log the rank's drain")
        check(("decode@0", "exit=0") in svc.exits(), "decode@0's exit: %s" % svc.exits())
        st = svc.admin.status()
        check(st["reruns"] == 0 and st["n_failed"] == 0,
              "streams re-ran or failed across the stop: %s" % st)
        log("decode@0 stopped with %s streams and a prompt booked in prefill: finished there, "
            "no re-run, exit 0" % m.group(1))
        svc.check_no_leaks()
        # The whole set stopped under load (dsv4-launch's SIGTERM, as
        # `systemctl stop dsv4.target`): the ranks first, each finishing
        # its streams while the scheduler serves them, then the scheduler
        progress = os.path.join(svc.dir, "progress3")
        p3 = svc.client(prompts, n_out, progress=progress)
        started = {}

        def under_way(c):
            started.clear()
            started.update(c)
            return sum(n >= 2 for n in c.values()) >= 2
        wait_progress(progress, under_way, "streams under way")
        svc.proc.send_signal(signal.SIGTERM)
        got3, rc3, err3 = finish(p3)
        check(svc.proc.wait(60) == 0, "dsv4-launch's exit after SIGTERM")
        # streams under way when the stop came end normally; prompts still
        # queued (no rank takes new work while stopping) may get the
        # scheduler's 500 after its 10 s (docs/operations.md §5)
        running = [i for i, n in started.items() if n >= 1]
        compare([got3[i] for i in running], [ref[i] for i in running],
                "streams under way when the set was stopped", err3)
        rest = [i for i in range(len(got3)) if i not in running]
        bad = [i for i in rest if not (got3[i][0] == "done" and got3[i][2] == ref[i][2]) and
               not (got3[i][0] == "error" and got3[i][1] == "500")]
        check(not bad, "queued prompts across the stop: %s" % [got3[i][:2] for i in bad])
        lines = readf(svc.notify_log).splitlines()
        sched_stop = [i for i, ln in enumerate(lines) if ln.startswith("sched NOTIFY STOPPING=1")]
        rank_exits = [i for i, ln in enumerate(lines)
                      if re.match(r"(prefill|decode)@\d+ EXIT", ln)]
        check(sched_stop and rank_exits and sched_stop[0] > max(rank_exits),
              "the scheduler stopped before the ranks had exited:\n%s" % "\n".join(lines[-30:]))
        log("the set stopped under load: the ranks finished the %d streams under way, then the "
            "scheduler stopped" % len(running))
    finally:
        stop_checked(svc)


def sc_burst():
    """A burst prefill rank (prefill@1.burst = yes, docs/operations.md "Burst
    prefill"): it takes the prompts of an idle service, the plain prefill@0
    those that arrive while streams decode, and it stands in when prefill@0
    is drained; with burst_free_slots = 1 (the default; off at first, then
    reloaded) it also takes prompts that would wait for a busy prefill@0
    while decode slots are free; every output equals the single-process
    forward."""
    svc = Service(n_prefill=2, n_decode=1,
                  extra_conf="prefill@1.burst = yes\nburst_free_slots = 0\n")
    try:
        def ranks():
            return {"%s@%d" % (r["role"], r["index"]): r for r in svc.admin.ranks()}

        def placed():
            rk = ranks()
            return rk["prefill@0"].get("placed", 0), rk["prefill@1"].get("placed", 0)
        rk = ranks()
        check(rk["prefill@1"].get("burst") is True and not rk["prefill@0"].get("burst") and
              not rk["decode@0"].get("burst"), "burst flags in RANK: %s" % rk)
        # One request at a time: the decode group is idle at each dispatch.
        one = os.path.join(svc.dir, "one.txt")
        make_prompts(one, 1, seed=5)
        ref1 = reference(svc, one, 8)
        for i in range(4):
            got, rc, err = finish(svc.client(one, 8), svc)
            check(rc == 0, "svc_client failed")
            compare(got, ref1, "sequential request %d" % i, err)
        check(placed() == (0, 4), "idle service: prompts placed (prefill@0, prefill@1) = %s, "
              "want (0, 4)" % (placed(),))
        # 16 at once: the first finds the decode group idle, the rest do not.
        p16 = os.path.join(svc.dir, "p16.txt")
        make_prompts(p16, 16, seed=16)
        ref16 = reference(svc, p16, 24)
        got, rc, err = finish(svc.client(p16, 24), svc)
        check(rc == 0, "svc_client failed")
        compare(got, ref16, "16 concurrent streams", err)
        p0, p1 = placed()
        log("16 concurrent: prefill@0 took %d, prefill@1 (burst) %d" % (p0, p1 - 4))
        check(p0 + p1 - 4 == 16 and p1 - 4 <= 4,
              "16 concurrent: prefill@0 took %d, the burst rank %d (want at most 4)" %
              (p0, p1 - 4))
        # prefill@0 drained: the burst rank takes every prompt, busy or not.
        check(svc.admin.drain("prefill@0", 60000)["code"] == 200, "drain prefill@0 failed")
        got, rc, err = finish(svc.client(p16, 24), svc)
        check(rc == 0, "svc_client failed")
        compare(got, ref16, "16 concurrent streams, prefill@0 drained", err)
        check(placed() == (p0, p1 + 16), "prefill@0 drained: placed %s, want %s" %
              (placed(), (p0, p1 + 16)))
        check(svc.admin.undrain("prefill@0")["code"] == 200, "undrain failed")
        # burst_free_slots = 1 (reloaded: the default, the key removed): a
        # prompt that would wait for the busy prefill@0 while decode slots
        # are free goes to the burst rank.
        with open(svc.conf) as f:
            conf = f.read()
        with open(svc.conf, "w") as f:
            f.write(conf.replace("burst_free_slots = 0\n", ""))
        r = svc.admin.reload()
        check(r["code"] == 200, "reload with burst_free_slots = 1: %s" % r)
        p0, p1 = placed()
        got, rc, err = finish(svc.client(p16, 24), svc)
        check(rc == 0, "svc_client failed")
        compare(got, ref16, "16 concurrent streams, burst_free_slots = 1", err)
        q0, q1 = placed()
        log("16 concurrent, burst_free_slots = 1: prefill@0 took %d, prefill@1 (burst) %d" %
            (q0 - p0, q1 - p1))
        check(q0 - p0 + q1 - p1 == 16 and q1 - p1 >= 5,
              "burst_free_slots = 1: prefill@0 took %d, the burst rank %d (want 5 or more)" %
              (q0 - p0, q1 - p1))
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


def sa_start(sa, d, listen, fdnames, conf, errname, env=()):
    """Start dsv4-sched -f conf under systemd-socket-activate `sa` on the
    listeners `listen` (paths or host:port) named `fdnames`, with extra
    environment `env` ("K=V"); its stderr goes to d/errname. Returns the
    Popen and that path once the unix listeners exist."""
    errp = os.path.join(d, errname)
    cmd = [sa]
    for addr in listen:
        cmd += ["-l", addr]
    cmd.append("--fdname=" + ":".join(fdnames))
    for e in env:
        cmd += ["-E", e]
    with open(errp, "w") as err:
        p = subprocess.Popen(cmd + [exe("daemons/sched/dsv4-sched"), "-f", conf], stderr=err)
    wait_for(lambda: all(os.path.exists(a) for a in listen if a.startswith("/")), "listeners")
    return p, errp


def sa_wake(path):
    """The first connection to a socket-activated scheduler's unix client
    listener `path`: a DEALER that has sent a HEARTBEAT (which starts the
    scheduler). The caller closes it."""
    c = zmq.Context.instance().socket(zmq.DEALER)
    c.setsockopt(zmq.LINGER, 0)
    c.connect("ipc://" + path)
    c.send_multipart([b"", b"DSV4C1", bytes([7]), msgpack.packb({})])
    return c


def sc_socket_activate():
    sa = shutil.which("systemd-socket-activate")
    check(sa is not None, "systemd-socket-activate not installed (tools/setup.sh)")
    d = scratch_dir("dsv4-sa-")
    p = None
    try:
        client, ctl = os.path.join(d, "client.sock"), os.path.join(d, "ctl.sock")
        conf = os.path.join(d, "dsv4.conf")
        with open(conf, "w") as f:
            f.write("client_endpoint = ipc://%s\nadmin_endpoint = ipc://%s\n"
                    "rank_endpoint = ipc://%s/rank.sock\n" % (client, ctl, d))
        npath = os.path.join(d, "notify.sock")
        ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        ns.bind(npath)
        p, _ = sa_start(sa, d, [client, ctl], ["client", "admin"], conf, "err",
                        env=["NOTIFY_SOCKET=" + npath, "WATCHDOG_USEC=1000000"])
        # The first connection activates the scheduler.
        c = sa_wake(client)
        check(c.poll(WAIT_S * 1000), "no HEARTBEAT answer on the passed client socket")
        fr = c.recv_multipart()
        check(fr[1] == b"DSV4C1" and fr[2][0] == 7, "bad heartbeat reply %s" % fr[:3])
        msgs = []
        ns.settimeout(WAIT_S)
        while "WATCHDOG=1" not in msgs:
            msgs += ns.recv(4096).decode().split("\n")
        st = Admin("ipc://" + ctl).status()
        check("version" in st, "admin STATUS over the passed admin socket: %s" % st)
        # The served listeners are the passed ones: the scheduler's fds 3 and
        # 4 are the only listening sockets bound to those paths.
        inodes = unix_listeners()
        for fd, path in ((3, client), (4, ctl)):
            link = os.readlink("/proc/%d/fd/%d" % (p.pid, fd))
            ino = int(re.match(r"socket:\[(\d+)\]", link).group(1))
            check(inodes.get(path) == [ino],
                  "%s: listening sockets %s, scheduler fd %d is %d" %
                  (path, inodes.get(path), fd, ino))
        c.close()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(WAIT_S)
        ns.settimeout(2)
        try:
            while True:
                msgs += ns.recv(4096).decode().split("\n")
        except socket.timeout:
            pass
        seq = [m.split("=")[0] for m in msgs if m]
        log("notify sequence: %s" % " ".join(dict.fromkeys(seq)))
        check(rc == 0, "dsv4-sched exit %d after SIGTERM" % rc)
        i_ready = seq.index("READY")
        check(seq.count("READY") == 1, "READY=1 sent %d times" % seq.count("READY"))
        check("STATUS" in seq[:i_ready], "no STATUS= before READY=1")
        check("WATCHDOG" in seq[i_ready:], "no WATCHDOG=1 after READY=1")
        check(seq[-1] == "STOPPING" or (seq[-1] == "STATUS" and "STOPPING" in seq),
              "STOPPING=1 not at the end: %s" % seq[-4:])
        check("WATCHDOG" not in seq[:i_ready], "WATCHDOG=1 before READY=1")
        ns.close()
        # A socket passed under another name (a unit's FileDescriptorName=
        # wrong): exit 6 naming it (it was ignored, and its clients hung).
        p, e2 = sa_start(sa, d, [client, ctl], ["client", "ctlx"], conf, "err2")
        c = sa_wake(client)
        rc = p.wait(WAIT_S)
        c.close()
        check(rc == 6 and "named 'ctlx'" in readf(e2),
              "a socket named ctlx: exit %d: %s" % (rc, readf(e2)[-300:]))
        # A listener at another path than the configured endpoint (a socket
        # unit's ListenStream= out of step with client_endpoint): served,
        # with a warning naming both, since clients of the configuration
        # would knock elsewhere.
        other = os.path.join(d, "other.sock")
        p, e3 = sa_start(sa, d, [other, ctl], ["client", "admin"], conf, "err3")
        c = sa_wake(other)
        check(c.poll(WAIT_S * 1000), "no HEARTBEAT answer on a listener at another path")
        c.close()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(WAIT_S)
        e3 = readf(e3)
        check(rc == 0 and "passed ipc://%s, the configuration names ipc://%s" % (other, client)
              in e3 and "admin socket: the service" not in e3,
              "a listener at another path: exit %d: %s" % (rc, e3[-400:]))
        # A TCP client listener (CURVE) with no server.key: the
        # configuration's fault, exit 6 as when the scheduler binds itself
        # (it exited 1, and its unit restarted it in a loop).
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        nokeys = os.path.join(d, "nokeys")
        os.mkdir(nokeys)
        conf4 = os.path.join(d, "tcp.conf")
        with open(conf4, "w") as f:
            f.write("client_endpoint = tcp://127.0.0.1:%d\nadmin_endpoint = ipc://%s\n"
                    "rank_endpoint = ipc://%s/rank.sock\nkey_dir = %s\n" % (port, ctl, d, nokeys))
        p, e4 = sa_start(sa, d, ["127.0.0.1:%d" % port], ["client"], conf4, "err4")
        # (the first connection starts it)
        wait_for(lambda: subprocess.run(["sh", "-c", "exec 3<>/dev/tcp/127.0.0.1/%d" % port],
                                        executable="/bin/bash").returncode == 0 or
                 p.poll() is not None, "the TCP listener")
        rc = p.wait(WAIT_S)
        e4 = readf(e4)
        check(rc == 6 and "server.key" in e4,
              "an adopted TCP listener without server.key: exit %d: %s" % (rc, e4[-300:]))
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def unix_listeners():
    """path -> [inode] of listening unix sockets (/proc/net/unix)."""
    res = {}
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            f_ = line.split()
            if len(f_) >= 8 and f_[5] == "01" and int(f_[3], 16) & 0x10000:
                res.setdefault(f_[7], []).append(int(f_[6]))
    return res


def sc_launch():
    d = scratch_dir("dsv4-launch-")
    fake = os.path.join(ARGS.src, "tests/integration/fake_daemon.py")
    p = None
    try:
        def run(extra_env=None, args=(), wait=True, nlog=None):
            env = dict(os.environ, FAKE_REPORT=os.path.join(d, "rep"))
            env.pop("NOTIFY_SOCKET", None)
            env.update(extra_env or {})
            cmd = [exe("tools/launch/dsv4-launch"),
                   "-o", "client_endpoint=ipc://%s/c.sock" % d,
                   "-o", "admin_endpoint=ipc://%s/a.sock" % d,
                   "--sched-bin", fake, "--prefill-bin", fake, "--decode-bin", fake,
                   "-r", "50", "-t", "10", "--notify-log", nlog or os.path.join(d, "n")] + list(args)
            return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)

        def reports():
            with open(os.path.join(d, "rep")) as f:
                return [json.loads(line) for line in f]

        # 1. Listeners, ordering, command exit status, clean stop.
        p = run(args=["-D", "2", "-w", "5", "--", "sh", "-c",
                      'test "$DSV4_ENDPOINT" = "ipc://%s/c.sock" && exit 7' % d])
        check(p.wait(WAIT_S) == 7, "command exit status not passed through")
        reps = reports()
        check(len(reps) == 4, "%d daemons started, want 4" % len(reps))
        s = reps[0]
        check([x["name"] for x in s["fds"]] == ["client", "admin"], "fd names %s" % s["fds"])
        check(s["fds"][0]["addr"] == d + "/c.sock" and s["fds"][1]["addr"] == d + "/a.sock",
              "listener addresses %s" % s["fds"])
        check(all(x["listening"] for x in s["fds"]), "passed sockets not listening")
        check(all(r["watchdog_usec"] == "5000000" and r["watchdog_pid_ok"] for r in reps),
              "watchdog environment")
        check(all(not r["fds"] for r in reps[1:]), "ranks got listeners")
        check(sorted(r["argv"][r["argv"].index("--rank") + 1] for r in reps[1:]) ==
              ["0", "0", "1"], "rank indices")
        nl = readf(os.path.join(d, "n"))
        check(nl.index("sched NOTIFY READY=1") < nl.index("decode@0 START"),
              "ranks started before the scheduler was ready")
        check(not os.path.exists(d + "/c.sock"), "listener left behind")
        log("launch: listeners, notify ordering, command status: ok")

        # 2. kill -9 -> restart; exit 0 -> no restart; SIGTERM -> stop all.
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n2")
        p = run(args=["-P", "0", "-D", "1", "-w", "0"], nlog=nlog)
        wait_for(lambda: len(reports_safe(d)) == 2, "set up")
        dec = reports_safe(d)[1]["pid"]
        os.kill(dec, signal.SIGKILL)
        wait_for(lambda: len(reports_safe(d)) == 3, "decode@0 restarted after kill -9")
        check("--rank" in reports_safe(d)[2]["argv"], "restarted the wrong process")
        wait_for(lambda: readf(nlog).count("decode@0 NOTIFY READY=1") == 2,
                 "the restarted decode@0 ready")
        os.kill(reports_safe(d)[2]["pid"], signal.SIGTERM)   # clean exit: stays down
        wait_for(lambda: "decode@0 EXIT exit=0" in readf(nlog), "clean exit")
        p.send_signal(signal.SIGTERM)
        check(p.wait(WAIT_S) == 0, "launcher exit status after SIGTERM")
        check(len(reports_safe(d)) == 3, "restarted after a clean exit")
        log("launch: restart on kill -9, not on exit 0, stop on SIGTERM: ok")

        # 3. Watchdog: a daemon that never pings is killed (SIGABRT) and restarted.
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n3")
        p = run({"FAKE_NO_WATCHDOG": "1"}, args=["-P", "0", "-D", "0", "-w", "1"], nlog=nlog)
        wait_for(lambda: "sched EXIT signal=6" in readf(nlog), "watchdog kill")
        wait_for(lambda: len(reports_safe(d)) >= 2, "restart after watchdog")
        p.send_signal(signal.SIGTERM)
        p.wait(WAIT_S)
        log("launch: watchdog: ok")

        # 4. Start limit: a daemon failing at once is given up after 5 starts.
        os.unlink(os.path.join(d, "rep"))
        p = run({"FAKE_EXIT_AFTER_S": "0.01", "FAKE_EXIT": "3"},
                args=["-P", "0", "-D", "0", "-w", "0"], nlog=os.path.join(d, "n4"))
        check(p.wait(WAIT_S) == 1, "launcher did not give up on a crash loop")
        check(len(reports_safe(d)) == 5, "%d starts before giving up" % len(reports_safe(d)))
        log("launch: start limit: ok")

        # 5. RestartPreventExitStatus=2 6: a daemon exiting for its usage or
        # its configuration is started once; the set stops with its status.
        for st in (6, 2):
            os.unlink(os.path.join(d, "rep"))
            nlog = os.path.join(d, "n5-%d" % st)
            p = run({"FAKE_EXIT_AFTER_S": "0.01", "FAKE_EXIT": str(st)},
                    args=["-P", "0", "-D", "0", "-w", "0"], nlog=nlog)
            rc = p.wait(WAIT_S)
            check(rc == st, "launcher exit %d after a daemon's exit %d" % (rc, st))
            check(len(reports_safe(d)) == 1, "%d starts after exit %d, want 1" %
                  (len(reports_safe(d)), st))
            check("sched EXIT exit=%d" % st in readf(nlog), "no exit %d in the notify log" % st)
        log("launch: exit 2 and 6 not restarted, the set stops with the status: ok")

        # 6. The scheduler alone (-P 0 -D 0) is a whole set: the command runs
        # once it is ready (it waited forever before); with --no-sched too
        # there is nothing to run (usage).
        os.unlink(os.path.join(d, "rep"))
        p = run(args=["-P", "0", "-D", "0", "-w", "0", "--", "sh", "-c", "exit 5"],
                nlog=os.path.join(d, "n6"))
        check(p.wait(WAIT_S) == 5, "the scheduler alone: command status not passed through")
        check(len(reports_safe(d)) == 1, "%d daemons for -P 0 -D 0" % len(reports_safe(d)))
        p = run(args=["--no-sched", "-P", "0", "-D", "0", "--", "true"],
                nlog=os.path.join(d, "n7"))
        check(p.wait(WAIT_S) == 2, "--no-sched -P 0 -D 0 not refused")
        log("launch: the scheduler alone runs the command; nothing at all is refused: ok")

        # 7. SIGHUP (systemctl reload's part) goes to the scheduler alone,
        # which reloads; nothing restarts.
        os.unlink(os.path.join(d, "rep"))
        hup = os.path.join(d, "rep.hup")
        p = run(args=["-P", "0", "-D", "1", "-w", "0"], nlog=os.path.join(d, "n8"))
        wait_for(lambda: len(reports_safe(d)) == 2, "set up")
        sched_pid, dec_pid = reports_safe(d)[0]["pid"], reports_safe(d)[1]["pid"]
        p.send_signal(signal.SIGHUP)
        wait_for(lambda: readf(hup) != "", "the scheduler got no SIGHUP")
        time.sleep(0.3)
        check(readf(hup).split() == [str(sched_pid)],
              "SIGHUP reached %s, want the scheduler (%d) alone" % (readf(hup).split(), sched_pid))
        check(len(reports_safe(d)) == 2 and p.poll() is None, "a restart after SIGHUP")
        os.kill(dec_pid, 0)
        p.send_signal(signal.SIGTERM)
        check(p.wait(WAIT_S) == 0, "launcher exit status after SIGHUP, SIGTERM")
        log("launch: SIGHUP to the scheduler alone: ok")
        # (b) SIGHUP while the scheduler starts: it may not handle SIGHUP
        # yet (the default action ended it, "EXIT signal=1"); the launcher
        # holds the SIGHUP back until READY=1 (its reload before READY=1).
        os.unlink(os.path.join(d, "rep"))
        os.unlink(hup)
        nlog = os.path.join(d, "n8b")
        p = run({"FAKE_READY_AFTER_S": "1.5"}, args=["-P", "0", "-D", "0", "-w", "0"],
                nlog=nlog)
        wait_for(lambda: "sched START" in readf(nlog), "the scheduler started")
        p.send_signal(signal.SIGHUP)        # perhaps before its handler
        wait_for(lambda: len(reports_safe(d)) == 1, "the scheduler's report")
        p.send_signal(signal.SIGHUP)        # with its handler, not ready
        wait_for(lambda: readf(hup) != "", "the held SIGHUP never reached the scheduler")
        wait_for(lambda: "sched NOTIFY RELOADING=1" in readf(nlog), "the reload")
        nl = readf(nlog)
        check("EXIT" not in nl, "SIGHUP during the start: %s" % nl)
        check(nl.index("sched NOTIFY READY=1") < nl.index("sched NOTIFY RELOADING=1"),
              "a SIGHUP reached the scheduler before its READY=1: %s" % nl)
        p.send_signal(signal.SIGTERM)
        check(p.wait(WAIT_S) == 0, "launcher exit status after SIGHUP at start, SIGTERM")
        log("launch: SIGHUP while the scheduler starts held back until READY=1: ok")

        # 8. Start and stop timeouts.  (a) EXTEND_TIMEOUT_USEC never brings
        # the start deadline nearer (sd_notify(3)): 0.5 s asked at start
        # against -T 3, READY after 1.5 s, is no timeout.
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n9")
        p = run({"FAKE_EXTEND_USEC": "500000", "FAKE_READY_AFTER_S": "1.5"},
                args=["-P", "0", "-D", "0", "-w", "0", "-T", "3", "--", "true"], nlog=nlog)
        check(p.wait(WAIT_S) == 0, "a short EXTEND_TIMEOUT_USEC: launcher exit %s" % p.returncode)
        check("sched NOTIFY READY=1" in readf(nlog) and "sched EXIT signal" not in readf(nlog)
              and len(reports_safe(d)) == 1,
              "a short EXTEND_TIMEOUT_USEC cut the start timeout: %s" % readf(nlog))
        # (b) an extension past -T 1: READY after 2 s, 3 s asked, no timeout.
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n10")
        p = run({"FAKE_EXTEND_USEC": "3000000", "FAKE_READY_AFTER_S": "2"},
                args=["-P", "0", "-D", "0", "-w", "0", "-T", "1", "--", "true"], nlog=nlog)
        check(p.wait(WAIT_S) == 0, "EXTEND_TIMEOUT_USEC past -T: launcher exit %s" % p.returncode)
        check(len(reports_safe(d)) == 1 and "sched EXIT signal" not in readf(nlog),
              "EXTEND_TIMEOUT_USEC past -T not honoured: %s" % readf(nlog))
        # (c) not ready within -T 1 and deaf to SIGTERM: SIGTERM, then
        # SIGKILL after -t 1, then a restart (a start timeout is a failure).
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n11")
        p = run({"FAKE_READY_AFTER_S": "60", "FAKE_IGNORE_TERM": "1"},
                args=["-P", "0", "-D", "0", "-w", "0", "-T", "1", "-t", "1"], nlog=nlog)
        wait_for(lambda: "sched EXIT signal=9" in readf(nlog), "SIGKILL after a start timeout")
        wait_for(lambda: len(reports_safe(d)) >= 2, "restart after a start timeout")
        p.send_signal(signal.SIGTERM)
        # (d) the set's stop: the child still ignores SIGTERM, SIGKILL after
        # -t 1, and the stop is not a clean one: exit 1 (systemd marks a
        # unit killed at TimeoutStopSec= failed; it was 0)
        check(p.wait(WAIT_S) == 1, "launcher exit status after a stop timeout: %s" %
              p.returncode)
        err = p.stderr.read()
        check("sched not ready in time; SIGTERM" in err and
              "sched did not stop in time; SIGKILL" in err and
              "stop timeout; killing what is left" in err,
              "timeout lines missing from the launcher's log:\n%s" % err[-2000:])
        check(readf(nlog).count("sched EXIT signal=9") == 2, "want two SIGKILLs: %s" % readf(nlog))
        log("launch: start timeout extended, never shortened; SIGKILL after a timeout's "
            "SIGTERM and at the stop timeout: ok")
        # (e) EXTEND_TIMEOUT_USEC while the set stops lengthens its stop
        # timeout: 3 s asked on SIGTERM against -t 1, exit 0 after 2 s.
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n11e")
        p = run({"FAKE_STOP_EXTEND_USEC": "3000000", "FAKE_STOP_AFTER_S": "2"},
                args=["-P", "0", "-D", "0", "-w", "0", "-t", "1", "--", "true"], nlog=nlog)
        check(p.wait(WAIT_S) == 0, "stop extended: launcher exit %s" % p.returncode)
        check("sched EXIT exit=0" in readf(nlog) and "signal=9" not in readf(nlog),
              "EXTEND_TIMEOUT_USEC while stopping not honoured: %s" % readf(nlog))
        check("stop timeout; killing" not in p.stderr.read(), "the stop timeout fired")
        log("launch: EXTEND_TIMEOUT_USEC while stopping lengthens the stop timeout: ok")
        # (f) The stop timeout is each unit's (TimeoutStopSec=): a rank deaf
        # to SIGTERM is killed at -t 2, the scheduler, whose SIGTERM was
        # still due, is not: it gets its SIGTERM then and stops in 1 s.
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n11f")
        p = run({"FAKE_RANK_IGNORE_TERM": "1", "FAKE_STOP_AFTER_S": "1"},
                args=["-P", "0", "-D", "1", "-w", "0", "-t", "2", "--", "true"], nlog=nlog)
        check(p.wait(WAIT_S) == 1, "a rank deaf to SIGTERM: launcher exit %s, want 1 (killed)"
              % p.returncode)
        check("decode@0 EXIT signal=9" in readf(nlog) and "sched EXIT exit=0" in readf(nlog),
              "the scheduler killed before its SIGTERM: %s" % readf(nlog))
        # (g) ... and its SIGTERM, after the ranks took 2 s of -t 3, brings
        # it a whole -t: it stops 2 s later, unkilled.
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n11g")
        p = run({"FAKE_STOP_AFTER_S": "2"},
                args=["-P", "0", "-D", "1", "-w", "0", "-t", "3", "--", "true"], nlog=nlog)
        check(p.wait(WAIT_S) == 0, "slow stops: launcher exit %s" % p.returncode)
        check("decode@0 EXIT exit=0" in readf(nlog) and "sched EXIT exit=0" in readf(nlog),
              "the scheduler's stop timeout did not start at its SIGTERM: %s" % readf(nlog))
        log("launch: the scheduler's stop timeout starts at its SIGTERM: ok")
        # (h) A rank that stops on its own (a SIGTERM from elsewhere: its
        # STOPPING=1) and hangs: SIGKILL after -t 2, a failure, restarted
        # (it kept running with no deadline).
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n11h")
        p = run({"FAKE_RANK_STOP_AFTER_S": "1000"},
                args=["-P", "0", "-D", "1", "-w", "0", "-t", "2", "-r", "50"], nlog=nlog)
        wait_for(lambda: re.search(r"decode@0 NOTIFY .*READY=1", readf(nlog)), "the rank ready")
        rank = [r for r in reports_safe(d) if "--rank" in r["argv"]][0]
        os.kill(rank["pid"], signal.SIGTERM)
        wait_for(lambda: "decode@0 EXIT signal=9" in readf(nlog), "SIGKILL of a stopping rank")
        wait_for(lambda: len([r for r in reports_safe(d) if "--rank" in r["argv"]]) == 2,
                 "the killed rank restarted")
        p.send_signal(signal.SIGTERM)
        p.wait(WAIT_S)
        check("decode@0 did not stop in time; SIGKILL" in p.stderr.read(),
              "no 'did not stop in time' line")
        log("launch: a rank stopping on its own is killed after -t and restarted: ok")

        # 9. An exit before READY=1 fails the start whatever its status
        # (systemd's result "protocol"): exit 0 before READY is restarted
        # and hits the start limit; the set does not wait for ever.
        os.unlink(os.path.join(d, "rep"))
        nlog = os.path.join(d, "n12")
        p = run({"FAKE_READY_AFTER_S": "60", "FAKE_EXIT_AFTER_S": "0.05", "FAKE_EXIT": "0"},
                args=["-P", "0", "-D", "0", "-w", "0", "--", "true"], nlog=nlog)
        check(p.wait(WAIT_S) == 1, "exit 0 before READY: launcher exit %s, want 1 (start limit)"
              % p.returncode)
        check(len(reports_safe(d)) == 5, "%d starts, want 5" % len(reports_safe(d)))
        check("READY=1" not in readf(nlog) and readf(nlog).count("sched EXIT exit=0") == 5,
              "notify log: %s" % readf(nlog))
        check("sched exit=0 before READY=1: a failed start" in p.stderr.read(),
              "no 'failed start' line")
        log("launch: an exit 0 before READY=1 is a failed start: ok")
        # ... but an exit 0 right after READY=1 is a clean one, even when the
        # launcher sees the SIGCHLD and the READY datagram in one wake-up
        for i in range(5):
            os.unlink(os.path.join(d, "rep"))
            nlog = os.path.join(d, "n12-%d" % i)
            p = run({"FAKE_EXIT_AT_READY": "1"},
                    args=["-P", "0", "-D", "0", "-w", "0", "--", "true"], nlog=nlog)
            check(p.wait(WAIT_S) == 0 and len(reports_safe(d)) == 1,
                  "exit 0 at READY: launcher exit %s, %d starts: %s" %
                  (p.returncode, len(reports_safe(d)), readf(nlog)))
        log("launch: an exit 0 right after READY=1 is a clean exit (5 runs): ok")

        # 10. Listeners the configuration gets wrong: exit 6 (configuration,
        # not restarted by systemd); an address in use: exit 1.
        blocker = os.path.join(d, "file")
        with open(blocker, "w"):
            pass
        for ep in ("foo://x", "tcp://127.0.0.1", "tcp://127.0.0.1:", "ipc://",
                   "ipc://%s/sub/c.sock" % blocker, "ipc://%s/%s.sock" % (d, "x" * 120)):
            q = subprocess.Popen([exe("tools/launch/dsv4-launch"), "-o", "client_endpoint=" + ep,
                                  "-o", "admin_endpoint=ipc://%s/a.sock" % d, "-P", "0", "-D", "0",
                                  "--sched-bin", fake, "--", "true"],
                                 stderr=subprocess.PIPE, text=True)
            err = q.communicate(timeout=WAIT_S)[1]
            check(q.returncode == 6, "client_endpoint=%s: exit %d, want 6: %s" %
                  (ep, q.returncode, err))
            check("client_endpoint or admin_endpoint as configured" in err,
                  "client_endpoint=%s: %s" % (ep, err))
        busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        q = subprocess.Popen([exe("tools/launch/dsv4-launch"), "-o",
                              "client_endpoint=tcp://127.0.0.1:%d" % busy.getsockname()[1],
                              "-o", "admin_endpoint=ipc://%s/a.sock" % d, "-P", "0", "-D", "0",
                              "--sched-bin", fake, "--", "true"],
                             stderr=subprocess.PIPE, text=True)
        err = q.communicate(timeout=WAIT_S)[1]
        busy.close()
        check(q.returncode == 1 and "Address already in use" in err,
              "an address in use: exit %d: %s" % (q.returncode, err))
        log("launch: listeners misconfigured exit 6, an address in use exits 1: ok")

        # 11. (a) A live set's ipc:// listeners are in use: a second launcher
        # with the same endpoints exits 1 and leaves them to the first.
        p = run(args=["-P", "0", "-D", "0", "--", "sleep", "60"], nlog=os.path.join(d, "n11"))
        wait_for(lambda: "sched NOTIFY READY=1" in readf(os.path.join(d, "n11")),
                 "the first set ready")
        # the listeners' modes are dsv4-sched.socket's and -admin.socket's
        # (the client's was the umask's: other users could not connect)
        modes = [stat.S_IMODE(os.stat(d + x).st_mode) for x in ("/c.sock", "/a.sock")]
        check(modes == [0o666, 0o660], "listener modes %s, want 0666 and 0660 (admin_mode)" %
              [oct(m) for m in modes])
        q = run(args=["-P", "0", "-D", "0", "--", "true"], nlog=os.path.join(d, "n11b"))
        err = q.communicate(timeout=WAIT_S)[1]
        check(q.returncode == 1 and "in use" in err,
              "a second launcher on a live set's sockets: exit %d: %s" % (q.returncode, err))
        check(os.path.exists(d + "/c.sock") and os.path.exists(d + "/a.sock"),
              "the second launcher removed the first one's sockets")
        check(p.poll() is None, "the first launcher stopped")
        p.send_signal(signal.SIGTERM)
        p.wait(WAIT_S)
        # (b) A child that gives up (exit 6) stops the set, and so the
        # command: the set's status is the child's, not the command's.
        p = run({"FAKE_EXIT_AFTER_S": "0.3", "FAKE_EXIT": "6"},
                args=["-P", "0", "-D", "0", "-w", "0", "--", "sleep", "30"])
        rc = p.wait(WAIT_S)
        check(rc == 6, "a child's exit 6 under a command: launcher exit %d, want 6" % rc)
        # (c) The command starts with SIGPIPE at its default (the launcher
        # ignores it).
        out = os.path.join(d, "status11")
        p = run(args=["-P", "0", "-D", "0", "--", "sh", "-c", "cat /proc/self/status > " + out])
        check(p.wait(WAIT_S) == 0, "the command failed")
        ign = [ln.split()[1] for ln in readf(out).splitlines() if ln.startswith("SigIgn:")]
        check(ign and int(ign[0], 16) & (1 << (signal.SIGPIPE - 1)) == 0,
              "the command starts with SIGPIPE ignored: SigIgn %s" % ign)
        # (d) A launcher that is PID 1 (a container's entry point) runs its
        # children (they compared their parent with 1 and exited at once).
        if subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"],
                          stderr=subprocess.DEVNULL).returncode == 0:
            env = dict(os.environ, FAKE_REPORT=os.path.join(d, "rep"))
            env.pop("NOTIFY_SOCKET", None)
            q = subprocess.run(["unshare", "-p", "-f", "--mount-proc",
                                exe("tools/launch/dsv4-launch"),
                                "-o", "client_endpoint=ipc://%s/c.sock" % d,
                                "-o", "admin_endpoint=ipc://%s/a.sock" % d,
                                "--sched-bin", fake, "-P", "0", "-D", "0", "--", "sh", "-c",
                                "exit 5"], env=env, stderr=subprocess.PIPE, text=True,
                               timeout=WAIT_S)
            check(q.returncode == 5, "dsv4-launch as PID 1: exit %d, want the command's 5: %s"
                  % (q.returncode, q.stderr[-2000:]))
            pid1 = "ok"
        else:
            pid1 = "not tried (unshare -p not permitted here)"
        log("launch: a live set's sockets in use, a child's give-up status under a command, "
            "the command's SIGPIPE: ok; as PID 1: %s" % pid1)
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def readf(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def reports_safe(d):
    try:
        with open(os.path.join(d, "rep")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def sc_pyclient():
    """Issue 4: the Python client written from docs/protocol.md alone
    (tests/ipc/pyclient.py, pyzmq + msgpack) drives generate, stream and
    cancel against the real scheduler and ranks."""
    sys.path.insert(0, os.path.join(ARGS.src, "tests", "ipc"))
    import pyclient
    svc = Service(n_prefill=1, n_decode=1)
    c = None
    try:
        prompts = os.path.join(svc.dir, "py.txt")
        make_prompts(prompts, 4, seed=404)
        ref = reference(svc, prompts)
        ids = read_prompts(prompts)
        c = pyclient.Client(svc.client_ep)
        check(c.ping(), "pyclient: no HEARTBEAT answer")
        # generate + stream, several requests in flight on one connection
        rids = [c.generate(tokens=p, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                           logprobs=True, tag="py%d" % i) for i, p in enumerate(ids)]
        for i, rid in enumerate(rids):
            out = pyclient.collect(c, rid)
            check(out["accepted"], "pyclient: request %d not accepted" % i)
            check(out["final"] == "done", "pyclient: request %d ended with %s %r" %
                  (i, out["final"], out.get("body")))
            check(out["tokens"] == ref[i][2], "pyclient: request %d tokens %s, want %s" %
                  (i, out["tokens"], ref[i][2]))
            b = out["body"]
            check(b["finish"] == ref[i][1] and b["completion_tokens"] == len(ref[i][2])
                  and b["prompt_tokens"] == len(ids[i]) and b.get("tag") == "py%d" % i,
                  "pyclient: request %d DONE %r" % (i, b))
            check(len(out["logprobs"]) == len(out["tokens"]) and
                  all(lp <= 0 for lp in out["logprobs"]), "pyclient: bad logprobs")
        # stream=false: one TOKENS right before DONE
        rid = c.generate(tokens=ids[0], max_tokens=MAX_TOKENS, temperature=0, stream=False)
        out = pyclient.collect(c, rid)
        check(out["chunks"] == 1 and out["tokens"] == ref[0][2],
              "pyclient: stream=false gave %d chunks" % out["chunks"])
        # a temperature near float's smallest is greedy (logits / 1e-38
        # overflowed and the sampler drew the least likely token)
        rid = c.generate(tokens=ids[0], max_tokens=MAX_TOKENS, temperature=1e-38)
        out = pyclient.collect(c, rid)
        check(out["final"] == "done" and out["tokens"] == ref[0][2],
              "pyclient: temperature 1e-38 gave %s, want %s" % (out["tokens"], ref[0][2]))
        # cancel after the first tokens
        rid = c.generate(tokens=ids[1], max_tokens=200, temperature=0)
        seen, final = 0, None
        for kind, body in c.events(rid):
            if kind == "tokens":
                seen += len(body["tokens"])
                if seen and final is None:
                    c.cancel(rid)
                    final = "sent"
            elif kind in ("done", "error"):
                final = (kind, body)
        check(final[0] == "done" and final[1]["finish"] == "cancelled",
              "pyclient: cancel ended with %r" % (final,))
        # bad input: a clear error with a 4xx code
        rid = c.generate(tokens=ids[2], temperature=-1)
        out = pyclient.collect(c, rid)
        check(out["final"] == "error" and 400 <= out["body"]["code"] < 500,
              "pyclient: temperature -1 gave %r" % (out.get("body"),))
        log("pyclient: generate, stream, stream=false, cancel and a bad request OK")
        svc.check_no_leaks()
    finally:
        if c is not None:
            c.close()
        stop_checked(svc)



def reference_top(svc, prompts, k, max_tokens=MAX_TOKENS):
    """The single-process forward's outputs and, per prompt, each output
    token's k most likely tokens [(id, logprob)] (svc_client --top)."""
    r = subprocess.run([exe("tests/integration/svc_client"), "--reference", svc.model,
                        "-p", prompts, "-n", str(max_tokens), "--top", str(k)],
                       capture_output=True, text=True, check=True)
    lines = r.stdout.splitlines()
    tops = {}
    for line in lines:
        f = line.split()
        if f[1] == "top":
            check(int(f[2]) == len(tops.setdefault(int(f[0]), [])), "bad top line " + line)
            tops[int(f[0])].append([(int(a), float(b)) for a, b in
                                    (x.split(":") for x in f[3:])])
    return parse_outputs("\n".join(l for l in lines if l.split()[1] != "top")), tops


def top_checked(what, out, k, greedy, want=None):
    """A request's top_logprobs output: k entries a token, ids distinct,
    log-probabilities <= 0 and descending; greedy: the first is the token with
    its logprob; sampled: the token is among them or no more likely than the
    last; want (the reference's lists): the same ids, logprobs within 1e-5."""
    check(out["final"] == "done", "%s: ended with %r" % (what, out.get("body")))
    check(len(out["top"]) == len(out["tokens"]) == len(out["logprobs"]),
          "%s: %d top lists for %d tokens" % (what, len(out["top"]), len(out["tokens"])))
    for j, (tok, lp, top) in enumerate(zip(out["tokens"], out["logprobs"], out["top"])):
        ids = [i for i, _ in top]
        lps = [x for _, x in top]
        check(len(top) == k and len(set(ids)) == k and all(x <= 0 for x in lps) and
              lps == sorted(lps, reverse=True), "%s: token %d: top %r" % (what, j, top))
        if greedy:
            check(ids[0] == tok and lps[0] == lp,
                  "%s: token %d (%d, %g) is not the first of %r" % (what, j, tok, lp, top))
        else:
            check(tok in ids or lp <= lps[-1],
                  "%s: token %d (%d, %g) more likely than the last of %r" % (what, j, tok, lp, top))
        if want is not None:
            w = want[j]
            check([i for i, _ in w] == ids and all(abs(a - b) <= 1e-5 for (_, a), b in
                                                     zip(w, lps)),
                  "%s: token %d: top %r, the single-process forward's %r" % (what, j, top, w))


def sc_top_logprobs():
    """GENERATE top_logprobs: every output token's most likely tokens, from
    the prefill rank (the first token) and the decode rank (the rest, plain
    steps and MTP verify steps), through the scheduler to the client; the
    same as the single-process forward's (svc_client --reference --top)."""
    sys.path.insert(0, os.path.join(ARGS.src, "tests", "ipc"))
    import pyclient
    for conf in ("", "decode.mtp = yes"):
        svc = Service(n_prefill=1, n_decode=1, extra_conf=conf)
        c = None
        try:
            prompts = os.path.join(svc.dir, "top.txt")
            make_prompts(prompts, 3, seed=505)
            ref, tops5 = reference_top(svc, prompts, 5)
            _, tops20 = reference_top(svc, prompts, 20)
            ids = read_prompts(prompts)
            c = pyclient.Client(svc.client_ep)
            what = "top_logprobs%s" % (" (mtp)" if conf else "")
            rids = [c.generate(tokens=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                               top_logprobs=5) for p in ids]
            for i, rid in enumerate(rids):
                out = pyclient.collect(c, rid)
                check(out["tokens"] == ref[i][2], "%s: request %d tokens %s, want %s" %
                      (what, i, out["tokens"], ref[i][2]))
                top_checked("%s: request %d" % (what, i), out, 5, True, tops5[i])
            # 20 (the most), in one TOKENS (stream = false)
            out = pyclient.collect(c, c.generate(tokens=ids[0], max_tokens=MAX_TOKENS,
                                                 temperature=0, logprobs=True,
                                                 top_logprobs=20, stream=False))
            check(out["chunks"] == 1, "%s: stream=false gave %d chunks" % (what, out["chunks"]))
            top_checked(what + ": 20, stream=false", out, 20, True, tops20[0])
            # longer outputs (the scheduler's arrays grow past 64 tokens; a
            # streamed request's sent lists are dropped as it goes)
            ref150, tops150 = reference_top(svc, prompts, 2, max_tokens=150)
            for stream in (False, True):
                out = pyclient.collect(c, c.generate(tokens=ids[1], max_tokens=150,
                                                     temperature=0, logprobs=True,
                                                     top_logprobs=2, stream=stream))
                check(out["tokens"] == ref150[1][2] and len(out["tokens"]) > 64,
                      "%s: 150 tokens (stream %s): %d, the reference's %d" %
                      (what, stream, len(out["tokens"]), len(ref150[1][2])))
                top_checked("%s: 150 tokens, stream %s" % (what, stream), out, 2, True,
                            tops150[1])
            # sampled: the lists are the model's whatever the sampling
            out = pyclient.collect(c, c.generate(tokens=ids[1], max_tokens=MAX_TOKENS,
                                                 temperature=1.5, seed=11, logprobs=True,
                                                 top_logprobs=3))
            top_checked(what + ": sampled", out, 3, False)
            # none asked: none sent
            out = pyclient.collect(c, c.generate(tokens=ids[2], max_tokens=4, temperature=0))
            check(out["final"] == "done" and out["top"] == [],
                  "%s: top lists %r without top_logprobs" % (what, out["top"]))
            # out of range: 401 naming the key
            out = pyclient.collect(c, c.generate(tokens=ids[2], top_logprobs=21))
            check(out["final"] == "error" and out["body"]["code"] == 401 and
                  "top_logprobs" in out["body"]["message"],
                  "%s: top_logprobs 21 gave %r" % (what, out.get("body")))
            log("%s: 3 greedy requests of 5, one of 20, a sampled one of 3 == the "
                "single-process forward's" % what)
            # (the tiny model's MTP drafts are never accepted: the lists of
            # a verify step's accepted rows are checked by test_spec)
            svc.check_no_leaks()
        finally:
            if c is not None:
                c.close()
            stop_checked(svc)



def sc_mtp_forced():
    """mtp = yes with drafts forced to be right most steps (test-only
    DSV4_TEST_MTP_DRAFTS: the tiny model's MTP layer never is), so streams
    emit two tokens a step: greedy, seeded sampling, stop ids landing on
    either token of a pair, max_tokens of both parities, logprobs and top
    lists: every output (tokens, logprobs, lists, finish, usage) == the plain
    set's for the same requests."""
    sys.path.insert(0, os.path.join(ARGS.src, "tests", "ipc"))
    import pyclient

    def serve(svc, reqs):
        c = pyclient.Client(svc.client_ep)
        try:
            rids = [c.generate(**r) for r in reqs]
            return [pyclient.collect(c, rid) for rid in rids]
        finally:
            c.close()

    plain = Service(n_prefill=1, n_decode=1)
    try:
        prompts = os.path.join(plain.dir, "forced.txt")
        make_prompts(prompts, 4, seed=606)
        ref = reference(plain, prompts)
        ids = read_prompts(prompts)
        reqs = []
        for i, p in enumerate(ids):
            base = dict(tokens=p, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3,
                        seed=1000 + i)
            reqs.append(dict(base, temperature=0))
            reqs.append(dict(base, temperature=1.0, top_k=50))
            reqs.append(dict(base, temperature=0, max_tokens=7 + i % 2))
            # a stop id at output index 2 + i and 8 + i: the first token of
            # a pair or its second, as the steps fall
            for k in (2 + i, 8 + i):
                if k < len(ref[i][2]):
                    reqs.append(dict(base, temperature=0, stop_ids=[ref[i][2][k]]))
        want = serve(plain, reqs)
    finally:
        stop_checked(plain)
    drafts = os.path.join(plain.dir, "drafts.txt")
    with open(drafts, "w") as f:
        for o in want:
            f.write(" ".join(str(t) for t in o["tokens"]) + "\n")
    svc = Service(n_prefill=1, n_decode=1, extra_conf="decode.mtp = yes",
                  env={"DSV4_TEST_MTP_DRAFTS": drafts})
    try:
        got = serve(svc, reqs)
        for i, (g, w) in enumerate(zip(got, want)):
            for key in ("final", "tokens", "logprobs", "top"):
                check(g[key] == w[key], "request %d (%s): %s %r, plain %r" %
                      (i, {k: v for k, v in reqs[i].items() if k != "tokens"}, key,
                       g[key], w[key]))
            check(g["body"].get("finish") == w["body"].get("finish") and
                  g["body"].get("completion_tokens") == w["body"].get("completion_tokens"),
                  "request %d: DONE %r, plain %r" % (i, g["body"], w["body"]))
        d, a = wait_for(lambda: (lambda c: c if c and c[1] > 0 else None)(
            mtp_counters(svc, "decode@0")), "decode@0 reporting accepted drafts")
        log("mtp_forced: %d requests == the plain set's; decode@0 %d drafts, %d accepted" %
            (len(reqs), d, a))
        check(a >= len(reqs), "only %d drafts accepted" % a)
        svc.check_no_leaks()
    finally:
        stop_checked(svc)


SCENARIOS = {
    "launch": sc_launch,
    "greedy16": sc_greedy16,
    "batch64": sc_batch64,
    "socket_activate": sc_socket_activate,
    "kill_decode": sc_kill_decode,
    "kill_prefill": sc_kill_prefill,
    "kill_sched": sc_kill_sched,
    "restart_sched": sc_restart_sched,
    "cancel1000": sc_cancel1000,
    "ctl_cancel": sc_ctl_cancel,
    "drain": sc_drain,
    "stop_drain": sc_stop_drain,
    "pyclient": sc_pyclient,
    "top_logprobs": sc_top_logprobs,
    "group2": sc_group2,
    "mtp": sc_mtp,
    "mtp_forced": sc_mtp_forced,
    "group_break": sc_group_break,
    "group_rejoin": sc_group_rejoin,
    "join_stop": sc_join_stop,
    "group_mismatch": sc_group_mismatch,
    "model_mismatch": sc_model_mismatch,
    "prefill_nomem": sc_prefill_nomem,
    "decode_nomem": sc_decode_nomem,
    "export_nomem": sc_export_nomem,
    "prefill_warmup": sc_prefill_warmup,
    "burst": sc_burst,
}


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--build", required=True)
    ap.add_argument("--src", default=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    ARGS = ap.parse_args()
    t0 = time.monotonic()
    try:
        SCENARIOS[ARGS.scenario]()
    except Fail as e:
        log("FAIL %s: %s" % (ARGS.scenario, e))
        dump_scratch()
        log("FAIL %s after %.1f s; logs above, kept in %s" %
            (ARGS.scenario, time.monotonic() - t0, " ".join(SCRATCH)))
        return 1
    except BaseException:
        dump_scratch()
        raise
    if os.environ.get("SVC_TEST_KEEP"):
        log("kept (SVC_TEST_KEEP): %s" % " ".join(SCRATCH))
    else:
        remove_scratch()
    log("PASS %s (%.1f s)" % (ARGS.scenario, time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
