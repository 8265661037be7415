/*
 * fast_linear.cu — the fast linear for decode: FP8 block-scaled weights
 * under REF numerics and BF16 weights (any numerics), at any T (fast for
 * T <= 16), through the warp tiles of fast.cuh.  Used by cuda_linear when
 * dsv4_cuda_set_kernels(be, 1) was called and cuda_fast_linear_ok() agrees.
 * Also the grouped output projection (linear_grouped, FP8 weights run as
 * bf16 on bf16-rounded inputs): the same tile kernel, each row tile reading
 * its group's slice of x (cuda_fast_linear_grouped_ok).
 *
 * The work of one call (both forms):
 *   1. activations: REF FP8 quantization per 128 columns into f16 values +
 *      scales (FP8 weights), the bf16 hi/lo split of x (BF16 weights), or
 *      bf16(x) (grouped);
 *   2. the tiles, once per pass of 16 tokens: a block of 8 warps; warp w
 *      takes row tile (blockIdx.x * 8/bk + w / bk) (32 rows for FP8, 16 for
 *      BF16) and K slice (blockIdx.y * bk + w % bk); the bk slices of a
 *      block are added in shared memory in slice order; with G = gridDim.y
 *      > 1 each block writes its partial sums (G, T, N);
 *   3. with G > 1, the G partials of each output added in order y = 0..G-1,
 *      then rounded.
 * The split (slices S = bk * G, blocks of K per slice) is chosen from N and K
 * only, aiming at >= FL_WARPS warps in flight, so results never depend on T.
 *
 * Two forms, same bits (dsv4_cuda_set_linear, DSV4_CUDA_LINEAR=v1 / fused:N):
 *   one launch per pass (flf_kernel; opt-in, DSV4_CUDA_LINEAR=fused:16:
 *   measured slower on the H200, docs/perf.md run 20): each block prepares, from
 *   fp32 x, the 128-column blocks of x its warps read, for the pass's
 *   tokens, into shared memory (fl_stage: the expressions of step 1, so the
 *   same codes, scales and bf16 halves), in rounds of rs blocks per slice
 *   when the whole range would not fit (FL_SMEM_MAX); with G > 1 each block
 *   then writes its partials, fences, and counts itself in at its row
 *   group's counter (st->lin_ctr[blockIdx.x]); the block that arrives last
 *   adds the G partials of its rows in the order y = 0..G-1 (fl_reduce's
 *   order, whatever the arrival order) and sets the counter back to zero
 *   for the next launch or graph replay (the next launch on the stream
 *   waits for this grid to complete, PDL included).  The counters belong to
 *   the backend, whose work is all on its one stream: two calls never use
 *   them at the same time; calls on other backends have their own.
 *   Three launches (fk_quant_kernel / fk_split_kernel, fl_kernel,
 *   fl_reduce_kernel; "v1", the default): step 1 into scratch, then the
 *   tiles, then the reduction.  Two launches ("v1r",
 *   dsv4_cuda_set_linear_reduce): the same, but fl_kernel's row groups add
 *   their split-K partials as flf_kernel's do (fl_last_reduce, the same
 *   counters), so no fl_reduce_kernel; no staging cost.  The one-launch form falls back to this one where it does
 *   not apply (x not 16-byte aligned, more row groups than counters, a
 *   grouped block spanning two groups, no counters).
 */
#include "kernels/cuda/fast.cuh"

#include <cuda_fp16.h>
#include <stdlib.h>
#include <string.h>

#define FL_THREADS 256
#define FL_NWARP (FL_THREADS / 32)
#define FL_WARPS 2048      /* warps wanted per call (132 SMs x ~16) */
#define FL_TOKENS 16       /* tokens per pass (two n-tiles) */

/* --- activation preparation ------------------------------------------------------- */

/* The REF value of column v in a block of scale s: the FP8 value of v / s
 * (the exact path's quant_kernel expression). */
static __device__ __forceinline__ float
fk_quant_value(float v, float s)
{
    return cu_fp8_to_f32(cu_f32_to_fp8(cu_clampf(v / s, 448.0f)));
}

/* x = hi + lo, both bf16 bits (hi = bf16(x), lo = bf16(x - hi); lo = 0 when
 * x is not finite). */
static __device__ __forceinline__ void
fk_split_value(float v, uint16_t *hi, uint16_t *lo)
{
    float h = cu_bf16_round(v);

    *hi = (uint16_t)(__float_as_uint(h) >> 16);
    *lo = isfinite(v) ? (uint16_t)(__float_as_uint(cu_bf16_round(v - h)) >> 16) : 0;
}

/* One warp per (row, 128-block): the exact path's quant_kernel, values
 * written as f16 and/or bf16 bits (both exact for FP8 values); the codes by
 * fk_quant2 (fast.cuh: the hardware's conversion: the same values, every load of the
 * warp first and a few instructions a value instead of a division and the
 * software rounding of fk_quant_value). */
static __global__ void
fk_quant_kernel(uint16_t *f16, uint16_t *bf16, float *sx, const float *x, int64_t stride,
                int rows, int K)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int nb = K / 128;
    int64_t wid = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    int64_t r = wid / nb;
    int b = (int)(wid % nb);
    float v[4], s;
    const float *xb;

    if (r >= rows)
        return;   /* whole warps leave together */
    xb = x + r * stride + (int64_t)b * 128;
    for (int i = 0; i < 4; i++)
        v[i] = xb[lane + 32 * i];
    s = fk_quant_scale_warp(v);
    {
        float inv = 1.0f / s;   /* exact: s is a power of two (or inf) */
        uint32_t h01 = fk_quant2(v[0], v[1], inv, NULL),
                 h23 = fk_quant2(v[2], v[3], inv, NULL);
        uint16_t q[4] = { (uint16_t)h01, (uint16_t)(h01 >> 16), (uint16_t)h23,
                          (uint16_t)(h23 >> 16) };

        for (int i = 0; i < 4; i++) {
            int64_t at = r * K + (int64_t)b * 128 + lane + 32 * i;

            if (f16 != NULL)
                f16[at] = q[i];
            if (bf16 != NULL)   /* the FP8 value's bf16 bits (f16 -> fp32 is exact) */
                bf16[at] = (uint16_t)(__float_as_uint(__half2float(__ushort_as_half(q[i]))) >>
                                      16);
        }
    }
    if (lane == 0)
        sx[r * nb + b] = s;
}

enum dsv4_err
fk_quant(struct dsv4_backend *be, uint16_t *f16, uint16_t *bf16, float *sx, const float *x,
         int64_t stride, int rows, int K)
{
    int64_t warps = (int64_t)rows * (K / 128);

    if (warps <= 0)
        return DSV4_OK;
    cu_launch(fk_quant_kernel, cuda_blocks(warps * 32, 256), 256, 0, cuda_stream(be), f16, bf16, sx,
              x, stride, rows, K);
    CUDA_LAUNCHED("fast quant");
    return DSV4_OK;
}

/* x = hi + lo, both bf16 (hi = bf16(x), lo = bf16(x - hi); lo = 0 when x is
 * not finite); lo == NULL: hi only. */
