/*
 * test_safetensors.c — safetensors writer/reader round trip, sharded
 * checkpoints through model.safetensors.index.json, and hostile files: every
 * malformed file must give DSV4_ERR_WEIGHTS (or SYS for an unopenable file)
 * with a message naming the file and, where there is one, the tensor; random
 * header corruption must never crash (run under ASan/UBSan).  A FIFO in
 * place of a file is refused at once; an index naming thousands of shards
 * reports the first missing one.
 */
#include <errno.h>
#include <ftw.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/safetensors.h"

static char tmpdir[512];

/* path = tmpdir/name (static buffer rotation so two paths can coexist). */
static const char *
tpath(const char *name)
{
    static char buf[4][1024];
    static int k;

    k = (k + 1) % 4;
    snprintf(buf[k], sizeof(buf[k]), "%s/%s", tmpdir, name);
    return buf[k];
}

static int
rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static int
setup(void **state)
{
    const char *base = getenv("TMPDIR");

    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "%s/dsv4-st-XXXXXX", base ? base : "/tmp");
    return mkdtemp(tmpdir) == NULL ? -1 : 0;
}

static int
teardown(void **state)
{
    (void)state;
    return nftw(tmpdir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* Write a file from an explicit header text (length field = hlen_field,
 * or the text length when hlen_field < 0) followed by `data_len` bytes. */
static void
write_raw(const char *path, const char *hdr, long long hlen_field, size_t data_len)
{
    FILE *fp = fopen(path, "wb");
    uint64_t h = hlen_field < 0 ? strlen(hdr) : (uint64_t)hlen_field;
    uint8_t len8[8];

    assert_non_null(fp);
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)(h >> (8 * i));
    assert_int_equal(fwrite(len8, 1, 8, fp), 8);
    assert_int_equal(fwrite(hdr, 1, strlen(hdr), fp), strlen(hdr));
    for (size_t i = 0; i < data_len; i++)
        fputc((int)(i & 0xff), fp);
    assert_int_equal(fclose(fp), 0);
}

/* The last error message must contain every fragment of the NULL-terminated
 * list `ap`. */
static void
check_msg(va_list ap)
{
    const char *frag;

    while ((frag = va_arg(ap, const char *)) != NULL) {
        if (strstr(dsv4_errmsg(), frag) == NULL)
            fail_msg("message \"%s\" lacks \"%s\"", dsv4_errmsg(), frag);
    }
}

/* Open must fail with `want`, and the message must contain each of the
 * given fragments (NULL-terminated). */
static void
expect_open_fail(const char *path, enum dsv4_err want, ...)
{
    struct dsv4_st_file *f = (struct dsv4_st_file *)(uintptr_t)1;
    enum dsv4_err err;
    va_list ap;

    dsv4_err_clear();
    err = dsv4_st_open(&f, path);
    if (err != want)
        fail_msg("%s: got %d (%s), want %d", path, err, dsv4_errmsg(), want);
    assert_null(f);
    va_start(ap, want);
    check_msg(ap);
    va_end(ap);
}

static void
expect_ckpt_fail(const char *dir, ...)
{
    struct dsv4_ckpt *c = (struct dsv4_ckpt *)(uintptr_t)1;
    enum dsv4_err err;
    va_list ap;

    err = dsv4_ckpt_open(&c, dir);
    if (err != DSV4_ERR_WEIGHTS)
        fail_msg("%s: got %d (%s), want WEIGHTS", dir, err, dsv4_errmsg());
    assert_null(c);
    va_start(ap, dir);
    check_msg(ap);
    va_end(ap);
}

/* --- a small sample file -------------------------------------------------- */

enum { NT = 5 };
static const char *const s_names[NT] = { "w.weight", "w.scale", "bias", "empty", "scalar" };
static const enum dsv4_st_dtype s_dt[NT] = {
    DSV4_ST_F8_E4M3, DSV4_ST_F8_E8M0, DSV4_ST_F32, DSV4_ST_BF16, DSV4_ST_I64,
};
static const int s_nd[NT] = { 2, 2, 1, 2, 0 };
static const int64_t s_shape[NT][DSV4_ST_MAX_DIMS] = {
    { 3, 5 }, { 1, 1 }, { 3 }, { 0, 4 }, { 0 },
};

/* Deterministic content of sample tensor i, byte j. */
static uint8_t
s_byte(int i, size_t j)
{
    return (uint8_t)(i * 37 + j * 11 + 1);
}

static size_t
s_size(int i)
{
    size_t n = dsv4_st_dtype_size(s_dt[i]);

    for (int d = 0; d < s_nd[i]; d++)
        n *= (size_t)s_shape[i][d];
    return n;
}

/* Write the sample with names prefixed by `prefix`, streaming each tensor
 * in pieces of `chunk` bytes. */
static void
write_sample(const char *path, const char *prefix, size_t chunk)
{
    char nbuf[NT][64];
    const char *names[NT];
    struct dsv4_st_writer *w;

    for (int i = 0; i < NT; i++) {
        snprintf(nbuf[i], sizeof(nbuf[i]), "%s%s", prefix, s_names[i]);
        names[i] = nbuf[i];
    }
    assert_int_equal(dsv4_st_writer_open(&w, path, NT, names, s_dt, s_nd, s_shape), DSV4_OK);
    for (int i = 0; i < NT; i++) {
        uint8_t buf[64];
        size_t n = s_size(i);

        for (size_t j = 0; j < n; j++)
            buf[j] = s_byte(i, j);
        for (size_t j = 0; j < n; j += chunk) {
            size_t k = n - j < chunk ? n - j : chunk;

            assert_int_equal(dsv4_st_writer_put(w, buf + j, k), DSV4_OK);
        }
    }
    assert_int_equal(dsv4_st_writer_close(w), DSV4_OK);
}

static void
check_sample_tensor(const struct dsv4_st_tensor *t, int i, const char *file)
{
    assert_non_null(t);
    assert_int_equal(t->dtype, s_dt[i]);
    assert_int_equal(t->n_dims, s_nd[i]);
    for (int d = 0; d < s_nd[i]; d++)
        assert_int_equal(t->shape[d], s_shape[i][d]);
    assert_int_equal(t->n_bytes, s_size(i));
    assert_string_equal(t->file, file);
    for (size_t j = 0; j < t->n_bytes; j++)
        assert_int_equal(((const uint8_t *)t->data)[j], s_byte(i, j));
}

/* --- tests ----------------------------------------------------------------- */

static void
test_dtypes(void **state)
{
    (void)state;
    for (int d = 1; d < DSV4_ST__COUNT; d++) {
        assert_int_equal(dsv4_st_dtype_parse(dsv4_st_dtype_name(d)), d);
        assert_true(dsv4_st_dtype_size(d) > 0);
    }
    assert_int_equal(dsv4_st_dtype_size(DSV4_ST_I64), 8);
    assert_int_equal(dsv4_st_dtype_size(DSV4_ST_BF16), 2);
    assert_int_equal(dsv4_st_dtype_parse("F8_E5M2"), DSV4_ST_NONE);
    assert_int_equal(dsv4_st_dtype_parse("bf16"), DSV4_ST_NONE);
}

static void
test_roundtrip(void **state)
{
    const char *p = tpath("rt.safetensors");
    struct dsv4_st_file *f;
    uint8_t head[8];
    uint64_t hlen = 0;
    struct stat st;
    FILE *fp;
    size_t total = 0;

    (void)state;
    write_sample(p, "", 4);
    /* layout: header length multiple of 8, padded with spaces */
    fp = fopen(p, "rb");
    assert_non_null(fp);
    assert_int_equal(fread(head, 1, 8, fp), 8);
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | head[i];
    assert_int_equal(hlen % 8, 0);
    {
        char *h = malloc(hlen + 1);

        assert_int_equal(fread(h, 1, hlen, fp), hlen);
        h[hlen] = '\0';
        assert_int_equal(h[0], '{');
        assert_true(strrchr(h, '}') != NULL);
        for (char *q = strrchr(h, '}') + 1; *q != '\0'; q++)
            assert_int_equal(*q, ' ');
        free(h);
    }
    fclose(fp);
    for (int i = 0; i < NT; i++)
        total += s_size(i);
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal((uint64_t)st.st_size, 8 + hlen + total);

    assert_int_equal(dsv4_st_open(&f, p), DSV4_OK);
    assert_int_equal(dsv4_st_count(f), NT);
    for (int i = 0; i < NT; i++) {
        assert_string_equal(dsv4_st_at(f, i)->name, s_names[i]);  /* header order */
        check_sample_tensor(dsv4_st_find(f, s_names[i]), i, p);
    }
    assert_null(dsv4_st_find(f, "nope"));
    assert_null(dsv4_st_at(f, NT));
    dsv4_st_close(f);
    dsv4_st_close(NULL);
}

static void
test_writer_misuse(void **state)
{
    const char *p = tpath("short.safetensors");
    const char *dup[2] = { "a", "a" };
    const enum dsv4_st_dtype dt[2] = { DSV4_ST_F32, DSV4_ST_F32 };
    const int nd[2] = { 1, 1 };
    const int64_t sh[2][DSV4_ST_MAX_DIMS] = { { 2 }, { 1 } };
    const int64_t neg[2][DSV4_ST_MAX_DIMS] = { { -2 }, { 1 } };
    struct dsv4_st_writer *w;
    float v[3] = { 1, 2, 3 };

    (void)state;
    assert_int_equal(dsv4_st_writer_open(&w, p, 2, dup, dt, nd, sh), DSV4_ERR_INVAL);
    assert_non_null(strstr(dsv4_errmsg(), "'a'"));
    dup[1] = "b";
    assert_int_equal(dsv4_st_writer_open(&w, p, 2, dup, dt, nd, neg), DSV4_ERR_INVAL);

    assert_int_equal(dsv4_st_writer_open(&w, p, 2, dup, dt, nd, sh), DSV4_OK);
    /* more than the current tensor holds */
    assert_int_equal(dsv4_st_writer_put(w, v, 12), DSV4_ERR_INVAL);
    assert_non_null(strstr(dsv4_errmsg(), "'a'"));
    assert_int_equal(dsv4_st_writer_put(w, v, 8), DSV4_OK);
    /* closing before "b" is written fails and removes the file */
    assert_int_equal(dsv4_st_writer_close(w), DSV4_ERR_INVAL);
    assert_non_null(strstr(dsv4_errmsg(), "'b'"));
    assert_int_equal(access(p, F_OK), -1);
    assert_int_equal(access(tpath("short.safetensors.tmp"), F_OK), -1);

    assert_int_equal(dsv4_st_writer_open(&w, "/nonexistent-dir/x.safetensors", 2, dup, dt, nd,
                                         sh), DSV4_ERR_SYS);
}

/* A file written over an existing one replaces it whole at the close: a
 * reader that has the old one mapped (a running rank) keeps its bytes, and a
 * write that fails leaves the old file as it was. */
static void
test_writer_replaces(void **state)
{
    const char *p = tpath("replace.safetensors");
    const char *nm[1] = { "c" };
    const enum dsv4_st_dtype dt[1] = { DSV4_ST_F32 };
    const int nd[1] = { 1 };
    const int64_t sh[1][DSV4_ST_MAX_DIMS] = { { 2 } };
    struct dsv4_st_file *old, *cur;
    struct dsv4_st_writer *w;
    float v = 1;

    (void)state;
    write_sample(p, "a.", 7);
    assert_int_equal(dsv4_st_open(&old, p), DSV4_OK);
    write_sample(p, "b.", 7);
    for (int i = 0; i < NT; i++) {
        char name[64];

        snprintf(name, sizeof(name), "a.%s", s_names[i]);
        check_sample_tensor(dsv4_st_find(old, name), i, p);
    }
    assert_int_equal(dsv4_st_open(&cur, p), DSV4_OK);
    assert_null(dsv4_st_find(cur, "a.bias"));
    check_sample_tensor(dsv4_st_find(cur, "b.bias"), 2, p);
    dsv4_st_close(cur);
    /* a write given up half-way: the file at p is still the "b." one */
    assert_int_equal(dsv4_st_writer_open(&w, p, 1, nm, dt, nd, sh), DSV4_OK);
    assert_int_equal(dsv4_st_writer_put(w, &v, sizeof(v)), DSV4_OK);
    assert_int_equal(dsv4_st_writer_close(w), DSV4_ERR_INVAL);
    assert_int_equal(access(tpath("replace.safetensors.tmp"), F_OK), -1);
    assert_int_equal(dsv4_st_open(&cur, p), DSV4_OK);
    check_sample_tensor(dsv4_st_find(cur, "b.bias"), 2, p);
    dsv4_st_close(cur);
    dsv4_st_close(old);
}

static void
test_metadata_ignored(void **state)
{
    const char *p = tpath("meta.safetensors");
    struct dsv4_st_file *f;

    (void)state;
    write_raw(p, "{\"__metadata__\":{\"format\":\"pt\"},"
                 "\"x\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]}}  ", -1, 4);
    assert_int_equal(dsv4_st_open(&f, p), DSV4_OK);
    assert_int_equal(dsv4_st_count(f), 1);
    assert_string_equal(dsv4_st_at(f, 0)->name, "x");
    dsv4_st_close(f);
}

/* A file whose data area is cut short: the last tensor runs past it. */
static void
test_truncated(void **state)
{
    const char *p = tpath("trunc.safetensors");
    struct stat st;

    (void)state;
    write_sample(p, "", 64);
    assert_int_equal(stat(p, &st), 0);
    assert_int_equal(truncate(p, st.st_size - 3), 0);
    expect_open_fail(p, DSV4_ERR_WEIGHTS, p, "'scalar'", "outside the data area", NULL);
    /* cut inside the header */
    assert_int_equal(truncate(p, 40), 0);
    expect_open_fail(p, DSV4_ERR_WEIGHTS, p, "past the end", NULL);
    assert_int_equal(truncate(p, 5), 0);
    expect_open_fail(p, DSV4_ERR_WEIGHTS, p, "shorter", NULL);
}

static void
test_header_len_past_end(void **state)
{
    const char *p = tpath("hlen.safetensors");

    (void)state;
    write_raw(p, "{}", 1000, 0);
    expect_open_fail(p, DSV4_ERR_WEIGHTS, p, "past the end", NULL);
    write_raw(p, "{}", 0xffffffffffffffll, 0);
    expect_open_fail(p, DSV4_ERR_WEIGHTS, p, "past the end", NULL);
}

static void
test_bad_headers(void **state)
{
    static const struct {
        const char *hdr;
        size_t data;
        const char *frag1, *frag2;
    } cases[] = {
        /* overlapping offsets */
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
          "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
          "'b'", "overlap" },
        /* out-of-range offsets */
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 16,
          "'a'", "outside" },
        /* begin > end */
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", 16, "'a'",
          "[8, 4]: begin > end" },
        { "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[114688,16384]}}", 16,
          "'a'", "begin > end" },
        /* dtype / shape size mismatch */
        { "{\"a\":{\"dtype\":\"BF16\",\"shape\":[3,2],\"data_offsets\":[0,8]}}", 8, "'a'", "span" },
        /* overflowing shape product */
        { "{\"a\":{\"dtype\":\"I64\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}",
          8, "'a'", "overflowing" },
        /* unknown dtype */
        { "{\"a\":{\"dtype\":\"F9\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2, "'a'", "\"F9\"" },
        /* negative / non-integer dims and offsets, missing fields */
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[-2],\"data_offsets\":[0,2]}}", 2, "'a'", "shape" },
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[2.5],\"data_offsets\":[0,2]}}", 2, "'a'", "shape" },
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0]}}", 2, "'a'", "data_offsets" },
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[-1,1]}}", 2, "'a'",
          "data_offsets" },
        { "{\"a\":{\"shape\":[2],\"data_offsets\":[0,2]}}", 2, "'a'", "dtype" },
        { "{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,2]}}", 2, "'a'", "shape" },
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 1,
          "'a'", "dims" },
        { "{\"a\":[1,2]}", 0, "'a'", "not an object" },
        /* malformed JSON */
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}", 2, "header", NULL },
        { "{\"a\":{\"dtype\":\"U8\"  xx", 2, "header", NULL },
        { "{\"a\":1} trailing", 0, "header", NULL },
        { "[1,2,3]", 0, "not a JSON object", NULL },
        /* duplicate names */
        { "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
          "\"dup\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[2,3]},"
          "\"dup\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[3,4]}}", 4,
          "'dup'", "duplicate" },
        /* a key repeated inside an entry */
        { "{\"a\":{\"dtype\":\"U8\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,1]}}",
          1, "duplicate", NULL },
        /* same name written with an escape */
        { "{\"dup\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
          "\"d\\u0075p\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2,
          "'dup'", "duplicate" },
    };
    const char *p = tpath("bad.safetensors");

    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        write_raw(p, cases[i].hdr, -1, cases[i].data);
        expect_open_fail(p, DSV4_ERR_WEIGHTS, p, cases[i].frag1, cases[i].frag2, NULL);
    }
    /* an embedded NUL in the header */
    {
        FILE *fp = fopen(p, "wb");
        static const uint8_t raw[] = { 9, 0, 0, 0, 0, 0, 0, 0, '{', '}', 0, ' ', ' ', ' ', ' ',
                                       ' ', ' ' };

        assert_int_equal(fwrite(raw, 1, sizeof(raw), fp), sizeof(raw));
        fclose(fp);
        expect_open_fail(p, DSV4_ERR_WEIGHTS, p, "header", NULL);
    }
}

