/*
 * cuda_backend.cu — the CUDA backend: its ops table, device memory, the
 * scratch buffer, the expert-array registry, and the small layout ops (fill,
 * scatter/gather, scale, add_streams, embed), which mirror cpu_backend.c.
 *
 * One backend owns one non-blocking stream on the current device; every copy
 * and kernel is queued on it, and sync waits for it.  Upload and download
 * use cudaMemcpyAsync from/to host memory as given (pageable memory makes the
 * copy synchronous with respect to the host buffer, which is what callers
 * that reuse their buffers right away need).
 */
#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda_fast.h"   /* dsv4_cuda_graph_kernels */

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static enum dsv4_err cuda_side_join(struct dsv4_backend *be);

enum dsv4_err
cuda_err(cudaError_t rc, const char *what, const char *file, int line)
{
    /* The failed call's error stays in the thread's last-error slot until
     * read: the next op's launch check (cudaGetLastError) would report it
     * under its own name (an out-of-memory of one import failing the next
     * decode step).  Read it here; a sticky error stays anyway. */
    (void)cudaGetLastError();
    return dsv4_err_set(rc == cudaErrorMemoryAllocation ? DSV4_ERR_NOMEM : DSV4_ERR_CUDA,
                        "cuda: %s: %s (%s:%d)", what, cudaGetErrorString(rc), file, line);
}

