/*
 * test_sched_queue.c — unit tests of dsv4-sched's pure parts: admission
 * status, group choice and decode slots (sched_queue.c), stop-string search
 * and hold-back (sched_req.c), and the round trip of the protocol fields the
 * scheduler added (PREFILL chunk, STATUS metrics and handoff histogram, RANK
 * rank_active, burst and device, READY burst and device), and the handoff histogram's
 * bucketing (sched_ctl.c).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemons/sched/sched.h"

static void
test_admit(void **state)
{
    (void)state;
    assert_int_equal(queue_admit_status(0, 4, false), DSV4_STATUS_OK);
    assert_int_equal(queue_admit_status(3, 4, false), DSV4_STATUS_OK);
    assert_int_equal(queue_admit_status(4, 4, false), DSV4_STATUS_BUSY);
    assert_int_equal(queue_admit_status(0, 4, true), DSV4_STATUS_DRAINING);
}

/* A complete one-rank group of `role` with `cap` slots. */
static struct sched_group *
mkgroup(struct sched_group_list *l, struct sched_rank *k, enum dsv4_role role, uint32_t id,
    uint32_t cap, uint32_t ctx)
{
    struct sched_group *g = calloc(1, sizeof(*g));

    memset(k, 0, sizeof(*k));
    k->role = role;
    k->state = DSV4_RANK_STATE_READY;
    strcpy(k->host, "h");
    g->role = role;
    g->id = id;
    g->size = 1;
    g->n_ranks = 1;
    g->ranks[0] = k;
    g->capacity = cap;
    g->max_ctx = ctx;
    g->slots = calloc(cap, 1);
    g->n_slots = cap;
    TAILQ_INSERT_TAIL(l, g, entry);
    return g;
}

/* Free the groups mkgroup made. */
static void
freegroups(struct sched_group_list *l)
{
    struct sched_group *g;

    while ((g = TAILQ_FIRST(l)) != NULL) {
        TAILQ_REMOVE(l, g, entry);
        free(g->slots);
        free(g);
    }
}

static void
test_pick(void **state)
{
    struct sched_group_list l;
    struct sched_rank k[3];
    struct sched_group *d0, *d1, *p0;

    (void)state;
    TAILQ_INIT(&l);
    d0 = mkgroup(&l, &k[0], DSV4_ROLE_DECODE, 0, 2, 100);
    d1 = mkgroup(&l, &k[1], DSV4_ROLE_DECODE, 1, 2, 1000);
    p0 = mkgroup(&l, &k[2], DSV4_ROLE_PREFILL, 0, 1, 1000);
    /* Least loaded wins, lowest id on ties; the context must fit. */
    assert_ptr_equal(queue_pick(&l, DSV4_ROLE_DECODE, 50, DSV4_TRANSPORT_NONE), d0);
    d0->load = 1;
    assert_ptr_equal(queue_pick(&l, DSV4_ROLE_DECODE, 50, DSV4_TRANSPORT_NONE), d1);
    assert_ptr_equal(queue_pick(&l, DSV4_ROLE_DECODE, 500, DSV4_TRANSPORT_NONE), d1);
    d1->load = 2;
    assert_null(queue_pick(&l, DSV4_ROLE_DECODE, 500, DSV4_TRANSPORT_NONE));
    assert_ptr_equal(queue_pick(&l, DSV4_ROLE_DECODE, 50, DSV4_TRANSPORT_NONE), d0);
    /* A drained or dead rank takes its group out; an incomplete group too. */
    k[0].drain = true;
    assert_null(queue_pick(&l, DSV4_ROLE_DECODE, 50, DSV4_TRANSPORT_NONE));
    k[0].drain = false;
    d0->n_ranks = 0;
    assert_null(queue_pick(&l, DSV4_ROLE_DECODE, 50, DSV4_TRANSPORT_NONE));
    /* ...but it still counts for "could ever fit". */
    assert_true(queue_ctx_possible(&l, DSV4_ROLE_DECODE, 1000));
    assert_false(queue_ctx_possible(&l, DSV4_ROLE_DECODE, 1001));
    assert_ptr_equal(queue_pick(&l, DSV4_ROLE_PREFILL, 10, DSV4_TRANSPORT_NONE), p0);
    /* Slots: lowest free first, never more than capacity. */
    assert_int_equal(queue_slot_take(d0), 0);
    assert_int_equal(queue_slot_take(d0), 1);
    assert_int_equal(queue_slot_take(d0), -1);
    queue_slot_put(d0, 0);
    assert_int_equal(queue_slot_take(d0), 0);
    /* Transport: ranks announcing nothing speak shm; same host. */
    assert_int_equal(queue_transport(p0, d1), DSV4_TRANSPORT_SHM);
    d1->transports = 1u << DSV4_TRANSPORT_UCX;
    assert_int_equal(queue_transport(p0, d1), DSV4_TRANSPORT_NONE);
    p0->transports = (1u << DSV4_TRANSPORT_UCX) | (1u << DSV4_TRANSPORT_SHM);
    assert_int_equal(queue_transport(p0, d1), DSV4_TRANSPORT_UCX);
    freegroups(&l);
}

