/*
 * cuda.cuh — private header of the CUDA backend: its state, error checks,
 * the device-side number formats and the 8-lane dot product that reproduce
 * the CPU reference bit for bit, and the ops of each file (table of contents).
 *
 * Numerics.  The CPU backend (kernels/cpu) is the oracle.  Every kernel here
 * performs the same fp32 operations in the same order:
 *   - the whole backend is compiled with --fmad=false, so a*b+c is a rounded
 *     product then a rounded sum, as in the CPU build (no contraction);
 *   - the canonical dot product (cpu_dot: 8 interleaved lane sums, then the
 *     lanes added pairwise l+4, +2, +1) is computed by an aligned group of 8
 *     threads: thread l of the group sums the elements i with i % 8 == l in
 *     order, and three xor-shuffles add the lanes in the same tree
 *     (addition is commutative, so every thread of the group ends with the
 *     same bits);
 *   - expf/log1pf are evaluated in double and rounded to float (the correctly
 *     rounded value but for double-rounding accidents), as the CPU backend
 *     does (cpu_expf, cpu_log1pf); cos/sin are computed in double as the CPU
 *     does; sqrtf and fp32 division are IEEE on both sides.
 * So the ops agree exactly with the CPU backend, unless CUDA's and glibc's
 * double exp round a value lying within a double ulp of a float rounding
 * boundary differently; the op tests (tests/gpu/test_ops_gpu.c) keep small
 * bounds for that case.
 *
 * Memory: backend memory is device memory (cudaMalloc, zero-filled).  Ops
 * that need temporary space take it from one scratch buffer owned by the
 * backend, grown on demand (an outgrown buffer is kept, not freed, until the
 * backend is destroyed: queued work and recorded graphs may still use it;
 * growing never synchronises, so it is allowed while a graph is being
 * recorded, kernels/cuda/cuda_backend.cu).  All work runs
 * on the backend's stream; ops never synchronise except where noted (the
 * moe op on an expert array that dsv4_cuda_weights_upload did not register).
 */
#ifndef DSV4_KERNELS_CUDA_CUDA_CUH
#define DSV4_KERNELS_CUDA_CUDA_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/err.h"
#include "kernels/backend.h"

/* --- state --------------------------------------------------------------- */

/* A device copy of an expert array, registered by dsv4_cuda_weights_upload. */
struct cuda_expert_table {
    const struct dsv4_expert_w *host;   /* key: the host array */
    struct dsv4_expert_w *dev;          /* (n) device copy of the structs */
    int n;
    bool owned;                         /* dev is its own allocation, made by
                                           dsv4_cuda_experts_register (a weight
                                           upload's points into its tables) */
};

#define CUDA_MAX_ARENAS 8   /* weight arenas a backend tells cuda_blas_weights of */

/* Backend state (be->priv). */
struct cuda_state {
    int device;
    int sms;                            /* the device's SM count (cuda_sms) */
    int mps;                            /* 1: the context is an MPS client (cuda_mps) */
    int cc_major;                       /* compute capability major (cuda_sm90) */
    size_t smem_max;                    /* dynamic shared memory a block may have
                                           (cuda_smem_max) */
    int uuid_known;                     /* 1: uuid holds the device's UUID */
    uint8_t uuid[16];                   /* dsv4_cuda_device_uuid's answer, asked
                                           of the runtime once per backend */
    cudaStream_t stream;
    void *scratch;                      /* device scratch, grown on demand */
    size_t scratch_bytes;
    struct cuda_expert_table *tables;   /* registered expert arrays */
    int n_tables, cap_tables;
    void **retired;                     /* outgrown scratch buffers: recorded
                                           graphs may still use them; freed
                                           by destroy or trim */
    int n_retired, cap_retired;
    int fast_kernels;                   /* dsv4_cuda_set_kernels: the ops with
                                           a fast version (fast_*.cu) use it
                                           where it applies (0 = exact) */
    const float *q16;                   /* the x of the last linear_norm_rope
                                           (q_attn) whose rows the fast
                                           kernels left as bf16 in x's first
                                           half, for the attention op after
                                           it (q_held; cuda_q16_take), else
                                           NULL */
    void *batch_host;                   /* copy_batch (cuda_copy.cu): pinned
                                           staging of the piece table */
    size_t batch_bytes;
    cudaEvent_t batch_ev;               /* recorded after the table's upload
                                           (NULL until the first call) */
    long test_graph_nomem;              /* DSV4_CUDA_TEST_GRAPH_NOMEM (test
                                           only): graph_end reports that the
                                           device has no memory for the graph:
                                           always (-1, "1"), or for the first
                                           N graphs ("first:N", counted down) */
    int graph_nodes, graph_kernels;     /* of the last graph_end: all nodes,
                                           kernel nodes (dsv4_cuda_graph_kernels) */
    unsigned *lin_ctr;                  /* fast_linear.cu: the split-K arrival
                                           counters of the one-launch decode
                                           linear (FL_CTRS, zero between its
                                           launches; also fd_kernel's global
                                           form, fast_attention.cu); per
                                           backend, so calls on another
                                           backend's stream never share them
                                           (NULL: three-launch form only, v2
                                           attention as clusters) */
    int lin_tmax;                       /* the one-launch decode linear for
                                           passes of at most this many tokens
                                           (0: three launches always; from
                                           DSV4_CUDA_LINEAR at create, or
                                           dsv4_cuda_set_linear) */
    int lin_red;                        /* the three-launch form adds split-K
                                           in the tile kernel (two launches;
                                           DSV4_CUDA_LINEAR=v1r at create, or
                                           dsv4_cuda_set_linear_reduce) */
    /* The side queue (side_begin / side_end / side_join, kernels/backend.h;
     * cuda_backend.cu).  While its ops are queued (side == 1), `stream` is
     * side_stream and main_stream the backend's own; scratch and lin_ctr
     * are swapped with side_scratch and side_ctr, so each queue has its
     * own. */
    cudaStream_t side_stream;           /* NULL: no side queue */
    cudaStream_t main_stream;
    cudaEvent_t side_ev[2];             /* [0] the fork point on the main
                                           stream, [1] the side's last op */
    int side;                           /* 0 none, 1 side ops being queued,
                                           2 ended, join pending */
    void *side_scratch;
    size_t side_scratch_bytes;
    unsigned *side_ctr;                 /* lin_ctr's second half */
    /* The hc Sinkhorn beside the main stream (cuda_hc_fork / cuda_hc_join;
     * fast_hc.cu): its own stream, fork and done events, and whether a
     * Sinkhorn launched there is not joined yet. */
    cudaStream_t hc_stream;             /* NULL: Sinkhorn in the finish kernel */
    cudaEvent_t hc_ev[2];
    int hc_pending;
    void *blas;                         /* fast_blas.cu: the cuBLASLt handle,
                                           workspace and plans (NULL until
                                           the first call; cuda_blas_fini) */
    /* The weight arenas in use (cuda_weights_tables registers, and
     * dsv4_cuda_weights_free removes, them): fixed once made, so
     * cuda_blas_weights keeps bf16 copies only of weights inside one. */
    const char *arena[CUDA_MAX_ARENAS];
    size_t arena_bytes[CUDA_MAX_ARENAS];
    int n_arena;
};

/* Whether be is a CUDA backend (the entry points that take any backend
 * check this before cuda_st). */
static inline int
cuda_is_backend(const struct dsv4_backend *be)
{
    return be != NULL && be->name != NULL && strcmp(be->name, "cuda") == 0;
}

/* The CUDA state of a CUDA backend (check cuda_is_backend first where be
 * may be another backend's). */
static inline struct cuda_state *
cuda_st(struct dsv4_backend *be)
{
    return (struct cuda_state *)be->priv;
}

/* The stream the backend's ops are queued on now: its own, or the side
 * queue's while side ops are being queued (side_begin .. side_end). */
static inline cudaStream_t
cuda_stream(struct dsv4_backend *be)
{
    return cuda_st(be)->stream;
}

/* The backend's device's SM count (queried once at create; 132, an H100 /
 * H200's, where the query failed): grids that fill the GPU size by it. */
static inline int
cuda_sms(struct dsv4_backend *be)
{
    return cuda_st(be)->sms;
}

/* Whether the backend's device is an sm_90 one (Hopper: the wgmma
 * kernels' target; compute capability queried once at create, 0 where the
 * query failed). */
