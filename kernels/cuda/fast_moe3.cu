/*
 * fast_moe3.cu — the decode MoE, versions 3 and 5 (v5 the default, v3 on
 * request; DSV4_CUDA_FAST_MOE=v1 for fast_moe.cu's): the FP4
 * routed experts and the FP8 shared expert through the FP8 tensor cores
 * (mma.sync m16n8k32 e4m3), weights streamed through a per-warp
 * shared-memory ring by cp.async.  Design, knobs, measurements: docs/gpu.md,
 * "The decode MoE kernel".
 *
 * Why.  Hopper has no FP4 tensor-core input; v1 and v2 decoded every FP4
 * weight to bf16 (a table in shared memory, or bit placement and a scale
 * multiply), about 20 instructions per 32-bit word of weights, and read the
 * weights at 0.41 of 4.3 TB/s.  Every E2M1 value is an E4M3 value, so the
 * conversion is a bit move (fk_fp4x8_e4m3: eight codes in seven
 * instructions, the values times 2^-6), the activations are already FP8
 * (REF quantization), and the products are done by the FP8 tensor cores.
 *
 * Launches (five; four for moe_parts):
 *   1. fm3_prep_kernel: block 0 groups the picks r = t*k + j by expert
 *      (clamped into the table; active experts in increasing id order,
 *      their rows in increasing r; moe_parts leaves out the experts not
 *      held) by ranking every pick against all others; the other blocks
 *      quantize x per row per 128 columns (the exact path's codes and
 *      scales) as E4M3 bytes in two column orders, P4 (for the FP4 experts)
 *      and P8 (for the FP8 shared expert), see fm3_p4 / fm3_p8;
 *   2. fm3_kernel<1> (up): grid (I/16 / RT, slots), slot 0 the shared
 *      expert (its items are the largest: first), then the active experts;
 *      a block of 8 warps takes RT row tiles one after the other (one
 *      stream: the next tile's stages load during a tile's epilogue), a
 *      row tile being 16 rows of w1 and the same 16 rows of w3; warp w
 *      streams tile w/4 (w1 or w3) over quarter w & 3 of K; h = the exact
 *      path's SwiGLU expression, stored as fp32;
 *   3. fm3_hquant_kernel: h quantized per row per 128 columns (the exact
 *      codes), pick rows in P4 order, shared rows in P8 order;
 *   4. fm3_kernel<0> (down): grid (D/32 / RT, slots); a row tile is 32
 *      rows of w2, warp w streams rows (w/4)*16 .. + 15 of it over quarter
 *      w & 3 of K; y = bf16(w2 . h);
 *   5. the exact path's combine (cuda_moe_combine; moe only).
 *
 * Knobs: DSV4_CUDA_FAST_MOE "v3,NS,RT": NS ring stages per warp (2..6,
 * default 4), RT row tiles per block (1, 2, 4, 8; 0 or absent: the most
 * that leave 4224 blocks, fm3_rt).  Neither changes any result.
 *
 * A warp's work.  The warp streams its 16-row tiles through a ring of NS
 * stages in its own part of shared memory; a stage is 128 bytes of each of the 16 rows (FP4: 256 columns,
 * two 128-column blocks; FP8: 128 columns) plus, for FP4, the rows' 8 E8M0
 * scale bytes.  Each lane issues four 16-byte cp.async (L2 prefetch 256 B)
 * and one 4-byte one per stage, NS - 1 stages ahead; only the warp reads
 * its ring, so __syncwarp is the only barrier of the stream.  Row r's
 * 16-byte segment j lies at r*128 + 16*(j ^ (r & 7)), so the cp.async
 * writes and the ldmatrix reads are free of bank conflicts.  One
 * ldmatrix.x4 gives thread (g, q) word q of two segments of rows g and
 * g + 8, which is exactly its A fragment words:
 *   FP4: a segment is one scale group (32 columns); word q holds columns
 *        8q .. 8q+7 of the group; fk_fp4x8_e4m3 gives a0 (row g) / a1
 *        (row g+8) = the even columns 8q + 0, 2, 4, 6 and a2 / a3 the odd
 *        ones; one mma per group;
 *   FP8: segments 2m and 2m+1 are the mma's k 0..15 and 16..31 (natural
 *        order); four mma per 128-column block.
 * B (the tokens) is read from global memory (L1-cached: the block's warps
 * of the same quarter share the rows), 32 bytes per thread and token tile
 * per 128-column block: the quantizers store each 128-column block so
 * that thread q's 32 bytes are contiguous and words 2m, 2m+1 are its b0,
 * b1 of the block's mma m, in both orders:
 *   P4: column c = 32G + 8q + e goes to q*32 + 8G + (e & 1)*4 + e/2;
 *   P8: column c = 16s + 4q + i goes to q*32 + 4s + i.
 * Tokens are the mma's N: passes of 8 or 16 slot rows (one or two n-tiles;
 * rows past the slot's end repeat its last row and are not stored).
 * tests/gpu/fm3_layout_sim.py replays this index algebra against the PTX
 * definitions of ldmatrix and the mma.  Registers: 128 (two blocks of 8
 * warps per SM at NS = 4, 81 KB of shared memory each), no spills.
 *
 * Numerics (REF), the contract.  The mma of one k32 step is run on a zero
 * accumulator and its fp32 result d added in fp32 registers: FP4,
 * blk = fma(d, s_w, blk) with s_w the E8M0 scale of the step's group
 * (exact power of two); FP8, blk = blk + d.  Per 128-column block b:
 * Q = fma(blk, s_x(b) * f, Q), s_x the token's activation scale and f = 64
 * (FP4: undoes the 2^-6 of the conversion) or the FP8 block scale (products
 * of powers of two: exact).  K is cut into four quarters, one per warp; Q
 * is the sum of one quarter's blocks in order, and the output is
 * (((Q0 + Q1) + Q2) + Q3), added through shared memory by the warp of
 * quarter 0.  The products are exact; the sums differ from the exact
 * path's only by the order and, inside one k32 mma, by the tensor core's
 * internal precision (on Hopper the FP8 mma may keep fewer than 24 bits
 * while adding its 32 products: that is why the partial sums are never
 * longer than one group).  h = bf16(silu(min(g, L)) * clamp(u, +-L) *
 * route weight) with g, u the bf16-rounded sums, the exact path's
 * expression (cu_swiglu); y = bf16(sum); out = the exact path's combine.
 * Determinism: every output value is computed by fixed warps of one block
 * in a fixed order; an output column of an mma depends only on its own B
 * column, so a token's row is the same whatever other rows share its
 * pass, its slot or the call: independent of T, the same in a CUDA graph
 * and outside.
 *
 * v5 (fm5_kernel; the default, DSV4_CUDA_FAST_MOE "v3" forces v3; "v5,P"
 * sets the warps per item, fm5_team, "v5,P,MT" also the m-tiles of an
 * item, fm5_pass's wide tiles): the same stages, ring, A
 * fragments, mma and fp32 additions, but no quarters of K across warps and
 * no block barrier.  Each warp takes (slot, tile) items from a per-call
 * counter (zeroed by the prep kernel) and streams the tile's 16 rows of A
 * over all of K through its own ring of FM5_NS stages (up: rows r .. r + 7
 * of w1 and the same rows of w3, so that one thread holds g and u of an
 * output; down: 16 rows of w2), with the ring slot and stage kept as
 * counters (v3 paid
 * five runtime integer divisions per stage: on the H200 v3 issued ~540
 * instructions per 2 KB stage and was issue-bound, 25% occupancy, DRAM at
 * a third of its peak, while the same loads with no arithmetic move
 * 0.99 of 4.3 TB/s).  The warp keeps a quarter's blocks in acc and folds
 * the quarters in order, tot = ((Q0 + Q1) + Q2) + Q3, fm3_tile_end's
 * order, and stores h or y itself: v3's results bit for bit (bench_fast
 * "moe v5 bits").  Passes of 8 slot rows (a second pass of a tile reads
 * it from L2).  Small calls have fewer items than resident warps (one
 * token: 7 slots, 1,792 up items for 2,112 warps; a tp rank's share 896),
 * and a warp alone on a tile is bound by its ring's latency: there a team
 * of 2 or 4 warps of a block takes each item (fm5_team, fm5_parts), warp
 * j streaming quarters j*4/P .. of the tile, the team's first warp folding
 * the others' quarter sums in the
 * same order (shared memory, a named barrier): the same bits at any P.
 *
 * Requirements (else v1): T*k <= FM3_MAX_TK, D and I multiples of 1024 and
 * at most 8192 (four quarters of whole stages; the FP8 block scales of a
 * tile held in shared memory).  Weights 16-byte aligned (cuda_fast_moe_ok);
 * FP4 scale rows 4-byte aligned (the loaders align every tensor to 256
 * bytes): a slot whose scales are not gets NaN outputs.
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_mma.cuh"   /* fa_ldsm_x4 */

#include <cuda_fp16.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FM3_MAX_TK 4096          /* picks per call (the grouping's shared arrays) */
#define FM3_SB 128               /* bytes of each weight row per stage */
#define FM3_TILE_B (16 * FM3_SB) /* a stage of the warp's 16 rows */
#define FM3_STAGE_B (FM3_TILE_B + 16 * 8)    /* + FP4 scales (16 rows x 8) */
#define FM3_SCF 12               /* floats per row of the converted FP4 scales (8 + pad) */
#define FM3_SCF_B (16 * FM3_SCF * 4)         /* per warp: converted scales */
#define FM3_RED_Q (2 * 4 * 32)   /* floats of one quarter sum of a tile (NT = 2) */
#define FM3_PREP_THREADS 512
#define FM3_MAX_KB 64            /* 128-column blocks of K at most (FP8 scales of a quarter) */
#define FM3_BOUND_THREADS 256    /* __launch_bounds__ of fm3_kernel: 8 warps ... */
#define FM3_BOUND_BLOCKS 2       /* ... two blocks per SM: 128 registers */

/* Everything the kernels need, by value. */
struct fm3_args {
    const struct dsv4_expert_w *table;  /* device copy of the expert array */
    struct dsv4_expert_w shared;        /* shared expert (device pointers) */
    int has_shared;
    const int32_t *grp;     /* n_act, act_e[A], act_off[A+1], rows[T*k] */
    int A;                  /* routed slots at most: min(T*k, n_table) */
    const uint8_t *xq4, *xq8;   /* (T, D): E4M3 codes of x, P4 and P8 order */
    const uint16_t *xh4, *xh8;  /* (T, D): the codes' values as f16, v5's order (fm3_h) */
    const float *xs;        /* (T, D/128) */
    float *h;               /* (R, I), R = T*k + T: SwiGLU outputs (bf16 values) */
    uint8_t *hq;            /* (R, I): codes of h, pick rows P4, shared rows P8 */
    uint16_t *hh;           /* (R, I): their values as f16, v5's order */
    float *hs;              /* (R, I/128) */
    float *y;               /* (R, D): the summands (moe_parts: the caller's array) */
    const float *weights;   /* (T, k) */
    int T, k, D, I;
    int ns;                 /* ring stages per warp: 2 .. 6 */
    int rt;                 /* row tiles per block (one after the other) */
    float lim;
    int *ctr;               /* v5: items taken so far by the up [1] and down [0] kernel */
    int ef;                 /* v5: narrow tiles of one pass copy with L2 evict_first
                               (fm5_cursor_at; fm5_ef_sw) */
    int place;              /* v5: where the grid's teams outnumber the items, a team's
                               item is its place in the grid (fm5_kernel; fm5_place_sw) */
};