static __global__ void
fk_split_kernel(uint16_t *hi, uint16_t *lo, const float *x, int64_t n)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    uint16_t h, l;

    if (i >= n)
        return;
    fk_split_value(x[i], &h, &l);
    hi[i] = h;
    if (lo != NULL)
        lo[i] = l;
}

/* --- the tile kernel ---------------------------------------------------------------- */

/* Weight and activation formats of a call (the tile kernel's MODE). */
enum {
    FL_BF16 = 0,     /* BF16 weights, x as bf16 hi + lo */
    FL_FP8 = 1,      /* FP8 weights, REF-quantized x as f16 + scales */
    FL_GROUPED = 2,  /* FP8 weights run as bf16, x rounded to bf16 (grouped) */
};

struct fl_args {
    struct dsv4_linear W;
    const uint16_t *xv;     /* (T, xstride): f16 FP8 values (FP8), bf16 hi (BF16)
                               or bf16(x) (grouped) */
    const uint16_t *xl;     /* (T, K): bf16 lo (BF16), else NULL */
    const float *sx;        /* (T, K/128) (FP8) */
    float *out;             /* (T, N) */
    float *part;            /* (G, T, N) when G > 1 */
    int T, t0;              /* tokens; first token of this pass */
    int N, K, nb;           /* nb = K / 128 */
    int64_t xstride;        /* x row stride (K, or G*K when grouped) */
    int R;                  /* rows per group: row o reads x columns
                               (o / R) * K .. + K (R = N: not grouped) */
    int bps, bk;            /* 128-blocks per slice, slices per block */
    int round_out;
    int early;              /* the first weight block loaded before the PDL wait
                               (fl_block; lin_early_sw) */
    /* the one-launch form (flf_kernel) */
    const float *x;         /* (T, xstride) fp32 activations */
    unsigned *ctr;          /* (gridDim.x) arrival counters when G > 1 */
    int nt;                 /* tokens of this pass, min(16, T - t0) */
    int rs;                 /* 128-blocks per slice staged per round */
    int ld;                 /* staged row stride, halves: rs * 128 + 8 */
};

/* wr[m][h]: weight row (row0 + 16 m + g + 8 h) from 128-column block kb on
 * (bf16 rows: two bytes per column). */
template <int MODE, int MT>
static __device__ __forceinline__ void
fl_wrows(const uint8_t *(&wr)[MT][2], const struct fl_args &a, int row0, int kb, int g)
{
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            wr[m][h] = (const uint8_t *)a.W.w +
                       ((int64_t)(row0 + m * 16 + g + 8 * h) * a.K + (int64_t)kb * 128) *
                           (MODE ? 1 : 2);
}

/*
 * The end of a pass of both forms: the bk slices of the block added in
 * slice order (red: the block's shared array; every thread calls this),
 * then warp w % bk == 0 of each row tile writes its sums: out (rounded when
 * round_out) when G == 1, else the partials (G, T, N) at slice group by.
 */
template <int MT, int NT>
static __device__ __forceinline__ void
fl_finish(float (&acc)[MT][NT][4], float (&red)[FL_NWARP][MT][NT][4][32],
          const struct fl_args &a, int tile, int row0, int by, int G)
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;

    if (a.bk > 1) {
        /* add the block's slices in slice order */
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    red[warp][m][n][i][lane] = acc[m][n][i];
        __syncthreads();
        if (warp % a.bk == 0)
            for (int j = 1; j < a.bk; j++)
#pragma unroll
                for (int m = 0; m < MT; m++)
#pragma unroll
                    for (int n = 0; n < NT; n++)
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            acc[m][n][i] += red[warp + j][m][n][i][lane];
    }
    if (warp % a.bk != 0 || tile >= a.N / (16 * MT))
        return;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int row = row0 + m * 16 + g + 8 * (i >> 1);
                int t = a.t0 + n * 8 + 2 * q + (i & 1);
                float v = acc[m][n][i];

                if (t >= a.T)
                    continue;
                if (G == 1)
                    a.out[(int64_t)t * a.N + row] = a.round_out ? cu_bf16_round(v) : v;
                else
                    a.part[((int64_t)by * a.T + t) * a.N + row] = v;
            }
}

/*
 * Split-K in the tile kernel (a.ctr != NULL, G = gridDim.y > 1; after the
 * block wrote its partials, fl_finish): the block counts itself in at its
 * row group's counter (cu_block_arrives_last, which also sets it back to
 * zero), and the block that arrives last adds, for its rows and the pass's
 * a.nt tokens, the G partials read at L2 in the order y = 0..G-1
 * (fl_reduce_kernel's order and expression, whatever order the blocks
 * arrived in).  Every thread of the block calls it.
 */
template <int MT>
static __device__ __forceinline__ void
fl_last_reduce(const struct fl_args &a)
{
    int tpb = FL_NWARP / a.bk, rowA = blockIdx.x * tpb * 16 * MT;

    if (cu_block_arrives_last(a.ctr + blockIdx.x, gridDim.y)) {
        int rows = min(tpb * 16 * MT, a.N - rowA), n = rows * a.nt;
        int64_t tn = (int64_t)a.T * a.N;

        for (int e = threadIdx.x; e < n; e += FL_THREADS) {
            int64_t i = (int64_t)(a.t0 + e / rows) * a.N + rowA + e % rows;
            float v = __ldcg(a.part + i);   /* L2: other blocks wrote them */

            for (int y = 1; y < (int)gridDim.y; y++)
                v += __ldcg(a.part + (int64_t)y * tn + i);
            a.out[i] = a.round_out ? cu_bf16_round(v) : v;
        }
    }
}

/*
 * Block (bx, by) of a linear's tile grid (G = its y extent): the row tiles
 * bx * 8/bk .., slice group by (fl_kernel's block; flm_kernel's blocks of
 * each of its linears).
 */
