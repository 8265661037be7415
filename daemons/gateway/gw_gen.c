/*
 * gw_gen.c — POST /v1/completions and /v1/chat/completions: the request
 * gw_req.c parsed from the OpenAI body into one libdsv4client request, and
 * its events back into OpenAI JSON (one answer) or server-sent events
 * (stream: true).
 *
 * Chat prompts are rendered and tokenized here with the DeepSeek-V4 rules
 * (dsv4_chat_encode: message text never becomes markers) and sent as token
 * ids; completion prompts go as text (the scheduler tokenizes, exactly as
 * for any libdsv4client user) or as token ids.  Every request stops on EOS
 * (whose text is not part of the answer).  The calling connection thread
 * blocks on its own dsv4_client connection; every wait is sliced into
 * GW_POLL_MS steps that check the HTTP peer is still there, so a client that
 * goes away cancels its request within one slice.
 *
 * A stream whose scheduler is quiet (a queue wait, a long prefill, a re-run)
 * sends an SSE comment every gateway_idle_s / 3: libmicrohttpd closes a
 * connection that moves no byte for gateway_idle_s, and it cannot tell a
 * gateway waiting for tokens from a client that stalls.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <json-c/json.h>

#include "common/log.h"
#include "daemons/gateway/gateway.h"
#include "dsv4/client.h"
#include "ipc/zsock.h"

struct gw_gen {
    struct gw *g;
    struct MHD_Connection *conn;
    enum gw_route route;
    bool chat, stream, include_usage, logprobs, thinking, return_ids;
    char id[48];
    int64_t created;
    struct dsv4_client *c;
    uint64_t cid;
    bool submitted, accepted, final, counted;
    int finish;                      /* DONE: enum dsv4_client_finish */
    int err_code;                    /* ERROR: protocol code */
    char err_msg[512];
    uint32_t prompt_tokens, completion_tokens;
    int64_t t_submit, t_last, deadline;
    uint64_t n_out;                  /* output tokens seen */
    bool in_reasoning;               /* thinking mode: before </think> */
    size_t r_sent;                   /* reasoning bytes streamed (the rest may
                                      * begin a </think> the next event ends) */
    struct dsv4_tok_text content, reasoning;
    struct dsv4_tok_ids ids, prompt_ids;
    float *lps;
    /* completions with logprobs: toff[i], the characters (code points) of
     * the output text before token i, from the gateway's own decoding of
     * the ids (ots into otext: the scheduler's text, NUL bytes dropped) */
    size_t *toff;
    struct dsv4_tok_stream ots;
    struct dsv4_tok_text otext;
    size_t ochars;
    uint32_t top_req;                /* most likely tokens asked per position (0 ... 20) */
    /* the most likely tokens of output tokens top_base ... ids.len (streamed:
     * the current event's, the earlier ones sent; else all): token i's
     * top_n[i - top_base] at (i - top_base) * top_req, room for top_cap */
    int32_t *top_ids;
    float *top_lps;
    uint8_t *top_n;
    size_t top_base, top_cap;
    char *out;                       /* SSE bytes not yet handed to MHD */
    size_t out_len, out_off, out_cap;
    bool sse_end;                    /* [DONE] queued */
    int64_t keepalive_ms;            /* stream: the longest quiet between writes */
    enum gw_outcome outcome;
};

static int64_t
gw_now_ms(void)
{
    return dsv4_now_ms();
}

/* --- small helpers ------------------------------------------------------- */

/* The bytes of t from `off` on ("" when t is empty). */
static const char *
gw_text_at(const struct dsv4_tok_text *t, size_t off)
{
    return t->s != NULL ? t->s + off : "";
}

static char *
gw_json_dump(json_object *o, size_t *len)
{
    const char *s = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN |
        JSON_C_TO_STRING_NOSLASHESCAPE);
    char *d = strdup(s);

    if (d != NULL && len != NULL)
        *len = strlen(d);
    return d;
}

static int
gw_out_append(struct gw_gen *q, const char *s, size_t n)
{
    char *nb;
    size_t ncap;

    if (n == 0)
        return 0;   /* (q->out may still be NULL: memcpy's arguments must not be) */
    if (q->out_len + n > q->out_cap) {
        ncap = q->out_cap != 0 ? q->out_cap : 4096;
        while (ncap < q->out_len + n)
            ncap *= 2;
        if ((nb = realloc(q->out, ncap)) == NULL)
            return -1;
        q->out = nb;
        q->out_cap = ncap;
    }
    memcpy(q->out + q->out_len, s, n);
    q->out_len += n;
    return 0;
}

/* Queue one SSE event "data: <json>\n\n"; takes the object. */
static void
gw_sse_json(struct gw_gen *q, json_object *o)
{
    size_t n;
    char *s = gw_json_dump(o, &n);

    json_object_put(o);
    if (s == NULL)
        return;
    gw_out_append(q, "data: ", 6);
    gw_out_append(q, s, n);
    gw_out_append(q, "\n\n", 2);
    free(s);
}

