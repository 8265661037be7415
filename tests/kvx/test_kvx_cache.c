/*
 * test_kvx_cache.c — the region and mapping caches of the cudaipc transport
 * (ipc/kvx_cache.h), without CUDA: a fake destroy callback records what the
 * cache lets go, so each test checks exactly which regions are freed or
 * mappings closed, and when.
 *
 *   - exporter: best fit within the slack, misses outside it, LRU eviction
 *     by bytes and by count, oversize regions destroyed at once, a cap of 0
 *     keeps nothing;
 *   - importer: hits by key only, referenced entries are never evicted,
 *     release applies the caps, an owner's other instances are dropped
 *     (stale while referenced, destroyed on their last release), those
 *     idle too long are closed, clear destroys everything;
 *   - dsv4_kvx_release on a transport without recycle_region (shm) frees
 *     the region like dsv4_kvx_free.
 */
#include <sys/stat.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ipc/kvx_cache.h"

#define MIB (1ull << 20)

/* What the cache destroyed, in order (data pointers as small integers). */
static uintptr_t gone[64];
static int n_gone;

static void
record(void *ctx, const struct dsv4_kvx_centry *e)
{
    (void)ctx;
    assert_true(n_gone < 64);
    gone[n_gone++] = (uintptr_t)e->data;
}

static int
reset(void **state)
{
    (void)state;
    n_gone = 0;
    return 0;
}

/* A region entry: data = id, size in MiB. */
static struct dsv4_kvx_centry
region(uintptr_t id, uint64_t mib)
{
    struct dsv4_kvx_centry e;

    memset(&e, 0, sizeof(e));
    e.data = (void *)id;
    e.size = mib * MIB;
    e.key[0] = (uint8_t)id;
    e.key_len = 64;
    return e;
}

/* A mapping entry: key = handle-like bytes naming (id, owner, pid, instance). */
static struct dsv4_kvx_centry
mapping(uintptr_t id, const char *owner, uint32_t pid, uint64_t inst)
{
    struct dsv4_kvx_centry e = region(id, 8);

    snprintf(e.owner, sizeof(e.owner), "%s", owner);
    e.pid = pid;
    e.instance = inst;
    memset(e.key, 0, sizeof(e.key));
    memcpy(e.key, &id, sizeof(id));
    memcpy(e.key + 8, &pid, sizeof(pid));
    memcpy(e.key + 12, &inst, sizeof(inst));
    e.key_len = 100;
    return e;
}

static void
test_take_best_fit(void **state)
{
    struct dsv4_kvx_cache c;
    struct dsv4_kvx_centry e, got;

    (void)state;
    dsv4_kvx_cache_init(&c, 1024 * MIB, 64, record, NULL);
    e = region(1, 100);
    dsv4_kvx_cache_put(&c, &e);
    e = region(2, 40);
    dsv4_kvx_cache_put(&c, &e);
    e = region(3, 44);
    dsv4_kvx_cache_put(&c, &e);
    assert_int_equal(c.n, 3);
    assert_int_equal(c.bytes, 184 * MIB);

    /* 39 MiB: 40 and 44 fit (<= 39 + 9.75 + 2), the smaller wins */
    assert_true(dsv4_kvx_cache_take(&c, 39 * MIB, 2 * MIB, &got));
    assert_ptr_equal(got.data, (void *)2);
    assert_int_equal(got.size, 40 * MIB);
    assert_int_equal(got.key[0], 2);
    /* 10 MiB: 44 and 100 are too large for it */
    assert_false(dsv4_kvx_cache_take(&c, 10 * MIB, 2 * MIB, &got));
    /* 101 MiB: nothing is large enough */
    assert_false(dsv4_kvx_cache_take(&c, 101 * MIB, 2 * MIB, &got));
    assert_true(dsv4_kvx_cache_take(&c, 90 * MIB, 2 * MIB, &got));
    assert_ptr_equal(got.data, (void *)1);
    assert_int_equal(c.hits, 2);
    assert_int_equal(c.misses, 2);
    assert_int_equal(c.n, 1);
    assert_int_equal(c.bytes, 44 * MIB);
    assert_int_equal(n_gone, 0);
    /* slack UINT64_MAX (kv_cudaipc out of device memory): any larger size,
     * the sum saturating instead of wrapping below it */
    assert_false(dsv4_kvx_cache_take(&c, 45 * MIB, UINT64_MAX, &got));
    assert_true(dsv4_kvx_cache_take(&c, 10 * MIB, UINT64_MAX, &got));
    assert_ptr_equal(got.data, (void *)3);
    dsv4_kvx_cache_put(&c, &got);
    assert_true(dsv4_kvx_cache_take(&c, 1, UINT64_MAX - 1, &got));
    assert_ptr_equal(got.data, (void *)3);
    dsv4_kvx_cache_put(&c, &got);
    dsv4_kvx_cache_clear(&c);
    assert_int_equal(n_gone, 1);
    assert_int_equal(gone[0], 3);
    assert_int_equal(c.n, 0);
    assert_int_equal(c.bytes, 0);
}

