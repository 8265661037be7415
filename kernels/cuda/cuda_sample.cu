/*
 * cuda_sample.cu — token sampling with cpu_sample.c's algorithm (greedy,
 * temperature, top-k, top-p, the (seed, step) counter-based draw), and the
 * segmented key sort it shares with indexer_topk.
 *
 * Per call: SAMPLE_CHUNKS blocks per row (each a contiguous chunk of the
 * vocabulary) find their chunk's argmax (lowest id on ties) and, for
 * sampled rows, write z = l / temperature and its sort keys; a second
 * launch of the same grid takes the row's argmax and maximum from the
 * chunks' and sums exp(l - max) over its chunk in double; the final kernel
 * adds the chunks' sums in chunk order (log-probability).  (One block per
 * row did all of it before: 108 us a step for the 129,280 double exps on
 * one SM, perf.md run 30.)  The rows that need a candidate order (top_k in
 * [1, V) or top_p < 1) are sorted by CUB's segmented radix sort on (z desc,
 * id asc) keys, which is cpu_topk's order.  Steps 4-5 of the algorithm sum
 * the weights in runs and spans (kernels/sample_order.h, the CPU's code
 * too): sample_runs_kernel forms every run's sum (a thread a run) and
 * every span's (a block a span), and one warp per row then draws as
 * so_draw on those sums, recomputing at most one run's weights: its 32
 * lanes walk 32 spans, runs or positions at once, each lane adding the
 * values before its own in order, so the draw is so_draw's bit for bit
 * (sw_draw; until run 37 one thread walked, 25-38 us a step).  (One
 * thread per row made one running sum over all candidates before run 36:
 * 41 ms a step at temperature 1.)  The argmax and maximum are the CPU's (order-free); Σ exp
 * for the log-probability is a tree of partial sums (a different double
 * summation order than the CPU's, invisible after the rounding to float but
 * for rare last-bit cases).
 *
 * sample_top (the top log-probabilities a client asks for) runs on the same
 * SAMPLE_CHUNKS chunks of a row: top_chunk_kernel finds each chunk's argmax
 * (as sample_max_kernel) and its DSV4_TOP_MAX best cu_rank_keys (the keys
 * are unique, ids in the low bits: (logit desc, id asc), NaN as -inf,
 * cpu_topk's order): every thread keeps a sorted list in registers, a
 * warp's lists merge by rounds of a warp minimum over their heads (shuffles
 * only), the warps' lists in warp 0 the same way; sample_sum_kernel then
 * sums the chunks as for sampling, and top_final_kernel merges the chunks'
 * lists (a warp a row) and takes the row's log-sum-exp from sample_row_stats,
 * so a greedy token's entry has its logprob bit for bit.  (Run 90: one block
 * a row scanned it all, with the double exps on one SM: 0.45 ms a step at
 * n_top 20.)
 */
#include "kernels/cuda/cuda.cuh"
#include "kernels/sample_order.h"

#include <math.h>

#include <cub/device/device_segmented_radix_sort.cuh>

/* --- segmented sort ---------------------------------------------------------------- */

static __global__ void
seg_offsets_kernel(int *off, int n_seg, int seg_len)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;

    if (i <= n_seg)
        off[i] = i * seg_len;
}

size_t
cuda_sort_temp_bytes(int n_seg, int seg_len)
{
    size_t tb = 0;

    cub::DeviceSegmentedRadixSort::SortKeys(NULL, tb, (const unsigned long long *)NULL,
                                            (unsigned long long *)NULL, n_seg * seg_len, n_seg,
                                            (const int *)NULL, (const int *)NULL, 0, 64);
    return cuda_align((size_t)(n_seg + 1) * sizeof(int)) + cuda_align(tb);
}

