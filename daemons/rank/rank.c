/*
 * rank.c — main of dsv4-prefill / dsv4-decode: options and configuration,
 * start-up (weights, backend, model, transfer layer, scheduler link), the
 * event loop, the scheduler link (READY / WELCOME / heartbeats / loss) and
 * the top-level dispatch of scheduler messages.  The role's work lives in
 * rank_prefill.c and rank_decode.c, the handoff regions in rank_kv.c.
 *
 * Single-threaded (the backend may run its own worker threads inside a
 * forward call).  Signals arrive through a signalfd in the poll set.
 */
#include "rank.h"

#include <sys/signalfd.h>

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/model_config.h"
#include "common/sdnotify.h"
#include "common/weights_shard.h"
#ifdef DSV4_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda_fast.h"
#include "kernels/cuda_gemm_grouped.h"   /* dsv4_cuda_blas_usable */
#include "kernels/cuda_share.h"
#include "kernels/cuda_weights.h"
#endif

#define RANK_POLL_SOCK 0      /* poll slot: scheduler DEALER */
#define RANK_POLL_SIGNAL 1    /* poll slot: signalfd */
#define RANK_POLL_KVX 2       /* poll slots: transport event fds (imports done) */
#define RANK_POLL_N (RANK_POLL_KVX + DSV4_TRANSPORT__COUNT)

static void __attribute__((noreturn))
usage(int status)
{
    char synopsis[512];

    snprintf(synopsis, sizeof(synopsis),
        "usage: dsv4-%s [-nv] [-f CONFIG] [-o KEY=VALUE]... [--rank N] [--group N]\n"
        "       [--checkpoint DIR] [--backend cpu|cuda] [--threads N] [--sched ENDPOINT]\n"
        "       [--slots N] [--max-seq N] [--rows N] [--kv-timeout-ms MS] [--role ROLE]\n"
        "       [--synthetic-weights SEED (--preset NAME | --config FILE) [--set K=V]...]\n"
        "       [--no-graphs]\n", dsv4_role_name(RANK_ROLE));
    dsv4_cli_usage(synopsis,
        "A dsv4 rank: registers with the scheduler and runs the model's forward for\n"
        "the requests it is given (docs/architecture.md, docs/operations.md).\n"
        "  -f CONFIG             configuration file (default " DSV4_CONF_DEFAULT_PATH "\n"
        "                        when it exists; ROLE. and ROLE@N. keys win)\n"
        "  -o KEY=VALUE          set one configuration key over the file (up to 64)\n"
        "  -n                    check the configuration (the scheduler endpoint, the\n"
        "                        checkpoint's tensors) without a device or a connection,\n"
        "                        print it and exit\n"
        "  -v                    more logging (-vv: debug)\n"
        "  --rank N              this rank's index (0); its GPU is the `gpu` key's\n"
        "                        (decode@N.gpu = N puts rank N on device N)\n"
        "  --group N             its decode group (default N / group_size)\n"
        "  --checkpoint DIR      over the checkpoint key\n"
        "  --backend cpu|cuda    over the backend key\n"
        "  --threads N           over the threads key (CPU backend)\n"
        "  --sched ENDPOINT      over rank_endpoint (the scheduler's rank socket)\n"
        "  --slots N             concurrent requests (default slots / prefill_slots)\n"
        "  --max-seq N           over max_seq\n"
        "  --rows N              rows per prefill forward call (default the larger of\n"
        "                        256 and prefill_chunk)\n"
        "  --kv-timeout-ms MS    export expiry: free an exported decode state nobody\n"
        "                        claimed after MS (default 120000); not the key\n"
        "                        kv_timeout_ms, a decode rank's import bound (5000)\n"
        "  --role ROLE           must name this executable's role\n"
        "  --synthetic-weights SEED  generate the weights (seeded) instead of reading a\n"
        "                        checkpoint; the model from --preset NAME or --config\n"
        "                        FILE (a config.json), --set KEY=VALUE over it\n"
        "  --no-graphs           no CUDA graphs for the decode step\n"
        "  -h, --help            this help\n"
        "      --version         the version\n"
        DSV4_CLI_DAEMON_EXIT, status);
}

/* --- Messages to the scheduler ------------------------------------------------- */

/* The link's send queue, in messages: as the scheduler's side (sched.c), so
 * that a scheduler slow to read costs memory, not messages.  A send that
 * still finds it full loses the link (send_lost): tokens or an end dropped
 * alone would leave a request with a gap, or never ended. */
#define RANK_HWM 1000000
/* On exit: the last messages (DRAIN, DISCONNECT) get this long to leave. */
#define RANK_LINGER_MS 500

bool
rank_send(struct rank *k, const struct dsv4_msg *m)
{
    struct dsv4_perr pe;
    enum dsv4_err e;

    if (k->sock == NULL)
        return false;
    e = dsv4_zsock_send(k->sock, NULL, m, ZMQ_DONTWAIT, &pe);
    if (e != DSV4_OK) {
        log_warnx("rank_send: %s: %s", dsv4_proto_cmd_name(DSV4_SUB_RANK, m->cmd),
                  e == DSV4_ERR_INVAL ? pe.message : dsv4_strerror(e));
        if (e == DSV4_ERR_BUSY && k->link == RANK_LINK_UP)
            k->send_lost = true;
        return false;
    }
    if (k->link == RANK_LINK_UP)
        dsv4_liveness_tx(&k->live, dsv4_now_ms());
    return true;
}

void
rank_send_error(struct rank *k, uint64_t req, uint16_t code, const char *fmt, ...)
{
    char msg[DSV4_PROTO_MAX_MESSAGE / 2];
    struct dsv4_msg m;
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    log_warnx("rank_error: req=%" PRIu64 " code=%u %s", req, (unsigned)code, msg);
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_ERROR);
    m.u.error.req = req;
    m.u.error.code = code;
    m.u.error.message = msg;
    rank_send(k, &m);
}

void
rank_send_ref(struct rank *k, int cmd, uint64_t req)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_RANK, cmd);
    m.u.ref.req = req;
    rank_send(k, &m);
}

uint32_t
rank_active(const struct rank *k)
{
    uint32_t n = 0;

    for (int i = 0; i < k->o.slots; i++) {
        if (k->jobs != NULL && k->jobs[i].active)
            n++;
        if (k->streams != NULL && k->streams[i].active)
            n++;
    }
    return n + k->n_exports;
}

enum dsv4_err
rank_test_nomem(long *left, const char *var, enum dsv4_err e)
{
    if (e == DSV4_OK && *left > 0 && --*left == 0)
        e = dsv4_err_set(DSV4_ERR_NOMEM, "out of device memory injected for a test (%s)", var);
    return e;
}

enum dsv4_err
rank_warmup(struct rank *k)
{
    enum dsv4_err e = k->o.role == DSV4_ROLE_PREFILL ? prefill_warmup(k) : decode_warmup(k);

    if (e == DSV4_OK)
        k->warmed = true;
    return e;
}

void
rank_warmup_inputs(struct rank *k, int n_tok, int n_seqs)
{
    for (int i = 0; i < n_tok; i++)
        k->b_tok[i] = (int32_t)(((int64_t)i * 7919 + 13) % k->V);
    for (int s = 0; s < n_seqs; s++) {
        memset(&k->sp[s], 0, sizeof(k->sp[s]));
        k->sp[s].temperature = 1.0f;
        k->sp[s].top_p = 1.0f;
        k->sp[s].n_top = DSV4_TOP_MAX;   /* the top path's kernels and scratch too */
    }
}

void
rank_sample_params(struct dsv4_sample_params *p, const struct dsv4_sampling *s, uint64_t step)
{
    /* a temperature below the protocol's bound is greedy: the backends'
     * sample op takes it so itself (so_greedy), at the same bound */
    _Static_assert(DSV4_PROTO_MIN_TEMPERATURE == DSV4_SAMPLE_GREEDY_BELOW,
                   "the protocol's and the sampler's greedy bounds differ");
    p->temperature = s->temperature;
    p->top_p = s->top_p;
    p->top_k = (int32_t)s->top_k;
    p->seed = s->has_seed ? s->seed : 0;
    p->step = step;
    p->n_top = (int32_t)(s->top_logprobs < DSV4_TOP_MAX ? s->top_logprobs : DSV4_TOP_MAX);
}

void
rank_top_pack(struct rank *k, struct dsv4_top *t, int n)
{
    uint32_t at = 0;
    bool any = false;

    for (int i = 0; i < n; i++) {
        int c = k->out_top.n[i];

        k->out_top_n[i] = (uint64_t)c;
        any = any || c > 0;
        for (int j = 0; j < c; j++, at++) {
            k->msg_top_ids[at] = k->out_top.ids[(size_t)i * DSV4_TOP_MAX + j];
            k->msg_top_lp[at] = k->out_top.logprob[(size_t)i * DSV4_TOP_MAX + j];
        }
    }
    memset(t, 0, sizeof(*t));
    if (!any)
        return;
    t->top_n = k->out_top_n;
    t->top_ids = at > 0 ? k->msg_top_ids : NULL;
    t->top_logprobs = at > 0 ? k->msg_top_lp : NULL;
    t->n_top = at;
}

/* --- Scheduler link ------------------------------------------------------------- */

/*
 * The id READY announces for the rank's GPU (proto.h dsv4_rank_ready.device):
 * its CUDA UUID as nvidia-smi prints it, "GPU-xxxxxxxx-xxxx-xxxx-xxxx-
 * xxxxxxxxxxxx"; "" on the cpu backend or when the driver cannot say (the
 * scheduler then takes the rank as sharing a GPU with every group).
 */
