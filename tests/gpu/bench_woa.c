/*
 * bench_woa.c — the grouped prefill GEMM of linear_grouped (wo_a;
 * fw_kernel's grouped mode, kernels/cuda/fast_gemm.cu,
 * kernels/cuda_gemm_grouped.h) against the exact op and against today's
 * path (the decode kernel fl_kernel in passes of 16 rows), on the flash
 * shape.
 *
 *   bench_woa [SEED]
 *
 * Shapes: wo_a of DeepSeek-V4-Flash (model doc: o_groups G = 8, R =
 * o_lora_rank 1024 rows per group, K = 8 heads x 512 = 4096 columns per
 * group; W (8192, 4096) FP8 with 128x128 E8M0 block scales, x (T, 32768))
 * and its half per rank at TP = 2 (wo_a/2: G = 4), at T = 64, 128, 256, 512, 2048.
 * Random weights (E4M3 codes without NaN, scales 2^-7..2^-3) and x
 * (normals, not bf16-valued: the op's rounding of x counts).
 *
 * Per case, with the fast kernels on:
 *   gemm    cuda_fast_gemm_grouped called directly (any T) on the T rows,
 *           on the path the op takes at this T: cuBLASLt (fast_blas.cu) from
 *           DSV4_CUDA_BLAS_MIN_T rows when DSV4_CUDA_BLAS is on, else
 *           fw_kernel's grouped mode (dsv4_cuda_set_blas for the case);
 *   op      linear_grouped as the forward calls it (the GEMM where
 *           cuda_fast_gemm_grouped_ok holds: T > 64 and the cost model;
 *           else fl_kernel);
 *   fl      linear_grouped with the GEMM switched off
 *           (dsv4_cuda_set_gemm_grouped(0): today's path).
 * Checked (any failure fails the case):
 *   bounds  gemm, op and fl against the exact op (fast kernels off) on
 *           N_SAMPLE rows spread over T: max |v - exact| / max |exact| <=
 *           2^-7 and >= 90% bit-identical values (bench_fast's bounds for
 *           the grouped decode linear);
 *   det     gemm twice: the same bits on all T rows;
 *   T-indep gemm's rows T/2 .. T-1 as a call of T - T/2 rows, and rows 0,
 *           T/2 + 1, T - 1 each alone (a call of one row), equal to the
 *           same rows of the call of T: bit for bit;
 *   op      when the op takes the GEMM: its output equals gemm's, bit for bit;
 *   written no NaN in gemm's or the op's T rows (outputs are cleared to NaN
 *           before every call, so a row left unwritten shows);
 *   replay  the op (switch on) recorded into a CUDA graph and launched
 *           twice leaves the plain call's bits (the forward does not graph
 *           prefill, but a graph must not change what the kernel computes).
 * A failure prints, on indented lines just before its case's line, the
 * first value off (token, output column o = group g, row j, the values),
 * for the bounds also the largest difference and which group slice of x
 * the first value off matches (host dot products of W's row o with each
 * slice: a wrong group offset shows as the value of another group).
 * Timed (CUDA events on the backend's stream, no graph, as prefill runs
 * it): median over N_TIMED of REPS back-to-back calls, µs per call, for
 * gemm, op and fl; TFLOP/s of gemm (2 T G R K); speedup = fl / op; and,
 * when DSV4_CUDA_BLAS is on, `other`: gemm on the other path (the
 * crossover that DSV4_CUDA_BLAS_MIN_T is chosen from).
 * Last line: PASS or FAIL.  Exit status: 0 pass, 1 fail, 77 no CUDA
 * device (or no sm_90 device: the GEMM is Hopper-only; on an sm_90 device
 * a refusal fails unless DSV4_CUDA_WGMMA or DSV4_CUDA_GEMM_GROUPED is off).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>   /* the device's compute capability */

#include "common/err.h"
#include "common/formats.h"
#include "common/weights.h"
#include "kernels/backend.h"
#include "kernels/cuda_fast.h"
#include "kernels/cuda_gemm_grouped.h"
#include "tests/gpu/gpu_test_util.h"   /* TRY, test_rng_*, test_cuda_open, test_dev_alloc */

