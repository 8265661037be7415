#!/usr/bin/env python3
"""f4_layout_sim.py — desk check of kernels/cuda/fast_gemm4.cu's data layout.

Replays, in numpy, what one warpgroup of f4_kernel does with the bytes: the
activation permutation f4_perm (f4_prep_kernel), the cp.async placement of
weights (XOR swizzle f4_a_off) and activation codes (K-major core matrices)
in shared memory, each thread's A fragment reads and FP4 -> e4m3 conversion
(fk_fp4x8_e4m3) or FP8 byte split (__byte_perm 0x6420 / 0x7531), then the
wgmma semantics as the PTX ISA defines them (A register fragment of
m64nNk32 .e4m3; B read through the matrix descriptor: start + 256 s, LBO
128 along K, SBO 1024 along N) and the kernel's scaling (per-group s_w * 64,
FP8 block scale, the activation scale folded by power-of-two ratios).  The
result must equal the plain sum over logical columns of weight value times
activation value (float64, both sides; only the layout is checked, not the
tensor core's rounding).  Prints OK or the first mismatch; exit 1 on one.

Usage: python3 tests/gpu/f4_layout_sim.py (numpy only, a few seconds).
"""
import sys

import numpy as np

RNG = np.random.default_rng(20261130)
LBO, SBO = 128, 1024


