/*
 * rank_decode.c — the decode role: DECODE starts importing a request's
 * decode state into a free slot (rank_kv.c); when the state is in (at once
 * for shm, after a network copy for ucx) the rank acknowledges with
 * KV_RELEASE and the stream joins the running batch.  An import that fails
 * or outlives kv_timeout_ms is acknowledged too (the exporter may free) and
 * reported as ERROR, so the scheduler re-runs the request; the other
 * streams keep stepping meanwhile.  Every step is ONE forward call over all
 * running streams (one token each); each stream samples with (seed, step),
 * the step's tokens go out in one TOKENS message, and a stream that reached
 * its max_tokens, sampled one of its stop ids or filled its slot ends with
 * DECODE_DONE.  The CPU backend's results do not depend on the batch, so any
 * mix of streams gives each stream the tokens of a single-stream run.
 *
 * Rank main thread only.
 */
#include "rank.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/sdnotify.h"

static void decode_import_step(struct rank *k, int slot);

/* The decode state of `req` could not be imported: acknowledge (the
 * exporter may free) and report, so the scheduler re-runs the request. */
static void
decode_import_failed(struct rank *k, uint64_t req, enum dsv4_err e)
{
    log_warnx("decode_import: req=%" PRIu64 ": %s", req, dsv4_errmsg());
    rank_send_ref(k, DSV4_RANK_KV_RELEASE, req);
    rank_send_error(k, req, dsv4_proto_code_from_err(e), "import of the decode state failed: "
                    "%s", dsv4_errmsg());
}

void
decode_start(struct rank *k, const struct dsv4_rank_decode *d)
{
    struct rank_stream *st;
    enum dsv4_err e;
    int slot = -1;

    for (int i = 0; i < k->o.slots; i++) {
        if (k->streams[i].active && k->streams[i].req == d->req) {
            rank_send_ref(k, DSV4_RANK_KV_RELEASE, d->req);
            rank_send_error(k, d->req, DSV4_STATUS_BAD_ARGUMENT, "req %" PRIu64
                            " is already decoding", d->req);
            return;
        }
    }
    /* The scheduler's slot when free, else the first free one. */
    if (d->slot < (uint32_t)k->o.slots && !k->streams[d->slot].active)
        slot = (int)d->slot;
    for (int i = 0; i < k->o.slots && slot < 0; i++)
        if (!k->streams[i].active)
            slot = i;
    if (slot < 0) {
        rank_send_ref(k, DSV4_RANK_KV_RELEASE, d->req);
        rank_send_error(k, d->req, DSV4_STATUS_BUSY, "%s: all %d stream slots busy", k->name,
                        k->o.slots);
        return;
    }
    if ((int64_t)d->pos >= k->max_seq || d->token < 0 || d->token >= k->V) {
        rank_send_ref(k, DSV4_RANK_KV_RELEASE, d->req);
        rank_send_error(k, d->req, (int64_t)d->pos >= k->max_seq ? DSV4_STATUS_TOO_LARGE :
                        DSV4_STATUS_BAD_ARGUMENT, "pos %u / token %d do not fit %s (%d "
                        "positions, %d ids)", (unsigned)d->pos, (int)d->token, k->name,
                        k->max_seq, k->V);
        return;
    }
    st = &k->streams[slot];
    memset(st, 0, sizeof(*st));
    e = kv_import_start(k, st, d->kv, d->n_kv, d->pos);
    if (e != DSV4_OK) {
        memset(st, 0, sizeof(*st));
        decode_import_failed(k, d->req, e);
        return;
    }
    st->active = true;
    st->req = d->req;
    st->gen = k->comm_gen;
    st->next = d->token;
    rank_test_drafts_start(k, slot, d->token);
    st->max_tokens = d->max_tokens;
    st->step = d->has_step ? d->step : 1;
    st->s = d->s;
    st->n_stop_ids = d->n_stop_ids;
    if (d->n_stop_ids > 0)
        memcpy(st->stop_ids, d->stop_ids, sizeof(int32_t) * d->n_stop_ids);
    log_info("decode_start: req=%" PRIu64 " slot=%d pos=%u max_tokens=%u via %s", d->req,
             slot, (unsigned)d->pos, (unsigned)d->max_tokens,
             dsv4_transport_name(st->xk->transport));
    /* A local transport has finished already. */
    decode_import_step(k, slot);
}

