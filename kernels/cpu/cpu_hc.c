/*
 * cpu_hc.c — manifold-constrained hyper-connections (model doc §3.2):
 * hc_pre (mix, Sinkhorn, stream collapse), hc_post, hc_head.
 *
 * Numerics, all fp32 as in the reference:
 *   v = X[t] flattened (n*D values as given), r = 1 / sqrtf(cpu_sumsq(v)/(n*D)
 *   + norm_eps), mix[m] = cpu_dot(v, fn[m]) * r.
 *   sigmoid(x) = 1 / (1 + expf(-x)); softmax subtracts the row max, uses
 *   expf and divides by the sum (summed in index order).
 *   Sinkhorn: C = softmax rows + eps, column normalise, then iters-1 times
 *   row normalise and column normalise (each divides by sum + eps).
 *   x_out = bf16(Σ_j pre_j X_j), j ascending.
 *   hc_post: X_out[k] = bf16(post_k f + Σ_j C[j][k] X_j), the sum over j
 *   (ascending) first, as the reference does.
 * Phase 1 (mix dot products) runs in parallel over (token, mix row); phase 2
 * over tokens.
 */
#include "kernels/cpu/cpu.h"

#include <math.h>
#include <stdlib.h>

#include "common/formats.h"

#define HC_MAX_N 16   /* streams supported (the model has 4) */

/* --- mix projection ------------------------------------------------------------ */

struct mix_job {
    float *mix;        /* (T, M+1): M dots, then the sum of squares */
    const float *X;    /* (T, nD) */
    const float *fn;   /* (M, nD) */
    int M, nD;
};

static void
mix_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct mix_job *j = ctx;

    (void)tid;
    for (int64_t it = begin; it < end; it++) {
        int64_t t = it / (j->M + 1);
        int m = (int)(it % (j->M + 1));
        const float *v = j->X + t * j->nD;

        if (m < j->M)
            j->mix[it] = cpu_dot(v, j->fn + (int64_t)m * j->nD, j->nD);
        else
            j->mix[it] = cpu_sumsq(v, j->nD);
    }
}

/*
 * mix (T, M+1) <- raw dots and sums of squares; then each row's first M
 * values are scaled by r.  Returns the buffer (free()) or NULL.
 */
static float *
hc_mix(struct dsv4_backend *be, const float *X, const float *fn, int T, int M, int nD,
       float norm_eps)
{
    struct mix_job j;

    j.mix = malloc((size_t)T * (M + 1) * sizeof(float));
    if (j.mix == NULL)
        return NULL;
    j.X = X;
    j.fn = fn;
    j.M = M;
    j.nD = nD;
    cpu_parallel_for(be, (int64_t)T * (M + 1), 1 + 65536 / nD, mix_task, &j);
    for (int t = 0; t < T; t++) {
        float *mx = j.mix + (int64_t)t * (M + 1);
        float r = 1.0f / sqrtf(mx[M] / (float)nD + norm_eps);

        for (int m = 0; m < M; m++)
            mx[m] *= r;
    }
    return j.mix;
}

static inline float
sigmoidf(float x)
{
    return 1.0f / (1.0f + cpu_expf(-x));
}

/* out (D) = bf16(Σ_j pre[j] X[j]) */
static void
hc_collapse(float *out, const float *X, const float *pre, int n, int D)
{
    for (int i = 0; i < D; i++) {
        float acc = pre[0] * X[i];

        for (int jj = 1; jj < n; jj++)
            acc += pre[jj] * X[(int64_t)jj * D + i];
        out[i] = dsv4_bf16_round(acc);
    }
}

/* --- hc_pre ------------------------------------------------------------------------- */

/* Sinkhorn projection of the n x n logits C (row j, column k) in place. */
static void
sinkhorn(float *C, int n, int iters, float eps)
{
    for (int j = 0; j < n; j++) {
        float *row = C + j * n;
        float mx = row[0], sum = 0.0f;

        for (int k = 1; k < n; k++)
            mx = row[k] > mx ? row[k] : mx;
        for (int k = 0; k < n; k++) {
            row[k] = cpu_expf(row[k] - mx);
            sum += row[k];
        }
        for (int k = 0; k < n; k++)
            row[k] = row[k] / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int j = 0; j < n; j++) {
                float sum = 0.0f;

                for (int k = 0; k < n; k++)
                    sum += C[j * n + k];
                for (int k = 0; k < n; k++)
                    C[j * n + k] /= sum + eps;
            }
        }
        for (int k = 0; k < n; k++) {
            float sum = 0.0f;

            for (int j = 0; j < n; j++)
                sum += C[j * n + k];
            for (int j = 0; j < n; j++)
                C[j * n + k] /= sum + eps;
        }
    }
}

