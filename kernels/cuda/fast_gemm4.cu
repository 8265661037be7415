/*
 * fast_gemm4.cu — the prefill MoE (T > 96 rows) on FP8 wgmma (issue 7),
 * opt-in with DSV4_CUDA_GEMM4=1 on the Hopper path of fast_gemm.cu: the
 * same grouping, tiles, SwiGLU expression, per-128 quantization of h and
 * combine as fw_moe, with the products on the FP8 tensor cores instead of
 * bf16 ones (FP4 weights decode to e4m3 in seven instructions per eight
 * values, fk_fp4x8_e4m3, instead of a table lookup and a multiply
 * per pair).
 *
 * f4_kernel (sm_90a).  As fw_kernel: the weights are the A operand (64
 * rows per warpgroup, from registers), the token rows of a tile the B
 * operand (N = BN = 16, 32 or 64), both streamed global -> shared with
 * cp.async in S stages of 128 columns.  The MMA is wgmma m64nNk32
 * .f32.e4m3.e4m3 with A in registers: per warp (rows 16w..16w+15 of the
 * warpgroup) thread (g, q) holds reg0 = row g, k slots 4q..4q+3 (one byte
 * each, increasing k), reg1 = row g+8, same slots, reg2 = row g, slots
 * 16+4q..16+4q+3, reg3 = row g+8, same (PTX ISA, the register fragment of
 * A for .e4m3 at k32; the mma.sync m16n8k32 A fragment).
 *
 * K order.  Thread q reads the 8 consecutive columns 8q..8q+7 of its rows in
 * a 32-column group (FP4: 4 bytes, FP8: 8 bytes) and puts the even ones
 * (8q+0, 2, 4, 6) in reg0/reg1, the odd ones in reg2/reg3: k slot j of the
 * k32 step is logical column 2j (j < 16) or 2(j-16)+1 (j >= 16).  B holds
 * at physical byte p of each 32-column group the column of slot p: the
 * activations are stored so in global memory (f4_perm(c): p = 16(c & 1) +
 * (c >> 1) inside the group), written by f4_prep_kernel (x) and by the up
 * epilogue (h), as e4m3 codes with one fp32 scale per (row, 128 columns).
 *
 * B in shared memory: K-major, no swizzle; core matrix (8 token rows x 16
 * bytes) (n8, kc) of a stage at byte (n8 * 8 + kc) * 128, row n % 8 at +16 *
 * (n % 8): leading byte offset (next 16 bytes of K) 128, stride byte offset
 * (next 8 tokens) 1024, k32 step s of the stage at byte 256 * s.
 *
 * Numerics.  Every product is exact (e4m3 times e4m3; FP4 weights as their
 * value times 2^-6, exact in e4m3) and one k32 wgmma is one E8M0 group of
 * the FP4 weights: each group is summed by the tensor core into fresh
 * accumulators (scale-d = 0), then acc = fma(grp, s_w[row, group] * 64,
 * acc) in fp32, groups in order.  FP8 weights (the shared expert) have one
 * scale per 128 x 128 block: the 4 k32 steps of a block chain in the tensor
 * core (scale-d = 1 after the first; at most 128 products, the promotion
 * interval the FP8 sums need on Hopper), then acc = fma(blk, s_w, acc).
 * The activation scale s_x (per token and 128 columns, a power of two) is
 * folded: acc is kept in units of the current block's s_x; entering block
 * kb it is multiplied by s_x[kb-1] / s_x[kb] (a power of two: exact, while
 * in fp32's normal range), and the result is acc * s_x[last].  Real-number
 * equal to the op contract's sum of per-block sums times the scales,
 * another order of fp32 rounding than fw_kernel or the exact path (fine:
 * only calls of T > 96 rows take this path).  Each output depends on its
 * own weight row and token only: the bits do not depend on T, the tile
 * (BN), the grid or the other rows.
 *
 * Epilogues as fw_kernel's: F4_LINEAR writes out[row][col] = bf16(acc);
 * F4_UP (NWG = 4: 128 rows of w1 and the same 128 of w3, rows 8..15 of each
 * 16 the w3 rows of rows 0..7) forms h = bf16(silu(min(g, L)) * clamp(u,
 * ±L) [* w]) from the bf16-rounded g, u, quantizes h per token over the
 * block's 128 columns (the exact path's scale and codes; amax over the 16
 * warps through shared memory) and writes the down GEMM's B operand: codes
 * at f4_perm(c), the scale at (row, c / 128).
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_gemm.cuh"
#include "kernels/cuda/fast_wgmma.cuh"
#include "kernels/cuda_gemm4.h"

#include <stdlib.h>
#include <string.h>

#define F4_SMEM_MAX (220 * 1024)
#define F4_MAX_STAGES 8
#define F4_LBO 128              /* B: next 16 bytes of K */
#define F4_SBO 1024             /* B: next 8 token rows */