static inline int
cuda_sm90(struct dsv4_backend *be)
{
    return cuda_st(be)->cc_major == 9;
}

/* The dynamic shared memory one block of be's device may be given: the
 * device's opt-in limit (cudaDevAttrMaxSharedMemoryPerBlockOptin, asked
 * once at create: 227 KB on Hopper, 99 KB on sm_120), lowered by
 * DSV4_CUDA_SMEM_LIMIT (bytes; set to 101376 on a Hopper GPU it makes the
 * fast paths choose as on sm_120, docs/gpu.md "Building for sm_120"). */
static inline size_t
cuda_smem_max(const struct dsv4_backend *be)
{
    return ((const struct cuda_state *)be->priv)->smem_max;
}

/* Whether a kernel of `smem` bytes of dynamic shared memory a block can
 * run on be's device (cuda_smem_max). */
static inline int
cuda_smem_fits(const struct dsv4_backend *be, size_t smem)
{
    return smem <= cuda_smem_max(be);
}

/* Whether the backend's context is an MPS client (cudaDevAttrMpsEnabled,
 * queried once at create): its kernels may get only a share of the SMs and
 * share the block scheduler with another process's, so a grid of one
 * resident CTA a device SM can run in two waves. */
static inline int
cuda_mps(struct dsv4_backend *be)
{
    return cuda_st(be)->mps;
}

/* Whether an attention op's q, with its q_held flag held, is the q the
 * last linear_norm_rope (q_attn) left as bf16 in its first half (cuda_state
 * q16).  The mark is cleared either way: one attention op reads it. */
static inline int
cuda_q16_take(struct dsv4_backend *be, const float *q, int held)
{
    struct cuda_state *st = cuda_st(be);
    int r = held && q != NULL && st->q16 == q;

    st->q16 = NULL;
    return r;
}

/* q's n values, held as bf16 in its first half (cuda_q16_take), widened in
 * place to fp32 (through the scratch; fast_attention.cu): for the attention
 * kernels that read fp32 q. */
enum dsv4_err cuda_q16_widen(struct dsv4_backend *be, const float *q, int64_t n);

/* Wait for every stream of the backend (the main one, the side queue's, the
 * hc Sinkhorn's) before memory they may use is freed; errors are dropped
 * (the caller frees anyway) and the thread's last error cleared. */
void cuda_quiesce(struct dsv4_backend *be);

/* Map a CUDA error to DSV4_ERR_CUDA with the call site in the message. */
enum dsv4_err cuda_err(cudaError_t rc, const char *what, const char *file, int line);

/* Return from the enclosing function on a failed CUDA call. */
#define CUDA_TRY(call)                                                      \
    do {                                                                    \
        cudaError_t rc_ = (call);                                           \
        if (rc_ != cudaSuccess)                                             \
            return cuda_err(rc_, #call, __FILE__, __LINE__);                \
    } while (0)

/* After a launch: the launch error, if any, reported under `name` (the op). */
#define CUDA_LAUNCHED(name)                                                 \
    do {                                                                    \
        cudaError_t rc_ = cudaGetLastError();                               \
        if (rc_ != cudaSuccess)                                             \
            return cuda_err(rc_, name, __FILE__, __LINE__);                 \
    } while (0)

/*
 * Programmatic dependent launch (PDL; docs/gpu.md, "PDL").  With
 * DSV4_CUDA_PDL unset or not "0"/"off" (read once per process; default on),
 * cu_launch launches with cudaLaunchAttributeProgrammaticStreamSerialization,
 * so the kernel's blocks may be scheduled while the kernel before it on the
 * stream is still running (stream capture records a programmatic edge).
 * The invariant: every kernel launched through cu_launch calls cu_pdl_wait()
 * in all its threads before any global memory access (simplest: as its very
 * first statement), and a thread that returns before the wait touches no
 * global memory.  Kernels launched with <<<>>> need nothing.
 */
int cuda_pdl_enabled(void);

/*
 * An on/off switch from the environment: 1 when the variable `name` is
 * "1" or "on", 0 when it is "0" or "off", dflt when unset or anything else.
 * Read at each call (callers cache it).
 */
int cuda_env_switch(const char *name, int dflt);

/*
 * An on/off kernel switch a program may set: the environment variable
 * `env` (cuda_env_switch, read once, `dflt` when unset) unless
 * cuda_switch_set gave a value.  Define one per switch as
 * `static struct cuda_switch x = CUDA_SWITCH("DSV4_CUDA_X", 1);`.
 */
struct cuda_switch {
    const char *env;    /* the variable */
    int dflt;           /* its value when unset */
    int from_env;       /* -1 until read */
    int set;            /* -1: the environment decides */
};
#define CUDA_SWITCH(env, dflt) { (env), (dflt), -1, -1 }

/* on < 0: back to the environment; else on != 0. */
void cuda_switch_set(struct cuda_switch *sw, int on);
/* The switch's value: 1 or 0. */
int cuda_switch_on(struct cuda_switch *sw);

#define CUDA_MAX_DEV 64     /* devices whose per-kernel attributes are remembered */

/*
 * Allow kernel f `smem` bytes of dynamic shared memory on be's device, once
 * per device and size: done (CUDA_MAX_DEV entries, zero at start, one array
 * per kernel) keeps the largest size allowed so far on each device.
 * DSV4_ERR_NOTSUP, and no CUDA call, where smem is more than the device
 * allows a block (cuda_smem_max); the fast paths' checks choose forms that
 * fit, so this is the last guard, not the way a path is turned down.
 */
enum dsv4_err cuda_smem_allow(struct dsv4_backend *be, const void *f, size_t smem,
                              size_t *done);

/*
 * Launch kernel k (grid, block, smem dynamic shared bytes, on stream st) with
 * args, converted to k's parameter types as <<<>>> does; with the PDL
 * attribute when cuda_pdl_enabled().  Returns the launch's error, which also
 * reaches cudaGetLastError as a <<<>>> launch's does, so a call site's
 * CUDA_LAUNCHED check reports it.
 */
template <typename... P, typename... A>
static inline cudaError_t
cu_launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, A... args)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1] = {};

    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    if (cuda_pdl_enabled()) {
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, k, args...);
}

/*
 * A launch configuration of grid x block CTAs (smem dynamic bytes each, on
 * st) in clusters of cs CTAs along x: cfg with one attribute, at[0] (the
 * caller's array of at least one).
 */
static inline void
cu_cluster_cfg(cudaLaunchConfig_t &cfg, cudaLaunchAttribute *at, dim3 grid, dim3 block,
               size_t smem, cudaStream_t st, int cs)
{
    cfg = cudaLaunchConfig_t{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    at[0] = cudaLaunchAttribute{};
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = (unsigned)cs;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
}

/*
 * cu_launch for a kernel run in clusters of cs CTAs along x: *launched = 1
 * once launched; 0 (and cudaSuccess) when the device cannot hold one such
 * cluster (cudaOccupancyMaxActiveClusters), asked while *fits is 0 (the
 * caller's per-device cache: 1 fits, -1 does not), so the caller falls
 * back to another kernel.  The PDL attribute as cu_launch's.
 */
template <typename... P, typename... A>
static inline cudaError_t
cu_launch_cluster(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, int cs,
                  signed char *fits, int *launched, A... args)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[2] = {};
    cudaError_t e;

    *launched = 0;
    cu_cluster_cfg(cfg, at, grid, block, smem, st, cs);
    if (*fits == 0) {
        int n = 0;

        if (cudaOccupancyMaxActiveClusters(&n, k, &cfg) != cudaSuccess) {
            (void)cudaGetLastError();
            n = 0;
        }
        *fits = n > 0 ? 1 : -1;
    }
    if (*fits < 0)
        return cudaSuccess;
    if (cuda_pdl_enabled()) {   /* the kernel waits at its top (cu_pdl_wait) */
        at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[1].val.programmaticStreamSerializationAllowed = 1;
        cfg.numAttrs = 2;
    }
    e = cudaLaunchKernelEx(&cfg, k, args...);
    *launched = e == cudaSuccess;
    return e;
}

