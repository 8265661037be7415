/*
 * model_config.c — parse, validate, override and write the root config.json
 * of a DeepSeek-V4 checkpoint (model doc §1.1), and the named presets.
 *
 * One table (cfg_fields) lists every key of §1.1 in the order of the official
 * file, with its JSON type, where it lives in struct dsv4_config and whether
 * it is required.  The parser, the writer and the "--set key=value" override
 * path all walk that table, so the three cannot drift apart.
 *
 * Optional keys that are absent take the value of the real model (the flash
 * preset, which equals the defaults of model doc §1.2), except expert_dtype
 * and transformers_version which stay empty.  JSON null counts as absent.
 * Keys that are not in the table are ignored (HF configs carry many).
 */
#include "common/model_config.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "common/file_open.h"
#include "common/json_keys.h"

/* JSON object a key lives in. */
enum cfg_sect {
    SECT_ROOT = 0,
    SECT_ROPE,      /* rope_scaling */
    SECT_QUANT,     /* quantization_config */
    SECT__COUNT
};

/* How a key is stored. */
enum cfg_type {
    T_I32,          /* int32_t */
    T_I64,          /* int64_t */
    T_F64,          /* double (JSON int or double) */
    T_BOOL,         /* int, JSON true/false */
    T_STR,          /* char[size] */
    T_ARCH,         /* architectures: list of strings, [0] kept */
    T_RATIOS,       /* compress_ratios: list of ints */
    T_BLOCK,        /* weight_block_size: list of 2 ints */
    T_OBJ,          /* opens section `sub` */
};

struct cfg_field {
    const char *key;
    const char *alias;      /* accepted instead of key when key is absent */
    enum cfg_sect sect;
    enum cfg_type type;
    size_t off;
    size_t size;            /* T_STR: buffer size */
    int required;
    enum cfg_sect sub;      /* T_OBJ: the section it opens */
};

#define OFF(f) offsetof(struct dsv4_config, f)
#define SZ(f) sizeof(((struct dsv4_config *)0)->f)
#define FI(k, t, f, req) { k, NULL, SECT_ROOT, t, OFF(f), 0, req, SECT_ROOT }
#define FS(k, f, req) { k, NULL, SECT_ROOT, T_STR, OFF(f), SZ(f), req, SECT_ROOT }

/* Every key of model doc §1.1, in the order of the official file. */
static const struct cfg_field cfg_fields[] = {
    { "architectures", NULL, SECT_ROOT, T_ARCH, OFF(architecture), SZ(architecture), 0,
      SECT_ROOT },
    FS("model_type", model_type, 1),
    FI("vocab_size", T_I32, vocab_size, 1),
    FI("hidden_size", T_I32, hidden_size, 1),
    FI("num_hidden_layers", T_I32, num_hidden_layers, 1),
    FI("num_attention_heads", T_I32, num_attention_heads, 1),
    FI("num_key_value_heads", T_I32, num_key_value_heads, 1),
    FI("head_dim", T_I32, head_dim, 1),
    FI("qk_rope_head_dim", T_I32, qk_rope_head_dim, 1),
    FI("q_lora_rank", T_I32, q_lora_rank, 1),
    FI("o_groups", T_I32, o_groups, 1),
    FI("o_lora_rank", T_I32, o_lora_rank, 1),
    FI("sliding_window", T_I32, sliding_window, 1),
    FI("compress_ratios", T_RATIOS, compress_ratios, 1),
    FI("compress_rope_theta", T_F64, compress_rope_theta, 0),
    FI("rope_theta", T_F64, rope_theta, 0),
    { "rope_scaling", NULL, SECT_ROOT, T_OBJ, 0, 0, 0, SECT_ROPE },
    { "type", "rope_type", SECT_ROPE, T_STR, 0, 0, 0, SECT_ROOT },  /* must be "yarn" */
    { "factor", NULL, SECT_ROPE, T_F64, OFF(rope_factor), 0, 0, SECT_ROOT },
    { "original_max_position_embeddings", NULL, SECT_ROPE, T_I64, OFF(rope_original_max_pos), 0,
      0, SECT_ROOT },
    { "beta_fast", NULL, SECT_ROPE, T_F64, OFF(rope_beta_fast), 0, 0, SECT_ROOT },
    { "beta_slow", NULL, SECT_ROPE, T_F64, OFF(rope_beta_slow), 0, 0, SECT_ROOT },
    FI("max_position_embeddings", T_I64, max_position_embeddings, 0),
    FI("index_n_heads", T_I32, index_n_heads, 1),
    FI("index_head_dim", T_I32, index_head_dim, 1),
    FI("index_topk", T_I32, index_topk, 1),
    FI("n_routed_experts", T_I32, n_routed_experts, 1),
    FI("num_experts_per_tok", T_I32, num_experts_per_tok, 1),
    FI("n_shared_experts", T_I32, n_shared_experts, 0),
    FI("moe_intermediate_size", T_I32, moe_intermediate_size, 1),
    FI("routed_scaling_factor", T_F64, routed_scaling_factor, 0),
    FS("scoring_func", scoring_func, 0),
    FS("topk_method", topk_method, 0),
    FI("norm_topk_prob", T_BOOL, norm_topk_prob, 0),
    FI("num_hash_layers", T_I32, num_hash_layers, 1),
    FI("swiglu_limit", T_F64, swiglu_limit, 0),
    FI("hc_mult", T_I32, hc_mult, 1),
    FI("hc_sinkhorn_iters", T_I32, hc_sinkhorn_iters, 0),
    FI("hc_eps", T_F64, hc_eps, 0),
    FI("rms_norm_eps", T_F64, rms_norm_eps, 0),
    FI("num_nextn_predict_layers", T_I32, num_nextn_predict_layers, 0),
    FS("hidden_act", hidden_act, 0),
    FI("attention_bias", T_BOOL, attention_bias, 0),
    FI("attention_dropout", T_F64, attention_dropout, 0),
    FI("initializer_range", T_F64, initializer_range, 0),
    FI("tie_word_embeddings", T_BOOL, tie_word_embeddings, 0),
    FI("bos_token_id", T_I32, bos_token_id, 0),
    FI("eos_token_id", T_I32, eos_token_id, 0),
    { "torch_dtype", "dtype", SECT_ROOT, T_STR, OFF(torch_dtype), SZ(torch_dtype), 0, SECT_ROOT },
    FI("use_cache", T_BOOL, use_cache, 0),
    FS("transformers_version", transformers_version, 0),
    { "quantization_config", NULL, SECT_ROOT, T_OBJ, 0, 0, 1, SECT_QUANT },
    { "quant_method", NULL, SECT_QUANT, T_STR, OFF(quant_method), SZ(quant_method), 1, SECT_ROOT },
    { "fmt", NULL, SECT_QUANT, T_STR, OFF(quant_fmt), SZ(quant_fmt), 1, SECT_ROOT },
    { "activation_scheme", NULL, SECT_QUANT, T_STR, OFF(quant_activation_scheme),
      SZ(quant_activation_scheme), 0, SECT_ROOT },
    { "scale_fmt", NULL, SECT_QUANT, T_STR, OFF(quant_scale_fmt), SZ(quant_scale_fmt), 0,
      SECT_ROOT },
    { "weight_block_size", NULL, SECT_QUANT, T_BLOCK, OFF(weight_block), 0, 1, SECT_ROOT },
    FS("expert_dtype", expert_dtype, 0),
};

