#!/usr/bin/env python3
"""sched_smoke.py — dsv4-sched against fake ranks written here (pyzmq + msgpack).

Starts the real scheduler on ipc:// endpoints in a temporary directory, plus a
fake prefill rank and a fake decode rank (threads of this script) whose
"model" is a pure function: output token k of a request is
f(sum of the original prompt, seed, k).  A re-run after a rank death must
therefore reproduce the same tokens, and the test can compute every expected
output.  Scenarios (one per argument, or all):

  basic      greedy-style requests give f's tokens, usage, finish "length"
  batch      40 requests with max_batch 4: all served, never > 4 streams decoding
  stop       stop ids (incl. EOS), stop strings cut the text, held-back text
  cancel     cancel mid-stream: DONE cancelled, ABORT reached the decode rank, no leak
  ctl_cancel  dsv4ctl requests shows where a stream decodes (WHERE, --json groups);
             dsv4ctl cancel ends it mid-stream: DONE cancelled with f's prefix, ABORT
             at the decode rank, counted; a second cancel is 404
  death      the decode rank dies mid-stream; a new one registers; every request
             completes with exactly f's tokens (no loss, no duplicates)
  overload   queue bound: 300 beyond it; 301 while draining; drain/undrain via dsv4ctl
  resume     GENERATE with resume (a client's tokens and text from a scheduler that went
             away): the rest follows, the same tokens and text, nothing twice; a resume
             already at its end gets DONE at once; refusals (no seed, too long, text)
  refuse     GENERATEs refused at once with their codes (ids outside the vocabulary, in
             the prompt or the resume; more context than the decode ranks hold, while
             exactly their context is admitted; an empty prompt text; an id in use by a
             request in flight, which goes on; prompt text without a tokenizer)
  drain_restart  a rank drain waiting while the rank restarts: the new process stays
             drained and the wait follows it; undrained, the stream runs again and
             completes; a rank of another name in its place ends the wait "rank gone"
  drain_hol  a queued request that only a drained group can hold does not hold up the
             ones behind it, and is served once undrained; prompt plus max_tokens
             beyond every prefill rank's context: 413 at once
  sigterm    SIGTERM with work in flight, the ranks serving on: new requests 302, a
             short stream completes, a long one ends with 302 "scheduler restarting"
             at the stop timeout (stop_timeout_ms = 5000) with f's tokens so far, exit 0
  sigterm_alone  SIGTERM with a request queued after every rank left (DRAIN): 500 "no
             rank left" at once (stop_timeout_ms = 600000), exit 0; with
             no rank ever registered the stop timeout runs (302 after it)
  reload     SIGHUP and dsv4ctl reload: queue_max and max_batch change at once (queued
             requests kept, -o overrides still win), a start-bound key is logged as
             waiting, a file that does not load changes nothing (dsv4ctl: 500, exit 1);
             max_batch lowered and raised holds
  malformed  garbage on the client, rank and admin sockets; the scheduler keeps serving
  group_error  a decode group of two ranks where rank 1 fails one import that rank 0
             took: rank 0 gets ABORT of it, the re-run runs under a new rank-protocol
             id, every request completes with f's tokens and no rank keeps a stream
             (a rank of a group left holding a stream stalls the whole group)
  prefill_nomem  the prefill rank answers PREFILL with ERROR 503 (no device memory
             for the forward call): once, and the request runs again and completes
             with f's tokens; five times (the first run and 4 re-runs), and the
             request fails with 503 "gave up after 4 re-runs (prefill rank out of
             memory)"; the client sees nothing of the failed runs; with a second
             prefill group the re-run goes there
  group_broken  a decode group of two whose communicator breaks mid-stream with both
             ranks alive (GROUP_BROKEN): one re-form under a new epoch, the ranks show
             `joining` until it is out, reports of an old epoch or of the epoch being
             re-formed are ignored, every request completes with f's tokens, no rank death

Exit status 0 on success, 1 on failure, 77 when pyzmq/msgpack are missing.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

try:
    import msgpack
    import zmq
except ImportError:
    print("pyzmq/msgpack not installed: skipped")
    sys.exit(77)

VOCAB = 274          # tiny_tokenizer.json, added tokens included
EOS = 268            # <｜end▁of▁sentence｜> in tiny_tokenizer.json
CLI, RANK, CTL = b"DSV4C1", b"DSV4R1", b"DSV4A1"


def f(psum, seed, k):
    """The fake model: output token k (never EOS unless a test asks)."""
    t = (psum * 31 + seed * 17 + k * 7) % 264 + 3   # plain tokens 3..266
    return t


FAKE_GPU = "GPU-0123abcd-4567-89ef-0123-456789abcdef"   # a decode rank's READY device

ALL_RANKS = []
ALL_SCHEDS = []


class FakeRank(threading.Thread):
    """One fake rank (prefill or decode) on a DEALER socket."""

    def __init__(self, ctx, endpoint, role, index, capacity=16, tick=0.004, group=None,
                 group_rank=0, group_size=1, device=None, host="test", pid=None,
                 model=None, max_ctx=4096, abi=None):
        super().__init__(daemon=True)
        self.abi = abi                  # READY's abi (None: not sent, as an older rank)
        self.max_ctx = max_ctx          # READY's max_ctx
        self.model = model              # READY's model fingerprint (None: not sent)
        self.host = host                # READY's host and pid (the test's by default)
        self.pid = os.getpid() if pid is None else pid
        self.device = device            # READY's GPU UUID (None: not sent, as a CPU rank)
        self.ctx, self.endpoint, self.role, self.index = ctx, endpoint, role, index
        self.capacity, self.tick = capacity, tick
        self.group = index if group is None else group
        self.group_rank, self.group_size = group_rank, group_size
        self.fail_decode = 0            # answer this many DECODEs with an import ERROR
        self.fail_prefill = 0           # answer this many PREFILLs with ERROR 503
        self.prefill_error = None       # (code, message[, delay s]): answer the next PREFILL so
        self.rejoin = True              # DISCONNECT: READY again (False: record it, stop)
        self.hold_release = False       # decode: keep KV_RELEASE and steps back (an import
                                        # under way)
        self.held_release = []          # reqs whose KV_RELEASE is kept back
        self.hold_abort = False         # keep ABORT_DONE back (an abort under way)
        self.held_abort = []
        self.disconnects = []           # reasons of the DISCONNECTs received
        self.log = []                   # (cmd, req) of PREFILL, DECODE, ABORT, ERROR sent
        self.stop = False
        self.dead = False               # simulate a crash: stop answering
        self.streams = {}               # decode: req -> state
        self.max_streams = 0
        self.aborts = set()
        self.released = set()
        self.exported = set()
        self.welcomed = threading.Event()
        self.lock = threading.Lock()
        # groups (group_size > 1): COMM epochs this rank 0 was asked for, asks
        # held back while hold_comm, the epoch joined (HEARTBEAT comm_epoch),
        # actions for the rank's thread, a forced HEARTBEAT `active`
        self.comm_asks, self.held, self.hold_comm, self.joined = [], [], False, 0
        self.script, self.active_override = [], None
        ALL_RANKS.append(self)

    def do(self, *acts):
        """Queue actions for the rank's thread: ("broken", epoch) drops the
        streams and reports GROUP_BROKEN, ("late", epoch) only sends the report
        (one delivered late), ("hb",) sends a HEARTBEAT now, ("leave",) sends
        DRAIN, as a rank does at its SIGTERM, and ends the rank."""
        with self.lock:
            self.script += list(acts)

    def heartbeat(self, s):
        b = {"active": len(self.streams) if self.active_override is None
             else self.active_override}
        if self.group_size > 1:
            b["comm_epoch"] = self.joined
        self.send(s, 3, b)

    def run_script(self, s):
        with self.lock:
            acts, self.script = self.script, []
        for a in acts:
            if a[0] in ("broken", "late"):
                if a[0] == "broken":    # like daemons/rank group_broken
                    with self.lock:
                        self.streams.clear()
                    self.joined = 0
                self.send(s, 17, {"group": self.group, "group_rank": self.group_rank,
                                  "comm_epoch": a[1], "reason": "test: collective failed"})
            elif a[0] == "hb":
                self.heartbeat(s)
            elif a[0] == "leave":
                self.send(s, 13, {})
                self.stop = True
        while self.held_release and not self.hold_release:
            self.send(s, 8, {"req": self.held_release.pop(0)})
        while self.held_abort and not self.hold_abort:
            self.send(s, 12, {"req": self.held_abort.pop(0)})
        while self.held and not self.hold_comm:
            self.send(s, 16, {"comm_epoch": self.held.pop(0),
                              "comm_id": b"/fakecomm".ljust(128, b"\0")})

    def send(self, s, cmd, body, raw=()):
        self.last_tx = time.time()
        s.send_multipart([b"", RANK, bytes([cmd]), msgpack.packb(body)] + list(raw))

    def run(self):
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        ready = {"role": self.role, "index": self.index, "group": self.group,
                 "group_rank": self.group_rank, "group_size": self.group_size,
                 "capacity": self.capacity, "max_ctx": self.max_ctx, "host": self.host,
                 "pid": self.pid, "transports": ["shm"]}
        if self.device is not None:
            ready["device"] = self.device
        if self.model is not None:
            ready["model"] = self.model
        if self.abi is not None:
            ready["abi"] = self.abi
        self.send(s, 1, ready)
        while not self.stop:
            if self.dead:
                break
            if s.poll(int(self.tick * 1000)):
                fr = s.recv_multipart()
                cmd, body = fr[2][0], msgpack.unpackb(fr[3])
                self.handle(s, cmd, body, fr[4:])
            self.run_script(s)
            if self.role == "decode" and self.streams and not self.hold_release:
                self.step(s)            # (an import under way: no step yet)
            if time.time() - self.last_tx > 0.05:
                self.heartbeat(s)
        s.close(0)

    def handle(self, s, cmd, b, raw):
        if cmd == 2:
            self.welcomed.set()
        elif cmd == 4:                  # DISCONNECT: register again
            self.disconnects.append(b.get("reason"))
            if not self.rejoin:
                self.stop = True
                return
            self.joined = 0
            self.send(s, 1, {"role": self.role, "index": self.index, "group": self.group,
                             "group_rank": self.group_rank, "group_size": self.group_size,
                             "capacity": self.capacity, "max_ctx": self.max_ctx, "host": self.host,
                             "pid": self.pid})
        elif cmd == 16:                 # COMM: rank 0 makes the id; the others take it
            if "comm_id" not in b:
                self.comm_asks.append(b["comm_epoch"])
                self.held.append(b["comm_epoch"])
                self.run_script(s)
            else:
                self.joined = b["comm_epoch"]
                self.heartbeat(s)       # like daemons/rank after a join
        elif cmd == 5:                  # PREFILL
            self.log.append((5, b["req"]))
            if self.prefill_error is not None:
                code, msg = self.prefill_error[:2]
                if len(self.prefill_error) > 2:
                    time.sleep(self.prefill_error[2])
                self.prefill_error = None
                self.log.append((15, b["req"]))
                self.send(s, 15, {"req": b["req"], "code": code, "message": msg})
                return
            if self.fail_prefill > 0:   # like daemons/rank out of device memory
                self.fail_prefill -= 1
                self.log.append((15, b["req"]))
                self.send(s, 15, {"req": b["req"], "code": 503, "message":
                                  "prefill@%d: no device memory for a forward of %d rows "
                                  "(test)" % (self.index, len(b["tokens"]))})
                return
            toks, step = b["tokens"], b.get("step", 0)
            prompt = toks[:len(toks) - step]
            tok = f(sum(prompt), b["seed"], step)
            with self.lock:
                self.exported.add(b["req"])
            kv = [{"part": self.group_rank, "n_parts": self.group_size, "transport": "shm",
                   "n_tokens": len(toks),
                   "sizes": [64], "offsets": [0]}]
            self.send(s, 6, {"req": b["req"], "token": tok, "kv": kv},
                      [("shm-%d-%d" % (b["req"], sum(prompt))).encode()])
        elif cmd == 7:                  # DECODE
            h = b["kv"][0]
            self.log.append((7, b["req"]))
            if self.hold_release:
                self.held_release.append(b["req"])
            else:
                self.send(s, 8, {"req": b["req"]})
            # like daemons/rank: a stream held already, or a failed import
            err = None
            if b["req"] in self.streams:
                err = "req %d is already decoding" % b["req"]
            elif self.fail_decode > 0:
                self.fail_decode -= 1
                err = "import of the decode state failed (test)"
            if err is not None:
                self.log.append((15, b["req"]))
                self.send(s, 15, {"req": b["req"], "code": 500, "message": err})
                return
            # The prompt sum rides in the fake KV handle the scheduler forwards.
            psum = int(raw[0].decode().split("-")[2])
            with self.lock:
                self.streams[b["req"]] = {"psum": psum,
                                          "seed": b["seed"], "step": b.get("step", 1),
                                          "left": b["max_tokens"],
                                          "stop": set(b.get("stop_ids", [])),
                                          "pos": b["pos"], "token": b["token"],
                                          "kv": h}
                self.max_streams = max(self.max_streams, len(self.streams))
        elif cmd == 8:                  # KV_RELEASE
            with self.lock:
                self.released.add(b["req"])
                self.exported.discard(b["req"])
        elif cmd == 11:                 # ABORT
            self.log.append((11, b["req"]))
            with self.lock:
                self.aborts.add(b["req"])
                self.streams.pop(b["req"], None)
                self.exported.discard(b["req"])
            if self.hold_abort:
                self.held_abort.append(b["req"])
            else:
                self.send(s, 12, {"req": b["req"]})

    def step(self, s):
        reqs, toks, done = [], [], []
        with self.lock:
            for req, st in list(self.streams.items()):
                tok = PSUM.token(req, st["psum"], st["seed"], st["step"])
                st["step"] += 1
                st["left"] -= 1
                reqs.append(req)
                toks.append(tok)
                if st["left"] == 0 or tok in st["stop"]:
                    done.append((req, "stop" if tok in st["stop"] else "length",
                                 st["step"]))
                    del self.streams[req]
        if reqs:
            self.send(s, 9, {"step": 0, "reqs": reqs, "tokens": toks})
        for req, fin, n in done:
            self.send(s, 10, {"req": req, "finish": fin, "n_tokens": n})


class Psum:
    """Tokens the test forces on the fake decode rank (req, k) -> id."""

    def __init__(self):
        self.override = {}

    def token(self, req, psum, seed, k):
        o = self.override.get((seed, k))
        return o if o is not None else f(psum, seed, k)


PSUM = Psum()


class Sched:
    def __init__(self, build, tmp, extra=()):
        self.tmp = tmp
        self.ep = {n: "ipc://%s/%s.sock" % (tmp, n) for n in ("client", "rank", "ctl")}
        self.build = build
        args = [os.path.join(build, "daemons/sched/dsv4-sched"), "-v",
                "-o", "client_endpoint=" + self.ep["client"],
                "-o", "rank_endpoint=" + self.ep["rank"],
                "-o", "admin_endpoint=" + self.ep["ctl"],
                "-o", "heartbeat_ms=100", "-o", "liveness=3",
                "-o", "tokenizer=" + TOKENIZER] + list(extra)
        self.log = open(os.path.join(tmp, "sched.log"), "w")
        self.p = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        ALL_SCHEDS.append(self)

    def ctl(self, *args):
        """dsv4ctl --json: (exit status, the parsed output or None)."""
        rc, out = self.ctl_text("--json", *args)
        return rc, (json.loads(out) if out.strip() else None)

    def ctl_text(self, *args):
        """dsv4ctl's table output: (exit status, text)."""
        r = subprocess.run([os.path.join(self.build, "tools/dsv4ctl/dsv4ctl"),
                            "--admin", self.ep["ctl"]] + list(args),
                           capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout

    def stop(self):
        self.p.terminate()
        rc = self.p.wait(timeout=30)
        self.log.close()
        return rc


class Client:
    def __init__(self, ctx, ep):
        self.s = ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(ep)
        self.next_id = 1

    def generate(self, **kw):
        """Send GENERATE `kw` under the client's next id, or `id` if given;
        returns the id."""
        if "id" not in kw:
            kw["id"] = self.next_id
            self.next_id += 1
        self.s.send_multipart([b"", CLI, bytes([1]), msgpack.packb(kw)])
        return kw["id"]

    def cancel(self, i):
        self.s.send_multipart([b"", CLI, bytes([6]), msgpack.packb({"id": i})])

    def collect(self, ids, timeout=30, on_tokens=None, seen_ok=False):
        """Run until every id got DONE or ERROR; returns id -> result."""
        res = {i: {"tokens": [], "text": "", "ok": seen_ok} for i in ids}
        left = set(ids)
        end = time.time() + timeout
        while left and time.time() < end:
            if not self.s.poll(100):
                continue
            fr = self.s.recv_multipart()
            assert fr[1] == CLI, fr
            cmd, b = fr[2][0], msgpack.unpackb(fr[3])
            r = res.get(b["id"])
            if r is None:
                continue
            if cmd == 2:
                r["ok"] = True
                r["req"] = b["req"]
            elif cmd == 4:
                assert r["ok"] and "final" not in r
                r["tokens"] += b["tokens"]
                r["text"] += b["text"]
                if on_tokens:
                    on_tokens(b["id"], r)
            elif cmd in (3, 5):
                assert "final" not in r
                r["final"] = (cmd, b)
                left.discard(b["id"])
        if left:
            raise AssertionError("no final message for %s" % sorted(left))
        return res


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def expected(prompt, seed, n):
    return [f(sum(prompt), seed, k) for k in range(n)]


def wait_ranks(sc, n):
    end = time.time() + 20
    while time.time() < end:
        rc, st = sc.ctl("status")
        if rc == 0 and st["n_ranks_ready"] >= n:
            return
        time.sleep(0.05)
    raise AssertionError("ranks did not register")


def wait_idle(sc):
    """No request left in the scheduler (all state released)."""
    end = time.time() + 20
    while time.time() < end:
        rc, reqs = sc.ctl("requests")
        if rc == 0 and reqs == []:
            return
        time.sleep(0.05)
    raise AssertionError("requests left: %s" % reqs)


def submit(cl, prompt, seed, n, **kw):
    i = cl.generate(tokens=prompt, seed=seed, max_tokens=n, temperature=0, **kw)
    return i


def setup(ctx, build, tmp, extra=(), max_batch=16):
    sc = Sched(build, tmp, ["-o", "max_batch=%d" % max_batch] + list(extra))
    time.sleep(0.2)
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0, capacity=2)
    dec = FakeRank(ctx, sc.ep["rank"], "decode", 0, capacity=16, device=FAKE_GPU)
    pre.start()
    dec.start()
    wait_ranks(sc, 2)
    return sc, pre, dec


