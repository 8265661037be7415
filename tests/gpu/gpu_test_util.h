/*
 * gpu_test_util.h — small helpers shared by the whole-forward GPU tests
 * (tests/gpu/test_forward_gpu.c, tests/gpu/test_decode_gpu.c, test_tp_gpu.c,
 * test_share_gpu.c): wall clock, greedy argmax, logits row error, qsort
 * comparator, the flash config cut to a few layers.
 */
#ifndef DSV4_TESTS_GPU_GPU_TEST_UTIL_H
#define DSV4_TESTS_GPU_GPU_TEST_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "common/err.h"
#include "common/model_config.h"

/* Logits bounds of the GPU vs CPU forward comparisons (the tests' headers
 * say why): median row error, every row. */
#define MEDIAN_TOL 1e-3
#define MAX_TOL 0.1

/* Exit(1) with the message of a failed call. */
#define TRY(what, expr)                                                            \
    do {                                                                           \
        if ((expr) != DSV4_OK) {                                                   \
            fprintf(stderr, "%s: %s\n", what, dsv4_errmsg());                      \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

/* Monotonic wall clock in ms. */
static inline double
now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Greedy token: the largest logit, lowest id on ties. */
static inline int
argmax(const float *l, int V)
{
    int b = 0;

    for (int i = 1; i < V; i++)
        if (l[i] > l[b])
            b = i;
    return b;
}

/* ||g - c|| / ||c|| of one logits row; *max_abs = max |g - c|. */
static inline double
rel_err(const float *g, const float *c, int V, double *max_abs)
{
    double d = 0, n = 0, m = 0;

    for (int i = 0; i < V; i++) {
        double x = (double)g[i] - c[i];
        d += x * x;
        n += (double)c[i] * c[i];
        m = fmax(m, fabs(x));
    }
    *max_abs = m;
    return n > 0 ? sqrt(d / n) : sqrt(d);
}

/* The `flash` preset cut to `layers` layers (their compress ratios as in
 * flash) plus its MTP layer; the hash layers capped at `layers`. */
static inline void
flash_cut(struct dsv4_config *cfg, int layers)
{
    char set_layers[64], set_hash[64], set_ratios[512];
    int o = snprintf(set_ratios, sizeof(set_ratios), "compress_ratios=[");

    TRY("preset", dsv4_config_preset(cfg, "flash"));
    for (int l = 0; l <= layers; l++)   /* + the MTP layer */
        o += snprintf(set_ratios + o, sizeof(set_ratios) - (size_t)o, "%s%d", l ? "," : "",
                      l == layers ? 0 : cfg->compress_ratios[l]);
    snprintf(set_ratios + o, sizeof(set_ratios) - (size_t)o, "]");
    snprintf(set_layers, sizeof(set_layers), "num_hidden_layers=%d", layers);
    snprintf(set_hash, sizeof(set_hash), "num_hash_layers=%d",
             cfg->num_hash_layers < layers ? cfg->num_hash_layers : layers);
    const char *sets[] = { set_layers, set_ratios, set_hash };
    TRY("flash override", dsv4_config_override(cfg, 3, sets));
}

/* qsort comparator for doubles, ascending. */
static inline int
cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

#endif