/* The expert of a block: slot blockIdx.y. */
struct fm3_slot {
    const struct dsv4_expert_w *E;
    const int32_t *rows;    /* pick rows (routed), NULL for the shared expert */
    int n;                  /* rows of this slot */
};

/* The 16-row tiles of a warp: tile i (i = 0 .. the block's row tiles - 1)
 * starts at row r0 + i*step of the tensor. */
struct fm3_warp {
    const uint8_t *w;       /* tile 0's first row */
    const uint8_t *sc;      /* FP4: tile 0's first row's scales; FP8: the scale array */
    int64_t tw, ts;         /* bytes from one tile to the next: weights, FP4 scales */
    int rb;                 /* bytes per weight row */
    int sb;                 /* FP4 scale bytes per row */
    int r0, step;           /* tile 0's first row; rows from one tile to the next */
    int bad;                /* FP4 scales not 4-byte aligned: NaN outputs */
};

/* --- column orders ------------------------------------------------------------------ */

/* Place of column c (0..127) of a 128-column block: P4 (FP4 experts). */
static __device__ __forceinline__ int
fm3_p4(int c)
{
    int G = c >> 5, q = (c >> 3) & 3, e = c & 7;

    return q * 32 + G * 8 + (e & 1) * 4 + (e >> 1);
}

/* P8 (the FP8 shared expert). */
static __device__ __forceinline__ int
fm3_p8(int c)
{
    return ((c >> 2) & 3) * 32 + (c >> 4) * 4 + (c & 3);
}

/*
 * v5's place of the value whose code is at P4 / P8 place `pos` (its f16
 * copy): thread q's 32 values are four groups of 16 bytes, group m at
 * byte 64m + 16q of the block (fm5_act: the four threads of a token read
 * 64 contiguous bytes a load, two sectors of one line), reordered so that
 * f16x2 word m*4 + h*2 + i holds bytes 2h, 2h+1 of its code word 2m + i
 * (b0 / b1 of mma m): the B registers of the two m16n8k16 halves of mma
 * m (fm5_mma) are words m*4 + 2h, m*4 + 2h + 1.
 */
static __device__ __forceinline__ int
fm3_h(int pos)
{
    int q = pos >> 5, j = pos & 31, w = j >> 2, bb = j & 3;

    return (w >> 1) * 32 + q * 8 + (bb >> 1) * 4 + (w & 1) * 2 + (bb & 1);
}

/*
 * REF quantization of a 128-column block held by a warp (v[i] = column
 * lane + 32 i): the codes and values of fk_quant and of the exact path
 * (through fk_quant2: the hardware's conversion, the same bits); codes to
 * p4 (P4 order) and/or p8 (P8 order), their values as f16 (exact) to h4 /
 * h8 (v5's order, fm3_h), any may be NULL; the scale to *sp.
 */
static __device__ __forceinline__ void
fm3_quant_warp(const float (&v)[4], uint8_t *p4, uint8_t *p8, uint16_t *h4, uint16_t *h8,
               float *sp)
{
    int lane = threadIdx.x & 31;
    float s = fk_quant_scale_warp(v), inv = 1.0f / s;   /* exact: s is a power of two or inf */
    uint16_t c2[2];
    uint32_t h2[2] = { fk_quant2(v[0], v[1], inv, &c2[0]), fk_quant2(v[2], v[3], inv, &c2[1]) };

    for (int i = 0; i < 4; i++) {
        uint8_t c = (uint8_t)(c2[i / 2] >> (8 * (i & 1)));
        uint16_t hv = (uint16_t)(h2[i / 2] >> (16 * (i & 1)));
        int col = lane + 32 * i;

        if (p4 != NULL)
            p4[fm3_p4(col)] = c;
        if (p8 != NULL)
            p8[fm3_p8(col)] = c;
        if (h4 != NULL)
            h4[fm3_h(fm3_p4(col))] = hv;
        if (h8 != NULL)
            h8[fm3_h(fm3_p8(col))] = hv;
    }
    if (lane == 0)
        *sp = s;
}

/* --- grouping ------------------------------------------------------------------------- */

/*
 * Block 0 of fm3_prep_kernel: grp = n_act, act_e[A], act_off[A+1], rows[Tk]
 * (see fm3_args).  Pick r of expert e (clamped into the table) goes to
 * place #{valid r' : (e', r') < (e, r)}; its expert's slot is the number of
 * distinct valid experts below e.  skip_unheld: experts without weights
 * (moe_parts: held elsewhere) are not valid.  A stable counting sort: warp
 * 0 walks the picks 32 at a time in order (__match_any_sync finds a pick's
 * peers in its 32), giving each its rank among its expert's picks and the
 * count per expert; one block scan over the experts of (count, count > 0)
 * gives each expert's first place and slot.  O(Tk / 32 + E / threads)
 * steps; the pairwise ranking it replaced took O(Tk^2 / threads), which
 * showed at prefill sizes (a 4-layer prefill of 256 tokens 12.1 -> 11.1 ms,
 * perf.md run 26).  E <= FM3_MAX_E (cuda_fast_moe_ok).
 */
#define FM3_MAX_E 4096           /* experts (cuda_fast_moe_ok's FM_MAX_E) */
#define FM3_NONE 0xffffu         /* a pick that is not valid */

static __device__ void
fm3_group(int32_t *grp, const int32_t *ids, int Tk, int E, int A,
          const struct dsv4_expert_w *table, int skip_unheld)
{
    __shared__ uint16_t ge[FM3_MAX_TK], rk[FM3_MAX_TK];   /* expert; rank among its picks */
    __shared__ int32_t cnt[FM3_MAX_E];   /* picks per expert, then first place | slot << 16 */
    __shared__ int32_t wbase[33];        /* fk_block_scan */
    int32_t total;                       /* n_valid | n_act << 16 */
    int32_t *act_e = grp + 1, *act_off = grp + 1 + A, *rows = grp + 2 + 2 * A;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int per = (E + blockDim.x - 1) / blockDim.x, e0 = threadIdx.x * per, s = 0, run;

    for (int e = threadIdx.x; e < E; e += blockDim.x)
        cnt[e] = 0;
    for (int r = threadIdx.x; r < Tk; r += blockDim.x) {
        int e = ids[r];

        e = e < 0 ? 0 : (e >= E ? E - 1 : e);
        ge[r] = (uint16_t)(skip_unheld && table[e].w1.w == NULL ? FM3_NONE : e);
    }
    __syncthreads();
    if (warp == 0)   /* ranks and counts, picks in order */
        for (int c = 0; c < Tk; c += 32) {
            int r = c + lane;
            unsigned e = r < Tk ? ge[r] : FM3_NONE;
            unsigned peers = __match_any_sync(0xffffffffu, e);
            int before = __popc(peers & ((1u << lane) - 1u));

            if (e != FM3_NONE)
                rk[r] = (uint16_t)(cnt[e] + before);
            __syncwarp();   /* every peer read cnt[e] */
            if (e != FM3_NONE && before == 0)
                cnt[e] += __popc(peers);
            __syncwarp();
        }
    __syncthreads();
    /* exclusive scan over the experts of count + (count > 0) << 16 */
    for (int i = 0; i < per && e0 + i < E; i++)
        s += cnt[e0 + i] + (cnt[e0 + i] > 0 ? 1 << 16 : 0);
    run = fk_block_scan(s, wbase, &total);
    for (int i = 0; i < per && e0 + i < E; i++) {
        int c = cnt[e0 + i];

        cnt[e0 + i] = run;
        run += c + (c > 0 ? 1 << 16 : 0);
    }
    __syncthreads();
    for (int r = threadIdx.x; r < Tk; r += blockDim.x) {
        unsigned e = ge[r];
        int ps;

        if (e == FM3_NONE)
            continue;
        ps = cnt[e];
        rows[(ps & 0xffff) + rk[r]] = r;
        if (rk[r] == 0) {
            act_e[ps >> 16] = (int32_t)e;
            act_off[ps >> 16] = ps & 0xffff;
        }
    }
    if (threadIdx.x == 0) {
        grp[0] = total >> 16;
        act_off[total >> 16] = total & 0xffff;
    }
}

/*
 * Block 0 groups the picks (fm3_group); the others quantize x, a warp per
 * (token, 128-column block), into both column orders.
 */
static __global__ void __launch_bounds__(FM3_PREP_THREADS)
fm3_prep_kernel(struct fm3_args a, const float *x, const int32_t *ids, int E, int skip_unheld,
                uint8_t *xq4, uint8_t *xq8, float *xs)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int nb = a.D / 128;
    int64_t wid;

    if (blockIdx.x == 0) {
        if (threadIdx.x < 2)
            a.ctr[threadIdx.x] = 0;   /* v5's item counters of this call */
        fm3_group((int32_t *)a.grp, ids, a.T * a.k, E, a.A, a.table, skip_unheld);
        return;
    }
    wid = (int64_t)(blockIdx.x - 1) * (blockDim.x / 32) + threadIdx.x / 32;
    if (wid >= (int64_t)a.T * nb)
        return;   /* whole warps */
    {
        int64_t t = wid / nb, b = wid % nb, at = t * a.D + b * 128;
        float v[4];

        for (int i = 0; i < 4; i++)
            v[i] = x[at + (threadIdx.x & 31) + 32 * i];
        fm3_quant_warp(v, xq4 + at, xq8 + at, (uint16_t *)a.xh4 + at, (uint16_t *)a.xh8 + at,
                       xs + t * nb + b);
    }
}

/* h (R, I) -> codes and scales: pick rows (r < T*k) P4, shared rows P8. */
static __global__ void
fm3_hquant_kernel(struct fm3_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int nb = a.I / 128, R = a.T * a.k + a.T;
    int64_t wid = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;

    if (wid >= (int64_t)R * nb)
        return;
    {
        int64_t r = wid / nb, b = wid % nb, at = r * a.I + b * 128;
        int pick = r < (int64_t)a.T * a.k;
        float v[4];

        for (int i = 0; i < 4; i++)
            v[i] = a.h[at + (threadIdx.x & 31) + 32 * i];
        fm3_quant_warp(v, pick ? a.hq + at : NULL, pick ? NULL : a.hq + at,
                       pick ? a.hh + at : NULL, pick ? NULL : a.hh + at, a.hs + r * nb + b);
    }
}

