/*
 * test_model_config.c — config.json parsing, validation, overrides, writing
 * and presets (common/model_config.c).
 *
 * The reference document is the official root config.json of
 * DeepSeek-V4-Flash, transcribed here by hand from model doc §1.1; every
 * error case mutates one field of it with json-c and checks the error class
 * and that the message names both the file and the field.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <json-c/json.h>

#include "common/err.h"
#include "common/model_config.h"

/* Model doc §1.1, current revision (with expert_dtype). */
static const char official_json[] =
    "{\n"
    "  \"architectures\": [\"DeepseekV4ForCausalLM\"],\n"
    "  \"attention_bias\": false,\n"
    "  \"attention_dropout\": 0.0,\n"
    "  \"bos_token_id\": 0,\n"
    "  \"compress_ratios\": [0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,\n"
    "      4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,\n"
    "      4, 128, 4, 128, 4, 128, 4, 0],\n"
    "  \"compress_rope_theta\": 160000,\n"
    "  \"eos_token_id\": 1,\n"
    "  \"expert_dtype\": \"fp4\",\n"
    "  \"hc_eps\": 1e-06,\n"
    "  \"hc_mult\": 4,\n"
    "  \"hc_sinkhorn_iters\": 20,\n"
    "  \"head_dim\": 512,\n"
    "  \"hidden_act\": \"silu\",\n"
    "  \"hidden_size\": 4096,\n"
    "  \"index_head_dim\": 128,\n"
    "  \"index_n_heads\": 64,\n"
    "  \"index_topk\": 512,\n"
    "  \"initializer_range\": 0.02,\n"
    "  \"max_position_embeddings\": 1048576,\n"
    "  \"model_type\": \"deepseek_v4\",\n"
    "  \"moe_intermediate_size\": 2048,\n"
    "  \"n_routed_experts\": 256,\n"
    "  \"n_shared_experts\": 1,\n"
    "  \"norm_topk_prob\": true,\n"
    "  \"num_attention_heads\": 64,\n"
    "  \"num_experts_per_tok\": 6,\n"
    "  \"num_hash_layers\": 3,\n"
    "  \"num_hidden_layers\": 43,\n"
    "  \"num_key_value_heads\": 1,\n"
    "  \"num_nextn_predict_layers\": 1,\n"
    "  \"o_groups\": 8,\n"
    "  \"o_lora_rank\": 1024,\n"
    "  \"q_lora_rank\": 1024,\n"
    "  \"qk_rope_head_dim\": 64,\n"
    "  \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\",\n"
    "      \"quant_method\": \"fp8\", \"scale_fmt\": \"ue8m0\",\n"
    "      \"weight_block_size\": [128, 128]},\n"
    "  \"rms_norm_eps\": 1e-06,\n"
    "  \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 16,\n"
    "      \"original_max_position_embeddings\": 65536, \"type\": \"yarn\"},\n"
    "  \"rope_theta\": 10000,\n"
    "  \"routed_scaling_factor\": 1.5,\n"
    "  \"scoring_func\": \"sqrtsoftplus\",\n"
    "  \"sliding_window\": 128,\n"
    "  \"swiglu_limit\": 10.0,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"topk_method\": \"noaux_tc\",\n"
    "  \"torch_dtype\": \"bfloat16\",\n"
    "  \"transformers_version\": \"4.57.1\",\n"
    "  \"use_cache\": true,\n"
    "  \"vocab_size\": 129280\n"
    "}\n";

static enum dsv4_err
parse_str(struct dsv4_config *c, const char *s)
{
    return dsv4_config_parse(c, s, strlen(s), "test.json");
}

/* The official document with `path` ("a" or "a.b") set to the JSON `value`
 * (NULL deletes it), parsed into c. */
static enum dsv4_err
parse_mutated(struct dsv4_config *c, const char *path, const char *value)
{
    json_object *root = json_tokener_parse(official_json), *obj = root, *v = NULL;
    char key[128];
    char *dot;
    enum dsv4_err e;

    assert_non_null(root);
    snprintf(key, sizeof(key), "%s", path);
    dot = strchr(key, '.');
    if (dot != NULL) {
        *dot = '\0';
        assert_true(json_object_object_get_ex(root, key, &obj));
        memmove(key, dot + 1, strlen(dot + 1) + 1);
    }
    if (value == NULL) {
        json_object_object_del(obj, key);
    } else {
        v = json_tokener_parse(value);
        assert_true(v != NULL || strcmp(value, "null") == 0);
        json_object_object_add(obj, key, v);
    }
    e = parse_str(c, json_object_to_json_string(root));
    json_object_put(root);
    return e;
}

