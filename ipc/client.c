/*
 * client.c — libdsv4client (see dsv4/client.h): a DEALER connection to the
 * scheduler's client endpoint carrying many requests.
 *
 * DESIGN: each connection owns its ZeroMQ context and socket and a small
 * table of requests in flight (id, deadline).  dsv4_client_next() is the only
 * place that reads: it returns locally made final events first (a request's
 * deadline passed without an answer, or the server fell silent), then waits
 * on the socket until an event for a tracked request arrives, sending
 * HEARTBEAT after HB_IDLE_MS of silence.  Messages for ids no longer tracked
 * (e.g. after a local timeout) and malformed messages are dropped.
 *
 * Resume (docs/protocol.md §4.6): every request keeps a copy of its
 * GENERATE, the seed its OK named, and the tokens and text bytes it got.  A
 * socket monitor reports when the connection to the scheduler drops; when
 * it is up again (a restarted scheduler: systemd or dsv4-launch kept the
 * listener), each request in flight is sent again with `resume`, so it goes
 * on where it was: its caller sees neither a second ACCEPTED nor a token
 * twice.  (A connection that only blipped reaches the same scheduler under
 * a new routing id; it cancels the old copies when it cannot send to them.)
 * A request that cannot go on exactly (its OK named no seed, its output
 * could not be noted, its resend did not fit the pipe) ends with a 504
 * ERROR instead of waiting for an answer that will not come; one cancelled
 * while the connection was down is cancelled again under its new wire id.
 * A message of an older wire id of a request in flight (its GENERATE was
 * also queued on the socket before the drop was seen, so it reached the new
 * scheduler twice) is answered with a CANCEL of that copy.  A scheduler
 * that stops while its ranks serve on answers what it still holds with 302
 * (since 1.3): such a request stays in flight and is resumed the same way
 * on the next scheduler.
 */
#include "dsv4/client.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "common/err.h"
#include "ipc/proto.h"
#include "ipc/zsock.h"

#define DEFAULT_CONNECT_TIMEOUT_MS 5000
#define HB_IDLE_MS 1000            /* silence before we send HEARTBEAT */
#define TIMEOUT_GRACE_MS 1000      /* wait this long past timeout_ms for the server's 408 */
#define ERRMSG_LEN 256
#define RESUME_ID_SHIFT 48         /* a resumed request's wire id (ids stay < 2^48) */
/* the monitor's events of a refused handshake (a CURVE key that is not the
 * server's): the connect check's 504 says so */
