/*
 * cuda_synth.cu — synthetic weights built directly in device memory
 * (dsv4_cuda_weights_synthetic, kernels/cuda_weights.h), for GPU machines
 * whose disk cannot hold a real-sized checkpoint.
 *
 * The tensors are those of the config's inventory (common/model_tensors.h):
 * the same names, dtypes, shapes and formats that dsv4-mkmodel writes and
 * dsv4_weights_load checks.  Each tensor gets a 256-byte aligned place in one
 * device allocation, in inventory order; its name is bound to the field of
 * struct dsv4_weights it fills (bind_* below), and a kernel generates its
 * values in place.
 *
 * Values follow dsv4-mkmodel's distributions (docs/mkmodel.md): FP8 linears
 * N(0, 1/sqrt(n_in)) quantized per 128x128 block with the power-of-two scale
 * 2^ceil(log2(amax/448)); FP4 experts the same per row per 32-group with
 * amax/6; bf16 linears N(0, 1/sqrt(n_in)); norms 1 + N(0, 0.1); embed
 * N(0, 1); head N(0, 2/sqrt(D)); hc fn N(0, 1/sqrt(nD)), base N(0, 0.5),
 * scale U[0.5, 1.5); sink N(0, 1); gate bias N(0, 0.1); ape N(0, 0.5);
 * tid2eid k distinct ids uniform in [0, E).  The generator is counter-based:
 * element i of tensor j draws from splitmix64 finalisers of (seed, j, i), so
 * every thread computes its values independently and the result does not
 * depend on the launch shape.  Normals are Box-Muller in double.
 *
 * dsv4_cuda_weights_synthetic_arena (kernels/cuda_share.h) builds the same
 * thing in a shareable arena, or only computes the layout and binds the
 * fields in another process's arena (import: no generation).  The layout
 * hash covers every tensor's (index, offset, bytes).
 */
#include "kernels/cuda_weights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/model_tensors.h"
#include "common/weights_share.h"
#include "common/weights_shard.h"
#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda_share.h"

#define GIB (1024.0 * 1024.0 * 1024.0)
#define SYN_THREADS 256

/* --- counter-based generator ------------------------------------------------ */

static __host__ __device__ __forceinline__ uint64_t
syn_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* 64 random bits for draw `i` of the stream `key`. */
static __device__ __forceinline__ uint64_t
syn_bits(uint64_t key, uint64_t i)
{
    return syn_mix(key ^ syn_mix(i * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull));
}

/* Uniform in [0, 1) with 53 bits. */
static __device__ __forceinline__ double
syn_uniform(uint64_t key, uint64_t i)
{
    return (double)(syn_bits(key, i) >> 11) * 0x1.0p-53;
}

/* Standard normal for element i (Box-Muller on draws 2i, 2i+1). */
static __device__ __forceinline__ double
syn_normal(uint64_t key, uint64_t i)
{
    double u = 1.0 - syn_uniform(key, 2 * i), v = syn_uniform(key, 2 * i + 1);

    return sqrt(-2.0 * log(u)) * cos(2.0 * 3.14159265358979323846 * v);
}

/* --- kernels ------------------------------------------------------------------ */

/* Plain F32 / BF16 tensor: mean + std * N(0,1), or mean + std * U[0,1). */
static __global__ void
syn_plain_kernel(void *out, int bf16, int64_t n, double mean, double std, int uniform,
                 uint64_t key, int64_t i0)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        double r = uniform ? syn_uniform(key, i0 + i) : syn_normal(key, i0 + i);
        float v = (float)(mean + std * r);

        if (bf16)
            ((uint16_t *)out)[i] = (uint16_t)(__float_as_uint(cu_bf16_round(v)) >> 16);
        else
            ((float *)out)[i] = v;
    }
}

/* E8M0 code of a power-of-two scale. */
static __device__ __forceinline__ uint8_t
syn_e8m0(float pow2)
{
    return (uint8_t)((__float_as_uint(pow2) >> 23) & 0xff);
}

/* FP8 weight [out, in], or its part [g0, g0 + out) x [c0, c0 + in) of a
 * tensor of `full` columns (g0, c0 multiples of 128): one block per 128x128
 * tile; element (r, c) draws N(0, std) at index (g0 + r)*full + c0 + c; the
 * tile's scale from its amax (the full tensor's tile: the same scale). */
