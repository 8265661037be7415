/*
 * sched_rank.c — dsv4-sched: the rank sub-protocol (docs/protocol.md §6) on
 * the rank ROUTER, and the rank registry: registration (READY/WELCOME),
 * groups, heartbeats, death detection, and the handlers that move requests
 * from prefill to decode (PREFILL_DONE -> DECODE -> KV_RELEASE) and turn
 * decode TOKENS into output.
 *
 * Runs in the scheduler's only thread.  Trust: a rank is a sibling process,
 * but a malformed or out-of-turn message from it still never crashes the
 * scheduler: the rank is disconnected and its work re-run elsewhere.  A rank
 * that sends READY again (restart, or after DISCONNECT) has lost its state,
 * so everything it held is treated as lost at that moment.  A dead rank stays
 * listed as "dead" until it registers again.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "common/log.h"
#include "daemons/sched/sched.h"

#define RANK_BATCH 512 /* messages handled per poll wake-up */

const char *
rank_name(const struct sched_rank *k, char *buf, size_t len)
{
    snprintf(buf, len, "%s@%u", dsv4_role_name(k->role) ? dsv4_role_name(k->role) : "?",
        k->index);
    return buf;
}

struct sched_rank *
rank_by_name(struct sched *s, const char *name)
{
    struct sched_rank *k;
    char buf[48];

    TAILQ_FOREACH(k, &s->ranks, entry) {
        if (strcmp(rank_name(k, buf, sizeof(buf)), name) == 0)
            return k;
    }
    return NULL;
}

static struct sched_rank *
rank_by_route(struct sched *s, const struct dsv4_route *route)
{
    struct sched_rank *k;

    TAILQ_FOREACH(k, &s->ranks, entry) {
        if (k->state != DSV4_RANK_STATE_DEAD && k->route.len == route->len &&
            memcmp(k->route.id, route->id, route->len) == 0)
            return k;
    }
    return NULL;
}

static struct sched_group *
group_of(struct sched *s, const struct sched_rank *k)
{
    return queue_group_find(&s->groups, k->role, k->group);
}

uint32_t
rank_load(const struct sched_rank *k, struct sched *s)
{
    struct sched_group *g = group_of(s, k);

    return g != NULL && k->state != DSV4_RANK_STATE_DEAD ? g->load : 0;
}

/* Recompute what a group offers from its members. */
static void
group_update(struct sched *s, struct sched_group *g)
{
    uint32_t cap = UINT32_MAX, ctx = UINT32_MAX, tr = UINT32_MAX, n_burst = 0, rows = 0;

    g->n_ranks = 0;
    for (uint32_t i = 0; i < g->size; i++) {
        struct sched_rank *k = g->ranks[i];

        if (k == NULL)
            continue;
        g->n_ranks++;
        cap = k->capacity < cap ? k->capacity : cap;
        ctx = k->max_ctx < ctx ? k->max_ctx : ctx;
        tr &= k->transports;
        n_burst += k->burst;
        if (k->call_rows != 0 && (rows == 0 || k->call_rows < rows))
            rows = k->call_rows;
    }
    g->call_rows = rows;
    /* A group is a burst group when every rank present says so. */
    if (n_burst > 0 && n_burst < g->n_ranks)
        log_warnx("group %s/%u: %u of its %u ranks are burst ranks: the group is taken as a "
            "plain prefill group (set burst on all of them or none)",
            dsv4_role_name(g->role), g->id, n_burst, g->n_ranks);
    g->burst = g->n_ranks > 0 && n_burst == g->n_ranks;
    if (g->n_ranks == 0) {
        g->capacity = 0;
        g->max_ctx = 0;
        g->transports = 0;
        return;
    }
    if (g->role == DSV4_ROLE_DECODE && cap > (uint32_t)s->cfg.file.max_batch)
        cap = (uint32_t)s->cfg.file.max_batch;
    /* A complete group of several ranks needs a communicator for its epoch:
     * ask rank 0 for an id (docs/protocol.md §6.4). */
    if (g->size > 1 && g->n_ranks == g->size && g->comm_ready != g->epoch &&
        g->comm_asked != g->epoch && g->ranks[0] != NULL) {
        struct dsv4_msg cm;

        dsv4_msg_init(&cm, DSV4_SUB_RANK, DSV4_RANK_COMM);
        cm.u.comm.comm_epoch = g->epoch;
        cm.u.comm.one_host = true;
        for (uint32_t i = 1; i < g->size; i++)
            if (strcmp(g->ranks[i]->host, g->ranks[0]->host) != 0)
                cm.u.comm.one_host = false;
        rank_send(s, g->ranks[0], &cm);
        g->comm_asked = g->epoch;
        log_info("group %s/%u complete (epoch %u): asking rank 0 for a communicator id",
            dsv4_role_name(g->role), g->id, g->epoch);
    }
    g->capacity = cap;
    g->max_ctx = ctx;
    g->max_ctx_last = ctx;
    g->transports = tr;
    if (g->role == DSV4_ROLE_DECODE && g->n_slots < cap) {
        uint8_t *sl = realloc(g->slots, cap);

        if (sl == NULL) {
            g->capacity = g->n_slots;
            return;
        }
        memset(sl + g->n_slots, 0, cap - g->n_slots);
        g->slots = sl;
        g->n_slots = cap;
    }
}

/* Has rank k of (complete) group g joined the communicator of g's epoch?
 * Alone: yes.  In a group: once the epoch's COMM is out and, for a rank
 * that reports comm_epoch in its HEARTBEATs, once it reported this epoch. */
