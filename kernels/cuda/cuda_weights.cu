/*
 * cuda_weights.cu — upload of a loaded checkpoint to device memory
 * (kernels/cuda_weights.h).
 *
 * Two walks over every tensor of the struct: the first adds up the sizes
 * (each tensor aligned to 256 bytes), the second copies each tensor into its
 * place in one device allocation and replaces the pointer in the copy of the
 * struct.  Tensor sizes follow from the config and the linear shapes
 * (common/weights.h).  The copy is synchronous (cudaMemcpy from the
 * mappings); streaming through pinned buffers is the fast path's business.
 * Progress goes to the log every GiB and to the caller's callback
 * (dsv4_cuda_weights_upload_progress), which the rank daemons turn into
 * STATUS= lines.  Every layer's expert array and shared-expert struct get a
 * registered device copy (cuda_weights_tables), so the moe op reads them
 * without a host copy and can be recorded in a graph.
 *
 * The arena may also be a shareable VMM allocation or another process's,
 * mapped (kernels/cuda_share.h): then pass 1 only places the pointers.  Pass
 * 0 hashes every tensor's place (offset, bytes) into the layout hash that
 * such an import must match.
 */
#include "kernels/cuda_weights.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/weights_share.h"
#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda_share.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

/* One walk: pass 0 sizes (and hashes the layout), pass 1 copies (or only
 * places, for an imported arena). */
struct walk {
    int pass;
    int place_only;
    size_t total, off, logged;
    uint64_t layout;
    char *arena;
    enum dsv4_err err;
    const struct dsv4_cuda_progress *progress;   /* may be NULL */
};

static void
walk_tensor(struct walk *wk, const void **field, size_t bytes)
{
    size_t at;
    cudaError_t rc;

    if (*field == NULL || bytes == 0 || wk->err != DSV4_OK)
        return;
    at = wk->off;
    wk->off += cuda_align(bytes);
    if (wk->pass == 0) {
        uint64_t place[2] = { at, bytes };

        wk->layout = dsv4_wshare_hash(wk->layout, place, sizeof(place));
        return;
    }
    if (wk->place_only) {
        *field = wk->arena + at;
        return;
    }
    rc = cudaMemcpy(wk->arena + at, *field, bytes, cudaMemcpyHostToDevice);
    if (rc != cudaSuccess) {
        wk->err = cuda_err(rc, "weights upload", __FILE__, __LINE__);
        return;
    }
    *field = wk->arena + at;
    if (wk->off - wk->logged >= (size_t)GIB) {
        log_info("cuda weights: %.1f of %.1f GiB on the device", wk->off / GIB,
                 wk->total / GIB);
        wk->logged = wk->off;
        cuda_progress(wk->progress, wk->off, wk->total);
    }
}

#define WALK(wk, f, bytes) walk_tensor((wk), (const void **)(void *)&(f), (bytes))

static void
walk_linear(struct walk *wk, struct dsv4_linear *L)
{
    size_t n = (size_t)L->n_out, k = (size_t)L->n_in;

    if (L->w == NULL)
        return;
    switch (L->fmt) {
    case DSV4_WFMT_BF16:
        WALK(wk, L->w, n * k * 2);
        break;
    case DSV4_WFMT_FP8:
        WALK(wk, L->w, n * k);
        WALK(wk, L->scale, ((n + 127) / 128) * ((k + 127) / 128));
        break;
    case DSV4_WFMT_FP4:
        WALK(wk, L->w, n * k / 2);
        WALK(wk, L->scale, n * (k / 32));
        break;
    }
}

static void
walk_expert(struct walk *wk, struct dsv4_expert_w *e)
{
    walk_linear(wk, &e->w1);
    walk_linear(wk, &e->w3);
    walk_linear(wk, &e->w2);
}

/* rows: mix rows of fn ((2+n)n, or n for a head); n_scale: 3 or 1 */
static void
walk_hc(struct walk *wk, struct dsv4_hc_w *hc, size_t rows, size_t nD, size_t n_scale)
{
    WALK(wk, hc->fn, rows * nD * 4);
    WALK(wk, hc->base, rows * 4);
    WALK(wk, hc->scale, n_scale * 4);
}

static void
walk_compressor(struct walk *wk, struct dsv4_compressor_w *c)
{
    size_t cc = c->ratio == 4 ? 2 : 1;

    WALK(wk, c->ape, (size_t)c->ratio * cc * c->dim * 4);
    walk_linear(wk, &c->wkv);
    walk_linear(wk, &c->wgate);
    WALK(wk, c->norm, (size_t)c->dim * 2);
}

