/*
 * forward.c — the DeepSeek-V4 forward pass over the op interface (see
 * forward.h).  Every numeric step is an op of the backend; this file only
 * decides what runs in which order, computes the host-side bookkeeping
 * (positions, ring slots, which rows finish a compressor window) and uploads
 * those small index arrays.
 *
 * DESIGN: one code path for prefill, chunked prefill and decode.  Compressors
 * always run in their streaming form (model doc §3.3.4), which gives the same
 * entries as the reference's one-shot prefill; window attention reads the
 * current call's KV rows for positions inside the call and the slot's ring for
 * older ones; the ring is written only after attention.  Hence the result for
 * a sequence is the same whatever the chunking and whatever else is batched.
 */
#include "kernels/forward.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/weights_shard.h"
#include "kernels/comm.h"

#define HC_MAX_STREAMS DSV4_HC_MAX

/* Decode state and parameters of one layer. */
struct layer_state {
    const struct dsv4_layer_w *w;
    int ratio;                 /* 0, 4, 128 */
    const float *freqs;        /* host, rd/2: this layer's rope frequencies */
    float *ring;               /* (n_slots, win, Dh) */
    struct page_pool *pg;      /* page table of comp (and keys); NULL if ratio 0 */
    float *comp;               /* ((pg->n_pages + 1) * P, Dh) or NULL */
    float *st_kv, *st_z;       /* main compressor state (n_slots, c*r, c*Dh);
                                  ratio 4: followed by 2 * n_slots half rows
                                  (spec_snapshot) */
    float *keys;               /* indexer keys ((pg->n_pages + 1) * P, dI); ratio 4 */
    float *ist_kv, *ist_z;     /* indexer compressor state (n_slots, 8, 2*dI),
                                  followed by 2 * n_slots half rows */
};

/*
 * Recorded graphs by kind and batch size (opts.graphs): plain decode steps
 * (G_DECODE_ALL: steps whose every row takes all its compressed entries, so
 * the indexer's query side is left out; idx_all), speculative verify steps,
 * the MTP draft steps after them, and the restores of rejected drafts
 * (forward.h, "Speculative decoding").
 */
enum graph_kind { G_DECODE, G_DECODE_ALL, G_VERIFY, G_DRAFT, G_RESTORE, G_KINDS };
/* Calls of a kind and batch size that run ungraphed after its graph could
 * not be made for want of device memory, before one records again. */
#define GRAPH_RETRY_CALLS 1024

/*
 * Pages of the pools that grow with the sequence (backend.h,
 * DSV4_PAGE_ENTRIES): one page table per compression ratio, shared by every
 * layer of that ratio (their sequences have the same lengths) and by the
 * ratio-4 layers' indexer keys.  Each layer's pool has n_pages pages plus a
 * spare page (index n_pages): unallocated table entries point there, and the
 * fixed-shape plan of a graphed step writes non-emitting rows there.
 */
struct page_pool {
    int r;                     /* compression ratio */
    int pps;                   /* pages per slot (page-table width) */
    int cap;                   /* pps * P: entries a slot can address */
    int n_pages;               /* allocatable pages */
    int32_t *h_pt;             /* host (n_slots, pps) */
    int32_t *d_pt;             /* backend copy */
    uint8_t *dirty;            /* host (n_slots): row not yet uploaded */
    int32_t *held;             /* host (n_slots): pages a slot holds */
    int32_t *free_ids;         /* host stack of free pages */
    int n_free;
};

#define P DSV4_PAGE_ENTRIES

/* Host-side bookkeeping of one call, uploaded to the i_* device arrays. */
struct call_plan {
    int T;                     /* rows */
    int32_t *slot, *pos, *row0, *pos0, *tok;      /* (T) */
    /* compressor emissions for ratio 4 and 128: emit index per row, and per
     * emitted entry its rope position and destination row in the pools */
    int32_t *emit4, *emit128;  /* (T) */
    int n_emit4, n_emit128;
    int32_t *epos4, *epos128;  /* (T) */
    int32_t *erow4, *erow128;  /* (T) pool row (slot*cap + w); the indexer's
                                  key pool has the same capacity as ratio 4 */
    /* ring writes: source rows of the call and destination ring rows */
    int n_ring;
    int32_t *ring_src, *ring_dst; /* every layer's ring has the same layout */
    /* logits rows */
    int n_out;
    int32_t *out_rows;
    /* every row has at most K valid ratio-4 entries (idx_all) */
    int idx_small;
    /* every sequence starts at position 0 in this call (dsv4_attn.fresh) */
    int fresh;
    /* the logits rows' slot, pos, row0, pos0 and tok, and 0 .. n_out - 1:
     * the rows of a trimmed last layer (forward.h DSV4_FWD_FULL_LAST) */
    int32_t *oslot, *opos, *orow0, *opos0, *otok, *oid;
};

/*
 * The rows the layers run on: the call's, or (a trimmed last layer) its
 * logits rows past the layer's KV-side work.  trim_enter saves the call's
 * here and points the model at the compact ones; trim_leave restores them.
 */
struct row_view {
    int T;
    float *X, *X2, *xn, *post, *comb;
    int32_t *slot, *pos, *row0, *pos0, *tok, *out_rows;
};

struct dsv4_model {
    struct dsv4_backend *be;
    const struct dsv4_weights *w;
    struct dsv4_config cfg;
    int n_slots, max_seq, max_rows;
    int D, H, Dh, rd, nope, n_hc, win, V;
    int nI, dI, K;
    int n_main, n_layers;          /* main layers; main + MTP */
    /* model group (opts.comm): tp ranks, this one tp_rank; local heads,
     * output groups and output columns */
    struct dsv4_comm *comm;
    int tp, tp_rank, Hl, Gl, Dl;
    int moe_local;                 /* opts.moe_local in a group */
    int wo_b_cols;                 /* the shard holds wo_b's input columns (group split
                                      tp, common/weights_shard.h), not its rows */
    int Vr0, Vl;                   /* the head's vocabulary rows held: [Vr0, Vr0 + Vl);
                                      Vl < V in a group (gathered, logits_compute) */
    float freqs_swa[64], freqs_comp[64];
    struct layer_state *L;
    struct page_pool pg[2];        /* ratio 4, ratio 128 */
    int32_t *len;                  /* host (n_slots) */
    int32_t *mtp_len;              /* host (n_slots) */
    /* row bookkeeping of the last KEEP_HIDDEN call */
    int hidden_rows;
    struct call_plan plan;         /* host scratch */
    /* device index arrays (max_rows each) */
    int32_t *i_slot, *i_pos, *i_row0, *i_pos0, *i_tok;
    int32_t *i_emit4, *i_emit128, *i_epos4, *i_epos128, *i_erow4, *i_erow128;
    int32_t *i_ring_src, *i_ring_dst, *i_out_rows;
    /* the last layer on the logits rows only (forward.h DSV4_FWD_FULL_LAST):
     * asked for by this call; running so (then `full` holds the call's rows);
     * the compact rows' index arrays and scratch (n_slots rows: a trimmed
     * call has one logits row per run) */
    int trim_last, trimmed;
    /* this call's CSA top-k is every valid entry of each row (at most K of
     * them: plan.idx_small): the indexer's query side (its wq_b, RoPE,
     * Hadamard, weights_proj and scores) is left out and indexer_topk runs
     * without q (backend.h) */
    int idx_all;
    struct row_view full;
    int32_t *i_oslot, *i_opos, *i_orow0, *i_opos0, *i_otok, *i_oid;
    float *Xc, *xnc, *postc, *combc, *wIc;
    /* device scratch */
    float *X, *X2, *x, *xn, *post, *comb, *y;
    float *qr, *q, *kv, *o, *u;
    float *ca, *cz, *ent;          /* compressor projections and entries */
    float *qI, *wI, *ia, *iz, *ient;
    int32_t *sel;
    float *rw;                     /* router weights (T, k) */
    int32_t *rid;                  /* router ids (T, k) */
    float *ring_tmp;               /* (T, Dh) */
    float *hidden;                 /* (T, n, D) kept for MTP */
    float *e, *he;                 /* MTP: (T, D), (T, n, D) */
    float *logits_dev;             /* (max_rows, V) */
    float *logits_loc;             /* Vl < V: (max_rows, Vl) this rank's columns */
    float *u_loc, *y_loc;          /* tp > 1: (T, Gl*R), (T, Dl) this rank's part */
    int32_t *s_ids;                /* forward_sample: (max_rows) sampled ids */
    float *s_lp;                   /* forward_sample: (max_rows) their logprobs */
    int32_t *s_top_ids;            /* (max_rows, DSV4_TOP_MAX) sample_top's ids */
    float *s_top_lp;               /*   and their logprobs */
    float *parts;                  /* tp > 1: moe parts (T*k + T, D) */
    /* graphs by kind and batch size (opts.graphs; NULL until first use) */
    int graphs;
    void *graph[G_KINDS][DSV4_GRAPH_MAX_BATCH + 1];
    /* > 0: that graph could not be made for want of device memory: the
     * kind and size run without one (graph_run) for this many more calls,
     * then try again (0 also when the graphs are dropped) */
    uint16_t graph_none[G_KINDS][DSV4_GRAPH_MAX_BATCH + 1];
    uint16_t graph_retry;          /* calls a refused graph waits: GRAPH_RETRY_CALLS,
                                      or DSV4_TEST_GRAPH_RETRY_CALLS (test only) */
    long graphs_again;             /* graphs recorded at a retry after a refusal */
    /* speculative decoding (forward.h): the verify call in flight or kept
     * for the draft step; host arrays of n_slots (rows: max_rows) */
    int spec_n;                    /* streams of the kept verify call; 0 = none */
    int spec_graphed;              /* it ran as a graph (every stream had drafts) */
    int32_t *spec_slot, *spec_rows, *spec_keep, *spec_pos, *spec_idx;
    int32_t *spec_tok, *spec_next; /* (max_rows) rows fed; ids sampled per row */
    float *spec_lp;                /* (max_rows) their log-probabilities */
    int32_t *spec_top_ids;         /* (max_rows, DSV4_TOP_MAX) the rows' most likely ids
                                      (spec_verify's and forward_sample's, host) */
    float *spec_top_lp;            /*   and those ids' log-probabilities */
    struct dsv4_sample_params *spec_params;   /* (max_rows) per row */
    int32_t *i_spec_src, *i_spec_dst;         /* device (n_slots): half rows */
};

/* --- small helpers ----------------------------------------------------- */

#define TRY(expr)                              \
    do {                                       \
        enum dsv4_err e_ = (expr);             \
        if (e_ != DSV4_OK)                     \
            return e_;                         \
    } while (0)

static void *
dev_alloc(struct dsv4_model *m, size_t bytes, int *fail)
{
    void *p;

    if (bytes == 0)
        bytes = 4;
    p = m->be->ops->alloc(m->be, bytes);
    if (p == NULL)
        *fail = 1;
    return p;
}

static void
dev_free(struct dsv4_model *m, void *p)
{
    if (p != NULL)
        m->be->ops->free(m->be, p);
}

/*
 * Rope frequencies (model doc §3.3.3; REF precompute_freqs_cis): inv_f_i =
 * base^(-2i/rd); with YaRN (orig > 0) the frequencies of dims past the
 * correction range are divided by `factor`, with a linear ramp in between.
 */
static void
rope_freqs(float *f, int rd, double base, int64_t orig, double factor, double beta_fast,
           double beta_slow)
{
    int half = rd / 2;
    double low = 0, high = 0;

    if (orig > 0) {
        double lo = floor(rd * log((double)orig / (beta_fast * 2 * M_PI)) / (2 * log(base)));
        double hi = ceil(rd * log((double)orig / (beta_slow * 2 * M_PI)) / (2 * log(base)));
        low = lo < 0 ? 0 : lo;
        high = hi > rd - 1 ? rd - 1 : hi;
        if (low == high)
            high += 0.001;
    }
    for (int i = 0; i < half; i++) {
        float inv = (float)(1.0 / pow(base, (double)(2 * i) / rd));
        if (orig > 0) {
            float ramp = (float)((i - low) / (high - low));
            ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
            float smooth = 1.0f - ramp;
            inv = inv / (float)factor * (1.0f - smooth) + inv * smooth;
        }
        f[i] = inv;
    }
}

/* --- creation ---------------------------------------------------------- */

static void
plan_free(struct call_plan *p)
{
    free(p->slot);
    free(p->pos);
    free(p->row0);
    free(p->pos0);
    free(p->tok);
    free(p->emit4);
    free(p->emit128);
    free(p->epos4);
    free(p->epos128);
    free(p->erow4);
    free(p->erow128);
    free(p->ring_src);
    free(p->ring_dst);
    free(p->out_rows);
    free(p->oslot);
    free(p->opos);
    free(p->orow0);
    free(p->opos0);
    free(p->otok);
    free(p->oid);
}

static int
plan_alloc(struct call_plan *p, int n)
{
    size_t b = (size_t)n * sizeof(int32_t);

    p->slot = malloc(b);
    p->pos = malloc(b);
    p->row0 = malloc(b);
    p->pos0 = malloc(b);
    p->tok = malloc(b);
    p->emit4 = malloc(b);
    p->emit128 = malloc(b);
    p->epos4 = malloc(b);
    p->epos128 = malloc(b);
    p->erow4 = malloc(b);
    p->erow128 = malloc(b);
    p->ring_src = malloc(b);
    p->ring_dst = malloc(b);
    p->out_rows = malloc(b);
    p->oslot = malloc(b);
    p->opos = malloc(b);
    p->orow0 = malloc(b);
    p->opos0 = malloc(b);
    p->otok = malloc(b);
    p->oid = malloc(b);
    return p->slot && p->pos && p->row0 && p->pos0 && p->tok && p->emit4 && p->emit128 &&
           p->epos4 && p->epos128 && p->erow4 && p->erow128 && p->ring_src && p->ring_dst &&
           p->out_rows && p->oslot && p->opos && p->orow0 && p->opos0 && p->otok && p->oid;
}

