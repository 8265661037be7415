/*
 * test_cpu_ops.c — the CPU reference backend (kernels/cpu/) op by op against
 * naive double-precision implementations written here from the op contracts
 * (kernels/backend.h) and model doc §3, plus property tests: Sinkhorn
 * doubly-stochastic, RoPE inverse, row independence of linear (T = 1 vs 7),
 * thread-count independence (bit-identical), streaming compressor = direct
 * windowed softmax, huge negative sink = plain softmax, sampling determinism.
 *
 * Tolerances: results the op rounds to bf16 are compared with
 * |got - ref| <= rtol * |ref| + mtol * mag, where rtol = 2^-7 (one bf16 ulp:
 * fp32 accumulation may flip a rounding) and mag is the sum of absolute
 * terms of the reference sum (fp32 accumulation error); fp32 outputs use
 * rtol ~ 1e-5.  Weights are built with formats.h encoders (FP8/FP4 codes and
 * E8M0 scales) from random real values with block-dependent magnitudes, so a
 * wrong scale index or nibble order is far outside any tolerance.
 */
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/formats.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"

#define BF16_RTOL (1.0 / 128.0)

/* --- helpers ----------------------------------------------------------------------- */

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint64_t
rng_u64(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* uniform in [-1, 1) */
static double
rng_sym(void)
{
    return (double)(rng_u64() >> 11) / 4503599627370496.0 - 1.0;
}

/* roughly normal, unit variance */
static double
rng_norm(void)
{
    return (rng_sym() + rng_sym() + rng_sym()) * 1.0;
}

static float
bf(double v)
{
    return dsv4_bf16_round((float)v);
}

/* n bf16-valued floats ~ N(0, sd^2) */
static float *
rand_bf16(int64_t n, double sd)
{
    float *x = malloc((size_t)n * sizeof(float));

    assert_non_null(x);
    for (int64_t i = 0; i < n; i++)
        x[i] = bf(rng_norm() * sd);
    return x;
}

static float *
rand_f32(int64_t n, double sd)
{
    float *x = malloc((size_t)n * sizeof(float));

    assert_non_null(x);
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)(rng_norm() * sd);
    return x;
}

static struct dsv4_backend *
mkbe(enum dsv4_numerics num, int threads)
{
    struct dsv4_backend *be = NULL;

    assert_int_equal(dsv4_backend_create(&be, "cpu", num, threads), DSV4_OK);
    assert_non_null(be);
    return be;
}

/*
 * Compare: |got - ref| <= rtol*|ref| + mtol*mag[i] (+ atol); prints the first
 * mismatches and the worst error before failing.
 */
static void
check_close(const char *what, const float *got, const double *ref, const double *mag,
            int64_t n, double rtol, double mtol, double atol)
{
    int64_t bad = 0;
    double worst = 0.0;

    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        double tol = rtol * fabs(ref[i]) + (mag != NULL ? mtol * mag[i] : 0.0) + atol;

        if (d > worst)
            worst = d;
        if (!(d <= tol)) {
            if (bad < 5)
                print_message("%s: NOT OK [%lld] got %.9g ref %.9g (tol %.3g)\n", what,
                              (long long)i, (double)got[i], ref[i], tol);
            bad++;
        }
    }
    if (bad > 0)
        fail_msg("%s: %lld of %lld values out of tolerance, max abs err %.3g", what,
                 (long long)bad, (long long)n, worst);
}

/* --- test weights -------------------------------------------------------------------- */

struct tw {
    struct dsv4_linear L;
    void *w;
    uint8_t *scale;
    double *real;     /* (n_out, n_in) dequantized values */
};

/* magnitude varying by block, so scale-index mistakes show */
static double
blk_sd(int bo, int bi)
{
    return 0.05 * ldexp(1.0, (bo * 3 + bi) % 4 - 1);
}

static void
tw_free(struct tw *w)
{
    free(w->w);
    free(w->scale);
    free(w->real);
}

static void
tw_make(struct tw *t, enum dsv4_wfmt fmt, int n_out, int n_in)
{
    int64_t n = (int64_t)n_out * n_in;
    double *v = malloc((size_t)n * sizeof(double));

    assert_non_null(v);
    memset(t, 0, sizeof(*t));
    t->real = calloc((size_t)n, sizeof(double));
    assert_non_null(t->real);
    t->L.n_out = n_out;
    t->L.n_in = n_in;
    t->L.fmt = fmt;
    if (fmt == DSV4_WFMT_FP4) {
        for (int o = 0; o < n_out; o++)
            for (int i = 0; i < n_in; i++)
                v[(int64_t)o * n_in + i] = rng_norm() * blk_sd(o % 5, i / 32);
    } else {
        for (int o = 0; o < n_out; o++)
            for (int i = 0; i < n_in; i++)
                v[(int64_t)o * n_in + i] = rng_norm() * blk_sd(o / 128, i / 128);
    }
    if (fmt == DSV4_WFMT_BF16) {
        uint16_t *w = malloc((size_t)n * 2);

        assert_non_null(w);
        for (int64_t i = 0; i < n; i++) {
            w[i] = dsv4_f32_to_bf16((float)v[i]);
            t->real[i] = dsv4_bf16_to_f32(w[i]);
        }
        t->w = w;
    } else if (fmt == DSV4_WFMT_FP8) {
        int sr = (n_out + 127) / 128, sc = (n_in + 127) / 128;
        uint8_t *w = malloc((size_t)n);

        t->scale = malloc((size_t)sr * sc);
        assert_non_null(w);
        assert_non_null(t->scale);
        for (int bo = 0; bo < sr; bo++) {
            for (int bi = 0; bi < sc; bi++) {
                double amax = 0.0;
                float s;

                for (int o = bo * 128; o < n_out && o < bo * 128 + 128; o++)
                    for (int i = bi * 128; i < n_in && i < bi * 128 + 128; i++)
                        amax = fmax(amax, fabs(v[(int64_t)o * n_in + i]));
                s = dsv4_pow2_scale((float)amax, 448.0f);
                t->scale[bo * sc + bi] = dsv4_f32_to_e8m0(s);
                for (int o = bo * 128; o < n_out && o < bo * 128 + 128; o++) {
                    for (int i = bi * 128; i < n_in && i < bi * 128 + 128; i++) {
                        int64_t k = (int64_t)o * n_in + i;

                        w[k] = dsv4_f32_to_fp8((float)(v[k] / s));
                        t->real[k] = (double)dsv4_fp8_to_f32(w[k]) * s;
                    }
                }
            }
        }
        t->w = w;
    } else {
        uint8_t *w = calloc((size_t)n / 2, 1);

        t->scale = malloc((size_t)n / 32);
        assert_non_null(w);
        assert_non_null(t->scale);
        for (int o = 0; o < n_out; o++) {
            for (int g = 0; g < n_in / 32; g++) {
                double amax = 0.0;
                float s;

                for (int i = g * 32; i < g * 32 + 32; i++)
                    amax = fmax(amax, fabs(v[(int64_t)o * n_in + i]));
                s = dsv4_pow2_scale((float)amax, 6.0f);
                t->scale[(int64_t)o * (n_in / 32) + g] = dsv4_f32_to_e8m0(s);
                for (int i = g * 32; i < g * 32 + 32; i++) {
                    int64_t k = (int64_t)o * n_in + i;
                    uint8_t c = dsv4_f32_to_fp4((float)(v[k] / s));

                    w[k / 2] |= (uint8_t)(c << (4 * (i & 1)));
                    t->real[k] = (double)dsv4_fp4_table[c] * s;
                }
            }
        }
        t->w = w;
    }
    t->L.w = t->w;
    t->L.scale = t->scale;
    free(v);
}

/*
 * Reference linear of one row: the input as the op sees it (FP8
 * quantize-dequantize per 128 block under REF for FP8/FP4 weights), then a
 * double dot product.  *mag = Σ |terms|.
 */
static double *
ref_x(const float *x, int K, int quant)
{
    double *xr = malloc((size_t)K * sizeof(double));

    assert_non_null(xr);
    for (int b = 0; b < K; b += 128) {
        if (quant) {
            uint8_t q[128];
            float s = dsv4_fp8_quant_block(q, x + b, 128);

            for (int i = 0; i < 128; i++)
                xr[b + i] = (double)dsv4_fp8_to_f32(q[i]) * s;
        } else {
            for (int i = b; i < K && i < b + 128; i++)
                xr[i] = x[i];
        }
    }
    return xr;
}

static void
ref_linear(double *out, double *mag, const float *x, int T, const struct tw *w, int quant)
{
    int N = w->L.n_out, K = w->L.n_in;

    for (int t = 0; t < T; t++) {
        double *xr = ref_x(x + (int64_t)t * K, K, quant && w->L.fmt != DSV4_WFMT_BF16);

        for (int n = 0; n < N; n++) {
            double s = 0.0, m = 0.0;

            for (int k = 0; k < K; k++) {
                double p = xr[k] * w->real[(int64_t)n * K + k];

                s += p;
                m += fabs(p);
            }
            out[(int64_t)t * N + n] = s;
            if (mag != NULL)
                mag[(int64_t)t * N + n] = m;
        }
        free(xr);
    }
}

/* --- backend creation and layout ops ----------------------------------------------------- */

static void
test_create(void **state)
{
    struct dsv4_backend *be = NULL;

    (void)state;
    assert_int_equal(dsv4_backend_create(&be, "cuda", DSV4_NUMERICS_REF, 1), DSV4_ERR_NOTSUP);
    assert_null(be);
    assert_int_equal(dsv4_backend_create(&be, "tpu", DSV4_NUMERICS_REF, 1), DSV4_ERR_INVAL);
    assert_null(be);
    be = mkbe(DSV4_NUMERICS_HF, 0);
    assert_string_equal(be->name, "cpu");
    assert_true(be->n_threads >= 1);
    assert_int_equal(be->numerics, DSV4_NUMERICS_HF);
    dsv4_backend_destroy(be);
    dsv4_backend_destroy(NULL);
}

