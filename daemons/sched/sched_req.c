/*
 * sched_req.c — dsv4-sched: the request table and each request's life cycle
 * (docs/protocol.md §5): output bookkeeping with stop conditions, finishing,
 * failing, cancelling, re-running after a rank death, and freeing.
 *
 * Requests are found from rank messages by `rid`, the id of the current
 * run: a re-run aborts the old run on every rank still holding it and
 * continues under a new id, so late messages about the old run are stale by
 * construction (sched.h).
 *
 * Runs in the scheduler's only thread.  Invariant: a request is freed only
 * when it is closing, its final client message has been sent (or its client
 * is gone) and no group holds state for it (pre.g == dec.g == NULL).  Every
 * release of rank-side state goes through req_hold_clear, which also returns
 * the group's load and the decode slot, so the books always balance.
 *
 * Output: every token accepted from a rank is appended to `out` and its text
 * (streaming UTF-8 decoder) to `text`.  Text that could still turn out to be
 * the start of a stop string is held back (text_safe); a stop string cuts the
 * text where it starts (text_cut) and finishes the request with "stop".
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "daemons/sched/sched.h"

#define NO_CUT ((size_t)-1)

static unsigned
hash_req(uint64_t req)
{
    return (unsigned)((req * 0x9E3779B97F4A7C15ull) >> 52) & (SCHED_REQ_BUCKETS - 1);
}

/* A new request id (never 0). */
static uint64_t
req_next_id(struct sched *s)
{
    uint64_t id = s->next_req++;

    if (s->next_req == 0)
        s->next_req = 1;
    return id;
}

/* Put `r` on the hash chain of its rid. */
static void
req_hash(struct sched *s, struct sched_req *r)
{
    unsigned h = hash_req(r->rid);

    r->hnext = s->hash[h];
    s->hash[h] = r;
}

/* Take `r` out of the hash chain of its rid. */
static void
req_unhash(struct sched *s, struct sched_req *r)
{
    struct sched_req **pp;

    for (pp = &s->hash[hash_req(r->rid)]; *pp != NULL; pp = &(*pp)->hnext) {
        if (*pp == r) {
            *pp = r->hnext;
            break;
        }
    }
}

struct sched_req *
req_new(struct sched *s)
{
    struct sched_req *r;

    if ((r = calloc(1, sizeof(*r))) == NULL)
        return NULL;
    r->req = req_next_id(s);
    r->rid = r->req;
    r->text_cut = NO_CUT;
    r->handoff_us = -1;
    r->state = DSV4_REQ_QUEUED;
    dsv4_msg_init(&r->kv, DSV4_SUB_RANK, DSV4_RANK_DECODE);
    req_hash(s, r);
    if (s->tok != NULL)
        dsv4_tok_stream_init(&r->ts, s->tok);
    return r;
}

struct sched_req *
req_find(struct sched *s, uint64_t req)
{
    struct sched_req *r;

    for (r = s->hash[hash_req(req)]; r != NULL; r = r->hnext) {
        if (r->rid == req)
            return r;
    }
    return NULL;
}

static bool
route_eq(const struct dsv4_route *a, const struct dsv4_route *b)
{
    return a->len == b->len && memcmp(a->id, b->id, a->len) == 0;
}

struct sched_req *
req_find_client(struct sched *s, const struct dsv4_route *route, uint64_t id)
{
    struct sched_req *r;

    TAILQ_FOREACH(r, &s->queue, qentry) {
        if (r->id == id && route_eq(&r->client, route))
            return r;
    }
    TAILQ_FOREACH(r, &s->live, qentry) {
        if (r->id == id && !r->final_sent && route_eq(&r->client, route))
            return r;
    }
    return NULL;
}

void
req_unqueue(struct sched *s, struct sched_req *r)
{
    if (!r->queued)
        return;
    queue_remove(s, r);
    TAILQ_INSERT_TAIL(&s->live, r, qentry);
    s->n_live++;
}

void
req_kv_clear(struct sched_req *r)
{
    for (int i = 0; i < DSV4_PROTO_MAX_KV_PARTS; i++) {
        free(r->kv_handles[i]);
        free(r->kv_arrays[i]);
        r->kv_handles[i] = NULL;
        r->kv_arrays[i] = NULL;
    }
    r->kv_parts = 0;
}

