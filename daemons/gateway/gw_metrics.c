/*
 * gw_metrics.c — dsv4-gateway's measurements and the scheduler's: the
 * gateway's counters and latency histograms (measured here, per request, at
 * the gateway), the admin client that fetches the scheduler's STATUS and
 * RANKS on every scrape, and the Prometheus text rendering.  docs/gateway.md
 * lists every metric and where it is measured.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "common/log.h"
#include "daemons/gateway/gateway.h"
#include "ipc/proto.h"
#include "ipc/zsock.h"

/* Upper bounds of the histogram buckets, seconds (CPU test runs are slow,
 * H200 decode steps are milliseconds: the range covers both). */
static const double gw_bounds[GW_HIST_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
};

void
gw_hist_observe(struct gw_hist *h, double seconds)
{
    int i;

    for (i = 0; i < GW_HIST_BUCKETS && seconds > gw_bounds[i]; i++)
        ;
    h->count[i]++;
    h->sum += seconds;
    h->n++;
}

void
gw_metrics_http(struct gw *g, enum gw_route route, unsigned status)
{
    unsigned cls = status / 100;

    if (cls < 1 || cls > 5)
        cls = 5;
    pthread_mutex_lock(&g->mlock);
    g->m.http[route][cls]++;
    pthread_mutex_unlock(&g->mlock);
}

/* --- admin client -------------------------------------------------------- */

static void
gw_admin_drop(struct gw *g)
{
    dsv4_zsock_close(g->admin);
    g->admin = NULL;
}

void
gw_admin_close(struct gw *g)
{
    gw_admin_drop(g);
    if (g->zctx != NULL)
        zmq_ctx_term(g->zctx);
    g->zctx = NULL;
}

/* Send one admin command and collect replies until a final one; handler
 * `item` sees every message.  Caller holds alock.  0, or -1 (socket
 * dropped, so no late answer confuses the next call). */
static int
gw_admin_call(struct gw *g, int cmd, int final, void (*item)(struct gw_sched *,
    const struct dsv4_msg *), struct gw_sched *s)
{
    struct dsv4_zsock_cfg zc;
    struct dsv4_perr pe;
    struct dsv4_msg m;
    int64_t end = dsv4_now_ms() + GW_ADMIN_TIMEOUT_MS;
    zmq_pollitem_t it;

    if (g->zctx == NULL && (g->zctx = zmq_ctx_new()) == NULL)
        return -1;
    if (g->admin == NULL) {
        dsv4_zsock_cfg_init(&zc);
        zc.endpoint = g->conf.admin_endpoint;
        zc.type = ZMQ_DEALER;
        zc.key_dir = g->conf.key_dir;
        if ((g->admin = dsv4_zsock_open(g->zctx, &zc, NULL)) == NULL) {
            log_warnx("gw_admin_call: %s: %s", g->conf.admin_endpoint, dsv4_errmsg());
            return -1;
        }
    }
    dsv4_msg_init(&m, DSV4_SUB_CTL, cmd);
    if (dsv4_zsock_send(g->admin, NULL, &m, ZMQ_DONTWAIT, NULL) != DSV4_OK) {
        gw_admin_drop(g);
        return -1;
    }
    for (;;) {
        int64_t left = end - dsv4_now_ms();

        it = (zmq_pollitem_t){ g->admin, 0, ZMQ_POLLIN, 0 };
        if (left <= 0 || zmq_poll(&it, 1, (long)left) <= 0) {
            log_warnx("gw_admin_call: no answer from %s", g->conf.admin_endpoint);
            gw_admin_drop(g);
            return -1;
        }
        if (dsv4_zsock_recv(g->admin, NULL, &m, &pe, 0) != DSV4_OK)
            continue;
        if (m.sub == DSV4_SUB_CTL && m.cmd == DSV4_CTL_RESULT) {
            log_warnx("gw_admin_call: scheduler answered %u: %s", m.u.error.code,
                m.u.error.message);
            dsv4_msg_clear(&m);
            return -1;
        }
        if (m.sub == DSV4_SUB_CTL && item != NULL)
            item(s, &m);
        if (m.sub == DSV4_SUB_CTL && m.cmd == final) {
            dsv4_msg_clear(&m);
            return 0;
        }
        dsv4_msg_clear(&m);
    }
}

