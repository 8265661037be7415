/*
 * cuda_moe.cu — router (learned and hash) and routed + shared experts;
 * numerics of cpu_moe.c.
 *
 * router: the gate logits by cuda_linear (BF16, fp32 out), then one thread
 *   per token: sqrt(softplus), the CPU's insertion top-k (ties to the lower
 *   expert id) or the tid2eid row, and the normalised weights.
 *
 * moe: instead of grouping tokens per expert as the CPU does, every (token,
 *   pick) row and every shared-expert row is computed on its own, which gives
 *   the same values (each output is one complete dot product in the CPU's
 *   order).  Rows: T*k routed picks (row t*k + j), then T shared rows.
 *     1. x quantized per row to FP8 (REF numerics).
 *     2. up: h[row, i] = bf16(silu(min(g, L)) * clamp(u, ±L) [* weight]),
 *        g, u the bf16-rounded w1/w3 outputs.
 *     3. h quantized per row (REF).
 *     4. down: y[row, :] = bf16(w2 · h[row]).
 *     5. out[t] = bf16(Σ picks in increasing expert id order (stable), then
 *        + shared).
 *   The experts are read through a device copy of the expert array: the one
 *   dsv4_cuda_weights_upload registered for that array, or else one built
 *   for this call (which downloads ids to find the experts used, and so
 *   synchronises).  Expert ids are clamped into the table.
 *
 * moe_parts (expert parallelism): the same kernels write steps 1-4 into the
 *   caller's (T*k + T, D) array, which is zeroed first; rows whose expert is
 *   not held here (no weights) stay zero.  Needs a registered expert array.
 *   moe_combine is step 5 on such an array.
 */
#include "kernels/cuda/cuda.cuh"

#include <stdlib.h>

#define MOE_MAX_K 64
#define LIN_THREADS 256
#define LIN_GROUPS (LIN_THREADS / 8)

/* --- router ------------------------------------------------------------------------ */

static __global__ void
router_kernel(float *weights, int32_t *ids, float *s, const float *bias,
              const int64_t *tid2eid, const int32_t *tokens, int T, int E, int k,
              float route_scale, int hf)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    float *st;
    int32_t *id;
    float sum = 0.0f;

    if (t >= T)
        return;
    st = s + (int64_t)t * E;
    id = ids + (int64_t)t * k;
    for (int i = 0; i < E; i++) {
        float l = st[i];

        st[i] = sqrtf(l > 20.0f ? l : cu_log1pf(cu_expf(l)));
    }
    if (tid2eid != NULL) {
        for (int j = 0; j < k; j++) {
            int64_t v = tid2eid[(int64_t)tokens[t] * k + j];

            id[j] = (int32_t)(v < 0 ? 0 : (v >= E ? E - 1 : v));
        }
    } else {
        float best[MOE_MAX_K];
        int n = 0;

        for (int i = 0; i < E; i++) {
            float v = st[i] + (bias != NULL ? bias[i] : 0.0f);
            int at = n;

            while (at > 0 && v > best[at - 1])
                at--;
            if (at >= k)
                continue;
            for (int m = (n < k ? n : k - 1); m > at; m--) {
                best[m] = best[m - 1];
                id[m] = id[m - 1];
            }
            best[at] = v;
            id[at] = i;
            if (n < k)
                n++;
        }
    }
    for (int j = 0; j < k; j++)
        sum += st[id[j]];
    if (hf)
        sum += 1e-20f;
    for (int j = 0; j < k; j++)
        weights[(int64_t)t * k + j] = st[id[j]] / sum * route_scale;
}

enum dsv4_err
cuda_router(struct dsv4_backend *be, float *weights, int32_t *ids, const float *x,
            const struct dsv4_linear *gate, const float *bias, const int64_t *tid2eid,
            const int32_t *tokens, int T, int k, float route_scale)
{
    int E = gate->n_out;
    float *s;
    enum dsv4_err e;

    if (gate->fmt != DSV4_WFMT_BF16 || k < 1 || k > E || k > MOE_MAX_K)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda router: gate fmt %d, k=%d, E=%d",
                            (int)gate->fmt, k, E);
    if (T <= 0)
        return DSV4_OK;
    if (cuda_st(be)->fast_kernels)   /* fast_router.cu (also keeps the fast linear's
                                        scratch apart from s) */
        return cuda_fast_router(be, weights, ids, x, gate, bias, tid2eid, tokens, T, k,
                                route_scale);
    /* the exact BF16 linear takes no scratch, so this buffer stays ours */
    s = (float *)cuda_scratch(be, (size_t)T * E * sizeof(float));
    if (s == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda router: no scratch");
    e = cuda_linear(be, s, x, gate, T, DSV4_LIN_F32_OUT);
    if (e != DSV4_OK)
        return e;
    router_kernel<<<cuda_blocks(T, 64), 64, 0, cuda_stream(be)>>>(
        weights, ids, s, bias, tid2eid, tokens, T, E, k, route_scale,
        be->numerics == DSV4_NUMERICS_HF);
    CUDA_LAUNCHED("router");
    return DSV4_OK;
}

