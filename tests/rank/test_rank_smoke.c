/*
 * test_rank_smoke.c — dsv4-prefill and dsv4-decode end to end, with this
 * program playing the scheduler (docs/protocol.md §6) on a ROUTER socket:
 *
 *   READY -> WELCOME; PREFILL (two prompts, chunked: --rows is smaller than
 *   the prompts) -> PREFILL_DONE with a shm location; DECODE -> KV_RELEASE
 *   (forwarded to the prefill rank) -> TOKENS ... -> DECODE_DONE; then one
 *   prompt again over each other transport both ranks offer (ucx, cudaipc),
 *   first aborted as its DECODE is sent, then decoded.
 *
 * Checks: the greedy tokens (prefill's first token + the decode rank's) equal
 * those of a single-process dsv4_model_forward run of the same prompt; the
 * shm object exists while exported and is gone after the release (and after
 * an ABORT of an export nobody claimed); ABORT of a running stream is
 * acknowledged and frees it; the ranks survive the scheduler going away and
 * register again with a new one; a prefill rank killed while it holds an
 * export leaves the region, and its next process removes it at its start;
 * an export nobody claims is freed after --kv-timeout-ms; PREFILLs and
 * DECODEs the scheduler would never send (a transport the rank lacks, too
 * many tokens, ids outside the vocabulary, a position past max_seq, a region
 * that does not exist, a location that does not fit the DECODE or comes over
 * a transport the decode rank lacks) get ERROR with their codes and the
 * ranks serve on;
 * SIGTERM makes each send DRAIN, and after the DRAIN_DONE answer
 * DISCONNECT, and end with status 0.
 *
 * usage: test_rank_smoke CKPT_DIR DSV4_PREFILL DSV4_DECODE
 */
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <signal.h>
#include <stdint.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "ipc/proto.h"
#include "ipc/zsock.h"
#include "tests/model/model_util.h"

#define HANG_GUARD_MS 300000  /* fail instead of hanging forever */
#define N_REQ 3
#define MAX_OUT 16

