/*
 * test_client.c — libdsv4client against the stand-in scheduler
 * (fake_sched.c) running in a thread on ipc:// in a temporary directory:
 * connect, several requests in flight, text and token-id prompts, logprobs,
 * stop ids, non-streamed output, cancel, server-side and client-side
 * timeouts, refusals, local validation, an idle connection, a full send
 * queue, and a server that goes away or restarts (resume, a cancel while
 * it is away, a request that cannot be resumed, a request sent twice).
 */
#include <limits.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <zmq.h>

#include "dsv4/client.h"
#include "tests/ipc/fake_sched.h"

#define WAIT_MS 10000 /* generous bound per event; only guards against hangs */
#define MAX_OUT 4096
#define TOP_TOKENS 16   /* tokens whose most likely tokens an outcome keeps */
#define TOP_MAX 20      /* top_logprobs' bound (docs/protocol.md §4.1) */

struct server {
    char dir[64];
    char endpoint[128];
    atomic_int stop;
    pthread_t thread;
};

static void *
server_main(void *arg)
{
    struct server *s = arg;

    return (void *)(intptr_t)fake_sched_run(s->endpoint, &s->stop);
}

static int
server_start(void **state)
{
    struct server *s = calloc(1, sizeof(*s));

    snprintf(s->dir, sizeof(s->dir), "/tmp/dsv4-client-XXXXXX");
    if (mkdtemp(s->dir) == NULL)
        return -1;
    snprintf(s->endpoint, sizeof(s->endpoint), "ipc://%s/client.sock", s->dir);
    atomic_store(&s->stop, 0);
    if (pthread_create(&s->thread, NULL, server_main, s) != 0)
        return -1;
    *state = s;
    return 0;
}

static void
server_stop(struct server *s)
{
    if (atomic_exchange(&s->stop, 1) == 0)
        pthread_join(s->thread, NULL);
}

/* A new fake scheduler on the same endpoint (a restarted dsv4-sched). */
static void
server_restart(struct server *s)
{
    atomic_store(&s->stop, 0);
    assert_int_equal(pthread_create(&s->thread, NULL, server_main, s), 0);
}

static int
server_teardown(void **state)
{
    struct server *s = *state;
    char path[256];

    server_stop(s);
    snprintf(path, sizeof(path), "%s/client.sock", s->dir);
    unlink(path);
    rmdir(s->dir);
    free(s);
    return 0;
}

static struct dsv4_client *
connect_ok(struct server *s)
{
    struct dsv4_client *c = NULL;

    assert_int_equal(dsv4_client_connect(s->endpoint, NULL, &c), 0);
    assert_non_null(c);
    return c;
}

/* Everything one request produced. */
struct outcome {
    uint64_t id;
    bool accepted;
    int32_t tokens[MAX_OUT];
    float logprobs[MAX_OUT];
    size_t n_top[TOP_TOKENS]; /* dsv4_client_event_top of the first tokens */
    int32_t top_ids[TOP_TOKENS][TOP_MAX];
    float top_lp[TOP_TOKENS][TOP_MAX];
    size_t n_tokens, n_chunks;
    bool have_logprobs;
    char text[MAX_OUT];
    int final_type;           /* DONE or ERROR */
    int finish, code;
    uint32_t prompt_tokens, completion_tokens;
    char tag[64];
};

/* Collect events until every outcome in `o` has its final event. */
static void
collect(struct dsv4_client *c, struct outcome *o, size_t n)
{
    size_t open = n;

    while (open > 0) {
        struct dsv4_client_event ev;
        struct outcome *x = NULL;

        assert_int_equal(dsv4_client_next(c, &ev, WAIT_MS), 0);
        for (size_t i = 0; i < n; i++) {
            if (o[i].id == ev.id)
                x = &o[i];
        }
        assert_non_null(x);
        assert_int_equal(x->final_type, 0); /* nothing after the final event */
        switch (ev.type) {
        case DSV4_CLIENT_EV_ACCEPTED:
            assert_false(x->accepted);
            assert_int_equal(x->n_tokens, 0);
            assert_true(ev.req != 0);
            x->accepted = true;
            break;
        case DSV4_CLIENT_EV_TOKENS:
            assert_true(x->accepted);
            assert_true(x->n_tokens + ev.n_tokens <= MAX_OUT);
            memcpy(x->tokens + x->n_tokens, ev.tokens, ev.n_tokens * sizeof(int32_t));
            if (ev.logprobs != NULL) {
                memcpy(x->logprobs + x->n_tokens, ev.logprobs, ev.n_tokens * sizeof(float));
                x->have_logprobs = true;
            }
            for (size_t i = 0; i < ev.n_tokens; i++) {
                const int32_t *ti;
                const float *tl;
                size_t k = dsv4_client_event_top(c, i, &ti, &tl);

                assert_true(k <= TOP_MAX);
                if (x->n_tokens + i >= TOP_TOKENS)
                    continue;
                x->n_top[x->n_tokens + i] = k;
                if (k > 0) {
                    memcpy(x->top_ids[x->n_tokens + i], ti, k * sizeof(*ti));
                    memcpy(x->top_lp[x->n_tokens + i], tl, k * sizeof(*tl));
                }
            }
            /* out of range: none */
            assert_int_equal(dsv4_client_event_top(c, ev.n_tokens, NULL, NULL), 0);
            x->n_tokens += ev.n_tokens;
            x->n_chunks++;
            strncat(x->text, ev.text, sizeof(x->text) - strlen(x->text) - 1);
            break;
        case DSV4_CLIENT_EV_DONE:
            x->final_type = ev.type;
            x->finish = ev.finish;
            x->prompt_tokens = ev.prompt_tokens;
            x->completion_tokens = ev.completion_tokens;
            if (ev.tag != NULL)
                snprintf(x->tag, sizeof(x->tag), "%s", ev.tag);
            open--;
            break;
        case DSV4_CLIENT_EV_ERROR:
            x->final_type = ev.type;
            x->code = ev.code;
            assert_non_null(ev.message);
            if (ev.tag != NULL)
                snprintf(x->tag, sizeof(x->tag), "%s", ev.tag);
            open--;
            break;
        default:
            fail_msg("unknown event type %d", ev.type);
        }
    }
}