def prompts(n):
    return [[(i * 13 + j * 5) % 250 + 5 for j in range(3 + i % 5)] for i in range(n)]


def t_basic(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    ps = prompts(4)
    ids = {}
    for k, p in enumerate(ps):
        i = submit(cl, p, 1000 + k, 12)
        ids[i] = (p, 1000 + k)
    res = collect_with_psum(cl, ids)
    for i, (p, seed) in ids.items():
        r = res[i]
        check(r["final"][0] == 5, "DONE expected: %s" % (r["final"],))
        d = r["final"][1]
        check(d["finish"] == "length", d)
        check(r["tokens"] == expected(p, seed, 12), "tokens %s" % r["tokens"])
        check(d["prompt_tokens"] == len(p) and d["completion_tokens"] == 12, d)
    wait_idle(sc)
    rc, st = sc.ctl("status")
    check(st["n_done"] == 4 and st["handoffs"] == 4 and st["tokens_out"] == 48, st)
    check(st["handoff_count"] == 4, st)
    # An import the decode rank refuses (KV_RELEASE, then ERROR): the re-run's
    # handoff is timed, the refused one is not (protocol.md §7; it was).
    dec.fail_decode = 1
    p = [7, 8, 9]
    i = submit(cl, p, 5, 6)
    r = cl.collect([i])[i]
    check(r["final"][0] == 5 and r["tokens"] == expected(p, 5, 6), r)
    wait_idle(sc)
    rc, st = sc.ctl("status")
    check(st["handoffs"] == 6 and st["reruns"] == 1 and st["handoff_count"] == 5, st)
    # the ranks' GPUs: whole in --json, cut to "GPU-" + 8 digits in the table,
    # "-" for a rank that sent none
    check(rank_row(sc, "decode@0").get("device") == FAKE_GPU and
          "device" not in rank_row(sc, "prefill@0"), "dsv4ctl --json ranks: device")
    # ranks that say no model: none in --json ranks or status, "-" in the text
    check("model" not in rank_row(sc, "decode@0") and "model" not in st,
          "a model without any rank saying one: %s" % st)
    rc, text = sc.ctl_text("status")
    check(rc == 0 and re.search(r"^model +- \(none yet\)$", text, re.M) is not None,
          "dsv4ctl status without a model:\n" + text)
    rc, text = sc.ctl_text("ranks")
    rows = {ln.split()[0]: ln for ln in text.splitlines()[1:] if ln.strip()}
    check(rc == 0 and "DEVICE" in text.splitlines()[0] and
          re.search(r" %s +-$" % FAKE_GPU[:12], rows.get("decode@0", "")) is not None and
          re.search(r"s +- +-$", rows.get("prefill@0", "")) is not None,
          "dsv4ctl ranks: the DEVICE column:\n" + text)
    return sc, [pre, dec]


def collect_with_psum(cl, ids, timeout=60, on_tokens=None):
    """collect() for a dict id -> (prompt, seed)."""
    return cl.collect(list(ids), timeout, on_tokens)


def t_batch(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp, max_batch=4)
    cl = Client(ctx, sc.ep["client"])
    ids = {}
    for k, p in enumerate(prompts(40)):
        ids[submit(cl, p, k, 6)] = (p, k)
    res = collect_with_psum(cl, ids)
    for i, (p, seed) in ids.items():
        check(res[i]["tokens"] == expected(p, seed, 6), "request %d" % i)
    check(dec.max_streams <= 4, "decode rank saw %d streams" % dec.max_streams)
    check(dec.max_streams == 4, "batching never reached 4 (%d)" % dec.max_streams)
    wait_idle(sc)
    return sc, [pre, dec]


def t_stop(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    p = [10, 20, 30]
    seed = 5
    full = expected(p, seed, 20)
    # Stop id: the 6th output token.
    i1 = submit(cl, p, seed, 20, stop_ids=[full[5]])
    # EOS from the model ends a request too (forced as output token 7 of seed 77).
    PSUM.override[(77, 7)] = EOS
    i2 = submit(cl, p, 77, 20)
    # No streaming: everything in one TOKENS before DONE.
    i3 = cl.generate(tokens=p, seed=seed, max_tokens=20, temperature=0, stream=False)
    ids = {i1: (p, seed), i2: (p, 77), i3: (p, seed)}
    res = collect_with_psum(cl, ids)
    check(res[i1]["tokens"] == full[:6] and res[i1]["final"][1]["finish"] == "stop",
          "stop id: %s" % res[i1])
    check(res[i2]["tokens"] == expected(p, 77, 7) + [EOS] and res[i2]["final"][1]["finish"] == "stop",
          "eos: %s" % res[i2])
    text = res[i3]["text"]
    check(res[i3]["tokens"] == full and len(text) > 4, "non-stream: %s" % res[i3])
    # Now a stop string taken from the middle of that text.
    cut = len(text) // 2
    stop = text[cut:cut + 3]
    first = text.find(stop)
    i4 = submit(cl, p, seed, 20, stop=[stop])
    res = collect_with_psum(cl, {i4: (p, seed)})
    r = res[i4]
    check(r["final"][1]["finish"] == "stop", r)
    check(r["text"] == text[:first], "stop string cut: %r vs %r" % (r["text"], text[:first]))
    check(r["tokens"] == full[:len(r["tokens"])] and len(r["tokens"]) < 20, r)
    # A stop string inside an added token's text (here the EOS's) is no
    # match: the marker goes out whole, the request ends at the EOS.  The
    # old scheduler cut the text inside it ("...<｜end▁of") and the pieces
    # reached the client.
    eos_text = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    i6 = submit(cl, p, 77, 20)
    res = collect_with_psum(cl, {i6: (p, 77)})
    res_eos_text = res[i6]["text"]
    check(res_eos_text.endswith(eos_text), "EOS text: %r" % res_eos_text)
    plain = res_eos_text[:-len(eos_text)]
    for stop in ("of", "end\u2581", "\u2581sentence\uff5c>"):
        if stop in plain:
            continue
        i7 = submit(cl, p, 77, 20, stop=[stop])
        res = collect_with_psum(cl, {i7: (p, 77)})
        check(res[i7]["text"] == res_eos_text and res[i7]["tokens"] == expected(p, 77, 7) + [EOS]
              and res[i7]["final"][1]["finish"] == "stop",
              "stop %r inside the EOS text: %r" % (stop, res[i7]))
    # The U+FFFD of a character left unfinished is text like any other:
    # found by a stop string when an added token (here EOS) follows it, and
    # when the request's end (max_tokens) flushes it.  Both were missed:
    # "\ufffd<eos>" and "\ufffd" with finish length came back.
    # (the decode rank's tokens: steps 1 and 2; the prefill's, step 0, is
    # f's, ASCII for this seed)
    PSUM.override[(7070, 1)] = 228          # a lead byte, never finished
    PSUM.override[(7070, 2)] = EOS
    t0 = expected(p, 7070, 1)[0]
    check(t0 < 128, "seed 7070's first token %d is not ASCII" % t0)
    for n_max, why in ((5, "before the EOS"), (2, "at max_tokens")):
        j = submit(cl, p, 7070, n_max, stop=["\ufffd"])
        r = collect_with_psum(cl, {j: (p, 7070)})[j]
        check(r["text"] == chr(t0) and r["final"][1]["finish"] == "stop" and
              r["tokens"][1] == 228, "stop U+FFFD %s: %s" % (why, r))
    # 64 stop ids (the protocol's most), none of them EOS: with the EOS the
    # scheduler adds, DECODE carries 65 (it could not be sent, and the
    # request hung after its first token)
    many = [t for t in range(3, 270) if t not in full and t != EOS][:63] + [full[5]]
    i5 = submit(cl, p, seed, 20, stop_ids=many)
    res = collect_with_psum(cl, {i5: (p, seed)})
    check(res[i5]["tokens"] == full[:6] and res[i5]["final"][1]["finish"] == "stop",
          "64 stop ids: %s" % res[i5])
    wait_idle(sc)
    return sc, [pre, dec]


def t_cancel(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    ids = {}
    for k, p in enumerate(prompts(8)):
        ids[submit(cl, p, k, 4000 if k % 2 == 0 else 5)] = (p, k)
    cancelled = set()

    def on_tokens(i, r):
        if ids[i][1] % 2 == 0 and i not in cancelled and len(r["tokens"]) >= 3:
            cl.cancel(i)
            cancelled.add(i)
    res = collect_with_psum(cl, ids, on_tokens=on_tokens)
    for i, (p, k) in ids.items():
        d = res[i]["final"][1]
        if k % 2 == 0:
            check(d["finish"] == "cancelled", d)
            n = len(res[i]["tokens"])
            check(res[i]["tokens"] == expected(p, k, n), "cancelled output")
            check(d["completion_tokens"] >= n, d)
        else:
            check(d["finish"] == "length" and res[i]["tokens"] == expected(p, k, 5), d)
    # Cancel of an unknown id: 404.
    cl.cancel(999)
    fr = cl.s.recv_multipart()
    b = msgpack.unpackb(fr[3])
    check(fr[2][0] == 3 and b["code"] == 404 and b["id"] == 999, b)
    wait_idle(sc)
    time.sleep(0.2)
    check(not dec.streams, "decode rank still holds %s" % dec.streams)
    check(len(dec.aborts) >= 4, "aborts %s" % dec.aborts)
    rc, st = sc.ctl("status")
    check(st["n_cancelled"] == 4, st)
    return sc, [pre, dec]


def t_ctl_cancel(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    p = prompts(1)[0]
    i = submit(cl, p, 7, 4000, tag="long-one")   # 4,000 ticks of 4 ms: 16 s

    def decoding():
        rc, reqs = sc.ctl("requests")
        return (rc == 0 and len(reqs) == 1 and reqs[0]["state"] == "decoding" and
                reqs[0]["completion_tokens"] >= 3)
    end = time.time() + 20
    while not decoding() and time.time() < end:
        time.sleep(0.02)
    rc, reqs = sc.ctl("requests")
    r = reqs[0]
    check(r["state"] == "decoding", "not decoding: %s" % r)
    # where it runs: the decode group (the prefill group let go at the handoff)
    check(r["decode_group"] == 0 and r["prefill_group"] is None and r["reruns"] == 0, r)
    rc, text = sc.ctl_text("requests")
    lines = text.splitlines()
    check(rc == 0 and lines[0].split()[:3] == ["REQ", "STATE", "WHERE"] and
          lines[1].split()[:3] == [str(r["req"]), "decoding", "decode/0"] and
          lines[1].split()[-1] == "long-one", "dsv4ctl requests:\n" + text)
    # dsv4ctl cancel: DONE cancelled at the client, ABORT at the decode rank
    rc, res = sc.ctl("cancel", str(r["req"]))
    check(rc == 0 and res["code"] == 200, "dsv4ctl cancel: %s %s" % (rc, res))
    out = cl.collect([i])[i]
    d = out["final"][1]
    n = len(out["tokens"])
    check(out["final"][0] == 5 and d["finish"] == "cancelled" and 3 <= n < 4000, d)
    check(out["tokens"] == expected(p, 7, n), "cancelled output is not f's prefix")
    wait_idle(sc)
    time.sleep(0.2)
    check(not dec.streams and r["req"] in dec.aborts,
          "decode rank: streams %s, aborts %s" % (dec.streams, dec.aborts))
    rc, res = sc.ctl("cancel", str(r["req"]))
    check(rc == 1 and res["code"] == 404, "a second cancel: %s %s" % (rc, res))
    rc, st = sc.ctl("status")
    check(st["n_cancelled"] == 1 and st["n_done"] == 0, st)
    return sc, [pre, dec]


def t_death(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    ids = {}
    for k, p in enumerate(prompts(8)):
        ids[submit(cl, p, k, 60)] = (p, k)
    state = {"killed": False, "new": None}

    def on_tokens(i, r):
        if not state["killed"] and len(r["tokens"]) >= 10:
            state["killed"] = True
            dec.dead = True             # stops answering, like kill -9
            nd = FakeRank(ctx, sc.ep["rank"], "decode", 1)
            nd.start()
            state["new"] = nd
    res = collect_with_psum(cl, ids, timeout=60, on_tokens=on_tokens)
    check(state["killed"], "never killed")
    for i, (p, k) in ids.items():
        check(res[i]["final"][0] == 5, res[i]["final"])
        check(res[i]["tokens"] == expected(p, k, 60),
              "request %d: %d tokens, duplicates or loss" % (i, len(res[i]["tokens"])))
    rc, st = sc.ctl("status")
    check(st["rank_deaths"] >= 1 and st["reruns"] >= 1, st)
    rc, ranks = sc.ctl("ranks")
    check(any(r["name"] == "decode@0" and r["state"] == "dead" for r in ranks), ranks)
    wait_idle(sc)
    return sc, [pre, dec, state["new"]]


def t_death_ctx(ctx, build, tmp):
    """A stream that only decode@0 can hold (decode@1's max_ctx is 128)
    when decode@0 dies: its re-run waits for decode@0 to come back and
    completes (the old scheduler counted only groups with live ranks and
    failed it with 413)."""
    sc = Sched(build, tmp, ["-o", "max_batch=16"])
    time.sleep(0.2)
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0)
    d0 = FakeRank(ctx, sc.ep["rank"], "decode", 0)
    d1 = FakeRank(ctx, sc.ep["rank"], "decode", 1, max_ctx=128)
    for r in (pre, d0, d1):
        r.start()
    wait_ranks(sc, 3)
    cl = Client(ctx, sc.ep["client"])
    p, seed = [10, 20, 30], 6
    i = submit(cl, p, seed, 200)
    state = {"new": None}

    def on_tokens(_, r):
        if state["new"] is None and len(r["tokens"]) >= 10:
            d0.dead = True              # stops answering, like kill -9
            state["new"] = True
    # a new decode@0 registers once the scheduler has seen the old one dead
    done = {}

    def restart_when_dead():
        end = time.time() + 30
        while time.time() < end:
            rc, ranks = sc.ctl("ranks")
            if any(x["name"] == "decode@0" and x["state"] == "dead" for x in ranks):
                nd = FakeRank(ctx, sc.ep["rank"], "decode", 0)
                nd.start()
                done["rank"] = nd
                return
            time.sleep(0.05)
    t = threading.Thread(target=restart_when_dead)
    t.start()
    res = collect_with_psum(cl, {i: (p, seed)}, timeout=60, on_tokens=on_tokens)
    t.join()
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, seed, 200),
          "re-run after decode@0's death: %s" % (res[i]["final"],))
    wait_idle(sc)
    return sc, [pre, d0, d1, done.get("rank")]


def t_overload(ctx, build, tmp):
    sc = Sched(build, tmp, ["-o", "queue_max=3"])
    time.sleep(0.2)
    cl = Client(ctx, sc.ep["client"])
    ids = [submit(cl, [5, 6], 1, 4) for _ in range(5)]
    got = {}
    end = time.time() + 10
    while len(got) < 5 and time.time() < end:
        if cl.s.poll(100):
            fr = cl.s.recv_multipart()
            b = msgpack.unpackb(fr[3])
            got[b["id"]] = (fr[2][0], b)
    check(all(got[i][0] == 2 for i in ids[:3]), got)
    check(all(got[i][0] == 3 and got[i][1]["code"] == 300 for i in ids[3:]), got)
    # Global drain: admits nothing (301), and its reply waits for the queue.
    rc, _ = sc.ctl("drain", "all", "--timeout", "0.3")
    check(rc == 1, "drain with queued work must time out (rc %d)" % rc)
    i = submit(cl, [5, 6], 1, 4)
    fr = cl.s.recv_multipart()
    b = msgpack.unpackb(fr[3])
    check(fr[2][0] == 3 and b["code"] == 301 and b["id"] == i, b)
    rc, st = sc.ctl("status")
    check(st["draining"] and st["n_queued"] == 3, st)
    # a drain still waiting when the drain is lifted is answered then (409)
    waiting = subprocess.Popen([os.path.join(sc.build, "tools/dsv4ctl/dsv4ctl"), "--admin",
                                sc.ep["ctl"], "drain", "all"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    time.sleep(0.3)
    check(waiting.poll() is None, "drain all with queued work returned at once")
    rc, _ = sc.ctl("undrain")
    check(rc == 0, "undrain")
    out = waiting.communicate(timeout=10)[0]
    check(waiting.returncode != 0 and "undrained" in out,
          "the waiting drain after undrain: rc %s %r" % (waiting.returncode, out))
    # Ranks arrive: the queued work runs and drain completes.
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0)
    dec = FakeRank(ctx, sc.ep["rank"], "decode", 0)
    pre.start()
    dec.start()
    res = cl.collect(ids[:3], timeout=30, seen_ok=True)
    check(all(res[i]["final"][0] == 5 for i in ids[:3]), res)
    rc, _ = sc.ctl("drain", "decode@0", "--timeout", "10")
    check(rc == 0, "rank drain")
    rc, ranks = sc.ctl("ranks")
    check(any(r["name"] == "decode@0" and r["state"] == "drained" for r in ranks), ranks)
    # A drained rank gets no new work: the request waits in the queue.
    i = submit(cl, [7], 2, 3)
    time.sleep(0.3)
    rc, reqs = sc.ctl("requests")
    check(len(reqs) == 1 and reqs[0]["state"] == "queued", reqs)
    rc, _ = sc.ctl("undrain", "decode@0")
    res = cl.collect([i], timeout=30)
    check(res[i]["final"][0] == 5, res)
    rc, _ = sc.ctl("drain", "nosuch@1")
    check(rc == 1, "unknown rank")
    return sc, [pre, dec]


def t_resume(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    p, n = [11, 12, 13, 14], 8
    # The first run, as a client sees it: OK carries the seed in effect.
    i = cl.generate(tokens=p, max_tokens=n, temperature=0)
    msgs, seed = [], None
    while True:
        fr = cl.s.recv_multipart()
        cmd, b = fr[2][0], msgpack.unpackb(fr[3])
        if cmd == 2:
            seed = b.get("seed")
        elif cmd == 4:
            msgs.append((b["tokens"], b["text"]))
        elif cmd in (3, 5):
            break
    check(seed is not None, "OK has no seed")
    toks = [t for ts, _ in msgs for t in ts]
    text = "".join(x for _, x in msgs).encode()
    check(toks == expected(p, seed, n) and cmd == 5, "first run: %s" % toks)
    # Resume after the first messages, as a client would after losing the
    # scheduler: the rest comes, the same tokens and text, nothing twice.
    for cut in (1, 3, len(msgs) - 1):
        k = sum(len(ts) for ts, _ in msgs[:cut])
        tl = len("".join(x for _, x in msgs[:cut]).encode())
        j = cl.generate(tokens=p, max_tokens=n, temperature=0, seed=seed,
                        resume=toks[:k], resume_text=tl)
        r = cl.collect([j])[j]
        check(r["final"][0] == 5 and r["final"][1]["finish"] == "length" and
              r["final"][1]["completion_tokens"] == n, "resume at %d: %s" % (k, r["final"]))
        check(r["tokens"] == toks[k:], "resume at %d: tokens %s != %s" %
              (k, r["tokens"], toks[k:]))
        check(r["text"].encode() == text[tl:], "resume at %d: text %r != %r" %
              (k, r["text"], text[tl:]))
    # A token whose text is a NUL byte (id 0 of the tiny tokenizer, forced as
    # the fake's third token): the wire's text drops it, so a client's
    # resume_text does not count it; every resume after it goes on with
    # the same text, no byte twice and none refused.
    seed0 = 4242
    PSUM.override[(seed0, 2)] = 0
    i = cl.generate(tokens=p, max_tokens=n, temperature=0, seed=seed0)
    msgs0 = []
    while True:
        fr = cl.s.recv_multipart()
        cmd, b = fr[2][0], msgpack.unpackb(fr[3])
        if cmd == 4:
            msgs0.append((b["tokens"], b["text"]))
        elif cmd in (3, 5):
            break
    toks0 = [t for ts, _ in msgs0 for t in ts]
    text0 = "".join(x for _, x in msgs0).encode()
    check(cmd == 5 and toks0[2] == 0 and b"\0" not in text0, "NUL token run: %s" % toks0)
    for cut in range(1, len(msgs0)):
        k = sum(len(ts) for ts, _ in msgs0[:cut])
        if k <= 2:
            continue
        tl = len("".join(x for _, x in msgs0[:cut]).encode())
        j = cl.generate(tokens=p, max_tokens=n, temperature=0, seed=seed0,
                        resume=toks0[:k], resume_text=tl)
        r = cl.collect([j])[j]
        check(r["final"][0] == 5 and r["tokens"] == toks0[k:] and
              r["text"].encode() == text0[tl:], "resume after a NUL token at %d: %s %r != %r" %
              (k, r["final"], r["text"], text0[tl:]))
    # A stop string across the NUL token ("xy" where the text is x NUL y):
    # the client's text has "xy", so it stops there (the scheduler matched
    # on its own text, with the NUL, and ran to max_tokens).
    t0 = text0.decode()
    across = t0[1:3]
    check(toks0[0] < 128 and toks0[1] < 128 and toks0[3] < 128 and t0.find(across) == 1,
          "the NUL run's text %r does not suit the case" % t0)
    j = cl.generate(tokens=p, max_tokens=n, temperature=0, seed=seed0, stop=[across])
    r = cl.collect([j])[j]
    check(r["final"][0] == 5 and r["final"][1]["finish"] == "stop" and
          r["text"] == t0[:1], "stop %r across a NUL token: %s" % (across, r))
    # All tokens already there (the DONE was lost): DONE at once, nothing else.
    j = cl.generate(tokens=p, max_tokens=n, temperature=0, seed=seed, resume=toks,
                    resume_text=len(text))
    r = cl.collect([j])[j]
    check(r["tokens"] == [] and r["final"][0] == 5 and r["final"][1]["finish"] == "length",
          "complete resume: %s" % r)
    # A stop id among the resumed tokens ends it there, with finish stop.
    j = cl.generate(tokens=p, max_tokens=n, temperature=0, seed=seed, resume=toks[:3],
                    stop_ids=[toks[1]])
    r = cl.collect([j])[j]
    check(r["tokens"] == [] and r["final"][1]["finish"] == "stop", "stop in resume: %s" % r)
    # Refused: no seed; more than max_tokens; text past the tokens' text.
    for kw, code in [({"resume": toks[:2]}, 401),
                     ({"seed": seed, "resume": toks + toks}, 401),
                     ({"seed": seed, "resume": toks[:2], "resume_text": 100000}, 401)]:
        j = cl.generate(tokens=p, max_tokens=n, temperature=0, **kw)
        r = cl.collect([j])[j]
        check(r["final"][0] == 3 and r["final"][1]["code"] == code, "%s: %s" % (kw, r))
    # The same when the close's flush is what reaches the count: the lead
    # byte 0xE4 resumed, then a continuation byte (the prefill's token, f's
    # for a seed picked so) and max_tokens (the request's end makes a U+FFFD
    # of the two): 401, not 500.
    # It counts as failed, not done.
    sd = next(x for x in range(1, 10000) if 0x80 <= expected(p, x, 2)[1] <= 0xBF)
    wait_idle(sc)
    _, st0 = sc.ctl("status")
    j = cl.generate(tokens=p, max_tokens=2, temperature=0, seed=sd, resume=[0xE4],
                    resume_text=1)
    r = cl.collect([j])[j]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 401, "resume_text at the flush: %s" % r)
    wait_idle(sc)
    _, st = sc.ctl("status")
    check(st["n_failed"] == st0["n_failed"] + 1 and st["n_done"] == st0["n_done"],
          "resume_text at the flush counted: %s -> %s" % (st0, st))
    # A count past the resumed tokens' text that ends inside the character
    # the next token completes (the lead byte 0xC3 resumed, 1 byte counted):
    # 401 once the text gets there (it was taken, and every later piece
    # failed to encode: 500).
    j = cl.generate(tokens=p, max_tokens=n, temperature=0, seed=seed, resume=[0xC3],
                    resume_text=1)
    r = cl.collect([j])[j]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 401 and
          "inside a character" in r["final"][1]["message"], "resume_text inside: %s" % r)
    wait_idle(sc)
    return sc, [pre, dec]


def t_refuse(ctx, build, tmp):
    """GENERATEs the scheduler refuses: each gets ERROR with its code and
    message at once and counts as rejected; nothing of them is placed, and a
    request in flight under a reused id goes on."""
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    _, st0 = sc.ctl("status")
    big = 1000000    # above the tiny tokenizer's vocabulary
    cases = [
        ({"tokens": [5, big]}, 401, r"tokens\[1\] = 1000000 is outside the vocabulary "
         r"\(\d+ ids\)"),
        ({"tokens": [5, 6], "seed": 3, "resume": [7, big]}, 401,
         r"resume\[1\] = 1000000 is outside the vocabulary"),
        # the fake decode rank holds 4,096 positions: 10 + 4,087 do not fit
        ({"tokens": [5] * 10, "max_tokens": 4087}, 413,
         r"prompt \(10 tokens\) plus max_tokens \(4087\) exceed the context"),
        # (refused by the protocol's bounds, before the tokenizer)
        ({"prompt": ""}, 401, r"prompt: 0 elements/bytes, minimum 1"),
    ]
    for kw, code, msg in cases:
        kw = dict({"max_tokens": 4, "temperature": 0}, **kw)
        j = cl.generate(**kw)
        r = cl.collect([j], timeout=10)[j]
        check(not r["ok"] and r["final"][0] == 3 and r["final"][1]["code"] == code and
              re.search(msg, r["final"][1]["message"]), "%s: %s" % (kw, r))
    # exactly the context: admitted (cancelled once it runs)
    j = cl.generate(tokens=[5] * 10, max_tokens=4086, temperature=0)
    cancelled = []

    def cancel_once(i, _):
        if not cancelled:
            cancelled.append(i)
            cl.cancel(i)
    r = cl.collect([j], timeout=10, on_tokens=cancel_once)[j]
    check(r["ok"] and r["final"][0] == 5 and r["final"][1]["finish"] == "cancelled",
          "10 + 4,086 tokens: %s" % (r,))
    # an id in use by a request in flight: the second GENERATE is refused,
    # the first streams on to its end
    p, n = [21, 22, 23], 60
    first = {"id": 500, "tokens": p, "max_tokens": n, "temperature": 0, "seed": 9}
    cl.generate(**first)
    got, refused, final = [], None, None
    end = time.time() + 30
    while final is None and time.time() < end:
        if not cl.s.poll(100):
            continue
        fr = cl.s.recv_multipart()
        cmd, b = fr[2][0], msgpack.unpackb(fr[3])
        check(b["id"] == 500, "a message for id %s" % b["id"])
        if cmd == 2 and not got:
            cl.generate(**dict(first, seed=10))
        elif cmd == 4:
            got += b["tokens"]
        elif cmd == 3 and refused is None:
            refused = b
        elif cmd in (3, 5):
            final = (cmd, b)
    check(refused is not None and refused["code"] == 401 and
          "already in use" in refused["message"], "the reused id: %s" % refused)
    check(final is not None and final[0] == 5 and got == expected(p, 9, n),
          "the request in flight: %s, tokens %s" % (final, got))
    wait_idle(sc)
    _, st = sc.ctl("status")
    check(st["n_rejected"] - st0["n_rejected"] == len(cases) + 1,
          "rejected %d -> %d" % (st0["n_rejected"], st["n_rejected"]))
    # a scheduler without a tokenizer takes token ids only
    nt = os.path.join(tmp, "nt")
    os.mkdir(nt)
    s2 = Sched(build, nt, ["-o", "tokenizer=none"])
    time.sleep(0.2)
    c2 = Client(ctx, s2.ep["client"])
    j = c2.generate(prompt="hello", max_tokens=4)
    r = c2.collect([j], timeout=10)[j]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 501 and
          "no tokenizer configured" in r["final"][1]["message"], "no tokenizer: %s" % (r,))
    check(s2.stop() == 0, "the scheduler without a tokenizer did not exit 0")
    ALL_SCHEDS.remove(s2)
    return sc, [pre, dec]


def t_drain_hol(ctx, build, tmp):
    """A queued request that only a drained decode group can hold waits for
    it without holding up the requests behind it (they waited for it, an idle
    group beside); undrained, it is served.  A prompt plus max_tokens beyond
    every prefill rank's context is refused at once (a re-run after a decode
    rank's loss prefills the prompt and the output so far)."""
    sc = Sched(build, tmp, ["-o", "max_batch=16"])
    time.sleep(0.2)
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0, max_ctx=200)
    d0 = FakeRank(ctx, sc.ep["rank"], "decode", 0, max_ctx=64)
    d1 = FakeRank(ctx, sc.ep["rank"], "decode", 1, max_ctx=4096)
    for r in (pre, d0, d1):
        r.start()
    wait_ranks(sc, 3)
    rc, _ = sc.ctl("drain", "decode@1")
    check(rc == 0, "drain decode@1")
    cl = Client(ctx, sc.ep["client"])
    p_long, p_short = [10, 20, 30], [11, 21, 31]
    long_id = submit(cl, p_long, 1, 100)      # 103 positions: decode@1 only
    short_id = submit(cl, p_short, 2, 8)      # fits decode@0, idle
    r = cl.collect([short_id], timeout=20)[short_id]
    check(r["final"][0] == 5 and r["tokens"] == expected(p_short, 2, 8),
          "the request behind one waiting for a drained group: %s" % (r,))
    rc, reqs = sc.ctl("requests")
    check(rc == 0 and [x["state"] for x in reqs] == ["queued"], "requests: %s" % (reqs,))
    rc, _ = sc.ctl("undrain", "decode@1")
    check(rc == 0, "undrain decode@1")
    r = cl.collect([long_id], timeout=30, seen_ok=True)[long_id]
    check(r["final"][0] == 5 and r["tokens"] == expected(p_long, 1, 100),
          "the request that waited for decode@1: %s, %d tokens" % (r["final"],
                                                                    len(r["tokens"])))
    # 3 + 300 fits decode@1 but no prefill rank (200): 413 at once
    j = cl.generate(tokens=p_long, max_tokens=300, temperature=0, seed=1)
    r = cl.collect([j], timeout=10)[j]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 413 and
          "exceed the context" in r["final"][1]["message"], "3 + 300: %s" % (r,))
    wait_idle(sc)
    return sc, [pre, d0, d1]


