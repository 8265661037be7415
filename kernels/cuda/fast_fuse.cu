/*
 * fast_fuse.cu — the CUDA backend's fused ops (kernels/backend.h:
 * hc_post_pre, norm_rope) and the fast norm + RoPE + FP8 sim kernel.
 *
 * With the fast kernels off (or where a fast kernel does not apply) each op
 * runs its definition, the composition of the backend's own ops
 * (dsv4_hc_post_pre_compose, dsv4_norm_rope_compose): the exact kernels,
 * hence the CPU's bits.  With the fast kernels on:
 *   hc_post_pre  fast_hc.cu's two kernels (hc_post fused into the mix, the
 *                next input norm into the finish);
 *   norm_rope    one block per row (fz_norm_threads(D) threads, the fast
 *                rms_norm's tree): the normed row into shared memory, the
 *                RoPE pairs (rope_kernel's expressions, cos/sin of the fp32
 *                angle in double), FP8 sim per block of values on one warp
 *                each (fp8_sim_kernel's expressions; REF only), then the
 *                row written in place and, when asked, to its pool row.
 * DSV4_CUDA_FUSE=0 turns these kernels (and fast_hc.cu's, and the decode
 * compress chains) off.  Both give the bits of the fast ops they replace run one after the other
 * (fast rms_norm, rope, fp8_sim, scatter_rows; hc_post, fast hc_pre, fast
 * rms_norm), so they differ from the exact path only where those do (the
 * order of the norm's and the mix's sums).  One launch instead of two to
 * four; T-independent and deterministic.
 *
 * Versions (cuda_fast_norm_version, fast_fuse.cuh).  v2 issues each
 * thread's loads of the row (its FZ_K elements i, i + B, ... of the tree,
 * the weights, the position and the pool row) before any arithmetic and
 * keeps the row in registers for the normed values; v1 (DSV4_CUDA_NORM=
 * v1) is the first kernel, whose loops issue one load per iteration; v3
 * (calls of up to FZ3_MAX_ROWS rows, else v2) adds helper warps that
 * compute the RoPE angles while the tree loads the row, and does the RoPE,
 * FP8 sim and store with all 256 threads (fz_norm_rope3_kernel);
 * norm_rope2 (the q and the window KV of a layer) runs both calls in one
 * v3 launch (fz_norm_rope3x2_kernel) when they have at most FZ3_MAX_PAIR
 * rows together.  v4 (default) is v3 but for larger calls of several heads
 * without FP8 sim (the per-head q of a prefill or a decode batch): a warp
 * per row, a block of FZ4_WARPS rows of one position sharing its RoPE
 * angles (fz_norm_rope4_kernel).  norm_rope2 whose first call takes v4 and
 * whose second takes v3 (a decode batch's q and window KV) runs both in one
 * launch too (fz_norm_rope43_kernel: v4's blocks, then v3's), ahead of the
 * two-v3 form.
 * Same expressions in the same order: the same bits.
 */
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#include "kernels/cuda_fast.h"
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_fuse.cuh"

#define FZ_MAX_D 1024        /* norm_rope: row length staged in shared memory */
#define FZ_MAX_PAIRS 64      /* norm_rope: RoPE pairs (rd / 2) */

/* The host frequency table, passed by value (recorded into graphs). */
struct fz_freqs {
    float f[FZ_MAX_PAIRS];
};

/* Arguments of fz_norm_rope_kernel. */
struct fz_nr {
    float *x, *dst;
    const uint16_t *xb;   /* v4 (linear_norm_rope): read the rows from these bf16
                             bits instead of x (then written to x), or NULL */
    uint16_t *ob;         /* v4 (linear_norm_rope, q_attn): write the rows as bf16
                             (round to nearest even) here instead of to x, or NULL */
    const uint16_t *w;
    const int32_t *pos, *dst_rows;
    int D, heads, off, np, sim_cols, sim_block;
    float eps;
    struct fz_freqs fr;
};