/* --- the weight ring ------------------------------------------------------------------ */

/* 16 bytes global -> shared, L2 prefetch of 256 bytes. */
static __device__ __forceinline__ void
fm3_cp16(uint32_t dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;"
                 :: "r"(dst), "l"(src) : "memory");
}

/* fm3_cp16 whose lines L2 evicts first (policy pol: fm3_ef_policy). */
static __device__ __forceinline__ void
fm3_cp16_ef(uint32_t dst, const void *src, uint64_t pol)
{
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "l"(pol) : "memory");
}

/* An L2 policy of evict_first for every line it is given to. */
static __device__ __forceinline__ uint64_t
fm3_ef_policy(void)
{
    uint64_t pol;

    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}

/* 4 bytes global -> shared. */
static __device__ __forceinline__ void
fm3_cp4(uint32_t dst, const void *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src) : "memory");
}

static __device__ __forceinline__ void
fm3_commit(void)
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Wait until at most n (0..4) of this thread's groups are pending. */
static __device__ __forceinline__ void
fm3_wait(int n)
{
    switch (n) {
    case 0:
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        break;
    case 1:
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        break;
    case 2:
        asm volatile("cp.async.wait_group 2;" ::: "memory");
        break;
    case 3:
        asm volatile("cp.async.wait_group 3;" ::: "memory");
        break;
    default:
        asm volatile("cp.async.wait_group 4;" ::: "memory");
        break;
    }
}

/*
 * Stage st of tile ti of the warp into buf: lane copies segment lane & 7 of
 * rows i*4 + lane/8, i = 0..3 (a warp instruction reads four whole 128-byte
 * row pieces), and (FP4) 4 of the 8 scale bytes of row lane/2 to
 * buf + FM3_TILE_B + lane*4.
 */
template <int FP8>
static __device__ __forceinline__ void
fm3_issue(const struct fm3_warp &wp, int ti, int st, char *buf)
{
    uint32_t sb = (uint32_t)__cvta_generic_to_shared(buf);
    int lane = threadIdx.x & 31, seg = lane & 7;
    const uint8_t *w = wp.w + ti * wp.tw + st * FM3_SB + seg * 16;

#pragma unroll
    for (int i = 0; i < 4; i++) {
        int row = i * 4 + (lane >> 3);

        fm3_cp16(sb + row * FM3_SB + ((seg ^ (row & 7)) << 4), w + (int64_t)row * wp.rb);
    }
    if (!FP8)
        fm3_cp4(sb + FM3_TILE_B + lane * 4,
                wp.sc + ti * wp.ts + (int64_t)(lane >> 1) * wp.sb + st * 8 + (lane & 1) * 4);
}

/* FP4: 4 scale bytes v of this lane -> floats at
 * scf[row * FM3_SCF + 4*(lane & 1) ..], row = lane/2 (cu_e8m0_to_f32's
 * values).  A byte b is 2^(b-127) = b << 23 as fp32 bits unless it is 0
 * (subnormal 2^-127) or 0xff (NaN): those two are the bytes whose bits
 * 1..7 all equal their neighbours below, tested for all four at once (a
 * zero byte of (v ^ v << 1) & 0xfe..fe); the common case is then two
 * operations per scale instead of cu_e8m0_to_f32's two compares and
 * branches (Nsight Compute: 45 of v5's 430 instructions per stage). */
static __device__ __forceinline__ void
fm3_scales_word(uint32_t v, float *scf)
{
    int lane = threadIdx.x & 31;
    uint32_t y = (v ^ (v << 1)) & 0xfefefefeu;
    float4 f;

    if (((y - 0x01010101u) & ~y & 0x80808080u) == 0) {   /* no byte is 0 or 0xff */
        f.x = __uint_as_float((v << 23) & 0x7f800000u);
        f.y = __uint_as_float((v << 15) & 0x7f800000u);
        f.z = __uint_as_float((v << 7) & 0x7f800000u);
        f.w = __uint_as_float((v >> 1) & 0x7f800000u);
    } else {
        f.x = cu_e8m0_to_f32((uint8_t)(v & 0xffu));
        f.y = cu_e8m0_to_f32((uint8_t)((v >> 8) & 0xffu));
        f.z = cu_e8m0_to_f32((uint8_t)((v >> 16) & 0xffu));
        f.w = cu_e8m0_to_f32((uint8_t)(v >> 24));
    }
    *(float4 *)(scf + (lane >> 1) * FM3_SCF + (lane & 1) * 4) = f;
}

/* fm3_scales_word of the 4 scale bytes this lane copied into buf. */
static __device__ __forceinline__ void
fm3_scales(const char *buf, float *scf)
{
    fm3_scales_word(*(const uint32_t *)(buf + FM3_TILE_B + (threadIdx.x & 31) * 4), scf);
}

/* ldmatrix.x4 of segments j, j+1 of the tile in buf: r[0], r[1] = word q of
 * segment j of rows g, g+8; r[2], r[3] the same of segment j+1. */
static __device__ __forceinline__ void
fm3_ldsm(uint32_t (&r)[4], const char *buf, int j)
{
    int lane = threadIdx.x & 31, mi = lane >> 3, rr = lane & 7;
    int row = (mi & 1) * 8 + rr, seg = j + (mi >> 1);

    fa_ldsm_x4(r, buf + row * FM3_SB + ((seg ^ rr) << 4));
}

/* The activations of 128-column block kb: xw[n] = thread q's 32 bytes of the
 * B row of n-tile n, xc[n][j] = the scale of C column 2q + j. */
template <int NT>
static __device__ __forceinline__ void
fm3_act(uint32_t (&xw)[NT][8], float (&xc)[NT][2], const uint8_t *const (&xr)[NT],
        const float *const (&sr)[NT][2], int kb)
{
    int q = threadIdx.x & 3;

#pragma unroll
    for (int n = 0; n < NT; n++) {
        const uint4 *p = (const uint4 *)(xr[n] + (int64_t)kb * 128 + q * 32);
        uint4 v0 = __ldg(p), v1 = __ldg(p + 1);

        xw[n][0] = v0.x;
        xw[n][1] = v0.y;
        xw[n][2] = v0.z;
        xw[n][3] = v0.w;
        xw[n][4] = v1.x;
        xw[n][5] = v1.y;
        xw[n][6] = v1.z;
        xw[n][7] = v1.w;
        xc[n][0] = __ldg(sr[n][0] + kb);
        xc[n][1] = __ldg(sr[n][1] + kb);
    }
}

/* v3's B operand of fm3_block: the E4M3 words of n-tile n (fm3_act);
 * d = the k32 product (fk_mma_e4m3) on a zero accumulator. */
template <int NT>
struct fm3_b8 {
    const uint32_t (&xw)[NT][8];

    __device__ __forceinline__ void
    mma(float (&d)[4], int n, int m, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) const
    {
        d[0] = d[1] = d[2] = d[3] = 0.0f;
        fk_mma_e4m3(d, a0, a1, a2, a3, xw[n][2 * m], xw[n][2 * m + 1]);
    }

    /* group m's B is used (nothing to do: v3 loads B per block) */
    __device__ __forceinline__ void
    done(int) const
    {
    }
};

/*
 * One 128-column block (block b of the stage in buf) into blk, the B
 * operand and the k32 product from bo (fm3_b8: v3; fm5_bh: v5; bo.done(m)
 * after the last use of group m's B):
 * FP4 (b = 0, 1): four groups, one k32 product each, blk = fma(d, s_w, blk);
 * FP8 (b = 0): four k32 products, blk += d.
 */
template <int FP8, int NT, class BOP>
static __device__ __forceinline__ void
fm3_block(float (&blk)[NT][4], const char *buf, int b, const float *scf, const BOP &bo)
{
    int lane = threadIdx.x & 31, g = lane >> 2;

    if (FP8) {
#pragma unroll
        for (int m = 0; m < 4; m++) {
            uint32_t r[4];

            fm3_ldsm(r, buf, 2 * m);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                float d[4];

                bo.mma(d, n, m, r[0], r[1], r[2], r[3]);
#pragma unroll
                for (int i = 0; i < 4; i++)
                    blk[n][i] += d[i];
            }
            bo.done(m);
        }
    } else {
#pragma unroll
        for (int pr = 0; pr < 2; pr++) {
            float2 s0 = *(const float2 *)(scf + g * FM3_SCF + 4 * b + 2 * pr);
            float2 s8 = *(const float2 *)(scf + (g + 8) * FM3_SCF + 4 * b + 2 * pr);
            uint32_t r[4];

            fm3_ldsm(r, buf, 4 * b + 2 * pr);
#pragma unroll
            for (int gi = 0; gi < 2; gi++) {
                int m = 2 * pr + gi;
                float w0 = gi ? s0.y : s0.x, w8 = gi ? s8.y : s8.x;
                uint32_t a0, a1, a2, a3;

                fk_fp4x8_e4m3(r[2 * gi], &a0, &a2);
                fk_fp4x8_e4m3(r[2 * gi + 1], &a1, &a3);
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    float d[4];

                    bo.mma(d, n, m, a0, a1, a2, a3);
                    blk[n][0] = __fmaf_rn(d[0], w0, blk[n][0]);
                    blk[n][1] = __fmaf_rn(d[1], w0, blk[n][1]);
                    blk[n][2] = __fmaf_rn(d[2], w8, blk[n][2]);
                    blk[n][3] = __fmaf_rn(d[3], w8, blk[n][3]);
                }
                bo.done(m);
            }
        }
    }
}

/* --- a pass: slot rows p .. p + 8*NT - 1 through the warp's tile --------------------- */

/* Activation row of slot row j (clamped by the caller): up, x (P4 / P8 by
 * the expert's format); down, h (its own row's order). */
template <int UP>
static __device__ __forceinline__ int64_t
fm3_act_row(const struct fm3_args &a, const struct fm3_slot &s, int j)
{
    if (s.rows == NULL)
        return UP ? j : (int64_t)a.T * a.k + j;
    return UP ? s.rows[j] / a.k : s.rows[j];
}

/* Activation rows of pass p: xr[n] = the B row (codes) of n-tile n of thread
 * (g, q), sr[n][c] = the scale row of its C column 2q + c (slot rows past
 * the end repeat the last). */
template <int UP, int FP8, int NT>
static __device__ __forceinline__ void
fm3_act_rows(const struct fm3_args &a, const struct fm3_slot &s, int p, const uint8_t *(&xr)[NT],
             const float *(&sr)[NT][2])
{
    int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3, K = UP ? a.D : a.I, nb = K / 128;
    const uint8_t *xbase = UP ? (FP8 ? a.xq8 : a.xq4) : a.hq;
    const float *sbase = UP ? a.xs : a.hs;

#pragma unroll
    for (int n = 0; n < NT; n++) {
        xr[n] = xbase + fm3_act_row<UP>(a, s, min(p + n * 8 + g, s.n - 1)) * K;
#pragma unroll
        for (int c = 0; c < 2; c++)
            sr[n][c] = sbase + fm3_act_row<UP>(a, s, min(p + n * 8 + 2 * q + c, s.n - 1)) * nb;
    }
}

