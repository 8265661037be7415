/*
 * fast_moe.cu — the fast routed + shared MoE for decode (T <= FM_MAX_T token
 * rows, REF numerics, FP4 routed experts, an FP8 shared expert).  Used by
 * cuda_moe when dsv4_cuda_set_kernels(be, 1) was called and
 * cuda_fast_moe_ok() agrees; moe and moe_parts.  No host synchronisation,
 * no host copy: the op can be recorded in a CUDA graph.  Design, knobs and
 * measurements: docs/gpu.md, "The decode MoE kernel".
 *
 * v3 (fast_moe3.cu: FP4 -> e4m3 and FP8 tensor-core MMA) is the default
 * where it takes the shapes, v1 elsewhere: on the H200 (bench_fast,
 * 2026-11-30, third session) v3 read the weights at 0.45 of 4.3 TB/s at
 * T = 16 against v1's 0.42 (0.35 against 0.29 at T = 1) and a 4-layer
 * batch-16 step took 3.52 ms against 3.73.  v2 read them at 0.35-0.37 at
 * T = 4..64 against v1's 0.40-0.41 (v2 only wins at T = 1-2).
 * v2 (DSV4_CUDA_FAST_MOE = "v2" or "W,KS,PF,CPS" to tune it), three launches:
 *   1. fm2_prep_kernel: block 0 groups the (token, pick) rows r = t*k + j by
 *      expert id (clamped into the table, as the exact path does; the
 *      active experts in increasing id order, their rows in increasing r)
 *      and zeroes the counters; the other blocks quantize x per row per 128
 *      columns (the exact path's codes), as bf16 in fm2_perm order (routed
 *      experts) and f16 (shared expert);
 *   2. fm2_kernel: persistent blocks take work items from an atomic counter:
 *      up items (slot, 16*W/KS columns of h: rows of w1 and w3, SwiGLU, h
 *      stored; the last item of a 128-column h block quantizes it), then
 *      down items (slot, 32*W/KS rows of w2, once the slot's h is
 *      quantized).  The FP4 weights stream through registers PF - 1 blocks
 *      ahead, 16-byte loads, decoded by bit placement (fm2_dec), times the
 *      E8M0 group scale (exact bf16 products), bf16 mma;
 *   3. the exact path's combine (cuda_moe_combine; moe only).
 * v1 (default; DSV4_CUDA_FAST_MOE=v1): the first kernels, six launches:
 *   x quantization (fk_quant); grouping (fm_group_kernel); up, grid (I/64,
 *   A+1) with A = min(T*k, E) expert slots plus the shared slot, a warp per
 *   16 rows of w1 and w3, FP4 decoded through a table in shared memory
 *   (filled by every block); h quantization; down, grid (D/128, A+1), a warp
 *   per 32 rows of w2; combine.
 * Numerics (both): h = bf16(silu(min(g, L)) * clamp(u, +-L) * route weight)
 * with g, u the bf16-rounded outputs, exactly the exact path's expression;
 * y[row] = bf16(w2 . h[row]); every dot product is the exact path's terms
 * summed in another fp32 order (per 128-column block, then blocks in
 * order); out[t] = bf16(picks in increasing expert id order (stable), then
 * + the shared row), the exact path's own combine on the (T*k + T, D)
 * layout.  Deterministic: each value is computed by one warp in a fixed
 * order, whichever block takes the item.
 */
#include "kernels/cuda/fast.cuh"

#include <cuda_fp16.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FM_MAX_T 96                /* token rows per call */
#define FM_MAX_E 4096              /* experts in the table (grouping in shared memory) */
#define FM_WARPS 4                 /* warps per block, up and down */
#define FM_THREADS (FM_WARPS * 32)
#define FM_MAX_K 64                /* picks per token (the exact path's bound) */

/* Everything the kernels need, by value (v1 and v2). */
struct fm2_args {
    const struct dsv4_expert_w *table;  /* device copy of the expert array */
    struct dsv4_expert_w shared;        /* shared expert (device pointers) */
    int has_shared;
    const int32_t *grp;     /* grouping (fm_group): n_act, act_e[A], act_off[A+1], rows */
    int A;                  /* routed slots at most */
    int32_t *ctr;           /* [0] work queue; [1 + y*NB + b] finished up items of h
                               block b of slot y; [1 + (A+1)*NB + y] quantized h blocks
                               of slot y (zeroed by fm2_prep_kernel) */
    uint16_t *xp, *xf;      /* (T, D): FP8 values of x, bf16 (routed; v2: in
                               fm2_perm order) and f16 (shared) */
    float *xs;              /* (T, D/128) */
    float *h;               /* (R, I), R = T*k + T: SwiGLU outputs (bf16 values) */
    uint16_t *hp, *hf;      /* (R, I): FP8 values of h, as xp / xf */
    float *hs;              /* (R, I/128) */
    float *y;               /* (R, D): the summands (moe_parts: the caller's array) */
    const float *weights;   /* (T, k) */
    int T, k, D, I;
    int ks;                 /* K slices per item (v2 configuration) */
    float lim;
};

/* The expert slot of a block (v1) or of a work item (v2). */
struct fm_slot {
    const struct dsv4_expert_w *E;
    const int32_t *rows;    /* pick rows (routed), NULL for the shared slot */
    int n;                  /* rows of this slot */
};

static __device__ __forceinline__ int
fm_slot_get(const struct fm2_args &a, struct fm_slot *s)
{
    const int32_t *act_e = a.grp + 1, *act_off = a.grp + 1 + a.A;
    int y = blockIdx.y;

    if (y == a.A) {
        if (!a.has_shared)
            return 0;
        s->E = &a.shared;
        s->rows = NULL;
        s->n = a.T;
        return 1;
    }
    if (y >= a.grp[0])
        return 0;
    s->E = &a.table[act_e[y]];
    s->rows = a.grp + 2 + 2 * a.A + act_off[y];
    s->n = act_off[y + 1] - act_off[y];
    return 1;
}

/* Slot row j -> token (row of x) and row of h / y (k picks per token, T
 * tokens: the shared rows follow the T*k pick rows). */
static __device__ __forceinline__ int
fm_token(const struct fm_slot &s, int j, int k)
{
    return s.rows != NULL ? s.rows[j] / k : j;
}

static __device__ __forceinline__ int
fm_hrow(const struct fm_slot &s, int j, int T, int k)
{
    return s.rows != NULL ? s.rows[j] : T * k + j;
}