#define N_FIELDS (sizeof(cfg_fields) / sizeof(cfg_fields[0]))

/* Section names for messages ("rope_scaling.factor"). */
static const char *const sect_prefix[SECT__COUNT] = {
    [SECT_ROOT] = "",
    [SECT_ROPE] = "rope_scaling.",
    [SECT_QUANT] = "quantization_config.",
};

/* The only rope_scaling type we implement (model doc §3.3.3). */
static const char rope_type_yarn[] = "yarn";

/* --- presets -------------------------------------------------------------- */

static void
copy_str(char *dst, size_t len, const char *src)
{
    snprintf(dst, len, "%s", src);
}

/* The real DeepSeek-V4-Flash (model doc §1.1). */
static void
preset_flash(struct dsv4_config *c)
{
    memset(c, 0, sizeof(*c));
    copy_str(c->model_type, sizeof(c->model_type), "deepseek_v4");
    copy_str(c->architecture, sizeof(c->architecture), "DeepseekV4ForCausalLM");
    copy_str(c->torch_dtype, sizeof(c->torch_dtype), "bfloat16");
    copy_str(c->transformers_version, sizeof(c->transformers_version), "4.57.1");
    copy_str(c->hidden_act, sizeof(c->hidden_act), "silu");
    copy_str(c->scoring_func, sizeof(c->scoring_func), "sqrtsoftplus");
    copy_str(c->topk_method, sizeof(c->topk_method), "noaux_tc");
    copy_str(c->expert_dtype, sizeof(c->expert_dtype), "fp4");

    c->vocab_size = 129280;
    c->hidden_size = 4096;
    c->num_hidden_layers = 43;
    c->num_attention_heads = 64;
    c->num_key_value_heads = 1;
    c->head_dim = 512;
    c->qk_rope_head_dim = 64;
    c->q_lora_rank = 1024;
    c->o_groups = 8;
    c->o_lora_rank = 1024;
    c->sliding_window = 128;
    /* 0, 0, then 4/128 alternating (even index 4, odd 128), MTP 0 */
    c->n_compress_ratios = 44;
    for (int i = 0; i < 43; i++)
        c->compress_ratios[i] = i < 2 ? 0 : (i % 2 == 0 ? 4 : 128);
    c->compress_ratios[43] = 0;
    c->index_n_heads = 64;
    c->index_head_dim = 128;
    c->index_topk = 512;
    c->n_routed_experts = 256;
    c->num_experts_per_tok = 6;
    c->n_shared_experts = 1;
    c->moe_intermediate_size = 2048;
    c->num_hash_layers = 3;
    c->hc_mult = 4;
    c->hc_sinkhorn_iters = 20;
    c->num_nextn_predict_layers = 1;
    c->max_position_embeddings = 1048576;
    c->bos_token_id = 0;
    c->eos_token_id = 1;

    c->rope_theta = 10000.0;
    c->compress_rope_theta = 160000.0;
    c->rope_factor = 16.0;
    c->rope_original_max_pos = 65536;
    c->rope_beta_fast = 32.0;
    c->rope_beta_slow = 1.0;
    c->routed_scaling_factor = 1.5;
    c->swiglu_limit = 10.0;
    c->hc_eps = 1e-6;
    c->rms_norm_eps = 1e-6;
    c->initializer_range = 0.02;
    c->attention_dropout = 0.0;

    c->norm_topk_prob = 1;
    c->tie_word_embeddings = 0;
    c->attention_bias = 0;
    c->use_cache = 1;

    copy_str(c->quant_method, sizeof(c->quant_method), "fp8");
    copy_str(c->quant_fmt, sizeof(c->quant_fmt), "e4m3");
    copy_str(c->quant_activation_scheme, sizeof(c->quant_activation_scheme), "dynamic");
    copy_str(c->quant_scale_fmt, sizeof(c->quant_scale_fmt), "ue8m0");
    c->weight_block[0] = 128;
    c->weight_block[1] = 128;
}

/* Set main compress ratios from `r` (n entries) plus `n_mtp` SWA MTP layers. */
static void
set_ratios(struct dsv4_config *c, const int32_t *r, int n, int n_mtp)
{
    memset(c->compress_ratios, 0, sizeof(c->compress_ratios));
    for (int i = 0; i < n; i++)
        c->compress_ratios[i] = r[i];
    c->num_hidden_layers = n;
    c->num_nextn_predict_layers = n_mtp;
    c->n_compress_ratios = n + n_mtp;
}