/* v2: the normed values of the elements fz_row_load gave thread tid of
 * the B tree threads, into y. */
static __device__ __forceinline__ void
fz_row_normed(float *y, const float *v, const uint16_t *wb, float rs, int has_w, int D,
              int tid, int B)
{
#pragma unroll
    for (int k = 0; k < FZ_K; k++) {
        int i = tid + k * B;

        if (i < D)
            y[i] = fz_norm_apply(v[k], rs, has_w, wb[k]);
    }
}

/* RoPE of the pair (off + 2i, off + 2i + 1) of y by (cs, sn) (rope_kernel's
 * expressions, cu_rope_rot). */
static __device__ __forceinline__ void
fz_rope_pair(float *y, int off, int i, float cs, float sn)
{
    cu_rope_rot(y[off + 2 * i], y[off + 2 * i + 1], cs, sn);
}

/* The RoPE angles of row r's position into cs, sn: pairs i0, i0 + step, ...
 * (cu_rope_cs: cos / sin in double of the fp32 angle). */
static __device__ __forceinline__ void
fz_rope_angles(const struct fz_nr &a, int64_t r, int i0, int step, float *cs, float *sn)
{
    float pf = (float)a.pos[r / a.heads];

    for (int i = i0; i < a.np; i += step)
        cu_rope_cs(pf, a.fr.f[i], 0, cs[i], sn[i]);
}

/* FP8 sim of the first sim_cols values of y per sim_block (fp8_sim_kernel's
 * cu_fp8_sim_block): warp `warp` of nw takes blocks warp, warp + nw, ... */
static __device__ __forceinline__ void
fz_fp8_sim(float *y, int sim_cols, int sim_block, int warp, int nw, int lane)
{
    for (int b = warp; b < sim_cols / sim_block; b += nw)
        cu_fp8_sim_block(y + b * sim_block, sim_block, lane);
}

/* Row r of the norm_rope call, one block of fz_norm_threads(D) threads;
 * V2: every load issued first (the row in registers, D <= FZ_K * threads). */
template <int V2>
static __global__ void __launch_bounds__(FZ_NORM_MAX_THREADS)
fz_norm_rope_kernel(struct fz_nr a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ float y[FZ_MAX_D];
    __shared__ float red[FZ_NORM_MAX_THREADS / 32];
    int64_t r = blockIdx.x;
    int nt = blockDim.x, nw = nt / 32, tid = threadIdx.x, lane = tid % 32, D = a.D;
    float *xr = a.x + r * D;
    float acc = 0.0f, rs, pf = 0.0f;
    int64_t drow = 0;

    /* rms_norm (fn_kernel) */
    if (V2) {
        float v[FZ_K];
        uint16_t wb[FZ_K];

        if (a.np > 0)
            pf = (float)a.pos[r / a.heads];
        if (a.dst != NULL)
            drow = a.dst_rows[r];
        fz_row_load(v, wb, xr, a.w, D, tid, nt);
        rs = fz_row_scale(v, red, D, tid, nt, a.eps);
        fz_row_normed(y, v, wb, rs, a.w != NULL, D, tid, nt);
    } else {
        for (int i = tid; i < D; i += nt) {
            float v = cu_bf16_round(xr[i]);

            acc += v * v;
        }
        acc = fz_warp_sum(acc);
        if (lane == 0)
            red[tid / 32] = acc;
        __syncthreads();
        rs = fz_norm_scale(fz_ordered_sum(red, nw), D, a.eps);
        for (int i = tid; i < D; i += nt)
            y[i] = fz_norm_value(xr[i], rs, a.w, i);
    }
    __syncthreads();
    /* RoPE of pairs (off + 2i, off + 2i + 1) at the row's position (rope_kernel) */
    if (a.np > 0) {
        if (!V2)
            pf = (float)a.pos[r / a.heads];

        for (int i = tid; i < a.np; i += nt) {
            float cs, sn;

            cu_rope_cs(pf, a.fr.f[i], 0, cs, sn);
            fz_rope_pair(y, a.off, i, cs, sn);
        }
        __syncthreads();
    }
    /* FP8 sim of the first sim_cols values per sim_block (fp8_sim_kernel) */
    if (a.sim_cols > 0) {
        fz_fp8_sim(y, a.sim_cols, a.sim_block, tid / 32, nw, lane);
        __syncthreads();
    }
    for (int i = tid; i < D; i += nt) {
        xr[i] = y[i];
        if (a.dst != NULL)
            a.dst[(V2 ? drow : (int64_t)a.dst_rows[r]) * D + i] = y[i];
    }
}