void *
cuda_scratch(struct dsv4_backend *be, size_t bytes)
{
    struct cuda_state *st = cuda_st(be);
    size_t want;
    void *p = NULL;

    if (bytes <= st->scratch_bytes && st->scratch != NULL)
        return st->scratch;
    /* queued work and recorded graphs may still use the old buffer: keep it
     * (no synchronisation, so this also works while recording a graph) */
    if (st->scratch != NULL && st->n_retired == st->cap_retired) {
        int cap = st->cap_retired ? 2 * st->cap_retired : 8;
        void **r = (void **)realloc(st->retired, (size_t)cap * sizeof(*r));

        if (r == NULL)
            return NULL;
        st->retired = r;
        st->cap_retired = cap;
    }
    want = bytes + bytes / 2 + (1u << 20);
    if (cudaMalloc(&p, want) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    if (st->scratch != NULL)
        st->retired[st->n_retired++] = st->scratch;
    st->scratch = p;
    st->scratch_bytes = want;
    return st->scratch;
}

/* --- expert registry ----------------------------------------------------------- */

const struct cuda_expert_table *
cuda_experts_find(struct dsv4_backend *be, const struct dsv4_expert_w *host)
{
    struct cuda_state *st = cuda_st(be);

    for (int i = 0; i < st->n_tables; i++)
        if (st->tables[i].host == host)
            return &st->tables[i];
    return NULL;
}

enum dsv4_err
cuda_experts_register(struct dsv4_backend *be, const struct dsv4_expert_w *host,
                      struct dsv4_expert_w *dev, int n, bool owned)
{
    struct cuda_state *st = cuda_st(be);

    cuda_experts_unregister(be, host);
    if (st->n_tables == st->cap_tables) {
        int cap = st->cap_tables ? 2 * st->cap_tables : 16;
        struct cuda_expert_table *t = (struct cuda_expert_table *)realloc(
            st->tables, (size_t)cap * sizeof(*t));

        if (t == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "cuda: no memory for the expert registry");
        st->tables = t;
        st->cap_tables = cap;
    }
    st->tables[st->n_tables].host = host;
    st->tables[st->n_tables].dev = dev;
    st->tables[st->n_tables].n = n;
    st->tables[st->n_tables].owned = owned;
    st->n_tables++;
    return DSV4_OK;
}

void
cuda_experts_unregister(struct dsv4_backend *be, const struct dsv4_expert_w *host)
{
    struct cuda_state *st = cuda_st(be);

    for (int i = 0; i < st->n_tables; i++) {
        if (st->tables[i].host == host) {
            st->tables[i] = st->tables[--st->n_tables];
            return;
        }
    }
}

/* --- the hc Sinkhorn beside the main stream (cuda.cuh) ------------------------------ */

/* DSV4_CUDA_HC_DEFER=0: cuda_hc_fork answers NULL (the finish kernel runs
 * the Sinkhorn, as before docs/perf.md run 38). */
static struct cuda_switch hc_defer_sw = CUDA_SWITCH("DSV4_CUDA_HC_DEFER", 1);

int
cuda_hc_defer_on(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    return st->hc_stream != NULL && st->side != 1 && cuda_switch_on(&hc_defer_sw);
}

cudaStream_t
cuda_hc_fork(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    if (!cuda_hc_defer_on(be) || cuda_hc_join(be) != DSV4_OK ||   /* one pending at a time */
        cudaEventRecord(st->hc_ev[0], cuda_stream(be)) != cudaSuccess ||
        cudaStreamWaitEvent(st->hc_stream, st->hc_ev[0], 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return st->hc_stream;
}

enum dsv4_err
cuda_hc_forked(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    CUDA_TRY(cudaEventRecord(st->hc_ev[1], st->hc_stream));
    st->hc_pending = 1;
    return DSV4_OK;
}

enum dsv4_err
cuda_hc_join(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    if (!st->hc_pending)
        return DSV4_OK;
    /* cleared before the wait, as cuda_side_join does: a failed wait (an
     * invalidated capture's) left it set, and every later op then waited
     * outside the capture on an event recorded inside it, and failed */
    if (st->side != 1)   /* a side branch's wait does not order the main stream */
        st->hc_pending = 0;
    CUDA_TRY(cudaStreamWaitEvent(cuda_stream(be), st->hc_ev[1], 0));
    return DSV4_OK;
}

/* --- lifecycle and memory --------------------------------------------------------- */

/* A non-blocking stream of priority prio and two timing-free events in ev,
 * or NULL (and no events) if any of them cannot be made. */
static cudaStream_t
stream_pair(int prio, cudaEvent_t ev[2])
{
    cudaStream_t s = NULL;
    int n_ev = 0;

    if (cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, prio) != cudaSuccess)
        return NULL;
    while (n_ev < 2 && cudaEventCreateWithFlags(&ev[n_ev], cudaEventDisableTiming) == cudaSuccess)
        n_ev++;
    if (n_ev == 2)
        return s;
    while (n_ev > 0)
        cudaEventDestroy(ev[--n_ev]);
    cudaStreamDestroy(s);
    return NULL;
}

/* Wait for and release what stream_pair made (nothing when s is NULL). */
static void
stream_pair_free(cudaStream_t s, cudaEvent_t ev[2])
{
    if (s == NULL)
        return;
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    cudaEventDestroy(ev[0]);
    cudaEventDestroy(ev[1]);
}

/* Free the scratch buffers of both queues and the outgrown ones (nothing
 * queued may still use them): cuda_destroy, cuda_trim. */
static void
scratch_free_all(struct cuda_state *st)
{
    cudaFree(st->scratch);
    cudaFree(st->side_scratch);
    for (int i = 0; i < st->n_retired; i++)
        cudaFree(st->retired[i]);
    st->scratch = st->side_scratch = NULL;
    st->scratch_bytes = st->side_scratch_bytes = 0;
    st->n_retired = 0;
}

static void
cuda_destroy(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    (void)cuda_side_join(be);   /* back on the main stream, own scratch */
    (void)cuda_hc_join(be);
    cudaStreamSynchronize(st->stream);
    stream_pair_free(st->hc_stream, st->hc_ev);
    stream_pair_free(st->side_stream, st->side_ev);
    cuda_copy_fini(be);
    cuda_fast_linear_fini(be);
    cuda_blas_fini(be);
    scratch_free_all(st);
    free(st->retired);
    cudaStreamDestroy(st->stream);
    free(st->tables);
    free(st);
    free(be);
}

static void *
cuda_alloc(struct dsv4_backend *be, size_t bytes)
{
    void *p = NULL;

    if (bytes == 0)
        bytes = 256;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    /* zero-filled, and visible to every later op on the stream */
    if (cudaMemsetAsync(p, 0, bytes, cuda_stream(be)) != cudaSuccess) {
        (void)cudaGetLastError();   /* not the next launch's error */
        cudaFree(p);
        return NULL;
    }
    return p;
}

void
cuda_quiesce(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    (void)cudaStreamSynchronize(cuda_stream(be));
    if (st->side_stream != NULL)
        (void)cudaStreamSynchronize(st->side_stream);
    if (st->hc_stream != NULL)
        (void)cudaStreamSynchronize(st->hc_stream);
    (void)cudaGetLastError();
}

static void
cuda_free(struct dsv4_backend *be, void *p)
{
    if (p == NULL)
        return;
    /* the streams may still use it: the main one, a side queue ended but
     * not joined, a Sinkhorn not joined */
    cuda_quiesce(be);
    cudaFree(p);
    (void)cudaGetLastError();
}

static enum dsv4_err
cuda_upload(struct dsv4_backend *be, void *dst, const void *src, size_t n)
{
    TRY_HC_JOIN(be);
    if (n > 0)
        CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, cuda_stream(be)));
    return DSV4_OK;
}

