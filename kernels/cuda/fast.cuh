/*
 * fast.cuh — private header of the fast decode kernels (fast_linear.cu,
 * fast_moe.cu): the warp-level tile routines that stream weight rows through
 * the tensor cores, and the activation preparation they share.
 *
 * The idea.  Decode multiplies a few activation rows (T = 1..16) by large
 * weights, so what counts is reading each weight byte once at full
 * bandwidth.  A warp owns a tile of 16 (or 32) weight rows and a range of
 * 128-column blocks; each thread reads 16 contiguous bytes of two rows per
 * load (16-byte vector loads, coalesced per row) and feeds them, decoded to
 * f16/bf16 pairs, straight into mma.sync.m16n8k16 as the A operand.  The
 * activations are the B operand, 8 token rows per mma (n-tile).
 *
 * Fragment mapping.  In an m16n8k16 mma, thread (g = lane/4, q = lane%4)
 * holds A rows g and g+8 at k slots {2q, 2q+1} (low pair) and {2q+8, 2q+9}
 * (high pair), B column (token) g at the same k slots, and C rows g, g+8 at
 * columns (tokens) 2q, 2q+1.  A dot product does not care in which order its
 * k terms come, as long as A and B agree, so the k slots are mapped onto
 * columns in the way that suits the loads: in mma step s, thread q's low
 * pair is columns base + q*W + 4s + {0, 1} and its high pair base + q*W + 4s
 * + {2, 3}, W being the width a thread reads per row (16 columns of FP8 or
 * BF16 per 64-column chunk, 32 columns of FP4 per 128-column block).  Both
 * operands then come from one 16-byte load per row (weights) and per token
 * (activations, pre-converted to f16/bf16 in the same column order as x).
 *
 * Numerics (REF).  Activations are quantized per row per 128 columns to FP8
 * exactly as the exact path does (same scale, same codes); FP8 values are
 * exact in f16 and in bf16, E4M3 weights are exact in f16 (hardware cvt),
 * FP4 weights times their E8M0 group scale are exact in bf16 (for scales
 * 2^-126..2^127), so every product is exact and the tensor core sums them
 * in fp32: per 128-column block the sum differs from the exact path's only by
 * fp32 rounding (other order).  The block sum is then scaled by s_x (and s_w
 * for FP8) and added in block order, as the op contract says.  BF16 weights
 * take x as given: x = hi + lo with hi, lo bf16 (|x - hi - lo| <= 2^-17 |x|),
 * two mma per step.
 *
 * Determinism: each output is a function of its own row and token only; the
 * split of K over warps depends on N and K, never on T.
 */
#ifndef DSV4_KERNELS_CUDA_FAST_CUH
#define DSV4_KERNELS_CUDA_FAST_CUH

#include "kernels/cuda/cuda.cuh"

#define FK_LUT_WORDS (256 * 32)   /* FP4 byte -> bf16x2 table, one copy per bank */

/* --- block scan --------------------------------------------------------------- */

/*
 * Exclusive prefix sum over the block of v, one value a thread (blockDim.x a
 * multiple of 32, at most 1024); *total: the block's sum.  Every thread of
 * the block calls it; ws: 33 shared slots, free again when it returns (it
 * ends with a barrier).  The grouping of the MoE kernels (fm3_group,
 * fg_group_kernel) takes its offsets from it.
 */
