/*
 * fast_indexer.cu — the fast indexer scores and top-k (backend.h
 * `indexer_topk`, model doc §3.3.5) for any T.  Used by cuda_indexer_topk
 * when the fast kernels are on (kernels/cuda_fast.h) and
 * cuda_fast_indexer_ok accepts the shapes.
 *
 * Two kernels, scores (T, cap) fp32 in the backend scratch between them.
 *
 * fi_score_kernel: a CTA of 8 warps owns R rows (R = 4 for prefill-sized
 *   calls, 1 for decode) and a chunk of key entries.  When the R rows share
 *   a slot (consecutive rows of one sequence) one pass serves them all, each
 *   key tile loaded once; else each row gets its own pass.  Per tile of 64
 *   keys: the keys (fp32 pool rows through the page table) are converted to
 *   bf16 in shared memory; the q·k dot products of every (row, head, key)
 *   come from the tensor cores (mma.sync m16n8k16 bf16, fp32 accumulators,
 *   the Q fragments in registers for the pass); then one thread per
 *   (row, key) forms the score exactly as the exact path does: per head in
 *   head order, REF: term = bf16(ReLU(bf16(dot)) * w), sum in fp32,
 *   score = bf16(sum); HF: the fp32 expression without roundings.
 *
 *   Exactness guard (REF).  The exact path's dot (cpu_dot's order) and the
 *   tensor core's are both the exact real dot product whenever every
 *   partial sum is representable: with all q_i, k_i bf16 values, q's
 *   nonzero magnitudes in [2^Lq, 2^Mq) and k's in [2^Lk, 2^Mk), every
 *   product and partial sum is a multiple of 2^(Lq+Lk) below
 *   128 * 2^(Mq+Mk), so (Mq + 7 + Mk) - (Lq + Lk) <= 24 and
 *   Lq + Lk >= -126 (no subnormals) make both exact, hence equal.  The
 *   indexer's inputs are FP4-simulated (E2M1 codes times a power of two per
 *   32 values), which meets this unless a vector's block scales are very far
 *   apart.  A (head, key) pair that fails the guard (or has a value that is
 *   not bf16, inf or NaN) gets its dot recomputed by the summing thread in
 *   cpu_dot's order from the fp32 inputs.  So under REF the scores are the
 *   exact path's bits, and the selection (below) is the exact path's set and
 *   order.  HF numerics skip the guard (only non-bf16 / non-finite values
 *   take the exact dot): scores differ by fp32 rounding, picks only at near
 *   ties.
 *
 * fi_select_kernel: one CTA per row.  The sort key of entry e is the exact
 *   path's (cu_rank_key: score descending, then index ascending).  When
 *   n_valid > K a radix select (4 passes of 8 bits over the 32-bit score key,
 *   shared-memory histograms) finds the K-th best score key; entries better
 *   than it are taken, and of the entries equal to it the lowest indices
 *   (an ordered block scan) until K are taken; the K keys are then sorted
 *   (bitonic, shared memory) and written as sel, then -1.  n_valid <= K:
 *   every valid entry in index order (backend.h), and the score kernels
 *   skip the row (fi_n_scored).
 *
 * v2 (DSV4_CUDA_ATTN=v1 keeps the first kernels): decode-sized
 *   calls (T < 32) batch the score kernel's loads (fi_score_kernel<1, true>),
 *   and rows of K <= 512 picks from at most 4,096 valid entries use
 *   fi_select2_kernel (keys in registers, shuffle steps in the sort).  Same
 *   scores and picks bit for bit.
 * v3 (the default for decode-sized calls whose v3 grid fits the SMs at
 *   once, fi_score_cl_launch; DSV4_CUDA_FI_CLUSTER=0: v2): the scores on a
 *   cluster of 4 CTAs per (row, key tile), 16 heads each, the head-order
 *   sums over distributed shared memory (fi_score_cl_kernel).  Same scores
 *   bit for bit.
 *
 * No host synchronisation, scratch from the backend only (graph-safe);
 * deterministic, each row's picks depend on its own inputs only.
 */
#include "kernels/cuda/fast_mma.cuh"

#include <cooperative_groups.h>
#include <stdlib.h>
#include <string.h>

namespace cg = cooperative_groups;

#define FI_THREADS 256
#define FI_NK 64              /* keys per tile */
#define FI_KLD (128 + 8)      /* bf16 row stride of the key tile */
#define FI_TLD (FI_NK + 8)    /* float row stride of the dot tile */
#define FI_MAX_HEADS 64
#define FI_SEL_THREADS 512
#define FI_MAX_K 2048
#define FI_SEL_REG 8          /* v2 select: score keys per thread in registers */
#define FI_CS 4               /* v3 decode scores: CTAs of a cluster, 16 heads each */
#define FI_CH 16              /* ... heads per CTA (FI_CS FI_CH = FI_MAX_HEADS) */
#define FI_MAX_DEV 64         /* devices with a cached cluster check */

struct fi_args {
    float *scores;            /* (T, cap) */
    const float *q, *w, *keys;
    const int32_t *pages, *slot, *pos;
    int T, nh, cap, ratio, ref, kt;   /* kt: key tiles per CTA */
    int K;
};

static __device__ __forceinline__ int
fi_n_valid(const int32_t *pos, int t, int ratio, int cap)
{
    int n = (pos[t] + 1) / ratio;

    return n < cap ? n : cap;
}