static void
test_official(void **state)
{
    struct dsv4_config c, flash;

    (void)state;
    assert_int_equal(parse_str(&c, official_json), DSV4_OK);
    assert_string_equal(c.model_type, "deepseek_v4");
    assert_string_equal(c.architecture, "DeepseekV4ForCausalLM");
    assert_int_equal(c.vocab_size, 129280);
    assert_int_equal(c.hidden_size, 4096);
    assert_int_equal(c.num_hidden_layers, 43);
    assert_int_equal(c.num_attention_heads, 64);
    assert_int_equal(c.head_dim, 512);
    assert_int_equal(c.qk_rope_head_dim, 64);
    assert_int_equal(c.q_lora_rank, 1024);
    assert_int_equal(c.o_groups, 8);
    assert_int_equal(c.o_lora_rank, 1024);
    assert_int_equal(c.sliding_window, 128);
    assert_int_equal(c.n_compress_ratios, 44);
    for (int i = 0; i < 44; i++) {
        int want = i < 2 || i == 43 ? 0 : (i % 2 == 0 ? 4 : 128);
        assert_int_equal(c.compress_ratios[i], want);
    }
    assert_int_equal(dsv4_config_attn(&c, 2), DSV4_ATTN_CSA);
    assert_int_equal(dsv4_config_attn(&c, 3), DSV4_ATTN_HCA);
    assert_int_equal(dsv4_config_attn(&c, 43), DSV4_ATTN_SWA);
    assert_true(dsv4_config_is_hash(&c, 2));
    assert_false(dsv4_config_is_hash(&c, 3));
    assert_int_equal(dsv4_config_n_mtp(&c), 1);
    assert_int_equal(c.index_n_heads, 64);
    assert_int_equal(c.index_head_dim, 128);
    assert_int_equal(c.index_topk, 512);
    assert_int_equal(c.n_routed_experts, 256);
    assert_int_equal(c.num_experts_per_tok, 6);
    assert_int_equal(c.moe_intermediate_size, 2048);
    assert_int_equal(c.num_hash_layers, 3);
    assert_int_equal(c.hc_mult, 4);
    assert_int_equal(c.hc_sinkhorn_iters, 20);
    assert_true(c.max_position_embeddings == 1048576);
    assert_true(c.rope_theta == 10000.0);
    assert_true(c.compress_rope_theta == 160000.0);
    assert_true(c.rope_factor == 16.0);
    assert_true(c.rope_original_max_pos == 65536);
    assert_true(c.rope_beta_fast == 32.0 && c.rope_beta_slow == 1.0);
    assert_true(c.routed_scaling_factor == 1.5);
    assert_true(c.swiglu_limit == 10.0);
    assert_true(c.hc_eps == 1e-6 && c.rms_norm_eps == 1e-6);
    assert_true(c.norm_topk_prob && c.use_cache && !c.tie_word_embeddings);
    assert_string_equal(c.expert_dtype, "fp4");
    assert_string_equal(c.quant_scale_fmt, "ue8m0");
    assert_int_equal(c.weight_block[0], 128);
    assert_int_equal(c.weight_block[1], 128);

    /* the flash preset is exactly the official file */
    assert_int_equal(dsv4_config_preset(&flash, "flash"), DSV4_OK);
    assert_memory_equal(&c, &flash, sizeof(c));
}

/* Optional keys take the §1.2 defaults; unknown keys are ignored; HF's
 * alternative spellings are accepted. */