/*
 * v3 (decode-sized calls): FZ3_THREADS threads a row.  The first B =
 * fz_norm_threads(D) are v2's norm tree (the same loads, sums and order);
 * meanwhile the others compute the RoPE pairs' cos / sin (v2's expressions)
 * into shared memory, so the double-precision trig overlaps the row's
 * loads instead of following the norm.  The RoPE pairs then take all
 * threads, the FP8 sim one warp per block of values (8 warps instead of
 * v2's 2 for D = 512), the store all threads.  Same bits as v2.
 */
#define FZ3_THREADS 256
#define FZ3_MAX_PAIR 1024   /* norm_rope2: rows of both calls in one v3 launch */
#define FZ3_MAX_ROWS 256    /* larger calls keep v2 (bench_fuse, H200: nr_q at 1,024 rows
                               6.2 us against v2 5.0; at <= 256 rows 3.0-3.3 against 4.3) */

/* Row r of call a, the whole block (v3). */
static __device__ __forceinline__ void
fz_norm_rope3_row(const struct fz_nr &a, int64_t r)
{
    __shared__ float y[FZ_MAX_D];
    __shared__ float red[FZ_NORM_MAX_THREADS / 32];
    __shared__ float cs[FZ_MAX_PAIRS], sn[FZ_MAX_PAIRS];
    int nt = FZ3_THREADS, nw = nt / 32, tid = threadIdx.x, lane = tid % 32, D = a.D;
    int B = fz_norm_threads(D);
    float *xr = a.x + r * D;
    int64_t drow = a.dst != NULL ? a.dst_rows[r] : 0;
    float xv[FZ_K];
    uint16_t wb[FZ_K];

    if (tid < B) {   /* the norm tree: v2's loads and sums */
        fz_row_load(xv, wb, xr, a.w, D, tid, B);
        fz_row_sumsq(xv, red, D, tid, B);
    } else if (a.np > 0) {   /* the RoPE angles of the row's position */
        fz_rope_angles(a, r, tid - B, nt - B, cs, sn);
    }
    __syncthreads();
    if (tid < B)
        fz_row_normed(y, xv, wb, fz_norm_scale(fz_ordered_sum(red, B / 32), D, a.eps),
                      a.w != NULL, D, tid, B);
    __syncthreads();
    for (int i = tid; i < a.np; i += nt)
        fz_rope_pair(y, a.off, i, cs[i], sn[i]);
    if (a.sim_cols > 0) {
        __syncthreads();
        fz_fp8_sim(y, a.sim_cols, a.sim_block, tid / 32, nw, lane);
    }
    __syncthreads();
    for (int i = tid; i < D; i += nt) {
        xr[i] = y[i];
        if (a.dst != NULL)
            a.dst[drow * D + i] = y[i];
    }
}

static __global__ void __launch_bounds__(FZ3_THREADS)
fz_norm_rope3_kernel(struct fz_nr a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    fz_norm_rope3_row(a, blockIdx.x);
}

/* Two calls in one launch (norm_rope2): blocks [0, rows0) are call 0's
 * rows, the rest call 1's. */
struct fz_nr2 {
    struct fz_nr c[2];
    int rows0;
};