static enum dsv4_err
cuda_download(struct dsv4_backend *be, void *dst, const void *src, size_t n)
{
    TRY_HC_JOIN(be);
    if (n > 0)
        CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, cuda_stream(be)));
    return DSV4_OK;
}

static enum dsv4_err
cuda_copy(struct dsv4_backend *be, void *dst, const void *src, size_t n)
{
    TRY_HC_JOIN(be);
    if (n > 0)
        CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, cuda_stream(be)));
    return DSV4_OK;
}

static enum dsv4_err
cuda_sync(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    TRY_HC_JOIN(be);
    CUDA_TRY(cudaStreamSynchronize(cuda_stream(be)));
    /* a side branch a failed call left unjoined (joined ones are in the
     * main stream's wait already) */
    if (st->side_stream != NULL)
        CUDA_TRY(cudaStreamSynchronize(st->side_stream));
    return DSV4_OK;
}

/* --- elementwise / layout ----------------------------------------------------------- */

#define EW_THREADS 256

static __global__ void
fill_kernel(float *x, float v, int64_t n)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = v;
}

static enum dsv4_err
cuda_fill(struct dsv4_backend *be, float *x, float v, int64_t n)
{
    TRY_HC_JOIN(be);
    if (n <= 0)
        return DSV4_OK;
    cu_launch(fill_kernel, cuda_blocks(n, EW_THREADS), EW_THREADS, 0, cuda_stream(be), x, v, n);
    CUDA_LAUNCHED("fill");
    return DSV4_OK;
}

/*
 * dst[drow(i), :] = src[srow(i), :]; rows NULL = identity on that side.
 * Row i is blockIdx.x; its columns are spread over gridDim.y blocks, V floats
 * a thread (V = 4: cols a multiple of 4 and both arrays 16-byte aligned,
 * rows_copy_launch).  Until run 66 one block copied a whole row with one
 * float a thread per iteration, each load behind the previous iteration's
 * store: the 64 KB row of the four hc streams gathered for the head at
 * batch 1 took 13-14 us on the step's chain.
 */
template <int V>
static __global__ void
rows_copy_kernel(float *dst, const int32_t *drows, const float *src, const int32_t *srows,
                 int cols)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int i = blockIdx.x, nv = cols / V;
    int64_t d = drows != NULL ? drows[i] : i, s = srows != NULL ? srows[i] : i;

    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < nv; c += gridDim.y * blockDim.x) {
        if (V == 4)
            ((float4 *)(dst + d * cols))[c] = ((const float4 *)(src + s * cols))[c];
        else
            dst[d * cols + c] = src[s * cols + c];
    }
}

/* The grid of rows_copy_kernel and embed_kernel: a row a block row
 * (blockIdx.x), the row's per items a thread spread over blocks along y,
 * at most 32. */
static dim3
row_grid(int rows, int per)
{
    int ny = (per + EW_THREADS - 1) / EW_THREADS;

    return dim3((unsigned)rows, (unsigned)(ny < 32 ? ny : 32));
}

/* rows_copy_kernel for n rows of cols floats: float4 copies where they
 * apply. */
