/*
 * bench_fast.c — the fast decode kernels (kernels/cuda_fast.h) against the
 * exact CUDA kernels on the flash shapes, then their speed.
 *
 *   bench_fast [SEED]
 *
 * Cases, each at T = 1, 4, 16, 64 token rows, REF numerics, random weights
 * in the checkpoint formats:
 *   linear   wq_a 4096->1024, wq_b 1024->32768, wo_b 8192->4096, wkv
 *            4096->512, idx_wq_b 1024->8192, proj 4096->4096, wq_b and wo_b
 *            at TP = 2 (FP8, 128x128 E8M0 scales), head 4096->129280, gate
 *            4096->256, cwkv 4096->1024 (BF16, fp32 out as the forward runs
 *            them); wo_a: linear_grouped, 8 (and 4) groups of 1024 x 4096 FP8
 *            run as bf16.  Each on the one-launch form (DSV4_CUDA_LINEAR=
 *            fused) with the checks below, then the three-launch form (the
 *            default) and the two-launch form (v1r: split-K added in the
 *            tile kernel) against it: bit for bit equal (else the first
 *            differing value: index, token, column, both values), graph
 *            replay == plain call for each, kernels per call in the graph
 *            (one launch: one per pass of 16 tokens; two: at most three's),
 *            us per call of each ("lin" lines, a table at the end); first
 *            the one-launch FP8 activation code against the exact
 *            expression on all 2^32 floats ("linear quant check");
 *   moe      256 FP4 experts D=4096 I=2048, k=6, FP8 shared expert, and
 *            moe_parts with the odd experts held elsewhere, at T = 1, 2, 4,
 *            8, 16, 32, 64, for every setting of DSV4_CUDA_FAST_MOE in a
 *            sweep (BENCH_MOE_CFGS, default moe_cfgs_default), a table of
 *            the shares of peak per setting at the end ("moe cfg" lines);
 *   norm     rms_norm (T, 4096) with a weight; norm_h: (T*64, 512) without
 *            (the per-head q norm);
 *   hc_pre   n = 4 streams of 4096, Sinkhorn 20 iterations (x, post, comb);
 *   hc_head  the same streams, the head form;
 *   router   BF16 gate 256 x 4096, bias, k = 6, learned routing;
 *   comp4, comp128  compress at ratio 4 (c = 2) and 128, d = 512, one slot
 *            per row, every row emitting (state pools restored before each
 *            checked run).
 *
 * Per case: the exact path and the fast path on the same inputs; per output,
 * the largest |fast - exact| relative to the largest |exact|, and the share
 * of bit-identical values, against bounds (the fast paths sum in another
 * order, so they differ by fp32 rounding before any bf16 rounding):
 *   bf16 outputs (FP8 linear, wo_a)  max rel <= 2^-7 (one bf16 ulp of the
 *                               largest value, doubled), >= 90% identical;
 *   fp32 outputs (head)         max rel <= 2^-13 (the x = hi + lo split
 *                               leaves 2^-17 per term, plus fp32 sums);
 *   moe                         max rel <= 2^-5, >= 50% identical (a
 *                               one-ulp change of g or u can move an h value
 *                               to the next FP8 code, 2^-3 of that value);
 *   rms_norm                    2^-7, >= 99% identical (only the row's sum
 *                               of squares is summed in another order);
 *   hc_pre / hc_head            x: 2^-7, >= 95% identical; post, comb (fp32):
 *                               2^-12 (only the mix sums differ);
 *   router                      the picks equal the exact ones but at near
 *                               ties: a token whose picks differ is a flip
 *                               (counted, printed), and each differing pick
 *                               must have an exact score (sqrt(softplus(l))
 *                               + bias, from the exact gate logits) within
 *                               2^-10 of the token's largest score of the
 *                               exact pick's; weights (fp32) of the tokens
 *                               without a flip: 2^-12;
 *   compress                    entries (fp32) 2^-12; the state pools
 *                               after the call bit-identical.
 * Also checked: the fast path gives the same bits on a second run, and the
 * first rows at this T equal those at the previous (smaller) T: results do
 * not depend on T.  Then the fast op is recorded 10 times into a CUDA graph
 * (as decode runs it) and the graph timed with CUDA events: median of 15
 * launches after a warm-up, per op; GB/s counts the bytes the op must move:
 * weights (for the MoE: the experts routed to plus the shared expert), and
 * for the small ops their activations too; the ratio is to 4.3 TB/s
 * (DESIGN.md §7) and the summary averages it over the weight-streaming ops
 * (linear, wo_a, moe) at T <= 16.  T = 64 reads the weights of an expert or
 * matrix once per 16 tokens (the fast path's pass size).
 *
 * Decode MoE self-check (before each setting's moe cases): moe_parts of one
 * token through one FP4 expert and the FP8 shared expert against a host
 * reference of the same formula, first with an identity w2 (y shows h
 * column by column), then with random w2; the first value off is printed
 * (moe_selfcheck).  The moe cases also check that the last call of the
 * timed CUDA graph left the same bits as the plain call ("replay").
 * BENCH_FAST_ONLY=moe runs only the MoE cases (self-checks and sweep).
 *
 * BENCH_FAST_ONLY=linear runs only the linear cases (linear, wo_a).
 * BENCH_FAST_ONLY=prefill runs only the prefill cases below (pf_*).
 *
 * Prefill cases (kernels/cuda/fast_gemm.cu, after the decode ones): the FP8
 * linears pf_wq_a 4096->1024, pf_wq_b 1024->16384 (half of 64x512 per rank),
 * pf_wkv 4096->512, pf_wo_b 8192->4096, pf_idxq 1024->8192, and the BF16
 * linears pf_cwkv 4096->1024 (compressor at ratio 4: c*d = 2*512, fp32
 * out), pf_cwk128 4096->512 (ratio 128, fp32 out), pf_wproj 4096->64
 * (indexer weights_proj, bf16 out), pf_gate 4096->256 (router gate, fp32
 * out) at T = 32, 128, 512, 2048, 8192; pf_moe / pf_parts (moe, and
 * moe_parts with the odd experts not held) at T = 64, 256, 512, 1024, 2048
 * tokens of random routing (6 of 256 per token), and at T = 512 again with
 * every FP4 group scale raised 2^12 (fw_kernel's decode for scales of 2^1
 * and more).  Each case runs on both
 * paths of the prefill GEMMs: "wgmma" (the Hopper path, the default) and
 * "mma" (dsv4_cuda_set_wgmma(0): the mma.sync GEMMs, the decode kernels
 * for BF16), each checked on 48 sampled rows against the exact op on those
 * rows (same bounds as above; a failure prints the first value out of
 * bounds with its token row and column, and the largest difference), run
 * twice for determinism (pf_moe / pf_parts on "wgmma" also the timed
 * graph's last replay against the plain call: the same bits), and timed:
 * TFLOP/s of the products, GB/s of weights + fp32 activations, and the
 * ratio of the op's floor (the larger of FLOPs at 990 TFLOP/s and bytes at
 * 4.3 TB/s) to the time.
 *
 * FP8 x FP8 prefill linear (kernels/cuda/fast_gemm8.cu; BENCH_FAST_ONLY=gemm8
 * runs only these, nothing else): wq_a, wq_b, wq_b/2, wkv, wo_b, wo_b/2
 * (4096 x 4096), idx_wq_b at T = 128, 300, 512, 2048: the kernel called directly
 * ("gemm8"; each case twice, "lt:" on cuBLASLt and "wg:" on g8_kernel) and the linear op without it ("fw/op": fw_kernel where the cost
 * model takes the GEMM, else the decode kernels) against the exact op on 48
 * sampled rows (bounds as the FP8 linears), gemm8 run twice (same bits),
 * its first 32 rows at every T equal to those at T = 128, the timed graph's
 * last replay equal to the plain call; us per call, TFLOP/s and the speedup
 * over fw/op.
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
#include "kernels/cuda_gemm8.h"
#include "kernels/cuda_gemm_grouped.h"   /* dsv4_cuda_set_blas */
#include "tests/gpu/gpu_test_util.h"   /* TRY */

#define PEAK_GBS 4300.0      /* DESIGN.md §7: device copy bandwidth per H200 */
#define GRAPH_REPS 10        /* op calls per recorded graph */
#define N_TIMED 15           /* timed graph launches */
#define T_MAX 64
#define E_EXPERTS 256
#define K_PICKS 6
#define D_MODEL 4096
#define I_EXPERT 2048
#define O_GROUPS 8           /* wo_a: 8 groups of 1024 x 4096 */
#define O_RANK 1024
#define N_HEADS 64           /* per-head q norm: 64 rows of 512 per token */
#define HEAD_DIM 512
#define HC_N 4               /* hyper-connection streams */
#define HC_ITERS 20

/* Bounds (see the header). */
#define BOUND_BF16 0x1p-7
#define BOUND_F32 0x1p-13
#define BOUND_MOE 0x1p-5
#define IDENT_BF16 0.90
#define IDENT_MOE 0.50
#define IDENT_NORM 0.99      /* rms_norm: only the row's sum of squares differs */
#define IDENT_HC 0.95        /* hc_pre/hc_head x: only the mix sums differ */
#define BOUND_HC 0x1p-12     /* hc post, comb (fp32) */
#define BOUND_ROUTE 0x1p-12  /* router weights (fp32), tokens with the same picks */
#define ROUTE_TIE 0x1p-10    /* near tie: exact scores within this share of the top one */
#define BOUND_COMP 0x1p-12   /* compress entries (fp32); its state pools: identical */

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

enum op_kind {
    OP_LINEAR, OP_MOE, OP_GROUPED, OP_NORM, OP_HC_PRE, OP_HC_HEAD, OP_ROUTER, OP_COMPRESS,
    OP_PARTS
};

#define MAX_OUTS 3

/* One output array of an op: (T, w) values of 4 bytes (fp32, or int32 ids). */
struct out_arr {
    const char *tag;
    void *dev;
    int w;            /* values per token */
    int is_id;        /* router ids: compared by the near-tie rule */
    double bound;     /* max |fast - exact| / max |exact| */
    double ident;     /* least share of bit-identical values */
};

/* What a case runs on the given T. */
struct op {
    const char *name;
    enum op_kind kind;
    int bw;           /* weight-streaming op: counted in the bandwidth summary */
    /* linear, grouped (G groups), router (gate) */
    struct dsv4_linear W;
    unsigned flags;
    int G;
    /* moe */
    const struct dsv4_expert_w *experts, *shared;
    const int32_t *ids;
    const float *weights;
    /* rms_norm: rows_per_t rows of D per token; nw may be NULL */
    const uint16_t *nw;
    int rows_per_t, D;
    /* hc */
    const struct dsv4_hc_w *hc;
    int n;
    /* router */
    const float *bias;
    float *logits;    /* (T, E) scratch for the near-tie check */
    /* compress: ratio r, d channels; state pools (T_MAX slots) and their
     * initial contents (restored before each checked run) */
    int r;
    float *skv, *sz;
    const float *skv0, *sz0, *za, *ape;
    size_t pool_bytes;
    const int32_t *slot, *pos, *emit;
    /* common */
    const float *x;
    struct out_arr outs[MAX_OUTS];
    int n_outs;
};

static enum dsv4_err
op_run(struct dsv4_backend *be, const struct op *o, int T)
{
    float *o0 = o->outs[0].dev, *o1 = o->outs[1].dev, *o2 = o->outs[2].dev;

    switch (o->kind) {
    case OP_MOE:
        return be->ops->moe(be, o0, o->x, o->ids, o->weights, o->experts, o->shared, T,
                            K_PICKS, 10.0f);
    case OP_PARTS:
        return be->ops->moe_parts(be, o0, o->x, o->ids, o->weights, o->experts, o->shared, T,
                                  K_PICKS, D_MODEL, 10.0f);
    case OP_GROUPED:
        return be->ops->linear_grouped(be, o0, o->x, &o->W, T, o->G);
    case OP_NORM:
        return be->ops->rms_norm(be, o0, o->x, o->nw, T * o->rows_per_t, o->D, 1e-6f);
    case OP_HC_PRE:
        return be->ops->hc_pre(be, o0, o1, o2, o->x, o->hc, T, o->n, o->D, HC_ITERS, 1e-6f,
                               1e-6f);
    case OP_HC_HEAD:
        return be->ops->hc_head(be, o0, o->x, o->hc, T, o->n, o->D, 1e-6f, 1e-6f);
    case OP_ROUTER:
        return be->ops->router(be, o1, (int32_t *)o0, o->x, &o->W, o->bias, NULL, NULL, T,
                               K_PICKS, 1.5f);
    case OP_COMPRESS:
        return be->ops->compress(be, o0, o->skv, o->sz, o->x, o->za, o->ape, o->slot, o->pos,
                                 o->emit, T, o->r, o->D);
    default:
        return be->ops->linear(be, o0, o->x, &o->W, T, o->flags);
    }
}

/* Before a checked run: ops that update state in place start from the same
 * state each time. */
static void
op_reset(struct dsv4_backend *be, const struct op *o)
{
    if (o->kind != OP_COMPRESS)
        return;
    TRY("copy", be->ops->copy(be, o->skv, o->skv0, o->pool_bytes));
    TRY("copy", be->ops->copy(be, o->sz, o->sz0, o->pool_bytes));
}

/* Per-op state kept across T: the previous fast results (T-independence). */
struct hist {
    void *prev[MAX_OUTS];
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

/* Median time (ms) of one call of f(be, ctx, T), from graphs of GRAPH_REPS
 * calls (what f writes then holds the last replay's values). */
static float
time_calls(struct dsv4_backend *be, struct dsv4_cuda_timer *tm,
           enum dsv4_err (*f)(struct dsv4_backend *, const void *, int), const void *ctx, int T)
{
    void *g = NULL;
    float ms[N_TIMED];