#define CLIENT_HANDSHAKE_EVENTS                                                     \
    (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |    \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

_Static_assert((int)DSV4_CLIENT_FINISH_STOP == (int)DSV4_FINISH_STOP, "finish values");
_Static_assert((int)DSV4_CLIENT_FINISH_LENGTH == (int)DSV4_FINISH_LENGTH, "finish values");
_Static_assert((int)DSV4_CLIENT_FINISH_CANCELLED == (int)DSV4_FINISH_CANCELLED, "finish values");
_Static_assert((int)DSV4_CLIENT_UNREACHABLE == (int)DSV4_STATUS_UNREACHABLE, "codes");
_Static_assert((int)DSV4_CLIENT_BAD_ARGUMENT == (int)DSV4_STATUS_BAD_ARGUMENT, "codes");
/* A 1.3 caller's params end at timeout_ms plus the struct's tail padding:
 * fields added later lie past that, or its padding bytes would be read. */
_Static_assert(offsetof(struct dsv4_client_params, top_logprobs) >=
               (offsetof(struct dsv4_client_params, timeout_ms) + sizeof(uint32_t) +
                _Alignof(struct dsv4_client_params) - 1) /
               _Alignof(struct dsv4_client_params) * _Alignof(struct dsv4_client_params),
               "a field added to dsv4_client_params overlaps the 1.3 struct's padding");

/* A request in flight. */
struct creq {
    uint64_t id;          /* client id */
    uint64_t req;         /* scheduler id; 0 until OK */
    int64_t deadline_ms;  /* local give-up time; 0 = none */
    /* For a resume: the GENERATE as sent (pointing at the copies below),
     * whether an OK came, and what arrived. */
    struct dsv4_cli_generate g;
    char *prompt, *tag, **stop;
    int32_t *tokens, *stop_ids;
    bool accepted;
    int32_t *got;         /* output tokens received */
    uint32_t n_got, cap_got;
    uint64_t got_text;    /* bytes of output text received */
    bool lost_output;     /* out of memory noting it: no resume */
    uint32_t n_resumes;   /* wire id = id + n_resumes << RESUME_ID_SHIFT */
    bool cancelled;       /* dsv4_client_cancel asked: a resume cancels it again */
    bool orphan;          /* the connection dropped and it could not be resumed:
                             next() ends it with 504 */
    bool parked;          /* answered 302: waits for the next scheduler (its
                             CANCEL is not sent: next() ends it locally) */
    bool resent;          /* resumed, and the next scheduler's OK not yet come:
                             a refusal now is of the resend (504) */
};

struct dsv4_client {
    void *ctx;                   /* own ZeroMQ context */
    void *sock;                  /* DEALER */
    int conn_timeout_ms;         /* 0 = no loss detection */
    uint64_t next_id;            /* last id handed out */
    struct creq *reqs;           /* in flight, unordered */
    size_t n_reqs, cap_reqs;
    int64_t last_rx_ms;          /* last message from the server */
    int64_t last_hb_ms;          /* last HEARTBEAT we sent */
    struct dsv4_msg cur;         /* decoded message behind the last event */
    bool ev_tokens;              /* the last event was c->cur's TOKENS */
    uint32_t *top_off;           /* (n_tokens + 1) where its token i's most likely
                                    tokens start in cur's top arrays */
    size_t cap_top_off;
    char ev_msg[ERRMSG_LEN];     /* message of a locally made ERROR event */
    char ev_tag[DSV4_PROTO_MAX_TAG + 1];  /* its request's tag */
    char errmsg[ERRMSG_LEN];     /* detail of the last failure */
    void *mon;                   /* PAIR: the DEALER's monitor events; NULL = none */
    bool down;                   /* the connection dropped; resume when it is up */
    bool handshake_failed;       /* the connect check saw a handshake refused */
};

/* The detail of this thread's last failed connect (dsv4_client_errmsg(NULL)):
 * the connection it was written into is gone. */
static _Thread_local char connect_errmsg[ERRMSG_LEN];

static int
fail(struct dsv4_client *c, int code, const char *msg)
{
    if (c != NULL)
        snprintf(c->errmsg, sizeof(c->errmsg), "%s", msg);
    return code;
}

static int
code_of(enum dsv4_err e)
{
    return e == DSV4_OK ? DSV4_CLIENT_OK : dsv4_proto_code_from_err(e);
}

/* Free what a request's copy of its GENERATE owns. */
static void
req_free_copy(struct creq *r)
{
    free(r->prompt);
    free(r->tokens);
    for (uint32_t i = 0; r->stop != NULL && i < r->g.n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->stop_ids);
    free(r->tag);
    free(r->got);
}

void
dsv4_client_version(int *major, int *minor, int *patch)
{
    if (major != NULL)
        *major = DSV4_CLIENT_VERSION_MAJOR;
    if (minor != NULL)
        *minor = DSV4_CLIENT_VERSION_MINOR;
    if (patch != NULL)
        *patch = DSV4_CLIENT_VERSION_PATCH;
}

const char *
dsv4_client_strerror(int code)
{
    if (code == DSV4_CLIENT_OK)
        return "success";
    if (code == DSV4_CLIENT_NONE)
        return "no event";
    return dsv4_proto_code_str((uint16_t)(code < 0 || code > 999 ? 0 : code));
}

void
dsv4_client_opts_init(struct dsv4_client_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->size = sizeof(*o);
    o->connect_timeout_ms = DEFAULT_CONNECT_TIMEOUT_MS;
}

void
dsv4_client_params_init(struct dsv4_client_params *p)
{
    memset(p, 0, sizeof(*p));
    p->size = sizeof(*p);
    p->temperature = DSV4_PROTO_DEFAULT_TEMPERATURE;
    p->top_p = DSV4_PROTO_DEFAULT_TOP_P;
    p->max_tokens = DSV4_PROTO_DEFAULT_MAX_TOKENS;
    p->stream = 1;
}

/* Send CANCEL of wire id `wire`, not waiting: a full pipe drops it. */
static enum dsv4_err
send_cancel(struct dsv4_client *c, uint64_t wire)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_CANCEL);
    m.u.cancel.id = wire;
    return dsv4_zsock_send(c->sock, NULL, &m, ZMQ_DONTWAIT, NULL);
}

/* Whether `r` can go on exactly on another scheduler: not without the
 * tokens it got, nor with tokens but no seed (an OK that named none: the
 * field is optional). */
static bool
resumable(const struct creq *r)
{
    /* (the wire id's resume count must not wrap to an older id's) */
    return !r->lost_output && (r->n_got == 0 || r->g.s.has_seed) &&
        r->n_resumes < (UINT64_C(1) << (64 - RESUME_ID_SHIFT)) - 1;
}

/* Send every request in flight again, with what it got as `resume`
 * (docs/protocol.md §4.6): the connection is up again after a drop. */
static void
resume_all(struct dsv4_client *c)
{
    int64_t now = dsv4_now_ms();

    for (size_t i = 0; i < c->n_reqs; i++) {
        struct creq *r = &c->reqs[i];
        struct dsv4_msg m;

        /* one that cannot go on exactly: next() ends it */
        if (!resumable(r)) {
            r->orphan = true;
            continue;
        }
        /* A new id on the wire: whatever the scheduler that went away still
         * had in the pipe for the old one is dropped as unknown. */
        r->g.id = r->id + ((uint64_t)++r->n_resumes << RESUME_ID_SHIFT);
        dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_GENERATE);
        m.u.generate = r->g;
        if (r->n_got > 0) {
            m.u.generate.resume = r->got;
            m.u.generate.n_resume = r->n_got;
            m.u.generate.resume_text = r->got_text;
            m.u.generate.has_resume_text = true;
        }
        if (r->deadline_ms != 0) {
            int64_t left = r->deadline_ms - TIMEOUT_GRACE_MS - now;

            m.u.generate.timeout_ms = left > 1 ? (uint32_t)left : 1;
        }
        if (dsv4_zsock_send(c->sock, NULL, &m, ZMQ_DONTWAIT, NULL) != DSV4_OK) {
            r->orphan = true;           /* a full pipe (or no memory): next() ends it */
            continue;
        }
        r->parked = false;
        r->resent = true;
        if (r->cancelled)
            send_cancel(c, r->g.id);
    }
}