static void
rows_copy_launch(struct dsv4_backend *be, float *dst, const int32_t *drows, const float *src,
                 const int32_t *srows, int n, int cols)
{
    int vec = cols % 4 == 0 && ((uintptr_t)dst | (uintptr_t)src) % 16 == 0;
    dim3 grid = row_grid(n, vec ? cols / 4 : cols);

    if (vec)
        cu_launch(rows_copy_kernel<4>, grid, EW_THREADS, 0, cuda_stream(be), dst, drows, src,
                  srows, cols);
    else
        cu_launch(rows_copy_kernel<1>, grid, EW_THREADS, 0, cuda_stream(be), dst, drows, src,
                  srows, cols);
}

static enum dsv4_err
cuda_scatter_rows(struct dsv4_backend *be, float *dst, const int32_t *rows, const float *src,
                  int n, int cols)
{
    TRY_HC_JOIN(be);
    if (n <= 0 || cols <= 0)
        return DSV4_OK;
    rows_copy_launch(be, dst, rows, src, (const int32_t *)NULL, n, cols);
    CUDA_LAUNCHED("scatter_rows");
    return DSV4_OK;
}

static enum dsv4_err
cuda_gather_rows(struct dsv4_backend *be, float *dst, const float *src, const int32_t *rows,
                 int n, int cols)
{
    TRY_HC_JOIN(be);
    if (n <= 0 || cols <= 0)
        return DSV4_OK;
    rows_copy_launch(be, dst, (const int32_t *)NULL, src, rows, n, cols);
    CUDA_LAUNCHED("gather_rows");
    return DSV4_OK;
}

static __global__ void
scale_kernel(float *x, float s, int64_t n)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = cu_bf16_round(x[i] * s);
}

static enum dsv4_err
cuda_scale(struct dsv4_backend *be, float *x, float s, int64_t n)
{
    if (n <= 0)
        return DSV4_OK;
    cu_launch(scale_kernel, cuda_blocks(n, EW_THREADS), EW_THREADS, 0, cuda_stream(be), x, s, n);
    CUDA_LAUNCHED("scale");
    return DSV4_OK;
}

/* grid (T * n_streams): out row = bf16(e[t] + h row) */
static __global__ void
add_streams_kernel(float *out, const float *e, const float *h, int n_streams, int D)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t r = blockIdx.x, t = r / n_streams;

    for (int i = threadIdx.x; i < D; i += blockDim.x)
        out[r * D + i] = cu_bf16_round(e[t * D + i] + h[r * D + i]);
}

static enum dsv4_err
cuda_add_streams(struct dsv4_backend *be, float *out, const float *e, const float *h, int T,
                 int n_streams, int D)
{
    if (T <= 0 || n_streams <= 0)
        return DSV4_OK;
    cu_launch(add_streams_kernel, T * n_streams, EW_THREADS, 0, cuda_stream(be), out, e, h,
              n_streams, D);
    CUDA_LAUNCHED("add_streams");
    return DSV4_OK;
}

/*
 * grid (T * n_copies, column blocks): row r = blockIdx.x is copy r % n_copies
 * of token r / n_copies; V bf16 values a thread (V = 8: one 16-byte load,
 * two 16-byte stores; D a multiple of 8 and table and out 16-byte aligned).
 * Until run 66 one block wrote a row a value a thread per iteration, each
 * load behind the previous store (the step's first kernel, 6.9 us at batch
 * 1).
 */
template <int V>
static __global__ void
embed_kernel(float *out, const int32_t *ids, const uint16_t *table, int D, int n_copies)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t r = blockIdx.x, t = r / n_copies;
    const uint16_t *row = table + (int64_t)ids[t] * D;

    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < D / V; c += gridDim.y * blockDim.x) {
        if (V == 8) {
            uint4 w = ((const uint4 *)row)[c];
            uint32_t u[4] = { w.x, w.y, w.z, w.w };
            float4 *o = (float4 *)(out + r * D) + 2 * c;

            o[0] = make_float4(__uint_as_float(u[0] << 16), __uint_as_float(u[0] & 0xffff0000u),
                               __uint_as_float(u[1] << 16), __uint_as_float(u[1] & 0xffff0000u));
            o[1] = make_float4(__uint_as_float(u[2] << 16), __uint_as_float(u[2] & 0xffff0000u),
                               __uint_as_float(u[3] << 16), __uint_as_float(u[3] & 0xffff0000u));
        } else {
            out[r * D + c] = cu_bf16_to_f32(row[c]);
        }
    }
}

