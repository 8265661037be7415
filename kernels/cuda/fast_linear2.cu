/*
 * fast_linear2.cu — the decode linear, second version (v2, off by default:
 * DSV4_CUDA_LINEAR=v2 or v2h): FP8 block-scaled weights under REF numerics,
 * one launch per pass of up to 16 tokens, no scratch, the weights streamed
 * through a shared-memory ring with cp.async and multiplied on the FP8
 * tensor cores.  fast_linear.cu calls it for its FP8 mode when selected
 * (cuda_fast_linear2_variant); v1 (fl_kernel) stays the default and the
 * fallback for every shape v2 does not take.
 *
 * Why.  v1 reads the flash attention linears at 0.06-0.72 of 4.3 TB/s at
 * T <= 16 (docs/perf.md): three launches per call (activation quantization,
 * tile kernel, split-K reduction), one weight block in flight per warp, and
 * f16 conversions of every weight byte.  v2:
 *   - quantizes the activations inside the kernel: each CTA quantizes the
 *     tokens of the pass over its own K range into shared memory (E4M3 bytes
 *     and scales, the exact path's codes and scales) while its first weight
 *     blocks are on the way;
 *   - keeps F2_STAGES 128-column weight blocks (4 KB per warp each) in
 *     flight per warp: each thread copies its own 16-byte chunks with
 *     cp.async.cg into a per-thread slot of the ring and later reads back
 *     only those, so the ring needs no barrier and has no bank conflicts;
 *   - splits K over the warps of a CTA (KW) and over the CTAs of a thread
 *     block cluster (C, along grid y), and adds the slices through
 *     distributed shared memory in the same kernel: no partial sums in
 *     global memory, no second launch;
 *   - multiplies E4M3 weights by E4M3 activations with mma m16n8k32
 *     (fk_mma_e4m3, variant "v2"), or, variant "v2h", converts both to f16
 *     and uses m16n8k16 as v1 does (the exact-product fallback, should the
 *     FP8 tensor core's reduced internal precision fail the bounds).
 *
 * Geometry (f2_plan_for, from N and K only, so results never depend on T):
 * a warp owns 32 weight rows (two m16 tiles) and a K slice of bps blocks;
 * a CTA is RW x KW warps (RW row tiles of 32, KW slices: warp w takes row
 * tile w % RW and slice w / RW); C CTAs of a cluster take consecutive
 * ranges of KW * bps blocks (cluster rank z: slices z*KW .. z*KW + KW-1).
 * S = C * KW slices in all, a power of two aiming at F2_WANT warps per
 * call, RW shrunk until the grid has F2_CTAS CTAs.  Flash shapes: wq_a
 * 1024x4096 S 32 (C 4, KW 8, RW 1); wkv 512x4096 S 32 (4, 8, 1); wq_b
 * 32768x1024 S 1 (RW 8, bps 8); wq_b/2 16384x1024 S 2 (C 2); wo_b
 * 4096x8192 S 8 (C 4, KW 2, RW 4); wo_b/2 2048x8192 S 16 (4, 4, 2);
 * indexer wq_b 8192x1024 S 4 (C 4, RW 8): 64..128 CTAs of 8 warps.
 *
 * Fragments (fast.cuh's fk_mma_e4m3 comment).  Thread (g = lane/4, q =
 * lane%4) copies, per row r of its tile (rows g, g+8 of each m16 tile) and
 * block kb, the 16 bytes at kb*128 + c*64 + q*16 (c = 0, 1): eight words
 * f = 4c + e holding columns kb*128 + c*64 + q*16 + 4e .. +3.  k32 step s
 * (0..3) gives the mma a0 = word 2s of row g, a2 = word 2s+1 of row g, a1,
 * a3 the same words of row g+8, i.e. k = 4q..4q+3 <- word 2s and k = 16+4q
 * .. 19+4q <- word 2s+1; b0, b1 are the same words of token g's quantized
 * row (B[k][token g]).  A and B put the same columns on the same k, and the
 * four steps cover the block's 128 columns once (f = 0..7, q = 0..3), so
 * each step adds 32 products of the block.  v2h: step f (0..7) takes word f
 * as k = 2q, 2q+1 (its low two bytes) and 2q+8, 2q+9 (high two) of
 * m16n8k16, both operands converted to f16 (exact).
 *
 * Numerics (REF).  Activation codes and scales are the exact path's (the
 * same scale rule; the code by the hardware's round-to-nearest-even
 * cvt.rn.satfinite.e4m3x2.f32 of the clamped value, which
 * dsv4_cuda_linear_selftest compares with cu_f32_to_fp8).  v2: each k32
 * step's mma starts from zero and its result is added to the block sum in
 * fp32 registers (the FP8 tensor core may keep less than fp32 inside one
 * instruction; nothing is accumulated across instructions there); v2h: the
 * block sum accumulates in the mma as v1's.  Then acc += blk * (s_x * s_w)
 * per block in block order; slices are added in slice order (the KW
 * slices of a CTA, then the C CTA sums in cluster rank order) and the sum
 * rounded to bf16.  Each output is a function of its own token's row of x
 * and the weights: padding tokens of a pass are zeros in their own mma
 * columns.
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_wgmma.cuh"

#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/formats.h"
#include "kernels/cuda_fast.h"

namespace cg = cooperative_groups;

#define F2_STAGES 4          /* weight blocks in flight per warp */
#define F2_MAXW 8            /* warps per CTA at most */
#define F2_TOK 16            /* tokens per pass (two n8 tiles) */
#define F2_MAXC 4            /* CTAs per cluster at most, default */
#define F2_MAXRANGE 32       /* 128-column blocks per CTA at most (its x in smem) */
#define F2_WANT 1024         /* warps wanted per call, default */
#define F2_CTAS 128          /* CTAs wanted per call (132 SMs, one CTA each) */
#define F2_SLOT 4096         /* bytes of one ring slot: 32 rows x 128 columns */
#define F2_QB 8              /* (token, block) items a warp quantizes per batch */
#define F2_SMEM_MAX (227 * 1024)   /* shared memory per CTA on sm_90 */
#define F2_MAX_DEV 16