#define R_ROWS 1024          /* o_lora_rank: weight rows per group */
#define K_COLS 4096          /* columns per group: 8 heads x head_dim 512 */
#define G_MAX 8              /* o_groups */
#define T_MAX 2048
#define N_SAMPLE 48          /* rows checked against the exact op */
#define N_TIMED 9
#define REPS 5               /* calls per timing */
#define BOUND 0x1p-7         /* max |v - exact| / max |exact| */
#define IDENT 0.90           /* least share of bit-identical values */

static const int t_list[] = { 64, 128, 256, 512, 2048 };
static const struct {
    const char *name;
    int G;
} shapes[] = { { "wo_a", 8 }, { "wo_a/2", 4 } };

static uint64_t rng;
static struct dsv4_backend *be;
static struct dsv4_cuda_timer *tm;

/* One weight with its host copy (for the diagnosis). */
struct woa {
    const char *name;
    struct dsv4_linear W;
    int G, N, K;
    int64_t GK;              /* x row length */
    uint8_t *hw, *hs;        /* host codes (N, K), scales (N/128, K/128) */
};

/* Whether the environment turns kernel switch `name` off ("0" or "off"). */
static int
switched_off(const char *name)
{
    const char *v = getenv(name);

    return v != NULL && (strcmp(v, "0") == 0 || strcmp(v, "off") == 0);
}

/* The case's device buffers and host copies. */
struct bufs {
    float *x, *xs, *out, *outs;   /* device: x (T_MAX, GK), sampled rows, outputs */
    const float *xh;              /* host copy of x */
    float *ref, *gemm, *op, *fl, *tmp, *rows;   /* host */
};

static void *
host_alloc(size_t bytes)
{
    void *p = malloc(bytes);

    if (p == NULL) {
        fprintf(stderr, "host allocation of %zu bytes failed\n", bytes);
        exit(1);
    }
    return p;
}

/* W (G * R_ROWS, K_COLS) FP8: codes with exponents 0..7 (no NaN), E8M0
 * scales 120..124. */
static struct woa
woa_make(const char *name, int G)
{
    struct woa w = { .name = name, .G = G, .N = G * R_ROWS, .K = K_COLS };
    size_t nw = (size_t)w.N * w.K, ns = (size_t)(w.N / 128) * (w.K / 128);

    w.GK = (int64_t)G * w.K;
    w.hw = host_alloc(nw);
    w.hs = host_alloc(ns);
    for (size_t i = 0; i < nw; i++)
        w.hw[i] = (uint8_t)test_rng_next(&rng) & 0xbf;
    for (size_t i = 0; i < ns; i++)
        w.hs[i] = (uint8_t)(120 + test_rng_next(&rng) % 5);
    w.W = (struct dsv4_linear){ .n_out = w.N, .n_in = w.K, .fmt = DSV4_WFMT_FP8 };
    w.W.w = test_dev_alloc(be, nw);
    w.W.scale = test_dev_alloc(be, ns);
    TRY("upload", be->ops->upload(be, (void *)(uintptr_t)w.W.w, w.hw, nw));
    TRY("upload", be->ops->upload(be, (void *)(uintptr_t)w.W.scale, w.hs, ns));
    return w;
}

static void
woa_free(struct woa *w)
{
    be->ops->free(be, (void *)(uintptr_t)w->W.w);
    be->ops->free(be, (void *)(uintptr_t)w->W.scale);
    free(w->hw);
    free(w->hs);
}

/* W's row o against bf16(x row t, group slice g), in double. */
static double
host_dot(const struct woa *w, const float *xh, int t, int o, int g)
{
    const uint8_t *wr = w->hw + (size_t)o * w->K;
    const float *xr = xh + (size_t)t * w->GK + (size_t)g * w->K;
    double s = 0;

    for (int c = 0; c < w->K; c++)
        s += (double)dsv4_fp8_to_f32(wr[c]) *
             dsv4_e8m0_to_f32(w->hs[(size_t)(o / 128) * (w->K / 128) + c / 128]) *
             dsv4_bf16_round(xr[c]);
    return s;
}

