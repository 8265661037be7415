/*
 * fast_linear.cu — the fast linear for decode: FP8 block-scaled weights
 * under REF numerics and BF16 weights (any numerics), at any T (fast for
 * T <= 16), through the warp tiles of fast.cuh.  Used by cuda_linear when
 * dsv4_cuda_set_kernels(be, 1) was called and cuda_fast_linear_ok() agrees.
 * Also the grouped output projection (linear_grouped, FP8 weights run as
 * bf16 on bf16-rounded inputs): the same tile kernel, each row tile reading
 * its group's slice of x (cuda_fast_linear_grouped_ok).
 *
 * Steps of one call:
 *   1. activations: REF FP8 quantization per 128 columns into f16 values +
 *      scales (FP8 weights), the bf16 hi/lo split of x (BF16 weights), or
 *      bf16(x) (grouped);
 *   2. the tile kernel, once per pass of 16 tokens: a block of 8 warps;
 *      warp w takes row tile (blockIdx.x * 8/bk + w / bk) (32 rows for FP8,
 *      16 for BF16) and K slice (blockIdx.y * bk + w % bk); the bk slices of
 *      a block are added in shared memory in slice order; with G =
 *      gridDim.y > 1 each block writes its partial sums (G, T, N);
 *   3. with G > 1, a reduction adds the G partials in order and rounds.
 * The split (slices S = bk * G, blocks of K per slice) is chosen from N and K
 * only, aiming at >= FL_WARPS warps in flight, so results never depend on T.
 */
#include "kernels/cuda/fast.cuh"

#include <cuda_fp16.h>

#define FL_THREADS 256
#define FL_NWARP (FL_THREADS / 32)
#define FL_WARPS 2048      /* warps wanted per call (132 SMs x ~16) */
#define FL_TOKENS 16       /* tokens per pass (two n-tiles) */

/* --- activation preparation ------------------------------------------------------- */

/* One warp per (row, 128-block): the exact path's quant_kernel, values
 * written as f16 and/or bf16 bits (both exact for FP8 values). */
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
    float amax = 1e-4f, v[4], s;
    const float *xb;

    if (r >= rows)
        return;   /* whole warps leave together */
    xb = x + r * stride + (int64_t)b * 128;
    for (int i = 0; i < 4; i++) {
        v[i] = xb[lane + 32 * i];
        amax = fmaxf(amax, fabsf(v[i]));
    }
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    s = cu_pow2_scale(amax, 448.0f);
    for (int i = 0; i < 4; i++) {
        float qv = cu_fp8_to_f32(cu_f32_to_fp8(cu_clampf(v[i] / s, 448.0f)));
        int64_t at = r * K + (int64_t)b * 128 + lane + 32 * i;

        if (f16 != NULL)
            f16[at] = __half_as_ushort(__float2half_rn(qv));
        if (bf16 != NULL)
            bf16[at] = (uint16_t)(__float_as_uint(qv) >> 16);
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
    float v, h;

    if (i >= n)
        return;
    v = x[i];
    h = cu_bf16_round(v);
    hi[i] = (uint16_t)(__float_as_uint(h) >> 16);
    if (lo != NULL)
        lo[i] = isfinite(v) ? (uint16_t)(__float_as_uint(cu_bf16_round(v - h)) >> 16) : 0;
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
};

template <int MODE, int MT, int NT>
static __global__ void __launch_bounds__(FL_THREADS, 2)
fl_kernel(struct fl_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ float red[FL_NWARP][MT][NT][4][32];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int tile = blockIdx.x * (FL_NWARP / a.bk) + warp / a.bk;
    int slice = blockIdx.y * a.bk + warp % a.bk;
    int kb0 = slice * a.bps, kb1 = min(a.nb, kb0 + a.bps);
    int n_tiles = a.N / (16 * MT), row0 = tile * 16 * MT;
    float acc[MT][NT][4];

    fk_zero(acc);
    if (tile < n_tiles && kb0 < kb1) {
        const uint8_t *wr[MT][2];
        const uint16_t *xb[NT];

#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                wr[m][h] = (const uint8_t *)a.W.w +
                           (int64_t)(row0 + m * 16 + g + 8 * h) * a.K * (MODE ? 1 : 2);
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
            fk_fp8<MT, NT, MODE == FL_GROUPED>(acc, wr, ws, xb, xs, kb0, kb1, q);
        } else {
            const uint16_t *xl[NT];

#pragma unroll
            for (int n = 0; n < NT; n++)
                xl[n] = a.xl + (xb[n] - a.xv);
            fk_bf16<MT, NT>(acc, wr, xb, xl, 2 * kb0, 2 * kb1, q);
        }
    }
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
    if (warp % a.bk != 0 || tile >= n_tiles)
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
                if (gridDim.y == 1)
                    a.out[(int64_t)t * a.N + row] = a.round_out ? cu_bf16_round(v) : v;
                else
                    a.part[((int64_t)blockIdx.y * a.T + t) * a.N + row] = v;
            }
}