template <typename T>
static __device__ __forceinline__ T
fk_block_scan(T v, T *ws, T *total)
{
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    T x = v;

    for (int o = 1; o < 32; o *= 2) {
        T y = __shfl_up_sync(0xffffffffu, x, o);

        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        ws[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T w = lane < nw ? ws[lane] : 0, z = w;

        for (int o = 1; o < 32; o *= 2) {
            T y = __shfl_up_sync(0xffffffffu, z, o);

            if (lane >= o)
                z += y;
        }
        if (lane < nw)
            ws[lane] = z - w;   /* exclusive, by warp */
        if (lane == 31)
            ws[32] = z;         /* the block's total (lanes past nw added 0) */
    }
    __syncthreads();
    x = x - v + ws[warp];
    *total = ws[32];
    __syncthreads();   /* ws read by every thread before anyone reuses it */
    return x;
}

/* --- loads and instructions ------------------------------------------------- */

/* 16 bytes of weights, read once: no L1 allocation. */
static __device__ __forceinline__ uint4
fk_ld_w(const void *p)
{
    uint4 v;

    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

/* fk_ld_w that the compiler keeps in program order with the other volatile
 * asm (the mma): a load issued ahead of the math it is meant to overlap
 * stays there (software pipelining, fast_moe.cu). */
static __device__ __forceinline__ uint4
fk_ld_wv(const void *p)
{
    uint4 v;

    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* 16 bytes of activations (re-read by many warps: cached). */
static __device__ __forceinline__ uint4
fk_ld_x(const uint16_t *p)
{
    return __ldg((const uint4 *)p);
}

/* Word i (compile-time after unrolling) of a vector. */
static __device__ __forceinline__ uint32_t
fk_word(const uint4 &v, int i)
{
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/* Word i (0..7) of two vectors, i.e. of 16 halves. */
static __device__ __forceinline__ uint32_t
fk_word8(const uint4 (&v)[2], int i)
{
    return fk_word(v[i / 4], i % 4);
}

/* Two E4M3 codes (low byte first) -> f16x2 (exact). */
static __device__ __forceinline__ uint32_t
fk_e4m3x2(uint32_t two)
{
    uint32_t r;
    unsigned short h = (unsigned short)(two & 0xffffu);

    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
    return r;
}

/*
 * fk_quant_value of two columns v0, v1 of a block whose scale has the
 * reciprocal inv = 1 / s, as f16 bits (v0 in the low half), and, when
 * codes != NULL, their E4M3 codes into *codes (v0's in the low byte): the
 * exact path's cu_f32_to_fp8(cu_clampf(v / s, 448)).  The same values: s is
 * a power of two in [2^-22, 2^120] (amax >= 1e-4; or inf), so 1 / s is
 * exact and v * inv is v / s, rounded once the same way; the clamp to
 * +-448 is cu_clampf's but for NaN (fminf/fmaxf drop it: handled apart);
 * cvt.rn.satfinite.e4m3x2.f32 rounds to nearest even as cu_f32_to_fp8 does
 * (subnormal codes, signed zeros); E4M3 to f16 is exact; a NaN gets the
 * exact expression's code 0x7f and its f16 (cu_fp8_to_f32(0x7f) is +qNaN,
 * rounded to f16).  dsv4_cuda_linear_quant_check compares the values with
 * the exact expression's on every float; equal values are equal codes
 * (E4M3 -> f16 is one to one but for the NaN codes, which the conversion
 * never gives a clamped input).
 */
static __device__ __forceinline__ uint32_t
fk_quant2(float v0, float v1, float inv, uint16_t *codes)
{
    float p0 = v0 * inv, p1 = v1 * inv;
    float a0 = fminf(fmaxf(p0, -448.0f), 448.0f), a1 = fminf(fmaxf(p1, -448.0f), 448.0f);
    uint32_t nan16 = __half_as_ushort(__float2half_rn(__int_as_float(0x7fc00000)));
    unsigned short e;
    uint32_t h;

    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(e) : "f"(a1), "f"(a0));
    h = fk_e4m3x2(e);
    if (isnan(p0)) {
        h = (h & 0xffff0000u) | nan16;
        e = (unsigned short)((e & 0xff00u) | 0x7fu);
    }
    if (isnan(p1)) {
        h = (h & 0x0000ffffu) | nan16 << 16;
        e = (unsigned short)((e & 0x00ffu) | 0x7f00u);
    }
    if (codes != NULL)
        *codes = e;
    return h;
}

/* a * b on bf16 pairs (exact for a power-of-two b in range). */
static __device__ __forceinline__ uint32_t
fk_bmul2(uint32_t a, uint32_t b)
{
    uint32_t r;

    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}

/*
 * The two E4M3 codes in bytes 0 and 2 of t (bytes 1 and 3 are ignored) ->
 * bf16x2 (exact), low half from byte 0: the code's bits placed in a bf16
 * (sign to bit 15, exponent and mantissa to bits 10..4) are the value times
 * 2^-120 (subnormal codes included), so one exact multiply by 2^120
 * restores it.  The NaN code (S.1111.111) decodes as +-480, not NaN:
 * checkpoints hold none.
 */
static __device__ __forceinline__ uint32_t
fk_e4m3b02_bf16(uint32_t t)
{
    return fk_bmul2((t & 0x00800080u) << 8 | (t & 0x007f007fu) << 4, 0x7b807b80u);
}

/* Two E4M3 codes (low byte first) -> bf16x2 (exact), as fk_e4m3b02_bf16. */
static __device__ __forceinline__ uint32_t
fk_e4m3x2_bf16_spread(uint32_t two)
{
    return fk_e4m3b02_bf16((two & 0xffu) | (two & 0xff00u) << 8);
}

/*
 * Two E4M3 codes (the low 16 bits of two, low byte first) -> bf16x2 (exact),
 * through the hardware's E4M3 -> f16 conversion: every E4M3 value but 0 is
 * an f16 normal, so the f16's exponent and top seven mantissa bits shifted
 * down by three are a bf16 of the value times 2^-112 (the rest of the f16
 * mantissa is zero), and one exact multiply by 2^112 restores it; zero
 * stays zero.  Five instructions a pair against fk_e4m3x2_bf16_spread's
 * seven or eight; the same bits for every code but NaN (S.1111.111, which
 * checkpoints do not hold): dsv4_cuda_linear_e4m3_check compares them on
 * all 65,536 pairs.
 */
static __device__ __forceinline__ uint32_t
fk_e4m3x2_bf16(uint32_t two)
{
    uint32_t h = fk_e4m3x2(two);

    return fk_bmul2((h >> 3 & 0x0fff0fffu) | (h & 0x80008000u), 0x77807780u);
}

/*
 * FP4 (E2M1) codes n and n + 4 of the word w (nibble n at bits 4n..4n+3,
 * n = 0..3) as a bf16 pair times 2^-126, low half code n: the code's
 * magnitude bits e1 e0 m go to bf16 bits 8..6 (exponent field e, top
 * mantissa bit m) and its sign to bit 15, which is the E2M1 value times
 * 2^-126 (code 1, 0.5, lands on the subnormal 2^-127).  The caller
 * multiplies by 2^126 times the group scale.  Three integer operations for
 * n constant (and one shift per word for n = 2, 3): the two nibbles masked
 * out, one multiply by 2^a + 2^(a+6) makes the copy shifted by a (the
 * magnitudes in place) and the copy shifted by a + 6 (the signs in place)
 * without overlapping bits, and a mask keeps those.
 */
static __device__ __forceinline__ uint32_t
fk_fp4pair_bf16(uint32_t w, int n)
{
    if (n >= 2)
        w >>= 8;
    return (n & 1 ? (w & 0x00f000f0u) * 0x0104u : (w & 0x000f000fu) * 0x1040u) & 0x81c081c0u;
}

/* E8M0 scale -> the bf16 pair (s, s). */
static __device__ __forceinline__ uint32_t
fk_e8m0_bf16x2(uint32_t e)
{
    uint32_t h = e == 0xffu ? 0x7fc0u : e == 0 ? 0x0040u : e << 7;

    return h | h << 16;
}

/* d += a * b, f16 inputs, fp32 accumulators. */
static __device__ __forceinline__ void
fk_mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
           uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/*
 * d += a * b, FP8 e4m3 inputs, fp32 accumulators (m16n8k32; sm_89+).
 * Fragments (PTX ISA): with g = lane / 4, q = lane % 4, a0 holds A[g][4q ..
 * 4q+3], a1 A[g+8][4q ..], a2 A[g][16+4q ..], a3 A[g+8][16+4q ..] (bytes in
 * increasing k); b0 holds B[4q .. 4q+3][g], b1 B[16+4q ..][g]; d as the
 * m16n8k16 forms.  The sum of the 32 products inside the instruction may be
 * kept with less than fp32 precision on Hopper: add partials of one k32
 * step (or one scale block) into fp32 registers.
 */
static __device__ __forceinline__ void
fk_mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
            uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/*
 * Eight FP4 e2m1 codes (w: byte j holds element 2j in its low nibble, 2j+1
 * in its high one) as FP8 e4m3 bytes of the values times 2^-6, exactly:
 * the code's bits E1 E0 M moved to bits 4..2 of the byte are e4m3's low
 * exponent bits and first mantissa bit, and e4m3's subnormals (exponent 0)
 * match e2m1's (E = 0: 0 or 0.5); the sign moves to bit 7.  *even gets
 * elements 0, 2, 4, 6 (bytes in that order), *odd elements 1, 3, 5, 7.
 * Seven instructions for eight values.  odd is a multiply-high by 2^30 (the
 * right shift by 2) of its masked magnitude bits with the masked sign bits
 * as the addend (disjoint bits: the sum is the OR): ptxas makes it two
 * independent masks (LOP3) and one LEA.HI combining them, where
 * (w >> 2) & m | (w & s) was three dependent instructions (the same count);
 * the decode MoE, whose warps wait on such chains, ran its batch-16 down
 * kernel 150 -> 144 us (docs/perf.md run 62).  A multiplier of 2^30 + 1
 * (the same result: m's low bits are 0) makes it an IMAD.HI on the FMA
 * pipe instead, plus one more instruction: the ALU pipe 63 -> 55% busy, but
 * that kernel 143 -> 152 us; keep 2^30.  The
 * caller multiplies the scale by 64 (exact for E8M0 scales) and lays the
 * other operand out in the same k order (any permutation of k shared by A
 * and B leaves the dot product's terms unchanged).
 */
static __device__ __forceinline__ void
fk_fp4x8_e4m3(uint32_t w, uint32_t *even, uint32_t *odd)
{
    uint32_t o;

    *even = ((w << 2) & 0x1c1c1c1cu) | ((w << 4) & 0x80808080u);
    asm("mad.hi.u32 %0, %1, 0x40000000, %2;" : "=r"(o) : "r"(w & 0x70707070u),
        "r"(w & 0x80808080u));
    *odd = o;
}

/* d += a * b, bf16 inputs, fp32 accumulators. */
static __device__ __forceinline__ void
fk_mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
            uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/*
 * Fill the FP4 table in shared memory: entry (byte b, lane l) at b*32 + l is
 * the bf16 pair (e2m1(b & 15), e2m1(b >> 4)); each lane reads its own copy,
 * so lookups never conflict.  Every thread of the block must call it.
 */
static __device__ __forceinline__ void
fk_lut_fill(uint32_t *lut)
{
    for (int i = threadIdx.x; i < FK_LUT_WORDS; i += blockDim.x) {
        int b = i >> 5;
        uint32_t lo = __float_as_uint(cu_fp4_to_f32((unsigned)b & 15u)) >> 16;
        uint32_t hi = __float_as_uint(cu_fp4_to_f32((unsigned)b >> 4)) >> 16;

        lut[i] = lo | hi << 16;
    }
    __syncthreads();
}

/* --- warp tiles ------------------------------------------------------------------- */

/* acc = 0 */
template <int MT, int NT>
static __device__ __forceinline__ void
fk_zero(float (&acc)[MT][NT][4])
{
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[m][n][i] = 0.0f;
}

/* acc += blk * (s_x * sw) for block kb: C columns 2q, 2q+1 are the tokens of
 * xs[n][0], xs[n][1] (sw == 1: exact, no change).  COH: 1, the scales were
 * written earlier in the same kernel (read at L2, fast_moe.cu's h); 2, they
 * are in shared memory (plain loads, fast_linear.cu's one-launch form). */
template <int NT, int COH = 0>
static __device__ __forceinline__ void
fk_add_scaled(float (&acc)[NT][4], const float (&blk)[NT][4], const float *const (&xs)[NT][2],
              int kb, float sw)
{
#pragma unroll
    for (int n = 0; n < NT; n++) {
        float f0 = (COH == 1 ? __ldcg(xs[n][0] + kb) : xs[n][0][kb]) * sw;
        float f1 = (COH == 1 ? __ldcg(xs[n][1] + kb) : xs[n][1][kb]) * sw;

        acc[n][0] += blk[n][0] * f0;
        acc[n][1] += blk[n][1] * f1;
        acc[n][2] += blk[n][2] * f0;
        acc[n][3] += blk[n][3] * f1;
    }
}
/*
 * Common arguments of the tile routines (one warp, lane = g*4 + q):
 *   acc[m][n][i]  C fragment of row tile m, token tile n (see the file
 *                 comment); accumulated into, never cleared
 *   wr[m][h]      start of weight row (tile m's first row + g + 8h)
 *   xb[n]         activation row (length K, f16 or bf16) of token n*8 + g
 *   xs[n][j]      scale row (K/128 floats) of token n*8 + 2q + j
 *   kb0..kb1      the 128-column blocks to add
 */

/* 16 bytes of activations written by the same kernel (fast_moe.cu's h):
 * coherent at L2, never the non-coherent path. */
static __device__ __forceinline__ uint4
fk_ld_xc(const uint16_t *p)
{
    return __ldcg((const uint4 *)p);
}

/* Activation load: COH == 0 read-only during the kernel (cached), 1
 * written earlier in the same kernel (L2), 2 in shared memory (a plain
 * load; VOL ignored).  VOL: volatile asm, kept in program order with the
 * mma (a software-pipelined loop whose later loads the compiler would
 * otherwise hoist, at the cost of registers). */
template <int COH, int VOL = 0>
static __device__ __forceinline__ uint4
fk_ld_act(const uint16_t *p)
{
    uint4 v;

    if (COH == 2)
        return *(const uint4 *)p;
    if (!VOL)
        return COH ? fk_ld_xc(p) : fk_ld_x(p);
    if (COH)
        asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    else
        asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    return v;
}

/* The FP8 weight bytes of 128-column block kb: w[m][h][c] = 16 bytes at
 * kb*128 + c*64 + q*16 of row wr[m][h] (VOL: fk_ld_wv, kept in place). */
template <int MT, int VOL = 0>
static __device__ __forceinline__ void
fk_fp8_load(uint4 (&w)[MT][2][2], const uint8_t *const (&wr)[MT][2], int kb, int q)
{
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const uint8_t *p = wr[m][h] + (int64_t)kb * 128 + c * 64 + q * 16;

                w[m][h][c] = VOL ? fk_ld_wv(p) : fk_ld_w(p);
            }
}

/* One 128-column block kb of fk_fp8 on weights already loaded (fk_fp8_load);
 * COH, VOL: the activation load (fk_ld_act). */
template <int MT, int NT, int BX, int COH, int VOL = 0>
static __device__ __forceinline__ void
fk_fp8_kb(float (&acc)[MT][NT][4], const uint4 (&w)[MT][2][2], const uint8_t *const (&ws)[MT],
          const uint16_t *const (&xb)[NT], const float *const (&xs)[NT][2], int kb, int q)
{
    uint4 x[NT][2][2];
    float blk[MT][NT][4];

#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const uint16_t *p = xb[n] + (int64_t)kb * 128 + c * 64 + q * 16;

            x[n][c][0] = fk_ld_act<COH, VOL>(p);
            x[n][c][1] = fk_ld_act<COH, VOL>(p + 8);
        }
    fk_zero(blk);
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int m = 0; m < MT; m++) {
                uint32_t u0 = fk_word(w[m][0][c], s), u8 = fk_word(w[m][1][c], s);
                uint32_t a0 = BX ? fk_e4m3x2_bf16(u0) : fk_e4m3x2(u0);
                uint32_t a2 = BX ? fk_e4m3x2_bf16(u0 >> 16) : fk_e4m3x2(u0 >> 16);
                uint32_t a1 = BX ? fk_e4m3x2_bf16(u8) : fk_e4m3x2(u8);
                uint32_t a3 = BX ? fk_e4m3x2_bf16(u8 >> 16) : fk_e4m3x2(u8 >> 16);

#pragma unroll
                for (int n = 0; n < NT; n++) {
                    uint32_t b0 = fk_word8(x[n][c], 2 * s), b1 = fk_word8(x[n][c], 2 * s + 1);

                    if (BX)
                        fk_mma_bf16(blk[m][n], a0, a1, a2, a3, b0, b1);
                    else
                        fk_mma_f16(blk[m][n], a0, a1, a2, a3, b0, b1);
                }
            }
#pragma unroll
    for (int m = 0; m < MT; m++) {
        float sw = cu_e8m0_to_f32(ws[m][kb]);

        if (BX) {
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    acc[m][n][i] += blk[m][n][i] * sw;
        } else {
            fk_add_scaled<NT, COH>(acc[m], blk[m], xs, kb, sw);
        }
    }
}

