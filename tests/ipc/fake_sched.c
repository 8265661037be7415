/*
 * fake_sched.c — stand-in scheduler for the client tests (see fake_sched.h).
 * Built into test_client (run in a thread) and into the fake_sched program
 * that the Python client test starts.
 */
#include "tests/ipc/fake_sched.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "ipc/proto.h"
#include "ipc/zsock.h"

#define FAKE_MAX_REQS 64
#define FAKE_TICK_MS 1
#define FAKE_TEXT_MAX 16
#define FAKE_SEED 4242           /* what OK says; a resume must send it back */

struct fake_req {
    bool live;
    struct dsv4_route route;
    uint64_t id, req;
    int32_t *src;            /* output source ids */
    uint32_t n_src;
    bool text;               /* prompt was text: pieces are single bytes */
    uint32_t max_tokens, emitted;
    int32_t stop_ids[DSV4_PROTO_MAX_STOP_IDS];
    uint32_t n_stop_ids;
    bool logprobs, stream, stall;
    uint32_t top;            /* GENERATE top_logprobs: streamed tokens of even
                                index get that many (id tok + 1000 j, logprob
                                lp - j), odd ones none */
    int64_t deadline_ms;     /* 0 = none */
    char *tag;
    int32_t *acc;            /* stream=false: everything so far */
    float *acc_lp;
    char *acc_text;
    size_t acc_text_len;
};

struct fake {
    void *sock;
    struct fake_req reqs[FAKE_MAX_REQS];
    uint64_t next_req;
};

static void
req_free(struct fake_req *r)
{
    free(r->src);
    free(r->tag);
    free(r->acc);
    free(r->acc_lp);
    free(r->acc_text);
    memset(r, 0, sizeof(*r));
}

static void
send_error(struct fake *f, const struct dsv4_route *to, uint64_t id, uint64_t req, int code,
    const char *text, const char *tag)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_ERROR);
    m.u.error.id = id;
    m.u.error.req = req;
    m.u.error.code = (uint16_t)code;
    m.u.error.message = text;
    m.u.error.tag = tag;
    (void)dsv4_zsock_send(f->sock, to, &m, ZMQ_DONTWAIT, NULL);
}

static void
send_done(struct fake *f, struct fake_req *r, enum dsv4_finish finish)
{
    struct dsv4_msg m;

    if (!r->stream && r->emitted > 0) {
        dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_TOKENS);
        m.u.tokens.id = r->id;
        m.u.tokens.req = r->req;
        m.u.tokens.tokens = r->acc;
        m.u.tokens.logprobs = r->logprobs ? r->acc_lp : NULL;
        m.u.tokens.n_tokens = r->emitted;
        m.u.tokens.text = r->acc_text;
        (void)dsv4_zsock_send(f->sock, &r->route, &m, ZMQ_DONTWAIT, NULL);
    }
    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_DONE);
    m.u.done.id = r->id;
    m.u.done.req = r->req;
    m.u.done.finish = finish;
    m.u.done.prompt_tokens = r->n_src;
    m.u.done.completion_tokens = r->emitted;
    m.u.done.tag = r->tag;
    (void)dsv4_zsock_send(f->sock, &r->route, &m, ZMQ_DONTWAIT, NULL);
    req_free(r);
}

/* The text of output token `tok` of r into piece[FAKE_TEXT_MAX]: the byte
 * itself for a text prompt, "[ID]" for ids; returns its length. */
static size_t
fake_piece(const struct fake_req *r, int32_t tok, char *piece)
{
    if (r->text)
        return (size_t)snprintf(piece, FAKE_TEXT_MAX, "%c", (char)tok);
    return (size_t)snprintf(piece, FAKE_TEXT_MAX, "[%d]", tok);
}

/* A resume (docs/protocol.md §4.6) must be the output so far, tokens and
 * text bytes, with the seed; then the request goes on after it. */
static bool
resume_ok(struct fake_req *r, const struct dsv4_cli_generate *g)
{
    uint64_t text = 0;
    char piece[FAKE_TEXT_MAX];

    if (!g->s.has_seed || g->s.seed != FAKE_SEED || g->n_resume > r->max_tokens)
        return false;
    for (uint32_t k = 0; k < g->n_resume; k++) {
        if (g->resume[k] != r->src[k % r->n_src])
            return false;
        text += fake_piece(r, r->src[k % r->n_src], piece);
    }
    if (!g->has_resume_text || g->resume_text != text)
        return false;
    r->emitted = g->n_resume;
    return true;
}