static void
req_destroy(struct sched *s, struct sched_req *r)
{
    req_unhash(s, r);
    req_kv_clear(r);
    free(r->tag);
    free(r->prompt);
    free(r->stop_ids);
    for (uint32_t i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->out);
    free(r->out_lp);
    free(r->out_text_end);
    free(r->out_top_ids);
    free(r->out_top_lp);
    free(r->out_top_n);
    free(r->err_msg);
    dsv4_tok_text_free(&r->text);
    free(r);
}

void
req_hold_clear(struct sched *s, struct sched_req *r, struct sched_hold *h)
{
    if (h->g == NULL)
        return;
    if (h->g->load > 0)
        h->g->load--;
    if (h == &r->dec) {
        queue_slot_put(h->g, r->slot);
        r->dec_early = 0;
    }
    h->g = NULL;
    h->acks = 0;
    /* A closing request's exported KV outlives the decode group's import. */
    if (h == &r->dec && r->closing && r->pre.g != NULL && r->pre.acks == 0) {
        rank_send_ref(s, r->pre.g, DSV4_RANK_KV_RELEASE, r->rid);
        req_hold_clear(s, r, &r->pre);
    }
}

void
req_maybe_free(struct sched *s, struct sched_req *r)
{
    if (!r->closing || !r->final_sent || r->pre.g != NULL || r->dec.g != NULL)
        return;
    if (r->queued)
        queue_remove(s, r);
    else {
        TAILQ_REMOVE(&s->live, r, qentry);
        s->n_live--;
    }
    log_debug("req_free: req=%llu", (unsigned long long)r->req);
    req_destroy(s, r);
}

/* --- Output and stop conditions ----------------------------------------------- */

long
req_stop_find(char *const *stop, uint32_t n_stop, const char *text, size_t len, size_t from)
{
    long best = -1;

    for (uint32_t i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        const char *p;

        if (sl == 0 || from >= len || len - from < sl)
            continue;
        p = memmem(text + from, len - from, stop[i], sl);
        if (p != NULL && (best < 0 || p - text < best))
            best = p - text;
    }
    return best;
}

size_t
req_stop_holdback(char *const *stop, uint32_t n_stop, const char *text, size_t len)
{
    size_t best = 0;

    for (uint32_t i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);

        /* Longest k < sl with text ending in stop[i][0..k). */
        for (size_t k = sl > len + 1 ? len : sl - 1; k > best; k--) {
            if (memcmp(text + len - k, stop[i], k) == 0) {
                best = k;
                break;
            }
        }
    }
    return best;
}

/* realloc *p to n elements of `size` bytes; false (p as it was) when out of memory. */
static bool
grow(void *p, size_t n, size_t size)
{
    void *q = realloc(*(void **)p, n * size);

    if (q == NULL)
        return false;
    *(void **)p = q;
    return true;
}

static bool
grow_out(struct sched_req *r)
{
    uint32_t cap = r->cap_out ? r->cap_out * 2 : 64;

    if (!grow(&r->out, cap, sizeof(*r->out)) || !grow(&r->out_lp, cap, sizeof(*r->out_lp)) ||
        !grow(&r->out_text_end, cap, sizeof(*r->out_text_end)))
        return false;
    r->cap_out = cap;
    return true;
}

/* Room for one more token's most likely tokens: the sent tokens' dropped
 * first, then the arrays doubled when still full; false when out of memory. */
static bool
grow_top(struct sched_req *r)
{
    size_t N = r->s.top_logprobs;
    uint32_t drop = r->n_sent > r->top_base ? r->n_sent - r->top_base : 0, keep, cap;

    if (drop > 0) {
        keep = r->n_out - r->n_sent;
        memmove(r->out_top_ids, r->out_top_ids + drop * N, keep * N * sizeof(*r->out_top_ids));
        memmove(r->out_top_lp, r->out_top_lp + drop * N, keep * N * sizeof(*r->out_top_lp));
        memmove(r->out_top_n, r->out_top_n + drop, keep * sizeof(*r->out_top_n));
        r->top_base = r->n_sent;
    }
    if (r->n_out - r->top_base < r->top_cap)
        return true;
    cap = r->top_cap ? r->top_cap * 2 : 64;
    if (!grow(&r->out_top_ids, cap * N, sizeof(*r->out_top_ids)) ||
        !grow(&r->out_top_lp, cap * N, sizeof(*r->out_top_lp)) ||
        !grow(&r->out_top_n, cap, sizeof(*r->out_top_n)))
        return false;
    r->top_cap = cap;
    return true;
}

