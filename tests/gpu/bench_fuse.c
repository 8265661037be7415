/*
 * bench_fuse.c — the fused small ops (kernels/backend.h: hc_post_pre,
 * norm_rope; kernels/cuda/fast_fuse.cu, fast_hc.cu) and the decode-sized
 * fast compress (slot chains, fast_attn.cu) on the flash shapes: checks
 * and speed.
 *
 *   bench_fuse [SEED]
 *
 * BENCH_FUSE_ONLY=NAME runs only the case of that name (below).
 *
 * Cases at T = 1, 2, 4, 16, 32, 64 rows (the hc ops and nr_q also 256,
 * 300 and 2,048: the prefill form of the mix, hf2_mixb_kernel's blocks of
 * 64 tokens from 64, a last block of fewer tokens at 300, two slabs at
 * 2,048; norm_rope's v4), REF
 * numerics, random inputs:
 *   hc_post_pre  n = 4 streams of 4096, Sinkhorn 20 iterations, with the
 *                next input norm (weighted): X_out, x, post, comb, xn;
 *   nr_q         norm_rope as the per-head q path: T*64 rows of 512, no
 *                weight, RoPE of the last 64 (64 heads per position);
 *   nr_kv        the window KV: T rows of 512, kv_norm, RoPE, FP8 sim of the
 *                first 448 per 64;
 *   nr_ent       a compressor's entries: as nr_kv, plus the scatter into a
 *                pool of 4*T_MAX rows at shuffled rows;
 *   nr_pair      nr_ent through norm_rope2: the first ceil(T/2) tokens' rows
 *                as one call, the rest as the other (T = 1: all in the
 *                first, an empty second);
 *   nr_qkv       the attention's norm_rope2: nr_q's rows and nr_kv's in
 *                one call (from 5 tokens q takes v4, kv v3: one launch);
 *   nr_idx       the indexer compressor's entries: 128 wide, RoPE of the
 *                last 64, no sim;
 *   comp4c, comp128c  compress with rows sharing slots (slot t % ceil(T/2),
 *                each slot's rows at consecutive positions, windows ending
 *                inside the call), so the chains of fc_chain_kernel run
 *                more than one row;
 *   hc_pre       hc_pre alone (n = 4 streams of 4096, 20 iterations): x,
 *                post, comb;
 *   hc_head      hc_head (n = 4 streams of 4096): x;
 *   rms_norm     the fast rms_norm alone, T rows of 4096 with a weight.
 * Per case and T, five runs on the same inputs: the CPU backend (the fused
 * op is its composition), the CUDA exact kernels (fast off), the CUDA fast
 * fused kernels, the CUDA fast kernels composed (the plain ops one after
 * the other: hc_post + hc_pre + rms_norm; rms_norm + rope + fp8_sim +
 * scatter_rows; not for the plain ops hc_pre, hc_head, rms_norm), the
 * fast op with the first version of the small kernels (v1:
 * dsv4_cuda_set_small_kernels(1), as DSV4_CUDA_HC=v1 DSV4_CUDA_NORM=v1;
 * not for compress) and, for the hc ops and norm_rope, with v3 (hc: the
 * second kernel a programmatic dependent launch, DSV4_CUDA_HC=v3;
 * norm_rope: helper warps for the RoPE angles, DSV4_CUDA_NORM=v3) and, for
 * norm_rope, v4 (a warp per row for calls of more than 256 rows of several
 * heads, DSV4_CUDA_NORM=v4; the other calls as v3).  Checks:
 *   exact == CPU       bit for bit (the exact kernels' contract; fp32
 *                      values after an exp within 2^-20 relative of the
 *                      largest, as test_ops_gpu allows);
 *   fused == composed  bit for bit (the fused kernels promise the fast
 *                      ops' bits; not for compress: no composed form);
 *   fast vs exact      max |fast - exact| / max |exact| and the share of
 *                      bit-identical values against the bounds of
 *                      bench_fast (hc x, xn 2^-7 >= 90%; post, comb 2^-12;
 *                      X_out identical; norm_rope 2^-7 >= 90% without
 *                      FP8 sim, 2^-3 >= 80% with it (a one-ulp change of
 *                      a normed value can move it to the next FP8 code);
 *                      compress entries 2^-12, state pools identical);
 *   v2 == v1, v3, v4   the small kernels' versions give the same bits
 *                      (not for compress; v3: hc ops and norm_rope; v4:
 *                      norm_rope);
 *   determinism        a second fast run gives the same bits;
 *   T-independence     the first rows at this T equal those at the
 *                      previous T (fast fused; not for compress, whose
 *                      slots, positions and emitted rows depend on T).
 * Then each form recorded 10 times into a CUDA graph, median of 15 timed
 * replays per call: exact, fast composed, fast fused (v2), fast
 * fused with the v1, the v3 and the v4 small kernels (µs), and the kernel launches
 * per call of each (counted from the graph's nodes; 0.0 us (0): not run).
 * A failing line names the first differing value (index, both values).
 * Last line: PASS or FAIL.  Exit status: 0 pass, 1 fail, 77 no CUDA device.
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

#define T_MAX 2048
#define D_MODEL 4096
#define HC_N 4
#define HC_ITERS 20
#define HEADS 64
#define HEAD_DIM 512
#define NOPE 448
#define RD 64
#define IDX_DIM 128
#define POOL_ROWS (4 * T_MAX)
#define GRAPH_REPS 10
#define N_TIMED 15
#define MAX_ARRS 10

static const int t_list[] = { 1, 2, 4, 16, 32, 64, 256, 300, 2048 };
#define N_T ((int)(sizeof(t_list) / sizeof(t_list[0])))

static struct dsv4_backend *cpu, *gpu;
static uint64_t rng_state;

static uint64_t
rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double
rng_unif(void)
{
    return (double)(rng_next() >> 11) * 0x1p-53;
}

/* n normals times sd (bf16-rounded when round), or uniforms in [lo, lo+sd)
 * when uni. */
