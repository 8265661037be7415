/*
 * cuda_ar.cu — the cudaipc group of kernels/comm.h: a one-shot all-reduce
 * kernel between the CUDA devices of one host, that can be aborted.
 *
 * DESIGN.  Each rank owns a receive buffer in its own device memory (struct
 * ar_hdr, then 2 x size data slots of slot_bytes) and maps every peer's
 * (cudaIpcOpenMemHandle between processes; the plain pointer between
 * threads of one process, with peer access enabled).  One call = one launch
 * of AR_BLOCKS blocks; block b owns the b-th 16-byte-aligned chunk of x:
 *   1. it reads and bumps its own epoch counter e (device memory: the same
 *      kernel node replayed from a graph gets a new epoch each time);
 *   2. it stores its chunk of x into slot [e & 1][rank] of every peer's
 *      buffer (16-byte peer stores);
 *   3. every thread fences (fence.acq_rel.sys), the block synchronises,
 *      and thread s stores e into flag[rank][b] of peer s (st.release.sys);
 *   4. thread s spins on flag[s][b] of its own buffer (ld.acquire.sys)
 *      until it holds e or more; the block synchronises;
 *   5. it sums its chunk over the slots in rank order (its own slot is x
 *      itself; the peers' slots are read through L2, ld.cg) into x.
 * Memory order: a peer's data stores happen before its fence, its barrier
 * and its release store of the flag; our acquire load of that flag and our
 * barrier order our reads after them (PTX release/acquire patterns at
 * system scope, cumulative through bar.sync).
 * Slot reuse: rank r writes parity p of peer q again at call e + 2, after
 * its block b saw q's flag of call e + 1, which q's block b stores only once
 * q's kernel of call e + 1 runs, i.e. after q's kernel of call e (all its
 * blocks, whatever the chunks) finished reading parity p.  Flags only grow,
 * so one flag per (rank, block) suffices ("e or more").
 *
 * Abort.  The waits poll the group's `broken` word (own device memory,
 * written by any rank that gives up), and every 64 turns the abort word
 * (pinned host memory mapped into the device, set by abort() from any
 * thread: a device word written by a copy could not pass a stream blocked
 * in the kernel) and %globaltimer against timeout_ms.  A block that gives
 * up sets `broken` in its own and every peer's buffer and the error word
 * (mapped host memory: the host reads it without synchronising), skips the
 * sum and returns normally; later kernels see `broken` at their start and
 * return at once, so a decode graph of 129 all-reduces ends within
 * milliseconds of the abort.  check() and every later call report the
 * broken group; the stream and the CUDA context stay healthy, so the
 * process destroys the communicator and joins a new one.
 *
 * allreduce_min_u64 (the rank's tick, the join-time exchanges) goes through
 * an inner shm group on the same id (kernels/comm_shm.c), which is also the
 * bootstrap: the ranks exchange pids, devices, buffer addresses and IPC
 * handles with a minimum all-reduce over UINT64_MAX-padded rows.
 */
#include "kernels/comm.h"
#include "kernels/cuda/cuda.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define AR_BLOCKS 64                 /* blocks of every launch (fixed: per-block epochs) */
#define AR_THREADS 512
#define AR_MAX DSV4_COMM_CUDAIPC_MAX_RANKS
#define AR_SHM_BYTES 65536           /* inner shm group: min_u64 chunk, exchange */
#define AR_ROW 12                    /* uint64 per rank in the bootstrap exchange */
#define AR_POLL 64                   /* spins between abort / deadline checks */

/* Error word values (ar_ctl.err). */
#define AR_ERR_TIMEOUT 1u
#define AR_ERR_ABORT 2u
#define AR_ERR_PEER 3u

/* Head of a receive buffer (device memory of its owner; peers write flag
 * and broken). */
struct ar_hdr {
    unsigned long long flag[AR_MAX][AR_BLOCKS]; /* [sender][block]: last epoch
                                                    whose data arrived */
    unsigned long long epoch[AR_BLOCKS];        /* owner only: calls per block */
    unsigned int broken;                        /* a rank gave up */
};

/* Mapped pinned host memory: written by the host (abort) and the device
 * (err), read by both. */
struct ar_ctl {
    unsigned int abort;    /* host -> device: give up */
    unsigned int err;      /* device -> host: AR_ERR_* of the first give-up */
};

