/*
 * kvxfer.h — decode-state transfer between ranks (prefill -> decode): an
 * exporter allocates a region, writes a request's decode state into it and
 * publishes an opaque descriptor; an importer maps the descriptor read-only,
 * copies the state into its own pool and unmaps; the exporter frees the
 * region when the importer has acknowledged (KV_RELEASE, docs/protocol.md
 * §6.2), on cancel, or when it gives up waiting.
 *
 * One interface, several transports behind it (enum dsv4_transport):
 *   shm      POSIX shared memory on one host (CPU backend), ipc/kv_shm.c;
 *            handle = the shm object name ("/dsv4kv-<owner>-<req>-<n>").
 *   cudaipc  device memory (cudaMalloc) on one host, ipc/kv_cudaipc.c;
 *            handle = cudaIpcMemHandle_t + the exporter's device UUID + the
 *            allocation's size + the exporter's pid and instance + the
 *            owner tag.  Regions released after the importer's
 *            acknowledgement (dsv4_kvx_release) are kept for reuse, and the
 *            importer keeps mappings open (ipc/kvx_cache.h).  Built only with CUDA, in
 *            its own library (the ranks link it): it is not in
 *            dsv4_kvx_open's table, callers open it with
 *            dsv4_kvx_open_ops(&dsv4_kvx_cudaipc_ops, ...).
 *   ucx      host memory registered with UCX, read by the importer with an
 *            RMA get (TCP or RDMA underneath), ipc/kv_ucx.c; handle = the
 *            exporter's worker address + buffer address + packed rkey.
 * A transport is a table of functions (struct dsv4_kvx_ops); adding one is a
 * new ops table and a case in dsv4_kvx_open(), or, for a transport that
 * needs libraries this one does not link (cudaipc), a table passed to
 * dsv4_kvx_open_ops().
 *
 * Memory: with shm and ucx, region and map `data` are host memory.  A
 * transport instance with `device_memory` set (cudaipc) hands out DEVICE
 * pointers instead: the exporter writes the region with device copies
 * (dsv4_model_state_export_dev) and the importer reads it the same way
 * (dsv4_model_state_import_dev); never dereference them on the host.
 *
 * Imports can also run asynchronously (dsv4_kvx_import_start / _test): a
 * transport that copies over a network (ucx) starts the copy and reports
 * completion through dsv4_kvx_event_fd(); one that maps locally (shm)
 * finishes at once.  Every import is bounded by the instance's timeout
 * (struct dsv4_kvx_opts): one that has not finished by then fails with
 * DSV4_ERR_TIMEOUT and its transport state is torn down, so a stalled link
 * never leaves a request without a terminal state.
 *
 * The descriptor (struct dsv4_kvx_desc) is what travels: transport, handle
 * bytes (one raw frame of PREFILL_DONE / DECODE) and the region size.
 * dsv4_kvx_desc_from_loc() builds it from a decoded struct dsv4_kv_loc and
 * validates the segment table against the region; the handle is checked by
 * the transport on import, so a malformed descriptor is an error, never a
 * crash.
 *
 * Execution context: one thread per struct dsv4_kvx (a rank's main loop).
 * Ownership: a region belongs to the dsv4_kvx that exported it until
 * dsv4_kvx_free() or dsv4_kvx_release(); a mapping belongs to the importer
 * until dsv4_kvx_unmap() (a transport may keep the memory mapped after it,
 * for the next import from the same region).
 */
#ifndef DSV4_IPC_KVXFER_H
#define DSV4_IPC_KVXFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "ipc/proto.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_KVX_MAX_HANDLE 4096  /* bytes of a handle this library produces or accepts */
#define DSV4_KVX_MAX_OWNER 64     /* bytes of an owner tag, NUL included */

/* What an importer needs to find a region (docs/protocol.md §6.2). */
struct dsv4_kvx_desc {
    enum dsv4_transport transport;
    uint8_t handle[DSV4_KVX_MAX_HANDLE]; /* opaque to everyone but the transport */
    uint32_t handle_len;                 /* [1, DSV4_KVX_MAX_HANDLE] */
    uint64_t size;                       /* bytes of the region (>= every offset + size) */
};

/* An exported region (exporter side). */
struct dsv4_kvx_region {
    void *data;                  /* writable, `size` bytes, page-aligned */
    uint64_t size;
    uint64_t req;                /* request it was made for */
    struct dsv4_kvx_desc desc;   /* what to publish */
    void *priv;                  /* transport state */
};

