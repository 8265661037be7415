/*
 * fast_gemm.cu — tensor-core GEMMs for prefill (issue 7): the FP8 linear
 * under REF numerics and the routed + shared MoE at many token rows, used by
 * cuda_linear / cuda_moe when the fast kernels are on and the decode
 * kernels (fast_linear.cu, fast_moe.cu) would re-read the weights once per
 * 16 rows (cuda_fast_gemm_linear_ok, cuda_fast_gemm_moe_ok).
 *
 * The tile kernel (fg_kernel).  A block of 8 warps computes a tile of
 * BM = 32*MT activation rows (the A operand, M) by 128 weight rows (the B
 * operand, N), streaming K through shared memory in stages of 128 columns
 * (one scale block) with a 3-stage cp.async pipeline.  Warps are 2 (M) x 4
 * (N), each a 16*MT x 32 sub-tile of MT m16 tiles x 4 n8 tiles.  The mma
 * is m16n8k16 with fp32 accumulators, as in the decode kernels (fast.cuh):
 *   FP8 weights  A = the REF FP8 activation values as f16, B = E4M3 codes
 *                converted to f16 pairs in registers (exact);
 *   FP4 weights  A = the same values as bf16, B = E2M1 pairs from the
 *                per-lane table times the row's E8M0 group scale (exact).
 * K order: in each 32-column chunk, thread q of a quad reads the 8
 * consecutive columns 8q..8q+7 of its A rows (one 16-byte load per row) and
 * of its B row (8 FP8 bytes or 4 FP4 bytes); mma step s (0, 1) takes
 * columns 8q+4s+{0,1} as k slots 2q, 2q+1 and 8q+4s+{2,3} as slots 2q+8,
 * 2q+9.  A and B agree, so each mma adds 16 exact products of the chunk and
 * the two steps cover its 32 columns.  Shared memory rows are XOR-swizzled
 * in 16-byte chunks so that these loads are free of bank conflicts.
 *
 * Numerics (REF): per 128-column block the products of the block are summed
 * by the tensor cores in fp32 (blk), then acc += blk * (s_x * s_w) (FP8) or
 * acc += blk * s_x (FP4: the group scales are in the weights), blocks in
 * order: the op contract's per-block scaling, another order inside a block
 * than the exact path only.  Each output depends on its own row and column
 * only (no split of K, no reduction across rows): the bits do not depend on
 * T, on the tile shape MT or on the other rows.  They do differ (by that
 * rounding) from the decode kernels', which add their K slices in another
 * tree: a row computed by the decode kernels and by the GEMM may differ in
 * the last bit.  So calls of up to FG_DECODE_ROWS rows always take the
 * decode kernels: decode steps and speculative verify / draft steps (2 rows
 * per stream, up to 32 at batch 16) then compute every row with the same
 * bits whatever the batch, which is what makes speculative greedy decoding
 * reproduce plain greedy decoding token for token on the GPU.
 *
 * MoE (cuda_fast_gemm_moe), no host synchronisation:
 *   1. x quantized (fk_quant): bf16 values for the routed experts, f16 for
 *      the shared one, with the scales;
 *   2. grouping (fg_group_kernel, one block): counts per expert, then
 *      tiles of at most BM rows per active (held) expert in increasing id
 *      order, (expert, first row, rows) each, and the (token, pick) rows
 *      r = t*k + j of each expert; the grid is the upper bound
 *      ceil(T*k / BM) + min(E, T*k) of tiles, blocks past the count leave;
 *   3. up (FP4, routed tiles; FP8, the shared expert's dense tiles): a
 *      block takes 64 columns of I from w1 and the same 64 from w3 (its 128
 *      B rows), and writes h = bf16(silu(min(g, L)) * clamp(u, ±L) [* w])
 *      from the bf16-rounded g, u (the exact path's expression);
 *   4. h quantized per row (routed rows bf16, shared rows f16);
 *   5. down (w2): y[r] = bf16(w2 · h[r]), r the pick row (t*k + j) or
 *      T*k + t for the shared expert: moe_parts' layout;
 *   6. moe: the exact path's combine (cuda_moe_combine); moe_parts: the
 *      caller's (zeroed) array holds the held rows, nothing else is done.
 */
#include "kernels/cuda/fast.cuh"

#include <stdlib.h>
#include <string.h>