/* out[i] = Σ_y part[y, i] in order, then rounded. */
static __global__ void
fl_reduce_kernel(float *out, const float *part, int64_t n, int G, int round_out)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    float v;

    if (i >= n)
        return;
    v = part[i];
    for (int y = 1; y < G; y++)
        v += part[(int64_t)y * n + i];
    out[i] = round_out ? cu_bf16_round(v) : v;
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
    cudaStream_t st = cuda_stream(be);
    dim3 grid(cuda_blocks(sp->tiles, FL_NWARP / sp->bk), (unsigned)sp->G);

    for (a->t0 = 0; a->t0 < a->T; a->t0 += FL_TOKENS) {
        if (a->T - a->t0 <= 8)
            cu_launch(fl_kernel<MODE, MT, 1>, grid, FL_THREADS, 0, st, *a);
        else
            cu_launch(fl_kernel<MODE, MT, 2>, grid, FL_THREADS, 0, st, *a);
        CUDA_LAUNCHED("fast linear");
    }
    if (sp->G > 1) {
        int64_t n = (int64_t)a->T * a->N;

        cu_launch(fl_reduce_kernel, cuda_blocks(n, 256), 256, 0, st, a->out, a->part, n, sp->G,
                  a->round_out);
        CUDA_LAUNCHED("fast linear reduce");
    }
    return DSV4_OK;
}

/* Scratch layout of one call: x values, bf16 lo (BF16), scales (FP8), the
 * partial sums (G > 1); sizes are multiples of 256. */
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

size_t
cuda_fast_linear_scratch(const struct dsv4_linear *W, int T, int G)
{
    int mode = fl_mode(W, G > 0);
    struct fl_split sp = fl_split_for(W->n_out, W->n_in, mode == FL_BF16 ? 1 : 2);
    struct fl_scratch b = fl_scratch_for(mode, &sp, T, (int64_t)W->n_in * (G > 0 ? G : 1),
                                         W->n_out);

    return b.v + b.l + b.s + b.p;
}

enum dsv4_err
cuda_fast_linear_at(struct dsv4_backend *be, float *out, const float *x,
                    const struct dsv4_linear *W, int T, unsigned flags, int G, size_t off)
{
    int mode = fl_mode(W, G > 0), N = W->n_out, K = W->n_in;
    int64_t xcols = (int64_t)K * (G > 0 ? G : 1), n = (int64_t)T * xcols;
    struct fl_split sp = fl_split_for(N, K, mode == FL_BF16 ? 1 : 2);
    struct fl_scratch b = fl_scratch_for(mode, &sp, T, xcols, N);
    cudaStream_t st = cuda_stream(be);
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
    a.W = *W;
    a.xv = (const uint16_t *)base;
    a.xl = mode == FL_BF16 ? (const uint16_t *)(base + b.v) : NULL;
    a.sx = mode == FL_FP8 ? (const float *)(base + b.v) : NULL;
    a.part = sp.G > 1 ? (float *)(base + b.v + b.l + b.s) : NULL;
    a.out = out;
    a.T = T;
    a.t0 = 0;
    a.N = N;
    a.K = K;
    a.nb = sp.nb;
    a.xstride = xcols;
    a.R = G > 0 ? N / G : N;
    a.bps = sp.bps;
    a.bk = sp.bk;
    a.round_out = !(mode == FL_BF16 && (flags & DSV4_LIN_F32_OUT));
    switch (mode) {
    case FL_FP8:
        e = fk_quant(be, (uint16_t *)a.xv, NULL, (float *)a.sx, x, K, T, K);
        if (e != DSV4_OK)
            return e;
        return fl_run<FL_FP8, 2>(be, &a, &sp);
    case FL_GROUPED:
        cu_launch(fk_split_kernel, cuda_blocks(n, 256), 256, 0, st, (uint16_t *)a.xv,
                  (uint16_t *)NULL, x, n);
        CUDA_LAUNCHED("fast bf16 round");
        return fl_run<FL_GROUPED, 2>(be, &a, &sp);
    default:
        cu_launch(fk_split_kernel, cuda_blocks(n, 256), 256, 0, st, (uint16_t *)a.xv,
                  (uint16_t *)a.xl, x, n);
        CUDA_LAUNCHED("fast split");
        return fl_run<FL_BF16, 1>(be, &a, &sp);
    }
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