/* The import of stream `slot` ended (st->xfer NULL): acknowledge, then run
 * the stream or drop it. */
static void
decode_import_step(struct rank *k, int slot)
{
    struct rank_stream *st = &k->streams[slot];
    uint64_t req = st->req;
    enum dsv4_err e;

    e = kv_import_poll(k, st, slot);
    if (e == DSV4_ERR_BUSY)
        return;
    if (e != DSV4_OK) {
        memset(st, 0, sizeof(*st));
        decode_import_failed(k, req, e);
        return;
    }
    /* Copied: the exporter may free it now. */
    rank_send_ref(k, DSV4_RANK_KV_RELEASE, req);
    log_debug("decode_import: req=%" PRIu64 " slot=%d running", req, slot);
}

int64_t
decode_imports(struct rank *k, int64_t now)
{
    int64_t next = -1;

    for (int t = 0; t < DSV4_TRANSPORT__COUNT; t++)
        if (k->kvx[t] != NULL)
            dsv4_kvx_event_clear(k->kvx[t]);
    for (int i = 0; i < k->o.slots; i++) {
        struct rank_stream *st = &k->streams[i];
        int64_t left;

        if (!st->active || st->xfer == NULL)
            continue;
        decode_import_step(k, i);
        if (!st->active || st->xfer == NULL)
            continue;
        left = st->xfer->deadline_ms - now;
        if (left < 0)
            left = 0;
        if (next < 0 || left < next)
            next = left;
    }
    return next;
}

int
decode_runnable(const struct rank *k, uint64_t *reqs)
{
    int n = 0;

    for (int i = 0; i < k->o.slots; i++)
        if (k->streams[i].active && k->streams[i].xfer == NULL)
            reqs[n++] = k->streams[i].req;
    return n;
}

bool
decode_pending(const struct rank *k)
{
    for (int i = 0; i < k->o.slots; i++)
        if (k->streams[i].active && k->streams[i].xfer == NULL)
            return true;
    return false;
}

static void stats_post(struct rank *k, int64_t t1);
static void spec_status(struct rank *k, bool force);

static void
decode_end(struct rank *k, int slot, enum dsv4_finish f, bool report)
{
    struct rank_stream *st = &k->streams[slot];
    struct dsv4_msg m;

    if (st->xfer != NULL)
        kv_import_abort(k, st);
    if (report) {
        dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DECODE_DONE);
        m.u.decode_done.req = st->req;
        m.u.decode_done.finish = f;
        m.u.decode_done.n_tokens = st->n_emitted;
        rank_send(k, &m);
        log_info("decode_done: req=%" PRIu64 " finish=%s n_tokens=%u%s", st->req,
                 dsv4_finish_name(f), (unsigned)st->n_emitted, k->mtp ? " (mtp)" : "");
        if (k->mtp)
            log_info("decode_done: req=%" PRIu64 " mtp drafts=%u accepted=%u", st->req,
                     (unsigned)st->n_drafts, (unsigned)st->n_accepted);
    }
    memset(st, 0, sizeof(*st));
    dsv4_model_seq_reset(k->m, slot);
    if (!decode_pending(k)) {
        /* idle from here: no step gap to count, and the open window ends
         * at the last step (an abort or a failed step ended the last
         * stream), not at the next stream's first step */
        if (k->st_fwd_end_us != 0)
            stats_post(k, k->st_fwd_end_us);
        k->st_fwd_end_us = 0;
        /* the drafts' counters too (the last step's post may have been
         * held back by its once-a-second limit) */
        if (k->mtp)
            spec_status(k, true);
    }
}

/* Why stream `st` ends after emitting `tok` (a stop id, max_tokens), or
 * NONE. */