static void
test_put_caps(void **state)
{
    struct dsv4_kvx_cache c;
    struct dsv4_kvx_centry e, got;

    (void)state;
    /* 100 MiB and 3 regions at most */
    dsv4_kvx_cache_init(&c, 100 * MIB, 3, record, NULL);
    for (uintptr_t id = 1; id <= 3; id++) {
        e = region(id, 30);
        dsv4_kvx_cache_put(&c, &e);
    }
    assert_int_equal(n_gone, 0);
    /* a 4th: over both caps; the least recently put (1) goes */
    e = region(4, 30);
    dsv4_kvx_cache_put(&c, &e);
    assert_int_equal(n_gone, 1);
    assert_int_equal(gone[0], 1);
    /* 60 MiB: 3 and 2 of 30 must go to stay within 100 MiB (2 first) */
    e = region(5, 60);
    dsv4_kvx_cache_put(&c, &e);
    assert_int_equal(n_gone, 3);
    assert_int_equal(gone[1], 2);
    assert_int_equal(gone[2], 3);
    assert_int_equal(c.n, 2);
    assert_int_equal(c.bytes, 90 * MIB);
    /* larger than the cap: destroyed at once, the others stay */
    e = region(6, 101);
    dsv4_kvx_cache_put(&c, &e);
    assert_int_equal(n_gone, 4);
    assert_int_equal(gone[3], 6);
    assert_true(dsv4_kvx_cache_take(&c, 60 * MIB, 0, &got));
    assert_ptr_equal(got.data, (void *)5);
    dsv4_kvx_cache_clear(&c);
    assert_int_equal(n_gone, 5);
    assert_int_equal(gone[4], 4);

    /* cap 0: nothing is kept */
    dsv4_kvx_cache_init(&c, 0, 0, record, NULL);
    e = region(7, 1);
    dsv4_kvx_cache_put(&c, &e);
    assert_int_equal(n_gone, 6);
    assert_int_equal(gone[5], 7);
    assert_int_equal(c.n, 0);
    dsv4_kvx_cache_clear(&c);
}

