/*
 * rank_group.c — a rank of a model group (rank.h, "rank_group.c"): the
 * communicator of each epoch and the tick that keeps the ranks' forward
 * calls in step.
 *
 * Communicator: the scheduler asks group rank 0 for an id when the group
 * is complete (COMM without id, saying whether the group is on one host);
 * rank 0 makes one (the `comm` key, dsv4_comm_pick: on the CUDA backend a
 * cudaipc group name when the group is on one host, else an NCCL unique id;
 * a shm group name on the CPU backend) and returns it; the scheduler sends
 * it to every rank, and each takes the kind of communicator from the id.
 * A rank without a working communicator joins at once; a rank whose
 * communicator still works keeps ticking on it with the new epoch marked
 * pending, and the ranks switch together after
 * the tick that shows every rank has the same pending epoch (so no rank is
 * left waiting in a collective of the old one).  On a switch each rank
 * drops what it held for the old epoch (the scheduler re-ran it when the
 * group changed) and keeps what arrived after the new epoch's COMM (work
 * the scheduler placed on the new epoch, which a rank still ticking on the
 * old communicator can receive before it switches).
 * Right after joining, the ranks exchange their process ids and host
 * hashes (a minimum all-reduce), so the watchdog can tell when a peer on
 * this host has died, and agree on the warm-up: when a rank has not run
 * its warm-up calls yet (its process is new), every rank of the group runs
 * them together (rank_warmup; the calls are collectives), which also
 * records the full batch's graphs again with the new communicator.  The
 * join (making the communicator, binding the model to it, that exchange,
 * the warm-up) runs in a thread of its own, because it waits for
 * the peers: the main loop keeps heartbeating meanwhile and holds the
 * scheduler's messages until it ends.  A broken communicator (a peer died
 * or left: a collective failed or the watchdog aborted it) is dropped
 * together with the work; the rank says so (GROUP_BROKEN with the epoch,
 * docs/protocol.md §6.5), stays registered and waits for the next COMM,
 * which the scheduler sends for a new epoch.  Only
 * NCCL's abort has been seen to hang (a peer killed inside a graphed
 * collective): for it alone the rank exits when the abort does not return
 * within GROUP_ABORT_S, and leaves the aborted communicator and its graphs
 * alone.  cudaipc and shm aborts return at once: the rank destroys the
 * communicator, frees the graphs recorded with it and keeps its process,
 * CUDA context, weights and decode state.
 *
 * Tick descriptor (2 * slots + 3 uint64): the runnable requests ascending,
 * padded with UINT64_MAX, then their complements, then the pending epoch
 * (0 = none) and its complement, then 0 when the rank stops after this tick
 * (else 1).  Its layout, and group_peers' exchange, are part of
 * DSV4_RANK_ABI (ipc/proto.h): a change increments it.  After the minimum
 * all-reduce the first half holds the smallest id of each position and the
 * second half the complement of the largest: a position where both are
 * equal holds the same request on every rank.  Requests are numbered in
 * the order the scheduler sent them, so ranks that have not yet seen a
 * message differ only at the end of the list; the agreed work is the
 * leading run of equal positions.
 */
#include "rank.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/sdnotify.h"
#ifdef DSV4_HAVE_CUDA
#include "kernels/cuda_fast.h"
#endif

/*
 * The words of the tick descriptor after its 2 * slots, and of group_peers'
 * exchange after its 2 * group_size: what peers of one build agree on, part
 * of DSV4_RANK_ABI (ipc/proto.h).  The assert is a tripwire: a change to
 * either count fails the build until DSV4_RANK_ABI is incremented and the
 * assert updated with it (so that the scheduler keeps ranks of the old and
 * the new layout apart).  A change of what a word means needs the same.
 */
#define GROUP_TICK_TAIL 3
#define GROUP_PEERS_TAIL 7
_Static_assert(DSV4_RANK_ABI >= 3 && GROUP_TICK_TAIL == 3 && GROUP_PEERS_TAIL == 7,
               "the group's exchanges changed: increment DSV4_RANK_ABI, then update this");

#define GROUP_JOIN_MS 60000     /* a communicator must assemble within this */
#define GROUP_COLL_MS 20000     /* a collective section may wait this long (every
                                   forward is collective, so a live peer that does
                                   not come has left the group) */
#define WATCH_MS 50             /* watchdog period */
#define GROUP_ABORT_S 3         /* longest wait for an abort to return */

/* Peer watchdog: inside a collective section, aborts the communicator when
 * a peer process of this host is gone. */
struct rank_watch {
    pthread_t th;
    pthread_mutex_t mu;         /* guards comm, pids, local, busy */
    pthread_cond_t idle;        /* busy went to 0 */
    int busy;                   /* the thread is aborting comm (outside mu) */
    struct dsv4_comm *comm;
    int n;
    pid_t pids[64];
    bool local[64];
    atomic_int inside;          /* main thread in a collective section */
    _Atomic int64_t since_ms;   /* ... since then */
    atomic_int stop;
    atomic_int fired;           /* the communicator was aborted */
    atomic_int peer_gone;       /* ... because a peer process of this host died */
    enum dsv4_comm_kind kind;   /* of comm (guarded by mu) */
};

/* A scheduler message held while a join runs. */
struct rank_held {
    struct rank_held *next;
    struct dsv4_msg m;
};