static bool
rank_joined(const struct sched_rank *k, const struct sched_group *g)
{
    if (g->size <= 1)
        return true;
    if (g->comm_ready != g->epoch)
        return false;
    return !k->has_comm_epoch || k->comm_epoch == g->epoch;
}

void
rank_groups_update(struct sched *s)
{
    struct sched_group *g;

    TAILQ_FOREACH(g, &s->groups, entry)
        group_update(s, g);
}

void
rank_update_states(struct sched *s)
{
    struct sched_rank *k;

    TAILQ_FOREACH(k, &s->ranks, entry) {
        struct sched_group *g;

        if (k->state == DSV4_RANK_STATE_DEAD)
            continue;
        g = group_of(s, k);
        if (g == NULL || g->n_ranks != g->size || !rank_joined(k, g))
            k->state = DSV4_RANK_STATE_JOINING;
        else if (k->drain || k->leaving)
            k->state = g->load == 0 ? DSV4_RANK_STATE_DRAINED : DSV4_RANK_STATE_DRAINING;
        else
            k->state = DSV4_RANK_STATE_READY;
    }
}

void
rank_tell_leavers(struct sched *s)
{
    struct sched_rank *k;

    TAILQ_FOREACH(k, &s->ranks, entry) {
        struct sched_group *g;
        struct dsv4_msg m;

        if (!k->leaving || k->leave_told || k->state == DSV4_RANK_STATE_DEAD)
            continue;
        g = group_of(s, k);
        if (g == NULL || g->load != 0)
            continue;
        /* nothing booked on its group any more (requests still in prefill
         * count): the stopping rank may go (protocol §6) */
        dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DRAIN_DONE);
        if (rank_send(s, k, &m) == DSV4_OK)
            k->leave_told = true;
    }
}

/* --- Sending --------------------------------------------------------------------- */

enum dsv4_err
rank_send(struct sched *s, struct sched_rank *k, const struct dsv4_msg *m)
{
    struct dsv4_perr pe;
    enum dsv4_err e;
    char nb[48];

    if (k->state == DSV4_RANK_STATE_DEAD)
        return DSV4_OK;
    e = dsv4_zsock_send(s->rank, &k->route, m, ZMQ_DONTWAIT, &pe);
    if (e == DSV4_OK) {
        dsv4_liveness_tx(&k->live, dsv4_now_ms());
        return DSV4_OK;
    }
    log_warnx("rank %s: %s not sent: %s", rank_name(k, nb, sizeof(nb)),
        dsv4_proto_cmd_name(m->sub, m->cmd), dsv4_errmsg());
    /* Handled from the timers, not here: the caller may be iterating. */
    if (e == DSV4_ERR_SYS || e == DSV4_ERR_BUSY)
        k->unreachable = true;
    return e == DSV4_ERR_PROTO ? e : DSV4_OK;
}

enum dsv4_err
rank_send_group(struct sched *s, struct sched_group *g, const struct dsv4_msg *m)
{
    enum dsv4_err e = DSV4_OK;

    for (uint32_t i = 0; i < g->size; i++) {
        if (g->ranks[i] != NULL && rank_send(s, g->ranks[i], m) == DSV4_ERR_PROTO)
            e = DSV4_ERR_PROTO;
    }
    return e;
}

void
rank_send_ref(struct sched *s, struct sched_group *g, int cmd, uint64_t req)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_RANK, cmd);
    m.u.ref.req = req;
    rank_send_group(s, g, &m);
}

static void
send_disconnect(struct sched *s, const struct dsv4_route *to, const char *reason)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DISCONNECT);
    m.u.disconnect.reason = reason;
    (void)dsv4_zsock_send(s->rank, to, &m, ZMQ_DONTWAIT, NULL);
}

/* --- Death ----------------------------------------------------------------------- */

/*
 * Rank `k` is gone (liveness expired, DISCONNECT, re-registration, malformed
 * message): take it out of its group and re-run or release every request its
 * group held.  The group keeps its other members, but is incomplete and gets
 * no work until the rank is back.
 */
static void
rank_lost(struct sched *s, struct sched_rank *k, const char *why)
{
    struct sched_group *g = group_of(s, k);
    struct sched_req *r, *tmp;
    char nb[48];

    if (k->state == DSV4_RANK_STATE_DEAD)
        return;
    log_notice("rank %s lost: %s", rank_name(k, nb, sizeof(nb)), why);
    s->m.rank_deaths++;
    k->state = DSV4_RANK_STATE_DEAD;
    k->unreachable = false;
    if (g != NULL) {
        if (k->group_rank < g->size && g->ranks[k->group_rank] == k)
            g->ranks[k->group_rank] = NULL;
        group_update(s, g);
        TAILQ_FOREACH_SAFE(r, &s->live, qentry, tmp) {
            if (r->pre.g == g || r->dec.g == g)
                req_rank_lost(s, r, g);
        }
    }
    rank_update_states(s);
}

int64_t
rank_timers(struct sched *s, int64_t now)
{
    struct sched_rank *k;
    int64_t next = -1;

    TAILQ_FOREACH(k, &s->ranks, entry) {
        int64_t t;

        if (k->state == DSV4_RANK_STATE_DEAD)
            continue;
        if (k->unreachable) {
            send_disconnect(s, &k->route, "unreachable");
            rank_lost(s, k, "unreachable");
            continue;
        }
        if (dsv4_liveness_dead(&k->live, now)) {
            send_disconnect(s, &k->route, "heartbeat timeout");
            rank_lost(s, k, "no message within the liveness interval");
            continue;
        }
        if (dsv4_liveness_due(&k->live, now)) {
            struct dsv4_msg m;

            dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
            m.u.heartbeat.active = rank_load(k, s);
            rank_send(s, k, &m);
        }
        t = dsv4_liveness_next_ms(&k->live, now);
        if (next < 0 || t < next)
            next = t;
    }
    return next;
}