static void
test_layout_ops(void **state)
{
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);
    const struct dsv4_backend_ops *op = be->ops;
    uint16_t table[4 * 3];
    int32_t ids[2] = { 3, 1 }, rows[2] = { 2, 0 };
    float *buf = op->alloc(be, 64 * sizeof(float));
    float src[6] = { 1, 2, 3, 4, 5, 6 }, e[3] = { 0.5f, 0.25f, 1.0f / 3.0f };
    float out[2 * 2 * 3], g[6], host[8];

    (void)state;
    assert_non_null(buf);
    for (int i = 0; i < 64; i++)
        assert_true(buf[i] == 0.0f);
    for (int i = 0; i < 12; i++)
        table[i] = dsv4_f32_to_bf16((float)i * 1.5f);
    assert_int_equal(op->embed(be, out, ids, table, 2, 3, 2), DSV4_OK);
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < 2; c++)
            for (int i = 0; i < 3; i++)
                assert_true(out[(t * 2 + c) * 3 + i] == (float)(ids[t] * 3 + i) * 1.5f);

    assert_int_equal(op->fill(be, buf, -2.0f, 9), DSV4_OK);
    assert_true(buf[8] == -2.0f && buf[9] == 0.0f);
    assert_int_equal(op->scatter_rows(be, buf, rows, src, 2, 3), DSV4_OK);
    assert_true(buf[6] == 1 && buf[8] == 3 && buf[0] == 4 && buf[2] == 6 && buf[3] == -2.0f);
    assert_int_equal(op->gather_rows(be, g, buf, rows, 2, 3), DSV4_OK);
    assert_memory_equal(g, src, sizeof(src));
    assert_int_equal(op->upload(be, buf, src, sizeof(src)), DSV4_OK);
    assert_int_equal(op->copy(be, buf + 8, buf, sizeof(src)), DSV4_OK);
    assert_int_equal(op->download(be, host, buf + 8, sizeof(src)), DSV4_OK);
    assert_memory_equal(host, src, sizeof(src));
    assert_int_equal(op->scale(be, buf, 1.0f / 3.0f, 6), DSV4_OK);
    for (int i = 0; i < 6; i++)
        assert_true(buf[i] == bf(src[i] / 3.0));   /* one rounding of an exact-ish value */
    assert_int_equal(op->add_streams(be, out, e, src, 1, 2, 3), DSV4_OK);
    for (int j = 0; j < 2; j++)
        for (int i = 0; i < 3; i++)
            assert_true(out[j * 3 + i] == bf((double)e[i] + src[j * 3 + i]));
    assert_int_equal(op->sync(be), DSV4_OK);
    op->free(be, buf);
    dsv4_backend_destroy(be);
}

/* --- linear ------------------------------------------------------------------------------- */

static void
run_linear_case(enum dsv4_numerics num, enum dsv4_wfmt fmt, int T, int N, int K, unsigned flags)
{
    struct dsv4_backend *be = mkbe(num, 3);
    struct tw w;
    float *x = rand_bf16((int64_t)T * K, 1.0);
    float *out = malloc((size_t)T * N * sizeof(float));
    double *ref = malloc((size_t)T * N * sizeof(double));
    double *mag = malloc((size_t)T * N * sizeof(double));
    char what[96];
    int f32 = fmt == DSV4_WFMT_BF16 && (flags & DSV4_LIN_F32_OUT);

    tw_make(&w, fmt, N, K);
    /* a few outliers so activation blocks get different scales */
    for (int t = 0; t < T; t++)
        x[(int64_t)t * K + (t * 37) % K] = bf(50.0 + t);
    assert_int_equal(be->ops->linear(be, out, x, &w.L, T, flags), DSV4_OK);
    ref_linear(ref, mag, x, T, &w, num == DSV4_NUMERICS_REF);
    snprintf(what, sizeof(what), "linear num=%d fmt=%d T=%d N=%d K=%d f32=%d", (int)num,
             (int)fmt, T, N, K, f32);
    check_close(what, out, ref, mag, (int64_t)T * N, f32 ? 0.0 : BF16_RTOL, 1e-5, 0.0);
    for (int i = 0; i < T * N && !f32; i++)
        assert_true(out[i] == bf(out[i]));
    tw_free(&w);
    free(x);
    free(out);
    free(ref);
    free(mag);
    dsv4_backend_destroy(be);
}

static void
test_linear(void **state)
{
    (void)state;
    run_linear_case(DSV4_NUMERICS_REF, DSV4_WFMT_FP8, 7, 200, 384, 0);
    run_linear_case(DSV4_NUMERICS_HF, DSV4_WFMT_FP8, 7, 200, 384, 0);
    run_linear_case(DSV4_NUMERICS_REF, DSV4_WFMT_FP4, 5, 24, 256, 0);
    run_linear_case(DSV4_NUMERICS_HF, DSV4_WFMT_FP4, 5, 24, 256, 0);
    run_linear_case(DSV4_NUMERICS_REF, DSV4_WFMT_BF16, 70, 37, 50, 0);
    run_linear_case(DSV4_NUMERICS_REF, DSV4_WFMT_BF16, 3, 37, 50, DSV4_LIN_F32_OUT);
    run_linear_case(DSV4_NUMERICS_HF, DSV4_WFMT_BF16, 3, 9, 130, DSV4_LIN_F32_OUT);
}

/* The REF activation quantization must be visible: REF and HF differ. */
static void
test_linear_quant_matters(void **state)
{
    struct dsv4_backend *ref = mkbe(DSV4_NUMERICS_REF, 1), *hf = mkbe(DSV4_NUMERICS_HF, 1);
    struct tw w;
    float *x = rand_bf16(4 * 256, 1.0), a[4 * 64], b[4 * 64];
    int differ = 0;

    (void)state;
    tw_make(&w, DSV4_WFMT_FP8, 64, 256);
    assert_int_equal(ref->ops->linear(ref, a, x, &w.L, 4, 0), DSV4_OK);
    assert_int_equal(hf->ops->linear(hf, b, x, &w.L, 4, 0), DSV4_OK);
    for (int i = 0; i < 4 * 64; i++)
        differ += a[i] != b[i];
    assert_true(differ > 0);
    tw_free(&w);
    free(x);
    dsv4_backend_destroy(ref);
    dsv4_backend_destroy(hf);
}

/* Row t of a T=7 call equals the same row computed alone (T=1), bit for bit. */
static void
test_linear_row_independent(void **state)
{
    enum dsv4_wfmt fmts[3] = { DSV4_WFMT_FP8, DSV4_WFMT_FP4, DSV4_WFMT_BF16 };

    (void)state;
    for (int f = 0; f < 3; f++) {
        struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);
        struct tw w;
        float *x = rand_bf16(7 * 256, 1.0), all[7 * 40], one[40];

        tw_make(&w, fmts[f], 40, 256);
        assert_int_equal(be->ops->linear(be, all, x, &w.L, 7, 0), DSV4_OK);
        for (int t = 0; t < 7; t++) {
            assert_int_equal(be->ops->linear(be, one, x + t * 256, &w.L, 1, 0), DSV4_OK);
            assert_memory_equal(one, all + t * 40, sizeof(one));
        }
        tw_free(&w);
        free(x);
        dsv4_backend_destroy(be);
    }
}

/*
 * Output columns are computed four at a time with a shared-load kernel and
 * singly at the tail: both must give the same bits.  Each row of a 5-row
 * weight alone (a 1-row weight) must reproduce that row's column.
 */
static void
test_linear_column_independent(void **state)
{
    enum dsv4_wfmt fmts[2] = { DSV4_WFMT_FP8, DSV4_WFMT_BF16 };

    (void)state;
    for (int f = 0; f < 2; f++) {
        struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 1);
        struct tw w;
        float *x = rand_bf16(3 * 256, 1.0), all[3 * 5], one[3];

        tw_make(&w, fmts[f], 5, 256);
        assert_int_equal(be->ops->linear(be, all, x, &w.L, 3, 0), DSV4_OK);
        for (int r = 0; r < 5; r++) {
            struct dsv4_linear L1 = w.L;

            L1.n_out = 1;
            L1.w = (const uint8_t *)w.L.w + (fmts[f] == DSV4_WFMT_BF16 ? 2 : 1) * r * 256;
            assert_int_equal(be->ops->linear(be, one, x, &L1, 3, 0), DSV4_OK);
            for (int t = 0; t < 3; t++)
                assert_true(one[t] == all[t * 5 + r]);
        }
        tw_free(&w);
        free(x);
        dsv4_backend_destroy(be);
    }
}

static void
test_linear_grouped(void **state)
{
    int T = 3, G = 4, R = 20, Kg = 256;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 3);
    struct tw w;
    float *x = rand_bf16((int64_t)T * G * Kg, 1.0);
    float *out = malloc((size_t)T * G * R * sizeof(float));
    double *ref = malloc((size_t)T * G * R * sizeof(double));
    double *mag = malloc((size_t)T * G * R * sizeof(double));

    (void)state;
    tw_make(&w, DSV4_WFMT_FP8, G * R, Kg);
    assert_int_equal(be->ops->linear_grouped(be, out, x, &w.L, T, G), DSV4_OK);
    for (int t = 0; t < T; t++) {
        for (int g = 0; g < G; g++) {
            for (int r = 0; r < R; r++) {
                double s = 0.0, m = 0.0;

                for (int k = 0; k < Kg; k++) {
                    /* wo_a as bf16 must be the exact FP8 value */
                    double wv = w.real[(int64_t)(g * R + r) * Kg + k];
                    double p;

                    assert_true(bf(wv) == wv);
                    p = wv * x[((int64_t)t * G + g) * Kg + k];
                    s += p;
                    m += fabs(p);
                }
                ref[(t * G + g) * R + r] = s;
                mag[(t * G + g) * R + r] = m;
            }
        }
    }
    check_close("linear_grouped", out, ref, mag, (int64_t)T * G * R, BF16_RTOL, 1e-5, 0.0);
    tw_free(&w);
    free(x);
    free(out);
    free(ref);
    free(mag);
    dsv4_backend_destroy(be);
}

/* --- rms_norm, rope, sims --------------------------------------------------------------------- */

static void
test_rms_norm(void **state)
{
    int rows = 5, D = 300;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);
    float *x = rand_f32((int64_t)rows * D, 2.0);   /* not bf16: the op rounds first */
    float *out = malloc((size_t)rows * D * sizeof(float));
    float *inpl = malloc((size_t)rows * D * sizeof(float));
    double *ref = malloc((size_t)rows * D * sizeof(double));
    uint16_t *w = malloc((size_t)D * 2);

    (void)state;
    for (int i = 0; i < D; i++)
        w[i] = dsv4_f32_to_bf16((float)(1.0 + 0.5 * rng_sym()));
    for (int weighted = 0; weighted < 2; weighted++) {
        const uint16_t *wp = weighted ? w : NULL;

        assert_int_equal(be->ops->rms_norm(be, out, x, wp, rows, D, 1e-6f), DSV4_OK);
        for (int r = 0; r < rows; r++) {
            double ss = 0.0;

            for (int i = 0; i < D; i++)
                ss += (double)bf(x[r * D + i]) * bf(x[r * D + i]);
            for (int i = 0; i < D; i++)
                ref[r * D + i] = bf(x[r * D + i]) / sqrt(ss / D + 1e-6) *
                                 (wp ? dsv4_bf16_to_f32(wp[i]) : 1.0);
        }
        check_close("rms_norm", out, ref, NULL, (int64_t)rows * D, BF16_RTOL, 0, 0);
        /* in place gives the same bits */
        memcpy(inpl, x, (size_t)rows * D * sizeof(float));
        assert_int_equal(be->ops->rms_norm(be, inpl, inpl, wp, rows, D, 1e-6f), DSV4_OK);
        assert_memory_equal(inpl, out, (size_t)rows * D * sizeof(float));
    }
    /* x is rounded to bf16 before the mean square: 1.004 -> 1.0078125 gives
     * 0.45117 (bf16); without the rounding the result is 0.44922 */
    x[0] = 1.004f;
    x[1] = 3.0f;
    assert_int_equal(be->ops->rms_norm(be, out, x, NULL, 1, 2, 1e-6f), DSV4_OK);
    assert_true(out[0] == bf(1.0078125 / sqrt((1.0078125 * 1.0078125 + 9.0) / 2 + 1e-6)));
    assert_true(out[0] == 0.451171875f);
    free(x);
    free(out);
    free(inpl);
    free(ref);
    free(w);
    dsv4_backend_destroy(be);
}