static float *
host_vals(size_t n, float sd, int round, int uni, float lo)
{
    float *h = malloc(n * sizeof(float) + 4);

    if (h == NULL)
        exit(1);
    for (size_t i = 0; i < n; i++) {
        double u1 = rng_unif(), u2 = rng_unif();
        float v = uni ? lo + sd * (float)u1
                      : sd * (float)(sqrt(-2.0 * log(u1 + 1e-300)) * cos(6.283185307179586 * u2));

        h[i] = round ? dsv4_bf16_round(v) : v;
    }
    return h;
}

/* --- arrays on both backends --------------------------------------------------- */

/*
 * One array of a case: host contents restored before every run (NULL:
 * NaN poison, every output value must be written), its copies on the CPU
 * and the GPU backend, and what the checks compare: `w` values per row
 * (the first rows(T) rows), or the whole array when w == 0.
 */
struct arr {
    const char *tag;
    size_t bytes;
    void *init;
    void *c, *g;
    int out;              /* compared */
    int w;                /* floats per row; 0: whole array */
    int rows_per_t;       /* rows per token (nr_q: 64) */
    int is_int;
    double bound, ident;  /* fast vs exact */
    double cpu_bound;     /* exact vs CPU (0: identical) */
};

static void *
dev_alloc(struct dsv4_backend *be, size_t bytes)
{
    void *p = be->ops->alloc(be, bytes);

    if (p == NULL) {
        fprintf(stderr, "alloc %zu: %s\n", bytes, dsv4_errmsg());
        exit(1);
    }
    return p;
}

static void
arr_make(struct arr *a, const char *tag, size_t bytes, void *init)
{
    memset(a, 0, sizeof(*a));
    a->tag = tag;
    a->bytes = bytes;
    a->init = init;
    a->c = dev_alloc(cpu, bytes);
    a->g = dev_alloc(gpu, bytes);
}

static void
arr_out(struct arr *a, int w, int rows_per_t, double bound, double ident, double cpu_bound)
{
    a->out = 1;
    a->w = w;
    a->rows_per_t = rows_per_t;
    a->bound = bound;
    a->ident = ident;
    a->cpu_bound = cpu_bound;
}

/* Restore every array of the case on backend be. */
static void
arrs_reset(struct dsv4_backend *be, struct arr *as, int n)
{
    for (int i = 0; i < n; i++) {
        void *d = be == cpu ? as[i].c : as[i].g;

        if (as[i].init != NULL) {
            TRY("upload", be->ops->upload(be, d, as[i].init, as[i].bytes));
        } else {
            float *h = malloc(as[i].bytes);

            if (h == NULL)
                exit(1);
            for (size_t j = 0; j < as[i].bytes / 4; j++)
                h[j] = NAN;
            TRY("upload", be->ops->upload(be, d, h, as[i].bytes));
            free(h);
        }
    }
}

/* Bytes of array a compared at T. */
static size_t
arr_cmp_bytes(const struct arr *a, int T)
{
    return a->w == 0 ? a->bytes : (size_t)T * a->rows_per_t * a->w * 4;
}

/* --- cases ---------------------------------------------------------------------------- */

enum form { F_FUSED, F_COMPOSED };
enum kind { K_HC, K_NR, K_QKV, K_COMP, K_PRE, K_HEAD, K_NORM };

struct kase {
    const char *name;
    enum kind kind;
    struct arr a[MAX_ARRS];
    int n;
    /* hc: a[] = X_out, x, post, comb, xn, f, X, post_in / comb_in (post, comb
     * in place: the op may alias them), so post/comb start from inputs */
    struct dsv4_hc_w hc_c, hc_g;
    uint16_t *nw_c, *nw_g;
    /* norm_rope */
    int D, heads, off, rd, sim_cols, with_w, with_dst, pair;
    int32_t *pos_c, *pos_g, *rows_c, *rows_g;
    float freqs[RD / 2];
    /* compress */
    int r;
    int32_t *slot_h, *cpos_h, *emit_h;   /* host, per T (rebuilt) */
};

/* Upload host bytes to both backends' new arrays. */
static void
both_upload(void **c, void **g, const void *h, size_t bytes)
{
    *c = dev_alloc(cpu, bytes);
    *g = dev_alloc(gpu, bytes);
    TRY("upload", cpu->ops->upload(cpu, *c, h, bytes));
    TRY("upload", gpu->ops->upload(gpu, *g, h, bytes));
}