def t_drain_restart(ctx, build, tmp):
    """A rank drain that waits while the rank restarts: the new process of
    the same name stays drained and the wait follows it (answered once it
    holds nothing); undrained, the stream the old one held runs again and
    completes.  A rank of another name that takes the drained rank's place
    in its group ends the wait with "rank gone"."""
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    p, n = [31, 32, 33], 400
    i = submit(cl, p, 5, n)
    out = {}

    def state():
        return rank_row(sc, "decode@0")["state"]

    def streaming():
        # the stream on decode@0 before the drain: a drain of an idle rank
        # ends at once ("drained", never "draining")
        end = time.time() + 10
        while rank_row(sc, "decode@0").get("active", 0) == 0 and time.time() < end:
            time.sleep(0.02)
        check(rank_row(sc, "decode@0").get("active", 0) > 0, "no stream on decode@0")

    def drain(key):
        out[key] = sc.ctl_text("drain", "decode@0", "--timeout", "20")
    streaming()
    t = threading.Thread(target=drain, args=("first",))
    t.start()

    def wait_draining():
        end = time.time() + 10
        while state() != "draining" and time.time() < end:
            time.sleep(0.02)
        check(state() == "draining", "decode@0 not draining")
    wait_draining()
    dec.dead = True                 # stops answering, like kill -9
    nd = FakeRank(ctx, sc.ep["rank"], "decode", 0, device=FAKE_GPU)
    nd.start()
    t.join(15)
    check(not t.is_alive() and out["first"][0] == 0 and "drained" in out["first"][1],
          "the drain across the restart: %s" % (out.get("first"),))
    check(state() == "drained", "the new decode@0 is %s" % state())
    check(not nd.streams, "the drained new rank got a stream")
    rc, _ = sc.ctl("undrain", "decode@0")
    check(rc == 0, "undrain")
    res = collect_with_psum(cl, {i: (p, 5)}, timeout=30)
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, 5, n),
          "the stream across the restart: %s, %d tokens" % (res[i]["final"],
                                                             len(res[i]["tokens"])))
    # another rank takes the drained rank's place (group 0, rank 0)
    i = submit(cl, p, 6, n)
    streaming()
    t = threading.Thread(target=drain, args=("gone",))
    t.start()
    wait_draining()
    nd.dead = True
    other = FakeRank(ctx, sc.ep["rank"], "decode", 7, group=0, device=FAKE_GPU)
    other.start()
    t.join(15)
    check(not t.is_alive() and out["gone"][0] == 0 and "rank gone" in out["gone"][1] and
          "drained" not in out["gone"][1],
          "the drain of a replaced rank: %s" % (out.get("gone"),))
    res = collect_with_psum(cl, {i: (p, 6)}, timeout=30)
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, 6, n),
          "the stream across the replacement: %s" % (res[i]["final"],))
    wait_idle(sc)
    return sc, [pre, dec, nd, other]