/* Forget every recorded graph, freeing them when `release`. */
static void
graphs_drop(struct dsv4_model *m, int release)
{
    for (int k = 0; k < G_KINDS; k++) {
        for (int i = 0; i <= DSV4_GRAPH_MAX_BATCH; i++) {
            if (release && m->graph[k][i] != NULL)
                m->be->ops->graph_free(m->be, m->graph[k][i]);
            m->graph[k][i] = NULL;
            m->graph_none[k][i] = 0;
        }
    }
}

void
dsv4_model_free(struct dsv4_model *m)
{
    if (m == NULL)
        return;
    graphs_drop(m, 1);
    if (m->L != NULL) {
        for (int l = 0; l < m->n_layers; l++) {
            struct layer_state *ls = &m->L[l];
            dev_free(m, ls->ring);
            dev_free(m, ls->comp);
            dev_free(m, ls->st_kv);
            dev_free(m, ls->st_z);
            dev_free(m, ls->keys);
            dev_free(m, ls->ist_kv);
            dev_free(m, ls->ist_z);
        }
        free(m->L);
    }
    for (int i = 0; i < 2; i++) {
        dev_free(m, m->pg[i].d_pt);
        free(m->pg[i].h_pt);
        free(m->pg[i].dirty);
        free(m->pg[i].held);
        free(m->pg[i].free_ids);
    }
    void *bufs[] = {
        m->i_slot, m->i_pos, m->i_row0, m->i_pos0, m->i_tok, m->i_emit4, m->i_emit128,
        m->i_epos4, m->i_epos128, m->i_erow4, m->i_erow128, m->i_ring_src,
        m->i_ring_dst, m->i_out_rows, m->i_oslot, m->i_opos, m->i_orow0, m->i_opos0,
        m->i_otok, m->i_oid, m->Xc, m->xnc, m->postc, m->combc, m->wIc, m->X, m->X2, m->x,
        m->xn, m->post, m->comb, m->y,
        m->qr, m->q, m->kv, m->o, m->u, m->ca, m->cz, m->ent, m->qI, m->wI, m->ia, m->iz,
        m->ient, m->sel, m->rw, m->rid, m->ring_tmp, m->hidden, m->e, m->he, m->logits_dev,
        m->logits_loc,
        m->u_loc, m->y_loc, m->parts, m->s_ids, m->s_lp, m->s_top_ids, m->s_top_lp,
        m->i_spec_src, m->i_spec_dst,
    };
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        dev_free(m, bufs[i]);
    plan_free(&m->plan);
    free(m->len);
    free(m->mtp_len);
    free(m->spec_slot);
    free(m->spec_rows);
    free(m->spec_keep);
    free(m->spec_pos);
    free(m->spec_idx);
    free(m->spec_tok);
    free(m->spec_next);
    free(m->spec_lp);
    free(m->spec_top_ids);
    free(m->spec_top_lp);
    free(m->spec_params);
    free(m);
}

enum dsv4_err
dsv4_model_create(struct dsv4_model **out, struct dsv4_backend *be,
                  const struct dsv4_weights *w, const struct dsv4_model_opts *opts)
{
    const struct dsv4_config *c = &w->cfg;
    struct dsv4_model *m;
    int fail = 0;

    *out = NULL;
    if (opts->n_slots <= 0 || opts->max_seq_len <= 0 || opts->max_rows <= 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "model: n_slots, max_seq_len and max_rows must be > 0");
    if (c->hc_mult > HC_MAX_STREAMS || c->qk_rope_head_dim > 128)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "model: hc_mult or qk_rope_head_dim too large");
    m = calloc(1, sizeof(*m));
    if (m == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "model: out of memory");
    m->be = be;
    m->w = w;
    m->cfg = *c;
    m->n_slots = opts->n_slots;
    m->max_seq = (opts->max_seq_len + 127) / 128 * 128;
    m->max_rows = opts->max_rows;
    m->D = c->hidden_size;
    m->H = c->num_attention_heads;
    m->Dh = c->head_dim;
    m->rd = c->qk_rope_head_dim;
    m->nope = m->Dh - m->rd;
    m->n_hc = c->hc_mult;
    m->win = c->sliding_window;
    m->V = c->vocab_size;
    m->nI = c->index_n_heads;
    m->dI = c->index_head_dim;
    m->K = c->index_topk;
    m->n_main = c->num_hidden_layers;
    m->n_layers = w->n_layers;
    m->comm = opts->comm;
    m->tp = opts->comm != NULL ? opts->comm->size : opts->tp_size > 0 ? opts->tp_size : 1;
    m->tp_rank = opts->comm != NULL ? opts->comm->rank : opts->tp_rank;
    m->moe_local = opts->moe_local && m->tp > 1;
    if (m->tp_rank < 0 || m->tp_rank >= m->tp ||
        (opts->comm != NULL && opts->tp_size > 0 &&
         (opts->tp_size != opts->comm->size || opts->tp_rank != opts->comm->rank))) {
        free(m);
        return dsv4_err_set(DSV4_ERR_INVAL, "model: rank %d of %d does not match the "
                            "communicator", opts->tp_rank, opts->tp_size);
    }
    m->Hl = m->H / m->tp;
    m->Gl = c->o_groups / m->tp;
    m->Dl = m->D / m->tp;
    m->wo_b_cols = m->tp > 1 && w->n_layers >= 1 && w->layers[0].wo_b.n_out == m->D &&
                   w->layers[0].wo_b.n_in == m->Gl * c->o_lora_rank;
    if (m->tp > 1 && (m->Hl * m->tp != m->H || m->Gl * m->tp != c->o_groups ||
                      m->Dl * m->tp != m->D || w->n_layers < 1 ||
                      w->layers[0].wq_b.n_out != m->Hl * m->Dh ||
                      (w->layers[0].wo_b.n_out != m->Dl && !m->wo_b_cols))) {
        int r = m->tp_rank, n = m->tp;

        free(m);
        return dsv4_err_set(DSV4_ERR_INVAL, "model: rank %d of %d needs its shard of the "
                            "weights (common/weights_shard.h)", r, n);
    }
    m->Vr0 = w->head_rows > 0 ? w->head_row0 : 0;
    m->Vl = w->head_rows > 0 ? w->head_rows : m->V;
    if (m->Vl != m->V) {   /* a vocabulary slice: this rank's of its group */
        int32_t r0, n;

        dsv4_shard_vocab(m->V, m->tp_rank, m->tp, &r0, &n);
        if (m->tp <= 1 || r0 != m->Vr0 || n != m->Vl) {
            int r = m->tp_rank, g = m->tp;

            free(m);
            return dsv4_err_set(DSV4_ERR_INVAL, "model: the head holds vocabulary rows "
                                "[%d, %d), not rank %d of %d's (common/weights_shard.h)",
                                w->head_row0, w->head_row0 + w->head_rows, r, g);
        }
    }
    m->graphs = opts->graphs && be->ops->graph_begin != NULL && be->ops->graph_end != NULL &&
                be->ops->graph_launch != NULL && be->ops->graph_free != NULL;
    m->graph_retry = GRAPH_RETRY_CALLS;
    {
        /* test only: a shorter wait, so that a test sees the retry */
        const char *t = getenv("DSV4_TEST_GRAPH_RETRY_CALLS");
        long v = t != NULL ? strtol(t, NULL, 10) : 0;

        if (v >= 1 && v <= GRAPH_RETRY_CALLS)
            m->graph_retry = (uint16_t)v;
    }
    rope_freqs(m->freqs_swa, m->rd, c->rope_theta, 0, 1, 0, 0);
    rope_freqs(m->freqs_comp, m->rd, c->compress_rope_theta, c->rope_original_max_pos,
               c->rope_factor, c->rope_beta_fast, c->rope_beta_slow);

    m->len = calloc((size_t)m->n_slots, sizeof(int32_t));
    m->mtp_len = calloc((size_t)m->n_slots, sizeof(int32_t));
    m->L = calloc((size_t)m->n_layers, sizeof(*m->L));
    m->spec_slot = calloc((size_t)m->n_slots, sizeof(int32_t));
    m->spec_rows = calloc((size_t)m->n_slots, sizeof(int32_t));
    m->spec_keep = calloc((size_t)m->n_slots, sizeof(int32_t));
    m->spec_pos = calloc((size_t)m->n_slots, sizeof(int32_t));
    m->spec_idx = calloc((size_t)m->n_slots, sizeof(int32_t));
    m->spec_tok = calloc((size_t)m->max_rows, sizeof(int32_t));
    m->spec_next = calloc((size_t)m->max_rows, sizeof(int32_t));
    m->spec_lp = calloc((size_t)m->max_rows, sizeof(float));
    m->spec_top_ids = calloc((size_t)m->max_rows * DSV4_TOP_MAX, sizeof(int32_t));
    m->spec_top_lp = calloc((size_t)m->max_rows * DSV4_TOP_MAX, sizeof(float));
    m->spec_params = calloc((size_t)m->max_rows, sizeof(*m->spec_params));
    if (m->len == NULL || m->mtp_len == NULL || m->L == NULL || m->spec_slot == NULL ||
        m->spec_rows == NULL || m->spec_keep == NULL || m->spec_pos == NULL ||
        m->spec_idx == NULL || m->spec_tok == NULL || m->spec_next == NULL ||
        m->spec_lp == NULL || m->spec_top_ids == NULL || m->spec_top_lp == NULL ||
        m->spec_params == NULL || !plan_alloc(&m->plan, m->max_rows)) {
        dsv4_model_free(m);
        return dsv4_err_set(DSV4_ERR_NOMEM, "model: out of memory");
    }

    size_t S = (size_t)m->n_slots, F = sizeof(float);
    for (int i = 0; i < 2; i++) {
        struct page_pool *pg = &m->pg[i];

        pg->r = i == 0 ? 4 : 128;
        pg->pps = (m->max_seq / pg->r + P - 1) / P;
        pg->cap = pg->pps * P;
        /* default: every slot can hold max_seq; else at least one such slot */
        pg->n_pages = m->n_slots * pg->pps;
        if (opts->pool_tokens > 0) {
            int64_t n = (opts->pool_tokens / pg->r + P - 1) / P;

            pg->n_pages = (int)(n < pg->pps ? pg->pps : n < pg->n_pages ? n : pg->n_pages);
        }
        pg->h_pt = malloc(S * pg->pps * sizeof(int32_t));
        pg->dirty = calloc(S, 1);
        pg->held = calloc(S, sizeof(int32_t));
        pg->free_ids = malloc((size_t)pg->n_pages * sizeof(int32_t));
        pg->d_pt = dev_alloc(m, S * pg->pps * sizeof(int32_t), &fail);
        if (pg->h_pt == NULL || pg->dirty == NULL || pg->held == NULL || pg->free_ids == NULL) {
            dsv4_model_free(m);
            return dsv4_err_set(DSV4_ERR_NOMEM, "model: out of memory");
        }
        for (size_t j = 0; j < S * pg->pps; j++)
            pg->h_pt[j] = pg->n_pages;            /* the spare page */
        for (int j = 0; j < pg->n_pages; j++)
            pg->free_ids[j] = pg->n_pages - 1 - j;  /* page 0 on top */
        pg->n_free = pg->n_pages;
        memset(pg->dirty, 1, S);
    }
    for (int l = 0; l < m->n_layers; l++) {
        struct layer_state *ls = &m->L[l];
        ls->w = &w->layers[l];
        ls->ratio = w->layers[l].ratio;
        ls->freqs = ls->ratio ? m->freqs_comp : m->freqs_swa;
        ls->ring = dev_alloc(m, S * m->win * m->Dh * F, &fail);
        if (ls->ratio) {
            /* ratio 4: room for the snapshot and spare half rows after the
             * slots' states (spec_snapshot) */
            int r = ls->ratio, cc = r == 4 ? 2 : 1;
            size_t rows = r == 4 ? 2 * S : S;
            ls->pg = &m->pg[r == 4 ? 0 : 1];
            ls->comp = dev_alloc(m, (size_t)(ls->pg->n_pages + 1) * P * m->Dh * F, &fail);
            ls->st_kv = dev_alloc(m, rows * cc * r * cc * m->Dh * F, &fail);
            ls->st_z = dev_alloc(m, rows * cc * r * cc * m->Dh * F, &fail);
        }
        if (ls->ratio == 4) {
            ls->keys = dev_alloc(m, (size_t)(ls->pg->n_pages + 1) * P * m->dI * F, &fail);
            ls->ist_kv = dev_alloc(m, 2 * S * 8 * 2 * m->dI * F, &fail);
            ls->ist_z = dev_alloc(m, 2 * S * 8 * 2 * m->dI * F, &fail);
        }
    }

    size_t T = (size_t)m->max_rows, I4 = sizeof(int32_t);
    size_t n = (size_t)m->n_hc, D = (size_t)m->D;
    size_t k = (size_t)c->num_experts_per_tok;
    size_t qdim = (size_t)m->H * m->Dh;
    size_t udim = (size_t)c->o_groups * c->o_lora_rank;
    int32_t **idx[] = {
        &m->i_slot, &m->i_pos, &m->i_row0, &m->i_pos0, &m->i_tok, &m->i_emit4, &m->i_emit128,
        &m->i_epos4, &m->i_epos128, &m->i_erow4, &m->i_erow128, &m->i_ring_src,
        &m->i_ring_dst, &m->i_out_rows, &m->i_oslot, &m->i_opos, &m->i_orow0, &m->i_opos0,
        &m->i_otok, &m->i_oid,
    };
    for (size_t i = 0; i < sizeof(idx) / sizeof(idx[0]); i++)
        *idx[i] = dev_alloc(m, T * I4, &fail);
    m->X = dev_alloc(m, T * n * D * F, &fail);
    m->X2 = dev_alloc(m, T * n * D * F, &fail);
    m->Xc = dev_alloc(m, S * n * D * F, &fail);
    m->xnc = dev_alloc(m, S * D * F, &fail);
    m->postc = dev_alloc(m, S * n * F, &fail);
    m->combc = dev_alloc(m, S * n * n * F, &fail);
    m->wIc = dev_alloc(m, S * (size_t)(m->nI > 0 ? m->nI : 1) * F, &fail);
    m->hidden = dev_alloc(m, T * n * D * F, &fail);
    m->he = dev_alloc(m, T * n * D * F, &fail);
    m->x = dev_alloc(m, T * D * F, &fail);
    m->xn = dev_alloc(m, T * D * F, &fail);
    m->y = dev_alloc(m, T * D * F, &fail);
    m->e = dev_alloc(m, T * D * F, &fail);
    m->post = dev_alloc(m, T * n * F, &fail);
    m->comb = dev_alloc(m, T * n * n * F, &fail);
    m->qr = dev_alloc(m, T * (size_t)c->q_lora_rank * F, &fail);
    m->q = dev_alloc(m, T * qdim * F, &fail);
    m->o = dev_alloc(m, T * qdim * F, &fail);
    m->kv = dev_alloc(m, T * m->Dh * F, &fail);
    m->ring_tmp = dev_alloc(m, T * m->Dh * F, &fail);
    if (!m->wo_b_cols)   /* wo_a's whole output (a group with wo_b's columns: u_loc) */
        m->u = dev_alloc(m, T * udim * F, &fail);
    m->ca = dev_alloc(m, T * 2 * m->Dh * F, &fail);
    m->cz = dev_alloc(m, T * 2 * m->Dh * F, &fail);
    m->ent = dev_alloc(m, T * m->Dh * F, &fail);
    m->qI = dev_alloc(m, T * (size_t)m->nI * m->dI * F, &fail);
    m->wI = dev_alloc(m, T * (size_t)m->nI * F, &fail);
    m->ia = dev_alloc(m, T * 2 * m->dI * F, &fail);
    m->iz = dev_alloc(m, T * 2 * m->dI * F, &fail);
    m->ient = dev_alloc(m, T * m->dI * F, &fail);
    m->sel = dev_alloc(m, T * (size_t)(m->K > 0 ? m->K : 1) * I4, &fail);
    m->rw = dev_alloc(m, T * k * F, &fail);
    m->rid = dev_alloc(m, T * k * I4, &fail);
    m->logits_dev = dev_alloc(m, T * (size_t)m->V * F, &fail);
    if (m->Vl != m->V)
        m->logits_loc = dev_alloc(m, T * (size_t)m->Vl * F, &fail);
    m->s_ids = dev_alloc(m, T * I4, &fail);
    m->s_lp = dev_alloc(m, T * F, &fail);
    m->s_top_ids = dev_alloc(m, T * DSV4_TOP_MAX * I4, &fail);
    m->s_top_lp = dev_alloc(m, T * DSV4_TOP_MAX * F, &fail);
    m->i_spec_src = dev_alloc(m, S * I4, &fail);
    m->i_spec_dst = dev_alloc(m, S * I4, &fail);
    if (m->tp > 1) {
        m->u_loc = dev_alloc(m, T * (size_t)m->Gl * c->o_lora_rank * F, &fail);
        if (!m->wo_b_cols)   /* wo_b's rows: this rank's output columns */
            m->y_loc = dev_alloc(m, T * (size_t)m->Dl * F, &fail);
        m->parts = dev_alloc(m, T * (k + 1) * D * F, &fail);
    }
    if (fail) {
        dsv4_model_free(m);
        return dsv4_err_set(DSV4_ERR_NOMEM, "model: backend allocation failed "
                            "(n_slots=%d max_seq_len=%d max_rows=%d)",
                            opts->n_slots, opts->max_seq_len, opts->max_rows);
    }
    for (int s = 0; s < m->n_slots; s++) {
        enum dsv4_err e = dsv4_model_seq_reset(m, s);
        if (e != DSV4_OK) {
            dsv4_model_free(m);
            return e;
        }
    }
    *out = m;
    return DSV4_OK;
}

