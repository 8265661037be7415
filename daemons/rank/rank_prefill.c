/*
 * rank_prefill.c — the prefill role: prompts arrive in PREFILL, run through
 * the model in chunks (several prompts may share one forward call, at most
 * o.rows rows in all), the first output token is sampled with (seed, step),
 * and the slot's decode state is exported for the decode side
 * (rank_kv.c) and reported in PREFILL_DONE.  The model slot is free again
 * as soon as the state is exported; the export lives until KV_RELEASE.
 *
 * Rank main thread only.
 */
#include "rank.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "common/sdnotify.h"

void
prefill_start(struct rank *k, const struct dsv4_rank_prefill *p)
{
    struct rank_job *j = NULL;
    int slot = -1;

    /* A PREFILL for a request this rank still holds (running, or exported
     * and not yet released) is the scheduler re-running it: its word is
     * final, so the old work is dropped and the new one starts. */
    if (prefill_abort(k, p->req))
        log_notice("prefill_start: req=%" PRIu64 " re-run; earlier work dropped", p->req);
    for (int i = 0; i < k->o.slots; i++) {
        if (!k->jobs[i].active && slot < 0)
            slot = i;
    }
    if (p->transport <= DSV4_TRANSPORT_NONE || p->transport >= DSV4_TRANSPORT__COUNT ||
        k->kvx[p->transport] == NULL) {
        rank_send_error(k, p->req, DSV4_STATUS_NOT_SUPPORTED, "transport %s not supported "
                        "by %s", dsv4_transport_name(p->transport) != NULL ?
                        dsv4_transport_name(p->transport) : "?", k->name);
        return;
    }
    if ((int64_t)p->n_tokens > k->max_seq) {
        rank_send_error(k, p->req, DSV4_STATUS_TOO_LARGE, "%u prompt tokens, %s holds %d",
                        (unsigned)p->n_tokens, k->name, k->max_seq);
        return;
    }
    for (uint32_t i = 0; i < p->n_tokens; i++) {
        if (p->tokens[i] < 0 || p->tokens[i] >= k->V) {
            rank_send_error(k, p->req, DSV4_STATUS_BAD_ARGUMENT, "token %d at %u outside the "
                            "vocabulary (%d)", (int)p->tokens[i], (unsigned)i, k->V);
            return;
        }
    }
    if (slot < 0) {
        rank_send_error(k, p->req, DSV4_STATUS_BUSY, "%s: all %d prefill slots busy",
                        k->name, k->o.slots);
        return;
    }
    j = &k->jobs[slot];
    j->tokens = malloc(sizeof(int32_t) * p->n_tokens);
    if (j->tokens == NULL) {
        rank_send_error(k, p->req, DSV4_STATUS_NO_MEMORY, "out of memory");
        return;
    }
    memcpy(j->tokens, p->tokens, sizeof(int32_t) * p->n_tokens);
    /* reset where the last job's clear did not (the rank's first use of the
     * slot): its state fills are then off the prompt's first-token path */
    if (!j->clean && dsv4_model_seq_reset(k->m, slot) != DSV4_OK)
        fatalx("prefill_start: seq_reset slot=%d: %s", slot, dsv4_errmsg());
    j->clean = false;
    j->active = true;
    j->req = p->req;
    j->gen = k->comm_gen;
    j->n_tokens = p->n_tokens;
    j->done = 0;
    j->chunk = (uint32_t)k->o.rows;
    if (p->has_chunk && p->chunk < j->chunk)
        j->chunk = p->chunk;
    j->s = p->s;
    j->step = p->step;
    j->transport = p->transport;
    j->t_us = dsv4_now_us();
    log_info("prefill_start: req=%" PRIu64 " n_tokens=%u slot=%d", p->req,
             (unsigned)p->n_tokens, slot);
}

int
prefill_runnable(const struct rank *k, uint64_t *reqs)
{
    int n = 0;

    for (int i = 0; i < k->o.slots; i++)
        if (k->jobs[i].active && k->jobs[i].done < k->jobs[i].n_tokens)
            reqs[n++] = k->jobs[i].req;
    return n;
}

bool
prefill_pending(const struct rank *k)
{
    for (int i = 0; i < k->o.slots; i++)
        if (k->jobs[i].active)
            return true;
    return false;
}

