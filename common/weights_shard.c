/*
 * weights_shard.c — the per-rank part of the weights (weights_shard.h).
 */
#include "common/weights_shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum dsv4_err
dsv4_group_split_parse(const char *s, enum dsv4_group_split *split)
{
    if (s != NULL && strcmp(s, "ep") == 0)
        *split = DSV4_GROUP_SPLIT_EP;
    else if (s != NULL && strcmp(s, "tp") == 0)
        *split = DSV4_GROUP_SPLIT_TP;
    else
        return dsv4_err_set(DSV4_ERR_CONFIG, "group split '%s': expected ep or tp",
                            s != NULL ? s : "(null)");
    return DSV4_OK;
}

enum dsv4_err
dsv4_group_split_resolve(const char *s, int fast_kernels, enum dsv4_group_split *split)
{
    if (s != NULL && strcmp(s, "auto") == 0) {
        *split = fast_kernels ? DSV4_GROUP_SPLIT_TP : DSV4_GROUP_SPLIT_EP;
        return DSV4_OK;
    }
    return dsv4_group_split_parse(s, split);
}

const char *
dsv4_group_split_name(enum dsv4_group_split split)
{
    return split == DSV4_GROUP_SPLIT_TP ? "tp" : "ep";
}

enum dsv4_err
dsv4_shard_check(const struct dsv4_config *c, int size, enum dsv4_group_split split)
{
    int H = c->num_attention_heads, G = c->o_groups, D = c->hidden_size;
    int E = c->n_routed_experts, I = c->moe_intermediate_size;

    if (size < 1)
        return dsv4_err_set(DSV4_ERR_CONFIG, "shard: %d ranks", size);
    if (split != DSV4_GROUP_SPLIT_EP && split != DSV4_GROUP_SPLIT_TP)
        return dsv4_err_set(DSV4_ERR_CONFIG, "shard: group split %d", (int)split);
    if (size == 1)
        return DSV4_OK;
    if (H % size != 0 || G % size != 0 ||
        (split == DSV4_GROUP_SPLIT_EP && E % size != 0))
        return dsv4_err_set(DSV4_ERR_CONFIG, "shard: %d ranks do not divide the heads (%d), "
                            "output groups (%d) and experts (%d)", size, H, G, E);
    if ((int64_t)H / size * c->head_dim % 128 != 0 || c->o_lora_rank % 128 != 0 ||
        D % (128 * size) != 0)
        return dsv4_err_set(DSV4_ERR_CONFIG, "shard: %d ranks: a rank's query rows (%d), "
                            "o_lora_rank (%d) or output columns (%d) are not multiples of 128",
                            size, H / size * c->head_dim, c->o_lora_rank, D / size);
    if (split == DSV4_GROUP_SPLIT_TP && I % (128 * size) != 0)
        return dsv4_err_set(DSV4_ERR_CONFIG, "shard: group split tp over %d ranks: a rank's "
                            "part of moe_intermediate_size %d (%d) is not a multiple of 128",
                            size, I, I / size);
    return DSV4_OK;
}

void
dsv4_shard_vocab(int V, int rank, int size, int32_t *row0, int32_t *rows)
{
    int64_t a = (int64_t)V * rank / size, b = (int64_t)V * (rank + 1) / size;

    *row0 = (int32_t)a;
    *rows = (int32_t)(b - a);
}

/* Layer index of a "layers.N." / "mtp.N." name and the rest after it. */
static int
layer_of(const struct dsv4_config *c, const char *name, const char **rest)
{
    int id, k = 0;

    if (sscanf(name, "layers.%d.%n", &id, &k) == 1 && k > 0) {
        *rest = name + k;
        return id;
    }
    if (sscanf(name, "mtp.%d.%n", &id, &k) == 1 && k > 0) {
        *rest = name + k;
        return c->num_hidden_layers + id;
    }
    return -1;
}

/* Whether `rest` (a layer tensor's name after "layers.N.") is w1 / w3
 * (1) or w2 (2) of an expert (shared: *shared = 1); 0 if no expert's. */
static int
expert_matrix(const char *rest, int *shared, int *e)
{
    int n = 0;

    *shared = 0;
    *e = -1;
    if (sscanf(rest, "ffn.experts.%d.%n", e, &n) == 1 && n > 0)
        rest += n;
    else if (strncmp(rest, "ffn.shared_experts.", 19) == 0)
        rest += 19, *shared = 1;
    else
        return 0;
    if (strncmp(rest, "w1.", 3) == 0 || strncmp(rest, "w3.", 3) == 0)
        return 1;
    if (strncmp(rest, "w2.", 3) == 0)
        return 2;
    return 0;
}

int
dsv4_shard_part(const struct dsv4_config *c, const char *name, int rank, int size,
                enum dsv4_group_split split, int64_t shape0, int64_t shape1,
                struct dsv4_shard_part *part)
{
    const char *rest = NULL;
    int l = layer_of(c, name, &rest), e, shared, m;
    int64_t per = shape0 / (size > 0 ? size : 1);

