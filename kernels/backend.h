/*
 * backend.h — the op interface shared by the CPU reference backend and the
 * CUDA backend.  The DeepSeek-V4 forward (kernels/forward.c) is written once
 * over these ops; a backend is a table of function pointers plus its state.
 *
 * Conventions (STYLE §7.11):
 *   - Signature: op(be, outputs..., inputs..., sizes/params) -> enum dsv4_err.
 *   - Shapes are written outermost first: (T, H, Dh) means T rows of H heads of
 *     Dh contiguous values.  T = token rows in this call (tokens of several
 *     sequences may be mixed; each row carries its own slot and position).
 *   - Every pointer argument is backend memory (host memory for the CPU
 *     backend) unless marked "host".  Index arrays are int32.
 *   - Activations are F32 buffers.  Where the reference holds a bf16 tensor the
 *     op rounds its output to bf16 ("-> bf16" below), so F32 storage carries the
 *     reference's values exactly; ops that the reference runs in fp32 say so.
 *   - Numerics follow DeepSeek's reference (model doc §3.0/§3.8) when
 *     be->numerics == DSV4_NUMERICS_REF; DSV4_NUMERICS_HF instead follows
 *     Hugging Face transformers' dequantized path (no activation quantization,
 *     no FP8/FP4 KV simulation, fp32 indexer scores) and exists to compare the
 *     architecture against transformers tightly (docs/model.md).
 *   - Ops allocate nothing and do not synchronise (CUDA: async on the
 *     backend's stream); outputs never alias inputs unless stated.
 *
 * Decode state lives in per-layer pools indexed by a sequence slot (0 ..
 * n_slots-1), see kernels/forward.h; ops receive pool base pointers plus the
 * per-row slot.  The pools that grow with the sequence (compressed entries,
 * indexer keys) are paged: see DSV4_PAGE_ENTRIES.
 */
#ifndef DSV4_KERNELS_BACKEND_H
#define DSV4_KERNELS_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "common/weights.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Paged pools.  Compressed KV entries and indexer keys live in pages of
 * DSV4_PAGE_ENTRIES rows of one pool per layer.  An op reading such a pool
 * takes its base, `cap` (entries one slot can address, a multiple of
 * DSV4_PAGE_ENTRIES when paged) and `pages`, the page table (n_slots,
 * cap / DSV4_PAGE_ENTRIES) int32 in backend memory: entry e of slot s is
 * pool row dsv4_pool_row(pages, cap, s, e).  pages == NULL means an unpaged
 * pool, entry e of slot s at row s * cap + e.
 */
#define DSV4_PAGE_ENTRIES 64

/* Pool row of entry e of slot s (see above); host code only. */
static inline int64_t
dsv4_pool_row(const int32_t *pages, int cap, int s, int e)
{
    if (pages == NULL)
        return (int64_t)s * cap + e;
    return (int64_t)pages[(int64_t)s * (cap / DSV4_PAGE_ENTRIES) + e / DSV4_PAGE_ENTRIES] *
               DSV4_PAGE_ENTRIES + e % DSV4_PAGE_ENTRIES;
}

/* Compressed entries a row at position pos sees of a pool of ratio `ratio`
 * holding `cap` entries a slot: the finished windows, min((pos + 1) /
 * ratio, cap) (indexer_topk's n_valid); host code only. */
static inline int
dsv4_n_valid(int pos, int ratio, int cap)
{
    int n = (pos + 1) / ratio;

    return n < cap ? n : cap;
}

/* Which numerics a backend follows (docs/model.md, "Numerics"). */
enum dsv4_numerics {
    DSV4_NUMERICS_REF = 0,  /* DeepSeek reference (FP8 act quant, KV/indexer sims) */
    DSV4_NUMERICS_HF = 1,   /* transformers dequantized mode (see above) */
};

/* linear() flags */
#define DSV4_LIN_F32_OUT 1u   /* bf16 weights only: keep fp32 output (no bf16 rounding) */

/* Sampling parameters of one row (host memory). */
struct dsv4_sample_params {
    float temperature;   /* 0 = greedy (argmax, lowest id on ties) */
    float top_p;         /* (0, 1]; 1 = off */
    int32_t top_k;       /* 0 = off */
    int32_t n_top;       /* [0, DSV4_TOP_MAX]: the most likely ids sample_top
                            reports for the row; 0 = none (sample ignores it) */
    uint64_t seed;       /* stream seed */
    uint64_t step;       /* index of the token being sampled; with seed it
                            fully determines the random draw */
};

