/*
 * fast_gemm8.cu — the FP8 x FP8 prefill linear (the default on sm_90;
 * DSV4_CUDA_GEMM8=0 or dsv4_cuda_set_gemm8(0) keeps fw_kernel;
 * kernels/cuda_gemm8.h).  fw_kernel (fast_gemm.cu)
 * decodes every FP8 weight into bf16 registers once per token tile; here
 * both operands stay E4M3 codes in shared memory and the tensor cores take
 * them as they are (wgmma m64n128k32 .f32.e4m3.e4m3), DeepGEMM-style.
 *
 * Operands.  A = the weights (M: 128 rows per CTA, 64 per consumer
 * warpgroup), rows of W as stored (K-major); B = the activations' REF E4M3
 * codes (N: a tile of 128 tokens), K-major, from g8_prep_kernel: per token
 * and 128-column block the exact path's quantization (amax from 1e-4,
 * s_x = 2^ceil(log2(amax / 448)), code = e4m3(clamp(x / s_x, 448))), the
 * same codes and scales as fw_prep_kernel's mode 0.
 *
 * Shared memory.  A ring of G8_S stages of one 128-column block each: A
 * (128 weight rows x 128 bytes), B (128 tokens x 128 bytes), the tokens'
 * s_x (128 floats).  A and B rows are 128 bytes at row * 128, 16-byte chunk
 * c of a row stored at chunk c ^ (row & 7): the 128-byte swizzle pattern
 * (address bits 4-6 XOR bits 7-9) on 1024-byte aligned stages.  wgmma
 * descriptor (PTX ISA "Matrix Descriptor Format", K-major, 128B swizzle):
 * start >> 4 in bits 0-13, LBO 1 (unused for swizzled K-major), SBO = 1024
 * >> 4 (next 8 rows) in bits 32-45, base offset 0, layout 1 (128B swizzle)
 * in bits 62-63; k32 step s of a stage starts 32 * s bytes into it (the
 * hardware swizzles the full address, so this addresses logical chunks
 * 2s, 2s+1 of every row).  Consumer warpgroup g's A starts at row 64 g
 * (8192 bytes, a multiple of 1024).
 *
 * Warps.  384 threads: warpgroups 0 and 1 consume (64 weight rows x 128
 * tokens each), warpgroup 2 produces: per stage it waits until the stage's
 * previous block is used up (mbarrier `empty`, 256 arrivals), queues the
 * stage's cp.async copies (16 per thread), and G8_LAG stages later, when
 * cp.async.wait_group says they landed, makes them visible to the async
 * proxy (fence.proxy.async) and arrives at the stage's `full` mbarrier (128
 * arrivals).  Consumers wait on `full`, issue the block's 4 wgmma (scale-d
 * 0 on the first: a fresh fp32 partial per block), wait for them, add the
 * partial scaled (one fma a value), and arrive at `empty`.
 *
 * Tiles.  The grid is persistent: min(tiles, SMs) CTAs, CTA b taking tiles
 * b, b + grid, ...; the ring's blocks are counted across a CTA's tiles, so
 * the producer queues the next tile's first blocks while the consumers
 * finish a tile and store it.  With K = 1,024 (wq_b: 8 blocks a tile) a
 * CTA a tile spent a fifth of its time filling the ring and storing (one
 * CTA an SM: nothing overlapped them); docs/perf.md run 45.  Token tiles
 * vary fastest (g8_tile), so the CTAs running at one time share a few
 * weight tiles.  Under MPS (cuda_mps) the grid stays a CTA a tile: a
 * client may get only a share of the SMs (a prefill rank's
 * mps_sm_percent), and a grid of one CTA a device SM, each with a fixed
 * list of tiles, would then run in two waves.
 *
 * Numerics (REF).  Per 128-column block the tensor cores sum the 128
 * products of codes (exact) into blk (fp32; Hopper's FP8 accumulation is of
 * reduced precision inside an instruction, so no partial spans more than
 * one block), then acc += blk * (s_w * s_x) in fp32 (both scales powers of
 * two: the product is exact), blocks in increasing order: the op
 * contract's per-block scaling, another order inside a block.  Output
 * out[token][row] = bf16-rounded acc, as fw_kernel's FG_LINEAR epilogue.
 * Each output depends on its own weight row and token only, and a token
 * sits at the same column (token mod 128) of its tile at every T, so the
 * bits do not depend on T; they may differ from fw_kernel's (one fp32 sum
 * over all of K) by rounding.  Only calls of T > 64 rows come here (the
 * caller's FG_DECODE_ROWS rule).
 *
 * cuBLASLt (the default where it can take the shape: kernels/cuda/
 * fast_blas.cu, switched with the other cuBLASLt paths, DSV4_CUDA_BLAS /
 * dsv4_cuda_set_blas, and alone with DSV4_CUDA_BLAS_FP8=0).  cuBLASLt 12.9+ multiplies E4M3 operands with the
 * same scaling on sm_90: the weights' scales as 128 x 128 blocks, x's one
 * per token and 128 columns (both fp32), each 128-column block's products
 * summed by the tensor cores and scaled into fp32 accumulators.  g8_blas
 * prepares x with g8_prep_kernel (the same codes and scales), writing the
 * scales column-major (K / 128, T') for T' = T rounded up to BL_FP8_ROWS
 * with zero rows after T, and the weights' E8M0 scales as fp32 values in
 * the same launch; cuBLASLt writes bf16 (its rounding of the fp32 sums),
 * widened into out.  Measured on the H200 (docs/perf.md run 48), the op
 * at 2,048 tokens with preparation and widening: wq_b (32,768 x 1,024)
 * 283.7 -> 243.9 us, wo_b (4,096 x 8,192) 255.9 -> 172.8 us.  The scales'
 * layouts were found with a probe (docs/gpu.md "FP8 linears on
 * cuBLASLt").  The same algorithm serves every
 * T (chosen once at 2,048 columns, no split-K), so a row's bits do not
 * depend on T; they may differ from g8_kernel's (another order inside a
 * block, the same fp32 sum across blocks in order or not: cuBLASLt does
 * not say).
 *
 * Accumulator fragment (m64nNk32 has m64nNk16's D layout): thread lane
 * (g = lane / 4, q = lane % 4) of warp w in its warpgroup holds, in
 * d[4 j + i], weight row 16 w + g + 8 (i / 2) of the warpgroup's 64 and
 * token 8 j + 2 q + (i % 2) of the tile.
 */
