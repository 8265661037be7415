/*
 * kv_cudaipc.c — the `cudaipc` decode-state transport (ipc/kvxfer.h):
 * device memory handed from the exporting process to the importing one on
 * the same host through CUDA IPC memory handles, so the state never visits
 * host memory (docs/gpu.md "Decode-state handoff over CUDA IPC").
 *
 * Exporter: export_region takes a region from the instance's cache of
 * released regions (ipc/kvx_cache.h: best fit, at most a quarter + 2 MiB
 * larger than asked) with the IPC handle it already has, or else makes one:
 * cudaMalloc of the size rounded up to 2 MiB on the instance's device (its
 * own allocation, so the handle covers exactly the region; on out-of-memory
 * a cached region of any larger size is taken instead, or when there is
 * none the cached regions are freed and the allocation retried) and
 * cudaIpcGetMemHandle.  The rank writes the state into it with device
 * copies (dsv4_model_state_export_dev), which have finished when it
 * publishes the descriptor.  recycle_region (dsv4_kvx_release, after
 * KV_RELEASE: the importer has finished reading) puts the region back into
 * the cache, which keeps at most cache_bytes (struct dsv4_kvx_opts; 4 GiB)
 * and 64 regions, freeing the least recently used beyond; free_region
 * (cancel, export timeout: a reader may still come, and a recycled region
 * would show it another request's state) is cudaFree.  So a warm export
 * does no cudaMalloc and no cudaFree (which synchronises the device).
 *
 * Handle bytes (docs/protocol.md §6.2), 101 … 163 bytes:
 *     0   64  cudaIpcMemHandle_t of the allocation
 *    64   16  UUID of the exporter's device (cudaDeviceProp.uuid)
 *    80    8  size of the allocation in bytes, little-endian
 *    88    4  pid of the exporting process, little-endian
 *    92    8  instance of the exporter: its transport's start time in ns
 *             since the epoch (CLOCK_REALTIME), little-endian
 *   100  1-63 owner tag of the exporter ([A-Za-z0-9._-], no NUL)
 *
 * Importer: import_map checks the handle, that the exporter's device is one
 * this process sees (by UUID: device ordinals differ between processes with
 * different CUDA_VISIBLE_DEVICES) and the sizes.  Mappings are cached by the
 * handle's bytes (a region the exporter recycled comes back with the same
 * handle): a hit costs no CUDA call; a miss is cudaIpcOpenMemHandle with
 * cudaIpcMemLazyEnablePeerAccess (so the exporter's device may be another
 * GPU of the host, read over NVLink/PCIe).  The mapped `data` is a DEVICE
 * pointer (x->device_memory), which the rank reads with
 * dsv4_model_state_import_dev (device-to-device copies, complete on return).
 * unmap drops the reference; the mapping stays open until the cache lets
 * it go (least recently used beyond cache_bytes or 64 mappings), until a
 * handle with the same owner tag from another exporter process or instance
 * arrives (the old exporter went away: closing its mappings is what frees
 * its memory), until it has not been used for CIPC_MAP_IDLE_MS (tick: the
 * exporter may have freed the region, and the open mapping keeps that
 * memory from it), or until the transport closes.  Reading a recycled region
 * through a kept mapping is safe because the exporter recycles a region only
 * after KV_RELEASE, i.e. once the importer of its previous contents is done.
 * With no cache (cache_bytes < 0, or DSV4_KV_CUDAIPC_CACHE_MIB=0) a release
 * is cudaFree and an unmap cudaIpcCloseMemHandle, as before the caches.
 *
 * cleanup_stale has nothing to do: device memory is released by the driver
 * when the process that allocated it exits, so a crashed exporter leaves no
 * region behind (an importer still holding a mapping keeps it until it
 * closes the mapping: see above).
 *
 * Trust: the allocation's size comes from the handle (the runtime API cannot
 * query the size of an IPC allocation); a handle that overstates it makes
 * the importer's copy fault.  Descriptors come from the scheduler over the
 * ranks' authenticated socket, as for shm names.
 *
 * Runs in a rank's main thread; every call first makes the instance's device
 * current.  Built only with CUDA (library dsv4kvxcuda, ipc/meson.build).
 */
