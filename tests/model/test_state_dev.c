/*
 * test_state_dev.c — the device-side decode-state handoff
 * (dsv4_model_state_export_dev / _import_dev, kernels/forward.h), which the
 * cudaipc transport uses, against the host-side one:
 *
 *   - a state exported into a backend buffer has the bytes of the host
 *     export (same layout: header + the walk's arrays);
 *   - importing it into another slot and decoding there gives the logits of
 *     the slot it came from, bit for bit;
 *   - a device import followed by a host export reproduces the host bytes;
 *   - a damaged header, a wrong length or a short buffer are refused;
 *   - the backend's copy_batch op (which the device walk uses) moves pieces
 *     of every size and alignment, empty ones included, exactly.
 *
 * Usage: test_state_dev CHECKPOINT_DIR (run_with_ckpt.sh makes one).  Runs
 * on the CPU backend (backend memory = host memory); DSV4_TEST_BACKEND=cuda
 * runs the same checks on a GPU.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model_util.h"

#define N_PROMPT 133    /* crosses the window and several r=4 entries */
#define N_DECODE 24     /* decode steps after the handoff */
#define N_IDS (N_PROMPT + N_DECODE)

static const char *ckpt_dir;
static struct tmodel tm;
static int32_t ids[N_IDS];

static int
setup(void **state)
{
    (void)state;
    tmodel_open(&tm, ckpt_dir, DSV4_NUMERICS_REF, 4, 512, N_PROMPT);
    tmodel_tokens(ids, N_IDS, tm.V, 11);
    return 0;
}

static int
teardown(void **state)
{
    (void)state;
    tmodel_close(&tm);
    return 0;
}

/* Backend buffer of n bytes (zeroed). */
static void *
dev_alloc(size_t n)
{
    void *p = tm.be->ops->alloc(tm.be, n);

    assert_non_null(p);
    return p;
}

/* n bytes of backend memory to a new host buffer. */
static unsigned char *
dev_fetch(const void *dev, size_t n)
{
    unsigned char *h = malloc(n);

    assert_non_null(h);
    assert_int_equal(tm.be->ops->download(tm.be, h, dev, n), DSV4_OK);
    assert_int_equal(tm.be->ops->sync(tm.be), DSV4_OK);
    return h;
}

/* Flip bit 0 of byte `at` of a backend buffer. */
static void
dev_flip(void *dev, size_t at)
{
    unsigned char c;

    assert_int_equal(tm.be->ops->download(tm.be, &c, (char *)dev + at, 1), DSV4_OK);
    assert_int_equal(tm.be->ops->sync(tm.be), DSV4_OK);
    c ^= 1;
    assert_int_equal(tm.be->ops->upload(tm.be, (char *)dev + at, &c, 1), DSV4_OK);
    assert_int_equal(tm.be->ops->sync(tm.be), DSV4_OK);
}

/* Reset `slot` and prefill it with ids[0, n); last row's logits to out. */
static void
prefill(int32_t slot, int32_t n, float *out)
{
    struct dsv4_batch pb = { 1, &slot, &n, ids };

    assert_int_equal(dsv4_model_seq_reset(tm.m, slot), DSV4_OK);
    assert_int_equal(dsv4_model_forward(tm.m, &pb, out, 0), DSV4_OK);
}

/* Decode ids[from, to) in slots sa and sb one token at a time: bit-identical
 * logits at every step (a, b: scratch rows of V). */
static void
decode_both(int32_t sa, int32_t sb, int from, int to, float *a, float *b)
{
    int32_t one = 1;

    for (int p = from; p < to; p++) {
        struct dsv4_batch da = { 1, &sa, &one, &ids[p] }, db = { 1, &sb, &one, &ids[p] };
        assert_int_equal(dsv4_model_forward(tm.m, &da, a, 0), DSV4_OK);
        assert_int_equal(dsv4_model_forward(tm.m, &db, b, 0), DSV4_OK);
        assert_memory_equal(a, b, (size_t)tm.V * sizeof(float));
    }
}

/* Prefill slot 1; export it to the host and to a backend buffer: the same
 * bytes. Import the device copy into slot 2 and decode both slots: the same
 * logits. */
static void
test_dev_handoff(void **state)
{
    int n = N_PROMPT;
    float *a = malloc((size_t)tm.V * sizeof(float)), *b = malloc((size_t)tm.V * sizeof(float));
    unsigned char *hbuf, *got;
    size_t cap, hlen = 0, dlen = 0;
    void *dbuf;

    (void)state;
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(dsv4_model_seq_reset(tm.m, 2), DSV4_OK);
    prefill(1, n, a);

    cap = dsv4_model_state_size(tm.m, n);
    hbuf = malloc(cap);
    assert_non_null(hbuf);
    dbuf = dev_alloc(cap);
    assert_int_equal(dsv4_model_state_export(tm.m, 1, hbuf, cap, &hlen), DSV4_OK);
    assert_int_equal(dsv4_model_state_export_dev(tm.m, 1, dbuf, cap - 1, &dlen),
                     DSV4_ERR_INVAL);
    assert_int_equal(dsv4_model_state_export_dev(tm.m, 1, dbuf, cap, &dlen), DSV4_OK);
    assert_int_equal(dlen, hlen);
    assert_int_equal(dlen, cap);
    got = dev_fetch(dbuf, dlen);
    printf("# state of %d tokens: %zu bytes; device export == host export: %s\n", n, dlen,
           memcmp(got, hbuf, dlen) == 0 ? "yes" : "NO");
    assert_memory_equal(got, hbuf, dlen);
    free(got);

    /* refused: short, truncated, damaged header; the slot stays usable */
    assert_int_equal(dsv4_model_state_import_dev(tm.m, 2, dbuf, 16), DSV4_ERR_PROTO);
    assert_int_equal(dsv4_model_state_import_dev(tm.m, 2, dbuf, dlen - 4), DSV4_ERR_PROTO);
    dev_flip(dbuf, 0);
    assert_int_equal(dsv4_model_state_import_dev(tm.m, 2, dbuf, dlen), DSV4_ERR_PROTO);
    dev_flip(dbuf, 0);
    assert_int_equal(dsv4_model_state_import_dev(tm.m, 4, dbuf, dlen), DSV4_ERR_INVAL);

    assert_int_equal(dsv4_model_state_import_dev(tm.m, 2, dbuf, dlen), DSV4_OK);
    assert_int_equal(dsv4_model_seq_len(tm.m, 2), n);

    /* what the device import put in slot 2 exports to the same host bytes */
    got = malloc(cap);
    assert_non_null(got);
    assert_int_equal(dsv4_model_state_export(tm.m, 2, got, cap, &hlen), DSV4_OK);
    assert_memory_equal(got, hbuf, cap);
    free(got);

    decode_both(1, 2, n, N_IDS, a, b);
    printf("# %d decode steps after the device handoff: logits bit-identical\n", N_DECODE);
    tm.be->ops->free(tm.be, dbuf);
    free(hbuf);
    free(a);
    free(b);
}

