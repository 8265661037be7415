/*
 * comm.h — collective communication between the ranks of one model group
 * (tensor-parallel attention, experts split as group_split says; kernels/forward.h).
 *
 * The forward pass needs one collective: an in-place sum over the ranks of
 * a buffer of backend memory (all-reduce).  The model uses it only on
 * buffers where each element is nonzero on at most one rank (each rank
 * writes its own columns or rows and zeros elsewhere), so the sum is an
 * exact gather: results do not depend on the number of ranks or on the
 * reduction order, and a group computes bit for bit what one rank computes.
 *
 * Implementations:
 *   local  ranks are threads of one process, each with its own backend
 *          (any backend whose memory the host can read: the CPU backend);
 *          kernels/comm_local.c.  Used by the tests.
 *   shm    ranks are processes on one host with host-readable backends (the
 *          CPU backend's rank daemons): a POSIX shared-memory segment named
 *          by the group id; kernels/comm_shm.c.
 *   nccl   one CUDA device per rank, any process layout; the sum is queued
 *          on the rank's CUDA backend stream (so it can be recorded in a
 *          decode graph); kernels/cuda/cuda_comm.cu, CUDA builds only.
 *   cudaipc  one CUDA device per rank, all ranks on one host (2..8): a
 *          one-shot all-reduce kernel over NVLink / PCIe peer stores into
 *          the peers' device buffers (CUDA IPC), queued on the backend
 *          stream like nccl; it can be aborted while waiting for a rank that
 *          died, leaving the stream and the CUDA context healthy;
 *          kernels/cuda/cuda_ar.cu, CUDA builds only (docs/gpu.md).
 *
 * Execution context: each rank's handle is used by one thread at a time;
 * every rank must issue the same collectives in the same order.
 */
#ifndef DSV4_KERNELS_COMM_H
#define DSV4_KERNELS_COMM_H

#include <stdint.h>

#include "common/err.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct dsv4_comm;

/* A communicator's operations (local, shm, NCCL, cudaipc), each documented
 * at its member. */
struct dsv4_comm_ops {
    /* x (n floats, memory of backend be) <- Σ over the ranks' x, in place.
     * Local: blocks until every rank has summed.  NCCL: queued on be's
     * stream. */
    enum dsv4_err (*allreduce_sum)(struct dsv4_comm *c, struct dsv4_backend *be, float *x,
                                   int64_t n);
    /* x (n uint64, memory of be) <- element-wise minimum over the ranks, in
     * place (small control exchanges: which work every rank agrees on). */
    enum dsv4_err (*allreduce_min_u64)(struct dsv4_comm *c, struct dsv4_backend *be,
                                       uint64_t *x, int64_t n);
    /* Give up: collectives in flight or started later fail instead of
     * waiting for a rank that is gone.  Callable from another thread. */
    void (*abort)(struct dsv4_comm *c);
    /* Free this rank's handle. */
    void (*destroy)(struct dsv4_comm *c);
    /* Optional (NULL: collectives report their errors when called).  For
     * communicators whose queued collectives can fail after the call
     * returned (cudaipc): DSV4_OK when none of those queued so far has
     * failed; otherwise the group is broken (DSV4_ERR_TIMEOUT, or
     * DSV4_ERR_CANCELED after an abort): make a new one.  Covers every
     * collective that has completed on the device: call it after
     * synchronising the backend to cover all of them. */
    enum dsv4_err (*check)(struct dsv4_comm *c);
};

/* One rank's handle of a group. */
struct dsv4_comm {
    const struct dsv4_comm_ops *ops;
    int rank;     /* 0 .. size-1 */
    int size;     /* ranks in the group */
    void *priv;
};

/*
 * A local group of `size` ranks (threads of this process): out[r] is rank
 * r's handle, to be used by one thread each.  Each handle is freed with
 * dsv4_comm_destroy; the shared state goes with the last one.
 */
enum dsv4_err dsv4_comm_local_create(struct dsv4_comm **out, int size);

/* Free a handle (NULL is a no-op). */
void dsv4_comm_destroy(struct dsv4_comm *c);

/* c->ops->check when the communicator has one, else DSV4_OK (NULL c:
 * DSV4_OK).  kernels/comm_id.c. */
enum dsv4_err dsv4_comm_check(struct dsv4_comm *c);

/* Bytes of a group id (an NCCL unique id, or a shm group's name), made by
 * rank 0 and given to every rank. */
#define DSV4_COMM_ID_BYTES 128

/*
 * A way to stop a communicator's creation early (the create functions'
 * `stop`; NULL: none): the waits for the other ranks call fn(arg) now and
 * then, and give up with DSV4_ERR_CANCELED once it returns nonzero (a rank
 * that leaves a join for a newer group, or stops).  fn is called from the
 * creating thread.
 */
struct dsv4_comm_stop {
    int (*fn)(void *arg);
    void *arg;
};

/* A fresh id for a shm group (random name); first sweeps /dev/shm
 * (dsv4_comm_shm_sweep, names older than 10 minutes). */