def t_sigterm(ctx, build, tmp):
    """SIGTERM with work in flight while the ranks serve on (a restart of
    the scheduler alone): new requests get 302 (for the next scheduler), a
    stream that
    ends within the stop timeout (stop_timeout_ms = 5000) completes, and one
    that would not gets ERROR 302 "scheduler restarting" at the timeout with
    f's tokens so far (libdsv4client resumes it on the next scheduler); the
    scheduler then exits 0."""
    sc, pre, dec = setup(ctx, build, tmp, extra=["-o", "stop_timeout_ms=5000"])
    cl = Client(ctx, sc.ep["client"])
    pl, ps = [41, 42], [43, 44]
    il = submit(cl, pl, 7, 4000)        # 16 s at the fake rank's 4 ms a step
    i_s = submit(cl, ps, 8, 200)        # 0.8 s: ends before the stop timeout
    i_r = cl.next_id                    # the one sent after SIGTERM
    sent = {}

    def on_tokens(i, r):
        if i == il and not sent:
            sent["t"] = time.time()
            sc.p.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            sent["id"] = submit(cl, [45], 9, 10)
    res = cl.collect([il, i_s, i_r], timeout=30, on_tokens=on_tokens)
    waited = time.time() - sent["t"]
    check(sent["id"] == i_r, "ids")
    r = res[i_r]
    check(not r["ok"] and r["final"][0] == 3 and r["final"][1]["code"] == 302,
          "a request after SIGTERM, the ranks serving: %s" % (r["final"],))
    r = res[i_s]
    check(r["final"][0] == 5 and r["tokens"] == expected(ps, 8, 200),
          "the short stream: %s" % (r["final"],))
    r = res[il]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 302 and
          "scheduler restarting" in r["final"][1]["message"],
          "the long stream at the stop timeout: %s" % (r["final"],))
    # waited for the stop timeout (no upper bound: a loaded machine only
    # makes it later, and the 302's message says why it ended)
    check(waited >= 4.5, "failed %.1f s after SIGTERM, before the 5 s timeout" % waited)
    check(0 < len(r["tokens"]) < 4000 and r["tokens"] == expected(pl, 7, len(r["tokens"])),
          "the long stream's %d tokens are not f's" % len(r["tokens"]))
    check(sc.p.wait(timeout=5) == 0, "the scheduler did not exit 0 after the stop timeout")
    return sc, [pre, dec]