static void
test_connect(void **state)
{
    struct server *s = *state;
    struct dsv4_client_opts o;
    struct dsv4_client *c = NULL;
    struct dsv4_client_event ev;
    char ep[256];

    c = connect_ok(s);
    assert_int_equal(dsv4_client_pending(c), 0);
    /* No request in flight: next() returns at once. */
    assert_int_equal(dsv4_client_next(c, &ev, -1), DSV4_CLIENT_NONE);
    dsv4_client_close(c);

    /* Nobody listening: the connection check fails with 504. */
    dsv4_client_opts_init(&o);
    o.connect_timeout_ms = 100;
    snprintf(ep, sizeof(ep), "ipc://%s/nobody.sock", s->dir);
    assert_int_equal(dsv4_client_connect(ep, &o, &c), DSV4_CLIENT_UNREACHABLE);
    assert_null(c);
    assert_int_equal(dsv4_client_connect(NULL, &o, &c), DSV4_CLIENT_BAD_ARGUMENT);
    /* A key file that does not exist. */
    o.server_key_file = "/nonexistent/server.pub";
    assert_int_equal(dsv4_client_connect(s->endpoint, &o, &c), DSV4_CLIENT_BAD_ARGUMENT);
    /* The caller's mistakes are 401, not 500: an endpoint of no known
     * form, a server key that is not 40 Z85 characters. */
    dsv4_client_opts_init(&o);
    assert_int_equal(dsv4_client_connect("bogus://x", &o, &c), DSV4_CLIENT_BAD_ARGUMENT);
    assert_non_null(strstr(dsv4_client_errmsg(NULL), "ipc://PATH"));   /* the reason kept */
    assert_int_equal(dsv4_client_connect("tcp://localhost:99999", &o, &c),
        DSV4_CLIENT_BAD_ARGUMENT);
    snprintf(ep, sizeof(ep), "@%s", s->endpoint);   /* a bind */
    assert_int_equal(dsv4_client_connect(ep, &o, &c), DSV4_CLIENT_BAD_ARGUMENT);
    assert_non_null(strstr(dsv4_client_errmsg(NULL), "'@'"));
    o.server_key = "too-short";
    assert_int_equal(dsv4_client_connect(s->endpoint, &o, &c), DSV4_CLIENT_BAD_ARGUMENT);
    assert_non_null(strstr(dsv4_client_errmsg(NULL), "40"));
    assert_null(c);
    c = connect_ok(s);
    assert_string_equal(dsv4_client_errmsg(NULL), "");   /* a connect that worked */
    dsv4_client_close(c);
}

/* One text request of `prompt` served on c to its max_tokens `n`. */
static void
serve_one(struct dsv4_client *c, const char *prompt, uint32_t n)
{
    struct dsv4_client_params p;
    struct outcome o[1];

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    p.max_tokens = n;
    assert_int_equal(dsv4_client_submit_text(c, prompt, &p, &o[0].id), 0);
    collect(c, o, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_DONE);
    assert_int_equal(o[0].n_tokens, n);
}

/* A scheduler killed under the connect check: a ROUTER on s's endpoint
 * reads the check's HEARTBEAT (its first frame) and closes without
 * answering; 0.3 s later the fake scheduler serves the endpoint. */
