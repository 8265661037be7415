/*
 * cuda_gemm_grouped.h — the prefill GEMM of the grouped output projection
 * (linear_grouped: wo_a) in the CUDA backend (kernels/cuda/fast_gemm.cu,
 * fw_kernel's grouped mode; docs/gpu.md, "Prefill GEMMs").  With the fast
 * kernels on, cuda_linear_grouped takes it at T > 64 rows where the cost
 * model of the dense FP8 linears prefers the GEMM; the decode kernels
 * (fast_linear.cu, FL_GROUPED) keep the other calls.  The switch and the
 * direct entry are here for the benchmark (tests/gpu/bench_woa.c).
 * C-callable; only in builds with CUDA.
 */
#ifndef DSV4_KERNELS_CUDA_GEMM_GROUPED_H
#define DSV4_KERNELS_CUDA_GEMM_GROUPED_H

#include "common/err.h"
#include "common/weights.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * on != 0: linear_grouped calls that qualify (cuda_fast_gemm_grouped_ok)
 * take the grouped GEMM; 0: they keep the decode kernels at every T; -1:
 * back to the environment's choice (DSV4_CUDA_GEMM_GROUPED=0 or off: not
 * used; default: used).  Process-wide; takes effect for ops queued
 * afterwards.  The two paths sum in another order (a value may differ in
 * the last bit between them).
 */
void dsv4_cuda_set_gemm_grouped(int on);

/* 1 when the grouped GEMM is switched on (dsv4_cuda_set_gemm_grouped, the
 * environment); says nothing about the device or the shape. */
int cuda_fast_gemm_grouped_on(void);

/*
 * 1 when cuda_linear_grouped (fast kernels on) takes the grouped GEMM for
 * W, T rows and G groups: T > 64, the switch on, DSV4_CUDA_GEMM not off,
 * the Hopper path on an sm_90 device (DSV4_CUDA_WGMMA, dsv4_cuda_set_wgmma),
 * FP8 weights with scales, rows per group R = n_out / G and n_in multiples
 * of 128, codes 16-byte aligned, and the dense linears' cost model of T,
 * n_out and n_in prefers the GEMM.  Host-side checks only.
 */
int cuda_fast_gemm_grouped_ok(const struct dsv4_backend *be, const struct dsv4_linear *W, int T,
                              int G);

/*
 * out (T, G, R)[t, g, :] = W[g rows] (R, K) · bf16(x (T, G, K)[t, g, :]):
 * linear_grouped's contract (kernels/backend.h) with W (G * R, K) FP8,
 * 128x128 E8M0 block scales, decoded to the exact bf16 values w * s_w, the
 * products summed in fp32 over all of K by the tensor cores, outputs
 * bf16-rounded.  Each output depends on its own token row and weight row
 * only (not on T, the tile or the other rows).  On cuBLASLt at every T
 * unless dsv4_cuda_set_blas / DSV4_CUDA_BLAS say otherwise (below; the op
 * takes it from DSV4_CUDA_BLAS_MIN_T rows).  Any T >= 0 (the T > 64
 * and cost-model conditions of _ok are not applied); the shape, format and
 * device conditions of _ok are, else DSV4_ERR_NOTSUP.  Uses the backend
 * scratch (T * G * K bf16 values; on cuBLASLt also the bf16 weights and
 * outputs).
 */
enum dsv4_err cuda_fast_gemm_grouped(struct dsv4_backend *be, float *out, const float *x,
                                     const struct dsv4_linear *W, int T, int G);

/*
 * on != 0: cuda_fast_gemm_grouped, and the shared expert of the prefill MoE
 * GEMM (fast_gemm.cu, fw_moe), run on cuBLASLt (kernels/cuda/fast_blas.cu:
 * the FP8 weights decoded once a call, cuBLASLt's BF16 GEMM) where
 * libcublasLt can be opened, and on fw_kernel otherwise; 0: fw_kernel
 * always; -1: back to the environment (DSV4_CUDA_BLAS=0 or off: fw_kernel;
 * default on).  Process-wide; for ops queued afterwards.  The two sum in
 * other orders (a value may differ in the last bit between them).
 */
void dsv4_cuda_set_blas(int on);

/* 1 when the cuBLASLt path is switched on (dsv4_cuda_set_blas, the
 * environment); says nothing of the library. */
int dsv4_cuda_blas_on(void);

/*
 * 1 when be's prefill GEMMs may take cuBLASLt: the path switched on
 * (dsv4_cuda_blas_on), libcublasLt opened with its handle and workspace (made
 * here on first use, as the first cuBLASLt call would), and, where be's
 * context is an MPS client, DSV4_CUDA_BLAS_MPS not 0 (in an MPS client the
 * plans use clusters of one block: docs/gpu.md "Prefill beside decode").  0
 * otherwise, the reason in dsv4_errmsg(); the GEMMs then run on fw_kernel /
 * g8_kernel.  Asked by the shared expert's path (fw_moe) and the grouped
 * GEMM before they queue anything, and by the rank for its start-up log.
 */
int dsv4_cuda_blas_usable(struct dsv4_backend *be);

/*
 * The least T at which linear_grouped (fast kernels on) takes cuBLASLt:
 * below it the weights' decode of each call costs more than fw_kernel's
 * grouped mode saves (docs/perf.md run 47: wo_a at T = 128 85 against 60
 * µs, at 256 94 against 105, wo_a/2 at 256 72 against 58, at 512 81 against
 * 100).  cuda_fast_gemm_grouped itself follows the switch at every T (its
 * rows T-independent on either path).
 */
#define DSV4_CUDA_BLAS_MIN_T 384

#ifdef __cplusplus
}
#endif

#endif