static void
rank_device_id(struct rank *k, char *out, size_t n)
{
    out[0] = '\0';
#ifdef DSV4_HAVE_CUDA
    uint8_t u[16];

    if (strcmp(k->be->name, "cuda") != 0)
        return;
    if (dsv4_cuda_device_uuid(k->be, u) != DSV4_OK) {
        log_warnx("rank_device_id: %s: the scheduler will take this rank as sharing its GPU "
                  "with every group", dsv4_errmsg());
        return;
    }
    snprintf(out, n, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
             u[13], u[14], u[15]);
#else
    (void)k;
    (void)n;
#endif
}

/* Open a fresh DEALER (dropping anything queued on the old one) and send
 * READY.  A failure is retried at the next READY retry. */
static void
link_join(struct rank *k)
{
    struct dsv4_zsock_cfg cfg;
    struct dsv4_msg m;
    enum dsv4_err e;

    dsv4_zsock_close(k->sock);
    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = k->o.conf.rank_endpoint;
    cfg.type = ZMQ_DEALER;
    cfg.key_dir = k->o.conf.key_dir;
    cfg.hwm = RANK_HWM;
    k->sock = dsv4_zsock_open(k->zctx, &cfg, &e);
    k->send_lost = false;
    k->link = RANK_LINK_JOINING;
    k->ready_ms = dsv4_now_ms();
    if (k->sock == NULL) {
        log_warnx("link_join: %s: %s", k->o.conf.rank_endpoint, dsv4_errmsg());
        return;
    }
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_READY);
    m.u.ready.role = k->o.role;
    m.u.ready.index = k->o.index;
    m.u.ready.group = k->o.group;
    m.u.ready.group_rank = k->o.group_rank;
    m.u.ready.group_size = k->o.group_size;
    m.u.ready.capacity = (uint32_t)k->o.slots;
    m.u.ready.max_ctx = (uint32_t)k->max_seq;
    m.u.ready.host = k->host;
    m.u.ready.pid = (uint32_t)getpid();
    m.u.ready.transports = k->transports;
    m.u.ready.burst = k->o.burst;
    m.u.ready.device = k->device[0] != '\0' ? k->device : NULL;
    m.u.ready.model = k->model_fp[0] != '\0' ? k->model_fp : NULL;
    m.u.ready.abi = DSV4_RANK_ABI;
    m.u.ready.has_abi = true;
    if (k->o.role == DSV4_ROLE_PREFILL) {
        /* the rows of one forward call now, and before the warm-up lowered them */
        int rows = k->o.rows < k->max_seq ? k->o.rows : k->max_seq;

        m.u.ready.call_rows = (uint32_t)rows;
        m.u.ready.call_rows_full = (uint32_t)(k->rows_full > rows ? k->rows_full : rows);
        m.u.ready.has_call_rows = true;
    }
    rank_send(k, &m);
    log_debug("link_join: READY sent to %s", k->o.conf.rank_endpoint);
}

/* The scheduler is gone (or told us to go): everything we hold belonged to
 * it, so drop it all and register again, or stop if the rank is leaving. */
static void
link_lost(struct rank *k, const char *why)
{
    uint32_t n = rank_active(k);
    bool stop = k->leave_ms != 0;

    if (stop)
        log_warnx("link_lost: %s; dropping %u requests, stopping", why, (unsigned)n);
    else if (k->relink_delay_ms > 0)
        log_warnx("link_lost: %s; dropping %u requests, registering again in %lld ms", why,
                  (unsigned)n, (long long)k->relink_delay_ms);
    else
        log_warnx("link_lost: %s; dropping %u requests, registering again", why, (unsigned)n);
    group_join_abandon(k);  /* a join in flight: wait for it, drop what it made */
    group_close(k, true);   /* the group re-forms when we are back */
    if (k->o.role == DSV4_ROLE_PREFILL)
        prefill_reset(k);
    else
        decode_reset(k);
    if (stop) {
        /* stopping: no new registration (a READY now would register a
         * process about to exit); rank_loop stops at once */
        dsv4_zsock_close(k->sock);
        k->sock = NULL;
        k->link = RANK_LINK_NONE;
        k->stopping = true;
        return;
    }
    sdnotify_status("scheduler lost (%s); registering again", why);
    k->drain = false;
    if (k->relink_delay_ms > 0) {
        /* READY later (link_timers): no socket meanwhile */
        dsv4_zsock_close(k->sock);
        k->sock = NULL;
        k->link = RANK_LINK_JOINING;
        k->ready_ms = dsv4_now_ms() + k->relink_delay_ms - RANK_READY_RETRY_MS;
        k->relink_delay_ms = 0;
        return;
    }
    link_join(k);
}

int64_t
rank_backoff_ms(int n)
{
    int64_t ms;

    if (n < 2)
        return 0;
    ms = (int64_t)RANK_JOIN_BACKOFF_MS << (n - 2 < 5 ? n - 2 : 5);
    return ms < RANK_JOIN_BACKOFF_MAX_MS ? ms : RANK_JOIN_BACKOFF_MAX_MS;
}

/* The scheduler answered READY with DISCONNECT (a group_size that differs
 * from its group's, ...): say why, and register again, after a growing
 * pause when the refusals go on, or a misconfigured rank would send
 * thousands of READYs a second (and log each). */
static void
link_refused(struct rank *k, const char *reason)
{
    char why[DSV4_PROTO_MAX_MESSAGE + 64];  /* the whole reason, with the count */

    k->relink_delay_ms = rank_backoff_ms(++k->refusals);
    snprintf(why, sizeof(why), "READY refused (%d in a row): %s", k->refusals,
             reason != NULL ? reason : "no reason given");
    link_lost(k, why);
}

void
rank_relink(struct rank *k, const char *why)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DISCONNECT);
    m.u.disconnect.reason = why;
    if (k->link == RANK_LINK_UP)
        rank_send(k, &m);
    link_lost(k, why);
}

static void
link_welcome(struct rank *k, const struct dsv4_rank_welcome *w)
{
    int64_t now = dsv4_now_ms();

    if (k->link != RANK_LINK_UP)
        log_notice("link_welcome: registered with %s heartbeat_ms=%u liveness=%u",
                   k->o.conf.rank_endpoint, (unsigned)w->heartbeat_ms, (unsigned)w->liveness);
    k->link = RANK_LINK_UP;
    k->refusals = 0;
    dsv4_liveness_init(&k->live, w->heartbeat_ms, w->liveness, now);
    if (k->o.role == DSV4_ROLE_PREFILL)
        sdnotify_status("serving as %s (%d slots, %d rows a call%s)", k->name, k->o.slots,
                        k->o.rows, k->o.burst ? ", burst prefill" : "");
    else
        sdnotify_status("serving as %s (%d slots)", k->name, k->o.slots);
    if (!k->notified_ready) {
        sdnotify_ready();
        k->notified_ready = true;
    }
    if (k->o.group_size > 1)
        rank_heartbeat(k);   /* says it has no communicator yet: shown joining */
}

void
rank_heartbeat(struct rank *k)
{
    struct dsv4_msg m;

    if (k->link != RANK_LINK_UP)
        return;
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
    m.u.heartbeat.active = rank_active(k);
    if (k->mtp) {
        /* cumulative MTP counters for dsv4ctl (docs/protocol.md §6.1) */
        m.u.heartbeat.mtp_drafts = k->spec_drafts;
        m.u.heartbeat.mtp_accepted = k->spec_accepted;
        m.u.heartbeat.has_mtp = true;
    }
    if (k->o.group_size > 1) {
        /* the epoch joined, 0 while joining or broken (dsv4ctl: joining) */
        m.u.heartbeat.comm_epoch = k->comm != NULL ? k->comm_epoch : 0;
        m.u.heartbeat.has_comm_epoch = true;
    }
    if (k->o.role == DSV4_ROLE_DECODE) {
        m.u.heartbeat.graphs_refused = (uint32_t)k->graphs_refused;
        m.u.heartbeat.has_graphs_refused = true;
    }
    /* (tried: a failed send is not retried at every turn of the loop) */
    k->hb_ms = dsv4_now_ms();
    rank_send(k, &m);
}

/* Heartbeats, liveness, READY retries; returns ms until the next event. */
static int64_t
link_timers(struct rank *k, int64_t now)
{
    if (k->link != RANK_LINK_UP) {
        if (now - k->ready_ms >= RANK_READY_RETRY_MS)
            link_join(k);
        return k->ready_ms + RANK_READY_RETRY_MS - now;
    }
    if (dsv4_liveness_dead(&k->live, now)) {
        link_lost(k, "no message within liveness");
        return RANK_READY_RETRY_MS;
    }
    if (k->send_lost) {
        link_lost(k, "the scheduler does not take messages (send queue full)");
        return RANK_READY_RETRY_MS;
    }
    /* at least once an interval, busy or not, so that the figures it
     * carries (active, MTP counters) stay current; a HEARTBEAT sent is also
     * the last message sent, so this covers heartbeat_ms of silence too */
    if (now - k->hb_ms >= (int64_t)k->live.interval_ms)
        rank_heartbeat(k);
    {
        int64_t next = dsv4_liveness_next_ms(&k->live, now);
        int64_t hb = k->hb_ms + (int64_t)k->live.interval_ms - now;

        return hb < next ? (hb < 0 ? 0 : hb) : next;
    }
}

/* --- Dispatch ------------------------------------------------------------------- */

static bool
rank_role_is(struct rank *k, enum dsv4_role r, uint64_t req, int cmd)
{
    if (k->o.role == r)
        return true;
    rank_send_error(k, req, DSV4_STATUS_BAD_MESSAGE, "%s sent to a %s rank",
                    dsv4_proto_cmd_name(DSV4_SUB_RANK, cmd), dsv4_role_name(k->o.role));
    return false;
}