    part->row0 = 0;
    part->rows = shape0;
    part->col0 = 0;
    part->cols = shape1;
    if (size > 1 && strcmp(name, "head.weight") == 0) {
        int32_t r0, n;

        dsv4_shard_vocab((int)shape0, rank, size, &r0, &n);
        part->row0 = r0;
        part->rows = n;
        return 1;
    }
    if (size <= 1 || l < 0)
        return 1;
    m = expert_matrix(rest, &shared, &e);
    if (m == 0 && (strncmp(rest, "ffn.experts.", 12) == 0 ||
                   strncmp(rest, "ffn.shared_experts.", 19) == 0))
        m = 3;   /* another tensor of an expert (none in the checkpoint today) */
    if (m != 0 && split == DSV4_GROUP_SPLIT_EP) {
        if (shared)
            return l % size == rank;
        return e >= rank * (c->n_routed_experts / size) &&
               e < (rank + 1) * (c->n_routed_experts / size);
    }
    if (m == 1) {   /* TP: w1 / w3 rows of this rank's slice of I */
        part->row0 = rank * per;
        part->rows = per;
    } else if (m == 2) {   /* TP: w2 columns */
        part->col0 = rank * (shape1 / size);
        part->cols = shape1 / size;
    }
    if (strncmp(rest, "attn.wo_b.", 10) == 0 && split == DSV4_GROUP_SPLIT_TP) {
        part->col0 = rank * (shape1 / size);   /* TP: this rank's wo_a outputs */
        part->cols = shape1 / size;
    } else if (strcmp(rest, "attn.attn_sink") == 0 || strncmp(rest, "attn.wq_b.", 10) == 0 ||
               strncmp(rest, "attn.wo_a.", 10) == 0 || strncmp(rest, "attn.wo_b.", 10) == 0) {
        part->row0 = rank * per;
        part->rows = per;
    }
    return 1;
}

/* Rows [r0, r0 + n) of L (r0, n multiples of 128 for FP8). */
static void
slice_rows(struct dsv4_linear *L, int64_t r0, int64_t n)
{
    int64_t k = L->n_in;

    if (L->w == NULL)
        return;
    switch (L->fmt) {
    case DSV4_WFMT_BF16:
        L->w = (const uint8_t *)L->w + r0 * k * 2;
        break;
    case DSV4_WFMT_FP8:
        L->w = (const uint8_t *)L->w + r0 * k;
        L->scale += (r0 / 128) * ((k + 127) / 128);
        break;
    case DSV4_WFMT_FP4:
        L->w = (const uint8_t *)L->w + r0 * k / 2;
        L->scale += r0 * (k / 32);
        break;
    }
    L->n_out = (int32_t)n;
}

/*
 * Columns [c0, c0 + n) of L (values; c0, n multiples of 128) copied to dst
 * (weights, then scales), L pointed at the copy; returns the bytes used
 * (dst == NULL: only counts them).
 */
static size_t
slice_cols(struct dsv4_linear *L, int64_t c0, int64_t n, uint8_t *dst)
{
    int64_t k = L->n_in, rows = L->n_out, wb, ws, sr, sb, ss;
    const uint8_t *w = L->w, *sc = L->scale;

    if (L->w == NULL)
        return 0;
    switch (L->fmt) {
    case DSV4_WFMT_FP8:   /* one byte a value; 128 x 128 scale blocks */
        wb = k, ws = n, sr = (rows + 127) / 128, sb = (k + 127) / 128, ss = n / 128;
        w += c0, sc += c0 / 128;
        break;
    case DSV4_WFMT_FP4:   /* two values a byte; one scale a 32 of a row */
        wb = k / 2, ws = n / 2, sr = rows, sb = k / 32, ss = n / 32;
        w += c0 / 2, sc += c0 / 32;
        break;
    default:              /* BF16 */
        wb = 2 * k, ws = 2 * n, sr = 0, sb = 0, ss = 0;
        w += 2 * c0;
        break;
    }
    if (dst != NULL) {
        for (int64_t r = 0; r < rows; r++)
            memcpy(dst + r * ws, w + r * wb, (size_t)ws);
        for (int64_t r = 0; r < sr; r++)
            memcpy(dst + rows * ws + r * ss, sc + r * sb, (size_t)ss);
        L->w = dst;
        L->scale = sr > 0 ? dst + rows * ws : NULL;
        L->n_in = (int32_t)n;
    }
    return (size_t)(rows * ws + sr * ss + 15) / 16 * 16;
}

/* Expert x cut to rank r's slice of I (TP split; see the header); its w2
 * columns copied to dst (NULL: counted only).  Returns the bytes used. */
