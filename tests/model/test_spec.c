/*
 * test_spec.c — speculative decoding with the MTP layer (kernels/forward.h,
 * "Speculative decoding") gives exactly the tokens of plain greedy decoding.
 *
 * Four streams of mixed prompt lengths (1, 37, 130, 250 tokens) on the tiny
 * checkpoint (window 16, r = 4 and r = 128 layers, one MTP layer) generate
 * N_GEN tokens each, once by plain batched greedy steps (the reference, with
 * the MTP head run after every step as dsv4_model_mtp) and once by verify +
 * draft steps.  At every verify step each stream draws its draft from one of
 * four sources: the MTP layer's draft, the true next token (forced accept),
 * a wrong one (forced reject), or none; random MTP weights alone would
 * reject almost always, so the forced ones cover both paths, including the
 * restore of an r = 4 compressor state, hundreds of times over many window,
 * r = 4 and r = 128 boundaries.  Streams finish at different steps, so the
 * batch shrinks.  Checked, bit for bit (memcmp): every token, every logits
 * row of a kept token against the plain step that produced it, and every MTP
 * draft row against the reference MTP head at the same position.
 *
 * The same script in a model group of two ranks (threads, local comm,
 * weight shards) gives every rank the single rank's tokens and logits; that
 * run skips the MTP pass over the prompts, so it also covers a slot whose
 * MTP layer starts late (empty MTP window).
 *
 * Usage: test_spec CHECKPOINT_DIR (run_with_ckpt.sh makes it).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "group_threads.h"
#include "model_util.h"

#define N_SEQ 4
#define N_GEN 200          /* generated tokens per stream (main test) */
#define N_GEN_TP 60        /* in the group test */
#define MAX_SEQ 1024
static const int32_t prompt_len[N_SEQ] = { 1, 37, 130, 250 };
#define N_PROMPT (1 + 37 + 130 + 250)
#define K1 (DSV4_SPEC_MAX_DRAFT + 1)

static const char *ckpt_dir;
static int V;

/* Draft sources of one stream at one verify step. */
enum src { SRC_MTP, SRC_ACCEPT, SRC_REJECT, SRC_NONE };

/*
 * What a run produces, indexed by stream s and generated-token index k:
 * tok[s][k] the k-th generated token (k = 0: from the prefill); lg[s][k]
 * the logits row that produced tok[s][k + 1]; mtp[s][k] the MTP head's row
 * at the position of tok[s][k] paired with tok[s][k + 1] (has_mtp marks the
 * ones a speculative run computed).
 */
struct run {
    int n_gen;
    int32_t tok[N_SEQ][N_GEN + 2];
    float *lg;                  /* (N_SEQ, N_GEN, V) */
    float *mtp;                 /* (N_SEQ, N_GEN, V) */
    uint8_t has_mtp[N_SEQ][N_GEN];
    int accepted, rejected, restored, mtp_accepted, calls;
    int top_checked, top_accepted; /* tokens whose top ids were checked; of them,
                                      accepted drafts (a verify's second row) */
    enum dsv4_err err;
    char msg[256];
};

static void
run_alloc(struct run *o, int n_gen)
{
    memset(o, 0, sizeof(*o));
    o->n_gen = n_gen;
    o->lg = calloc((size_t)N_SEQ * N_GEN * V, sizeof(float));
    o->mtp = calloc((size_t)N_SEQ * N_GEN * V, sizeof(float));
    assert_true(o->lg != NULL && o->mtp != NULL);
}

static void
run_free(struct run *o)
{
    free(o->lg);
    free(o->mtp);
}

static float *
row_of(float *a, int s, int k)
{
    return a + ((size_t)s * N_GEN + k) * V;
}