/* HTTP status and OpenAI code for a protocol status of an ERROR event. */
static unsigned
gw_http_status(int code, const char **ocode)
{
    switch (code) {
    case DSV4_CLIENT_BUSY: *ocode = "overloaded"; return 429;
    case DSV4_CLIENT_DRAINING: *ocode = "draining"; return 503;
    /* (seen only for a request the client library could not resume) */
    case DSV4_CLIENT_RESTARTING: *ocode = "scheduler_restarting"; return 503;
    case DSV4_CLIENT_BAD_MESSAGE:
    case DSV4_CLIENT_BAD_ARGUMENT: *ocode = "invalid_request"; return 400;
    case DSV4_CLIENT_TOO_LARGE: *ocode = "context_length_exceeded"; return 400;
    case DSV4_CLIENT_TIMEOUT: *ocode = "timeout"; return 504;
    case DSV4_CLIENT_SLOW_CONSUMER: *ocode = "slow_consumer"; return 429;
    case DSV4_CLIENT_NOT_SUPPORTED: *ocode = "not_supported"; return 501;
    case DSV4_CLIENT_NO_MEMORY: *ocode = "out_of_memory"; return 503;
    case DSV4_CLIENT_UNREACHABLE: *ocode = "scheduler_unreachable"; return 503;
    default: *ocode = "internal_error"; return 500;
    }
}

static const char *
gw_finish_name(int finish)
{
    return finish == DSV4_CLIENT_FINISH_LENGTH ? "length" :
        finish == DSV4_CLIENT_FINISH_CANCELLED ? "cancelled" : "stop";
}

/* --- events -------------------------------------------------------------- */

static json_object *
gw_usage(const struct gw_gen *q)
{
    json_object *u = json_object_new_object();

    json_object_object_add(u, "prompt_tokens", json_object_new_int64(q->prompt_tokens));
    json_object_object_add(u, "completion_tokens",
        json_object_new_int64(q->completion_tokens));
    json_object_object_add(u, "total_tokens",
        json_object_new_int64((int64_t)q->prompt_tokens + q->completion_tokens));
    return u;
}

/* A log-probability as JSON: -inf (and NaN) as -9999.0, as OpenAI has it. */
static json_object *
gw_lp_json(float lp)
{
    return json_object_new_double(isfinite(lp) ? lp : -9999.0);
}

/* A chat logprobs entry {"token", "logprob", "bytes"} of token `id`. */
static json_object *
gw_chat_entry(const struct gw_gen *q, int32_t id, float lp)
{
    json_object *t = json_object_new_object(), *bytes = json_object_new_array();
    const char *piece;
    size_t j, n;

    piece = dsv4_tok_piece(q->g->tok, id, &n);
    json_object_object_add(t, "token", gw_json_bytes(piece, n));
    json_object_object_add(t, "logprob", gw_lp_json(lp));
    for (j = 0; j < n; j++)
        json_object_array_add(bytes, json_object_new_int((unsigned char)piece[j]));
    json_object_object_add(t, "bytes", bytes);
    return t;
}

/* Add token `id`'s text -> lp to the legacy completions object o, unless a
 * token of the same text is there already (it was the more likely). */
static void
gw_dict_add(const struct gw_gen *q, json_object *o, int32_t id, float lp)
{
    size_t n;
    const char *piece = dsv4_tok_piece(q->g->tok, id, &n);
    json_object *k = gw_json_bytes(piece, n);

    if (!json_object_object_get_ex(o, json_object_get_string(k), NULL))
        json_object_object_add(o, json_object_get_string(k), gw_lp_json(lp));
    json_object_put(k);
}

/* The most likely tokens of output position i: chat a list of entries,
 * best first; completions an object text -> logprob (OpenAI's legacy
 * format: of two that render the same, the first, more likely, stays; the
 * sampled token added last when it is not among them). */
static json_object *
gw_top_json(const struct gw_gen *q, size_t i)
{
    size_t t = i - q->top_base, j;
    const int32_t *ids = q->top_ids + t * q->top_req;
    const float *lps = q->top_lps + t * q->top_req;
    json_object *o = q->chat ? json_object_new_array() : json_object_new_object();

    for (j = 0; j < q->top_n[t]; j++) {
        if (q->chat)
            json_object_array_add(o, gw_chat_entry(q, ids[j], lps[j]));
        else
            gw_dict_add(q, o, ids[j], lps[j]);
    }
    /* the sampled token is always there (OpenAI: up to logprobs + 1 entries) */
    if (!q->chat && q->top_n[t] > 0)
        gw_dict_add(q, o, q->ids.v[i], q->lps[i]);
    return o;
}