enum dsv4_err
cuda_sort_segments(struct dsv4_backend *be, unsigned long long *keys_out,
                   const unsigned long long *keys_in, int n_seg, int seg_len, void *temp)
{
    size_t ob = cuda_align((size_t)(n_seg + 1) * sizeof(int));
    size_t tb = cuda_sort_temp_bytes(n_seg, seg_len) - ob;
    int *off = (int *)temp;

    if ((int64_t)n_seg * seg_len > 0x7fffffff)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda sort: %d x %d keys", n_seg, seg_len);
    seg_offsets_kernel<<<cuda_blocks(n_seg + 1, 256), 256, 0, cuda_stream(be)>>>(off, n_seg,
                                                                                seg_len);
    CUDA_LAUNCHED("seg_offsets");
    CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeys((char *)temp + ob, tb, keys_in, keys_out,
                                                     n_seg * seg_len, n_seg, off, off + 1, 0,
                                                     64, cuda_stream(be)));
    return DSV4_OK;
}

/* --- sampling ---------------------------------------------------------------------- */

#define SAMPLE_THREADS 256
#define SAMPLE_CHUNKS 32   /* blocks per row */

/* Per-row results of the first pass. */
struct row_stats {
    int32_t argmax;
    float max;
    double sum;   /* Σ exp((double)(l - max)) */
};

/* One chunk's partial results. */
struct chunk_stats {
    float max;     /* the chunk's largest value (-inf when empty) */
    int32_t arg;   /* its lowest id (INT_MAX when none) */
    double sum;    /* Σ exp((double)(l - row max)) over the chunk */
};

/* [lo, hi) of chunk c of a row of V. */
static __device__ __forceinline__ void
sample_chunk(int V, int c, int *lo, int *hi)
{
    int per = (V + SAMPLE_CHUNKS - 1) / SAMPLE_CHUNKS;

    *lo = min(V, c * per);
    *hi = min(V, *lo + per);
}

/* grid (n, SAMPLE_CHUNKS): the chunk's argmax into cs; z and keys of
 * sampled rows. */
static __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_max_kernel(struct chunk_stats *cs, float *z, unsigned long long *keys,
                  const float *logits, const struct dsv4_sample_params *params, int V,
                  int want_keys)
{
    __shared__ float rv[SAMPLE_THREADS / 32];
    __shared__ int ri[SAMPLE_THREADS / 32];
    int64_t r = blockIdx.x;
    int c = blockIdx.y, lo, hi;
    const float *l = logits + r * V;
    const float temp = params[r].temperature;
    const int greedy = so_greedy(&params[r]);
    float bv = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;

    sample_chunk(V, c, &lo, &hi);
    for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS) {
        float v = l[i];

        if (cu_ranks_before(v, i, bv, bi))
            bv = v, bi = i;
        if (!greedy) {
            float zi = v / temp;

            z[r * V + i] = zi;
            if (want_keys)
                keys[r * V + i] = cu_rank_key(zi, i);
        }
    }
    cu_block_best(bv, bi, rv, ri);
    if (threadIdx.x == 0) {
        cs[r * SAMPLE_CHUNKS + c].max = bv;
        cs[r * SAMPLE_CHUNKS + c].arg = bi;
    }
}

/* The row's argmax (lowest id on ties, NaN never: cu_ranks_before; 0 when
 * every value is NaN, as the CPU's argmax) from its chunks' (order-free). */
static __device__ __forceinline__ int
sample_row_argmax(const struct chunk_stats *cs)
{
    float bv = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;

    for (int c = 0; c < SAMPLE_CHUNKS; c++)
        if (cu_ranks_before(cs[c].max, cs[c].arg, bv, bi))
            bv = cs[c].max, bi = cs[c].arg;
    if (bi == 0x7fffffff)
        bi = 0;
    return bi;
}

/* grid (n, SAMPLE_CHUNKS): Σ exp(l - max) over the chunk into cs. */
static __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_sum_kernel(struct chunk_stats *cs, const float *logits, int V)
{
    __shared__ double rs[SAMPLE_THREADS / 32];
    __shared__ float s_max;
    int64_t r = blockIdx.x;
    int c = blockIdx.y, lo, hi;
    const float *l = logits + r * V;
    double sum = 0.0;

    if (threadIdx.x == 0)
        s_max = l[sample_row_argmax(cs + r * SAMPLE_CHUNKS)];
    __syncthreads();
    sample_chunk(V, c, &lo, &hi);
    for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS)
        sum += so_lw(l[i], s_max);
    for (int o = 16; o > 0; o /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x % 32 == 0)
        rs[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < SAMPLE_THREADS / 32; w++)
            sum += rs[w];
        cs[r * SAMPLE_CHUNKS + c].sum = sum;
    }
}

