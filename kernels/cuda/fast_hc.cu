/*
 * fast_hc.cu — the fast hc_pre and hc_head (hyper-connection mixing, model
 * doc §3.2).  Used by cuda_hc_pre / cuda_hc_head when
 * dsv4_cuda_set_kernels(be, 1) was called and cuda_fast_hc_ok() agrees
 * (M + 1 <= 32 mix values, i.e. n <= 4 for hc_pre; n*n <= 32 for Sinkhorn).
 *
 * Two kernels instead of the exact path's three latency-bound ones:
 *   1. mix: grid (T, S), S = ceil(nD / HF_COLS) column chunks (a function of
 *      nD only).  Block (t, s) computes, for its chunk of X[t] and of the M
 *      rows of fn, the M partial dot products and the partial sum of squares:
 *      thread i sums its columns (i, i + 256) in order, warps add their lanes
 *      by an xor butterfly, thread m adds the 8 warp sums in warp order;
 *      partials go to part (T, S, M+1).
 *   2. finish: one block per token.  mix[m] = the S partials added in chunk
 *      order; then exactly the exact path's per-token math on it: r =
 *      1 / sqrtf(sumsq / nD + norm_eps), pre = sigmoid(mix*r*scale0 + base)
 *      + hc_eps, post = 2 sigmoid(...), comb = Sinkhorn of the n x n logits
 *      (one lane per entry of a warp; every sum is the exact path's
 *      sequential sum in index order, read from shared memory), and the
 *      collapse x_out = bf16(Σ_j pre_j X[t, j, :]), j ascending.
 * Only the order of the mix sums differs from the exact path (which runs
 * 8 interleaved chains over nD); given the same mix values the rest is bit
 * for bit the same expression.  Deterministic, independent of T.
 */
#include "kernels/cuda/fast.cuh"

#define HF_THREADS 256
#define HF_NWARP (HF_THREADS / 32)
#define HF_COLS 512          /* columns of X per mix block (2 per thread) */
#define HF_MAX_M1 32         /* mix values per token (M + 1) */

/* The number of mix rows M of the hc_pre (head == 0) or hc_head form. */
static __host__ __device__ int
hf_rows(int n, int head)
{
    return head ? n : (2 + n) * n;
}

int
cuda_fast_hc_ok(int n, int head)
{
    return n >= 1 && hf_rows(n, head) + 1 <= HF_MAX_M1 && n * n <= 32;
}

/* part[t, s, m] for m < M: Σ over chunk s of X[t, c] fn[m, c]; m = M: of X[t, c]^2 */
static __global__ void __launch_bounds__(HF_THREADS)
hf_mix_kernel(float *part, const float *X, const float *fn, int M, int nD)
{
    __shared__ float red[HF_NWARP][HF_MAX_M1];
    int s = blockIdx.y, S = gridDim.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int64_t t = blockIdx.x;
    int c1 = min(nD, (s + 1) * HF_COLS);
    const float *Xt = X + t * nD;
    float acc[HF_MAX_M1];

#pragma unroll
    for (int m = 0; m < HF_MAX_M1; m++)
        acc[m] = 0.0f;
    for (int c = s * HF_COLS + threadIdx.x; c < c1; c += HF_THREADS) {
        float xv = Xt[c];

#pragma unroll
        for (int m = 0; m < HF_MAX_M1; m++) {
            if (m < M)
                acc[m] += xv * __ldg(fn + (int64_t)m * nD + c);
            else if (m == M)
                acc[m] += xv * xv;
        }
    }
#pragma unroll
    for (int m = 0; m < HF_MAX_M1; m++) {
        if (m > M)
            break;
        for (int o = 16; o > 0; o /= 2)
            acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
        if (lane == 0)
            red[warp][m] = acc[m];
    }
    __syncthreads();
    if (threadIdx.x <= M) {
        float v = red[0][threadIdx.x];

        for (int w = 1; w < HF_NWARP; w++)
            v += red[w][threadIdx.x];
        part[(t * S + s) * (M + 1) + threadIdx.x] = v;
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

/* One block per token: the mix from the partials, pre/post/comb, collapse. */
static __global__ void __launch_bounds__(HF_THREADS)
hf_finish_kernel(float *x_out, float *post, float *comb, const float *part, const float *X,
                 struct dsv4_hc_w hc, int n, int D, int S, int iters, float hc_eps,
                 float norm_eps, int head)
{
    __shared__ float mix[HF_MAX_M1], pre[HF_MAX_M1], C[32];
    int64_t t = blockIdx.x;
    int M = hf_rows(n, head), nD = n * D, tid = threadIdx.x;
    const float *Xt = X + t * nD;
    float r;

    if (tid <= M) {
        const float *p = part + t * S * (M + 1) + tid;
        float v = p[0];

        for (int s = 1; s < S; s++)
            v += p[(int64_t)s * (M + 1)];
        mix[tid] = v;
    }
    __syncthreads();
    r = 1.0f / sqrtf(mix[M] / (float)nD + norm_eps);
    if (tid < n) {
        pre[tid] = hf_sigmoidf((mix[tid] * r) * hc.scale[0] + hc.base[tid]) + hc_eps;
    } else if (!head && tid >= 32 && tid < 32 + n) {
        int k = tid - 32;

        post[t * n + k] = 2.0f * hf_sigmoidf((mix[n + k] * r) * hc.scale[1] + hc.base[n + k]);
    } else if (!head && tid >= 64 && tid < 96) {
        int l = tid - 64, m = l < n * n ? l : 0;
        float c = (mix[2 * n + m] * r) * hc.scale[2] + hc.base[2 * n + m];

        c = hf_sinkhorn(c, C, n, iters, hc_eps, l);
        if (l < n * n)
            comb[t * n * n + l] = c;
    }
    __syncthreads();
    for (int i = tid; i < D; i += HF_THREADS) {
        float acc = pre[0] * Xt[i];

        for (int j = 1; j < n; j++)
            acc += pre[j] * Xt[(int64_t)j * D + i];
        x_out[t * D + i] = cu_bf16_round(acc);
    }
}

enum dsv4_err
cuda_fast_hc(struct dsv4_backend *be, float *x_out, float *post, float *comb, const float *X,
             const struct dsv4_hc_w *hc, int T, int n, int D, int iters, float hc_eps,
             float norm_eps, int head)
{
    int M = hf_rows(n, head), nD = n * D, S = (nD + HF_COLS - 1) / HF_COLS;
    cudaStream_t st = cuda_stream(be);
    float *part;

    if (T <= 0 || D <= 0)
        return DSV4_OK;
    part = (float *)cuda_scratch(be, (size_t)T * S * (M + 1) * sizeof(float));
    if (part == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast hc: no scratch");
    hf_mix_kernel<<<dim3((unsigned)T, (unsigned)S), HF_THREADS, 0, st>>>(part, X, hc->fn, M,
                                                                        nD);
    CUDA_LAUNCHED("fast hc mix");
    hf_finish_kernel<<<T, HF_THREADS, 0, st>>>(x_out, post, comb, part, X, *hc, n, D, S, iters,
                                               hc_eps, norm_eps, head);
    CUDA_LAUNCHED("fast hc finish");
    return DSV4_OK;
}