#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda/fast.cuh"   /* fk_quant2 */
#include "kernels/cuda/fast_wgmma.cuh"
#include "kernels/cuda_gemm8.h"

#include <stdlib.h>
#include <string.h>

#define G8_BM 128                  /* weight rows per CTA */
#define G8_BN 128                  /* tokens per CTA */
#define G8_S 6                     /* stages in the ring */
#define G8_LAG (G8_S - 2)          /* stages the producer keeps in flight unsignalled */
#define G8_THREADS 384             /* 2 consumer warpgroups + 1 producer warpgroup */
#define G8_STAGE_A (G8_BM * 128)   /* bytes */
#define G8_STAGE_B (G8_BN * 128)
#define G8_SMEM (1024 + G8_S * (G8_STAGE_A + G8_STAGE_B) + G8_S * G8_BN * 4 + 2 * G8_S * 8)

/* Arguments of a launch, by value. */
struct g8_args {
    const uint8_t *w;        /* (N, K) E4M3 weights */
    const uint8_t *ws;       /* (N / 128, K / 128) E8M0 block scales */
    const uint8_t *xq;       /* (T, K) E4M3 activation codes */
    const float *sx;         /* (T, K / 128) their scales */
    float *out;              /* (T, N) */
    int T, N, K;
};

/*
 * Codes and scales of x (rows, K) per 128-column block, the exact path's
 * quantization (see the file comment): a warp per G8_PREP_BLOCKS blocks of
 * a row, lane l taking columns 4l .. 4l + 3 of each (one 16-byte load, one
 * 4-byte store of codes), every block's loads issued before the first
 * block's amax (0.58 -> 0.53 ms in a 4-layer 2,048-token prefill against a
 * warp per block; docs/perf.md run 45).
 */
#define G8_PREP_BLOCKS 4

/* Where the scales of x go and what else a launch does: the cuBLASLt form
 * (g8_blas) wants them column-major (nb, ldt), zero rows rows .. ldt - 1
 * (codes and scales) and the weights' E8M0 block scales as fp32 values. */
