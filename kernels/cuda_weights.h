/*
 * cuda_weights.h — the model's weights in device memory for the CUDA
 * backend (kernels/cuda/cuda_weights.cu).
 *
 * dsv4_cuda_weights_upload() copies every tensor of a loaded checkpoint
 * (common/weights.h: pointers into the host mappings) into one device
 * allocation, in the checkpoint's own layout and formats (FP8 with E8M0
 * block scales, FP4 experts packed two per byte), and fills a copy of the
 * struct whose pointers are device pointers.  The `layers` array and each
 * layer's `experts` array stay host arrays (of structs holding device
 * pointers), as the forward pass and the moe op expect; each experts array is
 * also registered with the backend together with a device copy, so the moe
 * op reads it without synchronising.  Progress is logged (log_info) every
 * GiB and at the end.
 *
 * Only available in builds with CUDA (DSV4_HAVE_CUDA).
 */
#ifndef DSV4_KERNELS_CUDA_WEIGHTS_H
#define DSV4_KERNELS_CUDA_WEIGHTS_H

#include <stdint.h>

#include "common/err.h"
#include "common/weights.h"
#include "common/weights_shard.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Upload `host` to the device of CUDA backend `be` and fill *dev.  `host`
 * may be freed afterwards.  DSV4_ERR_NOMEM when the device memory does not
 * suffice, DSV4_ERR_INVAL when `be` is not a CUDA backend.
 */
enum dsv4_err dsv4_cuda_weights_upload(struct dsv4_backend *be, struct dsv4_weights *dev,
                                       const struct dsv4_weights *host);

/* Progress callback of an upload or a generation: `done` of `total` bytes
 * are on the device.  Called every GiB and once at the end, on the calling
 * thread. */
struct dsv4_cuda_progress {
    void (*fn)(void *ctx, uint64_t done, uint64_t total);
    void *ctx;
};

/* dsv4_cuda_weights_upload with progress reports (pr may be NULL). */
enum dsv4_err dsv4_cuda_weights_upload_progress(struct dsv4_backend *be,
                                                struct dsv4_weights *dev,
                                                const struct dsv4_weights *host,
                                                const struct dsv4_cuda_progress *pr);

/*
 * Synthetic weights (kernels/cuda/cuda_synth.cu): build every tensor of the
 * inventory of `cfg` (common/model_tensors.h: same names, shapes and
 * formats as dsv4-mkmodel writes) directly in device memory and fill *dev as
 * dsv4_cuda_weights_upload would.  Values have dsv4-mkmodel's distributions
 * (docs/mkmodel.md) drawn from a counter-based generator keyed by (seed,
 * inventory index, element index), so the same seed gives the same bytes on
 * any GPU; they are not dsv4-mkmodel's bytes.  Free with
 * dsv4_cuda_weights_free.  pr may be NULL.
 */
enum dsv4_err dsv4_cuda_weights_synthetic(struct dsv4_backend *be, struct dsv4_weights *dev,
                                          const struct dsv4_config *cfg, uint64_t seed,
                                          const struct dsv4_cuda_progress *pr);

/*
 * The part of the synthetic weights that rank `rank` of a group of `size`
 * holds (common/weights_shard.h) under the group split `split`: the same
 * values as the corresponding elements of dsv4_cuda_weights_synthetic(seed),
 * only the tensors, rows and columns of that rank on the device; the struct
 * is what dsv4_weights_shard() makes of the full weights.  DSV4_ERR_CONFIG
 * when cfg cannot be split.
 */
enum dsv4_err dsv4_cuda_weights_synthetic_shard(struct dsv4_backend *be,
                                                struct dsv4_weights *dev,
                                                const struct dsv4_config *cfg, uint64_t seed,
                                                int rank, int size,
                                                enum dsv4_group_split split,
                                                const struct dsv4_cuda_progress *pr);

/* Free what dsv4_cuda_weights_upload or _synthetic made (a zeroed *dev is
 * a no-op). */
void dsv4_cuda_weights_free(struct dsv4_backend *be, struct dsv4_weights *dev);

#ifdef __cplusplus
}
#endif
#endif