static void
test_missing_file(void **state)
{
    const char *p = tpath("does-not-exist.safetensors");

    (void)state;
    expect_open_fail(p, DSV4_ERR_SYS, p, NULL);
    expect_open_fail(tmpdir, DSV4_ERR_WEIGHTS, tmpdir, "regular", NULL);
}

/* Flip random header bytes of a good file: open may fail but never crash,
 * and anything it accepts stays inside the mapping. */
static void
test_fuzz_header(void **state)
{
    const char *good = tpath("fz-good.safetensors"), *p = tpath("fz.safetensors");
    uint64_t rs = 12345;
    uint8_t *buf;
    long n;
    FILE *fp;

    (void)state;
    write_sample(good, "layer.", 7);
    fp = fopen(good, "rb");
    fseek(fp, 0, SEEK_END);
    n = ftell(fp);
    rewind(fp);
    buf = malloc((size_t)n);
    assert_int_equal(fread(buf, 1, (size_t)n, fp), (size_t)n);
    fclose(fp);
    for (int it = 0; it < 1500; it++) {
        uint8_t *m = malloc((size_t)n);
        struct dsv4_st_file *f;
        long len = n;

        memcpy(m, buf, (size_t)n);
        for (int k = 0; k < 1 + it % 4; k++) {
            rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
            m[rs % 208] = (uint8_t)(rs >> 32);  /* the header is > 200 bytes */
        }
        if (it % 7 == 0)
            len = (long)(rs % (uint64_t)n);
        fp = fopen(p, "wb");
        fwrite(m, 1, (size_t)len, fp);
        fclose(fp);
        if (dsv4_st_open(&f, p) == DSV4_OK) {
            for (int i = 0; i < dsv4_st_count(f); i++) {
                const struct dsv4_st_tensor *t = dsv4_st_at(f, i);
                volatile uint8_t sink = 0;

                for (size_t j = 0; j < t->n_bytes; j++)
                    sink ^= ((const uint8_t *)t->data)[j];
                (void)sink;
                assert_ptr_equal(dsv4_st_find(f, t->name), t);
            }
            dsv4_st_close(f);
        } else {
            assert_true(strstr(dsv4_errmsg(), p) != NULL);
        }
        free(m);
    }
    free(buf);
}

