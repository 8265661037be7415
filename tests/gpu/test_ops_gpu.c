/*
 * test_ops_gpu.c — every op of kernels/backend.h on the CUDA backend against
 * the CPU reference backend, on fresh random inputs (seed from argv[1] or the
 * clock; printed so a failure can be replayed).
 *
 * Each check compares the CUDA result with the CPU result by
 *   err = max |gpu - cpu| / max |cpu|
 * and prints it with the fraction of bit-identical values; it fails when err
 * exceeds the bound written next to the check, or when the NaN pattern
 * differs.  Bounds: the CUDA kernels do the CPU's fp32 operations in the same
 * order (kernels/cuda/cuda.cuh), so most ops must agree exactly (bound 0).
 * Where an exponential or a cosine enters, CUDA evaluates it through double
 * and glibc's expf may differ by one ulp, which can flip one bf16 rounding of
 * the output: bound 2^-7 relative to the largest value (one bf16 ulp) for
 * bf16 outputs, 1e-5 for fp32 outputs.  Index outputs (top-k, router ids,
 * sampled tokens) must be identical.  With DSV4_CUDA_KERNELS=fast the fast
 * rms_norm sums a row's squares in another fixed order (fast_norm.cu), so its
 * checks allow one bf16 ulp there (norm_bound), and the fast grouped linear
 * adds its K slices in its own order (fast_linear.cu), so linear_grouped
 * allows 1e-5 there (grouped_bound).  The other linear cases use shapes the
 * fast linear does not take (N not a multiple of 32 or 16): exact under both.
 * One check compares the CUDA backend with itself: linear_norm_rope at a
 * prefill size against its composition (the same bits required).
 *
 * Exit status: 0 all pass, 1 a failure, 77 no CUDA device (meson: skipped).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/formats.h"
#include "kernels/backend.h"
#include "kernels/cuda_fast.h"   /* dsv4_cuda_get_kernels */

#define BF16_ULP (1.0 / 128.0)
#define F32_TOL 1e-5

static struct dsv4_backend *cpu, *gpu;
static int n_fail;

/* The bound of the rms_norm checks: 0 (the exact kernels sum in the CPU's
 * order), one bf16 ulp with the fast kernels on (DSV4_CUDA_KERNELS=fast: a
 * tree of its own, the rsqrt may differ in its last bit and flip one bf16
 * rounding). */
static double
norm_bound(void)
{
    return dsv4_cuda_get_kernels(gpu) ? BF16_ULP : 0;
}

/* The bound of the linear_grouped check: 0 (the exact kernel sums K in the
 * CPU's order), F32_TOL with the fast kernels on (the tile kernel of
 * fast_linear.cu splits K into slices added in slice order: the same values
 * summed in another order). */
static double
grouped_bound(void)
{
    return dsv4_cuda_get_kernels(gpu) ? F32_TOL : 0;
}

/* --- random inputs -------------------------------------------------------------------- */

static uint64_t rng_state;