struct g8_prep_more {
    int ldt;                 /* 0: sx (rows, nb) row-major; else sx (nb, ldt) */
    float *wsf;              /* (nws) fp32 values of ws, or NULL */
    const uint8_t *ws;
    int nws;
};

/* g8_kernel's form: scales row-major, nothing else. */
static const struct g8_prep_more g8_row_major = { 0, NULL, NULL, 0 };

static __global__ void
g8_prep_kernel(uint8_t *xq, float *sx, const float *x, int rows, int K, struct g8_prep_more mo)
{
    int nb = K / 128, lane = threadIdx.x & 31, ng = (nb + G8_PREP_BLOCKS - 1) / G8_PREP_BLOCKS;
    int64_t wid = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
    int64_t r = wid / ng, rpad = mo.ldt > rows ? mo.ldt : rows;
    int b0 = (int)(wid % ng) * G8_PREP_BLOCKS;
    float4 v[G8_PREP_BLOCKS];

    if (r >= rows) {   /* whole warps: padding rows, then the weights' scales */
        if (r < rpad) {
            for (int j = 0; j < G8_PREP_BLOCKS && b0 + j < nb; j++) {
                *(uint32_t *)(xq + r * K + (int64_t)(b0 + j) * 128 + 4 * lane) = 0;
                if (lane == 0)
                    sx[(int64_t)(b0 + j) * mo.ldt + r] = 0.0f;
            }
        } else if (mo.wsf != NULL) {
            int64_t i = (wid - rpad * ng) * 32 + lane;

            if (i < mo.nws)
                mo.wsf[i] = cu_e8m0_to_f32(mo.ws[i]);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < G8_PREP_BLOCKS; j++)
        if (b0 + j < nb) {
            const float *p = x + r * K + (int64_t)(b0 + j) * 128 + 4 * lane;

            if (((uintptr_t)x & 15) == 0)   /* K is a multiple of 128: every p aligned */
                v[j] = *(const float4 *)p;
            else
                v[j] = make_float4(p[0], p[1], p[2], p[3]);
        }
#pragma unroll
    for (int j = 0; j < G8_PREP_BLOCKS; j++) {
        float amax = 1e-4f, s;
        uint32_t q;

        if (b0 + j >= nb)
            break;
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[j].x), fabsf(v[j].y)),
                                 fmaxf(fabsf(v[j].z), fabsf(v[j].w))));
        for (int o = 16; o > 0; o /= 2)
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        s = cu_pow2_scale(amax, 448.0f);
        {
            /* the hardware's conversion (fk_quant2: cu_f32_to_fp8's codes of
             * the clamped v / s, NaN 0x7f; v / s as v * (1 / s), s a power
             * of two or inf) instead of a division and the software rounding
             * a value (docs/perf.md run 57) */
            uint16_t c01, c23;

            (void)fk_quant2(v[j].x, v[j].y, 1.0f / s, &c01);
            (void)fk_quant2(v[j].z, v[j].w, 1.0f / s, &c23);
            q = (uint32_t)c01 | (uint32_t)c23 << 16;
        }
        *(uint32_t *)(xq + r * K + (int64_t)(b0 + j) * 128 + 4 * lane) = q;
        if (lane == 0)
            sx[mo.ldt > 0 ? (int64_t)(b0 + j) * mo.ldt + r : r * nb + b0 + j] = s;
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* --- cp.async, wgmma (the mbarriers: fast_wgmma.cuh) ------------------------------ */

/* 16 bytes global -> shared; valid == 0: the 16 bytes are zeroed (src not read). */
static __device__ __forceinline__ void
g8_cp16(uint32_t dst, const void *src, int valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

/* 4 bytes, the same way. */
static __device__ __forceinline__ void
g8_cp4(uint32_t dst, const void *src, int valid)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

/* d (64 x 128, fp32) = (acc ? d : 0) + A (64 x 32 E4M3 at da) * B (32 x 128 E4M3 at db). */
static __device__ __forceinline__ void
g8_mma(float (&d)[64], uint64_t da, uint64_t db, int acc)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                 "{"
                 WG_R64
                 "}, %64, %65, p, 1, 1;\n"
                 "}\n"
                 : WG_D64(d)
                 : "l"(da), "l"(db), "r"(acc));
}