static enum dsv4_finish
decode_stop_token(const struct rank_stream *st, int32_t tok)
{
    for (uint32_t i = 0; i < st->n_stop_ids; i++)
        if (st->stop_ids[i] == tok)
            return DSV4_FINISH_STOP;
    if (st->n_emitted >= st->max_tokens)
        return DSV4_FINISH_LENGTH;
    return DSV4_FINISH_NONE;
}

/* Why stream `st` ends after sampling `tok`, or NONE. */
static enum dsv4_finish
decode_stop(const struct rank *k, const struct rank_stream *st, int slot, int32_t tok)
{
    enum dsv4_finish f = decode_stop_token(st, tok);

    if (f != DSV4_FINISH_NONE)
        return f;
    /* The next step would feed `tok` at position seq_len: it must fit. */
    if (dsv4_model_seq_len(k->m, slot) >= k->max_seq)
        return DSV4_FINISH_LENGTH;
    return DSV4_FINISH_NONE;
}

/* The streams of this step into k->b_slot (one token each: b_ntok, b_tok,
 * sp); their number; *want_lp when one wants log-probabilities. */
static int
decode_pick(struct rank *k, bool *want_lp)
{
    int n = 0;

    *want_lp = false;
    /* alone: every running stream; in a group: the agreed ones, in order */
    int n_cand = k->comm != NULL ? k->n_agreed : k->o.slots;

    for (int c = 0; c < n_cand; c++) {
        int i = c;
        struct rank_stream *st;

        if (k->comm != NULL) {
            i = -1;
            for (int s = 0; s < k->o.slots && i < 0; s++)
                if (k->streams[s].active && k->streams[s].req == k->agreed[c])
                    i = s;
            if (i < 0)
                continue;
        }
        st = &k->streams[i];
        if (!st->active || st->xfer != NULL)
            continue;
        k->b_slot[n] = i;
        k->b_ntok[n] = 1;
        k->b_tok[n] = st->next;
        rank_sample_params(&k->sp[n], &st->s, st->step);
        *want_lp = *want_lp || st->s.logprobs;
        n++;
    }
    return n;
}

/*
 * Account a step of n streams whose forward (with sampling, tokens back on
 * the host) ran from t0 to t1; STATUS= with the window's figures once a
 * second and when the rank goes idle: steps, stream-steps (tokens emitted),
 * the forward's time a step and the host's time between two forwards (the
 * group's tick, the TOKENS message, the scheduler's messages: what a
 * model-level benchmark of the forward does not see).
 */
static void
decode_stats(struct rank *k, int n, int64_t t0, int64_t t1)
{
    bool idle = !decode_pending(k);

    if (k->st_win_us == 0)
        k->st_win_us = t0;
    if (k->st_fwd_end_us != 0) {
        k->st_host_us += t0 - k->st_fwd_end_us;
        k->st_gaps++;
    }
    k->st_fwd_us += t1 - t0;
    k->st_steps++;
    k->st_rows += (uint64_t)n;
    k->st_fwd_end_us = idle ? 0 : t1;   /* idle: the next gap is not a step's */
    if (!idle && t1 - k->st_win_us < 1000000)
        return;
    stats_post(k, t1);
}

/* How a STATUS= line starts: a rank that SIGTERM made leave says so for as
 * long as it finishes its streams (rank_signal's "stopping: ..." line is
 * not replaced by a plain "serving"). */
static const char *
status_doing(const struct rank *k)
{
    return k->leave_ms != 0 ? "stopping: finishing its streams as" : "serving as";
}

/* Post the open window of decode_stats, ending at t1, and start a new one
 * (nothing when no step ran in it). */
