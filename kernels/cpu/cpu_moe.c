/*
 * cpu_moe.c — router (learned and hash) and the routed + shared experts
 * (model doc §3.4).
 *
 * router: logits = x · gate^T in fp32 (cpu_linear with DSV4_LIN_F32_OUT; the
 *   gate must be BF16), s = sqrtf(softplus(l)) with torch's softplus
 *   (l > 20 ? l : log1pf(expf(l))).  ids = tid2eid[token] (int64 -> int32;
 *   the table is (V, k)) or the k best of s + bias (bias may be NULL), best
 *   first, ties to the lower expert id.  weights = (s[id] / Σ_j s[ids_j]) * route_scale, the sum taken
 *   over j in order; HF numerics divide by (Σ + 1e-20) as transformers does.
 *   Otherwise identical in both modes.
 *
 * moe: tokens are grouped per expert ("units": experts in id order with their
 *   tokens in order, then the shared expert with every token).  Per unit:
 *   g = linear(w1, x), u = linear(w3, x) (cpu_linear numerics, bf16 outputs),
 *   with limit L > 0: g = min(g, L), u = clamp(u, ±L); h = bf16(silu(g) * u
 *   [* weight]) with silu(g) = g / (1 + expf(-g)); y = linear(w2, h) -> bf16.
 *   out[t] = bf16(Σ routed y in increasing expert id order, then + shared y),
 *   accumulated in fp32 as the reference does (y = 0; y[idx] += expert(...)
 *   expert by expert; y += shared(x)).
 *   Three parallel phases: (unit, I-tile, token-tile) for w1/w3/SwiGLU,
 *   (unit, D-tile, token-tile) for w2 (after the FP8 quantization of h under
 *   REF numerics), tokens for the sum.  All experts (routed and shared) must
 *   share D and the intermediate size I.
 *
 * moe_parts / moe_combine (expert parallelism, backend.h): the same units
 *   for the experts held here only; instead of the sum, each pick's y row is
 *   copied to its place in the parts array (zero for picks not held).
 *   moe_combine is the sum phase over such an array.
 */
#include "kernels/cpu/cpu.h"

#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/formats.h"

#define MOE_TB 64              /* token rows per work item */
#define MOE_MAX_K 64   /* experts per token supported */

/* --- router ---------------------------------------------------------------------------- */

static inline float
sqrt_softplus(float l)
{
    return sqrtf(l > 20.0f ? l : cpu_log1pf(cpu_expf(l)));
}

enum dsv4_err
cpu_router(struct dsv4_backend *be, float *weights, int32_t *ids, const float *x,
           const struct dsv4_linear *gate, const float *bias, const int64_t *tid2eid,
           const int32_t *tokens, int T, int k, float route_scale)
{
    int E = gate->n_out;
    float *s;
    enum dsv4_err e;

    if (gate->fmt != DSV4_WFMT_BF16 || k < 1 || k > E || k > MOE_MAX_K)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu router: gate fmt %d, k=%d, E=%d",
                            (int)gate->fmt, k, E);
    if (T <= 0)
        return DSV4_OK;
    s = malloc((size_t)T * E * sizeof(float));
    if (s == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu router: no memory");
    e = cpu_linear(be, s, x, gate, T, DSV4_LIN_F32_OUT);
    if (e != DSV4_OK) {
        free(s);
        return e;
    }
    for (int t = 0; t < T; t++) {
        float *st = s + (int64_t)t * E;
        int32_t *id = ids + (int64_t)t * k;
        float *wt = weights + (int64_t)t * k;
        float sum = 0.0f;

        for (int i = 0; i < E; i++)
            st[i] = sqrt_softplus(st[i]);
        if (tid2eid != NULL) {
            for (int j = 0; j < k; j++) {
                id[j] = (int32_t)tid2eid[(int64_t)tokens[t] * k + j];
                assert(id[j] >= 0 && id[j] < E);
            }
        } else {
            /* insertion into the sorted best-k list; strict '>' keeps the
             * lower id first on ties */
            float best[MOE_MAX_K];
            int n = 0;

            for (int i = 0; i < E; i++) {
                float v = st[i] + (bias != NULL ? bias[i] : 0.0f);
                int at = n;

                while (at > 0 && v > best[at - 1])
                    at--;
                if (at >= k)
                    continue;
                for (int m = (n < k ? n : k - 1); m > at; m--) {
                    best[m] = best[m - 1];
                    id[m] = id[m - 1];
                }
                best[at] = v;
                id[at] = i;
                if (n < k)
                    n++;
            }
        }
        for (int j = 0; j < k; j++)
            sum += st[id[j]];
        if (be->numerics == DSV4_NUMERICS_HF)
            sum += 1e-20f;
        for (int j = 0; j < k; j++)
            wt[j] = st[id[j]] / sum * route_scale;
    }
    free(s);
    return DSV4_OK;
}