/* --- moe ------------------------------------------------------------------------------ */

/* Row r's expert: routed pick r < Tk, else the shared expert. */
static __device__ __forceinline__ const struct dsv4_expert_w *
moe_expert(const struct dsv4_expert_w *table, int n_table, const struct dsv4_expert_w *shared,
           const int32_t *ids, int64_t r, int64_t Tk)
{
    int id;

    if (r >= Tk)
        return shared;
    id = ids[r];
    id = id < 0 ? 0 : (id >= n_table ? n_table - 1 : id);
    return &table[id];
}

/* Activation row r of a source: quantized (xq, sx) when the weight format
 * quantizes under REF, else raw. */
struct moe_src {
    const float *raw, *q, *sx;
    int64_t K;
};

/* up: grid (I tiles, rows); h (rows, I) */
static __global__ void
moe_up_kernel(float *h, struct moe_src xs, const struct dsv4_expert_w *table, int n_table,
              const struct dsv4_expert_w *shared, const int32_t *ids, const float *weights,
              int T, int k, int I, float lim, int ref)
{
    int64_t Tk = (int64_t)T * k, rows = Tk + (shared != NULL ? T : 0);
    int g = threadIdx.x / 8, l8 = threadIdx.x % 8;
    int i = blockIdx.x * LIN_GROUPS + g, ic = i < I ? i : I - 1;

    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const struct dsv4_expert_w *E = moe_expert(table, n_table, shared, ids, r, Tk);
        if (E->w1.w == NULL) {            /* not held here (moe_parts) */
            if (l8 == 0 && i < I)
                h[r * I + i] = 0.0f;
            continue;
        }
        int64_t t = r < Tk ? r / k : r - Tk;
        int q1 = ref && E->w1.fmt != DSV4_WFMT_BF16, q3 = ref && E->w3.fmt != DSV4_WFMT_BF16;
        const float *x1 = (q1 ? xs.q : xs.raw) + t * xs.K, *x3 = (q3 ? xs.q : xs.raw) + t * xs.K;
        float g = cu_lin_dot(E->w1, ic, x1, q1 ? xs.sx + t * (xs.K / 128) : NULL, l8, 0);
        float u = cu_lin_dot(E->w3, ic, x3, q3 ? xs.sx + t * (xs.K / 128) : NULL, l8, 0);
        float v = cu_swiglu(g, u, lim);
        if (r < Tk)
            v *= weights[r];
        if (l8 == 0 && i < I)
            h[r * I + i] = cu_bf16_round(v);
    }
}

/* down: grid (D tiles, rows); y (rows, D) */
static __global__ void
moe_down_kernel(float *y, struct moe_src hs, const struct dsv4_expert_w *table, int n_table,
                const struct dsv4_expert_w *shared, const int32_t *ids, int T, int k, int D,
                int ref)
{
    int64_t Tk = (int64_t)T * k, rows = Tk + (shared != NULL ? T : 0);
    int g = threadIdx.x / 8, l8 = threadIdx.x % 8;
    int o = blockIdx.x * LIN_GROUPS + g, oc = o < D ? o : D - 1;

    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const struct dsv4_expert_w *E = moe_expert(table, n_table, shared, ids, r, Tk);
        if (E->w2.w == NULL) {            /* not held here (moe_parts) */
            if (l8 == 0 && o < D)
                y[r * D + o] = 0.0f;
            continue;
        }
        int q2 = ref && E->w2.fmt != DSV4_WFMT_BF16;
        const float *hr = (q2 ? hs.q : hs.raw) + r * hs.K;
        float v = cu_lin_dot(E->w2, oc, hr, q2 ? hs.sx + r * (hs.K / 128) : NULL, l8, 0);

        if (l8 == 0 && o < D)
            y[r * D + o] = cu_bf16_round(v);
    }
}