static __global__ void
syn_fp8_kernel(uint8_t *w, uint8_t *scale, int64_t out, int64_t in, float std, uint64_t key,
               int64_t g0, int64_t c0, int64_t full)
{
    __shared__ float red[SYN_THREADS];
    int64_t r0 = (int64_t)blockIdx.x * 128, t0 = (int64_t)blockIdx.y * 128;
    int64_t rows = out - r0 < 128 ? out - r0 : 128, cols = in - t0 < 128 ? in - t0 : 128;
    int64_t nbc = (in + 127) / 128;
    float amax = 0.0f, sc;

    for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x) {
        int64_t r = r0 + e / cols, c = t0 + e % cols;
        amax = fmaxf(amax, fabsf((float)syn_normal(key, (g0 + r) * full + c0 + c) * std));
    }
    red[threadIdx.x] = amax;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s)
            red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    sc = cu_pow2_scale(fmaxf(red[0], 0x1.0p-100f), 448.0f);
    if (threadIdx.x == 0)
        scale[blockIdx.x * nbc + blockIdx.y] = syn_e8m0(sc);
    for (int64_t e = threadIdx.x; e < rows * cols; e += blockDim.x) {
        int64_t r = r0 + e / cols, c = t0 + e % cols;
        w[r * in + c] =
            cu_f32_to_fp8((float)syn_normal(key, (g0 + r) * full + c0 + c) * std / sc);
    }
}

/* FP4 expert weight, logical [out, in], or its part [g0, g0 + out) x
 * [c0, c0 + in) of a tensor of `full` columns (c0 a multiple of 32): one
 * thread per (row, 32-group); element (r, c) draws at index
 * (g0 + r)*full + c0 + c, so a part holds the full tensor's values. */
static __global__ void
syn_fp4_kernel(uint8_t *w, uint8_t *scale, int64_t out, int64_t in, float std, uint64_t key,
               int64_t g0, int64_t c0, int64_t full)
{
    int64_t ng = in / 32;

    for (int64_t g = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; g < out * ng;
         g += (int64_t)gridDim.x * blockDim.x) {
        int64_t base = (g0 + g / ng) * full + c0 + (g % ng) * 32;
        int64_t dst = (g / ng) * in + (g % ng) * 32;
        float v[32], amax = 0.0f, sc;

        for (int i = 0; i < 32; i++) {
            v[i] = (float)syn_normal(key, base + i) * std;
            amax = fmaxf(amax, fabsf(v[i]));
        }
        sc = cu_pow2_scale(fmaxf(amax, 0x1.0p-100f), 6.0f);
        scale[g] = syn_e8m0(sc);
        for (int i = 0; i < 32; i += 2)
            w[dst / 2 + i / 2] = (uint8_t)(cu_f32_to_fp4(v[i] / sc) |
                                           (cu_f32_to_fp4(v[i + 1] / sc) << 4));
    }
}

/* tid2eid [V, k]: per row k distinct ids uniform in [0, E) (rejection). */
static __global__ void
syn_tid2eid_kernel(int64_t *out, int64_t V, int k, int E, uint64_t key)
{
    for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < V;
         t += (int64_t)gridDim.x * blockDim.x) {
        uint64_t draw = 0;

        for (int j = 0; j < k; j++) {
            int64_t id;
            int dup;

            do {
                id = (int64_t)(syn_bits(key, (uint64_t)t * 4096 + draw++) % (uint64_t)E);
                dup = 0;
                for (int q = 0; q < j; q++)
                    dup |= out[t * k + q] == id;
            } while (dup);
            out[t * k + j] = id;
        }
    }
}

/* --- binding names to struct fields ---------------------------------------- */

struct syn_ctx {
    struct dsv4_weights *w;
    struct cuda_wpriv *p;
    const struct dsv4_config *cfg;
};