/* CPU-sized model with the flash structure (every layer kind, both routings). */
static void
preset_small(struct dsv4_config *c)
{
    static const int32_t ratios[] = { 0, 0, 4, 128, 4, 128 };

    preset_flash(c);
    c->hidden_size = 256;
    set_ratios(c, ratios, 6, 1);
    c->num_attention_heads = 4;
    c->head_dim = 128;
    c->qk_rope_head_dim = 64;
    c->q_lora_rank = 128;
    c->o_groups = 2;
    c->o_lora_rank = 128;
    c->sliding_window = 16;
    c->index_n_heads = 4;
    c->index_head_dim = 128;
    c->index_topk = 8;
    c->n_routed_experts = 8;
    c->num_experts_per_tok = 2;
    c->moe_intermediate_size = 128;
    c->num_hash_layers = 3;
    c->hc_mult = 4;
    c->hc_sinkhorn_iters = 20;
}

/* Test-sized: small with a 1024-token vocabulary and 4 layers. */
static void
preset_tiny(struct dsv4_config *c)
{
    static const int32_t ratios[] = { 0, 4, 128, 4 };

    preset_small(c);
    c->vocab_size = 1024;
    set_ratios(c, ratios, 4, 1);
    c->num_hash_layers = 2;
}

enum dsv4_err
dsv4_config_preset(struct dsv4_config *cfg, const char *name)
{
    if (strcmp(name, "flash") == 0)
        preset_flash(cfg);
    else if (strcmp(name, "small") == 0)
        preset_small(cfg);
    else if (strcmp(name, "tiny") == 0)
        preset_tiny(cfg);
    else
        return dsv4_err_set(DSV4_ERR_INVAL, "unknown model preset '%s' (flash, small, tiny)",
                            name);
    return DSV4_OK;
}

/* --- validation ----------------------------------------------------------- */

#define BAD(file, field, ...) \
    cfg_bad((file), (field), __VA_ARGS__)