/* Producer thread p (0..127): queue block kb's copies into the stage at sa, sb, ss. */
static __device__ __forceinline__ void
g8_load(const struct g8_args &a, int p, int n0, int t0, int kb, uint32_t sa, uint32_t sb,
        uint32_t ss)
{
    int nb = a.K / 128;

#pragma unroll
    for (int i = 0; i < G8_BM * 8 / 128; i++) {
        int idx = p + 128 * i, r = idx >> 3, c = idx & 7;

        g8_cp16(sa + wg_off_sw128(r, c), a.w + (int64_t)(n0 + r) * a.K + kb * 128 + c * 16, 1);
    }
#pragma unroll
    for (int i = 0; i < G8_BN * 8 / 128; i++) {
        int idx = p + 128 * i, r = idx >> 3, c = idx & 7, ok = t0 + r < a.T;

        g8_cp16(sb + wg_off_sw128(r, c),
                a.xq + (int64_t)(ok ? t0 + r : 0) * a.K + kb * 128 + c * 16, ok);
    }
    {
        int ok = t0 + p < a.T;

        g8_cp4(ss + 4 * p, a.sx + (int64_t)(ok ? t0 + p : 0) * nb + kb, ok);
    }
}

/* acc += blk * (s_w * s_x) for the block whose token scales are at sxt (one
 * fma a value: blk * s_w * s_x is exact, both scales being powers of two, so
 * the fused form rounds as the product's sum would, short of a product below
 * 2^-126). */
static __device__ __forceinline__ void
g8_promote(float (&acc)[64], const float (&blk)[64], float sw, const float *sxt, int q)
{
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int ii = 0; ii < 2; ii++) {
            float f = sw * sxt[8 * j + 2 * q + ii];

            acc[4 * j + ii] = __fmaf_rn(blk[4 * j + ii], f, acc[4 * j + ii]);
            acc[4 * j + 2 + ii] = __fmaf_rn(blk[4 * j + 2 + ii], f, acc[4 * j + 2 + ii]);
        }
}

/* Wait for block `it` of the ring and issue its 4 wgmma into blk (one group). */
static __device__ __forceinline__ void
g8_issue(float (&blk)[64], uint32_t sa, uint32_t sb, uint32_t full, int wg, int it)
{
    int st = it % G8_S;
    uint32_t a0 = sa + st * G8_STAGE_A + wg * 64 * 128, b0 = sb + st * G8_STAGE_B;

    wg_bar_wait(full + 8 * st, (uint32_t)((it / G8_S) & 1));
    wg_fence();
#pragma unroll
    for (int s = 0; s < 4; s++)
        g8_mma(blk, wg_desc_sw128(a0 + 32 * s), wg_desc_sw128(b0 + 32 * s), s);
    wg_commit();
}

/* out[token][row] = bf16(acc) of the consumer thread's values of tile (n0, t0). */
static __device__ __forceinline__ void
g8_store(const struct g8_args &a, const float (&acc)[64], int n0, int t0, int wg, int warp,
         int g, int q)
{
    /* a whole tile stores without a test per value */
    float *o = a.out + (int64_t)(t0 + 2 * q) * a.N + n0 + wg * 64 + warp * 16 + g;
    int whole = t0 + G8_BN <= a.T;

#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int dt = 8 * j + (i & 1);

            if (whole || t0 + 2 * q + dt < a.T)
                o[(int64_t)dt * a.N + 8 * (i >> 1)] = cu_bf16_round(acc[4 * j + i]);
        }
}

/*
 * Tile u of a call: token tile u % nT (nT = ceil(T / 128)), weight row tile
 * u / nT.  Token tiles vary fastest, so the CTAs running at one time share
 * a few weight tiles (read from DRAM once, then from L2) and the whole
 * activation matrix (T x K bytes, small), instead of sweeping all weights
 * once per token tile.
 */
static __device__ __forceinline__ void
g8_tile(const struct g8_args &a, int u, int *n0, int *t0)
{
    int nT = (a.T + G8_BN - 1) / G8_BN;

    *n0 = (u / nT) * G8_BM;
    *t0 = (u % nT) * G8_BN;
}