/* A communicator join in its thread (group_join).  The thread uses k's
 * options, backend and model (the main thread leaves them alone meanwhile)
 * and the watchdog (under its lock), writes nc, e and why, then sets done;
 * the main thread reads them once done is set. */
struct rank_join {
    pthread_t th;
    bool threaded;              /* th runs (else the join ran inline) */
    struct rank *k;
    uint32_t epoch;
    uint8_t id[DSV4_COMM_ID_BYTES];
    enum dsv4_comm_kind kind;
    long delay_ms;              /* test only (DSV4_TEST_JOIN_DELAY_MS) */
    atomic_int done;
    pthread_mutex_t mu;         /* guards nc and cancel between the threads */
    bool cancel;                /* a newer epoch came or the link is left: give up
                                   (join_cancel) */
    struct dsv4_comm *nc;       /* the communicator, when made (even if a later
                                   step failed) */
    enum dsv4_err e;
    char why[256];              /* dsv4_errmsg() of the thread on failure */
    struct rank_held *held, **held_tail; /* main thread only */
};

static uint64_t
host_hash(const char *h)
{
    uint64_t x = 1469598103934665603ull;

    while (*h != '\0')
        x = (x ^ (uint8_t)*h++) * 1099511628211ull;
    return x;
}

static int64_t
mono_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Started before an abort: when the abort has not returned within
 * GROUP_ABORT_S (see group_close), the process exits, wherever the main
 * thread is stuck, so that the service manager restarts it. */
static void *
watch_reaper(void *arg)
{
    struct rank_watch *w = arg;
    struct timespec nap = { GROUP_ABORT_S, 0 };
    int busy;

    nanosleep(&nap, NULL);
    pthread_mutex_lock(&w->mu);
    busy = w->busy;
    pthread_mutex_unlock(&w->mu);
    if (busy) {
        log_warnx("group: the communicator's abort did not return within %d s; exiting so "
                  "that this rank is restarted", GROUP_ABORT_S);
        _exit(1);
    }
    return NULL;
}

static void *
watch_main(void *arg)
{
    struct rank_watch *w = arg;
    struct timespec nap = { 0, WATCH_MS * 1000000L };

    while (!atomic_load(&w->stop)) {
        nanosleep(&nap, NULL);
        if (!atomic_load(&w->inside))
            continue;
        struct dsv4_comm *victim = NULL;

        pthread_mutex_lock(&w->mu);
        if (w->comm != NULL && !atomic_load(&w->fired) &&
            mono_ms() - atomic_load(&w->since_ms) > GROUP_COLL_MS) {
            log_warnx("group: a collective section took over %d ms; aborting the "
                      "communicator", GROUP_COLL_MS);
            victim = w->comm;
        }
        for (int i = 0; i < w->n && w->comm != NULL && victim == NULL; i++) {
            if (!w->local[i] || w->pids[i] <= 0 || atomic_load(&w->fired))
                continue;
            if (kill(w->pids[i], 0) != 0 && errno == ESRCH) {
                log_warnx("group: peer rank %d (pid %d) is gone; aborting the communicator",
                          i, (int)w->pids[i]);
                atomic_store(&w->peer_gone, 1);
                victim = w->comm;
            }
        }
        bool may_hang = w->kind == DSV4_COMM_NCCL;

        if (victim != NULL) {
            atomic_store(&w->fired, 1);
            w->busy = 1;
        }
        pthread_mutex_unlock(&w->mu);
        if (victim == NULL)
            continue;
        if (may_hang) {
            pthread_t r;

            if (pthread_create(&r, NULL, watch_reaper, w) == 0)
                pthread_detach(r);
        }
        /* outside the lock: the main thread may be waiting in a collective */
        victim->ops->abort(victim);
        log_notice("group: communicator aborted");
        pthread_mutex_lock(&w->mu);
        w->busy = 0;
        pthread_cond_broadcast(&w->idle);
        pthread_mutex_unlock(&w->mu);
    }
    return NULL;
}

void
group_init(struct rank *k, const struct dsv4_config *cfg)
{
    struct rank_watch *w;

    (void)cfg;
    if (k->o.group_size <= 1)
        return;
    k->test_break = rank_test_env(k, RANK_TEST_GROUP_BREAK);
    k->test_join_delay_ms = rank_test_env(k, RANK_TEST_JOIN_DELAY);
    if (dsv4_comm_pick(k->o.conf.comm, k->be->name, 1, (int)k->o.group_size) ==
        DSV4_COMM_NONE)
        fatalx("group_init: %s", dsv4_errmsg());
    k->tick_h = calloc(2 * (size_t)k->o.slots + GROUP_TICK_TAIL, sizeof(uint64_t));
    k->tick_d = k->be->ops->alloc(k->be,
                                  (2 * (size_t)k->o.slots + GROUP_TICK_TAIL) * sizeof(uint64_t));
    w = calloc(1, sizeof(*w));
    if (k->tick_h == NULL || k->tick_d == NULL || w == NULL)
        fatalx("group_init: no memory");
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->idle, NULL);
    if (pthread_create(&w->th, NULL, watch_main, w) != 0)
        fatalx("group_init: watchdog thread");
    k->watch = w;
    log_info("group_init: rank %u of group %u (%u ranks)", (unsigned)k->o.group_rank,
             (unsigned)k->o.group, (unsigned)k->o.group_size);
}