/* A value of y (fp32, or bf16 bits widened: cuda_moe_combine16), and four
 * consecutive ones (16-byte aligned fp32, 8-byte aligned bf16). */
static __device__ __forceinline__ float
moe_y1(const float *y, int64_t i)
{
    return y[i];
}

static __device__ __forceinline__ float
moe_y1(const uint16_t *y, int64_t i)
{
    return __uint_as_float((uint32_t)y[i] << 16);
}

static __device__ __forceinline__ float4
moe_y4(const float *y, int64_t i)
{
    return *(const float4 *)(y + i);
}

static __device__ __forceinline__ float4
moe_y4(const uint16_t *y, int64_t i)
{
    uint2 w = *(const uint2 *)(y + i);

    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                       __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
}

/* rk[a]: pick a's place in the order of increasing expert id (stable): the
 * picks before it. */
template <int KS>
static __device__ __forceinline__ void
moe_pick_ranks(const int32_t (&iv)[KS], int (&rk)[KS])
{
#pragma unroll
    for (int a = 0; a < KS; a++) {
        rk[a] = 0;
#pragma unroll
        for (int b = 0; b < KS; b++)
            rk[a] += b != a && (iv[b] < iv[a] || (iv[b] == iv[a] && b < a));
    }
}

/*
 * out[t, i]: picks by increasing expert id (stable), then the shared row.
 * KS > 0 (k == KS, the model's 6): every load first (the token's ids and its
 * k + 1 values, one round trip), then each pick's place in the order as a
 * count of the picks before it, and the values added in that order from
 * registers; the same sums as the insertion sort below (KS = 0, any k),
 * which waits for each id it compares and then for each value in turn.
 */
template <int KS, typename YT>
static __global__ void
moe_sum_kernel(float *out, const YT *y, const int32_t *ids, int T, int k, int D,
               int has_shared)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t it = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int64_t t = it / D;
    int i = (int)(it % D);
    const int32_t *id;
    float o = 0.0f;

    if (t >= T)
        return;
    id = ids + t * k;
    if (KS > 0) {
        int32_t iv[KS > 0 ? KS : 1];
        float yv[KS > 0 ? KS : 1], ys = 0.0f;
        int rk[KS > 0 ? KS : 1];

#pragma unroll
        for (int a = 0; a < KS; a++) {
            iv[a] = id[a];
            yv[a] = moe_y1(y, (t * KS + a) * D + i);
        }
        if (has_shared)
            ys = moe_y1(y, ((int64_t)T * KS + t) * D + i);
        moe_pick_ranks<(KS > 0 ? KS : 1)>(iv, rk);
#pragma unroll
        for (int r = 0; r < KS; r++) {
            float v = 0.0f;

#pragma unroll
            for (int a = 0; a < KS; a++)
                v = rk[a] == r ? yv[a] : v;
            o += v;
        }
        if (has_shared)
            o += ys;
    } else {
        int order[MOE_MAX_K];

        for (int a = 0; a < k; a++) {
            int at = a;

            while (at > 0 && id[order[at - 1]] > id[a]) {
                order[at] = order[at - 1];
                at--;
            }
            order[at] = a;
        }
        for (int a = 0; a < k; a++)
            o += moe_y1(y, (t * k + order[a]) * D + i);
        if (has_shared)
            o += moe_y1(y, ((int64_t)T * k + t) * D + i);
    }
    out[it] = cu_bf16_round(o);
}

/*
 * moe_sum_kernel<KS>'s sums for 4 consecutive columns a thread (16-byte
 * loads and store; the picks' order worked out once for the 4): the same
 * sums.  D % 4 == 0, y and out 16-byte aligned.
 */
template <int KS, typename YT>
static __global__ void
moe_sum4_kernel(float *out, const YT *y, const int32_t *ids, int T, int D, int has_shared)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t it = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, t = it / (D / 4);
    int i = (int)(it % (D / 4)) * 4;
    const int32_t *id = ids + t * KS;
    int32_t iv[KS];
    float4 yv[KS], ys = make_float4(0.0f, 0.0f, 0.0f, 0.0f), o;
    int rk[KS];

    if (t >= T)
        return;