static void
walk_all(struct walk *wk, struct dsv4_weights *w)
{
    const struct dsv4_config *c = &w->cfg;
    size_t V = c->vocab_size, D = c->hidden_size, n = c->hc_mult, E = c->n_routed_experts;

    WALK(wk, w->embed, V * D * 2);
    WALK(wk, w->head, (w->head_rows > 0 ? (size_t)w->head_rows : V) * D * 2);
    WALK(wk, w->norm, D * 2);
    walk_hc(wk, &w->hc_head, n, n * D, 1);
    for (int l = 0; l < w->n_layers; l++) {
        struct dsv4_layer_w *lw = &w->layers[l];

        walk_hc(wk, &lw->hc_attn, (2 + n) * n, n * D, 3);
        walk_hc(wk, &lw->hc_ffn, (2 + n) * n, n * D, 3);
        WALK(wk, lw->attn_norm, D * 2);
        WALK(wk, lw->ffn_norm, D * 2);
        WALK(wk, lw->attn_sink, (size_t)c->num_attention_heads * 4);
        walk_linear(wk, &lw->wq_a);
        WALK(wk, lw->q_norm, (size_t)lw->wq_a.n_out * 2);
        walk_linear(wk, &lw->wq_b);
        walk_linear(wk, &lw->wkv);
        WALK(wk, lw->kv_norm, (size_t)lw->wkv.n_out * 2);
        walk_linear(wk, &lw->wo_a);
        walk_linear(wk, &lw->wo_b);
        if (lw->ratio != 0)
            walk_compressor(wk, &lw->compressor);
        if (lw->ratio == 4) {
            walk_linear(wk, &lw->idx_wq_b);
            walk_linear(wk, &lw->idx_weights_proj);
            walk_compressor(wk, &lw->idx_compressor);
        }
        walk_linear(wk, &lw->gate);
        WALK(wk, lw->gate_bias, E * 4);
        WALK(wk, lw->tid2eid, V * (size_t)c->num_experts_per_tok * 8);
        walk_expert(wk, &lw->shared);
        if (lw->experts != NULL)
            for (size_t e = 0; e < E; e++)
                walk_expert(wk, &lw->experts[e]);
        walk_linear(wk, &lw->e_proj);
        walk_linear(wk, &lw->h_proj);
        WALK(wk, lw->enorm, D * 2);
        WALK(wk, lw->hnorm, D * 2);
        WALK(wk, lw->mtp_norm, D * 2);
        walk_hc(wk, &lw->hc_head, n, n * D, 1);
    }
}

extern "C" void
dsv4_cuda_weights_free(struct dsv4_backend *be, struct dsv4_weights *dev)
{
    struct cuda_wpriv *p = (struct cuda_wpriv *)dev->priv;

    if (p == NULL)
        return;
    /* bf16 copies kept of these weights (fast_blas.cu): new weights may
     * land at the same addresses */
    cuda_arena_forget(be, p->arena);
    cuda_blas_weights_drop(be);
    for (int l = 0; l < p->n_layers && p->experts != NULL; l++)
        cuda_experts_unregister(be, p->experts + (size_t)l * p->E);
    for (int l = 0; l < p->n_layers && p->layers != NULL; l++)
        cuda_experts_unregister(be, &p->layers[l].shared);
    cuda_quiesce(be);
    cuda_arena_free(p);
    cudaFree(p->dev_experts);
    cudaFree(p->dev_shared);
    (void)cudaGetLastError();   /* not the next launch's error */
    free(p->layers);
    free(p->experts);
    free(p);
    memset(dev, 0, sizeof(*dev));
}

void
cuda_progress(const struct dsv4_cuda_progress *pr, uint64_t done, uint64_t total)
{
    if (pr != NULL && pr->fn != NULL)
        pr->fn(pr->ctx, done, total);
}