static void
prefill_job_clear(struct rank *k, int slot)
{
    struct rank_job *j = &k->jobs[slot];

    free(j->tokens);
    memset(j, 0, sizeof(*j));
    j->clean = dsv4_model_seq_reset(k->m, slot) == DSV4_OK;
}

/*
 * A forward call of `rows` rows ran out of device memory (the backend's
 * scratch for a call that size; dsv4_errmsg says which op) on a rank outside
 * a group.  Nothing else is wrong with the rank, so it stays up: the prompts
 * of the call go back to the scheduler as NO_MEMORY (it re-runs them, on
 * another prefill group while one is usable, and fails them after its
 * re-runs) and their slots are reset; smaller calls may still fit.  Fatal
 * instead, it would fail the same way at every restart and, with the
 * re-runs, take the rank's start limit and the set down (docs/operations.md
 * "Troubleshooting").
 */
static void
prefill_nomem(struct rank *k, int n_seqs, int rows)
{
    char why[256];

    snprintf(why, sizeof(why), "%s", dsv4_errmsg());
    log_warnx("prefill_work: forward of %d rows: %s; its %d prompt(s) go back to the "
              "scheduler", rows, why, n_seqs);
    for (int s = 0; s < n_seqs; s++) {
        int slot = k->b_slot[s];

        rank_send_error(k, k->jobs[slot].req, DSV4_STATUS_NO_MEMORY, "%s: no device memory "
                        "for a forward of %d rows: %s", k->name, rows, why);
        prefill_job_clear(k, slot);
    }
}

/* One forward call of batch `b`, sampling each run's last row into
 * k->out_tok / out_lp / out_top with k->sp; DSV4_TEST_FORWARD_NOMEM turns its N-th
 * call (the start-up warm-up counted) into DSV4_ERR_NOMEM. */
static enum dsv4_err
prefill_forward(struct rank *k, const struct dsv4_batch *b)
{
    return rank_test_nomem(&k->test_nomem, RANK_TEST_FORWARD_NOMEM,
                           dsv4_model_forward_sample(k->m, b, k->sp, k->out_tok, k->out_lp,
                                                     &k->out_top));
}

/*
 * The warm-up (rank_warmup: before the rank registers, or in a group's
 * join): one forward call of the largest size the rank will run (o.rows
 * rows, at most max_seq, one sequence in slot 0), then the export of its
 * decode state into a region for the longest prompt, so that the backend's
 * working memory (the CUDA kernels' scratch, cuBLASLt's copies, lazily
 * loaded kernels) and the handoff's region are taken now and not by the
 * first prompt, and so that a call that size which does not fit the device
 * is found at start.  Alone, when the call or its export runs out of device
 * memory, the backend's working memory is given back (dsv4_model_trim), the
 * rows per call are halved and both tried again: the rank then serves in
 * smaller calls (a warning says so) instead of failing every long prompt
 * with 503.  In a group a rank cannot lower its calls alone (its peers'
 * calls must match, and one out of memory may have left them inside a
 * collective): the error is returned.
 */
/* The warm-up's export of slot `slot`'s state of n tokens into a region
 * sized for the longest prompt (max_seq tokens; kv_warmup_export), so that
 * the handoff's memory is taken before the rank serves too: a GPU whose
 * scratch left no room for it failed every prompt's export with 503
 * (docs/perf.md runs 71, 72).  DSV4_OK, or the error with its message. */
static enum dsv4_err
warmup_export(struct rank *k, int slot, int n)
{
    int64_t t0 = dsv4_now_us();
    const char *via;
    char why[256];
    size_t bytes;
    enum dsv4_err e = kv_warmup_export(k, slot, n, k->max_seq, &bytes, &via);

    if (e != DSV4_OK) {
        snprintf(why, sizeof(why), "%s", dsv4_errmsg());
        return dsv4_err_set(e, "prefill_warmup: the decode-state export of %d tokens into a "
                            "region for %d (%zu bytes, %s): %s", n, k->max_seq, bytes, via,
                            why);
    }
    log_notice("prefill_warmup: a decode-state export of %d tokens into a region for %d (%zu "
               "bytes, %s) took %.1f ms", n, k->max_seq, bytes, via,
               (double)(dsv4_now_us() - t0) / 1e3);
    return DSV4_OK;
}

