/*
 * model_tensors.c — the tensor inventory of a DeepSeek-V4 checkpoint for a
 * given config (model doc §2.1, §2.4, §2.5).
 *
 * Names are those of the official checkpoint (no "model." prefix).  Order:
 * shard 1 embed.weight; shard 2+L layer L; shard 2+n_layers the final
 * hc_head/norm/head; last shard the MTP layer(s).  Inside a shard, tensors are
 * grouped by element size, largest first (I64, F32, BF16, then 1-byte types),
 * so every tensor is naturally aligned in the file; within a group the order
 * is that of the model doc's table (mHC, norms, attention, compressor,
 * indexer, router, shared expert, routed experts).  Each FP8/FP4 ".weight" is
 * immediately followed by its ".scale" (dsv4-mkmodel relies on that).
 *
 * Dimension names: D hidden, H heads, Dh head_dim, Rq q_lora_rank, G o_groups,
 * R o_lora_rank, I moe_intermediate_size, E routed experts, n hc_mult.
 */
#include "common/model_tensors.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct inv_builder {
    struct dsv4_inventory *inv;
    int cap;
    int shard;               /* shard of what is added now */
    int layer;               /* layer id of what is added now (-1 top level) */
    const char *prefix;      /* "layers.3." / "mtp.0." / "" */
    enum dsv4_err err;
};

