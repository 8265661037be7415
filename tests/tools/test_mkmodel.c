/*
 * test_mkmodel.c — dsv4-mkmodel end to end (path of the binary in argv[1]).
 *
 * --inventory output for flash (model doc §2.6 numbers) and for --set
 * overrides; a tiny checkpoint: index total_size and weight_map against the
 * inventory, every shard readable by the safetensors reader with the
 * inventory's dtypes and shapes, config.json round trip, the quantization
 * rules of the generator (minimal power-of-two scales) and the value
 * distributions it documents; determinism in the seed.
 */
#include <dirent.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <json-c/json.h>

#include "common/formats.h"
#include "common/model_config.h"
#include "common/model_tensors.h"
#include "common/safetensors.h"

static const char *mkmodel;          /* path of dsv4-mkmodel */
static char tmpdir[] = "/tmp/dsv4-test-mkmodel-XXXXXX";

/* Run mkmodel with `args` (shell words), capture stdout+stderr into out;
 * returns the exit status. */
static int
run(char *out, size_t len, const char *args)
{
    char cmd[2048];
    size_t n = 0;
    FILE *p;
    int st;

    snprintf(cmd, sizeof(cmd), "'%s' %s 2>&1", mkmodel, args);
    p = popen(cmd, "r");
    assert_non_null(p);
    while (n + 1 < len && fgets(out + n, (int)(len - n), p) != NULL)
        n += strlen(out + n);
    out[n] = '\0';
    st = pclose(p);
    assert_true(WIFEXITED(st));
    return WEXITSTATUS(st);
}

static void
test_inventory_flash(void **state)
{
    char out[256];

    (void)state;
    assert_int_equal(run(out, sizeof(out), "--preset flash --inventory"), 0);
    assert_string_equal(out, "tensors=69187 bytes=159609485896\n");
}

static void
test_inventory_overrides(void **state)
{
    const char *sets[] = { "vocab_size=512", "sliding_window=8", "index_topk=4" };
    struct dsv4_config c;
    struct dsv4_inventory inv;
    char out[512], want[128];

    (void)state;
    assert_int_equal(dsv4_config_preset(&c, "tiny"), DSV4_OK);
    assert_int_equal(dsv4_config_override(&c, 3, sets), DSV4_OK);
    assert_int_equal(dsv4_inventory_build(&inv, &c), DSV4_OK);
    snprintf(want, sizeof(want), "tensors=%d bytes=%llu\n", inv.n,
             (unsigned long long)inv.total_bytes);
    dsv4_inventory_free(&inv);
    assert_int_equal(run(out, sizeof(out), "--preset tiny --set vocab_size=512 "
                                           "--set sliding_window=8 --set index_topk=4 "
                                           "--inventory"), 0);
    assert_string_equal(out, want);

    /* errors: a bad --set names its field; it, an unknown preset and bad
     * usage are bad option values, status 2 (docs/operations.md) */
    assert_int_equal(run(out, sizeof(out), "--preset tiny --set num_key_value_heads=2 "
                                           "--inventory"), 2);
    assert_non_null(strstr(out, "num_key_value_heads"));
    assert_int_equal(run(out, sizeof(out), "--preset nosuch --inventory"), 2);
    assert_non_null(strstr(out, "nosuch"));
    assert_int_equal(run(out, sizeof(out), "--preset tiny"), 2);
    assert_int_equal(run(out, sizeof(out), "--preset tiny --config x.json --inventory"), 2);
    /* a seed is decimal from its first character: " -1" wrapped to 2^64 - 1,
     * and 0x10 read as 16 (010 as 8, the same checkpoint as --seed 8) */
    assert_int_equal(run(out, sizeof(out), "--preset tiny --seed ' -1' --inventory"), 2);
    assert_non_null(strstr(out, "bad --seed"));
    assert_int_equal(run(out, sizeof(out), "--preset tiny --seed 0x10 --inventory"), 2);
}

/* Whole file into memory. */
static unsigned char *
slurp(const char *path, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    unsigned char *buf;
    long n;

    if (fp == NULL)
        fail_msg("cannot open %s", path);
    fseek(fp, 0, SEEK_END);
    n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    *len = (size_t)n;
    return buf;
}