/* Log-probability entries of ids[from..to). */
static json_object *
gw_logprobs(const struct gw_gen *q, size_t from, size_t to)
{
    json_object *o, *a, *b, *c = NULL, *e, *top = NULL;
    size_t i, n;

    o = json_object_new_object();
    if (q->chat)
        c = json_object_new_array();
    a = json_object_new_array();
    b = json_object_new_array();
    e = json_object_new_array();
    if (!q->chat && q->top_req > 0)
        top = json_object_new_array();
    for (i = from; i < to; i++) {
        if (q->chat) {
            json_object *t = gw_chat_entry(q, q->ids.v[i], q->lps[i]);

            json_object_object_add(t, "top_logprobs", q->top_req > 0 ? gw_top_json(q, i) :
                json_object_new_array());
            json_object_array_add(c, t);
        } else {
            const char *piece = dsv4_tok_piece(q->g->tok, q->ids.v[i], &n);

            json_object_array_add(a, gw_json_bytes(piece, n));
            json_object_array_add(b, gw_lp_json(q->lps[i]));
            json_object_array_add(e, json_object_new_int64((int64_t)q->toff[i]));
            if (top != NULL)
                json_object_array_add(top, gw_top_json(q, i));
        }
    }
    if (q->chat) {
        json_object_object_add(o, "content", c);
        json_object_put(a);
        json_object_put(b);
        json_object_put(e);
    } else {
        json_object_object_add(o, "tokens", a);
        json_object_object_add(o, "token_logprobs", b);
        json_object_object_add(o, "top_logprobs", top);   /* null when none were asked */
        json_object_object_add(o, "text_offset", e);
    }
    return o;
}

static json_object *
gw_ids_json(const int32_t *v, size_t from, size_t to)
{
    json_object *a = json_object_new_array();
    size_t i;

    for (i = from; i < to; i++)
        json_object_array_add(a, json_object_new_int(v[i]));
    return a;
}

/* Header of a chunk/answer: id, object, created, model. */
static json_object *
gw_head(const struct gw_gen *q, const char *object)
{
    json_object *o = json_object_new_object();

    json_object_object_add(o, "id", json_object_new_string(q->id));
    json_object_object_add(o, "object", json_object_new_string(object));
    json_object_object_add(o, "created", json_object_new_int64(q->created));
    json_object_object_add(o, "model", json_object_new_string(q->g->conf.gateway_model));
    return o;
}

/* One SSE chunk with text `c`/reasoning `r` for ids[from..to); finish NULL
 * = not the last. */
static void
gw_sse_chunk(struct gw_gen *q, const char *c, size_t cn, const char *r, size_t rn,
    size_t from, size_t to, const char *finish)
{
    json_object *o, *ch, *arr, *d;

    o = gw_head(q, q->chat ? "chat.completion.chunk" : "text_completion");
    ch = json_object_new_object();
    json_object_object_add(ch, "index", json_object_new_int(0));
    if (q->chat) {
        d = json_object_new_object();
        if (cn > 0 || (rn == 0 && finish == NULL))
            json_object_object_add(d, "content", json_object_new_string_len(c, (int)cn));
        if (rn > 0)
            json_object_object_add(d, "reasoning_content",
                json_object_new_string_len(r, (int)rn));
        json_object_object_add(ch, "delta", d);
    } else {
        json_object_object_add(ch, "text", json_object_new_string_len(c, (int)cn));
    }
    json_object_object_add(ch, "logprobs", q->logprobs && to > from ?
        gw_logprobs(q, from, to) : NULL);
    if (q->return_ids && to > from)
        json_object_object_add(ch, "token_ids", gw_ids_json(q->ids.v, from, to));
    json_object_object_add(ch, "finish_reason", finish != NULL ?
        json_object_new_string(finish) : NULL);
    arr = json_object_new_array();
    json_object_array_add(arr, ch);
    json_object_object_add(o, "choices", arr);
    gw_sse_json(q, o);
}

/* Room for twice as many output tokens (ids, logprobs); -1 when out of
 * memory (what fitted stays). */
static int
gw_grow(struct gw_gen *q)
{
    size_t ncap = q->ids.cap != 0 ? q->ids.cap * 2 : 64;
    int32_t *nv = realloc(q->ids.v, ncap * sizeof(*nv));
    float *nl;

    if (nv == NULL)
        return -1;
    q->ids.v = nv;
    if ((nl = realloc(q->lps, ncap * sizeof(*nl))) == NULL)
        return -1;
    q->lps = nl;
    if (!q->chat && q->logprobs) {
        size_t *no = realloc(q->toff, ncap * sizeof(*no));

        if (no == NULL)
            return -1;
        q->toff = no;
    }
    q->ids.cap = ncap;
    return 0;
}

/* Token `id` is output token q->ids.len: its text offset (completions
 * logprobs' text_offset, in characters of the answer's text). */
static void
gw_text_offset(struct gw_gen *q, int32_t id)
{
    q->toff[q->ids.len] = q->ochars;
    if (dsv4_tok_stream_push(&q->ots, id, &q->otext) == DSV4_OK) {
        for (size_t i = 0; i < q->otext.len; i++) {
            unsigned char b = (unsigned char)q->otext.s[i];

            q->ochars += b != 0 && (b & 0xC0) != 0x80;
        }
    }
    q->otext.len = 0;   /* only counted: empty for the next token */
}

