/*
 * formats.h — the number formats of the checkpoint (model doc §2.2) and the
 * low-precision simulations of the reference (model doc §3.0, §3.8).
 *
 *   bf16      upper 16 bits of an IEEE float; rounding is round-to-nearest-even
 *   FP8 E4M3  "e4m3fn": bias 7, no infinities, 0x7F/0xFF = NaN, max ±448
 *   E8M0      unsigned exponent, value 2^(e-127), 0xFF = NaN
 *   FP4 E2M1  4-bit code (sign, 2 exponent bits bias 1, 1 mantissa bit);
 *             packed two per byte, element 2j in the LOW nibble, 2j+1 HIGH
 *
 * All conversions are pure functions usable from any thread.
 */
#ifndef DSV4_COMMON_FORMATS_H
#define DSV4_COMMON_FORMATS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* --- bf16 ------------------------------------------------------------- */

/* The value of bf16 bits h (exact: the top half of an fp32). */
static inline float dsv4_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round-to-nearest-even; NaN stays NaN (quiet). */
static inline uint16_t dsv4_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f32 -> nearest bf16 -> f32 (what a "cast to bf16" does to a value). */
static inline float dsv4_bf16_round(float f)
{
    return dsv4_bf16_to_f32(dsv4_f32_to_bf16(f));
}

/* --- FP8 E4M3 ---------------------------------------------------------- */

/* Decode table for all 256 codes (NaN for 0x7F and 0xFF). */
extern const float dsv4_fp8_e4m3_table[256];

/* The value of E4M3 code v (dsv4_fp8_e4m3_table). */
static inline float dsv4_fp8_to_f32(uint8_t v)
{
    return dsv4_fp8_e4m3_table[v];
}

/* Encode with round-to-nearest-even, saturating to ±448 (values beyond the
 * range clamp, as the reference clamps before casting); NaN -> 0x7F. */
uint8_t dsv4_f32_to_fp8(float f);

/* --- E8M0 -------------------------------------------------------------- */

/* 2^(e-127); NaN for 0xFF. */
float dsv4_e8m0_to_f32(uint8_t e);

/* Exponent code of a positive power of two (2^k -> k+127).  `f` must be a
 * power of two in [2^-127, 2^127]. */
uint8_t dsv4_f32_to_e8m0(float f);

/* --- FP4 E2M1 ---------------------------------------------------------- */

/* code -> value: 0,.5,1,1.5,2,3,4,6 and negatives for codes 8..15. */
extern const float dsv4_fp4_table[16];

/* Element `i` of a packed row (low nibble = even index). */
static inline float dsv4_fp4_get(const uint8_t *row, size_t i)
{
    uint8_t b = row[i >> 1];
    return dsv4_fp4_table[(i & 1) ? (b >> 4) : (b & 0x0f)];
}

/* Nearest E2M1 code of `f` (ties to even code mantissa; clamps to ±6). */
uint8_t dsv4_f32_to_fp4(float f);

/* --- Reference low-precision simulations (model doc §3.0, §3.8) --------- */

/* Power-of-two scale used by the reference: 2^ceil(log2(amax / qmax)). */
float dsv4_pow2_scale(float amax, float qmax);

/*
 * FP8 activation quantization of one block (model doc §3.0): amax =
 * max(|x|, 1e-4), s = 2^ceil(log2(amax/448)), q[i] = fp8(clamp(x[i]/s, ±448)).
 * Writes codes to q (may be NULL) and returns s.
 */
float dsv4_fp8_quant_block(uint8_t *q, const float *x, int n);

/*
 * In-place FP8 quant-dequant simulation (model doc §3.8, FP8_sim), applied
 * per block of `block` values: x <- bf16(fp8(clamp(x/s, ±448)) * s).
 * n must be a multiple of block.
 */
void dsv4_fp8_sim(float *x, int n, int block);

/*
 * In-place FP4 quant-dequant simulation (FP4_sim): amax = max(|x|, 6*2^-126),
 * s = 2^ceil(log2(amax/6)), x <- bf16(e2m1(clamp(x/s, ±6)) * s).
 */
void dsv4_fp4_sim(float *x, int n, int block);

/* In-place normalised Walsh-Hadamard transform of 128 values (Sylvester
 * order), result rounded to bf16: x <- bf16(H128 x / sqrt(128)). */
void dsv4_hadamard128(float *x);

#ifdef __cplusplus
}
#endif
#endif
