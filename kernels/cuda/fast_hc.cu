/*
 * fast_hc.cu — the fast hc_pre and hc_head (hyper-connection mixing, model
 * doc §3.2) and the fused hc_post + hc_pre (+ the next input norm) of the
 * hc_post_pre op.  Used by cuda_hc_pre / cuda_hc_head / cuda_hc_post_pre
 * when dsv4_cuda_set_kernels(be, 1) was called and cuda_fast_hc_ok() agrees
 * (M + 1 <= 32 mix values, i.e. n <= 4 for hc_pre; n*n <= 32 for Sinkhorn;
 * DSV4_CUDA_FUSE=0 in the environment: never, the exact kernels run).
 *
 * Two kernels per op, both spread over the whole GPU at T = 1:
 *   1. mix: grid (S, ceil(T / HF_TG)), S = ceil(nD / HF_CW) column chunks
 *      of HF_CW = 128 (a function of nD only).  Block (s, g) stages chunk s
 *      of the M rows of fn (once for its HF_TG tokens) and of X for its
 *      tokens in shared memory; thread i then takes (token, mix row) pairs
 *      and sums its chunk's products in column order (one chain of <= 128),
 *      the last row being the sum of squares; the partials go to
 *      part (T, S, M+1).  In the fused form (hc_post_pre) the block first
 *      computes its chunk of X_out = hc_post(f, X, post, comb) — the exact
 *      kernel's expression, so the same bits — writes it, and uses it as X.
 *   2. finish: grid (T, ceil(D / HF_XCOLS)), or (T, 1) when the input norm
 *      is fused; HF_THREADS + 32 threads.  mix[m] = the S partials of
 *      (t, m), lane l of a warp summing chunks l, l + 32, ... in order, then
 *      an xor butterfly.  r = 1 / sqrtf(sumsq / nD + norm_eps), pre, post
 *      and the Sinkhorn comb by the exact path's expressions (post and
 *      Sinkhorn on the extra warp of the block y == 0, one lane per entry of
 *      the n x n matrix, every row/column sum the exact path's sequential
 *      sum from shared memory), the collapse x_out = bf16(Σ_j pre_j X_j), j
 *      ascending, over the block's columns by the first HF_THREADS threads
 *      (the extra warp works on Sinkhorn meanwhile: the collapse threads
 *      synchronise among themselves with a named barrier).  With the norm
 *      fused, the first fz_norm_threads(D) threads collapse the whole row
 *      and norm it with the fast rms_norm's tree (fast_fuse.cuh), so xn has
 *      the fast rms_norm's bits.
 * Only the order of the mix sums differs from the exact path (which runs 8
 * interleaved chains over nD); given the same mix values the rest is the
 * exact path's expressions.  Every value is a function of its own token's
 * inputs and fixed chunkings: deterministic, independent of T and of the
 * other rows; the fused op gives the bits of hc_post, the fast hc_pre and
 * the fast rms_norm run one after the other.  Scratch: T*S*(M+1) floats,
 * the calls cut into slabs of HF_SLAB tokens.
 *
 * Versions (cuda_fast_hc_version, fast_fuse.cuh).  The kernels above are
 * v1 (DSV4_CUDA_HC=v1).  v2 (default where hf2_ok holds: n <= 4, D % 4 ==
 * 0, 16-byte aligned rows, S <= 256, D <= 4096 with the norm) computes the
 * same values by the same expressions in the same order, but is built for
 * latency (each of v1's loops issued one global load per iteration):
 *   hf2_mix: 256 threads; every thread first issues its 16-byte loads of
 *      the fn chunk and of X (or of hc_post's inputs: X rows, f, post,
 *      comb) into registers, then stores them to shared memory (rows padded
 *      to HF_CW + 4 floats: 16-byte aligned, no bank conflicts for the
 *      float4 reads of the dot products); the partials go to
 *      part (T, M+1, S) (contiguous in s for the finish's gather); in
 *      calls of at least HF2_PAIR_T tokens (16 since run 63, 64 before)
 *      each whole block of HF_TG tokens has each thread run two (token,
 *      row) chains of one token side by side (the same chains, so the same
 *      bits; the token's X words read once for both); since run 49 calls
 *      of at least HF2_BLOCKED_T (64) tokens take hf2_mixb_kernel instead
 *      (blocks of 64 tokens, 4-token x
 *      2-row register tiles: the same chains; DSV4_CUDA_HC_MIXB=0 keeps
 *      the blocked form);
 *   hf2_finish: with the norm, 512 collapse threads + one warp per token
 *      (4 columns per thread and 16-byte loads); without, 128 + 32 threads
 *      per 512 columns.  Every thread first issues its loads of X, of the
 *      norm weights, of the hc scale/base values it needs and of its warp's
 *      partials (all of them, then the sums in v1's order); Sinkhorn keeps
 *      the n x n matrix in registers, one entry per lane, and reads rows
 *      and columns with __shfl_sync in index order (v1's sequential sums,
 *      no shared memory or __syncwarp); the collapsed row goes to shared
 *      memory for the norm's tree (the first fz_norm_threads(D) threads,
 *      elements i, i + B, ... in order as fn_kernel) and the normed values
 *      are made from the registers.  Slabs of HF2_SH_T tokens or more (a
 *      prefill's) instead copy the token's X and all its partials into
 *      shared memory (cp.async, the same sums from there): 48 registers
 *      instead of 96, so two blocks an SM overlap one token's loads with
 *      the other's barriers and norm (run 61: 47 -> 40 us a slab of 1,024;
 *      DSV4_CUDA_HC_FINSH=0 keeps the registers).
 * v3 (the default since bench_fuse on the H200, 2026-11-30: hc_post_pre
 * at T = 1 8.5 us against v2's 9.1 and v1's 21.7, same bits; DSV4_CUDA_HC=v2
 * for v2) is v2 with the finish launched as a
 * programmatic dependent launch (PDL): hf2_mix lets its dependents start
 * as soon as every mix block runs, the finish blocks issue the loads that
 * do not depend on the mix (hc weights, norm weights, and X for hc_pre /
 * hc_head) and then wait (griddepcontrol.wait: the mix grid complete and
 * its writes visible) before reading the partials (and X_out in the fused
 * form).  Every thread of the finish waits, so the kernels after it see
 * the mix's writes as well.  Same bits as v2.
 * Sinkhorn beside (v2 and v3, since run 38; DSV4_CUDA_HC_DEFER=0: in the
 * finish as before): the finish's extra warp writes the Sinkhorn's input
 * into comb, and hf2_sinkhorn_kernel (a warp per token, the same
 * hf2_sinkhorn) finishes it on the backend's hc stream (cuda_hc_fork,
 * cuda.cuh), which the next op touching comb joins: its 20 dependent
 * iterations were the finish's longest part, and comb is only read at the
 * sub-layer's end.
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_fuse.cuh"
#include "kernels/cuda/fast_wgmma.cuh"

#define HF_THREADS 256       /* finish: collapse threads (+ one warp) */
#define HF_MT 128            /* mix block */
#define HF_CW 128            /* columns of X per mix chunk */
#define HF_TG 16             /* tokens per mix block */
#define HF_XCOLS 512         /* collapse columns per finish block (no norm) */
#define HF_MAX_M1 32         /* mix values per token (M + 1) */
#define HF_SLAB 1024         /* tokens per launch pair (bounds the scratch) */
#define HF2_MT 256           /* v2 mix block (8 warps: hf2_mix_kernel's blocked form needs them) */
#define HF2_BLOCKED_T 64     /* v2 mix: calls of at least this many tokens take hf2_mixb_kernel */
#define HF2_PAIR_T 16        /* v2 mix: whole blocks of HF_TG tokens of calls of at least this
                                many tokens take the blocked form (two chains a thread;
                                DSV4_CUDA_HC_PAIR=0: HF2_BLOCKED_T, as before run 63) */
