/*
 * cpu_attn.c — the attention-side ops: streaming compressor, indexer scores
 * with top-k, and sparse attention with sink (model doc §3.3.4-§3.3.6).
 *
 * compress: the "Streaming form" of model doc §3.3.4.  State pools are
 *   (n_slots, c*r, c*d) fp32.  The caller must initialise a fresh slot's
 *   state with fill: kv = 0 and z = -inf (with overlap, r == 4, the
 *   previous-window slots of the first window must weigh nothing).  Row t at
 *   position p writes slot j = p % r (overlap: r + j) with a[t] and
 *   z[t] + ape[j] (fp32 add).  When emit[t] >= 0 — allowed only where the
 *   window completes, (p + 1) % r == 0 — each channel ch gets
 *   E[ch] = Σ_k (e_k / Σ e) v_k over the slots k in order, e_k =
 *   expf(l_k - max l), where with overlap slots [0, r) contribute column ch
 *   (first halves of the previous window) and slots [r, 2r) column d + ch
 *   (second halves of the current window).  After a completed window with
 *   overlap, slots [r, 2r) are copied to [0, r).  The entry is the raw fp32
 *   sum; norm, RoPE and quantization simulation are the caller's.  Every
 *   step is per channel, so the work is split over channel ranges and each
 *   worker runs the rows in order.
 *
 * indexer_topk: REF numerics compute each head's q·k with cpu_dot and round
 *   it to bf16, then term = bf16(ReLU(dot) * w[h]), and the score is
 *   bf16(Σ_h term) summed in fp32 over heads in order; HF numerics keep fp32
 *   throughout.  Top-k keeps the best K by (score desc, index asc) with a
 *   bounded heap; a row with at most K valid entries takes them all in index
 *   order and is not scored.  Scores are computed in parallel over (row,
 *   64-entry block), top-k in parallel over rows, in row groups that bound
 *   the score buffer.
 *
 * attention: for each (row, head), candidates are the window positions in
 *   ascending order, then the compressed entries (ascending for HCA, in sel
 *   order for CSA).  s_j = cpu_dot(q, K_j) * scale; m = max s_j;
 *   den = Σ_j expf(s_j - m) + expf(sink - m); out = bf16((Σ_j e_j K_j) / den)
 *   with the weighted sum accumulated in fp32 in candidate order.  Work items
 *   are (row, group of 4 heads), which share the candidate loads.
 */
#include "kernels/cpu/cpu.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>

#include "common/formats.h"

/* --- compress ----------------------------------------------------------------------- */

#define COMP_CH_BLOCK 32   /* channels per work item */

struct comp_job {
    float *entries, *state_kv, *state_z;
    const float *a, *z, *ape;
    const int32_t *slot, *pos, *emit;
    int T, r, d, c;
};

static void
comp_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct comp_job *j = ctx;
    int r = j->r, d = j->d, c = j->c;
    int64_t cd = (int64_t)c * d;           /* state row length */
    int64_t pool = (int64_t)c * r * cd;    /* floats per slot */
    int ch0 = (int)begin * COMP_CH_BLOCK;
    int ch1 = (int)end * COMP_CH_BLOCK < d ? (int)end * COMP_CH_BLOCK : d;

    (void)tid;
    for (int t = 0; t < j->T; t++) {
        float *kv = j->state_kv + j->slot[t] * pool;
        float *zs = j->state_z + j->slot[t] * pool;
        int p = j->pos[t], jj = p % r;
        int64_t dst = (int64_t)(c == 2 ? r + jj : jj) * cd;

        for (int h = 0; h < c; h++) {
            for (int ch = ch0; ch < ch1; ch++) {
                int64_t col = (int64_t)h * d + ch;

                kv[dst + col] = j->a[t * cd + col];
                zs[dst + col] = j->z[t * cd + col] + j->ape[jj * cd + col];
            }
        }
        if (j->emit[t] >= 0) {
            float *E = j->entries + (int64_t)j->emit[t] * d;
            int ns = c * r;

            for (int ch = ch0; ch < ch1; ch++) {
                float m = -INFINITY, den = 0.0f, acc = 0.0f;
                float e[256];

                for (int k = 0; k < ns; k++) {
                    int64_t col = (c == 2 && k >= r) ? d + ch : ch;
                    float l = zs[k * cd + col];

                    m = l > m ? l : m;
                }
                for (int k = 0; k < ns; k++) {
                    int64_t col = (c == 2 && k >= r) ? d + ch : ch;

                    e[k] = cpu_expf(zs[k * cd + col] - m);
                    den += e[k];
                }
                for (int k = 0; k < ns; k++) {
                    int64_t col = (c == 2 && k >= r) ? d + ch : ch;

                    acc += (e[k] / den) * kv[k * cd + col];
                }
                E[ch] = acc;
            }
        }
        if (c == 2 && jj == r - 1) {
            for (int k = 0; k < r; k++) {
                for (int h = 0; h < c; h++) {
                    for (int ch = ch0; ch < ch1; ch++) {
                        int64_t col = (int64_t)h * d + ch;

                        kv[k * cd + col] = kv[(r + k) * cd + col];
                        zs[k * cd + col] = zs[(r + k) * cd + col];
                    }
                }
            }
        }
    }
}