#include "ipc/kvxfer.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "common/log.h"
#include "ipc/kvx_cache.h"
#include "ipc/zsock.h"   /* dsv4_now_ms */

#define CIPC_MEMH 64                        /* bytes of cudaIpcMemHandle_t */
#define CIPC_UUID 16                        /* bytes of a device UUID */
#define CIPC_OFF_UUID CIPC_MEMH
#define CIPC_OFF_SIZE (CIPC_OFF_UUID + CIPC_UUID)
#define CIPC_OFF_PID (CIPC_OFF_SIZE + 8)
#define CIPC_OFF_INST (CIPC_OFF_PID + 4)
#define CIPC_OFF_OWNER (CIPC_OFF_INST + 8)  /* = fixed part, 100 bytes */
#define CIPC_MAX_DEV 64                     /* devices of one host we look at */
#define CIPC_GRAIN (2ull << 20)             /* allocation granularity */
#define CIPC_MAX_CACHED 64                  /* regions / mappings kept */
#define CIPC_MAP_IDLE_MS 10000              /* a mapping not used this long is
                                               closed (the exporter may have
                                               freed its region) */
#define CIPC_TICK_MS 1000                   /* expiry looked at this often */

_Static_assert(sizeof(cudaIpcMemHandle_t) == CIPC_MEMH, "cudaIpcMemHandle_t is 64 bytes");
_Static_assert(CIPC_OFF_OWNER + DSV4_KVX_MAX_OWNER - 1 <= DSV4_KVX_MAX_HANDLE,
               "a cudaipc handle fits a descriptor");
_Static_assert(CIPC_OFF_OWNER + DSV4_KVX_MAX_OWNER - 1 <= DSV4_KVX_CACHE_KEY,
               "a cudaipc handle fits a cache key");

/* Instance state (x->priv). */
struct cipc {
    int device;                             /* ours: current at open time */
    int n_dev;                              /* devices this process sees */
    uint8_t uuid[CIPC_MAX_DEV][CIPC_UUID];  /* their UUIDs, by ordinal */
    uint32_t pid;                           /* ours: handle bytes 88 … 99 */
    uint64_t instance;
    struct dsv4_kvx_cache regions;          /* exporter: released regions */
    struct dsv4_kvx_cache maps;             /* importer: open mappings */
    int64_t next_tick_ms;                   /* cipc_tick: the next look */
};

/* A parsed handle (cipc_parse). */
struct cipc_handle {
    uint64_t size;                          /* of the allocation */
    uint32_t pid;                           /* the exporter's process */
    uint64_t instance;                      /* and transport instance */
    char owner[DSV4_KVX_MAX_OWNER];         /* its owner tag */
};