static uint64_t
rng_u64(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* uniform in [-1, 1) */
static float
rng_sym(void)
{
    return (float)((double)(rng_u64() >> 11) / 4503599627370496.0 - 1.0);
}

static int
rng_int(int n)
{
    return (int)(rng_u64() % (uint64_t)n);
}

/* n floats uniform in [-a, a), rounded to bf16 (activations) */
static float *
rand_bf16(int64_t n, float a)
{
    float *x = malloc((size_t)n * sizeof(float) + 4);

    for (int64_t i = 0; i < n; i++)
        x[i] = dsv4_bf16_round(a * rng_sym());
    return x;
}

/* n fp32 values uniform in [-a, a) */
static float *
rand_f32(int64_t n, float a)
{
    float *x = malloc((size_t)n * sizeof(float) + 4);

    for (int64_t i = 0; i < n; i++)
        x[i] = a * rng_sym();
    return x;
}

/* --- buffers on both backends ----------------------------------------------------------- */

/* The same data on the CPU (c) and the CUDA (g) backend. */
struct pair {
    void *c, *g;
    size_t bytes;
};

static struct pair
pair_new(const void *init, size_t bytes)
{
    struct pair p = { cpu->ops->alloc(cpu, bytes), gpu->ops->alloc(gpu, bytes), bytes };

    if (p.c == NULL || p.g == NULL) {
        fprintf(stderr, "allocation of %zu bytes failed\n", bytes);
        exit(1);
    }
    if (init != NULL) {
        cpu->ops->upload(cpu, p.c, init, bytes);
        gpu->ops->upload(gpu, p.g, init, bytes);
    }
    return p;
}

static void
pair_free(struct pair *p)
{
    cpu->ops->free(cpu, p->c);
    gpu->ops->free(gpu, p->g);
}

/* The CUDA side's bytes (host copy, malloc'd). */
static void *
pair_gpu(const struct pair *p)
{
    void *h = malloc(p->bytes + 4);

    if (gpu->ops->download(gpu, h, p->g, p->bytes) != DSV4_OK ||
        gpu->ops->sync(gpu) != DSV4_OK) {
        fprintf(stderr, "download failed: %s\n", dsv4_errmsg());
        exit(1);
    }
    return h;
}

/* The CPU side's bytes copied to the CUDA side (after an in-place op whose
 * bound allows a difference, so the next check sees only its own op's). */
static void
pair_sync(struct pair *p)
{
    void *h = malloc(p->bytes + 4);

    if (cpu->ops->download(cpu, h, p->c, p->bytes) != DSV4_OK ||
        gpu->ops->upload(gpu, p->g, h, p->bytes) != DSV4_OK) {
        fprintf(stderr, "pair_sync failed: %s\n", dsv4_errmsg());
        exit(1);
    }
    free(h);
}

/* A float pair filled with NaN (poison: every output must be written). */
static struct pair
pair_poison(int64_t n)
{
    float *h = malloc((size_t)n * sizeof(float) + 4);
    struct pair p;

    for (int64_t i = 0; i < n; i++)
        h[i] = NAN;
    p = pair_new(h, (size_t)n * sizeof(float));
    free(h);
    return p;
}

/* --- checks ---------------------------------------------------------------------------- */

static void
check_status(const char *what, enum dsv4_err ec, enum dsv4_err eg)
{
    if (ec != DSV4_OK || eg != DSV4_OK) {
        printf("FAIL %-28s cpu %d gpu %d: %s\n", what, ec, eg, dsv4_errmsg());
        n_fail++;
    }
}

/* Compare n floats (first `n` of the pair, CPU side vs CUDA side). */
static void
check_f32(const char *what, const struct pair *p, int64_t n, double bound)
{
    const float *c = p->c;
    float *g = pair_gpu(p);
    double maxd = 0, maxr = 0;
    int64_t same = 0, nan_bad = 0;

    for (int64_t i = 0; i < n; i++) {
        if (isnan(c[i]) || isnan(g[i])) {
            nan_bad += isnan(c[i]) != isnan(g[i]);
            same += isnan(c[i]) && isnan(g[i]);
            continue;
        }
        if (memcmp(&c[i], &g[i], 4) == 0)
            same++;
        maxd = fmax(maxd, fabs((double)c[i] - g[i]));
        maxr = fmax(maxr, fabs((double)c[i]));
    }
    double err = maxr > 0 ? maxd / maxr : maxd;
    int ok = err <= bound && nan_bad == 0;

    printf("%s %-28s n=%-8lld err=%.3g (bound %.3g) identical %.4f%s\n", ok ? "ok  " : "FAIL",
           what, (long long)n, err, bound, n > 0 ? (double)same / n : 1.0,
           nan_bad ? " NaN MISMATCH" : "");
    n_fail += !ok;
    free(g);
}

/* Index outputs must be identical. */
static void
check_i32(const char *what, const struct pair *p, int64_t n)
{
    const int32_t *c = p->c;
    int32_t *g = pair_gpu(p);
    int64_t diff = 0, first = -1;

    for (int64_t i = 0; i < n; i++) {
        if (c[i] != g[i]) {
            diff++;
            if (first < 0)
                first = i;
        }
    }
    printf("%s %-28s n=%-8lld differing %lld", diff ? "FAIL" : "ok  ", what, (long long)n,
           (long long)diff);
    if (first >= 0)
        printf(" (first at %lld: cpu %d gpu %d)", (long long)first, c[first], g[first]);
    printf("\n");
    n_fail += diff != 0;
    free(g);
}

/* --- weights ---------------------------------------------------------------------------- */

/* A linear weight on both backends. */
struct wpair {
    struct dsv4_linear c, g;
    struct pair w, s;
};

/* Random weight of format fmt (n_out x n_in): real values with block-varying
 * magnitudes encoded with formats.h; scales E8M0. */
static struct wpair
weight_new(enum dsv4_wfmt fmt, int n_out, int n_in)
{
    struct wpair W;
    size_t nw, ns = 0;
    uint8_t *w, *s = NULL;

    memset(&W, 0, sizeof(W));
    if (fmt == DSV4_WFMT_BF16) {
        uint16_t *b;

        nw = (size_t)n_out * n_in * 2;
        b = calloc(1, nw);
        for (size_t i = 0; i < (size_t)n_out * n_in; i++)
            b[i] = dsv4_f32_to_bf16(0.1f * rng_sym());
        w = (uint8_t *)b;
    } else if (fmt == DSV4_WFMT_FP8) {
        nw = (size_t)n_out * n_in;
        ns = (size_t)((n_out + 127) / 128) * ((n_in + 127) / 128);
        w = calloc(1, nw);
        s = calloc(1, ns);
        for (size_t i = 0; i < nw; i++)
            w[i] = dsv4_f32_to_fp8(448.0f * rng_sym());
        for (size_t i = 0; i < ns; i++)
            s[i] = (uint8_t)(127 - 14 + rng_int(5));
    } else {
        nw = (size_t)n_out * n_in / 2;
        ns = (size_t)n_out * (n_in / 32);
        w = calloc(1, nw);
        s = calloc(1, ns);
        for (size_t i = 0; i < nw; i++)
            w[i] = (uint8_t)rng_u64();
        for (size_t i = 0; i < ns; i++)
            s[i] = (uint8_t)(127 - 9 + rng_int(5));
    }
    W.w = pair_new(w, nw);
    if (s != NULL)
        W.s = pair_new(s, ns);
    W.c = (struct dsv4_linear){ W.w.c, s ? W.s.c : NULL, n_out, n_in, fmt };
    W.g = (struct dsv4_linear){ W.w.g, s ? W.s.g : NULL, n_out, n_in, fmt };
    free(w);
    free(s);
    return W;
}

static void
weight_free(struct wpair *W)
{
    pair_free(&W->w);
    if (W->s.c != NULL)
        pair_free(&W->s);
}

/* Run `call` on both backends: the macro expands it once per side with BE set. */
#define BOTH(what, call_c, call_g) check_status(what, (call_c), (call_g))

/* --- tests -------------------------------------------------------------------------------- */

static void
test_layout(void)
{
    int T = 23, n = 4, D = 200, V = 50;
    float *x = rand_bf16((int64_t)T * n * D, 2.0f), *e = rand_bf16((int64_t)T * D, 2.0f);
    int32_t rows[23], ids[23];
    uint16_t *tab = malloc((size_t)V * D * 2);
    struct pair px = pair_new(x, (size_t)T * n * D * 4), pe = pair_new(e, (size_t)T * D * 4);
    struct pair po = pair_poison((int64_t)T * n * D), pr, pi, pt;

    for (int i = 0; i < T; i++) {
        rows[i] = (i * 7 + 3) % T;   /* a permutation */
        ids[i] = rng_int(V);
    }
    for (int i = 0; i < V * D; i++)
        tab[i] = dsv4_f32_to_bf16(rng_sym());
    pr = pair_new(rows, sizeof(rows));
    pi = pair_new(ids, sizeof(ids));
    pt = pair_new(tab, (size_t)V * D * 2);

    BOTH("fill", cpu->ops->fill(cpu, po.c, 1.5f, (int64_t)T * D),
         gpu->ops->fill(gpu, po.g, 1.5f, (int64_t)T * D));
    check_f32("fill", &po, (int64_t)T * D, 0);
    BOTH("scatter_rows", cpu->ops->scatter_rows(cpu, po.c, pr.c, pe.c, T, D),
         gpu->ops->scatter_rows(gpu, po.g, pr.g, pe.g, T, D));
    check_f32("scatter_rows", &po, (int64_t)T * D, 0);
    BOTH("gather_rows", cpu->ops->gather_rows(cpu, po.c, px.c, pr.c, T, n * D),
         gpu->ops->gather_rows(gpu, po.g, px.g, pr.g, T, n * D));
    check_f32("gather_rows", &po, (int64_t)T * n * D, 0);
    BOTH("scale", cpu->ops->scale(cpu, px.c, 0.377f, (int64_t)T * n * D),
         gpu->ops->scale(gpu, px.g, 0.377f, (int64_t)T * n * D));
    check_f32("scale", &px, (int64_t)T * n * D, 0);
    BOTH("add_streams", cpu->ops->add_streams(cpu, po.c, pe.c, px.c, T, n, D),
         gpu->ops->add_streams(gpu, po.g, pe.g, px.g, T, n, D));
    check_f32("add_streams", &po, (int64_t)T * n * D, 0);
    BOTH("embed", cpu->ops->embed(cpu, po.c, pi.c, pt.c, T, D, n),
         gpu->ops->embed(gpu, po.g, pi.g, pt.g, T, D, n));
    check_f32("embed", &po, (int64_t)T * n * D, 0);
    pair_free(&px), pair_free(&pe), pair_free(&po), pair_free(&pr), pair_free(&pi);
    pair_free(&pt);
    free(x), free(e), free(tab);
}

/*
 * linear_norm_rope at a prefill size (256 rows of 8 heads of 512: with the
 * fast kernels wq_b's FP8 GEMM on cuBLASLt hands its bf16 output to the
 * norm, fast_fuse.cu) against its composition on the same CUDA backend
 * (dsv4_linear_norm_rope_compose: the linear's fp32 output, then
 * norm_rope): the same bits required.  Then with q_attn (the q of a
 * prefill's attention): x's first half must hold those values as bf16,
 * or x the fp32 values where the fast form did not take the call (HF
 * numerics).
 */
static void
test_linear_norm_rope(void)
{
    int T = 256, H = 8, Dh = 512, K = 1024, rd = 64;
    int64_t n = (int64_t)T * H * Dh;
    struct wpair W = weight_new(DSV4_WFMT_FP8, H * Dh, K);
    float *x = rand_bf16((int64_t)T * K, 3.0f), fr[32], *a, *b;
    int32_t pos[256];
    struct pair px = pair_new(x, (size_t)T * K * 4), pp, pa = pair_poison(n), pb = pair_poison(n);
    struct dsv4_norm_rope nr;
    enum dsv4_err e1, e2;
    int64_t diff = 0;

    for (int t = 0; t < T; t++)
        pos[t] = 3 * t + 1;
    for (int i = 0; i < rd / 2; i++)
        fr[i] = powf(10000.0f, -2.0f * (float)i / (float)rd);
    pp = pair_new(pos, sizeof(pos));
    memset(&nr, 0, sizeof(nr));
    nr.x = pa.g;
    nr.rows = T * H;
    nr.D = Dh;
    nr.eps = 1e-6f;
    nr.pos = pp.g;
    nr.heads = H;
    nr.off = Dh - rd;
    nr.rd = rd;
    nr.freqs = fr;
    e1 = gpu->ops->linear_norm_rope(gpu, px.g, &W.g, T, 0, &nr);
    nr.x = pb.g;
    e2 = dsv4_linear_norm_rope_compose(gpu, px.g, &W.g, T, 0, &nr);
    check_status("linear_norm_rope", e1, e2);
    a = pair_gpu(&pa);
    b = pair_gpu(&pb);
    for (int64_t i = 0; i < n; i++)
        diff += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    printf("%s %-28s n=%-8lld differing from its composition %lld\n", diff ? "FAIL" : "ok  ",
           "linear_norm_rope", (long long)n, (long long)diff);
    n_fail += diff != 0;
    /* q_attn: the fast kernels leave the rows as bf16 (nearest even) in x's
     * first half for the attention op after it, where their GEMM and norm
     * take the call (REF numerics); else x holds the fp32 rows as before */
    {
        struct pair pc = pair_poison(n);
        const uint16_t *c;
        int64_t bad = 0, f32 = 0;

        nr.x = pc.g;
        nr.q_attn = 1;
        check_status("linear_norm_rope (q_attn)",
                     gpu->ops->linear_norm_rope(gpu, px.g, &W.g, T, 0, &nr), e2);
        free(a);
        a = pair_gpu(&pc);
        c = (const uint16_t *)a;
        for (int64_t i = 0; i < n; i++) {
            f32 += memcmp(&a[i], &b[i], sizeof(float)) == 0;
            bad += c[i] != dsv4_f32_to_bf16(b[i]);
        }
        if (f32 == n)   /* the composition ran: fp32 rows, nothing held */
            bad = 0;
        printf("%s %-28s n=%-8lld %s, values not the composition's %lld\n",
               bad ? "FAIL" : "ok  ", "linear_norm_rope (q_attn)", (long long)n,
               f32 == n ? "fp32 (not held)" : "held as bf16", (long long)bad);
        n_fail += bad != 0;
        pair_free(&pc);
    }
    free(a), free(b), free(x);
    weight_free(&W);
    pair_free(&px), pair_free(&pp), pair_free(&pa), pair_free(&pb);
}

static void
test_linear(void)
{
    static const struct {
        const char *name;
        enum dsv4_wfmt fmt;
        unsigned flags;
        int T, N, K;
    } cases[] = {
        { "linear fp8", DSV4_WFMT_FP8, 0, 37, 300, 512 },
        { "linear fp8 T=1", DSV4_WFMT_FP8, 0, 1, 1000, 1024 },
        { "linear fp4", DSV4_WFMT_FP4, 0, 19, 256, 384 },
        { "linear bf16", DSV4_WFMT_BF16, 0, 29, 130, 250 },
        { "linear bf16 f32out", DSV4_WFMT_BF16, DSV4_LIN_F32_OUT, 29, 130, 256 },
    };

    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        int T = cases[c].T, N = cases[c].N, K = cases[c].K;
        struct wpair W = weight_new(cases[c].fmt, N, K);
        float *x = rand_bf16((int64_t)T * K, 3.0f);
        struct pair px = pair_new(x, (size_t)T * K * 4), po = pair_poison((int64_t)T * N);

        BOTH(cases[c].name, cpu->ops->linear(cpu, po.c, px.c, &W.c, T, cases[c].flags),
             gpu->ops->linear(gpu, po.g, px.g, &W.g, T, cases[c].flags));
        check_f32(cases[c].name, &po, (int64_t)T * N, 0);   /* same fp32 ops, same order */
        weight_free(&W);
        pair_free(&px), pair_free(&po);
        free(x);
    }
    {
        int T = 13, G = 4, Kg = 256, R = 96;
        struct wpair W = weight_new(DSV4_WFMT_FP8, G * R, Kg);
        float *x = rand_f32((int64_t)T * G * Kg, 2.0f);   /* rounded to bf16 by the op */
        struct pair px = pair_new(x, (size_t)T * G * Kg * 4), po = pair_poison((int64_t)T * G * R);

        BOTH("linear_grouped", cpu->ops->linear_grouped(cpu, po.c, px.c, &W.c, T, G),
             gpu->ops->linear_grouped(gpu, po.g, px.g, &W.g, T, G));
        check_f32("linear_grouped", &po, (int64_t)T * G * R, grouped_bound());
        weight_free(&W);
        pair_free(&px), pair_free(&po);
        free(x);
    }
}