static void
test_rope(void **state)
{
    int T = 3, H = 2, rd = 16, off = 8;
    int64_t hs = 40, rs = 100;
    int32_t pos[3] = { 0, 7, 100000 };
    float freqs[8];
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);
    float *x = rand_bf16(T * rs, 1.0);
    float *y = malloc((size_t)T * rs * sizeof(float));
    double *ref = malloc((size_t)T * rs * sizeof(double));

    (void)state;
    for (int i = 0; i < rd / 2; i++)
        freqs[i] = (float)pow(10000.0, -2.0 * i / rd);
    memcpy(y, x, (size_t)T * rs * sizeof(float));
    assert_int_equal(be->ops->rope(be, y, pos, T, H, rs, hs, off, rd, freqs, 0), DSV4_OK);
    for (int64_t i = 0; i < T * rs; i++)
        ref[i] = x[i];
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < rd / 2; i++) {
                int64_t o = t * rs + h * hs + off + 2 * i;
                double ang = (float)pos[t] * freqs[i];   /* the fp32 angle */
                double a = x[o], b = x[o + 1];

                ref[o] = a * cos(ang) - b * sin(ang);
                ref[o + 1] = a * sin(ang) + b * cos(ang);
            }
        }
    }
    check_close("rope", y, ref, NULL, T * rs, BF16_RTOL, 0, 1e-6);
    /* inverse rotation returns the input within two bf16 roundings */
    assert_int_equal(be->ops->rope(be, y, pos, T, H, rs, hs, off, rd, freqs, 1), DSV4_OK);
    for (int64_t i = 0; i < T * rs; i++)
        ref[i] = x[i];
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < rd / 2; i++) {
                int64_t o = t * rs + h * hs + off + 2 * i;
                double m = hypot(x[o], x[o + 1]);

                assert_true(fabs(y[o] - x[o]) <= m / 64.0);
                assert_true(fabs(y[o + 1] - x[o + 1]) <= m / 64.0);
                y[o] = x[o];
                y[o + 1] = x[o + 1];
            }
        }
    }
    /* everything outside the rotated slices is untouched */
    assert_memory_equal(y, x, (size_t)T * rs * sizeof(float));
    free(x);
    free(y);
    free(ref);
    dsv4_backend_destroy(be);
}

static void
test_sims(void **state)
{
    struct dsv4_backend *ref = mkbe(DSV4_NUMERICS_REF, 2), *hf = mkbe(DSV4_NUMERICS_HF, 2);
    int rows = 4, n = 128;
    int64_t stride = 200;
    float *x = rand_f32(rows * stride, 3.0);
    float *a = malloc((size_t)rows * stride * sizeof(float));
    float *b = malloc((size_t)rows * stride * sizeof(float));

    (void)state;
    /* fp8_sim: each row's first n_cols simulated per block, the rest untouched */
    memcpy(a, x, (size_t)rows * stride * sizeof(float));
    memcpy(b, x, (size_t)rows * stride * sizeof(float));
    assert_int_equal(ref->ops->fp8_sim(ref, a, rows, stride, n, 64), DSV4_OK);
    for (int r = 0; r < rows; r++)
        dsv4_fp8_sim(b + r * stride, n, 64);
    assert_memory_equal(a, b, (size_t)rows * stride * sizeof(float));
    assert_memory_not_equal(a, x, (size_t)n * sizeof(float));
    assert_int_equal(hf->ops->fp8_sim(hf, b, rows, stride, n, 64), DSV4_OK);
    assert_memory_equal(a, b, (size_t)rows * stride * sizeof(float));

    /* hadamard_fp4: FP4_sim(bf16(H x)) per contiguous 128-vector */
    memcpy(a, x, (size_t)3 * 128 * sizeof(float));
    assert_int_equal(ref->ops->hadamard_fp4(ref, a, 3), DSV4_OK);
    for (int r = 0; r < 3; r++) {
        float h[128];

        for (int i = 0; i < 128; i++) {
            double s = 0.0;

            for (int k = 0; k < 128; k++)
                s += (__builtin_popcount((unsigned)(i & k)) & 1 ? -1.0 : 1.0) * x[r * 128 + k];
            h[i] = bf(s / sqrt(128.0));
        }
        dsv4_fp4_sim(h, 128, 32);
        /* the naive Hadamard may round differently in rare ties: allow one
         * FP4 step on a few values */
        for (int i = 0; i < 128; i++)
            assert_true(fabs(a[r * 128 + i] - h[i]) <= 0.25 * fabs(h[i]) + 1e-3 ||
                        a[r * 128 + i] == h[i]);
    }
    memcpy(b, x, (size_t)3 * 128 * sizeof(float));
    assert_int_equal(hf->ops->hadamard_fp4(hf, b, 3), DSV4_OK);
    assert_memory_equal(b, x, (size_t)3 * 128 * sizeof(float));
    free(x);
    free(a);
    free(b);
    dsv4_backend_destroy(ref);
    dsv4_backend_destroy(hf);
}

/* --- mHC ------------------------------------------------------------------------------------- */

struct hc_case {
    int T, n, D;
    float *X, *fn, *base, *scale;
    struct dsv4_hc_w w;
};

static void
hc_case_make(struct hc_case *c, int T, int n, int D, int M, int n_scale)
{
    c->T = T;
    c->n = n;
    c->D = D;
    c->X = rand_bf16((int64_t)T * n * D, 1.0);
    c->fn = rand_f32((int64_t)M * n * D, 0.05);
    c->base = rand_f32(M, 0.5);
    c->scale = rand_f32(n_scale, 1.0);
    c->w.fn = c->fn;
    c->w.base = c->base;
    c->w.scale = c->scale;
}

static void
hc_case_free(struct hc_case *c)
{
    free(c->X);
    free(c->fn);
    free(c->base);
    free(c->scale);
}

/* mix (M) of token t in double */
static void
ref_hc_mix(double *mix, const struct hc_case *c, int t, int M)
{
    int nD = c->n * c->D;
    const float *v = c->X + (int64_t)t * nD;
    double ss = 0.0;

    for (int i = 0; i < nD; i++)
        ss += (double)v[i] * v[i];
    for (int m = 0; m < M; m++) {
        double s = 0.0;

        for (int i = 0; i < nD; i++)
            s += (double)v[i] * c->fn[(int64_t)m * nD + i];
        mix[m] = s / sqrt(ss / nD + 1e-6);
    }
}

static double
sigm(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

static void
run_hc_pre_case(int iters, float hc_eps, float comb_scale)
{
    struct hc_case c;
    int T = 3, n = 4, D = 64, M = (2 + n) * n;
    double eps = hc_eps;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 3);
    float *xo = malloc((size_t)T * D * sizeof(float)), post[3 * 4], comb[3 * 16];
    double *rx = malloc((size_t)T * D * sizeof(double)), rpost[3 * 4], rcomb[3 * 16];

    hc_case_make(&c, T, n, D, M, 3);
    c.scale[2] *= comb_scale;
    assert_int_equal(be->ops->hc_pre(be, xo, post, comb, c.X, &c.w, T, n, D, iters, hc_eps,
                                     1e-6f), DSV4_OK);
    for (int t = 0; t < T; t++) {
        double mix[24], pre[4], C[4][4];

        ref_hc_mix(mix, &c, t, M);
        for (int k = 0; k < n; k++) {
            pre[k] = sigm(mix[k] * c.scale[0] + c.base[k]) + eps;
            rpost[t * n + k] = 2.0 * sigm(mix[n + k] * c.scale[1] + c.base[n + k]);
        }
        for (int j = 0; j < n; j++) {
            double mx = -INFINITY, s = 0.0;

            for (int k = 0; k < n; k++) {
                C[j][k] = mix[2 * n + j * n + k] * c.scale[2] + c.base[2 * n + j * n + k];
                mx = fmax(mx, C[j][k]);
            }
            for (int k = 0; k < n; k++)
                s += exp(C[j][k] - mx);
            for (int k = 0; k < n; k++)
                C[j][k] = exp(C[j][k] - mx) / s + eps;
        }
        for (int it = 0; it < iters; it++) {
            for (int pass = it == 0 ? 1 : 0; pass < 2; pass++) {
                for (int a = 0; a < n; a++) {
                    double s = 0.0;

                    for (int b = 0; b < n; b++)
                        s += pass == 0 ? C[a][b] : C[b][a];
                    for (int b = 0; b < n; b++) {
                        if (pass == 0)
                            C[a][b] /= s + eps;
                        else
                            C[b][a] /= s + eps;
                    }
                }
            }
        }
        for (int j = 0; j < n; j++)
            for (int k = 0; k < n; k++)
                rcomb[t * 16 + j * n + k] = C[j][k];
        for (int i = 0; i < D; i++) {
            double s = 0.0;

            for (int j = 0; j < n; j++)
                s += pre[j] * c.X[((int64_t)t * n + j) * D + i];
            rx[t * D + i] = s;
        }
        /* property: doubly stochastic (columns exact after the last step) */
        for (int a = 0; a < n && iters >= 20; a++) {
            double rsum = 0.0, csum = 0.0;

            for (int b = 0; b < n; b++) {
                rsum += comb[t * 16 + a * n + b];
                csum += comb[t * 16 + b * n + a];
            }
            assert_true(fabs(csum - 1.0) < 1e-4);
            assert_true(fabs(rsum - 1.0) < 1e-3);
        }
    }
    check_close("hc_pre post", post, rpost, NULL, T * n, 1e-5, 0, 1e-6);
    check_close("hc_pre comb", comb, rcomb, NULL, T * n * n, 1e-4, 0, 1e-6);
    check_close("hc_pre x", xo, rx, NULL, T * D, BF16_RTOL, 0, 1e-6);
    hc_case_free(&c);
    free(xo);
    free(rx);
    dsv4_backend_destroy(be);
}

static void
test_hc_pre(void **state)
{
    (void)state;
    run_hc_pre_case(20, 1e-6f, 1.0f);
    /* few iterations, a large eps and sharp logits: every step shows */
    run_hc_pre_case(3, 0.05f, 8.0f);
}

