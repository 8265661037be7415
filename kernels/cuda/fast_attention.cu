/*
 * fast_attention.cu — the fast sparse attention with sink (backend.h
 * `attention`, model doc §3.3.6) for any T: decode rows and prefill rows
 * alike.  Used by cuda_attention when the fast kernels are on
 * (kernels/cuda_fast.h) and cuda_fast_attention_ok accepts the shapes.
 *
 * The exact kernel runs one block per (row, head) and walks the candidates
 * one after the other.  Here a CTA of 8 warps owns one row and a group of
 * HG = 16 * MT heads (MT = 2 when H > 16: 32 heads, all of a TP = 2 rank's
 * heads; H = 64 takes two CTAs per row), and streams the row's candidates
 * in tiles of FA_NC = 32 key rows, flash-attention style:
 *
 *   1. the tile's key rows (window rows from kv or the ring, compressed rows
 *      through the page table and, for CSA, sel; looked up FA_PG tiles at a
 *      time into a table in shared memory, one candidate a thread) are
 *      copied into an fp32 staging tile with cp.async (8 threads a key row;
 *      masked candidates are zero-filled); each thread converts the pieces
 *      it copied itself into one of two bf16 tiles (the pools hold bf16
 *      values, so this is exact), and after the tile's first barrier issues
 *      the next tile's copies, which are in flight while this one is used
 *      (3 barriers a tile);
 *   2. scores S = Q K^T on the tensor cores (mma.sync m16n8k16 bf16, fp32
 *      accumulators): warp w owns head dimensions [w Dh/8, (w+1) Dh/8), its
 *      Q fragments stay in registers for the whole row, and the 8 warps'
 *      partial sums are added in warp order in shared memory;
 *   3. online softmax per head (running max m, running sum l; 8 or 16
 *      threads per head, fixed reduction trees), P = exp(S - m) in shared
 *      memory, the rescale factor alpha = exp(m_old - m_new);
 *   4. O = O * alpha + P V on the tensor cores, V = K from the same bf16
 *      tile (ldmatrix.trans), each warp its Dh/8 output dimensions.  P is
 *      fed as bf16 hi + lo (two mma; |p - hi - lo| <= 2^-16 |p|), so P V
 *      is close to fp32 accuracy rather than bf16's.
 *   A fresh call (dsv4_attn.fresh: every sequence from position 0, so every
 *   key row is a row of kv or an entry one of the call's rows completed)
 *   has those rows rounded to bf16 once (fa_stage_kernel, into scratch),
 *   and fa_kernel<..., B16 = 1> copies them straight into the bf16 tiles
 *   (fd_issue on bf16 rows; no fp32 staging, no conversion; the same
 *   values, so the same bits).  DSV4_CUDA_ATTN_STAGE=0 converts in every
 *   CTA as before.
 *   At H = 64, Dh = 512 a fresh call's rows run fh_kernel instead
 *   (fast_attention_wg.cuh: wgmma, one CTA a row and all 64 heads).
 *   At the end out = bf16(O / (l + exp(sink - m))); for attention_unrope
 *   (cuda_attention_unrope) fd_kernel's output stage then rotates the pairs
 *   of the RoPE dimensions back at the row's position (fa_unrope_cs:
 *   rope_kernel's expressions on the stored values, so the bits of
 *   attention + rope); after fa_kernel the rope kernel does it.
 *
 * Decode-sized calls (T * head groups <= FA_SPLIT_ROWS, head groups of 32
 * when H > 16, else 16) would give too few CTAs, so there each row's
 * candidate list is split over several CTAs (flash-decoding).  The
 * candidate list is the exact path's (window positions, then the compressed
 * entries in order; CSA slots with sel < 0 or >= cap are masked, not
 * compacted), so which CTA gets which candidate depends on the row alone.
 * Two forms of the split, DSV4_CUDA_ATTN picks (fa_variant):
 *
 *   v2 (default; fd_kernel, one launch): a thread block cluster of CS = 4
 *     CTAs (8 with DSV4_CUDA_FD_CS=8; fd_cs) per (row, group of 16 or 32
 *     heads); rank z takes the row's tiles z, z + CS, z + 2 CS, ...  The
 *     candidate rows of the CTA's tiles are looked
 *     up once, all in parallel, before any tile is loaded (v1 looked them up
 *     copy by copy, a chain of dependent sel / page-table loads per tile);
 *     tile j + 1's copies are in flight while tile j is computed; 3 barriers a
 *     tile.  Then the cluster merges in shared memory (each rank writes 1/CS
 *     of the head dimensions, reading the CS partials over DSMEM in rank
 *     order): no scratch, no second kernel, nothing to reset between graph
 *     replays.  Heads per CTA: 32 once T * ceil(H / 32) * CS >= FD_MIN_CTAS
 *     (fewer key reads), else 16 (more CTAs: a T = 1, H = 64 call has 32);
 *     "v2-16" / "v2-32" force one.  A head's arithmetic is the same
 *     with 16 or 32 heads per CTA (8 threads a head in the softmax either
 *     way; the mma computes each element on its own).  Where a call's
 *     clusters would not all fit on the device at once (fd_launch), the
 *     global form runs the same CTAs without clusters and merges through
 *     scratch and a counter (the same bits; "v2c" / "v2g" force one form,
 *     DSV4_CUDA_FD_GLOBAL=0 keeps clusters).  Rows with more than
 *     CS * FD_TPR * FA_NC candidates possible (2,048 with CS = 4: win + K,
 *     or win + cap, HCA past ~245k tokens), or a device that cannot hold a
 *     cluster, take v1.
 *   v1 ("v1"): chunks of FA_CHUNK candidates, one fa_kernel CTA each, the
 *     unnormalised (O, m, l) to scratch, and fa_combine_kernel merges the
 *     chunks of a (row, head) in chunk order.
 * Masked candidates change no value (P = 0 and alpha = 1, or everything
 * still 0 while the running max is -inf), so two walks skip them where whole
 * tiles are masked: a v2 CTA walks only its tiles with a valid candidate
 * (fd_kernel), and an unsplit row (prefill) stops after its last valid
 * candidate (fa_trim).  Below K * ratio tokens a CSA row's selection ends in
 * -1 slots (the indexer writes its picks, then -1): at 1,024 tokens 256 of
 * the 512 slots.  The values are those of the full walk up to the sign of a
 * zero (-0 + 0 is +0 in the walk that adds the masked tile).
 *
 * Numerics.  q and the key rows are used as bf16 (the forward's values are
 * bf16; other inputs are rounded to bf16 first).  Products are exact; the
 * differences from the exact path are fp32 rounding: the dot product's
 * summation order (tensor core, then 8 warp partials), expf (CUDA's, not
 * the double-rounded one), the online rescaling by alpha, the sum order of
 * the denominator and of P V, and P's hi + lo split (relative error
 * <= 2^-16 per weight).  Outputs are deterministic and depend on the row's
 * own inputs, on whether the call was split (T * groups <= FA_SPLIT_ROWS)
 * and on the form of the split (v1, v2) only: not on the other rows or on T
 * otherwise (tests/gpu/bench_attn.c checks rows at T = 1, 4, 16).  No host
 * synchronisation, no allocation beyond the backend scratch (graph-safe).
 */
#include "kernels/cuda/fast_mma.cuh"
#include "kernels/cuda_fast.h"   /* dsv4_cuda_q16_hold */

#include <cooperative_groups.h>
#include <stdlib.h>
#include <string.h>

namespace cg = cooperative_groups;

#define FA_THREADS 256
#define FA_WARPS 8
#define FA_NC 32            /* candidates per tile */
#define FA_CHUNK 64         /* candidates per CTA when split */
#define FA_SPLIT_ROWS 64    /* split when T * head groups <= this */
#define FA_PG 8             /* tiles whose key rows fa_kernel looks up at once (FA_PG FA_NC
                               = FA_THREADS: one candidate a thread) */
#define FA_SPLIT_BYTES ((size_t)64 << 20)   /* scratch bound of the split form */
#define FA_SP_LD (FA_NC + 8)   /* row stride (floats) of the score / P tiles */
#define FD_CS 4             /* v2: CTAs per (row, head group), one cluster (or 8: fd_cs) */
#define FD_TPR 16           /* v2: tiles per CTA at most */
#define FD_MIN_CTAS 64      /* 32 heads per CTA from this many CTAs (H200, bench_attn
                               2026-11-30: T = 4 at H = 64 10.2 us vs 15.1 with 16,
                               T = 4 at H = 32 7.9 vs 10.1 the other way) */
#define FD_MAX_DEV 64       /* devices with a cached cluster check */
#define FD_MI 4             /* global form's merge: outputs a thread per round (CS x 4 loads
                               in flight) */

struct fa_args {
    float *out;
    const float *q, *kv, *ring, *comp;
    const int32_t *pages, *sel;
    const float *sink;
    const int32_t *slot, *pos, *row0, *pos0;
    float *part;            /* split: (T, n_hg, n_ch, HG, Dh + 2) partials */
    int T, H, Dh, win, cap, ratio, K;
    float scale;
    int n_hg, n_ch, split;  /* split: candidates per chunk, 0 = whole rows */
    int ur_off, ur_np;      /* the output's inverse RoPE: ur_np pairs from dimension ur_off */
    float ur_f[CUDA_FA_UR_MAX];   /* (ur_np = 0: none), frequencies */
    /* a fresh call's key rows as bf16 (fa_stage_kernel), else NULL: kv's T
     * rows, and per row c the compressed entry it completed (row c of compb) */
    uint16_t *kvb, *compb;
    /* fh_kernel's row counter in the staging's scratch (zeroed by
     * fa_stage_kernel) */
    int *ctr;
    /* fd_kernel's global form: the arrival counters of its (row, head
     * group)s, zero between launches (the backend's st->lin_ctr) */
    unsigned *fdc;
    /* fd_kernel looks its candidate rows up before its PDL wait (no sel;
     * DSV4_CUDA_FD_EARLY) */
    int early;
    /* attention_out: fa_kernel's output as bf16 here (T, H, Dh) instead of
     * out (cuda_fast_attention_out), else NULL */
    uint16_t *outb;
    /* 1: q's values are bf16 in its first half ((const uint16_t *)q, T x H x
     * Dh; cuda_q16_take): fa_load_q (fa_kernel, fd_kernel) and fh_kernel
     * read them so (the bf16 they round fp32 q to) */
    int q16;
};

/* --- small device helpers ------------------------------------------------------ */

/* The factors of row t's inverse RoPE pairs (cu_rope_cs; they depend on
 * the position and the pair, not on the head) into cs / sn, pairs
 * threadIdx.x, threadIdx.x + blockDim.x, ...: a CTA works them out once,
 * while its first tile's copies are in flight, for every head's output
 * stage (fa_unrope_cs).
 * The caller's barriers order these stores before the reads. */