static void
test_norm(void)
{
    int rows = 45, D = 512, T = 9, H = 5, Dh = 128, rd = 64;
    float *x = rand_f32((int64_t)rows * D, 4.0f), freqs[32];
    uint16_t w[512];
    int32_t pos[9];
    struct pair px = pair_new(x, (size_t)rows * D * 4), po = pair_poison((int64_t)rows * D);
    struct pair pw, pp;

    for (int i = 0; i < D; i++)
        w[i] = dsv4_f32_to_bf16(1.0f + 0.5f * rng_sym());
    pw = pair_new(w, sizeof(w));
    BOTH("rms_norm", cpu->ops->rms_norm(cpu, po.c, px.c, pw.c, rows, D, 1e-6f),
         gpu->ops->rms_norm(gpu, po.g, px.g, pw.g, rows, D, 1e-6f));
    check_f32("rms_norm", &po, (int64_t)rows * D, norm_bound());
    BOTH("rms_norm unweighted", cpu->ops->rms_norm(cpu, po.c, px.c, NULL, rows, D, 1e-6f),
         gpu->ops->rms_norm(gpu, po.g, px.g, NULL, rows, D, 1e-6f));
    check_f32("rms_norm unweighted", &po, (int64_t)rows * D, norm_bound());
    BOTH("rms_norm in place", cpu->ops->rms_norm(cpu, px.c, px.c, pw.c, rows, D, 1e-6f),
         gpu->ops->rms_norm(gpu, px.g, px.g, pw.g, rows, D, 1e-6f));
    check_f32("rms_norm in place", &px, (int64_t)rows * D, norm_bound());
    pair_sync(&px);   /* the checks below start from the same values on both sides */

    /* rope on (T, H, Dh) rows (uses the first T*H*Dh values of px) */
    for (int i = 0; i < rd / 2; i++)
        freqs[i] = (float)pow(10000.0, -2.0 * i / rd);
    for (int t = 0; t < T; t++)
        pos[t] = rng_int(100000);
    pp = pair_new(pos, sizeof(pos));
    /* H heads: a thread a pair; 16 heads (512 pairs a row): a block a row */
    for (int c = 0; c < 4; c++) {
        static const char *names[4] = { "rope", "rope inverse", "rope rows",
                                        "rope rows inverse" };
        int inv = c & 1, Hc = c < 2 ? H : 16;
        const char *nm = names[c];

        BOTH(nm, cpu->ops->rope(cpu, px.c, pp.c, T, Hc, (int64_t)Hc * Dh, Dh, Dh - rd, rd,
                                freqs, inv),
             gpu->ops->rope(gpu, px.g, pp.g, T, Hc, (int64_t)Hc * Dh, Dh, Dh - rd, rd, freqs,
                            inv));
        /* cos/sin through double on both sides; a one-ulp difference of a
         * float cos/sin could flip one bf16 rounding */
        check_f32(nm, &px, (int64_t)T * Hc * Dh, BF16_ULP);
        pair_sync(&px);
    }

    BOTH("fp8_sim", cpu->ops->fp8_sim(cpu, px.c, rows, D, D - 64, 64),
         gpu->ops->fp8_sim(gpu, px.g, rows, D, D - 64, 64));
    check_f32("fp8_sim", &px, (int64_t)rows * D, 0);
    BOTH("hadamard_fp4", cpu->ops->hadamard_fp4(cpu, px.c, rows * D / 128),
         gpu->ops->hadamard_fp4(gpu, px.g, rows * D / 128));
    check_f32("hadamard_fp4", &px, (int64_t)rows * D, 0);
    pair_free(&px), pair_free(&po), pair_free(&pw), pair_free(&pp);
    free(x);
}