/* Which group slice of x a value v of (token t, column o) matches. */
static void
diag_groups(const struct woa *w, const float *xh, int t, int o, float v)
{
    int R = w->N / w->G, best = 0;
    double bd = INFINITY;

    printf("     diag token %d column %d (group %d row %d) value %.8g; W row . x group slice:",
           t, o, o / R, o % R, v);
    for (int g = 0; g < w->G; g++) {
        double d = host_dot(w, xh, t, o, g);

        printf(" g%d %.6g", g, d);
        if (fabs(d - v) < bd) {
            bd = fabs(d - v);
            best = g;
        }
    }
    printf("; closest: group %d%s\n", best, best == o / R ? " (its own)" : " (ANOTHER group)");
}

/* n = min(T, N_SAMPLE) distinct rows spread over 0 .. T-1 (first and last). */
static int
sample_rows(int T, int *rows)
{
    int n = T < N_SAMPLE ? T : N_SAMPLE;

    for (int i = 0; i < n; i++)
        rows[i] = n > 1 ? (int)((int64_t)i * (T - 1) / (n - 1)) : 0;
    return n;
}

/* Rows rows[0..n) of full (rows of N) into dst (n, N). */
static void
gather(float *dst, const float *full, const int *rows, int n, int N)
{
    for (int i = 0; i < n; i++)
        memcpy(dst + (size_t)i * N, full + (size_t)rows[i] * N, (size_t)N * sizeof(float));
}

/*
 * v (n, N) against the exact ref on the sampled rows: 1 within BOUND and
 * IDENT; prints the figures (tag), and on failure the first value off and
 * its group diagnosis.
 */
static int
vs_exact(const char *tag, const struct woa *w, const struct bufs *b, const float *v,
         const int *rows, int n, char *line, size_t len)
{
    size_t m = (size_t)n * w->N, ident = 0, first = m, worst = 0;
    double maxd = 0, maxr = 0, rel;
    int ok;

    for (size_t i = 0; i < m; i++) {
        double d = fabs((double)v[i] - b->ref[i]);

        if (isnan(d))
            d = INFINITY;   /* a NaN is the largest difference */
        if (d > maxd) {
            maxd = d;
            worst = i;
        }
        maxr = fmax(maxr, fabs((double)b->ref[i]));
        ident += memcmp(&v[i], &b->ref[i], sizeof(float)) == 0;
    }
    rel = maxr > 0 ? maxd / maxr : maxd;
    ok = maxr > 0 && rel <= BOUND && (double)ident / m >= IDENT;
    snprintf(line, len, "%s maxrel %.2e ident %5.1f%%", tag, rel, 100.0 * ident / m);
    if (ok)
        return 1;
    for (size_t i = 0; i < m && first == m; i++)
        if (!(fabs((double)v[i] - b->ref[i]) <= BOUND * maxr))
            first = i;
    printf("     %s %s: maxrel %.3e (bound %.1e), %zu of %zu identical (min %.0f%%), max "
           "|exact| %.6g; largest difference at token %d column %d: %.8g exact %.8g\n",
           w->name, tag, rel, BOUND, ident, m, 100 * IDENT, maxr, rows[worst / w->N],
           (int)(worst % w->N), v[worst], b->ref[worst]);
    if (first < m) {
        int t = rows[first / w->N], o = (int)(first % w->N);

        printf("     %s %s: first value out of bounds: token %d column %d: %.8g exact %.8g\n",
               w->name, tag, t, o, v[first], b->ref[first]);
        diag_groups(w, b->xh, t, o, v[first]);
    }
    return 0;
}

/* 1 when a and b (n values of rows of N, row 0 = token t0) hold the same
 * bits; else prints the first difference. */
static int
same_bits(const char *what, const struct woa *w, const float *a, const float *b, size_t n,
          int t0)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            printf("     %s %s: first difference at token %d column %d: %.8g vs %.8g\n",
                   w->name, what, t0 + (int)(i / w->N), (int)(i % w->N), a[i], b[i]);
            return 0;
        }
    return 1;
}