/* v = 0. */
template <int NT>
static __device__ __forceinline__ void
fm3_zero(float (&v)[NT][4])
{
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[n][i] = 0.0f;
}

/* The end of a 128-column block: acc = fma(blk, s_x * f, acc), blk = 0,
 * with f = f0 for the tile's rows g (C values 0, 1) and f1 for rows g + 8
 * (v3's tiles and FP4 have one f; v5's FP8 up tiles are w1 and w3 rows). */
template <int NT>
static __device__ __forceinline__ void
fm3_block_end(float (&acc)[NT][4], float (&blk)[NT][4], const float (&xc)[NT][2], float f0,
              float f1)
{
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            acc[n][i] = __fmaf_rn(blk[n][i], xc[n][i & 1] * (i < 2 ? f0 : f1), acc[n][i]);
            blk[n][i] = 0.0f;
        }
}

/* Quarter sum number `b` of the row tile in red (b = t*4 + qt - 1). */
static __device__ __forceinline__ float *
fm3_red(float *red, int b, int v)
{
    return red + ((size_t)b * 8 + v) * 32 + (threadIdx.x & 31);
}

/*
 * The end of row tile rt of a pass: the quarter sums (acc) of the warps
 * that do not combine go to red; the combining warps add them in order and
 * store h (UP) or y.  Every warp of the block calls it (two barriers).
 */
template <int UP, int NT>
static __device__ __forceinline__ void
fm3_tile_end(const struct fm3_args &a, const struct fm3_slot &s, const struct fm3_warp &wp,
             int p, int rt, int t, int qt, int comb, const float (&acc)[NT][4], float *red)
{
    int g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;

    /* quarter sums to red (all but the combining warps' own), then added */
    if (!comb)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                *fm3_red(red, t * 4 + qt - 1, n * 4 + i) = acc[n][i];
    __syncthreads();
    if (comb)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int j = p + n * 8 + 2 * q + (i & 1);
                int row = (UP ? rt * 16 : rt * 32 + t * 16) + g + 8 * (i >> 1);
                float sum = acc[n][i], u = 0.0f;
                int64_t hr;

                for (int r = 1; r < 4; r++)
                    sum += *fm3_red(red, t * 4 + r - 1, n * 4 + i);
                if (UP) {   /* u: tile 1's quarters */
                    u = *fm3_red(red, 3, n * 4 + i);
                    for (int r = 1; r < 4; r++)
                        u += *fm3_red(red, 3 + r, n * 4 + i);
                }
                if (j >= s.n)
                    continue;
                hr = s.rows != NULL ? s.rows[j] : (int64_t)a.T * a.k + j;
                if (UP) {
                    float v = cu_swiglu(sum, u, a.lim);

                    if (s.rows != NULL)
                        v *= a.weights[hr];
                    a.h[hr * a.I + row] = wp.bad ? __int_as_float(0x7fc00000) : cu_bf16_round(v);
                } else {
                    a.y[hr * a.D + row] =
                        wp.bad ? __int_as_float(0x7fc00000) : cu_bf16_round(sum);
                }
            }
    __syncthreads();   /* red is read before the next tile writes it */
}

/*
 * Slot rows p .. p + 8*NT - 1 through the warp's tiles 0 .. nrt-1 (row
 * tiles rt0 .., tile t of each) over quarter qt of K, one continuous
 * stream of stages; after each row tile its quarters are added in order
 * through red (every warp of the block: barriers; the next tile's stages
 * are in flight meanwhile): for each tile (((Q0 + Q1) + Q2) + Q3), by the
 * warp of quarter 0 of tile 0 (UP: it needs both tiles, g and u, and
 * stores h) or of each tile (down: it stores its 16 rows of y).
 */
template <int UP, int FP8, int NT>
static __device__ void
fm3_pass(const struct fm3_args &a, const struct fm3_slot &s, const struct fm3_warp &wp, int p,
         int rt0, int nrt, int t, int qt, char *ring, float *scf, float *red)
{
    int K = UP ? a.D : a.I, nb = K / 128, nq = nb / 4, ns = a.ns;
    int bps = FP8 ? 1 : 2;                      /* 128-column blocks per stage */
    int nst = wp.rb / FM3_SB / 4, st0 = qt * nst, kb0 = qt * nq, ntot = nrt * nst;
    const uint8_t *xr[NT];
    const float *sr[NT][2];
    uint32_t xw[NT][8];
    float xc[NT][2];
    float acc[NT][4], blk[NT][4];
    int comb = qt == 0 && (t == 0 || !UP);      /* this warp adds the quarters */

    fm3_act_rows<UP, FP8, NT>(a, s, p, xr, sr);
    fm3_zero<NT>(acc);
    fm3_zero<NT>(blk);
    for (int i = 0; i < ns - 1; i++) {
        if (i < ntot)
            fm3_issue<FP8>(wp, i / nst, st0 + i % nst, ring + i * FM3_STAGE_B);
        fm3_commit();
    }
    for (int gi = 0; gi < ntot; gi++) {
        char *buf = ring + (gi % ns) * FM3_STAGE_B;
        int ti = gi / nst, si = gi - ti * nst, nx = gi + ns - 1;

        fm3_wait(ns - 2);   /* stage gi has landed (this thread's copies) */
        __syncwarp();       /* ... and every lane's; stage gi-1 is read */
        if (!FP8) {
            fm3_scales(buf, scf);
            __syncwarp();
        }
        if (nx < ntot)
            fm3_issue<FP8>(wp, nx / nst, st0 + nx % nst, ring + (nx % ns) * FM3_STAGE_B);
        fm3_commit();
#pragma unroll
        for (int b = 0; b < (FP8 ? 1 : 2); b++) {
            int kb = kb0 + si * bps + b;
            float f = 64.0f;

            if (FP8)   /* the tile's 128x128 block scale */
                f = cu_e8m0_to_f32(
                    __ldg(wp.sc + (int64_t)((wp.r0 + ti * wp.step) / 128) * nb + kb));
            fm3_act<NT>(xw, xc, xr, sr, kb);
            fm3_block<FP8, NT>(blk, buf, b, scf, fm3_b8<NT>{ xw });
            fm3_block_end<NT>(acc, blk, xc, f, f);
        }
        if (si == nst - 1) {   /* row tile rt0 + ti is complete */
            fm3_tile_end<UP, NT>(a, s, wp, p, rt0 + ti, t, qt, comb, acc, red);
            fm3_zero<NT>(acc);
        }
    }
    __syncwarp();   /* the ring is read before the next pass refills it */
}

/* Every pass of the slot through the warp's tiles (FP8: the shared expert). */
template <int UP, int FP8>
static __device__ void
fm3_passes(const struct fm3_args &a, const struct fm3_slot &s, int rt0, int nrt, int t, int qt,
           char *ring, float *scf, float *red)
{
    int K = UP ? a.D : a.I;
    const struct dsv4_linear *L = UP ? (t ? &s.E->w3 : &s.E->w1) : &s.E->w2;
    struct fm3_warp wp;

    wp.r0 = UP ? rt0 * 16 : rt0 * 32 + t * 16;
    wp.step = UP ? 16 : 32;
    wp.rb = FP8 ? K : K / 2;
    wp.sb = K / 32;
    wp.w = (const uint8_t *)L->w + (int64_t)wp.r0 * wp.rb;
    wp.tw = (int64_t)wp.step * wp.rb;
    wp.sc = FP8 ? L->scale : L->scale + (int64_t)wp.r0 * wp.sb;
    wp.ts = (int64_t)wp.step * wp.sb;
    /* FP4 scales not 4-byte aligned: NaN outputs, the weight bytes read as
     * scales instead (aligned); UP: either tensor's (h needs both tiles) */
    wp.bad = !FP8 && ((uintptr_t)(UP ? (uintptr_t)s.E->w1.scale | (uintptr_t)s.E->w3.scale
                                     : (uintptr_t)L->scale) & 3) != 0;
    if (wp.bad) {
        wp.sc = wp.w;
        wp.ts = wp.tw;
    }
    for (int p = 0; p < s.n; p += 16) {
        if (s.n - p <= 8)
            fm3_pass<UP, FP8, 1>(a, s, wp, p, rt0, nrt, t, qt, ring, scf, red);
        else
            fm3_pass<UP, FP8, 2>(a, s, wp, p, rt0, nrt, t, qt, ring, scf, red);
    }
}

/*
 * The expert of slot y (blockIdx.y) into *s: 1 the shared expert (FP8), 2 a
 * routed one (FP4), 0 an idle slot (the whole block leaves).
 */
static __device__ __forceinline__ int
fm3_slot_get(const struct fm3_args &a, int y, struct fm3_slot *s)
{
    const int32_t *act_e = a.grp + 1, *act_off = a.grp + 1 + a.A;

    if (a.has_shared && y == 0) {
        s->E = &a.shared;
        s->rows = NULL;
        s->n = a.T;
        return 1;
    }
    y -= a.has_shared;
    if (y >= a.grp[0])
        return 0;
    s->E = &a.table[act_e[y]];
    s->rows = a.grp + 2 + 2 * a.A + act_off[y];
    s->n = act_off[y + 1] - act_off[y];
    return 2;
}

/*
 * UP: w1/w3/SwiGLU, grid (I/16 / RT, slots); else w2, grid (D/32 / RT,
 * slots): a block of 8 warps takes RT = a.rt row tiles one after the other
 * (16 rows of w1 and w3, or 32 rows of w2, each); warp w: tile (w/4) & 1,
 * quarter w & 3 of K.  Dynamic shared memory: fm3_smem_bytes.
 */
template <int UP>
static __global__ void __launch_bounds__(FM3_BOUND_THREADS, FM3_BOUND_BLOCKS)
fm3_kernel(struct fm3_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    extern __shared__ __align__(16) char fm3_sm[];
    struct fm3_slot s;
    int warp = threadIdx.x >> 5, t = (warp >> 2) & 1, qt = warp & 3, rt0 = blockIdx.x * a.rt;
    int per = a.ns * FM3_STAGE_B + FM3_SCF_B, y = blockIdx.y;
    char *ring = fm3_sm + warp * per;
    float *scf = (float *)(ring + a.ns * FM3_STAGE_B);
    float *red = (float *)(fm3_sm + 8 * per);

    switch (fm3_slot_get(a, y, &s)) {
    case 1:
        fm3_passes<UP, 1>(a, s, rt0, a.rt, t, qt, ring, scf, red);
        break;
    case 2:
        fm3_passes<UP, 0>(a, s, rt0, a.rt, t, qt, ring, scf, red);
        break;
    default:
        break;   /* an idle slot: the whole block leaves */
    }
}