static void
test_hc(void)
{
    int T = 17, n = 4, D = 256, M = (2 + n) * n;
    float *X = rand_bf16((int64_t)T * n * D, 2.0f), *f = rand_bf16((int64_t)T * D, 2.0f);
    float *fn = rand_f32((int64_t)M * n * D, 0.05f), *base = rand_f32(M, 1.0f);
    float scale[3] = { 0.7f, 1.3f, 2.0f };
    struct pair pX = pair_new(X, (size_t)T * n * D * 4), pf = pair_new(f, (size_t)T * D * 4);
    struct pair pfn = pair_new(fn, (size_t)M * n * D * 4), pb = pair_new(base, (size_t)M * 4);
    struct pair ps = pair_new(scale, sizeof(scale));
    struct pair px = pair_poison((int64_t)T * D), ppost = pair_poison((int64_t)T * n);
    struct pair pcomb = pair_poison((int64_t)T * n * n), pXo = pair_poison((int64_t)T * n * D);
    struct dsv4_hc_w hcc = { pfn.c, pb.c, ps.c }, hcg = { pfn.g, pb.g, ps.g };

    BOTH("hc_pre", cpu->ops->hc_pre(cpu, px.c, ppost.c, pcomb.c, pX.c, &hcc, T, n, D, 20, 1e-6f,
                                    1e-6f),
         gpu->ops->hc_pre(gpu, px.g, ppost.g, pcomb.g, pX.g, &hcg, T, n, D, 20, 1e-6f, 1e-6f));
    check_f32("hc_pre x", &px, (int64_t)T * D, BF16_ULP);    /* expf in sigmoid */
    check_f32("hc_pre post", &ppost, (int64_t)T * n, F32_TOL);
    check_f32("hc_pre comb", &pcomb, (int64_t)T * n * n, F32_TOL);
    /* hc_post from the CPU's post/comb on both sides: exact */
    gpu->ops->upload(gpu, ppost.g, ppost.c, (size_t)T * n * 4);
    gpu->ops->upload(gpu, pcomb.g, pcomb.c, (size_t)T * n * n * 4);
    BOTH("hc_post", cpu->ops->hc_post(cpu, pXo.c, pf.c, pX.c, ppost.c, pcomb.c, T, n, D),
         gpu->ops->hc_post(gpu, pXo.g, pf.g, pX.g, ppost.g, pcomb.g, T, n, D));
    check_f32("hc_post", &pXo, (int64_t)T * n * D, 0);
    BOTH("hc_head", cpu->ops->hc_head(cpu, px.c, pX.c, &hcc, T, n, D, 1e-6f, 1e-6f),
         gpu->ops->hc_head(gpu, px.g, pX.g, &hcg, T, n, D, 1e-6f, 1e-6f));
    check_f32("hc_head", &px, (int64_t)T * D, BF16_ULP);
    pair_free(&pX), pair_free(&pf), pair_free(&pfn), pair_free(&pb), pair_free(&ps);
    pair_free(&px), pair_free(&ppost), pair_free(&pcomb), pair_free(&pXo);
    free(X), free(f), free(fn), free(base);
}

static void
test_compress(void)
{
    for (int ri = 0; ri < 2; ri++) {
        int r = ri == 0 ? 4 : 128, c = r == 4 ? 2 : 1, d = 96, T = 150, S = 2;
        int64_t cd = (int64_t)c * d, pool = (int64_t)c * r * cd;
        float *a = rand_f32(T * cd, 2.0f), *z = rand_f32(T * cd, 3.0f);
        float *ape = rand_f32(r * cd, 1.0f);
        int32_t slot[150], pos[150], emit[150];
        int n_emit = 0;
        char nm[64];

        /* slot 1: positions 0..139 (crosses 127); slot 0: positions 40..49
         * (a fresh state) */
        for (int t = 0; t < T; t++) {
            slot[t] = t < 140 ? 1 : 0;
            pos[t] = t < 140 ? t : 40 + (t - 140);
            emit[t] = (pos[t] + 1) % r == 0 ? n_emit++ : -1;
        }
        struct pair pa = pair_new(a, (size_t)T * cd * 4), pz = pair_new(z, (size_t)T * cd * 4);
        struct pair pape = pair_new(ape, (size_t)r * cd * 4);
        struct pair psl = pair_new(slot, sizeof(slot)), pps = pair_new(pos, sizeof(pos));
        struct pair pem = pair_new(emit, sizeof(emit));
        struct pair pent = pair_poison((int64_t)(n_emit + 1) * d);
        struct pair pkv = pair_new(NULL, (size_t)S * pool * 4), pzs = pair_new(NULL, (size_t)S * pool * 4);

        cpu->ops->fill(cpu, pzs.c, -INFINITY, S * pool);
        gpu->ops->fill(gpu, pzs.g, -INFINITY, S * pool);
        snprintf(nm, sizeof(nm), "compress r=%d", r);
        BOTH(nm, cpu->ops->compress(cpu, pent.c, pkv.c, pzs.c, pa.c, pz.c, pape.c, psl.c, pps.c,
                                    pem.c, T, r, d),
             gpu->ops->compress(gpu, pent.g, pkv.g, pzs.g, pa.g, pz.g, pape.g, psl.g, pps.g,
                                pem.g, T, r, d));
        check_f32(nm, &pent, (int64_t)n_emit * d, F32_TOL);   /* expf of the softmax */
        snprintf(nm, sizeof(nm), "compress r=%d state", r);
        check_f32(nm, &pkv, S * pool, 0);
        pair_free(&pa), pair_free(&pz), pair_free(&pape), pair_free(&psl), pair_free(&pps);
        pair_free(&pem), pair_free(&pent), pair_free(&pkv), pair_free(&pzs);
        free(a), free(z), free(ape);
    }
}