static void
test_hc_post_head(void **state)
{
    struct hc_case c;
    int T = 2, n = 4, D = 96;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);
    float *f = rand_bf16(T * D, 1.0), *post = rand_f32(T * n, 1.0), *comb = rand_f32(T * 16, 0.3);
    float *xo = malloc((size_t)T * n * D * sizeof(float));
    double *ref = malloc((size_t)T * n * D * sizeof(double));

    (void)state;
    hc_case_make(&c, T, n, D, n, 1);
    assert_int_equal(be->ops->hc_post(be, xo, f, c.X, post, comb, T, n, D), DSV4_OK);
    for (int t = 0; t < T; t++)
        for (int k = 0; k < n; k++)
            for (int i = 0; i < D; i++) {
                double s = (double)post[t * n + k] * f[t * D + i];

                for (int j = 0; j < n; j++)
                    s += (double)comb[t * 16 + j * n + k] * c.X[((int64_t)t * n + j) * D + i];
                ref[((int64_t)t * n + k) * D + i] = s;
            }
    check_close("hc_post", xo, ref, NULL, T * n * D, BF16_RTOL, 0, 1e-5);

    assert_int_equal(be->ops->hc_head(be, xo, c.X, &c.w, T, n, D, 1e-6f, 1e-6f), DSV4_OK);
    for (int t = 0; t < T; t++) {
        double mix[4];

        ref_hc_mix(mix, &c, t, n);
        for (int i = 0; i < D; i++) {
            double s = 0.0;

            for (int j = 0; j < n; j++)
                s += (sigm(mix[j] * c.scale[0] + c.base[j]) + 1e-6) *
                     c.X[((int64_t)t * n + j) * D + i];
            ref[t * D + i] = s;
        }
    }
    check_close("hc_head", xo, ref, NULL, T * D, BF16_RTOL, 0, 1e-6);
    hc_case_free(&c);
    free(f);
    free(post);
    free(comb);
    free(xo);
    free(ref);
    dsv4_backend_destroy(be);
}

/* --- compressor ------------------------------------------------------------------------------ */

/*
 * Stream n_tok tokens of two interleaved sequences (slot 1 gets `n_tok2`
 * tokens) through compress in two calls and compare every emitted entry with
 * the direct windowed softmax of model doc §3.3.4.
 */
static void
run_compress_case(int r, int d, int n_tok, int n_tok2, int threads)
{
    int c = r == 4 ? 2 : 1, cd = c * d, n_slots = 2;
    int T = n_tok + n_tok2;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, threads);
    float *a = rand_f32((int64_t)T * cd, 1.0), *z = rand_f32((int64_t)T * cd, 2.0);
    float *ape = rand_f32((int64_t)r * cd, 1.0);
    int64_t pool = (int64_t)c * r * cd;
    float *skv = be->ops->alloc(be, n_slots * pool * sizeof(float));
    float *sz = be->ops->alloc(be, n_slots * pool * sizeof(float));
    int n_emit = n_tok / r + n_tok2 / r;
    float *ent = calloc((size_t)n_emit * d, sizeof(float));
    double *ref = calloc((size_t)n_emit * d, sizeof(double));
    int32_t *slot = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4);
    int32_t *emit = malloc((size_t)T * 4), *tok_of = malloc((size_t)T * 4);
    int ne = 0, p0 = 0, p1 = 0;
    char what[64];

    /* interleave: two tokens of slot 0, one of slot 1, ... */
    for (int t = 0; t < T; t++) {
        int s = (p1 < n_tok2 && (t % 3 == 2 || p0 >= n_tok)) ? 1 : 0;
        int p = s == 0 ? p0++ : p1++;

        slot[t] = s;
        pos[t] = p;
        emit[t] = (p + 1) % r == 0 ? ne++ : -1;
    }
    assert_int_equal(ne, n_emit);
    assert_int_equal(be->ops->fill(be, skv, 0.0f, n_slots * pool), DSV4_OK);
    assert_int_equal(be->ops->fill(be, sz, -INFINITY, n_slots * pool), DSV4_OK);
    /* two calls, split in the middle */
    assert_int_equal(be->ops->compress(be, ent, skv, sz, a, z, ape, slot, pos, emit, T / 2, r,
                                       d), DSV4_OK);
    assert_int_equal(be->ops->compress(be, ent, skv, sz, a + (int64_t)(T / 2) * cd,
                                       z + (int64_t)(T / 2) * cd, ape, slot + T / 2,
                                       pos + T / 2, emit + T / 2, T - T / 2, r, d), DSV4_OK);
    /* direct form: row of (slot, position) */
    for (int t = 0; t < T; t++) {
        if (emit[t] < 0)
            continue;
        int w = pos[t] / r;

        for (int i = 0; i < T; i++)
            tok_of[i] = -1;
        for (int i = 0; i < T; i++)
            if (slot[i] == slot[t])
                tok_of[pos[i]] = i;
        for (int ch = 0; ch < d; ch++) {
            double lg[16], vl[16], mx = -INFINITY, den = 0.0, e = 0.0;
            int ns = 0;

            if (c == 2 && w > 0) {
                for (int q = 0; q < r; q++) {
                    int i = tok_of[(w - 1) * r + q];

                    lg[ns] = (double)z[(int64_t)i * cd + ch] + ape[q * cd + ch];
                    vl[ns++] = a[(int64_t)i * cd + ch];
                }
            }
            for (int q = 0; q < r; q++) {
                int i = tok_of[w * r + q];
                int col = (c == 2 ? d : 0) + ch;

                lg[ns] = (double)z[(int64_t)i * cd + col] + ape[q * cd + col];
                vl[ns++] = a[(int64_t)i * cd + col];
            }
            for (int q = 0; q < ns; q++)
                mx = fmax(mx, lg[q]);
            for (int q = 0; q < ns; q++)
                den += exp(lg[q] - mx);
            for (int q = 0; q < ns; q++)
                e += exp(lg[q] - mx) / den * vl[q];
            ref[(int64_t)emit[t] * d + ch] = e;
        }
    }
    snprintf(what, sizeof(what), "compress r=%d d=%d", r, d);
    check_close(what, ent, ref, NULL, (int64_t)n_emit * d, 1e-5, 0, 1e-6);
    free(a);
    free(z);
    free(ape);
    free(ent);
    free(ref);
    free(slot);
    free(pos);
    free(emit);
    free(tok_of);
    be->ops->free(be, skv);
    be->ops->free(be, sz);
    dsv4_backend_destroy(be);
}

static void
test_compress(void **state)
{
    (void)state;
    /* three windows of slot 0 (plus a partial one), two of slot 1 */
    run_compress_case(4, 40, 14, 8, 3);
    run_compress_case(8, 40, 24, 16, 2);
    run_compress_case(16, 8, 48, 17, 1);
}

/* --- indexer --------------------------------------------------------------------------------- */

static void
run_indexer_case(enum dsv4_numerics num)
{
    int T = 4, nh = 4, dI = 128, cap = 40, ratio = 4, K = 8, n_slots = 2;
    int32_t slot[4] = { 0, 1, 0, 1 }, pos[4] = { 150, 20, 3, 200 };
    struct dsv4_backend *be = mkbe(num, 3);
    float *q = rand_bf16((int64_t)T * nh * dI, 1.0), *w = rand_bf16(T * nh, 0.2);
    float *keys = rand_bf16((int64_t)n_slots * cap * dI, 1.0);
    int32_t sel[4 * 8];
    int ref_mode = num == DSV4_NUMERICS_REF;

    assert_int_equal(be->ops->indexer_topk(be, sel, q, w, keys, NULL, slot, pos, T, nh, dI, cap,
                                           ratio, K), DSV4_OK);
    for (int t = 0; t < T; t++) {
        int nv = (pos[t] + 1) / ratio < cap ? (pos[t] + 1) / ratio : cap;
        int kk = K < nv ? K : nv, chosen[64] = { 0 };
        double sc[64], tol, minsel = INFINITY;

        for (int e = 0; e < nv; e++) {
            double s = 0.0;

            for (int h = 0; h < nh; h++) {
                double dot = 0.0;

                for (int i = 0; i < dI; i++)
                    dot += (double)q[((int64_t)t * nh + h) * dI + i] *
                           keys[((int64_t)slot[t] * cap + e) * dI + i];
                s += (dot > 0 ? dot : 0) * w[t * nh + h];
            }
            sc[e] = s;
        }
        /* REF rounds dots, terms and sum to bf16: allow a few bf16 ulps */
        tol = ref_mode ? 0.03 : 1e-4;
        if (nv <= K) {   /* every valid entry, in index order, unscored */
            for (int i = 0; i < K; i++)
                assert_int_equal(sel[t * K + i], i < nv ? i : -1);
            continue;
        }
        for (int i = 0; i < K; i++) {
            if (i >= kk) {
                assert_int_equal(sel[t * K + i], -1);
                continue;
            }
            assert_true(sel[t * K + i] >= 0 && sel[t * K + i] < nv);
            assert_false(chosen[sel[t * K + i]]);
            chosen[sel[t * K + i]] = 1;
            minsel = fmin(minsel, sc[sel[t * K + i]]);
            if (i > 0)   /* decreasing score order */
                assert_true(sc[sel[t * K + i]] <= sc[sel[t * K + i - 1]] +
                            tol * (1.0 + fabs(sc[sel[t * K + i]])));
        }
        /* nothing left out scores clearly above the selection */
        for (int e = 0; e < nv; e++)
            if (!chosen[e])
                assert_true(sc[e] <= minsel + tol * (1.0 + fabs(minsel)));
    }
    free(q);
    free(w);
    free(keys);
    dsv4_backend_destroy(be);
}

static void
test_indexer(void **state)
{
    (void)state;
    run_indexer_case(DSV4_NUMERICS_HF);
    run_indexer_case(DSV4_NUMERICS_REF);
}

/* Equal scores: lower index first. */
static void
test_indexer_ties(void **state)
{
    int nh = 2, dI = 128, cap = 16, K = 5;
    int32_t slot = 0, pos = 39, sel[5];
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_HF, 2);
    float *q = rand_bf16(nh * dI, 1.0), w[2] = { 1.0f, 0.5f };
    float *keys = malloc((size_t)cap * dI * sizeof(float));
    float *k0 = rand_bf16(dI, 1.0);

    (void)state;
    for (int e = 0; e < cap; e++)
        memcpy(keys + e * dI, k0, (size_t)dI * sizeof(float));
    /* entry 6 strictly best, all others equal */
    for (int i = 0; i < dI; i++)
        keys[6 * dI + i] = q[i] + q[dI + i];
    assert_int_equal(be->ops->indexer_topk(be, &sel[0], q, w, keys, NULL, &slot, &pos, 1, nh, dI, cap,
                                           4, K), DSV4_OK);
    assert_int_equal(sel[0], 6);
    assert_int_equal(sel[1], 0);
    assert_int_equal(sel[2], 1);
    assert_int_equal(sel[3], 2);
    assert_int_equal(sel[4], 3);
    free(q);
    free(keys);
    free(k0);
    dsv4_backend_destroy(be);
}

/*
 * REF rounds the scores to bf16, HF does not: two entries scoring 1.0 and
 * 1.001 tie under REF (lower index first) and not under HF (top-1 of 2).
 */