#endif   /* __CUDA_ARCH_FEAT_SM90_ALL */

/*
 * Persistent grid of min(tiles, SMs) CTAs; CTA b takes tiles b, b + grid,
 * ...  The ring's blocks are counted across the CTA's tiles (it), so the
 * producer queues the next tile's first blocks while the consumers finish
 * the current one and write its outputs.
 */
static __global__ void __launch_bounds__(G8_THREADS, 1)
g8_kernel(struct g8_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char g8_sm[];
    uint32_t base = (uint32_t)__cvta_generic_to_shared(g8_sm);
    uint32_t pad = (1024u - (base & 1023u)) & 1023u;
    uint32_t sa = base + pad, sb = sa + G8_S * G8_STAGE_A, ss = sb + G8_S * G8_STAGE_B;
    uint32_t full = ss + G8_S * G8_BN * 4, empty = full + 8 * G8_S;
    const float *sxs = (const float *)(g8_sm + pad + G8_S * (G8_STAGE_A + G8_STAGE_B));
    int tid = threadIdx.x, wg = tid >> 7, nkt = a.K / 128;
    int ntiles = (a.N / G8_BM) * ((a.T + G8_BN - 1) / G8_BN);

    if (tid == 0) {
        for (int s = 0; s < G8_S; s++) {
            wg_bar_init(full + 8 * s, 128);
            wg_bar_init(empty + 8 * s, 256);
        }
    }
    __syncthreads();

    if (wg == 2) {
        /* producer: block `it` of the CTA's sequence goes to stage it % S */
        int p = tid - 256, it = 0;

        for (int u = blockIdx.x; u < ntiles; u += gridDim.x) {
            int n0, t0;

            g8_tile(a, u, &n0, &t0);
            for (int kt = 0; kt < nkt; kt++, it++) {
                int st = it % G8_S;

                if (it >= G8_S)
                    wg_bar_wait(empty + 8 * st, (uint32_t)((it / G8_S - 1) & 1));
                g8_load(a, p, n0, t0, kt, sa + st * G8_STAGE_A, sb + st * G8_STAGE_B,
                        ss + st * G8_BN * 4);
                wg_cp_commit_mem();
                if (it >= G8_LAG) {
                    /* block it - LAG (and all before it) landed */
                    wg_cp_wait_mem<G8_LAG>();
                    wg_fence_proxy();
                    wg_bar_arrive(full + 8 * ((it - G8_LAG) % G8_S));
                }
            }
        }
        wg_cp_wait_mem<0>();
        wg_fence_proxy();
        for (int j = it - G8_LAG > 0 ? it - G8_LAG : 0; j < it; j++)
            wg_bar_arrive(full + 8 * (j % G8_S));
        return;
    }

    {
        /* consumers: warpgroup wg has weight rows n0 + 64 wg .. + 63 of each tile */
        int warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q = lane & 3, it = 0;

        for (int u = blockIdx.x; u < ntiles; u += gridDim.x) {
            int n0, t0;
            const uint8_t *wsr;
            float acc[64], blk[64];
            uint8_t wnext;

            g8_tile(a, u, &n0, &t0);
            wsr = a.ws + (int64_t)(n0 / 128) * nkt;
            wnext = __ldg(wsr);
#pragma unroll
            for (int i = 0; i < 64; i++) {
                acc[i] = 0.0f;
                blk[i] = 0.0f;
            }
            for (int kt = 0; kt < nkt; kt++, it++) {
                float sw = cu_e8m0_to_f32(wnext);

                /* the next block's weight scale, a block ahead of its use */
                if (kt + 1 < nkt)
                    wnext = __ldg(wsr + kt + 1);
                g8_issue(blk, sa, sb, full, wg, it);
                wg_wait<0>();
                wg_hold(blk);
                g8_promote(acc, blk, sw, sxs + (it % G8_S) * G8_BN, q);
                wg_bar_arrive(empty + 8 * (it % G8_S));
            }
            g8_store(a, acc, n0, t0, wg, warp, g, q);
        }
    }
#endif
}

/* --- host side ------------------------------------------------------------------------ */

/* on unless "0"/"off": the default since run 14 on the H200 (2026-11-30:
 * bench_fast 21 cases ok, 2.4-3.1x fw_kernel); dsv4_cuda_set_gemm8 */