static void
test_defaults_and_aliases(void **state)
{
    struct dsv4_config c;
    json_object *root = json_tokener_parse(official_json), *rs;
    static const char *const optional[] = {
        "rms_norm_eps", "hc_eps", "num_nextn_predict_layers", "expert_dtype", "rope_scaling",
        "rope_theta", "compress_rope_theta", "swiglu_limit", "routed_scaling_factor",
        "hc_sinkhorn_iters", "n_shared_experts", "architectures", "torch_dtype",
        "transformers_version", "max_position_embeddings",
    };

    (void)state;
    for (size_t i = 0; i < sizeof(optional) / sizeof(optional[0]); i++)
        json_object_object_del(root, optional[i]);
    json_object_object_add(root, "dtype", json_object_new_string("float32"));
    json_object_object_add(root, "auto_map", json_object_new_object());
    json_object_object_add(root, "some_future_key", json_object_new_int(7));
    assert_int_equal(parse_str(&c, json_object_to_json_string(root)), DSV4_OK);
    assert_true(c.rms_norm_eps == 1e-6);
    assert_true(c.hc_eps == 1e-6);
    assert_int_equal(c.num_nextn_predict_layers, 1);
    assert_string_equal(c.expert_dtype, "");
    assert_string_equal(c.transformers_version, "");
    assert_true(c.rope_factor == 16.0 && c.rope_original_max_pos == 65536);
    assert_true(c.rope_theta == 10000.0 && c.compress_rope_theta == 160000.0);
    assert_true(c.swiglu_limit == 10.0 && c.routed_scaling_factor == 1.5);
    assert_int_equal(c.hc_sinkhorn_iters, 20);
    assert_int_equal(c.n_shared_experts, 1);
    assert_string_equal(c.architecture, "DeepseekV4ForCausalLM");
    assert_string_equal(c.torch_dtype, "float32");

    /* "rope_type" instead of "type", null as absent */
    rs = json_object_new_object();
    json_object_object_add(rs, "rope_type", json_object_new_string("yarn"));
    json_object_object_add(rs, "factor", json_object_new_int(8));
    json_object_object_add(root, "rope_scaling", rs);
    json_object_object_add(root, "hc_eps", NULL);
    assert_int_equal(parse_str(&c, json_object_to_json_string(root)), DSV4_OK);
    assert_true(c.rope_factor == 8.0);
    assert_true(c.hc_eps == 1e-6);
    json_object_object_add(rs, "rope_type", json_object_new_string("linear"));
    assert_int_equal(parse_str(&c, json_object_to_json_string(root)), DSV4_ERR_CONFIG);
    assert_non_null(strstr(dsv4_errmsg(), "rope_scaling.type"));
    json_object_put(root);
}

/* Official compress_ratios as JSON with entry `idx` replaced by `val`. */
static char ratios_bad5[512], ratios_mtp4[512];

static void
ratios_json(char *buf, size_t len, int idx, int val)
{
    size_t n = (size_t)snprintf(buf, len, "[");

    for (int i = 0; i < 44; i++) {
        int r = i < 2 || i == 43 ? 0 : (i % 2 == 0 ? 4 : 128);
        n += (size_t)snprintf(buf + n, len - n, "%s%d", i ? ", " : "", i == idx ? val : r);
    }
    snprintf(buf + n, len - n, "]");
}

struct bad_case {
    const char *path;     /* field to change */
    const char *value;    /* new JSON value, NULL = delete */
    const char *field;    /* must appear in the message */
    const char *why;      /* and so must this */
};