void
dsv4_model_abandon_graphs(struct dsv4_model *m)
{
    graphs_drop(m, 0);
}

long
dsv4_model_graphs_again(const struct dsv4_model *m)
{
    return m->graphs_again;
}

int
dsv4_model_graphs_refused(const struct dsv4_model *m)
{
    int n = 0;

    for (int k = 0; k < G_KINDS; k++)
        for (int i = 0; i <= DSV4_GRAPH_MAX_BATCH; i++)
            n += m->graph_none[k][i] > 0;
    return n;
}

enum dsv4_err
dsv4_model_trim(struct dsv4_model *m)
{
    graphs_drop(m, 1);
    return m->be->ops->trim != NULL ? m->be->ops->trim(m->be) : DSV4_OK;
}

enum dsv4_err
dsv4_model_set_comm(struct dsv4_model *m, struct dsv4_comm *comm)
{
    if (comm != NULL && (comm->size != m->tp || comm->rank != m->tp_rank))
        return dsv4_err_set(DSV4_ERR_INVAL, "model: communicator of rank %d of %d for rank "
                            "%d of %d", comm->rank, comm->size, m->tp_rank, m->tp);
    graphs_drop(m, 1);
    m->comm = comm;
    return DSV4_OK;
}

int
dsv4_model_vocab(const struct dsv4_model *m)
{
    return m->V;
}

/* --- pages ---------------------------------------------------------------- */

/* Pages slot s needs in pool pg for a sequence of len tokens. */
static int
pages_needed(const struct page_pool *pg, int len)
{
    return (len / pg->r + P - 1) / P;
}

/* Return every page of slot s to the free lists. */
static void
pages_release(struct dsv4_model *m, int s)
{
    for (int i = 0; i < 2; i++) {
        struct page_pool *pg = &m->pg[i];
        int32_t *row = pg->h_pt + (int64_t)s * pg->pps;

        for (int j = 0; j < pg->held[s]; j++) {
            pg->free_ids[pg->n_free++] = row[j];
            row[j] = pg->n_pages;
        }
        if (pg->held[s] > 0)
            pg->dirty[s] = 1;
        pg->held[s] = 0;
    }
}

/*
 * Give slot s[i] (i < n) the pages for a sequence of len[i] tokens, in both
 * pools; all or nothing: DSV4_ERR_NOMEM naming the pool when the free pages
 * do not cover every slot's growth.
 */
static enum dsv4_err
pages_reserve(struct dsv4_model *m, const int32_t *s, const int32_t *len, int n)
{
    for (int i = 0; i < 2; i++) {
        const struct page_pool *pg = &m->pg[i];
        int64_t want = 0;

        for (int j = 0; j < n; j++) {
            int need = pages_needed(pg, len[j]);

            want += need > pg->held[s[j]] ? need - pg->held[s[j]] : 0;
        }
        if (want > pg->n_free)
            return dsv4_err_set(DSV4_ERR_NOMEM, "forward: decode-state pool full (ratio %d: "
                                "%lld more pages needed, %d of %d free; raise pool_tokens)",
                                pg->r, (long long)want, pg->n_free, pg->n_pages);
    }
    for (int i = 0; i < 2; i++) {
        struct page_pool *pg = &m->pg[i];

        for (int j = 0; j < n; j++) {
            int32_t *row = pg->h_pt + (int64_t)s[j] * pg->pps;
            int need = pages_needed(pg, len[j]);

            while (pg->held[s[j]] < need) {
                row[pg->held[s[j]]++] = pg->free_ids[--pg->n_free];
                pg->dirty[s[j]] = 1;
            }
        }
    }
    return DSV4_OK;
}

/* Upload the page-table rows changed since the last upload. */
static enum dsv4_err
pages_upload(struct dsv4_model *m)
{
    for (int i = 0; i < 2; i++) {
        struct page_pool *pg = &m->pg[i];

        for (int s = 0; s < m->n_slots; s++) {
            if (!pg->dirty[s])
                continue;
            TRY(m->be->ops->upload(m->be, pg->d_pt + (int64_t)s * pg->pps,
                                   pg->h_pt + (int64_t)s * pg->pps,
                                   (size_t)pg->pps * sizeof(int32_t)));
            pg->dirty[s] = 0;
        }
    }
    return DSV4_OK;
}

void
dsv4_model_pages(const struct dsv4_model *m, int *in_use, int *total)
{
    *in_use = m->pg[0].n_pages - m->pg[0].n_free;
    *total = m->pg[0].n_pages;
}

int
dsv4_model_seq_len(const struct dsv4_model *m, int slot)
{
    return m->len[slot];
}

enum dsv4_err
dsv4_model_seq_reset(struct dsv4_model *m, int slot)
{
    const struct dsv4_backend_ops *ops = m->be->ops;

    if (slot < 0 || slot >= m->n_slots)
        return dsv4_err_set(DSV4_ERR_INVAL, "model: slot %d out of range", slot);
    /* Compressor states: kv 0, logits -inf (model doc §4).  Rings, entries and
     * keys need no clearing: only positions already written are ever read. */
    for (int l = 0; l < m->n_layers; l++) {
        struct layer_state *ls = &m->L[l];
        if (ls->ratio) {
            int r = ls->ratio, cc = r == 4 ? 2 : 1;
            int64_t n = (int64_t)cc * r * cc * m->Dh;
            TRY(ops->fill(m->be, ls->st_kv + (int64_t)slot * n, 0.0f, n));
            TRY(ops->fill(m->be, ls->st_z + (int64_t)slot * n, -INFINITY, n));
        }
        if (ls->ratio == 4) {
            int64_t n = (int64_t)8 * 2 * m->dI;
            TRY(ops->fill(m->be, ls->ist_kv + (int64_t)slot * n, 0.0f, n));
            TRY(ops->fill(m->be, ls->ist_z + (int64_t)slot * n, -INFINITY, n));
        }
    }
    pages_release(m, slot);
    m->len[slot] = 0;
    m->mtp_len[slot] = 0;
    m->spec_n = 0;     /* a kept verify call may hold this slot */
    return DSV4_OK;
}

/* --- the call plan ------------------------------------------------------ */

/*
 * Validate the batch and fill m->plan: per-row slot/pos/run start, the
 * compressor emissions for ratios 4 and 128, the ring writes, the logits rows.
 */
static enum dsv4_err
plan_build(struct dsv4_model *m, const struct dsv4_batch *b, unsigned flags)
{
    struct call_plan *p = &m->plan;
    int T = 0;

    m->trim_last = m->idx_all = 0;   /* forward_run may ask for them */
    if (b->n_seqs <= 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "forward: empty batch");
    for (int i = 0; i < b->n_seqs; i++) {
        int s = b->slot[i];
        if (s < 0 || s >= m->n_slots)
            return dsv4_err_set(DSV4_ERR_INVAL, "forward: slot %d out of range [0, %d)", s,
                                m->n_slots);
        for (int j = 0; j < i; j++)
            if (b->slot[j] == s)
                return dsv4_err_set(DSV4_ERR_INVAL, "forward: slot %d appears twice", s);
        if (b->n_tokens[i] <= 0)
            return dsv4_err_set(DSV4_ERR_INVAL, "forward: run %d has no tokens", i);
        /* no sums: a run of INT_MAX tokens wrapped them past the checks */
        if (b->n_tokens[i] > m->max_rows - T)
            return dsv4_err_set(DSV4_ERR_INVAL, "forward: more than max_rows=%d rows",
                                m->max_rows);
        if (b->n_tokens[i] > m->max_seq - m->len[s])
            return dsv4_err_set(DSV4_ERR_INVAL, "forward: slot %d would exceed max_seq_len=%d",
                                s, m->max_seq);
        T += b->n_tokens[i];
    }
    for (int t = 0; t < T; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= m->V)
            return dsv4_err_set(DSV4_ERR_INVAL, "forward: token id %d out of range "
                                "[0, %d)", b->tokens[t], m->V);
    for (int i = 0; i < b->n_seqs; i++)
        p->pos[i] = m->len[b->slot[i]] + b->n_tokens[i];   /* lengths after the call */
    TRY(pages_reserve(m, b->slot, p->pos, b->n_seqs));
    p->T = T;
    p->n_emit4 = p->n_emit128 = p->n_ring = p->n_out = 0;
    p->idx_small = 1;
    p->fresh = 1;
    int t = 0;
    const struct page_pool *pg4 = &m->pg[0], *pg128 = &m->pg[1];
    for (int i = 0; i < b->n_seqs; i++) {
        int s = b->slot[i], n = b->n_tokens[i], p0 = m->len[s];
        if (p0 > 0)
            p->fresh = 0;
        for (int j = 0; j < n; j++, t++) {
            int pos = p0 + j, tok = b->tokens[t];
            p->slot[t] = s;
            p->pos[t] = pos;
            p->row0[t] = t - j;
            p->pos0[t] = p0;
            p->tok[t] = tok;
            p->emit4[t] = p->emit128[t] = -1;
            if (dsv4_n_valid(pos, 4, pg4->cap) > m->K)
                p->idx_small = 0;
            if ((pos + 1) % 4 == 0) {
                int e = p->n_emit4++;
                p->emit4[t] = e;
                p->epos4[e] = pos + 1 - 4;
                p->erow4[e] = (int32_t)dsv4_pool_row(pg4->h_pt, pg4->cap, s, pos / 4);
            }
            if ((pos + 1) % 128 == 0) {
                int e = p->n_emit128++;
                p->emit128[t] = e;
                p->epos128[e] = pos + 1 - 128;
                p->erow128[e] =
                    (int32_t)dsv4_pool_row(pg128->h_pt, pg128->cap, s, pos / 128);
            }
            if (pos >= p0 + n - m->win) {
                p->ring_src[p->n_ring] = t;
                p->ring_dst[p->n_ring] = s * m->win + pos % m->win;
                p->n_ring++;
            }
            if ((flags & DSV4_FWD_ALL_LOGITS) || j == n - 1)
                p->out_rows[p->n_out++] = t;
        }
    }
    return DSV4_OK;
}