static enum dsv4_err
cuda_embed(struct dsv4_backend *be, float *out, const int32_t *ids, const uint16_t *table,
           int T, int D, int n_copies)
{
    int vec = D % 8 == 0 && ((uintptr_t)out | (uintptr_t)table) % 16 == 0;
    dim3 grid = row_grid(T * n_copies, vec ? D / 8 : D);

    if (T <= 0 || n_copies <= 0)
        return DSV4_OK;
    if (vec)
        cu_launch(embed_kernel<8>, grid, EW_THREADS, 0, cuda_stream(be), out, ids, table, D,
                  n_copies);
    else
        cu_launch(embed_kernel<1>, grid, EW_THREADS, 0, cuda_stream(be), out, ids, table, D,
                  n_copies);
    CUDA_LAUNCHED("embed");
    return DSV4_OK;
}

/* --- graphs ------------------------------------------------------------------------- */

/*
 * Stream capture in relaxed mode (cudaMalloc of a growing scratch buffer is
 * allowed while recording; nothing else here calls an unsafe API).  The
 * recording is instantiated once and replayed with cudaGraphLaunch on the
 * backend's stream.
 */
static enum dsv4_err
cuda_graph_begin(struct dsv4_backend *be)
{
    enum dsv4_err e;

    TRY_HC_JOIN(be);   /* a recording starts with nothing pending beside */
    /* nor on the side queue: a call that failed between side_run and
     * side_join left its branch open, and the capture's first side_begin
     * would wait on an event recorded outside it */
    if ((e = cuda_side_join(be)) != DSV4_OK)
        return e;
    CUDA_TRY(cudaStreamBeginCapture(cuda_stream(be), cudaStreamCaptureModeRelaxed));
    return DSV4_OK;
}

/* Count g's nodes and kernel nodes into the state (dsv4_cuda_graph_kernels). */
static void
cuda_graph_count(struct dsv4_backend *be, cudaGraph_t g)
{
    struct cuda_state *st = cuda_st(be);
    cudaGraphNode_t *nodes;
    size_t nn = 0;

    st->graph_nodes = st->graph_kernels = 0;
    if (cudaGraphGetNodes(g, NULL, &nn) != cudaSuccess || nn == 0)
        return;
    nodes = (cudaGraphNode_t *)malloc(nn * sizeof(*nodes));
    if (nodes != NULL && cudaGraphGetNodes(g, nodes, &nn) == cudaSuccess) {
        st->graph_nodes = (int)nn;
        for (size_t i = 0; i < nn; i++) {
            cudaGraphNodeType ty;

            if (cudaGraphNodeGetType(nodes[i], &ty) == cudaSuccess &&
                ty == cudaGraphNodeTypeKernel)
                st->graph_kernels++;
        }
    }
    free(nodes);
    (void)cudaGetLastError();
}

extern "C" int
dsv4_cuda_graph_kernels(const struct dsv4_backend *be, int *nodes)
{
    const struct cuda_state *st;

    if (!cuda_is_backend(be))
        return -1;
    st = (const struct cuda_state *)be->priv;
    if (nodes != NULL)
        *nodes = st->graph_nodes;
    return st->graph_kernels;
}

extern "C" int
dsv4_cuda_context_lost(struct dsv4_backend *be)
{
    cudaError_t rc;

    if (!cuda_is_backend(be))
        return 0;
    rc = cudaStreamQuery(cuda_stream(be));
    return rc != cudaSuccess && rc != cudaErrorNotReady;
}