void
group_close(struct rank *k, bool abort_peers)
{
    if (k->comm == NULL)
        return;
    /* peers waiting in a collective with us fail now (shm, cudaipc), not
     * at their timeout */
    bool aborted = abort_peers;
    enum dsv4_comm_kind kind = DSV4_COMM_NCCL;

    if (k->watch != NULL) {
        struct timespec until;

        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += GROUP_ABORT_S;
        pthread_mutex_lock(&k->watch->mu);
        kind = k->watch->kind;
        while (k->watch->busy) {
            if (kind != DSV4_COMM_NCCL) {
                /* its abort only sets flags: it returns at once */
                pthread_cond_wait(&k->watch->idle, &k->watch->mu);
                continue;
            }
            if (pthread_cond_timedwait(&k->watch->idle, &k->watch->mu, &until) == ETIMEDOUT) {
                /* Seen on H200s: ncclCommAbort does not return when a peer
                 * died inside a collective of a recorded graph; the CUDA
                 * stream is stuck behind it.  Exit: the service manager
                 * restarts this rank, which maps the shared weights again
                 * (a second or two) and rejoins the group. */
                fatalx("group: the communicator's abort did not return within %d s; "
                       "exiting so that this rank is restarted", GROUP_ABORT_S);
            }
        }
        aborted = aborted || atomic_load(&k->watch->fired);
        k->watch->comm = NULL;
        k->watch->n = 0;
        pthread_mutex_unlock(&k->watch->mu);
    }
    if (abort_peers)
        k->comm->ops->abort(k->comm);
    if (aborted && kind != DSV4_COMM_NCCL) {
        /* the abort ended every wait: the stream drains at once; the graphs
         * recorded with this communicator go (freed), the next are recorded
         * with the new one */
        (void)k->be->ops->sync(k->be);
        dsv4_model_set_comm(k->m, NULL);
        dsv4_comm_destroy(k->comm);
        k->comm = NULL;
        log_notice("group_close: aborted communicator of epoch %u destroyed",
                   (unsigned)k->comm_epoch);
        return;
    }
    if (aborted) {
        /* graphs holding the aborted communicator's operations are left
         * alone (kernels/forward.h), and so is the communicator's handle */
        dsv4_model_abandon_graphs(k->m);
        dsv4_model_set_comm(k->m, NULL);
        log_notice("group_close: aborted communicator of epoch %u dropped",
                   (unsigned)k->comm_epoch);
        k->comm = NULL;
        return;
    }
    dsv4_model_set_comm(k->m, NULL);
    dsv4_comm_destroy(k->comm);
    k->comm = NULL;
    log_info("group_close: communicator of epoch %u closed", (unsigned)k->comm_epoch);
}

void
group_free(struct rank *k)
{
    group_join_abandon(k);
    if (k->comm != NULL && k->watch != NULL && k->watch->kind == DSV4_COMM_NCCL) {
        /* at exit an NCCL communicator is left to the process's end:
         * destroying it (or the graphs holding its operations) waits for
         * peers that may be gone or exiting too (seen as stop timeouts) */
        dsv4_model_abandon_graphs(k->m);
        dsv4_model_set_comm(k->m, NULL);
        k->comm = NULL;
    }
    group_close(k, true);
    free(k->pend_id);
    k->pend_id = NULL;
    if (k->watch != NULL) {
        atomic_store(&k->watch->stop, 1);
        pthread_join(k->watch->th, NULL);
        pthread_mutex_destroy(&k->watch->mu);
        pthread_cond_destroy(&k->watch->idle);
        free(k->watch);
        k->watch = NULL;
    }
    if (k->tick_d != NULL)
        k->be->ops->free(k->be, k->tick_d);
    free(k->tick_h);
    k->tick_d = NULL;
    k->tick_h = NULL;
}

void
group_enter(struct rank *k)
{
    if (k->watch != NULL) {
        atomic_store(&k->watch->since_ms, mono_ms());
        atomic_store(&k->watch->inside, 1);
    }
}

void
group_leave(struct rank *k)
{
    if (k->watch != NULL)
        atomic_store(&k->watch->inside, 0);
}

/* Bytes the largest all-reduce of the forward moves (shm group size): the
 * MoE's or wo_a's outputs of a call's rows, or the gather of its logits
 * (one row a sequence: the head's vocabulary slices, forward.c). */
static size_t
group_max_bytes(const struct rank *k)
{
    const struct dsv4_config *c = &k->cfg;
    size_t k1 = (size_t)(k->spec_k1 > 0 ? k->spec_k1 : 1);
    size_t T = k->o.role == DSV4_ROLE_PREFILL ? (size_t)k->o.rows : (size_t)k->o.slots * k1;
    size_t n_out = (size_t)k->o.slots * k1;
    size_t moe = ((size_t)c->num_experts_per_tok + 1) * (size_t)c->hidden_size;
    size_t att = (size_t)c->o_groups * (size_t)c->o_lora_rank;
    size_t per = moe > att ? moe : att, lg = n_out * (size_t)c->vocab_size;

    return (T * per > lg ? T * per : lg) * sizeof(float) +
           4 * (size_t)k->o.slots * sizeof(uint64_t) + 4096;
}