/* The op of case k at T on backend be (arrays of that backend). */
static enum dsv4_err
kase_run(struct dsv4_backend *be, struct kase *k, int T, enum form form)
{
    int g = be == gpu;
#define A(i) ((float *)(g ? k->a[i].g : k->a[i].c))
#define I32(i) ((int32_t *)(g ? k->a[i].g : k->a[i].c))

    switch (k->kind) {
    case K_HC: {
        const struct dsv4_hc_w *hc = g ? &k->hc_g : &k->hc_c;
        const uint16_t *nw = g ? k->nw_g : k->nw_c;
        enum dsv4_err e;

        if (form == F_FUSED)
            return be->ops->hc_post_pre(be, A(0), A(1), A(2), A(3), A(4), A(5), A(6), A(2),
                                        A(3), hc, nw, T, HC_N, D_MODEL, HC_ITERS, 1e-6f,
                                        1e-6f);
        e = be->ops->hc_post(be, A(0), A(5), A(6), A(2), A(3), T, HC_N, D_MODEL);
        if (e == DSV4_OK)
            e = be->ops->hc_pre(be, A(1), A(2), A(3), A(0), hc, T, HC_N, D_MODEL, HC_ITERS,
                                1e-6f, 1e-6f);
        if (e == DSV4_OK)
            e = be->ops->rms_norm(be, A(4), A(1), nw, T, D_MODEL, 1e-6f);
        return e;
    }
    case K_NR: {
        int rows = T * k->heads;
        const uint16_t *w = k->with_w ? (g ? k->nw_g : k->nw_c) : NULL;
        const int32_t *pos = g ? k->pos_g : k->pos_c, *rw = g ? k->rows_g : k->rows_c;
        float *dst = k->with_dst ? A(1) : NULL;
        enum dsv4_err e;

        if (form == F_FUSED && k->pair) {   /* tokens [0, h) and [h, T) */
            int h = (T + 1) / 2;
            struct dsv4_norm_rope a = {
                .x = A(0), .w = w, .rows = h * k->heads, .D = k->D, .eps = 1e-6f, .pos = pos,
                .heads = k->heads, .off = k->off, .rd = k->rd, .freqs = k->freqs,
                .sim_cols = k->sim_cols, .sim_block = 64, .dst = dst, .dst_rows = rw,
            };
            struct dsv4_norm_rope b = a;

            b.x = A(0) + (int64_t)h * k->heads * k->D;
            b.rows = (T - h) * k->heads;
            b.pos = pos + h;
            b.dst_rows = rw + (int64_t)h * k->heads;
            return be->ops->norm_rope2(be, &a, &b);
        }
        if (form == F_FUSED)
            return be->ops->norm_rope(be, A(0), w, rows, k->D, 1e-6f, pos, k->heads, k->off,
                                      k->rd, k->freqs, k->sim_cols, 64, dst, rw);
        e = be->ops->rms_norm(be, A(0), A(0), w, rows, k->D, 1e-6f);
        if (e == DSV4_OK)
            e = be->ops->rope(be, A(0), pos, T, k->heads, (int64_t)k->heads * k->D, k->D, k->off,
                              k->rd, k->freqs, 0);
        if (e == DSV4_OK && k->sim_cols > 0)
            e = be->ops->fp8_sim(be, A(0), rows, k->D, k->sim_cols, 64);
        if (e == DSV4_OK && dst != NULL)
            e = be->ops->scatter_rows(be, dst, rw, A(0), rows, k->D);
        return e;
    }
    case K_QKV: {   /* a[] = q (T * HEADS rows, no weight), kv (T rows: weight, FP8 sim) */
        const uint16_t *w = g ? k->nw_g : k->nw_c;
        const int32_t *pos = g ? k->pos_g : k->pos_c;
        struct dsv4_norm_rope q = {
            .x = A(0), .rows = T * HEADS, .D = k->D, .eps = 1e-6f, .pos = pos,
            .heads = HEADS, .off = k->off, .rd = k->rd, .freqs = k->freqs,
        };
        struct dsv4_norm_rope kv = {
            .x = A(1), .w = w, .rows = T, .D = k->D, .eps = 1e-6f, .pos = pos, .heads = 1,
            .off = k->off, .rd = k->rd, .freqs = k->freqs, .sim_cols = k->sim_cols,
            .sim_block = 64,
        };
        enum dsv4_err e;

        if (form == F_FUSED)
            return be->ops->norm_rope2(be, &q, &kv);
        e = be->ops->rms_norm(be, A(0), A(0), NULL, T * HEADS, k->D, 1e-6f);
        if (e == DSV4_OK)
            e = be->ops->rope(be, A(0), pos, T, HEADS, (int64_t)HEADS * k->D, k->D, k->off,
                              k->rd, k->freqs, 0);
        if (e == DSV4_OK)
            e = be->ops->rms_norm(be, A(1), A(1), w, T, k->D, 1e-6f);
        if (e == DSV4_OK)
            e = be->ops->rope(be, A(1), pos, T, 1, k->D, k->D, k->off, k->rd, k->freqs, 0);
        if (e == DSV4_OK)
            e = be->ops->fp8_sim(be, A(1), T, k->D, k->sim_cols, 64);
        return e;
    }
    case K_PRE:   /* a[] = x, post, comb, X */
        return be->ops->hc_pre(be, A(0), A(1), A(2), A(3), g ? &k->hc_g : &k->hc_c, T, HC_N,
                               D_MODEL, HC_ITERS, 1e-6f, 1e-6f);
    case K_HEAD:   /* a[] = x, X */
        return be->ops->hc_head(be, A(0), A(1), g ? &k->hc_g : &k->hc_c, T, HC_N, D_MODEL,
                                1e-6f, 1e-6f);
    case K_NORM:   /* a[] = out, x */
        return be->ops->rms_norm(be, A(0), A(1), g ? k->nw_g : k->nw_c, T, D_MODEL, 1e-6f);
    default:
        /* a[] = entries, kv pool, z pool, a, z, ape, slot, pos, emit */
        return be->ops->compress(be, A(0), A(1), A(2), A(3), A(4), A(5), I32(6), I32(7), I32(8),
                                 T, k->r, HEAD_DIM);
    }
#undef A
#undef I32
}