static void
stats_post(struct rank *k, int64_t t1)
{
    double fwd_ms, out_us;

    if (k->st_steps == 0) {
        k->st_win_us = 0;
        return;
    }
    fwd_ms = (double)k->st_fwd_us / 1e3 / (double)k->st_steps;
    out_us = k->st_gaps > 0 ? (double)k->st_host_us / (double)k->st_gaps : 0.0;
    sdnotify_status("%s %s (%d slots); %" PRIu64 " steps (%" PRIu64 " stream-steps) "
                    "in %.2f s, forward %.2f ms a step, %.0f us a step outside it",
                    status_doing(k), k->name, k->o.slots, k->st_steps, k->st_rows,
                    (double)(t1 - k->st_win_us) / 1e6, fwd_ms, out_us);
    log_debug("decode_stats: %" PRIu64 " steps, %" PRIu64 " stream-steps, forward %.3f ms, "
              "outside %.1f us a step", k->st_steps, k->st_rows, fwd_ms, out_us);
    k->st_win_us = 0;
    k->st_fwd_us = k->st_host_us = 0;
    k->st_steps = k->st_rows = k->st_gaps = 0;
}

/*
 * A step (`what`) of the n streams in b_slot ran out of device memory on a
 * rank outside a group: rare after the warm-up took a full batch's working
 * memory (a batch size's first graph, a context's first indexer scores, the
 * GPU's other processes taking more), and nothing else is wrong with the
 * rank, so it stays up.  The step may have written part of its streams'
 * state, so they end here and go back to the scheduler as NO_MEMORY: it
 * re-runs each from its last emitted token (a prefill of the prompt and the
 * output so far, then a decode group), and fails it after its re-runs.
 * Exiting instead would re-run every stream of the rank and pay a restart.
 */
static void
decode_nomem(struct rank *k, int n, const char *what)
{
    char why[256];

    snprintf(why, sizeof(why), "%s", dsv4_errmsg());
    log_warnx("%s of %d streams: %s; they go back to the scheduler", what, n, why);
    for (int r = 0; r < n; r++) {
        int slot = k->b_slot[r];

        rank_send_error(k, k->streams[slot].req, DSV4_STATUS_NO_MEMORY, "%s: no device "
                        "memory for a step of %d streams: %s", k->name, n, why);
        decode_end(k, slot, DSV4_FINISH_CANCELLED, false);
    }
    k->st_fwd_end_us = 0;
}

/* After a step: warn when kinds of step run without a CUDA graph because
 * none could be made (forward.h): at the first, then each time their
 * number doubles (a few lines at most); a notice when they all
 * run as graphs again.  A change goes to the scheduler at once (HEARTBEAT
 * graphs_refused: dsv4ctl ranks, the gateway's /metrics). */
static void
decode_graphs_check(struct rank *k)
{
    int n = dsv4_model_graphs_refused(k->m) + (int)k->test_graphs_refused;

    if (n > 0 && n >= 2 * k->graphs_warned) {
        log_warnx("decode: %d kind(s) of step (batch sizes) now run without a CUDA graph%s: no "
                  "device memory was left to make one (each such step pays its launches; the "
                  "GPU's other daemons hold the memory: lower their prefill_chunk, or run "
                  "fewer on the GPU)", n, k->test_graphs_refused > 0 ? " (counted for a "
                  "test: " RANK_TEST_GRAPHS_REFUSED ")" : "");
        k->graphs_warned = n;
    } else if (n == 0 && k->graphs_warned > 0) {
        log_notice("decode: every kind of step runs as a CUDA graph again");
        k->graphs_warned = 0;
    }
    if (n != k->graphs_refused) {
        k->graphs_refused = n;
        rank_heartbeat(k);
    }
}