static void
test_maps_refs_and_lru(void **state)
{
    struct dsv4_kvx_cache c;
    struct dsv4_kvx_centry e, *hit;

    (void)state;
    dsv4_kvx_cache_init(&c, 1024 * MIB, 2, record, NULL);
    e = mapping(1, "prefill-0", 100, 7);
    assert_true(dsv4_kvx_cache_add(&c, &e));
    /* same key: a hit with a second reference; another key: a miss */
    hit = dsv4_kvx_cache_find(&c, e.key, e.key_len);
    assert_non_null(hit);
    assert_ptr_equal(hit->data, (void *)1);
    assert_int_equal(hit->refs, 2);
    assert_null(dsv4_kvx_cache_find(&c, e.key, e.key_len - 1));
    e.key[0] ^= 0x80;
    assert_null(dsv4_kvx_cache_find(&c, e.key, e.key_len));
    /* two more mappings held: over the count cap, but all referenced */
    e = mapping(2, "prefill-0", 100, 7);
    assert_true(dsv4_kvx_cache_add(&c, &e));
    e = mapping(3, "prefill-0", 100, 7);
    assert_true(dsv4_kvx_cache_add(&c, &e));
    assert_int_equal(c.n, 3);
    assert_int_equal(n_gone, 0);
    /* releasing 2 lets the cache evict it (the only unreferenced one) */
    assert_true(dsv4_kvx_cache_release(&c, (void *)2));
    assert_int_equal(n_gone, 1);
    assert_int_equal(gone[0], 2);
    /* 1 is held twice: the first release keeps it */
    assert_true(dsv4_kvx_cache_release(&c, (void *)1));
    assert_true(dsv4_kvx_cache_release(&c, (void *)1));
    assert_true(dsv4_kvx_cache_release(&c, (void *)3));
    assert_int_equal(c.n, 2);
    assert_int_equal(n_gone, 1);
    /* unknown data: not the cache's */
    assert_false(dsv4_kvx_cache_release(&c, (void *)9));
    /* a 4th: the least recently used unreferenced one (1) goes */
    e = mapping(4, "prefill-0", 100, 7);
    assert_true(dsv4_kvx_cache_add(&c, &e));
    assert_int_equal(n_gone, 2);
    assert_int_equal(gone[1], 1);
    assert_true(dsv4_kvx_cache_release(&c, (void *)4));
    assert_int_equal(c.hits, 1);
    assert_int_equal(c.misses, 2);
    dsv4_kvx_cache_clear(&c);
    assert_int_equal(n_gone, 4);
}

static void
test_drop_owner(void **state)
{
    struct dsv4_kvx_cache c;
    struct dsv4_kvx_centry e;

    (void)state;
    dsv4_kvx_cache_init(&c, 1024 * MIB, 64, record, NULL);
    e = mapping(1, "prefill-0", 100, 7);        /* the old instance, released */
    assert_true(dsv4_kvx_cache_add(&c, &e));
    assert_true(dsv4_kvx_cache_release(&c, (void *)1));
    e = mapping(2, "prefill-0", 100, 7);        /* the old instance, still held */
    assert_true(dsv4_kvx_cache_add(&c, &e));
    e = mapping(3, "prefill-1", 100, 7);        /* another owner */
    assert_true(dsv4_kvx_cache_add(&c, &e));
    assert_true(dsv4_kvx_cache_release(&c, (void *)3));
    e = mapping(4, "prefill-0", 200, 9);        /* the new instance */
    assert_true(dsv4_kvx_cache_add(&c, &e));
    assert_true(dsv4_kvx_cache_release(&c, (void *)4));

    /* prefill-0 now runs as (200, 9): its two mappings of (100, 7) go */
    assert_int_equal(dsv4_kvx_cache_drop_owner(&c, "prefill-0", 200, 9), 2);
    assert_int_equal(n_gone, 1);
    assert_int_equal(gone[0], 1);
    /* 2 is stale: a lookup misses it, its release destroys it */
    e = mapping(2, "prefill-0", 100, 7);
    assert_null(dsv4_kvx_cache_find(&c, e.key, e.key_len));
    assert_int_equal(dsv4_kvx_cache_drop_owner(&c, "prefill-0", 200, 9), 0);
    assert_true(dsv4_kvx_cache_release(&c, (void *)2));
    assert_int_equal(n_gone, 2);
    assert_int_equal(gone[1], 2);
    /* the new instance's and the other owner's mappings stay */
    assert_int_equal(c.n, 2);
    e = mapping(4, "prefill-0", 200, 9);
    assert_non_null(dsv4_kvx_cache_find(&c, e.key, e.key_len));
    assert_true(dsv4_kvx_cache_release(&c, (void *)4));
    /* a pid change alone is another process too */
    assert_int_equal(dsv4_kvx_cache_drop_owner(&c, "prefill-1", 101, 7), 1);
    assert_int_equal(gone[2], 3);
    dsv4_kvx_cache_clear(&c);
    assert_int_equal(n_gone, 4);
    assert_int_equal(gone[3], 4);
}

