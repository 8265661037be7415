/*
 * fast_moe.cu — the fast routed + shared MoE for decode (T <= FM_MAX_T token
 * rows, REF numerics, FP4 routed experts, an FP8 shared expert), through the
 * warp tiles of fast.cuh.  Used by cuda_moe when dsv4_cuda_set_kernels(be, 1)
 * was called and cuda_fast_moe_ok() agrees.  No host synchronisation, no
 * host copy: the op can be recorded in a CUDA graph.
 *
 * Steps of one call (all on the backend's stream):
 *   1. x quantized per row per 128 columns (the exact path's codes), kept as
 *      f16 (shared expert) and bf16 (routed experts) values + scales;
 *   2. grouping (one block): the (token, pick) rows r = t*k + j are grouped
 *      by expert id (clamped into the table, as the exact path does): the
 *      active experts in increasing id order with their rows in increasing
 *      r, in a small device array;
 *   3. up: grid (I/64, A+1) with A = min(T*k, E) expert slots plus the
 *      shared slot; slot y < n_active takes the y-th active expert, slots
 *      beyond n_active leave at once; a warp takes 16 rows of w1 and the
 *      same 16 rows of w3 (one pass over K reads both and shares the
 *      activations), for all of the expert's rows in passes of 16; then
 *      h = bf16(silu(min(g, L)) * clamp(u, ±L) * route weight) with g, u the
 *      bf16-rounded outputs, exactly the exact path's expression;
 *   4. h quantized per row (REF), f16 and bf16 values;
 *   5. down: grid (D/128, A+1), a warp takes 32 rows of w2;
 *      y[row] = bf16(w2 · h[row]);
 *   6. out[t] = bf16(Σ picks in increasing expert id order (stable), then
 *      + the shared row), in fp32, the op contract's order: the exact path's
 *      own combine (cuda_moe_combine), on the same (T*k + T, D) layout.
 * Weights are read once per pass of 16 rows of an expert: once per step
 * when no expert gets more than 16 rows.
 */
#include "kernels/cuda/fast.cuh"

#include <string.h>

#define FM_MAX_T 96                /* token rows per call */
#define FM_MAX_E 4096              /* experts in the table (grouping in shared memory) */
#define FM_WARPS 4                 /* warps per block, up and down */
#define FM_THREADS (FM_WARPS * 32)
#define FM_MAX_K 64                /* picks per token (the exact path's bound) */

/* Everything the up/down kernels need, by value. */
struct fm_args {
    const struct dsv4_expert_w *table;  /* device copy of the expert array */
    struct dsv4_expert_w shared;        /* shared expert (device pointers) */
    int has_shared;
    const int32_t *grp;     /* grouping: n_act, act_e[A], act_off[A+1], rows[T*k] */
    int A;                  /* routed slots (grid.y - 1) */
    const uint16_t *xf, *xb;   /* (T, D) f16 / bf16 FP8 values of x */
    const float *xs;           /* (T, D/128) */
    float *h;                  /* (R, I), R = T*k + T */
    const uint16_t *hf, *hb;   /* (R, I) f16 / bf16 FP8 values of h */
    const float *hs;           /* (R, I/128) */
    float *y;                  /* (R, D) */
    const float *weights;      /* (T, k) */
    int T, k, D, I;
    float lim;
};

/* The expert slot of this block. */
struct fm_slot {
    const struct dsv4_expert_w *E;
    const int32_t *rows;    /* pick rows (routed), NULL for the shared slot */
    int n;                  /* rows of this slot */
};

static __device__ __forceinline__ int
fm_slot_get(const struct fm_args &a, struct fm_slot *s)
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

/* Slot row j -> token (row of x) and row of h / y. */
static __device__ __forceinline__ int
fm_token(const struct fm_args &a, const struct fm_slot &s, int j)
{
    return s.rows != NULL ? s.rows[j] / a.k : j;
}

static __device__ __forceinline__ int
fm_hrow(const struct fm_args &a, const struct fm_slot &s, int j)
{
    return s.rows != NULL ? s.rows[j] : a.T * a.k + j;
}

/* --- grouping ------------------------------------------------------------------------- */

/* One block; dynamic shared memory (E + Tk) ints.  skip_unheld: experts of
 * the table without weights (moe_parts: held by another rank) are left out. */