def e4m3(b):
    """Value of e4m3 byte(s) b (no NaN codes are generated)."""
    b = np.asarray(b, dtype=np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 15
    m = b & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return s * v


def e2m1(c):
    c = np.asarray(c, dtype=np.int64)
    e = (c >> 1) & 3
    m = c & 1
    a = np.where(e == 0, 0.5 * m, (1 + 0.5 * m) * 2.0 ** (e - 1.0))
    return np.where(c & 8, -a, a)


def fp4x8_e4m3(w):
    """fk_fp4x8_e4m3: (even, odd) words."""
    even = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
    odd = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    return even & 0xFFFFFFFF, odd & 0xFFFFFFFF


def byte_perm(x, y, sel):
    bs = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(bs[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def f4_perm(c):
    return (c & ~31) | (c & 1) << 4 | (c & 31) >> 1


def a_off(fp4, r, c):
    if fp4:
        return r * 64 + ((c ^ ((r >> 1) & 3)) << 4)
    return r * 128 + ((c ^ ((r & 3) << 1)) << 4)


def u32(buf, off):
    return int.from_bytes(bytes(buf[off:off + 4]), "little")


def pow2_ratio(p, c):
    return p / c   # exact for powers of two (the kernel's integer form)


def check(fp4, BN, K):
    nkt = K // 128
    rows = 64
    # weights: FP4 packed (byte j: element 2j low nibble) + E8M0 per 32, or FP8 + one block scale
    if fp4:
        wcodes = RNG.integers(0, 16, size=(rows, K))
        wbytes = (wcodes[:, 0::2] | (wcodes[:, 1::2] << 4)).astype(np.uint8)
        wval = e2m1(wcodes)
        gexp = RNG.integers(-6, 4, size=(rows, K // 32))
        wref = wval * (2.0 ** np.repeat(gexp, 32, axis=1))
    else:
        wbytes = RNG.integers(0, 256, size=(rows, K)).astype(np.uint8)
        wbytes[(wbytes & 0x7F) == 0x7F] = 0x11   # no NaN
        bexp = RNG.integers(-10, -4, size=(nkt,))   # one 128-row block: a scale per column block
        wref = e4m3(wbytes) * (2.0 ** np.repeat(bexp, 128))[None, :]
    # activations: e4m3 codes (logical order) + power-of-two scale per (token, 128)
    xcodes = RNG.integers(0, 256, size=(BN, K)).astype(np.uint8)
    xcodes[(xcodes & 0x7F) == 0x7F] = 0x22
    sx = 2.0 ** RNG.integers(-12, 3, size=(BN, nkt)).astype(np.float64)
    xref = e4m3(xcodes) * np.repeat(sx, 128, axis=1)
    ref = wref @ xref.T   # (rows, BN)

    xq = np.zeros((BN, K), dtype=np.uint8)   # global, permuted (f4_prep_kernel)
    for c in range(K):
        xq[:, f4_perm(c)] = xcodes[:, c]

    acc = np.zeros((rows, BN))
    arow = 64 if fp4 else 128
    for kt in range(nkt):
        # cp.async into the stage
        sa = np.zeros(rows * arow, dtype=np.uint8)
        for r in range(rows):
            for c in range(arow // 16):
                src = wbytes[r, kt * arow + c * 16: kt * arow + c * 16 + 16]
                o = a_off(fp4, r, c)
                sa[o:o + 16] = src
        sb = np.zeros(BN * 128, dtype=np.uint8)
        for n in range(BN):
            for c in range(8):
                o = ((n >> 3) * 8 + c) * 128 + (n & 7) * 16
                sb[o:o + 16] = xq[n, kt * 128 + c * 16: kt * 128 + c * 16 + 16]
        # fragments: A[m][k] bytes per group G
        A = np.zeros((4, rows, 32), dtype=np.int64)
        for w in range(4):
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                ra = w * 16 + g
                for G in range(4):
                    if fp4:
                        wa = u32(sa, a_off(1, ra, G) + q * 4)
                        wb = u32(sa, a_off(1, ra + 8, G) + q * 4)
                        r0, r2 = fp4x8_e4m3(wa)
                        r1, r3 = fp4x8_e4m3(wb)
                    else:
                        c, o = 2 * G + (q >> 1), (q & 1) * 8
                        va = (u32(sa, a_off(0, ra, c) + o), u32(sa, a_off(0, ra, c) + o + 4))
                        vb = (u32(sa, a_off(0, ra + 8, c) + o),
                              u32(sa, a_off(0, ra + 8, c) + o + 4))
                        r0, r2 = byte_perm(*va, 0x6420), byte_perm(*va, 0x7531)
                        r1, r3 = byte_perm(*vb, 0x6420), byte_perm(*vb, 0x7531)
                    for i in range(4):   # PTX: a0..a3 row g, k 4q+i; a4..a7 row g+8; +16
                        A[G, 16 * w + g, 4 * q + i] = (r0 >> (8 * i)) & 0xFF
                        A[G, 16 * w + g + 8, 4 * q + i] = (r1 >> (8 * i)) & 0xFF
                        A[G, 16 * w + g, 16 + 4 * q + i] = (r2 >> (8 * i)) & 0xFF
                        A[G, 16 * w + g + 8, 16 + 4 * q + i] = (r3 >> (8 * i)) & 0xFF
        # rescale acc to this block's activation scale
        sp = sx[:, kt - 1] if kt > 0 else sx[:, kt]
        acc *= pow2_ratio(sp, sx[:, kt])[None, :]
        blk = np.zeros((rows, BN))
        for G in range(4):
            start = 256 * G
            B = np.zeros((32, BN), dtype=np.int64)
            for k in range(32):
                for n in range(BN):
                    B[k, n] = sb[start + (n // 8) * SBO + (n % 8) * 16 + (k // 16) * LBO + k % 16]
            t = e4m3(A[G]) @ e4m3(B)
            if fp4:
                acc += t * (2.0 ** gexp[:, kt * 4 + G] * 64.0)[:, None]
            else:
                blk += t
        if not fp4:
            acc += blk * 2.0 ** bexp[kt]
    out = acc * sx[:, nkt - 1][None, :]
    bad = np.argwhere(~np.isclose(out, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max()))
    name = "fp4" if fp4 else "fp8"
    if len(bad):
        m, n = bad[0]
        print(f"FAIL {name} BN={BN} K={K}: row {m} token {n}: sim {out[m, n]!r} ref {ref[m, n]!r} "
              f"({len(bad)} of {out.size} differ)")
        return False
    print(f"ok   {name} BN={BN} K={K}: {out.size} outputs equal the logical sums")
    return True


def main():
    ok = True
    for fp4 in (1, 0):
        for BN in (16, 64):
            ok &= check(fp4, BN, 256)
    print("f4_layout_sim:", "OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