/*
 * The order of the sampler's double sums (cpu_sample.c, step 4-5): the
 * candidates' weights are summed in runs of DSV4_SAMPLE_RUN positions, the
 * runs' sums in spans of DSV4_SAMPLE_SPAN runs, the spans' sums in order, so
 * that a backend can form the sums in parallel and still draw the CPU's
 * token.
 */
#define DSV4_SAMPLE_RUN 16
/* Temperatures below this sample greedily: z = logits / T leaves float's
 * range near the smallest floats (1e-38 drew among the overflowed logits),
 * and the draw is the argmax in all but ties long before (the scheduler's
 * and the ranks' DSV4_PROTO_MIN_TEMPERATURE, the same value). */
#define DSV4_SAMPLE_GREEDY_BELOW 1e-5f
/* Most likely ids a row's sample_top reports at most (the stride of its
 * outputs); the OpenAI API's top_logprobs bound. */
#define DSV4_TOP_MAX 20
#define DSV4_SAMPLE_SPAN 256

struct dsv4_backend;

/* The arguments of one attention call (attention_unrope; the fields are
 * attention's parameters of the same names, but for `fresh`). */
struct dsv4_attn {
    float *out;
    const float *q, *kv, *ring, *comp;
    const int32_t *pages, *sel;
    const float *sink;
    const int32_t *slot, *pos, *row0, *pos0;
    int T, H, Dh, win, cap, ratio, K;
    float scale;
    /* A hint; 0 is always correct.  1: every sequence of the call starts at
     * position 0 in it (pos0 = 0 on every row) and kv has the call's T rows,
     * so every key row a query reads is a row of kv or a compressed entry
     * that one of the call's rows completed (entry e of row t's sequence:
     * row row0 + (e + 1) ratio - 1, the row whose position ends its
     * window), none from the ring or from an earlier call.  The CUDA fast
     * kernels then stage those rows as bf16 once per call instead of once
     * per (row, head group).  Values are the same either way. */
    int fresh;
    /* 1: q is the x of the linear_norm_rope call with q_attn set that was
     * queued last before this op, and nothing has touched x since; the
     * backend may then read q in the form that call left it in (the CUDA
     * fast kernels: bf16).  0 is always correct where q holds its values. */
    int q_held;
};

/* The arguments of one norm_rope call (norm_rope2). */
struct dsv4_norm_rope {
    float *x;
    const uint16_t *w;
    int rows, D;
    float eps;
    const int32_t *pos;
    int heads, off, rd;
    const float *freqs;
    int sim_cols, sim_block;
    float *dst;
    const int32_t *dst_rows;
    /* linear_norm_rope only (other ops ignore it).  1: x is the q of the
     * attention op (attention_unrope or attention_out, q_held set) that the
     * caller queues next, and only that op reads it.  The backend may then
     * leave the rows in a form of its own for that op: x's contents are
     * unspecified to anyone else.  The CUDA fast kernels keep them as bf16
     * (round to nearest even) in x's first half, the rounding their
     * attention does to q anyway: the same results. */
    int q_attn;
};

/* A backend's operations: memory, the model's ops and graphs; each is
 * documented at its member. */
struct dsv4_backend_ops {
    /* --- lifecycle and memory ------------------------------------------ */
    void (*destroy)(struct dsv4_backend *be);
    /* Zero-filled allocation of `bytes`; NULL on failure. */
    void *(*alloc)(struct dsv4_backend *be, size_t bytes);
    void (*free)(struct dsv4_backend *be, void *p);
    /* host -> backend, backend -> host, backend -> backend copies. */
    enum dsv4_err (*upload)(struct dsv4_backend *be, void *dst, const void *src, size_t n);
    enum dsv4_err (*download)(struct dsv4_backend *be, void *dst, const void *src, size_t n);
    enum dsv4_err (*copy)(struct dsv4_backend *be, void *dst, const void *src, size_t n);
    /*
     * n backend -> backend copies in one call: dst[i][0, bytes[i]) =
     * src[i][0, bytes[i]) for i < n.  dst, src, bytes: host arrays of n
     * (backend pointers, any alignment; bytes[i] may be 0); no destination
     * may overlap another piece's source or destination.  The arrays may be
     * reused when the call returns.  CUDA: the table goes to the device in
     * one copy and one kernel moves every piece (instead of one
     * cudaMemcpyAsync each; DSV4_CUDA_COPY_BATCH=memcpy selects those); the
     * call may wait for its previous call's table upload, and must not be
     * recorded into a graph (DSV4_ERR_NOTSUP while recording).  Used by the
     * decode-state export / import to and from CUDA IPC regions.
     */
    enum dsv4_err (*copy_batch)(struct dsv4_backend *be, int n, void *const *dst,
                                const void *const *src, const size_t *bytes);
    /* Wait for all queued work. */
    enum dsv4_err (*sync)(struct dsv4_backend *be);