static __global__ void
fm_group_kernel(int32_t *grp, const int32_t *ids, int Tk, int E, int A,
                const struct dsv4_expert_w *table, int skip_unheld)
{
    extern __shared__ int32_t fm_sm[];
    __shared__ int32_t n_act;
    int32_t *cnt = fm_sm, *ida = fm_sm + E;
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

/* --- up: w1, w3, SwiGLU ---------------------------------------------------------------- */

/*
 * The warp's activation rows for slot rows p .. p + 8*NT - 1 (clamped to the
 * slot's last row): B rows xb[n] (slot row p + n*8 + g) and C scale rows
 * xs[n][j] (slot row p + n*8 + 2q + j), slot row j being row token(j)
 * (of_h = 0: x) or hrow(j) (of_h = 1: h) of `base` (row length K) and
 * `sbase` (K/128 scales per row).
 */
template <int NT>
static __device__ __forceinline__ void
fm_acts(const uint16_t *(&xb)[NT], const float *(&xs)[NT][2], const struct fm_args &a,
        const struct fm_slot &s, int p, int of_h, const uint16_t *base, const float *sbase,
        int K)
{
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;

#pragma unroll
    for (int n = 0; n < NT; n++) {
        int j = min(p + n * 8 + g, s.n - 1);

        xb[n] = base + (int64_t)(of_h ? fm_hrow(a, s, j) : fm_token(a, s, j)) * K;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            j = min(p + n * 8 + 2 * q + c, s.n - 1);
            xs[n][c] = sbase + (int64_t)(of_h ? fm_hrow(a, s, j) : fm_token(a, s, j)) * (K / 128);
        }
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

#pragma unroll
        for (int m = 0; m < 2; m++) {
#pragma unroll
            for (int h = 0; h < 2; h++)
                wr[m][h] = (const uint8_t *)L[m]->w + (int64_t)(r0[m] + g + 8 * h) * K;
            ws[m] = L[m]->scale + (int64_t)(r0[m] / 128) * nb;
        }
        fk_fp8<2, NT>(acc, wr, ws, xb, xs, 0, nb, q);
    } else {
        const uint8_t *ws[2][2];

#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = r0[m] + g + 8 * h;

                wr[m][h] = (const uint8_t *)L[m]->w + (int64_t)row * (K / 2);
                ws[m][h] = L[m]->scale + (int64_t)row * (K / 32);
            }
        fk_fp4<2, NT>(acc, wr, ws, xb, xs, 0, nb, q, lut);
    }
}

/* Rows p .. p + 8*NT - 1 of slot s through row tile `tile` (16 rows of I). */
template <int NT>
static __device__ __forceinline__ void
fm_up_pass(const struct fm_args &a, const struct fm_slot &s, int p, int tile,
           const uint32_t *lut)
{
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int sh = s.rows == NULL, D = a.D, row0 = tile * 16;
    const uint16_t *xb[NT];
    const float *xs[NT][2];
    float acc[2][NT][4];

    fk_zero(acc);
    fm_acts<NT>(xb, xs, a, s, p, 0, sh ? a.xf : a.xb, a.xs, D);
    {
        const struct dsv4_linear *L[2] = { &s.E->w1, &s.E->w3 };
        const int r0[2] = { row0, row0 };

        fm_tile<NT>(acc, L, r0, sh, xb, xs, lut);
    }
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int j = p + n * 8 + 2 * q + (i & 1), row = row0 + g + 8 * (i >> 1), hr;
            float gv, uv, v;

            if (j >= s.n)
                continue;
            gv = cu_bf16_round(acc[0][n][i]);
            uv = cu_bf16_round(acc[1][n][i]);
            if (a.lim > 0.0f) {
                gv = gv < a.lim ? gv : a.lim;
                uv = uv < -a.lim ? -a.lim : uv > a.lim ? a.lim : uv;
            }
            v = gv / (1.0f + cu_expf(-gv)) * uv;
            hr = fm_hrow(a, s, j);
            if (!sh)
                v *= a.weights[hr];
            a.h[(int64_t)hr * a.I + row] = cu_bf16_round(v);
        }
}

/* --- down: w2 --------------------------------------------------------------------------- */

/* Rows p .. p + 8*NT - 1 of slot s through row tile `tile` (32 rows of D). */
template <int NT>
static __device__ __forceinline__ void
fm_down_pass(const struct fm_args &a, const struct fm_slot &s, int p, int tile,
             const uint32_t *lut)
{
    int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int sh = s.rows == NULL, I = a.I, row0 = tile * 32;
    const uint16_t *xb[NT];
    const float *xs[NT][2];
    float acc[2][NT][4];

    fk_zero(acc);
    fm_acts<NT>(xb, xs, a, s, p, 1, sh ? a.hf : a.hb, a.hs, I);
    {
        const struct dsv4_linear *L[2] = { &s.E->w2, &s.E->w2 };
        const int r0[2] = { row0, row0 + 16 };

        fm_tile<NT>(acc, L, r0, sh, xb, xs, lut);
    }
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int j = p + n * 8 + 2 * q + (i & 1), row = row0 + m * 16 + g + 8 * (i >> 1);

                if (j < s.n)
                    a.y[(int64_t)fm_hrow(a, s, j) * a.D + row] = cu_bf16_round(acc[m][n][i]);
            }
}