/* 1 if dirs a and b hold the file `name` with equal bytes. */
static int
same_file(const char *a, const char *b, const char *name)
{
    char pa[512], pb[512];
    unsigned char *x, *y;
    size_t nx, ny;
    int same;

    snprintf(pa, sizeof(pa), "%s/%s", a, name);
    snprintf(pb, sizeof(pb), "%s/%s", b, name);
    x = slurp(pa, &nx);
    y = slurp(pb, &ny);
    same = nx == ny && memcmp(x, y, nx) == 0;
    free(x);
    free(y);
    return same;
}

/* Generate tiny into tmpdir/sub with `seed`. */
static void
make_tiny(const char *sub, int seed, char *dir, size_t len)
{
    char args[1024], out[1024];

    snprintf(dir, len, "%s/%s", tmpdir, sub);
    snprintf(args, sizeof(args), "--preset tiny --seed %d --out '%s'", seed, dir);
    if (run(out, sizeof(out), args) != 0)
        fail_msg("mkmodel failed: %s", out);
}

/* Index and shards against the inventory; config round trip. */
static void
check_layout(const char *dir, const struct dsv4_inventory *inv, const struct dsv4_config *cfg)
{
    char path[512], file[64];
    struct dsv4_config back;
    struct dsv4_ckpt *ck;
    json_object *idx, *meta, *map, *v;

    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    idx = json_object_from_file(path);
    assert_non_null(idx);
    assert_true(json_object_object_get_ex(idx, "metadata", &meta));
    assert_true(json_object_object_get_ex(meta, "total_size", &v));
    assert_true((uint64_t)json_object_get_int64(v) == inv->total_bytes);
    assert_true(json_object_object_get_ex(idx, "weight_map", &map));
    assert_int_equal(json_object_object_length(map), inv->n);
    for (int i = 0; i < inv->n; i++) {
        dsv4_shard_name(file, sizeof(file), inv->t[i].shard, inv->n_shards);
        if (!json_object_object_get_ex(map, inv->t[i].name, &v))
            fail_msg("%s not in weight_map", inv->t[i].name);
        assert_string_equal(json_object_get_string(v), file);
    }
    json_object_put(idx);

    assert_int_equal(dsv4_ckpt_open(&ck, dir), DSV4_OK);
    assert_int_equal(dsv4_ckpt_count(ck), inv->n);
    for (int i = 0; i < inv->n; i++) {
        const struct dsv4_tensor_spec *s = &inv->t[i];
        const struct dsv4_st_tensor *t = dsv4_ckpt_find(ck, s->name);
        assert_non_null(t);
        assert_int_equal(t->dtype, s->dtype);
        assert_int_equal(t->n_dims, s->n_dims);
        for (int d = 0; d < s->n_dims; d++)
            assert_int_equal(t->shape[d], s->shape[d]);
        dsv4_shard_name(file, sizeof(file), s->shard, inv->n_shards);
        assert_non_null(strstr(t->file, file));
    }
    dsv4_ckpt_close(ck);

    snprintf(path, sizeof(path), "%s/config.json", dir);
    assert_int_equal(dsv4_config_load(&back, path), DSV4_OK);
    assert_memory_equal(&back, cfg, sizeof(back));
}

/* Mean and standard deviation accumulated in double. */
struct stats {
    double n, s, ss;
};

static void
acc(struct stats *st, double x)
{
    st->n += 1;
    st->s += x;
    st->ss += x * x;
}

static double
mean(const struct stats *st)
{
    return st->s / st->n;
}

static double
sdev(const struct stats *st)
{
    return sqrt(st->ss / st->n - mean(st) * mean(st));
}

/* FP8 weight: every 128x128 block uses the smallest power-of-two scale that
 * fits (max |code| in [224, 448]); dequantized std ~ 1/sqrt(n_in). */