/* Largest buffer of one cudaipc launch: larger all-reduces (prefill) go in
 * pieces of this size (the receive buffers hold 2 x group size of it). */
#define GROUP_IPC_MAX_BYTES (8u << 20)

/* Make the id of a new communicator (rank 0); one_host from the COMM. */
static enum dsv4_err
group_make_id(struct rank *k, uint8_t *id, bool one_host)
{
    switch (dsv4_comm_pick(k->o.conf.comm, k->be->name, one_host, (int)k->o.group_size)) {
    case DSV4_COMM_SHM:
        return dsv4_comm_shm_unique_id(id);
    case DSV4_COMM_CUDAIPC:
        return dsv4_comm_cudaipc_unique_id(id);
    case DSV4_COMM_NCCL:
#ifdef DSV4_HAVE_CUDA
        return dsv4_comm_nccl_unique_id(id);
#else
        return dsv4_err_set(DSV4_ERR_NOTSUP, "group: no NCCL in this build");
#endif
    default:
        return DSV4_ERR_CONFIG;   /* dsv4_comm_pick set the message */
    }
}

/* Every slot of the rank is idle (no prefill job, no decode stream). */
static bool
slots_idle(const struct rank *k)
{
    for (int i = 0; i < k->o.slots; i++)
        if ((k->jobs != NULL && k->jobs[i].active) ||
            (k->streams != NULL && k->streams[i].active))
            return false;
    return true;
}

/* What decides the collectives a rank's calls make, beyond their size: MTP
 * (a verify and a draft against a plain step), the split and the experts'
 * combining, and the numerics (the ranks' shares must be of one model). */
static uint64_t
group_layout(const struct rank *k)
{
    return (uint64_t)k->mtp | (uint64_t)k->group_split << 1 | (uint64_t)k->moe_local << 4 |
           (uint64_t)(strcmp(k->o.conf.numerics, "hf") == 0) << 5;
}

/*
 * Exchange process ids and host hashes over the new communicator nc of
 * `kind` and arm the watchdog for it; agree on the warm-up.  Runs in the
 * join's thread.  One minimum all-reduce of 2n + 7 values: n pids, n host
 * hashes (each rank fills its own position, UINT64_MAX elsewhere), then 0
 * when the rank owes its warm-up calls (k->warmed), 0 when one of its slots
 * is in use, its call size (prefill: rows a call; decode: slots) and that
 * size's complement, 0 when its join was given up (`stop`), and its layout
 * (group_layout) and that's complement.  *warm: some rank owes its warm-up
 * and every slot of every rank is idle, so every rank runs it now (the same
 * calls: its collectives match).  Ranks of different call sizes or layouts
 * cannot run the same calls at all: an error.  A join
 * some rank gave up (an NCCL communicator is not aborted: join_cancel) ends
 * here on every rank, before the warm-up: DSV4_ERR_CANCELED.
 */
static enum dsv4_err
group_peers(struct rank *k, struct dsv4_comm *nc, enum dsv4_comm_kind kind,
            const struct dsv4_comm_stop *stop, bool *warm)
{
    uint32_t n = k->o.group_size, nv = 2 * n + GROUP_PEERS_TAIL;
    uint64_t *v = calloc(nv, sizeof(uint64_t));
    uint64_t *d = k->be->ops->alloc(k->be, nv * sizeof(uint64_t));
    uint64_t me = host_hash(k->host);
    uint64_t size = (uint64_t)(k->o.role == DSV4_ROLE_PREFILL ? k->o.rows : k->o.slots);
    enum dsv4_err e = DSV4_OK;

    *warm = false;
    if (v == NULL || d == NULL) {
        e = dsv4_err_set(DSV4_ERR_NOMEM, "group: no memory");
        goto out;
    }
    for (uint32_t i = 0; i < 2 * n; i++)
        v[i] = UINT64_MAX;
    v[k->o.group_rank] = (uint64_t)getpid();
    v[n + k->o.group_rank] = me;
    v[2 * n] = k->warmed;
    v[2 * n + 1] = slots_idle(k);
    v[2 * n + 2] = size;
    v[2 * n + 3] = ~size;
    v[2 * n + 4] = !stop->fn(stop->arg);
    v[2 * n + 5] = group_layout(k);
    v[2 * n + 6] = ~group_layout(k);
    /* the watchdog's limit covers the exchange too: an NCCL collective
     * waits without bound for a peer that died or skipped it (the peers'
     * pids, for its other check, come with the exchange) */
    pthread_mutex_lock(&k->watch->mu);
    k->watch->comm = nc;
    k->watch->kind = kind;
    k->watch->n = 0;
    atomic_store(&k->watch->fired, 0);
    atomic_store(&k->watch->peer_gone, 0);
    pthread_mutex_unlock(&k->watch->mu);
    group_enter(k);
    e = k->be->ops->upload(k->be, d, v, nv * sizeof(uint64_t));
    if (e == DSV4_OK)
        e = nc->ops->allreduce_min_u64(nc, k->be, d, (int64_t)nv);
    if (e == DSV4_OK)
        e = k->be->ops->download(k->be, v, d, nv * sizeof(uint64_t));
    if (e == DSV4_OK)
        e = k->be->ops->sync(k->be);
    group_leave(k);
    if (e != DSV4_OK)
        goto out;
    if (v[2 * n + 4] == 0) {
        e = dsv4_err_set(DSV4_ERR_CANCELED, "a rank of the group gave the join up");
        goto out;
    }
    if (v[2 * n + 2] != ~v[2 * n + 3]) {
        e = dsv4_err_set(DSV4_ERR_CONFIG, "group: its ranks differ in %s (%" PRIu64 " to %"
                         PRIu64 "): give every rank of the group the same %s", k->o.role ==
                         DSV4_ROLE_PREFILL ? "rows a call" : "slots", v[2 * n + 2],
                         ~v[2 * n + 3], k->o.role == DSV4_ROLE_PREFILL ? "prefill_chunk" :
                         "slots");
        goto out;
    }
    if (v[2 * n + 5] != ~v[2 * n + 6]) {
        e = dsv4_err_set(DSV4_ERR_CONFIG, "group: its ranks differ in mtp, group_split, "
                         "DSV4_MOE_LOCAL or numerics (here mtp %s, split %s, moe_local %d, "
                         "numerics %s): give every rank of the group the same",
                         k->mtp ? "yes" : "no", dsv4_group_split_name(k->group_split),
                         (int)k->moe_local, k->o.conf.numerics);
        goto out;
    }
    if (v[2 * n] == 0 && v[2 * n + 1] == 0)
        log_warnx("group: a rank owes its warm-up calls, but a slot is in use: not now");
    *warm = v[2 * n] == 0 && v[2 * n + 1] != 0;
    pthread_mutex_lock(&k->watch->mu);
    for (uint32_t i = 0; i < n && i < 64; i++) {
        k->watch->pids[i] = i == k->o.group_rank ? 0 : (pid_t)v[i];
        k->watch->local[i] = v[n + i] == me;
    }
    k->watch->n = (int)n;
    pthread_mutex_unlock(&k->watch->mu);
out:
    free(v);
    if (d != NULL)
        k->be->ops->free(k->be, d);
    return e;
}

