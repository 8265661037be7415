/*
 * cuda_linear.cu — linear (BF16 / FP8 block-scaled / FP4 group-scaled
 * weights, kept in their checkpoint layout), the grouped output projection,
 * and the FP8 activation quantization they share with the moe op.
 *
 * Numerics: those of cpu_linear.c (see its header), through cu_lin_dot
 * (cuda.cuh): weights decoded per element to their exact real value, the
 * REF path quantizes each input row per 128 columns to FP8 first and sums
 * per block times the block scale, everything else is one canonical dot.
 *
 * Kernels (correct first, not fast): one block of 256 threads computes 32
 * outputs of one row, an 8-thread group per output.  The fast paths
 * (cuBLASLt FP8, FP4 grouped GEMM) are the next issue's.
 */
#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda_gemm_grouped.h"   /* DSV4_CUDA_BLAS_MIN_T */
#include "kernels/cuda/fast_gemm.cuh"

#define LIN_THREADS 256
#define LIN_GROUPS (LIN_THREADS / 8)   /* outputs per block */
#define QBLK 128

/* --- activation quantization --------------------------------------------------- */

/* One warp per (row, 128-block): dsv4_fp8_quant_block. */
static __global__ void
quant_kernel(float *xq, float *sx, const float *x, int64_t stride, int rows, int K)
{
    int nb = K / QBLK;
    int64_t wid = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    int64_t r = wid / nb;
    int b = (int)(wid % nb);
    float amax = 1e-4f, v[QBLK / 32], s;
    const float *xb;

    if (r >= rows)
        return;   /* whole warps leave together */
    xb = x + r * stride + (int64_t)b * QBLK;
    for (int i = 0; i < QBLK / 32; i++) {
        v[i] = xb[lane + 32 * i];
        amax = fmaxf(amax, fabsf(v[i]));
    }
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    s = cu_pow2_scale(amax, 448.0f);
    for (int i = 0; i < QBLK / 32; i++)
        xq[r * K + (int64_t)b * QBLK + lane + 32 * i] =
            cu_fp8_to_f32(cu_f32_to_fp8(cu_clampf(v[i] / s, 448.0f)));
    if (lane == 0)
        sx[r * nb + b] = s;
}

enum dsv4_err
cuda_quant_rows(struct dsv4_backend *be, float *xq, float *sx, const float *x, int64_t stride,
                int rows, int K)
{
    int64_t warps = (int64_t)rows * (K / QBLK);

    if (K % QBLK != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda linear: FP8 activation quantization needs "
                            "K %% 128 == 0 (K=%d)", K);
    if (warps <= 0)
        return DSV4_OK;
    quant_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, cuda_stream(be)>>>(xq, sx, x, stride,
                                                                          rows, K);
    CUDA_LAUNCHED("quant");
    return DSV4_OK;
}

/* --- linear ---------------------------------------------------------------------------- */

/*
 * out[t, o] for o < N (N = W.n_out): row t of x (row stride x_stride; for
 * a grouped linear, group o / R starts at column (o / R) * W.n_in) with
 * weight row o.  sx: (T, K/128) scales or NULL.
 */
static __global__ void
linear_kernel(float *out, const float *x, const float *sx, struct dsv4_linear W, int T,
              int64_t x_stride, int R, int round_x, int round_out)
{
    int N = W.n_out, K = W.n_in;
    int g = threadIdx.x / 8, l8 = threadIdx.x % 8;
    int o = blockIdx.x * LIN_GROUPS + g;
    int oc = o < N ? o : N - 1;   /* idle groups still join the shuffles */

    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const float *xr = x + (int64_t)t * x_stride + (int64_t)(oc / R) * K;
        const float *sr = sx != NULL ? sx + (int64_t)t * (K / QBLK) : NULL;
        float v = cu_lin_dot(W, oc, xr, sr, l8, round_x);

        if (l8 == 0 && o < N)
            out[(int64_t)t * N + o] = round_out ? cu_bf16_round(v) : v;
    }
}

static int
lin_check(const struct dsv4_linear *W)
{
    if (W->n_out <= 0 || W->n_in <= 0)
        return 0;
    if (W->fmt == DSV4_WFMT_BF16)
        return W->w != NULL;
    if (W->w == NULL || W->scale == NULL)
        return 0;
    return W->fmt == DSV4_WFMT_FP8 || (W->fmt == DSV4_WFMT_FP4 && W->n_in % 32 == 0);
}

static enum dsv4_err
lin_launch(struct dsv4_backend *be, float *out, const float *x, const float *sx,
           const struct dsv4_linear *W, int T, int64_t x_stride, int R, int round_x,
           int round_out)
{
    dim3 grid(cuda_blocks(W->n_out, LIN_GROUPS), T < 65535 ? T : 65535);

    linear_kernel<<<grid, LIN_THREADS, 0, cuda_stream(be)>>>(out, x, sx, *W, T, x_stride, R,
                                                             round_x, round_out);
    CUDA_LAUNCHED("linear");
    return DSV4_OK;
}

/* Whether cuda_linear gives W at T rows to the fast decode linear: the fast
 * kernels are on, neither prefill GEMM takes it (they come first) and the
 * decode linear does. */
static int
lin_fast_decode(struct dsv4_backend *be, const struct dsv4_linear *W, int T)
{
    return cuda_st(be)->fast_kernels && !cuda_fast_gemm_linear_ok(be, W, T) &&
           !cuda_fast_gemm_bf16_ok(be, W, T) && cuda_fast_linear_ok(be, W);
}