/* --- the split ----------------------------------------------------------------------- */

/* How an N x K weight is split (f2_plan_for). */
struct f2_plan {
    int nb;      /* K / 128 */
    int bps;     /* blocks per slice */
    int KW;      /* slices per CTA (warps along K) */
    int C;       /* CTAs per cluster (along K) */
    int RW;      /* row tiles of 32 per CTA */
    int range;   /* blocks per CTA: KW * bps */
};

/*
 * The split for N x K with clusters of at most maxc CTAs and about `want`
 * warps: S = C * KW slices, a power of two <= min(nb, 8 * maxc); then as
 * many row tiles per CTA (RW, with KW * RW <= 8) as keep F2_CTAS CTAs.
 * Zero when v2 cannot take the shape (its x range would not fit).
 */
static int
f2_plan_for(struct f2_plan *p, int N, int K, int maxc, int want)
{
    int tiles = N / 32, S, pw;

    p->nb = K / 128;
    S = (want + tiles - 1) / tiles;
    S = S < p->nb ? S : p->nb;
    S = S < 8 * maxc ? S : 8 * maxc;
    for (pw = 1; pw * 2 <= S; pw *= 2)
        ;
    S = pw;
    p->bps = (p->nb + S - 1) / S;
    p->C = S < maxc ? S : maxc;
    p->KW = S / p->C;
    p->RW = F2_MAXW / p->KW;
    while (p->RW > 1 && (tiles % p->RW != 0 || (tiles / p->RW) * p->C < F2_CTAS))
        p->RW /= 2;
    p->range = p->KW * p->bps;
    return p->range <= F2_MAXRANGE;
}

/* Shared memory layout of a CTA (byte offsets; all multiples of 16). */
struct f2_smem {
    int xs_stride;           /* bytes per token row of quantized x */
    int rtp;                 /* floats per token row of the partial sums */
    size_t ring, xq, sx, sw, part, total;
};

static __host__ __device__ struct f2_smem
f2_smem_for(int KW, int RW, int range)
{
    struct f2_smem s;
    int RT = 32 * RW, ngrp = (RT + 127) / 128;

    s.xs_stride = range * 128 + 64;   /* 64: tokens g, g+1 on other banks */
    s.rtp = RT + 4;                   /* 4: conflict-free fragment stores */
    s.ring = 0;
    s.xq = (size_t)KW * RW * F2_STAGES * F2_SLOT;
    s.sx = s.xq + (size_t)F2_TOK * s.xs_stride;
    s.sw = s.sx + ((size_t)F2_TOK * range * 4 + 15) / 16 * 16;
    s.part = s.sw + ((size_t)ngrp * range * 4 + 15) / 16 * 16;
    s.total = s.part + (size_t)KW * F2_TOK * s.rtp * 4;
    return s;
}

/* --- the kernel ---------------------------------------------------------------------- */

struct f2_args {
    const uint8_t *w;        /* (N, K) E4M3 */
    const uint8_t *ws;       /* (N/128, K/128) E8M0 */
    const float *x;          /* (T, K), 16-byte aligned */
    float *out;              /* (T, N), bf16-valued */
    int T, t0;               /* tokens; first token of this pass */
    int N, K, nb, bps, KW, RW, range;
};