static void add(struct inv_builder *b, enum dsv4_tkind kind, enum dsv4_st_dtype dt,
                int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/*
 * Append one tensor named prefix + fmt; d1 < 0 makes it 1-D [d0].  Errors
 * stick in b->err (later calls do nothing).
 */
static void
add(struct inv_builder *b, enum dsv4_tkind kind, enum dsv4_st_dtype dt, int64_t d0, int64_t d1,
    const char *fmt, ...)
{
    struct dsv4_inventory *inv = b->inv;
    struct dsv4_tensor_spec *s;
    char tail[96];
    va_list ap;

    if (b->err != DSV4_OK)
        return;
    if (inv->n == b->cap) {
        int cap = b->cap ? b->cap * 2 : 1024;
        struct dsv4_tensor_spec *t = realloc(inv->t, (size_t)cap * sizeof(*t));
        if (t == NULL) {
            b->err = dsv4_err_set(DSV4_ERR_NOMEM, "tensor inventory: out of memory");
            return;
        }
        inv->t = t;
        b->cap = cap;
    }
    s = &inv->t[inv->n];
    memset(s, 0, sizeof(*s));
    va_start(ap, fmt);
    vsnprintf(tail, sizeof(tail), fmt, ap);
    va_end(ap);
    if ((size_t)snprintf(s->name, sizeof(s->name), "%s%s", b->prefix, tail) >= sizeof(s->name)) {
        b->err = dsv4_err_set(DSV4_ERR_INVAL, "tensor inventory: name too long: %s%s",
                              b->prefix, tail);
        return;
    }
    s->dtype = dt;
    s->n_dims = d1 < 0 ? 1 : 2;
    s->shape[0] = d0;
    s->shape[1] = d1 < 0 ? 0 : d1;
    s->shard = b->shard;
    s->kind = kind;
    s->layer = b->layer;
    inv->total_bytes += dsv4_tensor_spec_bytes(s);
    inv->n++;
}

/* FP8 linear `name` [out, in]: weight + 128x128-block E8M0 scale. */
static void
add_fp8(struct inv_builder *b, const char *name, int64_t out, int64_t in)
{
    add(b, DSV4_TK_FP8_WEIGHT, DSV4_ST_F8_E4M3, out, in, "%s.weight", name);
    add(b, DSV4_TK_FP8_SCALE, DSV4_ST_F8_E8M0, (out + 127) / 128, (in + 127) / 128, "%s.scale",
        name);
}

/* FP4 expert linear `name` logical [out, in]: packed pairs + 1x32 E8M0 scale. */
static void
add_fp4(struct inv_builder *b, const char *name, int64_t out, int64_t in)
{
    add(b, DSV4_TK_FP4_WEIGHT, DSV4_ST_I8, out, in / 2, "%s.weight", name);
    add(b, DSV4_TK_FP4_SCALE, DSV4_ST_F8_E8M0, out, in / 32, "%s.scale", name);
}

/* Compressor `name` of ratio r and entry width d (model doc §3.3.4). */
static void
add_compressor(struct inv_builder *b, const struct dsv4_config *c, const char *name, int r,
               int64_t d)
{
    int64_t cd = (r == 4 ? 2 : 1) * d;

    add(b, DSV4_TK_APE, DSV4_ST_F32, r, cd, "%s.ape", name);
    add(b, DSV4_TK_LINEAR_BF16, DSV4_ST_BF16, cd, c->hidden_size, "%s.wkv.weight", name);
    add(b, DSV4_TK_LINEAR_BF16, DSV4_ST_BF16, cd, c->hidden_size, "%s.wgate.weight", name);
    add(b, DSV4_TK_NORM, DSV4_ST_BF16, d, -1, "%s.norm.weight", name);
}

/* The mHC collapse parameters (top level "hc_head_*" or MTP's own). */
static void
add_hc_head(struct inv_builder *b, const struct dsv4_config *c)
{
    int64_t n = c->hc_mult;

    add(b, DSV4_TK_HC_FN, DSV4_ST_F32, n, n * c->hidden_size, "hc_head_fn");
    add(b, DSV4_TK_HC_BASE, DSV4_ST_F32, n, -1, "hc_head_base");
    add(b, DSV4_TK_HC_SCALE, DSV4_ST_F32, 1, -1, "hc_head_scale");
}

/* Everything of one transformer block (main layer or MTP), prefix set. */
static void
add_layer(struct inv_builder *b, const struct dsv4_config *c, int layer)
{
    int64_t D = c->hidden_size, H = c->num_attention_heads, Dh = c->head_dim;
    int64_t Rq = c->q_lora_rank, G = c->o_groups, R = c->o_lora_rank;
    int64_t I = c->moe_intermediate_size, n = c->hc_mult;
    int64_t mix = (2 + n) * n;
    int r = c->compress_ratios[layer];
    char name[32];

    add(b, DSV4_TK_HC_FN, DSV4_ST_F32, mix, n * D, "hc_attn_fn");
    add(b, DSV4_TK_HC_FN, DSV4_ST_F32, mix, n * D, "hc_ffn_fn");
    add(b, DSV4_TK_HC_BASE, DSV4_ST_F32, mix, -1, "hc_attn_base");
    add(b, DSV4_TK_HC_BASE, DSV4_ST_F32, mix, -1, "hc_ffn_base");
    add(b, DSV4_TK_HC_SCALE, DSV4_ST_F32, 3, -1, "hc_attn_scale");
    add(b, DSV4_TK_HC_SCALE, DSV4_ST_F32, 3, -1, "hc_ffn_scale");
    add(b, DSV4_TK_NORM, DSV4_ST_BF16, D, -1, "attn_norm.weight");
    add(b, DSV4_TK_NORM, DSV4_ST_BF16, D, -1, "ffn_norm.weight");

    /* attention */
    add(b, DSV4_TK_SINK, DSV4_ST_F32, H, -1, "attn.attn_sink");
    add_fp8(b, "attn.wq_a", Rq, D);
    add(b, DSV4_TK_NORM, DSV4_ST_BF16, Rq, -1, "attn.q_norm.weight");
    add_fp8(b, "attn.wq_b", H * Dh, Rq);
    add_fp8(b, "attn.wkv", Dh, D);
    add(b, DSV4_TK_NORM, DSV4_ST_BF16, Dh, -1, "attn.kv_norm.weight");
    add_fp8(b, "attn.wo_a", G * R, H * Dh / G);
    add_fp8(b, "attn.wo_b", D, G * R);
    if (r != 0)
        add_compressor(b, c, "attn.compressor", r, Dh);
    if (r == 4) {
        int64_t nI = c->index_n_heads, dI = c->index_head_dim;
        add_fp8(b, "attn.indexer.wq_b", nI * dI, Rq);
        add(b, DSV4_TK_LINEAR_BF16, DSV4_ST_BF16, nI, D, "attn.indexer.weights_proj.weight");
        add_compressor(b, c, "attn.indexer.compressor", r, dI);
    }

    /* MoE */
    add(b, DSV4_TK_LINEAR_BF16, DSV4_ST_BF16, c->n_routed_experts, D, "ffn.gate.weight");
    if (dsv4_config_is_hash(c, layer))
        add(b, DSV4_TK_TID2EID, DSV4_ST_I64, c->vocab_size, c->num_experts_per_tok,
            "ffn.gate.tid2eid");
    else
        add(b, DSV4_TK_GATE_BIAS, DSV4_ST_F32, c->n_routed_experts, -1, "ffn.gate.bias");
    add_fp8(b, "ffn.shared_experts.w1", I, D);
    add_fp8(b, "ffn.shared_experts.w3", I, D);
    add_fp8(b, "ffn.shared_experts.w2", D, I);
    for (int e = 0; e < c->n_routed_experts; e++) {
        snprintf(name, sizeof(name), "ffn.experts.%d.w1", e);
        add_fp4(b, name, I, D);
        snprintf(name, sizeof(name), "ffn.experts.%d.w3", e);
        add_fp4(b, name, I, D);
        snprintf(name, sizeof(name), "ffn.experts.%d.w2", e);
        add_fp4(b, name, D, I);
    }
}

/*
 * Reorder each shard's tensors by element size, largest first (stable), so
 * that with an 8-aligned data area every tensor is naturally aligned in the
 * file, as the safetensors library does when it writes.  A quantized weight
 * and its scale are both 1-byte types, so the scale still follows it.
 */
static enum dsv4_err
align_order(struct dsv4_inventory *inv)
{
    static const size_t sizes[] = { 8, 4, 2, 1 };
    struct dsv4_tensor_spec *t = malloc((size_t)inv->n * sizeof(*t));
    int n = 0;

    if (t == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "tensor inventory: out of memory");
    for (int first = 0; first < inv->n; ) {
        int last = first;
        while (last < inv->n && inv->t[last].shard == inv->t[first].shard)
            last++;
        for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++)
            for (int i = first; i < last; i++)
                if (dsv4_st_dtype_size(inv->t[i].dtype) == sizes[k])
                    t[n++] = inv->t[i];
        first = last;
    }
    if (n != inv->n) {
        free(t);
        return dsv4_err_set(DSV4_ERR_INVAL, "tensor inventory: unexpected dtype size");
    }
    free(inv->t);
    inv->t = t;
    return DSV4_OK;
}

