/*
 * bench_fast.c — the fast decode kernels (kernels/cuda_fast.h) against the
 * exact CUDA kernels on the flash shapes, then their speed.
 *
 *   bench_fast [SEED]
 *
 * Cases: linear wq_a 4096->1024, wq_b 1024->32768, wo_b 8192->4096,
 * wkv 4096->512 (FP8, 128x128 E8M0 scales), head 4096->129280 (BF16, fp32
 * out as the forward runs it), and the MoE (256 FP4 experts D=4096
 * I=2048, k=6, FP8 shared expert), each at T = 1, 4, 16, 64, REF numerics,
 * random weights in the checkpoint formats.
 *
 * Per case: the exact path and the fast path on the same inputs; the
 * largest |fast - exact| relative to the largest |exact|, and the share of
 * bit-identical outputs, against bounds (the fast path sums each 128-column
 * block in another order, so it differs by fp32 rounding before the bf16
 * rounding of the output):
 *   bf16 outputs (FP8 linear)   max rel <= 2^-7 (one bf16 ulp of the largest
 *                               value, doubled), >= 90% identical;
 *   fp32 outputs (head)         max rel <= 2^-13 (the x = hi + lo split
 *                               leaves 2^-17 per term, plus fp32 sums);
 *   moe                         max rel <= 2^-5, >= 50% identical (a
 *                               one-ulp change of g or u can move an h value
 *                               to the next FP8 code, 2^-3 of that value).
 * Also checked: the fast path gives the same bits on a second run, and the
 * first rows at this T equal those at the previous (smaller) T: results do
 * not depend on T.  Then the fast op is recorded 10 times into a CUDA graph
 * (as decode runs it) and the graph timed with CUDA events: median of 15
 * launches after a warm-up, per op; GB/s counts the weight bytes the op
 * must read (for the MoE: the experts routed to plus the shared expert), and
 * the ratio is to 4.3 TB/s (DESIGN.md §7).  T = 64 reads the weights of an
 * expert or matrix once per 16 tokens (the fast path's pass size).
 *
 * Exit status: 0 all ok, 1 a numerical failure, 77 no CUDA device.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/formats.h"
#include "common/weights.h"
#include "kernels/backend.h"
#include "kernels/cuda_fast.h"
#include "tests/gpu/gpu_test_util.h"   /* TRY */

#define PEAK_GBS 4300.0      /* DESIGN.md §7: device copy bandwidth per H200 */
#define GRAPH_REPS 10        /* op calls per recorded graph */
#define N_TIMED 15           /* timed graph launches */
#define T_MAX 64
#define E_EXPERTS 256
#define K_PICKS 6
#define D_MODEL 4096
#define I_EXPERT 2048

/* Bounds (see the header). */
#define BOUND_BF16 0x1p-7
#define BOUND_F32 0x1p-13
#define BOUND_MOE 0x1p-5
#define IDENT_BF16 0.90
#define IDENT_MOE 0.50

static const int t_list[] = { 1, 4, 16, 64 };
#define N_T ((int)(sizeof(t_list) / sizeof(t_list[0])))

/* --- random data -------------------------------------------------------------------- */

static uint64_t rng_state;

static uint64_t
rng_next(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double
rng_unif(void)
{
    return (double)(rng_next() >> 11) * 0x1p-53;
}

static float
rng_normal(void)
{
    double u = rng_unif() + 1e-300, v = rng_unif();

    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* n random bytes passed through mask (and xor flip). */
static void
fill_bytes(uint8_t *p, size_t n, uint8_t mask)
{
    size_t i = 0;

    for (; i + 8 <= n; i += 8) {
        uint64_t r = rng_next();

        for (int j = 0; j < 8; j++)
            p[i + j] = (uint8_t)(r >> (8 * j)) & mask;
    }
    for (; i < n; i++)
        p[i] = (uint8_t)rng_next() & mask;
}

/* E8M0 scales in [lo, lo + span). */
static void
fill_scales(uint8_t *p, size_t n, int lo, int span)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(lo + (int)(rng_next() % (uint64_t)span));
}

/* bf16 weights: random sign and mantissa, exponents 2^-7..2^-3. */
static void
fill_bf16(uint16_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t r = rng_next();

        p[i] = (uint16_t)(((r & 1) << 15) | ((120 + (r >> 8) % 5) << 7) | ((r >> 16) & 0x7f));
    }
}