/* Entries of row t the score kernels score: every valid one when there are
 * more than K, else none (the row takes them all, unscored). */
static __device__ __forceinline__ int
fi_n_scored(const struct fi_args &a, int t)
{
    int n = fi_n_valid(a.pos, t, a.ratio, a.cap);

    return n > a.K ? n : 0;
}

/* A select kernel's row t of at most K valid entries: them in index order,
 * then -1; 1 when it took the row (uniform over the CTA). */
static __device__ __forceinline__ int
fi_select_all(int32_t *sel, int t, int nv, int K)
{
    if (nv > K)
        return 0;
    for (int i = threadIdx.x; i < K; i += blockDim.x)
        sel[(int64_t)t * K + i] = i < nv ? i : -1;
    return 1;
}

/*
 * Exactness facts of 4 values, merged over a warp: x = M (values < 2^M),
 * y = L (nonzero values >= 2^L), z = flags (1: some value is not a finite
 * bf16; 2: some value is nonzero).
 */
static __device__ __forceinline__ int3
fi_stats(float4 v)
{
    int3 s = make_int3(-1000, 1000, 0);
    float e[4] = { v.x, v.y, v.z, v.w };

#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t b = __float_as_uint(e[i]);
        int E = (int)((b >> 23) & 0xffu);
        uint32_t m = b & 0x7fffffu;

        if ((b & 0xffffu) != 0 || E == 0xff)
            s.z |= 1;
        if ((b & 0x7fffffffu) == 0)
            continue;
        s.z |= 2;
        s.x = max(s.x, E == 0 ? -126 : E - 126);
        s.y = min(s.y, E == 0 ? -149 + __ffs(m) - 1 : E - 150 + __ffs(m | 0x800000u) - 1);
    }
    /* one warp reduction each (redux.sync): the same max, min and or as
     * five xor-shuffle rounds, without their chain of dependent shuffles
     * (16 calls a warp in a decode score kernel) */
    s.x = __reduce_max_sync(0xffffffffu, s.x);
    s.y = __reduce_min_sync(0xffffffffu, s.y);
    s.z = (int)__reduce_or_sync(0xffffffffu, (unsigned)s.z);
    return s;
}

/* Whether the tensor-core dot of q (stats a) and k (stats b) is the exact
 * path's (see the file comment). */
static __device__ __forceinline__ int
fi_exact(int3 a, int3 b, int ref)
{
    if ((a.z | b.z) & 1)
        return 0;
    if (!(a.z & 2) || !(b.z & 2) || !ref)
        return 1;   /* a zero vector: both give 0 */
    return a.x + 7 + b.x - (a.y + b.y) <= 24 && a.y + b.y >= -126;
}

/* cpu_dot(q, k, 128): 8 lane sums in order, added l+4, +2, +1. */
static __device__ float
fi_dot_ref(const float *q, const float *k)
{
    float s[8];

#pragma unroll
    for (int l = 0; l < 8; l++)
        s[l] = 0.0f;
    for (int i = 0; i < 128; i += 8)
#pragma unroll
        for (int l = 0; l < 8; l++)
            s[l] += q[i + l] * k[i + l];
#pragma unroll
    for (int w = 4; w > 0; w /= 2)
#pragma unroll
        for (int l = 0; l < w; l++)
            s[l] += s[l + w];
    return s[0];
}

/* The term of head h for a key of stats kst at row t: REF bf16(ReLU(
 * bf16(dot)) * w), else ReLU(dot) * w; dot = the tensor core's d when the
 * exactness guard holds, else cpu_dot's from the fp32 inputs. */
static __device__ __forceinline__ float
fi_term(const struct fi_args &a, int4 q, float wv, int3 kst, float d, int t, int h,
        const float *krow)
{
    float dot = fi_exact(make_int3(q.x, q.y, q.z), kst, a.ref)
        ? d : fi_dot_ref(a.q + ((int64_t)t * a.nh + h) * 128, krow);

    if (a.ref) {
        dot = cu_bf16_round(dot);
        return cu_bf16_round((dot > 0.0f ? dot : 0.0f) * wv);
    }
    return (dot > 0.0f ? dot : 0.0f) * wv;
}

/*
 * The q stats and w of heads h0 .. h0 + NH - 1 of row t into qs[0 .. NH) /
 * ws (heads >= nh skipped; nothing when !act): warp w takes heads
 * h0 + w + 8 k, every warp's loads issued together, then the stats.  Every
 * thread of the block calls it.
 */