static void *
dying_then_fake(void *arg)
{
    struct server *s = arg;
    void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
    int linger = 0, wait = WAIT_MS;
    char buf[256];

    zmq_setsockopt(r, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(r, ZMQ_RCVTIMEO, &wait, sizeof(wait));
    if (zmq_bind(r, s->endpoint) == 0)
        (void)zmq_recv(r, buf, sizeof(buf), 0);
    zmq_close(r);
    zmq_ctx_term(ctx);
    usleep(300 * 1000);
    return server_main(s);
}

/* The connect check goes on past a scheduler that died under it: the
 * next one answers within the timeout (the check sent one HEARTBEAT, lost
 * with the first, and waited out its whole timeout: 504 with a scheduler
 * serving). */
static void
test_connect_server_died(void **state)
{
    struct server *s = *state;
    struct dsv4_client_opts o;
    struct dsv4_client *c = NULL;

    server_stop(s);   /* the setup's, for this test's own */
    atomic_store(&s->stop, 0);
    assert_int_equal(pthread_create(&s->thread, NULL, dying_then_fake, s), 0);
    dsv4_client_opts_init(&o);
    o.connect_timeout_ms = WAIT_MS;
    assert_int_equal(dsv4_client_connect(s->endpoint, &o, &c), 0);
    serve_one(c, "abc", 3);
    dsv4_client_close(c);
}

/* Three text requests interleaved on one connection. */
static void
test_many_in_flight(void **state)
{
    static const char *const prompts[] = { "abc", "Hello, world", "xy" };
    static const uint32_t max[] = { 5, 30, 1 };
    struct dsv4_client *c = connect_ok(*state);
    struct dsv4_client_params p;
    struct outcome o[3];

    memset(o, 0, sizeof(o));
    for (int i = 0; i < 3; i++) {
        dsv4_client_params_init(&p);
        p.max_tokens = max[i];
        p.tag = i == 1 ? "second" : NULL;
        assert_int_equal(dsv4_client_submit_text(c, prompts[i], &p, &o[i].id), 0);
    }
    assert_int_equal(dsv4_client_pending(c), 3);
    assert_true(o[0].id != o[1].id && o[1].id != o[2].id);
    collect(c, o, 3);
    for (int i = 0; i < 3; i++) {
        size_t plen = strlen(prompts[i]);

        assert_int_equal(o[i].final_type, DSV4_CLIENT_EV_DONE);
        assert_int_equal(o[i].finish, DSV4_CLIENT_FINISH_LENGTH);
        assert_int_equal(o[i].n_tokens, max[i]);
        assert_int_equal(o[i].completion_tokens, max[i]);
        assert_int_equal(o[i].prompt_tokens, plen);
        assert_false(o[i].have_logprobs);
        for (uint32_t k = 0; k < max[i]; k++) {
            assert_int_equal(o[i].tokens[k], (uint8_t)prompts[i][k % plen]);
            assert_int_equal(o[i].text[k], prompts[i][k % plen]);
        }
        assert_int_equal(strlen(o[i].text), max[i]);
    }
    assert_string_equal(o[1].tag, "second");
    assert_int_equal(dsv4_client_pending(c), 0);
    dsv4_client_close(c);
}

/* Token-id prompt, logprobs, stop ids, and non-streamed output. */
static void
test_ids_logprobs_stop(void **state)
{
    static const int32_t ids[] = { 5, 6, 7, 8 };
    static const int32_t stop[] = { 7 };
    struct dsv4_client *c = connect_ok(*state);
    struct dsv4_client_params p;
    struct outcome o[2];

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    p.logprobs = 1;
    p.stop_ids = stop;
    p.n_stop_ids = 1;
    assert_int_equal(dsv4_client_submit_tokens(c, ids, 4, &p, &o[0].id), 0);
    dsv4_client_params_init(&p);
    p.stream = 0;
    p.max_tokens = 6;
    p.logprobs = 1;
    assert_int_equal(dsv4_client_submit_tokens(c, ids, 4, &p, &o[1].id), 0);
    collect(c, o, 2);

    assert_int_equal(o[0].finish, DSV4_CLIENT_FINISH_STOP);
    assert_int_equal(o[0].n_tokens, 3); /* the stop token is included */
    assert_int_equal(o[0].tokens[2], 7);
    assert_string_equal(o[0].text, "[5][6][7]");
    assert_true(o[0].have_logprobs);
    for (int k = 0; k < 3; k++)
        assert_true(o[0].logprobs[k] == -(float)k / 8);
    assert_int_equal(o[0].n_chunks, 3);

    assert_int_equal(o[1].finish, DSV4_CLIENT_FINISH_LENGTH);
    assert_int_equal(o[1].n_chunks, 1); /* stream = 0: one TOKENS event */
    assert_int_equal(o[1].n_tokens, 6);
    assert_string_equal(o[1].text, "[5][6][7][8][5][6]");
    dsv4_client_close(c);
}

/* top_logprobs: each token's most likely tokens through
 * dsv4_client_event_top (the fake server sends them for even tokens, none
 * for odd ones); a request that asks none gets none; after a DONE event the
 * accessor reports none. */
static void
test_top_logprobs(void **state)
{
    static const int32_t ids[] = { 5, 6, 7 };
    struct dsv4_client *c = connect_ok(*state);
    struct dsv4_client_params p;
    struct outcome o[2];

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    assert_int_equal(p.top_logprobs, 0);
    p.logprobs = 1;
    p.top_logprobs = 4;
    p.max_tokens = 5;
    assert_int_equal(dsv4_client_submit_tokens(c, ids, 3, &p, &o[0].id), 0);
    p.top_logprobs = 0;
    assert_int_equal(dsv4_client_submit_tokens(c, ids, 3, &p, &o[1].id), 0);
    collect(c, o, 2);
    assert_int_equal(o[0].n_tokens, 5);
    for (size_t k = 0; k < 5; k++) {
        assert_int_equal(o[0].n_top[k], k % 2 == 0 ? 4 : 0);
        for (size_t j = 0; j < o[0].n_top[k]; j++) {
            assert_int_equal(o[0].top_ids[k][j], o[0].tokens[k] + 1000 * (int32_t)j);
            assert_true(o[0].top_lp[k][j] == o[0].logprobs[k] - (float)j);
        }
        assert_int_equal(o[1].n_top[k], 0);
    }
    assert_int_equal(dsv4_client_event_top(c, 0, NULL, NULL), 0);   /* last event: DONE */
    assert_int_equal(dsv4_client_event_top(NULL, 0, NULL, NULL), 0);
    /* more than the protocol carries: refused before sending */
    p.top_logprobs = TOP_MAX + 1;
    assert_int_equal(dsv4_client_submit_tokens(c, ids, 3, &p, NULL), DSV4_CLIENT_BAD_ARGUMENT);
    /* a caller built against 1.3 passes the size its struct had, which ends
     * before top_logprobs: what lies there is not read (its padding) */
    p.size = offsetof(struct dsv4_client_params, top_logprobs);
    memset(&p.reserved0, 0xff, sizeof(p.reserved0) + sizeof(p.top_logprobs));
    p.max_tokens = 2;
    memset(o, 0, sizeof(o));
    assert_int_equal(dsv4_client_submit_tokens(c, ids, 3, &p, &o[0].id), 0);
    collect(c, o, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_DONE);
    assert_int_equal(o[0].n_top[0], 0);
    dsv4_client_close(c);
}

/* Cancel a long request after its first tokens; the other one continues. */
static void
test_cancel(void **state)
{
    struct dsv4_client *c = connect_ok(*state);
    struct dsv4_client_params p;
    struct dsv4_client_event ev;
    uint64_t long_id, short_id;
    bool cancelled = false, long_done = false, short_done = false;

    dsv4_client_params_init(&p);
    p.max_tokens = 1048576;
    assert_int_equal(dsv4_client_submit_text(c, "forever", &p, &long_id), 0);
    p.max_tokens = 3;
    assert_int_equal(dsv4_client_submit_text(c, "abc", &p, &short_id), 0);
    while (!long_done || !short_done) {
        assert_int_equal(dsv4_client_next(c, &ev, WAIT_MS), 0);
        if (ev.id == long_id && ev.type == DSV4_CLIENT_EV_TOKENS && !cancelled) {
            assert_int_equal(dsv4_client_cancel(c, long_id), 0);
            cancelled = true;
        }
        if (ev.type == DSV4_CLIENT_EV_DONE && ev.id == long_id) {
            assert_true(cancelled);
            assert_int_equal(ev.finish, DSV4_CLIENT_FINISH_CANCELLED);
            long_done = true;
        }
        if (ev.type == DSV4_CLIENT_EV_DONE && ev.id == short_id) {
            assert_int_equal(ev.finish, DSV4_CLIENT_FINISH_LENGTH);
            short_done = true;
        }
        assert_int_not_equal(ev.type, DSV4_CLIENT_EV_ERROR);
    }
    /* Finished requests cannot be cancelled. */
    assert_int_equal(dsv4_client_cancel(c, long_id), DSV4_CLIENT_NOT_FOUND);
    dsv4_client_close(c);
}

/* The server's timeout (408 from the server) and the library's own (the
 * server stays silent). */
static void
test_timeouts(void **state)
{
    struct dsv4_client *c = connect_ok(*state);
    struct dsv4_client_params p;
    struct outcome o[2];

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    p.max_tokens = 1048576;
    p.timeout_ms = 50;
    assert_int_equal(dsv4_client_submit_text(c, "slow", &p, &o[0].id), 0);
    p.tag = "stalled";
    assert_int_equal(dsv4_client_submit_text(c, "__stall__", &p, &o[1].id), 0);
    collect(c, o, 2);
    assert_string_equal(o[1].tag, "stalled");   /* the local 408 carries the tag */
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_ERROR);
    assert_int_equal(o[0].code, DSV4_CLIENT_TIMEOUT);
    assert_int_equal(o[1].final_type, DSV4_CLIENT_EV_ERROR);
    assert_int_equal(o[1].code, DSV4_CLIENT_TIMEOUT);
    assert_int_equal(o[1].n_tokens, 0);
    assert_int_equal(dsv4_client_pending(c), 0);
    dsv4_client_close(c);
}

