/*
 * sched_client.c — dsv4-sched: the client sub-protocol (docs/protocol.md §4)
 * on the client ROUTER: GENERATE validation and tokenization, CANCEL,
 * HEARTBEAT, and the output path (OK, TOKENS, DONE/ERROR).
 *
 * Runs in the scheduler's only thread.  Nothing is sent to a client directly
 * from a handler: handlers change the request and client_flush() sends what
 * is due, in protocol order, with ZMQ_DONTWAIT.  When the client's pipe is
 * full the output stays with the request (merged into one TOKENS later) and
 * the loop retries shortly; past DSV4_PROTO_MAX_PENDING tokens the request
 * fails with 429.  A client that has gone away (EHOSTUNREACH under
 * ZMQ_ROUTER_MANDATORY) has its request cancelled on the ranks.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "common/log.h"
#include "daemons/sched/sched.h"

#define CLIENT_BATCH 256  /* messages handled per poll wake-up */
#define CLIENT_TURN_MS 50  /* ... and ms spent on them at most (the 4 MiB
                              prompt texts are tokenized here) */

static bool
route_eq(const struct dsv4_route *a, const struct dsv4_route *b)
{
    return a->len == b->len && memcmp(a->id, b->id, a->len) == 0;
}

/* Send one ERROR; DSV4_ERR_BUSY when the client's pipe is full. */
static enum dsv4_err
error_send(struct sched *s, const struct dsv4_route *to, uint64_t id, uint16_t code,
    const char *text, const char *tag)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_ERROR);
    m.u.error.id = id;
    m.u.error.code = code;
    m.u.error.message = text;
    m.u.error.tag = tag;
    return dsv4_zsock_send(s->client, to, &m, ZMQ_DONTWAIT, NULL);
}

static bool
refusal_waits(struct sched *s, const struct dsv4_route *to)
{
    struct sched_refusal *f;

    TAILQ_FOREACH(f, &s->refusals, entry)
        if (route_eq(&f->to, to))
            return true;
    return false;
}

static void
refusal_free(struct sched *s, struct sched_refusal *f)
{
    TAILQ_REMOVE(&s->refusals, f, entry);
    s->n_refusals--;
    free(f->text);
    free(f->tag);
    free(f);
}

/* Refuse a message or request: ERROR with the client's id; kept for
 * client_flush_all when the client's pipe is full (after any refusal of
 * the same client still waiting: in order). */
static void
send_error(struct sched *s, const struct dsv4_route *to, uint64_t id, uint16_t code,
    const char *text, const char *tag)
{
    struct sched_refusal *f;
    enum dsv4_err e = DSV4_ERR_BUSY;

    if (!refusal_waits(s, to))
        e = error_send(s, to, id, code, text, tag);
    if (e != DSV4_ERR_BUSY) {
        if (e != DSV4_OK)   /* the client is gone: nobody to tell */
            log_debug("client: error reply not sent: %s", dsv4_errmsg());
        return;
    }
    if (s->n_refusals >= SCHED_MAX_REFUSALS || (f = calloc(1, sizeof(*f))) == NULL ||
        (f->text = strdup(text != NULL ? text : "")) == NULL ||
        (tag != NULL && (f->tag = strdup(tag)) == NULL)) {
        if (s->n_refusals < SCHED_MAX_REFUSALS) {
            free(f != NULL ? f->text : NULL);
            free(f);
        }
        log_warnx("client: refusal of id %llu (%u) dropped: %u waiting",
            (unsigned long long)id, code, s->n_refusals);
        return;
    }
    f->to = *to;
    f->id = id;
    f->code = code;
    TAILQ_INSERT_TAIL(&s->refusals, f, entry);
    s->n_refusals++;
    s->n_dirty = 1;
}

/* Send the refusals waiting, in order per client; true when none is left.
 * A client whose send blocks holds its later refusals back: marked in one
 * pass over the rest at its first block, so the flush costs the list's
 * length times the clients blocked, not its square. */
