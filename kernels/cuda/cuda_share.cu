/*
 * cuda_share.cu — arenas of device weights made or mapped through the CUDA
 * virtual memory API (kernels/cuda_share.h), and the private arena helpers
 * of cuda_weights.cu / cuda_synth.cu (cuda.cuh).
 *
 * The driver functions come from cudaGetDriverEntryPointByVersion (asked for
 * their CUDA 12.0 signatures, those of <cudaTypedefs.h> named _v10020 /
 * _v2000 / _v6000), once per process, so nothing links libcuda.so: a build
 * with CUDA still starts without a GPU, and a private arena never touches the
 * table.
 *
 * A shareable arena: cuMemCreate (pinned device memory, POSIX fd handle
 * requested) of the size rounded up to the recommended granularity,
 * cuMemExportToShareableHandle to an fd, then mapped as an import is:
 * cuMemAddressReserve (aligned to the granularity), cuMemMap of the whole
 * allocation, cuMemSetAccess read-write for the device.  An import starts
 * from the received fd (cuMemImportFromShareableHandle).  Release runs in
 * the reverse order: unmap, free the address range, release the handle,
 * close the fd.  The physical memory goes when the last handle, mapping or
 * descriptor of it in any process is gone.
 */
#include "kernels/cuda_share.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/cuda/cuda.cuh"

#define GIB (1024.0 * 1024.0 * 1024.0)
#define DRV_VERSION 12000   /* signatures asked for */

/* A VMM arena (cuda_wpriv.vmm). */
struct cuda_vmm {
    CUmemGenericAllocationHandle handle;
    CUdeviceptr base;
    size_t size;          /* allocation = reservation = mapping, bytes */
    int fd;               /* exported or received descriptor, -1 none */
    int created, reserved, mapped;
};

/* The driver functions used here. */
static struct {
    PFN_cuMemCreate_v10020 create;
    PFN_cuMemRelease_v10020 release;
    PFN_cuMemAddressReserve_v10020 reserve;
    PFN_cuMemAddressFree_v10020 addr_free;
    PFN_cuMemMap_v10020 map;
    PFN_cuMemUnmap_v10020 unmap;
    PFN_cuMemSetAccess_v10020 set_access;
    PFN_cuMemExportToShareableHandle_v10020 export_fd;
    PFN_cuMemImportFromShareableHandle_v10020 import_fd;
    PFN_cuMemGetAllocationGranularity_v10020 granularity;
    PFN_cuGetErrorString_v6000 error_string;
    PFN_cuDeviceGet_v2000 device_get;
    PFN_cuDeviceGetAttribute_v2000 device_attr;
    int ok;
    char why[256];
} drv;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

static void
drv_get(void **fn, const char *name)
{
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t rc;

    if (!drv.ok)
        return;
    rc = cudaGetDriverEntryPointByVersion(name, fn, DRV_VERSION, cudaEnableDefault, &q);
    if (rc != cudaSuccess || q != cudaDriverEntryPointSuccess || *fn == NULL) {
        snprintf(drv.why, sizeof(drv.why), "driver entry point %s: %s", name,
                 rc != cudaSuccess ? cudaGetErrorString(rc) :
                 q == cudaDriverEntryPointVersionNotSufficent ? "driver too old" :
                 "not found");
        (void)cudaGetLastError();
        drv.ok = 0;
    }
}

#define DRV_GET(f, name) drv_get((void **)(void *)&drv.f, name)

static void
drv_init(void)
{
    drv.ok = 1;
    DRV_GET(create, "cuMemCreate");
    DRV_GET(release, "cuMemRelease");
    DRV_GET(reserve, "cuMemAddressReserve");
    DRV_GET(addr_free, "cuMemAddressFree");
    DRV_GET(map, "cuMemMap");
    DRV_GET(unmap, "cuMemUnmap");
    DRV_GET(set_access, "cuMemSetAccess");
    DRV_GET(export_fd, "cuMemExportToShareableHandle");
    DRV_GET(import_fd, "cuMemImportFromShareableHandle");
    DRV_GET(granularity, "cuMemGetAllocationGranularity");
    DRV_GET(error_string, "cuGetErrorString");
    DRV_GET(device_get, "cuDeviceGet");
    DRV_GET(device_attr, "cuDeviceGetAttribute");
}

/* The table, or DSV4_ERR_NOTSUP saying why not. */
static enum dsv4_err
drv_load(void)
{
    pthread_once(&drv_once, drv_init);
    if (!drv.ok)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "weights share: %s", drv.why);
    return DSV4_OK;
}