/* --- grouping ------------------------------------------------------------------------- */

/*
 * Called by a whole block; sm: (E + Tk) ints of dynamic shared memory.
 * skip_unheld: experts of the table without weights (moe_parts: held by
 * another rank) are left out.
 */
static __device__ void
fm_group(int32_t *grp, const int32_t *ids, int Tk, int E, int A,
         const struct dsv4_expert_w *table, int skip_unheld, int32_t *sm)
{
    __shared__ int32_t n_act;
    int32_t *cnt = sm, *ida = sm + E;
    int32_t *act_e = grp + 1, *act_off = grp + 1 + A, *rows = grp + 2 + 2 * A;

    for (int e = threadIdx.x; e < E; e += blockDim.x)
        cnt[e] = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < Tk; r += blockDim.x) {
        int e = ids[r];

        e = e < 0 ? 0 : (e >= E ? E - 1 : e);
        ida[r] = e;
        atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int n = 0, pos = 0;

        for (int e = 0; e < E; e++) {
            if (cnt[e] == 0 || (skip_unheld && table[e].w1.w == NULL))
                continue;
            act_e[n] = e;
            act_off[n] = pos;
            pos += cnt[e];
            n++;
        }
        act_off[n] = pos;
        grp[0] = n;
        n_act = n;
    }
    __syncthreads();
    /* each active expert's rows, in increasing r */
    for (int i = threadIdx.x; i < n_act; i += blockDim.x) {
        int e = act_e[i], p = act_off[i];

        for (int r = 0; r < Tk; r++)
            if (ida[r] == e)
                rows[p++] = r;
    }
}

/* v1: one block; dynamic shared memory (E + Tk) ints. */
static __global__ void
fm_group_kernel(int32_t *grp, const int32_t *ids, int Tk, int E, int A,
                const struct dsv4_expert_w *table, int skip_unheld)
{
    extern __shared__ int32_t fm_sm[];

    fm_group(grp, ids, Tk, E, A, table, skip_unheld, fm_sm);
}

/*
 * The warp's activation rows for slot rows p .. p + 8*NT - 1 (clamped to the
 * slot's last row): B rows xb[n] (slot row p + n*8 + g) and C scale rows
 * xs[n][j] (slot row p + n*8 + 2q + j), slot row j being row token(j)
 * (of_h = 0: x) or hrow(j) (of_h = 1: h) of `base` (row length K) and
 * `sbase` (K/128 scales per row).
 */
template <int NT>
static __device__ __forceinline__ void
fm_acts(const uint16_t *(&xb)[NT], const float *(&xs)[NT][2], const struct fm_slot &s, int p,
        int of_h, const uint16_t *base, const float *sbase, int K, int T, int k)
{
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;

#pragma unroll
    for (int n = 0; n < NT; n++) {
        int j = min(p + n * 8 + g, s.n - 1);

        xb[n] = base + (int64_t)(of_h ? fm_hrow(s, j, T, k) : fm_token(s, j, k)) * K;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            j = min(p + n * 8 + 2 * q + c, s.n - 1);
            xs[n][c] = sbase + (int64_t)(of_h ? fm_hrow(s, j, T, k) : fm_token(s, j, k)) *
                                   (K / 128);
        }
    }
}

/*
 * The epilogue of an up pass (rows p .. of slot s, 16 columns row0.. of h
 * per acc pair): h = bf16(silu(min(g, L)) * clamp(u, +-L) [* weight]) with
 * g, u the bf16-rounded outputs, the exact path's expression.
 */
template <int NT>
static __device__ __forceinline__ void
fm_up_store(float *h, const float (&acc)[2][NT][4], const struct fm_slot &s, int p, int row0,
            const float *weights, int T, int k, int I, float lim)
{
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;

#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int j = p + n * 8 + 2 * q + (i & 1), row = row0 + g + 8 * (i >> 1), hr;
            float v;

            if (j >= s.n)
                continue;
            v = cu_swiglu(acc[0][n][i], acc[1][n][i], lim);
            hr = fm_hrow(s, j, T, k);
            if (s.rows != NULL)
                v *= weights[hr];
            h[(int64_t)hr * I + row] = cu_bf16_round(v);
        }
}

/* The epilogue of a down pass: y[hrow, row0 + m*16 + ...] = bf16(acc). */
template <int NT>
static __device__ __forceinline__ void
fm_down_store(float *y, const float (&acc)[2][NT][4], const struct fm_slot &s, int p, int row0,
              int T, int k, int D)
{
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;

#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int j = p + n * 8 + 2 * q + (i & 1), row = row0 + m * 16 + g + 8 * (i >> 1);

                if (j < s.n)
                    y[(int64_t)fm_hrow(s, j, T, k) * D + row] = cu_bf16_round(acc[m][n][i]);
            }
}

/* --- v1: up w1, w3, SwiGLU; down w2 --------------------------------------------------- */

/*
 * The thread's weight rows of the two 16-row tiles m = 0, 1 (rows r0[m] +
 * g and + g + 8 of L[m], K columns): FP8 (ws[m] = the tile's 128x128 scale
 * row) or FP4 (ws[m][h] = the row's E8M0 group scales).
 */
static __device__ __forceinline__ void
fm_rows_fp8(const uint8_t *(&wr)[2][2], const uint8_t *(&ws)[2],
            const struct dsv4_linear *const (&L)[2], const int (&r0)[2], int K, int g)
{
#pragma unroll
    for (int m = 0; m < 2; m++) {
#pragma unroll
        for (int h = 0; h < 2; h++)
            wr[m][h] = (const uint8_t *)L[m]->w + (int64_t)(r0[m] + g + 8 * h) * K;
        ws[m] = L[m]->scale + (int64_t)(r0[m] / 128) * (K / 128);
    }
}

static __device__ __forceinline__ void
fm_rows_fp4(const uint8_t *(&wr)[2][2], const uint8_t *(&ws)[2][2],
            const struct dsv4_linear *const (&L)[2], const int (&r0)[2], int K, int g)
{
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = r0[m] + g + 8 * h;

            wr[m][h] = (const uint8_t *)L[m]->w + (int64_t)row * (K / 2);
            ws[m][h] = L[m]->scale + (int64_t)row * (K / 32);
        }
}

/*
 * acc += the two 16-row tiles m = 0, 1: rows r0[m] .. r0[m] + 15 of L[m]
 * (FP8 for the shared expert, sh; else FP4), over all of K = L[0]->n_in.
 */
