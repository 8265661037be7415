/*
 * fast_norm.cu — the fast rms_norm: one block per row instead of one warp
 * whose 8-lane groups each run a sequential chain (cuda_norm.cu).  Used by
 * cuda_rms_norm when dsv4_cuda_set_kernels(be, 1) was called (any shape).
 *
 * The sum of squares of the bf16-rounded row is a fixed tree: thread i of
 * the block sums elements i, i + B, i + 2B, ... in order (B = block size, a
 * function of D only), each warp adds its 32 partials by an xor butterfly,
 * and every thread adds the warps' sums in warp order.  So the result is
 * deterministic and independent of the number of rows; only this sum's order
 * differs from the exact path, the rest (1 / sqrtf(mean + eps), the
 * product with w, bf16 roundings) is the same expression.  The tree and the
 * expressions live in fast_fuse.cuh: the fused ops that end in a norm (the
 * hc finish, norm_rope) use them and give the same bits.
 *
 * Two versions (cuda_fast_norm_version, fast_fuse.cuh): fn2_kernel (v2,
 * default where D <= FZ_K * B, i.e. every D <= 4096) issues all of a
 * thread's loads of x and w before the sum and keeps the row in registers
 * for the output; fn_kernel (v1, DSV4_CUDA_NORM=v1, and longer rows) loops
 * with one load per iteration and reads x again after the sum.  The same
 * expressions in the same order: the same bits.
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_fuse.cuh"   /* the tree, shared with the fused ops */

static __global__ void __launch_bounds__(FZ_NORM_MAX_THREADS)
fn_kernel(float *out, const float *x, const uint16_t *w, int D, float eps)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ float red[FZ_NORM_MAX_THREADS / 32];
    int64_t r = blockIdx.x;
    int nw = blockDim.x / 32, lane = threadIdx.x % 32;
    const float *xr = x + r * D;
    float acc = 0.0f, rs;

    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = cu_bf16_round(xr[i]);

        acc += v * v;
    }
    acc = fz_warp_sum(acc);
    if (lane == 0)
        red[threadIdx.x / 32] = acc;
    __syncthreads();   /* also: every read of x is done before out (== x?) is written */
    rs = fz_norm_scale(fz_ordered_sum(red, nw), D, eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x)
        out[r * D + i] = fz_norm_value(xr[i], rs, w, i);
}

/* fn_kernel with the FZ_K elements i, i + B, ... of each thread (and their
 * weights) loaded into registers first; D <= FZ_K * blockDim.x. */
static __global__ void __launch_bounds__(FZ_NORM_MAX_THREADS)
fn2_kernel(float *out, const float *x, const uint16_t *w, int D, float eps)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ float red[FZ_NORM_MAX_THREADS / 32];
    int64_t r = blockIdx.x;
    int B = blockDim.x, tid = threadIdx.x;
    const float *xr = x + r * D;
    float v[FZ_K], rs;
    uint16_t wb[FZ_K];

    fz_row_load(v, wb, xr, w, D, tid, B);
    /* its __syncthreads: every read of x is done before out (== x?) is written */
    rs = fz_row_scale(v, red, D, tid, B, eps);
#pragma unroll
    for (int k = 0; k < FZ_K; k++) {
        int i = tid + k * B;

        if (i < D)
            out[r * D + i] = fz_norm_apply(v[k], rs, w != NULL, wb[k]);
    }
}

enum dsv4_err
cuda_fast_rms_norm(struct dsv4_backend *be, float *out, const float *x, const uint16_t *w,
                   int rows, int D, float eps)
{
    if (rows <= 0 || D <= 0)
        return DSV4_OK;
    if (cuda_fast_norm_version() >= 2 && fz_fits_regs(D))
        cu_launch(fn2_kernel, rows, fz_norm_threads(D), 0, cuda_stream(be), out, x, w, D, eps);
    else
        cu_launch(fn_kernel, rows, fz_norm_threads(D), 0, cuda_stream(be), out, x, w, D, eps);
    CUDA_LAUNCHED("fast rms_norm");
    return DSV4_OK;
}