template <int NH>
static __device__ __forceinline__ void
fi_q_stats(const struct fi_args &a, int t, int h0, int act, int4 *qs, float *ws)
{
    constexpr int NQ = NH / (FI_THREADS / 32);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float4 qv[NQ];
    float wv[NQ];

#pragma unroll
    for (int k = 0; k < NQ; k++) {
        int h = h0 + warp + (FI_THREADS / 32) * k, ok = act && h < a.nh;
        const float *qr = a.q + ((int64_t)t * a.nh + (ok ? h : 0)) * 128;

        qv[k] = ok ? *(const float4 *)(qr + lane * 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        wv[k] = ok && lane == 0 ? a.w[(int64_t)t * a.nh + h] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < NQ; k++) {
        int hl = warp + (FI_THREADS / 32) * k;

        if (act && h0 + hl < a.nh) {   /* uniform over the warp */
            int3 st = fi_stats(qv[k]);

            if (lane == 0) {
                qs[hl] = make_int4(st.x, st.y, st.z, 0);
                ws[hl] = wv[k];
            }
        }
    }
}

/*
 * The A fragments (bf16, mma m16n8k16, K = 128 in 8 k-steps) of heads
 * h0 .. h0 + 15 of row t for this lane; zero for heads >= nh or when !act.
 */
static __device__ __forceinline__ void
fi_q_frag(uint32_t (&qa)[8][4], const struct fi_args &a, int t, int h0, int act)
{
    int lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;

#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        int h = h0 + g + 8 * hh, ok = act && h < a.nh;
        const float *qr = a.q + ((int64_t)t * a.nh + (ok ? h : 0)) * 128 + 2 * q4;

#pragma unroll
        for (int k = 0; k < 8; k++) {
            float2 lo = ok ? *(const float2 *)(qr + 16 * k) : make_float2(0.f, 0.f);
            float2 hi = ok ? *(const float2 *)(qr + 16 * k + 8) : make_float2(0.f, 0.f);

            qa[k][hh] = fa_pack(lo.x, lo.y);
            qa[k][2 + hh] = fa_pack(hi.x, hi.y);
        }
    }
}

/*
 * Key tile e0 .. e0 + FI_NK - 1 of slot s (entries >= n zero): bf16 rows
 * into kb, stats into ks, pool rows (NULL past n) into krow.  Warp w loads
 * keys w, w + 8, .., one float4 a lane: the page-table reads, then the key
 * loads, each batch in flight together.  Every thread of the block calls it.
 */
static __device__ __forceinline__ void
fi_key_tile(const struct fi_args &a, int s, int e0, int n, uint16_t *kb, int4 *ks,
            const float **krow)
{
    constexpr int KPW = FI_NK / (FI_THREADS / 32);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float *kr[KPW];
    float4 kv[KPW];

#pragma unroll
    for (int k = 0; k < KPW; k++) {
        int e = e0 + warp + (FI_THREADS / 32) * k;

        kr[k] = e < n ? a.keys + cu_pool_row(a.pages, a.cap, s, e) * 128 : NULL;
    }
#pragma unroll
    for (int k = 0; k < KPW; k++)
        kv[k] = kr[k] != NULL ? *(const float4 *)(kr[k] + lane * 4)
                              : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < KPW; k++) {
        int j = warp + (FI_THREADS / 32) * k;
        int3 st = fi_stats(kv[k]);

        *(uint2 *)(kb + j * FI_KLD + lane * 4) =
            make_uint2(fa_pack(kv[k].x, kv[k].y), fa_pack(kv[k].z, kv[k].w));
        if (lane == 0) {
            ks[j] = make_int4(st.x, st.y, st.z, 0);
            krow[j] = kr[k];
        }
    }
}

/*
 * The scores of one key tile of row t (R == 1): every thread of the block
 * turns (head, key) dots of dt into terms in place, then thread j < FI_NK
 * adds key j's terms in head order and stores the score (REF: bf16).  The
 * same expression per term (fi_term) and the same order of the sum as one
 * thread per key walking the heads.  Every thread of the block calls it.
 */
static __device__ __forceinline__ void
fi_score_sum(const struct fi_args &a, float *dt, const int4 *qs, const float *ws,
             const int4 *ks, const float *const *krow, int t, int e0, int nv, int act)
{
    for (int i = threadIdx.x; i < a.nh * FI_NK; i += FI_THREADS) {
        int h = i / FI_NK, j = i % FI_NK;

        if (act && e0 + j < nv)
            dt[h * FI_TLD + j] = fi_term(a, qs[h], ws[h], make_int3(ks[j].x, ks[j].y, ks[j].z),
                                         dt[h * FI_TLD + j], t, h, krow[j]);
    }
    __syncthreads();
    if (threadIdx.x < FI_NK && act && e0 + (int)threadIdx.x < nv) {
        int j = threadIdx.x;
        float acc = 0.0f;

        for (int h = 0; h < a.nh; h++)
            acc += dt[h * FI_TLD + j];
        a.scores[(int64_t)t * a.cap + e0 + j] = a.ref ? cu_bf16_round(acc) : acc;
    }
}

/* Shared memory of fi_score_kernel<R>. */
static __host__ __device__ __forceinline__ size_t
fi_smem_bytes(int R)
{
    return (size_t)FI_NK * FI_KLD * 2                  /* key tile, bf16 */
           + (size_t)R * FI_MAX_HEADS * FI_TLD * 4     /* dots */
           + (size_t)R * FI_MAX_HEADS * (4 + 16)       /* w, q stats */
           + (size_t)FI_NK * 16                        /* key stats */
           + (size_t)FI_NK * sizeof(void *);           /* key rows */
}

/*
 * grid (ceil(T / R), ceil(cap / (kt * 64))).  R * 4 m-tiles of 16 heads:
 * R >= 2: R / 2 m-tiles per warp, all 8 n-tiles; R == 1: one m-tile per two
 * warps, 4 n-tiles each.  B (v2): the loads of the q stats (R == 1) and of
 * a key tile are issued in batches instead of one dependent chain per
 * iteration (the same arithmetic).  R = 4 (prefill) is bounded to 128
 * registers, two CTAs (2 x 98 KB) per SM: 210 registers held it to one and
 * 12.5% occupancy, latency-bound (Nsight Compute: 0.2 issued per cycle per
 * scheduler).  With 256 bytes of spills it is still faster: bench_attn on
 * the H200, 2,048 rows 576 -> 411 us, 2,048 at 6,144 3,042 -> 1,936, 8,192
 * rows 7,266 -> 4,580 (the fp32 case, every dot on the exact fallback,
 * 20.0 -> 22.8 ms); the same picks.
 */
