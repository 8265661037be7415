#!/usr/bin/env python3
"""rank_epoch.py — two real dsv4-prefill ranks of one group (CPU backend, shm
communicator) driven by this script playing the scheduler (docs/protocol.md
§6.4, §6.5) over a ROUTER socket, message by message:

  0. Rank 1's READY answered with ERROR once, then refused (DISCONNECT
     {reason}) for 2 s: the rank logs each answer, and registers again after
     a growing pause.
  1. READY -> WELCOME (each says HEARTBEAT comm_epoch 0); the id of epoch 1
     goes to rank 0 only, so its join waits for its peer: it keeps
     heartbeating meanwhile and answers the request for epoch 2's id; then
     rank 1 gets epoch 1's id too (both report comm_epoch 1), and both get
     epoch 2's and switch to it together (both report comm_epoch 2).
  2. A switch of epoch with work placed on the new epoch before a rank has
     switched: rank 0 gets COMM of epoch 3 and PREFILL A while its epoch-2
     communicator still works (it reports A in HEARTBEAT active), then rank 1
     gets them.  The ranks switch together and both must run A (PREFILL_DONE
     from both): work that arrives after the new epoch's COMM belongs to it.
  3. A break with every rank alive (test-only DSV4_TEST_GROUP_BREAK makes
     rank 1's 2nd forward call fail): PREFILL B -> GROUP_BROKEN {group 0,
     group_rank, comm_epoch 3} from both ranks, HEARTBEAT comm_epoch 0 after;
     then epoch 4: both join again (same processes) and run PREFILL C.
  4. Two prompts alone, then twice: kill -9 of rank 1, a new process (no
     --rows: its prefill_chunk, 512, is above max_seq, 256), a new epoch,
     and both prompts at once, so they share one forward call: the new rank
     joins (its rows per call capped to max_seq before the join, as its
     peer's warm-up capped them), and both ranks give each prompt the token
     it got alone (the call's rows in the same order on both: the
     rotation over the prompts restarts at every join).

usage: rank_epoch.py BUILD_DIR (KEEP=1 keeps the scratch directory with the
ranks' logs).  Exit 0 pass, 1 fail, 77 without pyzmq/msgpack.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import msgpack
    import zmq
except ImportError:
    print("pyzmq/msgpack not installed: skipped")
    sys.exit(77)

RANK = b"DSV4R1"
READY, WELCOME, HEARTBEAT, DISCONNECT, PREFILL, PREFILL_DONE = 1, 2, 3, 4, 5, 6
KV_RELEASE, ERROR, COMM, GROUP_BROKEN = 8, 15, 16, 17
BOUND_S = 120        # a step that does not happen within this fails the test


class Fail(Exception):
    pass


class Sched:
    """The scheduler side: a ROUTER; ranks by group_rank."""

    def __init__(self, ctx, ep):
        self.s = ctx.socket(zmq.ROUTER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.bind(ep)
        self.route = {}              # group_rank -> identity

    def send(self, gr, cmd, body):
        self.s.send_multipart([self.route[gr], b"", RANK, bytes([cmd]),
                               msgpack.packb(body)])

    def recv(self):
        fr = self.s.recv_multipart()
        if fr[2] != RANK:
            raise Fail("not a rank message: %r" % fr[:3])
        b = msgpack.unpackb(fr[4], raw=False)
        gr = next((g for g, r in self.route.items() if r == fr[0]), None)
        if fr[3][0] == READY:
            gr = b["group_rank"]
            self.route[gr] = fr[0]
        return gr, fr[3][0], b

    def wait(self, pred, what, registered=True):
        """Receive until pred(group_rank, cmd, body) holds; returns that body.
        registered: a DISCONNECT or READY (a rank registering again) fails."""
        end = time.monotonic() + BOUND_S
        while time.monotonic() < end:
            if self.s.poll(100):
                gr, cmd, b = self.recv()
                if cmd == HEARTBEAT:
                    self.send(gr, HEARTBEAT, {})   # the rank's view of our liveness
                if cmd == ERROR:
                    raise Fail("rank %s: ERROR %s" % (gr, b))
                if registered and cmd in (DISCONNECT, READY):
                    raise Fail("rank %s left the link (%d %s) waiting for %s" %
                               (gr, cmd, b, what))
                if pred(gr, cmd, b):
                    return b
        raise Fail("never got " + what)


def hb(epoch, gr=None, active=None):
    """Predicate: a HEARTBEAT carrying comm_epoch `epoch` (and `active`)."""
    return lambda g, c, b: (c == HEARTBEAT and b.get("comm_epoch") == epoch and
                            (gr is None or g == gr) and
                            (active is None or b.get("active") == active))


def ask(sc, epoch):
    """Ask rank 0 for the id of `epoch`; returns it."""
    sc.send(0, COMM, {"comm_epoch": epoch, "one_host": True})
    return sc.wait(lambda g, c, b: g == 0 and c == COMM and b["comm_epoch"] == epoch,
                   "rank 0's id of epoch %d" % epoch)["comm_id"]


def form(sc, epoch):
    """Ask rank 0 for epoch's id, send it to both, wait until both joined."""
    cid = ask(sc, epoch)
    for gr in (0, 1):
        sc.send(gr, COMM, {"comm_epoch": epoch, "comm_id": cid})
    for gr in (0, 1):
        sc.wait(hb(epoch, gr), "rank %d joined epoch %d" % (gr, epoch))
    return cid