static void
rank_dispatch_msg(struct rank *k, const struct dsv4_msg *m)
{
    if (m->sub != DSV4_SUB_RANK) {
        log_warnx("rank_dispatch: message of another sub-protocol dropped");
        return;
    }
    if (k->link != RANK_LINK_UP) {
        if (m->cmd == DSV4_RANK_WELCOME)
            link_welcome(k, &m->u.welcome);
        else if (m->cmd == DSV4_RANK_DISCONNECT)
            link_refused(k, m->u.disconnect.reason);
        else if (m->cmd == DSV4_RANK_ERROR)
            /* READY malformed (the scheduler's protocol bounds): READY again
             * every RANK_READY_RETRY_MS, each answer logged */
            log_warnx("link_join: READY answered with ERROR %u: %s",
                      (unsigned)m->u.error.code,
                      m->u.error.message != NULL ? m->u.error.message : "");
        else
            log_debug("rank_dispatch: %s before WELCOME ignored",
                      dsv4_proto_cmd_name(m->sub, m->cmd));
        return;
    }
    dsv4_liveness_rx(&k->live, dsv4_now_ms());
    switch (m->cmd) {
    case DSV4_RANK_WELCOME:
        link_welcome(k, &m->u.welcome);
        break;
    case DSV4_RANK_HEARTBEAT:
        break;
    case DSV4_RANK_DISCONNECT:
        link_lost(k, m->u.disconnect.reason != NULL ? m->u.disconnect.reason : "DISCONNECT");
        break;
    case DSV4_RANK_PREFILL:
        if (rank_role_is(k, DSV4_ROLE_PREFILL, m->u.prefill.req, m->cmd))
            prefill_start(k, &m->u.prefill);
        break;
    case DSV4_RANK_DECODE:
        if (rank_role_is(k, DSV4_ROLE_DECODE, m->u.decode.req, m->cmd))
            decode_start(k, &m->u.decode);
        break;
    case DSV4_RANK_KV_RELEASE:
        if (k->o.role == DSV4_ROLE_PREFILL && !kv_released(k, m->u.ref.req))
            log_debug("rank_dispatch: KV_RELEASE of unknown req=%" PRIu64, m->u.ref.req);
        break;
    case DSV4_RANK_ABORT:
        if (k->o.role == DSV4_ROLE_PREFILL ? prefill_abort(k, m->u.ref.req) :
                                             decode_abort(k, m->u.ref.req))
            log_info("rank_abort: req=%" PRIu64 " freed", m->u.ref.req);
        rank_send_ref(k, DSV4_RANK_ABORT_DONE, m->u.ref.req);
        break;
    case DSV4_RANK_DRAIN:
        k->drain = true;
        break;
    case DSV4_RANK_DRAIN_DONE:
        /* leaving: nothing is booked on the group any more (rank_loop) */
        k->leave_done = true;
        break;
    case DSV4_RANK_COMM:
        group_comm(k, &m->u.comm);
        break;
    case DSV4_RANK_ERROR:
        log_warnx("rank_dispatch: scheduler error req=%" PRIu64 " code=%u: %s",
                  m->u.error.req, (unsigned)m->u.error.code,
                  m->u.error.message != NULL ? m->u.error.message : "");
        break;
    default:
        log_warnx("rank_dispatch: unexpected %s dropped", dsv4_proto_cmd_name(m->sub, m->cmd));
        break;
    }
}

/* Read every waiting message. */
static void
rank_dispatch_sched(struct rank *k)
{
    struct dsv4_perr pe;
    struct dsv4_msg m;
    enum dsv4_err e;

    dsv4_msg_init(&m, DSV4_SUB_NONE, 0);
    while (k->sock != NULL && !k->stopping) {
        e = dsv4_zsock_recv(k->sock, NULL, &m, &pe, ZMQ_DONTWAIT);
        if (e == DSV4_ERR_BUSY)
            break;
        if (e == DSV4_ERR_PROTO || e == DSV4_ERR_INVAL) {
            log_warnx("rank_dispatch: malformed %s from the scheduler (code %u): %s",
                      dsv4_proto_cmd_name(pe.sub, pe.cmd), (unsigned)pe.code, pe.message);
            /* work whose request can be named is answered, or the
             * scheduler would hold that request (a scheduler of another
             * version whose values this rank refuses) */
            if (pe.sub == DSV4_SUB_RANK && pe.req != 0 &&
                (pe.cmd == DSV4_RANK_PREFILL || pe.cmd == DSV4_RANK_DECODE))
                rank_send_error(k, pe.req, pe.code, "malformed %s: %s",
                                dsv4_proto_cmd_name(pe.sub, pe.cmd), pe.message);
            continue;
        }
        if (e != DSV4_OK) {
            if (errno != EINTR)
                log_warnx("rank_dispatch: receive: %s", dsv4_errmsg());
            break;
        }
        if (group_joining(k) && !(m.sub == DSV4_SUB_RANK && m.cmd == DSV4_RANK_COMM &&
                                  m.u.comm.comm_id == NULL) &&
            !(m.sub == DSV4_SUB_RANK && m.cmd == DSV4_RANK_DRAIN_DONE)) {
            /* handled once the join ended, in order; the link stays alive
             * meanwhile.  A request for an id (rank 0) is answered now: the
             * scheduler re-forming the group must not wait for this join,
             * and the id of a newer epoch makes it give up; so is a
             * stopping rank's DRAIN_DONE (rank_loop then stops, and the
             * join is given up) */
            if (k->link == RANK_LINK_UP)
                dsv4_liveness_rx(&k->live, dsv4_now_ms());
            /* a newer epoch's id, or the scheduler dropping this rank (a
             * restarted scheduler answers an unknown rank's heartbeats so):
             * the join gives up now, not after its bound (up to 60 s) */
            if (m.sub == DSV4_SUB_RANK &&
                ((m.cmd == DSV4_RANK_COMM && m.u.comm.comm_epoch != group_joining_epoch(k)) ||
                 m.cmd == DSV4_RANK_DISCONNECT))
                group_join_cancel(k);
            group_hold(k, &m);
            continue;
        }
        rank_dispatch_msg(k, &m);
        dsv4_msg_clear(&m);
    }
}

/* A first SIGTERM (or SIGINT) with the link up and stop_drain_s > 0: the
 * scheduler is sent DRAIN (place nothing new here) and the rank stops once
 * idle with nothing more booked on its group (the scheduler's DRAIN_DONE:
 * a prompt placed here may still be in prefill, so even a rank holding
 * nothing asks) or stop_drain_s later (rank_loop).  Else, and at a second
 * signal, it stops now. */
static void
rank_signal(struct rank *k)
{
    struct signalfd_siginfo si;

    while (read(k->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        struct dsv4_msg m;

        if (si.ssi_signo == SIGHUP)
            log_notice("rank_signal: SIGHUP ignored: a rank reads its configuration at start "
                       "(restart it to apply a change)");
        if (si.ssi_signo != SIGTERM && si.ssi_signo != SIGINT)
            continue;
        if (k->leave_ms == 0 && k->link == RANK_LINK_UP && k->o.conf.stop_drain_s > 0) {
            uint32_t n = rank_active(k);

            dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DRAIN);
            if (rank_send(k, &m)) {
                k->leave_ms = dsv4_now_ms() + (int64_t)k->o.conf.stop_drain_s * 1000;
                log_notice("rank_signal: %s: finishing its requests (%u here) and those "
                           "booked on its group (at most %d s) before stopping; a second "
                           "signal stops at once",
                           strsignal((int)si.ssi_signo), n, k->o.conf.stop_drain_s);
                sdnotify_stopping();
                sdnotify_status("stopping: finishing its requests (%u here)", n);
                continue;
            }
        }
        log_notice("rank_signal: %s, stopping", strsignal((int)si.ssi_signo));
        k->stopping = true;
    }
}

void
rank_exit_if_stopped(struct rank *k, const char *phase)
{
    rank_signal(k);
    if (!k->stopping)
        return;
    sdnotify_stopping();
    log_notice("main: %s stopped while %s", k->name, phase);
    exit(0);
}

/*
 * The loop.  Each iteration:
 *  - timers: READY retry / heartbeat / scheduler liveness, abandoned exports,
 *    watchdog, DRAIN_DONE once idle;
 *  - decode: finish the decode-state imports that completed, fail those past
 *    their bound (the nearest bound is a timer);
 *  - a communicator join running in its thread: finish it when done (then
 *    the scheduler messages held meanwhile are dispatched);
 *  - zmq_poll on the scheduler socket, the signalfd and the transports'
 *    event fds, for 0 ms when model work is pending, else until the nearest
 *    timer (at most RANK_JOIN_POLL_MS while a join runs);
 *  - signals, then every waiting scheduler message;
 *  - at most one forward call: a prefill chunk or one decode step.
 */