/*
 * Give the plan of a decode step (one row per run) a fixed shape, so that a
 * graph recorded once per batch size serves every step: every row counts as
 * emitting for both compressors (emit[t] = t), and a row that does not
 * really finish a window sends its entry to the pools' spare page.  The ops then see the same counts at every step; the
 * entries that land in the spare row are never read.  The fresh hint is
 * dropped: it picks kernels on the host (dsv4_attn.fresh), and a graph
 * recorded at position 0 (the warm-up's) would replay them at every later
 * position, where they would read key rows that are not in the call.
 */
static void
plan_fix_emits(struct dsv4_model *m)
{
    struct call_plan *p = &m->plan;
    const struct page_pool *pg4 = &m->pg[0], *pg128 = &m->pg[1];

    p->fresh = 0;

    for (int t = 0; t < p->T; t++) {
        int s = p->slot[t], pos = p->pos[t];
        int e4 = (pos + 1) % 4 == 0, e128 = (pos + 1) % 128 == 0;

        p->emit4[t] = e4 ? t : -1;
        p->epos4[t] = e4 ? pos + 1 - 4 : 0;
        p->erow4[t] = e4 ? (int32_t)dsv4_pool_row(pg4->h_pt, pg4->cap, s, pos / 4)
                         : pg4->n_pages * P;
        p->emit128[t] = e128 ? t : -1;
        p->epos128[t] = e128 ? pos + 1 - 128 : 0;
        p->erow128[t] = e128 ? (int32_t)dsv4_pool_row(pg128->h_pt, pg128->cap, s, pos / 128)
                             : pg128->n_pages * P;
    }
    p->n_emit4 = p->n_emit128 = p->T;
}

/* Upload the plan's index arrays. */
static enum dsv4_err
plan_upload(struct dsv4_model *m)
{
    struct call_plan *p = &m->plan;
    int no = m->trim_last ? p->n_out : 0;

    /* a trimmed last layer's rows: the logits rows' indices (row0 stays a
     * row of the call: the window keys are the call's kv rows) */
    for (int i = 0; i < no; i++) {
        int t = p->out_rows[i];

        p->oslot[i] = p->slot[t];
        p->opos[i] = p->pos[t];
        p->orow0[i] = p->row0[t];
        p->opos0[i] = p->pos0[t];
        p->otok[i] = p->tok[t];
        p->oid[i] = i;
    }
    struct {
        int32_t *dst;
        const int32_t *src;
        int n;
    } up[] = {
        { m->i_slot, p->slot, p->T },         { m->i_pos, p->pos, p->T },
        { m->i_row0, p->row0, p->T },         { m->i_pos0, p->pos0, p->T },
        { m->i_tok, p->tok, p->T },           { m->i_emit4, p->emit4, p->T },
        { m->i_emit128, p->emit128, p->T },   { m->i_epos4, p->epos4, p->n_emit4 },
        { m->i_epos128, p->epos128, p->n_emit128 }, { m->i_erow4, p->erow4, p->n_emit4 },
        { m->i_erow128, p->erow128, p->n_emit128 },
        { m->i_ring_src, p->ring_src, p->n_ring }, { m->i_ring_dst, p->ring_dst, p->n_ring },
        { m->i_out_rows, p->out_rows, p->n_out },
        { m->i_oslot, p->oslot, no },         { m->i_opos, p->opos, no },
        { m->i_orow0, p->orow0, no },         { m->i_opos0, p->opos0, no },
        { m->i_otok, p->otok, no },           { m->i_oid, p->oid, no },
    };
    for (size_t i = 0; i < sizeof(up) / sizeof(up[0]); i++)
        if (up[i].n > 0)
            TRY(m->be->ops->upload(m->be, up[i].dst, up[i].src,
                                   (size_t)up[i].n * sizeof(int32_t)));
    return pages_upload(m);
}

/* --- the last layer on the logits rows (forward.h DSV4_FWD_FULL_LAST) --- */

/*
 * From here on the layer runs on the call's logits rows only: their streams
 * X, the normed input xn and the hc_pre outputs post / comb gathered into
 * the compact buffers, the index arrays and T the compact ones.  What was
 * queued before (the compressor branch, the window KV of every row) keeps
 * the call's rows.
 */
static enum dsv4_err
trim_enter(struct dsv4_model *m)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    struct call_plan *p = &m->plan;
    int n = m->n_hc, D = m->D, N = p->n_out;

    TRY(ops->gather_rows(be, m->Xc, m->X, m->i_out_rows, N, n * D));
    TRY(ops->gather_rows(be, m->xnc, m->xn, m->i_out_rows, N, D));
    TRY(ops->gather_rows(be, m->postc, m->post, m->i_out_rows, N, n));
    TRY(ops->gather_rows(be, m->combc, m->comb, m->i_out_rows, N, n * n));
    m->full = (struct row_view){
        .T = p->T, .X = m->X, .X2 = m->X2, .xn = m->xn, .post = m->post, .comb = m->comb,
        .slot = m->i_slot, .pos = m->i_pos, .row0 = m->i_row0, .pos0 = m->i_pos0,
        .tok = m->i_tok, .out_rows = m->i_out_rows,
    };
    m->X = m->Xc, m->xn = m->xnc, m->post = m->postc, m->comb = m->combc;
    m->i_slot = m->i_oslot, m->i_pos = m->i_opos, m->i_row0 = m->i_orow0;
    m->i_pos0 = m->i_opos0, m->i_tok = m->i_otok, m->i_out_rows = m->i_oid;
    p->T = N;
    m->trimmed = 1;
    return DSV4_OK;
}

/* Back to the call's rows (nothing when not trimmed).  The streams of the
 * call's rows are stale: only the logits rows went through the last layer. */
static void
trim_leave(struct dsv4_model *m)
{
    const struct row_view *f = &m->full;

    if (!m->trimmed)
        return;
    m->X = f->X, m->X2 = f->X2, m->xn = f->xn, m->post = f->post, m->comb = f->comb;
    m->i_slot = f->slot, m->i_pos = f->pos, m->i_row0 = f->row0, m->i_pos0 = f->pos0;
    m->i_tok = f->tok, m->i_out_rows = f->out_rows;
    m->plan.T = f->T;
    m->trimmed = 0;
}

/* --- attention sub-steps ----------------------------------------------- */

/*
 * Run a compressor over this call's rows and store the finished entries
 * (model doc §3.3.4): its projections a = wkv xn and z = wgate xn (fp32)
 * are already there (attention's linear_multi), then the streaming update,
 * norm -> RoPE at the window start -> FP8 sim (main) or Hadamard+FP4 sim
 * (indexer), scattered into the slot's pool.
 */
static enum dsv4_err
run_compressor(struct dsv4_model *m, const struct layer_state *ls,
               const struct dsv4_compressor_w *cw, float *st_kv, float *st_z, float *pool,
               const int32_t *erow, float *a, float *z, float *ent, int indexer)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    const struct call_plan *p = &m->plan;
    int r = cw->ratio, d = cw->dim;
    int n_emit = r == 4 ? p->n_emit4 : p->n_emit128;
    const int32_t *emit = r == 4 ? m->i_emit4 : m->i_emit128;
    const int32_t *epos = r == 4 ? m->i_epos4 : m->i_epos128;

    TRY(ops->compress(be, ent, st_kv, st_z, a, z, cw->ape, m->i_slot, m->i_pos, emit, p->T, r,
                      d));
    if (n_emit == 0)
        return DSV4_OK;
    /* norm -> RoPE (-> FP8 sim -> pool for the main compressor): one op */
    if (!indexer)
        return ops->norm_rope(be, ent, cw->norm, n_emit, d, (float)m->cfg.rms_norm_eps, epos, 1,
                              d - m->rd, m->rd, ls->freqs, d - m->rd, 64, pool, erow);
    TRY(ops->norm_rope(be, ent, cw->norm, n_emit, d, (float)m->cfg.rms_norm_eps, epos, 1,
                       d - m->rd, m->rd, ls->freqs, 0, 0, NULL, NULL));
    TRY(ops->hadamard_fp4(be, ent, n_emit));
    return ops->scatter_rows(be, pool, erow, ent, n_emit, d);
}

/*
 * The attention output projection over a group (kernels/comm.h), after
 * attention_out put this rank's groups of wo_a into m->u_loc: gathered into
 * m->u (every rank's columns, exact: the others' are zero); this rank's
 * output columns of wo_b, gathered into m->y.  Each value is the one a
 * single rank computes.  With wo_b's input columns instead (group split
 * tp): wo_b on this rank's wo_a outputs, a partial y, and one all-reduce
 * adds the ranks' partials (no gather of u).
 */
static enum dsv4_err
attention_out_tp(struct dsv4_model *m, const struct dsv4_layer_w *lw)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    int T = m->plan.T, R = m->cfg.o_lora_rank, GR = m->cfg.o_groups * R, GRl = m->Gl * R;

    if (m->wo_b_cols) {
        TRY(ops->linear(be, m->y, m->u_loc, &lw->wo_b, T, 0));
        return m->comm->ops->allreduce_sum(m->comm, be, m->y, (int64_t)T * m->D);
    }
    TRY(ops->fill(be, m->u, 0.0f, (int64_t)T * GR));
    TRY(ops->copy2d(be, m->u + (int64_t)m->tp_rank * GRl, GR, m->u_loc, GRl, T, GRl));
    TRY(m->comm->ops->allreduce_sum(m->comm, be, m->u, (int64_t)T * GR));
    TRY(ops->linear(be, m->y_loc, m->u, &lw->wo_b, T, 0));
    TRY(ops->fill(be, m->y, 0.0f, (int64_t)T * m->D));
    TRY(ops->copy2d(be, m->y + (int64_t)m->tp_rank * m->Dl, m->D, m->y_loc, m->Dl, T, m->Dl));
    return m->comm->ops->allreduce_sum(m->comm, be, m->y, (int64_t)T * m->D);
}

/*
 * The most rows of a call whose latency-hiding side branches (the q / kv
 * norm beside the indexer, the ring update beside the output projection)
 * run on the side queue: with more, both branches' kernels fill the GPU
 * and running them side by side only slows the longer one (docs/perf.md
 * run 33: a 2,048-token prefill 297 -> 301 ms with them).
 */
#define SIDE_SMALL_T 64
/* Calls of more rows run wq_b and the q norm as linear_norm_rope (attention) */
#define Q_FUSED_MIN_T 64

/*
 * Run fn(m, ls, arg) on the backend's side queue where it has one and
 * `side` asks for it (kernels/backend.h side_begin: beside the ops queued
 * after it until side_join), else in order.  fn's ops must not write what
 * the main queue's ops up to the join read or write, nor read what they
 * write.
 */
static enum dsv4_err
side_run(struct dsv4_model *m, struct layer_state *ls, int side,
         enum dsv4_err (*fn)(struct dsv4_model *, struct layer_state *, const void *),
         const void *arg)
{
    const struct dsv4_backend_ops *ops = m->be->ops;
    enum dsv4_err e, e_end;
    int on = 0;

    if (!side)
        return fn(m, ls, arg);
    if (ops->side_begin != NULL)
        TRY(ops->side_begin(m->be, &on));
    e = fn(m, ls, arg);
    e_end = ops->side_end != NULL ? ops->side_end(m->be) : DSV4_OK;
    TRY(e);
    return e_end;
}

/* The ops queued after this run after side_run's ops. */
static enum dsv4_err
side_join(struct dsv4_model *m)
{
    return m->be->ops->side_join != NULL ? m->be->ops->side_join(m->be) : DSV4_OK;
}

/*
 * The compressor branch of a compressed layer's attention (model doc §3.3.4,
 * §3.7): the projections of xn that only the compressors and the indexer's
 * weights read (the compressors' wkv / wgate, the indexer's compressor and
 * weights_proj: BF16 in the checkpoint), then the indexer's compressor
 * (before the main one) and the main compressor.  It reads m->xn and writes
 * m->ia, iz, wI, ca, cz, the entries, the compressor states and the pools,
 * none of which the query branch (attention) reads or writes, so the two
 * may run beside each other (the backend's side queue).
 */