/* Weight format of a launch. */
enum {
    F4_FP8 = 0,     /* E4M3, 128x128 E8M0 block scales (the shared expert) */
    F4_FP4 = 1,     /* E2M1 pairs, E8M0 scale per 32 columns (routed experts) */
};

/* What a block writes. */
enum {
    F4_LINEAR = 0,  /* out[row, n] = bf16(acc) for its weight rows (w2) */
    F4_UP = 1,      /* 128 rows of w1 and the same 128 of w3: h, quantized */
};

/* Bytes of one weight row per stage of 128 columns. */
#define F4_AROW(WF) ((WF) == F4_FP4 ? 64 : 128)

/* Shared memory plan of an instantiation: S stages of A (weights), B
 * (codes), FP4 group scales and activation scales; then the row maps and
 * (F4_UP) the amax exchange. */
template <int WF, int EPI, int NWG, int BN>
struct f4_cfg {
    static constexpr int RA = 64 * NWG;                 /* weight rows */
    static constexpr int THREADS = 128 * NWG;
    static constexpr int AB = RA * F4_AROW(WF);         /* A bytes per stage */
    static constexpr int BB = BN * 128;                 /* B bytes per stage */
    static constexpr int SB = WF == F4_FP4 ? RA * 4 : 0;   /* FP4 group scales */
    static constexpr int XB = BN * 4;                   /* activation scales */
    static constexpr int STAGE = AB + BB + SB + XB;
    static constexpr int FIXED = 2 * BN * 4 + (EPI == F4_UP ? 4 * NWG * BN * 4 : 0);
    static constexpr int S0 = (F4_SMEM_MAX - FIXED) / STAGE;
    static constexpr int S = S0 > F4_MAX_STAGES ? F4_MAX_STAGES : S0;
    static constexpr int SMEM = S * STAGE + FIXED;
};

/* Everything a launch needs, by value (as fw_args; B is e4m3 codes + scales). */
struct f4_args {
    struct dsv4_linear W, W3;       /* dense tiles: the weight (F4_UP: w1, w3) */
    const struct dsv4_expert_w *table;  /* routed tiles: device expert structs, else NULL */
    const int32_t *grp;             /* routed: the grouping (fg_group_kernel's layout) */
    int A;                          /* routed: tile slots */
    int down;                       /* routed: w2 (B row = pick row), else w1/w3
                                       (B row = pick row / k) */
    int k;
    const uint8_t *xq;              /* (rows, K) B codes, f4_perm order */
    const float *xs;                /* (rows, K/128) their scales */
    float *out;                     /* F4_LINEAR: (rows, ldo) */
    uint8_t *hq;                    /* F4_UP: (rows, ldo) the down GEMM's codes */
    float *hs;                      /* F4_UP: (rows, ldo/128) their scales */
    int64_t ldo;
    const float *weights;           /* routed F4_UP: (T*k) route weights; else NULL */
    int M;                          /* dense: rows; B row i -> brow0 + i, out row orow0 + i */
    int brow0, orow0;
    int K;                          /* weight n_in */
    float lim;                      /* SwiGLU limit (<= 0: none) */
};

/* Physical position of logical column c (inside 32-column groups: the even
 * columns first, then the odd ones). */
static __device__ __forceinline__ int
f4_perm(int c)
{
    return (c & ~31) | (c & 1) << 4 | (c & 31) >> 1;
}

/*
 * B operand of x (rows, K), row stride `stride`: the exact path's FP8
 * quantization per 128 columns (codes at f4_perm, the scale per block).
 * One warp per (row, 128-column block).
 */