template <int NT>
static __device__ __forceinline__ void
fm_tile(float (&acc)[2][NT][4], const struct dsv4_linear *const (&L)[2], const int (&r0)[2],
        int sh, const uint16_t *const (&xb)[NT], const float *const (&xs)[NT][2],
        const uint32_t *lut)
{
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4, K = L[0]->n_in, nb = K / 128;
    const uint8_t *wr[2][2];

    if (sh) {
        const uint8_t *ws[2];

        fm_rows_fp8(wr, ws, L, r0, K, g);
        fk_fp8<2, NT>(acc, wr, ws, xb, xs, 0, nb, q);
    } else {
        const uint8_t *ws[2][2];

        fm_rows_fp4(wr, ws, L, r0, K, g);
        fk_fp4<2, NT>(acc, wr, ws, xb, xs, 0, nb, q, lut);
    }
}

/* Rows p .. p + 8*NT - 1 of slot s through row tile `tile` (16 rows of I). */
template <int NT>
static __device__ __forceinline__ void
fm_up_pass(const struct fm2_args &a, const struct fm_slot &s, int p, int tile,
           const uint32_t *lut)
{
    int sh = s.rows == NULL, row0 = tile * 16;
    const uint16_t *xb[NT];
    const float *xs[NT][2];
    float acc[2][NT][4];

    fk_zero(acc);
    fm_acts<NT>(xb, xs, s, p, 0, sh ? a.xf : a.xp, a.xs, a.D, a.T, a.k);
    {
        const struct dsv4_linear *L[2] = { &s.E->w1, &s.E->w3 };
        const int r0[2] = { row0, row0 };

        fm_tile<NT>(acc, L, r0, sh, xb, xs, lut);
    }
    fm_up_store<NT>(a.h, acc, s, p, row0, a.weights, a.T, a.k, a.I, a.lim);
}

/* Rows p .. p + 8*NT - 1 of slot s through row tile `tile` (32 rows of D). */
template <int NT>
static __device__ __forceinline__ void
fm_down_pass(const struct fm2_args &a, const struct fm_slot &s, int p, int tile,
             const uint32_t *lut)
{
    int sh = s.rows == NULL, row0 = tile * 32;
    const uint16_t *xb[NT];
    const float *xs[NT][2];
    float acc[2][NT][4];

    fk_zero(acc);
    fm_acts<NT>(xb, xs, s, p, 1, sh ? a.hf : a.hp, a.hs, a.I, a.T, a.k);
    {
        const struct dsv4_linear *L[2] = { &s.E->w2, &s.E->w2 };
        const int r0[2] = { row0, row0 + 16 };

        fm_tile<NT>(acc, L, r0, sh, xb, xs, lut);
    }
    fm_down_store<NT>(a.y, acc, s, p, row0, a.T, a.k, a.D);
}

/* UP: w1/w3/SwiGLU, grid (I / 64, A + 1); else w2, grid (D / 128, A + 1). */
template <int UP>
static __global__ void __launch_bounds__(FM_THREADS)
fm_kernel(struct fm2_args a)
{
    __shared__ uint32_t lut[FK_LUT_WORDS];
    struct fm_slot s;
    int tile = blockIdx.x * FM_WARPS + threadIdx.x / 32;

    if (!fm_slot_get(a, &s))
        return;   /* idle slot: the whole block leaves */
    if (s.rows != NULL)
        fk_lut_fill(lut);
    for (int p = 0; p < s.n; p += 16) {
        if (UP && s.n - p <= 8)
            fm_up_pass<1>(a, s, p, tile, lut);
        else if (UP)
            fm_up_pass<2>(a, s, p, tile, lut);
        else if (s.n - p <= 8)
            fm_down_pass<1>(a, s, p, tile, lut);
        else
            fm_down_pass<2>(a, s, p, tile, lut);
    }
}

/* --- v2: one persistent kernel for up and down ----------------------------------------- */

/* Column c of a row -> its place in the activation order of the FP4 tiles:
 * inside each 8-column group, (0, 4, 1, 5, 2, 6, 3, 7). */
static __device__ __forceinline__ int
fm2_perm(int c)
{
    return (c & ~7) | (c & 3) << 1 | (c >> 2 & 1);
}

/*
 * REF quantization of one 128-column block held by a warp (v[i] = column
 * lane + 32 i), the expressions of fk_quant (fast_linear.cu) and of the
 * exact path: FP8 values written as bf16 at fm2_perm places of pb and/or as
 * f16 in column order to f16 (either may be NULL), the scale to *sp.
 */
static __device__ __forceinline__ void
fm2_quant_warp(const float (&v)[4], uint16_t *pb, uint16_t *f16, float *sp)
{
    int lane = threadIdx.x % 32;
    float amax = 1e-4f, s;

    for (int i = 0; i < 4; i++)
        amax = fmaxf(amax, fabsf(v[i]));
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    s = cu_pow2_scale(amax, 448.0f);
    for (int i = 0; i < 4; i++) {
        float qv = cu_fp8_to_f32(cu_f32_to_fp8(cu_clampf(v[i] / s, 448.0f)));
        int c = lane + 32 * i;

        if (f16 != NULL)
            f16[c] = __half_as_ushort(__float2half_rn(qv));
        if (pb != NULL)
            pb[fm2_perm(c)] = (uint16_t)(__float_as_uint(qv) >> 16);
    }
    if (lane == 0)
        *sp = s;
}

/*
 * Before fm2_kernel: block 0 groups the picks by expert (fm_group) and zeroes
 * the counters; the other blocks quantize x, a warp per (token, 128-column
 * block).  Dynamic shared memory: (E + Tk) ints (block 0).
 */
static __global__ void
fm2_prep_kernel(struct fm2_args a, const float *x, const int32_t *ids, int E,
                int skip_unheld, int n_ctr)
{
    extern __shared__ int32_t fm_sm[];
    int nb = a.D / 128;
    int64_t wid;
    float v[4];

    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < n_ctr; i += blockDim.x)
            a.ctr[i] = 0;
        fm_group((int32_t *)a.grp, ids, a.T * a.k, E, a.A, a.table, skip_unheld, fm_sm);
        return;
    }
    wid = (int64_t)(blockIdx.x - 1) * (blockDim.x / 32) + threadIdx.x / 32;
    if (wid >= (int64_t)a.T * nb)
        return;   /* whole warps */
    {
        int64_t t = wid / nb, b = wid % nb, at = t * a.D + b * 128;

        for (int i = 0; i < 4; i++)
            v[i] = x[at + threadIdx.x % 32 + 32 * i];
        fm2_quant_warp(v, a.xp + at, a.xf + at, a.xs + t * nb + b);
    }
}