/* --- device helpers ------------------------------------------------------------------- */

static void *
dev_alloc(struct dsv4_backend *be, size_t bytes)
{
    void *p = be->ops->alloc(be, bytes);

    if (p == NULL) {
        fprintf(stderr, "device allocation of %zu bytes failed\n", bytes);
        exit(1);
    }
    return p;
}

static void *
dev_upload(struct dsv4_backend *be, const void *src, size_t bytes)
{
    void *p = dev_alloc(be, bytes);

    TRY("upload", be->ops->upload(be, p, src, bytes));
    return p;
}

/* An FP8 linear (N x K) with random codes (exponents 0..7, no NaN) and
 * scales. */
static struct dsv4_linear
make_fp8(struct dsv4_backend *be, int N, int K)
{
    struct dsv4_linear W = { .n_out = N, .n_in = K, .fmt = DSV4_WFMT_FP8 };
    size_t nw = (size_t)N * K, ns = (size_t)(N / 128) * (K / 128);
    uint8_t *h = malloc(nw > ns ? nw : ns);

    if (h == NULL)
        exit(1);
    fill_bytes(h, nw, 0xbf);
    W.w = dev_upload(be, h, nw);
    fill_scales(h, ns, 120, 5);
    W.scale = dev_upload(be, h, ns);
    free(h);
    return W;
}

static struct dsv4_linear
make_bf16(struct dsv4_backend *be, int N, int K)
{
    struct dsv4_linear W = { .n_out = N, .n_in = K, .fmt = DSV4_WFMT_BF16 };
    size_t n = (size_t)N * K;
    uint16_t *h = malloc(n * sizeof(uint16_t));

    if (h == NULL)
        exit(1);
    fill_bf16(h, n);
    W.w = dev_upload(be, h, n * sizeof(uint16_t));
    free(h);
    return W;
}

/* An FP4 linear (N x K, logical) carved from `arena` at *off. */
static struct dsv4_linear
make_fp4(struct dsv4_backend *be, char *arena, size_t *off, uint8_t *stage, int N, int K)
{
    struct dsv4_linear W = { .n_out = N, .n_in = K, .fmt = DSV4_WFMT_FP4 };
    size_t nw = (size_t)N * K / 2, ns = (size_t)N * (K / 32);

    fill_bytes(stage, nw, 0xff);
    TRY("upload", be->ops->upload(be, arena + *off, stage, nw));
    W.w = arena + *off;
    *off += (nw + 255) / 256 * 256;
    fill_scales(stage, ns, 118, 7);
    TRY("upload", be->ops->upload(be, arena + *off, stage, ns));
    W.scale = (const uint8_t *)(arena + *off);
    *off += (ns + 255) / 256 * 256;
    return W;
}

static size_t
lin_bytes(const struct dsv4_linear *W)
{
    size_t n = (size_t)W->n_out * W->n_in;

    switch (W->fmt) {
    case DSV4_WFMT_FP8:
        return n + (size_t)(W->n_out / 128) * (W->n_in / 128);
    case DSV4_WFMT_FP4:
        return n / 2 + (size_t)W->n_out * (W->n_in / 32);
    default:
        return 2 * n;
    }
}

/* --- one case ------------------------------------------------------------------------------ */

/* What a case runs: a linear or the moe, on the given T. */
struct op {
    const char *name;
    int is_moe;
    /* linear */
    struct dsv4_linear W;
    unsigned flags;
    /* moe */
    const struct dsv4_expert_w *experts, *shared;
    const int32_t *ids;
    const float *weights;
    /* common */
    const float *x;
    float *out;
    int n_out;        /* outputs per row */
};

static enum dsv4_err
op_run(struct dsv4_backend *be, const struct op *o, int T)
{
    if (o->is_moe)
        return be->ops->moe(be, o->out, o->x, o->ids, o->weights, o->experts, o->shared, T,
                            K_PICKS, 10.0f);
    return be->ops->linear(be, o->out, o->x, &o->W, T, o->flags);
}

/* Per-op state kept across T: the previous fast result (T-independence). */
struct hist {
    float *prev;
    int prev_T;
};