static int32_t
argmax(const float *x, int n)
{
    int32_t b = 0;

    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

static uint64_t
rng_next(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

#define RUN_TRY(expr)                                                        \
    do {                                                                     \
        enum dsv4_err e_ = (expr);                                           \
        if (e_ != DSV4_OK) {                                                 \
            o->err = e_;                                                     \
            snprintf(o->msg, sizeof(o->msg), "%s: %s", #expr, dsv4_errmsg()); \
            goto out;                                                        \
        }                                                                    \
    } while (0)

/*
 * Prefill the prompts into slots 0..N_SEQ-1 (fresh), first tokens into
 * o->tok[s][0]; with `mtp`, the MTP head over the prompts too (each row
 * paired with the next prompt id, the last with the first token), whose
 * last rows are returned in first_draft (the MTP layer then follows the
 * slots from position 0).
 */
static void
prefill(struct dsv4_model *m, struct run *o, int mtp, int32_t *first_draft)
{
    int32_t slot[N_SEQ] = { 0, 1, 2, 3 };
    int32_t *ids = malloc(N_PROMPT * sizeof(int32_t));
    int32_t *next = malloc(N_PROMPT * sizeof(int32_t));
    float *lg = malloc((size_t)N_PROMPT * V * sizeof(float));
    struct dsv4_batch b = { N_SEQ, slot, prompt_len, ids };

    tmodel_tokens(ids, N_PROMPT, V, 5);
    for (int s = 0; s < N_SEQ; s++)
        RUN_TRY(dsv4_model_seq_reset(m, s));
    RUN_TRY(dsv4_model_forward(m, &b, lg, mtp ? DSV4_FWD_KEEP_HIDDEN : 0));
    for (int s = 0; s < N_SEQ; s++)
        o->tok[s][0] = argmax(lg + (size_t)s * V, V);
    if (mtp) {
        for (int s = 0, row = 0; s < N_SEQ; s++)
            for (int i = 0; i < prompt_len[s]; i++, row++)
                next[row] = i + 1 < prompt_len[s] ? ids[row + 1] : o->tok[s][0];
        RUN_TRY(dsv4_model_mtp(m, &b, next, lg));
        for (int s = 0, row = 0; s < N_SEQ; s++) {
            row += prompt_len[s];
            first_draft[s] = argmax(lg + (size_t)(row - 1) * V, V);
        }
    }
out:
    free(ids);
    free(next);
    free(lg);
}

/* The reference: plain batched greedy steps, each followed by the MTP head
 * over its row with the token it produced. */
static void
plain_script(struct dsv4_model *m, struct run *o)
{
    int32_t slot[N_SEQ] = { 0, 1, 2, 3 }, ones[N_SEQ] = { 1, 1, 1, 1 }, tok[N_SEQ], nxt[N_SEQ];
    int32_t first[N_SEQ];
    float *lg = malloc((size_t)N_SEQ * V * sizeof(float));
    float *mg = malloc((size_t)N_SEQ * V * sizeof(float));

    prefill(m, o, 1, first);
    if (o->err != DSV4_OK)
        goto out;
    for (int k = 0; k < o->n_gen; k++) {
        struct dsv4_batch b = { N_SEQ, slot, ones, tok };

        for (int s = 0; s < N_SEQ; s++)
            tok[s] = o->tok[s][k];
        RUN_TRY(dsv4_model_forward(m, &b, lg, DSV4_FWD_KEEP_HIDDEN));
        for (int s = 0; s < N_SEQ; s++) {
            nxt[s] = argmax(lg + (size_t)s * V, V);
            o->tok[s][k + 1] = nxt[s];
            memcpy(row_of(o->lg, s, k), lg + (size_t)s * V, (size_t)V * sizeof(float));
        }
        RUN_TRY(dsv4_model_mtp(m, &b, nxt, mg));
        for (int s = 0; s < N_SEQ; s++)
            memcpy(row_of(o->mtp, s, k), mg + (size_t)s * V, (size_t)V * sizeof(float));
    }
out:
    free(lg);
    free(mg);
}

/*
 * Whether the n_top most likely ids a verify step reported for a token
 * (ids, lp) are those of its logits row l: by (logit desc, id asc), each
 * with logit - log Σ exp (within 1e-5).
 */
static bool
top_matches(const float *l, int n_top, const int32_t *ids, const float *lp)
{
    double m = -INFINITY, s = 0.0;
    int32_t prev = -1;

    for (int i = 0; i < V; i++)
        m = l[i] > m ? l[i] : m;
    for (int i = 0; i < V; i++)
        s += exp((double)l[i] - m);
    for (int j = 0; j < n_top; j++) {
        int32_t best = -1;

        /* the best id after prev in (logit desc, id asc) order */
        for (int i = 0; i < V; i++) {
            bool after = prev < 0 || l[i] < l[prev] || (l[i] == l[prev] && i > prev);

            if (after && (best < 0 || l[i] > l[best]))
                best = i;
        }
        if (ids[j] != best || fabs(lp[j] - ((double)l[best] - m - log(s))) > 1e-5)
            return false;
        prev = best;
    }
    return true;
}

/*
 * The speculative run: verify + draft steps until every stream has n_gen
 * tokens.  Odd streams also ask for their 3 most likely ids, checked
 * against the verify's logits rows (top_matches), accepted drafts' rows
 * included.  ref holds the plain tokens (for the forced drafts; the run does
 * not otherwise look at them).  Drafts come from the sources drawn from a
 * fixed generator, so every rank of a group makes the same calls.
 */
static void
spec_script(struct dsv4_model *m, const struct run *ref, int prompt_mtp, struct run *o)
{
    int32_t slot[N_SEQ], last[N_SEQ], nd[N_SEQ], draft[N_SEQ], ids[N_SEQ * K1], nout[N_SEQ];
    int32_t top_ids[N_SEQ * K1 * DSV4_TOP_MAX];
    float top_lp[N_SEQ * K1 * DSV4_TOP_MAX];
    int32_t top_n[N_SEQ * K1];
    struct dsv4_top_out top = { top_ids, top_lp, top_n };
    int32_t mtp_draft[N_SEQ] = { 0 }, next_draft[N_SEQ], e[N_SEQ] = { 0 }, map[N_SEQ];
    enum src src[N_SEQ];
    struct dsv4_sample_params sp[N_SEQ];
    float *lg = malloc((size_t)N_SEQ * K1 * V * sizeof(float));
    float *mg = malloc((size_t)N_SEQ * V * sizeof(float));
    uint64_t rng = 0x5eed;
    int n_gen = o->n_gen;

    prefill(m, o, prompt_mtp, mtp_draft);
    if (o->err != DSV4_OK)
        goto out;
    for (;;) {
        struct dsv4_spec_batch b = { 0, slot, last, nd, draft };
        int n = 0;

        for (int s = 0; s < N_SEQ; s++) {
            if (e[s] >= n_gen)
                continue;
            slot[n] = s;
            map[n] = s;
            last[n] = o->tok[s][e[s]];
            src[n] = (enum src)(rng_next(&rng) % 4);
            if (e[s] + 1 >= n_gen)
                src[n] = SRC_NONE;     /* no reference row for a second token */
            nd[n] = src[n] != SRC_NONE;
            draft[n] = src[n] == SRC_MTP ? mtp_draft[s] :
                       src[n] == SRC_ACCEPT ? ref->tok[s][e[s] + 1] :
                       src[n] == SRC_REJECT ?
                       (int32_t)((ref->tok[s][e[s] + 1] + 1 + rng_next(&rng) % (V - 1)) % V) : 0;
            memset(&sp[n], 0, sizeof(sp[n]));
            sp[n].top_p = 1.0f;
            sp[n].step = (uint64_t)e[s] + 1;
            sp[n].n_top = s % 2 ? 3 : 0;
            n++;
        }
        if (n == 0)
            break;
        b.n_seqs = n;
        RUN_TRY(dsv4_model_spec_verify(m, &b, sp, ids, NULL, &top, nout, lg));
        o->calls++;
        for (int i = 0, row = 0; i < n; i++) {
            int s = map[i], p = prompt_len[s] + e[s];

            for (int j = 0; j < nout[i]; j++) {
                if (top_n[i * K1 + j] != sp[i].n_top ||
                    !top_matches(lg + (size_t)(row + j) * V, sp[i].n_top,
                                 top_ids + (size_t)(i * K1 + j) * DSV4_TOP_MAX,
                                 top_lp + (size_t)(i * K1 + j) * DSV4_TOP_MAX)) {
                    o->err = DSV4_ERR_INVAL;
                    snprintf(o->msg, sizeof(o->msg), "stream %d at %d, token %d: most likely "
                             "ids differ from its logits row's", s, e[s], j);
                    goto out;
                }
                o->top_checked += sp[i].n_top > 0;
                o->top_accepted += sp[i].n_top > 0 && j == 1;
                o->tok[s][e[s] + 1 + j] = ids[i * K1 + j];
                memcpy(row_of(o->lg, s, e[s] + j), lg + (size_t)(row + j) * V,
                       (size_t)V * sizeof(float));
            }
            if (nd[i] == 1 && nout[i] == 2) {
                o->accepted++;
                o->mtp_accepted += src[i] == SRC_MTP;
            } else if (nd[i] == 1) {
                o->rejected++;
                o->restored += (p + 2) % 4 == 0;
            }
            /* an accepted forced draft must be kept, a wrong one refused */
            if ((src[i] == SRC_ACCEPT && nout[i] != 2) || (src[i] == SRC_REJECT && nout[i] != 1) ||
                (nd[i] == 0 && nout[i] != 1)) {
                o->err = DSV4_ERR_INVAL;
                snprintf(o->msg, sizeof(o->msg), "stream %d at %d: source %d kept %d tokens", s,
                         e[s], src[i], nout[i]);
                goto out;
            }
            row += 1 + nd[i];
        }
        RUN_TRY(dsv4_model_spec_draft(m, next_draft, mg));
        for (int i = 0; i < n; i++) {
            int s = map[i];

            e[s] += nout[i];
            mtp_draft[s] = next_draft[i];
            memcpy(row_of(o->mtp, s, e[s] - 1), mg + (size_t)i * V, (size_t)V * sizeof(float));
            o->has_mtp[s][e[s] - 1] = 1;
        }
    }
out:
    free(lg);
    free(mg);
}

/* Rows [0, n) of stream s of a and b differ: the first such row, else -1. */
static int
first_diff(const float *a, const float *b, int s, int n)
{
    for (int k = 0; k < n; k++)
        if (memcmp(a + ((size_t)s * N_GEN + k) * V, b + ((size_t)s * N_GEN + k) * V,
                   (size_t)V * sizeof(float)) != 0)
            return k;
    return -1;
}

static void
expect_tokens(const struct run *got, const struct run *want, const char *what)
{
    for (int s = 0; s < N_SEQ; s++) {
        for (int k = 0; k <= got->n_gen; k++) {
            if (got->tok[s][k] != want->tok[s][k])
                fail_msg("%s: stream %d token %d is %d, plain decoding gives %d", what, s, k,
                         got->tok[s][k], want->tok[s][k]);
        }
    }
}

static void
test_spec_equals_plain(void **state)
{
    struct tmodel tm;
    struct run ref, sp;
    int n_mtp = 0;

    (void)state;
    tmodel_open(&tm, ckpt_dir, DSV4_NUMERICS_REF, N_SEQ, MAX_SEQ, N_PROMPT);
    V = tm.V;
    run_alloc(&ref, N_GEN);
    run_alloc(&sp, N_GEN);
    plain_script(tm.m, &ref);
    if (ref.err != DSV4_OK)
        fail_msg("plain: %s", ref.msg);
    spec_script(tm.m, &ref, 1, &sp);
    if (sp.err != DSV4_OK)
        fail_msg("speculative: %s", sp.msg);
    printf("# %d verify calls for %d tokens: %d drafts accepted, %d rejected (%d r=4 "
           "restores), %d MTP drafts accepted\n", sp.calls, N_SEQ * N_GEN, sp.accepted,
           sp.rejected, sp.restored, sp.mtp_accepted);
    expect_tokens(&sp, &ref, "speculative");
    for (int s = 0; s < N_SEQ; s++) {
        int k = first_diff(sp.lg, ref.lg, s, N_GEN);

        if (k >= 0)
            fail_msg("stream %d: logits producing token %d differ from the plain step's", s,
                     k + 1);
        for (k = 0; k < N_GEN; k++) {
            if (!sp.has_mtp[s][k])
                continue;
            n_mtp++;
            if (memcmp(row_of(sp.mtp, s, k), row_of(ref.mtp, s, k),
                       (size_t)V * sizeof(float)) != 0)
                fail_msg("stream %d: MTP draft row at token %d differs from the MTP head's", s,
                         k);
        }
    }
    printf("# every token and logits row equal; %d MTP draft rows equal the MTP head's\n",
           n_mtp);
    /* both paths ran many times (a property of the fixed draft sources) */
    assert_true(sp.accepted >= 60);
    printf("# most likely ids of %d tokens == their logits rows', %d of them accepted drafts\n",
           sp.top_checked, sp.top_accepted);
    assert_true(sp.top_accepted >= 20);
    assert_true(sp.rejected >= 100);
    assert_true(sp.restored >= 20);
    assert_true(n_mtp >= N_GEN);
    run_free(&ref);
    run_free(&sp);
    tmodel_close(&tm);
}

/* --- a group of two ranks ------------------------------------------------ */

static struct dsv4_model_opts
opts(struct dsv4_comm *c)
{
    struct dsv4_model_opts o = { .n_slots = N_SEQ, .max_seq_len = MAX_SEQ,
                                 .max_rows = N_PROMPT, .comm = c };
    return o;
}

/* The thread group's runs: the plain reference and one run per rank. */
struct group_runs {
    const struct run *ref;
    struct run out[2];
};

static void
rank_run(struct dsv4_model *m, int rank, void *ctx)
{
    struct group_runs *g = ctx;

    spec_script(m, g->ref, 0, &g->out[rank]);
}

static void
test_spec_group(void **state)
{
    struct tmodel tm;
    struct dsv4_model_opts o = opts(NULL);
    struct run ref, one;
    struct group_runs gr;

    (void)state;
    tmodel_open(&tm, ckpt_dir, DSV4_NUMERICS_REF, N_SEQ, MAX_SEQ, N_PROMPT);
    V = tm.V;
    run_alloc(&ref, N_GEN_TP);
    run_alloc(&one, N_GEN_TP);
    plain_script(tm.m, &ref);
    if (ref.err != DSV4_OK)
        fail_msg("plain: %s", ref.msg);
    spec_script(tm.m, &ref, 0, &one);
    if (one.err != DSV4_OK)
        fail_msg("one rank: %s", one.msg);
    expect_tokens(&one, &ref, "one rank, late MTP start");
    gr.ref = &ref;
    for (int r = 0; r < 2; r++)
        run_alloc(&gr.out[r], N_GEN_TP);
    if (group_threads_run(&tm.w, 2, DSV4_GROUP_SPLIT_EP, &o, rank_run, &gr) != DSV4_OK)
        fail_msg("group: %s", dsv4_errmsg());
    for (int r = 0; r < 2; r++) {
        struct run *g = &gr.out[r];

        if (g->err != DSV4_OK)
            fail_msg("rank %d: %s", r, g->msg);
        expect_tokens(g, &ref, "group rank");
        for (int s = 0; s < N_SEQ; s++) {
            int k = first_diff(g->lg, one.lg, s, N_GEN_TP);

            if (k < 0)
                k = first_diff(g->mtp, one.mtp, s, N_GEN_TP);
            if (k >= 0)
                fail_msg("rank %d stream %d: row %d differs from the single rank's", r, s, k);
        }
        assert_memory_equal(g->has_mtp, one.has_mtp, sizeof(one.has_mtp));
        assert_int_equal(g->accepted, one.accepted);
        printf("# rank %d: %d verify calls, %d accepted, %d rejected: == one rank\n", r,
               g->calls, g->accepted, g->rejected);
        run_free(g);
    }
    run_free(&ref);
    run_free(&one);
    tmodel_close(&tm);
}

/* Bad verify and draft calls are refused. */
static void
test_spec_errors(void **state)
{
    struct tmodel tm;
    int32_t slot[2] = { 0, 0 }, last[2] = { 1, 2 }, nd[2] = { 1, 1 }, dr[2] = { 3, 4 };
    int32_t ids[2 * K1], nout[2], two = 2;
    struct dsv4_sample_params sp[2];
    struct dsv4_spec_batch b = { 1, slot, last, nd, dr };

    (void)state;
    memset(sp, 0, sizeof(sp));
    sp[0].top_p = sp[1].top_p = 1.0f;
    tmodel_open(&tm, ckpt_dir, DSV4_NUMERICS_REF, 2, 128, 4);
    V = tm.V;
    assert_int_equal(dsv4_model_spec_draft(tm.m, ids, NULL), DSV4_ERR_INVAL);   /* no verify */
    b.n_seqs = 2;                                                                 /* repeated slot */
    assert_int_equal(dsv4_model_spec_verify(tm.m, &b, sp, ids, NULL, NULL, nout, NULL),
                     DSV4_ERR_INVAL);
    b.n_seqs = 1;
    nd[0] = DSV4_SPEC_MAX_DRAFT + 1;
    assert_int_equal(dsv4_model_spec_verify(tm.m, &b, sp, ids, NULL, NULL, nout, NULL),
                     DSV4_ERR_INVAL);
    nd[0] = 1;
    assert_int_equal(dsv4_model_seq_len(tm.m, 0), 0);
    assert_int_equal(dsv4_model_spec_verify(tm.m, &b, sp, ids, NULL, NULL, nout, NULL), DSV4_OK);
    assert_int_equal(dsv4_model_seq_len(tm.m, 0), nout[0]);
    /* a plain forward in between forgets the verify's rows */
    struct dsv4_batch fb = { 1, slot, &two, last };
    float *lg = malloc((size_t)V * sizeof(float));
    assert_int_equal(dsv4_model_forward(tm.m, &fb, lg, 0), DSV4_OK);
    assert_int_equal(dsv4_model_spec_draft(tm.m, ids, NULL), DSV4_ERR_INVAL);
    free(lg);
    tmodel_close(&tm);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spec_errors),
        cmocka_unit_test(test_spec_equals_plain),
        cmocka_unit_test(test_spec_group),
    };

    if (argc != 2) {
        fprintf(stderr, "usage: test_spec CHECKPOINT_DIR\n");
        return 2;
    }
    ckpt_dir = argv[1];
    return cmocka_run_group_tests(tests, NULL, NULL);
}
