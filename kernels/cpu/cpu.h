/*
 * cpu.h — private header of the CPU reference backend: its state, the thread
 * pool, the shared linear core and the ops of each file (table of contents).
 *
 * The CPU backend is the reference every other backend is tested against.
 * Its ops follow kernels/backend.h word for word; every file says which
 * rounding and summation order it uses.  Results never depend on the number
 * of threads: work is partitioned over outputs (rows, output columns,
 * channels, heads), and every reduction runs whole on one thread in a fixed
 * order.
 *
 * Memory: "backend memory" is host memory (alloc = aligned calloc).  Unlike
 * the CUDA backend the ops may take temporary host scratch from the heap
 * (malloc/free within the call); on failure they return DSV4_ERR_NOMEM.
 *
 * Execution context: one backend is driven by one thread at a time; the ops
 * run synchronously (sync is a no-op) and use the backend's worker pool.
 */
#ifndef DSV4_KERNELS_CPU_CPU_H
#define DSV4_KERNELS_CPU_CPU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

/* --- thread pool (cpu_backend.c) ------------------------------------------ */

/*
 * A parallel-for body: handles items [begin, end) on worker `tid`
 * (0 .. n_threads-1; tid 0 is the calling thread).  Must not call
 * cpu_parallel_for itself.
 */
typedef void (*cpu_task_fn)(void *ctx, int64_t begin, int64_t end, int tid);

struct cpu_pool;

/* Backend state (be->priv). */
struct cpu_state {
    struct cpu_pool *pool;  /* NULL when single-threaded */
    int n_threads;          /* >= 1 */
};

/*
 * Run fn over items [0, n) in chunks of `grain` items (>= 1), spread over the
 * backend's threads; returns when all are done.  Items must be independent:
 * which thread runs which chunk varies between calls.
 */
void cpu_parallel_for(struct dsv4_backend *be, int64_t n, int64_t grain, cpu_task_fn fn,
                      void *ctx);

/* The backend's thread count (>= 1). */
int cpu_threads(const struct dsv4_backend *be);

/* --- the innermost loops under ASan/UBSan ---------------------------------- */

/*
 * CI's second pass builds everything with ASan+UBSan, where a checked load in
 * a dot product's inner loop made the model ~10x slower than the plain build
 * (cpu_dot4 alone was 71% of test_forward's time there).  The few innermost
 * loops (cpu_dot, cpu_dot4, cpu_lin_decode's row decode) are therefore built
 * without instrumentation (CPU_HOT) and check every range they touch once on
 * entry instead (cpu_check_range): the same accesses are covered, each range
 * as a whole.  Without ASan both are no-ops.
 */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>

#define CPU_HOT __attribute__((no_sanitize("address", "undefined")))

/*
 * Abort through ASan's own report when any of the n bytes at p is not
 * addressable: the first bad byte is read by an instrumented load, so the
 * report names the address, its allocation and the caller's stack.
 */
static inline void
cpu_check_range(const void *p, size_t n)
{
    const volatile char *bad = __asan_region_is_poisoned((void *)(uintptr_t)p, n);

    if (bad != NULL)
        (void)*bad;
}
#else
#define CPU_HOT
/* Without ASan: nothing to check. */
static inline void
cpu_check_range(const void *p, size_t n)
{
    (void)p;
    (void)n;
}
#endif

/* --- shared numeric helpers (cpu_linear.c) -------------------------------- */

/* Lanes of the canonical dot product. */
#define CPU_LANES 8

/*
 * The canonical fp32 dot product of every op: CPU_LANES interleaved partial
 * sums (lane l takes elements i with i % CPU_LANES == l, in order), then the
 * lanes are added pairwise (l and l+4, then +2, +1).  Written so compilers
 * vectorise it without reassociating.
 */
float cpu_dot(const float *a, const float *b, int n);

/* out[q] = cpu_dot(a, b_q, n) for q < 4, bit for bit, sharing loads of a. */
void cpu_dot4(float *out, const float *a, const float *b0, const float *b1, const float *b2,
              const float *b3, int n);

