/*
 * bench_fcp.c — the prefill form of the fast compress
 * (kernels/cuda/fast_attn.cu, dsv4_cuda_set_fc_prefill) against the
 * one-warp-per-channel kernel fc_kernel at prefill sizes: bit for bit and
 * speed.
 *
 *   bench_fcp [SEED]
 *
 * Shapes: the main compressors (d = 512, r = 4 with overlap and r = 128)
 * and the indexer's (d = 128, r = 4), at T = 512 and 2,048 rows, random a,
 * z, ape and random prior state (the state rows a call reads from earlier
 * calls are random, so a wrong pre-call slot shows).  Plans:
 *   one     one sequence (slot 1 of 4) from position 0;
 *   mid     one sequence from a position inside a window (r=4: 150,
 *           r=128: 434), so the first entries use pre-call state;
 *   multi   three sequences (slots 2, 0, 3: T/2, T/4, T/4 rows) from
 *           positions 0, 150 / 434, 7;
 *   inter   two sequences with interleaved rows (the prefill form's check
 *           fails: it must fall back to the loop, same bits).
 * Per case: the entries (every row, non-emitting rows keep the fill
 * value) and both state pools after one call, fc_kernel vs the prefill
 * form: identical bits required; a failure names the first differing
 * value.  Then the median of 9 timed calls of each form (µs).
 * Last line: PASS or FAIL.  Exit status: 0 pass, 1 fail, 77 no CUDA device.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "kernels/backend.h"
#include "kernels/cuda_fast.h"
#include "tests/gpu/gpu_test_util.h"   /* TRY */

#define N_SLOTS 4
#define N_TIMED 9
#define FILL_VAL (-7.0f)

static struct dsv4_backend *gpu;
static uint64_t rng_state;

static uint64_t
rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* n uniforms in [-sd, sd). */
static float *
host_vals(size_t n, float sd)
{
    float *h = malloc(n * sizeof(float));

    if (h == NULL)
        exit(1);
    for (size_t i = 0; i < n; i++)
        h[i] = sd * (float)((double)(rng_next() >> 11) * 0x1p-52 - 1.0);
    return h;
}

static void *
dev_alloc(size_t bytes)
{
    void *p = gpu->ops->alloc(gpu, bytes);

    if (p == NULL) {
        fprintf(stderr, "alloc %zu: %s\n", bytes, dsv4_errmsg());
        exit(1);
    }
    return p;
}

/* One shape's buffers (device, and the host initial values). */
struct shape {
    int r, d, c, T;
    size_t pool_n, row_n;   /* floats: state pools, a / z */
    float *h_kv, *h_z, *h_a, *h_zin, *h_ape;
    float *kv, *z, *a, *zin, *ape, *ent;
    int32_t *slot, *pos, *emit;
    int32_t *h_slot, *h_pos, *h_emit;
};

static void
shape_make(struct shape *s, int r, int d, int T)
{
    s->r = r;
    s->d = d;
    s->c = r == 4 ? 2 : 1;
    s->T = T;
    s->pool_n = (size_t)N_SLOTS * s->c * r * s->c * d;
    s->row_n = (size_t)T * s->c * d;
    s->h_kv = host_vals(s->pool_n, 1.0f);
    s->h_z = host_vals(s->pool_n, 2.0f);
    s->h_a = host_vals(s->row_n, 1.0f);
    s->h_zin = host_vals(s->row_n, 2.0f);
    s->h_ape = host_vals((size_t)r * s->c * d, 0.5f);
    s->kv = dev_alloc(s->pool_n * 4);
    s->z = dev_alloc(s->pool_n * 4);
    s->a = dev_alloc(s->row_n * 4);
    s->zin = dev_alloc(s->row_n * 4);
    s->ape = dev_alloc((size_t)r * s->c * d * 4);
    s->ent = dev_alloc((size_t)T * d * 4);
    s->slot = dev_alloc((size_t)T * 4);
    s->pos = dev_alloc((size_t)T * 4);
    s->emit = dev_alloc((size_t)T * 4);
    s->h_slot = malloc((size_t)T * 4);
    s->h_pos = malloc((size_t)T * 4);
    s->h_emit = malloc((size_t)T * 4);
    if (s->h_slot == NULL || s->h_pos == NULL || s->h_emit == NULL)
        exit(1);
    TRY("upload", gpu->ops->upload(gpu, s->a, s->h_a, s->row_n * 4));
    TRY("upload", gpu->ops->upload(gpu, s->zin, s->h_zin, s->row_n * 4));
    TRY("upload", gpu->ops->upload(gpu, s->ape, s->h_ape, (size_t)r * s->c * d * 4));
}

