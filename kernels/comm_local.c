/*
 * comm_local.c — the local group of kernels/comm.h: ranks are threads of one
 * process, buffers are host-readable.  An all-reduce is three barrier
 * phases: every rank publishes its buffer; every rank sums all buffers, in
 * rank order, into its private scratch; every rank copies its scratch back
 * (after the last barrier nobody reads a buffer any more).  The threads of
 * one process cannot vanish alone, so abort is a no-op here.
 */
#include "kernels/comm.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct local_group {
    pthread_mutex_t mu;
    pthread_barrier_t bar;
    int size;
    int refs;                 /* handles alive */
    void **buf;               /* (size) published buffers */
    int64_t *n;               /* (size) their lengths */
};

struct local_rank {
    struct local_group *g;
    void *scratch;
    size_t cap;
};

/* Both reductions: sum of floats (min == 0) or minimum of uint64. */
static enum dsv4_err
local_reduce(struct dsv4_comm *c, void *x, int64_t n, int min)
{
    struct local_rank *lr = c->priv;
    struct local_group *g = lr->g;
    size_t bytes = (size_t)n * (min ? sizeof(uint64_t) : sizeof(float));
    int bad = 0;

    if (bytes > lr->cap) {
        void *s = realloc(lr->scratch, bytes);

        if (s == NULL)
            bad = 1;   /* still take part in the barriers, or the others hang */
        else
            lr->scratch = s, lr->cap = bytes;
    }
    g->buf[c->rank] = x;
    g->n[c->rank] = n;
    pthread_barrier_wait(&g->bar);
    for (int r = 0; r < g->size; r++)
        bad |= g->n[r] != n;
    if (!bad && min) {
        uint64_t *o = lr->scratch;

        for (int64_t i = 0; i < n; i++) {
            uint64_t v = ((const uint64_t *)g->buf[0])[i];

            for (int r = 1; r < g->size; r++)
                if (((const uint64_t *)g->buf[r])[i] < v)
                    v = ((const uint64_t *)g->buf[r])[i];
            o[i] = v;
        }
    } else if (!bad) {
        float *o = lr->scratch;

        for (int64_t i = 0; i < n; i++) {
            float s = 0.0f;

            for (int r = 0; r < g->size; r++)
                s += ((const float *)g->buf[r])[i];
            o[i] = s;
        }
    }
    pthread_barrier_wait(&g->bar);
    if (!bad)
        memcpy(x, lr->scratch, bytes);
    pthread_barrier_wait(&g->bar);
    if (bad)
        return dsv4_err_set(DSV4_ERR_INVAL, "comm local: rank %d: all-reduce of %lld values "
                            "does not match the other ranks (or no memory)", c->rank,
                            (long long)n);
    return DSV4_OK;
}

static enum dsv4_err
local_allreduce(struct dsv4_comm *c, struct dsv4_backend *be, float *x, int64_t n)
{
    (void)be;
    return local_reduce(c, x, n, 0);
}

static enum dsv4_err
local_min_u64(struct dsv4_comm *c, struct dsv4_backend *be, uint64_t *x, int64_t n)
{
    (void)be;
    return local_reduce(c, x, n, 1);
}

static void
local_abort(struct dsv4_comm *c)
{
    (void)c;
}

static void
local_destroy(struct dsv4_comm *c)
{
    struct local_rank *lr = c->priv;
    struct local_group *g = lr->g;
    int last;

    pthread_mutex_lock(&g->mu);
    last = --g->refs == 0;
    pthread_mutex_unlock(&g->mu);
    if (last) {
        pthread_barrier_destroy(&g->bar);
        pthread_mutex_destroy(&g->mu);
        free(g->buf);
        free(g->n);
        free(g);
    }
    free(lr->scratch);
    free(lr);
    free(c);
}

static const struct dsv4_comm_ops local_ops = {
    .allreduce_sum = local_allreduce,
    .allreduce_min_u64 = local_min_u64,
    .abort = local_abort,
    .destroy = local_destroy,
};

enum dsv4_err
dsv4_comm_local_create(struct dsv4_comm **out, int size)
{
    struct local_group *g;

    if (size < 1)
        return dsv4_err_set(DSV4_ERR_INVAL, "comm local: size %d", size);
    for (int r = 0; r < size; r++)
        out[r] = NULL;
    g = calloc(1, sizeof(*g));
    if (g == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "comm local: no memory");
    g->buf = calloc((size_t)size, sizeof(*g->buf));
    g->n = calloc((size_t)size, sizeof(*g->n));
    if (g->buf == NULL || g->n == NULL || pthread_barrier_init(&g->bar, NULL, size) != 0) {
        free(g->buf);
        free(g->n);
        free(g);
        return dsv4_err_set(DSV4_ERR_NOMEM, "comm local: no memory");
    }
    pthread_mutex_init(&g->mu, NULL);
    g->size = size;
    for (int r = 0; r < size; r++) {
        struct dsv4_comm *c = calloc(1, sizeof(*c));
        struct local_rank *lr = calloc(1, sizeof(*lr));

        if (c == NULL || lr == NULL) {
            free(c);
            free(lr);
            for (int q = 0; q < r; q++)
                dsv4_comm_destroy(out[q]), out[q] = NULL;
            if (r == 0) {
                pthread_barrier_destroy(&g->bar);
                pthread_mutex_destroy(&g->mu);
                free(g->buf);
                free(g->n);
                free(g);
            }
            return dsv4_err_set(DSV4_ERR_NOMEM, "comm local: no memory");
        }
        lr->g = g;
        c->ops = &local_ops;
        c->rank = r;
        c->size = size;
        c->priv = lr;
        g->refs++;
        out[r] = c;
    }
    return DSV4_OK;
}

void
dsv4_comm_destroy(struct dsv4_comm *c)
{
    if (c != NULL)
        c->ops->destroy(c);
}