static enum dsv4_err
cuda_graph_end(struct dsv4_backend *be, void **out)
{
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    cudaError_t rc;

    *out = NULL;
    (void)cuda_hc_join(be);   /* a capture ends with every fork joined: */
    (void)cuda_side_join(be); /* the side queue's too (a failed body's) */
    rc = cudaStreamEndCapture(cuda_stream(be), &g);
    cuda_st(be)->hc_pending = 0;   /* its event was recorded in the capture */
    if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        if (g != NULL)
            cudaGraphDestroy(g);
        return cuda_err(rc, "cudaStreamEndCapture", __FILE__, __LINE__);
    }
    cuda_graph_count(be, g);
    if (cuda_st(be)->test_graph_nomem != 0) {
        rc = cudaErrorMemoryAllocation;
        if (cuda_st(be)->test_graph_nomem > 0)
            cuda_st(be)->test_graph_nomem--;
    } else {
        rc = cudaGraphInstantiate(&x, g, 0);
    }
    cudaGraphDestroy(g);
    if (rc != cudaSuccess) {
        (void)cudaGetLastError();
        return cuda_err(rc, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
    *out = (void *)x;
    return DSV4_OK;
}

static enum dsv4_err
cuda_graph_launch(struct dsv4_backend *be, void *g)
{
    TRY_HC_JOIN(be);
    CUDA_TRY(cudaGraphLaunch((cudaGraphExec_t)g, cuda_stream(be)));
    return DSV4_OK;
}

static void
cuda_graph_free(struct dsv4_backend *be, void *g)
{
    if (g == NULL)
        return;
    cuda_quiesce(be);
    cudaGraphExecDestroy((cudaGraphExec_t)g);
    (void)cudaGetLastError();
}

/* --- the side queue ------------------------------------------------------------------ */

/* DSV4_CUDA_SIDE=0: side_begin answers *on = 0 (everything in order). */
static struct cuda_switch side_sw = CUDA_SWITCH("DSV4_CUDA_SIDE", 1);

/* Exchange the per-queue resources (scratch, linear counters) with the
 * other queue's. */
static void
cuda_side_swap(struct cuda_state *st)
{
    void *p = st->scratch;
    size_t b = st->scratch_bytes;
    unsigned *c = st->lin_ctr;

    st->scratch = st->side_scratch;
    st->scratch_bytes = st->side_scratch_bytes;
    st->lin_ctr = st->side_ctr;
    st->side_scratch = p;
    st->side_scratch_bytes = b;
    st->side_ctr = c;
}

/*
 * Fork: the side stream waits for an event recorded on the main stream (in
 * a recording, the capture's fork), then takes the ops.  A branch left
 * unjoined by a failed call is ended and joined first.
 */
static enum dsv4_err
cuda_side_begin(struct dsv4_backend *be, int *on)
{
    struct cuda_state *st = cuda_st(be);
    enum dsv4_err e;

    *on = 0;
    if (st->side != 0 && (e = cuda_side_join(be)) != DSV4_OK)
        return e;
    if (st->side_stream == NULL || !cuda_switch_on(&side_sw))
        return DSV4_OK;
    CUDA_TRY(cudaEventRecord(st->side_ev[0], st->stream));
    CUDA_TRY(cudaStreamWaitEvent(st->side_stream, st->side_ev[0], 0));
    st->main_stream = st->stream;
    st->stream = st->side_stream;
    cuda_side_swap(st);
    st->side = 1;
    *on = 1;
    return DSV4_OK;
}

/* Back to the main stream; the side's last op marked by side_ev[1]. */
static enum dsv4_err
cuda_side_end(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);
    cudaError_t rc;

    if (st->side != 1)
        return DSV4_OK;
    rc = cudaEventRecord(st->side_ev[1], st->side_stream);
    st->stream = st->main_stream;
    cuda_side_swap(st);
    st->side = rc == cudaSuccess ? 2 : 0;
    CUDA_TRY(rc);
    return DSV4_OK;
}

/* The main stream waits for side_ev[1] (in a recording, the join). */
static enum dsv4_err
cuda_side_join(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);
    enum dsv4_err e;

    if (st->side == 1 && (e = cuda_side_end(be)) != DSV4_OK)
        return e;
    if (st->side != 2)
        return DSV4_OK;
    st->side = 0;
    CUDA_TRY(cudaStreamWaitEvent(st->stream, st->side_ev[1], 0));
    return DSV4_OK;
}

static enum dsv4_err
cuda_copy2d(struct dsv4_backend *be, float *dst, int64_t dst_ld, const float *src,
            int64_t src_ld, int rows, int cols)
{
    TRY_HC_JOIN(be);
    if (rows <= 0 || cols <= 0)
        return DSV4_OK;
    CUDA_TRY(cudaMemcpy2DAsync(dst, (size_t)dst_ld * sizeof(float), src,
                               (size_t)src_ld * sizeof(float), (size_t)cols * sizeof(float),
                               (size_t)rows, cudaMemcpyDeviceToDevice, cuda_stream(be)));
    return DSV4_OK;
}