template <int MODE, int MT, int NT>
static __device__ __forceinline__ void
fl_block(const struct fl_args &a, int bx, int by, int G, float (&red)[FL_NWARP][MT][NT][4][32])
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int tile = bx * (FL_NWARP / a.bk) + warp / a.bk;
    int slice = by * a.bk + warp % a.bk;
    int kb0 = slice * a.bps, kb1 = min(a.nb, kb0 + a.bps);
    int n_tiles = a.N / (16 * MT), row0 = tile * 16 * MT, work = tile < n_tiles && kb0 < kb1;
    float acc[MT][NT][4];
    const uint8_t *wr[MT][2];
    uint4 w0[MT][2][2];

    fk_zero(acc);
    /* weights (never written by a kernel): the first block's bytes (FP8: 128
     * columns; BF16: a 64-column chunk) asked for before the PDL wait, so
     * they arrive while the kernel before ends (DSV4_CUDA_LIN_EARLY=0: after
     * it) */
    fl_wrows<MODE, MT>(wr, a, row0, 0, g);
    if (work && a.early) {
        if (MODE)
            fk_fp8_load<MT, 1>(w0, wr, kb0, q);
        else
            fk_bf16_load<MT, 1>(w0, wr, 2 * kb0, q);
    }
    cu_pdl_wait();   /* PDL: before any other global access */
    cu_pdl_trigger();
    if (MODE && work && !a.early)
        fk_fp8_load<MT>(w0, wr, kb0, q);
    if (work) {
        const uint16_t *xb[NT];

#pragma unroll
        for (int n = 0; n < NT; n++)
            xb[n] = a.xv + (int64_t)min(a.t0 + n * 8 + g, a.T - 1) * a.xstride +
                    (int64_t)(row0 / a.R) * a.K;
        if (MODE) {
            const uint8_t *ws[MT];
            const float *xs[NT][2];

#pragma unroll
            for (int m = 0; m < MT; m++)
                ws[m] = a.W.scale + (int64_t)((row0 + m * 16) / 128) * a.nb;
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int j = 0; j < 2; j++)
                    xs[n][j] = MODE == FL_GROUPED ? NULL :
                               a.sx + (int64_t)min(a.t0 + n * 8 + 2 * q + j, a.T - 1) * a.nb;
            fk_fp8_kb<MT, NT, MODE == FL_GROUPED, 0>(acc, w0, ws, xb, xs, kb0, q);
            fk_fp8<MT, NT, MODE == FL_GROUPED>(acc, wr, ws, xb, xs, kb0 + 1, kb1, q);
        } else {
            const uint16_t *xl[NT];

#pragma unroll
            for (int n = 0; n < NT; n++)
                xl[n] = a.xl + (xb[n] - a.xv);
            if (a.early) {
                fk_bf16_ch<MT, NT>(acc, w0, xb, xl, 2 * kb0, q);
                fk_bf16<MT, NT>(acc, wr, xb, xl, 2 * kb0 + 1, 2 * kb1, q);
            } else {
                fk_bf16<MT, NT>(acc, wr, xb, xl, 2 * kb0, 2 * kb1, q);
            }
        }
    }
    fl_finish<MT, NT>(acc, red, a, tile, row0, by, G);
}

template <int MODE, int MT, int NT>
static __global__ void __launch_bounds__(FL_THREADS, 2)
fl_kernel(struct fl_args a)
{
    /* the PDL wait: in fl_block, after its first weight loads */
    __shared__ float red[FL_NWARP][MT][NT][4][32];

    fl_block<MODE, MT, NT>(a, blockIdx.x, blockIdx.y, gridDim.y, red);
    if (gridDim.y > 1 && a.ctr != NULL)
        fl_last_reduce<MT>(a);   /* the two-launch form */
}

/* --- several linears of one input (linear_multi) -------------------------------------- */

/* One tile launch over the linears of one format: linear e owns the blocks
 * off[e] .. off[e+1] - 1 of the 1-D grid, its own fl_kernel grid of gx[e] x
 * (off[e+1] - off[e]) / gx[e] blocks, x-major. */
struct flm_args {
    struct fl_args a[DSV4_LINEAR_MULTI_MAX];
    int off[DSV4_LINEAR_MULTI_MAX + 1];
    int gx[DSV4_LINEAR_MULTI_MAX];
    int n;
};

template <int MODE, int MT, int NT>
static __global__ void __launch_bounds__(FL_THREADS, 2)
flm_kernel(struct flm_args m)
{
    /* the PDL wait: in fl_block, after its first weight loads */
    __shared__ float red[FL_NWARP][MT][NT][4][32];
    int b = blockIdx.x, e = 0;

    while (e + 1 < m.n && b >= m.off[e + 1])
        e++;
    b -= m.off[e];
    fl_block<MODE, MT, NT>(m.a[e], b % m.gx[e], b / m.gx[e], (m.off[e + 1] - m.off[e]) / m.gx[e],
                           red);
}

/* fl_reduce_kernel over several linears: linear e's n[e] outputs are the
 * elements off[e] .. off[e+1] - 1 of the 1-D grid. */
struct flm_red {
    float *out[DSV4_LINEAR_MULTI_MAX];
    const float *part[DSV4_LINEAR_MULTI_MAX];
    int64_t off[DSV4_LINEAR_MULTI_MAX + 1];
    int G[DSV4_LINEAR_MULTI_MAX];
    int round_out[DSV4_LINEAR_MULTI_MAX];
    int n;
};

/* out[i] = Σ_y part[y, i] in order (G partials of n values), then rounded. */
static __device__ __forceinline__ void
fl_reduce_one(float *out, const float *part, int64_t n, int G, int round_out, int64_t i)
{
    float v = part[i];

    for (int y = 1; y < G; y++)
        v += part[(int64_t)y * n + i];
    out[i] = round_out ? cu_bf16_round(v) : v;
}

static __global__ void
fl_reduce_kernel(float *out, const float *part, int64_t n, int G, int round_out)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;

    if (i < n)
        fl_reduce_one(out, part, n, G, round_out, i);
}

/* fl_reduce_kernel's sums for each linear of r (the same expression). */
static __global__ void
flm_reduce_kernel(struct flm_red r)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int e = 0;

    if (i >= r.off[r.n])
        return;
    while (e + 1 < r.n && i >= r.off[e + 1])
        e++;
    fl_reduce_one(r.out[e], r.part[e], r.off[e + 1] - r.off[e], r.G[e], r.round_out[e],
                  i - r.off[e]);
}

/* --- the one-launch form ------------------------------------------------------------------ */

#define FL_CTRS 1024                 /* row-group counters per backend (G > 1 needs
                                        at most 256 for any N, K: fl_split_for) */
#define FL_SMEM_MAX (72 * 1024)      /* staged x per block: 2 blocks per SM with red */

#define FLF_U 4    /* staging tasks per warp in flight */
#define FLF_PF 4   /* weight blocks per warp asked of L2 before staging */

/* i / d for 0 <= i < 2^22 and d >= 1, rd = 1.0f / d: the float quotient is
 * within one of the true one (i exact, rd within 2^-24), then corrected
 * (an integer division would cost ~20 instructions per task). */
static __device__ __forceinline__ int
flf_div(int i, int d, float rd)
{
    int q = (int)((float)i * rd);

    q -= q * d > i;
    q += (q + 1) * d <= i;
    return q;
}

/*
 * Task i of staging round j0 (flf_stage): token tok < nt, block jj < rn of
 * the round, slice sl of the block (rnt = rn * nt; r1, r2: 1.0f / nt,
 * 1.0f / rnt); the 128-block of x it reads (kb), or -1 past the end
 * (i >= bk * rnt, or kb >= nb).
 */
static __device__ __forceinline__ int
flf_task(const struct fl_args &a, int i, int rnt, int j0, float r1, float r2, int *tok,
         int *jj, int *sl)
{
    int kb, u = flf_div(i, a.nt, r1);

    *tok = i - u * a.nt;
    *sl = flf_div(i, rnt, r2);
    *jj = u - *sl * (rnt / a.nt);
    kb = (blockIdx.y * a.bk + *sl) * a.bps + j0 + *jj;
    return i < a.bk * rnt && kb < a.nb ? kb : -1;
}