    TRY("graph_begin", be->ops->graph_begin(be));
    for (int i = 0; i < GRAPH_REPS; i++)
        TRY("op (recording)", f(be, ctx, T));
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

static enum dsv4_err
op_call(struct dsv4_backend *be, const void *o, int T)
{
    return op_run(be, (const struct op *)o, T);
}

/* Median time (ms) of one op call, from graphs of GRAPH_REPS calls. */
static float
time_fast(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct op *o, int T)
{
    return time_calls(be, tm, op_call, o, T);
}

/* Comparison of one float output (or the router's weights). */
struct diff {
    double maxd, maxr;
    size_t ident, n;
};

static void
diff_add(struct diff *d, const float *fast, const float *ref, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double dd = fabs((double)fast[i] - ref[i]);

        if (!(dd <= d->maxd))
            d->maxd = isnan(dd) ? INFINITY : dd;
        if (fabs((double)ref[i]) > d->maxr)
            d->maxr = fabs((double)ref[i]);
        d->ident += memcmp(&fast[i], &ref[i], sizeof(float)) == 0;
    }
    d->n += n;
}

/* sqrt(softplus(l)) + bias, in double (the near-tie check's scores). */
static double
route_score(float l, float bias)
{
    return sqrt(l > 20.0f ? (double)l : log1p(exp((double)l))) + bias;
}

/*
 * Router ids: tokens whose picks differ from the exact ones are counted as
 * flips; every differing pick must be a near tie (the two experts' exact
 * scores within ROUTE_TIE of the token's largest score), else *bad is set.
 * The weights of tokens with identical picks go into d.
 */
static int
router_compare(const struct op *o, int T, const int32_t *fid, const int32_t *rid,
               const float *fw, const float *rw, const float *logits, const float *bias,
               struct diff *d, int *bad)
{
    int E = o->W.n_out, flips = 0;

    for (int t = 0; t < T; t++) {
        const int32_t *a = rid + (size_t)t * K_PICKS, *b = fid + (size_t)t * K_PICKS;
        double top = 0;

        if (memcmp(a, b, K_PICKS * sizeof(int32_t)) == 0) {
            diff_add(d, fw + (size_t)t * K_PICKS, rw + (size_t)t * K_PICKS, K_PICKS);
            continue;
        }
        flips++;
        for (int e = 0; e < E; e++) {
            double v = fabs(route_score(logits[(size_t)t * E + e], bias[e]));

            top = v > top ? v : top;
        }
        for (int j = 0; j < K_PICKS; j++) {
            double va, vb;

            if (a[j] == b[j])
                continue;
            if (b[j] < 0 || b[j] >= E) {
                *bad = 1;
                continue;
            }
            va = route_score(logits[(size_t)t * E + a[j]], bias[a[j]]);
            vb = route_score(logits[(size_t)t * E + b[j]], bias[b[j]]);
            if (!(fabs(va - vb) <= ROUTE_TIE * top))
                *bad = 1;
        }
    }
    return flips;
}

/* One case at T (checks, then timing); returns the share of peak bandwidth. */
static double
run_case(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct op *o, int T,
         size_t bytes, struct hist *h, struct tally *ty)
{
    void *ref[MAX_OUTS], *fast[MAX_OUTS], *again[MAX_OUTS];
    float exact_ms = 0, fast_ms, *logits = NULL, *bias = NULL;
    int det_ok = 1, tind_ok = 1, ok = 1, flips = -1, bad_flip = 0, replay_ok = 1;
    char line[512];
    size_t len = 0;
    double gbs;

    for (int i = 0; i < o->n_outs; i++) {
        size_t nb = (size_t)T * o->outs[i].w * 4;

        ref[i] = malloc(nb);
        fast[i] = malloc(nb);
        again[i] = malloc(nb);
        if (ref[i] == NULL || fast[i] == NULL || again[i] == NULL)
            exit(1);
    }
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 0));
    if (o->kind == OP_ROUTER) {   /* exact logits and the bias, for the near-tie check */
        size_t ne = (size_t)T * o->W.n_out;

        logits = malloc(ne * sizeof(float));
        bias = malloc((size_t)o->W.n_out * sizeof(float));
        if (logits == NULL || bias == NULL)
            exit(1);
        TRY("gate", be->ops->linear(be, o->logits, o->x, &o->W, T, DSV4_LIN_F32_OUT));
        TRY("download", be->ops->download(be, logits, o->logits, ne * sizeof(float)));
        TRY("download", be->ops->download(be, bias, o->bias, o->W.n_out * sizeof(float)));
    }
    op_reset(be, o);
    TRY("sync", be->ops->sync(be));
    TRY("timer", dsv4_cuda_timer_start(tm));
    TRY("exact op", op_run(be, o, T));
    TRY("timer", dsv4_cuda_timer_stop(tm, &exact_ms));
    for (int i = 0; i < o->n_outs; i++)
        TRY("download", be->ops->download(be, ref[i], o->outs[i].dev,
                                          (size_t)T * o->outs[i].w * 4));
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
    op_reset(be, o);
    TRY("fast op", op_run(be, o, T));
    for (int i = 0; i < o->n_outs; i++)
        TRY("download", be->ops->download(be, fast[i], o->outs[i].dev,
                                          (size_t)T * o->outs[i].w * 4));
    op_reset(be, o);
    TRY("fast op", op_run(be, o, T));
    for (int i = 0; i < o->n_outs; i++)
        TRY("download", be->ops->download(be, again[i], o->outs[i].dev,
                                          (size_t)T * o->outs[i].w * 4));

    for (int i = 0; i < o->n_outs; i++) {
        const struct out_arr *a = &o->outs[i];
        size_t nb = (size_t)T * a->w * 4;
        struct diff d = { 0, 0, 0, 0 };
        double rel;
        int this_ok;

        det_ok &= memcmp(fast[i], again[i], nb) == 0;
        if (h->prev[i] != NULL) {
            int rows = h->prev_T < T ? h->prev_T : T;

            tind_ok &= memcmp(h->prev[i], fast[i], (size_t)rows * a->w * 4) == 0;
        }
        if (a->is_id) {
            flips = router_compare(o, T, fast[i], ref[i], fast[i + 1], ref[i + 1], logits,
                                   bias, &d, &bad_flip);
            i++;   /* the weights, compared with the ids */
            det_ok &= memcmp(fast[i], again[i], nb) == 0;
            if (h->prev[i] != NULL) {
                int rows = h->prev_T < T ? h->prev_T : T;

                tind_ok &= memcmp(h->prev[i], fast[i], (size_t)rows * a->w * 4) == 0;
            }
            a = &o->outs[i];
        } else {
            diff_add(&d, fast[i], ref[i], (size_t)T * a->w);
        }
        rel = d.maxr > 0 ? d.maxd / d.maxr : d.maxd;
        /* (router: no weights to compare when every token's picks flipped) */
        this_ok = d.n == 0 ? flips > 0 : rel <= a->bound && (double)d.ident / d.n >= a->ident &&
                                          d.maxr > 0;
        ok &= this_ok;
        len += (size_t)snprintf(line + len, sizeof(line) - len,
                                "%s%s maxrel %.2e (%.1e) ident %5.1f%% (%2.0f%%)  ",
                                this_ok ? "" : "!", a->tag, rel, a->bound,
                                d.n ? 100.0 * d.ident / d.n : 0.0, 100 * a->ident);
        if (len >= sizeof(line))
            len = sizeof(line) - 1;
    }
    if (flips >= 0)
        len += (size_t)snprintf(line + len, sizeof(line) - len, "flips %d%s  ", flips,
                                bad_flip ? " (NOT near ties)" : " (near ties)");
    ok &= det_ok && tind_ok && !bad_flip;
    for (int i = 0; i < o->n_outs; i++) {
        free(h->prev[i]);
        h->prev[i] = fast[i];
        free(ref[i]);
        free(again[i]);
    }
    h->prev_T = T;
    free(logits);
    free(bias);

    fast_ms = time_fast(be, tm, o, T);
    if (o->kind == OP_MOE || o->kind == OP_PARTS) {   /* the graph's last call == plain */
        for (int i = 0; i < o->n_outs; i++) {
            size_t nb = (size_t)T * o->outs[i].w * 4;
            void *g = malloc(nb);

            if (g == NULL)
                exit(1);
            TRY("download", be->ops->download(be, g, o->outs[i].dev, nb));
            replay_ok &= memcmp(g, h->prev[i], nb) == 0;
            free(g);
        }
        ok &= replay_ok;
        len += (size_t)snprintf(line + len, sizeof(line) - len, "replay %s  ",
                                replay_ok ? "yes" : "NO");
        if (len >= sizeof(line))
            len = sizeof(line) - 1;
    }
    gbs = (double)bytes / (fast_ms * 1e-3) / 1e9;
    printf("%-4s %-8s T=%-3d %sdet %s  T-indep %s  exact %8.3f ms  fast %8.1f us  "
           "%6.0f GB/s  %.2f of peak\n",
           ok ? "ok" : "FAIL", o->name, T, line, det_ok ? "yes" : "NO", tind_ok ? "yes" : "NO",
           exact_ms, fast_ms * 1e3, gbs, gbs / PEAK_GBS);
    fflush(stdout);
    if (ok)
        ty->ok++;
    else
        ty->fail++;
    if (T <= 16 && o->bw) {
        ty->sum_ratio += gbs / PEAK_GBS;
        ty->n_ratio++;
    }
    return gbs / PEAK_GBS;
}