#define CHECK(c)                                                                 \
    do {                                                                         \
        if (!(c)) {                                                              \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #c); \
            cleanup_children();                                                  \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

static pid_t children[2];
static char sockdir[64];

static void
cleanup_children(void)
{
    for (int i = 0; i < 2; i++)
        if (children[i] > 0)
            kill(children[i], SIGKILL);
}

/* One request the test drives. */
struct treq {
    uint64_t req;
    int32_t prompt[64];
    int n_prompt;
    int max_tokens;          /* total output tokens */
    int32_t out[MAX_OUT];    /* prefill's first token, then the decode rank's */
    int n_out;
    bool done;
    /* PREFILL_DONE's location, copied. */
    struct dsv4_kv_loc loc;
    uint8_t handle[4096];    /* a UCX location's worker address and rkey */
    uint64_t sizes[1], offsets[1];
    bool released;
};

struct peer {
    struct dsv4_route route;
    bool ready;
    uint32_t transports;    /* its READY's (bit t: enum dsv4_transport t) */
};

static void *zctx, *router;
static struct peer pre, dec;
static char endpoint[128];

/* Start a rank; kv_timeout (may be NULL: the default) is its
 * --kv-timeout-ms. */
static pid_t
spawn(const char *exe, const char *ckpt, const char *conf, const char *rank, const char *slots,
      const char *rows, const char *kv_timeout)
{
    pid_t pid = fork();

    CHECK(pid >= 0);
    if (pid == 0) {
        /* Die with the test, whatever ends it. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        /* RANK_SMOKE_VERBOSE=1: the ranks log at debug level. */
        const char *av[] = { exe, "-f", conf, "--rank", rank, "--checkpoint", ckpt, "--sched",
                             endpoint, "--threads", "1", "--max-seq", "256", "--slots", slots,
                             "--rows", rows, "--kv-timeout-ms",
                             kv_timeout != NULL ? kv_timeout : "120000",
                             getenv("RANK_SMOKE_VERBOSE") != NULL ? "-vv" : NULL, NULL };
        execv(exe, (char *const *)(uintptr_t)av);
        perror(exe);
        _exit(127);
    }
    return pid;
}

static void
router_open(void)
{
    struct dsv4_zsock_cfg cfg;

    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = endpoint;
    cfg.type = ZMQ_ROUTER;
    cfg.bind = true;
    router = dsv4_zsock_open(zctx, &cfg, NULL);
    CHECK(router != NULL);
}

static bool
route_eq(const struct dsv4_route *a, const struct dsv4_route *b)
{
    return a->len == b->len && memcmp(a->id, b->id, a->len) == 0;
}

static bool
known(const struct dsv4_route *r)
{
    return (pre.ready && route_eq(r, &pre.route)) || (dec.ready && route_eq(r, &dec.route));
}

/* Receive one message (waits for it); a HEARTBEAT is answered, cleared and
 * reported by returning false. */
static bool
recv_one(struct dsv4_route *from, struct dsv4_msg *m)
{
    struct dsv4_perr pe;

    CHECK(dsv4_zsock_recv(router, from, m, &pe, 0) == DSV4_OK);
    if (m->cmd != DSV4_RANK_HEARTBEAT)
        return true;
    /* Answer as a scheduler does: a registered rank keeps its link, an
     * unknown one (registered with an earlier scheduler) is told to go. */
    dsv4_msg_clear(m);
    dsv4_msg_init(m, DSV4_SUB_RANK, known(from) ? DSV4_RANK_HEARTBEAT :
                                                  DSV4_RANK_DISCONNECT);
    /* The rank may have dropped this link meanwhile (it re-registers on
     * a new one): a reply to a peer that is gone is not an error, as in
     * the scheduler. */
    enum dsv4_err e = dsv4_zsock_send(router, from, m, 0, NULL);
    CHECK(e == DSV4_OK || (e == DSV4_ERR_SYS && errno == EHOSTUNREACH));
    dsv4_msg_clear(m);
    return false;
}

/* Receive one message other than HEARTBEAT (hang guard only). */
static void
recv_msg(struct dsv4_route *from, struct dsv4_msg *m)
{
    zmq_pollitem_t it = { router, -1, ZMQ_POLLIN, 0 };

    do
        CHECK(zmq_poll(&it, 1, HANG_GUARD_MS) == 1);
    while (!recv_one(from, m));
}

static void
send_to(const struct peer *p, const struct dsv4_msg *m)
{
    CHECK(dsv4_zsock_send(router, &p->route, m, 0, NULL) == DSV4_OK);
}

static void
send_ref(const struct peer *p, int cmd, uint64_t req)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_RANK, cmd);
    m.u.ref.req = req;
    send_to(p, &m);
}

/* Wait until every rank not yet ready sent READY, answering each with
 * WELCOME. */
static void
register_wait(void)
{
    struct dsv4_route from;
    struct dsv4_msg m, w;

    dsv4_msg_init(&m, DSV4_SUB_NONE, 0);
    while (!pre.ready || !dec.ready) {
        recv_msg(&from, &m);
        if (m.cmd == DSV4_RANK_READY) {
            struct peer *p = m.u.ready.role == DSV4_ROLE_PREFILL ? &pre : &dec;
            CHECK(m.u.ready.group_size == 1);
            CHECK(m.u.ready.transports & (1u << DSV4_TRANSPORT_SHM));
            CHECK(m.u.ready.capacity == (m.u.ready.role == DSV4_ROLE_PREFILL ? 2u : 4u));
            p->route = from;
            p->ready = true;
            p->transports = m.u.ready.transports;
            dsv4_msg_init(&w, DSV4_SUB_RANK, DSV4_RANK_WELCOME);
            w.u.welcome.heartbeat_ms = 100;
            w.u.welcome.liveness = 100;  /* 10 s: this harness sends no heartbeats, and sanitizer builds are slow */
            send_to(p, &w);
        }
        dsv4_msg_clear(&m);
    }
}

/* Wait until both ranks sent READY (again). */
static void
register_ranks(void)
{
    pre.ready = dec.ready = false;
    register_wait();
}

static bool
shm_exists(const struct treq *r)
{
    char path[400];
    struct stat st;

    snprintf(path, sizeof(path), "/dev/shm%.*s", (int)r->loc.handle_len,
             (const char *)r->handle);
    return stat(path, &st) == 0;
}