enum dsv4_err dsv4_comm_shm_unique_id(uint8_t id[DSV4_COMM_ID_BYTES]);

/* Unlink this user's dsv4comm-* segments in `dir` (the directory behind
 * shm_open's names: /dev/shm) last written `stale_s` or more seconds ago,
 * one stderr line each: a group whose rank 0 was killed before any peer
 * opened its name leaves it (kernels/comm_shm.c). */
void dsv4_comm_shm_sweep(const char *dir, int stale_s);

/*
 * Join shm group `id` as rank `rank` of `size`; buffers of up to
 * `max_bytes` can be reduced.  Rank 0 creates the segment, the others open
 * it (waiting for it up to timeout_ms); every collective waits at most
 * timeout_ms for the others (then DSV4_ERR_TIMEOUT, and the group is
 * broken: make a new one).  The segment's name is unlinked once every rank
 * has mapped it, or by any rank whose creation fails; rank 0 reserves its
 * pages (a full /dev/shm: DSV4_ERR_SYS).  `stop` (or NULL) ends the waits
 * of the creation early (DSV4_ERR_CANCELED, the segment marked broken for
 * the ranks that joined).  A rank whose max_bytes differs from rank 0's is
 * refused at once (DSV4_ERR_CONFIG) and breaks the group, so that the
 * others stop waiting too (DSV4_ERR_TIMEOUT, "the group broke").
 */
enum dsv4_err dsv4_comm_shm_create(struct dsv4_comm **out, int rank, int size,
                                   const uint8_t id[DSV4_COMM_ID_BYTES], size_t max_bytes,
                                   int timeout_ms, const struct dsv4_comm_stop *stop);

/* NCCL group (CUDA builds, DSV4_HAVE_CUDA). */
enum dsv4_err dsv4_comm_nccl_unique_id(uint8_t id[DSV4_COMM_ID_BYTES]);

/*
 * Join NCCL group `id` as rank `rank` of `size`, on the device of CUDA
 * backend `be`.  Waits until every rank has joined, at most timeout_ms
 * (then DSV4_ERR_TIMEOUT), or until `stop` (or NULL) says so
 * (DSV4_ERR_CANCELED).  DSV4_ERR_NOTSUP without libnccl.so.2.
 */
enum dsv4_err dsv4_comm_nccl_create(struct dsv4_comm **out, struct dsv4_backend *be, int rank,
                                    int size, const uint8_t id[DSV4_COMM_ID_BYTES],
                                    int timeout_ms, const struct dsv4_comm_stop *stop);

/*
 * cudaipc group (CUDA builds; kernels/cuda/cuda_ar.cu, docs/gpu.md "One-shot
 * all-reduce over CUDA IPC").
 *
 * The id is a shm-style name with its own prefix ("/dsv4ar-" and 32 hex
 * digits): dsv4_comm_cudaipc_unique_id makes one (any build), and
 * dsv4_comm_id_is_cudaipc tells it from a shm group name or an NCCL unique
 * id (kernels/comm_id.c), so the ranks of a group take the kind of
 * communicator from the id rank 0 made.
 */
#define DSV4_COMM_CUDAIPC_PREFIX "/dsv4ar-"
#define DSV4_COMM_CUDAIPC_MAX_RANKS 8

/* A fresh id for a cudaipc group: the prefix and 32 random lower-case hex
 * digits (those of a shm group's random name), NUL-padded.  Errors: those
 * of dsv4_comm_shm_unique_id. */
enum dsv4_err dsv4_comm_cudaipc_unique_id(uint8_t id[DSV4_COMM_ID_BYTES]);
/* 1 when id is a cudaipc group id (prefix, 32 lower-case hex digits, NUL,
 * zeros to the end), else 0. */
int dsv4_comm_id_is_cudaipc(const uint8_t id[DSV4_COMM_ID_BYTES]);

/* Kinds of communicator (dsv4_comm_pick). */
enum dsv4_comm_kind {
    DSV4_COMM_NONE = 0,     /* the setting does not fit the backend */
    DSV4_COMM_SHM,
    DSV4_COMM_NCCL,
    DSV4_COMM_CUDAIPC,
};

/*
 * The communicator a group's rank 0 makes (the rank daemons' `comm` key,
 * docs/operations.md): `comm` "auto", "nccl", "cudaipc" or "shm"; `backend`
 * "cpu" or "cuda"; one_host: every rank of the group is on this host (COMM,
 * docs/protocol.md §6.4).  cpu: shm (auto or shm); cuda: auto is cudaipc on
 * one host (2..8 ranks of `size`), else nccl.  DSV4_COMM_NONE with the
 * reason in dsv4_errmsg() for a setting the backend cannot use (nccl or
 * cudaipc on cpu, shm on cuda, cudaipc for more than 8 ranks).  Pure.
 */
enum dsv4_comm_kind dsv4_comm_pick(const char *comm, const char *backend, int one_host,
                                   int size);

