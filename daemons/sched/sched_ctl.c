/*
 * sched_ctl.c — dsv4-sched: the admin sub-protocol (docs/protocol.md §7) on
 * the admin ROUTER, used by dsv4ctl: status with metrics, rank and request
 * listings (items, then _END with the count, ntpd style), drain and undrain,
 * cancel of one request; the handoff-time histogram that STATUS reports.
 *
 * Runs in the scheduler's only thread.  A DRAIN is answered later: the wait
 * is kept until the drained work has finished (RESULT 200) or its timeout
 * passed (RESULT 408); ctl_timers checks the waits every loop turn.  A
 * malformed admin message gets RESULT 400 and changes nothing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "common/log.h"
#include "daemons/sched/sched.h"

static void
send_result(struct sched *s, const struct dsv4_route *to, uint16_t code, const char *text)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_RESULT);
    m.u.error.code = code;
    m.u.error.message = text;
    if (dsv4_zsock_send(s->admin, to, &m, ZMQ_DONTWAIT, NULL) != DSV4_OK)
        log_info("ctl: result not sent: %s", dsv4_errmsg());
}

static const uint64_t handoff_bounds_us[DSV4_PROTO_HANDOFF_BUCKETS] =
    DSV4_PROTO_HANDOFF_BOUNDS_US;

void
ctl_handoff_observe(struct sched_metrics *m, uint64_t us)
{
    for (int i = DSV4_PROTO_HANDOFF_BUCKETS - 1; i >= 0 && us <= handoff_bounds_us[i]; i--)
        m->handoff_le[i]++;
    m->handoff_sum_us += us;
    m->handoff_count++;
}

int64_t
ctl_now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void
show_status(struct sched *s, const struct dsv4_route *to)
{
    struct dsv4_ctl_status *st;
    struct sched_rank *k;
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_STATUS);
    st = &m.u.status;
    st->version = SCHED_VERSION;
    st->uptime_ms = (uint64_t)(dsv4_now_ms() - s->start_ms);
    st->draining = s->draining || s->stopping;
    /* the model every rank must run: the checkpoint's, else the live
     * registered ranks' (all the same: the scheduler refuses any other) */
    st->model = s->model_ref[0] != '\0' ? s->model_ref : NULL;
    TAILQ_FOREACH(k, &s->ranks, entry) {
        if (k->state == DSV4_RANK_STATE_DEAD)
            continue;
        if (st->model == NULL && k->model[0] != '\0')
            st->model = k->model;
        st->n_ranks++;
        if (k->state == DSV4_RANK_STATE_READY)
            st->n_ranks_ready++;
        /* MTP totals: one rank per group (all of a group run the same steps) */
        if (k->has_mtp && k->group_rank == 0) {
            st->mtp_drafts += k->mtp_drafts;
            st->mtp_accepted += k->mtp_accepted;
            st->has_mtp = true;
        }
    }
    st->n_queued = s->n_queued;
    st->n_running = s->n_live;
    st->n_done = s->m.n_done;
    st->n_failed = s->m.n_failed;
    st->n_cancelled = s->m.n_cancelled;
    st->n_rejected = s->m.n_rejected;
    st->tokens_in = s->m.tokens_in;
    st->tokens_out = s->m.tokens_out;
    st->handoffs = s->m.handoffs;
    st->reruns = s->m.reruns;
    st->rank_deaths = s->m.rank_deaths;
    st->has_metrics = true;
    st->handoff_buckets = s->m.handoff_le;
    st->n_handoff_buckets = DSV4_PROTO_HANDOFF_BUCKETS;
    st->handoff_sum_us = s->m.handoff_sum_us;
    st->handoff_count = s->m.handoff_count;
    st->has_handoff = true;
    (void)dsv4_zsock_send(s->admin, to, &m, ZMQ_DONTWAIT, NULL);
}

static void
send_count(struct sched *s, const struct dsv4_route *to, int cmd, uint32_t n)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CTL, cmd);
    m.u.count.count = n;
    (void)dsv4_zsock_send(s->admin, to, &m, ZMQ_DONTWAIT, NULL);
}

