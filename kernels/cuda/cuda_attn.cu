/*
 * cuda_attn.cu — the attention-side ops: streaming compressor, indexer
 * scores with top-k, sparse attention with sink; numerics and orders of
 * cpu_attn.c (see its header for the algorithms).
 *
 * compress: one thread per channel runs every row in order (the state of a
 *   channel is touched by that thread only).
 * indexer_topk: an 8-thread group per (row, entry) computes the score and
 *   writes a 64-bit sort key (score desc, index asc); each row's keys are
 *   sorted (cuda_sort_segments) and the first K give sel; a row with at most
 *   K valid entries takes them in index order (without q: only that).
 * attention: the candidate key rows of each row are listed first (one thread
 *   per row, in the CPU's candidate order); then one block per (row, head)
 *   computes the scores (8-thread groups), the max, the exponentials, the
 *   denominator (one thread, candidate order) and the weighted sums (one
 *   thread per output dimension, candidate order).
 * These are the exact kernels; with the fast switch on, attention and
 * indexer_topk call fast_attention.cu / fast_indexer.cu where those apply.
 */
#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda_gemm_grouped.h"   /* DSV4_CUDA_BLAS_MIN_T, cuda_fast_gemm_grouped_ok */

/* --- compress ------------------------------------------------------------------------ */

static __global__ void
compress_kernel(float *entries, float *state_kv, float *state_z, const float *a,
                const float *z, const float *ape, const int32_t *slot, const int32_t *pos,
                const int32_t *emit, int T, int r, int d, int c)
{
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    int64_t cd = (int64_t)c * d, pool = (int64_t)c * r * cd;
    int ns = c * r;

    if (ch >= d)
        return;
    for (int t = 0; t < T; t++) {
        float *kv = state_kv + slot[t] * pool;
        float *zs = state_z + slot[t] * pool;
        int p = pos[t], jj = p % r;
        int64_t dst = (int64_t)(c == 2 ? r + jj : jj) * cd;

        for (int h = 0; h < c; h++) {
            int64_t col = (int64_t)h * d + ch;

            kv[dst + col] = a[t * cd + col];
            zs[dst + col] = z[t * cd + col] + ape[jj * cd + col];
        }
        if (emit[t] >= 0) {
            float m = -__int_as_float(0x7f800000), den = 0.0f, acc = 0.0f;

            for (int k = 0; k < ns; k++) {
                int64_t col = (c == 2 && k >= r) ? d + ch : ch;
                float l = zs[k * cd + col];

                m = l > m ? l : m;
            }
            for (int k = 0; k < ns; k++) {
                int64_t col = (c == 2 && k >= r) ? d + ch : ch;

                den += cu_expf(zs[k * cd + col] - m);
            }
            for (int k = 0; k < ns; k++) {
                int64_t col = (c == 2 && k >= r) ? d + ch : ch;

                acc += (cu_expf(zs[k * cd + col] - m) / den) * kv[k * cd + col];
            }
            entries[(int64_t)emit[t] * d + ch] = acc;
        }
        if (c == 2 && jj == r - 1) {
            for (int k = 0; k < r; k++) {
                for (int h = 0; h < c; h++) {
                    int64_t col = (int64_t)h * d + ch;

                    kv[k * cd + col] = kv[(r + k) * cd + col];
                    zs[k * cd + col] = zs[(r + k) * cd + col];
                }
            }
        }
    }
}

enum dsv4_err
cuda_compress(struct dsv4_backend *be, float *entries, float *state_kv, float *state_z,
              const float *a, const float *z, const float *ape, const int32_t *slot,
              const int32_t *pos, const int32_t *emit, int T, int r, int d)
{
    int c = r == 4 ? 2 : 1;

    if (r < 1 || c * r > 256 || d < 1)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda compress: r=%d d=%d", r, d);
    if (T <= 0)
        return DSV4_OK;
    if (cuda_st(be)->fast_kernels)   /* fast_attn.cu */
        return cuda_fast_compress(be, entries, state_kv, state_z, a, z, ape, slot, pos, emit,
                                  T, r, d);
    compress_kernel<<<cuda_blocks(d, 64), 64, 0, cuda_stream(be)>>>(
        entries, state_kv, state_z, a, z, ape, slot, pos, emit, T, r, d, c);
    CUDA_LAUNCHED("compress");
    return DSV4_OK;
}