/* Refusals: locally invalid parameters never leave the process; the server's
 * ERROR ends a request. */
static void
test_refusals(void **state)
{
    static const char *const too_many[17] = { "a", "a", "a", "a", "a", "a", "a", "a", "a", "a",
        "a", "a", "a", "a", "a", "a", "a" };
    struct dsv4_client *c = connect_ok(*state);
    struct dsv4_client_params p;
    struct outcome o[1];
    uint64_t id = 0;

    dsv4_client_params_init(&p);
    p.temperature = 11;
    assert_int_equal(dsv4_client_submit_text(c, "x", &p, &id), DSV4_CLIENT_BAD_ARGUMENT);
    assert_true(strlen(dsv4_client_errmsg(c)) > 0);
    dsv4_client_params_init(&p);
    p.max_tokens = 0;
    assert_int_equal(dsv4_client_submit_text(c, "x", &p, &id), DSV4_CLIENT_BAD_ARGUMENT);
    dsv4_client_params_init(&p);
    p.stop = too_many;
    p.n_stop = 17;
    assert_int_equal(dsv4_client_submit_text(c, "x", &p, &id), DSV4_CLIENT_TOO_LARGE);
    {
        static const char *const with_null[2] = { "a", NULL };

        p.stop = with_null;
        p.n_stop = 2;
        assert_int_equal(dsv4_client_submit_text(c, "x", &p, &id), DSV4_CLIENT_BAD_ARGUMENT);
    }
    assert_int_equal(dsv4_client_submit_text(c, "bad \xff utf8", NULL, &id),
        DSV4_CLIENT_BAD_MESSAGE);
    assert_int_equal(dsv4_client_submit_text(c, NULL, NULL, &id), DSV4_CLIENT_BAD_ARGUMENT);
    {
        /* inproc:// never reaches a server (the connection's context is
         * its own): refused, not a 504 after the connect timeout */
        struct dsv4_client *d = NULL;

        assert_int_equal(dsv4_client_connect("inproc://x", NULL, &d), DSV4_CLIENT_BAD_ARGUMENT);
        assert_null(d);
        assert_non_null(strstr(dsv4_client_errmsg(NULL), "inproc://"));
    }
    assert_int_equal(dsv4_client_submit_tokens(c, NULL, 0, NULL, &id),
        DSV4_CLIENT_BAD_ARGUMENT);
    assert_int_equal(dsv4_client_pending(c), 0);

    memset(o, 0, sizeof(o));
    assert_int_equal(dsv4_client_submit_text(c, "__busy__", NULL, &o[0].id), 0);
    collect(c, o, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_ERROR);
    assert_int_equal(o[0].code, DSV4_CLIENT_BUSY);
    assert_false(o[0].accepted);
    assert_string_equal(dsv4_client_strerror(DSV4_CLIENT_BUSY), "server busy, retry later");
    assert_string_equal(dsv4_client_strerror(0), "success");
    dsv4_client_close(c);
}