static void group_join(struct rank *k);

void
group_comm(struct rank *k, const struct dsv4_rank_comm *c)
{
    uint8_t id[DSV4_COMM_ID_BYTES];

    if (k->o.group_size <= 1) {
        log_warnx("group_comm: COMM for a rank that is alone dropped");
        return;
    }
    if (c->comm_id == NULL) {
        struct dsv4_msg m;
        bool shm;

        if (k->o.group_rank != 0) {
            log_warnx("group_comm: asked for an id, but this is not rank 0");
            return;
        }
        if (group_make_id(k, id, c->one_host) != DSV4_OK) {
            log_warnx("group_comm: %s", dsv4_errmsg());
            rank_relink(k, "cannot make a communicator id");
            return;
        }
        dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_COMM);
        m.u.comm.comm_epoch = c->comm_epoch;
        m.u.comm.comm_id = id;
        m.u.comm.comm_id_len = DSV4_COMM_ID_BYTES;
        rank_send(k, &m);
        shm = !dsv4_comm_id_is_cudaipc(id) && strcmp(k->be->name, "cpu") == 0;
        /* (a shm id is its segment's name: a leak traces to its epoch) */
        log_info("group_comm: id of epoch %u made (%s%s)", (unsigned)c->comm_epoch,
                 dsv4_comm_id_is_cudaipc(id) ? "cudaipc" : shm ? "shm " : "nccl",
                 shm ? (const char *)id : "");
        return;
    }
    if (c->comm_id_len != DSV4_COMM_ID_BYTES) {
        log_warnx("group_comm: id of %u bytes dropped", (unsigned)c->comm_id_len);
        return;
    }
    if (k->pend_id == NULL && (k->pend_id = malloc(DSV4_COMM_ID_BYTES)) == NULL)
        fatalx("group_comm: no memory");
    memcpy(k->pend_id, c->comm_id, DSV4_COMM_ID_BYTES);
    k->pend_epoch = c->comm_epoch;
    k->comm_gen++;   /* what arrives from now on is the new epoch's work */
    if (k->comm == NULL)
        group_join(k);   /* else at the tick where every rank has it */
}

/*
 * Drop the work that arrived before COMM number `gen` (every export too):
 * the scheduler re-runs what the group held when its epoch changed, and
 * work that arrived after the COMM of the next epoch was sent for that
 * epoch (the scheduler places work only once an epoch's COMM is out, and
 * the link keeps the order), so it stays.
 */
static void
group_drop_work(struct rank *k, uint32_t gen)
{
    if (k->o.role == DSV4_ROLE_PREFILL)
        prefill_reset_before(k, gen);
    else
        decode_reset_before(k, gen);
}

/* The join's stop (struct dsv4_comm_stop): it was cancelled. */
static int
join_stopped(void *arg)
{
    struct rank_join *j = arg;
    bool cancel;

    pthread_mutex_lock(&j->mu);
    cancel = j->cancel;
    pthread_mutex_unlock(&j->mu);
    return cancel;
}

/* The join's thread: wait (test only), make the communicator of the
 * epoch, bind the model to it, exchange pids and hosts, and run the warm-up
 * calls when a rank owes them (group_peers). */