enum dsv4_err
cuda_weights_tables(struct dsv4_backend *be, struct cuda_wpriv *p)
{
    size_t ne = (size_t)p->n_layers * p->E;
    cudaError_t rc = cudaSuccess;
    enum dsv4_err e;

    /* device copies of the expert arrays and of each layer's shared-expert
     * struct, registered for the moe op */
    if (ne > 0) {
        rc = cudaMalloc((void **)&p->dev_experts, ne * sizeof(*p->experts));
        if (rc == cudaSuccess)
            rc = cudaMemcpy(p->dev_experts, p->experts, ne * sizeof(*p->experts),
                            cudaMemcpyHostToDevice);
    }
    if (rc == cudaSuccess && p->n_layers > 0) {
        rc = cudaMalloc((void **)&p->dev_shared, (size_t)p->n_layers * sizeof(*p->dev_shared));
        for (int l = 0; l < p->n_layers && rc == cudaSuccess; l++)
            rc = cudaMemcpy(p->dev_shared + l, &p->layers[l].shared, sizeof(*p->dev_shared),
                            cudaMemcpyHostToDevice);
    }
    if (rc != cudaSuccess)
        return cuda_err(rc, "expert tables", __FILE__, __LINE__);
    /* the weights are in place: fixed from here (fast_blas.cu keeps bf16
     * copies of some) */
    cuda_arena_note(be, p->arena, p->arena_bytes);
    for (int l = 0; l < p->n_layers; l++) {
        if (p->layers[l].experts != NULL) {
            e = cuda_experts_register(be, p->layers[l].experts,
                                      p->dev_experts + (size_t)l * p->E, p->E, false);
            if (e != DSV4_OK)
                return e;
        }
        if (p->layers[l].shared.w1.w != NULL) {
            e = cuda_experts_register(be, &p->layers[l].shared, p->dev_shared + l, 1, false);
            if (e != DSV4_OK)
                return e;
        }
    }
    return DSV4_OK;
}

extern "C" enum dsv4_err
dsv4_cuda_weights_upload(struct dsv4_backend *be, struct dsv4_weights *dev,
                         const struct dsv4_weights *host)
{
    return dsv4_cuda_weights_upload_progress(be, dev, host, NULL);
}

extern "C" enum dsv4_err
dsv4_cuda_weights_upload_progress(struct dsv4_backend *be, struct dsv4_weights *dev,
                                  const struct dsv4_weights *host,
                                  const struct dsv4_cuda_progress *pr)
{
    return dsv4_cuda_weights_upload_arena(be, dev, host, pr, NULL);
}

extern "C" enum dsv4_err
dsv4_cuda_weights_upload_arena(struct dsv4_backend *be, struct dsv4_weights *dev,
                               const struct dsv4_weights *host,
                               const struct dsv4_cuda_progress *pr,
                               const struct dsv4_cuda_arena *a)
{
    struct cuda_wpriv *p;
    struct walk wk;
    int L = host->n_layers, E = host->cfg.n_routed_experts;
    size_t ne = (size_t)L * E;
    enum dsv4_err e;

    memset(dev, 0, sizeof(*dev));
    if (!cuda_is_backend(be))
        return dsv4_err_set(DSV4_ERR_INVAL, "cuda weights: not a CUDA backend");
    p = (struct cuda_wpriv *)calloc(1, sizeof(*p));
    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda weights: no memory");
    *dev = *host;
    dev->priv = p;
    p->n_layers = L;
    p->E = E;
    p->layers = (struct dsv4_layer_w *)calloc((size_t)L + 1, sizeof(*p->layers));
    p->experts = (struct dsv4_expert_w *)calloc(ne + 1, sizeof(*p->experts));
    if (p->layers == NULL || p->experts == NULL) {
        dsv4_cuda_weights_free(be, dev);
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda weights: no memory");
    }
    memcpy(p->layers, host->layers, (size_t)L * sizeof(*p->layers));
    dev->layers = p->layers;
    for (int l = 0; l < L; l++) {
        if (host->layers[l].experts == NULL)
            continue;
        memcpy(p->experts + (size_t)l * E, host->layers[l].experts, (size_t)E * sizeof(*p->experts));
        p->layers[l].experts = p->experts + (size_t)l * E;
    }

    memset(&wk, 0, sizeof(wk));
    wk.progress = pr;
    wk.layout = DSV4_WSHARE_FNV0;
    walk_all(&wk, dev);
    wk.total = wk.off;
    p->layout = wk.layout;
    wk.place_only = cuda_arena_import(a);
    log_info("cuda weights: %s %.2f GiB (%d layers, %d experts each)",
             wk.place_only ? "mapping" : "uploading", wk.total / GIB, L, E);
    e = cuda_arena_alloc(be, p, wk.total, a, "cuda weights");
    if (e != DSV4_OK) {
        dsv4_cuda_weights_free(be, dev);
        return e;
    }
    wk.pass = 1;
    wk.off = 0;
    wk.arena = p->arena;
    walk_all(&wk, dev);
    if (wk.err != DSV4_OK) {
        e = wk.err;
        dsv4_cuda_weights_free(be, dev);
        return e;
    }

    e = cuda_weights_tables(be, p);
    if (e != DSV4_OK) {
        dsv4_cuda_weights_free(be, dev);
        return e;
    }
    cuda_progress(pr, wk.total, wk.total);
    log_info("cuda weights: %.2f GiB on device %d", wk.total / GIB, cuda_st(be)->device);
    return DSV4_OK;
}