/* Compress inputs at T: rows share slots (slot t % ns), consecutive
 * positions per slot, each slot's run ending a window inside the call. */
static void
comp_plan(struct kase *k, int T)
{
    int ns = (T + 1) / 2, cnt[T_MAX] = { 0 }, len[T_MAX] = { 0 };

    for (int t = 0; t < T; t++)
        len[t % ns]++;
    for (int t = 0; t < T; t++) {
        int s = t % ns, p = k->r * (s + 1) - len[s] + cnt[s]++;

        k->slot_h[t] = s;
        k->cpos_h[t] = p < 0 ? p + k->r : p;
        k->emit_h[t] = (k->cpos_h[t] + 1) % k->r == 0 ? t : -1;
    }
    for (int i = 6; i < 9; i++) {
        const int32_t *h = i == 6 ? k->slot_h : i == 7 ? k->cpos_h : k->emit_h;

        memcpy(k->a[i].init, h, T_MAX * sizeof(int32_t));
    }
}

/* --- comparison --------------------------------------------------------------------- */

struct cmp {
    double maxd, maxr;
    size_t ident, n, first;
    float fa, fb;
    int have_first;
};

static void
cmp_add(struct cmp *c, const void *va, const void *vb, size_t n, int is_int)
{
    for (size_t i = 0; i < n; i++) {
        int same;
        double d;

        if (is_int) {
            int32_t x = ((const int32_t *)va)[i], y = ((const int32_t *)vb)[i];

            same = x == y;
            d = same ? 0 : INFINITY;
            c->maxr = 1;
        } else {
            float x = ((const float *)va)[i], y = ((const float *)vb)[i];

            same = memcmp(&x, &y, 4) == 0;
            d = fabs((double)x - y);
            if (isnan(d))
                d = same ? 0 : INFINITY;
            if (fabs((double)y) > c->maxr)
                c->maxr = fabs((double)y);
        }
        if (d > c->maxd)
            c->maxd = d;
        c->ident += same;
        if (!same && !c->have_first) {
            c->have_first = 1;
            c->first = i;
            c->fa = is_int ? (float)((const int32_t *)va)[i] : ((const float *)va)[i];
            c->fb = is_int ? (float)((const int32_t *)vb)[i] : ((const float *)vb)[i];
        }
    }
    c->n += n;
}

static double
cmp_rel(const struct cmp *c)
{
    return c->maxr > 0 ? c->maxd / c->maxr : c->maxd;
}

/* Append "tag: ..." to line for a check of a (got) against b (want) with
 * bound/ident; returns whether it holds. */
static int
check(char *line, size_t cap, const char *what, const struct arr *a, const void *got,
      const void *want, size_t bytes, double bound, double ident)
{
    struct cmp c;
    size_t len = strlen(line);
    double share;
    int ok;

    memset(&c, 0, sizeof(c));
    cmp_add(&c, got, want, bytes / 4, a->is_int);
    share = c.n ? (double)c.ident / c.n : 1.0;
    ok = cmp_rel(&c) <= bound && share >= ident;
    if (ok && bound == 0 && ident >= 1.0)
        return 1;   /* identical as required: nothing to say */
    snprintf(line + len, cap - len, " %s%s %s maxrel %.2e (%.0e) ident %.1f%% (%.0f%%)",
             ok ? "" : "!", a->tag, what, cmp_rel(&c), bound, 100 * share, 100 * ident);
    if (!ok && c.have_first) {
        len = strlen(line);
        snprintf(line + len, cap - len, " first at %zu: %.9g vs %.9g", c.first, c.fa, c.fb);
    }
    return ok;
}

/* --- timing ------------------------------------------------------------------------- */

static int
cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;

    return x < y ? -1 : x > y;
}

/* Median µs per call of case k's form on the GPU, and the graph's kernel
 * nodes per call. */
static float
time_form(struct dsv4_cuda_timer *tm, struct kase *k, int T, enum form form, int *nodes)
{
    void *g = NULL;
    float ms[N_TIMED];

    TRY("graph_begin", gpu->ops->graph_begin(gpu));
    for (int i = 0; i < GRAPH_REPS; i++)
        TRY("op (recording)", kase_run(gpu, k, T, form));
    TRY("graph_end", gpu->ops->graph_end(gpu, &g));
    *nodes = dsv4_cuda_graph_kernels(gpu, NULL);
    if (*nodes > 0)
        *nodes /= GRAPH_REPS;
    for (int i = 0; i < 2; i++)
        TRY("graph_launch", gpu->ops->graph_launch(gpu, g));
    TRY("sync", gpu->ops->sync(gpu));
    for (int i = 0; i < N_TIMED; i++) {
        TRY("timer", dsv4_cuda_timer_start(tm));
        TRY("graph_launch", gpu->ops->graph_launch(gpu, g));
        TRY("timer", dsv4_cuda_timer_stop(tm, &ms[i]));
        ms[i] /= GRAPH_REPS;
    }
    gpu->ops->graph_free(gpu, g);
    qsort(ms, N_TIMED, sizeof(float), cmp_float);
    return ms[N_TIMED / 2] * 1e3f;
}

