/*
 * sched_queue.c — dsv4-sched: the admission queue and the batching policy.
 *
 * Runs in the scheduler's only thread.  The policy is deliberately simple and
 * explicit: requests leave the queue in FIFO order (re-runs after a rank
 * death go to the head, so they keep their place); a request starts only
 * when both a prefill group with room and a decode group with a free stream
 * slot exist, and the decode slot is reserved at that moment, so at most
 * `max_batch` streams ever decode on one group and a finished prefill never
 * waits for a slot.  Among the groups that fit, the least loaded one wins
 * (lowest group id on ties), which spreads streams over data-parallel decode
 * groups; among equally loaded prefill groups the one that runs the prompt
 * in fewer forward calls goes first (queue_pick_prefill).  The first half
 * of this file is pure (no sockets) and unit-tested.
 */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "daemons/sched/sched.h"

/* --- Pure policy ------------------------------------------------------------ */

uint16_t
queue_admit_status(uint32_t n_queued, uint32_t queue_max, bool draining)
{
    if (draining)
        return DSV4_STATUS_DRAINING;
    if (n_queued >= queue_max)
        return DSV4_STATUS_BUSY;
    return DSV4_STATUS_OK;
}

void
queue_push(struct sched *s, struct sched_req *r, bool front)
{
    if (front)
        TAILQ_INSERT_HEAD(&s->queue, r, qentry);
    else
        TAILQ_INSERT_TAIL(&s->queue, r, qentry);
    r->queued = true;
    r->state = DSV4_REQ_QUEUED;
    s->n_queued++;
}

void
queue_remove(struct sched *s, struct sched_req *r)
{
    if (!r->queued)
        return;
    TAILQ_REMOVE(&s->queue, r, qentry);
    r->queued = false;
    s->n_queued--;
}

/* A group takes work when it is complete, none of its ranks is drained or
 * leaving, and (several ranks) every rank has the communicator of its
 * epoch. */
static bool
group_usable(const struct sched_group *g)
{
    if (g->size == 0 || g->n_ranks != g->size || (g->size > 1 && g->comm_ready != g->epoch))
        return false;
    for (uint32_t i = 0; i < g->size; i++) {
        const struct sched_rank *k = g->ranks[i];

        if (k == NULL || k->drain || k->leaving || k->state == DSV4_RANK_STATE_DEAD)
            return false;
    }
    return true;
}

static uint32_t
transports_of(const struct sched_group *g)
{
    /* A rank that announces no transport is taken to speak shm (CPU). */
    return g->transports != 0 ? g->transports : 1u << DSV4_TRANSPORT_SHM;
}

bool
queue_group_fits(const struct sched_group *g, uint32_t ctx, enum dsv4_transport t)
{
    if (!group_usable(g) || g->load >= g->capacity || g->max_ctx < ctx)
        return false;
    return t == DSV4_TRANSPORT_NONE || (transports_of(g) & (1u << t)) != 0;
}

/* Whether g goes before best (NULL: nothing yet): less loaded, or as loaded
 * with a lower id. */
static bool
group_before(const struct sched_group *g, const struct sched_group *best)
{
    return best == NULL || g->load < best->load || (g->load == best->load && g->id < best->id);
}

struct sched_group *
queue_group_find(struct sched_group_list *groups, enum dsv4_role role, uint32_t id)
{
    struct sched_group *g;

    TAILQ_FOREACH(g, groups, entry) {
        if (g->role == role && g->id == id)
            return g;
    }
    return NULL;
}

/* The least loaded group of `role` that fits ctx and transport t, is not
 * `skip` and, when `other` (a group of the other role) is given, shares a
 * KV transport with it; NULL when none. */
static struct sched_group *
pick(struct sched_group_list *groups, enum dsv4_role role, uint32_t ctx, enum dsv4_transport t,
    const struct sched_group *other, const struct sched_group *skip)
{
    struct sched_group *g, *best = NULL;

    TAILQ_FOREACH(g, groups, entry) {
        if (g->role != role || g == skip || !queue_group_fits(g, ctx, t))
            continue;
        if (other != NULL &&
            queue_transport(role == DSV4_ROLE_DECODE ? other : g,
                role == DSV4_ROLE_DECODE ? g : other) == DSV4_TRANSPORT_NONE)
            continue;
        if (group_before(g, best))
            best = g;
    }
    return best;
}