struct tally {
    int ok, fail;
    double sum_ratio;
    int n_ratio;
};

static int
cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;

    return x < y ? -1 : x > y;
}

/* Median time (ms) of one op call, from graphs of GRAPH_REPS calls. */
static float
time_fast(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct op *o, int T)
{
    void *g = NULL;
    float ms[N_TIMED];

    TRY("graph_begin", be->ops->graph_begin(be));
    for (int i = 0; i < GRAPH_REPS; i++)
        TRY("op (recording)", op_run(be, o, T));
    TRY("graph_end", be->ops->graph_end(be, &g));
    for (int i = 0; i < 2; i++)
        TRY("graph_launch", be->ops->graph_launch(be, g));
    TRY("sync", be->ops->sync(be));
    for (int i = 0; i < N_TIMED; i++) {
        TRY("timer", dsv4_cuda_timer_start(tm));
        TRY("graph_launch", be->ops->graph_launch(be, g));
        TRY("timer", dsv4_cuda_timer_stop(tm, &ms[i]));
        ms[i] /= GRAPH_REPS;
    }
    be->ops->graph_free(be, g);
    qsort(ms, N_TIMED, sizeof(float), cmp_float);
    return ms[N_TIMED / 2];
}

static void
run_case(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct op *o, int T,
         size_t bytes, struct hist *h, struct tally *ty)
{
    size_t n = (size_t)T * o->n_out;
    float *ref = malloc(n * sizeof(float)), *fast = malloc(n * sizeof(float));
    float *again = malloc(n * sizeof(float));
    double maxd = 0, maxr = 0, rel, bound, ident_min;
    size_t ident = 0;
    float exact_ms = 0, fast_ms;
    int f32 = !o->is_moe && (o->flags & DSV4_LIN_F32_OUT);
    int det_ok = 1, tind_ok = 1, ok;
    double gbs;

    if (ref == NULL || fast == NULL || again == NULL)
        exit(1);
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 0));
    TRY("sync", be->ops->sync(be));
    TRY("timer", dsv4_cuda_timer_start(tm));
    TRY("exact op", op_run(be, o, T));
    TRY("timer", dsv4_cuda_timer_stop(tm, &exact_ms));
    TRY("download", be->ops->download(be, ref, o->out, n * sizeof(float)));
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
    TRY("fast op", op_run(be, o, T));
    TRY("download", be->ops->download(be, fast, o->out, n * sizeof(float)));
    TRY("fast op", op_run(be, o, T));
    TRY("download", be->ops->download(be, again, o->out, n * sizeof(float)));

    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)fast[i] - ref[i]);

        if (!(d <= maxd))
            maxd = isnan(d) ? INFINITY : d;
        if (fabs((double)ref[i]) > maxr)
            maxr = fabs((double)ref[i]);
        ident += memcmp(&fast[i], &ref[i], sizeof(float)) == 0;
        det_ok &= memcmp(&fast[i], &again[i], sizeof(float)) == 0;
    }
    if (h->prev != NULL) {
        int rows = h->prev_T < T ? h->prev_T : T;

        tind_ok = memcmp(h->prev, fast, (size_t)rows * o->n_out * sizeof(float)) == 0;
    }
    free(h->prev);
    h->prev = fast;
    h->prev_T = T;

    rel = maxr > 0 ? maxd / maxr : maxd;
    bound = o->is_moe ? BOUND_MOE : f32 ? BOUND_F32 : BOUND_BF16;
    ident_min = o->is_moe ? IDENT_MOE : f32 ? 0.0 : IDENT_BF16;
    ok = rel <= bound && (double)ident / n >= ident_min && det_ok && tind_ok && maxr > 0;

    fast_ms = time_fast(be, tm, o, T);
    gbs = (double)bytes / (fast_ms * 1e-3) / 1e9;
    printf("%-4s %-5s T=%-3d maxrel %.2e (bound %.1e)  ident %5.1f%% (min %2.0f%%)  "
           "det %s  T-indep %s  exact %8.3f ms  fast %8.1f us  %6.0f GB/s  %.2f of peak\n",
           ok ? "ok" : "FAIL", o->name, T, rel, bound, 100.0 * ident / n, 100 * ident_min,
           det_ok ? "yes" : "NO", tind_ok ? "yes" : "NO", exact_ms, fast_ms * 1e3, gbs,
           gbs / PEAK_GBS);
    fflush(stdout);
    if (ok)
        ty->ok++;
    else
        ty->fail++;
    if (T <= 16) {
        ty->sum_ratio += gbs / PEAK_GBS;
        ty->n_ratio++;
    }
    free(ref);
    free(again);
}

