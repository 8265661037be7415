/*
 * test_formats.c — number formats and low-precision simulations
 * (common/formats.c) against independent oracles: the format definitions of
 * model doc §2.2 evaluated in double precision, brute-force nearest-value
 * searches over every code, and straightforward double-precision versions of
 * FP8_sim / FP4_sim / Hadamard128 (model doc §3.0, §3.8).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/formats.h"

/* Deterministic xorshift so failures reproduce. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t
rng_u64(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static double
rng_unit(void)
{
    return (double)(rng_u64() >> 11) / 9007199254740992.0;
}

/* Roughly normal values times a random power of two in [2^-lo, 2^hi]. */
static float
rng_value(int lo, int hi)
{
    double g = rng_unit() + rng_unit() + rng_unit() - 1.5;
    int k = (int)(rng_u64() % (uint64_t)(lo + hi + 1)) - lo;

    return (float)ldexp(g, k);
}

/* E4M3 value from the definition (model doc §2.2), NaN for 0x7F/0xFF. */
static double
fp8_oracle(int c)
{
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    double v;

    if ((c & 0x7f) == 0x7f)
        return NAN;
    v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}

/*
 * Nearest code among `n` codes with values val(c): ties go to the code whose
 * lowest bit (mantissa lsb) is 0.  Values beyond the extremes clamp.
 */
static int
nearest_code(double x, int n, double (*val)(int))
{
    int best = -1;
    double bd = INFINITY;

    for (int c = 0; c < n; c++) {
        double v = val(c), d;

        if (isnan(v))
            continue;
        d = fabs(v - x);
        if (d < bd || (d == bd && (c & 1) == 0 && (best & 1) == 1)) {
            bd = d;
            best = c;
        }
    }
    return best;
}

static double
fp4_oracle(int c)
{
    static const double mag[8] = { 0, 0.5, 1, 1.5, 2, 3, 4, 6 };

    return (c & 8) ? -mag[c & 7] : mag[c & 7];
}

/* Code of x chosen by brute force; the sign of zero follows x. */
static int
fp8_nearest(double x)
{
    int c = nearest_code(fabs(x), 128, fp8_oracle);

    return signbit(x) ? c | 0x80 : c;
}

static int
fp4_nearest(double x)
{
    int c = nearest_code(fabs(x), 8, fp4_oracle);

    return signbit(x) ? c | 8 : c;
}

/* bf16 rounding (RNE) of a double, by counting representable steps. */
static double
bf16_oracle(double x)
{
    int e;

    if (x == 0.0)
        return x;
    (void)frexp(x, &e);           /* |x| in [2^(e-1), 2^e) */
    if (e - 1 < -126)
        e = -125;                  /* subnormal spacing 2^-133 */
    return ldexp(nearbyint(ldexp(x, 8 - e)), e - 8);
}

/* Smallest power of two >= r. */
static double
pow2_ceil_oracle(double r)
{
    double p = ldexp(1.0, -160);

    while (p < r)
        p *= 2.0;
    return p;
}

/* --- FP8 E4M3 ---------------------------------------------------------- */

static void
test_fp8_table(void **state)
{
    (void)state;
    for (int c = 0; c < 256; c++) {
        double o = fp8_oracle(c);
        float t = dsv4_fp8_to_f32((uint8_t)c);

        if (isnan(o)) {
            assert_true(isnan(t));
            continue;
        }
        assert_true((double)t == o);
        assert_true(!signbit(t) == !signbit(o));
    }
    assert_true(dsv4_fp8_to_f32(0x7e) == 448.0f);
    assert_true(dsv4_fp8_to_f32(0x01) == 0x1p-9f);
    assert_true(dsv4_fp8_to_f32(0x08) == 0x1p-6f);
    assert_true(dsv4_fp8_to_f32(0x38) == 1.0f);
}

/* Every finite code survives decode -> encode, including -0. */
static void
test_fp8_roundtrip(void **state)
{
    (void)state;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f)
            continue;
        assert_int_equal(dsv4_f32_to_fp8(dsv4_fp8_to_f32((uint8_t)c)), c);
    }
}