static void
on_generate(struct fake *f, const struct dsv4_route *from, const struct dsv4_cli_generate *g)
{
    struct fake_req *r = NULL;
    struct dsv4_msg m;

    if (g->prompt != NULL && strcmp(g->prompt, "__busy__") == 0) {
        send_error(f, from, g->id, 0, DSV4_STATUS_BUSY, "queue full", g->tag);
        return;
    }
    if (g->prompt != NULL && strcmp(g->prompt, "__restart__") == 0) {
        /* OK, the token '_', then 302 (a scheduler that stops); its resend
         * (with that token as `resume`) is refused with 300 */
        int32_t tok = '_';

        if (g->resume != NULL) {
            send_error(f, from, g->id, 0, DSV4_STATUS_BUSY, "queue full", g->tag);
            return;
        }
        dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_OK);
        m.u.ok.id = g->id;
        m.u.ok.req = ++f->next_req;
        m.u.ok.seed = FAKE_SEED;
        m.u.ok.has_seed = true;
        (void)dsv4_zsock_send(f->sock, from, &m, ZMQ_DONTWAIT, NULL);
        dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_TOKENS);
        m.u.tokens.id = g->id;
        m.u.tokens.req = f->next_req;
        m.u.tokens.tokens = &tok;
        m.u.tokens.n_tokens = 1;
        m.u.tokens.text = "_";
        (void)dsv4_zsock_send(f->sock, from, &m, ZMQ_DONTWAIT, NULL);
        send_error(f, from, g->id, f->next_req, DSV4_STATUS_RESTARTING, "scheduler restarting",
            g->tag);
        return;
    }
    if (g->prompt != NULL && strcmp(g->prompt, "__count__") == 0) {
        char text[32];
        int n = 0;

        for (int i = 0; i < FAKE_MAX_REQS; i++)
            n += f->reqs[i].live;
        snprintf(text, sizeof(text), "live %d", n);
        send_error(f, from, g->id, 0, DSV4_STATUS_NOT_SUPPORTED, text, g->tag);
        return;
    }
    for (int i = 0; i < FAKE_MAX_REQS && r == NULL; i++) {
        if (!f->reqs[i].live)
            r = &f->reqs[i];
    }
    if (r == NULL) {
        send_error(f, from, g->id, 0, DSV4_STATUS_BUSY, "too many requests", g->tag);
        return;
    }
    r->live = true;
    r->route = *from;
    r->id = g->id;
    r->req = ++f->next_req;
    r->text = g->prompt != NULL;
    r->n_src = r->text ? (uint32_t)strlen(g->prompt) : g->n_tokens;
    r->src = malloc(r->n_src * sizeof(int32_t));
    for (uint32_t i = 0; i < r->n_src; i++)
        r->src[i] = r->text ? (uint8_t)g->prompt[i] : g->tokens[i];
    r->max_tokens = g->max_tokens;
    if (g->n_stop_ids > 0)
        memcpy(r->stop_ids, g->stop_ids, g->n_stop_ids * sizeof(int32_t));
    r->n_stop_ids = g->n_stop_ids;
    r->logprobs = g->s.logprobs;
    r->top = g->s.top_logprobs;
    r->stream = g->stream;
    r->stall = r->text && strcmp(g->prompt, "__stall__") == 0;
    r->deadline_ms = g->timeout_ms > 0 ? dsv4_now_ms() + g->timeout_ms : 0;
    r->tag = g->tag != NULL ? strdup(g->tag) : NULL;
    if (g->resume != NULL && !resume_ok(r, g)) {
        send_error(f, from, g->id, 0, DSV4_STATUS_BAD_ARGUMENT,
            "resume is not this request's output so far", g->tag);
        req_free(r);
        return;
    }
    if (!r->stream) {
        r->acc = malloc(r->max_tokens * sizeof(int32_t));
        r->acc_lp = malloc(r->max_tokens * sizeof(float));
        r->acc_text = calloc(1, (size_t)r->max_tokens * FAKE_TEXT_MAX + 1);
    }
    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_OK);
    m.u.ok.id = r->id;
    m.u.ok.req = r->req;
    m.u.ok.tag = r->tag;
    m.u.ok.seed = FAKE_SEED;
    m.u.ok.has_seed = !(r->text && strcmp(g->prompt, "__noseed__") == 0);
    (void)dsv4_zsock_send(f->sock, from, &m, ZMQ_DONTWAIT, NULL);
}

static struct fake_req *
find(struct fake *f, const struct dsv4_route *from, uint64_t id)
{
    for (int i = 0; i < FAKE_MAX_REQS; i++) {
        struct fake_req *r = &f->reqs[i];

        if (r->live && r->id == id && r->route.len == from->len &&
            memcmp(r->route.id, from->id, from->len) == 0)
            return r;
    }
    return NULL;
}

