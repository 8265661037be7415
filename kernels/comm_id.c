/*
 * comm_id.c — host-side helpers of kernels/comm.h shared by every build:
 * the cudaipc group id (made and recognised here, so that a rank built
 * without CUDA, and the CPU tests, handle it too), dsv4_comm_check, and the
 * cudaipc constructor of builds without CUDA (DSV4_ERR_NOTSUP).
 *
 * A cudaipc id is the shm group name format of comm_shm.c with its own
 * prefix: "/dsv4ar-" followed by 32 lower-case hex digits, NUL-padded to
 * DSV4_COMM_ID_BYTES.  It names the group's bootstrap segment.
 */
#include "kernels/comm.h"

#include <stdio.h>
#include <string.h>

#define CUDAIPC_HEX 32          /* random hex digits after the prefix */

enum dsv4_err
dsv4_comm_cudaipc_unique_id(uint8_t id[DSV4_COMM_ID_BYTES])
{
    uint8_t shm[DSV4_COMM_ID_BYTES];
    const char *hex;
    enum dsv4_err e = dsv4_comm_shm_unique_id(shm);

    if (e != DSV4_OK)
        return e;
    /* the shm name ends in the 32 random hex digits */
    hex = (const char *)shm + strlen((const char *)shm) - CUDAIPC_HEX;
    memset(id, 0, DSV4_COMM_ID_BYTES);
    snprintf((char *)id, DSV4_COMM_ID_BYTES, "%s%s", DSV4_COMM_CUDAIPC_PREFIX, hex);
    return DSV4_OK;
}

int
dsv4_comm_id_is_cudaipc(const uint8_t id[DSV4_COMM_ID_BYTES])
{
    size_t pl = strlen(DSV4_COMM_CUDAIPC_PREFIX), end = pl + CUDAIPC_HEX;

    if (memcmp(id, DSV4_COMM_CUDAIPC_PREFIX, pl) != 0)
        return 0;
    for (size_t i = pl; i < end; i++)
        if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f')))
            return 0;
    for (size_t i = end; i < DSV4_COMM_ID_BYTES; i++)
        if (id[i] != 0)
            return 0;
    return 1;
}

enum dsv4_err
dsv4_comm_check(struct dsv4_comm *c)
{
    if (c == NULL || c->ops->check == NULL)
        return DSV4_OK;
    return c->ops->check(c);
}

enum dsv4_comm_kind
dsv4_comm_pick(const char *comm, const char *backend, int one_host, int size)
{
    int cpu = strcmp(backend, "cpu") == 0;
    int ipc_fits = size >= 2 && size <= DSV4_COMM_CUDAIPC_MAX_RANKS;

    if (strcmp(comm, "auto") == 0) {
        if (cpu)
            return DSV4_COMM_SHM;
        return one_host && ipc_fits ? DSV4_COMM_CUDAIPC : DSV4_COMM_NCCL;
    }
    if (strcmp(comm, "shm") == 0 && cpu)
        return DSV4_COMM_SHM;
    if (strcmp(comm, "nccl") == 0 && !cpu)
        return DSV4_COMM_NCCL;
    if (strcmp(comm, "cudaipc") == 0 && !cpu && ipc_fits)
        return DSV4_COMM_CUDAIPC;
    dsv4_err_set(DSV4_ERR_CONFIG, "comm = %s does not fit the %s backend with %d ranks (cpu: "
                 "auto or shm; cuda: auto, nccl, or cudaipc for 2..%d ranks of one host)",
                 comm, backend, size, DSV4_COMM_CUDAIPC_MAX_RANKS);
    return DSV4_COMM_NONE;
}

#ifndef DSV4_HAVE_CUDA
enum dsv4_err
dsv4_comm_cudaipc_create(struct dsv4_comm **out, struct dsv4_backend *be, int rank, int size,
                         const uint8_t id[DSV4_COMM_ID_BYTES], size_t max_bytes,
                         int timeout_ms)
{
    (void)be;
    (void)rank;
    (void)size;
    (void)id;
    (void)max_bytes;
    (void)timeout_ms;
    *out = NULL;
    return dsv4_err_set(DSV4_ERR_NOTSUP, "comm cudaipc: this build has no CUDA");
}
#endif