/*
 * griddepcontrol.wait: block until every prerequisite grid (the kernel before
 * this one when it was launched with the PDL attribute) has completed and its
 * memory operations are visible.  PTX ISA, "griddepcontrol": ".wait modifier
 * causes the executing thread to wait until all prerequisite grids in flight
 * have completed"; a kernel launched without the attribute starts after its
 * predecessor completed, so no prerequisite grid is in flight and the wait
 * returns at once (a no-op; see also the CUDA programming guide, 4.5
 * "Programmatic Dependent Launch and Synchronization").
 */
static __device__ __forceinline__ void
cu_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" : : : "memory");
#endif
}

/*
 * griddepcontrol.launch_dependents: the next kernel on the stream, when it is
 * launched with the PDL attribute, may be scheduled once every block of this
 * grid has executed this (or exited).  PTX ISA: it "signals that specific
 * dependents the runtime system designated to react to this instruction can
 * be scheduled"; without such a dependent it has no effect.  It orders no
 * memory: the dependent still waits (cu_pdl_wait) for this grid's completion.
 */
static __device__ __forceinline__ void
cu_pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" : : : "memory");
#endif
}

/*
 * Count the calling block in at *ctr, where n blocks of the grid arrive
 * (split-K or split-candidate partials): every thread's global writes are
 * made visible before the count; returns 1 in every thread of the block
 * that arrives last, which has set *ctr back to 0 for the next launch or
 * graph replay (the next kernel on the stream waits for this grid to
 * complete) and may then read the other blocks' writes at L2 (__ldcg).
 * Every thread of the block calls it.
 */
static __device__ __forceinline__ int
cu_block_arrives_last(unsigned *ctr, unsigned n)
{
    __shared__ int last;

    __threadfence();   /* this thread's partials, before the count */
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(ctr, 1u) == n - 1;
        if (last)
            atomicExch(ctr, 0u);   /* all n arrived: ready for the next launch */
        __threadfence();   /* the count, before the partials are read */
    }
    __syncthreads();
    return last;
}

/*
 * The hc Sinkhorn beside the main stream (fast_hc.cu).  cuda_hc_defer_on:
 * whether an hc op being queued now may leave its Sinkhorn to such a
 * stream (the finish kernels then write its input).  cuda_hc_fork:
 * the stream on which the Sinkhorn of the hc op being queued may run beside
 * what the main stream runs next (it waits for everything queued so far),
 * or NULL (no such stream, a side branch being queued, or
 * DSV4_CUDA_HC_DEFER=0: the finish kernel runs it); after launching there,
 * cuda_hc_forked marks the Sinkhorn pending.  cuda_hc_join: the current
 * stream waits for a pending Sinkhorn; every op that may read or write the
 * comb matrix it writes (the hc ops, the copies, sync, graph_end, ...)
 * calls it first, so the matrix is complete before anything touches it.
 */
int cuda_hc_defer_on(struct dsv4_backend *be);
cudaStream_t cuda_hc_fork(struct dsv4_backend *be);
enum dsv4_err cuda_hc_forked(struct dsv4_backend *be);
enum dsv4_err cuda_hc_join(struct dsv4_backend *be);
/* cuda_hc_join, returning its error from the calling op. */
#define TRY_HC_JOIN(be)                              \
    do {                                             \
        enum dsv4_err hj_ = cuda_hc_join(be);        \
        if (hj_ != DSV4_OK)                          \
            return hj_;                              \
    } while (0)

/* Device scratch of at least `bytes` (valid until the next cuda_scratch
 * call); NULL when it cannot be allocated. */
void *cuda_scratch(struct dsv4_backend *be, size_t bytes);

/* Bytes rounded up to 256 (carving several arrays out of one scratch). */
static inline size_t
cuda_align(size_t bytes)
{
    return (bytes + 255) / 256 * 256;
}

/* The registered device copy of the expert array `host`, or NULL. */
const struct cuda_expert_table *cuda_experts_find(struct dsv4_backend *be,
                                                  const struct dsv4_expert_w *host);
/* Register (or replace) the device copy of `host` (n experts); owned: dev
 * is an allocation of its own, which dsv4_cuda_experts_release frees. */
enum dsv4_err cuda_experts_register(struct dsv4_backend *be, const struct dsv4_expert_w *host,
                                    struct dsv4_expert_w *dev, int n, bool owned);
/* Forget the registration of `host` (does not free dev). */
void cuda_experts_unregister(struct dsv4_backend *be, const struct dsv4_expert_w *host);

/* Ownership record of device weights, kept in dev->priv
 * (kernels/cuda/cuda_weights.cu, cuda_synth.cu). */
struct cuda_vmm;
struct cuda_wpriv {
    char *arena;                     /* device: every tensor */
    size_t arena_bytes;
    struct cuda_vmm *vmm;            /* arena made or imported through the VMM
                                        API (cuda_share.cu); NULL: cudaMalloc */
    uint64_t layout;                 /* hash of the tensors' places in the arena */
    struct dsv4_layer_w *layers;     /* host copy */
    struct dsv4_expert_w *experts;   /* host copy, n_layers * E */
    struct dsv4_expert_w *dev_experts; /* device copy of the same */
    struct dsv4_expert_w *dev_shared;  /* device copies of layers[l].shared */
    int n_layers, E;
};

/* Copy p's expert arrays and shared-expert structs to the device and
 * register them with the backend (the moe op finds them there). */
enum dsv4_err cuda_weights_tables(struct dsv4_backend *be, struct cuda_wpriv *p);

/* The arena of p for `bytes` (p->layout already computed): cudaMalloc'd
 * when a is NULL or private, else made shareable or imported (a->kind;
 * kernels/cuda_share.h, cuda_share.cu).  Sets p->arena, p->arena_bytes and
 * p->vmm.  `what` starts the error messages. */
struct dsv4_cuda_arena;
enum dsv4_err cuda_arena_alloc(struct dsv4_backend *be, struct cuda_wpriv *p, size_t bytes,
                               const struct dsv4_cuda_arena *a, const char *what);
/* Release what cuda_arena_alloc made (the caller has synchronised). */
void cuda_arena_free(struct cuda_wpriv *p);
/* Whether a says to place the tensors without writing them (IMPORT). */
int cuda_arena_import(const struct dsv4_cuda_arena *a);

/* Report progress through pr (NULL or pr->fn NULL: nothing). */
struct dsv4_cuda_progress;
void cuda_progress(const struct dsv4_cuda_progress *pr, uint64_t done, uint64_t total);

/* Blocks for n items at `per` items per block. */
static inline unsigned
cuda_blocks(int64_t n, int64_t per)
{
    int64_t b = (n + per - 1) / per;

    return (unsigned)(b < 1 ? 1 : (b > 0x7fffffff ? 0x7fffffff : b));
}

/* --- device number formats (common/formats.h, bit for bit) ---------------- */

