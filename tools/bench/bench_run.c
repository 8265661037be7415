/*
 * bench_run.c — one concurrency level of closed-loop load.
 *
 * Workers: C threads, each with its own libdsv4client connection and one
 * request in flight; when a request ends, the same worker submits the next.
 * Chosen over one connection carrying C requests because (a) C connections
 * are what C independent clients look like to the scheduler, so nothing
 * per-connection (the DEALER pipe, its high-water mark, the merging of
 * pending tokens when one socket blocks) is shared by all streams and
 * distorts the figures; (b) each thread stamps its own events the moment
 * dsv4_client_next returns them, so a burst on one stream does not delay the
 * timestamps of the others; (c) a connection is not thread-safe, and one per
 * thread needs no locking around the library.  64 threads are cheap.
 *
 * Phases, by a shared request counter.  Each request draws its lengths,
 * prompt ids and sampling seed from an RNG stream of its own: the j-th
 * measured request from stream j, warm-up and extra requests from streams
 * of their own ranges (STREAM_WARMUP, STREAM_EXTRA), so a run is
 * reproducible whatever the timing, and every level of a sweep measures the
 * same requests whatever its warm-up count:
 *   warm-up   requests 0 .. W-1: sent, not counted;
 *   measured  the next N requests (or, with --duration, those sent within D
 *             seconds of the first measured one); t_start = the first one's
 *             submission;
 *   extra     requests sent after that keep the load at C until the last
 *             measured request ends (t_end); they are then cancelled and not
 *             counted.
 * Latency figures come from measured requests; output tok/s counts every
 * token that arrived in [t_start, t_end] (from any request, so the tail of
 * the run does not drain the load), divided by t_end - t_start.
 *
 * A worker whose connection fails, or whose request the library ends with
 * 504 (the server did not answer within --connect-timeout, or the request
 * could not be resumed after a scheduler restart), is lost: it sends no
 * more, so a level whose server is gone ends within a connect timeout
 * instead of failing each of its requests one timeout after another.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dsv4/client.h"

#include "bench.h"

#define POLL_MS 100          /* wake this often to notice stop and SIGINT */
#define CANCEL_WAIT_S 30.0   /* give up on a cancelled request's final event */
#define MAX_REPORTED 5       /* failures printed per level */
#define STREAM_WARMUP (1ull << 62) /* RNG streams of warm-up requests: + their number */
#define STREAM_EXTRA (1ull << 63)  /* of extra requests: + their number */

atomic_int bench_interrupted;

enum req_kind {
    REQ_NONE = 0,  /* no request: the level is over */
    REQ_WARMUP,
    REQ_MEASURED,
    REQ_EXTRA,
};

/* State shared by the workers of one level; everything under mu. */
struct level {
    const struct bench_opts *o;
    int concurrency;
    int warmup;                  /* warm-up requests of this level */
    pthread_mutex_t mu;
    pthread_barrier_t ready;     /* every worker connected (or failed to) */
    uint64_t next;               /* next request index */
    int measuring;               /* t_start is set */
    int closed;                  /* no more measured requests will be sent */
    int stop;                    /* t_end is set: cancel and leave */
    double t_start, t_end;       /* s */
    uint64_t sent, ended;        /* measured requests */
    uint64_t extra;              /* extra requests sent */
    double t_tok;                /* the latest token time counted in the window */
    struct bench_result *res;    /* counters; summaries filled at the end */
};

/* One worker: a connection and its current request. */
struct worker {
    struct level *lv;
    int index;
    pthread_t thread;
    struct dsv4_client *c;
    int32_t *ids;                /* prompt buffer */
    size_t ids_cap;
    struct bench_samples ttft, itl, tpot, e2e; /* s, measured requests only */
    /* current request */
    struct bench_samples req_itl; /* its ITL gaps: into itl only if it finishes */
    int kind;                    /* enum req_kind; REQ_NONE = idle */
    uint64_t id;                 /* library id */
    uint32_t n_prompt, max_tokens;
    struct bench_stream st;
    int cancelled;
    double t_cancel;
    int oom;
    uint64_t top_short;          /* its tokens with fewer most likely tokens than asked */
};