/* The linear named `base` (without ".weight"/".scale") of layer lw. */
static struct dsv4_linear *
bind_layer_linear(struct dsv4_layer_w *lw, const char *base)
{
    static const struct {
        const char *name;
        size_t off;
    } tab[] = {
        { "attn.wq_a", offsetof(struct dsv4_layer_w, wq_a) },
        { "attn.wq_b", offsetof(struct dsv4_layer_w, wq_b) },
        { "attn.wkv", offsetof(struct dsv4_layer_w, wkv) },
        { "attn.wo_a", offsetof(struct dsv4_layer_w, wo_a) },
        { "attn.wo_b", offsetof(struct dsv4_layer_w, wo_b) },
        { "attn.compressor.wkv", offsetof(struct dsv4_layer_w, compressor.wkv) },
        { "attn.compressor.wgate", offsetof(struct dsv4_layer_w, compressor.wgate) },
        { "attn.indexer.wq_b", offsetof(struct dsv4_layer_w, idx_wq_b) },
        { "attn.indexer.weights_proj", offsetof(struct dsv4_layer_w, idx_weights_proj) },
        { "attn.indexer.compressor.wkv", offsetof(struct dsv4_layer_w, idx_compressor.wkv) },
        { "attn.indexer.compressor.wgate",
          offsetof(struct dsv4_layer_w, idx_compressor.wgate) },
        { "ffn.gate", offsetof(struct dsv4_layer_w, gate) },
        { "ffn.shared_experts.w1", offsetof(struct dsv4_layer_w, shared.w1) },
        { "ffn.shared_experts.w2", offsetof(struct dsv4_layer_w, shared.w2) },
        { "ffn.shared_experts.w3", offsetof(struct dsv4_layer_w, shared.w3) },
        { "e_proj", offsetof(struct dsv4_layer_w, e_proj) },
        { "h_proj", offsetof(struct dsv4_layer_w, h_proj) },
    };
    int e, which, n;

    for (size_t i = 0; i < sizeof(tab) / sizeof(tab[0]); i++)
        if (strcmp(base, tab[i].name) == 0)
            return (struct dsv4_linear *)((char *)lw + tab[i].off);
    if (sscanf(base, "ffn.experts.%d.w%d%n", &e, &which, &n) == 2 && base[n] == '\0' &&
        lw->experts != NULL) {
        struct dsv4_expert_w *x = &lw->experts[e];
        return which == 1 ? &x->w1 : which == 2 ? &x->w2 : which == 3 ? &x->w3 : NULL;
    }
    return NULL;
}

/* A non-linear tensor field of layer lw. */
static const void **
bind_layer_field(struct dsv4_layer_w *lw, const char *name)
{
    static const struct {
        const char *name;
        size_t off;
    } tab[] = {
        { "hc_attn_fn", offsetof(struct dsv4_layer_w, hc_attn.fn) },
        { "hc_attn_base", offsetof(struct dsv4_layer_w, hc_attn.base) },
        { "hc_attn_scale", offsetof(struct dsv4_layer_w, hc_attn.scale) },
        { "hc_ffn_fn", offsetof(struct dsv4_layer_w, hc_ffn.fn) },
        { "hc_ffn_base", offsetof(struct dsv4_layer_w, hc_ffn.base) },
        { "hc_ffn_scale", offsetof(struct dsv4_layer_w, hc_ffn.scale) },
        { "hc_head_fn", offsetof(struct dsv4_layer_w, hc_head.fn) },
        { "hc_head_base", offsetof(struct dsv4_layer_w, hc_head.base) },
        { "hc_head_scale", offsetof(struct dsv4_layer_w, hc_head.scale) },
        { "attn_norm.weight", offsetof(struct dsv4_layer_w, attn_norm) },
        { "ffn_norm.weight", offsetof(struct dsv4_layer_w, ffn_norm) },
        { "attn.attn_sink", offsetof(struct dsv4_layer_w, attn_sink) },
        { "attn.q_norm.weight", offsetof(struct dsv4_layer_w, q_norm) },
        { "attn.kv_norm.weight", offsetof(struct dsv4_layer_w, kv_norm) },
        { "attn.compressor.ape", offsetof(struct dsv4_layer_w, compressor.ape) },
        { "attn.compressor.norm.weight", offsetof(struct dsv4_layer_w, compressor.norm) },
        { "attn.indexer.compressor.ape", offsetof(struct dsv4_layer_w, idx_compressor.ape) },
        { "attn.indexer.compressor.norm.weight",
          offsetof(struct dsv4_layer_w, idx_compressor.norm) },
        { "ffn.gate.bias", offsetof(struct dsv4_layer_w, gate_bias) },
        { "ffn.gate.tid2eid", offsetof(struct dsv4_layer_w, tid2eid) },
        { "enorm.weight", offsetof(struct dsv4_layer_w, enorm) },
        { "hnorm.weight", offsetof(struct dsv4_layer_w, hnorm) },
        { "norm.weight", offsetof(struct dsv4_layer_w, mtp_norm) },
    };

    for (size_t i = 0; i < sizeof(tab) / sizeof(tab[0]); i++)
        if (strcmp(name, tab[i].name) == 0)
            return (const void **)((char *)lw + tab[i].off);
    return NULL;
}