    /* --- elementwise / layout ------------------------------------------- */
    /* x[0..n) = v */
    enum dsv4_err (*fill)(struct dsv4_backend *be, float *x, float v, int64_t n);
    /* dst[rows[i], :] = src[i, :] for i < n; row length `cols`.  Rows
     * indices are distinct. */
    enum dsv4_err (*scatter_rows)(struct dsv4_backend *be, float *dst, const int32_t *rows,
                                  const float *src, int n, int cols);
    /* dst[i, :] = src[rows[i], :] for i < n. */
    enum dsv4_err (*gather_rows)(struct dsv4_backend *be, float *dst, const float *src,
                                 const int32_t *rows, int n, int cols);
    /* x[0..n) = bf16(x * s) (the indexer's weights_proj scaling). */
    enum dsv4_err (*scale)(struct dsv4_backend *be, float *x, float s, int64_t n);
    /* out[t, j, :] = bf16(e[t, :] + h[t, j, :]) for j < n_streams (MTP input). */
    enum dsv4_err (*add_streams)(struct dsv4_backend *be, float *out, const float *e,
                                 const float *h, int T, int n_streams, int D);

    /* --- model ops ------------------------------------------------------ */
    /* out (T, n_copies, D) = table[ids[t], :] repeated n_copies times.
     * table: bf16 (V, D). */
    enum dsv4_err (*embed)(struct dsv4_backend *be, float *out, const int32_t *ids,
                           const uint16_t *table, int T, int D, int n_copies);

    /* out (rows, D) = bf16(x_bf16 / sqrt(mean(x_bf16^2) + eps) * w), fp32 math,
     * x first rounded to bf16.  w: bf16 (D), or NULL for an unweighted norm.
     * out may alias x. */
    enum dsv4_err (*rms_norm)(struct dsv4_backend *be, float *out, const float *x,
                              const uint16_t *w, int rows, int D, float eps);

    /*
     * out (T, N) = x (T, K) · W^T.
     *   FP8/FP4 weights: x is quantized per row per 128-column block to FP8
     *   (REF numerics; HF numerics use x as is), fp32 accumulation with the
     *   weight scales; -> bf16.
     *   BF16 weights: fp32 math on x as given; -> bf16 unless DSV4_LIN_F32_OUT.
     * N = W->n_out, K = W->n_in.
     */
    enum dsv4_err (*linear)(struct dsv4_backend *be, float *out, const float *x,
                            const struct dsv4_linear *W, int T, unsigned flags);

    /*
     * Grouped output projection (model doc §3.3.7):
     * out (T, G, R)[t, g, :] = Wa[g] (R, Kg) · x (T, G, Kg)[t, g, :], with Wa the
     * FP8 weight dequantized to bf16 (n_out = G*R, n_in = Kg); bf16 inputs,
     * fp32 accumulation -> bf16.  No activation quantization.
     */
    enum dsv4_err (*linear_grouped)(struct dsv4_backend *be, float *out, const float *x,
                                    const struct dsv4_linear *Wa, int T, int G);

    /*
     * Interleaved partial RoPE in place (model doc §3.3.3): for row t, head h,
     * the rd values at x + t*row_stride + h*head_stride + off are rotated as rd/2
     * complex pairs (2i, 2i+1) by angle pos[t] * freqs[i] (fp32), or by its
     * negation when `inverse`; -> bf16.  freqs: host, rd/2 floats.
     */
    enum dsv4_err (*rope)(struct dsv4_backend *be, float *x, const int32_t *pos, int T,
                          int n_heads, int64_t row_stride, int64_t head_stride, int off,
                          int rd, const float *freqs, int inverse);

    /* In-place FP8 simulation (FP8_sim) of the first n_cols values of each of
     * `rows` rows (row stride `stride`), per `block` values.  REF only; a
     * no-op under HF numerics. */
    enum dsv4_err (*fp8_sim)(struct dsv4_backend *be, float *x, int rows, int64_t stride,
                             int n_cols, int block);

    /* Indexer rotation of `rows` contiguous 128-vectors in place:
     * x <- FP4_sim(bf16(Hadamard128(x)), block 32).  A no-op under HF numerics
     * (the Hadamard is orthogonal and cancels in q·k). */
    enum dsv4_err (*hadamard_fp4)(struct dsv4_backend *be, float *x, int rows);