/*
 * Stage round j0 of the block's slices: for each slice sl of the block, each
 * 128-block jj < rs of the round (block kb = (blockIdx.y * bk + sl) * bps +
 * j0 + jj, when below nb and inside the slice) and each token tok < nt of
 * the pass, one warp reads the 128 fp32 columns (lane: columns 4 lane ..
 * 4 lane + 3; FLF_U tasks' loads in flight per warp) and writes row
 * (sl * nt + tok) of the staged arrays at column jj * 128 (row stride ld
 * halves): FP8, the f16 values and the scale (sxs, row stride rs); BF16, hi
 * and lo; grouped, hi.  The block's amax is the exact path's (fmaxf over the
 * same 128 values, in another order: the same maximum).
 */
template <int MODE>
static __device__ __forceinline__ void
flf_stage(const struct fl_args &a, uint16_t *xv, uint16_t *xl, float *sxs, int j0,
          int64_t xcol, int warp, int lane)
{
    int rn = min(a.rs, a.bps - j0), rnt = rn * a.nt, tasks = a.bk * rnt;
    float r1 = 1.0f / (float)a.nt, r2 = 1.0f / (float)rnt;

    for (int i0 = warp; i0 < tasks; i0 += FL_NWARP * FLF_U) {
        float4 v[FLF_U];
        int tok[FLF_U], jj[FLF_U], sl[FLF_U], kb[FLF_U];

#pragma unroll
        for (int u = 0; u < FLF_U; u++) {
            kb[u] = flf_task(a, i0 + u * FL_NWARP, rnt, j0, r1, r2, &tok[u], &jj[u], &sl[u]);
            v[u] = kb[u] < 0 ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                             : __ldg((const float4 *)(a.x + (int64_t)(a.t0 + tok[u]) *
                                                                a.xstride +
                                                      xcol + (int64_t)kb[u] * 128) + lane);
        }
#pragma unroll
        for (int u = 0; u < FLF_U; u++) {
            int64_t d;
            uint2 h;

            if (kb[u] < 0)
                continue;   /* whole warps */
            d = (int64_t)(sl[u] * a.nt + tok[u]) * a.ld + jj[u] * 128 + lane * 4;
            if (MODE == FL_FP8) {
                float vv[4] = { v[u].x, v[u].y, v[u].z, v[u].w };
                float sc = fk_quant_scale_warp(vv), inv = 1.0f / sc;

                h.x = fk_quant2(v[u].x, v[u].y, inv, NULL);
                h.y = fk_quant2(v[u].z, v[u].w, inv, NULL);
                if (lane == 0)
                    sxs[(sl[u] * a.nt + tok[u]) * a.rs + jj[u]] = sc;
            } else {
                uint16_t hi[4], lo[4];

                fk_split_value(v[u].x, &hi[0], &lo[0]);
                fk_split_value(v[u].y, &hi[1], &lo[1]);
                fk_split_value(v[u].z, &hi[2], &lo[2]);
                fk_split_value(v[u].w, &hi[3], &lo[3]);
                h.x = hi[0] | (uint32_t)hi[1] << 16;
                h.y = hi[2] | (uint32_t)hi[3] << 16;
                if (MODE == FL_BF16) {
                    uint2 l;

                    l.x = lo[0] | (uint32_t)lo[1] << 16;
                    l.y = lo[2] | (uint32_t)lo[3] << 16;
                    *(uint2 *)(xl + d) = l;
                }
            }
            *(uint2 *)(xv + d) = h;
        }
    }
}

/* Ask L2 for the first FLF_PF 128-column blocks kb0.. (below kb1) of the
 * warp's weight rows (one 128-byte line per lane and block: 32 FP8 rows, or
 * 16 BF16 rows of two lines), so they stream in while the block stages x
 * (wo_b: the warp's whole slice).  At most FLF_PF * 4 KB per resident warp
 * in flight: 34 MB for 16 warps on each of 132 SMs, inside the 50 MB L2. */
template <int MODE, int MT>
static __device__ __forceinline__ void
flf_prefetch(const struct fl_args &a, int row0, int kb0, int kb1, int lane)
{
    int esz = MODE == FL_BF16 ? 2 : 1;
    int row = row0 + (MODE == FL_BF16 ? lane / 2 : lane % (16 * MT));
    int64_t col = MODE == FL_BF16 ? (lane % 2) * 128 : 0;

    for (int kb = kb0; kb < min(kb1, kb0 + FLF_PF); kb++) {
        const uint8_t *p = (const uint8_t *)a.W.w + ((int64_t)row * a.K + (int64_t)kb * 128) * esz +
                           col;

        asm volatile("prefetch.global.L2 [%0];" : : "l"(p));
    }
}

/*
 * One pass of the one-launch form: fl_kernel's tiles on x staged in shared
 * memory (flf_stage, rounds of rs blocks per slice), then, with G > 1, the
 * row group's last block adds the partials (see the file comment).  Dynamic
 * shared memory: bk * nt rows of ld halves (values; BF16: twice, hi then
 * lo), then (FP8) bk * nt rows of rs scales.
 */
template <int MODE, int MT, int NT>
static __global__ void __launch_bounds__(FL_THREADS, 2)
flf_kernel(struct fl_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    extern __shared__ uint4 flf_smem[];
    __shared__ float red[FL_NWARP][MT][NT][4][32];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int tpb = FL_NWARP / a.bk, rowA = blockIdx.x * tpb * 16 * MT;
    int tile = blockIdx.x * tpb + warp / a.bk, sl = warp % a.bk;
    int slice = blockIdx.y * a.bk + sl;
    int kb0 = slice * a.bps, kb1 = min(a.nb, kb0 + a.bps);
    int n_tiles = a.N / (16 * MT), row0 = tile * 16 * MT;
    int64_t xcol = (int64_t)(rowA / a.R) * a.K;   /* the block's group (host: one) */
    uint16_t *xv = (uint16_t *)flf_smem, *xl = xv + (int64_t)a.bk * a.nt * a.ld;
    float *sxs = (float *)xl;
    float acc[MT][NT][4];

    fk_zero(acc);
    for (int j0 = 0; j0 < a.bps; j0 += a.rs) {
        int kr = kb0 + j0, kre = min(kb1, kr + a.rs);   /* the warp's blocks this round */
        int busy = tile < n_tiles && kr < kre;

        if (busy)
            flf_prefetch<MODE, MT>(a, row0, kr, kre, lane);
        if (j0 > 0)
            __syncthreads();   /* the last round's x read */
        flf_stage<MODE>(a, xv, xl, sxs, j0, xcol, warp, lane);
        __syncthreads();
        if (busy) {
            const uint8_t *wr[MT][2];
            const uint16_t *xb[NT];

            fl_wrows<MODE, MT>(wr, a, row0, kr, g);
#pragma unroll
            for (int n = 0; n < NT; n++)
                xb[n] = xv + (int64_t)(sl * a.nt + min(n * 8 + g, a.nt - 1)) * a.ld;
            if (MODE) {
                const uint8_t *ws[MT];
                const float *xs[NT][2];

#pragma unroll
                for (int m = 0; m < MT; m++)
                    ws[m] = a.W.scale + (int64_t)((row0 + m * 16) / 128) * a.nb + kr;
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int j = 0; j < 2; j++)
                        xs[n][j] = MODE == FL_GROUPED ? NULL :
                                   sxs + (sl * a.nt + min(n * 8 + 2 * q + j, a.nt - 1)) * a.rs;
                fk_fp8<MT, NT, MODE == FL_GROUPED, 2>(acc, wr, ws, xb, xs, 0, kre - kr, q);
            } else {
                const uint16_t *xo[NT];

#pragma unroll
                for (int n = 0; n < NT; n++)
                    xo[n] = xl + (xb[n] - xv);
                fk_bf16<MT, NT, 1>(acc, wr, xb, xo, 0, 2 * (kre - kr), q);
            }
        }
    }
    fl_finish<MT, NT>(acc, red, a, tile, row0, blockIdx.y, gridDim.y);
    if (gridDim.y > 1)
        fl_last_reduce<MT>(a);
}

