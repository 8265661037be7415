/*
 * bench_stats.c — dsv4-bench arithmetic: seeded random numbers, length
 * distributions, sample arrays, percentiles and the per-stream timing rule.
 * No I/O, no threads: everything here is unit-tested (tests/bench/).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"

/* --- random numbers ------------------------------------------------- */

void
bench_rng_seed(struct bench_rng *r, uint64_t seed, uint64_t stream)
{
    /* Mix the stream number through one splitmix64 step of its own so that
     * neighbouring (seed, stream) pairs start far apart. */
    struct bench_rng t = { stream ^ 0xD1B54A32D192ED03ull };

    r->s = seed ^ bench_rng_next(&t);
}

uint64_t
bench_rng_next(struct bench_rng *r)
{
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double
bench_rng_uniform(struct bench_rng *r)
{
    return (double)(bench_rng_next(r) >> 11) * 0x1.0p-53; /* 53 random bits */
}

double
bench_rng_normal(struct bench_rng *r)
{
    double u1 = 1.0 - bench_rng_uniform(r); /* (0, 1]: log(u1) is finite */
    double u2 = bench_rng_uniform(r);

    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* --- length distributions ------------------------------------------- */

/* Parse a number of `what` into *v; integers only when `integral`. */
static int
dist_num(const char *s, double *v, int integral, const char *spec, char *err, size_t errlen)
{
    char *end;

    errno = 0;
    *v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !isfinite(*v) ||
        (integral && *v != floor(*v))) {
        snprintf(err, errlen, "bad number '%s' in length spec '%s'", s, spec);
        return -1;
    }
    return 0;
}

int
bench_dist_parse(struct bench_dist *d, const char *spec, char *err, size_t errlen)
{
    static const struct {
        const char *name;
        int kind;
    } kinds[] = {
        { "uniform", BENCH_DIST_UNIFORM },
        { "normal", BENCH_DIST_NORMAL },
        { "lognormal", BENCH_DIST_LOGNORMAL },
    };
    char buf[128], *f[4];
    int nf = 0;

    if (spec == NULL || strlen(spec) >= sizeof(buf) || spec[0] == '\0') {
        snprintf(err, errlen, "bad length spec '%s'", spec != NULL ? spec : "");
        return -1;
    }
    strcpy(buf, spec);
    /* strtok would merge empty fields ("uniform::4"); split by hand. */
    f[nf++] = buf;
    for (char *p = buf; *p != '\0'; p++) {
        if (*p != ':')
            continue;
        if (nf == 4) {
            snprintf(err, errlen, "too many fields in length spec '%s'", spec);
            return -1;
        }
        *p = '\0';
        f[nf++] = p + 1;
    }
    if (nf == 1) {
        d->kind = BENCH_DIST_FIXED;
        if (dist_num(f[0], &d->a, 1, spec, err, errlen) != 0)
            return -1;
        d->b = d->a;
        if (d->a < 1 || d->a > BENCH_MAX_LEN) {
            snprintf(err, errlen, "length %s outside 1..%d", f[0], BENCH_MAX_LEN);
            return -1;
        }
        return 0;
    }
    d->kind = 0;
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        if (strcmp(f[0], kinds[i].name) == 0)
            d->kind = kinds[i].kind;
    if (d->kind == 0) {
        snprintf(err, errlen, "unknown distribution '%s' (N, uniform:LO:HI, normal:MEAN:SD, "
            "lognormal:MEAN:SD)", f[0]);
        return -1;
    }
    if (nf != 3) {
        snprintf(err, errlen, "'%s' needs two numbers (%s:A:B)", spec, f[0]);
        return -1;
    }
    if (dist_num(f[1], &d->a, d->kind == BENCH_DIST_UNIFORM, spec, err, errlen) != 0 ||
        dist_num(f[2], &d->b, d->kind == BENCH_DIST_UNIFORM, spec, err, errlen) != 0)
        return -1;
    if (d->kind == BENCH_DIST_UNIFORM) {
        if (d->a < 1 || d->b > BENCH_MAX_LEN || d->a > d->b) {
            snprintf(err, errlen, "uniform:LO:HI needs 1 <= LO <= HI <= %d", BENCH_MAX_LEN);
            return -1;
        }
    } else if (d->a < 1 || d->a > BENCH_MAX_LEN || d->b < 0) {
        snprintf(err, errlen, "%s:MEAN:SD needs 1 <= MEAN <= %d and SD >= 0", f[0],
            BENCH_MAX_LEN);
        return -1;
    }
    return 0;
}

/* Round and clamp a real length to [1, BENCH_MAX_LEN]. */
static uint32_t
dist_clamp(double x)
{
    x = floor(x + 0.5);
    if (!(x >= 1))      /* also NaN */
        return 1;
    if (x > BENCH_MAX_LEN)
        return BENCH_MAX_LEN;
    return (uint32_t)x;
}

uint32_t
bench_dist_draw(const struct bench_dist *d, struct bench_rng *r)
{
    double s2, mu;

    switch (d->kind) {
    case BENCH_DIST_UNIFORM:
        return (uint32_t)d->a + (uint32_t)(bench_rng_uniform(r) * (d->b - d->a + 1));
    case BENCH_DIST_NORMAL:
        return dist_clamp(d->a + d->b * bench_rng_normal(r));
    case BENCH_DIST_LOGNORMAL:
        /* Lengths L = exp(N(mu, s2)) with E[L] = a and sd(L) = b. */
        s2 = log(1.0 + (d->b * d->b) / (d->a * d->a));
        mu = log(d->a) - s2 / 2;
        return dist_clamp(exp(mu + sqrt(s2) * bench_rng_normal(r)));
    default:
        return dist_clamp(d->a);
    }
}

void
bench_dist_format(const struct bench_dist *d, char *buf, size_t len)
{
    switch (d->kind) {
    case BENCH_DIST_UNIFORM:
        snprintf(buf, len, "uniform:%.0f:%.0f", d->a, d->b);
        break;
    case BENCH_DIST_NORMAL:
        snprintf(buf, len, "normal:%.15g:%.15g", d->a, d->b);
        break;
    case BENCH_DIST_LOGNORMAL:
        snprintf(buf, len, "lognormal:%.15g:%.15g", d->a, d->b);
        break;
    default:
        snprintf(buf, len, "%.0f", d->a);
    }
}

/* --- samples and summaries ------------------------------------------ */

int
bench_samples_add(struct bench_samples *s, double x)
{
    if (s->n == s->cap) {
        size_t cap = s->cap != 0 ? 2 * s->cap : 256;
        double *v = realloc(s->v, cap * sizeof(*v));

        if (v == NULL)
            return -1;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = x;
    return 0;
}

int
bench_samples_merge(struct bench_samples *dst, const struct bench_samples *src)
{
    for (size_t i = 0; i < src->n; i++)
        if (bench_samples_add(dst, src->v[i]) != 0)
            return -1;
    return 0;
}

void
bench_samples_free(struct bench_samples *s)
{
    free(s->v);
    s->v = NULL;
    s->n = s->cap = 0;
}

double
bench_percentile(const double *sorted, size_t n, double p)
{
    double rank = (double)(n - 1) * p / 100.0;
    size_t lo = (size_t)floor(rank);

    if (lo + 1 >= n)
        return sorted[n - 1];
    return sorted[lo] + (rank - (double)lo) * (sorted[lo + 1] - sorted[lo]);
}

static int
cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

void
bench_summarize(struct bench_samples *s, double scale, struct bench_summary *out)
{
    double sum = 0;

    memset(out, 0, sizeof(*out));
    if (s->n == 0)
        return;
    qsort(s->v, s->n, sizeof(s->v[0]), cmp_double);
    for (size_t i = 0; i < s->n; i++)
        sum += s->v[i];
    out->n = s->n;
    out->mean = sum / (double)s->n * scale;
    out->min = s->v[0] * scale;
    out->max = s->v[s->n - 1] * scale;
    out->p50 = bench_percentile(s->v, s->n, 50) * scale;
    out->p90 = bench_percentile(s->v, s->n, 90) * scale;
    out->p99 = bench_percentile(s->v, s->n, 99) * scale;
}

/* --- timing of one stream ------------------------------------------- */

void
bench_stream_begin(struct bench_stream *st, double t_submit)
{
    memset(st, 0, sizeof(*st));
    st->t_submit = t_submit;
}

int
bench_stream_tokens(struct bench_stream *st, double t, size_t k, struct bench_samples *itl)
{
    if (k == 0)
        return 0;
    if (st->n_tokens == 0) {
        st->t_first = t;
    } else if (itl != NULL) {
        double gap = (t - st->t_last) / (double)k;

        for (size_t i = 0; i < k; i++)
            if (bench_samples_add(itl, gap) != 0)
                return -1;
    }
    st->t_last = t;
    st->n_tokens += (uint32_t)k;
    return 0;
}
