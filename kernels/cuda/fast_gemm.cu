/*
 * fast_gemm.cu — tensor-core GEMMs for prefill (issue 7): the FP8 linear
 * under REF numerics and the routed + shared MoE at many token rows, used by
 * cuda_linear / cuda_moe when the fast kernels are on and the decode
 * kernels (fast_linear.cu, fast_moe.cu) would re-read the weights once per
 * 16 rows (cuda_fast_gemm_linear_ok, cuda_fast_gemm_moe_ok), the BF16
 * linear at T > 64 (cuda_fast_gemm_bf16_ok, fast_gemm.cuh) and the grouped
 * output projection (linear_grouped, wo_a) at T > 64 (fw_kernel's grouped
 * mode: cuda_fast_gemm_grouped_ok, kernels/cuda_gemm_grouped.h).
 *
 * Two paths.  On sm_90 the Hopper path (fw_kernel, wgmma; its own comment
 * below) takes all of them; DSV4_CUDA_WGMMA=0 or dsv4_cuda_set_wgmma(0)
 * keeps the mma.sync path described next (fg_kernel, FP8 linear and MoE;
 * BF16 linears then stay on the decode kernels).
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
 *      on the Hopper path at BM = 64 and at most 32 rows an expert on
 *      average, an expert's tail of at most 32 rows goes in a second list,
 *      run on tiles of 32 (DSV4_CUDA_MOE_TAIL32);
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
#include "kernels/cuda/fast_gemm.cuh"
#include "kernels/cuda/fast_wgmma.cuh"
#include "kernels/cuda_fast.h"
#include "kernels/cuda_gemm8.h"
#include "kernels/cuda_gemm_grouped.h"   /* dsv4_cuda_blas_usable */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FG_THREADS 256
#define FG_BN 128            /* B (weight) rows per block */
#define FG_STAGES 3          /* cp.async pipeline depth (stages of 128 columns); 2 where
                                three do not fit the device's shared memory (fg_stages) */
#define FG_MAX_E 4096        /* experts (grouping counts in shared memory) */
#define FG_MAX_K 64          /* picks per token (the exact path's bound) */
#define FG_MOE_MIN_T 97      /* the decode MoE (fast_moe.cu) takes T <= 96 */
#define FG_SMS 132           /* H200 SMs: the linear's cost model */

/* Weight format of a launch. */
enum {
    FG_FP8 = 0,     /* E4M3, 128x128 E8M0 block scales; f16 activations */
    FG_FP4 = 1,     /* E2M1 pairs, E8M0 scale per 32 columns; bf16 activations */
};

/* What a block writes. */
enum {
    FG_LINEAR = 0,  /* out[row, n] = bf16(acc) for its 128 weight rows (also w2) */
    FG_UP = 1,      /* 64 rows of w1 and the same 64 of w3: h = SwiGLU */
    FG_GROUPED = 2, /* fw_kernel only: FG_LINEAR's output, B (the token rows)
                       from the block's group slice of x (linear_grouped) */
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

/* Dynamic shared memory of a launch of ns stages: per stage A (BM x 256
 * bytes), B (128 x BROW), FP4 group scales (128 x 4), activation scales (BM
 * floats); then the row maps (2 x BM ints) and, for FP4, the decoding
 * table.  At three stages: FP8 101,120 bytes (mt 2) and 151,552 (mt 4), FP4
 * 109,312 and 159,744; at two, mt 2: 67,584 and 83,968. */
static size_t
fg_smem_bytes(int wf, int mt, int ns)
{
    size_t bm = 32 * (size_t)mt;

    return (size_t)ns * (bm * 256 + FG_BN * (size_t)FG_BROW(wf) + FG_BN * 4 + bm * 4) +
           2 * bm * 4 + (wf == FG_FP4 ? FK_LUT_WORDS * 4 : 0);
}

/* The stages of fg_kernel<wf, ., mt> on be's device: FG_STAGES where they
 * fit its shared memory a block (cuda_smem_max), else 2 at mt 2 where two
 * do (sm_120's 99 KB: the FP4 tiles), else 0 (no form fits). */
static int
fg_stages(const struct dsv4_backend *be, int wf, int mt)
{
    if (cuda_smem_fits(be, fg_smem_bytes(wf, mt, FG_STAGES)))
        return FG_STAGES;
    return mt == 2 && cuda_smem_fits(be, fg_smem_bytes(wf, mt, 2)) ? 2 : 0;
}

/* The row tile (2 or 4) fg_kernel<wf> takes on be's device for a wish of
 * mt: mt where a form of it fits (fg_stages), else 2 where that does, else
 * 0. */
static int
fg_tile_fit(const struct dsv4_backend *be, int wf, int mt)
{
    if (fg_stages(be, wf, mt) != 0)
        return mt;
    return fg_stages(be, wf, 2) != 0 ? 2 : 0;
}

/* --- the tile kernel ------------------------------------------------------------- */

/* Shared memory of a block, carved per fg_smem_bytes. */
struct fg_smem {
    unsigned char *a, *b, *s;   /* stage arrays: A values, B bytes, FP4 group scales */
    float *x;                   /* stage array: activation scales */
    int *arow, *orow;           /* (BM) A row and output row of tile row i; -1: none */
    uint32_t *lut;              /* FP4 table */
};

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