    /*
     * mHC pre (model doc §3.2) for T rows: from X (T, n, D) computes
     * x_out (T, D) -> bf16, post (T, n) and comb (T, n, n) in fp32, with
     * Sinkhorn of `iters` iterations.  hc->fn: (mix=(2+n)n, n*D).
     * comb (here and from hc_post_pre) is an input of the hc ops only: a
     * backend may complete it beside its queue (the CUDA fast kernels run
     * the Sinkhorn on a stream of their own), so only the hc ops, the
     * memory ops (upload, download, copy, copy_batch, fill, scatter_rows,
     * gather_rows, copy2d), sync and graph_end are ordered after it; the
     * compute ops (linear, attention, ...) must not be given it.
     */
    enum dsv4_err (*hc_pre)(struct dsv4_backend *be, float *x_out, float *post, float *comb,
                            const float *X, const struct dsv4_hc_w *hc, int T, int n, int D,
                            int iters, float hc_eps, float norm_eps);

    /* mHC post: X_out[t, k, :] = bf16(post[t,k] * f[t, :] + Σ_j comb[t,j,k] X[t,j,:]),
     * fp32 math.  X_out must not alias X. */
    enum dsv4_err (*hc_post)(struct dsv4_backend *be, float *X_out, const float *f,
                             const float *X, const float *post, const float *comb, int T,
                             int n, int D);

    /* Final collapse: x_out (T, D) = bf16(Σ_j pre_j X[t, j, :]) with
     * pre = sigmoid(mix * scale[0] + base) + hc_eps; hc->fn: (n, n*D). */
    enum dsv4_err (*hc_head)(struct dsv4_backend *be, float *x_out, const float *X,
                             const struct dsv4_hc_w *hc, int T, int n, int D, float hc_eps,
                             float norm_eps);

    /*
     * Streaming compressor update (model doc §3.3.4), rows in order:
     * for each row t (sequence slot[t], position pos[t]) writes a[t] and
     * z[t] + ape[pos % r] into the slot's state and, when emit[t] >= 0, writes
     * the finished raw entry (before norm/RoPE) to entries[emit[t], :].
     *   a, z       (T, c*d) fp32 (wkv(x), wgate(x)); c = 2 if r == 4 else 1
     *   ape        (r, c*d) fp32
     *   state_kv, state_z  pools (n_slots, c*r, c*d) fp32; overlap layout:
     *              slots [0, r) previous window, [r, 2r) current window
     *   entries    (n_emit, d) fp32
     * Rows of one sequence must appear in increasing position order.
     */
    enum dsv4_err (*compress)(struct dsv4_backend *be, float *entries, float *state_kv,
                              float *state_z, const float *a, const float *z,
                              const float *ape, const int32_t *slot, const int32_t *pos,
                              const int32_t *emit, int T, int r, int d);

    /*
     * Indexer scores and top-k (model doc §3.3.5).  For row t: valid entries
     * s < min((pos[t] + 1) / ratio, cap) of slot[t]'s key pool (paged by
     * `pages`, see DSV4_PAGE_ENTRIES);
     * score[s] = Σ_h w[t,h] · ReLU(q[t,h,:] · keys[slot, s, :]);
     * sel[t, :] = indices of the K best scores (ties: lower index first), in
     * decreasing score order, when n_valid > K; else every valid entry (the
     * top-k set is all of them) in increasing index order, unscored; then -1.
     * q and w are not read for rows with n_valid <= K and may be NULL when
     * every row has n_valid <= K (then only sel is written).
     *   q    (T, nh, dI)   w (T, nh)   keys pool (rows, dI)
     *   sel  (T, K) int32
     * REF numerics round q·k, each head term and the sum to bf16 as the
     * reference's bf16 einsum does; HF numerics keep fp32.
     */
    enum dsv4_err (*indexer_topk)(struct dsv4_backend *be, int32_t *sel, const float *q,
                                  const float *w, const float *keys, const int32_t *pages,
                                  const int32_t *slot,
                                  const int32_t *pos, int T, int nh, int dI, int cap,
                                  int ratio, int K);