enum dsv4_err
prefill_warmup(struct rank *k)
{
    int rows = k->o.rows < k->max_seq ? k->o.rows : k->max_seq;
    int slot = 0;
    int32_t n;
    struct dsv4_batch b;

    k->rows_full = rows;
    /* a smaller call after a failed one takes a prefix of the same tokens */
    rank_warmup_inputs(k, rows, 1);
    b.n_seqs = 1;
    b.slot = &slot;
    b.n_tokens = &n;
    b.tokens = k->b_tok;
    for (;;) {
        int64_t t0 = dsv4_now_us();
        char why[256];
        bool fitted = false;   /* the forward call did */
        enum dsv4_err e, r;

        sdnotify_status("warming up: a forward call of %d rows", rows);
        n = rows;
        e = prefill_forward(k, &b);
        if (e == DSV4_OK) {
            fitted = true;
            log_notice("prefill_warmup: a forward call of %d rows took %.1f ms", rows,
                       (double)(dsv4_now_us() - t0) / 1e3);
            e = warmup_export(k, slot, rows);
        } else {
            snprintf(why, sizeof(why), "%s", dsv4_errmsg());
            dsv4_err_set(e, "prefill_warmup: a forward call of %d rows: %s", rows, why);
        }
        snprintf(why, sizeof(why), "%s", dsv4_errmsg());
        if ((r = dsv4_model_seq_reset(k->m, slot)) != DSV4_OK) {
            snprintf(why, sizeof(why), "%s", dsv4_errmsg());
            return dsv4_err_set(r, "prefill_warmup: seq_reset: %s", why);
        }
        if (e == DSV4_OK)
            break;
        if (e == DSV4_ERR_NOMEM && k->o.group_size > 1)
            return dsv4_err_set(e, "%s (in a group the rows per call are not lowered: lower "
                                "prefill_chunk%s)", why, fitted ? " or max_seq, or run fewer "
                                "daemons on the GPU" : "");
        /* the region is sized for max_seq whatever the rows: where
         * /dev/shm is short, smaller calls free none of its room */
        if (e == DSV4_ERR_NOMEM && fitted && k->kv_shm_full)
            return dsv4_err_set(e, "%s (no room in /dev/shm for the handoff of a max_seq "
                                "prompt: lower max_seq, or give /dev/shm more room, e.g. a "
                                "container's --shm-size)", why);
        if (e != DSV4_ERR_NOMEM || rows == 1)
            return dsv4_err_set(e, "%s%s", why, e == DSV4_ERR_NOMEM && fitted ? " (no room left "
                                "for the handoff: lower max_seq, or run fewer daemons on the "
                                "GPU)" : "");
        /* what the larger call grew is given back: the smaller one and its
         * export find the room it leaves */
        if ((r = dsv4_model_trim(k->m)) != DSV4_OK) {
            char tw[256];

            snprintf(tw, sizeof(tw), "%s", dsv4_errmsg());
            return dsv4_err_set(r, "%s; then the backend's trim: %s", why, tw);
        }
        log_warnx("%s; rows per call lowered to %d (prompts longer than that run in several "
                  "calls)", why, rows / 2);
        rows /= 2;
    }
    k->o.rows = rows;
    return DSV4_OK;
}

/* The prompt in `slot` is through the model and its first token, sampled
 * from its last row, is `tok` (log-probability lp; its n_top most likely
 * tokens top_ids / top_lp): export, report. */
static void
prefill_finish(struct rank *k, int slot, int32_t tok, float lp, int32_t n_top,
               const int32_t *top_ids, const float *top_lp)
{
    struct rank_job *j = &k->jobs[slot];
    struct dsv4_msg m;
    uint64_t seg[2];
    enum dsv4_err e;
    int64_t t_x = dsv4_now_us();   /* the forward calls done */

    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_PREFILL_DONE);
    e = kv_export(k, j->transport, j->req, slot, j->n_tokens, seg, &m.u.prefill_done.kv[0]);
    if (e != DSV4_OK) {
        rank_send_error(k, j->req, dsv4_proto_code_from_err(e), "export of the decode state "
                        "failed: %s", dsv4_errmsg());
        prefill_job_clear(k, slot);
        return;
    }
    m.u.prefill_done.req = j->req;
    m.u.prefill_done.token = tok;
    m.u.prefill_done.n_kv = 1;
    /* in a group every rank holds the whole (replicated) state: one part each */
    m.u.prefill_done.kv[0].part = k->o.group_rank;
    m.u.prefill_done.kv[0].n_parts = k->o.group_size;
    if (j->s.logprobs) {
        m.u.prefill_done.logprob = lp;
        m.u.prefill_done.has_logprob = true;
    }
    if (n_top > 0) {
        m.u.prefill_done.top_ids = top_ids;
        m.u.prefill_done.top_logprobs = top_lp;
        m.u.prefill_done.n_top = (uint32_t)n_top;
    }
    if (!rank_send(k, &m))
        kv_release(k, j->req);
    /* the time since PREFILL arrived: through the model, then the export */
    log_info("prefill_done: req=%" PRIu64 " token=%d n_tokens=%u run_ms=%.2f "
             "export_ms=%.2f", j->req, (int)tok, (unsigned)j->n_tokens,
             (double)(t_x - j->t_us) / 1e3, (double)(dsv4_now_us() - t_x) / 1e3);
    prefill_job_clear(k, slot);
}