/* --- moe -------------------------------------------------------------------------------------- */

/* One expert applied to a list of token rows. */
struct moe_unit {
    const struct dsv4_expert_w *w;
    const int32_t *tok;      /* (n) token rows of x */
    const float *wt;         /* (n) routing weights, NULL for the shared expert */
    int n;
    int64_t row0;            /* first row of this unit in H and Y */
    int64_t item0[2];        /* first work item of this unit, per phase */
};

struct moe_job {
    const struct moe_unit *units;
    int n_units;
    int D, I;
    float lim;
    struct cpu_lin_src xs_raw, xs_q;   /* x as given / FP8-quantized */
    struct cpu_lin_src hs_raw, hs_q;   /* H as given / FP8-quantized */
    float *H;                          /* (rows, I) SwiGLU outputs */
    float *Y;                          /* (rows, D) expert outputs */
    float *wbuf;                       /* (n_threads, 2, NB * max(D, I)) */
    float *gu;                         /* (n_threads, 2, MOE_TB * NB) */
    int64_t n_items[2];
    /* phase 3 */
    float *out;
    const int32_t *ids;
    const int64_t *yrow;               /* (T, k) rows of Y per routed pick;
                                          NULL: row t*k + j */
    int64_t shared_row0;               /* -1 without shared expert */
    int k;
};

static const struct cpu_lin_src *
moe_src(const struct cpu_lin_src *raw, const struct cpu_lin_src *q, enum dsv4_wfmt fmt)
{
    return fmt == DSV4_WFMT_BF16 || q->sx == NULL ? raw : q;
}

/* The unit holding work item `it` of phase `ph` (binary search). */
static int
moe_unit_of(const struct moe_job *j, int64_t it, int ph)
{
    int lo = 0, hi = j->n_units - 1;

    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;

        if (j->units[mid].item0[ph] <= it)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Work item `it` of phase `ph`: its unit, output tile [n0, n1) of `N`
 * outputs, token tile [t0, t1) and a key naming the (unit, n-tile). */
struct moe_item {
    const struct moe_unit *un;
    int n0, n1, t0, t1;
    int64_t tile;
};

static struct moe_item
moe_item_at(const struct moe_job *j, int64_t it, int ph, int N)
{
    struct moe_item m;
    int n_tt;
    int64_t rel;

    m.un = &j->units[moe_unit_of(j, it, ph)];
    n_tt = (m.un->n + MOE_TB - 1) / MOE_TB;
    rel = it - m.un->item0[ph];
    m.n0 = (int)(rel / n_tt) * CPU_LIN_NB;
    m.n1 = m.n0 + CPU_LIN_NB < N ? m.n0 + CPU_LIN_NB : N;
    m.t0 = (int)(rel % n_tt) * MOE_TB;
    m.t1 = m.t0 + MOE_TB < m.un->n ? m.t0 + MOE_TB : m.un->n;
    m.tile = m.un->item0[ph] + rel / n_tt;
    return m;
}

static void
moe_up_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct moe_job *j = ctx;
    size_t wsz = CPU_LIN_WBUF(j->D > j->I ? j->D : j->I);
    float *w1 = j->wbuf + (int64_t)tid * 2 * wsz, *w3 = w1 + wsz;
    float *g = j->gu + (int64_t)tid * 2 * MOE_TB * CPU_LIN_NB, *u = g + MOE_TB * CPU_LIN_NB;
    int64_t decoded = -1;

    for (int64_t it = begin; it < end; it++) {
        struct moe_item m = moe_item_at(j, it, 0, j->I);
        const struct moe_unit *un = m.un;
        int nn = m.n1 - m.n0;

        if (m.tile != decoded) {
            cpu_lin_decode(w1, &un->w->w1, m.n0, m.n1);
            cpu_lin_decode(w3, &un->w->w3, m.n0, m.n1);
            decoded = m.tile;
        }
        cpu_lin_rows(g, nn, moe_src(&j->xs_raw, &j->xs_q, un->w->w1.fmt), un->tok + m.t0,
                     m.t1 - m.t0, w1, m.n0, m.n1, 1);
        cpu_lin_rows(u, nn, moe_src(&j->xs_raw, &j->xs_q, un->w->w3.fmt), un->tok + m.t0,
                     m.t1 - m.t0, w3, m.n0, m.n1, 1);
        for (int i = 0; i < m.t1 - m.t0; i++) {
            float *h = j->H + (un->row0 + m.t0 + i) * j->I;

            for (int c = 0; c < nn; c++) {
                float gv = g[i * nn + c], uv = u[i * nn + c], v;

                if (j->lim > 0.0f) {
                    gv = gv < j->lim ? gv : j->lim;
                    uv = uv < -j->lim ? -j->lim : uv > j->lim ? j->lim : uv;
                }
                v = gv / (1.0f + cpu_expf(-gv)) * uv;
                if (un->wt != NULL)
                    v *= un->wt[m.t0 + i];
                h[m.n0 + c] = dsv4_bf16_round(v);
            }
        }
    }
}