static __device__ __forceinline__ float
cu_bf16_to_f32(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

/* Round-to-nearest-even to bf16, NaN stays (quiet) NaN. */
static __device__ __forceinline__ float
cu_bf16_round(float f)
{
    uint32_t u = __float_as_uint(f);

    if ((u & 0x7fffffffu) > 0x7f800000u)
        return __uint_as_float(((u >> 16) | 0x40u) << 16);
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

/* bf16(lo) in the low half and bf16(hi) in the high half of one word
 * (cu_bf16_round's rounding): two values as a bf16 pair. */
static __device__ __forceinline__ uint32_t
cu_bf16x2_round(float lo, float hi)
{
    return __float_as_uint(cu_bf16_round(lo)) >> 16 |
           (__float_as_uint(cu_bf16_round(hi)) & 0xffff0000u);
}

/* E4M3 code -> value (NaN for S.1111.111). */
static __device__ __forceinline__ float
cu_fp8_to_f32(uint8_t v)
{
    int e = (v >> 3) & 15, m = v & 7;
    float a;

    if (e == 15 && m == 7)
        return __int_as_float(0x7fc00000);
    a = e == 0 ? (float)m * (1.0f / 512.0f) : ldexpf(1.0f + (float)m * 0.125f, e - 7);
    return (v & 0x80) ? -a : a;
}

/* E8M0 -> 2^(e-127), NaN for 0xff. */
static __device__ __forceinline__ float
cu_e8m0_to_f32(uint8_t e)
{
    if (e == 0xff)
        return __int_as_float(0x7fc00000);
    if (e == 0)
        return __uint_as_float(0x00400000u);   /* 2^-127, subnormal */
    return __uint_as_float((uint32_t)e << 23);
}

/* E2M1 code (4 bits) -> value. */
static __device__ __forceinline__ float
cu_fp4_to_f32(unsigned c)
{
    unsigned e = (c >> 1) & 3, m = c & 1;
    float a = e == 0 ? 0.5f * (float)m : (1.0f + 0.5f * (float)m) * (float)(1u << (e - 1));

    return (c & 8) ? -a : a;
}

/* dsv4_f32_to_fp8: RNE, saturating to +-448, NaN -> 0x7f. */
static __device__ __forceinline__ uint8_t
cu_f32_to_fp8(float f)
{
    uint8_t sign;
    float a;
    int e, q;

    if (isnan(f))
        return 0x7f;
    sign = signbit(f) ? 0x80 : 0x00;
    a = fabsf(f);
    if (a >= 448.0f)
        return sign | 0x7e;
    if (a < 0x1p-6f) {
        q = (int)rintf(a * 512.0f);
        return sign | (uint8_t)q;
    }
    (void)frexpf(a, &e);
    q = (int)rintf(ldexpf(a, 3 - (e - 1)));
    return sign | (uint8_t)((e - 1 + 7) * 8 + q - 8);
}

/*
 * x (finite, |x| <= 448) rounded to the nearest E4M3 value, ties to even:
 * cu_fp8_to_f32(cu_f32_to_fp8(x)), on sm_89 and later by the hardware's
 * conversions (RN to E4M3 and back through f16, which holds every E4M3
 * value exactly).  Only a NaN's payload could differ from the composition.
 */
static __device__ __forceinline__ float
cu_fp8_round(float x)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short p;
    uint32_t h2;

    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(p) : "f"(0.0f), "f"(x));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(p));
    return __half2float(__ushort_as_half((unsigned short)(h2 & 0xffffu)));
#else
    return cu_fp8_to_f32(cu_f32_to_fp8(x));
#endif
}

/* dsv4_f32_to_fp4: nearest E2M1 code, ties to the even code, clamps to 6. */
static __device__ __forceinline__ unsigned
cu_f32_to_fp4(float f)
{
    unsigned sign, c;
    float a;

    if (isnan(f))
        return 0;
    sign = signbit(f) ? 8u : 0u;
    a = fabsf(f);
    if (a <= 0.25f)
        c = 0;
    else if (a < 0.75f)
        c = 1;
    else if (a <= 1.25f)
        c = 2;
    else if (a < 1.75f)
        c = 3;
    else if (a <= 2.5f)
        c = 4;
    else if (a < 3.5f)
        c = 5;
    else if (a <= 5.0f)
        c = 6;
    else
        c = 7;
    return sign | c;
}

