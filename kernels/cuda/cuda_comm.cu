/*
 * cuda_comm.cu — the NCCL group of kernels/comm.h.
 *
 * NCCL is opened at run time (dlopen "libnccl.so.2"), not linked: the
 * binaries start on machines without NCCL and a one-rank model never needs
 * it; a group then fails with a clear error.  The sum is queued on the
 * rank's CUDA backend stream, so it can sit inside a recorded decode graph.
 * Communicators are non-blocking (ncclConfig_t.blocking = 0): creation is
 * polled against a deadline (a rank that never joins fails the others'
 * set-up instead of hanging them), and ncclCommAbort can end collectives
 * waiting for a rank that died.
 */
#include "kernels/comm.h"
#include "kernels/cuda/cuda.cuh"

#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The NCCL entry points used, resolved once. */
struct nccl_api {
    void *lib;
    ncclResult_t (*get_unique_id)(ncclUniqueId *);
    ncclResult_t (*init_rank_config)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
    ncclResult_t (*async_error)(ncclComm_t, ncclResult_t *);
    ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                               ncclComm_t, cudaStream_t);
    ncclResult_t (*destroy)(ncclComm_t);
    ncclResult_t (*abort)(ncclComm_t);
    const char *(*error_string)(ncclResult_t);
};

static struct nccl_api nccl;
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;
static char nccl_why[256];

static void
nccl_open(void)
{
    void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);

    if (lib == NULL) {
        snprintf(nccl_why, sizeof(nccl_why), "cannot open libnccl.so.2: %s", dlerror());
        return;
    }
    nccl.get_unique_id = (ncclResult_t(*)(ncclUniqueId *))dlsym(lib, "ncclGetUniqueId");
    nccl.init_rank_config = (ncclResult_t(*)(ncclComm_t *, int, ncclUniqueId, int,
                                             ncclConfig_t *))dlsym(lib,
                                                                   "ncclCommInitRankConfig");
    nccl.async_error = (ncclResult_t(*)(ncclComm_t, ncclResult_t *))dlsym(
        lib, "ncclCommGetAsyncError");
    nccl.all_reduce = (ncclResult_t(*)(const void *, void *, size_t, ncclDataType_t,
                                       ncclRedOp_t, ncclComm_t, cudaStream_t))dlsym(
        lib, "ncclAllReduce");
    nccl.destroy = (ncclResult_t(*)(ncclComm_t))dlsym(lib, "ncclCommDestroy");
    nccl.error_string = (const char *(*)(ncclResult_t))dlsym(lib, "ncclGetErrorString");
    nccl.abort = (ncclResult_t(*)(ncclComm_t))dlsym(lib, "ncclCommAbort");
    if (nccl.get_unique_id == NULL || nccl.init_rank_config == NULL ||
        nccl.async_error == NULL || nccl.all_reduce == NULL ||
        nccl.destroy == NULL || nccl.error_string == NULL || nccl.abort == NULL) {
        snprintf(nccl_why, sizeof(nccl_why), "libnccl.so.2 lacks an entry point");
        dlclose(lib);
        memset(&nccl, 0, sizeof(nccl));
        return;
    }
    nccl.lib = lib;
}

static enum dsv4_err
nccl_ready(void)
{
    pthread_once(&nccl_once, nccl_open);
    if (nccl.lib == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "comm nccl: %s", nccl_why);
    return DSV4_OK;
}

static enum dsv4_err
nccl_err(ncclResult_t rc, const char *what)
{
    return dsv4_err_set(DSV4_ERR_CUDA, "comm nccl: %s: %s", what, nccl.error_string(rc));
}