/* The expert of work-item slot y: y = 0 is the shared expert when there is
 * one, then the active experts in increasing id order. */
static __device__ __forceinline__ void
fm2_slot_get(const struct fm2_args &a, int y, struct fm_slot *s)
{
    const int32_t *act_e = a.grp + 1, *act_off = a.grp + 1 + a.A;

    if (a.has_shared) {
        if (y == 0) {
            s->E = &a.shared;
            s->rows = NULL;
            s->n = a.T;
            return;
        }
        y--;
    }
    s->E = &a.table[act_e[y]];
    s->rows = a.grp + 2 + 2 * a.A + act_off[y];
    s->n = act_off[y + 1] - act_off[y];
}

/*
 * E2M1 codes -> bf16 pairs, by bit placement: code i of word w (bits
 * 4i..4i+3, sign e1 e0 m) goes to a bf16 with the sign at bit 15 and
 * (e1 e0 m) at bits 8..6 (the two low exponent bits and the top mantissa
 * bit), which is the code's value times 2^-126 (e = 0: the subnormal m *
 * 2^-127 = 0.5 m * 2^-126).  r[i] = (code i, code i + 4) in (low, high)
 * half, i = 0..3; the activations are laid out to match (fm2_perm).
 */
static __device__ __forceinline__ void
fm2_dec(uint32_t w, uint32_t (&r)[4])
{
    uint32_t x0 = w & 0x000f000fu, x1 = w & 0x00f000f0u;
    uint32_t x2 = w & 0x0f000f00u, x3 = w & 0xf000f000u;

    r[0] = ((x0 << 12) | (x0 << 6)) & 0x81c081c0u;
    r[1] = ((x1 << 8) | (x1 << 2)) & 0x81c081c0u;
    r[2] = ((x2 << 4) | (x2 >> 2)) & 0x81c081c0u;
    r[3] = (x3 | (x3 >> 6)) & 0x81c081c0u;
}

/* bf16 pairs that bring fm2_dec's values to code * 2^(s-127) for the E8M0
 * scale s: m1 = 2^(s-1) when s <= 128, else 2^127 and then m2 = 2^(s-128)
 * (NaN for s = 255); m2 = 1 when s <= 128.  Every product is exact. */
static __device__ __forceinline__ int
fm2_scale(uint32_t s, uint32_t *m1, uint32_t *m2)
{
    uint32_t a = s <= 128 ? (s + 126) << 7 : 0x7f00u;
    uint32_t b = s <= 128 ? 0x3f80u : s == 255 ? 0x7fc0u : (s - 1) << 7;

    *m1 = a | a << 16;
    *m2 = b | b << 16;
    return s > 128;
}

/* A weight scale byte, loaded in program order (see fk_ld_act's VOL). */
static __device__ __forceinline__ uint32_t
fm2_ld_u8(const uint8_t *p)
{
    uint32_t v;

    asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

/* The FP4 weight bytes of a 128-column block: w[m][h] = 16 bytes at pw[m][h]
 * + off (pw: row start + kb*64 + q*16; loads kept in place: fk_ld_wv). */
template <int MT>
static __device__ __forceinline__ void
fm2_fp4_load(uint4 (&w)[MT][2], const uint8_t *const (&pw)[MT][2], int off)
{
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            w[m][h] = fk_ld_wv(pw[m][h] + off);
}

/*
 * One 128-column block kb of FP4 weights already loaded (the arguments of
 * fk_fp4, as running pointers: ps[m][h] + so = the block's scale byte of
 * thread q, px[n] + xo = its 32 activations, in fm2_perm order; COH:
 * fk_ld_act).  Thread q's 32 columns (one scale group) are 4 words; word j
 * holds columns c..c+7, c = kb*128 + q*32 + j*8, decoded to (c, c+4),
 * (c+1, c+5), (c+2, c+6), (c+3, c+7): the A pairs of two mma steps, and the
 * 16 activation bytes at c (fm2_perm order) are the matching B pairs in the
 * same order.
 */
template <int MT, int NT, int COH>
static __device__ __forceinline__ void
fm2_fp4_kb(float (&acc)[MT][NT][4], const uint4 (&w)[MT][2], const uint8_t *const (&ps)[MT][2],
           int so, const uint16_t *const (&px)[NT], int xo, const float *const (&xs)[NT][2],
           int kb)
{
    uint32_t m1[MT][2], m2[MT][2];
    float blk[MT][NT][4];
    int big = 0;

#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            big |= fm2_scale(fm2_ld_u8(ps[m][h] + so), &m1[m][h], &m2[m][h]);
    big = __any_sync(0xffffffffu, big);
    fk_zero(blk);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint4 x[NT];

#pragma unroll
        for (int n = 0; n < NT; n++)
            x[n] = fk_ld_act<COH, 1>(px[n] + xo + j * 8);
#pragma unroll
        for (int m = 0; m < MT; m++) {
            uint32_t r0[4], r8[4];

            fm2_dec(fk_word(w[m][0], j), r0);
            fm2_dec(fk_word(w[m][1], j), r8);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                r0[i] = fk_bmul2(r0[i], m1[m][0]);
                r8[i] = fk_bmul2(r8[i], m1[m][1]);
            }
            if (big) {   /* scales above 2^1: a second exact step */
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    r0[i] = fk_bmul2(r0[i], m2[m][0]);
                    r8[i] = fk_bmul2(r8[i], m2[m][1]);
                }
            }
#pragma unroll
            for (int n = 0; n < NT; n++) {
                fk_mma_bf16(blk[m][n], r0[0], r8[0], r0[1], r8[1], x[n].x, x[n].y);
                fk_mma_bf16(blk[m][n], r0[2], r8[2], r0[3], r8[3], x[n].z, x[n].w);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; m++)
        fk_add_scaled<NT, COH>(acc[m], blk[m], xs, kb, 1.0f);
}

/* acc += FP4 blocks kb0 .. kb1-1, weights loaded PF - 1 blocks ahead; the
 * pointers advance by PF blocks per round so that the stages' offsets are
 * constants. */
