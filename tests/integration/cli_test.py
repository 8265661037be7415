#!/usr/bin/env python3
"""cli_test.py — the command line of every dsv4 program (common/cli.h).

  cli_test.py --build BUILD_DIR --src SRC_DIR --version VERSION

1. The contract, for each of the ten programs: `--help` and `-h` print the
   usage ("usage: NAME ...") on stdout and exit 0 with nothing on stderr;
   `--version` prints "NAME VERSION" (meson's project version) and exits 0;
   an unknown option exits 2 with the synopsis and a pointer to --help on
   stderr and nothing on stdout.
2. Odd values: every option that takes a value (read from the program's own
   --help) is given, in turn, values an operator or a script may pass by
   mistake: empty, negative, zero, a word, a number beyond 64 bits, "nan",
   5,000 characters, a path whose parent is a file.  Each run must end by
   itself in 0, 1 or 2 (the daemons also 6, a configuration fault), with
   a message on stderr when it is not 0, and without a signal or a
   sanitizer report (the ASan+UBSan build runs this too).  The daemons run
   with -n (check only); dsv4ctl, dsv4-generate and dsv4-bench talk to a
   real service set on a tiny checkpoint, so a value that is accepted does
   real work; dsv4-launch runs the scheduler alone (-P 0 -D 0) and `true`
   once it is ready.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import svc_test  # noqa: E402  (Service, Fail, check)
from svc_test import Fail, check  # noqa: E402

PROGRAMS = {
    "dsv4-sched": "daemons/sched/dsv4-sched",
    "dsv4-prefill": "daemons/rank/dsv4-prefill",
    "dsv4-decode": "daemons/rank/dsv4-decode",
    "dsv4-gateway": "daemons/gateway/dsv4-gateway",
    "dsv4ctl": "tools/dsv4ctl/dsv4ctl",
    "dsv4-launch": "tools/launch/dsv4-launch",
    "dsv4-generate": "tools/generate/dsv4-generate",
    "dsv4-bench": "tools/bench/dsv4-bench",
    "dsv4-mkmodel": "tools/mkmodel/dsv4-mkmodel",
    "dsv4-tokenize": "tools/tokenize/dsv4-tokenize",
}
# the programs that exit DSV4_EXIT_CONFIG (6) for a configuration fault
DAEMONS = ("dsv4-sched", "dsv4-prefill", "dsv4-decode", "dsv4-gateway", "dsv4-launch")

# The last one is a path no program can create, root included: its parent
# is a regular file of the scratch directory (main() fills it in).
ODD_VALUES = ["", "-1", "0", "abc", "99999999999999999999", "nan", "x" * 5000, None]
SANITIZER = re.compile(r"Sanitizer|runtime error:")
RUN_TIMEOUT_S = 60
FIFO_TIMEOUT_S = 20     # a checkpoint with a FIFO: an answer at once, not a hang


def log(*a):
    print("cli_test:", *a, flush=True)


def run(argv, stdin=b"", cwd=None, timeout=RUN_TIMEOUT_S):
    """(returncode, stdout, stderr); a run past `timeout` is a failure."""
    env = dict(os.environ)
    # A sanitizer report must show as a signal, not as exit status 1.
    for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
        env[k] = (env.get(k, "") + ":abort_on_error=1").lstrip(":")
    try:
        r = subprocess.run(argv, input=stdin, capture_output=True, cwd=cwd, env=env,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Fail("%s: still running after %d s" % (short(argv), timeout))
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


def short(argv):
    return " ".join(a if len(a) < 40 else a[:20] + "...(%d chars)" % len(a) for a in argv)


def contract(name, path, version):
    for flag in ("--help", "-h"):
        rc, out, err = run([path, flag])
        check(rc == 0, "%s %s: exit %d, want 0; stderr: %s" % (name, flag, rc, err[:300]))
        check(out.startswith("usage: %s " % name) and out.count("\n") >= 3,
              "%s %s: stdout is not its usage: %r" % (name, flag, out[:300]))
        check(err == "", "%s %s: stderr not empty: %r" % (name, flag, err[:300]))
        check("--version" in out, "%s %s: --version is not listed" % (name, flag))
    rc, out, err = run([path, "--version"])
    check(rc == 0 and out == "%s %s\n" % (name, version) and err == "",
          "%s --version: exit %d, stdout %r, stderr %r" % (name, rc, out, err[:300]))
    rc, out, err = run([path, "--no-such-option"])
    check(rc == 2, "%s --no-such-option: exit %d, want 2" % (name, rc))
    check(out == "", "%s --no-such-option: stdout not empty: %r" % (name, out[:300]))
    check(("usage: %s " % name) in err and "--help" in err,
          "%s --no-such-option: stderr lacks the synopsis and --help: %r" % (name, err[:300]))


def value_options(help_text):
    """The options of a usage text that take a value: an option followed by
    a placeholder (starting with a capital, or holding '|', as
    "--backend cpu|cuda").  "-x, --long V" counts once (as --long)."""
    opts = []
    alias = dict(re.findall(r"(?<![\w-])(-[A-Za-z]), (--[\w-]+)", help_text))
    for line in help_text.splitlines():
        for m in re.finditer(r"(?<![\w-])(--?[A-Za-z][\w-]*)(?:,\s+(--[\w-]+))?"
                             r"[ =]([A-Z][\w.:=|-]*|[a-z]+\|[\w|]+)", line):
            o = m.group(2) or alias.get(m.group(1), m.group(1))
            if o not in opts:
                opts.append(o)
    return opts


class Case:
    """How to run one program: fixed arguments before the swept option, after
    it, the standard input and the working directory (a scratch one: an
    accepted value may name a file to write)."""

    def __init__(self, cwd, head=(), tail=(), stdin=b""):
        self.head, self.tail, self.stdin, self.cwd = list(head), list(tail), stdin, cwd


def sweep(name, path, case):
    rc, help_text, _ = run([path, "--help"])
    opts = [o for o in value_options(help_text) if o not in ("-h", "--help", "--version")]
    check(opts, "%s: no option with a value found in its --help" % name)
    # The fixed arguments themselves must work.
    rc, out, err = run([path] + case.head + case.tail, case.stdin, case.cwd)
    check(rc == 0, "%s: the fixed arguments fail (exit %d): %s\n%s" %
          (short([path] + case.head + case.tail), rc, out[-500:], err[-2000:]))
    n = 0
    codes = {}
    ok = (0, 1, 2, 6) if name in DAEMONS else (0, 1, 2)   # common/cli.h
    for o in opts:
        for v in ODD_VALUES:
            argv = [path] + case.head + [o, v] + case.tail
            rc, out, err = run(argv, case.stdin, case.cwd)
            n += 1
            codes[rc] = codes.get(rc, 0) + 1
            check(not SANITIZER.search(err), "%s: a sanitizer report:\n%s" %
                  (short(argv), err[-3000:]))
            check(rc in ok, "%s: exit %d (a negative status is a signal)\n%s" %
                  (short(argv), rc, err[-3000:]))
            check(rc == 0 or err.strip(), "%s: exit %d without a message on stderr" %
                  (short(argv), rc))
    log("%-14s %2d options x %d values: %d runs, exit %s" %
        (name, len(opts), len(ODD_VALUES), n,
         ", ".join("%d: %d" % kv for kv in sorted(codes.items()))))


def conf_checkpoint(conf):
    """The `checkpoint` of configuration file `conf`."""
    with open(conf) as f:
        for line in f:
            k, _, v = line.partition("=")
            if k.strip() == "checkpoint":
                return v.strip()
    return None


def short_context_checkpoint(conf, tmp):
    """A copy of the configuration's checkpoint (links to its shards) whose
    config.json says max_position_embeddings = 64."""
    src = conf_checkpoint(conf)
    d = os.path.join(tmp, "ctx64")
    os.mkdir(d)
    for n in os.listdir(src):
        if n != "config.json":
            os.symlink(os.path.join(src, n), os.path.join(d, n))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 64
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def fifo_checkpoints(conf, tmp):
    """Copies of the configuration's checkpoint (links to its files) with a
    FIFO in place of a shard, of the index, of config.json: [(dir, fifo)]."""
    src = conf_checkpoint(conf)
    names = sorted(os.listdir(src))
    shard = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")][0]
    out = []
    for sub, victim in (("fifo-shard", shard), ("fifo-index", "model.safetensors.index.json"),
                        ("fifo-config", "config.json")):
        d = os.path.join(tmp, sub)
        os.mkdir(d)
        for n in names:
            if n == victim:
                os.mkfifo(os.path.join(d, n))
            else:
                os.symlink(os.path.join(src, n), os.path.join(d, n))
        out.append((d, os.path.join(d, victim)))
    return out


def checks(paths, conf, tmp):
    """The daemons' -n finds what their start would refuse (docs/operations.md):
    exit status and message for each case."""
    sched, dec = paths["dsv4-sched"], paths["dsv4-decode"]
    cases = [
        ([sched, "-n", "-f", conf], 0, r"tokenizer .*\(274 ids\)\nconfiguration OK"),
        ([sched, "-n", "-f", conf, "-o", "client_endpoint=abc"], 6,
         r"client_endpoint: abc: not ipc://PATH"),
        ([sched, "-n", "-f", conf, "-o", "rank_endpoint=ipc://%s/no-dir/r.sock" % tmp], 6,
         r"rank_endpoint: .*no directory"),
        ([sched, "-n", "-f", conf, "-o", "admin_endpoint=ipc:///" + "d" * 120], 6,
         r"longer than 107 bytes"),
        ([sched, "-n", "-f", conf, "-o", "rank_endpoint=tcp://127.0.0.1:99999"], 6,
         r"port is not a number of 1 \.\.\. 65535"),
        ([sched, "-n", "-f", conf, "-o", "rank_endpoint=tcp://127.0.0.1:5555",
          "-o", "key_dir=%s" % tmp], 6, r"CURVE key .*server\.key"),
        ([sched, "-n", "-f", conf, "-o", "tokenizer=%s/none.json" % tmp], 6, r"tokenizer"),
        ([dec, "-n", "-f", conf], 0, r"checkpoint .*: \d+ layers.*\nconfiguration OK"),
        ([dec, "-n", "-f", conf, "--checkpoint", tmp + "/nothing"], 6, r"checkpoint .*nothing"),
        ([dec, "-n", "-f", conf, "--sched", "tcp://*:5555"], 6, r"no host to connect to"),
        # one TOKENS message holds a step: 2 tokens a stream with MTP
        ([dec, "-n", "-f", conf, "-o", "mtp=yes", "--slots", "513"], 6,
         r"513 slots; 1\.\.512 supported with mtp = yes"),
        ([dec, "-n", "-f", conf, "-o", "mtp=yes", "--slots", "512"], 0, r"configuration OK"),
        ([dec, "-n", "-f", conf, "-o", "backend=cpu", "--synthetic-weights", "1", "--preset",
          "tiny"], 6, r"--synthetic-weights needs the cuda backend"),
        # a handoff carries at most 16 parts of the decode state
        ([paths["dsv4-prefill"], "-n", "-f", conf, "-o", "group_size=17"], 6,
         r"group_size 17; 1\.\.16 supported for prefill groups"),
        # a group the model does not divide (the tiny model: 4 heads, 2
        # output groups, 8 experts), as the start's shard of the weights
        ([dec, "-n", "-f", conf, "-o", "group_size=3"], 6,
         r"rank 0 of a group of 3: shard: 3 ranks do not divide the heads"),
        ([dec, "-n", "-f", conf, "-o", "group_size=2"], 0,
         r"group of 2, split ep\nconfiguration OK"),
    ]
    # a context past the model's (max_position_embeddings): refused, not
    # served with positions its RoPE was not made for
    ctx64 = short_context_checkpoint(conf, tmp)
    cases += [
        ([dec, "-n", "-f", conf, "--checkpoint", ctx64, "--max-seq", "65"], 6,
         r"max_seq 65 is past the model's context \(max_position_embeddings 64"),
        ([dec, "-n", "-f", conf, "--checkpoint", ctx64, "--max-seq", "64"], 0,
         r"configuration OK"),
    ]
    # backend faults the start exited 1 on (restarted to the start limit)
    # and -n passed: a comm the backend cannot use, kv_cudaipc = yes off
    # cuda
    cases += [
        ([dec, "-n", "-f", conf, "-o", "backend=cpu", "-o", "comm=nccl", "-o", "group_size=2"],
         6, r"comm: .*nccl"),
        ([dec, "-n", "-f", conf, "-o", "backend=cpu", "-o", "kv_cudaipc=yes"], 6,
         r"kv_cudaipc = yes needs the cuda backend"),
    ]
    # a FIFO in place of a shard, the index or config.json: refused at once
    # as not a regular file (it blocked the load for ever)
    for d, fifo in fifo_checkpoints(conf, tmp):
        cases.append(([dec, "-n", "-f", conf, "--checkpoint", d], 6,
                      re.escape(fifo) + r": not a regular file \(a FIFO\)"))
    for argv, want, pat in cases:
        rc, out, err = run(argv, cwd=tmp, timeout=FIFO_TIMEOUT_S if "fifo-" in " ".join(argv)
                           else RUN_TIMEOUT_S)
        check(rc == want and re.search(pat, out + err),
              "%s: exit %d (want %d), /%s/ %s in:\n%s%s" %
              (short(argv), rc, want, pat, "found" if re.search(pat, out + err) else
               "not found", out[-1500:], err[-1500:]))
    log("-n of dsv4-sched and dsv4-decode: %d cases of what the start would refuse" %
        len(cases))
    # The default endpoints' directory, /run/dsv4, is made by the units'
    # RuntimeDirectory= at the start: -n on a host where the service has not
    # run since the boot notes it, not a failure.  Shown in a mount
    # namespace with an empty /run (skipped where unshare is refused).
    probe = run(["unshare", "-m", "sh", "-c", "mount -t tmpfs none /run"], cwd=tmp)
    if probe[0] == 0:
        rc, out, err = run(["unshare", "-m", "sh", "-c",
                            'mount -t tmpfs none /run && exec "$@"', "sh", sched, "-n", "-f",
                            conf, "-o", "client_endpoint=ipc:///run/dsv4/client.sock",
                            "-o", "admin_endpoint=ipc:///run/dsv4/ctl.sock",
                            "-o", "rank_endpoint=ipc:///run/dsv4/rank.sock"], cwd=tmp)
        check(rc == 0 and out.count("no directory /run/dsv4 now") == 3 and
              "configuration OK" in out,
              "-n without /run/dsv4: exit %d:\n%s%s" % (rc, out[-1500:], err[-1500:]))
        log("-n without /run/dsv4: noted, configuration OK")
    else:
        log("-n without /run/dsv4: not shown (unshare refused: %s)" % probe[2].strip()[-200:])
    # The start itself (no -n) ends with the same status for the same fault,
    # which the units' RestartPreventExitStatus= does not restart.
    gw = paths["dsv4-gateway"]
    starts = [
        ([sched, "-f", conf, "-o", "client_endpoint=abc"], r"client socket: abc"),
        ([sched, "-f", conf, "-o", "tokenizer=%s/none.json" % tmp], r"tokenizer"),
        ([sched, "-f", conf, "-o", "bogus=1"], r"unknown key"),
        ([dec, "-f", conf, "--checkpoint", tmp + "/nothing"], r"weights .*nothing"),
        ([dec, "-f", conf, "-o", "mtp=yes", "--slots", "1024"], r"1\.\.512 supported"),
        ([dec, "-f", conf, "-o", "group_size=3"], r"3 ranks do not divide the heads"),
        ([dec, "-f", conf, "--checkpoint", ctx64, "--max-seq", "65"], r"past the model's context"),
        # the scheduler's endpoint of no form (the start retried it every
        # second for ever), a comm the backend cannot use, kv_cudaipc = yes
        # off cuda (both exited 1)
        ([dec, "-f", conf, "-o", "rank_endpoint=bogus://x"], r"rank_endpoint: .*bogus"),
        ([dec, "-f", conf, "-o", "backend=cpu", "-o", "comm=nccl", "-o", "group_size=2"],
         r"comm: .*nccl"),
        ([dec, "-f", conf, "-o", "backend=cpu", "-o", "kv_cudaipc=yes"],
         r"kv_cudaipc = yes needs the cuda backend"),
        ([dec, "-f", conf, "-o", "backend=cpu", "--synthetic-weights", "1", "--preset",
          "tiny"], r"--synthetic-weights needs the cuda backend"),
        ([gw, "-f", conf, "-o", "tokenizer=%s/none.json" % tmp], r"tokenizer"),
        ([gw, "-f", conf, "-l", "127.0.0.1:notaport"], r"cannot be listened on"),
    ]
    # backend = cuda on a build without CUDA (-n says so): exit 6 as -n,
    # not 1, which systemd restarted for ever
    rc, out, err = run([dec, "-n", "-f", conf, "-o", "backend=cuda"], cwd=tmp)
    if "this build has no CUDA" in err:
        check(rc == 6, "-n with backend = cuda without CUDA: exit %d" % rc)
        starts.append(([dec, "-f", conf, "-o", "backend=cuda"], r"this build has no CUDA"))
    for argv, pat in starts:
        rc, out, err = run(argv, cwd=tmp)
        check(rc == 6 and re.search(pat, out + err),
              "%s: exit %d (want 6), /%s/ %s in:\n%s%s" %
              (short(argv), rc, pat, "found" if re.search(pat, out + err) else "not found",
               out[-1500:], err[-1500:]))
    log("starts refused for their configuration: %d cases, each exit 6" % len(starts))


def ctl_waits(paths, tmp):
    """dsv4ctl drain against a stand-in admin endpoint that takes the DRAIN
    and never answers: a limit under 1 ms goes out as 1 ms (not 0, which is
    none), and with no limit a scheduler that goes away (the stand-in
    closes its socket) ends the wait with exit 3 instead of never."""
    import msgpack
    import zmq
    ep = "ipc://%s/stand-in-admin.sock" % tmp
    for limit in ("0.0004", None):
        ctx = zmq.Context()
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(ep)
        argv = [paths["dsv4ctl"], "--admin", ep, "drain", "decode@0"]
        if limit is not None:
            argv += ["--timeout", limit]
        q = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            check(s.poll(RUN_TIMEOUT_S * 1000), "dsv4ctl sent no DRAIN")
            body = msgpack.unpackb(s.recv_multipart()[-1], raw=False)
            if limit is not None:
                check(body.get("timeout_ms") == 1, "--timeout %s sent %s" % (limit, body))
            else:
                time.sleep(0.2)
                s.close()
            out, err = q.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Fail("dsv4ctl drain (--timeout %s) still waiting after %d s" %
                       (limit, RUN_TIMEOUT_S))
        finally:
            if q.poll() is None:
                q.kill()
                q.communicate()
            s.close()
            ctx.term()
        want = "no answer" if limit is not None else "connection to the scheduler dropped"
        check(q.returncode == 3 and want in err,
              "dsv4ctl drain (--timeout %s): exit %d: %s" % (limit, q.returncode, err))
    log("dsv4ctl drain: a limit under 1 ms is 1 ms; a scheduler gone mid-wait ends it (3)")


def nobody_there(paths, tmp):
    """Against an admin endpoint nobody listens on: dsv4ctl drain without a
    limit ends with exit 3 (it waited for ever), and --json listings print
    nothing on stdout (they printed half an array, "[").  dsv4-launch
    refuses an abstract ipc://@NAME endpoint (it made a file "@NAME" no
    client found) with 6, and a command of more than 64 arguments (it ran
    with 64) with 2."""
    ep = "ipc://%s/nobody-admin.sock" % tmp
    try:
        r = subprocess.run([paths["dsv4ctl"], "--admin", ep, "drain", "all"],
                           capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Fail("dsv4ctl drain against nobody still waiting after %d s" % RUN_TIMEOUT_S)
    check(r.returncode == 3 and "no answer" in r.stderr,
          "dsv4ctl drain against nobody: exit %d: %s" % (r.returncode, r.stderr))
    # with a --timeout too: no connection is no answer then, not at the end
    # of the drain's limit (--timeout 600 waited 605 s, past this run's
    # RUN_TIMEOUT_S: a failure)
    try:
        r = subprocess.run([paths["dsv4ctl"], "--admin", ep, "drain", "all", "--timeout", "600"],
                           capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Fail("dsv4ctl drain --timeout 600 against nobody still waiting after %d s" %
                   RUN_TIMEOUT_S)
    check(r.returncode == 3 and "no connection" in r.stderr,
          "dsv4ctl drain --timeout 600 against nobody: exit %d: %s" % (r.returncode, r.stderr))
    # a socket that accepts and never greets (a listener a service manager
    # holds with no scheduler behind it): no connection either (it waited
    # for ever: the socket's connect was taken for the scheduler's)
    import socket
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    spath = os.path.join(tmp, "silent-admin.sock")
    silent.bind(spath)
    silent.listen(8)
    try:
        r = subprocess.run([paths["dsv4ctl"], "--admin", "ipc://" + spath, "drain", "all"],
                           capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Fail("dsv4ctl drain against a silent listener still waiting after %d s" %
                   RUN_TIMEOUT_S)
    finally:
        silent.close()
    check(r.returncode == 3 and "no connection" in r.stderr,
          "dsv4ctl drain against a silent listener: exit %d: %s" % (r.returncode, r.stderr))
    for what in ("ranks", "requests"):
        r = subprocess.run([paths["dsv4ctl"], "--json", "--admin", ep, what],
                           capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        check(r.returncode == 3 and r.stdout == "",
              "dsv4ctl --json %s against nobody: exit %d, stdout %r" %
              (what, r.returncode, r.stdout))
    launch = svc_test.exe("tools/launch/dsv4-launch")
    r = subprocess.run([launch, "-P", "0", "-D", "0", "-o",
                        "client_endpoint=ipc://@dsv4-cli-test-abstract", "--", "true"],
                       capture_output=True, text=True, cwd=tmp, timeout=RUN_TIMEOUT_S)
    check(r.returncode == 6 and "abstract" in r.stderr and
          not os.path.exists(os.path.join(tmp, "@dsv4-cli-test-abstract")),
          "dsv4-launch with an abstract endpoint: exit %d: %s" % (r.returncode, r.stderr[-300:]))
    r = subprocess.run([launch, "-P", "0", "-D", "0", "--", "sh", "-c", "exit 0", "sh"] +
                       [str(i) for i in range(100)], capture_output=True, text=True,
                       cwd=tmp, timeout=RUN_TIMEOUT_S)
    check(r.returncode == 2 and "at most 64" in r.stderr,
          "dsv4-launch with 104 command arguments: exit %d: %s" %
          (r.returncode, r.stderr[-300:]))
    log("nobody there: dsv4ctl drain exits 3, --json listings print nothing; dsv4-launch "
        "refuses an abstract endpoint (6) and a command of 104 arguments (2)")


def ctl_endpoint(paths, tmp):
    """dsv4ctl's endpoint and key: $DSV4_ADMIN_ENDPOINT (dsv4-launch sets it
    for its command) when --admin is absent, ahead of the file's
    admin_endpoint; a tcp:// endpoint's server key from the file's key_dir
    (it looked in /etc/dsv4 whatever the file said)."""
    import zmq
    ep = "ipc://%s/env-admin.sock" % tmp
    conf = os.path.join(tmp, "ctl-ep.conf")
    keys = os.path.join(tmp, "ctl-keys")
    os.makedirs(keys, exist_ok=True)
    r = subprocess.run([paths["dsv4ctl"], "keygen", keys], capture_output=True, text=True)
    check(r.returncode == 0, "dsv4ctl keygen: %s" % r.stderr)
    with open(conf, "w") as f:
        f.write("admin_endpoint = ipc://%s/nobody.sock\nkey_dir = %s\n" % (tmp, keys))
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(ep)
    env = dict(os.environ, DSV4_ADMIN_ENDPOINT=ep)
    q = subprocess.Popen([paths["dsv4ctl"], "-f", conf, "status"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        check(s.poll(RUN_TIMEOUT_S * 1000), "dsv4ctl did not use $DSV4_ADMIN_ENDPOINT")
    finally:
        q.kill()
        q.communicate()
        s.close()
        ctx.term()
    # tcp:// with the file's key_dir: it gets as far as waiting for an answer
    # (exit 3), not a missing /etc/dsv4/server.pub (exit 2)
    with open(conf, "w") as f:
        f.write("admin_endpoint = tcp://127.0.0.1:9\nkey_dir = %s\n" % keys)
    r = subprocess.run([paths["dsv4ctl"], "-f", conf, "status"], capture_output=True,
                       text=True, timeout=RUN_TIMEOUT_S)
    check(r.returncode == 3 and "server.pub" not in r.stderr,
          "dsv4ctl with key_dir %s: exit %d: %s" % (keys, r.returncode, r.stderr))
    # a CURVE scheduler whose key is not key_dir's server.pub: the
    # handshake fails, which dsv4ctl says (it said "the connection
    # dropped ... (a scheduler restart?)"); exit 3 still
    if zmq.has("curve"):
        theirs = os.path.join(tmp, "ctl-keys-theirs")
        os.makedirs(theirs, exist_ok=True)
        r = subprocess.run([paths["dsv4ctl"], "keygen", theirs], capture_output=True, text=True)
        check(r.returncode == 0, "dsv4ctl keygen: %s" % r.stderr)
        ctx = zmq.Context()
        s = ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.curve_server = True
        with open(os.path.join(theirs, "server.key")) as f:
            s.curve_secretkey = f.read().strip().encode()
        port = s.bind_to_random_port("tcp://127.0.0.1")
        with open(conf, "w") as f:
            f.write("admin_endpoint = tcp://127.0.0.1:%d\nkey_dir = %s\n" % (port, keys))
        try:
            r = subprocess.run([paths["dsv4ctl"], "-f", conf, "drain", "all"],
                               capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        finally:
            s.close()
            ctx.term()
        check(r.returncode == 3 and "CURVE handshake failed: check server.pub in key_dir" in
              r.stderr, "dsv4ctl with another server.pub: exit %d: %s" % (r.returncode, r.stderr))
        log("dsv4ctl: $DSV4_ADMIN_ENDPOINT used, a tcp:// endpoint's key from key_dir, "
            "a CURVE handshake refused said so")
        return
    log("dsv4ctl: $DSV4_ADMIN_ENDPOINT used, a tcp:// endpoint's key from key_dir "
        "(no CURVE in pyzmq: the wrong key not tried)")


def ctl_live(paths, svc, tmp):
    """Against the live set: a second dsv4-sched of the same configuration
    exits 1 ("in use by a running process") and leaves the set's sockets
    alone (libzmq's ipc:// bind unlinked them and took the endpoints); the
    table of `dsv4ctl requests` prints a tag's control characters as '?';
    a drain target over the protocol's 32 bytes is a usage error (2, it was
    3, "no answer"); `dsv4ctl reload` with a file that does not load
    reaches the scheduler, which refuses (1; dsv4ctl exited 2 at once)."""
    sched, ctl = paths["dsv4-sched"], paths["dsv4ctl"]
    other = ["-o", "client_endpoint=ipc://%s/second-c.sock" % tmp,
             "-o", "admin_endpoint=ipc://%s/second-a.sock" % tmp]
    for extra, what in (([], "client"), (other, "rank")):
        rc, out, err = run([sched, "-f", svc.conf] + extra, cwd=tmp, timeout=20)
        check(rc == 1 and re.search(r"%s socket: ipc://\S+: in use by a running process" %
                                    what, err),
              "a second dsv4-sched (%s endpoint): exit %d: %s" % (what, rc, err[-1500:]))
    for ep in (svc.client_ep, svc.rank_ep, svc.admin_ep):
        check(os.path.exists(ep[len("ipc://"):]), "%s removed" % ep)
    rc, out, err = run([ctl, "--admin", svc.admin_ep, "status"])
    check(rc == 0, "dsv4ctl status after a second dsv4-sched: exit %d: %s" % (rc, err))
    svc.wait_ranks(2)
    log("a second dsv4-sched on a live set's endpoints exits 1; the set still serves")

    long_target = "decode@" + "1" * 40
    for cmd in ("drain", "undrain"):
        rc, out, err = run([ctl, "--admin", svc.admin_ep, cmd, long_target])
        check(rc == 2 and "at most 32" in err,
              "dsv4ctl %s of a %d-byte target: exit %d: %s" %
              (cmd, len(long_target), rc, err[-500:]))

    # a request held in the queue (its decode rank drained) with a tag of
    # control characters
    rc, out, err = run([ctl, "--admin", svc.admin_ep, "drain", "decode@0"])
    check(rc == 0, "dsv4ctl drain decode@0: %s" % err)
    tag = "a\x1b[2Jb\rc\nd\x7fe"
    gen = subprocess.Popen([paths["dsv4-generate"], "-e", svc.client_ep, "--ids", "-n", "2",
                            "--tag", tag, "1 2 3"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        wait = time.monotonic() + RUN_TIMEOUT_S
        while True:
            rc, out, err = run([ctl, "--admin", svc.admin_ep, "requests"])
            check(rc == 0, "dsv4ctl requests: %s" % err)
            if "a?[2Jb?c?d?e" in out or time.monotonic() > wait:
                break
            time.sleep(0.1)
        check("a?[2Jb?c?d?e" in out and not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", out) and
              out.count("\n") == 2,
              "dsv4ctl requests with a tag of control characters: %r" % out)
        rc, js, err = run([ctl, "--admin", svc.admin_ep, "--json", "requests"])
        check(rc == 0 and "a\\u001b[2Jb\\u000dc\\u000ad" in js, "--json requests: %r" % js)
    finally:
        run([ctl, "--admin", svc.admin_ep, "undrain", "decode@0"])
        try:
            gen.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            gen.kill()
            gen.communicate()
    check(gen.returncode == 0, "dsv4-generate --tag: exit %s" % gen.returncode)
    log("dsv4ctl: a 40-byte drain target exits 2; a tag's control characters print as ?")

    with open(svc.conf) as f:
        good = f.read()
    try:
        with open(svc.conf, "a") as f:
            f.write("queue_max = many\n")
        rc, out, err = run([ctl, "-f", svc.conf, "--admin", svc.admin_ep, "reload"])
        check(rc == 1 and "warning" in err and "queue_max" in err and
              "does not load" in err,
              "dsv4ctl -f BROKEN reload: exit %d: %s" % (rc, err[-1500:]))
        rc, out, err = run([ctl, "-f", svc.conf, "keygen", os.path.join(tmp, "k-broken")])
        check(rc == 2, "dsv4ctl -f BROKEN keygen: exit %d, want 2: %s" % (rc, err))
    finally:
        with open(svc.conf, "w") as f:
            f.write(good)
    log("dsv4ctl reload with a file that does not load: the scheduler's refusal, exit 1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--version", required=True)
    args = ap.parse_args()
    svc_test.ARGS = args
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="dsv4-cli-")
    open(os.path.join(tmp, "a-file"), "w").close()
    ODD_VALUES[-1] = os.path.join(tmp, "a-file", "x")
    svc = None
    try:
        paths = {n: svc_test.exe(p) for n, p in PROGRAMS.items()}
        for name, path in paths.items():
            contract(name, path, args.version)
        log("--help, -h, --version and an unknown option: as common/cli.h says, "
            "in all %d programs" % len(paths))

        tok = os.path.abspath(os.path.join(args.src, "tests", "tokenizer",
                                           "tiny_tokenizer.json"))
        conf = os.path.join(tmp, "gw.conf")
        with open(conf, "w") as f:
            f.write("tokenizer = %s\ngateway_listen = 127.0.0.1:8123\n" % tok)
        svc = svc_test.Service()
        # The daemons' -n: a file of this test's own (a bare -n reads
        # /etc/dsv4/dsv4.conf when it exists), its sockets in tmp.
        dconf = os.path.join(tmp, "d.conf")
        with open(dconf, "w") as f:
            f.write("client_endpoint = ipc://%s/c.sock\nrank_endpoint = ipc://%s/r.sock\n"
                    "admin_endpoint = ipc://%s/a.sock\ncheckpoint = %s\ntokenizer = %s\n" %
                    (tmp, tmp, tmp, svc.model, tok))
        checks(paths, dconf, tmp)
        ctl_waits(paths, tmp)
        nobody_there(paths, tmp)
        ctl_endpoint(paths, tmp)
        ctl_live(paths, svc, tmp)
        lconf = os.path.join(tmp, "l.conf")
        with open(lconf, "w") as f:
            f.write("client_endpoint = ipc://%s/lc.sock\nrank_endpoint = ipc://%s/lr.sock\n"
                    "admin_endpoint = ipc://%s/la.sock\ntokenizer = %s\n" %
                    (tmp, tmp, tmp, tok))
        cases = {
            "dsv4-sched": Case(tmp, ["-n", "-f", dconf]),
            "dsv4-prefill": Case(tmp, ["-n", "-f", dconf]),
            "dsv4-decode": Case(tmp, ["-n", "-f", dconf]),
            "dsv4-gateway": Case(tmp, ["-n", "-f", conf]),
            "dsv4ctl": Case(tmp, ["--admin", svc.admin_ep], ["status"]),
            "dsv4-generate": Case(tmp, ["-e", svc.client_ep, "-n", "2", "--ids",
                                   "--timeout", "20000", "--connect-timeout", "5000"],
                                  ["1 2 3"]),
            "dsv4-bench": Case(tmp, ["-e", svc.client_ep, "-c", "1", "-n", "2", "-w", "0",
                                "-p", "4", "-l", "2", "-q", "-j", os.devnull,
                                "--token-range", "3:200", "--timeout", "20000",
                                "--connect-timeout", "5000"]),
            "dsv4-mkmodel": Case(tmp, ["--preset", "tiny", "--out", "m"]),
            "dsv4-tokenize": Case(tmp, ["--tokenizer", tok], stdin=b"hello world\n"),
            # the scheduler alone (its own sockets in tmp), `true` once it is
            # ready, then the set stops
            "dsv4-launch": Case(tmp, ["-f", lconf, "-P", "0", "-D", "0", "-w", "0",
                                      "--sched-bin", paths["dsv4-sched"]], ["--", "true"]),
        }
        for name, case in cases.items():
            sweep(name, paths[name], case)
        svc.check_no_leaks()
    except Fail as e:
        log("FAIL: %s" % e)
        if svc is not None:
            log("service log:\n" + svc.errlog())
        return 1
    finally:
        if svc is not None:
            svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    svc_test.remove_scratch()
    log("PASS (%.1f s)" % (time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