static const struct bad_case bad_cases[] = {
    /* unknown model */
    { "model_type", "\"llama\"", "model_type", "unknown" },
    { "architectures", "[\"LlamaForCausalLM\"]", "architectures", "not supported" },
    /* missing required fields */
    { "model_type", NULL, "model_type", "missing" },
    { "hidden_size", NULL, "hidden_size", "missing" },
    { "compress_ratios", NULL, "compress_ratios", "missing" },
    { "num_key_value_heads", NULL, "num_key_value_heads", "missing" },
    { "hidden_size", "null", "hidden_size", "missing" },
    { "quantization_config", NULL, "quantization_config", "missing" },
    { "quantization_config.weight_block_size", NULL, "quantization_config.weight_block_size",
      "missing" },
    /* wrong JSON types */
    { "vocab_size", "\"129280\"", "vocab_size", "wrong type" },
    { "hidden_size", "4096.5", "hidden_size", "wrong type" },
    { "rope_theta", "\"10000\"", "rope_theta", "wrong type" },
    { "norm_topk_prob", "1", "norm_topk_prob", "wrong type" },
    { "compress_ratios", "4", "compress_ratios", "wrong type" },
    { "compress_ratios", "[0, \"4\"]", "compress_ratios", "wrong type" },
    { "rope_scaling", "16", "rope_scaling", "wrong type" },
    { "rope_scaling.factor", "\"16\"", "rope_scaling.factor", "wrong type" },
    { "quantization_config", "\"fp8\"", "quantization_config", "wrong type" },
    { "scoring_func", "3", "scoring_func", "wrong type" },
    { "architectures", "\"DeepseekV4ForCausalLM\"", "architectures", "wrong type" },
    /* out of range */
    { "vocab_size", "0", "vocab_size", "out of range" },
    { "vocab_size", "-5", "vocab_size", "out of range" },
    { "vocab_size", "1099511627776", "vocab_size", "out of range" },
    { "num_key_value_heads", "8", "num_key_value_heads", "must be 1" },
    { "index_head_dim", "64", "index_head_dim", "128" },
    { "n_shared_experts", "2", "n_shared_experts", "must be 1" },
    { "hc_mult", "9", "hc_mult", "out of range" },
    { "hc_mult", "0", "hc_mult", "out of range" },
    { "sliding_window", "0", "sliding_window", "out of range" },
    { "rms_norm_eps", "0", "rms_norm_eps", "out of range" },
    { "rope_scaling.factor", "0.5", "rope_scaling.factor", "out of range" },
    { "quantization_config.weight_block_size", "[64, 64]",
      "quantization_config.weight_block_size", "[128, 128]" },
    { "quantization_config.weight_block_size", "[128]",
      "quantization_config.weight_block_size", "entries" },
    { "quantization_config.quant_method", "\"int8\"", "quantization_config.quant_method",
      "not supported" },
    { "expert_dtype", "\"fp8\"", "expert_dtype", "not supported" },
    { "scoring_func", "\"softmax\"", "scoring_func", "not supported" },
    { "tie_word_embeddings", "true", "tie_word_embeddings", "not supported" },
    { "hidden_size", "4100", "hidden_size", "multiple of 32" },
    { "hidden_size", "4000", "hidden_size", "multiple of 128" },
    { "moe_intermediate_size", "2000", "moe_intermediate_size", "multiple of 32" },
    { "q_lora_rank", "1000", "q_lora_rank", "multiple of 128" },
    { "compress_ratios", ratios_bad5, "compress_ratios", "entry 5 is 64" },
    /* contradictions */
    { "compress_ratios", "[0, 0, 4, 128]", "compress_ratios", "4 entries" },
    { "num_nextn_predict_layers", "2", "compress_ratios", "44 entries" },
    { "num_hidden_layers", "42", "compress_ratios", "44 entries" },
    { "compress_ratios", ratios_mtp4, "compress_ratios", "MTP" },
    { "head_dim", "64", "head_dim", "qk_rope_head_dim" },
    { "o_groups", "5", "o_groups", "num_attention_heads" },
    { "n_routed_experts", "4", "num_experts_per_tok", "exceeds n_routed_experts 4" },
    /* the routers' and the kernels' bounds; RoPE bases of 1 or less */
    { "num_experts_per_tok", "65", "num_experts_per_tok", "at most 64" },
    /* sizes a rank allocates from: past a cap, named here, not at the
     * start's allocation */
    { "sliding_window", "2147483647", "sliding_window", "at most 8192" },
    { "index_topk", "2147483647", "index_topk", "at most 8192" },
    { "index_n_heads", "100000", "index_n_heads", "at most 1024" },
    { "hc_sinkhorn_iters", "1000000", "hc_sinkhorn_iters", "at most 1000" },
    { "vocab_size", "100000000", "vocab_size", "at most 16777216" },
    { "n_routed_experts", "4097", "n_routed_experts", "at most 4096" },
    { "rope_theta", "1", "rope_theta", "must be > 1" },
    { "compress_rope_theta", "0.5", "compress_rope_theta", "must be > 1" },
    { "num_hidden_layers", "2147483647", "num_hidden_layers", "2147483647 + 1 MTP layers" },
    { "num_hash_layers", "44", "num_hash_layers", "num_hidden_layers" },
    { "bos_token_id", "200000", "bos_token_id", "vocab_size" },
    { "rope_scaling.beta_fast", "0.5", "rope_scaling.beta_fast", "beta_slow" },
};