/* --- indexer_topk ---------------------------------------------------------------------- */

static __device__ __forceinline__ int
idx_n_valid(const int32_t *pos, int t, int ratio, int cap)
{
    int n = (pos[t] + 1) / ratio;

    return n < cap ? n : cap;
}

/* keys[t, e] for e < cap: the score's sort key, or ~0 past n_valid */
static __global__ void
idx_score_kernel(unsigned long long *keys, const float *q, const float *w, const float *kpool,
                 const int32_t *pages, const int32_t *slot, const int32_t *pos, int T, int nh, int dI, int cap,
                 int ratio, int ref)
{
    int64_t it = blockIdx.x * (int64_t)(blockDim.x / 8) + threadIdx.x / 8;
    int l8 = threadIdx.x % 8;
    int64_t itc = it < (int64_t)T * cap ? it : (int64_t)T * cap - 1;
    int t = (int)(itc / cap), e = (int)(itc % cap);
    int nv = idx_n_valid(pos, t, ratio, cap);
    int ec = e < nv ? e : 0;
    const float *qt = q + (int64_t)t * nh * dI, *wt = w + (int64_t)t * nh;
    const float *k = kpool + cu_pool_row(pages, cap, slot[t], ec) * dI;
    float acc = 0.0f;

    for (int h = 0; h < nh; h++) {
        float dot = cu_dot8(qt + (int64_t)h * dI, k, dI, l8);

        if (ref) {
            dot = cu_bf16_round(dot);
            acc += cu_bf16_round((dot > 0.0f ? dot : 0.0f) * wt[h]);
        } else {
            acc += (dot > 0.0f ? dot : 0.0f) * wt[h];
        }
    }
    if (ref)
        acc = cu_bf16_round(acc);
    if (l8 == 0 && it == itc)
        keys[it] = e < nv ? cu_rank_key(acc, e) : ~0ull;
}

/* sel from the sorted keys; rows of at most K valid entries (every row
 * when sorted is NULL) take them in index order */
static __global__ void
idx_select_kernel(int32_t *sel, const unsigned long long *sorted, const int32_t *pos, int T,
                  int cap, int ratio, int K)
{
    int64_t it = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    int t = (int)(it / K), i = (int)(it % K), nv;

    if (t >= T)
        return;
    nv = idx_n_valid(pos, t, ratio, cap);
    sel[it] = i >= nv ? -1
              : nv <= K || sorted == NULL
                  ? i
                  : (int32_t)(sorted[(int64_t)t * cap + i] & 0xffffffffu);
}