static bool
refusals_flush(struct sched *s)
{
    struct sched_refusal *f, *tmp, *g;

    TAILQ_FOREACH(f, &s->refusals, entry)
        f->held = false;
    TAILQ_FOREACH_SAFE(f, &s->refusals, entry, tmp) {
        if (f->held)
            continue;
        if (error_send(s, &f->to, f->id, f->code, f->text, f->tag) == DSV4_ERR_BUSY) {
            for (g = TAILQ_NEXT(f, entry); g != NULL; g = TAILQ_NEXT(g, entry))
                if (route_eq(&g->to, &f->to))
                    g->held = true;
            continue;
        }
        refusal_free(s, f);   /* sent, or the client is gone */
    }
    return TAILQ_EMPTY(&s->refusals);
}

void
client_free_refusals(struct sched *s)
{
    while (!TAILQ_EMPTY(&s->refusals))
        refusal_free(s, TAILQ_FIRST(&s->refusals));
}

static uint64_t
splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Copy the stop conditions of `g` into `r`, adding EOS to the stop ids. */
static bool
copy_stops(struct sched *s, struct sched_req *r, const struct dsv4_cli_generate *g)
{
    bool have_eos = false;

    r->stop_ids = malloc(((size_t)g->n_stop_ids + 1) * sizeof(int32_t));
    if (r->stop_ids == NULL)
        return false;
    for (uint32_t i = 0; i < g->n_stop_ids; i++) {
        r->stop_ids[r->n_stop_ids++] = g->stop_ids[i];
        have_eos |= g->stop_ids[i] == s->eos;
    }
    if (s->eos >= 0 && !have_eos)
        r->stop_ids[r->n_stop_ids++] = s->eos;
    if (g->n_stop > 0) {
        if ((r->stop = calloc(g->n_stop, sizeof(char *))) == NULL)
            return false;
        for (uint32_t i = 0; i < g->n_stop; i++) {
            if ((r->stop[i] = strdup(g->stop[i])) == NULL)
                return false;
            r->n_stop++;
            if (strlen(g->stop[i]) > r->stop_maxlen)
                r->stop_maxlen = strlen(g->stop[i]);
        }
    }
    return true;
}

/*
 * GENERATE with `resume` (docs/protocol.md §4.6): the client has the first
 * n_resume output tokens and resume_text bytes of text of this request from
 * a scheduler that went away.  They are taken as emitted and sent (the stop
 * conditions and the stop-string hold-back run over them as they did
 * there), so the queued request prefills prompt + them, as a re-run does,
 * and samples on from position n_resume with the same seed: the same tokens
 * follow, and only those go to the client.  A resume that already meets a
 * stop condition ends at once (its DONE was what got lost).
 */
static void
resume(struct sched *s, struct sched_req *r, const struct dsv4_cli_generate *g)
{
    uint64_t got = g->has_resume_text ? g->resume_text : 0;
    size_t text;

    for (uint32_t i = 0; i < g->n_resume && !r->closing; i++) {
        struct sched_tok t = { .id = g->resume[i] };

        (void)req_emit(s, r, &t);
    }
    s->m.tokens_out -= r->n_out;    /* counted by the scheduler that made them */
    r->n_sent = r->n_out;
    text = (size_t)got;   /* (the text has no NUL byte: req_emit) */
    log_notice("client: req=%llu id=%llu resumes after %u tokens and %llu bytes of text",
        (unsigned long long)r->req, (unsigned long long)r->id, r->n_out,
        (unsigned long long)got);
    /* The text sent can run ahead of the tokens sent by part of the token
     * held back with it (client_flush), never by more than a token's text. */
    if (text > r->text_safe + SCHED_RESUME_TEXT_AHEAD) {
        r->text_sent = r->text_safe;
        req_fail(s, r, DSV4_STATUS_BAD_ARGUMENT, "resume_text (%llu bytes) is past the text "
            "of the resumed tokens (%zu bytes)", (unsigned long long)got, r->text_safe);
        return;
    }
    /* A client only ever got whole characters: a count inside one would
     * make every later piece start mid-character (not UTF-8).  A count past
     * the text is checked when the text gets there (req_emit). */
    if (text < r->text.len && ((unsigned char)r->text.s[text] & 0xC0) == 0x80) {
        r->text_sent = r->text_safe;
        req_fail(s, r, DSV4_STATUS_BAD_ARGUMENT, "resume_text (%llu bytes) ends inside a "
            "character of the resumed tokens' text", (unsigned long long)got);
        return;
    }
    r->text_sent = text;
    r->resume_ahead = text > r->text.len;
}