/* 1 when none of the n values (rows of N) is NaN (every output written:
 * the outputs are cleared to NaN before each call); else prints the first. */
static int
written(const char *what, const struct woa *w, const float *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (isnan(v[i])) {
            printf("     %s %s: token %d column %d is NaN (not written?)\n", w->name, what,
                   (int)(i / w->N), (int)(i % w->N));
            return 0;
        }
    return 1;
}

/* One linear_grouped call of a case (the thing timed). */
struct call {
    int kind;   /* 0: the GEMM directly, 1: the op (switch on), 2: the op (switch off) */
    const struct woa *w;
    float *out;
    const float *x;
};

static enum dsv4_err
call_run(const struct call *c, int T)
{
    if (c->kind == 0)
        return cuda_fast_gemm_grouped(be, c->out, c->x, &c->w->W, T, c->w->G);
    dsv4_cuda_set_gemm_grouped(c->kind == 1);
    return be->ops->linear_grouped(be, c->out, c->x, &c->w->W, T, c->w->G);
}

/* NaN in c's T output rows (so that rows a call fails to write show). */
static void
call_clear(const struct call *c, int T)
{
    TRY("fill", be->ops->fill(be, c->out, NAN, (int64_t)T * c->w->N));
}

/* c's output (T rows) on the host. */
static void
call_get(const struct call *c, int T, float *host)
{
    call_clear(c, T);
    TRY("linear_grouped", call_run(c, T));
    TRY("download", be->ops->download(be, host, c->out, (size_t)T * c->w->N * sizeof(float)));
}

static int
cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;

    return x < y ? -1 : x > y;
}

/* Median µs per call of c at T (plain stream, REPS calls per event pair). */
static double
call_time(const struct call *c, int T)
{
    float ms[N_TIMED];

    TRY("warm-up", call_run(c, T));
    for (int i = 0; i < N_TIMED; i++) {
        TRY("timer", dsv4_cuda_timer_start(tm));
        for (int r = 0; r < REPS; r++)
            TRY("linear_grouped", call_run(c, T));
        TRY("timer", dsv4_cuda_timer_stop(tm, &ms[i]));
    }
    qsort(ms, N_TIMED, sizeof(float), cmp_float);
    return ms[N_TIMED / 2] * 1e3 / REPS;
}

/* c recorded into a graph, its output cleared, the graph launched twice;
 * the output then into host. */
static void
call_replay(const struct call *c, int T, float *host)
{
    void *g = NULL;

    TRY("graph_begin", be->ops->graph_begin(be));
    TRY("linear_grouped (recording)", call_run(c, T));
    TRY("graph_end", be->ops->graph_end(be, &g));
    call_clear(c, T);
    TRY("graph_launch", be->ops->graph_launch(be, g));
    TRY("graph_launch", be->ops->graph_launch(be, g));
    TRY("download", be->ops->download(be, host, c->out, (size_t)T * c->w->N * sizeof(float)));
    be->ops->graph_free(be, g);
}

/* T-independence: gemm's rows T/2 .. T-1 as one call, and three rows alone,
 * against b->gemm (the call of T rows). */
static int
t_indep(const struct woa *w, struct bufs *b, int T)
{
    int h = T / 2, single[3] = { 0, h + 1 < T ? h + 1 : T - 1, T - 1 }, ok = 1;
    struct call c = { 0, w, b->out, b->x + (size_t)h * w->GK };

    call_get(&c, T - h, b->tmp);
    ok &= same_bits("T-indep (rows T/2.. as a call of T/2)", w, b->gemm + (size_t)h * w->N,
                    b->tmp, (size_t)(T - h) * w->N, h);
    for (int i = 0; i < 3; i++) {
        c.x = b->x + (size_t)single[i] * w->GK;
        call_get(&c, 1, b->tmp);
        ok &= same_bits("T-indep (row alone)", w, b->gemm + (size_t)single[i] * w->N, b->tmp,
                        (size_t)w->N, single[i]);
    }
    return ok;
}

