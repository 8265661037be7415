/*
 * forward.h — the DeepSeek-V4 forward pass, written once over the op
 * interface (kernels/backend.h), with per-sequence decode state.
 *
 * A model holds the weights (as the backend sees them), the rope frequency
 * tables, scratch buffers for up to `max_rows` token rows per call, and the
 * decode state of `n_slots` sequence slots (model doc §4):
 *
 *   per layer        window ring       (n_slots, win, Dh)        f32
 *   ratio > 0        compressed KV     paged, Dh per entry       f32
 *                    compressor state  kv, z (n_slots, c*r, c*Dh) f32
 *   ratio == 4       indexer keys      paged, dI per entry       f32
 *                    indexer compressor state (n_slots, 8, 2*dI) f32
 *   MTP layer(s)     window ring of their own
 *
 * The compressed entries and indexer keys, the state that grows with the
 * sequence, live in pages of DSV4_PAGE_ENTRIES entries (kernels/backend.h)
 * taken from a pool per layer as a sequence grows and returned when its slot
 * is reset, so memory follows the tokens actually held rather than
 * n_slots x max_seq_len (opts.pool_tokens).
 *
 * One call runs any mix of sequences: each sequence contributes a run of
 * consecutive tokens continuing from its current length, so the same call
 * serves prefill from position 0, chunked prefill continuing at position > 0,
 * and batched decode of sequences of different lengths.  Results for a
 * sequence do not depend on what else is in the batch.
 *
 * Execution context: single-threaded caller; the backend may use threads.
 */
#ifndef DSV4_KERNELS_FORWARD_H
#define DSV4_KERNELS_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "common/weights.h"
#include "kernels/backend.h"
#include "kernels/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What dsv4_model_create sizes and switches on. */
struct dsv4_model_opts {
    int n_slots;        /* sequence slots (decode streams + prefills in flight) */
    int max_seq_len;    /* positions per sequence; rounded up to a multiple of 128 */
    int max_rows;       /* token rows per forward call */
    int graphs;         /* nonzero: run decode steps as recorded backend graphs
                           (see DSV4_GRAPH_MAX_BATCH; ignored by backends without
                           graph ops, such as the CPU backend) */
    int64_t pool_tokens; /* tokens the paged pools hold over all slots together;
                            0 = n_slots * max_seq_len (every slot can be full) */
    struct dsv4_comm *comm; /* model group (kernels/comm.h), or NULL for one rank;
                               not owned */
    int tp_rank, tp_size;   /* place in the model group when comm is NULL at
                               creation (dsv4_model_set_comm later); 0, 0 = from
                               comm, or one rank */
    int moe_local;          /* groups: each rank combines its own experts' rows
                               before the all-reduce (see "Model groups") */
};

/*
 * Model groups.  With opts.comm, the model is one rank of a group that runs
 * the forward together: each rank holds its shard of the weights
 * (common/weights_shard.h: its query heads and output groups of attention,
 * and by the group split either its rows of wo_b, its routed experts and
 * every size-th shared expert (ep) or its input columns of wo_b and its
 * slice of every expert's intermediate size (tp); under both its slice of
 * the head's vocabulary rows) and
 * every rank runs every call with the same batch.  The ranks' parts are
 * gathered with all-reduces over buffers where each element comes from one
 * rank (three per layer: wo_a's output, wo_b's output, the experts' parts;
 * and the logits' columns once a call), so every rank computes bit for bit
 * what a single rank holding all the weights computes, and each rank
 * returns (and samples from) the full logits.
 *
 * With opts.moe_local each rank instead combines its own experts' rows
 * (moe_combine over its moe_parts, the other rank's rows zero) and the
 * group all-reduces those (T, D) partial outputs: a (T*k + T) / T times
 * smaller exchange (7x at k = 6: 235 MB a layer at a 2,048-token prefill),
 * as DeepSeek's reference does its expert parallelism.  Every rank still
 * computes the same bits as the others (every communicator adds the ranks'
 * values in rank order on every rank), but no longer a single rank's:
 * the sum of two bf16-rounded partial outputs is not the bf16 sum of all
 * rows.  The rank daemons set it with the CUDA fast kernels (which differ
 * from the exact ones by rounding anyway); the exact kernels and the CPU
 * backend keep the bit-identical form.  With the tp group split every
 * rank's experts' rows are partial sums (over its slice of I), so the
 * group's result is again the sum of the ranks' parts; moe_local is what
 * the rank daemons run with it (each rank's combine, one (T, D) exchange).
 * The tp split also gives each rank wo_b's input columns of its own wo_a
 * groups (the model sees it in the shapes): the attention output is then
 * one all-reduce of partial outputs instead of two gathers (u, then y).
 */

