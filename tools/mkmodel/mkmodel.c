/*
 * mkmodel.c — dsv4-mkmodel: write a synthetic DeepSeek-V4 checkpoint in the
 * exact official layout (config.json, model-000NN-of-000MM.safetensors shards,
 * model.safetensors.index.json) for any config, deterministically from a seed.
 *
 *   dsv4-mkmodel (--preset NAME | --config FILE) [--set key=value ...]
 *                [--seed N] (--out DIR | --inventory)
 *
 * --inventory writes nothing and prints "tensors=N bytes=B".
 *
 * Values.  Every tensor has its own random stream: xoshiro256** seeded by
 * splitmix64 from (seed, index of the tensor in the inventory), so a tensor's
 * contents do not depend on the shard it lands in or on other tensors.
 * N(m, s) is a normal draw (Box-Muller); n_in is a linear's input width.
 *
 *   FP8 linears        real W ~ N(0, 1/sqrt(n_in)); per 128x128 block
 *                      scale = 2^ceil(log2(amax/448)) (E8M0), q = fp8(W/scale)
 *   FP4 experts        real W ~ N(0, 1/sqrt(n_in)); per row per 32-group
 *                      scale = 2^ceil(log2(amax/6)) (E8M0), q = e2m1(W/scale),
 *                      element 2j in the low nibble
 *   bf16 linears       N(0, 1/sqrt(n_in))  (router gate, compressor wkv/wgate,
 *                      indexer weights_proj)
 *   RMSNorm weights    1 + N(0, 0.1)
 *   embed.weight       N(0, 1)
 *   head.weight        N(0, 2/sqrt(D))  (final-norm output has RMS ~1, so
 *                      logits have std ~2)
 *   hc_*_fn            N(0, 1/sqrt(n*D))  (mix = fn . v / rms(v) is ~N(0, 1))
 *   hc_*_base          N(0, 0.5)
 *   hc_*_scale         uniform [0.5, 1.5)
 *   attn_sink          N(0, 1)
 *   ffn.gate.bias      N(0, 0.1)
 *   compressor ape     N(0, 0.5)
 *   ffn.gate.tid2eid   per token k distinct expert ids, uniform in [0, E)
 *
 * Data is streamed: at most 128 rows of one tensor are held at a time, plus
 * the (small) scale tensor that follows a quantized weight, so even the flash
 * preset needs little memory (but a lot of disk and time).
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <json-c/json.h>

#include "common/cli.h"
#include "common/err.h"
#include "common/formats.h"
#include "common/model_config.h"
#include "common/model_tensors.h"
#include "common/safetensors.h"

#define FP8_QMAX 448.0f
#define FP4_QMAX 6.0f
#define FP8_BLOCK 128
#define FP4_GROUP 32
#define MAX_SETS 256
#define CHUNK (1 << 16)      /* elements per put for plain tensors */

/* --- random numbers --------------------------------------------------------- */

struct rng {
    uint64_t s[4];
    int have_spare;
    double spare;
};

static uint64_t
splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Stream `stream` of generator `seed`. */
static void
rng_init(struct rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ splitmix64(&stream);

    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
    r->have_spare = 0;
}