static enum dsv4_err
attention_compress(struct dsv4_model *m, struct layer_state *ls, const void *unused)
{
    const struct dsv4_backend_ops *ops = m->be->ops;
    const struct dsv4_layer_w *lw = ls->w;
    float *outs[DSV4_LINEAR_MULTI_MAX];
    const struct dsv4_linear *Ws[DSV4_LINEAR_MULTI_MAX];
    unsigned fl[DSV4_LINEAR_MULTI_MAX];
    int n = 0;

#define LIN_ADD(o, w, f) (outs[n] = (o), Ws[n] = (w), fl[n++] = (f))
    if (ls->ratio == 4) {
        LIN_ADD(m->ia, &lw->idx_compressor.wkv, DSV4_LIN_F32_OUT);
        LIN_ADD(m->iz, &lw->idx_compressor.wgate, DSV4_LIN_F32_OUT);
        if (!m->idx_all)   /* the scores' head weights */
            LIN_ADD(m->wI, &lw->idx_weights_proj, 0);
    }
    LIN_ADD(m->ca, &lw->compressor.wkv, DSV4_LIN_F32_OUT);
    LIN_ADD(m->cz, &lw->compressor.wgate, DSV4_LIN_F32_OUT);
#undef LIN_ADD
    (void)unused;
    TRY(ops->linear_multi(m->be, n, outs, m->xn, Ws, fl, m->plan.T));
    if (ls->ratio == 4)
        TRY(run_compressor(m, ls, &lw->idx_compressor, ls->ist_kv, ls->ist_z, ls->keys,
                           m->i_erow4, m->ia, m->iz, m->ient, 1));
    return run_compressor(m, ls, &lw->compressor, ls->st_kv, ls->st_z, ls->comp,
                          ls->ratio == 4 ? m->i_erow4 : m->i_erow128, m->ca, m->cz, m->ent, 0);
}

/* Per-head RMS -> RoPE on the last rd of the queries (m->q): the norm_rope
 * call of attention_qkv_norm and of attention's linear_norm_rope. */
static struct dsv4_norm_rope
attention_q_norm(const struct dsv4_model *m, const struct layer_state *ls)
{
    struct dsv4_norm_rope nq = {
        .x = m->q, .w = NULL, .rows = m->plan.T * m->Hl, .D = m->Dh,
        .eps = (float)m->cfg.rms_norm_eps, .pos = m->i_pos, .heads = m->Hl, .off = m->nope,
        .rd = m->rd, .freqs = ls->freqs,
    };

    return nq;
}

/*
 * Per-head RMS -> RoPE on the last rd of the queries (m->q), unless kv_only
 * is not NULL (attention's linear_norm_rope did them); the window KV (K =
 * V, m->kv): kv_norm -> RoPE -> FP8 sim of the nope dims.  Reads and writes
 * m->q and m->kv only.
 */
static enum dsv4_err
attention_qkv_norm(struct dsv4_model *m, struct layer_state *ls, const void *kv_only)
{
    float eps = (float)m->cfg.rms_norm_eps;
    int Dh = m->Dh, rd = m->rd;
    /* the window KV of every row of the call, also in a trimmed layer */
    int Tkv = m->trimmed ? m->full.T : m->plan.T;
    const int32_t *pkv = m->trimmed ? m->full.pos : m->i_pos;
    struct dsv4_norm_rope nq = attention_q_norm(m, ls);
    struct dsv4_norm_rope nkv = {
        .x = m->kv, .w = ls->w->kv_norm, .rows = Tkv, .D = Dh, .eps = eps, .pos = pkv,
        .heads = 1, .off = m->nope, .rd = rd, .freqs = ls->freqs, .sim_cols = m->nope,
        .sim_block = 64,
    };

    if (kv_only != NULL)
        return dsv4_norm_rope_one(m->be, &nkv);
    return m->be->ops->norm_rope2(m->be, &nq, &nkv);
}

/*
 * The ring update after attention (older ring rows were still being read):
 * this call's window KV rows (m->kv) into the slots' rings at ring_dst,
 * through m->ring_tmp.
 */
static enum dsv4_err
attention_ring_update(struct dsv4_model *m, struct layer_state *ls, const void *ring_dst)
{
    const struct call_plan *p = &m->plan;

    TRY(m->be->ops->gather_rows(m->be, m->ring_tmp, m->kv, m->i_ring_src, p->n_ring, m->Dh));
    return m->be->ops->scatter_rows(m->be, ls->ring, (const int32_t *)ring_dst, m->ring_tmp,
                                    p->n_ring, m->Dh);
}

/*
 * Attention sub-layer (model doc §3.3): m->xn (T, D) -> m->y (T, D).  trim:
 * the call's last layer on its logits rows only (forward.h
 * DSV4_FWD_FULL_LAST): the compressor branch and the window KV (wkv, its
 * norm and RoPE, the ring) on every row, the rest, and so the layer's
 * output, on the logits rows (trim_enter).
 */
static enum dsv4_err
attention(struct dsv4_model *m, struct layer_state *ls, const int32_t *ring_dst, int trim)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    const struct dsv4_layer_w *lw = ls->w;
    const struct call_plan *p = &m->plan;
    float eps = (float)m->cfg.rms_norm_eps;
    int T = p->T, H = m->Hl, Dh = m->Dh, rd = m->rd;   /* this rank's heads */
    const int32_t *sel = NULL;
    const float *comp = NULL;
    /* prefill-sized calls: wq_b and the q norm through linear_norm_rope (the
     * CUDA fast kernels hand the GEMM's bf16 output to the norm); decode
     * calls keep the q norm beside the window KV's in norm_rope2 (one
     * launch) */
    int q_fused = 0;
    const void *kv_only = NULL;   /* attention_qkv_norm: the q norm done (q_fused) */

    /* the compressor branch first, on the backend's side queue where it has
     * one (beside the query branch below, until side_join) */
    if (ls->ratio)
        TRY(side_run(m, ls, 1, attention_compress, NULL));

    /* the query branch: the projections of xn it reads (wq_a, wkv: each
     * reads only xn and writes its own buffer), then q_norm(wq_a x) -> wq_b
     * (and the indexer's wq_b) */
    {
        float *outs[DSV4_LINEAR_MULTI_MAX];
        const struct dsv4_linear *Ws[DSV4_LINEAR_MULTI_MAX];
        unsigned fl[DSV4_LINEAR_MULTI_MAX];
        int n = 0;

#define LIN_ADD(o, w, f) (outs[n] = (o), Ws[n] = (w), fl[n++] = (f))
        if (trim) {   /* wkv on every row, then the logits rows only */
            LIN_ADD(m->kv, &lw->wkv, 0);
            TRY(ops->linear_multi(be, n, outs, m->xn, Ws, fl, T));
            TRY(trim_enter(m));
            T = p->T, n = 0;
            LIN_ADD(m->qr, &lw->wq_a, 0);
        } else {
            LIN_ADD(m->qr, &lw->wq_a, 0);
            LIN_ADD(m->kv, &lw->wkv, 0);
        }
        TRY(ops->linear_multi(be, n, outs, m->xn, Ws, fl, T));

        TRY(ops->rms_norm(be, m->qr, m->qr, lw->q_norm, T, lw->wq_a.n_out, eps));
        n = 0;
        q_fused = T > Q_FUSED_MIN_T;   /* the rows q is computed on (after a trim) */
        kv_only = q_fused ? (const void *)&q_fused : NULL;
        if (q_fused) {   /* wq_b with the q norm and RoPE */
            struct dsv4_norm_rope nq = attention_q_norm(m, ls);

            /* q is read next, and only, by attention_out below (q_held):
             * the backend may keep it in its own form (the CUDA fast
             * kernels: bf16) */
            nq.q_attn = 1;
            TRY(ops->linear_norm_rope(be, m->qr, &lw->wq_b, T, 0, &nq));
        } else {
            LIN_ADD(m->q, &lw->wq_b, 0);
        }
        if (ls->ratio == 4 && !m->idx_all)
            LIN_ADD(m->qI, &lw->idx_wq_b, 0);
#undef LIN_ADD
        if (n > 0)
            TRY(ops->linear_multi(be, n, outs, m->qr, Ws, fl, T));
    }
    if (ls->ratio != 4) {
        TRY(attention_qkv_norm(m, ls, kv_only));
        if (ls->ratio) {   /* what follows reads the compressor branch's outputs */
            TRY(side_join(m));
            comp = ls->comp;
        }
    } else {
        int nI = m->nI, dI = m->dI;
        float *qI = m->idx_all ? NULL : m->qI, *wI = m->idx_all ? NULL : m->wI;

        /* the indexer's queries (model doc §3.7), then its top-k (which
         * reads the compressor branch's keys and weights) beside the q / kv
         * norm on the side queue; with idx_all the top-k is every valid
         * entry, and nothing of the query side is needed */
        if (qI != NULL) {
            TRY(ops->rope(be, qI, m->i_pos, T, nI, (int64_t)nI * dI, dI, dI - rd, rd,
                          ls->freqs, 0));
            TRY(ops->hadamard_fp4(be, qI, T * nI));
        }
        TRY(side_join(m));
        comp = ls->comp;
        if (wI != NULL && m->trimmed) {   /* the branch's weights of the logits rows */
            TRY(ops->gather_rows(be, m->wIc, wI, m->full.out_rows, T, nI));
            wI = m->wIc;
        }
        TRY(side_run(m, ls, T <= SIDE_SMALL_T, attention_qkv_norm, kv_only));
        if (wI != NULL)
            TRY(ops->scale(be, wI, (float)(1.0 / sqrt((double)dI) / sqrt((double)nI)),
                           (int64_t)T * nI));
        TRY(ops->indexer_topk(be, m->sel, qI, wI, ls->keys, ls->pg->d_pt, m->i_slot,
                              m->i_pos, T, nI, dI, ls->pg->cap, 4, m->K));
        TRY(side_join(m));
        sel = m->sel;
    }

    {
        /* the value carried the keys' rotation: undone at the query position */
        struct dsv4_attn at = {
            .out = m->o, .q = m->q, .kv = m->kv, .ring = ls->ring, .comp = comp,
            .pages = ls->ratio ? ls->pg->d_pt : NULL, .sel = sel, .sink = lw->attn_sink,
            .slot = m->i_slot, .pos = m->i_pos, .row0 = m->i_row0, .pos0 = m->i_pos0, .T = T,
            .H = H, .Dh = Dh, .win = m->win, .cap = ls->ratio ? ls->pg->cap : 0,
            .ratio = ls->ratio, .K = m->K, .scale = (float)(1.0 / sqrt((double)Dh)),
            .fresh = p->fresh && !m->trimmed, .q_held = q_fused,
        };

        /* with the grouped output projection (wo_a) of this rank's groups
         * into m->u_loc (m->u with one rank); m->o is the op's to use */
        TRY(ops->attention_out(be, &at, m->nope, rd, ls->freqs, m->tp == 1 ? m->u : m->u_loc,
                               &lw->wo_a, m->tp == 1 ? m->cfg.o_groups : m->Gl));
    }
    /* the ring update on the side queue, beside wo_b (it touches only m->kv,
     * m->ring_tmp and the ring) */
    if (p->n_ring > 0)
        TRY(side_run(m, ls, T <= SIDE_SMALL_T, attention_ring_update, ring_dst));

    if (m->tp == 1)
        TRY(ops->linear(be, m->y, m->u, &lw->wo_b, T, 0));
    else
        TRY(attention_out_tp(m, lw));
    return side_join(m);
}

/* Routed + shared experts: m->xn -> m->y; over a group, each rank's
 * experts' parts summed (exact: the others' are zero), then combined; with
 * moe_local, combined on each rank, then summed (forward.h). */
static enum dsv4_err
experts(struct dsv4_model *m, const struct dsv4_layer_w *lw)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    const struct dsv4_config *c = &m->cfg;
    int T = m->plan.T, k = c->num_experts_per_tok;

    if (m->tp == 1)
        return ops->moe(be, m->y, m->xn, m->rid, m->rw, lw->experts, &lw->shared, T, k,
                        (float)c->swiglu_limit);
    TRY(ops->moe_parts(be, m->parts, m->xn, m->rid, m->rw, lw->experts, &lw->shared, T, k,
                       m->D, (float)c->swiglu_limit));
    if (m->moe_local) {   /* this rank's rows combined, then the partial outputs summed */
        TRY(ops->moe_combine(be, m->y, m->parts, m->rid, T, k, m->D));
        return m->comm->ops->allreduce_sum(m->comm, be, m->y, (int64_t)T * m->D);
    }
    TRY(m->comm->ops->allreduce_sum(m->comm, be, m->parts, ((int64_t)T * k + T) * m->D));
    return ops->moe_combine(be, m->y, m->parts, m->rid, T, k, m->D);
}

/*
 * hc_post of the sub-layer output m->y into X2, then (next != NULL) hc_pre
 * of `next` on it into m->x, m->post, m->comb and the next sub-layer's
 * input norm `nw` into m->xn, as one fused op; X and X2 swapped.
 */
static enum dsv4_err
hc_step(struct dsv4_model *m, const struct dsv4_hc_w *next, const uint16_t *nw)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_config *c = &m->cfg;
    int T = m->plan.T, n = m->n_hc, D = m->D;
    float *t;

    if (next != NULL)
        TRY(be->ops->hc_post_pre(be, m->X2, m->x, m->post, m->comb, m->xn, m->y, m->X,
                                 m->post, m->comb, next, nw, T, n, D, c->hc_sinkhorn_iters,
                                 (float)c->hc_eps, (float)c->rms_norm_eps));
    else
        TRY(be->ops->hc_post(be, m->X2, m->y, m->X, m->post, m->comb, T, n, D));
    t = m->X, m->X = m->X2, m->X2 = t;
    return DSV4_OK;
}