#define FG_THREADS 256
#define FG_BN 128            /* B (weight) rows per block */
#define FG_STAGES 3          /* cp.async pipeline depth (stages of 128 columns) */
#define FG_MAX_E 4096        /* experts (grouping counts in shared memory) */
#define FG_MAX_K 64          /* picks per token (the exact path's bound) */
#define FG_MOE_MIN_T 97      /* the decode MoE (fast_moe.cu) takes T <= 96 */
#define FG_SMS 132           /* H200 SMs: the linear's cost model */
#define FG_MAX_DEV 64        /* devices whose kernel attributes are remembered */

/* Weight format of a launch. */
enum {
    FG_FP8 = 0,     /* E4M3, 128x128 E8M0 block scales; f16 activations */
    FG_FP4 = 1,     /* E2M1 pairs, E8M0 scale per 32 columns; bf16 activations */
};

/* What a block writes. */
enum {
    FG_LINEAR = 0,  /* out[row, n] = bf16(acc) for its 128 weight rows (also w2) */
    FG_UP = 1,      /* 64 rows of w1 and the same 64 of w3: h = SwiGLU */
};

/* Everything a launch needs, by value. */
struct fg_args {
    struct dsv4_linear W, W3;       /* dense tiles: the weight (FG_UP: w1, w3) */
    const struct dsv4_expert_w *table;  /* routed tiles: device expert structs,
                                           else NULL */
    const int32_t *grp;             /* routed: the grouping (fg_group_kernel) */
    int A;                          /* routed: tile slots (the grid's y) */
    int down;                       /* routed: w2 (A row = pick row), else w1/w3
                                       (A row = pick row / k) */
    int k;
    const uint16_t *xa;             /* (rows, K) activation values, f16 or bf16 */
    const float *sx;                /* (rows, K/128) their scales */
    float *out;                     /* (rows, ldo) */
    int64_t ldo;
    const float *weights;           /* routed FG_UP: (T*k) route weights; else NULL */
    int M;                          /* dense: rows; A row i -> arow0 + i, out row
                                       orow0 + i */
    int arow0, orow0;
    int K;                          /* weight n_in */
    float lim;                      /* SwiGLU limit (<= 0: none) */
};

/* Bytes of one B row per stage. */
#define FG_BROW(WF) ((WF) == FG_FP8 ? 128 : 64)

/* Dynamic shared memory of a launch: per stage A (BM x 256 bytes), B (128 x
 * BROW), FP4 group scales (128 x 4), activation scales (BM floats); then the
 * row maps (2 x BM ints) and, for FP4, the decoding table. */
static size_t
fg_smem_bytes(int wf, int mt)
{
    size_t bm = 32 * (size_t)mt;

    return FG_STAGES * (bm * 256 + FG_BN * (size_t)FG_BROW(wf) + FG_BN * 4 + bm * 4) +
           2 * bm * 4 + (wf == FG_FP4 ? FK_LUT_WORDS * 4 : 0);
}

/* --- cp.async --------------------------------------------------------------------- */

/* 16 bytes global -> shared; valid == 0: the 16 bytes are zeroed (src not read). */
static __device__ __forceinline__ void
fg_cp16(void *dst, const void *src, int valid)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);

    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(d), "l"(src), "r"(valid ? 16 : 0));
}

/* 4 bytes, the same way. */
static __device__ __forceinline__ void
fg_cp4(void *dst, const void *src, int valid)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);

    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(d), "l"(src), "r"(valid ? 4 : 0));
}

static __device__ __forceinline__ void
fg_commit(void)
{
    asm volatile("cp.async.commit_group;");
}

