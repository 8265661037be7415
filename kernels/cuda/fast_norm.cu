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
 * product with w, bf16 roundings) is the same expression.
 */
#include "kernels/cuda/fast.cuh"

#define FN_MAX_THREADS 256

/* Threads per row for rows of D values (about 8 values each). */
static int
fn_threads(int D)
{
    int t = (D / 8 + 31) / 32 * 32;

    return t < 32 ? 32 : t > FN_MAX_THREADS ? FN_MAX_THREADS : t;
}

static __global__ void __launch_bounds__(FN_MAX_THREADS)
fn_kernel(float *out, const float *x, const uint16_t *w, int D, float eps)
{
    __shared__ float red[FN_MAX_THREADS / 32];
    int64_t r = blockIdx.x;
    int nw = blockDim.x / 32, lane = threadIdx.x % 32;
    const float *xr = x + r * D;
    float acc = 0.0f, rs;

    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = cu_bf16_round(xr[i]);

        acc += v * v;
    }
    for (int o = 16; o > 0; o /= 2)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0)
        red[threadIdx.x / 32] = acc;
    __syncthreads();   /* also: every read of x is done before out (== x?) is written */
    acc = red[0];
    for (int j = 1; j < nw; j++)
        acc += red[j];
    rs = 1.0f / sqrtf(acc / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float v = cu_bf16_round(xr[i]) * rs;

        if (w != NULL)
            v *= cu_bf16_to_f32(w[i]);
        out[r * D + i] = cu_bf16_round(v);
    }
}

enum dsv4_err
cuda_fast_rms_norm(struct dsv4_backend *be, float *out, const float *x, const uint16_t *w,
                   int rows, int D, float eps)
{
    if (rows <= 0 || D <= 0)
        return DSV4_OK;
    fn_kernel<<<rows, fn_threads(D), 0, cuda_stream(be)>>>(out, x, w, D, eps);
    CUDA_LAUNCHED("fast rms_norm");
    return DSV4_OK;
}
