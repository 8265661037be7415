#!/usr/bin/env python3
"""gw_test.py — dsv4-gateway end to end on the CPU backend (issue 10, "Must
show").  One scenario per run:

  gw_test.py SCENARIO --build BUILD_DIR [--src SRC_DIR]

Scenarios (each starts its own set: dsv4-launch -G with one prefill and one
decode rank on a tiny checkpoint whose vocabulary is the real tokenizer's,
129,280 ids, so text requests work):

  api         the official `openai` client (pip) runs a completion, a chat
              completion and a streamed chat completion; curl reads an SSE
              stream; every greedy answer is token-for-token (and text-for-
              text) the answer of dsv4-generate (libdsv4client) for the same
              request; chat prompts are the DeepSeek-V4 rendering (checked
              against dsv4-tokenize of the rendered string), thinking mode
              included; /v1/models, /health; bearer tokens (401 without); a
              second gateway under systemd-socket-activate (the .socket unit's
              way) serves the passed listener and sends READY=1.
  robust      malformed JSON, wrong types, refused parameters, oversized
              bodies (declared and chunked), unknown routes and models, a
              client that stalls in its headers or body, clients that hang
              up mid-stream and mid-answer: clear errors (OpenAI shape), the
              requests are cancelled at the scheduler (admin protocol and
              dsv4ctl --json show nothing left), the gateway keeps serving;
              drain gives 503 on /health and on requests, undrain restores;
              on a scheduler without ranks (queue_max 1, 1 s deadline): 504
              for the queued request, 429 for the one after, /health 503;
              a gateway started alone with no scheduler at its endpoints:
              503 scheduler_unreachable (streamed or not), /health 503,
              dsv4_scheduler_up 0, /v1/models 200, SIGTERM exits 0.
  types       about 1,400 requests: every field of both routes, and the
              fields inside messages, content parts, prompts, stop arrays,
              stream_options, chat_template_kwargs and response_format, set
              to values of every JSON type (null, bools, numbers out of
              range, strings, arrays, objects): each gets 200 or an OpenAI
              error, a value of a type its field never takes is refused, the
              gateway never stops (it used to crash on a content part or
              response_format whose "type" was null), nothing is left over.
  prometheus  a real Prometheus server (Debian's `prometheus`) scrapes the
              gateway; the PromQL query of the request counter (HTTP API
              /api/v1/query) returns the number of requests the test made;
              `dsv4ctl --json status` and /metrics agree on every counter.
  scripted    no set: the gateway (gateway_idle_s 1) against ScriptedSched,
              a stand-in scheduler in this test (pyzmq + msgpack) whose
              answers the prompt scripts: a stream quiet for longer than the
              idle timeout ends with its tokens and [DONE] (keep-alive
              comments between), half-closed, closed and reset clients
              are cancelled, errors after acceptance look the same streamed or
              not and count as "error", error bodies are UTF-8, 405 has
              Allow, every error code answered is documented.

Exit 77 (skipped) only when a tool the scenario needs is missing and cannot
be installed (pip or apt unreachable).
"""
import argparse
import http.client
import json
import os
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import svc_test  # noqa: E402  (Admin, the leak check, check/wait_for)
from svc_test import Fail, check, wait_for  # noqa: E402


def log(*a):
    print("gw_test:", *a, flush=True)

MODEL = "deepseek-v4-flash"
EOS = "<｜end▁of▁sentence｜>"
BOS = "<｜begin▁of▁sentence｜>"
ARGS = None


def skip(why):
    print("gw_test: SKIP:", why, flush=True)
    sys.exit(77)


def need_openai():
    try:
        import openai  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                        "--break-system-packages", "openai"], check=False)
        try:
            import openai  # noqa: F401
        except ImportError:
            skip("the openai package is not installed and pip could not install it")
    import openai
    return openai


def need_pyzmq():
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                        "--break-system-packages", "pyzmq", "msgpack"], check=False)
        try:
            import msgpack  # noqa: F401
            import zmq  # noqa: F401
        except ImportError:
            skip("pyzmq or msgpack is not installed and pip could not install it")


def need_prometheus():
    p = shutil.which("prometheus")
    if p is None:
        subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        p = shutil.which("prometheus")
        if p is None:
            skip("prometheus is not installed and apt-get could not install it")
    return p


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def exe(rel):
    return svc_test.exe(rel)