static void *
join_main(void *arg)
{
    struct rank_join *j = arg;
    struct rank *k = j->k;
    struct dsv4_comm *nc = NULL;
    /* a newer epoch or the rank's stop ends the wait for the peers */
    struct dsv4_comm_stop stop = { join_stopped, j };
    bool warm = false;
    enum dsv4_err e;

    /* test only: in steps of 10 ms, so that a stop ends it as it ends the
     * wait for the peers */
    for (long left = j->delay_ms; left > 0 && !join_stopped(j); left -= 10) {
        struct timespec nap = { 0, (left < 10 ? left : 10) * 1000000L };

        nanosleep(&nap, NULL);
    }
    switch (j->kind) {
    case DSV4_COMM_CUDAIPC: {
        size_t mb = group_max_bytes(k);

        e = dsv4_comm_cudaipc_create(&nc, k->be, (int)k->o.group_rank, (int)k->o.group_size,
                                     j->id, mb < GROUP_IPC_MAX_BYTES ? mb :
                                     GROUP_IPC_MAX_BYTES, GROUP_COLL_MS, &stop);
        break;
    }
    case DSV4_COMM_SHM:
        e = dsv4_comm_shm_create(&nc, (int)k->o.group_rank, (int)k->o.group_size, j->id,
                                 group_max_bytes(k), GROUP_JOIN_MS, &stop);
        break;
    default:
#ifdef DSV4_HAVE_CUDA
        e = dsv4_comm_nccl_create(&nc, k->be, (int)k->o.group_rank, (int)k->o.group_size,
                                  j->id, GROUP_JOIN_MS, &stop);
#else
        e = dsv4_err_set(DSV4_ERR_NOTSUP, "no communicator for backend %s", k->be->name);
#endif
        break;
    }
    if (e == DSV4_OK) {
        bool cancel;

        pthread_mutex_lock(&j->mu);
        j->nc = nc;
        cancel = j->cancel;
        pthread_mutex_unlock(&j->mu);
        /* group_close takes the kind of what it closes from here, made
         * and then given up included */
        pthread_mutex_lock(&k->watch->mu);
        k->watch->kind = j->kind;
        pthread_mutex_unlock(&k->watch->mu);
        /* A cancel that came before j->nc was set: shm and cudaipc abort
         * now (their peers stop waiting); an NCCL communicator cannot be
         * aborted safely, so its exchange runs on every rank and carries
         * the cancel to them (group_peers), under the watchdog. */
        if (cancel && j->kind != DSV4_COMM_NCCL) {
            nc->ops->abort(nc);
            e = dsv4_err_set(DSV4_ERR_CANCELED, "a newer epoch came");
        }
    }
    if (e == DSV4_OK)
        e = dsv4_model_set_comm(k->m, nc);
    if (e == DSV4_OK)
        e = group_peers(k, nc, j->kind, &stop, &warm);
    if (e == DSV4_OK && warm) {
        /* under the watchdog, as the forward calls are: a peer that dies
         * meanwhile fails the join, not the process */
        log_notice("group_join: epoch %u: the group's warm-up calls (%s)", (unsigned)j->epoch,
                   k->warmed ? "a peer owes them" : "this rank owes them");
        group_enter(k);
        e = rank_warmup(k);
        group_leave(k);
        /* out of memory, every later join would fail the same way: stop,
         * with the error for the operator (rank_warmup's message) */
        if (e == DSV4_ERR_NOMEM)
            fatalx("group_join: %s", dsv4_errmsg());
    }
    j->e = e;
    if (e != DSV4_OK)
        snprintf(j->why, sizeof(j->why), "%s", dsv4_errmsg());
    atomic_store(&j->done, 1);
    return NULL;
}

/* Start joining the pending epoch's communicator (group_join_poll ends it). */
static void
group_join(struct rank *k)
{
    struct rank_join *j = calloc(1, sizeof(*j));

    if (j == NULL)
        fatalx("group_join: no memory");
    j->k = k;
    j->epoch = k->pend_epoch;
    memcpy(j->id, k->pend_id, DSV4_COMM_ID_BYTES);
    j->delay_ms = k->test_join_delay_ms;
    k->test_join_delay_ms = 0;
    j->held_tail = &j->held;
    pthread_mutex_init(&j->mu, NULL);
    k->pend_epoch = 0;
    group_drop_work(k, k->comm_gen);
    group_close(k, false);
    sdnotify_status("joining the communicator of group %u, epoch %u", (unsigned)k->o.group,
                    (unsigned)j->epoch);
    /* the id says which kind rank 0 picked */
    if (dsv4_comm_id_is_cudaipc(j->id))
        j->kind = DSV4_COMM_CUDAIPC;
    else if (strcmp(k->be->name, "cpu") == 0)
        j->kind = DSV4_COMM_SHM;
    else
        j->kind = DSV4_COMM_NCCL;
    if (j->delay_ms > 0)
        log_warnx("group_join: test-only delay of %ld ms before joining epoch %u",
                  j->delay_ms, (unsigned)j->epoch);
    k->join = j;
    j->threaded = pthread_create(&j->th, NULL, join_main, j) == 0;
    if (!j->threaded) {
        log_warnx("group_join: no thread for the join; joining in the main loop");
        join_main(j);
    }
}

bool
group_joining(const struct rank *k)
{
    return k->join != NULL;
}

uint32_t
group_joining_epoch(const struct rank *k)
{
    return k->join != NULL ? k->join->epoch : 0;
}

