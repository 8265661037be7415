/*
 * cuda_hc.cu — manifold-constrained hyper-connections (model doc §3.2):
 * hc_pre, hc_post, hc_head; numerics and order of cpu_hc.c.
 *
 * hc_pre / hc_head run three kernels: the mix dot products (an 8-thread
 * group per (token, mix row), plus the sum of squares), the per-token small
 * math (scale by r, sigmoid, Sinkhorn: one thread per token), and the
 * collapse (one thread per output element).  hc_post is elementwise.
 */
#include "kernels/cuda/cuda.cuh"

#define HC_MAX_N 16

/* mix[t, m] = dot(X[t], fn[m]) for m < M, mix[t, M] = sumsq(X[t]) */
static __global__ void
hc_mix_kernel(float *mix, const float *X, const float *fn, int T, int M, int nD)
{
    int64_t it = blockIdx.x * (int64_t)(blockDim.x / 8) + threadIdx.x / 8;
    int l8 = threadIdx.x % 8;
    int64_t itc = it < (int64_t)T * (M + 1) ? it : (int64_t)T * (M + 1) - 1;
    int64_t t = itc / (M + 1);
    int m = (int)(itc % (M + 1));
    const float *v = X + t * nD;
    float d = cu_dot8(v, m < M ? fn + (int64_t)m * nD : v, nD, l8);

    if (l8 == 0 && it == itc)
        mix[it] = d;
}

static __device__ __forceinline__ float
cu_sigmoidf(float x)
{
    return 1.0f / (1.0f + cu_expf(-x));
}

/* sinkhorn() of cpu_hc.c on the n x n logits C. */
static __device__ void
cu_sinkhorn(float *C, int n, int iters, float eps)
{
    for (int j = 0; j < n; j++) {
        float *row = C + j * n;
        float mx = row[0], sum = 0.0f;

        for (int k = 1; k < n; k++)
            mx = row[k] > mx ? row[k] : mx;
        for (int k = 0; k < n; k++) {
            row[k] = cu_expf(row[k] - mx);
            sum += row[k];
        }
        for (int k = 0; k < n; k++)
            row[k] = row[k] / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int j = 0; j < n; j++) {
                float sum = 0.0f;

                for (int k = 0; k < n; k++)
                    sum += C[j * n + k];
                for (int k = 0; k < n; k++)
                    C[j * n + k] /= sum + eps;
            }
        }
        for (int k = 0; k < n; k++) {
            float sum = 0.0f;

            for (int j = 0; j < n; j++)
                sum += C[j * n + k];
            for (int j = 0; j < n; j++)
                C[j * n + k] /= sum + eps;
        }
    }
}

/* One thread per token: pre (T, n) and, unless head, post and comb. */
static __global__ void
hc_small_kernel(float *pre, float *post, float *comb, const float *mix, struct dsv4_hc_w hc,
                int T, int n, int nD, int iters, float hc_eps, float norm_eps, int head)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int M = head ? n : (2 + n) * n;
    const float *mx = mix + (int64_t)t * (M + 1);
    float r;

    if (t >= T)
        return;
    r = 1.0f / sqrtf(mx[M] / (float)nD + norm_eps);
    for (int k = 0; k < n; k++)
        pre[t * n + k] = cu_sigmoidf((mx[k] * r) * hc.scale[0] + hc.base[k]) + hc_eps;
    if (!head) {
        float C[HC_MAX_N * HC_MAX_N];

        for (int k = 0; k < n; k++)
            post[t * n + k] = 2.0f * cu_sigmoidf((mx[n + k] * r) * hc.scale[1] + hc.base[n + k]);
        for (int m = 0; m < n * n; m++)
            C[m] = (mx[2 * n + m] * r) * hc.scale[2] + hc.base[2 * n + m];
        cu_sinkhorn(C, n, iters, hc_eps);
        for (int m = 0; m < n * n; m++)
            comb[(int64_t)t * n * n + m] = C[m];
    }
}

/* x_out[t, i] = bf16(Σ_j pre[t, j] X[t, j, i]), j ascending */
static __global__ void
hc_collapse_kernel(float *x_out, const float *X, const float *pre, int T, int n, int D)
{
    int64_t it = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t t = it / D;
    int i = (int)(it % D);
    const float *Xt = X + t * n * D, *p = pre + t * n;
    float acc;

    if (t >= T)
        return;
    acc = p[0] * Xt[i];
    for (int j = 1; j < n; j++)
        acc += p[j] * Xt[(int64_t)j * D + i];
    x_out[t * D + i] = cu_bf16_round(acc);
}