/* Row r's statistics from its chunks': argmax, max, Σ in chunk order. */
static __device__ struct row_stats
sample_row_stats(const struct chunk_stats *cs, const float *l)
{
    struct row_stats st;

    st.argmax = sample_row_argmax(cs);
    st.max = l[st.argmax];
    st.sum = 0.0;
    for (int c = 0; c < SAMPLE_CHUNKS; c++)
        st.sum += cs[c].sum;
    return st;
}

/* Row r's candidates (z, and its sorted keys when step 3 sorts them) with
 * zmax, no stored sums yet. */
static __device__ struct so_cands
sample_cands(const struct dsv4_sample_params *sp, const float *z,
             const unsigned long long *sorted, float zmax, int64_t r, int V)
{
    struct so_cands c;

    c.z = z + r * V;
    c.cand = NULL;
    c.keys = so_sorted(sp, V) ? sorted + r * V : NULL;
    c.q = c.d = NULL;
    c.zmax = zmax;
    c.n_cand = so_n_cand(sp, V);
    return c;
}

/*
 * grid (n rows, so_spans(V)), DSV4_SAMPLE_SPAN threads: for a sampled
 * row thread t sums the weights of run t of span y in order into q, and
 * thread 0 the span's run sums in order into d (runs past the row's
 * candidates add nothing).  Greedy rows leave at once.
 */
static __global__ void __launch_bounds__(DSV4_SAMPLE_SPAN)
sample_runs_kernel(double *q, double *d, const struct chunk_stats *cs, const float *z,
                   const unsigned long long *sorted, const float *logits,
                   const struct dsv4_sample_params *params, int V)
{
    __shared__ double qs[DSV4_SAMPLE_SPAN];
    __shared__ float s_zmax;
    int64_t r = blockIdx.x;
    int b = blockIdx.y * DSV4_SAMPLE_SPAN + threadIdx.x;
    const struct dsv4_sample_params *sp = &params[r];
    struct so_cands c;
    double v;

    if (so_greedy(sp))
        return;   /* the whole block */
    if (threadIdx.x == 0)   /* zmax: z at the row's argmax (z = l / temperature keeps the order) */
        s_zmax = z[r * V + sample_row_argmax(cs + r * SAMPLE_CHUNKS)];
    __syncthreads();
    c = sample_cands(sp, z, sorted, s_zmax, r, V);
    v = so_run(&c, b, c.n_cand);   /* 0 past the candidates */
    if (b < so_runs(V))
        q[r * so_runs(V) + b] = v;
    qs[threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;

        for (int t = 0; t < DSV4_SAMPLE_SPAN; t++)
            sum += qs[t];
        d[r * so_spans(V) + blockIdx.y] = sum;
    }
}

/* --- the draw by one warp ------------------------------------------------------------ */

/*
 * so_find, so_mass and so_draw (sample_order.h) with the 32 lanes of a warp
 * walking 32 spans, runs or positions at once: lane j of a group of 32
 * values adds the group's values before its own to the running sum one by
 * one in order (shuffles), so every partial sum it compares is the
 * sequential walk's, bit for bit, and the first lane whose test passes
 * (ballot) is the walk's stop.  The same position as so_find for every
 * input; every lane returns it.
 */
#define SW_ALL 0xffffffffu

/* base + the values of lanes 0 .. lane - 1, added in lane order. */
static __device__ double
sw_prefix(double base, double v, int lane)
{
    double e = base;

#pragma unroll
    for (int j = 0; j < 31; j++) {
        double o = __shfl_sync(SW_ALL, v, j);

        if (j < lane)
            e += o;
    }
    return e;
}

