/*
 * rank_test_drafts.c — test only: forced MTP drafts (DSV4_TEST_MTP_DRAFTS).
 *
 * The tiny test checkpoints' MTP layer never predicts the next token, so a
 * decode rank with mtp = yes would never emit two tokens in a step and the
 * path of an accepted draft (two tokens a stream, a stop id or max_tokens
 * on either, their logprobs and lists, the RNG step of the second) would go
 * untested through the service.  With DSV4_TEST_MTP_DRAFTS=FILE a decode
 * rank replaces the MTP layer's draft of a stream whose output so far
 * (from its DECODE's token on) begins one of FILE's lines (token ids, one
 * output a line, as plain decoding gave it): with h tokens so far, every
 * 5th h keeps the MTP draft, every 7th (h % 7 == 3) drafts a wrong token
 * (the right one + 1), the others the line's next token.  The drafts change
 * which steps emit two tokens, never which tokens: a service under it must
 * give plain decoding's outputs.  Every rank of a group reads the same file
 * and sees the same outputs, so all decide alike.
 */
#include "daemons/rank/rank.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#define TD_LINES 256     /* outputs read from the file */
#define TD_LEN 4096      /* tokens a line and a stream's history */

/* The file's outputs and each slot's history. */
struct rank_test_drafts {
    int32_t *line[TD_LINES];
    int line_len[TD_LINES];
    int n_lines;
    int32_t *hist;       /* (slots, TD_LEN) */
    int *n_hist;         /* (slots) */
};

void
rank_test_drafts_load(struct rank *k)
{
    const char *path = getenv(RANK_TEST_MTP_DRAFTS);
    struct rank_test_drafts *t;
    char *buf = NULL;
    size_t cap = 0;
    FILE *fp;

    if (path == NULL || !k->mtp)
        return;
    if ((fp = fopen(path, "r")) == NULL) {
        log_warn("rank_init: test-only %s=%s", RANK_TEST_MTP_DRAFTS, path);
        return;
    }
    t = calloc(1, sizeof(*t));
    t->hist = calloc((size_t)k->o.slots * TD_LEN, sizeof(int32_t));
    t->n_hist = calloc((size_t)k->o.slots, sizeof(int));
    if (t->hist == NULL || t->n_hist == NULL)
        fatalx("rank_init: out of memory");
    while (t->n_lines < TD_LINES && getline(&buf, &cap, fp) > 0) {
        int32_t *a = malloc(TD_LEN * sizeof(int32_t));
        int n = 0;
        char *p = buf, *end;

        if (a == NULL)
            fatalx("rank_init: out of memory");
        for (long v = strtol(p, &end, 10); end != p && n < TD_LEN; v = strtol(p, &end, 10)) {
            a[n++] = (int32_t)v;
            p = end;
        }
        t->line[t->n_lines] = a;
        t->line_len[t->n_lines++] = n;
    }
    free(buf);
    fclose(fp);
    k->test_drafts = t;
    log_warnx("rank_init: test-only %s=%s: %d outputs force the MTP drafts", RANK_TEST_MTP_DRAFTS,
              path, t->n_lines);
}

void
rank_test_drafts_free(struct rank *k)
{
    struct rank_test_drafts *t = k->test_drafts;

    if (t == NULL)
        return;
    for (int i = 0; i < t->n_lines; i++)
        free(t->line[i]);
    free(t->hist);
    free(t->n_hist);
    free(t);
    k->test_drafts = NULL;
}

void
rank_test_drafts_start(struct rank *k, int slot, int32_t token)
{
    struct rank_test_drafts *t = k->test_drafts;

    if (t == NULL)
        return;
    t->hist[(size_t)slot * TD_LEN] = token;
    t->n_hist[slot] = 1;
}

void
rank_test_drafts_emit(struct rank *k, int slot, int32_t token)
{
    struct rank_test_drafts *t = k->test_drafts;

    if (t != NULL && t->n_hist[slot] < TD_LEN)
        t->hist[(size_t)slot * TD_LEN + t->n_hist[slot]++] = token;
}

void
rank_test_drafts_pick(struct rank *k, int slot, int32_t *draft)
{
    struct rank_test_drafts *t = k->test_drafts;
    int h;

    if (t == NULL)
        return;
    h = t->n_hist[slot];
    if (h % 5 == 0)
        return;   /* the MTP layer's */
    for (int i = 0; i < t->n_lines; i++) {
        if (t->line_len[i] <= h ||
            memcmp(t->line[i], t->hist + (size_t)slot * TD_LEN, (size_t)h * sizeof(int32_t)) != 0)
            continue;
        *draft = h % 7 == 3 ? (t->line[i][h] + 1) % k->V : t->line[i][h];
        return;
    }
}
