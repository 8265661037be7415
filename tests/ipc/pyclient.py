#!/usr/bin/env python3
"""pyclient.py - a dsv4 client in Python (pyzmq + msgpack), written from
docs/protocol.md alone (client sub-protocol DSV4C1).

As a library:
    c = Client("ipc:///run/dsv4/client.sock")
    rid = c.generate(prompt="Hello", max_tokens=16)
    for ev in c.events(rid): ...          # ("accepted"|"tokens"|"done"|"error", body)

As a program:
    pyclient.py ENDPOINT "prompt" [max_tokens]     stream text to stdout
    pyclient.py --check ENDPOINT                   self-test against the stand-in
                                                   scheduler (tests/ipc/fake_sched.c)
"""
import sys
import time

if not __debug__:   # its checks are asserts: under -O / PYTHONOPTIMIZE none would run
    sys.exit("pyclient.py: run without -O (PYTHONOPTIMIZE): its checks are asserts")

import msgpack
import zmq

SIG = b"DSV4C1"
GENERATE, OK, ERROR, TOKENS, DONE, CANCEL, HEARTBEAT = range(1, 8)


class ProtocolError(Exception):
    pass


class Client:
    def __init__(self, endpoint, server_key=None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key is not None:  # CURVE (tcp endpoints)
            pub, sec = zmq.curve_keypair()
            self.sock.curve_serverkey = server_key.encode() if isinstance(server_key, str) else server_key
            self.sock.curve_publickey = pub
            self.sock.curve_secretkey = sec
        self.sock.connect(endpoint)
        self.next_id = 0
        self.pending = {}  # id -> list of buffered events for other ids

    def close(self):
        self.sock.close()
        self.ctx.term()

    def send(self, cmd, body):
        self.sock.send_multipart([b"", SIG, bytes([cmd]), msgpack.packb(body, use_bin_type=True)])

    def recv(self, timeout_ms):
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart()
        if len(frames) < 4 or frames[0] != b"" or frames[1] != SIG or len(frames[2]) != 1:
            raise ProtocolError("bad framing: %r" % frames[:3])
        body = msgpack.unpackb(frames[3], raw=False)
        if not isinstance(body, dict):
            raise ProtocolError("body is not a map")
        return frames[2][0], body

    def ping(self, timeout_ms=5000):
        """Send HEARTBEAT; True when the server answers in time."""
        self.send(HEARTBEAT, {})
        end = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < end:
            m = self.recv(int((end - time.monotonic()) * 1000) + 1)
            if m is not None and m[0] == HEARTBEAT:
                return True
        return False

    def generate(self, prompt=None, tokens=None, **params):
        """Send GENERATE; params are the keys of docs/protocol.md 4.1."""
        self.next_id += 1
        body = {"id": self.next_id}
        if prompt is not None:
            body["prompt"] = prompt
        if tokens is not None:
            body["tokens"] = list(tokens)
        body.update(params)
        self.send(GENERATE, body)
        self.pending[self.next_id] = []
        return self.next_id

    def cancel(self, rid):
        self.send(CANCEL, {"id": rid})

    def next_event(self, timeout_ms=10000):
        """Next message from the socket as (kind, id, body); None on timeout.
        Events that events() set aside for other requests are not included."""
        m = self.recv(timeout_ms)
        if m is None:
            return None
        cmd, body = m
        kind = {OK: "accepted", TOKENS: "tokens", DONE: "done", ERROR: "error",
                HEARTBEAT: "heartbeat"}.get(cmd)
        if kind is None:
            raise ProtocolError("unexpected command %d" % cmd)
        return kind, body.get("id", 0), body

    def events(self, rid, timeout_ms=10000):
        """Yield (kind, body) of request rid until DONE or ERROR; other
        requests' events are kept for later."""
        while True:
            queue = self.pending.get(rid)
            if queue:
                kind, _, body = queue.pop(0)
            else:
                ev = self.next_event(timeout_ms)
                if ev is None:
                    raise TimeoutError("no event for request %d" % rid)
                kind, eid, body = ev
                if kind == "heartbeat":
                    continue
                if eid != rid:
                    if eid in self.pending:
                        self.pending[eid].append(ev)
                    continue
            yield kind, body
            if kind in ("done", "error"):
                del self.pending[rid]
                return


def collect(client, rid):
    out = {"accepted": False, "tokens": [], "text": "", "logprobs": [], "top": [], "chunks": 0}
    for kind, body in client.events(rid):
        if kind == "accepted":
            assert not out["accepted"] and body["req"] >= 1
            out["accepted"] = True
        elif kind == "tokens":
            assert out["accepted"]
            assert isinstance(body["text"], str)
            out["tokens"] += body["tokens"]
            out["text"] += body["text"]
            out["logprobs"] += body.get("logprobs", [])
            # most likely tokens: top_n[i] entries for token i, one after the other
            # (absent when the request asked for none)
            at, ids, lps = 0, body.get("top_ids", []), body.get("top_logprobs", [])
            for k in body.get("top_n", []):
                out["top"].append(list(zip(ids[at:at + k], lps[at:at + k])))
                at += k
            assert at == len(ids) == len(lps)
            out["chunks"] += 1
        else:
            out["final"] = kind
            out["body"] = body
    return out


def check(endpoint):
    """Drive generate / stream / cancel / errors against the stand-in
    scheduler (whose output echoes the prompt, see fake_sched.h)."""
    c = Client(endpoint)
    assert c.ping(), "server did not answer HEARTBEAT"

    # Several requests in flight, streamed, interleaved.
    a = c.generate(prompt="Hello", max_tokens=7, tag="py-a")
    b = c.generate(tokens=[3, 4], max_tokens=3, logprobs=True, temperature=0, seed=5)
    rb = collect(c, b)
    ra = collect(c, a)
    assert ra["final"] == "done" and ra["body"]["finish"] == "length", ra
    assert ra["text"] == "HelloHe", ra["text"]
    assert ra["tokens"] == [ord(ch) for ch in "HelloHe"]
    assert ra["body"]["completion_tokens"] == 7 and ra["body"]["prompt_tokens"] == 5
    assert ra["body"].get("tag") == "py-a"
    assert rb["tokens"] == [3, 4, 3] and rb["text"] == "[3][4][3]"
    assert len(rb["logprobs"]) == 3 and all(lp <= 0 for lp in rb["logprobs"])

    # Stop token ids and non-streamed output.
    s = c.generate(tokens=[1, 2, 9, 4], stop_ids=[9], stream=False)
    rs = collect(c, s)
    assert rs["body"]["finish"] == "stop" and rs["tokens"] == [1, 2, 9] and rs["chunks"] == 1

    # Cancel a long request once it streams.
    x = c.generate(prompt="long", max_tokens=1048576)
    cancelled = False
    for kind, body in c.events(x):
        if kind == "tokens" and not cancelled:
            c.cancel(x)
            cancelled = True
        if kind == "done":
            assert body["finish"] == "cancelled", body
    assert cancelled

    # Refusals: out of range, both prompt and tokens, malformed body.
    e = c.generate(prompt="x", temperature=11)
    r = collect(c, e)
    assert r["final"] == "error" and r["body"]["code"] == 401 and r["body"]["id"] == e, r
    e = c.generate(prompt="x", tokens=[1])
    r = collect(c, e)
    assert r["final"] == "error" and r["body"]["code"] == 401, r
    c.sock.send_multipart([b"", SIG, bytes([GENERATE]), b"\x82\xa2id"])
    ev = c.next_event()
    assert ev[0] == "error" and ev[2]["code"] == 400, ev
    c.sock.send_multipart([b"", SIG, bytes([99]), msgpack.packb({})])
    ev = c.next_event()
    assert ev[0] == "error" and ev[2]["code"] == 400, ev

    # Server-side timeout.
    t = c.generate(prompt="slow", max_tokens=1048576, timeout_ms=50)
    r = collect(c, t)
    assert r["final"] == "error" and r["body"]["code"] == 408, r

    # Unknown id cancel: 404.
    c.cancel(12345)
    ev = c.next_event()
    assert ev[0] == "error" and ev[2]["code"] == 404 and ev[1] == 12345, ev
    c.close()
    print("pyclient: all checks passed")
    return 0


def main(argv):
    if len(argv) == 3 and argv[1] == "--check":
        return check(argv[2])
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    c = Client(argv[1])
    rid = c.generate(prompt=argv[2], max_tokens=int(argv[3]) if len(argv) == 4 else 256)
    for kind, body in c.events(rid, timeout_ms=600000):
        if kind == "tokens":
            sys.stdout.write(body["text"])
            sys.stdout.flush()
        elif kind == "error":
            print("\nerror %d: %s" % (body["code"], body["message"]), file=sys.stderr)
            return 1
    print()
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