static void
gw_take_status(struct gw_sched *s, const struct dsv4_msg *m)
{
    const struct dsv4_ctl_status *st = &m->u.status;

    if (m->cmd != DSV4_CTL_STATUS)
        return;
    s->uptime_ms = st->uptime_ms;
    s->draining = st->draining;
    s->n_ranks = st->n_ranks;
    s->n_ranks_ready = st->n_ranks_ready;
    s->n_queued = st->n_queued;
    s->n_running = st->n_running;
    s->n_done = st->n_done;
    s->n_failed = st->n_failed;
    s->has_metrics = st->has_metrics;
    s->n_cancelled = st->n_cancelled;
    s->n_rejected = st->n_rejected;
    s->tokens_in = st->tokens_in;
    s->tokens_out = st->tokens_out;
    s->handoffs = st->handoffs;
    s->reruns = st->reruns;
    s->rank_deaths = st->rank_deaths;
    /* The histogram is used only when complete (buckets, sum and count). */
    s->has_handoff = st->has_handoff && st->handoff_buckets != NULL &&
        st->n_handoff_buckets == DSV4_PROTO_HANDOFF_BUCKETS;
    if (s->has_handoff) {
        memcpy(s->handoff_le, st->handoff_buckets, sizeof(s->handoff_le));
        s->handoff_sum_us = st->handoff_sum_us;
        s->handoff_count = st->handoff_count;
    }
}

static void
gw_take_rank(struct gw_sched *s, const struct dsv4_msg *m)
{
    const struct dsv4_ctl_rank *k = &m->u.rank;
    struct gw_rank *r;

    if (m->cmd != DSV4_CTL_RANK || s->n >= GW_MAX_RANKS)
        return;
    r = &s->ranks[s->n++];
    snprintf(r->role, sizeof(r->role), "%s", dsv4_role_name(k->role));
    snprintf(r->state, sizeof(r->state), "%s", dsv4_rank_state_name(k->state));
    r->index = k->index;
    r->group = k->group;
    r->group_rank = k->group_rank;
    r->active = k->active;
    r->capacity = k->capacity;
    r->rank_active = k->rank_active;
    r->has_rank_active = k->has_rank_active;
    r->call_rows = k->call_rows;
    r->call_rows_full = k->call_rows_full;
    r->has_call_rows = k->has_call_rows;
    r->graphs_refused = k->graphs_refused;
    r->has_graphs_refused = k->has_graphs_refused;
}

int
gw_sched_query(struct gw *g, struct gw_sched *s)
{
    int rc;

    pthread_mutex_lock(&g->qlock);
    if (g->q_busy) {
        uint64_t want = g->q_count + 1;   /* the one in flight */

        while (g->q_count < want)
            pthread_cond_wait(&g->qdone, &g->qlock);
        *s = *g->q_last;
        rc = g->q_rc;
        pthread_mutex_unlock(&g->qlock);
        return rc;
    }
    g->q_busy = true;
    pthread_mutex_unlock(&g->qlock);

    memset(s, 0, sizeof(*s));
    pthread_mutex_lock(&g->alock);
    rc = gw_admin_call(g, DSV4_CTL_SHOW_STATUS, DSV4_CTL_STATUS, gw_take_status, s);
    if (rc == 0)
        rc = gw_admin_call(g, DSV4_CTL_SHOW_RANKS, DSV4_CTL_RANKS_END, gw_take_rank, s);
    pthread_mutex_unlock(&g->alock);
    s->up = rc == 0;

    pthread_mutex_lock(&g->qlock);
    *g->q_last = *s;
    g->q_rc = rc;
    g->q_count++;
    g->q_busy = false;
    pthread_cond_broadcast(&g->qdone);
    pthread_mutex_unlock(&g->qlock);
    return rc;
}