static void
check_fp8(const struct dsv4_st_tensor *w, const struct dsv4_st_tensor *sc)
{
    int64_t out = w->shape[0], in = w->shape[1], nbc = sc->shape[1];
    const uint8_t *q = w->data, *s = sc->data;
    struct stats st = { 0 };

    for (int64_t rb = 0; rb < sc->shape[0]; rb++) {
        for (int64_t cb = 0; cb < nbc; cb++) {
            float amax = 0, scale = dsv4_e8m0_to_f32(s[rb * nbc + cb]);
            for (int64_t i = rb * 128; i < out && i < rb * 128 + 128; i++) {
                for (int64_t j = cb * 128; j < in && j < cb * 128 + 128; j++) {
                    float v = dsv4_fp8_to_f32(q[i * in + j]);
                    amax = fmaxf(amax, fabsf(v));
                    acc(&st, v * scale);
                }
            }
            if (!(amax >= 224 && amax <= 448))
                fail_msg("%s block %lld,%lld: max |q| %g", w->name, (long long)rb,
                         (long long)cb, amax);
        }
    }
    assert_true(fabs(mean(&st)) < 0.1 / sqrt((double)in));
    assert_true(fabs(sdev(&st) * sqrt((double)in) - 1.0) < 0.1);
}

/* FP4 weight: per row per 32-group, max |e2m1| in [3, 6] (minimal scale);
 * dequantized std ~ 1/sqrt(n_in) (coarse: E2M1 has 3 significant levels). */
static void
check_fp4(const struct dsv4_st_tensor *w, const struct dsv4_st_tensor *sc)
{
    int64_t out = w->shape[0], in = w->shape[1] * 2, ng = in / 32;
    const uint8_t *q = w->data, *s = sc->data;
    struct stats st = { 0 };

    assert_int_equal(sc->shape[1], ng);
    for (int64_t r = 0; r < out; r++) {
        for (int64_t g = 0; g < ng; g++) {
            float amax = 0, scale = dsv4_e8m0_to_f32(s[r * ng + g]);
            for (int64_t j = g * 32; j < g * 32 + 32; j++) {
                float v = dsv4_fp4_get(q + r * (in / 2), (size_t)j);
                amax = fmaxf(amax, fabsf(v));
                acc(&st, v * scale);
            }
            if (!(amax >= 3 && amax <= 6))
                fail_msg("%s row %lld group %lld: max |q| %g", w->name, (long long)r,
                         (long long)g, amax);
        }
    }
    assert_true(fabs(sdev(&st) * sqrt((double)in) - 1.0) < 0.2);
}

/* Values of a plain BF16/F32 tensor. */
static struct stats
plain_stats(const struct dsv4_st_tensor *t)
{
    size_t n = t->n_bytes / (t->dtype == DSV4_ST_BF16 ? 2 : 4);
    struct stats st = { 0 };

    for (size_t i = 0; i < n; i++) {
        float v;
        if (t->dtype == DSV4_ST_BF16) {
            uint16_t h;
            memcpy(&h, (const uint8_t *)t->data + 2 * i, 2);
            v = dsv4_bf16_to_f32(h);
        } else {
            memcpy(&v, (const uint8_t *)t->data + 4 * i, 4);
        }
        acc(&st, v);
    }
    return st;
}