enum dsv4_err
cuda_indexer_topk(struct dsv4_backend *be, int32_t *sel, const float *q, const float *w,
                  const float *keys, const int32_t *pages, const int32_t *slot,
                  const int32_t *pos, int T, int nh,
                  int dI, int cap, int ratio, int K)
{
    cudaStream_t s = cuda_stream(be);
    size_t kb, tb;
    unsigned long long *kin, *kout;
    enum dsv4_err e;
    char *base;

    if (ratio < 1 || K < 1)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda indexer_topk: ratio=%d K=%d", ratio, K);
    if (T <= 0)
        return DSV4_OK;
    if (cap <= 0 || q == NULL || w == NULL) {
        /* no entry can be valid (every pick -1), or (no q) each row takes
         * its valid entries, at most K (backend.h) */
        idx_select_kernel<<<cuda_blocks((int64_t)T * K, 256), 256, 0, s>>>(sel, NULL, pos, T,
                                                                           cap, ratio, K);
        CUDA_LAUNCHED("idx_select");
        return DSV4_OK;
    }
    if (cuda_st(be)->fast_kernels && cuda_fast_indexer_ok(q, keys, nh, dI, cap, K))
        return cuda_fast_indexer_topk(be, sel, q, w, keys, pages, slot, pos, T, nh, dI, cap,
                                      ratio, K);   /* fast_indexer.cu */
    kb = cuda_align((size_t)T * cap * sizeof(unsigned long long));
    tb = cuda_sort_temp_bytes(T, cap);
    base = (char *)cuda_scratch(be, 2 * kb + tb);
    if (base == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda indexer_topk: no scratch (T=%d cap=%d)", T,
                            cap);
    kin = (unsigned long long *)base;
    kout = (unsigned long long *)(base + kb);
    idx_score_kernel<<<cuda_blocks((int64_t)T * cap, 32), 256, 0, s>>>(
        kin, q, w, keys, pages, slot, pos, T, nh, dI, cap, ratio, be->numerics == DSV4_NUMERICS_REF);
    CUDA_LAUNCHED("idx_score");
    e = cuda_sort_segments(be, kout, kin, T, cap, base + 2 * kb);
    if (e != DSV4_OK)
        return e;
    idx_select_kernel<<<cuda_blocks((int64_t)T * K, 256), 256, 0, s>>>(sel, kout, pos, T, cap,
                                                                       ratio, K);
    CUDA_LAUNCHED("idx_select");
    return DSV4_OK;
}

/* --- attention ------------------------------------------------------------------------- */

/* Candidate key rows of row t in the CPU's order; n[t] their count. */
static __global__ void
attn_cand_kernel(const float **cand, int *n_cand, const float *kv, const float *ring,
                 const float *comp, const int32_t *pages, const int32_t *sel,
                 const int32_t *slot, const int32_t *pos, const int32_t *row0, const int32_t *pos0, int T, int Dh,
                 int win, int cap, int ratio, int K, int max_cand)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    int p, s, n = 0, u0;
    const float **c;

    if (t >= T)
        return;
    p = pos[t];
    s = slot[t];
    u0 = p - win + 1 > 0 ? p - win + 1 : 0;
    c = cand + (int64_t)t * max_cand;
    for (int u = u0; u <= p; u++) {
        if (u >= pos0[t])
            c[n++] = kv + (int64_t)(row0[t] + (u - pos0[t])) * Dh;
        else
            c[n++] = ring + ((int64_t)s * win + u % win) * Dh;
    }
    if (comp != NULL) {
        if (sel == NULL) {
            int ne = (p + 1) / ratio;

            ne = ne < cap ? ne : cap;
            for (int e = 0; e < ne; e++)
                c[n++] = comp + cu_pool_row(pages, cap, s, e) * Dh;
        } else {
            const int32_t *sl = sel + (int64_t)t * K;

            for (int i = 0; i < K; i++)
                if (sl[i] >= 0 && sl[i] < cap)
                    c[n++] = comp + cu_pool_row(pages, cap, s, sl[i]) * Dh;
        }
    }
    n_cand[t] = n;
}

#define ATTN_THREADS 256

/* One block per (row, head); sc: (T*H, max_cand) scratch. */
static __global__ void
attn_kernel(float *out, const float *q, const float *const *cand, const int *n_cand,
            const float *sink, float *sc, int H, int Dh, int max_cand, float scale)
{
    __shared__ float red[ATTN_THREADS / 32];
    __shared__ float s_m, s_den;
    int64_t th = blockIdx.x, t = th / H;
    int h = (int)(th % H), n = n_cand[t];
    const float *const *c = cand + t * max_cand;
    const float *qh = q + th * Dh;
    float *s = sc + th * max_cand;
    int g = threadIdx.x / 8, l8 = threadIdx.x % 8;
    float m = -__int_as_float(0x7f800000);

    /* scores: cpu_dot(cand, q) * scale, 32 candidates at a time */
    for (int c0 = 0; c0 < n; c0 += ATTN_THREADS / 8) {
        int ci = c0 + g < n ? c0 + g : n - 1;
        float v = cu_dot8(c[ci], qh, Dh, l8) * scale;

        if (l8 == 0 && c0 + g < n)
            s[ci] = v;
        if (c0 + g < n)
            m = fmaxf(m, v);
    }
    for (int o = 16; o > 0; o /= 2)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float mm = red[0];

        for (int i = 1; i < ATTN_THREADS / 32; i++)
            mm = fmaxf(mm, red[i]);
        s_m = mm;
    }
    __syncthreads();
    m = s_m;
    for (int i = threadIdx.x; i < n; i += ATTN_THREADS)
        s[i] = cu_expf(s[i] - m);
    __syncthreads();
    if (threadIdx.x == 0) {
        float den = 0.0f;

        for (int i = 0; i < n; i++)
            den += s[i];
        s_den = den + cu_expf(sink[h] - m);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < Dh; i += ATTN_THREADS) {
        float acc = 0.0f;

        for (int j = 0; j < n; j++)
            acc += s[j] * c[j][i];
        out[th * Dh + i] = cu_bf16_round(acc / s_den);
    }
}