def t_sigterm_alone(ctx, build, tmp):
    """SIGTERM with a request queued and no rank left to run it (the set
    stops: its ranks left first, each with its DRAIN): ERROR 500 "no rank
    left" at once, not at the stop timeout (10 minutes here), and exit 0."""
    sc, pre, dec = setup(ctx, build, tmp, extra=["-o", "stop_timeout_ms=600000"])
    pre.do(("leave",))
    dec.do(("leave",))
    pre.join(10)
    dec.join(10)
    cl = Client(ctx, sc.ep["client"])
    i = submit(cl, [41, 42], 7, 10)
    end = time.time() + 20
    while time.time() < end and (sc.ctl("status")[1] or {}).get("n_queued") != 1:
        time.sleep(0.05)
    sc.p.send_signal(signal.SIGTERM)
    r = cl.collect([i], timeout=60, seen_ok=True)[i]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 500 and
          "no rank left" in r["final"][1]["message"],
          "a queued request at SIGTERM without ranks: %s" % (r.get("final"),))
    check(sc.p.wait(timeout=30) == 0, "the scheduler did not exit 0")
    # No rank ever registered (a scheduler restarted twice: the ranks have
    # not come back yet): not the set's stop, so the stop timeout runs and
    # the request gets 302 (the next scheduler takes it)
    sub = os.path.join(tmp, "norank")
    os.makedirs(sub)
    sc2 = Sched(build, sub, ["-o", "stop_timeout_ms=1000"])
    cl2 = Client(ctx, sc2.ep["client"])
    j = submit(cl2, [41, 42], 7, 10)
    end = time.time() + 20
    while time.time() < end and (sc2.ctl("status")[1] or {}).get("n_queued") != 1:
        time.sleep(0.05)
    sc2.p.send_signal(signal.SIGTERM)
    r = cl2.collect([j], timeout=60, seen_ok=True)[j]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 302,
          "a queued request at SIGTERM before any rank came: %s" % (r.get("final"),))
    check(sc2.p.wait(timeout=30) == 0, "the second scheduler did not exit 0")
    return sc, [pre, dec]


def t_reload(ctx, build, tmp):
    conf = os.path.join(tmp, "dsv4.conf")

    def write(text):
        with open(conf + ".new", "w") as fp:
            fp.write(text)
        os.replace(conf + ".new", conf)

    def reload(sc, marker):
        """SIGHUP, then wait for the reload's last log line (marker)."""
        with open(os.path.join(tmp, "sched.log")) as fp:
            before = fp.read().count(marker)
        sc.p.send_signal(signal.SIGHUP)
        end = time.time() + 10
        while time.time() < end:
            with open(os.path.join(tmp, "sched.log")) as fp:
                text = fp.read()
            if text.count(marker) > before:
                return text
            time.sleep(0.05)
        raise AssertionError("no %r after SIGHUP:\n%s" % (marker, text[-2000:]))

    def admit(cl, n):
        """Submit n requests; their first answers (2 accepted, else the code)."""
        ids = [submit(cl, [5, 6], 1, 4) for _ in range(n)]
        got = {}
        end = time.time() + 10
        while len(got) < n and time.time() < end:
            if cl.s.poll(100):
                fr = cl.s.recv_multipart()
                b = msgpack.unpackb(fr[3])
                got[b["id"]] = fr[2][0] if fr[2][0] != 3 else b["code"]
        return ids, [got.get(i) for i in ids]

    write("queue_max = 3\nprefill_chunk = 128\n")
    # -o overrides still win after a reload
    sc = Sched(build, tmp, ["-f", conf, "-o", "prefill_chunk=64"])
    time.sleep(0.2)
    cl = Client(ctx, sc.ep["client"])
    ids, st = admit(cl, 5)
    check(st == [2, 2, 2, 300, 300], "queue_max 3: %s" % st)
    queued = ids[:3]
    # Live keys change at once; a key bound at the start waits and says so.
    write("queue_max = 5\nmax_batch = 2\nprefill_chunk = 256\nkey_dir = %s\n"
          "checkpoint = %s/other-model\n" % (tmp, tmp))
    log = reload(sc, "reload: done")
    check("reload: queue_max 3 -> 5" in log and "reload: max_batch 16 -> 2" in log, log[-2000:])
    check("reload: read %s" % conf in log, "the file read not named:\n" + log[-2000:])
    check("prefill_chunk" not in log, "an -o override lost to the file:\n" + log[-2000:])
    check('key_dir "%s" takes effect at the next start' % tmp in log, log[-2000:])
    # the model's fingerprint is taken at the start: a new checkpoint waits
    # too (a reload passed over it without a word)
    check('checkpoint "%s/other-model" takes effect at the next start' % tmp in log,
          log[-2000:])
    check("2 setting(s) changed, 2 waiting for a restart" in log, log[-2000:])
    ids, st = admit(cl, 3)
    check(st == [2, 2, 300], "queue_max 5: %s" % st)
    queued += ids[:2]
    # A file that does not load changes nothing; the scheduler keeps serving.
    write("queue_max = 7\nbogus = 1\n")
    log = reload(sc, "the running settings stay")
    check('unknown key "bogus"' in log, log[-2000:])
    _, st = admit(cl, 1)
    check(st == [300], "queue_max after a failed reload: %s" % st)
    check(sc.p.poll() is None, "the scheduler exited")
    # The same through the admin socket: dsv4ctl reload answers with the outcome.
    rc, res = sc.ctl("reload")
    check(rc == 1 and res["code"] == 500 and 'unknown key "bogus"' in res["message"] and
          "running settings stay" in res["message"], "dsv4ctl reload, bad file: %s" % res)
    # max_batch 2 holds for the decode group that registers now.
    write("queue_max = 64\nmax_batch = 2\n")
    rc, res = sc.ctl("reload")
    check(rc == 0 and res == {"code": 200, "message": "1 setting(s) changed, 0 waiting for a "
                              "restart (the log says which)"}, "dsv4ctl reload: %s" % res)
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0)
    dec = FakeRank(ctx, sc.ep["rank"], "decode", 0, capacity=16)
    pre.start()
    dec.start()
    res = cl.collect(queued, timeout=30, seen_ok=True)
    check(all(res[i]["final"][0] == 5 and res[i]["tokens"] == expected([5, 6], 1, 4)
              for i in queued), res)
    more = {}
    for k, p in enumerate(prompts(12)):
        more[submit(cl, p, k, 6)] = (p, k)
    res = collect_with_psum(cl, more)
    for i, (p, seed) in more.items():
        check(res[i]["tokens"] == expected(p, seed, 6), "request %d: %s" % (i, res[i]))
    check(dec.max_streams == 2, "max_batch 2 after the reload: %d streams" % dec.max_streams)
    # Raised again while the group serves: it takes more streams.
    write("max_batch = 4\n")
    reload(sc, "reload: done")
    dec.max_streams = 0
    more = {}
    for k, p in enumerate(prompts(20)):
        more[submit(cl, p, k, 6)] = (p, k)
    res = collect_with_psum(cl, more)
    check(all(res[i]["tokens"] == expected(p, s, 6) for i, (p, s) in more.items()), res)
    check(dec.max_streams == 4, "max_batch 4 after the reload: %d streams" % dec.max_streams)
    wait_idle(sc)
    return sc, [pre, dec]