static void
rank_loop(struct rank *k)
{
    zmq_pollitem_t items[RANK_POLL_N];

    while (!k->stopping) {
        int64_t now = dsv4_now_ms(), t, timeout;
        bool work, imports;
        int n = RANK_POLL_KVX;

        group_join_poll(k, rank_dispatch_msg);
        timeout = link_timers(k, now);
        /* neither while a join uses the backend (nothing is exported then;
         * imports wait) */
        t = group_joining(k) ? -1 : kv_timers(k, now);
        if (t >= 0 && t < timeout)
            timeout = t;
        /* decode_imports runs, and clears the transports' event fds, only
         * here: they are polled only then (a signal while the link is down,
         * a UCX peer's error with no import, woke every poll at once) */
        imports = k->o.role == DSV4_ROLE_DECODE && k->link == RANK_LINK_UP && !group_joining(k);
        if (imports) {
            t = decode_imports(k, now);
            if (t >= 0 && t < timeout)
                timeout = t;
        }
        if (k->wd_interval_ms > 0) {
            if (now - k->wd_last_ms >= k->wd_interval_ms) {
                sdnotify_watchdog();
                k->wd_last_ms = now;
            }
            t = k->wd_last_ms + k->wd_interval_ms - now;
            if (t < timeout)
                timeout = t;
        }
        if (k->leave_ms != 0) {
            /* leaving: done once idle with nothing more booked on the
             * group (the scheduler's DRAIN_DONE: a request placed here may
             * still be in prefill), at its bound, or with the link gone */
            bool done = k->leave_done && rank_active(k) == 0;

            if (!k->leave_now && (done || now >= k->leave_ms || k->link != RANK_LINK_UP)) {
                log_notice("rank_loop: %s, stopping", done ? "done" :
                           now >= k->leave_ms ? "stop_drain_s passed" :
                           "the scheduler's link is gone");
                /* in a group: one more tick tells the peers, who would
                 * otherwise wait for this rank in their next collective */
                if (k->comm == NULL || k->link != RANK_LINK_UP)
                    break;
                k->leave_now = true;
            }
            if (k->leave_now && k->comm == NULL)
                break;   /* the group broke meanwhile: no tick to tell */
            if (k->leave_now)
                timeout = 0;
            else if (k->leave_ms - now < timeout)
                timeout = k->leave_ms - now;
        }
        if (k->drain && k->link == RANK_LINK_UP && rank_active(k) == 0) {
            struct dsv4_msg m;
            dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DRAIN_DONE);
            if (rank_send(k, &m))
                k->drain = false;
        }
        /* work it can run: a group member without its communicator waits
         * (below) and must not spin on the work it holds meanwhile */
        work = k->link == RANK_LINK_UP && (k->o.group_size <= 1 || k->comm != NULL) &&
               (k->o.role == DSV4_ROLE_PREFILL ? prefill_pending(k) : decode_pending(k));
        if (work || timeout < 0)
            timeout = 0;
        /* a group ticks every iteration: the peers' ticks wait for ours */
        if (k->comm != NULL && timeout > RANK_GROUP_IDLE_MS)
            timeout = RANK_GROUP_IDLE_MS;
        if (group_joining(k) && timeout > RANK_JOIN_POLL_MS)
            timeout = RANK_JOIN_POLL_MS;

        memset(items, 0, sizeof(items));
        items[RANK_POLL_SOCK].socket = k->sock;
        items[RANK_POLL_SOCK].fd = -1;
        items[RANK_POLL_SOCK].events = k->sock != NULL ? ZMQ_POLLIN : 0;
        items[RANK_POLL_SIGNAL].fd = k->sigfd;
        items[RANK_POLL_SIGNAL].events = ZMQ_POLLIN;
        for (int i = 0; i < DSV4_TRANSPORT__COUNT && imports; i++) {
            int fd = k->kvx[i] != NULL ? dsv4_kvx_event_fd(k->kvx[i]) : -1;
            if (fd < 0)
                continue;
            items[n].fd = fd;
            items[n++].events = ZMQ_POLLIN;
        }
        if (k->sock == NULL) {
            /* no socket: a plain fd in slot 0 keeps the slot layout */
            items[RANK_POLL_SOCK].fd = k->sigfd;
        }
        if (zmq_poll(items, n, (long)timeout) < 0) {
            if (errno == EINTR)
                continue;
            fatal("rank_loop: zmq_poll");
        }
        if (items[RANK_POLL_SIGNAL].revents & ZMQ_POLLIN)
            rank_signal(k);
        if (k->stopping)
            break;
        rank_dispatch_sched(k);
        if (k->comm != NULL) {
            /* one tick per iteration, then the work every rank agrees on */
            uint64_t mine[RANK_MAX_SLOTS];
            int n_mine = k->link != RANK_LINK_UP ? 0 : k->o.role == DSV4_ROLE_PREFILL ?
                                                       prefill_runnable(k, mine) :
                                                       decode_runnable(k, mine);

            if (group_tick(k, mine, n_mine) && k->n_agreed > 0 && k->link == RANK_LINK_UP) {
                if (k->o.role == DSV4_ROLE_PREFILL)
                    prefill_work(k);
                else
                    decode_work(k);
            }
            if (k->leave_now)
                break;   /* the tick told the peers */
            continue;
        }
        if (k->link != RANK_LINK_UP || k->o.group_size > 1)
            continue;   /* a group member without its communicator waits */
        if (k->o.role == DSV4_ROLE_PREFILL)
            prefill_work(k);
        else
            decode_work(k);
    }
}

/* --- Start-up and shutdown -------------------------------------------------------- */

enum {
    OPT_ROLE = 256, OPT_RANK, OPT_GROUP, OPT_CHECKPOINT, OPT_BACKEND, OPT_THREADS, OPT_SCHED,
    OPT_SLOTS, OPT_MAX_SEQ, OPT_ROWS, OPT_KV_TIMEOUT, OPT_SYNTH, OPT_PRESET, OPT_MCONFIG,
    OPT_MSET, OPT_NO_GRAPHS,
};

static long
opt_num(const char *s, long lo, long hi, const char *what)
{
    char *end;
    long v;

    errno = 0;
    v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "dsv4-%s: %s: %s is not in %ld..%ld\n", dsv4_role_name(RANK_ROLE),
                what, s, lo, hi);
        exit(2);
    }
    return v;
}

static void
conf_set_or_die(struct dsv4_conf *c, const char *key, const char *value)
{
    if (dsv4_conf_set(c, key, value) != DSV4_OK) {
        fprintf(stderr, "dsv4-%s: %s\n", dsv4_role_name(RANK_ROLE), dsv4_errmsg());
        exit(2);
    }
}

/* The synthetic model's configuration: --preset NAME or --config FILE, with
 * the --set overrides.  DSV4_OK, or the error with its message. */
static enum dsv4_err
rank_synthetic_config(const struct rank_opts *o, struct dsv4_config *cfg)
{
    enum dsv4_err e = o->model_preset != NULL ? dsv4_config_preset(cfg, o->model_preset) :
                                                dsv4_config_load(cfg, o->model_config);

    if (e == DSV4_OK && o->n_model_sets > 0)
        e = dsv4_config_override(cfg, o->n_model_sets, o->model_sets);
    return e;
}

/* Whether the scheduler's endpoint cannot be used as configured (its form;
 * for tcp://, the CURVE key file), with the message set: for -n and the
 * start alike (a start retried the connect every second for ever). */
static bool
rank_endpoint_fault(const struct rank_opts *o)
{
    struct dsv4_zsock_cfg zc;

    dsv4_zsock_cfg_init(&zc);
    zc.endpoint = o->conf.rank_endpoint;
    zc.type = ZMQ_DEALER;
    zc.key_dir = o->conf.key_dir;
    return dsv4_zsock_check(&zc) != DSV4_OK;
}

/* The backend faults found without a device, for -n and the start alike:
 * backend cuda on a build without CUDA, synthetic weights off the cuda
 * backend, a group `comm` the backend cannot use, kv_cudaipc = yes off the
 * cuda backend, ucx = yes on a build without UCX.  All are the
 * configuration's (exit DSV4_EXIT_CONFIG, which the units'
 * RestartPreventExitStatus= does not restart; they exited 1 at the start,
 * restarted to the start limit, and passed -n).  Returns whether there is
 * one, with the message set, as rank_endpoint_fault and rank_ctx_fault. */
static bool
rank_backend_fault(const struct rank_opts *o)
{
#ifdef DSV4_HAVE_CUDA
    const bool built_cuda = true;
#else
    const bool built_cuda = false;
#endif
#ifdef DSV4_HAVE_UCX
    const bool built_ucx = true;
#else
    const bool built_ucx = false;
#endif
    bool cuda = strcmp(o->conf.backend, "cuda") == 0;
    char comm[256];

    if (cuda && !built_cuda)
        dsv4_err_set(DSV4_ERR_CONFIG, "backend cuda: this build has no CUDA");
    else if (o->synthetic && !cuda)
        dsv4_err_set(DSV4_ERR_CONFIG, "--synthetic-weights needs the cuda backend");
    else if (o->group_size > 1 && dsv4_comm_pick(o->conf.comm, o->conf.backend, 1,
                                                 (int)o->group_size) == DSV4_COMM_NONE) {
        snprintf(comm, sizeof(comm), "%s", dsv4_errmsg());
        dsv4_err_set(DSV4_ERR_CONFIG, "comm: %s", comm);
    } else if (strcmp(o->conf.kv_cudaipc, "yes") == 0 && !cuda)
        dsv4_err_set(DSV4_ERR_CONFIG, "kv_cudaipc = yes needs the cuda backend");
    else if (strcmp(o->conf.ucx, "yes") == 0 && !built_ucx)
        dsv4_err_set(DSV4_ERR_CONFIG, "ucx = yes: this build has no UCX");
    else
        return false;
    return true;
}

/* The group's split: the group_split key (dsv4_group_split_resolve: auto
 * is tp with the CUDA fast kernels, `fast`, else ep); DSV4_GROUP_SPLIT=ep /
 * tp / auto wins.  The start (rank_group_split) and -n both ask it. */
static enum dsv4_err
rank_split_resolve(const struct rank_opts *o, int fast, enum dsv4_group_split *split)
{
    const char *v = getenv("DSV4_GROUP_SPLIT");

    *split = DSV4_GROUP_SPLIT_EP;
    if (v == NULL || *v == '\0')
        v = o->conf.group_split;
    return dsv4_group_split_resolve(v, fast, split);
}

/* Whether `max_seq` is past the model's context (config.json's
 * max_position_embeddings: the positions its RoPE and compressors were made
 * for), with the message set: a rank serves no longer context than its
 * model, at -n and at the start alike. */
static bool
rank_ctx_fault(const struct rank_opts *o, const struct dsv4_config *cfg)
{
    if ((int64_t)o->conf.max_seq <= cfg->max_position_embeddings)
        return false;
    dsv4_err_set(DSV4_ERR_CONFIG, "max_seq %d is past the model's context "
                 "(max_position_embeddings %lld in its config.json)", (int)o->conf.max_seq,
                 (long long)cfg->max_position_embeddings);
    return true;
}

