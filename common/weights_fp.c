/*
 * weights_fp.c — the model fingerprint of weights_fp.h.
 */
#include "common/weights_fp.h"

#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/safetensors.h"

#define FNV_OFFSET 14695981039346656037ull
#define FNV_PRIME 1099511628211ull
#define SAMPLE_BYTES 64

static uint64_t
mix(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;

    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * FNV_PRIME;
    return h;
}

static uint64_t
mix_i64(uint64_t h, int64_t v)
{
    return mix(h, &v, sizeof(v));
}

static void
put(uint64_t h, char *out)
{
    snprintf(out, DSV4_FP_CHARS + 1, "%016llx", (unsigned long long)h);
}

static int
by_name(const void *a, const void *b)
{
    const struct dsv4_st_tensor *x = *(const struct dsv4_st_tensor *const *)a;
    const struct dsv4_st_tensor *y = *(const struct dsv4_st_tensor *const *)b;

    return strcmp(x->name, y->name);
}

/* A routed expert's tensor other than expert 0's: its data is not sampled
 * (they are most of the checkpoint's tensors). */
static bool
routed_expert_not_0(const char *name)
{
    const char *e = strstr(name, ".experts.");

    return e != NULL && strncmp(e + 9, "0.", 2) != 0;
}

/* h mixed with the configuration's text (with its NUL); false when out of
 * memory. */
static bool
mix_config(uint64_t *h, const struct dsv4_config *cfg)
{
    char *text = dsv4_config_text(cfg);

    if (text == NULL)
        return false;
    *h = mix(*h, text, strlen(text) + 1);
    free(text);
    return true;
}

enum dsv4_err
dsv4_ckpt_fingerprint_of(const struct dsv4_ckpt *c, const struct dsv4_config *cfg, char *out)
{
    const struct dsv4_st_tensor **t;
    uint64_t h = FNV_OFFSET;
    int n;

    if (c == NULL || cfg == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "fingerprint: no checkpoint");
    if (!mix_config(&h, cfg))
        return dsv4_err_set(DSV4_ERR_NOMEM, "fingerprint: no memory");
    n = dsv4_ckpt_count(c);
    if ((t = malloc(sizeof(*t) * (size_t)(n > 0 ? n : 1))) == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "fingerprint: no memory");
    for (int i = 0; i < n; i++)
        t[i] = dsv4_ckpt_at(c, i);
    qsort(t, (size_t)n, sizeof(*t), by_name);
    for (int i = 0; i < n; i++) {
        h = mix(h, t[i]->name, strlen(t[i]->name) + 1);
        h = mix_i64(h, t[i]->dtype);
        for (int d = 0; d < t[i]->n_dims; d++)
            h = mix_i64(h, t[i]->shape[d]);
        if (!routed_expert_not_0(t[i]->name))
            h = mix(h, t[i]->data, t[i]->n_bytes < SAMPLE_BYTES ? t[i]->n_bytes : SAMPLE_BYTES);
    }
    free(t);
    put(h, out);
    return DSV4_OK;
}

enum dsv4_err
dsv4_ckpt_fingerprint(const char *dir, char *out)
{
    struct dsv4_config cfg;
    struct dsv4_ckpt *c;
    char path[PATH_MAX];
    enum dsv4_err e;

    if (snprintf(path, sizeof(path), "%s/config.json", dir) >= (int)sizeof(path))
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: path too long", dir);
    if ((e = dsv4_config_load(&cfg, path)) != DSV4_OK)
        return e;
    if ((e = dsv4_ckpt_open(&c, dir)) != DSV4_OK)
        return e;
    e = dsv4_ckpt_fingerprint_of(c, &cfg, out);
    dsv4_ckpt_close(c);
    return e;
}

enum dsv4_err
dsv4_synthetic_fingerprint(const struct dsv4_config *cfg, uint64_t seed, char *out)
{
    static const char mark[] = "synthetic";
    uint64_t h = mix(FNV_OFFSET, mark, sizeof(mark));

    if (!mix_config(&h, cfg))
        return dsv4_err_set(DSV4_ERR_NOMEM, "fingerprint: no memory");
    put(mix(h, &seed, sizeof(seed)), out);
    return DSV4_OK;
}