static struct cuda_switch g8_switch = CUDA_SWITCH("DSV4_CUDA_GEMM8", 1);

/* on unless "0"/"off": g8_blas where cuBLASLt takes the shape (and the
 * cuBLASLt paths are on: DSV4_CUDA_BLAS); 0 keeps g8_kernel (A/B runs) */
static struct cuda_switch g8_blas_switch = CUDA_SWITCH("DSV4_CUDA_BLAS_FP8", 1);

void
dsv4_cuda_set_gemm8(int on)
{
    cuda_switch_set(&g8_switch, on);
}

int
cuda_fast_gemm8_on(void)
{
    return cuda_switch_on(&g8_switch);
}

/* Scratch bytes of g8_blas for W at T rows: x's codes and scales (from
 * the start, the same for every W of one n_in), the weights' fp32 scales,
 * the bf16 outputs. */
static size_t
g8_blas_scratch(const struct dsv4_linear *W, int T, size_t *bq, size_t *bs, size_t *bw)
{
    int N = W->n_out, K = W->n_in, nb = K / 128;
    int Tp = (T + BL_FP8_ROWS - 1) / BL_FP8_ROWS * BL_FP8_ROWS;

    *bq = cuda_align((size_t)Tp * K);
    *bs = cuda_align((size_t)Tp * nb * sizeof(float));
    *bw = cuda_align((size_t)(N / 128 * nb) * sizeof(float));
    return *bq + *bs + *bw + cuda_align((size_t)Tp * N * 2);
}

/* The cuBLASLt form (file comment): x's codes for T rows padded with zero
 * rows to a multiple of BL_FP8_ROWS, their scales column-major, the
 * weights' block scales as fp32 (one prep launch), cuBLASLt's FP8
 * block-scaled GEMM into bf16 scratch, widened into out.  NOTSUP from
 * cuBLASLt leaves only scratch written.  x_ready: x's codes and scales are
 * in the scratch already (a call on the same x and T queued before, the
 * scratch not used since), so the prep makes only the weights' scales. */
static enum dsv4_err
g8_blas(struct dsv4_backend *be, float *out, const float *x, const struct dsv4_linear *W, int T,
        uint16_t **obp, int x_ready)
{
    int N = W->n_out, K = W->n_in, nb = K / 128, nws = N / 128 * nb;
    int Tp = (T + BL_FP8_ROWS - 1) / BL_FP8_ROWS * BL_FP8_ROWS, rows = x_ready ? 0 : T;
    size_t bq, bs, bw, need = g8_blas_scratch(W, T, &bq, &bs, &bw);
    int64_t warps = (int64_t)(x_ready ? 0 : Tp) * ((nb + G8_PREP_BLOCKS - 1) / G8_PREP_BLOCKS) +
                    (nws + 31) / 32;
    struct g8_prep_more mo;
    char *p = (char *)cuda_scratch(be, need);
    uint8_t *xq = (uint8_t *)p;
    float *sx = (float *)(p + bq);
    uint16_t *ob = (uint16_t *)(p + bq + bs + bw);
    enum dsv4_err e;

    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "fast gemm8: no scratch for %d x %d", T, K);
    mo.ldt = x_ready ? 0 : Tp;   /* x_ready: no rows, no padding, the weights' scales only */
    mo.wsf = (float *)(p + bq + bs);
    mo.ws = W->scale;
    mo.nws = nws;
    g8_prep_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, cuda_stream(be)>>>(xq, sx, x, rows,
                                                                              K, mo);
    CUDA_LAUNCHED("fast gemm8 prep (cuBLASLt)");
    if ((e = cuda_blas_fp8(be, ob, W, mo.wsf, xq, sx, Tp)) != DSV4_OK)
        return e;
    if (obp != NULL) {   /* cuda_fast_gemm8_b16: the bf16 outputs themselves */
        *obp = ob;
        return DSV4_OK;
    }
    return cuda_blas_widen(be, out, ob, (int64_t)T * N);
}