static __device__ __forceinline__ void
fa_unrope_table(const struct fa_args &a, int t, float *cs, float *sn)
{
    for (int i = threadIdx.x; i < a.ur_np; i += blockDim.x)
        cu_rope_cs((float)a.pos[t], a.ur_f[i], 1, cs[i], sn[i]);
}

/* The output pair (u, v) of dimensions d, d + 1 (d even), rotated back
 * where the call asks (the inverse RoPE of pairs ur_off .. ur_off + 2 ur_np)
 * by the CTA's table (fa_unrope_table): rope_kernel's values. */
static __device__ __forceinline__ void
fa_unrope_cs(const struct fa_args &a, int d, const float *cs, const float *sn, float &u,
             float &v)
{
    int i = (d - a.ur_off) >> 1;

    if (d >= a.ur_off && i < a.ur_np)
        cu_rope_rot(u, v, cs[i], sn[i]);
}

/* p = hi + lo in bf16 pairs: hi = bf16(p), lo = bf16(p - hi). */
static __device__ __forceinline__ void
fa_split2(float p0, float p1, uint32_t &hi, uint32_t &lo)
{
    hi = fa_pack(p0, p1);
    lo = fa_pack(p0 - __uint_as_float(hi << 16), p1 - __uint_as_float(hi & 0xffff0000u));
}

/* 16 bytes global -> shared, zero-filled when !valid. */
static __device__ __forceinline__ void
fa_cp16(void *dst, const void *src, int valid)
{
    uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);

    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

static __device__ __forceinline__ void
fa_cp_commit(void)
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* Wait until at most n committed groups are pending. */
template <int N>
static __device__ __forceinline__ void
fa_cp_wait(void)
{
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

/* Row facts shared by the main and the combine kernel. */
struct fa_row {
    int p, s, u0, nw, n_cand;
};

static __device__ __forceinline__ struct fa_row
fa_row_of(const struct fa_args &a, int t)
{
    struct fa_row r;
    int nc = 0;

    r.p = a.pos[t];
    r.s = a.slot[t];
    r.u0 = r.p - a.win + 1 > 0 ? r.p - a.win + 1 : 0;
    r.nw = r.p - r.u0 + 1;
    if (a.comp != NULL) {
        if (a.sel != NULL) {
            nc = a.K;
        } else {
            nc = (r.p + 1) / a.ratio;
            nc = nc < a.cap ? nc : a.cap;
        }
    }
    r.n_cand = r.nw + nc;
    return r;
}

/* Key row of candidate c (< n_cand) of row t, or NULL when masked (a CSA
 * slot holding no entry). */
static __device__ __forceinline__ const float *
fa_cand(const struct fa_args &a, const struct fa_row &r, int t, int c)
{
    int e;

    if (c < r.nw) {
        int u = r.u0 + c, p0 = a.pos0[t];

        if (u >= p0)
            return a.kv + (int64_t)(a.row0[t] + (u - p0)) * a.Dh;
        return a.ring + ((int64_t)r.s * a.win + u % a.win) * a.Dh;
    }
    e = c - r.nw;
    if (a.sel != NULL) {
        e = a.sel[(int64_t)t * a.K + e];
        if (e < 0 || e >= a.cap)
            return NULL;
    }
    return a.comp + cu_pool_row(a.pages, a.cap, r.s, e) * a.Dh;
}

/*
 * fa_cand for a fresh call (fa_args.kvb set): candidate c of row t in the
 * bf16 copies.  Window rows are all the call's (pos0 = 0); entry e of the
 * row's sequence is the copy made at the row that completed it, row0 + (e +
 * 1) ratio - 1.  A CSA pick of an entry no row up to t has completed (the
 * indexer picks none: its keys are the completed entries) is masked rather
 * than read past the sequence.
 */
static __device__ __forceinline__ const uint16_t *
fa_cand16(const struct fa_args &a, const struct fa_row &r, int t, int c)
{
    int e;

    if (c < r.nw)
        return a.kvb + (int64_t)(a.row0[t] + (r.u0 + c - a.pos0[t])) * a.Dh;
    e = c - r.nw;
    if (a.sel != NULL) {
        e = a.sel[(int64_t)t * a.K + e];
        if (e < 0 || e >= a.cap || (int64_t)(e + 1) * a.ratio - 1 > r.p)
            return NULL;
    }
    return a.compb + (int64_t)(a.row0[t] + ((e + 1) * a.ratio - 1 - a.pos0[t])) * a.Dh;
}

/*
 * The bf16 copies of a fresh call (one warp an item, Dh / 128 16-byte
 * loads a lane): items 0 .. T - 1 kv's rows, items T .. 2 T - 1 for row c =
 * item - T the compressed entry whose window row c ends ((pos + 1) % ratio
 * == 0, entry (pos + 1) / ratio - 1 < cap; other rows have none).  Rounded
 * as fa_convert rounds: the values fa_kernel's tiles get either way (the
 * pools and kv hold bf16 values, so the copies are exact).
 */
static __global__ void
fa_stage_kernel(struct fa_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t item = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    const float *src;
    uint16_t *dst;

    if (item == 0 && lane == 0)
        *a.ctr = 0;   /* fh_kernel's rows: none taken */
    if (item >= 2 * (int64_t)a.T)
        return;   /* whole warps leave together */
    if (item < a.T) {
        src = a.kv + item * a.Dh;
        dst = a.kvb + item * a.Dh;
    } else {
        int c = (int)(item - a.T), p = a.pos[c], e;

        if (a.comp == NULL || a.ratio < 1 || (p + 1) % a.ratio != 0)
            return;
        e = (p + 1) / a.ratio - 1;
        if (e >= a.cap)
            return;
        src = a.comp + cu_pool_row(a.pages, a.cap, a.slot[c], e) * a.Dh;
        dst = a.compb + (int64_t)c * a.Dh;
    }
    for (int d = lane * 4; d < a.Dh; d += 128) {
        float4 v = *(const float4 *)(src + d);

        *(uint2 *)(dst + d) = make_uint2(fa_pack(v.x, v.y), fa_pack(v.z, v.w));
    }
}

/*
 * The end of row t's candidates past its last valid one (CSA: slots with sel
 * < 0 or >= cap are masked; the indexer writes its picks first, then -1, so
 * a row below K * ratio tokens ends in masked slots): candidates past it
 * change no value (P = 0, alpha = 1), so a walk may stop there.  Every
 * thread of the block calls it; c_end without sel.
 */
static __device__ __forceinline__ int
fa_trim(const struct fa_args &a, const struct fa_row &r, int t, int c_end)
{
    __shared__ int last;

    if (a.sel == NULL)
        return c_end;
    if (threadIdx.x == 0)
        last = -1;
    __syncthreads();
    /* each thread's last valid slot, then one shared atomic a warp (a
     * warp's atomics on one address are serialised) */
    int mine = -1;

    for (int e = threadIdx.x; e < c_end - r.nw; e += blockDim.x) {
        int v = a.sel[(int64_t)t * a.K + e];

        if (v >= 0 && v < a.cap)
            mine = e;
    }
    mine = __reduce_max_sync(0xffffffffu, mine);
    if ((threadIdx.x & 31) == 0 && mine >= 0)
        atomicMax(&last, mine);
    __syncthreads();
    return r.nw + last + 1;
}

/* Shared memory layout (bytes) of fa_kernel<MT> for head dimension Dh. */
static __host__ __device__ __forceinline__ size_t
fa_smem_bytes(int MT, int Dh, int B16)
{
    int HG = 16 * MT;

    return (size_t)(B16 ? 0 : FA_NC * Dh * 4)       /* fp32 staging */
           + (size_t)2 * FA_NC * (Dh + 8) * 2       /* bf16 tiles */
           + (size_t)FA_WARPS * HG * FA_SP_LD * 4   /* score partials */
           + (size_t)HG * FA_SP_LD * 4              /* P */
           + (size_t)3 * HG * 4                     /* m, l, alpha */
           + (size_t)2 * FA_PG * FA_NC * sizeof(void *);   /* key rows, two halves */
}

/* --- the main kernel -------------------------------------------------------------- */

/*
 * The copies of a tile: FA_NC rows of Dh floats in 16-byte pieces; warp w
 * takes rows w FA_RPW .. (w + 1) FA_RPW - 1 and lane l pieces l, l + 32, ...
 * of each, so one warp instruction copies 512 contiguous bytes of a row and
 * the warp's bf16 stores of the conversion are 256 contiguous bytes (run
 * 50: with 8 threads a row, rows 1,040 bytes apart, Nsight Compute found
 * those stores 2.9-way bank-conflicted).  Each thread converts the pieces
 * it copied itself (fa_convert), so the staging needs no barrier of its
 * own.
 */
#define FA_RPW (FA_NC / FA_WARPS)   /* tile rows a warp copies and converts */
static_assert(FA_NC % FA_WARPS == 0 && FA_THREADS == 32 * FA_WARPS, "fd_issue: rows a warp");

/* Issue this thread's copies of one tile (rows ptr[0 .. FA_NC) of Dh
 * elements E, NULL: zero-filled) into tile (rows LD elements apart): the
 * fp32 staging (E float, LD = Dh) or, for a fresh call's bf16 rows
 * (fa_stage_kernel), the bf16 tile itself (E uint16_t, LD = Dh + 8).  Warp
 * w takes rows w FA_RPW .., lane l the 16-byte pieces l, l + 32, ... of
 * each (one warp instruction, 512 contiguous bytes). */
template <int Dh, typename E, int LD>
static __device__ __forceinline__ void
fd_issue(const E *const *ptr, E *tile, const void *dummy)
{
    constexpr int PE = 16 / sizeof(E);   /* elements a piece */
    int row0 = (threadIdx.x / 32) * FA_RPW, c = (threadIdx.x % 32) * PE;

    static_assert(Dh % (32 * PE) == 0, "fd_issue: whole pieces a lane");
#pragma unroll
    for (int r = 0; r < FA_RPW; r++) {
        const E *src = ptr[row0 + r];
        E *dst = tile + (size_t)(row0 + r) * LD + c;

#pragma unroll
        for (int k = 0; k < Dh / (32 * PE); k++)
            fa_cp16(dst + 32 * PE * k, src != NULL ? (const void *)(src + c + 32 * PE * k) : dummy,
                    src != NULL);
    }
    fa_cp_commit();
}

/* This thread's pieces of the staged tile (its copies complete) -> the bf16
 * tile kj (rows of Dh + 8). */
template <int Dh>
static __device__ __forceinline__ void
fa_convert(const float *stage, uint16_t *kj)
{
    int row0 = (threadIdx.x / 32) * FA_RPW, c4 = (threadIdx.x % 32) * 4;

#pragma unroll
    for (int r = 0; r < FA_RPW; r++) {
        const float *sr = stage + (size_t)(row0 + r) * Dh + c4;
        uint16_t *kr = kj + (size_t)(row0 + r) * (Dh + 8) + c4;

#pragma unroll
        for (int k = 0; k < Dh / 128; k++) {
            float4 v = *(const float4 *)(sr + 128 * k);

            *(uint2 *)(kr + 128 * k) = make_uint2(fa_pack(v.x, v.y), fa_pack(v.z, v.w));
        }
    }
}

/*
 * The key rows of candidates c0 .. c0 + N - 1 of row t (NULL: masked, or
 * past c_end) into ptr: thread i (of FA_THREADS) looks up candidate c0 + i,
 * c0 + i + FA_THREADS, ...  N = FA_PG FA_NC for fa_kernel, FH_PG FH_NC for
 * fh_kernel (fast_attention_wg.cuh).
 * The unsplit walk (prefill rows) looks its candidates up FA_PG tiles at a
 * time, so each copy of a tile reads its source row from shared memory
 * instead of working out the window / ring / page-table address per 16-byte
 * piece (docs/perf.md run 39: that was a third of fa_kernel's instructions).
 */
template <int B16, int N = FA_PG * FA_NC>
static __device__ __forceinline__ void
fa_rows(const struct fa_args &a, const struct fa_row &r, int t, int c0, int c_end,
        const void **ptr)
{
    for (int i = threadIdx.x; i < N; i += FA_THREADS) {
        int c = c0 + i;

        ptr[i] = c >= c_end ? NULL : B16 ? (const void *)fa_cand16(a, r, t, c)
                                         : (const void *)fa_cand(a, r, t, c);
    }
}

#include "kernels/cuda/fast_attention_wg.cuh"

/* The Q fragments of heads h0 .. h0 + 16 MT - 1 of row t over this warp's
 * head dimensions (bf16; zero rows past H). */
template <int MT, int DW>
static __device__ __forceinline__ void
fa_load_q(uint32_t (&qa)[MT][DW / 16][4], const struct fa_args &a, int t, int h0, int warp,
          int lane)
{
    constexpr int Dh = 8 * DW, KS = DW / 16;
    int g = lane / 4, q4 = lane % 4, d0 = warp * DW;

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int h = h0 + mt * 16 + g + 8 * hh;
            int64_t qi = ((int64_t)t * a.H + (h < a.H ? h : 0)) * Dh + d0 + 2 * q4;
            const float *qr = a.q + qi;

            if (a.q16) {   /* already bf16: the pairs as they are */
                const uint16_t *qb = (const uint16_t *)a.q + qi;

#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    qa[mt][ks][hh] = h < a.H ? *(const uint32_t *)(qb + 16 * ks) : 0u;
                    qa[mt][ks][2 + hh] = h < a.H ? *(const uint32_t *)(qb + 16 * ks + 8) : 0u;
                }
                continue;
            }
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                float2 lo = h < a.H ? *(const float2 *)(qr + 16 * ks) : make_float2(0.f, 0.f);
                float2 hi = h < a.H ? *(const float2 *)(qr + 16 * ks + 8)
                                    : make_float2(0.f, 0.f);

                qa[mt][ks][hh] = fa_pack(lo.x, lo.y);       /* a0 / a1 */
                qa[mt][ks][2 + hh] = fa_pack(hi.x, hi.y);   /* a2 / a3 */
            }
        }
}