/* Point the field named s->name at device address `at`; 0 when bound. */
static int
bind(struct syn_ctx *c, const struct dsv4_tensor_spec *s, const void *at)
{
    struct dsv4_weights *w = c->w;
    struct dsv4_layer_w *lw = NULL;
    const char *name = s->name;
    char base[96];
    size_t n;
    int id, k;

    if (sscanf(name, "layers.%d.%n", &id, &k) == 1 && k > 0) {
        lw = id >= 0 && id < c->cfg->num_hidden_layers ? &w->layers[id] : NULL;
        name += k;
    } else if (sscanf(name, "mtp.%d.%n", &id, &k) == 1 && k > 0) {
        id += c->cfg->num_hidden_layers;
        lw = id < w->n_layers ? &w->layers[id] : NULL;
        name += k;
    } else {
        const void **f = NULL;

        if (strcmp(name, "embed.weight") == 0)
            f = (const void **)&w->embed;
        else if (strcmp(name, "head.weight") == 0)
            f = (const void **)&w->head;
        else if (strcmp(name, "norm.weight") == 0)
            f = (const void **)&w->norm;
        else if (strcmp(name, "hc_head_fn") == 0)
            f = (const void **)&w->hc_head.fn;
        else if (strcmp(name, "hc_head_base") == 0)
            f = (const void **)&w->hc_head.base;
        else if (strcmp(name, "hc_head_scale") == 0)
            f = (const void **)&w->hc_head.scale;
        if (f == NULL)
            return -1;
        *f = at;
        return 0;
    }
    if (lw == NULL)
        return -1;
    n = strlen(name);
    if (s->kind == DSV4_TK_FP8_WEIGHT || s->kind == DSV4_TK_FP4_WEIGHT ||
        s->kind == DSV4_TK_LINEAR_BF16 || s->kind == DSV4_TK_FP8_SCALE ||
        s->kind == DSV4_TK_FP4_SCALE) {
        int is_scale = s->kind == DSV4_TK_FP8_SCALE || s->kind == DSV4_TK_FP4_SCALE;
        const char *suffix = is_scale ? ".scale" : ".weight";
        size_t ls = strlen(suffix);
        struct dsv4_linear *L;

        if (n <= ls || n - ls >= sizeof(base) || strcmp(name + n - ls, suffix) != 0)
            return -1;
        memcpy(base, name, n - ls);
        base[n - ls] = '\0';
        L = bind_layer_linear(lw, base);
        if (L == NULL)
            return -1;
        if (is_scale) {
            L->scale = (const uint8_t *)at;
            return 0;
        }
        L->w = at;
        L->n_out = (int32_t)s->shape[0];
        L->n_in = (int32_t)(s->kind == DSV4_TK_FP4_WEIGHT ? 2 * s->shape[1] : s->shape[1]);
        L->fmt = s->kind == DSV4_TK_FP8_WEIGHT ? DSV4_WFMT_FP8 :
                 s->kind == DSV4_TK_FP4_WEIGHT ? DSV4_WFMT_FP4 : DSV4_WFMT_BF16;
        return 0;
    }
    const void **f = bind_layer_field(lw, name);
    if (f == NULL)
        return -1;
    *f = at;
    if (strcmp(name, "attn.compressor.norm.weight") == 0)
        lw->compressor.dim = (int32_t)s->shape[0];
    if (strcmp(name, "attn.indexer.compressor.norm.weight") == 0)
        lw->idx_compressor.dim = (int32_t)s->shape[0];
    return 0;
}

/* --- generation ------------------------------------------------------------------ */

/* Generate tensor `idx` at `at`, whose shape `s` is this rank's part `pt`
 * of a tensor of `full1` columns; `scale_at`: its scale tensor's place (FP8
 * / FP4 weights). */