/* Validate, tokenize and queue one GENERATE; refusals answer ERROR at once. */
static void
on_generate(struct sched *s, const struct dsv4_route *from, const struct dsv4_cli_generate *g)
{
    struct dsv4_tok_ids ids = { 0 };
    const int32_t *tokens = g->tokens;
    uint32_t n = g->n_tokens, timeout;
    struct sched_req *r;
    uint16_t st;
    char msg[160];

    /* a restart (the ranks serve on): the next scheduler takes it, as it
     * takes what this one has not finished (libdsv4client sends it again) */
    if (s->stopping && !rank_set_stopped(s)) {
        s->m.n_rejected++;
        send_error(s, from, g->id, DSV4_STATUS_RESTARTING, SCHED_RESTARTING_MSG, g->tag);
        return;
    }
    st = queue_admit_status(s->n_queued, (uint32_t)s->cfg.file.queue_max,
        s->draining || s->stopping);
    if (st != DSV4_STATUS_OK) {
        s->m.n_rejected++;
        send_error(s, from, g->id, st, st == DSV4_STATUS_BUSY ?
            "overloaded: admission queue full, retry later" :
            "draining: the scheduler admits no new requests", g->tag);
        return;
    }
    if ((g->prompt == NULL) == (g->tokens == NULL)) {
        s->m.n_rejected++;
        send_error(s, from, g->id, DSV4_STATUS_BAD_ARGUMENT,
            "exactly one of prompt and tokens must be given", g->tag);
        return;
    }
    if (req_find_client(s, from, g->id) != NULL) {
        s->m.n_rejected++;
        send_error(s, from, g->id, DSV4_STATUS_BAD_ARGUMENT,
            "id is already in use by a request in flight", g->tag);
        return;
    }
    if (g->prompt != NULL) {
        if (s->tok == NULL) {
            s->m.n_rejected++;
            send_error(s, from, g->id, DSV4_STATUS_NOT_SUPPORTED,
                "no tokenizer configured: send token ids", g->tag);
            return;
        }
        if (dsv4_tok_encode(s->tok, g->prompt, strlen(g->prompt), DSV4_TOK_SPECIAL,
                &ids) != DSV4_OK) {
            s->m.n_rejected++;
            snprintf(msg, sizeof(msg), "tokenizer: %s", dsv4_errmsg());
            send_error(s, from, g->id, DSV4_STATUS_INTERNAL, msg, g->tag);
            dsv4_tok_ids_free(&ids);
            return;
        }
        tokens = ids.v;
        n = (uint32_t)ids.len;
        if (n == 0 || n > DSV4_PROTO_MAX_PROMPT_TOKENS) {
            s->m.n_rejected++;
            send_error(s, from, g->id, n == 0 ? DSV4_STATUS_BAD_ARGUMENT :
                DSV4_STATUS_TOO_LARGE, "prompt has no tokens or too many", g->tag);
            dsv4_tok_ids_free(&ids);
            return;
        }
    }
    if (g->resume != NULL && (!g->s.has_seed || g->n_resume > g->max_tokens)) {
        s->m.n_rejected++;
        send_error(s, from, g->id, DSV4_STATUS_BAD_ARGUMENT, !g->s.has_seed ?
            "resume needs the seed of the request (OK's seed)" :
            "resume holds more tokens than max_tokens", g->tag);
        dsv4_tok_ids_free(&ids);
        return;
    }
    for (uint32_t i = 0; s->vocab > 0 && g->resume != NULL && i < g->n_resume; i++) {
        if (g->resume[i] >= s->vocab) {
            s->m.n_rejected++;
            snprintf(msg, sizeof(msg), "resume[%u] = %d is outside the vocabulary (%d ids)",
                i, g->resume[i], s->vocab);
            send_error(s, from, g->id, DSV4_STATUS_BAD_ARGUMENT, msg, g->tag);
            dsv4_tok_ids_free(&ids);
            return;
        }
    }
    for (uint32_t i = 0; s->vocab > 0 && i < n; i++) {
        if (tokens[i] >= s->vocab) {
            s->m.n_rejected++;
            snprintf(msg, sizeof(msg), "tokens[%u] = %d is outside the vocabulary (%d ids)",
                i, tokens[i], s->vocab);
            send_error(s, from, g->id, DSV4_STATUS_BAD_ARGUMENT, msg, g->tag);
            dsv4_tok_ids_free(&ids);
            return;
        }
    }
    /* (prefill too: a re-run after a decode rank's loss prefills the prompt
     * and the output so far, up to n + max_tokens - 1 tokens and the slot
     * of the next) */
    if ((uint64_t)n + g->max_tokens > DSV4_PROTO_MAX_CTX ||
        !queue_ctx_possible(&s->groups, DSV4_ROLE_DECODE, n + g->max_tokens) ||
        !queue_ctx_possible(&s->groups, DSV4_ROLE_PREFILL, n + g->max_tokens)) {
        s->m.n_rejected++;
        snprintf(msg, sizeof(msg), "prompt (%u tokens) plus max_tokens (%u) exceed the "
            "context this deployment serves", n, g->max_tokens);
        send_error(s, from, g->id, DSV4_STATUS_TOO_LARGE, msg, g->tag);
        dsv4_tok_ids_free(&ids);
        return;
    }

    if ((r = req_new(s)) == NULL)
        goto nomem;
    r->prompt = malloc((size_t)n * sizeof(int32_t));
    if (r->prompt == NULL || (g->tag != NULL && (r->tag = strdup(g->tag)) == NULL) ||
        !copy_stops(s, r, g)) {
        /* Not yet on any list: give it a final state and free it at once. */
        r->closing = r->final_sent = true;
        queue_push(s, r, false);
        req_maybe_free(s, r);
        goto nomem;
    }
    memcpy(r->prompt, tokens, (size_t)n * sizeof(int32_t));
    r->n_prompt = n;
    dsv4_tok_ids_free(&ids);
    r->id = g->id;
    r->client = *from;
    r->s = g->s;
    if (r->s.temperature < DSV4_PROTO_MIN_TEMPERATURE)
        r->s.temperature = 0.0f;
    if (!r->s.has_seed) {
        r->s.seed = splitmix64((uint64_t)dsv4_now_ms() ^ (r->req << 20));
        r->s.has_seed = true;
    }
    r->max_tokens = g->max_tokens;
    r->stream = g->stream;
    r->t_recv_ms = dsv4_now_ms();
    timeout = g->timeout_ms != 0 ? g->timeout_ms : (uint32_t)s->cfg.file.request_timeout_ms;
    r->deadline_ms = timeout != 0 ? r->t_recv_ms + timeout : 0;
    s->m.tokens_in += n;
    queue_push(s, r, false);
    log_debug("client: req=%llu id=%llu queued, %u prompt tokens", (unsigned long long)r->req,
        (unsigned long long)r->id, n);
    if (g->resume != NULL)
        resume(s, r, g);
    (void)client_flush(s, r); /* OK */
    return;
nomem:
    dsv4_tok_ids_free(&ids);
    s->m.n_rejected++;
    send_error(s, from, g->id, DSV4_STATUS_NO_MEMORY, "out of memory", g->tag);
}

