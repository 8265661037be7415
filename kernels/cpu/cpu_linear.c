/*
 * cpu_linear.c — linear (BF16 / FP8 block-scaled / FP4 group-scaled weights)
 * and the grouped output projection, plus the canonical dot product.
 *
 * Numerics (model doc §3.0, §2.3):
 *   - A weight row is decoded to real fp32 values, code value times its E8M0
 *     scale.  Scales are powers of two, so this is exact, and for FP8 (one
 *     scale per 128x128 block) Σ q·(w·s_w) equals (Σ q·w)·s_w exactly.  For
 *     FP4 the weight scale changes every 32 columns inside a 128-block; the
 *     block sum then runs over the already-scaled weights.
 *   - REF numerics, FP8/FP4 weights: every input row is quantized per 128
 *     columns (dsv4_fp8_quant_block) to FP8 values q with scale s_x, and
 *     out = Σ_blocks s_x · cpu_dot128(q, w_real), blocks in order, fp32.
 *   - HF numerics, FP8/FP4 weights, and BF16 weights: out = cpu_dot(x, w_real)
 *     over the whole row, fp32.
 *   - Output rounded to bf16 except BF16 weights with DSV4_LIN_F32_OUT.
 * Each output element is one complete dot product computed on one thread,
 * so results do not depend on T, on the tiling or on the thread count.
 *
 * Parallel work items are (n-tile of CPU_LIN_NB weight rows) x (t-tile of
 * CPU_LIN_TB rows); a worker decodes its weight tile once into its private
 * buffer and reuses it while its chunk stays on the same n-tile.
 */
#include "kernels/cpu/cpu.h"

#include <assert.h>
#include <stdlib.h>

#include "common/formats.h"

#define CPU_LIN_TB 64   /* activation rows per work item */
#define QBLK 128        /* activation quantization block (model doc §3.0) */

/* --- dot products ------------------------------------------------------------ */

#define LANES CPU_LANES

/* Add the lanes pairwise (l + 4, then + 2, + 1). */
static inline CPU_HOT float
lanes_sum(float *acc)
{
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    return acc[0];
}

/* The loop of cpu_dot: not instrumented (CPU_HOT; its caller checks). */
static CPU_HOT float
dot_loop(const float *a, const float *b, int n)
{
    float acc[LANES] = { 0 };
    int i = 0;

    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i + l < n; l++)
        acc[l] += a[i + l] * b[i + l];
    return lanes_sum(acc);
}

float
cpu_dot(const float *a, const float *b, int n)
{
    cpu_check_range(a, (size_t)n * sizeof(float));
    cpu_check_range(b, (size_t)n * sizeof(float));
    return dot_loop(a, b, n);
}

/* The loop of cpu_dot4: not instrumented (CPU_HOT; its caller checks). */
static CPU_HOT void
dot4_loop(float *out, const float *a, const float *b0, const float *b1, const float *b2,
          const float *b3, int n)
{
    float s0[LANES] = { 0 }, s1[LANES] = { 0 }, s2[LANES] = { 0 }, s3[LANES] = { 0 };
    int i = 0;

    for (; i + LANES <= n; i += LANES) {
        for (int l = 0; l < LANES; l++) {
            float av = a[i + l];

            s0[l] += av * b0[i + l];
            s1[l] += av * b1[i + l];
            s2[l] += av * b2[i + l];
            s3[l] += av * b3[i + l];
        }
    }
    for (int l = 0; i + l < n; l++) {
        s0[l] += a[i + l] * b0[i + l];
        s1[l] += a[i + l] * b1[i + l];
        s2[l] += a[i + l] * b2[i + l];
        s3[l] += a[i + l] * b3[i + l];
    }
    out[0] = lanes_sum(s0);
    out[1] = lanes_sum(s1);
    out[2] = lanes_sum(s2);
    out[3] = lanes_sum(s3);
}

void
cpu_dot4(float *out, const float *a, const float *b0, const float *b1, const float *b2,
         const float *b3, int n)
{
    size_t bytes = (size_t)n * sizeof(float);

    cpu_check_range(out, 4 * sizeof(float));
    cpu_check_range(a, bytes);
    cpu_check_range(b0, bytes);
    cpu_check_range(b1, bytes);
    cpu_check_range(b2, bytes);
    cpu_check_range(b3, bytes);
    dot4_loop(out, a, b0, b1, b2, b3, n);
}