/* Room for the most likely tokens of `n` tokens from top_base; -1 when out
 * of memory. */
static int
gw_top_room(struct gw_gen *q, size_t n)
{
    size_t ncap = q->top_cap != 0 ? q->top_cap : 64, k = q->top_req;
    int32_t *ti;
    float *tl;
    uint8_t *tn;

    if (n <= q->top_cap)
        return 0;
    while (ncap < n)
        ncap *= 2;
    if ((ti = realloc(q->top_ids, ncap * k * sizeof(*ti))) == NULL)
        return -1;
    q->top_ids = ti;
    if ((tl = realloc(q->top_lps, ncap * k * sizeof(*tl))) == NULL)
        return -1;
    q->top_lps = tl;
    if ((tn = realloc(q->top_n, ncap * sizeof(*tn))) == NULL)
        return -1;
    q->top_n = tn;
    q->top_cap = ncap;
    return 0;
}

/* A TOKENS event: record ids, timing, text (EOS text dropped, reasoning
 * split off at </think> in thinking mode); stream a chunk. */
static void
gw_on_tokens(struct gw_gen *q, const struct dsv4_client_event *ev)
{
    const char *text = ev->text != NULL ? ev->text : "", *cut, *eos;
    size_t tn = strlen(text), from = q->ids.len, i, eosn;
    size_t c0 = q->content.len, r0 = q->r_sent, hold = 0;
    int64_t now = gw_now_ms();

    pthread_mutex_lock(&q->g->mlock);
    if (q->n_out == 0)
        gw_hist_observe(&q->g->m.ttft, (double)(now - q->t_submit) / 1000.0);
    else
        for (i = 0; i < ev->n_tokens; i++)
            gw_hist_observe(&q->g->m.itl, (double)(now - q->t_last) / 1000.0 /
                (double)ev->n_tokens);
    pthread_mutex_unlock(&q->g->mlock);
    q->t_last = now;
    q->n_out += ev->n_tokens;
    if (q->stream)
        q->top_base = from;   /* the earlier events' lists went out with them */
    for (i = 0; i < ev->n_tokens; i++) {
        if (q->ids.len == q->ids.cap && gw_grow(q) != 0)
            return;
        q->lps[q->ids.len] = ev->logprobs != NULL ? ev->logprobs[i] : 0.0f;
        if (!q->chat && q->logprobs)
            gw_text_offset(q, ev->tokens[i]);
        if (q->top_req > 0) {
            /* (the event's arrays last until the next dsv4_client_next) */
            const int32_t *tids;
            const float *tlps;
            size_t k = dsv4_client_event_top(q->c, i, &tids, &tlps), t;

            if (gw_top_room(q, q->ids.len - q->top_base + 1) != 0)
                return;
            t = q->ids.len - q->top_base;
            if (k > q->top_req)
                k = q->top_req;
            if (k > 0) {
                memcpy(q->top_ids + t * q->top_req, tids, k * sizeof(*tids));
                memcpy(q->top_lps + t * q->top_req, tlps, k * sizeof(*tlps));
            }
            q->top_n[t] = (uint8_t)k;
        }
        q->ids.v[q->ids.len++] = ev->tokens[i];
    }
    /* EOS ends the request and is part of the token output; its text is not
     * part of the answer. */
    if (ev->n_tokens > 0 && ev->tokens[ev->n_tokens - 1] == q->g->eos) {
        eos = dsv4_tok_piece(q->g->tok, q->g->eos, &eosn);
        if (eos != NULL && tn >= eosn && memcmp(text + tn - eosn, eos, eosn) == 0)
            tn -= eosn;
    }
    if (q->in_reasoning) {
        /* </think> may be split over events (spelled in plain tokens): the
         * search starts where an unfinished one may, and such a start is
         * not streamed until the next event settles it */
        const char *r;
        size_t at = q->r_sent;

        gw_text_add(&q->reasoning, text, tn);
        tn = 0;
        r = gw_text_at(&q->reasoning, 0);
        cut = memmem(r + at, q->reasoning.len - at, "</think>", 8);
        if (cut != NULL) {
            text = cut + 8;
            tn = q->reasoning.len - (size_t)(text - r);
            gw_text_add(&q->content, text, tn);   /* (before the cut ends reasoning) */
            tn = 0;
            q->reasoning.len = (size_t)(cut - r);
            q->in_reasoning = false;
        } else {
            for (size_t k = 7; k > 0 && hold == 0; k--)
                if (q->reasoning.len - at >= k &&
                    memcmp(r + q->reasoning.len - k, "</think>", k) == 0)
                    hold = k;
        }
    }
    gw_text_add(&q->content, text, tn);
    q->r_sent = q->reasoning.len - hold;
    if (q->stream && (q->content.len > c0 || q->r_sent > r0 || q->logprobs ||
        q->return_ids))
        gw_sse_chunk(q, gw_text_at(&q->content, c0), q->content.len - c0,
            gw_text_at(&q->reasoning, r0), q->r_sent - r0, from, q->ids.len, NULL);
}