enum dsv4_err
cpu_compress(struct dsv4_backend *be, float *entries, float *state_kv, float *state_z,
             const float *a, const float *z, const float *ape, const int32_t *slot,
             const int32_t *pos, const int32_t *emit, int T, int r, int d)
{
    struct comp_job j = { entries, state_kv, state_z, a, z, ape, slot, pos, emit, T, r, d,
                          r == 4 ? 2 : 1 };

    if (r < 1 || j.c * r > 256 || d < 1)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu compress: r=%d d=%d", r, d);
    for (int t = 0; t < T; t++)
        assert(emit[t] < 0 || pos[t] % r == r - 1);
    cpu_parallel_for(be, (d + COMP_CH_BLOCK - 1) / COMP_CH_BLOCK, 1, comp_task, &j);
    return DSV4_OK;
}

/* --- indexer_topk --------------------------------------------------------------------- */

#define IDX_EB 64                    /* entries per scoring work item */
#define IDX_SCORE_BUDGET (1 << 23)   /* scores buffered per row group */

/* a ranks below b: lower score, or equal score and higher index */
static inline int
pick_worse(struct cpu_pick a, struct cpu_pick b)
{
    return a.s < b.s || (a.s == b.s && a.i > b.i);
}

/* Restore the heap (worst at the root) below node i of h[0..n). */
static void
heap_down(struct cpu_pick *h, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, w = i;

        if (l < n && pick_worse(h[l], h[w]))
            w = l;
        if (l + 1 < n && pick_worse(h[l + 1], h[w]))
            w = l + 1;
        if (w == i)
            return;
        struct cpu_pick tmp = h[i];
        h[i] = h[w];
        h[w] = tmp;
        i = w;
    }
}

int
cpu_topk(int32_t *sel, const float *s, int n, int K, struct cpu_pick *heap)
{
    int kk = K < n ? K : n, sz = 0;

    for (int i = 0; i < n; i++) {
        struct cpu_pick c = { isnan(s[i]) ? -INFINITY : s[i], i };

        if (sz < kk) {
            /* sift up */
            int at = sz++;

            heap[at] = c;
            while (at > 0 && pick_worse(heap[at], heap[(at - 1) / 2])) {
                struct cpu_pick tmp = heap[at];
                heap[at] = heap[(at - 1) / 2];
                heap[(at - 1) / 2] = tmp;
                at = (at - 1) / 2;
            }
        } else if (kk > 0 && pick_worse(heap[0], c)) {
            heap[0] = c;
            heap_down(heap, kk, 0);
        }
    }
    /* pop the worst to the back: the array ends best first */
    for (int end = sz - 1; end > 0; end--) {
        struct cpu_pick tmp = heap[0];
        heap[0] = heap[end];
        heap[end] = tmp;
        heap_down(heap, end, 0);
    }
    for (int i = 0; i < sz; i++)
        sel[i] = heap[i].i;
    return sz;
}