#pragma unroll
    for (int a = 0; a < KS; a++) {
        iv[a] = id[a];
        yv[a] = moe_y4(y, (t * KS + a) * D + i);
    }
    if (has_shared)
        ys = moe_y4(y, ((int64_t)T * KS + t) * D + i);
    moe_pick_ranks<KS>(iv, rk);
    o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int r = 0; r < KS; r++) {
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

#pragma unroll
        for (int a = 0; a < KS; a++)
            v = rk[a] == r ? yv[a] : v;
        o.x += v.x;
        o.y += v.y;
        o.z += v.z;
        o.w += v.w;
    }
    if (has_shared) {
        o.x += ys.x;
        o.y += ys.y;
        o.z += ys.z;
        o.w += ys.w;
    }
    *(float4 *)(out + t * D + i) = make_float4(cu_bf16_round(o.x), cu_bf16_round(o.y),
                                               cu_bf16_round(o.z), cu_bf16_round(o.w));
}

/* moe_sum_kernel for k picks a token (the k = 6 form where it applies; 4
 * columns a thread where the shapes allow); y fp32 or bf16 (YT). */
template <typename YT>
static void
moe_sum_launch(cudaStream_t st, float *out, const YT *y, const int32_t *ids, int T, int k,
               int D, int has_shared)
{
    if (k == 6 && D % 4 == 0 && (((uintptr_t)out | (uintptr_t)y) & 15) == 0)
        cu_launch(moe_sum4_kernel<6, YT>, cuda_blocks((int64_t)T * D / 4, 256), 256, 0, st, out,
                  y, ids, T, D, has_shared);
    else if (k == 6)
        cu_launch(moe_sum_kernel<6, YT>, cuda_blocks((int64_t)T * D, 256), 256, 0, st, out, y,
                  ids, T, k, D, has_shared);
    else
        cu_launch(moe_sum_kernel<0, YT>, cuda_blocks((int64_t)T * D, 256), 256, 0, st, out, y,
                  ids, T, k, D, has_shared);
}

static int
moe_expert_ok(const struct dsv4_expert_w *w, int D, int I)
{
    return w->w1.n_in == D && w->w3.n_in == D && w->w1.n_out == I && w->w3.n_out == I &&
           w->w2.n_in == I && w->w2.n_out == D;
}

/*
 * For an unregistered expert array: downloads ids (synchronises), checks the
 * shapes of the experts used and returns the number of table entries
 * needed (max id + 1) in *n_table.
 */
