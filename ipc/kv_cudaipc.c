/*
 * kv_cudaipc.c — the `cudaipc` decode-state transport (ipc/kvxfer.h):
 * device memory handed from the exporting process to the importing one on
 * the same host through CUDA IPC memory handles, so the state never visits
 * host memory (docs/gpu.md "Decode-state handoff over CUDA IPC").
 *
 * Exporter: export_region is cudaMalloc of the region on the instance's
 * device (its own allocation, so the handle covers exactly the region) and
 * cudaIpcGetMemHandle; the rank writes the state into it with device copies
 * (dsv4_model_state_export_dev), which have finished when it publishes the
 * descriptor.  free_region is cudaFree, called after KV_RELEASE (or cancel,
 * or the export timeout) as for every transport.
 *
 * Handle bytes (docs/protocol.md §6.2), 89 … 151 bytes:
 *     0   64  cudaIpcMemHandle_t of the allocation
 *    64   16  UUID of the exporter's device (cudaDeviceProp.uuid)
 *    80    8  size of the allocation in bytes, little-endian
 *    88  1-63 owner tag of the exporter ([A-Za-z0-9._-], no NUL)
 *
 * Importer: import_map checks the handle, that the exporter's device is one
 * this process sees (by UUID: device ordinals differ between processes with
 * different CUDA_VISIBLE_DEVICES) and the sizes, then cudaIpcOpenMemHandle
 * with cudaIpcMemLazyEnablePeerAccess (so the exporter's device may be
 * another GPU of the host, read over NVLink/PCIe); the mapped `data` is a
 * DEVICE pointer (x->device_memory), which the rank reads with
 * dsv4_model_state_import_dev (device-to-device copies, complete on return);
 * unmap is cudaIpcCloseMemHandle.
 *
 * cleanup_stale has nothing to do: device memory is released by the driver
 * when the process that allocated it exits, so a crashed exporter leaves no
 * region behind (an importer still holding a mapping keeps it until unmap).
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

#include <cuda_runtime_api.h>

#include "common/log.h"

#define CIPC_MEMH 64                        /* bytes of cudaIpcMemHandle_t */
#define CIPC_UUID 16                        /* bytes of a device UUID */
#define CIPC_OFF_UUID CIPC_MEMH
#define CIPC_OFF_SIZE (CIPC_OFF_UUID + CIPC_UUID)
#define CIPC_OFF_OWNER (CIPC_OFF_SIZE + 8)  /* = fixed part, 88 bytes */
#define CIPC_MAX_DEV 64                     /* devices of one host we look at */

_Static_assert(sizeof(cudaIpcMemHandle_t) == CIPC_MEMH, "cudaIpcMemHandle_t is 64 bytes");
_Static_assert(CIPC_OFF_OWNER + DSV4_KVX_MAX_OWNER - 1 <= DSV4_KVX_MAX_HANDLE,
               "a cudaipc handle fits a descriptor");

/* Instance state (x->priv). */
struct cipc {
    int device;                             /* ours: current at open time */
    int n_dev;                              /* devices this process sees */
    uint8_t uuid[CIPC_MAX_DEV][CIPC_UUID];  /* their UUIDs, by ordinal */
};

/* A failed CUDA call as a dsv4 error (DSV4_ERR_SYS, or NOMEM for an
 * allocation). */