float
cpu_sumsq(const float *a, int n)
{
    return cpu_dot(a, a, n);
}

/* --- activation preparation -------------------------------------------------- */

struct prep_job {
    float *xq;            /* (rows, K) FP8 values */
    float *sx;            /* (rows, K/128) */
    const float *x;
    int64_t stride;
    int K;
};

static void
prep_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct prep_job *j = ctx;
    int nb = j->K / QBLK;
    uint8_t q[QBLK];

    (void)tid;
    for (int64_t r = begin; r < end; r++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = j->x + r * j->stride + (int64_t)b * QBLK;
            float *o = j->xq + r * j->K + (int64_t)b * QBLK;

            j->sx[r * nb + b] = dsv4_fp8_quant_block(q, xb, QBLK);
            for (int i = 0; i < QBLK; i++)
                o[i] = dsv4_fp8_to_f32(q[i]);
        }
    }
}

enum dsv4_err
cpu_lin_prepare(struct dsv4_backend *be, struct cpu_lin_src *src, float **buf, const float *x,
                int64_t stride, int rows, int K, enum dsv4_wfmt fmt)
{
    struct prep_job j;

    *buf = NULL;
    src->x = x;
    src->sx = NULL;
    src->stride = stride;
    src->K = K;
    if (be->numerics != DSV4_NUMERICS_REF || fmt == DSV4_WFMT_BF16 || rows <= 0)
        return DSV4_OK;
    if (K % QBLK != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP,
                            "cpu linear: FP8 activation quantization needs K %% 128 == 0 "
                            "(K=%d)", K);
    j.xq = malloc(((size_t)rows * K + (size_t)rows * (K / QBLK)) * sizeof(float));
    if (j.xq == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu linear: no memory for %d x %d activations",
                            rows, K);
    j.sx = j.xq + (size_t)rows * K;
    j.x = x;
    j.stride = stride;
    j.K = K;
    cpu_parallel_for(be, rows, 16, prep_task, &j);
    *buf = j.xq;
    src->x = j.xq;
    src->sx = j.sx;
    src->stride = K;
    return DSV4_OK;
}

/* --- weight decoding --------------------------------------------------------- */

/* Row n of a linear's weights: its weight bytes and its scale bytes. */
struct wrow {
    const uint8_t *w, *sc;    /* sc: NULL for bf16 */
    size_t wbytes, sbytes;
};

/* Where row n of W lies: what decode_row reads, and cpu_lin_decode checks. */
static struct wrow
weight_row(const struct dsv4_linear *W, int n)
{
    int64_t K = W->n_in, ns = (K + QBLK - 1) / QBLK;
    const uint8_t *w = W->w;
    struct wrow r = { 0 };

    switch (W->fmt) {
    case DSV4_WFMT_BF16:
        r.w = w + n * K * 2, r.wbytes = (size_t)K * 2;
        break;
    case DSV4_WFMT_FP8:   /* one scale a 128 x 128 block */
        r.w = w + n * K, r.wbytes = (size_t)K;
        r.sc = W->scale + (n / QBLK) * ns, r.sbytes = (size_t)ns;
        break;
    case DSV4_WFMT_FP4:   /* two values a byte; one scale a 32 of a row */
        r.w = w + n * (K / 2), r.wbytes = (size_t)K / 2;
        r.sc = W->scale + n * (K / 32), r.sbytes = (size_t)K / 32;
        break;
    }
    return r;
}

/*
 * Decode row r (weight_row) of a linear of format fmt and K columns into o
 * (K floats).  Not instrumented (CPU_HOT): cpu_lin_decode checks the ranges
 * it reads and writes.
 */
static CPU_HOT void
decode_row(float *o, enum dsv4_wfmt fmt, int K, struct wrow r)
{
    switch (fmt) {
    case DSV4_WFMT_BF16: {
        const uint16_t *w = (const uint16_t *)r.w;

        for (int k = 0; k < K; k++)
            o[k] = dsv4_bf16_to_f32(w[k]);
        break;
    }
    case DSV4_WFMT_FP8: {
        int ns = (K + QBLK - 1) / QBLK;

        for (int b = 0; b < ns; b++) {
            float s = dsv4_e8m0_to_f32(r.sc[b]);
            int k1 = (b + 1) * QBLK < K ? (b + 1) * QBLK : K;

            for (int k = b * QBLK; k < k1; k++)
                o[k] = dsv4_fp8_e4m3_table[r.w[k]] * s;
        }
        break;
    }
    case DSV4_WFMT_FP4:
        for (int g = 0; g < K / 32; g++) {
            float s = dsv4_e8m0_to_f32(r.sc[g]);

            for (int k = g * 32; k < g * 32 + 32; k += 2) {
                uint8_t byte = r.w[k / 2];

                o[k] = dsv4_fp4_table[byte & 0x0f] * s;
                o[k + 1] = dsv4_fp4_table[byte >> 4] * s;
            }
        }
        break;
    }
}