/* 16 bytes global -> shared (L2 only). */
static __device__ __forceinline__ void
f2_cp16(void *dst, const void *src)
{
    uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);

    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src) : "memory");
}

/* Four floats -> four E4M3 codes (RNE, saturating; v0 in the low byte). */
static __device__ __forceinline__ uint32_t
f2_e4m3x4(float v0, float v1, float v2, float v3)
{
    unsigned short lo, hi;

    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v1), "f"(v0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v3), "f"(v2));
    return (uint32_t)lo | (uint32_t)hi << 16;
}

/* The value the REF code is taken of: v / s clamped to +-448 (the exact
 * path's expression), as v * rs with rs = 1/s: the same number, s being a
 * power of two whose reciprocal is normal (2^-22 <= s <= 2^120 for amax >=
 * 1e-4), and the same 0 or NaN when s is inf. */
static __device__ __forceinline__ float
f2_qin(float v, float rs)
{
    return cu_clampf(v * rs, 448.0f);
}

/* Copy block kb of the warp's 32 rows into a ring slot: chunk j = 4m + 2h
 * + c (tile m, row g + 8h, half c) of thread `lane` at slot[j*32 + lane]. */
static __device__ __forceinline__ void
f2_issue(uint4 *slot, const uint8_t *const (&wr)[2][2], int kb, int lane, int q)
{
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int c = 0; c < 2; c++)
                f2_cp16(slot + (4 * m + 2 * h + c) * 32 + lane,
                        wr[m][h] + (int64_t)kb * 128 + c * 64 + q * 16);
}

/* Two E4M3 codes (the low 16 bits of `two`, low byte first) -> f16x2. */
static __device__ __forceinline__ uint32_t
f2_h2(uint32_t two)
{
    return fk_e4m3x2(two);
}

/*
 * One block's sum blk (zeroed here) of the warp's two m16 tiles and NT
 * token tiles from the weight words wv (chunk j = 4m + 2h + c) and the
 * activation words xv[n][c] (token n*8 + g).  F16 = 0: m16n8k32 E4M3 with
 * each step's result added in fp32; F16 = 1: m16n8k16 on f16 conversions.
 */
template <int NT, int F16>
static __device__ __forceinline__ void
f2_block(float (&blk)[2][NT][4], const uint4 (&wv)[8], const uint4 (&xv)[NT][2])
{
    fk_zero(blk);
    if (!F16) {
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int m = 0; m < 2; m++) {
                int c = s / 2, e = 2 * (s % 2);
                uint32_t a0 = fk_word(wv[4 * m + c], e), a2 = fk_word(wv[4 * m + c], e + 1);
                uint32_t a1 = fk_word(wv[4 * m + 2 + c], e);
                uint32_t a3 = fk_word(wv[4 * m + 2 + c], e + 1);

#pragma unroll
                for (int n = 0; n < NT; n++) {
                    float d[4] = { 0.0f, 0.0f, 0.0f, 0.0f };

                    fk_mma_e4m3(d, a0, a1, a2, a3, fk_word(xv[n][c], e),
                                fk_word(xv[n][c], e + 1));
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        blk[m][n][i] += d[i];
                }
            }
    } else {
#pragma unroll
        for (int f = 0; f < 8; f++)
#pragma unroll
            for (int m = 0; m < 2; m++) {
                int c = f / 4, e = f % 4;
                uint32_t u0 = fk_word(wv[4 * m + c], e), u8 = fk_word(wv[4 * m + 2 + c], e);
                uint32_t a0 = f2_h2(u0), a2 = f2_h2(u0 >> 16);
                uint32_t a1 = f2_h2(u8), a3 = f2_h2(u8 >> 16);

#pragma unroll
                for (int n = 0; n < NT; n++) {
                    uint32_t b = fk_word(xv[n][c], e);

                    fk_mma_f16(blk[m][n], a0, a1, a2, a3, f2_h2(b), f2_h2(b >> 16));
                }
            }
    }
}