bool
gw_sched_serving(const struct gw_sched *s, char *why, size_t len)
{
    bool prefill = false, decode = false, group_ok;
    int i, j;

    if (!s->up) {
        snprintf(why, len, "the scheduler does not answer on its admin socket");
        return false;
    }
    if (s->draining) {
        snprintf(why, len, "the scheduler is draining");
        return false;
    }
    for (i = 0; i < s->n; i++) {
        const struct gw_rank *r = &s->ranks[i];

        if (strcmp(r->role, "prefill") == 0 && strcmp(r->state, "ready") == 0)
            prefill = true;
        if (strcmp(r->role, "decode") != 0 || decode)
            continue;
        /* A decode group is ready when every member the scheduler knows is. */
        group_ok = true;
        for (j = 0; j < s->n; j++)
            if (strcmp(s->ranks[j].role, "decode") == 0 && s->ranks[j].group == r->group &&
                strcmp(s->ranks[j].state, "ready") != 0)
                group_ok = false;
        decode = group_ok;
    }
    if (!decode) {
        snprintf(why, len, "no decode group is ready");
        return false;
    }
    if (!prefill) {
        snprintf(why, len, "no prefill rank is ready");
        return false;
    }
    return true;
}

/* --- Prometheus text ----------------------------------------------------- */