/* Run o at every T of t_list; bytes_at(T) = bytes the op must move. */
static void
run_all(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct op *o,
        size_t fixed_bytes, size_t per_token_bytes, int per_pass, struct tally *ty)
{
    struct hist h;

    memset(&h, 0, sizeof(h));
    for (int i = 0; i < N_T; i++) {
        int T = t_list[i];
        size_t passes = per_pass ? (size_t)(T + 15) / 16 : 1;

        run_case(be, tm, o, T, passes * fixed_bytes + (size_t)T * per_token_bytes, &h, ty);
    }
    for (int i = 0; i < MAX_OUTS; i++)
        free(h.prev[i]);
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

/* The same for moe_parts with the odd experts held elsewhere: the distinct
 * even experts routed to, + shared. */
static size_t
moe_bytes_even(const int32_t *ids, int T, size_t per_expert, size_t shared)
{
    char used[E_EXPERTS] = { 0 };
    size_t n = 0;

    for (int i = 0; i < T * K_PICKS; i++) {
        n += !used[ids[i]] && ids[i] % 2 == 0;
        used[ids[i]] = 1;
    }
    return n * per_expert + shared;
}

/* n fp32 values: normals times `scale`, rounded to bf16 when round != 0. */
static float *
host_normals(size_t n, float scale, int round)
{
    float *h = malloc(n * sizeof(float));

    if (h == NULL)
        exit(1);
    for (size_t i = 0; i < n; i++) {
        h[i] = rng_normal() * scale;
        if (round)
            h[i] = dsv4_bf16_round(h[i]);
    }
    return h;
}

/* The same, uploaded (the host copy freed). */
static float *
dev_normals(struct dsv4_backend *be, size_t n, float scale, int round)
{
    float *h = host_normals(n, scale, round), *d = dev_upload(be, h, n * sizeof(float));

    free(h);
    return d;
}

/* hc weights for n streams of D (head: the hc_head form). */
static struct dsv4_hc_w
make_hc(struct dsv4_backend *be, int n, int D, int head)
{
    struct dsv4_hc_w hc;
    int M = head ? n : (2 + n) * n;
    float sc[3] = { 0.8f, 0.6f, 1.2f };

    hc.fn = dev_normals(be, (size_t)M * n * D, 0.01f, 0);
    hc.base = dev_normals(be, (size_t)M, 0.5f, 0);
    hc.scale = dev_upload(be, sc, (head ? 1 : 3) * sizeof(float));
    return hc;
}

/* An out_arr of w fp32 values per token on `dev`. */
static struct out_arr
out_f32(const char *tag, void *dev, int w, double bound, double ident)
{
    struct out_arr a = { tag, dev, w, 0, bound, ident };

    return a;
}

/* Routing of n tokens: k distinct experts per token, positive weights
 * summing to 1.5. */
static void
make_routing(int32_t *ids, float *wts, int n)
{
    for (int t = 0; t < n; t++) {
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
}

/* --- decode MoE self-check: one expert, one token, a scalar reference ---------------- */

/*
 * moe_parts at T = 1, k = 1 on one FP4 expert (pick row 0) and the FP8
 * shared expert (row 1) against a host computation of the same formula
 * (x and h quantized per 128 columns by dsv4_fp8_quant_block, dot products
 * in double, g and u rounded to bf16, the SwiGLU with limit 10, route
 * weight 0.75, y rounded to bf16), twice: with w2 (both experts) an
 * identity on the first I columns, so that y[c] = the quantized h[c]
 * itself ("up": checks w1, w3, the SwiGLU and h's quantization column by
 * column), then with random w2 ("all").  Each prints the largest
 * |gpu - ref| / max |ref|, the share of identical values and the first
 * value off by more than 2^-6 of max |ref| (column, gpu, ref, the
 * reference's h or x scale there), which points at a fragment layout
 * error (a whole tile, a column pattern within 32 or 128 columns).
 * Bounds: up 2^-4 and >= 90% identical (a one-ulp change of g or u moves
 * an h value by at most one FP8 step); all: the moe bounds.
 */
struct sc_expert {
    uint8_t *w[3], *s[3];      /* host: w1, w3, w2 codes and scales (w2: random) */
    uint8_t *wi, *si;          /* host: the identity w2 */
    struct dsv4_expert_w dev;  /* device, random w2 */
    struct dsv4_expert_w devi; /* device, identity w2 (w1, w3 shared with dev) */
};

/* Value of weight (r, c) of linear m (0 w1, 1 w3, 2 w2; id: the identity
 * w2) of e; fp8: the shared expert's format. */
static double
sc_weight(const struct sc_expert *e, int fp8, int m, int id, int r, int c)
{
    int K = m == 2 ? I_EXPERT : D_MODEL;
    const uint8_t *w = id ? e->wi : e->w[m], *sc = id ? e->si : e->s[m];

    if (fp8)
        return (double)dsv4_fp8_to_f32(w[(size_t)r * K + c]) *
               dsv4_e8m0_to_f32(sc[(size_t)(r / 128) * (K / 128) + c / 128]);
    return (double)dsv4_fp4_get(w + (size_t)r * (K / 2), (size_t)c) *
           dsv4_e8m0_to_f32(sc[(size_t)r * (K / 32) + c / 32]);
}

/* Random codes (FP8: no NaN) and scales of one expert, uploaded; the
 * identity w2 beside them. */
static void
sc_make(struct dsv4_backend *be, struct sc_expert *e, int fp8)
{
    struct dsv4_linear *L[3];

    for (int m = 0; m < 3; m++) {
        int N = m == 2 ? D_MODEL : I_EXPERT, K = m == 2 ? I_EXPERT : D_MODEL;
        size_t nw = fp8 ? (size_t)N * K : (size_t)N * K / 2;
        size_t ns = fp8 ? (size_t)(N / 128) * (K / 128) : (size_t)N * (K / 32);

        e->w[m] = malloc(nw);
        e->s[m] = malloc(ns);
        if (e->w[m] == NULL || e->s[m] == NULL)
            exit(1);
        fill_bytes(e->w[m], nw, fp8 ? 0xbf : 0xff);
        fill_scales(e->s[m], ns, fp8 ? 120 : 118, fp8 ? 5 : 7);
        L[m] = m == 0 ? &e->dev.w1 : m == 1 ? &e->dev.w3 : &e->dev.w2;
        L[m]->n_out = N;
        L[m]->n_in = K;
        L[m]->fmt = fp8 ? DSV4_WFMT_FP8 : DSV4_WFMT_FP4;
        L[m]->w = dev_upload(be, e->w[m], nw);
        L[m]->scale = dev_upload(be, e->s[m], ns);
        if (m == 2) {   /* identity: row r < I has 1.0 at column r, scales 1 */
            e->wi = calloc(nw, 1);
            e->si = malloc(ns);
            if (e->wi == NULL || e->si == NULL)
                exit(1);
            memset(e->si, 127, ns);
            for (int r = 0; r < I_EXPERT; r++) {
                if (fp8)
                    e->wi[(size_t)r * K + r] = 0x38;               /* E4M3 1.0 */
                else
                    e->wi[(size_t)r * (K / 2) + r / 2] = (uint8_t)(2 << (4 * (r & 1)));
            }
            e->devi = e->dev;
            e->devi.w2.w = dev_upload(be, e->wi, nw);
            e->devi.w2.scale = dev_upload(be, e->si, ns);
        }
    }
}

static void
sc_free(struct dsv4_backend *be, struct sc_expert *e)
{
    be->ops->free(be, (void *)(uintptr_t)e->devi.w2.w);
    be->ops->free(be, (void *)(uintptr_t)e->devi.w2.scale);
    be->ops->free(be, (void *)(uintptr_t)e->dev.w1.w);
    be->ops->free(be, (void *)(uintptr_t)e->dev.w1.scale);
    be->ops->free(be, (void *)(uintptr_t)e->dev.w3.w);
    be->ops->free(be, (void *)(uintptr_t)e->dev.w3.scale);
    be->ops->free(be, (void *)(uintptr_t)e->dev.w2.w);
    be->ops->free(be, (void *)(uintptr_t)e->dev.w2.scale);
    for (int m = 0; m < 3; m++) {
        free(e->w[m]);
        free(e->s[m]);
    }
    free(e->wi);
    free(e->si);
}

/* x (D) quantized as the exact path does: dequantized values xd, scales xs. */
static void
sc_quant(double *xd, float *xs, const float *x, int n)
{
    uint8_t q[128];

    for (int b = 0; b < n / 128; b++) {
        float s = dsv4_fp8_quant_block(q, x + b * 128, 128);

        xs[b] = s;
        for (int i = 0; i < 128; i++)
            xd[b * 128 + i] = (double)dsv4_fp8_to_f32(q[i]) * s;
    }
}

/* The reference row y (D) of expert e for x (weight w; 0: the shared
 * expert, no weight); hs: h's scales. */
static void
sc_ref(float *y, float *hs, const struct sc_expert *e, int fp8, int id, const float *x,
       float w)
{
    double *xd = malloc(D_MODEL * sizeof(double)), *hd = malloc(I_EXPERT * sizeof(double));
    float *h = malloc(I_EXPERT * sizeof(float)), xs[D_MODEL / 128];

    if (xd == NULL || hd == NULL || h == NULL)
        exit(1);
    sc_quant(xd, xs, x, D_MODEL);
    for (int i = 0; i < I_EXPERT; i++) {
        double g = 0, u = 0;
        float gv, uv, v;

        for (int c = 0; c < D_MODEL; c++) {
            g += sc_weight(e, fp8, 0, 0, i, c) * xd[c];
            u += sc_weight(e, fp8, 1, 0, i, c) * xd[c];
        }
        gv = dsv4_bf16_round((float)g);
        uv = dsv4_bf16_round((float)u);
        gv = gv < 10.0f ? gv : 10.0f;
        uv = uv < -10.0f ? -10.0f : uv > 10.0f ? 10.0f : uv;
        v = gv / (1.0f + (float)exp(-(double)gv)) * uv;
        if (w != 0.0f)
            v *= w;
        h[i] = dsv4_bf16_round(v);
    }
    sc_quant(hd, hs, h, I_EXPERT);
    for (int d = 0; d < D_MODEL; d++) {
        double acc = 0;

        for (int i = 0; i < I_EXPERT; i++) {
            double wv = sc_weight(e, fp8, 2, id, d, i);

            if (wv != 0.0)
                acc += wv * hd[i];
        }
        y[d] = dsv4_bf16_round((float)acc);
    }
    free(xd);
    free(hd);
    free(h);
}

/* Compare one row; returns 1 when within (bound, ident). */
static int
sc_compare(const char *cfg, const char *what, const float *gpu, const float *ref, int n,
           const float *hs, double bound, double ident)
{
    struct diff d = { 0, 0, 0, 0 };
    double rel;
    int first = -1, ok;

    diff_add(&d, gpu, ref, (size_t)n);
    for (int i = 0; i < n && first < 0; i++)
        if (!(fabs((double)gpu[i] - ref[i]) <= 0x1p-6 * d.maxr))
            first = i;
    rel = d.maxr > 0 ? d.maxd / d.maxr : d.maxd;
    ok = d.maxr > 0 && rel <= bound && (double)d.ident / d.n >= ident;
    printf("%s moe selfcheck %-9s %-10s maxrel %.2e (%.1e) ident %5.1f%% (%2.0f%%)", ok ? "ok  " :
           "FAIL", cfg, what, rel, bound, 100.0 * d.ident / d.n, 100 * ident);
    if (first >= 0)
        printf("  first off: col %d (in 128: %d, in 32: %d) gpu %.6g ref %.6g", first,
               first % 128, first % 32, gpu[first], ref[first]);
    if (first >= 0 && hs != NULL)   /* y[c] is the quantized h[c] */
        printf(" (h scale %.3g)", hs[first / 128]);
    printf("\n");
    return ok;
}

/*
 * The self-check under the DSV4_CUDA_FAST_MOE setting now in the
 * environment (sc: the pick's and the shared expert's weights; ref: their
 * reference rows, [0] up pick, [1] up shared, [2] all pick, [3] all shared;
 * hs: the reference h scales of the same).
 */
static void
moe_selfcheck(struct dsv4_backend *be, const char *cfg, struct sc_expert *sc,
              const float *x, float (*ref)[D_MODEL], float (*hs)[I_EXPERT / 128],
              struct tally *ty)
{
    static const char *what[4] = { "up pick", "up shared", "all pick", "all shared" };
    int32_t id = 0;
    float w = 0.75f, *y = malloc(2 * D_MODEL * sizeof(float)), *zero;
    float *y_d = dev_alloc(be, 2 * D_MODEL * sizeof(float));
    int32_t *id_d = dev_upload(be, &id, sizeof(id));
    float *w_d = dev_upload(be, &w, sizeof(w));

    zero = calloc(2 * D_MODEL, sizeof(float));
    if (y == NULL || zero == NULL)
        exit(1);
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
    for (int pass = 0; pass < 2; pass++) {   /* 0: identity w2, 1: random w2 */
        struct dsv4_expert_w *e = pass ? &sc[0].dev : &sc[0].devi;
        const struct dsv4_expert_w *shared = pass ? &sc[1].dev : &sc[1].devi;

        TRY("register experts", dsv4_cuda_experts_register(be, e, 1));
        TRY("upload", be->ops->upload(be, y_d, zero, 2 * D_MODEL * sizeof(float)));
        TRY("moe_parts", be->ops->moe_parts(be, y_d, x, id_d, w_d, e, shared, 1, 1, D_MODEL,
                                            10.0f));
        TRY("download", be->ops->download(be, y, y_d, 2 * D_MODEL * sizeof(float)));
        dsv4_cuda_experts_release(be, e);
        for (int r = 0; r < 2; r++) {
            int k = pass * 2 + r, n = pass ? D_MODEL : I_EXPERT;
            int ok = sc_compare(cfg, what[k], y + (size_t)r * D_MODEL, ref[k], n,
                                pass ? NULL : hs[k],
                                pass ? BOUND_MOE : 0x1p-4, pass ? IDENT_MOE : 0.90);

            if (ok)
                ty->ok++;
            else
                ty->fail++;
        }
    }
    be->ops->free(be, y_d);
    be->ops->free(be, id_d);
    be->ops->free(be, w_d);
    free(y);
    free(zero);
}

/* --- decode MoE (kernels/cuda/fast_moe.cu) for every configuration ------------------ */

/*
 * The expert sets of the decode MoE cases: [0] all 256 experts (moe), [1]
 * the odd ones held elsewhere (moe_parts, the ep group split), [2] every
 * expert cut to the first half of I (moe_parts, a rank's share under the
 * tp group split: w1 / w3 the first I/2 rows, w2 and the shared expert the
 * same bytes read as (D, I/2): other values, the same shapes and bytes as
 * a tp rank's), each with its shared expert.
 */
struct moe_sets {
    const struct dsv4_expert_w *table[3];
    const struct dsv4_expert_w *shared[3];
    size_t per_expert[3], shared_bytes[3];
};

static const char *const moe_set_name[3] = { "moe", "parts", "tp" };

/*
 * v5 against v3, bit for bit (fast_moe3.cu: the same sums in the same
 * order): moe, moe_parts (half the experts held) and the tp set at T = 1, 16 and 64
 * (passes of one and of two n-tiles, several rows per expert), and at T =
 * 64 routed to experts 0..11 only ("skew": about 32 rows per expert, so
 * several passes per tile, which v5 streams in one item with both parts)
 * under the setting `cfg` (a "v5" one) and under "v3"; the output is
 * filled with 0xff bytes before each run (a row one of them does not write
 * differs).  One line per case: the first differing float, its index and
 * both values.
 */
static void
moe_v5_bits(struct dsv4_backend *be, const char *cfg, const struct moe_sets *ms, const float *x,
            float *out, const int32_t *ids_d, const float *wts_d, struct tally *ty)
{
    static const int ts[] = { 1, 16, 64, 64 };   /* the last: skewed routing */
    size_t w = (size_t)(K_PICKS + 1) * D_MODEL, nb = T_MAX * w * sizeof(float);
    uint32_t *fill = malloc(nb), *r3 = malloc(nb), *r5 = malloc(nb);
    int32_t skew[T_MAX * K_PICKS], *skew_d;

    if (fill == NULL || r3 == NULL || r5 == NULL)
        exit(1);
    for (int t = 0; t < T_MAX; t++)   /* 6 distinct of experts 0..11 */
        for (int j = 0; j < K_PICKS; j++)
            skew[t * K_PICKS + j] = (t + 2 * j + (j >= 3 && t % 2)) % 12;
    skew_d = be->ops->alloc(be, sizeof(skew));
    if (skew_d == NULL)
        exit(1);
    TRY("upload", be->ops->upload(be, skew_d, skew, sizeof(skew)));
    memset(fill, 0xff, nb);
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
    for (int parts = 0; parts < 3; parts++)
        for (size_t i = 0; i < sizeof(ts) / sizeof(ts[0]); i++) {
            int sk = i == sizeof(ts) / sizeof(ts[0]) - 1;
            struct op o = { .name = "v5 bits", .kind = parts ? OP_PARTS : OP_MOE,
                            .experts = ms->table[parts], .shared = ms->shared[parts],
                            .ids = sk ? skew_d : ids_d, .weights = wts_d, .x = x };
            int T = ts[i];
            size_t n = (size_t)T * (parts ? w : D_MODEL), bad = n;

            o.outs[0] = out_f32("out", out, (int)(parts ? w : D_MODEL), BOUND_MOE, IDENT_MOE);
            o.n_outs = 1;
            for (int v = 0; v < 2; v++) {
                setenv("DSV4_CUDA_FAST_MOE", v ? cfg : "v3", 1);
                TRY("upload", be->ops->upload(be, out, fill, n * sizeof(float)));
                TRY("fast op", op_run(be, &o, T));
                TRY("download", be->ops->download(be, v ? r5 : r3, out, n * sizeof(float)));
            }
            for (size_t j = 0; j < n && bad == n; j++)
                if (r3[j] != r5[j])
                    bad = j;
            if (bad == n) {
                ty->ok++;
                printf("ok   moe v5 bits %-9s %-5s T=%-2d%s %zu floats == v3\n", cfg,
                       moe_set_name[parts], T, sk ? " skew" : "", n);
            } else {
                float f3, f5;

                memcpy(&f3, &r3[bad], 4);
                memcpy(&f5, &r5[bad], 4);
                ty->fail++;
                printf("FAIL moe v5 bits %-9s %-5s T=%-2d%s first difference at %zu (row %zu "
                       "col %zu): v3 %.9g (%08x) v5 %.9g (%08x)\n", cfg, moe_set_name[parts],
                       T, sk ? " skew" : "", bad, bad / D_MODEL, bad % D_MODEL, f3, r3[bad], f5,
                       r5[bad]);
            }
        }
    setenv("DSV4_CUDA_FAST_MOE", cfg, 1);
    be->ops->free(be, skew_d);
    free(fill);
    free(r3);
    free(r5);
}

static const int moe_t[] = { 1, 2, 4, 8, 16, 32, 64 };
#define N_MOE_T ((int)(sizeof(moe_t) / sizeof(moe_t[0])))

/* DSV4_CUDA_FAST_MOE settings swept by default (BENCH_MOE_CFGS overrides:
 * space-separated); the first is fast_moe.cu's default (FM2_DEFAULT). */
static const char moe_cfgs_default[] =
    "4,2,4,0 4,4,4,0 4,1,4,0 8,2,4,0 8,4,4,0 4,2,2,0 v1 v3 v5";

/*
 * moe (all 256 experts held), moe_parts (the odd experts held elsewhere)
 * and moe_parts on the tp set (struct moe_sets) at every T of moe_t, for
 * every setting of DSV4_CUDA_FAST_MOE in the sweep: the checks of run_case
 * against the exact op, then GB/s of the distinct experts' bytes the call
 * needs (moe_parts: the held ones) plus the shared expert, as a share of
 * 4.3 TB/s.  One table line per setting at the
 * end ("moe cfg").  moe_parts' T-independence is not checked (its rows move
 * with T: the shared rows follow the T*k pick rows).  Only the first
 * setting counts in the summary's mean.
 */
static void
moe_decode_all(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct moe_sets *ms,
               const float *x, float *out, const int32_t *ids_d, const float *wts_d,
               const int32_t *ids, struct tally *ty)
{
    const char *env = getenv("BENCH_MOE_CFGS");
    char list[512], *save = NULL, *cfg;
    char table[64][240];
    int n_cfg = 0;
    struct sc_expert sc[2];
    float(*sc_ref_rows)[D_MODEL] = malloc(4 * sizeof(*sc_ref_rows));
    float(*sc_hs)[I_EXPERT / 128] = malloc(4 * sizeof(*sc_hs));
    float *xh1 = malloc(D_MODEL * sizeof(float));

    /* the self-check's experts and reference rows (token 0 of x) */
    if (sc_ref_rows == NULL || sc_hs == NULL || xh1 == NULL)
        exit(1);
    {
        uint64_t keep = rng_state;   /* the later cases' data as without the self-check */

        sc_make(be, &sc[0], 0);
        sc_make(be, &sc[1], 1);
        rng_state = keep;
    }
    TRY("download", be->ops->download(be, xh1, x, D_MODEL * sizeof(float)));
    for (int k = 0; k < 4; k++)
        sc_ref(sc_ref_rows[k], sc_hs[k], &sc[k & 1], k & 1, k < 2, xh1, k & 1 ? 0.0f : 0.75f);
    snprintf(list, sizeof(list), "%s", env != NULL ? env : moe_cfgs_default);
    printf("decode moe (fast_moe.cu): settings of DSV4_CUDA_FAST_MOE \"W,KS,PF,CPS\" "
           "(warps per block, K slices per item, FP4 blocks in flight, blocks per SM cap), "
           "v1, or v3 / \"v3,NS,RT\" (fast_moe3.cu: ring stages per warp, row tiles per "
           "block), or v5 (fast_moe3.cu: persistent warps, a tile of 16 rows of A over all of K "
           "each); GB/s of the "
           "distinct experts' bytes + shared expert\n");
    for (cfg = strtok_r(list, " ", &save); cfg != NULL && n_cfg < 64;
         cfg = strtok_r(NULL, " ", &save), n_cfg++) {
        size_t len;

        setenv("DSV4_CUDA_FAST_MOE", cfg, 1);
        printf("moe setting %s\n", cfg);
        moe_selfcheck(be, cfg, sc, x, sc_ref_rows, sc_hs, ty);
        if (strncmp(cfg, "v5", 2) == 0)
            moe_v5_bits(be, cfg, ms, x, out, ids_d, wts_d, ty);
        len = (size_t)snprintf(table[n_cfg], sizeof(table[n_cfg]), "moe cfg %-9s", cfg);
        for (int parts = 0; parts < 3; parts++) {
            struct op o = { .name = moe_set_name[parts], .kind = parts ? OP_PARTS : OP_MOE,
                            .bw = n_cfg == 0 && parts < 2, .experts = ms->table[parts],
                            .shared = ms->shared[parts], .ids = ids_d, .weights = wts_d,
                            .x = x };
            struct hist h;

            memset(&h, 0, sizeof(h));
            o.outs[0] = out_f32("out", out, parts ? (K_PICKS + 1) * D_MODEL : D_MODEL,
                                BOUND_MOE, IDENT_MOE);
            o.n_outs = 1;
            if (len < sizeof(table[n_cfg]))
                len += (size_t)snprintf(table[n_cfg] + len, sizeof(table[n_cfg]) - len,
                                        "%s%s", parts ? " | " : " ", moe_set_name[parts]);
            for (int i = 0; i < N_MOE_T; i++) {
                int T = moe_t[i];
                size_t pe = ms->per_expert[parts], sb = ms->shared_bytes[parts];
                size_t bytes = parts == 1 ? moe_bytes_even(ids, T, pe, sb)
                                          : moe_bytes(ids, T, pe, sb);
                double r;

                if (parts) {   /* no T-independence check: rows move with T */
                    free(h.prev[0]);
                    h.prev[0] = NULL;
                }
                r = run_case(be, tm, &o, T, bytes, &h, ty);
                if (len < sizeof(table[n_cfg]))
                    len += (size_t)snprintf(table[n_cfg] + len, sizeof(table[n_cfg]) - len,
                                            " %d:%.2f", T, r);
            }
            for (int i = 0; i < MAX_OUTS; i++)
                free(h.prev[i]);
        }
    }
    unsetenv("DSV4_CUDA_FAST_MOE");
    sc_free(be, &sc[0]);
    sc_free(be, &sc[1]);
    free(sc_ref_rows);
    free(sc_hs);
    free(xh1);
    printf("decode moe, share of 4.3 TB/s per setting (T:share; moe, then moe_parts with "
           "half the experts held, then moe_parts on a tp rank's share of every expert):\n");
    for (int i = 0; i < n_cfg; i++)
        printf("%s\n", table[i]);
}

/* --- decode linears: one launch against three (kernels/cuda/fast_linear.cu) ------------ */

/*
 * The decode linears (REF numerics): the model's FP8 linears at TP = 1 and
 * the rank's share at TP = 2, wo_a (linear_grouped, 8 and 4 groups), the
 * BF16 head, router gate and compressor (fp32 out).  The gate (16 row
 * tiles, split-K over 4 blocks), wq_a, wkv, wo_b and wo_a/2 take the split-K
 * reduction, the others not.  "bw": counted in the bandwidth summary (the
 * shapes the summary had before).
 */
static const struct {
    const char *name;
    int fp8, N, K, G, bw;   /* G > 0: linear_grouped with G groups of N / G rows */
} lin_shapes[] = {
    { "wq_a", 1, 1024, 4096, 0, 1 },
    { "wq_b", 1, 32768, 1024, 0, 1 },     /* 64 heads x 512 */
    { "wq_b/2", 1, 16384, 1024, 0, 0 },   /* TP = 2: 32 heads per rank */
    { "wkv", 1, 512, 4096, 0, 1 },
    { "wo_b", 1, 4096, 8192, 0, 1 },
    { "wo_b/2", 1, 2048, 8192, 0, 0 },    /* TP = 2: half the output rows */
    { "idx_wq_b", 1, 8192, 1024, 0, 0 },  /* indexer, 64 heads x 128 */
    { "proj", 1, 4096, 4096, 0, 0 },      /* MTP e_proj / h_proj */
    { "wo_a", 1, O_GROUPS * O_RANK, D_MODEL, O_GROUPS, 1 },
    { "wo_a/2", 1, O_GROUPS / 2 * O_RANK, D_MODEL, O_GROUPS / 2, 0 },
    { "head", 0, 129280, 4096, 0, 1 },
    { "gate", 0, E_EXPERTS, D_MODEL, 0, 0 },
    { "cwkv", 0, 1024, D_MODEL, 0, 0 },   /* compressor at ratio 4: c * d = 2 * 512 */
};
#define N_LIN ((int)(sizeof(lin_shapes) / sizeof(lin_shapes[0])))

/* Output 0 of o at T, downloaded (malloc'd). */
static float *
lin_get(struct dsv4_backend *be, const struct op *o, int T)
{
    size_t n = (size_t)T * o->outs[0].w;
    float *h = malloc(n * sizeof(float));

    if (h == NULL)
        exit(1);
    TRY("download", be->ops->download(be, h, o->outs[0].dev, n * sizeof(float)));
    return h;
}

/* Index of the first value whose bits differ between a and b, or n. */
static size_t
lin_first_diff(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0)
            return i;
    return n;
}

/* Print a first difference (i < n) of what vs the one-launch output. */
static void
lin_print_diff(const char *what, const float *a, const float *fused, size_t i, size_t n, int N)
{
    uint32_t ab, fb;

    if (i >= n)
        return;
    memcpy(&ab, &a[i], 4);
    memcpy(&fb, &fused[i], 4);
    printf("     %s differs first at index %zu (token %zu, column %zu): %.9g (%08x), one "
           "launch %.9g (%08x)\n", what, i, i / N, i % N, a[i], ab, fused[i], fb);
}

/* A form of the decode linear against the one-launch output `fused` at T:
 * the plain call, then timed graphs; sets its ms per call, kernels per call
 * in the graph, the first index whose bits differ from fused (plain call)
 * and from the plain call (the graph's last replay), n if none; returns the
 * plain output (malloc'd). */
struct lin_form {
    float ms, kern;
    size_t diff, rep;
};

static float *
lin_form_run(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct op *o, int T,
             const float *fused, struct lin_form *f)
{
    size_t n = (size_t)T * o->outs[0].w;
    float *plain, *rep;

    TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
    TRY("op", op_run(be, o, T));
    plain = lin_get(be, o, T);
    f->diff = lin_first_diff(plain, fused, n);
    f->ms = time_fast(be, tm, o, T);
    f->kern = (float)dsv4_cuda_graph_kernels(be, NULL) / GRAPH_REPS;
    rep = lin_get(be, o, T);
    f->rep = lin_first_diff(rep, plain, n);
    if (f->rep < n)
        lin_print_diff("graph replay vs its plain call", rep, plain, f->rep, n,
                       o->outs[0].w);
    free(rep);
    return plain;
}

/*
 * One linear case at T: run_case with the one-launch form (bounds against
 * the exact op, same bits twice, rows independent of T, us per call from
 * graphs), its timed graph's last replay == the plain call and kernels per
 * call == the passes of 16 tokens; then the three-launch form
 * (dsv4_cuda_set_linear(be, 0)) and the two-launch form (and
 * dsv4_cuda_set_linear_reduce(be, 1)), each bit for bit equal to the
 * one-launch output, its graph replay equal to its plain call, at most as
 * many kernels as the three-launch form (two launches: as many, less one
 * per call for split-K shapes), and its us per call.  The backend's
 * settings are restored.  Appends " T:three/two/one us" to row.
 */
static void
lin_case(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct op *o, int T,
         size_t bytes, struct hist *h, struct tally *ty, char *row, size_t rowlen)
{
    int N = o->outs[0].w, passes = (T + 15) / 16, ok;
    int was_t = dsv4_cuda_set_linear(be, 16), was_r = dsv4_cuda_set_linear_reduce(be, 0);
    size_t n = (size_t)T * N, dr, len = strlen(row);
    struct lin_form f3, f2;
    double share, us1;
    float kf, *fused, *rep, *v3, *v2;

    share = run_case(be, tm, o, T, bytes, h, ty);
    us1 = share > 0 ? bytes / (share * PEAK_GBS * 1e6) * 1e3 : 0.0;
    kf = (float)dsv4_cuda_graph_kernels(be, NULL) / GRAPH_REPS;   /* run_case's graph */
    rep = lin_get(be, o, T);                                       /* its last replay */
    fused = h->prev[0];                        /* run_case's plain call at this T */
    dr = lin_first_diff(rep, fused, n);
    lin_print_diff("one-launch graph replay", rep, fused, dr, n, N);

    dsv4_cuda_set_linear(be, 0);
    v3 = lin_form_run(be, tm, o, T, fused, &f3);
    dsv4_cuda_set_linear_reduce(be, 1);
    v2 = lin_form_run(be, tm, o, T, fused, &f2);
    dsv4_cuda_set_linear(be, was_t);
    dsv4_cuda_set_linear_reduce(be, was_r);

    ok = dr == n && f3.diff == n && f3.rep == n && f2.diff == n && f2.rep == n &&
         kf == passes && f3.kern > kf && f2.kern <= f3.kern;
    printf("%-4s lin %-8s T=%-3d ==one: three %s two %s  replay: one %s three %s two %s  "
           "launches/call three %.1f two %.1f one %.1f (%d passes)  us three %8.1f two "
           "%8.1f one %8.1f\n",
           ok ? "ok" : "FAIL", o->name, T, f3.diff == n ? "yes" : "NO",
           f2.diff == n ? "yes" : "NO", dr == n ? "yes" : "NO", f3.rep == n ? "yes" : "NO",
           f2.rep == n ? "yes" : "NO", f3.kern, f2.kern, kf, passes, f3.ms * 1e3, f2.ms * 1e3,
           us1);
    lin_print_diff("three-launch output", v3, fused, f3.diff, n, N);
    lin_print_diff("two-launch output", v2, fused, f2.diff, n, N);
    fflush(stdout);
    if (ok)
        ty->ok++;
    else
        ty->fail++;
    if (len < rowlen)
        snprintf(row + len, rowlen - len, "  %d:%.1f/%.1f/%.1f", T, f3.ms * 1e3, f2.ms * 1e3,
                 us1);
    free(rep);
    free(v3);
    free(v2);
}

/* --- linear_multi against separate linears (kernels/cuda/fast_linear.cu) ------------- */

/*
 * The projections of one input the forward gives linear_multi (a ratio-4
 * layer's xn: wq_a, wkv FP8; the indexer's compressor wkv / wgate (fp32
 * out), its weights_proj BF16; the compressor's wkv / wgate BF16 fp32 out;
 * then qr's wq_b/2 and idx_wq_b FP8) at T = 1, 5, 16 and at the prefill
 * sizes T = 300, 2,048 (the cuBLASLt linears with x split / quantized once
 * for all of them: cuda_fast_gemm_multi; its own input rows): every output
 * of the one call bit for bit equal to the separate linear calls' (each
 * call's output filled with 0xff bytes first, so an output the call does
 * not write differs).  One line per case.
 */
static void
lin_multi_bits(struct dsv4_backend *be, const float *xd, struct tally *ty)
{
    static const struct { int fp8, N, K; unsigned fl; } sh[] = {
        { 1, 1024, 4096, 0 }, { 1, 512, 4096, 0 }, { 0, 256, 4096, DSV4_LIN_F32_OUT },
        { 0, 256, 4096, DSV4_LIN_F32_OUT }, { 0, 64, 4096, 0 },
        { 0, 1024, 4096, DSV4_LIN_F32_OUT }, { 0, 1024, 4096, DSV4_LIN_F32_OUT },
        { 1, 16384, 1024, 0 }, { 1, 8192, 1024, 0 },
    };
    static const int groups[2][2] = { { 0, 7 }, { 7, 9 } };   /* [first, end) of sh */
    static const int ts[] = { 1, 5, 16, 300, 2048 };
    enum { NS = sizeof(sh) / sizeof(sh[0]), TP = 2048 };
    struct dsv4_linear W[NS];
    float *o1[NS], *o2[NS];
    float *xp = dev_normals(be, (size_t)TP * 4096, 1.0f, 1);   /* prefill rows */
    size_t maxn = 0;
    uint8_t *fill;
    float *h1, *h2;

    for (int i = 0; i < NS; i++) {
        size_t n = (size_t)TP * sh[i].N * sizeof(float);

        W[i] = sh[i].fp8 ? make_fp8(be, sh[i].N, sh[i].K) : make_bf16(be, sh[i].N, sh[i].K);
        o1[i] = dev_alloc(be, n);
        o2[i] = dev_alloc(be, n);
        maxn = n > maxn ? n : maxn;
    }
    fill = malloc(maxn);
    h1 = malloc(maxn);
    h2 = malloc(maxn);
    if (fill == NULL || h1 == NULL || h2 == NULL)
        exit(1);
    memset(fill, 0xff, maxn);
    TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
    for (int gi = 0; gi < 2; gi++)
        for (size_t ti = 0; ti < sizeof(ts) / sizeof(ts[0]); ti++) {
            int T = ts[ti], a = groups[gi][0], n = groups[gi][1] - a, bad = -1;
            const float *x = T > 16 ? xp : xd;
            const struct dsv4_linear *Wp[NS];
            unsigned fl[NS];
            size_t at = 0;

            for (int i = a; i < a + n; i++) {
                size_t bytes = (size_t)T * sh[i].N * sizeof(float);

                Wp[i - a] = &W[i];
                fl[i - a] = sh[i].fl;
                TRY("upload", be->ops->upload(be, o1[i], fill, bytes));
                TRY("upload", be->ops->upload(be, o2[i], fill, bytes));
                TRY("linear", be->ops->linear(be, o1[i], x, &W[i], T, sh[i].fl));
            }
            TRY("linear_multi", be->ops->linear_multi(be, n, &o2[a], x, Wp, fl, T));
            for (int i = a; i < a + n && bad < 0; i++) {
                size_t cnt = (size_t)T * sh[i].N;

                TRY("download", be->ops->download(be, h1, o1[i], cnt * sizeof(float)));
                TRY("download", be->ops->download(be, h2, o2[i], cnt * sizeof(float)));
                at = lin_first_diff(h1, h2, cnt);
                if (at < cnt)
                    bad = i;
            }
            if (bad < 0) {
                ty->ok++;
                printf("ok   linear multi bits  %s T=%-4d %d linears == separate calls\n",
                       gi ? "qr" : "xn", T, n);
            } else {
                ty->fail++;
                printf("FAIL linear multi bits  %s T=%-4d linear %d (%d x %d) first difference at "
                       "%zu: %.9g vs %.9g\n", gi ? "qr" : "xn", T, bad - a, sh[bad].N,
                       sh[bad].K, at, h1[at], h2[at]);
            }
        }
    for (int i = 0; i < NS; i++) {
        be->ops->free(be, o1[i]);
        be->ops->free(be, o2[i]);   /* the weights stay until the backend goes */
    }
    be->ops->free(be, xp);
    free(fill);
    free(h1);
    free(h2);
}

/* One exhaustive check of the linear kernels' conversions (cuda_fast.h
 * dsv4_cuda_linear_*_check): ok with what it showed, else how many inputs
 * differ (`differ`) and the first, in hex. */
static void
lin_check_report(struct tally *ty, const char *name, const char *ok_what, const char *differ,
                 uint64_t bad, uint32_t first)
{
    if (bad == 0) {
        printf("ok   linear %s check: %s\n", name, ok_what);
        ty->ok++;
    } else {
        printf("FAIL linear %s check: %llu %s %08x\n", name, (unsigned long long)bad, differ,
               first);
        ty->fail++;
    }
}

/*
 * Every decode linear case (BENCH_FAST_ONLY=linear runs only these): first
 * the hardware FP8 code of the one-launch form against the exact expression
 * on all 2^32 floats (dsv4_cuda_linear_quant_check) and the grouped form's
 * weight decode on all pairs of E4M3 codes (dsv4_cuda_linear_e4m3_check),
 * then lin_case at every
 * T of t_list per shape, and a table of us per call (three launches / one).
 * x: (T_MAX, 8192) device scratch re-laid per K from xh; xg: (T_MAX, 8 *
 * 4096) activations of the grouped cases.
 */
static void
linear_all(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, float *x, const float *xh,
           float *xg, float *out, struct tally *ty)
{
    char table[N_LIN][256];
    uint64_t bad = 0;
    uint32_t first = 0;

    TRY("quant check", dsv4_cuda_linear_quant_check(be, &bad, &first));
    lin_check_report(ty, "quant", "one-launch FP8 codes == exact path's on all 2^32 floats",
                     "of 2^32 floats differ, first bits", bad, first);
    TRY("e4m3 check", dsv4_cuda_linear_e4m3_check(be, &bad, &first));
    lin_check_report(ty, "e4m3", "grouped weights' bf16 == exact decode on all 65,536 pairs "
                     "of codes (NaN codes aside)", "pairs of codes differ, first", bad, first);
    for (int l = 0; l < N_LIN; l++) {
        int N = lin_shapes[l].N, K = lin_shapes[l].K, G = lin_shapes[l].G;
        struct op o = { .name = lin_shapes[l].name, .kind = G > 0 ? OP_GROUPED : OP_LINEAR,
                        .bw = lin_shapes[l].bw, .x = G > 0 ? xg : x, .G = G };
        struct hist h;

        o.W = lin_shapes[l].fp8 ? make_fp8(be, N, K) : make_bf16(be, N, K);
        o.flags = lin_shapes[l].fp8 ? 0 : DSV4_LIN_F32_OUT;
        o.outs[0] = lin_shapes[l].fp8 ? out_f32("out", out, N, BOUND_BF16, IDENT_BF16)
                                      : out_f32("out", out, N, BOUND_F32, 0.0);
        o.n_outs = 1;
        /* rows of x are K apart: re-lay the first T_MAX rows for this K */
        for (int t = 0; t < T_MAX && G == 0; t++)
            TRY("upload", be->ops->upload(be, x + (size_t)t * K, xh + (size_t)t * 8192,
                                          (size_t)K * sizeof(float)));
        snprintf(table[l], sizeof(table[l]), "linear %-8s %6d x %-5d%s us three/two/one:",
                 o.name, N, K, G > 0 ? " grouped" : "");
        memset(&h, 0, sizeof(h));
        for (int i = 0; i < N_T; i++) {
            int T = t_list[i];
            size_t bytes = (size_t)(T + 15) / 16 * lin_bytes(&o.W) +
                           (G > 0 ? (size_t)T * G * K * 4 : 0);

            lin_case(be, tm, &o, T, bytes, &h, ty, table[l], sizeof(table[l]));
        }
        for (int i = 0; i < MAX_OUTS; i++)
            free(h.prev[i]);
        be->ops->free(be, (void *)(uintptr_t)o.W.w);   /* ours: allocated above */
        be->ops->free(be, (void *)(uintptr_t)o.W.scale);
    }
    printf("decode linears, us per call at T (three launches / two / one):\n");
    for (int l = 0; l < N_LIN; l++)
        printf("%s\n", table[l]);
}

/* --- prefill: the tensor-core GEMMs (kernels/cuda/fast_gemm.cu) ------------------- */

/*
 * Prefill cases (many token rows): the fast op on all T rows, the exact op
 * on P_SAMPLE of them (spread over T, first and last included: the exact
 * kernels take each row on its own, so a row's exact value does not depend
 * on the others, and the exact op at T = 8192 would take minutes).  Checked:
 * the bounds of the decode cases on the sampled rows, the same bits on a
 * second run, and (reported, not failed: the op takes another path at small
 * T, see cuda_fast.h) whether the first P_TIND rows equal those of the
 * previous T.  Timed as the decode cases (graph of GRAPH_REPS calls);
 * TFLOP/s counts 2 * rows * N * K of the products the op must do, GB/s the
 * weights read once plus the fp32 activations in and out.
 */
#define P_SAMPLE 48          /* rows (tokens) checked against the exact op */
#define P_TIND 32            /* first rows compared across T */
#define P_TMAX 8192          /* linear rows */
#define P_TMOE 2048          /* moe tokens */

#define PEAK_TFS 990.0        /* H200 dense bf16/fp16 tensor TFLOP/s: the floors */

static const int pt_lin[] = { 32, 128, 512, 2048, 8192 };
static const int pt_moe[] = { 64, 256, 512, 1024, 2048 };
/* paths: dsv4_cuda_set_wgmma(i) */
static const char *const pf_path[2] = { "mma", "wgmma" };
static const int pf_paths_default[2] = { 1, 0 };

/* n = min(T, P_SAMPLE) distinct rows spread over 0 .. T-1 (first and last). */
static int
sample_rows(int T, int *rows)
{
    int n = T < P_SAMPLE ? T : P_SAMPLE;

    for (int i = 0; i < n; i++)
        rows[i] = n > 1 ? (int)((int64_t)i * (T - 1) / (n - 1)) : 0;
    return n;
}

/* Row rows[i] (w floats) of dev for i < n into host (n, w). */
static void
download_rows(struct dsv4_backend *be, float *host, const float *dev, const int *rows, int n,
              size_t w)
{
    for (int i = 0; i < n; i++)
        TRY("download", be->ops->download(be, host + (size_t)i * w, dev + (size_t)rows[i] * w,
                                          w * sizeof(float)));
}

/* What one prefill case compares: the fast op's rows (n, w) against the
 * exact op's (rows[i] the token of row i), and two fast runs. */
struct pf_check {
    const char *name;
    int T, path;           /* path: index of pf_path */
    double bound, ident;
    float exact_ms;
    double flops, bytes;   /* per call */
    const int *rows;
    size_t w;
};

static void
pf_report(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const struct op *o,
          const struct pf_check *c, const float *fast, const float *again, const float *ref,
          size_t n, const char *tind, struct tally *ty)
{
    struct diff d = { 0, 0, 0, 0 };
    double rel, tfs, gbs, floor_ms;
    int det = memcmp(fast, again, n * sizeof(float)) == 0, ok;
    float ms;

    diff_add(&d, fast, ref, n);
    rel = d.maxr > 0 ? d.maxd / d.maxr : d.maxd;
    ok = det && d.maxr > 0 && rel <= c->bound && (double)d.ident / d.n >= c->ident;
    if (!ok) {   /* the first value out of bounds and the largest difference (NaN first) */
        size_t first = n, worst = 0;
        double we = -1.0;

        for (size_t i = 0; i < n; i++) {
            double e = fabs((double)fast[i] - ref[i]);

            if (first == n && !(e <= c->bound * d.maxr))
                first = i;
            if (isnan(e) ? !isnan(we) : e > we) {
                worst = i;
                we = e;
            }
        }
        if (first < n)
            printf("     %s %s T=%d: first value out of bounds: token %d column %zu: "
                   "fast %.8g exact %.8g\n", c->name, pf_path[c->path], c->T,
                   c->rows[first / c->w], first % c->w, fast[first], ref[first]);
        printf("     %s %s T=%d: largest difference: token %d column %zu: fast %.8g exact "
               "%.8g (max |exact| %.6g); %zu of %zu identical; deterministic %s\n", c->name,
               pf_path[c->path], c->T, c->rows[worst / c->w], worst % c->w, fast[worst],
               ref[worst], d.maxr, d.ident, d.n, det ? "yes" : "NO");
    }
    ms = time_fast(be, tm, o, c->T);
    tfs = c->flops / (ms * 1e-3) / 1e12;
    gbs = c->bytes / (ms * 1e-3) / 1e9;
    floor_ms = fmax(c->flops / (PEAK_TFS * 1e12), c->bytes / (PEAK_GBS * 1e9)) * 1e3;
    printf("%-4s %-9s %-5s T=%-5d out maxrel %.2e (%.1e) ident %5.1f%% (%2.0f%%)  det %s  "
           "T-indep %-9s exact(%d rows) %7.3f ms  fast %9.1f us  %6.1f TFLOP/s  %6.0f GB/s  "
           "floor %8.1f us  ratio %.2f\n",
           ok ? "ok" : "FAIL", c->name, pf_path[c->path], c->T, rel, c->bound,
           d.n ? 100.0 * d.ident / d.n : 0.0, 100 * c->ident, det ? "yes" : "NO", tind,
           c->T < P_SAMPLE ? c->T : P_SAMPLE, c->exact_ms, ms * 1e3, tfs, gbs, floor_ms * 1e3,
           floor_ms / ms);
    fflush(stdout);
    if (ok)
        ty->ok++;
    else
        ty->fail++;
}

/* The linear W (flags; output bounds bound, ident) at every T of pt_lin on
 * x (P_TMAX, K) (host copy xh), on both paths (pf_path). */
static void
pf_linear(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const char *name,
          const struct dsv4_linear *W, unsigned flags, double bound, double ident, float *x,
          const float *xh, float *out, float *xs, float *outs, struct tally *ty)
{
    int N = W->n_out, K = W->n_in, rows[P_SAMPLE], prev_T = 0;
    size_t nw = (size_t)P_SAMPLE * N, nf = (size_t)P_TIND * N;
    float *fast = malloc(nw * 4), *again = malloc(nw * 4), *ref = malloc(nw * 4);
    float *first = malloc(nf * 4), *pfirst = malloc(2 * nf * 4);
    struct op o = { .name = name, .kind = OP_LINEAR, .x = x, .W = *W, .flags = flags };

    if (fast == NULL || again == NULL || ref == NULL || first == NULL || pfirst == NULL)
        exit(1);
    o.outs[0] = out_f32("out", out, N, bound, ident);
    o.n_outs = 1;
    for (size_t i = 0; i < sizeof(pt_lin) / sizeof(pt_lin[0]); i++) {
        int T = pt_lin[i], n = sample_rows(T, rows);
        struct pf_check c = { name, T, 0, bound, ident, 0, 2.0 * T * N * K,
                              (double)lin_bytes(W) + 4.0 * T * (N + K), rows, (size_t)N };

        /* exact: the sampled rows gathered into xs */
        for (int j = 0; j < n; j++)
            TRY("upload", be->ops->upload(be, xs + (size_t)j * K, xh + (size_t)rows[j] * K,
                                          (size_t)K * 4));
        TRY("set_kernels", dsv4_cuda_set_kernels(be, 0));
        TRY("sync", be->ops->sync(be));
        TRY("timer", dsv4_cuda_timer_start(tm));
        TRY("exact linear", be->ops->linear(be, outs, xs, W, n, flags));
        TRY("timer", dsv4_cuda_timer_stop(tm, &c.exact_ms));
        TRY("download", be->ops->download(be, ref, outs, (size_t)n * N * 4));
        TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
        for (int path = 1; path >= 0; path--) {
            const char *tind = "-";

            dsv4_cuda_set_wgmma(path);
            c.path = path;
            TRY("fast linear", be->ops->linear(be, out, x, W, T, flags));
            download_rows(be, fast, out, rows, n, N);
            TRY("download", be->ops->download(be, first, out, nf * 4));
            TRY("fast linear", be->ops->linear(be, out, x, W, T, flags));
            download_rows(be, again, out, rows, n, N);
            if (prev_T > 0)
                tind = memcmp(first, pfirst + path * nf, nf * 4) == 0 ? "yes" : "no (path)";
            memcpy(pfirst + path * nf, first, nf * 4);
            pf_report(be, tm, &o, &c, fast, again, ref, (size_t)n * N, tind, ty);
        }
        dsv4_cuda_set_wgmma(-1);
        prev_T = T;
    }
    free(fast);
    free(again);
    free(ref);
    free(first);
    free(pfirst);
}

/* The sampled tokens' rows of a moe / moe_parts output y (T tokens; parts:
 * the k pick rows and the shared row of each) into dst (n, w). */
static void
pf_moe_rows(struct dsv4_backend *be, float *dst, const float *y, const int *rows, int n, int T,
            int parts, int w)
{
    size_t Tk = (size_t)T * K_PICKS;

    for (int j = 0; j < n; j++) {
        const float *src = parts ? y + (size_t)rows[j] * K_PICKS * D_MODEL
                                 : y + (size_t)rows[j] * D_MODEL;

        TRY("download", be->ops->download(be, dst + (size_t)j * w, src,
                                          (size_t)(parts ? K_PICKS : 1) * D_MODEL * 4));
        if (parts)
            TRY("download", be->ops->download(be, dst + (size_t)j * w +
                                                      (size_t)K_PICKS * D_MODEL,
                                              y + (Tk + rows[j]) * D_MODEL,
                                              (size_t)D_MODEL * 4));
    }
}

/* The timed graph's last replay (in y) against the plain call's rows
 * (fast): the same bits, or a failure with the first difference. */
static void
pf_moe_replay(struct dsv4_backend *be, const struct pf_check *c, const float *y, int parts,
              int w, const float *fast, float *buf, struct tally *ty)
{
    int n = c->T < P_SAMPLE ? c->T : P_SAMPLE;
    size_t nv = (size_t)n * w, i;

    pf_moe_rows(be, buf, y, c->rows, n, c->T, parts, w);
    for (i = 0; i < nv && memcmp(buf + i, fast + i, 4) == 0; i++)
        ;
    if (i == nv) {
        printf("ok   %-9s %-5s T=%-5d graph replay: same bits as the plain call\n", c->name,
               pf_path[c->path], c->T);
        ty->ok++;
    } else {
        printf("FAIL %-9s %-5s T=%-5d graph replay differs from the plain call: token %d "
               "column %zu: replay %.8g plain %.8g\n", c->name, pf_path[c->path], c->T,
               c->rows[i / w], i % w, buf[i], fast[i]);
        ty->fail++;
    }
}

/* Reported only: this path's rows (b) against the first path's (a, name an). */
static void
pf_moe_vs(const struct pf_check *c, const char *an, const float *a, const float *b, size_t n)
{
    struct diff d = { 0, 0, 0, 0 };

    diff_add(&d, b, a, n);
    printf("     %-9s %-5s T=%-5d vs %s: maxrel %.2e, %5.1f%% identical\n", c->name,
           pf_path[c->path], c->T, an, d.maxr > 0 ? d.maxd / d.maxr : d.maxd,
           d.n ? 100.0 * d.ident / d.n : 0.0);
}

/*
 * moe (parts == 0) or moe_parts (parts: experts of odd id not held, as a
 * rank of an expert-parallel pair of ranks sees them) at every T of tl (nt
 * of them, at most P_TMOE) on the paths pp (np of them, indices of
 * pf_path): x (P_TMOE, D) with host copy xh, routing ids/wts (P_TMOE, k).
 * With np > 1 each path after the first is also compared with the first
 * ("vs <path>": maxrel, identical share; reported), the first P_TIND rows
 * with those of the previous T on the same path (T-indep; reported: below
 * DSV4_CUDA_MOE_SPLIT tokens the decode MoE takes the call) and, on the
 * wgmma path, the timed graph's last replay with the plain call (fails when
 * not the same bits: the Hopper path's rows depend on their own token only,
 * whatever the order its persistent tiles run in).
 */
static void
pf_moe(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, int parts,
       const struct dsv4_expert_w *experts, const struct dsv4_expert_w *shared, float *x,
       const float *xh, const int32_t *ids_d, const float *wts_d, const int32_t *ids,
       const float *wts, size_t per_expert, size_t shared_bytes, const int *tl, int nt,
       const int *pp, int np, struct tally *ty)
{
    int rows[P_SAMPLE], trows[P_TIND], w = parts ? (K_PICKS + 1) * D_MODEL : D_MODEL;
    size_t nw = (size_t)P_SAMPLE * w, ny = ((size_t)P_TMOE * K_PICKS + P_TMOE) * D_MODEL;
    float *fast = malloc(nw * 4), *again = malloc(nw * 4), *ref = malloc(nw * 4);
    float *xsh = malloc((size_t)P_SAMPLE * D_MODEL * 4);
    int32_t *sid = malloc((size_t)P_SAMPLE * K_PICKS * 4);
    float *swt = malloc((size_t)P_SAMPLE * K_PICKS * 4);
    float *first = malloc(nw * 4), *pfirst = malloc(2 * nw * 4), *f0 = malloc(nw * 4);
    float *y = dev_alloc(be, ny * 4), *ys = dev_alloc(be, nw * 4);
    float *xs = dev_alloc(be, (size_t)P_SAMPLE * D_MODEL * 4);
    int32_t *sid_d = dev_alloc(be, (size_t)P_SAMPLE * K_PICKS * 4);
    float *swt_d = dev_alloc(be, (size_t)P_SAMPLE * K_PICKS * 4);
    struct op o = { .name = parts ? "pf_parts" : "pf_moe", .kind = parts ? OP_PARTS : OP_MOE,
                    .experts = experts, .shared = shared, .ids = ids_d, .weights = wts_d,
                    .x = x };

    if (fast == NULL || again == NULL || ref == NULL || xsh == NULL ||
        sid == NULL || swt == NULL || first == NULL || pfirst == NULL ||
        f0 == NULL)
        exit(1);
    o.outs[0] = out_f32("out", y, D_MODEL, BOUND_MOE, IDENT_MOE);
    o.n_outs = 1;
    for (int j = 0; j < P_TIND; j++)
        trows[j] = j;
    for (int i = 0; i < nt; i++) {
        int T = tl[i], n = sample_rows(T, rows), held = 0;
        size_t Tk = (size_t)T * K_PICKS;
        struct pf_check c = { o.name, T, 0, BOUND_MOE, IDENT_MOE, 0, 0, 0, rows, (size_t)w };

        for (size_t r = 0; r < Tk; r++)
            held += !parts || ids[r] % 2 == 0;
        c.flops = 6.0 * D_MODEL * I_EXPERT * (double)(held + T);
        c.bytes = (double)moe_bytes(ids, T, per_expert, 0) / (parts ? 2 : 1) + shared_bytes +
                  8.0 * T * D_MODEL;
        /* exact on the sampled tokens */
        for (int j = 0; j < n; j++) {
            memcpy(xsh + (size_t)j * D_MODEL, xh + (size_t)rows[j] * D_MODEL,
                   (size_t)D_MODEL * 4);
            memcpy(sid + (size_t)j * K_PICKS, ids + (size_t)rows[j] * K_PICKS, K_PICKS * 4);
            memcpy(swt + (size_t)j * K_PICKS, wts + (size_t)rows[j] * K_PICKS, K_PICKS * 4);
        }
        TRY("upload", be->ops->upload(be, xs, xsh, (size_t)n * D_MODEL * 4));
        TRY("upload", be->ops->upload(be, sid_d, sid, (size_t)n * K_PICKS * 4));
        TRY("upload", be->ops->upload(be, swt_d, swt, (size_t)n * K_PICKS * 4));
        TRY("set_kernels", dsv4_cuda_set_kernels(be, 0));
        TRY("sync", be->ops->sync(be));
        TRY("timer", dsv4_cuda_timer_start(tm));
        if (parts)
            TRY("exact moe_parts", be->ops->moe_parts(be, ys, xs, sid_d, swt_d, experts, shared,
                                                     n, K_PICKS, D_MODEL, 10.0f));
        else
            TRY("exact moe", be->ops->moe(be, ys, xs, sid_d, swt_d, experts, shared, n,
                                         K_PICKS, 10.0f));
        TRY("timer", dsv4_cuda_timer_stop(tm, &c.exact_ms));
        if (parts) {   /* rows s*k + j, then n*k + s: to the fast layout */
            for (int j = 0; j < n; j++) {
                TRY("download", be->ops->download(be, ref + (size_t)j * w,
                                                  ys + (size_t)j * K_PICKS * D_MODEL,
                                                  (size_t)K_PICKS * D_MODEL * 4));
                TRY("download", be->ops->download(
                                    be, ref + (size_t)j * w + (size_t)K_PICKS * D_MODEL,
                                    ys + ((size_t)n * K_PICKS + j) * D_MODEL,
                                    (size_t)D_MODEL * 4));
            }
        } else {
            TRY("download", be->ops->download(be, ref, ys, (size_t)n * D_MODEL * 4));
        }
        TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
        for (int pi = 0; pi < np; pi++) {
            int path = pp[pi];
            const char *tind = "-";

            dsv4_cuda_set_wgmma(path != 0);
            c.path = path;
            /* fast, twice (the sampled tokens' rows), and the first P_TIND tokens' rows */
            TRY("fast moe", op_run(be, &o, T));
            pf_moe_rows(be, fast, y, rows, n, T, parts, w);
            pf_moe_rows(be, first, y, trows, P_TIND, T, parts, w);
            TRY("fast moe", op_run(be, &o, T));
            pf_moe_rows(be, again, y, rows, n, T, parts, w);
            if (i > 0 && T >= P_TIND && tl[i - 1] >= P_TIND) {
                int same = memcmp(first, pfirst + pi * nw, (size_t)P_TIND * w * 4) == 0;

                tind = same ? "yes" : "no";
            }
            memcpy(pfirst + pi * nw, first, (size_t)P_TIND * w * 4);
            if (pi == 0)
                memcpy(f0, fast, (size_t)n * w * 4);
            pf_report(be, tm, &o, &c, fast, again, ref, (size_t)n * w, tind, ty);
            if (path == 1)   /* y now holds the timed graph's last replay */
                pf_moe_replay(be, &c, y, parts, w, fast, again, ty);
            if (pi > 0)
                pf_moe_vs(&c, pf_path[pp[0]], f0, fast, (size_t)n * w);
        }
        dsv4_cuda_set_wgmma(-1);
    }
    be->ops->free(be, y);
    be->ops->free(be, ys);
    be->ops->free(be, xs);
    be->ops->free(be, sid_d);
    be->ops->free(be, swt_d);
    free(fast);
    free(again);
    free(ref);
    free(xsh);
    free(sid);
    free(swt);
    free(first);
    free(pfirst);
    free(f0);
}

/* --- the FP8 x FP8 prefill linear (kernels/cuda/fast_gemm8.cu) ----------------------- */

static const int g8_t[] = { 128, 300, 512, 2048 };   /* 300: cuBLASLt's rows padded to 16 */
#define G8_NT ((int)(sizeof(g8_t) / sizeof(g8_t[0])))
#define G8_TMAX 2048

/* One linear call of the gemm8 cases. */
struct g8_call {
    int kernel;   /* 1: the FP8 x FP8 linear (called directly); 0: the linear op
                     with it switched off (fw_kernel where the cost model takes
                     the GEMM, else the decode kernels) */
    float *out;
    const float *x;
    const struct dsv4_linear *W;
};

static enum dsv4_err
g8_run(struct dsv4_backend *be, const void *ctx, int T)
{
    const struct g8_call *c = ctx;

    if (c->kernel)
        return cuda_fast_gemm8_linear(be, c->out, c->x, c->W, T);
    dsv4_cuda_set_gemm8(0);
    return be->ops->linear(be, c->out, c->x, c->W, T, 0);
}

/* |a - b| / max |b| over n values; *ident: the bit-identical ones.  The
 * first value over bound * max |b| (or NaN) in *first (n when none). */
static double
g8_rel(const float *a, const float *b, size_t n, double bound, size_t *ident, size_t *first)
{
    struct diff d = { 0, 0, 0, 0 };

    diff_add(&d, a, b, n);
    *ident = d.ident;
    *first = n;
    for (size_t i = 0; i < n && *first == n; i++)
        if (!(fabs((double)a[i] - b[i]) <= bound * d.maxr))
            *first = i;
    return d.maxr > 0 ? d.maxd / d.maxr : d.maxd;
}

/*
 * The FP8 linear W at T = 128, 300, 512, 2048 rows of x (G8_TMAX, K) (host copy
 * xh): the FP8 x FP8 kernel ("gemm8") and the op without it ("fw/op")
 * against the exact op on the sampled rows (BOUND_BF16, IDENT_BF16), run
 * twice (same bits), the first P_TIND rows at every T equal to T = 128's
 * (gemm8), the timed graph's last replay equal to the plain call (gemm8),
 * and the times of both.
 */
static void
g8_linear(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, const char *name,
          const struct dsv4_linear *W, float *x, const float *xh, float *out, float *xs,
          float *outs, struct tally *ty)
{
    int N = W->n_out, K = W->n_in, rows[P_SAMPLE];
    size_t nw = (size_t)P_SAMPLE * N, nf = (size_t)P_TIND * N;
    float *fast = malloc(nw * 4), *again = malloc(nw * 4), *ref = malloc(nw * 4);
    float *fw = malloc(nw * 4), *first = malloc(nf * 4), *first0 = malloc(nf * 4);
    struct g8_call c8 = { 1, out, x, W }, cw = { 0, out, x, W };

    if (fast == NULL || again == NULL || ref == NULL || fw == NULL || first == NULL ||
        first0 == NULL)
        exit(1);
    for (int i = 0; i < G8_NT; i++) {
        int T = g8_t[i], n = sample_rows(T, rows), det, tind, replay, ok;
        size_t m = (size_t)n * N, id8, idw, idx, f8, fwf, fx;
        double r8, rw, rx, flops = 2.0 * T * N * K;
        float ms8, msw;

        for (int j = 0; j < n; j++)
            TRY("upload", be->ops->upload(be, xs + (size_t)j * K, xh + (size_t)rows[j] * K,
                                          (size_t)K * 4));
        TRY("set_kernels", dsv4_cuda_set_kernels(be, 0));
        TRY("exact linear", be->ops->linear(be, outs, xs, W, n, 0));
        TRY("download", be->ops->download(be, ref, outs, m * 4));
        TRY("set_kernels", dsv4_cuda_set_kernels(be, 1));
        dsv4_cuda_set_wgmma(1);

        TRY("gemm8", g8_run(be, &c8, T));
        download_rows(be, fast, out, rows, n, N);
        TRY("download", be->ops->download(be, first, out, nf * 4));
        TRY("gemm8", g8_run(be, &c8, T));
        download_rows(be, again, out, rows, n, N);
        det = memcmp(fast, again, m * 4) == 0;
        if (i == 0)
            memcpy(first0, first, nf * 4);
        tind = memcmp(first0, first, nf * 4) == 0;
        ms8 = time_calls(be, tm, g8_run, &c8, T);
        download_rows(be, again, out, rows, n, N);
        replay = memcmp(fast, again, m * 4) == 0;

        TRY("fw linear", g8_run(be, &cw, T));
        download_rows(be, fw, out, rows, n, N);
        msw = time_calls(be, tm, g8_run, &cw, T);
        dsv4_cuda_set_gemm8(-1);
        dsv4_cuda_set_wgmma(-1);

        r8 = g8_rel(fast, ref, m, BOUND_BF16, &id8, &f8);
        rw = g8_rel(fw, ref, m, BOUND_BF16, &idw, &fwf);
        rx = g8_rel(fast, fw, m, BOUND_BF16, &idx, &fx);
        ok = det && tind && replay && r8 <= BOUND_BF16 && (double)id8 / m >= IDENT_BF16;
        if (f8 < m)
            printf("     %s gemm8 T=%d: first value out of bounds: token %d column %zu: "
                   "gemm8 %.8g exact %.8g fw/op %.8g\n", name, T, rows[f8 / N], f8 % N,
                   fast[f8], ref[f8], fw[f8]);
        printf("%-4s %-13s gemm8 T=%-5d vs exact maxrel %.2e (%.1e) ident %5.1f%% (%2.0f%%)  "
               "det %s  T-indep(T=%d) %s  replay %s  %9.1f us %7.1f TFLOP/s | fw/op maxrel "
               "%.2e ident %5.1f%% %9.1f us %7.1f TFLOP/s | gemm8 vs fw/op maxrel %.2e ident "
               "%5.1f%%  speedup %.2f\n",
               ok ? "ok" : "FAIL", name, T, r8, BOUND_BF16, 100.0 * id8 / m, 100 * IDENT_BF16,
               det ? "yes" : "NO", g8_t[0], tind ? "yes" : "NO", replay ? "yes" : "NO",
               ms8 * 1e3, flops / (ms8 * 1e-3) / 1e12, rw, 100.0 * idw / m, msw * 1e3,
               flops / (msw * 1e-3) / 1e12, rx, 100.0 * idx / m, msw / ms8);
        fflush(stdout);
        if (ok)
            ty->ok++;
        else
            ty->fail++;
    }
    free(fast);
    free(again);
    free(ref);
    free(fw);
    free(first);
    free(first0);
}

/* Every FP8 linear of the prefill at T = 128, 300, 512, 2048 (BENCH_FAST_ONLY=gemm8). */
static void
g8_all(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, struct tally *ty)
{
    static const struct {
        const char *name;
        int N, K;
    } lins[] = {
        { "wq_a", 1024, 4096 },
        { "wq_b", 32768, 1024 },
        { "wq_b/2", 16384, 1024 },   /* TP = 2 */
        { "wkv", 512, 4096 },
        { "wo_b", 4096, 8192 },
        { "wo_b/2", 4096, 4096 },    /* TP = 2 */
        { "idx_wq_b", 8192, 1024 },
    };
    size_t nx = (size_t)G8_TMAX * 8192;
    float *xh = host_normals(nx, 1.0f, 1), *x = dev_alloc(be, nx * 4);
    float *out = dev_alloc(be, (size_t)G8_TMAX * 32768 * 4);
    float *xs = dev_alloc(be, (size_t)P_SAMPLE * 8192 * 4);
    float *outs = dev_alloc(be, (size_t)P_SAMPLE * 32768 * 4);

    printf("gemm8 (fast_gemm8.cu, FP8 x FP8 wgmma) and fw/op (the linear op without it: "
           "fw_kernel where the cost model takes the GEMM) against the exact op on %d "
           "sampled rows; T-indep: first %d rows equal to T = %d's; replay: the timed "
           "graph's last replay equal to the plain call\n", P_SAMPLE, P_TIND, g8_t[0]);
    for (size_t l = 0; l < sizeof(lins) / sizeof(lins[0]); l++) {
        struct dsv4_linear W = make_fp8(be, lins[l].N, lins[l].K);

        /* x as (G8_TMAX, K): rows K apart */
        TRY("upload", be->ops->upload(be, x, xh, (size_t)G8_TMAX * lins[l].K * 4));
        /* both forms of the kernel: cuBLASLt ("lt:") and g8_kernel ("wg:") */
        for (int lt = 1; lt >= 0; lt--) {
            char name[32];

            snprintf(name, sizeof(name), "%s:%s", lt ? "lt" : "wg", lins[l].name);
            dsv4_cuda_set_blas(lt);
            g8_linear(be, tm, name, &W, x, xh, out, xs, outs, ty);
        }
        dsv4_cuda_set_blas(-1);
        be->ops->free(be, (void *)(uintptr_t)W.w);
        be->ops->free(be, (void *)(uintptr_t)W.scale);
    }
    be->ops->free(be, x);
    be->ops->free(be, out);
    be->ops->free(be, xs);
    be->ops->free(be, outs);
    free(xh);
}

/* Every prefill case: the FP8 linears of the flash layers at P_TMAX rows,
 * then moe and moe_parts (half the experts held) on P_TMOE tokens. */
/*
 * moe and moe_parts (the odd experts held elsewhere) through pf_moe at the
 * T of tl on the paths pp: x (P_TMOE, D) with host copy xh; routing as the
 * decode cases.
 */
static void
pf_moe_both(struct dsv4_backend *be, struct dsv4_cuda_timer *tm,
            const struct dsv4_expert_w *experts, const struct dsv4_expert_w *shared, float *x,
            const float *xh, size_t per_expert, size_t shared_bytes, const int *tl, int nt,
            const int *pp, int np, struct tally *ty)
{
    int32_t *ids = malloc((size_t)P_TMOE * K_PICKS * 4);
    float *wts = malloc((size_t)P_TMOE * K_PICKS * 4);
    struct dsv4_expert_w *half = malloc(E_EXPERTS * sizeof(*half));
    int32_t *ids_d;
    float *wts_d;

    if (ids == NULL || wts == NULL || half == NULL)
        exit(1);
    make_routing(ids, wts, P_TMOE);
    memcpy(half, experts, E_EXPERTS * sizeof(*half));
    for (int e = 1; e < E_EXPERTS; e += 2)
        memset(&half[e], 0, sizeof(half[e]));
    TRY("register experts", dsv4_cuda_experts_register(be, half, E_EXPERTS));
    ids_d = dev_upload(be, ids, (size_t)P_TMOE * K_PICKS * 4);
    wts_d = dev_upload(be, wts, (size_t)P_TMOE * K_PICKS * 4);
    pf_moe(be, tm, 0, experts, shared, x, xh, ids_d, wts_d, ids, wts, per_expert,
           shared_bytes, tl, nt, pp, np, ty);
    pf_moe(be, tm, 1, half, shared, x, xh, ids_d, wts_d, ids, wts, per_expert, shared_bytes,
           tl, nt, pp, np, ty);
    be->ops->free(be, ids_d);
    be->ops->free(be, wts_d);
    dsv4_cuda_experts_release(be, half);
    free(half);
    free(ids);
    free(wts);
}

/* Add delta to every E8M0 group scale of the FP4 experts' w1, w3 and w2
 * (device copies, through the host). */
static void
shift_fp4_scales(struct dsv4_backend *be, const struct dsv4_expert_w *experts, int delta)
{
    for (int e = 0; e < E_EXPERTS; e++) {
        const struct dsv4_linear *L[3] = { &experts[e].w1, &experts[e].w3, &experts[e].w2 };

        for (int m = 0; m < 3; m++) {
            size_t n = (size_t)L[m]->n_out * (L[m]->n_in / 32);
            uint8_t *h = malloc(n);
            void *d = (void *)(uintptr_t)L[m]->scale;

            if (h == NULL)
                exit(1);
            TRY("download scales", be->ops->download(be, h, d, n));
            for (size_t i = 0; i < n; i++)
                h[i] = (uint8_t)(h[i] + delta);
            TRY("upload scales", be->ops->upload(be, d, h, n));
            free(h);
        }
    }
}

static void
prefill_all(struct dsv4_backend *be, struct dsv4_cuda_timer *tm,
            const struct dsv4_expert_w *experts, const struct dsv4_expert_w *shared,
            size_t per_expert, size_t shared_bytes, struct tally *ty)
{
    static const struct {
        const char *name;
        int bf16, N, K;
        unsigned flags;
    } lins[] = {
        { "pf_wq_a", 0, 1024, 4096, 0 },
        { "pf_wq_b", 0, 16384, 1024, 0 },    /* 64 heads x 512, half per rank of 2 */
        { "pf_wkv", 0, 512, 4096, 0 },
        { "pf_wo_b", 0, 4096, 8192, 0 },
        { "pf_idxq", 0, 8192, 1024, 0 },     /* indexer wq_b: 64 heads x 128 */
        { "pf_cwkv", 1, 1024, 4096, DSV4_LIN_F32_OUT },   /* compressor, ratio 4: 2 x 512 */
        { "pf_cwk128", 1, 512, 4096, DSV4_LIN_F32_OUT },  /* compressor, ratio 128 */
        { "pf_wproj", 1, 64, 4096, 0 },      /* indexer weights_proj */
        { "pf_gate", 1, 256, 4096, DSV4_LIN_F32_OUT },    /* router gate */
    };
    size_t nx = (size_t)P_TMAX * 8192, nu = (size_t)P_TMAX * D_MODEL;
    float *xh = host_normals(nx, 1.0f, 1), *x = dev_upload(be, xh, nx * 4);
    /* BF16 weights take x as given: values that are not bf16 (a lo part) */
    float *xuh = host_normals(nu, 1.0f, 0), *xu = dev_upload(be, xuh, nu * 4);
    float *out = dev_alloc(be, (size_t)P_TMAX * 16384 * 4);
    float *xs = dev_alloc(be, (size_t)P_SAMPLE * 8192 * 4);
    float *outs = dev_alloc(be, (size_t)P_SAMPLE * 16384 * 4);

    printf("prefill (fast_gemm.cu): the exact op on %d sampled rows per case; paths wgmma "
           "(default) and mma (dsv4_cuda_set_wgmma(0)); T-indep: first %d rows equal to the "
           "previous T's on the same path (not failed: smaller T may take the decode "
           "kernels); ratio: floor (max of FLOPs at %.0f TFLOP/s, bytes at %.1f TB/s) / "
           "time\n", P_SAMPLE, P_TIND, PEAK_TFS, PEAK_GBS / 1e3);
    for (size_t l = 0; l < sizeof(lins) / sizeof(lins[0]); l++) {
        int bf = lins[l].bf16;
        struct dsv4_linear W = bf ? make_bf16(be, lins[l].N, lins[l].K)
                                  : make_fp8(be, lins[l].N, lins[l].K);
        unsigned fl = lins[l].flags;

        /* x rows are K apart: xh read the same way (rows of K of the same array);
         * the BF16 weights (all K = D_MODEL) on xu */
        pf_linear(be, tm, lins[l].name, &W, fl, bf && fl ? BOUND_F32 : BOUND_BF16,
                  bf && fl ? 0.0 : IDENT_BF16, bf ? xu : x, bf ? xuh : xh, out, xs, outs, ty);
        be->ops->free(be, (void *)(uintptr_t)W.w);
        if (W.scale != NULL)
            be->ops->free(be, (void *)(uintptr_t)W.scale);
    }
    be->ops->free(be, out);
    be->ops->free(be, xs);
    be->ops->free(be, outs);
    be->ops->free(be, xu);
    free(xuh);

    /* moe: x (P_TMOE, D) is the first rows of the same array */
    pf_moe_both(be, tm, experts, shared, x, xh, per_expert, shared_bytes, pt_moe,
                (int)(sizeof(pt_moe) / sizeof(pt_moe[0])), pf_paths_default, 2, ty);
    {
        /* the FP4 group scales 2^3 .. 2^9 (bytes 130 .. 136): fw_kernel's
         * decode multiplies by the scale apart (its one-multiply form holds
         * up to 2^1 only) */
        static const int big_t[] = { 512 };

        printf("prefill moe with the FP4 group scales raised 2^12 (2^3 .. 2^9)\n");
        shift_fp4_scales(be, experts, 12);
        pf_moe_both(be, tm, experts, shared, x, xh, per_expert, shared_bytes, big_t, 1,
                    pf_paths_default, 2, ty);
        shift_fp4_scales(be, experts, -12);
    }
    be->ops->free(be, x);
    free(xh);
}

/* The end of main: release what it made; the exit status. */
static int
bench_end(struct dsv4_backend *be, struct dsv4_cuda_timer *tm, struct dsv4_expert_w *experts,
          int32_t *ids, float *wts, float *xh, const struct tally *ty)
{
    dsv4_cuda_experts_release(be, experts);
    dsv4_cuda_timer_destroy(tm);
    dsv4_backend_destroy(be);
    free(experts);
    free(ids);
    free(wts);
    free(xh);
    return ty->fail ? 1 : 0;
}

int
main(int argc, char **argv)
{
    struct dsv4_backend *be = NULL;
    struct dsv4_cuda_timer *tm;
    struct tally ty = { 0 };
    const char *only = getenv("BENCH_FAST_ONLY");
    int only_moe = only != NULL && strcmp(only, "moe") == 0;   /* the decode MoE only */
    int only_pf = only != NULL && strcmp(only, "prefill") == 0; /* the prefill GEMMs */
    float *xh, *x, *xg, *Xs, *out, *o1, *o2, *wts;
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
    printf("bench_fast: seed %llu; bounds: max |fast - exact| / max |exact| (bound) and "
           "share of bit-identical values (min) per output; router picks may differ at near "
           "ties only (scores within %.1e of the largest); GB/s of the bytes an op must "
           "move, peak %.0f GB/s\n",
           (unsigned long long)(argc > 1 ? strtoull(argv[1], NULL, 10) : 20261201ull),
           ROUTE_TIE, PEAK_GBS);

    if (only != NULL && strcmp(only, "gemm8") == 0) {
        g8_all(be, tm, &ty);
        printf("summary: %d ok, %d failed (BENCH_FAST_ONLY=gemm8)\n", ty.ok, ty.fail);
        dsv4_cuda_timer_destroy(tm);
        dsv4_backend_destroy(be);
        return ty.fail ? 1 : 0;
    }

    /* activations: (T_MAX, 8192) bf16-valued normals; rows are prefixes */
    xh = host_normals((size_t)T_MAX * 8192, 1.0f, 1);
    x = dev_upload(be, xh, (size_t)T_MAX * 8192 * sizeof(float));
    out = dev_alloc(be, (size_t)T_MAX * 129280 * sizeof(float));
    o1 = dev_alloc(be, (size_t)T_MAX * 256 * sizeof(float));
    o2 = dev_alloc(be, (size_t)T_MAX * 256 * sizeof(float));

    /* grouped activations (wo_a): (T, 8 * 4096), not bf16-valued (the op
     * rounds them) */
    xg = dev_normals(be, (size_t)T_MAX * O_GROUPS * D_MODEL, 1.0f, 0);
    if (!only_moe && !only_pf) {
        linear_all(be, tm, x, xh, xg, out, &ty);
        lin_multi_bits(be, x, &ty);
    }
    if (getenv("BENCH_FAST_ONLY") != NULL && strcmp(getenv("BENCH_FAST_ONLY"), "linear") == 0) {
        printf("summary: %d ok, %d failed (BENCH_FAST_ONLY=linear)\n", ty.ok, ty.fail);
        dsv4_cuda_timer_destroy(tm);
        dsv4_backend_destroy(be);
        free(xh);
        return ty.fail ? 1 : 0;
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
    if (only_pf) {
        prefill_all(be, tm, experts, &shared, per_expert, shared_bytes, &ty);
        printf("summary: %d ok, %d failed (BENCH_FAST_ONLY=%s)\n", ty.ok, ty.fail, only);
        dsv4_cuda_experts_release(be, experts);
        dsv4_cuda_timer_destroy(tm);
        dsv4_backend_destroy(be);
        free(experts);
        free(xh);
        return ty.fail ? 1 : 0;
    }

    /* routing: k distinct experts per token, positive weights summing to 1.5 */
    ids = malloc((size_t)T_MAX * K_PICKS * sizeof(int32_t));
    wts = malloc((size_t)T_MAX * K_PICKS * sizeof(float));
    if (ids == NULL || wts == NULL)
        return 1;
    make_routing(ids, wts, T_MAX);
    {
        /* moe_parts' expert arrays: the odd experts held elsewhere; the tp
         * rank's share of every expert (struct moe_sets) */
        struct dsv4_expert_w *half = malloc(E_EXPERTS * sizeof(*half));
        struct dsv4_expert_w *tp = malloc(E_EXPERTS * sizeof(*tp)), shared_tp;
        int32_t *ids_d = dev_upload(be, ids, (size_t)T_MAX * K_PICKS * sizeof(int32_t));
        float *wts_d = dev_upload(be, wts, (size_t)T_MAX * K_PICKS * sizeof(float));
        struct moe_sets ms = {
            .table = { experts, half, tp },
            .shared = { &shared, &shared, &shared_tp },
            .per_expert = { per_expert, per_expert, per_expert / 2 },
            .shared_bytes = { shared_bytes, shared_bytes, shared_bytes / 2 },
        };

        if (half == NULL || tp == NULL)
            return 1;
        memcpy(half, experts, E_EXPERTS * sizeof(*half));
        for (int e = 1; e < E_EXPERTS; e += 2)
            memset(&half[e], 0, sizeof(half[e]));
        memcpy(tp, experts, E_EXPERTS * sizeof(*tp));
        shared_tp = shared;
        for (int e = 0; e <= E_EXPERTS; e++) {
            struct dsv4_expert_w *w = e < E_EXPERTS ? &tp[e] : &shared_tp;

            w->w1.n_out = w->w3.n_out = I_EXPERT / 2;
            w->w2.n_in = I_EXPERT / 2;
        }
        TRY("register experts", dsv4_cuda_experts_register(be, half, E_EXPERTS));
        TRY("register experts", dsv4_cuda_experts_register(be, tp, E_EXPERTS));
        moe_decode_all(be, tm, &ms, x, out, ids_d, wts_d, ids, &ty);
        dsv4_cuda_experts_release(be, tp);
        dsv4_cuda_experts_release(be, half);
        free(tp);
        free(half);
        be->ops->free(be, ids_d);
        be->ops->free(be, wts_d);
    }
    if (only_moe) {
        printf("summary: %d ok, %d failed (BENCH_FAST_ONLY=moe)\n", ty.ok, ty.fail);
        return bench_end(be, tm, experts, ids, wts, xh, &ty);
    }

    /* rms_norm: (T, 4096) weighted (attn/ffn norm), (T * 64, 512) unweighted
     * (per-head q norm); x not bf16-valued (the op rounds it) */
    {
        struct op o = { .name = "norm", .kind = OP_NORM, .x = xg, .rows_per_t = 1,
                        .D = D_MODEL };
        float *wf = host_normals(D_MODEL, 0.1f, 0);
        uint16_t *wb = malloc(D_MODEL * sizeof(uint16_t));

        if (wb == NULL)
            return 1;
        for (int i = 0; i < D_MODEL; i++)
            wb[i] = dsv4_f32_to_bf16(1.0f + wf[i]);
        o.nw = dev_upload(be, wb, D_MODEL * sizeof(uint16_t));
        o.outs[0] = out_f32("out", out, D_MODEL, BOUND_BF16, IDENT_NORM);
        o.n_outs = 1;
        run_all(be, tm, &o, D_MODEL * 2, (size_t)D_MODEL * 8, 0, &ty);
        o.name = "norm_h";
        o.nw = NULL;
        o.rows_per_t = N_HEADS;
        o.D = HEAD_DIM;
        o.outs[0].w = N_HEADS * HEAD_DIM;
        run_all(be, tm, &o, 0, (size_t)N_HEADS * HEAD_DIM * 8, 0, &ty);
        free(wf);
        free(wb);
    }

    /* hc_pre and hc_head on X (T, 4, 4096) bf16-valued */
    Xs = dev_normals(be, (size_t)T_MAX * HC_N * D_MODEL, 1.0f, 1);
    {
        struct dsv4_hc_w hp = make_hc(be, HC_N, D_MODEL, 0), hh = make_hc(be, HC_N, D_MODEL, 1);
        struct op o = { .name = "hc_pre", .kind = OP_HC_PRE, .x = Xs, .hc = &hp, .n = HC_N,
                        .D = D_MODEL };
        size_t fnb = (size_t)(2 + HC_N) * HC_N * HC_N * D_MODEL * 4;

        o.outs[0] = out_f32("x", out, D_MODEL, BOUND_BF16, IDENT_HC);
        o.outs[1] = out_f32("post", o1, HC_N, BOUND_HC, 0.0);
        o.outs[2] = out_f32("comb", o2, HC_N * HC_N, BOUND_HC, 0.0);
        o.n_outs = 3;
        run_all(be, tm, &o, fnb, (size_t)(HC_N + 1) * D_MODEL * 4, 0, &ty);
        o.name = "hc_head";
        o.kind = OP_HC_HEAD;
        o.hc = &hh;
        o.n_outs = 1;
        run_all(be, tm, &o, fnb / (2 + HC_N), (size_t)(HC_N + 1) * D_MODEL * 4, 0, &ty);
    }

    /* router: gate BF16 256 x 4096, bias, k = 6, learned routing */
    {
        struct op o = { .name = "router", .kind = OP_ROUTER, .x = x };
        struct out_arr a = { "ids", o2, K_PICKS, 1, 0, 0 };

        o.W = make_bf16(be, E_EXPERTS, D_MODEL);
        o.bias = dev_normals(be, E_EXPERTS, 0.05f, 0);
        o.logits = dev_alloc(be, (size_t)T_MAX * E_EXPERTS * sizeof(float));
        o.outs[0] = a;
        o.outs[1] = out_f32("weights", o1, K_PICKS, BOUND_ROUTE, 0.0);
        o.n_outs = 2;
        run_all(be, tm, &o, lin_bytes(&o.W), (size_t)D_MODEL * 4, 0, &ty);
    }

    /* compress: ratio 4 (overlapping windows, c = 2) and 128, d = 512; row t
     * is slot t at the last position of a window (every row emits, ratio 4
     * shifts its windows) */
    for (int ci = 0; ci < 2; ci++) {
        int r = ci == 0 ? 4 : 128, c = r == 4 ? 2 : 1, d = HEAD_DIM;
        size_t per_slot = (size_t)c * r * c * d;
        struct op o = { .name = ci == 0 ? "comp4" : "comp128", .kind = OP_COMPRESS, .r = r,
                        .D = d };
        int32_t sp[T_MAX][3];
        int32_t *h = malloc(sizeof(int32_t) * 3 * T_MAX);

        if (h == NULL)
            return 1;
        for (int t = 0; t < T_MAX; t++) {
            sp[t][0] = t;
            sp[t][1] = r * (t + 1) - 1;
            sp[t][2] = t;
        }
        for (int j = 0; j < 3; j++) {
            for (int t = 0; t < T_MAX; t++)
                h[t] = sp[t][j];
            *(j == 0 ? &o.slot : j == 1 ? &o.pos : &o.emit) =
                dev_upload(be, h, T_MAX * sizeof(int32_t));
        }
        free(h);
        o.pool_bytes = (size_t)T_MAX * per_slot * sizeof(float);
        o.skv0 = dev_normals(be, (size_t)T_MAX * per_slot, 1.0f, 0);
        o.sz0 = dev_normals(be, (size_t)T_MAX * per_slot, 1.0f, 0);
        o.skv = dev_alloc(be, o.pool_bytes);
        o.sz = dev_alloc(be, o.pool_bytes);
        o.x = dev_normals(be, (size_t)T_MAX * c * d, 1.0f, 0);
        o.za = dev_normals(be, (size_t)T_MAX * c * d, 1.0f, 0);
        o.ape = dev_normals(be, (size_t)r * c * d, 0.5f, 0);
        o.outs[0] = out_f32("entry", out, d, BOUND_COMP, 0.0);
        o.outs[1] = out_f32("kv", o.skv, (int)per_slot, 0.0, 1.0);
        o.outs[2] = out_f32("z", o.sz, (int)per_slot, 0.0, 1.0);
        o.n_outs = 3;
        run_all(be, tm, &o, (size_t)r * c * d * 4, (2 * per_slot + 2 * (size_t)c * d) * 4, 0,
                &ty);
    }

    prefill_all(be, tm, experts, &shared, per_expert, shared_bytes, &ty);

    printf("summary: %d ok, %d failed; mean share of peak bandwidth of the weight-streaming "
           "ops at T <= 16: %.2f\n",
           ty.ok, ty.fail, ty.n_ratio ? ty.sum_ratio / ty.n_ratio : 0.0);
    return bench_end(be, tm, experts, ids, wts, xh, &ty);
}