/* --- one case at every T ---------------------------------------------------------------- */

/* Run k on be (fast on/off for the GPU) and download its outputs into res. */
static void
run_download(struct dsv4_backend *be, struct kase *k, int T, enum form form, void **res)
{
    if (k->kind == K_COMP)
        comp_plan(k, T);
    arrs_reset(be, k->a, k->n);
    TRY(k->name, kase_run(be, k, T, form));
    for (int i = 0; i < k->n; i++) {
        if (!k->a[i].out)
            continue;
        res[i] = malloc(k->a[i].bytes);
        if (res[i] == NULL)
            exit(1);
        TRY("download", be->ops->download(be, res[i], be == cpu ? k->a[i].c : k->a[i].g,
                                          arr_cmp_bytes(&k->a[i], T)));
    }
    TRY("sync", be->ops->sync(be));
}

static void
free_res(void **res, int n)
{
    for (int i = 0; i < n; i++) {
        free(res[i]);
        res[i] = NULL;
    }
}

static int
kase_all(struct dsv4_cuda_timer *tm, struct kase *k)
{
    void *prev[MAX_ARRS] = { 0 };
    int prev_T = 0, fails = 0;
    int nr = k->kind == K_NR || k->kind == K_QKV;
    int has_co = k->kind == K_HC || nr, has_v1 = k->kind != K_COMP;
    int has_v3 = k->kind == K_HC || k->kind == K_PRE || k->kind == K_HEAD || nr;
    int has_v4 = nr;

    for (int ti = 0; ti < N_T; ti++) {
        int T = t_list[ti], ok = 1, n_ex = 0, n_co = 0, n_fu = 0, n_v1 = 0, n_v3 = 0, n_v4 = 0;
        void *rc[MAX_ARRS] = { 0 }, *rx[MAX_ARRS] = { 0 }, *rf[MAX_ARRS] = { 0 };
        void *rf2[MAX_ARRS] = { 0 }, *rco[MAX_ARRS] = { 0 }, *rv1[MAX_ARRS] = { 0 };
        void *rv3[MAX_ARRS] = { 0 }, *rv4[MAX_ARRS] = { 0 };
        char line[2048] = "";
        float us_ex, us_co = 0, us_fu, us_v1 = 0, us_v3 = 0, us_v4 = 0;

        /* beyond 64 rows: the hc ops, and norm_rope of several heads (v4) */
        if (T > 64 && k->kind != K_HC && k->kind != K_PRE && k->kind != K_HEAD &&
            !(nr && k->heads > 1))
            continue;

        run_download(cpu, k, T, F_FUSED, rc);
        TRY("kernels", dsv4_cuda_set_kernels(gpu, 0));
        run_download(gpu, k, T, F_FUSED, rx);
        TRY("kernels", dsv4_cuda_set_kernels(gpu, 1));
        dsv4_cuda_set_small_kernels(2);
        run_download(gpu, k, T, F_FUSED, rf);
        run_download(gpu, k, T, F_FUSED, rf2);
        if (has_co)
            run_download(gpu, k, T, F_COMPOSED, rco);
        if (has_v1) {
            dsv4_cuda_set_small_kernels(1);
            run_download(gpu, k, T, F_FUSED, rv1);
        }
        if (has_v3) {
            dsv4_cuda_set_small_kernels(3);
            run_download(gpu, k, T, F_FUSED, rv3);
        }
        if (has_v4) {
            dsv4_cuda_set_small_kernels(4);
            run_download(gpu, k, T, F_FUSED, rv4);
        }
        dsv4_cuda_set_small_kernels(2);
        for (int i = 0; i < k->n; i++) {
            const struct arr *a = &k->a[i];
            size_t nb = arr_cmp_bytes(a, T);

            if (!a->out)
                continue;
            ok &= check(line, sizeof(line), "exact/cpu", a, rx[i], rc[i], nb, a->cpu_bound,
                        a->cpu_bound == 0 ? 1.0 : 0.0);
            if (has_co)
                ok &= check(line, sizeof(line), "fused/composed", a, rf[i], rco[i], nb, 0, 1.0);
            if (has_v1)
                ok &= check(line, sizeof(line), "v2/v1", a, rf[i], rv1[i], nb, 0, 1.0);
            if (has_v3)
                ok &= check(line, sizeof(line), "v3/v2", a, rv3[i], rf[i], nb, 0, 1.0);
            if (has_v4)
                ok &= check(line, sizeof(line), "v4/v2", a, rv4[i], rf[i], nb, 0, 1.0);
            ok &= check(line, sizeof(line), "fast/exact", a, rf[i], rx[i], nb, a->bound,
                        a->ident);
            ok &= check(line, sizeof(line), "determinism", a, rf2[i], rf[i], nb, 0, 1.0);
            /* compress: slots (t % ceil(T/2)), positions and emitted rows
             * depend on T, so its rows at two T are different inputs */
            if (prev[i] != NULL && a->w > 0 && k->kind != K_COMP)
                ok &= check(line, sizeof(line), "T-indep", a, rf[i], prev[i],
                            arr_cmp_bytes(a, prev_T), 0, 1.0);
        }
        TRY("kernels", dsv4_cuda_set_kernels(gpu, 0));
        us_ex = time_form(tm, k, T, F_FUSED, &n_ex);
        TRY("kernels", dsv4_cuda_set_kernels(gpu, 1));
        if (has_co)
            us_co = time_form(tm, k, T, F_COMPOSED, &n_co);
        us_fu = time_form(tm, k, T, F_FUSED, &n_fu);
        if (has_v1) {
            dsv4_cuda_set_small_kernels(1);
            us_v1 = time_form(tm, k, T, F_FUSED, &n_v1);
        }
        if (has_v3) {
            dsv4_cuda_set_small_kernels(3);
            us_v3 = time_form(tm, k, T, F_FUSED, &n_v3);
        }
        if (has_v4) {
            dsv4_cuda_set_small_kernels(4);
            us_v4 = time_form(tm, k, T, F_FUSED, &n_v4);
        }
        dsv4_cuda_set_small_kernels(2);
        printf("%-4s %-12s T=%-3d exact %8.1f us (%d kernels)  fast composed %7.1f us (%d)  "
               "fast fused %7.1f us (%d)  v1 %7.1f us (%d)  v3 %7.1f us (%d)  v4 %7.1f us "
               "(%d)%s\n",
               ok ? "ok" : "FAIL", k->name, T, us_ex, n_ex, us_co, n_co, us_fu, n_fu, us_v1,
               n_v1, us_v3, n_v3, us_v4, n_v4, line);
        fflush(stdout);
        fails += !ok;
        free_res(prev, k->n);
        memcpy(prev, rf, sizeof(prev));
        prev_T = T;
        free_res(rc, k->n);
        free_res(rx, k->n);
        free_res(rf2, k->n);
        free_res(rco, k->n);
        free_res(rv1, k->n);
        free_res(rv3, k->n);
        free_res(rv4, k->n);
    }
    free_res(prev, k->n);
    return fails;
}

