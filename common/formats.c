/*
 * formats.c — checkpoint number formats (model doc §2.2) and the reference's
 * low-precision simulations (model doc §3.0, §3.8).
 *
 * Every encoder here is exact: it computes the representable neighbours of
 * the input on the target grid with integer/exponent arithmetic (frexpf,
 * ldexpf, nearbyintf under the default round-to-nearest-even mode) instead of
 * float logarithms, so ties and exact powers of two land where the reference
 * (PyTorch casts) puts them.  Pure functions, no state; any thread.
 */
#include "common/formats.h"

#include <assert.h>
#include <math.h>

/* --- FP8 E4M3 ---------------------------------------------------------- */

/* Value of a code: (-1)^s 2^(e-7) (1 + m/8), subnormal 2^-6 m/8, NaN at
 * S.1111.111.  Written out so the table is a constant, not an init step. */
#define FP8_ROW(e)                                                           \
    FP8_V(e, 0), FP8_V(e, 1), FP8_V(e, 2), FP8_V(e, 3),                      \
    FP8_V(e, 4), FP8_V(e, 5), FP8_V(e, 6), FP8_V(e, 7)
#define FP8_EXP2(e) ((float)(1u << (e)) / 128.0f)
#define FP8_V(e, m) ((e) == 0 ? (float)(m) / 512.0f : FP8_EXP2(e) * (1.0f + (float)(m) / 8.0f))
#define FP8_POS                                                              \
    FP8_ROW(0), FP8_ROW(1), FP8_ROW(2), FP8_ROW(3), FP8_ROW(4), FP8_ROW(5),  \
    FP8_ROW(6), FP8_ROW(7), FP8_ROW(8), FP8_ROW(9), FP8_ROW(10), FP8_ROW(11),\
    FP8_ROW(12), FP8_ROW(13), FP8_ROW(14),                                   \
    FP8_V(15, 0), FP8_V(15, 1), FP8_V(15, 2), FP8_V(15, 3),                  \
    FP8_V(15, 4), FP8_V(15, 5), FP8_V(15, 6), NAN
#define FP8_NROW(e)                                                          \
    -FP8_V(e, 0), -FP8_V(e, 1), -FP8_V(e, 2), -FP8_V(e, 3),                  \
    -FP8_V(e, 4), -FP8_V(e, 5), -FP8_V(e, 6), -FP8_V(e, 7)
#define FP8_NEG                                                              \
    FP8_NROW(0), FP8_NROW(1), FP8_NROW(2), FP8_NROW(3), FP8_NROW(4),         \
    FP8_NROW(5), FP8_NROW(6), FP8_NROW(7), FP8_NROW(8), FP8_NROW(9),         \
    FP8_NROW(10), FP8_NROW(11), FP8_NROW(12), FP8_NROW(13), FP8_NROW(14),    \
    -FP8_V(15, 0), -FP8_V(15, 1), -FP8_V(15, 2), -FP8_V(15, 3),              \
    -FP8_V(15, 4), -FP8_V(15, 5), -FP8_V(15, 6), NAN

const float dsv4_fp8_e4m3_table[256] = { FP8_POS, FP8_NEG };

#define FP8_MAX 448.0f

/*
 * E4M3 has 3 mantissa bits, so in binade [2^E, 2^(E+1)) the step is
 * 2^(E-3); below 2^-6 (subnormals) the step is fixed at 2^-9.  With
 * q = rint(|f| / step) the code is simply (biased exponent) * 8 + q - 8 for
 * normals and q for subnormals: a mantissa carry (q == 16, or q == 8 from the
 * subnormal range) moves into the exponent field by itself.
 */
uint8_t
dsv4_f32_to_fp8(float f)
{
    uint8_t sign;
    float a;
    int e, q;

    if (isnan(f))
        return 0x7f;
    sign = signbit(f) ? 0x80 : 0x00;
    a = fabsf(f);
    if (a >= FP8_MAX)
        return sign | 0x7e;  /* saturate to 448 (clamp, then cast) */
    if (a < 0x1p-6f) {
        q = (int)nearbyintf(a * 512.0f);  /* exact scaling, RNE */
        return sign | (uint8_t)q;
    }
    (void)frexpf(a, &e);      /* a = m 2^e, m in [0.5, 1): binade E = e - 1 */
    q = (int)nearbyintf(ldexpf(a, 3 - (e - 1)));  /* in [8, 16] */
    return sign | (uint8_t)((e - 1 + 7) * 8 + q - 8);
}

/* --- E8M0 -------------------------------------------------------------- */

float
dsv4_e8m0_to_f32(uint8_t e)
{
    if (e == 0xff)
        return NAN;
    /* 2^-127 is a float subnormal; ldexpf produces it exactly. */
    return ldexpf(1.0f, (int)e - 127);
}

