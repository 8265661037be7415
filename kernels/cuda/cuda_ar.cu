/*
 * cuda_ar.cu — the cudaipc group of kernels/comm.h: a one-shot all-reduce
 * kernel between the CUDA devices of one host, that can be aborted.
 *
 * DESIGN.  Each rank owns a receive buffer in its own device memory (struct
 * ar_hdr, then 2 x size data slots of slot_bytes) and maps every peer's
 * (cudaIpcOpenMemHandle between processes; the plain pointer between
 * threads of one process, with peer access enabled), and after the data
 * slots 2 x size LL slots (ar_ll_kernel below).  Three kernels
 * (kernels/comm.h dsv4_comm_ar_algo; DSV4_CUDA_AR or set_tune pick): PUSH
 * and V1 (ar_kernel) and LL (ar_ll_kernel); AUTO runs LL for small x.
 * One PUSH call = one launch of G blocks (1 .. AR_BLOCKS by size; V1: always
 * AR_BLOCKS); block b owns the b-th 16-byte-aligned chunk of x:
 *   1. it takes the call's epoch e from its counter in device memory (the
 *      same kernel node replayed from a graph gets a new epoch each time)
 *      and bumps its counter and those of the blocks this grid lacks, so
 *      every call has one epoch whatever the grids of the calls before;
 *   2. it stores its chunk of x into slot [e & 1][rank] of every peer's
 *      buffer (16-byte peer stores);
 *   3. the block synchronises (V1: every thread fences first,
 *      fence.acq_rel.sys), and thread s stores e into flag[rank][b] of peer
 *      s (st.release.sys, cumulative over the block's stores);
 *   4. thread s spins on flag[s][b] of its own buffer (ld.acquire.sys)
 *      until it holds e or more; the block synchronises;
 *   5. it sums its chunk over the slots in rank order (its own slot is x
 *      itself; the peers' slots are read through L2, ld.cg) into x.
 * Memory order: a peer's data stores happen before its fence, its barrier
 * and its release store of the flag; our acquire load of that flag and our
 * barrier order our reads after them (PTX release/acquire patterns at
 * system scope, cumulative through bar.sync).
 * Slot reuse: rank r writes parity p of peer q again at call e + 2, after
 * its kernel of call e + 1 finished, whose blocks saw q's flags of call
 * e + 1, which q stores only once q's kernel of call e + 1 runs, i.e. after
 * q's kernel of call e (all its blocks, whatever the chunks and grids)
 * finished reading parity p.  Flags only grow, so one flag per (rank,
 * block) suffices ("e or more"), whatever grid each call had.
 *
 * Abort.  The waits (ar_wait_poll, on each wait's own schedule) poll the
 * group's `broken` word (own device memory, written by any rank that gives
 * up), and every 64 turns the abort word
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
 * bootstrap: the ranks exchange process tokens (random), devices, buffer addresses and IPC
 * handles with a minimum all-reduce over UINT64_MAX-padded rows.
 */
#include "kernels/comm.h"
#include "kernels/cuda/cuda.cuh"

#include <sys/random.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define AR_BLOCKS DSV4_COMM_AR_MAX_BLOCKS  /* most blocks of a launch (per-block flags) */
#define AR_THREADS 512
#define AR_MAX DSV4_COMM_CUDAIPC_MAX_RANKS
#define AR_SHM_BYTES 65536           /* inner shm group: min_u64 chunk, exchange */
#define AR_ROW 12                    /* uint64 per rank in the bootstrap exchange */
#define AR_POLL 64                   /* spins between abort / deadline checks */
#define AR_LL_POLL_BROKEN 16         /* LL: spins between checks of `broken` */
#define AR_LL_POLL_HOST 1024         /* LL: spins between reads of the abort word */
#define AR_LL_CAP ((size_t)1 << 20)  /* most bytes of x per LL launch */

/* Error word values (ar_ctl.err). */
#define AR_ERR_TIMEOUT 1u
#define AR_ERR_ABORT 2u
#define AR_ERR_PEER 3u

/* Head of a receive buffer (device memory of its owner; peers write flag
 * and broken). */
