/*
 * cpu_backend.c — the CPU reference backend: its ops table, host memory,
 * the persistent worker pool, and the small layout ops (fill, scatter/gather,
 * scale, add_streams, embed).
 *
 * DESIGN: the pool has n_threads-1 workers plus the calling thread.  A
 * parallel-for publishes one job (function, context, item count, grain) under
 * a mutex, bumps a generation counter and wakes the workers; everybody takes
 * chunks from an atomic counter until none is left, and the caller waits
 * until every worker has checked out.  Only one job runs at a time (ops are
 * called from one thread and never nest parallel-fors).
 */
#include "kernels/cpu/cpu.h"

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/formats.h"

/* --- worker pool ------------------------------------------------------------ */

struct cpu_pool {
    pthread_mutex_t mu;
    pthread_cond_t wake;       /* workers: a new job or stop */
    pthread_cond_t done;       /* caller: the last worker checked out */
    pthread_t *threads;        /* (n_workers) */
    int n_workers;             /* n_threads - 1 */
    int n_started;             /* threads actually created */
    uint64_t gen;              /* job generation, bumped per job */
    int busy;                  /* workers not yet done with the current job */
    int stop;                  /* set once, at destroy */
    cpu_task_fn fn;            /* current job */
    void *ctx;
    int64_t n, grain;
    atomic_llong next;         /* next unclaimed item */
};

struct cpu_worker_arg {
    struct cpu_pool *pool;
    int tid;
};

/* Claim and run chunks of the current job until none is left. */
static void
pool_run_chunks(struct cpu_pool *p, cpu_task_fn fn, void *ctx, int64_t n, int64_t grain,
                int tid)
{
    for (;;) {
        int64_t i = atomic_fetch_add(&p->next, grain);
        if (i >= n)
            break;
        fn(ctx, i, i + grain < n ? i + grain : n, tid);
    }
}

static void *
pool_worker(void *arg)
{
    struct cpu_worker_arg wa = *(struct cpu_worker_arg *)arg;
    struct cpu_pool *p = wa.pool;
    uint64_t seen = 0;

    free(arg);
    for (;;) {
        cpu_task_fn fn;
        void *ctx;
        int64_t n, grain;

        pthread_mutex_lock(&p->mu);
        while (!p->stop && p->gen == seen)
            pthread_cond_wait(&p->wake, &p->mu);
        if (p->stop) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        seen = p->gen;
        fn = p->fn;
        ctx = p->ctx;
        n = p->n;
        grain = p->grain;
        pthread_mutex_unlock(&p->mu);

        pool_run_chunks(p, fn, ctx, n, grain, wa.tid);

        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0)
            pthread_cond_signal(&p->done);
        pthread_mutex_unlock(&p->mu);
    }
}

static void
pool_destroy(struct cpu_pool *p)
{
    if (p == NULL)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_started; i++)
        pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p);
}

static enum dsv4_err
pool_create(struct cpu_pool **out, int n_threads)
{
    struct cpu_pool *p = calloc(1, sizeof(*p));

    *out = NULL;
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu backend: no memory for the thread pool");
    p->n_workers = n_threads - 1;
    p->threads = calloc((size_t)p->n_workers, sizeof(*p->threads));
    if (p->threads == NULL) {
        free(p);
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu backend: no memory for the thread pool");
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->next, 0);
    for (int i = 0; i < p->n_workers; i++) {
        struct cpu_worker_arg *wa = malloc(sizeof(*wa));
        int rc;

        if (wa == NULL) {
            pool_destroy(p);
            return dsv4_err_set(DSV4_ERR_NOMEM, "cpu backend: no memory for the thread pool");
        }
        wa->pool = p;
        wa->tid = i + 1;
        rc = pthread_create(&p->threads[i], NULL, pool_worker, wa);
        if (rc != 0) {
            free(wa);
            pool_destroy(p);
            return dsv4_err_set(DSV4_ERR_SYS, "cpu backend: pthread_create: %s",
                                strerror(rc));
        }
        p->n_started++;
    }
    *out = p;
    return DSV4_OK;
}

