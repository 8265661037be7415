/*
 * weights_shard.c — the per-rank part of the weights (weights_shard.h).
 */
#include "common/weights_shard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum dsv4_err
dsv4_shard_check(const struct dsv4_config *c, int size)
{
    int H = c->num_attention_heads, G = c->o_groups, D = c->hidden_size;
    int E = c->n_routed_experts;

    if (size < 1)
        return dsv4_err_set(DSV4_ERR_CONFIG, "shard: %d ranks", size);
    if (size == 1)
        return DSV4_OK;
    if (H % size != 0 || G % size != 0 || E % size != 0)
        return dsv4_err_set(DSV4_ERR_CONFIG, "shard: %d ranks do not divide the heads (%d), "
                            "output groups (%d) and experts (%d)", size, H, G, E);
    if ((int64_t)H / size * c->head_dim % 128 != 0 || c->o_lora_rank % 128 != 0 ||
        D % (128 * size) != 0)
        return dsv4_err_set(DSV4_ERR_CONFIG, "shard: %d ranks: a rank's query rows (%d), "
                            "o_lora_rank (%d) or output columns (%d) are not multiples of 128",
                            size, H / size * c->head_dim, c->o_lora_rank, D / size);
    return DSV4_OK;
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

int
dsv4_shard_rows(const struct dsv4_config *c, const char *name, int rank, int size,
                int64_t shape0, int64_t *row0, int64_t *rows)
{
    const char *rest = NULL;
    int l = layer_of(c, name, &rest), e, n = 0;
    int64_t per = shape0 / (size > 0 ? size : 1);

    *row0 = 0;
    *rows = shape0;
    if (size <= 1 || l < 0)
        return 1;
    if (sscanf(rest, "ffn.experts.%d.%n", &e, &n) == 1 && n > 0) {
        int pe = c->n_routed_experts / size;

        return e >= rank * pe && e < (rank + 1) * pe;
    }
    if (strncmp(rest, "ffn.shared_experts.", 19) == 0)
        return l % size == rank;
    if (strcmp(rest, "attn.attn_sink") == 0 || strncmp(rest, "attn.wq_b.", 10) == 0 ||
        strncmp(rest, "attn.wo_a.", 10) == 0 || strncmp(rest, "attn.wo_b.", 10) == 0) {
        *row0 = rank * per;
        *rows = per;
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

enum dsv4_err
dsv4_weights_shard(struct dsv4_weights *out, const struct dsv4_weights *in, int rank, int size)
{
    const struct dsv4_config *c = &in->cfg;
    int E = c->n_routed_experts, L = in->n_layers;
    int H = c->num_attention_heads, G = c->o_groups, D = c->hidden_size;
    struct dsv4_expert_w *ex = NULL;
    enum dsv4_err e;

    memset(out, 0, sizeof(*out));
    if (rank < 0 || rank >= size)
        return dsv4_err_set(DSV4_ERR_INVAL, "shard: rank %d of %d", rank, size);
    e = dsv4_shard_check(c, size);
    if (e != DSV4_OK)
        return e;
    *out = *in;
    out->priv = NULL;
    out->layers = calloc((size_t)L + 1, sizeof(*out->layers));
    ex = calloc((size_t)L * (E > 0 ? E : 1) + 1, sizeof(*ex));
    if (out->layers == NULL || ex == NULL) {
        free(out->layers);
        free(ex);
        memset(out, 0, sizeof(*out));
        return dsv4_err_set(DSV4_ERR_NOMEM, "shard: no memory");
    }
    out->priv = ex;
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
            slice_rows(&lw->wo_b, (int64_t)rank * (D / size), D / size);
            if (l % size != rank)
                memset(&lw->shared, 0, sizeof(lw->shared));
        }
        if (in->layers[l].experts != NULL) {
            lw->experts = ex + (size_t)l * E;
            for (int x = 0; x < E; x++)
                if (size == 1 || (x >= rank * pe && x < (rank + 1) * pe))
                    lw->experts[x] = in->layers[l].experts[x];
        }
    }
    return DSV4_OK;
}

void
dsv4_weights_shard_free(struct dsv4_weights *w)
{
    if (w == NULL)
        return;
    free(w->layers);
    free(w->priv);
    memset(w, 0, sizeof(*w));
}