static enum dsv4_err cfg_bad(const char *file, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* DSV4_ERR_CONFIG with "file: field 'x': <why>". */
static enum dsv4_err
cfg_bad(const char *file, const char *field, const char *fmt, ...)
{
    char why[512];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s': %s", file, field, why);
}

/* Integer fields with a simple lower bound (all must be at least `min`). */
struct int_min {
    const char *key;
    size_t off;
    int32_t min;
};

static const struct int_min int_mins[] = {
    { "vocab_size", OFF(vocab_size), 1 },
    { "hidden_size", OFF(hidden_size), 1 },
    { "num_hidden_layers", OFF(num_hidden_layers), 1 },
    { "num_attention_heads", OFF(num_attention_heads), 1 },
    { "head_dim", OFF(head_dim), 1 },
    { "qk_rope_head_dim", OFF(qk_rope_head_dim), 2 },
    { "q_lora_rank", OFF(q_lora_rank), 1 },
    { "o_groups", OFF(o_groups), 1 },
    { "o_lora_rank", OFF(o_lora_rank), 1 },
    { "sliding_window", OFF(sliding_window), 1 },
    { "index_n_heads", OFF(index_n_heads), 1 },
    { "index_topk", OFF(index_topk), 1 },
    { "n_routed_experts", OFF(n_routed_experts), 1 },
    { "num_experts_per_tok", OFF(num_experts_per_tok), 1 },
    { "moe_intermediate_size", OFF(moe_intermediate_size), 1 },
    { "num_hash_layers", OFF(num_hash_layers), 0 },
    { "hc_mult", OFF(hc_mult), 1 },
    { "hc_sinkhorn_iters", OFF(hc_sinkhorn_iters), 1 },
    { "num_nextn_predict_layers", OFF(num_nextn_predict_layers), 0 },
    { "bos_token_id", OFF(bos_token_id), 0 },
    { "eos_token_id", OFF(eos_token_id), 0 },
};

/* Integer fields with an upper bound (at most `min`, here the maximum): far
 * above the model's (window 128, top-k 512, 64 indexer heads, 20 Sinkhorn
 * iterations, 129,280 ids), they keep what a rank allocates from them (a
 * window ring and a top-k list a slot, a vocabulary's logits a row) from
 * passing -n and failing the start as an allocation of no named field. */
static const struct int_min int_maxs[] = {
    { "vocab_size", OFF(vocab_size), 1 << 24 },
    { "sliding_window", OFF(sliding_window), 8192 },
    { "index_n_heads", OFF(index_n_heads), 1024 },
    { "index_topk", OFF(index_topk), 8192 },
    { "hc_sinkhorn_iters", OFF(hc_sinkhorn_iters), 1000 },
};

/* Positive finite double fields. */
struct dbl_pos {
    const char *key;
    size_t off;
};

static const struct dbl_pos dbl_pos[] = {
    { "rope_theta", OFF(rope_theta) },
    { "compress_rope_theta", OFF(compress_rope_theta) },
    { "rope_scaling.factor", OFF(rope_factor) },
    { "rope_scaling.beta_fast", OFF(rope_beta_fast) },
    { "rope_scaling.beta_slow", OFF(rope_beta_slow) },
    { "routed_scaling_factor", OFF(routed_scaling_factor) },
    { "swiglu_limit", OFF(swiglu_limit) },
    { "rms_norm_eps", OFF(rms_norm_eps) },
};

/* String fields that must hold one given value. */
struct str_eq {
    const char *key;
    size_t off;
    const char *want;
};

static const struct str_eq str_eqs[] = {
    { "model_type", OFF(model_type), "deepseek_v4" },
    { "architectures", OFF(architecture), "DeepseekV4ForCausalLM" },
    { "hidden_act", OFF(hidden_act), "silu" },
    { "scoring_func", OFF(scoring_func), "sqrtsoftplus" },
    { "topk_method", OFF(topk_method), "noaux_tc" },
    { "quantization_config.quant_method", OFF(quant_method), "fp8" },
    { "quantization_config.fmt", OFF(quant_fmt), "e4m3" },
    { "quantization_config.activation_scheme", OFF(quant_activation_scheme), "dynamic" },
    { "quantization_config.scale_fmt", OFF(quant_scale_fmt), "ue8m0" },
};

/* Dimensions that are a row or column count of some FP8 128x128-block weight
 * (model doc §2.4: wq_a, wq_b, wkv, wo_a, wo_b, shared experts, indexer wq_b,
 * e_proj/h_proj).  H*Dh/G (wo_a input) and index_n_heads*128 are checked
 * separately. */
static const struct int_min fp8_dims[] = {
    { "hidden_size", OFF(hidden_size), 0 },
    { "q_lora_rank", OFF(q_lora_rank), 0 },
    { "head_dim", OFF(head_dim), 0 },
    { "o_lora_rank", OFF(o_lora_rank), 0 },
    { "moe_intermediate_size", OFF(moe_intermediate_size), 0 },
};

static int32_t
cfg_i32(const struct dsv4_config *c, size_t off)
{
    int32_t v;

    memcpy(&v, (const char *)c + off, sizeof(v));
    return v;
}

static double
cfg_f64(const struct dsv4_config *c, size_t off)
{
    double v;

    memcpy(&v, (const char *)c + off, sizeof(v));
    return v;
}

/* Ranges of single fields. */
static enum dsv4_err
validate_fields(const struct dsv4_config *c, const char *f)
{
    for (size_t i = 0; i < sizeof(str_eqs) / sizeof(str_eqs[0]); i++) {
        const char *have = (const char *)c + str_eqs[i].off;
        if (strcmp(have, str_eqs[i].want) != 0) {
            if (i == 0)
                return BAD(f, "model_type", "unknown model_type '%s' (want 'deepseek_v4')",
                           have);
            return BAD(f, str_eqs[i].key, "'%s' not supported (want '%s')", have,
                       str_eqs[i].want);
        }
    }
    if (c->expert_dtype[0] != '\0' && strcmp(c->expert_dtype, "fp4") != 0)
        return BAD(f, "expert_dtype", "'%s' not supported (want 'fp4' or absent)",
                   c->expert_dtype);
    for (size_t i = 0; i < sizeof(int_mins) / sizeof(int_mins[0]); i++) {
        int32_t v = cfg_i32(c, int_mins[i].off);
        if (v < int_mins[i].min)
            return BAD(f, int_mins[i].key, "%d out of range (must be >= %d)", v,
                       int_mins[i].min);
    }
    for (size_t i = 0; i < sizeof(int_maxs) / sizeof(int_maxs[0]); i++) {
        int32_t v = cfg_i32(c, int_maxs[i].off);
        if (v > int_maxs[i].min)
            return BAD(f, int_maxs[i].key, "%d out of range (at most %d)", v,
                       int_maxs[i].min);
    }
    for (size_t i = 0; i < sizeof(dbl_pos) / sizeof(dbl_pos[0]); i++) {
        double v = cfg_f64(c, dbl_pos[i].off);
        if (!isfinite(v) || v <= 0)
            return BAD(f, dbl_pos[i].key, "%g out of range (must be > 0)", v);
    }
    /* a RoPE base of 1 or less gives log(base) <= 0: NaN or inverted
     * frequencies */
    if (c->rope_theta <= 1)
        return BAD(f, "rope_theta", "%g out of range (must be > 1)", c->rope_theta);
    if (c->compress_rope_theta <= 1)
        return BAD(f, "compress_rope_theta", "%g out of range (must be > 1)",
                   c->compress_rope_theta);
    if (c->n_routed_experts > DSV4_MAX_EXPERTS)
        return BAD(f, "n_routed_experts", "%d out of range (at most %d)", c->n_routed_experts,
                   DSV4_MAX_EXPERTS);
    if (c->num_experts_per_tok > DSV4_MAX_TOPK)
        return BAD(f, "num_experts_per_tok", "%d out of range (at most %d)",
                   c->num_experts_per_tok, DSV4_MAX_TOPK);
    if (!isfinite(c->hc_eps) || c->hc_eps < 0)
        return BAD(f, "hc_eps", "%g out of range (must be >= 0)", c->hc_eps);
    if (!isfinite(c->attention_dropout) || c->attention_dropout < 0 ||
        c->attention_dropout >= 1)
        return BAD(f, "attention_dropout", "%g out of range [0, 1)", c->attention_dropout);
    if (!isfinite(c->initializer_range) || c->initializer_range < 0)
        return BAD(f, "initializer_range", "%g out of range (must be >= 0)",
                   c->initializer_range);
    if (c->rope_factor < 1)
        return BAD(f, "rope_scaling.factor", "%g out of range (must be >= 1)", c->rope_factor);
    if (c->rope_original_max_pos < 1)
        return BAD(f, "rope_scaling.original_max_position_embeddings",
                   "%lld out of range (must be >= 1)", (long long)c->rope_original_max_pos);
    if (c->max_position_embeddings < 1)
        return BAD(f, "max_position_embeddings", "%lld out of range (must be >= 1)",
                   (long long)c->max_position_embeddings);
    if (c->num_key_value_heads != 1)
        return BAD(f, "num_key_value_heads", "%d not supported (must be 1: K = V, one head)",
                   c->num_key_value_heads);
    if (c->n_shared_experts != 1)
        return BAD(f, "n_shared_experts", "%d not supported (must be 1)", c->n_shared_experts);
    if (c->index_head_dim != 128)
        return BAD(f, "index_head_dim", "%d not supported (must be 128: Hadamard-128)",
                   c->index_head_dim);
    if (c->hc_mult > DSV4_HC_MAX)
        return BAD(f, "hc_mult", "%d out of range (at most %d)", c->hc_mult, DSV4_HC_MAX);
    if (c->weight_block[0] != 128 || c->weight_block[1] != 128)
        return BAD(f, "quantization_config.weight_block_size",
                   "[%d, %d] not supported (must be [128, 128])", c->weight_block[0],
                   c->weight_block[1]);
    if (c->tie_word_embeddings)
        return BAD(f, "tie_word_embeddings", "true not supported (embed and head are separate)");
    if (c->attention_bias)
        return BAD(f, "attention_bias", "true not supported");
    if (!c->norm_topk_prob)
        return BAD(f, "norm_topk_prob", "false not supported");
    return DSV4_OK;
}

/* Relations between fields. */
static enum dsv4_err
validate_relations(const struct dsv4_config *c, const char *f)
{
    int64_t sum = (int64_t)c->num_hidden_layers + c->num_nextn_predict_layers;
    int n_layers = (int)sum;

    if (sum > DSV4_MAX_LAYERS)
        return BAD(f, "num_hidden_layers", "%d + %d MTP layers exceeds the limit of %d",
                   c->num_hidden_layers, c->num_nextn_predict_layers, DSV4_MAX_LAYERS);
    if (c->n_compress_ratios != n_layers)
        return BAD(f, "compress_ratios",
                   "has %d entries, num_hidden_layers + num_nextn_predict_layers = %d",
                   c->n_compress_ratios, n_layers);
    for (int i = 0; i < n_layers; i++) {
        int r = c->compress_ratios[i];
        if (r != 0 && r != 4 && r != 128)
            return BAD(f, "compress_ratios", "entry %d is %d (must be 0, 4 or 128)", i, r);
        if (i >= c->num_hidden_layers && r != 0)
            return BAD(f, "compress_ratios",
                       "entry %d (MTP layer) is %d (MTP layers are sliding-window only: 0)",
                       i, r);
    }
    if (c->head_dim <= c->qk_rope_head_dim)
        return BAD(f, "head_dim", "%d must be greater than qk_rope_head_dim %d", c->head_dim,
                   c->qk_rope_head_dim);
    if (c->qk_rope_head_dim % 2 != 0)
        return BAD(f, "qk_rope_head_dim", "%d must be even (interleaved pairs)",
                   c->qk_rope_head_dim);
    if (c->qk_rope_head_dim >= c->index_head_dim)
        return BAD(f, "qk_rope_head_dim", "%d must be less than index_head_dim %d",
                   c->qk_rope_head_dim, c->index_head_dim);
    if ((c->head_dim - c->qk_rope_head_dim) % 64 != 0)
        return BAD(f, "head_dim",
                   "nope part %d (head_dim - qk_rope_head_dim) must be a multiple of 64 "
                   "(KV FP8 simulation blocks)", c->head_dim - c->qk_rope_head_dim);
    if (c->num_attention_heads % c->o_groups != 0)
        return BAD(f, "o_groups", "num_attention_heads %d is not a multiple of o_groups %d",
                   c->num_attention_heads, c->o_groups);
    if (c->num_experts_per_tok > c->n_routed_experts)
        return BAD(f, "num_experts_per_tok", "%d exceeds n_routed_experts %d",
                   c->num_experts_per_tok, c->n_routed_experts);
    if (c->num_hash_layers > c->num_hidden_layers)
        return BAD(f, "num_hash_layers", "%d exceeds num_hidden_layers %d",
                   c->num_hash_layers, c->num_hidden_layers);
    if (c->bos_token_id >= c->vocab_size)
        return BAD(f, "bos_token_id", "%d is not below vocab_size %d", c->bos_token_id,
                   c->vocab_size);
    if (c->eos_token_id >= c->vocab_size)
        return BAD(f, "eos_token_id", "%d is not below vocab_size %d", c->eos_token_id,
                   c->vocab_size);
    if (c->rope_beta_fast <= c->rope_beta_slow)
        return BAD(f, "rope_scaling.beta_fast", "%g must be greater than beta_slow %g",
                   c->rope_beta_fast, c->rope_beta_slow);
    /* FP4 experts: 1x32 groups along K (hidden_size for w1/w3, I for w2). */
    if (c->hidden_size % 32 != 0)
        return BAD(f, "hidden_size", "%d is not a multiple of 32 (FP4 expert groups)",
                   c->hidden_size);
    if (c->moe_intermediate_size % 32 != 0)
        return BAD(f, "moe_intermediate_size", "%d is not a multiple of 32 (FP4 expert groups)",
                   c->moe_intermediate_size);
    /* FP8 weights: 128x128 blocks (transformers requires whole blocks). */
    for (size_t i = 0; i < sizeof(fp8_dims) / sizeof(fp8_dims[0]); i++) {
        int32_t v = cfg_i32(c, fp8_dims[i].off);
        if (v % 128 != 0)
            return BAD(f, fp8_dims[i].key, "%d is not a multiple of 128 (FP8 weight blocks)", v);
    }
    if ((int64_t)c->num_attention_heads * c->head_dim / c->o_groups % 128 != 0)
        return BAD(f, "o_groups",
                   "group width num_attention_heads*head_dim/o_groups = %lld is not a "
                   "multiple of 128 (FP8 weight blocks of wo_a)",
                   (long long)c->num_attention_heads * c->head_dim / c->o_groups);
    return DSV4_OK;
}

static enum dsv4_err
validate_named(const struct dsv4_config *c, const char *file)
{
    enum dsv4_err e = validate_fields(c, file);

    if (e != DSV4_OK)
        return e;
    return validate_relations(c, file);
}

enum dsv4_err
dsv4_config_validate(const struct dsv4_config *cfg)
{
    return validate_named(cfg, "config");
}

/* --- parsing -------------------------------------------------------------- */

/* Convert a JSON integer to int32 (field type checked by the caller). */
static enum dsv4_err
json_to_i32(json_object *v, const char *file, const char *pfx, const char *key, int32_t *out)
{
    int64_t x;

    if (!json_object_is_type(v, json_type_int))
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': wrong type (want integer)",
                            file, pfx, key);
    errno = 0;
    x = json_object_get_int64(v);
    if (errno != 0 || x < INT32_MIN || x > INT32_MAX)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': integer out of range", file,
                            pfx, key);
    *out = (int32_t)x;
    return DSV4_OK;
}