#define HF2_CWP (HF_CW + 4)  /* v2 mix: shared row stride (16-byte rows, no conflicts) */
#define HF2_N 4              /* v2: streams n at most */
#define HF2_NT 512           /* v2 finish with the norm: collapse threads (+ one warp) */
#define HF2_NU 2             /* ... float4 columns per thread at most (D <= 4096) */
#define HF2_XT 128           /* v2 finish without the norm: collapse threads (+ one warp), */
                             /* one float4 column each (512 columns per block) */
#define HF2_SH_T 1024        /* v2 finish with the norm: slabs of at least this many tokens
                                stage X and the partials in shared memory (two blocks an SM;
                                bench_fuse: slower at 64-300 tokens, faster at 1,024) */
#define HF2_SH_MAX (96 * 1024) /* ... if they fit this many bytes */
#define HF2_SQ 8             /* v2 finish: partials per lane and mix row (S <= 256) */
#define HF_DEFER_SLABS 64    /* slabs of a call whose Sinkhorn can be deferred */
#define HF2B_TG 64           /* v2 mix, long calls (hf2_mixb_kernel): tokens per block */
#define HF2B_MR 24           /* ... mix rows at most ((2 + n) n for n <= 4) */
#define HF2B_TILE 192        /* ... threads on 4-token x 2-row tiles (16 x HF2B_MR / 2) */

/* The number of mix rows M of the hc_pre (head == 0) or hc_head form. */
static __host__ __device__ int
hf_rows(int n, int head)
{
    return head ? n : (2 + n) * n;
}

int
cuda_fast_hc_ok(int n, int head)
{
    return n >= 1 && hf_rows(n, head) + 1 <= HF_MAX_M1 && n * n <= 32 &&
           cuda_fast_fuse_enabled();
}

/* hc_post's inputs for the fused mix (X_out written, then used as X). */
struct hf_post {
    float *X_out;
    const float *f, *X, *post, *comb;
};

/*
 * part[t, s, m] for m < M: Σ over chunk s of X[t, c] fn[m, c] in column
 * order; m = M: of X[t, c]^2.  POST: X[t] is first made as hc_post (p).
 */
template <int POST>
static __global__ void __launch_bounds__(HF_MT)
hf_mix_kernel(float *part, const float *X, const float *fn, int T, int M, int n, int D,
              struct hf_post p)
{
    __shared__ float fs[HF_MAX_M1 - 1][HF_CW + 1];   /* +1: no bank conflicts */
    __shared__ float xs[HF_TG][HF_CW + 1];
    int s = blockIdx.x, S = gridDim.x, tid = threadIdx.x;
    int nD = n * D, c0 = s * HF_CW, cw = min(HF_CW, nD - c0);
    int t0 = blockIdx.y * HF_TG, tg = min(HF_TG, T - t0);

    for (int i = tid; i < M * HF_CW; i += HF_MT) {
        int m = i / HF_CW, c = i % HF_CW;

        fs[m][c] = c < cw ? __ldg(fn + (int64_t)m * nD + c0 + c) : 0.0f;
    }
    for (int i = tid; i < tg * HF_CW; i += HF_MT) {
        int tt = i / HF_CW, c = i % HF_CW, col = c0 + c;
        int64_t t = t0 + tt;
        float v = 0.0f;

        if (c < cw && POST) {
            /* hc_post_kernel's expression (cuda_hc.cu) */
            int k = col / D, d = col % D;
            const float *Xt = p.X + t * nD, *C = p.comb + t * n * n;
            float acc = C[k] * Xt[d];

            for (int j = 1; j < n; j++)
                acc += C[j * n + k] * Xt[(int64_t)j * D + d];
            v = cu_bf16_round(p.post[t * n + k] * p.f[t * D + d] + acc);
            p.X_out[t * nD + col] = v;
        } else if (c < cw) {
            v = X[t * nD + col];
        }
        xs[tt][c] = v;
    }
    __syncthreads();
    for (int i = tid; i < tg * (M + 1); i += HF_MT) {
        int tt = i / (M + 1), m = i % (M + 1);
        const float *a = xs[tt], *b = m < M ? fs[m] : xs[tt];
        float acc = 0.0f;

#pragma unroll 8
        for (int c = 0; c < cw; c++)
            acc += a[c] * b[c];
        part[((int64_t)(t0 + tt) * S + s) * (M + 1) + m] = acc;
    }
}

static __device__ __forceinline__ float
hf_sigmoidf(float x)
{
    return 1.0f / (1.0f + cu_expf(-x));
}

/* c / (Σ_i C[first + i*step] + eps) for i < n in order, after C[l] = c on
 * the lanes that hold an entry (act); every lane of the warp calls it. */
static __device__ __forceinline__ float
hf_div_sum(float c, float *C, int act, int l, int first, int step, int n, float eps)
{
    float sum = 0.0f;

    if (act)
        C[l] = c;
    __syncwarp();
    if (act) {
        for (int i = 0; i < n; i++)
            sum += C[first + i * step];
        c /= sum + eps;
    }
    __syncwarp();
    return c;
}

/*
 * The exact path's Sinkhorn (cuda_hc.cu, cpu_hc.c) on one warp: lane l <
 * n*n holds entry (j, k) = (l / n, l % n) in c and returns its final value;
 * C is the warp's n*n shared array.  Every lane of the warp must call it.
 */
static __device__ float
hf_sinkhorn(float c, float *C, int n, int iters, float eps, int l)
{
    int act = l < n * n, j = l / n, k = l % n;
    float mx = 0.0f, sum = 0.0f;

    /* softmax of row j, then + eps */
    if (act)
        C[l] = c;
    __syncwarp();
    if (act) {
        mx = C[j * n];
        for (int kk = 1; kk < n; kk++)
            mx = C[j * n + kk] > mx ? C[j * n + kk] : mx;
        c = cu_expf(c - mx);
    }
    __syncwarp();
    if (act)
        C[l] = c;
    __syncwarp();
    if (act) {
        for (int kk = 0; kk < n; kk++)
            sum += C[j * n + kk];
        c = c / sum + eps;
    }
    __syncwarp();
    for (int it = 0; it < iters; it++) {
        if (it > 0)
            c = hf_div_sum(c, C, act, l, j * n, 1, n, eps);   /* row j */
        c = hf_div_sum(c, C, act, l, k, n, n, eps);           /* column k */
    }
    return c;
}

/* Barrier of the first `count` threads of the block (a multiple of 32),
 * without the others (the extra warp runs Sinkhorn meanwhile). */
static __device__ __forceinline__ void
hf_bar(int count)
{
    asm volatile("barrier.sync 1, %0;" : : "r"(count) : "memory");
}

