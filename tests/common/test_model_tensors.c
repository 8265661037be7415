/*
 * test_model_tensors.c — the tensor inventory (common/model_tensors.c).
 *
 * Flash: the published numbers of model doc §2.1/§2.6 (tensor count, byte
 * total, dtype histogram, MTP shard, embed shard, logical parameter count)
 * and spot checks of §2.4 shapes.  Small: counts and bytes recomputed here per
 * layer kind from the §2.4 table with the small preset's dimensions.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/model_config.h"
#include "common/model_tensors.h"

static const struct dsv4_tensor_spec *
find(const struct dsv4_inventory *inv, const char *name)
{
    for (int i = 0; i < inv->n; i++)
        if (strcmp(inv->t[i].name, name) == 0)
            return &inv->t[i];
    return NULL;
}

/* Assert tensor `name` exists with this dtype, shape (d1 < 0: 1-D), shard. */
static void
expect(const struct dsv4_inventory *inv, const char *name, enum dsv4_st_dtype dt, int64_t d0,
       int64_t d1, int shard)
{
    const struct dsv4_tensor_spec *s = find(inv, name);

    if (s == NULL)
        fail_msg("missing tensor %s", name);
    assert_int_equal(s->dtype, dt);
    assert_int_equal(s->n_dims, d1 < 0 ? 1 : 2);
    assert_int_equal(s->shape[0], d0);
    if (d1 >= 0)
        assert_int_equal(s->shape[1], d1);
    assert_int_equal(s->shard, shard);
}