struct idx_job {
    int32_t *sel;
    const float *q, *w, *keys;
    const int32_t *pages;      /* page table or NULL (backend.h) */
    const int32_t *slot, *pos;
    int nh, dI, cap, ratio, K;
    int ref;                   /* REF numerics (bf16 roundings) */
    int t0;                    /* first row of the group */
    float *scores;             /* group's scores, row after row */
    const int64_t *off;        /* (rows in group + 1) offsets into scores */
    const int32_t *item_row;   /* scoring items: row in group, entry block */
    const int32_t *item_blk;
    struct cpu_pick *heaps;    /* (n_threads, K) */
};

static int
idx_n_valid(const struct idx_job *j, int t)
{
    return dsv4_n_valid(j->pos[t], j->ratio, j->cap);
}

/* Entries of row t that are scored: every valid one when there are more
 * than K, else none (the row takes them all). */
static int
idx_n_scored(const struct idx_job *j, int t)
{
    int n = idx_n_valid(j, t);

    return n > j->K ? n : 0;
}

static void
idx_score_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct idx_job *j = ctx;

    (void)tid;
    for (int64_t it = begin; it < end; it++) {
        int rr = j->item_row[it], t = j->t0 + rr;
        int nv = idx_n_scored(j, t);
        int e0 = j->item_blk[it] * IDX_EB;
        int e1 = e0 + IDX_EB < nv ? e0 + IDX_EB : nv;
        const float *q = j->q + (int64_t)t * j->nh * j->dI;
        const float *w = j->w + (int64_t)t * j->nh;
        float *out = j->scores + j->off[rr];

        for (int e = e0; e < e1; e++) {
            const float *k =
                j->keys + dsv4_pool_row(j->pages, j->cap, j->slot[t], e) * j->dI;
            float acc = 0.0f;

            for (int h = 0; h < j->nh; h++) {
                float dot = cpu_dot(q + (int64_t)h * j->dI, k, j->dI);

                if (j->ref) {
                    dot = dsv4_bf16_round(dot);
                    acc += dsv4_bf16_round((dot > 0.0f ? dot : 0.0f) * w[h]);
                } else {
                    acc += (dot > 0.0f ? dot : 0.0f) * w[h];
                }
            }
            out[e] = j->ref ? dsv4_bf16_round(acc) : acc;
        }
    }
}

static void
idx_topk_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct idx_job *j = ctx;
    struct cpu_pick *heap = j->heaps + (int64_t)tid * j->K;

    for (int64_t rr = begin; rr < end; rr++) {
        int t = j->t0 + (int)rr;
        int32_t *sel = j->sel + (int64_t)t * j->K;
        int n = idx_n_valid(j, t);

        if (n > j->K) {
            n = cpu_topk(sel, j->scores + j->off[rr], n, j->K, heap);
        } else {
            for (int i = 0; i < n; i++)
                sel[i] = i;
        }
        for (int i = n; i < j->K; i++)
            sel[i] = -1;
    }
}