static void
on_cancel(struct sched *s, const struct dsv4_route *from, uint64_t id)
{
    struct sched_req *r = req_find_client(s, from, id);

    if (r == NULL) {
        send_error(s, from, id, DSV4_STATUS_NOT_FOUND, "no request with this id", NULL);
        return;
    }
    /* A request already ending gets its DONE/ERROR; nothing to add. */
    if (!r->closing)
        req_cancel(s, r);
}

void
client_dispatch(struct sched *s)
{
    int64_t t0 = dsv4_now_ms();

    for (int i = 0; i < CLIENT_BATCH && dsv4_now_ms() - t0 < CLIENT_TURN_MS; i++) {
        struct dsv4_route from;
        struct dsv4_perr pe;
        struct dsv4_msg m;
        enum dsv4_err e;

        e = dsv4_zsock_recv(s->client, &from, &m, &pe, ZMQ_DONTWAIT);
        if (e == DSV4_ERR_BUSY)
            return;
        if (e == DSV4_ERR_PROTO || e == DSV4_ERR_INVAL) {
            log_info("client: refused message: %u %s", pe.code, pe.message);
            if (pe.sub == DSV4_SUB_CLI) {
                if (pe.cmd == DSV4_CLI_GENERATE)
                    s->m.n_rejected++;   /* invalid: outside the protocol's bounds */
                (void)dsv4_zsock_send_perr(s->client, &from, &pe);
            } else if (pe.sub != DSV4_SUB_NONE) {
                send_error(s, &from, 0, DSV4_STATUS_BAD_MESSAGE,
                    "not a client message", NULL);
            } else {
                /* no signature this scheduler knows (another version's
                 * client, or not a dsv4 peer): say which one it speaks */
                char text[sizeof(pe.message) + 64];

                snprintf(text, sizeof(text), "%s (this scheduler speaks %s)", pe.message,
                    DSV4_PROTO_SIG_CLI);
                send_error(s, &from, 0, DSV4_STATUS_BAD_MESSAGE, text, NULL);
            }
            continue;
        }
        if (e != DSV4_OK) {
            log_warnx("client: receive: %s", dsv4_errmsg());
            return;
        }
        if (m.sub != DSV4_SUB_CLI) {
            send_error(s, &from, 0, DSV4_STATUS_BAD_MESSAGE, "not a client message", NULL);
        } else if (m.cmd == DSV4_CLI_GENERATE) {
            on_generate(s, &from, &m.u.generate);
        } else if (m.cmd == DSV4_CLI_CANCEL) {
            on_cancel(s, &from, m.u.cancel.id);
        } else if (m.cmd == DSV4_CLI_HEARTBEAT) {
            struct dsv4_msg hb;

            dsv4_msg_init(&hb, DSV4_SUB_CLI, DSV4_CLI_HEARTBEAT);
            (void)dsv4_zsock_send(s->client, &from, &hb, ZMQ_DONTWAIT, NULL);
        } else {
            send_error(s, &from, 0, DSV4_STATUS_BAD_MESSAGE,
                "unexpected command from a client", NULL);
        }
        dsv4_msg_clear(&m);
    }
}