/* Burst prefill groups (queue_pick_prefill): preferred while the decode
 * groups are idle, skipped while they are busy, taken when no other prefill
 * group is usable at all. */
static void
test_pick_burst(void **state)
{
    struct sched_group_list l;
    struct sched_rank k[4];
    struct sched_group *d0, *p0, *p1, *pb;

    (void)state;
    TAILQ_INIT(&l);
    d0 = mkgroup(&l, &k[0], DSV4_ROLE_DECODE, 0, 16, 1000);
    p0 = mkgroup(&l, &k[1], DSV4_ROLE_PREFILL, 0, 1, 1000);
    /* without burst groups: queue_pick's answer */
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    pb = mkgroup(&l, &k[2], DSV4_ROLE_PREFILL, 1, 1, 1000);
    pb->burst = true;
    /* idle: the burst group, though p0 has the lower id */
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), pb);
    /* one stream decoding: past burst_streams 0, within 1 */
    d0->load = 1;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    assert_ptr_equal(queue_pick_prefill(&l, 10, 1, 0, NULL), pb);
    /* busy burst group while idle: the plain one */
    d0->load = 0;
    pb->load = 1;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    /* busy decode, plain group full: wait (NULL), not the burst group */
    pb->load = 0;
    d0->load = 5;
    p0->load = 1;
    assert_null(queue_pick_prefill(&l, 10, 0, 0, NULL));
    /* ...but with the plain group drained, dead or too short, the burst one */
    k[1].drain = true;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), pb);
    k[1].drain = false;
    k[1].state = DSV4_RANK_STATE_DEAD;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), pb);
    k[1].state = DSV4_RANK_STATE_READY;
    assert_ptr_equal(queue_pick_prefill(&l, 2000, 0, 0, NULL), NULL);
    p0->max_ctx = 500;
    pb->max_ctx = 2000;
    assert_ptr_equal(queue_pick_prefill(&l, 1500, 0, 0, NULL), pb);
    /* two plain groups, busy decode: the least loaded plain one */
    p1 = mkgroup(&l, &k[3], DSV4_ROLE_PREFILL, 2, 1, 2000);
    p0->max_ctx = 2000;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p1);
    freegroups(&l);
}

/* Lowered rows per call (READY call_rows): on equal loads the prefill group
 * that runs the prompt in fewer forward calls goes first; the load still
 * comes before the calls, and a prompt that fits one call of either keeps
 * the lower id. */
static void
test_pick_call_rows(void **state)
{
    struct sched_group_list l;
    struct sched_rank k[4];
    struct sched_group *p0, *p1, *pb, *pc;

    (void)state;
    TAILQ_INIT(&l);
    mkgroup(&l, &k[0], DSV4_ROLE_DECODE, 0, 16, 4096);
    p0 = mkgroup(&l, &k[1], DSV4_ROLE_PREFILL, 0, 2, 4096);
    p1 = mkgroup(&l, &k[2], DSV4_ROLE_PREFILL, 1, 2, 4096);
    p0->call_rows = 512;    /* lowered */
    p1->call_rows = 2048;
    assert_ptr_equal(queue_pick_prefill(&l, 2048, 0, 0, NULL), p1);
    assert_ptr_equal(queue_pick_prefill(&l, 512, 0, 0, NULL), p0);    /* one call either way */
    assert_ptr_equal(queue_pick_prefill(&l, 513, 0, 0, NULL), p1);
    p1->load = 1;           /* less loaded first */
    assert_ptr_equal(queue_pick_prefill(&l, 2048, 0, 0, NULL), p0);
    p1->load = 0;
    p1->call_rows = 0;      /* not said: taken as one call */
    assert_ptr_equal(queue_pick_prefill(&l, 4000, 0, 0, NULL), p1);
    /* two burst groups beside idle decode: the same rule among them */
    p1->call_rows = 2048;
    pb = mkgroup(&l, &k[3], DSV4_ROLE_PREFILL, 2, 2, 4096);
    pb->burst = true;
    pb->call_rows = 256;
    pc = p0;
    pc->burst = true;
    assert_ptr_equal(queue_pick_prefill(&l, 2048, 0, 0, NULL), pc);
    pc->call_rows = 128;
    assert_ptr_equal(queue_pick_prefill(&l, 2048, 0, 0, NULL), pb);
    freegroups(&l);
}