void
decode_work(struct rank *k)
{
    uint64_t reqs[RANK_MAX_SLOTS];
    bool want_lp = false;
    struct dsv4_batch b;
    struct dsv4_msg m;
    enum dsv4_err e;
    int64_t t0, t1;
    int n;

    if (k->mtp) {
        decode_work_spec(k);
        return;
    }
    n = decode_pick(k, &want_lp);
    if (n == 0)
        return;
    b.n_seqs = n;
    b.slot = k->b_slot;
    b.n_tokens = k->b_ntok;
    b.tokens = k->b_tok;
    /* forward and sampling on the backend: only the ids come back */
    t0 = dsv4_now_us();
    group_enter(k);
    e = dsv4_model_forward_sample(k->m, &b, k->sp, k->out_tok, want_lp ? k->out_lp : NULL,
                                  &k->out_top);
    /* the N-th step (the warm-up not counted) */
    e = rank_test_nomem(&k->test_nomem, RANK_TEST_FORWARD_NOMEM, e);
    t1 = dsv4_now_us();
    if (e == DSV4_ERR_NOMEM && k->comm == NULL) {
        group_leave(k);
        decode_nomem(k, n, "decode_work: forward");
        return;
    }
    if (!group_forward_end(k, e, "decode_work: forward of %d streams", n)) {
        k->st_fwd_end_us = 0;
        return;
    }
    decode_graphs_check(k);

    for (int r = 0; r < n; r++) {
        struct rank_stream *st = &k->streams[k->b_slot[r]];
        reqs[r] = st->req;
        st->next = k->out_tok[r];
        st->step++;
        st->n_emitted++;
    }
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_TOKENS);
    m.u.step.step = k->n_steps++;
    m.u.step.reqs = reqs;
    m.u.step.tokens = k->out_tok;
    m.u.step.logprobs = want_lp ? k->out_lp : NULL;
    m.u.step.n = (uint32_t)n;
    rank_top_pack(k, &m.u.step.top, n);
    rank_send(k, &m);
    log_debug("decode_work: step=%" PRIu64 " streams=%d", m.u.step.step, n);

    /* (counted before the streams end: the last one's end posts the window
     * with this step in it, not a window of this step alone after it) */
    decode_stats(k, n, t0, t1);
    for (int r = 0; r < n; r++) {
        int slot = k->b_slot[r];
        enum dsv4_finish f = decode_stop(k, &k->streams[slot], slot, k->out_tok[r]);
        if (f != DSV4_FINISH_NONE)
            decode_end(k, slot, f, true);
    }
}

/* STATUS= with the speculative-decoding counters: at most once a second,
 * and when the rank has gone idle (`force`). */
static void
spec_status(struct rank *k, bool force)
{
    int64_t now = dsv4_now_ms();

    if (!force && k->spec_status_ms != 0 && now - k->spec_status_ms < 1000)
        return;
    k->spec_status_ms = now;
    sdnotify_status("%s %s (%d slots); mtp drafts %" PRIu64 " accepted %" PRIu64
                    " (%.1f%%)", status_doing(k), k->name, k->o.slots, k->spec_drafts,
                    k->spec_accepted,
                    k->spec_drafts > 0 ? 100.0 * (double)k->spec_accepted /
                    (double)k->spec_drafts : 0.0);
}