static void
test_indexer_bf16_scores(void **state)
{
    int dI = 128, cap = 4;
    int32_t slot = 0, pos = 7, sel[1];
    float q[128] = { 1.0f }, w = 1.0f, keys[4 * 128] = { 0 };

    (void)state;
    keys[0] = 1.0f;
    keys[128] = 1.001f;
    for (int num = 0; num < 2; num++) {
        struct dsv4_backend *be = mkbe(num == 0 ? DSV4_NUMERICS_REF : DSV4_NUMERICS_HF, 1);

        assert_int_equal(be->ops->indexer_topk(be, sel, q, &w, keys, NULL, &slot, &pos, 1, 1, dI, cap,
                                               4, 1), DSV4_OK);
        assert_int_equal(sel[0], num == 0 ? 0 : 1);
        dsv4_backend_destroy(be);
    }
}

/*
 * Rows with at most K valid entries take them all in index order, without q
 * and w; a row with more and no q is refused.
 */
static void
test_indexer_all(void **state)
{
    int dI = 128, cap = 40, K = 8;
    int32_t slot[3] = { 0, 1, 0 }, pos[3] = { 31, 2, 12 }, sel[3 * 8];
    float *keys = rand_bf16((int64_t)2 * cap * dI, 1.0);
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);

    (void)state;
    memset(sel, 0x55, sizeof(sel));
    assert_int_equal(be->ops->indexer_topk(be, sel, NULL, NULL, keys, NULL, slot, pos, 3, 4, dI,
                                           cap, 4, K), DSV4_OK);
    for (int t = 0; t < 3; t++) {
        int nv = (pos[t] + 1) / 4;

        for (int i = 0; i < K; i++)
            assert_int_equal(sel[t * K + i], i < nv ? i : -1);
    }
    pos[1] = 36;   /* 9 valid entries > K */
    assert_int_equal(be->ops->indexer_topk(be, sel, NULL, NULL, keys, NULL, slot, pos, 3, 4, dI,
                                           cap, 4, K), DSV4_ERR_INVAL);
    free(keys);
    dsv4_backend_destroy(be);
}

/* --- attention ------------------------------------------------------------------------------- */

struct attn_case {
    int T, H, Dh, win, cap, ratio, K, n_slots;
    int32_t slot[5], pos[5], row0[5], pos0[5];
    float *q, *kv, *ring, *comp, *sink;
    int32_t *sel;
};

static void
attn_case_make(struct attn_case *c)
{
    static const int32_t slot[5] = { 0, 0, 0, 1, 1 }, pos[5] = { 9, 10, 11, 2, 3 };
    static const int32_t row0[5] = { 0, 0, 0, 3, 3 }, pos0[5] = { 9, 9, 9, 2, 2 };

    c->T = 5;
    c->H = 5;
    c->Dh = 32;
    c->win = 8;
    c->cap = 6;
    c->ratio = 4;
    c->K = 3;
    c->n_slots = 2;
    memcpy(c->slot, slot, sizeof(slot));
    memcpy(c->pos, pos, sizeof(pos));
    memcpy(c->row0, row0, sizeof(row0));
    memcpy(c->pos0, pos0, sizeof(pos0));
    c->q = rand_bf16((int64_t)c->T * c->H * c->Dh, 0.5);
    c->kv = rand_bf16((int64_t)c->T * c->Dh, 1.0);
    c->ring = rand_bf16((int64_t)c->n_slots * c->win * c->Dh, 1.0);
    c->comp = rand_bf16((int64_t)c->n_slots * c->cap * c->Dh, 1.0);
    c->sink = rand_f32(c->H, 1.0);
    c->sel = malloc((size_t)c->T * c->K * sizeof(int32_t));
    for (int t = 0; t < c->T; t++)
        for (int i = 0; i < c->K; i++)
            c->sel[t * c->K + i] = (t + i) % 3 == 2 ? -1 : (t * 2 + i) % c->cap;
}

static void
attn_case_free(struct attn_case *c)
{
    free(c->q);
    free(c->kv);
    free(c->ring);
    free(c->comp);
    free(c->sink);
    free(c->sel);
}

/* reference in double; mode 0 = window only, 1 = HCA (all entries), 2 = CSA (sel) */
static void
ref_attention(double *ref, const struct attn_case *c, int mode, int use_sink, float scale)
{
    for (int t = 0; t < c->T; t++) {
        const float *cand[64];
        int n = 0, p = c->pos[t], s = c->slot[t];

        for (int u = p - c->win + 1 < 0 ? 0 : p - c->win + 1; u <= p; u++)
            cand[n++] = u >= c->pos0[t] ? c->kv + (int64_t)(c->row0[t] + u - c->pos0[t]) * c->Dh
                                        : c->ring + ((int64_t)s * c->win + u % c->win) * c->Dh;
        if (mode == 1)
            for (int e = 0; e < (p + 1) / c->ratio; e++)
                cand[n++] = c->comp + ((int64_t)s * c->cap + e) * c->Dh;
        if (mode == 2)
            for (int i = 0; i < c->K; i++)
                if (c->sel[t * c->K + i] >= 0)
                    cand[n++] = c->comp + ((int64_t)s * c->cap + c->sel[t * c->K + i]) * c->Dh;
        for (int h = 0; h < c->H; h++) {
            const float *q = c->q + ((int64_t)t * c->H + h) * c->Dh;
            double sc[64], mx = -INFINITY, den = 0.0;

            for (int j = 0; j < n; j++) {
                double d = 0.0;

                for (int i = 0; i < c->Dh; i++)
                    d += (double)q[i] * cand[j][i];
                sc[j] = d * scale;
                mx = fmax(mx, sc[j]);
            }
            for (int j = 0; j < n; j++)
                den += exp(sc[j] - mx);
            if (use_sink)
                den += exp((double)c->sink[h] - mx);
            for (int i = 0; i < c->Dh; i++) {
                double o = 0.0;

                for (int j = 0; j < n; j++)
                    o += exp(sc[j] - mx) / den * cand[j][i];
                ref[((int64_t)t * c->H + h) * c->Dh + i] = o;
            }
        }
    }
}

static void
test_attention(void **state)
{
    struct attn_case c;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 3);
    float scale = 1.0f / sqrtf(32.0f);
    int64_t n;
    float *out;
    double *ref;

    (void)state;
    attn_case_make(&c);
    n = (int64_t)c.T * c.H * c.Dh;
    out = malloc((size_t)n * sizeof(float));
    ref = malloc((size_t)n * sizeof(double));
    for (int mode = 0; mode < 3; mode++) {
        char what[32];

        assert_int_equal(be->ops->attention(be, out, c.q, c.kv, c.ring,
                                            mode == 0 ? NULL : c.comp, NULL,
                                            mode == 2 ? c.sel : NULL, c.sink, c.slot, c.pos,
                                            c.row0, c.pos0, c.T, c.H, c.Dh, c.win, c.cap,
                                            c.ratio, c.K, scale), DSV4_OK);
        ref_attention(ref, &c, mode, 1, scale);
        snprintf(what, sizeof(what), "attention mode %d", mode);
        check_close(what, out, ref, NULL, n, BF16_RTOL, 0, 1e-6);
    }
    /* a huge negative sink is a plain softmax */
    for (int h = 0; h < c.H; h++)
        c.sink[h] = -1e30f;
    assert_int_equal(be->ops->attention(be, out, c.q, c.kv, c.ring, c.comp, NULL, NULL, c.sink,
                                        c.slot, c.pos, c.row0, c.pos0, c.T, c.H, c.Dh, c.win,
                                        c.cap, c.ratio, c.K, scale), DSV4_OK);
    ref_attention(ref, &c, 1, 0, scale);
    check_close("attention, no sink", out, ref, NULL, n, BF16_RTOL, 0, 1e-6);
    free(out);
    free(ref);
    attn_case_free(&c);
    dsv4_backend_destroy(be);
}

/*
 * Paged pools (backend.h, DSV4_PAGE_ENTRIES): attention over compressed
 * entries and the indexer's top-k read the same values through a shuffled
 * page table as through a contiguous pool, bit for bit.
 */
static void
test_paged_pools(void **state)
{
    enum { S = 3, PPS = 2, NP = 8, P = DSV4_PAGE_ENTRIES, CAP = PPS * P, T = 6, H = 4,
           DH = 64, WIN = 4, K = 20, NH = 2, DI = 128 };
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);
    int32_t pages[S * PPS], perm[NP], slot[T], pos[T], row0[T], pos0[T], sel[2][T * K];
    float *comp = rand_bf16((int64_t)S * CAP * DH, 1.0), *paged = calloc(NP * P * DH, 4);
    float *keys = rand_bf16((int64_t)S * CAP * DI, 1.0), *pkeys = calloc(NP * P * DI, 4);
    float *q = rand_bf16((int64_t)T * H * DH, 0.5), *kv = rand_bf16((int64_t)T * DH, 1.0);
    float *ring = rand_bf16((int64_t)S * WIN * DH, 1.0), *sink = rand_f32(H, 1.0);
    float *qi = rand_bf16((int64_t)T * NH * DI, 1.0), *wi = rand_bf16((int64_t)T * NH, 0.3);
    float *out[2];

    (void)state;
    for (int i = 0; i < NP; i++)
        perm[i] = i;
    for (int i = NP - 1; i > 0; i--) {
        int j = (int)(rng_u64() % (uint64_t)(i + 1)), x = perm[i];

        perm[i] = perm[j], perm[j] = x;
    }
    for (int i = 0; i < S * PPS; i++)
        pages[i] = perm[i];
    for (int s = 0; s < S; s++)
        for (int e = 0; e < CAP; e++) {
            int64_t r = dsv4_pool_row(pages, CAP, s, e);

            assert_true(r >= 0 && r < NP * P);
            memcpy(paged + r * DH, comp + ((int64_t)s * CAP + e) * DH, DH * 4);
            memcpy(pkeys + r * DI, keys + ((int64_t)s * CAP + e) * DI, DI * 4);
        }
    for (int t = 0; t < T; t++) {
        slot[t] = t % S;
        pos[t] = 100 + 70 * t;          /* up to 450: (pos+1)/4 < CAP */
        row0[t] = t;
        pos0[t] = pos[t];
    }
    for (int v = 0; v < 2; v++)
        assert_int_equal(be->ops->indexer_topk(be, sel[v], qi, wi, v ? pkeys : keys,
                                               v ? pages : NULL, slot, pos, T, NH, DI, CAP, 4,
                                               K), DSV4_OK);
    assert_memory_equal(sel[0], sel[1], sizeof(sel[0]));
    for (int mode = 0; mode < 2; mode++) {
        for (int v = 0; v < 2; v++) {
            out[v] = malloc((size_t)T * H * DH * 4);
            assert_int_equal(be->ops->attention(be, out[v], q, kv, ring, v ? paged : comp,
                                                v ? pages : NULL, mode ? sel[0] : NULL, sink,
                                                slot, pos, row0, pos0, T, H, DH, WIN, CAP, 4, K,
                                                0.125f), DSV4_OK);
        }
        assert_memory_equal(out[0], out[1], (size_t)T * H * DH * 4);
        free(out[0]);
        free(out[1]);
    }
    free(comp), free(paged), free(keys), free(pkeys), free(q), free(kv), free(ring);
    free(sink), free(qi), free(wi);
    dsv4_backend_destroy(be);
}