/*
 * Decode graphs.  With opts.graphs set and a backend that records graphs
 * (CUDA), a forward call whose runs all have one token, with at most
 * DSV4_GRAPH_MAX_BATCH runs and without DSV4_FWD_KEEP_HIDDEN, runs as one
 * replay of a graph recorded for its batch size on first use.  The host-side
 * plan of such a call has a fixed shape (every row may emit a compressor
 * entry; rows that do not write theirs to a spare pool row), so only the
 * small index arrays uploaded before the replay change between steps
 * (docs/gpu.md, "Decode graphs").  Results are bit-identical to the
 * ungraphed call.  Where the backend has no device memory to make a
 * recorded graph, that kind of call and batch size runs ungraphed instead
 * for its next 1,024 calls, then tries to record again (the memory may have
 * come back), and dsv4_model_graphs_refused counts it meanwhile.
 */
#define DSV4_GRAPH_MAX_BATCH 16

/* One forward call: n_seqs runs of tokens.  All arrays are host memory. */
struct dsv4_batch {
    int n_seqs;
    const int32_t *slot;      /* (n_seqs) distinct slots */
    const int32_t *n_tokens;  /* (n_seqs) >= 1 tokens each */
    const int32_t *tokens;    /* (Σ n_tokens) token ids, sequence after sequence */
};

/* dsv4_model_forward flags */
#define DSV4_FWD_ALL_LOGITS 1u  /* logits for every row (else last row of each run) */
#define DSV4_FWD_KEEP_HIDDEN 2u /* keep the final streams of the rows for the MTP head */
/*
 * Run the last layer on every row.  Without it a call whose logits rows are
 * fewer than its rows (a prefill chunk: one logits row a run) runs the last
 * main layer's KV-side work (compressors, indexer keys, window KV and ring)
 * on every row and the rest of the layer (queries, attention, output
 * projection, experts, mHC) on the logits rows only: no later call reads the
 * other rows' output of the last layer.  Same logits and the same decode
 * state either way (each op's rows are computed from their own inputs; on
 * the CUDA backend a different kernel for fewer rows may round a value
 * differently).  For tests and A/B measurements; implied by
 * DSV4_FWD_KEEP_HIDDEN (the MTP head reads every row) and
 * DSV4_FWD_ALL_LOGITS.
 */
#define DSV4_FWD_FULL_LAST 4u
/*
 * Score the indexer's entries even where every row of the call has at most
 * index_topk valid compressed entries (a context of at most 4 · index_topk
 * tokens).  Without it such a call's CSA top-k is every valid entry, in
 * index order (backend.h indexer_topk: the same for those rows either way),
 * and the indexer's query side (its wq_b, RoPE, Hadamard, weights_proj,
 * scores) is left out: the same logits and state.  For tests and A/B
 * measurements.
 */
#define DSV4_FWD_FULL_INDEXER 8u

struct dsv4_model;

/*
 * Create a model over weights `w` on backend `be` (neither is owned; both
 * must outlive the model).  The CPU backend uses w's pointers as they are.
 * Allocates the state pools and scratch on the backend.
 */
enum dsv4_err dsv4_model_create(struct dsv4_model **out, struct dsv4_backend *be,
                                const struct dsv4_weights *w, const struct dsv4_model_opts *opts);
void dsv4_model_free(struct dsv4_model *m);

