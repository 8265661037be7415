#!/usr/bin/env python3
"""fl2_layout_sim.py — desk check of fast_linear2.cu's index algebra.

Replays f2_kernel's addressing in Python for small shapes: the split of
f2_plan_for, the quantized activations' shared-memory layout, the per-thread
cp.async ring (chunk j = 4m + 2h + c at slot[j*32 + lane]), the mma fragments
as the PTX ISA defines them (m16n8k32 E4M3: a0 = A[g][4q..4q+3], a1 =
A[g+8][4q..], a2 = A[g][16+4q..], a3 = A[g+8][16+4q..], b0 = B[4q..][g],
b1 = B[16+4q..][g]; m16n8k16 f16: a0 = A[g][2q, 2q+1], a1 = A[g+8][..],
a2 = A[g][2q+8, 2q+9], a3 = A[g+8][..], b0 = B[2q, 2q+1][g], b1 =
B[2q+8, 2q+9][g]; C: c0 c1 = D[g][2q, 2q+1], c2 c3 = D[g+8][..]), the
partial sums' layout, the KW slice sum and the cluster sum, and compares
every output with a plain per-block product.  Values are small integers
and the scales powers of two, so every sum is exact and any index slip
shows.  Run: python3 tests/gpu/fl2_layout_sim.py (prints PASS or the first
mismatch); no GPU, no numpy needed.
"""
import random
import sys

MAXW, TOK, STAGES, CTAS = 8, 16, 4, 128