/* Parse a list of ints into out[0..max) ; *n gets the length. */
static enum dsv4_err
json_to_i32_list(json_object *v, const char *file, const char *pfx, const char *key,
                 int32_t *out, int max, int32_t *n)
{
    size_t len;

    if (!json_object_is_type(v, json_type_array))
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': wrong type (want list)", file,
                            pfx, key);
    len = json_object_array_length(v);
    if (len > (size_t)max)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': %zu entries (at most %d)",
                            file, pfx, key, len, max);
    for (size_t i = 0; i < len; i++) {
        enum dsv4_err e = json_to_i32(json_object_array_get_idx(v, i), file, pfx, key, &out[i]);
        if (e != DSV4_OK)
            return e;
    }
    *n = (int32_t)len;
    return DSV4_OK;
}

static enum dsv4_err
json_to_str(json_object *v, const char *file, const char *pfx, const char *key, char *buf,
            size_t size)
{
    const char *s;

    if (!json_object_is_type(v, json_type_string))
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': wrong type (want string)", file,
                            pfx, key);
    s = json_object_get_string(v);
    if (strlen(s) >= size)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': string too long ('%s')", file,
                            pfx, key, s);
    copy_str(buf, size, s);
    return DSV4_OK;
}

/* Store JSON value `v` into the field `fd` of c (or the rope type buffer). */
static enum dsv4_err
parse_value(struct dsv4_config *c, const struct cfg_field *fd, json_object *v, const char *file,
            char *rope_type, size_t rope_type_len)
{
    const char *pfx = sect_prefix[fd->sect];
    char *dst = (char *)c + fd->off;
    enum dsv4_err e = DSV4_OK;
    int32_t tmp[2], n;
    int64_t x;
    double d;

    switch (fd->type) {
    case T_I32:
        e = json_to_i32(v, file, pfx, fd->key, &tmp[0]);
        if (e == DSV4_OK)
            memcpy(dst, &tmp[0], sizeof(int32_t));
        return e;
    case T_I64:
        if (!json_object_is_type(v, json_type_int))
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': wrong type (want integer)",
                                file, pfx, fd->key);
        errno = 0;
        x = json_object_get_int64(v);
        if (errno != 0)
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': integer out of range",
                                file, pfx, fd->key);
        memcpy(dst, &x, sizeof(x));
        return DSV4_OK;
    case T_F64:
        if (!json_object_is_type(v, json_type_int) && !json_object_is_type(v, json_type_double))
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': wrong type (want number)",
                                file, pfx, fd->key);
        d = json_object_get_double(v);
        if (!isfinite(d))
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': not a finite number",
                                file, pfx, fd->key);
        memcpy(dst, &d, sizeof(d));
        return DSV4_OK;
    case T_BOOL:
        if (!json_object_is_type(v, json_type_boolean))
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s%s': wrong type (want boolean)",
                                file, pfx, fd->key);
        tmp[0] = json_object_get_boolean(v) ? 1 : 0;
        memcpy(dst, &tmp[0], sizeof(int));
        return DSV4_OK;
    case T_STR:
        if (fd->sect == SECT_ROPE)
            return json_to_str(v, file, pfx, fd->key, rope_type, rope_type_len);
        return json_to_str(v, file, pfx, fd->key, dst, fd->size);
    case T_ARCH:
        if (!json_object_is_type(v, json_type_array) || json_object_array_length(v) < 1)
            return dsv4_err_set(DSV4_ERR_CONFIG,
                                "%s: field 'architectures': wrong type (want non-empty list)",
                                file);
        return json_to_str(json_object_array_get_idx(v, 0), file, pfx, fd->key, dst, fd->size);
    case T_RATIOS:
        memset(c->compress_ratios, 0, sizeof(c->compress_ratios));
        return json_to_i32_list(v, file, pfx, fd->key, c->compress_ratios, DSV4_MAX_LAYERS,
                                &c->n_compress_ratios);
    case T_BLOCK:
        e = json_to_i32_list(v, file, pfx, fd->key, tmp, 2, &n);
        if (e == DSV4_OK && n != 2)
            return dsv4_err_set(DSV4_ERR_CONFIG,
                                "%s: field '%s%s': %d entries (want 2: [128, 128])", file, pfx,
                                fd->key, n);
        if (e == DSV4_OK)
            memcpy(c->weight_block, tmp, sizeof(tmp));
        return e;
    case T_OBJ:
        break;
    }
    return e;
}