static __global__ void
f4_prep_kernel(uint8_t *xq, float *xs, const float *x, int64_t stride, int rows, int K)
{
    int nb = K / 128, lane = threadIdx.x & 31;
    int64_t wid = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int64_t r = wid / nb;
    int b = (int)(wid % nb);
    float amax = 1e-4f, v[4], s;
    const float *xr;

    if (r >= rows)
        return;   /* whole warps leave together */
    xr = x + r * stride + (int64_t)b * 128;
    for (int i = 0; i < 4; i++) {
        v[i] = xr[lane + 32 * i];
        amax = fmaxf(amax, fabsf(v[i]));
    }
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    s = cu_pow2_scale(amax, 448.0f);
    for (int i = 0; i < 4; i++)
        xq[r * K + f4_perm(b * 128 + lane + 32 * i)] = cu_f32_to_fp8(cu_clampf(v[i] / s, 448.0f));
    if (lane == 0)
        xs[r * nb + b] = s;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* --- wgmma --------------------------------------------------------------------------- */

/* d (64 x 16) = (SD ? d : 0) + a (64 x 32 e4m3, registers) * B (32 x 16 at desc). */
template <int SD>
static __device__ __forceinline__ void
f4_mma16(float (&d)[8], const uint32_t (&a)[4], uint64_t desc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}"
                 : WG_D8(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SD));
}

/* d (64 x 32) = (SD ? d : 0) + a (64 x 32 e4m3, registers) * B (32 x 32 at desc). */
template <int SD>
static __device__ __forceinline__ void
f4_mma32(float (&d)[16], const uint32_t (&a)[4], uint64_t desc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}"
                 : WG_D16(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SD));
}

/* d (64 x 64) = (SD ? d : 0) + a (64 x 32 e4m3, registers) * B (32 x 64 at desc). */
template <int SD>
static __device__ __forceinline__ void
f4_mma64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}"
                 : WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(SD));
}

/* The k32 wgmma for the tile width BN. */
template <int BN, int SD>
static __device__ __forceinline__ void
f4_mma(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t desc)
{
    if constexpr (BN == 16)
        f4_mma16<SD>(d, a, desc);
    else if constexpr (BN == 32)
        f4_mma32<SD>(d, a, desc);
    else
        f4_mma64<SD>(d, a, desc);
}

#endif   /* __CUDA_ARCH_FEAT_SM90_ALL */

/* Queue the loads of 128-column block kb into the stage at sa, sb, ss, sx. */
template <int WF, int EPI, int NWG, int BN>
static __device__ __forceinline__ void
f4_load(unsigned char *sa, unsigned char *sb, unsigned char *ss, float *sx, const int *brow,
        const struct f4_args &a, const struct dsv4_linear &L1, const struct dsv4_linear &L3,
        int n0, int kb)
{
    typedef f4_cfg<WF, EPI, NWG, BN> C;
    const int CH = F4_AROW(WF) / 16;   /* 16-byte chunks per weight row */
    int tid = threadIdx.x, K = a.K;

    for (int i = tid; i < C::RA * CH; i += C::THREADS) {
        int r = i / CH, c = i % CH, is3, wr = wg_wrow<EPI == F4_UP>(r, n0, &is3);
        const struct dsv4_linear &L = is3 ? L3 : L1;
        const uint8_t *src = (const uint8_t *)L.w +
                             (WF == F4_FP4 ? (int64_t)wr * (K / 2) + kb * 64
                                           : (int64_t)wr * K + kb * 128) + c * 16;

        wg_cp16(sa + wg_off<F4_AROW(WF)>(r, c), src, 1);
    }
    for (int i = tid; i < BN * 8; i += C::THREADS) {
        int n = i >> 3, c = i & 7, r = brow[n];
        int64_t o = (int64_t)(r < 0 ? 0 : r) * K + kb * 128 + c * 16;

        wg_cp16(sb + ((n >> 3) * 8 + c) * 128 + (n & 7) * 16, a.xq + o, r >= 0);
    }
    if (WF == F4_FP4 && tid < C::RA) {
        int is3, wr = wg_wrow<EPI == F4_UP>(tid, n0, &is3);
        const struct dsv4_linear &L = is3 ? L3 : L1;

        wg_cp4(ss + tid * 4, L.scale + (int64_t)wr * (K / 32) + kb * 4, 1);
    }
    if (tid < BN) {
        int r = brow[tid];

        wg_cp4(sx + tid, a.xs + (int64_t)(r < 0 ? 0 : r) * (K / 128) + kb, r >= 0);
    }
}