/* so_mass by the warp. */
static __device__ double
sw_mass(const struct so_cands *c, int n)
{
    int lane = threadIdx.x & 31, ns = so_spans(n);
    double m = 0.0;

    for (int s0 = 0; s0 < ns; s0 += 32) {
        int s = s0 + lane, last = ns - s0 < 32 ? ns - s0 - 1 : 31;
        double d = s < ns ? so_span(c, s, n) : 0.0;

        m = __shfl_sync(SW_ALL, sw_prefix(m, d, lane) + d, last);
    }
    return m;
}

/* so_find by the warp. */
static __device__ int
sw_find(const struct so_cands *c, int n, double t, int ge)
{
    int lane = threadIdx.x & 31, ns = so_spans(n);
    double e = 0.0;

    for (int s0 = 0; s0 < ns; s0 += 32) {
        int s = s0 + lane;
        double d = s < ns ? so_span(c, s, n) : 0.0, es = sw_prefix(e, d, lane);
        unsigned hit = __ballot_sync(SW_ALL, s < ns && so_pass(es + d, t, ge));

        if (hit == 0) {
            e = __shfl_sync(SW_ALL, es + d, 31);   /* a partial group is the last */
            continue;
        }
        /* span sf: its runs from G = the spans' mass before it */
        int sf = s0 + __ffs(hit) - 1;
        int p0 = sf * SO_SPAN_POS, p1 = p0 + SO_SPAN_POS < n ? p0 + SO_SPAN_POS : n;
        double g = __shfl_sync(SW_ALL, es, __ffs(hit) - 1);

        for (int r0 = p0; r0 < p1; r0 += 32 * DSV4_SAMPLE_RUN) {
            int p = r0 + lane * DSV4_SAMPLE_RUN;
            double q = p < p1 ? so_run(c, p / DSV4_SAMPLE_RUN, n) : 0.0, gs = sw_prefix(g, q, lane);
            unsigned rh = __ballot_sync(SW_ALL, p < p1 && so_pass(gs + q, t, ge));

            if (rh == 0) {
                g = __shfl_sync(SW_ALL, gs + q, 31);
                continue;
            }
            /* run at pr: its weights from G */
            int pr = r0 + (__ffs(rh) - 1) * DSV4_SAMPLE_RUN;
            int len = p1 - pr < DSV4_SAMPLE_RUN ? p1 - pr : DSV4_SAMPLE_RUN;
            double gr = __shfl_sync(SW_ALL, gs, __ffs(rh) - 1);
            double w = lane < len ? so_w(c, pr + lane) : 0.0, gi = sw_prefix(gr, w, lane) + w;
            unsigned ph = __ballot_sync(SW_ALL, lane < len && so_pass(gi, t, ge));

            return ph != 0 ? pr + __ffs(ph) - 1 : pr + len - 1;
        }
        return p1 - 1;
    }
    return n - 1;
}

/* so_draw by the warp. */
static __device__ int
sw_draw(const struct so_cands *c, const struct dsv4_sample_params *sp)
{
    int n = c->n_cand;

    if (sp->top_p < 1.0f)
        n = sw_find(c, n, (double)sp->top_p * sw_mass(c, n), 1) + 1;
    return so_cand(c, sw_find(c, n, so_u(sp) * sw_mass(c, n), 0));
}

static __global__ void
sample_final_kernel(int32_t *out_ids, float *out_logprob, const struct chunk_stats *cs,
                    const float *z, const unsigned long long *sorted, const double *q,
                    const double *d, const float *logits,
                    const struct dsv4_sample_params *params, int n, int V)
{
    int r = blockIdx.x;   /* a warp a row (the draw by all its lanes, sw_draw) */
    int id;
    struct row_stats st;

    if (r >= n)
        return;
    st = sample_row_stats(cs + (int64_t)r * SAMPLE_CHUNKS, logits + (int64_t)r * V);
    if (so_greedy(&params[r])) {
        id = st.argmax;
    } else {
        const struct dsv4_sample_params *sp = &params[r];
        struct so_cands c = sample_cands(sp, z, sorted, z[(int64_t)r * V + st.argmax], r, V);

        c.q = q + (int64_t)r * so_runs(V);
        c.d = d + (int64_t)r * so_spans(V);
        id = sw_draw(&c, sp);
    }
    if (threadIdx.x != 0)
        return;
    out_ids[r] = id;
    if (out_logprob != NULL)
        out_logprob[r] = (float)so_logprob(logits[(int64_t)r * V + id], st.max, st.sum);
}