/* FP8 weights (E4M3, 128x128 E8M0 scales; ws[m] = tile m's scale row).
 * BX == 0: f16 FP8-valued activations with their scales xs (REF linear);
 * BX == 1: bf16 activations without scales (linear_grouped: xs unused), the
 * weights decoded to bf16 and each block sum times the weight scale only.
 * COH: where xb and xs are (fk_ld_act; 2: shared memory). */
template <int MT, int NT, int BX = 0, int COH = 0>
static __device__ __forceinline__ void
fk_fp8(float (&acc)[MT][NT][4], const uint8_t *const (&wr)[MT][2],
       const uint8_t *const (&ws)[MT], const uint16_t *const (&xb)[NT],
       const float *const (&xs)[NT][2], int kb0, int kb1, int q)
{
    for (int kb = kb0; kb < kb1; kb++) {
        uint4 w[MT][2][2];

        fk_fp8_load<MT>(w, wr, kb, q);
        fk_fp8_kb<MT, NT, BX, COH>(acc, w, ws, xb, xs, kb, q);
    }
}

/* FP4 weights (E2M1 pairs, low nibble first; ws[m][h] = row's E8M0 group
 * scales, one per 32 columns), bf16 FP8-valued activations.  Thread q reads
 * the 16 bytes (32 columns, one scale group) kb*128 + q*32 of each row. */