static enum dsv4_err
generate(struct dsv4_backend *be, const struct dsv4_config *cfg, const struct dsv4_tensor_spec *s,
         int idx, uint64_t seed, void *at, void *scale_at, const struct dsv4_shard_part *pt,
         int64_t full1)
{
    cudaStream_t st = cuda_stream(be);
    uint64_t key = seed ^ syn_mix((uint64_t)idx + 0x51ed270b27f3a1c5ull);
    int64_t n = (int64_t)(dsv4_tensor_spec_bytes(s) / dsv4_st_dtype_size(s->dtype));
    int64_t row0 = pt->row0;
    double in_std = s->n_dims == 2 ? 1.0 / sqrt((double)full1) : 1.0;
    double mean = 0, std = 1;
    int uniform = 0;
    unsigned grid = cuda_blocks(n, SYN_THREADS);

    if (grid > 65536)
        grid = 65536;
    if (s->kind != DSV4_TK_FP8_WEIGHT && s->kind != DSV4_TK_FP4_WEIGHT &&
        s->kind != DSV4_TK_FP8_SCALE && s->kind != DSV4_TK_FP4_SCALE && pt->cols != full1)
        return dsv4_err_set(DSV4_ERR_INVAL, "synthetic weights: %s: a column slice of a "
                            "tensor that is not an FP8 / FP4 weight", s->name);
    switch (s->kind) {
    case DSV4_TK_FP8_WEIGHT: {
        dim3 g((unsigned)((s->shape[0] + 127) / 128), (unsigned)((s->shape[1] + 127) / 128));
        syn_fp8_kernel<<<g, SYN_THREADS, 0, st>>>((uint8_t *)at, (uint8_t *)scale_at,
                                                  s->shape[0], s->shape[1], (float)in_std,
                                                  key, row0, pt->col0, full1);
        CUDA_LAUNCHED("synthetic fp8");
        return DSV4_OK;
    }
    case DSV4_TK_FP4_WEIGHT: {
        int64_t in = 2 * s->shape[1], groups = s->shape[0] * (in / 32);
        unsigned g4 = cuda_blocks(groups, 128);

        syn_fp4_kernel<<<g4 > 65536 ? 65536 : g4, 128, 0, st>>>(
            (uint8_t *)at, (uint8_t *)scale_at, s->shape[0], in,
            (float)(1.0 / sqrt((double)(2 * full1))), key, row0, 2 * pt->col0, 2 * full1);
        CUDA_LAUNCHED("synthetic fp4");
        return DSV4_OK;
    }
    case DSV4_TK_FP8_SCALE:
    case DSV4_TK_FP4_SCALE:
        return DSV4_OK;   /* written with the weight */
    case DSV4_TK_TID2EID:
        syn_tid2eid_kernel<<<cuda_blocks(s->shape[0], SYN_THREADS), SYN_THREADS, 0, st>>>(
            (int64_t *)at, s->shape[0], (int)s->shape[1], cfg->n_routed_experts, key);
        CUDA_LAUNCHED("synthetic tid2eid");
        return DSV4_OK;
    case DSV4_TK_EMBED:
    case DSV4_TK_SINK:
        break;
    case DSV4_TK_HEAD:
        std = 2.0 * in_std;
        break;
    case DSV4_TK_NORM:
        mean = 1.0, std = 0.1;
        break;
    case DSV4_TK_LINEAR_BF16:
    case DSV4_TK_HC_FN:
        std = in_std;
        break;
    case DSV4_TK_HC_BASE:
    case DSV4_TK_APE:
        std = 0.5;
        break;
    case DSV4_TK_HC_SCALE:
        mean = 0.5, std = 1.0, uniform = 1;
        break;
    case DSV4_TK_GATE_BIAS:
        std = 0.1;
        break;
    default:
        return dsv4_err_set(DSV4_ERR_INVAL, "synthetic weights: %s: unknown kind %d", s->name,
                            (int)s->kind);
    }
    if (s->dtype != DSV4_ST_F32 && s->dtype != DSV4_ST_BF16)
        return dsv4_err_set(DSV4_ERR_INVAL, "synthetic weights: %s: unexpected dtype",
                            s->name);
    syn_plain_kernel<<<grid, SYN_THREADS, 0, st>>>(at, s->dtype == DSV4_ST_BF16, n, mean, std,
                                                   uniform, key,
                                                   row0 * (s->shape[0] > 0 ? n / s->shape[0]
                                                                           : 0));
    CUDA_LAUNCHED("synthetic plain");
    return DSV4_OK;
}