static void
moe_down_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct moe_job *j = ctx;
    size_t wsz = CPU_LIN_WBUF(j->D > j->I ? j->D : j->I);
    float *w2 = j->wbuf + (int64_t)tid * 2 * wsz;
    int64_t decoded = -1;

    for (int64_t it = begin; it < end; it++) {
        struct moe_item m = moe_item_at(j, it, 1, j->D);
        struct cpu_lin_src hs;

        if (m.tile != decoded) {
            cpu_lin_decode(w2, &m.un->w->w2, m.n0, m.n1);
            decoded = m.tile;
        }
        hs = cpu_lin_src_at(moe_src(&j->hs_raw, &j->hs_q, m.un->w->w2.fmt),
                            m.un->row0 + m.t0);
        cpu_lin_rows(j->Y + (m.un->row0 + m.t0) * j->D + m.n0, j->D, &hs, NULL, m.t1 - m.t0,
                     w2, m.n0, m.n1, 1);
    }
}

static void
moe_sum_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct moe_job *j = ctx;
    int k = j->k, D = j->D;

    (void)tid;
    for (int64_t t = begin; t < end; t++) {
        const int32_t *id = j->ids + t * k;
        float *o = j->out + t * D;
        int order[MOE_MAX_K];

        /* picks by increasing expert id (stable) */
        for (int a = 0; a < k; a++) {
            int at = a;

            while (at > 0 && id[order[at - 1]] > id[a]) {
                order[at] = order[at - 1];
                at--;
            }
            order[at] = a;
        }
        for (int i = 0; i < D; i++)
            o[i] = 0.0f;
        for (int a = 0; a < k; a++) {
            int64_t r = t * k + order[a];
            const float *y = j->Y + (j->yrow != NULL ? j->yrow[r] : r) * D;

            for (int i = 0; i < D; i++)
                o[i] += y[i];
        }
        if (j->shared_row0 >= 0) {
            const float *y = j->Y + (j->shared_row0 + t) * D;

            for (int i = 0; i < D; i++)
                o[i] += y[i];
        }
        for (int i = 0; i < D; i++)
            o[i] = dsv4_bf16_round(o[i]);
    }
}

static int
moe_expert_ok(const struct dsv4_expert_w *w, int D, int I)
{
    return w->w1.n_in == D && w->w3.n_in == D && w->w1.n_out == I && w->w3.n_out == I &&
           w->w2.n_in == I && w->w2.n_out == D;
}

/* Whether expert w is held here (its weights are present). */
static int
moe_held(const struct dsv4_expert_w *w)
{
    return w != NULL && w->w1.w != NULL;
}

/*
 * moe (parts == NULL) or moe_parts (parts: (T*k + T, D), D given; experts
 * not held give zero rows).
 */