/* --- sharded checkpoints ------------------------------------------------- */

static void
write_text(const char *path, const char *text)
{
    FILE *fp = fopen(path, "w");

    assert_non_null(fp);
    fputs(text, fp);
    fclose(fp);
}

/* Two shards "s1" (prefix a.) and "s2" (prefix b.) in directory `dir`, and an
 * index mapping them; `extra` is spliced into the weight_map. */
static void
make_ckpt(const char *dir, const char *extra, int skip_last_of_s2)
{
    char p1[1024], p2[1024], ip[1024], idx[8192];
    size_t o = 0;

    mkdir(dir, 0755);
    snprintf(p1, sizeof(p1), "%s/model-00001-of-00002.safetensors", dir);
    snprintf(p2, sizeof(p2), "%s/model-00002-of-00002.safetensors", dir);
    snprintf(ip, sizeof(ip), "%s/model.safetensors.index.json", dir);
    write_sample(p1, "a.", 5);
    write_sample(p2, "b.", 5);
    o += (size_t)snprintf(idx + o, sizeof(idx) - o, "{\"metadata\":{\"total_size\":1},"
                          "\"weight_map\":{%s", extra);
    for (int s = 0; s < 2; s++) {
        for (int i = 0; i < NT; i++) {
            if (s == 1 && i == NT - 1 && skip_last_of_s2)
                continue;
            o += (size_t)snprintf(idx + o, sizeof(idx) - o,
                                  "%s\"%s.%s\":\"model-0000%d-of-00002.safetensors\"",
                                  (idx[o - 1] != '{' && idx[o - 1] != ',') ? "," : "",
                                  s == 0 ? "a" : "b", s_names[i], s + 1);
        }
    }
    snprintf(idx + o, sizeof(idx) - o, "}}");
    write_text(ip, idx);
}

