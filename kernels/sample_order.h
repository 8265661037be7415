/*
 * sample_order.h — steps 4-5 of the sampler (cpu_sample.c), written once for
 * the CPU backend and the CUDA one (kernels/cuda/cuda_sample.cu), so that
 * both draw the same token from the same (seed, step): the candidates'
 * weights, the fixed order of their double sums (runs of DSV4_SAMPLE_RUN
 * positions, spans of DSV4_SAMPLE_SPAN runs: kernels/backend.h), the
 * search for the position the running mass passes a value, and the draw.
 * A backend may hand in the sums of whole runs and spans formed elsewhere
 * in the same order (the CUDA backend forms them in parallel); whatever is
 * not handed in is summed here.
 */
#ifndef DSV4_SAMPLE_ORDER_H
#define DSV4_SAMPLE_ORDER_H

#include <math.h>
#include <stdint.h>

#include "kernels/backend.h"

#ifdef __CUDACC__
#define SO_FN static __host__ __device__ inline
#else
#define SO_FN static inline
#endif

#define SO_SPAN_POS (DSV4_SAMPLE_RUN * DSV4_SAMPLE_SPAN)   /* positions of a span */

/* Runs and spans of n positions. */
SO_FN int
so_runs(int n)
{
    return (n + DSV4_SAMPLE_RUN - 1) / DSV4_SAMPLE_RUN;
}

SO_FN int
so_spans(int n)
{
    return (n + SO_SPAN_POS - 1) / SO_SPAN_POS;
}

/* Step 1: whether the row is greedy (temperature below
 * DSV4_SAMPLE_GREEDY_BELOW, 0 included). */
SO_FN int
so_greedy(const struct dsv4_sample_params *sp)
{
    return sp->temperature < DSV4_SAMPLE_GREEDY_BELOW;
}

/* Step 3 for a sampled row of V: whether its candidates are in sorted
 * order (top_k in [1, V) or top_p < 1; else id order), and how many there
 * are (top_k, or V). */
SO_FN int
so_sorted(const struct dsv4_sample_params *sp, int V)
{
    return (sp->top_k > 0 && sp->top_k < V) || sp->top_p < 1.0f;
}

SO_FN int
so_n_cand(const struct dsv4_sample_params *sp, int V)
{
    return sp->top_k > 0 && sp->top_k < V ? sp->top_k : V;
}

/* The rows' parameters, checked as every backend's sample op does: V >= 1,
 * temperature >= 0 and finite, top_k >= 0, top_p in (0, 1]; else
 * DSV4_ERR_INVAL naming the row (host code). */
static inline enum dsv4_err
so_check(const struct dsv4_sample_params *params, int n, int V)
{
    if (V < 1)
        return dsv4_err_set(DSV4_ERR_INVAL, "sample: V=%d", V);
    for (int r = 0; r < n; r++) {
        const struct dsv4_sample_params *sp = &params[r];

        if (!(sp->temperature >= 0.0f) || !isfinite(sp->temperature) || sp->top_k < 0 ||
            !(sp->top_p > 0.0f && sp->top_p <= 1.0f))
            return dsv4_err_set(DSV4_ERR_INVAL, "sample: row %d: bad parameters "
                                "(temperature %g, top_k %d, top_p %g)", r,
                                (double)sp->temperature, sp->top_k, (double)sp->top_p);
    }
    return DSV4_OK;
}

/* sample_top's parameters: n_top in [0, DSV4_TOP_MAX] on every row, V >= 1. */
static inline enum dsv4_err
so_check_top(const struct dsv4_sample_params *params, int n, int V)
{
    if (V < 1)
        return dsv4_err_set(DSV4_ERR_INVAL, "sample_top: V=%d", V);
    for (int r = 0; r < n; r++) {
        if (params[r].n_top < 0 || params[r].n_top > DSV4_TOP_MAX)
            return dsv4_err_set(DSV4_ERR_INVAL, "sample_top: row %d: n_top %d (0 .. %d)", r,
                                params[r].n_top, DSV4_TOP_MAX);
    }
    return DSV4_OK;
}

/* The candidates of a sampled row (cpu_sample.c step 3). */
struct so_cands {
    const float *z;                  /* z = logits / temperature, by id */
    const int32_t *cand;             /* candidate ids by position, or NULL: */
    const unsigned long long *keys;  /* sorted keys (id in the low 32 bits), or NULL: id order */
    const double *q, *d;             /* sums of every whole run / span of the n_cand
                                        positions in this order, or NULL */
    float zmax;                      /* the largest z */
    int n_cand;                      /* candidates */
};