/* Wait until at most N groups are pending. */
template <int N>
static __device__ __forceinline__ void
fg_wait(void)
{
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

/* --- the tile kernel ------------------------------------------------------------- */

/* Shared memory of a block, carved per fg_smem_bytes. */
struct fg_smem {
    unsigned char *a, *b, *s;   /* stage arrays: A values, B bytes, FP4 group scales */
    float *x;                   /* stage array: activation scales */
    int *arow, *orow;           /* (BM) A row and output row of tile row i; -1: none */
    uint32_t *lut;              /* FP4 table */
};

/* Byte offset of logical 16-byte chunk c of row `row` in a stage:
 * A rows (256 bytes): chunk ^ 4 on odd rows;
 * FP8 B rows (128 bytes): chunk pairs ^ (row & 3);
 * FP4 B rows (64 bytes): chunk ^ ((row >> 1) & 3). */
static __device__ __forceinline__ int
fg_a_off(int row, int c)
{
    return row * 256 + ((c ^ ((row & 1) << 2)) << 4);
}

template <int WF>
static __device__ __forceinline__ int
fg_b_off(int row, int c)
{
    return WF == FG_FP8 ? row * 128 + ((c ^ ((row & 3) << 1)) << 4)
                        : row * 64 + ((c ^ ((row >> 1) & 3)) << 4);
}

/* B (smem) row of warp column wn's n-tile j: FG_UP puts w1's 64 rows first,
 * w3's next, so that n-tiles j and j + 2 are g and u of the same columns. */
template <int EPI>
static __device__ __forceinline__ int
fg_brow(int wn, int j)
{
    return EPI == FG_UP ? (j >> 1) * 64 + wn * 16 + (j & 1) * 8 : wn * 32 + j * 8;
}

/* Queue the loads of 128-column block kb into stage st. */
template <int WF, int EPI, int MT>
static __device__ __forceinline__ void
fg_load(const struct fg_smem &sm, int st, int kb, const struct fg_args &a,
        const struct dsv4_linear &L1, const struct dsv4_linear &L3, int n0)
{
    const int BM = 32 * MT;
    int tid = threadIdx.x, K = a.K, nb = K / 128;
    unsigned char *as = sm.a + st * BM * 256;
    unsigned char *bs = sm.b + st * FG_BN * FG_BROW(WF);

#pragma unroll
    for (int it = 0; it < BM * 16 / FG_THREADS; it++) {
        int row = (tid >> 4) + it * (FG_THREADS / 16), c = tid & 15, r = sm.arow[row];
        const uint16_t *src = a.xa + (int64_t)(r < 0 ? 0 : r) * K + kb * 128 + c * 8;

        fg_cp16(as + fg_a_off(row, c), src, r >= 0);
    }
    if (WF == FG_FP8) {
#pragma unroll
        for (int it = 0; it < 4; it++) {
            int row = (tid >> 3) + it * 32, c = tid & 7;
            const struct dsv4_linear &L = EPI == FG_UP && row >= 64 ? L3 : L1;
            int wrow = n0 + (EPI == FG_UP ? (row & 63) : row);

            fg_cp16(bs + fg_b_off<WF>(row, c),
                    (const uint8_t *)L.w + (int64_t)wrow * K + kb * 128 + c * 16, 1);
        }
    } else {
#pragma unroll
        for (int it = 0; it < 2; it++) {
            int row = (tid >> 2) + it * 64, c = tid & 3;
            const struct dsv4_linear &L = EPI == FG_UP && row >= 64 ? L3 : L1;
            int wrow = n0 + (EPI == FG_UP ? (row & 63) : row);

            fg_cp16(bs + fg_b_off<WF>(row, c),
                    (const uint8_t *)L.w + (int64_t)wrow * (K / 2) + kb * 64 + c * 16, 1);
        }
        if (tid < FG_BN) {
            int row = tid;
            const struct dsv4_linear &L = EPI == FG_UP && row >= 64 ? L3 : L1;
            int wrow = n0 + (EPI == FG_UP ? (row & 63) : row);

            fg_cp4(sm.s + st * FG_BN * 4 + row * 4, L.scale + (int64_t)wrow * (K / 32) + kb * 4,
                   1);
        }
    }
    if (tid >= FG_THREADS - BM) {
        int i = tid - (FG_THREADS - BM), r = sm.arow[i];

        fg_cp4(sm.x + st * BM + i, a.sx + (int64_t)(r < 0 ? 0 : r) * nb + kb, r >= 0);
    }
}

/*
 * acc += one stage (128 columns): the block sums blk of the warp's
 * sub-tile, then acc += blk * (s_x * sw[j]).  wm, wn: the warp's place.
 */
template <int WF, int EPI, int MT>
static __device__ __forceinline__ void
fg_stage(float (&acc)[MT][4][4], const struct fg_smem &sm, int st, const float (&sw)[4],
         int wm, int wn)
{
    const int BM = 32 * MT;
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const unsigned char *as = sm.a + st * BM * 256;
    const unsigned char *bs = sm.b + st * FG_BN * FG_BROW(WF);
    const unsigned char *ss = sm.s + st * FG_BN * 4;
    const uint32_t *lt = sm.lut + lane;
    float blk[MT][4][4];

    fk_zero(blk);
#pragma unroll
    for (int kc = 0; kc < 4; kc++) {
        uint4 av[MT][2];
        uint32_t bv[4][2][2];

#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = wm * 16 * MT + m * 16 + g + 8 * h;

                av[m][h] = *(const uint4 *)(as + fg_a_off(row, kc * 4 + q));
            }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int row = fg_brow<EPI>(wn, j) + g;

            if (WF == FG_FP8) {
                uint2 w = *(const uint2 *)(bs + fg_b_off<WF>(row, kc * 2 + (q >> 1)) +
                                           (q & 1) * 8);

                bv[j][0][0] = fk_e4m3x2(w.x);
                bv[j][0][1] = fk_e4m3x2(w.x >> 16);
                bv[j][1][0] = fk_e4m3x2(w.y);
                bv[j][1][1] = fk_e4m3x2(w.y >> 16);
            } else {
                uint32_t w = *(const uint32_t *)(bs + fg_b_off<WF>(row, kc) + q * 4);
                uint32_t sc = fk_e8m0_bf16x2(ss[row * 4 + kc]);

#pragma unroll
                for (int s = 0; s < 2; s++) {
                    bv[j][s][0] = fk_bmul2(lt[((w >> (16 * s)) & 0xffu) * 32], sc);
                    bv[j][s][1] = fk_bmul2(lt[((w >> (16 * s + 8)) & 0xffu) * 32], sc);
                }
            }
        }
#pragma unroll
        for (int s = 0; s < 2; s++)
#pragma unroll
            for (int m = 0; m < MT; m++) {
                uint32_t a0 = fk_word(av[m][0], 2 * s), a1 = fk_word(av[m][1], 2 * s);
                uint32_t a2 = fk_word(av[m][0], 2 * s + 1), a3 = fk_word(av[m][1], 2 * s + 1);

#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (WF == FG_FP8)
                        fk_mma_f16(blk[m][j], a0, a1, a2, a3, bv[j][s][0], bv[j][s][1]);
                    else
                        fk_mma_bf16(blk[m][j], a0, a1, a2, a3, bv[j][s][0], bv[j][s][1]);
                }
            }
    }
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float xs = sm.x[st * BM + wm * 16 * MT + m * 16 + g + 8 * h];