/* Arguments of the finish kernel. */
struct hf_fin {
    float *x_out, *post, *comb;   /* outputs (post, comb: hc_pre form only) */
    float *xn;                    /* fused norm output, or NULL */
    const uint16_t *nw;           /* its weight (may be NULL) */
    const float *part, *X;
    struct dsv4_hc_w hc;
    int n, D, S, iters, head;
    int x_dep;                    /* X is written by the mix kernel (fused form) */
    int defer;                    /* v2 / v3: comb gets Sinkhorn's input; hf2_sinkhorn_kernel
                                     (beside the main stream, cuda_hc_fork) finishes it */
    float hc_eps, norm_eps;
};

/* Block (t, y): mix, pre (and on y == 0 post, comb), the collapse of its
 * columns; NORM: of the whole row, then xn = rms_norm(x_out). */
template <int NORM>
static __global__ void __launch_bounds__(HF_THREADS + 32)
hf_finish_kernel(struct hf_fin a)
{
    __shared__ float mix[HF_MAX_M1], pre[HF_MAX_M1], C[32], red[HF_THREADS / 32];
    int64_t t = blockIdx.x;
    int n = a.n, D = a.D, M = hf_rows(n, a.head), nD = n * D;
    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    int all = blockIdx.y == 0 && !a.head;       /* this block writes post and comb */
    int B = NORM ? fz_norm_threads(D) : HF_THREADS;   /* collapse threads */
    int i0 = NORM ? 0 : blockIdx.y * HF_XCOLS, i1 = NORM ? D : min(D, i0 + HF_XCOLS);
    const float *Xt = a.X + t * nD;
    float r;

    /* the mix values this block needs: pre's and the sum of squares (all:
     * every one) */
    for (int m = warp; m <= M; m += HF_THREADS / 32 + 1) {
        const float *p = a.part + t * a.S * (M + 1) + m;
        float v = 0.0f;

        if (!all && m >= n && m < M)
            continue;   /* warp-uniform */
        for (int s = lane; s < a.S; s += 32)
            v += p[(int64_t)s * (M + 1)];
        v = fz_warp_sum(v);
        if (lane == 0)
            mix[m] = v;
    }
    __syncthreads();
    r = 1.0f / sqrtf(mix[M] / (float)nD + a.norm_eps);
    if (tid >= HF_THREADS) {   /* the extra warp: post, then Sinkhorn */
        int l = tid - HF_THREADS, e = l < n * n ? l : 0;
        float c;

        if (!all)
            return;
        if (l < n)
            a.post[t * n + l] =
                2.0f * hf_sigmoidf((mix[n + l] * r) * a.hc.scale[1] + a.hc.base[n + l]);
        c = (mix[2 * n + e] * r) * a.hc.scale[2] + a.hc.base[2 * n + e];
        c = hf_sinkhorn(c, C, n, a.iters, a.hc_eps, l);
        if (l < n * n)
            a.comb[t * n * n + l] = c;
        return;
    }
    if (tid < n)
        pre[tid] = hf_sigmoidf((mix[tid] * r) * a.hc.scale[0] + a.hc.base[tid]) + a.hc_eps;
    if (tid >= B)
        return;
    hf_bar(B);
    {
        float acc2 = 0.0f, rs;

        for (int i = i0 + tid; i < i1; i += B) {
            float acc = pre[0] * Xt[i], v;

            for (int j = 1; j < n; j++)
                acc += pre[j] * Xt[(int64_t)j * D + i];
            v = cu_bf16_round(acc);
            a.x_out[t * D + i] = v;
            acc2 += v * v;   /* fn_kernel's term: v is already bf16 */
        }
        if (!NORM)
            return;
        acc2 = fz_warp_sum(acc2);
        if (lane == 0)
            red[warp] = acc2;
        hf_bar(B);
        rs = fz_norm_scale(fz_ordered_sum(red, B / 32), D, a.norm_eps);
        for (int i = tid; i < D; i += B)   /* x_out: this thread's own writes */
            a.xn[t * D + i] = fz_norm_value(a.x_out[t * D + i], rs, a.nw, i);
    }
}

/* --- v2 ------------------------------------------------------------------------- */

/*
 * hf_mix_kernel with every load issued first; part (T, M+1, S).  Needs
 * D % 4 == 0 and 16-byte aligned fn, X (POST: p.X, p.f, p.X_out).
 */
/* The sum of a[c] . b[c] over c < n4 (float4s), one chain in column order:
 * hf2_mix's partial of one (token, mix row) over its chunk. */
static __device__ __forceinline__ float
hf2_dot(const float4 *a, const float4 *b, int n4)
{
    float acc = 0.0f;

#pragma unroll 8
    for (int c = 0; c < n4; c++) {
        float4 x = a[c], y = b[c];

        acc += x.x * y.x;
        acc += x.y * y.y;
        acc += x.z * y.z;
        acc += x.w * y.w;
    }
    return acc;
}

/* hf2_post_load with the column given as stream k and offset d in it. */
static __device__ __forceinline__ void
hf2_post_load_kd(const struct hf_post &p, int64_t t, int k, int d, int n, int D, int nD,
                 float4 (&xv)[HF2_N], float (&cc)[HF2_N], float4 &f4, float &pk)
{
#pragma unroll
    for (int j = 0; j < HF2_N; j++) {
        if (j < n) {
            xv[j] = *(const float4 *)(p.X + t * nD + (int64_t)j * D + d);
            cc[j] = p.comb[t * n * n + j * n + k];
        }
    }
    f4 = *(const float4 *)(p.f + t * D + d);
    pk = p.post[t * n + k];
}

/* hc_post's inputs for the 4 columns col .. col + 3 of X_out (row length
 * nD = n D; one stream k = col / D) of token t: the n streams' X words at
 * those columns, comb's column k, f and post[k].  xv, cc past n untouched. */
static __device__ __forceinline__ void
hf2_post_load(const struct hf_post &p, int64_t t, int col, int n, int D, int nD,
              float4 (&xv)[HF2_N], float (&cc)[HF2_N], float4 &f4, float &pk)
{
    hf2_post_load_kd(p, t, col / D, col % D, n, D, nD, xv, cc, f4, pk);
}

/* X_out's 4 values from hf2_post_load's inputs: hc_post_kernel's expression
 * (cuda_hc.cu), per component. */
static __device__ __forceinline__ float4
hf2_post_value(const float4 (&xv)[HF2_N], const float (&cc)[HF2_N], float4 f4, float pk, int n)
{
    float o[4];

#pragma unroll
    for (int e = 0; e < 4; e++) {
        float acc = cc[0] * fz_f4(xv[0], e);

#pragma unroll
        for (int j = 1; j < HF2_N; j++)
            if (j < n)
                acc += cc[j] * fz_f4(xv[j], e);
        o[e] = cu_bf16_round(pk * fz_f4(f4, e) + acc);
    }
    return make_float4(o[0], o[1], o[2], o[3]);
}

/* hf2_mix_kernel's fn chunk: fv[u] = the float4 of mix row m = i / (HF_CW
 * / 4) at column c0 + c of thread tid's i = tid + u * HF2_MT (zero past M
 * or cw). */