template <int R, bool B>
static __global__ void __launch_bounds__(FI_THREADS, R >= 4 ? 2 : 1)
fi_score_kernel(struct fi_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    constexpr int MTW = R >= 2 ? R / 2 : 1, WPM = R >= 2 ? 1 : 2, NTW = 8 / WPM;
    extern __shared__ __align__(16) unsigned char fi_sm[];
    uint16_t *kb = (uint16_t *)fi_sm;
    float *dt = (float *)(kb + FI_NK * FI_KLD);
    float *ws = dt + R * FI_MAX_HEADS * FI_TLD;
    int4 *qs = (int4 *)(ws + R * FI_MAX_HEADS);
    int4 *ks = qs + R * FI_MAX_HEADS;
    const float **krow = (const float **)(ks + FI_NK);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    int t0 = blockIdx.x * R, e_beg = blockIdx.y * a.kt * FI_NK;
    int same = 1, n_pass;

    for (int r = 1; r < R; r++)
        if (t0 + r < a.T && a.slot[t0 + r] != a.slot[t0])
            same = 0;
    n_pass = same ? 1 : R;
    for (int pass = 0; pass < n_pass; pass++) {
        /* rows of this pass: all (same slot) or row `pass` alone */
        int act[R], nv[R], nvmax = 0, s;
        uint32_t qa[MTW][8][4];

#pragma unroll
        for (int r = 0; r < R; r++) {
            act[r] = t0 + r < a.T && (same || r == pass);
            nv[r] = act[r] ? fi_n_scored(a, t0 + r) : 0;
            nvmax = max(nvmax, nv[r]);
        }
        if (e_beg >= nvmax)
            continue;   /* uniform over the block */
        s = a.slot[t0 + (same ? 0 : pass)];

        /* q stats and w of the active rows (B, R == 1: each warp's 8 loads
         * issued together, then the stats) */
        if (B && R == 1) {
            fi_q_stats<FI_MAX_HEADS>(a, t0, 0, act[0], qs, ws);
        } else {
            for (int i = warp; i < R * FI_MAX_HEADS; i += FI_THREADS / 32) {
                int r = i / FI_MAX_HEADS, h = i % FI_MAX_HEADS;

                if (!act[r] || h >= a.nh)
                    continue;
                {
                    const float *qr = a.q + ((int64_t)(t0 + r) * a.nh + h) * 128;
                    int3 st = fi_stats(*(const float4 *)(qr + lane * 4));

                    if (lane == 0) {
                        qs[i] = make_int4(st.x, st.y, st.z, 0);
                        ws[i] = a.w[(int64_t)(t0 + r) * a.nh + h];
                    }
                }
            }
        }
        /* Q fragments: m-tile mi = row mi / 4, heads (mi % 4) * 16 .. */
#pragma unroll
        for (int j = 0; j < MTW; j++) {
            int mi = R >= 2 ? warp * MTW + j : warp / 2, r = mi / 4;

            fi_q_frag(qa[j], a, t0 + r, (mi % 4) * 16, act[r]);
        }

        for (int kt = 0; kt < a.kt; kt++) {
            int e0 = e_beg + kt * FI_NK;

            if (e0 >= nvmax)
                break;   /* uniform */
            __syncthreads();   /* the previous tile's readers are done */
            /* key tile: warp w loads keys w, w + 8, .. w + 56, one float4 per
             * lane (B: the page-table reads, then the key loads, each batch
             * in flight together) */
            if (B) {
                fi_key_tile(a, s, e0, nvmax, kb, ks, krow);
            } else {
                for (int j = warp; j < FI_NK; j += FI_THREADS / 32) {
                    int e = e0 + j;
                    const float *kr = e < nvmax
                        ? a.keys + cu_pool_row(a.pages, a.cap, s, e) * 128 : NULL;
                    float4 v = kr != NULL ? *(const float4 *)(kr + lane * 4)
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
                    int3 st = fi_stats(v);

                    *(uint2 *)(kb + j * FI_KLD + lane * 4) =
                        make_uint2(fa_pack(v.x, v.y), fa_pack(v.z, v.w));
                    if (lane == 0) {
                        ks[j] = make_int4(st.x, st.y, st.z, 0);
                        krow[j] = kr;
                    }
                }
            }
            __syncthreads();
            /* dots: this warp's m-tiles x n-tiles, K = 128 */
            {
                float acc[MTW][NTW][4];
                int n0 = R >= 2 ? 0 : (warp % 2) * NTW;

#pragma unroll
                for (int j = 0; j < MTW; j++)
#pragma unroll
                    for (int n = 0; n < NTW; n++)
#pragma unroll
                        for (int i = 0; i < 4; i++)
                            acc[j][n][i] = 0.0f;
#pragma unroll
                for (int n = 0; n < NTW; n++)
#pragma unroll
                    for (int k = 0; k < 8; k += 2) {
                        uint32_t b[4];

                        fa_ldsm_x4(b, kb + ((n0 + n) * 8 + (lane & 7)) * FI_KLD + 16 * k +
                                          (lane >> 3) * 8);
#pragma unroll
                        for (int j = 0; j < MTW; j++) {
                            fk_mma_bf16(acc[j][n], qa[j][k][0], qa[j][k][1], qa[j][k][2],
                                        qa[j][k][3], b[0], b[1]);
                            fk_mma_bf16(acc[j][n], qa[j][k + 1][0], qa[j][k + 1][1],
                                        qa[j][k + 1][2], qa[j][k + 1][3], b[2], b[3]);
                        }
                    }
#pragma unroll
                for (int j = 0; j < MTW; j++) {
                    int mi = R >= 2 ? warp * MTW + j : warp / 2;
                    /* dot tile row = r * 64 + head */
                    float *d = dt + ((mi / 4) * FI_MAX_HEADS + (mi % 4) * 16 + g) * FI_TLD;

#pragma unroll
                    for (int n = 0; n < NTW; n++) {
                        int c = (n0 + n) * 8 + 2 * q4;

                        *(float2 *)(d + c) = make_float2(acc[j][n][0], acc[j][n][1]);
                        *(float2 *)(d + 8 * FI_TLD + c) = make_float2(acc[j][n][2], acc[j][n][3]);
                    }
                }
            }
            __syncthreads();
            if (R == 1) {
                /* decode: the (head, key) terms by all the block's threads,
                 * each into its own dot's place, then one thread per key
                 * adds them in head order (fi_score_sum: the same
                 * expressions and order as the loop of R > 1, so the same
                 * bits; that loop had 64 of the 256 threads walk 64 heads
                 * each) */
                fi_score_sum(a, dt, qs, ws, ks, krow, t0, e0, nv[0], act[0]);
            } else {
                /* scores: one thread per (row, key), heads in order */
                for (int i = threadIdx.x; i < R * FI_NK; i += FI_THREADS) {
                    int r = i / FI_NK, j = i % FI_NK, e = e0 + j, t = t0 + r;
                    float acc = 0.0f;
                    int3 kst;

                    if (!act[r] || e >= nv[r])
                        continue;
                    kst = make_int3(ks[j].x, ks[j].y, ks[j].z);
                    for (int h = 0; h < a.nh; h++)
                        acc += fi_term(a, qs[r * FI_MAX_HEADS + h], ws[r * FI_MAX_HEADS + h],
                                       kst, dt[(r * FI_MAX_HEADS + h) * FI_TLD + j], t, h,
                                       krow[j]);
                    a.scores[(int64_t)t * a.cap + e] = a.ref ? cu_bf16_round(acc) : acc;
                }
            }
        }
        __syncthreads();   /* before the next pass rewrites qs / ws */
    }
}

