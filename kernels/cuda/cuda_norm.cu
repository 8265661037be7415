/*
 * cuda_norm.cu — RMSNorm, interleaved RoPE, and the in-place low-precision
 * simulations (FP8_sim, Hadamard + FP4_sim); numerics of cpu_norm.c.
 *
 * rms_norm: one warp per row; its four 8-thread groups each compute the sum
 *   of squares in cpu_sumsq's lane order (redundantly: the sum must be one
 *   sequential chain per lane to match the CPU), then the warp writes the row.
 * rope: one thread per (row, head, pair); cos/sin of the fp32 angle in double.
 * fp8_sim: one warp per (row, block); hadamard_fp4: one 128-thread block per
 *   row, the butterflies in double in shared memory, then FP4_sim per 32
 *   values on one warp each.
 */
#include "kernels/cuda/cuda.cuh"

/* --- rms_norm ----------------------------------------------------------------------- */

#define NORM_ROWS 4   /* warps (rows) per block */

static __global__ void
rms_norm_kernel(float *out, const float *x, const uint16_t *w, int rows, int D, float eps)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t r = blockIdx.x * (int64_t)NORM_ROWS + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    const float *xr;
    float acc = 0.0f, rs;

    if (r >= rows)
        return;   /* whole warps */
    xr = x + r * D;
    for (int i = lane % 8; i < D; i += 8) {
        float v = cu_bf16_round(xr[i]);

        acc += v * v;
    }
    acc = cu_lanes8_sum(acc);
    rs = 1.0f / sqrtf(acc / (float)D + eps);
    for (int i = lane; i < D; i += 32) {
        float v = cu_bf16_round(xr[i]) * rs;

        if (w != NULL)
            v *= cu_bf16_to_f32(w[i]);
        out[r * D + i] = cu_bf16_round(v);
    }
}

enum dsv4_err
cuda_rms_norm(struct dsv4_backend *be, float *out, const float *x, const uint16_t *w, int rows,
              int D, float eps)
{
    if (rows <= 0 || D <= 0)
        return DSV4_OK;
    if (cuda_st(be)->fast_kernels)
        return cuda_fast_rms_norm(be, out, x, w, rows, D, eps);   /* fast_norm.cu */
    cu_launch(rms_norm_kernel, cuda_blocks(rows, NORM_ROWS), 32 * NORM_ROWS, 0, cuda_stream(be),
              out, x, w, rows, D, eps);
    CUDA_LAUNCHED("rms_norm");
    return DSV4_OK;
}

/* --- rope ---------------------------------------------------------------------------- */

#define ROPE_MAX_PAIRS 256

/* The host frequency table, passed by value. */
struct rope_freqs {
    float f[ROPE_MAX_PAIRS];
};

static __global__ void
rope_kernel(float *x, const int32_t *pos, int T, int n_heads, int64_t row_stride,
            int64_t head_stride, int off, int np, struct rope_freqs fr, int inverse)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t it = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t t = it / ((int64_t)n_heads * np);
    int h = (int)(it / np % n_heads), i = (int)(it % np);
    float a, b, *v;

    if (t >= T)
        return;
    v = x + t * row_stride + h * head_stride + off;
    a = v[2 * i];
    b = v[2 * i + 1];
    cu_rope_pair(a, b, (float)pos[t], fr.f[i], inverse);
    v[2 * i] = a;
    v[2 * i + 1] = b;
}

/*
 * The same rotation, one block per row t: the row's cos / sin per pair
 * worked out once into shared memory (rope_kernel works them out again for
 * every head), then every head's pairs.  For rows of many heads (the
 * attention output's inverse RoPE at prefill: 64 heads x 32 pairs a row).
 */
static __global__ void
rope_rows_kernel(float *x, const int32_t *pos, int n_heads, int64_t row_stride,
                 int64_t head_stride, int off, int np, struct rope_freqs fr, int inverse)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ float cs[ROPE_MAX_PAIRS], sn[ROPE_MAX_PAIRS];
    int64_t t = blockIdx.x;
    float *xr = x + t * row_stride + off;

    for (int i = threadIdx.x; i < np; i += blockDim.x)
        cu_rope_cs((float)pos[t], fr.f[i], inverse, cs[i], sn[i]);
    __syncthreads();
    for (int e = threadIdx.x; e < n_heads * np; e += blockDim.x) {
        int h = e / np, i = e % np;
        float *v = xr + h * head_stride + 2 * i, a = v[0], b = v[1];

        cu_rope_rot(a, b, cs[i], sn[i]);
        v[0] = a;
        v[1] = b;
    }
}

#define ROPE_ROWS_MIN_PAIRS 256   /* pairs a row from which rope_rows_kernel runs */