/* An error in the stream: an OpenAI error object as an SSE event. */
static void
gw_sse_error(struct gw_gen *q)
{
    json_object *o = json_object_new_object(), *e = json_object_new_object();
    const char *code;
    unsigned st = gw_http_status(q->err_code, &code);

    /* The same message, type and code as the JSON answer of this error
     * (gw_http_error). */
    json_object_object_add(e, "message", gw_json_bytes(q->err_msg, strlen(q->err_msg)));
    json_object_object_add(e, "type", json_object_new_string(gw_http_error_type(st)));
    json_object_object_add(e, "param", NULL);
    json_object_object_add(e, "code", json_object_new_string(code));
    json_object_object_add(o, "error", e);
    gw_sse_json(q, o);
}

static void
gw_on_final(struct gw_gen *q)
{
    json_object *o;

    if (!q->stream)
        return;
    if (q->err_code != 0) {
        gw_sse_error(q);
    } else {
        /* (reasoning held back as a possible </think>'s start is reasoning) */
        gw_sse_chunk(q, "", 0, gw_text_at(&q->reasoning, q->r_sent),
            q->reasoning.len - q->r_sent, 0, 0, gw_finish_name(q->finish));
        if (q->include_usage) {
            o = gw_head(q, q->chat ? "chat.completion.chunk" : "text_completion");
            json_object_object_add(o, "choices", json_object_new_array());
            json_object_object_add(o, "usage", gw_usage(q));
            gw_sse_json(q, o);
        }
    }
    gw_out_append(q, "data: [DONE]\n\n", 14);
    q->sse_end = true;
}

/* Take one event of our request. */
static void
gw_on_event(struct gw_gen *q, const struct dsv4_client_event *ev)
{
    if (ev->id != q->cid && ev->id != 0)
        return;
    switch (ev->type) {
    case DSV4_CLIENT_EV_ACCEPTED:
        q->accepted = true;
        break;
    case DSV4_CLIENT_EV_TOKENS:
        gw_on_tokens(q, ev);
        break;
    case DSV4_CLIENT_EV_DONE:
        q->final = true;
        q->finish = ev->finish;
        q->prompt_tokens = ev->prompt_tokens;
        q->completion_tokens = ev->completion_tokens;
        /* (an operator's dsv4ctl cancel: finish "cancelled" with the output
         * so far, as for any client; it was a 500 internal_error, the
         * output dropped) */
        gw_on_final(q);
        break;
    case DSV4_CLIENT_EV_ERROR:
        q->final = true;
        q->err_code = ev->code;
        snprintf(q->err_msg, sizeof(q->err_msg), "%s (%d %s)",
            ev->message != NULL ? ev->message : "", ev->code, dsv4_client_strerror(ev->code));
        gw_on_final(q);
        break;
    }
}

/* How a gw_wait ended. */
enum gw_wait_end {
    GW_W_DONE = 0,      /* `until` said stop, or the request ended */
    GW_W_GONE,          /* the HTTP peer is gone */
    GW_W_DEADLINE,      /* the gateway's own deadline passed (the request is final) */
    GW_W_QUIET,         /* a stream should write a keep-alive now: quiet_at came */
};

/* Wait for events until `until` says stop, the request ends, the peer goes
 * or the deadline passes; with quiet_at > 0 (a stream, which can always
 * write a keep-alive) also until the clock reaches quiet_at. */
static enum gw_wait_end
gw_wait(struct gw_gen *q, bool (*until)(const struct gw_gen *), int64_t quiet_at)
{
    struct dsv4_client_event ev;
    int64_t now, next_check = gw_now_ms() + GW_POLL_MS;
    int rc;

    while (!q->final && !until(q)) {
        rc = dsv4_client_next(q->c, &ev, GW_POLL_MS);
        if (rc != 0 && rc != DSV4_CLIENT_NONE) {
            q->final = true;
            q->err_code = rc;
            snprintf(q->err_msg, sizeof(q->err_msg), "scheduler connection failed: %s",
                dsv4_client_errmsg(q->c));
            gw_on_final(q);
            break;
        }
        if (rc == 0)
            gw_on_event(q, &ev);
        /* Events can arrive faster than GW_POLL_MS for the whole request
         * (tokens of a non-streamed answer): look at the peer on a clock,
         * not only when the scheduler is quiet. */
        now = gw_now_ms();
        if (rc == DSV4_CLIENT_NONE || now >= next_check) {
            next_check = now + GW_POLL_MS;
            if (gw_http_peer_gone(q->conn))
                return GW_W_GONE;
        }
        if (rc == DSV4_CLIENT_NONE && now > q->deadline) {
            q->final = true;
            q->err_code = DSV4_CLIENT_TIMEOUT;
            snprintf(q->err_msg, sizeof(q->err_msg), "no answer within %d ms",
                q->g->conf.gateway_timeout_ms);
            gw_on_final(q);
            return GW_W_DEADLINE;
        }
        if (quiet_at > 0 && now >= quiet_at)
            return GW_W_QUIET;
    }
    return GW_W_DONE;
}