/*
 * v3 decode scores (T < 32; DSV4_CUDA_FI_CLUSTER=0 keeps v2's
 * fi_score_kernel<1, true>): a cluster of FI_CS CTAs per (row, key tile),
 * CTA z owning heads z FI_CH .. z FI_CH + FI_CH - 1.  Each CTA loads the
 * whole tile (keys, their stats and rows), its heads' q stats, w and Q
 * fragments, computes their dots (one m-tile; warp w the keys 8w .. 8w + 7)
 * and their terms in place (fi_term); then rank z adds keys z FI_CH ..
 * of the tile over all the heads in head order, reading each head's term
 * from the CTA that owns it (distributed shared memory).  The expressions
 * and the order of fi_score_sum, so v2's scores bit for bit, with a quarter
 * of its q work, dots and terms on each CTA: v2 ran them all on one CTA,
 * which for the few dozen keys of a short context was the whole kernel
 * (docs/perf.md run 38: ~3,900 instructions a warp, one SM busy).
 */
static __global__ void __launch_bounds__(FI_THREADS, 1)
fi_score_cl_kernel(struct fi_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ __align__(16) uint16_t kb[FI_NK * FI_KLD];
    __shared__ __align__(16) float dt[FI_CH * FI_TLD];
    __shared__ float ws[FI_CH];
    __shared__ int4 qs[FI_CH], ks[FI_NK];
    __shared__ const float *krow[FI_NK];
    cg::cluster_group cl = cg::this_cluster();
    int z = (int)cl.block_rank(), t = (int)(blockIdx.x / FI_CS), h0 = z * FI_CH;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q4 = lane % 4;
    int e0 = blockIdx.y * FI_NK, nv = fi_n_scored(a, t), s = a.slot[t];
    uint32_t qa[8][4];

    if (e0 >= nv)
        return;   /* the whole cluster (same row and tile) */
    /* this CTA's heads: q stats and w (two a warp), Q fragments */
    fi_q_stats<FI_CH>(a, t, h0, 1, qs, ws);
    fi_q_frag(qa, a, t, h0, 1);
    fi_key_tile(a, s, e0, nv, kb, ks, krow);
    __syncthreads();
    /* dots of the CTA's 16 heads with keys 8 warp .. 8 warp + 7, K = 128 in
     * k-steps of 16 in order (v2's sequence of mma for every element) */
    {
        float acc[4] = { 0.0f, 0.0f, 0.0f, 0.0f };

#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            uint32_t b[4];

            fa_ldsm_x4(b, kb + (warp * 8 + (lane & 7)) * FI_KLD + 16 * k + (lane >> 3) * 8);
            fk_mma_bf16(acc, qa[k][0], qa[k][1], qa[k][2], qa[k][3], b[0], b[1]);
            fk_mma_bf16(acc, qa[k + 1][0], qa[k + 1][1], qa[k + 1][2], qa[k + 1][3], b[2], b[3]);
        }
        *(float2 *)(dt + g * FI_TLD + warp * 8 + 2 * q4) = make_float2(acc[0], acc[1]);
        *(float2 *)(dt + (g + 8) * FI_TLD + warp * 8 + 2 * q4) = make_float2(acc[2], acc[3]);
    }
    __syncthreads();
    /* this CTA's (head, key) terms in place */
    for (int i = threadIdx.x; i < FI_CH * FI_NK; i += FI_THREADS) {
        int hl = i / FI_NK, j = i % FI_NK, h = h0 + hl;

        if (h < a.nh && e0 + j < nv)
            dt[hl * FI_TLD + j] = fi_term(a, qs[hl], ws[hl], make_int3(ks[j].x, ks[j].y, ks[j].z),
                                          dt[hl * FI_TLD + j], t, h, krow[j]);
    }
    cl.sync();   /* every rank's terms written */
    if (threadIdx.x < FI_NK / FI_CS) {
        int j = z * (FI_NK / FI_CS) + threadIdx.x;
        float acc = 0.0f;

        if (e0 + j < nv) {
            for (int h = 0; h < a.nh; h++)
                acc += cl.map_shared_rank(dt, h / FI_CH)[(h % FI_CH) * FI_TLD + j];
            a.scores[(int64_t)t * a.cap + e0 + j] = a.ref ? cu_bf16_round(acc) : acc;
        }
    }
    cl.sync();   /* no rank leaves while another reads its terms */
}

