/*
 * weights.c — load a checkpoint directory into struct dsv4_weights (host
 * pointers into the read-only shard mappings), after checking it against the
 * inventory implied by its config.json (model doc §2.4).
 *
 * Order of work: config.json -> inventory -> open every shard (the reader
 * validates each file and the index) -> every inventory tensor present with
 * its exact dtype and shape -> no tensor outside the inventory -> no NaN
 * (0xFF) E8M0 scale -> fill the per-layer structs.  Nothing is handed out
 * unless all of it passed; errors name the file and the tensor.
 *
 * Alignment: the official writer orders data by element size, so typed
 * tensors (F32, BF16, I64) start aligned.  A file that does not (any other
 * writer may lay tensors out in any order) still loads: such a tensor is
 * copied once into an aligned buffer owned by the weights.
 */
#include "common/weights.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model_tensors.h"
#include "common/safetensors.h"

struct weights_priv {
    struct dsv4_ckpt *ck;
    struct dsv4_expert_w *experts;  /* [n_layers * E] */
    void **copies;                  /* aligned copies of misaligned tensors */
    int n_copies, cap_copies;
};

/* Fill context: the first error sticks and later lookups do nothing. */
struct fill {
    struct dsv4_weights *w;
    struct weights_priv *p;
    const char *dir;
    const char *prefix;             /* "layers.3." / "mtp.0." / "" */
    enum dsv4_err err;
};

/* --- checking --------------------------------------------------------- */

static void
fmt_shape(char *buf, size_t len, int n_dims, const int64_t *shape)
{
    size_t o = 0;

    o += (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < n_dims && o < len; d++)
        o += (size_t)snprintf(buf + o, len - o, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (o < len)
        snprintf(buf + o, len - o, "]");
}

/* Whether a file of the checkpoint (one that holds a tensor) is named
 * `base` (a base name). */
static int
ckpt_has_file(const struct dsv4_ckpt *ck, const char *base)
{
    const char *prev = NULL;

    for (int i = 0; i < dsv4_ckpt_count(ck); i++) {
        const char *f = dsv4_ckpt_at(ck, i)->file, *b;

        if (f == prev)   /* the tensors come file by file */
            continue;
        prev = f;
        b = strrchr(f, '/');
        if (strcmp(b != NULL ? b + 1 : f, base) == 0)
            return 1;
    }
    return 0;
}

/* One inventory entry against what the checkpoint holds; the I64 tensors
 * (the hash layers' tid2eid) must hold expert ids below n_experts. */
static enum dsv4_err
check_tensor(const struct dsv4_ckpt *ck, const struct dsv4_tensor_spec *s, const char *dir,
             int n_shards, int n_experts)
{
    const struct dsv4_st_tensor *t = dsv4_ckpt_find(ck, s->name);
    char want[96], got[96];
    const void *ff;

    if (t == NULL) {
        char shard[64];

        /* the official layout's shard is named as a file only when the
         * checkpoint has that file (a single model.safetensors, or shards
         * of other names, do not) */
        dsv4_shard_name(shard, sizeof(shard), s->shard, n_shards);
        fmt_shape(want, sizeof(want), s->n_dims, s->shape);
        if (ckpt_has_file(ck, shard))
            return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s/%s: tensor '%s': missing (expected %s %s)",
                                dir, shard, s->name, dsv4_st_dtype_name(s->dtype), want);
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': missing (expected %s %s; "
                            "shard %d of %d in the official layout)", dir, s->name,
                            dsv4_st_dtype_name(s->dtype), want, s->shard, n_shards);
    }
    if (t->dtype != s->dtype)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': dtype %s, expected %s", t->file,
                            s->name, dsv4_st_dtype_name(t->dtype), dsv4_st_dtype_name(s->dtype));
    if (t->n_dims != s->n_dims || memcmp(t->shape, s->shape, (size_t)s->n_dims * sizeof(int64_t))) {
        fmt_shape(want, sizeof(want), s->n_dims, s->shape);
        fmt_shape(got, sizeof(got), t->n_dims, t->shape);
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': shape %s, expected %s", t->file,
                            s->name, got, want);
    }
    if (t->dtype == DSV4_ST_F8_E8M0 && (ff = memchr(t->data, 0xff, t->n_bytes)) != NULL)
        return dsv4_err_set(DSV4_ERR_WEIGHTS,
                            "%s: tensor '%s': NaN scale (E8M0 0xFF) at element %zu", t->file,
                            s->name, (size_t)((const uint8_t *)ff - (const uint8_t *)t->data));
    if (t->dtype == DSV4_ST_I64) {
        for (size_t i = 0; i < t->n_bytes / sizeof(int64_t); i++) {
            int64_t v;

            memcpy(&v, (const uint8_t *)t->data + i * sizeof(v), sizeof(v));
            if (v < 0 || v >= n_experts)
                return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': expert id %lld at "
                                    "element %zu (n_routed_experts %d)", t->file, s->name,
                                    (long long)v, i, n_experts);
        }
    }
    return DSV4_OK;
}

