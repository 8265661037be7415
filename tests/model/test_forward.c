/*
 * test_forward.c — the forward pass on the CPU backend is consistent with
 * itself across the ways a sequence can be fed (issue 2, "Must show"):
 *
 *   - incremental decode reproduces a one-shot prefill, over >= 300 positions
 *     crossing the window, r=4 and r=128 boundaries;
 *   - chunked prefill with uneven chunks reproduces the one-shot prefill;
 *   - a batch of sequences of different lengths gives each sequence's
 *     single-sequence result (prefill and batched decode);
 *   - the MTP head gives the same logits one-shot and incrementally;
 *   - a decode state exported from one slot and imported into another
 *     continues identically (the prefill -> decode handoff);
 *   - forward_sample (sampling on the backend) gives the ids and
 *     log-probabilities of the sample op applied to forward's logits;
 *   - paged pools: a pool smaller than n_slots x max_seq refuses growth it
 *     cannot hold (DSV4_ERR_NOMEM, nothing changed), and pages returned by a
 *     reset serve the next sequence with identical results;
 *   - the last layer on the logits rows only (the default for prefill
 *     calls) gives the logits of every row through it (DSV4_FWD_FULL_LAST)
 *     bit for bit, and leaves the same decode state: decode steps after
 *     either agree with the one-shot prefill;
 *   - calls whose every row has at most index_topk valid compressed entries
 *     (the indexer's query side left out) give the bits of the same calls
 *     with the indexer scored (DSV4_FWD_FULL_INDEXER), up to and across the
 *     point where a row first has more.
 *
 * Usage: test_forward CHECKPOINT_DIR (made by dsv4-mkmodel; see
 * run_forward.sh).  The comparison bound is 1e-6 of the largest logit: the
 * CPU backend computes every row independently of the others, so the results
 * are expected to be identical; the bound only allows for nothing.
 */
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model_util.h"

#define N_POS 300       /* positions: window 16, r=4 and r=128 boundaries crossed */
#define REL_TOL 1e-6

static const char *ckpt_dir;
static struct tmodel tm;
static int32_t ids[N_POS + 1];
static float *ref;      /* (N_POS, V) one-shot prefill logits of ids, slot 0 */

static void
check_close(const float *got, const float *want, int64_t n, const char *what)
{
    double ma, d = tmodel_max_diff(want, got, n, &ma);

    printf("# %s: max |diff| = %.3g (max |logit| %.3g)\n", what, d, ma);
    assert_true(ma > 0 && isfinite(ma));   /* (a NaN reference reads as infinite) */
    assert_true(d <= REL_TOL * ma);
}

static int
setup(void **state)
{
    (void)state;
    tmodel_open(&tm, ckpt_dir, DSV4_NUMERICS_REF, 8, 512, N_POS);
    tmodel_tokens(ids, N_POS + 1, tm.V, 7);
    ref = malloc((size_t)N_POS * tm.V * sizeof(float));
    assert_non_null(ref);
    int32_t slot = 0, n = N_POS;
    struct dsv4_batch b = { 1, &slot, &n, ids };
    assert_int_equal(dsv4_model_seq_reset(tm.m, 0), DSV4_OK);
    assert_int_equal(dsv4_model_forward(tm.m, &b, ref, DSV4_FWD_ALL_LOGITS), DSV4_OK);
    return 0;
}

static int
teardown(void **state)
{
    (void)state;
    free(ref);
    tmodel_close(&tm);
    return 0;
}

static void
test_incremental(void **state)
{
    float *got = malloc((size_t)N_POS * tm.V * sizeof(float));
    int32_t slot = 1, one = 1;

    (void)state;
    assert_int_equal(dsv4_model_seq_reset(tm.m, 1), DSV4_OK);
    for (int p = 0; p < N_POS; p++) {
        struct dsv4_batch b = { 1, &slot, &one, &ids[p] };
        assert_int_equal(dsv4_model_forward(tm.m, &b, got + (size_t)p * tm.V, 0), DSV4_OK);
    }
    assert_int_equal(dsv4_model_seq_len(tm.m, 1), N_POS);
    check_close(got, ref, (int64_t)N_POS * tm.V, "incremental vs one-shot");
    free(got);
}