static void
shape_free(struct shape *s)
{
    void *dv[] = { s->kv, s->z, s->a, s->zin, s->ape, s->ent, s->slot, s->pos, s->emit };

    for (size_t i = 0; i < sizeof(dv) / sizeof(dv[0]); i++)
        gpu->ops->free(gpu, dv[i]);
    free(s->h_kv);
    free(s->h_z);
    free(s->h_a);
    free(s->h_zin);
    free(s->h_ape);
    free(s->h_slot);
    free(s->h_pos);
    free(s->h_emit);
}

/* Plan rows [t0, t0 + n) as slot sl from position p0 (step: row stride). */
static void
plan_run(struct shape *s, int t0, int n, int step, int sl, int p0)
{
    for (int i = 0; i < n; i++) {
        int t = t0 + i * step, p = p0 + i;

        s->h_slot[t] = sl;
        s->h_pos[t] = p;
        s->h_emit[t] = (p + 1) % s->r == 0 ? t : -1;
    }
}

/* The plan by name (see the head of the file). */
static void
plan_make(struct shape *s, const char *plan)
{
    int T = s->T, mid = s->r == 4 ? 150 : 434;

    if (strcmp(plan, "one") == 0) {
        plan_run(s, 0, T, 1, 1, 0);
    } else if (strcmp(plan, "mid") == 0) {
        plan_run(s, 0, T, 1, 1, mid);
    } else if (strcmp(plan, "multi") == 0) {
        plan_run(s, 0, T / 2, 1, 2, 0);
        plan_run(s, T / 2, T / 4, 1, 0, mid);
        plan_run(s, T / 2 + T / 4, T - T / 2 - T / 4, 1, 3, 7);
    } else {   /* inter */
        plan_run(s, 0, T / 2, 2, 0, 0);
        plan_run(s, 1, T / 2, 2, 1, mid);
    }
    TRY("upload", gpu->ops->upload(gpu, s->slot, s->h_slot, (size_t)T * 4));
    TRY("upload", gpu->ops->upload(gpu, s->pos, s->h_pos, (size_t)T * 4));
    TRY("upload", gpu->ops->upload(gpu, s->emit, s->h_emit, (size_t)T * 4));
}

/* Reset the state and entries, then one compress call with the form. */
static enum dsv4_err
run_form(struct shape *s, int prefill)
{
    dsv4_cuda_set_fc_prefill(prefill);
    TRY("upload", gpu->ops->upload(gpu, s->kv, s->h_kv, s->pool_n * 4));
    TRY("upload", gpu->ops->upload(gpu, s->z, s->h_z, s->pool_n * 4));
    TRY("fill", gpu->ops->fill(gpu, s->ent, FILL_VAL, (int64_t)s->T * s->d));
    return gpu->ops->compress(gpu, s->ent, s->kv, s->z, s->a, s->zin, s->ape, s->slot, s->pos,
                              s->emit, s->T, s->r, s->d);
}

/* Download entries, kv, z into res[0..2]. */
static void
fetch(struct shape *s, float **res)
{
    size_t n[3] = { (size_t)s->T * s->d, s->pool_n, s->pool_n };
    float *src[3] = { s->ent, s->kv, s->z };

    for (int i = 0; i < 3; i++) {
        res[i] = malloc(n[i] * 4);
        if (res[i] == NULL)
            exit(1);
        TRY("download", gpu->ops->download(gpu, res[i], src[i], n[i] * 4));
    }
    TRY("sync", gpu->ops->sync(gpu));
}

/* Bit-compare n floats; on a difference append the first to line. */
static int
same_bits(char *line, size_t len, const char *what, const float *x, const float *ref, size_t n)
{
    size_t bad = 0, first = 0;

    for (size_t i = 0; i < n; i++)
        if (memcmp(&x[i], &ref[i], 4) != 0 && bad++ == 0)
            first = i;
    if (bad == 0)
        return 1;
    snprintf(line + strlen(line), len - strlen(line),
             "  %s: %zu of %zu differ, first [%zu] prefill %.9g fc %.9g", what, bad, n, first,
             (double)x[first], (double)ref[first]);
    return 0;
}

static int
cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;

    return (x > y) - (x < y);
}