/*
 * One block (model doc §3.2): X (T, n, D) updated in place (via X2).
 * pre_done: the attention hc_pre and attn_norm of this block already ran
 * (the previous block's last hc_post_pre, into m->xn); next: the next
 * block's layer, whose attention hc_pre and attn_norm then run fused with
 * this block's last hc_post (NULL: plain hc_post).
 */
static enum dsv4_err
block(struct dsv4_model *m, struct layer_state *ls, const int32_t *ring_dst, int pre_done,
      const struct dsv4_layer_w *next, int trim)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    const struct dsv4_layer_w *lw = ls->w;
    const struct dsv4_config *c = &m->cfg;
    int T = m->plan.T, n = m->n_hc, D = m->D;
    float eps = (float)c->rms_norm_eps, hc_eps = (float)c->hc_eps;

    if (!pre_done) {
        TRY(ops->hc_pre(be, m->x, m->post, m->comb, m->X, &lw->hc_attn, T, n, D,
                        c->hc_sinkhorn_iters, hc_eps, eps));
        TRY(ops->rms_norm(be, m->xn, m->x, lw->attn_norm, T, D, eps));
    }
    TRY(attention(m, ls, ring_dst, trim));
    T = m->plan.T;   /* the logits rows from here on when trimmed */
    TRY(hc_step(m, &lw->hc_ffn, lw->ffn_norm));

    TRY(ops->router(be, m->rw, m->rid, m->xn, &lw->gate, lw->gate_bias, lw->tid2eid, m->i_tok,
                    T, c->num_experts_per_tok, (float)c->routed_scaling_factor));
    TRY(experts(m, lw));
    return hc_step(m, next != NULL ? &next->hc_attn : NULL,
                   next != NULL ? next->attn_norm : NULL);
}

/* hc_head -> norm -> head on the plan's logits rows into m->logits_dev.  A
 * rank holding a vocabulary slice of the head (m->Vl < m->V) computes its
 * columns, and the group's all-reduce of rows that are zero elsewhere
 * gathers the whole rows on every rank: each logit is one rank's value
 * plus zeros, the full head's bits (but -0 may come back +0). */
static enum dsv4_err
logits_compute(struct dsv4_model *m, const struct dsv4_hc_w *hc, const uint16_t *norm)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    const struct dsv4_config *c = &m->cfg;
    const struct call_plan *p = &m->plan;
    struct dsv4_linear head = {
        .w = m->w->head, .scale = NULL, .n_out = m->V, .n_in = m->D, .fmt = DSV4_WFMT_BF16,
    };

    TRY(ops->gather_rows(be, m->X2, m->X, m->i_out_rows, p->n_out, m->n_hc * m->D));
    TRY(ops->hc_head(be, m->x, m->X2, hc, p->n_out, m->n_hc, m->D, (float)c->hc_eps,
                     (float)c->rms_norm_eps));
    TRY(ops->rms_norm(be, m->xn, m->x, norm, p->n_out, m->D, (float)c->rms_norm_eps));
    if (m->Vl == m->V)
        return ops->linear(be, m->logits_dev, m->xn, &head, p->n_out, DSV4_LIN_F32_OUT);
    if (p->n_out == 0)
        return DSV4_OK;   /* the same plan on every rank: none of them gathers */
    head.n_out = m->Vl;
    TRY(ops->linear(be, m->logits_loc, m->xn, &head, p->n_out, DSV4_LIN_F32_OUT));
    TRY(ops->fill(be, m->logits_dev, 0.0f, (int64_t)p->n_out * m->V));
    TRY(ops->copy2d(be, m->logits_dev + m->Vr0, m->V, m->logits_loc, m->Vl, p->n_out, m->Vl));
    return m->comm->ops->allreduce_sum(m->comm, be, m->logits_dev, (int64_t)p->n_out * m->V);
}

/* Download the plan's (n_out, V) logits and wait. */
static enum dsv4_err
logits_download(struct dsv4_model *m, float *logits)
{
    struct dsv4_backend *be = m->be;

    TRY(be->ops->download(be, logits, m->logits_dev,
                          (size_t)m->plan.n_out * m->V * sizeof(float)));
    return be->ops->sync(be);
}

/* The device work of a forward call after the plan upload: embedding, the
 * main layers, the logits on the device.  Leaves m->X where it found it
 * (each block swaps X and X2 twice). */
static enum dsv4_err
forward_layers(struct dsv4_model *m)
{
    struct dsv4_backend *be = m->be;
    int last = m->n_main - 1;

    TRY(be->ops->embed(be, m->X, m->i_tok, m->w->embed, m->plan.T, m->D, m->n_hc));
    for (int l = 0; l <= last; l++)
        TRY(block(m, &m->L[l], m->i_ring_dst, l > 0, l < last ? m->L[l + 1].w : NULL,
                  l == last && m->trim_last));
    return logits_compute(m, &m->w->hc_head, m->w->norm);
}

/* forward_layers, back on the call's rows after a trimmed last layer (also
 * when it failed). */
static enum dsv4_err
forward_body(struct dsv4_model *m)
{
    enum dsv4_err e = forward_layers(m);

    trim_leave(m);
    return e;
}

/* `body` as a replay of the graph of kind `kind` for batch size n, recorded
 * on first use (forward.h, docs/gpu.md).  The body's device work must
 * depend on the call only through the uploaded index arrays.  A graph
 * recorded whole that the backend cannot make for want of device memory
 * (CUDA: cudaGraphInstantiate) is not needed: nothing recorded has run, so
 * the body runs as an ordinary call, now and for that kind and size's next
 * GRAPH_RETRY_CALLS - 1 calls (graph_none; dsv4_model_graphs_refused); the
 * call after them records again (the memory may have come back). */
static enum dsv4_err
graph_run(struct dsv4_model *m, enum graph_kind kind, int n,
          enum dsv4_err (*body)(struct dsv4_model *))
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;

    /* graph_none: 1 at the call that tries again */
    if (m->graph_none[kind][n] > 1) {
        m->graph_none[kind][n]--;
        return body(m);
    }
    if (m->graph[kind][n] == NULL) {
        float *X = m->X, *X2 = m->X2;
        void *g = NULL;
        enum dsv4_err e, e2;

        TRY(ops->graph_begin(be));
        e = body(m);
        e2 = ops->graph_end(be, &g);
        m->X = X, m->X2 = X2;
        if (e != DSV4_OK || e2 != DSV4_OK) {
            if (g != NULL)
                ops->graph_free(be, g);
            if (e == DSV4_OK && e2 == DSV4_ERR_NOMEM) {
                m->graph_none[kind][n] = m->graph_retry;
                return body(m);
            }
            return e != DSV4_OK ? e : e2;
        }
        m->graph[kind][n] = g;
        if (m->graph_none[kind][n] != 0)
            m->graphs_again++;
        m->graph_none[kind][n] = 0;
    }
    return ops->graph_launch(be, m->graph[kind][n]);
}

/* Whether the batch runs as a graph replay (forward.h). */
static int
graph_eligible(const struct dsv4_model *m, const struct dsv4_batch *b, unsigned flags)
{
    if (!m->graphs || (flags & DSV4_FWD_KEEP_HIDDEN) || b->n_seqs > DSV4_GRAPH_MAX_BATCH)
        return 0;
    for (int i = 0; i < b->n_seqs; i++)
        if (b->n_tokens[i] != 1)
            return 0;
    return 1;
}

/* --- public entry points ----------------------------------------------- */

/* The device part of a forward call: plan, layers, logits in logits_dev
 * (the caller downloads or samples them, then calls forward_commit). */
static enum dsv4_err
forward_run(struct dsv4_model *m, const struct dsv4_batch *b, unsigned flags)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    const struct call_plan *p = &m->plan;
    int graphed;

    if (m->tp > 1 && m->comm == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "forward: rank %d of %d has no communicator",
                            m->tp_rank, m->tp);
    m->spec_n = 0;
    TRY(plan_build(m, b, flags));
    graphed = graph_eligible(m, b, flags);
    if (graphed)
        plan_fix_emits(m);
    /* the last layer on the logits rows alone where the other rows' output
     * is not used (their KV state still comes from every row) */
    m->trim_last = !(flags & (DSV4_FWD_FULL_LAST | DSV4_FWD_KEEP_HIDDEN)) && !graphed &&
                   p->n_out < p->T;
    /* no indexer scores where every row's top-k is all its valid entries */
    m->idx_all = p->idx_small && !(flags & DSV4_FWD_FULL_INDEXER);
    TRY(plan_upload(m));
    if (graphed)
        TRY(graph_run(m, m->idx_all ? G_DECODE_ALL : G_DECODE, m->plan.T, forward_body));
    else
        TRY(forward_body(m));
    if (flags & DSV4_FWD_KEEP_HIDDEN) {
        TRY(ops->copy(be, m->hidden, m->X, (size_t)p->T * m->n_hc * m->D * sizeof(float)));
        m->hidden_rows = p->T;
    } else {
        m->hidden_rows = 0;
    }
    return DSV4_OK;
}

/* The runs of b are through the model: their slots grew. */
static void
forward_commit(struct dsv4_model *m, const struct dsv4_batch *b)
{
    for (int i = 0; i < b->n_seqs; i++)
        m->len[b->slot[i]] += b->n_tokens[i];
}

enum dsv4_err
dsv4_model_forward(struct dsv4_model *m, const struct dsv4_batch *b, float *logits,
                   unsigned flags)
{
    TRY(forward_run(m, b, flags));
    TRY(logits_download(m, logits));
    forward_commit(m, b);
    return DSV4_OK;
}

/* Log-probabilities as the protocol carries them (<= 0): a NaN (from a NaN
 * logit) becomes -inf and a rounding above 0 becomes 0, or the rank could
 * not encode the step's TOKENS and every stream of the batch lost it. */
static float
lp_clean(float v)
{
    return isnan(v) ? -INFINITY : v > 0.0f ? 0.0f : v;
}

/* Whether any of params[0 .. n) asks for its most likely ids. */
static bool
top_wanted(const struct dsv4_sample_params *params, int n)
{
    for (int i = 0; i < n; i++)
        if (params[i].n_top > 0)
            return true;
    return false;
}

/* sample_top over the first n rows of the logits (params: the rows'), their
 * entries downloaded into ids / lp (host, n * DSV4_TOP_MAX; the rows' other
 * entries as they were on the backend): queued, the caller syncs. */
static enum dsv4_err
top_queue(struct dsv4_model *m, const struct dsv4_sample_params *params, int n, int32_t *ids,
          float *lp)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    size_t k = (size_t)n * DSV4_TOP_MAX;

    TRY(ops->sample_top(be, m->s_top_ids, m->s_top_lp, m->logits_dev, params, n, m->V));
    TRY(ops->download(be, ids, m->s_top_ids, k * sizeof(int32_t)));
    return ops->download(be, lp, m->s_top_lp, k * sizeof(float));
}

/* Copy row `row`'s top entries (after top_queue into src_*) to entry `at` of
 * *top, as many as params asks (no more than V; none when it asks none, and
 * then src_* are not read), log-probabilities cleaned; their count in n. */
static void
top_copy(const struct dsv4_model *m, const struct dsv4_top_out *top, int at,
         const int32_t *src_ids, const float *src_lp, int row,
         const struct dsv4_sample_params *params)
{
    int k = params->n_top < m->V ? params->n_top : m->V;

    top->n[at] = k;
    for (int j = 0; j < k; j++) {
        top->ids[(size_t)at * DSV4_TOP_MAX + j] = src_ids[(size_t)row * DSV4_TOP_MAX + j];
        top->logprob[(size_t)at * DSV4_TOP_MAX + j] =
            lp_clean(src_lp[(size_t)row * DSV4_TOP_MAX + j]);
    }
}

enum dsv4_err
dsv4_model_forward_sample(struct dsv4_model *m, const struct dsv4_batch *b,
                          const struct dsv4_sample_params *params, int32_t *out_ids,
                          float *out_logprob, const struct dsv4_top_out *top)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    int n = b->n_seqs;

    TRY(forward_run(m, b, 0));
    TRY(ops->sample(be, m->s_ids, m->s_lp, m->logits_dev, params, n, m->V));
    TRY(ops->download(be, out_ids, m->s_ids, (size_t)n * sizeof(int32_t)));
    if (out_logprob != NULL)
        TRY(ops->download(be, out_logprob, m->s_lp, (size_t)n * sizeof(float)));
    if (top != NULL && top_wanted(params, n))
        TRY(top_queue(m, params, n, m->spec_top_ids, m->spec_top_lp));
    TRY(ops->sync(be));
    for (int i = 0; out_logprob != NULL && i < n; i++)
        out_logprob[i] = lp_clean(out_logprob[i]);
    for (int i = 0; top != NULL && i < n; i++)
        top_copy(m, top, i, m->spec_top_ids, m->spec_top_lp, i, &params[i]);
    forward_commit(m, b);
    return DSV4_OK;
}

/*
 * The MTP layer (model doc §3.6) over the plan's rows, each paired with the
 * hidden row of the same index in m->hidden and the plan's token (the one
 * that follows it), then its logits on the plan's logits rows into
 * m->logits_dev.  Leaves m->X where it found it.
 */