static inline uint64_t
rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* xoshiro256** */
static uint64_t
rng_next(struct rng *r)
{
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;

    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

/* Uniform in [0, 1) with 53 random bits. */
static double
rng_uniform(struct rng *r)
{
    return (double)(rng_next(r) >> 11) * 0x1.0p-53;
}

/* Standard normal (Box-Muller, both values used). */
static double
rng_normal(struct rng *r)
{
    double u, v, m;

    if (r->have_spare) {
        r->have_spare = 0;
        return r->spare;
    }
    u = 1.0 - rng_uniform(r);           /* (0, 1]: log is finite */
    v = rng_uniform(r);
    m = sqrt(-2.0 * log(u));
    r->spare = m * sin(2.0 * M_PI * v);
    r->have_spare = 1;
    return m * cos(2.0 * M_PI * v);
}

/* --- tensor generation -------------------------------------------------- */

struct gen {
    struct dsv4_st_writer *w;
    const struct dsv4_config *cfg;
    uint64_t seed;
    float *f;                 /* scratch values, up to 128 rows or CHUNK */
    size_t f_cap;
    uint8_t *bytes;           /* scratch output bytes */
    size_t bytes_cap;
    uint8_t *stash;           /* scale codes of the last quantized weight */
    size_t stash_len;
    size_t stash_cap;
    char stash_for[96];       /* name of the scale tensor the stash is for */
};

static enum dsv4_err
grow(void **p, size_t *cap, size_t need)
{
    void *np;

    if (need <= *cap)
        return DSV4_OK;
    np = realloc(*p, need);
    if (np == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "out of memory (%zu bytes)", need);
    *p = np;
    *cap = need;
    return DSV4_OK;
}

static enum dsv4_err
scratch(struct gen *g, size_t n_floats, size_t n_bytes)
{
    size_t fc = g->f_cap * sizeof(float);
    enum dsv4_err e = grow((void **)&g->f, &fc, n_floats * sizeof(float));

    g->f_cap = fc / sizeof(float);
    if (e == DSV4_OK)
        e = grow((void **)&g->bytes, &g->bytes_cap, n_bytes);
    return e;
}

/* Power-of-two scale for amax (floored so an all-zero block stays valid). */
static float
pow2_scale(float amax, float qmax)
{
    if (amax < 0x1.0p-100f)
        amax = 0x1.0p-100f;
    return dsv4_pow2_scale(amax, qmax);
}

/* Remember `len` scale codes for the tensor named weight-name's ".scale". */
static enum dsv4_err
stash_scale(struct gen *g, const char *weight_name, size_t len)
{
    size_t n = strlen(weight_name);
    enum dsv4_err e;

    if (n < 7 || strcmp(weight_name + n - 7, ".weight") != 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "%s: quantized weight not named .weight",
                            weight_name);
    g->stash_len = 0;
    e = grow((void **)&g->stash, &g->stash_cap, len);
    if (e != DSV4_OK)
        return e;
    memset(g->stash, 0, len);
    g->stash_len = len;
    snprintf(g->stash_for, sizeof(g->stash_for), "%.*s.scale", (int)(n - 7), weight_name);
    return DSV4_OK;
}

/* FP8 E4M3 weight [out, in] with 128x128-block E8M0 scales. */
static enum dsv4_err
gen_fp8(struct gen *g, const struct dsv4_tensor_spec *s, struct rng *r)
{
    int64_t out = s->shape[0], in = s->shape[1];
    int64_t nbc = (in + FP8_BLOCK - 1) / FP8_BLOCK;
    float std = (float)(1.0 / sqrt((double)in));
    enum dsv4_err e;

    e = stash_scale(g, s->name, (size_t)(((out + FP8_BLOCK - 1) / FP8_BLOCK) * nbc));
    if (e == DSV4_OK)
        e = scratch(g, (size_t)(FP8_BLOCK * in), (size_t)(FP8_BLOCK * in));
    for (int64_t r0 = 0; e == DSV4_OK && r0 < out; r0 += FP8_BLOCK) {
        int64_t rows = out - r0 < FP8_BLOCK ? out - r0 : FP8_BLOCK;

        for (int64_t i = 0; i < rows * in; i++)
            g->f[i] = (float)rng_normal(r) * std;
        for (int64_t cb = 0; cb < nbc; cb++) {
            int64_t c0 = cb * FP8_BLOCK, c1 = c0 + FP8_BLOCK < in ? c0 + FP8_BLOCK : in;
            float amax = 0.0f, sc;

            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = c0; j < c1; j++)
                    amax = fmaxf(amax, fabsf(g->f[i * in + j]));
            sc = pow2_scale(amax, FP8_QMAX);
            g->stash[(r0 / FP8_BLOCK) * nbc + cb] = dsv4_f32_to_e8m0(sc);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = c0; j < c1; j++)
                    g->bytes[i * in + j] = dsv4_f32_to_fp8(g->f[i * in + j] / sc);
        }
        e = dsv4_st_writer_put(g->w, g->bytes, (size_t)(rows * in));
    }
    return e;
}

/* FP4 E2M1 expert weight, logical [out, in], stored [out, in/2], with
 * per-row 32-group E8M0 scales [out, in/32]. */
