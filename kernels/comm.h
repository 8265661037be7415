/*
 * comm.h — collective communication between the ranks of one model group
 * (tensor-parallel attention, expert-parallel experts; kernels/forward.h).
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

/* Bytes of a group id (an NCCL unique id, or a shm group's name), made by
 * rank 0 and given to every rank. */
#define DSV4_COMM_ID_BYTES 128

/* A fresh id for a shm group (random name). */
enum dsv4_err dsv4_comm_shm_unique_id(uint8_t id[DSV4_COMM_ID_BYTES]);

/*
 * Join shm group `id` as rank `rank` of `size`; buffers of up to
 * `max_bytes` can be reduced.  Rank 0 creates the segment, the others open
 * it (waiting for it up to timeout_ms); every collective waits at most
 * timeout_ms for the others (then DSV4_ERR_TIMEOUT, and the group is
 * broken: make a new one).  The segment is unlinked when rank 0's handle is
 * destroyed.
 */
enum dsv4_err dsv4_comm_shm_create(struct dsv4_comm **out, int rank, int size,
                                   const uint8_t id[DSV4_COMM_ID_BYTES], size_t max_bytes,
                                   int timeout_ms);

/* NCCL group (CUDA builds, DSV4_HAVE_CUDA). */
enum dsv4_err dsv4_comm_nccl_unique_id(uint8_t id[DSV4_COMM_ID_BYTES]);

/*
 * Join NCCL group `id` as rank `rank` of `size`, on the device of CUDA
 * backend `be`.  Waits until every rank has joined, at most timeout_ms
 * (then DSV4_ERR_TIMEOUT).  DSV4_ERR_NOTSUP without libnccl.so.2.
 */
enum dsv4_err dsv4_comm_nccl_create(struct dsv4_comm **out, struct dsv4_backend *be, int rank,
                                    int size, const uint8_t id[DSV4_COMM_ID_BYTES],
                                    int timeout_ms);

#ifdef __cplusplus
}
#endif
#endif