/*
 * Online softmax of one tile, thread tid (< HG TPH) of the TPH threads of
 * head tid / TPH, each CPT = FA_NC / TPH consecutive candidates: scores
 * (the FA_WARPS partials of sp added in warp order, times scale; -inf where
 * !valid(candidate)), the tile's max by a fixed xor tree, P = exp(S - m) into
 * pm, the running max s_m, sum s_l and the rescale factor s_al.  The TPH
 * threads of a head are consecutive lanes of one warp, and every lane of a
 * calling warp must call it.
 */
template <int HG, int TPH, class Valid>
static __device__ __forceinline__ void
fa_tile_softmax(const float *sp, float *pm, float *s_m, float *s_l, float *s_al, float scale,
                int tid, Valid valid)
{
    constexpr int CPT = FA_NC / TPH;
    int hh = tid / TPH, c1 = (tid % TPH) * CPT;
    float sv[CPT], mx = -__int_as_float(0x7f800000), sum = 0.0f, m_old, m_new, m_use;

#pragma unroll
    for (int j = 0; j < CPT; j++) {
        float acc = 0.0f;

#pragma unroll
        for (int w = 0; w < FA_WARPS; w++)
            acc += sp[((size_t)w * HG + hh) * FA_SP_LD + c1 + j];
        sv[j] = valid(c1 + j) ? acc * scale : -__int_as_float(0x7f800000);
        mx = fmaxf(mx, sv[j]);
    }
#pragma unroll
    for (int o2 = TPH / 2; o2 > 0; o2 /= 2)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
    m_old = s_m[hh];
    m_new = fmaxf(m_old, mx);
    m_use = m_new == -__int_as_float(0x7f800000) ? 0.0f : m_new;
#pragma unroll
    for (int j = 0; j < CPT; j++) {
        float p = expf(sv[j] - m_use);

        pm[hh * FA_SP_LD + c1 + j] = p;
        sum += p;
    }
#pragma unroll
    for (int o2 = TPH / 2; o2 > 0; o2 /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, o2);
    __syncwarp();
    if (tid % TPH == 0) {
        float al = expf(m_old - m_use);

        s_al[hh] = al;
        s_l[hh] = s_l[hh] * al + sum;
        s_m[hh] = m_new;
    }
}

/*
 * Scores of one tile over this warp's head dimensions [warp DW, (warp + 1)
 * DW): sp[warp][head][candidate] (FA_SP_LD floats a head), from the bf16
 * tile kb (FA_NC key rows of Dh + 8) and the warp's Q fragments qa.
 */
template <int MT, int DW>
static __device__ __forceinline__ void
fa_tile_qk(const uint16_t *kb, const uint32_t (&qa)[MT][DW / 16][4], float *sp, int warp,
           int lane)
{
    constexpr int HG = 16 * MT, Dh = 8 * DW, KS = DW / 16;
    int g = lane / 4, q4 = lane % 4, d0 = warp * DW;
    float s[MT][FA_NC / 8][4];

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < FA_NC / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                s[mt][n][i] = 0.0f;
#pragma unroll
    for (int n = 0; n < FA_NC / 8; n++)
#pragma unroll
        for (int ks = 0; ks < KS; ks += 2) {
            uint32_t b[4];

            /* matrices: dims +0, +8 of k-step ks, then of ks + 1 */
            fa_ldsm_x4(b, kb + (size_t)(n * 8 + (lane & 7)) * (Dh + 8) + d0 +
                              16 * ks + ((lane >> 3) & (KS > 1 ? 3 : 1)) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                fk_mma_bf16(s[mt][n], qa[mt][ks][0], qa[mt][ks][1], qa[mt][ks][2],
                            qa[mt][ks][3], b[0], b[1]);
                if (ks + 1 < KS)
                    fk_mma_bf16(s[mt][n], qa[mt][ks + 1][0], qa[mt][ks + 1][1],
                                qa[mt][ks + 1][2], qa[mt][ks + 1][3], b[2], b[3]);
            }
        }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < FA_NC / 8; n++) {
            float *d = sp + ((size_t)warp * HG + mt * 16 + g) * FA_SP_LD + n * 8 + 2 * q4;

            *(float2 *)d = make_float2(s[mt][n][0], s[mt][n][1]);
            *(float2 *)(d + 8 * FA_SP_LD) = make_float2(s[mt][n][2], s[mt][n][3]);
        }
}

/*
 * O = O * alpha + P V for one tile: o holds this warp's head dimensions
 * (NT = DW / 8 n-tiles), P the tile's weights pm (bf16 hi + lo), alpha the
 * rescale factors s_al, V the bf16 tile kb.
 */
template <int MT, int DW>
static __device__ __forceinline__ void
fa_tile_pv(const uint16_t *kb, const float *pm, const float *s_al, float (&o)[MT][DW / 8][4],
           int warp, int lane)
{
    constexpr int Dh = 8 * DW, NT = DW / 8;
    int g = lane / 4, q4 = lane % 4, d0 = warp * DW;

#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float al0 = s_al[mt * 16 + g], al1 = s_al[mt * 16 + g + 8];

#pragma unroll
        for (int n = 0; n < NT; n++) {
            o[mt][n][0] *= al0;
            o[mt][n][1] *= al0;
            o[mt][n][2] *= al1;
            o[mt][n][3] *= al1;
        }
    }
#pragma unroll
    for (int kk = 0; kk < FA_NC / 16; kk++) {
        uint32_t ph[MT][4], pl[MT][4];

#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const float *pr = pm + (mt * 16 + g) * FA_SP_LD + kk * 16 + 2 * q4;
            float2 v0 = *(const float2 *)pr, v1 = *(const float2 *)(pr + 8 * FA_SP_LD);
            float2 v2 = *(const float2 *)(pr + 8), v3 = *(const float2 *)(pr + 8 * FA_SP_LD + 8);

            fa_split2(v0.x, v0.y, ph[mt][0], pl[mt][0]);
            fa_split2(v1.x, v1.y, ph[mt][1], pl[mt][1]);
            fa_split2(v2.x, v2.y, ph[mt][2], pl[mt][2]);
            fa_split2(v3.x, v3.y, ph[mt][3], pl[mt][3]);
        }
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            uint32_t b[4];
            int kr = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            int dc = d0 + n * 8 + (lane >> 4) * 8;

            /* matrices: candidates +0..7 / +8..15 at dims n, then at n + 1 */
            fa_ldsm_x4_t(b, kb + (size_t)kr * (Dh + 8) + dc);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                fk_mma_bf16(o[mt][n], ph[mt][0], ph[mt][1], ph[mt][2], ph[mt][3], b[0], b[1]);
                fk_mma_bf16(o[mt][n], pl[mt][0], pl[mt][1], pl[mt][2], pl[mt][3], b[0], b[1]);
                fk_mma_bf16(o[mt][n + 1], ph[mt][0], ph[mt][1], ph[mt][2], ph[mt][3], b[2],
                            b[3]);
                fk_mma_bf16(o[mt][n + 1], pl[mt][0], pl[mt][1], pl[mt][2], pl[mt][3], b[2],
                            b[3]);
            }
        }
    }
}

/*
 * One CTA per (row t, head group hg, chunk ch); MT m-tiles of 16 heads;
 * DW = Dh / 8 head dimensions per warp.
 */