/* --- Output ---------------------------------------------------------------------- */

/* Send one message to r's client.  1 sent, 0 would block, -1 client gone,
 * -2 the message could not be encoded (a bug: the client is still there). */
static int
send_to(struct sched *s, struct sched_req *r, const struct dsv4_msg *m)
{
    enum dsv4_err e = dsv4_zsock_send(s->client, &r->client, m, ZMQ_DONTWAIT, NULL);

    if (e == DSV4_OK)
        return 1;
    if (e == DSV4_ERR_BUSY)
        return 0;
    if (e == DSV4_ERR_SYS && errno == EHOSTUNREACH) {
        log_info("client: req=%llu client gone", (unsigned long long)r->req);
        return -1;
    }
    log_warnx("client: req=%llu send: %s", (unsigned long long)r->req, dsv4_errmsg());
    return e == DSV4_ERR_SYS ? -1 : -2;
}

/* A reply of r could not be encoded: end r with a plain ERROR 500 (ASCII,
 * no tag: it encodes) so that its client hears of the end, and stop it. */
static void
client_unencodable(struct sched *s, struct sched_req *r)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_ERROR);
    m.u.error.id = r->id;
    m.u.error.req = r->req;
    m.u.error.code = DSV4_STATUS_INTERNAL;
    m.u.error.message = "internal error: a reply to this request could not be encoded "
        "(see the scheduler's log)";
    (void)dsv4_zsock_send(s->client, &r->client, &m, ZMQ_DONTWAIT, NULL);
    if (!r->closing)    /* (counted failed: its client got ERROR) */
        req_fail(s, r, DSV4_STATUS_INTERNAL, "a reply could not be encoded");
    r->final_sent = true;
    r->n_sent = r->n_out;
}