/* The server disappears with a request in flight: 504. */
/* The scheduler goes away mid-stream and a new one comes up on the same
 * endpoint: the request goes on there (resume, docs/protocol.md §4.6), and
 * its caller sees one ACCEPTED and every token once, in order. */
static void
test_resume(void **state)
{
    struct server *s = *state;
    static const int32_t prompt[] = { 7, 8, 9 };
    struct dsv4_client *c = connect_ok(s);
    struct dsv4_client_params p;
    struct dsv4_client_event ev;
    struct outcome o[1];
    char want[MAX_OUT];
    size_t n_accepted = 0;

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    p.max_tokens = 200;
    assert_int_equal(dsv4_client_submit_tokens(c, prompt, 3, &p, &o[0].id), 0);
    while (o[0].n_tokens < 20) {
        assert_int_equal(dsv4_client_next(c, &ev, 5000), 0);
        n_accepted += ev.type == DSV4_CLIENT_EV_ACCEPTED;
        assert_true(ev.type == DSV4_CLIENT_EV_ACCEPTED || ev.type == DSV4_CLIENT_EV_TOKENS);
        for (size_t k = 0; k < ev.n_tokens; k++)
            o[0].tokens[o[0].n_tokens++] = ev.tokens[k];
        if (ev.text != NULL)
            strcat(o[0].text, ev.text);
    }
    server_stop(s);
    server_restart(s);
    o[0].accepted = true;             /* collect fails on a second ACCEPTED */
    collect(c, o, 1);
    assert_int_equal(n_accepted, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_DONE);
    assert_int_equal(o[0].finish, DSV4_CLIENT_FINISH_LENGTH);
    assert_int_equal(o[0].n_tokens, 200);
    want[0] = '\0';
    for (size_t k = 0; k < 200; k++) {
        assert_int_equal(o[0].tokens[k], prompt[k % 3]);
        snprintf(want + strlen(want), sizeof(want) - strlen(want), "[%d]", prompt[k % 3]);
    }
    assert_string_equal(o[0].text, want);
    assert_int_equal(dsv4_client_pending(c), 0);
    dsv4_client_close(c);
}