        wg_cp16(as + wg_off<256>(row, c), src, r >= 0);
    }
    if (WF == FG_FP8) {
#pragma unroll
        for (int it = 0; it < 4; it++) {
            int row = (tid >> 3) + it * 32, c = tid & 7;
            const struct dsv4_linear &L = EPI == FG_UP && row >= 64 ? L3 : L1;
            int wrow = n0 + (EPI == FG_UP ? (row & 63) : row);

            wg_cp16(bs + wg_off<FG_BROW(WF)>(row, c),
                    (const uint8_t *)L.w + (int64_t)wrow * K + kb * 128 + c * 16, 1);
        }
    } else {
#pragma unroll
        for (int it = 0; it < 2; it++) {
            int row = (tid >> 2) + it * 64, c = tid & 3;
            const struct dsv4_linear &L = EPI == FG_UP && row >= 64 ? L3 : L1;
            int wrow = n0 + (EPI == FG_UP ? (row & 63) : row);

            wg_cp16(bs + wg_off<FG_BROW(WF)>(row, c),
                    (const uint8_t *)L.w + (int64_t)wrow * (K / 2) + kb * 64 + c * 16, 1);
        }
        if (tid < FG_BN) {
            int row = tid;
            const struct dsv4_linear &L = EPI == FG_UP && row >= 64 ? L3 : L1;
            int wrow = n0 + (EPI == FG_UP ? (row & 63) : row);

            wg_cp4(sm.s + st * FG_BN * 4 + row * 4, L.scale + (int64_t)wrow * (K / 32) + kb * 4,
                   1);
        }
    }
    if (tid >= FG_THREADS - BM) {
        int i = tid - (FG_THREADS - BM), r = sm.arow[i];

        wg_cp4(sm.x + st * BM + i, a.sx + (int64_t)(r < 0 ? 0 : r) * nb + kb, r >= 0);
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

                av[m][h] = *(const uint4 *)(as + wg_off<256>(row, kc * 4 + q));
            }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int row = fg_brow<EPI>(wn, j) + g;

            if (WF == FG_FP8) {
                uint2 w = *(const uint2 *)(bs + wg_off<FG_BROW(WF)>(row, kc * 2 + (q >> 1)) +
                                           (q & 1) * 8);

                bv[j][0][0] = fk_e4m3x2(w.x);
                bv[j][0][1] = fk_e4m3x2(w.x >> 16);
                bv[j][1][0] = fk_e4m3x2(w.y);
                bv[j][1][1] = fk_e4m3x2(w.y >> 16);
            } else {
                uint32_t w = *(const uint32_t *)(bs + wg_off<FG_BROW(WF)>(row, kc) + q * 4);
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
 * y*BM .. of a.M.  Routed: tile slot y of the grouping, or nothing.  NS:
 * the cp.async pipeline's stages (FG_STAGES, or 2: fg_stages).
 */
template <int WF, int EPI, int MT, int NS>
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
    sm.b = sm.a + NS * BM * 256;
    sm.s = sm.b + NS * FG_BN * FG_BROW(WF);
    sm.x = (float *)(sm.s + NS * FG_BN * 4);
    sm.arow = (int *)(sm.x + NS * BM);
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

    for (int s = 0; s < NS - 1; s++) {
        if (s < nkt)
            fg_load<WF, EPI, MT>(sm, s, s, a, L1, L3, n0);
        wg_cp_commit();
    }
    for (int kt = 0; kt < nkt; kt++) {
        int nx = kt + NS - 1;
        float sw[4];

        wg_cp_wait<NS - 2>();
        __syncthreads();   /* stage kt landed for all; stage nx's old data is used up */
        if (nx < nkt)
            fg_load<WF, EPI, MT>(sm, nx % NS, nx, a, L1, L3, n0);
        wg_cp_commit();
#pragma unroll
        for (int j = 0; j < 4; j++)
            sw[j] = WF == FG_FP8 ? cu_e8m0_to_f32(__ldg(swp[j] + kt)) : 1.0f;
        fg_stage<WF, EPI, MT>(acc, sm, kt % NS, sw, wm, wn);
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
                    float v = cu_swiglu(acc[m][j][i], acc[m][j + 2][i], a.lim);

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

#define FG_GROUP_ILP 8   /* pick ids a thread of fg_group_kernel loads at once */

/* The expert ids, clamped into [0, E), of picks r0 + i * stride (i <
 * FG_GROUP_ILP; -1 past Tk), all loads issued before any is used. */
static __device__ __forceinline__ void
fg_group_ids(int (&e)[FG_GROUP_ILP], const int32_t *ids, int r0, int stride, int Tk, int E)
{
#pragma unroll
    for (int i = 0; i < FG_GROUP_ILP; i++)
        e[i] = r0 + i * stride < Tk ? ids[r0 + i * stride] : 0;
#pragma unroll
    for (int i = 0; i < FG_GROUP_ILP; i++)
        e[i] = r0 + i * stride >= Tk ? -1 : e[i] < 0 ? 0 : (e[i] >= E ? E - 1 : e[i]);
}

/*
 * One block; dynamic shared memory 3 * E ints.  grp: [0] the number of
 * tiles; tile i at 1 + 3i: expert, first entry in rows, rows (<= BM); rows
 * at 1 + 3A: the pick rows of each active expert, experts in increasing id
 * order (inside an expert in any order: rows are computed independently).
 * skip_unheld: experts without weights (held by another rank) are left out.
 * The ids are read FG_GROUP_ILP a thread at once, and the experts' row and
 * tile offsets come from a block scan (a thread an expert), not one
 * thread's walk over the experts.  ctr (or NULL): nctr item counters of the
 * GEMMs that follow (fwp_kernel), zeroed.
 *
 * grp2 (or NULL): a second list of A2 slots (same layout: [0] its count,
 * tile j at 1 + 3j) for the tiles of at most BM/2 rows.  An expert's rows
 * then go in tiles of BM (the last one holding more than BM/2 rows) and, if
 * that leaves a tail of at most BM/2 rows, one tile of grp2 for it, so a
 * launch of BM/2-row tiles takes it instead of a BM-row tile half empty.
 * A grp2 tile's "first entry" is counted from grp2 + 1 + 3 * A2, where the
 * kernels look for it (wg_tile_rows_at), so it is negative: the rows stay
 * the one array at grp + 1 + 3A.  A2 >= the active experts.
 */
static __global__ void
fg_group_kernel(int32_t *grp, const int32_t *ids, int Tk, int E, int A, int BM,
                const struct dsv4_expert_w *table, int skip_unheld, int32_t *ctr, int nctr,
                int32_t *grp2, int A2)
{
    extern __shared__ int32_t fg_gs[];
    __shared__ unsigned long long ws[33];
    int32_t *cnt = fg_gs, *off = fg_gs + E, *fill = fg_gs + 2 * E;
    int32_t *tiles = grp + 1, *rows = grp + 1 + 3 * A;
    int nthr = blockDim.x, pos0 = 0, nt0 = 0;

    for (int e = threadIdx.x; e < E; e += nthr) {
        cnt[e] = 0;
        fill[e] = 0;
        off[e] = !skip_unheld || table[e].w1.w != NULL;   /* held */
    }
    __syncthreads();
    for (int r0 = threadIdx.x; r0 < Tk; r0 += nthr * FG_GROUP_ILP) {
        int e[FG_GROUP_ILP];

        fg_group_ids(e, ids, r0, nthr, Tk, E);
#pragma unroll
        for (int i = 0; i < FG_GROUP_ILP; i++)
            if (e[i] >= 0)
                atomicAdd(&cnt[e[i]], 1);
    }
    __syncthreads();
    /* rows and tiles of the active experts, by increasing id: a scan of
     * (rows << 32 | tiles), nthr experts a round; with grp2 the tiles are
     * (BM tiles << 16 | grp2 tiles): fewer than 65,536 of either in all */
    int nt20 = 0;
    int32_t *tiles2 = grp2 != NULL ? grp2 + 1 : NULL;
    int rdelta = grp2 != NULL ? (int)(rows - (grp2 + 1 + 3 * A2)) : 0;

    for (int e0 = 0; e0 < E; e0 += nthr) {
        int e = e0 + (int)threadIdx.x, c = 0, nt = 0, tail = 0;
        unsigned long long ex, tot;
        unsigned tl;

        if (e < E && off[e])
            c = cnt[e];
        nt = (c + BM - 1) / BM;
        if (grp2 != NULL && c % BM != 0 && c % BM <= BM / 2) {
            tail = c % BM;   /* its own tile in grp2 */
            nt--;
        }
        tl = grp2 != NULL ? (unsigned)nt << 16 | (tail > 0) : (unsigned)nt;
        ex = fk_block_scan((unsigned long long)c << 32 | tl, ws, &tot);
        if (e < E) {
            int p = pos0 + (int)(ex >> 32);
            int t0 = nt0 + (int)(grp2 != NULL ? (ex & 0xffffffffu) >> 16 : ex & 0xffffffffu);

            off[e] = c > 0 ? p : -1;
            for (int j = 0; j < nt; j++) {
                tiles[3 * (t0 + j)] = e;
                tiles[3 * (t0 + j) + 1] = p + j * BM;
                tiles[3 * (t0 + j) + 2] = c - j * BM < BM ? c - j * BM : BM;
            }
            if (tail > 0) {
                int t2 = nt20 + (int)(ex & 0xffffu);

                tiles2[3 * t2] = e;
                tiles2[3 * t2 + 1] = p + nt * BM + rdelta;
                tiles2[3 * t2 + 2] = tail;
            }
        }
        pos0 += (int)(tot >> 32);
        if (grp2 != NULL) {
            nt0 += (int)((tot & 0xffffffffu) >> 16);
            nt20 += (int)(tot & 0xffffu);
        } else {
            nt0 += (int)(tot & 0xffffffffu);
        }
    }
    if (threadIdx.x == 0) {
        grp[0] = nt0;
        if (grp2 != NULL)
            grp2[0] = nt20;
    }
    if (ctr != NULL && (int)threadIdx.x < nctr)
        ctr[threadIdx.x] = 0;
    __syncthreads();
    for (int r0 = threadIdx.x; r0 < Tk; r0 += nthr * FG_GROUP_ILP) {
        int e[FG_GROUP_ILP];

        fg_group_ids(e, ids, r0, nthr, Tk, E);
#pragma unroll
        for (int i = 0; i < FG_GROUP_ILP; i++)
            if (e[i] >= 0 && off[e[i]] >= 0)
                rows[off[e[i]] + atomicAdd(&fill[e[i]], 1)] = r0 + i * nthr;
    }
}

/* --- the Hopper path: wgmma with the weights as the register operand -------------------- */

/*
 * fw_kernel (sm_90a).  The weights are the A operand (M = weight rows), the
 * activation rows the B operand (N = tokens), so a tile holds as few token
 * rows as the expert has (16, 32, 64 or 128) instead of padding them to 64
 * or 128: at a few rows per expert the kernel streams each expert's
 * weights once, and at many rows it is a 64-row x N wgmma per warpgroup.
 *
 * A (weights) go global -> shared with cp.async (S stages of 128 columns,
 * rows XOR-swizzled per 16 bytes as in fg_kernel; each thread's sources
 * worked out once, fw_src), then each thread decodes its own fragment into
 * registers: FP4 by bit placement (fk_fp4pair_bf16: the value times
 * 2^-126) times 2^126 times the E8M0 group scale in one bf16 multiply (two
 * when a scale of the warp's stage is 2^1 or more, or NaN), FP8 by
 * fk_e4m3b02_bf16 times the block scale, BF16 as stored.  All scales are
 * powers of two, so every decoded weight is the exact bf16 value w * s_w.
 * Register fragment of wgmma m64nNk16 (the mma.sync m16n8k16 A fragment per
 * warp; warp w of the warpgroup holds rows 16w..16w+15): thread (g, q) reg0
 * = row g, k slots 2q, 2q+1; reg1 = row g+8, same slots; reg2 = row g,
 * slots 2q+8, 2q+9; reg3 = row g+8, same.  Thread q reads the 8 consecutive
 * columns 8q..8q+7 of a 32-column group of its rows (FP4: one 32-bit word,
 * FP8: 8 bytes, BF16: 16), and pairs column 8q+n with 8q+n+4 (n = 0..3:
 * FP4 nibbles n and n+4 of the word sit 16 bits apart, so both values of a
 * bf16 pair need the same two shifts): k16 step s2 (0, 1) of the group takes
 * the pair n = 2s2 as slots 2q, 2q+1 and n = 2s2+1 as slots 2q+8, 2q+9.
 *
 * B (activations) must then hold, at k slot j = 8h + 2q + i of step s2 of a
 * group, the column 8q + 2s2 + h + 4i: the activations are stored in that
 * permuted order in global memory (fw_perm: physical position p = 16s2 +
 * 8h + 2q + i of logical column c = 8q + 2s2 + h + 4i, inside each
 * 32-column group), written so by fw_prep_kernel (x) and by the up kernel's
 * epilogue (h).  Their values are bf16: under REF the FP8 code value times
 * its power-of-two block scale s_x (exact in bf16), so no per-block scaling
 * is left to do; BF16 weights take x = hi + lo (two wgmma per step).
 *
 * Per stage a warpgroup runs two halves (fw_half): decode 4 A fragments,
 * issue their 4 wgmma as one group and go on to the next half while the
 * tensor cores run it (at most one group in flight before a decode); loads
 * run S - 2 stages ahead so that a refilled buffer's wgmma are done.  The
 * FP4 / FP8 weight words of both halves are read from shared memory into
 * registers first thing in the stage (fw_half's wait is a memory clobber:
 * behind it the second half's loads started late; perf.md run 34).
 *
 * B in shared memory: K-major, no swizzle.  Core matrix (8 token rows x 16
 * bytes) (n8, k8) of a stage at byte (n8 * 16 + k8) * 128, row n % 8 at +16
 * * (n % 8): so the leading byte offset (next 8 columns of K) is 128, the
 * stride byte offset (next 8 tokens) 2048, and k16 step s of the stage
 * starts at byte 256 * s.  Descriptor: start >> 4 in bits 0-13, LBO >> 4 in
 * 16-29, SBO >> 4 in 32-45, base offset 0, swizzle mode 0 (PTX ISA,
 * "Matrix Descriptor Format", K-major canonical layout
 * ((8,m),(T,2k)):((1T,SBO),(1,LBO))).
 *
 * Numerics.  Every product is exact (bf16 values times bf16 values) and the
 * tensor core sums them in fp32 over all of K: the same real sum as the op
 * contract's per-block sums times the scales (the scales are powers of
 * two), another order of fp32 rounding.  Each output depends on its own
 * weight row and token only: the bits do not depend on T, the tile (N), the
 * grid or the other rows; they differ from fg_kernel's (per-block sums) by
 * rounding.
 *
 * Epilogues: FG_LINEAR writes out[token][row] (bf16-rounded, or fp32 for
 * BF16 weights with DSV4_LIN_F32_OUT); FG_UP (NWG = 4: 128 rows of w1 and
 * the same 128 of w3, rows 8..15 of each warp the w3 rows of rows 0..7, so
 * one thread holds g and u of a column) forms h with the exact expression,
 * then quantizes it per token over the block's 128 columns (REF: amax over
 * the 16 warps through shared memory, the exact path's scale and codes) and
 * writes the down GEMM's B operand (permuted, code value times scale).
 *
 * Grouped (FG_GROUPED, linear_grouped: wo_a): FP8 weights (G * R, K), x
 * (T, G * K); weight row o reads x columns (o / R) * K .. + K.  R % 128 ==
 * 0, so a block's 128 rows n0.. lie in one group g = n0 / R: its B rows are
 * x's rows (a.ldb = G * K values apart) from column g * K on, prepared as
 * bf16(x) (fw_prep mode 2: the op rounds x to bf16, no quantization) in the
 * permuted order over the whole row (g * K is a multiple of 32, so group
 * g's columns keep fw_perm's order relative to g * K).  Everything else is
 * the FP8 FG_LINEAR block: weights decoded to the exact bf16 w * s_w, one
 * fp32 sum over K, out[token][o] bf16-rounded.
 */

#define FW_BF16 2               /* weight format: BF16, x as hi + lo */
#define FW_SMEM_MAX (220 * 1024)
#define FW_MAX_STAGES 8
#define FW_LBO 128              /* B: next 8 columns of K */
#define FW_SBO 2048             /* B: next 8 token rows */

/* Bytes of one weight row per stage of 128 columns. */
#define FW_AROW(WF) ((WF) == FG_FP4 ? 64 : (WF) == FG_FP8 ? 128 : 256)

/* Shared memory plan of an instantiation. */
template <int WF, int EPI, int NWG, int BN>
struct fw_cfg {
    static constexpr int RA = 64 * NWG;                 /* weight rows */
    static constexpr int THREADS = 128 * NWG;
    static constexpr int AB = RA * FW_AROW(WF);         /* A bytes per stage */
    static constexpr int BB = BN * 256;                 /* B bytes per stage (one of hi/lo) */
    static constexpr int NB = WF == FW_BF16 ? 2 : 1;
    static constexpr int SB = WF == FG_FP4 ? RA * 4 : 0;   /* FP4 group scales */
    static constexpr int STAGE = AB + NB * BB + SB;
    /* the row maps; FG_UP: the warps' maxima, the scales, the route weights */
    static constexpr int FIXED = 2 * BN * 4 + (EPI == FG_UP ? (4 * NWG + 2) * BN * 4 : 0);
    /* the FP4 down tiles of 2 warpgroups (24.5 KB a stage; fw_moe's tiles
     * of 16 and 32 tokens, those of 64 take 4 warpgroups) run two CTAs an
     * SM on 4 stages each: 16 warps instead of 8 (docs/perf.md run 32) */
    static constexpr int BLOCKS = WF == FG_FP4 && EPI == FG_LINEAR && NWG == 2 ? 2 : 1;
    static constexpr int S0 = (FW_SMEM_MAX / BLOCKS - FIXED) / STAGE;
    static constexpr int SMAX = BLOCKS == 2 ? 4 : FW_MAX_STAGES;
    static constexpr int S = S0 > SMAX ? SMAX : S0;
    static constexpr int SMEM = S * STAGE + FIXED;
};

/* Everything a launch needs, by value (as fg_args; B values are bf16). */
struct fw_args {
    struct dsv4_linear W, W3;       /* dense tiles: the weight (FG_UP: w1, w3) */
    const struct dsv4_expert_w *table;  /* routed tiles: device expert structs, else NULL */
    const int32_t *grp;             /* routed: the grouping (fg_group_kernel) */
    int A;                          /* routed: tile slots */
    int down;                       /* routed: w2 (B row = pick row), else w1/w3
                                       (B row = pick row / k) */
    int k;
    const uint16_t *xb;             /* (rows, K) B values, permuted bf16 */
    const uint16_t *xl;             /* BF16 weights: the lo parts, else NULL */
    float *out;                     /* FG_LINEAR: (rows, ldo) */
    uint16_t *outb;                 /* FG_LINEAR (bf16-rounded outputs): their bf16
                                       bits here (rows, ldo) instead of out, or NULL */
    uint16_t *hq;                   /* FG_UP: (rows, ldo) the down GEMM's B values */
    int64_t ldo;
    const float *weights;           /* routed FG_UP: (T*k) route weights; else NULL */
    int M;                          /* dense: rows; B row i -> brow0 + i, out row orow0 + i */
    int brow0, orow0;
    int K;                          /* weight n_in */
    float lim;                      /* SwiGLU limit (<= 0: none) */
    int f32out;                     /* FG_LINEAR: fp32 outputs (else bf16-rounded) */
    int64_t ldb;                    /* FG_GROUPED: B row stride (G * K values) */
    int grows;                      /* FG_GROUPED: weight rows per group (R): the
                                       block of rows n0.. reads B columns
                                       (n0 / R) * K .. + K */
    int gx, gy;                     /* fwp_kernel: the items (column block, tile) */
    int32_t *ctr;                   /* fwp_kernel: the item counter (zeroed by
                                       fg_group_kernel), or NULL: item blockIdx.x +
                                       i * gridDim.x */
};

/*
 * B values from x (rows, K), row stride `stride`: mode 0 (REF) the FP8 code
 * value of the exact path's quantization per 128 columns times its scale;
 * mode 1 hi = bf16(x) and lo = bf16(x - hi) (lo = 0 when x is not finite);
 * mode 2 hi = bf16(x) only (linear_grouped; lo unused).  One warp per (row,
 * 128-column block).
 */
static __global__ void
fw_prep_kernel(uint16_t *hi, uint16_t *lo, const float *x, int64_t stride, int rows, int K,
               int mode)
{
    int nb = K / 128, lane = threadIdx.x & 31;
    int64_t wid = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int64_t r = wid / nb;
    int b = (int)(wid % nb);
    float amax = 1e-4f, v[4], s = 1.0f;
    const float *xr;

    if (r >= rows)
        return;   /* whole warps leave together */
    xr = x + r * stride + (int64_t)b * 128;
    for (int i = 0; i < 4; i++) {
        v[i] = xr[lane + 32 * i];
        amax = fmaxf(amax, fabsf(v[i]));
    }
    if (mode == 0) {
        for (int o = 16; o > 0; o /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        s = cu_pow2_scale(amax, 448.0f);
    }
    for (int i = 0; i < 4; i++) {
        int64_t at = r * K + fw_perm(b * 128 + lane + 32 * i);

        if (mode == 0) {
            /* v / s as v * (1 / s): s is a power of two */
            float qv = cu_fp8_round(cu_clampf(v[i] * (1.0f / s), 448.0f)) * s;

            hi[at] = (uint16_t)(__float_as_uint(qv) >> 16);
        } else {
            float h = cu_bf16_round(v[i]);

            hi[at] = (uint16_t)(__float_as_uint(h) >> 16);
            if (mode == 1)
                lo[at] = isfinite(v[i]) ?
                         (uint16_t)(__float_as_uint(cu_bf16_round(v[i] - h)) >> 16) : 0;
        }
    }
}

/* The down GEMM's B value of h in a block of scale s (the exact path's FP8
 * code of h / s times s; h / s as h * (1 / s): s is a power of two, so both
 * are the same correctly rounded value), as bf16 bits. */
static __device__ __forceinline__ uint16_t
fw_hq_bits(float h, float s)
{
    float qv = cu_fp8_round(cu_clampf(h * (1.0f / s), 448.0f)) * s;

    return (uint16_t)(__float_as_uint(qv) >> 16);
}

/*
 * The shared expert's h from cuBLASLt's up GEMM (fw_shared_blas): gu (T,
 * 2I) bf16 holds g (columns 0 .. I-1) and u (I .. 2I-1) of each token; h =
 * bf16(swiglu(g, u)) and its quantization per 128 columns as fw_epilogue's
 * FG_UP form (amax floored at 1e-4, the power-of-two scale, fw_hq_bits),
 * into hq rows row0 + t in fw_perm order.  A warp per (token, 128-column
 * block), four columns a lane.
 */
static __global__ void
fw_sh_hq_kernel(uint16_t *hq, const uint16_t *gu, int I, int64_t row0, float lim)
{
    int t = blockIdx.x, c0 = blockIdx.y * 128 + threadIdx.x * 4;
    const uint16_t *gr = gu + (int64_t)t * 2 * I;
    uint16_t *hr = hq + (row0 + t) * I;
    float h[4], m = 0.0f, s;

#pragma unroll
    for (int j = 0; j < 4; j++) {
        h[j] = cu_bf16_round(cu_swiglu(cu_bf16_to_f32(gr[c0 + j]), cu_bf16_to_f32(gr[I + c0 + j]),
                                       lim));
        m = fmaxf(m, fabsf(h[j]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    s = cu_pow2_scale(fmaxf(1e-4f, m), 448.0f);
#pragma unroll
    for (int j = 0; j < 4; j++)
        hr[fw_perm(c0 + j)] = fw_hq_bits(h[j], s);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* d (64 x 16, fp32) += a (64 x 16, registers) * B (16 x 16 at desc). */
static __device__ __forceinline__ void
fw_mma16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{"
                 "%0, %1, %2, %3, %4, %5, %6, %7"
                 "}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"
                 : WG_D8(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

/* d (64 x 32, fp32) += a (64 x 16, registers) * B (16 x 32 at desc). */
static __device__ __forceinline__ void
fw_mma32(float (&d)[16], const uint32_t (&a)[4], uint64_t desc)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15"
                 "}, {%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
                 : WG_D16(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

/* d (64 x 64, fp32) += a (64 x 16, registers) * B (16 x 64 at desc). */
static __device__ __forceinline__ void
fw_mma64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
                 : WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

/* d (64 x 128, fp32) += a (64 x 16, registers) * B (16 x 128 at desc). */
static __device__ __forceinline__ void
fw_mma128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{"
                 WG_R64
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
                 : WG_D64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

/* d += a * B for the tile width BN. */
template <int BN>
static __device__ __forceinline__ void
fw_mma(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t desc)
{
    if constexpr (BN == 16)
        fw_mma16(d, a, desc);
    else if constexpr (BN == 32)
        fw_mma32(d, a, desc);
    else if constexpr (BN == 64)
        fw_mma64(d, a, desc);
    else
        fw_mma128(d, a, desc);
}

/*
 * Where a copier's cp.async of the next stage come from and go to: a
 * cursor worked out once per CTA after the row maps (fw_src_make), whose
 * source pointers step one stage's columns after each stage is queued
 * (fw_step, at the end of a stage's work).  Before, the address algebra
 * (row map, weight row, swizzle, 64-bit products) ran again for every chunk
 * of every stage (docs/perf.md run 32), and later each stage still worked
 * out its sources from kb into the registers the previous copies were
 * reading: a copy holds its address registers until the memory pipe takes
 * it, so the next address waited for it (Nsight Compute, run 40: a tenth of
 * the FP4 up kernel's stall samples).
 *
 * PT copiers share a stage's copies (fw_kernel: all C::THREADS threads;
 * fwp_kernel: its producer warpgroup, PT = 128); copier p:
 * A: chunk c = p % CH of CTA rows r + j * RS (r = p / CH, j < NA; RS = PT /
 * CH is a multiple of 8, of 16 for the up tiles, so the swizzle and the w1
 * / w3 choice are those of row r for every j): from pa[j] to stage offset
 * ad + j * RS * FW_AROW.
 * B: copy i = p + j * PT is token row n = 8 (i / 128) + i % 8, chunk c =
 * (i / 8) % 16, from pb[j] (zero-filled where bit j of bz is set: no row;
 * pb[j] then walks row 0, never read) to stage offset ((n / 8) 16 + c) 128
 * + (n % 8) 16 = bd + j * (PT / 128) * 2048; bit j of bn set: past the
 * tile's BN * 16 chunks, no copy.  So a warp's 32 copies fill four whole
 * 128-byte lines of the stage (8 tokens' chunk c side by side: no bank
 * conflicts) from 8 rows' 64 contiguous bytes each (until run 41 a warp
 * copied 16 chunks of one row, 128 bytes apart in shared memory: 8-way
 * bank conflicts on every B copy, Nsight Compute).
 * FP4 scales: rows p + j * PT < RA (j < NS), 4 bytes each from sc[j].
 */
template <int WF, int EPI, int NWG, int BN, int PT>
struct fw_src {
    typedef fw_cfg<WF, EPI, NWG, BN> C;
    static constexpr int CH = FW_AROW(WF) / 16;                      /* chunks per row */
    static constexpr int NA = C::RA * CH / PT;                        /* A chunks per copier */
    static constexpr int RS = PT / CH;                                /* rows between them */
    static constexpr int NBL = (BN * 16 + PT - 1) / PT;               /* B chunks */
    static constexpr int NS = (C::RA + PT - 1) / PT;                  /* FP4 scale rows */
    static_assert(C::RA * CH % PT == 0 && PT % 128 == 0 && RS % 8 == 0 &&
                      (EPI != FG_UP || RS % 16 == 0),
                  "fw_src: chunk layout");
    const uint8_t *pa[NA];  /* A: chunk j's source for the next stage */
    const uint16_t *pb[NBL];    /* B: chunk j's source (hi) for the next stage */
    const uint16_t *pl[NBL];    /* BF16 weights: the same in the lo parts */
    uint32_t ad;            /* A: first chunk's offset in a stage */
    uint32_t bd;            /* B: first chunk's offset in a stage */
    uint32_t bz, bn;        /* B: chunks zero-filled / not copied (bit j) */
    const uint8_t *sc[NS];  /* FP4: scale row j's next 4 bytes (row < RA), else NULL */
};

/* Copier p's fw_src at stage 0 (the row maps written and synchronised;
 * L1 / L3 the tile's weights, n0 its first weight row). */
template <int WF, int EPI, int NWG, int BN, int PT>
static __device__ __forceinline__ void
fw_src_make(struct fw_src<WF, EPI, NWG, BN, PT> &f, int p, const int *brow,
            const struct fw_args &a, const struct dsv4_linear &L1, const struct dsv4_linear &L3,
            int n0)
{
    typedef fw_src<WF, EPI, NWG, BN, PT> F;
    typedef fw_cfg<WF, EPI, NWG, BN> C;
    int K = a.K, r = p / F::CH, c = p % F::CH, is3;
    int wr = wg_wrow<EPI == FG_UP>(r, n0, &is3);
    int64_t rowb = WF == FG_FP4 ? K / 2 : WF == FG_FP8 ? K : (int64_t)K * 2;
    /* B rows: K values apart from column 0, or (grouped) the group's slice */
    int64_t ldb = EPI == FG_GROUPED ? a.ldb : K;
    int64_t b0 = EPI == FG_GROUPED ? (int64_t)(n0 / a.grows) * K : 0;
    const uint8_t *a0 = (const uint8_t *)(is3 ? L3 : L1).w + wr * rowb + c * 16;
    int64_t as = (EPI == FG_UP ? F::RS / 2 : F::RS) * rowb;

#pragma unroll
    for (int j = 0; j < F::NA; j++)
        f.pa[j] = a0 + j * as;
    f.ad = (uint32_t)wg_off<FW_AROW(WF)>(r, c);
    f.bd = (uint32_t)(((p >> 7) * 16 + ((p >> 3) & 15)) * 128 + (p & 7) * 16);
    f.bz = f.bn = 0;
#pragma unroll
    for (int j = 0; j < F::NBL; j++) {
        int i = p + j * PT, br = i < BN * 16 ? brow[8 * (i >> 7) + (i & 7)] : -1;
        int64_t o = br < 0 ? 0 : (int64_t)br * ldb + b0 + ((i >> 3) & 15) * 8;

        f.bn |= (uint32_t)(i >= BN * 16) << j;
        f.bz |= (uint32_t)(br < 0) << j;
        f.pb[j] = a.xb + o;
        f.pl[j] = WF == FW_BF16 ? a.xl + o : NULL;
    }
#pragma unroll
    for (int j = 0; j < F::NS; j++) {
        int row = p + j * PT;

        f.sc[j] = NULL;
        if (WF == FG_FP4 && row < C::RA) {
            int s3, sr = wg_wrow<EPI == FG_UP>(row, n0, &s3);

            f.sc[j] = (s3 ? L3 : L1).scale + (int64_t)sr * (K / 32);
        }
    }
}

/* Queue copier p's loads of the cursor's stage into the stage at sa / sb /
 * sl / ss. */
template <int WF, int EPI, int NWG, int BN, int PT>
static __device__ __forceinline__ void
fw_load(unsigned char *sa, unsigned char *sb, unsigned char *sl, unsigned char *ss, int p,
        const struct fw_src<WF, EPI, NWG, BN, PT> &f)
{
    typedef fw_src<WF, EPI, NWG, BN, PT> F;

#pragma unroll
    for (int j = 0; j < F::NA; j++)
        wg_cp16(sa + f.ad + j * F::RS * FW_AROW(WF), f.pa[j], 1);
#pragma unroll
    for (int j = 0; j < F::NBL; j++) {
        uint32_t d = f.bd + j * (PT / 128) * 2048;
        int ok = !((f.bz >> j) & 1);

        if ((f.bn >> j) & 1)
            continue;
        wg_cp16(sb + d, f.pb[j], ok);
        if (WF == FW_BF16)
            wg_cp16(sl + d, f.pl[j], ok);
    }
#pragma unroll
    for (int j = 0; j < F::NS; j++)
        if (WF == FG_FP4 && f.sc[j] != NULL)
            wg_cp4(ss + (p + j * PT) * 4, f.sc[j], 1);
}

/* The cursor to the next stage (128 columns on). */
template <int WF, int EPI, int NWG, int BN, int PT>
static __device__ __forceinline__ void
fw_step(struct fw_src<WF, EPI, NWG, BN, PT> &f)
{
    typedef fw_src<WF, EPI, NWG, BN, PT> F;

#pragma unroll
    for (int j = 0; j < F::NA; j++)
        f.pa[j] += FW_AROW(WF);
#pragma unroll
    for (int j = 0; j < F::NBL; j++) {
        f.pb[j] += 128;
        if (WF == FW_BF16)
            f.pl[j] += 128;
    }
#pragma unroll
    for (int j = 0; j < F::NS; j++)
        if (WF == FG_FP4 && f.sc[j] != NULL)
            f.sc[j] += 4;
}

/*
 * The 4 A fragments of half H (columns 64H .. 64H + 63; groups 2H, 2H + 1)
 * of a stage, rows ra = 16w + g of the warpgroup's block and ra + 8, into
 * af.  FP4: sca / scb the rows' four group scale bytes; the decoded pair
 * (fk_fp4pair_bf16, the values times 2^-126) times 2^126 * s_w in one bf16
 * multiply, exact for s_w up to 2^1; BIG (a scale of 2^1 or more, or NaN,
 * in the warp's stage) times 2^126, then times s_w.  FP8: swa / swb the
 * rows' block scales as bf16 pairs.  FP4 and FP8 take the words of group G
 * of rows ra and ra + 8 from pw[G] (FP4: the row's 32-bit word, then row ra
 * + 8's; FP8: the 8 bytes of row ra, then of ra + 8), which fw_kernel loads
 * at the start of the stage; BF16 reads shared memory here.
 */
template <int WF, int H, int BIG>
static __device__ __forceinline__ void
fw_dec(uint32_t (&af)[4][4], const unsigned char *sa, uint32_t sca, uint32_t scb, int ra,
       int q, uint32_t swa, uint32_t swb, const uint32_t (&pw)[4][4])
{
#pragma unroll
    for (int G2 = 0; G2 < 2; G2++) {
        const int G = 2 * H + G2;

        if (WF == FG_FP4) {
            uint32_t wa = pw[G][0], wb = pw[G][1];
            /* the group's scale bytes e in both halves; multiplier 2^126 * 2^(e - 127) */
            uint32_t ea = __byte_perm(sca, 0, G | 4 << 4 | G << 8 | 4 << 12);
            uint32_t eb = __byte_perm(scb, 0, G | 4 << 4 | G << 8 | 4 << 12);
            uint32_t ma = BIG ? 0x7e807e80u : ea * 128u + 0x3f003f00u;
            uint32_t mb = BIG ? 0x7e807e80u : eb * 128u + 0x3f003f00u;

#pragma unroll
            for (int s2 = 0; s2 < 2; s2++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int n = 2 * s2 + h;   /* columns 8q + n and 8q + n + 4 */
                    uint32_t va = fk_bmul2(fk_fp4pair_bf16(wa, n), ma);
                    uint32_t vb = fk_bmul2(fk_fp4pair_bf16(wb, n), mb);

                    if (BIG) {   /* a scale of 2^1 or more (or NaN): times it apart */
                        va = fk_bmul2(va, fk_e8m0_bf16x2(ea & 0xffu));
                        vb = fk_bmul2(vb, fk_e8m0_bf16x2(eb & 0xffu));
                    }
                    af[2 * G2 + s2][2 * h] = va;
                    af[2 * G2 + s2][2 * h + 1] = vb;
                }
        } else if (WF == FG_FP8) {
            uint2 va = make_uint2(pw[G][0], pw[G][1]), vb = make_uint2(pw[G][2], pw[G][3]);

#pragma unroll
            for (int s2 = 0; s2 < 2; s2++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int n = 2 * s2 + h;   /* bytes n and n + 4 of the 8 columns */
                    uint32_t sel = n | n << 4 | (4 + n) << 8 | (4 + n) << 12;

                    af[2 * G2 + s2][2 * h] =
                        fk_bmul2(fk_e4m3b02_bf16(__byte_perm(va.x, va.y, sel)), swa);
                    af[2 * G2 + s2][2 * h + 1] =
                        fk_bmul2(fk_e4m3b02_bf16(__byte_perm(vb.x, vb.y, sel)), swb);
                }
        } else {
            uint4 va = *(const uint4 *)(sa + wg_off<256>(ra, 4 * G + q));
            uint4 vb = *(const uint4 *)(sa + wg_off<256>(ra + 8, 4 * G + q));

#pragma unroll
            for (int s2 = 0; s2 < 2; s2++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int n = 2 * s2 + h;   /* columns n and n + 4: words n / 2 and n / 2 + 2 */
                    uint32_t sel = (n & 1) ? 0x7632u : 0x5410u;

                    af[2 * G2 + s2][2 * h] =
                        __byte_perm(fk_word(va, n >> 1), fk_word(va, (n >> 1) + 2), sel);
                    af[2 * G2 + s2][2 * h + 1] =
                        __byte_perm(fk_word(vb, n >> 1), fk_word(vb, (n >> 1) + 2), sel);
                }
        }
    }
}

/*
 * d += half H (columns 64H .. 64H + 63) of a stage of the warpgroup's 64
 * rows: fw_dec's 4 A fragments into af, then 4 (BF16: 8) wgmma as one
 * group, not waited for: the tensor cores run it while the warpgroup
 * decodes the next half into the other af (fw_kernel alternates two).
 * First waits until at most one group is pending, i.e. the group that read
 * af last (two commits ago) is done.  FP4: big (uniform in the warp) picks
 * fw_dec's two-multiply form; the wgmma stay outside the branch (every warp
 * of the warpgroup issues the same instructions).
 */
template <int WF, int BN, int H>
static __device__ __forceinline__ void
fw_half(float (&d)[BN / 2], uint32_t (&af)[4][4], const unsigned char *sa, uint32_t sb,
        uint32_t sl, uint32_t sca, uint32_t scb, int big, int ra, int q, uint32_t swa,
        uint32_t swb, const uint32_t (&pw)[4][4])
{
    wg_wait<1>();
    if (WF == FG_FP4 && big)
        fw_dec<WF, H, 1>(af, sa, sca, scb, ra, q, swa, swb, pw);
    else
        fw_dec<WF, H, 0>(af, sa, sca, scb, ra, q, swa, swb, pw);
    wg_fence();
#pragma unroll
    for (int s = 0; s < 4; s++) {
        fw_mma<BN>(d, af[s], wg_desc<FW_LBO, FW_SBO>(sb, 4 * H + s));
        if (WF == FW_BF16)
            fw_mma<BN>(d, af[s], wg_desc<FW_LBO, FW_SBO>(sl, 4 * H + s));
    }
    wg_commit();
}

/* Where fw_kernel's and fwp_kernel's shared memory holds what (fw_cfg's
 * plan): the ring's A, B, BF16 lo parts and FP4 scales, then the row maps
 * and the up epilogue's warp maxima, scales and route weights. */
template <int WF, int EPI, int NWG, int BN>
struct fw_smem {
    typedef fw_cfg<WF, EPI, NWG, BN> C;
    unsigned char *sa, *sb, *sl, *ss;
    int *brow, *orow;
    float *red, *scl, *rwt;

    __device__ __forceinline__ explicit fw_smem(unsigned char *base)
    {
        sa = base;
        sb = sa + C::S * C::AB;
        sl = sb + C::S * C::BB;
        ss = sl + (C::NB - 1) * C::S * C::BB;
        brow = (int *)(ss + C::S * C::SB);
        orow = brow + BN;
        red = (float *)(orow + BN);
        scl = red + (EPI == FG_UP ? 4 * NWG * BN : 0);
        rwt = scl + BN;
    }
};

/*
 * A tile's outputs from the accumulators d of consumer thread tid (0 ..
 * 128 * NWG - 1; fw_kernel: every thread, fwp_kernel: its consumer
 * warpgroups): FG_LINEAR / FG_GROUPED out (bf16-rounded or fp32), FG_UP h
 * and its quantization (the consumers meet on named barrier 1).  orow: the
 * tile's output rows, rwt its route weights, red / scl the up form's
 * maxima and scales, n0 the tile's first weight row.
 */
template <int WF, int EPI, int NWG, int BN>
static __device__ __forceinline__ void
fw_epilogue(const struct fw_args &a, const float (&d)[BN / 2], const int *orow, const float *rwt,
            float *red, float *scl, int n0)
{
    int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    int g = lane >> 2, q = lane & 3, ra = warp * 16 + g;   /* row in the warpgroup's 64 */

    /* D fragment: d[4j + i] is row ra + 8 * (i >> 1) of the warpgroup's 64,
     * token 8j + 2q + (i & 1) */
    if (EPI != FG_UP) {   /* FG_LINEAR, FG_GROUPED */
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int r = orow[8 * j + 2 * q + (i & 1)];
                int64_t o;

                if (r < 0)
                    continue;
                o = (int64_t)r * a.ldo + n0 + wg * 64 + ra + 8 * (i >> 1);
                if (a.outb != NULL)   /* bf16 bits: cu_bf16_round's value */
                    a.outb[o] = (uint16_t)(__float_as_uint(cu_bf16_round(d[4 * j + i])) >> 16);
                else
                    a.out[o] = a.f32out ? d[4 * j + i] : cu_bf16_round(d[4 * j + i]);
            }
    } else {
        /* h of column c = wg*32 + warp*8 + g (rows ra: w1, ra + 8: w3) */
        int c = n0 + wg * 32 + warp * 8 + g, wid = wg * 4 + warp;
        float h[BN / 4];

#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int ii = 0; ii < 2; ii++) {
                int n = 8 * j + 2 * q + ii, r = orow[n];
                float v = cu_swiglu(d[4 * j + ii], d[4 * j + 2 + ii], a.lim), m;

                if (a.weights != NULL && r >= 0)
                    v *= rwt[n];
                v = cu_bf16_round(v);
                h[2 * j + ii] = v;
                m = fabsf(v);
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
                if (g == 0)
                    red[wid * BN + n] = m;
            }
        wg_sync<1, 128 * NWG>();
        if (tid < BN) {   /* token tid's scale, from the 4 * NWG warps' maxima */
            float amax = 1e-4f;

            for (int w = 0; w < 4 * NWG; w++)
                amax = fmaxf(amax, red[w * BN + tid]);
            scl[tid] = cu_pow2_scale(amax, 448.0f);
        }
        wg_sync<1, 128 * NWG>();
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int ii = 0; ii < 2; ii++) {
                int n = 8 * j + 2 * q + ii, r = orow[n];
                float s = scl[n];

                if (r < 0)
                    continue;
                a.hq[(int64_t)r * a.ldo + fw_perm(c)] = fw_hq_bits(h[2 * j + ii], s);
            }
    }
}

#endif   /* __CUDA_ARCH_FEAT_SM90_ALL */

/*
 * Grid (weight row tiles of RA rows (FG_UP: 128 columns of I), token tiles).
 * Dense (a.table == NULL): token tile y is rows y*BN .. of a.M.  Routed: tile
 * slot y of the grouping, or nothing.
 */
template <int WF, int EPI, int NWG, int BN>
static __global__ void __launch_bounds__(128 * NWG, (fw_cfg<WF, EPI, NWG, BN>::BLOCKS))
fw_kernel(struct fw_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef fw_cfg<WF, EPI, NWG, BN> C;
    extern __shared__ __align__(128) unsigned char fw_sm[];
    const struct fw_smem<WF, EPI, NWG, BN> m(fw_sm);
    unsigned char *sa = m.sa, *sb = m.sb, *sl = m.sl, *ss = m.ss;
    int *brow = m.brow, *orow = m.orow;
    float *red = m.red, *scl = m.scl, *rwt = m.rwt;
    struct dsv4_linear L1, L3;
    int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    int g = lane >> 2, q = lane & 3, ra = warp * 16 + g;   /* row in the warpgroup's 64 */
    int n0 = blockIdx.x * (EPI == FG_UP ? 128 : C::RA), nkt = a.K / 128;
    uint32_t sb0 = (uint32_t)__cvta_generic_to_shared(sb);
    uint32_t sl0 = (uint32_t)__cvta_generic_to_shared(sl);
    const unsigned char *sw1 = NULL, *sw3 = NULL;
    float d[BN / 2];
    uint32_t af0[4][4], af1[4][4];   /* the two halves' A fragments (fw_half) */
    struct fw_src<WF, EPI, NWG, BN, C::THREADS> fs;

    if (!wg_tile_rows<BN, C::THREADS>(a, brow, orow, L1, L3))
        return;   /* an idle slot: the whole block leaves */
    __syncthreads();   /* the row maps, before the loads use them */
    fw_src_make<WF, EPI, NWG, BN, C::THREADS>(fs, tid, brow, a, L1, L3, n0);
    /* the route weights now, read in the epilogue after the stages'
     * barriers (loaded there, each waited for its own global load) */
    if (EPI == FG_UP && a.weights != NULL && tid < BN && orow[tid] >= 0)
        rwt[tid] = a.weights[orow[tid]];
    /* loads run S - 2 stages ahead: the buffer a load refills was last read
     * by the wgmma of two stages back, which every warpgroup has waited for
     * (fw_half) before the barrier that precedes the load */
    for (int s = 0; s < C::S - 2; s++) {
        if (s < nkt) {
            fw_load<WF, EPI, NWG, BN, C::THREADS>(sa + s * C::AB, sb + s * C::BB, sl + s * C::BB,
                                                  ss + s * C::SB, tid, fs);
            fw_step<WF, EPI, NWG, BN, C::THREADS>(fs);
        }
        wg_cp_commit();
    }
    if (WF == FG_FP8) {
        /* block scale rows of this thread's two weight rows (128-row blocks) */
        int is3a, is3b, wa = wg_wrow<EPI == FG_UP>(wg * 64 + ra, n0, &is3a);
        int wb = wg_wrow<EPI == FG_UP>(wg * 64 + ra + 8, n0, &is3b);

        sw1 = (is3a ? L3 : L1).scale + (int64_t)(wa / 128) * nkt;
        sw3 = (is3b ? L3 : L1).scale + (int64_t)(wb / 128) * nkt;
    }
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        d[i] = 0.0f;

    for (int kt = 0; kt < nkt; kt++) {
        int st = kt % C::S, nx = kt + C::S - 2;
        uint32_t swa = 0, swb = 0, sca = 0, scb = 0, pw[4][4] = {};
        int big = 0;
        /* this stage's weight rows of the warpgroup */
        const unsigned char *sas = sa + st * C::AB + wg * 64 * FW_AROW(WF);

        wg_cp_wait<C::S - 3>();
        wg_fence_proxy();
        __syncthreads();   /* stage kt landed for all; stage kt - 2 read by all */
        if (WF != FW_BF16) {
            /* the stage's A words of rows ra and ra + 8 (all four groups),
             * loaded first: in fw_dec, behind fw_half's wait (a memory
             * clobber), the second half's loads could not start early */
#pragma unroll
            for (int G = 0; G < 4; G++) {
                if (WF == FG_FP4) {
                    pw[G][0] = *(const uint32_t *)(sas + wg_off<FG_BROW(FG_FP4)>(ra, G) + q * 4);
                    pw[G][1] =
                        *(const uint32_t *)(sas + wg_off<FG_BROW(FG_FP4)>(ra + 8, G) + q * 4);
                } else {
                    int c = 2 * G + (q >> 1), o = (q & 1) * 8;
                    uint2 va = *(const uint2 *)(sas + wg_off<FG_BROW(FG_FP8)>(ra, c) + o);
                    uint2 vb = *(const uint2 *)(sas + wg_off<FG_BROW(FG_FP8)>(ra + 8, c) + o);

                    pw[G][0] = va.x, pw[G][1] = va.y, pw[G][2] = vb.x, pw[G][3] = vb.y;
                }
            }
        }
        if (WF == FG_FP4) {
            /* rows ra's and ra + 8's four group scales, with the words:
             * behind the copies below they waited in the memory pipe */
            const unsigned char *sw = ss + st * C::SB + wg * 64 * 4;

            sca = *(const uint32_t *)(sw + ra * 4);
            scb = *(const uint32_t *)(sw + (ra + 8) * 4);
        }
        if (nx < nkt) {
            int sn = nx % C::S;

            fw_load<WF, EPI, NWG, BN, C::THREADS>(sa + sn * C::AB, sb + sn * C::BB,
                                                  sl + sn * C::BB, ss + sn * C::SB, tid, fs);
        }
        wg_cp_commit();
        if (WF == FG_FP8) {
            swa = fk_e8m0_bf16x2(__ldg(sw1 + kt));
            swb = fk_e8m0_bf16x2(__ldg(sw3 + kt));
        }
        /* big: a group scale of 2^1 or more (or NaN) in the warp, which
         * fw_dec multiplies in apart */
        if (WF == FG_FP4)
            big = __any_sync(0xffffffffu, ((sca | scb) & 0x80808080u) != 0);
        {
            /* this stage's B and BF16 lo parts */
            uint32_t sbs = sb0 + st * C::BB, sls = sl0 + st * C::BB;

            fw_half<WF, BN, 0>(d, af0, sas, sbs, sls, sca, scb, big, ra, q, swa, swb, pw);
            fw_half<WF, BN, 1>(d, af1, sas, sbs, sls, sca, scb, big, ra, q, swa, swb, pw);
        }
        /* the cursor steps after the stage's work, when the copies it
         * queued have long left with its address registers */
        if (nx < nkt)
            fw_step<WF, EPI, NWG, BN, C::THREADS>(fs);
    }
    wg_wait<0>();
    wg_hold(d);
    fw_epilogue<WF, EPI, NWG, BN>(a, d, orow, rwt, red, scl, n0);
#endif
}

/*
 * fwp_kernel's consumers: one item's nkt stages from the ring (slot st,
 * parity ph, pv the slot last read; all carried on to the next item).
 * Each stage's slot is released once the next stage's first wgmma wait
 * shows its wgmma done; the item's last stage's by the caller.
 */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int WF, int EPI, int NWG, int BN>
static __device__ __forceinline__ void
fwp_stages(const struct fw_smem<WF, EPI, NWG, BN> &m, float (&d)[BN / 2], uint32_t (&af0)[4][4],
           uint32_t (&af1)[4][4], uint32_t full, uint32_t empty, int nkt, int &st, int &ph,
           int &pv)
{
    typedef fw_cfg<WF, EPI, NWG, BN> C;
    int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    int g = lane >> 2, q = lane & 3, ra = warp * 16 + g;   /* row in the warpgroup's 64 */
    uint32_t sb0 = (uint32_t)__cvta_generic_to_shared(m.sb);
    uint32_t sl0 = (uint32_t)__cvta_generic_to_shared(m.sl);

    for (int kt = 0; kt < nkt; kt++) {
        uint32_t sca, scb, pw[4][4] = {};
        int big;
        /* this stage's weight rows of the warpgroup, scales, B */
        const unsigned char *sas = m.sa + st * C::AB + wg * 64 * FW_AROW(WF);
        const unsigned char *sw = m.ss + st * C::SB + wg * 64 * 4;
        uint32_t sbs = sb0 + st * C::BB, sls = sl0 + st * C::BB;

        wg_bar_wait(full + 8 * st, (uint32_t)ph);
        wg_fence_proxy();   /* the stage's B, copied by cp.async, before the wgmma read it */
#pragma unroll
        for (int G = 0; G < 4; G++) {
            const unsigned char *pa = sas + q * 4;

            pw[G][0] = *(const uint32_t *)(pa + wg_off<FG_BROW(FG_FP4)>(ra, G));
            pw[G][1] = *(const uint32_t *)(pa + wg_off<FG_BROW(FG_FP4)>(ra + 8, G));
        }
        sca = *(const uint32_t *)(sw + ra * 4);
        scb = *(const uint32_t *)(sw + (ra + 8) * 4);
        big = __any_sync(0xffffffffu, ((sca | scb) & 0x80808080u) != 0);
        fw_half<WF, BN, 0>(d, af0, sas, sbs, sls, sca, scb, big, ra, q, 0, 0, pw);
        fw_half<WF, BN, 1>(d, af1, sas, sbs, sls, sca, scb, big, ra, q, 0, 0, pw);
        /* fw_half's wait of the second half: the previous stage's
         * wgmma are done, its slot free (its A words were read
         * before them); at the item's first stage the caller has
         * released the previous item's last */
        if (kt > 0 && lane == 0)
            wg_bar_arrive(empty + 8 * pv);
        pv = st;
        if (++st == C::S) {
            st = 0;
            ph ^= 1;
        }
    }
}
#endif

/*
 * fwp_kernel (sm_90a): fw_kernel's routed FP4 tiles of four warpgroups (the
 * MoE's up tiles; its down tiles of 64 tokens) with the copies on a fifth,
 * producer warpgroup.  In fw_kernel every thread queued its share of a
 * stage's cp.async (address registers, predicates, ~80 instructions a warp
 * and stage of ~330) and all 16 warps met at a CTA barrier every stage
 * (perf.md run 40: 9% of the stall samples).  Here the 128 producer threads
 * (fw_src with PT = 128: 8 A chunks, 8 B chunks and 2 scale rows each)
 * fill a ring of C::S stages: per stage each waits until the consumers
 * have released the slot (mbarrier `empty`, one arrival per consumer warp),
 * queues its copies and arrives at the slot's `full` mbarrier through
 * cp.async.mbarrier.arrive (counted once its copies have landed).  The
 * consumer warpgroups wait on `full`, make the B operand visible to the
 * async proxy, load the stage's A words and scales, decode and issue the
 * wgmma as fw_kernel (fw_half), and release the previous stage once its
 * wgmma are done (fw_half's wait of the second half).  No CTA barrier in
 * the loop.  The epilogue (fw_epilogue) is fw_kernel's: the same values,
 * bit for bit.
 *
 * Persistent (perf.md run 49): a CTA runs items (column block x, tile y)
 * one after another, w = y * a.gx + x, from the counter a.ctr (an atomic
 * add per item: a late CTA, under MPS or beside another kernel, only finds
 * fewer) or, with a.ctr NULL, blockIdx.x + i * gridDim.x.  The producer's
 * thread 0 takes the item and passes it to the consumers through a
 * two-entry ring in shared memory (mbarriers `ifull`, one arrival, and
 * `iempty`, one per consumer warp); the stage ring's slots and parities run
 * on across items, so the producer queues the next item's first stages
 * while the consumers run the last one's epilogue (which had left the SM's
 * tensor cores idle: perf.md run 40, the epilogue and the prologue 22% of
 * fw_kernel's stall samples).  Producer and consumers each write the row
 * map they read (brow / orow and the route weights), behind their own
 * named barriers (2 and 1).  Each item's values are those of the one-tile
 * form: the same bits.
 */
#define FWP_PT 128   /* producer threads */

template <int WF, int EPI, int NWG, int BN>
static __global__ void __launch_bounds__(128 * NWG + FWP_PT, 1)
fwp_kernel(struct fw_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef fw_cfg<WF, EPI, NWG, BN> C;
    extern __shared__ __align__(128) unsigned char fw_sm[];
    const struct fw_smem<WF, EPI, NWG, BN> m(fw_sm);   /* the ring, maps, epilogue's */
    uint32_t full = (uint32_t)__cvta_generic_to_shared(fw_sm + C::SMEM), empty = full + 8 * C::S;
    uint32_t ifull = empty + 8 * C::S, iempty = ifull + 16;
    volatile int *item = (volatile int *)(fw_sm + C::SMEM + 16 * C::S + 32);
    int tid = threadIdx.x, nkt = a.K / 128;

    static_assert(WF == FG_FP4 && NWG == 4, "fwp_kernel: routed FP4 tiles of four warpgroups");
    if (tid == 0) {
        for (int s = 0; s < C::S; s++) {
            wg_bar_init(full + 8 * s, FWP_PT);
            wg_bar_init(empty + 8 * s, 4 * NWG);
        }
        for (int s = 0; s < 2; s++) {
            wg_bar_init(ifull + 8 * s, 1);
            wg_bar_init(iempty + 8 * s, 4 * NWG);
        }
    }
    __syncthreads();   /* the mbarriers */

    if (tid >= C::THREADS) {
        /* the producer: stage kt of item i into slot st, its round's parity ph */
        int p = tid - C::THREADS, st = 0, ph = 0, g = 0;
        int ny = a.table != NULL ? min(a.grp[0], a.gy) : a.gy, items = a.gx * ny;

        for (int i = 0;; i++) {
            struct fw_src<WF, EPI, NWG, BN, FWP_PT> fs;
            struct dsv4_linear L1, L3;
            int w, x, n0;

            if (p == 0) {
                if (i >= 2)   /* the consumers have read the entry's item i - 2 */
                    wg_bar_wait(iempty + 8 * (i & 1), (uint32_t)(((i >> 1) & 1) ^ 1));
                w = a.ctr != NULL ? atomicAdd(a.ctr, 1) : (int)blockIdx.x + i * (int)gridDim.x;
                item[i & 1] = w < items ? w : -1;
                wg_bar_arrive(ifull + 8 * (i & 1));
            }
            /* item i's entry written; every producer thread done with item
             * i - 1's brow (fw_src_make) */
            wg_sync<2, FWP_PT>();
            w = item[i & 1];
            if (w < 0)
                break;
            x = w % a.gx;
            n0 = x * (EPI == FG_UP ? 128 : C::RA);
            wg_tile_rows_at<BN, WG_BROW>(a, w / a.gx, p, FWP_PT, m.brow, (int *)NULL, L1, L3);
            wg_sync<2, FWP_PT>();   /* brow */
            fw_src_make<WF, EPI, NWG, BN, FWP_PT>(fs, p, m.brow, a, L1, L3, n0);
            for (int kt = 0; kt < nkt; kt++, g++) {
                if (g >= C::S)   /* the slot's stage of the previous round released */
                    wg_bar_wait(empty + 8 * st, (uint32_t)(ph ^ 1));
                fw_load<WF, EPI, NWG, BN, FWP_PT>(m.sa + st * C::AB, m.sb + st * C::BB,
                                                  m.sl + st * C::BB, m.ss + st * C::SB, p, fs);
                wg_bar_cp_arrive(full + 8 * st);
                fw_step<WF, EPI, NWG, BN, FWP_PT>(fs);
                if (++st == C::S) {
                    st = 0;
                    ph ^= 1;
                }
            }
        }
        wg_cp_wait_mem<0>();   /* leave with no copy in flight */
        return;
    }

    {
        int lane = tid & 31, st = 0, ph = 0, pv = C::S - 1;

        for (int i = 0;; i++) {
            float d[BN / 2];
            uint32_t af0[4][4], af1[4][4];   /* the two halves' A fragments (fw_half) */
            struct dsv4_linear L1, L3;
            int w, n0;

            wg_bar_wait(ifull + 8 * (i & 1), (uint32_t)((i >> 1) & 1));
            w = item[i & 1];
            __syncwarp();
            if (lane == 0)
                wg_bar_arrive(iempty + 8 * (i & 1));
            if (w < 0)
                break;
            n0 = (w % a.gx) * (EPI == FG_UP ? 128 : C::RA);
            wg_sync<1, C::THREADS>();   /* the previous item's epilogue done with orow, rwt */
            wg_tile_rows_at<BN, WG_OROW>(a, w / a.gx, tid, C::THREADS, (int *)NULL, m.orow, L1,
                                         L3);
            /* orow[tid] was written by this thread */
            if (EPI == FG_UP && a.weights != NULL && tid < BN && m.orow[tid] >= 0)
                m.rwt[tid] = a.weights[m.orow[tid]];
            wg_sync<1, C::THREADS>();   /* orow, rwt */
#pragma unroll
            for (int j = 0; j < BN / 2; j++)
                d[j] = 0.0f;
            fwp_stages<WF, EPI, NWG, BN>(m, d, af0, af1, full, empty, nkt, st, ph, pv);
            wg_wait<0>();
            if (lane == 0)   /* the item's last stage: its wgmma are done */
                wg_bar_arrive(empty + 8 * pv);
            wg_hold(d);
            fw_epilogue<WF, EPI, NWG, BN>(a, d, m.orow, m.rwt, m.red, m.scl, n0);
        }
    }
#endif
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

template <int WF, int EPI, int MT, int NS>
static enum dsv4_err
fg_launch(struct dsv4_backend *be, const struct fg_args *a, unsigned gx, unsigned gy)
{
    static size_t smem_done[CUDA_MAX_DEV];   /* per instantiation and device */
    size_t smem = fg_smem_bytes(WF, MT, NS);
    enum dsv4_err e = cuda_smem_allow(be, (const void *)fg_kernel<WF, EPI, MT, NS>, smem,
                                      smem_done);

    if (e != DSV4_OK)
        return e;
    fg_kernel<WF, EPI, MT, NS><<<dim3(gx, gy), FG_THREADS, smem, cuda_stream(be)>>>(*a);
    CUDA_LAUNCHED("fast gemm");
    return DSV4_OK;
}

/* The tile kernel with the row tile chosen at run time (MT = 2 or 4; the
 * callers took it from fg_tile_fit or fg_moe_tile) and the stages that fit
 * be's device (fg_stages). */
template <int WF, int EPI>
static enum dsv4_err
fg_run(struct dsv4_backend *be, const struct fg_args *a, int mt, unsigned gx, unsigned gy)
{
    int ns = fg_stages(be, WF, mt);

    if (mt == 4 && ns == FG_STAGES)
        return fg_launch<WF, EPI, 4, FG_STAGES>(be, a, gx, gy);
    if (mt == 2 && ns == FG_STAGES)
        return fg_launch<WF, EPI, 2, FG_STAGES>(be, a, gx, gy);
    if (mt == 2 && ns == 2)
        return fg_launch<WF, EPI, 2, 2>(be, a, gx, gy);
    return dsv4_err_set(DSV4_ERR_NOTSUP, "fast gemm: no tile of %d rows fits the device's "
                        "%zu bytes of shared memory a block", 32 * mt, cuda_smem_max(be));
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

/* --- the Hopper path, host side ------------------------------------------------------------ */

static int fw_override = -1;   /* dsv4_cuda_set_wgmma; -1: the environment decides */

void
dsv4_cuda_set_wgmma(int on)
{
    fw_override = on < 0 ? -1 : on != 0;
}

/* The wgmma path for this backend's device: sm_90 only, on unless
 * DSV4_CUDA_WGMMA=0 (or off) or dsv4_cuda_set_wgmma(0). */
static int
fw_enabled(const struct dsv4_backend *be)
{
    static int env = -1;

    if (env < 0) {
        const char *v = getenv("DSV4_CUDA_WGMMA");

        env = !(v != NULL && (strcmp(v, "off") == 0 || strcmp(v, "0") == 0));
    }
    if (!(fw_override < 0 ? env : fw_override))
        return 0;
    return cuda_sm90((struct dsv4_backend *)be);
}

template <int WF, int EPI, int NWG, int BN>
static enum dsv4_err
fw_launch(struct dsv4_backend *be, const struct fw_args *a, unsigned gx, unsigned gy)
{
    typedef fw_cfg<WF, EPI, NWG, BN> C;
    static size_t smem_done[CUDA_MAX_DEV];   /* per instantiation and device */
    enum dsv4_err e;

    static_assert(C::S >= 3, "fw_kernel: shared memory for fewer than 3 stages");
    static_assert(EPI != FG_UP || NWG == 4, "fw_kernel: the up epilogue needs 128 columns");
    e = cuda_smem_allow(be, (const void *)fw_kernel<WF, EPI, NWG, BN>, C::SMEM, smem_done);
    if (e != DSV4_OK)
        return e;
    if (gx == 0 || gy == 0)
        return DSV4_OK;
    fw_kernel<WF, EPI, NWG, BN><<<dim3(gx, gy), C::THREADS, C::SMEM, cuda_stream(be)>>>(*a);
    CUDA_LAUNCHED("fast gemm (wgmma)");
    return DSV4_OK;
}

/* DSV4_CUDA_FW_PRODUCER=0: the routed FP4 tiles of four warpgroups on
 * fw_kernel instead of fwp_kernel. */
static struct cuda_switch fwp_switch = CUDA_SWITCH("DSV4_CUDA_FW_PRODUCER", 1);

/* DSV4_CUDA_FW_PERSIST=0: fwp_kernel with one item (column block, tile) a
 * CTA, as until run 49, instead of one CTA an SM taking items from the
 * launch's counter. */
static struct cuda_switch fwp_persist_switch = CUDA_SWITCH("DSV4_CUDA_FW_PERSIST", 1);

/* fwp_kernel<FG_FP4, EPI, 4, BN> on grid (gx, gy) (fw_kernel<...> when
 * DSV4_CUDA_FW_PRODUCER=0).  Used for the tiles of 64 tokens: at 32 and 16
 * fw_kernel was faster (docs/perf.md run 41). */
template <int EPI, int BN>
static enum dsv4_err
fwp_launch(struct dsv4_backend *be, const struct fw_args *a, unsigned gx, unsigned gy)
{
    typedef fw_cfg<FG_FP4, EPI, 4, BN> C;
    static size_t smem_done[CUDA_MAX_DEV];   /* per instantiation and device */
    /* + the full and empty mbarriers, ifull and iempty, the item entries */
    size_t smem = (size_t)C::SMEM + 16 * C::S + 32 + 8;
    struct fw_args b = *a;
    unsigned grid = gx * gy;
    enum dsv4_err e;

    if (!cuda_switch_on(&fwp_switch))
        return fw_launch<FG_FP4, EPI, 4, BN>(be, a, gx, gy);
    e = cuda_smem_allow(be, (const void *)fwp_kernel<FG_FP4, EPI, 4, BN>, smem, smem_done);
    if (e != DSV4_OK)
        return e;
    if (gx == 0 || gy == 0)
        return DSV4_OK;
    b.gx = (int)gx;
    b.gy = (int)gy;
    if (b.ctr != NULL && cuda_switch_on(&fwp_persist_switch)) {
        if (grid > (unsigned)cuda_sms(be))
            grid = (unsigned)cuda_sms(be);   /* one CTA an SM, items from the counter */
    } else {
        b.ctr = NULL;   /* one item a CTA */
    }
    fwp_kernel<FG_FP4, EPI, 4, BN><<<grid, C::THREADS + FWP_PT, smem, cuda_stream(be)>>>(b);
    CUDA_LAUNCHED("fast gemm (wgmma, producer)");
    return DSV4_OK;
}

/* The instantiations used: routed FP4 up (NWG 4) and down (NWG 2) at token
 * tiles of 16, 32, 64 (down at 64: NWG 4, fw_moe); the FP8 shared expert
 * and linears; BF16 linears. */
template <int WF, int EPI, int NWG>
static enum dsv4_err
fw_run(struct dsv4_backend *be, const struct fw_args *a, int bn, unsigned gx, unsigned gy)
{
    if constexpr (WF == FG_FP4) {
        if (bn == 64 && NWG == 4)   /* the producer form (fwp_kernel) */
            return fwp_launch<EPI, 64>(be, a, gx, gy);
        if (bn == 16)
            return fw_launch<WF, EPI, NWG, 16>(be, a, gx, gy);
        if (bn == 32)
            return fw_launch<WF, EPI, NWG, 32>(be, a, gx, gy);
        if (bn == 64)
            return fw_launch<WF, EPI, NWG, 64>(be, a, gx, gy);
    } else if constexpr (EPI == FG_UP) {
        if (bn == 64)
            return fw_launch<WF, EPI, NWG, 64>(be, a, gx, gy);
    } else {
        if (bn == 32)
            return fw_launch<WF, EPI, NWG, 32>(be, a, gx, gy);
        if (bn == 64)
            return fw_launch<WF, EPI, NWG, 64>(be, a, gx, gy);
        if constexpr (WF == FG_FP8) {
            if (bn == 128)
                return fw_launch<WF, EPI, NWG, 128>(be, a, gx, gy);
        }
    }
    return dsv4_err_set(DSV4_ERR_INVAL, "fast gemm (wgmma): no tile of %d tokens", bn);
}

/* B values of x (rows, K): mode 0 REF quantized, 1 the hi/lo split. */
static enum dsv4_err
fw_prep(struct dsv4_backend *be, uint16_t *hi, uint16_t *lo, const float *x, int64_t stride,
        int rows, int K, int mode)
{
    int64_t warps = (int64_t)rows * (K / 128);

    if (warps <= 0)
        return DSV4_OK;
    fw_prep_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, cuda_stream(be)>>>(
        hi, lo, x, stride, rows, K, mode);
    CUDA_LAUNCHED("fast gemm prep");
    return DSV4_OK;
}

/*
 * Token tile of the dense linear (W: n_out N, n_in K, bpe weight bytes per
 * value) at T rows, or 0 when the decode kernels are expected to be faster.
 * A first model, to be tuned from bench_fast: the decode kernels read the
 * weights once per 16 rows at ~2 TB/s; a CTA of the wgmma kernel streams its
 * weight rows and token rows at ~28 GB/s (4.3 TB/s over 132 SMs, less the
 * misses) and computes at ~3 TFLOP/s (half of the SM's bf16 peak), in waves
 * of 132 CTAs.  Depends on T, N, K only.
 */
static int
fw_linear_bn(int T, int N, int K, int bpe)
{
    int ra = N % 128 == 0 ? 128 : 64, best_bn = 0, nb = bpe == 2 ? 2 : 1;
    double dec = (double)((T + 15) / 16) * ((double)N * K * bpe / 2.0e12 + 4e-6), best = dec;

    for (int bn = 32; bn <= (bpe == 1 ? 128 : 64); bn *= 2) {
        double ctas = (double)(N / ra) * ((T + bn - 1) / bn), waves = ceil(ctas / FG_SMS);
        double bytes = (double)ra * K * bpe + (double)bn * K * 2 * nb;
        double flops = 2.0 * ra * bn * K * nb;
        double t = waves * (fmax(bytes / 28e9, flops / 3.0e12) + 2e-6);

        if (t < best) {
            best = t;
            best_bn = bn;
        }
    }
    return best_bn;
}

/* Scratch bytes of fw_linear: the B values (and the lo parts for BF16). */
static size_t
fw_linear_scratch(const struct dsv4_linear *W, int T)
{
    return (W->fmt == DSV4_WFMT_BF16 ? 2 : 1) *
           cuda_align((size_t)T * W->n_in * sizeof(uint16_t));
}

/* The dense linear through fw_kernel: FP8 (REF) or BF16 weights; its
 * scratch starts `off` bytes into the backend scratch. */
static enum dsv4_err
fw_linear(struct dsv4_backend *be, float *out, const float *x, const struct dsv4_linear *W,
          int T, unsigned flags, size_t off)
{
    int N = W->n_out, K = W->n_in, bf = W->fmt == DSV4_WFMT_BF16;
    int bn = fw_linear_bn(T, N, K, bf ? 2 : 1), nwg = N % 128 == 0 ? 2 : 1;
    size_t bx = cuda_align((size_t)T * K * sizeof(uint16_t));
    char *p;
    struct fw_args a;
    enum dsv4_err e;
    unsigned gx = (unsigned)(N / (64 * nwg)), gy;

    if (T <= 0)
        return DSV4_OK;
    p = (char *)cuda_scratch(be, off + fw_linear_scratch(W, T));
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast gemm: no scratch for %d x %d", T, K);
    p += off;
    bn = bn == 0 ? 64 : bn;
    gy = (unsigned)((T + bn - 1) / bn);
    memset(&a, 0, sizeof(a));
    a.W = *W;
    a.W3 = *W;
    a.xb = (const uint16_t *)p;
    a.xl = bf ? (const uint16_t *)(p + bx) : NULL;
    a.out = out;
    a.ldo = N;
    a.M = T;
    a.K = K;
    a.f32out = bf && (flags & DSV4_LIN_F32_OUT);
    e = fw_prep(be, (uint16_t *)a.xb, (uint16_t *)a.xl, x, K, T, K, bf);
    if (e != DSV4_OK)
        return e;
    if (bf)
        return nwg == 2 ? fw_run<FW_BF16, FG_LINEAR, 2>(be, &a, bn, gx, gy)
                        : fw_run<FW_BF16, FG_LINEAR, 1>(be, &a, bn, gx, gy);
    return fw_run<FG_FP8, FG_LINEAR, 2>(be, &a, bn, gx, gy);
}

int
cuda_fast_gemm_bf16_ok(const struct dsv4_backend *be, const struct dsv4_linear *W, int T)
{
    if (T <= FG_DECODE_ROWS || !fg_enabled() || !fw_enabled(be) ||
        W->fmt != DSV4_WFMT_BF16 || W->w == NULL || W->n_in <= 0 || W->n_in % 128 != 0 ||
        W->n_out <= 0 || W->n_out % 64 != 0 || (uintptr_t)W->w % 16 != 0)
        return 0;
    return fw_linear_bn(T, W->n_out, W->n_in, 2) != 0;
}

enum dsv4_err
cuda_fast_gemm_bf16(struct dsv4_backend *be, float *out, const float *x,
                    const struct dsv4_linear *W, int T, unsigned flags)
{
    return cuda_fast_gemm_bf16_at(be, out, x, W, T, flags, 0);
}

size_t
cuda_fast_gemm_bf16_scratch(const struct dsv4_linear *W, int T)
{
    return fw_linear_scratch(W, T);
}

enum dsv4_err
cuda_fast_gemm_bf16_at(struct dsv4_backend *be, float *out, const float *x,
                       const struct dsv4_linear *W, int T, unsigned flags, size_t off)
{
    /* cuBLASLt first (fast_blas.cu; the same scratch: 2 T K bf16 from off) */
    enum dsv4_err e = cuda_blas_bf16(be, out, x, W, T, flags, off, 1);

    if (e != DSV4_ERR_NOTSUP)
        return e;
    return fw_linear(be, out, x, W, T, flags, off);
}

/* --- linear_multi at prefill: x prepared once ------------------------------------------ */

/* DSV4_CUDA_LIN_SHARE=0: cuda_fast_gemm_multi takes none (each linear
 * prepares its x, as cuda_linear alone). */
static struct cuda_switch lm_share_switch = CUDA_SWITCH("DSV4_CUDA_LIN_SHARE", 1);

/* Whether cuda_linear (with the fast kernels on) gives W at T rows to the
 * FP8 cuBLASLt form (cuda_fast_gemm_linear, then its FP8 x FP8 form; the
 * form itself may still turn it down: cuda_fast_gemm8_blas / _b16). */
static int
fg8_blas_route(struct dsv4_backend *be, const struct dsv4_linear *W, int T)
{
    return cuda_fast_gemm_linear_ok(be, W, T) && fw_enabled(be) && cuda_fast_gemm8_on();
}

enum dsv4_err
cuda_fast_gemm_multi(struct dsv4_backend *be, int n, float *const *outs, const float *x,
                     const struct dsv4_linear *const *Ws, const unsigned *flags, int T,
                     int *done)
{
    size_t need = 0;
    int split = 1, quant = 1, K = n > 0 ? Ws[0]->n_in : 0;

    for (int i = 0; i < n; i++)
        done[i] = 0;
    if (n < 2 || !cuda_st(be)->fast_kernels || !cuda_switch_on(&lm_share_switch))
        return DSV4_OK;
    /* the most scratch any of them takes, so that none reallocates it */
    for (int i = 0; i < n; i++) {
        size_t b = 0;

        if (Ws[i]->n_in != K)
            return DSV4_OK;
        if (cuda_fast_gemm_bf16_ok(be, Ws[i], T))   /* BF16 weights only */
            b = fw_linear_scratch(Ws[i], T);   /* hi + lo: cuda_blas_bf16's too */
        else if (fg8_blas_route(be, Ws[i], T))
            b = cuda_fast_gemm8_blas_scratch(Ws[i], T);
        need = b > need ? b : need;
    }
    if (need == 0)
        return DSV4_OK;
    if (cuda_scratch(be, need) == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "fast gemm multi: no scratch for %d x %d", T, K);
    /* the BF16 ones first: their hi + lo at the scratch's start */
    for (int i = 0; i < n; i++) {
        enum dsv4_err e;

        if (!cuda_fast_gemm_bf16_ok(be, Ws[i], T))
            continue;
        e = cuda_blas_bf16(be, outs[i], x, Ws[i], T, flags[i], 0, split);
        if (e == DSV4_ERR_NOTSUP)
            continue;   /* nothing queued: the caller's */
        if (e != DSV4_OK)
            return e;
        done[i] = 1;
        split = 0;
    }
    /* then the FP8 ones: x's codes and scales at the scratch's start */
    for (int i = 0; i < n; i++) {
        enum dsv4_err e;

        if (done[i] || !fg8_blas_route(be, Ws[i], T))
            continue;
        e = cuda_fast_gemm8_blas(be, outs[i], x, Ws[i], T, !quant);
        if (e == DSV4_ERR_NOTSUP)
            continue;
        if (e != DSV4_OK)
            return e;
        done[i] = 1;
        quant = 0;
    }
    return DSV4_OK;
}

/* --- the grouped linear (linear_grouped, wo_a) on fw_kernel ------------------------------ */

/* dsv4_cuda_set_gemm_grouped */
static struct cuda_switch fwg_switch = CUDA_SWITCH("DSV4_CUDA_GEMM_GROUPED", 1);

void
dsv4_cuda_set_gemm_grouped(int on)
{
    cuda_switch_set(&fwg_switch, on);
}

int
cuda_fast_gemm_grouped_on(void)
{
    return cuda_switch_on(&fwg_switch);
}

/* The shapes of fw_kernel's grouped mode: FP8 weights (G * R, K), R and K
 * multiples of 128 (a block's 128 rows in one group), codes 16-byte aligned. */
static int
fw_grouped_shape(const struct dsv4_linear *W, int G)
{
    return W->fmt == DSV4_WFMT_FP8 && W->w != NULL && W->scale != NULL && G > 0 &&
           W->n_in > 0 && W->n_in % 128 == 0 && W->n_out > 0 && W->n_out % G == 0 &&
           (W->n_out / G) % 128 == 0 && (uintptr_t)W->w % 16 == 0;
}

int
cuda_fast_gemm_grouped_ok(const struct dsv4_backend *be, const struct dsv4_linear *W, int T,
                          int G)
{
    if (T <= FG_DECODE_ROWS || !fg_enabled() || !cuda_fast_gemm_grouped_on() ||
        !fw_enabled(be) || !fw_grouped_shape(W, G))
        return 0;
    /* the decode kernels' grouped mode streams the weights once per 16 rows,
     * as for a dense linear of the same N and K: the same cost model */
    return fw_linear_bn(T, W->n_out, W->n_in, 1) != 0;
}

enum dsv4_err
cuda_fast_gemm_grouped(struct dsv4_backend *be, float *out, const float *x,
                       const struct dsv4_linear *W, int T, int G)
{
    return cuda_fast_gemm_grouped_run(be, out, x, W, T, G, dsv4_cuda_blas_on());
}

enum dsv4_err
cuda_fast_gemm_grouped_run(struct dsv4_backend *be, float *out, const float *x,
                           const struct dsv4_linear *W, int T, int G, int blas)
{
    int N = W->n_out, K = W->n_in, bn;
    int64_t xcols = (int64_t)G * K;
    uint16_t *xb;
    struct fw_args a;
    enum dsv4_err e;

    if (!fw_grouped_shape(W, G) || !fw_enabled(be) || xcols > INT32_MAX)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda fast gemm grouped: not for fmt %d, %d x %d, "
                            "G=%d on this device", (int)W->fmt, W->n_out, W->n_in, G);
    if (T <= 0)
        return DSV4_OK;
    if (blas) {   /* fast_blas.cu; NOTSUP: fw_kernel below */
        e = cuda_blas_grouped(be, out, x, W, T, G);
        if (e != DSV4_ERR_NOTSUP)
            return e;
    }
    xb = (uint16_t *)cuda_scratch(be, cuda_align((size_t)T * xcols * sizeof(uint16_t)));
    if (xb == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast gemm grouped: no scratch for %d x %lld",
                            T, (long long)xcols);
    bn = fw_linear_bn(T, N, K, 1);
    bn = bn == 0 ? 64 : bn;   /* a direct call below the cost model's threshold */
    memset(&a, 0, sizeof(a));
    a.W = *W;
    a.W3 = *W;
    a.xb = xb;
    a.out = out;
    a.ldo = N;
    a.M = T;
    a.K = K;
    a.ldb = xcols;
    a.grows = N / G;
    e = fw_prep(be, xb, NULL, x, xcols, T, (int)xcols, 2);
    if (e != DSV4_OK)
        return e;
    return fw_run<FG_FP8, FG_GROUPED, 2>(be, &a, bn, (unsigned)(N / 128),
                                         (unsigned)((T + bn - 1) / bn));
}

/*
 * The shared expert's dense tiles of 64 tokens, on the routed launch's
 * arguments r: up (W3 != NULL: w1, w3; B rows the tokens, h rows Tk + t) or
 * down (W1 = w2; B and output rows Tk + t); N the output columns.
 */
static enum dsv4_err
fw_shared(struct dsv4_backend *be, const struct fw_args *r, const struct dsv4_linear *W1,
          const struct dsv4_linear *W3, int T, int Tk, int N)
{
    struct fw_args s = *r;
    unsigned gy = (unsigned)((T + 63) / 64);

    s.table = NULL;
    s.W = *W1;
    s.W3 = W3 != NULL ? *W3 : *W1;
    s.weights = NULL;
    s.M = T;
    s.brow0 = W3 != NULL ? 0 : Tk;
    s.orow0 = Tk;
    if (W3 != NULL)
        return fw_run<FG_FP8, FG_UP, 4>(be, &s, 64, (unsigned)(N / 128), gy);
    return fw_run<FG_FP8, FG_LINEAR, 2>(be, &s, 64, (unsigned)(N / 128), gy);
}

/*
 * The shared expert on cuBLASLt (fast_blas.cu; docs/gpu.md "The shared
 * expert on cuBLASLt"): its FP8 weights decoded to bf16 with their columns
 * in fw_perm order (so fw_moe's permuted x and h serve as they are; a copy
 * kept between calls where cuda_blas_weights can), one GEMM each way.  Up
 * (W3 != NULL): g | u of every token into bo (T, 2 I), then fw_sh_hq_kernel
 * writes h's B values into hq rows Tk + t.  Down (W1 = w2): y rows Tk + t
 * (bf16-rounded, as FG_LINEAR; with r->outb cuBLASLt's bf16 output written
 * there as it is) from hq rows Tk + t.  wb: 2 I D bf16 of
 * scratch, bo: T max(2 I, D).  DSV4_ERR_NOTSUP (nothing queued but the
 * weights' decode) when cuBLASLt cannot take it.
 */
static enum dsv4_err
fw_shared_blas(struct dsv4_backend *be, const struct fw_args *r, const struct dsv4_linear *W1,
               const struct dsv4_linear *W3, int T, int Tk, int D, int I, uint16_t *wb,
               uint16_t *bo)
{
    const uint16_t *wk = cuda_blas_weights(be, wb, W1, W3, 1);   /* kept or decoded now */
    enum dsv4_err e;

    if (wk == NULL)
        return DSV4_ERR_NOTSUP;
    if (W3 != NULL) {
        if ((e = cuda_blas_gemm(be, bo, wk, r->xb, 2 * I, D, 1, T)) != DSV4_OK)
            return e;
        fw_sh_hq_kernel<<<dim3((unsigned)T, (unsigned)(I / 128)), 32, 0, cuda_stream(be)>>>(
            r->hq, bo, I, Tk, r->lim);
        CUDA_LAUNCHED("fast gemm moe shared h");
        return DSV4_OK;
    }
    if (r->outb != NULL)   /* bf16 rows: cuBLASLt's output is them */
        return cuda_blas_gemm(be, r->outb + (size_t)Tk * D, wk, r->xb + (size_t)Tk * I, D, I, 1,
                              T);
    if ((e = cuda_blas_gemm(be, bo, wk, r->xb + (size_t)Tk * I, D, I, 1, T)) != DSV4_OK)
        return e;
    return cuda_blas_widen(be, r->out + (size_t)Tk * D, bo, (int64_t)T * D);
}

/* DSV4_CUDA_MOE_Y16=0: moe's rows (y) as fp32 in fw_moe as well (A/B runs;
 * the same values: they are bf16-rounded either way). */
static struct cuda_switch fw_y16_sw = CUDA_SWITCH("DSV4_CUDA_MOE_Y16", 1);

/* DSV4_CUDA_MOE_TAIL32=0: at token tiles of 64, an expert's tail of at most
 * 32 rows in a tile of 64 as until session 48, not in a launch of tiles of
 * 32 (A/B runs; the same bits). */
static struct cuda_switch fw_tail32_sw = CUDA_SWITCH("DSV4_CUDA_MOE_TAIL32", 1);

/* The routed tiles of grp2 (fg_group_kernel: the tails of at most 32 rows)
 * through fw_kernel's tiles of 32 tokens, with a's other arguments; gx: the
 * column blocks, as for fw_run's launch of the same GEMM. */
template <int EPI, int NWG>
static enum dsv4_err
fw_tail32(struct dsv4_backend *be, const struct fw_args *a, const int32_t *grp2, int A2,
          unsigned gx)
{
    struct fw_args b = *a;

    b.grp = grp2;
    b.A = A2;
    b.ctr = NULL;
    return fw_launch<FG_FP4, EPI, NWG, 32>(be, &b, gx, (unsigned)A2);
}

/*
 * The MoE through fw_kernel (cuda_fast_gemm_moe's contract): x's B values;
 * the grouping with tiles of BN rows (16, 32 or 64 from the average rows of
 * an active expert); up (routed FP4, then the shared expert's FP8 dense
 * tiles) writing h's B values with the scales of the down GEMM's
 * quantization; down into y in moe_parts' layout (moe: y is scratch of its
 * own and holds the rows as bf16, their values being bf16-rounded; moe_parts:
 * the caller's fp32 array); the exact combine.  The shared expert's two GEMMs
 * run on cuBLASLt where it is there (fw_shared_blas; DSV4_CUDA_BLAS), else on
 * fw_kernel's dense tiles.
 */
static enum dsv4_err
fw_moe(struct dsv4_backend *be, float *out, float *parts, const float *x, const int32_t *ids,
       const float *weights, const struct dsv4_expert_w *table, int n_table,
       const struct dsv4_expert_w *shared, int T, int k, int D, int I, float lim)
{
    cudaStream_t st = cuda_stream(be);
    int Tk = T * k, R = Tk + T, act = Tk < n_table ? Tk : n_table, avg = Tk / act;
    /* token tile: one tile for nearly every expert (rows ~ Poisson(avg)); a
     * wider tile costs only wgmma time, small while the weights stream */
    int bn = avg <= 8 ? 16 : avg <= 20 ? 32 : 64;
    int A = (Tk + bn - 1) / bn + act, has_sh = shared != NULL;
    /* tiles of 64 at up to 32 rows an expert on average: an expert's tail
     * of at most 32 rows in a tile of 32 (fg_group_kernel's grp2: act slots
     * after the counters).  Measured (docs/perf.md run 69, H100, 16 layers):
     * a 1,024-token prefill (24 rows) 52.2-52.6 ms against 52.9-58.0; a
     * 2,048-token one (48 rows: few tails that short, and two launches of
     * mostly idle CTAs) 79.9 against 79.0, hence the bound */
    int A2 = bn == 64 && avg <= 32 && A < 65536 && cuda_switch_on(&fw_tail32_sw) ? act : 0;
    /* the grouping, then the up and down GEMMs' item counters, then grp2 */
    size_t b_grp =
        cuda_align((size_t)(1 + 3 * A + Tk + 2 + (A2 > 0 ? 1 + 3 * A2 : 0)) * sizeof(int32_t));
    size_t b_x = cuda_align((size_t)T * D * sizeof(uint16_t));
    size_t b_h = cuda_align((size_t)R * I * sizeof(uint16_t));
    /* moe: y, its own rows, as bf16 (the values are bf16-rounded: half the
     * bytes written and read by the combine); moe_parts: the caller's fp32 */
    int y16 = parts == NULL && cuda_switch_on(&fw_y16_sw);
    size_t b_y = parts != NULL ? 0 : cuda_align((size_t)R * D * (y16 ? 2 : sizeof(float)));
    /* the shared expert on cuBLASLt (fw_shared_blas): bf16 weights, outputs */
    int bl = has_sh && dsv4_cuda_blas_usable(be);
    size_t b_bw = bl ? cuda_align((size_t)2 * I * D * sizeof(uint16_t)) : 0;
    size_t b_bo = bl ? cuda_align((size_t)T * (2 * I > D ? 2 * I : D) * sizeof(uint16_t)) : 0;
    char *p = (char *)cuda_scratch(be, b_grp + b_x + b_h + b_y + b_bw + b_bo);
    struct fw_args a;
    enum dsv4_err e;
    int32_t *grp, *grp2;
    uint16_t *xb, *hq, *bw, *bo;
    float *y;

    if (T <= 0)
        return DSV4_OK;
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast gemm moe: no scratch (T=%d k=%d)", T, k);
    grp = (int32_t *)p;
    grp2 = A2 > 0 ? grp + 1 + 3 * A + Tk + 2 : NULL;
    xb = (uint16_t *)(p + b_grp);
    hq = (uint16_t *)(p + b_grp + b_x);
    y = parts != NULL ? parts : (float *)(p + b_grp + b_x + b_h);
    bw = (uint16_t *)(p + b_grp + b_x + b_h + b_y);
    bo = (uint16_t *)(p + b_grp + b_x + b_h + b_y + b_bw);

    e = fw_prep(be, xb, NULL, x, D, T, D, 0);
    if (e != DSV4_OK)
        return e;
    fg_group_kernel<<<1, 1024, (size_t)3 * n_table * sizeof(int32_t), st>>>(
        grp, ids, Tk, n_table, A, bn, table, parts != NULL, grp + 1 + 3 * A + Tk, 2, grp2, A2);
    CUDA_LAUNCHED("fast gemm moe group");

    /* up: h of every pick row (routed), then of every token (shared, rows Tk + t) */
    memset(&a, 0, sizeof(a));
    a.table = table;
    a.grp = grp;
    a.A = A;
    a.k = k;
    a.xb = xb;
    a.hq = hq;
    a.ldo = I;
    a.weights = weights;
    a.K = D;
    a.lim = lim;
    a.ctr = grp + 1 + 3 * A + Tk;   /* fwp_kernel's items (tiles of 64 tokens) */
    e = fw_run<FG_FP4, FG_UP, 4>(be, &a, bn, (unsigned)(I / 128), (unsigned)A);
    if (e == DSV4_OK && A2 > 0)   /* the tails of at most 32 rows */
        e = fw_tail32<FG_UP, 4>(be, &a, grp2, A2, (unsigned)(I / 128));
    if (e != DSV4_OK)
        return e;
    if (bl && (e = fw_shared_blas(be, &a, &shared->w1, &shared->w3, T, Tk, D, I, bw, bo)) !=
                  DSV4_OK) {
        if (e != DSV4_ERR_NOTSUP)
            return e;
        bl = 0;   /* cuBLASLt cannot take it: fw_kernel's tiles, both ways */
    }
    if (has_sh && !bl && (e = fw_shared(be, &a, &shared->w1, &shared->w3, T, Tk, I)) != DSV4_OK)
        return e;

    /* down into y (rows of moe_parts' layout) */
    a.down = 1;
    a.xb = hq;
    a.hq = NULL;
    a.out = y16 ? NULL : y;
    a.outb = y16 ? (uint16_t *)y : NULL;
    a.ldo = D;
    a.weights = NULL;
    a.K = I;
    a.ctr = grp + 1 + 3 * A + Tk + 1;
    /* token tiles of 64: 256 weight rows a CTA (four warpgroups, one CTA an
     * SM), each tile's activations read half as often as with 128 rows
     * (two CTAs of two warpgroups an SM; docs/perf.md run 40: 4.53 -> 3.71
     * ms for the down GEMMs of a 4-layer 2,048-token prefill); 16 and 32
     * as before */
    if (bn == 64 && D % 256 == 0)
        e = fwp_launch<FG_LINEAR, 64>(be, &a, (unsigned)(D / 256), (unsigned)A);
    else
        e = fw_run<FG_FP4, FG_LINEAR, 2>(be, &a, bn, (unsigned)(D / 128), (unsigned)A);
    if (e == DSV4_OK && A2 > 0)
        e = fw_tail32<FG_LINEAR, 2>(be, &a, grp2, A2, (unsigned)(D / 128));
    if (e != DSV4_OK)
        return e;
    if (bl && (e = fw_shared_blas(be, &a, &shared->w2, NULL, T, Tk, D, I, bw, bo)) != DSV4_OK) {
        if (e != DSV4_ERR_NOTSUP)
            return e;
        bl = 0;
    }
    if (has_sh && !bl && (e = fw_shared(be, &a, &shared->w2, NULL, T, Tk, D)) != DSV4_OK)
        return e;
    if (parts != NULL)
        return DSV4_OK;   /* moe_parts: the caller sums the ranks' parts, then combines */
    if (y16)   /* the exact path's step 5, reading bf16 */
        return cuda_moe_combine16(be, out, (const uint16_t *)y, ids, T, k, D);
    return cuda_moe_combine(be, out, y, ids, T, k, D);   /* the exact path's step 5 */
}

int
cuda_fast_gemm_linear_ok(const struct dsv4_backend *be, const struct dsv4_linear *W, int T)
{
    if (!fg_enabled() || T <= FG_DECODE_ROWS || be->numerics != DSV4_NUMERICS_REF ||
        W->fmt != DSV4_WFMT_FP8 || W->w == NULL || W->scale == NULL || W->n_in <= 0 ||
        W->n_in % 128 != 0 || W->n_out <= 0 || W->n_out % FG_BN != 0 ||
        (uintptr_t)W->w % 16 != 0)
        return 0;
    if (fw_enabled(be))
        return fw_linear_bn(T, W->n_out, W->n_in, 1) != 0;
    return fg_linear_tile(T, W->n_out, W->n_in) != 0 && fg_tile_fit(be, FG_FP8, 2) != 0;
}

enum dsv4_err
cuda_fast_gemm_linear_b16(struct dsv4_backend *be, uint16_t **ob, const float *x,
                          const struct dsv4_linear *W, int T)
{
    /* cuda_linear's choice: cuda_fast_gemm_linear, then its FP8 x FP8 form,
     * then that form's cuBLASLt path */
    if (!cuda_st(be)->fast_kernels || !fg8_blas_route(be, W, T))
        return DSV4_ERR_NOTSUP;
    return cuda_fast_gemm8_b16(be, ob, x, W, T);
}

enum dsv4_err
cuda_fast_gemm_linear(struct dsv4_backend *be, float *out, const float *x,
                      const struct dsv4_linear *W, int T)
{
    int N = W->n_out, K = W->n_in, mt = fg_linear_tile(T, N, K);
    size_t bx = cuda_align((size_t)T * K * sizeof(uint16_t));
    char *p;
    struct fg_args a;
    enum dsv4_err e;

    if (T <= 0)
        return DSV4_OK;
    if (fw_enabled(be) && cuda_fast_gemm8_on())   /* opt-in FP8 x FP8 (fast_gemm8.cu) */
        return cuda_fast_gemm8_linear(be, out, x, W, T);
    if (fw_enabled(be))
        return fw_linear(be, out, x, W, T, 0, 0);   /* the Hopper path */
    p = (char *)cuda_scratch(be, bx + cuda_align((size_t)T * (K / 128) * sizeof(float)));
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast gemm: no scratch for %d x %d", T, K);
    mt = fg_tile_fit(be, FG_FP8, mt == 0 ? 4 : mt);
    if (mt == 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda fast gemm: no tile fits the device");
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

/* The MoE's row tile (its grouping's and both weight formats' tiles): 64
 * rows unless the experts average more than 96 rows and tiles of 128 fit
 * be's device (fg_stages; not on sm_120). */
static int
fg_moe_tile(const struct dsv4_backend *be, int Tk, int n_table)
{
    return Tk / (Tk < n_table ? Tk : n_table) > 96 && fg_stages(be, FG_FP4, 4) != 0 &&
                   fg_stages(be, FG_FP8, 4) != 0
               ? 4
               : 2;
}

int
cuda_fast_gemm_moe_ok(const struct dsv4_backend *be, const struct dsv4_expert_w *experts, int n,
                      const struct dsv4_expert_w *shared, int T, int k, int D, int I,
                      int parts)
{
    if (!fg_enabled() || be->numerics != DSV4_NUMERICS_REF || T < FG_MOE_MIN_T ||
        cuda_fast_moe_takes(T, k, D, I) || k < 1 || k > FG_MAX_K || n < 1 || n > FG_MAX_E ||
        D % 128 != 0 || I % 128 != 0)
        return 0;
    if (shared == NULL ? !parts : !fg_expert_ok(shared, DSV4_WFMT_FP8, D, I))
        return 0;
    /* the mma.sync path: tiles of 64 rows must fit (fg_moe_tile) */
    if (!fw_enabled(be) && (fg_stages(be, FG_FP4, 2) == 0 || fg_stages(be, FG_FP8, 2) == 0))
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
    cudaStream_t st;
    int Tk = T * k, R = Tk + T, nbD = D / 128, nbI = I / 128;
    int mt = fg_moe_tile(be, Tk, n_table), BM = 32 * mt;
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
    char *p;
    int32_t *grp;
    uint16_t *xb, *xf, *hb, *hf;
    float *xs, *h, *hs, *y;
    struct fg_args a;
    enum dsv4_err e;

    if (T <= 0)
        return DSV4_OK;
    if (fw_enabled(be))   /* the Hopper path */
        return fw_moe(be, out, parts, x, ids, weights, table, n_table, shared, T, k, D, I, lim);
    st = cuda_stream(be);
    p = (char *)cuda_scratch(be, b_grp + 2 * b_x16 + b_xs + b_h + b_hb + b_hf + b_hs + b_y);
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
        grp, ids, Tk, n_table, A, BM, table, parts != NULL, NULL, 0, NULL, 0);
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