static double
now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Count one error code of a failed measured request. */
static void
count_code(struct bench_result *r, int code)
{
    int i;

    for (i = 0; i < r->n_codes; i++)
        if (r->err_code[i] == code)
            break;
    if (i == r->n_codes) {
        if (r->n_codes == BENCH_N_CODES)
            i = BENCH_N_CODES - 1; /* table full: lump into the last code */
        else
            r->err_code[r->n_codes++] = code;
    }
    r->err_count[i]++;
}

/* Whether the measured phase takes no more requests (under mu). */
static int
level_closed(struct level *lv, double now)
{
    if (!lv->closed && lv->measuring) {
        if (lv->o->duration_s > 0)
            lv->closed = now >= lv->t_start + lv->o->duration_s;
        else
            lv->closed = lv->sent >= lv->o->requests;
    }
    return lv->closed;
}

/* End the level at `now` (under mu).  The window ends no earlier than the
 * tokens counted in it (a worker stamps its tokens before it takes mu, so
 * those of a moment before `now` may be counted after a later stamp). */
static void
level_stop(struct level *lv, double now)
{
    if (!lv->stop) {
        lv->stop = 1;
        lv->t_end = now > lv->t_tok ? now : lv->t_tok;
        if (!lv->measuring)
            lv->t_start = now;
    }
}

/* Classify the next request; *stream receives its RNG stream (under mu). */
static int
level_take(struct level *lv, double now, uint64_t *stream)
{
    uint64_t i;

    if (lv->stop)
        return REQ_NONE;
    i = lv->next++;
    if (i < (uint64_t)lv->warmup) {
        *stream = STREAM_WARMUP + i;
        return REQ_WARMUP;
    }
    if (!lv->measuring) {
        lv->measuring = 1;
        lv->t_start = now;
    }
    if (level_closed(lv, now)) {
        *stream = STREAM_EXTRA + lv->extra++;
        return REQ_EXTRA;
    }
    *stream = lv->sent++;
    lv->res->measured++;
    return REQ_MEASURED;
}

/*
 * The current request ended: DONE (code 0, finish, usage) or failed (code,
 * message; the first few failures of a level are printed).
 */