/* Sum of squares with the same lane order as cpu_dot. */
float cpu_sumsq(const float *a, int n);

/* --- top-k selection (cpu_attn.c) ----------------------------------------- */

/* A (score, index) candidate of a top-k selection. */
struct cpu_pick {
    float s;
    int32_t i;
};

/*
 * Indices of the best min(K, n) of s[0..n) by (score desc, index asc), in
 * that order, written to sel; NaN ranks as -inf.  heap: scratch of
 * min(K, n) picks.  Returns the number written.  O(n log K).
 */
int cpu_topk(int32_t *sel, const float *s, int n, int K, struct cpu_pick *heap);

/* --- linear core (cpu_linear.c) ------------------------------------------- */

/* Rows of weight decoded per work item (the linear kernels' n-tile). */
#define CPU_LIN_NB 8

/*
 * Activations prepared for a linear: for FP8/FP4 weights under REF numerics
 * x holds the FP8 values of the quantized input and sx one scale per 128
 * columns; otherwise x is the input as given and sx is NULL.
 */
struct cpu_lin_src {
    const float *x;   /* (rows, stride) */
    const float *sx;  /* (rows, K/128) or NULL */
    int64_t stride;   /* row stride of x, in floats */
    int K;            /* columns used */
};

/* The source advanced to row `row`. */
static inline struct cpu_lin_src
cpu_lin_src_at(const struct cpu_lin_src *s, int64_t row)
{
    struct cpu_lin_src r = *s;

    r.x += row * s->stride;
    if (r.sx != NULL)
        r.sx += row * (s->K / 128);
    return r;
}

/*
 * Prepare x (rows, K) (row stride `stride`) for weight format `fmt`:
 * under REF numerics and FP8/FP4 weights, quantizes into *buf (allocated
 * here: rows*K + rows*K/128 floats; free with free()); otherwise points at
 * x and sets *buf = NULL.  Parallel over rows.
 */
enum dsv4_err cpu_lin_prepare(struct dsv4_backend *be, struct cpu_lin_src *src, float **buf,
                              const float *x, int64_t stride, int rows, int K,
                              enum dsv4_wfmt fmt);

/*
 * Decode rows [n0, n1) of W (at most CPU_LIN_NB) to real fp32 values (code
 * value times its E8M0 scale, exact) into wbuf (n1-n0, W->n_in).
 */
void cpu_lin_decode(float *wbuf, const struct dsv4_linear *W, int n0, int n1);

/*
 * out[i*out_stride + (n - n0)] for i < n_rows, n in [n0, n1): the dot of
 * source row rows[i] (or i when rows == NULL) with decoded weight rows
 * wbuf (n1-n0, K).  With scales (src->sx) the sum runs per 128-block and
 * each block's sum is multiplied by its activation scale before it is added.
 * round_bf16: round each result to bf16.
 */
void cpu_lin_rows(float *out, int64_t out_stride, const struct cpu_lin_src *src,
                  const int32_t *rows, int n_rows, const float *wbuf, int n0, int n1,
                  int round_bf16);

/* scratch floats per thread needed by cpu_lin_decode for `K` columns */
#define CPU_LIN_WBUF(K) ((size_t)CPU_LIN_NB * (size_t)(K))

/* --- ops, by file ----------------------------------------------------------- */
/* Each implements the kernels/backend.h op of the same name (its contract
 * there); the file header says which rounding and order it uses. */

/* cpu_linear.c */
enum dsv4_err cpu_linear(struct dsv4_backend *be, float *out, const float *x,
                         const struct dsv4_linear *W, int T, unsigned flags);
enum dsv4_err cpu_linear_grouped(struct dsv4_backend *be, float *out, const float *x,
                                 const struct dsv4_linear *Wa, int T, int G);

/* cpu_norm.c */
enum dsv4_err cpu_rms_norm(struct dsv4_backend *be, float *out, const float *x,
                           const uint16_t *w, int rows, int D, float eps);