/* A mapped region (importer side). */
struct dsv4_kvx_map {
    const void *data;            /* read-only view, `size` bytes */
    uint64_t size;
    void *priv;                  /* transport state */
};

struct dsv4_kvx;

struct dsv4_kvx_xfer;

/* Options of a transport instance; zeroed = defaults. */
struct dsv4_kvx_opts {
    int64_t timeout_ms;        /* bound of one import; 0 = DSV4_KVX_TIMEOUT_MS */
    const char *ucx_tls;       /* ucx: UCX_TLS list; NULL or "" = "tcp" */
    const char *ucx_devices;   /* ucx: UCX_NET_DEVICES; NULL or "" = all devices */
    int64_t cache_bytes;       /* cudaipc: bytes of released regions kept for
                                  reuse (exporter) and of mappings kept open
                                  (importer); 0 = DSV4_KVX_CACHE_BYTES, < 0 =
                                  none (the environment's
                                  DSV4_KV_CUDAIPC_CACHE_MIB wins when set) */
};

#define DSV4_KVX_TIMEOUT_MS 5000  /* default import bound */
#define DSV4_KVX_CACHE_BYTES (4ull << 30)  /* default cudaipc cache cap */

/* One transport's implementation.  export_region, free_region, unmap and
 * cleanup_stale are required, and import_map or import_start (+ _test and
 * _abort); the rest are optional (NULL): without import_start an import is
 * one synchronous import_map, without init/fini the instance has no state. */
struct dsv4_kvx_ops {
    /* Allocate a region of `size` bytes for request `req` and fill r. */
    enum dsv4_err (*export_region)(struct dsv4_kvx *x, uint64_t req, uint64_t size,
                                   struct dsv4_kvx_region *r);
    /* Unmap and destroy an exported region (the name/handle stops working
     * for new importers; existing mappings stay valid until unmapped). */
    void (*free_region)(struct dsv4_kvx *x, struct dsv4_kvx_region *r);
    /* Map a descriptor read-only; DSV4_ERR_PROTO for a malformed handle,
     * DSV4_ERR_SYS when the region cannot be opened (gone, permissions). */
    enum dsv4_err (*import_map)(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d,
                                struct dsv4_kvx_map *m);
    /* Release a mapping from import_map. */
    void (*unmap)(struct dsv4_kvx *x, struct dsv4_kvx_map *m);
    /* Destroy regions a previous process with the same owner left behind;
     * returns how many were removed. */
    int (*cleanup_stale)(struct dsv4_kvx *x);
    /* (optional) Set up x->priv from the options; DSV4_ERR_* on failure. */
    enum dsv4_err (*init)(struct dsv4_kvx *x, const struct dsv4_kvx_opts *o);
    /* (optional) Tear down x->priv (bounded time; in-flight imports fail). */
    void (*fini)(struct dsv4_kvx *x);
    /* (optional) Start importing d; the transport keeps its state in t->priv
     * and may lower t->bound_ms (the import's deadline is its start plus
     * that). */
    enum dsv4_err (*import_start)(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d,
                                  struct dsv4_kvx_xfer *t);
    /* (optional, with import_start) DSV4_OK: finished, m filled (released
     * with unmap); DSV4_ERR_BUSY: still running; anything else: failed, the
     * transport state of t is gone. */
    enum dsv4_err (*import_test)(struct dsv4_kvx *x, struct dsv4_kvx_xfer *t,
                                 struct dsv4_kvx_map *m);
    /* (optional, with import_start) Give up an import that is still running;
     * the transport state of t is released (now or once the network lets go).
     * t->timed_out says whether its deadline passed (the link may be stalled)
     * or the caller cancelled it (other imports from the same peer go on). */
    void (*import_abort)(struct dsv4_kvx *x, struct dsv4_kvx_xfer *t);
    /* (optional) fd readable when an import may have finished, or -1. */
    int (*event_fd)(struct dsv4_kvx *x);
    /* (optional) free_region after the importer acknowledged the region
     * (KV_RELEASE): nobody reads it any more, so the transport may keep its
     * memory and handle for a later export_region instead of destroying it.
     * NULL = free_region. */
    void (*recycle_region)(struct dsv4_kvx *x, struct dsv4_kvx_region *r);
    /* (optional) Housekeeping at `now_ms` (dsv4_now_ms) (cudaipc: close
     * mappings idle too long); returns ms until it wants the next call, or
     * -1 for none until something changes. */
    int64_t (*tick)(struct dsv4_kvx *x, int64_t now_ms);
};