#pragma unroll
            for (int j = 0; j < 4; j++) {
                float f = xs * sw[j];

                acc[m][j][2 * h] += blk[m][j][2 * h] * f;
                acc[m][j][2 * h + 1] += blk[m][j][2 * h + 1] * f;
            }
        }
}

/*
 * Grid (N tiles, row tiles).  Dense (a.table == NULL): row tile y is rows
 * y*BM .. of a.M.  Routed: tile slot y of the grouping, or nothing.
 */
template <int WF, int EPI, int MT>
static __global__ void __launch_bounds__(FG_THREADS, 1)
fg_kernel(struct fg_args a)
{
    extern __shared__ __align__(16) unsigned char fg_sm[];
    const int BM = 32 * MT;
    struct fg_smem sm;
    struct dsv4_linear L1, L3;
    int tid = threadIdx.x, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
    int lane = tid & 31, g = lane >> 2, q = lane & 3;
    int n0 = blockIdx.x * (EPI == FG_UP ? 64 : 128), nkt = a.K / 128, nb = a.K / 128;
    const uint8_t *swp[4];
    float acc[MT][4][4];

    sm.a = fg_sm;
    sm.b = sm.a + FG_STAGES * BM * 256;
    sm.s = sm.b + FG_STAGES * FG_BN * FG_BROW(WF);
    sm.x = (float *)(sm.s + FG_STAGES * FG_BN * 4);
    sm.arow = (int *)(sm.x + FG_STAGES * BM);
    sm.orow = sm.arow + BM;
    sm.lut = (uint32_t *)(sm.orow + BM);

    if (a.table != NULL) {
        const int32_t *tl = a.grp + 1 + 3 * blockIdx.y, *rows;
        const struct dsv4_expert_w *E;
        int n_rows;

        if ((int)blockIdx.y >= a.grp[0])
            return;   /* an idle slot: the whole block leaves */
        E = &a.table[tl[0]];
        rows = a.grp + 1 + 3 * a.A + tl[1];
        n_rows = tl[2];
        L1 = a.down ? E->w2 : E->w1;
        L3 = E->w3;
        for (int i = tid; i < BM; i += FG_THREADS) {
            int r = i < n_rows ? rows[i] : -1;

            sm.orow[i] = r;
            sm.arow[i] = r < 0 ? -1 : (a.down ? r : r / a.k);
        }
    } else {
        int m0 = blockIdx.y * BM;

        L1 = a.W;
        L3 = a.W3;
        for (int i = tid; i < BM; i += FG_THREADS) {
            int ok = m0 + i < a.M;

            sm.arow[i] = ok ? a.arow0 + m0 + i : -1;
            sm.orow[i] = ok ? a.orow0 + m0 + i : -1;
        }
    }
    if (WF == FG_FP4)
        fk_lut_fill(sm.lut);   /* ends with __syncthreads */
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; j++)
        swp[j] = WF == FG_FP8 ? (EPI == FG_UP && j >= 2 ? L3 : L1).scale +
                                (int64_t)(n0 / 128) * nb : NULL;
    fk_zero(acc);

    for (int s = 0; s < FG_STAGES - 1; s++) {
        if (s < nkt)
            fg_load<WF, EPI, MT>(sm, s, s, a, L1, L3, n0);
        fg_commit();
    }
    for (int kt = 0; kt < nkt; kt++) {
        int nx = kt + FG_STAGES - 1;
        float sw[4];

        fg_wait<FG_STAGES - 2>();
        __syncthreads();   /* stage kt landed for all; stage nx's old data is used up */
        if (nx < nkt)
            fg_load<WF, EPI, MT>(sm, nx % FG_STAGES, nx, a, L1, L3, n0);
        fg_commit();
#pragma unroll
        for (int j = 0; j < 4; j++)
            sw[j] = WF == FG_FP8 ? cu_e8m0_to_f32(__ldg(swp[j] + kt)) : 1.0f;
        fg_stage<WF, EPI, MT>(acc, sm, kt % FG_STAGES, sw, wm, wn);
    }

    /* C fragment: acc[m][j][i] is row wm*16*MT + m*16 + g + 8*(i >> 1), B row
     * fg_brow(wn, j) + 2q + (i & 1) */
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = sm.orow[wm * 16 * MT + m * 16 + g + 8 * (i >> 1)];

            if (r < 0)
                continue;
            if (EPI == FG_UP) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    float gv = cu_bf16_round(acc[m][j][i]), uv = cu_bf16_round(acc[m][j + 2][i]);
                    float v;

                    if (a.lim > 0.0f) {
                        gv = gv < a.lim ? gv : a.lim;
                        uv = uv < -a.lim ? -a.lim : uv > a.lim ? a.lim : uv;
                    }
                    v = gv / (1.0f + cu_expf(-gv)) * uv;
                    if (a.weights != NULL)
                        v *= a.weights[r];
                    a.out[(int64_t)r * a.ldo + n0 + wn * 16 + j * 8 + 2 * q + (i & 1)] =
                        cu_bf16_round(v);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    a.out[(int64_t)r * a.ldo + n0 + wn * 32 + j * 8 + 2 * q + (i & 1)] =
                        cu_bf16_round(acc[m][j][i]);
            }
        }
}