enum dsv4_err
cuda_sample(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob, const float *logits,
            const struct dsv4_sample_params *params, int n, int V)
{
    cudaStream_t s = cuda_stream(be);
    int any_temp = 0, any_sort = 0;
    size_t pb, sb, zb, kb, tb = 0, qb, db;
    double *q = NULL, *d = NULL;
    char *base;
    unsigned long long *kin = NULL, *kout = NULL;
    enum dsv4_err e = so_check(params, n, V);

    if (e != DSV4_OK || n <= 0)
        return e;
    for (int r = 0; r < n; r++)
        if (!so_greedy(&params[r])) {
            any_temp = 1;
            any_sort = any_sort || so_sorted(&params[r], V);
        }
    pb = cuda_align((size_t)n * sizeof(*params));
    sb = cuda_align((size_t)n * SAMPLE_CHUNKS * sizeof(struct chunk_stats));
    zb = any_temp ? cuda_align((size_t)n * V * sizeof(float)) : 0;
    kb = any_sort ? cuda_align((size_t)n * V * sizeof(unsigned long long)) : 0;
    if (any_sort)
        tb = cuda_sort_temp_bytes(n, V);
    tb = cuda_align(tb);
    qb = any_temp ? cuda_align((size_t)n * so_runs(V) * sizeof(double)) : 0;
    db = any_temp ? cuda_align((size_t)n * so_spans(V) * sizeof(double)) : 0;
    base = (char *)cuda_scratch(be, pb + sb + zb + 2 * kb + tb + qb + db);
    if (base == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "sample: no scratch (n=%d V=%d)", n, V);
    if (any_sort) {
        kin = (unsigned long long *)(base + pb + sb + zb);
        kout = (unsigned long long *)(base + pb + sb + zb + kb);
    }
    if (any_temp) {
        q = (double *)(base + pb + sb + zb + 2 * kb + tb);
        d = (double *)(base + pb + sb + zb + 2 * kb + tb + qb);
    }
    CUDA_TRY(cudaMemcpyAsync(base, params, (size_t)n * sizeof(*params), cudaMemcpyHostToDevice,
                             s));
    sample_max_kernel<<<dim3((unsigned)n, SAMPLE_CHUNKS), SAMPLE_THREADS, 0, s>>>(
        (struct chunk_stats *)(base + pb), (float *)(base + pb + sb), kin, logits,
        (const struct dsv4_sample_params *)base, V, any_sort);
    CUDA_LAUNCHED("sample_max");
    sample_sum_kernel<<<dim3((unsigned)n, SAMPLE_CHUNKS), SAMPLE_THREADS, 0, s>>>(
        (struct chunk_stats *)(base + pb), logits, V);
    CUDA_LAUNCHED("sample_sum");
    if (any_sort) {
        e = cuda_sort_segments(be, kout, kin, n, V, base + pb + sb + zb + 2 * kb);
        if (e != DSV4_OK)
            return e;
    }
    if (any_temp) {
        sample_runs_kernel<<<dim3((unsigned)n, (unsigned)so_spans(V)), DSV4_SAMPLE_SPAN, 0,
                             s>>>(q, d, (const struct chunk_stats *)(base + pb),
                                  (const float *)(base + pb + sb), kout, logits,
                                  (const struct dsv4_sample_params *)base, V);
        CUDA_LAUNCHED("sample_runs");
    }
    sample_final_kernel<<<(unsigned)n, 32, 0, s>>>(
        out_ids, out_logprob, (const struct chunk_stats *)(base + pb),
        (const float *)(base + pb + sb), kout, q, d, logits,
        (const struct dsv4_sample_params *)base, n, V);
    CUDA_LAUNCHED("sample_final");
    return DSV4_OK;
}