/* --- Registration ------------------------------------------------------------------ */

static struct sched_group *
group_get(struct sched *s, enum dsv4_role role, uint32_t id)
{
    struct sched_group *g = queue_group_find(&s->groups, role, id);

    if (g != NULL)
        return g;
    if ((g = calloc(1, sizeof(*g))) == NULL)
        return NULL;
    g->role = role;
    g->id = id;
    TAILQ_INSERT_TAIL(&s->groups, g, entry);
    return g;
}

/* Forget entry `k`; drain waits on it move to `heir` (same name) if any. */
static void
rank_remove(struct sched *s, struct sched_rank *k, struct sched_rank *heir)
{
    rank_lost(s, k, "replaced by a new registration");
    ctl_rank_gone(s, k, heir);
    TAILQ_REMOVE(&s->ranks, k, entry);
    free(k);
}

/* Answer READY with DISCONNECT {why}, and say so in the journal: the rank
 * is misconfigured (it registers again after a growing pause). */
static void
refuse_ready(struct sched *s, const struct dsv4_route *from, const struct dsv4_rank_ready *m,
    const char *why)
{
    log_warnx("READY of %s@%u (group %u, rank %u/%u, pid %u) refused: %s",
        dsv4_role_name(m->role), (unsigned)m->index, (unsigned)m->group,
        (unsigned)m->group_rank, (unsigned)m->group_size, (unsigned)m->pid, why);
    send_disconnect(s, from, why);
}

/*
 * Whether `old`, a registration that READY `m` (from another link) would
 * replace, belongs to a process that still runs.  Replacing a live one
 * makes two processes of one name (or seat) take turns: the replaced one
 * is told nothing, its next HEARTBEAT gets DISCONNECT "not registered", it
 * registers again and replaces the other, at every heartbeat, each time
 * dropping its group's requests.  Gone: its liveness expired, or it is the
 * same process (host and pid) on a new socket, or its link no longer
 * reaches a process: a HEARTBEAT to it (harmless to a live rank) fails
 * once its socket closed, as a killed process's does at once (a rank
 * restarted after kill -9 replaces it).  A host that died without closing
 * its connections keeps the link until the liveness expires.  `where` gets
 * the old one's host and pid.
 */