static void
test_errors(void **state)
{
    struct dsv4_config c, before;

    (void)state;
    ratios_json(ratios_bad5, sizeof(ratios_bad5), 5, 64);
    ratios_json(ratios_mtp4, sizeof(ratios_mtp4), 43, 4);
    for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
        const struct bad_case *b = &bad_cases[i];
        enum dsv4_err e;

        memset(&c, 0x5a, sizeof(c));
        before = c;
        dsv4_err_clear();
        e = parse_mutated(&c, b->path, b->value);
        if (e != DSV4_ERR_CONFIG || strstr(dsv4_errmsg(), "test.json") == NULL ||
            strstr(dsv4_errmsg(), b->field) == NULL || strstr(dsv4_errmsg(), b->why) == NULL)
            fail_msg("case %zu (%s = %s): err %d, message '%s'", i, b->path,
                     b->value ? b->value : "(deleted)", (int)e, dsv4_errmsg());
        /* a failed parse leaves the output untouched */
        assert_memory_equal(&c, &before, sizeof(c));
    }
}

static void
test_bad_json(void **state)
{
    struct dsv4_config c;
    static const char *const docs[] = {
        "", "{", "[1, 2]", "{\"model_type\": \"deepseek_v4\"} trailing", "not json",
    };

    (void)state;
    for (size_t i = 0; i < sizeof(docs) / sizeof(docs[0]); i++) {
        assert_int_equal(parse_str(&c, docs[i]), DSV4_ERR_CONFIG);
        assert_non_null(strstr(dsv4_errmsg(), "test.json"));
    }
    assert_int_equal(dsv4_config_load(&c, "/nonexistent/dir/config.json"), DSV4_ERR_SYS);
    assert_non_null(strstr(dsv4_errmsg(), "/nonexistent/dir/config.json"));
}

/* official_json with its first `from` replaced by `to`, into doc. */
static void
splice(char *doc, size_t size, const char *from, const char *to)
{
    const char *at = strstr(official_json, from);

    assert_non_null(at);
    assert_true(strlen(official_json) + strlen(to) < size);
    snprintf(doc, size, "%.*s%s%s", (int)(at - official_json), official_json, to,
             at + strlen(from));
}

/* A key written twice (json-c keeps the last) is refused, naming it: at the
 * top level and inside quantization_config. */
static void
test_duplicate_keys(void **state)
{
    static const struct {
        const char *from, *to, *key;
    } dups[] = {
        { "  \"vocab_size\": 129280\n", "  \"vocab_size\": 5,\n  \"vocab_size\": 129280\n",
          "vocab_size" },
        { "\"quant_method\": \"fp8\"", "\"quant_method\": \"fp8\", \"quant_method\": \"fp8\"",
          "quant_method" },
    };
    struct dsv4_config c;

    (void)state;
    assert_int_equal(parse_str(&c, official_json), DSV4_OK);
    for (size_t i = 0; i < sizeof(dups) / sizeof(dups[0]); i++) {
        char doc[8192];

        splice(doc, sizeof(doc), dups[i].from, dups[i].to);
        assert_int_equal(parse_str(&c, doc), DSV4_ERR_CONFIG);
        assert_non_null(strstr(dsv4_errmsg(), dups[i].key));
        assert_non_null(strstr(dsv4_errmsg(), "twice"));
    }
}

/* One key in two sibling objects is no duplicate: rope_scaling's "factor"
 * again in another object, beside a real duplicate deeper than the scan
 * looks (json-c keeps the last; the object is not the model's) is
 * accepted, and a duplicate in the second object is named as itself, not
 * as the key the siblings share (it was named "factor"). */
static void
test_duplicate_siblings(void **state)
{
    static const char *from = "  \"vocab_size\": 129280\n";
    struct dsv4_config c;
    char doc[8192];

    (void)state;
    splice(doc, sizeof(doc), from, "  \"text_config\": {\"factor\": 2},\n"
           "  \"extra\": {\"x\": {\"a\": 1, \"a\": 2}},\n  \"vocab_size\": 129280\n");
    if (parse_str(&c, doc) != DSV4_OK)
        fail_msg("%s", dsv4_errmsg());
    splice(doc, sizeof(doc), from, "  \"text_config\": {\"factor\": 2, \"beta\": 1, "
           "\"beta\": 2},\n  \"vocab_size\": 129280\n");
    assert_int_equal(parse_str(&c, doc), DSV4_ERR_CONFIG);
    assert_non_null(strstr(dsv4_errmsg(), "key \"beta\" appears twice"));
}