void
cpu_lin_decode(float *wbuf, const struct dsv4_linear *W, int n0, int n1)
{
    int K = W->n_in;

    assert(n1 - n0 <= CPU_LIN_NB);
    for (int n = n0; n < n1; n++) {
        float *o = wbuf + (int64_t)(n - n0) * K;
        struct wrow r = weight_row(W, n);

        cpu_check_range(o, (size_t)K * sizeof(float));
        cpu_check_range(r.w, r.wbytes);
        cpu_check_range(r.sc, r.sbytes);
        decode_row(o, W->fmt, K, r);
    }
}

/* --- row kernel ---------------------------------------------------------------- */

void
cpu_lin_rows(float *out, int64_t out_stride, const struct cpu_lin_src *src, const int32_t *rows,
             int n_rows, const float *wbuf, int n0, int n1, int round_bf16)
{
    int K = src->K;
    int nb = K / QBLK;

    for (int i = 0; i < n_rows; i++) {
        int64_t r = rows != NULL ? rows[i] : i;
        const float *xr = src->x + r * src->stride;
        const float *sx = src->sx != NULL ? src->sx + r * nb : NULL;
        float *o = out + (int64_t)i * out_stride;
        int n = n0;

        /* four weight rows at a time share the loads of x */
        for (; n + 4 <= n1; n += 4) {
            const float *w = wbuf + (int64_t)(n - n0) * K;
            float acc[4] = { 0 }, d[4];

            if (sx != NULL) {
                for (int b = 0; b < nb; b++) {
                    int c = b * QBLK;

                    cpu_dot4(d, xr + c, w + c, w + K + c, w + 2 * K + c, w + 3 * K + c, QBLK);
                    for (int q = 0; q < 4; q++)
                        acc[q] += sx[b] * d[q];
                }
            } else {
                cpu_dot4(acc, xr, w, w + K, w + 2 * K, w + 3 * K, K);
            }
            for (int q = 0; q < 4; q++)
                o[n - n0 + q] = round_bf16 ? dsv4_bf16_round(acc[q]) : acc[q];
        }
        for (; n < n1; n++) {
            const float *w = wbuf + (int64_t)(n - n0) * K;
            float acc;

            if (sx != NULL) {
                acc = 0.0f;
                for (int b = 0; b < nb; b++)
                    acc += sx[b] * cpu_dot(xr + b * QBLK, w + b * QBLK, QBLK);
            } else {
                acc = cpu_dot(xr, w, K);
            }
            o[n - n0] = round_bf16 ? dsv4_bf16_round(acc) : acc;
        }
    }
}

/* --- linear and linear_grouped ------------------------------------------------- */

/*
 * One (grouped) linear: group g multiplies columns [g*Kg, (g+1)*Kg) of the
 * source rows with weight rows [g*R, (g+1)*R) into output columns
 * [g*R, (g+1)*R).  A plain linear is G = 1.
 */
struct lin_job {
    const struct dsv4_linear *W;
    struct cpu_lin_src src;   /* group 0, row 0 */
    float *out;               /* (T, G*R) */
    float *wbuf;              /* (n_threads, CPU_LIN_NB * Kg) */
    int T, G, R;
    int n_nt, n_tt;           /* n-tiles per group, t-tiles */
    int round_bf16;
};