class GwService:
    """dsv4-launch -G in a tmp dir: scheduler, 1 prefill, 1 decode rank and the
    gateway; attributes as svc_test.Service has them, so its leak check
    (Service.check_no_leaks) runs on this set too."""

    def __init__(self, extra_conf="", ranks=True, env=None):
        self.dir = tempfile.mkdtemp(prefix="dsv4-gw-")
        self.model = os.path.join(self.dir, "model")
        if ranks:
            subprocess.run([exe("tools/mkmodel/dsv4-mkmodel"), "--preset", "tiny",
                            "--set", "vocab_size=129280", "--out", self.model],
                           check=True, stdout=subprocess.DEVNULL)
        n = "1" if ranks else "0"
        self.client_ep = "ipc://%s/client.sock" % self.dir
        self.admin_ep = "ipc://%s/ctl.sock" % self.dir
        self.rank_ep = "ipc://%s/rank.sock" % self.dir   # svc_test.shm_exports
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.conf = os.path.join(self.dir, "dsv4.conf")
        with open(self.conf, "w") as f:
            f.write(f"""# gateway test configuration
client_endpoint = {self.client_ep}
rank_endpoint = {self.rank_ep}
admin_endpoint = {self.admin_ep}
heartbeat_ms = 500
liveness = 10
checkpoint = {self.model}
threads = 1
max_seq = 2048
prefill_chunk = 64
gateway_listen = 127.0.0.1:{self.port}
gateway_max_body = 65536
gateway_idle_s = 2
gateway_launch = yes
{extra_conf}
""")
        self.notify_log = os.path.join(self.dir, "notify.log")
        self.nsock_path = os.path.join(self.dir, "launch.notify")
        self.nsock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.nsock.bind(self.nsock_path)
        self.stderr = open(os.path.join(self.dir, "launch.err"), "w")
        self.proc = subprocess.Popen(
            [exe("tools/launch/dsv4-launch"), "-f", self.conf, "-P", n, "-D", n,
             "-r", "200", "-w", "20", "-T", "120", "-t", "20",
             "--sched-bin", exe("daemons/sched/dsv4-sched"),
             "--prefill-bin", exe("daemons/rank/dsv4-prefill"),
             "--decode-bin", exe("daemons/rank/dsv4-decode"),
             "--gateway-bin", exe("daemons/gateway/dsv4-gateway"),
             "--notify-log", self.notify_log],
            env=dict(os.environ, NOTIFY_SOCKET=self.nsock_path, **(env or {})),
            stderr=self.stderr)
        self.admin = svc_test.Admin(self.admin_ep)
        self.killed = set()
        svc_test.Service.wait_notify(self, "READY=1")
        if ranks:
            svc_test.Service.wait_ranks(self, 2)
            wait_for(lambda: self.http("GET", "/health")[0] == 200, "/health 200")

    errlog = svc_test.Service.errlog
    exits = svc_test.Service.exits
    check_exits = svc_test.Service.check_exits
    pid = svc_test.Service.pid
    kill9 = svc_test.Service.kill9

    def check_no_leaks(self):
        svc_test.Service.check_no_leaks(self)
        wait_for(lambda: metric(self.metrics(), "dsv4_gateway_streams_active") == 0,
                 "dsv4_gateway_streams_active 0")

    def http(self, method, path, body=None, headers=None, timeout=120):
        """One request; returns (status, headers, body bytes)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, dict(r.getheaders()), data

    def metrics(self):
        st, _, data = self.http("GET", "/metrics")
        check(st == 200, "/metrics answered %d" % st)
        return data.decode()

    def stop(self):
        self.admin.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # The checkpoint is large (129,280-id embeddings); logs stay.
        shutil.rmtree(self.model, ignore_errors=True)


def metric(text, name, labels=None):
    """Value of one sample of the Prometheus text `text` (None if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, val = line.rpartition(" ")
        n, _, lab = key.partition("{")
        if n != name:
            continue
        got = {}
        for part in lab.rstrip("}").split(","):
            if "=" in part:
                k, v = part.split("=", 1)
                got[k] = v.strip('"')
        if labels is None or all(got.get(k) == v for k, v in labels.items()):
            return float(val)
    return None


def generate_rows(svc, prompt=None, ids=None, n=16, top=None):
    """dsv4-generate (libdsv4client), greedy, EOS as stop id like the
    gateway, --logprobs (--top-logprobs TOP with top): (text, rows), a row
    (id, logprob, [(id, logprob) of the most likely tokens]) per output
    token."""
    cmd = [exe("tools/generate/dsv4-generate"), "-e", svc.client_ep, "-t", "0",
           "-n", str(n), "--logprobs", "--stop-id", str(tok_id(EOS))]
    if top is not None:
        cmd += ["--top-logprobs", str(top)]
    if ids is not None:
        cmd += ["--ids", " ".join(map(str, ids))]
    else:
        cmd += [prompt]
    r = subprocess.run(cmd, capture_output=True, timeout=300)
    check(r.returncode == 0, "dsv4-generate failed: %s" % r.stderr.decode())
    rows = []
    for line in r.stderr.decode().splitlines():
        f = line.split()
        if not f or not f[0].lstrip("-").isdigit():
            continue
        tops = [(int(t), float(lp)) for t, lp in (x.split(":") for x in f[2:])]
        rows.append((int(f[0]), float(f[1]), tops))
    return r.stdout.decode().rstrip("\n"), rows


def generate(svc, prompt=None, ids=None, n=16):
    """generate_rows without logprobs: (text, [ids])."""
    text, rows = generate_rows(svc, prompt, ids, n)
    return text, [row[0] for row in rows]


_pieces = {}


def pieces(ids):
    """The bytes of each token id (dsv4-tokenize --decode --hex, one id a
    line), as the gateway renders a token (dsv4_tok_piece)."""
    need = sorted(set(i for i in ids if i not in _pieces))
    if need:
        r = subprocess.run([exe("tools/tokenize/dsv4-tokenize"), "--decode", "--hex"],
                           input="".join("%d\n" % i for i in need), capture_output=True,
                           text=True, check=True)
        for i, h in zip(need, r.stdout.split("\n")):
            _pieces[i] = bytes.fromhex(h.strip())
    return [_pieces[i] for i in ids]


def api_lp(x):
    """A log-probability as the gateway writes it (-inf as -9999.0)."""
    return x if x != float("-inf") else -9999.0


def check_desc(lps, what):
    check(all(x <= 0 for x in lps) and all(a >= b for a, b in zip(lps, lps[1:])),
          "%s: log-probabilities not <= 0 and descending: %s" % (what, lps))


def check_chat_top(content, rows, k, what):
    """Chat logprobs.content entries with top_logprobs (k a position) ==
    dsv4-generate --top-logprobs rows (greedy: the first is the token)."""
    check(len(content) == len(rows), "%s: %d logprobs entries, dsv4-generate %d" %
          (what, len(content), len(rows)))
    for pos, (e, (rid, rlp, rtop)) in enumerate(zip(content, rows)):
        w = "%s, token %d" % (what, pos)
        top = e.top_logprobs
        check(len(top) == k and len(rtop) == k, "%s: %d top entries, dsv4-generate %d, "
              "want %d" % (w, len(top), len(rtop), k))
        check(bytes(e.bytes) == pieces([rid])[0] and abs(e.logprob - api_lp(rlp)) <= 1e-6,
              "%s: %r %s != dsv4-generate %d %s" % (w, e.token, e.logprob, rid, rlp))
        check_desc([t.logprob for t in top], w)
        check(top[0].token == e.token and bytes(top[0].bytes) == bytes(e.bytes) and
              top[0].logprob == e.logprob, "%s: greedy, the first top entry %r %s is not "
              "the token %r %s" % (w, top[0].token, top[0].logprob, e.token, e.logprob))
        for t, (tid, tlp), pb in zip(top, rtop, pieces([i for i, _ in rtop])):
            check(bytes(t.bytes) == pb and t.token == pb.decode("utf-8", "replace") and
                  abs(t.logprob - api_lp(tlp)) <= 1e-6, "%s: top %r %s %s != dsv4-generate "
                  "%d %r %s" % (w, t.token, t.bytes, t.logprob, tid, pb, tlp))


def check_completion_top(lp, rows, k, what):
    """Completion logprobs with top_logprobs (k a position: text ->
    logprob) == dsv4-generate --top-logprobs rows."""
    check(lp.top_logprobs is not None and len(lp.top_logprobs) == len(rows) ==
          len(lp.tokens), "%s: top_logprobs %s for %d tokens" % (what, lp.top_logprobs,
                                                                 len(rows)))
    for pos, (m, tok, tlp, (rid, rlp, rtop)) in enumerate(zip(
            lp.top_logprobs, lp.tokens, lp.token_logprobs, rows)):
        w = "%s, token %d" % (what, pos)
        check(len(rtop) == k, "%s: dsv4-generate gave %d top entries, want %d" %
              (w, len(rtop), k))
        want = {}
        for (tid, tl), pb in zip(rtop, pieces([i for i, _ in rtop])):
            # (json-c keys are C strings: a key ends at a NUL byte)
            want.setdefault(pb.decode("utf-8", "replace").split("\0")[0], api_lp(tl))
        check(isinstance(m, dict) and list(m) == list(want) and
              all(abs(m[t] - want[t]) <= 1e-6 for t in want),
              "%s: top %s != dsv4-generate's %s" % (w, m, want))
        check_desc(list(m.values()), w)
        check(abs(tlp - api_lp(rlp)) <= 1e-6, "%s: logprob %s != %s" % (w, tlp, rlp))
        best = list(m)[0]
        check(best == tok and m[best] == tlp, "%s: greedy, the first top entry %r %s is not "
              "the token %r %s" % (w, best, m[best], tok, tlp))


def tokenize_special(text):
    r = subprocess.run([exe("tools/tokenize/dsv4-tokenize"), "--special"],
                       input=text + "\n", capture_output=True, text=True, check=True)
    return [int(x) for x in r.stdout.split()]


_tok_ids = {}


def tok_id(marker):
    if marker not in _tok_ids:
        ids = tokenize_special(marker)
        check(len(ids) == 1, "%s is not one token: %s" % (marker, ids))
        _tok_ids[marker] = ids[0]
    return _tok_ids[marker]


def extra(obj, key):
    """A non-standard field of an openai response object."""
    v = getattr(obj, key, None)
    if v is None and getattr(obj, "model_extra", None):
        v = obj.model_extra.get(key)
    return v


def error_of(status, data, want_status, want_code=None):
    check(status == want_status, "status %d, want %d: %s" % (status, want_status, data[:300]))
    doc = json.loads(data)
    e = doc.get("error")
    check(isinstance(e, dict) and isinstance(e.get("message"), str) and e["message"]
          and "type" in e and "code" in e, "not an OpenAI error object: %s" % doc)
    if want_code is not None:
        check(e["code"] == want_code, "error code %s, want %s (%s)" %
              (e["code"], want_code, e["message"]))
    return e


A_CANCEL = 12   # docs/protocol.md §7: the admin CANCEL (dsv4ctl cancel)


def sse_events(raw):
    """data: payloads of an SSE body, in order."""
    out = []
    for block in raw.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                out.append(line[6:])
    return out


# --- scenarios ---------------------------------------------------------------


def sc_api():
    openai = need_openai()
    key = "sk-test-" + os.urandom(8).hex()
    tmp = tempfile.mkdtemp(prefix="dsv4-gwkeys-")
    keys = os.path.join(tmp, "gateway.keys")
    with open(keys, "w") as f:
        f.write("# test keys\n\n  %s  \nsecond-key\n" % key)
    os.chmod(keys, 0o640)
    svc = GwService("gateway_keys = %s" % keys)
    try:
        cli = openai.OpenAI(base_url=svc.base + "/v1", api_key=key, max_retries=0)
        # Auth: no token / a wrong one -> 401; /health and /metrics stay open.
        st, hdr, data = svc.http("POST", "/v1/completions", {"prompt": "x"})
        error_of(st, data, 401, "invalid_api_key")
        bad = openai.OpenAI(base_url=svc.base + "/v1", api_key="wrong", max_retries=0)
        try:
            bad.models.list()
            raise Fail("a wrong key was accepted")
        except openai.AuthenticationError:
            pass
        models = cli.models.list()
        check([m.id for m in models.data] == [MODEL], "models: %s" % models)
        st, _, data = svc.http("GET", "/health")
        check(st == 200 and json.loads(data)["status"] == "ok", "health: %s" % data)

        # 1. completion, text prompt, greedy: == dsv4-generate.
        prompt = "The quick brown fox"
        r = cli.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                   logprobs=0, extra_body={"return_token_ids": True})
        ref_text, ref_ids = generate(svc, prompt=prompt, n=16)
        ch = r.choices[0]
        check(extra(ch, "token_ids") == ref_ids, "completion ids %s != libdsv4client %s" %
              (extra(ch, "token_ids"), ref_ids))
        check(ch.text == ref_text, "completion text %r != %r" % (ch.text, ref_text))
        check(r.usage.completion_tokens == len(ref_ids) and r.usage.prompt_tokens > 0,
              "usage %s" % r.usage)
        check(ch.finish_reason in ("length", "stop"), "finish %s" % ch.finish_reason)
        check(len(ch.logprobs.token_logprobs) == len(ref_ids) and
              all(lp <= 0 for lp in ch.logprobs.token_logprobs), "logprobs %s" % ch.logprobs)
        log("completion == libdsv4client: %d tokens" % len(ref_ids))
        check(ch.logprobs.top_logprobs is None, "logprobs 0: top_logprobs %s" %
              ch.logprobs.top_logprobs)

        # logprobs 3 (legacy: the 3 most likely tokens of each position,
        # text -> logprob) == dsv4-generate --top-logprobs 3.
        r3 = cli.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                    logprobs=3)
        _, rows = generate_rows(svc, prompt=prompt, n=16, top=3)
        check(r3.choices[0].text == ref_text, "logprobs 3: text %r" % r3.choices[0].text)
        check_completion_top(r3.choices[0].logprobs, rows, 3, "completion logprobs 3")
        # text_offset: each token's offset in characters of the answer's
        # text, where its text starts (a token whose bytes are whole
        # characters; the old offsets counted bytes)
        lp3, t3 = r3.choices[0].logprobs, r3.choices[0].text
        check(lp3.text_offset[0] == 0 and lp3.text_offset == sorted(lp3.text_offset),
              "text_offset %s" % lp3.text_offset)
        seen = 0
        for tok, off in zip(lp3.tokens, lp3.text_offset):
            if "\ufffd" not in tok and off + len(tok) <= len(t3):
                check(t3[off:off + len(tok)] == tok, "text_offset %d: %r, the text there %r" %
                      (off, tok, t3[off:off + len(tok)]))
                seen += 1
        check(seen > 0 and any(ord(ch) > 127 for ch in t3),
              "text_offset: %d tokens checked, text %r" % (seen, t3))
        log("completion logprobs 3 == dsv4-generate --top-logprobs 3: %d tokens" % len(rows))
        # sampled, logprobs 1: each object has the sampled token too (OpenAI's
        # legacy "up to logprobs + 1"), with its token_logprob
        rs = cli.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.5,
                                    seed=5, logprobs=1)
        lp = rs.choices[0].logprobs
        extra_n = 0
        for pos, (m, tok, tlp) in enumerate(zip(lp.top_logprobs, lp.tokens, lp.token_logprobs)):
            check(1 <= len(m) <= 2 and tok in m and abs(m[tok] - tlp) <= 1e-6,
                  "sampled logprobs 1, token %d %r %s: top %s" % (pos, tok, tlp, m))
            check_desc(list(m.values()), "sampled logprobs 1, token %d" % pos)
            extra_n += len(m) == 2
        log("sampled completion logprobs 1: %d of %d tokens not the most likely, listed too" %
            (extra_n, len(lp.tokens)))

        # Token-id prompt.
        r2 = cli.completions.create(model=MODEL, prompt=[5, 17, 99, 1234], max_tokens=8,
                                    temperature=0, extra_body={"return_token_ids": True})
        _, ref2 = generate(svc, ids=[5, 17, 99, 1234], n=8)
        check(extra(r2.choices[0], "token_ids") == ref2, "id-prompt completion differs")

        # 2. chat completion: prompt is the DeepSeek-V4 rendering; answer ==
        # dsv4-generate on those ids.
        msgs = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hi"}]
        rendered = BOS + "You are terse.<｜User｜>Say hi<｜Assistant｜></think>"
        want_prompt = tokenize_special(rendered)
        c = cli.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                        temperature=0, logprobs=True,
                                        extra_body={"return_token_ids": True})
        check(extra(c, "prompt_token_ids") == want_prompt, "chat prompt %s != rendering %s" %
              (extra(c, "prompt_token_ids"), want_prompt))
        ref_text, ref_ids = generate(svc, ids=want_prompt, n=12)
        cc = c.choices[0]
        check(extra(cc, "token_ids") == ref_ids, "chat ids %s != %s" %
              (extra(cc, "token_ids"), ref_ids))
        check(cc.message.content == ref_text, "chat text %r != %r" %
              (cc.message.content, ref_text))
        check(cc.message.role == "assistant" and len(cc.logprobs.content) == len(ref_ids),
              "chat message/logprobs: %s" % cc)
        check(c.usage.prompt_tokens == len(want_prompt), "chat usage %s" % c.usage)
        check(all(e.top_logprobs == [] for e in cc.logprobs.content),
              "no top_logprobs asked: %s" % cc.logprobs.content)
        log("chat completion == libdsv4client: %d tokens" % len(ref_ids))

        # top_logprobs 5: the 5 most likely tokens of each position, best
        # first == dsv4-generate --top-logprobs 5 on the same ids.
        c5 = cli.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=5)
        _, rows = generate_rows(svc, ids=want_prompt, n=12, top=5)
        check(c5.choices[0].message.content == ref_text, "top_logprobs 5: text %r" %
              c5.choices[0].message.content)
        check_chat_top(c5.choices[0].logprobs.content, rows, 5, "chat top_logprobs 5")
        log("chat top_logprobs 5 == dsv4-generate --top-logprobs 5: %d tokens" % len(rows))
        # Streamed with top_logprobs 2: the same lists, cut at 2.
        s2 = cli.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         stream=True)
        got = []
        for chunk in s2:
            for chc in chunk.choices:
                if chc.logprobs is not None and chc.logprobs.content:
                    got += chc.logprobs.content
        top_of = (lambda e, k: [(t.token, t.logprob, t.bytes) for t in e.top_logprobs[:k]])
        check(len(got) == len(c5.choices[0].logprobs.content) and
              all(top_of(a, 2) == top_of(b, 2) and len(a.top_logprobs) == 2 and
                  (a.token, a.logprob) == (b.token, b.logprob)
                  for a, b in zip(got, c5.choices[0].logprobs.content)),
              "streamed top_logprobs 2 %s != the answer's %s" %
              (got, c5.choices[0].logprobs.content))
        log("streamed chat top_logprobs 2 == the answer's (%d tokens)" % len(got))

        # 3. streamed chat completion == the same answer.
        stream = cli.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"return_token_ids": True})
        text, ids, finish, usage, n_chunks = "", [], None, None, 0
        for chunk in stream:
            n_chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
            for chc in chunk.choices:
                text += chc.delta.content or ""
                ids += extra(chc, "token_ids") or []
                finish = chc.finish_reason or finish
        check(ids == ref_ids and text == ref_text, "streamed chat %r %s != %r %s" %
              (text, ids, ref_text, ref_ids))
        check(finish == cc.finish_reason and usage is not None and
              usage.completion_tokens == len(ref_ids), "stream end: %s %s" % (finish, usage))
        check(n_chunks >= 3, "only %d chunks" % n_chunks)
        log("streamed chat == libdsv4client (%d chunks)" % n_chunks)

        # Thinking mode: the prompt ends with <think>; output is split at
        # </think> into reasoning_content and content.
        t = cli.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                        temperature=0, extra_body={
                                            "chat_template_kwargs": {"thinking": True},
                                            "return_token_ids": True})
        want_think = tokenize_special(BOS + "You are terse.<｜User｜>Say hi<｜Assistant｜><think>")
        check(extra(t, "prompt_token_ids") == want_think, "thinking prompt %s != %s" %
              (extra(t, "prompt_token_ids"), want_think))
        ref_text, ref_ids = generate(svc, ids=want_think, n=6)
        reasoning = extra(t.choices[0].message, "reasoning_content")
        check(reasoning is not None and
              reasoning + ("</think>" if "</think>" in ref_text else "") +
              (t.choices[0].message.content or "") == ref_text,
              "thinking answer %r + %r != %r" % (reasoning, t.choices[0].message.content,
                                                 ref_text))
        # enable_thinking (vLLM's name) is thinking too; a conversation that
        # ends with an assistant turn opens no <think>, so its output is all
        # content (it went to reasoning_content whole); text parts are
        # joined with "\n" (they were joined with nothing).
        msgs2 = [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                              {"type": "text", "text": "hi"}]},
                 {"role": "assistant", "content": "Hi"}]
        t = cli.chat.completions.create(model=MODEL, messages=msgs2, max_tokens=6,
                                        temperature=0, extra_body={
                                            "chat_template_kwargs": {"enable_thinking": True},
                                            "return_token_ids": True})
        want2 = extra(t, "prompt_token_ids")
        tail = tokenize_special("<｜Assistant｜><think></think>Hi" + EOS)
        check(want2[-len(tail):] == tail, "prompt ending with an assistant turn %s: not "
              "ending %s" % (want2, tail))
        t2 = cli.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say\nhi"}, msgs2[1]],
            max_tokens=1, temperature=0, extra_body={"thinking": True,
                                                     "return_token_ids": True})
        check(extra(t2, "prompt_token_ids") == want2, "parts %s != \"Say\\nhi\" %s" %
              (want2, extra(t2, "prompt_token_ids")))
        ref_text, ref_ids = generate(svc, ids=want2, n=6)
        check(not extra(t.choices[0].message, "reasoning_content") and
              t.choices[0].message.content == ref_text.replace(EOS, ""),
              "after an assistant turn: %r / %r != %r" % (
                  extra(t.choices[0].message, "reasoning_content"),
                  t.choices[0].message.content, ref_text))
        log("thinking mode: after an assistant turn all content; enable_thinking; parts "
            "joined with \\n")

        # 4. curl with SSE: a streamed completion == the non-streamed one.
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16,
                           "temperature": 0, "stream": True})
        r = subprocess.run(["curl", "-sSN", "--fail-with-body", "-H",
                            "Authorization: Bearer " + key, "-H",
                            "Content-Type: application/json", "-d", body,
                            svc.base + "/v1/completions", "-D", "-"],
                           capture_output=True, timeout=120)
        check(r.returncode == 0, "curl failed: %s" % r.stderr.decode())
        head, _, rest = r.stdout.partition(b"\r\n\r\n")
        check(b"text/event-stream" in head, "curl: no SSE content type: %s" % head)
        ev = sse_events(rest)
        check(ev and ev[-1] == "[DONE]", "curl stream does not end with [DONE]: %s" % ev[-2:])
        chunks = [json.loads(e) for e in ev[:-1]]
        curl_text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        check(curl_text == ch.text, "curl SSE text %r != %r" % (curl_text, ch.text))
        check(chunks[-1]["choices"][0]["finish_reason"] == ch.finish_reason,
              "curl finish %s" % chunks[-1])
        log("curl SSE: %d events == the completion" % len(ev))
        rotate_keys(svc, keys, key)
        socket_activated(svc, key, ch.text)
        svc.check_no_leaks()
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def rotate_keys(svc, keys, key):
    """SIGHUP (to dsv4-launch, which passes it on; the unit's ExecReload=
    under systemd) reloads the keys file: a revoked key is refused and a new
    one taken at once, no restart; a file that cannot be used keeps the keys
    that run.  Leaves `key` in force again."""
    def status(k):
        return svc.http("GET", "/v1/models", headers={"Authorization": "Bearer " + k})[0]

    def reload_to(text, want):
        with open(keys + ".new", "w") as f:
            f.write(text)
        os.chmod(keys + ".new", 0o640)
        os.replace(keys + ".new", keys)
        svc.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: all(status(k) == st for k, st in want.items()),
                 "keys after SIGHUP: want %s" % want)

    gw_pid = svc.pid("gateway")
    new = "sk-new-" + os.urandom(8).hex()
    reload_to("%s\n" % new, {new: 200, key: 401, "second-key": 401})
    # an unusable file (no key) keeps the running keys
    reload_to("# nothing\n", {})
    # the reload done (its log line), then the keys as they were
    wait_for(lambda: "cannot be used; the 1 running key(s) stay" in svc.errlog(),
             "no log of the kept keys")
    check(status(new) == 200 and status(key) == 401, "keys changed by an unusable file")
    reload_to("%s\n" % key, {key: 200, new: 401})
    check(svc.pid("gateway") == gw_pid, "the gateway restarted")
    log("keys: SIGHUP revoked one and took another, kept them over an unusable file")