/* json-c skips C and C++ comments, even in strict mode: their brackets,
 * quotes and key-like text are not keys (the duplicate scan once read the
 * brackets of a `//` comment as real ones and indexed before its depth
 * table: tests/fuzz/crashes/mconf-crash-1ce7305...), and a key written
 * twice around a comment is still found. */
static void
test_comments(void **state)
{
    static const char *from = "  \"vocab_size\": 129280\n";
    static const struct {
        const char *to;
        enum dsv4_err want;
    } docs[] = {
        { "  \"vocab_size\": 129280 // }}}] \"vocab_size\": 7, 'x' {\n", DSV4_OK },
        { "  /* ]] \"vocab_size\": 7, } */ \"vocab_size\": 129280\n", DSV4_OK },
        { "  \"vocab_size\": 5, // the first\n  \"vocab_size\": 129280\n", DSV4_ERR_CONFIG },
    };
    struct dsv4_config c;

    (void)state;
    for (size_t i = 0; i < sizeof(docs) / sizeof(docs[0]); i++) {
        char doc[8192];

        splice(doc, sizeof(doc), from, docs[i].to);
        assert_int_equal(parse_str(&c, doc), docs[i].want);
        if (docs[i].want == DSV4_OK)
            assert_int_equal(c.vocab_size, 129280);
        else
            assert_non_null(strstr(dsv4_errmsg(), "vocab_size"));
    }
}

/* A struct-level check names the field too. */
static void
test_validate_struct(void **state)
{
    struct dsv4_config c;

    (void)state;
    assert_int_equal(dsv4_config_preset(&c, "flash"), DSV4_OK);
    c.index_topk = 0;
    assert_int_equal(dsv4_config_validate(&c), DSV4_ERR_CONFIG);
    assert_non_null(strstr(dsv4_errmsg(), "index_topk"));
    assert_int_equal(dsv4_config_preset(&c, "small"), DSV4_OK);
    c.num_attention_heads = 3;   /* 3 % o_groups 2 */
    assert_int_equal(dsv4_config_validate(&c), DSV4_ERR_CONFIG);
    assert_non_null(strstr(dsv4_errmsg(), "o_groups"));
}

/* Round trip through a file in a fresh temporary directory. */
static void
roundtrip(const struct dsv4_config *c, struct dsv4_config *back, json_object **doc)
{
    char dir[] = "/tmp/dsv4-test-config-XXXXXX", path[64];

    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/config.json", dir);
    assert_int_equal(dsv4_config_write(c, path), DSV4_OK);
    assert_int_equal(dsv4_config_load(back, path), DSV4_OK);
    *doc = json_object_from_file(path);
    assert_non_null(*doc);
    unlink(path);
    rmdir(dir);
}

static void
test_presets(void **state)
{
    static const char *const names[] = { "flash", "small", "tiny" };
    struct dsv4_config c, back;
    json_object *doc, *v;

    (void)state;
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(dsv4_config_preset(&c, names[i]), DSV4_OK);
        assert_int_equal(dsv4_config_validate(&c), DSV4_OK);
        roundtrip(&c, &back, &doc);
        assert_memory_equal(&c, &back, sizeof(c));
        /* official form: ratios as a list, expert_dtype present */
        assert_true(json_object_object_get_ex(doc, "compress_ratios", &v));
        assert_true(json_object_is_type(v, json_type_array));
        assert_int_equal(json_object_array_length(v), c.num_hidden_layers + 1);
        assert_true(json_object_object_get_ex(doc, "expert_dtype", &v));
        assert_string_equal(json_object_get_string(v), "fp4");
        assert_true(json_object_object_get_ex(doc, "rope_scaling", &v));
        assert_true(json_object_is_type(v, json_type_object));
        json_object_put(doc);
    }

    /* small: every layer kind, both routings; tiny: 4 layers, test vocab */
    assert_int_equal(dsv4_config_preset(&c, "small"), DSV4_OK);
    assert_int_equal(c.vocab_size, 129280);
    assert_int_equal(c.num_hidden_layers, 6);
    assert_int_equal(c.hidden_size, 256);
    assert_int_equal(c.compress_ratios[2], 4);
    assert_int_equal(c.compress_ratios[3], 128);
    assert_int_equal(c.compress_ratios[6], 0);
    assert_int_equal(c.num_hash_layers, 3);
    assert_true(c.swiglu_limit == 10.0 && c.routed_scaling_factor == 1.5);
    assert_int_equal(dsv4_config_preset(&c, "tiny"), DSV4_OK);
    assert_int_equal(c.vocab_size, 1024);
    assert_int_equal(c.num_hidden_layers, 4);
    assert_int_equal(c.n_compress_ratios, 5);
    assert_int_equal(c.num_hash_layers, 2);

    assert_int_equal(dsv4_config_preset(&c, "huge"), DSV4_ERR_INVAL);

    /* a config without expert_dtype (initial revision) stays without it */
    assert_int_equal(dsv4_config_preset(&c, "tiny"), DSV4_OK);
    c.expert_dtype[0] = '\0';
    roundtrip(&c, &back, &doc);
    assert_memory_equal(&c, &back, sizeof(c));
    assert_false(json_object_object_get_ex(doc, "expert_dtype", &v));
    json_object_put(doc);
}