static int
send_heartbeat(struct dsv4_client *c)
{
    struct dsv4_msg m;
    enum dsv4_err e;

    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_HEARTBEAT);
    e = dsv4_zsock_send(c->sock, NULL, &m, ZMQ_DONTWAIT, NULL);
    c->last_hb_ms = dsv4_now_ms();
    /* A full pipe means the server is not reading; loss detection handles it. */
    return e == DSV4_OK || e == DSV4_ERR_BUSY ? 0 : fail(c, code_of(e), dsv4_errmsg());
}

/* Read the monitor's events: a drop marks the connection down; the next
 * connect resumes the requests in flight. */
static void
mon_read(struct dsv4_client *c)
{
    int ev;

    while ((ev = dsv4_zsock_mon_next(c->mon)) >= 0) {
        if (ev == ZMQ_EVENT_DISCONNECTED) {
            c->down = true;
        } else if (ev == ZMQ_EVENT_CONNECTED && c->down) {
            c->down = false;
            resume_all(c);
            /* a heartbeat lost with the old connection is not the new
             * server's silence: a fresh one, answered by the new server */
            (void)send_heartbeat(c);
        }
    }
}

/* Connect check: send HEARTBEAT and wait for any answer.  The HEARTBEAT
 * goes again on each new connection and after each HB_IDLE_MS without an
 * answer: one written to a scheduler that died under it (kill -9 while
 * the client connected) was lost with it, and the check waited out its
 * whole timeout while the next scheduler served. */
static int
await_server(struct dsv4_client *c, int timeout_ms)
{
    int64_t end = dsv4_now_ms() + timeout_ms;
    int rc;

    if ((rc = send_heartbeat(c)) != 0)
        return rc;
    for (;;) {
        zmq_pollitem_t it[2] = { { c->sock, 0, ZMQ_POLLIN, 0 }, { c->mon, 0, ZMQ_POLLIN, 0 } };
        int64_t now = dsv4_now_ms(), left = end - now, resend = c->last_hb_ms + HB_IDLE_MS;
        bool connected = false;
        struct dsv4_perr pe;
        enum dsv4_err e;
        enum dsv4_sub sub;
        int ev;

        if (left <= 0)
            return fail(c, DSV4_CLIENT_UNREACHABLE, c->handshake_failed ?
                "the CURVE handshake with the server failed: its key is not the one given "
                "(server_key / server_key_file), or it does not use CURVE" :
                "server did not answer within the connection timeout");
        if (now >= resend) {
            if ((rc = send_heartbeat(c)) != 0)
                return rc;
            continue;
        }
        if (zmq_poll(it, 2, (long)(resend - now < left ? resend - now : left)) < 0) {
            if (zmq_errno() == EINTR)
                continue;               /* a signal: wait on */
            return fail(c, DSV4_CLIENT_INTERNAL, zmq_strerror(zmq_errno()));
        }
        /* a handshake refused: the reason, once no answer came */
        while ((it[1].revents & ZMQ_POLLIN) && (ev = dsv4_zsock_mon_next(c->mon)) >= 0) {
            if (ev & CLIENT_HANDSHAKE_EVENTS)
                c->handshake_failed = true;
            connected = connected || ev == ZMQ_EVENT_CONNECTED;
        }
        if (connected && (rc = send_heartbeat(c)) != 0)
            return rc;
        if (!(it[0].revents & ZMQ_POLLIN))
            continue;
        e = dsv4_zsock_recv(c->sock, NULL, &c->cur, &pe, ZMQ_DONTWAIT);
        sub = c->cur.sub;
        dsv4_msg_clear(&c->cur);
        if (e == DSV4_OK && sub != DSV4_SUB_CLI) {
            /* an admin or rank endpoint answered (the scheduler's RESULT
             * 400, a DISCONNECT): the connect had succeeded, and every
             * request then waited for ever */
            char msg[200];

            snprintf(msg, sizeof(msg), "the server answers in %s, not DSV4C1: not a client "
                     "endpoint (the scheduler's admin_endpoint or rank_endpoint?)",
                     dsv4_proto_sig(sub));
            return fail(c, DSV4_CLIENT_NOT_SUPPORTED, msg);
        }
        if (e == DSV4_OK) {
            c->last_rx_ms = dsv4_now_ms();
            return 0;
        }
        if (e == DSV4_ERR_SYS)
            return fail(c, DSV4_CLIENT_INTERNAL, dsv4_errmsg());
    }
}

int
dsv4_client_connect(const char *endpoint, const struct dsv4_client_opts *opts,
    struct dsv4_client **out)
{
    struct dsv4_client_opts o;
    struct dsv4_zsock_cfg cfg;
    char key[DSV4_ZSOCK_Z85_LEN + 1];
    struct dsv4_client *c;
    enum dsv4_err e;
    int rc;

