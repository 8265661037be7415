/*
 * cuda_fast.h — switch between the CUDA backend's exact kernels and its fast
 * decode kernels (kernels/cuda/fast_*.cu; docs/gpu.md, "Fast kernels"),
 * plus two helpers the fast-kernel benchmark needs: expert array
 * registration and event timing on the backend's stream.
 *
 * The exact kernels reproduce the CPU reference bit for bit.  The fast ones
 * follow the same numerics contract (REF: FP8 activation quantization per
 * 128 columns, per-block partial sums times the scales, bf16 outputs where
 * the op says so) with another summation order (inside a 128-column block
 * for the linears, a tree for the reductions of rms_norm and hc), so they
 * differ from the exact path by rounding only (and the router's picks at
 * near ties); they are deterministic (same inputs, same bits, whatever T
 * and the other rows), except that the linear, linear_grouped and the moe
 * switch to the prefill GEMMs (kernels/cuda/fast_gemm.cu) at larger T,
 * which sum in another order: a row may differ in the last bit on the two
 * sides of that switch (never within one side).  DSV4_CUDA_GEMM=off keeps the decode
 * kernels at every T.
 *
 * C-callable; only in builds with CUDA (DSV4_HAVE_CUDA).
 */
#ifndef DSV4_KERNELS_CUDA_FAST_H
#define DSV4_KERNELS_CUDA_FAST_H

#include "common/err.h"
#include "common/weights.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * fast != 0: these ops use the fast kernels where they apply, the exact
 * kernels elsewhere:
 *   linear  FP8 weights under REF numerics (n_out % 32 == 0), BF16 weights
 *           (n_out % 16 == 0); n_in % 128 == 0; weights 16-byte aligned
 *           (FP8 with n_out % 128 == 0 at T > 64: the prefill GEMM where a
 *           cost model of T, N, K prefers it);
 *   linear_grouped  FP8 weights, n_in % 128 == 0, rows per group % 32 == 0,
 *           weights 16-byte aligned (rows per group % 128 == 0 at T > 64:
 *           the prefill GEMM where the cost model prefers it,
 *           kernels/cuda_gemm_grouped.h);
 *   moe     REF numerics, 1 <= k <= 64, FP4 routed experts and an
 *           FP8 shared expert, D and I multiples of 128, and an
 *           expert array registered with the backend (as
 *           dsv4_cuda_weights_upload does, or dsv4_cuda_experts_register):
 *           the decode kernel at T <= 96, and up to DSV4_CUDA_MOE_SPLIT
 *           rows (256) when v3/v5 fit (T*k <= 4096, D and I multiples
 *           of 1024, at most 8192), the prefill GEMM above (FP4
 *           scales 4-byte aligned, at most 4096 experts); moe_parts too;
 *   rms_norm, router  always;
 *   hc_pre  n <= 4 streams; hc_head  n <= 5;
 *   attention  any T, Dh 128, 256 or 512, arrays 16-byte aligned; q and the
 *           key rows are used as bf16 values (the forward's are); outputs
 *           differ from the exact ones by fp32 rounding (another summation
 *           order, online softmax, P as bf16 hi + lo);
 *   indexer_topk  any T, dI 128, nh <= 64, K <= 2048, q and keys 16-byte
 *           aligned; under REF numerics the exact path's picks (set and
 *           order), under HF numerics fp32 rounding differences (picks
 *           may differ at near ties).
 * DSV4_CUDA_FAST_ATTN=0 in the environment keeps the exact attention and
 * indexer_topk with the fast switch on.
 * fast == 0 (the default): exact kernels everywhere.  Takes effect for ops
 * queued afterwards; graphs already recorded keep the kernels they recorded.
 * DSV4_ERR_INVAL when be is not a CUDA backend.
 */
enum dsv4_err dsv4_cuda_set_kernels(struct dsv4_backend *be, int fast);

/* 1 when the fast kernels are on, 0 when not (or be is not CUDA). */
int dsv4_cuda_get_kernels(const struct dsv4_backend *be);