/* --- host side ------------------------------------------------------------------------ */

/* The split of K for an N x K weight with row tiles of 16*MT. */
struct fl_split {
    int nb, bps, bk, G, tiles;
};

static struct fl_split
fl_split_for(int N, int K, int MT)
{
    struct fl_split s;
    int want, S;

    s.tiles = N / (16 * MT);
    s.nb = K / 128;
    want = (FL_WARPS + s.tiles - 1) / s.tiles;
    S = want < s.nb ? want : s.nb;
    S = S < 1 ? 1 : S;
    s.bps = (s.nb + S - 1) / S;
    S = (s.nb + s.bps - 1) / s.bps;
    s.bk = S >= 8 ? 8 : S >= 4 ? 4 : S >= 2 ? 2 : 1;
    s.G = (S + s.bk - 1) / s.bk;
    return s;
}

int
cuda_fast_linear_ok(const struct dsv4_backend *be, const struct dsv4_linear *W)
{
    if (W->w == NULL || W->n_in <= 0 || W->n_out <= 0 || W->n_in % 128 != 0 ||
        (uintptr_t)W->w % 16 != 0)
        return 0;
    if (W->fmt == DSV4_WFMT_FP8)
        return be->numerics == DSV4_NUMERICS_REF && W->scale != NULL && W->n_out % 32 == 0;
    return W->fmt == DSV4_WFMT_BF16 && W->n_out % 16 == 0;
}

int
cuda_fast_linear_grouped_ok(const struct dsv4_linear *W, int G)
{
    return W->fmt == DSV4_WFMT_FP8 && W->w != NULL && W->scale != NULL && G > 0 &&
           W->n_in > 0 && W->n_in % 128 == 0 && W->n_out > 0 && W->n_out % G == 0 &&
           (W->n_out / G) % 32 == 0 && (uintptr_t)W->w % 16 == 0;
}

template <int MODE, int MT>
static enum dsv4_err
fl_run(struct dsv4_backend *be, struct fl_args *a, const struct fl_split *sp)
{
    const struct cuda_state *cs = cuda_st(be);
    cudaStream_t st = cuda_stream(be);
    dim3 grid(cuda_blocks(sp->tiles, FL_NWARP / sp->bk), (unsigned)sp->G);

    /* the two-launch form: split-K added by each row group's last block */
    a->ctr = sp->G > 1 && cs->lin_red && cs->lin_ctr != NULL && grid.x <= FL_CTRS ? cs->lin_ctr
                                                                                  : NULL;
    for (a->t0 = 0; a->t0 < a->T; a->t0 += FL_TOKENS) {
        a->nt = a->T - a->t0 < FL_TOKENS ? a->T - a->t0 : FL_TOKENS;
        if (a->nt <= 8)
            cu_launch(fl_kernel<MODE, MT, 1>, grid, FL_THREADS, 0, st, *a);
        else
            cu_launch(fl_kernel<MODE, MT, 2>, grid, FL_THREADS, 0, st, *a);
        CUDA_LAUNCHED("fast linear");
    }
    if (sp->G > 1 && a->ctr == NULL) {
        int64_t n = (int64_t)a->T * a->N;

        cu_launch(fl_reduce_kernel, cuda_blocks(n, 256), 256, 0, st, a->out, a->part, n, sp->G,
                  a->round_out);
        CUDA_LAUNCHED("fast linear reduce");
    }
    return DSV4_OK;
}

/* Dynamic shared bytes of flf_kernel for nt tokens and rounds of rs blocks
 * per slice. */
static size_t
flf_smem_bytes(int mode, const struct fl_split *sp, int nt, int rs)
{
    size_t rows = (size_t)sp->bk * nt, vals = rows * (size_t)(rs * 128 + 8) * 2;

    return (mode == FL_BF16 ? 2 * vals : vals) + (mode == FL_FP8 ? rows * rs * 4 : 0);
}

/* Blocks per slice and round for nt tokens: the fewest rounds whose staged x
 * fits FL_SMEM_MAX (0: none does). */
static int
flf_rounds(int mode, const struct fl_split *sp, int nt)
{
    for (int r = 1; r <= sp->bps; r++) {
        int rs = (sp->bps + r - 1) / r;

        if (flf_smem_bytes(mode, sp, nt, rs) <= FL_SMEM_MAX)
            return rs;
    }
    return 0;
}

/* Whether the call takes the one-launch form (see the file comment). */
static int
flf_applies(struct dsv4_backend *be, int mode, const struct fl_split *sp, const float *x,
            int N, int R, int T)
{
    const struct cuda_state *st = cuda_st(be);
    int MT = mode == FL_BF16 ? 1 : 2, tpb = FL_NWARP / sp->bk;
    unsigned blocks = cuda_blocks(sp->tiles, tpb);

    if ((T < FL_TOKENS ? T : FL_TOKENS) > st->lin_tmax || (uintptr_t)x % 16 != 0)
        return 0;
    if (sp->G > 1 && (st->lin_ctr == NULL || blocks > FL_CTRS))
        return 0;
    if (R != N && R % (tpb * 16 * MT) != 0)
        return 0;   /* a block's tiles in two groups */
    return flf_rounds(mode, sp, T < FL_TOKENS ? T : FL_TOKENS) > 0;
}

/* The one-launch form: one flf_kernel per pass of 16 tokens. */
template <int MODE, int MT>
static enum dsv4_err
flf_run(struct dsv4_backend *be, struct fl_args *a, const struct fl_split *sp)
{
    cudaStream_t st = cuda_stream(be);
    dim3 grid(cuda_blocks(sp->tiles, FL_NWARP / sp->bk), (unsigned)sp->G);

    a->ctr = cuda_st(be)->lin_ctr;
    for (a->t0 = 0; a->t0 < a->T; a->t0 += FL_TOKENS) {
        size_t smem;

        a->nt = a->T - a->t0 < FL_TOKENS ? a->T - a->t0 : FL_TOKENS;
        a->rs = flf_rounds(MODE, sp, a->nt);   /* > 0: fewer tokens than checked */
        a->ld = a->rs * 128 + 8;
        smem = flf_smem_bytes(MODE, sp, a->nt, a->rs);
        if (a->nt <= 8) {
            CUDA_TRY(cudaFuncSetAttribute(flf_kernel<MODE, MT, 1>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          FL_SMEM_MAX));
            cu_launch(flf_kernel<MODE, MT, 1>, grid, FL_THREADS, smem, st, *a);
        } else {
            CUDA_TRY(cudaFuncSetAttribute(flf_kernel<MODE, MT, 2>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          FL_SMEM_MAX));
            cu_launch(flf_kernel<MODE, MT, 2>, grid, FL_THREADS, smem, st, *a);
        }
        CUDA_LAUNCHED("fast linear (one launch)");
    }
    return DSV4_OK;
}