static void
worker_end(struct worker *w, double now, int code, int finish, uint32_t usage,
    const char *message)
{
    struct level *lv = w->lv;
    struct bench_result *r = lv->res;
    int oom = 0;

    /* A measured request is cancelled by SIGINT (its times are cut short)
     * or by someone else (dsv4ctl cancel: no figure of it counts). */
    if (w->kind == REQ_MEASURED && code == 0 && finish == DSV4_CLIENT_FINISH_CANCELLED &&
        !w->cancelled)
        code = -1;
    if (w->kind == REQ_MEASURED && code == 0 && finish != DSV4_CLIENT_FINISH_CANCELLED) {
        oom |= bench_samples_add(&w->e2e, now - w->st.t_submit);
        if (w->st.n_tokens > 0)
            oom |= bench_samples_add(&w->ttft, w->st.t_first - w->st.t_submit);
        /* tokens that came in one event (--no-stream) say nothing of the
         * time between them: no sample rather than 0 ms */
        if (w->st.n_tokens > 1 && w->st.t_last > w->st.t_first)
            oom |= bench_samples_add(&w->tpot,
                (w->st.t_last - w->st.t_first) / (double)(w->st.n_tokens - 1));
        /* its inter-token gaps too: every latency sample comes from the
         * same set of requests, those that finished */
        oom |= bench_samples_merge(&w->itl, &w->req_itl);
    }
    w->req_itl.n = 0;
    w->oom |= oom;
    pthread_mutex_lock(&lv->mu);
    if (w->kind == REQ_MEASURED) {
        lv->ended++;
        r->prompt_tokens += w->n_prompt;
        r->output_requested += w->max_tokens;
        r->output_tokens += w->st.n_tokens;
        if (code == -1) {
            if (r->server_cancelled++ < MAX_REPORTED)
                fprintf(stderr, "dsv4-bench: a measured request was cancelled by the server "
                    "side (dsv4ctl cancel?): not counted as done\n");
        } else if (code != 0) {
            if (r->failed++ < MAX_REPORTED)
                fprintf(stderr, "dsv4-bench: request failed: %d %s: %s\n", code,
                    dsv4_client_strerror(code), message != NULL ? message : "");
            count_code(r, code);
        } else {
            r->done++;
            r->finish_length += finish == DSV4_CLIENT_FINISH_LENGTH;
            r->finish_stop += finish == DSV4_CLIENT_FINISH_STOP;
            r->finish_cancelled += finish == DSV4_CLIENT_FINISH_CANCELLED;
            /* one cancelled by SIGINT was cut short by us, not by the model,
             * and may have tokens on their way still */
            if (finish != DSV4_CLIENT_FINISH_CANCELLED) {
                r->short_outputs += w->st.n_tokens < w->max_tokens;
                r->usage_mismatch += usage != w->st.n_tokens;
            }
            r->top_short += w->top_short;
        }
    } else if (code != 0) {
        if (r->unmeasured_failed++ < MAX_REPORTED)
            fprintf(stderr, "dsv4-bench: a %s request failed: %d %s: %s\n",
                w->kind == REQ_WARMUP ? "warm-up" : "extra", code, dsv4_client_strerror(code),
                message != NULL ? message : "");
    } else if (w->cancelled && lv->stop) {
        r->extra_cancelled++;
    }
    /* a refusal of the request itself comes again at once for the next:
     * the level stops rather than resend as fast as the server answers */
    if ((code == DSV4_CLIENT_BAD_ARGUMENT || code == DSV4_CLIENT_TOO_LARGE) && !lv->stop) {
        fprintf(stderr, "dsv4-bench: the server refuses the requests (%d %s): the level "
            "stops\n", code, dsv4_client_strerror(code));
        r->refused = 1;
        level_stop(lv, now);
    }
    if (level_closed(lv, now) && lv->ended == lv->sent)
        level_stop(lv, now);
    pthread_mutex_unlock(&lv->mu);
    w->kind = REQ_NONE;
}

/* Build and send the request of RNG stream `stream`; 0, or the library's
 * code on failure. */
static int
worker_submit(struct worker *w, uint64_t stream)
{
    const struct bench_opts *o = w->lv->o;
    struct dsv4_client_params p;
    struct bench_rng rng;
    uint32_t span = (uint32_t)(o->id_hi - o->id_lo);

    bench_rng_seed(&rng, o->seed, stream);
    w->n_prompt = bench_dist_draw(&o->prompt, &rng);
    w->max_tokens = bench_dist_draw(&o->output, &rng);
    if (w->n_prompt > w->ids_cap) {
        int32_t *ids = realloc(w->ids, w->n_prompt * sizeof(*ids));

        if (ids == NULL)
            return DSV4_CLIENT_NO_MEMORY;
        w->ids = ids;
        w->ids_cap = w->n_prompt;
    }
    for (uint32_t i = 0; i < w->n_prompt; i++)
        w->ids[i] = o->id_lo + (int32_t)(bench_rng_next(&rng) % span);
    dsv4_client_params_init(&p);
    p.temperature = o->temperature;
    p.top_p = o->top_p;
    p.top_k = o->top_k;
    p.top_logprobs = o->top_logprobs;
    p.seed = bench_rng_next(&rng) >> 1;
    p.has_seed = 1;
    p.max_tokens = w->max_tokens;
    p.stream = o->stream;
    p.timeout_ms = o->timeout_ms;
    p.tag = "dsv4-bench";
    w->cancelled = 0;
    w->top_short = 0;
    bench_stream_begin(&w->st, now_s());
    return dsv4_client_submit_tokens(w->c, w->ids, w->n_prompt, &p, &w->id);
}