static void
test_indexer(void)
{
    /* paged key pool: 4 pages per slot, 13 pages, shuffled page table */
    int T = 21, nh = 4, dI = 128, cap = 256, ratio = 4, K = 16, S = 3, NP = 13;
    float *q = rand_bf16((int64_t)T * nh * dI, 1.0f), *w = rand_bf16((int64_t)T * nh, 1.0f);
    float *keys = rand_bf16((int64_t)NP * DSV4_PAGE_ENTRIES * dI, 1.0f);
    int32_t slot[21], pos[21], pages[13];
    struct pair pq, pw, pk, psl, pps, psel, ppg;

    for (int i = 0; i < NP; i++)
        pages[i] = i;
    for (int i = NP - 1; i > 0; i--) {
        int j = rng_int(i + 1), x = pages[i];

        pages[i] = pages[j], pages[j] = x;
    }
    for (int t = 0; t < T; t++) {
        slot[t] = rng_int(S);
        pos[t] = t < 5 ? rng_int(60) : rng_int(cap * ratio);   /* some with n_valid < K */
    }
    pq = pair_new(q, (size_t)T * nh * dI * 4);
    pw = pair_new(w, (size_t)T * nh * 4);
    pk = pair_new(keys, (size_t)NP * DSV4_PAGE_ENTRIES * dI * 4);
    psl = pair_new(slot, sizeof(slot));
    pps = pair_new(pos, sizeof(pos));
    ppg = pair_new(pages, sizeof(pages));
    psel = pair_new(NULL, (size_t)T * K * 4);
    BOTH("indexer_topk", cpu->ops->indexer_topk(cpu, psel.c, pq.c, pw.c, pk.c, ppg.c, psl.c,
                                                pps.c, T, nh, dI, cap, ratio, K),
         gpu->ops->indexer_topk(gpu, psel.g, pq.g, pw.g, pk.g, ppg.g, psl.g, pps.g, T, nh, dI,
                                cap, ratio, K));
    check_i32("indexer_topk sel", &psel, (int64_t)T * K);
    pair_free(&pq), pair_free(&pw), pair_free(&pk), pair_free(&psl), pair_free(&pps);
    pair_free(&psel), pair_free(&ppg);
    free(q), free(w), free(keys);
}

/* T rows: 12 (the fast kernels' split form, fd_kernel) or more than 64
 * (whole rows, fa_kernel); slot 0 the first 3/4 of them. */
static void
test_attention(int T)
{
    int H = 8, Dh = 128, win = 16, cap = 64, ratio = 4, K = 10, S = 2, T0 = T * 3 / 4;
    float *q = rand_bf16((int64_t)T * H * Dh, 1.0f), *kv = rand_bf16((int64_t)T * Dh, 1.0f);
    float *ring = rand_bf16((int64_t)S * win * Dh, 1.0f);
    float *comp = rand_bf16((int64_t)(S + 1) * cap * Dh, 1.0f);   /* paged: 3 pages */
    float *sink = rand_f32(H, 2.0f);
    int32_t *slot = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4);
    int32_t *row0 = malloc((size_t)T * 4), *pos0 = malloc((size_t)T * 4);
    int32_t *sel = malloc((size_t)T * K * 4), pages[2] = { 2, 0 };
    struct pair pq, pkv, pring, pcomp, psink, psl, pps, pr0, pp0, psel, po, ppg;

    /* slot 0: T0 rows continuing up to 208; slot 1: the others from 5 (short) */
    for (int t = 0; t < T; t++) {
        int s = t < T0 ? 0 : 1;

        slot[t] = s;
        pos0[t] = s == 0 ? 209 - T0 : 5;   /* slot 0 ends at 208 */
        row0[t] = s == 0 ? 0 : T0;
        pos[t] = pos0[t] + (t - row0[t]);
        for (int i = 0; i < K; i++) {
            int nv = (pos[t] + 1) / ratio;

            sel[t * K + i] = i < nv && i < K - 2 ? rng_int(nv) : -1;
        }
    }
    pq = pair_new(q, (size_t)T * H * Dh * 4);
    pkv = pair_new(kv, (size_t)T * Dh * 4);
    pring = pair_new(ring, (size_t)S * win * Dh * 4);
    pcomp = pair_new(comp, (size_t)(S + 1) * cap * Dh * 4);
    ppg = pair_new(pages, sizeof(pages));
    psink = pair_new(sink, (size_t)H * 4);
    psl = pair_new(slot, (size_t)T * 4);
    pps = pair_new(pos, (size_t)T * 4);
    pr0 = pair_new(row0, (size_t)T * 4);
    pp0 = pair_new(pos0, (size_t)T * 4);
    psel = pair_new(sel, (size_t)T * K * 4);
    po = pair_poison((int64_t)T * H * Dh);
    for (int mode = 0; mode < 3; mode++) {
        static const char *nm[] = { "attention swa", "attention hca", "attention csa" };
        const void *cc = mode ? pcomp.c : NULL, *cg = mode ? pcomp.g : NULL;
        const void *sc = mode == 2 ? psel.c : NULL, *sg = mode == 2 ? psel.g : NULL;

        BOTH(nm[mode], cpu->ops->attention(cpu, po.c, pq.c, pkv.c, pring.c, cc, ppg.c, sc,
                                           psink.c, psl.c, pps.c, pr0.c, pp0.c, T, H, Dh, win,
                                           cap, ratio, K, 0.088f),
             gpu->ops->attention(gpu, po.g, pq.g, pkv.g, pring.g, cg, ppg.g, sg, psink.g,
                                 psl.g, pps.g, pr0.g, pp0.g, T, H, Dh, win, cap, ratio, K,
                                 0.088f));
        check_f32(nm[mode], &po, (int64_t)T * H * Dh, BF16_ULP);   /* expf of the softmax */

        /* attention_unrope (the last 64 dimensions rotated back): the CPU's
         * composition against the CUDA op; then, on the CUDA side, the op's
         * bits against its own attention + rope (the fused output stage of
         * the fast kernels must not change a bit) */
        {
            static const char *nu[] = { "attention_unrope swa", "attention_unrope hca",
                                        "attention_unrope csa" };
            int off = Dh - 64, rd = 64, same = 0;
            float fr[32], *g1, *g2;
            enum dsv4_err e;
            struct dsv4_attn ac = {
                .out = po.c, .q = pq.c, .kv = pkv.c, .ring = pring.c, .comp = cc,
                .pages = ppg.c, .sel = sc, .sink = psink.c, .slot = psl.c, .pos = pps.c,
                .row0 = pr0.c, .pos0 = pp0.c, .T = T, .H = H, .Dh = Dh, .win = win,
                .cap = cap, .ratio = ratio, .K = K, .scale = 0.088f,
            };
            struct dsv4_attn ag = {
                .out = po.g, .q = pq.g, .kv = pkv.g, .ring = pring.g, .comp = cg,
                .pages = ppg.g, .sel = sg, .sink = psink.g, .slot = psl.g, .pos = pps.g,
                .row0 = pr0.g, .pos0 = pp0.g, .T = T, .H = H, .Dh = Dh, .win = win,
                .cap = cap, .ratio = ratio, .K = K, .scale = 0.088f,
            };

            for (int i = 0; i < rd / 2; i++)
                fr[i] = powf(10000.0f, -2.0f * i / rd);
            BOTH(nu[mode], cpu->ops->attention_unrope(cpu, &ac, off, rd, fr),
                 gpu->ops->attention_unrope(gpu, &ag, off, rd, fr));
            check_f32(nu[mode], &po, (int64_t)T * H * Dh, 2 * BF16_ULP);
            g1 = pair_gpu(&po);
            e = gpu->ops->attention(gpu, po.g, pq.g, pkv.g, pring.g, cg, ppg.g, sg, psink.g,
                                    psl.g, pps.g, pr0.g, pp0.g, T, H, Dh, win, cap, ratio, K,
                                    0.088f);
            BOTH(nu[mode], e,
                 gpu->ops->rope(gpu, po.g, pps.g, T, H, (int64_t)H * Dh, Dh, off, rd, fr, 1));
            g2 = pair_gpu(&po);
            for (int64_t i = 0; i < (int64_t)T * H * Dh; i++)
                same += memcmp(&g1[i], &g2[i], 4) == 0;
            printf("%s %-28s cuda op == cuda attention + rope: %d of %lld\n",
                   same == T * H * Dh ? "ok  " : "FAIL", nu[mode], same,
                   (long long)T * H * Dh);
            n_fail += same != T * H * Dh;
            free(g1), free(g2);
        }
    }
    pair_free(&pq), pair_free(&pkv), pair_free(&pring), pair_free(&pcomp), pair_free(&psink);
    pair_free(&psl), pair_free(&pps), pair_free(&pr0), pair_free(&pp0), pair_free(&psel);
    pair_free(&po), pair_free(&ppg);
    free(q), free(kv), free(ring), free(comp), free(sink);
    free(slot), free(pos), free(row0), free(pos0), free(sel);
}