/* --- v5: persistent warps, each a tile of 16 rows of A over all of K -------------- */

#define FM5_NS 3   /* ring stages per warp (3, 4, 6 measured: perf.md run 25) */
#define FM5_SG_GROUP (32 * 16)   /* SG: a scale group of the wide tiles, 16 bytes a lane */
#define FM5_SG_B (2 * FM5_SG_GROUP)   /* SG: a warp's two scale groups */
/* shared memory per warp: the ring, the converted scales, with SG the scale groups */
#define FM5_PER_SG(SG) (FM5_NS * FM3_STAGE_B + FM3_SCF_B + ((SG) ? FM5_SG_B : 0))
#define FM5_PER FM5_PER_SG(0)
#define FM5_TEAM_F (4 * 4 * 32)   /* floats of a team's quarter sums (fm5_team) */
#define FM5_ROWS(UP) ((UP) ? 8 : 16)  /* output rows of a tile (fm5_tile) */
/* fm5_kernel's blocks: 4 warps each; 5 blocks (20 warps) an SM where the
 * kernel fits 96 registers without spilling (down with whole tiles: P = 1,
 * the batch-16 form), else 4 (16 warps, 128 registers; up, and teams).
 * Against 8-warp blocks two an SM (perf.md run 36): batch-16 down 123 ->
 * 117 us a layer, up 233 -> 230.  The up kernel at 96 registers (20 warps)
 * is no faster, with w1 / w3 tiles of 16 rows each (perf.md run 36) or of 8
 * (run 42). */
#define FM5_WARPS 4
#define FM5_BLOCKS(UP, P, MT) ((UP) || (P) > 1 || (MT) > 1 ? 4 : 5)
#define FM5_SMEM_SG(P, SG) \
    (FM5_WARPS * FM5_PER_SG(SG) + ((P) > 1 ? FM5_WARPS / (P) * FM5_TEAM_F * 4 : 0))
#define FM5_SMEM(P) FM5_SMEM_SG(P, 0)

/* A warp's tile of one slot's expert: 16 rows of A, two halves of 8 rows
 * (UP: rows row .. row + 7 of w1, then the same rows of w3, so that a
 * thread's C fragment holds g and u of one output; down: rows row .. row +
 * 15 of w2). */
struct fm5_tile {
    const uint8_t *w[2];    /* half h's first weight row */
    const uint8_t *sc[2];   /* FP4: half h's first row's scales; FP8: its scale array */
    int row;                /* the tile's first output row */
    int rb, sb;             /* bytes per weight row; FP4 scale bytes per row */
    int bad;                /* FP4 scales not 4-byte aligned: NaN outputs */
};

/* The tile at output row `row` of slot s's expert (fm3_passes' pointers
 * and its rule for misaligned FP4 scales). */
template <int UP, int FP8>
static __device__ __forceinline__ void
fm5_tile_get(const struct fm3_args &a, const struct fm3_slot &s, int row, struct fm5_tile *tl)
{
    int K = UP ? a.D : a.I;

    tl->row = row;
    tl->rb = FP8 ? K : K / 2;
    tl->sb = K / 32;
    tl->bad = !FP8 && ((UP ? (uintptr_t)s.E->w1.scale | (uintptr_t)s.E->w3.scale
                           : (uintptr_t)s.E->w2.scale) & 3) != 0;
    for (int h = 0; h < 2; h++) {
        const struct dsv4_linear *L = UP ? (h ? &s.E->w3 : &s.E->w1) : &s.E->w2;
        int r = UP ? row : row + 8 * h;

        tl->w[h] = (const uint8_t *)L->w + (int64_t)r * tl->rb;
        tl->sc[h] = FP8 ? L->scale : tl->bad ? tl->w[h] : L->scale + (int64_t)r * tl->sb;
    }
}

/* The e4m3 pair in the low (hi = 0) or high half of v as an f16x2 (exact). */
static __device__ __forceinline__ uint32_t
fm5_h2(uint32_t v, int hi)
{
    uint32_t d;

    if (hi)
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }"
            : "=r"(d) : "r"(v));
    else
        asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }"
            : "=r"(d) : "r"(v));
    return d;
}

/*
 * d = the m16n8k32 e4m3 product of A (a0..a3, e4m3) and B (v5's f16 words
 * bh[0..3]) on a zero accumulator, as two native m16n8k16 f16 mma: the
 * first on the low e4m3 pair of every register (k 4q, 4q+1, 16+4q, 16+4q+1
 * of the k32 step), the second on the high pairs, accumulating.  Hopper has
 * no FP8 mma.sync: the compiler emulates fk_mma_e4m3 the same way (two
 * HMMA.16816 on F2FP-unpacked halves) but also unpacks B every time and
 * adds the zero accumulator afterwards; here B comes unpacked from memory.
 */
static __device__ __forceinline__ void
fm5_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, const uint32_t *bh)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(fm5_h2(a0, 0)), "r"(fm5_h2(a1, 0)), "r"(fm5_h2(a2, 0)),
                   "r"(fm5_h2(a3, 0)), "r"(bh[0]), "r"(bh[1]), "f"(0.0f));
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(fm5_h2(a0, 1)), "r"(fm5_h2(a1, 1)), "r"(fm5_h2(a2, 1)),
                   "r"(fm5_h2(a3, 1)), "r"(bh[2]), "r"(bh[3]));
}

/* Group m of a block's activations: xh[4m .. 4m+3] = the 16 bytes at p. */
static __device__ __forceinline__ void
fm5_act_group(uint32_t *xh, int m, const uint4 *p)
{
    uint4 v = __ldg(p);

    xh[4 * m] = v.x;
    xh[4 * m + 1] = v.y;
    xh[4 * m + 2] = v.z;
    xh[4 * m + 3] = v.w;
}

/* The activations of one 128-column block (one n-tile): xh = thread q's 64
 * bytes of v5's f16 words, group m at xp + 4m (fm3_h; xp: the block's
 * first 16 bytes of thread q). */
static __device__ __forceinline__ void
fm5_act(uint32_t (&xh)[16], const uint4 *xp)
{
#pragma unroll
    for (int m = 0; m < 4; m++)
        fm5_act_group(xh, m, xp + 4 * m);
}

/*
 * v5's B operand of fm3_block: the f16 words of fm5_act in xh; d =
 * fm5_mma.  Once group m's words are used, the same registers take group m
 * of the block the warp reads next (at nx), so each block's B is asked for
 * a block ahead instead of right before its first mma (Nsight Compute: the
 * first mma of a stage had waited on those loads).
 */
struct fm5_bh {
    uint32_t *xh;
    const uint4 *nx;
    bool keep;      /* B is used again (wide tiles' m-tile 0): no load in done */

    __device__ __forceinline__ void
    mma(float (&d)[4], int, int m, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) const
    {
        fm5_mma(d, a0, a1, a2, a3, &xh[4 * m]);
    }

    __device__ __forceinline__ void
    done(int m) const
    {
        if (!keep)
            fm5_act_group(xh, m, nx + 4 * m);
    }
};

/*
 * v5's issue cursor: where the lane's copies of the next stage to issue
 * come from (its row piece in half 0 and in half 1 of the tile, gw[h], the
 * rows 4 below them at r4; FP4: its 4 scale bytes gs); pointers step
 * instead of being recomputed from the stage each time (Nsight Compute:
 * about 35 integer instructions per stage for five copies).
 */
struct fm5_cursor {
    const uint8_t *gw[2], *gs;
    int r4;                 /* bytes from row i to row i + 4 */
    int sg16;               /* SG, 16-byte aligned scales: fm5_issue copies a lane's
                               scales of four stages at once (fm5_sg_off) */
    uint32_t sgb;           /* shared address of the warp's two scale groups */
    int ef;                 /* narrow tile of one pass: copies evict_first (pol) */
    uint64_t pol;
};

/* SG: byte offset, in the warp's scale groups, of this lane's scale word of
 * stage k of the pass: stages 4j .. 4j + 3 are group j & 1, 16 bytes a lane,
 * a word a stage (fm5_issue copies the lane's 16 bytes at stage 4j). */
static __device__ __forceinline__ uint32_t
fm5_sg_off(int k)
{
    return ((k >> 2) & 1) * FM5_SG_GROUP + (threadIdx.x & 31) * 16 + (k & 3) * 4;
}

/* The cursor at stage st0 of the tile: lane l copies segment l & 7 of rows
 * l / 8 and 4 + l / 8 of each half (the tile's rows i * 4 + l / 8, i = 0
 * .. 3) and scale bytes 4 (l & 1) .. of row l / 2 (half l / 16).  Wide
 * tiles (MT = 2, FP4; fm5_pass): a stage is one 128-column block of 32
 * rows, held as 16 rows of 128 bytes whose segments 0-3 are m-tile 0's row
 * and segments 4-7 m-tile 1's (UP: rows r + 8 mt + i of w1 and w3, down:
 * rows r + 16 mt + i of w2), and a row's 8 scale bytes m-tile 0's 4, then
 * m-tile 1's: so fm3_block's block b = mt reads m-tile mt of the stage. */
template <int UP, int FP8, int MT, int SG, int EF>
static __device__ __forceinline__ void
fm5_cursor_at(struct fm5_cursor *c, const struct fm5_tile &tl, int st0, int ef)
{
    /* the m-tile of the lane's segment and of its scale bytes (0 unless
     * wide), the rows an m-tile further down */
    const int lane = threadIdx.x & 31, seg = lane & 7, ms = MT == 2 ? seg >> 2 : 0;
    const int mc = MT == 2 ? lane & 1 : 0, mrows = UP ? 8 : 16;
    const int off =
        (mrows * ms + (lane >> 3)) * tl.rb + (seg & (8 / MT - 1)) * 16 + st0 * (FM3_SB / MT);
    /* UP: half lane / 16's scale rows (w1 or w3); down: the halves' rows are one run */
    const int srow = UP ? (lane >> 1) & 7 : lane >> 1;

    c->gw[0] = tl.w[0] + off;
    c->gw[1] = tl.w[1] + off;   /* UP only (fm5_issue) */
    c->gs = FP8 ? NULL
                : (UP && (lane >> 4) ? tl.sc[1] : tl.sc[0]) + (srow + mrows * mc) * tl.sb +
                      (MT == 1 ? (lane & 1) * 4 : 0) + st0 * (8 / MT);
    c->r4 = 4 * tl.rb;
    c->sg16 = SG && !FP8 && !tl.bad && st0 == 0 && ((uintptr_t)c->gs & 15) == 0;
    /* a narrow tile's rows are read by one pass: L2 may drop them first
     * (wide tiles read each 256-byte line over four stages, and a tile of
     * several passes reads it again: not for them; docs/perf.md run 55) */
    c->ef = EF && ef;
    c->pol = c->ef ? fm3_ef_policy() : 0;
}