/* A re-run after NO_MEMORY (queue_pick_prefill's skip): the prefill group
 * that failed is left out while another one is usable (the caller waits for
 * it when it is busy), and queue_usable_besides says when none is. */
static void
test_pick_skip(void **state)
{
    struct sched_group_list l;
    struct sched_rank k[4];
    struct sched_group *p0, *p1, *pb;

    (void)state;
    TAILQ_INIT(&l);
    mkgroup(&l, &k[0], DSV4_ROLE_DECODE, 0, 16, 1000);
    p0 = mkgroup(&l, &k[1], DSV4_ROLE_PREFILL, 0, 1, 1000);
    /* the only prefill group: nothing else usable, so the caller takes it */
    assert_null(queue_pick_prefill(&l, 10, 0, 0, p0));
    assert_false(queue_usable_besides(&l, DSV4_ROLE_PREFILL, p0, 10));
    assert_true(queue_usable_besides(&l, DSV4_ROLE_PREFILL, NULL, 10));
    /* the role is looked at: the decode group (1,000 positions) */
    assert_true(queue_usable_besides(&l, DSV4_ROLE_DECODE, NULL, 1000));
    assert_false(queue_usable_besides(&l, DSV4_ROLE_DECODE, NULL, 1001));
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    /* a second plain group: taken instead of p0, though p0 has the lower id */
    p1 = mkgroup(&l, &k[2], DSV4_ROLE_PREFILL, 1, 1, 1000);
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, p0), p1);
    assert_true(queue_usable_besides(&l, DSV4_ROLE_PREFILL, p0, 10));
    /* p1 busy: wait for it (NULL) while it is usable */
    p1->load = 1;
    assert_null(queue_pick_prefill(&l, 10, 0, 0, p0));
    assert_true(queue_usable_besides(&l, DSV4_ROLE_PREFILL, p0, 10));
    /* p1 drained or too short: not usable, so p0 again */
    k[2].drain = true;
    assert_false(queue_usable_besides(&l, DSV4_ROLE_PREFILL, p0, 10));
    k[2].drain = false;
    assert_false(queue_usable_besides(&l, DSV4_ROLE_PREFILL, p0, 2000));
    /* an idle burst group beside a skipped plain one: the burst group; the
     * skipped burst group leaves the plain one */
    p1->load = 0;
    pb = mkgroup(&l, &k[3], DSV4_ROLE_PREFILL, 2, 1, 1000);
    pb->burst = true;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, p0), pb);
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, pb), p0);
    freegroups(&l);
}

/* burst_free_slots (queue_pick_prefill's burst_free): a burst group also
 * takes a prompt that would wait for a busy plain group while at least that
 * many decode slots beside it are free; never while a plain group has room,
 * never with 0, and only slots of usable decode groups on its GPUs count. */