/* Tokens arrived at t: stream timing, and the window count. */
static void
worker_tokens(struct worker *w, double t, size_t n)
{
    struct level *lv = w->lv;

    if (bench_stream_tokens(&w->st, t, n, w->kind == REQ_MEASURED ? &w->req_itl : NULL) != 0)
        w->oom = 1;
    pthread_mutex_lock(&lv->mu);
    if (lv->measuring && t >= lv->t_start && (!lv->stop || t <= lv->t_end)) {
        lv->res->window_tokens += n;
        if (t > lv->t_tok)
            lv->t_tok = t;
    }
    pthread_mutex_unlock(&lv->mu);
}

int
bench_connect(const struct bench_opts *o, struct dsv4_client **c)
{
    struct dsv4_client_opts copts;

    dsv4_client_opts_init(&copts);
    copts.server_key_file = o->server_key_file;
    copts.connect_timeout_ms = o->connect_timeout_ms;
    return dsv4_client_connect(o->endpoint, &copts, c);
}

static void *
worker_main(void *arg)
{
    struct worker *w = arg;
    struct level *lv = w->lv;
    const struct bench_opts *o = lv->o;
    sigset_t ss;
    int rc;

    /* SIGINT goes to the main thread (waiting in pthread_join), so no
     * zmq_poll of a worker is interrupted; workers see bench_interrupted. */
    sigemptyset(&ss);
    sigaddset(&ss, SIGINT);
    pthread_sigmask(SIG_BLOCK, &ss, NULL);
    rc = bench_connect(o, &w->c);
    if (rc != 0)
        fprintf(stderr, "dsv4-bench: worker %d: %s: %d %s: %s\n", w->index, o->endpoint, rc,
            dsv4_client_strerror(rc), dsv4_client_errmsg(NULL));
    pthread_barrier_wait(&lv->ready);
    if (rc != 0)
        goto lost;

    for (;;) {
        struct dsv4_client_event ev;
        uint64_t stream = 0;
        int stop, fresh = 0;
        double t;

        pthread_mutex_lock(&lv->mu);
        if (atomic_load(&bench_interrupted) && !lv->stop) {
            lv->res->interrupted = 1;
            level_stop(lv, now_s());
        }
        stop = lv->stop;
        if (w->kind == REQ_NONE) {
            w->kind = level_take(lv, now_s(), &stream);
            fresh = w->kind != REQ_NONE;
        }
        pthread_mutex_unlock(&lv->mu);
        if (w->kind == REQ_NONE)
            break;
        if (fresh && (rc = worker_submit(w, stream)) != 0) {
            worker_end(w, now_s(), rc, 0, 0, dsv4_client_errmsg(w->c));
            continue;
        }
        /* 404 when it just ended: fine; 300 (the send queue is full):
         * again at the next turn */
        if (stop && !w->cancelled && dsv4_client_cancel(w->c, w->id) != DSV4_CLIENT_BUSY) {
            w->cancelled = 1;
            w->t_cancel = now_s();
        }
        if (w->cancelled && now_s() - w->t_cancel > CANCEL_WAIT_S) {
            fprintf(stderr, "dsv4-bench: worker %d: no answer to CANCEL\n", w->index);
            break;
        }
        rc = dsv4_client_next(w->c, &ev, POLL_MS);
        t = now_s();
        if (rc == DSV4_CLIENT_NONE)
            continue;
        if (rc != 0) {
            fprintf(stderr, "dsv4-bench: worker %d: connection: %d %s: %s\n", w->index, rc,
                dsv4_client_strerror(rc), dsv4_client_errmsg(w->c));
            worker_end(w, t, rc, 0, 0, "connection failed");
            goto lost;
        }
        if (ev.id != w->id)
            continue; /* a stale reply (e.g. 404 to a late CANCEL) */
        switch (ev.type) {
        case DSV4_CLIENT_EV_TOKENS:
            worker_tokens(w, t, ev.n_tokens);
            for (size_t i = 0; o->top_logprobs > 0 && i < ev.n_tokens; i++)
                w->top_short += dsv4_client_event_top(w->c, i, NULL, NULL) < o->top_logprobs;
            break;
        case DSV4_CLIENT_EV_DONE:
            worker_end(w, t, 0, ev.finish, ev.completion_tokens, NULL);
            break;
        case DSV4_CLIENT_EV_ERROR:
            worker_end(w, t, ev.code, 0, 0, ev.message);
            if (ev.code == DSV4_CLIENT_UNREACHABLE) {
                fprintf(stderr, "dsv4-bench: worker %d: %s; it sends no more\n", w->index,
                    ev.message != NULL ? ev.message : "server unreachable");
                goto lost;
            }
            break;
        default:
            break;
        }
    }
    dsv4_client_close(w->c);
    w->c = NULL;
    return NULL;

lost:
    pthread_mutex_lock(&lv->mu);
    lv->res->workers_lost++;
    pthread_mutex_unlock(&lv->mu);
    dsv4_client_close(w->c);
    w->c = NULL;
    return NULL;
}