/* Greedy reference: prompt through one forward call, then one token at a
 * time, each argmax'ed by the backend's sampler at temperature 0. */
static void
reference(struct tmodel *t, const struct treq *r, int32_t *out)
{
    struct dsv4_sample_params sp = { .temperature = 0.0f, .top_p = 1.0f };
    float *logits = malloc(sizeof(float) * (size_t)t->V);
    int32_t slot = 0, n = r->n_prompt, one = 1, tok;

    CHECK(logits != NULL);
    CHECK(dsv4_model_seq_reset(t->m, 0) == DSV4_OK);
    struct dsv4_batch b = { 1, &slot, &n, r->prompt };
    CHECK(dsv4_model_forward(t->m, &b, logits, 0) == DSV4_OK);
    for (int i = 0; i < r->max_tokens; i++) {
        sp.step = (uint64_t)i;
        CHECK(t->be->ops->sample(t->be, &tok, NULL, logits, &sp, 1, t->V) == DSV4_OK);
        out[i] = tok;
        struct dsv4_batch d = { 1, &slot, &one, &tok };
        if (i + 1 < r->max_tokens)
            CHECK(dsv4_model_forward(t->m, &d, logits, 0) == DSV4_OK);
    }
    free(logits);
}

static void
send_prefill_via(struct treq *r, enum dsv4_transport via)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_PREFILL);
    m.u.prefill.req = r->req;
    m.u.prefill.tokens = r->prompt;
    m.u.prefill.n_tokens = (uint32_t)r->n_prompt;
    m.u.prefill.s.temperature = 0.0f;
    m.u.prefill.s.seed = 7;
    m.u.prefill.s.has_seed = true;
    m.u.prefill.dst_group = 0;
    m.u.prefill.transport = via;
    send_to(&pre, &m);
}

static void
send_prefill(struct treq *r)
{
    send_prefill_via(r, DSV4_TRANSPORT_SHM);
}

static void
send_decode(struct treq *r, uint32_t slot)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DECODE);
    m.u.decode.req = r->req;
    m.u.decode.slot = slot;
    m.u.decode.token = r->out[0];
    m.u.decode.pos = (uint32_t)r->n_prompt;
    m.u.decode.max_tokens = (uint32_t)(r->max_tokens - 1);
    m.u.decode.s.temperature = 0.0f;
    m.u.decode.s.seed = 7;
    m.u.decode.s.has_seed = true;
    m.u.decode.step = 1;
    m.u.decode.has_step = true;
    m.u.decode.kv[0] = r->loc;
    m.u.decode.n_kv = 1;
    send_to(&dec, &m);
}

/* Copy PREFILL_DONE's location (of transport via) and first token into r;
 * a shm region exists. */
static void
take_location_via(struct treq *r, const struct dsv4_msg *m, enum dsv4_transport via)
{
    CHECK(m->u.prefill_done.n_kv == 1);
    r->loc = m->u.prefill_done.kv[0];
    CHECK(r->loc.transport == via && r->loc.n_seg == 1);
    CHECK(r->loc.n_tokens == (uint32_t)r->n_prompt);
    CHECK(r->loc.handle_len <= sizeof(r->handle));
    memcpy(r->handle, r->loc.handle, r->loc.handle_len);
    r->sizes[0] = r->loc.sizes[0];
    r->offsets[0] = r->loc.offsets[0];
    r->loc.handle = r->handle;
    r->loc.sizes = r->sizes;
    r->loc.offsets = r->offsets;
    r->out[r->n_out++] = m->u.prefill_done.token;
    CHECK(via != DSV4_TRANSPORT_SHM || shm_exists(r));
}

static void
take_location(struct treq *r, const struct dsv4_msg *m)
{
    take_location_via(r, m, DSV4_TRANSPORT_SHM);
}

/* PREFILL r on the prefill rank over `via` and wait for its PREFILL_DONE
 * (r's location and first token taken). */