static __global__ void __launch_bounds__(FZ3_THREADS)
fz_norm_rope3x2_kernel(struct fz_nr2 a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    if ((int)blockIdx.x < a.rows0)
        fz_norm_rope3_row(a.c[0], blockIdx.x);
    else
        fz_norm_rope3_row(a.c[1], (int64_t)blockIdx.x - a.rows0);
}

/*
 * v4 (the default for calls of more than FZ3_MAX_ROWS rows whose heads are
 * a multiple of FZ4_WARPS, without FP8 sim: the per-head q of a prefill or
 * of a decode batch): a warp per row, the row in registers (element lane +
 * 32 j in v[j]), FZ4_WARPS rows of one position a block; the block's RoPE
 * angles computed once by its first warp (v2's expressions) while the
 * others load their rows.  v2 ran a block of
 * fz_norm_threads(D) threads per row (131,072 blocks for the q of a
 * 2,048-token prefill), each computing its row's angles, with two block
 * barriers.  The norm's tree is v2's: lane l stands for the tree threads l +
 * 32 w (w < B / 32) in turn, each summing its elements in order (j = w, w +
 * B / 32, ...), a tree warp's 32 partials added by the same xor butterfly,
 * the B / 32 warp sums in order; the RoPE pairs meet across adjacent lanes
 * (a shuffle) with rope_kernel's expressions: the same bits as v2
 * (bench_fuse "v4/v2").  Blocks of 32 rows (four a warp) were no faster
 * at 16,384 rows and slower below (docs/perf.md run 42).
 */
#define FZ4_WARPS 8

/* Block `blk` of v4 on call a: rows blk * FZ4_WARPS .. + FZ4_WARPS - 1.
 * XB: the rows come from a.xb (bf16 bits): their values are bf16 already,
 * so the norm's roundings of x to bf16 are left out (the same values: a
 * bf16 value, or a quiet NaN such as the GEMM's conversion writes, rounds
 * to itself), a third of the instructions an element.  OB: a.ob != NULL
 * (the output bf16), the normed values' rounding left to the store's
 * cvt.rn where the RoPE does not read them. */