/* --- grouping ---------------------------------------------------------------------- */

/*
 * One block; dynamic shared memory 3 * E ints.  grp: [0] the number of
 * tiles; tile i at 1 + 3i: expert, first entry in rows, rows (<= BM); rows
 * at 1 + 3A: the pick rows of each active expert, experts in increasing id
 * order (inside an expert in any order: rows are computed independently).
 * skip_unheld: experts without weights (held by another rank) are left out.
 */
static __global__ void
fg_group_kernel(int32_t *grp, const int32_t *ids, int Tk, int E, int A, int BM,
                const struct dsv4_expert_w *table, int skip_unheld)
{
    extern __shared__ int32_t fg_gs[];
    int32_t *cnt = fg_gs, *off = fg_gs + E, *fill = fg_gs + 2 * E;
    int32_t *tiles = grp + 1, *rows = grp + 1 + 3 * A;

    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        cnt[e] = 0;
        fill[e] = 0;
        off[e] = !skip_unheld || table[e].w1.w != NULL;   /* held */
    }
    __syncthreads();
    for (int r = threadIdx.x; r < Tk; r += blockDim.x) {
        int e = ids[r];

        e = e < 0 ? 0 : (e >= E ? E - 1 : e);
        atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int pos = 0, nt = 0;

        for (int e = 0; e < E; e++) {
            int c = cnt[e];

            if (c == 0 || !off[e]) {
                off[e] = -1;
                continue;
            }
            off[e] = pos;
            for (int j = 0; j < c; j += BM) {
                tiles[3 * nt] = e;
                tiles[3 * nt + 1] = pos + j;
                tiles[3 * nt + 2] = c - j < BM ? c - j : BM;
                nt++;
            }
            pos += c;
        }
        grp[0] = nt;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < Tk; r += blockDim.x) {
        int e = ids[r];

        e = e < 0 ? 0 : (e >= E ? E - 1 : e);
        if (off[e] >= 0)
            rows[off[e] + atomicAdd(&fill[e], 1)] = r;
    }
}