/* Bytes of weights the moe reads at T: distinct experts routed to, + shared. */
static size_t
moe_bytes(const int32_t *ids, int T, size_t per_expert, size_t shared)
{
    char used[E_EXPERTS] = { 0 };
    size_t n = 0;

    for (int i = 0; i < T * K_PICKS; i++) {
        n += !used[ids[i]];
        used[ids[i]] = 1;
    }
    return n * per_expert + shared;
}

int
main(int argc, char **argv)
{
    struct dsv4_backend *be = NULL;
    struct dsv4_cuda_timer *tm;
    struct tally ty = { 0 };
    static const struct {
        const char *name;
        int fp8, N, K;
    } lins[] = {
        { "wq_a", 1, 1024, 4096 },
        { "wq_b", 1, 32768, 1024 },
        { "wo_b", 1, 4096, 8192 },
        { "wkv", 1, 512, 4096 },
        { "head", 0, 129280, 4096 },
    };
    int n_lin = (int)(sizeof(lins) / sizeof(lins[0]));
    float *xh, *x, *out, *wts;
    int32_t *ids;
    struct dsv4_expert_w *experts, shared;
    char *arena;
    size_t per_expert, off = 0, shared_bytes;
    uint8_t *stage;

    rng_state = argc > 1 ? strtoull(argv[1], NULL, 10) : 20261201ull;
    if (dsv4_backend_create(&be, "cuda", DSV4_NUMERICS_REF, 0) != DSV4_OK) {
        printf("skip: no CUDA backend (%s)\n", dsv4_errmsg());
        return 77;
    }
    tm = dsv4_cuda_timer_create(be);
    if (tm == NULL) {
        fprintf(stderr, "timer: %s\n", dsv4_errmsg());
        return 1;
    }
    printf("bench_fast: seed %llu; bounds: bf16 out %.1e (>= %.0f%% identical), fp32 out "
           "%.1e, moe %.1e (>= %.0f%% identical); GB/s of weight bytes, peak %.0f GB/s\n",
           (unsigned long long)(argc > 1 ? strtoull(argv[1], NULL, 10) : 20261201ull),
           BOUND_BF16, 100 * IDENT_BF16, BOUND_F32, BOUND_MOE, 100 * IDENT_MOE, PEAK_GBS);

    /* activations: (T_MAX, 8192) bf16-valued normals; rows are prefixes */
    xh = malloc((size_t)T_MAX * 8192 * sizeof(float));
    if (xh == NULL)
        return 1;
    for (size_t i = 0; i < (size_t)T_MAX * 8192; i++)
        xh[i] = dsv4_bf16_round(rng_normal());
    x = dev_upload(be, xh, (size_t)T_MAX * 8192 * sizeof(float));
    out = dev_alloc(be, (size_t)T_MAX * 129280 * sizeof(float));

    for (int l = 0; l < n_lin; l++) {
        struct op o = { .name = lins[l].name, .x = x, .out = out, .n_out = lins[l].N };
        struct hist h = { NULL, 0 };

        o.W = lins[l].fp8 ? make_fp8(be, lins[l].N, lins[l].K) : make_bf16(be, lins[l].N,
                                                                            lins[l].K);
        o.flags = lins[l].fp8 ? 0 : DSV4_LIN_F32_OUT;
        /* rows of x are K apart: re-lay the first T_MAX rows for this K */
        for (int t = 0; t < T_MAX; t++)
            TRY("upload", be->ops->upload(be, x + (size_t)t * lins[l].K,
                                          xh + (size_t)t * 8192,
                                          (size_t)lins[l].K * sizeof(float)));
        for (int i = 0; i < N_T; i++)
            run_case(be, tm, &o, t_list[i], (size_t)((t_list[i] + 15) / 16) * lin_bytes(&o.W),
                     &h, &ty);
        free(h.prev);
        be->ops->free(be, (void *)(uintptr_t)o.W.w);   /* ours: allocated above */
        be->ops->free(be, (void *)(uintptr_t)o.W.scale);
    }
    for (int t = 0; t < T_MAX; t++)
        TRY("upload", be->ops->upload(be, x + (size_t)t * D_MODEL, xh + (size_t)t * 8192,
                                      D_MODEL * sizeof(float)));

    /* experts: one arena, 256 x (w1, w3, w2) FP4; shared FP8 */
    per_expert = 0;
    {
        struct dsv4_linear a = { .n_out = I_EXPERT, .n_in = D_MODEL, .fmt = DSV4_WFMT_FP4 };
        struct dsv4_linear b = { .n_out = D_MODEL, .n_in = I_EXPERT, .fmt = DSV4_WFMT_FP4 };

        per_expert = 2 * lin_bytes(&a) + lin_bytes(&b);
    }
    arena = dev_alloc(be, (size_t)E_EXPERTS * (per_expert + 6 * 256));
    stage = malloc((size_t)D_MODEL * I_EXPERT / 2);
    experts = calloc(E_EXPERTS, sizeof(*experts));
    if (stage == NULL || experts == NULL)
        return 1;
    for (int e = 0; e < E_EXPERTS; e++) {
        experts[e].w1 = make_fp4(be, arena, &off, stage, I_EXPERT, D_MODEL);
        experts[e].w3 = make_fp4(be, arena, &off, stage, I_EXPERT, D_MODEL);
        experts[e].w2 = make_fp4(be, arena, &off, stage, D_MODEL, I_EXPERT);
    }
    free(stage);
    shared.w1 = make_fp8(be, I_EXPERT, D_MODEL);
    shared.w3 = make_fp8(be, I_EXPERT, D_MODEL);
    shared.w2 = make_fp8(be, D_MODEL, I_EXPERT);
    shared_bytes = lin_bytes(&shared.w1) + lin_bytes(&shared.w3) + lin_bytes(&shared.w2);
    TRY("register experts", dsv4_cuda_experts_register(be, experts, E_EXPERTS));

    /* routing: k distinct experts per token, positive weights summing to 1.5 */
    ids = malloc((size_t)T_MAX * K_PICKS * sizeof(int32_t));
    wts = malloc((size_t)T_MAX * K_PICKS * sizeof(float));
    if (ids == NULL || wts == NULL)
        return 1;
    for (int t = 0; t < T_MAX; t++) {
        float sum = 0;

        for (int j = 0; j < K_PICKS; j++) {
            int e, dup;

            do {
                e = (int)(rng_next() % E_EXPERTS);
                dup = 0;
                for (int m = 0; m < j; m++)
                    dup |= ids[t * K_PICKS + m] == e;
            } while (dup);
            ids[t * K_PICKS + j] = e;
            wts[t * K_PICKS + j] = (float)(0.1 + rng_unif());
            sum += wts[t * K_PICKS + j];
        }
        for (int j = 0; j < K_PICKS; j++)
            wts[t * K_PICKS + j] *= 1.5f / sum;
    }
    {
        struct op o = { .name = "moe", .is_moe = 1, .experts = experts, .shared = &shared,
                        .x = x, .out = out, .n_out = D_MODEL };
        struct hist h = { NULL, 0 };

        o.ids = dev_upload(be, ids, (size_t)T_MAX * K_PICKS * sizeof(int32_t));
        o.weights = dev_upload(be, wts, (size_t)T_MAX * K_PICKS * sizeof(float));
        for (int i = 0; i < N_T; i++) {
            int T = t_list[i];
            size_t bytes = moe_bytes(ids, T, per_expert, shared_bytes);

            run_case(be, tm, &o, T, bytes, &h, &ty);
        }
        free(h.prev);
    }

    printf("summary: %d ok, %d failed; mean share of peak bandwidth at T <= 16: %.2f\n",
           ty.ok, ty.fail, ty.n_ratio ? ty.sum_ratio / ty.n_ratio : 0.0);
    dsv4_cuda_experts_release(be, experts);
    dsv4_cuda_timer_destroy(tm);
    dsv4_backend_destroy(be);
    free(experts);
    free(ids);
    free(wts);
    free(xh);
    return ty.fail ? 1 : 0;
}