static void
test_ckpt_good(void **state)
{
    char dir[512], name[64], shard[1024];
    struct dsv4_ckpt *c;

    (void)state;
    snprintf(dir, sizeof(dir), "%s", tpath("ck-good"));
    make_ckpt(dir, "", 0);
    assert_int_equal(dsv4_ckpt_open(&c, dir), DSV4_OK);
    assert_int_equal(dsv4_ckpt_count(c), 2 * NT);
    for (int s = 0; s < 2; s++) {
        snprintf(shard, sizeof(shard), "%s/model-0000%d-of-00002.safetensors", dir, s + 1);
        for (int i = 0; i < NT; i++) {
            snprintf(name, sizeof(name), "%s.%s", s == 0 ? "a" : "b", s_names[i]);
            check_sample_tensor(dsv4_ckpt_find(c, name), i, shard);
            assert_string_equal(dsv4_ckpt_at(c, s * NT + i)->name, name);  /* shard order */
        }
    }
    assert_null(dsv4_ckpt_find(c, "c.bias"));
    assert_null(dsv4_ckpt_at(c, 2 * NT));
    dsv4_ckpt_close(c);
}

static void
test_ckpt_single_file(void **state)
{
    char dir[512], p[1024];
    struct dsv4_ckpt *c;

    (void)state;
    snprintf(dir, sizeof(dir), "%s", tpath("ck-single"));
    mkdir(dir, 0755);
    snprintf(p, sizeof(p), "%s/model.safetensors", dir);
    write_sample(p, "", 3);
    assert_int_equal(dsv4_ckpt_open(&c, dir), DSV4_OK);
    assert_int_equal(dsv4_ckpt_count(c), NT);
    check_sample_tensor(dsv4_ckpt_find(c, "bias"), 2, p);
    dsv4_ckpt_close(c);
    /* neither index nor model.safetensors */
    snprintf(dir, sizeof(dir), "%s", tpath("ck-empty"));
    mkdir(dir, 0755);
    assert_int_equal(dsv4_ckpt_open(&c, dir), DSV4_ERR_SYS);
    assert_null(c);
}