void
decode_work_spec(struct rank *k)
{
    const int K = DSV4_SPEC_MAX_DRAFT, K1 = DSV4_SPEC_MAX_DRAFT + 1;
    uint64_t reqs[RANK_MAX_SLOTS * (DSV4_SPEC_MAX_DRAFT + 1)];
    int end_slot[RANK_MAX_SLOTS];
    enum dsv4_finish end_why[RANK_MAX_SLOTS];
    struct dsv4_spec_batch b;
    struct dsv4_msg m;
    bool want_lp;
    enum dsv4_err e;
    int n, n_out = 0, n_end = 0;

    n = decode_pick(k, &want_lp);
    if (n == 0)
        return;
    for (int r = 0; r < n; r++) {
        const struct rank_stream *st = &k->streams[k->b_slot[r]];

        /* a draft needs room for its row; the first step has none */
        k->spec_nd[r] = st->has_draft &&
                        dsv4_model_seq_len(k->m, k->b_slot[r]) + K1 <= k->max_seq ? K : 0;
        k->spec_draft[r] = st->draft;
    }
    b.n_seqs = n;
    b.slot = k->b_slot;
    b.last = k->b_tok;
    b.n_draft = k->spec_nd;
    b.draft = k->spec_draft;
    /* verify (forward of [next, draft] and sampling on the backend), then
     * the MTP layer's next drafts; every rank of a group decides alike */
    group_enter(k);
    e = dsv4_model_spec_verify(k->m, &b, k->sp, k->out_tok, want_lp ? k->out_lp : NULL,
                               &k->out_top, k->spec_n, NULL);
    if (e == DSV4_OK)
        e = dsv4_model_spec_draft(k->m, k->spec_draft, NULL);
    /* the N-th step (the warm-up not counted) */
    e = rank_test_nomem(&k->test_nomem, RANK_TEST_FORWARD_NOMEM, e);
    if (e == DSV4_ERR_NOMEM && k->comm == NULL) {
        group_leave(k);
        decode_nomem(k, n, "decode_work_spec: verify and draft");
        return;
    }
    if (!group_forward_end(k, e, "decode_work_spec: verify of %d streams", n))
        return;
    decode_graphs_check(k);

    /* 1 .. K1 tokens per stream, in order; a stop id or max_tokens at any of
     * them ends the stream there (out_tok is compacted in place: n_out never
     * passes the index read) */
    for (int r = 0; r < n; r++) {
        int slot = k->b_slot[r];
        struct rank_stream *st = &k->streams[slot];

        st->has_draft = true;
        st->draft = k->spec_draft[r];
        st->n_drafts += (uint32_t)k->spec_nd[r];
        st->n_accepted += (uint32_t)(k->spec_n[r] - 1);
        k->spec_drafts += (uint64_t)k->spec_nd[r];
        k->spec_accepted += (uint64_t)(k->spec_n[r] - 1);
        for (int j = 0; j < k->spec_n[r]; j++) {
            int32_t tok = k->out_tok[r * K1 + j];
            enum dsv4_finish f;

            reqs[n_out] = st->req;
            k->out_tok[n_out] = tok;
            k->out_lp[n_out] = k->out_lp[r * K1 + j];
            k->out_top.n[n_out] = k->out_top.n[r * K1 + j];
            memmove(k->out_top.ids + (size_t)n_out * DSV4_TOP_MAX,
                    k->out_top.ids + (size_t)(r * K1 + j) * DSV4_TOP_MAX,
                    DSV4_TOP_MAX * sizeof(int32_t));
            memmove(k->out_top.logprob + (size_t)n_out * DSV4_TOP_MAX,
                    k->out_top.logprob + (size_t)(r * K1 + j) * DSV4_TOP_MAX,
                    DSV4_TOP_MAX * sizeof(float));
            n_out++;
            rank_test_drafts_emit(k, slot, tok);
            st->next = tok;
            st->step++;
            st->n_emitted++;
            /* the length check only after the last token (earlier ones are
             * through the model already) */
            f = j + 1 < k->spec_n[r] ? decode_stop_token(st, tok) : decode_stop(k, st, slot, tok);
            if (f != DSV4_FINISH_NONE) {
                end_slot[n_end] = slot;
                end_why[n_end++] = f;
                break;
            }
        }
        rank_test_drafts_pick(k, slot, &st->draft);   /* test only */
    }
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_TOKENS);
    m.u.step.step = k->n_steps++;
    m.u.step.reqs = reqs;
    m.u.step.tokens = k->out_tok;
    m.u.step.logprobs = want_lp ? k->out_lp : NULL;
    m.u.step.n = (uint32_t)n_out;
    rank_top_pack(k, &m.u.step.top, n_out);
    rank_send(k, &m);
    log_debug("decode_work_spec: step=%" PRIu64 " streams=%d tokens=%d", m.u.step.step, n,
              n_out);
    for (int i = 0; i < n_end; i++)
        decode_end(k, end_slot[i], end_why[i], true);
    spec_status(k, !decode_pending(k));
}

bool
decode_abort(struct rank *k, uint64_t req)
{
    for (int i = 0; i < k->o.slots; i++) {
        if (k->streams[i].active && k->streams[i].req == req) {
            decode_end(k, i, DSV4_FINISH_CANCELLED, false);
            return true;
        }
    }
    return false;
}