static void
test_chunked(void **state)
{
    static const int chunks[] = { 1, 7, 130, 33, 64, 65 };   /* sums to 300 */
    float *got = malloc((size_t)N_POS * tm.V * sizeof(float));
    int32_t slot = 2;
    int at = 0;

    (void)state;
    assert_int_equal(dsv4_model_seq_reset(tm.m, 2), DSV4_OK);
    for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
        int32_t n = chunks[c];
        struct dsv4_batch b = { 1, &slot, &n, &ids[at] };
        assert_int_equal(dsv4_model_forward(tm.m, &b, got + (size_t)at * tm.V,
                                            DSV4_FWD_ALL_LOGITS), DSV4_OK);
        at += n;
    }
    assert_int_equal(at, N_POS);
    check_close(got, ref, (int64_t)N_POS * tm.V, "chunked vs one-shot");
    free(got);
}

/* Three sequences (prefixes of ids at different offsets of the reference
 * are not needed: a sequence is a prefix of ids, so its logits are rows of
 * ref).  Prefill all three in one call, then decode them together. */
static void
test_batch(void **state)
{
    int32_t slots[3] = { 1, 2, 3 }, lens[3] = { 37, 150, 5 };
    int32_t tok[3 * N_POS];
    float *got = malloc((size_t)(37 + 150 + 5) * tm.V * sizeof(float));
    int at = 0;

    (void)state;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(dsv4_model_seq_reset(tm.m, slots[i]), DSV4_OK);
        memcpy(&tok[at], ids, (size_t)lens[i] * sizeof(int32_t));
        at += lens[i];
    }
    struct dsv4_batch b = { 3, slots, lens, tok };
    assert_int_equal(dsv4_model_forward(tm.m, &b, got, DSV4_FWD_ALL_LOGITS), DSV4_OK);
    at = 0;
    for (int i = 0; i < 3; i++) {
        check_close(got + (size_t)at * tm.V, ref, (int64_t)lens[i] * tm.V, "batched prefill");
        at += lens[i];
    }
    /* 40 batched decode steps; sequence i continues with ids[len_i + step] */
    for (int step = 0; step < 40; step++) {
        int32_t ones[3] = { 1, 1, 1 }, next[3];
        for (int i = 0; i < 3; i++)
            next[i] = ids[lens[i] + step];
        struct dsv4_batch d = { 3, slots, ones, next };
        assert_int_equal(dsv4_model_forward(tm.m, &d, got, 0), DSV4_OK);
        for (int i = 0; i < 3; i++)
            check_close(got + (size_t)i * tm.V, ref + (size_t)(lens[i] + step) * tm.V, tm.V,
                        "batched decode");
    }
    free(got);
}

static void
test_mtp(void **state)
{
    int n = 140;
    float *one = malloc((size_t)n * tm.V * sizeof(float));
    float *inc = malloc((size_t)n * tm.V * sizeof(float));
    float *tmp = malloc((size_t)n * tm.V * sizeof(float));
    int32_t slot = 1, nn = n, o1 = 1;

    (void)state;
    assert_int_equal(dsv4_model_seq_reset(tm.m, 1), DSV4_OK);
    struct dsv4_batch b = { 1, &slot, &nn, ids };
    assert_int_equal(dsv4_model_forward(tm.m, &b, tmp, DSV4_FWD_KEEP_HIDDEN), DSV4_OK);
    assert_int_equal(dsv4_model_mtp(tm.m, &b, &ids[1], one), DSV4_OK);
    /* MTP without a kept forward is refused */
    assert_int_equal(dsv4_model_mtp(tm.m, &b, &ids[1], one), DSV4_ERR_INVAL);

    assert_int_equal(dsv4_model_seq_reset(tm.m, 1), DSV4_OK);
    for (int p = 0; p < n; p++) {
        struct dsv4_batch s = { 1, &slot, &o1, &ids[p] };
        assert_int_equal(dsv4_model_forward(tm.m, &s, tmp, DSV4_FWD_KEEP_HIDDEN), DSV4_OK);
        assert_int_equal(dsv4_model_mtp(tm.m, &s, &ids[p + 1], inc + (size_t)p * tm.V),
                         DSV4_OK);
    }
    check_close(inc, one, (int64_t)n * tm.V, "MTP incremental vs one-shot");
    free(one);
    free(inc);
    free(tmp);
}