static void
prefill_via(struct treq *r, enum dsv4_transport via)
{
    struct dsv4_route from;
    struct dsv4_msg m;

    r->n_out = 0;
    send_prefill_via(r, via);
    dsv4_msg_init(&m, DSV4_SUB_NONE, 0);
    recv_msg(&from, &m);
    CHECK(m.cmd == DSV4_RANK_PREFILL_DONE && route_eq(&from, &pre.route));
    CHECK(m.u.prefill_done.req == r->req);
    take_location_via(r, &m, via);
    dsv4_msg_clear(&m);
}

/* PREFILL r over shm; nobody claims the region. */
static void
prefill_unclaimed(struct treq *r)
{
    prefill_via(r, DSV4_TRANSPORT_SHM);
}

/* The first transport other than none missing from `offered` (a READY's
 * transports), or DSV4_TRANSPORT_NONE when it offers them all. */
static int
missing_transport(uint32_t offered)
{
    for (int x = DSV4_TRANSPORT_NONE + 1; x < DSV4_TRANSPORT__COUNT; x++)
        if (!(offered & (1u << x)))
            return x;
    return DSV4_TRANSPORT_NONE;
}

/* Answer HEARTBEATs until r's region is gone (no other message may come);
 * false if it is still there after bound_ms. */
static bool
wait_region_gone(const struct treq *r, int bound_ms)
{
    zmq_pollitem_t it = { router, -1, ZMQ_POLLIN, 0 };
    struct dsv4_route from;
    struct dsv4_msg m;
    int64_t end = dsv4_now_ms() + bound_ms;

    dsv4_msg_init(&m, DSV4_SUB_NONE, 0);
    while (dsv4_now_ms() < end) {
        if (!shm_exists(r))
            return true;
        if (zmq_poll(&it, 1, 50) == 1 && recv_one(&from, &m)) {
            fprintf(stderr, "unexpected %s\n", dsv4_proto_cmd_name(m.sub, m.cmd));
            CHECK(0);
        }
    }
    return !shm_exists(r);
}

/* Wait for `p`'s ERROR about `req` (a decode rank's KV_RELEASE of it before
 * is counted in *released) and check its code. */
static void
expect_error(const struct peer *p, uint64_t req, int code, int *released)
{
    struct dsv4_route from;
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_NONE, 0);
    for (;;) {
        recv_msg(&from, &m);
        CHECK(route_eq(&from, &p->route));
        if (m.cmd != DSV4_RANK_KV_RELEASE)
            break;
        CHECK(m.u.ref.req == req);
        (*released)++;
        dsv4_msg_clear(&m);
    }
    CHECK(m.cmd == DSV4_RANK_ERROR && m.u.error.req == req);
    if (m.u.error.code != code)
        fprintf(stderr, "req %llu: ERROR %u %s, want %d\n", (unsigned long long)req,
                (unsigned)m.u.error.code, m.u.error.message, code);
    CHECK(m.u.error.code == code);
    dsv4_msg_clear(&m);
}

/* Work the scheduler would never send (it checks first): each gets ERROR
 * with its code, a DECODE's KV_RELEASE comes before, and the ranks serve on. */
