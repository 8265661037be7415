#!/usr/bin/env python3
"""hf_reference.py — reference logits from Hugging Face transformers'
DeepseekV4ForCausalLM for a checkpoint written by dsv4-mkmodel.

Runs on the GPU machine (transformers 5.17 is installed there, not in CI):
loads the checkpoint in the official layout with FineGrainedFP8Config(
dequantize=True) and eager attention, runs one forward over N token ids (the
same deterministic ids as tests/model/model_util.c: xorshift from a seed) and
writes a fixture that tests/model/test_hf.c compares our CPU forward with.

Fixture format: 8 bytes magic b"DSV4HFX1", u32 little-endian header length,
a JSON header {"n": N, "vocab": V, "seed": S, "positions": [...], "ids": [...],
"checkpoint": {...what made it...}, "transformers": version}, then float32
logits (len(positions), V) row-major.
"""
import argparse
import json
import struct
import sys
import time

import numpy as np


def tokens(n, vocab, seed):
    """Same generator as tmodel_tokens() in tests/model/model_util.c."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + 1) & mask
    out = []
    for _ in range(n):
        x ^= (x << 13) & mask
        x ^= x >> 7
        x ^= (x << 17) & mask
        out.append(x % vocab)
    return out


def pick_positions(n, every):
    """Every `every`-th position plus the ones around window/compressor
    boundaries (so the fixture stays small but covers every boundary)."""
    pos = set(range(0, n, every))
    for b in (4, 8, 16, 32, 128, 256, 384, 512):
        for d in (-2, -1, 0, 1):
            if 0 <= b + d < n:
                pos.add(b + d)
    pos.add(n - 1)
    return sorted(pos)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", default="{}", help="JSON describing how the checkpoint was made")
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    t0 = time.time()
    model = DeepseekV4ForCausalLM.from_pretrained(
        a.ckpt,
        quantization_config=FineGrainedFP8Config(dequantize=True),
        dtype=torch.bfloat16,
        attn_implementation="eager",
        device_map="cuda",
    )
    model.eval()
    vocab = model.config.vocab_size
    ids = tokens(a.n, vocab, a.seed)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], device="cuda"), use_cache=False)
    logits = out.logits[0].float().cpu().numpy()
    positions = pick_positions(a.n, a.every)
    sel = np.ascontiguousarray(logits[positions], dtype=np.float32)
    header = {
        "n": a.n, "vocab": vocab, "seed": a.seed, "positions": positions, "ids": ids,
        "checkpoint": json.loads(a.meta), "transformers": transformers.__version__,
        "logits_dtype": str(out.logits.dtype),
    }
    h = json.dumps(header).encode()
    with open(a.out, "wb") as f:
        f.write(b"DSV4HFX1")
        f.write(struct.pack("<I", len(h)))
        f.write(h)
        f.write(sel.tobytes())
    print(f"hf_reference: {a.ckpt}: n={a.n} V={vocab} positions={len(positions)} "
          f"logit std={logits.std():.3f} in {time.time() - t0:.1f}s -> {a.out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