uint8_t
dsv4_f32_to_e8m0(float f)
{
    int e;
    float m;

    m = frexpf(f, &e);  /* f = 0.5 * 2^e for a power of two */
    assert(m == 0.5f && e - 1 >= -127 && e - 1 <= 127);
    (void)m;
    return (uint8_t)(e - 1 + 127);
}

/* --- FP4 E2M1 ---------------------------------------------------------- */

const float dsv4_fp4_table[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

/*
 * Midpoints between neighbouring magnitudes; at an exact midpoint the code
 * with an even mantissa bit (even code) wins, hence <= at the midpoints whose
 * lower neighbour has an even code and < elsewhere.  NaN encodes as +0 (the
 * format has no NaN; the reference never feeds one).
 */
uint8_t
dsv4_f32_to_fp4(float f)
{
    uint8_t sign, c;
    float a;

    if (isnan(f))
        return 0;
    sign = signbit(f) ? 0x8 : 0x0;
    a = fabsf(f);
    if (a <= 0.25f)
        c = 0;
    else if (a < 0.75f)
        c = 1;
    else if (a <= 1.25f)
        c = 2;
    else if (a < 1.75f)
        c = 3;
    else if (a <= 2.5f)
        c = 4;
    else if (a < 3.5f)
        c = 5;
    else if (a <= 5.0f)
        c = 6;
    else
        c = 7;
    return sign | c;
}

/* --- Reference low-precision simulations ------------------------------ */

/*
 * 2^ceil(log2(r)) with r = amax / qmax rounded to float as the reference
 * does (fp32 division).  frexpf gives r = m 2^e with m in [0.5, 1): r is an
 * exact power of two iff m == 0.5, and then ceil(log2 r) = e - 1; otherwise
 * it is e.  A non-positive or non-finite ratio is returned unchanged.
 */
float
dsv4_pow2_scale(float amax, float qmax)
{
    float r = amax / qmax;
    float m;
    int e;

    if (!(r > 0.0f) || isinf(r))
        return r;
    m = frexpf(r, &e);
    return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

/* max(|x[i]|) over a block, floored at `lo`. */
static float
block_amax(const float *x, int n, float lo)
{
    float amax = lo;

    for (int i = 0; i < n; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

static float
clampf(float v, float lim)
{
    return v > lim ? lim : (v < -lim ? -lim : v);
}

float
dsv4_fp8_quant_block(uint8_t *q, const float *x, int n)
{
    float s = dsv4_pow2_scale(block_amax(x, n, 1e-4f), FP8_MAX);

    if (q != NULL) {
        for (int i = 0; i < n; i++)
            q[i] = dsv4_f32_to_fp8(clampf(x[i] / s, FP8_MAX));
    }
    return s;
}

void
dsv4_fp8_sim(float *x, int n, int block)
{
    assert(block > 0 && n % block == 0);
    for (int b = 0; b < n; b += block) {
        float *v = x + b;
        float s = dsv4_pow2_scale(block_amax(v, block, 1e-4f), FP8_MAX);

        for (int i = 0; i < block; i++) {
            uint8_t c = dsv4_f32_to_fp8(clampf(v[i] / s, FP8_MAX));
            v[i] = dsv4_bf16_round(dsv4_fp8_to_f32(c) * s);
        }
    }
}

void
dsv4_fp4_sim(float *x, int n, int block)
{
    assert(block > 0 && n % block == 0);
    for (int b = 0; b < n; b += block) {
        float *v = x + b;
        float s = dsv4_pow2_scale(block_amax(v, block, 6.0f * 0x1p-126f), 6.0f);

        for (int i = 0; i < block; i++) {
            uint8_t c = dsv4_f32_to_fp4(clampf(v[i] / s, 6.0f));
            v[i] = dsv4_bf16_round(dsv4_fp4_table[c] * s);
        }
    }
}

/*
 * Fast Walsh-Hadamard transform in natural (Sylvester) order: butterflies
 * of span 1, 2, 4, ... give H[i][j] = (-1)^popcount(i & j).  Done in double
 * so the only rounding that matters is the final one to bf16.
 */
void
dsv4_hadamard128(float *x)
{
    double v[128];

    for (int i = 0; i < 128; i++)
        v[i] = x[i];
    for (int h = 1; h < 128; h *= 2) {
        for (int i = 0; i < 128; i += 2 * h) {
            for (int j = i; j < i + h; j++) {
                double a = v[j], b = v[j + h];

                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
    }
    for (int i = 0; i < 128; i++)
        x[i] = dsv4_bf16_round((float)(v[i] / sqrt(128.0)));
}