/* One case: w at T rows.  Returns 1 when every check holds. */
static int
run_case(const struct woa *w, struct bufs *b, int T)
{
    int rows[N_SAMPLE], n = sample_rows(T, rows), N = w->N;
    int to_gemm, ok_g, ok_o, ok_f, det, tind, op_same = 1, replay, wr, ok;
    size_t m = (size_t)T * N;
    struct call cg = { 0, w, b->out, b->x }, co = { 1, w, b->out, b->x };
    struct call cf = { 2, w, b->out, b->x };
    char lg[96], lo[96], lf[96];
    double us_g, us_o, us_f, us_alt = 0;
    int blas_env = dsv4_cuda_blas_on(), blas = blas_env && T >= DSV4_CUDA_BLAS_MIN_T;

    /* exact: the sampled rows gathered */
    for (int j = 0; j < n; j++)
        TRY("upload", be->ops->upload(be, b->xs + (size_t)j * w->GK,
                                      b->xh + (size_t)rows[j] * w->GK,
                                      (size_t)w->GK * sizeof(float)));
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 0));
    TRY("exact linear_grouped", be->ops->linear_grouped(be, b->outs, b->xs, &w->W, n, w->G));
    TRY("download", be->ops->download(be, b->ref, b->outs, (size_t)n * N * sizeof(float)));
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));

    dsv4_cuda_set_blas(blas);   /* gemm on the op's path at this T */
    call_get(&cg, T, b->gemm);
    gather(b->rows, b->gemm, rows, n, N);
    ok_g = vs_exact("gemm", w, b, b->rows, rows, n, lg, sizeof(lg));
    call_get(&cg, T, b->tmp);
    det = same_bits("det (gemm twice)", w, b->gemm, b->tmp, m, 0);
    tind = t_indep(w, b, T);

    dsv4_cuda_set_gemm_grouped(1);
    to_gemm = cuda_fast_gemm_grouped_ok(be, &w->W, T, w->G);
    call_get(&co, T, b->op);
    gather(b->rows, b->op, rows, n, N);
    ok_o = vs_exact("op", w, b, b->rows, rows, n, lo, sizeof(lo));
    if (to_gemm)
        op_same = same_bits("op == gemm", w, b->op, b->gemm, m, 0);
    call_replay(&co, T, b->tmp);
    replay = same_bits("replay", w, b->op, b->tmp, m, 0);

    call_get(&cf, T, b->fl);
    gather(b->rows, b->fl, rows, n, N);
    ok_f = vs_exact("fl", w, b, b->rows, rows, n, lf, sizeof(lf));

    us_g = call_time(&cg, T);
    us_o = call_time(&co, T);
    us_f = call_time(&cf, T);
    if (blas_env) {
        dsv4_cuda_set_blas(!blas);
        us_alt = call_time(&cg, T);
    }
    dsv4_cuda_set_blas(-1);
    dsv4_cuda_set_gemm_grouped(-1);

    wr = written("gemm", w, b->gemm, m) && written("op", w, b->op, m);
    ok = ok_g && ok_o && ok_f && det && tind && op_same && replay && wr;
    printf("%s %-6s G=%d T=%-4d op->%-4s gemm=%-4s | %s | %s | %s | det %s T-indep %s "
           "op==gemm %s replay %s written %s | gemm %8.1f us %6.1f TFLOP/s  op %8.1f us  "
           "fl %8.1f us  speedup %.2f  other %8.1f us\n",
           ok ? "PASS" : "FAIL", w->name, w->G, T, to_gemm ? "gemm" : "fl", blas ? "blas" : "fw",
           lg, lo, lf,
           det ? "yes" : "NO", tind ? "yes" : "NO",
           to_gemm ? (op_same ? "yes" : "NO") : "-", replay ? "yes" : "NO", wr ? "yes" : "NO",
           us_g,
           2.0 * T * N * w->K / (us_g * 1e-6) / 1e12, us_o, us_f, us_f / us_o, us_alt);
    fflush(stdout);
    return ok;
}