static enum dsv4_err
cipc_fail(cudaError_t rc, const char *what)
{
    enum dsv4_err e = rc == cudaErrorMemoryAllocation ? DSV4_ERR_NOMEM : DSV4_ERR_SYS;

    return dsv4_err_set(e, "kv_cudaipc: %s: %s", what, cudaGetErrorString(rc));
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

static enum dsv4_err
cipc_init(struct dsv4_kvx *x, const struct dsv4_kvx_opts *o)
{
    struct cudaDeviceProp prop;
    struct cipc *c;
    cudaError_t rc;

    (void)o;
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
    x->priv = c;
    x->device_memory = true;
    return DSV4_OK;
}

static void
cipc_fini(struct dsv4_kvx *x)
{
    free(x->priv);
    x->priv = NULL;
}

static enum dsv4_err
cipc_export_region(struct dsv4_kvx *x, uint64_t req, uint64_t size, struct dsv4_kvx_region *r)
{
    const struct cipc *c = x->priv;
    cudaIpcMemHandle_t h;
    size_t olen = strlen(x->owner);
    cudaError_t rc;
    enum dsv4_err e;
    void *p = NULL;

    if (size > (uint64_t)SIZE_MAX)
        return dsv4_err_set(DSV4_ERR_INVAL, "kv_cudaipc: region of %" PRIu64 " bytes", size);
    if ((e = cipc_device(x)) != DSV4_OK)
        return e;
    if ((rc = cudaMalloc(&p, (size_t)size)) != cudaSuccess)
        return cipc_fail(rc, "cudaMalloc of the region");
    if ((rc = cudaIpcGetMemHandle(&h, p)) != cudaSuccess) {
        cudaFree(p);
        return cipc_fail(rc, "cudaIpcGetMemHandle");
    }
    r->data = p;
    r->size = size;
    r->req = req;
    r->desc.transport = DSV4_TRANSPORT_CUDAIPC;
    memcpy(r->desc.handle, &h, CIPC_MEMH);
    memcpy(r->desc.handle + CIPC_OFF_UUID, c->uuid[c->device], CIPC_UUID);
    for (int i = 0; i < 8; i++)
        r->desc.handle[CIPC_OFF_SIZE + i] = (uint8_t)(size >> (8 * i));
    memcpy(r->desc.handle + CIPC_OFF_OWNER, x->owner, olen);
    r->desc.handle_len = (uint32_t)(CIPC_OFF_OWNER + olen);
    r->desc.size = size;
    r->priv = NULL;
    return DSV4_OK;
}

static void
cipc_free_region(struct dsv4_kvx *x, struct dsv4_kvx_region *r)
{
    cudaError_t rc;

    if (cipc_device(x) != DSV4_OK)
        log_warnx("kv_cudaipc_free: %s", dsv4_errmsg());
    if ((rc = cudaFree(r->data)) != cudaSuccess)
        log_warnx("kv_cudaipc_free: cudaFree of req=%" PRIu64 ": %s", r->req,
                  cudaGetErrorString(rc));
}

/*
 * Check a handle: length, owner tag characters, size; *size_out = the
 * allocation's size.  Returns the ordinal of the exporter's device here, -1
 * (DSV4_ERR_PROTO set) for a malformed handle, -2 (DSV4_ERR_SYS set) for a
 * device this process does not see.
 */
static int
cipc_parse(const struct cipc *c, const struct dsv4_kvx_desc *d, uint64_t *size_out)
{
    uint64_t size = 0;
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
    }
    for (int i = 0; i < 8; i++)
        size |= (uint64_t)d->handle[CIPC_OFF_SIZE + i] << (8 * i);
    if (size == 0 || size < d->size || size > (uint64_t)SIZE_MAX) {
        dsv4_err_set(DSV4_ERR_PROTO, "kv_cudaipc: allocation of %" PRIu64 " bytes, descriptor "
                     "says %" PRIu64, size, d->size);
        return -1;
    }
    *size_out = size;
    for (int dev = 0; dev < c->n_dev; dev++)
        if (memcmp(c->uuid[dev], d->handle + CIPC_OFF_UUID, CIPC_UUID) == 0)
            return dev;
    dsv4_err_set(DSV4_ERR_SYS, "kv_cudaipc: the exporter's device (%.*s) is not visible here "
                 "(CUDA_VISIBLE_DEVICES?)", (int)olen,
                 (const char *)d->handle + CIPC_OFF_OWNER);
    return -2;
}

static enum dsv4_err
cipc_import_map(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d, struct dsv4_kvx_map *m)
{
    const struct cipc *c = x->priv;
    cudaIpcMemHandle_t h;
    uint64_t size = 0;
    cudaError_t rc;
    enum dsv4_err e;
    void *p = NULL;
    int dev;

    if ((dev = cipc_parse(c, d, &size)) < 0)
        return dev == -1 ? DSV4_ERR_PROTO : DSV4_ERR_SYS;
    if ((e = cipc_device(x)) != DSV4_OK)
        return e;
    memcpy(&h, d->handle, CIPC_MEMH);
    rc = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (rc != cudaSuccess)
        return cipc_fail(rc, "cudaIpcOpenMemHandle");
    if (dev != c->device)
        log_debug("kv_cudaipc: region on device %d, importing on device %d (peer access)", dev,
                  c->device);
    m->data = p;
    m->size = size;
    m->priv = NULL;
    return DSV4_OK;
}

static void
cipc_unmap(struct dsv4_kvx *x, struct dsv4_kvx_map *m)
{
    cudaError_t rc;

    if (cipc_device(x) != DSV4_OK)
        log_warnx("kv_cudaipc_unmap: %s", dsv4_errmsg());
    if ((rc = cudaIpcCloseMemHandle((void *)(uintptr_t)m->data)) != cudaSuccess)
        log_warnx("kv_cudaipc_unmap: cudaIpcCloseMemHandle: %s", cudaGetErrorString(rc));
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
};