template <int J, int XB = 0, int OB = 0>
static __device__ __forceinline__ void
fz_norm_rope4_block(const struct fz_nr &a, int64_t blk)
{
    constexpr int D = J * 32, NVW = fz_norm_threads(D) / 32;
    __shared__ float cs[FZ_MAX_PAIRS], sn[FZ_MAX_PAIRS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, has_w = a.w != NULL;
    const int64_t r = blk * FZ4_WARPS + warp;   /* the block's: one position */
    const int re = a.off + 2 * a.np;   /* the RoPE's elements: off .. re - 1 */
    uint16_t wb[J];

    static_assert(fz_norm_threads(D) * FZ_K >= D, "the tree covers the row");
#pragma unroll
    for (int j = 0; j < J; j++)
        wb[j] = has_w ? a.w[lane + 32 * j] : (uint16_t)0;
    float *xr = a.x + r * D;
    int64_t drow = a.dst != NULL ? a.dst_rows[r] : 0;
    float v[J], tot = 0.0f, rs;

    if (XB) {   /* the linear's bf16 output: the values x would hold */
        const uint16_t *br = a.xb + r * D;

#pragma unroll
        for (int j = 0; j < J; j++)
            v[j] = __uint_as_float((uint32_t)br[lane + 32 * j] << 16);
    } else {
#pragma unroll
        for (int j = 0; j < J; j++)
            v[j] = xr[lane + 32 * j];
    }
    /* the angles while the row's loads are in flight (warp 0 computed them
     * before its loads until run 61: the block waited on both in turn) */
    if (warp == 0 && a.np > 0)
        fz_rope_angles(a, r, lane, 32, cs, sn);
#pragma unroll
    for (int w = 0; w < NVW; w++) {   /* tree warp w: threads 32 w + lane */
        float acc = 0.0f;

#pragma unroll
        for (int j = w; j < J; j += NVW) {
            float b = XB ? v[j] : cu_bf16_round(v[j]);

            acc += b * b;
        }
        acc = fz_warp_sum(acc);
        tot = w == 0 ? acc : tot + acc;
    }
    rs = fz_norm_scale(tot, D, a.eps);
    /* OB: the values the RoPE leaves alone are stored by one cvt.rn of
     * the unrounded product (fz_norm_pre: the same bf16); only the RoPE's
     * are rounded first */
#pragma unroll
    for (int j = 0; j < J; j++)
        v[j] = OB ? fz_norm_pre(v[j], rs, has_w, wb[j], XB)
                  : fz_norm_apply(v[j], rs, has_w, wb[j], XB);
    __syncthreads();   /* the angles */
#pragma unroll
    for (int j = 0; j < J; j++) {
        int e = lane + 32 * j;
        float p;

        if (32 * j + 31 < a.off || 32 * j >= re)   /* the same for the whole warp */
            continue;
        if (OB)
            v[j] = cu_bf16_round(v[j]);
        p = __shfl_xor_sync(0xffffffffu, v[j], 1);   /* the pair's other element */
        if (e >= a.off && e < re) {
            int i = (e - a.off) >> 1, odd = (e - a.off) & 1;

            v[j] = odd ? cu_rope_elem(p, v[j], cs[i], sn[i], 1)
                       : cu_rope_elem(v[j], p, cs[i], sn[i], 0);
        }
    }
    if (OB || a.ob != NULL) {   /* bf16 (cvt.rn: fa_pack's rounding in the attention) */
        uint16_t *orow = a.ob + r * D;

#pragma unroll
        for (int j = 0; j < J; j++) {
            uint16_t b;

            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v[j]));
            orow[lane + 32 * j] = b;
        }
    } else {
#pragma unroll
        for (int j = 0; j < J; j++) {
            xr[lane + 32 * j] = v[j];
            if (a.dst != NULL)
                a.dst[drow * D + lane + 32 * j] = v[j];
        }
    }
}

template <int J, int XB, int OB>
static __global__ void __launch_bounds__(FZ4_WARPS * 32)
fz_norm_rope4_kernel(struct fz_nr a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    fz_norm_rope4_block<J, XB, OB>(a, blockIdx.x);
}

/* norm_rope2 with call 0 on v4 (blocks [0, rows0 / FZ4_WARPS)) and call 1
 * on v3 (a block a row after them): a decode batch's per-head q and its
 * window KV in one launch, each with its own kernel's code (the same bits). */
static_assert(FZ4_WARPS * 32 == FZ3_THREADS, "v4 and v3 blocks of one size");

template <int J>
static __global__ void __launch_bounds__(FZ3_THREADS)
fz_norm_rope43_kernel(struct fz_nr2 a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int nb0 = a.rows0 / FZ4_WARPS;

    if ((int)blockIdx.x < nb0)
        fz_norm_rope4_block<J>(a.c[0], blockIdx.x);
    else
        fz_norm_rope3_row(a.c[1], (int64_t)blockIdx.x - nb0);
}

/* Whether v4 takes call a of `rows` rows (fz_nr_make done). */
static int
fz4_takes(const struct fz_nr &a, int rows)
{
    return cuda_fast_norm_version() >= 4 && rows > FZ3_MAX_ROWS && a.heads % FZ4_WARPS == 0 &&
           a.sim_cols <= 0 && a.off % 2 == 0 &&
           (a.D == 128 || a.D == 256 || a.D == 512 || a.D == 1024);
}

/* f(std::integral_constant<int, J>()) for v4's J = D / 32 of the row widths
 * fz4_takes allows (128, 256, 512, else 1024): the v4 kernels' template
 * argument, chosen once for every launch of them. */