/* --- top-k ------------------------------------------------------------------------- */

/* The 32-bit score part of cu_rank_key: ascending = better. */
static __device__ __forceinline__ uint32_t
fi_ukey(float s)
{
    return (uint32_t)(cu_rank_key(s, 0) >> 32);
}

/*
 * Block-wide exclusive scan of flag f (0/1): this thread's rank among the
 * flagged threads and (in *total) their count.  Every thread calls it;
 * wsum: FI_SEL_THREADS / 32 ints of shared memory.
 */
static __device__ __forceinline__ int
fi_scan(int f, int *wsum, int *total)
{
    unsigned bal = __ballot_sync(0xffffffffu, f);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int rank = __popc(bal & ((1u << lane) - 1u)), off = 0, tot = 0;

    if (lane == 0)
        wsum[warp] = __popc(bal);
    __syncthreads();
    for (int w = 0; w < FI_SEL_THREADS / 32; w++) {
        off += w < warp ? wsum[w] : 0;
        tot += wsum[w];
    }
    __syncthreads();
    *total = tot;
    return off + rank;
}

/*
 * Warp 0 of the select: the bin of the 256-bin histogram hist holding the
 * kleft-th key (1-based, in bin order) into *bin, the count of the bins
 * before it into *before.
 */
static __device__ __forceinline__ void
fi_radix_bin(const int *hist, int kleft, int *bin, int *before_out)
{
    int c[8], sum = 0, incl;

    for (int i = 0; i < 8; i++) {
        c[i] = hist[threadIdx.x * 8 + i];
        sum += c[i];
    }
    incl = sum;
    for (int o = 1; o < 32; o *= 2) {
        int v = __shfl_up_sync(0xffffffffu, incl, o);

        if ((int)threadIdx.x >= o)
            incl += v;
    }
    if (incl - sum < kleft && kleft <= incl) {
        int before = incl - sum;

        for (int i = 0; i < 8; i++) {
            if (kleft <= before + c[i]) {
                *bin = (int)threadIdx.x * 8 + i;
                *before_out = before;
                break;
            }
            before += c[i];
        }
    }
}

/* One CTA per row: sel[t, :] from scores[t, 0..n_valid). kpad: power of two >= K. */
static __global__ void __launch_bounds__(FI_SEL_THREADS)
fi_select_kernel(int32_t *sel, const float *scores, const int32_t *pos, int cap, int ratio,
                 int K, int kpad)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    extern __shared__ unsigned long long fs_keys[];
    __shared__ int hist[256], wsum[FI_SEL_THREADS / 32];
    __shared__ int s_bin, s_before, s_lt;
    int t = blockIdx.x, nv = fi_n_valid(pos, t, ratio, cap);
    const float *sc = scores + (int64_t)t * cap;

    if (fi_select_all(sel, t, nv, K))
        return;
    {   /* nv > K */
        uint32_t prefix = 0, mask = 0;
        int kleft = K, need, eq_base = 0;

        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = threadIdx.x; i < 256; i += FI_SEL_THREADS)
                hist[i] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < nv; i += FI_SEL_THREADS) {
                uint32_t u = fi_ukey(sc[i]);

                if ((u & mask) == prefix)
                    atomicAdd(&hist[(u >> shift) & 255u], 1);
            }
            __syncthreads();
            if (threadIdx.x < 32)
                fi_radix_bin(hist, kleft, &s_bin, &s_before);
            __syncthreads();
            prefix |= (uint32_t)s_bin << shift;
            mask |= 255u << shift;
            kleft -= s_before;
            __syncthreads();   /* s_bin / s_before read before the next pass */
        }
        /* prefix: the K-th best score key; take the K - kleft better ones and
         * the kleft lowest-index ones equal to it */
        need = kleft;
        if (threadIdx.x == 0)
            s_lt = 0;
        __syncthreads();
        for (int b0 = 0; b0 < nv; b0 += FI_SEL_THREADS) {
            int i = b0 + threadIdx.x, tot, rk;
            uint32_t u = i < nv ? fi_ukey(sc[i]) : 0xffffffffu;
            int eq = i < nv && u == prefix;

            if (i < nv && u < prefix)
                fs_keys[atomicAdd(&s_lt, 1)] = (unsigned long long)u << 32 | (uint32_t)i;
            rk = fi_scan(eq, wsum, &tot);
            if (eq && eq_base + rk < need)
                fs_keys[K - need + eq_base + rk] = (unsigned long long)u << 32 | (uint32_t)i;
            eq_base += tot;
        }
    }
    for (int i = K + threadIdx.x; i < kpad; i += FI_SEL_THREADS)
        fs_keys[i] = ~0ull;
    __syncthreads();
    /* bitonic sort, ascending */
    for (int k = 2; k <= kpad; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < kpad; i += FI_SEL_THREADS) {
                int ixj = i ^ j;

                if (ixj > i) {
                    unsigned long long x = fs_keys[i], y = fs_keys[ixj];

                    if ((x > y) == ((i & k) == 0)) {
                        fs_keys[i] = y;
                        fs_keys[ixj] = x;
                    }
                }
            }
            __syncthreads();
        }
    for (int i = threadIdx.x; i < K; i += FI_SEL_THREADS)
        sel[(int64_t)t * K + i] = (int32_t)(fs_keys[i] & 0xffffffffu);
}