/* The first stop string in r's text that ends in [old, end) (end: where
 * the words end, before an added token's text), searched after the last
 * added token's text; -1 when none. */
static long
stop_search(const struct sched_req *r, size_t old, size_t end)
{
    size_t back = r->stop_maxlen - 1, from = old > back ? old - back : 0;

    if (r->n_stop == 0 || end <= old)
        return -1;
    return req_stop_find(r->stop, r->n_stop, r->text.s, end,
        from > r->text_barrier ? from : r->text_barrier);
}

/* A resume whose text ran ahead of its tokens (resume): once the text
 * reaches the client's count, that must be a character's start; else the
 * request fails with 401 (every later piece would start mid-character).
 * True when it failed. */
static bool
resume_check_fails(struct sched *s, struct sched_req *r)
{
    if (!r->resume_ahead || r->text.len <= r->text_sent)
        return false;
    r->resume_ahead = false;
    if (((unsigned char)r->text.s[r->text_sent] & 0xC0) != 0x80)
        return false;
    r->text_sent = r->text_safe;
    if (r->closing) {   /* (the close's flush got there: its DONE becomes this) */
        r->err_code = DSV4_STATUS_BAD_ARGUMENT;
        free(r->err_msg);
        r->err_msg = strdup("resume_text ends inside a character of the output's text");
        /* counted where it ends: failed, not done or cancelled */
        if (r->state == DSV4_REQ_CANCELLED)
            s->m.n_cancelled--;
        else
            s->m.n_done--;
        s->m.n_failed++;
        r->state = DSV4_REQ_FAILED;
        return true;
    }
    req_fail(s, r, DSV4_STATUS_BAD_ARGUMENT, "resume_text ends inside a character of the "
        "output's text");
    return true;
}

bool
req_emit(struct sched *s, struct sched_req *r, const struct sched_tok *t)
{
    size_t old = r->text.len, words_end;
    bool stop_id = false, added;
    long at;
    int32_t token = t->id;

    if (r->closing)
        return true;
    if ((r->n_out == r->cap_out && !grow_out(r)) ||
        (r->s.top_logprobs > 0 && !grow_top(r))) {
        req_fail(s, r, DSV4_STATUS_NO_MEMORY, "out of memory for output");
        return true;
    }
    r->out[r->n_out] = token;
    r->out_lp[r->n_out] = t->has_lp ? t->lp : 0.0f;
    if (r->s.top_logprobs > 0) {
        size_t N = r->s.top_logprobs, k = t->top_ids == NULL ? 0 : t->n_top < N ? t->n_top : N;
        size_t row = r->n_out - r->top_base;

        if (k > 0) {
            memcpy(r->out_top_ids + row * N, t->top_ids, k * sizeof(int32_t));
            memcpy(r->out_top_lp + row * N, t->top_lp, k * sizeof(float));
        }
        r->out_top_n[row] = (uint8_t)k;
    }
    r->n_out++;
    s->m.tokens_out++;
    /* An added token's text (<｜end▁of▁sentence｜>, </think>, ...) is a marker,
     * not words: no stop string is matched in it or across it, so none cuts
     * one into pieces (the text after it is searched from its end).  What
     * its push would first flush of an unfinished character (a U+FFFD) is
     * the text before it, flushed first so that it is searched. */
    added = s->tok != NULL && dsv4_tok_is_added(s->tok, token);
    if (added)
        (void)dsv4_tok_stream_flush(&r->ts, &r->text);
    words_end = r->text.len;
    if (s->tok != NULL && dsv4_tok_stream_push(&r->ts, token, &r->text) != DSV4_OK)
        log_debug("req_emit: req=%llu token %d has no text", (unsigned long long)r->req, token);
    if (!added)
        words_end = r->text.len;
    /* The wire's str holds no NUL byte: the output's text is without them,
     * so that stop strings and offsets see what the client gets. */
    if (r->text.len > old && memchr(r->text.s + old, '\0', r->text.len - old) != NULL) {
        size_t k = old;

        for (size_t i = old; i < r->text.len; i++)
            if (r->text.s[i] != '\0')
                r->text.s[k++] = r->text.s[i];
        r->text.len = k;
        if (!added)
            words_end = k;   /* (a marker's and a U+FFFD's text hold no NUL) */
    }
    r->out_text_end[r->n_out - 1] = r->text.len;
    if (resume_check_fails(s, r))
        return true;
    for (uint32_t i = 0; i < r->n_stop_ids; i++)
        stop_id |= r->stop_ids[i] == token;
    at = stop_search(r, old, words_end);
    if (added)
        r->text_barrier = r->text.len;
    if (at >= 0) {
        r->text_cut = (size_t)at;
        r->text_safe = (size_t)at;
        req_finish(s, r, DSV4_FINISH_STOP);
        return true;
    }
    {
        /* The hold-back never reaches before the last text_safe (a longer
         * suffix that is a stop string's prefix would have made a longer
         * one before), so only the text from there is tried: the cost per
         * token is the new bytes', not n_stop x the longest stop's. */
        size_t from = r->text_safe > r->text_barrier ? r->text_safe : r->text_barrier;

        r->text_safe = r->text.len - req_stop_holdback(r->stop, r->n_stop, r->text.s + from,
            r->text.len - from);
    }
    if (stop_id || r->n_out >= r->max_tokens) {
        /* The decode rank sees the same condition and ends the stream itself. */
        r->dec_self_end = true;
        req_finish(s, r, stop_id ? DSV4_FINISH_STOP : DSV4_FINISH_LENGTH);
        return true;
    }
    return false;
}