/* Kernel arguments: the same for every replay of a recorded launch. */
struct ar_args {
    float *x;                       /* (n) in place */
    long long n;
    char *buf[AR_MAX];              /* rank s's receive buffer, as mapped here
                                       (indexed by constants only: a dynamic
                                       index would copy the array to local
                                       memory) */
    char *own;                      /* buf[rank] */
    size_t data_off;                /* bytes of the header, rounded */
    size_t slot_bytes;
    struct ar_ctl *ctl;             /* device pointer of the mapped control */
    unsigned long long timeout_ns;
    int rank, size;
};

struct ar_rank {
    struct dsv4_comm *inner;        /* shm group on the same id */
    int device;
    cudaStream_t stream;            /* be's stream at create (destroy syncs it) */
    char *own;                      /* cudaMalloc'd receive buffer */
    char *buf[AR_MAX];              /* every rank's buffer as mapped here */
    bool opened[AR_MAX];            /* buf[s] from cudaIpcOpenMemHandle */
    size_t data_off, slot_bytes;
    struct ar_ctl *ctl_h;           /* cudaHostAlloc'd, mapped */
    struct ar_ctl *ctl_d;
    int timeout_ms;
    uint64_t *scratch;              /* AR_SHM_BYTES host, min_u64 staging */
};

/* --- device side ------------------------------------------------------------ */