/* The backend's trim (kernels/backend.h): once the queued work is done, no
 * op uses the scratch buffers any more (the caller freed the graphs that
 * may): free them; cuda_scratch takes a new one at the next call. */
static enum dsv4_err
cuda_trim(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);
    enum dsv4_err e;

    if (st->side != 0 && (e = cuda_side_join(be)) != DSV4_OK)
        return e;
    if ((e = cuda_hc_join(be)) != DSV4_OK)
        return e;
    CUDA_TRY(cudaStreamSynchronize(st->stream));
    scratch_free_all(st);
    return DSV4_OK;
}

/* --- constructor -------------------------------------------------------------------- */

static const struct dsv4_backend_ops cuda_ops = {
    cuda_destroy,
    cuda_alloc,
    cuda_free,
    cuda_upload,
    cuda_download,
    cuda_copy,
    cuda_copy_batch,
    cuda_sync,
    cuda_fill,
    cuda_scatter_rows,
    cuda_gather_rows,
    cuda_scale,
    cuda_add_streams,
    cuda_embed,
    cuda_rms_norm,
    cuda_linear,
    cuda_linear_grouped,
    cuda_rope,
    cuda_fp8_sim,
    cuda_hadamard_fp4,
    cuda_hc_pre,
    cuda_hc_post,
    cuda_hc_head,
    cuda_compress,
    cuda_indexer_topk,
    cuda_attention,
    cuda_router,
    cuda_moe,
    cuda_moe_parts,
    cuda_moe_combine,
    cuda_copy2d,
    cuda_sample,
    cuda_sample_top,
    cuda_graph_begin,
    cuda_graph_end,
    cuda_graph_launch,
    cuda_graph_free,
    cuda_hc_post_pre,   /* fast_fuse.cu */
    cuda_norm_rope,
    cuda_linear_multi,
    cuda_norm_rope2,    /* fast_fuse.cu */
    cuda_attention_unrope,   /* cuda_attn.cu */
    cuda_attention_out,      /* cuda_attn.cu */
    cuda_linear_norm_rope,   /* fast_fuse.cu */
    cuda_side_begin,
    cuda_side_end,
    cuda_side_join,
    cuda_trim,
};

/* cuda_smem_max's value for device dev: the device's opt-in limit per block
 * (48 KB where the query fails: what any device allows without opting in),
 * lowered to DSV4_CUDA_SMEM_LIMIT where that is a positive number of bytes
 * (anything else: unset). */
static size_t
cuda_smem_limit(int dev)
{
    const char *v = getenv("DSV4_CUDA_SMEM_LIMIT");
    int optin = 0;
    size_t lim;

    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess ||
        optin <= 0) {
        (void)cudaGetLastError();
        optin = 48 * 1024;
    }
    lim = (size_t)optin;
    if (v != NULL) {
        char *end = NULL;
        unsigned long long n;

        errno = 0;
        n = strtoull(v, &end, 10);
        if (errno == 0 && end != v && *end == '\0' && v[0] != '-' && n > 0 && n < lim)
            lim = (size_t)n;
    }
    return lim;
}