void
decode_reset(struct rank *k)
{
    decode_reset_before(k, UINT32_MAX);
}

void
decode_reset_before(struct rank *k, uint32_t gen)
{
    for (int i = 0; i < k->o.slots; i++)
        if (k->streams[i].active && k->streams[i].gen < gen)
            decode_end(k, i, DSV4_FINISH_CANCELLED, false);
}

/* One warm-up call at batch size n on slots 0 .. n-1 (rank_warmup_inputs),
 * the slots reset after: a plain step (flags: DSV4_FWD_FULL_INDEXER or 0;
 * logits to `logits`, or sampled when NULL) or, with speculative decoding,
 * a verify step where every stream has a draft and the draft step after
 * it.  DSV4_OK, or the error with its message. */
static enum dsv4_err
warmup_call(struct rank *k, int n, unsigned flags, float *logits)
{
    char why[256];
    enum dsv4_err e;

    rank_warmup_inputs(k, n, n);
    for (int s = 0; s < n; s++) {
        k->b_slot[s] = s;
        k->b_ntok[s] = 1;
        k->spec_nd[s] = DSV4_SPEC_MAX_DRAFT;   /* 1, as in decode_work_spec */
        k->spec_draft[s] = (int32_t)(((int64_t)s * 31 + 7) % k->V);
    }
    if (k->mtp) {
        struct dsv4_spec_batch sb = { .n_seqs = n, .slot = k->b_slot, .last = k->b_tok,
                                      .n_draft = k->spec_nd, .draft = k->spec_draft };

        e = dsv4_model_spec_verify(k->m, &sb, k->sp, k->out_tok, k->out_lp, &k->out_top,
                                   k->spec_n, NULL);
        if (e == DSV4_OK)
            e = dsv4_model_spec_draft(k->m, k->spec_draft, NULL);
    } else {
        struct dsv4_batch b = { .n_seqs = n, .slot = k->b_slot, .n_tokens = k->b_ntok,
                                .tokens = k->b_tok };

        e = logits != NULL ? dsv4_model_forward(k->m, &b, logits, flags)
                           : dsv4_model_forward_sample(k->m, &b, k->sp, k->out_tok, k->out_lp,
                                                       &k->out_top);
    }
    if (e != DSV4_OK) {
        snprintf(why, sizeof(why), "%s", dsv4_errmsg());
        return dsv4_err_set(e, "decode_warmup: a step of %d streams%s: %s", n,
                            flags & DSV4_FWD_FULL_INDEXER ? " (indexer scores)" : "", why);
    }
    for (int s = 0; s < n; s++)
        if ((e = dsv4_model_seq_reset(k->m, s)) != DSV4_OK) {
            snprintf(why, sizeof(why), "%s", dsv4_errmsg());
            return dsv4_err_set(e, "decode_warmup: seq_reset slot=%d: %s", s, why);
        }
    return DSV4_OK;
}

enum dsv4_err
decode_warmup(struct rank *k)
{
    int64_t t0 = dsv4_now_us();
    int top = k->o.slots;
    enum dsv4_err e;
    float *logits;

    sdnotify_status("warming up: a step of %d streams", top);
    if (k->mtp) {
        e = warmup_call(k, top, 0, NULL);
    } else {
        /* contexts of more than index_topk compressed entries score them
         * (their own graph and working memory), then a sampled step */
        logits = calloc((size_t)top * (size_t)k->V, sizeof(float));
        if (logits == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "decode_warmup: no memory for the logits");
        e = warmup_call(k, top, DSV4_FWD_FULL_INDEXER, logits);
        free(logits);
        if (e == DSV4_OK)
            e = warmup_call(k, top, 0, NULL);
    }
    if (e == DSV4_OK) {
        log_notice("decode_warmup: a step of %d streams%s in %.1f ms", top,
                   k->mtp ? " (verify and draft)" : "", (double)(dsv4_now_us() - t0) / 1e3);
        decode_graphs_check(k);
    }
    return e;
}