/* -n: the group's split as the start resolves it (rank_group_split) without
 * a backend: with the cuda backend the fast kernels are on when
 * DSV4_CUDA_KERNELS is fast or, unset, cuda_kernels is (rank_init_model);
 * then whether cfg divides over the group as the start's shard of the
 * weights needs (dsv4_shard_check).  Prints the split of a group of more
 * than one rank; exits DSV4_EXIT_CONFIG with the start's message on a
 * fault. */
static void
rank_check_group(const struct rank_opts *o, const struct dsv4_config *cfg)
{
    const char *role = dsv4_role_name(RANK_ROLE);
    const char *kern = getenv("DSV4_CUDA_KERNELS");
    enum dsv4_group_split split;
    int fast;

    if (rank_ctx_fault(o, cfg)) {
        fprintf(stderr, "dsv4-%s: %s\n", role, dsv4_errmsg());
        exit(DSV4_EXIT_CONFIG);
    }

    fast = strcmp(o->conf.backend, "cuda") == 0 &&
           strcmp(kern != NULL ? kern : o->conf.cuda_kernels, "fast") == 0;
    if (rank_split_resolve(o, fast, &split) != DSV4_OK) {
        fprintf(stderr, "dsv4-%s: %s\n", role, dsv4_errmsg());
        exit(DSV4_EXIT_CONFIG);
    }
    if (dsv4_shard_check(cfg, (int)o->group_size, split) != DSV4_OK) {
        fprintf(stderr, "dsv4-%s: rank %d of a group of %d: %s\n", role, (int)o->group_rank,
                (int)o->group_size, dsv4_errmsg());
        exit(DSV4_EXIT_CONFIG);
    }
    if (o->group_size > 1)
        printf("group of %u, split %s\n", (unsigned)o->group_size,
               dsv4_group_split_name(split));
}

/* -n: what the start would refuse, found without a device or a connection:
 * the scheduler endpoint's form and CURVE key (dsv4_zsock_check), and the
 * weights' source: the checkpoint (config.json and every tensor, mapped and
 * checked as at start, then unmapped) or the synthetic model's
 * configuration, and the group's split of that model (rank_check_group).
 * No device is opened: `gpu` past the host's devices is found at start
 * only.  One line each on stdout; exits DSV4_EXIT_CONFIG on the first
 * fault. */
static void
rank_check(const struct rank_opts *o)
{
    const char *role = dsv4_role_name(RANK_ROLE);
    struct dsv4_weights w;
    struct dsv4_config cfg;

    if (rank_endpoint_fault(o)) {
        fprintf(stderr, "dsv4-%s: rank_endpoint: %s\n", role, dsv4_errmsg());
        exit(DSV4_EXIT_CONFIG);
    }
    printf("scheduler %s\n", o->conf.rank_endpoint);
    if (rank_backend_fault(o)) {
        fprintf(stderr, "dsv4-%s: %s\n", role, dsv4_errmsg());
        exit(DSV4_EXIT_CONFIG);
    }
    if (o->synthetic) {
        if (rank_synthetic_config(o, &cfg) != DSV4_OK) {
            fprintf(stderr, "dsv4-%s: model config: %s\n", role, dsv4_errmsg());
            exit(DSV4_EXIT_CONFIG);
        }
        printf("synthetic weights, seed %" PRIu64 ": %d layers\n", o->synth_seed,
               (int)cfg.num_hidden_layers);
        rank_check_group(o, &cfg);
        return;
    }
    if (dsv4_weights_load(&w, o->conf.checkpoint) != DSV4_OK) {
        fprintf(stderr, "dsv4-%s: checkpoint %s: %s\n", role, o->conf.checkpoint,
                dsv4_errmsg());
        exit(DSV4_EXIT_CONFIG);
    }
    printf("checkpoint %s: %d layers (MTP included)\n", o->conf.checkpoint, w.n_layers);
    cfg = w.cfg;
    dsv4_weights_free(&w);
    rank_check_group(o, &cfg);
}

/* Options over the configuration file over the defaults.  Returns true for
 * -n (check only). */
static bool
rank_options(struct rank_opts *o, int argc, char **argv)
{
    static const struct option lopts[] = {
        { "role", required_argument, NULL, OPT_ROLE },
        { "rank", required_argument, NULL, OPT_RANK },
        { "group", required_argument, NULL, OPT_GROUP },
        { "checkpoint", required_argument, NULL, OPT_CHECKPOINT },
        { "backend", required_argument, NULL, OPT_BACKEND },
        { "threads", required_argument, NULL, OPT_THREADS },
        { "sched", required_argument, NULL, OPT_SCHED },
        { "slots", required_argument, NULL, OPT_SLOTS },
        { "max-seq", required_argument, NULL, OPT_MAX_SEQ },
        { "rows", required_argument, NULL, OPT_ROWS },
        { "kv-timeout-ms", required_argument, NULL, OPT_KV_TIMEOUT },
        { "synthetic-weights", required_argument, NULL, OPT_SYNTH },
        { "preset", required_argument, NULL, OPT_PRESET },
        { "config", required_argument, NULL, OPT_MCONFIG },
        { "set", required_argument, NULL, OPT_MSET },
        { "no-graphs", no_argument, NULL, OPT_NO_GRAPHS },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };
    const char *over[64], *path = NULL, *set[OPT_KV_TIMEOUT + 1] = { 0 };
    enum dsv4_conf_role crole = RANK_ROLE == DSV4_ROLE_PREFILL ? DSV4_CONF_ROLE_PREFILL :
                                                                 DSV4_CONF_ROLE_DECODE;
    int n_over = 0, c, slots = 0;
    bool check = false, group_set = false, rows_set = false;

    memset(o, 0, sizeof(*o));
    o->role = RANK_ROLE;
    o->rows = RANK_PREFILL_ROWS;
    o->kv_timeout_ms = RANK_KV_TIMEOUT_MS;
    while ((c = getopt_long(argc, argv, "f:o:nvh", lopts, NULL)) != -1) {
        switch (c) {
        case 'f': path = optarg; break;
        case 'o':
            if (n_over == (int)(sizeof(over) / sizeof(over[0])))
                usage(2);
            over[n_over++] = optarg;
            break;
        case 'n': check = true; break;
        case 'v': o->verbose++; break;
        case OPT_ROLE:
            if (strcmp(optarg, dsv4_role_name(RANK_ROLE)) != 0) {
                fprintf(stderr, "dsv4-%s: this executable only runs the %s role\n",
                        dsv4_role_name(RANK_ROLE), dsv4_role_name(RANK_ROLE));
                exit(2);
            }
            break;
        case OPT_RANK: o->index = (uint32_t)opt_num(optarg, 0, 65535, "--rank"); break;
        case OPT_GROUP:
            o->group = (uint32_t)opt_num(optarg, 0, 65535, "--group");
            group_set = true;
            break;
        case OPT_SLOTS: slots = (int)opt_num(optarg, 1, RANK_MAX_SLOTS, "--slots"); break;
        case OPT_ROWS:
            o->rows = (int)opt_num(optarg, 1, 1 << 20, "--rows");
            rows_set = true;
            break;
        case OPT_KV_TIMEOUT:
            o->kv_timeout_ms = opt_num(optarg, 1, DSV4_PROTO_MAX_TIMEOUT_MS, "--kv-timeout-ms");
            break;
        case OPT_SYNTH:
            o->synthetic = true;
            o->synth_seed = (uint64_t)opt_num(optarg, 0, INT64_MAX, "--synthetic-weights");
            break;
        case OPT_PRESET: o->model_preset = optarg; break;
        case OPT_MCONFIG: o->model_config = optarg; break;
        case OPT_MSET:
            if (o->n_model_sets == (int)(sizeof(o->model_sets) / sizeof(o->model_sets[0])))
                usage(2);
            o->model_sets[o->n_model_sets++] = optarg;
            break;
        case OPT_NO_GRAPHS: o->no_graphs = true; break;
        case OPT_CHECKPOINT: case OPT_BACKEND: case OPT_THREADS: case OPT_SCHED:
        case OPT_MAX_SEQ:
            set[c] = optarg;
            break;
        case 'h':
            usage(0);
        case DSV4_CLI_OPT_VERSION:
            dsv4_cli_version(RANK_ROLE == DSV4_ROLE_PREFILL ? "dsv4-prefill" : "dsv4-decode");
        default:
            usage(2);
        }
    }
    if (optind != argc)
        usage(2);
    if (o->synthetic && (o->model_preset == NULL) == (o->model_config == NULL)) {
        fprintf(stderr, "dsv4-%s: --synthetic-weights needs one of --preset NAME and "
                "--config FILE\n", dsv4_role_name(RANK_ROLE));
        exit(2);
    }
    if (!o->synthetic && (o->model_preset != NULL || o->model_config != NULL ||
                          o->n_model_sets > 0)) {
        fprintf(stderr, "dsv4-%s: --preset, --config and --set go with --synthetic-weights\n",
                dsv4_role_name(RANK_ROLE));
        exit(2);
    }

    dsv4_conf_defaults(&o->conf);
    if (path == NULL && access(DSV4_CONF_DEFAULT_PATH, F_OK) == 0)
        path = DSV4_CONF_DEFAULT_PATH;
    if (path != NULL && dsv4_conf_load_rank(&o->conf, path, crole, (int)o->index) != DSV4_OK) {
        fprintf(stderr, "dsv4-%s: %s\n", dsv4_role_name(RANK_ROLE), dsv4_errmsg());
        exit(DSV4_EXIT_CONFIG);
    }
    o->conf_path = path;
    for (int i = 0; i < n_over; i++) {
        if (dsv4_conf_set_kv(&o->conf, over[i]) != DSV4_OK) {
            fprintf(stderr, "dsv4-%s: -o %s: %s\n", dsv4_role_name(RANK_ROLE), over[i],
                    dsv4_errmsg());
            exit(DSV4_EXIT_CONFIG);
        }
    }
    o->burst = strcmp(o->conf.burst, "yes") == 0;
    if (RANK_ROLE == DSV4_ROLE_DECODE && o->burst) {
        fprintf(stderr, "dsv4-decode: burst = yes has no effect on a decode rank (it marks "
                "burst prefill ranks)\n");
        o->burst = false;
    }
    if (set[OPT_CHECKPOINT] != NULL)
        conf_set_or_die(&o->conf, "checkpoint", set[OPT_CHECKPOINT]);
    if (set[OPT_BACKEND] != NULL)
        conf_set_or_die(&o->conf, "backend", set[OPT_BACKEND]);
    if (set[OPT_THREADS] != NULL)
        conf_set_or_die(&o->conf, "threads", set[OPT_THREADS]);
    if (set[OPT_SCHED] != NULL)
        conf_set_or_die(&o->conf, "rank_endpoint", set[OPT_SCHED]);
    if (set[OPT_MAX_SEQ] != NULL)
        conf_set_or_die(&o->conf, "max_seq", set[OPT_MAX_SEQ]);
    /* rows per forward call: enough for the scheduler's prefill chunks (a
     * prefill GEMM reads every expert's weights once per call, so chunks cut
     * smaller than prefill_chunk cost the weights' bandwidth again) */
    if (!rows_set && o->conf.prefill_chunk > o->rows)
        o->rows = o->conf.prefill_chunk;
    /* rank N is rank N % group_size of group N / group_size (unless --group) */
    o->group_size = (uint32_t)o->conf.group_size;
    o->group_rank = o->index % o->group_size;
    if (!group_set)
        o->group = o->index / o->group_size;
    o->slots = slots > 0 ? slots : RANK_ROLE == DSV4_ROLE_PREFILL ? o->conf.prefill_slots :
                                                                    o->conf.slots;
    if (o->slots < 1 || o->slots > RANK_MAX_SLOTS) {
        fprintf(stderr, "dsv4-%s: %d slots; 1..%d supported\n", dsv4_role_name(RANK_ROLE),
                o->slots, RANK_MAX_SLOTS);
        exit(DSV4_EXIT_CONFIG);
    }
    /* each prefill rank exports its part of a request's decode state, and a
     * handoff carries at most DSV4_PROTO_MAX_KV_PARTS parts */
    if (RANK_ROLE == DSV4_ROLE_PREFILL && o->group_size > DSV4_PROTO_MAX_KV_PARTS) {
        fprintf(stderr, "dsv4-prefill: group_size %u; 1..%d supported for prefill groups\n",
                (unsigned)o->group_size, DSV4_PROTO_MAX_KV_PARTS);
        exit(DSV4_EXIT_CONFIG);
    }
    /* with speculative decoding a stream emits up to 1 + DSV4_SPEC_MAX_DRAFT
     * tokens a step, and one TOKENS message carries a step */
    if (RANK_ROLE == DSV4_ROLE_DECODE && strcmp(o->conf.mtp, "yes") == 0 &&
        o->slots > RANK_MAX_SLOTS / (DSV4_SPEC_MAX_DRAFT + 1)) {
        fprintf(stderr, "dsv4-decode: %d slots; 1..%d supported with mtp = yes\n", o->slots,
                RANK_MAX_SLOTS / (DSV4_SPEC_MAX_DRAFT + 1));
        exit(DSV4_EXIT_CONFIG);
    }
    if (check) {
        dsv4_conf_print(&o->conf, stdout);
        printf("# rank=%u group=%u group_rank=%u/%u slots=%d rows=%d export_expiry_ms=%" PRId64
               "\n", (unsigned)o->index, (unsigned)o->group, (unsigned)o->group_rank,
               (unsigned)o->group_size, o->slots, o->rows, o->kv_timeout_ms);
        rank_check(o);
        printf("configuration OK\n");
    }
    return check;
}