/* --- router, moe ----------------------------------------------------------------------------- */

static double
ref_sqsp(double l)
{
    return sqrt(l > 20 ? l : log1p(exp(l)));
}

static void
run_router_case(enum dsv4_numerics num, int hash)
{
    int T = 6, D = 64, E = 16, k = 4, V = 10;
    struct dsv4_backend *be = mkbe(num, 2);
    struct tw gate;
    float *x = rand_bf16(T * D, 1.0), *bias = rand_f32(E, 0.5), wts[6 * 4];
    int32_t ids[6 * 4], tokens[6];
    int64_t tid2eid[10 * 4];
    double logits[6 * 16], rw[6 * 4];

    tw_make(&gate, DSV4_WFMT_BF16, E, D);
    for (int t = 0; t < T; t++)
        tokens[t] = (t * 7) % V;
    for (int i = 0; i < V * k; i++)
        tid2eid[i] = (i * 5 + i / k) % E;
    assert_int_equal(be->ops->router(be, wts, ids, x, &gate.L, hash ? NULL : bias,
                                     hash ? tid2eid : NULL, tokens, T, k, 1.5f), DSV4_OK);
    ref_linear(logits, NULL, x, T, &gate, 0);
    for (int t = 0; t < T; t++) {
        double s[16], sum = 0.0;
        int rid[4];

        for (int e = 0; e < E; e++)
            s[e] = ref_sqsp(logits[t * E + e]);
        if (hash) {
            for (int j = 0; j < k; j++)
                rid[j] = (int)tid2eid[tokens[t] * k + j];
        } else {
            int used[16] = { 0 };

            for (int j = 0; j < k; j++) {
                int b = -1;

                for (int e = 0; e < E; e++)
                    if (!used[e] && (b < 0 || s[e] + bias[e] > s[b] + bias[b]))
                        b = e;
                used[b] = 1;
                rid[j] = b;
            }
        }
        for (int j = 0; j < k; j++) {
            assert_int_equal(ids[t * k + j], rid[j]);
            sum += s[rid[j]];
        }
        for (int j = 0; j < k; j++)
            rw[t * k + j] = s[rid[j]] / sum * 1.5;
    }
    check_close("router weights", wts, rw, NULL, T * k, 1e-5, 0, 0);
    tw_free(&gate);
    free(x);
    free(bias);
    dsv4_backend_destroy(be);
}

static void
test_router(void **state)
{
    (void)state;
    run_router_case(DSV4_NUMERICS_REF, 0);
    run_router_case(DSV4_NUMERICS_REF, 1);
    run_router_case(DSV4_NUMERICS_HF, 0);
}

/* Ties in s + bias go to the lower expert id. */
static void
test_router_ties(void **state)
{
    int D = 8, E = 6, k = 3;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 1);
    uint16_t gw[6 * 8] = { 0 };
    struct dsv4_linear gate = { gw, NULL, 6, 8, DSV4_WFMT_BF16 };
    float x[8] = { 1, 0, 0, 0, 0, 0, 0, 0 }, bias[6] = { 0, 1, 0, 1, 0, 1 }, wts[3];
    int32_t ids[3];

    (void)state;
    assert_int_equal(be->ops->router(be, wts, ids, x, &gate, bias, NULL, NULL, 1, k, 1.0f),
                     DSV4_OK);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 5);
    for (int j = 0; j < k; j++)
        assert_true(fabsf(wts[j] - 1.0f / 3.0f) < 1e-6f);
    (void)D;
    (void)E;
    dsv4_backend_destroy(be);
}

struct moe_case {
    int T, k, E, D, I;
    float lim;
    struct tw w[5][3];              /* experts 0..E-1 then the shared one; w1, w3, w2 */
    struct dsv4_expert_w ex[5];
    float *x, *wts;
    int32_t *ids;
};

static void
moe_case_make(struct moe_case *c)
{
    c->T = 5;
    c->k = 2;
    c->E = 4;
    c->D = 128;
    c->I = 256;
    c->lim = 0.4f;
    for (int e = 0; e <= c->E; e++) {
        enum dsv4_wfmt f = e < c->E ? DSV4_WFMT_FP4 : DSV4_WFMT_FP8;

        tw_make(&c->w[e][0], f, c->I, c->D);
        tw_make(&c->w[e][1], f, c->I, c->D);
        tw_make(&c->w[e][2], f, c->D, c->I);
        c->ex[e].w1 = c->w[e][0].L;
        c->ex[e].w3 = c->w[e][1].L;
        c->ex[e].w2 = c->w[e][2].L;
    }
    c->x = rand_bf16((int64_t)c->T * c->D, 2.0);
    c->wts = rand_f32((int64_t)c->T * c->k, 0.5);
    c->ids = malloc((size_t)c->T * c->k * sizeof(int32_t));
    for (int t = 0; t < c->T; t++) {
        c->ids[t * 2] = (3 * t + 1) % c->E;   /* pairs not sorted by id */
        c->ids[t * 2 + 1] = (c->ids[t * 2] + 1 + t % 3) % c->E;
    }
}

static void
moe_case_free(struct moe_case *c)
{
    for (int e = 0; e <= c->E; e++)
        for (int i = 0; i < 3; i++)
            tw_free(&c->w[e][i]);
    free(c->x);
    free(c->wts);
    free(c->ids);
}

/* One expert on token row x in double with the op's bf16 stages; y (D). */
static void
ref_expert(double *y, const struct moe_case *c, int e, const float *x, double wt, int quant,
           int *n_clamped)
{
    double *g = malloc((size_t)c->I * sizeof(double)), *u = malloc((size_t)c->I * sizeof(double));
    float *h = malloc((size_t)c->I * sizeof(float));

    ref_linear(g, NULL, x, 1, &c->w[e][0], quant);
    ref_linear(u, NULL, x, 1, &c->w[e][1], quant);
    for (int i = 0; i < c->I; i++) {
        double gv = bf(g[i]), uv = bf(u[i]);

        *n_clamped += gv > c->lim || fabs(uv) > c->lim;
        gv = fmin(gv, c->lim);
        uv = fmax(-c->lim, fmin(uv, c->lim));
        h[i] = bf(gv / (1.0 + exp(-gv)) * uv * wt);
    }
    ref_linear(y, NULL, h, 1, &c->w[e][2], quant);
    for (int i = 0; i < c->D; i++)
        y[i] = bf(y[i]);
    free(g);
    free(u);
    free(h);
}

static void
run_moe_case(enum dsv4_numerics num)
{
    struct moe_case c;
    struct dsv4_backend *be = mkbe(num, 3);
    float *out;
    double *ref, *y, rms = 0.0;
    int n_clamped = 0;

    moe_case_make(&c);
    out = malloc((size_t)c.T * c.D * sizeof(float));
    ref = calloc((size_t)c.T * c.D, sizeof(double));
    y = malloc((size_t)c.D * sizeof(double));
    assert_int_equal(be->ops->moe(be, out, c.x, c.ids, c.wts, c.ex, &c.ex[c.E], c.T, c.k, c.lim),
                     DSV4_OK);
    for (int t = 0; t < c.T; t++) {
        for (int j = 0; j <= c.k; j++) {
            int e = j < c.k ? c.ids[t * c.k + j] : c.E;

            ref_expert(y, &c, e, c.x + (int64_t)t * c.D, j < c.k ? c.wts[t * c.k + j] : 1.0,
                       num == DSV4_NUMERICS_REF, &n_clamped);
            for (int i = 0; i < c.D; i++)
                ref[t * c.D + i] += y[i];
        }
    }
    assert_true(n_clamped > 0);   /* the limit is exercised */
    for (int i = 0; i < c.T * c.D; i++)
        rms += ref[i] * ref[i];
    rms = sqrt(rms / (c.T * c.D));
    /* bf16 stages inside the experts may round differently: 2% of rms */
    check_close("moe", out, ref, NULL, (int64_t)c.T * c.D, BF16_RTOL, 0, 0.02 * rms);
    free(out);
    free(ref);
    free(y);
    moe_case_free(&c);
    dsv4_backend_destroy(be);
}

static void
test_moe(void **state)
{
    (void)state;
    run_moe_case(DSV4_NUMERICS_REF);
    run_moe_case(DSV4_NUMERICS_HF);
}

/* --- thread-count independence ------------------------------------------------------------- */

static void
test_threads_bitwise(void **state)
{
    struct dsv4_backend *b1 = mkbe(DSV4_NUMERICS_REF, 1), *b3 = mkbe(DSV4_NUMERICS_REF, 3);
    struct dsv4_backend *bes[2] = { b1, b3 };
    float *res[2][6];
    size_t sz[6];
    struct tw w;
    struct moe_case mc;
    struct attn_case ac;
    struct hc_case hc;
    int T = 70, N = 50, K = 256;
    float *x;

    (void)state;
    tw_make(&w, DSV4_WFMT_FP8, N, K);
    x = rand_bf16((int64_t)T * K, 1.0);
    moe_case_make(&mc);
    attn_case_make(&ac);
    hc_case_make(&hc, 3, 4, 64, 24, 3);
    sz[0] = (size_t)T * N * sizeof(float);
    sz[1] = (size_t)mc.T * mc.D * sizeof(float);
    sz[2] = (size_t)ac.T * ac.H * ac.Dh * sizeof(float);
    sz[3] = (size_t)(3 * 64 + 3 * 4 + 3 * 16) * sizeof(float);
    sz[4] = (size_t)4 * 8 * sizeof(int32_t);
    for (int b = 0; b < 2; b++) {
        struct dsv4_backend *be = bes[b];
        float *q = NULL, *wi = NULL, *keys = NULL;
        int32_t slot[4] = { 0, 1, 0, 1 }, pos[4] = { 150, 20, 3, 200 };

        for (int i = 0; i < 5; i++)
            res[b][i] = malloc(sz[i]);
        assert_int_equal(be->ops->linear(be, res[b][0], x, &w.L, T, 0), DSV4_OK);
        assert_int_equal(be->ops->moe(be, res[b][1], mc.x, mc.ids, mc.wts, mc.ex, &mc.ex[mc.E],
                                      mc.T, mc.k, mc.lim), DSV4_OK);
        assert_int_equal(be->ops->attention(be, res[b][2], ac.q, ac.kv, ac.ring, ac.comp, NULL,
                                            ac.sel, ac.sink, ac.slot, ac.pos, ac.row0, ac.pos0,
                                            ac.T, ac.H, ac.Dh, ac.win, ac.cap, ac.ratio, ac.K,
                                            0.17f),
                         DSV4_OK);
        assert_int_equal(be->ops->hc_pre(be, res[b][3], res[b][3] + 3 * 64,
                                         res[b][3] + 3 * 64 + 12, hc.X, &hc.w, 3, 4, 64, 20,
                                         1e-6f, 1e-6f), DSV4_OK);
        rng_state = 0x1234567ull;   /* same indexer inputs for both backends */
        q = rand_bf16(4 * 4 * 128, 1.0);
        wi = rand_bf16(4 * 4, 0.2);
        keys = rand_bf16(2 * 40 * 128, 1.0);
        assert_int_equal(be->ops->indexer_topk(be, (int32_t *)res[b][4], q, wi, keys, NULL,
                                               slot, pos, 4, 4, 128, 40, 4, 8), DSV4_OK);
        free(q);
        free(wi);
        free(keys);
    }
    for (int i = 0; i < 5; i++) {
        assert_memory_equal(res[0][i], res[1][i], sz[i]);
        free(res[0][i]);
        free(res[1][i]);
    }
    tw_free(&w);
    free(x);
    moe_case_free(&mc);
    attn_case_free(&ac);
    hc_case_free(&hc);
    dsv4_backend_destroy(b1);
    dsv4_backend_destroy(b3);
    /* the compressor partitions channels: 1 and 3 threads must agree too
     * (run_compress_case checks values; here it runs with both counts) */
    run_compress_case(4, 100, 12, 4, 1);
    run_compress_case(4, 100, 12, 4, 3);
}