/* p / c for powers of two p, c in fp32's normal range (exact); 0 when c is
 * not positive (an empty token slot). */
static __device__ __forceinline__ float
f4_ratio(float p, float c)
{
    return c > 0.0f ? __int_as_float(__float_as_int(p) - __float_as_int(c) + 0x3f800000) : 0.0f;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* acc = fma(t, s_w, acc): rows ra (s0) and ra + 8 (s1) of the D fragment. */
template <int N>
static __device__ __forceinline__ void
f4_fma(float (&acc)[N], const float (&t)[N], float s0, float s1)
{
#pragma unroll
    for (int i = 0; i < N; i++)
        acc[i] = __fmaf_rn(t[i], (i & 2) ? s1 : s0, acc[i]);
}

/*
 * One stage (128 columns) of the warpgroup's 64 rows into acc: decode the 4
 * A fragments (rows ra = 16w + g of the warpgroup's block and ra + 8),
 * rescale acc to this block's activation scales (sxc; sxp the previous
 * block's, = sxc for the first), then per group (FP4) or per block (FP8)
 * wgmma into t, waited for, and acc = fma(t, s_w, acc).  swa, swb: FP8
 * block scales of rows ra and ra + 8.  PIPE (FP4): two accumulator sets, the
 * next group's wgmma in flight while the previous one is added (the same
 * additions in the same order: the same bits; 16 registers more per
 * thread, so only where there is room).
 */
template <int WF, int BN, int PIPE>
static __device__ __forceinline__ void
f4_stage(float (&acc)[BN / 2], const unsigned char *sa, uint32_t sb, const unsigned char *ss,
         const float *sxc, const float *sxp, int ra, int q, float swa, float swb)
{
    uint32_t af[4][4];
    float t[BN / 2];

#pragma unroll
    for (int G = 0; G < 4; G++) {
        if (WF == F4_FP4) {
            uint32_t wa = *(const uint32_t *)(sa + wg_off<F4_AROW(F4_FP4)>(ra, G) + q * 4);
            uint32_t wb = *(const uint32_t *)(sa + wg_off<F4_AROW(F4_FP4)>(ra + 8, G) + q * 4);

            fk_fp4x8_e4m3(wa, &af[G][0], &af[G][2]);
            fk_fp4x8_e4m3(wb, &af[G][1], &af[G][3]);
        } else {
            int c = 2 * G + (q >> 1), o = (q & 1) * 8;
            uint2 va = *(const uint2 *)(sa + wg_off<F4_AROW(F4_FP8)>(ra, c) + o);
            uint2 vb = *(const uint2 *)(sa + wg_off<F4_AROW(F4_FP8)>(ra + 8, c) + o);

            af[G][0] = __byte_perm(va.x, va.y, 0x6420);   /* columns 8q + 0, 2, 4, 6 */
            af[G][2] = __byte_perm(va.x, va.y, 0x7531);   /* columns 8q + 1, 3, 5, 7 */
            af[G][1] = __byte_perm(vb.x, vb.y, 0x6420);
            af[G][3] = __byte_perm(vb.x, vb.y, 0x7531);
        }
    }
    /* acc in units of this block's activation scale: token 8j + 2q + (i & 1) */
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        float2 c = *(const float2 *)(sxc + 8 * j + 2 * q);
        float2 p = *(const float2 *)(sxp + 8 * j + 2 * q);
        float r0 = f4_ratio(p.x, c.x), r1 = f4_ratio(p.y, c.y);

        acc[4 * j] *= r0;
        acc[4 * j + 1] *= r1;
        acc[4 * j + 2] *= r0;
        acc[4 * j + 3] *= r1;
    }
    if (WF == F4_FP4 && PIPE) {
        float u[BN / 2], s0[4], s1[4];

#pragma unroll
        for (int G = 0; G < 4; G++) {
            s0[G] = cu_e8m0_to_f32(ss[ra * 4 + G]) * 64.0f;
            s1[G] = cu_e8m0_to_f32(ss[(ra + 8) * 4 + G]) * 64.0f;
        }
        wg_fence();
        f4_mma<BN, 0>(t, af[0], wg_desc<F4_LBO, F4_SBO>(sb, 0));
        wg_commit();
        wg_fence();
        f4_mma<BN, 0>(u, af[1], wg_desc<F4_LBO, F4_SBO>(sb, 1));
        wg_commit();
        wg_wait<1>();   /* group 0 done, group 1 in flight */
        wg_hold(t);
        f4_fma(acc, t, s0[0], s1[0]);
        wg_fence();
        f4_mma<BN, 0>(t, af[2], wg_desc<F4_LBO, F4_SBO>(sb, 2));
        wg_commit();
        wg_wait<1>();   /* group 1 done, group 2 in flight */
        wg_hold(u);
        f4_fma(acc, u, s0[1], s1[1]);
        wg_fence();
        f4_mma<BN, 0>(u, af[3], wg_desc<F4_LBO, F4_SBO>(sb, 3));
        wg_commit();
        wg_wait<1>();   /* group 2 done, group 3 in flight */
        wg_hold(t);
        f4_fma(acc, t, s0[2], s1[2]);
        wg_wait<0>();
        wg_hold(u);
        f4_fma(acc, u, s0[3], s1[3]);
    } else if (WF == F4_FP4) {
#pragma unroll
        for (int G = 0; G < 4; G++) {
            float s0 = cu_e8m0_to_f32(ss[ra * 4 + G]) * 64.0f;
            float s1 = cu_e8m0_to_f32(ss[(ra + 8) * 4 + G]) * 64.0f;

            wg_fence();
            f4_mma<BN, 0>(t, af[G], wg_desc<F4_LBO, F4_SBO>(sb, G));
            wg_commit();
            wg_wait<0>();
            wg_hold(t);
            f4_fma(acc, t, s0, s1);
        }
    } else {
        wg_fence();
        f4_mma<BN, 0>(t, af[0], wg_desc<F4_LBO, F4_SBO>(sb, 0));
        f4_mma<BN, 1>(t, af[1], wg_desc<F4_LBO, F4_SBO>(sb, 1));
        f4_mma<BN, 1>(t, af[2], wg_desc<F4_LBO, F4_SBO>(sb, 2));
        f4_mma<BN, 1>(t, af[3], wg_desc<F4_LBO, F4_SBO>(sb, 3));
        wg_commit();
        wg_wait<0>();
        wg_hold(t);
        f4_fma(acc, t, swa, swb);
    }
}