static enum dsv4_err
gen_fp4(struct gen *g, const struct dsv4_tensor_spec *s, struct rng *r)
{
    int64_t out = s->shape[0], in = s->shape[1] * 2, ng = in / FP4_GROUP;
    float std = (float)(1.0 / sqrt((double)in));
    enum dsv4_err e;

    e = stash_scale(g, s->name, (size_t)(out * ng));
    if (e == DSV4_OK)
        e = scratch(g, (size_t)in, (size_t)(in / 2));
    for (int64_t row = 0; e == DSV4_OK && row < out; row++) {
        for (int64_t i = 0; i < in; i++)
            g->f[i] = (float)rng_normal(r) * std;
        for (int64_t k = 0; k < ng; k++) {
            const float *v = g->f + k * FP4_GROUP;
            float amax = 0.0f, sc;

            for (int i = 0; i < FP4_GROUP; i++)
                amax = fmaxf(amax, fabsf(v[i]));
            sc = pow2_scale(amax, FP4_QMAX);
            g->stash[row * ng + k] = dsv4_f32_to_e8m0(sc);
            for (int i = 0; i < FP4_GROUP; i += 2) {
                uint8_t lo = dsv4_f32_to_fp4(v[i] / sc), hi = dsv4_f32_to_fp4(v[i + 1] / sc);
                g->bytes[(k * FP4_GROUP + i) / 2] = (uint8_t)(lo | (hi << 4));
            }
        }
        e = dsv4_st_writer_put(g->w, g->bytes, (size_t)(in / 2));
    }
    return e;
}

/* The scale tensor that follows its weight: write the stash. */
static enum dsv4_err
gen_scale(struct gen *g, const struct dsv4_tensor_spec *s)
{
    enum dsv4_err e;

    if (strcmp(g->stash_for, s->name) != 0 || g->stash_len != dsv4_tensor_spec_bytes(s))
        return dsv4_err_set(DSV4_ERR_INVAL, "%s: scale does not follow its weight", s->name);
    e = dsv4_st_writer_put(g->w, g->stash, g->stash_len);
    g->stash_for[0] = '\0';
    g->stash_len = 0;
    return e;
}

/* tid2eid [V, k]: per row k distinct expert ids in [0, E). */
static enum dsv4_err
gen_tid2eid(struct gen *g, const struct dsv4_tensor_spec *s, struct rng *r)
{
    int64_t V = s->shape[0], k = s->shape[1], E = g->cfg->n_routed_experts;
    int64_t *perm, *row;
    enum dsv4_err e = DSV4_OK;

    perm = malloc((size_t)E * sizeof(*perm));
    row = malloc((size_t)k * sizeof(*row));
    if (perm == NULL || row == NULL) {
        free(perm);
        free(row);
        return dsv4_err_set(DSV4_ERR_NOMEM, "out of memory");
    }
    for (int64_t i = 0; i < E; i++)
        perm[i] = i;
    /* partial Fisher-Yates: perm stays a permutation, its first k are fresh */
    for (int64_t t = 0; e == DSV4_OK && t < V; t++) {
        for (int64_t i = 0; i < k; i++) {
            int64_t j = i + (int64_t)(rng_uniform(r) * (double)(E - i)), tmp = perm[i];
            perm[i] = perm[j];
            perm[j] = tmp;
            row[i] = perm[i];
        }
        e = dsv4_st_writer_put(g->w, row, (size_t)k * sizeof(*row));
    }
    free(perm);
    free(row);
    return e;
}

/* Plain F32/BF16 tensor: value = mean + std * N(0,1), or uniform [lo, lo+w). */
static enum dsv4_err
gen_plain(struct gen *g, const struct dsv4_tensor_spec *s, struct rng *r, double mean,
          double std, int uniform)
{
    uint64_t n = dsv4_tensor_spec_bytes(s) / dsv4_st_dtype_size(s->dtype);
    enum dsv4_err e = scratch(g, CHUNK, CHUNK * sizeof(float));

    for (uint64_t done = 0; e == DSV4_OK && done < n; ) {
        size_t m = n - done < CHUNK ? (size_t)(n - done) : CHUNK;

        for (size_t i = 0; i < m; i++) {
            float v = (float)(uniform ? mean + std * rng_uniform(r) : mean + std * rng_normal(r));
            if (s->dtype == DSV4_ST_BF16) {
                uint16_t h = dsv4_f32_to_bf16(v);
                memcpy(g->bytes + 2 * i, &h, 2);
            } else {
                memcpy(g->bytes + 4 * i, &v, 4);
            }
        }
        e = dsv4_st_writer_put(g->w, g->bytes, m * dsv4_st_dtype_size(s->dtype));
        done += m;
    }
    return e;
}