template <int NT, int F16>
static __global__ void __launch_bounds__(F2_MAXW * 32, 1)
f2_kernel(struct f2_args a)
{
    extern __shared__ __align__(16) unsigned char f2_sm[];
    cg::cluster_group cl = cg::this_cluster();
    const struct f2_smem L = f2_smem_for(a.KW, a.RW, a.range);
    int W = a.KW * a.RW, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int g = lane / 4, q = lane % 4, rw = warp % a.RW, kw = warp / a.RW;
    int RT = 32 * a.RW, cta_row = blockIdx.x * RT, row0 = cta_row + 32 * rw;
    int z = (int)cl.block_rank(), C = (int)cl.num_blocks();
    int cb0 = z * a.range, ncb = max(0, min(a.nb, cb0 + a.range) - cb0);
    int kb0 = cb0 + kw * a.bps, n_kb = max(0, min(a.nb, kb0 + a.bps) - kb0);
    int ntok = min(NT * 8, a.T - a.t0), wgi = row0 / 128 - cta_row / 128;
    uint4 *ring = (uint4 *)(f2_sm + L.ring) + warp * F2_STAGES * (F2_SLOT / 16);
    unsigned char *xq = f2_sm + L.xq;
    float *sx = (float *)(f2_sm + L.sx), *sw = (float *)(f2_sm + L.sw);
    float *part = (float *)(f2_sm + L.part);
    const uint8_t *wr[2][2];
    float acc[2][NT][4];

    /* 1. the first F2_STAGES weight blocks on their way */
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            wr[m][h] = a.w + (int64_t)(row0 + 16 * m + 8 * h + g) * a.K;
#pragma unroll
    for (int s = 0; s < F2_STAGES; s++) {
        if (s < n_kb)
            f2_issue(ring + s * (F2_SLOT / 16), wr, kb0 + s, lane, q);
        wg_cp_commit_mem();
    }

    /* 2. the pass's tokens over the CTA's blocks: a warp per (token, block),
     *    4 columns per lane, F2_QB items' loads issued before any is used;
     *    tokens past T are zero codes with scale 0 */
    for (int it0 = warp; it0 < NT * 8 * ncb; it0 += F2_QB * W) {
        float4 v[F2_QB];

#pragma unroll
        for (int u = 0; u < F2_QB; u++) {
            int it = it0 + u * W, tok = it / ncb, lb = it % ncb;

            v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (it < NT * 8 * ncb && tok < ntok)
                v[u] = __ldg((const float4 *)(a.x + (int64_t)(a.t0 + tok) * a.K +
                                              (int64_t)(cb0 + lb) * 128) + lane);
        }
#pragma unroll
        for (int u = 0; u < F2_QB; u++) {
            int it = it0 + u * W, tok = it / ncb, lb = it % ncb;
            float amax = 1e-4f, s = 0.0f, rs;
            uint32_t word = 0;

            if (it >= NT * 8 * ncb)
                break;   /* warp-uniform */
            if (tok < ntok) {
                amax = fmaxf(fmaxf(fmaxf(fmaxf(amax, fabsf(v[u].x)), fabsf(v[u].y)),
                                   fabsf(v[u].z)), fabsf(v[u].w));
                for (int o = 16; o > 0; o /= 2)
                    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                s = cu_pow2_scale(amax, 448.0f);
                rs = __frcp_rn(s);   /* exact: s is a power of two (or inf: 0) */
                word = f2_e4m3x4(f2_qin(v[u].x, rs), f2_qin(v[u].y, rs), f2_qin(v[u].z, rs),
                                 f2_qin(v[u].w, rs));
            }
            *(uint32_t *)(xq + tok * L.xs_stride + lb * 128 + lane * 4) = word;
            if (lane == 0)
                sx[tok * a.range + lb] = s;
        }
    }
    for (int i = threadIdx.x; i < (RT + 127) / 128 * ncb; i += blockDim.x) {
        int gi = i / ncb, lb = i % ncb;

        sw[gi * a.range + lb] = cu_e8m0_to_f32(a.ws[(int64_t)(cta_row / 128 + gi) * a.nb +
                                                     cb0 + lb]);
    }
    __syncthreads();

    /* 3. the warp's slice, block by block */
    fk_zero(acc);
    for (int i = 0; i < n_kb; i++) {
        int lb = kb0 + i - cb0;
        uint4 *slot = ring + (i % F2_STAGES) * (F2_SLOT / 16);
        uint4 wv[8], xv[NT][2];
        float blk[2][NT][4];

        wg_cp_wait_mem<F2_STAGES - 1>();   /* this thread's copies of block i are in */
#pragma unroll
        for (int j = 0; j < 8; j++)
            wv[j] = slot[j * 32 + lane];
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int c = 0; c < 2; c++)
                xv[n][c] = *(const uint4 *)(xq + (n * 8 + g) * L.xs_stride + lb * 128 +
                                            c * 64 + q * 16);
        f2_block<NT, F16>(blk, wv, xv);
#pragma unroll
        for (int m = 0; m < 2; m++) {
            float swv = sw[wgi * a.range + lb];

#pragma unroll
            for (int n = 0; n < NT; n++) {
                float f0 = sx[(n * 8 + 2 * q) * a.range + lb] * swv;
                float f1 = sx[(n * 8 + 2 * q + 1) * a.range + lb] * swv;

                acc[m][n][0] += blk[m][n][0] * f0;
                acc[m][n][1] += blk[m][n][1] * f1;
                acc[m][n][2] += blk[m][n][2] * f0;
                acc[m][n][3] += blk[m][n][3] * f1;
            }
        }
        /* the slot's words are in registers and consumed: refill it */
        if (i + F2_STAGES < n_kb)
            f2_issue(slot, wr, kb0 + i + F2_STAGES, lane, q);
        wg_cp_commit_mem();
    }
    wg_cp_wait_mem<0>();

    /* 4. slices: the warp's partial -> part[kw][tok][row]; the CTA's KW
     *    slices added in order into part[0] */
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int r = 32 * rw + 16 * m + g + 8 * (i >> 1), tok = n * 8 + 2 * q + (i & 1);

                part[(kw * F2_TOK + tok) * L.rtp + r] = acc[m][n][i];
            }
    __syncthreads();
    if (a.KW > 1)
        for (int e = threadIdx.x; e < ntok * RT; e += blockDim.x) {
            int tok = e / RT, r = e % RT;
            float v = part[tok * L.rtp + r];

            for (int k = 1; k < a.KW; k++)
                v += part[(k * F2_TOK + tok) * L.rtp + r];
            part[tok * L.rtp + r] = v;
        }
    cl.sync();

    /* 5. rank z finishes rows z*RT/C ..: the C CTA sums in rank order */
    {
        int rs = RT / C;

        for (int e = threadIdx.x; e < ntok * rs; e += blockDim.x) {
            int tok = e / rs, r = z * rs + e % rs;
            float v = part[tok * L.rtp + r];

            if (C > 1) {
                v = cl.map_shared_rank(part, 0)[tok * L.rtp + r];
                for (int p = 1; p < C; p++)
                    v += cl.map_shared_rank(part, p)[tok * L.rtp + r];
            }
            a.out[(int64_t)(a.t0 + tok) * a.N + cta_row + r] = cu_bf16_round(v);
        }
    }
    cl.sync();   /* peers read this CTA's part until here */
}

