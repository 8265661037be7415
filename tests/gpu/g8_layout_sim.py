#!/usr/bin/env python3
# g8_layout_sim.py — desk check of the FP8 x FP8 prefill linear's data layout
# (kernels/cuda/fast_gemm8.cu, g8_kernel) without a GPU.
#
#   python3 tests/gpu/g8_layout_sim.py      (numpy; a few seconds)
#
# Replays what g8_kernel moves where for one CTA (128 weight rows x 128
# tokens, a partial token tile too): the producer threads' cp.async chunk
# placement (g8_load, g8_off: rows of 128 bytes, chunk c at c ^ (row & 7)),
# the ring of stages, the wgmma descriptors of each k32 step (g8_desc: start,
# SBO, 128B swizzle), and the epilogue's reading of the D fragment.  wgmma is
# modelled by the PTX ISA's definitions: K-major 128B-swizzled operand
# element (m, k) of one k32 step (8-bit types) at start + (m / 8) * SBO +
# (m % 8) * 128 + k, then address bits 4-6 XOR bits 7-9; D element
# d[4j+i] of thread (warp w, g = lane / 4, q = lane % 4) = (row 16w + g +
# 8 (i >> 1), column 8j + 2q + (i & 1)).  Codes are small integers so that
# every sum is exact; the result must equal sum over blocks of (A_b . B_b) *
# s_w * s_x.  The index functions are copies of the kernel's: keep them in
# step.  Exit status 1 when a case is off.
import sys
import numpy as np

rng = np.random.default_rng(7)
BM, BN, S = 128, 128, 6


def g8_off(r, c):
    return r * 128 + ((c ^ (r & 7)) << 4)


def g8_desc(addr):
    return ((addr & 0x3ffff) >> 4) | 1 << 16 | (1024 >> 4) << 32 | 1 << 62


def desc_read(smem, desc, rows):
    """(rows, 32) bytes of one k32 operand as the hardware reads them."""
    start = (desc & 0x3fff) << 4
    sbo = ((desc >> 32) & 0x3fff) << 4
    assert desc >> 62 == 1 and (desc >> 49) & 7 == 0
    out = np.zeros((rows, 32), dtype=np.int64)
    for m in range(rows):
        for k in range(32):
            a = start + (m // 8) * sbo + (m % 8) * 128 + k
            a ^= ((a >> 7) & 7) << 4
            out[m, k] = smem[a]
    return out


def run(N, K, T, bx, by):
    nkt = K // 128
    W = rng.integers(-3, 4, size=(N, K))
    X = rng.integers(-3, 4, size=(T, K))
    ws = rng.integers(-3, 4, size=(N // 128, nkt)).astype(np.float64)
    sx = rng.integers(-3, 4, size=(T, nkt)).astype(np.float64)
    n0, t0 = bx * BM, by * BN
    # smem: one byte per cell holding the (signed) code; base 1024-aligned
    SA, SB = 0, S * BM * 128
    smem = np.zeros(S * (BM + BN) * 128, dtype=np.int64)
    sxs = np.zeros((S, BN))
    acc = np.zeros((2, 4, 32, 64))   # [wg][warp][lane][reg]
    for kt in range(nkt):
        st = kt % S
        smem[SA + st * BM * 128:SA + (st + 1) * BM * 128] = -99   # stale data must not be read
        smem[SB + st * BN * 128:SB + (st + 1) * BN * 128] = -99
        for p in range(128):          # producer threads (g8_load)
            for i in range(BM * 8 // 128):
                idx = p + 128 * i
                r, c = idx >> 3, idx & 7
                src = W[n0 + r, kt * 128 + c * 16:kt * 128 + c * 16 + 16]
                o = SA + st * BM * 128 + g8_off(r, c)
                smem[o:o + 16] = src
            for i in range(BN * 8 // 128):
                idx = p + 128 * i
                r, c = idx >> 3, idx & 7
                ok = t0 + r < T
                o = SB + st * BN * 128 + g8_off(r, c)
                smem[o:o + 16] = X[t0 + r, kt * 128 + c * 16:kt * 128 + c * 16 + 16] if ok else 0
            sxs[st, p] = sx[t0 + p, kt] if t0 + p < T else 0.0
        sw = ws[n0 // 128, kt]
        for wg in range(2):
            a0 = SA + st * BM * 128 + wg * 64 * 128
            b0 = SB + st * BN * 128
            blk = np.zeros((64, BN), dtype=np.int64)
            for s in range(4):
                A = desc_read(smem, g8_desc(a0 + 32 * s), 64)
                B = desc_read(smem, g8_desc(b0 + 32 * s), BN)
                blk = (blk if s else 0) + A @ B.T
            for w in range(4):
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    for j in range(16):
                        for ii in range(2):
                            f = sw * sxs[st, 8 * j + 2 * q + ii]
                            for h in range(2):
                                reg = 4 * j + 2 * h + ii
                                acc[wg, w, lane, reg] += blk[16 * w + g + 8 * h,
                                                             8 * j + 2 * q + ii] * f
    out = np.full((T, N), np.nan)
    for wg in range(2):
        for w in range(4):
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                for j in range(16):
                    for i in range(4):
                        t = t0 + 8 * j + 2 * q + (i & 1)
                        if t < T:
                            out[t, n0 + wg * 64 + w * 16 + g + 8 * (i >> 1)] = acc[wg, w, lane,
                                                                                   4 * j + i]
    ref = np.zeros((T, N))
    for kt in range(nkt):
        blk = X[:, kt * 128:(kt + 1) * 128] @ W[:, kt * 128:(kt + 1) * 128].T
        ref += blk * sx[:, kt:kt + 1] * np.repeat(ws[:, kt], 128)[None, :]
    rows = slice(t0, min(T, t0 + BN))
    cols = slice(n0, n0 + BM)
    ok = np.array_equal(out[rows, cols], ref[rows, cols])
    print("%s N=%d K=%d T=%d tile (%d, %d)" % ("OK" if ok else "OFF", N, K, T, bx, by))
    return ok


good = run(256, 1024, 200, 1, 1)      # partial token tile, 8 blocks (ring wraps)
good &= run(128, 256, 128, 0, 0)
sys.exit(0 if good else 1)