template <int FQ>
static __device__ __forceinline__ void
hf2_fn_load(float4 (&fv)[FQ], const float *fn, int M, int nD, int c0, int cw, int tid)
{
#pragma unroll
    for (int u = 0; u < FQ; u++) {
        int i = tid + u * HF2_MT, m = i / (HF_CW / 4), c = i % (HF_CW / 4) * 4;
        /* fk_ld_wv: a volatile load, kept before the PDL wait */
        uint4 w = m < M && c < cw ? fk_ld_wv(fn + (int64_t)m * nD + c0 + c)
                                  : make_uint4(0u, 0u, 0u, 0u);

        fv[u] = make_float4(__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z),
                            __uint_as_float(w.w));
    }
}

template <int POST>
static __global__ void __launch_bounds__(HF2_MT)
hf2_mix_kernel(float *part, const float *X, const float *fn, int T, int M, int n, int D,
               struct hf_post p, int pair_t, int early)
{
    enum {
        FQ = ((HF_MAX_M1 - 1) * (HF_CW / 4) + HF2_MT - 1) / HF2_MT,   /* fn float4 per thread */
        XQ = (HF_TG * (HF_CW / 4) + HF2_MT - 1) / HF2_MT              /* X float4 per thread */
    };
    __shared__ __align__(16) float fs[HF_MAX_M1 - 1][HF2_CWP];
    __shared__ __align__(16) float xs[HF_TG][HF2_CWP];
    int s = blockIdx.x, S = gridDim.x, tid = threadIdx.x;
    int nD = n * D, c0 = s * HF_CW, cw = min(HF_CW, nD - c0);
    int t0 = blockIdx.y * HF_TG, tg = min(HF_TG, T - t0);
    float4 fv[FQ], xv[XQ][HF2_N], f4[XQ];
    float pk[XQ], cc[XQ][HF2_N];
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    /* every load first: the fn chunk (the layer's weights, written only at
     * load time: asked for before the PDL wait, so they arrive while the
     * kernel before ends; DSV4_CUDA_HC_EARLY=0 after it), ... */
    if (early)
        hf2_fn_load<FQ>(fv, fn, M, nD, c0, cw, tid);
    /* launched by cu_launch: the previous kernel complete before any other
     * load; the wait stays before the trigger: the v3 finish loads X before
     * its own wait when X is not ours (x_dep 0), so every kernel before
     * this one must be complete when the finish starts */
    cu_pdl_wait();
    /* v3: the finish (launched with PDL) may start once every block is here */
    cu_pdl_trigger();
    if (!early)
        hf2_fn_load<FQ>(fv, fn, M, nD, c0, cw, tid);
    /* ... and X's chunk of the block's tokens (POST: hc_post's inputs) */
#pragma unroll
    for (int u = 0; u < XQ; u++) {
        int i = tid + u * HF2_MT, tt = i / (HF_CW / 4), c = i % (HF_CW / 4) * 4, col = c0 + c;
        int ok = tt < tg && c < cw;
        int64_t t = t0 + tt;

        pk[u] = 0.0f;
        f4[u] = zero;
#pragma unroll
        for (int j = 0; j < HF2_N; j++) {
            xv[u][j] = zero;
            cc[u][j] = 0.0f;
        }
        if (!POST && ok) {
            xv[u][0] = *(const float4 *)(X + t * nD + col);
        } else if (POST && ok) {
            hf2_post_load(p, t, col, n, D, nD, xv[u], cc[u], f4[u], pk[u]);
        }
    }
#pragma unroll
    for (int u = 0; u < FQ; u++) {
        int i = tid + u * HF2_MT, m = i / (HF_CW / 4), c = i % (HF_CW / 4) * 4;

        if (m < M)
            *(float4 *)&fs[m][c] = fv[u];
    }
#pragma unroll
    for (int u = 0; u < XQ; u++) {
        int i = tid + u * HF2_MT, tt = i / (HF_CW / 4), c = i % (HF_CW / 4) * 4;
        float4 v = xv[u][0];

        if (tt >= tg)
            continue;
        if (POST && c < cw) {
            v = hf2_post_value(xv[u], cc[u], f4[u], pk[u], n);
            *(float4 *)(p.X_out + (int64_t)(t0 + tt) * nD + c0 + c) = v;
        }
        *(float4 *)&xs[tt][c] = v;
    }
    __syncthreads();
    if (T >= pair_t && tg == HF_TG) {
        /* whole blocks of a long call: lane l of warp w takes token l % 16
         * and mix rows g, g + 16 (g = 2w + l / 16; row M is the sum of
         * squares), both chains in one loop: a token's X words are read
         * once for two rows and a row's fn words are the same for the 16
         * lanes that read them, so a product costs ~0.4 of the shared-memory
         * wavefronts of one (token, row) a thread, on which the long calls
         * were bound (perf.md run 41: L1 95% busy).  The same chains in the
         * same order: the same bits. */
        int l = tid & 31, tt = l & 15, g = 2 * (tid >> 5) + (l >> 4), m1 = g + 16;
        const float4 *a = (const float4 *)xs[tt];
        const float4 *b0 = (const float4 *)(g < M ? fs[g] : xs[tt]);
        const float4 *b1 = (const float4 *)(m1 < M ? fs[m1] : m1 == M ? xs[tt] : fs[0]);
        float acc0 = 0.0f, acc1 = 0.0f;
        int two = __any_sync(0xffffffffu, m1 <= M);   /* a second row in the warp */

        if (g > M)
            return;   /* no row here (M + 1 <= 16 + 16 rows) */
        if (two) {
#pragma unroll 4
            for (int c = 0; c < cw / 4; c++) {
                float4 x = a[c], y = b0[c], z = b1[c];

                acc0 += x.x * y.x;
                acc1 += x.x * z.x;
                acc0 += x.y * y.y;
                acc1 += x.y * z.y;
                acc0 += x.z * y.z;
                acc1 += x.z * z.z;
                acc0 += x.w * y.w;
                acc1 += x.w * z.w;
            }
        } else {
            acc0 = hf2_dot(a, b0, cw / 4);
        }
        part[((int64_t)(t0 + tt) * (M + 1) + g) * S + s] = acc0;
        if (m1 <= M)
            part[((int64_t)(t0 + tt) * (M + 1) + m1) * S + s] = acc1;
        return;
    }
    for (int i = tid; i < tg * (M + 1); i += HF2_MT) {
        int tt = i / (M + 1), m = i % (M + 1);
        const float4 *a = (const float4 *)xs[tt], *b = (const float4 *)(m < M ? fs[m] : xs[tt]);

        part[((int64_t)(t0 + tt) * (M + 1) + m) * S + s] = hf2_dot(a, b, cw / 4);
    }
}

/*
 * hf2_mix_kernel for calls of at least HF2_BLOCKED_T tokens (perf.md run
 * 49): blocks of HF2B_TG = 64 tokens instead of 16, so a block's fn chunk
 * (M rows of 128 columns, from L2) serves four times the tokens, and
 * register tiles instead of one or two chains a thread.  hf2_mix's
 * blocked form had every product cost a shared-memory load of its X word
 * (the fn word shared by 16 lanes) and ran at ≈ 4 times the slab's DRAM
 * time, its issue slots filled by loads (Nsight Compute, run 43: 80 M
 * instructions a 1,024-token slab for 26 M products).  Here thread i <
 * HF2B_TILE holds 8 chains: tokens q, q + 16, q + 32, q + 48 (q = i % 16:
 * the 16 lanes of a load read 16 consecutive token rows, two wavefronts)
 * times mix rows 2r, 2r + 1 (r = i / 16; rows past M are zero rows of fs,
 * not written): per float4 of columns 6 loads for 32 products.  The other
 * 64 threads sum each token's squares (row M).  Every chain is hf2_dot's
 * (products in column order over the chunk, one fp32 add each): the same
 * partials, the same bits.  M <= HF2B_MR.
 */