static enum dsv4_err
mtp_body(struct dsv4_model *m)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    const struct dsv4_layer_w *mw = &m->w->layers[m->n_main];
    float eps = (float)m->cfg.rms_norm_eps;
    int T = m->plan.T, n = m->n_hc, D = m->D;

    /* Z = e_proj(enorm(embed(next))) broadcast + h_proj(hnorm(hidden)) */
    TRY(ops->embed(be, m->x, m->i_tok, m->w->embed, T, D, 1));
    TRY(ops->rms_norm(be, m->x, m->x, mw->enorm, T, D, eps));
    TRY(ops->linear(be, m->e, m->x, &mw->e_proj, T, 0));
    TRY(ops->rms_norm(be, m->X2, m->hidden, mw->hnorm, T * n, D, eps));
    TRY(ops->linear(be, m->he, m->X2, &mw->h_proj, T * n, 0));
    TRY(ops->add_streams(be, m->X, m->e, m->he, T, n, D));
    TRY(block(m, &m->L[m->n_main], m->i_ring_dst, 0, NULL, 0));
    return logits_compute(m, &mw->hc_head, mw->mtp_norm);
}

enum dsv4_err
dsv4_model_mtp(struct dsv4_model *m, const struct dsv4_batch *b, const int32_t *next_tokens,
               float *logits)
{
    struct dsv4_batch nb = *b;
    int T = 0;

    if (m->n_layers <= m->n_main)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "mtp: checkpoint has no MTP layer");
    if (m->tp > 1 && m->comm == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "mtp: rank %d of %d has no communicator",
                            m->tp_rank, m->tp);
    for (int i = 0; i < b->n_seqs; i++)
        T += b->n_tokens[i];
    if (T != m->hidden_rows)
        return dsv4_err_set(DSV4_ERR_INVAL, "mtp: batch has %d rows, the last forward kept %d",
                            T, m->hidden_rows);
    /* Rebuild the plan at the positions of the kept rows: the forward advanced
     * each slot's length, so step back by the run length. */
    for (int i = 0; i < b->n_seqs; i++) {
        int s = b->slot[i];
        if (s < 0 || s >= m->n_slots || m->len[s] - b->n_tokens[i] != m->mtp_len[s])
            return dsv4_err_set(DSV4_ERR_INVAL, "mtp: run %d (slot %d) does not continue the "
                                "MTP layer's sequence", i, s);
    }
    for (int i = 0; i < b->n_seqs; i++)
        m->len[b->slot[i]] -= b->n_tokens[i];
    nb.tokens = next_tokens;
    m->spec_n = 0;
    enum dsv4_err e = plan_build(m, &nb, DSV4_FWD_ALL_LOGITS);
    for (int i = 0; i < b->n_seqs; i++)
        m->len[b->slot[i]] += b->n_tokens[i];
    TRY(e);
    TRY(plan_upload(m));
    TRY(mtp_body(m));
    TRY(logits_download(m, logits));
    for (int i = 0; i < b->n_seqs; i++)
        m->mtp_len[b->slot[i]] += b->n_tokens[i];
    m->hidden_rows = 0;
    return DSV4_OK;
}

/* --- speculative decoding (forward.h) ------------------------------------ */

/*
 * Snapshot and restore around a verify call.  The one piece of state a
 * rejected draft changes that is read later is the previous-window half
 * (slots [0, r)) of an r = 4 compressor state, overwritten when the draft's
 * position completes a window (kernels/backend.h `compress`, overlap
 * layout); everything else it writes (the current-window slot of its
 * position, the r = 128 state row, its ring row, emitted entries and
 * indexer keys) lies where the position is written again before anything
 * reads it.  Each r = 4 state array holds, after the n_slots states of two
 * half rows each, n_slots snapshot half rows (2S + i for stream i of the
 * call) and n_slots spare ones (3S + i), so that both directions are one
 * fixed-shape row copy per array: a graph can hold them.
 */

/* Call `fn` on every r = 4 state array of the main layers with its half-row
 * length in floats. */
static enum dsv4_err
spec_arrays(struct dsv4_model *m, int n,
            enum dsv4_err (*fn)(struct dsv4_model *, float *, int, int))
{
    for (int l = 0; l < m->n_main; l++) {
        struct layer_state *ls = &m->L[l];

        if (ls->ratio != 4)
            continue;
        TRY(fn(m, ls->st_kv, 4 * 2 * m->Dh, n));
        TRY(fn(m, ls->st_z, 4 * 2 * m->Dh, n));
        TRY(fn(m, ls->ist_kv, 4 * 2 * m->dI, n));
        TRY(fn(m, ls->ist_z, 4 * 2 * m->dI, n));
    }
    return DSV4_OK;
}

/* Half row i_spec_src[i] (the slot's previous window) -> snapshot row i. */
static enum dsv4_err
spec_snap_one(struct dsv4_model *m, float *a, int half, int n)
{
    return m->be->ops->gather_rows(m->be, a + (int64_t)2 * m->n_slots * half, a,
                                   m->i_spec_src, n, half);
}

/* Snapshot row i -> half row i_spec_dst[i] (the slot's, or a spare one). */
static enum dsv4_err
spec_restore_one(struct dsv4_model *m, float *a, int half, int n)
{
    return m->be->ops->scatter_rows(m->be, a, m->i_spec_dst,
                                    a + (int64_t)2 * m->n_slots * half, n, half);
}

/* The device work of a verify call: snapshot, then the forward. */
static enum dsv4_err
verify_body(struct dsv4_model *m)
{
    TRY(spec_arrays(m, m->spec_n, spec_snap_one));
    return forward_body(m);
}

/* The restore of a verify call's rejected drafts (i_spec_dst uploaded). */
static enum dsv4_err
restore_body(struct dsv4_model *m)
{
    return spec_arrays(m, m->spec_n, spec_restore_one);
}

/* Give slot s an empty MTP window when its MTP layer has not followed its
 * positions (forward.h): the ring rows zeroed, the MTP length caught up. */
static enum dsv4_err
spec_mtp_catch_up(struct dsv4_model *m, int s)
{
    int64_t ring = (int64_t)m->win * m->Dh;

    if (m->mtp_len[s] == m->len[s])
        return DSV4_OK;
    for (int l = m->n_main; l < m->n_layers; l++)
        TRY(m->be->ops->fill(m->be, m->L[l].ring + s * ring, 0.0f, ring));
    m->mtp_len[s] = m->len[s];
    return DSV4_OK;
}

/* Download rows of the plan's logits when `logits` is set, the n sampled
 * ids into ids and their log-probabilities into lp (when set), and wait. */
static enum dsv4_err
spec_download(struct dsv4_model *m, int n, int32_t *ids, float *lp, float *logits)
{
    const struct dsv4_backend_ops *ops = m->be->ops;

    if (logits != NULL)
        TRY(ops->download(m->be, logits, m->logits_dev,
                          (size_t)m->plan.n_out * m->V * sizeof(float)));
    TRY(ops->download(m->be, ids, m->s_ids, (size_t)n * sizeof(int32_t)));
    if (lp != NULL)
        TRY(ops->download(m->be, lp, m->s_lp, (size_t)n * sizeof(float)));
    return ops->sync(m->be);
}

enum dsv4_err
dsv4_model_spec_verify(struct dsv4_model *m, const struct dsv4_spec_batch *b,
                       const struct dsv4_sample_params *params, int32_t *out_ids,
                       float *out_lp, const struct dsv4_top_out *top, int32_t *out_n,
                       float *logits)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    const int K = DSV4_SPEC_MAX_DRAFT, K1 = DSV4_SPEC_MAX_DRAFT + 1;
    int n = b->n_seqs, T = 0, all = 1, graphed, any_restore = 0;
    enum dsv4_err e;
    int64_t S = m->n_slots;
    struct dsv4_batch fb;

    m->spec_n = 0;
    m->hidden_rows = 0;
    if (m->tp > 1 && m->comm == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "verify: rank %d of %d has no communicator",
                            m->tp_rank, m->tp);
    if (n <= 0 || n > m->n_slots)
        return dsv4_err_set(DSV4_ERR_INVAL, "verify: %d streams (1 .. %d)", n, m->n_slots);
    for (int i = 0; i < n; i++) {
        int nd = b->n_draft[i];

        if (nd < 0 || nd > K || T + 1 + nd > m->max_rows)
            return dsv4_err_set(DSV4_ERR_INVAL, "verify: stream %d has %d drafts (0 .. %d) "
                                "or the call exceeds max_rows=%d", i, nd, K, m->max_rows);
        m->spec_rows[i] = 1 + nd;
        m->spec_tok[T] = b->last[i];
        for (int j = 0; j < nd; j++)
            m->spec_tok[T + 1 + j] = b->draft[i * K + j];
        for (int j = 0; j <= nd; j++) {
            m->spec_params[T + j] = params[i];
            m->spec_params[T + j].step = params[i].step + (uint64_t)j;
        }
        T += 1 + nd;
        all = all && nd == K;
    }
    fb.n_seqs = n;
    fb.slot = b->slot;
    fb.n_tokens = m->spec_rows;
    fb.tokens = m->spec_tok;
    TRY(plan_build(m, &fb, DSV4_FWD_ALL_LOGITS | DSV4_FWD_KEEP_HIDDEN));
    for (int i = 0; i < n; i++) {
        m->spec_slot[i] = b->slot[i];
        m->spec_pos[i] = m->len[b->slot[i]];
        TRY(spec_mtp_catch_up(m, b->slot[i]));
        m->spec_idx[i] = 2 * b->slot[i];
    }
    graphed = m->graphs && all && n <= DSV4_GRAPH_MAX_BATCH;
    if (graphed)
        plan_fix_emits(m);
    TRY(plan_upload(m));
    TRY(ops->upload(be, m->i_spec_src, m->spec_idx, (size_t)n * sizeof(int32_t)));
    /* (spec_n is n only while a body runs, and after success: a failed
     * call must not let a draft step follow it) */
    m->spec_n = n;
    e = graphed ? graph_run(m, G_VERIFY, n, verify_body) : verify_body(m);
    m->spec_n = 0;
    if (e != DSV4_OK)
        return e;
    TRY(ops->copy(be, m->hidden, m->X, (size_t)T * m->n_hc * m->D * sizeof(float)));
    TRY(ops->sample(be, m->s_ids, m->s_lp, m->logits_dev, m->spec_params, T, m->V));
    if (top != NULL && top_wanted(m->spec_params, T))
        TRY(top_queue(m, m->spec_params, T, m->spec_top_ids, m->spec_top_lp));
    TRY(spec_download(m, T, m->spec_next, m->spec_lp, logits));

    /* Keep the drafts up to the first one that differs from the token sampled
     * before it.  k = 1: a rejected draft at p + 1 needs the restore when it
     * completed an r = 4 window ((p + 2) % 4 == 0); the snapshot holds the
     * state before the call, whose previous-window half position p leaves
     * alone (p does not complete a window then). */
    for (int i = 0, row = 0; i < n; i++) {
        int nd = b->n_draft[i], acc = 0;

        while (acc < nd && m->spec_next[row + acc] == b->draft[i * K + acc])
            acc++;
        out_n[i] = acc + 1;
        for (int j = 0; j <= acc; j++) {
            out_ids[i * K1 + j] = m->spec_next[row + j];
            if (out_lp != NULL)
                out_lp[i * K1 + j] = lp_clean(m->spec_lp[row + j]);
            if (top != NULL)
                top_copy(m, top, i * K1 + j, m->spec_top_ids, m->spec_top_lp, row + j,
                         &m->spec_params[row + j]);
        }
        m->spec_idx[i] = (int32_t)(3 * S + i);           /* spare: nothing to undo */
        if (acc < nd && (m->spec_pos[i] + 2) % 4 == 0) {
            m->spec_idx[i] = 2 * b->slot[i];
            any_restore = 1;
        }
        m->spec_keep[i] = acc + 1;
        row += nd + 1;
    }
    if (any_restore) {
        TRY(ops->upload(be, m->i_spec_dst, m->spec_idx, (size_t)n * sizeof(int32_t)));
        m->spec_n = n;
        e = graphed ? graph_run(m, G_RESTORE, n, restore_body) : restore_body(m);
        m->spec_n = 0;
        if (e != DSV4_OK)
            return e;
    }
    for (int i = 0; i < n; i++)
        m->len[b->slot[i]] += out_n[i];
    m->spec_n = n;
    m->spec_graphed = graphed;
    return DSV4_OK;
}

enum dsv4_err
dsv4_model_spec_draft(struct dsv4_model *m, int32_t *drafts, float *logits)
{
    struct dsv4_backend *be = m->be;
    const struct dsv4_backend_ops *ops = be->ops;
    struct call_plan *p = &m->plan;
    struct dsv4_batch mb;
    int n = m->spec_n, graphed;
    enum dsv4_err e;

    if (m->n_layers <= m->n_main)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "draft: checkpoint has no MTP layer");
    if (n == 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "draft: the last call was not a verify step");
    if (m->tp > 1 && m->comm == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "draft: rank %d of %d has no communicator",
                            m->tp_rank, m->tp);
    /* The MTP rows are the verify call's rows at its positions: step the
     * slots back to where the call started while planning. */
    mb.n_seqs = n;
    mb.slot = m->spec_slot;
    mb.n_tokens = m->spec_rows;
    mb.tokens = m->spec_next;
    for (int i = 0; i < n; i++)
        m->len[m->spec_slot[i]] = m->spec_pos[i];
    e = plan_build(m, &mb, 0);
    for (int i = 0; i < n; i++)
        m->len[m->spec_slot[i]] = m->spec_pos[i] + m->spec_keep[i];
    if (e != DSV4_OK) {
        m->spec_n = 0;
        return e;
    }
    /* the draft comes from the last kept row of each stream */
    for (int i = 0, row = 0; i < n; i++) {
        p->out_rows[i] = row + m->spec_keep[i] - 1;
        row += m->spec_rows[i];
    }
    graphed = m->spec_graphed;
    if (graphed)
        plan_fix_emits(m);
    m->spec_n = 0;
    TRY(plan_upload(m));
    if (graphed)
        TRY(graph_run(m, G_DRAFT, n, mtp_body));
    else
        TRY(mtp_body(m));
    for (int i = 0; i < n; i++) {
        memset(&m->spec_params[i], 0, sizeof(m->spec_params[i]));   /* greedy */
        m->spec_params[i].top_p = 1.0f;
    }
    TRY(ops->sample(be, m->s_ids, NULL, m->logits_dev, m->spec_params, n, m->V));
    TRY(spec_download(m, n, drafts, NULL, logits));
    for (int i = 0; i < n; i++)
        m->mtp_len[m->spec_slot[i]] = m->len[m->spec_slot[i]];
    return DSV4_OK;
}