static enum dsv4_err
moe_run(struct dsv4_backend *be, float *out, float *parts, const float *x, const int32_t *ids,
        const float *weights, const struct dsv4_expert_w *experts,
        const struct dsv4_expert_w *shared, int T, int k, int D_parts, float swiglu_limit)
{
    struct moe_job j = { 0 };
    struct moe_unit *units = NULL;
    int32_t *cnt = NULL, *tok = NULL;
    float *wts = NULL, *xbuf = NULL, *hbuf = NULL;
    int64_t *yrow = NULL, rows;
    int E = 0, nthr = cpu_threads(be), nu = 0;
    enum dsv4_err e = DSV4_OK;
    const struct dsv4_expert_w *any;
    enum dsv4_wfmt qfmt[2] = { DSV4_WFMT_BF16, DSV4_WFMT_BF16 };

    if (T <= 0)
        return DSV4_OK;
    if (k < 0 || k > MOE_MAX_K)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu moe: k=%d", k);
    for (int64_t i = 0; i < (int64_t)T * k; i++) {
        assert(ids[i] >= 0);
        E = ids[i] + 1 > E ? ids[i] + 1 : E;
    }
    if (parts != NULL) {
        /* only what is held here; zero rows for the rest */
        if (!moe_held(shared))
            shared = NULL;
        any = shared;
        for (int64_t i = 0; i < (int64_t)T * k && any == NULL; i++)
            if (moe_held(&experts[ids[i]]))
                any = &experts[ids[i]];
        memset(parts, 0, ((size_t)T * k + T) * D_parts * sizeof(float));
        if (any == NULL)
            return DSV4_OK;
        if (any->w1.n_in != D_parts)
            return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu moe_parts: experts have D=%d, not %d",
                                any->w1.n_in, D_parts);
    } else {
        any = k > 0 ? &experts[ids[0]] : shared;
    }
    if (any == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu moe: no expert at all (k=0, no shared)");
    j.D = any->w1.n_in;
    j.I = any->w1.n_out;
    for (int i = 0; i < (int64_t)T * k; i++)
        if ((parts == NULL || moe_held(&experts[ids[i]])) &&
            !moe_expert_ok(&experts[ids[i]], j.D, j.I))
            return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu moe: expert %d shape differs", ids[i]);
    if (shared != NULL && !moe_expert_ok(shared, j.D, j.I))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu moe: shared expert shape differs");

    /* group the picks per expert (counting sort, tokens in order) */
    rows = (int64_t)T * k + (shared != NULL ? T : 0);
    cnt = calloc((size_t)E + 1, sizeof(*cnt));
    tok = malloc((size_t)rows * sizeof(*tok));
    wts = malloc((size_t)T * k * sizeof(*wts) + 1);
    yrow = malloc((size_t)T * k * sizeof(*yrow) + 1);
    units = calloc((size_t)E + 1, sizeof(*units));
    if (cnt == NULL || tok == NULL || wts == NULL || yrow == NULL || units == NULL)
        goto nomem;
    for (int64_t i = 0; i < (int64_t)T * k; i++)
        cnt[ids[i] + 1]++;
    for (int ex = 0; ex < E; ex++)
        cnt[ex + 1] += cnt[ex];
    for (int t = 0; t < T; t++) {
        for (int a = 0; a < k; a++) {
            int ex = ids[t * k + a];
            int64_t r = cnt[ex]++;

            tok[r] = t;
            wts[r] = weights[t * k + a];
            yrow[t * k + a] = r;
        }
    }
    /* cnt[ex] is now the end of expert ex's rows */
    for (int ex = 0; ex < E; ex++) {
        int64_t r0 = ex > 0 ? cnt[ex - 1] : 0;

        if (cnt[ex] == r0 || (parts != NULL && !moe_held(&experts[ex])))
            continue;
        units[nu].w = &experts[ex];
        units[nu].tok = tok + r0;
        units[nu].wt = wts + r0;
        units[nu].n = (int)(cnt[ex] - r0);
        units[nu].row0 = r0;
        nu++;
    }
    j.shared_row0 = -1;
    if (shared != NULL) {
        int64_t r0 = (int64_t)T * k;

        for (int t = 0; t < T; t++)
            tok[r0 + t] = t;
        units[nu].w = shared;
        units[nu].tok = tok + r0;
        units[nu].wt = NULL;
        units[nu].n = T;
        units[nu].row0 = r0;
        j.shared_row0 = r0;
        nu++;
    }
    for (int ph = 0; ph < 2; ph++) {
        int64_t items = 0;

        for (int u = 0; u < nu; u++) {
            int nn = ph == 0 ? j.I : j.D;

            units[u].item0[ph] = items;
            items += (int64_t)((nn + CPU_LIN_NB - 1) / CPU_LIN_NB) *
                     ((units[u].n + MOE_TB - 1) / MOE_TB);
        }
        j.n_items[ph] = items;
    }
    j.units = units;
    j.n_units = nu;
    j.lim = swiglu_limit;
    j.k = k;
    j.ids = ids;
    j.yrow = yrow;
    j.out = out;

    /* activations: raw and (REF, when a weight is FP8/FP4) FP8-quantized */
    for (int u = 0; u < nu; u++) {
        if (units[u].w->w1.fmt != DSV4_WFMT_BF16 || units[u].w->w3.fmt != DSV4_WFMT_BF16)
            qfmt[0] = DSV4_WFMT_FP8;
        if (units[u].w->w2.fmt != DSV4_WFMT_BF16)
            qfmt[1] = DSV4_WFMT_FP8;
    }
    e = cpu_lin_prepare(be, &j.xs_q, &xbuf, x, j.D, T, j.D, qfmt[0]);
    if (e != DSV4_OK)
        goto out;
    j.xs_raw = (struct cpu_lin_src){ x, NULL, j.D, j.D };
    j.H = malloc((size_t)rows * (j.I + j.D) * sizeof(float));
    j.wbuf = malloc((size_t)nthr * 2 * CPU_LIN_WBUF(j.D > j.I ? j.D : j.I) * sizeof(float));
    j.gu = malloc((size_t)nthr * 2 * MOE_TB * CPU_LIN_NB * sizeof(float));
    if (j.H == NULL || j.wbuf == NULL || j.gu == NULL)
        goto nomem;
    j.Y = j.H + rows * j.I;
    cpu_parallel_for(be, j.n_items[0], 1, moe_up_task, &j);
    e = cpu_lin_prepare(be, &j.hs_q, &hbuf, j.H, j.I, (int)rows, j.I, qfmt[1]);
    if (e != DSV4_OK)
        goto out;
    j.hs_raw = (struct cpu_lin_src){ j.H, NULL, j.I, j.I };
    cpu_parallel_for(be, j.n_items[1], 1, moe_down_task, &j);
    if (parts == NULL) {
        cpu_parallel_for(be, T, 1, moe_sum_task, &j);
        goto out;
    }
    for (int64_t i = 0; i < (int64_t)T * k; i++)
        if (moe_held(&experts[ids[i]]))
            memcpy(parts + i * j.D, j.Y + yrow[i] * j.D, (size_t)j.D * sizeof(float));
    if (shared != NULL)
        memcpy(parts + (int64_t)T * k * j.D, j.Y + j.shared_row0 * j.D,
               (size_t)T * j.D * sizeof(float));
    goto out;
nomem:
    e = dsv4_err_set(DSV4_ERR_NOMEM, "cpu moe: no memory (T=%d k=%d)", T, k);
out:
    free(j.H);
    free(j.wbuf);
    free(j.gu);
    free(xbuf);
    free(hbuf);
    free(units);
    free(cnt);
    free(tok);
    free(wts);
    free(yrow);
    return e;
}

