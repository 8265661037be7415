#!/usr/bin/env python3
# fw_layout_sim.py — desk check of the Hopper GEMM's data layout
# (kernels/cuda/fast_gemm.cu, fw_kernel) without a GPU.
#
#   python3 tests/gpu/fw_layout_sim.py      (numpy; ~15 s)
#
# Replays, in Python, what fw_kernel moves where: the cp.async chunk
# placement of the weight rows (XOR-swizzled A stages) and of the token rows
# (B stages of no-swizzle K-major core matrices), each thread's decoding of
# its A fragments (FP4 bytes + group scales, FP8 byte pairs, BF16 words), the
# permuted column order of the activations (fw_perm), and the epilogues'
# reading of the D fragment (FG_LINEAR rows, FG_UP g/u pairs).  The wgmma
# itself is modelled by the PTX ISA's definitions: register A fragment of
# m64nNk16 (warp w rows 16w..16w+15; thread (g, q): reg0 row g k 2q,2q+1;
# reg1 row g+8; reg2 row g k 2q+8,2q+9; reg3 row g+8), B element (k, n) at
# start + (n/8)*SBO + (n%8)*16 + (k/8)*LBO + (k%8)*2, and D element
# d[4j+i] = (row g + 8*(i>>1), column 8j + 2q + (i&1)).  Each case must
# equal a plain GEMM to rounding ("OK"); the index functions are copies of
# the kernel's, so keep them in step when the kernel changes.  FP8 block
# scales (one power of two per 128 weight rows x 128 columns) are applied as
# the kernel does: per thread, the scale row of its absolute weight row.
# The grouped mode (FG_GROUPED, linear_grouped) runs every block of G
# groups of R rows: block n0 reads x columns (n0 // R) * K .. of rows G * K
# values apart, against out[t, o] = W[o] . x[t, (o // R) * K ..].  Exit
# status 1 when a case is off.
import numpy as np
rng = np.random.default_rng(1)
FP4, FP8, BF16 = 1, 0, 2
LIN, UP = 0, 1
AROW = {FP4: 64, FP8: 128, BF16: 256}

def fg_a_off(row, c): return row * 256 + ((c ^ ((row & 1) << 2)) << 4)
def fg_b_off(wf, row, c):
    return row * 128 + ((c ^ ((row & 3) << 1)) << 4) if wf == FP8 else row * 64 + ((c ^ ((row >> 1) & 3)) << 4)
def fw_a_off(wf, r, c): return fg_a_off(r, c) if wf == BF16 else fg_b_off(wf, r, c)
def fw_perm(c): return (c & ~31) | ((c >> 1) & 1) << 4 | (c & 1) << 3 | ((c >> 3) & 3) << 1 | ((c >> 2) & 1)
def fw_wrow(epi, r, n0):
    if epi == UP: return n0 + (r >> 4) * 8 + (r & 7), (r >> 3) & 1
    return n0 + r, 0

E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6]
def e2m1(c): return (-1 if c & 8 else 1) * E2M1[c & 7]