/* --- case construction ------------------------------------------------------------------ */

static uint16_t *
host_norm_w(int D)
{
    uint16_t *w = malloc((size_t)D * sizeof(uint16_t));
    float *f = host_vals((size_t)D, 0.1f, 0, 0, 0);

    if (w == NULL)
        exit(1);
    for (int i = 0; i < D; i++)
        w[i] = dsv4_f32_to_bf16(1.0f + f[i]);
    free(f);
    return w;
}

/* The hc weights of n mix rows per stream set (hc_pre: (2 + n) n, hc_head:
 * n) on both backends. */
static void
make_hc_w(struct kase *k, int M)
{
    int nD = HC_N * D_MODEL;
    float sc[3] = { 0.7f, 1.3f, 0.9f };
    float *fn = host_vals((size_t)M * nD, 0.01f, 0, 0, 0), *base = host_vals(M, 0.5f, 0, 0, 0);
    void *pc, *pg;

    both_upload(&pc, &pg, fn, (size_t)M * nD * 4);
    k->hc_c.fn = pc;
    k->hc_g.fn = pg;
    both_upload(&pc, &pg, base, (size_t)M * 4);
    k->hc_c.base = pc;
    k->hc_g.base = pg;
    both_upload(&pc, &pg, sc, sizeof(sc));
    k->hc_c.scale = pc;
    k->hc_g.scale = pg;
    free(fn);
    free(base);
}

static void
make_hc_case(struct kase *k)
{
    int nD = HC_N * D_MODEL;
    float *comb;
    uint16_t *nw = host_norm_w(D_MODEL);

    memset(k, 0, sizeof(*k));
    make_hc_w(k, (2 + HC_N) * HC_N);
    k->name = "hc_post_pre";
    k->kind = K_HC;
    arr_make(&k->a[0], "X_out", (size_t)T_MAX * nD * 4, NULL);
    arr_make(&k->a[1], "x", (size_t)T_MAX * D_MODEL * 4, NULL);
    arr_make(&k->a[2], "post", (size_t)T_MAX * HC_N * 4, host_vals((size_t)T_MAX * HC_N, 2.0f,
                                                                    0, 1, 0));
    comb = host_vals((size_t)T_MAX * HC_N * HC_N, 0.5f, 0, 1, 0);
    arr_make(&k->a[3], "comb", (size_t)T_MAX * HC_N * HC_N * 4, comb);
    arr_make(&k->a[4], "xn", (size_t)T_MAX * D_MODEL * 4, NULL);
    arr_make(&k->a[5], "f", (size_t)T_MAX * D_MODEL * 4, host_vals((size_t)T_MAX * D_MODEL,
                                                                   1.0f, 1, 0, 0));
    arr_make(&k->a[6], "X", (size_t)T_MAX * nD * 4, host_vals((size_t)T_MAX * nD, 1.0f, 1, 0,
                                                              0));
    k->n = 7;
    arr_out(&k->a[0], nD, 1, 0, 1.0, 0);
    arr_out(&k->a[1], D_MODEL, 1, 0x1p-7, 0.90, 0);
    arr_out(&k->a[2], HC_N, 1, 0x1p-12, 0.0, 0x1p-20);
    arr_out(&k->a[3], HC_N * HC_N, 1, 0x1p-12, 0.0, 0x1p-20);
    arr_out(&k->a[4], D_MODEL, 1, 0x1p-7, 0.90, 0);
    both_upload((void **)&k->nw_c, (void **)&k->nw_g, nw, (size_t)D_MODEL * 2);
    free(nw);
}