void
cuda_fast_linear_init(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);
    const char *v = getenv("DSV4_CUDA_LINEAR");
    void *p = NULL;

    /* three launches by default: the one-launch form stages x per block
     * and was slower at every T >= 4 and overall at T = 1 (perf.md run 20) */
    st->lin_tmax = 0;
    st->lin_red = 0;
    if (v != NULL && strcmp(v, "v1r") == 0)
        st->lin_red = 1;
    else if (v != NULL && strcmp(v, "fused") == 0)
        st->lin_tmax = FL_TOKENS;
    else if (v != NULL && strncmp(v, "fused:", 6) == 0)
        st->lin_tmax = atoi(v + 6) < 0 ? 0 : atoi(v + 6);
    st->lin_ctr = NULL;
    st->side_ctr = NULL;
    /* two sets: the main queue's and the side queue's (cuda_state.side_ctr) */
    if (cudaMalloc(&p, 2 * FL_CTRS * sizeof(unsigned)) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    /* zero before any later work on the stream */
    if (cudaMemsetAsync(p, 0, 2 * FL_CTRS * sizeof(unsigned), st->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFree(p);
        return;
    }
    st->lin_ctr = (unsigned *)p;
    st->side_ctr = st->lin_ctr + FL_CTRS;
}

void
cuda_fast_linear_fini(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    /* the allocation starts at the main queue's half (destroy ends a side
     * branch first; either order is freed right) */
    cudaFree(st->side_ctr != NULL && st->side_ctr < st->lin_ctr ? st->side_ctr : st->lin_ctr);
    st->lin_ctr = st->side_ctr = NULL;
}

extern "C" int
dsv4_cuda_set_linear(struct dsv4_backend *be, int tmax)
{
    int was;

    if (!cuda_is_backend(be))
        return -1;
    was = cuda_st(be)->lin_tmax;
    cuda_st(be)->lin_tmax = tmax < 0 ? 0 : tmax;
    return was;
}

extern "C" int
dsv4_cuda_set_linear_reduce(struct dsv4_backend *be, int in_kernel)
{
    int was;

    if (!cuda_is_backend(be))
        return -1;
    was = cuda_st(be)->lin_red;
    cuda_st(be)->lin_red = in_kernel != 0;
    return was;
}

/* fk_quant2 (scale 1) against fk_quant_value rounded to f16, on the bit
 * patterns i, i + stride, ...: count the differences, keep the first. */
static __global__ void
flf_quant_check_kernel(unsigned long long *bad, unsigned *first)
{
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;

    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (1ull << 32);
         i += 2 * stride) {
        uint32_t u0 = (uint32_t)i, u1 = (uint32_t)(i + stride < (1ull << 32) ? i + stride : i);
        float v0 = __uint_as_float(u0), v1 = __uint_as_float(u1);
        uint32_t h = fk_quant2(v0, v1, 1.0f, NULL);
        uint32_t r0 = __half_as_ushort(__float2half_rn(fk_quant_value(v0, 1.0f)));
        uint32_t r1 = __half_as_ushort(__float2half_rn(fk_quant_value(v1, 1.0f)));

        if ((h & 0xffffu) != r0) {
            atomicAdd(bad, 1ull);
            atomicMin(first, u0);
        }
        if (u1 != u0 && h >> 16 != r1) {
            atomicAdd(bad, 1ull);
            atomicMin(first, u1);
        }
    }
}

/* Run check kernel k (`blocks` blocks of 256 threads, into a counter of
 * differences and the first one) and read its results; `what` names it in
 * errors. */
static enum dsv4_err
fl_check(struct dsv4_backend *be, void (*k)(unsigned long long *, unsigned *), unsigned blocks,
         const char *what, uint64_t *n_bad, uint32_t *first)
{
    unsigned long long *d = NULL, hb = 0;
    unsigned hf = 0xffffffffu;
    cudaStream_t st;

    if (!cuda_is_backend(be))
        return dsv4_err_set(DSV4_ERR_INVAL, "%s: not a CUDA backend", what);
    st = cuda_stream(be);
    CUDA_TRY(cudaMalloc((void **)&d, 16));
    if (cudaMemcpyAsync(d, &hb, 8, cudaMemcpyHostToDevice, st) != cudaSuccess ||
        cudaMemcpyAsync(d + 1, &hf, 4, cudaMemcpyHostToDevice, st) != cudaSuccess) {
        cudaFree(d);
        return dsv4_err_set(DSV4_ERR_CUDA, "%s: copy failed", what);
    }
    k<<<blocks, 256, 0, st>>>(d, (unsigned *)(d + 1));
    if (cudaGetLastError() != cudaSuccess ||
        cudaMemcpyAsync(&hb, d, 8, cudaMemcpyDeviceToHost, st) != cudaSuccess ||
        cudaMemcpyAsync(&hf, d + 1, 4, cudaMemcpyDeviceToHost, st) != cudaSuccess ||
        cudaStreamSynchronize(st) != cudaSuccess) {
        cudaFree(d);
        return dsv4_err_set(DSV4_ERR_CUDA, "%s: kernel failed", what);
    }
    cudaFree(d);
    *n_bad = hb;
    *first = hf;
    return DSV4_OK;
}

extern "C" enum dsv4_err
dsv4_cuda_linear_quant_check(struct dsv4_backend *be, uint64_t *n_bad, uint32_t *first)
{
    return fl_check(be, flf_quant_check_kernel, 1024, "dsv4_cuda_linear_quant_check", n_bad,
                    first);
}

/* fk_e4m3x2_bf16 against the bf16 of the exact decode (cu_fp8_to_f32) of
 * both codes, on every pair of codes but those holding the NaN code. */
static __global__ void
fk_e4m3_check_kernel(unsigned long long *bad, unsigned *first)
{
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x, c0 = i & 0xffu, c1 = i >> 8 & 0xffu;
    uint32_t want, got;

    if (i >= 65536u || (c0 & 0x7fu) == 0x7fu || (c1 & 0x7fu) == 0x7fu)
        return;
    want = __float_as_uint(cu_fp8_to_f32((uint8_t)c0)) >> 16 |
           (__float_as_uint(cu_fp8_to_f32((uint8_t)c1)) & 0xffff0000u);
    got = fk_e4m3x2_bf16(i | 0xabcd0000u);   /* the high half must not matter */
    if (got != want || fk_e4m3x2_bf16_spread(i) != want) {
        atomicAdd(bad, 1ull);
        atomicMin(first, i);
    }
}