def socket_activated(svc, key, want_text):
    """A second gateway on the same set, started by systemd-socket-activate
    on the first connection (as dsv4-gateway.socket does): it adopts the
    passed listener (not gateway_listen), sends READY=1 to NOTIFY_SOCKET and
    answers the connection that started it."""
    sa = shutil.which("systemd-socket-activate")
    check(sa is not None, "systemd-socket-activate not installed (tools/setup.sh)")
    port = free_port()
    npath = os.path.join(svc.dir, "gw2.notify")
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(npath)
    err = open(os.path.join(svc.dir, "gw2.err"), "w")
    p = subprocess.Popen([sa, "-l", "127.0.0.1:%d" % port, "-E", "NOTIFY_SOCKET=" + npath,
                          exe("daemons/gateway/dsv4-gateway"), "-f", svc.conf],
                         stdout=err, stderr=err)
    try:
        def listening():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                return False
        wait_for(listening, "systemd-socket-activate listening")
        body = json.dumps({"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 16,
                           "temperature": 0})
        r = subprocess.run(["curl", "-sS", "--fail-with-body", "-H",
                            "Authorization: Bearer " + key, "-H",
                            "Content-Type: application/json", "-d", body,
                            "http://127.0.0.1:%d/v1/completions" % port],
                           capture_output=True, timeout=120)
        check(r.returncode == 0, "socket-activated gateway: %s %s" % (r.stdout, r.stderr))
        check(json.loads(r.stdout)["choices"][0]["text"] == want_text,
              "socket-activated gateway answered differently: %s" % r.stdout[:200])
        ns.settimeout(30)
        msgs = []
        while "READY=1" not in msgs:
            msgs += ns.recv(4096).decode().split("\n")
        log("socket-activated gateway: READY=1, same answer on the passed listener")
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        ns.close()
    check(p.returncode == 0, "socket-activated gateway exited %s" % p.returncode)


def raw_conn(svc):
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=60)
    return s


def hang_up_mid_stream(svc, path, body):
    """POST a long streamed request, read until the first output arrives,
    then close the socket."""
    data = json.dumps(body).encode()
    s = raw_conn(svc)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)
    got = b""
    while got.count(b"data: ") < 2:
        b = s.recv(4096)
        check(b, "stream ended before the hang-up: %r" % got[-300:])
        got += b
    check(b" 200 " in got.split(b"\r\n")[0], "stream status: %r" % got[:100])
    s.close()


def sched_death_mid_stream(svc):
    """kill -9 of the scheduler while a streamed completion runs: the
    gateway's libdsv4client resumes the request on the restarted scheduler
    (docs/protocol.md §4.6), so the HTTP client's one stream carries the text
    of an undisturbed request, nothing twice."""
    body = {"prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0}
    st, _, data = svc.http("POST", "/v1/completions", body)
    check(st == 200, "reference completion: %d %s" % (st, data[:200]))
    want = json.loads(data)["choices"][0]["text"]
    c = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=120)
    c.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    check(r.status == 200, "stream status %d" % r.status)
    events, killed = [], None
    while True:
        line = r.readline()
        check(line, "the stream ended without [DONE] after %d events" % len(events))
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            break
        events.append(json.loads(line[6:]))
        if len(events) == 4:
            killed = svc.kill9("sched")
    c.close()
    check(killed is not None, "the stream ended before the kill (%d events)" % len(events))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    check(text == want, "text across the scheduler's death %r != %r" % (text, want))
    wait_for(lambda: svc.pid("sched") not in (None, killed),
             "the scheduler restarted")
    svc_test.Service.wait_ranks(svc, 2)
    svc.check_no_leaks()
    svc.stderr.flush()
    with open(os.path.join(svc.dir, "launch.err")) as f:
        resumed = re.findall(r"resumes after (\d+) tokens", f.read())
    check(len(resumed) == 1 and int(resumed[0]) >= 4,
          "the scheduler logged no resume of the stream: %s" % resumed)
    log("scheduler killed mid-stream: the stream went on after %s tokens, %d events, the "
        "same text" % (resumed[0], len(events)))