/* The next stage, stage k of the pass, into the ring slot at shared address
 * sb (fm3_issue's placement; so: the lane's four shared offsets); then the
 * cursor steps.
 * UP: the halves are two tensors; down: rows of one (gw[1] = gw[0] + 2
 * r4, not kept: one register pair fewer). */
template <int UP, int FP8, int MT, int SG, int EF>
static __device__ __forceinline__ void
fm5_issue(struct fm5_cursor *c, uint32_t sb, const uint32_t (&so)[4], int k)
{
    const uint8_t *src[4] = { c->gw[0], c->gw[0] + c->r4, UP ? c->gw[1] : c->gw[0] + 2 * c->r4,
                              UP ? c->gw[1] + c->r4 : c->gw[0] + 3 * c->r4 };

    if (EF && c->ef)
#pragma unroll
        for (int i = 0; i < 4; i++)
            fm3_cp16_ef(sb + so[i], src[i], c->pol);
    else
#pragma unroll
        for (int i = 0; i < 4; i++)
            fm3_cp16(sb + so[i], src[i]);
    if (!FP8) {
        if (!SG || !c->sg16)
            fm3_cp4(sb + FM3_TILE_B + (threadIdx.x & 31) * 4, c->gs);
        else if ((k & 3) == 0)   /* this and the next three stages' */
            fm3_cp16(c->sgb + fm5_sg_off(k), c->gs);
        c->gs += 8 / MT;
    }
    c->gw[0] += FM3_SB / MT;
    c->gw[1] += FM3_SB / MT;
}

/*
 * The team of warps that shares v5's items (fm5_kernel): P = 1, 2 or 4
 * consecutive warps of the block; warp j of the team streams quarters
 * j * 4/P .. (j + 1) * 4/P - 1 of K of each part of the item's tile.  The
 * team's first warp folds the quarters in order, its own from registers
 * and the others' through `part`, so the outputs are those of one warp
 * taking the whole tile (P = 1), bit for bit.
 */
struct fm5_team {
    int j;          /* this warp's place in the team (0 .. P - 1) */
    int bar;        /* the team's named barrier (1 + the team's index) */
    float *part;    /* the team's quarter sums: [quarter][4][32 lanes] */
};

/* The P warps of the team meet (named barrier tm.bar; shared memory ordered). */
template <int P>
static __device__ __forceinline__ void
fm5_team_sync(const struct fm5_team &tm)
{
    asm volatile("bar.sync %0, %1;" :: "r"(tm.bar), "n"(P * 32) : "memory");
}

/*
 * Slot rows p .. p + 7 through the warp's tile over all of K (over its
 * quarters of K, in a team of P > 1: fm5_team): one stream of stages
 * through the warp's ring, FM5_NS - 1 ahead; per 128-column block
 * fm3_block and fm3_block_end's expression exactly as v3, a quarter's
 * blocks into acc, the quarters folded in order into tot (((Q0 + Q1) + Q2)
 * + Q3: fm3_tile_end's order), so every output is v3's bit for bit (an
 * output of an mma depends only on its own A row and B column); then h
 * (UP: the SwiGLU of g, C rows g, and u, C rows g + 8 of the same thread,
 * as fm3_tile_end) or y stored by the warp itself.  No block barrier: the
 * warps of a block are independent.  Wide tiles (MT = 2: FP4, P = 1;
 * fm5_cursor_at): two m-tiles of 16 rows, a stage one block of both, each
 * block's B (the activations, loaded a block ahead) used by both m-tiles'
 * mma: half the activation loads per weight byte, the loads that kept L1
 * busy (docs/perf.md run 43).  Each output is the same sum in the same
 * order as with MT = 1.
 */
template <int UP, int FP8, int P, int MT, int SG, int EF>
static __device__ void
fm5_pass(const struct fm3_args &a, const struct fm3_slot &s, const struct fm5_tile &tl, int p,
         char *ring, float *scf, const struct fm5_team &tm)
{
    static_assert(MT == 1 || (MT == 2 && !FP8 && P == 1), "wide tiles: FP4, one warp an item");
    static_assert(!SG || MT == 2, "scale groups: wide tiles only");
    constexpr int BPS = FP8 || MT == 2 ? 1 : 2;   /* 128-column blocks per stage */
    const int lane = threadIdx.x & 31, seg = lane & 7, g = lane >> 2, q = lane & 3;
    const int K = UP ? a.D : a.I, nb = K / 128, nq = nb / 4;
    const int nqw = 4 / P, q0 = P == 1 ? 0 : tm.j * nqw;   /* the warp's quarters */
    const int nst = nqw * (nq / BPS), st0 = q0 * (nq / BPS);   /* and stages */
    const uint32_t rs = (uint32_t)__cvta_generic_to_shared(ring);
    const uint32_t rend = rs + FM5_NS * FM3_STAGE_B;
    const char *sg = ring + FM5_NS * FM3_STAGE_B + FM3_SCF_B;   /* SG: the scale groups */
    const uint8_t *xr[1];
    const uint16_t *xhr;
    const float *sr[1][2];
    uint32_t xh[16];
    float xc[1][2];
    float tot[MT][1][4], acc[MT][1][4], blk[MT][1][4];
    uint32_t so[4], isb = rs;
    int slot = 0, gi = 0;
    int64_t orow[2];
    float ow[2];
    struct fm5_cursor cur;

#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        fm3_zero<1>(tot[mt]);
        fm3_zero<1>(acc[mt]);
        fm3_zero<1>(blk[mt]);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int row = i * 4 + (lane >> 3);

        so[i] = (uint32_t)(row * FM3_SB + ((seg ^ (row & 7)) << 4));
    }
    fm3_act_rows<UP, FP8, 1>(a, s, p, xr, sr);
    /* the output rows of this lane's C columns (slot rows p + 2q, p + 2q + 1)
     * and their route weights, asked now rather than after the last stage */
#pragma unroll
    for (int c = 0; c < 2; c++) {
        int j = p + 2 * q + c;

        orow[c] = j >= s.n ? -1 : s.rows != NULL ? s.rows[j] : (int64_t)a.T * a.k + j;
        ow[c] = UP && s.rows != NULL && j < s.n ? a.weights[orow[c]] : 1.0f;
    }
    xhr = (UP ? (FP8 ? a.xh8 : a.xh4) : a.hh) + (xr[0] - (UP ? (FP8 ? a.xq8 : a.xq4) : a.hq));
    fm5_cursor_at<UP, FP8, MT, SG, EF>(&cur, tl, st0, a.ef && s.n <= 8);
    cur.sgb = (uint32_t)__cvta_generic_to_shared(sg);
    for (int i = 0; i < FM5_NS - 1; i++) {
        if (i < nst)
            fm5_issue<UP, FP8, MT, SG, EF>(&cur, isb, so, i);
        fm3_commit();
        isb += FM3_STAGE_B;
    }
    /* the warp's blocks of the activations, the first's words and scales
     * now, every next one's a block ahead */
    const uint4 *xb0 = (const uint4 *)(xhr + q * 8) + st0 * BPS * (128 * 2 / 16);
    const float *xs0 = sr[0][0] + st0 * BPS, *xs1 = sr[0][1] + st0 * BPS;
    const int nblk = nst * BPS;
    int jb = 0;   /* the current block's place among the warp's */

    fm5_act(xh, xb0);
    xc[0][0] = __ldg(xs0);
    xc[0][1] = __ldg(xs1);
    /* the warp's quarters, nq / BPS stages each, then the quarter folded (nq
     * is even: K a multiple of 1,024), so the stage loop holds no fold */