/*
 * Phase 2 of hc_pre and hc_head, per token: pre (and for hc_pre post, comb
 * with Sinkhorn) from the mix, then x_out = collapse(pre, X).  head: the
 * hc_head form (n mix values, no post/comb).
 */
struct collapse_job {
    float *x_out, *post, *comb;
    const float *X, *mix;
    const struct dsv4_hc_w *hc;
    int n, D, iters, head;
    float hc_eps;
};

static void
collapse_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct collapse_job *j = ctx;
    int n = j->n, M = j->head ? n : (2 + n) * n;
    const float *sc = j->hc->scale, *base = j->hc->base;

    (void)tid;
    for (int64_t t = begin; t < end; t++) {
        const float *mx = j->mix + t * (M + 1);
        float pre[HC_MAX_N];

        for (int k = 0; k < n; k++)
            pre[k] = sigmoidf(mx[k] * sc[0] + base[k]) + j->hc_eps;
        if (!j->head) {
            float *C = j->comb + t * n * n;

            for (int k = 0; k < n; k++)
                j->post[t * n + k] = 2.0f * sigmoidf(mx[n + k] * sc[1] + base[n + k]);
            for (int m = 0; m < n * n; m++)
                C[m] = mx[2 * n + m] * sc[2] + base[2 * n + m];
            sinkhorn(C, n, j->iters, j->hc_eps);
        }
        hc_collapse(j->x_out + t * j->D, j->X + t * n * j->D, pre, n, j->D);
    }
}

/* Both phases of hc_pre / hc_head for the job j (X, hc, n, D set). */
static enum dsv4_err
collapse_run(struct dsv4_backend *be, struct collapse_job *j, int T, float norm_eps)
{
    int n = j->n, M = j->head ? n : (2 + n) * n;
    float *mix;

    if (n < 1 || n > HC_MAX_N || (!j->head && j->iters < 1))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cpu hc: n=%d iters=%d", n, j->iters);
    if (T <= 0)
        return DSV4_OK;
    mix = hc_mix(be, j->X, j->hc->fn, T, M, n * j->D, norm_eps);
    if (mix == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cpu hc: no memory");
    j->mix = mix;
    cpu_parallel_for(be, T, 1 + 16384 / (n * j->D), collapse_task, j);
    free(mix);
    return DSV4_OK;
}

enum dsv4_err
cpu_hc_pre(struct dsv4_backend *be, float *x_out, float *post, float *comb, const float *X,
           const struct dsv4_hc_w *hc, int T, int n, int D, int iters, float hc_eps,
           float norm_eps)
{
    struct collapse_job j = { x_out, post, comb, X, NULL, hc, n, D, iters, 0, hc_eps };

    return collapse_run(be, &j, T, norm_eps);
}

/* --- hc_post ---------------------------------------------------------------------------- */

struct post_job {
    float *X_out;
    const float *f, *X, *post, *comb;
    int n, D;
};

static void
post_task(void *ctx, int64_t begin, int64_t end, int tid)
{
    const struct post_job *j = ctx;
    int n = j->n, D = j->D;

    (void)tid;
    for (int64_t it = begin; it < end; it++) {
        int64_t t = it / n;
        int k = (int)(it % n);
        const float *X = j->X + t * n * D;
        const float *C = j->comb + t * n * n;
        const float *f = j->f + t * D;
        float pk = j->post[t * n + k];
        float *o = j->X_out + (t * n + k) * D;

        for (int i = 0; i < D; i++) {
            float acc = C[k] * X[i];

            for (int jj = 1; jj < n; jj++)
                acc += C[jj * n + k] * X[(int64_t)jj * D + i];
            o[i] = dsv4_bf16_round(pk * f[i] + acc);
        }
    }
}

enum dsv4_err
cpu_hc_post(struct dsv4_backend *be, float *X_out, const float *f, const float *X,
            const float *post, const float *comb, int T, int n, int D)
{
    struct post_job j = { X_out, f, X, post, comb, n, D };

    cpu_parallel_for(be, (int64_t)T * n, 1 + 16384 / (n * D), post_task, &j);
    return DSV4_OK;
}

/* --- hc_head ------------------------------------------------------------------------------ */

enum dsv4_err
cpu_hc_head(struct dsv4_backend *be, float *x_out, const float *X, const struct dsv4_hc_w *hc,
            int T, int n, int D, float hc_eps, float norm_eps)
{
    struct collapse_job j = { x_out, NULL, NULL, X, NULL, hc, n, D, 0, 1, hc_eps };

    return collapse_run(be, &j, T, norm_eps);
}