static void
test_pick_burst_free(void **state)
{
    struct sched_group_list l;
    struct sched_rank k[4];
    struct sched_group *d0, *d1, *p0, *pb;

    (void)state;
    TAILQ_INIT(&l);
    d0 = mkgroup(&l, &k[0], DSV4_ROLE_DECODE, 0, 16, 1000);
    p0 = mkgroup(&l, &k[1], DSV4_ROLE_PREFILL, 0, 1, 1000);
    pb = mkgroup(&l, &k[2], DSV4_ROLE_PREFILL, 1, 1, 1000);
    pb->burst = true;
    /* 12 streams decode (4 slots free); the plain group has room: it */
    d0->load = 12;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 1, NULL), p0);
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 4, NULL), p0);
    /* the plain group busy: off (0) waits, 1..4 take the burst group, 5 waits */
    p0->load = 1;
    assert_null(queue_pick_prefill(&l, 10, 0, 0, NULL));
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 1, NULL), pb);
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 4, NULL), pb);
    assert_null(queue_pick_prefill(&l, 10, 0, 5, NULL));
    /* the burst group busy too, or too short for the prompt: wait */
    pb->load = 1;
    assert_null(queue_pick_prefill(&l, 10, 0, 1, NULL));
    pb->load = 0;
    assert_null(queue_pick_prefill(&l, 2000, 0, 1, NULL));
    /* a drained decode group's slots do not count */
    k[0].drain = true;
    assert_null(queue_pick_prefill(&l, 10, 0, 1, NULL));
    k[0].drain = false;
    /* nor do those of a decode group on another GPU: d0 (4 free) on GPU-a,
     * the burst group beside a full d1 on GPU-b */
    strcpy(k[0].device, "GPU-a");
    strcpy(k[1].device, "GPU-a");
    strcpy(k[2].device, "GPU-b");
    d1 = mkgroup(&l, &k[3], DSV4_ROLE_DECODE, 1, 16, 1000);
    strcpy(k[3].device, "GPU-b");
    d1->load = 16;
    assert_null(queue_pick_prefill(&l, 10, 0, 1, NULL));
    d1->load = 15;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 1, NULL), pb);    /* one slot free on GPU-b */
    assert_null(queue_pick_prefill(&l, 10, 0, 2, NULL));
    assert_ptr_equal(queue_pick_prefill(&l, 10, 15, 0, NULL), pb);   /* burst_streams: idle enough */
    /* with its GPU idle the burst group serves whatever burst_free says */
    d1->load = 0;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), pb);
    freegroups(&l);
}

/* Burst groups and GPUs: only the decode groups that may share a GPU with a
 * burst group (queue_groups_share_gpu: the ranks' READY devices) count
 * against its burst_streams. */
static void
test_pick_burst_gpus(void **state)
{
    struct sched_group_list l;
    struct sched_rank k[8];
    struct sched_group *d0, *d1, *p0, *pa, *pb, *g;

    (void)state;
    TAILQ_INIT(&l);
    d0 = mkgroup(&l, &k[0], DSV4_ROLE_DECODE, 0, 16, 1000);
    d1 = mkgroup(&l, &k[1], DSV4_ROLE_DECODE, 1, 16, 1000);
    p0 = mkgroup(&l, &k[2], DSV4_ROLE_PREFILL, 0, 1, 1000);
    pb = mkgroup(&l, &k[3], DSV4_ROLE_PREFILL, 1, 1, 1000);
    pb->burst = true;
    strcpy(k[0].device, "GPU-a");
    strcpy(k[1].device, "GPU-b");
    strcpy(k[2].device, "GPU-a");
    strcpy(k[3].device, "GPU-b");
    assert_false(queue_groups_share_gpu(d0, pb));
    assert_true(queue_groups_share_gpu(d1, pb));
    assert_true(queue_groups_share_gpu(d0, p0));
    /* the busy decode group is on the other GPU: the burst group serves */
    d0->load = 5;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), pb);
    /* a stream beside it: the plain group */
    d1->load = 1;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    assert_ptr_equal(queue_pick_prefill(&l, 10, 1, 0, NULL), pb);
    /* a rank that did not say its device may be on any GPU: it counts */
    d1->load = 0;
    k[0].device[0] = '\0';
    assert_true(queue_groups_share_gpu(d0, pb));
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    strcpy(k[0].device, "GPU-a");
    k[3].device[0] = '\0';
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    strcpy(k[3].device, "GPU-b");
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), pb);
    /* ... and so does a group with a rank missing */
    d0->size = 2;
    assert_true(queue_groups_share_gpu(d0, pb));
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    /* two-rank groups share a GPU when any device is in both */
    d0->ranks[1] = &k[4];
    d0->n_ranks = 2;
    memset(&k[4], 0, sizeof(k[4]));
    k[4].state = DSV4_RANK_STATE_READY;
    strcpy(k[4].device, "GPU-c");
    assert_false(queue_groups_share_gpu(d0, pb));
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), pb);
    strcpy(k[4].device, "GPU-b");
    assert_true(queue_groups_share_gpu(d0, pb));
    assert_true(queue_groups_share_gpu(pb, d0));
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    strcpy(k[4].device, "GPU-c");
    /* two burst groups: the one beside idle GPUs, though the other has the
     * lower id; with both busy, the plain group */
    pa = mkgroup(&l, &k[5], DSV4_ROLE_PREFILL, 0, 1, 1000);
    pa->id = 0;
    pa->burst = true;
    strcpy(k[5].device, "GPU-a");
    p0->id = 2;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), pb);
    d1->load = 3;
    assert_ptr_equal(queue_pick_prefill(&l, 10, 0, 0, NULL), p0);
    /* no plain group usable: a busy burst group rather than none */
    k[2].drain = true;
    g = queue_pick_prefill(&l, 10, 0, 0, NULL);
    assert_true(g == pa || g == pb);
    assert_ptr_equal(g, pa);   /* the lower id on equal loads */
    k[2].drain = false;
    freegroups(&l);
}

