#!/usr/bin/env python3
"""bench_test.py — dsv4-bench end to end (issue 7).

  bench_test.py --build BUILD_DIR [--src SRC_DIR]

Brings up the CPU service set on the tiny generated model with
tests/integration/svc_test.py's Service (dsv4-launch, one prefill and one
decode rank; `tokenizer = none`, so no EOS is added to the stop ids and every
request runs to max_tokens), then runs dsv4-bench:

  * a sweep C=1,4 with a warm-up, a fixed request count and --plot: the JSON
    has both levels, every measured request done with exactly the tokens
    asked, the same measured requests at both levels (seeded), percentiles
    ordered, TTFT <= E2E, window tokens >= measured tokens; the PNG is a PNG;
  * a --duration level (C=2): every request sent in the window is counted
    and done;
  * plot.py on two result files (two series);
  * argument errors (exit 2; an unknown short option named as itself), an
    output that cannot be written (exit 2, before any load) and an
    unreachable server (exit 1, no hang);
  * a server that dies under load (a stand-in scheduler killed): each
    worker is lost at its first 504, one failed request a worker, and the
    JSON written after the level holds the level;
  * a sweep with the default warm-up (the level's concurrency): both levels
    measure the same requests;
  * prompts past the context: the level stops at the first 413 (it resent
    them as fast as the scheduler answered), exit 1;
then the service's books must be empty (the extra requests cancelled at the
end of each level are freed).  Timing is never asserted.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
import svc_test  # noqa: E402  (Service, the leak check, check)
from svc_test import Fail, check  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
N_REQ, WARMUP, OUT_LEN, P_LO, P_HI = 6, 2, 12, 8, 24


def log(*a):
    print("bench_test:", *a, flush=True)


def bench(args, expect=0):
    cmd = [svc_test.exe("tools/bench/dsv4-bench")] + args
    log(" ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != expect:
        raise Fail("dsv4-bench exit %d (wanted %d)\nstderr:\n%s" %
                   (r.returncode, expect, r.stderr[-3000:]))
    return r


def check_summary(name, s, n=None):
    keys = ("min", "p50", "p90", "p99", "max")
    if n is not None:
        check(s["n"] == n, "%s: n=%d, wanted %d" % (name, s["n"], n))
    check(s["n"] > 0, "%s: no samples" % name)
    v = [s[k] for k in keys]
    check(all(x >= 0 for x in v), "%s: negative value %s" % (name, s))
    check(v == sorted(v), "%s: percentiles out of order %s" % (name, s))
    check(s["min"] <= s["mean"] <= s["max"], "%s: mean outside [min, max] %s" % (name, s))


def check_run(run, concurrency, measured=None):
    c = concurrency
    check(run["concurrency"] == c, "concurrency %s, wanted %d" % (run["concurrency"], c))
    if measured is not None:
        check(run["measured_requests"] == measured,
              "C=%d: %d measured requests, wanted %d" % (c, run["measured_requests"], measured))
    m = run["measured_requests"]
    check(m > 0, "C=%d: nothing measured" % c)
    check(run["done"] == m and run["failed"] == 0 and run["errors"] == {},
          "C=%d: done %d failed %d errors %s of %d" %
          (c, run["done"], run["failed"], run["errors"], m))
    check(run["finish"] == {"length": m, "stop": 0, "cancelled": 0},
          "C=%d: finish %s" % (c, run["finish"]))
    check(run["output_tokens"] == run["output_tokens_requested"] == m * OUT_LEN,
          "C=%d: output tokens %d, asked %d, wanted %d" %
          (c, run["output_tokens"], run["output_tokens_requested"], m * OUT_LEN))
    check(run["short_outputs"] == 0 and run["usage_mismatch"] == 0,
          "C=%d: short %d usage mismatch %d" % (c, run["short_outputs"], run["usage_mismatch"]))
    check(m * P_LO <= run["prompt_tokens"] <= m * P_HI,
          "C=%d: prompt tokens %d outside the distribution" % (c, run["prompt_tokens"]))
    check(run["workers_lost"] == 0 and not run["interrupted"], "C=%d: lost/interrupted" % c)
    check(run["duration_s"] > 0, "C=%d: duration %s" % (c, run["duration_s"]))
    # Every measured token arrived inside the window.
    check(run["window_output_tokens"] >= run["output_tokens"],
          "C=%d: window tokens %d < measured %d" %
          (c, run["window_output_tokens"], run["output_tokens"]))
    rate = run["window_output_tokens"] / run["duration_s"]
    check(abs(run["output_tok_s"] - rate) <= 1e-3 * rate + 0.01,
          "C=%d: output_tok_s %s != %s" % (c, run["output_tok_s"], rate))
    check_summary("ttft", run["ttft_ms"], m)
    check_summary("e2e", run["e2e_ms"], m)
    check_summary("tpot", run["tpot_ms"], m)
    itl = run["itl_ms"]
    check_summary("itl", itl)
    check(itl["n"] <= m * (OUT_LEN - 1), "itl: %d samples > %d" % (itl["n"], m * (OUT_LEN - 1)))
    for p in ("min", "p50", "p90", "p99", "max"):
        check(run["ttft_ms"][p] <= run["e2e_ms"][p],
              "C=%d: ttft %s %s > e2e %s" % (c, p, run["ttft_ms"][p], run["e2e_ms"][p]))


def check_png(path):
    check(os.path.exists(path), "no PNG at " + path)
    with open(path, "rb") as f:
        head = f.read(8)
    check(head == PNG_MAGIC, "%s is not a PNG (%r)" % (path, head))
    check(os.path.getsize(path) > 1000, "%s is tiny" % path)


def scenario(tmp):
    # Argument errors and an unreachable server need no service.
    for bad in (["-c", "65"], ["-c", "1,,2"], ["-p", "normal:5"], ["-n", "0"],
                ["-n", "3", "-d", "1"], ["--token-range", "9:9"], ["--bogus"], ["extra"]):
        r = bench(bad, expect=2)
        check("dsv4-bench:" in r.stderr, "no message for %s: %r" % (bad, r.stderr))
    r = bench(["-e", "ipc://%s/nobody.sock" % tmp, "-xq"], expect=2)
    check("unknown option '-x'" in r.stderr, "-xq: %r" % r.stderr[-500:])
    # (it said "unknown option '-q'")
    r = bench(["--quiet=x"], expect=2)
    check("option '--quiet' takes no argument" in r.stderr, "--quiet=x: %r" % r.stderr[-500:])
    # the outputs are checked before any load (the sweep is not lost at its end)
    for bad, what in ((["-j", os.path.join(tmp, "nodir", "x.json")], "nodir/x.json"),
                      (["-P", os.path.join(tmp, "nodir", "x.png")], "cannot write in")):
        r = bench(["-e", "ipc://%s/nobody.sock" % tmp, "--connect-timeout", "300"] + bad,
                  expect=2)
        check(what in r.stderr and "504" not in r.stderr, "%s: %r" % (bad, r.stderr[-500:]))
    r = bench(["-e", "ipc://%s/nobody.sock" % tmp, "--connect-timeout", "300", "-n", "1",
               "-j", os.path.join(tmp, "none.json")], expect=1)
    check("could not connect" in r.stderr or "504" in r.stderr,
          "unreachable server: %r" % r.stderr[-500:])

    # Requests that fail after tokens came (the stand-in scheduler's 408 at
    # their timeout, mid-stream) add no latency sample: ITL, like TTFT and
    # E2E, comes from the requests that finished.
    fake_ep = "ipc://%s/fake.sock" % tmp
    fake = subprocess.Popen([svc_test.exe("tests/ipc/fake_sched"), fake_ep])
    try:
        fails_json = os.path.join(tmp, "fails.json")
        bench(["-e", fake_ep, "-c", "2", "-n", "4", "-w", "0", "-p", "8", "-l", "100000",
               "--timeout", "60", "--token-range", "2:1024", "-q", "-j", fails_json], expect=1)
        with open(fails_json) as f:
            run = json.load(f)["runs"][0]
        check(run["failed"] == 4 and run["errors"] == {"408": 4} and run["output_tokens"] > 0,
              "stand-in timeouts: failed %d errors %s output %d" %
              (run["failed"], run["errors"], run["output_tokens"]))
        check(run["itl_ms"]["n"] == 0 and run["ttft_ms"]["n"] == 0,
              "failed requests' latencies counted: itl n=%d ttft n=%d" %
              (run["itl_ms"]["n"], run["ttft_ms"]["n"]))
    finally:
        fake.terminate()
        fake.wait(timeout=30)

    # A server that dies under load: each worker's request ends with 504
    # once the server is silent past --connect-timeout, and the worker is
    # lost; before, every remaining measured request waited for its own 504.
    fake = subprocess.Popen([svc_test.exe("tests/ipc/fake_sched"), fake_ep])
    try:
        gone_json = os.path.join(tmp, "gone.json")
        b = subprocess.Popen([svc_test.exe("tools/bench/dsv4-bench"), "-e", fake_ep, "-c", "2",
                              "-n", "40", "-w", "0", "-p", "8", "-l", "100000",
                              "--token-range", "2:1024", "--connect-timeout", "300",
                              "-j", gone_json], stderr=subprocess.PIPE, text=True)
        head = b.stderr.readline()      # the table's header: past the endpoint check
        check("out_tok/s" in head, "dsv4-bench did not start its level: %r" % head)
        time.sleep(1)                   # requests under way (or queued: the same outcome)
        fake.kill()
        fake.wait(timeout=30)
        err = b.communicate(timeout=300)[1]
        check(b.returncode == 1, "dsv4-bench exit %d after its server died" % b.returncode)
        with open(gone_json) as f:
            run = json.load(f)["runs"][0]
        check(run["workers_lost"] == 2 and run["failed"] == 2 and
              run["measured_requests"] == 2 and run["errors"] == {"504": 2},
              "server gone: lost %d, measured %d, failed %d, errors %s\n%s" %
              (run["workers_lost"], run["measured_requests"], run["failed"], run["errors"],
               err[-1500:]))
        log("server gone under load: each worker lost at its first 504")
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait(timeout=30)

    svc = svc_test.Service(n_prefill=1, n_decode=1, extra_conf="tokenizer = none\n")
    try:
        common = ["-e", svc.client_ep, "-p", "uniform:%d:%d" % (P_LO, P_HI),
                  "-l", str(OUT_LEN), "--token-range", "2:1024", "-s", "7",
                  "--timeout", str(svc_test.TIMEOUT_MS)]
        sweep_json = os.path.join(tmp, "sweep.json")
        sweep_png = os.path.join(tmp, "sweep.png")
        r = bench(common + ["-c", "1,4", "-n", str(N_REQ), "-w", str(WARMUP), "-L", "tiny",
                            "-j", sweep_json, "-P", sweep_png])
        check("out_tok/s" in r.stderr, "no table on stderr: %r" % r.stderr[-500:])
        with open(sweep_json) as f:
            doc = json.load(f)
        check(doc["tool"] == "dsv4-bench" and doc["schema"] == 1 and doc["label"] == "tiny",
              "header: %s" % {k: doc.get(k) for k in ("tool", "schema", "label")})
        check(doc["config"]["concurrency"] == [1, 4] and
              doc["config"]["output_len"] == str(OUT_LEN) and
              doc["config"]["prompt_len"] == "uniform:%d:%d" % (P_LO, P_HI),
              "config: %s" % doc["config"])
        runs = doc["runs"]
        check(len(runs) == 2, "%d runs, wanted 2" % len(runs))
        for run, c in zip(runs, (1, 4)):
            check(run["warmup_requests"] == WARMUP, "C=%d: warm-up %d" %
                  (c, run["warmup_requests"]))
            check_run(run, c, N_REQ)
        # Seeded: both levels measured requests WARMUP .. WARMUP+N_REQ-1.
        check(runs[0]["prompt_tokens"] == runs[1]["prompt_tokens"],
              "same seed, different prompts: %d vs %d" %
              (runs[0]["prompt_tokens"], runs[1]["prompt_tokens"]))
        check_png(sweep_png)
        log("sweep C=1,4: %s tok/s" % [x["output_tok_s"] for x in runs])

        # The default warm-up (the level's concurrency) differs by level; the
        # measured requests do not (each draws from its own stream).
        dw_json = os.path.join(tmp, "default_warmup.json")
        bench(common + ["-c", "1,3", "-n", "4", "-q", "-j", dw_json])
        with open(dw_json) as f:
            runs = json.load(f)["runs"]
        check([r["warmup_requests"] for r in runs] == [1, 3] and
              runs[0]["prompt_tokens"] == runs[1]["prompt_tokens"],
              "default warm-up: warm-ups %s, prompt tokens %s" %
              ([r["warmup_requests"] for r in runs], [r["prompt_tokens"] for r in runs]))

        dur_json = os.path.join(tmp, "duration.json")
        r = bench(common + ["-c", "2", "-d", "1", "-w", "0", "-q", "-j", "-"])
        check(r.stderr.strip() == "", "-q still printed: %r" % r.stderr[-500:])
        with open(dur_json, "w") as f:
            f.write(r.stdout)
        doc = json.loads(r.stdout)
        check(doc["config"]["duration_s"] == 1 and doc["config"]["requests"] is None,
              "config: %s" % doc["config"])
        check(len(doc["runs"]) == 1, "duration: %d runs" % len(doc["runs"]))
        check_run(doc["runs"][0], 2)
        check(doc["runs"][0]["duration_s"] >= 1, "duration window %s < 1 s" %
              doc["runs"][0]["duration_s"])

        # --no-stream: a request's tokens come in one event, so no TPOT (nor
        # ITL) sample, not a TPOT of 0; the settings as given, all digits
        ns_json = os.path.join(tmp, "nostream.json")
        bench(common + ["-c", "1", "-n", "2", "-w", "0", "--no-stream", "-t", "0.0004",
                        "--top-p", "0.0004", "-q", "-j", ns_json])
        with open(ns_json) as f:
            doc = json.load(f)
        run = doc["runs"][0]
        check(run["done"] == 2 and run["tpot_ms"]["n"] == 0 and run["itl_ms"]["n"] == 0,
              "--no-stream: done %d, tpot %s, itl n=%d" %
              (run["done"], run["tpot_ms"], run["itl_ms"]["n"]))
        check(doc["config"]["temperature"] == 0.0004 and doc["config"]["top_p"] == 0.0004,
              "settings rounded: %s" % doc["config"])

        # --top-logprobs: every token of every measured request came with its
        # lists (top_short 0), streamed and not; the setting in the config
        for extra in ([], ["--no-stream"]):
            r = bench(common + ["-c", "2", "-n", "2", "-w", "0", "--top-logprobs", "20", "-q",
                                "-j", "-"] + extra)
            doc = json.loads(r.stdout)
            run = doc["runs"][0]
            check(doc["config"]["top_logprobs"] == 20 and run["done"] == 2 and
                  run["output_tokens"] > 0 and run["top_short"] == 0,
                  "--top-logprobs 20 %s: config %s, run %s" % (extra, doc["config"], run))
        r = bench(common + ["-c", "1", "--top-logprobs", "21"], expect=2)

        # Prompts past the context (max_seq 256): the server refuses each
        # (413); the level stops at the first refusal, warm-up's included,
        # instead of resending for its whole duration as fast as the
        # scheduler answers (40,000 requests in 2 s); exit 1, refused.
        rej0 = svc.admin.status()["n_rejected"]
        r = bench(["-e", svc.client_ep, "-p", "300", "-l", "4", "-c", "2", "-w", "2", "-d", "2",
                   "--token-range", "2:1024", "-q", "-j", "-"], expect=1)
        doc = json.loads(r.stdout)
        run = doc["runs"][0]
        rej = svc.admin.status()["n_rejected"] - rej0
        check(run["refused"] and rej <= 8 and "refuses the requests" in r.stderr,
              "a level of refused requests: %d refused at the scheduler, run %s" % (rej, run))

        two_png = os.path.join(tmp, "two.png")
        subprocess.run([sys.executable, os.path.join(svc_test.ARGS.src, "tools/bench/plot.py"),
                        "-o", two_png, sweep_json, dur_json], check=True, timeout=300)
        check_png(two_png)

        svc.check_no_leaks()
    finally:
        svc.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--src", default=os.path.dirname(os.path.dirname(HERE)))
    svc_test.ARGS = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-") as tmp:
        try:
            scenario(tmp)
        except Fail as e:
            log("FAIL: %s" % e)
            return 1
    log("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