void
prefill_work(struct rank *k)
{
    int n_seqs = 0, rows = 0, S = k->o.slots;
    struct dsv4_batch b;
    enum dsv4_err e;

    /* Round-robin over the jobs so one long prompt cannot starve the rest; a
     * group member takes the agreed requests (rank_group.c), rotated alike on
     * every rank. */
    int n_cand = k->comm != NULL ? k->n_agreed : S;

    for (int t = 0; t < n_cand && rows < k->o.rows; t++) {
        int i = (int)((k->rr + (uint32_t)t) % (uint32_t)n_cand);
        struct rank_job *j;
        uint32_t n;

        if (k->comm != NULL) {
            uint64_t req = k->agreed[i];

            i = -1;
            for (int s = 0; s < S && i < 0; s++)
                if (k->jobs[s].active && k->jobs[s].req == req)
                    i = s;
            if (i < 0)
                continue;
        }
        j = &k->jobs[i];
        if (!j->active || j->done >= j->n_tokens)
            continue;
        n = j->n_tokens - j->done;
        if (n > j->chunk)
            n = j->chunk;
        if (n > (uint32_t)(k->o.rows - rows))
            n = (uint32_t)(k->o.rows - rows);
        k->b_slot[n_seqs] = i;
        k->b_ntok[n_seqs] = (int32_t)n;
        rank_sample_params(&k->sp[n_seqs], &j->s, j->step);
        if (j->done + n < j->n_tokens)
            k->sp[n_seqs].n_top = 0;   /* a chunk's sample is not output */
        memcpy(&k->b_tok[rows], &j->tokens[j->done], sizeof(int32_t) * n);
        rows += (int)n;
        n_seqs++;
    }
    k->rr = (k->rr + 1) % (uint32_t)S;
    if (n_seqs == 0)
        return;
    b.n_seqs = n_seqs;
    b.slot = k->b_slot;
    b.n_tokens = k->b_ntok;
    b.tokens = k->b_tok;
    /* every run's last row is sampled on the backend; the runs that finish
     * their prompt use theirs */
    group_enter(k);
    e = prefill_forward(k, &b);
    if (e == DSV4_ERR_NOMEM && k->comm == NULL) {
        group_leave(k);
        prefill_nomem(k, n_seqs, rows);
        return;
    }
    if (!group_forward_end(k, e, "prefill_work: forward of %d rows", rows))
        return;
    for (int s = 0; s < n_seqs; s++) {
        struct rank_job *j = &k->jobs[k->b_slot[s]];
        j->done += (uint32_t)k->b_ntok[s];
        if (j->done == j->n_tokens)
            prefill_finish(k, k->b_slot[s], k->out_tok[s], k->out_lp[s], k->out_top.n[s],
                           k->out_top.ids + (size_t)s * DSV4_TOP_MAX,
                           k->out_top.logprob + (size_t)s * DSV4_TOP_MAX);
    }
}

bool
prefill_abort(struct rank *k, uint64_t req)
{
    bool held = kv_release(k, req);

    for (int i = 0; i < k->o.slots; i++) {
        if (k->jobs[i].active && k->jobs[i].req == req) {
            prefill_job_clear(k, i);
            held = true;
        }
    }
    return held;
}

void
prefill_reset(struct rank *k)
{
    prefill_reset_before(k, UINT32_MAX);
}

void
prefill_reset_before(struct rank *k, uint32_t gen)
{
    for (int i = 0; i < k->o.slots; i++)
        if (k->jobs[i].active && k->jobs[i].gen < gen)
            prefill_job_clear(k, i);
    kv_release_all(k);
}