/* Prefill in slot 1, hand the state to slot 2 through export/import (the
 * prefill -> decode handoff), decode both: identical logits; a damaged or
 * truncated state is refused. */
static void
test_state_handoff(void **state)
{
    int32_t s1 = 1, s2 = 2, n = 133, one = 1;
    float *a = malloc((size_t)tm.V * sizeof(float)), *b = malloc((size_t)tm.V * sizeof(float));
    size_t cap, len;

    (void)state;
    assert_int_equal(dsv4_model_seq_reset(tm.m, 1), DSV4_OK);
    assert_int_equal(dsv4_model_seq_reset(tm.m, 2), DSV4_OK);
    struct dsv4_batch pb = { 1, &s1, &n, ids };
    assert_int_equal(dsv4_model_forward(tm.m, &pb, a, 0), DSV4_OK);
    cap = dsv4_model_state_size(tm.m, n);
    assert_true(cap > 0);
    char *buf = malloc(cap);
    assert_int_equal(dsv4_model_state_export(tm.m, 1, buf, cap - 1, &len), DSV4_ERR_INVAL);
    assert_int_equal(dsv4_model_state_export(tm.m, 1, buf, cap, &len), DSV4_OK);
    assert_int_equal(len, cap);
    assert_int_equal(dsv4_model_state_import(tm.m, 2, buf, len - 4), DSV4_ERR_PROTO);
    buf[0] ^= 1;
    assert_int_equal(dsv4_model_state_import(tm.m, 2, buf, len), DSV4_ERR_PROTO);
    buf[0] ^= 1;
    assert_int_equal(dsv4_model_state_import(tm.m, 2, buf, len), DSV4_OK);
    assert_int_equal(dsv4_model_seq_len(tm.m, 2), n);
    for (int p = n; p < n + 30; p++) {
        struct dsv4_batch d1 = { 1, &s1, &one, &ids[p] }, d2 = { 1, &s2, &one, &ids[p] };
        assert_int_equal(dsv4_model_forward(tm.m, &d1, a, 0), DSV4_OK);
        assert_int_equal(dsv4_model_forward(tm.m, &d2, b, 0), DSV4_OK);
        check_close(b, a, tm.V, "decode after handoff");
        check_close(b, ref + (size_t)p * tm.V, tm.V, "decode after handoff vs one-shot");
    }
    free(buf);
    free(a);
    free(b);
}

/* forward_sample == forward, then the sample op on the host logits; its top
 * ids == the sample_top op on them, for the row that asks only (row 1's
 * entries keep their sentinel), the greedy row's best being its token. */