/* Little-endian integer of n bytes at p. */
static uint64_t
cipc_get(const uint8_t *p, int n)
{
    uint64_t v = 0;

    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* Store v as a little-endian integer of n bytes at p. */
static void
cipc_put(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* A failed CUDA call as a dsv4 error (DSV4_ERR_SYS, or NOMEM for an
 * allocation).  The error is also taken off the thread's last-error slot:
 * a failure this transport reports and survives (a handle of a dead or
 * freed exporter, cudaErrorInvalidValue / InvalidResourceHandle) must not
 * surface at the rank's next kernel launch check as that kernel's failure. */
static enum dsv4_err
cipc_fail(cudaError_t rc, const char *what)
{
    enum dsv4_err e = rc == cudaErrorMemoryAllocation ? DSV4_ERR_NOMEM : DSV4_ERR_SYS;

    (void)cudaGetLastError();
    return dsv4_err_set(e, "kv_cudaipc: %s: %s", what, cudaGetErrorString(rc));
}

/* Log a failed CUDA call that is only worth a warning, and take the error
 * off the last-error slot (as cipc_fail does). */
static void
cipc_warn(cudaError_t rc, const char *what)
{
    (void)cudaGetLastError();
    log_warnx("kv_cudaipc: %s: %s", what, cudaGetErrorString(rc));
}

/* Make the instance's device current (the rank's device; a library call may
 * have switched). */
static enum dsv4_err
cipc_device(const struct dsv4_kvx *x)
{
    const struct cipc *c = x->priv;
    cudaError_t rc = cudaSetDevice(c->device);

    return rc == cudaSuccess ? DSV4_OK : cipc_fail(rc, "cudaSetDevice");
}

/* Cache callback: free a released region (the device is current). */
static void
cipc_region_destroy(void *ctx, const struct dsv4_kvx_centry *e)
{
    cudaError_t rc;

    (void)ctx;
    if ((rc = cudaFree(e->data)) != cudaSuccess)
        cipc_warn(rc, "cudaFree of a cached region");
}

/* Cache callback: close a mapping (the device is current). */
static void
cipc_map_destroy(void *ctx, const struct dsv4_kvx_centry *e)
{
    cudaError_t rc;

    (void)ctx;
    if ((rc = cudaIpcCloseMemHandle(e->data)) != cudaSuccess) {
        char what[DSV4_KVX_MAX_OWNER + 48];

        snprintf(what, sizeof(what), "cudaIpcCloseMemHandle (region of %s)", e->owner);
        cipc_warn(rc, what);
    }
}

/* The caches' byte cap: DSV4_KV_CUDAIPC_CACHE_MIB when set, else the
 * options' (0 = the default, < 0 = none). */
static uint64_t
cipc_cache_bytes(const struct dsv4_kvx_opts *o)
{
    const char *env = getenv("DSV4_KV_CUDAIPC_CACHE_MIB");
    char *end;

    if (env != NULL && *env != '\0') {
        long long mib = strtoll(env, &end, 10);

        if (*end == '\0' && mib >= 0 && mib <= (1ll << 30))
            return (uint64_t)mib << 20;
        log_warnx("kv_cudaipc: DSV4_KV_CUDAIPC_CACHE_MIB=%s ignored", env);
    }
    if (o->cache_bytes < 0)
        return 0;
    return o->cache_bytes > 0 ? (uint64_t)o->cache_bytes : DSV4_KVX_CACHE_BYTES;
}

static enum dsv4_err
cipc_init(struct dsv4_kvx *x, const struct dsv4_kvx_opts *o)
{
    struct cudaDeviceProp prop;
    struct timespec ts;
    struct cipc *c;
    cudaError_t rc;
    uint64_t cap;

    if ((c = calloc(1, sizeof(*c))) == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "kv_cudaipc: out of memory");
    if ((rc = cudaGetDeviceCount(&c->n_dev)) != cudaSuccess || c->n_dev < 1) {
        free(c);
        return rc != cudaSuccess ? cipc_fail(rc, "cudaGetDeviceCount")
                                 : dsv4_err_set(DSV4_ERR_NOTSUP, "kv_cudaipc: no CUDA device");
    }
    if (c->n_dev > CIPC_MAX_DEV)
        c->n_dev = CIPC_MAX_DEV;
    if ((rc = cudaGetDevice(&c->device)) != cudaSuccess) {
        free(c);
        return cipc_fail(rc, "cudaGetDevice");
    }
    for (int d = 0; d < c->n_dev; d++) {
        if ((rc = cudaGetDeviceProperties(&prop, d)) != cudaSuccess) {
            free(c);
            return cipc_fail(rc, "cudaGetDeviceProperties");
        }
        memcpy(c->uuid[d], prop.uuid.bytes, CIPC_UUID);
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    c->pid = (uint32_t)getpid();
    c->instance = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    cap = cipc_cache_bytes(o);
    dsv4_kvx_cache_init(&c->regions, cap, cap > 0 ? CIPC_MAX_CACHED : 0, cipc_region_destroy,
                        c);
    dsv4_kvx_cache_init(&c->maps, cap, cap > 0 ? CIPC_MAX_CACHED : 0, cipc_map_destroy, c);
    log_debug("kv_cudaipc: device %d, pid %u, caches of %" PRIu64 " MiB", c->device,
              (unsigned)c->pid, cap >> 20);
    x->priv = c;
    x->device_memory = true;
    return DSV4_OK;
}

static void
cipc_fini(struct dsv4_kvx *x)
{
    struct cipc *c = x->priv;

    if (cipc_device(x) != DSV4_OK)
        log_warnx("kv_cudaipc_fini: %s", dsv4_errmsg());
    log_debug("kv_cudaipc: regions reused %" PRIu64 " of %" PRIu64 ", mappings reused %" PRIu64
              " of %" PRIu64, c->regions.hits, c->regions.hits + c->regions.misses,
              c->maps.hits, c->maps.hits + c->maps.misses);
    dsv4_kvx_cache_clear(&c->regions);
    dsv4_kvx_cache_clear(&c->maps);
    free(c);
    x->priv = NULL;
}

/* A released region of at least `size` bytes and at most a quarter +
 * `slack` larger (dsv4_kvx_cache_take) out of the cache, with the handle it
 * was exported with: *p, *asize, *h.  False: none. */
static bool
cipc_take(struct cipc *c, uint64_t size, uint64_t slack, void **p, uint64_t *asize,
          cudaIpcMemHandle_t *h)
{
    struct dsv4_kvx_centry ent;

    if (!dsv4_kvx_cache_take(&c->regions, size, slack, &ent))
        return false;
    *p = ent.data;
    *asize = ent.size;
    memcpy(h, ent.key, CIPC_MEMH);
    return true;
}

/* A new region of at least `size` bytes: *p, its allocation size *asize and
 * IPC handle *h.  On out-of-memory a cached region of any larger size is
 * taken (the warm-up's, sized for the longest prompt: rank_prefill.c), or
 * else the cached regions go and it retries. */
static enum dsv4_err
cipc_alloc(struct cipc *c, uint64_t size, void **p, uint64_t *asize, cudaIpcMemHandle_t *h)
{
    cudaError_t rc;

    *asize = (size + CIPC_GRAIN - 1) / CIPC_GRAIN * CIPC_GRAIN;
    rc = cudaMalloc(p, (size_t)*asize);
    if (rc == cudaErrorMemoryAllocation && c->regions.n > 0) {
        (void)cudaGetLastError();
        if (cipc_take(c, size, UINT64_MAX, p, asize, h)) {
            log_info("kv_cudaipc: out of device memory: a cached region of %" PRIu64 " MiB "
                     "taken for %" PRIu64 " MiB", *asize >> 20, size >> 20);
            return DSV4_OK;
        }
        log_info("kv_cudaipc: out of device memory: freeing %d cached regions (%" PRIu64
                 " MiB)", c->regions.n, c->regions.bytes >> 20);
        dsv4_kvx_cache_clear(&c->regions);
        rc = cudaMalloc(p, (size_t)*asize);
    }
    if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        return cipc_fail(rc, "cudaMalloc of the region");
    }
    if ((rc = cudaIpcGetMemHandle(h, *p)) != cudaSuccess) {
        cudaFree(*p);
        return cipc_fail(rc, "cudaIpcGetMemHandle");
    }
    return DSV4_OK;
}

static enum dsv4_err
cipc_export_region(struct dsv4_kvx *x, uint64_t req, uint64_t size, struct dsv4_kvx_region *r)
{
    struct cipc *c = x->priv;
    cudaIpcMemHandle_t h;
    size_t olen = strlen(x->owner);
    uint64_t asize;
    enum dsv4_err e;
    void *p = NULL;

    if (size > (uint64_t)SIZE_MAX - CIPC_GRAIN)
        return dsv4_err_set(DSV4_ERR_INVAL, "kv_cudaipc: region of %" PRIu64 " bytes", size);
    if ((e = cipc_device(x)) != DSV4_OK)
        return e;
    if (!cipc_take(c, size, CIPC_GRAIN, &p, &asize, &h) &&
        (e = cipc_alloc(c, size, &p, &asize, &h)) != DSV4_OK)
        return e;
    r->data = p;
    r->size = size;
    r->req = req;
    r->desc.transport = DSV4_TRANSPORT_CUDAIPC;
    memcpy(r->desc.handle, &h, CIPC_MEMH);
    memcpy(r->desc.handle + CIPC_OFF_UUID, c->uuid[c->device], CIPC_UUID);
    cipc_put(r->desc.handle + CIPC_OFF_SIZE, asize, 8);
    cipc_put(r->desc.handle + CIPC_OFF_PID, c->pid, 4);
    cipc_put(r->desc.handle + CIPC_OFF_INST, c->instance, 8);
    memcpy(r->desc.handle + CIPC_OFF_OWNER, x->owner, olen);
    r->desc.handle_len = (uint32_t)(CIPC_OFF_OWNER + olen);
    r->desc.size = size;
    r->priv = NULL;
    return DSV4_OK;
}

/* Not acknowledged (cancel, timeout, shutdown): the memory goes. */
static void
cipc_free_region(struct dsv4_kvx *x, struct dsv4_kvx_region *r)
{
    cudaError_t rc;

    if (cipc_device(x) != DSV4_OK)
        log_warnx("kv_cudaipc_free: %s", dsv4_errmsg());
    if ((rc = cudaFree(r->data)) != cudaSuccess) {
        char what[64];

        snprintf(what, sizeof(what), "free: cudaFree of req=%" PRIu64, r->req);
        cipc_warn(rc, what);
    }
}

/* Acknowledged (KV_RELEASE): back into the cache, handle and all. */
static void
cipc_recycle_region(struct dsv4_kvx *x, struct dsv4_kvx_region *r)
{
    struct cipc *c = x->priv;
    struct dsv4_kvx_centry ent;

    if (cipc_device(x) != DSV4_OK)
        log_warnx("kv_cudaipc_release: %s", dsv4_errmsg());
    memset(&ent, 0, sizeof(ent));
    ent.data = r->data;
    ent.size = cipc_get(r->desc.handle + CIPC_OFF_SIZE, 8);
    memcpy(ent.key, r->desc.handle, CIPC_MEMH);
    ent.key_len = CIPC_MEMH;
    dsv4_kvx_cache_put(&c->regions, &ent);
}

/*
 * Check a handle: length, owner tag characters, size; fills *out.  Returns
 * the ordinal of the exporter's device here, -1 (DSV4_ERR_PROTO set) for a
 * malformed handle, -2 (DSV4_ERR_SYS set) for a device this process does
 * not see.
 */
static int
cipc_parse(const struct cipc *c, const struct dsv4_kvx_desc *d, struct cipc_handle *out)
{
    uint32_t olen;

    if (d->handle_len <= CIPC_OFF_OWNER ||
        d->handle_len > CIPC_OFF_OWNER + DSV4_KVX_MAX_OWNER - 1) {
        dsv4_err_set(DSV4_ERR_PROTO, "kv_cudaipc: handle of %u bytes", (unsigned)d->handle_len);
        return -1;
    }
    olen = d->handle_len - CIPC_OFF_OWNER;
    for (uint32_t i = 0; i < olen; i++) {
        uint8_t ch = d->handle[CIPC_OFF_OWNER + i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == '-')) {
            dsv4_err_set(DSV4_ERR_PROTO, "kv_cudaipc: bad owner tag in handle");
            return -1;
        }
        out->owner[i] = (char)ch;
    }
    out->owner[olen] = '\0';
    out->size = cipc_get(d->handle + CIPC_OFF_SIZE, 8);
    out->pid = (uint32_t)cipc_get(d->handle + CIPC_OFF_PID, 4);
    out->instance = cipc_get(d->handle + CIPC_OFF_INST, 8);
    if (out->size == 0 || out->size < d->size || out->size > (uint64_t)SIZE_MAX) {
        dsv4_err_set(DSV4_ERR_PROTO, "kv_cudaipc: allocation of %" PRIu64 " bytes, descriptor "
                     "says %" PRIu64, out->size, d->size);
        return -1;
    }
    for (int dev = 0; dev < c->n_dev; dev++)
        if (memcmp(c->uuid[dev], d->handle + CIPC_OFF_UUID, CIPC_UUID) == 0)
            return dev;
    dsv4_err_set(DSV4_ERR_SYS, "kv_cudaipc: the exporter's device (%s) is not visible here "
                 "(CUDA_VISIBLE_DEVICES?)", out->owner);
    return -2;
}

static enum dsv4_err
cipc_import_map(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d, struct dsv4_kvx_map *m)
{
    struct cipc *c = x->priv;
    struct dsv4_kvx_centry *hit, ent;
    struct cipc_handle ph;
    cudaIpcMemHandle_t h;
    cudaError_t rc;
    enum dsv4_err e;
    void *p = NULL;
    int dev, n;

    if ((dev = cipc_parse(c, d, &ph)) < 0)
        return dev == -1 ? DSV4_ERR_PROTO : DSV4_ERR_SYS;
    if ((e = cipc_device(x)) != DSV4_OK)
        return e;
    /* a new process or instance under this owner tag: the old one is gone */
    if ((n = dsv4_kvx_cache_drop_owner(&c->maps, ph.owner, ph.pid, ph.instance)) > 0)
        log_info("kv_cudaipc: %s restarted (pid %u): closed %d mappings of its predecessor",
                 ph.owner, (unsigned)ph.pid, n);
    if ((hit = dsv4_kvx_cache_find(&c->maps, d->handle, d->handle_len)) != NULL) {
        hit->used_ms = dsv4_now_ms();
        m->data = hit->data;
        m->size = hit->size;
        m->priv = NULL;
        return DSV4_OK;
    }
    memcpy(&h, d->handle, CIPC_MEMH);
    rc = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (rc != cudaSuccess)
        return cipc_fail(rc, "cudaIpcOpenMemHandle");
    if (dev != c->device)
        log_debug("kv_cudaipc: region on device %d, importing on device %d (peer access)", dev,
                  c->device);
    memset(&ent, 0, sizeof(ent));
    ent.data = p;
    ent.size = ph.size;
    memcpy(ent.key, d->handle, d->handle_len);
    ent.key_len = d->handle_len;
    memcpy(ent.owner, ph.owner, sizeof(ent.owner));
    ent.pid = ph.pid;
    ent.instance = ph.instance;
    ent.used_ms = dsv4_now_ms();
    /* not kept (no memory for the table): unmap closes it */
    if (!dsv4_kvx_cache_add(&c->maps, &ent))
        log_debug("kv_cudaipc: mapping not cached (out of memory)");
    m->data = p;
    m->size = ph.size;
    m->priv = NULL;
    return DSV4_OK;
}

static void
cipc_unmap(struct dsv4_kvx *x, struct dsv4_kvx_map *m)
{
    struct cipc *c = x->priv;
    cudaError_t rc;

    if (cipc_device(x) != DSV4_OK)
        log_warnx("kv_cudaipc_unmap: %s", dsv4_errmsg());
    if (dsv4_kvx_cache_release(&c->maps, m->data))
        return;     /* kept open, or closed by the cache */
    if ((rc = cudaIpcCloseMemHandle((void *)(uintptr_t)m->data)) != cudaSuccess)
        cipc_warn(rc, "unmap: cudaIpcCloseMemHandle");
}

/* Close the mappings not used for CIPC_MAP_IDLE_MS: an exporter that freed a
 * region (its cache's eviction, a cancel, its out-of-memory retry) never
 * sends that handle again, and while the mapping stays open the memory
 * stays the exporter's loss (see the file comment). */
static int64_t
cipc_tick(struct dsv4_kvx *x, int64_t now_ms)
{
    struct cipc *c = x->priv;
    int n;

    if (c->maps.n == 0)
        return -1;   /* an import adds one first */
    if (now_ms < c->next_tick_ms)
        return c->next_tick_ms - now_ms;
    c->next_tick_ms = now_ms + CIPC_TICK_MS;
    if (cipc_device(x) != DSV4_OK) {
        log_warnx("kv_cudaipc_tick: %s", dsv4_errmsg());
        return CIPC_TICK_MS;
    }
    if ((n = dsv4_kvx_cache_expire(&c->maps, now_ms, CIPC_MAP_IDLE_MS)) > 0)
        log_debug("kv_cudaipc: closed %d mappings idle for %d ms", n, CIPC_MAP_IDLE_MS);
    return c->maps.n > 0 ? CIPC_TICK_MS : -1;
}

/* Nothing outlives the exporting process (see the file comment). */
static int
cipc_cleanup_stale(struct dsv4_kvx *x)
{
    (void)x;
    return 0;
}

const struct dsv4_kvx_ops dsv4_kvx_cudaipc_ops = {
    .export_region = cipc_export_region,
    .free_region = cipc_free_region,
    .import_map = cipc_import_map,
    .unmap = cipc_unmap,
    .cleanup_stale = cipc_cleanup_stale,
    .init = cipc_init,
    .fini = cipc_fini,
    .recycle_region = cipc_recycle_region,
    .tick = cipc_tick,
};