static bool
gw_until_accepted(const struct gw_gen *q)
{
    return q->accepted;
}

static bool
gw_until_output(const struct gw_gen *q)
{
    return q->out_off < q->out_len;
}

static bool
gw_until_never(const struct gw_gen *q)
{
    (void)q;
    return false;
}

/* Record the outcome once. */
static void
gw_count(struct gw_gen *q, enum gw_outcome out)
{
    struct gw_metrics *m = &q->g->m;

    if (q->counted)
        return;
    q->counted = true;
    q->outcome = out;
    pthread_mutex_lock(&q->g->mlock);
    m->outcome[out]++;
    m->prompt_tokens += q->prompt_tokens;
    m->completion_tokens += q->completion_tokens;
    if (q->submitted)
        gw_hist_observe(&m->duration, (double)(gw_now_ms() - q->t_submit) / 1000.0);
    pthread_mutex_unlock(&q->g->mlock);
}

/* The outcome of a request that ended (docs/gateway.md, "Metrics").
 * "rejected" is a refusal before the request ran: the scheduler refuses
 * (busy, draining, too large) instead of accepting (DSV4C1 sends ERROR or
 * OK first), so an error after OK, whatever its code, failed a request
 * that ran. */
static enum gw_outcome
gw_outcome_of(const struct gw_gen *q)
{
    if (q->err_code == 0)
        return q->finish == DSV4_CLIENT_FINISH_LENGTH ? GW_OUT_LENGTH :
            q->finish == DSV4_CLIENT_FINISH_CANCELLED ? GW_OUT_CANCELLED : GW_OUT_STOP;
    if (q->err_code == DSV4_CLIENT_TIMEOUT)
        return GW_OUT_TIMEOUT;
    if (!q->accepted)
        return GW_OUT_REJECTED;
    return GW_OUT_ERROR;
}

/* --- answers -------------------------------------------------------------- */

static enum MHD_Result
gw_reply_error(struct gw_gen *q)
{
    const char *code;
    unsigned st = gw_http_status(q->err_code, &code);

    gw_count(q, gw_outcome_of(q));
    return gw_http_error(q->g, q->conn, q->route, st, code, "%s", q->err_msg);
}

static enum MHD_Result
gw_reply_json(struct gw_gen *q)
{
    json_object *o, *ch, *msg, *arr;

    gw_count(q, gw_outcome_of(q));
    o = gw_head(q, q->chat ? "chat.completion" : "text_completion");
    ch = json_object_new_object();
    json_object_object_add(ch, "index", json_object_new_int(0));
    if (q->chat) {
        msg = json_object_new_object();
        json_object_object_add(msg, "role", json_object_new_string("assistant"));
        json_object_object_add(msg, "content", json_object_new_string_len(
            gw_text_at(&q->content, 0), (int)q->content.len));
        if (q->thinking)
            json_object_object_add(msg, "reasoning_content", json_object_new_string_len(
                gw_text_at(&q->reasoning, 0), (int)q->reasoning.len));
        json_object_object_add(ch, "message", msg);
    } else {
        json_object_object_add(ch, "text", json_object_new_string_len(
            gw_text_at(&q->content, 0), (int)q->content.len));
    }
    json_object_object_add(ch, "logprobs", q->logprobs ?
        gw_logprobs(q, 0, q->ids.len) : NULL);
    if (q->return_ids) {
        json_object_object_add(ch, "token_ids", gw_ids_json(q->ids.v, 0, q->ids.len));
        if (q->prompt_ids.len > 0)
            json_object_object_add(o, "prompt_token_ids",
                gw_ids_json(q->prompt_ids.v, 0, q->prompt_ids.len));
    }
    json_object_object_add(ch, "finish_reason",
        json_object_new_string(gw_finish_name(q->finish)));
    arr = json_object_new_array();
    json_object_array_add(arr, ch);
    json_object_object_add(o, "choices", arr);
    json_object_object_add(o, "usage", gw_usage(q));
    return gw_http_json(q->g, q->conn, q->route, 200, o);
}

/* MHD pulls the SSE body from here (connection thread; may block). */
static ssize_t
gw_sse_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct gw_gen *q = cls;
    size_t n;

    (void)pos;
    if (q->out_off == q->out_len) {
        q->out_off = q->out_len = 0;
        if (q->sse_end)
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (gw_wait(q, gw_until_output, gw_now_ms() + q->keepalive_ms) == GW_W_GONE) {
            gw_count(q, GW_OUT_DISCONNECT);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        /* Still nothing to send (GW_W_QUIET): a comment, so that the
         * connection does not look idle to MHD (or a proxy). */
        if (q->out_len == 0 && !q->sse_end)
            gw_out_append(q, GW_KEEPALIVE, strlen(GW_KEEPALIVE));
        if (q->out_off == q->out_len)
            return q->sse_end ? MHD_CONTENT_READER_END_OF_STREAM : 0;
    }
    n = q->out_len - q->out_off;
    if (n > max)
        n = max;
    memcpy(buf, q->out + q->out_off, n);
    q->out_off += n;
    if (q->final && q->out_off == q->out_len)
        gw_count(q, gw_outcome_of(q));
    return (ssize_t)n;
}