/* --- Ending ------------------------------------------------------------------- */

/* Tell the groups holding `r` to free it; `prev` is the state it was in. */
static void
release_holds(struct sched *s, struct sched_req *r, enum dsv4_req_state prev)
{
    if (r->pre.g != NULL) {
        if (prev == DSV4_REQ_PREFILLING) {
            rank_send_ref(s, r->pre.g, DSV4_RANK_ABORT, r->rid);
            r->pre.acks = r->pre.g->n_ranks;
            if (r->pre.acks == 0)
                req_hold_clear(s, r, &r->pre);
        } else if (!(prev == DSV4_REQ_HANDOFF && r->dec_started && r->dec.g != NULL)) {
            /* Its KV is exported: KV_RELEASE frees it, no answer.  (While a
             * decode group may still be importing it, the release waits for
             * that group to let go: req_hold_clear.) */
            rank_send_ref(s, r->pre.g, DSV4_RANK_KV_RELEASE, r->rid);
            req_hold_clear(s, r, &r->pre);
        }
    }
    if (r->dec.g != NULL) {
        if (!r->dec_started) {
            req_hold_clear(s, r, &r->dec);
        } else {
            if (!r->dec_self_end)
                rank_send_ref(s, r->dec.g, DSV4_RANK_ABORT, r->rid);
            /* ranks that already reported the end (on_freed) count as done */
            r->dec.acks = r->dec.g->n_ranks > r->dec_early ? r->dec.g->n_ranks - r->dec_early
                                                           : 0;
            r->dec_early = 0;
            if (r->dec.acks == 0)
                req_hold_clear(s, r, &r->dec);
        }
    }
}

static void
close_common(struct sched *s, struct sched_req *r, enum dsv4_req_state st)
{
    enum dsv4_req_state prev = r->state;

    r->closing = true;
    r->state = st;
    req_unqueue(s, r);
    if (s->tok != NULL && r->text_cut == NO_CUT) {
        size_t old = r->text.len;
        long at;

        /* the flush's U+FFFD is text like any: searched for a stop string
         * (the request then ends there, finish stop) and reaching a
         * resume's count */
        (void)dsv4_tok_stream_flush(&r->ts, &r->text);
        if (r->err_code == 0 && (at = stop_search(r, old, r->text.len)) >= 0) {
            r->text_cut = (size_t)at;
            if (r->finish == DSV4_FINISH_LENGTH)
                r->finish = DSV4_FINISH_STOP;
        }
        if (r->err_code == 0)
            (void)resume_check_fails(s, r);
    }
    r->text_safe = r->text_cut != NO_CUT ? r->text_cut : r->text.len;
    release_holds(s, r, prev);
    if (r->client_gone)
        r->final_sent = true;
}