/*
 * v2 of fi_select_kernel for K <= FI_SEL_THREADS and rows of at most
 * FI_SEL_THREADS * FI_SEL_REG valid entries: the same selection (the same
 * picks in the same order), with the row's score keys read once into
 * registers (all loads in flight together; the radix passes and the final
 * pass read registers, not memory) and a bitonic sort of FI_SEL_THREADS
 * keys, one per thread, whose steps of distance < 32 are register shuffles
 * (no barrier) and the others one barrier each (two buffers).
 */
static __global__ void __launch_bounds__(FI_SEL_THREADS)
fi_select2_kernel(int32_t *sel, const float *scores, const int32_t *pos, int cap, int ratio,
                  int K)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ unsigned long long fs[2][FI_SEL_THREADS];
    __shared__ int hist[256], wsum[FI_SEL_THREADS / 32];
    __shared__ int s_bin, s_before, s_lt;
    int t = blockIdx.x, nv = fi_n_valid(pos, t, ratio, cap);
    int tid = threadIdx.x, b = 0, N = 32;
    const float *sc = scores + (int64_t)t * cap;
    uint32_t u[FI_SEL_REG];
    unsigned long long x;

    if (fi_select_all(sel, t, nv, K))
        return;
#pragma unroll
    for (int k = 0; k < FI_SEL_REG; k++) {
        int i = tid + FI_SEL_THREADS * k;

        u[k] = i < nv ? fi_ukey(sc[i]) : 0xffffffffu;
    }
    {   /* nv > K */
        uint32_t prefix = 0, mask = 0;
        int kleft = K, need, eq_base = 0;

        fs[0][tid] = ~0ull;
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (tid < 256)
                hist[tid] = 0;
            __syncthreads();
#pragma unroll
            for (int k = 0; k < FI_SEL_REG; k++)
                if (tid + FI_SEL_THREADS * k < nv && (u[k] & mask) == prefix)
                    atomicAdd(&hist[(u[k] >> shift) & 255u], 1);
            __syncthreads();
            if (tid < 32)
                fi_radix_bin(hist, kleft, &s_bin, &s_before);
            __syncthreads();
            prefix |= (uint32_t)s_bin << shift;
            mask |= 255u << shift;
            kleft -= s_before;
            __syncthreads();   /* s_bin / s_before read before the next pass */
        }
        /* as fi_select_kernel: the K - kleft better keys, then the kleft
         * lowest-index ones equal to the K-th */
        need = kleft;
        if (tid == 0)
            s_lt = 0;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < FI_SEL_REG; k++) {
            int i = tid + FI_SEL_THREADS * k, tot, rk, eq;

            if (FI_SEL_THREADS * k >= nv)
                break;   /* uniform */
            eq = i < nv && u[k] == prefix;
            if (i < nv && u[k] < prefix)
                fs[0][atomicAdd(&s_lt, 1)] = (unsigned long long)u[k] << 32 | (uint32_t)i;
            rk = fi_scan(eq, wsum, &tot);
            if (eq && eq_base + rk < need)
                fs[0][K - need + eq_base + rk] = (unsigned long long)u[k] << 32 | (uint32_t)i;
            eq_base += tot;
        }
        __syncthreads();
        x = fs[0][tid];
    }
    /* bitonic sort of the first N keys x, ascending by thread: N the
     * least power of two (at least a warp) that holds the K keys taken,
     * the threads past it holding ~0, already in place (rows of at most K
     * valid entries, a decode step's few dozen, take fi_select_all) */
    while (N < K)
        N <<= 1;
    for (int k = 2; k <= N; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            unsigned long long y;
            int up = (tid & k) == 0, low = tid < (tid ^ j);

            if (j >= 32) {
                /* the last reads of fs[b] were before the previous
                 * shared-memory step's barrier */
                fs[b][tid] = x;
                __syncthreads();
                y = fs[b][tid ^ j];
                b ^= 1;
            } else {
                y = __shfl_xor_sync(0xffffffffu, x, j);
            }
            x = low == up ? (x < y ? x : y) : (x < y ? y : x);
        }
    if (tid < K)
        sel[(int64_t)t * K + tid] = (int32_t)(x & 0xffffffffu);
}