/* dsv4_pow2_scale: 2^ceil(log2(amax / qmax)). */
static __device__ __forceinline__ float
cu_pow2_scale(float amax, float qmax)
{
    float r = amax / qmax, m;
    int e;

    if (!(r > 0.0f) || isinf(r))
        return r;
    m = frexpf(r, &e);
    return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

static __device__ __forceinline__ float
cu_clampf(float v, float lim)
{
    return v > lim ? lim : (v < -lim ? -lim : v);
}

/* dsv4_fp8_sim of `block` values at v by one warp (lane of 32): the
 * block's power-of-two scale from its amax, each value through E4M3 and
 * back, bf16-rounded (fp8_sim_kernel, and the fused norm_rope's sim). */
static __device__ __forceinline__ void
cu_fp8_sim_block(float *v, int block, int lane)
{
    float amax = 1e-4f, s;

    for (int i = lane; i < block; i += 32)
        amax = fmaxf(amax, fabsf(v[i]));
    for (int o = 16; o > 0; o /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    s = cu_pow2_scale(amax, 448.0f);
    for (int i = lane; i < block; i += 32)
        v[i] = cu_bf16_round(cu_fp8_to_f32(cu_f32_to_fp8(cu_clampf(v[i] / s, 448.0f))) * s);
}

/* The RoPE factors of position p (as float) and frequency f: the angle
 * p * f in fp32, its cos / sin in double rounded to fp32, sin negated when
 * `inverse` (rope_kernel's expressions, which define the op; cu_rope_pair). */
static __device__ __forceinline__ void
cu_rope_cs(float p, float f, int inverse, float &cs, float &sn)
{
    float ang = p * f;

    cs = (float)cos((double)ang);
    sn = (float)sin((double)ang);
    if (inverse)
        sn = -sn;
}

/* Element `odd` of the pair (u, v) rotated by (cs, sn), bf16-rounded. */
static __device__ __forceinline__ float
cu_rope_elem(float u, float v, float cs, float sn, int odd)
{
    return odd ? cu_bf16_round(u * sn + v * cs) : cu_bf16_round(u * cs - v * sn);
}

/* The pair (u, v) rotated by (cs, sn) in place, each output bf16-rounded. */
static __device__ __forceinline__ void
cu_rope_rot(float &u, float &v, float cs, float sn)
{
    float a = u, b = v;

    u = cu_rope_elem(a, b, cs, sn, 0);
    v = cu_rope_elem(a, b, cs, sn, 1);
}

/* RoPE of the pair (u, v) at position p by frequency f, in place (rope_kernel). */
static __device__ __forceinline__ void
cu_rope_pair(float &u, float &v, float p, float f, int inverse)
{
    float cs, sn;

    cu_rope_cs(p, f, inverse, cs, sn);
    cu_rope_rot(u, v, cs, sn);
}

/* expf / log1pf through double (see the file comment). */
static __device__ __forceinline__ float
cu_expf(float x)
{
    return (float)exp((double)x);
}

static __device__ __forceinline__ float
cu_log1pf(float x)
{
    return (float)log1p((double)x);
}

/* The SwiGLU of the MoE on the fp32 sums g, u of w1, w3 (the exact path's
 * expression, which every fast MoE kernel repeats bit for bit): both
 * rounded to bf16, g <= lim and |u| <= lim when lim > 0, silu(g) * u (not
 * rounded). */
static __device__ __forceinline__ float
cu_swiglu(float g, float u, float lim)
{
    float gv = cu_bf16_round(g), uv = cu_bf16_round(u);

    if (lim > 0.0f) {
        gv = gv < lim ? gv : lim;
        uv = uv < -lim ? -lim : uv > lim ? lim : uv;
    }
    return gv / (1.0f + cu_expf(-gv)) * uv;
}

/* --- the canonical dot product on 8 lanes ---------------------------------- */

/* Add the partial sums of an aligned 8-thread group in cpu_dot's pairwise
 * order; every thread of the warp must call it. */
static __device__ __forceinline__ float
cu_lanes8_sum(float v)
{
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v;
}

/* cpu_dot(a, b, n) on the 8-thread group of lane l8 (0..7). */
static __device__ __forceinline__ float
cu_dot8(const float *a, const float *b, int n, int l8)
{
    float acc = 0.0f;

    for (int i = l8; i < n; i += 8)
        acc += a[i] * b[i];
    return cu_lanes8_sum(acc);
}

/* Real value (code times scale, exact) of weight element (n, k) of W. */
static __device__ __forceinline__ float
cu_weight(const struct dsv4_linear &W, int64_t n, int k)
{
    int K = W.n_in;

    switch (W.fmt) {
    case DSV4_WFMT_FP8: {
        int ns = (K + 127) / 128;
        uint8_t c = ((const uint8_t *)W.w)[n * K + k];

        return cu_fp8_to_f32(c) * cu_e8m0_to_f32(W.scale[(n / 128) * ns + k / 128]);
    }
    case DSV4_WFMT_FP4: {
        uint8_t b = ((const uint8_t *)W.w)[n * (K / 2) + k / 2];

        return cu_fp4_to_f32((k & 1) ? (b >> 4) : (b & 0x0f)) *
               cu_e8m0_to_f32(W.scale[n * (K / 32) + k / 32]);
    }
    default:
        return cu_bf16_to_f32(((const uint16_t *)W.w)[n * K + k]);
    }
}

/*
 * Output n of a linear for one activation row, on the 8-thread group of lane
 * l8 (cpu_lin_rows): with scales sx (REF, FP8/FP4 weights; xr holds the FP8
 * values) the sum runs per 128 columns and each block's dot is multiplied by
 * its scale before it is added; otherwise one dot over the whole row.
 * round_x: x is rounded to bf16 first (linear_grouped).
 */
static __device__ __forceinline__ float
cu_lin_dot(const struct dsv4_linear &W, int64_t n, const float *xr, const float *sx, int l8,
           int round_x)
{
    int K = W.n_in;

    if (sx != NULL) {
        float acc = 0.0f;

        for (int b = 0; b < K / 128; b++) {
            float v = 0.0f;

            for (int i = b * 128 + l8; i < b * 128 + 128; i += 8)
                v += xr[i] * cu_weight(W, n, i);
            acc += sx[b] * cu_lanes8_sum(v);
        }
        return acc;
    } else {
        float v = 0.0f;

        for (int i = l8; i < K; i += 8) {
            float xv = round_x ? cu_bf16_round(xr[i]) : xr[i];

            v += xv * cu_weight(W, n, i);
        }
        return cu_lanes8_sum(v);
    }
}

/* --- linear helpers (cuda_linear.cu) --------------------------------------- */

/*
 * FP8 activation quantization (dsv4_fp8_quant_block per 128 columns) of x
 * (rows, K) with row stride `stride` into xq (rows, K) FP8 values and sx
 * (rows, K/128) scales.  K % 128 == 0.
 */
enum dsv4_err cuda_quant_rows(struct dsv4_backend *be, float *xq, float *sx, const float *x,
                              int64_t stride, int rows, int K);

/* Whether linear with weight format fmt quantizes its input (REF, FP8/FP4). */
static inline int
cuda_lin_quantizes(const struct dsv4_backend *be, enum dsv4_wfmt fmt)
{
    return be->numerics == DSV4_NUMERICS_REF && fmt != DSV4_WFMT_BF16;
}

/* --- ops, by file ------------------------------------------------------------ */
/* Each implements the kernels/backend.h op of the same name. */

/* cuda_linear.cu */
enum dsv4_err cuda_linear(struct dsv4_backend *be, float *out, const float *x,
                          const struct dsv4_linear *W, int T, unsigned flags);
enum dsv4_err cuda_linear_grouped(struct dsv4_backend *be, float *out, const float *x,
                                  const struct dsv4_linear *Wa, int T, int G);
/* 1 when cuda_linear_grouped runs this call on the fast decode linear
 * (cuda_fast_linear_grouped), its choice for every such call. */
int cuda_linear_grouped_decode(struct dsv4_backend *be, const struct dsv4_linear *Wa, int T,
                               int G);
enum dsv4_err cuda_linear_multi(struct dsv4_backend *be, int n, float *const *outs,
                                const float *x, const struct dsv4_linear *const *Ws,
                                const unsigned *flags, int T);

/* cuda_norm.cu */
enum dsv4_err cuda_rms_norm(struct dsv4_backend *be, float *out, const float *x,
                            const uint16_t *w, int rows, int D, float eps);
enum dsv4_err cuda_rope(struct dsv4_backend *be, float *x, const int32_t *pos, int T,
                        int n_heads, int64_t row_stride, int64_t head_stride, int off, int rd,
                        const float *freqs, int inverse);
enum dsv4_err cuda_fp8_sim(struct dsv4_backend *be, float *x, int rows, int64_t stride,
                           int n_cols, int block);
enum dsv4_err cuda_hadamard_fp4(struct dsv4_backend *be, float *x, int rows);

/* cuda_hc.cu */
enum dsv4_err cuda_hc_pre(struct dsv4_backend *be, float *x_out, float *post, float *comb,
                          const float *X, const struct dsv4_hc_w *hc, int T, int n, int D,
                          int iters, float hc_eps, float norm_eps);
enum dsv4_err cuda_hc_post(struct dsv4_backend *be, float *X_out, const float *f,
                           const float *X, const float *post, const float *comb, int T, int n,
                           int D);
enum dsv4_err cuda_hc_head(struct dsv4_backend *be, float *x_out, const float *X,
                           const struct dsv4_hc_w *hc, int T, int n, int D, float hc_eps,
                           float norm_eps);

/* Pool row of entry e of slot s (dsv4_pool_row of kernels/backend.h). */
static __device__ __forceinline__ int64_t
cu_pool_row(const int32_t *pages, int cap, int s, int e)
{
    if (pages == NULL)
        return (int64_t)s * cap + e;
    return (int64_t)pages[(int64_t)s * (cap / DSV4_PAGE_ENTRIES) + e / DSV4_PAGE_ENTRIES] *
               DSV4_PAGE_ENTRIES + e % DSV4_PAGE_ENTRIES;
}

/* cuda_attn.cu */
enum dsv4_err cuda_compress(struct dsv4_backend *be, float *entries, float *state_kv,
                            float *state_z, const float *a, const float *z, const float *ape,
                            const int32_t *slot, const int32_t *pos, const int32_t *emit,
                            int T, int r, int d);
enum dsv4_err cuda_indexer_topk(struct dsv4_backend *be, int32_t *sel, const float *q,
                                const float *w, const float *keys,
                                const int32_t *pages, const int32_t *slot,
                                const int32_t *pos, int T, int nh, int dI, int cap, int ratio,
                                int K);
enum dsv4_err cuda_attention(struct dsv4_backend *be, float *out, const float *q,
                             const float *kv, const float *ring, const float *comp,
                             const int32_t *pages,
                             const int32_t *sel, const float *sink, const int32_t *slot,
                             const int32_t *pos, const int32_t *row0, const int32_t *pos0,
                             int T, int H, int Dh, int win, int cap, int ratio, int K,
                             float scale);
/* backend.h attention_unrope (rd = 0: attention alone; cuda_attention is
 * that): the fast attention with the output's inverse RoPE
 * (cuda_fast_attention's ur_*), or the exact kernels and rope_kernel. */
enum dsv4_err cuda_attention_unrope(struct dsv4_backend *be, const struct dsv4_attn *a, int off,
                                    int rd, const float *freqs);
/* attention_out (backend.h): cuda_fast_attention_out where it takes the
 * call, else attention_unrope and linear_grouped. */
enum dsv4_err cuda_attention_out(struct dsv4_backend *be, const struct dsv4_attn *a, int off,
                                 int rd, const float *freqs, float *u,
                                 const struct dsv4_linear *wo_a, int G);

/* cuda_moe.cu */
enum dsv4_err cuda_router(struct dsv4_backend *be, float *weights, int32_t *ids,
                          const float *x, const struct dsv4_linear *gate, const float *bias,
                          const int64_t *tid2eid, const int32_t *tokens, int T, int k,
                          float route_scale);
enum dsv4_err cuda_moe(struct dsv4_backend *be, float *out, const float *x, const int32_t *ids,
                       const float *weights, const struct dsv4_expert_w *experts,
                       const struct dsv4_expert_w *shared, int T, int k, float swiglu_limit);
enum dsv4_err cuda_moe_parts(struct dsv4_backend *be, float *y, const float *x,
                             const int32_t *ids, const float *weights,
                             const struct dsv4_expert_w *experts,
                             const struct dsv4_expert_w *shared, int T, int k, int D,
                             float swiglu_limit);
enum dsv4_err cuda_moe_combine(struct dsv4_backend *be, float *out, const float *y,
                               const int32_t *ids, int T, int k, int D);
/* cuda_moe_combine with y's rows as bf16 bits (the fast prefill MoE's own
 * rows, whose values are bf16-rounded anyway): the same sums (cuda_moe.cu). */
enum dsv4_err cuda_moe_combine16(struct dsv4_backend *be, float *out, const uint16_t *y,
                                 const int32_t *ids, int T, int k, int D);

/* fast_linear.cu, fast_moe.cu: the fast decode kernels (kernels/cuda_fast.h);
 * cuda_linear / cuda_moe call them when st->fast_kernels is set and the
 * _ok predicate holds (host-side checks only, no synchronisation). */
int cuda_fast_linear_ok(const struct dsv4_backend *be, const struct dsv4_linear *W);
/* At backend creation: the decode linear's counters (st->lin_ctr, zeroed on
 * the stream) and its form from DSV4_CUDA_LINEAR (unset, "v1" or anything
 * else: three launches; "v1r": two, the split-K reduction in the tile
 * kernel; "fused": one launch; "fused:N": one launch for passes of at most
 * N tokens (1..16), three above).  Never fails: without counters the
 * split-K shapes take the three-launch form.  fini frees the counters
 * (stream synchronised by the caller). */
void cuda_fast_linear_init(struct dsv4_backend *be);
void cuda_fast_linear_fini(struct dsv4_backend *be);

/*
 * fast_blas.cu: linear_grouped (wo_a) of prefill calls through cuBLASLt's
 * BF16 GEMM — W (G * R, K) FP8 with 128x128 block scales decoded once a
 * call to bf16, x rounded to bf16, out the bf16-rounded fp32 outputs
 * (cuda_fast_gemm_grouped's contract, kernels/cuda_gemm_grouped.h).  Any
 * T >= 0.  DSV4_ERR_NOTSUP when switched off (DSV4_CUDA_BLAS=0,
 * dsv4_cuda_set_blas; dsv4_cuda_blas_on in kernels/cuda_gemm_grouped.h),
 * when libcublasLt cannot be opened, for other shapes or when cuBLASLt has
 * no algorithm: the caller then takes fw_kernel.
 * Uses the backend scratch (2 N K + 2 T G K + 2 T N bytes).
 */
enum dsv4_err cuda_blas_grouped(struct dsv4_backend *be, float *out, const float *x,
                                const struct dsv4_linear *W, int T, int G);
/* cuda_blas_grouped's checks alone: 1 when it takes W (FP8, R = n_out / G
 * a multiple of 128) on be (cuBLASLt there, a plan for the shape). */
int cuda_blas_grouped_ready(struct dsv4_backend *be, const struct dsv4_linear *W, int G);
/* Scratch bytes of cuda_blas_grouped_b16 at T rows (the weights' decode
 * where no kept copy serves, the GEMM's bf16 output). */
size_t cuda_blas_grouped_b16_scratch(const struct dsv4_linear *W, int T);
/* cuda_blas_grouped from x already in bf16 (xb (T, G K), the op's rounding
 * of x), scratch sc of cuda_blas_grouped_b16_scratch bytes (the caller's;
 * nothing else of the backend scratch is touched).  The caller has checked
 * cuda_blas_grouped_ready. */
enum dsv4_err cuda_blas_grouped_b16(struct dsv4_backend *be, float *out, const uint16_t *xb,
                                    const struct dsv4_linear *W, int T, int G,
                                    unsigned char *sc);
/* cuda_fast_gemm_grouped (fast_gemm.cu) on cuBLASLt when blas != 0 (and
 * cuda_blas_grouped takes the call), else on fw_kernel's grouped mode:
 * cuda_linear_grouped passes blas only from DSV4_CUDA_BLAS_MIN_T rows. */
enum dsv4_err cuda_fast_gemm_grouped_run(struct dsv4_backend *be, float *out, const float *x,
                                         const struct dsv4_linear *W, int T, int G, int blas);
/* Frees the backend's cuBLASLt state (destroy). */
void cuda_blas_fini(struct dsv4_backend *be);

/* fast_blas.cu's pieces (the shared expert of fast_gemm.cu's fw_moe; whether
 * cuBLASLt is there at all: dsv4_cuda_blas_usable, kernels/cuda_gemm_grouped.h). */
/* W (N, K) FP8, 128x128 E8M0 block scales, K % 128 == 0 -> the exact bf16
 * values (N, K) in wb; perm: column k of each row at fw_perm(k)
 * (fast_gemm.cuh), fw_kernel's B order.  Queued on the backend stream. */
enum dsv4_err cuda_blas_decode(struct dsv4_backend *be, uint16_t *wb,
                               const struct dsv4_linear *W, int perm);
/* The bf16 values of W1 and, when W3 != NULL, of W3 after them (rows of
 * W1, then rows of W3: cuda_blas_decode's, perm as there) for a GEMM: a copy
 * kept from an earlier call with the same weights, or one made now and kept
 * (within DSV4_CUDA_BLAS_KEEP_MB, default 4,096, while 8 GiB of device
 * memory stay free, only of weights inside a noted arena and not while the
 * queue is recorded; the call waits for a new copy's decode, so that any
 * queue may read it), or else decoded into wb (scratch the caller owns) for
 * this call only.  NULL (dsv4 error set) when the decode cannot take W1 or
 * W3.  Same values either way. */
const uint16_t *cuda_blas_weights(struct dsv4_backend *be, uint16_t *wb,
                                  const struct dsv4_linear *W1, const struct dsv4_linear *W3,
                                  int perm);
/* Frees the kept copies (cuda_blas_weights): called when device weights are
 * freed (dsv4_cuda_weights_free), as new ones may land at the same
 * addresses.  Synchronizes the backend stream first. */
void cuda_blas_weights_drop(struct dsv4_backend *be);
/* Tell the backend that [base, base + bytes) holds weights that stay as they
 * are until cuda_arena_forget (only such weights get kept copies; others, as
 * the tests' buffers, may be overwritten or freed and reused). */
void cuda_arena_note(struct dsv4_backend *be, const void *base, size_t bytes);
void cuda_arena_forget(struct dsv4_backend *be, const void *base);
/* out (T, G R) bf16 = per group g: wb rows g R .. (R, K) times xb (T, G K)
 * columns g K .. , fp32 sums rounded to bf16; cuBLASLt with one algorithm
 * per (R, K, G) (chosen at 2,048 columns, no split-K: rows T-independent).
 * DSV4_ERR_NOTSUP when cuBLASLt cannot take it (nothing queued). */
enum dsv4_err cuda_blas_gemm(struct dsv4_backend *be, uint16_t *out, const uint16_t *wb,
                             const uint16_t *xb, int R, int K, int G, int T);
/* Token columns of an FP8 call are a multiple of this (cuBLASLt's scales of x
 * are (K / 128, T) column-major; the caller pads T with zero rows). */
#define BL_FP8_ROWS 16
/* 1 when cuda_blas_fp8 can take W (N, K) FP8 on this backend: the cuBLASLt
 * path on, the library there, an algorithm for the shape (N, K multiples of
 * 128).  Queues nothing. */
int cuda_blas_fp8_ready(struct dsv4_backend *be, int N, int K);
/* out (T, N) bf16 = per 128-column block k the tensor cores' sum of the E4M3
 * code products of xq row t (T, K; row-major) and W row n, times ws[n / 128
 * * (K / 128) + k] * sx[k * T + t] (fp32 scales: W's block scales as values,
 * x's one per token and block, column-major), blocks summed in fp32,
 * rounded to bf16.  cuBLASLt's FP8 block-scaled GEMM (sm_90) with one
 * algorithm per (N, K) chosen at 2,048 columns, no split-K: each row depends
 * on its own token only.  T % BL_FP8_ROWS == 0.  DSV4_ERR_NOTSUP when
 * cuBLASLt cannot take it (nothing queued). */
enum dsv4_err cuda_blas_fp8(struct dsv4_backend *be, uint16_t *out, const struct dsv4_linear *W,
                            const float *ws, const uint8_t *xq, const float *sx, int T);
/* The BF16 linear of prefill calls (cuda_fast_gemm_bf16's contract,
 * fast_gemm.cuh) on cuBLASLt: x split into bf16 hi + lo (scratch from `off`
 * bytes into the backend scratch: 2 T K bf16), out = W hi then out += W lo
 * (fp32 sums, one algorithm per (N, K) chosen at 2,048 columns, no split-K:
 * rows T-independent), rounded to bf16 unless flags has DSV4_LIN_F32_OUT.
 * DSV4_ERR_NOTSUP (nothing queued) when switched off (DSV4_CUDA_BLAS,
 * DSV4_CUDA_BLAS_BF16), for other shapes or alignments, or without an
 * algorithm.  split == 0: hi + lo are already there, from a call on the
 * same x, T, n_in and off queued before with no other use of the scratch
 * since (cuda_linear_multi's prefill form). */
enum dsv4_err cuda_blas_bf16(struct dsv4_backend *be, float *out, const float *x,
                             const struct dsv4_linear *W, int T, unsigned flags, size_t off,
                             int split);
/* out[i] = the bf16 value ob[i] (n values, n % 4 == 0, 16-byte aligned). */
enum dsv4_err cuda_blas_widen(struct dsv4_backend *be, float *out, const uint16_t *ob,
                              int64_t n);
enum dsv4_err cuda_fast_linear(struct dsv4_backend *be, float *out, const float *x,
                               const struct dsv4_linear *W, int T, unsigned flags);
/* linear_multi on the fast decode linear: one activation preparation per
 * weight format (FP8 quantization, BF16 split), one tile launch per format
 * over all the linears' blocks, one launch adding the split-K partials of
 * all; each linear's split, tiles and sums are those of its own
 * cuda_fast_linear call, so the outputs are the same bits.  The caller
 * checks: 1 <= n <= DSV4_LINEAR_MULTI_MAX, 1 <= T <= 16 (one pass of
 * tokens), every Ws[i] cuda_fast_linear_ok with the same n_in. */
enum dsv4_err cuda_fast_linear_multi(struct dsv4_backend *be, int n, float *const *outs,
                                     const float *x, const struct dsv4_linear *const *Ws,
                                     const unsigned *flags, int T);
/* experts: host array of n structs (device pointers); shared may be NULL.
 * parts: moe_parts' case (experts without weights are not held here and
 * are skipped; shared NULL is allowed). */
int cuda_fast_moe_ok(const struct dsv4_backend *be, const struct dsv4_expert_w *experts, int n,
                     const struct dsv4_expert_w *shared, int T, int k, int D, int I,
                     int parts);
/* Whether the decode MoE (fast_moe.cu / fast_moe3.cu) takes a call of T
 * tokens of these shapes, so that the prefill GEMM (fast_gemm.cu) leaves it
 * alone: T <= 96 (every version), or T up to DSV4_CUDA_MOE_SPLIT (default
 * 256) when v3 / v5 is selected and fits.  Up to a few hundred tokens the
 * experts average a few rows each, a bandwidth-bound load v5 streams faster
 * than the GEMM reads it (H200, docs/perf.md run 23: a 4-layer prefill of
 * 128 tokens 14.4 -> 8.4 ms, 256 16.5 -> 12.4 ms; 512 21.0 -> 22.6 ms, so
 * the GEMM keeps 512 and up). */
int cuda_fast_moe_takes(int T, int k, int D, int I);
/* table: device copy of the n_table expert structs (registered); shared:
 * host struct of device pointers, or NULL.  parts != NULL: moe_parts into
 * that (T*k + T, D) array, zeroed by the caller (rows of experts not held
 * stay zero), no combine. */
enum dsv4_err cuda_fast_moe(struct dsv4_backend *be, float *out, float *parts, const float *x,
                            const int32_t *ids, const float *weights,
                            const struct dsv4_expert_w *table, int n_table,
                            const struct dsv4_expert_w *shared, int T, int k, int D, int I,
                            float lim);

/* fast_gemm.cu: the prefill GEMMs (tensor-core tiles of 64/128 rows x 128
 * weight rows), used before the decode kernels when their _ok predicate
 * holds (host-side checks only; DSV4_CUDA_GEMM=off turns them off).
 * linear: FP8 weights under REF numerics, n_out % 128 == 0, n_in % 128 == 0,
 * weights 16-byte aligned, T > 16 and the GEMM cheaper than the decode
 * kernel by a cost model of T, N and K. */
int cuda_fast_gemm_linear_ok(const struct dsv4_backend *be, const struct dsv4_linear *W, int T);
enum dsv4_err cuda_fast_gemm_linear(struct dsv4_backend *be, float *out, const float *x,
                                    const struct dsv4_linear *W, int T);
/* moe / moe_parts at T > 96 (the decode MoE's bound): the arguments and
 * conditions of cuda_fast_moe_ok / cuda_fast_moe (FP4 scales 4-byte aligned
 * too, at most 4096 experts). */
int cuda_fast_gemm_moe_ok(const struct dsv4_backend *be, const struct dsv4_expert_w *experts,
                          int n, const struct dsv4_expert_w *shared, int T, int k, int D, int I,
                          int parts);
enum dsv4_err cuda_fast_gemm_moe(struct dsv4_backend *be, float *out, float *parts,
                                 const float *x, const int32_t *ids, const float *weights,
                                 const struct dsv4_expert_w *table, int n_table,
                                 const struct dsv4_expert_w *shared, int T, int k, int D, int I,
                                 float lim);

/* fast_linear.cu (grouped), fast_norm.cu, fast_hc.cu, fast_router.cu: the
 * fast versions of linear_grouped, rms_norm, hc_pre / hc_head and router,
 * called by the ops of the same name when st->fast_kernels is set (and the
 * _ok predicate holds where there is one). */
int cuda_fast_linear_grouped_ok(const struct dsv4_linear *W, int G);
enum dsv4_err cuda_fast_linear_grouped(struct dsv4_backend *be, float *out, const float *x,
                                       const struct dsv4_linear *W, int T, int G);
/* Scratch bytes of the fast linear for W at T tokens (G > 0: grouped). */
size_t cuda_fast_linear_scratch(const struct dsv4_linear *W, int T, int G);
/* cuda_fast_linear_grouped with x's bf16 values already in place: at byte
 * off of the backend scratch, where the linear's own layout (placed at off,
 * as cuda_fast_linear_at) keeps bf16(x) first, (T, G * W->n_in); the caller
 * reserved off + cuda_fast_linear_scratch(W, T, G) bytes. */
enum dsv4_err cuda_fast_linear_grouped_b16(struct dsv4_backend *be, float *out,
                                           const struct dsv4_linear *W, int T, int G,
                                           size_t off);
enum dsv4_err cuda_fast_rms_norm(struct dsv4_backend *be, float *out, const float *x,
                                 const uint16_t *w, int rows, int D, float eps);
/* head: the hc_head form (n mix rows; post, comb unused). */
int cuda_fast_hc_ok(int n, int head);
enum dsv4_err cuda_fast_hc(struct dsv4_backend *be, float *x_out, float *post, float *comb,
                           const float *X, const struct dsv4_hc_w *hc, int T, int n, int D,
                           int iters, float hc_eps, float norm_eps, int head);
/* fast_attn.cu: any compress call cuda_compress accepts. */
enum dsv4_err cuda_fast_compress(struct dsv4_backend *be, float *entries, float *state_kv,
                                 float *state_z, const float *a, const float *z,
                                 const float *ape, const int32_t *slot, const int32_t *pos,
                                 const int32_t *emit, int T, int r, int d);
/* Any router call cuda_router accepts (BF16 gate, 1 <= k <= min(E, 64)). */
enum dsv4_err cuda_fast_router(struct dsv4_backend *be, float *weights, int32_t *ids,
                               const float *x, const struct dsv4_linear *gate,
                               const float *bias, const int64_t *tid2eid,
                               const int32_t *tokens, int T, int k, float route_scale);

/* fast_attention.cu, fast_indexer.cu: the fast attention and indexer_topk
 * for any T, called by cuda_attention / cuda_indexer_topk (after their own
 * argument checks) when st->fast_kernels is set and the _ok predicate holds
 * (host-side checks only).  Both predicates are false when the environment
 * has DSV4_CUDA_FAST_ATTN=0 (cuda_fast_attn_enabled). */
int cuda_fast_attn_enabled(void);
/* Dh 128, 256 or 512; the float arrays 16-byte aligned (NULL allowed);
 * fa_kernel's shared memory at H, Dh within what be's device allows a
 * block (cuda_smem_max: not at Dh 512 on sm_120). */
int cuda_fast_attention_ok(const struct dsv4_backend *be, const float *out, const float *q,
                           const float *kv, const float *ring, const float *comp, int H,
                           int Dh, int win, int cap, int ratio);
/* ur_rd > 0: then the output's inverse RoPE (rope(out, pos, T, H, H * Dh,
 * Dh, ur_off, ur_rd, ur_freqs, 1), ur_freqs on the host): in the decode
 * kernel's (fd_kernel's) output stage where it applies (ur_off even, ur_off
 * + ur_rd <= Dh, ur_rd / 2 <= CUDA_FA_UR_MAX, DSV4_CUDA_FUSE_UNROPE not 0),
 * else as a rope launch after.  fresh: dsv4_attn's hint (kernels/backend.h);
 * the prefill kernel then reads the key rows from a bf16 copy made once per
 * call (the same values).  q16: q's values are bf16 in its first half
 * (cuda_q16_take), which every fast attention kernel reads as it is (the
 * rounding they do to fp32 q): the same results.  outb (attention_out's
 * decode form; NULL: none): where the decode kernel runs with nothing
 * rotated after it, it writes the output's bf16 values (bf16(v): the grouped
 * linear's conversion) to outb, (T, H, Dh), instead of out, and sets
 * *wrote_b = 1; else *wrote_b = 0 and out is written.  Its scratch then stays
 * within cuda_fast_attention_outb_scratch(T, H, Dh) bytes. */
enum dsv4_err cuda_fast_attention(struct dsv4_backend *be, float *out, const float *q,
                                  const float *kv, const float *ring, const float *comp,
                                  const int32_t *pages, const int32_t *sel, const float *sink,
                                  const int32_t *slot, const int32_t *pos, const int32_t *row0,
                                  const int32_t *pos0, int T, int H, int Dh, int win, int cap,
                                  int ratio, int K, float scale, int ur_off, int ur_rd,
                                  const float *ur_freqs, int fresh, int q16, uint16_t *outb,
                                  int *wrote_b);
/* Scratch bytes the decode attention may take from the start of the backend
 * scratch (its partials), so a caller can keep outb after them. */
size_t cuda_fast_attention_outb_scratch(int T, int H, int Dh);
/* attention_out's prefill form (fast_attention.cu): a call the unsplit
 * fast attention takes (cuda_fast_attention_ok held, T * head groups > 64)
 * whose wo_a cuBLASLt takes (cuda_blas_grouped_ready, T >=
 * DSV4_CUDA_BLAS_MIN_T): the attention writes its output as bf16 (the
 * rounding it does anyway), the output's inverse RoPE rotates those
 * values and rounds them again (what rope then bl_x's rounding give), and
 * cuda_blas_grouped_b16 multiplies them: u with the bits of
 * attention_unrope + linear_grouped, a->out not written.  DSV4_ERR_NOTSUP
 * before anything is queued when it does not take the call
 * (DSV4_CUDA_ATTN_OUT=0: never).  q16 as cuda_fast_attention's. */
enum dsv4_err cuda_fast_attention_out(struct dsv4_backend *be, const struct dsv4_attn *a,
                                      int off, int rd, const float *freqs, float *u,
                                      const struct dsv4_linear *wo_a, int G, int q16);
/* The most RoPE pairs cuda_fast_attention rotates in its output stage. */
#define CUDA_FA_UR_MAX 64
/* dI == 128, 1 <= nh <= 64, cap >= 1, 1 <= K <= 2048, q and keys 16-byte
 * aligned. */
int cuda_fast_indexer_ok(const float *q, const float *keys, int nh, int dI, int cap, int K);
enum dsv4_err cuda_fast_indexer_topk(struct dsv4_backend *be, int32_t *sel, const float *q,
                                     const float *w, const float *keys, const int32_t *pages,
                                     const int32_t *slot, const int32_t *pos, int T, int nh,
                                     int dI, int cap, int ratio, int K);

/* fast_fuse.cu: the fused ops of backend.h (hc_post_pre, norm_rope): the
 * fast kernels when st->fast_kernels is set and they apply, else the ops'
 * compositions (dsv4_hc_post_pre_compose, dsv4_norm_rope_compose). */
enum dsv4_err cuda_hc_post_pre(struct dsv4_backend *be, float *X_out, float *x_out,
                               float *post_out, float *comb_out, float *xn, const float *f,
                               const float *X, const float *post, const float *comb,
                               const struct dsv4_hc_w *hc, const uint16_t *nw, int T, int n,
                               int D, int iters, float hc_eps, float norm_eps);
/* linear_norm_rope: where the linear takes the prefill FP8 GEMM on cuBLASLt
 * (cuda_fast_gemm_linear_b16) and the norm the v4 kernel, the norm reads the
 * GEMM's bf16 output itself (no widening pass; the same values); else the
 * composition. */
enum dsv4_err cuda_linear_norm_rope(struct dsv4_backend *be, const float *x,
                                    const struct dsv4_linear *W, int T, unsigned flags,
                                    const struct dsv4_norm_rope *nr);
/* fast_gemm.cu: cuda_linear's output for an FP8 W at T rows as bf16 bits in
 * the backend scratch (*ob, T x n_out; valid until the next cuda_scratch)
 * where cuda_linear would take the FP8 GEMM on cuBLASLt (the fast kernels'
 * prefill GEMM, DSV4_CUDA_GEMM8 and the cuBLASLt FP8 path on, a plan for
 * the shape): the values cuda_linear widens to its fp32 output.
 * DSV4_ERR_NOTSUP before anything is queued otherwise. */
enum dsv4_err cuda_fast_gemm_linear_b16(struct dsv4_backend *be, uint16_t **ob, const float *x,
                                        const struct dsv4_linear *W, int T);
/* norm_rope2: one launch of the v3 kernel for both calls where it applies. */
enum dsv4_err cuda_norm_rope2(struct dsv4_backend *be, const struct dsv4_norm_rope *a,
                              const struct dsv4_norm_rope *b);
enum dsv4_err cuda_norm_rope(struct dsv4_backend *be, float *x, const uint16_t *w, int rows,
                             int D, float eps, const int32_t *pos, int heads, int off, int rd,
                             const float *freqs, int sim_cols, int sim_block, float *dst,
                             const int32_t *dst_rows);

/* cuda_copy.cu: the copy_batch op (backend.h) and the release of its
 * staging at destroy. */
enum dsv4_err cuda_copy_batch(struct dsv4_backend *be, int n, void *const *dst,
                              const void *const *src, const size_t *bytes);
void cuda_copy_fini(struct dsv4_backend *be);

/* cuda_sample.cu */
enum dsv4_err cuda_sample(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob,
                          const float *logits, const struct dsv4_sample_params *params, int n,
                          int V);
enum dsv4_err cuda_sample_top(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob,
                              const float *logits, const struct dsv4_sample_params *params,
                              int n, int V);

/* --- sorting (cuda_sample.cu) ------------------------------------------------- */

/* Sort key of a score: ascending keys give (score desc, index asc); NaN
 * ranks as -inf and -0 equals +0, as the CPU's comparisons do. */
static __device__ __forceinline__ unsigned long long
cu_rank_key(float s, int32_t idx)
{
    uint32_t u;

    if (isnan(s))
        s = -__int_as_float(0x7f800000);
    if (s == 0.0f)
        s = 0.0f;
    u = __float_as_uint(s);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);   /* ascending order */
    return ((unsigned long long)(~u) << 32) | (uint32_t)idx;
}

/* Whether (va, ia) ranks before (vb, ib): larger value, then lower index
 * (the top-k order of the router and the sampler's argmax).  A NaN value
 * never does. */
static __device__ __forceinline__ bool
cu_ranks_before(float va, int ia, float vb, int ib)
{
    return va > vb || (va == vb && ia < ib);
}

/* The warp's best (bv, bi) by cu_ranks_before, from each lane's own, in
 * every lane (an xor butterfly; every lane of the warp calls it). */
static __device__ __forceinline__ void
cu_warp_best(float &bv, int &bi)
{
    for (int o = 16; o > 0; o /= 2) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);

        if (cu_ranks_before(ov, oi, bv, bi))
            bv = ov, bi = oi;
    }
}