struct sched_group *
queue_pick(struct sched_group_list *groups, enum dsv4_role role, uint32_t ctx,
    enum dsv4_transport t)
{
    return pick(groups, role, ctx, t, NULL, NULL);
}

bool
queue_groups_share_gpu(const struct sched_group *a, const struct sched_group *b)
{
    if (a->n_ranks < a->size || b->n_ranks < b->size)
        return true;   /* a missing rank's device is not known */
    for (uint32_t i = 0; i < a->size; i++) {
        const struct sched_rank *x = a->ranks[i];

        if (x == NULL || x->device[0] == '\0')
            return true;
        for (uint32_t j = 0; j < b->size; j++) {
            const struct sched_rank *y = b->ranks[j];

            if (y == NULL || y->device[0] == '\0' || strcmp(x->device, y->device) == 0)
                return true;
        }
    }
    return false;
}

/* Beside burst group b, summed over the decode groups that may share a GPU
 * with it: *streams their loads (slots taken), *idle the slots left in
 * those of them that are usable. */
static void
burst_beside(struct sched_group_list *groups, const struct sched_group *b, uint32_t *streams,
    uint32_t *idle)
{
    const struct sched_group *d;

    *streams = *idle = 0;
    TAILQ_FOREACH(d, groups, entry) {
        if (d->role != DSV4_ROLE_DECODE || !queue_groups_share_gpu(d, b))
            continue;
        *streams += d->load;
        if (group_usable(d) && d->load < d->capacity)
            *idle += d->capacity - d->load;
    }
}

/* Forward calls a prefill group takes for a prompt of ctx positions (one
 * when its ranks did not say their rows per call). */
static uint32_t
prefill_calls(const struct sched_group *g, uint32_t ctx)
{
    return g->call_rows == 0 ? 1 : (ctx + g->call_rows - 1) / g->call_rows;
}

/* group_before for prefill groups and a prompt of ctx positions: less loaded,
 * or as loaded in fewer forward calls, or those equal too with a lower id. */
static bool
prefill_before(const struct sched_group *g, const struct sched_group *best, uint32_t ctx)
{
    uint32_t cg, cb;

    if (best == NULL || g->load != best->load)
        return group_before(g, best);
    cg = prefill_calls(g, ctx);
    cb = prefill_calls(best, ctx);
    return cg < cb || (cg == cb && g->id < best->id);
}

struct sched_group *
queue_pick_prefill(struct sched_group_list *groups, uint32_t ctx, uint32_t burst_streams,
    uint32_t burst_free, const struct sched_group *skip)
{
    /* [0] plain, [1] burst with at most burst_streams beside it, [2] any
     * burst, [3] burst with at least burst_free free decode slots beside it */
    struct sched_group *g, *best[4] = { NULL, NULL, NULL, NULL };
    bool plain_usable = false;
    uint32_t streams, idle;

    TAILQ_FOREACH(g, groups, entry) {
        if (g->role != DSV4_ROLE_PREFILL || g == skip)
            continue;
        if (!g->burst && group_usable(g) && g->max_ctx >= ctx)
            plain_usable = true;
        if (!queue_group_fits(g, ctx, DSV4_TRANSPORT_NONE))
            continue;
        if (!g->burst) {
            if (prefill_before(g, best[0], ctx))
                best[0] = g;
            continue;
        }
        if (prefill_before(g, best[2], ctx))
            best[2] = g;
        burst_beside(groups, g, &streams, &idle);
        if (prefill_before(g, best[1], ctx) && streams <= burst_streams)
            best[1] = g;
        if (burst_free > 0 && idle >= burst_free && prefill_before(g, best[3], ctx))
            best[3] = g;
    }
    if (best[1] != NULL)
        return best[1];
    if (best[0] != NULL)
        return best[0];
    /* the plain groups are busy: wait for one, unless prefill is what keeps
     * decode slots empty (burst_free) */
    if (plain_usable)
        return best[3];
    return best[2];
}