/* The counter-based generator of step 5. */
SO_FN uint64_t
so_splitmix64(uint64_t x)
{
    uint64_t z = x + 0x9E3779B97F4A7C15ull;

    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Step 5's u in [0, 1) for (seed, step). */
SO_FN double
so_u(const struct dsv4_sample_params *sp)
{
    return (double)(so_splitmix64(sp->seed ^ (sp->step * 0xD1B54A32D192ED03ull)) >> 11) *
           0x1p-53;
}

/* Whether the running mass s passes t (ge: reaches, >=; else exceeds, >). */
SO_FN int
so_pass(double s, double t, int ge)
{
    return ge ? s >= t : s > t;
}

/* The id of the candidate at position i. */
SO_FN int
so_cand(const struct so_cands *c, int i)
{
    return c->cand != NULL ? c->cand[i] : c->keys != NULL ? (int)(c->keys[i] & 0xffffffffu) : i;
}

/* The weight of a value x (a z, or a logit) against its row's largest m,
 * in double: exp(x - m), the difference in fp32.  A NaN weighs 0 (it is
 * -inf: one NaN logit made the mass NaN, and the draw fell to the last
 * candidate); where m is +inf (a +inf logit, or z overflowing) the +inf
 * values share the mass, 1 each, and every other weighs 0 (exp(inf - inf)
 * was NaN).  The log-probabilities' sum (so_logprob) uses the same. */
SO_FN double
so_lw(float x, float m)
{
    if (isnan(x))
        return 0.0;
    if (isinf(m) && m > 0.0f)
        return x == m ? 1.0 : 0.0;
    return exp((double)(x - m));
}

/* The log-probability of a logit x in a row of largest logit m whose
 * so_lw(l_i, m) sum to s: x - (m + log s); a NaN is -inf, and where m is
 * +inf each +inf logit has -log s (s of them), any other -inf. */
SO_FN double
so_logprob(float x, float m, double s)
{
    if (isnan(x))
        return -INFINITY;
    if (isinf(m) && m > 0.0f)
        return x == m ? -log(s) : -INFINITY;
    return (double)x - ((double)m + log(s));
}

/* Step 4's weight of position i. */
SO_FN double
so_w(const struct so_cands *c, int i)
{
    return so_lw(c->z[so_cand(c, i)], c->zmax);
}

/* The sum of run b of the first n positions, in position order. */
SO_FN double
so_run(const struct so_cands *c, int b, int n)
{
    int p0 = b * DSV4_SAMPLE_RUN, p1 = p0 + DSV4_SAMPLE_RUN < n ? p0 + DSV4_SAMPLE_RUN : n;
    int whole = p0 + DSV4_SAMPLE_RUN < c->n_cand ? p0 + DSV4_SAMPLE_RUN : c->n_cand;
    double q = 0.0;

    if (c->q != NULL && p1 == whole)
        return c->q[b];
    for (int i = p0; i < p1; i++)
        q += so_w(c, i);
    return q;
}

/* The sum of span s of the first n positions: its runs' sums in order. */
SO_FN double
so_span(const struct so_cands *c, int s, int n)
{
    int p0 = s * SO_SPAN_POS, p1 = p0 + SO_SPAN_POS < n ? p0 + SO_SPAN_POS : n;
    int whole = p0 + SO_SPAN_POS < c->n_cand ? p0 + SO_SPAN_POS : c->n_cand;
    double d = 0.0;

    if (c->d != NULL && p1 == whole)
        return c->d[s];
    for (int p = p0; p < p1; p += DSV4_SAMPLE_RUN)
        d += so_run(c, p / DSV4_SAMPLE_RUN, n);
    return d;
}

/* Every run's and span's sum of all c->n_cand positions into q
 * (so_runs(n_cand)) and d (so_spans(n_cand)), in order, for the sums
 * below to read (c->q, c->d set). */
SO_FN void
so_sums(struct so_cands *c, double *q, double *d)
{
    c->q = c->d = NULL;
    for (int b = 0; b < so_runs(c->n_cand); b++)
        q[b] = so_run(c, b, c->n_cand);
    c->q = q;
    for (int s = 0; s < so_spans(c->n_cand); s++)
        d[s] = so_span(c, s, c->n_cand);
    c->d = d;
}

/* The mass of the first n positions: the spans' sums in order. */
SO_FN double
so_mass(const struct so_cands *c, int n)
{
    double m = 0.0;

    for (int s = 0; s < so_spans(n); s++)
        m += so_span(c, s, n);
    return m;
}

/*
 * The position the running mass of the first n positions first passes t
 * (ge: reaches, >=; else exceeds, >), found span, run, position: E = the
 * mass of the spans before span s, for the first span whose E + its sum
 * passes t; then G = E plus run sums, in order, up to the first run for
 * which G + its sum passes t; then G plus that run's weights, in order, up
 * to the first position where G passes t.  Where rounding leaves no passing
 * run or position, the last one of the span or run; no passing span, the
 * last position.
 */
SO_FN int
so_find(const struct so_cands *c, int n, double t, int ge)
{
    double e = 0.0;

    for (int s = 0; s < so_spans(n); s++) {
        int p0 = s * SO_SPAN_POS, p1 = p0 + SO_SPAN_POS < n ? p0 + SO_SPAN_POS : n;
        double d = so_span(c, s, n), g = e;

        if (!so_pass(e + d, t, ge)) {
            e += d;
            continue;
        }
        for (int p = p0; p < p1; p += DSV4_SAMPLE_RUN) {
            int len = p1 - p < DSV4_SAMPLE_RUN ? p1 - p : DSV4_SAMPLE_RUN;
            double q = so_run(c, p / DSV4_SAMPLE_RUN, n);

            if (!so_pass(g + q, t, ge)) {
                g += q;
                continue;
            }
            for (int i = p; i < p + len; i++) {
                g += so_w(c, i);
                if (so_pass(g, t, ge))
                    return i;
            }
            return p + len - 1;
        }
        return p1 - 1;
    }
    return n - 1;
}

/* Steps 4-5 for one row: top_p < 1 keeps the first so_find(n, top_p *
 * mass(n), >=) + 1 candidates; u from (seed, step); the id at so_find(kept,
 * u * mass(kept), >). */
SO_FN int
so_draw(const struct so_cands *c, const struct dsv4_sample_params *sp)
{
    int n = c->n_cand;

    if (sp->top_p < 1.0f)
        n = so_find(c, n, (double)sp->top_p * so_mass(c, n), 1) + 1;
    return so_cand(c, so_find(c, n, so_u(sp) * so_mass(c, n), 0));
}

#endif