/*
 * 1 when the decode kernels are launched as programmatic dependent launches
 * (PDL: each kernel's blocks scheduled while the previous kernel on the
 * stream finishes; docs/gpu.md, "PDL"): unless DSV4_CUDA_PDL=0 (or off) in the
 * environment, read once per process (default 1).  Same results either way.
 */
int dsv4_cuda_pdl_enabled(void);

/*
 * Register the host array `host` of n experts (structs holding device
 * pointers): a device copy of the structs is made and the moe op finds it
 * by the host array's address, so it reads the experts without a host copy
 * or synchronisation.  Weight uploads do this for a model's arrays; this is
 * for arrays built by hand (tests, benchmarks).  Release with
 * dsv4_cuda_experts_release before freeing `host`.
 */
enum dsv4_err dsv4_cuda_experts_register(struct dsv4_backend *be,
                                         const struct dsv4_expert_w *host, int n);
/* Forget the registration of `host` and free its device copy: an array
 * registered by dsv4_cuda_experts_register only (a weight upload's arrays
 * are left alone: dsv4_cuda_weights_free releases them). */
void dsv4_cuda_experts_release(struct dsv4_backend *be, const struct dsv4_expert_w *host);

/*
 * The prefill GEMMs' Hopper path (kernels/cuda/fast_gemm.cu, wgmma on
 * sm_90): on != 0 uses it where it applies (the MoE at T > 96, FP8 linears
 * and BF16 linears at T > 64 where its cost model prefers it), 0 keeps the
 * mma.sync GEMMs (FP8 linears, MoE) and the decode kernels (BF16 linears);
 * -1 goes back to the environment's choice (DSV4_CUDA_WGMMA=0 or off: not
 * used; default: used).  Process-wide; takes effect for ops queued
 * afterwards.  The two paths sum in another order (a row may differ in the
 * last bit between them).
 */
void dsv4_cuda_set_wgmma(int on);

/*
 * The version of the small fast kernels (the fast hc_pre, hc_head,
 * hc_post_pre, rms_norm and norm_rope; kernels/cuda/fast_hc.cu,
 * fast_norm.cu, fast_fuse.cu): 1 the first kernels, 2 the ones that issue
 * their loads in batches (the same bits as 1), 3 (the default of the hc
 * ops) for the hc ops v2 with the second kernel a programmatic dependent
 * launch, for norm_rope v2 with helper warps for the RoPE angles (calls of
 * up to 256 rows; rms_norm: 2), 4 (the default of rms_norm and norm_rope;
 * the hc ops take it as 3) v3 with a warp per row for larger norm_rope
 * calls of several heads (the prefill's and a decode batch's q); -1 goes
 * back to the environment's choice (DSV4_CUDA_HC=v1|v2|v3 for the hc ops,
 * DSV4_CUDA_NORM=v1|v2|v3|v4 for rms_norm and norm_rope).  All versions
 * give the same bits.  Process-wide; takes effect for ops queued
 * afterwards.  For timing and checking the versions in one process
 * (tests/gpu/bench_fuse.c).
 */
void dsv4_cuda_set_small_kernels(int version);

/*
 * The prefill form of the fast compress (kernels/cuda/fast_attn.cu): calls
 * of more than 64 rows compute their entries in parallel (one launch over
 * the emitting rows, one for the state, one checking that the call fits:
 * each slot's rows one run of consecutive positions; otherwise the
 * one-warp-per-channel loop) with the same bits as the one-warp-per-channel
 * kernel.  on != 0 uses it, 0 keeps the one-warp-per-channel kernel, -1 goes
 * back to the environment's choice (DSV4_CUDA_FC_PREFILL=0 or off: not used;
 * default: used).  Process-wide; takes effect for ops queued afterwards
 * (tests/gpu/bench_fcp.c).
 */
void dsv4_cuda_set_fc_prefill(int on);

/*
 * Kernel nodes of the last graph recorded on be (graph_begin .. graph_end
 * of backend.h, e.g. a decode step's graph), and its nodes of any kind in
 * *nodes (may be NULL); -1 when be is not a CUDA backend.  For counting the
 * launches a decode step makes (tests/gpu/bench_fuse.c).
 */