static int64_t
nccl_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* An NCCL group's handle: c->priv is the ncclComm_t (NULL once aborted);
 * in_call counts the NCCL calls under way on the rank's thread, which
 * nccl_abort (the watchdog's thread) waits out before it frees the
 * communicator (it freed it under a call reading it). */
struct nccl_comm {
    struct dsv4_comm c;   /* first: the handle given out, freed as one */
    int in_call;
};

/* Begin an NCCL call on c's communicator: its handle, or NULL once aborted
 * (then no call is under way); nccl_call_end after a call on a handle.
 * Sequentially consistent with nccl_abort's exchange and wait: either the
 * handle read here is NULL or the abort sees the call. */
static ncclComm_t
nccl_call_begin(struct dsv4_comm *c)
{
    int *in_call = &((struct nccl_comm *)c)->in_call;
    ncclComm_t comm;

    __atomic_add_fetch(in_call, 1, __ATOMIC_SEQ_CST);
    comm = (ncclComm_t)__atomic_load_n(&c->priv, __ATOMIC_SEQ_CST);
    if (comm == NULL)
        __atomic_sub_fetch(in_call, 1, __ATOMIC_SEQ_CST);
    return comm;
}

/* The NCCL call begun by nccl_call_begin is over. */
static void
nccl_call_end(struct dsv4_comm *c)
{
    __atomic_sub_fetch(&((struct nccl_comm *)c)->in_call, 1, __ATOMIC_SEQ_CST);
}

/* A non-blocking call returned rc: wait until the communicator is no
 * longer in progress (the operation is queued on the stream).  The first
 * collective of a communicator connects its peers and stays in progress
 * while a peer does not answer: the rank's watchdog then aborts it
 * (nccl_abort, from another thread), so each turn takes the handle again
 * (nccl_call_begin) and stops once it is gone (*aborted); the turns yield
 * the core. */
static ncclResult_t
nccl_settle(struct dsv4_comm *c, ncclResult_t rc, bool *aborted)
{
    *aborted = false;
    while (rc == ncclInProgress) {
        ncclComm_t comm = nccl_call_begin(c);
        ncclResult_t got;

        if (comm == NULL) {
            *aborted = true;
            return ncclInternalError;
        }
        got = nccl.async_error(comm, &rc);
        nccl_call_end(c);
        if (got != ncclSuccess)
            return ncclInternalError;
        if (rc == ncclInProgress)
            sched_yield();
    }
    return rc;
}

static enum dsv4_err
nccl_reduce(struct dsv4_comm *c, struct dsv4_backend *be, void *x, int64_t n,
            ncclDataType_t type, ncclRedOp_t op)
{
    ncclComm_t comm;
    ncclResult_t rc;
    bool aborted;

    if (n <= 0)
        return DSV4_OK;
    if ((comm = nccl_call_begin(c)) == NULL)
        return dsv4_err_set(DSV4_ERR_CUDA, "comm nccl: the communicator was aborted");
    rc = nccl.all_reduce(x, x, (size_t)n, type, op, comm, cuda_stream(be));
    nccl_call_end(c);
    rc = nccl_settle(c, rc, &aborted);
    if (aborted)
        return dsv4_err_set(DSV4_ERR_CUDA, "comm nccl: the communicator was aborted");
    return rc == ncclSuccess ? DSV4_OK : nccl_err(rc, "all-reduce");
}

static enum dsv4_err
nccl_allreduce(struct dsv4_comm *c, struct dsv4_backend *be, float *x, int64_t n)
{
    return nccl_reduce(c, be, x, n, ncclFloat32, ncclSum);
}

static enum dsv4_err
nccl_min_u64(struct dsv4_comm *c, struct dsv4_backend *be, uint64_t *x, int64_t n)
{
    return nccl_reduce(c, be, x, n, ncclUint64, ncclMin);
}

/* ncclCommAbort: kernels waiting for a rank that is gone return; the
 * communicator is unusable afterwards (destroy frees the handle only).
 * Called from the watchdog's thread: the handle is taken away first, then
 * the NCCL calls under way on it (non-blocking, each short) are waited
 * out before it is freed. */
static void
nccl_abort(struct dsv4_comm *c)
{
    void *comm = __atomic_exchange_n(&c->priv, (void *)NULL, __ATOMIC_SEQ_CST);

    if (comm == NULL)
        return;
    while (__atomic_load_n(&((struct nccl_comm *)c)->in_call, __ATOMIC_SEQ_CST) != 0)
        sched_yield();
    nccl.abort((ncclComm_t)comm);
}

static void
nccl_destroy(struct dsv4_comm *c)
{
    if (c->priv != NULL)
        nccl.destroy((ncclComm_t)c->priv);
    free(c);
}

static const struct dsv4_comm_ops nccl_ops = {
    nccl_allreduce,
    nccl_min_u64,
    nccl_abort,
    nccl_destroy,
    NULL,   /* check: a failed NCCL call reports itself */
};

extern "C" enum dsv4_err
dsv4_comm_nccl_unique_id(uint8_t id[DSV4_COMM_ID_BYTES])
{
    ncclUniqueId u;
    ncclResult_t rc;
    enum dsv4_err e = nccl_ready();

    static_assert(sizeof(u) <= DSV4_COMM_ID_BYTES, "ncclUniqueId larger than expected");
    if (e != DSV4_OK)
        return e;
    rc = nccl.get_unique_id(&u);
    if (rc != ncclSuccess)
        return nccl_err(rc, "unique id");
    memset(id, 0, DSV4_COMM_ID_BYTES);
    memcpy(id, &u, sizeof(u));
    return DSV4_OK;
}

extern "C" enum dsv4_err
dsv4_comm_nccl_create(struct dsv4_comm **out, struct dsv4_backend *be, int rank, int size,
                      const uint8_t id[DSV4_COMM_ID_BYTES], int timeout_ms,
                      const struct dsv4_comm_stop *stop)
{
    struct dsv4_comm *c;
    ncclUniqueId u;
    ncclComm_t comm = NULL;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    ncclResult_t rc, st;
    int64_t deadline = nccl_now_ms() + timeout_ms;
    enum dsv4_err e = nccl_ready();

    *out = NULL;
    if (e != DSV4_OK)
        return e;
    if (!cuda_is_backend(be))
        return dsv4_err_set(DSV4_ERR_INVAL, "comm nccl: not a CUDA backend");
    if (rank < 0 || rank >= size)
        return dsv4_err_set(DSV4_ERR_INVAL, "comm nccl: rank %d of %d", rank, size);
    CUDA_TRY(cudaSetDevice(cuda_st(be)->device));
    memcpy(&u, id, sizeof(u));
    config.blocking = 0;
    rc = nccl.init_rank_config(&comm, size, u, rank, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
        if (comm != NULL)   /* a non-blocking init may have made it */
            nccl.abort(comm);
        return nccl_err(rc, "init rank");
    }
    for (;;) {
        if (nccl.async_error(comm, &st) != ncclSuccess)
            st = ncclInternalError;
        if (st != ncclInProgress)
            break;
        if (nccl_now_ms() > deadline) {
            nccl.abort(comm);
            return dsv4_err_set(DSV4_ERR_TIMEOUT, "comm nccl: rank %d of %d: the group did "
                                "not assemble within %d ms", rank, size, timeout_ms);
        }
        if (stop != NULL && stop->fn(stop->arg)) {
            nccl.abort(comm);
            return dsv4_err_set(DSV4_ERR_CANCELED, "comm nccl: rank %d of %d: the join was "
                                "stopped", rank, size);
        }
        usleep(1000);
    }
    if (st != ncclSuccess) {
        nccl.abort(comm);
        return nccl_err(st, "init rank");
    }
    c = (struct dsv4_comm *)calloc(1, sizeof(struct nccl_comm));
    if (c == NULL) {
        nccl.destroy(comm);
        return dsv4_err_set(DSV4_ERR_NOMEM, "comm nccl: no memory");
    }
    c->ops = &nccl_ops;
    c->rank = rank;
    c->size = size;
    c->priv = comm;
    *out = c;
    return DSV4_OK;
}