static void *
xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size);

    if (p == NULL)
        fatalx("rank_init: out of memory");
    return p;
}

#ifdef DSV4_HAVE_CUDA
/* The rank whose weights are being uploaded (the progress callback's). */
static struct rank *rank_loading;

/* Weight upload / generation progress: log and STATUS=, and more start-up
 * time for systemd (TimeoutStartSec) while bytes keep arriving; a SIGTERM
 * meanwhile ends the process (the extension would also stretch systemd's
 * stop timeout: a stop would wait for the whole upload). */
static void
rank_weights_progress(void *ctx, uint64_t done, uint64_t total)
{
    const char *what = ctx;
    double gib = 1024.0 * 1024.0 * 1024.0;

    if (rank_loading != NULL)
        rank_exit_if_stopped(rank_loading, what);

    sdnotify_status("%s: %.1f of %.1f GiB on the GPU", what, done / gib, total / gib);
    sdnotify_extend_timeout(120ull * 1000 * 1000);
    log_info("rank_init: %s: %.1f of %.1f GiB on the GPU", what, done / gib, total / gib);
}
#endif

/* The group's split (rank_split_resolve), with the fast kernels as the
 * backend has them. */
static enum dsv4_group_split
rank_group_split(struct rank *k, bool cuda)
{
    enum dsv4_group_split split;
    int fast = 0;

#ifdef DSV4_HAVE_CUDA
    fast = cuda && dsv4_cuda_get_kernels(k->be);
#else
    (void)cuda;
#endif
    if (rank_split_resolve(&k->o, fast, &split) != DSV4_OK)
        fatalx_conf("rank_init: %s", dsv4_errmsg());
    return split;
}

/* The weights the model runs on: the checkpoint (host mappings; uploaded to
 * the GPU on the CUDA backend), or synthetic weights generated on the GPU;
 * in a group, this rank's shard of them (common/weights_shard.h).  On the
 * CUDA backend the device copy may be the other rank's of this GPU, mapped
 * (rank_share.c; then nothing is uploaded or generated here). */
static const struct dsv4_weights *
rank_init_weights(struct rank *k, bool cuda)
{
    int gr = (int)k->o.group_rank, gs = (int)k->o.group_size;
    enum dsv4_group_split split = rank_group_split(k, cuda);

    k->group_split = split;
    log_info("rank_init: group split %s over the group of %d", dsv4_group_split_name(split),
             gs);
#ifdef DSV4_HAVE_CUDA
    struct dsv4_cuda_progress pr = { rank_weights_progress, NULL };

    rank_loading = k;
    struct dsv4_cuda_arena arena;
    char source[PATH_MAX + 64];
    /* the weights share is keyed by the split: a tp rank's copy holds other bytes */
    const char *keyed = split == DSV4_GROUP_SPLIT_TP && gs > 1 ? ":split-tp" : "";
#endif

    if (k->o.synthetic) {
#ifdef DSV4_HAVE_CUDA
        struct dsv4_config cfg;

        /* off the cuda backend: refused by rank_backend_fault */
        if (rank_synthetic_config(&k->o, &cfg) != DSV4_OK)
            fatalx_conf("rank_init: model config: %s", dsv4_errmsg());
        if (dsv4_synthetic_fingerprint(&cfg, k->o.synth_seed, k->model_fp) == DSV4_OK)
            log_info("rank_init: model fingerprint %s (synthetic weights)", k->model_fp);
        else
            log_warnx("rank_init: no model fingerprint (not sent in READY): %s",
                      dsv4_errmsg());
        snprintf(source, sizeof(source), "synthetic:%" PRIu64 "%s", k->o.synth_seed, keyed);
        rank_share_begin(k, &cfg, source, &arena);
        if (arena.kind == DSV4_CUDA_ARENA_IMPORT &&
            dsv4_cuda_weights_synthetic_arena(k->be, &k->wdev, &cfg, k->o.synth_seed, gr, gs,
                                              split, NULL, &arena) != DSV4_OK)
            rank_share_fallback(k, &arena);
        if (arena.kind != DSV4_CUDA_ARENA_IMPORT) {
            pr.ctx = (void *)"generating synthetic weights";
            sdnotify_status("generating synthetic weights (seed %" PRIu64 ")",
                            k->o.synth_seed);
            log_info("rank_init: synthetic weights, seed %" PRIu64 ", %s %s", k->o.synth_seed,
                     k->o.model_preset != NULL ? "preset" : "config",
                     k->o.model_preset != NULL ? k->o.model_preset : k->o.model_config);
            if (dsv4_cuda_weights_synthetic_arena(k->be, &k->wdev, &cfg, k->o.synth_seed, gr,
                                                  gs, split, &pr, &arena) != DSV4_OK)
                fatalx("rank_init: synthetic weights: %s", dsv4_errmsg());
        }
        k->wdev_loaded = true;
        rank_share_done(k, &arena);
        return &k->wdev;
#else
        fatalx("rank_init: synthetic weights on a build without CUDA");   /* refused before */
#endif
    }
    sdnotify_status("loading weights from %s", k->o.conf.checkpoint);
    log_info("rank_init: loading %s", k->o.conf.checkpoint);
    if (dsv4_weights_load(&k->w, k->o.conf.checkpoint) != DSV4_OK)
        fatalx_conf("rank_init: weights %s: %s", k->o.conf.checkpoint, dsv4_errmsg());
    k->w_loaded = true;
    if (dsv4_ckpt_fingerprint_of(k->w.ckpt, &k->w.cfg, k->model_fp) == DSV4_OK)
        log_info("rank_init: model fingerprint %s", k->model_fp);
    else
        log_warnx("rank_init: no model fingerprint (not sent in READY): %s", dsv4_errmsg());
    if (dsv4_weights_shard(&k->wshard, &k->w, gr, gs, split) != DSV4_OK)
        fatalx_conf("rank_init: rank %d of a group of %d: %s", gr, gs, dsv4_errmsg());
    k->wshard_on = true;
    if (!cuda)
        return &k->wshard;
#ifdef DSV4_HAVE_CUDA
    {
        char real[PATH_MAX];

        /* and by the bytes loaded (their fingerprint): a directory
         * overwritten with another checkpoint of the same shapes must not
         * map the copy an older process made of the first */
        snprintf(source, sizeof(source), "checkpoint:%s%s%s%s",
                 realpath(k->o.conf.checkpoint, real) != NULL ? real : k->o.conf.checkpoint,
                 keyed, k->model_fp[0] != '\0' ? ":fp-" : "", k->model_fp);
    }
    rank_share_begin(k, &k->w.cfg, source, &arena);
    if (arena.kind == DSV4_CUDA_ARENA_IMPORT &&
        dsv4_cuda_weights_upload_arena(k->be, &k->wdev, &k->wshard, NULL, &arena) != DSV4_OK)
        rank_share_fallback(k, &arena);
    if (arena.kind != DSV4_CUDA_ARENA_IMPORT) {
        pr.ctx = (void *)"uploading weights";
        sdnotify_status("uploading weights to the GPU");
        if (dsv4_cuda_weights_upload_arena(k->be, &k->wdev, &k->wshard, &pr, &arena) != DSV4_OK)
            fatalx("rank_init: weights upload: %s", dsv4_errmsg());
    }
    rank_share_done(k, &arena);
    dsv4_weights_shard_free(&k->wshard);
    k->wshard_on = false;
    k->wdev_loaded = true;
    /* the device copy is all the model needs: drop the host mappings */
    dsv4_weights_free(&k->w);
    k->w_loaded = false;
    return &k->wdev;
#else
    fatalx_conf("rank_init: the cuda backend needs a build with CUDA");
#endif
}