/* Clear slot `slot` to an empty sequence (length 0, compressor states reset). */
enum dsv4_err dsv4_model_seq_reset(struct dsv4_model *m, int slot);
/* Current length (tokens processed) of a slot. */
int dsv4_model_seq_len(const struct dsv4_model *m, int slot);

/*
 * Run the batch.  Each run continues its slot from the slot's current length,
 * and the slot's length grows by its n_tokens.  logits (host): (n_out, V) with
 * n_out = Σ n_tokens under DSV4_FWD_ALL_LOGITS, else n_seqs; fp32.
 * Errors: DSV4_ERR_INVAL for a bad batch (too many rows, slot out of range or
 * repeated, token id out of range, sequence longer than max_seq_len);
 * DSV4_ERR_NOMEM when the paged pools cannot hold the batch's growth (no
 * state changes then; reset a slot and retry).
 */
enum dsv4_err dsv4_model_forward(struct dsv4_model *m, const struct dsv4_batch *b,
                                 float *logits, unsigned flags);

/*
 * Where a sampling call puts the most likely ids of the rows it sampled, with
 * their log-probabilities (the backend's sample_top, kernels/backend.h): host
 * arrays with DSV4_TOP_MAX entries per sampled token, in the order of the
 * call's ids (token t's at t * DSV4_TOP_MAX), filled for the tokens whose
 * params ask (n_top > 0; the first n_top entries, or V when smaller; each
 * log-probability <= 0, a NaN as -inf); the other entries are left alone.
 * n[t]: how many token t has (0 where its params ask none).
 */
struct dsv4_top_out {
    int32_t *ids;
    float *logprob;
    int32_t *n;
};

/*
 * dsv4_model_forward followed by sampling on the backend: one token per run
 * (from its last row's logits) with params[i] (host, n_seqs entries), ids
 * into out_ids and log-probabilities into out_logprob (may be NULL; each
 * <= 0, a NaN as -inf), both host arrays of n_seqs; the most likely ids of
 * the runs whose params ask into *top (may be NULL: none).  The logits stay
 * in backend memory: a GPU backend
 * moves a few bytes per run instead of a vocabulary row.  Same errors and
 * slot growth as dsv4_model_forward.
 */
enum dsv4_err dsv4_model_forward_sample(struct dsv4_model *m, const struct dsv4_batch *b,
                                        const struct dsv4_sample_params *params,
                                        int32_t *out_ids, float *out_logprob,
                                        const struct dsv4_top_out *top);

/*
 * MTP head (model doc §3.6) on the rows kept by the last forward call made
 * with DSV4_FWD_KEEP_HIDDEN: row i of that call is paired with next_tokens[i]
 * (the token that follows it) and the MTP layer runs at the row's position,
 * with its own window ring per slot.  logits (host): (rows, V).  The batch
 * must have the same runs as that forward call.
 */
enum dsv4_err dsv4_model_mtp(struct dsv4_model *m, const struct dsv4_batch *b,
                             const int32_t *next_tokens, float *logits);

/*
 * Speculative decoding with the MTP layer (docs/model.md, "Speculative
 * decoding").  A step of a stream feeds its last accepted token t (not yet
 * through the model, at position p = the slot's length) followed by up to
 * DSV4_SPEC_MAX_DRAFT draft tokens in one forward call, samples every row,
 * and keeps the drafts up to the first one that differs from the token the
 * main model sampled before it, plus the main model's token after the last
 * kept row: 1 .. k+1 tokens per stream.  The sampled rows use the stream's
 * (seed, step), (seed, step + 1), ... exactly as plain decoding would, and a
 * draft counts only when it equals the sampled token (exact match, also at
 * temperature > 0), so the tokens are those of plain decoding: the rows
 * before the first rejected draft see the same context as plain steps.
 *
 * A rejected draft leaves no trace: its position's ring row and emitted
 * compressor entries are rewritten before they are read when that position
 * is fed again, and the one piece of state it changes that is read later,
 * the previous-window half of an r = 4 compressor state when the draft
 * completes a window, is snapshotted in the verify call and restored.  The
 * slot's length grows by the kept tokens.
 *
 * dsv4_model_spec_draft then runs the MTP layer over the verify call's rows
 * (hidden state of row i with the token sampled at row i) and gives each
 * stream its next draft: the MTP layer's greedy token at the last kept row.
 * The MTP layer processes the slot's positions in order; a slot whose MTP
 * layer has not seen its earlier positions (a decode state imported from a
 * prefill that did not run it, or a stream decoded without drafts) starts
 * with a window of zero keys (the zeroed ring: each adds exp(-max) to the
 * softmax's sum with a zero value, so they damp the attention rather than
 * being left out): its first drafts are poorer, the output is the same.
 *
 * With opts.graphs, verify calls where every stream has a draft and the
 * draft steps after them run as graphs recorded per batch size (separate
 * from the plain decode graphs).  Every rank of a group runs the same calls
 * and samples the same logits, so all take the same decisions.
 */