#endif   /* __CUDA_ARCH_FEAT_SM90_ALL */

/*
 * Grid (weight row tiles of RA rows (F4_UP: 128 columns of I), token tiles).
 * Dense (a.table == NULL): token tile y is rows y*BN .. of a.M.  Routed: tile
 * slot y of the grouping, or nothing.
 *
 * Pipeline: the loads run S - 2 stages ahead, so that the stage before the
 * current one (its activation scales: the rescaling) is intact while the
 * current one is computed; the buffer a load refills was last read two
 * iterations earlier, before this iteration's __syncthreads.
 */
template <int WF, int EPI, int NWG, int BN>
static __global__ void __launch_bounds__(128 * NWG, 1)
f4_kernel(struct f4_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef f4_cfg<WF, EPI, NWG, BN> C;
    extern __shared__ __align__(128) unsigned char f4_sm[];
    unsigned char *sa = f4_sm, *sb = sa + C::S * C::AB, *ss = sb + C::S * C::BB;
    float *sx = (float *)(ss + C::S * C::SB);
    int *brow = (int *)(sx + C::S * BN), *orow = brow + BN;
    float *red = (float *)(orow + BN);
    struct dsv4_linear L1, L3;
    int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    int g = lane >> 2, q = lane & 3, ra = warp * 16 + g;   /* row in the warpgroup's 64 */
    int n0 = blockIdx.x * (EPI == F4_UP ? 128 : C::RA), nkt = a.K / 128;
    uint32_t sb0 = (uint32_t)__cvta_generic_to_shared(sb);
    const unsigned char *sw1 = NULL, *sw3 = NULL;
    const float *sxl;
    float acc[BN / 2];

    static_assert(C::S >= 3, "f4_kernel: shared memory for fewer than 3 stages");
    if (!wg_tile_rows<BN, C::THREADS>(a, brow, orow, L1, L3))
        return;   /* an idle slot: the whole block leaves */
    __syncthreads();   /* the row maps, before the loads use them */
    for (int s = 0; s < C::S - 2; s++) {
        if (s < nkt)
            f4_load<WF, EPI, NWG, BN>(sa + s * C::AB, sb + s * C::BB, ss + s * C::SB,
                                      sx + s * BN, brow, a, L1, L3, n0, s);
        wg_cp_commit();
    }
    if (WF == F4_FP8) {
        /* block scale rows of this thread's two weight rows (128-row blocks) */
        int is3a, is3b, wa = wg_wrow<EPI == F4_UP>(wg * 64 + ra, n0, &is3a);
        int wb = wg_wrow<EPI == F4_UP>(wg * 64 + ra + 8, n0, &is3b);

        sw1 = (is3a ? L3 : L1).scale + (int64_t)(wa / 128) * nkt;
        sw3 = (is3b ? L3 : L1).scale + (int64_t)(wb / 128) * nkt;
    }
#pragma unroll
    for (int i = 0; i < BN / 2; i++)
        acc[i] = 0.0f;

    for (int kt = 0; kt < nkt; kt++) {
        int st = kt % C::S, sp = kt == 0 ? st : (kt - 1) % C::S, nx = kt + C::S - 2;
        float swa = 0.0f, swb = 0.0f;

        wg_cp_wait<C::S - 3>();
        wg_fence_proxy();
        __syncthreads();   /* stage kt landed for all; stage nx's buffer (kt - 2) is used up */
        if (nx < nkt) {
            int sn = nx % C::S;

            f4_load<WF, EPI, NWG, BN>(sa + sn * C::AB, sb + sn * C::BB, ss + sn * C::SB,
                                      sx + sn * BN, brow, a, L1, L3, n0, nx);
        }
        wg_cp_commit();
        if (WF == F4_FP8) {
            swa = cu_e8m0_to_f32(__ldg(sw1 + kt));
            swb = cu_e8m0_to_f32(__ldg(sw3 + kt));
        }
        f4_stage<WF, BN, NWG == 2>(acc, sa + st * C::AB + wg * 64 * F4_AROW(WF),
                                   sb0 + st * C::BB, ss + st * C::SB + wg * 64 * 4,
                                   sx + st * BN, sx + sp * BN, ra, q, swa, swb);
    }
    sxl = sx + ((nkt - 1) % C::S) * BN;   /* the last block's scales: not refilled */

    /* D fragment: acc[4j + i] is row ra + 8 * (i >> 1) of the warpgroup's 64,
     * token 8j + 2q + (i & 1) */
    if (EPI == F4_LINEAR) {
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int n = 8 * j + 2 * q + (i & 1), r = orow[n];

                if (r >= 0)
                    a.out[(int64_t)r * a.ldo + n0 + wg * 64 + ra + 8 * (i >> 1)] =
                        cu_bf16_round(acc[4 * j + i] * sxl[n]);
            }
    } else {
        /* h of column c = wg*32 + warp*8 + g (rows ra: w1, ra + 8: w3) */
        int c = n0 + wg * 32 + warp * 8 + g, wid = wg * 4 + warp;
        float h[BN / 4];

#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int ii = 0; ii < 2; ii++) {
                int n = 8 * j + 2 * q + ii, r = orow[n];
                float v = cu_swiglu(acc[4 * j + ii] * sxl[n], acc[4 * j + 2 + ii] * sxl[n], a.lim);
                float m;

                if (a.weights != NULL && r >= 0)
                    v *= a.weights[r];
                v = cu_bf16_round(v);
                h[2 * j + ii] = v;
                m = fabsf(v);
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
                if (g == 0)
                    red[wid * BN + n] = m;
            }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int ii = 0; ii < 2; ii++) {
                int n = 8 * j + 2 * q + ii, r = orow[n];
                float amax = 1e-4f, s;

                if (r < 0)
                    continue;
                for (int w = 0; w < 4 * NWG; w++)
                    amax = fmaxf(amax, red[w * BN + n]);
                s = cu_pow2_scale(amax, 448.0f);
                a.hq[(int64_t)r * a.ldo + f4_perm(c)] =
                    cu_f32_to_fp8(cu_clampf(h[2 * j + ii] / s, 448.0f));
                if (wid == 0 && g == 0)
                    a.hs[(int64_t)r * (a.ldo / 128) + c / 128] = s;
            }
    }