long
rank_test_env(const struct rank *k, const char *var)
{
    const char *v = getenv(var), *p;
    char me[48];
    int n;

    if (v == NULL)
        return 0;
    n = snprintf(me, sizeof(me), "%s:", k->name);
    for (p = v; p != NULL; p = strchr(p, ',') != NULL ? strchr(p, ',') + 1 : NULL) {
        if (strncmp(p, me, (size_t)n) == 0) {
            long x = strtol(p + n, NULL, 10);

            log_warnx("rank_init: test-only %s=%s applies to %s: %ld", var, v, k->name, x);
            return x > 0 ? x : 0;
        }
    }
    return 0;
}

/* Weights, backend, model, buffers, transfer layer. */
static void
rank_init_model(struct rank *k)
{
    struct dsv4_model_opts mo;
    enum dsv4_numerics num;
    const struct dsv4_weights *w;
    bool cuda = strcmp(k->o.conf.backend, "cuda") == 0;
    const char *env;
    size_t rows;

    if (rank_backend_fault(&k->o))
        fatalx_conf("rank_init: %s", dsv4_errmsg());
    if (rank_endpoint_fault(&k->o))
        fatalx_conf("rank_init: rank_endpoint: %s", dsv4_errmsg());
    sdnotify_status("creating the %s backend", k->o.conf.backend);
    num = strcmp(k->o.conf.numerics, "hf") == 0 ? DSV4_NUMERICS_HF : DSV4_NUMERICS_REF;
#ifdef DSV4_HAVE_CUDA
    if (cuda) {
        int n_dev = 0, dev = k->o.conf.gpu, mps = 0;
        char pct[16] = "";
        const char *prio;

        /* SM share under MPS: read by the CUDA runtime when it starts */
        if (k->o.conf.mps_sm_percent > 0) {
            snprintf(pct, sizeof(pct), "%d", k->o.conf.mps_sm_percent);
            if (setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", pct, 1) != 0)
                fatal("rank_init: setenv");
        }
        /* cuda_priority = decode: decode ranks' stream at the highest
         * priority, prefill ranks' at the lowest (a GPU running both: the
         * decode steps' blocks go first); read by the backend's stream
         * creation, unless DSV4_CUDA_STREAM_PRIORITY is set already */
        if (strcmp(k->o.conf.cuda_priority, "decode") == 0 &&
            setenv("DSV4_CUDA_STREAM_PRIORITY",
                   k->o.role == DSV4_ROLE_DECODE ? "high" : "low", 0) != 0)
            fatal("rank_init: setenv");
        /* and under an MPS server, prefill ranks are clients of the lower
         * of MPS's two priorities (1, below normal; read by the CUDA
         * runtime when it starts, ignored without MPS), unless
         * CUDA_MPS_CLIENT_PRIORITY is set already */
        if (strcmp(k->o.conf.cuda_priority, "decode") == 0 && k->o.role == DSV4_ROLE_PREFILL &&
            setenv("CUDA_MPS_CLIENT_PRIORITY", "1", 0) != 0)
            fatal("rank_init: setenv");
        if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1)
            fatalx("rank_init: backend cuda: no CUDA device");
        /* `gpu` is the first device of the rank's group (rank r of the group
         * on gpu + r: a prefill group on GPUs 0-1 and a decode group on
         * 2-3 with prefill.gpu = 0, decode.gpu = 2); -1 shares the devices
         * among the groups (rank r on device r % n_dev) */
        if (dev < 0) {
            dev = (int)(k->o.group_rank % (uint32_t)n_dev);
            /* ranks of one group on one device: each all-reduce spins
             * until every peer's kernel arrives, so the peers' kernels
             * must all be resident at once (docs/operations.md, `gpu`) */
            if (k->o.group_size > (uint32_t)n_dev)
                log_warnx("rank_init: group_size %u on %d CUDA device(s): %u ranks of this "
                          "group share device %d; their all-reduces wait for each other and "
                          "can stall until the group gives up (four prefill ranks on one GPU "
                          "did): one rank of a group per GPU, or two under MPS for tests",
                          (unsigned)k->o.group_size, n_dev,
                          (unsigned)((k->o.group_size - (uint32_t)dev + (uint32_t)n_dev - 1) /
                                     (uint32_t)n_dev), dev);
        } else if (dev + (int)k->o.group_rank >= n_dev)
            fatalx_conf("rank_init: gpu = %d: rank %u of its group needs device %d, this "
                        "host has %d", dev, (unsigned)k->o.group_rank,
                        dev + (int)k->o.group_rank, n_dev);
        else
            dev += (int)k->o.group_rank;
        if (dsv4_cuda_backend_create(&k->be, num, dev) != DSV4_OK)
            fatalx("rank_init: backend cuda (device %d): %s", dev, dsv4_errmsg());
        /* the kernels: `cuda_kernels`, unless DSV4_CUDA_KERNELS is set */
        if (getenv("DSV4_CUDA_KERNELS") == NULL &&
            dsv4_cuda_set_kernels(k->be, strcmp(k->o.conf.cuda_kernels, "fast") == 0) != DSV4_OK)
            fatalx("rank_init: cuda kernels: %s", dsv4_errmsg());
        mps = dsv4_cuda_mps_client(k->be);
        /* notice, not info: what a rank runs on belongs in the default log */
        prio = getenv("CUDA_MPS_CLIENT_PRIORITY");
        log_notice("cuda device %d, %s kernels, MPS %s%s%s", dev,
                   dsv4_cuda_get_kernels(k->be) ? "fast" : "exact",
                   !mps ? "off" : k->o.conf.mps_sm_percent > 0 ? pct : "on (all SMs)",
                   mps && k->o.conf.mps_sm_percent > 0 ? "% of the SMs" : "",
                   mps && prio != NULL && strcmp(prio, "1") == 0 ? ", client priority below normal"
                                                                 : "");
        if (k->o.conf.mps_sm_percent > 0 && !mps)
            log_warnx("mps_sm_percent = %d has no effect: no MPS server for this GPU",
                     k->o.conf.mps_sm_percent);
        /* the prefill GEMMs' library (docs/gpu.md "Prefill beside decode") */
        if (k->o.role == DSV4_ROLE_PREFILL && dsv4_cuda_get_kernels(k->be)) {
            /* DSV4_CUDA_BLAS_CLUSTER overrides the plans' cluster shape
             * when it reads as 0-999 (fast_blas.cu bl_cluster_shape) */
            const char *cl = getenv("DSV4_CUDA_BLAS_CLUSTER");
            long cn = cl != NULL && *cl != '\0' ? strtol(cl, NULL, 10) : -1;
            int forced = cn >= 0 && cn < 1000;

            if (dsv4_cuda_blas_usable(k->be))
                log_notice("prefill GEMMs: cuBLASLt on%s%s",
                           forced ? ", cluster shape DSV4_CUDA_BLAS_CLUSTER="
                           : mps ? ", clusters of one block (MPS client)" : "",
                           forced ? cl : "");
            else
                log_notice("prefill GEMMs: dsv4's kernels only (%s)", dsv4_errmsg());
        }
    } else
#endif
    if (dsv4_backend_create(&k->be, k->o.conf.backend, num, k->o.conf.threads) != DSV4_OK)
        fatalx("rank_init: backend %s: %s", k->o.conf.backend, dsv4_errmsg());
    w = rank_init_weights(k, cuda);
    k->cfg = w->cfg;
    sdnotify_status("creating the model");
    memset(&mo, 0, sizeof(mo));
    mo.tp_rank = (int)k->o.group_rank;
    mo.tp_size = (int)k->o.group_size;
    /* decode steps as CUDA graphs (one per batch size, kernels/forward.h) */
    mo.graphs = k->o.role == DSV4_ROLE_DECODE && !k->o.no_graphs;
    /* the experts' outputs combined on each rank before the group's sum
     * with the fast kernels and with the tp group split (kernels/forward.h
     * "Model groups"); DSV4_MOE_LOCAL=0 / 1 overrides */
    mo.moe_local = k->group_split == DSV4_GROUP_SPLIT_TP;
#ifdef DSV4_HAVE_CUDA
    mo.moe_local = mo.moe_local || (cuda && dsv4_cuda_get_kernels(k->be));
#endif
    if ((env = getenv("DSV4_MOE_LOCAL")) != NULL)
        mo.moe_local = atoi(env) != 0;
    k->moe_local = mo.moe_local != 0;
    mo.n_slots = k->o.slots;
    if (rank_ctx_fault(&k->o, &w->cfg))
        fatalx_conf("rank_init: %s", dsv4_errmsg());
    mo.max_seq_len = k->o.conf.max_seq;
    /* speculative decoding: verify steps feed 1 + DSV4_SPEC_MAX_DRAFT rows
     * per stream (kernels/forward.h) */
    k->mtp = k->o.role == DSV4_ROLE_DECODE && strcmp(k->o.conf.mtp, "yes") == 0;
    if (k->mtp && w->n_layers <= w->cfg.num_hidden_layers) {
        log_warnx("rank_init: mtp = yes, but the checkpoint has no MTP layer: plain decoding");
        k->mtp = false;
    }
    k->spec_k1 = k->mtp ? DSV4_SPEC_MAX_DRAFT + 1 : 1;
    /* no call has more rows than the longest prompt: capped here, before a
     * group's join compares its ranks' calls (a fresh rank's and one whose
     * warm-up had capped them must agree) */
    if (k->o.role == DSV4_ROLE_PREFILL && k->o.rows > k->o.conf.max_seq)
        k->o.rows = k->o.conf.max_seq;
    mo.max_rows = k->o.role == DSV4_ROLE_PREFILL ? k->o.rows : k->o.slots * k->spec_k1;
    if (dsv4_model_create(&k->m, k->be, w, &mo) != DSV4_OK)
        fatalx("rank_init: model: %s", dsv4_errmsg());
    k->V = dsv4_model_vocab(k->m);
    k->max_seq = k->o.conf.max_seq;
    rows = (size_t)(mo.max_rows > k->o.slots ? mo.max_rows : k->o.slots);
    k->b_slot = xcalloc((size_t)k->o.slots, sizeof(int32_t));
    k->b_ntok = xcalloc((size_t)k->o.slots, sizeof(int32_t));
    k->b_tok = xcalloc(rows, sizeof(int32_t));
    k->sp = xcalloc((size_t)k->o.slots, sizeof(*k->sp));
    k->out_tok = xcalloc((size_t)k->o.slots * k->spec_k1, sizeof(int32_t));
    k->out_lp = xcalloc((size_t)k->o.slots * k->spec_k1, sizeof(float));
    k->out_top.ids = xcalloc((size_t)k->o.slots * k->spec_k1 * DSV4_TOP_MAX, sizeof(int32_t));
    k->out_top.logprob = xcalloc((size_t)k->o.slots * k->spec_k1 * DSV4_TOP_MAX,
                                 sizeof(float));
    k->out_top.n = xcalloc((size_t)k->o.slots * k->spec_k1, sizeof(int32_t));
    k->out_top_n = xcalloc((size_t)k->o.slots * k->spec_k1, sizeof(uint64_t));
    k->msg_top_ids = xcalloc((size_t)k->o.slots * k->spec_k1 * DSV4_TOP_MAX, sizeof(int32_t));
    k->msg_top_lp = xcalloc((size_t)k->o.slots * k->spec_k1 * DSV4_TOP_MAX, sizeof(float));
    k->spec_nd = xcalloc((size_t)k->o.slots, sizeof(int32_t));
    k->spec_draft = xcalloc((size_t)k->o.slots, sizeof(int32_t));
    k->spec_n = xcalloc((size_t)k->o.slots, sizeof(int32_t));
    if (k->mtp)
        log_info("rank_init: speculative decoding with the MTP layer (%d draft per stream)",
                 DSV4_SPEC_MAX_DRAFT);
    if (k->o.role == DSV4_ROLE_PREFILL)
        k->jobs = xcalloc((size_t)k->o.slots, sizeof(*k->jobs));
    else
        k->streams = xcalloc((size_t)k->o.slots, sizeof(*k->streams));
    if (kv_open(k) != 0)
        fatalx("rank_init: KV transfer layer");
    group_init(k, &k->cfg);
    if (k->o.group_size <= 1) {
        k->test_nomem = rank_test_env(k, RANK_TEST_FORWARD_NOMEM);
        if (k->o.role == DSV4_ROLE_PREFILL)
            k->test_export_nomem = rank_test_env(k, RANK_TEST_EXPORT_NOMEM);
    }
    if (k->o.role == DSV4_ROLE_DECODE) {
        k->test_graphs_refused = rank_test_env(k, RANK_TEST_GRAPHS_REFUSED);
        rank_test_drafts_load(k);
    }
}