static void
lin_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct lin_job *j = ctx;
    int K = j->src.K;
    float *wbuf = j->wbuf + (int64_t)tid * CPU_LIN_WBUF(K);
    int64_t decoded = -1;   /* (g, n-tile) index now in wbuf */

    for (int64_t it = begin; it < end; it++) {
        int64_t gn = it / j->n_tt;
        int g = (int)(gn / j->n_nt);
        int nt = (int)(gn % j->n_nt);
        int tt = (int)(it % j->n_tt);
        int n0 = nt * CPU_LIN_NB;
        int n1 = n0 + CPU_LIN_NB < j->R ? n0 + CPU_LIN_NB : j->R;
        int t0 = tt * CPU_LIN_TB;
        int t1 = t0 + CPU_LIN_TB < j->T ? t0 + CPU_LIN_TB : j->T;
        int64_t ow = (int64_t)j->G * j->R;
        struct cpu_lin_src s = cpu_lin_src_at(&j->src, t0);

        if (gn != decoded) {
            cpu_lin_decode(wbuf, j->W, g * j->R + n0, g * j->R + n1);
            decoded = gn;
        }
        s.x += (int64_t)g * K;   /* group g's columns (G > 1 never has scales) */
        cpu_lin_rows(j->out + (int64_t)t0 * ow + (int64_t)g * j->R + n0, ow, &s, NULL,
                     t1 - t0, wbuf, n0, n1, j->round_bf16);
    }
}

/* Run a prepared job over all its items. */
static enum dsv4_err
lin_run(struct dsv4_backend *be, struct lin_job *j)
{
    int nthr = cpu_threads(be);
    int64_t items, grain;

    j->n_nt = (j->R + CPU_LIN_NB - 1) / CPU_LIN_NB;
    j->n_tt = (j->T + CPU_LIN_TB - 1) / CPU_LIN_TB;
    j->wbuf = malloc((size_t)nthr * CPU_LIN_WBUF(j->src.K) * sizeof(float));
    if (j->wbuf == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu linear: no memory for weight tiles");
    items = (int64_t)j->G * j->n_nt * j->n_tt;
    /* whole n-tiles per chunk when there is enough work, for weight reuse */
    grain = items / (8 * (int64_t)nthr);
    if (grain > j->n_tt)
        grain = j->n_tt;
    cpu_parallel_for(be, items, grain, lin_task, j);
    free(j->wbuf);
    return DSV4_OK;
}

static int
lin_check(const struct dsv4_linear *W)
{
    if (W->fmt == DSV4_WFMT_BF16)
        return W->w != NULL;
    if (W->w == NULL || W->scale == NULL)
        return 0;
    return W->fmt == DSV4_WFMT_FP8 || (W->fmt == DSV4_WFMT_FP4 && W->n_in % 32 == 0);
}

enum dsv4_err
cpu_linear(struct dsv4_backend *be, float *out, const float *x, const struct dsv4_linear *W,
           int T, unsigned flags)
{
    struct lin_job j = { 0 };
    float *buf;
    enum dsv4_err e;

    if (!lin_check(W))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu linear: bad weight (fmt %d, %d x %d)",
                            (int)W->fmt, W->n_out, W->n_in);
    if (T <= 0)
        return DSV4_OK;
    e = cpu_lin_prepare(be, &j.src, &buf, x, W->n_in, T, W->n_in, W->fmt);
    if (e != DSV4_OK)
        return e;
    j.W = W;
    j.out = out;
    j.T = T;
    j.G = 1;
    j.R = W->n_out;
    j.round_bf16 = !(W->fmt == DSV4_WFMT_BF16 && (flags & DSV4_LIN_F32_OUT));
    e = lin_run(be, &j);
    free(buf);
    return e;
}

enum dsv4_err
cpu_linear_grouped(struct dsv4_backend *be, float *out, const float *x,
                   const struct dsv4_linear *Wa, int T, int G)
{
    struct lin_job j = { 0 };
    int64_t n = (int64_t)T * G * Wa->n_in;
    float *xb;
    enum dsv4_err e;

    if (!lin_check(Wa) || G <= 0 || Wa->n_out % G != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu linear_grouped: bad weight (fmt %d, %d x %d, "
                            "G=%d)", (int)Wa->fmt, Wa->n_out, Wa->n_in, G);
    if (T <= 0)
        return DSV4_OK;
    /* the reference's einsum runs on bf16 inputs */
    xb = malloc((size_t)n * sizeof(float));
    if (xb == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu linear_grouped: no memory");
    for (int64_t i = 0; i < n; i++)
        xb[i] = dsv4_bf16_round(x[i]);
    j.W = Wa;
    j.src.x = xb;
    j.src.sx = NULL;
    j.src.stride = (int64_t)G * Wa->n_in;
    j.src.K = Wa->n_in;
    j.out = out;
    j.T = T;
    j.G = G;
    j.R = Wa->n_out / G;
    j.round_bf16 = 1;
    e = lin_run(be, &j);
    free(xb);
    return e;
}