/* Give the join up (`why` for the log): the communicator's creation stops
 * waiting for its peers (join_stopped), and a communicator already made is
 * aborted (shm, cudaipc: the abort only sets flags; an NCCL abort may hang,
 * so a made NCCL communicator's exchange runs to its end, and tells every
 * rank to skip the warm-up: group_peers; a warm-up begun runs to its end). */
static void
join_cancel(struct rank *k, const char *why)
{
    struct rank_join *j = k->join;

    if (j == NULL)
        return;
    pthread_mutex_lock(&j->mu);
    if (!j->cancel) {
        j->cancel = true;
        log_notice("group_join: giving up the join of epoch %u %s", (unsigned)j->epoch, why);
        if (j->nc != NULL && j->kind != DSV4_COMM_NCCL)
            j->nc->ops->abort(j->nc);
    }
    pthread_mutex_unlock(&j->mu);
}

void
group_join_cancel(struct rank *k)
{
    join_cancel(k, "for a newer epoch");
}

void
group_hold(struct rank *k, struct dsv4_msg *m)
{
    struct rank_held *h = malloc(sizeof(*h));

    if (h == NULL)
        fatalx("group_hold: no memory");
    h->next = NULL;
    h->m = *m;   /* the decoded copies move with it */
    dsv4_msg_init(m, DSV4_SUB_NONE, 0);
    *k->join->held_tail = h;
    k->join->held_tail = &h->next;
}

/* Wait for the join's thread; k->join is NULL afterwards.  On failure the
 * communicator made (if any) becomes k->comm so that group_close drops it. */
static struct rank_join *
join_end(struct rank *k)
{
    struct rank_join *j = k->join;

    if (j->threaded)
        pthread_join(j->th, NULL);
    pthread_mutex_destroy(&j->mu);
    k->join = NULL;
    if (j->nc != NULL) {
        k->comm = j->nc;
        k->comm_epoch = j->epoch;
        /* prefill_work's rotation starts alike on every rank of the new
         * communicator: a restarted rank's is 0, its peers' had counted on */
        k->rr = 0;
    }
    return j;
}

/* Free held messages from `h` on. */
static void
held_free(struct rank_held *h)
{
    while (h != NULL) {
        struct rank_held *next = h->next;

        dsv4_msg_clear(&h->m);
        free(h);
        h = next;
    }
}

void
group_join_abandon(struct rank *k)
{
    struct rank_join *j;

    if (k->join == NULL)
        return;
    join_cancel(k, "(the link is left or the rank stops)");
    j = join_end(k);
    held_free(j->held);
    free(j);
    group_close(k, true);
}

static void group_joined(struct rank *k, enum dsv4_comm_kind kind);

void
group_join_poll(struct rank *k, void (*dispatch)(struct rank *, const struct dsv4_msg *))
{
    struct rank_join *j = k->join;
    struct rank_held *h;

    if (j == NULL || !atomic_load(&j->done))
        return;
    j = join_end(k);
    if (j->e != DSV4_OK && !j->cancel) {
        log_warnx("group_join: epoch %u: %s", (unsigned)j->epoch, j->why);
        held_free(j->held);   /* of this link, which is being left */
        free(j);
        group_close(k, true);
        /* once (a peer died meanwhile): register again at once; again and
         * again (a lasting cause, such as ranks of different sizes): back
         * off, or the group would re-form hundreds of times a second */
        k->relink_delay_ms = rank_backoff_ms(++k->join_fails);
        if (k->relink_delay_ms > 0)
            log_warnx("group_join: %d joins failed in a row; registering again in %lld ms",
                      k->join_fails, (long long)k->relink_delay_ms);
        rank_relink(k, "joining the group's communicator failed");
        return;
    }
    if (j->e != DSV4_OK || j->cancel) {
        /* given up: the held COMM of the newer epoch starts its join (also
         * where the join had succeeded before the cancel came: its
         * communicator was aborted, join_cancel) */
        log_info("group_join: epoch %u given up (%s)", (unsigned)j->epoch,
                 j->e != DSV4_OK ? j->why : "cancelled once made");
        group_close(k, true);
    } else {
        group_joined(k, j->kind);
    }
    /* the held messages, in order; one may start another join, which holds
     * the rest */
    h = j->held;
    free(j);
    while (h != NULL) {
        struct rank_held *next = h->next;

        if (group_joining(k)) {
            group_hold(k, &h->m);
        } else {
            dispatch(k, &h->m);
            dsv4_msg_clear(&h->m);
        }
        free(h);
        h = next;
    }
}

/* A join succeeded: say so (STATUS=, log, HEARTBEAT with the epoch). */
static void
group_joined(struct rank *k, enum dsv4_comm_kind kind)
{
    k->join_fails = 0;
    sdnotify_status("serving as %s, rank %u of group %u (epoch %u)", k->name,
                    (unsigned)k->o.group_rank, (unsigned)k->o.group, (unsigned)k->comm_epoch);
    log_notice("group_comm: joined group %u as rank %u of %u, epoch %u (%s)",
               (unsigned)k->o.group, (unsigned)k->o.group_rank, (unsigned)k->o.group_size,
               (unsigned)k->comm_epoch, kind == DSV4_COMM_CUDAIPC ? "cudaipc" :
               kind == DSV4_COMM_SHM ? "shm" : "nccl");
    rank_heartbeat(k);   /* the scheduler shows the rank joined */
}