int
main(int argc, char **argv)
{
    size_t gk = (size_t)G_MAX * K_COLS, nx = (size_t)T_MAX * gk, no = (size_t)T_MAX * G_MAX *
                                                                       R_ROWS;
    float *xh;
    struct bufs b;
    int pass = 0, fail = 0;
    enum dsv4_err e;

    rng = argc > 1 ? strtoull(argv[1], NULL, 10) : 20261130ull;
    test_cuda_open(&be, &tm);
    printf("bench_woa: seed %llu; linear_grouped (wo_a) on the grouped GEMM (gemm: called "
           "directly; op: the op, GEMM on; fl: the op, GEMM off = fl_kernel passes) against "
           "the exact op on %d sampled rows (bound %.1e, identical >= %.0f%%); us per call "
           "(median of %d x %d calls, no graph)\n",
           (unsigned long long)rng, N_SAMPLE, BOUND, 100 * IDENT, N_TIMED, REPS);

    xh = host_alloc(nx * sizeof(float));
    for (size_t i = 0; i < nx; i++)
        xh[i] = test_rng_normal(&rng);
    memset(&b, 0, sizeof(b));
    b.xh = xh;
    b.x = test_dev_alloc(be, nx * sizeof(float));
    TRY("upload", be->ops->upload(be, b.x, xh, nx * sizeof(float)));
    b.xs = test_dev_alloc(be, (size_t)N_SAMPLE * gk * sizeof(float));
    b.out = test_dev_alloc(be, no * sizeof(float));
    b.outs = test_dev_alloc(be, (size_t)N_SAMPLE * G_MAX * R_ROWS * sizeof(float));
    b.ref = host_alloc((size_t)N_SAMPLE * G_MAX * R_ROWS * sizeof(float));
    b.rows = host_alloc((size_t)N_SAMPLE * G_MAX * R_ROWS * sizeof(float));
    b.gemm = host_alloc(no * sizeof(float));
    b.op = host_alloc(no * sizeof(float));
    b.fl = host_alloc(no * sizeof(float));
    b.tmp = host_alloc(no * sizeof(float));

    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        struct woa w = woa_make(shapes[s].name, shapes[s].G);

        /* x as (T_MAX, G * K) for this G: the first rows of the host array */
        TRY("upload", be->ops->upload(be, b.x, xh, (size_t)T_MAX * w.GK * sizeof(float)));
        TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
        e = cuda_fast_gemm_grouped(be, b.out, b.x, &w.W, 1, w.G);
        if (e == DSV4_ERR_NOTSUP) {
            int major = 0;

            /* the GEMM is Hopper's: a refusal there is a failure, not a
             * skip, unless the environment turned it off */
            if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) ==
                    cudaSuccess && major == 9 && !switched_off("DSV4_CUDA_WGMMA") &&
                !switched_off("DSV4_CUDA_GEMM_GROUPED")) {
                printf("bench_woa: the grouped GEMM refused on an sm_90 device: %s\nFAIL\n",
                       dsv4_errmsg());
                return 1;
            }
            printf("skip: %s (the grouped GEMM needs an sm_90 device)\n", dsv4_errmsg());
            return 77;
        }
        TRY("grouped gemm", e);
        for (size_t i = 0; i < sizeof(t_list) / sizeof(t_list[0]); i++) {
            if (run_case(&w, &b, t_list[i]))
                pass++;
            else
                fail++;
        }
        woa_free(&w);
    }
    printf("bench_woa: %d passed, %d failed\n%s\n", pass, fail, fail ? "FAIL" : "PASS");
    be->ops->free(be, b.x);
    be->ops->free(be, b.xs);
    be->ops->free(be, b.out);
    be->ops->free(be, b.outs);
    free(b.ref);
    free(b.rows);
    free(b.gemm);
    free(b.op);
    free(b.fl);
    free(b.tmp);
    free(xh);
    dsv4_cuda_timer_destroy(tm);
    dsv4_backend_destroy(be);
    return fail ? 1 : 0;
}