#pragma unroll 1
    for (int qn = q0, st = st0; qn < q0 + nqw; qn++) {
#pragma unroll 1
        for (int se = st + nq / BPS; st < se; st++, gi++) {
            char *buf = ring + slot * FM3_STAGE_B;

            asm volatile("cp.async.wait_group %0;" :: "n"(FM5_NS - 2) : "memory");
            __syncwarp();   /* every lane's copies of this stage; the previous one is read */
            if (!FP8) {
                if (SG && cur.sg16)
                    fm3_scales_word(*(const uint32_t *)(sg + fm5_sg_off(gi)), scf);
                else
                    fm3_scales(buf, scf);
                __syncwarp();
            }
            if (gi + FM5_NS - 1 < nst)
                fm5_issue<UP, FP8, MT, SG, EF>(&cur, isb, so, gi + FM5_NS - 1);
            fm3_commit();
            isb = isb + FM3_STAGE_B == rend ? rs : isb + FM3_STAGE_B;
#pragma unroll
            for (int b = 0; b < BPS; b++) {
                float f0 = 64.0f, f1 = 64.0f;

                if (FP8) {   /* the 128x128 block scales of the halves' rows */
                    int64_t si = (int64_t)(tl.row / 128) * nb + st * BPS + b;

                    f0 = cu_e8m0_to_f32(__ldg(tl.sc[0] + si));
                    f1 = UP ? cu_e8m0_to_f32(__ldg(tl.sc[1] + si)) : f0;
                }
                int jn = jb + 1 == nblk ? 0 : jb + 1;   /* after the last: the first again */
                float xn[1][2] = { { __ldg(xs0 + jn), __ldg(xs1 + jn) } };
                const uint4 *nx = xb0 + jn * (128 * 2 / 16);

                if (MT == 1) {
                    fm3_block<FP8, 1>(blk[0], buf, b, scf, fm5_bh{ xh, nx, false });
                } else {   /* m-tile mt is the stage's block mt */
                    fm3_block<FP8, 1>(blk[0], buf, 0, scf, fm5_bh{ xh, nx, true });
                    fm3_block<FP8, 1>(blk[MT - 1], buf, 1, scf, fm5_bh{ xh, nx, false });
                }
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
                    fm3_block_end<1>(acc[mt], blk[mt], xc, f0, f1);
                xc[0][0] = xn[0][0];
                xc[0][1] = xn[0][1];
                jb = jn;
            }
            slot = slot == FM5_NS - 1 ? 0 : slot + 1;
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {   /* quarter qn is complete */
                if (P == 1 || tm.j == 0)
                    tot[mt][0][i] = qn == 0 ? acc[mt][0][i] : tot[mt][0][i] + acc[mt][0][i];
                else   /* to the team's first warp */
                    tm.part[(qn * 4 + i) * 32 + lane] = acc[mt][0][i];
                acc[mt][0][i] = 0.0f;
            }
    }
    __syncwarp();   /* the ring is read before the next pass refills it */
    if (P > 1) {   /* the other warps' quarters, in order; part is free again after */
        fm5_team_sync<P>(tm);
        if (tm.j == 0)
            for (int qn = nqw; qn < 4; qn++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    tot[0][0][i] += tm.part[(qn * 4 + i) * 32 + lane];
        fm5_team_sync<P>(tm);
        if (tm.j != 0)
            return;
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < (UP ? 2 : 4); i++) {
            int row = tl.row + (UP ? 8 : 16) * mt + g + 8 * (i >> 1);
            int64_t hr = orow[i & 1];

            if (hr < 0)
                continue;
            if (UP) {   /* g: half 0 (w1), u: half 1 (w3) */
                float v = cu_swiglu(tot[mt][0][i], tot[mt][0][i + 2], a.lim);

                if (s.rows != NULL)
                    v *= ow[i & 1];
                a.h[hr * a.I + row] = tl.bad ? __int_as_float(0x7fc00000) : cu_bf16_round(v);
            } else {
                a.y[hr * a.D + row] =
                    tl.bad ? __int_as_float(0x7fc00000) : cu_bf16_round(tot[mt][0][i]);
            }
        }
}

/* The passes of slot rows p0 .. p1 - 1 through the tile at `row` (v5):
 * passes of 8 slot rows (one n-tile; two n-tiles spill registers), a later
 * pass of a tile reading its weights from L2. */
template <int UP, int FP8, int P, int MT, int SG, int EF>
static __device__ void
fm5_passes(const struct fm3_args &a, const struct fm3_slot &s, int row, int p0, int p1,
           char *ring, float *scf, const struct fm5_team &tm)
{
    struct fm5_tile tl;

    fm5_tile_get<UP, FP8>(a, s, row, &tl);
    for (int p = p0; p < p1 && p < s.n; p += 8)
        fm5_pass<UP, FP8, P, MT, SG, EF>(a, s, tl, p, ring, scf, tm);
}

/*
 * v5 (DSV4_CUDA_FAST_MOE "v5"): UP, w1/w3/SwiGLU, else w2.  Items: first
 * the shared expert's (tile, pass of 8 of its T rows), tile-major
 * (a tile's passes run side by side, its weights read from DRAM once and
 * from L2 after: at prefill T the shared expert has T / 8 passes, which one
 * warp alone would take long after the rest), then the active experts'
 * (slot, tile) with all their passes; every warp takes the next item from
 * the call's counter (ctr[UP], zeroed by fm3_prep_kernel) until none is
 * left, so the grid only needs to fill the SMs it gets (also under MPS)
 * and the results do not depend on which warp takes an item (a.place:
 * where the grid's teams outnumber the items, a team's place in the grid
 * is its item and the counter is not asked; fm5_place_sw).  P > 1:
 * teams of P warps take the items (fm5_team).  MT = 2: the active experts'
 * tiles are wide (two m-tiles, fm5_pass; the shared expert's stay).
 * Blocks of FM5_WARPS warps, FM5_BLOCKS(UP, P, MT) an SM.  Dynamic shared
 * memory: the warps' rings and scales, and the teams' quarter sums
 * (FM5_SMEM_SG(P, SG)).  SG (wide tiles only; default, fm5_sg_sw): each
 * warp also holds two scale groups, and the wide tiles copy their FP4
 * scales four stages at a time (fm5_issue).
 */
template <int UP, int P, int MT, int SG = 0>
static __global__ void __launch_bounds__(FM5_WARPS * 32, FM5_BLOCKS(UP, P, MT))
fm5_kernel(struct fm3_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    extern __shared__ __align__(16) char fm3_sm[];
    __shared__ int taken[FM5_WARPS][2];   /* a team's items, by the parity of its turn */
    int warp = threadIdx.x >> 5, tiles = (UP ? a.I : a.D) / FM5_ROWS(UP), wide = tiles / MT;
    char *ring = fm3_sm + warp * FM5_PER_SG(SG);
    float *scf = (float *)(ring + FM5_NS * FM3_STAGE_B);
    int ps = a.has_shared ? (a.T + 7) / 8 : 0, nsh = tiles * ps;
    int items = nsh + a.grp[0] * wide;
    struct fm5_team tm;

    tm.j = warp % P;
    tm.bar = 1 + warp / P;
    tm.part = (float *)(fm3_sm + FM5_WARPS * FM5_PER_SG(SG)) + (warp / P) * FM5_TEAM_F;
    /* one item at most a team (a.place, the grid's teams outnumber the
     * items: a batch-1 call): the team's place in the grid is its item, no
     * counter (every warp asking it at once, then again to find none left) */
    const int teams = (int)gridDim.x * (FM5_WARPS / P);
    const int placed = a.place && teams >= items;

    for (int turn = 0;; turn ^= 1) {
        struct fm3_slot s;
        int it = 0;

        if (placed) {
            if (turn != 0)
                break;
            it = (int)blockIdx.x * (FM5_WARPS / P) + warp / P;
        } else {
            if ((threadIdx.x & 31) == 0 && tm.j == 0)
                it = atomicAdd(&a.ctr[UP], 1);
            if (P == 1) {
                it = __shfl_sync(0xffffffffu, it, 0);
            } else {   /* the first warp's item to the team (parity: a slow warp still
                          reads its turn's entry, the next turn writing the other) */
                if ((threadIdx.x & 31) == 0 && tm.j == 0)
                    taken[warp / P][turn] = it;
                fm5_team_sync<P>(tm);
                it = taken[warp / P][turn];
            }
        }
        if (it >= items)
            break;
        if (it < nsh) {   /* the shared expert: one pass of one tile */
            int p = (it % ps) * 8;

            if (fm3_slot_get(a, 0, &s) == 1)
                fm5_passes<UP, 1, P, 1, 0, MT == 1>(a, s, (it / ps) * FM5_ROWS(UP), p, p + 8,
                                                    ring, scf, tm);
            continue;
        }
        it -= nsh;
        if (fm3_slot_get(a, a.has_shared + it / wide, &s) == 2)
            fm5_passes<UP, 0, P, MT, SG, MT == 1>(a, s, (it % wide) * MT * FM5_ROWS(UP), 0, s.n,
                                                  ring, scf, tm);
    }
}

/* --- host side ------------------------------------------------------------------------------ */

int
cuda_fast_moe3_fits(int T, int k, int D, int I)
{
    return T >= 1 && k >= 1 && (int64_t)T * k <= FM3_MAX_TK && D % 1024 == 0 &&
           I % 1024 == 0 && D / 128 <= FM3_MAX_KB && I / 128 <= FM3_MAX_KB;
}

/* Settings: DSV4_CUDA_FAST_MOE unset or "v5": v5, its warps per item and
 * m-tiles by the call (fm5_parts, fm5_wide); "v5,P": v5 with P warps per
 * item (1, 2, 4); "v5,P,MT": and MT m-tiles (1, 2; 2 only where P is 1);
 * "v3",
 * "v3,NS" or "v3,NS,RT": v3.  Until v5 had teams (docs/perf.md run 35),
 * v3 was the default for moe_parts below 8 tokens, where whole tiles per
 * warp left most warps idle. */
struct fm3_cfg {
    int v5;     /* fm5_kernel: 1, 0 (fm3_kernel), -1: unset (v5) */
    int ns;     /* v3: ring stages per warp: 2 .. 6 */
    int rt;     /* v3: row tiles per block: 1, 2, 4, 8, or 0: by the number of tiles */
    int p5;     /* v5: warps per item: 1, 2, 4, or 0: by the number of items (fm5_parts) */
    int mt;     /* v5: m-tiles of an active expert's item: 1, 2, or 0: by the call (fm5_wide) */
};

#define FM3_NS_DEFAULT 4         /* 81 KB per block: two blocks (16 warps) per SM */
#define FM3_BLOCKS_AUTO 4224     /* rt = 0: at least this many blocks (16 waves of 264) */

static void
fm3_cfg_parse(struct fm3_cfg *c, const char *s)
{
    int ns, rt, n;

    c->v5 = s == NULL ? -1 : strncmp(s, "v5", 2) == 0;
    n = s != NULL && !c->v5 ? sscanf(s, "v3,%d,%d", &ns, &rt) : 0;
    c->ns = FM3_NS_DEFAULT;
    c->rt = 0;
    c->p5 = 0;
    c->mt = 0;
    if (c->v5 > 0) {
        int p5, mt, n5 = sscanf(s, "v5,%d,%d", &p5, &mt);

        if (n5 >= 1 && (p5 == 1 || p5 == 2 || p5 == 4))
            c->p5 = p5;
        if (n5 == 2 && (mt == 1 || mt == 2))
            c->mt = mt;
    }
    if (n >= 1 && ns >= 2 && ns <= 6)
        c->ns = ns;
    if (n >= 2 && (rt == 1 || rt == 2 || rt == 4 || rt == 8))
        c->rt = rt;
}

/* v5's warps per item (fm5_team) for `items` items at most on a device of
 * `warps` resident warps of the teams' kernel (FM5_BLOCKS(UP, 2, 1)): the
 * setting, else the most (4, 2, 1) whose teams take every item at once.
 * Small calls have fewer items than warps (one token: 7 slots x 128 tiles
 * of w1 / w3 for 2,112 warps), and a warp streaming a whole tile alone is
 * bound by its own ring's latency: a team streams the tile's quarters side
 * by side.  But a P that leaves items for a second round of the teams costs
 * that round's latency again for the items' last fraction: at batch 1 the
 * up kernel's 896 items took 32.0 us as 4-warp teams (1.7 rounds) and 29.2
 * as 2-warp teams (one round), the down kernel's 1,792 items 20.2 us in
 * pairs (1.7 rounds) and 17.4 us alone (one round) (H200, docs/perf.md run
 * 38; until then the fewest P that gave every resident warp a share).  The
 * results do not depend on it. */
static int
fm5_parts(const struct fm3_cfg *c, int64_t items, int64_t warps)
{
    if (c->p5 > 0)
        return c->p5;
    if (items * 4 <= warps)
        return 4;
    return items * 2 <= warps ? 2 : 1;
}

/* v5's m-tiles an item (fm5_pass) for calls of one warp an item, of
 * `items` wide items at most (every slot active) on `warps` resident warps
 * of the wide kernel: the setting, else wide tiles where they would leave
 * four rounds of items.  A wide item is twice as long, so is the last
 * round's tail: at 8 tokens (6,272 wide items at most, fewer active) the
 * wide tiles were slower with half the experts held (moe_parts 0.49 of
 * 4.3 TB/s against 0.55), at 16 faster (0.66 against 0.64; all held: 0.75
 * against 0.70; H200, docs/perf.md run 43).  The results do not depend on
 * it. */
static int
fm5_wide(const struct fm3_cfg *c, int64_t items, int64_t warps)
{
    if (c->mt > 0)
        return c->mt;
    return items >= 4 * warps ? 2 : 1;
}

/* Row tiles per block for `tiles` row tiles of each of `slots` slots: the
 * setting, else the most (up to 8) that leave FM3_BLOCKS_AUTO blocks (long
 * blocks for less per-block setup, many for a short tail).  The results do
 * not depend on it. */
static int
fm3_rt(const struct fm3_cfg *c, int tiles, int slots)
{
    int rt = c->rt;

    if (rt == 0)
        for (rt = 8; rt > 1 && (int64_t)slots * tiles / rt < FM3_BLOCKS_AUTO; rt /= 2)
            ;
    while (tiles % rt != 0)
        rt /= 2;
    return rt;
}

/* Dynamic shared memory of a block: the 8 warps' rings and scales, and the
 * quarter sums of a row tile (7: all but one). */
static size_t
fm3_smem_bytes(const struct fm3_cfg *c)
{
    size_t per = (size_t)c->ns * FM3_STAGE_B + FM3_SCF_B;

    return 8 * per + 7 * FM3_RED_Q * sizeof(float);
}

/*
 * DSV4_CUDA_FM5_SG16 (default on; 0 = the 4-byte copy of every stage): the
 * wide tiles copy their FP4 scales four stages at a time, one 16-byte
 * cp.async a lane (the 4-byte one of every stage took 32 shared-memory
 * wavefronts, 57% of the up kernel's excess in Nsight Compute), from two
 * scale groups of 512 bytes more shared memory a warp.  The same scales
 * reach the same lanes: the same bits.  docs/perf.md run 55: the 20-layer
 * batch-16 step 9.82-9.83 -> 9.73-9.79 ms, the up kernel's `Mem Busy' 77
 * -> 57%.
 */
static struct cuda_switch fm5_sg_sw = CUDA_SWITCH("DSV4_CUDA_FM5_SG16", 1);
/* DSV4_CUDA_FM5_EF (default on; 0 = plain copies): the narrow tiles of one
 * pass (a slot of at most 8 rows, in kernels of narrow tiles) copy their
 * weights with an L2 evict_first policy.  docs/perf.md run 55: the
 * 20-layer batch-1 step 3.31-3.34 -> 3.28-3.30 ms, batch 4 and 16
 * unchanged; a build with it on every copy made batch 16 +1.5 ms (the wide
 * tiles' 256-byte lines then leave L2 before their last stage reads them). */
static struct cuda_switch fm5_ef_sw = CUDA_SWITCH("DSV4_CUDA_FM5_EF", 1);
/* DSV4_CUDA_FM5_PLACE (default on; 0 = the counter always): where the
 * grid's teams outnumber the call's items (one round: a batch-1 call's
 * 1,792 items on 1,792 warps), each team takes the item at its place in
 * the grid instead of asking the counter, which every warp asked at once
 * and then again to find nothing left.  Which team takes an item does not
 * change a result.  A block that the SMs take late (MPS) then delays its
 * own item, where the counter would have let an early warp take it.
 * docs/perf.md run 65: the 20-layer batch-1 step 3.20-3.21 -> 3.14 ms (up
 * 27.8 -> 26.1 us, down 17.7 -> 15.9); placing the first item of every
 * call made batch 16 slower (9.47-9.50 -> 9.56-9.57 ms), so larger calls
 * keep the counter. */
static struct cuda_switch fm5_place_sw = CUDA_SWITCH("DSV4_CUDA_FM5_PLACE", 1);

/* Launch fm5_kernel<UP, P, MT, SG> (teams of P warps, MT m-tiles an active
 * expert's item) on `blocks` blocks of FM5_WARPS warps, its shared memory
 * allowed first (once per device). */
template <int UP, int P, int MT, int SG = 0>
static enum dsv4_err
fm5_launch(struct dsv4_backend *be, const struct fm3_args &a, unsigned blocks)
{
    static size_t opted[CUDA_MAX_DEV];
    enum dsv4_err e =
        cuda_smem_allow(be, (const void *)fm5_kernel<UP, P, MT, SG>, FM5_SMEM_SG(P, SG), opted);

    if (e == DSV4_OK)
        cu_launch(fm5_kernel<UP, P, MT, SG>, blocks, FM5_WARPS * 32, FM5_SMEM_SG(P, SG),
                  cuda_stream(be), a);
    return e;
}

/* Launch fm3_kernel<UP> on `tiles` row tiles per slot (a.rt per block), or
 * (v5) fm5_kernel<UP> on a grid that fills the device's SMs. */
template <int UP>
static enum dsv4_err
fm3_launch(struct dsv4_backend *be, const struct fm3_args &a, const struct fm3_cfg *c,
           int tiles, int slots)
{
    static size_t opted[CUDA_MAX_DEV];
    size_t smem = fm3_smem_bytes(c);
    dim3 grid((unsigned)(tiles / a.rt), (unsigned)slots);
    enum dsv4_err e;

    if (c->v5) {
        int n_sm = cuda_sms(be);
        int64_t items = (int64_t)slots * tiles, sms = n_sm > 0 ? n_sm : 1, warps, busy;
        unsigned blocks;
        int P, MT = 1;

        warps = sms * FM5_WARPS * FM5_BLOCKS(UP, 2, 1);
        P = fm5_parts(c, items, warps);
        if (P == 1) {
            warps = sms * FM5_WARPS * FM5_BLOCKS(UP, 1, 2);
            MT = fm5_wide(c, items / 2, warps);
            if (MT == 1)
                warps = sms * FM5_WARPS * FM5_BLOCKS(UP, 1, 1);
            else
                items /= 2;
        }
        busy = items * P;
        /* whole teams: FM5_WARPS is a multiple of P */
        blocks = (unsigned)(((busy < warps ? busy : warps) + FM5_WARPS - 1) / FM5_WARPS);
        e = P == 1 && MT == 2 && cuda_switch_on(&fm5_sg_sw) ? fm5_launch<UP, 1, 2, 1>(be, a, blocks)
            : P == 1 && MT == 2 ? fm5_launch<UP, 1, 2>(be, a, blocks)
            : P == 1          ? fm5_launch<UP, 1, 1>(be, a, blocks)
            : P == 2          ? fm5_launch<UP, 2, 1>(be, a, blocks)
                              : fm5_launch<UP, 4, 1>(be, a, blocks);
        if (e != DSV4_OK)
            return e;
        CUDA_LAUNCHED(UP ? "fast moe v5 up" : "fast moe v5 down");
        return DSV4_OK;
    }
    e = cuda_smem_allow(be, (const void *)fm3_kernel<UP>, smem, opted);
    if (e != DSV4_OK)
        return e;
    cu_launch(fm3_kernel<UP>, grid, 8 * 32, smem, cuda_stream(be), a);
    CUDA_LAUNCHED(UP ? "fast moe v3 up" : "fast moe v3 down");
    return DSV4_OK;
}

enum dsv4_err
cuda_fast_moe3(struct dsv4_backend *be, float *out, float *parts, const float *x,
               const int32_t *ids, const float *weights, const struct dsv4_expert_w *table,
               int n_table, const struct dsv4_expert_w *shared, int T, int k, int D, int I,
               float lim, const char *cfg)
{
    cudaStream_t st = cuda_stream(be);
    int Tk = T * k, A = Tk < n_table ? Tk : n_table, R = Tk + T;
    int slots = A + (shared != NULL), nbD = D / 128, nbI = I / 128;
    size_t b_grp = cuda_align((size_t)(2 + 2 * A + Tk + 2) * sizeof(int32_t));   /* + ctr */
    size_t b_xq = cuda_align((size_t)T * D), b_xs = cuda_align((size_t)T * nbD * sizeof(float));
    size_t b_h = cuda_align((size_t)R * I * sizeof(float)), b_hq = cuda_align((size_t)R * I);
    size_t b_hs = cuda_align((size_t)R * nbI * sizeof(float));
    size_t b_xh = cuda_align((size_t)T * D * 2), b_hh = cuda_align((size_t)R * I * 2);
    size_t b_y = parts != NULL ? 0 : cuda_align((size_t)R * D * sizeof(float));
    struct fm3_cfg c;
    struct fm3_args a;
    enum dsv4_err e;
    char *p;

    fm3_cfg_parse(&c, cfg);
    if (c.v5 < 0)
        c.v5 = 1;
    p = (char *)cuda_scratch(be, b_grp + 2 * b_xq + b_xs + b_h + b_hq + b_hs + b_y + 2 * b_xh +
                                     b_hh);
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast moe v3: no scratch (T=%d k=%d)", T, k);
    memset(&a, 0, sizeof(a));
    a.table = table;
    if (shared != NULL)
        a.shared = *shared;
    a.has_shared = shared != NULL;
    a.grp = (const int32_t *)p;
    a.ctr = (int *)p + 2 + 2 * A + Tk;
    a.A = A;
    p += b_grp;
    a.xq4 = (const uint8_t *)p;
    a.xq8 = (const uint8_t *)(p + b_xq);
    a.xs = (const float *)(p + 2 * b_xq);
    p += 2 * b_xq + b_xs;
    a.h = (float *)p;
    a.hq = (uint8_t *)(p + b_h);
    a.hs = (float *)(p + b_h + b_hq);
    p += b_h + b_hq + b_hs;
    a.y = parts != NULL ? parts : (float *)p;
    p += b_y;
    a.xh4 = (const uint16_t *)p;
    a.xh8 = (const uint16_t *)(p + b_xh);
    a.hh = (uint16_t *)(p + 2 * b_xh);
    a.weights = weights;
    a.T = T;
    a.k = k;
    a.D = D;
    a.I = I;
    a.ns = c.ns;
    a.lim = lim;
    a.ef = cuda_switch_on(&fm5_ef_sw);
    a.place = cuda_switch_on(&fm5_place_sw);

    cu_launch(fm3_prep_kernel,
              1 + (unsigned)(((int64_t)T * nbD + FM3_PREP_THREADS / 32 - 1) /
                             (FM3_PREP_THREADS / 32)),
              FM3_PREP_THREADS, 0, st, a, x, ids, n_table, parts != NULL, (uint8_t *)a.xq4,
              (uint8_t *)a.xq8, (float *)a.xs);
    CUDA_LAUNCHED("fast moe v3 prep");
    a.rt = fm3_rt(&c, I / 16, slots);
    /* v5: tiles of 8 rows of w1 and w3 */
    e = fm3_launch<1>(be, a, &c, c.v5 ? I / FM5_ROWS(1) : I / 16, slots);
    if (e != DSV4_OK)
        return e;
    cu_launch(fm3_hquant_kernel, cuda_blocks((int64_t)R * nbI * 32, 256), 256, 0, st, a);
    CUDA_LAUNCHED("fast moe v3 h quant");
    a.rt = fm3_rt(&c, D / 32, slots);
    e = fm3_launch<0>(be, a, &c, c.v5 ? D / FM5_ROWS(0) : D / 32, slots);   /* v5: 16 rows of w2 */
    if (e != DSV4_OK || parts != NULL)
        return e;   /* moe_parts: the caller sums the ranks' parts, then combines */
    return cuda_moe_combine(be, out, a.y, ids, T, k, D);   /* the exact path's step 5 */
}