enum dsv4_err
group_check(struct rank *k)
{
    return dsv4_comm_check(k->comm);
}

void
group_broken(struct rank *k, const char *what)
{
    char why[256];

    /* `what` is often dsv4_errmsg(), which the calls below may overwrite */
    snprintf(why, sizeof(why), "%s", what);
#ifdef DSV4_HAVE_CUDA
    /* a sticky CUDA error (e.g. under MPS, a killed client of this GPU can
     * fault the others): nothing on this context works any more, and the
     * MPS server takes new clients for the GPU only once the faulted ones
     * are gone; exit so that the rank restarts on a fresh context */
    if (dsv4_cuda_context_lost(k->be))
        fatalx("group: %s; the CUDA context is lost: exiting so that the rank restarts",
               why);
#endif
    log_warnx("group: %s; dropping the communicator and the work, waiting for the group to "
              "re-form", why);
    if (k->watch != NULL && atomic_load(&k->watch->peer_gone)) {
        /* a peer died: the scheduler learns it from the link (liveness,
         * DISCONNECT) and re-forms the group when the peer is back; a
         * GROUP_BROKEN could reach it first and make it re-form with the
         * dead peer, whose new epoch would then hold this rank's join */
        log_info("group: a peer process died; its restart re-forms the group");
    } else if (k->link == RANK_LINK_UP) {
        struct dsv4_msg m;

        /* the scheduler re-forms the group under a new epoch (§6.5) */
        dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_GROUP_BROKEN);
        m.u.broken.group = k->o.group;
        m.u.broken.group_rank = k->o.group_rank;
        m.u.broken.comm_epoch = k->comm_epoch;
        m.u.broken.reason = why;
        rank_send(k, &m);
    }
    sdnotify_status("group %u broke (%s); waiting for it to re-form", (unsigned)k->o.group,
                    why);
    group_close(k, true);
    /* the epoch's work goes (the scheduler re-runs it); the work that came
     * after the COMM of a pending epoch is that epoch's and stays */
    group_drop_work(k, k->pend_epoch != 0 ? k->comm_gen : UINT32_MAX);
    if (k->pend_epoch != 0)
        group_join(k);
}

bool
group_forward_end(struct rank *k, enum dsv4_err e, const char *fmt, ...)
{
    char what[128];
    va_list ap;

    if (e == DSV4_OK && k->comm != NULL)
        e = group_check(k);   /* a cudaipc all-reduce that gave up */
    if (e == DSV4_OK && k->comm != NULL && k->test_break > 0 && --k->test_break == 0)
        e = dsv4_err_set(DSV4_ERR_TIMEOUT, "collective failure injected for a test (%s)",
                         RANK_TEST_GROUP_BREAK);
    group_leave(k);
    if (e == DSV4_OK)
        return true;
    if (k->comm != NULL) {
        group_broken(k, dsv4_errmsg());
        return false;
    }
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    fatalx("%s: %s", what, dsv4_errmsg());
}

/* Ascending order of request ids. */
static int
req_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return (x > y) - (x < y);
}

bool
group_tick(struct rank *k, uint64_t *mine, int n)
{
    size_t S = (size_t)k->o.slots, N = 2 * S + GROUP_TICK_TAIL;
    enum dsv4_err e;

    k->n_agreed = 0;
    qsort(mine, (size_t)n, sizeof(uint64_t), req_cmp);
    for (size_t i = 0; i < S; i++) {
        uint64_t v = (int)i < n ? mine[i] : UINT64_MAX;

        k->tick_h[i] = v;
        k->tick_h[S + i] = ~v;
    }
    k->tick_h[2 * S] = k->pend_epoch;
    k->tick_h[2 * S + 1] = ~(uint64_t)k->pend_epoch;
    k->tick_h[2 * S + 2] = k->leave_now ? 0 : 1;   /* 0 (the min): a rank exits now */
    group_enter(k);
    e = k->be->ops->upload(k->be, k->tick_d, k->tick_h, N * sizeof(uint64_t));
    if (e == DSV4_OK)
        e = k->comm->ops->allreduce_min_u64(k->comm, k->be, k->tick_d, (int64_t)N);
    if (e == DSV4_OK)
        e = k->be->ops->download(k->be, k->tick_h, k->tick_d, N * sizeof(uint64_t));
    if (e == DSV4_OK)
        e = k->be->ops->sync(k->be);
    group_leave(k);
    if (e != DSV4_OK) {
        group_broken(k, dsv4_errmsg());
        return false;
    }
    /* a rank stops after this tick (rank_loop: leaving, done or at its
     * bound): it goes, the others enter no collective it would not join
     * and wait for the group to form again */
    if (k->tick_h[2 * S + 2] == 0) {
        if (!k->leave_now)
            group_broken(k, "a rank of the group is stopping");
        return false;
    }
    /* every rank holds the same pending epoch: switch together */
    if (k->tick_h[2 * S] != 0 && k->tick_h[2 * S] == ~k->tick_h[2 * S + 1]) {
        group_join(k);
        return false;
    }
    for (size_t i = 0; i < S; i++) {
        uint64_t lo = k->tick_h[i], hi = ~k->tick_h[S + i];

        if (lo != hi || lo == UINT64_MAX)
            break;
        k->agreed[k->n_agreed++] = lo;
    }
    return true;
}
