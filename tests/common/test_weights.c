/*
 * test_weights.c — dsv4_weights_load on a checkpoint written by dsv4-mkmodel
 * (path given as argv[1]; `--preset tiny`), and on copies of it broken in one
 * way each: wrong dtype, wrong shape, missing tensor, unexpected tensor, NaN
 * E8M0 scale, truncated shard, bad config.json, a FIFO for config.json, a
 * single-file checkpoint missing a tensor.  Each must fail with a message
 * naming the file (or, for a missing tensor, the file the checkpoint has or
 * its directory) and the tensor.  The good checkpoint's views are
 * checked against the reader and against dimensions derived from the config.
 * The model fingerprint (dsv4_ckpt_fingerprint): equal for the same
 * checkpoint, different for another seed's and for synthetic weights; of
 * loaded weights, the loaded checkpoint's even after its directory was
 * replaced.
 */
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <json-c/json.h>

#include "common/safetensors.h"
#include "common/weights.h"
#include "common/weights_fp.h"
#include "common/weights_shard.h"

static const char *mkmodel;
static char tmpdir[512];
static char good[600];     /* tmpdir/good: the untouched checkpoint */

static int
rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

/* dsv4-mkmodel --preset tiny --seed SEED --out DIR; 0 when it succeeded. */
static int
run_mkmodel(const char *seed, const char *dir)
{
    int status;
    pid_t pid = fork();

    if (pid == 0) {
        execl(mkmodel, mkmodel, "--preset", "tiny", "--seed", seed, "--out", dir, (char *)NULL);
        _exit(127);
    }
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
        fprintf(stderr, "%s failed\n", mkmodel);
        return -1;
    }
    return 0;
}

static int
setup(void **state)
{
    const char *base = getenv("TMPDIR");

    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "%s/dsv4-w-XXXXXX", base ? base : "/tmp");
    if (mkdtemp(tmpdir) == NULL)
        return -1;
    snprintf(good, sizeof(good), "%s/good", tmpdir);
    return run_mkmodel("7", good);
}