static int
cmp_name(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Invariants every inventory must have. */
static void
check_structure(const struct dsv4_inventory *inv)
{
    const char **names = malloc((size_t)inv->n * sizeof(*names));
    uint64_t sum = 0, off = 0;

    assert_non_null(names);
    for (int i = 0; i < inv->n; i++) {
        const struct dsv4_tensor_spec *s = &inv->t[i];
        names[i] = s->name;
        sum += dsv4_tensor_spec_bytes(s);
        assert_true(strncmp(s->name, "model.", 6) != 0);
        assert_true(s->shard >= 1 && s->shard <= inv->n_shards);
        /* shards are contiguous and increasing */
        if (i > 0)
            assert_true(s->shard == inv->t[i - 1].shard || s->shard == inv->t[i - 1].shard + 1);
        /* naturally aligned inside the shard's (8-aligned) data area */
        if (i > 0 && s->shard != inv->t[i - 1].shard)
            off = 0;
        if (off % dsv4_st_dtype_size(s->dtype) != 0)
            fail_msg("%s misaligned at offset %llu", s->name, (unsigned long long)off);
        off += dsv4_tensor_spec_bytes(s);
        /* a quantized weight is followed by its scale */
        if (s->kind == DSV4_TK_FP8_WEIGHT || s->kind == DSV4_TK_FP4_WEIGHT) {
            const struct dsv4_tensor_spec *t = &inv->t[i + 1];
            size_t n = strlen(s->name) - strlen("weight");
            assert_true(i + 1 < inv->n);
            assert_int_equal(t->kind, s->kind == DSV4_TK_FP8_WEIGHT ? DSV4_TK_FP8_SCALE
                                                                    : DSV4_TK_FP4_SCALE);
            assert_memory_equal(t->name, s->name, n);
            assert_string_equal(t->name + n, "scale");
        }
    }
    assert_int_equal(inv->t[0].shard, 1);
    assert_int_equal(inv->t[inv->n - 1].shard, inv->n_shards);
    assert_true(sum == inv->total_bytes);
    qsort(names, (size_t)inv->n, sizeof(*names), cmp_name);
    for (int i = 1; i < inv->n; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            fail_msg("duplicate tensor name %s", names[i]);
    free(names);
}

static void
test_flash(void **state)
{
    struct dsv4_config c;
    struct dsv4_inventory inv;
    int hist[DSV4_ST__COUNT] = { 0 };
    int mtp_n = 0, embed_n = 0;
    uint64_t mtp_bytes = 0, embed_bytes = 0, params = 0;
    char name[64];

    (void)state;
    assert_int_equal(dsv4_config_preset(&c, "flash"), DSV4_OK);
    assert_int_equal(dsv4_inventory_build(&inv, &c), DSV4_OK);
    assert_int_equal(inv.n, 69187);
    assert_true(inv.total_bytes == 159609485896ull);
    assert_int_equal(inv.n_shards, 46);
    check_structure(&inv);

    for (int i = 0; i < inv.n; i++) {
        const struct dsv4_tensor_spec *s = &inv.t[i];
        uint64_t b = dsv4_tensor_spec_bytes(s);
        hist[s->dtype]++;
        if (s->shard == 46) {
            mtp_n++;
            mtp_bytes += b;
            assert_true(strncmp(s->name, "mtp.0.", 6) == 0);
            assert_int_equal(s->layer, 43);
        }
        if (s->shard == 1) {
            embed_n++;
            embed_bytes += b;
        }
        /* logical parameters: FP4 counts 2 per byte; scales, tid2eid excluded */
        if (s->kind == DSV4_TK_FP4_WEIGHT)
            params += 2 * b;
        else if (s->kind != DSV4_TK_FP8_SCALE && s->kind != DSV4_TK_FP4_SCALE &&
                 s->kind != DSV4_TK_TID2EID)
            params += b / dsv4_st_dtype_size(s->dtype);
    }
    /* model doc §2.6 */
    assert_int_equal(hist[DSV4_ST_BF16], 433);
    assert_int_equal(hist[DSV4_ST_F32], 417);
    assert_int_equal(hist[DSV4_ST_F8_E4M3], 375);
    assert_int_equal(hist[DSV4_ST_F8_E8M0], 34167);
    assert_int_equal(hist[DSV4_ST_I8], 33792);
    assert_int_equal(hist[DSV4_ST_I64], 3);
    assert_int_equal(mtp_n, 1575);
    assert_true(mtp_bytes == 3593787756ull);
    assert_true(params == 290942289362ull);
    /* model doc §2.1 */
    assert_int_equal(embed_n, 1);
    assert_true(embed_bytes == 1059061760ull);

    /* model doc §2.4 spot checks */
    expect(&inv, "embed.weight", DSV4_ST_BF16, 129280, 4096, 1);
    expect(&inv, "layers.0.hc_attn_fn", DSV4_ST_F32, 24, 16384, 2);
    expect(&inv, "layers.0.hc_ffn_scale", DSV4_ST_F32, 3, -1, 2);
    expect(&inv, "layers.0.attn.attn_sink", DSV4_ST_F32, 64, -1, 2);
    expect(&inv, "layers.0.attn.wq_a.weight", DSV4_ST_F8_E4M3, 1024, 4096, 2);
    expect(&inv, "layers.0.attn.wq_a.scale", DSV4_ST_F8_E8M0, 8, 32, 2);
    expect(&inv, "layers.0.attn.wq_b.scale", DSV4_ST_F8_E8M0, 256, 8, 2);
    expect(&inv, "layers.0.attn.wkv.weight", DSV4_ST_F8_E4M3, 512, 4096, 2);
    expect(&inv, "layers.5.attn.wo_a.weight", DSV4_ST_F8_E4M3, 8192, 4096, 7);
    expect(&inv, "layers.5.attn.wo_b.scale", DSV4_ST_F8_E8M0, 32, 64, 7);
    expect(&inv, "layers.2.ffn.gate.tid2eid", DSV4_ST_I64, 129280, 6, 4);
    expect(&inv, "layers.3.ffn.gate.bias", DSV4_ST_F32, 256, -1, 5);
    expect(&inv, "layers.2.attn.compressor.ape", DSV4_ST_F32, 4, 1024, 4);
    expect(&inv, "layers.3.attn.compressor.ape", DSV4_ST_F32, 128, 512, 5);
    expect(&inv, "layers.3.attn.compressor.wkv.weight", DSV4_ST_BF16, 512, 4096, 5);
    expect(&inv, "layers.4.attn.compressor.wgate.weight", DSV4_ST_BF16, 1024, 4096, 6);
    expect(&inv, "layers.4.attn.compressor.norm.weight", DSV4_ST_BF16, 512, -1, 6);
    expect(&inv, "layers.2.attn.indexer.wq_b.weight", DSV4_ST_F8_E4M3, 8192, 1024, 4);
    expect(&inv, "layers.2.attn.indexer.wq_b.scale", DSV4_ST_F8_E8M0, 64, 8, 4);
    expect(&inv, "layers.2.attn.indexer.weights_proj.weight", DSV4_ST_BF16, 64, 4096, 4);
    expect(&inv, "layers.2.attn.indexer.compressor.ape", DSV4_ST_F32, 4, 256, 4);
    expect(&inv, "layers.2.attn.indexer.compressor.norm.weight", DSV4_ST_BF16, 128, -1, 4);
    expect(&inv, "layers.42.ffn.shared_experts.w2.weight", DSV4_ST_F8_E4M3, 4096, 2048, 44);
    expect(&inv, "layers.42.ffn.shared_experts.w2.scale", DSV4_ST_F8_E8M0, 32, 16, 44);
    expect(&inv, "layers.42.ffn.experts.255.w1.weight", DSV4_ST_I8, 2048, 2048, 44);
    expect(&inv, "layers.42.ffn.experts.255.w1.scale", DSV4_ST_F8_E8M0, 2048, 128, 44);
    expect(&inv, "layers.42.ffn.experts.255.w2.weight", DSV4_ST_I8, 4096, 1024, 44);
    expect(&inv, "layers.42.ffn.experts.255.w2.scale", DSV4_ST_F8_E8M0, 4096, 64, 44);
    expect(&inv, "hc_head_fn", DSV4_ST_F32, 4, 16384, 45);
    expect(&inv, "hc_head_base", DSV4_ST_F32, 4, -1, 45);
    expect(&inv, "hc_head_scale", DSV4_ST_F32, 1, -1, 45);
    expect(&inv, "norm.weight", DSV4_ST_BF16, 4096, -1, 45);
    expect(&inv, "head.weight", DSV4_ST_BF16, 129280, 4096, 45);
    expect(&inv, "mtp.0.e_proj.weight", DSV4_ST_F8_E4M3, 4096, 4096, 46);
    expect(&inv, "mtp.0.h_proj.scale", DSV4_ST_F8_E8M0, 32, 32, 46);
    expect(&inv, "mtp.0.enorm.weight", DSV4_ST_BF16, 4096, -1, 46);
    expect(&inv, "mtp.0.hnorm.weight", DSV4_ST_BF16, 4096, -1, 46);
    expect(&inv, "mtp.0.norm.weight", DSV4_ST_BF16, 4096, -1, 46);
    expect(&inv, "mtp.0.hc_head_fn", DSV4_ST_F32, 4, 16384, 46);
    expect(&inv, "mtp.0.ffn.gate.bias", DSV4_ST_F32, 256, -1, 46);
    expect(&inv, "mtp.0.ffn.experts.0.w3.weight", DSV4_ST_I8, 2048, 2048, 46);
    /* absent by layer kind */
    assert_null(find(&inv, "layers.3.ffn.gate.tid2eid"));
    assert_null(find(&inv, "layers.2.ffn.gate.bias"));
    assert_null(find(&inv, "layers.0.attn.compressor.ape"));
    assert_null(find(&inv, "layers.3.attn.indexer.wq_b.weight"));
    assert_null(find(&inv, "mtp.0.attn.compressor.ape"));
    assert_null(find(&inv, "mtp.0.ffn.gate.tid2eid"));
    assert_null(find(&inv, "mtp.0.embed.weight"));
    assert_null(find(&inv, "mtp.0.head.weight"));

    dsv4_shard_name(name, sizeof(name), 3, 46);
    assert_string_equal(name, "model-00003-of-00046.safetensors");
    dsv4_inventory_free(&inv);
    assert_null(inv.t);
}

/*
 * Small preset, recomputed from the §2.4 table: D 256, H 4, Dh 128, Rq 128,
 * G 2, R 128, I 128, E 8, top-2, n 4, V 129280, indexer 4 x 128.
 */
#define S_D 256
#define S_H 4
#define S_DH 128
#define S_RQ 128
#define S_G 2
#define S_R 128
#define S_I 128
#define S_E 8
#define S_K 2
#define S_N 4
#define S_V 129280
#define S_NI 4

/* bytes of an FP8 [o, i] weight + its scale */
static uint64_t
fp8_bytes(uint64_t o, uint64_t i)
{
    return o * i + ((o + 127) / 128) * ((i + 127) / 128);
}

/* bytes of an FP4 logical [o, i] weight + its scale */
static uint64_t
fp4_bytes(uint64_t o, uint64_t i)
{
    return o * i / 2 + o * i / 32;
}

static uint64_t
compressor_bytes(uint64_t r, uint64_t d)
{
    uint64_t cd = (r == 4 ? 2 : 1) * d;

    return 4 * r * cd + 2 * 2 * cd * S_D + 2 * d;
}

/* One block of ratio r (hash: tid2eid instead of gate.bias); *n tensors. */
static uint64_t
layer_bytes(int r, int hash, int *n)
{
    uint64_t mix = (2 + S_N) * S_N, b = 0;

    *n = 77 + (r ? 4 : 0) + (r == 4 ? 7 : 0);
    b += 2 * 4 * mix * S_N * S_D + 2 * 4 * mix + 2 * 4 * 3;    /* hc_attn/ffn */
    b += 2 * 2 * S_D;                                          /* attn/ffn norms */
    b += 4 * S_H;                                              /* sink */
    b += fp8_bytes(S_RQ, S_D) + 2 * S_RQ;                      /* wq_a, q_norm */
    b += fp8_bytes(S_H * S_DH, S_RQ);                          /* wq_b */
    b += fp8_bytes(S_DH, S_D) + 2 * S_DH;                      /* wkv, kv_norm */
    b += fp8_bytes(S_G * S_R, S_H * S_DH / S_G);               /* wo_a */
    b += fp8_bytes(S_D, S_G * S_R);                            /* wo_b */
    if (r)
        b += compressor_bytes((uint64_t)r, S_DH);
    if (r == 4)
        b += fp8_bytes(S_NI * 128, S_RQ) + 2 * S_NI * S_D + compressor_bytes(4, 128);
    b += 2 * S_E * S_D;                                        /* gate.weight */
    b += hash ? 8 * (uint64_t)S_V * S_K : 4 * S_E;             /* tid2eid / bias */
    b += 2 * fp8_bytes(S_I, S_D) + fp8_bytes(S_D, S_I);        /* shared expert */
    b += S_E * (2 * fp4_bytes(S_I, S_D) + fp4_bytes(S_D, S_I)); /* routed */
    return b;
}

static void
test_small(void **state)
{
    static const int ratios[6] = { 0, 0, 4, 128, 4, 128 };
    struct dsv4_config c;
    struct dsv4_inventory inv;
    uint64_t want_bytes, hc_head = 4 * (S_N * S_N * S_D + S_N + 1);
    int want_n, n;

    (void)state;
    assert_int_equal(dsv4_config_preset(&c, "small"), DSV4_OK);
    assert_int_equal(dsv4_inventory_build(&inv, &c), DSV4_OK);
    check_structure(&inv);

    /* embed, 6 layers, hc_head + norm + head, MTP (+ e/h_proj, 3 norms, hc_head) */
    want_n = 1 + 3 + 1 + 1;
    want_bytes = 2 * 2 * (uint64_t)S_V * S_D + hc_head + 2 * S_D;
    for (int l = 0; l < 6; l++) {
        want_bytes += layer_bytes(ratios[l], l < 3, &n);
        want_n += n;
    }
    want_bytes += layer_bytes(0, 0, &n) + 2 * fp8_bytes(S_D, S_D) + 3 * 2 * S_D + hc_head;
    want_n += n + 4 + 3 + 3;
    assert_int_equal(inv.n, want_n);
    assert_true(inv.total_bytes == want_bytes);
    assert_int_equal(inv.n_shards, 1 + 6 + 1 + 1);
    expect(&inv, "layers.2.ffn.gate.tid2eid", DSV4_ST_I64, S_V, S_K, 4);
    expect(&inv, "layers.4.ffn.gate.bias", DSV4_ST_F32, S_E, -1, 6);
    expect(&inv, "layers.5.attn.compressor.ape", DSV4_ST_F32, 128, 128, 7);
    expect(&inv, "layers.4.attn.indexer.compressor.ape", DSV4_ST_F32, 4, 256, 6);
    expect(&inv, "layers.1.attn.wo_a.weight", DSV4_ST_F8_E4M3, 256, 256, 3);
    expect(&inv, "mtp.0.ffn.experts.7.w2.weight", DSV4_ST_I8, S_D, S_I / 2, 9);
    expect(&inv, "head.weight", DSV4_ST_BF16, S_V, S_D, 8);
    dsv4_inventory_free(&inv);

    /* no MTP layer: no MTP shard */
    c.num_nextn_predict_layers = 0;
    c.n_compress_ratios = 6;
    assert_int_equal(dsv4_inventory_build(&inv, &c), DSV4_OK);
    assert_int_equal(inv.n_shards, 1 + 6 + 1);
    assert_null(find(&inv, "mtp.0.e_proj.weight"));
    check_structure(&inv);
    dsv4_inventory_free(&inv);

    /* an invalid config is refused */
    c.num_key_value_heads = 2;
    assert_int_equal(dsv4_inventory_build(&inv, &c), DSV4_ERR_CONFIG);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flash),
        cmocka_unit_test(test_small),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