def plan(N, K, maxc, want, ctas=CTAS):
    """f2_plan_for (ctas: F2_CTAS; smaller here to get RW > 1 on small N)."""
    tiles, nb = N // 32, K // 128
    S = -(-want // tiles)
    S = min(S, nb, 8 * maxc)
    pw = 1
    while pw * 2 <= S:
        pw *= 2
    S = pw
    bps = -(-nb // S)
    C = min(S, maxc)
    KW = S // C
    RW = MAXW // KW
    while RW > 1 and (tiles % RW != 0 or (tiles // RW) * C < ctas):
        RW //= 2
    return dict(nb=nb, bps=bps, KW=KW, C=C, RW=RW, range=KW * bps)


def word(buf, off):
    """Four bytes of buf at off (a .b32 register: byte 0 = lowest k)."""
    return buf[off:off + 4]


def run(N, K, T, maxc, want, ctas, f16, rng):
    p = plan(N, K, maxc, want, ctas)
    nb, bps, KW, C, RW, rng_ = p["nb"], p["bps"], p["KW"], p["C"], p["RW"], p["range"]
    # weights and activation codes as small integers (their "values")
    Wv = [[rng.randint(-3, 3) for _ in range(K)] for _ in range(N)]
    sw = [[2.0 ** rng.randint(-2, 2) for _ in range((K + 127) // 128)]
          for _ in range((N + 127) // 128)]
    Xv = [[rng.randint(-3, 3) for _ in range(K)] for _ in range(T)]
    sx = [[2.0 ** rng.randint(-2, 2) for _ in range(nb)] for _ in range(T)]
    ref = [[sum(sum(Wv[r][kb * 128 + k] * Xv[t][kb * 128 + k] for k in range(128))
                * sx[t][kb] * sw[r // 128][kb] for kb in range(nb))
            for r in range(N)] for t in range(T)]
    out = [[None] * N for _ in range(T)]
    RT = 32 * RW
    W = KW * RW
    for t0 in range(0, T, TOK):
        NT = 1 if T - t0 <= 8 else 2
        ntok = min(NT * 8, T - t0)
        for bx in range(N // RT):
            cta_row = bx * RT
            parts = []
            for z in range(C):
                cb0 = z * rng_
                ncb = max(0, min(nb, cb0 + rng_) - cb0)
                XS = rng_ * 128 + 64
                xq = [0] * (TOK * XS)   # smem bytes (values)
                sxs = [0.0] * (TOK * rng_)
                for it in range(NT * 8 * ncb):
                    tok, lb = it // ncb, it % ncb
                    for lane in range(32):
                        for b in range(4):
                            col = (cb0 + lb) * 128 + lane * 4 + b
                            xq[tok * XS + lb * 128 + lane * 4 + b] = \
                                Xv[t0 + tok][col] if tok < ntok else 0
                    sxs[tok * rng_ + lb] = sx[t0 + tok][cb0 + lb] if tok < ntok else 0.0
                part = {}
                for warp in range(W):
                    rw, kw = warp % RW, warp // RW
                    row0 = cta_row + 32 * rw
                    kb0 = cb0 + kw * bps
                    n_kb = max(0, min(nb, kb0 + bps) - kb0)
                    acc = {}
                    for i in range(n_kb):
                        kb = kb0 + i
                        lb = kb - cb0
                        # the ring slot: chunk j of lane at [j*32 + lane], 16 bytes
                        slot = {}
                        for lane in range(32):
                            g, q = lane // 4, lane % 4
                            for m in range(2):
                                for h in range(2):
                                    for c in range(2):
                                        r = row0 + 16 * m + 8 * h + g
                                        src = kb * 128 + c * 64 + q * 16
                                        slot[(4 * m + 2 * h + c) * 32 + lane] = \
                                            Wv[r][src:src + 16]
                        # the mma, fragment by fragment as the PTX ISA defines them
                        for m in range(2):
                            for n in range(NT):
                                A = [[None] * 32 for _ in range(16)]
                                B = [[None] * 8 for _ in range(32)]
                                D = [[0.0] * 8 for _ in range(16)]
                                steps = 8 if f16 else 4
                                for s in range(steps):
                                    A = [[None] * (16 if f16 else 32) for _ in range(16)]
                                    B = [[None] * 8 for _ in range(16 if f16 else 32)]
                                    for lane in range(32):
                                        g, q = lane // 4, lane % 4
                                        wv = [slot[j * 32 + lane] for j in range(8)]
                                        xoff = [(n * 8 + g) * XS + lb * 128 + c * 64 + q * 16
                                                for c in range(2)]
                                        xv = [xq[o:o + 16] for o in xoff]
                                        if not f16:
                                            c, e = s // 2, 2 * (s % 2)
                                            a0 = word(wv[4 * m + c], 4 * e)
                                            a2 = word(wv[4 * m + c], 4 * (e + 1))
                                            a1 = word(wv[4 * m + 2 + c], 4 * e)
                                            a3 = word(wv[4 * m + 2 + c], 4 * (e + 1))
                                            b0 = word(xv[c], 4 * e)
                                            b1 = word(xv[c], 4 * (e + 1))
                                            for bb in range(4):
                                                A[g][4 * q + bb] = a0[bb]
                                                A[g + 8][4 * q + bb] = a1[bb]
                                                A[g][16 + 4 * q + bb] = a2[bb]
                                                A[g + 8][16 + 4 * q + bb] = a3[bb]
                                                B[4 * q + bb][g] = b0[bb]
                                                B[16 + 4 * q + bb][g] = b1[bb]
                                        else:
                                            c, e = s // 4, s % 4
                                            u0 = word(wv[4 * m + c], 4 * e)
                                            u8 = word(wv[4 * m + 2 + c], 4 * e)
                                            b = word(xv[c], 4 * e)
                                            for bb in range(2):
                                                A[g][2 * q + bb] = u0[bb]
                                                A[g][2 * q + 8 + bb] = u0[2 + bb]
                                                A[g + 8][2 * q + bb] = u8[bb]
                                                A[g + 8][2 * q + 8 + bb] = u8[2 + bb]
                                                B[2 * q + bb][g] = b[bb]
                                                B[2 * q + 8 + bb][g] = b[2 + bb]
                                    kk = 16 if f16 else 32
                                    for rr in range(16):
                                        for cc in range(8):
                                            assert A[rr][0] is not None
                                            D[rr][cc] += sum(A[rr][k] * B[k][cc]
                                                             for k in range(kk))
                                # blk -> acc with the scales, C fragment order
                                for lane in range(32):
                                    g, q = lane // 4, lane % 4
                                    swv = sw[row0 // 128][kb]
                                    for ii in range(4):
                                        rr, cc = g + 8 * (ii >> 1), 2 * q + (ii & 1)
                                        f = sxs[(n * 8 + cc) * rng_ + lb] * swv
                                        key = (m, n, ii, lane)
                                        acc[key] = acc.get(key, 0.0) + D[rr][cc] * f
                    # part[kw][tok][r]
                    for (m, n, ii, lane), v in acc.items():
                        g, q = lane // 4, lane % 4
                        r = 32 * rw + 16 * m + g + 8 * (ii >> 1)
                        tok = n * 8 + 2 * q + (ii & 1)
                        part[(kw, tok, r)] = v
                    for m in range(2):   # empty slices write zeros
                        for n in range(NT):
                            for lane in range(32):
                                for ii in range(4):
                                    g, q = lane // 4, lane % 4
                                    r = 32 * rw + 16 * m + g + 8 * (ii >> 1)
                                    tok = n * 8 + 2 * q + (ii & 1)
                                    part.setdefault((kw, tok, r), 0.0)
                # the KW slices in order into part[0]
                for tok in range(ntok):
                    for r in range(RT):
                        v = part[(0, tok, r)]
                        for k in range(1, KW):
                            v += part[(k, tok, r)]
                        part[(0, tok, r)] = v
                parts.append(part)
            rs = RT // C
            for z in range(C):
                for e in range(ntok * rs):
                    tok, r = e // rs, z * rs + e % rs
                    v = parts[0][(0, tok, r)]
                    for pp in range(1, C):
                        v += parts[pp][(0, tok, r)]
                    assert out[t0 + tok][cta_row + r] is None, "written twice"
                    out[t0 + tok][cta_row + r] = v
    for t in range(T):
        for r in range(N):
            if out[t][r] != ref[t][r]:
                return "FAIL N=%d K=%d T=%d maxc=%d want=%d f16=%d plan %s: token %d row %d " \
                       "sim %r ref %r" % (N, K, T, maxc, want, f16, p, t, r, out[t][r], ref[t][r])
    return None


def main():
    rng = random.Random(7)
    cases = [  # N, K, T, maxc, want: KW > 1, C > 1, RW > 1, ragged slices, NT 1 and 2
        (64, 512, 3, 4, 1024),     # S 4: C 4, KW 1, RW 2
        (32, 1024, 11, 2, 1024),   # S 8: C 2, KW 4, RW 1
        (64, 384, 9, 4, 96),       # nb 3, S 2: bps 2, ragged
        (128, 256, 17, 1, 8),      # S 2: C 1, KW 2, two passes
        (256, 640, 5, 4, 64),      # nb 5, S 4: bps 2, an empty slice
    ]
    cases = [c + (CTAS,) for c in cases] + [
        (256, 256, 4, 1, 8, 1),    # S 1, RW 8: 256 rows per CTA, two scale rows
        (128, 512, 10, 2, 16, 1),  # S 4: C 2, KW 2, RW 2
    ]
    for N, K, T, maxc, want, ctas in cases:
        for f16 in (0, 1):
            err = run(N, K, T, maxc, want, ctas, f16, rng)
            print("%s N=%d K=%d T=%d maxc=%d want=%d %s plan %s" %
                  ("ok  " if err is None else "FAIL", N, K, T, maxc, want,
                   "v2h" if f16 else "v2 ", plan(N, K, maxc, want, ctas)))
            if err:
                print(err)
                return 1
    for name, N, K in (("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wq_b/2", 16384, 1024),
                       ("wkv", 512, 4096), ("wo_b", 4096, 8192), ("wo_b/2", 2048, 8192),
                       ("idx_wq_b", 8192, 1024), ("proj", 4096, 4096)):
        p = plan(N, K, 4, 1024)
        print("plan %-9s %5d x %-5d %s grid %d x %d, %d warps per CTA" %
              (name, N, K, p, N // (32 * p["RW"]), p["C"], p["KW"] * p["RW"]))
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