enum dsv4_err
dsv4_inventory_build(struct dsv4_inventory *inv, const struct dsv4_config *cfg)
{
    struct inv_builder b = { .inv = inv, .layer = -1, .prefix = "" };
    int L = cfg->num_hidden_layers, n_mtp = dsv4_config_n_mtp(cfg);
    int64_t D = cfg->hidden_size;
    char prefix[32];
    enum dsv4_err e;

    memset(inv, 0, sizeof(*inv));
    e = dsv4_config_validate(cfg);
    if (e != DSV4_OK)
        return e;
    inv->n_shards = 2 + L + (n_mtp > 0);

    b.shard = 1;
    add(&b, DSV4_TK_EMBED, DSV4_ST_BF16, cfg->vocab_size, D, "embed.weight");
    for (int l = 0; l < L; l++) {
        snprintf(prefix, sizeof(prefix), "layers.%d.", l);
        b.prefix = prefix;
        b.shard = 2 + l;
        b.layer = l;
        add_layer(&b, cfg, l);
    }
    b.prefix = "";
    b.shard = 2 + L;
    b.layer = -1;
    add_hc_head(&b, cfg);
    add(&b, DSV4_TK_NORM, DSV4_ST_BF16, D, -1, "norm.weight");
    add(&b, DSV4_TK_HEAD, DSV4_ST_BF16, cfg->vocab_size, D, "head.weight");
    for (int m = 0; m < n_mtp; m++) {
        snprintf(prefix, sizeof(prefix), "mtp.%d.", m);
        b.prefix = prefix;
        b.shard = 3 + L;
        b.layer = L + m;
        add_layer(&b, cfg, L + m);
        add_fp8(&b, "e_proj", D, D);
        add_fp8(&b, "h_proj", D, D);
        add(&b, DSV4_TK_NORM, DSV4_ST_BF16, D, -1, "enorm.weight");
        add(&b, DSV4_TK_NORM, DSV4_ST_BF16, D, -1, "hnorm.weight");
        add(&b, DSV4_TK_NORM, DSV4_ST_BF16, D, -1, "norm.weight");
        add_hc_head(&b, cfg);
    }
    if (b.err == DSV4_OK)
        b.err = align_order(inv);
    if (b.err != DSV4_OK) {
        dsv4_inventory_free(inv);
        return b.err;
    }
    return DSV4_OK;
}

void
dsv4_inventory_free(struct dsv4_inventory *inv)
{
    free(inv->t);
    memset(inv, 0, sizeof(*inv));
}

uint64_t
dsv4_tensor_spec_bytes(const struct dsv4_tensor_spec *s)
{
    uint64_t n = dsv4_st_dtype_size(s->dtype);

    for (int i = 0; i < s->n_dims; i++)
        n *= (uint64_t)s->shape[i];
    return n;
}

void
dsv4_shard_name(char *buf, size_t len, int shard, int n_shards)
{
    snprintf(buf, len, "model-%05d-of-%05d.safetensors", shard, n_shards);
}