/* --- decode-state export / import --------------------------------------- */

#define STATE_MAGIC 0x3130564b34565344ull   /* "DSV4KV01" little-endian */

/* Header of an exported state; followed by the per-layer arrays (forward.h). */
struct state_header {
    uint64_t magic;
    uint64_t fingerprint;   /* config fields that fix the layout */
    int32_t len;            /* tokens in the sequence */
    int32_t mtp_len;        /* tokens seen by the MTP layer(s) */
    int32_t n_layers;
    int32_t reserved;
};

static uint64_t
state_fingerprint(const struct dsv4_model *m)
{
    int32_t f[] = { m->n_layers, m->n_main, m->D, m->Dh, m->win, m->dI, m->n_hc, m->V };
    uint64_t h = 1469598103934665603ull;

    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++) {
        h = (h ^ (uint32_t)f[i]) * 1099511628211ull;
    }
    for (int l = 0; l < m->n_layers; l++)
        h = (h ^ (uint32_t)m->L[l].ratio) * 1099511628211ull;
    return h;
}

/* What state_walk does with each array of a slot's state.  The buffer is
 * host memory for EXPORT/IMPORT and backend memory for the _DEV directions
 * (a CUDA IPC region), where the arrays are gathered (struct state_batch)
 * and moved by one copy_batch call. */
enum state_dir {
    STATE_SIZE,         /* count bytes only */
    STATE_EXPORT,       /* backend -> host buffer */
    STATE_IMPORT,       /* host buffer -> backend */
    STATE_EXPORT_DEV,   /* backend -> backend buffer */
    STATE_IMPORT_DEV,   /* backend buffer -> backend */
};

/* The device-to-device pieces of a _DEV walk (host arrays of n). */
struct state_batch {
    int n, cap;
    void **dst;
    const void **src;
    size_t *bytes;
};

/* Queue the copy dst <- src of n bytes; a piece that continues the last one
 * on both sides (consecutive pages) extends it. */
static enum dsv4_err
state_batch_add(struct state_batch *b, void *dst, const void *src, size_t n)
{
    int k = b->n - 1;

    if (k >= 0 && (char *)b->dst[k] + b->bytes[k] == (char *)dst &&
        (const char *)b->src[k] + b->bytes[k] == (const char *)src) {
        b->bytes[k] += n;
        return DSV4_OK;
    }
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 256;
        void **d = realloc(b->dst, (size_t)cap * sizeof(*d));
        const void **s;
        size_t *z;

        if (d != NULL)
            b->dst = d;
        s = d != NULL ? realloc(b->src, (size_t)cap * sizeof(*s)) : NULL;
        if (s != NULL)
            b->src = s;
        z = s != NULL ? realloc(b->bytes, (size_t)cap * sizeof(*z)) : NULL;
        if (z == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "state: out of memory");
        b->bytes = z;
        b->cap = cap;
    }
    b->dst[b->n] = dst;
    b->src[b->n] = src;
    b->bytes[b->n] = n;
    b->n++;
    return DSV4_OK;
}

/* One array of `nfloats` at `dev`: copy it in direction `dir` at *buf
 * (advanced past it; _DEV: queued into sb) and add its bytes to *bytes. */
static enum dsv4_err
state_part(const struct dsv4_model *m, enum state_dir dir, float *dev, int64_t nfloats,
           char **buf, size_t *bytes, struct state_batch *sb)
{
    const struct dsv4_backend_ops *ops = m->be->ops;
    size_t n = (size_t)nfloats * sizeof(float);
    enum dsv4_err e = DSV4_OK;

    if (n > 0) {
        switch (dir) {
        case STATE_SIZE:
            break;
        case STATE_EXPORT:
            e = ops->download(m->be, *buf, dev, n);
            break;
        case STATE_IMPORT:
            e = ops->upload(m->be, dev, *buf, n);
            break;
        case STATE_EXPORT_DEV:
            e = state_batch_add(sb, *buf, dev, n);
            break;
        case STATE_IMPORT_DEV:
            e = state_batch_add(sb, dev, *buf, n);
            break;
        }
    }
    if (dir != STATE_SIZE)
        *buf += n;
    *bytes += n;
    return e;
}

/* Entries [0, n) of slot s of a paged pool with rows of d floats, page by
 * page, as one array (state_part). */
static enum dsv4_err
state_paged(const struct dsv4_model *m, enum state_dir dir, const struct page_pool *pg,
            float *pool, int s, int n, int d, char **buf, size_t *bytes, struct state_batch *sb)
{
    for (int e0 = 0; e0 < n; e0 += P) {
        int k = n - e0 < P ? n - e0 : P;
        float *rows = dir == STATE_SIZE ? NULL
                                        : pool + dsv4_pool_row(pg->h_pt, pg->cap, s, e0) * d;

        TRY(state_part(m, dir, rows, (int64_t)k * d, buf, bytes, sb));
    }
    return DSV4_OK;
}

/*
 * Walk slot `slot`'s state for a sequence of `len` tokens in the export
 * order (per layer: ring, compressed entries up to len/r, compressor states;
 * indexer keys up to len/4 and the indexer compressor states), counting the
 * bytes into *bytes and copying each array per `dir` at `buf` (_DEV:
 * queueing it into sb).
 */
static enum dsv4_err
state_pieces(const struct dsv4_model *m, int slot, int len, enum state_dir dir, char *buf,
             size_t *bytes, struct state_batch *sb)
{
    *bytes = 0;
    for (int l = 0; l < m->n_layers; l++) {
        const struct layer_state *ls = &m->L[l];
        int64_t ring = (int64_t)m->win * m->Dh;

        TRY(state_part(m, dir, ls->ring + slot * ring, ring, &buf, bytes, sb));
        if (ls->ratio) {
            int r = ls->ratio, cc = r == 4 ? 2 : 1;
            int64_t st = (int64_t)cc * r * cc * m->Dh;
            TRY(state_paged(m, dir, ls->pg, ls->comp, slot, len / r, m->Dh, &buf, bytes, sb));
            TRY(state_part(m, dir, ls->st_kv + slot * st, st, &buf, bytes, sb));
            TRY(state_part(m, dir, ls->st_z + slot * st, st, &buf, bytes, sb));
        }
        if (ls->ratio == 4) {
            int64_t st = (int64_t)8 * 2 * m->dI;
            TRY(state_paged(m, dir, ls->pg, ls->keys, slot, len / 4, m->dI, &buf, bytes, sb));
            TRY(state_part(m, dir, ls->ist_kv + slot * st, st, &buf, bytes, sb));
            TRY(state_part(m, dir, ls->ist_z + slot * st, st, &buf, bytes, sb));
        }
    }
    return DSV4_OK;
}

/* state_pieces, then (_DEV directions) one copy_batch of all the pieces. */
static enum dsv4_err
state_walk(const struct dsv4_model *m, int slot, int len, enum state_dir dir, char *buf,
           size_t *bytes)
{
    struct state_batch sb;
    enum dsv4_err e;

    memset(&sb, 0, sizeof(sb));
    e = state_pieces(m, slot, len, dir, buf, bytes, &sb);
    if (e == DSV4_OK && sb.n > 0)
        e = m->be->ops->copy_batch(m->be, sb.n, sb.dst, sb.src, sb.bytes);
    free(sb.dst);
    free(sb.src);
    free(sb.bytes);
    return e;
}

size_t
dsv4_model_state_size(const struct dsv4_model *m, int len)
{
    size_t bytes;

    state_walk(m, 0, len, STATE_SIZE, NULL, &bytes);   /* cannot fail when counting */
    return sizeof(struct state_header) + bytes;
}

/*
 * Export slot `slot` into buf (host memory when dev == 0, backend memory
 * else): the header (through a small host staging for a device buffer), then
 * the walk in the matching direction.
 */
static enum dsv4_err
state_export(struct dsv4_model *m, int slot, void *buf, size_t cap, size_t *out_len, int dev)
{
    struct state_header h;
    size_t need, bytes;

    if (slot < 0 || slot >= m->n_slots)
        return dsv4_err_set(DSV4_ERR_INVAL, "state export: slot %d out of range", slot);
    need = dsv4_model_state_size(m, m->len[slot]);
    if (cap < need)
        return dsv4_err_set(DSV4_ERR_INVAL, "state export: buffer of %zu bytes, need %zu", cap,
                            need);
    memset(&h, 0, sizeof(h));
    h.magic = STATE_MAGIC;
    h.fingerprint = state_fingerprint(m);
    h.len = m->len[slot];
    h.mtp_len = m->mtp_len[slot];
    h.n_layers = m->n_layers;
    if (dev)
        TRY(m->be->ops->upload(m->be, buf, &h, sizeof(h)));
    else
        memcpy(buf, &h, sizeof(h));
    TRY(state_walk(m, slot, h.len, dev ? STATE_EXPORT_DEV : STATE_EXPORT,
                   (char *)buf + sizeof(h), &bytes));
    /* the header's staging (h) and the copies are done before returning */
    TRY(m->be->ops->sync(m->be));
    if (out_len != NULL)
        *out_len = need;
    return DSV4_OK;
}

enum dsv4_err
dsv4_model_state_export(struct dsv4_model *m, int slot, void *buf, size_t cap, size_t *out_len)
{
    return state_export(m, slot, buf, cap, out_len, 0);
}

enum dsv4_err
dsv4_model_state_export_dev(struct dsv4_model *m, int slot, void *dev_buf, size_t cap,
                            size_t *out_len)
{
    return state_export(m, slot, dev_buf, cap, out_len, 1);
}

/* Import an exported state from buf (host memory when dev == 0, backend
 * memory else) into slot `slot`, after checking its header. */
static enum dsv4_err
state_import(struct dsv4_model *m, int slot, const void *buf, size_t len, int dev)
{
    struct state_header h;
    size_t want, bytes;
    enum dsv4_err e;

    if (slot < 0 || slot >= m->n_slots)
        return dsv4_err_set(DSV4_ERR_INVAL, "state import: slot %d out of range", slot);
    if (len < sizeof(h))
        return dsv4_err_set(DSV4_ERR_PROTO, "state import: %zu bytes, shorter than a header",
                            len);
    if (dev) {
        /* the header only comes to the host; the walk copies on the device */
        TRY(m->be->ops->download(m->be, &h, buf, sizeof(h)));
        TRY(m->be->ops->sync(m->be));
    } else {
        memcpy(&h, buf, sizeof(h));
    }
    if (h.magic != STATE_MAGIC || h.fingerprint != state_fingerprint(m) ||
        h.n_layers != m->n_layers)
        return dsv4_err_set(DSV4_ERR_PROTO, "state import: not a state of this model "
                            "(magic or config fingerprint differs)");
    if (h.len < 0 || h.len > m->max_seq || h.mtp_len < 0 || h.mtp_len > h.len)
        return dsv4_err_set(DSV4_ERR_PROTO, "state import: length %d (mtp %d) out of range "
                            "(max_seq_len %d)", h.len, h.mtp_len, m->max_seq);
    want = dsv4_model_state_size(m, h.len);
    if (want != len)
        return dsv4_err_set(DSV4_ERR_PROTO, "state import: %zu bytes, expected %zu for "
                            "length %d", len, want, h.len);
    /* the slot's old pages go, the new sequence's are reserved */
    m->spec_n = 0;
    pages_release(m, slot);
    m->len[slot] = m->mtp_len[slot] = 0;
    /* the walker's buffer pointer is not const, but an import only reads it */
    e = pages_reserve(m, &slot, &h.len, 1);
    if (e == DSV4_OK)
        e = state_walk(m, slot, h.len, dev ? STATE_IMPORT_DEV : STATE_IMPORT,
                       (char *)(uintptr_t)buf + sizeof(h), &bytes);
    if (e == DSV4_OK)
        e = m->be->ops->sync(m->be);
    if (e != DSV4_OK) {
        /* empty as forward.h says: the compressor states of a walk cut
         * short hold parts of two sequences, which a reuse would read (the
         * reset sets no message unless it fails too) */
        (void)dsv4_model_seq_reset(m, slot);
        return e;
    }
    m->len[slot] = h.len;
    m->mtp_len[slot] = h.mtp_len;
    return DSV4_OK;
}

enum dsv4_err
dsv4_model_state_import(struct dsv4_model *m, int slot, const void *buf, size_t len)
{
    return state_import(m, slot, buf, len, 0);
}

enum dsv4_err
dsv4_model_state_import_dev(struct dsv4_model *m, int slot, const void *dev_buf, size_t len)
{
    return state_import(m, slot, dev_buf, len, 1);
}