    connect_errmsg[0] = '\0';
    if (out == NULL || endpoint == NULL) {
        snprintf(connect_errmsg, sizeof(connect_errmsg), "no endpoint or no place for the "
            "connection");
        return DSV4_CLIENT_BAD_ARGUMENT;
    }
    *out = NULL;
    dsv4_client_opts_init(&o);
    if (opts != NULL)
        memcpy(&o, opts, opts->size < sizeof(o) ? opts->size : sizeof(o));
    if ((c = calloc(1, sizeof(*c))) == NULL) {
        snprintf(connect_errmsg, sizeof(connect_errmsg), "out of memory");
        return DSV4_CLIENT_NO_MEMORY;
    }
    if ((c->ctx = zmq_ctx_new()) == NULL) {
        snprintf(connect_errmsg, sizeof(connect_errmsg), "zmq_ctx_new: %s",
            zmq_strerror(zmq_errno()));
        free(c);
        return DSV4_CLIENT_INTERNAL;
    }
    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = endpoint;
    cfg.type = ZMQ_DEALER;
    cfg.bind = false;
    cfg.curve = DSV4_CURVE_OFF;
    if (o.server_key != NULL || o.server_key_file != NULL) {
        cfg.curve = DSV4_CURVE_ON;
        if (o.server_key == NULL) {
            if ((e = dsv4_zsock_key_read(o.server_key_file, key)) != DSV4_OK) {
                rc = fail(c, DSV4_CLIENT_BAD_ARGUMENT, dsv4_errmsg());
                goto err;
            }
            cfg.server_key = key;
        } else {
            cfg.server_key = o.server_key;
        }
    }
    /* the caller's mistakes are 401 with the reason, not a 500 from the
     * socket calls that trip on them */
    if (endpoint[0] == '@') {   /* dsv4_zsock's "bind here" mark */
        rc = fail(c, DSV4_CLIENT_BAD_ARGUMENT, "a client connects: no '@' before the endpoint");
        goto err;
    }
    if (strncmp(endpoint, "inproc://", 9) == 0) {   /* (the context is the library's own) */
        rc = fail(c, DSV4_CLIENT_BAD_ARGUMENT, "inproc:// cannot reach a server: the "
            "connection has a ZeroMQ context of its own; use ipc:// or tcp://");
        goto err;
    }
    if (dsv4_zsock_check(&cfg) != DSV4_OK) {   /* the endpoint's form */
        rc = fail(c, DSV4_CLIENT_BAD_ARGUMENT, dsv4_errmsg());
        goto err;
    }
    if (cfg.server_key != NULL && strlen(cfg.server_key) != DSV4_ZSOCK_Z85_LEN) {
        rc = fail(c, DSV4_CLIENT_BAD_ARGUMENT, "server key is not 40 Z85 characters");
        goto err;
    }
    if ((c->sock = dsv4_zsock_open(c->ctx, &cfg, &e)) == NULL) {
        rc = fail(c, e == DSV4_ERR_CONFIG ? DSV4_CLIENT_BAD_ARGUMENT : code_of(e),
            dsv4_errmsg());
        goto err;
    }
    /* Without the monitor a restarted scheduler would go unnoticed and the
     * requests in flight would wait forever: the connection is refused. */
    c->mon = dsv4_zsock_mon_open(c->ctx, c->sock, ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED |
        CLIENT_HANDSHAKE_EVENTS);
    if (c->mon == NULL) {
        rc = fail(c, DSV4_CLIENT_INTERNAL, "cannot watch the connection (socket monitor)");
        goto err;
    }
    c->conn_timeout_ms = o.connect_timeout_ms > 0 ? o.connect_timeout_ms : 0;
    c->last_rx_ms = c->last_hb_ms = dsv4_now_ms();
    if (c->conn_timeout_ms > 0 && (rc = await_server(c, c->conn_timeout_ms)) != 0)
        goto err;
    *out = c;
    return 0;
err:
    snprintf(connect_errmsg, sizeof(connect_errmsg), "%s", c->errmsg);
    dsv4_client_close(c);
    return rc;
}

void
dsv4_client_close(struct dsv4_client *c)
{
    if (c == NULL)
        return;
    dsv4_msg_clear(&c->cur);
    for (size_t i = 0; i < c->n_reqs; i++)
        req_free_copy(&c->reqs[i]);
    dsv4_zsock_mon_close(c->sock, c->mon);
    dsv4_zsock_close(c->sock);
    zmq_ctx_term(c->ctx);
    free(c->reqs);
    free(c->top_off);
    free(c);
}

static struct creq *
req_find(struct dsv4_client *c, uint64_t id)
{
    for (size_t i = 0; i < c->n_reqs; i++) {
        if (c->reqs[i].id == id)
            return &c->reqs[i];
    }
    return NULL;
}

/* The request whose GENERATE on the wire had `id` (the caller's id, or
 * after a resume the one that resume used). */
static struct creq *
req_find_wire(struct dsv4_client *c, uint64_t id)
{
    for (size_t i = 0; i < c->n_reqs; i++) {
        if (c->reqs[i].g.id == id)
            return &c->reqs[i];
    }
    return NULL;
}

static void
req_remove(struct dsv4_client *c, struct creq *r)
{
    req_free_copy(r);
    *r = c->reqs[--c->n_reqs];
}

/* Copy g's strings and arrays into r (r->g points at the copies); false
 * when out of memory (what was copied is freed by req_free_copy). */