bool
queue_usable_besides(struct sched_group_list *groups, enum dsv4_role role,
    const struct sched_group *skip, uint32_t ctx)
{
    const struct sched_group *g;

    TAILQ_FOREACH(g, groups, entry) {
        if (g->role == role && g != skip && group_usable(g) && g->max_ctx >= ctx)
            return true;
    }
    return false;
}

bool
queue_ctx_possible(struct sched_group_list *groups, enum dsv4_role role, uint32_t ctx)
{
    struct sched_group *g;
    bool any = false;

    TAILQ_FOREACH(g, groups, entry) {
        /* a group whose ranks all died counts with the context it had: a
         * rank death must not turn a request that fits into a 413 */
        uint32_t mc = g->n_ranks > 0 ? g->max_ctx : g->max_ctx_last;

        if (g->role != role || mc == 0)
            continue;
        any = true;
        if (mc >= ctx)
            return true;
    }
    /* With no group of that role registered yet nothing is known: wait. */
    return !any;
}

int
queue_slot_take(struct sched_group *g)
{
    for (uint32_t i = 0; i < g->n_slots; i++) {
        if (!g->slots[i]) {
            g->slots[i] = 1;
            return (int)i;
        }
    }
    return -1;
}

void
queue_slot_put(struct sched_group *g, uint32_t slot)
{
    if (slot < g->n_slots)
        g->slots[slot] = 0;
}

enum dsv4_transport
queue_transport(const struct sched_group *p, const struct sched_group *d)
{
    uint32_t common = transports_of(p) & transports_of(d);
    bool same_host = p->ranks[0] != NULL && d->ranks[0] != NULL &&
        strcmp(p->ranks[0]->host, d->ranks[0]->host) == 0;

    if (same_host && (common & (1u << DSV4_TRANSPORT_CUDAIPC)))
        return DSV4_TRANSPORT_CUDAIPC;
    if (same_host && (common & (1u << DSV4_TRANSPORT_SHM)))
        return DSV4_TRANSPORT_SHM;
    if (common & (1u << DSV4_TRANSPORT_UCX))
        return DSV4_TRANSPORT_UCX;
    return DSV4_TRANSPORT_NONE;
}

/* --- Dispatch ---------------------------------------------------------------- */

/* Send PREFILL for `r` to every rank of its prefill group. */
static void
send_prefill(struct sched *s, struct sched_req *r, enum dsv4_transport t)
{
    struct dsv4_msg m;
    int32_t *ids;
    uint32_t n = r->n_prompt + r->n_out;

    /* Prompt plus the tokens already emitted (a re-run continues from them). */
    if ((ids = malloc((size_t)n * sizeof(*ids))) == NULL) {
        req_fail(s, r, DSV4_STATUS_NO_MEMORY, "out of memory");
        return;
    }
    memcpy(ids, r->prompt, (size_t)r->n_prompt * sizeof(*ids));
    if (r->n_out > 0)
        memcpy(ids + r->n_prompt, r->out, (size_t)r->n_out * sizeof(*ids));
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_PREFILL);
    m.u.prefill.req = r->rid;
    m.u.prefill.tokens = ids;
    m.u.prefill.n_tokens = n;
    m.u.prefill.s = r->s;
    m.u.prefill.step = r->n_out;
    m.u.prefill.dst_group = r->dec.g->id;
    m.u.prefill.transport = t;
    if (s->cfg.file.prefill_chunk > 0) {
        m.u.prefill.chunk = (uint32_t)s->cfg.file.prefill_chunk;
        m.u.prefill.has_chunk = true;
    }
    /* a PREFILL that cannot be encoded (a value the decoder let through
     * and the encoder refuses) would hold the request in `prefilling`,
     * its slots taken, for good */
    if (rank_send_group(s, r->pre.g, &m) == DSV4_ERR_PROTO)
        req_fail(s, r, DSV4_STATUS_INTERNAL, "PREFILL could not be encoded: %s", dsv4_errmsg());
    free(ids);
}

