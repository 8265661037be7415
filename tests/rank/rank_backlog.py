#!/usr/bin/env python3
"""rank_backlog.py — a real dsv4-prefill and dsv4-decode (CPU backend, the
tiny model) driven by this script playing the scheduler (docs/protocol.md
§6) over a ROUTER socket that takes one message at a time (RCVHWM 1, a
4 KiB receive buffer), as a scheduler that stalls does.

A PREFILL whose values the rank refuses (temperature NaN) is answered with
ERROR for its req (it was only logged, and the request hung).

Four streams of 1,500 tokens are handed to the decode rank, then the script
reads nothing until the rank has logged all four ends (at most 15 s;
liveness 20 x 1 s, so the link stays up): its 1,500 TOKENS and four
DECODE_DONE then all wait in its send queue.  A plain build must get there
within the stall (else the backlog was not tested: a failure); a sanitizer
build, which steps slower, may not, and then checks the counts only, saying
so.  Once it reads again, every stream's TOKENS must add up to its
DECODE_DONE's n_tokens and to max_tokens, and every DECODE_DONE must come
(and a SIGHUP then is logged and ignored).  The rank's send queue used to be ZeroMQ's default 1,000 messages:
past it a TOKENS or DECODE_DONE was dropped with a warning while the link
stayed up (streams with gaps, requests never ended at the scheduler).

usage: rank_backlog.py BUILD_DIR (KEEP=1 keeps the scratch directory with
the ranks' logs).  Exit 0 pass, 1 fail, 77 without pyzmq/msgpack.
"""
import os
import signal
import subprocess
import sys
import time

try:
    import msgpack
    import zmq
except ImportError:
    print("pyzmq/msgpack not installed: skipped")
    sys.exit(77)
from rank_epoch import Fail, script_main   # noqa: E402 (after the skip)

RANK = b"DSV4R1"
READY, WELCOME, HEARTBEAT, PREFILL, PREFILL_DONE, DECODE, KV_RELEASE = 1, 2, 3, 5, 6, 7, 8
TOKENS, DECODE_DONE, ERROR = 9, 10, 15
# (1,500 steps: more than ZeroMQ's default queue of 1,000 messages, done
# within the stall by a plain build; a sanitizer build steps slower, and
# then checks the counts only)
N_STREAMS, MAX_TOKENS, STALL_S = 4, 1500, 15
QUIET_S = 30         # after the stall: no message for this long is a failure


def check(cond, what):
    if not cond:
        raise Fail(what)


def shm_regions(ep):
    """The decode-state regions in /dev/shm of ranks registering at `ep`
    (their names carry its FNV-1a hash: daemons/rank/rank_kv.c kv_open)."""
    h = 2166136261
    for c in ep.encode():
        h = ((h ^ c) * 16777619) & 0xffffffff
    prefix = "dsv4kv-%08x-" % h
    try:
        return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except FileNotFoundError:
        return []