/* A device import of a host-exported state (the two layouts are one):
 * continues like the source slot. */
static void
test_host_to_dev(void **state)
{
    int n = 70;
    float *a = malloc((size_t)tm.V * sizeof(float)), *b = malloc((size_t)tm.V * sizeof(float));
    unsigned char *hbuf;
    size_t cap, len = 0;
    void *dbuf;

    (void)state;
    assert_non_null(a);
    assert_non_null(b);
    prefill(0, n, a);
    cap = dsv4_model_state_size(tm.m, n);
    hbuf = malloc(cap);
    assert_non_null(hbuf);
    assert_int_equal(dsv4_model_state_export(tm.m, 0, hbuf, cap, &len), DSV4_OK);
    dbuf = dev_alloc(cap);
    assert_int_equal(tm.be->ops->upload(tm.be, dbuf, hbuf, len), DSV4_OK);
    assert_int_equal(tm.be->ops->sync(tm.be), DSV4_OK);
    assert_int_equal(dsv4_model_state_import_dev(tm.m, 3, dbuf, len), DSV4_OK);
    assert_int_equal(dsv4_model_seq_len(tm.m, 3), n);
    decode_both(0, 3, n, n + 8, a, b);
    tm.be->ops->free(tm.be, dbuf);
    free(hbuf);
    free(a);
    free(b);
}

/* copy_batch of 200 pieces with random sizes (0 … 70,000 bytes, so some
 * span several chunks of the CUDA kernel) and offsets (every residue modulo
 * 16 on both sides) from one backend buffer to another: the destination
 * equals a host replay of the same copies byte for byte, bytes between the
 * pieces included. */
static void
test_copy_batch(void **state)
{
    enum { N = 200, MAXB = 70000 };
    size_t span = (size_t)N * (MAXB + 64);
    unsigned char *hsrc = malloc(span), *want = malloc(span), *got;
    void *dst[N];
    const void *src[N];
    size_t bytes[N], so = 0, dof = 0, moved = 0;
    unsigned char *dsrc, *ddst;
    uint64_t r = 0x9e3779b97f4a7c15ull;

    (void)state;
    assert_non_null(hsrc);
    assert_non_null(want);
    for (size_t i = 0; i < span; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        hsrc[i] = (unsigned char)(r >> 56);
    }
    dsrc = dev_alloc(span);
    ddst = dev_alloc(span);         /* zeroed */
    assert_int_equal(tm.be->ops->upload(tm.be, dsrc, hsrc, span), DSV4_OK);
    memset(want, 0, span);
    for (int i = 0; i < N; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        so += (r >> 33) % 16;
        dof += (r >> 40) % 16;
        bytes[i] = i % 17 == 0 ? 0 : (size_t)((r >> 20) % MAXB);
        /* pieces in a shuffled order of the destination (backwards) */
        src[i] = dsrc + so;
        dst[i] = ddst + span - dof - bytes[i];
        memcpy(want + span - dof - bytes[i], hsrc + so, bytes[i]);
        so += bytes[i];
        dof += bytes[i];
        moved += bytes[i];
    }
    assert_true(so <= span && dof <= span);
    assert_int_equal(tm.be->ops->copy_batch(tm.be, N, dst, src, bytes), DSV4_OK);
    assert_int_equal(tm.be->ops->copy_batch(tm.be, 0, dst, src, bytes), DSV4_OK);
    assert_int_equal(tm.be->ops->copy_batch(tm.be, -1, dst, src, bytes), DSV4_ERR_INVAL);
    got = dev_fetch(ddst, span);
    for (size_t i = 0; i < span; i++) {
        if (got[i] != want[i]) {
            fprintf(stderr, "copy_batch: first difference at byte %zu: %u, want %u\n", i,
                    got[i], want[i]);
            break;
        }
    }
    printf("# copy_batch: %d pieces, %zu bytes\n", N, moved);
    assert_memory_equal(got, want, span);
    free(got);
    free(hsrc);
    free(want);
    tm.be->ops->free(tm.be, dsrc);
    tm.be->ops->free(tm.be, ddst);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dev_handoff),
        cmocka_unit_test(test_host_to_dev),
        cmocka_unit_test(test_copy_batch),
    };

    if (argc < 2) {
        fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]);
        return 2;
    }
    ckpt_dir = argv[1];
    return cmocka_run_group_tests(tests, setup, teardown);
}