static void
test_override(void **state)
{
    struct dsv4_config c, before;
    const char *ok1[] = { "vocab_size=512", "sliding_window=8", "index_topk=4" };
    const char *ok2[] = { "num_hidden_layers=3", "compress_ratios=[0,4,128,0]",
                          "rope_scaling.factor=8", "expert_dtype=", "num_hash_layers=1" };
    const char *bad1[] = { "num_hidden_layers=5" };
    const char *bad2[] = { "num_key_value_heads=null" };
    const char *bad3[] = { "novalue" };
    const char *bad4[] = { "hidden_size=abc" };
    const char *bad5[] = { "hiden_size=256" };
    const char *bad6[] = { "rope_scaling.hidden_size=256" };
    const char *ok3[] = { "dtype=float32", "rope_scaling.rope_type=yarn" };

    (void)state;
    assert_int_equal(dsv4_config_preset(&c, "tiny"), DSV4_OK);
    assert_int_equal(dsv4_config_override(&c, 3, ok1), DSV4_OK);
    assert_int_equal(c.vocab_size, 512);
    assert_int_equal(c.sliding_window, 8);
    assert_int_equal(c.index_topk, 4);
    assert_int_equal(c.hidden_size, 256);

    assert_int_equal(dsv4_config_override(&c, 5, ok2), DSV4_OK);
    assert_int_equal(c.num_hidden_layers, 3);
    assert_int_equal(c.n_compress_ratios, 4);
    assert_int_equal(c.compress_ratios[2], 128);
    assert_true(c.rope_factor == 8.0);
    assert_string_equal(c.expert_dtype, "");
    assert_int_equal(c.num_hash_layers, 1);

    before = c;
    assert_int_equal(dsv4_config_override(&c, 1, bad1), DSV4_ERR_CONFIG);
    assert_non_null(strstr(dsv4_errmsg(), "compress_ratios"));
    assert_memory_equal(&c, &before, sizeof(c));
    assert_int_equal(dsv4_config_override(&c, 1, bad2), DSV4_ERR_CONFIG);
    assert_non_null(strstr(dsv4_errmsg(), "num_key_value_heads"));
    assert_int_equal(dsv4_config_override(&c, 1, bad3), DSV4_ERR_INVAL);
    assert_int_equal(dsv4_config_override(&c, 1, bad4), DSV4_ERR_CONFIG);
    assert_non_null(strstr(dsv4_errmsg(), "hidden_size"));
    /* a misspelt key is refused, not ignored */
    assert_int_equal(dsv4_config_override(&c, 1, bad5), DSV4_ERR_INVAL);
    assert_non_null(strstr(dsv4_errmsg(), "hiden_size"));
    assert_int_equal(dsv4_config_override(&c, 1, bad6), DSV4_ERR_INVAL);
    assert_memory_equal(&c, &before, sizeof(c));
    assert_int_equal(dsv4_config_override(&c, 2, ok3), DSV4_OK);
    assert_string_equal(c.torch_dtype, "float32");
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_official),
        cmocka_unit_test(test_defaults_and_aliases),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_bad_json),
        cmocka_unit_test(test_duplicate_keys),
        cmocka_unit_test(test_duplicate_siblings),
        cmocka_unit_test(test_comments),
        cmocka_unit_test(test_validate_struct),
        cmocka_unit_test(test_presets),
        cmocka_unit_test(test_override),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