/* --- host side ------------------------------------------------------------------------ */

/* DSV4_CUDA_GEMM=off (or 0) keeps the decode kernels at every T (read once). */
static int
fg_enabled(void)
{
    static int on = -1;

    if (on < 0) {
        const char *v = getenv("DSV4_CUDA_GEMM");

        on = !(v != NULL && (strcmp(v, "off") == 0 || strcmp(v, "0") == 0));
    }
    return on;
}

template <int WF, int EPI, int MT>
static enum dsv4_err
fg_launch(struct dsv4_backend *be, const struct fg_args *a, unsigned gx, unsigned gy)
{
    static unsigned char attr_set[FG_MAX_DEV];   /* per instantiation and device */
    size_t smem = fg_smem_bytes(WF, MT);
    int dev = cuda_st(be)->device;

    if (dev < 0 || dev >= FG_MAX_DEV || !attr_set[dev]) {
        CUDA_TRY(cudaFuncSetAttribute(fg_kernel<WF, EPI, MT>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        if (dev >= 0 && dev < FG_MAX_DEV)
            attr_set[dev] = 1;
    }
    fg_kernel<WF, EPI, MT><<<dim3(gx, gy), FG_THREADS, smem, cuda_stream(be)>>>(*a);
    CUDA_LAUNCHED("fast gemm");
    return DSV4_OK;
}

/* The tile kernel with the row tile chosen at run time (MT = 2 or 4). */
template <int WF, int EPI>
static enum dsv4_err
fg_run(struct dsv4_backend *be, const struct fg_args *a, int mt, unsigned gx, unsigned gy)
{
    return mt == 4 ? fg_launch<WF, EPI, 4>(be, a, gx, gy) : fg_launch<WF, EPI, 2>(be, a, gx, gy);
}

/* Blocks of the dense GEMM at T rows and N columns with row tiles of 32*mt. */
static int64_t
fg_blocks(int T, int N, int mt)
{
    return (int64_t)(T + 32 * mt - 1) / (32 * mt) * (N / FG_BN);
}

/*
 * The linear's cost model (a first guess, to be tuned on the H200): the
 * decode kernel streams the weights once per 16 rows at ~2 TB/s; the GEMM
 * runs waves of FG_SMS blocks, each at ~2 TFLOP/s (~260 TFLOP/s in all).
 * Returns the row tile (2 or 4) of the cheaper GEMM, or 0 when the decode
 * kernel is cheaper.  Depends on T, N and K only.
 */
static int
fg_linear_tile(int T, int N, int K)
{
    double fl = (double)((T + 15) / 16) * ((double)N * K / 2.0e12 + 4e-6), best = fl;
    int mt = 0;

    for (int m = 2; m <= 4; m += 2) {
        double waves = (double)((fg_blocks(T, N, m) + FG_SMS - 1) / FG_SMS);
        double t = waves * (2.0 * 32 * m * FG_BN * K / 2.0e12) + 5e-6;

        if (t < best) {
            best = t;
            mt = m;
        }
    }
    return mt;
}

/* Rows up to which the linear always takes the decode kernels (above). */
#define FG_DECODE_ROWS 64

int
cuda_fast_gemm_linear_ok(const struct dsv4_backend *be, const struct dsv4_linear *W, int T)
{
    if (!fg_enabled() || T <= FG_DECODE_ROWS || be->numerics != DSV4_NUMERICS_REF ||
        W->fmt != DSV4_WFMT_FP8 || W->w == NULL || W->scale == NULL || W->n_in <= 0 ||
        W->n_in % 128 != 0 || W->n_out <= 0 || W->n_out % FG_BN != 0 ||
        (uintptr_t)W->w % 16 != 0)
        return 0;
    return fg_linear_tile(T, W->n_out, W->n_in) != 0;
}

enum dsv4_err
cuda_fast_gemm_linear(struct dsv4_backend *be, float *out, const float *x,
                      const struct dsv4_linear *W, int T)
{
    int N = W->n_out, K = W->n_in, mt = fg_linear_tile(T, N, K);
    size_t bx = cuda_align((size_t)T * K * sizeof(uint16_t));
    char *p = (char *)cuda_scratch(be, bx + cuda_align((size_t)T * (K / 128) * sizeof(float)));
    struct fg_args a;
    enum dsv4_err e;

    if (T <= 0)
        return DSV4_OK;
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast gemm: no scratch for %d x %d", T, K);
    mt = mt == 0 ? 4 : mt;
    memset(&a, 0, sizeof(a));
    a.W = *W;
    a.W3 = *W;
    a.xa = (const uint16_t *)p;
    a.sx = (const float *)(p + bx);
    a.out = out;
    a.ldo = N;
    a.M = T;
    a.K = K;
    e = fk_quant(be, (uint16_t *)a.xa, NULL, (float *)a.sx, x, K, T, K);
    if (e != DSV4_OK)
        return e;
    return fg_run<FG_FP8, FG_LINEAR>(be, &a, mt, (unsigned)(N / FG_BN),
                                     (unsigned)((T + 32 * mt - 1) / (32 * mt)));
}

static int
fg_lin_ok(const struct dsv4_linear *W, enum dsv4_wfmt fmt, int n_out, int n_in)
{
    return W->fmt == fmt && W->n_out == n_out && W->n_in == n_in && W->w != NULL &&
           W->scale != NULL && (uintptr_t)W->w % 16 == 0 && (uintptr_t)W->scale % 4 == 0;
}

static int
fg_expert_ok(const struct dsv4_expert_w *w, enum dsv4_wfmt fmt, int D, int I)
{
    return fg_lin_ok(&w->w1, fmt, I, D) && fg_lin_ok(&w->w3, fmt, I, D) &&
           fg_lin_ok(&w->w2, fmt, D, I);
}

int
cuda_fast_gemm_moe_ok(const struct dsv4_backend *be, const struct dsv4_expert_w *experts, int n,
                      const struct dsv4_expert_w *shared, int T, int k, int D, int I,
                      int parts)
{
    if (!fg_enabled() || be->numerics != DSV4_NUMERICS_REF || T < FG_MOE_MIN_T || k < 1 ||
        k > FG_MAX_K || n < 1 || n > FG_MAX_E || D % 128 != 0 || I % 128 != 0)
        return 0;
    if (shared == NULL ? !parts : !fg_expert_ok(shared, DSV4_WFMT_FP8, D, I))
        return 0;
    for (int e = 0; e < n; e++)
        if (!(parts && experts[e].w1.w == NULL) &&
            !fg_expert_ok(&experts[e], DSV4_WFMT_FP4, D, I))
            return 0;
    return 1;
}

enum dsv4_err
cuda_fast_gemm_moe(struct dsv4_backend *be, float *out, float *parts, const float *x,
                   const int32_t *ids, const float *weights, const struct dsv4_expert_w *table,
                   int n_table, const struct dsv4_expert_w *shared, int T, int k, int D, int I,
                   float lim)
{
    cudaStream_t st = cuda_stream(be);
    int Tk = T * k, R = Tk + T, nbD = D / 128, nbI = I / 128;
    /* row tile: 64 rows unless the experts average more than 96 rows */
    int mt = Tk / (Tk < n_table ? Tk : n_table) > 96 ? 4 : 2, BM = 32 * mt;
    int A = (Tk + BM - 1) / BM + (Tk < n_table ? Tk : n_table);
    int has_sh = shared != NULL;
    size_t b_grp = cuda_align((size_t)(1 + 3 * A + Tk) * sizeof(int32_t));
    size_t b_x16 = cuda_align((size_t)T * D * sizeof(uint16_t));
    size_t b_xs = cuda_align((size_t)T * nbD * sizeof(float));
    size_t b_h = cuda_align((size_t)R * I * sizeof(float));
    size_t b_hb = cuda_align((size_t)Tk * I * sizeof(uint16_t));
    size_t b_hf = cuda_align((size_t)T * I * sizeof(uint16_t));
    size_t b_hs = cuda_align((size_t)R * nbI * sizeof(float));
    size_t b_y = parts != NULL ? 0 : cuda_align((size_t)R * D * sizeof(float));
    char *p = (char *)cuda_scratch(be, b_grp + 2 * b_x16 + b_xs + b_h + b_hb + b_hf + b_hs +
                                           b_y);
    int32_t *grp;
    uint16_t *xb, *xf, *hb, *hf;
    float *xs, *h, *hs, *y;
    struct fg_args a;
    enum dsv4_err e;

    if (T <= 0)
        return DSV4_OK;
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast gemm moe: no scratch (T=%d k=%d)", T, k);
    grp = (int32_t *)p;
    p += b_grp;
    xb = (uint16_t *)p;
    xf = (uint16_t *)(p + b_x16);
    xs = (float *)(p + 2 * b_x16);
    p += 2 * b_x16 + b_xs;
    h = (float *)p;
    hb = (uint16_t *)(p + b_h);
    hf = (uint16_t *)(p + b_h + b_hb);
    hs = (float *)(p + b_h + b_hb + b_hf);
    y = parts != NULL ? parts : (float *)(p + b_h + b_hb + b_hf + b_hs);

    /* 1. x: bf16 values (routed), f16 (shared), scales */
    e = fk_quant(be, has_sh ? xf : NULL, xb, xs, x, D, T, D);
    if (e != DSV4_OK)
        return e;
    /* 2. grouping */
    fg_group_kernel<<<1, 1024, (size_t)3 * n_table * sizeof(int32_t), st>>>(
        grp, ids, Tk, n_table, A, BM, table, parts != NULL);
    CUDA_LAUNCHED("fast gemm moe group");

    /* 3. up: routed tiles, then the shared expert's */
    memset(&a, 0, sizeof(a));
    a.table = table;
    a.grp = grp;
    a.A = A;
    a.k = k;
    a.xa = xb;
    a.sx = xs;
    a.out = h;
    a.ldo = I;
    a.weights = weights;
    a.K = D;
    a.lim = lim;
    e = fg_run<FG_FP4, FG_UP>(be, &a, mt, (unsigned)(I / 64), (unsigned)A);
    if (e != DSV4_OK)
        return e;
    if (has_sh) {
        struct fg_args s = a;

        s.table = NULL;
        s.W = shared->w1;
        s.W3 = shared->w3;
        s.xa = xf;
        s.weights = NULL;
        s.M = T;
        s.orow0 = Tk;
        e = fg_run<FG_FP8, FG_UP>(be, &s, mt, (unsigned)(I / 64), (unsigned)((T + BM - 1) / BM));
        if (e != DSV4_OK)
            return e;
    }

    /* 4. h: routed rows as bf16, shared rows as f16 (hf row t = h row Tk + t) */
    e = fk_quant(be, NULL, hb, hs, h, I, Tk, I);
    if (e == DSV4_OK && has_sh)
        e = fk_quant(be, hf, NULL, hs + (int64_t)Tk * nbI, h + (int64_t)Tk * I, I, T, I);
    if (e != DSV4_OK)
        return e;

    /* 5. down into y (rows of moe_parts' layout) */
    a.down = 1;
    a.xa = hb;
    a.sx = hs;
    a.out = y;
    a.ldo = D;
    a.weights = NULL;
    a.K = I;
    e = fg_run<FG_FP4, FG_LINEAR>(be, &a, mt, (unsigned)(D / FG_BN), (unsigned)A);
    if (e != DSV4_OK)
        return e;
    if (has_sh) {
        struct fg_args s = a;

        s.table = NULL;
        s.W = shared->w2;
        s.W3 = shared->w2;
        s.xa = hf;
        s.sx = hs + (int64_t)Tk * nbI;
        s.M = T;
        s.arow0 = 0;
        s.orow0 = Tk;
        e = fg_run<FG_FP8, FG_LINEAR>(be, &s, mt, (unsigned)(D / FG_BN),
                                      (unsigned)((T + BM - 1) / BM));
        if (e != DSV4_OK)
            return e;
    }
    if (parts != NULL)
        return DSV4_OK;   /* moe_parts: the caller sums the ranks' parts, then combines */
    return cuda_moe_combine(be, out, y, ids, T, k, D);   /* the exact path's step 5 */
}
