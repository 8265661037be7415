/*
 * comm_id.c — host-side helpers of kernels/comm.h shared by every build:
 * the cudaipc group id (made and recognised here, so that a rank built
 * without CUDA, and the CPU tests, handle it too), dsv4_comm_check, and the
 * cudaipc constructor of builds without CUDA (DSV4_ERR_NOTSUP), and the
 * cudaipc kernel setting (DSV4_CUDA_AR: parse, pick, launch geometry).
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
                         int timeout_ms, const struct dsv4_comm_stop *stop)
{
    (void)be;
    (void)stop;
    (void)rank;
    (void)size;
    (void)id;
    (void)max_bytes;
    (void)timeout_ms;
    *out = NULL;
    return dsv4_err_set(DSV4_ERR_NOTSUP, "comm cudaipc: this build has no CUDA");
}

enum dsv4_err
dsv4_comm_cudaipc_set_tune(struct dsv4_comm *c, const char *spec)
{
    (void)c;
    (void)spec;
    return dsv4_err_set(DSV4_ERR_INVAL, "comm cudaipc: this build has no CUDA");
}
#endif

/* One KiB field of a tune spec: digits up to ',' or the end (empty: keep
 * *v).  Returns the rest after the field's ',' (or the end), NULL if bad. */
static const char *
ar_tune_field(const char *p, size_t *v)
{
    unsigned long long k = 0;
    const char *q = p;

    while (*q >= '0' && *q <= '9') {
        k = k * 10 + (unsigned long long)(*q - '0');
        if (k > 1048576)
            return NULL;
        q++;
    }
    if (*q != ',' && *q != '\0')
        return NULL;
    if (q != p) {
        if (k == 0)
            return NULL;
        *v = (size_t)k << 10;
    }
    return *q == ',' ? q + 1 : q;
}

enum dsv4_err
dsv4_comm_ar_tune_parse(struct dsv4_comm_ar_tune *t, const char *spec)
{
    static const struct {
        const char *name;
        enum dsv4_comm_ar_algo algo;
    } names[] = {
        { "auto", DSV4_COMM_AR_AUTO },
        { "v1", DSV4_COMM_AR_V1 },
        { "push", DSV4_COMM_AR_PUSH },
        { "ll", DSV4_COMM_AR_LL },
    };
    struct dsv4_comm_ar_tune r = { DSV4_COMM_AR_AUTO, 256u << 10, 8u << 10, 32u << 10 };
    const char *p;
    size_t len;
    int found = 0;

    *t = r;
    if (spec == NULL || *spec == '\0')
        return DSV4_OK;
    p = strchr(spec, ':');
    len = p != NULL ? (size_t)(p - spec) : strlen(spec);
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strlen(names[i].name) == len && strncmp(spec, names[i].name, len) == 0) {
            r.algo = names[i].algo;
            found = 1;
        }
    if (found && p != NULL) {
        size_t *fields[3] = { &r.ll_max, &r.ll_block, &r.push_block };

        int commas = 0;

        for (const char *q = ++p; *q != '\0'; q++)
            commas += *q == ',';
        for (int f = 0; f < 3 && p != NULL && *p != '\0'; f++)
            p = ar_tune_field(p, fields[f]);
        if (commas > 2 || p == NULL || *p != '\0')
            found = 0;
    }
    if (!found)
        return dsv4_err_set(DSV4_ERR_CONFIG, "DSV4_CUDA_AR = '%s': expected auto, v1, push or "
                            "ll, then optionally :LL_MAX_KB[,LL_KB[,PUSH_KB]] (KiB, 1 .. "
                            "1048576)", spec);
    *t = r;
    return DSV4_OK;
}

enum dsv4_comm_ar_algo
dsv4_comm_ar_pick(const struct dsv4_comm_ar_tune *t, int64_t n)
{
    if (t->algo != DSV4_COMM_AR_AUTO)
        return t->algo;
    return n >= 0 && (uint64_t)n * sizeof(float) <= t->ll_max ? DSV4_COMM_AR_LL
                                                              : DSV4_COMM_AR_PUSH;
}

int
dsv4_comm_ar_blocks(size_t bytes, size_t per_block)
{
    size_t g;

    if (per_block == 0)
        return DSV4_COMM_AR_MAX_BLOCKS;
    g = bytes / per_block + (bytes % per_block != 0);
    if (g < 1)
        g = 1;
    return g > DSV4_COMM_AR_MAX_BLOCKS ? DSV4_COMM_AR_MAX_BLOCKS : (int)g;
}