/* Midpoints between neighbours (ties) go to the even code; just off the
 * midpoint goes to the nearer one. */
static void
test_fp8_ties(void **state)
{
    (void)state;
    for (int c = 0; c < 0x7e; c++) {
        double lo = fp8_oracle(c), hi = fp8_oracle(c + 1);
        float mid = (float)((lo + hi) / 2);  /* exact in float */
        int even = (c & 1) ? c + 1 : c;

        assert_true((double)mid == (lo + hi) / 2);
        assert_int_equal(dsv4_f32_to_fp8(mid), even);
        assert_int_equal(dsv4_f32_to_fp8(-mid), even | 0x80);
        assert_int_equal(dsv4_f32_to_fp8(nextafterf(mid, 0.0f)), c);
        assert_int_equal(dsv4_f32_to_fp8(nextafterf(mid, 1e9f)), c + 1);
    }
    /* smallest subnormal tie: 2^-10 -> 0, 3 * 2^-10 -> 2^-8 (code 2) */
    assert_int_equal(dsv4_f32_to_fp8(0x1p-10f), 0);
    assert_int_equal(dsv4_f32_to_fp8(0x3p-10f), 2);
    assert_int_equal(dsv4_f32_to_fp8(-0x1p-30f), 0x80);
}

static void
test_fp8_saturate(void **state)
{
    (void)state;
    assert_int_equal(dsv4_f32_to_fp8(448.0f), 0x7e);
    assert_int_equal(dsv4_f32_to_fp8(460.0f), 0x7e);
    assert_int_equal(dsv4_f32_to_fp8(464.0f), 0x7e);
    assert_int_equal(dsv4_f32_to_fp8(1e30f), 0x7e);
    assert_int_equal(dsv4_f32_to_fp8(INFINITY), 0x7e);
    assert_int_equal(dsv4_f32_to_fp8(-INFINITY), 0xfe);
    assert_int_equal(dsv4_f32_to_fp8(-3000.0f), 0xfe);
    assert_int_equal(dsv4_f32_to_fp8(NAN), 0x7f);
}

static void
test_fp8_random(void **state)
{
    (void)state;
    for (int i = 0; i < 20000; i++) {
        float x = rng_value(14, 10);

        assert_int_equal(dsv4_f32_to_fp8(x), fp8_nearest(x));
    }
}

/* --- E8M0 -------------------------------------------------------------- */

static void
test_e8m0(void **state)
{
    (void)state;
    for (int e = 0; e < 255; e++) {
        float v = dsv4_e8m0_to_f32((uint8_t)e);

        assert_true((double)v == ldexp(1.0, e - 127));
        assert_int_equal(dsv4_f32_to_e8m0(v), e);
    }
    assert_true(isnan(dsv4_e8m0_to_f32(0xff)));
    assert_true(dsv4_e8m0_to_f32(127) == 1.0f);
}

/* --- FP4 E2M1 ---------------------------------------------------------- */

static void
test_fp4_table_and_nibbles(void **state)
{
    /* row of 4 logical values 0.5, -6, 1.5, 0 packed as model doc §2.2:
     * element 2j in the low nibble of byte j, 2j+1 in the high nibble */
    const uint8_t row[2] = { 0xf1, 0x03 };

    (void)state;
    for (int c = 0; c < 16; c++) {
        assert_true((double)dsv4_fp4_table[c] == fp4_oracle(c));
        assert_true(!signbit(dsv4_fp4_table[c]) == !(c & 8));
        assert_int_equal(dsv4_f32_to_fp4(dsv4_fp4_table[c]), c);
    }
    assert_true(dsv4_fp4_get(row, 0) == 0.5f);
    assert_true(dsv4_fp4_get(row, 1) == -6.0f);
    assert_true(dsv4_fp4_get(row, 2) == 1.5f);
    assert_true(dsv4_fp4_get(row, 3) == 0.0f);
}