/* A connection with connect_timeout_ms `ms` and one request in flight that
 * the server accepts and then leaves alone (o[0]). */
static struct dsv4_client *
connect_stalled(struct server *s, int ms, struct outcome *o)
{
    struct dsv4_client_opts opts;
    struct dsv4_client *c = NULL;
    struct dsv4_client_params p;

    dsv4_client_opts_init(&opts);
    opts.connect_timeout_ms = ms;
    assert_int_equal(dsv4_client_connect(s->endpoint, &opts, &c), 0);
    memset(o, 0, sizeof(*o));
    dsv4_client_params_init(&p);
    assert_int_equal(dsv4_client_submit_text(c, "__stall__", &p, &o[0].id), 0);
    return c;
}

static void
test_server_lost(void **state)
{
    struct server *s = *state;
    struct outcome o[1];
    /* generous: sanitizer builds under load */
    struct dsv4_client *c = connect_stalled(s, 3000, o);

    server_stop(s);
    collect(c, o, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_ERROR);
    assert_int_equal(o[0].code, DSV4_CLIENT_UNREACHABLE);
    dsv4_client_close(c);
}

/* A connection idle for longer than the heartbeat and connect_timeout_ms
 * serves its next request (the silence counts only while one is in
 * flight), and a connect_timeout_ms of INT_MAX does not overflow into an
 * instant 504. */
static void
test_idle(void **state)
{
    struct server *s = *state;
    struct dsv4_client_opts opts;
    struct dsv4_client *c = NULL;
    int timeouts[2] = { 200, INT_MAX };

    for (int t = 0; t < 2; t++) {
        dsv4_client_opts_init(&opts);
        opts.connect_timeout_ms = timeouts[t];
        assert_int_equal(dsv4_client_connect(s->endpoint, &opts, &c), 0);
        if (t == 0)
            usleep(1500 * 1000);      /* > 1 s heartbeat + 200 ms */
        serve_one(c, "idle", 5);
        dsv4_client_close(c);
    }
}

/* A caller that reads late (a paused pager, a slow consumer) gets what the
 * server sent meanwhile, not a local 504 for the silence it made itself nor
 * a 408 for a deadline the answer beat: the socket is read before either is
 * declared. */
static void
test_late_reader(void **state)
{
    struct server *s = *state;
    struct dsv4_client_opts opts;
    struct dsv4_client *c = NULL;
    struct dsv4_client_params p;
    struct outcome o[2];

    dsv4_client_opts_init(&opts);
    opts.connect_timeout_ms = 200;
    assert_int_equal(dsv4_client_connect(s->endpoint, &opts, &c), 0);
    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    p.max_tokens = 5;
    assert_int_equal(dsv4_client_submit_text(c, "late", &p, &o[0].id), 0);
    p.timeout_ms = 1000;   /* answered in a few ms: long before it */
    assert_int_equal(dsv4_client_submit_text(c, "late", &p, &o[1].id), 0);
    usleep(1600 * 1000);   /* > 1 s heartbeat + 200 ms, and > 1,000 ms */
    collect(c, o, 2);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(o[i].final_type, DSV4_CLIENT_EV_DONE);
        assert_int_equal(o[i].n_tokens, 5);
    }
    assert_int_equal(dsv4_client_pending(c), 0);
    dsv4_client_close(c);
}

/* No server: requests queue on the connection up to its high-water mark,
 * then submit says 300 at once instead of blocking. */
static void
test_send_queue_full(void **state)
{
    struct server *s = *state;
    struct dsv4_client_opts opts;
    struct dsv4_client *c = NULL;
    char ep[160];
    size_t sent = 0;
    int rc = 0;

    snprintf(ep, sizeof(ep), "ipc://%s/nobody.sock", s->dir);
    dsv4_client_opts_init(&opts);
    opts.connect_timeout_ms = 0;      /* no server to answer */
    assert_int_equal(dsv4_client_connect(ep, &opts, &c), 0);
    while (sent < 100000 && (rc = dsv4_client_submit_text(c, "q", NULL, NULL)) == 0)
        sent++;
    assert_int_equal(rc, DSV4_CLIENT_BUSY);
    assert_true(sent > 0);
    assert_int_equal(dsv4_client_pending(c), sent);
    dsv4_client_close(c);
}