template <int MT, int DW, int B16>
static __global__ void __launch_bounds__(FA_THREADS, 1)
fa_kernel(struct fa_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    constexpr int HG = 16 * MT, Dh = 8 * DW, KS = DW / 16, NT = DW / 8;
    constexpr int TPH = FA_THREADS / HG;   /* softmax threads per head */
    extern __shared__ __align__(16) unsigned char fa_sm[];
    float *stage = (float *)fa_sm;   /* B16: none */
    uint16_t *kb = (uint16_t *)(stage + (B16 ? 0 : FA_NC * Dh));
    float *sp = (float *)(kb + 2 * FA_NC * (Dh + 8));
    float *pm = sp + FA_WARPS * HG * FA_SP_LD;
    float *s_m = pm + HG * FA_SP_LD, *s_l = s_m + HG, *s_al = s_l + HG;
    const void **s_ptr = (const void **)(s_al + HG);
    int64_t bid = blockIdx.x;
    int ch = (int)(bid % a.n_ch), hg = (int)(bid / a.n_ch % a.n_hg);
    int t = (int)(bid / a.n_ch / a.n_hg);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    int d0 = warp * DW, h0 = hg * HG;
    uint32_t qa[MT][KS][4];
    float o[MT][NT][4], sk[MT][2];

    /* q and the sinks first: their loads in flight while the row's
     * candidates are worked out (a chain of dependent loads and barriers) */
    fa_load_q<MT, DW>(qa, a, t, h0, warp, lane);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int h = h0 + mt * 16 + g + 8 * hh;

            sk[mt][hh] = a.sink[h < a.H ? h : 0];
        }
    struct fa_row r = fa_row_of(a, t);
    int c_beg = a.split ? ch * a.split : 0;
    /* whole rows stop after the last valid candidate (the split form's
     * chunks stay as they are: its combine reads every chunk of the row) */
    int c_end = a.split ? min(r.n_cand, c_beg + a.split) : fa_trim(a, r, t, r.n_cand);
    int n_tiles = (c_end - c_beg + FA_NC - 1) / FA_NC;

    if (c_beg >= c_end)
        return;   /* an empty chunk: the combine does not read it */
    /* the key rows of tiles 0 .. 2 FA_PG - 1 (tile i in slot i % (2 FA_PG)) */
    fa_rows<B16>(a, r, t, c_beg, c_end, s_ptr);
    if (n_tiles > FA_PG)
        fa_rows<B16>(a, r, t, c_beg + FA_PG * FA_NC, c_end, s_ptr + FA_PG * FA_NC);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                o[mt][n][i] = 0.0f;
    if (threadIdx.x < HG) {
        s_m[threadIdx.x] = -__int_as_float(0x7f800000);
        s_l[threadIdx.x] = 0.0f;
    }
    __syncthreads();   /* s_ptr */
    if constexpr (B16)
        fd_issue<Dh, uint16_t, Dh + 8>((const uint16_t *const *)s_ptr, kb, a.q);
    else
        fd_issue<Dh, float, Dh>((const float *const *)s_ptr, stage, a.q);

    /* tile it: this thread's copies -> bf16 tile it & 1, barrier, tile it + 1's
     * copies issued (in flight during tile it), scores, barrier, softmax,
     * barrier, P V; 3 barriers a tile (fd_kernel's pipeline).  B16: the copies
     * land in bf16 tile it & 1 itself, and tile it + 1's go to the other tile,
     * whose last reads (tile it - 1's P V) were before tile it's first
     * barrier. */
    for (int it = 0; it < n_tiles; it++) {
        int c0 = c_beg + it * FA_NC;
        uint16_t *kj = kb + (size_t)(it & 1) * FA_NC * (Dh + 8);
        const void *const *tp = s_ptr + (it % (2 * FA_PG)) * FA_NC;

        /* the last reads of bf16 tile it & 1 (tile it - 2's) were before tile
         * it - 1's barriers */
        fa_cp_wait<0>();
        if constexpr (!B16)
            fa_convert<Dh>(stage, kj);
        /* from tile FA_PG on, every FA_PG tiles: the rows of tiles it + FA_PG ..
         * into the half whose tiles (it - FA_PG ..) were last read before tile
         * it - 1's softmax barrier */
        if (it >= FA_PG && it % FA_PG == 0 && it + FA_PG < n_tiles)
            fa_rows<B16>(a, r, t, c0 + FA_PG * FA_NC, c_end,
                         s_ptr + ((it / FA_PG + 1) % 2) * FA_PG * FA_NC);
        __syncthreads();   /* tile it complete; everyone's staging reads done */
        if (it + 1 < n_tiles) {
            if constexpr (B16)
                fd_issue<Dh, uint16_t, Dh + 8>(
                    (const uint16_t *const *)s_ptr + ((it + 1) % (2 * FA_PG)) * FA_NC,
                    kb + (size_t)((it + 1) & 1) * FA_NC * (Dh + 8), a.q);
            else
                fd_issue<Dh, float, Dh>(
                    (const float *const *)s_ptr + ((it + 1) % (2 * FA_PG)) * FA_NC, stage, a.q);
        }

        fa_tile_qk<MT, DW>(kj, qa, sp, warp, lane);
        __syncthreads();

        /* online softmax: TPH threads per head, CPT candidates each */
        fa_tile_softmax<HG, TPH>(sp, pm, s_m, s_l, s_al, a.scale, threadIdx.x,
                                 [&](int c) { return tp[c] != NULL; });
        __syncthreads();

        fa_tile_pv<MT, DW>(kj, pm, s_al, o, warp, lane);
        /* tile it + 1's barriers order these reads of pm and s_al before they
         * are rewritten; kj is not rewritten before tile it + 2 */
    }

    /* write out: the output (whole rows) or the chunk's partials (split) */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int hl = mt * 16 + g + 8 * hh, h = h0 + hl;
            float m = s_m[hl], l = s_l[hl];

            if (h >= a.H)
                continue;
            if (a.split) {
                float *pp = a.part + (((int64_t)t * a.n_hg + hg) * a.n_ch + ch) * HG * (Dh + 2);

#pragma unroll
                for (int n = 0; n < NT; n++)
                    *(float2 *)(pp + (int64_t)hl * Dh + d0 + n * 8 + 2 * q4) =
                        make_float2(o[mt][n][2 * hh], o[mt][n][2 * hh + 1]);
                if (warp == 0 && q4 == 0) {
                    pp[(int64_t)HG * Dh + 2 * hl] = m;
                    pp[(int64_t)HG * Dh + 2 * hl + 1] = l;
                }
            } else {
                /* the hardware's bf16 rounding (cu_bf16_round's bits for
                 * every non-NaN value) */
                float den = l + expf(sk[mt][hh] - m);
                int64_t oi = ((int64_t)t * a.H + h) * Dh + d0 + 2 * q4;

#pragma unroll
                for (int n = 0; n < NT; n++) {
                    uint32_t b = fa_pack(o[mt][n][2 * hh] / den, o[mt][n][2 * hh + 1] / den);

                    if (a.outb != NULL)   /* attention_out: the bf16 pair itself */
                        *(uint32_t *)(a.outb + oi + n * 8) = b;
                    else
                        *(float2 *)(a.out + oi + n * 8) = make_float2(
                            __uint_as_float(b << 16), __uint_as_float(b & 0xffff0000u));
                }
            }
        }
}

/*
 * Split form: out[t, h, :] from the row's chunks (those holding at least one
 * candidate), merged in chunk order.  One block per (row, head), one thread
 * per 4 dimensions.
 */
template <int MT>
static __global__ void
fa_combine_kernel(struct fa_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    constexpr int HG = 16 * MT;
    int64_t th = blockIdx.x;
    int t = (int)(th / a.H), h = (int)(th % a.H), hg = h / HG, hl = h % HG, Dh = a.Dh;
    struct fa_row r = fa_row_of(a, t);
    int nch = (r.n_cand + a.split - 1) / a.split;
    const float *pp = a.part + ((int64_t)t * a.n_hg + hg) * a.n_ch * HG * (Dh + 2);
    int64_t cs = (int64_t)HG * (Dh + 2);   /* floats per chunk */
    float M = -__int_as_float(0x7f800000), den = 0.0f;

    for (int c = 0; c < nch; c++)
        M = fmaxf(M, pp[c * cs + (int64_t)HG * Dh + 2 * hl]);
    for (int c = 0; c < nch; c++)
        den += pp[c * cs + (int64_t)HG * Dh + 2 * hl + 1] *
               expf(pp[c * cs + (int64_t)HG * Dh + 2 * hl] - M);
    den += expf(a.sink[h] - M);
    for (int d = threadIdx.x * 4; d < Dh; d += blockDim.x * 4) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);

        for (int c = 0; c < nch; c++) {
            float f = expf(pp[c * cs + (int64_t)HG * Dh + 2 * hl] - M);
            float4 v = *(const float4 *)(pp + c * cs + (int64_t)hl * Dh + d);

            acc.x += v.x * f;
            acc.y += v.y * f;
            acc.z += v.z * f;
            acc.w += v.w * f;
        }
        *(float4 *)(a.out + ((int64_t)t * a.H + h) * Dh + d) =
            make_float4(cu_bf16_round(acc.x / den), cu_bf16_round(acc.y / den),
                        cu_bf16_round(acc.z / den), cu_bf16_round(acc.w / den));
    }
}

/* --- v2: the split form in one launch (thread block clusters) ------------------------ */

/*
 * Shared memory of fd_kernel<MT> for head dimension Dh: one fp32 staging
 * tile (each thread converts the pieces it copied itself, so the staging is
 * private to the threads and needs no barrier of its own; after the loop the
 * CTA's unnormalised O lies there for the cluster's combine), two bf16 tiles
 * (tile j + 1 is converted while slower warps still read tile j), the score
 * partials, P, the candidate rows of the CTA's tiles, m / l / alpha and the
 * combine's factors.
 */
static __host__ __device__ __forceinline__ size_t
fd_smem_bytes(int MT, int Dh, int CS)
{
    int HG = 16 * MT;

    return (size_t)FA_NC * Dh * 4                   /* staging / O partial */
           + (size_t)2 * FA_NC * (Dh + 8) * 2       /* bf16 tiles */
           + (size_t)FA_WARPS * HG * FA_SP_LD * 4   /* score partials */
           + (size_t)HG * FA_SP_LD * 4              /* P */
           + (size_t)FD_TPR * FA_NC * sizeof(void *)   /* candidate rows */
           + (size_t)3 * HG * 4                     /* m, l, alpha */
           + (size_t)HG * (CS + 1) * 4;             /* combine factors, denominators */
}

/* fd_kernel's row facts of row t (*r) and its rank z's candidate rows into
 * s_ptr (tiles z, z + CS, ...; NULL: masked or past the row); returns the
 * rank's tile count (<= FD_TPR: the host's rule).  Every thread calls it. */
template <int CS>
static __device__ __forceinline__ int
fd_lookup(const struct fa_args &a, const float **s_ptr, struct fa_row *r, int t, int z)
{
    *r = fa_row_of(a, t);
    int n_tiles = (r->n_cand + FA_NC - 1) / FA_NC;
    int nj = n_tiles > z ? (n_tiles - z + CS - 1) / CS : 0;

    for (int i = threadIdx.x; i < nj * FA_NC; i += FA_THREADS) {
        int c = (z + CS * (i / FA_NC)) * FA_NC + i % FA_NC;

        s_ptr[i] = c < r->n_cand ? fa_cand(a, *r, t, c) : NULL;
    }
    return nj;
}