/*
 * Start queued requests in order while a prefill group and a decode slot are
 * free.  A request that a group in service could hold blocks the ones behind
 * it while the groups are busy (FIFO fairness); one that only a group out of
 * service (drained, dead, incomplete) could hold waits for it without holding
 * up the rest; one that no registered group could ever hold fails with 413.
 */
void
queue_dispatch(struct sched *s)
{
    struct sched_req *r, *next;

    for (r = TAILQ_FIRST(&s->queue); r != NULL; r = next) {
        uint32_t ctx = r->n_prompt + r->max_tokens;
        uint32_t pctx = r->n_prompt + r->n_out + 1;
        struct sched_group *d, *p, *skip;
        enum dsv4_transport t;
        int slot;

        next = TAILQ_NEXT(r, qentry);
        if (!queue_ctx_possible(&s->groups, DSV4_ROLE_DECODE, ctx) ||
            !queue_ctx_possible(&s->groups, DSV4_ROLE_PREFILL, pctx)) {
            req_fail(s, r, DSV4_STATUS_TOO_LARGE,
                "prompt (%u tokens) plus max_tokens (%u) exceed every rank's context",
                r->n_prompt, r->max_tokens);
            continue;
        }
        if (!queue_usable_besides(&s->groups, DSV4_ROLE_DECODE, NULL, ctx) ||
            !queue_usable_besides(&s->groups, DSV4_ROLE_PREFILL, NULL, pctx))
            continue;
        if ((d = queue_pick(&s->groups, DSV4_ROLE_DECODE, ctx, DSV4_TRANSPORT_NONE)) == NULL)
            return;
        /* a re-run after NO_MEMORY from a prefill group: another group, or
         * wait for one, unless that group is the only one usable */
        skip = r->avoid_pre != 0 ?
            queue_group_find(&s->groups, DSV4_ROLE_PREFILL, r->avoid_pre - 1) : NULL;
        if (skip != NULL && !queue_usable_besides(&s->groups, DSV4_ROLE_PREFILL, skip, pctx))
            skip = NULL;
        if ((p = queue_pick_prefill(&s->groups, pctx,
                 (uint32_t)s->cfg.file.burst_streams,
                 (uint32_t)s->cfg.file.burst_free_slots, skip)) == NULL)
            return;
        if ((t = queue_transport(p, d)) == DSV4_TRANSPORT_NONE) {
            /* the two picked alone cannot hand over (another host, no ucx):
             * another decode group for this prefill group, else another
             * prefill group for this decode group, instead of waiting for
             * a pair that the loads will never change */
            struct sched_group *d2 = pick(&s->groups, DSV4_ROLE_DECODE, ctx, DSV4_TRANSPORT_NONE, p, NULL);
            struct sched_group *p2 = d2 != NULL ? NULL :
                pick(&s->groups, DSV4_ROLE_PREFILL, pctx, DSV4_TRANSPORT_NONE, d, skip);

            if (d2 == NULL && p2 == NULL) {
                log_warnx("queue_dispatch: no free prefill and decode groups share a KV "
                    "transport (prefill group %u, decode group %u picked)", p->id, d->id);
                return;
            }
            if (d2 != NULL)
                d = d2;
            else
                p = p2;
            t = queue_transport(p, d);
        }
        if ((slot = queue_slot_take(d)) < 0)
            return;
        req_unqueue(s, r);
        r->state = DSV4_REQ_PREFILLING;
        r->slot = (uint32_t)slot;
        r->dec.g = d;
        r->dec.acks = 0;
        d->load++;
        r->pre.g = p;
        r->pre.acks = p->size;
        p->load++;
        for (uint32_t i = 0; i < p->size; i++)
            p->ranks[i]->placed++;
        for (uint32_t i = 0; i < d->size; i++)
            d->ranks[i]->placed++;
        r->kv_parts = 0;
        r->dec_started = false;
        r->dec_self_end = false;
        log_debug("queue_dispatch: req=%llu prefill=%u decode=%u slot=%d tokens=%u step=%u",
            (unsigned long long)r->req, p->id, d->id, slot, r->n_prompt + r->n_out, r->n_out);
        send_prefill(s, r, t);
    }
}