#endif
}

/* --- host side ------------------------------------------------------------------------ */

/* off unless "1"/"on" (no gain measured); dsv4_cuda_set_gemm4 */
static struct cuda_switch f4_switch = CUDA_SWITCH("DSV4_CUDA_GEMM4", 0);

void
dsv4_cuda_set_gemm4(int on)
{
    cuda_switch_set(&f4_switch, on);
}

int
cuda_fast_gemm4_on(void)
{
    return cuda_switch_on(&f4_switch);
}

template <int WF, int EPI, int NWG, int BN>
static enum dsv4_err
f4_launch(struct dsv4_backend *be, const struct f4_args *a, unsigned gx, unsigned gy)
{
    typedef f4_cfg<WF, EPI, NWG, BN> C;
    static size_t smem_done[CUDA_MAX_DEV];   /* per instantiation and device */
    enum dsv4_err e;

    static_assert(EPI != F4_UP || NWG == 4, "f4_kernel: the up epilogue needs 128 columns");
    e = cuda_smem_allow(be, (const void *)f4_kernel<WF, EPI, NWG, BN>, C::SMEM, smem_done);
    if (e != DSV4_OK)
        return e;
    if (gx == 0 || gy == 0)
        return DSV4_OK;
    f4_kernel<WF, EPI, NWG, BN><<<dim3(gx, gy), C::THREADS, C::SMEM, cuda_stream(be)>>>(*a);
    CUDA_LAUNCHED("fast gemm4 (fp8 wgmma)");
    return DSV4_OK;
}