void
cpu_parallel_for(struct dsv4_backend *be, int64_t n, int64_t grain, cpu_task_fn fn, void *ctx)
{
    struct cpu_state *st = be->priv;
    struct cpu_pool *p = st->pool;

    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    if (p == NULL || n <= grain) {
        fn(ctx, 0, n, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    p->grain = grain;
    atomic_store(&p->next, 0);
    p->busy = p->n_workers;
    p->gen++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);

    pool_run_chunks(p, fn, ctx, n, grain, 0);

    pthread_mutex_lock(&p->mu);
    while (p->busy > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

int
cpu_threads(const struct dsv4_backend *be)
{
    const struct cpu_state *st = be->priv;

    return st->n_threads;
}

/* --- lifecycle and memory ------------------------------------------------- */

#define CPU_ALIGN 64

static void
cpu_destroy(struct dsv4_backend *be)
{
    struct cpu_state *st = be->priv;

    pool_destroy(st->pool);
    free(st);
    free(be);
}

static void *
cpu_alloc(struct dsv4_backend *be, size_t bytes)
{
    size_t sz = (bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
    void *p;

    (void)be;
    if (sz == 0)
        sz = CPU_ALIGN;
    p = aligned_alloc(CPU_ALIGN, sz);
    if (p != NULL)
        memset(p, 0, sz);
    return p;
}

static void
cpu_free(struct dsv4_backend *be, void *p)
{
    (void)be;
    free(p);
}

static enum dsv4_err
cpu_memcpy(struct dsv4_backend *be, void *dst, const void *src, size_t n)
{
    (void)be;
    if (n > 0)
        memmove(dst, src, n);
    return DSV4_OK;
}

static enum dsv4_err
cpu_sync(struct dsv4_backend *be)
{
    (void)be;
    return DSV4_OK;
}

/* --- elementwise / layout ------------------------------------------------- */

static enum dsv4_err
cpu_fill(struct dsv4_backend *be, float *x, float v, int64_t n)
{
    (void)be;
    for (int64_t i = 0; i < n; i++)
        x[i] = v;
    return DSV4_OK;
}

static enum dsv4_err
cpu_scatter_rows(struct dsv4_backend *be, float *dst, const int32_t *rows, const float *src,
                 int n, int cols)
{
    (void)be;
    for (int i = 0; i < n; i++)
        memcpy(dst + (int64_t)rows[i] * cols, src + (int64_t)i * cols,
               (size_t)cols * sizeof(float));
    return DSV4_OK;
}

static enum dsv4_err
cpu_gather_rows(struct dsv4_backend *be, float *dst, const float *src, const int32_t *rows,
                int n, int cols)
{
    (void)be;
    for (int i = 0; i < n; i++)
        memcpy(dst + (int64_t)i * cols, src + (int64_t)rows[i] * cols,
               (size_t)cols * sizeof(float));
    return DSV4_OK;
}

static enum dsv4_err
cpu_scale(struct dsv4_backend *be, float *x, float s, int64_t n)
{
    (void)be;
    for (int64_t i = 0; i < n; i++)
        x[i] = dsv4_bf16_round(x[i] * s);
    return DSV4_OK;
}

static enum dsv4_err
cpu_add_streams(struct dsv4_backend *be, float *out, const float *e, const float *h, int T,
                int n_streams, int D)
{
    (void)be;
    for (int t = 0; t < T; t++) {
        const float *et = e + (int64_t)t * D;

        for (int j = 0; j < n_streams; j++) {
            int64_t o = ((int64_t)t * n_streams + j) * D;

            for (int i = 0; i < D; i++)
                out[o + i] = dsv4_bf16_round(et[i] + h[o + i]);
        }
    }
    return DSV4_OK;
}

static enum dsv4_err
cpu_embed(struct dsv4_backend *be, float *out, const int32_t *ids, const uint16_t *table,
          int T, int D, int n_copies)
{
    (void)be;
    for (int t = 0; t < T; t++) {
        const uint16_t *row = table + (int64_t)ids[t] * D;
        float *o = out + (int64_t)t * n_copies * D;

        for (int i = 0; i < D; i++)
            o[i] = dsv4_bf16_to_f32(row[i]);
        for (int j = 1; j < n_copies; j++)
            memcpy(o + (int64_t)j * D, o, (size_t)D * sizeof(float));
    }
    return DSV4_OK;
}

static enum dsv4_err
cpu_copy_batch(struct dsv4_backend *be, int n, void *const *dst, const void *const *src,
               const size_t *bytes)
{
    (void)be;
    if (n < 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "copy_batch: %d pieces", n);
    for (int i = 0; i < n; i++)
        if (bytes[i] > 0)
            memcpy(dst[i], src[i], bytes[i]);
    return DSV4_OK;
}

static enum dsv4_err
cpu_copy2d(struct dsv4_backend *be, float *dst, int64_t dst_ld, const float *src, int64_t src_ld,
           int rows, int cols)
{
    (void)be;
    for (int r = 0; r < rows; r++)
        memcpy(dst + r * dst_ld, src + r * src_ld, (size_t)cols * sizeof(float));
    return DSV4_OK;
}

/* --- constructor ------------------------------------------------------------ */

static const struct dsv4_backend_ops cpu_ops = {
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_memcpy,
    .download = cpu_memcpy,
    .copy = cpu_memcpy,
    .copy_batch = cpu_copy_batch,
    .sync = cpu_sync,
    .fill = cpu_fill,
    .scatter_rows = cpu_scatter_rows,
    .gather_rows = cpu_gather_rows,
    .scale = cpu_scale,
    .add_streams = cpu_add_streams,
    .embed = cpu_embed,
    .rms_norm = cpu_rms_norm,
    .linear = cpu_linear,
    .linear_grouped = cpu_linear_grouped,
    .rope = cpu_rope,
    .fp8_sim = cpu_fp8_sim,
    .hadamard_fp4 = cpu_hadamard_fp4,
    .hc_pre = cpu_hc_pre,
    .hc_post = cpu_hc_post,
    .hc_head = cpu_hc_head,
    .compress = cpu_compress,
    .indexer_topk = cpu_indexer_topk,
    .attention = cpu_attention,
    .router = cpu_router,
    .moe = cpu_moe,
    .moe_parts = cpu_moe_parts,
    .moe_combine = cpu_moe_combine,
    .copy2d = cpu_copy2d,
    .sample = cpu_sample,
    .sample_top = cpu_sample_top,
    .hc_post_pre = dsv4_hc_post_pre_compose,   /* the fused ops: their definitions */
    .norm_rope = dsv4_norm_rope_compose,
    .linear_multi = dsv4_linear_multi_compose,
    .norm_rope2 = dsv4_norm_rope2_compose,
    .attention_unrope = dsv4_attention_unrope_compose,
    .attention_out = dsv4_attention_out_compose,
    .linear_norm_rope = dsv4_linear_norm_rope_compose,
};

enum dsv4_err
dsv4_cpu_backend_create(struct dsv4_backend **out, enum dsv4_numerics numerics, int n_threads)
{
    struct dsv4_backend *be;
    struct cpu_state *st;
    enum dsv4_err e;

    *out = NULL;
    if (numerics != DSV4_NUMERICS_REF && numerics != DSV4_NUMERICS_HF)
        return dsv4_err_set(DSV4_ERR_INVAL, "cpu backend: unknown numerics mode %d",
                            (int)numerics);
    if (n_threads < 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "cpu backend: negative thread count %d",
                            n_threads);
    if (n_threads == 0) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);

        n_threads = nc > 0 ? (int)(nc < 1024 ? nc : 1024) : 1;
    }
    be = calloc(1, sizeof(*be));
    st = calloc(1, sizeof(*st));
    if (be == NULL || st == NULL) {
        free(be);
        free(st);
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu backend: no memory");
    }
    st->n_threads = n_threads;
    if (n_threads > 1) {
        e = pool_create(&st->pool, n_threads);
        if (e != DSV4_OK) {
            free(st);
            free(be);
            return e;
        }
    }
    be->ops = &cpu_ops;
    be->name = "cpu";
    be->numerics = numerics;
    be->n_threads = n_threads;
    be->priv = st;
    *out = be;
    return DSV4_OK;
}