static void
test_moe(void)
{
    int T = 20, D = 256, E = 8, k = 3, V = 50;
    float *x = rand_bf16((int64_t)T * D, 2.0f), *bias = rand_f32(E, 0.3f);
    int64_t *tid2eid = malloc((size_t)V * k * 8);
    int32_t tok[20];
    struct wpair gate = weight_new(DSV4_WFMT_BF16, E, D);
    struct pair px = pair_new(x, (size_t)T * D * 4), pb = pair_new(bias, (size_t)E * 4), pt, ptk;
    struct pair pw = pair_poison((int64_t)T * k), pid = pair_new(NULL, (size_t)T * k * 4);

    for (int i = 0; i < V; i++)
        for (int j = 0; j < k; j++)
            tid2eid[i * k + j] = (i + 3 * j) % E;
    for (int t = 0; t < T; t++)
        tok[t] = rng_int(V);
    pt = pair_new(tid2eid, (size_t)V * k * 8);
    ptk = pair_new(tok, sizeof(tok));
    BOTH("router", cpu->ops->router(cpu, pw.c, pid.c, px.c, &gate.c, pb.c, NULL, NULL, T, k, 1.5f),
         gpu->ops->router(gpu, pw.g, pid.g, px.g, &gate.g, pb.g, NULL, NULL, T, k, 1.5f));
    check_i32("router ids", &pid, (int64_t)T * k);
    check_f32("router weights", &pw, (int64_t)T * k, F32_TOL);   /* expf/log1pf */
    BOTH("router hash", cpu->ops->router(cpu, pw.c, pid.c, px.c, &gate.c, NULL, pt.c, ptk.c, T,
                                         k, 1.5f),
         gpu->ops->router(gpu, pw.g, pid.g, px.g, &gate.g, NULL, pt.g, ptk.g, T, k, 1.5f));
    check_i32("router hash ids", &pid, (int64_t)T * k);
    check_f32("router hash weights", &pw, (int64_t)T * k, F32_TOL);

    /* experts: FP4 routed (I = 256), FP8 shared; the CPU's router output on both sides */
    {
        int I = 256;
        struct wpair ew[8][3], sw[3];
        struct dsv4_expert_w exc[8], exg[8], shc, shg;
        struct pair po = pair_poison((int64_t)T * D);

        for (int e = 0; e < E; e++) {
            ew[e][0] = weight_new(DSV4_WFMT_FP4, I, D);
            ew[e][1] = weight_new(DSV4_WFMT_FP4, I, D);
            ew[e][2] = weight_new(DSV4_WFMT_FP4, D, I);
            exc[e] = (struct dsv4_expert_w){ ew[e][0].c, ew[e][1].c, ew[e][2].c };
            exg[e] = (struct dsv4_expert_w){ ew[e][0].g, ew[e][1].g, ew[e][2].g };
        }
        sw[0] = weight_new(DSV4_WFMT_FP8, I, D);
        sw[1] = weight_new(DSV4_WFMT_FP8, I, D);
        sw[2] = weight_new(DSV4_WFMT_FP8, D, I);
        shc = (struct dsv4_expert_w){ sw[0].c, sw[1].c, sw[2].c };
        shg = (struct dsv4_expert_w){ sw[0].g, sw[1].g, sw[2].g };
        /* learned routing again, copied to the GPU side */
        cpu->ops->router(cpu, pw.c, pid.c, px.c, &gate.c, pb.c, NULL, NULL, T, k, 1.5f);
        gpu->ops->upload(gpu, pw.g, pw.c, (size_t)T * k * 4);
        gpu->ops->upload(gpu, pid.g, pid.c, (size_t)T * k * 4);
        for (int lim = 0; lim < 2; lim++) {
            const char *nm = lim ? "moe limit 0.5" : "moe";
            float L = lim ? 0.5f : 0.0f;

            BOTH(nm, cpu->ops->moe(cpu, po.c, px.c, pid.c, pw.c, exc, &shc, T, k, L),
                 gpu->ops->moe(gpu, po.g, px.g, pid.g, pw.g, exg, &shg, T, k, L));
            /* expf in silu may flip a bf16 rounding of h, seen through w2 */
            check_f32(nm, &po, (int64_t)T * D, BF16_ULP);
        }
        for (int e = 0; e < E; e++)
            for (int j = 0; j < 3; j++)
                weight_free(&ew[e][j]);
        for (int j = 0; j < 3; j++)
            weight_free(&sw[j]);
        pair_free(&po);
    }
    /* moe_combine at the model's k = 6 (the GPU's 4-column form), ids with
     * repeats: the same sums in the same order, bit for bit */
    {
        float *yh = rand_f32((int64_t)(T * 6 + T) * D, 2.0f);
        int32_t ids6[20 * 6];
        struct pair py = pair_new(yh, (size_t)(T * 6 + T) * D * 4), pi6;
        struct pair po6 = pair_poison((int64_t)T * D);

        for (int i = 0; i < T * 6; i++)
            ids6[i] = rng_int(E);
        pi6 = pair_new(ids6, sizeof(ids6));
        BOTH("moe_combine k=6", cpu->ops->moe_combine(cpu, po6.c, py.c, pi6.c, T, 6, D),
             gpu->ops->moe_combine(gpu, po6.g, py.g, pi6.g, T, 6, D));
        check_f32("moe_combine k=6", &po6, (int64_t)T * D, 0);
        pair_free(&py), pair_free(&pi6), pair_free(&po6);
        free(yh);
    }
    weight_free(&gate);
    pair_free(&px), pair_free(&pb), pair_free(&pt), pair_free(&ptk), pair_free(&pw);
    pair_free(&pid);
    free(x), free(bias), free(tid2eid);
}