/* Read events (ACCEPTED, TOKENS) of the n_o requests in o until o[w] has
 * n tokens. */
static void
read_tokens(struct dsv4_client *c, struct outcome *o, size_t n_o, size_t w, size_t n)
{
    struct dsv4_client_event ev;

    while (o[w].n_tokens < n) {
        struct outcome *x = NULL;

        assert_int_equal(dsv4_client_next(c, &ev, WAIT_MS), 0);
        for (size_t i = 0; i < n_o; i++)
            x = o[i].id == ev.id ? &o[i] : x;
        assert_non_null(x);
        assert_true(ev.type == DSV4_CLIENT_EV_ACCEPTED || ev.type == DSV4_CLIENT_EV_TOKENS);
        x->accepted |= ev.type == DSV4_CLIENT_EV_ACCEPTED;
        x->n_tokens += ev.n_tokens;
    }
}

/* Text request `prompt` gets `n` tokens, the scheduler restarts, and the
 * request, which cannot go on, ends with 504; none is left in flight. */
static void
restart_ends_unreachable(struct server *s, struct dsv4_client *c, const char *prompt,
    const struct dsv4_client_params *p, size_t n)
{
    struct outcome o[1];

    memset(o, 0, sizeof(o));
    assert_int_equal(dsv4_client_submit_text(c, prompt, p, &o[0].id), 0);
    read_tokens(c, o, 1, 0, n);
    server_stop(s);
    server_restart(s);
    collect(c, o, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_ERROR);
    assert_int_equal(o[0].code, DSV4_CLIENT_UNREACHABLE);
    assert_int_equal(dsv4_client_pending(c), 0);
}

/* Restarts: a request cancelled while the scheduler is away is cancelled
 * on the new one; a request whose OK named no seed and which had tokens
 * cannot be resumed and ends with 504 instead of waiting forever. */
static void
test_resume_cancel_noseed(void **state)
{
    struct server *s = *state;
    static const int32_t prompt[] = { 5, 6 };
    struct dsv4_client *c = connect_ok(s);
    struct dsv4_client_params p;
    struct outcome o[1];

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    p.max_tokens = 3000;              /* well past the restart; < MAX_OUT */
    assert_int_equal(dsv4_client_submit_tokens(c, prompt, 2, &p, &o[0].id), 0);
    read_tokens(c, o, 1, 0, 5);
    server_stop(s);
    assert_int_equal(dsv4_client_cancel(c, o[0].id), 0);
    server_restart(s);
    collect(c, o, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_DONE);
    assert_int_equal(o[0].finish, DSV4_CLIENT_FINISH_CANCELLED);
    restart_ends_unreachable(s, c, "__noseed__", &p, 5);
    dsv4_client_close(c);
}

/* A request submitted while the scheduler is away reaches the new one
 * twice (queued on the socket, and resumed at the reconnect): the client
 * cancels the older copy, so one runs. */
static void
test_resume_twice_sent(void **state)
{
    struct server *s = *state;
    static const int32_t prompt[] = { 3, 4 };
    struct dsv4_client *c = connect_ok(s);
    struct dsv4_client_params p;
    struct outcome o[2];

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    p.max_tokens = 3000;
    assert_int_equal(dsv4_client_submit_tokens(c, prompt, 2, &p, &o[0].id), 0);
    read_tokens(c, o, 1, 0, 5);
    server_stop(s);
    usleep(100 * 1000);               /* the drop seen by the socket */
    assert_int_equal(dsv4_client_submit_tokens(c, prompt, 2, &p, &o[1].id), 0);
    server_restart(s);
    read_tokens(c, o, 2, 1, 20);        /* both copies' OKs have come by now */
    {
        struct outcome q[1];

        memset(q, 0, sizeof(q));
        assert_int_equal(dsv4_client_submit_text(c, "__count__", NULL, &q[0].id), 0);
        for (;;) {
            struct dsv4_client_event ev;

            assert_int_equal(dsv4_client_next(c, &ev, WAIT_MS), 0);
            if (ev.id != q[0].id)
                continue;
            assert_int_equal(ev.type, DSV4_CLIENT_EV_ERROR);
            assert_string_equal(ev.message, "live 2");   /* o[0] and o[1], once each */
            break;
        }
    }
    dsv4_client_close(c);
}

/* A caller away from dsv4_client_next for longer than the heartbeat and
 * connect_timeout_ms, while the server works quietly (answering heartbeats):
 * the next call does not end the request with 504 (the silence was the
 * caller's: no heartbeat was sent meanwhile, so none went unanswered). */