template <int POST>
static __global__ void __launch_bounds__(HF2_MT)
hf2_mixb_kernel(float *part, const float *X, const float *fn, int T, int M, int n, int D,
                struct hf_post p)
{
    __shared__ __align__(16) float fs[HF2B_MR][HF2_CWP];
    __shared__ __align__(16) float xs[HF2B_TG][HF2_CWP];
    int s = blockIdx.x, S = gridDim.x, tid = threadIdx.x;
    int nD = n * D, c0 = s * HF_CW, cw = min(HF_CW, nD - c0);
    int t0 = blockIdx.y * HF2B_TG, tg = min(HF2B_TG, T - t0);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    static_assert(HF2B_TILE + HF2B_TG == HF2_MT && HF2B_TILE == 16 * (HF2B_MR / 2),
                  "hf2_mixb: thread roles");
    /* as hf2_mix_kernel: the previous kernel complete before any load,
     * then the finish (PDL) may start */
    cu_pdl_wait();
    cu_pdl_trigger();
    {
        /* the fn chunk (rows M .. HF2B_MR - 1 zero) */
        enum { FQ = HF2B_MR * (HF_CW / 4) / HF2_MT };
        float4 fv[FQ];

#pragma unroll
        for (int u = 0; u < FQ; u++) {
            int i = tid + u * HF2_MT, m = i / (HF_CW / 4), c = i % (HF_CW / 4) * 4;

            fv[u] = m < M && c < cw ? __ldg((const float4 *)(fn + (int64_t)m * nD + c0 + c))
                                    : zero;
        }
#pragma unroll
        for (int u = 0; u < FQ; u++) {
            int i = tid + u * HF2_MT, m = i / (HF_CW / 4), c = i % (HF_CW / 4) * 4;

            *(float4 *)&fs[m][c] = fv[u];
        }
    }
    /* X's chunk of the block's tokens (POST: made by hc_post and written);
     * a thread keeps its column in every pass, so its stream and offset
     * are worked out once (the division was in every pass until run 61) */
    static_assert(HF2_MT % (HF_CW / 4) == 0, "hf2_mixb: a thread's column is fixed");
    const int c = tid % (HF_CW / 4) * 4, col = c0 + c, ks = col / D, ds = col % D;
#pragma unroll 2
    for (int u = 0; u < HF2B_TG * (HF_CW / 4) / HF2_MT; u++) {
        int tt = tid / (HF_CW / 4) + u * (HF2_MT / (HF_CW / 4));
        int64_t t = t0 + tt;
        float4 v = zero;

        if (tt < tg && c < cw) {
            if (!POST) {
                v = *(const float4 *)(X + t * nD + col);
            } else {
                /* hc_post's inputs, then its expression, as hf2_mix_kernel */
                float4 xv[HF2_N], f4;
                float cc[HF2_N], pk;

#pragma unroll
                for (int j = 0; j < HF2_N; j++) {
                    xv[j] = zero;
                    cc[j] = 0.0f;
                }
                hf2_post_load_kd(p, t, ks, ds, n, D, nD, xv, cc, f4, pk);
                v = hf2_post_value(xv, cc, f4, pk, n);
                *(float4 *)(p.X_out + t * nD + col) = v;
            }
        }
        *(float4 *)&xs[tt][c] = v;
    }
    __syncthreads();
    if (tid < HF2B_TILE) {
        int q = tid & 15, m0 = 2 * (tid >> 4), m1 = m0 + 1;
        const float4 *b0 = (const float4 *)fs[m0], *b1 = (const float4 *)fs[m1];
        float acc[4][2] = {};

        if (m0 >= M)
            return;
#pragma unroll 2
        for (int c = 0; c < cw / 4; c++) {
            float4 y0 = b0[c], y1 = b1[c];

#pragma unroll
            for (int j = 0; j < 4; j++) {
                float4 x = ((const float4 *)xs[q + 16 * j])[c];

                acc[j][0] += x.x * y0.x;
                acc[j][1] += x.x * y1.x;
                acc[j][0] += x.y * y0.y;
                acc[j][1] += x.y * y1.y;
                acc[j][0] += x.z * y0.z;
                acc[j][1] += x.z * y1.z;
                acc[j][0] += x.w * y0.w;
                acc[j][1] += x.w * y1.w;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int tt = q + 16 * j;

            if (tt >= tg)
                continue;
            part[((int64_t)(t0 + tt) * (M + 1) + m0) * S + s] = acc[j][0];
            if (m1 < M)
                part[((int64_t)(t0 + tt) * (M + 1) + m1) * S + s] = acc[j][1];
        }
    } else {
        int tt = tid - HF2B_TILE;   /* the sum of squares of token tt */
        const float4 *a = (const float4 *)xs[tt];
        float acc = hf2_dot(a, a, cw / 4);

        if (tt < tg)
            part[((int64_t)(t0 + tt) * (M + 1) + M) * S + s] = acc;
    }
}

/* c / (Σ_i c of lane first + i*step, i < n in order + eps): hf_div_sum with
 * the matrix in the warp's registers. */
static __device__ __forceinline__ float
hf2_div_sum(float c, int first, int step, int n, float eps)
{
    float sum = 0.0f;

#pragma unroll
    for (int i = 0; i < HF2_N; i++) {
        float o = __shfl_sync(0xffffffffu, c, first + i * step);

        if (i < n)
            sum += o;
    }
    return c / (sum + eps);
}

/*
 * hf_sinkhorn (the exact path's Sinkhorn) with entry (j, k) = (l / n, l % n)
 * in lane l's register c and no shared memory; lanes l >= n*n compute a
 * copy of entry 0 (their results are not used).  n <= HF2_N; every lane of
 * the warp calls it.
 */
static __device__ float
hf2_sinkhorn(float c, int n, int iters, float eps, int l)
{
    int e = l < n * n ? l : 0, j = e / n, k = e % n;
    float mx = __shfl_sync(0xffffffffu, c, j * n), sum = 0.0f;

    /* softmax of row j, then + eps */
#pragma unroll
    for (int kk = 1; kk < HF2_N; kk++) {
        float o = __shfl_sync(0xffffffffu, c, j * n + (kk < n ? kk : 0));

        if (kk < n)
            mx = o > mx ? o : mx;
    }
    c = cu_expf(c - mx);
#pragma unroll
    for (int kk = 0; kk < HF2_N; kk++) {
        float o = __shfl_sync(0xffffffffu, c, j * n + (kk < n ? kk : 0));

        if (kk < n)
            sum += o;
    }
    c = c / sum + eps;
    for (int it = 0; it < iters; it++) {
        if (it > 0)
            c = hf2_div_sum(c, j * n, 1, n, eps);   /* row j */
        c = hf2_div_sum(c, k, n, n, eps);           /* column k */
    }
    return c;
}

/* Copies n16 16-byte words src -> dst (shared) by cp.async, spread over
 * the block's threads, as one group of each thread. */
static __device__ __forceinline__ void
hf2_fin_copy(float *dst, const float *src, int n16)
{
    for (int i = threadIdx.x; i < n16; i += blockDim.x)
        wg_cp16(dst + 4 * i, src + 4 * i, 1);
    wg_cp_commit_mem();
}

/*
 * hf_finish_kernel with every load issued first.  NORM: one block per
 * token, HF2_NT collapse threads (float4 columns tid + HF2_NT*u) + one
 * warp; else block (t, y) collapses float4 columns y*HF2_XT + tid.  The mix
 * rows: r < R, R = M + 1 (the block that writes post and comb) or n + 1
 * (r == n standing for the sum of squares M); warp w sums rows w, w + W, ...
 */
template <int NORM, int PDL, int SH = 0>
static __global__ void __launch_bounds__((NORM ? HF2_NT : HF2_XT) + 32, SH ? 2 : 1)
hf2_finish_kernel(struct hf_fin a)
{
    enum {
        NT = NORM ? HF2_NT : HF2_XT,   /* collapse threads */
        U = NORM ? HF2_NU : 1,         /* float4 columns per collapse thread */
        W = NT / 32 + 1,               /* warps */
        Q = (HF_MAX_M1 + W - 1) / W,   /* mix rows per warp at most */
        XN = SH ? 1 : HF2_N,           /* X words held in registers (SH: none) */
        PQ = SH ? 1 : Q,               /* partials held in registers (SH: none) */
        PS = SH ? 1 : HF2_SQ
    };
    __shared__ float mix[HF_MAX_M1], pre[HF2_N], red[NT / 32];
    __shared__ __align__(16) float xs[NORM ? 4 * NT * U : 4];
    extern __shared__ __align__(16) float hsh[];   /* SH: X (n*D), then the partials */
    int64_t t = blockIdx.x;
    int n = a.n, D = a.D, M = hf_rows(n, a.head), nD = n * D, S = a.S, D4 = D / 4;
    int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    int all = blockIdx.y == 0 && !a.head;       /* this block writes post and comb */
    int R = all ? M + 1 : n + 1;
    int q0 = NORM ? 0 : blockIdx.y * NT;        /* first float4 column */
    int l = tid - NT, e = l >= 0 && l < n * n ? l : 0;
    const float *Xt = a.X + t * nD, *pt = a.part + t * (M + 1) * S;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 xv[U][XN], ov[U];
    uint2 wv[U];
    float pv[PQ][PS], sc = 0.0f, bs = 0.0f, sc2 = 0.0f, bs2 = 0.0f, r;
    float *psh = hsh + nD;                       /* SH: the token's (M + 1) * S partials */
    int early = !PDL || !a.x_dep;                /* X loaded before the wait */

    /* every load first: X of this thread's columns (SH: the token's X
     * copied to shared memory by the whole block) and the norm weights, */
    if (SH && early)
        hf2_fin_copy(hsh, Xt, nD / 4);
#pragma unroll
    for (int u = 0; u < U; u++) {
        int q = q0 + tid + NT * u, ok = tid < NT && q < D4;

        wv[u] = make_uint2(0, 0);
#pragma unroll
        for (int j = 0; j < XN; j++)
            xv[u][j] = !SH && early && ok && j < n
                           ? *(const float4 *)(Xt + (int64_t)j * D + 4 * q)
                           : zero;
        if (NORM && ok && a.nw != NULL)
            wv[u] = *(const uint2 *)(a.nw + 4 * q);
    }
    /* the hc weights this thread uses (pre: tid < n; post, comb: the extra
     * warp of the writing block), */
    if (tid < n) {
        sc = a.hc.scale[0];
        bs = a.hc.base[tid];
    } else if (l >= 0 && all) {
        sc = a.hc.scale[1];
        bs = a.hc.base[n + (l < n ? l : 0)];
        sc2 = a.hc.scale[2];
        bs2 = a.hc.base[2 * n + e];
    }
    if (PDL) {   /* v3: what follows reads the mix kernel's writes */
        asm volatile("griddepcontrol.wait;" : : : "memory");
        cu_pdl_trigger();   /* the next kernel, if PDL, may be scheduled */
        if (SH && !early)
            hf2_fin_copy(hsh, Xt, nD / 4);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int q = q0 + tid + NT * u, ok = !SH && !early && tid < NT && q < D4;

#pragma unroll
            for (int j = 0; j < XN; j++)
                if (ok && j < n)
                    xv[u][j] = *(const float4 *)(Xt + (int64_t)j * D + 4 * q);
        }
    }
    /* and the partials of this warp's mix rows (SH: all the token's rows,
     * to shared memory) */
    if (SH) {
        hf2_fin_copy(psh, pt, (M + 1) * S / 4);
        wg_cp_wait_mem<0>();
        __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < PQ; k++) {
        int rr = warp + W * k, m = all || rr < n ? rr : M;

#pragma unroll
        for (int u = 0; u < PS; u++) {
            int sidx = lane + 32 * u;

            pv[k][u] = !SH && rr < R && sidx < S ? pt[(int64_t)m * S + sidx] : 0.0f;
        }
    }
    /* mix[m]: lane l sums chunks l, l + 32, ... in order, then the butterfly */
#pragma unroll
    for (int k = 0; k < Q; k++) {
        int rr = warp + W * k, m = all || rr < n ? rr : M;
        float v = 0.0f;

#pragma unroll
        for (int u = 0; u < HF2_SQ; u++)
            if (lane + 32 * u < S)
                v += !SH ? pv[SH ? 0 : k][SH ? 0 : u]
                         : rr < R ? psh[m * S + lane + 32 * u] : 0.0f;
        v = fz_warp_sum(v);
        if (lane == 0 && rr < R)
            mix[m] = v;
    }
    __syncthreads();
    r = 1.0f / sqrtf(mix[M] / (float)nD + a.norm_eps);
    if (tid >= NT) {   /* the extra warp: post, then Sinkhorn */
        float c;

        if (!all)
            return;
        if (l < n)
            a.post[t * n + l] = 2.0f * hf_sigmoidf((mix[n + l] * r) * sc + bs);
        c = (mix[2 * n + e] * r) * sc2 + bs2;
        if (!a.defer)
            c = hf2_sinkhorn(c, n, a.iters, a.hc_eps, l);
        if (l < n * n)
            a.comb[t * n * n + l] = c;
        return;
    }
    if (tid < n)
        pre[tid] = hf_sigmoidf((mix[tid] * r) * sc + bs) + a.hc_eps;
    hf_bar(NT);
    {
        float pr[HF2_N];

#pragma unroll
        for (int j = 0; j < HF2_N; j++)
            pr[j] = j < n ? pre[j] : 0.0f;
#pragma unroll
        for (int u = 0; u < U; u++) {
            int q = q0 + tid + NT * u;
            float o[4];

            float4 x4[HF2_N];

#pragma unroll
            for (int j = 0; j < HF2_N; j++)
                x4[j] = !SH ? xv[u][SH ? 0 : j]
                        : j < n && q < D4 ? *(const float4 *)(hsh + (int64_t)j * D + 4 * q)
                                          : zero;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float acc = pr[0] * fz_f4(x4[0], c);

#pragma unroll
                for (int j = 1; j < HF2_N; j++)
                    if (j < n)
                        acc += pr[j] * fz_f4(x4[j], c);
                o[c] = cu_bf16_round(acc);
            }
            ov[u] = make_float4(o[0], o[1], o[2], o[3]);
            if (q < D4) {
                *(float4 *)(a.x_out + t * D + 4 * q) = ov[u];
                if (NORM)
                    *(float4 *)&xs[4 * q] = ov[u];
            }
        }
    }
    if (!NORM)
        return;
    hf_bar(NT);
    {
        int B = fz_norm_threads(D);
        float acc2 = 0.0f, rs;

        if (warp < B / 32) {   /* the norm's tree (fn_kernel's) */
            for (int i = tid; i < D; i += B) {
                float v = xs[i];

                acc2 += v * v;   /* fn_kernel's term: v is already bf16 */
            }
            acc2 = fz_warp_sum(acc2);
            if (lane == 0)
                red[warp] = acc2;
        }
        hf_bar(NT);
        rs = fz_norm_scale(fz_ordered_sum(red, B / 32), D, a.norm_eps);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int q = tid + NT * u, has = a.nw != NULL;
            uint16_t wb[4] = { (uint16_t)wv[u].x, (uint16_t)(wv[u].x >> 16), (uint16_t)wv[u].y,
                               (uint16_t)(wv[u].y >> 16) };

            if (q < D4)
                *(float4 *)(a.xn + t * D + 4 * q) =
                    make_float4(fz_norm_apply(ov[u].x, rs, has, wb[0]),
                                fz_norm_apply(ov[u].y, rs, has, wb[1]),
                                fz_norm_apply(ov[u].z, rs, has, wb[2]),
                                fz_norm_apply(ov[u].w, rs, has, wb[3]));
        }
    }
}