/* Fill tensor `idx` (inventory index) into the open writer. */
static enum dsv4_err
gen_tensor(struct gen *g, const struct dsv4_tensor_spec *s, int idx)
{
    double in_std = s->n_dims == 2 ? 1.0 / sqrt((double)s->shape[1]) : 1.0;
    struct rng r;

    rng_init(&r, g->seed, (uint64_t)idx);
    switch (s->kind) {
    case DSV4_TK_FP8_WEIGHT:
        return gen_fp8(g, s, &r);
    case DSV4_TK_FP4_WEIGHT:
        return gen_fp4(g, s, &r);
    case DSV4_TK_FP8_SCALE:
    case DSV4_TK_FP4_SCALE:
        return gen_scale(g, s);
    case DSV4_TK_TID2EID:
        return gen_tid2eid(g, s, &r);
    case DSV4_TK_EMBED:
        return gen_plain(g, s, &r, 0.0, 1.0, 0);
    case DSV4_TK_HEAD:
        return gen_plain(g, s, &r, 0.0, 2.0 * in_std, 0);
    case DSV4_TK_NORM:
        return gen_plain(g, s, &r, 1.0, 0.1, 0);
    case DSV4_TK_LINEAR_BF16:
    case DSV4_TK_HC_FN:
        return gen_plain(g, s, &r, 0.0, in_std, 0);
    case DSV4_TK_HC_BASE:
    case DSV4_TK_APE:
        return gen_plain(g, s, &r, 0.0, 0.5, 0);
    case DSV4_TK_HC_SCALE:
        return gen_plain(g, s, &r, 0.5, 1.0, 1);
    case DSV4_TK_SINK:
        return gen_plain(g, s, &r, 0.0, 1.0, 0);
    case DSV4_TK_GATE_BIAS:
        return gen_plain(g, s, &r, 0.0, 0.1, 0);
    }
    return dsv4_err_set(DSV4_ERR_INVAL, "%s: unknown tensor kind %d", s->name, (int)s->kind);
}