static void
rank_free(struct rank *k)
{
    group_join_abandon(k);   /* its thread uses the backend and the model */
    if (k->jobs != NULL)
        prefill_reset(k);
    if (k->streams != NULL)
        decode_reset(k);
    group_free(k);
    kv_close(k);
    if (k->sock != NULL) {
        int linger = RANK_LINGER_MS;   /* (the last DRAIN or DISCONNECT) */

        zmq_setsockopt(k->sock, ZMQ_LINGER, &linger, sizeof(linger));
    }
    dsv4_zsock_close(k->sock);
    if (k->zctx != NULL)
        zmq_ctx_term(k->zctx);
    free(k->jobs);
    free(k->streams);
    free(k->b_slot);
    free(k->b_ntok);
    free(k->b_tok);
    free(k->sp);
    free(k->out_tok);
    free(k->out_lp);
    free(k->out_top.ids);
    free(k->out_top.logprob);
    free(k->out_top.n);
    free(k->out_top_n);
    free(k->msg_top_ids);
    free(k->msg_top_lp);
    free(k->spec_nd);
    free(k->spec_draft);
    free(k->spec_n);
    rank_test_drafts_free(k);
    dsv4_model_free(k->m);
#ifdef DSV4_HAVE_CUDA
    rank_share_free(k);
    if (k->wdev_loaded)
        dsv4_cuda_weights_free(k->be, &k->wdev);
#endif
    dsv4_backend_destroy(k->be);
    if (k->wshard_on)
        dsv4_weights_shard_free(&k->wshard);
    if (k->w_loaded)
        dsv4_weights_free(&k->w);
    if (k->sigfd >= 0)
        close(k->sigfd);
}

int
main(int argc, char **argv)
{
    static struct rank k;
    sigset_t mask;

    if (rank_options(&k.o, argc, argv))
        return 0;
    snprintf(k.name, sizeof(k.name), "%s@%u", dsv4_role_name(k.o.role), (unsigned)k.o.index);
    log_init(k.o.verbose);
    {
        char tag[32];
        snprintf(tag, sizeof(tag), "%s/%u", dsv4_role_name(k.o.role), (unsigned)k.o.index);
        log_procinit(tag);
    }

    /* Block the signals before the backend starts threads, so only the
     * signalfd sees them. */
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    /* (read and ignored: its default action ended the rank, and systemd
     * counts such an end as clean, so it was not restarted) */
    sigaddset(&mask, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &mask, NULL) != 0)
        fatal("main: sigprocmask");
    signal(SIGPIPE, SIG_IGN);
    k.sigfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    if (k.sigfd < 0)
        fatal("main: signalfd");

    rank_init_model(&k);
    /* a rank in a group warms up with its peers when the group forms
     * (rank_group.c: its calls are collectives) */
    k.warmed = strcmp(k.o.conf.warmup, "yes") != 0;
    if (k.warmed)
        log_notice("main: warmup = %s: no warm-up calls", k.o.conf.warmup);
    else if (k.o.group_size <= 1 && rank_warmup(&k) != DSV4_OK)
        fatalx("main: %s", dsv4_errmsg());
    /* a SIGTERM during the load or the warm-up (read only from here on):
     * stop before registering, not after a READY the scheduler would take
     * for a rank that serves */
    rank_exit_if_stopped(&k, "starting");
    k.wd_interval_ms = (int64_t)(sdnotify_watchdog_interval_us() / 1000);
    k.wd_last_ms = dsv4_now_ms();
    /* The host the scheduler compares to pick shm (same host) or ucx. */
    if (k.o.conf.host[0] != '\0')
        snprintf(k.host, sizeof(k.host), "%s", k.o.conf.host);
    else if (gethostname(k.host, sizeof(k.host)) != 0)
        strcpy(k.host, "localhost");
    k.host[sizeof(k.host) - 1] = '\0';
    rank_device_id(&k, k.device, sizeof(k.device));
    k.zctx = zmq_ctx_new();
    if (k.zctx == NULL)
        fatal("main: zmq_ctx_new");
    sdnotify_status("registering with %s", k.o.conf.rank_endpoint);
    log_notice("main: %s up on host %s (%d slots, max_seq %d, V %d), registering with %s",
               k.name, k.host, k.o.slots, k.max_seq, k.V, k.o.conf.rank_endpoint);
    link_join(&k);

    rank_loop(&k);

    sdnotify_stopping();
    if (k.link == RANK_LINK_UP) {
        struct dsv4_msg m;

        rank_heartbeat(&k);   /* what it leaves (0 after a drain): dsv4ctl ranks */
        /* stopped without its DRAIN (stop_drain_s = 0): said now, so that
         * the scheduler knows the rank left on purpose (the set's stop, not
         * a crash: docs/protocol.md §4.3) */
        if (k.leave_ms == 0) {
            dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DRAIN);
            rank_send(&k, &m);
        }
        dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_DISCONNECT);
        m.u.disconnect.reason = RANK_STOP_REASON;
        rank_send(&k, &m);
    }
    log_notice("main: %s stopped (%u requests dropped)", k.name, (unsigned)rank_active(&k));
    rank_free(&k);
    return 0;
}