enum dsv4_err
cuda_rope(struct dsv4_backend *be, float *x, const int32_t *pos, int T, int n_heads,
          int64_t row_stride, int64_t head_stride, int off, int rd, const float *freqs,
          int inverse)
{
    struct rope_freqs fr;
    int64_t n;

    if (rd % 2 != 0 || rd / 2 > ROPE_MAX_PAIRS)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda rope: rd=%d (must be even, <= %d)", rd,
                            2 * ROPE_MAX_PAIRS);
    n = (int64_t)T * n_heads * (rd / 2);
    if (n <= 0)
        return DSV4_OK;
    for (int i = 0; i < ROPE_MAX_PAIRS; i++)
        fr.f[i] = i < rd / 2 ? freqs[i] : 0.0f;
    if ((int64_t)n_heads * (rd / 2) >= ROPE_ROWS_MIN_PAIRS) {
        cu_launch(rope_rows_kernel, (unsigned)T, 256, 0, cuda_stream(be), x, pos, n_heads,
                  row_stride, head_stride, off, rd / 2, fr, inverse);
        CUDA_LAUNCHED("rope rows");
        return DSV4_OK;
    }
    cu_launch(rope_kernel, cuda_blocks(n, 256), 256, 0, cuda_stream(be), x, pos, T, n_heads,
              row_stride, head_stride, off, rd / 2, fr, inverse);
    CUDA_LAUNCHED("rope");
    return DSV4_OK;
}

/* --- fp8_sim ---------------------------------------------------------------------------- */

/* One warp per (row, block): dsv4_fp8_sim on `block` values. */
static __global__ void
fp8_sim_kernel(float *x, int rows, int64_t stride, int nb, int block)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t wid = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    int64_t r = wid / nb;

    if (r >= rows)
        return;
    cu_fp8_sim_block(x + r * stride + (wid % nb) * block, block, lane);
}

enum dsv4_err
cuda_fp8_sim(struct dsv4_backend *be, float *x, int rows, int64_t stride, int n_cols,
             int block)
{
    int64_t warps;

    if (be->numerics != DSV4_NUMERICS_REF)
        return DSV4_OK;
    if (block <= 0 || n_cols % block != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda fp8_sim: n_cols=%d not a multiple of "
                            "block=%d", n_cols, block);
    warps = (int64_t)rows * (n_cols / block);
    if (warps <= 0)
        return DSV4_OK;
    cu_launch(fp8_sim_kernel, cuda_blocks(warps * 32, 256), 256, 0, cuda_stream(be), x, rows,
              stride, n_cols / block, block);
    CUDA_LAUNCHED("fp8_sim");
    return DSV4_OK;
}

/* --- hadamard_fp4 ---------------------------------------------------------------------- */

/*
 * One warp per 128-value row: lane l holds elements l + 32 k (k = 0..3).
 * The butterflies are the exact path's, level h = 1, 2, ..., 64 pairing
 * element j (bit h clear) with j + h into a + b and a - b in double: levels
 * below 32 across lanes (xor shuffles), 32 and 64 inside a lane.  FP4_sim's
 * block of 32 values is k's column of the warp.
 */
static __global__ void
hadamard_fp4_kernel(float *x, int64_t rows)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t r = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    double v[4];
    float *row = x + r * 128;

    if (r >= rows)
        return;   /* whole warps */
    for (int k = 0; k < 4; k++)
        v[k] = row[lane + 32 * k];
    for (int h = 1; h < 32; h *= 2)
        for (int k = 0; k < 4; k++) {
            double o = __shfl_xor_sync(0xffffffffu, v[k], h);

            v[k] = (lane & h) ? o - v[k] : v[k] + o;
        }
    for (int h = 1; h <= 2; h *= 2)   /* element bits 5 and 6: k's bits 0 and 1 */
        for (int k = 0; k < 4; k++)
            if (!(k & h)) {
                double a = v[k], b = v[k + h];

                v[k] = a + b;
                v[k + h] = a - b;
            }
    for (int k = 0; k < 4; k++) {
        float y = cu_bf16_round((float)(v[k] / sqrt(128.0))), amax, s;

        /* FP4_sim over the 32 values of column k */
        amax = fmaxf(6.0f * 0x1p-126f, fabsf(y));
        for (int o = 16; o > 0; o /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        s = cu_pow2_scale(amax, 6.0f);
        row[lane + 32 * k] =
            cu_bf16_round(cu_fp4_to_f32(cu_f32_to_fp4(cu_clampf(y / s, 6.0f))) * s);
    }
}

enum dsv4_err
cuda_hadamard_fp4(struct dsv4_backend *be, float *x, int rows)
{
    if (be->numerics != DSV4_NUMERICS_REF || rows <= 0)
        return DSV4_OK;
    cu_launch(hadamard_fp4_kernel, cuda_blocks((int64_t)rows * 32, 128), 128, 0,
              cuda_stream(be), x, (int64_t)rows);
    CUDA_LAUNCHED("hadamard_fp4");
    return DSV4_OK;
}