static void
show_ranks(struct sched *s, const struct dsv4_route *to)
{
    int64_t now = dsv4_now_ms();
    struct sched_rank *k;
    uint32_t n = 0;

    rank_update_states(s);
    TAILQ_FOREACH(k, &s->ranks, entry) {
        struct dsv4_msg m;

        dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_RANK);
        m.u.rank.role = k->role;
        m.u.rank.index = k->index;
        m.u.rank.group = k->group;
        m.u.rank.group_rank = k->group_rank;
        m.u.rank.host = k->host;
        m.u.rank.state = k->state;
        m.u.rank.active = rank_load(k, s);
        m.u.rank.capacity = k->capacity;
        m.u.rank.last_seen_ms = (uint64_t)(now - k->live.last_rx_ms);
        m.u.rank.rank_active = k->reported_active;
        m.u.rank.has_rank_active = true;
        m.u.rank.mtp_drafts = k->mtp_drafts;
        m.u.rank.mtp_accepted = k->mtp_accepted;
        m.u.rank.has_mtp = k->has_mtp;
        m.u.rank.burst = k->burst;
        m.u.rank.placed = k->placed;
        m.u.rank.device = k->device[0] != '\0' ? k->device : NULL;
        m.u.rank.call_rows = k->call_rows;
        m.u.rank.call_rows_full = k->call_rows_full;
        m.u.rank.has_call_rows = k->call_rows != 0;
        m.u.rank.graphs_refused = k->graphs_refused;
        m.u.rank.has_graphs_refused = k->has_graphs_refused;
        m.u.rank.model = k->model[0] != '\0' ? k->model : NULL;
        (void)dsv4_zsock_send(s->admin, to, &m, ZMQ_DONTWAIT, NULL);
        n++;   /* the listing's size: dsv4ctl tells a cut listing by it */
    }
    send_count(s, to, DSV4_CTL_RANKS_END, n);
}

static uint32_t
send_requests(struct sched *s, const struct dsv4_route *to, struct sched_req_list *l,
    int64_t now)
{
    struct sched_req *r;
    uint32_t n = 0;

    TAILQ_FOREACH(r, l, qentry) {
        struct dsv4_msg m;

        dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_REQUEST);
        m.u.request.req = r->req;
        m.u.request.state = r->state;
        m.u.request.tag = r->tag;
        m.u.request.prompt_tokens = r->n_prompt;
        m.u.request.completion_tokens = r->n_out;
        m.u.request.age_ms = (uint64_t)(now - r->t_recv_ms);
        if (r->pre.g != NULL) {
            m.u.request.prefill_group = r->pre.g->id;
            m.u.request.has_prefill_group = true;
        }
        if (r->dec.g != NULL) {
            m.u.request.decode_group = r->dec.g->id;
            m.u.request.has_decode_group = true;
        }
        m.u.request.reruns = r->reruns;
        (void)dsv4_zsock_send(s->admin, to, &m, ZMQ_DONTWAIT, NULL);
        n++;   /* the listing's size: dsv4ctl tells a cut listing by it */
    }
    return n;
}

static void
show_requests(struct sched *s, const struct dsv4_route *to)
{
    int64_t now = dsv4_now_ms();
    uint32_t n = send_requests(s, to, &s->live, now);

    n += send_requests(s, to, &s->queue, now);
    send_count(s, to, DSV4_CTL_REQUESTS_END, n);
}

/* Has the work a drain waits for finished? */
static bool
drain_done(struct sched *s, const struct sched_drain_wait *w)
{
    if (w->rank == NULL)
        return s->n_queued == 0 && s->n_live == 0;
    return rank_load(w->rank, s) == 0;
}