/* The instantiations used: routed FP4 up (NWG 4) and down (NWG 2) at token
 * tiles of 16, 32, 64; the FP8 shared expert at 64. */
template <int WF, int EPI, int NWG>
static enum dsv4_err
f4_run(struct dsv4_backend *be, const struct f4_args *a, int bn, unsigned gx, unsigned gy)
{
    if constexpr (WF == F4_FP4) {
        if (bn == 16)
            return f4_launch<WF, EPI, NWG, 16>(be, a, gx, gy);
        if (bn == 32)
            return f4_launch<WF, EPI, NWG, 32>(be, a, gx, gy);
    }
    if (bn == 64)
        return f4_launch<WF, EPI, NWG, 64>(be, a, gx, gy);
    return dsv4_err_set(DSV4_ERR_INVAL, "fast gemm4: no tile of %d tokens", bn);
}

/*
 * The shared expert's dense tiles of 64 tokens, on the routed launch's
 * arguments r: up (W3 != NULL: w1, w3; B rows the tokens, h rows Tk + t) or
 * down (W1 = w2; B and output rows Tk + t); N the output columns.
 */
static enum dsv4_err
f4_shared(struct dsv4_backend *be, const struct f4_args *r, const struct dsv4_linear *W1,
          const struct dsv4_linear *W3, int T, int Tk, int N)
{
    struct f4_args s = *r;
    unsigned gy = (unsigned)((T + 63) / 64);

    s.table = NULL;
    s.W = *W1;
    s.W3 = W3 != NULL ? *W3 : *W1;
    s.weights = NULL;
    s.M = T;
    s.brow0 = W3 != NULL ? 0 : Tk;
    s.orow0 = Tk;
    if (W3 != NULL)
        return f4_run<F4_FP8, F4_UP, 4>(be, &s, 64, (unsigned)(N / 128), gy);
    return f4_run<F4_FP8, F4_LINEAR, 2>(be, &s, 64, (unsigned)(N / 128), gy);
}