static void
gw_help(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void
gw_hist_print(FILE *f, const char *name, const char *help, const struct gw_hist *h)
{
    uint64_t cum = 0;
    int i;

    gw_help(f, name, "histogram", help);
    for (i = 0; i < GW_HIST_BUCKETS; i++) {
        cum += h->count[i];
        fprintf(f, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", name, gw_bounds[i], cum);
    }
    cum += h->count[GW_HIST_BUCKETS];
    fprintf(f, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, cum);
    fprintf(f, "%s_sum %.9g\n%s_count %" PRIu64 "\n", name, h->sum, name, h->n);
}

static const char *const gw_route_names[GW_R_N] = {
    "completions", "chat_completions", "models", "health", "metrics", "other",
};
static const char *const gw_outcome_names[GW_OUT_N] = {
    "stop", "length", "disconnected", "timeout", "rejected", "error", "cancelled",
};

static void
gw_render_gateway(FILE *f, const struct gw_metrics *m)
{
    int r, c;

    gw_help(f, "dsv4_gateway_http_requests_total", "counter",
        "HTTP requests answered by the gateway, by route and status class");
    for (r = 0; r < GW_R_N; r++)
        for (c = 1; c <= 5; c++)
            if (m->http[r][c] != 0)
                fprintf(f, "dsv4_gateway_http_requests_total{route=\"%s\",code=\"%dxx\"} %"
                    PRIu64 "\n", gw_route_names[r], c, m->http[r][c]);
    gw_help(f, "dsv4_gateway_requests_total", "counter",
        "Generation requests (completions and chat) by outcome, seen at the gateway");
    for (r = 0; r < GW_OUT_N; r++)
        fprintf(f, "dsv4_gateway_requests_total{outcome=\"%s\"} %" PRIu64 "\n",
            gw_outcome_names[r], m->outcome[r]);
    gw_help(f, "dsv4_gateway_streams_active", "gauge",
        "Generation requests the gateway has in flight");
    fprintf(f, "dsv4_gateway_streams_active %" PRIu64 "\n", m->streams_active);
    gw_help(f, "dsv4_gateway_prompt_tokens_total", "counter",
        "Prompt tokens of finished gateway requests (usage)");
    fprintf(f, "dsv4_gateway_prompt_tokens_total %" PRIu64 "\n", m->prompt_tokens);
    gw_help(f, "dsv4_gateway_completion_tokens_total", "counter",
        "Generated tokens of finished gateway requests (usage)");
    fprintf(f, "dsv4_gateway_completion_tokens_total %" PRIu64 "\n", m->completion_tokens);
    gw_hist_print(f, "dsv4_gateway_ttft_seconds",
        "Time from submitting a request to its first token, at the gateway", &m->ttft);
    gw_hist_print(f, "dsv4_gateway_inter_token_seconds",
        "Time between output tokens of a stream, at the gateway", &m->itl);
    gw_hist_print(f, "dsv4_gateway_request_duration_seconds",
        "Time from submitting a request to its final event, at the gateway", &m->duration);
}

/* The scheduler's handoff histogram (cumulative buckets already). */
static void
gw_render_handoff(FILE *f, const struct gw_sched *s)
{
    static const uint64_t bounds_us[DSV4_PROTO_HANDOFF_BUCKETS] =
        DSV4_PROTO_HANDOFF_BOUNDS_US;
    int i;

    gw_help(f, "dsv4_handoff_seconds", "histogram",
        "Decode-state handoff, measured by the scheduler from PREFILL_DONE (all parts) "
        "to the decode group's KV_RELEASE");
    for (i = 0; i < DSV4_PROTO_HANDOFF_BUCKETS; i++)
        fprintf(f, "dsv4_handoff_seconds_bucket{le=\"%g\"} %" PRIu64 "\n",
            (double)bounds_us[i] / 1e6, s->handoff_le[i]);
    fprintf(f, "dsv4_handoff_seconds_bucket{le=\"+Inf\"} %" PRIu64 "\n", s->handoff_count);
    fprintf(f, "dsv4_handoff_seconds_sum %.9g\ndsv4_handoff_seconds_count %" PRIu64 "\n",
        (double)s->handoff_sum_us / 1e6, s->handoff_count);
}

/* One family of the prefill ranks' rows per call (READY call_rows): now, or
 * (full) before the warm-up lowered them. */
static void
gw_render_call_rows(FILE *f, const struct gw_sched *s, bool full)
{
    const char *name = full ? "dsv4_prefill_call_rows_full" : "dsv4_prefill_call_rows";

    gw_help(f, name, "gauge", full ?
        "Prompt tokens a prefill rank would run in one forward call had no warm-up call "
        "run out of device memory" :
        "Prompt tokens a prefill rank runs in one forward call (lowered below "
        "dsv4_prefill_call_rows_full when its warm-up ran out of device memory)");
    for (int i = 0; i < s->n; i++)
        if (s->ranks[i].has_call_rows)
            fprintf(f, "%s{rank=\"%s@%u\"} %u\n", name, s->ranks[i].role,
                s->ranks[i].index, full ? s->ranks[i].call_rows_full : s->ranks[i].call_rows);
}

static void
gw_render_sched(FILE *f, const struct gw_sched *s)
{
    char why[128];
    int i;

    gw_help(f, "dsv4_scheduler_up", "gauge", "1 when the scheduler's admin socket answered");
    fprintf(f, "dsv4_scheduler_up %d\n", s->up ? 1 : 0);
    gw_help(f, "dsv4_serving", "gauge",
        "1 when not draining and a decode group and a prefill rank are ready (/health)");
    fprintf(f, "dsv4_serving %d\n", gw_sched_serving(s, why, sizeof(why)) ? 1 : 0);
    if (!s->up)
        return;
    gw_help(f, "dsv4_scheduler_uptime_seconds", "gauge", "Scheduler uptime");
    fprintf(f, "dsv4_scheduler_uptime_seconds %.3f\n", (double)s->uptime_ms / 1000.0);
    gw_help(f, "dsv4_scheduler_draining", "gauge", "1 while the scheduler drains");
    fprintf(f, "dsv4_scheduler_draining %d\n", s->draining ? 1 : 0);
    gw_help(f, "dsv4_queue_length", "gauge", "Requests queued at the scheduler");
    fprintf(f, "dsv4_queue_length %u\n", s->n_queued);
    gw_help(f, "dsv4_requests_running", "gauge", "Requests prefilling or decoding");
    fprintf(f, "dsv4_requests_running %u\n", s->n_running);
    gw_help(f, "dsv4_requests_total", "counter",
        "Requests ended at the scheduler, by outcome (all clients)");
    fprintf(f, "dsv4_requests_total{outcome=\"done\"} %" PRIu64 "\n", s->n_done);
    fprintf(f, "dsv4_requests_total{outcome=\"failed\"} %" PRIu64 "\n", s->n_failed);
    if (s->has_metrics) {
        fprintf(f, "dsv4_requests_total{outcome=\"cancelled\"} %" PRIu64 "\n", s->n_cancelled);
        fprintf(f, "dsv4_requests_total{outcome=\"rejected\"} %" PRIu64 "\n", s->n_rejected);
        gw_help(f, "dsv4_prompt_tokens_total", "counter", "Prompt tokens admitted");
        fprintf(f, "dsv4_prompt_tokens_total %" PRIu64 "\n", s->tokens_in);
        gw_help(f, "dsv4_generated_tokens_total", "counter", "Output tokens generated");
        fprintf(f, "dsv4_generated_tokens_total %" PRIu64 "\n", s->tokens_out);
        gw_help(f, "dsv4_handoffs_total", "counter",
            "Prefill-to-decode handoffs (DECODE messages sent)");
        fprintf(f, "dsv4_handoffs_total %" PRIu64 "\n", s->handoffs);
        gw_help(f, "dsv4_reruns_total", "counter", "Requests re-run after a rank failure");
        fprintf(f, "dsv4_reruns_total %" PRIu64 "\n", s->reruns);
        gw_help(f, "dsv4_rank_deaths_total", "counter",
            "Ranks lost (each restart of a rank follows one)");
        fprintf(f, "dsv4_rank_deaths_total %" PRIu64 "\n", s->rank_deaths);
    }
    if (s->has_handoff)
        gw_render_handoff(f, s);
    gw_help(f, "dsv4_ranks", "gauge", "Ranks registered, and ready");
    fprintf(f, "dsv4_ranks{state=\"registered\"} %u\n", s->n_ranks);
    fprintf(f, "dsv4_ranks{state=\"ready\"} %u\n", s->n_ranks_ready);
    gw_help(f, "dsv4_rank_up", "gauge",
        "1 when the rank is registered and alive (ready, draining or drained)");
    for (i = 0; i < s->n; i++) {
        const struct gw_rank *r = &s->ranks[i];
        bool up = strcmp(r->state, "ready") == 0 || strcmp(r->state, "draining") == 0 ||
            strcmp(r->state, "drained") == 0;

        fprintf(f, "dsv4_rank_up{rank=\"%s@%u\",role=\"%s\",group=\"%u\",state=\"%s\"} %d\n",
            r->role, r->index, r->role, r->group, r->state, up ? 1 : 0);
    }
    gw_help(f, "dsv4_decode_group_streams", "gauge",
        "Requests the scheduler has placed on a decode group (running streams)");
    for (i = 0; i < s->n; i++)
        if (strcmp(s->ranks[i].role, "decode") == 0 && s->ranks[i].group_rank == 0)
            fprintf(f, "dsv4_decode_group_streams{group=\"%u\"} %u\n", s->ranks[i].group,
                s->ranks[i].active);
    gw_help(f, "dsv4_kv_slots_in_use", "gauge",
        "Requests whose KV state a rank holds now (its last HEARTBEAT); one slot of "
        "max_seq positions each");
    for (i = 0; i < s->n; i++)
        if (s->ranks[i].has_rank_active)
            fprintf(f, "dsv4_kv_slots_in_use{rank=\"%s@%u\"} %u\n", s->ranks[i].role,
                s->ranks[i].index, s->ranks[i].rank_active);
    gw_help(f, "dsv4_kv_slots", "gauge", "KV slots of a rank (its capacity)");
    for (i = 0; i < s->n; i++)
        fprintf(f, "dsv4_kv_slots{rank=\"%s@%u\"} %u\n", s->ranks[i].role,
            s->ranks[i].index, s->ranks[i].capacity);
    gw_render_call_rows(f, s, false);
    gw_render_call_rows(f, s, true);
    gw_help(f, "dsv4_decode_graphs_refused", "gauge",
        "Kinds of decode step (batch sizes) a decode rank runs without a CUDA graph because "
        "no device memory was left to make one (its last HEARTBEAT)");
    for (i = 0; i < s->n; i++)
        if (s->ranks[i].has_graphs_refused)
            fprintf(f, "dsv4_decode_graphs_refused{rank=\"%s@%u\"} %u\n", s->ranks[i].role,
                s->ranks[i].index, s->ranks[i].graphs_refused);
}

char *
gw_metrics_render(struct gw *g, size_t *len)
{
    struct gw_metrics m;
    struct gw_sched *s;
    char *buf = NULL;
    FILE *f;

    if ((s = malloc(sizeof(*s))) == NULL)
        return NULL;
    gw_sched_query(g, s);
    pthread_mutex_lock(&g->mlock);
    m = g->m;
    pthread_mutex_unlock(&g->mlock);
    if ((f = open_memstream(&buf, len)) == NULL) {
        free(s);
        return NULL;
    }
    gw_render_gateway(f, &m);
    gw_render_sched(f, s);
    fclose(f);
    free(s);
    return buf;
}