static void
on_drain(struct sched *s, const struct dsv4_route *to, const struct dsv4_ctl_drain *d)
{
    struct sched_drain_wait *w;
    struct sched_rank *k = NULL;
    char text[96];

    if (strcmp(d->target, "all") != 0 && (k = rank_by_name(s, d->target)) == NULL) {
        snprintf(text, sizeof(text), "no rank named '%s'", d->target);
        send_result(s, to, DSV4_STATUS_NOT_FOUND, text);
        return;
    }
    if ((w = calloc(1, sizeof(*w))) == NULL) {
        send_result(s, to, DSV4_STATUS_NO_MEMORY, "out of memory");
        return;
    }
    if (k == NULL) {
        s->draining = true;
        log_notice("ctl: drain all: admitting nothing new");
    } else {
        k->drain = true;
        log_notice("ctl: drain %s", d->target);
    }
    rank_update_states(s);
    w->route = *to;
    w->rank = k;
    w->deadline_ms = d->timeout_ms != 0 ? dsv4_now_ms() + d->timeout_ms : 0;
    TAILQ_INSERT_TAIL(&s->drains, w, entry);
}

/* An UNDRAIN of rank k (NULL: of all) ends the drains it lifts: their waits
 * are answered now (RESULT 409), not later as if the drain had held. */
static void
undrain_waits(struct sched *s, const struct sched_rank *k)
{
    struct sched_drain_wait *w, *tmp;

    TAILQ_FOREACH_SAFE(w, &s->drains, entry, tmp) {
        if (k != NULL && w->rank != k)
            continue;
        send_result(s, &w->route, DSV4_STATUS_CANCELLED,
            "undrained before the drained work finished");
        TAILQ_REMOVE(&s->drains, w, entry);
        free(w);
    }
}

static void
on_undrain(struct sched *s, const struct dsv4_route *to, const struct dsv4_ctl_drain *d)
{
    struct sched_rank *k;
    char text[96];

    if (strcmp(d->target, "all") == 0) {
        s->draining = false;
        TAILQ_FOREACH(k, &s->ranks, entry)
            k->drain = false;
    } else if ((k = rank_by_name(s, d->target)) != NULL) {
        k->drain = false;
    } else {
        snprintf(text, sizeof(text), "no rank named '%s'", d->target);
        send_result(s, to, DSV4_STATUS_NOT_FOUND, text);
        return;
    }
    log_notice("ctl: undrain %s", d->target);
    rank_update_states(s);
    undrain_waits(s, strcmp(d->target, "all") == 0 ? NULL : k);
    send_result(s, to, DSV4_STATUS_OK, "undrained");
}

int64_t
ctl_timers(struct sched *s, int64_t now)
{
    struct sched_drain_wait *w, *tmp;
    int64_t next = -1;

    TAILQ_FOREACH_SAFE(w, &s->drains, entry, tmp) {
        if (drain_done(s, w)) {
            send_result(s, &w->route, DSV4_STATUS_OK, "drained");
        } else if (w->deadline_ms != 0 && now >= w->deadline_ms) {
            send_result(s, &w->route, DSV4_STATUS_TIMEOUT,
                "timeout passed before the drained work finished");
        } else {
            if (w->deadline_ms != 0 && (next < 0 || w->deadline_ms - now < next))
                next = w->deadline_ms - now;
            continue;
        }
        TAILQ_REMOVE(&s->drains, w, entry);
        free(w);
    }
    return next;
}

/* A rank entry is about to be freed: its drain waits follow `heir` (the
 * same rank registered again) or are answered now. */
void
ctl_rank_gone(struct sched *s, struct sched_rank *k, struct sched_rank *heir)
{
    struct sched_drain_wait *w, *tmp;

    TAILQ_FOREACH_SAFE(w, &s->drains, entry, tmp) {
        if (w->rank != k)
            continue;
        if (heir != NULL) {
            w->rank = heir;
            continue;
        }
        send_result(s, &w->route, DSV4_STATUS_OK, "rank gone");
        TAILQ_REMOVE(&s->drains, w, entry);
        free(w);
    }
}

/* The request in flight (queued or live) whose scheduler id is `req`: the
 * id REQUEST lists, which stays the same across re-runs.  NULL when none. */
static struct sched_req *
req_in_flight(struct sched *s, uint64_t req)
{
    struct sched_req *r;

    TAILQ_FOREACH(r, &s->live, qentry)
        if (r->req == req)
            return r;
    TAILQ_FOREACH(r, &s->queue, qentry)
        if (r->req == req)
            return r;
    return NULL;
}