static __device__ __forceinline__ void
ar_st_release(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ unsigned long long
ar_ld_acquire(const unsigned long long *p)
{
    unsigned long long v;

    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void
ar_fence(void)
{
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}

static __device__ __forceinline__ unsigned long long
ar_clock_ns(void)
{
    unsigned long long t;

    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Give up (thread of block b): mark every buffer broken, report `why`. */
static __device__ void
ar_give_up(const struct ar_args &a, unsigned int why)
{
    volatile struct ar_ctl *ctl = a.ctl;

#pragma unroll
    for (int s = 0; s < AR_MAX; s++)
        if (s < a.size)
            *(volatile unsigned int *)&((struct ar_hdr *)a.buf[s])->broken = 1;
    if (ctl->err == 0)
        ctl->err = why;
    __threadfence_system();
}

/* Wait (thread t of the block, t != rank) for rank t's chunk of epoch e;
 * 0 when it came, else AR_ERR_*. */
static __device__ unsigned int
ar_wait(const struct ar_args &a, const struct ar_hdr *me, int t, unsigned long long e)
{
    volatile const struct ar_ctl *ctl = a.ctl;
    const volatile unsigned int *broken = &me->broken;
    unsigned long long t0 = 0;

    for (unsigned int spin = 0;; spin++) {
        if (ar_ld_acquire(&me->flag[t][blockIdx.x]) >= e)
            return 0;
        if (*broken)
            return AR_ERR_PEER;
        if (spin == 0) {
            t0 = ar_clock_ns();
        } else if (spin % AR_POLL == 0) {
            /* a host read (~1 us over PCIe): not on the fast path */
            if (ctl->abort)
                return AR_ERR_ABORT;
            if (ar_clock_ns() - t0 > a.timeout_ns)
                return AR_ERR_TIMEOUT;
        }
    }
}

__global__ void __launch_bounds__(AR_THREADS)
ar_kernel(const struct ar_args a)
{
    __shared__ unsigned long long s_epoch;
    __shared__ unsigned int s_fail;
    struct ar_hdr *me = (struct ar_hdr *)a.own;
    const int b = blockIdx.x, t = threadIdx.x;

    /* (an abort before this launch that no wait noticed is reported by the
     * host side: check() reads the abort word too) */
    if (t == 0) {
        s_fail = *(volatile unsigned int *)&me->broken;
        s_epoch = me->epoch[b] + 1;
        me->epoch[b] = s_epoch;
    }
    __syncthreads();
    if (s_fail != 0)
        return;
    const unsigned long long e = s_epoch;
    const size_t par = (size_t)(e & 1);
    /* this block's chunk [lo, hi) of x, 4-float aligned */
    const long long per = ((a.n + AR_BLOCKS - 1) / AR_BLOCKS + 3) / 4 * 4;
    const long long lo = min(a.n, (long long)b * per), hi = min(a.n, lo + per);
    /* float4 units [vlo, vhi) when x is 16-byte aligned (lo is a multiple
     * of 4 when the chunk is not empty), then floats [slo, hi); an empty
     * chunk (lo == hi == n) does nothing */
    long long vlo = 0, vhi = 0, slo = lo;

    if (((uintptr_t)a.x & 15) == 0 && lo < hi) {
        vlo = lo / 4;
        vhi = hi / 4;
        slo = vhi * 4;
    }

    /* 2. push the chunk into slot [par][rank] of every peer */
    {
        const size_t off = a.data_off + (par * (size_t)a.size + (size_t)a.rank) * a.slot_bytes;

        for (long long i = vlo + t; i < vhi; i += AR_THREADS) {
            float4 v = ((const float4 *)a.x)[i];

#pragma unroll
            for (int s = 0; s < AR_MAX; s++)
                if (s < a.size && s != a.rank)
                    ((float4 *)(a.buf[s] + off))[i] = v;
        }
        for (long long i = slo + t; i < hi; i += AR_THREADS) {
            float v = a.x[i];

#pragma unroll
            for (int s = 0; s < AR_MAX; s++)
                if (s < a.size && s != a.rank)
                    ((float *)(a.buf[s] + off))[i] = v;
        }
    }
    /* 3. signal: data before flags, at system scope */
    ar_fence();
    __syncthreads();
#pragma unroll
    for (int s = 0; s < AR_MAX; s++)
        if (t == s && s < a.size && s != a.rank)
            ar_st_release(&((struct ar_hdr *)a.buf[s])->flag[a.rank][b], e);
    /* 4. wait for every peer's chunk b of epoch e */
    if (t < a.size && t != a.rank) {
        unsigned int why = ar_wait(a, me, t, e);

        if (why != 0)
            atomicMax(&s_fail, why);
    }
    __syncthreads();
    if (s_fail != 0) {
        if (t == 0)
            ar_give_up(a, s_fail);
        return;
    }
    /* 5. x = sum over the slots in rank order (own slot: x) */
    {
        const char *base = a.own + a.data_off + par * (size_t)a.size * a.slot_bytes;

        for (long long i = vlo + t; i < vhi; i += AR_THREADS) {
            float4 acc = a.rank == 0 ? ((const float4 *)a.x)[i]
                                     : __ldcg((const float4 *)base + i);

            for (int s = 1; s < a.size; s++) {
                float4 v = s == a.rank ? ((const float4 *)a.x)[i]
                                       : __ldcg((const float4 *)(base + s * a.slot_bytes) + i);

                acc.x += v.x;
                acc.y += v.y;
                acc.z += v.z;
                acc.w += v.w;
            }
            ((float4 *)a.x)[i] = acc;
        }
        for (long long i = slo + t; i < hi; i += AR_THREADS) {
            float acc = a.rank == 0 ? a.x[i] : __ldcg((const float *)base + i);

            for (int s = 1; s < a.size; s++)
                acc += s == a.rank ? a.x[i]
                                   : __ldcg((const float *)(base + s * a.slot_bytes) + i);
            a.x[i] = acc;
        }
    }
}

/* --- host side ----------------------------------------------------------------- */

static enum dsv4_err
ar_check(struct dsv4_comm *c)
{
    struct ar_rank *ar = (struct ar_rank *)c->priv;
    unsigned int err = __atomic_load_n(&ar->ctl_h->err, __ATOMIC_ACQUIRE);
    unsigned int ab = __atomic_load_n(&ar->ctl_h->abort, __ATOMIC_ACQUIRE);

    if (ab != 0)   /* first: a block that saw another's give-up may have
                      written AR_ERR_PEER before the one that saw the abort */
        return dsv4_err_set(DSV4_ERR_CANCELED, "comm cudaipc: rank %d: aborted: the group is "
                            "broken, make a new one", c->rank);
    if (err == AR_ERR_TIMEOUT)
        return dsv4_err_set(DSV4_ERR_TIMEOUT, "comm cudaipc: rank %d: a peer did not answer "
                            "within %d ms: the group is broken, make a new one", c->rank,
                            ar->timeout_ms);
    if (err == AR_ERR_PEER)
        return dsv4_err_set(DSV4_ERR_TIMEOUT, "comm cudaipc: rank %d: a peer gave up: the "
                            "group is broken, make a new one", c->rank);
    if (err != 0)
        return dsv4_err_set(DSV4_ERR_CANCELED, "comm cudaipc: rank %d: aborted: the group is "
                            "broken, make a new one", c->rank);
    return DSV4_OK;
}

static void
ar_args_init(struct ar_args *a, const struct dsv4_comm *c, const struct ar_rank *ar)
{
    memset(a, 0, sizeof(*a));
    for (int s = 0; s < c->size; s++)
        a->buf[s] = ar->buf[s];
    a->own = ar->buf[c->rank];
    a->data_off = ar->data_off;
    a->slot_bytes = ar->slot_bytes;
    a->ctl = ar->ctl_d;
    a->timeout_ns = (unsigned long long)ar->timeout_ms * 1000000ull;
    a->rank = c->rank;
    a->size = c->size;
}

static enum dsv4_err
ar_allreduce(struct dsv4_comm *c, struct dsv4_backend *be, float *x, int64_t n)
{
    struct ar_rank *ar = (struct ar_rank *)c->priv;
    int64_t per = (int64_t)(ar->slot_bytes / sizeof(float));
    struct ar_args a;
    enum dsv4_err e;

    if (n <= 0)
        return DSV4_OK;
    if ((e = ar_check(c)) != DSV4_OK)
        return e;
    ar_args_init(&a, c, ar);
    /* larger than a slot: one launch per slot's worth (every rank splits
     * the same way; the offsets keep x's alignment: per % 64 == 0) */
    for (int64_t off = 0; off < n; off += per) {
        a.x = x + off;
        a.n = n - off < per ? n - off : per;
        ar_kernel<<<AR_BLOCKS, AR_THREADS, 0, cuda_stream(be)>>>(a);
        CUDA_LAUNCHED("ar_kernel");
    }
    return DSV4_OK;
}

static enum dsv4_err
ar_min_u64(struct dsv4_comm *c, struct dsv4_backend *be, uint64_t *x, int64_t n)
{
    struct ar_rank *ar = (struct ar_rank *)c->priv;
    int64_t per = AR_SHM_BYTES / (int64_t)sizeof(uint64_t);
    cudaStream_t st = cuda_stream(be);
    enum dsv4_err e;

    if ((e = ar_check(c)) != DSV4_OK)
        return e;
    for (int64_t off = 0; off < n; off += per) {
        int64_t k = n - off < per ? n - off : per;

        CUDA_TRY(cudaMemcpyAsync(ar->scratch, x + off, (size_t)k * sizeof(uint64_t),
                                 cudaMemcpyDeviceToHost, st));
        CUDA_TRY(cudaStreamSynchronize(st));
        e = ar->inner->ops->allreduce_min_u64(ar->inner, NULL, ar->scratch, k);
        if (e != DSV4_OK)
            return e;
        CUDA_TRY(cudaMemcpyAsync(x + off, ar->scratch, (size_t)k * sizeof(uint64_t),
                                 cudaMemcpyHostToDevice, st));
        CUDA_TRY(cudaStreamSynchronize(st));   /* scratch is reused */
    }
    return DSV4_OK;
}

/* Callable from any thread: spinning kernels see the mapped word within
 * AR_POLL turns; the inner shm group fails its waits at once. */
static void
ar_abort(struct dsv4_comm *c)
{
    struct ar_rank *ar = (struct ar_rank *)c->priv;

    __atomic_store_n(&ar->ctl_h->abort, 1u, __ATOMIC_RELEASE);
    if (ar->inner != NULL)
        ar->inner->ops->abort(ar->inner);
}

/* Release what create made (any subset of it). */
static void
ar_free(struct dsv4_comm *c)
{
    struct ar_rank *ar = (struct ar_rank *)c->priv;

    if (ar != NULL) {
        for (int s = 0; s < AR_MAX; s++)
            if (ar->opened[s])
                cudaIpcCloseMemHandle(ar->buf[s]);
        if (ar->own != NULL)
            cudaFree(ar->own);
        if (ar->ctl_h != NULL)
            cudaFreeHost(ar->ctl_h);
        dsv4_comm_destroy(ar->inner);
        free(ar->scratch);
        free(ar);
    }
    free(c);
    cudaGetLastError();   /* nothing sticky is left for the caller's next check */
}

/*
 * Healthy group: finish this rank's queued work, then a barrier (no peer
 * writes into our buffer after it), then free.  Broken or aborted: make any
 * kernel still queued give up, finish them, free without a barrier.
 */
static void
ar_destroy(struct dsv4_comm *c)
{
    struct ar_rank *ar = (struct ar_rank *)c->priv;
    bool healthy = ar_check(c) == DSV4_OK;

    cudaSetDevice(ar->device);
    if (!healthy)
        ar_abort(c);
    if (cudaStreamSynchronize(ar->stream) != cudaSuccess)
        healthy = false;
    if (healthy && ar_check(c) == DSV4_OK) {
        uint64_t one = 1;

        (void)ar->inner->ops->allreduce_min_u64(ar->inner, NULL, &one, 1);
    }
    ar_free(c);
}

static const struct dsv4_comm_ops ar_ops = {
    ar_allreduce,
    ar_min_u64,
    ar_abort,
    ar_destroy,
    ar_check,
};

/* Map rank s's buffer from its exchange row (pid, device, address, slot
 * bytes, IPC handle). */
static enum dsv4_err
ar_open_peer(struct ar_rank *ar, int s, const uint64_t *row)
{
    if ((pid_t)row[0] == getpid()) {
        int dev = (int)row[1], can = 0;

        if (dev != ar->device) {
            CUDA_TRY(cudaDeviceCanAccessPeer(&can, ar->device, dev));
            if (!can)
                return dsv4_err_set(DSV4_ERR_NOTSUP, "comm cudaipc: device %d cannot access "
                                    "device %d", ar->device, dev);
            cudaError_t rc = cudaDeviceEnablePeerAccess(dev, 0);

            if (rc == cudaErrorPeerAccessAlreadyEnabled)
                cudaGetLastError();
            else if (rc != cudaSuccess)
                return cuda_err(rc, "cudaDeviceEnablePeerAccess", __FILE__, __LINE__);
        }
        ar->buf[s] = (char *)(uintptr_t)row[2];
        return DSV4_OK;
    }
    cudaIpcMemHandle_t h;
    void *p = NULL;

    memcpy(&h, &row[4], sizeof(h));
    CUDA_TRY(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    ar->buf[s] = (char *)p;
    ar->opened[s] = true;
    return DSV4_OK;
}

extern "C" enum dsv4_err
dsv4_comm_cudaipc_create(struct dsv4_comm **out, struct dsv4_backend *be, int rank, int size,
                         const uint8_t id[DSV4_COMM_ID_BYTES], size_t max_bytes,
                         int timeout_ms)
{
    struct dsv4_comm *c;
    struct ar_rank *ar;
    uint64_t *tab = NULL;
    size_t total;
    enum dsv4_err e;
    cudaIpcMemHandle_t h;
    uint64_t ok;

    static_assert(sizeof(cudaIpcMemHandle_t) <= (AR_ROW - 4) * sizeof(uint64_t),
                  "IPC handle larger than its row");
    *out = NULL;
    if (be == NULL || be->name == NULL || strcmp(be->name, "cuda") != 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "comm cudaipc: not a CUDA backend");
    if (size < 2 || size > AR_MAX || rank < 0 || rank >= size || max_bytes == 0 ||
        timeout_ms <= 0 || !dsv4_comm_id_is_cudaipc(id))
        return dsv4_err_set(DSV4_ERR_INVAL, "comm cudaipc: rank %d of %d (2..%d), %zu bytes, "
                            "timeout %d ms, or not a cudaipc id", rank, size, AR_MAX,
                            max_bytes, timeout_ms);
    c = (struct dsv4_comm *)calloc(1, sizeof(*c));
    ar = (struct ar_rank *)calloc(1, sizeof(*ar));
    if (ar != NULL)
        ar->scratch = (uint64_t *)malloc(AR_SHM_BYTES);
    tab = (uint64_t *)malloc((size_t)size * AR_ROW * sizeof(uint64_t));
    if (c == NULL || ar == NULL || ar->scratch == NULL || tab == NULL) {
        free(tab);
        if (ar != NULL)
            free(ar->scratch);
        free(ar);
        free(c);
        return dsv4_err_set(DSV4_ERR_NOMEM, "comm cudaipc: no memory");
    }
    c->ops = &ar_ops;
    c->rank = rank;
    c->size = size;
    c->priv = ar;
    ar->device = cuda_st(be)->device;
    ar->stream = cuda_stream(be);
    ar->timeout_ms = timeout_ms;
    ar->data_off = cuda_align(sizeof(struct ar_hdr));
    ar->slot_bytes = cuda_align(max_bytes);
    total = ar->data_off + 2 * (size_t)size * ar->slot_bytes;

#define AR_FAIL(expr)                   \
    do {                                \
        if ((e = (expr)) != DSV4_OK)    \
            goto fail;                  \
    } while (0)
#define AR_CUDA(call)                                               \
    do {                                                            \
        cudaError_t rc_ = (call);                                   \
        if (rc_ != cudaSuccess) {                                   \
            e = cuda_err(rc_, #call, __FILE__, __LINE__);           \
            goto fail;                                              \
        }                                                           \
    } while (0)

    AR_CUDA(cudaSetDevice(ar->device));
    AR_CUDA(cudaHostAlloc((void **)&ar->ctl_h, sizeof(struct ar_ctl), cudaHostAllocMapped));
    memset(ar->ctl_h, 0, sizeof(*ar->ctl_h));
    AR_CUDA(cudaHostGetDevicePointer((void **)&ar->ctl_d, ar->ctl_h, 0));
    AR_CUDA(cudaMalloc((void **)&ar->own, total));
    AR_CUDA(cudaMemsetAsync(ar->own, 0, total, ar->stream));
    AR_CUDA(cudaStreamSynchronize(ar->stream));   /* zero before any peer maps it */
    AR_CUDA(cudaIpcGetMemHandle(&h, ar->own));
    AR_FAIL(dsv4_comm_shm_create(&ar->inner, rank, size, id, AR_SHM_BYTES, timeout_ms));

    /* exchange: one row per rank, the others' rows UINT64_MAX (minimum) */
    for (size_t i = 0; i < (size_t)size * AR_ROW; i++)
        tab[i] = UINT64_MAX;
    {
        uint64_t *row = tab + (size_t)rank * AR_ROW;

        memset(row, 0, AR_ROW * sizeof(uint64_t));
        row[0] = (uint64_t)getpid();
        row[1] = (uint64_t)ar->device;
        row[2] = (uint64_t)(uintptr_t)ar->own;
        row[3] = (uint64_t)ar->slot_bytes;
        memcpy(&row[4], &h, sizeof(h));
    }
    AR_FAIL(ar->inner->ops->allreduce_min_u64(ar->inner, NULL, tab, (int64_t)size * AR_ROW));
    ok = 1;
    for (int s = 0; s < size && ok; s++) {
        const uint64_t *row = tab + (size_t)s * AR_ROW;

        if (row[3] != ar->slot_bytes) {
            dsv4_err_set(DSV4_ERR_PROTO, "comm cudaipc: rank %d holds %llu-byte slots, rank "
                         "%d %zu", s, (unsigned long long)row[3], rank, ar->slot_bytes);
            ok = 0;
        } else if (s == rank) {
            ar->buf[s] = ar->own;
        } else if (ar_open_peer(ar, s, row) != DSV4_OK) {
            ok = 0;
        }
    }
    {
        /* every rank must have mapped every buffer before any pushes */
        char why[256];
        uint64_t all = ok;

        snprintf(why, sizeof(why), "%s", ok ? "" : dsv4_errmsg());
        AR_FAIL(ar->inner->ops->allreduce_min_u64(ar->inner, NULL, &all, 1));
        if (!ok)
            AR_FAIL(dsv4_err_set(DSV4_ERR_CUDA, "%s", why));
        if (!all)
            AR_FAIL(dsv4_err_set(DSV4_ERR_CUDA, "comm cudaipc: rank %d: a peer could not map "
                                 "the group's buffers", rank));
    }
#undef AR_CUDA
#undef AR_FAIL
    free(tab);
    *out = c;
    return DSV4_OK;
fail:
    free(tab);
    if (ar->inner != NULL)
        ar->inner->ops->abort(ar->inner);   /* peers stop waiting for us */
    ar_free(c);
    return e;
}