/* An import in flight (dsv4_kvx_import_start). */
struct dsv4_kvx_xfer {
    uint64_t size;               /* descriptor's region size */
    int64_t bound_ms;            /* the import's bound: the instance's timeout_ms,
                                    or less where the exporter's handle says it
                                    keeps a freed region readable for less (ucx) */
    int64_t deadline_ms;         /* monotonic, its start + bound_ms: fails with
                                    DSV4_ERR_TIMEOUT after */
    bool done;                   /* synchronous transports: finished at start */
    bool timed_out;              /* set before import_abort when the deadline
                                    passed (a stalled link), not for a cancel */
    struct dsv4_kvx_map map;     /* synchronous transports: the mapping */
    void *priv;                  /* transport state */
};

/* A transport instance of one process. */
struct dsv4_kvx {
    const struct dsv4_kvx_ops *ops;
    enum dsv4_transport transport;
    char owner[DSV4_KVX_MAX_OWNER]; /* names this process's regions ("prefill-3") */
    uint64_t n_exported;            /* regions made so far (unique names) */
    uint64_t n_live;                /* regions exported and not freed */
    int64_t timeout_ms;             /* bound of one import (opts) */
    uint64_t n_imports;             /* imports started (statistics) */
    uint64_t n_timeouts;            /* imports that hit their bound */
    bool device_memory;             /* region/map `data` are device pointers
                                       (set by the transport's init: cudaipc) */
    void *priv;                     /* transport instance state (ops->init) */
};

/*
 * Make a transport instance.  `owner` tags this process's regions so a
 * restarted process can find its stale ones: 1 … 63 bytes of [A-Za-z0-9._-]
 * (e.g. "prefill-3"); two live processes must not share an owner.
 * DSV4_ERR_NOTSUP for a transport not built in, DSV4_ERR_INVAL for a bad
 * owner.  Free with dsv4_kvx_close().
 */
enum dsv4_err dsv4_kvx_open(struct dsv4_kvx **out, enum dsv4_transport t, const char *owner);

/*
 * dsv4_kvx_open with options (timeout, UCX transports and devices); o may be
 * NULL.  DSV4_ERR_SYS when the transport cannot start (UCX found no usable
 * device), with the reason in dsv4_errmsg().
 */
enum dsv4_err dsv4_kvx_open_opts(struct dsv4_kvx **out, enum dsv4_transport t,
                                 const char *owner, const struct dsv4_kvx_opts *o);

/*
 * dsv4_kvx_open_opts with the transport's ops table given by the caller: for
 * a transport built outside this library (cudaipc, ipc/kv_cudaipc.c).  `t`
 * names the transport (descriptors must carry it); the table must have the
 * required members (struct dsv4_kvx_ops).  Same errors as
 * dsv4_kvx_open_opts, plus DSV4_ERR_INVAL for a NULL table.
 */
enum dsv4_err dsv4_kvx_open_ops(struct dsv4_kvx **out, const struct dsv4_kvx_ops *ops,
                                enum dsv4_transport t, const char *owner,
                                const struct dsv4_kvx_opts *o);

/* True when transport t is built into this library (dsv4_kvx_open knows it;
 * cudaipc never is: it is opened with dsv4_kvx_open_ops). */
bool dsv4_kvx_available(enum dsv4_transport t);

/* Free the instance (regions still exported are NOT destroyed: callers free
 * them first, or a restart's dsv4_kvx_cleanup_stale() finds them).  NULL ok. */
void dsv4_kvx_close(struct dsv4_kvx *x);

/* Allocate and publish a region of `size` (>= 1) bytes for request `req`. */
enum dsv4_err dsv4_kvx_export(struct dsv4_kvx *x, uint64_t req, uint64_t size,
                              struct dsv4_kvx_region *r);

/* Destroy an exported region; r is zeroed.  Idempotent on a zeroed region. */
void dsv4_kvx_free(struct dsv4_kvx *x, struct dsv4_kvx_region *r);

/*
 * dsv4_kvx_free for a region whose importer has acknowledged it (KV_RELEASE:
 * it has finished reading, and no other importer was given the descriptor):
 * the transport may recycle the memory, and the same handle, for a later
 * export (cudaipc does).  Use dsv4_kvx_free instead when a reader may still
 * come (export timeout, cancel): a recycled region would show it another
 * request's state.  r is zeroed; idempotent on a zeroed region.
 */
