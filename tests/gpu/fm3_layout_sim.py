#!/usr/bin/env python3
# fm3_layout_sim.py — desk check of the decode MoE v3's data layout
# (kernels/cuda/fast_moe3.cu, fm3_kernel) without a GPU.
#
#   python3 tests/gpu/fm3_layout_sim.py      (numpy; a few seconds)
#
# Replays, in Python, what one warp tile of fm3_kernel moves where, for the
# FP4 routed experts and the FP8 shared expert: the quantizer's column
# orders (fm3_p4, fm3_p8), the cp.async placement of a stage (fm3_issue:
# XOR-swizzled 16-byte segments, the FP4 scale bytes), the scale conversion
# (fm3_scales), the ldmatrix.x4 addresses (fm3_ldsm), the FP4 -> E4M3
# conversion (fk_fp4x8_e4m3, fast.cuh), the B words each thread feeds the
# mma (fm3_act, fm3_block), the per-group and per-block scaling and the four
# quarters added in order (fm3_pass).  ldmatrix and the mma are modelled by
# the PTX ISA's definitions: ldmatrix .m8n8.x4 .b16: lanes 8i..8i+7 give
# the row addresses of matrix i, thread t receives bytes 4(t%4)..4(t%4)+3
# of row t/4 of each matrix; mma .m16n8k32 .e4m3: a0 = A[g][4q..4q+3],
# a1 = A[g+8][4q..], a2 = A[g][16+4q..], a3 = A[g+8][16+4q..] (bytes in
# increasing k), b0 = B[4q..4q+3][g], b1 = B[16+4q..][g], d0, d1 = D[g][2q,
# 2q+1], d2, d3 = D[g+8][2q, 2q+1].  Every tile must equal a plain dot
# product of the decoded values (float64, to rounding: "OK").  The index
# functions are copies of the kernel's: keep them in step when it changes.
# v5 (fm5_pass) uses the same stages, swizzle, ldmatrix and mma as v3
# (only the loop around them differs), so these cases cover it too.
# Exit status 1 when a case is off.
import sys

import numpy as np

rng = np.random.default_rng(3)
SB, TILE_B, SCF = 128, 2048, 12

E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6]


def e2m1(c):
    return (-1.0 if c & 8 else 1.0) * E2M1[c & 7]