static bool
req_copy(struct creq *r, const struct dsv4_cli_generate *g)
{
    memset(r, 0, sizeof(*r));
    r->g = *g;
    r->g.n_stop = 0;
    if (g->prompt != NULL && (r->prompt = strdup(g->prompt)) == NULL)
        return false;
    if (g->tokens != NULL) {
        if ((r->tokens = malloc((size_t)g->n_tokens * sizeof(int32_t))) == NULL)
            return false;
        memcpy(r->tokens, g->tokens, (size_t)g->n_tokens * sizeof(int32_t));
    }
    if (g->n_stop > 0) {
        if ((r->stop = calloc(g->n_stop, sizeof(*r->stop))) == NULL)
            return false;
        for (uint32_t i = 0; i < g->n_stop; i++) {
            if ((r->stop[i] = strdup(g->stop[i])) == NULL)
                return false;
            r->g.n_stop++;
        }
    }
    if (g->n_stop_ids > 0) {
        if ((r->stop_ids = malloc((size_t)g->n_stop_ids * sizeof(int32_t))) == NULL)
            return false;
        memcpy(r->stop_ids, g->stop_ids, (size_t)g->n_stop_ids * sizeof(int32_t));
    }
    if (g->tag != NULL && (r->tag = strdup(g->tag)) == NULL)
        return false;
    r->g.prompt = r->prompt;
    r->g.tokens = r->tokens;
    r->g.stop = (const char *const *)r->stop;
    r->g.stop_ids = r->stop_ids;
    r->g.tag = r->tag;
    return true;
}

/* Note n output tokens and `text` of request r. */
static void
req_got(struct creq *r, const int32_t *t, uint32_t n, const char *text)
{
    if (r->lost_output)
        return;
    /* more than it asked for: a server's fault; not noted (no resume) */
    if ((uint64_t)r->n_got + n > r->g.max_tokens) {
        r->lost_output = true;
        return;
    }
    if (r->n_got + n > r->cap_got) {
        uint32_t cap = r->cap_got != 0 ? r->cap_got : 64;
        int32_t *v;

        while (cap < r->n_got + n)
            cap *= 2;
        if ((v = realloc(r->got, (size_t)cap * sizeof(*v))) == NULL) {
            r->lost_output = true;     /* cannot be resumed any more */
            return;
        }
        r->got = v;
        r->cap_got = cap;
    }
    memcpy(r->got + r->n_got, t, (size_t)n * sizeof(*t));
    r->n_got += n;
    r->got_text += strlen(text);
}

static int
submit(struct dsv4_client *c, const char *prompt, const int32_t *ids, size_t n_ids,
    const struct dsv4_client_params *params, uint64_t *id)
{
    struct dsv4_client_params p;
    struct dsv4_cli_generate *g;
    struct dsv4_perr pe;
    struct dsv4_msg m;
    struct creq *q;
    enum dsv4_err e;

    if (c == NULL)
        return DSV4_CLIENT_BAD_ARGUMENT;
    dsv4_client_params_init(&p);
    if (params != NULL)
        memcpy(&p, params, params->size < sizeof(p) ? params->size : sizeof(p));
    if (n_ids > DSV4_PROTO_MAX_PROMPT_TOKENS || p.n_stop > DSV4_PROTO_MAX_STOP ||
        p.n_stop_ids > DSV4_PROTO_MAX_STOP_IDS)
        return fail(c, DSV4_CLIENT_TOO_LARGE, "too many prompt ids, stop strings or stop ids");
    if (c->n_reqs == c->cap_reqs) {
        size_t cap = c->cap_reqs == 0 ? 16 : 2 * c->cap_reqs;
        struct creq *r = realloc(c->reqs, cap * sizeof(*r));

        if (r == NULL)
            return fail(c, DSV4_CLIENT_NO_MEMORY, "out of memory");
        c->reqs = r;
        c->cap_reqs = cap;
    }
    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_GENERATE);
    g = &m.u.generate;
    g->id = c->next_id + 1;
    g->prompt = prompt;
    g->tokens = ids;
    g->n_tokens = (uint32_t)n_ids;
    g->s.temperature = p.temperature;
    g->s.top_p = p.top_p;
    g->s.top_k = p.top_k;
    g->s.seed = p.seed;
    g->s.has_seed = p.has_seed != 0;
    g->s.logprobs = p.logprobs != 0;
    g->s.top_logprobs = p.top_logprobs;
    g->max_tokens = p.max_tokens;
    g->stop = p.n_stop > 0 ? p.stop : NULL;
    g->n_stop = (uint32_t)p.n_stop;
    g->stop_ids = p.n_stop_ids > 0 ? p.stop_ids : NULL;
    g->n_stop_ids = (uint32_t)p.n_stop_ids;
    g->stream = p.stream != 0;
    g->tag = p.tag;
    g->timeout_ms = p.timeout_ms;
    if ((g->stop == NULL && p.n_stop > 0) || (g->stop_ids == NULL && p.n_stop_ids > 0))
        return fail(c, DSV4_CLIENT_BAD_ARGUMENT, "stop arrays are NULL");
    for (size_t i = 0; i < p.n_stop; i++) {
        if (p.stop[i] == NULL)
            return fail(c, DSV4_CLIENT_BAD_ARGUMENT, "a stop string is NULL");
    }
    /* A drop or reconnect not yet seen is handled first, so the requests
     * it resumes go out before this one and this one is not resumed. */
    mon_read(c);
    memset(&pe, 0, sizeof(pe));
    q = &c->reqs[c->n_reqs];
    if (!req_copy(q, g)) {
        req_free_copy(q);
        return fail(c, DSV4_CLIENT_NO_MEMORY, "out of memory");
    }
    /* Not waiting: a DEALER queues while no server is connected, and a
     * full queue would block the caller with no bound. */
    e = dsv4_zsock_send(c->sock, NULL, &m, ZMQ_DONTWAIT, &pe);
    if (e != DSV4_OK)
        req_free_copy(q);
    if (e == DSV4_ERR_INVAL && pe.code != 0)
        return fail(c, pe.code, pe.message);
    if (e == DSV4_ERR_BUSY)
        return fail(c, DSV4_CLIENT_BUSY, "the connection's send queue is full (the server "
            "is not connected or not reading); retry later");
    if (e != DSV4_OK)
        return fail(c, code_of(e), dsv4_errmsg());
    /* The server's silence counts from the first request in flight: an
     * idle connection hears nothing, and that is no loss. */
    if (c->n_reqs == 0)
        c->last_rx_ms = c->last_hb_ms = dsv4_now_ms();
    c->next_id++;
    q->id = g->id;
    q->req = 0;
    q->deadline_ms = p.timeout_ms > 0 ? dsv4_now_ms() + p.timeout_ms + TIMEOUT_GRACE_MS : 0;
    c->n_reqs++;
    if (id != NULL)
        *id = g->id;
    return 0;
}