enum dsv4_err
cuda_linear(struct dsv4_backend *be, float *out, const float *x, const struct dsv4_linear *W,
            int T, unsigned flags)
{
    int K = W->n_in;
    int round_out = !(W->fmt == DSV4_WFMT_BF16 && (flags & DSV4_LIN_F32_OUT));

    if (!lin_check(W))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda linear: bad weight (fmt %d, %d x %d)",
                            (int)W->fmt, W->n_out, W->n_in);
    if (T <= 0)
        return DSV4_OK;
    if (cuda_st(be)->fast_kernels && cuda_fast_gemm_linear_ok(be, W, T))
        return cuda_fast_gemm_linear(be, out, x, W, T);   /* fast_gemm.cu: prefill */
    if (cuda_st(be)->fast_kernels && cuda_fast_gemm_bf16_ok(be, W, T))
        return cuda_fast_gemm_bf16(be, out, x, W, T, flags);   /* fast_gemm.cu: prefill */
    if (lin_fast_decode(be, W, T))
        return cuda_fast_linear(be, out, x, W, T, flags);   /* fast_linear.cu */
    if (cuda_lin_quantizes(be, W->fmt)) {
        size_t xb = cuda_align((size_t)T * K * sizeof(float));
        float *xq = (float *)cuda_scratch(be, xb + (size_t)T * (K / QBLK + 1) * sizeof(float));
        enum dsv4_err e;

        if (xq == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "cuda linear: no scratch for %d x %d", T, K);
        e = cuda_quant_rows(be, xq, (float *)((char *)xq + xb), x, K, T, K);
        if (e != DSV4_OK)
            return e;
        return lin_launch(be, out, xq, (float *)((char *)xq + xb), W, T, K, W->n_out, 0,
                          round_out);
    }
    return lin_launch(be, out, x, NULL, W, T, K, W->n_out, 0, round_out);
}

/* The fast decode linear takes all n in one go when cuda_linear would give
 * each of them to it (lin_fast_decode) and they fit one pass of tokens;
 * otherwise the composition (n cuda_linear calls). */
enum dsv4_err
cuda_linear_multi(struct dsv4_backend *be, int n, float *const *outs, const float *x,
                  const struct dsv4_linear *const *Ws, const unsigned *flags, int T)
{
    int fast = n >= 1 && n <= DSV4_LINEAR_MULTI_MAX && T >= 1 && T <= 16;

    for (int i = 0; fast && i < n; i++)
        fast = lin_check(Ws[i]) && Ws[i]->n_in == Ws[0]->n_in && lin_fast_decode(be, Ws[i], T);
    if (fast)
        return cuda_fast_linear_multi(be, n, outs, x, Ws, flags, T);
    if (n >= 1 && n <= DSV4_LINEAR_MULTI_MAX && T > 16) {
        /* prefill: those on cuBLASLt with x prepared once, then the rest */
        int done[DSV4_LINEAR_MULTI_MAX], m = 0;
        float *o2[DSV4_LINEAR_MULTI_MAX];
        const struct dsv4_linear *W2[DSV4_LINEAR_MULTI_MAX];
        unsigned f2[DSV4_LINEAR_MULTI_MAX];
        enum dsv4_err e = cuda_fast_gemm_multi(be, n, outs, x, Ws, flags, T, done);

        if (e != DSV4_OK)
            return e;
        for (int i = 0; i < n; i++)
            if (!done[i]) {
                o2[m] = outs[i];
                W2[m] = Ws[i];
                f2[m++] = flags[i];
            }
        return m > 0 ? dsv4_linear_multi_compose(be, m, o2, x, W2, f2, T) : DSV4_OK;
    }
    return dsv4_linear_multi_compose(be, n, outs, x, Ws, flags, T);
}

int
cuda_linear_grouped_decode(struct dsv4_backend *be, const struct dsv4_linear *Wa, int T, int G)
{
    return lin_check(Wa) && G > 0 && Wa->n_out % G == 0 && T > 0 && cuda_st(be)->fast_kernels &&
           !cuda_fast_gemm_grouped_ok(be, Wa, T, G) && cuda_fast_linear_grouped_ok(Wa, G);
}

enum dsv4_err
cuda_linear_grouped(struct dsv4_backend *be, float *out, const float *x,
                    const struct dsv4_linear *Wa, int T, int G)
{
    struct dsv4_linear W = *Wa;

    if (!lin_check(Wa) || G <= 0 || Wa->n_out % G != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda linear_grouped: bad weight (fmt %d, %d x %d, "
                            "G=%d)", (int)Wa->fmt, Wa->n_out, Wa->n_in, G);
    if (T <= 0)
        return DSV4_OK;
    /* fast_gemm.cu: prefill; on cuBLASLt from DSV4_CUDA_BLAS_MIN_T rows (fast_blas.cu) */
    if (cuda_st(be)->fast_kernels && cuda_fast_gemm_grouped_ok(be, Wa, T, G))
        return cuda_fast_gemm_grouped_run(be, out, x, Wa, T, G,
                                          dsv4_cuda_blas_on() && T >= DSV4_CUDA_BLAS_MIN_T);
    if (cuda_linear_grouped_decode(be, Wa, T, G))
        return cuda_fast_linear_grouped(be, out, x, Wa, T, G);   /* fast_linear.cu */
    /* bf16 inputs (rounded on the fly), no activation quantization */
    return lin_launch(be, out, x, NULL, &W, T, (int64_t)G * Wa->n_in, Wa->n_out / G, 1, 1);
}