template <int MT, int NT>
static __device__ __forceinline__ void
fk_fp4(float (&acc)[MT][NT][4], const uint8_t *const (&wr)[MT][2],
       const uint8_t *const (&ws)[MT][2], const uint16_t *const (&xb)[NT],
       const float *const (&xs)[NT][2], int kb0, int kb1, int q, const uint32_t *lut)
{
    const uint32_t *lt = lut + (threadIdx.x & 31);

#pragma unroll 2
    for (int kb = kb0; kb < kb1; kb++) {
        uint4 w[MT][2], x[NT][4];
        uint32_t sc[MT][2];
        float blk[MT][NT][4];

#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                w[m][h] = fk_ld_w(wr[m][h] + (int64_t)kb * 64 + q * 16);
                sc[m][h] = fk_e8m0_bf16x2(__ldg(ws[m][h] + kb * 4 + q));
            }
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                x[n][j] = fk_ld_x(xb[n] + (int64_t)kb * 128 + q * 32 + j * 8);
        fk_zero(blk);
#pragma unroll
        for (int s = 0; s < 8; s++)
#pragma unroll
            for (int m = 0; m < MT; m++) {
                /* bytes 2s and 2s+1: columns 4s, 4s+1 and 4s+2, 4s+3 */
                uint32_t u0 = fk_word(w[m][0], s / 2) >> (16 * (s % 2));
                uint32_t u8 = fk_word(w[m][1], s / 2) >> (16 * (s % 2));
                uint32_t a0 = fk_bmul2(lt[(u0 & 0xffu) * 32], sc[m][0]);
                uint32_t a2 = fk_bmul2(lt[((u0 >> 8) & 0xffu) * 32], sc[m][0]);
                uint32_t a1 = fk_bmul2(lt[(u8 & 0xffu) * 32], sc[m][1]);
                uint32_t a3 = fk_bmul2(lt[((u8 >> 8) & 0xffu) * 32], sc[m][1]);

#pragma unroll
                for (int n = 0; n < NT; n++)
                    fk_mma_bf16(blk[m][n], a0, a1, a2, a3, fk_word(x[n][s / 2], (2 * s) % 4),
                                fk_word(x[n][s / 2], (2 * s + 1) % 4));
            }
#pragma unroll
        for (int m = 0; m < MT; m++)
            fk_add_scaled(acc[m], blk[m], xs, kb, 1.0f);
    }
}