extern "C" enum dsv4_err
dsv4_cuda_weights_synthetic(struct dsv4_backend *be, struct dsv4_weights *dev,
                            const struct dsv4_config *cfg, uint64_t seed,
                            const struct dsv4_cuda_progress *pr)
{
    return dsv4_cuda_weights_synthetic_shard(be, dev, cfg, seed, 0, 1, DSV4_GROUP_SPLIT_EP, pr);
}

extern "C" enum dsv4_err
dsv4_cuda_weights_synthetic_shard(struct dsv4_backend *be, struct dsv4_weights *dev,
                                  const struct dsv4_config *cfg, uint64_t seed, int rank,
                                  int size, enum dsv4_group_split split,
                                  const struct dsv4_cuda_progress *pr)
{
    return dsv4_cuda_weights_synthetic_arena(be, dev, cfg, seed, rank, size, split, pr, NULL);
}

extern "C" enum dsv4_err
dsv4_cuda_weights_synthetic_arena(struct dsv4_backend *be, struct dsv4_weights *dev,
                                  const struct dsv4_config *cfg, uint64_t seed, int rank,
                                  int size, enum dsv4_group_split split,
                                  const struct dsv4_cuda_progress *pr,
                                  const struct dsv4_cuda_arena *a)
{
    struct dsv4_inventory inv;
    struct cuda_wpriv *p;
    struct syn_ctx c;
    size_t *off = NULL, total = 0, logged = 0;
    struct dsv4_shard_part *pt = NULL;
    int64_t *full1 = NULL;
    int L, E, place_only = cuda_arena_import(a);
    uint64_t layout = DSV4_WSHARE_FNV0;
    enum dsv4_err e;
    cudaError_t rc;

    memset(dev, 0, sizeof(*dev));
    if (!cuda_is_backend(be))
        return dsv4_err_set(DSV4_ERR_INVAL, "synthetic weights: not a CUDA backend");
    if (rank < 0 || rank >= size)
        return dsv4_err_set(DSV4_ERR_INVAL, "synthetic weights: rank %d of %d", rank, size);
    e = dsv4_shard_check(cfg, size, split);
    if (e != DSV4_OK)
        return e;
    e = dsv4_inventory_build(&inv, cfg);
    if (e != DSV4_OK)
        return e;
    L = cfg->num_hidden_layers + dsv4_config_n_mtp(cfg);
    E = cfg->n_routed_experts;
    p = (struct cuda_wpriv *)calloc(1, sizeof(*p));
    off = (size_t *)calloc((size_t)inv.n + 1, sizeof(*off));
    pt = (struct dsv4_shard_part *)calloc((size_t)inv.n + 1, sizeof(*pt));
    full1 = (int64_t *)calloc((size_t)inv.n + 1, sizeof(*full1));
    if (p == NULL || off == NULL || pt == NULL || full1 == NULL) {
        free(p);
        free(off);
        free(pt);
        free(full1);
        dsv4_inventory_free(&inv);
        return dsv4_err_set(DSV4_ERR_NOMEM, "synthetic weights: no memory");
    }
    dev->cfg = *cfg;
    dev->n_layers = L;
    dev->priv = p;
    p->n_layers = L;
    p->E = E;
    p->layers = (struct dsv4_layer_w *)calloc((size_t)L + 1, sizeof(*p->layers));
    p->experts = (struct dsv4_expert_w *)calloc((size_t)L * E + 1, sizeof(*p->experts));
    if (p->layers == NULL || p->experts == NULL) {
        e = dsv4_err_set(DSV4_ERR_NOMEM, "synthetic weights: no memory");
        goto fail;
    }
    dev->layers = p->layers;
    for (int l = 0; l < L; l++) {
        struct dsv4_layer_w *lw = &p->layers[l];

        lw->id = l;
        lw->ratio = cfg->compress_ratios[l];
        lw->experts = E > 0 ? p->experts + (size_t)l * E : NULL;
        lw->compressor.ratio = lw->idx_compressor.ratio = lw->ratio;
    }
    /* this rank's part: tensors not held get no place (row count 0), a
     * slice gets the shape of its rows and columns (common/weights_shard.h) */
    for (int i = 0; i < inv.n; i++) {
        struct dsv4_tensor_spec *s = &inv.t[i];
        int64_t shape1 = s->n_dims == 2 ? s->shape[1] : 1;

        full1[i] = shape1;
        if (!dsv4_shard_part(cfg, s->name, rank, size, split, s->shape[0], shape1, &pt[i]))
            pt[i].row0 = -1, pt[i].rows = 0;
        if (size > 1 && strcmp(s->name, "head.weight") == 0) {   /* a vocabulary slice */
            dev->head_row0 = (int32_t)pt[i].row0;
            dev->head_rows = (int32_t)pt[i].rows;
        }
        s->shape[0] = pt[i].rows;
        if (s->n_dims == 2)
            s->shape[1] = pt[i].cols;
        off[i] = total;
        total += pt[i].rows > 0 ? cuda_align(dsv4_tensor_spec_bytes(s)) : 0;
        {
            uint64_t place[3] = { (uint64_t)i, off[i],
                                  pt[i].rows > 0 ? dsv4_tensor_spec_bytes(s) : 0 };

            layout = dsv4_wshare_hash(layout, place, sizeof(place));
        }
    }
    p->layout = layout;
    log_info("synthetic weights: %s %.2f GiB (%d layers, %d experts each), seed %llu, rank %d "
             "of %d, group split %s", place_only ? "mapping" : "generating", total / GIB, L,
             E, (unsigned long long)seed, rank, size, dsv4_group_split_name(split));
    e = cuda_arena_alloc(be, p, total, a, "synthetic weights");
    if (e != DSV4_OK)
        goto fail;
    c.w = dev;
    c.p = p;
    c.cfg = cfg;
    for (int i = 0; i < inv.n; i++) {
        const struct dsv4_tensor_spec *s = &inv.t[i];
        void *scale_at = NULL;

        if (pt[i].row0 < 0)
            continue;   /* held by another rank */
        if (bind(&c, s, p->arena + off[i]) != 0) {
            e = dsv4_err_set(DSV4_ERR_WEIGHTS, "synthetic weights: tensor '%s' has no place "
                             "in struct dsv4_weights", s->name);
            goto fail;
        }
        if (s->kind == DSV4_TK_FP8_WEIGHT || s->kind == DSV4_TK_FP4_WEIGHT) {
            /* the inventory puts each scale right after its weight */
            const struct dsv4_tensor_spec *sc = i + 1 < inv.n ? &inv.t[i + 1] : NULL;
            size_t nl = strlen(s->name);

            if (sc == NULL || nl < 7 || strncmp(sc->name, s->name, nl - 7) != 0 ||
                strcmp(sc->name + nl - 7, ".scale") != 0) {
                e = dsv4_err_set(DSV4_ERR_WEIGHTS, "synthetic weights: '%s' is not followed "
                                 "by its scale", s->name);
                goto fail;
            }
            scale_at = p->arena + off[i + 1];
        }
        if (place_only)
            continue;   /* the owner generated them */
        e = generate(be, cfg, s, i, seed, p->arena + off[i], scale_at, &pt[i], full1[i]);
        if (e != DSV4_OK)
            goto fail;
        if (off[i] - logged >= (size_t)GIB) {
            rc = cudaStreamSynchronize(cuda_stream(be));
            if (rc != cudaSuccess) {
                e = cuda_err(rc, "synthetic weights", __FILE__, __LINE__);
                goto fail;
            }
            logged = off[i];
            log_info("synthetic weights: %.1f of %.1f GiB generated", logged / GIB,
                     total / GIB);
            cuda_progress(pr, logged, total);
        }
    }
    rc = cudaStreamSynchronize(cuda_stream(be));
    if (rc != cudaSuccess) {
        e = cuda_err(rc, "synthetic weights", __FILE__, __LINE__);
        goto fail;
    }
    e = cuda_weights_tables(be, p);
    if (e != DSV4_OK)
        goto fail;
    cuda_progress(pr, total, total);
    log_info("synthetic weights: %.2f GiB on device %d%s", total / GIB, cuda_st(be)->device,
             place_only ? " (mapped)" : "");
    free(off);
    free(pt);
    free(full1);
    dsv4_inventory_free(&inv);
    return DSV4_OK;
fail:
    free(off);
    free(pt);
    free(full1);
    dsv4_inventory_free(&inv);
    dsv4_cuda_weights_free(be, dev);
    return e;
}