static void
bad_work(const struct tmodel *t, struct treq *r)
{
    static int32_t big[300];
    struct dsv4_msg m;
    int released = 0, sent = 0, lacks;
    uint64_t req = 400;
    int32_t first = r->prompt[0];

    /* PREFILL: a transport the rank does not have (its READY's list: a CPU
     * rank lacks cudaipc; a CUDA rank built with UCX has all three, so the
     * case is left out there), more tokens than max_seq (256), an id
     * outside the vocabulary */
    lacks = missing_transport(pre.transports);
    if (lacks == DSV4_TRANSPORT_NONE)
        printf("bad_work: the prefill rank has every transport: no PREFILL of a missing one\n");
    for (int i = lacks == DSV4_TRANSPORT_NONE ? 1 : 0; i < 3; i++) {
        dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_PREFILL);
        m.u.prefill.req = req + (uint64_t)i;
        m.u.prefill.tokens = i == 1 ? big : r->prompt;
        m.u.prefill.n_tokens = i == 1 ? 300u : (uint32_t)r->n_prompt;
        m.u.prefill.transport = i == 0 ? (enum dsv4_transport)lacks : DSV4_TRANSPORT_SHM;
        r->prompt[0] = i == 2 ? t->V : first;
        send_to(&pre, &m);
        expect_error(&pre, req + (uint64_t)i, i == 0 ? DSV4_STATUS_NOT_SUPPORTED :
                     i == 1 ? DSV4_STATUS_TOO_LARGE : DSV4_STATUS_BAD_ARGUMENT, &released);
    }
    r->prompt[0] = first;
    CHECK(released == 0);
    /* DECODE: a position past max_seq, a token outside the vocabulary, a
     * location whose region does not exist, a location that covers another
     * position count than pos, one that says it is one of two parts, one of
     * a transport the decode rank lacks (left out where it has all), one
     * whose segment is not the size of a state of pos positions (refused
     * before a transport sizes a buffer by it), one whose segment starts
     * past 0 (a transport fetched the region from 0 to its end: as much
     * more as the offset said) */
    lacks = missing_transport(dec.transports);
    for (int i = 0; i < 8; i++) {
        static const int code[8] = { DSV4_STATUS_TOO_LARGE, DSV4_STATUS_BAD_ARGUMENT,
                                     DSV4_STATUS_INTERNAL, DSV4_STATUS_BAD_MESSAGE,
                                     DSV4_STATUS_NOT_SUPPORTED, DSV4_STATUS_NOT_SUPPORTED,
                                     DSV4_STATUS_BAD_MESSAGE, DSV4_STATUS_NOT_SUPPORTED };
        uint64_t huge[1] = { UINT64_C(1) << 40 }, far[1] = { UINT64_C(1) << 30 };

        if (i == 5 && lacks == DSV4_TRANSPORT_NONE) {
            printf("bad_work: the decode rank has every transport: no DECODE from a missing "
                   "one\n");
            continue;
        }
        dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DECODE);
        m.u.decode.req = req + 10 + (uint64_t)i;
        m.u.decode.token = i == 1 ? t->V : 1;
        m.u.decode.pos = i == 0 ? 256u : i == 3 ? (uint32_t)r->n_prompt - 1 :
                         (uint32_t)r->n_prompt;
        m.u.decode.max_tokens = 4;
        m.u.decode.kv[0] = r->loc;
        m.u.decode.kv[0].n_parts = i == 4 ? 2 : r->loc.n_parts;
        m.u.decode.kv[0].transport = i == 5 ? (enum dsv4_transport)lacks : r->loc.transport;
        if (i == 6)
            m.u.decode.kv[0].sizes = huge;
        if (i == 7)
            m.u.decode.kv[0].offsets = far;
        m.u.decode.n_kv = 1;
        send_to(&dec, &m);
        expect_error(&dec, req + 10 + (uint64_t)i, code[i], &released);
        sent++;
    }
    CHECK(released == sent);   /* a KV_RELEASE before each ERROR */
    /* both still answer */
    for (int i = 0; i < 2; i++) {
        struct dsv4_route from;

        send_ref(i == 0 ? &pre : &dec, DSV4_RANK_ABORT, 997);
        recv_msg(&from, &m);
        CHECK(route_eq(&from, i == 0 ? &pre.route : &dec.route));
        CHECK(m.cmd == DSV4_RANK_ABORT_DONE && m.u.ref.req == 997);
        dsv4_msg_clear(&m);
    }
}

/* r prefilled over `via`, its DECODE followed at once by an ABORT (over
 * ucx the import is then most likely still in flight, and the decode rank
 * drops it): ABORT_DONE comes, after whatever came first (KV_RELEASE, the
 * first TOKENS), and the prefill rank's ABORT frees the export. */
static void
abort_in_import(struct treq *r, enum dsv4_transport via)
{
    struct dsv4_route from;
    struct dsv4_msg m;

    prefill_via(r, via);
    send_decode(r, 0);
    send_ref(&dec, DSV4_RANK_ABORT, r->req);
    for (;;) {
        recv_msg(&from, &m);
        CHECK(route_eq(&from, &dec.route));
        if (m.cmd == DSV4_RANK_ABORT_DONE) {
            CHECK(m.u.ref.req == r->req);
            dsv4_msg_clear(&m);
            break;
        }
        CHECK(m.cmd == DSV4_RANK_KV_RELEASE || m.cmd == DSV4_RANK_TOKENS);
        dsv4_msg_clear(&m);
    }
    send_ref(&pre, DSV4_RANK_ABORT, r->req);
    recv_msg(&from, &m);
    CHECK(m.cmd == DSV4_RANK_ABORT_DONE && m.u.ref.req == r->req &&
          route_eq(&from, &pre.route));
    dsv4_msg_clear(&m);
}