static void
test_forward_sample(void **state)
{
    int32_t slots[2] = { 2, 3 }, n[2] = { 37, 64 }, toks[101];
    struct dsv4_sample_params sp[2] = {
        { .temperature = 0.0f, .top_p = 1.0f, .n_top = 5, .seed = 1, .step = 0 },
        { .temperature = 0.8f, .top_p = 0.9f, .top_k = 50, .seed = 7, .step = 3 },
    };
    float *lg = malloc(2 * (size_t)tm.V * sizeof(float)), lp[2], lp2[2];
    float tlp1[2 * DSV4_TOP_MAX], tlp2[2 * DSV4_TOP_MAX];
    int32_t got1[2], got2[2], tid1[2 * DSV4_TOP_MAX], tid2[2 * DSV4_TOP_MAX], tn[2] = { -1, -1 };
    struct dsv4_top_out top = { tid2, tlp2, tn };

    (void)state;
    assert_non_null(lg);
    for (int i = 0; i < 2 * DSV4_TOP_MAX; i++) {
        tid1[i] = tid2[i] = -7;
        tlp1[i] = tlp2[i] = 1.0f;
    }
    for (int i = 0; i < 101; i++)
        toks[i] = (int32_t)((i * 7919 + 3) % tm.V);
    for (int round = 0; round < 2; round++) {
        struct dsv4_batch b = { 2, slots, n, toks };

        for (int s = 0; s < 2; s++)
            assert_int_equal(dsv4_model_seq_reset(tm.m, slots[s]), DSV4_OK);
        if (round == 0) {
            assert_int_equal(dsv4_model_forward(tm.m, &b, lg, 0), DSV4_OK);
            assert_int_equal(tm.be->ops->sample(tm.be, got1, lp, lg, sp, 2, tm.V), DSV4_OK);
            assert_int_equal(tm.be->ops->sample_top(tm.be, tid1, tlp1, lg, sp, 2, tm.V),
                             DSV4_OK);
        } else {
            assert_int_equal(dsv4_model_forward_sample(tm.m, &b, sp, got2, lp2, &top),
                             DSV4_OK);
        }
    }
    printf("# forward_sample: ids %d %d (forward + sample: %d %d); top %d %d %d\n", got2[0],
           got2[1], got1[0], got1[1], tid2[0], tid2[1], tid2[2]);
    assert_memory_equal(got1, got2, sizeof(got1));
    assert_memory_equal(lp, lp2, sizeof(lp));
    assert_memory_equal(tid1, tid2, sizeof(tid1));
    assert_memory_equal(tlp1, tlp2, sizeof(tlp1));
    assert_int_equal(tn[0], 5);
    assert_int_equal(tn[1], 0);
    assert_int_equal(tid2[0], got2[0]);
    assert_true(tlp2[0] == lp2[0]);
    for (int j = 1; j < 5; j++)
        assert_true(tlp2[j] <= tlp2[j - 1] && tid2[j] != tid2[0]);
    assert_int_equal(tid2[5], -7);
    assert_int_equal(tid2[DSV4_TOP_MAX], -7);
    assert_int_equal(dsv4_model_seq_len(tm.m, 3), 64);
    free(lg);
}

/* A pool of 512 tokens over 3 slots of 512: one full sequence at a time. */
static void
test_paged_pool(void **state)
{
    struct dsv4_model_opts o = { .n_slots = 3, .max_seq_len = 512, .max_rows = N_POS,
                                 .pool_tokens = 512 };
    struct dsv4_model *m = NULL;
    float *got = malloc((size_t)N_POS * tm.V * sizeof(float));
    int32_t other[N_POS], s0 = 0, s1 = 1, n = N_POS, three = 3, one = 1, half = N_POS / 2;
    int used, total;

    (void)state;
    assert_non_null(got);
    assert_int_equal(dsv4_model_create(&m, tm.be, &tm.w, &o), DSV4_OK);
    tmodel_tokens(other, N_POS, tm.V, 99);
    /* slot 0 takes every ratio-4 page */
    struct dsv4_batch b0 = { 1, &s0, &n, other };
    assert_int_equal(dsv4_model_forward(m, &b0, got, 0), DSV4_OK);
    dsv4_model_pages(m, &used, &total);
    printf("# pages after %d tokens: %d of %d\n", N_POS, used, total);
    assert_int_equal(used, total);
    /* slot 1: 3 tokens need no entry yet; the 4th needs a page there is not */
    struct dsv4_batch b1 = { 1, &s1, &three, ids };
    assert_int_equal(dsv4_model_forward(m, &b1, got, 0), DSV4_OK);
    struct dsv4_batch b2 = { 1, &s1, &one, ids + 3 };
    assert_int_equal(dsv4_model_forward(m, &b2, got, 0), DSV4_ERR_NOMEM);
    printf("# %s\n", dsv4_errmsg());
    assert_non_null(strstr(dsv4_errmsg(), "pool full"));
    assert_int_equal(dsv4_model_seq_len(m, 1), 3);
    /* free slot 0: slot 1 gets its (written) pages and matches the reference */
    assert_int_equal(dsv4_model_seq_reset(m, 0), DSV4_OK);
    assert_int_equal(dsv4_model_seq_reset(m, 1), DSV4_OK);
    dsv4_model_pages(m, &used, &total);
    assert_int_equal(used, 0);
    struct dsv4_batch c1 = { 1, &s1, &half, ids };
    struct dsv4_batch c2 = { 1, &s1, &half, ids + half };
    assert_int_equal(dsv4_model_forward(m, &c1, got, DSV4_FWD_ALL_LOGITS), DSV4_OK);
    assert_int_equal(dsv4_model_forward(m, &c2, got + (size_t)half * tm.V, DSV4_FWD_ALL_LOGITS),
                     DSV4_OK);
    check_close(got, ref, (int64_t)N_POS * tm.V, "paged pool, reused pages vs one-shot");
    dsv4_model_free(m);
    free(got);
}