/* --- sampling ------------------------------------------------------------------------------- */

static void
test_sample(void **state)
{
    int V = 1000, n = 3;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);
    float *lg = rand_f32((int64_t)n * V, 2.0), lp[3];
    struct dsv4_sample_params sp[3];
    /* first: zeroed for GCC's -Wmaybe-uninitialized under --coverage (it
     * cannot see that step 0 fills it before any later step reads it) */
    int32_t id[3], id2[3], first[3] = { 0, 0, 0 };
    int distinct = 0;

    (void)state;
    lg[V + 17] = 50.0f;          /* row 1: a tie at the top, lowest id wins */
    lg[V + 400] = 50.0f;
    memset(sp, 0, sizeof(sp));
    for (int r = 0; r < n; r++) {
        sp[r].top_p = 1.0f;
        sp[r].seed = 42 + r;
    }
    /* greedy = argmax; logprob = log-softmax */
    assert_int_equal(be->ops->sample(be, id, lp, lg, sp, n, V), DSV4_OK);
    for (int r = 0; r < n; r++) {
        int b = 0;
        double m, s = 0.0;

        for (int i = 1; i < V; i++)
            if (lg[r * V + i] > lg[r * V + b])
                b = i;
        assert_int_equal(id[r], b);
        m = lg[r * V + b];
        for (int i = 0; i < V; i++)
            s += exp((double)lg[r * V + i] - m);
        assert_true(fabs(lp[r] - ((double)lg[r * V + b] - m - log(s))) < 1e-5);
    }
    assert_int_equal(id[1], 17);
    /* a temperature below DSV4_SAMPLE_GREEDY_BELOW is greedy (1e-38 put
     * most z out of float's range and drew among them) */
    for (int r = 0; r < n; r++)
        sp[r].temperature = r == 0 ? 1e-38f : r == 1 ? 9.9e-6f : 1e-30f;
    for (int step = 0; step < 8; step++) {
        for (int r = 0; r < n; r++)
            sp[r].step = (uint64_t)step;
        assert_int_equal(be->ops->sample(be, id2, NULL, lg, sp, n, V), DSV4_OK);
        assert_memory_equal(id, id2, sizeof(id));
    }
    for (int r = 0; r < n; r++)
        sp[r].step = 0;
    /* top_k = 1 equals greedy, at any temperature */
    for (int r = 0; r < n; r++) {
        sp[r].temperature = 0.7f;
        sp[r].top_k = 1;
    }
    assert_int_equal(be->ops->sample(be, id2, NULL, lg, sp, n, V), DSV4_OK);
    assert_memory_equal(id, id2, sizeof(id));
    /* a tiny top_p keeps only the best token */
    for (int r = 0; r < n; r++) {
        sp[r].top_k = 0;
        sp[r].top_p = 1e-6f;
    }
    assert_int_equal(be->ops->sample(be, id2, NULL, lg, sp, n, V), DSV4_OK);
    assert_memory_equal(id, id2, sizeof(id));
    /* seeded draws: same (seed, step) -> same token; steps vary the draw */
    for (int r = 0; r < n; r++) {
        sp[r].temperature = 1.5f;
        sp[r].top_k = 50;
        sp[r].top_p = 0.9f;
    }
    for (int step = 0; step < 20; step++) {
        for (int r = 0; r < n; r++)
            sp[r].step = (uint64_t)step;
        assert_int_equal(be->ops->sample(be, id, NULL, lg, sp, n, V), DSV4_OK);
        assert_int_equal(be->ops->sample(be, id2, NULL, lg, sp, n, V), DSV4_OK);
        assert_memory_equal(id, id2, sizeof(id));
        if (step == 0)
            memcpy(first, id, sizeof(id));
        else
            distinct += id[0] != first[0] || id[2] != first[2];
    }
    assert_true(distinct > 0);
    /* bad parameters are rejected */
    sp[0].top_p = 0.0f;
    assert_int_equal(be->ops->sample(be, id, NULL, lg, sp, n, V), DSV4_ERR_INVAL);
    free(lg);
    dsv4_backend_destroy(be);
}

/*
 * NaN and +inf logits (a forward gone wrong): a NaN is -inf everywhere
 * (greedy skipped it except at id 0; one NaN made the mass NaN and every
 * draw the last id); +inf logits share the draw and the log-probability
 * (exp(inf - inf) was NaN: every draw the last id, never the +inf one).
 * Over 200 seeds, in id order and sorted (top_k, top_p < 1) alike.
 */
static void
test_sample_nonfinite(void **state)
{
    enum { V = 8, SEEDS = 200 };
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 1);
    float nan_row[V] = { NAN, 1, 2, NAN, 0, 0, 0, 0 };
    float inf_row[V] = { 1, 2, INFINITY, 0, 0, INFINITY, 0, 0 };
    struct dsv4_sample_params sp;
    int32_t id, tid[2];
    float lp, tlp[2];
    int seen[V];

    (void)state;
    memset(&sp, 0, sizeof(sp));
    sp.top_p = 1.0f;
    assert_int_equal(be->ops->sample(be, &id, &lp, nan_row, &sp, 1, V), DSV4_OK);
    assert_int_equal(id, 2);
    assert_true(isfinite(lp) && lp < 0.0f);
    assert_int_equal(be->ops->sample(be, &id, &lp, inf_row, &sp, 1, V), DSV4_OK);
    assert_int_equal(id, 2);
    assert_true(fabsf(lp - (float)-log(2.0)) < 1e-6f);   /* two +inf: half each */
    for (int mode = 0; mode < 3; mode++) {
        sp.temperature = 1.0f;
        sp.top_k = mode == 1 ? 4 : 0;
        sp.top_p = mode == 2 ? 0.999f : 1.0f;
        memset(seen, 0, sizeof(seen));
        for (int k = 0; k < SEEDS; k++) {
            sp.seed = (uint64_t)k;
            assert_int_equal(be->ops->sample(be, &id, NULL, nan_row, &sp, 1, V), DSV4_OK);
            assert_true(id != 0 && id != 3);   /* never a NaN */
            seen[id]++;
        }
        assert_true(seen[2] > seen[1] && seen[1] > 0);   /* e^2 : e^1 : e^0 ... */
        memset(seen, 0, sizeof(seen));
        for (int k = 0; k < SEEDS; k++) {
            sp.seed = (uint64_t)k;
            assert_int_equal(be->ops->sample(be, &id, &lp, inf_row, &sp, 1, V), DSV4_OK);
            assert_true(id == 2 || id == 5);   /* only the +inf ones */
            seen[id]++;
        }
        assert_true(seen[2] > SEEDS / 4 && seen[5] > SEEDS / 4);
    }
    /* sample_top: the same log-probabilities; a NaN last, as -inf */
    sp.n_top = 2;
    assert_int_equal(be->ops->sample_top(be, tid, tlp, inf_row, &sp, 1, V), DSV4_OK);
    assert_true(tid[0] == 2 && tid[1] == 5);
    assert_true(fabsf(tlp[0] - (float)-log(2.0)) < 1e-6f && tlp[1] == tlp[0]);
    assert_int_equal(be->ops->sample_top(be, tid, tlp, nan_row, &sp, 1, V), DSV4_OK);
    assert_true(tid[0] == 2 && tid[1] == 1 && isfinite(tlp[0]) && tlp[1] < tlp[0]);
    dsv4_backend_destroy(be);
}

/* Empirical frequencies follow softmax(logits / T) restricted by top_k. */
/*
 * sample_top against a sort of the row: the n_top best ids by (logit desc,
 * id asc; NaN as -inf), each with log-softmax at temperature 1 (the same
 * value sample gives its token), whatever the row's sampling; rows that do
 * not ask and entries past n_top (or past V) keep what was there.
 */