/* Importer: mappings not handed out for the idle time are closed (their
 * exporter may have freed the region), held ones and recent ones stay, and
 * a hit makes one recent again. */
static void
test_expire(void **state)
{
    struct dsv4_kvx_cache c;
    struct dsv4_kvx_centry e, *hit;

    (void)state;
    dsv4_kvx_cache_init(&c, 1024 * MIB, 64, record, NULL);
    for (uintptr_t id = 1; id <= 4; id++) {
        e = mapping(id, "prefill-0", 100, 7);
        e.used_ms = 1000 * (int64_t)id;          /* handed out at 1, 2, 3, 4 s */
        assert_true(dsv4_kvx_cache_add(&c, &e));
        if (id != 2)
            assert_true(dsv4_kvx_cache_release(&c, (void *)id));
    }
    /* at 11.5 s with 10 s idle: 1 goes; 2 is held; 3 and 4 are recent */
    assert_int_equal(dsv4_kvx_cache_expire(&c, 11500, 10000), 1);
    assert_int_equal(n_gone, 1);
    assert_int_equal(gone[0], 1);
    /* 3 is handed out again at 12 s (as cipc_import_map stamps a hit) */
    e = mapping(3, "prefill-0", 100, 7);
    hit = dsv4_kvx_cache_find(&c, e.key, e.key_len);
    assert_non_null(hit);
    hit->used_ms = 12000;
    assert_true(dsv4_kvx_cache_release(&c, (void *)3));
    /* at 20 s: 4 goes (4 + 10), 3 stays (12 + 10 > 20), 2 is still held */
    assert_int_equal(dsv4_kvx_cache_expire(&c, 20000, 10000), 1);
    assert_int_equal(gone[1], 4);
    assert_int_equal(c.n, 2);
    /* released at last, 2 goes at the next look; then 3 at 22 s */
    assert_true(dsv4_kvx_cache_release(&c, (void *)2));
    assert_int_equal(dsv4_kvx_cache_expire(&c, 20000, 10000), 1);
    assert_int_equal(gone[2], 2);
    assert_int_equal(dsv4_kvx_cache_expire(&c, 21999, 10000), 0);
    assert_int_equal(dsv4_kvx_cache_expire(&c, 22000, 10000), 1);
    assert_int_equal(gone[3], 3);
    assert_int_equal(c.n, 0);
    assert_int_equal(c.bytes, 0);
    dsv4_kvx_cache_clear(&c);
    assert_int_equal(n_gone, 4);
}

/* shm has no recycle_region: dsv4_kvx_release removes the object. */
static void
test_release_shm(void **state)
{
    struct dsv4_kvx_region r;
    struct dsv4_kvx *x;
    struct stat st;
    char owner[64], path[600];

    (void)state;
    snprintf(owner, sizeof(owner), "kvxcache-%ld", (long)getpid());
    assert_int_equal(dsv4_kvx_open(&x, DSV4_TRANSPORT_SHM, owner), DSV4_OK);
    assert_int_equal(dsv4_kvx_export(x, 1, 4096, &r), DSV4_OK);
    snprintf(path, sizeof(path), "/dev/shm%.*s", (int)r.desc.handle_len,
             (const char *)r.desc.handle);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(x->n_live, 1);
    dsv4_kvx_release(x, &r);
    assert_int_equal(x->n_live, 0);
    assert_null(r.data);
    assert_int_not_equal(stat(path, &st), 0);
    dsv4_kvx_release(x, &r);   /* idempotent */
    assert_int_equal(x->n_live, 0);
    dsv4_kvx_close(x);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_take_best_fit, reset),
        cmocka_unit_test_setup(test_put_caps, reset),
        cmocka_unit_test_setup(test_maps_refs_and_lru, reset),
        cmocka_unit_test_setup(test_drop_owner, reset),
        cmocka_unit_test_setup(test_expire, reset),
        cmocka_unit_test(test_release_shm),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
