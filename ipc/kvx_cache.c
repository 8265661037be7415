/*
 * kvx_cache.c — the region and mapping caches of the cudaipc transport
 * (ipc/kvx_cache.h).  A cache is a small unordered array (tens of entries):
 * every lookup is a linear scan, which costs nothing next to the CUDA calls
 * it saves.  Removal moves the last entry into the hole.
 */
#include "ipc/kvx_cache.h"

#include <stdlib.h>
#include <string.h>

void
dsv4_kvx_cache_init(struct dsv4_kvx_cache *c, uint64_t max_bytes, int max_n,
                    void (*destroy)(void *ctx, const struct dsv4_kvx_centry *e), void *ctx)
{
    memset(c, 0, sizeof(*c));
    c->max_bytes = max_bytes;
    c->max_n = max_n > 0 ? max_n : 0;
    c->destroy = destroy;
    c->ctx = ctx;
}

/* Remove entry i (not destroyed). */
static void
cache_remove(struct dsv4_kvx_cache *c, int i)
{
    c->bytes -= c->e[i].size;
    c->e[i] = c->e[--c->n];
}

/* Destroy and remove entry i. */
static void
cache_evict(struct dsv4_kvx_cache *c, int i)
{
    struct dsv4_kvx_centry e = c->e[i];

    cache_remove(c, i);
    c->evictions++;
    c->destroy(c->ctx, &e);
}

void
dsv4_kvx_cache_clear(struct dsv4_kvx_cache *c)
{
    while (c->n > 0)
        cache_evict(c, c->n - 1);
    free(c->e);
    c->e = NULL;
    c->cap = 0;
    c->bytes = 0;
}

/* Room for one more entry; false when the array cannot grow. */
static bool
cache_grow(struct dsv4_kvx_cache *c)
{
    struct dsv4_kvx_centry *e;
    int cap;

    if (c->n < c->cap)
        return true;
    cap = c->cap ? 2 * c->cap : 16;
    if ((e = realloc(c->e, (size_t)cap * sizeof(*e))) == NULL)
        return false;
    c->e = e;
    c->cap = cap;
    return true;
}

/* Append e with `refs` references as the most recent entry (room made by
 * cache_grow), then apply the caps. */
static void
cache_append(struct dsv4_kvx_cache *c, const struct dsv4_kvx_centry *e, int refs)
{
    c->e[c->n] = *e;
    c->e[c->n].refs = refs;
    c->e[c->n].stale = false;
    c->e[c->n].tick = ++c->clock;
    c->bytes += e->size;
    c->n++;
    dsv4_kvx_cache_trim(c);
}

void
dsv4_kvx_cache_trim(struct dsv4_kvx_cache *c)
{
    while (c->bytes > c->max_bytes || c->n > c->max_n) {
        int lru = -1;

        for (int i = 0; i < c->n; i++)
            if (c->e[i].refs == 0 && (lru < 0 || c->e[i].tick < c->e[lru].tick))
                lru = i;
        if (lru < 0)
            return;     /* everything left is in use */
        cache_evict(c, lru);
    }
}

bool
dsv4_kvx_cache_take(struct dsv4_kvx_cache *c, uint64_t need, uint64_t slack,
                    struct dsv4_kvx_centry *out)
{
    uint64_t most = need + need / 4;
    int best = -1;

    /* need + need / 4 + slack, saturated (slack UINT64_MAX: any size) */
    most = most < need || UINT64_MAX - most < slack ? UINT64_MAX : most + slack;
    for (int i = 0; i < c->n; i++) {
        const struct dsv4_kvx_centry *e = &c->e[i];

        if (e->refs == 0 && !e->stale && e->size >= need && e->size <= most &&
            (best < 0 || e->size < c->e[best].size))
            best = i;
    }
    if (best < 0) {
        c->misses++;
        return false;
    }
    *out = c->e[best];
    cache_remove(c, best);
    c->hits++;
    return true;
}

void
dsv4_kvx_cache_put(struct dsv4_kvx_cache *c, const struct dsv4_kvx_centry *e)
{
    if (e->size > c->max_bytes || c->max_n == 0 || !cache_grow(c)) {
        c->evictions++;
        c->destroy(c->ctx, e);
        return;
    }
    /* the new entry is the most recent: older ones go first */
    cache_append(c, e, 0);
}

struct dsv4_kvx_centry *
dsv4_kvx_cache_find(struct dsv4_kvx_cache *c, const uint8_t *key, uint32_t len)
{
    for (int i = 0; i < c->n; i++) {
        struct dsv4_kvx_centry *e = &c->e[i];

        if (!e->stale && e->key_len == len && memcmp(e->key, key, len) == 0) {
            e->refs++;
            e->tick = ++c->clock;
            c->hits++;
            return e;
        }
    }
    c->misses++;
    return NULL;
}

bool
dsv4_kvx_cache_add(struct dsv4_kvx_cache *c, const struct dsv4_kvx_centry *e)
{
    if (!cache_grow(c))
        return false;
    cache_append(c, e, 1);
    return true;
}

bool
dsv4_kvx_cache_release(struct dsv4_kvx_cache *c, const void *data)
{
    for (int i = 0; i < c->n; i++) {
        struct dsv4_kvx_centry *e = &c->e[i];

        if (e->data != data)
            continue;
        if (e->refs > 0 && --e->refs == 0 && e->stale)
            cache_evict(c, i);
        dsv4_kvx_cache_trim(c);
        return true;
    }
    return false;
}

int
dsv4_kvx_cache_expire(struct dsv4_kvx_cache *c, int64_t now_ms, int64_t idle_ms)
{
    int n = 0;

    for (int i = 0; i < c->n;) {
        if (c->e[i].refs == 0 && now_ms - c->e[i].used_ms >= idle_ms) {
            cache_evict(c, i);  /* the last entry moved to i: look at it next */
            n++;
        } else {
            i++;
        }
    }
    return n;
}

int
dsv4_kvx_cache_drop_owner(struct dsv4_kvx_cache *c, const char *owner, uint32_t pid,
                          uint64_t instance)
{
    int n = 0;

    for (int i = 0; i < c->n;) {
        struct dsv4_kvx_centry *e = &c->e[i];

        if (e->stale || strcmp(e->owner, owner) != 0 ||
            (e->pid == pid && e->instance == instance)) {
            i++;
            continue;
        }
        n++;
        if (e->refs > 0) {
            e->stale = true;
            i++;
        } else {
            cache_evict(c, i);  /* the last entry moved to i: look at it next */
        }
    }
    return n;
}