/* --- host side ----------------------------------------------------------------------- */

int
cuda_fast_indexer_ok(const float *q, const float *keys, int nh, int dI, int cap, int K)
{
    return cuda_fast_attn_enabled() && dI == 128 && nh >= 1 && nh <= FI_MAX_HEADS && cap >= 1 &&
           K >= 1 && K <= FI_MAX_K && ((uintptr_t)q & 15u) == 0 &&
           ((uintptr_t)keys & 15u) == 0;
}

template <int R, bool B>
static enum dsv4_err
fi_score_launch(struct dsv4_backend *be, const struct fi_args &a)
{
    static size_t smem_done[CUDA_MAX_DEV];   /* per instantiation and device */
    size_t smem = fi_smem_bytes(R);
    dim3 grid((unsigned)((a.T + R - 1) / R), (unsigned)((a.cap + a.kt * FI_NK - 1) /
                                                        (a.kt * FI_NK)));
    enum dsv4_err e = cuda_smem_allow(be, (const void *)fi_score_kernel<R, B>, smem, smem_done);

    if (e != DSV4_OK)
        return e;
    cu_launch(fi_score_kernel<R, B>, grid, FI_THREADS, smem, cuda_stream(be), a);
    CUDA_LAUNCHED("fast indexer scores");
    return DSV4_OK;
}

/*
 * v3's decode scores (fi_score_cl_kernel) for a; *launched = 0 (and
 * DSV4_OK) when DSV4_CUDA_FI_CLUSTER=0, nh > FI_CS FI_CH, the device cannot
 * hold one cluster (checked once per device), or v3's grid (FI_CS CTAs per
 * row and key tile of the pool, whatever the rows' positions: a graph
 * replays one shape) would not fit the SMs at once: each of v3's CTAs loads
 * its whole key tile, so where v2 already fills the GPU v3 only repeats
 * that work (bench_attn, H200: 16 rows, cap 1,088: 61.6 against 37.6 us;
 * 1 row, cap 320: 12.8 against 16.2).  Then the caller runs v2.
 */
static enum dsv4_err
fi_score_cl_launch(struct dsv4_backend *be, const struct fi_args &a, int *launched)
{
    static signed char fits[FI_MAX_DEV];   /* 0 unknown, 1 yes, -1 no */
    int env_on = cuda_env_switch("DSV4_CUDA_FI_CLUSTER", 1);
    int dev = cuda_st(be)->device, tiles = (a.cap + FI_NK - 1) / FI_NK;

    *launched = 0;
    if (!env_on || a.nh > FI_CS * FI_CH || dev < 0 ||
        dev >= FI_MAX_DEV)
        return DSV4_OK;
    if ((int64_t)a.T * tiles * FI_CS > cuda_sms(be))
        return DSV4_OK;
    CUDA_TRY(cu_launch_cluster(fi_score_cl_kernel, dim3((unsigned)(a.T * FI_CS), (unsigned)tiles),
                               dim3(FI_THREADS), 0, cuda_stream(be), FI_CS, &fits[dev], launched,
                               a));
    if (*launched)
        CUDA_LAUNCHED("fast indexer scores v3");
    return DSV4_OK;
}

enum dsv4_err
cuda_fast_indexer_topk(struct dsv4_backend *be, int32_t *sel, const float *q, const float *w,
                       const float *keys, const int32_t *pages, const int32_t *slot,
                       const int32_t *pos, int T, int nh, int dI, int cap, int ratio, int K)
{
    struct fi_args a;
    enum dsv4_err e;
    const char *var = getenv("DSV4_CUDA_ATTN");
    int kpad = 1, v1 = var != NULL && strcmp(var, "v1") == 0;

    (void)dI;
    memset(&a, 0, sizeof(a));
    a.scores = (float *)cuda_scratch(be, (size_t)T * cap * sizeof(float));
    if (a.scores == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "fast indexer: no scratch (T=%d cap=%d)", T, cap);
    a.q = q;
    a.w = w;
    a.keys = keys;
    a.pages = pages;
    a.slot = slot;
    a.pos = pos;
    a.T = T;
    a.nh = nh;
    a.cap = cap;
    a.ratio = ratio;
    a.K = K;
    a.ref = be->numerics == DSV4_NUMERICS_REF;
    if (T >= 32) {
        a.kt = 4;
        e = fi_score_launch<4, false>(be, a);
    } else {
        int done = 0;

        a.kt = 1;
        e = v1 ? DSV4_OK : fi_score_cl_launch(be, a, &done);
        if (e == DSV4_OK && !done)
            e = v1 ? fi_score_launch<1, false>(be, a) : fi_score_launch<1, true>(be, a);
    }
    if (e != DSV4_OK)
        return e;
    if (!v1 && K <= FI_SEL_THREADS && cap <= FI_SEL_THREADS * FI_SEL_REG) {
        cu_launch(fi_select2_kernel, (unsigned)T, FI_SEL_THREADS, 0, cuda_stream(be), sel, a.scores,
                  pos, cap, ratio, K);
        CUDA_LAUNCHED("fast indexer top-k v2");
        return DSV4_OK;
    }
    while (kpad < K)
        kpad *= 2;
    cu_launch(fi_select_kernel, (unsigned)T, FI_SEL_THREADS, (size_t)kpad * 8, cuda_stream(be), sel,
              a.scores, pos, cap, ratio, K, kpad);
    CUDA_LAUNCHED("fast indexer top-k");
    return DSV4_OK;
}