struct ar_hdr {
    unsigned long long flag[AR_MAX][AR_BLOCKS]; /* [sender][block]: last epoch
                                                    whose data arrived */
    unsigned long long epoch[AR_BLOCKS];        /* owner only: calls so far
                                                   (all entries equal between
                                                   launches) */
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
    size_t ll_off;                  /* LL slots: [2][size] of ll_bytes */
    size_t ll_bytes;
    struct ar_ctl *ctl;             /* device pointer of the mapped control */
    unsigned long long timeout_ns;
    long long per;                  /* per block: floats (push, a multiple
                                       of 4), units of 4 floats (LL) */
    int rank, size;
    int fence_all;                  /* push: every thread fences (V1) */
};

struct ar_rank {
    struct dsv4_comm *inner;        /* shm group on the same id */
    int device;
    cudaStream_t stream;            /* be's stream at create (destroy syncs it) */
    char *own;                      /* cudaMalloc'd receive buffer */
    char *buf[AR_MAX];              /* every rank's buffer as mapped here */
    bool opened[AR_MAX];            /* buf[s] from cudaIpcOpenMemHandle */
    size_t data_off, slot_bytes;
    size_t ll_off, ll_bytes;        /* LL slots (ll_bytes = 2 x bytes of x) */
    struct dsv4_comm_ar_tune tune;  /* kernels (DSV4_CUDA_AR, set_tune) */
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

/* LL line: two 8-byte words, each single-copy atomic (flag in the high
 * half, data in the low half); the vector access is two such words. */
static __device__ __forceinline__ void
ar_st_line(ulonglong2 *p, ulonglong2 v)
{
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(v.x), "l"(v.y)
                 : "memory");
}

static __device__ __forceinline__ ulonglong2
ar_ld_line(const ulonglong2 *p)
{
    ulonglong2 v;

    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p)
                 : "memory");
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

/*
 * Start of a launch (thread 0): this call's epoch e, the same in every block
 * of every launch whatever its grid: block b reads its counter and writes
 * e into the counters b, b + G, b + 2G, ... (G = gridDim.x), so that all
 * AR_BLOCKS counters stay equal and each is touched by one block only.
 */
static __device__ unsigned long long
ar_epoch_next(struct ar_hdr *me)
{
    const unsigned long long e = me->epoch[blockIdx.x] + 1;

#pragma unroll 1
    for (unsigned int b = blockIdx.x; b < AR_BLOCKS; b += gridDim.x)
        me->epoch[b] = e;
    return e;
}

/* Start of a launch (every thread): *s_epoch <- the call's epoch, *s_fail
 * <- the group's broken word; false when broken (the block returns).  (An
 * abort before this launch that no wait noticed is reported by the host
 * side: check() reads the abort word too.) */
static __device__ __forceinline__ bool
ar_begin(struct ar_hdr *me, unsigned long long *s_epoch, unsigned int *s_fail)
{
    if (threadIdx.x == 0) {
        *s_fail = *(volatile unsigned int *)&me->broken;
        *s_epoch = ar_epoch_next(me);
    }
    __syncthreads();
    return *s_fail == 0;
}

/*
 * The give-up checks of turn `spin` (0, 1, ...) of a wait loop, the same
 * for every wait: 0 to keep waiting, else the AR_ERR_* to give up with.
 * Each reason is looked at only on the turns its flag says (the loop's
 * schedule; constants once inlined): `broken` (own device memory, written
 * by a peer that gave up) when peer; the abort word (mapped host memory: a
 * read over PCIe, ~1 us) when host; the deadline (timeout_ns from *t0,
 * %globaltimer) when deadline, the abort word first when host_first.  Turn
 * 0 only starts the clock (*t0) after the `broken` check: neither loop
 * schedules the deadline or the abort word there.
 */
static __device__ __forceinline__ unsigned int
ar_wait_poll(const struct ar_args &a, unsigned int spin, unsigned long long *t0, bool peer,
             bool host, bool deadline, bool host_first)
{
    const volatile unsigned int *broken = &((const struct ar_hdr *)a.own)->broken;
    volatile const struct ar_ctl *ctl = a.ctl;

    if (peer && *broken)
        return AR_ERR_PEER;
    if (spin == 0) {
        *t0 = ar_clock_ns();
        return 0;
    }
    if (host_first && host && ctl->abort)
        return AR_ERR_ABORT;
    if (deadline && ar_clock_ns() - *t0 > a.timeout_ns)
        return AR_ERR_TIMEOUT;
    if (!host_first && host && ctl->abort)
        return AR_ERR_ABORT;
    return 0;
}