extern "C" enum dsv4_err
dsv4_cuda_linear_e4m3_check(struct dsv4_backend *be, uint64_t *n_bad, uint32_t *first)
{
    return fl_check(be, fk_e4m3_check_kernel, 256, "dsv4_cuda_linear_e4m3_check", n_bad, first);
}

/* Scratch layout of one call: x values, bf16 lo (BF16), scales (FP8), the
 * partial sums (G > 1); sizes are multiples of 256.  The one-launch form
 * uses only the partial sums, at the same place. */
struct fl_scratch {
    size_t v, l, s, p;
};

static struct fl_scratch
fl_scratch_for(int mode, const struct fl_split *sp, int T, int64_t xcols, int N)
{
    struct fl_scratch b;

    b.v = cuda_align((size_t)T * xcols * sizeof(uint16_t));
    b.l = mode == FL_BF16 ? b.v : 0;
    b.s = mode == FL_FP8 ? cuda_align((size_t)T * sp->nb * sizeof(float)) : 0;
    b.p = sp->G > 1 ? cuda_align((size_t)sp->G * T * N * sizeof(float)) : 0;
    return b;
}

/* The call's mode and row tile (MT) for weight W. */
static int
fl_mode(const struct dsv4_linear *W, int grouped)
{
    return grouped ? FL_GROUPED : W->fmt == DSV4_WFMT_FP8 ? FL_FP8 : FL_BF16;
}

/* DSV4_CUDA_LIN_EARLY=0: the decode linear's FP8 and BF16 weights all
 * loaded after its PDL wait. */
static struct cuda_switch lin_early_sw = CUDA_SWITCH("DSV4_CUDA_LIN_EARLY", 1);

/* The tile kernel's arguments for W (mode, split sp) at T rows of x (row
 * stride xcols; R rows per group, N when not grouped), with x prepared at
 * xv / xl / sx, the split-K partials at part (G > 1) and the output out. */
static struct fl_args
fl_args_for(const struct dsv4_linear *W, int mode, const struct fl_split *sp, int T,
            int64_t xcols, int R, unsigned flags, const float *x, const uint16_t *xv,
            const uint16_t *xl, const float *sx, float *part, float *out)
{
    struct fl_args a;

    memset(&a, 0, sizeof(a));
    a.W = *W;
    a.xv = xv;
    a.xl = xl;
    a.sx = sx;
    a.part = sp->G > 1 ? part : NULL;
    a.out = out;
    a.T = T;
    a.N = W->n_out;
    a.K = W->n_in;
    a.nb = sp->nb;
    a.xstride = xcols;
    a.R = R;
    a.bps = sp->bps;
    a.bk = sp->bk;
    a.round_out = !(mode == FL_BF16 && (flags & DSV4_LIN_F32_OUT));
    a.early = cuda_switch_on(&lin_early_sw);
    a.x = x;
    return a;
}

/* fk_split_kernel four values a thread (n % 4 == 0, x 16-byte and hi, lo
 * 8-byte aligned): one 16-byte load and 8-byte stores instead of a 4-byte
 * load and 2-byte stores a value (a prefill's BF16 linears split 8 M
 * values a call: 37 us against 15 at the memory's rate, docs/perf.md run
 * 57).  The same values. */
static __global__ void
fk_split4_kernel(uint16_t *hi, uint16_t *lo, const float *x, int64_t n)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) * 4;
    uint16_t h[4], l[4];

    if (i >= n)
        return;
    float4 v = *(const float4 *)(x + i);

    fk_split_value(v.x, &h[0], &l[0]);
    fk_split_value(v.y, &h[1], &l[1]);
    fk_split_value(v.z, &h[2], &l[2]);
    fk_split_value(v.w, &h[3], &l[3]);
    *(uint2 *)(hi + i) = make_uint2((uint32_t)h[0] | (uint32_t)h[1] << 16,
                                    (uint32_t)h[2] | (uint32_t)h[3] << 16);
    if (lo != NULL)
        *(uint2 *)(lo + i) = make_uint2((uint32_t)l[0] | (uint32_t)l[1] << 16,
                                        (uint32_t)l[2] | (uint32_t)l[3] << 16);
}

/* fast.cuh: x = hi + lo for n values (fk_split_kernel; fk_split4_kernel
 * where n and the pointers allow). */
enum dsv4_err
fk_split(struct dsv4_backend *be, uint16_t *hi, uint16_t *lo, const float *x, int64_t n)
{
    if (n % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)hi % 8 == 0 &&
        (uintptr_t)lo % 8 == 0)
        cu_launch(fk_split4_kernel, cuda_blocks(n / 4, 256), 256, 0, cuda_stream(be), hi, lo,
                  x, n);
    else
        cu_launch(fk_split_kernel, cuda_blocks(n, 256), 256, 0, cuda_stream(be), hi, lo, x,
                  n);
    CUDA_LAUNCHED("fast split");
    return DSV4_OK;
}

size_t
cuda_fast_linear_scratch(const struct dsv4_linear *W, int T, int G)
{
    int mode = fl_mode(W, G > 0);
    struct fl_split sp = fl_split_for(W->n_out, W->n_in, mode == FL_BF16 ? 1 : 2);
    struct fl_scratch b = fl_scratch_for(mode, &sp, T, (int64_t)W->n_in * (G > 0 ? G : 1),
                                         W->n_out);

    return b.v + b.l + b.s + b.p;
}

/* cuda_fast_linear_at; ready (grouped only): x's bf16 values already at the
 * scratch's byte off (cuda_fast_linear_grouped_b16), x unused. */
static enum dsv4_err
fl_at(struct dsv4_backend *be, float *out, const float *x, const struct dsv4_linear *W, int T,
      unsigned flags, int G, size_t off, int ready)
{
    int mode = fl_mode(W, G > 0), N = W->n_out, K = W->n_in;
    int64_t xcols = (int64_t)K * (G > 0 ? G : 1), n = (int64_t)T * xcols;
    struct fl_split sp = fl_split_for(N, K, mode == FL_BF16 ? 1 : 2);
    struct fl_scratch b = fl_scratch_for(mode, &sp, T, xcols, N);
    char *base;
    struct fl_args a;
    enum dsv4_err e;

    if (T <= 0)
        return DSV4_OK;
    base = (char *)cuda_scratch(be, off + b.v + b.l + b.s + b.p);
    if (base == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast linear: no scratch for %d x %lld", T,
                            (long long)xcols);
    base += off;
    a = fl_args_for(W, mode, &sp, T, xcols, G > 0 ? N / G : N, flags, x, (const uint16_t *)base,
                    mode == FL_BF16 ? (const uint16_t *)(base + b.v) : NULL,
                    mode == FL_FP8 ? (const float *)(base + b.v) : NULL,
                    (float *)(base + b.v + b.l + b.s), out);
    if (ready)
        return fl_run<FL_GROUPED, 2>(be, &a, &sp);
    if (flf_applies(be, mode, &sp, x, N, a.R, T))
        return mode == FL_FP8 ? flf_run<FL_FP8, 2>(be, &a, &sp)
             : mode == FL_GROUPED ? flf_run<FL_GROUPED, 2>(be, &a, &sp)
             : flf_run<FL_BF16, 1>(be, &a, &sp);
    switch (mode) {
    case FL_FP8:
        e = fk_quant(be, (uint16_t *)a.xv, NULL, (float *)a.sx, x, K, T, K);
        if (e != DSV4_OK)
            return e;
        return fl_run<FL_FP8, 2>(be, &a, &sp);
    case FL_GROUPED:   /* bf16(x) only */
        e = fk_split(be, (uint16_t *)a.xv, NULL, x, n);
        return e != DSV4_OK ? e : fl_run<FL_GROUPED, 2>(be, &a, &sp);
    default:
        e = fk_split(be, (uint16_t *)a.xv, (uint16_t *)a.xl, x, n);
        return e != DSV4_OK ? e : fl_run<FL_BF16, 1>(be, &a, &sp);
    }
}