enum dsv4_err
cuda_attention(struct dsv4_backend *be, float *out, const float *q, const float *kv,
               const float *ring, const float *comp, const int32_t *pages, const int32_t *sel,
               const float *sink, const int32_t *slot, const int32_t *pos, const int32_t *row0,
               const int32_t *pos0, int T, int H, int Dh, int win, int cap, int ratio, int K,
               float scale)
{
    const struct dsv4_attn a = {
        .out = out, .q = q, .kv = kv, .ring = ring, .comp = comp, .pages = pages, .sel = sel,
        .sink = sink, .slot = slot, .pos = pos, .row0 = row0, .pos0 = pos0, .T = T, .H = H,
        .Dh = Dh, .win = win, .cap = cap, .ratio = ratio, .K = K, .scale = scale, .fresh = 0,
        .q_held = 0,
    };

    return cuda_attention_unrope(be, &a, 0, 0, NULL);
}

/* attention with rd = 0, or attention_unrope: the fast kernels take the
 * inverse RoPE themselves (cuda_fast_attention), the exact ones are
 * followed by rope_kernel.  q16: q held as bf16 (cuda_q16_take, done by
 * the op that calls this).  outb, *wrote_b: cuda_fast_attention's (the
 * exact kernels write out: *wrote_b = 0). */
static enum dsv4_err
attention_unrope_run(struct dsv4_backend *be, const struct dsv4_attn *a, int off, int rd,
                     const float *freqs, int q16, uint16_t *outb, int *wrote_b)
{
    cudaStream_t s = cuda_stream(be);
    int T = a->T, H = a->H, Dh = a->Dh, max_cand;
    size_t cb, nb;
    char *base;

    if (a->win < 1 || (a->comp != NULL && a->sel == NULL && a->ratio < 1))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda attention: win=%d ratio=%d", a->win,
                            a->ratio);
    if (T <= 0 || H <= 0)
        return DSV4_OK;
    if (cuda_st(be)->fast_kernels &&
        cuda_fast_attention_ok(be, a->out, a->q, a->kv, a->ring, a->comp, H, Dh, a->win,
                               a->cap, a->ratio))
        return cuda_fast_attention(be, a->out, a->q, a->kv, a->ring, a->comp, a->pages, a->sel,
                                   a->sink, a->slot, a->pos, a->row0, a->pos0, T, H, Dh,
                                   a->win, a->cap, a->ratio, a->K, a->scale, off, rd,
                                   freqs, a->fresh, q16, outb, wrote_b);   /* fast_attention.cu */
    if (q16) {   /* the exact kernel reads fp32 */
        enum dsv4_err e = cuda_q16_widen(be, a->q, (int64_t)T * H * Dh);

        if (e != DSV4_OK)
            return e;
    }
    max_cand = a->win + (a->comp == NULL ? 0 : a->sel != NULL ? a->K : a->cap);
    cb = cuda_align((size_t)T * max_cand * sizeof(float *));
    nb = cuda_align((size_t)T * sizeof(int));
    base = (char *)cuda_scratch(be, cb + nb + (size_t)T * H * max_cand * sizeof(float));
    if (base == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda attention: no scratch");
    attn_cand_kernel<<<cuda_blocks(T, 64), 64, 0, s>>>(
        (const float **)base, (int *)(base + cb), a->kv, a->ring, a->comp, a->pages, a->sel,
        a->slot, a->pos, a->row0, a->pos0, T, Dh, a->win, a->cap, a->ratio, a->K, max_cand);
    CUDA_LAUNCHED("attn_cand");
    attn_kernel<<<(unsigned)((int64_t)T * H), ATTN_THREADS, 0, s>>>(
        a->out, a->q, (const float *const *)base, (const int *)(base + cb), a->sink,
        (float *)(base + cb + nb), H, Dh, max_cand, a->scale);
    CUDA_LAUNCHED("attention");
    return rd > 0 ? cuda_rope(be, a->out, a->pos, T, H, (int64_t)H * Dh, Dh, off, rd, freqs, 1)
                  : DSV4_OK;
}