def sc_robust():
    svc = GwService()
    try:
        adm = svc.admin
        base_cancelled = adm.status().get("n_cancelled", 0)
        # Malformed and invalid bodies: 400 in the OpenAI shape.
        for path, body, code in [
                ("/v1/completions", "{bad json", "invalid_json"),
                ("/v1/completions", '{"prompt": "x"} trailing', "invalid_json"),
                # bytes after a NUL were not looked at (json-c stops there)
                ("/v1/completions", '{"prompt": "x"}\0{"prompt": "y"}', "invalid_json"),
                ("/v1/completions", '{"prompt": "x"} \r\n\0', "invalid_json"),
                # U+0000 inside a string: it went on cut there
                ("/v1/completions", '{"prompt": "abc\\u0000def"}', "invalid_value"),
                ("/v1/completions", '{"prompt": "x", "stop": ["a\\u0000"]}', "invalid_value"),
                ("/v1/chat/completions",
                 '{"messages": [{"role": "user", "content": "a\\u0000b"}]}', "invalid_value"),
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
                 '[{"type": "text", "text": "a\\u0000b"}]}]}', "invalid_value"),
                ("/v1/chat/completions",
                 '{"messages": [{"role": "user\\u0000", "content": "x"}]}', "unsupported_role"),
                # not UTF-8 (json-c passes these bytes): the same for every text
                ("/v1/completions", '{"prompt": "a\xffb"}', "invalid_value"),
                ("/v1/completions", '{"prompt": "a\xed\xa0\x80b"}', "invalid_value"),
                ("/v1/completions", '{"prompt": "x", "stop": "\xc0\x80"}', "invalid_value"),
                ("/v1/chat/completions",
                 '{"messages": [{"role": "user", "content": "a\xffb"}]}', "invalid_value"),
                ("/v1/chat/completions", '{"messages": [{"role": "assistant", "content": "x", '
                 '"reasoning_content": "\xf5"}, {"role": "user", "content": "y"}]}',
                 "invalid_value"),
                ("/v1/completions", "[1, 2]", "invalid_json"),
                ("/v1/completions", "[" * 100 + "]" * 100, "invalid_json"),
                ("/v1/completions", "", "invalid_json"),
                ("/v1/completions", '{"prompt": "x", "max_tokens": "ten"}', "invalid_type"),
                ("/v1/completions", '{"prompt": "x", "temperature": -1}', "invalid_value"),
                ("/v1/completions", '{"prompt": "x", "n": 2}', "unsupported_value"),
                # a value of a type n never takes: invalid_type (it was unsupported_value)
                ("/v1/completions", '{"prompt": "x", "n": "1"}', "invalid_type"),
                # logprobs: 0 ... 20 most likely tokens (non-integers refused)
                ("/v1/completions", '{"prompt": "x", "logprobs": 21}', "invalid_value"),
                ("/v1/completions", '{"prompt": "x", "logprobs": -1}', "invalid_value"),
                ("/v1/completions", '{"prompt": "x", "logprobs": 2.5}', "invalid_value"),
                ("/v1/completions", '{"prompt": ["a", "b"]}', "unsupported_value"),
                ("/v1/completions", '{"prompt": [1, 999999]}', "invalid_value"),
                ("/v1/completions", '{"max_tokens": 4}', "invalid_request"),
                ("/v1/chat/completions", '{"messages": []}', "invalid_request"),
                ("/v1/chat/completions",
                 '{"messages": [{"role": "tool", "content": "x"}]}', "unsupported_role"),
                ("/v1/chat/completions",
                 '{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}',
                 "unsupported_parameter"),
                # top_logprobs: 0 ... 20, and only with "logprobs": true
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                 '"logprobs": true, "top_logprobs": 21}', "invalid_value"),
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                 '"logprobs": true, "top_logprobs": -1}', "invalid_value"),
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                 '"logprobs": true, "top_logprobs": 2.5}', "invalid_value"),
                ("/v1/chat/completions",
                 '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}',
                 "invalid_value"),
                ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                 '"logprobs": false, "top_logprobs": 3}', "invalid_value")]:
            st, _, data = svc.http("POST", path, body)
            error_of(st, data, 400, code)
        for path, body, field in [
                ("/v1/completions", {"prompt": "x", "logprobs": 21}, '"logprobs"'),
                ("/v1/completions", {"prompt": "x", "logprobs": 2.5}, '"logprobs"'),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "logprobs": True, "top_logprobs": 21},
                 '"top_logprobs"'),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "logprobs": True, "top_logprobs": -1},
                 '"top_logprobs"'),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "top_logprobs": 2}, '"logprobs": true'),
                # the value as sent, the bounds as they are ("%g" said "= 10
                # is outside 0 ... 10", "9.0072e+15 ... 9.0072e+15")
                ("/v1/completions", {"prompt": "x", "temperature": 10.0000001},
                 '"temperature" = 10.0000001 is outside 0 ... 10'),
                ("/v1/completions", {"prompt": "x", "seed": 9007199254740993},
                 '"seed" = 9007199254740993 is outside 0 ... 9007199254740991'),
                # a top_p that is 0 as a float (it was refused further on,
                # naming 0 and the wrong code)
                ("/v1/completions", {"prompt": "x", "top_p": 1e-50},
                 '"top_p" = 1e-50 is 0 as a float'),
                ("/v1/completions", {"prompt": "x", "max_tokens": 3,
                                     "max_completion_tokens": 4},
                 '"max_tokens" (3) and "max_completion_tokens" (4) differ')]:
            st, _, data = svc.http("POST", path, body)
            e = error_of(st, data, 400, "invalid_value")
            check(field in e["message"], "%s %s: the message %r does not name %s" %
                  (path, body, e["message"], field))
        # Bodies the JSON parser waits on (it said "continue (at byte N)"):
        # the message says what is wrong.
        for body, want in [("", "the body is empty"), (" \r\n", "the body is empty"),
                           ('{"prompt": "ab', "ends inside its JSON object (14 bytes)"),
                           ("12", "must be a JSON object")]:
            st, _, data = svc.http("POST", "/v1/completions", body)
            e = error_of(st, data, 400, "invalid_json")
            check(want in e["message"] and "continue" not in e["message"],
                  "body %r: %r" % (body, e["message"]))
        # In range: accepted (they were refused), and logprobs 0 still has
        # a null top_logprobs.
        for path, body, want_top in [
                ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 20}, 20),
                ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 0}, None),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 2, "logprobs": True,
                                          "top_logprobs": 20}, 20)]:
            st, _, data = svc.http("POST", path, body)
            check(st == 200, "%s %s: %d %s" % (path, body, st, data[:300]))
            lp = json.loads(data)["choices"][0]["logprobs"]
            tops = ([e["top_logprobs"] for e in lp["content"]] if "content" in lp else
                    lp["top_logprobs"])
            # (completions: two ids of the same text are one key, and the
            # sampled token is added when it is not among them: up to N + 1)
            check(tops is None if want_top is None else
                  (tops and all(len(t) == want_top or "content" not in lp and
                                0 < len(t) <= want_top + 1 for t in tops)),
                  "%s %s: top_logprobs %s" % (path, body, tops))
        st, _, data = svc.http("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"})
        error_of(st, data, 404, "model_not_found")
        st, _, data = svc.http("POST", "/v1/completions", {"model": MODEL + "\0x", "prompt": "x"})
        error_of(st, data, 404, "model_not_found")
        check(b"not UTF-8 text without U+0000" in data, "message: %s" % data)
        st, _, data = svc.http("GET", "/v1/completions")
        error_of(st, data, 405)
        st, _, data = svc.http("GET", "/nowhere")
        error_of(st, data, 404)
        # The scheduler's refusal: prompt + max_tokens beyond max_seq (2048).
        st, _, data = svc.http("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 5000})
        error_of(st, data, 400, "context_length_exceeded")
        log("malformed and invalid requests: 400/404/405 with OpenAI errors")

        # Oversized bodies: declared (Content-Length) and chunked.
        big = json.dumps({"prompt": "x" * 100000})
        st, _, data = svc.http("POST", "/v1/completions", big)
        error_of(st, data, 413, "request_too_large")
        r = subprocess.run(["curl", "-sS", "-H", "Transfer-Encoding: chunked", "-H",
                            "Content-Type: application/json", "--data-binary", "@-",
                            "-w", "\n%{http_code}", svc.base + "/v1/completions"],
                           input=big.encode(), capture_output=True, timeout=60)
        out = r.stdout.decode()
        body_txt, _, code = out.rpartition("\n")
        error_of(int(code), body_txt.encode(), 413, "request_too_large")
        log("oversized bodies: 413 (declared and chunked)")

        # Slow clients: stalled in the headers, stalled in the body.  The
        # gateway closes them after gateway_idle_s (2 s here).
        for partial in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100"
                        b"\r\n\r\n{\"prompt\":"):
            s = raw_conn(svc)
            s.sendall(partial)
            s.settimeout(60)
            rest = b""
            while True:
                b = s.recv(4096)
                if not b:
                    break
                rest += b
            s.close()
            log("stalled client closed by the gateway (%d bytes answered)" % len(rest))

        # Disconnects: mid-stream (SSE), and while waiting for a
        # non-streamed answer.  Both cancel the request at the scheduler.
        # max_tokens 1500 (max_seq 2048): the requests cannot finish on their
        # own in the moments between the hang-up and the gateway noticing it,
        # whatever the machine's load.
        hang_up_mid_stream(svc, "/v1/completions",
                           {"prompt": "count with me", "max_tokens": 1500, "stream": True})
        hang_up_mid_stream(svc, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "go"}],
                            "max_tokens": 1500, "stream": True})
        s = raw_conn(svc)
        data = json.dumps({"prompt": "long answer", "max_tokens": 1500}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                  % len(data) + data)
        wait_for(lambda: len(adm.requests()) > 0, "the request to run")
        s.close()
        try:
            wait_for(lambda: metric(svc.metrics(), "dsv4_gateway_requests_total",
                                    {"outcome": "disconnected"}) == 3,
                     "3 disconnected requests counted")
        except Fail:
            log("requests_total: " + " ".join(
                l for l in svc.metrics().splitlines() if "requests_total" in l))
            raise
        # each of the three hang-ups cancelled at the scheduler (none can
        # finish its 1,500 tokens first)
        wait_for(lambda: adm.status().get("n_cancelled", 0) - base_cancelled == 3,
                 "3 cancels at the scheduler")
        svc.check_no_leaks()
        log("hang-ups mid-stream, a reset mid-answer: cancelled, nothing leaked")

        # An operator's `dsv4ctl cancel`: finish_reason "cancelled" with the
        # output so far, outcome "cancelled" (it was a 500 internal_error,
        # the output dropped, counted as an error).
        base_err = metric(svc.metrics(), "dsv4_gateway_requests_total", {"outcome": "error"})
        # (the prefill rank drained, so that the request waits in the queue
        # for the cancel: 1,500 tokens of the tiny model take under a second)
        check(adm.drain("prefill@0")["code"] == 200, "drain prefill@0")
        for stream in (False, True):
            got = {}
            t = threading.Thread(target=lambda: got.update(r=svc.http(
                "POST", "/v1/completions", {"prompt": "cancel me", "max_tokens": 1500,
                                            "stream": stream})))
            t.start()
            reqs = wait_for(lambda: adm.requests(), "the request to queue")
            res = adm.call(A_CANCEL, {"req": reqs[0]["req"]}, finals=(svc_test.A_RESULT,))[1]
            t.join(120)
            check(res["code"] == 200 and "r" in got, "CANCEL: %s, answered: %s" %
                  (res, "r" in got))
            st, _, data = got["r"]
            check(st == 200, "cancelled (stream %s): %d %s" % (stream, st, data[:300]))
            if stream:
                ev = sse_events(data)
                check(ev[-1] == "[DONE]" and
                      json.loads(ev[-2])["choices"][0]["finish_reason"] == "cancelled",
                      "cancelled stream's end: %s" % ev[-3:])
            else:
                check(json.loads(data)["choices"][0]["finish_reason"] == "cancelled",
                      "cancelled answer: %s" % data[:300])
        check(metric(svc.metrics(), "dsv4_gateway_requests_total",
                     {"outcome": "cancelled"}) == 2, "2 cancelled requests counted")
        check(metric(svc.metrics(), "dsv4_gateway_requests_total",
                     {"outcome": "error"}) == base_err, "cancels counted as errors")
        check(adm.undrain("prefill@0")["code"] == 200, "undrain prefill@0")
        log("dsv4ctl cancel: finish_reason cancelled, streamed or not, counted as cancelled")

        # Still serving.
        st, _, data = svc.http("POST", "/v1/completions", {"prompt": "still there?",
                                                           "max_tokens": 4})
        check(st == 200 and json.loads(data)["usage"]["completion_tokens"] >= 1,
              "gateway stopped serving: %d %s" % (st, data[:200]))

        # Drain: /health and requests 503; undrain: back.
        res = adm.drain("all")
        check(res["code"] == 200, "drain: %s" % res)
        st, _, data = svc.http("GET", "/health")
        error_of(st, data, 503)
        st, _, data = svc.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        error_of(st, data, 503, "draining")
        check(adm.undrain("all")["code"] == 200, "undrain failed")
        wait_for(lambda: svc.http("GET", "/health")[0] == 200, "/health 200 after undrain")
        st, _, data = svc.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        check(st == 200, "after undrain: %d %s" % (st, data[:200]))
        log("drain: 503 on /health and requests; undrain restores")
        svc.check_no_leaks()
        sched_death_mid_stream(svc)
    finally:
        svc.stop()
    overload()
    no_scheduler()