/* Parse the document `root` into c (starting from the defaults). */
static enum dsv4_err
parse_root(struct dsv4_config *c, json_object *root, const char *file)
{
    json_object *sect[SECT__COUNT] = { root, NULL, NULL };
    int sect_present[SECT__COUNT] = { 1, 0, 0 };
    char rope_type[16];
    json_object *v;
    enum dsv4_err e;

    if (!json_object_is_type(root, json_type_object))
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: not a JSON object", file);
    /* an unknown model is reported as such, before any field complaint */
    if (json_object_object_get_ex(root, "model_type", &v) &&
        json_object_is_type(v, json_type_string) &&
        strcmp(json_object_get_string(v), "deepseek_v4") != 0)
        return BAD(file, "model_type", "unknown model_type '%s' (want 'deepseek_v4')",
                   json_object_get_string(v));

    preset_flash(c);
    c->expert_dtype[0] = '\0';
    c->transformers_version[0] = '\0';
    copy_str(rope_type, sizeof(rope_type), rope_type_yarn);

    for (size_t i = 0; i < N_FIELDS; i++) {
        const struct cfg_field *fd = &cfg_fields[i];
        json_object *obj = sect[fd->sect];
        int found = 0;

        if (obj != NULL) {
            found = json_object_object_get_ex(obj, fd->key, &v);
            if ((!found || v == NULL) && fd->alias != NULL)
                found = json_object_object_get_ex(obj, fd->alias, &v);
            if (found && v == NULL)
                found = 0;  /* null = absent */
        }
        if (!found) {
            if (fd->required && sect_present[fd->sect])
                return dsv4_err_set(DSV4_ERR_CONFIG, "%s: missing required field '%s%s'", file,
                                    sect_prefix[fd->sect], fd->key);
            continue;
        }
        if (fd->type == T_OBJ) {
            if (!json_object_is_type(v, json_type_object))
                return dsv4_err_set(DSV4_ERR_CONFIG, "%s: field '%s': wrong type (want object)",
                                    file, fd->key);
            sect[fd->sub] = v;
            sect_present[fd->sub] = 1;
            continue;
        }
        e = parse_value(c, fd, v, file, rope_type, sizeof(rope_type));
        if (e != DSV4_OK)
            return e;
    }
    if (strcmp(rope_type, rope_type_yarn) != 0)
        return BAD(file, "rope_scaling.type", "'%s' not supported (want 'yarn')", rope_type);
    return validate_named(c, file);
}