    /*
     * Sparse attention with sink (model doc §3.3.6), K = V.
     * Row t (slot s, position p) attends to:
     *   window: positions max(0, p-win+1) .. p; position u >= pos0[t] is row
     *           row0[t] + (u - pos0[t]) of `kv` (this call's window entries),
     *           u < pos0[t] is ring[s, u % win, :];
     *   compressed (comp != NULL): sel == NULL -> every entry e < (p+1)/ratio
     *           (HCA); else the entries sel[t, 0..K) that are >= 0 (CSA).
     * out (T, H, Dh) -> bf16; fp32 softmax with the sink logit sink[h] in the
     * denominator only; scores scaled by `scale`.  Compressed entry e of
     * slot s is row dsv4_pool_row(pages, cap, s, e) of comp.
     *   q (T, H, Dh)  kv (T, Dh)  ring (n_slots, win, Dh)  comp (rows, Dh)
     */
    enum dsv4_err (*attention)(struct dsv4_backend *be, float *out, const float *q,
                               const float *kv, const float *ring, const float *comp,
                               const int32_t *pages, const int32_t *sel, const float *sink,
                               const int32_t *slot, const int32_t *pos, const int32_t *row0,
                               const int32_t *pos0,
                               int T, int H, int Dh, int win, int cap, int ratio, int K,
                               float scale);

    /*
     * Router (model doc §3.4): scores s = sqrt(softplus(x · gate^T)) (fp32);
     * ids = tid2eid[tokens[t]] when tid2eid != NULL, else top-k of s + bias;
     * weights = s[ids] / Σ s[ids] * route_scale.
     *   weights (T, k) fp32   ids (T, k) int32   x (T, D)
     */
    enum dsv4_err (*router)(struct dsv4_backend *be, float *weights, int32_t *ids,
                            const float *x, const struct dsv4_linear *gate,
                            const float *bias, const int64_t *tid2eid, const int32_t *tokens,
                            int T, int k, float route_scale);

    /*
     * Routed + shared experts (model doc §3.4):
     * out[t] = bf16( Σ_j E_ids[t,j](x[t], weights[t,j]) + S(x[t]) ) where
     * E(x, w) = w2(bf16(silu(min(g, lim)) * clamp(u, ±lim) * w)), g = w1 x,
     * u = w3 x (linear outputs -> bf16), and S is the same without w.
     *   out (T, D)  x (T, D)  experts: array of E (backend memory)
     */
    enum dsv4_err (*moe)(struct dsv4_backend *be, float *out, const float *x,
                         const int32_t *ids, const float *weights,
                         const struct dsv4_expert_w *experts,
                         const struct dsv4_expert_w *shared, int T, int k, float swiglu_limit);

    /*
     * Expert parallelism: moe in two halves, so that ranks holding different
     * experts can sum their parts (kernels/comm.h) and still compute moe's
     * exact result.  moe_parts writes moe's summands,
     *   y (T*k + T, D): row t*k + j = E_ids[t,j](x[t], weights[t,j]) when that
     *   expert is held here (experts[id].w1.w != NULL), else 0; row T*k + t =
     *   S(x[t]) when shared != NULL and shared->w1.w != NULL, else 0;
     * each value exactly as moe computes it (bf16).  D and the intermediate
     * size come from the held experts (all must agree); with none held, y is
     * all zero.
     */
    enum dsv4_err (*moe_parts)(struct dsv4_backend *be, float *y, const float *x,
                               const int32_t *ids, const float *weights,
                               const struct dsv4_expert_w *experts,
                               const struct dsv4_expert_w *shared, int T, int k, int D,
                               float swiglu_limit);
    /* out (T, D) = bf16(Σ_j y[t*k + j] over j by increasing ids[t, j]
     * (stable), then + y[T*k + t]), fp32: moe's sum of moe_parts' y. */
    enum dsv4_err (*moe_combine)(struct dsv4_backend *be, float *out, const float *y,
                                 const int32_t *ids, int T, int k, int D);

    /* dst[r * dst_ld + c] = src[r * src_ld + c] for r < rows, c < cols. */
    enum dsv4_err (*copy2d)(struct dsv4_backend *be, float *dst, int64_t dst_ld,
                            const float *src, int64_t src_ld, int rows, int cols);

    /*
     * Sampling of n rows of logits (V each): greedy when temperature <
     * DSV4_SAMPLE_GREEDY_BELOW (0 included),
     * else softmax(logits / temperature) restricted by top_k then top_p, drawn
     * with a generator seeded from (seed, step).  out_ids (n) int32,
     * out_logprob (n) fp32 (log-softmax of the chosen id at temperature 1;
     * may be NULL).  params: host array of n.  A NaN logit counts as -inf
     * (never drawn while the row has another value; log-probability -inf);
     * where the largest value is +inf the +inf values share the draw and
     * the probability (kernels/sample_order.h so_lw, so_logprob).
     */
    enum dsv4_err (*sample)(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob,
                            const float *logits, const struct dsv4_sample_params *params,
                            int n, int V);
    /*
     * The most likely ids of n rows of logits (V each) with their
     * log-probabilities at temperature 1, whatever the row's sampling
     * parameters: for each row r with params[r].n_top = k > 0, out_ids[r *
     * DSV4_TOP_MAX + j] and out_logprob[r * DSV4_TOP_MAX + j] for j < min(k,
     * V) are the j-th id by (logit desc, id asc), a NaN logit as -inf, and
     * logit - (m + log Σ_i exp(logit_i - m)) as sample's out_logprob (m the
     * largest logit, the sum in double); the other entries are left as they
     * are.  Backend arrays of n * DSV4_TOP_MAX; params: host array of n.
     * DSV4_ERR_INVAL for n_top outside [0, DSV4_TOP_MAX] or V < 1.
     */
    enum dsv4_err (*sample_top)(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob,
                                const float *logits, const struct dsv4_sample_params *params,
                                int n, int V);