class BareGateway:
    """A dsv4-gateway this test started alone: GwService's HTTP helpers."""

    def __init__(self, port):
        self.port = port

    http = GwService.http
    metrics = GwService.metrics


def start_bare(d, gw, extra="", nofile=None):
    """Start dsv4-gateway alone on gw.port with its scheduler endpoints in
    directory d (and `extra` configuration lines; nofile: its RLIMIT_NOFILE,
    soft and hard), once it serves; returns the process and its stderr file
    (d/gateway.err; the caller closes it)."""
    conf = os.path.join(d, "dsv4.conf")
    with open(conf, "w") as f:
        f.write("client_endpoint = ipc://%s/client.sock\nadmin_endpoint = ipc://%s/ctl.sock\n"
                "gateway_listen = 127.0.0.1:%d\ntokenizer = %s\n%s" %
                (d, d, gw.port, os.path.join(ARGS.src, "tests/tokenizer/tiny_tokenizer.json"),
                 extra))
    err = open(os.path.join(d, "gateway.err"), "w")
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    limit = None if nofile is None else (
        lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    p = subprocess.Popen([exe("daemons/gateway/dsv4-gateway"), "-f", conf], stderr=err,
                         env=env, preexec_fn=limit)
    wait_for(lambda: p.poll() is not None or
             "serving" in svc_test.readf(os.path.join(d, "gateway.err")), "the gateway up")
    check(p.poll() is None, "the gateway exited (%s)" % p.poll())
    return p, err


def no_scheduler():
    """A gateway whose scheduler is not there (nothing listens on its
    endpoints): completions, streamed or not, get 503 scheduler_unreachable
    counted as rejected, /health 503, /metrics 200 with dsv4_scheduler_up 0,
    /v1/models 200; SIGTERM stops it with status 0."""
    d = tempfile.mkdtemp(prefix="dsv4-gw-nosched-")
    gw = BareGateway(free_port())
    p, err = start_bare(d, gw)
    try:
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
                           ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "hi"}],
                                                     "stream": True})):
            st, _, data = gw.http("POST", path, body)
            e = error_of(st, data, 503, "scheduler_unreachable")
            check("does not answer" in e["message"], "%s: %s" % (path, e["message"]))
        st, _, data = gw.http("GET", "/health")
        e = error_of(st, data, 503)
        check("does not answer" in e["message"], "health reason: %s" % e["message"])
        # Probes at once share the admin query in flight: a stand-in admin
        # endpoint that never answers counts the queries (they queued, and
        # the five probes sent five, the fifth answered after 15 s).  What
        # the gateway queued before the stand-in came is drained first.
        import zmq
        zctx = zmq.Context()
        stand = zctx.socket(zmq.ROUTER)
        stand.setsockopt(zmq.LINGER, 0)
        stand.bind("ipc://%s/ctl.sock" % d)
        end = time.time() + 1.0
        while time.time() < end:
            if stand.poll(100):
                stand.recv_multipart()
        took, queries = [], 0

        def probe():
            st, _, _ = gw.http("GET", "/health" if len(took) % 2 else "/metrics")
            took.append(st)
        th = [threading.Thread(target=probe) for _ in range(5)]
        for t in th:
            t.start()
        while any(t.is_alive() for t in th):
            if stand.poll(100):
                stand.recv_multipart()
                queries += 1
        stand.close()
        zctx.term()
        check(len(took) == 5 and 1 <= queries < 5,
              "concurrent /health and /metrics: %d admin queries for 5 probes (%s)" %
              (queries, took))
        m = gw.metrics()
        check(metric(m, "dsv4_scheduler_up") == 0 and metric(m, "dsv4_serving") == 0,
              "dsv4_scheduler_up / dsv4_serving not 0")
        check(metric(m, "dsv4_gateway_requests_total", {"outcome": "rejected"}) == 2,
              "two refused requests not counted as rejected")
        st, _, data = gw.http("GET", "/v1/models")
        check(st == 200 and json.loads(data)["data"], "/v1/models: %d %s" % (st, data[:200]))
        p.terminate()
        check(p.wait(60) == 0, "the gateway's exit status %s" % p.returncode)
        log("no scheduler: 503 scheduler_unreachable (streamed or not), /health 503, "
            "dsv4_scheduler_up 0, /v1/models 200")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        err.close()
        shutil.rmtree(d, ignore_errors=True)