/* BF16 weights, activations as bf16 pairs hi (xb) + lo (xl); 64-column
 * chunks ch0..ch1, no scales: acc collects the whole dot.  SH: xb and xl
 * are in shared memory (plain loads). */
/* The BF16 weight bytes of 64-column chunk ch: w[m][h][c] = 16 bytes at
 * (ch*64 + q*16)*2 + c*16 of row wr[m][h] (VOL: fk_ld_wv, kept in place). */
template <int MT, int VOL = 0>
static __device__ __forceinline__ void
fk_bf16_load(uint4 (&w)[MT][2][2], const uint8_t *const (&wr)[MT][2], int ch, int q)
{
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const uint8_t *p = wr[m][h] + ((int64_t)ch * 64 + q * 16) * 2 + c * 16;

                w[m][h][c] = VOL ? fk_ld_wv(p) : fk_ld_w(p);
            }
}

/* One 64-column chunk ch of fk_bf16 on weights already loaded
 * (fk_bf16_load). */
template <int MT, int NT, int SH = 0>
static __device__ __forceinline__ void
fk_bf16_ch(float (&acc)[MT][NT][4], const uint4 (&w)[MT][2][2],
           const uint16_t *const (&xb)[NT], const uint16_t *const (&xl)[NT], int ch, int q)
{
    uint4 xh[NT][2], xo[NT][2];

#pragma unroll
    for (int n = 0; n < NT; n++) {
        int64_t o = (int64_t)ch * 64 + q * 16;

        xh[n][0] = fk_ld_act<SH ? 2 : 0>(xb[n] + o);
        xh[n][1] = fk_ld_act<SH ? 2 : 0>(xb[n] + o + 8);
        xo[n][0] = fk_ld_act<SH ? 2 : 0>(xl[n] + o);
        xo[n][1] = fk_ld_act<SH ? 2 : 0>(xl[n] + o + 8);
    }
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
        for (int m = 0; m < MT; m++) {
            uint32_t a0 = fk_word8(w[m][0], 2 * s), a2 = fk_word8(w[m][0], 2 * s + 1);
            uint32_t a1 = fk_word8(w[m][1], 2 * s), a3 = fk_word8(w[m][1], 2 * s + 1);

#pragma unroll
            for (int n = 0; n < NT; n++) {
                fk_mma_bf16(acc[m][n], a0, a1, a2, a3, fk_word8(xh[n], 2 * s),
                            fk_word8(xh[n], 2 * s + 1));
                fk_mma_bf16(acc[m][n], a0, a1, a2, a3, fk_word8(xo[n], 2 * s),
                            fk_word8(xo[n], 2 * s + 1));
            }
        }
}