    /* --- optional: recorded graphs (NULL where the backend has none, as on
     * the CPU backend) ---------------------------------------------------- */
    /*
     * Record instead of run: the ops queued until graph_end are recorded,
     * host arguments by value and backend pointers as addresses, and nothing
     * runs.  Ops queued while recording must not synchronise or read device
     * data on the host (CUDA: stream capture; backend scratch grown while
     * recording stays allocated until the backend is destroyed).
     */
    enum dsv4_err (*graph_begin)(struct dsv4_backend *be);
    /* Stop recording; *out receives a replayable graph, or NULL on error
     * (the recording is dropped and the backend no longer records). */
    enum dsv4_err (*graph_end)(struct dsv4_backend *be, void **out);
    /* Queue a replay of g: the recorded ops run again in order, reading the
     * backend memory at the recorded addresses as it is when they run. */
    enum dsv4_err (*graph_launch)(struct dsv4_backend *be, void *g);
    /* Free a graph of graph_end (NULL is a no-op). */
    void (*graph_free)(struct dsv4_backend *be, void *g);

    /* --- fused ops (issue 7: fewer, larger kernels per decode step).  Each
     * is defined as the composition of the ops written in its comment, and
     * the CPU backend runs exactly that composition
     * (dsv4_hc_post_pre_compose, dsv4_norm_rope_compose below), so its
     * results do not change; the CUDA backend runs the same composition of
     * its exact kernels, and one fused kernel set with the fast kernels on
     * (kernels/cuda_fast.h: same bits as the fast ops composed). --------- */
    /*
     * hc_post of one sub-layer followed by hc_pre of the next and the next
     * sub-layer's input norm:
     *   hc_post(X_out, f, X, post, comb, T, n, D);
     *   hc_pre(x_out, post_out, comb_out, X_out, hc, T, n, D, iters, hc_eps,
     *          norm_eps);
     *   xn != NULL:  rms_norm(xn, x_out, nw, T, D, norm_eps).
     * post_out / comb_out may alias post / comb (read before written);
     * X_out must not alias X.
     */
    enum dsv4_err (*hc_post_pre)(struct dsv4_backend *be, float *X_out, float *x_out,
                                 float *post_out, float *comb_out, float *xn, const float *f,
                                 const float *X, const float *post, const float *comb,
                                 const struct dsv4_hc_w *hc, const uint16_t *nw, int T, int n,
                                 int D, int iters, float hc_eps, float norm_eps);
    /*
     * rms_norm, RoPE, FP8 simulation and a row scatter on `rows` contiguous
     * rows of D values in place, `heads` rows per position (rows % heads ==
     * 0; row i takes position pos[i / heads]):
     *   rms_norm(x, x, w, rows, D, eps);
     *   rd > 0:        rope(x, pos, rows / heads, heads, heads * D, D, off, rd,
     *                       freqs, 0);
     *   sim_cols > 0:  fp8_sim(x, rows, D, sim_cols, sim_block);
     *   dst != NULL:   scatter_rows(dst, dst_rows, x, rows, D).
     * freqs: host, rd/2 floats (as rope).  Used for the per-head q norm +
     * RoPE, the window KV (kv_norm, RoPE, FP8 sim) and the compressed
     * entries (norm, RoPE, FP8 sim, scatter into the pool).
     */
    enum dsv4_err (*norm_rope)(struct dsv4_backend *be, float *x, const uint16_t *w, int rows,
                               int D, float eps, const int32_t *pos, int heads, int off,
                               int rd, const float *freqs, int sim_cols, int sim_block,
                               float *dst, const int32_t *dst_rows);
    /*
     * n linears of one input x (T rows of K columns; every Ws[i]->n_in == K),
     * 1 <= n <= DSV4_LINEAR_MULTI_MAX:
     *   for i < n: linear(outs[i], x, Ws[i], T, flags[i]).
     * The outputs must not alias x or each other.  The forward uses it for
     * the projections of one normalised input (wq_a, wkv and the
     * compressors' and the indexer's of xn; wq_b and the indexer's wq_b of
     * the normed qr); the CUDA fast kernels run them as one activation
     * preparation, one tile launch per weight format and one reduction
     * (decode sizes), or give their cuBLASLt linears x split / quantized
     * once (prefill sizes).
     */
    enum dsv4_err (*linear_multi)(struct dsv4_backend *be, int n, float *const *outs,
                                  const float *x, const struct dsv4_linear *const *Ws,
                                  const unsigned *flags, int T);
    /*
     * Two independent norm_rope calls (fields as norm_rope's parameters):
     *   norm_rope(a...); norm_rope(b...).
     * Their rows (and pool rows) must not overlap.  The forward gives it the
     * per-head q and the window KV of attention; the CUDA fast kernels run
     * both in one launch.
     */
    enum dsv4_err (*norm_rope2)(struct dsv4_backend *be, const struct dsv4_norm_rope *a,
                                const struct dsv4_norm_rope *b);
    /*
     * Attention, then the inverse RoPE of its output at the query positions
     * (the value carried the keys' rotation: model doc §3.3.6):
     *   attention(a->out, a->q, ..., a->scale);
     *   rope(a->out, a->pos, a->T, a->H, a->H * a->Dh, a->Dh, off, rd, freqs, 1).
     * freqs: host, rd/2 floats (as rope).  The CUDA fast kernels rotate the
     * output pairs in the attention kernel's own output stage.
     */
    enum dsv4_err (*attention_unrope)(struct dsv4_backend *be, const struct dsv4_attn *a,
                                      int off, int rd, const float *freqs);
    /*
     * attention_unrope, then the grouped output projection of its output:
     *   attention_unrope(a, off, rd, freqs);
     *   linear_grouped(u, a->out, wo_a, a->T, G).
     * a->out is the backend's to use: what it holds afterwards is
     * unspecified (the CUDA fast kernels of a prefill-sized call hand the
     * attention's output to the GEMM as bf16 and do not write it).  u the
     * same values either way.
     */
    enum dsv4_err (*attention_out)(struct dsv4_backend *be, const struct dsv4_attn *a, int off,
                                   int rd, const float *freqs, float *u,
                                   const struct dsv4_linear *wo_a, int G);
    /*
     * A linear, then a norm_rope of its output (nr->x, nr->rows * nr->D =
     * T * W->n_out):
     *   linear(nr->x, x, W, T, flags);
     *   norm_rope(nr->x, nr->w, nr->rows, ...).
     * The forward gives it the per-head q of prefill-sized calls (wq_b, then
     * the q norm and RoPE); the CUDA fast kernels hand the GEMM's bf16
     * output to the norm without widening it to fp32 first.
     */
    enum dsv4_err (*linear_norm_rope)(struct dsv4_backend *be, const float *x,
                                      const struct dsv4_linear *W, int T, unsigned flags,
                                      const struct dsv4_norm_rope *nr);