def framing_keys_fds():
    """A gateway alone with bearer keys and 200 open files: it says it serves
    (200 - 64) / 12 = 11 connections, not the 256 configured (past its
    descriptors libmicrohttpd's accept() spun a core); every /v1/ URL wants
    the key (an unknown one: 401 without it, 404 with it); a body length a
    proxy could read otherwise (Content-Length with Transfer-Encoding, two
    Content-Lengths that differ) is refused 400 and the connection closed,
    so a request hidden after it is never served."""
    d = tempfile.mkdtemp(prefix="dsv4-gw-framing-")
    keys = os.path.join(d, "gateway.keys")
    with open(keys, "w") as f:
        f.write("k-framing\n")
    os.chmod(keys, 0o640)
    gw = BareGateway(free_port())
    p, err = start_bare(d, gw, "gateway_keys = %s\ngateway_max_conns_per_ip = 2\n" % keys,
                        nofile=200)
    try:
        text = svc_test.readf(os.path.join(d, "gateway.err"))
        check("gateway_max_conns = 256 needs" in text and "serving 11 connections" in text,
              "no fd budget line: %s" % text[-600:])
        st, _, data = gw.http("GET", "/v1/embeddings")
        error_of(st, data, 401, "invalid_api_key")
        st, _, data = gw.http("GET", "/v1/embeddings", headers={"Authorization": "Bearer k-framing"})
        error_of(st, data, 404, "not_found")
        # blanks around the key are not part of it (RFC 9110 5.5); a key
        # with a trailing blank was refused 401.  Sent raw: the client
        # library would strip them.
        for auth in (b"Bearer k-framing \t", b"Bearer \t k-framing"):
            r = raw_request(gw.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: " +
                            auth + b"\r\nConnection: close\r\n\r\n")
            check(r is not None and r[0] == 200, "Authorization %r: %s" % (auth, r))
        r = raw_request(gw.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: "
                        b"Bearer k-framin \r\nConnection: close\r\n\r\n")
        check(r is not None and r[0] == 401, "a key cut short was taken: %s" % (r,))
        hidden = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        for name, head in (("CL+TE", b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"),
                           ("CL twice", b"Content-Length: 5\r\nContent-Length: 4\r\n")):
            s = socket.create_connection(("127.0.0.1", gw.port), timeout=20)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Authorization: Bearer k-framing\r\n" + head + b"\r\n0\r\n\r\n" + hidden)
            got = b""
            try:
                while True:
                    b = s.recv(65536)
                    if not b:
                        break
                    got += b
            except socket.timeout:
                pass
            s.close()
            check(got.startswith(b"HTTP/1.1 400") and got.count(b"HTTP/1.1 ") == 1,
                  "%s: %r" % (name, got[:300]))
        # gateway_max_conns_per_ip = 2: a third connection from this
        # address is closed unanswered while two are held; one closed, the
        # next is served
        def open_pair():
            """Two connections the gateway keeps (the earlier ones' slots
            are given back a little after they close: until then a new one
            may be the address's third, closed at once)."""
            for _ in range(50):
                pair = [socket.create_connection(("127.0.0.1", gw.port), timeout=20)
                        for _ in range(2)]
                time.sleep(0.3)
                alive = True
                for h in pair:
                    h.setblocking(False)   # no wait: a timeout socket polls first
                    try:
                        alive = alive and h.recv(1, socket.MSG_PEEK) != b""
                    except BlockingIOError:
                        pass   # open, nothing sent: kept
                    except OSError:
                        alive = False
                    h.settimeout(20)
                if alive:
                    return pair
                for h in pair:
                    h.close()
            check(False, "the gateway closed every pair of connections")
            return []

        held = open_pair()
        s = socket.create_connection(("127.0.0.1", gw.port), timeout=20)
        got = b""
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            got = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            pass
        s.close()
        check(got == b"", "a third connection from one address was answered: %r" % got[:200])
        held.pop().close()
        time.sleep(0.3)
        st, _, _ = gw.http("GET", "/health")
        check(st in (200, 503), "no answer with one connection held: %s" % st)
        for h in held:
            h.close()
        log("framing: 11 connections for 200 open files; /v1/embeddings 401 without the key; "
            "CL+TE and two Content-Lengths 400, connection closed; a third connection from "
            "one address closed at gateway_max_conns_per_ip = 2")
    finally:
        p.terminate()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        err.close()
        shutil.rmtree(d, ignore_errors=True)


class ScriptedSched(threading.Thread):
    """A stand-in scheduler (DSV4C1 on a ROUTER, docs/protocol.md §4; pyzmq
    and msgpack) whose answers the prompt text scripts, for what the real set
    cannot be made to do on cue:

      "quiet:MS:TEXT"  OK, then nothing for MS ms (a queue wait, a long
                       prefill), then TEXT as one TOKENS and DONE "length"
      "late:CODE"      OK, TOKENS "x", ERROR CODE: a failure after acceptance
      "busy"           ERROR 300 and no OK: a refusal

    A request of token ids (chat) is answered with .parts: each text one
    TOKENS event (its bytes as the ids), then DONE "length".

    CANCEL ends a live request with DONE "cancelled" (counted in .cancels);
    HEARTBEAT is answered (libdsv4client pings a quiet server)."""

    SIG = b"DSV4C1"
    GENERATE, OK, ERROR, TOKENS, DONE, CANCEL, HEARTBEAT = range(1, 8)

    def __init__(self, endpoint):
        super().__init__(daemon=True)
        import msgpack
        import zmq
        self.msgpack = msgpack
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.due = []          # [when, route, id, req, text] of quiet requests
        self.cancels = 0
        self.next_req = 0
        self.parts = ["x"]
        self.stopping = False

    def send(self, route, cmd, body):
        self.sock.send_multipart([route, b"", self.SIG, bytes([cmd]),
                                  self.msgpack.packb(body, use_bin_type=True)])

    def finish(self, route, rid, req, text, finish):
        if text:
            self.send(route, self.TOKENS, {"id": rid, "req": req,
                                           "tokens": list(text.encode()), "text": text})
        self.send(route, self.DONE, {"id": rid, "req": req, "finish": finish,
                                     "prompt_tokens": 1,
                                     "completion_tokens": len(text.encode())})

    def on_generate(self, route, b):
        rid, prompt = b["id"], b.get("prompt", "")
        if prompt == "busy":
            self.send(route, self.ERROR, {"id": rid, "code": 300, "message": "queue full"})
            return
        self.next_req += 1
        req = self.next_req
        self.send(route, self.OK, {"id": rid, "req": req, "seed": 1})
        if prompt.startswith("late:"):
            self.send(route, self.TOKENS, {"id": rid, "req": req, "tokens": [120], "text": "x"})
            self.send(route, self.ERROR, {"id": rid, "req": req, "code": int(prompt[5:]),
                                          "message": "scripted failure"})
        elif prompt.startswith("quiet:"):
            _, ms, text = prompt.split(":", 2)
            self.due.append([time.monotonic() + int(ms) / 1000, route, rid, req, text])
        elif not prompt:
            for t in self.parts:
                self.send(route, self.TOKENS, {"id": rid, "req": req,
                                               "tokens": list(t.encode()), "text": t})
            self.send(route, self.DONE, {"id": rid, "req": req, "finish": "length",
                                         "prompt_tokens": 1,
                                         "completion_tokens": len("".join(self.parts).encode())})
        else:
            self.finish(route, rid, req, prompt, "length")

    def run(self):
        while not self.stopping:
            if self.sock.poll(10):
                f = self.sock.recv_multipart()
                cmd, body = f[3][0], self.msgpack.unpackb(f[4], raw=False)
                if cmd == self.GENERATE:
                    self.on_generate(f[0], body)
                elif cmd == self.HEARTBEAT:
                    self.send(f[0], self.HEARTBEAT, {})
                elif cmd == self.CANCEL:
                    for d in [d for d in self.due if d[1] == f[0] and d[2] == body["id"]]:
                        self.due.remove(d)
                        self.cancels += 1
                        self.finish(d[1], d[2], d[3], "", "cancelled")
            now = time.monotonic()
            for d in [d for d in self.due if d[0] <= now]:
                self.due.remove(d)
                self.finish(d[1], d[2], d[3], d[4], "length")
        self.sock.close()
        self.ctx.term()

    def stop(self):
        self.stopping = True
        self.join(10)


def raw_request(port, raw, half_close=False):
    """Send the bytes of one HTTP request on a new socket (then shut down
    its sending side when half_close); returns (status, headers, body bytes)
    of the answer read until the gateway closes (chunks joined), or None
    when the connection ended without one."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(raw)
    if half_close:
        s.shutdown(socket.SHUT_WR)
    got = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        got += b
    s.close()
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    hdr = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    if hdr.get("transfer-encoding") == "chunked":
        out = b""
        while True:
            size, _, rest = body.partition(b"\r\n")
            n = int(size, 16) if size else 0
            if n == 0:
                break
            out, body = out + rest[:n], rest[n + 2:]
        body = out
    return int(lines[0].split()[1]), hdr, body


def post_bytes(path, body, close=True):
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n" % (path.encode(), len(data),
                                              b"Connection: close\r\n" if close else b"") + data)


def doc_error_codes():
    """The `code`s of docs/gateway.md's error table."""
    with open(os.path.join(ARGS.src, "docs/gateway.md")) as f:
        text = f.read()
    section = text.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    table = [b for b in section.split("\n\n") if b.startswith("| HTTP |")][0]
    return {c for row in table.splitlines() if row.startswith("| ")
            for c in re.findall(r"`([a-z_]+)`", row.rsplit("|", 2)[1])}


def sc_scripted():
    """A gateway alone against ScriptedSched, gateway_idle_s 1: a stream
    whose first token comes after 3.5 idle timeouts ends with its tokens
    and [DONE] (": keep-alive" comments between), not with EOF; a client
    that half-closes after its request is cancelled at its FIN; a
    quiet stream whose client closes, and a non-streamed request whose
    client resets, are cancelled at the scheduler; an error after acceptance
    has the same status type and code streamed or not (504 timeout_error,
    429 slow_consumer) and counts as "error", a refusal before it as
    "rejected"; error bodies are UTF-8 JSON when the URL is not; 405 names
    the methods (Allow); every error code answered is in docs/gateway.md."""
    need_pyzmq()
    d = tempfile.mkdtemp(prefix="dsv4-gw-scripted-")
    sched = ScriptedSched("ipc://%s/client.sock" % d)
    sched.start()
    gw = BareGateway(free_port())
    p, err = start_bare(d, gw, "gateway_idle_s = 1\n")
    codes = set()

    def err_of(st, data, want_status, want_code=None):
        e = error_of(st, data, want_status, want_code)
        codes.add(e["code"])
        return e

    try:
        # A stream quiet for longer than gateway_idle_s: kept open by SSE
        # comments (the stream used to be cut: 200, then EOF, no [DONE]).
        r = raw_request(gw.port, post_bytes("/v1/completions", {
            "prompt": "quiet:3500:hello", "stream": True}))
        check(r is not None and r[0] == 200, "quiet stream: %s" % (r,))
        ev = sse_events(r[2])
        check(ev and ev[-1] == "[DONE]", "quiet stream cut before [DONE]: %r" % r[2][-300:])
        text = "".join(json.loads(e)["choices"][0]["text"] for e in ev[:-1])
        check(text == "hello", "quiet stream text %r" % text)
        check(b"\n: keep-alive\n\n" in b"\n" + r[2], "no keep-alive comment: %r" % r[2][:300])
        log("a stream quiet for 3.5 x gateway_idle_s: %d keep-alives, then its tokens and "
            "[DONE]" % r[2].count(b": keep-alive"))

        # A client trickling its headers (a line every 0.4 s, never idle for
        # gateway_idle_s) is cut once its request has been arriving for
        # gateway_idle_s; it used to keep its connection slot for good.
        t = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
        t.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        t0, closed = time.time(), False
        while time.time() - t0 < 8 and not closed:
            time.sleep(0.4)
            try:
                t.sendall(b"X-Trickle: 1\r\n")
                t.settimeout(0.01)
                try:
                    closed = t.recv(1) == b""
                except socket.timeout:
                    pass
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        t.close()
        check(closed, "a trickling client kept its connection for 8 s (gateway_idle_s 1)")
        log("a client trickling its headers: cut after %.1f s (gateway_idle_s 1)" %
            (time.time() - t0))

        # Half-close after the request: the gateway cannot tell it from a
        # close, so the FIN cancels the request, streamed or not
        # (docs/gateway.md "Client disconnects").
        c0 = sched.cancels
        for stream in (True, False):
            r = raw_request(gw.port, post_bytes("/v1/completions", {
                "prompt": "quiet:1000:half", "stream": stream}), half_close=True)
            check(r is None or (stream and sse_events(r[2])[-1:] != ["[DONE]"]),
                  "half-closed client (stream %s): answered %s" % (stream, r))
        # cancelled, not merely unanswered (the requests end by themselves
        # after 1 s at the stand-in, without a CANCEL)
        wait_for(lambda: sched.cancels == c0 + 2, "the half-closed requests cancelled")
        log("a client that half-closes after its request is cancelled at its FIN")

        # A client that closes its socket during a quiet stream: the next
        # keep-alive finds it gone; one that resets while it waits for a
        # non-streamed answer is gone at once.  Both are cancelled.
        c0 = sched.cancels
        s = raw_conn(gw)
        s.sendall(post_bytes("/v1/completions", {"prompt": "quiet:60000:never",
                                                 "stream": True}))
        check(b" 200 " in s.recv(4096), "quiet stream did not start")
        s.close()
        wait_for(lambda: sched.cancels == c0 + 1, "the closed stream cancelled")
        s = raw_conn(gw)
        s.sendall(post_bytes("/v1/completions", {"prompt": "quiet:60000:never"}))
        wait_for(lambda: len(sched.due) == 1, "the request to wait")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        wait_for(lambda: sched.cancels == c0 + 2, "the reset request cancelled")
        log("a closed stream and a reset client: cancelled at the scheduler")

        # Thinking mode: </think> spelled over two events splits the answer
        # all the same (it went to reasoning_content whole); streamed, no
        # delta holds a piece of it, and a held start that no marker
        # follows is reasoning in the last chunk.
        for parts, want_r, want_c in ((["abc</th", "ink>ans", "wer"], "abc", "answer"),
                                      (["ab<", "/x", "y</thi"], "ab</xy</thi", ""),
                                      (["a</think>b", "c</think>"], "a", "bc</think>")):
            sched.parts = parts
            body = {"messages": [{"role": "user", "content": "hi"}], "thinking": True}
            st, _, data = gw.http("POST", "/v1/chat/completions", body)
            check(st == 200, "thinking %s: %d %s" % (parts, st, data[:300]))
            msg = json.loads(data)["choices"][0]["message"]
            check((msg.get("reasoning_content"), msg["content"]) == (want_r, want_c),
                  "thinking %s: %s" % (parts, msg))
            st, _, data = gw.http("POST", "/v1/chat/completions", dict(body, stream=True))
            ds = [json.loads(e)["choices"][0]["delta"] for e in sse_events(data)[:-1]]
            rs = [d["reasoning_content"] for d in ds if d.get("reasoning_content")]
            cs = [d["content"] for d in ds if d.get("content")]
            check(("".join(rs), "".join(cs)) == (want_r, want_c) and
                  not any(r.endswith(("</", "</th")) for r in rs[:-1]),
                  "thinking %s streamed: reasoning %s, content %s" % (parts, rs, cs))
        log("thinking mode: </think> over two events splits the answer, streamed or not")

        # Errors after acceptance: the same status, type and code streamed
        # (an error event after the first chunk) or not; counted "error".
        m0 = gw.metrics()
        for code, want_st, want_code in ((408, 504, "timeout"), (429, 429, "slow_consumer"),
                                         (503, 503, "out_of_memory")):
            st, _, data = gw.http("POST", "/v1/completions", {"prompt": "late:%d" % code})
            e = err_of(st, data, want_st, want_code)
            check(e["type"] == {504: "timeout_error", 429: "rate_limit_error",
                                503: "service_unavailable"}[want_st],
                  "%d: type %s" % (code, e["type"]))
            st, _, data = gw.http("POST", "/v1/completions", {"prompt": "late:%d" % code,
                                                              "stream": True})
            ev = sse_events(data)
            check(st == 200 and ev[-1] == "[DONE]", "late %d stream: %d %r" % (code, st, data))
            se = json.loads(ev[-2]).get("error")
            check(se is not None and (se["type"], se["code"]) == (e["type"], e["code"]),
                  "late %d: stream error %s, answer %s" % (code, se, e))
        st, _, data = gw.http("POST", "/v1/completions", {"prompt": "busy"})
        err_of(st, data, 429, "overloaded")
        m1 = gw.metrics()

        def delta(outcome):
            lab = {"outcome": outcome}
            return (metric(m1, "dsv4_gateway_requests_total", lab) -
                    metric(m0, "dsv4_gateway_requests_total", lab))
        check((delta("timeout"), delta("error"), delta("rejected")) == (2, 4, 1),
              "outcomes: timeout %s, error %s, rejected %s (want 2, 4, 1)" %
              (delta("timeout"), delta("error"), delta("rejected")))
        log("errors after acceptance: same type and code streamed or not, counted as error; "
            "a refusal as rejected")

        # Error bodies stay UTF-8 JSON whatever bytes the URL had.
        for path in ("/v1/models/%FF%C3", "/nowhere%ED%A0%80x"):
            st, _, data = gw.http("GET", path)
            try:
                msg = json.loads(data.decode("utf-8"))["error"]["message"]
            except (UnicodeDecodeError, ValueError) as e:
                raise Fail("GET %s: the error body is not UTF-8 JSON (%s): %r" % (path, e, data))
            check("\ufffd" in msg, "GET %s: %s" % (path, msg))
            err_of(st, data, 404)
        # 405 names the methods the route takes.
        for method, path, allow in (("GET", "/v1/completions", "POST"),
                                    ("PUT", "/v1/chat/completions", "POST"),
                                    ("POST", "/health", "GET, HEAD"),
                                    ("DELETE", "/v1/models", "GET, HEAD")):
            st, hdr, data = gw.http(method, path, b"{}")
            err_of(st, data, 405, "method_not_allowed")
            check(hdr.get("Allow") == allow, "%s %s: Allow %r, want %r" %
                  (method, path, hdr.get("Allow"), allow))
        st, _, data = gw.http("GET", "/health")
        err_of(st, data, 503)
        missing = codes - doc_error_codes()
        check(not missing, "error codes not in docs/gateway.md's table: %s" % sorted(missing))
        log("UTF-8 error bodies, Allow on 405, %d error codes all documented" % len(codes))
        check(not sched.due, "requests left at the scheduler: %s" % sched.due)
        wait_for(lambda: metric(gw.metrics(), "dsv4_gateway_streams_active") == 0,
                 "dsv4_gateway_streams_active 0")
        # SIGTERM with a generation in flight: no new connection is taken,
        # the stream ends with its tokens and [DONE] (it used to be cut at
        # once), then the gateway exits 0
        res = {}
        th = threading.Thread(target=lambda: res.update(r=raw_request(gw.port, post_bytes(
            "/v1/completions", {"prompt": "quiet:5000:bye", "stream": True}))))
        th.start()
        wait_for(lambda: metric(gw.metrics(), "dsv4_gateway_streams_active") == 1,
                 "a stream in flight")
        p.terminate()
        wait_for(lambda: "gw_finish: waiting for 1 generations" in
                 svc_test.readf(os.path.join(d, "gateway.err")), "the gateway waiting")
        try:
            s = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
            s.close()
            raise Fail("a connection was taken after SIGTERM")
        except OSError:
            pass
        th.join(60)
        r = res.get("r")
        check(r is not None and r[0] == 200, "the stream across SIGTERM: %s" % (r,))
        ev = sse_events(r[2])
        check(ev and ev[-1] == "[DONE]" and
              "".join(json.loads(e)["choices"][0]["text"] for e in ev[:-1]) == "bye",
              "the stream across SIGTERM was cut: %r" % r[2][-300:])
        check(p.wait(60) == 0, "the gateway's exit status %s" % p.returncode)
        log("SIGTERM: no new connection, the stream in flight ended with [DONE], exit 0")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        err.close()
        sched.stop()
        shutil.rmtree(d, ignore_errors=True)
    framing_keys_fds()


# Values of every JSON type, and of the shapes the gateway looks into.
ODD_VALUES = [None, True, 0, -1, 2.5, 1e300, 2 ** 63, "", "x", "text", [], [None], [1],
              ["x"], {}, {"type": None}, {"type": "text"}, {"type": 5}]
COMMON_KEYS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
               "top_k", "seed", "stop", "stream", "stream_options", "return_token_ids",
               "logprobs", "n", "presence_penalty", "frequency_penalty", "suffix",
               "tools", "functions", "tool_choice", "function_call", "logit_bias",
               "best_of", "response_format", "audio", "prediction", "modalities",
               "user", "unknown_key"]