enum dsv4_err
dsv4_config_parse(struct dsv4_config *cfg, const char *json, size_t len, const char *name)
{
    struct json_tokener *tok;
    struct dsv4_config tmp;
    json_object *root;
    enum dsv4_err e;

    if (len > INT32_MAX)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: file too large", name);
    tok = json_tokener_new();
    if (tok == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", name);
    root = json_tokener_parse_ex(tok, json, (int)len);
    if (root == NULL || json_tokener_get_error(tok) != json_tokener_success) {
        enum json_tokener_error je = json_tokener_get_error(tok);
        json_object_put(root);
        json_tokener_free(tok);
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: invalid JSON: %s", name,
                            je == json_tokener_continue ? "unexpected end of input"
                                                        : json_tokener_error_desc(je));
    }
    /* nothing but whitespace may follow the document */
    for (size_t i = json_tokener_get_parse_end(tok); i < len; i++) {
        if (json[i] != ' ' && json[i] != '\n' && json[i] != '\r' && json[i] != '\t' &&
            json[i] != '\0') {
            json_object_put(root);
            json_tokener_free(tok);
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: invalid JSON: trailing data", name);
        }
    }
    json_tokener_free(tok);
    /* json-c keeps the last of a repeated key: a hand-edited copy of a key
     * written twice would be ignored without a word */
    for (int at = 1; at <= 2; at++) {
        char dup[128];

        if (dsv4_json_find_dup(root, json, len, at, dup, sizeof(dup)) && dup[0] != '\0') {
            json_object_put(root);
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: key \"%s\" appears twice", name, dup);
        }
    }
    e = parse_root(&tmp, root, name);
    json_object_put(root);
    if (e == DSV4_OK)
        *cfg = tmp;
    return e;
}

enum dsv4_err
dsv4_config_load(struct dsv4_config *cfg, const char *path)
{
    enum dsv4_err e;
    char *buf = NULL;
    size_t len = 0, cap = 0, got;
    struct stat st;
    FILE *fp;
    int fd;

    if ((e = dsv4_open_regular(path, DSV4_ERR_CONFIG, &fd, &st)) != DSV4_OK)
        return e;
    if ((fp = fdopen(fd, "rb")) == NULL) {
        int err = errno;

        close(fd);
        return dsv4_err_set(DSV4_ERR_SYS, "%s: %s", path, strerror(err));
    }
    do {
        if (cap - len < 4096) {
            char *nb;
            if (cap > (size_t)64 << 20) {
                free(buf);
                fclose(fp);
                return dsv4_err_set(DSV4_ERR_CONFIG, "%s: file too large", path);
            }
            cap = cap ? cap * 2 : 16384;
            nb = realloc(buf, cap);
            if (nb == NULL) {
                free(buf);
                fclose(fp);
                return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", path);
            }
            buf = nb;
        }
        got = fread(buf + len, 1, cap - len, fp);
        len += got;
    } while (got > 0);
    if (ferror(fp)) {
        int err = errno;
        free(buf);
        fclose(fp);
        return dsv4_err_set(DSV4_ERR_SYS, "%s: read: %s", path, strerror(err));
    }
    fclose(fp);
    e = dsv4_config_parse(cfg, buf, len, path);
    free(buf);
    return e;
}

/* --- writing -------------------------------------------------------------- */

/* A JSON number printed like Python's repr (what HF writes): "10.0" for an
 * integral value, else the shortest decimal that reads back as d. */
static json_object *
json_double_short(double d)
{
    char s[32];

    if (d == trunc(d) && fabs(d) < 1e16) {
        snprintf(s, sizeof(s), "%.1f", d);
        return json_object_new_double_s(d, s);
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(s, sizeof(s), "%.*g", prec, d);
        if (strtod(s, NULL) == d)
            break;
    }
    return json_object_new_double_s(d, s);
}

/* Add `v` under `key` to `obj`; false (and v freed) on allocation failure. */
static int
json_add(json_object *obj, const char *key, json_object *v)
{
    if (v == NULL)
        return 0;
    if (json_object_object_add(obj, key, v) != 0) {
        json_object_put(v);
        return 0;
    }
    return 1;
}

static json_object *
json_i32_list(const int32_t *v, int n)
{
    json_object *a = json_object_new_array();

    for (int i = 0; a != NULL && i < n; i++) {
        json_object *x = json_object_new_int(v[i]);
        if (x == NULL || json_object_array_add(a, x) != 0) {
            json_object_put(x);
            json_object_put(a);
            return NULL;
        }
    }
    return a;
}

/* The value of field `fd` as a new JSON object (NULL on allocation failure). */
static json_object *
field_to_json(const struct dsv4_config *c, const struct cfg_field *fd)
{
    const char *src = (const char *)c + fd->off;
    json_object *a, *s;
    int32_t i32;
    int64_t i64;
    double d;

    switch (fd->type) {
    case T_I32:
        memcpy(&i32, src, sizeof(i32));
        return json_object_new_int(i32);
    case T_I64:
        memcpy(&i64, src, sizeof(i64));
        return json_object_new_int64(i64);
    case T_F64:
        memcpy(&d, src, sizeof(d));
        return json_double_short(d);
    case T_BOOL:
        memcpy(&i32, src, sizeof(i32));
        return json_object_new_boolean(i32 != 0);
    case T_STR:
        return json_object_new_string(fd->sect == SECT_ROPE ? rope_type_yarn : src);
    case T_ARCH:
        a = json_object_new_array();
        s = json_object_new_string(src);
        if (a == NULL || s == NULL || json_object_array_add(a, s) != 0) {
            json_object_put(a);
            json_object_put(s);
            return NULL;
        }
        return a;
    case T_RATIOS:
        return json_i32_list(c->compress_ratios, c->n_compress_ratios);
    case T_BLOCK:
        return json_i32_list(c->weight_block, 2);
    case T_OBJ:
        return json_object_new_object();
    }
    return NULL;
}