static enum MHD_Result
gw_reply_stream(struct gw_gen *q)
{
    struct MHD_Response *r;
    enum MHD_Result rc;

    if (q->chat) {
        /* The first chunk names the role, as OpenAI's does. */
        json_object *o = gw_head(q, "chat.completion.chunk"), *ch, *d, *arr;

        ch = json_object_new_object();
        d = json_object_new_object();
        json_object_object_add(d, "role", json_object_new_string("assistant"));
        json_object_object_add(d, "content", json_object_new_string(""));
        json_object_object_add(ch, "index", json_object_new_int(0));
        json_object_object_add(ch, "delta", d);
        json_object_object_add(ch, "logprobs", NULL);
        json_object_object_add(ch, "finish_reason", NULL);
        arr = json_object_new_array();
        json_object_array_add(arr, ch);
        json_object_object_add(o, "choices", arr);
        /* Before any output that already arrived: put it first. */
        {
            char *keep = q->out;
            size_t klen = q->out_len;

            q->out = NULL;
            q->out_len = q->out_cap = 0;
            gw_sse_json(q, o);
            gw_out_append(q, keep != NULL ? keep : "", klen);
            free(keep);
        }
    }
    r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, gw_sse_read, q, NULL);
    if (r == NULL)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    rc = MHD_queue_response(q->conn, 200, r);
    MHD_destroy_response(r);
    gw_metrics_http(q->g, q->route, 200);
    return rc;
}

/* --- entry points --------------------------------------------------------- */

static int
gw_submit(struct gw_gen *q, struct gw_req *a, struct gw_bad *b)
{
    struct dsv4_client_opts co;
    char keyfile[DSV4_CONF_STR + 16];
    enum dsv4_err e;
    int rc;

    a->stop_ids[0] = q->g->eos;
    if (q->g->eos >= 0) {
        a->p.stop_ids = a->stop_ids;
        a->p.n_stop_ids = 1;
    }
    a->p.stream = 1;
    a->p.timeout_ms = (uint32_t)q->g->conf.gateway_timeout_ms;
    snprintf(a->tag, sizeof(a->tag), "gateway %s", q->id);
    a->p.tag = a->tag;
    if (q->chat) {
        pthread_mutex_lock(&q->g->toklock);
        e = dsv4_chat_encode(q->g->tok, a->msgs, a->n_msgs, &a->copts, &q->prompt_ids);
        pthread_mutex_unlock(&q->g->toklock);
        /* (an empty developer message is the request's fault; no memory,
         * or a tokenizer failure, the server's) */
        if (e == DSV4_ERR_INVAL)
            return gw_bad(b, 400, "invalid_request", "messages: %s", dsv4_errmsg());
        if (e != DSV4_OK)
            return gw_bad(b, 500, "internal_error", "messages: %s", dsv4_errmsg());
        /* reasoning comes first only where the prompt opens it (a
         * conversation that ends with an assistant or system turn does not) */
        q->in_reasoning = q->thinking && q->prompt_ids.len > 0 &&
            q->prompt_ids.v[q->prompt_ids.len - 1] == q->g->think_id;
    }
    dsv4_client_opts_init(&co);
    if (strncmp(q->g->conf.client_endpoint, "tcp://", 6) == 0) {
        snprintf(keyfile, sizeof(keyfile), "%s/server.pub", q->g->conf.key_dir);
        co.server_key_file = keyfile;
    }
    rc = dsv4_client_connect(q->g->conf.client_endpoint, &co, &q->c);
    if (rc == DSV4_CLIENT_UNREACHABLE)
        return gw_bad(b, 503, "scheduler_unreachable", "the scheduler at %s does not "
            "answer (%d %s: %s)", q->g->conf.client_endpoint, rc, dsv4_client_strerror(rc),
            dsv4_client_errmsg(NULL));
    if (rc != 0)   /* the gateway's own failure (no descriptors, no memory) */
        return gw_bad(b, 500, "internal_error", "the gateway could not open a connection to "
            "the scheduler (%d %s: %s)", rc, dsv4_client_strerror(rc),
            dsv4_client_errmsg(NULL));
    q->t_submit = gw_now_ms();
    q->deadline = q->t_submit + q->g->conf.gateway_timeout_ms + 5000;
    if (q->chat)
        rc = dsv4_client_submit_tokens(q->c, q->prompt_ids.v, q->prompt_ids.len, &a->p,
            &q->cid);
    else if (a->prompt != NULL)
        rc = dsv4_client_submit_text(q->c, a->prompt, &a->p, &q->cid);
    else
        rc = dsv4_client_submit_tokens(q->c, a->tokens, a->n_tokens, &a->p, &q->cid);
    if (rc != 0) {
        const char *code;
        unsigned st = gw_http_status(rc, &code);

        return gw_bad(b, st, code, "%s: %s", dsv4_client_strerror(rc),
            dsv4_client_errmsg(q->c));
    }
    q->submitted = true;
    pthread_mutex_lock(&q->g->mlock);
    q->g->m.streams_active++;
    pthread_mutex_unlock(&q->g->mlock);
    return 0;
}

