/*
 * backend.c — backend selection by name (kernels/backend.h), and the fused
 * ops as the compositions of plain ops that define them.
 *
 * "cpu" is always available.  "cuda" runs dsv4_cuda_backend_create on the
 * current device in builds with CUDA (DSV4_HAVE_CUDA, set by
 * kernels/meson.build) and is answered with DSV4_ERR_NOTSUP otherwise.
 */
#include "kernels/backend.h"

#include <string.h>

enum dsv4_err
dsv4_backend_create(struct dsv4_backend **out, const char *name, enum dsv4_numerics numerics,
                    int n_threads)
{
    *out = NULL;
    if (name == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "backend: no name given");
    if (strcmp(name, "cpu") == 0)
        return dsv4_cpu_backend_create(out, numerics, n_threads);
    if (strcmp(name, "cuda") == 0) {
#ifdef DSV4_HAVE_CUDA
        return dsv4_cuda_backend_create(out, numerics, -1);
#else
        return dsv4_err_set(DSV4_ERR_NOTSUP, "backend: the CUDA backend is not available "
                            "in this build");
#endif
    }
    return dsv4_err_set(DSV4_ERR_INVAL, "backend: unknown backend \"%s\" (expected cpu or "
                        "cuda)", name);
}

void
dsv4_backend_destroy(struct dsv4_backend *be)
{
    if (be != NULL)
        be->ops->destroy(be);
}

enum dsv4_err
dsv4_hc_post_pre_compose(struct dsv4_backend *be, float *X_out, float *x_out, float *post_out,
                         float *comb_out, float *xn, const float *f, const float *X,
                         const float *post, const float *comb, const struct dsv4_hc_w *hc,
                         const uint16_t *nw, int T, int n, int D, int iters, float hc_eps,
                         float norm_eps)
{
    const struct dsv4_backend_ops *ops = be->ops;
    enum dsv4_err e = ops->hc_post(be, X_out, f, X, post, comb, T, n, D);

    if (e == DSV4_OK)
        e = ops->hc_pre(be, x_out, post_out, comb_out, X_out, hc, T, n, D, iters, hc_eps,
                        norm_eps);
    if (e == DSV4_OK && xn != NULL)
        e = ops->rms_norm(be, xn, x_out, nw, T, D, norm_eps);
    return e;
}

enum dsv4_err
dsv4_norm_rope_compose(struct dsv4_backend *be, float *x, const uint16_t *w, int rows, int D,
                       float eps, const int32_t *pos, int heads, int off, int rd,
                       const float *freqs, int sim_cols, int sim_block, float *dst,
                       const int32_t *dst_rows)
{
    const struct dsv4_backend_ops *ops = be->ops;
    enum dsv4_err e;

    if (heads < 1 || rows % heads != 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "norm_rope: %d rows, %d heads", rows, heads);
    if (rows <= 0)
        return DSV4_OK;
    e = ops->rms_norm(be, x, x, w, rows, D, eps);
    if (e == DSV4_OK && rd > 0)
        e = ops->rope(be, x, pos, rows / heads, heads, (int64_t)heads * D, D, off, rd, freqs,
                      0);
    if (e == DSV4_OK && sim_cols > 0)
        e = ops->fp8_sim(be, x, rows, D, sim_cols, sim_block);
    if (e == DSV4_OK && dst != NULL)
        e = ops->scatter_rows(be, dst, dst_rows, x, rows, D);
    return e;
}

enum dsv4_err
dsv4_norm_rope_one(struct dsv4_backend *be, const struct dsv4_norm_rope *a)
{
    return be->ops->norm_rope(be, a->x, a->w, a->rows, a->D, a->eps, a->pos, a->heads, a->off,
                              a->rd, a->freqs, a->sim_cols, a->sim_block, a->dst, a->dst_rows);
}

enum dsv4_err
dsv4_norm_rope2_compose(struct dsv4_backend *be, const struct dsv4_norm_rope *a,
                        const struct dsv4_norm_rope *b)
{
    const struct dsv4_norm_rope *c[2] = { a, b };

    for (int i = 0; i < 2; i++) {
        enum dsv4_err e = dsv4_norm_rope_one(be, c[i]);
        if (e != DSV4_OK)
            return e;
    }
    return DSV4_OK;
}

enum dsv4_err
dsv4_linear_norm_rope_compose(struct dsv4_backend *be, const float *x,
                              const struct dsv4_linear *W, int T, unsigned flags,
                              const struct dsv4_norm_rope *nr)
{
    enum dsv4_err e = be->ops->linear(be, nr->x, x, W, T, flags);

    if (e != DSV4_OK)
        return e;
    return dsv4_norm_rope_one(be, nr);
}

enum dsv4_err
dsv4_attention_out_compose(struct dsv4_backend *be, const struct dsv4_attn *a, int off, int rd,
                           const float *freqs, float *u, const struct dsv4_linear *wo_a, int G)
{
    enum dsv4_err e = be->ops->attention_unrope(be, a, off, rd, freqs);

    if (e != DSV4_OK)
        return e;
    return be->ops->linear_grouped(be, u, a->out, wo_a, a->T, G);
}

enum dsv4_err
dsv4_attention_unrope_compose(struct dsv4_backend *be, const struct dsv4_attn *a, int off,
                              int rd, const float *freqs)
{
    enum dsv4_err e = be->ops->attention(be, a->out, a->q, a->kv, a->ring, a->comp, a->pages,
                                         a->sel, a->sink, a->slot, a->pos, a->row0, a->pos0,
                                         a->T, a->H, a->Dh, a->win, a->cap, a->ratio, a->K,
                                         a->scale);

    if (e != DSV4_OK)
        return e;
    return be->ops->rope(be, a->out, a->pos, a->T, a->H, (int64_t)a->H * a->Dh, a->Dh, off, rd,
                         freqs, 1);
}

enum dsv4_err
dsv4_linear_multi_compose(struct dsv4_backend *be, int n, float *const *outs, const float *x,
                          const struct dsv4_linear *const *Ws, const unsigned *flags, int T)
{
    if (n < 1 || n > DSV4_LINEAR_MULTI_MAX)
        return dsv4_err_set(DSV4_ERR_INVAL, "linear_multi: %d linears (1..%d)", n,
                            DSV4_LINEAR_MULTI_MAX);
    for (int i = 0; i < n; i++) {
        enum dsv4_err e;

        if (Ws[i]->n_in != Ws[0]->n_in)
            return dsv4_err_set(DSV4_ERR_INVAL, "linear_multi: inputs of %d and %d columns",
                                Ws[0]->n_in, Ws[i]->n_in);
        e = be->ops->linear(be, outs[i], x, Ws[i], T, flags[i]);
        if (e != DSV4_OK)
            return e;
    }
    return DSV4_OK;
}
