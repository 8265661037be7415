/*
 * model_util.c — see model_util.h.
 */
#include "model_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef DSV4_HAVE_CUDA
#include "kernels/cuda_weights.h"
#endif

void
tmodel_open(struct tmodel *t, const char *dir, enum dsv4_numerics num, int n_slots, int max_seq,
            int max_rows)
{
    struct dsv4_model_opts o = { .n_slots = n_slots, .max_seq_len = max_seq,
                                 .max_rows = max_rows };

    if (dsv4_weights_load(&t->w, dir) != DSV4_OK) {
        fprintf(stderr, "load %s: %s\n", dir, dsv4_errmsg());
        exit(1);
    }
    const char *bk = getenv("DSV4_TEST_BACKEND");
    const struct dsv4_weights *mw = &t->w;

    memset(&t->dw, 0, sizeof(t->dw));
    if (bk == NULL || bk[0] == '\0')
        bk = "cpu";
    if (dsv4_backend_create(&t->be, bk, num, 0) != DSV4_OK) {
        fprintf(stderr, "backend %s: %s\n", bk, dsv4_errmsg());
        exit(1);
    }
#ifdef DSV4_HAVE_CUDA
    if (strcmp(bk, "cuda") == 0) {
        if (dsv4_cuda_weights_upload(t->be, &t->dw, &t->w) != DSV4_OK) {
            fprintf(stderr, "upload: %s\n", dsv4_errmsg());
            exit(1);
        }
        mw = &t->dw;
    }
#endif
    if (dsv4_model_create(&t->m, t->be, mw, &o) != DSV4_OK) {
        fprintf(stderr, "model: %s\n", dsv4_errmsg());
        exit(1);
    }
    t->V = dsv4_model_vocab(t->m);
}

void
tmodel_close(struct tmodel *t)
{
    dsv4_model_free(t->m);
#ifdef DSV4_HAVE_CUDA
    if (t->dw.priv != NULL)
        dsv4_cuda_weights_free(t->be, &t->dw);
#endif
    dsv4_backend_destroy(t->be);
    dsv4_weights_free(&t->w);
}

void
tmodel_tokens(int32_t *ids, int n, int V, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;

    for (int i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids[i] = (int32_t)(x % (uint64_t)V);
    }
}

double
tmodel_max_diff(const float *a, const float *b, int64_t n, double *max_abs_a)
{
    double md = 0, ma = 0;

    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        /* a NaN on either side is infinitely far: kept as such (a NaN in
         * md was replaced by the next finite difference) */
        if (isnan(d))
            d = INFINITY;
        if (d > md)
            md = d;
        if (fabs(a[i]) > ma || isnan(a[i]))
            ma = isnan(a[i]) ? INFINITY : fabs(a[i]);
    }
    if (max_abs_a != NULL)
        *max_abs_a = ma;
    return md;
}