static void
test_fp4_encode(void **state)
{
    static const float ties[][2] = {
        { 0.25f, 0 }, { 0.75f, 2 }, { 1.25f, 2 }, { 1.75f, 4 },
        { 2.5f, 4 }, { 3.5f, 6 }, { 5.0f, 6 },
    };

    (void)state;
    for (size_t i = 0; i < sizeof(ties) / sizeof(ties[0]); i++) {
        assert_int_equal(dsv4_f32_to_fp4(ties[i][0]), (int)ties[i][1]);
        assert_int_equal(dsv4_f32_to_fp4(-ties[i][0]), (int)ties[i][1] | 8);
    }
    assert_int_equal(dsv4_f32_to_fp4(7.0f), 7);
    assert_int_equal(dsv4_f32_to_fp4(-100.0f), 15);
    for (int i = 0; i < 20000; i++) {
        float x = rng_value(4, 3);

        assert_int_equal(dsv4_f32_to_fp4(x), fp4_nearest(x));
    }
}

/* --- bf16 and scales ---------------------------------------------------- */

static void
test_bf16(void **state)
{
    (void)state;
    for (int i = 0; i < 20000; i++) {
        float x = rng_value(100, 100);

        assert_true((double)dsv4_bf16_round(x) == bf16_oracle(x));
    }
    /* ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> even (1) */
    assert_true(dsv4_bf16_round(1.0f + 0x1p-8f) == 1.0f);
    assert_true(dsv4_bf16_round(1.0f + 0x3p-8f) == 1.0f + 0x1p-6f);
    assert_true(isnan(dsv4_bf16_round(NAN)));
}

static void
test_pow2_scale(void **state)
{
    (void)state;
    for (int k = -40; k <= 40; k++) {
        float p = ldexpf(448.0f, k);

        assert_true(dsv4_pow2_scale(p, 448.0f) == ldexpf(1.0f, k));
        assert_true(dsv4_pow2_scale(nextafterf(p, INFINITY), 448.0f) == ldexpf(1.0f, k + 1));
        assert_true(dsv4_pow2_scale(ldexpf(6.0f, k), 6.0f) == ldexpf(1.0f, k));
    }
    for (int i = 0; i < 20000; i++) {
        float a = fabsf(rng_value(30, 30)) + 1e-30f;
        float q = (i & 1) ? 448.0f : 6.0f;

        assert_true((double)dsv4_pow2_scale(a, q) == pow2_ceil_oracle((double)(a / q)));
    }
}

/* --- simulations --------------------------------------------------------- */

/* Double-precision FP8_sim / FP4_sim of one block (model doc §3.8). */
static void
sim_oracle(double *out, const float *x, int n, double qmax, double floor_amax,
           int (*nearest)(double), double (*val)(int))
{
    double amax = floor_amax, s;

    for (int i = 0; i < n; i++)
        amax = fmax(amax, fabs(x[i]));
    s = pow2_ceil_oracle((double)((float)amax / (float)qmax));
    for (int i = 0; i < n; i++) {
        double v = fmin(fmax(x[i] / s, -qmax), qmax);

        out[i] = bf16_oracle(val(nearest(v)) * s);
    }
}

/* Run a simulation on random bf16 blocks of widely varying magnitude (and
 * one all-zero block, which exercises the amax floor) against sim_oracle. */
static void
check_sim(void (*sim)(float *, int, int), int block, double qmax, double floor_amax,
          int (*nearest)(double), double (*val)(int))
{
    enum { NB = 8 };
    float x[64 * NB], y[64 * NB];
    double o[64];
    int n = block * NB;

    for (int rep = 0; rep < 50; rep++) {
        int spread = 1 + rep % 20;

        for (int i = 0; i < n; i++)
            x[i] = dsv4_bf16_round(rng_value(spread, spread));
        x[rep % n] = 0.0f;
        if (rep == 0)
            memset(x, 0, (size_t)block * sizeof(float));
        memcpy(y, x, (size_t)n * sizeof(float));
        sim(y, n, block);
        for (int b = 0; b < n; b += block) {
            sim_oracle(o, x + b, block, qmax, floor_amax, nearest, val);
            for (int i = 0; i < block; i++)
                assert_true((double)y[b + i] == o[i]);
        }
    }
}