# The JSON type each typed field takes besides null (docs/gateway.md); a value
# of any other type must be refused (400).  "logprobs" is a number on
# /v1/completions and a bool on chat.
FIELD_KINDS = {"model": "string", "max_tokens": "number", "max_completion_tokens": "number",
               "temperature": "number", "top_p": "number", "top_k": "number",
               "seed": "number", "n": "number", "presence_penalty": "number",
               "frequency_penalty": "number", "top_logprobs": "number",
               "best_of": "number", "stream": "bool", "return_token_ids": "bool",
               "thinking": "bool", "echo": "bool", "stream_options": "object",
               "chat_template_kwargs": "object", "response_format": "object",
               "logit_bias": "object", "reasoning_effort": "string",
               "messages": "array"}


def json_kind(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(v)]


def wrong_kind(path, key, v):
    """Whether v is of a type that `key` never takes."""
    kind = FIELD_KINDS.get(key)
    if key == "logprobs":
        kind = "bool" if path == "/v1/chat/completions" else "number"
    elif key == "stop":
        return json_kind(v) not in ("null", "string", "array")
    elif key == "prompt":
        return json_kind(v) not in ("string", "array")
    return kind is not None and json_kind(v) not in ("null", kind)


def prompt_ok(p):
    """docs/gateway.md's prompt: a non-empty string, a non-empty array of token
    ids (the test model's 129,280), or a one-element array holding one of
    those."""
    def ids(x):
        return (isinstance(x, list) and x and
                all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 129280
                    for i in x))
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    return (isinstance(p, str) and p != "") or ids(p)


