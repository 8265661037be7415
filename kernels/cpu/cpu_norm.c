/*
 * cpu_norm.c — RMSNorm, interleaved RoPE, and the reference's in-place
 * low-precision simulations (FP8_sim, Hadamard + FP4_sim).
 *
 * RMSNorm (model doc §3.0): x is rounded to bf16, ms = cpu_sumsq(x) / D in
 * fp32, r = 1 / sqrtf(ms + eps), out = bf16((x * r) * w) (w in fp32), or
 * bf16(x * r) without weight.
 *
 * RoPE (model doc §3.3.3): angle = (float)pos * freqs[i] in fp32; cos and sin
 * of that fp32 angle are computed in double and rounded to fp32 (the
 * correctly rounded values, reproducible on any libm / device); the pair
 * (a, b) becomes (a*c - b*s, a*s + b*c) in fp32 (no fused multiply-add), with
 * s negated for the inverse rotation; each result is rounded to bf16.
 */
#include "kernels/cpu/cpu.h"

#include <assert.h>
#include <math.h>

#include "common/formats.h"

/* --- rms_norm -------------------------------------------------------------------- */

struct norm_job {
    float *out;
    const float *x;
    const uint16_t *w;
    int D;
    float eps;
};

static void
norm_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct norm_job *j = ctx;
    int D = j->D;

    (void)tid;
    for (int64_t r = begin; r < end; r++) {
        const float *x = j->x + r * D;
        float *o = j->out + r * D;
        float acc[CPU_LANES] = { 0 };
        float ss, rs;

        /* cpu_sumsq's lane order, on the bf16-rounded values */
        for (int i = 0; i < D; i++) {
            float v = dsv4_bf16_round(x[i]);

            acc[i % CPU_LANES] += v * v;
        }
        for (int w = CPU_LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; l++)
                acc[l] += acc[l + w];
        ss = acc[0];
        rs = 1.0f / sqrtf(ss / (float)D + j->eps);
        for (int i = 0; i < D; i++) {
            float v = dsv4_bf16_round(x[i]) * rs;

            if (j->w != NULL)
                v *= dsv4_bf16_to_f32(j->w[i]);
            o[i] = dsv4_bf16_round(v);
        }
    }
}

enum dsv4_err
cpu_rms_norm(struct dsv4_backend *be, float *out, const float *x, const uint16_t *w, int rows,
             int D, float eps)
{
    struct norm_job j = { out, x, w, D, eps };

    cpu_parallel_for(be, rows, 1 + 65536 / (D > 0 ? D : 1), norm_task, &j);
    return DSV4_OK;
}

/* --- rope --------------------------------------------------------------------------- */

#define ROPE_MAX_PAIRS 256

struct rope_job {
    float *x;
    const int32_t *pos;
    int n_heads;
    int64_t row_stride, head_stride;
    int off, rd;
    const float *freqs;
    int inverse;
};

static void
rope_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct rope_job *j = ctx;
    int np = j->rd / 2;
    float cs[ROPE_MAX_PAIRS], sn[ROPE_MAX_PAIRS];

    (void)tid;
    for (int64_t t = begin; t < end; t++) {
        float p = (float)j->pos[t];

        for (int i = 0; i < np; i++) {
            float ang = p * j->freqs[i];

            cs[i] = (float)cos((double)ang);
            sn[i] = (float)sin((double)ang);
            if (j->inverse)
                sn[i] = -sn[i];
        }
        for (int h = 0; h < j->n_heads; h++) {
            float *v = j->x + t * j->row_stride + h * j->head_stride + j->off;

            for (int i = 0; i < np; i++) {
                float a = v[2 * i], b = v[2 * i + 1];

                v[2 * i] = dsv4_bf16_round(a * cs[i] - b * sn[i]);
                v[2 * i + 1] = dsv4_bf16_round(a * sn[i] + b * cs[i]);
            }
        }
    }
}

enum dsv4_err
cpu_rope(struct dsv4_backend *be, float *x, const int32_t *pos, int T, int n_heads,
         int64_t row_stride, int64_t head_stride, int off, int rd, const float *freqs,
         int inverse)
{
    struct rope_job j = { x, pos, n_heads, row_stride, head_stride, off, rd, freqs, inverse };

    if (rd % 2 != 0 || rd / 2 > ROPE_MAX_PAIRS)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu rope: rd=%d (must be even, <= %d)", rd,
                            2 * ROPE_MAX_PAIRS);
    cpu_parallel_for(be, T, 1 + 4096 / (1 + n_heads * rd), rope_task, &j);
    return DSV4_OK;
}

/* --- fp8_sim, hadamard_fp4 ------------------------------------------------------------- */

struct sim_job {
    float *x;
    int64_t stride;
    int n_cols, block;
};

static void
fp8_sim_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct sim_job *j = ctx;

    (void)tid;
    for (int64_t r = begin; r < end; r++)
        dsv4_fp8_sim(j->x + r * j->stride, j->n_cols, j->block);
}

enum dsv4_err
cpu_fp8_sim(struct dsv4_backend *be, float *x, int rows, int64_t stride, int n_cols, int block)
{
    struct sim_job j = { x, stride, n_cols, block };

    if (be->numerics != DSV4_NUMERICS_REF)
        return DSV4_OK;
    if (block <= 0 || n_cols % block != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu fp8_sim: n_cols=%d not a multiple of "
                            "block=%d", n_cols, block);
    cpu_parallel_for(be, rows, 1 + 16384 / (n_cols > 0 ? n_cols : 1), fp8_sim_task, &j);
    return DSV4_OK;
}

static void
hadamard_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    float *x = ctx;

    (void)tid;
    for (int64_t r = begin; r < end; r++) {
        dsv4_hadamard128(x + r * 128);
        dsv4_fp4_sim(x + r * 128, 128, 32);
    }
}

enum dsv4_err
cpu_hadamard_fp4(struct dsv4_backend *be, float *x, int rows)
{
    if (be->numerics != DSV4_NUMERICS_REF)
        return DSV4_OK;
    cpu_parallel_for(be, rows, 64, hadamard_task, x);
    return DSV4_OK;
}