enum dsv4_err
cpu_moe(struct dsv4_backend *be, float *out, const float *x, const int32_t *ids,
        const float *weights, const struct dsv4_expert_w *experts,
        const struct dsv4_expert_w *shared, int T, int k, float swiglu_limit)
{
    return moe_run(be, out, NULL, x, ids, weights, experts, shared, T, k, 0, swiglu_limit);
}

enum dsv4_err
cpu_moe_parts(struct dsv4_backend *be, float *y, const float *x, const int32_t *ids,
              const float *weights, const struct dsv4_expert_w *experts,
              const struct dsv4_expert_w *shared, int T, int k, int D, float swiglu_limit)
{
    if (T <= 0)
        return DSV4_OK;
    if (k < 0 || k > MOE_MAX_K || D <= 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu moe_parts: k=%d D=%d", k, D);
    return moe_run(be, NULL, y, x, ids, weights, experts, shared, T, k, D, swiglu_limit);
}

enum dsv4_err
cpu_moe_combine(struct dsv4_backend *be, float *out, const float *y, const int32_t *ids, int T,
                int k, int D)
{
    struct moe_job j = { 0 };

    if (T <= 0)
        return DSV4_OK;
    if (k < 0 || k > MOE_MAX_K)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu moe_combine: k=%d", k);
    j.Y = (float *)(uintptr_t)y;   /* the sum phase only reads Y */
    j.D = D;
    j.k = k;
    j.ids = ids;
    j.yrow = NULL;
    j.shared_row0 = (int64_t)T * k;
    j.out = out;
    cpu_parallel_for(be, T, 1, moe_sum_task, &j);
    return DSV4_OK;
}