enum dsv4_err
cuda_fast_linear_at(struct dsv4_backend *be, float *out, const float *x,
                    const struct dsv4_linear *W, int T, unsigned flags, int G, size_t off)
{
    return fl_at(be, out, x, W, T, flags, G, off, 0);
}

enum dsv4_err
cuda_fast_linear_grouped_b16(struct dsv4_backend *be, float *out, const struct dsv4_linear *W,
                             int T, int G, size_t off)
{
    if (G <= 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "cuda fast linear grouped b16: G = %d", G);
    return fl_at(be, out, NULL, W, T, 0, G, off, 1);
}

enum dsv4_err
cuda_fast_linear(struct dsv4_backend *be, float *out, const float *x,
                 const struct dsv4_linear *W, int T, unsigned flags)
{
    return cuda_fast_linear_at(be, out, x, W, T, flags, 0, 0);
}

enum dsv4_err
cuda_fast_linear_grouped(struct dsv4_backend *be, float *out, const float *x,
                         const struct dsv4_linear *W, int T, int G)
{
    return cuda_fast_linear_at(be, out, x, W, T, 0, G, 0);
}

/* The launches of cuda_fast_linear_multi for the linears of one format
 * (idx[0..cnt-1] into a[]): one flm_kernel over all their blocks. */
template <int MODE, int MT>
static void
flm_launch(struct dsv4_backend *be, const struct fl_args *a, const struct fl_split *sp,
           const int *idx, int cnt, int T)
{
    struct flm_args m;
    int blocks = 0;

    memset(&m, 0, sizeof(m));
    m.n = cnt;
    for (int j = 0; j < cnt; j++) {
        const struct fl_split *s = &sp[idx[j]];

        m.a[j] = a[idx[j]];
        m.gx[j] = (int)cuda_blocks(s->tiles, FL_NWARP / s->bk);
        m.off[j] = blocks;
        blocks += m.gx[j] * s->G;
    }
    m.off[cnt] = blocks;
    if (T <= 8)
        cu_launch(flm_kernel<MODE, MT, 1>, blocks, FL_THREADS, 0, cuda_stream(be), m);
    else
        cu_launch(flm_kernel<MODE, MT, 2>, blocks, FL_THREADS, 0, cuda_stream(be), m);
}

enum dsv4_err
cuda_fast_linear_multi(struct dsv4_backend *be, int n, float *const *outs, const float *x,
                       const struct dsv4_linear *const *Ws, const unsigned *flags, int T)
{
    struct fl_args a[DSV4_LINEAR_MULTI_MAX];
    struct fl_split sp[DSV4_LINEAR_MULTI_MAX];
    int idx[2][DSV4_LINEAR_MULTI_MAX], cnt[2] = { 0, 0 }, K = Ws[0]->n_in;
    size_t b_v = cuda_align((size_t)T * K * sizeof(uint16_t)), total = 0, at;
    size_t b_s = cuda_align((size_t)T * (K / 128) * sizeof(float)), part[DSV4_LINEAR_MULTI_MAX];
    struct flm_red r;
    char *base;

    for (int i = 0; i < n; i++) {
        int mode = fl_mode(Ws[i], 0), fp8 = mode == FL_FP8;

        sp[i] = fl_split_for(Ws[i]->n_out, K, fp8 ? 2 : 1);
        part[i] = fl_scratch_for(mode, &sp[i], T, K, Ws[i]->n_out).p;
        total += part[i];
        idx[fp8][cnt[fp8]++] = i;
    }
    /* FP8: f16 values + scales; BF16: hi + lo; then the partial sums */
    at = (cnt[1] ? b_v + b_s : 0) + (cnt[0] ? 2 * b_v : 0);
    base = (char *)cuda_scratch(be, at + total);
    if (base == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast linear multi: no scratch (%d x %d)", T,
                            K);
    {
        uint16_t *v8 = (uint16_t *)base, *hi = (uint16_t *)(base + (cnt[1] ? b_v + b_s : 0));
        float *sx = (float *)(base + b_v);
        char *pp = base + at;
        enum dsv4_err e;

        if (cnt[1]) {
            e = fk_quant(be, v8, NULL, sx, x, K, T, K);
            if (e != DSV4_OK)
                return e;
        }
        if (cnt[0]) {
            e = fk_split(be, hi, (uint16_t *)((char *)hi + b_v), x, (int64_t)T * K);
            if (e != DSV4_OK)
                return e;
        }
        for (int i = 0; i < n; i++) {
            int mode = fl_mode(Ws[i], 0), fp8 = mode == FL_FP8;

            a[i] = fl_args_for(Ws[i], mode, &sp[i], T, K, Ws[i]->n_out, flags[i], x,
                               fp8 ? v8 : hi, fp8 ? NULL : (const uint16_t *)((char *)hi + b_v),
                               fp8 ? sx : NULL, (float *)pp, outs[i]);
            pp += part[i];
        }
    }
    if (cnt[1]) {
        flm_launch<FL_FP8, 2>(be, a, sp, idx[1], cnt[1], T);
        CUDA_LAUNCHED("fast linear multi (FP8)");
    }
    if (cnt[0]) {
        flm_launch<FL_BF16, 1>(be, a, sp, idx[0], cnt[0], T);
        CUDA_LAUNCHED("fast linear multi (BF16)");
    }
    memset(&r, 0, sizeof(r));
    for (int i = 0; i < n; i++)
        if (sp[i].G > 1) {
            r.out[r.n] = outs[i];
            r.part[r.n] = a[i].part;
            r.G[r.n] = sp[i].G;
            r.round_out[r.n] = a[i].round_out;
            r.off[r.n + 1] = r.off[r.n] + (int64_t)T * Ws[i]->n_out;
            r.n++;
        }
    if (r.n > 0) {
        cu_launch(flm_reduce_kernel, cuda_blocks(r.off[r.n], 256), 256, 0, cuda_stream(be), r);
        CUDA_LAUNCHED("fast linear multi reduce");
    }
    return DSV4_OK;
}