/*
 * The Sinkhorn of the finish kernels of a call whose comb they left as its
 * input (hf_fin.defer), in place: a warp per token, hf2_sinkhorn with the
 * finish warp's lanes (l >= n*n a copy of entry 0), so the same bits.  Run
 * beside the main stream (cuda_hc_fork): until run 38 it was the longest
 * part of the finish (bench_fuse at T = 1: hc_post_pre 8.1 us with 20
 * iterations, 6.3 with one), and comb is not read before the sub-layer's
 * end.
 */
static __global__ void __launch_bounds__(32)
hf2_sinkhorn_kernel(float *comb, int n, int iters, float eps)
{
    int64_t t = blockIdx.x;
    int l = threadIdx.x, e = l < n * n ? l : 0;
    float c = comb[t * n * n + e];

    c = hf2_sinkhorn(c, n, iters, eps, l);
    if (l < n * n)
        comb[t * n * n + l] = c;
}

/* Whether the v2 kernels take this call (a: the finish arguments; p: the
 * hc_post inputs of the fused form, p->X_out == NULL otherwise). */
static int
hf2_ok(const struct hf_fin *a, const struct hf_post *p, const float *fn)
{
#define HF2_AL(ptr, b) (((uintptr_t)(ptr) % (b)) == 0)
    int fused = p->X_out != NULL;

    if (cuda_fast_hc_version() < 2 || a->n > HF2_N || a->D % 4 != 0 ||
        a->S > 32 * HF2_SQ || (a->xn != NULL && a->D > 4 * HF2_NT * HF2_NU))
        return 0;
    if (!HF2_AL(a->X, 16) || !HF2_AL(a->x_out, 16) || !HF2_AL(fn, 16) ||
        !HF2_AL(a->xn, 16) || !HF2_AL(a->nw, 8))
        return 0;
    return !fused || (HF2_AL(p->X, 16) && HF2_AL(p->f, 16) && HF2_AL(p->X_out, 16));
#undef HF2_AL
}