template <typename F>
static void
fz4_by_j(int D, F f)
{
    switch (D) {
    case 128:
        f(std::integral_constant<int, 4>());
        break;
    case 256:
        f(std::integral_constant<int, 8>());
        break;
    case 512:
        f(std::integral_constant<int, 16>());
        break;
    default:
        f(std::integral_constant<int, 32>());
        break;
    }
}

/* DSV4_CUDA_NORM_OB=0: v4 with a bf16 output rounds every normed value
 * before the store (the same bits as the default, which leaves that
 * rounding to the store's cvt.rn where the RoPE does not read it). */
static struct cuda_switch fz4_ob_switch = CUDA_SWITCH("DSV4_CUDA_NORM_OB", 1);

/* Launch v4 on call a of `rows` rows (fz4_takes). */
static void
fz4_launch(struct dsv4_backend *be, const struct fz_nr &a, int rows)
{
    unsigned blocks = (unsigned)(rows / FZ4_WARPS);

    fz4_by_j(a.D, [&](auto j) {
        constexpr int J = decltype(j)::value;

        if (a.xb != NULL && a.ob != NULL && cuda_switch_on(&fz4_ob_switch))
            cu_launch(fz_norm_rope4_kernel<J, 1, 1>, blocks, FZ4_WARPS * 32, 0, cuda_stream(be),
                      a);
        else if (a.xb != NULL)
            cu_launch(fz_norm_rope4_kernel<J, 1, 0>, blocks, FZ4_WARPS * 32, 0, cuda_stream(be),
                      a);
        else
            cu_launch(fz_norm_rope4_kernel<J, 0, 0>, blocks, FZ4_WARPS * 32, 0, cuda_stream(be),
                      a);
    });
}

static int fz_small_override = -1;   /* dsv4_cuda_set_small_kernels; -1: environment */

void
dsv4_cuda_set_small_kernels(int version)
{
    fz_small_override = version >= 1 && version <= 4 ? version : -1;
}

/* The version the environment variable `name` asks for ("v1", "v2", "v3"
 * up to vmax; else vdef), or the override; *cache: -1 until read. */
static int
fz_env_version(const char *name, int *cache, int vmax, int vdef)
{
    if (fz_small_override > 0)
        return fz_small_override < vmax ? fz_small_override : vmax;
    if (*cache < 0) {
        const char *e = getenv(name);

        *cache = vdef;
        if (e != NULL && e[0] == 'v' && e[1] >= '1' && e[1] <= '0' + vmax && e[2] == '\0')
            *cache = e[1] - '0';
    }
    return *cache;
}

int
cuda_fast_hc_version(void)
{
    static int env = -1;

    return fz_env_version("DSV4_CUDA_HC", &env, 3, 3);
}

int
cuda_fast_norm_version(void)
{
    static int env = -1;

    return fz_env_version("DSV4_CUDA_NORM", &env, 4, 4);
}

int
cuda_fast_fuse_enabled(void)
{
    static int on = -1;

    if (on < 0) {
        on = cuda_env_switch("DSV4_CUDA_FUSE", 1);   /* 1 / on, 0 / off */
    }
    return on;
}

/* Whether the fast kernel takes this norm_rope call. */
static int
fz_norm_rope_ok(int D, int heads, int off, int rd, int sim_cols, int sim_block)
{
    if (D < 1 || D > FZ_MAX_D || heads < 1 || rd < 0 || rd % 2 != 0 ||
        rd / 2 > FZ_MAX_PAIRS || off < 0 || (rd > 0 && off + rd > D))
        return 0;
    return sim_cols <= 0 || (sim_block > 0 && sim_cols <= D && sim_cols % sim_block == 0);
}

