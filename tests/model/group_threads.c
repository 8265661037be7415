/*
 * group_threads.c — a model group of ranks as threads of one test process
 * (group_threads.h).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/weights_shard.h"
#include "group_threads.h"

/* One rank's thread: what it needs, and how its set-up went. */
struct group_rank {
    const struct dsv4_weights *full;
    const struct dsv4_model_opts *opts;
    enum dsv4_group_split split;
    struct dsv4_comm *comm;
    void (*fn)(struct dsv4_model *m, int rank, void *ctx);
    void *ctx;
    enum dsv4_err err;              /* set-up's, DSV4_OK when fn ran */
    char msg[256];                  /* set-up's message when err != DSV4_OK */
};

static void *
group_rank_main(void *arg)
{
    struct group_rank *r = arg;
    struct dsv4_backend *be = NULL;
    struct dsv4_weights sh;
    struct dsv4_model *m = NULL;
    struct dsv4_model_opts o = *r->opts;
    int rank = r->comm->rank;

    o.comm = r->comm;
    if ((r->err = dsv4_weights_shard(&sh, r->full, rank, r->comm->size, r->split)) != DSV4_OK) {
        snprintf(r->msg, sizeof(r->msg), "rank %d set-up: %s", rank, dsv4_errmsg());
        return NULL;    /* the other ranks then block: the test times out */
    }
    if ((r->err = dsv4_backend_create(&be, "cpu", DSV4_NUMERICS_REF, 1)) == DSV4_OK &&
        (r->err = dsv4_model_create(&m, be, &sh, &o)) == DSV4_OK)
        r->fn(m, rank, r->ctx);
    else
        snprintf(r->msg, sizeof(r->msg), "rank %d set-up: %s", rank, dsv4_errmsg());
    dsv4_model_free(m);
    dsv4_backend_destroy(be);
    dsv4_weights_shard_free(&sh);
    return NULL;
}

enum dsv4_err
group_threads_run(const struct dsv4_weights *full, int n, enum dsv4_group_split split,
                  const struct dsv4_model_opts *opts,
                  void (*fn)(struct dsv4_model *m, int rank, void *ctx), void *ctx)
{
    struct dsv4_comm **comm = calloc((size_t)n, sizeof(*comm));
    struct group_rank *rk = calloc((size_t)n, sizeof(*rk));
    pthread_t *th = calloc((size_t)n, sizeof(*th));
    enum dsv4_err e = DSV4_OK;
    int started = 0;

    if (comm == NULL || rk == NULL || th == NULL) {
        e = dsv4_err_set(DSV4_ERR_NOMEM, "group_threads: no memory for %d ranks", n);
        goto out;
    }
    if ((e = dsv4_comm_local_create(comm, n)) != DSV4_OK)
        goto out;
    for (int r = 0; r < n; r++) {
        rk[r].full = full;
        rk[r].opts = opts;
        rk[r].split = split;
        rk[r].comm = comm[r];
        rk[r].fn = fn;
        rk[r].ctx = ctx;
    }
    for (; started < n; started++)
        if (pthread_create(&th[started], NULL, group_rank_main, &rk[started]) != 0) {
            /* the started ranks wait for this one: as a failed set-up */
            e = dsv4_err_set(DSV4_ERR_INVAL, "group_threads: cannot start rank %d", started);
            break;
        }
    for (int r = 0; r < started; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < started && e == DSV4_OK; r++)
        if (rk[r].err != DSV4_OK)
            e = dsv4_err_set(rk[r].err, "%s", rk[r].msg);
    for (int r = 0; r < n; r++)
        dsv4_comm_destroy(comm[r]);
out:
    free(comm);
    free(rk);
    free(th);
    return e;
}