/* Both forms: head = hc_head (n mix rows, no post/comb). */
static enum dsv4_err
hc_collapse_run(struct dsv4_backend *be, float *x_out, float *post, float *comb,
                const float *X, const struct dsv4_hc_w *hc, int T, int n, int D, int iters,
                float hc_eps, float norm_eps, int head)
{
    int M = head ? n : (2 + n) * n, nD = n * D;
    size_t mb = cuda_align((size_t)T * (M + 1) * sizeof(float));
    float *mix, *pre;
    cudaStream_t s = cuda_stream(be);

    if (n < 1 || n > HC_MAX_N || (!head && iters < 1))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda hc: n=%d iters=%d", n, iters);
    if (T <= 0)
        return DSV4_OK;
    if (!head)
        TRY_HC_JOIN(be);   /* comb: a Sinkhorn still running beside (cuda.cuh) */
    if (cuda_st(be)->fast_kernels && cuda_fast_hc_ok(n, head))   /* fast_hc.cu */
        return cuda_fast_hc(be, x_out, post, comb, X, hc, T, n, D, iters, hc_eps, norm_eps,
                            head);
    mix = (float *)cuda_scratch(be, mb + (size_t)T * n * sizeof(float));
    if (mix == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda hc: no scratch");
    pre = (float *)((char *)mix + mb);
    hc_mix_kernel<<<cuda_blocks((int64_t)T * (M + 1), 32), 256, 0, s>>>(mix, X, hc->fn, T, M,
                                                                      nD);
    CUDA_LAUNCHED("hc_mix");
    hc_small_kernel<<<cuda_blocks(T, 64), 64, 0, s>>>(pre, post, comb, mix, *hc, T, n, nD,
                                                      iters, hc_eps, norm_eps, head);
    CUDA_LAUNCHED("hc_small");
    hc_collapse_kernel<<<cuda_blocks((int64_t)T * D, 256), 256, 0, s>>>(x_out, X, pre, T, n, D);
    CUDA_LAUNCHED("hc_collapse");
    return DSV4_OK;
}

enum dsv4_err
cuda_hc_pre(struct dsv4_backend *be, float *x_out, float *post, float *comb, const float *X,
            const struct dsv4_hc_w *hc, int T, int n, int D, int iters, float hc_eps,
            float norm_eps)
{
    return hc_collapse_run(be, x_out, post, comb, X, hc, T, n, D, iters, hc_eps, norm_eps, 0);
}

enum dsv4_err
cuda_hc_head(struct dsv4_backend *be, float *x_out, const float *X, const struct dsv4_hc_w *hc,
             int T, int n, int D, float hc_eps, float norm_eps)
{
    return hc_collapse_run(be, x_out, NULL, NULL, X, hc, T, n, D, 0, hc_eps, norm_eps, 1);
}

/* X_out[t, k, i] = bf16(post[t,k] f[t,i] + Σ_j comb[t,j,k] X[t,j,i]) */
static __global__ void
hc_post_kernel(float *X_out, const float *f, const float *X, const float *post,
               const float *comb, int T, int n, int D)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t it = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t tk = it / D, t = tk / n;
    int k = (int)(tk % n), i = (int)(it % D);
    const float *Xt = X + t * n * D, *C = comb + t * n * n;
    float acc;

    if (t >= T)
        return;
    acc = C[k] * Xt[i];
    for (int j = 1; j < n; j++)
        acc += C[j * n + k] * Xt[(int64_t)j * D + i];
    X_out[it] = cu_bf16_round(post[t * n + k] * f[t * D + i] + acc);
}

enum dsv4_err
cuda_hc_post(struct dsv4_backend *be, float *X_out, const float *f, const float *X,
             const float *post, const float *comb, int T, int n, int D)
{
    int64_t N = (int64_t)T * n * D;

    if (N <= 0)
        return DSV4_OK;
    TRY_HC_JOIN(be);   /* comb: a Sinkhorn still running beside (cuda.cuh) */
    cu_launch(hc_post_kernel, cuda_blocks(N, 256), 256, 0, cuda_stream(be), X_out, f, X, post, comb,
              T, n, D);
    CUDA_LAUNCHED("hc_post");
    return DSV4_OK;
}