void dsv4_kvx_release(struct dsv4_kvx *x, struct dsv4_kvx_region *r);

/* Map a descriptor read-only (m zeroed on failure).  For a network
 * transport this is import_start + waiting (bounded by the timeout). */
enum dsv4_err dsv4_kvx_import(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d,
                              struct dsv4_kvx_map *m);

/*
 * Start importing a descriptor; *out (freed by _test or _abort) is the
 * handle.  Errors found at once (malformed handle, peer unreachable) are
 * returned here and *out is NULL.
 */
enum dsv4_err dsv4_kvx_import_start(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d,
                                    struct dsv4_kvx_xfer **out);

/*
 * Poll an import: DSV4_OK = finished, m is the read-only view (release with
 * dsv4_kvx_unmap) and t is freed; DSV4_ERR_BUSY = still running (t stays);
 * any other error = failed and t is freed: DSV4_ERR_TIMEOUT when the
 * instance's timeout passed since the start, DSV4_ERR_SYS when the network
 * or the peer failed.  Never blocks.
 */
enum dsv4_err dsv4_kvx_import_test(struct dsv4_kvx *x, struct dsv4_kvx_xfer *t,
                                   struct dsv4_kvx_map *m);

/* Give up an import still running (cancel, shutdown); t is freed.  NULL ok. */
void dsv4_kvx_import_abort(struct dsv4_kvx *x, struct dsv4_kvx_xfer *t);

/* An fd that becomes readable when an import may have finished (drain it
 * with dsv4_kvx_event_clear), or -1 when imports finish synchronously. */
int dsv4_kvx_event_fd(struct dsv4_kvx *x);

/* Consume the readiness of dsv4_kvx_event_fd. */
void dsv4_kvx_event_clear(struct dsv4_kvx *x);

/* Release a mapping; m is zeroed.  Idempotent on a zeroed mapping. */
void dsv4_kvx_unmap(struct dsv4_kvx *x, struct dsv4_kvx_map *m);

/* Destroy regions left by an earlier process of the same owner; returns the
 * count removed.  Call once at start-up, before exporting. */
int dsv4_kvx_cleanup_stale(struct dsv4_kvx *x);

/* The transport's housekeeping (ops->tick; nothing for most): call it from
 * the process's loop with dsv4_now_ms(), again within the ms it returns
 * (-1: no need until the next import or export). */
int64_t dsv4_kvx_tick(struct dsv4_kvx *x, int64_t now_ms);

/*
 * Fill a protocol location (docs/protocol.md §6.2) for a region holding one
 * segment [0, len) that covers `n_tokens` positions; the location borrows
 * r->desc.handle and the caller's `seg` array (2 entries: size, offset), so
 * both must outlive the message.
 */
void dsv4_kvx_desc_to_loc(const struct dsv4_kvx_region *r, uint64_t len, uint32_t n_tokens,
                          uint64_t seg[2], struct dsv4_kv_loc *loc);

/*
 * Build a descriptor from a decoded location: copies transport and handle,
 * sets size to the end of the furthest segment.  DSV4_ERR_PROTO when the
 * handle is empty or too long, a segment overflows, or the transport is
 * unknown.
 */
enum dsv4_err dsv4_kvx_desc_from_loc(const struct dsv4_kv_loc *loc, struct dsv4_kvx_desc *d);

/* The shm transport's ops (ipc/kv_shm.c). */
extern const struct dsv4_kvx_ops dsv4_kvx_shm_ops;

#ifdef DSV4_HAVE_UCX
/* The ucx transport's ops (ipc/kv_ucx.c; built when libucx is found). */
extern const struct dsv4_kvx_ops dsv4_kvx_ucx_ops;
#endif

#ifdef DSV4_HAVE_CUDA
/* The cudaipc transport's ops (ipc/kv_cudaipc.c, library dsv4kvxcuda; CUDA
 * builds).  Its instance works on the calling thread's current CUDA device
 * at open time (the rank's backend device); regions and maps are device
 * memory (device_memory).  Exporter and importer must be different
 * processes (CUDA cannot open an IPC handle in the process that made it).
 * Released regions and open mappings are cached (opts cache_bytes). */
extern const struct dsv4_kvx_ops dsv4_kvx_cudaipc_ops;
#endif

#ifdef __cplusplus
}
#endif
#endif