extern "C" enum dsv4_err
dsv4_cuda_backend_create(struct dsv4_backend **out, enum dsv4_numerics numerics, int device)
{
    struct dsv4_backend *be;
    struct cuda_state *st;
    cudaError_t rc;
    const char *step = "cudaSetDevice";   /* the failing call's name */
    int n_dev = 0;

    *out = NULL;
    if (numerics != DSV4_NUMERICS_REF && numerics != DSV4_NUMERICS_HF)
        return dsv4_err_set(DSV4_ERR_INVAL, "cuda backend: unknown numerics mode %d",
                            (int)numerics);
    rc = cudaGetDeviceCount(&n_dev);
    if (rc != cudaSuccess || n_dev == 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda backend: no CUDA device (%s)",
                            rc != cudaSuccess ? cudaGetErrorString(rc) : "none found");
    be = (struct dsv4_backend *)calloc(1, sizeof(*be));
    st = (struct cuda_state *)calloc(1, sizeof(*st));
    if (be == NULL || st == NULL) {
        free(be);
        free(st);
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda backend: no memory");
    }
    if (device >= n_dev) {
        free(be);
        free(st);
        return dsv4_err_set(DSV4_ERR_INVAL, "cuda backend: device %d of %d", device, n_dev);
    }
    rc = device >= 0 ? cudaSetDevice(device) : cudaSuccess;
    if (rc == cudaSuccess && (rc = cudaGetDevice(&st->device)) != cudaSuccess)
        step = "cudaGetDevice";
    if (rc == cudaSuccess &&
        (cudaDeviceGetAttribute(&st->sms, cudaDevAttrMultiProcessorCount, st->device) !=
             cudaSuccess ||
         st->sms < 1)) {
        st->sms = 132;
        (void)cudaGetLastError();
    }
    if (rc == cudaSuccess && cudaDeviceGetAttribute(&st->cc_major,
                                                    cudaDevAttrComputeCapabilityMajor,
                                                    st->device) != cudaSuccess) {
        st->cc_major = 0;
        (void)cudaGetLastError();
    }
    if (rc == cudaSuccess)
        st->smem_max = cuda_smem_limit(st->device);
    if (rc == cudaSuccess &&
        cudaDeviceGetAttribute(&st->mps, cudaDevAttrMpsEnabled, st->device) != cudaSuccess) {
        st->mps = 0;
        (void)cudaGetLastError();
    }
    if (rc == cudaSuccess) {
        /* DSV4_CUDA_STREAM_PRIORITY=high / low: the stream's scheduling
         * priority (the rank daemons set it per role with `cuda_priority`:
         * decode steps ahead of prefill kernels on a shared GPU) */
        const char *pv = getenv("DSV4_CUDA_STREAM_PRIORITY");
        int lo = 0, hi = 0, prio = 0;

        if (pv != NULL && cudaDeviceGetStreamPriorityRange(&lo, &hi) == cudaSuccess)
            prio = strcmp(pv, "high") == 0 ? hi : strcmp(pv, "low") == 0 ? lo : 0;
        step = "stream creation";
        rc = cudaStreamCreateWithPriority(&st->stream, cudaStreamNonBlocking, prio);
    }
    if (rc != cudaSuccess) {
        free(be);
        free(st);
        return cuda_err(rc, step, __FILE__, __LINE__);
    }
    /* the side queue and the hc Sinkhorn's stream: each a second stream of
     * the same priority and two events (none if any of them cannot be
     * made: side_begin then answers 0, cuda_hc_fork NULL) */
    {
        int prio = 0;

        if (cudaStreamGetPriority(st->stream, &prio) != cudaSuccess)
            prio = 0;
        st->side_stream = stream_pair(prio, st->side_ev);
        st->hc_stream = stream_pair(prio, st->hc_ev);
        (void)cudaGetLastError();
    }
    be->ops = &cuda_ops;
    be->name = "cuda";
    be->numerics = numerics;
    be->n_threads = 1;
    be->priv = st;
    /* DSV4_CUDA_KERNELS=fast: the fast decode kernels (kernels/cuda_fast.h) */
    {
        const char *k = getenv("DSV4_CUDA_KERNELS");

        st->fast_kernels = k != NULL && strcmp(k, "fast") == 0;
    }
    /* test only: every recorded graph ("1"), or the first N ("first:N"),
     * "out of memory" (kernels/forward.h "Decode graphs": such steps run
     * ungraphed, then record again) */
    {
        const char *t = getenv("DSV4_CUDA_TEST_GRAPH_NOMEM");

        st->test_graph_nomem = 0;
        if (t != NULL && strcmp(t, "1") == 0)
            st->test_graph_nomem = -1;
        else if (t != NULL && strncmp(t, "first:", 6) == 0) {
            long n = strtol(t + 6, NULL, 10);

            st->test_graph_nomem = n > 0 ? n : 0;
        }
    }
    cuda_fast_linear_init(be);   /* fast_linear.cu: counters, DSV4_CUDA_LINEAR */
    log_info("cuda backend: device %d, %s numerics, %s kernels", st->device,
             numerics == DSV4_NUMERICS_REF ? "ref" : "hf", st->fast_kernels ? "fast" : "exact");
    *out = be;
    return DSV4_OK;
}