/* The v2 finish; v3 (cuda_fast_hc_version() == 3): as a programmatic
 * dependent launch of the mix kernel before it on the stream.  SH (with
 * the norm only): the token's X and partials staged in smem bytes of
 * shared memory, two blocks an SM. */
template <int NORM, int SH>
static enum dsv4_err
hf2_finish_launch(struct dsv4_backend *be, const struct hf_fin *a, dim3 grid, unsigned threads,
                  size_t smem, cudaStream_t st)
{
    static size_t smem_done[2][CUDA_MAX_DEV];
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1] = {};
    int v3 = cuda_fast_hc_version() == 3;

    if (SH) {
        enum dsv4_err e = cuda_smem_allow(be, v3 ? (const void *)hf2_finish_kernel<NORM, 1, SH>
                                                 : (const void *)hf2_finish_kernel<NORM, 0, SH>,
                                          smem, smem_done[v3]);

        if (e != DSV4_OK)
            return e;
    }
    if (!v3) {
        hf2_finish_kernel<NORM, 0, SH><<<grid, threads, smem, st>>>(*a);
        CUDA_LAUNCHED("fast hc finish v2");
        return DSV4_OK;
    }
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CUDA_TRY(cudaLaunchKernelEx(&cfg, hf2_finish_kernel<NORM, 1, SH>, *a));
    return DSV4_OK;
}

/*
 * Both kernels for tokens [0, T) (pointers already offset to the slab);
 * p.X_out != NULL: the fused form (X_out = hc_post first, then its hc_pre).
 */
/* DSV4_CUDA_HC_MIXB=0: long calls' mix on hf2_mix_kernel's blocked form
 * instead of hf2_mixb_kernel (the same bits). */
static struct cuda_switch hf2b_switch = CUDA_SWITCH("DSV4_CUDA_HC_MIXB", 1);
/* DSV4_CUDA_HC_PAIR=0: hf2_mix_kernel's blocked form (two chains a thread)
 * only from HF2_BLOCKED_T tokens, as before run 63, instead of from
 * HF2_PAIR_T (a decode batch of 16; the same bits). */
static struct cuda_switch hf2pair_switch = CUDA_SWITCH("DSV4_CUDA_HC_PAIR", 1);
/* DSV4_CUDA_HC_FINSH=0: long calls' finish with the norm holds X and the
 * partials in registers (one block an SM) instead of staging them in
 * shared memory (two blocks an SM; the same bits). */
static struct cuda_switch hf2sh_switch = CUDA_SWITCH("DSV4_CUDA_HC_FINSH", 1);
/* DSV4_CUDA_HC_EARLY=0: the v2 mix kernel loads its fn chunk after its PDL
 * wait (hf2_mix_kernel). */
static struct cuda_switch hf2early_switch = CUDA_SWITCH("DSV4_CUDA_HC_EARLY", 1);