static void
test_ckpt_bad_index(void **state)
{
    char dir[512], ip[1024];
    static const struct {
        const char *sub, *extra;
        int skip;
        const char *f1, *f2, *f3;
    } cases[] = {
        /* index names a shard that does not exist */
        { "ck-missing", "\"z.w\":\"model-00003-of-00002.safetensors\",", 0,
          "model-00003-of-00002.safetensors", "model.safetensors.index.json", NULL },
        /* index maps a tensor to a shard that lacks it */
        { "ck-notin", "\"b.extra\":\"model-00002-of-00002.safetensors\",", 0,
          "model-00002-of-00002.safetensors", "'b.extra'", "not present" },
        /* a shard holds a tensor the index does not list */
        { "ck-unlisted", "", 1, "model-00002-of-00002.safetensors", "'b.scalar'", "not listed" },
        /* a tensor listed under the wrong shard */
        { "ck-wrong", "\"b.scalar\":\"model-00001-of-00002.safetensors\",", 1,
          "model-00001-of-00002.safetensors", "'b.scalar'", "not present" },
        /* a tensor listed twice (json-c would silently keep the last) */
        { "ck-dup", "\"b.bias\":\"model-00002-of-00002.safetensors\",", 0,
          "model.safetensors.index.json", "'b.bias'", "duplicate" },
    };

    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(dir, sizeof(dir), "%s", tpath(cases[i].sub));
        make_ckpt(dir, cases[i].extra, cases[i].skip);
        expect_ckpt_fail(dir, cases[i].f1, cases[i].f2, cases[i].f3, NULL);
    }

    /* a shard name escaping the directory, a non-string value, bad JSON */
    snprintf(dir, sizeof(dir), "%s", tpath("ck-escape"));
    make_ckpt(dir, "\"x\":\"../model-00001-of-00002.safetensors\",", 0);
    expect_ckpt_fail(dir, "'x'", "shard file name", NULL);
    make_ckpt(dir, "\"x\":7,", 0);
    expect_ckpt_fail(dir, "'x'", NULL);
    /* the same after a good entry (json-c keeps the file's order): a shard
     * was counted before the bad value and must not be closed unopened */
    snprintf(ip, sizeof(ip), "%s/model.safetensors.index.json", dir);
    write_text(ip, "{\"weight_map\":{\"a.w\":\"model-00001-of-00002.safetensors\",\"x\":7}}");
    expect_ckpt_fail(dir, "'x'", NULL);
    write_text(ip, "{\"weight_map\":{\"a.w\":\"model-00001-of-00002.safetensors\","
               "\"x\":\"../model-00002-of-00002.safetensors\"}}");
    expect_ckpt_fail(dir, "'x'", "shard file name", NULL);
    snprintf(ip, sizeof(ip), "%s/model.safetensors.index.json", dir);
    write_text(ip, "{\"weight_map\":{\"a\":");
    expect_ckpt_fail(dir, "model.safetensors.index.json", NULL);
    write_text(ip, "{\"metadata\":{}}");
    expect_ckpt_fail(dir, "weight_map", NULL);
    /* a top-level key twice: said so, not as a tensor named '' */
    write_text(ip, "{\"metadata\":{},\"metadata\":{},\"weight_map\":{}}");
    expect_ckpt_fail(dir, "model.safetensors.index.json", "duplicate key outside weight_map",
                     NULL);
    /* a dangling index link (a download cut short): the index's error, not
     * the single-file layout's "model.safetensors: open" */
    {
        struct dsv4_ckpt *c = NULL;

        assert_int_equal(unlink(ip), 0);
        assert_int_equal(symlink("blob-not-there", ip), 0);
        assert_int_not_equal(dsv4_ckpt_open(&c, dir), DSV4_OK);
        assert_null(c);
        assert_non_null(strstr(dsv4_errmsg(), "model.safetensors.index.json"));
        assert_int_equal(unlink(ip), 0);
    }

    /* a corrupt shard: the error names the shard and the tensor */
    snprintf(dir, sizeof(dir), "%s", tpath("ck-trunc"));
    make_ckpt(dir, "", 0);
    {
        char p2[1100];
        struct stat st;

        snprintf(p2, sizeof(p2), "%s/model-00002-of-00002.safetensors", dir);
        assert_int_equal(stat(p2, &st), 0);
        assert_int_equal(truncate(p2, st.st_size - 1), 0);
        expect_ckpt_fail(dir, p2, "'b.scalar'", NULL);
    }
}