static void
test_stop_strings(void **state)
{
    char *stop[] = { "END", "xyz!" };
    const char *t = "abcEN";

    (void)state;
    assert_int_equal(req_stop_find(stop, 2, "abcENDxyz!", 10, 0), 3);
    assert_int_equal(req_stop_find(stop, 2, "abcENDxyz!", 10, 4), 6);
    assert_int_equal(req_stop_find(stop, 2, "abcEN", 5, 0), -1);
    /* "EN" might become "END": hold back 2 bytes; "xy" might become "xyz!". */
    assert_int_equal(req_stop_holdback(stop, 2, t, strlen(t)), 2);
    assert_int_equal(req_stop_holdback(stop, 2, "aaxy", 4), 2);
    assert_int_equal(req_stop_holdback(stop, 2, "xyz", 3), 3);
    assert_int_equal(req_stop_holdback(stop, 2, "abc", 3), 0);
    assert_int_equal(req_stop_holdback(stop, 2, "E", 1), 1);
    assert_int_equal(req_stop_holdback(stop, 0, "E", 1), 0);
}

/* Encode `m`, decode it back, compare. */
static void
roundtrip(struct dsv4_msg *m)
{
    struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES];
    struct dsv4_wire w;
    struct dsv4_perr pe;
    struct dsv4_msg back;

    assert_int_equal(dsv4_msg_encode(m, &w, &pe), DSV4_OK);
    fr[0].data = "";
    fr[0].len = 0;
    fr[1].data = w.sig;
    fr[1].len = DSV4_PROTO_SIG_LEN;
    fr[2].data = &w.cmd;
    fr[2].len = 1;
    fr[3].data = w.body;
    fr[3].len = w.body_len;
    for (uint32_t i = 0; i < w.n_raw; i++)
        fr[4 + i] = w.raw[i];
    assert_int_equal(dsv4_msg_decode(&back, fr, 4 + w.n_raw, &pe), DSV4_OK);
    assert_true(dsv4_msg_equal(m, &back));
    dsv4_msg_clear(&back);
    dsv4_wire_clear(&w);
}

/* Encoding `m` is refused with 401 (a sender-side check). */
static void
encode_refused(const struct dsv4_msg *m)
{
    struct dsv4_perr pe;
    struct dsv4_wire w;

    assert_int_not_equal(dsv4_msg_encode(m, &w, &pe), DSV4_OK);
    assert_int_equal(pe.code, DSV4_STATUS_BAD_ARGUMENT);
    dsv4_wire_clear(&w);
}

/* The handoff histogram: bucket edges are inclusive upper bounds, counts
 * cumulative; STATUS carries it (buckets, sum, count) and refuses a
 * histogram that is not cumulative, is short, or lacks sum and count. */