def e4m3(b):
    e, m = (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return float('nan')
    a = m / 512.0 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
    return -a if b & 0x80 else a


def e8m0(e):
    return 2.0 ** (e - 127)


# --- the kernel's index functions (copies) ---
def fm3_p4(c):
    G, q, e = c >> 5, (c >> 3) & 3, c & 7
    return q * 32 + G * 8 + (e & 1) * 4 + (e >> 1)


def fm3_p8(c):
    return ((c >> 2) & 3) * 32 + (c >> 4) * 4 + (c & 3)


def issue_off(lane, i):           # fm3_issue: (row, segment, smem offset)
    row, seg = i * 4 + (lane >> 3), lane & 7
    return row, seg, row * SB + ((seg ^ (row & 7)) << 4)


def ldsm_addr(lane, j):           # fm3_ldsm
    mi, rr = lane >> 3, lane & 7
    row, seg = (mi & 1) * 8 + rr, j + (mi >> 1)
    return row * SB + ((seg ^ rr) << 4)


def fp4x8_e4m3(w):                # fk_fp4x8_e4m3
    even = ((w << 2) & 0x1c1c1c1c) | ((w << 4) & 0x80808080)
    odd = ((w >> 2) & 0x1c1c1c1c) | (w & 0x80808080)
    return even & 0xffffffff, odd & 0xffffffff


# --- PTX models ---
def ldmatrix_x4(smem, addrs):
    """addrs[lane] -> r[lane][i] (4 words per lane)."""
    r = [[0] * 4 for _ in range(32)]
    for i in range(4):
        for t in range(32):
            base = addrs[8 * i + t // 4] + 4 * (t % 4)
            r[t][i] = int.from_bytes(bytes(smem[base:base + 4]), 'little')
    return r


def word_bytes(w):
    return [(w >> (8 * i)) & 0xff for i in range(4)]


def mma_e4m3(afr, bfr):
    """afr[lane] = (a0, a1, a2, a3), bfr[lane] = (b0, b1) -> d[lane][0..3]."""
    A = np.zeros((16, 32))
    B = np.zeros((32, 8))
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        a0, a1, a2, a3 = afr[lane]
        b0, b1 = bfr[lane]
        for i, v in enumerate(word_bytes(a0)):
            A[g][4 * q + i] = e4m3(v)
        for i, v in enumerate(word_bytes(a1)):
            A[g + 8][4 * q + i] = e4m3(v)
        for i, v in enumerate(word_bytes(a2)):
            A[g][16 + 4 * q + i] = e4m3(v)
        for i, v in enumerate(word_bytes(a3)):
            A[g + 8][16 + 4 * q + i] = e4m3(v)
        for i, v in enumerate(word_bytes(b0)):
            B[4 * q + i][g] = e4m3(v)
        for i, v in enumerate(word_bytes(b1)):
            B[16 + 4 * q + i][g] = e4m3(v)
    D = A @ B
    return [(D[l >> 2][2 * (l & 3)], D[l >> 2][2 * (l & 3) + 1], D[(l >> 2) + 8][2 * (l & 3)],
             D[(l >> 2) + 8][2 * (l & 3) + 1]) for l in range(32)]


def fp8_codes(n):
    c = rng.integers(0, 256, n)
    c[(c & 0x7f) == 0x7f] = 0x3e   # no NaN
    return c


def tile_case(fp8, K, n_slot, p, NT):
    """One 16-row tile over all of K (four quarters, as four warps do),
    slot rows p .. p + 8*NT - 1 of a slot of n_slot token rows."""
    nb = K // 128
    rb = K if fp8 else K // 2
    # weights: rows of codes; FP4: E8M0 per 32 columns, FP8: one per block
    if fp8:
        wc = fp8_codes(16 * K).reshape(16, K)
        wrow = [bytes(int(v) for v in wc[r]) for r in range(16)]
        sblk = rng.integers(115, 125, nb)
        wval = np.array([[e4m3(int(wc[r][c])) * e8m0(int(sblk[c // 128])) for c in range(K)]
                         for r in range(16)])
    else:
        wc = rng.integers(0, 16, (16, K))
        wrow = [bytes(int(wc[r][2 * i]) | int(wc[r][2 * i + 1]) << 4 for i in range(K // 2))
                for r in range(16)]
        sc = rng.integers(118, 130, (16, K // 32))
        scrow = [bytes(int(v) for v in sc[r]) for r in range(16)]
        wval = np.array([[e2m1(int(wc[r][c])) * e8m0(int(sc[r][c // 32])) for c in range(K)]
                         for r in range(16)])
    # the slot's activation rows: codes and scales, stored in the kernel's order
    xcode = [fp8_codes(K) for _ in range(n_slot)]
    xs = [2.0 ** rng.integers(-8, 3, nb) for _ in range(n_slot)]
    perm = fm3_p8 if fp8 else fm3_p4
    xq = []
    for j in range(n_slot):
        row = [0] * K
        for c in range(K):
            row[(c // 128) * 128 + perm(c % 128)] = int(xcode[j][c])
        xq.append(row)
    xval = [np.array([e4m3(int(xcode[j][c])) * xs[j][c // 128] for c in range(K)])
            for j in range(n_slot)]

    acc_q = []                              # per quarter: acc[lane][n][i]
    nst = rb // SB // 4
    nq = nb // 4
    bps = 1 if fp8 else 2
    for qt in range(4):
        acc = [[[0.0] * 4 for _ in range(NT)] for _ in range(32)]
        scf8 = [e8m0(int(sblk[qt * nq + i])) for i in range(nq)] if fp8 else None
        for si in range(nst):
            st = qt * nst + si
            smem = bytearray(TILE_B + 128)
            for lane in range(32):
                for i in range(4):
                    row, seg, off = issue_off(lane, i)
                    smem[off:off + 16] = wrow[row][st * SB + seg * 16:st * SB + seg * 16 + 16]
                if not fp8:
                    r, h = lane >> 1, lane & 1
                    src = scrow[r][st * 8 + h * 4:st * 8 + h * 4 + 4]
                    smem[TILE_B + lane * 4:TILE_B + lane * 4 + 4] = src
            scf = [0.0] * (16 * SCF)
            if not fp8:                      # fm3_scales
                for lane in range(32):
                    for i in range(4):
                        v = smem[TILE_B + lane * 4 + i]
                        scf[(lane >> 1) * SCF + (lane & 1) * 4 + i] = e8m0(v)
            for b in range(bps):
                kb = qt * nq + si * bps + b
                f = scf8[kb - qt * nq] if fp8 else 64.0
                # fm3_act: B words and C scales of each thread
                xw = [[None] * NT for _ in range(32)]
                xc = [[None] * NT for _ in range(32)]
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    for n in range(NT):
                        jb = min(p + n * 8 + g, n_slot - 1)
                        base = kb * 128 + q * 32
                        xw[lane][n] = [int.from_bytes(bytes(xq[jb][base + 4 * w:base + 4 * w + 4]),
                                                      'little') for w in range(8)]
                        xc[lane][n] = [xs[min(p + n * 8 + 2 * q + c, n_slot - 1)][kb]
                                       for c in range(2)]
                blk = [[[0.0] * 4 for _ in range(NT)] for _ in range(32)]
                if fp8:
                    for m in range(4):
                        r = ldmatrix_x4(smem, [ldsm_addr(l, 2 * m) for l in range(32)])
                        for n in range(NT):
                            d = mma_e4m3([tuple(r[l]) for l in range(32)],
                                         [(xw[l][n][2 * m], xw[l][n][2 * m + 1])
                                          for l in range(32)])
                            for l in range(32):
                                for i in range(4):
                                    blk[l][n][i] += d[l][i]
                else:
                    for pr in range(2):
                        r = ldmatrix_x4(smem, [ldsm_addr(l, 4 * b + 2 * pr) for l in range(32)])
                        for gi in range(2):
                            m = 2 * pr + gi
                            afr = []
                            for l in range(32):
                                a0, a2 = fp4x8_e4m3(r[l][2 * gi])
                                a1, a3 = fp4x8_e4m3(r[l][2 * gi + 1])
                                afr.append((a0, a1, a2, a3))
                            for n in range(NT):
                                d = mma_e4m3(afr, [(xw[l][n][2 * m], xw[l][n][2 * m + 1])
                                                   for l in range(32)])
                                for l in range(32):
                                    g = l >> 2
                                    w0 = scf[g * SCF + 4 * b + 2 * pr + gi]
                                    w8 = scf[(g + 8) * SCF + 4 * b + 2 * pr + gi]
                                    for i in range(4):
                                        blk[l][n][i] += d[l][i] * (w0 if i < 2 else w8)
                for l in range(32):
                    for n in range(NT):
                        for i in range(4):
                            acc[l][n][i] += blk[l][n][i] * xc[l][n][i & 1] * f
        acc_q.append(acc)
    # the four quarters in order, compared with the plain dot product
    worst = 0.0
    for l in range(32):
        g, q = l >> 2, l & 3
        for n in range(NT):
            for i in range(4):
                j = p + n * 8 + 2 * q + (i & 1)
                if j >= n_slot:
                    continue
                row = g + 8 * (i >> 1)
                got = ((acc_q[0][l][n][i] + acc_q[1][l][n][i]) + acc_q[2][l][n][i]) + \
                    acc_q[3][l][n][i]
                ref = float(np.dot(wval[row], xval[j]))
                scale = float(np.dot(np.abs(wval[row]), np.abs(xval[j]))) or 1.0
                worst = max(worst, abs(got - ref) / scale)
    return worst


def main():
    bad = 0
    # the column orders must be permutations of each 128-column block
    for name, fn in (('p4', fm3_p4), ('p8', fm3_p8)):
        if sorted(fn(c) for c in range(128)) != list(range(128)):
            print('FAIL %s is not a permutation' % name)
            bad = 1
    # the cp.async placement must fill every byte of a stage once, and the
    # 8 lanes of each quarter-warp phase of fm3_issue and of fm3_ldsm must
    # hit 8 distinct 16-byte bank groups
    seen = set()
    for lane in range(32):
        for i in range(4):
            seen.add(issue_off(lane, i)[2])
    if len(seen) != 128:
        print('FAIL fm3_issue does not cover the stage')
        bad = 1
    for i in range(4):
        for ph in range(4):
            if len({(issue_off(l, i)[2] % 128) // 16 for l in range(8 * ph, 8 * ph + 8)}) != 8:
                print('FAIL fm3_issue bank conflict (i %d phase %d)' % (i, ph))
                bad = 1
    for j in range(0, 8, 2):
        for mi in range(4):
            if len({(ldsm_addr(l, j) % 128) // 16 for l in range(8 * mi, 8 * mi + 8)}) != 8:
                print('FAIL fm3_ldsm bank conflict (j %d matrix %d)' % (j, mi))
                bad = 1
    cases = [
        ('fp4 up   K=4096 n=1  NT=1', 0, 4096, 1, 0, 1),
        ('fp4 down K=2048 n=3  NT=1', 0, 2048, 3, 0, 1),
        ('fp4 down K=2048 n=13 NT=2', 0, 2048, 13, 0, 2),
        ('fp8 up   K=4096 n=16 NT=2', 1, 4096, 16, 0, 2),
        ('fp8 down K=2048 n=21 p=16 NT=1', 1, 2048, 21, 16, 1),
    ]
    for name, fp8, K, n, p, NT in cases:
        w = tile_case(fp8, K, n, p, NT)
        ok = w < 1e-12
        bad |= not ok
        print('%s %-32s max |got - ref| / sum |terms| = %.2e' % ('OK  ' if ok else 'FAIL', name, w))
    return bad


if __name__ == '__main__':
    sys.exit(main())
