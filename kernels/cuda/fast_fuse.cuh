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

/* Threads of the norm tree for rows of D values (about 8 values each); a
 * constant expression for a constant D (fz_norm_rope4_kernel). */
static constexpr __host__ __device__ __forceinline__ int
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

/* fz_norm_apply before its last rounding: bf16(x) * rs * w.  Its
 * cvt.rn.bf16.f32 is the normed value's bf16 (the same RNE on finite
 * values, and a product of a NaN is the canonical NaN either way). */
static __device__ __forceinline__ float
fz_norm_pre(float x, float rs, int has_w, uint16_t wb, int x_bf16 = 0)
{
    float v = (x_bf16 ? x : cu_bf16_round(x)) * rs;

    if (has_w)
        v *= cu_bf16_to_f32(wb);
    return v;
}

/* The normed value bf16(bf16(x) * rs * w) with the weight's bf16 bits wb
 * already loaded (has_w == 0: no weight, wb unused).  x_bf16: x is a bf16
 * value already (it rounds to itself, so the first rounding is left out). */
static __device__ __forceinline__ float
fz_norm_apply(float x, float rs, int has_w, uint16_t wb, int x_bf16 = 0)
{
    return cu_bf16_round(fz_norm_pre(x, rs, has_w, wb, x_bf16));
}

/* The normed value: bf16(bf16(x) * rs * w) (w == NULL: no weight). */
static __device__ __forceinline__ float
fz_norm_value(float x, float rs, const uint16_t *w, int i)
{
    return fz_norm_apply(x, rs, w != NULL, w != NULL ? w[i] : (uint16_t)0);
}

/* Component e (0..3, a constant after unrolling) of v. */
static __device__ __forceinline__ float
fz_f4(float4 v, int e)
{
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

/* Elements per thread of the norm tree that the v2 kernels (fast_norm.cu,
 * fast_fuse.cu) hold in registers: rows with D <= FZ_K * fz_norm_threads(D)
 * (every D <= 4096) take them, longer rows the v1 loops. */
#define FZ_K 16

/* Whether a row of D values fits the v2 kernels' registers. */
static __host__ __device__ __forceinline__ int
fz_fits_regs(int D)
{
    return D >= 1 && D <= FZ_K * fz_norm_threads(D);
}

/* v2: elements tid + k*B (k < FZ_K) of the row xr into v (0 past D) and
 * their weights' bits into wb (0 without w), every load issued first. */
static __device__ __forceinline__ void
fz_row_load(float *v, uint16_t *wb, const float *xr, const uint16_t *w, int D, int tid, int B)
{
#pragma unroll
    for (int k = 0; k < FZ_K; k++) {
        int i = tid + k * B;

        v[k] = i < D ? xr[i] : 0.0f;
        wb[k] = i < D && w != NULL ? w[i] : (uint16_t)0;
    }
}

/* v2: this warp's sum of squares of the row's elements that fz_row_load
 * gave thread tid of the B tree threads, into red[tid / 32] (the tree's
 * first half; no barrier: fz_row_scale, or the caller's). */
static __device__ __forceinline__ void
fz_row_sumsq(const float *v, float *red, int D, int tid, int B)
{
    float acc = 0.0f;

#pragma unroll
    for (int k = 0; k < FZ_K; k++) {
        float b = cu_bf16_round(v[k]);

        if (tid + k * B < D)
            acc += b * b;
    }
    acc = fz_warp_sum(acc);
    if (tid % 32 == 0)
        red[tid / 32] = acc;
}

/* v2: the norm's scale of the row that fz_row_load gave the B = blockDim.x
 * threads of the block (the tree above); red: B / 32 shared floats.  One
 * __syncthreads: every thread of the block calls it. */
static __device__ __forceinline__ float
fz_row_scale(const float *v, float *red, int D, int tid, int B, float eps)
{
    fz_row_sumsq(v, red, D, tid, B);
    __syncthreads();
    return fz_norm_scale(fz_ordered_sum(red, B / 32), D, eps);
}

/* --- kernel versions ------------------------------------------------------------------ */

/*
 * The version of the small fast kernels: 1 the first ones (global loads
 * issued one loop iteration at a time), 2 the ones that issue every load of
 * a thread up front; 3 (the default of both): hc, v2 with the finish
 * launched as a programmatic dependent launch (fast_hc.cu); norm, v2 with
 * norm_rope's helper warps for calls of up to 256 rows and norm_rope2's
 * one launch (fast_fuse.cu; rms_norm runs v2).  All give the same bits.
 * hc: fast_hc.cu (hc_pre, hc_head, hc_post_pre), DSV4_CUDA_HC=v1|v2|v3 in
 * the environment; norm: the fast rms_norm (fast_norm.cu) and norm_rope
 * (fast_fuse.cu), DSV4_CUDA_NORM=v1|v2|v3.  dsv4_cuda_set_small_kernels
 * (kernels/cuda_fast.h) overrides both.  The environment is read once.
 */
int cuda_fast_hc_version(void);
int cuda_fast_norm_version(void);

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
