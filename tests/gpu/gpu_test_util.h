/*
 * gpu_test_util.h — small helpers shared by the whole-forward GPU tests
 * (tests/gpu/test_forward_gpu.c, tests/gpu/test_decode_gpu.c, test_tp_gpu.c,
 * test_share_gpu.c): wall clock, greedy argmax, byte and logits digests,
 * logits row error, qsort comparator, the flash config cut to a few layers,
 * a seeded random sequence and the CUDA backend with its timer
 * (tests/gpu/bench_woa.c).
 */
#ifndef DSV4_TESTS_GPU_GPU_TEST_UTIL_H
#define DSV4_TESTS_GPU_GPU_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "common/err.h"
#include "common/model_config.h"
#include "kernels/backend.h"
#include "kernels/cuda_fast.h"

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

/* FNV-1a of n bytes (equal digests: the same bits). */
static inline uint64_t
digest_bytes(const void *p, size_t n)
{
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 1469598103934665603ull;

    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* digest_bytes of n floats (a logits row, or several). */
static inline uint64_t
logits_digest(const float *l, size_t n)
{
    return digest_bytes(l, n * sizeof(float));
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

/* The next value of the splitmix64 sequence whose state is *s. */
static inline uint64_t
test_rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A standard normal value from the sequence *s (Box-Muller). */
static inline float
test_rng_normal(uint64_t *s)
{
    double u = (double)(test_rng_next(s) >> 11) * 0x1p-53 + 1e-300;
    double v = (double)(test_rng_next(s) >> 11) * 0x1p-53;

    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* A CUDA backend (REF numerics, device 0) in *be and an event timer on its
 * stream in *tm; without a CUDA device (NOTSUP) prints a skip line and
 * exits 77; exits 1 when the backend fails otherwise or the timer cannot
 * be made. */
static inline void
test_cuda_open(struct dsv4_backend **be, struct dsv4_cuda_timer **tm)
{
    enum dsv4_err e = dsv4_backend_create(be, "cuda", DSV4_NUMERICS_REF, 0);

    if (e == DSV4_ERR_NOTSUP) {
        printf("skip: no CUDA backend (%s)\n", dsv4_errmsg());
        exit(77);
    }
    if (e != DSV4_OK) {
        fprintf(stderr, "cuda backend: %s\n", dsv4_errmsg());
        exit(1);
    }
    *tm = dsv4_cuda_timer_create(*be);
    if (*tm == NULL) {
        fprintf(stderr, "timer: %s\n", dsv4_errmsg());
        exit(1);
    }
}

/* bytes of device memory from be; exits 1 when there are none. */
static inline void *
test_dev_alloc(struct dsv4_backend *be, size_t bytes)
{
    void *p = be->ops->alloc(be, bytes);

    if (p == NULL) {
        fprintf(stderr, "device allocation of %zu bytes failed: %s\n", bytes, dsv4_errmsg());
        exit(1);
    }
    return p;
}

/* qsort comparator for doubles, ascending. */
static inline int
cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

#endif
