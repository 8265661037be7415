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

#include "common/err.h"
#include "common/weights.h"
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

/* Free what dsv4_cuda_weights_upload made (a zeroed *dev is a no-op). */
void dsv4_cuda_weights_free(struct dsv4_backend *be, struct dsv4_weights *dev);

#ifdef __cplusplus
}
#endif
#endif