enum MHD_Result
gw_gen_handle(struct gw *g, struct MHD_Connection *conn, bool chat, const char *body,
    size_t len, struct gw_gen **genp)
{
    static atomic_uint_fast64_t serial;
    struct gw_req a;
    struct gw_bad b = { 0 };
    struct gw_gen *q;
    enum MHD_Result ret;
    enum gw_wait_end w;
    int rc = -1;

    if ((q = calloc(1, sizeof(*q))) == NULL)
        return MHD_NO;
    *genp = q;
    q->g = g;
    q->conn = conn;
    q->chat = chat;
    q->route = chat ? GW_R_CHAT : GW_R_COMPLETIONS;
    /* Three keep-alives per idle timeout: one late write still leaves room. */
    q->keepalive_ms = (int64_t)g->conf.gateway_idle_s * 1000 / 3;
    q->created = (int64_t)time(NULL);
    snprintf(q->id, sizeof(q->id), "%s-%d-%" PRIu64, chat ? "chatcmpl" : "cmpl",
        (int)getpid(), (uint64_t)atomic_fetch_add(&serial, 1) + 1);
    if (atomic_load(&g->stopping)) {
        memset(&a, 0, sizeof(a));
        gw_bad(&b, 503, "stopping", "the gateway is shutting down");
        goto out;
    }
    if (gw_req_parse(g, chat, body, len, &a, &b) != 0)
        goto out;
    q->stream = a.stream;
    q->include_usage = a.include_usage;
    q->logprobs = a.logprobs;
    q->top_req = a.logprobs ? a.p.top_logprobs : 0;
    dsv4_tok_stream_init(&q->ots, g->tok);
    q->return_ids = a.return_ids;
    q->thinking = chat && a.copts.thinking;
    if (gw_submit(q, &a, &b) != 0)
        goto out;
    rc = 0;
out:
    gw_req_free(&a);
    if (rc != 0) {
        gw_count(q, GW_OUT_REJECTED);
        return gw_http_error(g, conn, q->route, b.status, b.code, "%s", b.msg);
    }
    /* Wait for the scheduler to take the request, so refusals (busy,
     * draining, too long) get their own HTTP status, streaming or not. */
    w = gw_wait(q, q->stream ? gw_until_accepted : gw_until_never, 0);
    if (w == GW_W_GONE) {
        gw_count(q, GW_OUT_DISCONNECT);
        return MHD_NO;
    }
    if (q->final && q->err_code != 0 && (!q->stream || q->n_out == 0)) {
        q->out_len = q->out_off = 0;
        return gw_reply_error(q);
    }
    if (!q->stream)
        return gw_reply_json(q);
    ret = gw_reply_stream(q);
    return ret;
}

void
gw_gen_finish(struct gw *g, struct gw_gen *q, bool client_gone)
{
    struct dsv4_client_event ev;
    int64_t end;

    if (q == NULL)
        return;
    if (q->submitted && !q->final) {
        /* Still running: the client went away or the connection timed out.
         * Cancel and wait for the request's end so nothing is left behind. */
        dsv4_client_cancel(q->c, q->cid);
        end = gw_now_ms() + GW_CANCEL_WAIT_MS;
        while (!q->final && gw_now_ms() < end)
            if (dsv4_client_next(q->c, &ev, GW_POLL_MS) == 0 &&
                (ev.type == DSV4_CLIENT_EV_DONE || ev.type == DSV4_CLIENT_EV_ERROR) &&
                ev.id == q->cid)
                q->final = true;
        gw_count(q, client_gone ? GW_OUT_DISCONNECT : GW_OUT_ERROR);
    } else if (q->submitted) {
        gw_count(q, client_gone && q->out_off < q->out_len ? GW_OUT_DISCONNECT :
            gw_outcome_of(q));
    }
    if (q->submitted) {
        pthread_mutex_lock(&g->mlock);
        g->m.streams_active--;
        pthread_mutex_unlock(&g->mlock);
    }
    dsv4_client_close(q->c);
    dsv4_tok_text_free(&q->content);
    dsv4_tok_text_free(&q->reasoning);
    dsv4_tok_ids_free(&q->ids);
    dsv4_tok_ids_free(&q->prompt_ids);
    free(q->lps);
    free(q->toff);
    dsv4_tok_text_free(&q->otext);
    free(q->top_ids);
    free(q->top_lps);
    free(q->top_n);
    free(q->out);
    free(q);
}