static size_t
slice_expert(struct dsv4_expert_w *x, int rank, int size, uint8_t *dst)
{
    int64_t per = x->w1.n_out / size;

    if (x->w1.w == NULL)
        return 0;
    if (dst != NULL) {
        slice_rows(&x->w1, rank * per, per);
        slice_rows(&x->w3, rank * per, per);
    }
    return slice_cols(&x->w2, rank * per, per, dst);
}

/* What a view owns. */
struct shard_priv {
    struct dsv4_expert_w *ex;   /* [L * E] */
    uint8_t *cols;              /* TP: the w2 column copies */
};

enum dsv4_err
dsv4_weights_shard(struct dsv4_weights *out, const struct dsv4_weights *in, int rank, int size,
                   enum dsv4_group_split split)
{
    const struct dsv4_config *c = &in->cfg;
    int E = c->n_routed_experts, L = in->n_layers;
    int H = c->num_attention_heads, G = c->o_groups, D = c->hidden_size;
    int tp = size > 1 && split == DSV4_GROUP_SPLIT_TP;
    struct shard_priv *pv = NULL;
    size_t need = 0, at = 0;
    enum dsv4_err e;

    memset(out, 0, sizeof(*out));
    if (rank < 0 || rank >= size)
        return dsv4_err_set(DSV4_ERR_INVAL, "shard: rank %d of %d", rank, size);
    e = dsv4_shard_check(c, size, split);
    if (e != DSV4_OK)
        return e;
    for (int l = 0; tp && l < L; l++) {   /* bytes of the column copies */
        struct dsv4_expert_w x = in->layers[l].shared;
        struct dsv4_linear wo_b = in->layers[l].wo_b;

        need += slice_cols(&wo_b, 0, (int64_t)(G / size) * c->o_lora_rank, NULL);
        need += slice_expert(&x, rank, size, NULL);
        for (int i = 0; in->layers[l].experts != NULL && i < E; i++) {
            x = in->layers[l].experts[i];
            need += slice_expert(&x, rank, size, NULL);
        }
    }
    *out = *in;
    out->priv = NULL;
    out->layers = calloc((size_t)L + 1, sizeof(*out->layers));
    pv = calloc(1, sizeof(*pv));
    if (pv != NULL) {
        pv->ex = calloc((size_t)L * (E > 0 ? E : 1) + 1, sizeof(*pv->ex));
        pv->cols = need > 0 ? malloc(need) : NULL;
    }
    if (out->layers == NULL || pv == NULL || pv->ex == NULL || (need > 0 && pv->cols == NULL)) {
        free(out->layers);
        if (pv != NULL)
            free(pv->ex), free(pv->cols);
        free(pv);
        memset(out, 0, sizeof(*out));
        return dsv4_err_set(DSV4_ERR_NOMEM, "shard: no memory (%zu bytes of w2 columns)", need);
    }
    out->priv = pv;
    if (size > 1 && in->head != NULL) {   /* this rank's vocabulary rows */
        dsv4_shard_vocab(c->vocab_size, rank, size, &out->head_row0, &out->head_rows);
        out->head = in->head + (int64_t)out->head_row0 * D;
    }
    for (int l = 0; l < L; l++) {
        struct dsv4_layer_w *lw = &out->layers[l];
        int pe = E / size;

        *lw = in->layers[l];
        if (size > 1) {
            int64_t hr = (int64_t)H / size * c->head_dim;

            slice_rows(&lw->wq_b, rank * hr, hr);
            if (lw->attn_sink != NULL)
                lw->attn_sink += rank * (H / size);
            slice_rows(&lw->wo_a, (int64_t)rank * (G / size) * c->o_lora_rank,
                       (int64_t)(G / size) * c->o_lora_rank);
            if (tp) {   /* wo_b by its input columns: this rank's groups' */
                int64_t gr = (int64_t)(G / size) * c->o_lora_rank;

                at += slice_cols(&lw->wo_b, rank * gr, gr, pv->cols + at);
                at += slice_expert(&lw->shared, rank, size, pv->cols + at);
            } else {
                slice_rows(&lw->wo_b, (int64_t)rank * (D / size), D / size);
            }
            if (!tp && l % size != rank)
                memset(&lw->shared, 0, sizeof(lw->shared));
        }
        if (in->layers[l].experts != NULL) {
            lw->experts = pv->ex + (size_t)l * E;
            for (int x = 0; x < E; x++) {
                if (!tp && size > 1 && (x < rank * pe || x >= (rank + 1) * pe))
                    continue;   /* EP: another rank's */
                lw->experts[x] = in->layers[l].experts[x];
                if (tp)
                    at += slice_expert(&lw->experts[x], rank, size, pv->cols + at);
            }
        }
    }
    return DSV4_OK;
}

void
dsv4_weights_shard_free(struct dsv4_weights *w)
{
    struct shard_priv *pv;

    if (w == NULL)
        return;
    pv = w->priv;
    free(w->layers);
    if (pv != NULL)
        free(pv->ex), free(pv->cols);
    free(pv);
    memset(w, 0, sizeof(*w));
}