/* A CTA's unnormalised O (fd_kernel's registers o) to dst, (HG, Dh) fp32:
 * shared memory (the cluster form) or the call's scratch (the global form). */
template <int MT, int DW>
static __device__ __forceinline__ void
fd_put_o(const float (&o)[MT][DW / 8][4], float *dst)
{
    constexpr int Dh = 8 * DW, NT = DW / 8;
    int lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4, d0 = threadIdx.x / 32 * DW;

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int hl = mt * 16 + g + 8 * hh;

#pragma unroll
            for (int n = 0; n < NT; n++)
                *(float2 *)(dst + (size_t)hl * Dh + d0 + n * 8 + 2 * q4) =
                    make_float2(o[mt][n][2 * hh], o[mt][n][2 * hh + 1]);
        }
}

/* Four merged sums of a head: the ranks' partials v(k) times their factors
 * f[k] (fd_factors), added in rank order, ranks with f[k] < 0 (no
 * candidates) skipped and their partials not read (both forms' expression;
 * v: the form's read of rank k's four floats). */
template <int CS, class V>
static __device__ __forceinline__ float4
fd_sum(const float *f, V v)
{
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);

#pragma unroll
    for (int k = 0; k < CS; k++) {
        float fk = f[k];

        if (fk >= 0.0f) {
            float4 x = v(k);

            acc.x += x.x * fk;
            acc.y += x.y * fk;
            acc.z += x.z * fk;
            acc.w += x.w * fk;
        }
    }
    return acc;
}

/* Output dimensions d .. d + 3 of head h of row t from the merged sums acc
 * and the head's denominator: bf16(acc / den), the output's inverse RoPE
 * where it applies (fa_unrope_cs, the row's table s_ucs / s_usn). */
static __device__ __forceinline__ void
fd_emit(const struct fa_args &a, float4 acc, float den, int t, int h, int d, const float *s_ucs,
        const float *s_usn)
{
    float4 v = make_float4(cu_bf16_round(acc.x / den), cu_bf16_round(acc.y / den),
                           cu_bf16_round(acc.z / den), cu_bf16_round(acc.w / den));

    fa_unrope_cs(a, d, s_ucs, s_usn, v.x, v.y);
    fa_unrope_cs(a, d + 2, s_ucs, s_usn, v.z, v.w);
    if (a.outb != NULL)   /* attention_out's decode form: bf16(v), fk_split's hi */
        *(uint2 *)(a.outb + ((int64_t)t * a.H + h) * a.Dh + d) =
            make_uint2(cu_bf16x2_round(v.x, v.y), cu_bf16x2_round(v.z, v.w));
    else
        *(float4 *)(a.out + ((int64_t)t * a.H + h) * a.Dh + d) = v;
}

/*
 * A head's merge factors over the CS ranks' (m, l) (mz, lz, in rank order):
 * M = their max (0 when every rank is empty), f[k] = exp(mz[k] - M) (-1: a
 * rank without candidates, skipped), *den = the sum of lz[k] f[k] in rank
 * order plus exp(sink - M).  Both forms of fd_kernel merge with it.
 */
template <int CS>
static __device__ __forceinline__ void
fd_factors(const float (&mz)[CS], const float (&lz)[CS], float sink, float *f, float *den)
{
    float M = -__int_as_float(0x7f800000), d = 0.0f;

#pragma unroll
    for (int k = 0; k < CS; k++)
        M = fmaxf(M, mz[k]);
    M = M == -__int_as_float(0x7f800000) ? 0.0f : M;
#pragma unroll
    for (int k = 0; k < CS; k++) {
        float fk = mz[k] == -__int_as_float(0x7f800000) ? -1.0f : expf(mz[k] - M);

        f[k] = fk;
        if (fk >= 0.0f)
            d += lz[k] * fk;
    }
    *den = d + expf(sink - M);
}

/*
 * fd_kernel's global form after its tiles (every thread calls it): rank z's
 * O (registers o), m and l (s_m, s_l) to a.part, then the arrival count at
 * a.fdc[rg]; the CTA that arrives last (the others return) resets the
 * counter for the next launch or graph replay and writes the HG heads'
 * outputs: per head M, the ranks' factors and the denominator as the
 * cluster form's merge computes them, then every head dimension as the
 * ranks' O in rank order (cu_block_arrives_last, then L2 reads).
 */
template <int MT, int DW, int CS>
static __device__ __forceinline__ void
fd_merge_global(const struct fa_args &a, const float (&o)[MT][DW / 8][4], const float *s_m,
                const float *s_l, float *s_f, float *s_den, const float *s_ucs,
                const float *s_usn, int64_t rg, int z, int t, int h0)
{
    constexpr int HG = 16 * MT, Dh = 8 * DW, D4 = Dh / 4;
    float *ml = a.part + (int64_t)gridDim.x * HG * Dh;   /* (rank, head) -> (m, l) */

    {
        fd_put_o<MT, DW>(o, a.part + (rg * CS + z) * (int64_t)HG * Dh);
        if (threadIdx.x < HG)   /* final since the last tile's barriers (or the init's) */
            __stcg((float2 *)(ml + ((rg * CS + z) * HG + threadIdx.x) * 2),
                   make_float2(s_m[threadIdx.x], s_l[threadIdx.x]));
    }
    if (!cu_block_arrives_last(a.fdc + rg, CS))
        return;

    /* per head: the cluster form's M, factors (-1: a rank without
     * candidates) and denominator, in rank order */
    if (threadIdx.x < HG) {
        int hl = threadIdx.x, h = h0 + hl;
        float mz[CS], lz[CS];

#pragma unroll
        for (int k = 0; k < CS; k++) {
            float2 v = __ldcg((const float2 *)(ml + ((rg * CS + k) * HG + hl) * 2));

            mz[k] = v.x;
            lz[k] = v.y;
        }
        fd_factors<CS>(mz, lz, a.sink[h < a.H ? h : 0], s_f + hl * CS, s_den + hl);
    }
    __syncthreads();
    /* FD_MI outputs a thread at a time, all their CS partials' loads in
     * flight together (an L2 round trip per round, not per output) */
    for (int i0 = threadIdx.x; i0 < HG * D4; i0 += FA_THREADS * FD_MI) {
        float4 v[FD_MI][CS];

#pragma unroll
        for (int j = 0; j < FD_MI; j++) {
            int i = min(i0 + j * FA_THREADS, HG * D4 - 1), hl = i / D4, d = (i % D4) * 4;

#pragma unroll
            for (int k = 0; k < CS; k++)
                v[j][k] = __ldcg((const float4 *)(a.part + ((rg * CS + k) * HG + hl) *
                                                               (int64_t)Dh + d));
        }
#pragma unroll
        for (int j = 0; j < FD_MI; j++) {
            int i = i0 + j * FA_THREADS, ic = min(i, HG * D4 - 1);
            int hl = ic / D4, h = h0 + hl, d = (ic % D4) * 4;
            float4 acc = fd_sum<CS>(s_f + hl * CS, [&](int k) { return v[j][k]; });

            if (h < a.H && i < HG * D4)
                fd_emit(a, acc, s_den[hl], t, h, d, s_ucs, s_usn);
        }
    }
    /* the partials are dead: drop their L2 lines unwritten (discard), so
     * they do not go out to DRAM while the next kernels stream their
     * weights (8 MB a batch-16 call at 64 heads) */
    __syncthreads();   /* every read of them done */
    for (int i = threadIdx.x; i < CS * HG * Dh / 32; i += FA_THREADS)
        asm volatile("discard.global.L2 [%0], 128;" ::"l"(a.part + (rg * CS * HG * Dh +
                                                                   (int64_t)i * 32))
                     : "memory");
}

/*
 * One cluster of CS CTAs per (row t, head group hg of HG = 16 MT heads);
 * CTA rank z of the cluster takes the row's tiles z, z + CS, z + 2 CS, ...
 * (FA_NC candidates each, in the exact path's candidate order), keeps
 * (O, m, l) over them as fa_kernel does, then the cluster merges: rank z
 * writes head dimensions [z Dh / CS, (z + 1) Dh / CS) of the HG heads,
 * reading the CS partials from the CTAs' shared memory in rank order.
 * No scratch, no second launch, no counters.  No CTA returns early: every
 * one must reach both cluster barriers.
 *
 * GL = 1, the global form (no cluster; for calls whose clusters would not
 * all fit on the device at once, fd_launch): CTA blockIdx.x % CS takes rank
 * z's tiles as above and writes its (O, m, l) to the call's scratch
 * (a.part: every rank's O, then every rank's (m, l) per head); the CTA that
 * arrives last at its (row, head group)'s counter (a.fdc) sets it back to
 * zero and merges all CS partials, every head dimension, with the cluster
 * form's expressions in rank order: the same bits, one wave instead of two.
 */