def odd_bodies():
    """(path, body, must_refuse) triples: each key of both routes set to each
    of ODD_VALUES (must_refuse "type" when the value's type is wrong for the key),
    then the same values inside messages, content parts and prompts."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    comp = {"prompt": "x", "max_tokens": 1}
    out = []
    for v in ODD_VALUES:
        for path, base, keys in [
                ("/v1/chat/completions", chat, COMMON_KEYS + [
                    "messages", "thinking", "chat_template_kwargs", "reasoning_effort",
                    "top_logprobs"]),
                ("/v1/completions", comp, COMMON_KEYS + ["prompt", "echo"])]:
            for k in keys:
                b = dict(base)
                if k == "max_tokens":
                    b["max_completion_tokens"] = 1   # null: not the default 256
                b[k] = v
                # ("type": refused as a value of a type the field never takes)
                out.append((path, b, "type" if wrong_kind(path, k, v) else False))
        k = json_kind(v)
        for msgs, refuse in (
                ([v], k != "object"),
                ([{"role": v, "content": "x"}], True),
                ([{"role": "user", "content": v}], k not in ("null", "string", "array")),
                ([{"role": "user", "content": [v]}], True),
                ([{"role": "user", "content": [{"type": v, "text": "x"}]}], v != "text"),
                ([{"role": "user", "content": [{"type": "text", "text": v}]}], k != "string"),
                ([{"role": "assistant", "content": "x", "reasoning_content": v},
                  {"role": "user", "content": "y"}], k not in ("null", "string"))):
            out.append(("/v1/chat/completions", dict(chat, messages=msgs), refuse))
        for prompt in ([v], [[v]], [1, v]):
            out.append(("/v1/completions", dict(comp, prompt=prompt), not prompt_ok(prompt)))
        out.append(("/v1/chat/completions", dict(chat, stream=True,
                                                 stream_options={"include_usage": v}),
                    k not in ("null", "bool")))
        out.append(("/v1/chat/completions", dict(chat, chat_template_kwargs={"thinking": v}),
                    k not in ("null", "bool")))
        out.append(("/v1/chat/completions", dict(chat, response_format={"type": v}),
                    v != "text"))
        out.append(("/v1/completions", dict(comp, stop=[v]), k != "string" or v == ""))
    return out


def sc_types():
    svc = GwService()
    try:
        bodies = odd_bodies()
        n_ok = 0
        for path, body, must_refuse in bodies:
            text = json.dumps(body)
            try:
                st, _, data = svc.http("POST", path, text, timeout=60)
            except (OSError, http.client.HTTPException) as e:
                raise Fail("%s %s: no answer (%r); the gateway's log:\n%s" %
                           (path, text, e, svc.errlog()))
            check(not (must_refuse and st == 200), "%s %s: accepted a value of the wrong "
                  "type" % (path, text))
            if st == 200:
                n_ok += 1
                check(data, "%s %s: 200 with an empty body" % (path, text))
                if body.get("stream") is not True:
                    json.loads(data)
            else:
                check(st in (400, 404), "%s %s: status %d: %s" % (path, text, st, data[:300]))
                e = error_of(st, data, st)
                # (docs/gateway.md: a value of a type the field never takes)
                want = {"invalid_type", "unsupported_parameter", "model_not_found"}
                if body.get("prompt", "") is None or body.get("messages", []) is None:
                    want.add("invalid_request")   # (null: missing)
                check(must_refuse != "type" or e["code"] in want,
                      "%s %s: code %s for a value of the wrong type" % (path, text, e["code"]))
        log("%d requests with values of every JSON type in every field: %d answered 200, "
            "%d refused with an OpenAI error (%d of them of a wrong type), the gateway "
            "never stopped" % (len(bodies), n_ok, len(bodies) - n_ok,
                               sum(1 for b in bodies if b[2])))
        svc.check_no_leaks()
        st, _, data = svc.http("POST", "/v1/completions", {"prompt": "still there?",
                                                           "max_tokens": 4})
        check(st == 200 and json.loads(data)["usage"]["completion_tokens"] >= 1,
              "gateway stopped serving: %d %s" % (st, data[:200]))
    finally:
        svc.stop()


def overload():
    """A scheduler without ranks, queue_max 1, gateway_timeout_ms 1000: a
    first request waits in the queue until its deadline (504); one sent
    while it waits finds the queue full (429); /health says why it is 503."""
    svc = GwService("queue_max = 1\ngateway_timeout_ms = 1000", ranks=False)
    try:
        st, _, data = svc.http("GET", "/health")
        e = error_of(st, data, 503)
        check("decode" in e["message"], "health reason: %s" % e["message"])
        check(metric(svc.metrics(), "dsv4_serving") == 0, "dsv4_serving is not 0")
        first = {}

        def run_first():
            first["r"] = svc.http("POST", "/v1/completions", {"prompt": "wait", "max_tokens": 4})
        t = threading.Thread(target=run_first)
        t.start()
        wait_for(lambda: svc.admin.status()["n_queued"] == 1 or "r" in first,
                 "the first request queued")
        check("r" not in first, "the first request ended before the second was sent: %s" %
              (first.get("r"),))
        st, _, data = svc.http("POST", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "x"}], "stream": True})
        error_of(st, data, 429, "overloaded")
        t.join(120)
        st, _, data = first["r"]
        error_of(st, data, 504, "timeout")
        m = svc.metrics()
        check(metric(m, "dsv4_gateway_requests_total", {"outcome": "timeout"}) == 1 and
              metric(m, "dsv4_gateway_requests_total", {"outcome": "rejected"}) == 1,
              "outcome counters after 504/429")
        log("overload: 429 (queue full), 504 (deadline), /health 503 (no decode group)")
        svc.check_no_leaks()
    finally:
        svc.stop()


def sc_prometheus():
    prom = need_prometheus()
    # decode@0 counts 2 kinds of step without a CUDA graph (test only: the
    # cpu backend has none)
    svc = GwService(env={"DSV4_TEST_GRAPHS_REFUSED": "decode@0:2"})
    pdir = tempfile.mkdtemp(prefix="dsv4-prom-")
    pproc = None
    try:
        n_req = 5
        n_out = 0   # the tokens the requests got (sampled: one may stop before max_tokens)
        for i in range(n_req):
            st, _, data = svc.http("POST", "/v1/completions",
                                   {"prompt": "request %d" % i, "max_tokens": 3 + i})
            check(st == 200, "request %d: %d %s" % (i, st, data[:200]))
            usage = json.loads(data)["usage"]
            check(1 <= usage["completion_tokens"] <= 3 + i, "request %d usage: %s" % (i, usage))
            n_out += usage["completion_tokens"]
        st, _, _ = svc.http("POST", "/v1/completions", "{broken")
        check(st == 400, "broken body answered %d" % st)
        pport = free_port()
        with open(os.path.join(pdir, "prometheus.yml"), "w") as f:
            f.write("""global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: dsv4
    static_configs:
      - targets: ['127.0.0.1:%d']
""" % svc.port)
        plog = open(os.path.join(pdir, "prometheus.log"), "w")
        pproc = subprocess.Popen([prom, "--config.file=" + os.path.join(pdir, "prometheus.yml"),
                                  "--storage.tsdb.path=" + os.path.join(pdir, "data"),
                                  "--web.listen-address=127.0.0.1:%d" % pport],
                                 stdout=plog, stderr=plog)

        def query(q):
            url = "http://127.0.0.1:%d/api/v1/query?%s" % (pport, urllib.parse.urlencode(
                {"query": q}))
            try:
                with urllib.request.urlopen(url, timeout=10) as r:
                    doc = json.loads(r.read())
            except OSError:
                check(pproc.poll() is None, "prometheus exited")
                return None
            check(doc["status"] == "success", "PromQL error: %s" % doc)
            return doc["data"]["result"]

        q = 'sum(dsv4_gateway_requests_total{job="dsv4",outcome=~"stop|length"})'
        res = wait_for(lambda: (lambda r: r if r and float(r[0]["value"][1]) == n_req
                                else None)(query(q)), "PromQL %s == %d" % (q, n_req))
        log("PromQL %s = %s" % (q, res[0]["value"][1]))
        up = query('up{job="dsv4"}')
        check(up and up[0]["value"][1] == "1", "prometheus target not up: %s" % up)
        rej = wait_for(lambda: query('dsv4_gateway_requests_total{outcome="rejected"}'),
                       "rejected counter")
        check(float(rej[0]["value"][1]) == 1, "rejected = %s" % rej)
        done = query('dsv4_requests_total{outcome="done"}')
        check(done and float(done[0]["value"][1]) == n_req, "scheduler done = %s" % done)

        # dsv4ctl status and /metrics agree (idle set: nothing changes).
        svc.check_no_leaks()
        r = subprocess.run([exe("tools/dsv4ctl/dsv4ctl"), "--admin", svc.admin_ep, "--json",
                            "status"], capture_output=True, text=True, timeout=30)
        check(r.returncode == 0, "dsv4ctl: %s" % r.stderr)
        ctl = json.loads(r.stdout)
        m = svc.metrics()
        pairs = [("n_done", "dsv4_requests_total", {"outcome": "done"}),
                 ("n_failed", "dsv4_requests_total", {"outcome": "failed"}),
                 ("n_cancelled", "dsv4_requests_total", {"outcome": "cancelled"}),
                 ("n_rejected", "dsv4_requests_total", {"outcome": "rejected"}),
                 ("n_queued", "dsv4_queue_length", None),
                 ("n_running", "dsv4_requests_running", None),
                 ("tokens_in", "dsv4_prompt_tokens_total", None),
                 ("tokens_out", "dsv4_generated_tokens_total", None),
                 ("handoffs", "dsv4_handoffs_total", None),
                 ("reruns", "dsv4_reruns_total", None),
                 ("rank_deaths", "dsv4_rank_deaths_total", None),
                 ("handoff_count", "dsv4_handoff_seconds_count", None),
                 ("n_ranks_ready", "dsv4_ranks", {"state": "ready"})]
        for key, name, labels in pairs:
            check(metric(m, name, labels) == ctl[key], "%s: dsv4ctl %s, /metrics %s" %
                  (key, ctl[key], metric(m, name, labels)))
        check(ctl["n_done"] == n_req and ctl["tokens_out"] == n_out,
              "scheduler counters: %s" % ctl)
        # The scheduler timed every handoff of the run (PREFILL_DONE -> KV_RELEASE).
        check(ctl["handoff_count"] > 0 and
              metric(m, "dsv4_handoff_seconds_bucket", {"le": "+Inf"}) == ctl["handoff_count"]
              and len(ctl["handoff_buckets"]) == 14 and
              metric(m, "dsv4_handoff_seconds_bucket", {"le": "10"}) == ctl["handoff_buckets"][-1],
              "handoff histogram: dsv4ctl %s, /metrics count %s" %
              (ctl.get("handoff_count"), metric(m, "dsv4_handoff_seconds_count")))
        check(abs(metric(m, "dsv4_handoff_seconds_sum") - ctl["handoff_sum_us"] / 1e6) <=
              1e-8 * max(1.0, ctl["handoff_sum_us"] / 1e6),
              "handoff sum: dsv4ctl %s us, /metrics %s s" %
              (ctl["handoff_sum_us"], metric(m, "dsv4_handoff_seconds_sum")))
        check(metric(m, "dsv4_gateway_completion_tokens_total") == ctl["tokens_out"],
              "gateway usage total != scheduler tokens_out")
        check(metric(m, "dsv4_gateway_ttft_seconds_count") == n_req,
              "ttft histogram count %s" % metric(m, "dsv4_gateway_ttft_seconds_count"))
        check(metric(m, "dsv4_rank_up", {"rank": "decode@0"}) == 1 and
              metric(m, "dsv4_decode_group_streams", {"group": "0"}) == 0,
              "rank/group metrics missing")
        # every prefill rank's rows per call (READY call_rows), none for decode
        r = subprocess.run([exe("tools/dsv4ctl/dsv4ctl"), "--admin", svc.admin_ep, "--json",
                            "ranks"], capture_output=True, text=True, timeout=30)
        check(r.returncode == 0, "dsv4ctl: %s" % r.stderr)
        for k in json.loads(r.stdout):
            lab = {"rank": k["name"]}
            got = (metric(m, "dsv4_prefill_call_rows", lab),
                   metric(m, "dsv4_prefill_call_rows_full", lab))
            want = ((k["call_rows"], k["call_rows_full"]) if k["role"] == "prefill"
                    else (None, None))
            check(got == want and (k["role"] != "prefill" or want[0] > 0),
                  "%s: dsv4ctl call rows %s, /metrics %s" % (k["name"], want, got))
            # and every decode rank's kinds of step without a graph
            got = metric(m, "dsv4_decode_graphs_refused", lab)
            want = 2 if k["name"] == "decode@0" else None
            check(got == want and k.get("graphs_refused") == want,
                  "%s: graphs refused: dsv4ctl %s, /metrics %s, not %s" %
                  (k["name"], k.get("graphs_refused"), got, want))
        log("dsv4ctl status and /metrics agree on %d values" % len(pairs))
    finally:
        if pproc is not None:
            pproc.terminate()
            try:
                pproc.wait(30)
            except subprocess.TimeoutExpired:
                pproc.kill()
        svc.stop()
        shutil.rmtree(pdir, ignore_errors=True)


SCENARIOS = {"api": sc_api, "robust": sc_robust, "types": sc_types,
             "prometheus": sc_prometheus, "scripted": sc_scripted}


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--build", required=True)
    ap.add_argument("--src", default=os.path.dirname(os.path.dirname(HERE)))
    ARGS = ap.parse_args()
    svc_test.ARGS = ARGS
    if shutil.which("curl") is None:
        skip("curl is not installed")
    t0 = time.monotonic()
    try:
        SCENARIOS[ARGS.scenario]()
    except Fail as e:
        log("FAIL %s: %s" % (ARGS.scenario, e))
        return 1
    log("PASS %s (%.1f s)" % (ARGS.scenario, time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