void
req_finish(struct sched *s, struct sched_req *r, enum dsv4_finish f)
{
    if (r->closing)
        return;
    r->finish = f;
    if (f == DSV4_FINISH_CANCELLED)
        s->m.n_cancelled++;
    else
        s->m.n_done++;
    log_debug("req_finish: req=%llu finish=%s tokens=%u", (unsigned long long)r->req,
        dsv4_finish_name(f), r->n_out);
    close_common(s, r, f == DSV4_FINISH_CANCELLED ? DSV4_REQ_CANCELLED : DSV4_REQ_DONE);
}

/* Drop an incomplete UTF-8 sequence at the end of s (left by a cut). */
static void
utf8_trim(char *s)
{
    size_t n = strlen(s), i = n, need;
    unsigned char c;

    while (i > 0 && ((unsigned char)s[i - 1] & 0xC0) == 0x80 && n - i < 3)
        i--;
    if (i == 0)
        return;
    c = (unsigned char)s[i - 1];
    need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (i - 1 + need > n)
        s[i - 1] = '\0';
}

void
req_fail(struct sched *s, struct sched_req *r, uint16_t code, const char *fmt, ...)
{
    char buf[DSV4_PROTO_MAX_MESSAGE / 2];
    va_list ap;

    if (r->closing)
        return;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    utf8_trim(buf);     /* a cut message stays UTF-8: the ERROR encodes */
    r->err_code = code;
    r->err_msg = strdup(buf);
    s->m.n_failed++;
    log_info("req_fail: req=%llu code=%u %s", (unsigned long long)r->req, code, buf);
    close_common(s, r, DSV4_REQ_FAILED);
}

void
req_cancel(struct sched *s, struct sched_req *r)
{
    req_finish(s, r, DSV4_FINISH_CANCELLED);
}

/*
 * Put `r` back at the head of the queue to run again from prompt + output,
 * under a new rid.  Every rank of the groups holding it still (in a group,
 * the ranks other than the one that died or failed) gets ABORT of the old
 * rid: a rank of a group left holding a stream would keep it among its
 * runnable requests, and the group's ranks, which agree on the leading run
 * of their sorted runnable lists (daemons/rank/rank_group.c), would never
 * agree on any request again.  After SCHED_MAX_RERUNS the request fails
 * instead, with status `code` ("gave up after N re-runs (<why>)").
 */
static void
req_rerun(struct sched *s, struct sched_req *r, uint16_t code, const char *why)
{
    uint64_t old = r->rid;

    if (r->pre.g != NULL) {
        /* Whatever it is prefilling or has exported is of no use now.  ABORT
         * (not KV_RELEASE) also stops a prefill still running, so the PREFILL
         * of the re-run, which follows on the same link, finds the rank free
         * of this request; its late ABORT_DONE is ignored (on_freed). */
        rank_send_ref(s, r->pre.g, DSV4_RANK_ABORT, r->rid);
        req_hold_clear(s, r, &r->pre);
    }
    if (r->dec.g != NULL) {
        if (r->dec_started)
            rank_send_ref(s, r->dec.g, DSV4_RANK_ABORT, r->rid);
        req_hold_clear(s, r, &r->dec);
    }
    if (++r->reruns > SCHED_MAX_RERUNS) {
        req_fail(s, r, code, "gave up after %u re-runs (%s)", SCHED_MAX_RERUNS, why);
        return;
    }
    s->m.reruns++;
    req_unhash(s, r);
    r->rid = req_next_id(s);
    req_hash(s, r);
    log_notice("req_rerun: req=%llu from token %u as run %llu (was %llu) (%s)",
        (unsigned long long)r->req, r->n_out, (unsigned long long)r->rid,
        (unsigned long long)old, why);
    req_kv_clear(r);
    r->dec_started = false;
    r->dec_self_end = false;
    r->handoff_us = -1;     /* (a refused import's handoff is none) */
    TAILQ_REMOVE(&s->live, r, qentry);
    s->n_live--;
    queue_push(s, r, true);
}