enum dsv4_err
cpu_indexer_topk(struct dsv4_backend *be, int32_t *sel, const float *q, const float *w,
                 const float *keys, const int32_t *pages, const int32_t *slot, const int32_t *pos, int T, int nh,
                 int dI, int cap, int ratio, int K)
{
    struct idx_job j = { 0 };
    int64_t *off = NULL;
    int32_t *item_row = NULL, *item_blk = NULL;
    enum dsv4_err e = DSV4_OK;
    int t0 = 0;

    if (ratio < 1 || K < 1)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu indexer_topk: ratio=%d K=%d", ratio, K);
    j.sel = sel;
    j.q = q;
    j.w = w;
    j.keys = keys;
    j.pages = pages;
    j.slot = slot;
    j.pos = pos;
    j.nh = nh;
    j.dI = dI;
    j.cap = cap;
    j.ratio = ratio;
    j.K = K;
    j.ref = be->numerics == DSV4_NUMERICS_REF;
    if (q == NULL || w == NULL)
        for (int t = 0; t < T; t++)
            if (idx_n_scored(&j, t) > 0)
                return dsv4_err_set(DSV4_ERR_INVAL, "cpu indexer_topk: row %d has %d valid "
                                    "entries (> K = %d) and no q / w", t, idx_n_valid(&j, t), K);
    j.heaps = malloc((size_t)cpu_threads(be) * K * sizeof(*j.heaps));
    off = malloc(((size_t)T + 1) * sizeof(*off));
    if (j.heaps == NULL || off == NULL)
        goto nomem;
    while (t0 < T) {
        int t1 = t0;
        int64_t n_items = 0, it = 0;

        /* row group: at least one row, scores within the budget */
        off[0] = 0;
        while (t1 < T) {
            int nv = idx_n_scored(&j, t1);

            if (t1 > t0 && off[t1 - t0] + nv > IDX_SCORE_BUDGET)
                break;
            off[t1 - t0 + 1] = off[t1 - t0] + nv;
            n_items += (nv + IDX_EB - 1) / IDX_EB;
            t1++;
        }
        free(j.scores);
        free(item_row);
        free(item_blk);
        j.scores = malloc(((size_t)off[t1 - t0] + 1) * sizeof(float));
        item_row = malloc(((size_t)n_items + 1) * sizeof(int32_t));
        item_blk = malloc(((size_t)n_items + 1) * sizeof(int32_t));
        if (j.scores == NULL || item_row == NULL || item_blk == NULL)
            goto nomem;
        for (int t = t0; t < t1; t++) {
            int nb = (idx_n_scored(&j, t) + IDX_EB - 1) / IDX_EB;

            for (int b = 0; b < nb; b++, it++) {
                item_row[it] = t - t0;
                item_blk[it] = b;
            }
        }
        j.t0 = t0;
        j.off = off;
        j.item_row = item_row;
        j.item_blk = item_blk;
        cpu_parallel_for(be, n_items, 1, idx_score_task, &j);
        cpu_parallel_for(be, t1 - t0, 1, idx_topk_task, &j);
        t0 = t1;
    }
    goto out;
nomem:
    e = dsv4_err_set(DSV4_ERR_NOMEM, "cpu indexer_topk: no memory (T=%d cap=%d)", T, cap);
out:
    free(j.scores);
    free(item_row);
    free(item_blk);
    free(off);
    free(j.heaps);
    return e;
}

/* --- attention ------------------------------------------------------------------------ */

#define ATTN_HG 4   /* heads per work item (cpu_dot4) */

struct attn_job {
    float *out;
    const float *q, *kv, *ring, *comp;
    const int32_t *pages;       /* page table of comp or NULL (backend.h) */
    const int32_t *sel;
    const float *sink;
    const int32_t *slot, *pos, *row0, *pos0;
    int H, Dh, win, cap, ratio, K;
    float scale;
    int max_cand;               /* per-thread scratch capacity */
    const float **cand;         /* (n_threads, max_cand) */
    float *sc;                  /* (n_threads, ATTN_HG, max_cand) */
    float *acc;                 /* (n_threads, ATTN_HG, Dh) */
};

/* Fill cand with row t's key vectors, in candidate order; returns the count. */
static int
attn_candidates(const struct attn_job *j, int t, const float **cand)
{
    int p = j->pos[t], s = j->slot[t], n = 0;
    int u0 = p - j->win + 1 > 0 ? p - j->win + 1 : 0;

    for (int u = u0; u <= p; u++) {
        if (u >= j->pos0[t])
            cand[n++] = j->kv + (int64_t)(j->row0[t] + (u - j->pos0[t])) * j->Dh;
        else
            cand[n++] = j->ring + ((int64_t)s * j->win + u % j->win) * j->Dh;
    }
    if (j->comp != NULL) {
        if (j->sel == NULL) {
            int ne = (p + 1) / j->ratio;

            assert(ne <= j->cap);
            for (int e = 0; e < ne; e++)
                cand[n++] = j->comp + dsv4_pool_row(j->pages, j->cap, s, e) * j->Dh;
        } else {
            const int32_t *sl = j->sel + (int64_t)t * j->K;

            for (int i = 0; i < j->K; i++) {
                assert(sl[i] < j->cap);
                if (sl[i] >= 0)
                    cand[n++] = j->comp + dsv4_pool_row(j->pages, j->cap, s, sl[i]) * j->Dh;
            }
        }
    }
    return n;
}