/* UP: w1/w3/SwiGLU, grid (I / 64, A + 1); else w2, grid (D / 128, A + 1). */
template <int UP>
static __global__ void __launch_bounds__(FM_THREADS)
fm_kernel(struct fm_args a)
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
    if (be->numerics != DSV4_NUMERICS_REF || T < 1 || T > FM_MAX_T || k < 1 ||
        k > FM_MAX_K || n < 1 || n > FM_MAX_E || D % 128 != 0 || I % 128 != 0)
        return 0;
    if (shared == NULL ? !parts : !fm_expert_ok(shared, DSV4_WFMT_FP8, D, I))
        return 0;
    for (int e = 0; e < n; e++)
        if (!(parts && experts[e].w1.w == NULL) &&
            !fm_expert_ok(&experts[e], DSV4_WFMT_FP4, D, I))
            return 0;
    return 1;
}

enum dsv4_err
cuda_fast_moe(struct dsv4_backend *be, float *out, float *parts, const float *x,
              const int32_t *ids,
              const float *weights, const struct dsv4_expert_w *table, int n_table,
              const struct dsv4_expert_w *shared, int T, int k, int D, int I, float lim)
{
    cudaStream_t st = cuda_stream(be);
    int Tk = T * k, A = Tk < n_table ? Tk : n_table, R = Tk + T;
    size_t b_grp = cuda_align((size_t)(2 + 2 * A + Tk) * sizeof(int32_t));
    size_t b_x = cuda_align((size_t)T * D * sizeof(uint16_t));
    size_t b_xs = cuda_align((size_t)T * (D / 128) * sizeof(float));
    size_t b_h = cuda_align((size_t)R * I * sizeof(float));
    size_t b_h16 = cuda_align((size_t)R * I * sizeof(uint16_t));
    size_t b_hs = cuda_align((size_t)R * (I / 128) * sizeof(float));
    size_t b_y = parts != NULL ? 0 : cuda_align((size_t)R * D * sizeof(float));
    char *p = (char *)cuda_scratch(be, b_grp + 2 * b_x + b_xs + b_h + 2 * b_h16 + b_hs + b_y);
    struct fm_args a;
    int32_t *grp;
    enum dsv4_err e;

    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast moe: no scratch (T=%d k=%d)", T, k);
    memset(&a, 0, sizeof(a));
    grp = (int32_t *)p;
    p += b_grp;
    a.table = table;
    if (shared != NULL)
        a.shared = *shared;
    a.has_shared = shared != NULL;
    a.grp = grp;
    a.A = A;
    a.xf = (const uint16_t *)p;
    a.xb = (const uint16_t *)(p + b_x);
    a.xs = (const float *)(p + 2 * b_x);
    p += 2 * b_x + b_xs;
    a.h = (float *)p;
    a.hf = (const uint16_t *)(p + b_h);
    a.hb = (const uint16_t *)(p + b_h + b_h16);
    a.hs = (const float *)(p + b_h + 2 * b_h16);
    p += b_h + 2 * b_h16 + b_hs;
    a.y = parts != NULL ? parts : (float *)p;
    a.weights = weights;
    a.T = T;
    a.k = k;
    a.D = D;
    a.I = I;
    a.lim = lim;

    e = fk_quant(be, (uint16_t *)a.xf, (uint16_t *)a.xb, (float *)a.xs, x, D, T, D);
    if (e != DSV4_OK)
        return e;
    fm_group_kernel<<<1, 256, (size_t)(n_table + Tk) * sizeof(int32_t), st>>>(
        grp, ids, Tk, n_table, A, table, parts != NULL);
    CUDA_LAUNCHED("fast moe group");
    fm_kernel<1><<<dim3((unsigned)(I / 64), (unsigned)(A + 1)), FM_THREADS, 0, st>>>(a);
    CUDA_LAUNCHED("fast moe up");
    e = fk_quant(be, (uint16_t *)a.hf, (uint16_t *)a.hb, (float *)a.hs, a.h, I, R, I);
    if (e != DSV4_OK)
        return e;
    fm_kernel<0><<<dim3((unsigned)(D / 128), (unsigned)(A + 1)), FM_THREADS, 0, st>>>(a);
    CUDA_LAUNCHED("fast moe down");
    if (parts != NULL)
        return DSV4_OK;   /* moe_parts: the caller sums the ranks' parts, then combines */
    return cuda_moe_combine(be, out, a.y, ids, T, k, D);   /* the exact path's step 5 */
}