def t_malformed(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp)
    junk = [[b"x"], [b"", b"DSV4C1"], [b"", b"DSV4C1", b"\x01", b"\xc1"],
            [b"", b"DSV4C1", b"\x63", msgpack.packb({})],
            [b"", b"DSV4C1", b"\x01", msgpack.packb({"id": 1, "tokens": "no"})],
            [b"", b"DSV4R1", b"\x01", msgpack.packb({"role": "decode"})],
            [b"", b"DSV4A1", b"\x09", msgpack.packb({"target": 5})],
            [b"", b"DSV4C1", b"\x01", msgpack.packb({"id": 2, "tokens": [1],
                                                      "prompt": "x"})],
            [b"", b"DSV4C1", b"\x01", msgpack.packb({"id": 3, "tokens": [VOCAB + 5]})],
            [b"", b"DSV4C1", b"\x05", msgpack.packb({"id": 3})],
            [b"", b"DSV4C2", b"\x01", msgpack.packb({"id": 4, "tokens": [1]})]]
    codes, texts = {}, []
    for name in ("client", "rank", "ctl"):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(sc.ep[name])
        for j in junk:
            s.send_multipart(j)
        time.sleep(0.2)
        while s.poll(50):
            fr = s.recv_multipart()
            if len(fr) >= 4 and fr[1] == CLI and fr[2][0] == 3:
                b = msgpack.unpackb(fr[3])
                codes.setdefault(name, []).append(b["code"])
                if name == "client":
                    texts.append(b.get("message", ""))
        s.close(0)
    cc = codes.get("client", [])
    check(cc.count(401) == 2 and cc.count(400) >= 5 and set(cc) == {400, 401}, codes)
    # another version's client (DSV4C2) is told which version this one speaks
    check(any(t.startswith("unknown protocol signature") and "speaks DSV4C1" in t
              for t in texts), texts)
    # A registered rank that sends garbage is disconnected and re-registers.
    check(sc.p.poll() is None, "scheduler died")
    time.sleep(0.5)
    cl = Client(ctx, sc.ep["client"])
    p = [9, 9, 9]
    i = submit(cl, p, 3, 5)
    res = collect_with_psum(cl, {i: (p, 3)})
    check(res[i]["tokens"] == expected(p, 3, 5), res)
    rc, st = sc.ctl("status")
    check(rc == 0 and st["n_ranks_ready"] == 2, st)
    return sc, [pre, dec]


def t_busy(ctx, build, tmp):
    """A burst of large prompt texts (tokenized on the scheduler's thread)
    takes far longer than the ranks' liveness interval (300 ms here): no
    live rank may be declared dead for it, and every prompt gets its answer."""
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    big = ("hello world " * 100000)[:1 << 20]
    t0 = time.time()
    ids = [cl.generate(prompt=big, max_tokens=2) for _ in range(24)]
    res = cl.collect(ids, timeout=120)
    spent = time.time() - t0
    check(all(res[i].get("final") for i in ids), "unanswered: %s" %
          [i for i in ids if not res[i].get("final")])
    check(not pre.disconnects and not dec.disconnects,
          "ranks disconnected by a busy scheduler: %s %s" % (pre.disconnects, dec.disconnects))
    log = open(os.path.join(tmp, "sched.log")).read()
    check(" lost" not in log, [l for l in log.splitlines() if " lost" in l][:3])
    print("busy: 24 prompts of 1 MiB answered in %.1f s" % spent)
    return sc, [pre, dec]


def t_refusal_full(ctx, build, tmp):
    """A GENERATE refused (300, the queue full) while its client's pipe is
    full (16 streams it does not read) is answered once the client reads:
    the refusal waits for the socket as output does (it used to be dropped,
    leaving that id without any answer)."""
    sc = Sched(build, tmp, ["-o", "max_batch=16", "-o", "queue_max=2"])
    time.sleep(0.2)
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0, capacity=2, max_ctx=200000)
    dec = FakeRank(ctx, sc.ep["rank"], "decode", 0, capacity=16, max_ctx=200000)
    pre.start()
    dec.start()
    wait_ranks(sc, 2)
    cl = Client(ctx, sc.ep["client"])
    cl.s.close(0)
    cl.s = ctx.socket(zmq.DEALER)
    cl.s.setsockopt(zmq.RCVHWM, 1)
    cl.s.setsockopt(zmq.RCVBUF, 4096)
    cl.s.setsockopt(zmq.LINGER, 0)
    cl.s.connect(sc.ep["client"])
    time.sleep(0.2)
    ids = []
    for k in range(16):
        ids.append(submit(cl, [5, 6, 7], k, 100000))
        time.sleep(0.05)
    time.sleep(3.0)   # the streams run, nothing is read: the pipe to the client fills
    q = []
    for k in range(2):
        q.append(submit(cl, [5, 6, 7], 100 + k, 5))
        time.sleep(0.1)
    time.sleep(0.3)
    extra = submit(cl, [5, 6, 7], 200, 5)   # the queue is full: 300
    time.sleep(0.5)
    rc, st = sc.ctl("status")
    check(rc == 0 and st["n_rejected"] == 1, "the third one not refused: %s" % st)
    for i in ids:
        cl.cancel(i)
    finals = {}
    end = time.time() + 60
    while time.time() < end and len(finals) < len(ids) + len(q) + 1:
        if not cl.s.poll(200):
            continue
        fr = cl.s.recv_multipart()
        b = msgpack.unpackb(fr[3])
        if fr[2][0] in (3, 5):
            finals[b["id"]] = (fr[2][0], b.get("code"))
    check(finals.get(extra) == (3, 300), "the refused id's answer: %s" % (finals.get(extra),))
    check(len(finals) == len(ids) + len(q) + 1, "%d of %d answered" %
          (len(finals), len(ids) + len(q) + 1))
    return sc, [pre, dec]


def t_listing(ctx, build, tmp):
    """dsv4ctl requests lists every request, past the admin socket's default
    high-water mark of 1,000 messages (3,000 queued: no rank registered)."""
    sc = Sched(build, tmp, ["-o", "queue_max=4000"])
    time.sleep(0.2)
    cl = Client(ctx, sc.ep["client"])
    n = 3000
    for k in range(n):
        submit(cl, [5, 6], k, 2)
    end = time.time() + 30
    while time.time() < end:
        rc, st = sc.ctl("status")
        if rc == 0 and st["n_queued"] == n:
            break
        time.sleep(0.2)
    rc, reqs = sc.ctl("requests")
    check(rc == 0 and reqs is not None and len(reqs) == n,
          "dsv4ctl --json requests: rc %d, %s items of %d" % (rc, len(reqs or []), n))
    rc, text = sc.ctl_text("requests")
    check(rc == 0 and len([l for l in text.splitlines() if "queued" in l]) == n,
          "dsv4ctl requests (table): rc %d" % rc)
    return sc, []


def setup_group(ctx, build, tmp, fail_decode=0):
    """The scheduler, a prefill rank and a decode group of two (decode@0,
    decode@1; decode@1 fails its first fail_decode imports), all ready."""
    sc = Sched(build, tmp, ["-o", "max_batch=16"])
    time.sleep(0.2)
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0, capacity=2)
    d0 = FakeRank(ctx, sc.ep["rank"], "decode", 0, group=0, group_rank=0, group_size=2)
    d1 = FakeRank(ctx, sc.ep["rank"], "decode", 1, group=0, group_rank=1, group_size=2)
    d1.fail_decode = fail_decode
    for r in (pre, d0, d1):
        r.start()
    wait_ranks(sc, 3)
    return sc, pre, d0, d1


def t_prefill_nomem(ctx, build, tmp):
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    # 1. one ERROR 503: the re-run completes, the client sees only its tokens
    p = prompts(1)[0]
    pre.fail_prefill = 1
    i = submit(cl, p, 7, 10)
    res = cl.collect([i])
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, 7, 10),
          "after one 503: %s %s" % (res[i]["final"], res[i]["tokens"]))
    wait_idle(sc)
    rc, st = sc.ctl("status")
    check(st["reruns"] == 1 and st["n_failed"] == 0 and st["n_done"] == 1, st)
    # 2. 503 on the first run and on all 4 re-runs: ERROR 503, the reason named
    pre.fail_prefill = 5
    i = submit(cl, p, 8, 10)
    res = cl.collect([i])
    fin = res[i]["final"]
    check(fin[0] == 3 and fin[1]["code"] == 503 and
          "gave up after 4 re-runs (prefill rank out of memory)" in fin[1]["message"] and
          res[i]["tokens"] == [], "after five 503s: %s %s" % (fin, res[i]["tokens"]))
    check(pre.fail_prefill == 0 and len([q for c, q in pre.log if c == 15]) == 6,
          "ERRORs sent: %s" % pre.log)
    wait_idle(sc)
    rc, st = sc.ctl("status")
    check(st["reruns"] == 5 and st["n_failed"] == 1 and st["rank_deaths"] == 0, st)
    # 3. a second prefill group: the re-run goes there, not back to prefill@0
    # (which, the least loaded with the lower id, takes the first run)
    pre1 = FakeRank(ctx, sc.ep["rank"], "prefill", 1, capacity=2)
    pre1.start()
    wait_ranks(sc, 3)
    n0 = len(pre.log)
    pre.fail_prefill = 1
    i = submit(cl, p, 9, 10)
    res = cl.collect([i])
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, 9, 10),
          "with a second prefill group: %s %s" % (res[i]["final"], res[i]["tokens"]))
    got0 = [q for c, q in pre.log[n0:] if c == 5]
    got1 = [q for c, q in pre1.log if c == 5]
    check(len(got0) == 1 and len(got1) == 1 and got1[0] != got0[0],
          "PREFILLs: prefill@0 %s, prefill@1 %s" % (got0, got1))
    wait_idle(sc)
    return sc, [pre, pre1, dec]


def t_group_error(ctx, build, tmp):
    sc, pre, d0, d1 = setup_group(ctx, build, tmp, fail_decode=1)
    cl = Client(ctx, sc.ep["client"])
    ids = {}
    for k, p in enumerate(prompts(6)):
        ids[submit(cl, p, k, 20)] = (p, k)
    res = collect_with_psum(cl, ids)
    for i, (p, k) in ids.items():
        check(res[i]["final"][0] == 5, "request %d: %s" % (i, res[i]["final"]))
        check(res[i]["tokens"] == expected(p, k, 20), "request %d: tokens %s" %
              (i, res[i]["tokens"]))
    failed = [q for c, q in d1.log if c == 15]
    check(len(failed) == 1, "decode@1 failed %s" % failed)
    bad = failed[0]
    check((11, bad) in d0.log, "decode@0 got no ABORT of req %d: %s" % (bad, d0.log))
    check(d0.log.index((11, bad)) > d0.log.index((7, bad)), "ABORT before DECODE")
    check(not [q for c, q in d0.log if c == 15], "decode@0 failed: %s" % d0.log)
    n7 = [q for c, q in d0.log if c == 7]
    check(len(n7) == len(ids) + 1 and len(set(n7)) == len(n7),
          "the re-run did not get a new id: DECODEs %s" % n7)
    wait_idle(sc)
    time.sleep(0.2)
    check(not d0.streams and not d1.streams, "streams left: %s %s" % (d0.streams, d1.streams))
    rc, st = sc.ctl("status")
    check(st["reruns"] == 1 and st["n_failed"] == 0, st)
    return sc, [pre, d0, d1]


def setup_prefill_group(ctx, build, tmp):
    """The scheduler, a prefill group of two (prefill@0, prefill@1) and a
    decode rank, all ready."""
    sc = Sched(build, tmp, ["-o", "max_batch=16"])
    time.sleep(0.2)
    p0 = FakeRank(ctx, sc.ep["rank"], "prefill", 0, group=0, group_rank=0, group_size=2)
    p1 = FakeRank(ctx, sc.ep["rank"], "prefill", 1, group=0, group_rank=1, group_size=2)
    dec = FakeRank(ctx, sc.ep["rank"], "decode", 0)
    for r in (p0, p1, dec):
        r.start()
    wait_ranks(sc, 3)
    return sc, p0, p1, dec


