/*
 * fast_gemm.cuh — the prefill GEMM entry points of fast_gemm.cu beyond those
 * declared in cuda.cuh: the BF16 linear at many rows (the Hopper wgmma
 * path), called by cuda_linear when the fast kernels are on; and, through
 * kernels/cuda_gemm_grouped.h, the grouped linear's (linear_grouped: wo_a),
 * called by cuda_linear_grouped.
 */
#ifndef DSV4_KERNELS_CUDA_FAST_GEMM_CUH
#define DSV4_KERNELS_CUDA_FAST_GEMM_CUH

#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda_gemm_grouped.h"

/* Physical position of logical column c (permuted inside 32-column groups):
 * fw_kernel's B operand order (fast_gemm.cu, "Column order"), also that of
 * the bf16 weights fast_blas.cu decodes for the shared expert. */
static __device__ __forceinline__ int
fw_perm(int c)
{
    return (c & ~31) | ((c >> 1) & 1) << 4 | (c & 1) << 3 | ((c >> 3) & 3) << 1 | ((c >> 2) & 1);
}

/*
 * BF16 weights at T > 64 rows (calls of up to 64 rows keep the decode
 * kernels: FG_DECODE_ROWS), n_in % 128 == 0, n_out % 64 == 0, weights
 * 16-byte aligned, on an sm_90 device with the wgmma path on
 * (DSV4_CUDA_WGMMA, dsv4_cuda_set_wgmma) and the GEMM expected faster than
 * the decode kernels by a cost model of T, N and K.  Host-side checks only.
 */
int cuda_fast_gemm_bf16_ok(const struct dsv4_backend *be, const struct dsv4_linear *W, int T);

/*
 * out (T, n_out) = x (T, n_in) times W^T with x as given (x = hi + lo, two
 * bf16 parts, exact products, fp32 sums over all of K); bf16-rounded unless
 * flags has DSV4_LIN_F32_OUT.  Each output depends on its own row and
 * column only.
 */
enum dsv4_err cuda_fast_gemm_bf16(struct dsv4_backend *be, float *out, const float *x,
                                  const struct dsv4_linear *W, int T, unsigned flags);

/* Scratch bytes cuda_fast_gemm_bf16_at takes for W at T rows. */
size_t cuda_fast_gemm_bf16_scratch(const struct dsv4_linear *W, int T);

/* cuda_fast_gemm_bf16 with its scratch placed `off` bytes into the backend
 * scratch (the caller keeps its own arrays in the first `off` bytes and
 * reserves off + cuda_fast_gemm_bf16_scratch(W, T) beforehand). */
enum dsv4_err cuda_fast_gemm_bf16_at(struct dsv4_backend *be, float *out, const float *x,
                                     const struct dsv4_linear *W, int T, unsigned flags,
                                     size_t off);

/*
 * The linears of a prefill linear_multi (cuda_linear_multi: n of them, one
 * x of T > 16 rows) that cuda_linear would give to cuBLASLt, with x
 * prepared once: the BF16 ones (cuda_blas_bf16) share one split of x into
 * hi + lo, the FP8 ones (cuda_fast_gemm8_blas) one quantization of x.
 * The outputs are cuda_linear's, bit for bit.  done[i] = 1 for each linear
 * queued here; the caller runs the others (cuBLASLt turned them down, or
 * cuda_linear takes another path for them) after, since this one leaves
 * its prepared x in the backend scratch.  DSV4_CUDA_LIN_SHARE=0: none
 * taken.
 */
enum dsv4_err cuda_fast_gemm_multi(struct dsv4_backend *be, int n, float *const *outs,
                                   const float *x, const struct dsv4_linear *const *Ws,
                                   const unsigned *flags, int T, int *done);

#endif