/* A checkpoint made in `dir` (make_ckpt) whose file `name` is replaced by a
 * FIFO (or, `as_dir`, a directory): opening it fails at once naming the
 * file, "not a regular file" and `kind`. */
static void
not_regular_in(const char *where, const char *name, int as_dir, const char *kind)
{
    char dir[512], p[1100];

    snprintf(dir, sizeof(dir), "%s", where);
    make_ckpt(dir, "", 0);
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    assert_int_equal(unlink(p), 0);
    assert_int_equal(as_dir ? mkdir(p, 0755) : mkfifo(p, 0600), 0);
    expect_ckpt_fail(dir, p, "not a regular file", kind, NULL);
}

/* A FIFO in place of a file (a shard, the index, model.safetensors): refused
 * at once as not a regular file, never waited on (an open of a FIFO blocks
 * until a writer comes; the alarm turns such a hang into a failure). */
static void
test_not_regular(void **state)
{
    char dir[512], p[1100];

    (void)state;
    alarm(30);
    snprintf(p, sizeof(p), "%s", tpath("fifo.safetensors"));
    assert_int_equal(mkfifo(p, 0600), 0);
    expect_open_fail(p, DSV4_ERR_WEIGHTS, p, "not a regular file", "FIFO", NULL);

    not_regular_in(tpath("ck-fifo-shard"), "model-00002-of-00002.safetensors", 0, "FIFO");
    not_regular_in(tpath("ck-fifo-index"), "model.safetensors.index.json", 0, "FIFO");
    /* the single-file layout */
    snprintf(dir, sizeof(dir), "%s", tpath("ck-fifo-single"));
    assert_int_equal(mkdir(dir, 0755), 0);
    snprintf(p, sizeof(p), "%s/model.safetensors", dir);
    assert_int_equal(mkfifo(p, 0600), 0);
    expect_ckpt_fail(dir, p, "not a regular file", "FIFO", NULL);
    /* and a directory in place of the index */
    not_regular_in(tpath("ck-dir-index"), "model.safetensors.index.json", 1, "directory");
    alarm(0);
}