/* --- top log-probabilities (sample_top) ---------------------------------------------- */

#define TOP_NONE 0xffffffffffffffffull   /* above every cu_rank_key */

/* Insert key into the ascending list L[DSV4_TOP_MAX] (registers: every
 * index is a constant once unrolled), dropping its largest. */
static __device__ __forceinline__ void
top_insert(unsigned long long (&L)[DSV4_TOP_MAX], unsigned long long key)
{
    if (key >= L[DSV4_TOP_MAX - 1])
        return;
    L[DSV4_TOP_MAX - 1] = key;
#pragma unroll
    for (int j = DSV4_TOP_MAX - 1; j > 0; j--) {
        if (L[j] < L[j - 1]) {
            unsigned long long t = L[j];

            L[j] = L[j - 1];
            L[j - 1] = t;
        }
    }
}

/* The k smallest keys of the warp's lanes' ascending lists, in order, into
 * out[0 .. k) (lane 0 writes; out may be shared or global).  The lists are
 * consumed.  The keys are unique, so one lane's head wins a round. */
static __device__ __forceinline__ void
top_warp_merge(unsigned long long (&L)[DSV4_TOP_MAX], int k, unsigned long long *out)
{
    for (int j = 0; j < k; j++) {
        unsigned long long m = L[0];

        for (int o = 16; o > 0; o /= 2) {
            unsigned long long w = __shfl_xor_sync(0xffffffffu, m, o);

            m = w < m ? w : m;
        }
        if (L[0] == m) {
#pragma unroll
            for (int t = 0; t < DSV4_TOP_MAX - 1; t++)
                L[t] = L[t + 1];
            L[DSV4_TOP_MAX - 1] = TOP_NONE;
        }
        if ((threadIdx.x & 31) == 0)
            out[j] = m;
    }
}

/* grid (n, SAMPLE_CHUNKS), SAMPLE_THREADS: chunk c's argmax into cs (as
 * sample_max_kernel) and, for rows that ask, its k = min(n_top, V) best keys
 * in order into ck[(r * SAMPLE_CHUNKS + c) * DSV4_TOP_MAX ...]. */
static __global__ void __launch_bounds__(SAMPLE_THREADS)
top_chunk_kernel(struct chunk_stats *cs, unsigned long long *ck, const float *logits,
                 const struct dsv4_sample_params *params, int V)
{
    __shared__ float rv[SAMPLE_THREADS / 32];
    __shared__ int ri[SAMPLE_THREADS / 32];
    __shared__ unsigned long long wl[SAMPLE_THREADS / 32][DSV4_TOP_MAX];
    int64_t r = blockIdx.x;
    int c = blockIdx.y, lo, hi, k = min(params[r].n_top, V), w = threadIdx.x / 32;
    const float *l = logits + r * V;
    float bv = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    unsigned long long L[DSV4_TOP_MAX];

#pragma unroll
    for (int j = 0; j < DSV4_TOP_MAX; j++)
        L[j] = TOP_NONE;
    sample_chunk(V, c, &lo, &hi);
    for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS) {
        float v = l[i];

        if (cu_ranks_before(v, i, bv, bi))
            bv = v, bi = i;
        if (k > 0)
            top_insert(L, cu_rank_key(v, i));
    }
    cu_block_best(bv, bi, rv, ri);   /* (synchronises the block) */
    if (threadIdx.x == 0) {
        cs[r * SAMPLE_CHUNKS + c].max = bv;
        cs[r * SAMPLE_CHUNKS + c].arg = bi;
    }
    if (k <= 0)
        return;   /* the whole block */
    top_warp_merge(L, k, wl[w]);
    __syncthreads();
    if (w != 0)
        return;