/* r prefilled with its state handed over `via` (a transport both ranks
 * offer), decoded from that location (the decode rank's KV_RELEASE
 * forwarded to the prefill rank, which then frees its region); the
 * tokens must be the reference's. */
static void
handoff_via(struct tmodel *t, struct treq *r, enum dsv4_transport via)
{
    struct dsv4_route from;
    struct dsv4_msg m;
    int32_t ref[MAX_OUT];

    r->done = r->released = false;
    prefill_via(r, via);
    send_decode(r, 0);
    while (!r->done) {
        recv_msg(&from, &m);
        CHECK(route_eq(&from, &dec.route));
        if (m.cmd == DSV4_RANK_KV_RELEASE) {
            CHECK(m.u.ref.req == r->req && !r->released);
            r->released = true;
            send_ref(&pre, DSV4_RANK_KV_RELEASE, r->req);
        } else if (m.cmd == DSV4_RANK_TOKENS) {
            for (uint32_t i = 0; i < m.u.step.n; i++) {
                CHECK(m.u.step.reqs[i] == r->req && r->released && r->n_out < MAX_OUT);
                r->out[r->n_out++] = m.u.step.tokens[i];
            }
        } else {
            CHECK(m.cmd == DSV4_RANK_DECODE_DONE && m.u.decode_done.req == r->req);
            CHECK(m.u.decode_done.finish == DSV4_FINISH_LENGTH);
            r->done = true;
        }
        dsv4_msg_clear(&m);
    }
    /* the prefill rank handled the release before this ABORT's answer */
    send_ref(&pre, DSV4_RANK_ABORT, 995);
    recv_msg(&from, &m);
    CHECK(m.cmd == DSV4_RANK_ABORT_DONE && m.u.ref.req == 995);
    dsv4_msg_clear(&m);
    reference(t, r, ref);
    CHECK(r->n_out == r->max_tokens);
    for (int j = 0; j < r->max_tokens; j++) {
        if (ref[j] != r->out[j])
            fprintf(stderr, "req %llu via %s, token %d: service %d, reference %d\n",
                    (unsigned long long)r->req, dsv4_transport_name(via), j, (int)r->out[j],
                    (int)ref[j]);
        CHECK(ref[j] == r->out[j]);
    }
    printf("handoff via %s: %d tokens equal the reference\n", dsv4_transport_name(via),
           r->n_out);
}

static struct treq *
find(struct treq *rs, uint64_t req)
{
    for (int i = 0; i < N_REQ; i++)
        if (rs[i].req == req)
            return &rs[i];
    CHECK(!"unknown req");
    return NULL;
}