/* Write shard `shard` (tensors [first, last) of the inventory) to dir. */
static enum dsv4_err
write_shard(struct gen *g, const struct dsv4_inventory *inv, int first, int last,
            const char *dir)
{
    int n = last - first;
    const char **names = calloc((size_t)n, sizeof(*names));
    enum dsv4_st_dtype *dtypes = calloc((size_t)n, sizeof(*dtypes));
    int *ndims = calloc((size_t)n, sizeof(*ndims));
    int64_t (*shapes)[DSV4_ST_MAX_DIMS] = calloc((size_t)n, sizeof(*shapes));
    char file[64], path[4096];
    enum dsv4_err e = DSV4_OK;

    if (names == NULL || dtypes == NULL || ndims == NULL || shapes == NULL) {
        e = dsv4_err_set(DSV4_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) {
        const struct dsv4_tensor_spec *s = &inv->t[first + i];
        names[i] = s->name;
        dtypes[i] = s->dtype;
        ndims[i] = s->n_dims;
        for (int d = 0; d < s->n_dims; d++)
            shapes[i][d] = s->shape[d];
    }
    dsv4_shard_name(file, sizeof(file), inv->t[first].shard, inv->n_shards);
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    e = dsv4_st_writer_open(&g->w, path, n, names, dtypes, ndims,
                            (const int64_t (*)[DSV4_ST_MAX_DIMS])shapes);
    if (e != DSV4_OK)
        goto out;
    for (int i = 0; i < n && e == DSV4_OK; i++)
        e = gen_tensor(g, &inv->t[first + i], first + i);
    if (e == DSV4_OK) {
        e = dsv4_st_writer_close(g->w);
    } else {
        /* keep the first error's message; closing an incomplete file fails */
        char msg[1024];
        snprintf(msg, sizeof(msg), "%s", dsv4_errmsg());
        dsv4_st_writer_close(g->w);
        dsv4_err_set(e, "%s", msg);
    }
    g->w = NULL;
out:
    free(names);
    free(dtypes);
    free(ndims);
    free(shapes);
    return e;
}

/* Add v under key k (v may be NULL: allocation failed); false on failure. */
static int
obj_add(json_object *o, const char *k, json_object *v)
{
    if (v == NULL)
        return 0;
    if (json_object_object_add(o, k, v) != 0) {
        json_object_put(v);
        return 0;
    }
    return 1;
}

/* model.safetensors.index.json: total size and tensor -> shard file. */
static enum dsv4_err
write_index(const struct dsv4_inventory *inv, const char *dir)
{
    json_object *root = json_object_new_object(), *meta, *map;
    char path[4096], tmp[4100], file[64];
    int ok;

    if (root == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "index: out of memory");
    meta = json_object_new_object();
    ok = obj_add(root, "metadata", meta);
    ok = ok && obj_add(meta, "total_size", json_object_new_int64((int64_t)inv->total_bytes));
    map = ok ? json_object_new_object() : NULL;
    ok = ok && obj_add(root, "weight_map", map);
    for (int i = 0; ok && i < inv->n; i++) {
        dsv4_shard_name(file, sizeof(file), inv->t[i].shard, inv->n_shards);
        ok = obj_add(map, inv->t[i].name, json_object_new_string(file));
    }
    if (!ok) {
        json_object_put(root);
        return dsv4_err_set(DSV4_ERR_NOMEM, "index: out of memory");
    }
    /* written beside and renamed over the old index, as the shards are
     * (dsv4_st_writer_close): a rank reading it sees one whole index */
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    if (json_object_to_file_ext(tmp, root, JSON_C_TO_STRING_PRETTY |
                                               JSON_C_TO_STRING_SPACED |
                                               JSON_C_TO_STRING_NOSLASHESCAPE) != 0 ||
        rename(tmp, path) != 0) {
        int err = errno;

        json_object_put(root);
        unlink(tmp);
        return dsv4_err_set(DSV4_ERR_SYS, "%s: write failed: %s", path, strerror(err));
    }
    json_object_put(root);
    return DSV4_OK;
}

/* mkdir -p */
static enum dsv4_err
make_dirs(const char *dir)
{
    char p[4096];
    size_t n = strlen(dir);

    if (n == 0 || n >= sizeof(p))
        return dsv4_err_set(DSV4_ERR_INVAL, "bad output directory '%s'", dir);
    memcpy(p, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (p[i] != '/' && p[i] != '\0')
            continue;
        p[i] = '\0';
        if (mkdir(p, 0777) != 0 && errno != EEXIST)
            return dsv4_err_set(DSV4_ERR_SYS, "mkdir %s: %s", p, strerror(errno));
        p[i] = i == n ? '\0' : '/';
    }
    return DSV4_OK;
}

static enum dsv4_err
write_checkpoint(const struct dsv4_config *cfg, const struct dsv4_inventory *inv,
                 uint64_t seed, const char *dir)
{
    struct gen g = { .cfg = cfg, .seed = seed };
    char path[4096];
    enum dsv4_err e;

    e = make_dirs(dir);
    if (e != DSV4_OK)
        return e;
    /* shards are contiguous runs of the inventory */
    for (int first = 0; e == DSV4_OK && first < inv->n; ) {
        int last = first + 1;
        while (last < inv->n && inv->t[last].shard == inv->t[first].shard)
            last++;
        e = write_shard(&g, inv, first, last, dir);
        first = last;
    }
    if (e == DSV4_OK)
        e = write_index(inv, dir);
    /* config.json last, beside and renamed over the old one as the other
     * files: a directory with it is a whole checkpoint (tools/run.sh makes
     * one again where a stopped run left none) */
    if (e == DSV4_OK) {
        char tmp[4200];

        snprintf(path, sizeof(path), "%s/config.json", dir);
        snprintf(tmp, sizeof(tmp), "%s.tmp", path);
        e = dsv4_config_write(cfg, tmp);
        if (e == DSV4_OK && rename(tmp, path) != 0)
            e = dsv4_err_set(DSV4_ERR_SYS, "%s: rename: %s", path, strerror(errno));
    }
    free(g.f);
    free(g.bytes);
    free(g.stash);
    return e;
}

/* --- main ----------------------------------------------------------------- */

static void __attribute__((noreturn))
usage(int status)
{
    dsv4_cli_usage(
        "usage: dsv4-mkmodel (--preset NAME | --config FILE) [--set key=value ...]\n"
        "                    [--seed N] (--out DIR | --inventory)\n",
        "Writes a synthetic checkpoint in the official on-disk layout (docs/mkmodel.md).\n"
        "  --preset NAME   flash, small or tiny\n"
        "  --config FILE   start from this config.json instead of a preset\n"
        "  --set K=V       override a config.json field (K may be section.key)\n"
        "  --seed N        random seed (default 1)\n"
        "  --out DIR       write config.json, shards and index into DIR\n"
        "  --inventory     print \"tensors=N bytes=B\" and write nothing\n"
        "  -h, --help      this help\n"
        "      --version   the version\n"
        "Exit status: 0 written, 1 the config does not load or the model cannot be\n"
        "written, 2 usage (an unknown preset or --set key, a bad value).\n", status);
}

int
main(int argc, char **argv)
{
    static const struct option opts[] = {
        { "preset", required_argument, NULL, 'p' },
        { "config", required_argument, NULL, 'c' },
        { "set", required_argument, NULL, 's' },
        { "seed", required_argument, NULL, 'S' },
        { "out", required_argument, NULL, 'o' },
        { "inventory", no_argument, NULL, 'i' },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };
    const char *preset = NULL, *config = NULL, *out = NULL;
    const char *sets[MAX_SETS];
    struct dsv4_config cfg;
    struct dsv4_inventory inv;
    int n_sets = 0, inventory = 0, ch;
    uint64_t seed = 1;
    enum dsv4_err e;
    char *end;

    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (ch) {
        case 'p':
            preset = optarg;
            break;
        case 'c':
            config = optarg;
            break;
        case 's':
            if (n_sets == MAX_SETS) {
                fprintf(stderr, "dsv4-mkmodel: too many --set (at most %d)\n", MAX_SETS);
                return 2;
            }
            sets[n_sets++] = optarg;
            break;
        case 'S':
            errno = 0;
            /* decimal (base 0 read 010 as 8), a digit first (" -1" wrapped) */
            seed = strtoull(optarg, &end, 10);
            if (errno != 0 || end == optarg || *end != '\0' || optarg[0] < '0' ||
                optarg[0] > '9') {
                fprintf(stderr, "dsv4-mkmodel: bad --seed '%s'\n", optarg);
                return 2;
            }
            break;
        case 'o':
            out = optarg;
            break;
        case 'i':
            inventory = 1;
            break;
        case 'h':
            usage(0);
        case DSV4_CLI_OPT_VERSION:
            dsv4_cli_version("dsv4-mkmodel");
        default:
            usage(2);
        }
    }
    if (optind != argc || (preset == NULL) == (config == NULL) || (out == NULL) == !inventory)
        usage(2);

    /* an unknown preset or a bad --set is a bad option value (2); a
     * config.json that does not load, or a model that cannot be built, 1 */
    e = preset != NULL ? dsv4_config_preset(&cfg, preset) : DSV4_OK;
    if (e != DSV4_OK) {
        fprintf(stderr, "dsv4-mkmodel: %s\n", dsv4_errmsg());
        return 2;
    }
    if (preset == NULL && dsv4_config_load(&cfg, config) != DSV4_OK) {
        fprintf(stderr, "dsv4-mkmodel: %s\n", dsv4_errmsg());
        return 1;
    }
    if (n_sets > 0 && dsv4_config_override(&cfg, n_sets, sets) != DSV4_OK) {
        fprintf(stderr, "dsv4-mkmodel: %s\n", dsv4_errmsg());
        return 2;
    }
    e = dsv4_inventory_build(&inv, &cfg);
    if (e != DSV4_OK) {
        fprintf(stderr, "dsv4-mkmodel: %s\n", dsv4_errmsg());
        return 1;
    }
    if (inventory) {
        printf("tensors=%d bytes=%" PRIu64 "\n", inv.n, inv.total_bytes);
        dsv4_inventory_free(&inv);
        return 0;
    }
    e = write_checkpoint(&cfg, &inv, seed, out);
    dsv4_inventory_free(&inv);
    if (e != DSV4_OK) {
        fprintf(stderr, "dsv4-mkmodel: %s\n", dsv4_errmsg());
        return 1;
    }
    return 0;
}