template <int MT, int DW, int CS, int GL>
static __global__ void __launch_bounds__(FA_THREADS, 1)
fd_kernel(struct fa_args a)
{
    constexpr int HG = 16 * MT, Dh = 8 * DW, KS = DW / 16, NT = DW / 8;
    constexpr int SL4 = Dh / CS / 4;   /* float4s of a rank's output slice, per head */
    extern __shared__ __align__(16) unsigned char fa_sm[];
    __shared__ int s_tl[FD_TPR], s_nt;   /* the CTA's tiles with a valid candidate */
    float *stage = (float *)fa_sm, *po = stage;
    uint16_t *kb = (uint16_t *)(stage + FA_NC * Dh);
    float *sp = (float *)(kb + 2 * FA_NC * (Dh + 8));
    float *pm = sp + FA_WARPS * HG * FA_SP_LD;
    const float **s_ptr = (const float **)(pm + HG * FA_SP_LD);
    float *s_m = (float *)(s_ptr + FD_TPR * FA_NC), *s_l = s_m + HG, *s_al = s_l + HG;
    float *s_f = s_al + HG, *s_den = s_f + HG * CS;
    int z = (int)(blockIdx.x % CS);   /* the cluster rank (1-D clusters of CS) */
    int64_t rg = blockIdx.x / CS;   /* (row, head group) */
    int hg = (int)(rg % a.n_hg), t = (int)(rg / a.n_hg);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, h0 = hg * HG;
    struct fa_row r;
    int nj = 0;
    uint32_t qa[MT][KS][4];
    float o[MT][NT][4];
    __shared__ float s_ucs[CUDA_FA_UR_MAX], s_usn[CUDA_FA_UR_MAX];   /* fa_unrope_table */

    /* a.early (no sel): the candidate rows looked up before the PDL wait,
     * while the kernel before still runs.  They come from pos, slot, row0,
     * pos0 and the page table alone: the step's inputs, never written by
     * the kernel just before this one, and every kernel before that one is
     * complete once this grid runs (each kernel waits before it triggers
     * its dependents; fast_hc.cu's v3 finish relies on the same).  A CSA
     * row's sel may be the kernel just before's output: after the wait. */
    if (a.early)
        nj = fd_lookup<CS>(a, s_ptr, &r, t, z);
    cu_pdl_wait();   /* PDL: before any other global access */
    cu_pdl_trigger();
    /* all loads of the prologue in flight together: q, then the candidate
     * rows (window rows, or page table and sel for the compressed ones) */
    fa_load_q<MT, DW>(qa, a, t, h0, warp, lane);
    if (!a.early)
        nj = fd_lookup<CS>(a, s_ptr, &r, t, z);
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                o[mt][n][i] = 0.0f;
    if (threadIdx.x < HG) {
        s_m[threadIdx.x] = -__int_as_float(0x7f800000);
        s_l[threadIdx.x] = 0.0f;
    }
    __syncthreads();   /* s_ptr */
    /* skip the tiles without a valid candidate (CSA slots past the
     * indexer's selection are -1, so below K * ratio tokens the last tiles
     * hold none): such a tile changes no value (its P is 0, alpha 1, or all
     * zero while m is still -inf), so the CTA walks only the others, in
     * order (up to the sign of a zero sum) */
    if (warp == 0) {
        bool any = false;

        if (lane < nj)
            for (int c = 0; c < FA_NC; c++)
                any |= s_ptr[lane * FA_NC + c] != NULL;
        unsigned int b = __ballot_sync(0xffffffffu, any);

        if (any)
            s_tl[__popc(b & ((1u << lane) - 1u))] = lane;
        if (lane == 0)
            s_nt = __popc(b);
    }
    __syncthreads();   /* s_tl, s_nt */
    nj = s_nt;
    if (nj > 0)
        fd_issue<Dh, float, Dh>(s_ptr + s_tl[0] * FA_NC, stage, a.q);
    /* the output stage's RoPE factors while the first tile's copies are in
     * flight (ordered before their reads by the barriers that follow) */
    fa_unrope_table(a, t, s_ucs, s_usn);

    for (int j = 0; j < nj; j++) {
        const float *const *tp = s_ptr + s_tl[j] * FA_NC;
        uint16_t *kj = kb + (size_t)(j & 1) * FA_NC * (Dh + 8);

        /* this thread's copies of tile j -> bf16 tile j & 1 (the last reads
         * of that buffer, tile j - 2's, were before tile j - 1's barriers) */
        fa_cp_wait<0>();
        fa_convert<Dh>(stage, kj);
        __syncthreads();   /* tile j complete; everyone's staging reads done */
        if (j + 1 < nj)
            fd_issue<Dh, float, Dh>(s_ptr + s_tl[j + 1] * FA_NC, stage,
                                    a.q);   /* in flight during tile j */

        fa_tile_qk<MT, DW>(kj, qa, sp, warp, lane);
        __syncthreads();

        /* 8 threads per head, 4 candidates each, whatever HG (so a head's
         * numerics do not depend on MT) */
        if (threadIdx.x < HG * 8)
            fa_tile_softmax<HG, 8>(sp, pm, s_m, s_l, s_al, a.scale, threadIdx.x,
                                   [&](int c) { return tp[c] != NULL; });
        __syncthreads();

        fa_tile_pv<MT, DW>(kj, pm, s_al, o, warp, lane);
        /* tile j + 1's barriers order these reads of pm and s_al before
         * they are rewritten; kj is not rewritten before tile j + 2 */
    }

    if constexpr (GL != 0) {
        fd_merge_global<MT, DW, CS>(a, o, s_m, s_l, s_f, s_den, s_ucs, s_usn, rg, z, t, h0);
        return;
    }
    cg::cluster_group cl = cg::this_cluster();

    /* the CTA's unnormalised O into the staging (its last reads were
     * before the last tile's barriers; no copy is pending) */
    fd_put_o<MT, DW>(o, po);
    cl.sync();   /* every rank's O, m, l written */

    /* per head: M = max of the ranks' m, the ranks' factors exp(m - M) (-1:
     * a rank without candidates, skipped) and the denominator, in rank order */
    if (threadIdx.x < HG) {
        int hl = threadIdx.x, h = h0 + hl;
        float mz[CS], lz[CS];

#pragma unroll
        for (int k = 0; k < CS; k++) {
            mz[k] = cl.map_shared_rank(s_m, k)[hl];
            lz[k] = cl.map_shared_rank(s_l, k)[hl];
        }
        fd_factors<CS>(mz, lz, a.sink[h < a.H ? h : 0], s_f + hl * CS, s_den + hl);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < HG * SL4; i += FA_THREADS) {
        int hl = i / SL4, h = h0 + hl, d = z * (Dh / CS) + (i % SL4) * 4;
        float4 acc = fd_sum<CS>(s_f + hl * CS, [&](int k) {
            return *(const float4 *)(cl.map_shared_rank(po, k) + (size_t)hl * Dh + d);
        });

        if (h < a.H)
            fd_emit(a, acc, s_den[hl], t, h, d, s_ucs, s_usn);
    }
    cl.sync();   /* the other ranks have read this CTA's shared memory */
}

/* --- host side ----------------------------------------------------------------------- */

/* DSV4_CUDA_FAST_ATTN=0 keeps the exact attention and indexer under the fast
 * switch (a way around a fast kernel suspected wrong). */
int
cuda_fast_attn_enabled(void)
{
    return cuda_env_switch("DSV4_CUDA_FAST_ATTN", 1);   /* 0 / off: the exact kernels */
}