static enum dsv4_err
hf_slab(struct dsv4_backend *be, struct hf_fin *a, const struct hf_post *p, const float *fn,
        int T)
{
    int M = hf_rows(a->n, a->head);
    unsigned groups = (unsigned)((T + HF_TG - 1) / HF_TG);
    cudaStream_t st = cuda_stream(be);
    float *part = (float *)cuda_scratch(be, (size_t)T * a->S * (M + 1) * sizeof(float));
    int v2;

    if (part == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast hc: no scratch");
    a->part = part;
    v2 = hf2_ok(a, p, fn);
    if (!v2)
        a->defer = 0;   /* v1 runs its own Sinkhorn */
    if (v2 && T >= HF2_BLOCKED_T && M <= HF2B_MR && cuda_switch_on(&hf2b_switch)) {
        dim3 grid((unsigned)a->S, (unsigned)((T + HF2B_TG - 1) / HF2B_TG));

        if (p->X_out != NULL)
            cu_launch(hf2_mixb_kernel<1>, grid, HF2_MT, 0, st, part, (const float *)NULL, fn, T,
                      M, a->n, a->D, *p);
        else
            cu_launch(hf2_mixb_kernel<0>, grid, HF2_MT, 0, st, part, a->X, fn, T, M, a->n,
                      a->D, *p);
        CUDA_LAUNCHED("fast hc mix v2 (blocks of 64 tokens)");
    } else if (v2) {
        int pair_t = cuda_switch_on(&hf2pair_switch) ? HF2_PAIR_T : HF2_BLOCKED_T;
        int early = cuda_switch_on(&hf2early_switch);

        if (p->X_out != NULL)
            cu_launch(hf2_mix_kernel<1>, dim3((unsigned)a->S, groups), HF2_MT, 0, st, part,
                      (const float *)NULL, fn, T, M, a->n, a->D, *p, pair_t, early);
        else
            cu_launch(hf2_mix_kernel<0>, dim3((unsigned)a->S, groups), HF2_MT, 0, st, part, a->X,
                      fn, T, M, a->n, a->D, *p, pair_t, early);
        CUDA_LAUNCHED("fast hc mix v2");
    }
    if (v2) {
        size_t sh = ((size_t)a->n * a->D + (size_t)(M + 1) * a->S) * sizeof(float);

        if (a->xn != NULL && T >= HF2_SH_T && (M + 1) * a->S % 4 == 0 && sh <= HF2_SH_MAX &&
            cuda_switch_on(&hf2sh_switch))
            return hf2_finish_launch<1, 1>(be, a, dim3((unsigned)T, 1), HF2_NT + 32, sh, st);
        if (a->xn != NULL)
            return hf2_finish_launch<1, 0>(be, a, dim3((unsigned)T, 1), HF2_NT + 32, 0, st);
        return hf2_finish_launch<0, 0>(be, a,
                                       dim3((unsigned)T,
                                            (unsigned)((a->D / 4 + HF2_XT - 1) / HF2_XT)),
                                       HF2_XT + 32, 0, st);
    }
    if (p->X_out != NULL)
        hf_mix_kernel<1><<<dim3((unsigned)a->S, groups), HF_MT, 0, st>>>(part, NULL, fn, T, M,
                                                                        a->n, a->D, *p);
    else
        hf_mix_kernel<0><<<dim3((unsigned)a->S, groups), HF_MT, 0, st>>>(part, a->X, fn, T, M,
                                                                        a->n, a->D, *p);
    CUDA_LAUNCHED("fast hc mix");
    if (a->xn != NULL)
        hf_finish_kernel<1><<<dim3((unsigned)T, 1), HF_THREADS + 32, 0, st>>>(*a);
    else
        hf_finish_kernel<0><<<dim3((unsigned)T, (unsigned)((a->D + HF_XCOLS - 1) / HF_XCOLS)),
                              HF_THREADS + 32, 0, st>>>(*a);
    CUDA_LAUNCHED("fast hc finish");
    return DSV4_OK;
}

/* The slabs of a call; X_out != NULL: the fused form (hc_post inputs f,
 * X, post_in, comb_in). */
static enum dsv4_err
hf_run(struct dsv4_backend *be, float *X_out, float *x_out, float *post, float *comb,
       float *xn, const float *f, const float *X, const float *post_in, const float *comb_in,
       const struct dsv4_hc_w *hc, const uint16_t *nw, int T, int n, int D, int iters,
       float hc_eps, float norm_eps, int head)
{
    int64_t nD = (int64_t)n * D;
    int defer = comb != NULL && !head && cuda_hc_defer_on(be), n_def = 0;
    int def0[HF_DEFER_SLABS], defn[HF_DEFER_SLABS];   /* the deferred slabs */

    if (T <= 0 || D <= 0)
        return DSV4_OK;
    for (int t0 = 0; t0 < T; t0 += HF_SLAB) {
        int Ts = T - t0 < HF_SLAB ? T - t0 : HF_SLAB;
        struct hf_fin a;
        struct hf_post p;
        enum dsv4_err e;

        a.x_out = x_out + (int64_t)t0 * D;
        a.post = post != NULL ? post + (int64_t)t0 * n : NULL;
        a.comb = comb != NULL ? comb + (int64_t)t0 * n * n : NULL;
        a.xn = xn != NULL ? xn + (int64_t)t0 * D : NULL;
        a.nw = nw;
        a.X = (X_out != NULL ? X_out : X) + t0 * nD;
        a.hc = *hc;
        a.n = n;
        a.D = D;
        a.S = (int)((nD + HF_CW - 1) / HF_CW);
        a.iters = iters;
        a.head = head;
        a.x_dep = X_out != NULL;
        a.defer = defer && n_def < HF_DEFER_SLABS;
        a.hc_eps = hc_eps;
        a.norm_eps = norm_eps;
        p.X_out = X_out != NULL ? X_out + t0 * nD : NULL;
        p.f = f != NULL ? f + (int64_t)t0 * D : NULL;
        p.X = X + t0 * nD;
        p.post = post_in != NULL ? post_in + (int64_t)t0 * n : NULL;
        p.comb = comb_in != NULL ? comb_in + (int64_t)t0 * n * n : NULL;
        e = hf_slab(be, &a, &p, hc->fn, Ts);
        if (e != DSV4_OK)
            return e;
        if (a.defer) {
            def0[n_def] = t0;
            defn[n_def++] = Ts;
        }
    }
    if (n_def > 0) {   /* their Sinkhorn beside the main stream (else on it) */
        cudaStream_t hs = cuda_hc_fork(be);

        for (int i = 0; i < n_def; i++)
            hf2_sinkhorn_kernel<<<(unsigned)defn[i], 32, 0, hs != NULL ? hs : cuda_stream(be)>>>(
                comb + (int64_t)def0[i] * n * n, n, iters, hc_eps);
        CUDA_LAUNCHED("fast hc sinkhorn");
        if (hs != NULL)
            return cuda_hc_forked(be);
    }
    return DSV4_OK;
}

enum dsv4_err
cuda_fast_hc(struct dsv4_backend *be, float *x_out, float *post, float *comb, const float *X,
             const struct dsv4_hc_w *hc, int T, int n, int D, int iters, float hc_eps,
             float norm_eps, int head)
{
    return hf_run(be, NULL, x_out, post, comb, NULL, NULL, X, NULL, NULL, hc, NULL, T, n, D,
                  iters, hc_eps, norm_eps, head);
}

enum dsv4_err
cuda_fast_hc_post_pre(struct dsv4_backend *be, float *X_out, float *x_out, float *post_out,
                      float *comb_out, float *xn, const float *f, const float *X,
                      const float *post, const float *comb, const struct dsv4_hc_w *hc,
                      const uint16_t *nw, int T, int n, int D, int iters, float hc_eps,
                      float norm_eps)
{
    return hf_run(be, X_out, x_out, post_out, comb_out, xn, f, X, post, comb, hc, nw, T, n, D,
                  iters, hc_eps, norm_eps, 0);
}