    /* --- optional: a second queue (NULL where the backend has none, as on
     * the CPU backend: everything runs in the order queued) -------------- */
    /*
     * side_begin: *on = 1 when the ops queued from here until side_end go to
     * the backend's second queue, where they run after every op queued
     * before side_begin but beside (before, during or after) the ops queued
     * after side_end on the main queue, until side_join; *on = 0 when the
     * backend runs them in order as usual (side_end and side_join must still
     * be called; they then do nothing).  side_end: later ops go to the main
     * queue again (call it also when a side op failed).  side_join: the ops
     * queued after it run after every side op.  Between side_begin and
     * side_join an op of either queue must not write memory that an op of
     * the other reads or writes; backend scratch is per queue.  No nesting;
     * a recording (graph_begin) records both queues, and every side_begin
     * of it must be joined before graph_end.
     */
    enum dsv4_err (*side_begin)(struct dsv4_backend *be, int *on);
    enum dsv4_err (*side_end)(struct dsv4_backend *be);
    enum dsv4_err (*side_join)(struct dsv4_backend *be);

    /*
     * Optional (NULL: the backend keeps no working memory between calls).
     * Waits for every queued op, then frees the working memory the backend
     * grew for the calls so far (CUDA: the scratch buffers of both queues and
     * those they outgrew); later calls take it again, only as large as they
     * need.  Graphs recorded before may use that memory: the caller frees
     * them first and must not launch them after (dsv4_model_trim).  Not
     * while a graph is being recorded.
     */
    enum dsv4_err (*trim)(struct dsv4_backend *be);
};

