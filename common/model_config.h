/*
 * model_config.h — DeepSeek-V4 hyperparameters: parse and validate the root
 * config.json of a checkpoint (HF form, model doc §1.1), presets, and writing
 * config.json back (used by dsv4-mkmodel).
 *
 * Every field of model doc §1.1 is parsed.  Unknown model_type, a missing
 * required field, a wrong JSON type, an out-of-range value or fields that
 * contradict each other give DSV4_ERR_CONFIG with a message naming the field.
 */
#ifndef DSV4_COMMON_MODEL_CONFIG_H
#define DSV4_COMMON_MODEL_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_MAX_LAYERS 128       /* main layers + MTP layers */
#define DSV4_MAX_EXPERTS 4096     /* n_routed_experts (the CUDA router's bound) */
#define DSV4_MAX_TOPK 64          /* num_experts_per_tok (the routers' bound) */
#define DSV4_HC_MAX 8             /* hc_mult bound (4 in the real model) */

/* Attention type of a layer, from its compress ratio (model doc §1.4). */
enum dsv4_attn_type {
    DSV4_ATTN_SWA = 0,   /* ratio 0: sliding window only */
    DSV4_ATTN_CSA = 4,   /* ratio 4: overlapping compressor + indexer top-k */
    DSV4_ATTN_HCA = 128, /* ratio 128: non-overlapping compressor, all entries */
};

/* A checkpoint's config.json, parsed and checked (dsv4_config_load). */
struct dsv4_config {
    /* identity */
    char model_type[32];          /* must be "deepseek_v4" */
    char architecture[64];        /* architectures[0], "DeepseekV4ForCausalLM" */
    char torch_dtype[16];         /* "bfloat16" */
    char transformers_version[32];
    char hidden_act[16];          /* "silu" */
    char scoring_func[16];        /* "sqrtsoftplus" (only one supported) */
    char topk_method[16];         /* "noaux_tc" */
    char expert_dtype[8];         /* "fp4" or "" when absent (initial revision) */

    /* sizes */
    int32_t vocab_size;           /* V */
    int32_t hidden_size;          /* D */
    int32_t num_hidden_layers;    /* L (main layers; MTP layers come after) */
    int32_t num_attention_heads;  /* H */
    int32_t num_key_value_heads;  /* must be 1 (K = V, one shared head) */
    int32_t head_dim;             /* Dh = nope + rope */
    int32_t qk_rope_head_dim;     /* rd, RoPE on the LAST rd dims */
    int32_t q_lora_rank;          /* Rq */
    int32_t o_groups;             /* G */
    int32_t o_lora_rank;          /* per-group rank */
    int32_t sliding_window;       /* window (128) */
    int32_t compress_ratios[DSV4_MAX_LAYERS]; /* L + n_mtp entries: 0, 4, 128 */
    int32_t n_compress_ratios;    /* entries present in the file */
    int32_t index_n_heads;
    int32_t index_head_dim;       /* must be 128 (Hadamard-128) */
    int32_t index_topk;
    int32_t n_routed_experts;     /* E */
    int32_t num_experts_per_tok;  /* k */
    int32_t n_shared_experts;     /* must be 1 */
    int32_t moe_intermediate_size;/* I */
    int32_t num_hash_layers;      /* first layers routed by tid2eid */
    int32_t hc_mult;              /* n streams (4) */
    int32_t hc_sinkhorn_iters;
    int32_t num_nextn_predict_layers; /* MTP layers (1) */
    int64_t max_position_embeddings;
    int32_t bos_token_id;
    int32_t eos_token_id;

    /* floats */
    double rope_theta;            /* SWA layers */
    double compress_rope_theta;   /* CSA/HCA layers (with YaRN) */
    double rope_factor;           /* rope_scaling.factor */
    int64_t rope_original_max_pos;/* rope_scaling.original_max_position_embeddings */
    double rope_beta_fast;
    double rope_beta_slow;
    double routed_scaling_factor;
    double swiglu_limit;
    double hc_eps;
    double rms_norm_eps;
    double initializer_range;
    double attention_dropout;

    /* booleans */
    int norm_topk_prob;
    int tie_word_embeddings;      /* must be false */
    int attention_bias;           /* must be false */
    int use_cache;

    /* quantization_config */
    char quant_method[8];         /* "fp8" */
    char quant_fmt[8];            /* "e4m3" */
    char quant_activation_scheme[16]; /* "dynamic" */
    char quant_scale_fmt[8];      /* "ue8m0" */
    int32_t weight_block[2];      /* [128, 128] */
};

/* Parse `path` (a config.json, a regular file: a FIFO or a directory is
 * refused at once, DSV4_ERR_CONFIG).  On failure returns DSV4_ERR_CONFIG (or
 * DSV4_ERR_SYS if unreadable) with a message naming file and field. */
enum dsv4_err dsv4_config_load(struct dsv4_config *cfg, const char *path);

/* Parse a config.json held in memory (`name` is used in messages). */
enum dsv4_err dsv4_config_parse(struct dsv4_config *cfg, const char *json, size_t len,
                                const char *name);

/* Check the invariants between fields (called by load/parse; exposed for
 * presets and tests).  Message names the offending field. */
enum dsv4_err dsv4_config_validate(const struct dsv4_config *cfg);

/* Fill `cfg` with a named preset: "flash" (the real DeepSeek-V4-Flash),
 * "small" (CPU-sized, same structure), "tiny" (smaller still, test-sized
 * vocab).  Returns DSV4_ERR_INVAL for an unknown name. */
enum dsv4_err dsv4_config_preset(struct dsv4_config *cfg, const char *name);

/*
 * Apply overrides "key=value" (n of them) to `cfg`, then re-parse and
 * re-validate the result as a whole (so several related fields can change
 * together, e.g. num_hidden_layers and compress_ratios).  `key` is a config.json
 * key, or "section.key" inside rope_scaling / quantization_config; `value` is
 * JSON (number, list, true/false; null removes the key) or else taken as a
 * string.  On failure `cfg` is unchanged and the message names the field.
 * Used by `dsv4-mkmodel --set`.
 */
enum dsv4_err dsv4_config_override(struct dsv4_config *cfg, int n, const char *const *assign);

/* Write `cfg` as a root config.json in the official HF form.  Returns
 * DSV4_ERR_SYS on I/O failure. */
enum dsv4_err dsv4_config_write(const struct dsv4_config *cfg, const char *path);

/* `cfg` as compact JSON of the HF form, every field in the table's order:
 * one text for one configuration, whatever the spelling of the file it came
 * from (the model fingerprint hashes it, weights_fp.h).  Allocated: the
 * caller frees it; NULL when out of memory. */
char *dsv4_config_text(const struct dsv4_config *cfg);

/* Number of MTP layers (num_nextn_predict_layers). */
static inline int dsv4_config_n_mtp(const struct dsv4_config *c)
{
    return c->num_nextn_predict_layers;
}

/* Attention type of layer `layer` (0 .. L + n_mtp - 1). */
static inline enum dsv4_attn_type dsv4_config_attn(const struct dsv4_config *c, int layer)
{
    return (enum dsv4_attn_type)c->compress_ratios[layer];
}

/* True if MoE layer `layer` routes by the token-id hash table. */
static inline int dsv4_config_is_hash(const struct dsv4_config *c, int layer)
{
    return layer < c->num_hash_layers;
}

#ifdef __cplusplus
}
#endif
#endif