/* CANCEL: the request ends as its client's CANCEL would end it (finish
 * "cancelled", its ranks told to drop it); one already ending is left to
 * end. */
static void
on_cancel(struct sched *s, const struct dsv4_route *to, uint64_t req)
{
    struct sched_req *r = req_in_flight(s, req);
    char text[96];

    if (r == NULL) {
        snprintf(text, sizeof(text), "no request %llu in flight", (unsigned long long)req);
        send_result(s, to, DSV4_STATUS_NOT_FOUND, text);
        return;
    }
    if (r->closing) {
        snprintf(text, sizeof(text), "request %llu is ending already",
            (unsigned long long)req);
    } else {
        log_notice("ctl: request %llu (%s) cancelled from the admin socket",
            (unsigned long long)req, dsv4_req_state_name(r->state));
        req_cancel(s, r);
        snprintf(text, sizeof(text), "request %llu cancelled", (unsigned long long)req);
    }
    send_result(s, to, DSV4_STATUS_OK, text);
}

/* RELOAD: what SIGHUP does (sched_reload.c), answered with its outcome. */
static void
on_reload(struct sched *s, const struct dsv4_route *to)
{
    char msg[DSV4_PROTO_MAX_MESSAGE / 2];

    log_notice("ctl: reload asked from the admin socket");
    if (s->stopping) {
        send_result(s, to, DSV4_STATUS_DRAINING, "the scheduler is stopping");
        return;
    }
    send_result(s, to, sched_reload(s, msg, sizeof(msg)) == 0 ? DSV4_STATUS_OK :
        DSV4_STATUS_INTERNAL, msg);
}

void
ctl_dispatch(struct sched *s)
{
    for (int i = 0; i < 64; i++) {
        struct dsv4_route from;
        struct dsv4_perr pe;
        struct dsv4_msg m;
        enum dsv4_err e;

        e = dsv4_zsock_recv(s->admin, &from, &m, &pe, ZMQ_DONTWAIT);
        if (e == DSV4_ERR_BUSY)
            return;
        if (e == DSV4_ERR_PROTO || e == DSV4_ERR_INVAL) {
            log_info("ctl: refused message: %u %s", pe.code, pe.message);
            if (pe.sub != DSV4_SUB_NONE)
                send_result(s, &from, pe.code, pe.message);
            continue;
        }
        if (e != DSV4_OK) {
            log_warnx("ctl: receive: %s", dsv4_errmsg());
            return;
        }
        if (m.sub != DSV4_SUB_CTL) {
            send_result(s, &from, DSV4_STATUS_BAD_MESSAGE, "not an admin message");
        } else {
            switch (m.cmd) {
            case DSV4_CTL_SHOW_STATUS:
                show_status(s, &from);
                break;
            case DSV4_CTL_SHOW_RANKS:
                show_ranks(s, &from);
                break;
            case DSV4_CTL_SHOW_REQUESTS:
                show_requests(s, &from);
                break;
            case DSV4_CTL_DRAIN:
                on_drain(s, &from, &m.u.drain);
                break;
            case DSV4_CTL_UNDRAIN:
                on_undrain(s, &from, &m.u.drain);
                break;
            case DSV4_CTL_CANCEL:
                on_cancel(s, &from, m.u.ref.req);
                break;
            case DSV4_CTL_RELOAD:
                on_reload(s, &from);
                break;
            default:
                send_result(s, &from, DSV4_STATUS_BAD_MESSAGE,
                    "unexpected command on the admin socket");
                break;
            }
        }
        dsv4_msg_clear(&m);
    }
}

void
ctl_free_all(struct sched *s)
{
    struct sched_drain_wait *w;

    while ((w = TAILQ_FIRST(&s->drains)) != NULL) {
        send_result(s, &w->route, DSV4_STATUS_INTERNAL, "scheduler stopping");
        TAILQ_REMOVE(&s->drains, w, entry);
        free(w);
    }
}