static int
teardown(void **state)
{
    (void)state;
    return nftw(tmpdir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* --- building broken copies ------------------------------------------------ */

static void
copy_file(const char *from, const char *to, long keep)
{
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    char buf[1 << 16];
    long left = keep;
    size_t n;

    assert_non_null(in);
    assert_non_null(out);
    while ((n = fread(buf, 1, sizeof(buf), in)) > 0) {
        if (keep >= 0 && (long)n > left)
            n = (size_t)left;
        assert_int_equal(fwrite(buf, 1, n, out), n);
        left -= (long)n;
        if (keep >= 0 && left == 0)
            break;
    }
    fclose(in);
    assert_int_equal(fclose(out), 0);
}

/* Copy the good checkpoint to tmpdir/<name>; returns the new path. */
static const char *
clone(const char *name)
{
    static char dir[700];
    char from[1024], to[1024];
    struct dirent **ents;
    int n;

    snprintf(dir, sizeof(dir), "%s/%s", tmpdir, name);
    assert_int_equal(mkdir(dir, 0755), 0);
    n = scandir(good, &ents, NULL, alphasort);
    assert_true(n > 0);
    for (int i = 0; i < n; i++) {
        if (ents[i]->d_name[0] != '.') {
            snprintf(from, sizeof(from), "%s/%s", good, ents[i]->d_name);
            snprintf(to, sizeof(to), "%s/%s", dir, ents[i]->d_name);
            copy_file(from, to, -1);
        }
        free(ents[i]);
    }
    free(ents);
    return dir;
}

/* Base name of the shard that holds `tensor` in the good checkpoint. */
static void
shard_of(const char *tensor, char *buf, size_t len)
{
    struct dsv4_ckpt *c;
    const struct dsv4_st_tensor *t;

    assert_int_equal(dsv4_ckpt_open(&c, good), DSV4_OK);
    t = dsv4_ckpt_find(c, tensor);
    assert_non_null(t);
    snprintf(buf, len, "%s", strrchr(t->file, '/') + 1);
    dsv4_ckpt_close(c);
}

enum edit_op { ED_DTYPE, ED_SHAPE, ED_DROP, ED_ADD, ED_POKE };

struct edit {
    enum edit_op op;
    const char *tensor;           /* tensor edited (or next to which one is added) */
    enum dsv4_st_dtype dtype;     /* ED_DTYPE, ED_ADD */
    int n_dims;                   /* ED_SHAPE, ED_ADD */
    int64_t shape[2];
    const char *new_name;         /* ED_ADD */
    size_t poke_at;               /* ED_POKE: byte set to 0xFF */
};

/* Rewrite shard `path` with one edit applied (zeros for changed data). */
static void
rewrite_shard(const char *path, const struct edit *ed)
{
    struct dsv4_st_file *f;
    struct dsv4_st_writer *w;
    char tmp[1100];
    int n, m = 0;

    assert_int_equal(dsv4_st_open(&f, path), DSV4_OK);
    n = dsv4_st_count(f);
    {
        const char *names[n + 1];
        enum dsv4_st_dtype dt[n + 1];
        int nd[n + 1];
        int64_t sh[n + 1][DSV4_ST_MAX_DIMS];
        const void *src[n + 1];
        size_t nb[n + 1];

        memset(sh, 0, sizeof(sh));
        for (int i = 0; i < n; i++) {
            const struct dsv4_st_tensor *t = dsv4_st_at(f, i);
            int hit = strcmp(t->name, ed->tensor) == 0;

            if (hit && ed->op == ED_DROP)
                continue;
            names[m] = t->name;
            dt[m] = t->dtype;
            nd[m] = t->n_dims;
            memcpy(sh[m], t->shape, sizeof(sh[m]));
            src[m] = t->data;
            nb[m] = t->n_bytes;
            if (hit && ed->op == ED_DTYPE) {
                dt[m] = ed->dtype;
                src[m] = NULL;
            } else if (hit && ed->op == ED_SHAPE) {
                nd[m] = ed->n_dims;
                memcpy(sh[m], ed->shape, sizeof(ed->shape));
                src[m] = NULL;
            }
            nb[m] = dsv4_st_dtype_size(dt[m]);
            for (int d = 0; d < nd[m]; d++)
                nb[m] *= (size_t)sh[m][d];
            m++;
            if (hit && ed->op == ED_ADD) {
                names[m] = ed->new_name;
                dt[m] = ed->dtype;
                nd[m] = ed->n_dims;
                memcpy(sh[m], ed->shape, sizeof(ed->shape));
                src[m] = NULL;
                nb[m] = dsv4_st_dtype_size(dt[m]);
                for (int d = 0; d < nd[m]; d++)
                    nb[m] *= (size_t)sh[m][d];
                m++;
            }
        }
        snprintf(tmp, sizeof(tmp), "%s.tmp", path);
        assert_int_equal(dsv4_st_writer_open(&w, tmp, m, names, dt, nd,
                                             (const int64_t (*)[DSV4_ST_MAX_DIMS])sh), DSV4_OK);
        for (int i = 0; i < m; i++) {
            uint8_t *buf = calloc(1, nb[i] + 1);

            assert_non_null(buf);
            if (src[i] != NULL)
                memcpy(buf, src[i], nb[i]);
            if (ed->op == ED_POKE && strcmp(names[i], ed->tensor) == 0)
                buf[ed->poke_at] = 0xff;
            assert_int_equal(dsv4_st_writer_put(w, buf, nb[i]), DSV4_OK);
            free(buf);
        }
        assert_int_equal(dsv4_st_writer_close(w), DSV4_OK);
    }
    dsv4_st_close(f);
    assert_int_equal(rename(tmp, path), 0);
}

/* Drop or add `name` in the index of `dir` (shard = NULL drops). */
static void
edit_index(const char *dir, const char *name, const char *shard)
{
    char p[1024];
    struct json_object *root, *wm;

    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", dir);
    root = json_object_from_file(p);
    assert_non_null(root);
    assert_true(json_object_object_get_ex(root, "weight_map", &wm));
    if (shard == NULL)
        json_object_object_del(wm, name);
    else
        json_object_object_add(wm, name, json_object_new_string(shard));
    assert_int_equal(json_object_to_file(p, root), 0);
    json_object_put(root);
}

/* Load must fail with `want`; the message must hold every fragment. */
static void
expect_fail(const char *dir, enum dsv4_err want, ...)
{
    struct dsv4_weights w;
    enum dsv4_err err = dsv4_weights_load(&w, dir);
    const char *frag;
    va_list ap;

    if (err != want)
        fail_msg("%s: got %d (%s), want %d", dir, err, dsv4_errmsg(), want);
    assert_null(w.layers);
    assert_null(w.priv);
    va_start(ap, want);
    while ((frag = va_arg(ap, const char *)) != NULL) {
        if (strstr(dsv4_errmsg(), frag) == NULL)
            fail_msg("message \"%s\" lacks \"%s\"", dsv4_errmsg(), frag);
    }
    va_end(ap);
    dsv4_weights_free(&w);  /* harmless after a failure */
}

/* Edit one tensor of a fresh copy; returns the copy and the edited shard. */
static const char *
broken_copy(const char *name, const struct edit *ed, char *shard_path, size_t len)
{
    const char *dir = clone(name);
    char shard[128];

    shard_of(ed->tensor, shard, sizeof(shard));
    snprintf(shard_path, len, "%s/%s", dir, shard);
    rewrite_shard(shard_path, ed);
    if (ed->op == ED_DROP)
        edit_index(dir, ed->tensor, NULL);
    if (ed->op == ED_ADD)
        edit_index(dir, ed->new_name, shard);
    return dir;
}

/* --- the good checkpoint ---------------------------------------------------- */

/* Tensor `name` of the checkpoint: the view must point at its bytes (or at an
 * aligned copy of them). */
static void
check_view(const struct dsv4_ckpt *c, const void *view, const char *fmt, ...)
{
    const struct dsv4_st_tensor *t;
    char name[160];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    t = dsv4_ckpt_find(c, name);
    if (t == NULL)
        fail_msg("no tensor %s", name);
    if (view == NULL)
        fail_msg("%s: NULL view", name);
    assert_int_equal((uintptr_t)view % dsv4_st_dtype_size(t->dtype), 0);
    assert_memory_equal(view, t->data, t->n_bytes);
}

static void
check_linear(const struct dsv4_ckpt *c, const struct dsv4_linear *l, enum dsv4_wfmt fmt,
             int n_out, int n_in, const char *pre, const char *name)
{
    if (l->fmt != fmt || l->n_out != n_out || l->n_in != n_in)
        fail_msg("%s%s: fmt %d [%d, %d], expected fmt %d [%d, %d]", pre, name, l->fmt,
                 l->n_out, l->n_in, fmt, n_out, n_in);
    check_view(c, l->w, "%s%s.weight", pre, name);
    if (fmt == DSV4_WFMT_BF16)
        assert_null(l->scale);
    else
        check_view(c, l->scale, "%s%s.scale", pre, name);
}

static void
check_hc(const struct dsv4_ckpt *c, const struct dsv4_hc_w *h, const char *pre,
         const char *site)
{
    check_view(c, h->fn, "%s%s_fn", pre, site);
    check_view(c, h->base, "%s%s_base", pre, site);
    check_view(c, h->scale, "%s%s_scale", pre, site);
}

static void
check_compressor(const struct dsv4_ckpt *c, const struct dsv4_compressor_w *cw, int ratio,
                 int dim, int D, const char *pre, const char *name)
{
    char n[96];
    int cd = (ratio == 4 ? 2 : 1) * dim;

    assert_int_equal(cw->ratio, ratio);
    assert_int_equal(cw->dim, dim);
    check_view(c, cw->ape, "%s%s.ape", pre, name);
    snprintf(n, sizeof(n), "%s.wkv", name);
    check_linear(c, &cw->wkv, DSV4_WFMT_BF16, cd, D, pre, n);
    snprintf(n, sizeof(n), "%s.wgate", name);
    check_linear(c, &cw->wgate, DSV4_WFMT_BF16, cd, D, pre, n);
    check_view(c, cw->norm, "%s%s.norm.weight", pre, name);
}

static void
check_expert(const struct dsv4_ckpt *c, const struct dsv4_expert_w *e, enum dsv4_wfmt fmt,
             int D, int I, const char *pre, const char *name)
{
    char n[96];

    snprintf(n, sizeof(n), "%s.w1", name);
    check_linear(c, &e->w1, fmt, I, D, pre, n);
    snprintf(n, sizeof(n), "%s.w3", name);
    check_linear(c, &e->w3, fmt, I, D, pre, n);
    snprintf(n, sizeof(n), "%s.w2", name);
    check_linear(c, &e->w2, fmt, D, I, pre, n);
}

static void
check_layer(const struct dsv4_ckpt *c, const struct dsv4_weights *w, int id)
{
    const struct dsv4_config *cfg = &w->cfg;
    const struct dsv4_layer_w *l = &w->layers[id];
    int L = cfg->num_hidden_layers, D = cfg->hidden_size, H = cfg->num_attention_heads;
    int Dh = cfg->head_dim, Rq = cfg->q_lora_rank, G = cfg->o_groups, R = cfg->o_lora_rank;
    int r = cfg->compress_ratios[id];
    char pre[32], n[48];

    if (id < L)
        snprintf(pre, sizeof(pre), "layers.%d.", id);
    else
        snprintf(pre, sizeof(pre), "mtp.%d.", id - L);
    assert_int_equal(l->id, id);
    assert_int_equal(l->ratio, r);
    check_hc(c, &l->hc_attn, pre, "hc_attn");
    check_hc(c, &l->hc_ffn, pre, "hc_ffn");
    check_view(c, l->attn_norm, "%sattn_norm.weight", pre);
    check_view(c, l->ffn_norm, "%sffn_norm.weight", pre);
    check_view(c, l->attn_sink, "%sattn.attn_sink", pre);
    check_linear(c, &l->wq_a, DSV4_WFMT_FP8, Rq, D, pre, "attn.wq_a");
    check_view(c, l->q_norm, "%sattn.q_norm.weight", pre);
    check_linear(c, &l->wq_b, DSV4_WFMT_FP8, H * Dh, Rq, pre, "attn.wq_b");
    check_linear(c, &l->wkv, DSV4_WFMT_FP8, Dh, D, pre, "attn.wkv");
    check_view(c, l->kv_norm, "%sattn.kv_norm.weight", pre);
    check_linear(c, &l->wo_a, DSV4_WFMT_FP8, G * R, H * Dh / G, pre, "attn.wo_a");
    check_linear(c, &l->wo_b, DSV4_WFMT_FP8, D, G * R, pre, "attn.wo_b");
    if (r != 0)
        check_compressor(c, &l->compressor, r, Dh, D, pre, "attn.compressor");
    else
        assert_null(l->compressor.ape);
    if (r == 4) {
        int nI = cfg->index_n_heads, dI = cfg->index_head_dim;

        check_linear(c, &l->idx_wq_b, DSV4_WFMT_FP8, nI * dI, Rq, pre, "attn.indexer.wq_b");
        check_linear(c, &l->idx_weights_proj, DSV4_WFMT_BF16, nI, D, pre,
                     "attn.indexer.weights_proj");
        check_compressor(c, &l->idx_compressor, r, dI, D, pre, "attn.indexer.compressor");
    } else {
        assert_null(l->idx_wq_b.w);
        assert_null(l->idx_compressor.ape);
    }
    check_linear(c, &l->gate, DSV4_WFMT_BF16, cfg->n_routed_experts, D, pre, "ffn.gate");
    if (id < cfg->num_hash_layers) {
        check_view(c, l->tid2eid, "%sffn.gate.tid2eid", pre);
        assert_null(l->gate_bias);
    } else {
        check_view(c, l->gate_bias, "%sffn.gate.bias", pre);
        assert_null(l->tid2eid);
    }
    check_expert(c, &l->shared, DSV4_WFMT_FP8, D, cfg->moe_intermediate_size, pre,
                 "ffn.shared_experts");
    assert_non_null(l->experts);
    for (int e = 0; e < cfg->n_routed_experts; e++) {
        snprintf(n, sizeof(n), "ffn.experts.%d", e);
        check_expert(c, &l->experts[e], DSV4_WFMT_FP4, D, cfg->moe_intermediate_size, pre, n);
    }
    if (id >= L) {
        check_linear(c, &l->e_proj, DSV4_WFMT_FP8, D, D, pre, "e_proj");
        check_linear(c, &l->h_proj, DSV4_WFMT_FP8, D, D, pre, "h_proj");
        check_view(c, l->enorm, "%senorm.weight", pre);
        check_view(c, l->hnorm, "%shnorm.weight", pre);
        check_view(c, l->mtp_norm, "%snorm.weight", pre);
        check_hc(c, &l->hc_head, pre, "hc_head");
    } else {
        assert_null(l->e_proj.w);
        assert_null(l->enorm);
        assert_null(l->mtp_norm);
        assert_null(l->hc_head.fn);
    }
}

static void
test_good(void **state)
{
    struct dsv4_weights w;
    struct dsv4_ckpt *c;

    (void)state;
    if (dsv4_weights_load(&w, good) != DSV4_OK)
        fail_msg("%s", dsv4_errmsg());
    assert_int_equal(dsv4_ckpt_open(&c, good), DSV4_OK);
    assert_int_equal(w.n_layers, w.cfg.num_hidden_layers + w.cfg.num_nextn_predict_layers);
    assert_true(w.cfg.num_nextn_predict_layers > 0);
    check_view(c, w.embed, "embed.weight");
    check_view(c, w.head, "head.weight");
    check_view(c, w.norm, "norm.weight");
    check_hc(c, &w.hc_head, "", "hc_head");
    for (int i = 0; i < w.n_layers; i++)
        check_layer(c, &w, i);
    dsv4_ckpt_close(c);
    dsv4_weights_free(&w);
    assert_null(w.layers);
    dsv4_weights_free(&w);  /* twice is harmless */
}

/* The model fingerprint (common/weights_fp.h): the same checkpoint read
 * twice gives the same one; another seed's checkpoint of the same config
 * and synthetic weights give others; a directory without one fails. */
static void
test_fingerprint(void **state)
{
    struct dsv4_weights w;
    char fa[DSV4_FP_CHARS + 1], fb[DSV4_FP_CHARS + 1], fc[DSV4_FP_CHARS + 1];
    char s7[DSV4_FP_CHARS + 1], s7b[DSV4_FP_CHARS + 1], s8[DSV4_FP_CHARS + 1];
    char other[600];

    (void)state;
    snprintf(other, sizeof(other), "%s/other", tmpdir);
    assert_int_equal(run_mkmodel("8", other), 0);
    assert_int_equal(dsv4_ckpt_fingerprint(good, fa), DSV4_OK);
    assert_int_equal(dsv4_ckpt_fingerprint(good, fb), DSV4_OK);
    assert_int_equal(dsv4_ckpt_fingerprint(other, fc), DSV4_OK);
    assert_int_equal(strlen(fa), DSV4_FP_CHARS);
    assert_string_equal(fa, fb);
    assert_string_not_equal(fa, fc);
    assert_int_not_equal(dsv4_ckpt_fingerprint(tmpdir, fc), DSV4_OK);  /* no checkpoint */
    if (dsv4_weights_load(&w, good) != DSV4_OK)
        fail_msg("%s", dsv4_errmsg());
    assert_int_equal(dsv4_synthetic_fingerprint(&w.cfg, 7, s7), DSV4_OK);
    assert_int_equal(dsv4_synthetic_fingerprint(&w.cfg, 7, s7b), DSV4_OK);
    assert_int_equal(dsv4_synthetic_fingerprint(&w.cfg, 8, s8), DSV4_OK);
    assert_string_equal(s7, s7b);
    assert_string_not_equal(s7, s8);
    assert_string_not_equal(s7, fa);
    assert_int_equal(dsv4_ckpt_fingerprint_of(w.ckpt, &w.cfg, fb), DSV4_OK);
    assert_string_equal(fa, fb);
    dsv4_weights_free(&w);
    assert_null(w.ckpt);
    assert_int_equal(dsv4_ckpt_fingerprint_of(NULL, &w.cfg, fb), DSV4_ERR_INVAL);
}

/* dir: the shards of `good` (links) with `good`'s config.json changed by
 * `set` (dsv4_config_override's form). */
static void
same_shards_other_config(const char *dir, const char *set)
{
    struct dsv4_config cfg;
    char src[900], dst[900];
    struct dirent *de;
    DIR *d;

    assert_int_equal(mkdir(dir, 0755), 0);
    assert_non_null(d = opendir(good));
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' || strcmp(de->d_name, "config.json") == 0)
            continue;
        snprintf(src, sizeof(src), "%s/%s", good, de->d_name);
        snprintf(dst, sizeof(dst), "%s/%s", dir, de->d_name);
        assert_int_equal(symlink(src, dst), 0);
    }
    closedir(d);
    snprintf(src, sizeof(src), "%s/config.json", good);
    snprintf(dst, sizeof(dst), "%s/config.json", dir);
    assert_int_equal(dsv4_config_load(&cfg, src), DSV4_OK);
    if (set != NULL)
        assert_int_equal(dsv4_config_override(&cfg, 1, &set), DSV4_OK);
    assert_int_equal(dsv4_config_write(&cfg, dst), DSV4_OK);
}

/* The fingerprint is the model's, config.json included: the same shards
 * under another rope_theta or sliding_window are another model (a prefill
 * rank of one and a decode rank of the other streamed text of neither);
 * the same configuration spelt otherwise (written again: other layout) is
 * the same model; synthetic weights of another configuration differ. */
static void
test_fingerprint_config(void **state)
{
    struct dsv4_config a, b;
    char fg[DSV4_FP_CHARS + 1], f[DSV4_FP_CHARS + 1], sa[DSV4_FP_CHARS + 1];
    char sb[DSV4_FP_CHARS + 1], dir[700];
    static const char *const sets[] = { "rope_theta=20000", "sliding_window=64",
                                        "rope_scaling.factor=8" };
    const char *set = sets[0];

    (void)state;
    assert_int_equal(dsv4_ckpt_fingerprint(good, fg), DSV4_OK);
    snprintf(dir, sizeof(dir), "%s/respelt", tmpdir);
    same_shards_other_config(dir, NULL);
    assert_int_equal(dsv4_ckpt_fingerprint(dir, f), DSV4_OK);
    assert_string_equal(f, fg);
    for (size_t i = 0; i < sizeof(sets) / sizeof(sets[0]); i++) {
        snprintf(dir, sizeof(dir), "%s/cfg%zu", tmpdir, i);
        same_shards_other_config(dir, sets[i]);
        assert_int_equal(dsv4_ckpt_fingerprint(dir, f), DSV4_OK);
        if (strcmp(f, fg) == 0)
            fail_msg("%s: the fingerprint of the unchanged config.json", sets[i]);
    }
    assert_int_equal(dsv4_config_preset(&a, "tiny"), DSV4_OK);
    b = a;
    assert_int_equal(dsv4_config_override(&b, 1, &set), DSV4_OK);
    assert_int_equal(dsv4_synthetic_fingerprint(&a, 7, sa), DSV4_OK);
    assert_int_equal(dsv4_synthetic_fingerprint(&b, 7, sb), DSV4_OK);
    assert_string_not_equal(sa, sb);
}

/* Weights loaded from a directory that is then replaced by another
 * checkpoint (an operator's upgrade while the rank runs): the loaded
 * weights' fingerprint stays the one they were read from; the directory's
 * is the new one.  A rank sends the first, so a scheduler whose reference
 * is the new checkpoint refuses it. */
static void
test_fingerprint_replaced(void **state)
{
    struct dsv4_weights w, v;
    char f7[DSV4_FP_CHARS + 1], f8[DSV4_FP_CHARS + 1], fw[DSV4_FP_CHARS + 1];
    char fd[DSV4_FP_CHARS + 1], fv[DSV4_FP_CHARS + 1];
    char live[600], old[620], next[620];

    (void)state;
    snprintf(live, sizeof(live), "%s/live", tmpdir);
    snprintf(old, sizeof(old), "%s/live.old", tmpdir);
    snprintf(next, sizeof(next), "%s/live.next", tmpdir);
    assert_int_equal(run_mkmodel("7", live), 0);
    assert_int_equal(run_mkmodel("8", next), 0);
    assert_int_equal(dsv4_ckpt_fingerprint(live, f7), DSV4_OK);
    assert_int_equal(dsv4_ckpt_fingerprint(next, f8), DSV4_OK);
    assert_string_not_equal(f7, f8);
    if (dsv4_weights_load(&w, live) != DSV4_OK)
        fail_msg("%s", dsv4_errmsg());
    assert_non_null(w.ckpt);
    assert_int_equal(rename(live, old), 0);
    assert_int_equal(rename(next, live), 0);
    assert_int_equal(dsv4_ckpt_fingerprint_of(w.ckpt, &w.cfg, fw), DSV4_OK);
    assert_int_equal(dsv4_ckpt_fingerprint(live, fd), DSV4_OK);
    assert_string_equal(fw, f7);
    assert_string_equal(fd, f8);
    /* a group's shard view keeps its source's checkpoint */
    assert_int_equal(dsv4_weights_shard(&v, &w, 1, 2, DSV4_GROUP_SPLIT_EP), DSV4_OK);
    assert_ptr_equal(v.ckpt, w.ckpt);
    assert_int_equal(dsv4_ckpt_fingerprint_of(v.ckpt, &w.cfg, fv), DSV4_OK);
    assert_string_equal(fv, f7);
    dsv4_weights_shard_free(&v);
    dsv4_weights_free(&w);
}

/* --- broken checkpoints ------------------------------------------------------ */

static void
test_wrong_dtype(void **state)
{
    struct edit ed = { .op = ED_DTYPE, .tensor = "layers.1.attn.attn_sink",
                       .dtype = DSV4_ST_BF16 };
    char shard[1100];
    const char *dir;

    (void)state;
    dir = broken_copy("dtype", &ed, shard, sizeof(shard));
    expect_fail(dir, DSV4_ERR_WEIGHTS, shard, "'layers.1.attn.attn_sink'", "dtype BF16",
                "expected F32", NULL);
}

static void
test_wrong_shape(void **state)
{
    struct dsv4_config cfg;
    struct edit ed = { .op = ED_SHAPE, .tensor = "layers.0.attn.wq_a.weight", .n_dims = 2 };
    char shard[1100], p[1024], want[64], got[64];
    const char *dir;

    (void)state;
    snprintf(p, sizeof(p), "%s/config.json", good);
    assert_int_equal(dsv4_config_load(&cfg, p), DSV4_OK);
    ed.shape[0] = cfg.q_lora_rank * 2;  /* same byte count, other shape */
    ed.shape[1] = cfg.hidden_size / 2;
    dir = broken_copy("shape", &ed, shard, sizeof(shard));
    snprintf(want, sizeof(want), "expected [%d, %d]", cfg.q_lora_rank, cfg.hidden_size);
    snprintf(got, sizeof(got), "shape [%d, %d]", cfg.q_lora_rank * 2, cfg.hidden_size / 2);
    expect_fail(dir, DSV4_ERR_WEIGHTS, shard, "'layers.0.attn.wq_a.weight'", got, want, NULL);

    /* a 1-D tensor given two dims */
    ed.tensor = "layers.2.attn.kv_norm.weight";
    ed.shape[0] = cfg.head_dim;
    ed.shape[1] = 1;
    dir = broken_copy("shape2", &ed, shard, sizeof(shard));
    expect_fail(dir, DSV4_ERR_WEIGHTS, shard, "'layers.2.attn.kv_norm.weight'", "shape [", NULL);
}

static void
test_missing(void **state)
{
    struct edit ed = { .op = ED_DROP, .tensor = "layers.2.ffn.experts.3.w2.scale" };
    char shard[1100];
    const char *dir;

    (void)state;
    dir = broken_copy("missing", &ed, shard, sizeof(shard));
    expect_fail(dir, DSV4_ERR_WEIGHTS, shard, "'layers.2.ffn.experts.3.w2.scale'", "missing",
                NULL);
}

/* The single-file layout (model.safetensors, no index) missing a tensor: the
 * message names the directory and the tensor, and the official layout's
 * shard only as such, never as a file of this checkpoint (it has none of
 * that name). */
static void
test_missing_single_file(void **state)
{
    static const char *const gone = "layers.1.attn.q_norm.weight";
    char p[1024], want[64];
    struct dsv4_ckpt *c;
    struct dirent **ents;
    const char *dir;
    int n, m = 0;

    (void)state;
    dir = clone("single");
    assert_int_equal(dsv4_ckpt_open(&c, good), DSV4_OK);
    n = dsv4_ckpt_count(c);
    {
        const char *names[n + 1];
        enum dsv4_st_dtype dt[n + 1];
        int nd[n + 1];
        int64_t sh[n + 1][DSV4_ST_MAX_DIMS];
        const struct dsv4_st_tensor *src[n + 1];
        struct dsv4_st_writer *w;

        for (int i = 0; i < n; i++) {
            const struct dsv4_st_tensor *t = dsv4_ckpt_at(c, i);

            if (strcmp(t->name, gone) == 0)
                continue;
            names[m] = t->name;
            dt[m] = t->dtype;
            nd[m] = t->n_dims;
            memcpy(sh[m], t->shape, sizeof(sh[m]));
            src[m] = t;
            m++;
        }
        assert_int_equal(m, n - 1);
        snprintf(p, sizeof(p), "%s/model.safetensors", dir);
        assert_int_equal(dsv4_st_writer_open(&w, p, m, names, dt, nd,
                                             (const int64_t (*)[DSV4_ST_MAX_DIMS])sh), DSV4_OK);
        for (int i = 0; i < m; i++)
            assert_int_equal(dsv4_st_writer_put(w, src[i]->data, src[i]->n_bytes), DSV4_OK);
        assert_int_equal(dsv4_st_writer_close(w), DSV4_OK);
    }
    dsv4_ckpt_close(c);
    /* only config.json and model.safetensors are left */
    n = scandir(dir, &ents, NULL, alphasort);
    assert_true(n > 0);
    for (int i = 0; i < n; i++) {
        if (strncmp(ents[i]->d_name, "model-", 6) == 0 ||
            strcmp(ents[i]->d_name, "model.safetensors.index.json") == 0) {
            snprintf(p, sizeof(p), "%s/%s", dir, ents[i]->d_name);
            assert_int_equal(unlink(p), 0);
        }
        free(ents[i]);
    }
    free(ents);
    snprintf(want, sizeof(want), "'%s'", gone);
    expect_fail(dir, DSV4_ERR_WEIGHTS, dir, want, "missing", "official layout", NULL);
    if (strstr(dsv4_errmsg(), "model-0") != NULL)
        fail_msg("message \"%s\" names a shard file the checkpoint does not have",
                 dsv4_errmsg());
}

/* A FIFO in place of config.json: refused as not a regular file at once, not
 * waited on for a writer (the alarm turns a hang into a failure). */
static void
test_config_fifo(void **state)
{
    char p[1024];
    const char *dir;

    (void)state;
    dir = clone("cfgfifo");
    snprintf(p, sizeof(p), "%s/config.json", dir);
    assert_int_equal(unlink(p), 0);
    assert_int_equal(mkfifo(p, 0600), 0);
    alarm(30);
    expect_fail(dir, DSV4_ERR_CONFIG, "config.json", "not a regular file", "FIFO", NULL);
    alarm(0);
}

static void
test_unexpected(void **state)
{
    struct edit ed = { .op = ED_ADD, .tensor = "mtp.0.enorm.weight",
                       .new_name = "mtp.0.ffn.experts.99.w1.weight", .dtype = DSV4_ST_I8,
                       .n_dims = 2, .shape = { 4, 4 } };
    char shard[1100];
    const char *dir;

    (void)state;
    dir = broken_copy("unexpected", &ed, shard, sizeof(shard));
    expect_fail(dir, DSV4_ERR_WEIGHTS, shard, "'mtp.0.ffn.experts.99.w1.weight'", "unexpected",
                NULL);
}

/* A hash layer's tid2eid entry outside [0, n_routed_experts): refused at
 * load (the routers would index past their experts). */
static void
test_bad_expert_id(void **state)
{
    static const size_t at[] = { 7, 1 };   /* element 0 negative; element 0 + 0xff00 */

    (void)state;
    for (int i = 0; i < 2; i++) {
        struct edit ed = { .op = ED_POKE, .tensor = "layers.0.ffn.gate.tid2eid",
                           .poke_at = at[i] };
        char shard[1100], sub[16];
        const char *dir;

        snprintf(sub, sizeof(sub), "eid%d", i);
        dir = broken_copy(sub, &ed, shard, sizeof(shard));
        expect_fail(dir, DSV4_ERR_WEIGHTS, shard, "'layers.0.ffn.gate.tid2eid'",
                    "expert id", "at element 0", NULL);
    }
}

static void
test_nan_scale(void **state)
{
    static const char *const which[] = { "mtp.0.e_proj.scale", "layers.3.ffn.experts.7.w3.scale" };

    (void)state;
    for (int i = 0; i < 2; i++) {
        struct edit ed = { .op = ED_POKE, .tensor = which[i], .poke_at = 1 };
        char shard[1100], sub[16];
        const char *dir;

        snprintf(sub, sizeof(sub), "nan%d", i);
        dir = broken_copy(sub, &ed, shard, sizeof(shard));
        expect_fail(dir, DSV4_ERR_WEIGHTS, shard, which[i], "NaN scale", NULL);
    }
}

static void
test_truncated(void **state)
{
    const struct dsv4_st_tensor *last = NULL;
    struct dsv4_st_file *f;
    char from[1024], to[1024], shard[128], want[160];
    const char *dir;
    struct stat st;

    (void)state;
    shard_of("layers.1.attn.wq_a.weight", shard, sizeof(shard));
    snprintf(from, sizeof(from), "%s/%s", good, shard);
    /* the tensor whose data ends last is the one the cut damages */
    assert_int_equal(dsv4_st_open(&f, from), DSV4_OK);
    for (int i = 0; i < dsv4_st_count(f); i++) {
        const struct dsv4_st_tensor *t = dsv4_st_at(f, i);

        if (last == NULL || (const uint8_t *)t->data + t->n_bytes >
                            (const uint8_t *)last->data + last->n_bytes)
            last = t;
    }
    snprintf(want, sizeof(want), "'%s'", last->name);
    dsv4_st_close(f);

    dir = clone("trunc");
    snprintf(to, sizeof(to), "%s/%s", dir, shard);
    assert_int_equal(stat(from, &st), 0);
    copy_file(from, to, (long)st.st_size - 100);
    expect_fail(dir, DSV4_ERR_WEIGHTS, to, want, NULL);
}

static void
test_bad_config(void **state)
{
    char p[1024];
    const char *dir;
    FILE *fp;

    (void)state;
    dir = clone("badcfg");
    snprintf(p, sizeof(p), "%s/config.json", dir);
    fp = fopen(p, "w");
    assert_non_null(fp);
    fputs("{\"model_type\": \"deepseek_v4\",", fp);
    fclose(fp);
    expect_fail(dir, DSV4_ERR_CONFIG, "config.json", NULL);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_good),
        cmocka_unit_test(test_wrong_dtype),
        cmocka_unit_test(test_wrong_shape),
        cmocka_unit_test(test_missing),
        cmocka_unit_test(test_missing_single_file),
        cmocka_unit_test(test_config_fifo),
        cmocka_unit_test(test_unexpected),
        cmocka_unit_test(test_nan_scale),
        cmocka_unit_test(test_bad_expert_id),
        cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_fingerprint),
        cmocka_unit_test(test_fingerprint_config),
        cmocka_unit_test(test_fingerprint_replaced),
    };

    if (argc != 2) {
        fprintf(stderr, "usage: %s PATH-TO-dsv4-mkmodel\n", argv[0]);
        return 2;
    }
    mkmodel = argv[1];
    return cmocka_run_group_tests_name("weights", tests, setup, teardown);
}