enum dsv4_err
cuda_attention_unrope(struct dsv4_backend *be, const struct dsv4_attn *a, int off, int rd,
                      const float *freqs)
{
    int wrote_b;

    /* q as bf16 (linear_norm_rope) */
    return attention_unrope_run(be, a, off, rd, freqs, cuda_q16_take(be, a->q, a->q_held), NULL,
                                &wrote_b);
}

/* DSV4_CUDA_FD_B16=0: attention_out's decode form writes the attention's
 * fp32 output and converts it to bf16 for wo_a in its own launch. */
static struct cuda_switch fd_b16_sw = CUDA_SWITCH("DSV4_CUDA_FD_B16", 1);

enum dsv4_err
cuda_attention_out(struct dsv4_backend *be, const struct dsv4_attn *a, int off, int rd,
                   const float *freqs, float *u, const struct dsv4_linear *wo_a, int G)
{
    /* q as bf16 (linear_norm_rope): taken once, for whichever form runs */
    int q16 = cuda_q16_take(be, a->q, a->q_held);

    if (cuda_st(be)->fast_kernels && a->T >= DSV4_CUDA_BLAS_MIN_T && dsv4_cuda_blas_on() &&
        cuda_fast_gemm_grouped_ok(be, wo_a, a->T, G) &&
        cuda_fast_attention_ok(be, a->out, a->q, a->kv, a->ring, a->comp, a->H, a->Dh, a->win,
                               a->cap, a->ratio)) {
        enum dsv4_err e = cuda_fast_attention_out(be, a, off, rd, freqs, u, wo_a, G, q16);

        if (e != DSV4_ERR_NOTSUP)
            return e;
    }
    {
        uint16_t *xb = NULL;
        size_t xoff = 0;
        int wrote_b = 0;
        enum dsv4_err e;

        /* decode (the fast decode linear for wo_a, as cuda_linear_grouped
         * chooses it): the attention kernel writes wo_a's bf16 input into
         * that linear's scratch, after its own partials, so the linear
         * takes it without a conversion launch (the same values) */
        if (cuda_switch_on(&fd_b16_sw) && cuda_linear_grouped_decode(be, wo_a, a->T, G) &&
            (int64_t)G * wo_a->n_in == (int64_t)a->H * a->Dh) {
            char *base;

            xoff = cuda_align(cuda_fast_attention_outb_scratch(a->T, a->H, a->Dh));
            base = (char *)cuda_scratch(be, xoff + cuda_fast_linear_scratch(wo_a, a->T, G));
            if (base == NULL)
                return dsv4_err_set(DSV4_ERR_NOMEM, "cuda attention out: no scratch");
            xb = (uint16_t *)(base + xoff);
        }
        e = attention_unrope_run(be, a, off, rd, freqs, q16, xb, &wrote_b);
        if (e != DSV4_OK)
            return e;
        if (wrote_b)
            return cuda_fast_linear_grouped_b16(be, u, wo_a, a->T, G, xoff);
        return cuda_linear_grouped(be, u, a->out, wo_a, a->T, G);
    }
}