/* The most linears of one linear_multi call. */
#define DSV4_LINEAR_MULTI_MAX 8

/* A backend instance (CPU or CUDA): its operations and settings, created
 * by dsv4_backend_create (dsv4_cpu_backend_create, dsv4_cuda_backend_create). */
struct dsv4_backend {
    const struct dsv4_backend_ops *ops;
    const char *name;              /* "cpu", "cuda" */
    enum dsv4_numerics numerics;
    int n_threads;                 /* CPU worker threads (1 = single) */
    void *priv;                    /* backend state */
};

/*
 * Create a backend by name ("cpu"; "cuda" when built with CUDA).
 * n_threads: CPU worker count, 0 = number of online CPUs.
 */
enum dsv4_err dsv4_backend_create(struct dsv4_backend **out, const char *name,
                                  enum dsv4_numerics numerics, int n_threads);
/* Destroy (NULL is a no-op). */
void dsv4_backend_destroy(struct dsv4_backend *be);

/* ops->norm_rope of the call a describes (its fields as the op's arguments). */
enum dsv4_err dsv4_norm_rope_one(struct dsv4_backend *be, const struct dsv4_norm_rope *a);

/* The fused ops as the compositions that define them (see hc_post_pre,
 * norm_rope, linear_multi, norm_rope2, attention_unrope, attention_out and linear_norm_rope
 * above), through be's own ops: the CPU
 * backend's implementation,
 * and any backend's fallback where its fused kernels do not apply
 * (kernels/backend.c). */
enum dsv4_err dsv4_hc_post_pre_compose(struct dsv4_backend *be, float *X_out, float *x_out,
                                       float *post_out, float *comb_out, float *xn,
                                       const float *f, const float *X, const float *post,
                                       const float *comb, const struct dsv4_hc_w *hc,
                                       const uint16_t *nw, int T, int n, int D, int iters,
                                       float hc_eps, float norm_eps);
enum dsv4_err dsv4_norm_rope_compose(struct dsv4_backend *be, float *x, const uint16_t *w,
                                     int rows, int D, float eps, const int32_t *pos,
                                     int heads, int off, int rd, const float *freqs,
                                     int sim_cols, int sim_block, float *dst,
                                     const int32_t *dst_rows);
enum dsv4_err dsv4_linear_multi_compose(struct dsv4_backend *be, int n, float *const *outs,
                                        const float *x, const struct dsv4_linear *const *Ws,
                                        const unsigned *flags, int T);
enum dsv4_err dsv4_norm_rope2_compose(struct dsv4_backend *be, const struct dsv4_norm_rope *a,
                                      const struct dsv4_norm_rope *b);
enum dsv4_err dsv4_attention_unrope_compose(struct dsv4_backend *be, const struct dsv4_attn *a,
                                            int off, int rd, const float *freqs);
enum dsv4_err dsv4_attention_out_compose(struct dsv4_backend *be, const struct dsv4_attn *a,
                                         int off, int rd, const float *freqs, float *u,
                                         const struct dsv4_linear *wo_a, int G);
enum dsv4_err dsv4_linear_norm_rope_compose(struct dsv4_backend *be, const float *x,
                                            const struct dsv4_linear *W, int T, unsigned flags,
                                            const struct dsv4_norm_rope *nr);

/* The CPU backend constructor (kernels/cpu/cpu_backend.c). */
enum dsv4_err dsv4_cpu_backend_create(struct dsv4_backend **out, enum dsv4_numerics numerics,
                                      int n_threads);

/* The CUDA backend constructor (kernels/cuda/cuda_backend.cu; only in builds
 * with CUDA, where DSV4_HAVE_CUDA is defined): one stream on device `device`
 * (-1 = the calling thread's current device); the exact kernels, or the fast
 * ones (kernels/cuda_fast.h) when the environment has DSV4_CUDA_KERNELS=fast;
 * DSV4_CUDA_STREAM_PRIORITY=high / low sets the stream's priority.  DSV4_ERR_NOTSUP when no CUDA
 * device is present.  Weights go to the device with dsv4_cuda_weights_upload
 * (kernels/cuda_weights.h). */
enum dsv4_err dsv4_cuda_backend_create(struct dsv4_backend **out, enum dsv4_numerics numerics,
                                       int device);

/* 1 when be is a CUDA backend whose context is an MPS client
 * (cudaDevAttrMpsEnabled, asked once by dsv4_cuda_backend_create), else 0. */
int dsv4_cuda_mps_client(const struct dsv4_backend *be);

#ifdef __cplusplus
}
#endif
#endif