/* Rows of V random logits (scale a) sampled by both backends under sp
 * (steps advanced between reps): ids identical, log-probabilities within
 * F32_TOL.  tie: logits that get a tie for a row's argmax (-1: none). */
static void sample_check_rows(const char *what, struct dsv4_sample_params *sp, int N, int V,
                              float *l, int reps);

static void
sample_check(const char *what, struct dsv4_sample_params *sp, int N, int V, float a,
             int64_t tie0, int64_t tie1, int reps)
{
    float *l = rand_f32((int64_t)N * V, a);

    if (tie0 >= 0)
        l[tie0] = l[tie1] = 50.0f;
    sample_check_rows(what, sp, N, V, l, reps);
}

/* sample_check's comparison on the given rows l (freed). */
static void
sample_check_rows(const char *what, struct dsv4_sample_params *sp, int N, int V, float *l,
                  int reps)
{
    struct pair pl, pid = pair_new(NULL, (size_t)N * 4), plp = pair_poison(N);
    char name[64];

    pl = pair_new(l, (size_t)N * V * 4);
    for (int rep = 0; rep < reps; rep++) {
        BOTH(what, cpu->ops->sample(cpu, pid.c, plp.c, pl.c, sp, N, V),
             gpu->ops->sample(gpu, pid.g, plp.g, pl.g, sp, N, V));
        snprintf(name, sizeof(name), "%s ids", what);
        check_i32(name, &pid, N);
        snprintf(name, sizeof(name), "%s logprob", what);
        check_f32(name, &plp, N, F32_TOL);
        for (int r = 0; r < N; r++)
            sp[r].step++;
    }
    pair_free(&pl), pair_free(&pid), pair_free(&plp);
    free(l);
}

/* Seeded parameters of N rows: greedy, top_p 1, random seed and step. */
static void
sample_params(struct dsv4_sample_params *sp, int N)
{
    memset(sp, 0, (size_t)N * sizeof(*sp));
    for (int r = 0; r < N; r++) {
        sp[r].seed = rng_u64();
        sp[r].step = (uint64_t)rng_int(1000);
        sp[r].top_p = 1.0f;
    }
}

static void
test_sample(void)
{
    enum { N = 8, V = 5000 };
    struct dsv4_sample_params sp[N];

    sample_params(sp, N);
    sp[1].temperature = 0.8f;
    sp[2].temperature = 1.0f, sp[2].top_k = 50;
    sp[4].temperature = 0.7f, sp[4].top_p = 0.9f;
    sp[5].temperature = 1.2f, sp[5].top_k = 200, sp[5].top_p = 0.5f;
    sp[6].temperature = 2.0f, sp[6].top_p = 0.99f;
    sp[7].temperature = 0.01f, sp[7].top_k = 1;
    sp[0].temperature = 1e-30f;   /* below DSV4_SAMPLE_GREEDY_BELOW: greedy */
    /* row 3: a tie for the argmax */
    sample_check("sample", sp, N, V, 4.0f, 3 * V + 17, 3 * V + 4000, 3);
}

/* NaN and +inf logits (kernels/sample_order.h so_lw): rows with NaNs and
 * rows with two +inf, greedy, in id order and sorted, over many steps:
 * the same tokens (never a NaN's; only the +inf ones) and log-probabilities
 * as the CPU's. */
static void
test_sample_nonfinite(void)
{
    enum { N = 8, V = 5000 };
    struct dsv4_sample_params sp[N];
    float *l = rand_f32((int64_t)N * V, 3.0f);

    sample_params(sp, N);
    for (int r = 0; r < N; r++) {
        float *row = l + (int64_t)r * V;

        if (r % 2 == 0) {   /* NaNs, one at id 0 and one where the best was */
            row[0] = row[17] = row[V - 1] = NAN;
            row[40] = 20.0f;
            row[41] = 19.5f;
        } else {            /* two +inf */
            row[3] = row[V / 2] = INFINITY;
        }
        sp[r].temperature = r < 2 ? 0.0f : 1.0f;
        sp[r].top_k = r == 4 || r == 5 ? 50 : 0;
        sp[r].top_p = r == 6 || r == 7 ? 0.9f : 1.0f;
    }
    sample_check_rows("sample (NaN, +inf)", sp, N, V, l, 6);
}

/* The same at flash's vocabulary (32 spans of 256 runs of 16): draws over
 * every span in id order, and sorted candidates cut inside a run by top_k
 * (1,000 = 62.5 runs) and by top_p, so the draw also sums runs and spans
 * the stored sums do not cover (kernels/sample_order.h). */
static void
test_sample_vocab(void)
{
    enum { N = 5, V = 129280 };
    struct dsv4_sample_params sp[N];

    sample_params(sp, N);
    sp[1].temperature = 1.0f;
    sp[2].temperature = 1.3f, sp[2].top_k = 1000;
    sp[3].temperature = 0.9f, sp[3].top_p = 0.95f;
    sp[4].temperature = 2.0f, sp[4].top_k = 5000, sp[4].top_p = 0.6f;
    sample_check("sample (vocab)", sp, N, V, 3.0f, -1, -1, 4);
}

/* sample_top on N = 5 rows of V logits by both backends (n_top 20, 20, 0,
 * 1, 5): ids identical; log-probabilities within F32_TOL absolute where
 * finite, else the same (-inf as -inf, NaN as NaN); the entries of row 2
 * (n_top 0) and those past min(n_top, V) keep their sentinel.  Row 0: ties
 * at the top (50 at three ids, 40 at two); row 1: a tie, a NaN at id 1
 * (ranked as -inf: before the -inf at id V / 2 at V = 7; it makes the row's
 * log-probabilities NaN on both, as the CPU's formula does); row 3: a tie
 * for its one id; row 4: -inf but at three ids (then -inf ids by id,
 * log-probability -inf). */
