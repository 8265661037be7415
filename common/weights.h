/*
 * weights.h — the model's weights as typed views, one struct per layer.
 *
 * dsv4_weights_load() opens a checkpoint directory, checks it against the
 * inventory implied by the config (every expected tensor present, with the
 * expected dtype and shape; no unexpected tensor; no NaN in any E8M0 scale)
 * and fills the structs with pointers into the read-only mappings (host
 * memory); a typed tensor (F32, BF16, I64) that the file leaves misaligned
 * for its element type is copied once into an aligned buffer owned by the
 * weights.  A backend that keeps weights elsewhere (CUDA) copies the struct
 * and replaces the pointers; the layout and meaning of each tensor stay those
 * of the checkpoint (model doc §2).
 */
#ifndef DSV4_COMMON_WEIGHTS_H
#define DSV4_COMMON_WEIGHTS_H

#include <stdint.h>

#include "common/err.h"
#include "common/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Storage format of a linear weight. */
enum dsv4_wfmt {
    DSV4_WFMT_BF16 = 0,  /* w: bf16 [n_out, n_in]; no scale */
    DSV4_WFMT_FP8,       /* w: E4M3 [n_out, n_in]; scale: E8M0 [n_out/128, n_in/128] */
    DSV4_WFMT_FP4,       /* w: E2M1 pairs [n_out, n_in/2]; scale: E8M0 [n_out, n_in/32] */
};

/* One Linear: y = x W^T.  Pointers are backend memory (host for the CPU
 * backend). */
struct dsv4_linear {
    const void *w;
    const uint8_t *scale;  /* NULL for bf16 */
    int32_t n_out;
    int32_t n_in;
    enum dsv4_wfmt fmt;
};

/* A routed or shared expert: SwiGLU w2(silu(w1 x) * w3 x). */
struct dsv4_expert_w {
    struct dsv4_linear w1;  /* gate [I, D] */
    struct dsv4_linear w3;  /* up   [I, D] */
    struct dsv4_linear w2;  /* down [D, I] */
};

/* Compressor of a CSA/HCA layer or of an indexer (model doc §3.3.4). */
struct dsv4_compressor_w {
    const float *ape;           /* F32 [ratio, c*dim] */
    struct dsv4_linear wkv;     /* bf16 [c*dim, D] */
    struct dsv4_linear wgate;   /* bf16 [c*dim, D] */
    const uint16_t *norm;       /* bf16 [dim] */
    int32_t ratio;              /* 4 or 128 */
    int32_t dim;                /* 512 (attention) or 128 (indexer) */
};

/* mHC parameters of one site (model doc §3.2). */
struct dsv4_hc_w {
    const float *fn;     /* F32 [(2+n)*n, n*D] (or [n, n*D] for hc_head) */
    const float *base;   /* F32 [(2+n)*n] (or [n]) */
    const float *scale;  /* F32 [3] (or [1]) */
};

/* The weights of one layer (main or MTP), pointing into the shards. */
struct dsv4_layer_w {
    int32_t id;                    /* layer id (MTP layers follow the main ones) */
    int32_t ratio;                 /* compress ratio: 0, 4, 128 */
    struct dsv4_hc_w hc_attn, hc_ffn;
    const uint16_t *attn_norm;     /* bf16 [D] */
    const uint16_t *ffn_norm;      /* bf16 [D] */

    /* attention */
    const float *attn_sink;        /* F32 [H] */
    struct dsv4_linear wq_a;       /* FP8 [Rq, D] */
    const uint16_t *q_norm;        /* bf16 [Rq] */
    struct dsv4_linear wq_b;       /* FP8 [H*Dh, Rq] */
    struct dsv4_linear wkv;        /* FP8 [Dh, D] */
    const uint16_t *kv_norm;       /* bf16 [Dh] */
    struct dsv4_linear wo_a;       /* FP8 [G*R, H*Dh/G] (run as bf16, model doc §2.3) */
    struct dsv4_linear wo_b;       /* FP8 [D, G*R] */
    struct dsv4_compressor_w compressor;      /* ratio > 0 */
    struct dsv4_linear idx_wq_b;              /* FP8 [nI*dI, Rq]; ratio == 4 */
    struct dsv4_linear idx_weights_proj;      /* bf16 [nI, D]; ratio == 4 */
    struct dsv4_compressor_w idx_compressor;  /* ratio == 4 */

    /* MoE */
    struct dsv4_linear gate;       /* bf16 [E, D] router */
    const float *gate_bias;        /* F32 [E]; NULL on hash layers */
    const int64_t *tid2eid;        /* I64 [V, k]; NULL on learned layers */
    struct dsv4_expert_w shared;   /* FP8 */
    struct dsv4_expert_w *experts; /* [E] FP4; array owned by dsv4_weights */

    /* MTP only (NULL/zero on main layers) */
    struct dsv4_linear e_proj, h_proj;        /* FP8 [D, D] */
    const uint16_t *enorm, *hnorm, *mtp_norm; /* bf16 [D] */
    struct dsv4_hc_w hc_head;                 /* [n, n*D], [n], [1] */
};

/* A model's weights, as loaded (dsv4_weights_load) or made on a device. */
struct dsv4_weights {
    struct dsv4_config cfg;
    const uint16_t *embed;   /* bf16 [V, D] */
    const uint16_t *head;    /* bf16 [V, D], or rows head_row0 .. of it (a group's rank) */
    /* The vocabulary rows of head held: [head_row0, head_row0 + head_rows);
     * head_rows 0 means all V (head_row0 0): every loader's default.  A
     * rank of a model group holds its slice (dsv4_shard_vocab,
     * common/weights_shard.h) and the group gathers the logits. */
    int32_t head_row0, head_rows;
    const uint16_t *norm;    /* bf16 [D] */
    struct dsv4_hc_w hc_head;
    int n_layers;            /* main + MTP */
    struct dsv4_layer_w *layers;
    /* The open checkpoint the weights were read from (dsv4_weights_load;
     * its shards stay mapped until dsv4_weights_free), for a fingerprint
     * of exactly the loaded weights (dsv4_ckpt_fingerprint_of,
     * common/weights_fp.h).  A shard view (dsv4_weights_shard) keeps its
     * source's; NULL for weights from anywhere else (synthetic). */
    const struct dsv4_ckpt *ckpt;
    void *priv;              /* loader state (open checkpoint, arrays) */
};

/*
 * Load `dir` (config.json + shards) and check it.  On error: DSV4_ERR_CONFIG
 * for config.json, DSV4_ERR_WEIGHTS for any tensor problem, with a message
 * naming file and tensor.  Free with dsv4_weights_free.
 */
enum dsv4_err dsv4_weights_load(struct dsv4_weights *w, const char *dir);
void dsv4_weights_free(struct dsv4_weights *w);

#ifdef __cplusplus
}
#endif
#endif