/* A batched prefill of three runs (the last layer's tail on 3 of 192 rows),
 * then a chunked one of a fourth sequence whose chunks end off the r = 4
 * and r = 128 boundaries, each once trimmed (flags 0) and once with
 * DSV4_FWD_FULL_LAST on other slots: the same logits bits, each run's last
 * row the one-shot prefill's, and 20 batched decode steps of all four on
 * each side the one-shot prefill's rows (the trimmed layer's KV state:
 * window ring, compressor states and pools, indexer keys). */
static void
test_trimmed_last(void **state)
{
    int32_t lens[4] = { 37, 150, 5, 0 }, tok[3 * N_POS];
    static const int chunks[] = { 61, 70, 3, 57 };   /* the fourth run: 191 rows */
    int32_t slot_sets[2][4] = { { 0, 1, 2, 3 }, { 4, 5, 6, 7 } };
    float *got[2];
    int at = 0;

    (void)state;
    for (int i = 0; i < 3; i++) {
        memcpy(&tok[at], ids, (size_t)lens[i] * sizeof(int32_t));
        at += lens[i];
    }
    for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++)
        lens[3] += chunks[c];
    for (int side = 0; side < 2; side++) {
        unsigned flags = side ? DSV4_FWD_FULL_LAST : 0;
        int32_t *slots = slot_sets[side];
        struct dsv4_batch b = { 3, slots, lens, tok };
        int done = 0;

        got[side] = malloc((size_t)4 * tm.V * sizeof(float));
        assert_non_null(got[side]);
        for (int i = 0; i < 4; i++)
            assert_int_equal(dsv4_model_seq_reset(tm.m, slots[i]), DSV4_OK);
        assert_int_equal(dsv4_model_forward(tm.m, &b, got[side], flags), DSV4_OK);
        for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
            int32_t n = chunks[c];
            struct dsv4_batch cb = { 1, &slots[3], &n, &ids[done] };

            assert_int_equal(dsv4_model_forward(tm.m, &cb, got[side] + (size_t)3 * tm.V, flags),
                             DSV4_OK);
            done += n;
        }
        for (int i = 0; i < 4; i++)
            check_close(got[side] + (size_t)i * tm.V, ref + (size_t)(lens[i] - 1) * tm.V, tm.V,
                        side ? "full last layer" : "trimmed last layer");
    }
    assert_memory_equal(got[0], got[1], (size_t)4 * tm.V * sizeof(float));
    for (int step = 0; step < 20; step++) {
        int32_t ones[4] = { 1, 1, 1, 1 }, next[4];

        for (int i = 0; i < 4; i++)
            next[i] = ids[lens[i] + step];
        for (int side = 0; side < 2; side++) {
            struct dsv4_batch d = { 4, slot_sets[side], ones, next };

            assert_int_equal(dsv4_model_forward(tm.m, &d, got[side], 0), DSV4_OK);
            for (int i = 0; i < 4; i++)
                check_close(got[side] + (size_t)i * tm.V,
                            ref + (size_t)(lens[i] + step) * tm.V, tm.V,
                            side ? "decode after full last layer" : "decode after trimmed");
        }
        assert_memory_equal(got[0], got[1], (size_t)4 * tm.V * sizeof(float));
    }
    free(got[0]);
    free(got[1]);
}