def t_prefill_group_error(ctx, build, tmp):
    """A prefill group of two: rank 1 answers PREFILL with ERROR 500 after
    rank 0 exported its part.  The client gets the ERROR, and rank 0 is told
    to free its export (ABORT): the old scheduler dropped the group's hold
    with the error, so rank 0 kept its part until its own timeout."""
    sc, p0, p1, dec = setup_prefill_group(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    p1.prefill_error = (500, "export failed (test)", 0.05)
    i = submit(cl, [10, 20, 30], 1, 8)
    r = cl.collect([i])[i]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 500, "client: %s" % (r["final"],))
    wait_for_cond(lambda: not p0.exported, "prefill@0 freeing its export")
    check(any(c == 11 for c, _ in p0.log), "prefill@0 got no ABORT: %s" % p0.log)
    wait_idle(sc)
    return sc, [p0, p1, dec]


def t_prefill_lost_handoff(ctx, build, tmp):
    """A prefill group of two loses rank 1 while the decode rank imports
    the request's state (DECODE sent, KV_RELEASE not yet).  The request
    finishes from rank 0's part, and rank 0 is told to free it once the
    import is done: the old scheduler forgot the group's hold when the
    rank died, so rank 0 kept its export until its own kv_timeout_ms."""
    sc, p0, p1, dec = setup_prefill_group(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    dec.hold_release = True
    p = [10, 20, 30]
    i = submit(cl, p, 1, 8)
    wait_for_cond(lambda: any(c == 7 for c, _ in dec.log), "the DECODE")
    req = next(q for c, q in dec.log if c == 7)
    check(req in p0.exported, "prefill@0 holds no export of req %d" % req)
    p1.dead = True                      # like kill -9: stops answering
    wait_for_cond(lambda: any(r["name"] == "prefill@1" and r["state"] == "dead"
                              for r in sc.ctl("ranks")[1] or []), "prefill@1 seen dead")
    check(req in p0.exported, "prefill@0 freed its export before the import ended")
    dec.hold_release = False            # the import ends: KV_RELEASE
    wait_for_cond(lambda: req not in p0.exported, "prefill@0 told to free its export")
    check(req in p0.released, "prefill@0 freed it otherwise: %s" % p0.log)
    r = cl.collect([i])[i]
    check(r["final"][0] == 5 and r["tokens"] == expected(p, 1, 8),
          "client: %s %s" % (r["final"], r["tokens"]))
    wait_idle(sc)
    rc, st = sc.ctl("status")
    check(st["reruns"] == 0 and st["n_failed"] == 0 and st["rank_deaths"] == 1, st)
    return sc, [p0, p1, dec]


def t_closing_prefill_lost(ctx, build, tmp):
    """As prefill_lost_handoff, but the request is cancelled first (the
    decode rank holds its KV_RELEASE and ABORT_DONE back): once the decode
    rank lets go, the surviving prefill@0 is told to free its export (the
    old scheduler dropped the group's hold with the dead rank, and prefill@0
    kept its part until its own kv_timeout_ms)."""
    sc, p0, p1, dec = setup_prefill_group(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    dec.hold_release = dec.hold_abort = True
    i = submit(cl, [10, 20, 30], 1, 8)
    wait_for_cond(lambda: any(c == 7 for c, _ in dec.log), "the DECODE")
    req = next(q for c, q in dec.log if c == 7)
    cl.cancel(i)
    r = cl.collect([i], timeout=10)[i]
    check(r["final"][0] == 5 and r["final"][1]["finish"] == "cancelled", "client: %s" % (r,))
    p1.dead = True
    wait_for_cond(lambda: any(r["name"] == "prefill@1" and r["state"] == "dead"
                              for r in sc.ctl("ranks")[1] or []), "prefill@1 seen dead")
    check(req in p0.exported, "prefill@0 freed its export before the decode rank let go")
    dec.hold_release = dec.hold_abort = False
    wait_for_cond(lambda: req not in p0.exported, "prefill@0 told to free its export")
    check(req in p0.released, "prefill@0 freed it otherwise: %s" % p0.log)
    wait_idle(sc)
    return sc, [p0, p1, dec]


def t_pairing(ctx, build, tmp):
    """Two hosts, shm only (no ucx): decode@0 and prefill@1 on host B,
    decode@1 and prefill@0 on host A.  The least loaded groups of each
    role, decode@0 and prefill@0, cannot hand over; the scheduler pairs
    prefill@0 with decode@1 instead (the old one waited for that pair for
    good)."""
    sc = Sched(build, tmp, ["-o", "max_batch=16"])
    time.sleep(0.2)
    ranks = [FakeRank(ctx, sc.ep["rank"], "decode", 0, host="B"),
             FakeRank(ctx, sc.ep["rank"], "decode", 1, host="A"),
             FakeRank(ctx, sc.ep["rank"], "prefill", 0, host="A"),
             FakeRank(ctx, sc.ep["rank"], "prefill", 1, host="B")]
    for r in ranks:
        r.start()
    wait_ranks(sc, 4)
    cl = Client(ctx, sc.ep["client"])
    p, seed = [10, 20, 30], 4
    i = submit(cl, p, seed, 8)
    res = collect_with_psum(cl, {i: (p, seed)}, timeout=15)
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, seed, 8),
          "two hosts: %s" % (res[i]["final"],))
    wait_idle(sc)
    return sc, ranks


def wait_for_cond(pred, what, timeout=10):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("gave up waiting for " + what)


def t_ready_refused(ctx, build, tmp):
    """READYs the scheduler refuses (misconfigured ranks): a group_size that
    differs from its group's, a group larger than 64 ranks, another model
    than the registered ranks' (READY `model`), a build of another rank ABI
    (READY `abi`; the registered ranks send none: an older build).  DISCONNECT
    and the journal give the reason with the figures, nothing registers, the
    group's rank stays, and the group serves once a right READY comes."""
    sc = Sched(build, tmp, ["-o", "max_batch=16"])
    time.sleep(0.2)
    model = "0123456789abcdef"
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0, capacity=2, model=model)
    d0 = FakeRank(ctx, sc.ep["rank"], "decode", 0, group=0, group_rank=0, group_size=2,
                  model=model)
    for r in (pre, d0):
        r.start()
    wait_ranks(sc, 1)
    check(d0.welcomed.wait(20), "decode@0 not welcomed")
    bad = [FakeRank(ctx, sc.ep["rank"], "decode", 1, group=0, group_rank=1, group_size=3),
           FakeRank(ctx, sc.ep["rank"], "decode", 2, group=1, group_rank=0, group_size=65),
           FakeRank(ctx, sc.ep["rank"], "decode", 3, group=2, model="fedcba9876543210"),
           FakeRank(ctx, sc.ep["rank"], "prefill", 4, group=4, group_rank=0, group_size=17),
           FakeRank(ctx, sc.ep["rank"], "decode", 5, group=5, model=model, abi=1)]
    for r in bad:
        r.rejoin = False
        r.start()
    for r in bad:
        r.join(20)
        check(not r.is_alive(), "%s@%d got no DISCONNECT" % (r.role, r.index))
    why = ["group_size 3 differs from the 2 of group decode/0's other ranks",
           "group_size 65 with group_rank 0: a group has at most 64 ranks, numbered from 0",
           "model fedcba9876543210 differs from the model 0123456789abcdef of prefill@0, "
           "registered: every rank must run the same model (to change it, restart the whole "
           "set)",
           # a handoff carries at most 16 parts of the decode state
           "group_size 17: a prefill group has at most 16 ranks",
           "abi 1 differs from the abi 0 of prefill@0, registered (an older build): ranks of "
           "two builds would hang in a group's collectives or hand over decode state the other "
           "cannot read; every rank must run a build of the same abi (to change it, restart "
           "the whole set)"]
    for r, w in zip(bad, why):
        check(r.disconnects == [w] and not r.welcomed.is_set(),
              "%s@%d: DISCONNECT %s" % (r.role, r.index, r.disconnects))
    with open(os.path.join(tmp, "sched.log")) as fp:
        text = fp.read()
    for line in ("READY of decode@1 (group 0, rank 1/3, pid %d) refused: " + why[0],
                 "READY of decode@2 (group 1, rank 0/65, pid %d) refused: " + why[1],
                 "READY of decode@3 (group 2, rank 0/1, pid %d) refused: " + why[2],
                 "READY of decode@5 (group 5, rank 0/1, pid %d) refused: " + why[4]):
        check(line % os.getpid() in text, "not in the journal: " + line % os.getpid())
    rc, ranks = sc.ctl("ranks")
    check(rc == 0 and sorted(r["name"] for r in ranks) == ["decode@0", "prefill@0"],
          "ranks: %s" % ranks)
    # each rank's model in --json ranks; the one every rank must run (here the
    # registered ranks', the scheduler having no checkpoint) in status
    check(all(r.get("model") == model for r in ranks), "ranks' models: %s" % ranks)
    rc, st = sc.ctl("status")
    check(rc == 0 and st.get("model") == model, "status model: %s" % st)
    rc, text = sc.ctl_text("status")
    check(rc == 0 and re.search(r"^model +%s$" % model, text, re.M) is not None,
          "dsv4ctl status: the model line:\n" + text)
    d1 = FakeRank(ctx, sc.ep["rank"], "decode", 1, group=0, group_rank=1, group_size=2,
                  model=model)
    d1.start()
    wait_ranks(sc, 3)
    cl = Client(ctx, sc.ep["client"])
    p = prompts(1)[0]
    i = submit(cl, p, 3, 12)
    res = cl.collect([i])
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, 3, 12),
          "with the right decode@1: %s %s" % (res[i]["final"], res[i]["tokens"]))
    wait_idle(sc)
    # A drained rank restarted with a wrong group_size: refused, and the
    # drain of its name holds for the right process after it (before, the
    # refused READY had already replaced the old registration, drain flag
    # and all).
    rc, _ = sc.ctl("drain", "decode@1", "--timeout", "10")
    check(rc == 0 and rank_row(sc, "decode@1")["state"] == "drained", "decode@1 not drained")
    d1.dead = True
    d1.join(5)                      # its socket closed, as after kill -9
    w3 = FakeRank(ctx, sc.ep["rank"], "decode", 1, group=0, group_rank=1, group_size=3,
                  model=model, pid=2001)
    w3.rejoin = False
    w3.start()
    w3.join(20)
    check(not w3.is_alive() and w3.disconnects == [why[0]] and not w3.welcomed.is_set(),
          "the restarted decode@1 of group_size 3: DISCONNECT %s" % (w3.disconnects,))
    r1 = FakeRank(ctx, sc.ep["rank"], "decode", 1, group=0, group_rank=1, group_size=2,
                  model=model, pid=2002)
    r1.start()
    check(r1.welcomed.wait(20), "the right decode@1 not welcomed")
    check(rank_row(sc, "decode@1")["state"] == "drained",
          "decode@1 after the refused READY: %s" % rank_row(sc, "decode@1")["state"])
    # The group's only rank restarting into a group of another size is
    # taken (nothing of the group is left to disagree): prefill@0 of a
    # group of 1 comes back as rank 0 of 2.
    pre.dead = True
    pre.join(5)
    p2 = FakeRank(ctx, sc.ep["rank"], "prefill", 0, capacity=2, group=0, group_rank=0,
                  group_size=2, model=model, pid=2003)
    p2.start()
    check(p2.welcomed.wait(20), "prefill@0 restarted into a group of 2 not welcomed")
    return sc, [pre, d0, d1, w3, r1, p2]