template <int MT, int NT, int SH = 0>
static __device__ __forceinline__ void
fk_bf16(float (&acc)[MT][NT][4], const uint8_t *const (&wr)[MT][2],
        const uint16_t *const (&xb)[NT], const uint16_t *const (&xl)[NT], int ch0, int ch1,
        int q)
{
    for (int ch = ch0; ch < ch1; ch++) {
        uint4 w[MT][2][2];

        fk_bf16_load<MT>(w, wr, ch, q);
        fk_bf16_ch<MT, NT, SH>(acc, w, xb, xl, ch, q);
    }
}

/* --- fast_linear.cu, for the other fast ops ---------------------------------------- */

/* cuda_fast_linear_scratch (cuda.cuh): the bytes cuda_fast_linear_at takes. */

/*
 * cuda_fast_linear (G == 0) or cuda_fast_linear_grouped (G > 0) with its
 * scratch placed `off` bytes into the backend scratch, so that a caller can
 * keep its own arrays in the first `off` bytes: it reserves
 * off + cuda_fast_linear_scratch(W, T, G) bytes, which moves nothing when the
 * caller reserved at least as much before.
 */
enum dsv4_err cuda_fast_linear_at(struct dsv4_backend *be, float *out, const float *x,
                                  const struct dsv4_linear *W, int T, unsigned flags, int G,
                                  size_t off);

