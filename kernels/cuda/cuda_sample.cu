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
 * id asc) keys, which is cpu_topk's order; then one thread per row runs
 * steps 4-5 of the algorithm sequentially in candidate order, in double, as
 * the CPU does.  The argmax and maximum are the CPU's (order-free); Σ exp
 * for the log-probability is a tree of partial sums (a different double
 * summation order than the CPU's, invisible after the rounding to float but
 * for rare last-bit cases).
 */
#include "kernels/cuda/cuda.cuh"

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
    float bv = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;

    sample_chunk(V, c, &lo, &hi);
    for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS) {
        float v = l[i];

        if (cu_ranks_before(v, i, bv, bi))
            bv = v, bi = i;
        if (temp != 0.0f) {
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

/* The row's argmax (lowest id on ties; 0 when l[0] is NaN or nothing
 * compares, as the CPU's argmax) from its chunks' (order-free). */
static __device__ __forceinline__ int
sample_row_argmax(const struct chunk_stats *cs, const float *l)
{
    float bv = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;

    for (int c = 0; c < SAMPLE_CHUNKS; c++)
        if (cu_ranks_before(cs[c].max, cs[c].arg, bv, bi))
            bv = cs[c].max, bi = cs[c].arg;
    if (isnan(l[0]) || bi == 0x7fffffff)
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
        s_max = l[sample_row_argmax(cs + r * SAMPLE_CHUNKS, l)];
    __syncthreads();
    sample_chunk(V, c, &lo, &hi);
    for (int i = lo + threadIdx.x; i < hi; i += SAMPLE_THREADS)
        sum += exp((double)(l[i] - s_max));
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

    st.argmax = sample_row_argmax(cs, l);
    st.max = l[st.argmax];
    st.sum = 0.0;
    for (int c = 0; c < SAMPLE_CHUNKS; c++)
        st.sum += cs[c].sum;
    return st;
}

static __device__ uint64_t
cu_splitmix64(uint64_t x)
{
    uint64_t z = x + 0x9E3779B97F4A7C15ull;

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Steps 2-5 of cpu_sample.c for one row (temperature > 0). */
static __device__ int
sample_draw(const float *z, const unsigned long long *sorted,
            const struct dsv4_sample_params *sp, int V)
{
    int n, best = 0;
    float zmax;
    double total = 0.0, target, cum;
    uint64_t bits;

    if ((sp->top_k > 0 && sp->top_k < V) || sp->top_p < 1.0f)
        n = sp->top_k > 0 && sp->top_k < V ? sp->top_k : V;
    else
        sorted = NULL, n = V;
#define CAND(i) (sorted != NULL ? (int)(sorted[i] & 0xffffffffu) : (i))
    for (int i = 1; i < V; i++)
        if (z[i] > z[best])
            best = i;
    zmax = z[best];
    for (int i = 0; i < n; i++)
        total += exp((double)(z[CAND(i)] - zmax));
    if (sp->top_p < 1.0f) {
        double lim = (double)sp->top_p * total;
        int keep = 0;

        cum = 0.0;
        while (keep < n) {
            cum += exp((double)(z[CAND(keep)] - zmax));
            keep++;
            if (cum >= lim)
                break;
        }
        n = keep;
        total = cum;
    }
    bits = cu_splitmix64(sp->seed ^ (sp->step * 0xD1B54A32D192ED03ull));
    target = (double)(bits >> 11) * 0x1p-53 * total;
    cum = 0.0;
    for (int i = 0; i < n; i++) {
        cum += exp((double)(z[CAND(i)] - zmax));
        if (target < cum)
            return CAND(i);
    }
    return CAND(n - 1);
#undef CAND
}

static __global__ void
sample_final_kernel(int32_t *out_ids, float *out_logprob, const struct chunk_stats *cs,
                    const float *z, const unsigned long long *sorted, const float *logits,
                    const struct dsv4_sample_params *params, int n, int V)
{
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    int id;
    struct row_stats st;

    if (r >= n)
        return;
    st = sample_row_stats(cs + (int64_t)r * SAMPLE_CHUNKS, logits + (int64_t)r * V);
    if (params[r].temperature == 0.0f)
        id = st.argmax;
    else
        id = sample_draw(z + (int64_t)r * V, sorted != NULL ? sorted + (int64_t)r * V : NULL,
                         &params[r], V);
    out_ids[r] = id;
    if (out_logprob != NULL)
        out_logprob[r] = (float)((double)logits[(int64_t)r * V + id] -
                                 ((double)st.max + log(st.sum)));
}

enum dsv4_err
cuda_sample(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob, const float *logits,
            const struct dsv4_sample_params *params, int n, int V)
{
    cudaStream_t s = cuda_stream(be);
    int any_temp = 0, any_sort = 0;
    size_t pb, sb, zb, kb, tb = 0;
    char *base;
    unsigned long long *kin = NULL, *kout = NULL;

    if (V < 1)
        return dsv4_err_set(DSV4_ERR_INVAL, "sample: V=%d", V);
    for (int r = 0; r < n; r++) {
        const struct dsv4_sample_params *sp = &params[r];

        if (!(sp->temperature >= 0.0f) || !isfinite(sp->temperature) || sp->top_k < 0 ||
            !(sp->top_p > 0.0f && sp->top_p <= 1.0f))
            return dsv4_err_set(DSV4_ERR_INVAL, "sample: row %d: bad parameters "
                                "(temperature %g, top_k %d, top_p %g)", r,
                                (double)sp->temperature, sp->top_k, (double)sp->top_p);
        if (sp->temperature != 0.0f) {
            any_temp = 1;
            if ((sp->top_k > 0 && sp->top_k < V) || sp->top_p < 1.0f)
                any_sort = 1;
        }
    }
    if (n <= 0)
        return DSV4_OK;
    pb = cuda_align((size_t)n * sizeof(*params));
    sb = cuda_align((size_t)n * SAMPLE_CHUNKS * sizeof(struct chunk_stats));
    zb = any_temp ? cuda_align((size_t)n * V * sizeof(float)) : 0;
    kb = any_sort ? cuda_align((size_t)n * V * sizeof(unsigned long long)) : 0;
    if (any_sort)
        tb = cuda_sort_temp_bytes(n, V);
    base = (char *)cuda_scratch(be, pb + sb + zb + 2 * kb + tb);
    if (base == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "sample: no scratch (n=%d V=%d)", n, V);
    if (any_sort) {
        kin = (unsigned long long *)(base + pb + sb + zb);
        kout = (unsigned long long *)(base + pb + sb + zb + kb);
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
        enum dsv4_err e = cuda_sort_segments(be, kout, kin, n, V, base + pb + sb + zb + 2 * kb);

        if (e != DSV4_OK)
            return e;
    }
    sample_final_kernel<<<cuda_blocks(n, 64), 64, 0, s>>>(
        out_ids, out_logprob, (const struct chunk_stats *)(base + pb),
        (const float *)(base + pb + sb), kout, logits,
        (const struct dsv4_sample_params *)base, n, V);
    CUDA_LAUNCHED("sample_final");
    return DSV4_OK;
}