#pragma unroll
    for (int j = 0; j < DSV4_TOP_MAX; j++)
        L[j] = TOP_NONE;
    for (int i = threadIdx.x; i < (SAMPLE_THREADS / 32) * k; i += 32)
        top_insert(L, wl[i / k][i % k]);
    top_warp_merge(L, k, ck + (r * SAMPLE_CHUNKS + c) * DSV4_TOP_MAX);
}

/* grid n, a warp a row that asks: the chunks' lists merged (lane c holds
 * chunk c's), the log-probabilities against sample_row_stats's max and sum
 * (sample_final_kernel's expression). */
static __global__ void
top_final_kernel(int32_t *out_ids, float *out_logprob, const struct chunk_stats *cs,
                 const unsigned long long *ck, const float *logits,
                 const struct dsv4_sample_params *params, int V)
{
    __shared__ unsigned long long best[DSV4_TOP_MAX];
    int64_t r = blockIdx.x;
    int k = min(params[r].n_top, V), lane = threadIdx.x;
    const float *l = logits + r * V;
    unsigned long long L[DSV4_TOP_MAX];
    struct row_stats st;

    if (k <= 0)
        return;
#pragma unroll
    for (int j = 0; j < DSV4_TOP_MAX; j++)
        L[j] = j < k && lane < SAMPLE_CHUNKS ? ck[(r * SAMPLE_CHUNKS + lane) * DSV4_TOP_MAX + j]
                                             : TOP_NONE;
    top_warp_merge(L, k, best);
    __syncwarp();
    st = sample_row_stats(cs + r * SAMPLE_CHUNKS, l);
    for (int j = lane; j < k; j += 32) {
        int32_t id = (int32_t)(best[j] & 0xffffffffu);

        out_ids[r * DSV4_TOP_MAX + j] = id;
        out_logprob[r * DSV4_TOP_MAX + j] =
            (float)so_logprob(l[id], st.max, st.sum);
    }
}

enum dsv4_err
cuda_sample_top(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob,
                const float *logits, const struct dsv4_sample_params *params, int n, int V)
{
    cudaStream_t s = cuda_stream(be);
    size_t pb, sb, kb;
    char *base;
    int any = 0;
    enum dsv4_err e = so_check_top(params, n, V);

    if (e != DSV4_OK || n <= 0)
        return e;
    for (int r = 0; r < n; r++)
        any = any || params[r].n_top > 0;
    if (!any)
        return DSV4_OK;
    pb = cuda_align((size_t)n * sizeof(*params));
    sb = cuda_align((size_t)n * SAMPLE_CHUNKS * sizeof(struct chunk_stats));
    kb = cuda_align((size_t)n * SAMPLE_CHUNKS * DSV4_TOP_MAX * sizeof(unsigned long long));
    base = (char *)cuda_scratch(be, pb + sb + kb);
    if (base == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "sample_top: no scratch (n=%d)", n);
    CUDA_TRY(cudaMemcpyAsync(base, params, (size_t)n * sizeof(*params), cudaMemcpyHostToDevice,
                             s));
    top_chunk_kernel<<<dim3((unsigned)n, SAMPLE_CHUNKS), SAMPLE_THREADS, 0, s>>>(
        (struct chunk_stats *)(base + pb), (unsigned long long *)(base + pb + sb), logits,
        (const struct dsv4_sample_params *)base, V);
    CUDA_LAUNCHED("top_chunk");
    sample_sum_kernel<<<dim3((unsigned)n, SAMPLE_CHUNKS), SAMPLE_THREADS, 0, s>>>(
        (struct chunk_stats *)(base + pb), logits, V);
    CUDA_LAUNCHED("sample_sum (top)");
    top_final_kernel<<<(unsigned)n, 32, 0, s>>>(
        out_ids, out_logprob, (const struct chunk_stats *)(base + pb),
        (const unsigned long long *)(base + pb + sb), logits,
        (const struct dsv4_sample_params *)base, V);
    CUDA_LAUNCHED("top_final");
    return DSV4_OK;
}