int
dsv4_client_submit_text(struct dsv4_client *c, const char *prompt,
    const struct dsv4_client_params *params, uint64_t *id)
{
    if (prompt == NULL)
        return fail(c, DSV4_CLIENT_BAD_ARGUMENT, "prompt is NULL");
    return submit(c, prompt, NULL, 0, params, id);
}

int
dsv4_client_submit_tokens(struct dsv4_client *c, const int32_t *ids, size_t n_ids,
    const struct dsv4_client_params *params, uint64_t *id)
{
    if (ids == NULL || n_ids == 0)
        return fail(c, DSV4_CLIENT_BAD_ARGUMENT, "no prompt token ids");
    return submit(c, NULL, ids, n_ids, params, id);
}

int
dsv4_client_cancel(struct dsv4_client *c, uint64_t id)
{
    struct creq *r;
    enum dsv4_err e;

    if (c == NULL)
        return DSV4_CLIENT_BAD_ARGUMENT;
    mon_read(c);    /* a reconnect first: the cancel goes to the resumed copy */
    if ((r = req_find(c, id)) == NULL)
        return fail(c, DSV4_CLIENT_NOT_FOUND, "no such request in flight");
    r->cancelled = true;    /* a later resume cancels it again */
    if (r->parked)
        return 0;           /* no scheduler holds it: next() ends it (DONE cancelled) */
    if ((e = send_cancel(c, r->g.id)) == DSV4_ERR_BUSY)
        return fail(c, DSV4_CLIENT_BUSY, "the connection's send queue is full (the server "
            "is not connected or not reading); retry later");
    if (e != DSV4_OK)
        return fail(c, code_of(e), dsv4_errmsg());
    return 0;
}

size_t
dsv4_client_pending(const struct dsv4_client *c)
{
    return c == NULL ? 0 : c->n_reqs;
}

const char *
dsv4_client_errmsg(const struct dsv4_client *c)
{
    return c == NULL ? connect_errmsg : c->errmsg;
}

/* *ev (its tag set by the caller): DONE cancelled for `r`, a cancelled
 * request that no scheduler holds any more, with the tokens it got; `r` is
 * forgotten. */
static void
done_cancelled(struct dsv4_client *c, struct creq *r, struct dsv4_client_event *ev)
{
    ev->type = DSV4_CLIENT_EV_DONE;
    ev->id = r->id;
    ev->req = r->req;
    ev->finish = DSV4_CLIENT_FINISH_CANCELLED;
    ev->completion_tokens = r->n_got;
    req_remove(c, r);
}

/* A final ERROR made here: the request's deadline passed, or the server is
 * lost.  Returns true with *ev filled when one is due. */
static bool
local_event(struct dsv4_client *c, int64_t now, struct dsv4_client_event *ev)
{
    /* the server's silence, not the caller's: lost when a heartbeat it was
     * sent went unanswered for connect_timeout_ms (a caller away from
     * next() for longer sent none meanwhile) */
    bool lost = c->conn_timeout_ms > 0 && c->last_hb_ms > c->last_rx_ms &&
        now - c->last_hb_ms >= c->conn_timeout_ms;

    for (size_t i = 0; i < c->n_reqs; i++) {
        struct creq *r = &c->reqs[i];
        bool timed_out = r->deadline_ms != 0 && now >= r->deadline_ms;

        if (r->parked && r->cancelled && !lost) {
            /* cancelled while no scheduler holds it: ended here */
            memset(ev, 0, sizeof(*ev));
            if (r->tag != NULL) {
                snprintf(c->ev_tag, sizeof(c->ev_tag), "%s", r->tag);
                ev->tag = c->ev_tag;
            }
            done_cancelled(c, r, ev);
            return true;
        }
        if (!lost && !r->orphan && !timed_out)
            continue;
        memset(ev, 0, sizeof(*ev));
        ev->type = DSV4_CLIENT_EV_ERROR;
        ev->id = r->id;
        ev->req = r->req;
        ev->code = lost || r->orphan ? DSV4_CLIENT_UNREACHABLE : DSV4_CLIENT_TIMEOUT;
        snprintf(c->ev_msg, sizeof(c->ev_msg), "%s", lost ?
            "server did not answer (connection lost)" : r->orphan ?
            "the connection to the server dropped and the request could not be resumed" :
            "request timed out (no answer)");
        ev->message = c->ev_msg;
        if (r->tag != NULL) {
            snprintf(c->ev_tag, sizeof(c->ev_tag), "%s", r->tag);
            ev->tag = c->ev_tag;
        }
        if (!lost && !r->orphan)
            (void)send_cancel(c, r->g.id);  /* best effort: free the server side too */
        req_remove(c, r);
        return true;
    }
    return false;
}