#define DSV4_SPEC_MAX_DRAFT 1

/* One verify call: stream i in slot[i] feeds last[i] then its n_draft[i]
 * (0 .. DSV4_SPEC_MAX_DRAFT) drafts, draft[i * DSV4_SPEC_MAX_DRAFT + j]. */
struct dsv4_spec_batch {
    int n_seqs;
    const int32_t *slot;      /* (n_seqs) distinct slots */
    const int32_t *last;      /* (n_seqs) last accepted token, at the slot's length */
    const int32_t *n_draft;   /* (n_seqs) drafts of each stream */
    const int32_t *draft;     /* (n_seqs, DSV4_SPEC_MAX_DRAFT) */
};

/*
 * Verify step.  params[i]: stream i's sampling; its row j samples with step
 * params[i].step + j.  Output per stream i: out_n[i] tokens (1 ..
 * n_draft[i] + 1) in out_ids[i * (DSV4_SPEC_MAX_DRAFT + 1) + j] and their
 * log-probabilities in out_lp (same layout; may be NULL), and their most
 * likely ids in *top (same layout, DSV4_TOP_MAX entries a token; may be
 * NULL); the drafts accepted are out_n[i] - 1.  logits (host, may be NULL): every row's
 * logits, (Σ (1 + n_draft), V), stream after stream.  The slot's length
 * grows by out_n[i].  Errors as dsv4_model_forward (a stream needs room for
 * all its rows): nothing changes on a refused batch (DSV4_ERR_INVAL) or on
 * DSV4_ERR_NOMEM from the paged pools; a backend failure once the forward
 * has run (out of device memory inside it, a failed download) leaves the
 * slots' state written but their lengths as they were: reset them
 * (dsv4_model_seq_reset), as the decode rank does with its streams; a draft
 * step after any failed verify is refused.  Must be followed by
 * dsv4_model_spec_draft before the next forward call on these slots when
 * drafts are wanted (any other call forgets the verify's rows).
 */
enum dsv4_err dsv4_model_spec_verify(struct dsv4_model *m, const struct dsv4_spec_batch *b,
                                     const struct dsv4_sample_params *params, int32_t *out_ids,
                                     float *out_lp, const struct dsv4_top_out *top,
                                     int32_t *out_n, float *logits);

/*
 * Draft step after dsv4_model_spec_verify: runs the MTP layer over the
 * verify call's rows and writes each stream's next draft (greedy) to
 * drafts[i] (host, n_seqs of the verify call); logits (host, may be NULL):
 * the MTP layer's logits of those rows, (n_seqs, V).  DSV4_ERR_NOTSUP
 * without an MTP layer; DSV4_ERR_INVAL when the last call was not a verify.
 */
enum dsv4_err dsv4_model_spec_draft(struct dsv4_model *m, int32_t *drafts, float *logits);

/*
 * Decode-state handoff (prefill -> decode, model doc §4).  A slot's state is
 * serialised into a flat host buffer: a fixed header, then for every layer its
 * window ring, its compressed entries and indexer keys up to the sequence's
 * length, and its compressor states; then the MTP layers' rings.  The layout
 * depends only on the config and the sequence length, so both sides agree on
 * sizes.  The layout is part of DSV4_RANK_ABI (ipc/proto.h): a change to it
 * increments that, so that the scheduler keeps ranks of two layouts apart.  On the CPU backend this is a copy; a GPU backend moves the same
 * bytes (CUDA IPC / UCX) and may keep them in device memory.
 */