static void
test_fp8_sim(void **state)
{
    (void)state;
    check_sim(dsv4_fp8_sim, 64, 448.0, 1e-4f, fp8_nearest, fp8_oracle);
}

static void
test_fp4_sim(void **state)
{
    (void)state;
    check_sim(dsv4_fp4_sim, 32, 6.0, 6.0 * 0x1p-126, fp4_nearest, fp4_oracle);
}

static void
test_fp8_quant_block(void **state)
{
    float x[128];
    uint8_t q[128];

    (void)state;
    for (int rep = 0; rep < 50; rep++) {
        double amax = 1e-4f, s;
        float sc;

        for (int i = 0; i < 128; i++) {
            x[i] = dsv4_bf16_round(rng_value(rep % 16, rep % 16));
            amax = fmax(amax, fabs(x[i]));
        }
        sc = dsv4_fp8_quant_block(q, x, 128);
        s = pow2_ceil_oracle((double)((float)amax / 448.0f));
        assert_true((double)sc == s);
        for (int i = 0; i < 128; i++)
            assert_int_equal(q[i], fp8_nearest(fmin(fmax(x[i] / s, -448.0), 448.0)));
        assert_true(dsv4_fp8_quant_block(NULL, x, 128) == sc);
    }
}

/* --- Hadamard ------------------------------------------------------------ */

static int
popcount(unsigned v)
{
    int n = 0;

    for (; v != 0; v &= v - 1)
        n++;
    return n;
}

/* One bf16 ulp at |v| (spacing of bf16 numbers there). */
static double
bf16_ulp(double v)
{
    int e;

    (void)frexp(fabs(v) + 1e-30, &e);
    return ldexp(1.0, e - 8);
}

static void
test_hadamard_matrix(void **state)
{
    float x[128];

    (void)state;
    for (int rep = 0; rep < 20; rep++) {
        for (int i = 0; i < 128; i++)
            x[i] = dsv4_bf16_round(rng_value(3, 3));
        float y[128];

        memcpy(y, x, sizeof(x));
        dsv4_hadamard128(y);
        for (int i = 0; i < 128; i++) {
            double s = 0;

            for (int j = 0; j < 128; j++)
                s += (popcount((unsigned)(i & j)) & 1) ? -(double)x[j] : (double)x[j];
            s /= sqrt(128.0);
            assert_true(y[i] == dsv4_bf16_round(y[i]));
            assert_true(fabs(y[i] - s) <= (0.5 + 0x1p-15) * bf16_ulp(s));
        }
    }
}

/* H H = I: transforming twice gives the input back up to bf16 rounding. */
static void
test_hadamard_involution(void **state)
{
    float x[128];

    (void)state;
    for (int k = 0; k < 128; k++) {
        memset(x, 0, sizeof(x));
        x[k] = 1.0f;
        dsv4_hadamard128(x);
        for (int i = 0; i < 128; i++)
            assert_true(fabsf(x[i]) == dsv4_bf16_round((float)(1 / sqrt(128.0))));
        dsv4_hadamard128(x);
        for (int i = 0; i < 128; i++)
            assert_true(fabs(x[i] - (i == k ? 1.0 : 0.0)) <= 0x1p-7);
    }
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp8_table),
        cmocka_unit_test(test_fp8_roundtrip),
        cmocka_unit_test(test_fp8_ties),
        cmocka_unit_test(test_fp8_saturate),
        cmocka_unit_test(test_fp8_random),
        cmocka_unit_test(test_e8m0),
        cmocka_unit_test(test_fp4_table_and_nibbles),
        cmocka_unit_test(test_fp4_encode),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_pow2_scale),
        cmocka_unit_test(test_fp8_sim),
        cmocka_unit_test(test_fp8_quant_block),
        cmocka_unit_test(test_fp4_sim),
        cmocka_unit_test(test_hadamard_matrix),
        cmocka_unit_test(test_hadamard_involution),
    };

    return cmocka_run_group_tests_name("formats", tests, NULL, NULL);
}