def run(wf, epi, NWG, BN, K, ntok, ng=1, R=0):
    RA = 64 * NWG
    grouped = R > 0                      # FG_GROUPED: ng groups of R rows, x (ntok, ng*K)
    assert not grouped or (epi == LIN and R % RA == 0)
    nrows = ng * R if grouped else 128 if epi == UP else RA   # weight rows of each matrix used
    # weights: value arrays W1 (and W3) [rows, K] as python float; raw bytes per stage
    W = [rng.integers(0, 256, size=(nrows, K // 2 if wf == FP4 else K * (2 if wf == BF16 else 1)), dtype=np.uint8) for _ in range(2)]
    gs = [rng.integers(120, 130, size=(nrows, K // 32)) for _ in range(2)]  # fp4 group scale exps
    s8 = [rng.integers(-3, 4, size=((nrows + 127) // 128, K // 128)) for _ in range(2)]  # fp8 block exps
    def wval(m, row, col):
        if wf == FP4:
            b = W[m][row, col // 2]; code = (b & 15) if col % 2 == 0 else (b >> 4)
            return e2m1(int(code)) * 2.0 ** (int(gs[m][row, col // 32]) - 127)
        if wf == FP8:   # treat bytes as small ints for the index check
            return (float(W[m][row, col]) - 128.0) * 2.0 ** int(s8[m][row // 128, col // 128])
        return float(int(W[m][row, 2 * col]) + 256 * int(W[m][row, 2 * col + 1]))
    x = rng.standard_normal((ntok, ng * K if grouped else K))
    xp = np.zeros_like(x)
    for c in range(x.shape[1]): xp[:, fw_perm(c)] = x[:, c]   # fw_prep (values only; whole rows)
    nkt = K // 128
    out = np.full((ntok, nrows), np.nan)
    for n0 in range(0, nrows, RA) if grouped else (0,):
        b0 = (n0 // R) * K if grouped else 0                 # fw_load: the group's first column
        d = np.zeros((NWG, 4, 32, BN // 2))
        for kb in range(nkt):
            # --- fw_load: A stage bytes, B stage (as element array addressed by byte) ---
            sa = np.zeros(RA * AROW[wf], dtype=np.uint8)
            ss = np.zeros(RA * 4, dtype=np.int64)
            CH = AROW[wf] // 16
            for i in range(RA * CH):
                r, c = i // CH, i % CH
                wr, m = fw_wrow(epi, r, n0)
                if wf == FP4: src = W[m][wr, kb * 64 + c * 16: kb * 64 + c * 16 + 16]
                elif wf == FP8: src = W[m][wr, kb * 128 + c * 16: kb * 128 + c * 16 + 16]
                else: src = W[m][wr, kb * 256 + c * 16: kb * 256 + c * 16 + 16]
                o = fw_a_off(wf, r, c); assert (sa[o:o + 16] == 0).all()
                sa[o:o + 16] = src
            if wf == FP4:
                for t in range(RA):
                    wr, m = fw_wrow(epi, t, n0); ss[t * 4:t * 4 + 4] = gs[m][wr, kb * 4:kb * 4 + 4]
            sb = {}   # byte offset -> element value (bf16 granule)
            for i in range(BN * 16):
                n, c = 8 * (i >> 7) + (i & 7), (i >> 3) & 15   # fw_src_make's copy i
                dd = ((n >> 3) * 16 + c) * 128 + (n & 7) * 16
                for e in range(8):
                    sb[dd + 2 * e] = xp[n, b0 + kb * 128 + c * 8 + e] if n < ntok else 0.0
            # --- fw_stage per warpgroup / warp / lane, then the wgmma semantics ---
            for wg in range(NWG):
                base = wg * 64 * AROW[wf]
                A = np.zeros((8, 64, 16))   # per k16 step: the 64 x 16 A matrix assembled from fragments
                for w in range(4):
                    for lane in range(32):
                        g, q = lane >> 2, lane & 3
                        ra = w * 16 + g
                        for G in range(4):
                            for s2 in range(2):
                                s = 2 * G + s2
                                for reg in range(4):
                                    row = ra + (8 if reg in (1, 3) else 0)
                                    hi = reg >= 2
                                    pn = 2 * s2 + (1 if hi else 0)   # pair: columns 8q + pn, 8q + pn + 4
                                    if wf == FP4:
                                        o = base + fg_b_off(FP4, row, G) + q * 4
                                        word = int.from_bytes(bytes(sa[o:o + 4]), 'little')
                                        sc = 2.0 ** (int(ss[(wg * 64 + row) * 4 + G]) - 127)
                                        vals = [e2m1((word >> (4 * pn)) & 15) * sc, e2m1((word >> (4 * pn + 16)) & 15) * sc]
                                    elif wf == FP8:
                                        c = 2 * G + (q >> 1); o = base + fg_b_off(FP8, row, c) + (q & 1) * 8
                                        v8 = sa[o:o + 8]
                                        pair = (v8[pn], v8[pn + 4])
                                        wr8, m8 = fw_wrow(epi, wg * 64 + row, n0)   # block scale row
                                        sc = 2.0 ** int(s8[m8][wr8 // 128, kb])
                                        vals = [(float(pair[0]) - 128) * sc, (float(pair[1]) - 128) * sc]
                                    else:
                                        o = base + fg_a_off(row, 4 * G + q); v16 = sa[o:o + 16]
                                        lo, hh = v16[2 * pn: 2 * pn + 2], v16[2 * pn + 8: 2 * pn + 10]
                                        vals = [float(int(lo[0]) + 256 * int(lo[1])), float(int(hh[0]) + 256 * int(hh[1]))]
                                    kk = 2 * q + (8 if hi else 0)
                                    A[s, 16 * w + (row - ra) + g, kk] = vals[0]
                                    A[s, 16 * w + (row - ra) + g, kk + 1] = vals[1]
                for s in range(8):
                    start = 256 * s; LBO, SBO = 128, 2048
                    B = np.zeros((16, BN))
                    for k in range(16):
                        for n in range(BN):
                            B[k, n] = sb[start + (n // 8) * SBO + (n % 8) * 16 + (k // 8) * LBO + (k % 8) * 2]
                    Dm = A[s] @ B   # 64 x BN
                    for w in range(4):
                        for lane in range(32):
                            g, q = lane >> 2, lane & 3
                            for j in range(BN // 8):
                                for i in range(4):
                                    d[wg, w, lane, 4 * j + i] += Dm[16 * w + g + 8 * (i >> 1), 8 * j + 2 * q + (i & 1)]
        # --- epilogue: scatter into out[token][weight row] (LINEAR; UP below) ---
        if epi == LIN:
            for wg in range(NWG):
                for w in range(4):
                    for lane in range(32):
                        g, q = lane >> 2, lane & 3; ra = w * 16 + g
                        for j in range(BN // 8):
                            for i in range(4):
                                n = 8 * j + 2 * q + (i & 1)
                                if n < ntok: out[n, n0 + wg * 64 + ra + 8 * (i >> 1)] = d[wg, w, lane, 4 * j + i]
    if epi == LIN:
        xo = lambda r: (r // R) * K if grouped else 0   # row r's first x column
        ref = np.array([[sum(wval(0, r, c) * x[t, xo(r) + c] for c in range(K)) for r in range(nrows)] for t in range(ntok)])
        return np.abs(out - ref).max() / np.abs(ref).max()
    gout = np.full((ntok, 128), np.nan); uout = np.full((ntok, 128), np.nan)
    for wg in range(NWG):
        for w in range(4):
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                c = n0 + wg * 32 + w * 8 + g
                for j in range(BN // 8):
                    for ii in range(2):
                        n = 8 * j + 2 * q + ii
                        if n < ntok:
                            gout[n, c] = d[wg, w, lane, 4 * j + ii]; uout[n, c] = d[wg, w, lane, 4 * j + 2 + ii]
    rg = np.array([[sum(wval(0, r, c) * x[t, c] for c in range(K)) for r in range(128)] for t in range(ntok)])
    ru = np.array([[sum(wval(1, r, c) * x[t, c] for c in range(K)) for r in range(128)] for t in range(ntok)])
    return max(np.abs(gout - rg).max() / np.abs(rg).max(), np.abs(uout - ru).max() / np.abs(ru).max())

bad = 0
for wf in (FP4, FP8, BF16):
    for epi, nwg in ((LIN, 1), (LIN, 2), (UP, 4)):
        if wf == BF16 and epi == UP:
            continue
        for BN, nt in ((16, 13), (32, 32)):
            err = run(wf, epi, nwg, BN, 256, nt)
            bad += not err < 1e-12
            print("wf", {FP4: "fp4", FP8: "fp8", BF16: "bf16"}[wf], "epi", ("linear", "up")[epi],
                  "nwg", nwg, "BN", BN, "tokens", nt, "rel err %.2e" % err,
                  "OK" if err < 1e-12 else "BAD")
# grouped (linear_grouped): FP8, 2 warpgroups (128 rows), 3 groups of 128 or 2 of 256 rows
for ng, R, BN, nt in ((3, 128, 16, 11), (2, 256, 32, 32)):
    err = run(FP8, LIN, 2, BN, 256, nt, ng, R)
    bad += not err < 1e-12
    print("wf fp8 epi grouped nwg 2 groups", ng, "rows", R, "BN", BN, "tokens", nt,
          "rel err %.2e" % err, "OK" if err < 1e-12 else "BAD")
raise SystemExit(1 if bad else 0)