static bool
holder_alive(struct sched *s, const struct sched_rank *old, const struct dsv4_rank_ready *m,
    char *where, size_t len)
{
    struct dsv4_msg hb;

    if (old->state == DSV4_RANK_STATE_DEAD)
        return false;
    if (old->pid != 0 && old->pid == m->pid && strcmp(old->host, m->host) == 0)
        return false;
    snprintf(where, len, "host %s, pid %u", old->host, (unsigned)old->pid);
    dsv4_msg_init(&hb, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
    return dsv4_zsock_send(s->rank, &old->route, &hb, ZMQ_DONTWAIT, NULL) == DSV4_OK;
}

/* How READY `m`, received from link `from`, relates to registration `k`:
 * the same link, else the same rank name, else the same group seat. */
enum ready_rel { REL_NONE, REL_ROUTE, REL_NAME, REL_SEAT };

static enum ready_rel
ready_rel(const struct sched_rank *k, const struct dsv4_route *from,
    const struct dsv4_rank_ready *m)
{
    if (k->route.len == from->len && memcmp(k->route.id, from->id, from->len) == 0)
        return REL_ROUTE;
    if (k->role == m->role && k->index == m->index)
        return REL_NAME;
    if (k->role == m->role && k->group == m->group && k->group_rank == m->group_rank)
        return REL_SEAT;
    return REL_NONE;
}

/* Whether READY `m` would replace a live registration other than one on
 * its own link; if so, why says which (and m is refused). */
static bool
ready_conflict(struct sched *s, const struct dsv4_route *from,
    const struct dsv4_rank_ready *m, char *why, size_t len)
{
    const struct sched_rank *old;
    char where[320], nb[48];

    TAILQ_FOREACH(old, &s->ranks, entry) {
        enum ready_rel rel = ready_rel(old, from, m);

        if (rel == REL_NONE || rel == REL_ROUTE || !holder_alive(s, old, m, where,
            sizeof(where)))
            continue;
        if (rel == REL_NAME)
            snprintf(why, len, "rank %s is registered already (%s) and alive: a rank's "
                "name must be unique", rank_name(old, nb, sizeof(nb)), where);
        else
            snprintf(why, len, "group %s/%u's rank %u is held by %s (%s), alive",
                dsv4_role_name(m->role), (unsigned)m->group, (unsigned)m->group_rank,
                rank_name(old, nb, sizeof(nb)), where);
        return true;
    }
    return false;
}

/* Whether READY `m` runs another model than the scheduler's reference
 * (sched.model_ref) or, without one, than a live registered rank (both
 * saying theirs) other than the registrations it replaces (its link, its
 * name, its seat); if so, why says which.  A prefill rank of one model
 * handing its decode state to a decode rank of another would stream text
 * of neither, without any error. */
static bool
model_conflict(struct sched *s, const struct dsv4_route *from,
    const struct dsv4_rank_ready *m, char *why, size_t len)
{
    const struct sched_rank *k;
    char nb[48];

    if (m->model == NULL)
        return false;
    if (s->model_ref[0] != '\0') {
        if (strcmp(m->model, s->model_ref) == 0)
            return false;
        snprintf(why, len, "model %s differs from the model %s of checkpoint %.400s, which this "
            "scheduler is configured with: every rank must run it", m->model, s->model_ref,
            s->cfg.file.checkpoint);
        return true;
    }
    TAILQ_FOREACH(k, &s->ranks, entry) {
        if (k->state == DSV4_RANK_STATE_DEAD || k->model[0] == '\0' ||
            strcmp(k->model, m->model) == 0 || ready_rel(k, from, m) != REL_NONE)
            continue;
        snprintf(why, len, "model %s differs from the model %s of %s, registered: every rank "
            "must run the same model (to change it, restart the whole set)", m->model,
            k->model, rank_name(k, nb, sizeof(nb)));
        return true;
    }
    return false;
}

/* Whether READY `m` comes from a build whose rank-to-rank exchanges
 * (DSV4_RANK_ABI: a group's collectives, the decode state's layout) differ
 * from a live registered rank's, other than the registrations it replaces;
 * if so, why says which.  Every rank is compared, not only the group's: a
 * prefill rank hands its state to every decode group. */
static bool
abi_conflict(struct sched *s, const struct dsv4_route *from,
    const struct dsv4_rank_ready *m, char *why, size_t len)
{
    const struct sched_rank *k;
    char nb[48];

    TAILQ_FOREACH(k, &s->ranks, entry) {
        if (k->state == DSV4_RANK_STATE_DEAD || k->abi == m->abi ||
            ready_rel(k, from, m) != REL_NONE)
            continue;
        snprintf(why, len, "abi %u differs from the abi %u of %s, registered (%s): ranks of "
            "two builds would hang in a group's collectives or hand over decode state the "
            "other cannot read; every rank must run a build of the same abi (to change it, "
            "restart the whole set)", (unsigned)m->abi, (unsigned)k->abi,
            rank_name(k, nb, sizeof(nb)), k->abi == 0 ? "an older build" : "another build");
        return true;
    }
    return false;
}

/* Whether READY `m` names another group size than its group's ranks that
 * it does not replace (those of its link, name or seat); if so, why says
 * which.  Checked before anything is replaced, so that a refused READY
 * leaves the registrations it would have replaced, and a drain of its
 * name, as they were; a rank restarting alone into a group of another
 * size (nothing else of the group registered) is taken. */
static bool
size_conflict(struct sched *s, const struct dsv4_route *from,
    const struct dsv4_rank_ready *m, char *why, size_t len)
{
    const struct sched_group *g = queue_group_find(&s->groups, m->role, m->group);

    if (g == NULL || g->size == m->group_size)
        return false;
    for (uint32_t i = 0; i < g->size; i++) {
        if (g->ranks[i] == NULL || ready_rel(g->ranks[i], from, m) != REL_NONE)
            continue;
        snprintf(why, len, "group_size %u differs from the %u of group %s/%u's other ranks",
            (unsigned)m->group_size, (unsigned)g->size, dsv4_role_name(m->role),
            (unsigned)m->group);
        return true;
    }
    return false;
}

static void
on_ready(struct sched *s, const struct dsv4_route *from, const struct dsv4_rank_ready *m)
{
    struct sched_rank *k, *old, *tmp;
    struct sched_group *g;
    struct dsv4_msg w;
    char nb[48], why[1024];

    if (m->group_rank >= m->group_size || m->group_size > SCHED_MAX_GROUP) {
        /* (the protocol's bounds refuse group_rank >= group_size already) */
        snprintf(why, sizeof(why), "group_size %u with group_rank %u: a group has at most %d "
            "ranks, numbered from 0", (unsigned)m->group_size, (unsigned)m->group_rank,
            SCHED_MAX_GROUP);
        refuse_ready(s, from, m, why);
        return;
    }
    if (m->role == DSV4_ROLE_PREFILL && m->group_size > DSV4_PROTO_MAX_KV_PARTS) {
        /* each rank exports its part of the decode state, and a handoff
         * carries at most that many parts */
        snprintf(why, sizeof(why), "group_size %u: a prefill group has at most %d ranks",
            (unsigned)m->group_size, DSV4_PROTO_MAX_KV_PARTS);
        refuse_ready(s, from, m, why);
        return;
    }
    if (ready_conflict(s, from, m, why, sizeof(why)) ||
        size_conflict(s, from, m, why, sizeof(why)) ||
        model_conflict(s, from, m, why, sizeof(why)) ||
        abi_conflict(s, from, m, why, sizeof(why))) {
        refuse_ready(s, from, m, why);
        return;
    }
    if ((k = calloc(1, sizeof(*k))) == NULL)
        return;
    /* Whatever was registered under this link, name or group seat is gone;
     * a drain of the name outlives a restart of the rank. */
    TAILQ_FOREACH_SAFE(old, &s->ranks, entry, tmp) {
        bool same_route = old->route.len == from->len &&
            memcmp(old->route.id, from->id, from->len) == 0;
        bool same_name = old->role == m->role && old->index == m->index;

        if (same_name)
            k->drain = old->drain;
        if ((same_route && old->state != DSV4_RANK_STATE_DEAD) || same_name ||
            (old->role == m->role && old->group == m->group &&
             old->group_rank == m->group_rank && old->state != DSV4_RANK_STATE_DEAD))
            rank_remove(s, old, same_name ? k : NULL);
    }
    g = group_get(s, m->role, m->group);
    /* (size_conflict made sure that the group's ranks left agree) */
    if (g == NULL || (g->n_ranks > 0 && g->size != m->group_size)) {
        if (g == NULL)
            snprintf(why, sizeof(why), "the scheduler is out of memory");
        else
            snprintf(why, sizeof(why), "group_size %u differs from the %u of group %s/%u's "
                "other ranks", (unsigned)m->group_size, (unsigned)g->size,
                dsv4_role_name(m->role), (unsigned)m->group);
        refuse_ready(s, from, m, why);
        ctl_rank_gone(s, k, NULL);
        free(k);
        return;
    }
    k->route = *from;
    k->role = m->role;
    k->index = m->index;
    k->group = m->group;
    k->group_rank = m->group_rank;
    k->group_size = m->group_size;
    k->capacity = m->capacity;
    k->max_ctx = m->max_ctx;
    k->transports = m->transports;
    k->pid = m->pid;
    k->burst = m->role == DSV4_ROLE_PREFILL && m->burst;
    k->call_rows = m->role == DSV4_ROLE_PREFILL && m->has_call_rows ? m->call_rows : 0;
    k->call_rows_full = k->call_rows != 0 ? m->call_rows_full : 0;
    snprintf(k->host, sizeof(k->host), "%s", m->host);
    snprintf(k->device, sizeof(k->device), "%s", m->device != NULL ? m->device : "");
    snprintf(k->model, sizeof(k->model), "%s", m->model != NULL ? m->model : "");
    k->abi = m->abi;
    k->joined_ms = dsv4_now_ms();
    dsv4_liveness_init(&k->live, (uint32_t)s->cfg.file.heartbeat_ms,
        (uint32_t)s->cfg.file.liveness, k->joined_ms);
    TAILQ_INSERT_TAIL(&s->ranks, k, entry);
    g->size = m->group_size;
    g->ranks[m->group_rank] = k;
    g->epoch++;

    dsv4_msg_init(&w, DSV4_SUB_RANK, DSV4_RANK_WELCOME);
    w.u.welcome.heartbeat_ms = (uint32_t)s->cfg.file.heartbeat_ms;
    w.u.welcome.liveness = (uint32_t)s->cfg.file.liveness;
    w.u.welcome.comm_epoch = g->epoch;
    rank_send(s, k, &w);
    group_update(s, g);   /* after WELCOME: it may send COMM to the group */
    rank_update_states(s);
    log_notice("rank %s registered: group %u rank %u/%u capacity %u max_ctx %u host %s%s%s "
        "pid %u%s%s%s", rank_name(k, nb, sizeof(nb)), k->group, k->group_rank, k->group_size,
        k->capacity, k->max_ctx, k->host, k->device[0] != '\0' ? " device " : "", k->device,
        k->pid, k->model[0] != '\0' ? " model " : "", k->model,
        k->burst ? " (burst prefill)" : "");
    if (k->call_rows != 0 && k->call_rows < k->call_rows_full)
        log_warnx("rank %s runs prompts in forward calls of %u rows, lowered from %u (its "
            "warm-up ran out of device memory): longer prompts take several calls",
            rank_name(k, nb, sizeof(nb)), k->call_rows, k->call_rows_full);
}

/* --- Work ---------------------------------------------------------------------------- */

/* Keep a copy of one PREFILL_DONE location for the DECODE message. */
static bool
kv_keep(struct sched_req *r, const struct dsv4_kv_loc *src)
{
    uint32_t i = src->part;
    struct dsv4_kv_loc *dst;
    uint64_t *arr;
    uint8_t *h;

    if (i >= DSV4_PROTO_MAX_KV_PARTS || r->kv_handles[i] != NULL)
        return false;
    arr = malloc(2 * (size_t)src->n_seg * sizeof(uint64_t));
    h = malloc(src->handle_len);
    if (arr == NULL || h == NULL) {
        free(arr);
        free(h);
        return false;
    }
    memcpy(arr, src->sizes, src->n_seg * sizeof(uint64_t));
    memcpy(arr + src->n_seg, src->offsets, src->n_seg * sizeof(uint64_t));
    memcpy(h, src->handle, src->handle_len);
    r->kv_arrays[i] = arr;
    r->kv_handles[i] = h;
    dst = &r->kv.u.decode.kv[i];
    *dst = *src;
    dst->sizes = arr;
    dst->offsets = arr + src->n_seg;
    dst->handle = h;
    return true;
}

static void
send_decode(struct sched *s, struct sched_req *r, uint32_t n_parts)
{
    struct dsv4_rank_decode *d = &r->kv.u.decode;
    uint32_t pos = r->n_prompt + r->n_out - 1;

    r->kv.sub = DSV4_SUB_RANK;
    r->kv.cmd = DSV4_RANK_DECODE;
    d->req = r->rid;
    d->slot = r->slot;
    d->token = r->out[r->n_out - 1];
    d->pos = pos;
    d->max_tokens = r->max_tokens - r->n_out;
    d->s = r->s;
    d->stop_ids = r->stop_ids;
    d->n_stop_ids = r->n_stop_ids;
    d->n_kv = n_parts;
    d->step = r->n_out;
    d->has_step = true;
    r->dec_started = true;
    r->dec.acks = r->dec.g->n_ranks;
    r->state = DSV4_REQ_HANDOFF;
    s->m.handoffs++;
    /* a DECODE that cannot be encoded would leave the request waiting for
     * an answer that never comes */
    if (rank_send_group(s, r->dec.g, &r->kv) == DSV4_ERR_PROTO)
        req_fail(s, r, DSV4_STATUS_INTERNAL, "DECODE could not be encoded: %s", dsv4_errmsg());
}

static void
on_prefill_done(struct sched *s, struct sched_rank *k, struct sched_group *g,
    const struct dsv4_rank_prefill_done *m)
{
    struct sched_req *r = req_find(s, m->req);
    const struct dsv4_kv_loc *loc = &m->kv[0];

    if (r == NULL || r->pre.g != g) {
        /* Stale (re-run elsewhere, or forgotten): free the rank's export. */
        struct dsv4_msg rel;

        dsv4_msg_init(&rel, DSV4_SUB_RANK, DSV4_RANK_KV_RELEASE);
        rel.u.ref.req = m->req;
        rank_send(s, k, &rel);
        return;
    }
    if (r->closing || r->state != DSV4_REQ_PREFILLING)
        return; /* ABORT is on its way; ABORT_DONE releases it */
    if (loc->n_parts != g->size || !kv_keep(r, loc)) {
        req_rank_error(s, r, g, DSV4_STATUS_INTERNAL, "bad KV location parts");
        return;
    }
    if (k->group_rank == 0) {
        r->first_token = m->token;
        r->first_lp = m->logprob;
        r->first_has_lp = m->has_logprob;
        r->first_n_top = m->top_ids != NULL ? m->n_top : 0;
        if (r->first_n_top > 0) {
            memcpy(r->first_top_ids, m->top_ids, r->first_n_top * sizeof(int32_t));
            memcpy(r->first_top_lp, m->top_logprobs, r->first_n_top * sizeof(float));
        }
    }
    r->kv_parts++;
    if (r->pre.acks > 0)
        r->pre.acks--;
    if (r->pre.acks > 0)
        return;
    /* Every part is in: the first token is output; then hand off.  The
     * handoff is timed from here to the decode group's KV_RELEASE. */
    r->state = DSV4_REQ_HANDOFF;
    r->t_prefilled_us = ctl_now_us();
    {
        struct sched_tok t = { r->first_token, r->first_has_lp, r->first_lp,
                               r->first_top_ids, r->first_top_lp, r->first_n_top };

        if (req_emit(s, r, &t))
            return;
    }
    send_decode(s, r, g->size);
}

static void
on_kv_release(struct sched *s, struct sched_group *g, uint64_t req)
{
    struct sched_req *r = req_find(s, req);

    if (r == NULL || r->closing || r->dec.g != g || r->state != DSV4_REQ_HANDOFF)
        return;
    if (r->dec.acks > 0 && --r->dec.acks > 0)
        return;
    if (r->pre.g != NULL) {
        rank_send_ref(s, r->pre.g, DSV4_RANK_KV_RELEASE, r->rid);
        req_hold_clear(s, r, &r->pre);
    }
    req_kv_clear(r);
    r->state = DSV4_REQ_DECODING;
    if (r->t_prefilled_us != 0) {
        int64_t d = ctl_now_us() - r->t_prefilled_us;

        r->handoff_us = d > 0 ? d : 0;
        r->t_prefilled_us = 0;
    }
}

static void
on_tokens(struct sched *s, struct sched_rank *k, struct sched_group *g,
    const struct dsv4_rank_tokens *m)
{
    /* Every rank of a group computes the same tokens; the first one speaks. */
    uint32_t at = 0;   /* entry i's most likely tokens in m->top */

    if (k->group_rank != 0)
        return;
    for (uint32_t i = 0; i < m->n; i++) {
        struct sched_req *r = req_find(s, m->reqs[i]);
        uint32_t nt = m->top.top_n != NULL ? (uint32_t)m->top.top_n[i] : 0;
        struct sched_tok t = { m->tokens[i], m->logprobs != NULL,
                               m->logprobs != NULL ? m->logprobs[i] : 0.0f,
                               nt > 0 ? m->top.top_ids + at : NULL,
                               nt > 0 ? m->top.top_logprobs + at : NULL, nt };

        at += nt;
        if (r == NULL || r->closing || r->dec.g != g || !r->dec_started)
            continue;
        if (r->handoff_us >= 0) {   /* the import worked: the handoff counts */
            ctl_handoff_observe(&s->m, (uint64_t)r->handoff_us);
            r->handoff_us = -1;
        }
        (void)req_emit(s, r, &t);
    }
}

/* DECODE_DONE or ABORT_DONE: rank k freed `req`.  In a group every rank
 * ends a stream at the same step; rank 0 speaks for the group (its TOKENS
 * are the ones used, and they precede its DECODE_DONE), the others' count
 * as acknowledgements only. */
static void
on_freed(struct sched *s, struct sched_group *g, const struct sched_rank *k, uint64_t req,
    bool decode_done, enum dsv4_finish finish)
{
    struct sched_req *r = req_find(s, req);
    struct sched_hold *h;

    if (r == NULL)
        return;
    if (!r->closing) {
        if (!decode_done || r->dec.g != g || !r->dec_started)
            return;
        if (k->group_rank != 0) {
            /* counted when rank 0's report closes the request */
            r->dec_early++;
            return;
        }
        /* The rank ended the stream before we saw a reason to. */
        r->dec_self_end = true;
        if (finish == DSV4_FINISH_CANCELLED)
            req_fail(s, r, DSV4_STATUS_INTERNAL, "decode rank dropped the stream");
        else
            req_finish(s, r, finish);
    }
    h = r->pre.g == g ? &r->pre : r->dec.g == g ? &r->dec : NULL;
    if (h != NULL && (h->acks == 0 || --h->acks == 0))
        req_hold_clear(s, r, h);
    req_maybe_free(s, r);
}

/*
 * GROUP_BROKEN from rank k of group g: the communicator of epoch
 * m->comm_epoch broke and k dropped it with its work (docs/protocol.md
 * §6.5).  For the current epoch, once its COMM is out: a new epoch, every
 * request the group held re-run as on a rank's death, and rank 0 asked for
 * the new epoch's id.  Anything else (an older epoch: the break was
 * handled; the epoch's COMM not out: re-forming already) is ignored.
 */
static void
on_group_broken(struct sched *s, struct sched_rank *k, struct sched_group *g,
    const struct dsv4_rank_group_broken *m)
{
    const char *why = m->reason != NULL ? m->reason : "";
    struct sched_req *r, *tmp;
    char nb[48];

    rank_name(k, nb, sizeof(nb));
    if (g == NULL || g->size < 2 || m->group != k->group || m->group_rank != k->group_rank) {
        log_warnx("rank %s: GROUP_BROKEN of group %u rank %u does not match its "
            "registration (group %u rank %u of %u); dropped", nb, m->group, m->group_rank,
            k->group, k->group_rank, k->group_size);
        return;
    }
    if (m->comm_epoch != g->epoch || g->comm_ready != g->epoch) {
        log_info("rank %s: GROUP_BROKEN of epoch %u ignored (group %s/%u at epoch %u, "
            "communicator %s) (%s)", nb, m->comm_epoch, dsv4_role_name(g->role), g->id,
            g->epoch, g->comm_ready == g->epoch ? "out" : "re-forming", why);
        return;
    }
    log_notice("group %s/%u: communicator of epoch %u broke (rank %s: %s); re-forming as "
        "epoch %u", dsv4_role_name(g->role), g->id, g->epoch, nb, why, g->epoch + 1);
    g->epoch++;
    TAILQ_FOREACH_SAFE(r, &s->live, qentry, tmp) {
        if (r->pre.g == g || r->dec.g == g)
            req_rank_lost(s, r, g);
    }
    group_update(s, g);   /* asks rank 0 for the new epoch's id */
    rank_update_states(s);
}

/* --- Dispatch -------------------------------------------------------------------------- */

static void
rank_message(struct sched *s, struct sched_rank *k, const struct dsv4_route *from,
    struct dsv4_msg *m)
{
    struct sched_group *g = group_of(s, k);
    char nb[48];

    switch (m->cmd) {
    case DSV4_RANK_HEARTBEAT:
        k->reported_active = m->u.heartbeat.active;
        if (m->u.heartbeat.has_comm_epoch) {
            /* the state (joining / ready) follows in the loop's update */
            k->comm_epoch = m->u.heartbeat.comm_epoch;
            k->has_comm_epoch = true;
        }
        if (m->u.heartbeat.has_mtp) {
            k->mtp_drafts = m->u.heartbeat.mtp_drafts;
            k->mtp_accepted = m->u.heartbeat.mtp_accepted;
            k->has_mtp = true;
        }
        if (m->u.heartbeat.has_graphs_refused && k->role == DSV4_ROLE_DECODE) {
            k->graphs_refused = m->u.heartbeat.graphs_refused;
            k->has_graphs_refused = true;
        }
        break;
    case DSV4_RANK_DISCONNECT:
        rank_lost(s, k, m->u.disconnect.reason != NULL ? m->u.disconnect.reason :
            "rank disconnected");
        break;
    case DSV4_RANK_PREFILL_DONE:
        if (k->role == DSV4_ROLE_PREFILL)
            on_prefill_done(s, k, g, &m->u.prefill_done);
        else
            goto unexpected;
        break;
    case DSV4_RANK_KV_RELEASE:
        if (k->role == DSV4_ROLE_DECODE)
            on_kv_release(s, g, m->u.ref.req);
        else
            goto unexpected;
        break;
    case DSV4_RANK_TOKENS:
        if (k->role == DSV4_ROLE_DECODE)
            on_tokens(s, k, g, &m->u.step);
        else
            goto unexpected;
        break;
    case DSV4_RANK_DECODE_DONE:
        if (k->role == DSV4_ROLE_DECODE)
            on_freed(s, g, k, m->u.decode_done.req, true, m->u.decode_done.finish);
        else
            goto unexpected;
        break;
    case DSV4_RANK_ABORT_DONE:
        on_freed(s, g, k, m->u.ref.req, false, DSV4_FINISH_NONE);
        break;
    case DSV4_RANK_DRAIN_DONE:
        break;
    case DSV4_RANK_DRAIN:
        /* the rank is stopping (SIGTERM): it finishes what it holds */
        if (!k->leaving)
            log_notice("rank %s: stopping; it finishes its %u requests, no new work is "
                "placed on its group", rank_name(k, nb, sizeof(nb)), rank_load(k, s));
        k->leaving = true;
        rank_update_states(s);
        break;
    case DSV4_RANK_COMM:
        /* rank 0's id for the current epoch: every rank joins with it */
        if (g == NULL || k->group_rank != 0 || g->size < 2 || m->u.comm.comm_id == NULL)
            goto unexpected;
        if (m->u.comm.comm_epoch != g->epoch || g->n_ranks != g->size) {
            log_info("rank %s: communicator id of epoch %u dropped (group at epoch %u, %u of "
                "%u ranks)", rank_name(k, nb, sizeof(nb)), m->u.comm.comm_epoch, g->epoch,
                g->n_ranks, g->size);
            break;
        }
        rank_send_group(s, g, m);
        g->comm_ready = g->epoch;
        log_notice("group %s/%u: communicator of epoch %u sent to its %u ranks",
            dsv4_role_name(g->role), g->id, g->epoch, g->size);
        queue_dispatch(s);
        break;
    case DSV4_RANK_GROUP_BROKEN:
        on_group_broken(s, k, g, &m->u.broken);
        break;
    case DSV4_RANK_ERROR: {
        struct sched_req *r;

        log_info("rank %s: ERROR req=%llu %u %s", rank_name(k, nb, sizeof(nb)),
            (unsigned long long)m->u.error.req, m->u.error.code,
            m->u.error.message != NULL ? m->u.error.message : "");
        if (m->u.error.req != 0 && (r = req_find(s, m->u.error.req)) != NULL)
            req_rank_error(s, r, g, m->u.error.code,
                m->u.error.message != NULL ? m->u.error.message : "");
        break;
    }
    default:
        goto unexpected;
    }
    return;
unexpected:
    log_warnx("rank %s: unexpected %s; disconnecting", rank_name(k, nb, sizeof(nb)),
        dsv4_proto_cmd_name(m->sub, m->cmd));
    send_disconnect(s, from, "unexpected command");
    rank_lost(s, k, "unexpected command");
}

bool
rank_dispatch(struct sched *s)
{
    for (int i = 0; i < RANK_BATCH; i++) {
        struct dsv4_route from;
        struct sched_rank *k;
        struct dsv4_perr pe;
        struct dsv4_msg m;
        enum dsv4_err e;

        e = dsv4_zsock_recv(s->rank, &from, &m, &pe, ZMQ_DONTWAIT);
        if (e == DSV4_ERR_BUSY)
            return false;
        if (e != DSV4_OK && e != DSV4_ERR_PROTO && e != DSV4_ERR_INVAL) {
            log_warnx("rank: receive: %s", dsv4_errmsg());
            return false;
        }
        k = rank_by_route(s, &from);
        if (k != NULL)
            dsv4_liveness_rx(&k->live, dsv4_now_ms());
        if (e != DSV4_OK || m.sub != DSV4_SUB_RANK) {
            /* Malformed: drop it; a registered rank is disconnected.  A
             * peer of another sub-protocol (a client or dsv4ctl given the
             * rank endpoint) is told so with a DISCONNECT, which it does
             * not take for an answer of its own (it waited out its
             * connect timeout as "no answer"). */
            log_warnx("rank: malformed message (%u %s)%s",
                e != DSV4_OK ? pe.code : (unsigned)DSV4_STATUS_BAD_MESSAGE,
                e != DSV4_OK ? pe.message : "wrong sub-protocol",
                k != NULL ? "; disconnecting the rank" : "");
            if (k != NULL) {
                send_disconnect(s, &from, "malformed message");
                rank_lost(s, k, "malformed message");
            } else if (e != DSV4_OK && pe.sub == DSV4_SUB_RANK) {
                (void)dsv4_zsock_send_perr(s->rank, &from, &pe);
            } else if (e == DSV4_OK) {
                send_disconnect(s, &from, "not a rank message: this endpoint speaks DSV4R1");
            }
            if (e == DSV4_OK)
                dsv4_msg_clear(&m);
            continue;
        }
        if (m.cmd == DSV4_RANK_READY)
            on_ready(s, &from, &m.u.ready);
        else if (k == NULL)
            send_disconnect(s, &from, "not registered: send READY");
        else
            rank_message(s, k, &from, &m);
        dsv4_msg_clear(&m);
    }
    return true;
}

/* Whether a registered rank takes work (alive, not leaving).  A scheduler
 * that stops while one does is restarting (systemctl restart dsv4-sched, or
 * a stop its socket activates again): the set goes on. */
static bool
rank_serving(const struct sched *s)
{
    const struct sched_rank *k;

    TAILQ_FOREACH(k, &s->ranks, entry) {
        if (k->state != DSV4_RANK_STATE_DEAD && !k->leaving)
            return true;
    }
    return false;
}

/* Whether the set stops: no rank takes work and one left on purpose (its
 * SIGTERM's DRAIN; systemd and dsv4-launch stop the ranks before the
 * scheduler).  Not so while none has registered yet (a scheduler restarted
 * twice) or after a crash (the rank comes back). */
bool
rank_set_stopped(const struct sched *s)
{
    const struct sched_rank *k;

    if (rank_serving(s))
        return false;
    TAILQ_FOREACH(k, &s->ranks, entry) {
        if (k->leaving)
            return true;
    }
    return false;
}

void
rank_free_all(struct sched *s, const char *reason)
{
    struct sched_rank *k;
    struct sched_group *g;

    while ((k = TAILQ_FIRST(&s->ranks)) != NULL) {
        if (k->state != DSV4_RANK_STATE_DEAD)
            send_disconnect(s, &k->route, reason);
        TAILQ_REMOVE(&s->ranks, k, entry);
        free(k);
    }
    while ((g = TAILQ_FIRST(&s->groups)) != NULL) {
        TAILQ_REMOVE(&s->groups, g, entry);
        free(g->slots);
        free(g);
    }
}