enum dsv4_err cpu_rope(struct dsv4_backend *be, float *x, const int32_t *pos, int T,
                       int n_heads, int64_t row_stride, int64_t head_stride, int off, int rd,
                       const float *freqs, int inverse);
enum dsv4_err cpu_fp8_sim(struct dsv4_backend *be, float *x, int rows, int64_t stride,
                          int n_cols, int block);
enum dsv4_err cpu_hadamard_fp4(struct dsv4_backend *be, float *x, int rows);

/* cpu_hc.c */
enum dsv4_err cpu_hc_pre(struct dsv4_backend *be, float *x_out, float *post, float *comb,
                         const float *X, const struct dsv4_hc_w *hc, int T, int n, int D,
                         int iters, float hc_eps, float norm_eps);
enum dsv4_err cpu_hc_post(struct dsv4_backend *be, float *X_out, const float *f,
                          const float *X, const float *post, const float *comb, int T, int n,
                          int D);
enum dsv4_err cpu_hc_head(struct dsv4_backend *be, float *x_out, const float *X,
                          const struct dsv4_hc_w *hc, int T, int n, int D, float hc_eps,
                          float norm_eps);

/*
 * exp and log1p of a float, evaluated in double and rounded to float: the
 * correctly rounded value but for double-rounding accidents (far rarer than
 * one in a billion), and what the CUDA backend computes (cu_expf,
 * cu_log1pf in kernels/cuda/cuda.cuh), so the two backends agree bit for
 * bit where a float exp is taken (softmax, sigmoid, SiLU, softplus).
 */
static inline float
cpu_expf(float x)
{
    return (float)exp((double)x);
}

/* (log1p: see cpu_expf) */
static inline float
cpu_log1pf(float x)
{
    return (float)log1p((double)x);
}

/* cpu_attn.c */
enum dsv4_err cpu_compress(struct dsv4_backend *be, float *entries, float *state_kv,
                           float *state_z, const float *a, const float *z, const float *ape,
                           const int32_t *slot, const int32_t *pos, const int32_t *emit,
                           int T, int r, int d);
enum dsv4_err cpu_indexer_topk(struct dsv4_backend *be, int32_t *sel, const float *q,
                               const float *w, const float *keys,
                               const int32_t *pages, const int32_t *slot,
                               const int32_t *pos, int T, int nh, int dI, int cap, int ratio,
                               int K);
enum dsv4_err cpu_attention(struct dsv4_backend *be, float *out, const float *q,
                            const float *kv, const float *ring, const float *comp,
                            const int32_t *pages,
                            const int32_t *sel, const float *sink, const int32_t *slot,
                            const int32_t *pos, const int32_t *row0, const int32_t *pos0,
                            int T, int H, int Dh, int win, int cap, int ratio, int K,
                            float scale);

/* cpu_moe.c */
enum dsv4_err cpu_router(struct dsv4_backend *be, float *weights, int32_t *ids,
                         const float *x, const struct dsv4_linear *gate, const float *bias,
                         const int64_t *tid2eid, const int32_t *tokens, int T, int k,
                         float route_scale);
enum dsv4_err cpu_moe(struct dsv4_backend *be, float *out, const float *x, const int32_t *ids,
                      const float *weights, const struct dsv4_expert_w *experts,
                      const struct dsv4_expert_w *shared, int T, int k, float swiglu_limit);
enum dsv4_err cpu_moe_parts(struct dsv4_backend *be, float *y, const float *x,
                            const int32_t *ids, const float *weights,
                            const struct dsv4_expert_w *experts,
                            const struct dsv4_expert_w *shared, int T, int k, int D,
                            float swiglu_limit);
enum dsv4_err cpu_moe_combine(struct dsv4_backend *be, float *out, const float *y,
                              const int32_t *ids, int T, int k, int D);

/* cpu_sample.c */
enum dsv4_err cpu_sample(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob,
                         const float *logits, const struct dsv4_sample_params *params, int n,
                         int V);
enum dsv4_err cpu_sample_top(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob,
                             const float *logits, const struct dsv4_sample_params *params,
                             int n, int V);

#endif