static enum dsv4_err
moe_scan_ids(struct dsv4_backend *be, int *n_table, const struct dsv4_expert_w *experts,
             const int32_t *ids, int T, int k, int D, int I)
{
    int64_t n = (int64_t)T * k;
    int32_t *h = (int32_t *)malloc((size_t)n * sizeof(int32_t) + 1);
    int E = 0;

    if (h == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda moe: no memory");
    if (cudaMemcpyAsync(h, ids, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost,
                        cuda_stream(be)) != cudaSuccess ||
        cudaStreamSynchronize(cuda_stream(be)) != cudaSuccess) {
        free(h);
        return dsv4_err_set(DSV4_ERR_CUDA, "cuda moe: reading the expert ids failed");
    }
    for (int64_t i = 0; i < n; i++) {
        if (h[i] < 0 || !moe_expert_ok(&experts[h[i]], D, I)) {
            int bad = h[i];

            free(h);
            return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe: expert %d: bad id or shape", bad);
        }
        E = h[i] + 1 > E ? h[i] + 1 : E;
    }
    free(h);
    *n_table = E;
    return DSV4_OK;
}

/*
 * moe (parts == NULL) or moe_parts (parts: (T*k + T, D_parts) device array,
 * zeroed, then the held experts' rows).
 */
static enum dsv4_err
moe_run(struct dsv4_backend *be, float *out, float *parts, const float *x, const int32_t *ids,
        const float *weights, const struct dsv4_expert_w *experts,
        const struct dsv4_expert_w *shared, int T, int k, int D_parts, float swiglu_limit)
{
    cudaStream_t s = cuda_stream(be);
    const struct cuda_expert_table *reg = NULL, *reg_sh = NULL;
    const struct dsv4_expert_w *any;
    struct dsv4_expert_w *table = NULL;
    int n_table = 0, D, I, ref = be->numerics == DSV4_NUMERICS_REF;
    int64_t rows;
    size_t b_tab, b_sh, b_xq, b_xs, b_h, b_hq, b_hs, b_y;
    char *base, *p;
    struct moe_src xs, hs;
    enum dsv4_err e;

    if (T <= 0)
        return DSV4_OK;
    if (k < 0 || k > MOE_MAX_K)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe: k=%d", k);
    if (k > 0 && experts == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe: no routed experts");
    /* D and I from any expert (the CPU takes ids[0]'s; all must agree) */
    any = k > 0 ? &experts[0] : shared;
    if (parts != NULL) {
        /* the held experts only: a registered array says how many there are */
        const struct cuda_expert_table *rt = k > 0 ? cuda_experts_find(be, experts) : NULL;

        if (k > 0 && rt == NULL)
            return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe_parts: the expert array is not "
                                "registered (upload it with dsv4_cuda_weights_upload)");
        if (shared != NULL && shared->w1.w == NULL)
            shared = NULL;
        any = shared;
        for (int i = 0; rt != NULL && i < rt->n && any == NULL; i++)
            if (experts[i].w1.w != NULL)
                any = &experts[i];
        CUDA_TRY(cudaMemsetAsync(parts, 0, ((size_t)T * k + T) * D_parts * sizeof(float), s));
        if (any == NULL)
            return DSV4_OK;
        if (any->w1.n_in != D_parts)
            return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe_parts: experts have D=%d, not %d",
                                any->w1.n_in, D_parts);
    }
    if (any == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe: no expert at all (k=0, no shared)");
    D = any->w1.n_in;
    I = any->w1.n_out;
    if (shared != NULL && !moe_expert_ok(shared, D, I))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe: shared expert shape differs");
    if (ref && (D % 128 != 0 || I % 128 != 0))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe: D=%d I=%d not multiples of 128", D, I);
    rows = (int64_t)T * k + (shared != NULL ? T : 0);
    if (k > 0 && cuda_st(be)->fast_kernels) {   /* fast_moe.cu: */
        /* registered expert arrays only (no host copy, no synchronisation) */
        const struct cuda_expert_table *fr = cuda_experts_find(be, experts);

        if (fr != NULL &&   /* fast_gemm.cu: prefill (T > 96) */
            cuda_fast_gemm_moe_ok(be, experts, fr->n, shared, T, k, D, I, parts != NULL))
            return cuda_fast_gemm_moe(be, out, parts, x, ids, weights, fr->dev, fr->n, shared,
                                      T, k, D, I, swiglu_limit);
        if (fr != NULL &&
            cuda_fast_moe_ok(be, experts, fr->n, shared, T, k, D, I, parts != NULL))
            return cuda_fast_moe(be, out, parts, x, ids, weights, fr->dev, fr->n, shared, T, k,
                                 D, I, swiglu_limit);
    }
    if (k > 0) {
        reg = cuda_experts_find(be, experts);
        if (reg != NULL) {
            table = reg->dev;
            n_table = reg->n;
        } else {
            e = moe_scan_ids(be, &n_table, experts, ids, T, k, D, I);
            if (e != DSV4_OK)
                return e;
        }
    }

    /* the shared expert's struct: a registered device copy (no host copy,
     * so the op can be recorded in a graph), else copied from the host */
    reg_sh = shared != NULL ? cuda_experts_find(be, shared) : NULL;
    b_tab = reg == NULL && k > 0 ? cuda_align((size_t)n_table * sizeof(*experts) + 1) : 0;
    b_sh = cuda_align(sizeof(*shared));
    b_xq = cuda_align((size_t)T * D * sizeof(float));
    b_xs = cuda_align((size_t)T * (D / 128) * sizeof(float));
    b_h = cuda_align((size_t)rows * I * sizeof(float));
    b_hq = b_h;
    b_hs = cuda_align((size_t)rows * (I / 128) * sizeof(float));
    b_y = parts != NULL ? 0 : cuda_align((size_t)rows * D * sizeof(float));
    base = (char *)cuda_scratch(be, b_tab + b_sh + b_xq + b_xs + b_h + b_hq + b_hs + b_y);
    if (base == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda moe: no scratch (T=%d k=%d)", T, k);
    p = base;
    if (reg == NULL && k > 0) {
        table = (struct dsv4_expert_w *)p;
        CUDA_TRY(cudaMemcpyAsync(table, experts, (size_t)n_table * sizeof(*experts),
                                 cudaMemcpyHostToDevice, s));
    }
    p += b_tab;
    if (shared != NULL && reg_sh == NULL)
        CUDA_TRY(cudaMemcpyAsync(p, shared, sizeof(*shared), cudaMemcpyHostToDevice, s));
    const struct dsv4_expert_w *sh_dev =
        shared == NULL ? NULL : reg_sh != NULL ? reg_sh->dev : (const struct dsv4_expert_w *)p;
    xs.raw = x;
    xs.q = (float *)(p + b_sh);
    xs.sx = (float *)(p + b_sh + b_xq);
    xs.K = D;
    hs.raw = (float *)(p + b_sh + b_xq + b_xs);
    hs.q = (float *)(p + b_sh + b_xq + b_xs + b_h);
    hs.sx = (float *)(p + b_sh + b_xq + b_xs + b_h + b_hq);
    hs.K = I;
    float *y = parts != NULL ? parts : (float *)(p + b_sh + b_xq + b_xs + b_h + b_hq + b_hs);

    if (ref) {
        e = cuda_quant_rows(be, (float *)xs.q, (float *)xs.sx, x, D, T, D);
        if (e != DSV4_OK)
            return e;
    }
    {
        dim3 grid(cuda_blocks(I, LIN_GROUPS), rows < 65535 ? (unsigned)rows : 65535);

        moe_up_kernel<<<grid, LIN_THREADS, 0, s>>>(
            (float *)hs.raw, xs, table, n_table, sh_dev, ids, weights, T, k, I,
            swiglu_limit, ref);
        CUDA_LAUNCHED("moe_up");
    }
    if (ref) {
        e = cuda_quant_rows(be, (float *)hs.q, (float *)hs.sx, hs.raw, I, (int)rows, I);
        if (e != DSV4_OK)
            return e;
    }
    {
        dim3 grid(cuda_blocks(D, LIN_GROUPS), rows < 65535 ? (unsigned)rows : 65535);

        moe_down_kernel<<<grid, LIN_THREADS, 0, s>>>(
            y, hs, table, n_table, sh_dev, ids, T, k, D, ref);
        CUDA_LAUNCHED("moe_down");
    }
    if (parts != NULL)
        return DSV4_OK;
    moe_sum_launch(s, out, y, ids, T, k, D, shared != NULL);
    CUDA_LAUNCHED("moe_sum");
    return DSV4_OK;
}

enum dsv4_err
cuda_moe(struct dsv4_backend *be, float *out, const float *x, const int32_t *ids,
         const float *weights, const struct dsv4_expert_w *experts,
         const struct dsv4_expert_w *shared, int T, int k, float swiglu_limit)
{
    return moe_run(be, out, NULL, x, ids, weights, experts, shared, T, k, 0, swiglu_limit);
}

enum dsv4_err
cuda_moe_parts(struct dsv4_backend *be, float *y, const float *x, const int32_t *ids,
               const float *weights, const struct dsv4_expert_w *experts,
               const struct dsv4_expert_w *shared, int T, int k, int D, float swiglu_limit)
{
    if (D <= 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe_parts: D=%d", D);
    return moe_run(be, NULL, y, x, ids, weights, experts, shared, T, k, D, swiglu_limit);
}

/* cuda_moe_combine for y of fp32 or bf16 values (YT). */
template <typename YT>
static enum dsv4_err
moe_combine_any(struct dsv4_backend *be, float *out, const YT *y, const int32_t *ids, int T,
                int k, int D)
{
    if (T <= 0)
        return DSV4_OK;
    if (k < 0 || k > MOE_MAX_K)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda moe_combine: k=%d", k);
    moe_sum_launch(cuda_stream(be), out, y, ids, T, k, D, 1);
    CUDA_LAUNCHED("moe_combine");
    return DSV4_OK;
}

enum dsv4_err
cuda_moe_combine(struct dsv4_backend *be, float *out, const float *y, const int32_t *ids,
                 int T, int k, int D)
{
    return moe_combine_any(be, out, y, ids, T, k, D);
}

enum dsv4_err
cuda_moe_combine16(struct dsv4_backend *be, float *out, const uint16_t *y, const int32_t *ids,
                   int T, int k, int D)
{
    return moe_combine_any(be, out, y, ids, T, k, D);
}