/* Largest n <= max such that text[0..n) ends on a UTF-8 character boundary. */
static size_t
utf8_cut(const char *text, size_t len, size_t max)
{
    size_t n = len < max ? len : max;

    if (n == len)
        return n;
    while (n > 0 && ((unsigned char)text[n] & 0xC0) == 0x80)
        n--;
    return n;
}

/* A client TOKENS' most likely tokens, packed (top_pack). */
struct top_buf {
    uint64_t *cnt;
    int32_t *ids;
    float *lp;
};

/* The most likely tokens of out[from .. from + n) packed into b and
 * described by t (free b with top_free); false when out of memory. */
static bool
top_pack(const struct sched_req *r, uint32_t from, uint32_t n, struct top_buf *b,
    struct dsv4_top *t)
{
    size_t N = r->s.top_logprobs;
    uint32_t at = 0;

    memset(t, 0, sizeof(*t));
    b->cnt = malloc((size_t)n * sizeof(*b->cnt));
    b->ids = malloc((size_t)n * N * sizeof(*b->ids));
    b->lp = malloc((size_t)n * N * sizeof(*b->lp));
    if (b->cnt == NULL || b->ids == NULL || b->lp == NULL)
        return false;
    for (uint32_t i = 0; i < n; i++) {
        /* (tokens before top_base were sent: none is asked for) */
        size_t j = from + i - r->top_base;
        uint32_t k = from + i >= r->top_base ? r->out_top_n[j] : 0;

        b->cnt[i] = k;
        if (k > 0) {
            memcpy(b->ids + at, r->out_top_ids + j * N, k * sizeof(*b->ids));
            memcpy(b->lp + at, r->out_top_lp + j * N, k * sizeof(*b->lp));
        }
        at += k;
    }
    t->top_n = b->cnt;
    t->top_ids = at > 0 ? b->ids : NULL;
    t->top_logprobs = at > 0 ? b->lp : NULL;
    t->n_top = at;
    return true;
}

static void
top_free(struct top_buf *b)
{
    free(b->cnt);
    free(b->ids);
    free(b->lp);
}

/* One TOKENS message with out[n_sent .. n_sent + n) and text up to `text_end`. */
static int
send_tokens(struct sched *s, struct sched_req *r, uint32_t n, size_t text_end)
{
    /* (text_end < text_sent only after a resume whose text ran ahead) */
    size_t tl = text_end <= r->text_sent ? 0 : utf8_cut(r->text.s + r->text_sent,
        text_end - r->text_sent, DSV4_PROTO_MAX_TEXT);
    struct top_buf tb = { NULL, NULL, NULL };
    struct dsv4_msg m;
    char *piece;
    int rc;

    if ((piece = malloc(tl + 1)) == NULL)
        return 0;
    if (tl > 0)   /* (no text at all without a tokenizer: s is NULL) */
        memcpy(piece, r->text.s + r->text_sent, tl);   /* (no NUL in it: req_emit) */
    piece[tl] = '\0';
    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_TOKENS);
    m.u.tokens.id = r->id;
    m.u.tokens.req = r->req;
    m.u.tokens.tokens = r->out + r->n_sent;
    m.u.tokens.logprobs = r->s.logprobs ? r->out_lp + r->n_sent : NULL;
    m.u.tokens.n_tokens = n;
    m.u.tokens.text = piece;
    if (r->s.top_logprobs > 0 && !top_pack(r, r->n_sent, n, &tb, &m.u.tokens.top)) {
        top_free(&tb);
        free(piece);
        return 0;
    }
    if ((rc = send_to(s, r, &m)) == 1) {
        r->n_sent += n;
        r->text_sent += tl;
    }
    top_free(&tb);
    free(piece);
    return rc;
}