/* Bytes needed to export a slot whose sequence has `len` tokens. */
size_t dsv4_model_state_size(const struct dsv4_model *m, int len);

/* Export slot `slot` into buf (capacity cap bytes); returns DSV4_ERR_INVAL if
 * cap is too small.  *out_len receives the bytes written. */
enum dsv4_err dsv4_model_state_export(struct dsv4_model *m, int slot, void *buf, size_t cap,
                                      size_t *out_len);

/* Replace slot `slot`'s state by an exported one (checks the header: magic,
 * config fingerprint, length <= max_seq_len, size).  DSV4_ERR_PROTO on a
 * buffer that does not match this model; DSV4_ERR_NOMEM when the paged pools
 * lack the pages (the slot is then empty). */
enum dsv4_err dsv4_model_state_import(struct dsv4_model *m, int slot, const void *buf,
                                      size_t len);

/*
 * The same as dsv4_model_state_export / _import with the buffer in backend
 * memory (a CUDA IPC region, docs/gpu.md "Decode-state handoff over CUDA
 * IPC"): the same byte layout, but the arrays move device to device, all
 * of them in one backend copy_batch call (one kernel on CUDA), and only the
 * header passes through the host.  On the
 * CPU backend backend memory is host memory and these equal the host
 * versions.  dev_buf must be device memory the backend's copy op can read or
 * write (its own allocation, or another process's mapped through CUDA IPC);
 * both return once the copies are complete.  Same errors as the host
 * versions.
 */
enum dsv4_err dsv4_model_state_export_dev(struct dsv4_model *m, int slot, void *dev_buf,
                                          size_t cap, size_t *out_len);
enum dsv4_err dsv4_model_state_import_dev(struct dsv4_model *m, int slot, const void *dev_buf,
                                          size_t len);

/* Pages of the ratio-4 pool (the largest) in use and in all (forward.h). */
void dsv4_model_pages(const struct dsv4_model *m, int *in_use, int *total);

/*
 * Give the model (a rank of a group) its communicator, replacing the one it
 * had: after a member of the group rejoined, the group makes a new one.
 * Size and rank must be the model's; recorded decode graphs (which hold the
 * old communicator's operations) are dropped.  NULL detaches (forward calls
 * then fail with DSV4_ERR_INVAL until a communicator is set).
 */
enum dsv4_err dsv4_model_set_comm(struct dsv4_model *m, struct dsv4_comm *comm);

/* Forget the recorded decode graphs without freeing them: after a
 * communicator was aborted, graphs holding its operations may not be safe
 * to destroy; they are leaked (a few MB per batch size) instead. */
void dsv4_model_abandon_graphs(struct dsv4_model *m);

/*
 * Give back the working memory the backend grew for the calls so far (its
 * trim op, kernels/backend.h; nothing where it has none), after freeing the
 * recorded decode graphs, which may use it (they are recorded again on
 * first use).  The state pools and the model's own buffers stay.  For a
 * rank that lowers its rows per call after a call of the old size left too
 * little device memory for something else.  DSV4_OK, or the backend's
 * error.
 */
enum dsv4_err dsv4_model_trim(struct dsv4_model *m);

/* The graphs (kind of call and batch size) that could not be made for want
 * of device memory at their last try: those calls run ungraphed, slower by
 * their launches, until a later try succeeds. */
int dsv4_model_graphs_refused(const struct dsv4_model *m);

/* Graphs recorded at a later try after such a refusal, since the model was
 * made (the test-only DSV4_TEST_GRAPH_RETRY_CALLS shortens the 1,024 calls
 * to wait, from 1 to 1,024, so that a test sees it). */
long dsv4_model_graphs_again(const struct dsv4_model *m);

/* Number of vocabulary entries (logits row length). */
int dsv4_model_vocab(const struct dsv4_model *m);

#ifdef __cplusplus
}
#endif
#endif