/* --- host side ----------------------------------------------------------------------- */

/* DSV4_CUDA_LINEAR: "v1" or unset (0: v1), "v2" (1: E4M3 mma), "v2h" (2:
 * f16 mma), optionally ":MAXC:WANT" after v2/v2h (cluster size at most
 * 1, 2, 4 or 8; warps wanted); read at every call (the benchmark switches). */
static int
f2_env(int *maxc, int *want)
{
    const char *v = getenv("DSV4_CUDA_LINEAR");
    int var, n = 0, mc, wn;

    *maxc = F2_MAXC;
    *want = F2_WANT;
    if (v == NULL)
        return 0;
    if (strncmp(v, "v2h", 3) == 0)
        var = 2, n = 3;
    else if (strncmp(v, "v2", 2) == 0)
        var = 1, n = 2;
    else
        return 0;
    if (v[n] == ':' && sscanf(v + n + 1, "%d:%d", &mc, &wn) == 2 &&
        (mc == 1 || mc == 2 || mc == 4 || mc == 8) && wn >= 1 && wn <= 65536) {
        *maxc = mc;
        *want = wn;
    }
    return var;
}

int
cuda_fast_linear2_variant(const struct dsv4_backend *be, const struct dsv4_linear *W,
                          const float *x)
{
    struct f2_plan p;
    int maxc, want, var = f2_env(&maxc, &want);

    if (var == 0 || be->numerics != DSV4_NUMERICS_REF || W->fmt != DSV4_WFMT_FP8 ||
        W->w == NULL || W->scale == NULL || W->n_out <= 0 || W->n_out % 32 != 0 ||
        W->n_in <= 0 || W->n_in % 128 != 0 || (uintptr_t)W->w % 16 != 0 ||
        (uintptr_t)x % 16 != 0)
        return 0;
    if (!f2_plan_for(&p, W->n_out, W->n_in, maxc, want) ||
        f2_smem_for(p.KW, p.RW, p.range).total > F2_SMEM_MAX)
        return 0;
    return var;
}