/* The official HF-form document for c (NULL on allocation failure). */
static json_object *
config_to_json(const struct dsv4_config *c)
{
    json_object *sect[SECT__COUNT] = { NULL, NULL, NULL };

    sect[SECT_ROOT] = json_object_new_object();
    if (sect[SECT_ROOT] == NULL)
        return NULL;
    for (size_t i = 0; i < N_FIELDS; i++) {
        const struct cfg_field *fd = &cfg_fields[i];
        json_object *v;

        /* expert_dtype only in the current revision; absent when empty */
        if (fd->type == T_STR && fd->off == OFF(expert_dtype) && fd->sect == SECT_ROOT &&
            c->expert_dtype[0] == '\0')
            continue;
        v = field_to_json(c, fd);
        if (!json_add(sect[fd->sect], fd->key, v)) {
            json_object_put(sect[SECT_ROOT]);
            return NULL;
        }
        if (fd->type == T_OBJ)
            sect[fd->sub] = v;
    }
    return sect[SECT_ROOT];
}

enum dsv4_err
dsv4_config_write(const struct dsv4_config *cfg, const char *path)
{
    json_object *root = config_to_json(cfg);
    const char *s;
    FILE *fp;
    int ok;

    if (root == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", path);
    s = json_object_to_json_string_ext(root, JSON_C_TO_STRING_PRETTY |
                                                 JSON_C_TO_STRING_SPACED |
                                                 JSON_C_TO_STRING_NOSLASHESCAPE);
    fp = fopen(path, "w");
    if (fp == NULL) {
        int err = errno;
        json_object_put(root);
        return dsv4_err_set(DSV4_ERR_SYS, "%s: %s", path, strerror(err));
    }
    ok = s != NULL && fputs(s, fp) >= 0 && fputc('\n', fp) != EOF;
    ok = (fclose(fp) == 0) && ok;
    json_object_put(root);
    if (!ok)
        return dsv4_err_set(DSV4_ERR_SYS, "%s: write failed: %s", path, strerror(errno));
    return DSV4_OK;
}

char *
dsv4_config_text(const struct dsv4_config *cfg)
{
    json_object *root = config_to_json(cfg);
    const char *s;
    char *t = NULL;

    if (root == NULL)
        return NULL;
    s = json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN |
                                                 JSON_C_TO_STRING_NOSLASHESCAPE);
    if (s != NULL)
        t = strdup(s);
    json_object_put(root);
    return t;
}

/* --- overrides ------------------------------------------------------------ */

/* The table's spelling of `key` (in section `sect`, given by name or NULL
 * for the root; aliases map to the main key), or NULL if unknown. */
static const char *
known_key(const char *sect, const char *key)
{
    for (size_t i = 0; i < N_FIELDS; i++) {
        const struct cfg_field *fd = &cfg_fields[i];
        const char *want = "";

        for (size_t j = 0; j < N_FIELDS; j++)
            if (cfg_fields[j].type == T_OBJ && cfg_fields[j].sub == fd->sect)
                want = cfg_fields[j].key;
        if (strcmp(sect != NULL ? sect : "", want) != 0)
            continue;
        if (strcmp(fd->key, key) == 0 || (fd->alias != NULL && strcmp(fd->alias, key) == 0))
            return fd->key;
    }
    return NULL;
}

/* Apply one "key=value" (key may be "section.key") to the document. */
static enum dsv4_err
apply_assign(json_object *root, const char *assign)
{
    const char *eq = strchr(assign, '=');
    char key[128], *dot;
    json_object *obj = root, *v, *sub;
    const char *value, *canon;

    if (eq == NULL || eq == assign || (size_t)(eq - assign) >= sizeof(key))
        return dsv4_err_set(DSV4_ERR_INVAL, "override '%s': want key=value", assign);
    memcpy(key, assign, (size_t)(eq - assign));
    key[eq - assign] = '\0';
    value = eq + 1;

    dot = strchr(key, '.');
    if (dot != NULL)
        *dot = '\0';
    canon = known_key(dot != NULL ? key : NULL, dot != NULL ? dot + 1 : key);
    if (canon == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "override '%s': unknown config field", assign);
    if (dot != NULL) {
        if (!json_object_object_get_ex(root, key, &sub) || sub == NULL) {
            sub = json_object_new_object();
            if (!json_add(root, key, sub))
                return dsv4_err_set(DSV4_ERR_NOMEM, "override '%s': out of memory", assign);
        }
        if (!json_object_is_type(sub, json_type_object))
            return dsv4_err_set(DSV4_ERR_INVAL, "override '%s': '%s' is not an object", assign,
                                key);
        obj = sub;
    }
    memmove(key, canon, strlen(canon) + 1);
    /* JSON if it parses as one (numbers, lists, true, null), else a string */
    {
        struct json_tokener *tok = json_tokener_new();
        size_t vlen = strlen(value);

        if (tok == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "override '%s': out of memory", assign);
        /* include the NUL so a bare number is complete */
        v = json_tokener_parse_ex(tok, value, (int)vlen + 1);
        if (json_tokener_get_error(tok) != json_tokener_success ||
            json_tokener_get_parse_end(tok) < vlen) {
            json_object_put(v);
            v = json_object_new_string(value);
            if (v == NULL) {
                json_tokener_free(tok);
                return dsv4_err_set(DSV4_ERR_NOMEM, "override '%s': out of memory", assign);
            }
        } else if (v == NULL) {
            json_tokener_free(tok);
            json_object_object_del(obj, key);   /* null: make the field absent */
            return DSV4_OK;
        }
        json_tokener_free(tok);
    }
    if (!json_add(obj, key, v))
        return dsv4_err_set(DSV4_ERR_NOMEM, "override '%s': out of memory", assign);
    return DSV4_OK;
}

enum dsv4_err
dsv4_config_override(struct dsv4_config *cfg, int n, const char *const *assign)
{
    json_object *root = config_to_json(cfg);
    enum dsv4_err e = DSV4_OK;
    const char *s;

    if (root == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "config overrides: out of memory");
    for (int i = 0; i < n && e == DSV4_OK; i++)
        e = apply_assign(root, assign[i]);
    if (e == DSV4_OK) {
        s = json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN);
        if (s == NULL)
            e = dsv4_err_set(DSV4_ERR_NOMEM, "config overrides: out of memory");
        else
            e = dsv4_config_parse(cfg, s, strlen(s), "config overrides");
    }
    json_object_put(root);
    return e;
}