int
main(int argc, char **argv)
{
    struct treq rs[N_REQ];
    struct tmodel t;
    struct dsv4_route from;
    struct dsv4_msg m;
    char conf[96], rank_no[16];
    int n_done = 0, n_pdone = 0, status;
    bool abort_done = false;
    FILE *fp;

    if (argc != 4) {
        fprintf(stderr, "usage: %s CKPT DSV4_PREFILL DSV4_DECODE\n", argv[0]);
        return 2;
    }
    snprintf(sockdir, sizeof(sockdir), "/tmp/dsv4-rank-smoke-XXXXXX");
    CHECK(mkdtemp(sockdir) != NULL);
    snprintf(endpoint, sizeof(endpoint), "ipc://%s/rank.sock", sockdir);
    snprintf(conf, sizeof(conf), "%s/dsv4.conf", sockdir);
    fp = fopen(conf, "w");
    CHECK(fp != NULL);
    fclose(fp);
    /* A rank number of our own, so parallel runs use distinct shm names. */
    snprintf(rank_no, sizeof(rank_no), "%d", (int)(getpid() % 60000) + 1000);

    zctx = zmq_ctx_new();
    router_open();
    children[0] = spawn(argv[2], argv[1], conf, rank_no, "2", "8", NULL);
    children[1] = spawn(argv[3], argv[1], conf, rank_no, "4", "8", NULL);

    tmodel_open(&t, argv[1], DSV4_NUMERICS_REF, 1, 256, 64);
    memset(rs, 0, sizeof(rs));
    for (int i = 0; i < N_REQ; i++) {
        rs[i].req = 100 + (uint64_t)i;
        rs[i].n_prompt = 21 - 4 * i;             /* 21, 17, 13: chunked by 8 rows */
        rs[i].max_tokens = 9 - 2 * i;            /* 9, 7, 5 */
        tmodel_tokens(rs[i].prompt, rs[i].n_prompt, t.V, 11 + (uint64_t)i);
    }

    register_ranks();
    /* Two prompts share the prefill rank's two slots; the third waits. */
    send_prefill(&rs[0]);
    send_prefill(&rs[1]);
    dsv4_msg_init(&m, DSV4_SUB_NONE, 0);
    while (n_done < 2 || !abort_done) {
        struct treq *r;
        recv_msg(&from, &m);
        switch (m.cmd) {
        case DSV4_RANK_PREFILL_DONE:
            CHECK(route_eq(&from, &pre.route));
            r = find(rs, m.u.prefill_done.req);
            take_location(r, &m);
            n_pdone++;
            if (r == &rs[0] || r == &rs[1]) {
                send_decode(r, (uint32_t)(r - rs));
                if (r == &rs[0])
                    send_prefill(&rs[2]);
            } else {
                /* Nobody claims this one: ABORT frees it. */
                send_ref(&pre, DSV4_RANK_ABORT, r->req);
            }
            break;
        case DSV4_RANK_KV_RELEASE:
            CHECK(route_eq(&from, &dec.route));
            r = find(rs, m.u.ref.req);
            r->released = true;
            send_ref(&pre, DSV4_RANK_KV_RELEASE, r->req);
            break;
        case DSV4_RANK_TOKENS:
            CHECK(route_eq(&from, &dec.route));
            for (uint32_t i = 0; i < m.u.step.n; i++) {
                r = find(rs, m.u.step.reqs[i]);
                CHECK(r->released && !r->done && r->n_out < MAX_OUT);
                r->out[r->n_out++] = m.u.step.tokens[i];
            }
            break;
        case DSV4_RANK_DECODE_DONE:
            r = find(rs, m.u.decode_done.req);
            CHECK(m.u.decode_done.finish == DSV4_FINISH_LENGTH);
            CHECK(m.u.decode_done.n_tokens == (uint32_t)(r->max_tokens - 1));
            r->done = true;
            n_done++;
            break;
        case DSV4_RANK_ABORT_DONE:
            CHECK(m.u.ref.req == rs[2].req);
            CHECK(!shm_exists(&rs[2]));
            abort_done = true;
            break;
        case DSV4_RANK_HEARTBEAT:
            break;
        default:
            fprintf(stderr, "unexpected %s\n", dsv4_proto_cmd_name(m.sub, m.cmd));
            CHECK(0);
        }
        dsv4_msg_clear(&m);
    }
    CHECK(n_pdone == 3);

    /* The prefill rank freed the released regions: a message sent after the
     * KV_RELEASEs is answered after they were handled. */
    send_ref(&pre, DSV4_RANK_ABORT, 999);
    for (;;) {
        recv_msg(&from, &m);
        int cmd = m.cmd;
        uint64_t req = m.u.ref.req;
        dsv4_msg_clear(&m);
        if (cmd == DSV4_RANK_ABORT_DONE && req == 999)
            break;
    }
    for (int i = 0; i < 2; i++)
        CHECK(!shm_exists(&rs[i]));

    for (int i = 0; i < 2; i++) {
        int32_t ref[MAX_OUT];
        reference(&t, &rs[i], ref);
        CHECK(rs[i].n_out == rs[i].max_tokens);
        for (int j = 0; j < rs[i].max_tokens; j++) {
            if (ref[j] != rs[i].out[j])
                fprintf(stderr, "req %d token %d: service %d, reference %d\n", i, j,
                        (int)rs[i].out[j], (int)ref[j]);
            CHECK(ref[j] == rs[i].out[j]);
        }
    }

    /* The same prompt's state over every other transport both ranks offer
     * (the CPU backend: ucx where built; a CUDA rank: cudaipc, and ucx
     * staged through host memory), as the scheduler picks ucx between
     * hosts (docs/protocol.md §6.3): the same tokens. */
    for (int x = DSV4_TRANSPORT_SHM + 1; x < DSV4_TRANSPORT__COUNT; x++) {
        if (!(pre.transports & dec.transports & (1u << x)))
            continue;
        rs[0].req = 510 + (uint64_t)x;
        abort_in_import(&rs[0], (enum dsv4_transport)x);
        rs[0].req = 500 + (uint64_t)x;
        handoff_via(&t, &rs[0], (enum dsv4_transport)x);   /* and the slot serves again */
    }

    /* The scheduler goes away and a new one binds: both ranks register again.
     * A process's listener is gone when it exits; a socket closed here is
     * closed by libzmq's I/O thread a moment later, which then unlinks its
     * file: bound before, the new socket would meet a live listener (and
     * be refused: a live scheduler's socket is not taken) or lose its
     * file to that unlink. */
    dsv4_zsock_close(router);
    for (int i = 0; i < 5000 && access(endpoint + strlen("ipc://"), F_OK) == 0; i++)
        usleep(1000);
    router_open();
    register_ranks();

    /* A prefill rank killed while it holds an export leaves the region
     * behind; the next process of the same rank removes it before its READY. */
    rs[2].req = 300;
    prefill_unclaimed(&rs[2]);
    CHECK(kill(children[0], SIGKILL) == 0);
    CHECK(waitpid(children[0], &status, 0) == children[0]);
    CHECK(shm_exists(&rs[2]));
    children[0] = spawn(argv[2], argv[1], conf, rank_no, "2", "8", "1000");
    pre.ready = false;
    register_wait();
    CHECK(!shm_exists(&rs[2]));

    /* An export nobody claims or aborts is freed by the rank itself after
     * --kv-timeout-ms (1 s here); a late KV_RELEASE of it is harmless. */
    rs[2].req = 301;
    prefill_unclaimed(&rs[2]);
    CHECK(wait_region_gone(&rs[2], 60000));
    send_ref(&pre, DSV4_RANK_KV_RELEASE, rs[2].req);
    send_ref(&pre, DSV4_RANK_ABORT, 998);
    recv_msg(&from, &m);
    CHECK(m.cmd == DSV4_RANK_ABORT_DONE && m.u.ref.req == 998);
    dsv4_msg_clear(&m);

    /* rs[2]'s region is gone: its location serves as one that does not exist */
    bad_work(&t, &rs[2]);

    /* SIGTERM: a registered rank asks for no new work (DRAIN) and stops
     * once told that nothing is booked on it (DRAIN_DONE), then says so
     * (DISCONNECT); protocol §6 */
    for (int i = 0; i < 2; i++) {
        const struct peer *p = i == 0 ? &pre : &dec;

        int cmd;

        CHECK(kill(children[i], SIGTERM) == 0);
        do {
            recv_msg(&from, &m);
            cmd = m.cmd;
            dsv4_msg_clear(&m);
        } while (!(route_eq(&from, &p->route) && cmd == DSV4_RANK_DRAIN));
        send_ref(p, DSV4_RANK_DRAIN_DONE, 0);
        do {
            recv_msg(&from, &m);
            cmd = m.cmd;
            dsv4_msg_clear(&m);
        } while (!(route_eq(&from, &p->route) && cmd == DSV4_RANK_DISCONNECT));
        CHECK(waitpid(children[i], &status, 0) == children[i]);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        children[i] = 0;
    }
    dsv4_zsock_close(router);
    zmq_ctx_term(zctx);
    tmodel_close(&t);
    unlink(conf);
    rmdir(sockdir);
    printf("rank smoke: 3 prefills, 2 decodes, tokens equal the reference, regions freed\n");
    return 0;
}