template <int NT, int F16>
static enum dsv4_err
f2_launch(struct dsv4_backend *be, const struct f2_args &a, const struct f2_plan &p,
          size_t smem)
{
    static unsigned char attr_set[F2_MAX_DEV];
    int dev = cuda_st(be)->device;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1] = {};

    if (dev < 0 || dev >= F2_MAX_DEV || !attr_set[dev]) {
        int most = 0;

        CUDA_TRY(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
        CUDA_TRY(cudaFuncSetAttribute(f2_kernel<NT, F16>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, most));
        if (dev >= 0 && dev < F2_MAX_DEV)
            attr_set[dev] = 1;
    }
    cfg.gridDim = dim3((unsigned)(a.N / (32 * p.RW)), (unsigned)p.C, 1);
    cfg.blockDim = dim3((unsigned)(32 * p.KW * p.RW), 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = cuda_stream(be);
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = 1;
    at[0].val.clusterDim.y = (unsigned)p.C;
    at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CUDA_TRY(cudaLaunchKernelEx(&cfg, f2_kernel<NT, F16>, a));
    return DSV4_OK;
}

enum dsv4_err
cuda_fast_linear2(struct dsv4_backend *be, float *out, const float *x,
                  const struct dsv4_linear *W, int T, int variant)
{
    struct f2_plan p;
    struct f2_smem L;
    struct f2_args a;
    int maxc, want;

    (void)f2_env(&maxc, &want);
    if (!f2_plan_for(&p, W->n_out, W->n_in, maxc, want))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda fast linear v2: %d x %d", W->n_out,
                            W->n_in);
    L = f2_smem_for(p.KW, p.RW, p.range);
    a.w = (const uint8_t *)W->w;
    a.ws = W->scale;
    a.x = x;
    a.out = out;
    a.T = T;
    a.N = W->n_out;
    a.K = W->n_in;
    a.nb = p.nb;
    a.bps = p.bps;
    a.KW = p.KW;
    a.RW = p.RW;
    a.range = p.range;
    for (a.t0 = 0; a.t0 < T; a.t0 += F2_TOK) {
        int one = T - a.t0 <= 8;
        enum dsv4_err e = variant == 2 ? (one ? f2_launch<1, 1>(be, a, p, L.total)
                                              : f2_launch<2, 1>(be, a, p, L.total))
                                       : (one ? f2_launch<1, 0>(be, a, p, L.total)
                                              : f2_launch<2, 0>(be, a, p, L.total));

        if (e != DSV4_OK)
            return e;
    }
    return DSV4_OK;
}

/* --- self-check ---------------------------------------------------------------------- */

/*
 * One warp: D (16 x 8) = A (16 x 32, row-major E4M3 bytes) * B (32 x 8,
 * given as Bt: 8 rows of 32 k bytes) through fk_mma_e4m3, the fragments
 * loaded as its comment says; d_f16 the same product through the v2h path
 * (f16 conversions, two m16n8k16).
 */
static __global__ void
f2_tile_kernel(float *d8, float *d16, const uint8_t *A, const uint8_t *Bt)
{
    int lane = threadIdx.x, g = lane / 4, q = lane % 4;
    uint32_t a0 = *(const uint32_t *)(A + g * 32 + 4 * q);
    uint32_t a1 = *(const uint32_t *)(A + (g + 8) * 32 + 4 * q);
    uint32_t a2 = *(const uint32_t *)(A + g * 32 + 16 + 4 * q);
    uint32_t a3 = *(const uint32_t *)(A + (g + 8) * 32 + 16 + 4 * q);
    uint32_t b0 = *(const uint32_t *)(Bt + g * 32 + 4 * q);
    uint32_t b1 = *(const uint32_t *)(Bt + g * 32 + 16 + 4 * q);
    float d[4] = { 0.0f, 0.0f, 0.0f, 0.0f }, h[4] = { 0.0f, 0.0f, 0.0f, 0.0f };

    fk_mma_e4m3(d, a0, a1, a2, a3, b0, b1);
    /* f16: k 0..15 then 16..31; thread q holds k 2q, 2q+1 and 2q+8, 2q+9 */
    for (int half = 0; half < 2; half++) {
        int k0 = 16 * half;
        uint32_t x0 = A[g * 32 + k0 + 2 * q] | (uint32_t)A[g * 32 + k0 + 2 * q + 1] << 8;
        uint32_t x1 = A[(g + 8) * 32 + k0 + 2 * q] |
                      (uint32_t)A[(g + 8) * 32 + k0 + 2 * q + 1] << 8;
        uint32_t x2 = A[g * 32 + k0 + 8 + 2 * q] | (uint32_t)A[g * 32 + k0 + 9 + 2 * q] << 8;
        uint32_t x3 = A[(g + 8) * 32 + k0 + 8 + 2 * q] |
                      (uint32_t)A[(g + 8) * 32 + k0 + 9 + 2 * q] << 8;
        uint32_t y0 = Bt[g * 32 + k0 + 2 * q] | (uint32_t)Bt[g * 32 + k0 + 2 * q + 1] << 8;
        uint32_t y1 = Bt[g * 32 + k0 + 8 + 2 * q] | (uint32_t)Bt[g * 32 + k0 + 9 + 2 * q] << 8;

        fk_mma_f16(h, f2_h2(x0), f2_h2(x1), f2_h2(x2), f2_h2(x3), f2_h2(y0), f2_h2(y1));
    }
    for (int i = 0; i < 4; i++) {
        int r = g + 8 * (i >> 1), c = 2 * q + (i & 1);

        d8[r * 8 + c] = d[i];
        d16[r * 8 + c] = h[i];
    }
}