int
bench_run(const struct bench_opts *o, int concurrency, struct bench_result *res)
{
    struct worker *w = calloc((size_t)concurrency, sizeof(*w));
    struct bench_samples ttft = { 0 }, itl = { 0 }, tpot = { 0 }, e2e = { 0 };
    struct level lv;
    int oom = 0;

    memset(res, 0, sizeof(*res));
    res->concurrency = concurrency;
    if (w == NULL) {
        fprintf(stderr, "dsv4-bench: out of memory\n");
        return -1;
    }
    memset(&lv, 0, sizeof(lv));
    lv.o = o;
    lv.concurrency = concurrency;
    lv.warmup = o->warmup < 0 ? concurrency : o->warmup;
    lv.res = res;
    pthread_mutex_init(&lv.mu, NULL);
    pthread_barrier_init(&lv.ready, NULL, (unsigned)concurrency + 1);
    for (int i = 0; i < concurrency; i++) {
        w[i].lv = &lv;
        w[i].index = i;
        if (pthread_create(&w[i].thread, NULL, worker_main, &w[i]) != 0) {
            /* The started workers wait on the barrier: nothing to unwind. */
            fprintf(stderr, "dsv4-bench: cannot start worker %d\n", i);
            exit(1);
        }
    }
    pthread_barrier_wait(&lv.ready);
    for (int i = 0; i < concurrency; i++)
        pthread_join(w[i].thread, NULL);
    if (!lv.stop)
        level_stop(&lv, now_s()); /* every worker lost */

    res->warmup = lv.next < (uint64_t)lv.warmup ? (int)lv.next : lv.warmup;
    res->duration_s = lv.t_end - lv.t_start;
    if (res->duration_s > 0) {
        res->output_tok_s = (double)res->window_tokens / res->duration_s;
        res->requests_s = (double)(res->done - res->finish_cancelled) / res->duration_s;
    }
    for (int i = 0; i < concurrency; i++) {
        oom |= w[i].oom;
        oom |= bench_samples_merge(&ttft, &w[i].ttft) | bench_samples_merge(&itl, &w[i].itl) |
            bench_samples_merge(&tpot, &w[i].tpot) | bench_samples_merge(&e2e, &w[i].e2e);
        bench_samples_free(&w[i].ttft);
        bench_samples_free(&w[i].itl);
        bench_samples_free(&w[i].req_itl);
        bench_samples_free(&w[i].tpot);
        bench_samples_free(&w[i].e2e);
        free(w[i].ids);
    }
    bench_summarize(&ttft, 1e3, &res->ttft);
    bench_summarize(&itl, 1e3, &res->itl);
    bench_summarize(&tpot, 1e3, &res->tpot);
    bench_summarize(&e2e, 1e3, &res->e2e);
    bench_samples_free(&ttft);
    bench_samples_free(&itl);
    bench_samples_free(&tpot);
    bench_samples_free(&e2e);
    pthread_barrier_destroy(&lv.ready);
    pthread_mutex_destroy(&lv.mu);
    free(w);
    if (oom)
        fprintf(stderr, "dsv4-bench: out of memory: some samples are missing\n");
    if (res->workers_lost == concurrency && lv.next == 0) {
        fprintf(stderr, "dsv4-bench: no worker could connect to %s\n", o->endpoint);
        return -1;
    }
    return 0;
}