static int
fa_aligned(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

int
cuda_fast_attention_ok(const struct dsv4_backend *be, const float *out, const float *q,
                       const float *kv, const float *ring, const float *comp, int H, int Dh,
                       int win, int cap, int ratio)
{
    if (!cuda_fast_attn_enabled())
        return 0;
    if (Dh != 128 && Dh != 256 && Dh != 512)
        return 0;
    if (H < 1 || win < 1 || (comp != NULL && cap < 1) || ratio < 0)
        return 0;
    /* fa_kernel, every call's last resort (fd_kernel and the bf16-staged
     * form ask no more): a device of less shared memory a block (sm_120's
     * 99 KB at Dh 512) takes the exact kernels */
    if (!cuda_smem_fits(be, fa_smem_bytes(H > 16 ? 2 : 1, Dh, 0)))
        return 0;
    return fa_aligned(out) && fa_aligned(q) && fa_aligned(kv) && fa_aligned(ring) &&
           fa_aligned(comp);
}

template <int MT, int DW, int B16>
static enum dsv4_err
fa_launch_b(struct dsv4_backend *be, const struct fa_args &a)
{
    static size_t smem_done[CUDA_MAX_DEV];   /* per instantiation and device */
    cudaStream_t st = cuda_stream(be);
    size_t smem = fa_smem_bytes(MT, 8 * DW, B16);
    enum dsv4_err e = cuda_smem_allow(be, (const void *)fa_kernel<MT, DW, B16>, smem, smem_done);

    if (e != DSV4_OK)
        return e;
    cu_launch(fa_kernel<MT, DW, B16>, (unsigned)((int64_t)a.T * a.n_hg * a.n_ch), FA_THREADS,
              smem, st, a);
    CUDA_LAUNCHED("fast attention");
    return DSV4_OK;
}

/* DSV4_CUDA_FA_WG=0: a fresh call's rows of 64 heads of 512 dims on
 * fa_kernel instead of fh_kernel (fast_attention_wg.cuh).  1 where fh_kernel
 * runs (the switch on, an sm_90 device). */
static struct cuda_switch fh_sw = CUDA_SWITCH("DSV4_CUDA_FA_WG", 1);

static int
fh_mode(struct dsv4_backend *be)
{
    return cuda_switch_on(&fh_sw) && cuda_sm90(be);
}

/* fh_kernel for a's rows (a fresh call of whole rows, H = 64, Dh = 512):
 * one CTA an SM, taking rows from the call's counter (an MPS client's CTAs
 * that find no SM free until the others are done find no rows left). */
static enum dsv4_err
fh_launch(struct dsv4_backend *be, const struct fa_args &a)
{
    static size_t smem_done[CUDA_MAX_DEV];
    int grid = a.T < cuda_sms(be) ? a.T : cuda_sms(be);
    enum dsv4_err e = cuda_smem_allow(be, (const void *)fh_kernel, FH_SMEM, smem_done);

    if (e != DSV4_OK)
        return e;
    cu_launch(fh_kernel, (unsigned)grid, FH_THREADS, FH_SMEM, cuda_stream(be), a);
    CUDA_LAUNCHED("fast attention (wgmma)");
    return DSV4_OK;
}

template <int MT, int DW>
static enum dsv4_err
fa_launch(struct dsv4_backend *be, const struct fa_args &a)
{
    cudaStream_t st = cuda_stream(be);
    enum dsv4_err e;

    if constexpr (DW < 32) {   /* no staged form below Dh 256 (fa_stage_bytes) */
        e = fa_launch_b<MT, DW, 0>(be, a);
    } else if (a.kvb != NULL) {
        cu_launch(fa_stage_kernel, (unsigned)((2 * (int64_t)a.T * 32 + 255) / 256), 256, 0, st,
                  a);
        CUDA_LAUNCHED("fast attention stage");
        int mode = MT == 2 && DW == 64 && a.H == FH_H && !a.split ? fh_mode(be) : 0;

        e = mode ? fh_launch(be, a) : fa_launch_b<MT, DW, 1>(be, a);
    } else {
        e = fa_launch_b<MT, DW, 0>(be, a);
    }
    if (e != DSV4_OK)
        return e;
    if (a.split) {
        cu_launch(fa_combine_kernel<MT>, (unsigned)((int64_t)a.T * a.H), 128, 0, st, a);
        CUDA_LAUNCHED("fast attention combine");
    }
    return DSV4_OK;
}

template <int MT>
static enum dsv4_err
fa_launch_dh(struct dsv4_backend *be, const struct fa_args &a)
{
    switch (a.Dh) {
    case 128:
        return fa_launch<MT, 16>(be, a);
    case 256:
        return fa_launch<MT, 32>(be, a);
    default:
        return fa_launch<MT, 64>(be, a);
    }
}

/*
 * The kernels DSV4_CUDA_ATTN asks for: 1 ("v1": fa_kernel split into
 * FA_CHUNK chunks + fa_combine_kernel, the first version), 16 or 32 ("v2-16",
 * "v2-32": fd_kernel with that many heads per CTA), FA_V2C ("v2c":
 * fd_kernel's cluster form only), FA_V2G ("v2g": its global form always),
 * 0 (unset or anything else: fd_kernel, heads per CTA by the call's size,
 * the form by fd_global_on).
 */
#define FA_V2C 2
#define FA_V2G 3

static int
fa_variant(void)
{
    const char *v = getenv("DSV4_CUDA_ATTN");

    if (v == NULL)
        return 0;
    if (strcmp(v, "v1") == 0)
        return 1;
    if (strcmp(v, "v2-16") == 0)
        return 16;
    if (strcmp(v, "v2-32") == 0)
        return 32;
    if (strcmp(v, "v2c") == 0)
        return FA_V2C;
    if (strcmp(v, "v2g") == 0)
        return FA_V2G;
    return 0;
}

/* DSV4_CUDA_FD_EARLY=0: fd_kernel looks its candidate rows up after its
 * PDL wait in every call (A/B runs; the same bits). */
static struct cuda_switch fd_early_sw = CUDA_SWITCH("DSV4_CUDA_FD_EARLY", 1);

/* DSV4_CUDA_FD_GLOBAL=0: fd_kernel always as clusters (the global form
 * only where DSV4_CUDA_ATTN=v2g asks for it). */
static struct cuda_switch fd_global_sw = CUDA_SWITCH("DSV4_CUDA_FD_GLOBAL", 1);

/*
 * Clusters of fd_kernel<MT, DW, CS> (smem bytes of dynamic shared memory
 * each CTA) the device holds at once (cudaOccupancyMaxActiveClusters; 0
 * when it cannot say), asked once per device.  H200, 180 KB CTAs: 30 of 4.
 */
template <int MT, int DW, int CS>
static int
fd_clusters_at_once(int dev, size_t smem)
{
    static int n_at[FD_MAX_DEV];   /* 0 unknown, else n + 1 */
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute at[1];
    int n = 0;

    if (dev >= 0 && dev < FD_MAX_DEV && n_at[dev] > 0)
        return n_at[dev] - 1;
    cu_cluster_cfg(cfg, at, dim3(CS), dim3(FA_THREADS), smem, 0, CS);
    if (cudaOccupancyMaxActiveClusters(&n, fd_kernel<MT, DW, CS, 0>, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 0;
    }
    if (dev >= 0 && dev < FD_MAX_DEV)
        n_at[dev] = n + 1;
    return n;
}

/*
 * Launch fd_kernel<MT, DW> for a (a.n_hg head groups of 16 MT heads);
 * *launched = 0 (and DSV4_OK) when the device cannot hold one cluster of
 * CS such CTAs (checked once per device), so the caller falls back.
 * The form (fd_kernel): global where variant asks for it (FA_V2G), or
 * where the switch is on, variant is not FA_V2C and the call's clusters
 * would not all fit at once (a batch of 16 rows at 64 heads: 32 clusters
 * of 4, 30 at once on the H200: two waves); else clusters.  The global form
 * needs the backend's counters (st->lin_ctr, shared with the decode
 * linear's one- and two-launch forms: each kernel leaves them zero) and
 * scratch for the partials, else it is not taken.  Both forms give the
 * same bits.
 */
template <int MT, int DW, int CS>
static enum dsv4_err
fd_launch(struct dsv4_backend *be, const struct fa_args &a, int variant, int *launched)
{
    static signed char fits[FD_MAX_DEV];   /* 0 unknown, 1 yes, -1 no */
    static size_t smem_c[CUDA_MAX_DEV], smem_g[CUDA_MAX_DEV];   /* cuda_smem_allow's */
    struct cuda_state *st = cuda_st(be);
    int dev = st->device;
    size_t smem = fd_smem_bytes(MT, 8 * DW, CS);
    signed char once = 0;   /* a device past FD_MAX_DEV: asked at every launch */
    int64_t clusters = (int64_t)a.T * a.n_hg;
    unsigned grid = (unsigned)(clusters * CS);
    enum dsv4_err e;

    *launched = 0;
    if (!cuda_smem_fits(be, smem))
        return DSV4_OK;   /* sm_120 at Dh 512: fa_kernel (cuda_fast_attention_ok) */
    e = cuda_smem_allow(be, (const void *)fd_kernel<MT, DW, CS, 0>, smem, smem_c);
    if (e != DSV4_OK)
        return e;
    if (st->lin_ctr != NULL && clusters <= FA_SPLIT_ROWS &&
        (variant == FA_V2G ||
         (variant != FA_V2C && cuda_switch_on(&fd_global_sw) &&
          clusters > fd_clusters_at_once<MT, DW, CS>(dev, smem)))) {
        struct fa_args g = a;

        g.part = (float *)cuda_scratch(be, (size_t)grid * 16 * MT * (8 * DW + 2) * sizeof(float));
        if (g.part == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "fast attention: no scratch");
        g.fdc = st->lin_ctr;
        e = cuda_smem_allow(be, (const void *)fd_kernel<MT, DW, CS, 1>, smem, smem_g);
        if (e != DSV4_OK)
            return e;
        cu_launch(fd_kernel<MT, DW, CS, 1>, grid, FA_THREADS, smem, cuda_stream(be), g);
        CUDA_LAUNCHED("fast attention v2 (global)");
        *launched = 1;
        return DSV4_OK;
    }
    CUDA_TRY(cu_launch_cluster(fd_kernel<MT, DW, CS, 0>, dim3(grid), dim3(FA_THREADS), smem,
                               cuda_stream(be), CS,
                               dev >= 0 && dev < FD_MAX_DEV ? &fits[dev] : &once, launched, a));
    if (*launched)
        CUDA_LAUNCHED("fast attention v2");
    return DSV4_OK;
}

template <int MT, int CS>
static enum dsv4_err
fd_launch_dh(struct dsv4_backend *be, const struct fa_args &a, int variant, int *launched)
{
    switch (a.Dh) {
    case 128:
        return fd_launch<MT, 16, CS>(be, a, variant, launched);
    case 256:
        return fd_launch<MT, 32, CS>(be, a, variant, launched);
    default:
        return fd_launch<MT, 64, CS>(be, a, variant, launched);
    }
}

/*
 * CTAs per cluster: FD_CS (4), or 8 with DSV4_CUDA_FD_CS=8 (read at each
 * call).  A cluster of 8 of these 180 KB CTAs needs 8 SMs of one GPC: the
 * H200 holds 15 at once (30 of 4), so a batch-16 call at 32 heads per CTA
 * (16 clusters) ran in two waves.  H200, bench_attn, H = 32 (perf.md run
 * 31): T = 16 window 22.0 -> 11.8 us, CSA at 1,024 tokens 30.7 -> 18.4,
 * HCA 22.2 -> 14.7; T = 1 (one cluster, half the CTAs) CSA at 1,024 tokens
 * 11.4 -> 13.5, at 8,192 14.0 -> 19.0, window unchanged.  The two give
 * different bits (another grouping of the tiles), each T-independent.
 */
static int
fd_cs(void)
{
    const char *v = getenv("DSV4_CUDA_FD_CS");

    return v != NULL && strcmp(v, "8") == 0 ? 8 : FD_CS;
}

/* DSV4_CUDA_FUSE_UNROPE=0: the output's inverse RoPE as its own launch
 * (rope_kernel) after fd_kernel too, as before it was fused (the same bits:
 * docs/perf.md run 44). */
static struct cuda_switch fa_unrope_sw = CUDA_SWITCH("DSV4_CUDA_FUSE_UNROPE", 1);

/* The output's inverse RoPE as its own launch where the call asks for it
 * (ur_rd > 0) and the kernel launched for `a` did not rotate (a.ur_np == 0). */
static enum dsv4_err
fa_unrope_after(struct dsv4_backend *be, const struct fa_args &a, int ur_off, int ur_rd,
                const float *ur_freqs)
{
    if (ur_rd <= 0 || a.ur_np > 0)
        return DSV4_OK;
    return cuda_rope(be, a.out, a.pos, a.T, a.H, (int64_t)a.H * a.Dh, a.Dh, ur_off, ur_rd,
                     ur_freqs, 1);
}

/* The arguments of a call, whole rows (n_ch 1), head groups of 32 heads
 * when H > 16, else 16; nothing rotated. */
static struct fa_args
fa_args_make(float *out, const float *q, const float *kv, const float *ring, const float *comp,
             const int32_t *pages, const int32_t *sel, const float *sink, const int32_t *slot,
             const int32_t *pos, const int32_t *row0, const int32_t *pos0, int T, int H, int Dh,
             int win, int cap, int ratio, int K, float scale)
{
    struct fa_args a;
    int HG = H > 16 ? 32 : 16;

    memset(&a, 0, sizeof(a));
    a.out = out;
    a.q = q;
    a.kv = kv;
    a.ring = ring;
    a.comp = comp;
    a.pages = pages;
    a.sel = comp != NULL ? sel : NULL;
    a.sink = sink;
    a.slot = slot;
    a.pos = pos;
    a.row0 = row0;
    a.pos0 = pos0;
    a.T = T;
    a.H = H;
    a.Dh = Dh;
    a.win = win;
    a.cap = cap;
    a.ratio = ratio;
    a.K = K;
    a.scale = scale;
    a.n_hg = (H + HG - 1) / HG;
    a.n_ch = 1;
    return a;
}

/* --- q held as bf16 (linear_norm_rope's q_attn, dsv4_attn's q_held) ---------------------- */

/* i < n: widen, dst[i] (fp32) = src[i] (bf16); else dst[i] (bf16) =
 * src[i] (fp32) rounded to nearest even (fa_pack's rounding). */
static __global__ void
fa_q16_kernel(void *dst, const void *src, int64_t n, int widen)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (widen)
            ((float *)dst)[i] = __uint_as_float((uint32_t)((const uint16_t *)src)[i] << 16);
        else
            ((uint16_t *)dst)[i] = (uint16_t)(fa_pack(((const float *)src)[i], 0.0f) & 0xffffu);
    }
}

enum dsv4_err
cuda_q16_widen(struct dsv4_backend *be, const float *q, int64_t n)
{
    uint16_t *sc = (uint16_t *)cuda_scratch(be, (size_t)n * sizeof(uint16_t));

    if (sc == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "q16 widen: no scratch");
    /* the bf16 half first out of the way: the fp32 values overwrite it */
    CUDA_TRY(cudaMemcpyAsync(sc, q, (size_t)n * sizeof(uint16_t), cudaMemcpyDeviceToDevice,
                             cuda_stream(be)));
    cu_launch(fa_q16_kernel, cuda_blocks(n, 256), 256, 0, cuda_stream(be), (void *)q,
              (const void *)sc, n, 1);
    CUDA_LAUNCHED("q16 widen");
    return DSV4_OK;
}

enum dsv4_err
dsv4_cuda_q16_hold(struct dsv4_backend *be, float *q, int64_t n)
{
    uint16_t *sc;

    if (!cuda_is_backend(be))
        return dsv4_err_set(DSV4_ERR_INVAL, "q16 hold: not a CUDA backend");
    sc = (uint16_t *)cuda_scratch(be, (size_t)n * sizeof(uint16_t));
    if (sc == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "q16 hold: no scratch");
    cu_launch(fa_q16_kernel, cuda_blocks(n, 256), 256, 0, cuda_stream(be), (void *)sc,
              (const void *)q, n, 0);
    CUDA_LAUNCHED("q16 hold");
    CUDA_TRY(cudaMemcpyAsync(q, sc, (size_t)n * sizeof(uint16_t), cudaMemcpyDeviceToDevice,
                             cuda_stream(be)));
    cuda_st(be)->q16 = q;
    return DSV4_OK;
}