/* Median µs of N_TIMED calls of the form (state reset outside the timing). */
static float
time_form(struct dsv4_cuda_timer *tm, struct shape *s, int prefill)
{
    float ms[N_TIMED];

    for (int i = 0; i < N_TIMED; i++) {
        dsv4_cuda_set_fc_prefill(prefill);
        TRY("upload", gpu->ops->upload(gpu, s->kv, s->h_kv, s->pool_n * 4));
        TRY("upload", gpu->ops->upload(gpu, s->z, s->h_z, s->pool_n * 4));
        TRY("sync", gpu->ops->sync(gpu));
        TRY("timer", dsv4_cuda_timer_start(tm));
        TRY("compress", gpu->ops->compress(gpu, s->ent, s->kv, s->z, s->a, s->zin, s->ape,
                                           s->slot, s->pos, s->emit, s->T, s->r, s->d));
        TRY("timer", dsv4_cuda_timer_stop(tm, &ms[i]));
    }
    qsort(ms, N_TIMED, sizeof(float), cmp_float);
    return ms[N_TIMED / 2] * 1e3f;
}

/* One shape and plan: the check and the timings; 1 when it failed. */
static int
run_case(struct dsv4_cuda_timer *tm, struct shape *s, const char *plan)
{
    float *rf[3], *rp[3];
    char line[1024] = "";
    int ok = 1, n_emit = 0;
    float us_fc, us_p;

    plan_make(s, plan);
    for (int t = 0; t < s->T; t++)
        n_emit += s->h_emit[t] >= 0;
    TRY("compress", run_form(s, 0));
    fetch(s, rf);
    TRY("compress", run_form(s, 1));
    fetch(s, rp);
    ok &= same_bits(line, sizeof(line), "entries", rp[0], rf[0], (size_t)s->T * s->d);
    ok &= same_bits(line, sizeof(line), "kv", rp[1], rf[1], s->pool_n);
    ok &= same_bits(line, sizeof(line), "z", rp[2], rf[2], s->pool_n);
    us_fc = time_form(tm, s, 0);
    us_p = time_form(tm, s, 1);
    printf("%-4s r=%-3d d=%-3d T=%-4d %-5s (%4d entries)  fc_kernel %8.1f us  prefill %7.1f us  "
           "x%.1f%s\n",
           ok ? "ok" : "FAIL", s->r, s->d, s->T, plan, n_emit, us_fc, us_p,
           us_p > 0 ? us_fc / us_p : 0.0, line);
    fflush(stdout);
    for (int i = 0; i < 3; i++) {
        free(rf[i]);
        free(rp[i]);
    }
    return !ok;
}

int
main(int argc, char **argv)
{
    static const int shapes[][2] = { { 4, 512 }, { 128, 512 }, { 4, 128 } };
    static const int ts[] = { 512, 2048 };
    static const char *plans[] = { "one", "mid", "multi", "inter" };
    struct dsv4_cuda_timer *tm;
    int fails = 0;

    rng_state = argc > 1 ? strtoull(argv[1], NULL, 10) : 20261130ull;
    {
        /* skip only without a device (NOTSUP); any other failure fails */
        enum dsv4_err e = dsv4_backend_create(&gpu, "cuda", DSV4_NUMERICS_REF, 0);

        if (e == DSV4_ERR_NOTSUP) {
            printf("skip: no CUDA backend (%s)\n", dsv4_errmsg());
            return 77;
        }
        TRY("cuda backend", e);
    }
    TRY("kernels", dsv4_cuda_set_kernels(gpu, 1));
    tm = dsv4_cuda_timer_create(gpu);
    if (tm == NULL) {
        fprintf(stderr, "timer: %s\n", dsv4_errmsg());
        return 1;
    }
    printf("bench_fcp: seed %llu; prefill form vs fc_kernel, bit for bit; us per call "
           "(median of %d)\n",
           (unsigned long long)(argc > 1 ? strtoull(argv[1], NULL, 10) : 20261130ull), N_TIMED);
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
        for (size_t j = 0; j < sizeof(ts) / sizeof(ts[0]); j++) {
            struct shape s;

            shape_make(&s, shapes[i][0], shapes[i][1], ts[j]);
            for (size_t k = 0; k < sizeof(plans) / sizeof(plans[0]); k++)
                fails += run_case(tm, &s, plans[k]);
            shape_free(&s);
        }
    dsv4_cuda_set_fc_prefill(-1);
    printf("%s bench_fcp: %d case lines failed\n", fails ? "FAIL" : "PASS", fails);
    dsv4_cuda_timer_destroy(tm);
    dsv4_backend_destroy(gpu);
    return fails ? 1 : 0;
}