/*
 * Join cudaipc group `id` as rank `rank` of `size` (2 .. 8), on the device of
 * CUDA backend `be`; the ranks are processes (or threads, one device each) of
 * one host.  Rank 0 creates a bootstrap shm segment named by the id (the
 * others wait for it up to timeout_ms); every rank allocates its receive
 * buffer (2 x size slots of max_bytes, rounded up to 256, plus flags) in its
 * own device memory and maps the peers' buffers (CUDA IPC, or direct
 * pointers between threads of one process).  allreduce_sum: one kernel per
 * max_bytes of x (LL kernel: per min(max_bytes, 1 MiB)) on be's stream
 * (capturable in a graph: its epoch lives in device memory), x 16-byte
 * aligned is fastest; the sum runs in rank order.  The kernels come from
 * DSV4_CUDA_AR in the environment (dsv4_comm_ar_tune_parse below; a bad
 * value: DSV4_ERR_CONFIG).
 * Each wait inside the kernel gives up after timeout_ms (or at once after
 * abort): the kernel returns normally, the stream stays usable, and
 * check / the next call report the broken group.  allreduce_min_u64 is a
 * host exchange through the bootstrap segment (synchronises be's stream; not
 * for graphs).  destroy does not hang on a dead peer.  `stop` (or NULL)
 * ends the wait for the bootstrap segment's ranks early (DSV4_ERR_CANCELED).
 * DSV4_ERR_NOTSUP in builds without CUDA.
 */
enum dsv4_err dsv4_comm_cudaipc_create(struct dsv4_comm **out, struct dsv4_backend *be,
                                       int rank, int size,
                                       const uint8_t id[DSV4_COMM_ID_BYTES], size_t max_bytes,
                                       int timeout_ms, const struct dsv4_comm_stop *stop);

/*
 * Kernels of the cudaipc all-reduce (docs/gpu.md "One-shot all-reduce over
 * CUDA IPC", Kernels):
 *   V1    the first kernel: 64 blocks of 512 threads whatever n, every
 *         thread fences at system scope before the flags;
 *   PUSH  the same protocol (data stores, then one release flag per block
 *         and peer), one block per push_block bytes (1..64), no fence but
 *         the flag's own release;
 *   LL    low latency: each 8-byte word carries 4 bytes of data and a
 *         4-byte call flag, stored into the peers' LL slots; the reader polls
 *         the data itself (one NVLink crossing, no fence, no flag round
 *         trip); one block per ll_block bytes (1..64), at most 1 MiB (or
 *         max_bytes) per launch;
 *   AUTO  LL for n * 4 <= ll_max bytes, else PUSH (the default).
 * Every kernel sums in rank order (bit-identical results), can be
 * recorded in graphs and aborted in the same way.
 */
enum dsv4_comm_ar_algo {
    DSV4_COMM_AR_AUTO = 0,
    DSV4_COMM_AR_V1,
    DSV4_COMM_AR_PUSH,
    DSV4_COMM_AR_LL,
};

/* Kernel choice and geometry of a cudaipc communicator. */
struct dsv4_comm_ar_tune {
    enum dsv4_comm_ar_algo algo;
    size_t ll_max;        /* AUTO: LL up to this many bytes (default 256 KiB) */
    size_t ll_block;      /* LL bytes of x per block (default 8 KiB) */
    size_t push_block;    /* PUSH bytes of x per block (default 32 KiB) */
};

#define DSV4_COMM_AR_MAX_BLOCKS 64

/*
 * Parse a kernel setting (the DSV4_CUDA_AR environment variable that
 * dsv4_comm_cudaipc_create reads; NULL or "" = defaults): "auto", "v1",
 * "push" or "ll", optionally followed by ":LL_MAX_KB[,LL_KB[,PUSH_KB]]"
 * (KiB, 1 .. 1048576; an empty field keeps its default).
 * DSV4_ERR_CONFIG on anything else (*t then holds the defaults).  Pure.
 */
enum dsv4_err dsv4_comm_ar_tune_parse(struct dsv4_comm_ar_tune *t, const char *spec);

/* The kernel that setting t runs for an all-reduce of n floats (never
 * AUTO).  Pure. */
enum dsv4_comm_ar_algo dsv4_comm_ar_pick(const struct dsv4_comm_ar_tune *t, int64_t n);

/* Blocks of a launch over `bytes` of x at `per_block` bytes per block:
 * ceil(bytes / per_block), at least 1, at most DSV4_COMM_AR_MAX_BLOCKS.
 * Pure. */
int dsv4_comm_ar_blocks(size_t bytes, size_t per_block);

/*
 * Set the kernels of cudaipc handle c (spec as dsv4_comm_ar_tune_parse).
 * Every rank of the group must set the same before its next all-reduce
 * (different kernels on two ranks time out); already recorded graphs keep
 * the kernels they recorded.  DSV4_ERR_INVAL when c is not a cudaipc
 * handle, DSV4_ERR_CONFIG for a bad spec (c unchanged).
 */
enum dsv4_err dsv4_comm_cudaipc_set_tune(struct dsv4_comm *c, const char *spec);

#ifdef __cplusplus
}
#endif
#endif