static void
attn_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct attn_job *j = ctx;
    const float **cand = j->cand + (int64_t)tid * j->max_cand;
    float *sc = j->sc + (int64_t)tid * ATTN_HG * j->max_cand;
    float *acc = j->acc + (int64_t)tid * ATTN_HG * j->Dh;
    int Dh = j->Dh, n_hg = (j->H + ATTN_HG - 1) / ATTN_HG;

    for (int64_t it = begin; it < end; it++) {
        int t = (int)(it / n_hg), h0 = (int)(it % n_hg) * ATTN_HG;
        int nh = j->H - h0 < ATTN_HG ? j->H - h0 : ATTN_HG;
        const float *q[ATTN_HG];
        float m[ATTN_HG], den[ATTN_HG], d[ATTN_HG];
        int n = attn_candidates(j, t, cand);

        /* a group of heads shares every candidate load; a missing head
         * repeats the group's first and is discarded */
        for (int g = 0; g < ATTN_HG; g++) {
            q[g] = j->q + ((int64_t)t * j->H + h0 + (g < nh ? g : 0)) * Dh;
            m[g] = -INFINITY;
            den[g] = 0.0f;
        }
        for (int c = 0; c < n; c++) {
            cpu_dot4(d, cand[c], q[0], q[1], q[2], q[3], Dh);
            for (int g = 0; g < ATTN_HG; g++) {
                float v = d[g] * j->scale;

                sc[g * j->max_cand + c] = v;
                m[g] = v > m[g] ? v : m[g];
            }
        }
        for (int i = 0; i < ATTN_HG * Dh; i++)
            acc[i] = 0.0f;
        for (int c = 0; c < n; c++) {
            const float *k = cand[c];
            float e[ATTN_HG];

            for (int g = 0; g < ATTN_HG; g++) {
                e[g] = cpu_expf(sc[g * j->max_cand + c] - m[g]);
                den[g] += e[g];
            }
            for (int i = 0; i < Dh; i++) {
                float kv = k[i];

                acc[i] += e[0] * kv;
                acc[Dh + i] += e[1] * kv;
                acc[2 * Dh + i] += e[2] * kv;
                acc[3 * Dh + i] += e[3] * kv;
            }
        }
        for (int g = 0; g < nh; g++) {
            float *o = j->out + ((int64_t)t * j->H + h0 + g) * Dh;
            float dg = den[g] + cpu_expf(j->sink[h0 + g] - m[g]);

            for (int i = 0; i < Dh; i++)
                o[i] = dsv4_bf16_round(acc[g * Dh + i] / dg);
        }
    }
}

enum dsv4_err
cpu_attention(struct dsv4_backend *be, float *out, const float *q, const float *kv,
              const float *ring, const float *comp, const int32_t *pages, const int32_t *sel,
              const float *sink, const int32_t *slot, const int32_t *pos, const int32_t *row0,
              const int32_t *pos0, int T, int H, int Dh, int win, int cap, int ratio, int K,
              float scale)
{
    struct attn_job j = { 0 };
    int nthr = cpu_threads(be);

    if (win < 1 || (comp != NULL && sel == NULL && ratio < 1))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu attention: win=%d ratio=%d", win, ratio);
    if (T <= 0)
        return DSV4_OK;
    j.out = out;
    j.q = q;
    j.kv = kv;
    j.ring = ring;
    j.comp = comp;
    j.pages = pages;
    j.sel = sel;
    j.sink = sink;
    j.slot = slot;
    j.pos = pos;
    j.row0 = row0;
    j.pos0 = pos0;
    j.H = H;
    j.Dh = Dh;
    j.win = win;
    j.cap = cap;
    j.ratio = ratio;
    j.K = K;
    j.scale = scale;
    j.max_cand = win + (comp == NULL ? 0 : sel != NULL ? K : cap);
    j.cand = malloc((size_t)nthr * j.max_cand * sizeof(*j.cand));
    j.sc = malloc((size_t)nthr * ATTN_HG * j.max_cand * sizeof(float));
    j.acc = malloc((size_t)nthr * ATTN_HG * Dh * sizeof(float));
    if (j.cand == NULL || j.sc == NULL || j.acc == NULL) {
        free(j.cand);
        free(j.sc);
        free(j.acc);
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu attention: no memory");
    }
    cpu_parallel_for(be, (int64_t)T * ((H + ATTN_HG - 1) / ATTN_HG), 1, attn_task, &j);
    free(j.cand);
    free(j.sc);
    free(j.acc);
    return DSV4_OK;
}