/* Wait (thread t of the block, t != rank) for rank t's chunk of epoch e;
 * 0 when it came, else AR_ERR_*.  Every turn looks at `broken`; every
 * AR_POLL turns at the abort word, then the deadline (host reads: not on
 * the fast path). */
static __device__ unsigned int
ar_wait(const struct ar_args &a, const struct ar_hdr *me, int t, unsigned long long e)
{
    unsigned long long t0 = 0;

    for (unsigned int spin = 0;; spin++) {
        if (ar_ld_acquire(&me->flag[t][blockIdx.x]) >= e)
            return 0;
        const bool poll = spin % AR_POLL == 0;
        const unsigned int why = ar_wait_poll(a, spin, &t0, true, poll, poll, true);

        if (why != 0)
            return why;
    }
}

/* PUSH and V1: see the file's head.  Grid: 1 .. AR_BLOCKS blocks. */
__global__ void __launch_bounds__(AR_THREADS)
ar_kernel(const struct ar_args a)
{
    __shared__ unsigned long long s_epoch;
    __shared__ unsigned int s_fail;
    struct ar_hdr *me = (struct ar_hdr *)a.own;
    const int b = blockIdx.x, t = threadIdx.x;

    if (!ar_begin(me, &s_epoch, &s_fail))
        return;
    const unsigned long long e = s_epoch;
    const size_t par = (size_t)(e & 1);
    /* this block's chunk [lo, hi) of x, 4-float aligned (a.per floats) */
    const long long lo = min(a.n, (long long)b * a.per), hi = min(a.n, lo + a.per);
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
    /* 3. signal: data before flags, at system scope.  The release store is
     * cumulative: it orders every store of the block that precedes it
     * through the barrier, so one release per peer suffices (V1 also
     * fences in every thread, as the first version did) */
    if (a.fence_all)
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

/* --- LL kernel ---------------------------------------------------------------- */

/* The LL flag of epoch e: never 0 (the zeroed slots never match), and two
 * epochs of the same parity share a flag only 2 x (2^32 - 1) calls apart. */
static __device__ __forceinline__ unsigned int
ar_ll_flag(unsigned long long e)
{
    /* e mod (2^32 - 1) by end-around carry, then + 1 */
    unsigned long long r = (e & 0xffffffffull) + (e >> 32);

    r = (r & 0xffffffffull) + (r >> 32);
    return (r == 0xffffffffull ? 0u : (unsigned int)r) + 1u;
}

/* Floats 4u .. 4u+3 of x (zeros past n; element by element when x is not
 * 16-byte aligned or at the tail). */
static __device__ __forceinline__ float4
ar_ll_get(const struct ar_args &a, long long u, bool vec)
{
    const long long i = 4 * u;
    float4 v;

    if (vec && i + 3 < a.n)
        return ((const float4 *)a.x)[u];
    v.x = a.x[i];
    v.y = i + 1 < a.n ? a.x[i + 1] : 0.0f;
    v.z = i + 2 < a.n ? a.x[i + 2] : 0.0f;
    v.w = i + 3 < a.n ? a.x[i + 3] : 0.0f;
    return v;
}

static __device__ __forceinline__ void
ar_ll_put(const struct ar_args &a, long long u, bool vec, float4 v)
{
    const long long i = 4 * u;

    if (vec && i + 3 < a.n) {
        ((float4 *)a.x)[u] = v;
        return;
    }
    a.x[i] = v.x;
    if (i + 1 < a.n)
        a.x[i + 1] = v.y;
    if (i + 2 < a.n)
        a.x[i + 2] = v.z;
    if (i + 3 < a.n)
        a.x[i + 3] = v.w;
}

static __device__ __forceinline__ unsigned long long
ar_ll_word(unsigned int f, float v)
{
    return (unsigned long long)f << 32 | __float_as_uint(v);
}

static __device__ __forceinline__ bool
ar_ll_ok(ulonglong2 l, unsigned int f)
{
    return (unsigned int)(l.x >> 32) == f && (unsigned int)(l.y >> 32) == f;
}

/*
 * Wait (a whole warp: every lane calls it, valid or not) until lines p[0]
 * and p[1] hold flag f in every valid lane, then *v = their data; 0, or the
 * AR_ERR_* of a give-up (the same in every lane).  Lane 0 watches `broken`,
 * the deadline and the abort word for the warp.
 */
static __device__ __forceinline__ unsigned int
ar_ll_wait(const struct ar_args &a, const ulonglong2 *p, bool valid, unsigned int f, float4 *v)
{
    unsigned long long t0 = 0;

    for (unsigned int spin = 0;; spin++) {
        ulonglong2 l0 = make_ulonglong2(0, 0), l1 = make_ulonglong2(0, 0);
        unsigned int why = 0;
        bool ok = true;

        if (valid) {
            l0 = ar_ld_line(p);
            l1 = ar_ld_line(p + 1);
            ok = ar_ll_ok(l0, f) && ar_ll_ok(l1, f);
        }
        if (__all_sync(0xffffffffu, ok)) {
            v->x = __uint_as_float((unsigned int)l0.x);
            v->y = __uint_as_float((unsigned int)l0.y);
            v->z = __uint_as_float((unsigned int)l1.x);
            v->w = __uint_as_float((unsigned int)l1.y);
            return 0;
        }
        /* `broken` every AR_LL_POLL_BROKEN turns, the deadline every
         * AR_POLL, the abort word (a host read: rare) every
         * AR_LL_POLL_HOST, each on the last turn of its period */
        if ((threadIdx.x & 31) == 0)
            why = ar_wait_poll(a, spin, &t0,
                               spin % AR_LL_POLL_BROKEN == AR_LL_POLL_BROKEN - 1,
                               spin % AR_LL_POLL_HOST == AR_LL_POLL_HOST - 1,
                               spin % AR_POLL == AR_POLL - 1, false);
        why = __shfl_sync(0xffffffffu, why, 0);
        if (why != 0)
            return why;
    }
}

/*
 * LL: x in units of 4 floats (u = 0 .. ceil(n/4) - 1), block b owns the
 * b-th run of units.  Unit u travels as LL lines 2u and 2u + 1 of slot
 * [e & 1][rank] of every peer's LL slots: 16-byte stores of two 8-byte
 * words (flag f of epoch e << 32 | data bits).  An 8-byte word is written
 * and read whole (single-copy atomic), so a reader that sees f in a word
 * holds that word's data of call e: no fence, no flag round trip.  Phase 1
 * stores every unit of the block's run, phase 2 polls the peers' lines and
 * sums in rank order (own data: x itself) into x.
 * Slot reuse as for PUSH: a rank writes parity p again at call e + 2 only
 * after its whole kernel of call e + 1 received every peer's lines of call
 * e + 1, which each peer writes only after its kernel of call e finished.
 * Loops run the same number of turns in every lane of a warp (the warp
 * polls together: __all_sync) and blockDim.x is a multiple of 32.
 */
__global__ void __launch_bounds__(AR_THREADS)
ar_ll_kernel(const struct ar_args a)
{
    __shared__ unsigned long long s_epoch;
    __shared__ unsigned int s_fail;
    struct ar_hdr *me = (struct ar_hdr *)a.own;
    const int t = threadIdx.x, nt = blockDim.x;

    if (!ar_begin(me, &s_epoch, &s_fail))
        return;
    const unsigned long long e = s_epoch;
    const unsigned int f = ar_ll_flag(e);
    const size_t par = (size_t)(e & 1);
    const long long units = (a.n + 3) / 4;
    const long long lo = min(units, (long long)blockIdx.x * a.per), hi = min(units, lo + a.per);
    const bool vec = ((uintptr_t)a.x & 15) == 0;
    unsigned int why = 0;

    /* 1. store the run into LL slot [par][rank] of every peer */
    {
        const size_t off = a.ll_off + (par * (size_t)a.size + (size_t)a.rank) * a.ll_bytes;

        for (long long u = lo + t; u < hi; u += nt) {
            const float4 v = ar_ll_get(a, u, vec);
            const ulonglong2 l0 = make_ulonglong2(ar_ll_word(f, v.x), ar_ll_word(f, v.y));
            const ulonglong2 l1 = make_ulonglong2(ar_ll_word(f, v.z), ar_ll_word(f, v.w));

#pragma unroll
            for (int s = 0; s < AR_MAX; s++)
                if (s < a.size && s != a.rank) {
                    ulonglong2 *q = (ulonglong2 *)(a.buf[s] + off) + 2 * u;

                    ar_st_line(q, l0);
                    ar_st_line(q + 1, l1);
                }
        }
    }
    /* 2. receive and sum in rank order */
    {
        const char *base = a.own + a.ll_off + par * (size_t)a.size * a.ll_bytes;

        for (long long u0 = lo; u0 < hi && why == 0; u0 += nt) {
            const long long u = u0 + t;
            const bool valid = u < hi;
            const float4 mine = valid ? ar_ll_get(a, u, vec) : make_float4(0, 0, 0, 0);
            float4 acc = mine;

#pragma unroll
            for (int s = 0; s < AR_MAX; s++) {
                float4 v = mine;

                if (s >= a.size || why != 0)
                    break;
                if (s != a.rank)
                    why = ar_ll_wait(a, (const ulonglong2 *)(base + s * a.ll_bytes) + 2 * u,
                                     valid, f, &v);
                if (s == 0) {
                    acc = v;
                } else {
                    acc.x += v.x;
                    acc.y += v.y;
                    acc.z += v.z;
                    acc.w += v.w;
                }
            }
            if (why == 0 && valid)
                ar_ll_put(a, u, vec, acc);
        }
    }
    if (why != 0 && (t & 31) == 0) {
        /* first reason wins; our other warps and blocks stop at once */
        atomicCAS(&s_fail, 0u, why);
        *(volatile unsigned int *)&me->broken = 1;
    }
    __syncthreads();
    if (s_fail != 0 && t == 0)
        ar_give_up(a, s_fail);
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
    a->ll_off = ar->ll_off;
    a->ll_bytes = ar->ll_bytes;
    a->ctl = ar->ctl_d;
    a->timeout_ns = (unsigned long long)ar->timeout_ms * 1000000ull;
    a->rank = c->rank;
    a->size = c->size;
}

static enum dsv4_err
ar_allreduce(struct dsv4_comm *c, struct dsv4_backend *be, float *x, int64_t n)
{
    struct ar_rank *ar = (struct ar_rank *)c->priv;
    enum dsv4_comm_ar_algo algo = dsv4_comm_ar_pick(&ar->tune, n);
    bool ll = algo == DSV4_COMM_AR_LL;
    /* most floats per launch: a slot, or half the LL slot (every rank
     * splits the same way; the offsets keep x's alignment: per % 64 == 0) */
    int64_t per = (int64_t)((ll ? ar->ll_bytes / 2 : ar->slot_bytes) / sizeof(float));
    struct ar_args a;
    enum dsv4_err e;

    if (n <= 0)
        return DSV4_OK;
    if ((e = ar_check(c)) != DSV4_OK)
        return e;
    ar_args_init(&a, c, ar);
    a.fence_all = algo == DSV4_COMM_AR_V1;
    for (int64_t off = 0; off < n; off += per) {
        size_t bytes;
        int blocks;

        a.x = x + off;
        a.n = n - off < per ? n - off : per;
        bytes = (size_t)a.n * sizeof(float);
        if (ll) {
            blocks = dsv4_comm_ar_blocks(bytes, ar->tune.ll_block);
            a.per = ((a.n + 3) / 4 + blocks - 1) / blocks;
            ar_ll_kernel<<<blocks, AR_THREADS, 0, cuda_stream(be)>>>(a);
            CUDA_LAUNCHED("ar_ll_kernel");
        } else {
            blocks = algo == DSV4_COMM_AR_V1 ? AR_BLOCKS
                                             : dsv4_comm_ar_blocks(bytes, ar->tune.push_block);
            a.per = ((a.n + blocks - 1) / blocks + 3) / 4 * 4;
            ar_kernel<<<blocks, AR_THREADS, 0, cuda_stream(be)>>>(a);
            CUDA_LAUNCHED("ar_kernel");
        }
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

/* Close the peers' buffers this rank mapped (cudaIpcOpenMemHandle). */
static void
ar_close_peers(struct ar_rank *ar)
{
    for (int s = 0; s < AR_MAX; s++)
        if (ar->opened[s]) {
            cudaIpcCloseMemHandle(ar->buf[s]);
            ar->opened[s] = false;
        }
}

/* Release what create made (any subset of it). */
static void
ar_free(struct dsv4_comm *c)
{
    struct ar_rank *ar = (struct ar_rank *)c->priv;

    if (ar != NULL) {
        ar_close_peers(ar);
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
 * Healthy group: finish this rank's queued work, close the peers' buffers,
 * then a barrier (after it no peer writes into our buffer, and none has it
 * mapped: CUDA leaves freeing an exported buffer before its importers close
 * it undefined), then free.  Broken or aborted: make any kernel still
 * queued give up, finish them, free without a barrier (a peer that never
 * closes would hold this one for ever).
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

        ar_close_peers(ar);
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

extern "C" enum dsv4_err
dsv4_comm_cudaipc_set_tune(struct dsv4_comm *c, const char *spec)
{
    struct dsv4_comm_ar_tune t;
    enum dsv4_err e;

    if (c == NULL || c->ops != &ar_ops)
        return dsv4_err_set(DSV4_ERR_INVAL, "comm cudaipc: set_tune on another communicator");
    if ((e = dsv4_comm_ar_tune_parse(&t, spec)) != DSV4_OK)
        return e;
    ((struct ar_rank *)c->priv)->tune = t;
    return DSV4_OK;
}

static uint64_t ar_token_value;
static pthread_once_t ar_token_once = PTHREAD_ONCE_INIT;

static void
ar_token_init(void)
{
    uint64_t t = 0;

    if (getrandom(&t, sizeof(t), 0) != (ssize_t)sizeof(t))
        t = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&t;   /* no getrandom: unlikely */
    ar_token_value = t == UINT64_MAX ? 1 : t;
}

/* This process's token in the exchange: random, so that ranks in other
 * PID namespaces (a container each, both PID 1) are never taken for this
 * process, whose raw device addresses would then be used as its own. */
static uint64_t
ar_token(void)
{
    pthread_once(&ar_token_once, ar_token_init);
    return ar_token_value;
}

/* Map rank s's buffer from its exchange row (process token, device,
 * address, slot bytes, IPC handle). */
static enum dsv4_err
ar_open_peer(struct ar_rank *ar, int s, const uint64_t *row)
{
    if (row[0] == ar_token()) {
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
                         int timeout_ms, const struct dsv4_comm_stop *stop)
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
    if (!cuda_is_backend(be))
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
    if (dsv4_comm_ar_tune_parse(&ar->tune, getenv("DSV4_CUDA_AR")) != DSV4_OK) {
        e = DSV4_ERR_CONFIG;
        free(tab);
        ar_free(c);
        return e;
    }
    ar->device = cuda_st(be)->device;
    ar->stream = cuda_stream(be);
    ar->timeout_ms = timeout_ms;
    ar->data_off = cuda_align(sizeof(struct ar_hdr));
    ar->slot_bytes = cuda_align(max_bytes);
    ar->ll_off = ar->data_off + 2 * (size_t)size * ar->slot_bytes;
    ar->ll_bytes = 2 * (ar->slot_bytes < AR_LL_CAP ? ar->slot_bytes : AR_LL_CAP);
    total = ar->ll_off + 2 * (size_t)size * ar->ll_bytes;

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
    AR_FAIL(dsv4_comm_shm_create(&ar->inner, rank, size, id, AR_SHM_BYTES, timeout_ms, stop));

    /* exchange: one row per rank, the others' rows UINT64_MAX (minimum) */
    for (size_t i = 0; i < (size_t)size * AR_ROW; i++)
        tab[i] = UINT64_MAX;
    {
        uint64_t *row = tab + (size_t)rank * AR_ROW;

        memset(row, 0, AR_ROW * sizeof(uint64_t));
        row[0] = ar_token();
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