int dsv4_cuda_graph_kernels(const struct dsv4_backend *be, int *nodes);

/*
 * Nonzero when be's CUDA context is lost: its stream reports an error that
 * is not "not ready" (an illegal address, a launch failure, an MPS client
 * fault: sticky errors after which every call fails), queried without
 * waiting.  0 for a healthy context and for a backend that is not CUDA.  A
 * rank whose context is lost can only exit and be restarted.
 */
int dsv4_cuda_context_lost(struct dsv4_backend *be);

/* Event timer on the backend's stream. */
struct dsv4_cuda_timer;

/* A timer for be; NULL with the error set on failure. */
struct dsv4_cuda_timer *dsv4_cuda_timer_create(struct dsv4_backend *be);
/* Record the start event (queued work before it is not timed). */
enum dsv4_err dsv4_cuda_timer_start(struct dsv4_cuda_timer *t);
/* Record the stop event, wait for it, and give the elapsed GPU time. */
enum dsv4_err dsv4_cuda_timer_stop(struct dsv4_cuda_timer *t, float *ms);
/* Free (NULL is a no-op). */
void dsv4_cuda_timer_destroy(struct dsv4_cuda_timer *t);

/*
 * The form of the fast decode linear (kernels/cuda/fast_linear.cu) on be:
 * one launch per pass of up to 16 tokens (activation preparation and split-K
 * reduction inside the tile kernel) for passes of at most tmax tokens, three
 * launches (prepare, tiles, reduce) for larger passes; tmax 16 is one launch
 * always, 0 (the default: the one-launch form measured slower on the H200)
 * three launches always (DSV4_CUDA_LINEAR at backend creation: "v1" 0,
 * "fused" 16, "fused:N" N).  Both forms give the same bits.
 * Returns the previous tmax, or -1 when be is not a CUDA backend.
 */
int dsv4_cuda_set_linear(struct dsv4_backend *be, int tmax);

/*
 * Whether the three-launch decode linear adds its split-K partials in the
 * tile kernel (in_kernel != 0: the row group's last block, in the order of
 * the reduction kernel, so the same bits; two launches per call instead of
 * three; DSV4_CUDA_LINEAR=v1r at backend creation) or in a third kernel (0,
 * the default).  The one-launch form always adds them in its kernel.
 * Returns the previous setting, or -1 when be is not a CUDA backend.
 */
int dsv4_cuda_set_linear_reduce(struct dsv4_backend *be, int in_kernel);

/*
 * Check the one-launch linear's FP8 activation code (hardware E4M3
 * conversion) against the exact path's expression on all 2^32 float bit
 * patterns (scale 1; f16 bits compared).  *n_bad: the number that differ,
 * *first: the first such bit pattern (when any).  Synchronises the stream.
 */
enum dsv4_err dsv4_cuda_linear_quant_check(struct dsv4_backend *be, uint64_t *n_bad,
                                           uint32_t *first);

/*
 * Check the grouped linear's E4M3 -> bf16 weight decode (fk_e4m3x2_bf16,
 * through the hardware's f16 conversion, and the bit-placement form before
 * it) against the exact decode on all 65,536 pairs of codes but those with
 * the NaN code.  *n_bad: the pairs that differ, *first: the first (low code
 * in the low byte).  Synchronises the stream.
 */
enum dsv4_err dsv4_cuda_linear_e4m3_check(struct dsv4_backend *be, uint64_t *n_bad,
                                          uint32_t *first);

/*
 * Tests: q's n fp32 values (a device array of be's) rounded to bf16 (round
 * to nearest even) into q's first half, and marked as held for the next
 * attention op with q_held set (kernels/backend.h), as linear_norm_rope
 * with q_attn leaves the per-head q under the fast kernels.  DSV4_ERR_INVAL
 * when be is not a CUDA backend.
 */
enum dsv4_err dsv4_cuda_q16_hold(struct dsv4_backend *be, float *q, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