static void
top_check(const char *what, int V)
{
    enum { N = 5, K = DSV4_TOP_MAX };
    static const int n_top[N] = { 20, 20, 0, 1, 5 };
    struct dsv4_sample_params sp[N];
    float *l = rand_f32((int64_t)N * V, 3.0f), *lp0 = malloc(N * K * sizeof(float));
    int32_t *id0 = malloc(N * K * sizeof(int32_t));
    const float sent = 12345.0f;
    struct pair pl, pid, plp;
    const int32_t *ic;
    const float *fc;
    int32_t *ig;
    float *fg;
    int64_t bad = 0, first = -1;
    double maxd = 0;

    sample_params(sp, N);
    for (int r = 0; r < N; r++)
        sp[r].n_top = n_top[r];
    l[0 * (int64_t)V + 7 % V] = l[0 * (int64_t)V + V - 1] = l[0 * (int64_t)V + V / 2] = 50.0f;
    l[0 * (int64_t)V + V / 3] = l[0 * (int64_t)V + V / 4] = 40.0f;
    l[1 * (int64_t)V + 1] = NAN;
    l[1 * (int64_t)V + V / 2] = -INFINITY;
    l[1 * (int64_t)V + V - 1] = l[1 * (int64_t)V + V / 3] = 30.0f;
    l[3 * (int64_t)V + V - 1] = l[3 * (int64_t)V + 2 % V] = 30.0f;
    for (int i = 0; i < V; i++)
        if (i != 1 % V && i != V / 2 && i != V - 1)
            l[4 * (int64_t)V + i] = -INFINITY;
    for (int i = 0; i < N * K; i++)
        id0[i] = -7, lp0[i] = sent;
    pl = pair_new(l, (size_t)N * V * 4);
    pid = pair_new(id0, (size_t)N * K * 4);
    plp = pair_new(lp0, (size_t)N * K * 4);
    BOTH(what, cpu->ops->sample_top(cpu, pid.c, plp.c, pl.c, sp, N, V),
         gpu->ops->sample_top(gpu, pid.g, plp.g, pl.g, sp, N, V));
    ic = pid.c, fc = plp.c;
    ig = pair_gpu(&pid), fg = pair_gpu(&plp);
    for (int r = 0; r < N; r++) {
        int k = n_top[r] < V ? n_top[r] : V;

        for (int j = 0; j < K; j++) {
            int64_t i = (int64_t)r * K + j;
            int ok;

            if (j >= k) {
                ok = ic[i] == -7 && ig[i] == -7 && fc[i] == sent && fg[i] == sent;
            } else if (isfinite(fc[i]) && isfinite(fg[i])) {
                maxd = fmax(maxd, fabs((double)fc[i] - fg[i]));
                ok = ic[i] == ig[i] && fabs((double)fc[i] - fg[i]) <= F32_TOL;
            } else {
                ok = ic[i] == ig[i] &&
                     (isnan(fc[i]) ? isnan(fg[i]) : !isnan(fg[i]) && fc[i] == fg[i]);
            }
            if (!ok) {
                bad++;
                if (first < 0)
                    first = i;
            }
        }
    }
    /* a greedy sample of the same rows on the GPU: its token is the first
     * entry, with the same log-probability bit for bit (the same row sums) */
    {
        struct dsv4_sample_params gs[N];
        struct pair sid = pair_new(NULL, N * 4), slp = pair_new(NULL, N * 4);
        int32_t *gid;
        float *glp;

        memcpy(gs, sp, sizeof(gs));
        for (int r = 0; r < N; r++)
            gs[r].temperature = 0.0f;
        if (gpu->ops->sample(gpu, sid.g, slp.g, pl.g, gs, N, V) != DSV4_OK) {
            fprintf(stderr, "sample: %s\n", dsv4_errmsg());
            exit(1);
        }
        gid = pair_gpu(&sid), glp = pair_gpu(&slp);
        for (int r = 0; r < N; r++) {
            int64_t i = (int64_t)r * K;

            if (n_top[r] > 0 && (gid[r] != ig[i] || (memcmp(&glp[r], &fg[i], 4) != 0 &&
                                                     !(isnan(glp[r]) && isnan(fg[i]))))) {
                printf("FAIL %s: row %d greedy %d %.9g, first entry %d %.9g\n", what, r,
                       gid[r], (double)glp[r], ig[i], (double)fg[i]);
                bad++;
            }
        }
        free(gid), free(glp);
        pair_free(&sid), pair_free(&slp);
    }
    printf("%s %-28s n=%-8d differing %lld max |dlp| %.3g (bound %.3g)", bad ? "FAIL" : "ok  ",
           what, N * K, (long long)bad, maxd, F32_TOL);
    if (first >= 0)
        printf(" (first at row %lld entry %lld: cpu %d %.9g gpu %d %.9g)",
               (long long)(first / K), (long long)(first % K), ic[first], (double)fc[first],
               ig[first], (double)fg[first]);
    printf("\n");
    n_fail += bad != 0;
    free(ig), free(fg);
    pair_free(&pl), pair_free(&pid), pair_free(&plp);
    free(l), free(id0), free(lp0);
}

/* What a sample_top call costs at the vocabulary, n rows of k (a figure,
 * not a check). */
static void
top_time(int n, int k)
{
    const int V = 129280, reps = 50;
    struct dsv4_sample_params sp[16];
    float *l = rand_f32((int64_t)n * V, 3.0f);
    void *gl = gpu->ops->alloc(gpu, (size_t)n * V * 4);
    void *gi = gpu->ops->alloc(gpu, (size_t)n * DSV4_TOP_MAX * 4);
    void *gp = gpu->ops->alloc(gpu, (size_t)n * DSV4_TOP_MAX * 4);
    struct timespec t0, t1;

    sample_params(sp, n);
    for (int r = 0; r < n; r++)
        sp[r].n_top = k;
    gpu->ops->upload(gpu, gl, l, (size_t)n * V * 4);
    for (int i = 0; i <= reps; i++) {
        if (i == 1) {
            gpu->ops->sync(gpu);
            clock_gettime(CLOCK_MONOTONIC, &t0);
        }
        gpu->ops->sample_top(gpu, gi, gp, gl, sp, n, V);
    }
    gpu->ops->sync(gpu);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("time sample_top n=%d k=%d V=%d: %.1f us a call\n", n, k, V,
           ((double)(t1.tv_sec - t0.tv_sec) * 1e6 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e3) /
           reps);
    gpu->ops->free(gpu, gl), gpu->ops->free(gpu, gi), gpu->ops->free(gpu, gp);
    free(l);
}

/* sample_top at the vocabulary and at V = 7 (fewer ids than DSV4_TOP_MAX:
 * min(n_top, V) entries), and what it costs. */
static void
test_sample_top(void)
{
    top_check("sample_top (vocab)", 129280);
    top_check("sample_top (V=7)", 7);
    top_time(1, 20);
    top_time(1, 5);
    top_time(16, 20);
}

int
main(int argc, char **argv)
{
    uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : (uint64_t)time(NULL);
    enum dsv4_err e;

    for (int num = 0; num < 2; num++) {
        enum dsv4_numerics nm = num ? DSV4_NUMERICS_HF : DSV4_NUMERICS_REF;

        e = dsv4_backend_create(&gpu, "cuda", nm, 0);
        if (e == DSV4_ERR_NOTSUP) {
            printf("SKIP: %s\n", dsv4_errmsg());
            return 77;
        }
        if (e != DSV4_OK || dsv4_backend_create(&cpu, "cpu", nm, 0) != DSV4_OK) {
            fprintf(stderr, "backend: %s\n", dsv4_errmsg());
            return 1;
        }
        rng_state = seed + (uint64_t)num;
        printf("== numerics %s, seed %llu ==\n", num ? "hf" : "ref", (unsigned long long)seed);
        test_layout();
        test_linear();
        test_linear_norm_rope();
        test_norm();
        test_hc();
        test_compress();
        test_indexer();
        test_attention(12);
        test_attention(80);
        test_moe();
        test_sample();
        test_sample_nonfinite();
        test_sample_vocab();
        test_sample_top();
        dsv4_backend_destroy(cpu);
        dsv4_backend_destroy(gpu);
    }
    printf("%s: %d check(s) failed\n", n_fail ? "FAIL" : "PASS", n_fail);
    return n_fail ? 1 : 0;
}