/* 33 tokens (the r = 4 layers' rows: at most 8 = K valid entries), then
 * single-token steps to position 40 (9 and 10 valid entries from 35 on),
 * with and without DSV4_FWD_FULL_INDEXER on slots 0 and 1. */
static void
test_indexer_all(void **state)
{
    float *got[2];
    int32_t n0 = 33;

    (void)state;
    for (int side = 0; side < 2; side++) {
        int32_t slot = side;
        struct dsv4_batch b = { 1, &slot, &n0, ids };

        got[side] = malloc((size_t)tm.V * sizeof(float));
        assert_non_null(got[side]);
        assert_int_equal(dsv4_model_seq_reset(tm.m, slot), DSV4_OK);
        assert_int_equal(dsv4_model_forward(tm.m, &b, got[side],
                                            side ? DSV4_FWD_FULL_INDEXER : 0), DSV4_OK);
    }
    assert_memory_equal(got[0], got[1], (size_t)tm.V * sizeof(float));
    check_close(got[0], ref + (size_t)(n0 - 1) * tm.V, tm.V, "prefill, all entries taken");
    for (int p = n0; p < 41; p++) {
        int32_t one = 1;

        for (int side = 0; side < 2; side++) {
            int32_t slot = side;
            struct dsv4_batch d = { 1, &slot, &one, &ids[p] };

            assert_int_equal(dsv4_model_forward(tm.m, &d, got[side],
                                                side ? DSV4_FWD_FULL_INDEXER : 0), DSV4_OK);
        }
        assert_memory_equal(got[0], got[1], (size_t)tm.V * sizeof(float));
        check_close(got[0], ref + (size_t)p * tm.V, tm.V, "step, all entries or scored");
    }
    free(got[0]);
    free(got[1]);
}

static void
test_bad_batch(void **state)
{
    int32_t slot = 9, n = 1, tok = 0, bad_tok = 1 << 30;
    struct dsv4_batch b = { 1, &slot, &n, &tok };
    float l[1];

    (void)state;
    assert_int_equal(dsv4_model_forward(tm.m, &b, l, 0), DSV4_ERR_INVAL);
    slot = 0;
    b.tokens = &bad_tok;
    assert_int_equal(dsv4_model_forward(tm.m, &b, l, 0), DSV4_ERR_INVAL);
    n = N_POS + 1;
    b.tokens = ids;
    assert_int_equal(dsv4_model_forward(tm.m, &b, l, 0), DSV4_ERR_INVAL);
    /* a second run of INT_MAX tokens on a slot holding one: the row and
     * length sums wrapped negative past both checks (then an out-of-bounds
     * read of the tokens) */
    {
        int32_t slots[2] = { 4, 5 }, ns[2] = { 1, INT_MAX }, one = 1;
        struct dsv4_batch p1 = { 1, &slots[1], &one, ids }, two = { 2, slots, ns, ids };
        float *lv = malloc((size_t)tm.V * sizeof(float));

        assert_int_equal(dsv4_model_seq_reset(tm.m, 4), DSV4_OK);
        assert_int_equal(dsv4_model_seq_reset(tm.m, 5), DSV4_OK);
        assert_int_equal(dsv4_model_forward(tm.m, &p1, lv, 0), DSV4_OK);
        assert_int_equal(dsv4_model_forward(tm.m, &two, lv, 0), DSV4_ERR_INVAL);
        free(lv);
    }
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_incremental),
        cmocka_unit_test(test_chunked),
        cmocka_unit_test(test_batch),
        cmocka_unit_test(test_mtp),
        cmocka_unit_test(test_state_handoff),
        cmocka_unit_test(test_forward_sample),
        cmocka_unit_test(test_paged_pool),
        cmocka_unit_test(test_trimmed_last),
        cmocka_unit_test(test_indexer_all),
        cmocka_unit_test(test_bad_batch),
    };

    if (argc != 2) {
        fprintf(stderr, "usage: test_forward CHECKPOINT_DIR\n");
        return 2;
    }
    ckpt_dir = argv[1];
    return cmocka_run_group_tests(tests, setup, teardown);
}
