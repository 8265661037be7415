/*
 * cuda_share.h — device weights whose memory another process of the same
 * GPU can map (kernels/cuda/cuda_share.cu; docs/gpu.md "Weight sharing").
 *
 * The arena of the weights (kernels/cuda_weights.h: one allocation holding
 * every tensor) is made with the CUDA virtual memory API (cuMemCreate with a
 * POSIX file descriptor handle, cuMemAddressReserve, cuMemMap,
 * cuMemSetAccess), reached through cudaGetDriverEntryPointByVersion so the
 * programs keep linking only the static runtime and still start on machines
 * without a GPU.  The descriptor (common/weights_share.h hands it over) keeps
 * the memory alive while any process holds it or a mapping of it: either
 * process may exit and the other keeps the weights.
 *
 * The importing process computes the same layout as the owner without the
 * data (the tensors' places follow from the config and the part held, or
 * from the checkpoint's host struct) and maps the received allocation under
 * it; nothing is copied or generated.  The layout hash travels with the
 * descriptor and must match.
 *
 * Only available in builds with CUDA (DSV4_HAVE_CUDA).
 */
#ifndef DSV4_KERNELS_CUDA_SHARE_H
#define DSV4_KERNELS_CUDA_SHARE_H

#include <stdint.h>

#include "common/err.h"
#include "common/weights.h"
#include "kernels/backend.h"
#include "kernels/cuda_weights.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where the arena of device weights comes from. */
enum dsv4_cuda_arena_kind {
    DSV4_CUDA_ARENA_PRIVATE = 0,  /* cudaMalloc: the plain upload/synthetic */
    DSV4_CUDA_ARENA_SHAREABLE,    /* a VMM allocation with an exportable fd */
    DSV4_CUDA_ARENA_IMPORT,       /* another process's allocation: map it,
                                     place the tensors, write nothing */
};

/* The device allocation that holds a rank's weights, of one of the kinds
 * above. */
struct dsv4_cuda_arena {
    enum dsv4_cuda_arena_kind kind;
    /* IMPORT only (from struct dsv4_wshare_hdr): */
    int fd;                /* received descriptor; dup'd, the caller keeps it */
    uint64_t alloc_bytes;  /* size of the allocation behind fd */
    uint64_t used_bytes;   /* the owner's arena bytes (must equal ours) */
    uint64_t layout;       /* the owner's layout hash (must equal ours) */
};

/*
 * Whether the device of CUDA backend `be` can make and import shareable
 * allocations (driver entry points found, POSIX fd handles supported).  On
 * 0, dsv4_errmsg() says why.
 */
int dsv4_cuda_share_supported(struct dsv4_backend *be);

/* The UUID of the backend's device (cudaDeviceProp.uuid), asked of the runtime
 * at the first call and kept by the backend for later ones. */
enum dsv4_err dsv4_cuda_device_uuid(struct dsv4_backend *be, uint8_t uuid[16]);

/*
 * dsv4_cuda_weights_upload_progress with the arena from `a` (NULL: private).
 * IMPORT places the tensors of `host` (only its shapes are read; the
 * checkpoint's mappings are not touched) in the mapped allocation.
 * DSV4_ERR_WEIGHTS when an import's size or layout hash differ from ours.
 */
enum dsv4_err dsv4_cuda_weights_upload_arena(struct dsv4_backend *be, struct dsv4_weights *dev,
                                             const struct dsv4_weights *host,
                                             const struct dsv4_cuda_progress *pr,
                                             const struct dsv4_cuda_arena *a);

/*
 * dsv4_cuda_weights_synthetic_shard with the arena from `a` (NULL: private).
 * IMPORT computes the layout only (no generation).
 */
enum dsv4_err dsv4_cuda_weights_synthetic_arena(struct dsv4_backend *be,
                                                struct dsv4_weights *dev,
                                                const struct dsv4_config *cfg, uint64_t seed,
                                                int rank, int size,
                                                enum dsv4_group_split split,
                                                const struct dsv4_cuda_progress *pr,
                                                const struct dsv4_cuda_arena *a);

/*
 * The descriptor of the arena of `dev` (made SHAREABLE or IMPORTed; owned by
 * dev, closed by dsv4_cuda_weights_free) and the values for a struct
 * dsv4_wshare_hdr: allocation size, bytes used, layout hash.  -1 for a
 * private arena.
 */
int dsv4_cuda_weights_share_fd(const struct dsv4_weights *dev, uint64_t *alloc_bytes,
                               uint64_t *used_bytes, uint64_t *layout);

#ifdef __cplusplus
}
#endif
#endif