/* Quantizer check: bad[i] = 1 when the hardware code of v[i] (after the
 * clamp) differs from cu_f32_to_fp8's, or v[i] * (1/s) from v[i] / s for
 * the power of two s = 2^(i % 143 - 22) (f2_qin's claim). */
static __global__ void
f2_codes_kernel(int *bad, const float *v, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;

    if (i < n) {
        float c = cu_clampf(v[i], 448.0f), s = ldexpf(1.0f, i % 143 - 22);
        uint32_t hw = f2_e4m3x4(c, 0.0f, 0.0f, 0.0f) & 0xffu;

        bad[i] = hw != cu_f32_to_fp8(c) ||
                 __float_as_uint(f2_qin(v[i], __frcp_rn(s))) !=
                     __float_as_uint(cu_clampf(v[i] / s, 448.0f));
    }
}

/* Host: D = A * B in double from the E4M3 values. */
static void
f2_tile_ref(double *ref, double *mag, const uint8_t *A, const uint8_t *Bt)
{
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 8; c++) {
            double s = 0, m = 0;

            for (int k = 0; k < 32; k++) {
                double p = (double)dsv4_fp8_to_f32(A[r * 32 + k]) *
                           dsv4_fp8_to_f32(Bt[c * 32 + k]);

                s += p;
                m += fabs(p);
            }
            ref[r * 8 + c] = s;
            mag[r * 8 + c] = m;
        }
}

/* Small deterministic generator for the self-check inputs. */
static uint32_t
f2_rand(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(*s >> 33);
}

/* E4M3 code of an integer-valued random number in -8..8 (exact sums). */
static uint8_t
f2_small_code(uint64_t *s)
{
    int v = (int)(f2_rand(s) % 17) - 8;

    return dsv4_f32_to_fp8((float)v);
}

/* A code with random sign, exponent and mantissa, not NaN. */
static uint8_t
f2_any_code(uint64_t *s)
{
    uint8_t c = (uint8_t)f2_rand(s);

    return (c & 0x7f) == 0x7f ? (uint8_t)(c ^ 1) : c;
}

#define F2_NCODES (1 << 20)

