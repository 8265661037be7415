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
 *   cudaipc  (later) device memory + cudaIpcMemHandle_t / event handle.
 *   ucx      (later) registered memory + packed rkey and worker address.
 * A transport is a table of functions (struct dsv4_kvx_ops); adding one is a
 * new ops table and a case in dsv4_kvx_open().
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
 * dsv4_kvx_free(); a mapping belongs to the importer until dsv4_kvx_unmap().
 */
#ifndef DSV4_IPC_KVXFER_H
#define DSV4_IPC_KVXFER_H

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

/* One transport's implementation.  Every function is required. */
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
};

/* A transport instance of one process. */
struct dsv4_kvx {
    const struct dsv4_kvx_ops *ops;
    enum dsv4_transport transport;
    char owner[DSV4_KVX_MAX_OWNER]; /* names this process's regions ("prefill-3") */
    uint64_t n_exported;            /* regions made so far (unique names) */
    uint64_t n_live;                /* regions exported and not freed */
};

/*
 * Make a transport instance.  `owner` tags this process's regions so a
 * restarted process can find its stale ones: 1 … 63 bytes of [A-Za-z0-9._-]
 * (e.g. "prefill-3"); two live processes must not share an owner.
 * DSV4_ERR_NOTSUP for a transport not built in, DSV4_ERR_INVAL for a bad
 * owner.  Free with dsv4_kvx_close().
 */
enum dsv4_err dsv4_kvx_open(struct dsv4_kvx **out, enum dsv4_transport t, const char *owner);

/* Free the instance (regions still exported are NOT destroyed: callers free
 * them first, or a restart's dsv4_kvx_cleanup_stale() finds them).  NULL ok. */
void dsv4_kvx_close(struct dsv4_kvx *x);

/* Allocate and publish a region of `size` (>= 1) bytes for request `req`. */
enum dsv4_err dsv4_kvx_export(struct dsv4_kvx *x, uint64_t req, uint64_t size,
                              struct dsv4_kvx_region *r);

/* Destroy an exported region; r is zeroed.  Idempotent on a zeroed region. */
void dsv4_kvx_free(struct dsv4_kvx *x, struct dsv4_kvx_region *r);

/* Map a descriptor read-only (m zeroed on failure). */
enum dsv4_err dsv4_kvx_import(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d,
                              struct dsv4_kvx_map *m);

/* Release a mapping; m is zeroed.  Idempotent on a zeroed mapping. */
void dsv4_kvx_unmap(struct dsv4_kvx *x, struct dsv4_kvx_map *m);

/* Destroy regions left by an earlier process of the same owner; returns the
 * count removed.  Call once at start-up, before exporting. */
int dsv4_kvx_cleanup_stale(struct dsv4_kvx *x);

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

#ifdef __cplusplus
}
#endif
#endif