def t_dup_name(ctx, build, tmp):
    """Two processes of one rank name, or of one group seat: the second is
    refused while the first lives (before, each replaced the other at every
    heartbeat, dropping the group's requests); once the first is gone (its
    socket closed, as after kill -9) a new one replaces it at once."""
    # heartbeats every 5 s, liveness 500 s: only the probe of its link finds
    # the first one gone within 2 s
    sc, pre, a = setup(ctx, build, tmp, ["-o", "heartbeat_ms=5000", "-o", "liveness=100"])
    cl = Client(ctx, sc.ep["client"])
    p = prompts(1)[0]
    i = submit(cl, p, 4, 300)
    end = time.time() + 10
    while not a.streams and time.time() < end:
        time.sleep(0.01)
    check(a.streams, "decode@0 got no stream")
    held = "rank decode@0 is registered already (host test, pid %d) and alive: a rank's " \
           "name must be unique" % a.pid
    bad = [(FakeRank(ctx, sc.ep["rank"], "decode", 0, pid=1002), held),
           (FakeRank(ctx, sc.ep["rank"], "decode", 0, host="other", pid=1003), held),
           (FakeRank(ctx, sc.ep["rank"], "decode", 5, group=0, pid=1005),
            "group decode/0's rank 0 is held by decode@0 (host test, pid %d), alive" % a.pid)]
    for r, _ in bad:
        r.rejoin = False
        r.start()
    for r, why in bad:
        r.join(20)
        check(not r.is_alive() and r.disconnects == [why] and not r.welcomed.is_set(),
              "decode@%d (pid %d): DISCONNECT %s" % (r.index, r.pid, r.disconnects))
    res = collect_with_psum(cl, {i: (p, 4)}, timeout=30)
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, 4, 300),
          "the stream beside the refused READYs: %s" % (res[i]["final"],))
    rc, st = sc.ctl("status")
    check(st["rank_deaths"] == 0 and st["reruns"] == 0, st)
    # the first one gone: a new process of the name takes its place
    a.dead = True
    d = FakeRank(ctx, sc.ep["rank"], "decode", 0, pid=1004)
    d.start()
    check(d.welcomed.wait(2), "the new decode@0 was not welcomed within 2 s")
    check(rank_row(sc, "decode@0")["state"] == "ready", "decode@0 not ready")
    i = submit(cl, p, 5, 20)
    res = collect_with_psum(cl, {i: (p, 5)}, timeout=30)
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, 5, 20),
          "with the new decode@0: %s" % (res[i]["final"],))
    wait_idle(sc)
    return sc, [pre, a, d]


def rank_row(sc, name):
    rc, ranks = sc.ctl("ranks")
    check(rc == 0, "dsv4ctl ranks")
    return next(r for r in ranks if r["name"] == name)


def wait_marker(sc, name, active):
    """Until the scheduler has handled rank `name`'s HEARTBEAT {active}
    (so every message that rank sent before it too)."""
    end = time.time() + 20
    while time.time() < end:
        if rank_row(sc, name).get("rank_active") == active:
            return
        time.sleep(0.02)
    raise AssertionError("%s: HEARTBEAT active=%d never seen" % (name, active))


def t_group_broken(ctx, build, tmp):
    sc, pre, d0, d1 = setup_group(ctx, build, tmp)
    check(len(d0.comm_asks) == 1, "asks %s" % d0.comm_asks)
    E = d0.comm_asks[0]
    cl = Client(ctx, sc.ep["client"])
    ids = {}
    for k, p in enumerate(prompts(8)):
        ids[submit(cl, p, k, 40)] = (p, k)
    state = {"broken": False}

    def on_tokens(i, r):
        if state["broken"] or len(r["tokens"]) < 8:
            return
        state["broken"] = True
        # The communicator of epoch E breaks with both ranks alive: each drops
        # its streams and reports E.  decode@1 then reports E + 1, the epoch
        # being re-formed, whose COMM is not out (rank 0 holds the ask): it
        # must be ignored too.
        d0.hold_comm = True
        d1.active_override = 4242
        d1.do(("broken", E), ("broken", E + 1), ("hb",))
        d0.do(("broken", E))
        wait_marker(sc, "decode@1", 4242)
        for n in ("decode@0", "decode@1"):
            row = rank_row(sc, n)
            check(row["state"] == "joining", "%s while re-forming: %s" % (n, row))
        d0.hold_comm = False
        d1.active_override = None
        d0.do(("hb",))
    res = collect_with_psum(cl, ids, timeout=60, on_tokens=on_tokens)
    check(state["broken"], "never broken")
    for i, (p, k) in ids.items():
        check(res[i]["final"][0] == 5, "request %d: %s" % (i, res[i]["final"]))
        check(res[i]["tokens"] == expected(p, k, 40),
              "request %d: %d tokens, duplicates or loss" % (i, len(res[i]["tokens"])))
    check(d0.comm_asks == [E, E + 1], "one re-form expected, asks %s" % d0.comm_asks)
    rc, st = sc.ctl("status")
    check(st["rank_deaths"] == 0 and st["reruns"] >= 1 and st["n_failed"] == 0, st)
    wait_idle(sc)
    # A stale report (delivered late) after the re-form changes nothing:
    # rank 0 now holds any ask, so a wrong re-form would leave the group
    # without a communicator and the next request would never finish.
    d0.hold_comm = True
    d1.active_override = 4343
    d1.do(("late", E), ("hb",))
    wait_marker(sc, "decode@1", 4343)
    d1.active_override = None
    p = [11, 12, 13]
    i = submit(cl, p, 77, 10)
    res = collect_with_psum(cl, {i: (p, 77)}, timeout=30)
    check(res[i]["final"][0] == 5 and res[i]["tokens"] == expected(p, 77, 10), res[i])
    check(d0.comm_asks == [E, E + 1], "stale report re-formed: asks %s" % d0.comm_asks)
    rc, ranks = sc.ctl("ranks")
    check(all(r["state"] == "ready" for r in ranks), ranks)
    return sc, [pre, d0, d1]


def t_utf8(ctx, build, tmp):
    """Replies that must stay UTF-8: a rank's long error message of
    two-byte characters, cut to the client's bound, still reaches the
    client (the cut split a character: the ERROR could not be encoded,
    and the client heard nothing); a resume_text inside a character of
    the resumed tokens' text is refused (every later piece would have
    started mid-character)."""
    sc, pre, dec = setup(ctx, build, tmp)
    cl = Client(ctx, sc.ep["client"])
    pre.prefill_error = (500, "x" + "\u00e9" * 300)
    i = cl.generate(tokens=[10, 20, 30], max_tokens=4, temperature=0)
    r = cl.collect([i])[i]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 500 and
          "\u00e9" in r["final"][1]["message"], "a long UTF-8 error: %s" % (r["final"],))
    # "\u00e9" is ids 195 169 in the tests' tokenizer: 2 bytes, 1 is inside
    j = cl.generate(tokens=[10, 20, 30], max_tokens=8, temperature=0, seed=3,
                    resume=[195, 169], resume_text=1)
    r = cl.collect([j])[j]
    check(r["final"][0] == 3 and r["final"][1]["code"] == 401 and
          "inside a character" in r["final"][1]["message"], "resume_text mid-character: %s" %
          (r["final"],))
    wait_idle(sc)
    return sc, [pre, dec]


def t_chunks(ctx, build, tmp):
    """A non-streamed output of more than one TOKENS' 4,096 ids: each message
    carries its own tokens' text (the first carried it all and the second
    none, so a client resuming from the first was refused, and the EOS text
    and id arrived in different messages)."""
    sc = Sched(build, tmp, ["-o", "max_batch=16"])
    time.sleep(0.2)
    pre = FakeRank(ctx, sc.ep["rank"], "prefill", 0, capacity=2, max_ctx=200000)
    dec = FakeRank(ctx, sc.ep["rank"], "decode", 0, capacity=16, max_ctx=200000, tick=0.0002)
    pre.start()
    dec.start()
    wait_ranks(sc, 2)
    cl = Client(ctx, sc.ep["client"])
    p, n = [10, 20, 30], 5000
    msgs = {}

    def on_tokens(i, r):
        msgs.setdefault(i, []).append((len(r["tokens"]), len(r["text"])))
    i1 = cl.generate(tokens=p, seed=3, max_tokens=n, temperature=0, stream=False)
    i2 = cl.generate(tokens=p, seed=3, max_tokens=4096, temperature=0, stream=False)
    res = cl.collect([i1, i2], timeout=120, on_tokens=on_tokens)
    check(res[i1]["tokens"] == expected(p, 3, n) and
          res[i2]["tokens"] == expected(p, 3, 4096), "the outputs differ")
    m = msgs[i1]
    check(len(m) == 2 and m[0][0] == 4096 and m[1][0] == n, "messages: %s" % m)
    first, whole = m[0][1], m[1][1]
    # the text of the first 4,096 tokens: a request of just those has it
    # (and, at its end, a U+FFFD for a character they leave unfinished)
    want = len(res[i2]["text"])
    check(want - 1 <= first <= want and whole > first,
          "the first TOKENS' text is %d characters, that of 4096 tokens %d, the whole %d" %
          (first, want, whole))
    wait_idle(sc)
    return sc, [pre, dec]


def t_wrong_endpoint(ctx, build, tmp):
    """A client given the admin or rank endpoint, dsv4ctl given the client or
    rank endpoint: each says which endpoint it reached and stops (the client
    connected on the admin endpoint's RESULT 400 and waited for ever; the
    rank endpoint answered nobody; dsv4ctl waited out 5 s as "no answer")."""
    sc = Sched(build, tmp)
    time.sleep(0.2)
    gen = os.path.join(build, "tools/generate/dsv4-generate")
    for name, sig in (("ctl", "DSV4A1"), ("rank", "DSV4R1")):
        # no timeout option: the run's own timeout is the test's bound
        r = subprocess.run([gen, "-e", sc.ep[name], "--ids", "1 2 3"],
                           capture_output=True, text=True, timeout=30)
        check(r.returncode == 1 and "answers in %s" % sig in r.stderr and
              "not a client endpoint" in r.stderr,
              "dsv4-generate on the %s endpoint: exit %d: %s" % (name, r.returncode, r.stderr))
    for name, sig in (("client", "DSV4C1"), ("rank", "DSV4R1")):
        r = subprocess.run([os.path.join(build, "tools/dsv4ctl/dsv4ctl"), "--admin",
                            sc.ep[name], "status"], capture_output=True, text=True, timeout=30)
        check(r.returncode == 2 and "answers in %s" % sig in r.stderr and
              "not the scheduler's admin endpoint" in r.stderr,
              "dsv4ctl on the %s endpoint: exit %d: %s" % (name, r.returncode, r.stderr))
    check(sc.p.poll() is None, "scheduler died")
    return sc, []


TESTS = {"basic": t_basic, "batch": t_batch, "stop": t_stop, "cancel": t_cancel,
         "ctl_cancel": t_ctl_cancel,
         "death": t_death, "overload": t_overload, "reload": t_reload, "resume": t_resume,
         "refuse": t_refuse, "drain_restart": t_drain_restart, "drain_hol": t_drain_hol,
         "closing_prefill_lost": t_closing_prefill_lost,
         "sigterm": t_sigterm,
         "sigterm_alone": t_sigterm_alone,
         "ready_refused": t_ready_refused, "dup_name": t_dup_name,
         "malformed": t_malformed, "busy": t_busy, "listing": t_listing, "refusal_full": t_refusal_full, "prefill_nomem": t_prefill_nomem,
         "group_error": t_group_error, "group_broken": t_group_broken, "utf8": t_utf8,
         "prefill_group_error": t_prefill_group_error, "pairing": t_pairing,
         "prefill_lost_handoff": t_prefill_lost_handoff,
         "death_ctx": t_death_ctx, "chunks": t_chunks,
         "wrong_endpoint": t_wrong_endpoint}
TOKENIZER = None


def main():
    global TOKENIZER
    build, src = sys.argv[1], sys.argv[2]
    names = sys.argv[3:] or list(TESTS)
    TOKENIZER = os.path.join(src, "tests/tokenizer/tiny_tokenizer.json")
    failed = 0
    for name in names:
        ctx = zmq.Context()
        with tempfile.TemporaryDirectory(prefix="sched-") as tmp:
            PSUM.override.clear()
            sc, ranks = None, []
            try:
                sc, ranks = TESTS[name](ctx, build, tmp)
                rc = sc.stop()
                check(rc == 0, "scheduler exit status %d" % rc)
                print("ok %s" % name)
            except Exception as e:  # noqa: BLE001 - report and go on
                failed += 1
                print("FAIL %s: %s" % (name, e))
                traceback.print_exc(file=sys.stdout)
                for sc in ALL_SCHEDS:
                    sc.p.kill()
                    sc.p.wait()
                    sc.log.close()
                    with open(os.path.join(tmp, "sched.log")) as fp:
                        sys.stdout.write(fp.read()[-4000:])
            ALL_SCHEDS.clear()
            for r in ALL_RANKS:
                r.stop = True
            for r in ALL_RANKS:
                r.join(2)
            ALL_RANKS.clear()
        ctx.destroy(0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