static void
test_caller_pause(void **state)
{
    struct server *s = *state;
    struct dsv4_client_event ev;
    struct outcome o[1];
    struct dsv4_client *c = connect_stalled(s, 300, o);

    assert_int_equal(dsv4_client_next(c, &ev, WAIT_MS), 0);
    assert_int_equal(ev.type, DSV4_CLIENT_EV_ACCEPTED);
    usleep(2000 * 1000);                /* > 1 s heartbeat + 300 ms */
    /* two heartbeats' worth of next(): answered, so nothing happens */
    assert_int_equal(dsv4_client_next(c, &ev, 2500), DSV4_CLIENT_NONE);
    assert_int_equal(dsv4_client_pending(c), 1);
    o[0].accepted = true;
    assert_int_equal(dsv4_client_cancel(c, o[0].id), 0);
    collect(c, o, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_DONE);
    assert_int_equal(o[0].finish, DSV4_CLIENT_FINISH_CANCELLED);
    dsv4_client_close(c);
}

/* 302 from a scheduler that stops: the request waits for the next one.
 * Cancelled meanwhile, it ends here with DONE cancelled (the stopping
 * scheduler, which forgot it, answered the CANCEL with 404, and that was
 * the request's end).  Resent to the next scheduler, which refuses it
 * (300): 504, the request cannot go on (the caller had its OK and a token;
 * the 300 went to the caller as if it could submit again). */
static void
test_parked(void **state)
{
    struct server *s = *state;
    struct dsv4_client *c = connect_ok(s);
    struct dsv4_client_params p;
    struct outcome o[1];

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    for (int read_302 = 1; read_302 >= 0; read_302--) {
        struct dsv4_client_event ev;

        memset(o, 0, sizeof(o));
        assert_int_equal(dsv4_client_submit_text(c, "__restart__", &p, &o[0].id), 0);
        read_tokens(c, o, 1, 0, 1);
        /* the 302 taken by the library first (parked: no CANCEL sent), or
         * not (the CANCEL crosses it and the stopping scheduler answers
         * 404: the request was cancelled all the same) */
        if (read_302)
            assert_int_equal(dsv4_client_next(c, &ev, 300), DSV4_CLIENT_NONE);
        assert_int_equal(dsv4_client_cancel(c, o[0].id), 0);
        collect(c, o, 1);
        assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_DONE);
        assert_int_equal(o[0].finish, DSV4_CLIENT_FINISH_CANCELLED);
        assert_int_equal(o[0].completion_tokens, 1);
    }
    restart_ends_unreachable(s, c, "__restart__", &p, 1);
    dsv4_client_close(c);
}

/* A request resumed on a restarted scheduler that then ends with an error
 * of its own (its timeout: 408) gets that error, not the 504 of a refused
 * resend (every later 4xx of a resumed request was one). */
static void
test_resumed_then_timeout(void **state)
{
    struct server *s = *state;
    static const int32_t prompt[] = { 7, 8 };
    struct dsv4_client *c = connect_ok(s);
    struct dsv4_client_params p;
    struct dsv4_client_event ev;
    struct outcome o[1];

    memset(o, 0, sizeof(o));
    dsv4_client_params_init(&p);
    p.stream = 0;                     /* nothing comes before its end */
    p.max_tokens = 1000000;           /* an end the timeout comes first to */
    p.timeout_ms = 2000;
    assert_int_equal(dsv4_client_submit_tokens(c, prompt, 2, &p, &o[0].id), 0);
    assert_int_equal(dsv4_client_next(c, &ev, WAIT_MS), 0);
    assert_int_equal(ev.type, DSV4_CLIENT_EV_ACCEPTED);
    o[0].accepted = true;
    server_stop(s);
    server_restart(s);
    collect(c, o, 1);
    assert_int_equal(o[0].final_type, DSV4_CLIENT_EV_ERROR);
    assert_int_equal(o[0].code, DSV4_CLIENT_TIMEOUT);
    dsv4_client_close(c);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_connect, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_connect_server_died, server_start,
                                        server_teardown),
        cmocka_unit_test_setup_teardown(test_many_in_flight, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_ids_logprobs_stop, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_top_logprobs, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_cancel, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_timeouts, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_refusals, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_resume, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_server_lost, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_idle, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_late_reader, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_send_queue_full, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_resume_cancel_noseed, server_start,
            server_teardown),
        cmocka_unit_test_setup_teardown(test_resume_twice_sent, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_caller_pause, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_parked, server_start, server_teardown),
        cmocka_unit_test_setup_teardown(test_resumed_then_timeout, server_start,
            server_teardown),
    };

    if (getenv("TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TEST_FILTER"));   /* one test by name */
    return cmocka_run_group_tests(tests, NULL, NULL);
}