static void
test_handoff_hist(void **state)
{
    static const uint64_t bounds[DSV4_PROTO_HANDOFF_BUCKETS] = DSV4_PROTO_HANDOFF_BOUNDS_US;
    struct sched_metrics mt;
    uint64_t bad[DSV4_PROTO_HANDOFF_BUCKETS];
    struct dsv4_msg m;

    (void)state;
    memset(&mt, 0, sizeof(mt));
    ctl_handoff_observe(&mt, 0);           /* every bucket */
    ctl_handoff_observe(&mt, 500);         /* le 0.0005 (inclusive) */
    ctl_handoff_observe(&mt, 501);         /* le 0.001 and up */
    ctl_handoff_observe(&mt, 3000000);     /* le 5 and up */
    ctl_handoff_observe(&mt, 60000000);    /* +Inf only */
    assert_int_equal(bounds[0], 500);
    assert_int_equal(bounds[DSV4_PROTO_HANDOFF_BUCKETS - 1], 10000000);
    assert_int_equal(mt.handoff_count, 5);
    assert_int_equal(mt.handoff_sum_us, 0 + 500 + 501 + 3000000 + 60000000);
    assert_int_equal(mt.handoff_le[0], 2);
    assert_int_equal(mt.handoff_le[1], 3);
    assert_int_equal(mt.handoff_le[11], 3);  /* le 2.5 */
    assert_int_equal(mt.handoff_le[12], 4);  /* le 5 */
    assert_int_equal(mt.handoff_le[13], 4);  /* le 10 */
    for (int i = 1; i < DSV4_PROTO_HANDOFF_BUCKETS; i++)
        assert_true(bounds[i] > bounds[i - 1] && mt.handoff_le[i] >= mt.handoff_le[i - 1]);

    dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_STATUS);
    m.u.status.version = "v";
    m.u.status.has_handoff = true;           /* sum and count without buckets */
    m.u.status.handoff_sum_us = mt.handoff_sum_us;
    m.u.status.handoff_count = mt.handoff_count;
    roundtrip(&m);
    m.u.status.handoff_buckets = mt.handoff_le;
    m.u.status.n_handoff_buckets = DSV4_PROTO_HANDOFF_BUCKETS;
    roundtrip(&m);
    m.u.status.has_metrics = true;
    m.u.status.handoffs = 5;
    roundtrip(&m);

    memcpy(bad, mt.handoff_le, sizeof(bad));
    m.u.status.handoff_buckets = bad;
    bad[5] = 1;                              /* decreases */
    encode_refused(&m);
    bad[5] = mt.handoff_le[5];
    bad[13] = 6;                             /* above handoff_count */
    encode_refused(&m);
    bad[13] = mt.handoff_le[13];
    m.u.status.n_handoff_buckets = DSV4_PROTO_HANDOFF_BUCKETS - 1;
    encode_refused(&m);
    m.u.status.n_handoff_buckets = DSV4_PROTO_HANDOFF_BUCKETS;
    m.u.status.has_handoff = false;          /* buckets alone */
    encode_refused(&m);
}

static void
test_proto_additions(void **state)
{
    int32_t toks[3] = { 5, 6, 7 };
    struct dsv4_msg m;

    (void)state;
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_PREFILL);
    m.u.prefill.req = 9;
    m.u.prefill.tokens = toks;
    m.u.prefill.n_tokens = 3;
    m.u.prefill.transport = DSV4_TRANSPORT_SHM;
    roundtrip(&m);
    m.u.prefill.chunk = 512;
    m.u.prefill.has_chunk = true;
    roundtrip(&m);

    dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_STATUS);
    m.u.status.version = "v";
    roundtrip(&m);
    m.u.status.has_metrics = true;
    m.u.status.tokens_out = 123456789012ull;
    m.u.status.rank_deaths = 2;
    m.u.status.n_rejected = 7;
    roundtrip(&m);

    dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_RANK);
    m.u.rank.role = DSV4_ROLE_DECODE;
    m.u.rank.host = "h";
    m.u.rank.state = DSV4_RANK_STATE_READY;
    roundtrip(&m);
    m.u.rank.rank_active = 3;
    m.u.rank.has_rank_active = true;
    roundtrip(&m);
    m.u.rank.burst = true;
    m.u.rank.placed = 12345678901ull;
    roundtrip(&m);
    m.u.rank.device = "GPU-01234567-89ab-cdef-0123-456789abcdef";
    roundtrip(&m);

    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_READY);
    m.u.ready.role = DSV4_ROLE_PREFILL;
    m.u.ready.group_size = 1;
    m.u.ready.capacity = 1;
    m.u.ready.max_ctx = 4096;
    m.u.ready.host = "h";
    roundtrip(&m);
    m.u.ready.burst = true;
    roundtrip(&m);
    m.u.ready.device = "GPU-01234567-89ab-cdef-0123-456789abcdef";
    roundtrip(&m);
    {   /* the device id: 1 to DSV4_PROTO_MAX_DEVICE bytes */
        char big[DSV4_PROTO_MAX_DEVICE + 2];
        struct dsv4_wire w;
        struct dsv4_perr pe;

        memset(big, 'x', sizeof(big) - 1);
        big[sizeof(big) - 1] = '\0';
        m.u.ready.device = big;
        assert_int_not_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_OK);
        m.u.ready.device = "";
        assert_int_not_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_OK);
        big[DSV4_PROTO_MAX_DEVICE] = '\0';
        m.u.ready.device = big;
        roundtrip(&m);
    }
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_admit),
        cmocka_unit_test(test_pick),
        cmocka_unit_test(test_pick_burst),
        cmocka_unit_test(test_pick_burst_gpus),
        cmocka_unit_test(test_pick_burst_free),
        cmocka_unit_test(test_pick_skip),
        cmocka_unit_test(test_pick_call_rows),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_proto_additions),
        cmocka_unit_test(test_handoff_hist),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