enum dsv4_err
cuda_fast_gemm4_moe(struct dsv4_backend *be, float *out, float *parts, const float *x,
                    const int32_t *ids, const float *weights,
                    const struct dsv4_expert_w *table, int n_table,
                    const struct dsv4_expert_w *shared, int T, int k, int D, int I, float lim,
                    void (*group)(int32_t *grp, const int32_t *ids, int Tk, int E, int A,
                                  int BM, const struct dsv4_expert_w *table, int skip_unheld,
                                  cudaStream_t st))
{
    cudaStream_t st = cuda_stream(be);
    int Tk = T * k, R = Tk + T, act = Tk < n_table ? Tk : n_table, avg = Tk / (act > 0 ? act : 1);
    /* token tile as fw_moe: one tile for nearly every expert */
    int bn = avg <= 8 ? 16 : avg <= 20 ? 32 : 64;
    int A = (Tk + bn - 1) / bn + act, has_sh = shared != NULL;
    size_t b_grp = cuda_align((size_t)(1 + 3 * A + Tk) * sizeof(int32_t));
    size_t b_xq = cuda_align((size_t)T * D);
    size_t b_xs = cuda_align((size_t)T * (D / 128) * sizeof(float));
    size_t b_hq = cuda_align((size_t)R * I);
    size_t b_hs = cuda_align((size_t)R * (I / 128) * sizeof(float));
    size_t b_y = parts != NULL ? 0 : cuda_align((size_t)R * D * sizeof(float));
    char *p;
    struct f4_args a;
    enum dsv4_err e;
    int64_t warps = (int64_t)T * (D / 128);

    if (T <= 0)
        return DSV4_OK;
    p = (char *)cuda_scratch(be, b_grp + b_xq + b_xs + b_hq + b_hs + b_y);
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast gemm4 moe: no scratch (T=%d k=%d)", T, k);
    memset(&a, 0, sizeof(a));
    a.grp = (const int32_t *)p;
    a.xq = (const uint8_t *)(p + b_grp);
    a.xs = (const float *)(p + b_grp + b_xq);
    a.hq = (uint8_t *)(p + b_grp + b_xq + b_xs);
    a.hs = (float *)(p + b_grp + b_xq + b_xs + b_hq);

    f4_prep_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, st>>>((uint8_t *)a.xq, (float *)a.xs,
                                                                x, D, T, D);
    CUDA_LAUNCHED("fast gemm4 prep");
    group((int32_t *)a.grp, ids, Tk, n_table, A, bn, table, parts != NULL, st);
    CUDA_LAUNCHED("fast gemm4 moe group");

    /* up: h of every pick row (routed), then of every token (shared, rows Tk + t) */
    a.table = table;
    a.A = A;
    a.k = k;
    a.ldo = I;
    a.weights = weights;
    a.K = D;
    a.lim = lim;
    e = f4_run<F4_FP4, F4_UP, 4>(be, &a, bn, (unsigned)(I / 128), (unsigned)A);
    if (e != DSV4_OK)
        return e;
    if (has_sh && (e = f4_shared(be, &a, &shared->w1, &shared->w3, T, Tk, I)) != DSV4_OK)
        return e;

    /* down into y (rows of moe_parts' layout) */
    a.down = 1;
    a.xq = a.hq;
    a.xs = a.hs;
    a.hq = NULL;
    a.hs = NULL;
    a.out = parts != NULL ? parts : (float *)(p + b_grp + b_xq + b_xs + b_hq + b_hs);
    a.ldo = D;
    a.weights = NULL;
    a.K = I;
    e = f4_run<F4_FP4, F4_LINEAR, 2>(be, &a, bn, (unsigned)(D / 128), (unsigned)A);
    if (e != DSV4_OK)
        return e;
    if (has_sh && (e = f4_shared(be, &a, &shared->w2, NULL, T, Tk, D)) != DSV4_OK)
        return e;
    if (parts != NULL)
        return DSV4_OK;   /* moe_parts: the caller sums the ranks' parts, then combines */
    return cuda_moe_combine(be, out, a.out, ids, T, k, D);   /* the exact path's combine */
}