/* DSV4_ERR_CUDA (DSV4_ERR_NOMEM for out of memory) naming the call. */
static enum dsv4_err
drv_err(CUresult r, const char *what, const char *call)
{
    const char *s = NULL;

    if (drv.error_string == NULL || drv.error_string(r, &s) != CUDA_SUCCESS || s == NULL)
        s = "unknown error";
    return dsv4_err_set(r == CUDA_ERROR_OUT_OF_MEMORY ? DSV4_ERR_NOMEM : DSV4_ERR_CUDA,
                        "%s: %s: %s (%d)", what, call, s, (int)r);
}

#define DRV_TRY(what, call)                                                 \
    do {                                                                    \
        CUresult r_ = (call);                                               \
        if (r_ != CUDA_SUCCESS)                                             \
            return drv_err(r_, what, #call);                                \
    } while (0)

/* Make the backend's device current on this thread (the driver calls act on
 * the current context: the runtime's primary context). */
static enum dsv4_err
vmm_device(struct dsv4_backend *be)
{
    CUDA_TRY(cudaSetDevice(cuda_st(be)->device));
    CUDA_TRY(cudaFree(NULL));
    return DSV4_OK;
}

static void
vmm_prop(CUmemAllocationProp *prop, int dev)
{
    memset(prop, 0, sizeof(*prop));
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = dev;
}

static enum dsv4_err
vmm_granularity(const CUmemAllocationProp *prop, size_t *g, const char *what)
{
    *g = 0;
    if (drv.granularity(g, prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS ||
        *g == 0)
        DRV_TRY(what, drv.granularity(g, prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (*g == 0)
        return dsv4_err_set(DSV4_ERR_CUDA, "%s: allocation granularity 0", what);
    return DSV4_OK;
}

/* Reserve an address range for v->handle, map it, open it to the device. */
static enum dsv4_err
vmm_map(struct cuda_vmm *v, int dev, size_t gran, const char *what)
{
    CUmemAccessDesc acc;

    DRV_TRY(what, drv.reserve(&v->base, v->size, gran, 0, 0));
    v->reserved = 1;
    DRV_TRY(what, drv.map(v->base, v->size, 0, v->handle, 0));
    v->mapped = 1;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    DRV_TRY(what, drv.set_access(v->base, v->size, &acc, 1));
    return DSV4_OK;
}

static void
vmm_free(struct cuda_vmm *v)
{
    if (v == NULL)
        return;
    if (v->mapped)
        (void)drv.unmap(v->base, v->size);
    if (v->reserved)
        (void)drv.addr_free(v->base, v->size);
    if (v->created)
        (void)drv.release(v->handle);
    if (v->fd >= 0)
        close(v->fd);
    free(v);
}

/* A new shareable allocation of at least `bytes`. */
static enum dsv4_err
vmm_create(struct cuda_vmm *v, int dev, size_t bytes, const char *what)
{
    CUmemAllocationProp prop;
    size_t gran;
    int fd = -1;
    CUresult r;
    enum dsv4_err e;

    vmm_prop(&prop, dev);
    e = vmm_granularity(&prop, &gran, what);
    if (e != DSV4_OK)
        return e;
    v->size = (bytes + gran - 1) / gran * gran;
    r = drv.create(&v->handle, v->size, &prop, 0);
    if (r != CUDA_SUCCESS) {
        const char *s = NULL;

        if (drv.error_string(r, &s) != CUDA_SUCCESS || s == NULL)
            s = "unknown error";
        return dsv4_err_set(r == CUDA_ERROR_OUT_OF_MEMORY ? DSV4_ERR_NOMEM : DSV4_ERR_CUDA,
                            "%s: cannot allocate %.2f GiB of shareable device memory: %s",
                            what, v->size / GIB, s);
    }
    v->created = 1;
    DRV_TRY(what, drv.export_fd(&fd, v->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    v->fd = fd;
    (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    return vmm_map(v, dev, gran, what);
}

/* Map another process's allocation (a->fd, a->alloc_bytes). */
static enum dsv4_err
vmm_import(struct cuda_vmm *v, int dev, const struct dsv4_cuda_arena *a, const char *what)
{
    CUmemAllocationProp prop;
    size_t gran;
    enum dsv4_err e;

    vmm_prop(&prop, dev);
    e = vmm_granularity(&prop, &gran, what);
    if (e != DSV4_OK)
        return e;
    if (a->alloc_bytes == 0 || a->alloc_bytes % gran != 0)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: imported allocation of %llu bytes is not "
                            "a multiple of the granularity %zu", what,
                            (unsigned long long)a->alloc_bytes, gran);
    v->size = (size_t)a->alloc_bytes;
    v->fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (v->fd < 0)
        return dsv4_err_set(DSV4_ERR_SYS, "%s: dup of the imported descriptor failed", what);
    DRV_TRY(what, drv.import_fd(&v->handle, (void *)(uintptr_t)v->fd,
                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    v->created = 1;
    return vmm_map(v, dev, gran, what);
}

int
cuda_arena_import(const struct dsv4_cuda_arena *a)
{
    return a != NULL && a->kind == DSV4_CUDA_ARENA_IMPORT;
}

enum dsv4_err
cuda_arena_alloc(struct dsv4_backend *be, struct cuda_wpriv *p, size_t bytes,
                 const struct dsv4_cuda_arena *a, const char *what)
{
    struct cuda_vmm *v;
    enum dsv4_err e;
    cudaError_t rc;
    int dev = cuda_st(be)->device;

    p->arena = NULL;
    p->vmm = NULL;
    if (a == NULL || a->kind == DSV4_CUDA_ARENA_PRIVATE) {
        rc = cudaMalloc((void **)&p->arena, bytes > 0 ? bytes : 256);
        if (rc != cudaSuccess) {
            (void)cudaGetLastError();
            p->arena = NULL;
            return dsv4_err_set(DSV4_ERR_NOMEM, "%s: cannot allocate %.2f GiB on the device",
                                what, bytes / GIB);
        }
        p->arena_bytes = bytes;
        return DSV4_OK;
    }
    if (a->kind == DSV4_CUDA_ARENA_IMPORT &&
        (a->used_bytes != bytes || a->layout != p->layout || a->alloc_bytes < bytes))
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: the imported weights have another layout "
                            "(%llu bytes, layout %016llx; ours %zu bytes, %016llx)", what,
                            (unsigned long long)a->used_bytes, (unsigned long long)a->layout,
                            bytes, (unsigned long long)p->layout);
    e = drv_load();
    if (e == DSV4_OK)
        e = vmm_device(be);
    if (e != DSV4_OK)
        return e;
    v = (struct cuda_vmm *)calloc(1, sizeof(*v));
    if (v == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: no memory", what);
    v->fd = -1;
    e = a->kind == DSV4_CUDA_ARENA_IMPORT ? vmm_import(v, dev, a, what) :
                                            vmm_create(v, dev, bytes > 0 ? bytes : 256, what);
    if (e != DSV4_OK) {
        vmm_free(v);
        return e;
    }
    p->vmm = v;
    p->arena = (char *)(uintptr_t)v->base;
    p->arena_bytes = bytes;
    log_info("%s: %s %.2f GiB of shareable device memory on device %d", what,
             a->kind == DSV4_CUDA_ARENA_IMPORT ? "mapped" : "allocated", v->size / GIB, dev);
    return DSV4_OK;
}

void
cuda_arena_free(struct cuda_wpriv *p)
{
    if (p->vmm != NULL)
        vmm_free(p->vmm);
    else if (p->arena != NULL)
        cudaFree(p->arena);
    p->vmm = NULL;
    p->arena = NULL;
}

/* --- public ------------------------------------------------------------------------------ */

extern "C" int
dsv4_cuda_share_supported(struct dsv4_backend *be)
{
    CUdevice d;
    int vmm = 0, fd = 0;
    CUresult r;

    if (!cuda_is_backend(be)) {
        dsv4_err_set(DSV4_ERR_INVAL, "weights share: not a CUDA backend");
        return 0;
    }
    if (drv_load() != DSV4_OK || vmm_device(be) != DSV4_OK)
        return 0;
    r = drv.device_get(&d, cuda_st(be)->device);
    if (r == CUDA_SUCCESS)
        r = drv.device_attr(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d);
    if (r == CUDA_SUCCESS)
        r = drv.device_attr(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                            d);
    if (r != CUDA_SUCCESS) {
        drv_err(r, "weights share", "cuDeviceGetAttribute");
        return 0;
    }
    if (!vmm || !fd) {
        dsv4_err_set(DSV4_ERR_NOTSUP, "weights share: device %d lacks %s", cuda_st(be)->device,
                     !vmm ? "virtual memory management" : "POSIX fd memory handles");
        return 0;
    }
    return 1;
}

extern "C" enum dsv4_err
dsv4_cuda_device_uuid(struct dsv4_backend *be, uint8_t uuid[16])
{
    struct cuda_state *st = cuda_st(be);

    if (!st->uuid_known) {   /* a rank asks for the weight share and for every READY */
        cudaDeviceProp prop;

        CUDA_TRY(cudaGetDeviceProperties(&prop, st->device));
        memcpy(st->uuid, prop.uuid.bytes, 16);
        st->uuid_known = 1;
    }
    memcpy(uuid, st->uuid, 16);
    return DSV4_OK;
}

extern "C" int
dsv4_cuda_weights_share_fd(const struct dsv4_weights *dev, uint64_t *alloc_bytes,
                           uint64_t *used_bytes, uint64_t *layout)
{
    const struct cuda_wpriv *p = (const struct cuda_wpriv *)dev->priv;

    if (p == NULL || p->vmm == NULL || p->vmm->fd < 0)
        return -1;
    *alloc_bytes = p->vmm->size;
    *used_bytes = p->arena_bytes;
    *layout = p->layout;
    return p->vmm->fd;
}