/* Many distinct shard names, each listed several times and not one after
 * the other (the shards are the sorted, deduplicated names): the first
 * missing shard in that order is the one reported.  And a good checkpoint
 * whose index lists its two shards' tensors alternately. */
static void
test_ckpt_many_shards(void **state)
{
    enum { NS = 3000, REP = 3 };
    char dir[512], p[1100], *idx;
    size_t cap = (size_t)NS * REP * 64 + 64, o = 0;
    struct dsv4_ckpt *c;

    (void)state;
    snprintf(dir, sizeof(dir), "%s", tpath("ck-many"));
    assert_int_equal(mkdir(dir, 0755), 0);
    idx = malloc(cap);
    assert_non_null(idx);
    o += (size_t)snprintf(idx, cap, "{\"weight_map\":{");
    for (int r = 0; r < REP; r++) {
        for (int k = NS - 1; k >= 0; k--)   /* k = 0 first in sorted order, listed last */
            o += (size_t)snprintf(idx + o, cap - o, "%s\"t%d.%d\":\"s%05d.safetensors\"",
                                  o > 15 ? "," : "", r, k, k);
    }
    snprintf(idx + o, cap - o, "}}");
    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", dir);
    write_text(p, idx);
    free(idx);
    /* shards 0 and 1 exist (their contents are not checked before every
     * shard opened); 2 is the first missing */
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof(p), "%s/s%05d.safetensors", dir, k);
        write_sample(p, "", 7);
    }
    snprintf(p, sizeof(p), "%s/s00002.safetensors", dir);
    expect_ckpt_fail(dir, p, "open", "model.safetensors.index.json", NULL);
    assert_null(strstr(dsv4_errmsg(), "s00003"));

    /* alternating a., b., a., ...: opens, in shard order */
    snprintf(dir, sizeof(dir), "%s", tpath("ck-alt"));
    make_ckpt(dir, "", 0);
    {
        char text[4096];
        size_t n = 0;

        n += (size_t)snprintf(text, sizeof(text), "{\"weight_map\":{");
        for (int i = 0; i < NT; i++) {
            for (int sh = 0; sh < 2; sh++)
                n += (size_t)snprintf(text + n, sizeof(text) - n,
                                      "%s\"%s.%s\":\"model-0000%d-of-00002.safetensors\"",
                                      n > 15 ? "," : "", sh == 0 ? "a" : "b", s_names[i],
                                      sh + 1);
        }
        snprintf(text + n, sizeof(text) - n, "}}");
        snprintf(p, sizeof(p), "%s/model.safetensors.index.json", dir);
        write_text(p, text);
    }
    if (dsv4_ckpt_open(&c, dir) != DSV4_OK)
        fail_msg("%s", dsv4_errmsg());
    assert_int_equal(dsv4_ckpt_count(c), 2 * NT);
    assert_string_equal(dsv4_ckpt_at(c, 0)->name, "a.w.weight");
    assert_string_equal(dsv4_ckpt_at(c, NT)->name, "b.w.weight");
    dsv4_ckpt_close(c);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_writer_misuse),
        cmocka_unit_test(test_writer_replaces),
        cmocka_unit_test(test_metadata_ignored),
        cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_header_len_past_end),
        cmocka_unit_test(test_bad_headers),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_fuzz_header),
        cmocka_unit_test(test_ckpt_good),
        cmocka_unit_test(test_ckpt_single_file),
        cmocka_unit_test(test_ckpt_bad_index),
        cmocka_unit_test(test_not_regular),
        cmocka_unit_test(test_ckpt_many_shards),
    };

    return cmocka_run_group_tests_name("safetensors", tests, setup, teardown);
}