def prefill(req, tokens=None):
    return {"req": req, "tokens": tokens or [5, 9, 17, 33, 2 + req], "temperature": 0.0,
            "dst_group": 0, "transport": "shm"}


def tokens_of_both(sc, reqs):
    """PREFILL_DONE of every req in reqs from both ranks: {(req, rank): token}."""
    got = {}
    sc.wait(lambda g, c, b: c == PREFILL_DONE and b["req"] in reqs and
            (got.__setitem__((b["req"], g), b["token"]) or len(got) == 2 * len(reqs)),
            "PREFILL_DONE of reqs %s from both ranks" % (reqs,))
    for req in reqs:
        for gr in (0, 1):
            sc.send(gr, KV_RELEASE, {"req": req})
    return got


def done_by_both(sc, req):
    got = set()
    sc.wait(lambda g, c, b: c == PREFILL_DONE and b["req"] == req and
            (got.add(g) or got == {0, 1}), "PREFILL_DONE of req %d from both ranks" % req)
    for gr in (0, 1):
        sc.send(gr, KV_RELEASE, {"req": req})


def run(build, tmp, ctx):
    model = os.path.join(tmp, "model")
    subprocess.run([os.path.join(build, "tools/mkmodel/dsv4-mkmodel"), "--preset", "tiny",
                    "--out", model], check=True, stdout=subprocess.DEVNULL)
    ep = "ipc://%s/rank.sock" % tmp
    sc = Sched(ctx, ep)
    env = dict(os.environ, DSV4_TEST_GROUP_BREAK="prefill@1:2")
    env.pop("NOTIFY_SOCKET", None)
    procs = []
    logs = []

    def start(r, env, name):
        logs.append(open(os.path.join(tmp, name), "w"))
        return subprocess.Popen(
            [os.path.join(build, "daemons/rank/dsv4-prefill"), "-v",
             "-o", "group_size=2",
             "--rank", str(r), "--checkpoint", model, "--sched", ep, "--threads", "1",
             "--max-seq", "256", "--slots", "4"],
            env=env, stdout=logs[-1], stderr=subprocess.STDOUT)
    try:
        for r in (0, 1):
            procs.append(start(r, env, "prefill%d.log" % r))
        # 0. READYs of rank 1 refused for 2 s (as the scheduler refuses a
        # group_size that differs from its group's): the rank says why and
        # registers again after a growing pause, not thousands of times a second
        # (its first READY is answered with ERROR, as a malformed one is)
        seen, refused, errored = set(), [], []
        # longer than any fixed line buffer short of the protocol's bound
        # for a reason: the rank's journal must hold all of it
        why = "test: group_size differs (" + "x" * 600 + ") end of the reason"

        def refuse(g, c, b):
            if c != READY:
                return False
            if g == 1 and not errored:
                errored.append(g)
                sc.send(1, ERROR, {"req": 0, "code": 401, "message": "test: READY malformed"})
                return False
            if g == 1 and (not refused or time.monotonic() < refused[0] + 2):
                refused.append(time.monotonic())
                sc.send(1, DISCONNECT, {"reason": why})
                return False
            seen.add(g)
            return len(seen) == 2
        sc.wait(refuse, "READY", registered=False)
        if not 2 <= len(refused) <= 12:
            raise Fail("%d READYs of rank 1 refused within 2 s" % len(refused))
        with open(os.path.join(tmp, "prefill1.log")) as fp:
            text = fp.read()
        if "link_lost: READY refused (3 in a row): " + why + ";" not in text:
            raise Fail("rank 1's log does not give the refusal's whole reason")
        if "link_join: READY answered with ERROR 401: test: READY malformed" not in text:
            raise Fail("rank 1's log does not give the ERROR that answered its READY")
        print("ok a refused rank registered %d times in 2 s, saying why" % len(refused))

        # 1. registration and the first communicator
        for gr in (0, 1):
            sc.send(gr, WELCOME, {"heartbeat_ms": 200, "liveness": 100, "comm_epoch": 1})
        for gr in (0, 1):
            sc.wait(hb(0, gr), "rank %d: HEARTBEAT comm_epoch 0 after WELCOME" % gr)
        # 1. rank 0 alone gets epoch 1's id: its join waits for rank 1
        cid1 = ask(sc, 1)
        sc.send(0, COMM, {"comm_epoch": 1, "comm_id": cid1})
        for _ in range(3):
            sc.wait(hb(0, 0), "rank 0 heartbeating while it joins")
        cid2 = ask(sc, 2)
        sc.send(1, COMM, {"comm_epoch": 1, "comm_id": cid1})
        for gr in (0, 1):
            sc.wait(hb(1, gr), "rank %d joined epoch 1" % gr)
        for gr in (0, 1):
            sc.send(gr, COMM, {"comm_epoch": 2, "comm_id": cid2})
        for gr in (0, 1):
            sc.wait(hb(2, gr), "rank %d switched to epoch 2" % gr)
        print("ok a rank waiting in a join heartbeats and answers the next ask")

        # 2. epoch 3 with work placed on it before rank 1 has its COMM
        cid3 = ask(sc, 3)
        sc.send(0, COMM, {"comm_epoch": 3, "comm_id": cid3})
        sc.send(0, PREFILL, prefill(7))
        # rank 0 holds A while still on epoch 2 (a HEARTBEAT says so)
        sc.wait(hb(2, 0, active=1), "rank 0 holding req 7 on epoch 2")
        sc.send(1, COMM, {"comm_epoch": 3, "comm_id": cid3})
        sc.send(1, PREFILL, prefill(7))
        done_by_both(sc, 7)
        print("ok work placed on epoch 3 before the switch ran on both ranks")

        # 3. rank 1's 2nd forward call fails: the group breaks, both alive
        for gr in (0, 1):
            sc.send(gr, PREFILL, prefill(8))
        broken = {}
        sc.wait(lambda g, c, b: c == GROUP_BROKEN and
                (broken.__setitem__(g, b) or len(broken) == 2),
                "GROUP_BROKEN from both ranks")
        for gr, b in broken.items():
            if (b["group"], b["group_rank"], b["comm_epoch"]) != (0, gr, 3) or not b.get("reason"):
                raise Fail("rank %d: GROUP_BROKEN %s" % (gr, b))
        for gr in (0, 1):
            sc.wait(hb(0, gr), "rank %d: HEARTBEAT comm_epoch 0 after the break" % gr)
        form(sc, 4)
        for gr in (0, 1):
            sc.send(gr, PREFILL, prefill(9))
        done_by_both(sc, 9)
        for p in procs:
            if p.poll() is not None:
                raise Fail("a rank exited (%d)" % p.returncode)
        print("ok broken group reported (epoch 3) and re-formed (epoch 4), same processes")

        # 4. two prompts that share a forward call after rank 1's restart
        pa, pb = [5, 9, 17, 33, 7, 8, 100, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15]
        alone = {}
        for req, toks in ((20, pa), (21, pb)):
            for gr in (0, 1):
                sc.send(gr, PREFILL, prefill(req, toks))
            got = tokens_of_both(sc, [req])
            if got[(req, 0)] != got[(req, 1)]:
                raise Fail("req %d alone: the ranks differ: %s" % (req, got))
            alone[req] = got[(req, 0)]
        env1 = dict(env)
        env1.pop("DSV4_TEST_GROUP_BREAK")
        # two restarts: the one forward call in between moves rank 0's
        # rotation by one, so the old code's mismatch showed in one of them
        for rnd in range(2):
            procs[1].kill()
            procs[1].wait()
            procs[1] = start(1, env1, "prefill1.restart%d.log" % rnd)
            sc.wait(lambda g, c, b: c == READY and g == 1, "READY of the restarted rank 1",
                    registered=False)
            sc.send(1, WELCOME, {"heartbeat_ms": 200, "liveness": 100, "comm_epoch": 5 + rnd})
            form(sc, 5 + rnd)
            a, b = 22 + 2 * rnd, 23 + 2 * rnd
            for gr in (0, 1):
                sc.send(gr, PREFILL, prefill(a, pa))
                sc.send(gr, PREFILL, prefill(b, pb))
            got = tokens_of_both(sc, [a, b])
            want = {(a, 0): alone[20], (a, 1): alone[20], (b, 0): alone[21], (b, 1): alone[21]}
            if got != want:
                raise Fail("restart %d: two prompts in one call gave %s, alone %s" %
                           (rnd, sorted(got.items()), sorted(want.items())))
        print("ok after two restarts of rank 1, two prompts in one call == each alone, "
              "on both ranks")
        for gr in (0, 1):
            sc.send(gr, DISCONNECT, {"reason": "test over"})
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        rcs = [p.wait(timeout=60) for p in procs]
        for f in logs:
            f.close()
    if rcs != [0, 0]:
        raise Fail("rank exit status %s" % rcs)


def script_main(run, prefix):
    """A script's main (also rank_backlog.py's): run(build, tmp, ctx) in a
    scratch directory; on Fail, the reason and the tail of every log there;
    the exit status."""
    build = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix=prefix)
    ctx = zmq.Context()
    try:
        run(build, tmp, ctx)
    except Fail as e:
        print("FAIL: %s" % e)
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".log"):
                with open(os.path.join(tmp, name)) as f:
                    print("----- %s -----\n%s" % (name, f.read()[-4000:]))
        return 1
    finally:
        ctx.destroy(0)
    if not os.environ.get("KEEP"):
        shutil.rmtree(tmp, ignore_errors=True)
    print("PASS", tmp)
    return 0


if __name__ == "__main__":
    sys.exit(script_main(run, "rank-epoch-"))
