/*
 * cpu_sample.c — token sampling (greedy, temperature, top-k, top-p) with a
 * counter-based generator, so a draw depends only on (seed, step).
 *
 * The algorithm, which any other backend must follow to draw the same tokens:
 *   1. greedy (temperature below DSV4_SAMPLE_GREEDY_BELOW, 0 included: so_greedy):
 *      the argmax, lowest id on ties, NaN as -inf (all NaN: 0).
 *   2. z_i = logits_i / temperature (fp32 division).
 *   3. candidates: with top_k in [1, V) the top_k best z by (z desc, id asc);
 *      otherwise, when top_p < 1, all V in that order; otherwise all V in id
 *      order (no sorting needed).
 *   4. weights w_p = exp((double)(z - zmax)) of the candidate at position p
 *      (candidate order), zmax the largest z (a NaN weighs 0; where zmax is
 *      +inf, each +inf z weighs 1 and the rest 0: so_lw).  The mass of the first n
 *      positions is their weights' sum in double in a fixed blocked order:
 *      runs of 16 positions, spans of 256 runs, each summed in order;
 *      find(n, t) is the position where the running mass first passes t,
 *      searched span, run, position (kernels/sample_order.h, the code both
 *      backends run, says exactly how).  top_p < 1 keeps the first
 *      find(n, top_p * mass(n)) + 1 candidates ("passes": >=); their mass
 *      is M.
 *   5. u = (splitmix64(seed ^ (step * 0xD1B54A32D192ED03)) >> 11) * 2^-53 in
 *      [0, 1); the pick is the candidate at find(kept, u * M) ("passes": >).
 * (Before run 36 the sums of steps 4-5 were one running sum over all
 * candidates: the same draw up to rounding, but only one thread could form
 * it, 41 ms a step on the GPU.)
 * out_logprob = logits[id] - (m + log Σ_i exp(logits_i - m)), m = max logit,
 * the sum in double (temperature 1, all V tokens; NaN and +inf logits as in
 * step 4: so_logprob).
 * Invalid parameters (temperature < 0 or not finite, top_k < 0, top_p not in
 * (0, 1]) give DSV4_ERR_INVAL.  Rows run in parallel.
 *
 * cpu_sample_top: the row's n_top best ids by (logit desc, id asc) (cpu_topk,
 * NaN as -inf) with the same log-probability as out_logprob.
 */
#include "kernels/cpu/cpu.h"
#include "kernels/sample_order.h"

#include <math.h>
#include <stdlib.h>

struct sample_job {
    int32_t *out_ids;
    float *out_logprob;
    const float *logits;
    const struct dsv4_sample_params *params;
    int V;
    float *z;                 /* (n_threads, V) */
    struct cpu_pick *heap;    /* (n_threads, V) */
    int32_t *cand;            /* (n_threads, V) */
    double *q, *d;            /* (n_threads, so_runs(V) / so_spans(V)): the run and span sums */
};

/* The index of the largest l, lowest on ties; a NaN is none (it was the
 * pick when it stood at index 0); all NaN: 0. */
static int
argmax(const float *l, int V)
{
    int best = 0;

    for (int i = 1; i < V; i++)
        if (l[i] > l[best] || (isnan(l[best]) && !isnan(l[i])))
            best = i;
    return best;
}

static int
sample_row(const struct sample_job *j, const float *l, const struct dsv4_sample_params *sp,
           int tid)
{
    int V = j->V, n;
    float *z = j->z + (int64_t)tid * V;
    int32_t *cand = j->cand + (int64_t)tid * V;
    float zmax;

    if (so_greedy(sp))
        return argmax(l, V);
    for (int i = 0; i < V; i++)
        z[i] = l[i] / sp->temperature;
    if (so_sorted(sp, V)) {
        n = cpu_topk(cand, z, V, so_n_cand(sp, V), j->heap + (int64_t)tid * V);
    } else {
        for (int i = 0; i < V; i++)
            cand[i] = i;
        n = V;
    }
    zmax = z[argmax(z, V)];
    {
        struct so_cands c = { z, cand, NULL, NULL, NULL, zmax, n };

        so_sums(&c, j->q + (int64_t)tid * so_runs(V), j->d + (int64_t)tid * so_spans(V));
        return so_draw(&c, sp);
    }
}

/* The row's largest logit *m and Σ_i so_lw(l_i, m) in double, in id
 * order: what a logit's log-probability takes (so_logprob). */
static double
row_sum(const float *l, int V, float *m)
{
    double s = 0.0;

    *m = l[argmax(l, V)];
    for (int i = 0; i < V; i++)
        s += so_lw(l[i], *m);
    return s;
}

static void
sample_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct sample_job *j = ctx;

    for (int64_t r = begin; r < end; r++) {
        const float *l = j->logits + r * j->V;
        int id = sample_row(j, l, &j->params[r], tid);

        j->out_ids[r] = id;
        if (j->out_logprob != NULL) {
            float m;
            double s = row_sum(l, j->V, &m);

            j->out_logprob[r] = (float)so_logprob(l[id], m, s);
        }
    }
}

enum dsv4_err
cpu_sample(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob, const float *logits,
           const struct dsv4_sample_params *params, int n, int V)
{
    struct sample_job j = { out_ids, out_logprob, logits, params, V, NULL, NULL, NULL, NULL,
                            NULL };
    int nthr = cpu_threads(be);
    enum dsv4_err e = so_check(params, n, V);

    if (e != DSV4_OK || n <= 0)
        return e;
    j.z = malloc((size_t)nthr * V * sizeof(float));
    j.heap = malloc((size_t)nthr * V * sizeof(struct cpu_pick));
    j.cand = malloc((size_t)nthr * V * sizeof(int32_t));
    j.q = malloc((size_t)nthr * so_runs(V) * sizeof(double));
    j.d = malloc((size_t)nthr * so_spans(V) * sizeof(double));
    if (j.z != NULL && j.heap != NULL && j.cand != NULL && j.q != NULL && j.d != NULL)
        cpu_parallel_for(be, n, 1, sample_task, &j);
    else
        e = dsv4_err_set(DSV4_ERR_NOMEM, "sample: no memory (V=%d)", V);
    free(j.z);
    free(j.heap);
    free(j.cand);
    free(j.q);
    free(j.d);
    return e;
}

/* (a sample_job without the sampler's scratch: out_* are the top arrays) */
static void
top_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct sample_job *j = ctx;
    struct cpu_pick heap[DSV4_TOP_MAX];

    (void)tid;
    for (int64_t r = begin; r < end; r++) {
        const float *l = j->logits + r * j->V;
        int32_t *ids = j->out_ids + r * DSV4_TOP_MAX;
        float *lp = j->out_logprob + r * DSV4_TOP_MAX;
        int k = j->params[r].n_top;
        double s;
        float m;

        if (k == 0)
            continue;
        k = cpu_topk(ids, l, j->V, k, heap);
        s = row_sum(l, j->V, &m);
        for (int i = 0; i < k; i++)
            lp[i] = (float)so_logprob(l[ids[i]], m, s);
    }
}

enum dsv4_err
cpu_sample_top(struct dsv4_backend *be, int32_t *out_ids, float *out_logprob,
               const float *logits, const struct dsv4_sample_params *params, int n, int V)
{
    struct sample_job j = { out_ids, out_logprob, logits, params, V, NULL, NULL, NULL, NULL,
                            NULL };
    enum dsv4_err e = so_check_top(params, n, V);

    if (e == DSV4_OK && n > 0)
        cpu_parallel_for(be, n, 1, top_task, &j);
    return e;
}