static void
check_values(const char *dir, const struct dsv4_inventory *inv, const struct dsv4_config *cfg)
{
    struct dsv4_ckpt *ck;
    struct stats st;
    int n_fp8 = 0, n_fp4 = 0, n_tid = 0;

    assert_int_equal(dsv4_ckpt_open(&ck, dir), DSV4_OK);
    for (int i = 0; i < inv->n; i++) {
        const struct dsv4_tensor_spec *s = &inv->t[i];
        const struct dsv4_st_tensor *t = dsv4_ckpt_find(ck, s->name);

        switch (s->kind) {
        case DSV4_TK_FP8_WEIGHT:
            check_fp8(t, dsv4_ckpt_find(ck, inv->t[i + 1].name));
            n_fp8++;
            break;
        case DSV4_TK_FP4_WEIGHT:
            if (s->layer == 1) {   /* one layer is plenty */
                check_fp4(t, dsv4_ckpt_find(ck, inv->t[i + 1].name));
                n_fp4++;
            }
            break;
        case DSV4_TK_TID2EID: {
            const int64_t *id = t->data;
            int64_t k = t->shape[1];
            for (int64_t r = 0; r < t->shape[0]; r++) {
                for (int64_t a = 0; a < k; a++) {
                    assert_true(id[r * k + a] >= 0 && id[r * k + a] < cfg->n_routed_experts);
                    for (int64_t b = 0; b < a; b++)
                        assert_true(id[r * k + a] != id[r * k + b]);
                }
            }
            n_tid++;
            break;
        }
        case DSV4_TK_EMBED:
            st = plain_stats(t);
            assert_true(fabs(mean(&st)) < 0.05 && fabs(sdev(&st) - 1.0) < 0.05);
            break;
        case DSV4_TK_NORM:
            st = plain_stats(t);
            assert_true(fabs(mean(&st) - 1.0) < 0.05 && sdev(&st) < 0.2 && sdev(&st) > 0.05);
            break;
        case DSV4_TK_HC_SCALE:
            st = plain_stats(t);
            assert_true(st.s / st.n >= 0.5 && st.s / st.n < 1.5);
            break;
        case DSV4_TK_LINEAR_BF16:
        case DSV4_TK_HC_FN:
            st = plain_stats(t);
            assert_true(fabs(sdev(&st) * sqrt((double)s->shape[1]) - 1.0) < 0.15);
            break;
        default:
            break;
        }
    }
    dsv4_ckpt_close(ck);
    assert_true(n_fp8 > 0 && n_fp4 > 0 && n_tid == cfg->num_hash_layers);
}

static void
test_tiny_checkpoint(void **state)
{
    struct dsv4_config cfg;
    struct dsv4_inventory inv;
    char d1[256], d2[256], d3[256], file[64];
    int n_differ = 0;

    (void)state;
    assert_int_equal(dsv4_config_preset(&cfg, "tiny"), DSV4_OK);
    assert_int_equal(dsv4_inventory_build(&inv, &cfg), DSV4_OK);
    make_tiny("a", 7, d1, sizeof(d1));
    make_tiny("b", 7, d2, sizeof(d2));
    make_tiny("c", 8, d3, sizeof(d3));

    check_layout(d1, &inv, &cfg);
    check_values(d1, &inv, &cfg);

    /* same seed: identical files; other seed: every shard differs */
    assert_true(same_file(d1, d2, "config.json"));
    assert_true(same_file(d1, d2, "model.safetensors.index.json"));
    assert_true(same_file(d1, d3, "config.json"));
    for (int s = 1; s <= inv.n_shards; s++) {
        dsv4_shard_name(file, sizeof(file), s, inv.n_shards);
        assert_true(same_file(d1, d2, file));
        n_differ += !same_file(d1, d3, file);
    }
    assert_int_equal(n_differ, inv.n_shards);
    dsv4_inventory_free(&inv);
}

/* rm -r of what the tests made (two levels). */
static void
cleanup(void)
{
    DIR *d = opendir(tmpdir);
    struct dirent *e;
    char sub[768], path[1024];

    while (d != NULL && (e = readdir(d)) != NULL) {
        DIR *d2;
        struct dirent *e2;
        if (e->d_name[0] == '.')
            continue;
        snprintf(sub, sizeof(sub), "%s/%s", tmpdir, e->d_name);
        d2 = opendir(sub);
        while (d2 != NULL && (e2 = readdir(d2)) != NULL) {
            if (e2->d_name[0] == '.')
                continue;
            snprintf(path, sizeof(path), "%s/%s", sub, e2->d_name);
            unlink(path);
        }
        if (d2 != NULL)
            closedir(d2);
        rmdir(sub);
    }
    if (d != NULL)
        closedir(d);
    rmdir(tmpdir);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_inventory_flash),
        cmocka_unit_test(test_inventory_overrides),
        cmocka_unit_test(test_tiny_checkpoint),
    };
    int rc;

    if (argc != 2) {
        fprintf(stderr, "usage: %s PATH-TO-dsv4-mkmodel\n", argv[0]);
        return 2;
    }
    mkmodel = argv[1];
    if (mkdtemp(tmpdir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    rc = cmocka_run_group_tests(tests, NULL, NULL);
    cleanup();
    return rc;
}