/* The block's best (bv, bi) by cu_ranks_before, from each thread's own:
 * cu_warp_best per warp, then the warps' in warp order; the result is
 * thread 0's (the other threads keep their warp's).  rv, ri: blockDim.x / 32
 * shared entries.  One __syncthreads: every thread of the block calls it. */
static __device__ __forceinline__ void
cu_block_best(float &bv, int &bi, float *rv, int *ri)
{
    cu_warp_best(bv, bi);
    if (threadIdx.x % 32 == 0) {
        rv[threadIdx.x / 32] = bv;
        ri[threadIdx.x / 32] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < (int)blockDim.x / 32; w++)
            if (cu_ranks_before(rv[w], ri[w], bv, bi))
                bv = rv[w], bi = ri[w];
}

/* Device temporary bytes cuda_sort_segments needs for n_seg segments of
 * seg_len keys (host-side query, no device work). */
size_t cuda_sort_temp_bytes(int n_seg, int seg_len);

/* Sort n_seg segments of seg_len 64-bit keys each, keys_in -> keys_out,
 * ascending; temp: cuda_sort_temp_bytes(n_seg, seg_len) device bytes. */
enum dsv4_err cuda_sort_segments(struct dsv4_backend *be, unsigned long long *keys_out,
                                 const unsigned long long *keys_in, int n_seg, int seg_len,
                                 void *temp);

#endif