template <int MT, int NT, int PF, int COH>
static __device__ __forceinline__ void
fm2_fp4(float (&acc)[MT][NT][4], const uint8_t *const (&wr)[MT][2],
        const uint8_t *const (&ws)[MT][2], const uint16_t *const (&xb)[NT],
        const float *const (&xs)[NT][2], int kb0, int kb1, int q)
{
    uint4 w[PF][MT][2];
    const uint8_t *pw[MT][2], *ps[MT][2];
    const uint16_t *px[NT];

#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            pw[m][h] = wr[m][h] + (int64_t)kb0 * 64 + q * 16;
            ps[m][h] = ws[m][h] + kb0 * 4 + q;
        }
#pragma unroll
    for (int n = 0; n < NT; n++)
        px[n] = xb[n] + (int64_t)kb0 * 128 + q * 32;
#pragma unroll
    for (int p = 0; p < PF - 1; p++)
        if (kb0 + p < kb1)
            fm2_fp4_load<MT>(w[p], pw, p * 64);
    for (int kb = kb0; kb < kb1; kb += PF) {
#pragma unroll
        for (int p = 0; p < PF; p++) {
            if (kb + p + PF - 1 < kb1)
                fm2_fp4_load<MT>(w[(p + PF - 1) % PF], pw, (p + PF - 1) * 64);
            if (kb + p < kb1)
                fm2_fp4_kb<MT, NT, COH>(acc, w[p], ps, p * 4, px, p * 128, xs, kb + p);
        }
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                pw[m][h] += PF * 64;
                ps[m][h] += PF * 4;
            }
#pragma unroll
        for (int n = 0; n < NT; n++)
            px[n] += PF * 128;
    }
}

/* acc += FP8 blocks kb0 .. kb1-1 (fk_fp8 on f16 activations), weights
 * loaded one block ahead. */
template <int MT, int NT, int COH>
static __device__ __forceinline__ void
fm2_fp8(float (&acc)[MT][NT][4], const uint8_t *const (&wr)[MT][2],
        const uint8_t *const (&ws)[MT], const uint16_t *const (&xb)[NT],
        const float *const (&xs)[NT][2], int kb0, int kb1, int q)
{
    uint4 w[2][MT][2][2];

    if (kb0 < kb1)
        fk_fp8_load<MT, 1>(w[0], wr, kb0, q);
    for (int kb = kb0; kb < kb1; kb += 2) {
        if (kb + 1 < kb1)
            fk_fp8_load<MT, 1>(w[1], wr, kb + 1, q);
        fk_fp8_kb<MT, NT, 0, COH, 1>(acc, w[0], ws, xb, xs, kb, q);
        if (kb + 2 < kb1)
            fk_fp8_load<MT, 1>(w[0], wr, kb + 2, q);
        if (kb + 1 < kb1)
            fk_fp8_kb<MT, NT, 0, COH, 1>(acc, w[1], ws, xb, xs, kb + 1, q);
    }
}

/*
 * acc of the ks K slices of a row tile -> slice 0's acc, added in slice
 * order through red ([W][2][NT][4][32] floats).  Every warp of the block
 * calls it (barriers).
 */
template <int NT>
static __device__ __forceinline__ void
fm2_reduce(float (&acc)[2][NT][4], int ks, float *red)
{
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    if (ks == 1)
        return;
    __syncthreads();   /* the previous pass's readers are done */
    if (warp % ks != 0)
#pragma unroll
        for (int v = 0; v < 2 * NT * 4; v++)
            red[(warp * 2 * NT * 4 + v) * 32 + lane] = (&acc[0][0][0])[v];
    __syncthreads();
    if (warp % ks == 0)
        for (int sl = 1; sl < ks; sl++)
#pragma unroll
            for (int v = 0; v < 2 * NT * 4; v++)
                (&acc[0][0][0])[v] += red[((warp + sl) * 2 * NT * 4 + v) * 32 + lane];
}

/*
 * Rows p .. p + 8*NT - 1 of slot s through the warp's piece of an item:
 * 16 rows row0.. of w1 and of w3 (UP), or 32 rows row0.. of w2, over the
 * 128-column blocks kb0 .. kb1-1 of its K slice; then the slices are added
 * and slice 0 stores h (UP) or y.  SH: the shared expert (FP8), else a
 * routed one (FP4).
 */
template <int UP, int SH, int NT, int PF>
static __device__ __forceinline__ void
fm2_pass(const struct fm2_args &a, const struct fm_slot &s, int p, int row0, int kb0, int kb1,
         float *red)
{
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int K = UP ? a.D : a.I;
    const struct dsv4_linear *L[2] = { UP ? &s.E->w1 : &s.E->w2, UP ? &s.E->w3 : &s.E->w2 };
    const int r0[2] = { row0, UP ? row0 : row0 + 16 };
    const uint16_t *xb[NT];
    const float *xs[NT][2];
    const uint8_t *wr[2][2];
    float acc[2][NT][4];

    fk_zero(acc);
    if (UP)
        fm_acts<NT>(xb, xs, s, p, 0, SH ? a.xf : a.xp, a.xs, K, a.T, a.k);
    else
        fm_acts<NT>(xb, xs, s, p, 1, SH ? a.hf : a.hp, a.hs, K, a.T, a.k);
    if (SH) {
        const uint8_t *ws[2];

        fm_rows_fp8(wr, ws, L, r0, K, g);
        fm2_fp8<2, NT, !UP>(acc, wr, ws, xb, xs, kb0, kb1, q);
    } else {
        const uint8_t *ws[2][2];

        fm_rows_fp4(wr, ws, L, r0, K, g);
        fm2_fp4<2, NT, PF, !UP>(acc, wr, ws, xb, xs, kb0, kb1, q);
    }
    fm2_reduce<NT>(acc, a.ks, red);
    if (threadIdx.x / 32 % a.ks != 0)
        return;
    if (UP)
        fm_up_store<NT>(a.h, acc, s, p, row0, a.weights, a.T, a.k, a.I, a.lim);
    else
        fm_down_store<NT>(a.y, acc, s, p, row0, a.T, a.k, a.D);
}

/*
 * Every pass of 8 rows of slot s (SH: the shared expert) through the warp's
 * piece of an item.  One n-tile (8 token rows) per pass: with 16 (two
 * n-tiles) the kernel needed more than 255 registers and spilled; a slot
 * of more than 8 rows (the shared expert at T > 8) reads its item's weights
 * once per 8 rows, the later passes from L2.
 */
template <int UP, int SH, int PF>
static __device__ __forceinline__ void
fm2_passes(const struct fm2_args &a, const struct fm_slot &s, int row0, int kb0, int kb1,
           float *red)
{
    for (int p = 0; p < s.n; p += 8)
        fm2_pass<UP, SH, 1, PF>(a, s, p, row0, kb0, kb1, red);
}