/* Whether norm_rope call c takes the fast kernels; then *a set. */
static int
fz_nr_make(struct dsv4_backend *be, struct fz_nr *a, const struct dsv4_norm_rope *c)
{
    if (!cuda_st(be)->fast_kernels || !cuda_fast_fuse_enabled() || c->heads < 1 ||
        c->rows % c->heads != 0 ||
        !fz_norm_rope_ok(c->D, c->heads, c->off, c->rd, c->sim_cols, c->sim_block))
        return 0;
    memset(a, 0, sizeof(*a));
    a->x = c->x;
    a->dst = c->dst;
    a->w = c->w;
    a->pos = c->pos;
    a->dst_rows = c->dst_rows;
    a->D = c->D;
    a->heads = c->heads;
    a->off = c->off;
    a->np = c->rd / 2;
    /* fp8_sim is a no-op under HF numerics */
    a->sim_cols = be->numerics == DSV4_NUMERICS_REF && c->sim_cols > 0 ? c->sim_cols : 0;
    a->sim_block = c->sim_block;
    a->eps = c->eps;
    for (int i = 0; i < a->np; i++)
        a->fr.f[i] = c->freqs[i];
    return 1;
}

/* Whether the v3 row takes rows of D (v3 on, the tree's threads fewer
 * than the block's). */
static int
fz_v3_shape_ok(int D)
{
    return cuda_fast_norm_version() >= 3 && fz_fits_regs(D) && fz_norm_threads(D) < FZ3_THREADS;
}

enum dsv4_err
cuda_norm_rope(struct dsv4_backend *be, float *x, const uint16_t *w, int rows, int D,
               float eps, const int32_t *pos, int heads, int off, int rd, const float *freqs,
               int sim_cols, int sim_block, float *dst, const int32_t *dst_rows)
{
    const struct dsv4_norm_rope c = {
        .x = x, .w = w, .rows = rows, .D = D, .eps = eps, .pos = pos, .heads = heads,
        .off = off, .rd = rd, .freqs = freqs, .sim_cols = sim_cols, .sim_block = sim_block,
        .dst = dst, .dst_rows = dst_rows, .q_attn = 0,
    };
    struct fz_nr a;

    if (!fz_nr_make(be, &a, &c))
        return dsv4_norm_rope_compose(be, x, w, rows, D, eps, pos, heads, off, rd, freqs,
                                      sim_cols, sim_block, dst, dst_rows);
    if (rows <= 0)
        return DSV4_OK;
    if (fz4_takes(a, rows))   /* v4: large calls of several heads */
        fz4_launch(be, a, rows);
    else if (fz_v3_shape_ok(D) && rows <= FZ3_MAX_ROWS)
        cu_launch(fz_norm_rope3_kernel, rows, FZ3_THREADS, 0, cuda_stream(be), a);
    else if (cuda_fast_norm_version() >= 2 && fz_fits_regs(D))
        cu_launch(fz_norm_rope_kernel<1>, rows, fz_norm_threads(D), 0, cuda_stream(be), a);
    else
        cu_launch(fz_norm_rope_kernel<0>, rows, fz_norm_threads(D), 0, cuda_stream(be), a);
    CUDA_LAUNCHED("fast norm_rope");
    return DSV4_OK;
}

/* DSV4_CUDA_LIN_NORM=0: linear_norm_rope as its composition (the GEMM's
 * output widened to fp32, then the norm; the same bits). */
static struct cuda_switch fz_lin_norm_sw = CUDA_SWITCH("DSV4_CUDA_LIN_NORM", 1);

/* DSV4_CUDA_Q16=0: the per-head q of linear_norm_rope with q_attn written
 * as fp32 all the same (A/B runs; the attention rounds it to the same bf16). */
static struct cuda_switch fz_q16_sw = CUDA_SWITCH("DSV4_CUDA_Q16", 1);

