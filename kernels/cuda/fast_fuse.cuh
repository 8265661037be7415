/*
 * fast_fuse.cuh — private header of the fused small ops (issue 7): the
 * row-norm reduction tree that the fast rms_norm (fast_norm.cu), the fused
 * hc finish (fast_hc.cu) and the fused norm + RoPE (fast_fuse.cu) share,
 * so that a fused kernel gives the bits of the fast ops it replaces, and
 * the fast entry points of the fused ops.
 *
 * The tree.  A row of D values is normed by B = fz_norm_threads(D) threads
 * (a multiple of 32, from D only): thread i sums the squares of elements i,
 * i + B, i + 2B, ... in order, each warp adds its 32 partials by an xor
 * butterfly (every lane ends with the same bits: the additions are
 * commutative), and the B/32 warp sums are added in warp order.
 */
#ifndef DSV4_KERNELS_CUDA_FAST_FUSE_CUH
#define DSV4_KERNELS_CUDA_FAST_FUSE_CUH

#include "kernels/cuda/cuda.cuh"

#define FZ_NORM_MAX_THREADS 256

/* Threads of the norm tree for rows of D values (about 8 values each). */
static __host__ __device__ __forceinline__ int
fz_norm_threads(int D)
{
    int t = (D / 8 + 31) / 32 * 32;

    return t < 32 ? 32 : t > FZ_NORM_MAX_THREADS ? FZ_NORM_MAX_THREADS : t;
}

/* Sum over the warp by the xor butterfly (same bits on every lane). */
static __device__ __forceinline__ float
fz_warp_sum(float v)
{
    for (int o = 16; o > 0; o /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* red[0] + red[1] + ... + red[nw - 1], in that order. */
static __device__ __forceinline__ float
fz_ordered_sum(const float *red, int nw)
{
    float acc = red[0];

    for (int j = 1; j < nw; j++)
        acc += red[j];
    return acc;
}

/* 1 / sqrtf(mean + eps) of a row's sum of squares (the norm's scale). */
static __device__ __forceinline__ float
fz_norm_scale(float sumsq, int D, float eps)
{
    return 1.0f / sqrtf(sumsq / (float)D + eps);
}

/* The normed value: bf16(bf16(x) * rs * w) (w == NULL: no weight). */
static __device__ __forceinline__ float
fz_norm_value(float x, float rs, const uint16_t *w, int i)
{
    float v = cu_bf16_round(x) * rs;

    if (w != NULL)
        v *= cu_bf16_to_f32(w[i]);
    return cu_bf16_round(v);
}

/* --- fast entry points of the fused ops (kernels/backend.h) ----------------------- */

/* 0 when the environment has DSV4_CUDA_FUSE=0: the fused ops run their
 * compositions, hc_pre / hc_head the exact kernels and compress the
 * one-warp-per-channel kernel at every T, even with the fast kernels on
 * (to rule these kernels out); 1 otherwise.  Read once. */
int cuda_fast_fuse_enabled(void);

/* fast_hc.cu: hc_post_pre with the fast kernels (cuda_fast_hc_ok(n, 0)). */
enum dsv4_err cuda_fast_hc_post_pre(struct dsv4_backend *be, float *X_out, float *x_out,
                                    float *post_out, float *comb_out, float *xn, const float *f,
                                    const float *X, const float *post, const float *comb,
                                    const struct dsv4_hc_w *hc, const uint16_t *nw, int T,
                                    int n, int D, int iters, float hc_eps, float norm_eps);

#endif