def run(build, tmp, ctx):
    model = os.path.join(tmp, "model")
    subprocess.run([os.path.join(build, "tools/mkmodel/dsv4-mkmodel"), "--preset", "tiny",
                    "--out", model], check=True, stdout=subprocess.DEVNULL)
    ep = "ipc://%s/rank.sock" % tmp
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.bind(ep)
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    procs = []
    tokens, done, pending = {}, {}, []

    def send(ident, cmd, body, raw=()):
        s.send_multipart([ident, b"", RANK, bytes([cmd]), msgpack.packb(body)] + list(raw))

    def recv(timeout):
        if not s.poll(int(timeout * 1000)):
            return None
        ident, _, sig, cmd, body, *raw = s.recv_multipart()
        check(sig == RANK, "signature %r" % sig)
        m = (ident, cmd[0], msgpack.unpackb(body, raw=False), raw)
        if m[1] == TOKENS:
            for r in m[2]["reqs"]:
                tokens[r] = tokens.get(r, 0) + 1
        elif m[1] == DECODE_DONE:
            done[m[2]["req"]] = m[2]["n_tokens"]
        return m

    def wait(cmd, what, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            m = recv(end - time.time())
            if m is not None and m[1] == cmd:
                return m
        raise Fail("no %s" % what)

    for role in ("prefill", "decode"):
        log = open(os.path.join(tmp, role + ".log"), "w")
        procs.append(subprocess.Popen(
            [os.path.join(build, "daemons/rank/dsv4-" + role), "-v", "--rank", "0",
             "--checkpoint", model, "--sched", ep, "--threads", "1", "--max-seq", "4096",
             "--slots", str(N_STREAMS)], env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        ids = {}
        while len(ids) < 2:
            m = wait(READY, "READY")
            ids[m[2]["role"]] = m[0]
            send(m[0], WELCOME, {"heartbeat_ms": 1000, "liveness": 20})
        # A PREFILL the rank refuses to decode (temperature NaN, as a
        # scheduler of another version might send) is answered with ERROR
        # for its req (it was dropped with a warning: the request hung).
        send(ids["prefill"], PREFILL, {"req": 99, "tokens": [1, 2, 3], "dst_group": 0,
                                        "transport": "shm", "temperature": float("nan")})
        e = wait(ERROR, "ERROR for a malformed PREFILL", timeout=10)
        check(e[2]["req"] == 99 and e[2]["code"] == 401 and "malformed PREFILL" in
              e[2]["message"], "the malformed PREFILL's ERROR: %s" % e[2])
        for req in range(1, N_STREAMS + 1):
            send(ids["prefill"], PREFILL, {"req": req, "tokens": [1, 2, req], "dst_group": 0,
                                            "transport": "shm"})
            pd = wait(PREFILL_DONE, "PREFILL_DONE of %d" % req)
            pending.append((req, pd))
        for req, pd in pending:
            send(ids["decode"], DECODE, {"req": req, "slot": req - 1, "token": pd[2]["token"],
                                         "pos": 3, "max_tokens": MAX_TOKENS,
                                         "kv": pd[2]["kv"]}, pd[3])
        # the scheduler stalls until the rank has finished every stream
        dlog = os.path.join(tmp, "decode.log")
        end = time.time() + STALL_S
        while time.time() < end and open(dlog).read().count("decode_done: req=") < N_STREAMS:
            time.sleep(0.1)
        queued = open(dlog).read().count("decode_done: req=") == N_STREAMS
        binary = open(os.path.join(build, "daemons/rank/dsv4-decode"), "rb").read()
        check(queued or b"__asan_init" in binary,
              "the decode rank did not finish its streams within the %d s stall: the backlog "
              "was not tested" % STALL_S)
        last = time.time()
        while len(done) < N_STREAMS and time.time() - last < QUIET_S:
            if recv(1) is not None:
                last = time.time()
        with open(os.path.join(tmp, "decode.log")) as f:
            busy = f.read().count("TOKENS: busy")
        check(len(done) == N_STREAMS, "DECODE_DONE of %s only (tokens %s; %d TOKENS sends "
              "refused)" % (sorted(done), tokens, busy))
        for req in range(1, N_STREAMS + 1):
            check(done[req] == MAX_TOKENS and tokens.get(req, 0) == MAX_TOKENS,
                  "req %d: DECODE_DONE n_tokens %s, %s TOKENS entries (%d TOKENS sends "
                  "refused)" % (req, done[req], tokens.get(req), busy))
        # SIGHUP is logged and ignored (it ended the rank, and systemd took
        # that end as clean: never restarted)
        procs[1].send_signal(signal.SIGHUP)
        end = time.time() + 10
        while time.time() < end and "SIGHUP ignored" not in open(
                os.path.join(tmp, "decode.log")).read():
            recv(0.1)
        check(procs[1].poll() is None, "the decode rank exited (status %s)" % procs[1].poll())
        check("SIGHUP ignored" in open(os.path.join(tmp, "decode.log")).read(),
              "no log of the ignored SIGHUP")
        # the exports freed as the scheduler frees them (KV_RELEASE), so no
        # /dev/shm region is left behind (other tests count them)
        for req in range(1, N_STREAMS + 1):
            send(ids["prefill"], KV_RELEASE, {"req": req})
        end = time.time() + 10
        while time.time() < end and shm_regions(ep):
            recv(0.1)
        check(not shm_regions(ep), "regions left: %s" % shm_regions(ep))
        print("%d streams of %d tokens: every TOKENS and DECODE_DONE arrived, %s" %
              (N_STREAMS, MAX_TOKENS, "all queued at the rank during the stall" if queued else
               "the rank not done within the stall (a sanitizer build): counts only"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
        s.close(0)
        for n in shm_regions(ep):     # (a failed run's, killed)
            os.unlink(os.path.join("/dev/shm", n))


if __name__ == "__main__":
    sys.exit(script_main(run, "rank-backlog-"))