static int
send_final(struct sched *s, struct sched_req *r)
{
    struct dsv4_msg m;

    if (r->err_code != 0) {
        dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_ERROR);
        m.u.error.id = r->id;
        m.u.error.req = r->req;
        m.u.error.code = r->err_code;
        m.u.error.message = r->err_msg != NULL ? r->err_msg : "failed";
        m.u.error.tag = r->tag;
    } else {
        dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_DONE);
        m.u.done.id = r->id;
        m.u.done.req = r->req;
        m.u.done.finish = r->finish;
        m.u.done.prompt_tokens = r->n_prompt;
        m.u.done.completion_tokens = r->n_out;
        m.u.done.tag = r->tag;
    }
    return send_to(s, r, &m);
}

static void
client_lost(struct sched *s, struct sched_req *r)
{
    r->client_gone = true;
    if (!r->closing)
        req_cancel(s, r);
    r->final_sent = true;
    r->n_sent = r->n_out;
}

/*
 * Send, in protocol order, whatever of r's output is due: OK, TOKENS (all of
 * it when streaming; everything at the end otherwise), then DONE/ERROR.
 * While running, text not yet safe (stop-string prefix, incomplete UTF-8)
 * keeps one token back, so the text always has a TOKENS to ride in.
 * May free `r`.  Returns false when the client's pipe is full.
 */
bool
client_flush(struct sched *s, struct sched_req *r)
{
    struct dsv4_msg m;
    int rc = 1;

    if (r->client_gone || r->final_sent)
        goto out;
    if (!r->ok_sent) {
        dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_OK);
        m.u.ok.id = r->id;
        m.u.ok.req = r->req;
        m.u.ok.tag = r->tag;
        m.u.ok.seed = r->s.seed;        /* a resume sends it back */
        m.u.ok.has_seed = true;
        if ((rc = send_to(s, r, &m)) <= 0)
            goto blocked;
        r->ok_sent = true;
    }
    if ((r->stream || r->closing) && r->err_code == 0) {
        bool withheld = r->text_safe < r->text.len || r->ts.npend > 0;
        uint32_t tok_end = r->closing || !withheld ? r->n_out :
            (r->n_out > 0 ? r->n_out - 1 : 0);

        while (r->n_sent < tok_end) {
            uint32_t n = tok_end - r->n_sent;
            size_t te = r->text_safe;

            /* a chunk that is not the last carries its own tokens' text */
            if (n > DSV4_PROTO_MAX_CHUNK) {
                n = DSV4_PROTO_MAX_CHUNK;
                if (r->out_text_end[r->n_sent + n - 1] < te)
                    te = r->out_text_end[r->n_sent + n - 1];
            }
            if ((rc = send_tokens(s, r, n, te)) <= 0)
                goto blocked;
        }
    }
    if (r->closing) {
        if ((rc = send_final(s, r)) <= 0)
            goto blocked;
        r->final_sent = true;
    }
out:
    req_maybe_free(s, r);
    return true;
blocked:
    if (rc == -2) {
        client_unencodable(s, r);
        goto out;
    }
    if (rc < 0) {
        client_lost(s, r);
        goto out;
    }
    if (r->n_out - r->n_sent > DSV4_PROTO_MAX_PENDING && !r->closing) {
        req_fail(s, r, DSV4_STATUS_SLOW_CONSUMER,
            "more than %u output tokens not read by the client", DSV4_PROTO_MAX_PENDING);
        r->n_sent = r->n_out;
    }
    return false;
}

void
client_flush_all(struct sched *s)
{
    struct sched_req *r, *tmp;
    bool blocked = false;

    TAILQ_FOREACH_SAFE(r, &s->live, qentry, tmp) {
        if (r->final_sent)
            continue;
        if (!client_flush(s, r))
            blocked = true;
    }
    /* (a queued re-run may hold output its client has not taken yet) */
    TAILQ_FOREACH_SAFE(r, &s->queue, qentry, tmp) {
        if ((!r->ok_sent || r->n_sent < r->n_out) && !client_flush(s, r))
            blocked = true;
    }
    if (!refusals_flush(s))
        blocked = true;
    s->n_dirty = blocked ? 1 : 0;
}