/* hc_pre (head == 0) or hc_head alone on X of T_MAX tokens. */
static void
make_pre_case(struct kase *k, const char *name, int head)
{
    int nD = HC_N * D_MODEL, i = 0;

    memset(k, 0, sizeof(*k));
    k->name = name;
    k->kind = head ? K_HEAD : K_PRE;
    arr_make(&k->a[i], "x", (size_t)T_MAX * D_MODEL * 4, NULL);
    arr_out(&k->a[i++], D_MODEL, 1, 0x1p-7, 0.90, 0);
    if (!head) {
        arr_make(&k->a[i], "post", (size_t)T_MAX * HC_N * 4, NULL);
        arr_out(&k->a[i++], HC_N, 1, 0x1p-12, 0.0, 0x1p-20);
        arr_make(&k->a[i], "comb", (size_t)T_MAX * HC_N * HC_N * 4, NULL);
        arr_out(&k->a[i++], HC_N * HC_N, 1, 0x1p-12, 0.0, 0x1p-20);
    }
    arr_make(&k->a[i++], "X", (size_t)T_MAX * nD * 4,
             host_vals((size_t)T_MAX * nD, 1.0f, 1, 0, 0));
    k->n = i;
    make_hc_w(k, head ? HC_N : (2 + HC_N) * HC_N);
}

/* The fast rms_norm alone: T rows of D_MODEL, weighted, out of place. */
static void
make_norm_case(struct kase *k)
{
    uint16_t *w = host_norm_w(D_MODEL);
    size_t n = (size_t)T_MAX * D_MODEL;

    memset(k, 0, sizeof(*k));
    k->name = "rms_norm";
    k->kind = K_NORM;
    arr_make(&k->a[0], "out", n * 4, NULL);
    arr_out(&k->a[0], D_MODEL, 1, 0x1p-7, 0.90, 0);
    arr_make(&k->a[1], "x", n * 4, host_vals(n, 3.0f, 0, 0, 0));
    k->n = 2;
    both_upload((void **)&k->nw_c, (void **)&k->nw_g, w, (size_t)D_MODEL * 2);
    free(w);
}

/* A norm_rope case: rows of D per token (heads of them), RoPE of the last
 * RD, FP8 sim of the first sim_cols, a pool scatter when dst. */
static void
make_nr_case(struct kase *k, const char *name, int D, int heads, int with_w, int sim_cols,
             int with_dst)
{
    int32_t pos[T_MAX], rows[T_MAX * HEADS];
    size_t n = (size_t)T_MAX * heads * D;

    memset(k, 0, sizeof(*k));
    k->name = name;
    k->kind = K_NR;
    k->D = D;
    k->heads = heads;
    k->off = D - RD;
    k->rd = RD;
    k->sim_cols = sim_cols;
    k->with_w = with_w;
    k->with_dst = with_dst;
    for (int i = 0; i < RD / 2; i++)   /* CSA-like: θ = 160000, some divided by 16 */
        k->freqs[i] = (float)(pow(160000.0, -2.0 * i / RD) / (i >= 25 ? 16.0 : 1.0));
    for (int t = 0; t < T_MAX; t++)
        pos[t] = (int32_t)(rng_next() % 70000);
    /* pool rows: a shuffle of 0 .. POOL_ROWS-1, the first T_MAX used */
    for (int i = 0; i < POOL_ROWS && i < T_MAX * HEADS; i++)
        rows[i] = i;
    for (int i = POOL_ROWS - 1; i > 0; i--) {
        int j = (int)(rng_next() % (uint64_t)(i + 1)), tmp = rows[i];

        rows[i] = rows[j];
        rows[j] = tmp;
    }
    both_upload((void **)&k->pos_c, (void **)&k->pos_g, pos, sizeof(pos));
    both_upload((void **)&k->rows_c, (void **)&k->rows_g, rows, POOL_ROWS * sizeof(int32_t));
    if (with_w) {
        uint16_t *w = host_norm_w(D);

        both_upload((void **)&k->nw_c, (void **)&k->nw_g, w, (size_t)D * 2);
        free(w);
    }
    /* x not bf16-valued (the norm rounds it), scaled like a linear's output */
    arr_make(&k->a[0], "x", n * 4, host_vals(n, 3.0f, 0, 0, 0));
    arr_out(&k->a[0], D, heads, sim_cols > 0 ? 0x1p-3 : 0x1p-7, sim_cols > 0 ? 0.80 : 0.90, 0);
    k->n = 1;
    if (with_dst) {
        float *pool = host_vals((size_t)POOL_ROWS * D, 1.0f, 1, 0, 0);

        arr_make(&k->a[1], "pool", (size_t)POOL_ROWS * D * 4, pool);
        arr_out(&k->a[1], 0, 1, 0x1p-3, 0.80, 0);
        k->n = 2;
    }
}

/* nr_qkv: the attention's norm_rope2, the per-head q (nr_q's rows, a[0])
 * with the window KV (nr_kv's rows, a[1]) in one call. */
static void
make_qkv_case(struct kase *k)
{
    size_t n = (size_t)T_MAX * HEAD_DIM;
    uint16_t *w = host_norm_w(HEAD_DIM);

    make_nr_case(k, "nr_qkv", HEAD_DIM, HEADS, 0, 0, 0);
    k->kind = K_QKV;
    k->sim_cols = NOPE;
    both_upload((void **)&k->nw_c, (void **)&k->nw_g, w, (size_t)HEAD_DIM * 2);
    free(w);
    arr_make(&k->a[1], "kv", n * 4, host_vals(n, 3.0f, 0, 0, 0));
    arr_out(&k->a[1], HEAD_DIM, 1, 0x1p-3, 0.80, 0);
    k->n = 2;
}

