/*
 * cuda_comm.cu — the NCCL group of kernels/comm.h.
 *
 * NCCL is opened at run time (dlopen "libnccl.so.2"), not linked: the
 * binaries start on machines without NCCL and a one-rank model never needs
 * it; a group then fails with a clear error.  The sum is queued on the
 * rank's CUDA backend stream, so it can sit inside a recorded decode graph.
 */
#include "kernels/comm.h"
#include "kernels/cuda/cuda.cuh"

#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The NCCL entry points used, resolved once. */
struct nccl_api {
    void *lib;
    ncclResult_t (*get_unique_id)(ncclUniqueId *);
    ncclResult_t (*init_rank)(ncclComm_t *, int, ncclUniqueId, int);
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
    nccl.init_rank = (ncclResult_t(*)(ncclComm_t *, int, ncclUniqueId, int))dlsym(
        lib, "ncclCommInitRank");
    nccl.all_reduce = (ncclResult_t(*)(const void *, void *, size_t, ncclDataType_t,
                                       ncclRedOp_t, ncclComm_t, cudaStream_t))dlsym(
        lib, "ncclAllReduce");
    nccl.destroy = (ncclResult_t(*)(ncclComm_t))dlsym(lib, "ncclCommDestroy");
    nccl.error_string = (const char *(*)(ncclResult_t))dlsym(lib, "ncclGetErrorString");
    nccl.abort = (ncclResult_t(*)(ncclComm_t))dlsym(lib, "ncclCommAbort");
    if (nccl.get_unique_id == NULL || nccl.init_rank == NULL || nccl.all_reduce == NULL ||
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

static enum dsv4_err
nccl_allreduce(struct dsv4_comm *c, struct dsv4_backend *be, float *x, int64_t n)
{
    ncclResult_t rc;

    if (n <= 0)
        return DSV4_OK;
    rc = nccl.all_reduce(x, x, (size_t)n, ncclFloat32, ncclSum, (ncclComm_t)c->priv,
                         cuda_stream(be));
    return rc == ncclSuccess ? DSV4_OK : nccl_err(rc, "all-reduce");
}

static enum dsv4_err
nccl_min_u64(struct dsv4_comm *c, struct dsv4_backend *be, uint64_t *x, int64_t n)
{
    ncclResult_t rc;

    if (n <= 0)
        return DSV4_OK;
    rc = nccl.all_reduce(x, x, (size_t)n, ncclUint64, ncclMin, (ncclComm_t)c->priv,
                         cuda_stream(be));
    return rc == ncclSuccess ? DSV4_OK : nccl_err(rc, "all-reduce (min)");
}

/* ncclCommAbort: kernels waiting for a rank that is gone return; the
 * communicator is unusable afterwards (destroy frees the handle only). */
static void
nccl_abort(struct dsv4_comm *c)
{
    void *comm = __atomic_exchange_n(&c->priv, (void *)NULL, __ATOMIC_ACQ_REL);

    if (comm != NULL)
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
                      const uint8_t id[DSV4_COMM_ID_BYTES])
{
    struct dsv4_comm *c;
    ncclUniqueId u;
    ncclComm_t comm;
    ncclResult_t rc;
    enum dsv4_err e = nccl_ready();

    *out = NULL;
    if (e != DSV4_OK)
        return e;
    if (be == NULL || be->name == NULL || strcmp(be->name, "cuda") != 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "comm nccl: not a CUDA backend");
    if (rank < 0 || rank >= size)
        return dsv4_err_set(DSV4_ERR_INVAL, "comm nccl: rank %d of %d", rank, size);
    CUDA_TRY(cudaSetDevice(cuda_st(be)->device));
    memcpy(&u, id, sizeof(u));
    rc = nccl.init_rank(&comm, size, u, rank);
    if (rc != ncclSuccess)
        return nccl_err(rc, "init rank");
    c = (struct dsv4_comm *)calloc(1, sizeof(*c));
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