/* DSV4_CUDA_ATTN_STAGE=0: fresh calls' key rows converted in every CTA as
 * before (A/B runs; the same bits). */
static struct cuda_switch fa_stage_sw = CUDA_SWITCH("DSV4_CUDA_ATTN_STAGE", 1);

/* Scratch bytes of a call's staged key rows (fa_stage_kernel: 2 T rows of
 * Dh bf16, kv's and the completed entries', then fh_kernel's row counter):
 * a fresh call of whole rows (not split) with Dh >= 256 and the switch on,
 * else 0. */
static size_t
fa_stage_bytes(int fresh, int split, int T, int Dh)
{
    if (!fresh || split || Dh < 256 || !cuda_switch_on(&fa_stage_sw))
        return 0;
    return 2 * cuda_align((size_t)T * Dh * sizeof(uint16_t)) + cuda_align(sizeof(int));
}

/* a's staged rows at sc (fa_stage_bytes of the call). */
static void
fa_stage_at(struct fa_args &a, unsigned char *sc, int T, int Dh)
{
    size_t rows = cuda_align((size_t)T * Dh * sizeof(uint16_t));   /* T rows of Dh bf16 */

    a.kvb = (uint16_t *)sc;
    a.compb = (uint16_t *)(sc + rows);
    a.ctr = (int *)(sc + 2 * rows);
}

enum dsv4_err
cuda_fast_attention(struct dsv4_backend *be, float *out, const float *q, const float *kv,
                    const float *ring, const float *comp, const int32_t *pages,
                    const int32_t *sel, const float *sink, const int32_t *slot,
                    const int32_t *pos, const int32_t *row0, const int32_t *pos0, int T, int H,
                    int Dh, int win, int cap, int ratio, int K, float scale, int ur_off,
                    int ur_rd, const float *ur_freqs, int fresh, int q16, uint16_t *outb,
                    int *wrote_b)
{
    struct fa_args a = fa_args_make(out, q, kv, ring, comp, pages, sel, sink, slot, pos, row0,
                                    pos0, T, H, Dh, win, cap, ratio, K, scale);
    int MT = H > 16 ? 2 : 1, HG = 16 * MT, max_cand, variant = fa_variant(), cs = fd_cs();

    *wrote_b = 0;

    a.q16 = q16;   /* every kernel below reads q through fa_load_q or fh_kernel */
    if (ur_rd > 0 && ur_rd % 2 == 0 && ur_rd / 2 <= CUDA_FA_UR_MAX && ur_off >= 0 &&
        ur_off % 2 == 0 && ur_off + ur_rd <= Dh && cuda_switch_on(&fa_unrope_sw)) {
        a.ur_off = ur_off;
        a.ur_np = ur_rd / 2;
        for (int i = 0; i < a.ur_np; i++)
            a.ur_f[i] = ur_freqs[i];
    }
    max_cand = win + (comp == NULL ? 0 : sel != NULL ? K : cap);
    if ((int64_t)T * a.n_hg <= FA_SPLIT_ROWS && variant != 1 && max_cand > FA_NC &&
        max_cand <= cs * FD_TPR * FA_NC) {
        /* v2: 32 heads per CTA once the 32-head form has FD_MIN_CTAS CTAs
         * (fewer key reads), else 16 (more CTAs); a head's numerics are the
         * same either way */
        struct fa_args a2 = a;
        int mt2 = H > 16 && (variant == 32 ||
                             (variant != 16 &&
                              (int64_t)T * ((H + 31) / 32) * cs >= FD_MIN_CTAS));
        int launched = 0;
        enum dsv4_err e;

        a2.n_hg = (H + (mt2 ? 32 : 16) - 1) / (mt2 ? 32 : 16);
        a2.early = a2.sel == NULL && cuda_switch_on(&fd_early_sw);
        /* bf16 to outb where nothing is rotated after the kernel */
        a2.outb = ur_rd <= 0 || a2.ur_np > 0 ? outb : NULL;
        if (cs == 4)
            e = mt2 ? fd_launch_dh<2, 4>(be, a2, variant, &launched)
                    : fd_launch_dh<1, 4>(be, a2, variant, &launched);
        else
            e = mt2 ? fd_launch_dh<2, 8>(be, a2, variant, &launched)
                    : fd_launch_dh<1, 8>(be, a2, variant, &launched);
        if (e != DSV4_OK)
            return e;
        if (launched) {
            *wrote_b = a2.outb != NULL;
            return fa_unrope_after(be, a2, ur_off, ur_rd, ur_freqs);
        }
    }
    /* fa_kernel and its combine rotate nothing (in fa_kernel's output stage
     * it made a 2,048-token prefill slower, docs/perf.md run 44) */
    a.ur_off = a.ur_np = 0;
    if ((int64_t)T * a.n_hg <= FA_SPLIT_ROWS) {
        int n_ch = (max_cand + FA_CHUNK - 1) / FA_CHUNK;
        size_t bytes = (size_t)T * a.n_hg * n_ch * HG * (Dh + 2) * sizeof(float);

        if (n_ch > 1 && bytes <= FA_SPLIT_BYTES) {
            a.part = (float *)cuda_scratch(be, bytes);
            if (a.part == NULL)
                return dsv4_err_set(DSV4_ERR_NOMEM, "fast attention: no scratch");
            a.split = FA_CHUNK;
            a.n_ch = n_ch;
        }
    }
    /* a fresh call's whole rows: the key rows staged as bf16 once instead of
     * converted by each CTA */
    size_t ns = fa_stage_bytes(fresh, a.split, T, Dh);

    if (ns > 0) {
        unsigned char *sc = (unsigned char *)cuda_scratch(be, ns);

        if (sc == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "fast attention: no scratch");
        fa_stage_at(a, sc, T, Dh);
    }
    enum dsv4_err e = MT == 2 ? fa_launch_dh<2>(be, a) : fa_launch_dh<1>(be, a);

    if (e != DSV4_OK)
        return e;
    return fa_unrope_after(be, a, ur_off, ur_rd, ur_freqs);
}

size_t
cuda_fast_attention_outb_scratch(int T, int H, int Dh)
{
    /* fd_launch's global form: T * n_hg * CS CTAs of HG heads' (Dh + 2)
     * floats, n_hg * HG <= H rounded up to 32 */
    return (size_t)T * fd_cs() * ((H + 31) / 32 * 32) * (Dh + 2) * sizeof(float);
}

/* --- attention_out: the output to wo_a as bf16 ------------------------------------------ */

/* The RoPE frequencies of fa_unrope16_kernel, by value. */
struct fa_ur16 {
    int off, np;
    float f[CUDA_FA_UR_MAX];
};

/*
 * The output's inverse RoPE on its bf16 copy (T, H, Dh), one block a row:
 * the row's cos / sin per pair once (cu_rope_cs, as rope_rows_kernel), each
 * head's pairs read as bf16, rotated with rope_rows_kernel's expression
 * (cu_rope_rot) and rounded to bf16 again (cu_bf16_round, as bl_x_kernel
 * rounds the fp32 row the rope op leaves): the values attention_unrope
 * then linear_grouped's bf16 conversion give.
 */
static __global__ void
fa_unrope16_kernel(uint16_t *xb, const int32_t *pos, int H, int Dh, struct fa_ur16 ur)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ float cs[CUDA_FA_UR_MAX], sn[CUDA_FA_UR_MAX];
    int64_t t = blockIdx.x;
    uint16_t *xr = xb + t * H * Dh + ur.off;

    for (int i = threadIdx.x; i < ur.np; i += blockDim.x)
        cu_rope_cs((float)pos[t], ur.f[i], 1, cs[i], sn[i]);
    __syncthreads();
    for (int e = threadIdx.x; e < H * ur.np; e += blockDim.x) {
        int h = e / ur.np, i = e % ur.np;
        uint32_t *v = (uint32_t *)(xr + (int64_t)h * Dh + 2 * i), w = *v;
        float x0 = __uint_as_float(w << 16), x1 = __uint_as_float(w & 0xffff0000u);

        cu_rope_rot(x0, x1, cs[i], sn[i]);
        *v = cu_bf16x2_round(x0, x1);
    }
}

/* DSV4_CUDA_ATTN_OUT=0: attention_out as attention_unrope + linear_grouped
 * (fp32 output, rope, bl_x's conversion; the same bits). */
static struct cuda_switch fa_out_sw = CUDA_SWITCH("DSV4_CUDA_ATTN_OUT", 1);

enum dsv4_err
cuda_fast_attention_out(struct dsv4_backend *be, const struct dsv4_attn *x, int off, int rd,
                        const float *freqs, float *u, const struct dsv4_linear *wo_a, int G,
                        int q16)
{
    struct fa_args a = fa_args_make(x->out, x->q, x->kv, x->ring, x->comp, x->pages, x->sel,
                                    x->sink, x->slot, x->pos, x->row0, x->pos0, x->T, x->H,
                                    x->Dh, x->win, x->cap, x->ratio, x->K, x->scale);
    int T = x->T, H = x->H, Dh = x->Dh;
    size_t ns = 0, no = cuda_align((size_t)T * H * Dh * sizeof(uint16_t)), nb;
    struct fa_ur16 ur;
    unsigned char *sc;
    enum dsv4_err e;

    if (!cuda_switch_on(&fa_out_sw) || (int64_t)T * a.n_hg <= FA_SPLIT_ROWS || G <= 0 ||
        (int64_t)G * wo_a->n_in != (int64_t)H * Dh || rd < 0 || rd % 2 != 0 ||
        rd / 2 > CUDA_FA_UR_MAX || off < 0 || off % 2 != 0 || (rd > 0 && off + rd > Dh) ||
        !cuda_blas_grouped_ready(be, wo_a, G))
        return DSV4_ERR_NOTSUP;
    nb = cuda_blas_grouped_b16_scratch(wo_a, T);
    ns = fa_stage_bytes(x->fresh, 0, T, Dh);   /* cuda_fast_attention's staging */
    sc = (unsigned char *)cuda_scratch(be, ns + no + nb);
    if (sc == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "fast attention out: no scratch");
    if (ns > 0)
        fa_stage_at(a, sc, T, Dh);
    a.outb = (uint16_t *)(sc + ns);
    a.q16 = q16;
    e = H > 16 ? fa_launch_dh<2>(be, a) : fa_launch_dh<1>(be, a);
    if (e != DSV4_OK)
        return e;
    if (rd > 0) {
        memset(&ur, 0, sizeof(ur));
        ur.off = off;
        ur.np = rd / 2;
        for (int i = 0; i < ur.np; i++)
            ur.f[i] = freqs[i];
        cu_launch(fa_unrope16_kernel, (unsigned)T, 256, 0, cuda_stream(be), a.outb, x->pos, H,
                  Dh, ur);
        CUDA_LAUNCHED("fast attention out unrope");
    }
    return cuda_blas_grouped_b16(be, u, a.outb, wo_a, T, G, sc + ns + no);
}