/* Index c->cur's (a TOKENS) most likely tokens by token for
 * dsv4_client_event_top; false when it has none or there is no memory for
 * the index (the event then reports none). */
static bool
top_index(struct dsv4_client *c)
{
    const struct dsv4_cli_tokens *t = &c->cur.u.tokens;
    uint32_t n = t->n_tokens;

    if (t->top.top_n == NULL || t->top.top_ids == NULL)
        return false;
    if (c->cap_top_off < (size_t)n + 1) {
        uint32_t *o = realloc(c->top_off, ((size_t)n + 1) * sizeof(*o));

        if (o == NULL)
            return false;
        c->top_off = o;
        c->cap_top_off = (size_t)n + 1;
    }
    c->top_off[0] = 0;
    for (uint32_t i = 0; i < n; i++)   /* the decoder checked that they sum to n_top */
        c->top_off[i + 1] = c->top_off[i] + (uint32_t)t->top.top_n[i];
    return true;
}

size_t
dsv4_client_event_top(const struct dsv4_client *c, size_t i, const int32_t **ids,
    const float **logprobs)
{
    const struct dsv4_cli_tokens *t;

    if (ids != NULL)
        *ids = NULL;
    if (logprobs != NULL)
        *logprobs = NULL;
    if (c == NULL || !c->ev_tokens)
        return 0;
    t = &c->cur.u.tokens;
    if (i >= t->n_tokens || t->top.top_n[i] == 0)
        return 0;
    if (ids != NULL)
        *ids = t->top.top_ids + c->top_off[i];
    if (logprobs != NULL)
        *logprobs = t->top.top_logprobs + c->top_off[i];
    return (size_t)t->top.top_n[i];
}

/* Turn the decoded message in c->cur into an event; false when it is not
 * one the caller should see. */
static bool
to_event(struct dsv4_client *c, struct dsv4_client_event *ev)
{
    const struct dsv4_msg *m = &c->cur;
    struct creq *r;
    uint64_t id;

    memset(ev, 0, sizeof(*ev));
    c->ev_tokens = false;
    switch (m->cmd) {
    case DSV4_CLI_OK: id = m->u.ok.id; break;
    case DSV4_CLI_ERROR: id = m->u.error.id; break;
    case DSV4_CLI_TOKENS: id = m->u.tokens.id; break;
    case DSV4_CLI_DONE: id = m->u.done.id; break;
    default: return false; /* HEARTBEAT, or a command a server does not send */
    }
    r = req_find_wire(c, id);
    /* The OK of an older wire id of a request in flight: a second copy
     * running on the server (see the top of the file); cancel it. */
    if (r == NULL && m->cmd == DSV4_CLI_OK &&
        req_find(c, id & ((UINT64_C(1) << RESUME_ID_SHIFT) - 1)) != NULL)
        (void)send_cancel(c, id);
    if (r == NULL && !(m->cmd == DSV4_CLI_ERROR && id == 0))
        return false;
    ev->id = r != NULL ? r->id : 0;
    switch (m->cmd) {
    case DSV4_CLI_OK:
        r->req = m->u.ok.req;
        r->resent = false;      /* the resend taken: later errors are its own */
        if (m->u.ok.has_seed && !r->g.s.has_seed) {
            r->g.s.seed = m->u.ok.seed;     /* what a resume sends back */
            r->g.s.has_seed = true;
        }
        if (r->accepted)
            return false;                   /* a resumed request's: seen once */
        r->accepted = true;
        ev->type = DSV4_CLIENT_EV_ACCEPTED;
        ev->req = r->req;
        ev->tag = m->u.ok.tag;
        return true;
    case DSV4_CLI_TOKENS:
        req_got(r, m->u.tokens.tokens, m->u.tokens.n_tokens, m->u.tokens.text);
        ev->type = DSV4_CLIENT_EV_TOKENS;
        ev->req = m->u.tokens.req;
        ev->tokens = m->u.tokens.tokens;
        ev->logprobs = m->u.tokens.logprobs;
        ev->n_tokens = m->u.tokens.n_tokens;
        ev->text = m->u.tokens.text;
        c->ev_tokens = top_index(c);
        return true;
    case DSV4_CLI_DONE:
        ev->type = DSV4_CLIENT_EV_DONE;
        ev->req = m->u.done.req;
        ev->finish = m->u.done.finish;
        ev->prompt_tokens = m->u.done.prompt_tokens;
        ev->completion_tokens = m->u.done.completion_tokens;
        ev->tag = m->u.done.tag;
        req_remove(c, r);
        return true;
    default:
        /* 302: the scheduler stops while its ranks serve on.  The request
         * waits for the next scheduler, where resume_all sends it again
         * when the connection is back (or ends at its deadline, or with 504
         * when no scheduler comes); one that cannot go on exactly ends
         * here, with the 302. */
        if (r != NULL && m->u.error.code == DSV4_STATUS_RESTARTING && resumable(r)) {
            r->parked = true;
            return false;
        }
        if (r != NULL && r->cancelled && m->u.error.code == DSV4_STATUS_NOT_FOUND) {
            /* the CANCEL crossed a 302: the scheduler had let it go */
            ev->tag = m->u.error.tag;
            done_cancelled(c, r, ev);
            return true;
        }
        ev->type = DSV4_CLIENT_EV_ERROR;
        ev->req = m->u.error.req;
        ev->code = m->u.error.code;
        ev->message = m->u.error.message;
        ev->tag = m->u.error.tag;
        if (r != NULL && r->resent && r->accepted && m->u.error.code < DSV4_STATUS_INTERNAL) {
            /* the next scheduler refused the resend (busy, draining, a
             * bound of its own): the caller had output already and cannot
             * submit it again as it was, so it cannot go on: 504 */
            snprintf(c->ev_msg, sizeof(c->ev_msg), "the request could not be resumed on the "
                "restarted scheduler (%u: %s)", (unsigned)m->u.error.code,
                m->u.error.message != NULL ? m->u.error.message : "");
            ev->code = DSV4_CLIENT_UNREACHABLE;
            ev->message = c->ev_msg;
        }
        if (r != NULL)
            req_remove(c, r);
        return true;
    }
}

