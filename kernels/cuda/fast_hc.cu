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
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_fuse.cuh"

#define HF_THREADS 256       /* finish: collapse threads (+ one warp) */
#define HF_MT 128            /* mix block */
#define HF_CW 128            /* columns of X per mix chunk */
#define HF_TG 16             /* tokens per mix block */
#define HF_XCOLS 512         /* collapse columns per finish block (no norm) */
#define HF_MAX_M1 32         /* mix values per token (M + 1) */
#define HF_SLAB 1024         /* tokens per launch pair (bounds the scratch) */

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

/*
 * Both kernels for tokens [0, T) (pointers already offset to the slab);
 * p.X_out != NULL: the fused form (X_out = hc_post first, then its hc_pre).
 */
static enum dsv4_err
hf_slab(struct dsv4_backend *be, struct hf_fin *a, const struct hf_post *p, const float *fn,
        int T)
{
    int M = hf_rows(a->n, a->head);
    unsigned groups = (unsigned)((T + HF_TG - 1) / HF_TG);
    cudaStream_t st = cuda_stream(be);
    float *part = (float *)cuda_scratch(be, (size_t)T * a->S * (M + 1) * sizeof(float));

    if (part == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast hc: no scratch");
    a->part = part;
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