static void
make_comp_case(struct kase *k, const char *name, int r)
{
    int c = r == 4 ? 2 : 1, d = HEAD_DIM;
    size_t per_slot = (size_t)c * r * c * d;

    memset(k, 0, sizeof(*k));
    k->name = name;
    k->kind = K_COMP;
    k->r = r;
    arr_make(&k->a[0], "entry", (size_t)T_MAX * d * 4, NULL);
    arr_make(&k->a[1], "kv", (size_t)T_MAX * per_slot * 4,
             host_vals((size_t)T_MAX * per_slot, 1.0f, 0, 0, 0));
    arr_make(&k->a[2], "z", (size_t)T_MAX * per_slot * 4,
             host_vals((size_t)T_MAX * per_slot, 1.0f, 0, 0, 0));
    arr_make(&k->a[3], "a", (size_t)T_MAX * c * d * 4,
             host_vals((size_t)T_MAX * c * d, 1.0f, 0, 0, 0));
    arr_make(&k->a[4], "zin", (size_t)T_MAX * c * d * 4,
             host_vals((size_t)T_MAX * c * d, 1.0f, 0, 0, 0));
    arr_make(&k->a[5], "ape", (size_t)r * c * d * 4, host_vals((size_t)r * c * d, 0.5f, 0, 0, 0));
    for (int i = 6; i < 9; i++) {
        int32_t *h = calloc(T_MAX, sizeof(int32_t));

        if (h == NULL)
            exit(1);
        arr_make(&k->a[i], i == 6 ? "slot" : i == 7 ? "pos" : "emit", T_MAX * sizeof(int32_t),
                 h);
        k->a[i].is_int = 1;
    }
    k->n = 9;
    k->slot_h = malloc(T_MAX * sizeof(int32_t));
    k->cpos_h = malloc(T_MAX * sizeof(int32_t));
    k->emit_h = malloc(T_MAX * sizeof(int32_t));
    if (k->slot_h == NULL || k->cpos_h == NULL || k->emit_h == NULL)
        exit(1);
    /* entries of non-emitting rows stay NaN on every path: compare them all */
    arr_out(&k->a[0], d, 1, 0x1p-12, 0.0, 0x1p-20);
    arr_out(&k->a[1], 0, 1, 0, 1.0, 0);
    arr_out(&k->a[2], 0, 1, 0, 1.0, 0);
}

int
main(int argc, char **argv)
{
    struct dsv4_cuda_timer *tm;
    static struct kase ks[16];
    int fails = 0, n_k = 0;
    const char *only = getenv("BENCH_FUSE_ONLY");

    rng_state = argc > 1 ? strtoull(argv[1], NULL, 10) : 20261202ull;
    {
        /* skip only without a device (NOTSUP); any other failure fails */
        enum dsv4_err e = dsv4_backend_create(&gpu, "cuda", DSV4_NUMERICS_REF, 0);

        if (e == DSV4_ERR_NOTSUP) {
            printf("skip: no CUDA backend (%s)\n", dsv4_errmsg());
            return 77;
        }
        TRY("cuda backend", e);
    }
    TRY("cpu backend", dsv4_backend_create(&cpu, "cpu", DSV4_NUMERICS_REF, 0));
    tm = dsv4_cuda_timer_create(gpu);
    if (tm == NULL) {
        fprintf(stderr, "timer: %s\n", dsv4_errmsg());
        return 1;
    }
    printf("bench_fuse: seed %llu; checks: exact == cpu, fused == composed (fast), fast vs "
           "exact (bound, min identical share), determinism, T-independence; us per call "
           "(graphs of %d calls, median of %d)\n",
           (unsigned long long)(argc > 1 ? strtoull(argv[1], NULL, 10) : 20261202ull),
           GRAPH_REPS, N_TIMED);
    make_hc_case(&ks[n_k++]);
    make_nr_case(&ks[n_k++], "nr_q", HEAD_DIM, HEADS, 0, 0, 0);
    make_nr_case(&ks[n_k++], "nr_kv", HEAD_DIM, 1, 1, NOPE, 0);
    make_nr_case(&ks[n_k++], "nr_ent", HEAD_DIM, 1, 1, NOPE, 1);
    make_nr_case(&ks[n_k++], "nr_pair", HEAD_DIM, 1, 1, NOPE, 1);
    ks[n_k - 1].pair = 1;
    make_qkv_case(&ks[n_k++]);
    make_nr_case(&ks[n_k++], "nr_idx", IDX_DIM, 1, 1, 0, 0);
    make_comp_case(&ks[n_k++], "comp4c", 4);
    make_comp_case(&ks[n_k++], "comp128c", 128);
    make_pre_case(&ks[n_k++], "hc_pre", 0);
    make_pre_case(&ks[n_k++], "hc_head", 1);
    make_norm_case(&ks[n_k++]);
    for (int i = 0; i < n_k; i++)
        if (only == NULL || strcmp(only, ks[i].name) == 0)
            fails += kase_all(tm, &ks[i]);
    dsv4_cuda_set_small_kernels(-1);
    printf("%s bench_fuse: %d case lines failed\n", fails ? "FAIL" : "PASS", fails);
    dsv4_cuda_timer_destroy(tm);
    dsv4_backend_destroy(cpu);
    dsv4_backend_destroy(gpu);
    return fails ? 1 : 0;
}