/* --- the decode MoE v3 (fast_moe3.cu) -------------------------------------------- */

/* The exact path's REF activation scale of a 128-column block held by a
 * warp (v[i] = column lane + 32 i): 2^ceil(log2(amax / 448)), amax at least
 * 1e-4 (the codes are then cu_f32_to_fp8(cu_clampf(v / s, 448))). */
static __device__ __forceinline__ float
fk_quant_scale_warp(const float (&v)[4])
{
    float amax = 1e-4f;

    for (int i = 0; i < 4; i++)
        amax = fmaxf(amax, fabsf(v[i]));
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    return cu_pow2_scale(amax, 448.0f);
}

/* Whether v3 / v5 take these shapes: T*k <= 4096, D and I multiples of 1024
 * and at most 8192 (else fast_moe.cu's v1). */
int cuda_fast_moe3_fits(int T, int k, int D, int I);

/*
 * cuda_fast_moe (cuda.cuh) through v3 / v5 (FP4 weights converted to E4M3,
 * tensor cores); cuda_fast_moe calls it when DSV4_CUDA_FAST_MOE starts with
 * "v3" or "v5" (or is unset) and cuda_fast_moe3_fits holds.  cfg: that
 * setting ("v3", "v3,NS,RT", "v5", see fast_moe3.cu; unset: v5, or v3 for
 * moe_parts below 8 tokens).
 */
enum dsv4_err cuda_fast_moe3(struct dsv4_backend *be, float *out, float *parts, const float *x,
                             const int32_t *ids, const float *weights,
                             const struct dsv4_expert_w *table, int n_table,
                             const struct dsv4_expert_w *shared, int T, int k, int D, int I,
                             float lim, const char *cfg);

/* --- activation preparation (fast_linear.cu) ---------------------------------- */

/*
 * REF activation quantization of x (rows, K), row stride `stride`, per 128
 * columns (the exact path's codes and scales), written as the FP8 values in
 * f16 (f16 != NULL) and/or bf16 (bf16 != NULL), rows x K each, and the
 * scales sx (rows, K/128).  K % 128 == 0.
 */
enum dsv4_err fk_quant(struct dsv4_backend *be, uint16_t *f16, uint16_t *bf16, float *sx,
                       const float *x, int64_t stride, int rows, int K);

/* x = hi + lo for n values, both bf16 bits (hi = bf16(x), lo = bf16(x -
 * hi); lo = 0 where x is not finite; lo NULL: hi only), queued on the
 * backend stream. */
enum dsv4_err fk_split(struct dsv4_backend *be, uint16_t *hi, uint16_t *lo, const float *x,
                       int64_t n);

#endif