void
req_rank_lost(struct sched *s, struct sched_req *r, struct sched_group *g)
{
    if (r->closing) {
        /* an export that the decode group may still be importing stays
         * held: when that group lets go, req_hold_clear tells the prefill
         * group's surviving ranks to free their parts (as below) */
        if (r->pre.g == g && !(r->pre.acks == 0 && r->dec.g != NULL))
            req_hold_clear(s, r, &r->pre);
        if (r->dec.g == g)
            req_hold_clear(s, r, &r->dec);
        req_maybe_free(s, r);
        return;
    }
    if (r->pre.g == g) {
        if (r->state == DSV4_REQ_PREFILLING) {
            /* the group's other ranks (if any) get ABORT */
            req_rerun(s, r, DSV4_STATUS_INTERNAL, "prefill rank lost");
            return;
        }
        /* HANDOFF: the decode group may still import the exported state; if
         * it cannot, its ERROR re-runs the request.  The hold stays: once
         * the decode group lets go (KV_RELEASE, or the re-run), the
         * group's surviving ranks are told to free their parts (the dead
         * rank is skipped), instead of keeping them until kv_timeout_ms. */
    }
    if (r->dec.g == g)
        req_rerun(s, r, DSV4_STATUS_INTERNAL, "decode rank lost");   /* ABORT to the others */
}

/* Rank-side error about `r` from group `g`: the rank dropped it. */
void
req_rank_error(struct sched *s, struct sched_req *r, struct sched_group *g, uint16_t code,
    const char *msg)
{
    if (r->closing) {
        struct sched_hold *h = r->pre.g == g ? &r->pre : r->dec.g == g ? &r->dec : NULL;

        if (h != NULL && h->acks > 0 && --h->acks == 0)
            req_hold_clear(s, r, h);
        req_maybe_free(s, r);
        return;
    }
    if (r->pre.g == g && r->state == DSV4_REQ_PREFILLING) {
        if (code == DSV4_STATUS_NO_MEMORY) {
            /* a slot's host memory, or device memory for its forward call
             * (daemons/rank/rank_prefill.c): another try, on another prefill
             * group where one is usable (queue_dispatch) */
            r->avoid_pre = g->id + 1;
            req_rerun(s, r, code, "prefill rank out of memory");
        } else if (code == DSV4_STATUS_BUSY) {
            req_rerun(s, r, DSV4_STATUS_INTERNAL, "prefill rank busy");   /* ABORT to the others */
        } else {
            /* the hold stays: req_fail's ABORT goes to every rank of the
             * group, since the others may have exported their part already
             * (or be prefilling still) and must free it */
            req_fail(s, r, code, "prefill: %s", msg);
        }
        return;
    }
    /* the rank that answered dropped the stream, the group's others may
     * hold it: req_rerun aborts it on every rank of the group; NO_MEMORY:
     * a step out of device memory (daemons/rank/rank_decode.c) */
    if (r->dec.g == g) {
        if (code == DSV4_STATUS_NO_MEMORY)
            req_rerun(s, r, code, "decode rank out of memory");
        else
            req_rerun(s, r, DSV4_STATUS_INTERNAL, "decode rank error");
    }
}

int64_t
req_timers(struct sched *s, int64_t now)
{
    struct sched_req *r, *tmp;
    int64_t next = -1;
    struct sched_req_list *lists[2] = { &s->queue, &s->live };

    for (int i = 0; i < 2; i++) {
        TAILQ_FOREACH_SAFE(r, lists[i], qentry, tmp) {
            if (r->closing || r->deadline_ms == 0)
                continue;
            if (now >= r->deadline_ms) {
                req_fail(s, r, DSV4_STATUS_TIMEOUT, "timeout passed");
                continue;
            }
            if (next < 0 || r->deadline_ms - now < next)
                next = r->deadline_ms - now;
        }
    }
    return next;
}

void
req_free_all(struct sched *s)
{
    struct sched_req *r;

    while ((r = TAILQ_FIRST(&s->queue)) != NULL) {
        queue_remove(s, r);
        req_destroy(s, r);
    }
    while ((r = TAILQ_FIRST(&s->live)) != NULL) {
        TAILQ_REMOVE(&s->live, r, qentry);
        s->n_live--;
        req_destroy(s, r);
    }
}
