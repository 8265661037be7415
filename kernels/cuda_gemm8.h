/*
 * cuda_gemm8.h — the opt-in FP8 x FP8 prefill linear of the CUDA backend
 * (kernels/cuda/fast_gemm8.cu): both operands E4M3 in shared memory, wgmma
 * m64n128k32 .e4m3.e4m3, per 128-column block partial sums scaled by
 * s_w * s_x in fp32.  Used by the FP8 linear's prefill GEMM
 * (cuda_fast_gemm_linear, fast_gemm.cu) in place of the Hopper bf16 path
 * when switched on.  C-callable; only in builds with CUDA.
 */
#ifndef DSV4_KERNELS_CUDA_GEMM8_H
#define DSV4_KERNELS_CUDA_GEMM8_H

#include "common/err.h"
#include "common/weights.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * on != 0: FP8 linears that reach the prefill GEMM on an sm_90 device
 * (REF numerics, T > 64 rows, the Hopper path on) take the FP8 x FP8
 * kernel; 0: they keep fw_kernel; -1: back to the environment's choice
 * (DSV4_CUDA_GEMM8=0 or off: not used; default: used).  Process-wide; takes
 * effect for ops queued afterwards.  The two kernels round differently (a
 * value may differ in the last bits between them).
 */
void dsv4_cuda_set_gemm8(int on);

/* 1 when the FP8 x FP8 linear is switched on (dsv4_cuda_set_gemm8, the
 * environment); says nothing about the device. */
int cuda_fast_gemm8_on(void);

/*
 * out (T, n_out) = bf16-rounded x (T, n_in) times W^T under REF numerics
 * (on cuBLASLt's FP8 block-scaled GEMM where it takes the shape and the
 * cuBLASLt paths are on, DSV4_CUDA_BLAS and DSV4_CUDA_BLAS_FP8; else the
 * wgmma kernel):
 * x quantized to E4M3 per 128 columns with power-of-two scales (the exact
 * path's codes), per 128-column block the tensor cores' fp32 sum of the
 * code products, acc += blk * (s_w * s_x), blocks in order.  W FP8 with
 * 128x128 E8M0 block scales, n_out and n_in multiples of 128, W->w 16-byte
 * aligned; sm_90a device.  Each output depends on its own row and token
 * only (not on T, the tile or the grid).  Uses the backend scratch.
 */
enum dsv4_err cuda_fast_gemm8_linear(struct dsv4_backend *be, float *out, const float *x,
                                     const struct dsv4_linear *W, int T);
/* cuda_fast_gemm8_linear's cuBLASLt form without the widening: the bf16
 * outputs (T, n_out) in the backend scratch at *ob (valid until the next
 * cuda_scratch).  DSV4_ERR_NOTSUP before anything is queued where
 * cuBLASLt does not take the shape or the cuBLASLt FP8 path is off. */
enum dsv4_err cuda_fast_gemm8_b16(struct dsv4_backend *be, uint16_t **ob, const float *x,
                                  const struct dsv4_linear *W, int T);
/* cuda_fast_gemm8_linear's cuBLASLt form alone: DSV4_ERR_NOTSUP (nothing
 * queued) where that form does not take W.  x_ready: x's codes and scales
 * are in the backend scratch already, from a call of this function on the
 * same x, T and n_in queued before, the scratch not used since and big
 * enough for this call (cuda_fast_gemm8_blas_scratch) then (a prefill
 * linear_multi quantizes its x once). */
enum dsv4_err cuda_fast_gemm8_blas(struct dsv4_backend *be, float *out, const float *x,
                                   const struct dsv4_linear *W, int T, int x_ready);
/* The backend scratch bytes cuda_fast_gemm8_blas takes for W at T rows. */
size_t cuda_fast_gemm8_blas_scratch(const struct dsv4_linear *W, int T);

#ifdef __cplusplus
}
#endif

#endif
