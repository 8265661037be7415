/*
 * kvx_cache.h — the two caches of the cudaipc decode-state transport
 * (ipc/kv_cudaipc.c), kept free of CUDA so that CI tests them
 * (tests/kvx/test_kvx_cache.c):
 *
 *   - exporter: regions whose importer has acknowledged (KV_RELEASE) are
 *     kept, with their IPC handle, instead of being freed, and a later
 *     export of a similar size takes one back (dsv4_kvx_cache_take /
 *     _put): no cudaMalloc / cudaFree on the hot path;
 *   - importer: mappings opened from a handle stay open after the import
 *     (dsv4_kvx_cache_find / _add / _release), so the next import from a
 *     recycled region costs no cudaIpcOpenMemHandle.  Entries are keyed by
 *     the handle's bytes; those of an exporter instance that went away are
 *     closed when a handle of the same owner tag from another instance
 *     arrives (dsv4_kvx_cache_drop_owner), and those not used for a while
 *     are closed (dsv4_kvx_cache_expire): the exporter may have freed the
 *     region, which the open mapping keeps from it.
 *
 * Both are bounded by bytes and entries; the least recently used entry that
 * nobody holds goes first.  The cache calls `destroy` (cudaFree,
 * cudaIpcCloseMemHandle) for what it lets go, and never touches `data`
 * itself.  Not thread-safe: one per transport instance, which runs in one
 * thread.
 */
#ifndef DSV4_IPC_KVX_CACHE_H
#define DSV4_IPC_KVX_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "ipc/kvxfer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_KVX_CACHE_KEY 192   /* bytes of a key (a cudaipc handle) */

/* One cached region or mapping. */
struct dsv4_kvx_centry {
    void *data;                      /* the memory (opaque: a device pointer) */
    uint64_t size;                   /* its bytes */
    uint8_t key[DSV4_KVX_CACHE_KEY]; /* exporter: the IPC handle; importer: the
                                        descriptor's handle bytes */
    uint32_t key_len;
    char owner[DSV4_KVX_MAX_OWNER];  /* importer: the exporter's owner tag */
    uint32_t pid;                    /* importer: the exporter's process */
    uint64_t instance;               /* importer: the exporter's instance */
    int refs;                        /* mappings handed out, not yet released */
    bool stale;                      /* its exporter went away: destroy when
                                        the last reference goes */
    uint64_t tick;                   /* last use (LRU order) */
    int64_t used_ms;                 /* importer: when it was last handed out
                                        (the caller's clock; set it on _add
                                        and on a _find hit) */
};

/* A cache: entries, caps, the destroy callback, statistics. */
struct dsv4_kvx_cache {
    struct dsv4_kvx_centry *e;       /* (n) entries, unordered */
    int n, cap;                      /* entries, array capacity */
    uint64_t bytes;                  /* sum of the entries' sizes */
    uint64_t max_bytes;              /* keep at most this many bytes ... */
    int max_n;                       /* ... and entries unreferenced; 0 = none */
    uint64_t clock;                  /* LRU ticks */
    void (*destroy)(void *ctx, const struct dsv4_kvx_centry *e);
    void *ctx;
    uint64_t hits, misses, evictions; /* statistics */
};

/* An empty cache with the given caps (max_bytes or max_n 0: keep nothing
 * that is not referenced) and destroy callback. */
void dsv4_kvx_cache_init(struct dsv4_kvx_cache *c, uint64_t max_bytes, int max_n,
                         void (*destroy)(void *ctx, const struct dsv4_kvx_centry *e),
                         void *ctx);

/* Destroy every entry (referenced or not) and free the array; the cache is
 * empty and usable afterwards. */
void dsv4_kvx_cache_clear(struct dsv4_kvx_cache *c);

/*
 * Exporter: take the best-fitting free entry for a region of `need` bytes
 * out of the cache into *out: the smallest with size >= need and size <=
 * need + need / 4 + `slack` bytes (so a small request does not pin a large
 * region; the sum saturates, so slack UINT64_MAX takes any size).  False (a
 * miss) when there is none.
 */
bool dsv4_kvx_cache_take(struct dsv4_kvx_cache *c, uint64_t need, uint64_t slack,
                         struct dsv4_kvx_centry *out);

/* Exporter: keep a free region (e->refs must be 0), evicting the least
 * recently used ones to stay within the caps; one that cannot be kept (larger
 * than max_bytes, no memory for the array) is destroyed at once. */
void dsv4_kvx_cache_put(struct dsv4_kvx_cache *c, const struct dsv4_kvx_centry *e);

/* Importer: the live (not stale) entry whose key is key[0, len), with one
 * more reference, or NULL (a miss). */
struct dsv4_kvx_centry *dsv4_kvx_cache_find(struct dsv4_kvx_cache *c, const uint8_t *key,
                                            uint32_t len);

/* Importer: add a new mapping holding one reference (e->refs is ignored).
 * False when the array cannot grow: the caller keeps the mapping itself
 * (dsv4_kvx_cache_release will not know it). */
bool dsv4_kvx_cache_add(struct dsv4_kvx_cache *c, const struct dsv4_kvx_centry *e);

/* Importer: drop one reference of the entry whose data is `data`; an
 * unreferenced stale entry is destroyed, then the caps are applied.  False
 * when no entry has that data. */
bool dsv4_kvx_cache_release(struct dsv4_kvx_cache *c, const void *data);

/* Importer: an exporter `owner` now runs as (pid, instance): its entries
 * of any other instance are destroyed (or, while referenced, marked stale).
 * Returns how many were affected. */
int dsv4_kvx_cache_drop_owner(struct dsv4_kvx_cache *c, const char *owner, uint32_t pid,
                              uint64_t instance);

/* Destroy least recently used unreferenced entries until the caps hold. */
void dsv4_kvx_cache_trim(struct dsv4_kvx_cache *c);
/* Importer: destroy the unreferenced entries not handed out for idle_ms
 * (now_ms - used_ms >= idle_ms).  An exporter that freed a region never
 * sends its handle again, and the open mapping would keep the memory from
 * it until the caps pushed the entry out.  Returns how many went. */
int dsv4_kvx_cache_expire(struct dsv4_kvx_cache *c, int64_t now_ms, int64_t idle_ms);

#ifdef __cplusplus
}
#endif
#endif