static void
dispatch(struct fake *f)
{
    struct dsv4_route from;
    struct dsv4_perr pe;
    struct dsv4_msg m;
    struct fake_req *r;
    enum dsv4_err e;

    e = dsv4_zsock_recv(f->sock, &from, &m, &pe, ZMQ_DONTWAIT);
    if (e == DSV4_ERR_PROTO || e == DSV4_ERR_INVAL) {
        (void)dsv4_zsock_send_perr(f->sock, &from, &pe);
        return;
    }
    if (e != DSV4_OK)
        return;
    if (m.sub != DSV4_SUB_CLI) {
        send_error(f, &from, 0, 0, DSV4_STATUS_BAD_MESSAGE, "not a client message", NULL);
    } else if (m.cmd == DSV4_CLI_GENERATE) {
        on_generate(f, &from, &m.u.generate);
    } else if (m.cmd == DSV4_CLI_CANCEL) {
        if ((r = find(f, &from, m.u.cancel.id)) != NULL)
            send_done(f, r, DSV4_FINISH_CANCELLED);
        else
            send_error(f, &from, m.u.cancel.id, 0, DSV4_STATUS_NOT_FOUND, "no such request",
                NULL);
    } else if (m.cmd == DSV4_CLI_HEARTBEAT) {
        struct dsv4_msg hb;

        dsv4_msg_init(&hb, DSV4_SUB_CLI, DSV4_CLI_HEARTBEAT);
        (void)dsv4_zsock_send(f->sock, &from, &hb, ZMQ_DONTWAIT, NULL);
    } else {
        send_error(f, &from, 0, 0, DSV4_STATUS_BAD_MESSAGE, "unexpected command", NULL);
    }
    dsv4_msg_clear(&m);
}

/* One token for every live request. */
static void
step(struct fake *f)
{
    int64_t now = dsv4_now_ms();

    for (int i = 0; i < FAKE_MAX_REQS; i++) {
        struct fake_req *r = &f->reqs[i];
        char piece[FAKE_TEXT_MAX];
        int32_t tok;
        float lp;
        bool stop = false;

        if (!r->live || r->stall)
            continue;
        if (r->deadline_ms != 0 && now >= r->deadline_ms) {
            send_error(f, &r->route, r->id, r->req, DSV4_STATUS_TIMEOUT, "request timed out",
                r->tag);
            req_free(r);
            continue;
        }
        tok = r->src[r->emitted % r->n_src];
        lp = -(float)r->emitted / 8;
        fake_piece(r, tok, piece);
        for (uint32_t k = 0; k < r->n_stop_ids; k++)
            stop |= r->stop_ids[k] == tok;
        if (r->stream) {
            struct dsv4_msg m;

            dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_TOKENS);
            m.u.tokens.id = r->id;
            m.u.tokens.req = r->req;
            m.u.tokens.tokens = &tok;
            m.u.tokens.logprobs = r->logprobs ? &lp : NULL;
            m.u.tokens.n_tokens = 1;
            m.u.tokens.text = piece;
            if (r->top > 0) {
                static int32_t top_ids[DSV4_PROTO_MAX_TOP_LOGPROBS];
                static float top_lp[DSV4_PROTO_MAX_TOP_LOGPROBS];
                static uint64_t top_n;

                top_n = r->emitted % 2 == 0 ? r->top : 0;
                for (uint32_t j = 0; j < top_n; j++) {
                    top_ids[j] = tok + 1000 * (int32_t)j;
                    top_lp[j] = lp - (float)j;
                }
                m.u.tokens.top.top_n = &top_n;
                m.u.tokens.top.top_ids = top_n > 0 ? top_ids : NULL;
                m.u.tokens.top.top_logprobs = top_n > 0 ? top_lp : NULL;
                m.u.tokens.top.n_top = (uint32_t)top_n;
            }
            (void)dsv4_zsock_send(f->sock, &r->route, &m, ZMQ_DONTWAIT, NULL);
        } else {
            r->acc[r->emitted] = tok;
            r->acc_lp[r->emitted] = lp;
            memcpy(r->acc_text + r->acc_text_len, piece, strlen(piece) + 1);
            r->acc_text_len += strlen(piece);
        }
        r->emitted++;
        if (stop)
            send_done(f, r, DSV4_FINISH_STOP);
        else if (r->emitted == r->max_tokens)
            send_done(f, r, DSV4_FINISH_LENGTH);
    }
}

int
fake_sched_run(const char *endpoint, atomic_int *stop)
{
    struct dsv4_zsock_cfg cfg;
    struct fake *f = calloc(1, sizeof(*f));
    void *ctx = zmq_ctx_new();

    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = endpoint;
    cfg.type = ZMQ_ROUTER;
    cfg.bind = true;
    cfg.curve = DSV4_CURVE_OFF;
    if ((f->sock = dsv4_zsock_open(ctx, &cfg, NULL)) == NULL) {
        fprintf(stderr, "fake_sched: %s\n", dsv4_errmsg());
        zmq_ctx_term(ctx);
        free(f);
        return 1;
    }
    while (!atomic_load(stop)) {
        zmq_pollitem_t it = { f->sock, 0, ZMQ_POLLIN, 0 };

        if (zmq_poll(&it, 1, FAKE_TICK_MS) > 0)
            dispatch(f);
        else
            step(f);
    }
    for (int i = 0; i < FAKE_MAX_REQS; i++)
        req_free(&f->reqs[i]);
    dsv4_zsock_close(f->sock);
    zmq_ctx_term(ctx);
    free(f);
    return 0;
}