int
dsv4_cuda_linear_selftest(struct dsv4_backend *be, char *msg, size_t len)
{
    uint8_t hA[512], hB[256], *dA = NULL, *dB = NULL;
    float *dd = NULL, *dv = NULL, h8[128], h16[128], *hv = NULL;
    int *dbad = NULL, *hbad = NULL, fail = 0, nbad = 0, first_bad = -1;
    double ref[128], mag[128], worst8 = 0, worst16 = 0;
    uint64_t seed = 20261201;
    size_t at = 0;
    cudaStream_t st;

    if (be == NULL || strcmp(be->name, "cuda") != 0)
        return -1;
    st = cuda_stream(be);
    hv = (float *)malloc(F2_NCODES * sizeof(float));
    hbad = (int *)malloc(F2_NCODES * sizeof(int));
    if (hv == NULL || hbad == NULL ||
        cudaMalloc(&dA, sizeof(hA)) != cudaSuccess || cudaMalloc(&dB, sizeof(hB)) != cudaSuccess ||
        cudaMalloc(&dd, 256 * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&dv, F2_NCODES * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&dbad, F2_NCODES * sizeof(int)) != cudaSuccess) {
        fail = -1;
        goto out;
    }
    /* 1. layout: integer values, exact sums: the mma must give them exactly;
     * 2. precision: random codes, error relative to the sum of |products| */
    for (int round = 0; round < 2 && fail >= 0; round++) {
        double worst = 0;
        int first = -1;

        for (int i = 0; i < 512; i++)
            hA[i] = round == 0 ? f2_small_code(&seed) : f2_any_code(&seed);
        for (int i = 0; i < 256; i++)
            hB[i] = round == 0 ? f2_small_code(&seed) : f2_any_code(&seed);
        f2_tile_ref(ref, mag, hA, hB);
        if (cudaMemcpyAsync(dA, hA, sizeof(hA), cudaMemcpyHostToDevice, st) != cudaSuccess ||
            cudaMemcpyAsync(dB, hB, sizeof(hB), cudaMemcpyHostToDevice, st) != cudaSuccess) {
            fail = -1;
            break;
        }
        f2_tile_kernel<<<1, 32, 0, st>>>(dd, dd + 128, dA, dB);
        if (cudaMemcpyAsync(h8, dd, sizeof(h8), cudaMemcpyDeviceToHost, st) != cudaSuccess ||
            cudaMemcpyAsync(h16, dd + 128, sizeof(h16), cudaMemcpyDeviceToHost, st) !=
                cudaSuccess ||
            cudaStreamSynchronize(st) != cudaSuccess) {
            fail = -1;
            break;
        }
        for (int i = 0; i < 128; i++) {
            double e8 = fabs(h8[i] - ref[i]) / (mag[i] > 0 ? mag[i] : 1);
            double e16 = fabs(h16[i] - ref[i]) / (mag[i] > 0 ? mag[i] : 1);

            if (round == 0 && (h8[i] != ref[i] || h16[i] != ref[i]) && first < 0)
                first = i;
            worst = e8 > worst ? e8 : worst;
            if (round == 1) {
                worst8 = e8 > worst8 ? e8 : worst8;
                worst16 = e16 > worst16 ? e16 : worst16;
            }
        }
        if (round == 0) {
            if (first >= 0)
                fail = 1;
            at += (size_t)snprintf(msg + at, at < len ? len - at : 0,
                                   "%s mma fragment layout (16x32 e4m3 tile, integer values): %s",
                                   first < 0 ? "ok  " : "FAIL", first < 0 ? "exact" : "");
            if (first >= 0)
                at += (size_t)snprintf(msg + at, at < len ? len - at : 0,
                                       "first mismatch D[%d][%d]: e4m3 mma %.9g f16 mma %.9g "
                                       "scalar %.9g",
                                       first / 8, first % 8, h8[first], h16[first],
                                       ref[first]);
            at += (size_t)snprintf(msg + at, at < len ? len - at : 0, "\n");
        }
    }
    if (fail >= 0)
        at += (size_t)snprintf(msg + at, at < len ? len - at : 0,
                               "info random e4m3 tile: max |mma - exact| / sum |products|: "
                               "e4m3 mma %.2e (2^%.1f), f16 mma %.2e\n",
                               worst8, worst8 > 0 ? log2(worst8) : -999.0, worst16);
    /* 3. the quantizer's hardware codes against cu_f32_to_fp8: every
     * exponent of the E4M3 range and around it, ties, subnormals, signs */
    if (fail >= 0) {
        for (int i = 0; i < F2_NCODES; i++) {
            uint32_t r = f2_rand(&seed);
            int ex = (int)(i % 40) - 25;   /* 2^-25 .. 2^14 */
            float m = 1.0f + (float)(r & 0xffff) / 65536.0f;

            if (i % 7 == 0)   /* a tie: halfway between two codes of its binade */
                m = 1.0f + (float)((r & 7) * 2 + 1) / 16.0f;
            hv[i] = ldexpf(m, ex) * ((r >> 20) & 1 ? -1.0f : 1.0f);
        }
        hv[0] = 0.0f;
        hv[1] = -0.0f;
        hv[2] = 448.0f;
        hv[3] = 464.0f;
        hv[4] = 0x1p-9f;
        hv[5] = 0x1p-10f;
        hv[6] = 3 * 0x1p-10f;
        if (cudaMemcpyAsync(dv, hv, F2_NCODES * sizeof(float), cudaMemcpyHostToDevice, st) !=
                cudaSuccess)
            fail = -1;
        else
            f2_codes_kernel<<<F2_NCODES / 256, 256, 0, st>>>(dbad, dv, F2_NCODES);
        if (fail >= 0 && (cudaMemcpyAsync(hbad, dbad, F2_NCODES * sizeof(int),
                                          cudaMemcpyDeviceToHost, st) != cudaSuccess ||
                          cudaStreamSynchronize(st) != cudaSuccess))
            fail = -1;
        for (int i = 0; fail >= 0 && i < F2_NCODES; i++)
            if (hbad[i]) {
                nbad++;
                if (first_bad < 0)
                    first_bad = i;
            }
        if (fail >= 0) {
            if (nbad > 0)
                fail = 1;
            at += (size_t)snprintf(msg + at, at < len ? len - at : 0,
                                   "%s quantizer (cvt.rn.satfinite vs cu_f32_to_fp8, v * 1/s vs "
                                   "v / s; %d values): %d differ",
                                   nbad ? "FAIL" : "ok  ", F2_NCODES, nbad);
            if (first_bad >= 0)
                at += (size_t)snprintf(msg + at, at < len ? len - at : 0,
                                       ", first %.9g (index %d)", hv[first_bad], first_bad);
            at += (size_t)snprintf(msg + at, at < len ? len - at : 0, "\n");
        }
    }
out:
    if (fail < 0)
        (void)snprintf(msg + at, at < len ? len - at : 0, "FAIL self-check: CUDA error %s\n",
                       cudaGetErrorString(cudaGetLastError()));
    cudaFree(dA);
    cudaFree(dB);
    cudaFree(dd);
    cudaFree(dv);
    cudaFree(dbad);
    free(hv);
    free(hbad);
    return fail;
}