/* Read one message already waiting on the socket into an event: 1 when *ev
 * is one for the caller, 0 when a message was read but is none (or was
 * malformed), -1 when nothing waits, DSV4_CLIENT_INTERNAL on a socket
 * failure. */
static int
recv_ready(struct dsv4_client *c, struct dsv4_client_event *ev, int64_t now)
{
    struct dsv4_perr pe;
    enum dsv4_err e = dsv4_zsock_recv(c->sock, NULL, &c->cur, &pe, ZMQ_DONTWAIT);

    if (e == DSV4_ERR_BUSY)
        return -1;
    if (e == DSV4_ERR_SYS)
        return fail(c, DSV4_CLIENT_INTERNAL, dsv4_errmsg());
    if (e != DSV4_OK || c->cur.sub != DSV4_SUB_CLI) {
        dsv4_msg_clear(&c->cur);
        return 0;   /* malformed or another sub-protocol's: dropped, no sign of life */
    }
    c->last_rx_ms = now;
    if (to_event(c, ev))
        return 1;
    dsv4_msg_clear(&c->cur);
    return 0;
}

int
dsv4_client_next(struct dsv4_client *c, struct dsv4_client_event *ev, int timeout_ms)
{
    int64_t start = dsv4_now_ms(), now = start;
    unsigned dropped = 0;

    if (c == NULL || ev == NULL)
        return DSV4_CLIENT_BAD_ARGUMENT;
    dsv4_msg_clear(&c->cur);
    c->ev_tokens = false;
    for (;;) {
        zmq_pollitem_t its[2] = { { c->sock, 0, ZMQ_POLLIN, 0 }, { c->mon, 0, ZMQ_POLLIN, 0 } };
        zmq_pollitem_t *it = &its[0];
        int64_t wait = timeout_ms < 0 ? INT64_MAX : start + timeout_ms - now;
        int rc;

        /* what the server already sent first: a caller back after a long
         * pause gets those answers, not a loss or a timeout made here */
        rc = recv_ready(c, ev, now);
        if (rc == 1)
            return 0;
        if (rc == 0) {
            /* a message that is no event (a heartbeat's answer, a stale or
             * malformed one): read on, but a stream of them does not hold
             * the caller past its bound */
            if (++dropped % 64 == 0) {
                now = dsv4_now_ms();
                if (timeout_ms >= 0 && now - start >= timeout_ms)
                    return DSV4_CLIENT_NONE;
            }
            continue;
        }
        if (rc != -1)
            return rc;
        /* a heartbeat after HB_IDLE_MS of silence, one at a time: the loss
         * check counts from the one unanswered */
        if (c->n_reqs > 0 && now - c->last_rx_ms >= HB_IDLE_MS &&
            c->last_hb_ms <= c->last_rx_ms && (rc = send_heartbeat(c)) != 0)
            return rc;
        if (local_event(c, now, ev))
            return 0;
        if (c->n_reqs == 0)
            wait = 0; /* nothing to wait for; only drain stray messages */
        if (c->n_reqs > 0) {
            /* Wake up for the next heartbeat, deadline or loss check. */
            int64_t tick = HB_IDLE_MS;

            for (size_t i = 0; i < c->n_reqs; i++) {
                if (c->reqs[i].deadline_ms != 0 && c->reqs[i].deadline_ms - now < tick)
                    tick = c->reqs[i].deadline_ms - now;
            }
            if (tick < 0)
                tick = 0;
            if (tick < wait)
                wait = tick;
        }
        if (wait < 0)
            wait = 0;
        if (zmq_poll(its, c->mon != NULL ? 2 : 1, (long)wait) < 0) {
            if (zmq_errno() == EINTR)
                return DSV4_CLIENT_NONE;    /* a signal ended the wait */
            return fail(c, DSV4_CLIENT_INTERNAL, zmq_strerror(zmq_errno()));
        }
        now = dsv4_now_ms();
        if (c->mon != NULL && (its[1].revents & ZMQ_POLLIN))
            mon_read(c);
        if (it->revents & ZMQ_POLLIN)
            continue; /* read at the top of the loop */
        if (timeout_ms >= 0 && now - start >= timeout_ms)
            return DSV4_CLIENT_NONE;
        if (c->n_reqs == 0)
            return DSV4_CLIENT_NONE;
    }
}