static void
test_sample_top(void **state)
{
    enum { N = 4 };
    int V = 300;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_REF, 2);
    float *lg = rand_f32((int64_t)N * V, 2.0), lp[N], tlp[N * DSV4_TOP_MAX];
    int32_t id[N], tid[N * DSV4_TOP_MAX];
    struct dsv4_sample_params sp[N];
    int want[N] = { 1, 7, 0, DSV4_TOP_MAX };

    (void)state;
    lg[3] = lg[250] = lg[99] = 9.0f;          /* row 0: a three-way tie, ids 3 99 250 */
    lg[V + 10] = NAN;                         /* row 1: NaN and -inf rank last */
    lg[V + 11] = -INFINITY;
    lg[V + 12] = lg[V + 13] = 7.5f;
    for (int i = 0; i < V; i++)               /* row 3: all equal but two */
        lg[3 * V + i] = 0.25f;
    lg[3 * V + 200] = 1.0f;
    lg[3 * V + 5] = -1.0f;
    memset(sp, 0, sizeof(sp));
    for (int r = 0; r < N; r++) {
        sp[r].top_p = 1.0f;
        sp[r].temperature = r == 3 ? 0.5f : 0.0f;
        sp[r].top_k = r == 1 ? 3 : 0;
        sp[r].n_top = want[r];
    }
    for (int i = 0; i < N * DSV4_TOP_MAX; i++) {
        tid[i] = -5;
        tlp[i] = 2.0f;
    }
    assert_int_equal(be->ops->sample(be, id, lp, lg, sp, N, V), DSV4_OK);
    assert_int_equal(be->ops->sample_top(be, tid, tlp, lg, sp, N, V), DSV4_OK);
    for (int r = 0; r < N; r++) {
        const float *l = lg + (int64_t)r * V;
        int32_t *ord = malloc((size_t)V * sizeof(int32_t));
        double m = -INFINITY, s = 0.0;

        assert_non_null(ord);
        for (int i = 0; i < V; i++) {
            ord[i] = i;
            if (l[i] > m)
                m = l[i];
        }
        for (int i = 0; i < V; i++)   /* a NaN as -inf: weighs 0 */
            s += isnan(l[i]) ? 0.0 : exp((double)l[i] - m);
        /* insertion sort by (logit desc, id asc), NaN as -inf */
        for (int i = 1; i < V; i++) {
            int32_t x = ord[i];
            float vx = isnan(l[x]) ? -INFINITY : l[x];
            int j = i - 1;

            while (j >= 0 && (isnan(l[ord[j]]) ? -INFINITY : l[ord[j]]) < vx) {
                ord[j + 1] = ord[j];
                j--;
            }
            ord[j + 1] = x;
        }
        for (int j = 0; j < DSV4_TOP_MAX; j++) {
            int at = r * DSV4_TOP_MAX + j;

            if (j >= want[r]) {
                assert_int_equal(tid[at], -5);
                assert_true(tlp[at] == 2.0f);
                continue;
            }
            assert_int_equal(tid[at], ord[j]);
            /* a NaN logit is -inf: the others' log-probabilities stay
             * finite (it made the row's sum NaN, and every one NaN) */
            if (isnan(l[ord[j]]))
                assert_true(tlp[at] == -INFINITY);
            else
                assert_true(fabs(tlp[at] - ((double)l[ord[j]] - m - log(s))) < 1e-5);
        }
        if (want[r] > 0 && sp[r].temperature == 0.0f) {
            assert_int_equal(tid[r * DSV4_TOP_MAX], id[r]);
            assert_true(tlp[r * DSV4_TOP_MAX] == lp[r] && !isnan(lp[r]));
        }
        free(ord);
    }
    assert_int_equal(tid[0], 3);
    assert_int_equal(tid[DSV4_TOP_MAX], 12);
    assert_int_equal(tid[3 * DSV4_TOP_MAX], 200);
    assert_int_equal(tid[3 * DSV4_TOP_MAX + 1], 0);
    /* fewer ids than asked: V of them */
    sp[0].n_top = 5;
    assert_int_equal(be->ops->sample_top(be, tid, tlp, lg, sp, 1, 3), DSV4_OK);
    assert_int_equal(tid[0] + tid[1] + tid[2], 0 + 1 + 2);   /* all three ids, then as was */
    assert_true(tid[0] != tid[1] && tid[1] != tid[2] && tid[0] != tid[2]);
    assert_int_equal(tid[3], -5);
    /* n_top out of range */
    sp[0].n_top = DSV4_TOP_MAX + 1;
    assert_int_equal(be->ops->sample_top(be, tid, tlp, lg, sp, 1, V), DSV4_ERR_INVAL);
    sp[0].n_top = -1;
    assert_int_equal(be->ops->sample_top(be, tid, tlp, lg, sp, 1, V), DSV4_ERR_INVAL);
    free(lg);
    dsv4_backend_destroy(be);
}

static void
test_sample_distribution(void **state)
{
    int V = 4, N = 4000;
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_HF, 1);
    float lg[4] = { 1.0f, 0.0f, 2.0f, -1.0f };
    struct dsv4_sample_params sp = { .temperature = 2.0f, .top_p = 1.0f, .top_k = 3,
                                      .seed = 7 };
    int count[4] = { 0 };
    double p[4], s = 0.0;

    (void)state;
    for (int step = 0; step < N; step++) {
        int32_t id;

        sp.step = (uint64_t)step;
        assert_int_equal(be->ops->sample(be, &id, NULL, lg, &sp, 1, V), DSV4_OK);
        count[id]++;
    }
    for (int i = 0; i < V; i++) {
        p[i] = i == 3 ? 0.0 : exp(lg[i] / 2.0);   /* token 3 is outside top_k = 3 */
        s += p[i];
    }
    for (int i = 0; i < V; i++) {
        double f = (double)count[i] / N;

        print_message("token %d: freq %.4f expected %.4f\n", i, f, p[i] / s);
        assert_true(fabs(f - p[i] / s) < 0.03);
    }
    assert_int_equal(count[3], 0);

    /* top_p: probabilities .5 .3 .15 .05 (temperature 1), top_p 0.7 keeps
     * the first two (0.5 < 0.7 <= 0.8), renormalised to .625 / .375 */
    lg[0] = (float)log(0.5);
    lg[1] = (float)log(0.3);
    lg[2] = (float)log(0.15);
    lg[3] = (float)log(0.05);
    sp.temperature = 1.0f;
    sp.top_k = 0;
    sp.top_p = 0.7f;
    memset(count, 0, sizeof(count));
    for (int step = 0; step < N; step++) {
        int32_t id;

        sp.step = (uint64_t)step;
        assert_int_equal(be->ops->sample(be, &id, NULL, lg, &sp, 1, V), DSV4_OK);
        count[id]++;
    }
    print_message("top_p: %d %d %d %d\n", count[0], count[1], count[2], count[3]);
    assert_true(fabs((double)count[0] / N - 0.625) < 0.03);
    assert_true(count[2] == 0 && count[3] == 0);
    dsv4_backend_destroy(be);
}

/* The same over a vocabulary of several spans (the sums of runs of 16 and
 * spans of 256 runs, backend.h): four live tokens in different runs and
 * spans, the rest -inf (weight 0), with and without a sorted order. */
static void
test_sample_distribution_spans(void **state)
{
    enum { V = 3 * DSV4_SAMPLE_RUN * DSV4_SAMPLE_SPAN + 77, N = 4000 };
    static const int tok[4] = { 5, 4096 + 17, 2 * 4096 + 4095, 3 * 4096 + 76 };
    static const double want[4] = { 0.1, 0.2, 0.3, 0.4 };
    struct dsv4_backend *be = mkbe(DSV4_NUMERICS_HF, 1);
    float *lg = malloc(V * sizeof(float));

    (void)state;
    for (int i = 0; i < V; i++)
        lg[i] = -INFINITY;
    for (int k = 0; k < 4; k++)
        lg[tok[k]] = (float)log(want[k]);
    for (int sorted = 0; sorted < 2; sorted++) {
        struct dsv4_sample_params sp = { .temperature = 1.0f,
                                          .top_p = sorted ? 0.999f : 1.0f, .seed = 99 };
        int count[4] = { 0 };

        for (int step = 0; step < N; step++) {
            int32_t id;
            int k;

            sp.step = (uint64_t)step;
            assert_int_equal(be->ops->sample(be, &id, NULL, lg, &sp, 1, V), DSV4_OK);
            for (k = 0; k < 4 && tok[k] != id; k++)
                ;
            assert_true(k < 4);   /* never a token of weight 0 */
            count[k]++;
        }
        for (int k = 0; k < 4; k++) {
            print_message("sorted %d token %d: freq %.4f expected %.4f\n", sorted, tok[k],
                          (double)count[k] / N, want[k]);
            assert_true(fabs((double)count[k] / N - want[k]) < 0.03);
        }
    }
    free(lg);
    dsv4_backend_destroy(be);
}

/*
 * The innermost loops are not instrumented under ASan (kernels/cpu/cpu.h,
 * CPU_HOT); their range checks on entry must still catch a read one element
 * past a heap buffer.  Each case runs in a child: in bounds it must exit 0,
 * one past the end it must die in ASan's report.  Skipped without ASan.
 */
enum hot_case { HOT_DOT, HOT_DOT4, HOT_DECODE_FP4, HOT_DECODE_FP8 };

static void
hot_child(enum hot_case c, int over)
{
    int n = 256;
    float *a = malloc((size_t)n * sizeof(float));
    float *out = malloc(CPU_LIN_NB * (size_t)n * sizeof(float));
    /* exactly 4 rows of weights and their scales: row 3 + over = 4 is past them */
    size_t wbytes = c == HOT_DECODE_FP4 ? 4 * (size_t)n / 2 : 4 * (size_t)n;
    size_t sbytes = c == HOT_DECODE_FP4 ? 4 * (size_t)n / 32 : (size_t)n / 128;
    struct dsv4_linear W = { .w = calloc(wbytes, 1), .scale = calloc(sbytes, 1), .n_out = 4,
                             .n_in = n,
                             .fmt = c == HOT_DECODE_FP4 ? DSV4_WFMT_FP4 : DSV4_WFMT_FP8 };
    volatile float sink;

    for (int i = 0; i < n; i++)
        a[i] = (float)i;
    switch (c) {
    case HOT_DOT:
        out[0] = cpu_dot(a + over, a, n);
        break;
    case HOT_DOT4:
        cpu_dot4(out, a, a, a, a, a + over, n);
        break;
    case HOT_DECODE_FP4:
    case HOT_DECODE_FP8:
        cpu_lin_decode(out, &W, 3 + over, 4 + over);
        break;
    }
    sink = out[0];
    (void)sink;
    _exit(0);
}

static void
test_hot_loops_checked(void **state)
{
    (void)state;
#if !defined(__SANITIZE_ADDRESS__)
    skip();
#endif
    for (int c = HOT_DOT; c <= HOT_DECODE_FP8; c++) {
        for (int over = 0; over <= 1; over++) {
            int st = 0;
            pid_t pid = fork();

            assert_true(pid >= 0);
            if (pid == 0) {
                if (over) {   /* ASan's report is expected: keep it out of the log */
                    int fd = open("/dev/null", O_WRONLY);

                    if (fd >= 0)
                        dup2(fd, 2);
                }
                hot_child((enum hot_case)c, over);
            }
            assert_int_equal(waitpid(pid, &st, 0), pid);
            print_message("hot loop case %d, %s: %s %d\n", c, over ? "one past" : "in bounds",
                          WIFEXITED(st) ? "exit" : "signal",
                          WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
            if (over)
                assert_false(WIFEXITED(st) && WEXITSTATUS(st) == 0);
            else
                assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        }
    }
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create),
        cmocka_unit_test(test_layout_ops),
        cmocka_unit_test(test_linear),
        cmocka_unit_test(test_linear_quant_matters),
        cmocka_unit_test(test_linear_row_independent),
        cmocka_unit_test(test_linear_column_independent),
        cmocka_unit_test(test_linear_grouped),
        cmocka_unit_test(test_rms_norm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_sims),
        cmocka_unit_test(test_hc_pre),
        cmocka_unit_test(test_hc_post_head),
        cmocka_unit_test(test_compress),
        cmocka_unit_test(test_indexer),
        cmocka_unit_test(test_indexer_ties),
        cmocka_unit_test(test_indexer_bf16_scores),
        cmocka_unit_test(test_indexer_all),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_paged_pools),
        cmocka_unit_test(test_router),
        cmocka_unit_test(test_router_ties),
        cmocka_unit_test(test_moe),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_sample),
        cmocka_unit_test(test_sample_top),
        cmocka_unit_test(test_sample_nonfinite),
        cmocka_unit_test(test_sample_distribution),
        cmocka_unit_test(test_sample_distribution_spans),
        cmocka_unit_test(test_hot_loops_checked),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