/* Load with acquire semantics at GPU scope (the flag of fm2_kernel's h). */
static __device__ __forceinline__ int
fm2_ld_acquire(const int32_t *p)
{
    int v;

    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/*
 * Up item (y, ut): slot y, h columns ut*16*tiles ..; then, when it is the
 * last item of its 128-column h block, that block is quantized for the
 * slot's rows and the slot's count of quantized blocks goes up.
 */
template <int W, int PF>
static __device__ void
fm2_up(const struct fm2_args &a, int y, int ut, float *red, int *s_last)
{
    struct fm_slot s;
    int warp = threadIdx.x / 32, ks = a.ks, tiles = W / ks, nkb = a.D / 128;
    int NB = a.I / 128, blk = ut * 16 * tiles / 128;
    int32_t *cnt = a.ctr + 1 + y * NB + blk, *done = a.ctr + 1 + (a.A + 1) * NB + y;

    fm2_slot_get(a, y, &s);
    if (s.rows == NULL)
        fm2_passes<1, 1, PF>(a, s, (ut * tiles + warp / ks) * 16, warp % ks * nkb / ks,
                             (warp % ks + 1) * nkb / ks, red);
    else
        fm2_passes<1, 0, PF>(a, s, (ut * tiles + warp / ks) * 16, warp % ks * nkb / ks,
                             (warp % ks + 1) * nkb / ks, red);
    __threadfence();   /* this thread's h, before the count (release) */
    __syncthreads();
    if (threadIdx.x == 0) {
        int last = atomicAdd(cnt, 1) == 128 / (16 * tiles) - 1;

        if (last)
            __threadfence();   /* acquire the other items' h */
        *s_last = last;
    }
    __syncthreads();
    if (!*s_last)
        return;
    for (int j = warp; j < s.n; j += W) {
        int64_t hr = fm_hrow(s, j, a.T, a.k), at = hr * a.I + blk * 128;
        float v[4];

        for (int i = 0; i < 4; i++)
            v[i] = __ldcg(a.h + at + threadIdx.x % 32 + 32 * i);
        fm2_quant_warp(v, s.rows != NULL ? a.hp + at : NULL, s.rows != NULL ? NULL : a.hf + at,
                       a.hs + hr * NB + blk);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        atomicAdd(done, 1);
}

/* Down item (y, dt): slot y, rows dt*32*tiles .. of w2, once h is there. */
template <int W, int PF>
static __device__ void
fm2_down(const struct fm2_args &a, int y, int dt, float *red)
{
    struct fm_slot s;
    int warp = threadIdx.x / 32, ks = a.ks, tiles = W / ks, nkb = a.I / 128;
    const int32_t *done = a.ctr + 1 + (a.A + 1) * (a.I / 128) + y;

    fm2_slot_get(a, y, &s);
    if (threadIdx.x == 0)
        while (fm2_ld_acquire(done) < a.I / 128)
            __nanosleep(128);
    __syncthreads();
    if (s.rows == NULL)
        fm2_passes<0, 1, PF>(a, s, (dt * tiles + warp / ks) * 32, warp % ks * nkb / ks,
                             (warp % ks + 1) * nkb / ks, red);
    else
        fm2_passes<0, 0, PF>(a, s, (dt * tiles + warp / ks) * 32, warp % ks * nkb / ks,
                             (warp % ks + 1) * nkb / ks, red);
}

/*
 * The persistent kernel: W warps per block = W/ks row tiles x ks K slices.
 * Work items, handed out in this order by an atomic counter: up items
 * (slot, 16*W/ks columns of h), slot-major, then down items (slot,
 * 32*W/ks rows of y).  A down item waits until its slot's h is quantized;
 * every item it can wait for was handed out before it, to a block that is
 * running, so the wait ends whatever the number of resident blocks.  Each
 * output is computed by one item in a fixed order: the results do not
 * depend on which block took which item.
 */
template <int W, int PF>
static __global__ void __launch_bounds__(W * 32)
fm2_kernel(struct fm2_args a)
{
    __shared__ float red[W * 2 * 4 * 32];   /* fm2_reduce, NT = 1 */
    __shared__ int s_item, s_last;
    int tiles = W / a.ks, UT = a.I / (16 * tiles), DT = a.D / (32 * tiles);
    int n_slots = __ldg(a.grp) + a.has_shared, n_up = n_slots * UT;
    int total = n_slots * (UT + DT), it, nxt = 0;

    if (threadIdx.x == 0)
        s_item = atomicAdd(a.ctr, 1);
    __syncthreads();
    it = s_item;
    while (it < total) {
        __syncthreads();   /* every thread has read s_item */
        if (threadIdx.x == 0)
            nxt = atomicAdd(a.ctr, 1);   /* the next item, fetched during this one */
        if (it < n_up)
            fm2_up<W, PF>(a, it / UT, it % UT, red, &s_last);
        else
            fm2_down<W, PF>(a, (it - n_up) / DT, (it - n_up) % DT, red);
        if (threadIdx.x == 0)
            s_item = nxt;
        __syncthreads();
        it = s_item;
    }
}

/* --- host side ------------------------------------------------------------------------------ */

static int
fm_lin_ok(const struct dsv4_linear *W, enum dsv4_wfmt fmt, int n_out, int n_in)
{
    return W->fmt == fmt && W->n_out == n_out && W->n_in == n_in && W->w != NULL &&
           W->scale != NULL && (uintptr_t)W->w % 16 == 0;
}

static int
fm_expert_ok(const struct dsv4_expert_w *w, enum dsv4_wfmt fmt, int D, int I)
{
    return fm_lin_ok(&w->w1, fmt, I, D) && fm_lin_ok(&w->w3, fmt, I, D) &&
           fm_lin_ok(&w->w2, fmt, D, I);
}

int
cuda_fast_moe_ok(const struct dsv4_backend *be, const struct dsv4_expert_w *experts, int n,
                 const struct dsv4_expert_w *shared, int T, int k, int D, int I, int parts)
{
    if (be->numerics != DSV4_NUMERICS_REF || T < 1 || !cuda_fast_moe_takes(T, k, D, I) ||
        k < 1 || k > FM_MAX_K || n < 1 || n > FM_MAX_E || D % 128 != 0 || I % 128 != 0)
        return 0;
    if (shared == NULL ? !parts : !fm_expert_ok(shared, DSV4_WFMT_FP8, D, I))
        return 0;
    for (int e = 0; e < n; e++)
        if (!(parts && experts[e].w1.w == NULL) &&
            !fm_expert_ok(&experts[e], DSV4_WFMT_FP4, D, I))
            return 0;
    return 1;
}

#define FM_SPLIT_DEFAULT 256       /* cuda_fast_moe_takes: T the decode MoE takes */

int
cuda_fast_moe_takes(int T, int k, int D, int I)
{
    const char *v = getenv("DSV4_CUDA_MOE_SPLIT"), *m = getenv("DSV4_CUDA_FAST_MOE");
    int split = v != NULL ? atoi(v) : FM_SPLIT_DEFAULT;
    int v35 = m == NULL || strncmp(m, "v3", 2) == 0 || strncmp(m, "v5", 2) == 0;

    if (T <= FM_MAX_T)
        return 1;
    return v35 && T <= split && cuda_fast_moe3_fits(T, k, D, I);
}

/* The arrays of one call, carved from the backend scratch (v1 and v2). */
struct fm_bufs {
    int32_t *grp;           /* fm_group's output */
    int32_t *ctr;           /* n_ctr counters (v2) */
    uint16_t *x0, *x1;      /* (T, D) 16-bit FP8 values of x, two layouts */
    float *xs;              /* (T, D/128) */
    float *h;               /* (R, I), R = T*k + T */
    uint16_t *h0, *h1;      /* (R, I) as x0, x1 */
    float *hs;              /* (R, I/128) */
    float *y;               /* (R, D); parts when parts != NULL */
};

static enum dsv4_err
fm_bufs_get(struct dsv4_backend *be, struct fm_bufs *b, float *parts, int T, int k, int A,
            int D, int I, int n_ctr)
{
    int Tk = T * k, R = Tk + T;
    size_t b_grp = cuda_align((size_t)(2 + 2 * A + Tk) * sizeof(int32_t));
    size_t b_ctr = cuda_align((size_t)n_ctr * sizeof(int32_t));
    size_t b_x = cuda_align((size_t)T * D * sizeof(uint16_t));
    size_t b_xs = cuda_align((size_t)T * (D / 128) * sizeof(float));
    size_t b_h = cuda_align((size_t)R * I * sizeof(float));
    size_t b_h16 = cuda_align((size_t)R * I * sizeof(uint16_t));
    size_t b_hs = cuda_align((size_t)R * (I / 128) * sizeof(float));
    size_t b_y = parts != NULL ? 0 : cuda_align((size_t)R * D * sizeof(float));
    char *p = (char *)cuda_scratch(be, b_grp + b_ctr + 2 * b_x + b_xs + b_h + 2 * b_h16 +
                                           b_hs + b_y);

    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast moe: no scratch (T=%d k=%d)", T, k);
    b->grp = (int32_t *)p;
    b->ctr = (int32_t *)(p + b_grp);
    p += b_grp + b_ctr;
    b->x0 = (uint16_t *)p;
    b->x1 = (uint16_t *)(p + b_x);
    b->xs = (float *)(p + 2 * b_x);
    p += 2 * b_x + b_xs;
    b->h = (float *)p;
    b->h0 = (uint16_t *)(p + b_h);
    b->h1 = (uint16_t *)(p + b_h + b_h16);
    b->hs = (float *)(p + b_h + 2 * b_h16);
    p += b_h + 2 * b_h16 + b_hs;
    b->y = parts != NULL ? parts : (float *)p;
    return DSV4_OK;
}

/* The kernels' arguments for one call over the arrays b (x0, h0: the bf16
 * layouts; x1, h1: f16). */
static void
fm_args_fill(struct fm2_args *a, const struct fm_bufs *b, const struct dsv4_expert_w *table,
             const struct dsv4_expert_w *shared, const float *weights, int A, int T, int k,
             int D, int I, float lim)
{
    memset(a, 0, sizeof(*a));
    a->table = table;
    if (shared != NULL)
        a->shared = *shared;
    a->has_shared = shared != NULL;
    a->grp = b->grp;
    a->A = A;
    a->ctr = b->ctr;
    a->xp = b->x0;
    a->xf = b->x1;
    a->xs = b->xs;
    a->h = b->h;
    a->hp = b->h0;
    a->hf = b->h1;
    a->hs = b->hs;
    a->y = b->y;
    a->weights = weights;
    a->T = T;
    a->k = k;
    a->D = D;
    a->I = I;
    a->lim = lim;
}

/* v1: x quantization, grouping, up, h quantization, down, combine. */
static enum dsv4_err
fm1_run(struct dsv4_backend *be, float *out, float *parts, const float *x, const int32_t *ids,
        const float *weights, const struct dsv4_expert_w *table, int n_table,
        const struct dsv4_expert_w *shared, int T, int k, int D, int I, float lim)
{
    cudaStream_t st = cuda_stream(be);
    int Tk = T * k, A = Tk < n_table ? Tk : n_table, R = Tk + T;
    struct fm_bufs b = {};   /* every field set by fm_bufs_get on success */
    struct fm2_args a;
    enum dsv4_err e;

    e = fm_bufs_get(be, &b, parts, T, k, A, D, I, 0);
    if (e != DSV4_OK)
        return e;
    fm_args_fill(&a, &b, table, shared, weights, A, T, k, D, I, lim);

    e = fk_quant(be, a.xf, a.xp, a.xs, x, D, T, D);
    if (e != DSV4_OK)
        return e;
    fm_group_kernel<<<1, 256, (size_t)(n_table + Tk) * sizeof(int32_t), st>>>(
        b.grp, ids, Tk, n_table, A, table, parts != NULL);
    CUDA_LAUNCHED("fast moe group");
    fm_kernel<1><<<dim3((unsigned)(I / 64), (unsigned)(A + 1)), FM_THREADS, 0, st>>>(a);
    CUDA_LAUNCHED("fast moe up");
    e = fk_quant(be, a.hf, a.hp, a.hs, a.h, I, R, I);
    if (e != DSV4_OK)
        return e;
    fm_kernel<0><<<dim3((unsigned)(D / 128), (unsigned)(A + 1)), FM_THREADS, 0, st>>>(a);
    CUDA_LAUNCHED("fast moe down");
    if (parts != NULL)
        return DSV4_OK;   /* moe_parts: the caller sums the ranks' parts, then combines */
    return cuda_moe_combine(be, out, a.y, ids, T, k, D);   /* the exact path's step 5 */
}

/* fm2 configuration (DSV4_CUDA_FAST_MOE, docs/gpu.md "The decode MoE kernel"). */
struct fm2_cfg {
    int v1;     /* the previous kernels (fm_kernel) instead */
    int v3;     /* fast_moe3.cu (DSV4_CUDA_FAST_MOE "v3", "v3,NS,RT", "v5") */
    int W;      /* warps per block: 4 or 8 */
    int ks;     /* K slices per item: 1, 2 or 4 (W % ks == 0) */
    int PF;     /* FP4 weight blocks in flight per warp: 2 or 4 */
    int cps;    /* blocks per SM at most (0: as many as fit) */
};

#define FM2_DEFAULT "4,2,4,0"

/*
 * DSV4_CUDA_FAST_MOE: "v3..." or "v5" (fast_moe3.cu; v3 also when unset: the default
 * since bench_fast on the H200, 2026-11-30, 0.45 of 4.3 TB/s at T = 16
 * against v1's 0.42, 0.35 against 0.29 at T = 1), "v1", "v2" (v2 with
 * FM2_DEFAULT) or "W,KS,PF,CPS" (v2 with those settings); read at every
 * call (the benchmark sweeps it).  Anything else is v1.
 */
static void
fm2_cfg_get(struct fm2_cfg *c)
{
    const char *v = getenv("DSV4_CUDA_FAST_MOE");
    int W, ks, PF, cps;

    memset(c, 0, sizeof(*c));
    if (v == NULL || strncmp(v, "v3", 2) == 0 || strncmp(v, "v5", 2) == 0) {
        c->v3 = 1;
        return;
    }
    if (v != NULL && strcmp(v, "v2") == 0)
        (void)sscanf(FM2_DEFAULT, "%d,%d,%d,%d", &W, &ks, &PF, &cps);
    else if (v == NULL || sscanf(v, "%d,%d,%d,%d", &W, &ks, &PF, &cps) != 4 ||
             (W != 4 && W != 8) || (ks != 1 && ks != 2 && ks != 4) || (PF != 2 && PF != 4) ||
             cps < 0) {
        c->v1 = 1;
        return;
    }
    c->W = W;
    c->ks = ks;
    c->PF = PF;
    c->cps = cps;
}

/* fm2_kernel<W, PF>'s resident blocks per SM (computed once). */
template <int W, int PF>
static int
fm2_occupancy(void)
{
    static int occ;

    if (occ == 0 &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fm2_kernel<W, PF>, W * 32, 0) !=
            cudaSuccess)
        occ = 1;
    return occ > 0 ? occ : 1;
}

template <int W, int PF>
static enum dsv4_err
fm2_launch(struct dsv4_backend *be, const struct fm2_args &a, int cps)
{
    int n_sm = cuda_sms(be), per = fm2_occupancy<W, PF>();

    if (cps > 0 && cps < per)
        per = cps;
    fm2_kernel<W, PF><<<n_sm * per, W * 32, 0, cuda_stream(be)>>>(a);
    CUDA_LAUNCHED("fast moe (fm2)");
    return DSV4_OK;
}

/* v2: fm2_prep_kernel, fm2_kernel, combine (moe only). */
static enum dsv4_err
fm2_run(struct dsv4_backend *be, float *out, float *parts, const float *x, const int32_t *ids,
        const float *weights, const struct dsv4_expert_w *table, int n_table,
        const struct dsv4_expert_w *shared, int T, int k, int D, int I, float lim,
        const struct fm2_cfg *c)
{
    cudaStream_t st = cuda_stream(be);
    int Tk = T * k, A = Tk < n_table ? Tk : n_table, NB = I / 128;
    int n_ctr = 1 + (A + 1) * (NB + 1), warps = T * (D / 128);
    struct fm_bufs b = {};   /* every field set by fm_bufs_get on success */
    struct fm2_args a;
    enum dsv4_err e;

    e = fm_bufs_get(be, &b, parts, T, k, A, D, I, n_ctr);
    if (e != DSV4_OK)
        return e;
    fm_args_fill(&a, &b, table, shared, weights, A, T, k, D, I, lim);
    a.ks = c->ks;

    fm2_prep_kernel<<<1 + (warps + 7) / 8, 256, (size_t)(n_table + Tk) * sizeof(int32_t),
                      st>>>(a, x, ids, n_table, parts != NULL, n_ctr);
    CUDA_LAUNCHED("fast moe prep");
    switch (c->W * 10 + c->PF) {
    case 42:
        e = fm2_launch<4, 2>(be, a, c->cps);
        break;
    case 44:
        e = fm2_launch<4, 4>(be, a, c->cps);
        break;
    case 82:
        e = fm2_launch<8, 2>(be, a, c->cps);
        break;
    default:
        e = fm2_launch<8, 4>(be, a, c->cps);
        break;
    }
    if (e != DSV4_OK || parts != NULL)
        return e;   /* moe_parts: the caller sums the ranks' parts, then combines */
    return cuda_moe_combine(be, out, a.y, ids, T, k, D);   /* the exact path's step 5 */
}

enum dsv4_err
cuda_fast_moe(struct dsv4_backend *be, float *out, float *parts, const float *x,
              const int32_t *ids,
              const float *weights, const struct dsv4_expert_w *table, int n_table,
              const struct dsv4_expert_w *shared, int T, int k, int D, int I, float lim)
{
    struct fm2_cfg c;
    int tiles;

    fm2_cfg_get(&c);
    if (c.v3 && cuda_fast_moe3_fits(T, k, D, I))
        return cuda_fast_moe3(be, out, parts, x, ids, weights, table, n_table, shared, T, k, D,
                              I, lim, getenv("DSV4_CUDA_FAST_MOE"));
    if (c.v3)
        c.v1 = 1;   /* shapes v3 does not take */
    tiles = c.v1 ? 0 : c.W / c.ks;
    /* fm2's item shapes: K slices of whole 128-column blocks, h blocks of
     * whole items, y rows of whole items (else v1) */
    if (c.v1 || (D / 128) % c.ks != 0 || (I / 128) % c.ks != 0 || I % (16 * tiles) != 0 ||
        D % (32 * tiles) != 0)
        return fm1_run(be, out, parts, x, ids, weights, table, n_table, shared, T, k, D, I,
                       lim);
    return fm2_run(be, out, parts, x, ids, weights, table, n_table, shared, T, k, D, I, lim,
                   &c);
}