enum dsv4_err
cuda_linear_norm_rope(struct dsv4_backend *be, const float *x, const struct dsv4_linear *W,
                      int T, unsigned flags, const struct dsv4_norm_rope *nr)
{
    struct fz_nr a;
    uint16_t *ob = NULL;
    enum dsv4_err e;

    cuda_st(be)->q16 = NULL;   /* set below where x is left as bf16 */
    if (flags == 0 && T > 0 && (int64_t)nr->rows * nr->D == (int64_t)T * W->n_out &&
        cuda_switch_on(&fz_lin_norm_sw) && fz_nr_make(be, &a, nr) && fz4_takes(a, nr->rows) &&
        nr->dst == NULL) {
        e = cuda_fast_gemm_linear_b16(be, &ob, x, W, T);   /* fast_gemm.cu */
        if (e == DSV4_OK) {
            a.xb = ob;
            /* the q of the attention op after it (q_attn): bf16 in x's
             * first half, for that op only (cuda_q16_take) */
            if (nr->q_attn && cuda_switch_on(&fz_q16_sw)) {
                a.ob = (uint16_t *)nr->x;
                cuda_st(be)->q16 = nr->x;
            }
            fz4_launch(be, a, nr->rows);
            CUDA_LAUNCHED("fast linear + norm_rope");
            return DSV4_OK;
        }
        if (e != DSV4_ERR_NOTSUP)
            return e;
    }
    return dsv4_linear_norm_rope_compose(be, x, W, T, flags, nr);
}

enum dsv4_err
cuda_norm_rope2(struct dsv4_backend *be, const struct dsv4_norm_rope *a,
                const struct dsv4_norm_rope *b)
{
    struct fz_nr2 k;
    int n = a->rows + b->rows;

    if (a->rows <= 0 || b->rows <= 0 || !fz_nr_make(be, &k.c[0], a) ||
        !fz_nr_make(be, &k.c[1], b))
        return dsv4_norm_rope2_compose(be, a, b);
    k.rows0 = a->rows;
    /* one launch: call 0 on v4 where it takes it (a batch's per-head q),
     * call 1 on v3 (run 44: at batch 16 on one GPU this was two launches) */
    if (fz4_takes(k.c[0], a->rows) && fz_v3_shape_ok(b->D) && b->rows <= FZ3_MAX_ROWS) {
        unsigned blocks = (unsigned)(a->rows / FZ4_WARPS + b->rows);

        fz4_by_j(a->D, [&](auto j) {
            cu_launch(fz_norm_rope43_kernel<decltype(j)::value>, blocks, FZ3_THREADS, 0,
                      cuda_stream(be), k);
        });
        CUDA_LAUNCHED("fast norm_rope v4 + v3");
        return DSV4_OK;
    }
    /* or both on v3 (FZ3_MAX_PAIR rows in all) */
    if (n <= FZ3_MAX_PAIR && fz_v3_shape_ok(a->D) && fz_v3_shape_ok(b->D)) {
        cu_launch(fz_norm_rope3x2_kernel, n, FZ3_THREADS, 0, cuda_stream(be), k);
        CUDA_LAUNCHED("fast norm_rope x2");
        return DSV4_OK;
    }
    return dsv4_norm_rope2_compose(be, a, b);
}

enum dsv4_err
cuda_hc_post_pre(struct dsv4_backend *be, float *X_out, float *x_out, float *post_out,
                 float *comb_out, float *xn, const float *f, const float *X, const float *post,
                 const float *comb, const struct dsv4_hc_w *hc, const uint16_t *nw, int T,
                 int n, int D, int iters, float hc_eps, float norm_eps)
{
    TRY_HC_JOIN(be);   /* comb: a Sinkhorn still running beside (cuda.cuh) */
    if (!cuda_st(be)->fast_kernels || !cuda_fast_hc_ok(n, 0) || iters < 1)
        return dsv4_hc_post_pre_compose(be, X_out, x_out, post_out, comb_out, xn, f, X, post,
                                        comb, hc, nw, T, n, D, iters, hc_eps, norm_eps);
    return cuda_fast_hc_post_pre(be, X_out, x_out, post_out, comb_out, xn, f, X, post, comb, hc,
                                 nw, T, n, D, iters, hc_eps, norm_eps);
}