static int
cmp_spec_name(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Every inventory tensor present and right; nothing else in the checkpoint. */
static enum dsv4_err
check_all(const struct dsv4_ckpt *ck, const struct dsv4_inventory *inv, const char *dir,
          int n_experts)
{
    const char **names;
    enum dsv4_err err;

    for (int i = 0; i < inv->n; i++) {
        err = check_tensor(ck, &inv->t[i], dir, inv->n_shards, n_experts);
        if (err != DSV4_OK)
            return err;
    }
    /* all inventory names are present and checkpoint names are unique, so an
     * unexpected tensor exists iff the counts differ; find it by name */
    if (dsv4_ckpt_count(ck) == inv->n)
        return DSV4_OK;
    names = malloc((size_t)inv->n * sizeof(*names) + 1);
    if (names == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", dir);
    for (int i = 0; i < inv->n; i++)
        names[i] = inv->t[i].name;
    qsort(names, (size_t)inv->n, sizeof(*names), cmp_spec_name);
    err = DSV4_OK;
    for (int i = 0; i < dsv4_ckpt_count(ck); i++) {
        const struct dsv4_st_tensor *t = dsv4_ckpt_at(ck, i);

        if (bsearch(&t->name, names, (size_t)inv->n, sizeof(*names), cmp_spec_name) == NULL) {
            err = dsv4_err_set(DSV4_ERR_WEIGHTS,
                               "%s: tensor '%s': unexpected (not part of this config's model)",
                               t->file, t->name);
            break;
        }
    }
    free(names);
    return err;
}

/* --- filling ------------------------------------------------------------ */

/* The checkpoint tensor prefix + name (NULL, with f->err set, if absent). */
static const struct dsv4_st_tensor *
get_t(struct fill *f, const char *name)
{
    const struct dsv4_st_tensor *t;
    char full[160];

    if (f->err != DSV4_OK)
        return NULL;
    snprintf(full, sizeof(full), "%s%s", f->prefix, name);
    t = dsv4_ckpt_find(f->p->ck, full);
    if (t == NULL)
        f->err = dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': missing", f->dir, full);
    return t;
}

/* Data of a tensor, aligned for its element type (copied if the file's
 * layout leaves it misaligned). */
static const void *
data_of(struct fill *f, const struct dsv4_st_tensor *t)
{
    struct weights_priv *p = f->p;
    void *c;

    if (t == NULL)
        return NULL;
    if ((uintptr_t)t->data % dsv4_st_dtype_size(t->dtype) == 0)
        return t->data;
    if (p->n_copies == p->cap_copies) {
        int cap = p->cap_copies ? 2 * p->cap_copies : 64;
        void **nc = realloc(p->copies, (size_t)cap * sizeof(*nc));

        if (nc == NULL)
            goto nomem;
        p->copies = nc;
        p->cap_copies = cap;
    }
    c = aligned_alloc(64, (t->n_bytes + 63) & ~(size_t)63);
    if (c == NULL)
        goto nomem;
    memcpy(c, t->data, t->n_bytes);
    p->copies[p->n_copies++] = c;
    return c;
nomem:
    f->err = dsv4_err_set(DSV4_ERR_NOMEM, "%s: tensor '%s': out of memory", t->file, t->name);
    return NULL;
}

static const void *
get(struct fill *f, const char *name)
{
    return data_of(f, get_t(f, name));
}

/* A Linear `name`: weight (+ scale unless bf16); n_in is logical (FP4 holds
 * two values per stored byte). */
static struct dsv4_linear
get_linear(struct fill *f, const char *name, enum dsv4_wfmt fmt)
{
    struct dsv4_linear l = { .fmt = fmt };
    const struct dsv4_st_tensor *t;
    char n[128];

    snprintf(n, sizeof(n), "%s.weight", name);
    t = get_t(f, n);
    if (t == NULL)
        return l;
    l.w = data_of(f, t);
    l.n_out = (int32_t)t->shape[0];
    l.n_in = (int32_t)(fmt == DSV4_WFMT_FP4 ? 2 * t->shape[1] : t->shape[1]);
    if (fmt != DSV4_WFMT_BF16) {
        snprintf(n, sizeof(n), "%s.scale", name);
        l.scale = get(f, n);
    }
    return l;
}

/* mHC parameters "<site>_fn", "<site>_base", "<site>_scale". */
static struct dsv4_hc_w
get_hc(struct fill *f, const char *site)
{
    struct dsv4_hc_w h;
    char n[64];

    snprintf(n, sizeof(n), "%s_fn", site);
    h.fn = get(f, n);
    snprintf(n, sizeof(n), "%s_base", site);
    h.base = get(f, n);
    snprintf(n, sizeof(n), "%s_scale", site);
    h.scale = get(f, n);
    return h;
}

static struct dsv4_compressor_w
get_compressor(struct fill *f, const char *name, int ratio)
{
    struct dsv4_compressor_w c = { .ratio = ratio };
    const struct dsv4_st_tensor *t;
    char n[96];

    snprintf(n, sizeof(n), "%s.ape", name);
    c.ape = get(f, n);
    snprintf(n, sizeof(n), "%s.wkv", name);
    c.wkv = get_linear(f, n, DSV4_WFMT_BF16);
    snprintf(n, sizeof(n), "%s.wgate", name);
    c.wgate = get_linear(f, n, DSV4_WFMT_BF16);
    snprintf(n, sizeof(n), "%s.norm.weight", name);
    t = get_t(f, n);
    c.norm = data_of(f, t);
    c.dim = t != NULL ? (int32_t)t->shape[0] : 0;
    return c;
}

static struct dsv4_expert_w
get_expert(struct fill *f, const char *name, enum dsv4_wfmt fmt)
{
    struct dsv4_expert_w e;
    char n[64];

    snprintf(n, sizeof(n), "%s.w1", name);
    e.w1 = get_linear(f, n, fmt);
    snprintf(n, sizeof(n), "%s.w3", name);
    e.w3 = get_linear(f, n, fmt);
    snprintf(n, sizeof(n), "%s.w2", name);
    e.w2 = get_linear(f, n, fmt);
    return e;
}

/* Layer `id`: main layers are "layers.<id>.", MTP layer m is "mtp.<m>.". */
static void
fill_layer(struct fill *f, struct dsv4_layer_w *lw, int id, struct dsv4_expert_w *experts)
{
    const struct dsv4_config *c = &f->w->cfg;
    int L = c->num_hidden_layers, E = c->n_routed_experts;
    char prefix[32], n[48];

    if (id < L)
        snprintf(prefix, sizeof(prefix), "layers.%d.", id);
    else
        snprintf(prefix, sizeof(prefix), "mtp.%d.", id - L);
    f->prefix = prefix;
    memset(lw, 0, sizeof(*lw));
    lw->id = id;
    lw->ratio = c->compress_ratios[id];

    lw->hc_attn = get_hc(f, "hc_attn");
    lw->hc_ffn = get_hc(f, "hc_ffn");
    lw->attn_norm = get(f, "attn_norm.weight");
    lw->ffn_norm = get(f, "ffn_norm.weight");

    lw->attn_sink = get(f, "attn.attn_sink");
    lw->wq_a = get_linear(f, "attn.wq_a", DSV4_WFMT_FP8);
    lw->q_norm = get(f, "attn.q_norm.weight");
    lw->wq_b = get_linear(f, "attn.wq_b", DSV4_WFMT_FP8);
    lw->wkv = get_linear(f, "attn.wkv", DSV4_WFMT_FP8);
    lw->kv_norm = get(f, "attn.kv_norm.weight");
    lw->wo_a = get_linear(f, "attn.wo_a", DSV4_WFMT_FP8);
    lw->wo_b = get_linear(f, "attn.wo_b", DSV4_WFMT_FP8);
    if (lw->ratio != 0)
        lw->compressor = get_compressor(f, "attn.compressor", lw->ratio);
    if (lw->ratio == 4) {
        lw->idx_wq_b = get_linear(f, "attn.indexer.wq_b", DSV4_WFMT_FP8);
        lw->idx_weights_proj = get_linear(f, "attn.indexer.weights_proj", DSV4_WFMT_BF16);
        lw->idx_compressor = get_compressor(f, "attn.indexer.compressor", lw->ratio);
    }

    lw->gate = get_linear(f, "ffn.gate", DSV4_WFMT_BF16);
    if (dsv4_config_is_hash(c, id))
        lw->tid2eid = get(f, "ffn.gate.tid2eid");
    else
        lw->gate_bias = get(f, "ffn.gate.bias");
    lw->shared = get_expert(f, "ffn.shared_experts", DSV4_WFMT_FP8);
    lw->experts = experts;
    for (int e = 0; e < E; e++) {
        snprintf(n, sizeof(n), "ffn.experts.%d", e);
        experts[e] = get_expert(f, n, DSV4_WFMT_FP4);
    }

    if (id >= L) {
        lw->e_proj = get_linear(f, "e_proj", DSV4_WFMT_FP8);
        lw->h_proj = get_linear(f, "h_proj", DSV4_WFMT_FP8);
        lw->enorm = get(f, "enorm.weight");
        lw->hnorm = get(f, "hnorm.weight");
        lw->mtp_norm = get(f, "norm.weight");
        lw->hc_head = get_hc(f, "hc_head");
    }
}

static enum dsv4_err
fill_all(struct fill *f)
{
    struct dsv4_weights *w = f->w;
    const struct dsv4_config *c = &w->cfg;
    int E = c->n_routed_experts;

    w->n_layers = c->num_hidden_layers + dsv4_config_n_mtp(c);
    w->layers = calloc((size_t)w->n_layers + 1, sizeof(*w->layers));
    f->p->experts = calloc((size_t)w->n_layers * (size_t)E + 1, sizeof(*f->p->experts));
    if (w->layers == NULL || f->p->experts == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", f->dir);

    f->prefix = "";
    w->embed = get(f, "embed.weight");
    w->head = get(f, "head.weight");
    w->norm = get(f, "norm.weight");
    w->hc_head = get_hc(f, "hc_head");
    for (int i = 0; i < w->n_layers; i++)
        fill_layer(f, &w->layers[i], i, f->p->experts + (size_t)i * (size_t)E);
    return f->err;
}

/* --- public ------------------------------------------------------------- */

void
dsv4_weights_free(struct dsv4_weights *w)
{
    struct weights_priv *p;

    if (w == NULL)
        return;
    p = w->priv;
    if (p != NULL) {
        for (int i = 0; i < p->n_copies; i++)
            free(p->copies[i]);
        free(p->copies);
        free(p->experts);
        dsv4_ckpt_close(p->ck);
        free(p);
    }
    free(w->layers);
    memset(w, 0, sizeof(*w));
}

enum dsv4_err
dsv4_weights_load(struct dsv4_weights *w, const char *dir)
{
    struct dsv4_inventory inv = { 0 };
    struct fill f = { .w = w, .dir = dir };
    struct weights_priv *p;
    enum dsv4_err err;
    char path[4096];

    memset(w, 0, sizeof(*w));
    if ((size_t)snprintf(path, sizeof(path), "%s/config.json", dir) >= sizeof(path))
        return dsv4_err_set(DSV4_ERR_INVAL, "%s: path too long", dir);
    err = dsv4_config_load(&w->cfg, path);
    if (err != DSV4_OK)
        return err;
    p = calloc(1, sizeof(*p));
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", dir);
    w->priv = p;
    f.p = p;

    err = dsv4_inventory_build(&inv, &w->cfg);
    if (err != DSV4_OK)
        goto fail;
    err = dsv4_ckpt_open(&p->ck, dir);
    if (err != DSV4_OK)
        goto fail;
    err = check_all(p->ck, &inv, dir, w->cfg.n_routed_experts);
    if (err != DSV4_OK)
        goto fail;
    err = fill_all(&f);
    if (err != DSV4_OK)
        goto fail;
    w->ckpt = p->ck;
    dsv4_inventory_free(&inv);
    return DSV4_OK;
fail:
    dsv4_inventory_free(&inv);
    dsv4_weights_free(w);
    return err;
}