/* Whether g8_blas takes W at T rows: FP8 in 128-blocks, both the weights'
 * rows and columns a multiple of 512 (4 scale blocks), the cuBLASLt FP8
 * path on and an algorithm for the shape.  Below 4 scale blocks a side
 * (K or N of 128, 256, 384: the test presets' widths) cuBLASLt's
 * block-scaled GEMM gave wrong outputs on Hopper (median row error 1.41
 * against transformers, docs/perf.md run 84) where g8_kernel is right;
 * every FP8 linear of the flash model has both sides a multiple of 512. */
static int
g8_blas_takes(struct dsv4_backend *be, const struct dsv4_linear *W, int T)
{
    return T > 0 && W->fmt == DSV4_WFMT_FP8 && W->n_out % (4 * G8_BM) == 0 &&
           W->n_in % 512 == 0 && W->n_in > 0 && cuda_switch_on(&g8_blas_switch) &&
           cuda_blas_fp8_ready(be, W->n_out, W->n_in);
}

enum dsv4_err
cuda_fast_gemm8_b16(struct dsv4_backend *be, uint16_t **ob, const float *x,
                    const struct dsv4_linear *W, int T)
{
    if (!g8_blas_takes(be, W, T))
        return DSV4_ERR_NOTSUP;
    return g8_blas(be, NULL, x, W, T, ob, 0);
}

size_t
cuda_fast_gemm8_blas_scratch(const struct dsv4_linear *W, int T)
{
    size_t bq, bs, bw;

    return g8_blas_scratch(W, T, &bq, &bs, &bw);
}

enum dsv4_err
cuda_fast_gemm8_blas(struct dsv4_backend *be, float *out, const float *x,
                     const struct dsv4_linear *W, int T, int x_ready)
{
    if (!g8_blas_takes(be, W, T))
        return DSV4_ERR_NOTSUP;
    return g8_blas(be, out, x, W, T, NULL, x_ready);
}

enum dsv4_err
cuda_fast_gemm8_linear(struct dsv4_backend *be, float *out, const float *x,
                       const struct dsv4_linear *W, int T)
{
    static size_t smem_done[CUDA_MAX_DEV];
    int N = W->n_out, K = W->n_in, nb = K / 128;
    size_t bq = cuda_align((size_t)T * K);
    int64_t warps = (int64_t)T * ((nb + G8_PREP_BLOCKS - 1) / G8_PREP_BLOCKS), tiles;
    int grid;
    struct g8_args a;
    enum dsv4_err e;
    char *p;

    if (T <= 0)
        return DSV4_OK;
    if (W->fmt != DSV4_WFMT_FP8 || N % G8_BM != 0 || K % 128 != 0 || K <= 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "fast gemm8: %d x %d not FP8 in 128 blocks", N, K);
    if (g8_blas_takes(be, W, T) && (e = g8_blas(be, out, x, W, T, NULL, 0)) != DSV4_ERR_NOTSUP)
        return e;   /* cuBLASLt took it (or failed otherwise) */
    p = (char *)cuda_scratch(be, bq + cuda_align((size_t)T * nb * sizeof(float)));
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "fast gemm8: no scratch for %d x %d", T, K);
    e = cuda_smem_allow(be, (const void *)g8_kernel, G8_SMEM, smem_done);
    if (e != DSV4_OK)
        return e;
    memset(&a, 0, sizeof(a));
    a.w = (const uint8_t *)W->w;
    a.ws = W->scale;
    a.xq = (const uint8_t *)p;
    a.sx = (const float *)(p + bq);
    a.out = out;
    a.T = T;
    a.N = N;
    a.K = K;
    g8_prep_kernel<<<cuda_blocks(warps * 32, 256), 256, 0, cuda_stream(be)>>>(
        (uint8_t *)a.xq, (float *)a.sx, x, T, K, g8_row_major);
    CUDA_LAUNCHED("fast gemm8 prep");
    tiles = (int64_t)(N / G8_BM) * ((T + G8_BN - 1) / G8_BN);
    /* persistent: a CTA an SM; under MPS (a share of the SMs, perhaps) a CTA
     * a tile, as before run 45 (the file comment) */
    grid = cuda_mps(be) || tiles < cuda_sms(be) ? (int)tiles : cuda_sms(be);
    g8_kernel<<<grid, G8_THREADS, G8_SMEM, cuda_stream(be)>>>(a);
    CUDA_LAUNCHED("fast gemm8");
    return DSV4_OK;
}
