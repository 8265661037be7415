/*
 * sched.c — dsv4-sched: main (options, configuration, -n), setting up the
 * sockets (systemd socket activation or own binds) and the signalfd, and
 * the event loop with its top-level dispatch.  Nothing else lives here; the
 * handlers are in sched_client.c, sched_rank.c and sched_ctl.c, the policy in
 * sched_queue.c, the request life cycle in sched_req.c (sched.h is the map).
 *
 * One thread.  The loop is a single zmq_poll over the client, rank and admin
 * ROUTER sockets and a signalfd (SIGTERM/SIGINT/SIGHUP), with a timeout
 * computed from the nearest deadline.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
#include <zmq.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/sdnotify.h"
#include "common/weights_fp.h"
#include "daemons/sched/sched.h"

/* Poll slots (ntpd style). */
enum {
    POLL_CLIENT,
    POLL_RANKS,
    POLL_CTL,
    POLL_SIGNAL,
    POLL_MAX
};

#define RANK_HWM 1000000   /* rank link queues: never drop work messages; the
                              admin socket's too (listings) */
#define LINGER_MS 500      /* let final messages leave on exit */
#define RANK_DRAIN_BATCHES 16 /* rank batches read before the timers judge liveness */

static void __attribute__((noreturn))
usage(int status)
{
    dsv4_cli_usage(
        "usage: dsv4-sched [-nv] [-f CONFIG] [-o KEY=VALUE]...\n",
        "The dsv4 scheduler: admits the clients' requests and places their prefill and\n"
        "decode work on the ranks (docs/architecture.md, docs/operations.md).\n"
        "  -f CONFIG      configuration file (default " DSV4_CONF_DEFAULT_PATH " when it exists)\n"
        "  -o KEY=VALUE   set one configuration key over the file (up to 64)\n"
        "  -n             check the configuration (endpoints, keys, tokenizer) without\n"
        "                 binding, print \"configuration OK\" and exit\n"
        "  -v             more logging (-vv: debug)\n"
        "  -h, --help     this help\n"
        "      --version  the version\n"
        "SIGHUP reloads the configuration: queue_max, request_timeout_ms, stop_timeout_ms,\n"
        "prefill_chunk, burst_streams, burst_free_slots and max_batch change at once; the\n"
        "other keys wait for a restart.\n"
        DSV4_CLI_DAEMON_EXIT, status);
}

/*
 * The endpoint ZeroMQ should name an adopted listening fd with: ipc://PATH
 * for a unix socket, tcp://ADDR:PORT for TCP, from the fd itself, so what
 * systemd bound wins over the configuration.
 */
static int
fd_endpoint(int fd, char *buf, size_t len)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    char addr[INET6_ADDRSTRLEN];

    /* zeroed: an unnamed unix socket's getsockname writes the family alone,
     * and its path must read as empty, not as what the stack held */
    memset(&ss, 0, sizeof(ss));
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0)
        return -1;
    if (ss.ss_family == AF_UNIX) {
        const struct sockaddr_un *un = (const struct sockaddr_un *)&ss;

        if (un->sun_path[0] == '\0')
            return -1;
        snprintf(buf, len, "ipc://%s", un->sun_path);
    } else if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;

        inet_ntop(AF_INET, &in->sin_addr, addr, sizeof(addr));
        snprintf(buf, len, "tcp://%s:%u", addr, ntohs(in->sin_port));
    } else if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ss;

        inet_ntop(AF_INET6, &in6->sin6_addr, addr, sizeof(addr));
        snprintf(buf, len, "tcp://[%s]:%u", addr, ntohs(in6->sin6_port));
    } else {
        return -1;
    }
    return 0;
}

/*
 * Whether an adopted socket's endpoint `fdep` is the configured `ep`: the
 * same path for ipc://, the same port for tcp:// (the host may be spelt
 * otherwise: '*', a name, an interface).  Clients and ranks find the
 * scheduler by the configured endpoint, so a socket unit that listens
 * elsewhere leaves them knocking at a door nobody opens.
 */
static bool
endpoint_matches(const char *ep, const char *fdep)
{
    const char *a, *b;

    if (*ep == '@' || *ep == '>')
        ep++;
    if (strncmp(ep, "ipc://", 6) == 0 || strncmp(fdep, "ipc://", 6) == 0)
        return strcmp(ep, fdep) == 0;
    if (strncmp(ep, "tcp://", 6) != 0 || strncmp(fdep, "tcp://", 6) != 0)
        return false;
    a = strrchr(ep, ':');
    b = strrchr(fdep, ':');
    return a != NULL && b != NULL && (strcmp(a, ":*") == 0 || strcmp(a, b) == 0);
}

/* Open one ROUTER: on the adopted fd when there is one, else bind `ep`. */
static void *
open_router(struct sched *s, const char *what, const char *ep, int fd, unsigned mode, int hwm)
{
    struct dsv4_zsock_cfg zc;
    char fdep[160];
    void *sock;

    dsv4_zsock_cfg_init(&zc);
    zc.type = ZMQ_ROUTER;
    zc.bind = true;
    zc.endpoint = ep;
    zc.key_dir = s->cfg.file.key_dir;
    zc.hwm = hwm;
    zc.mode = mode;
    if (fd >= 0) {
        if (fd_endpoint(fd, fdep, sizeof(fdep)) != 0)
            fatalx_conf("%s: passed fd %d is not a unix or TCP socket", what, fd);
        if (!endpoint_matches(ep, fdep))
            log_warnx("%s socket: the service manager passed %s, the configuration names "
                "%s: whoever connects by the configuration will not reach this scheduler "
                "(make the socket unit's ListenStream= and %s_endpoint agree)",
                what, fdep, ep, what);
        zc.endpoint = fdep;
        zc.fd = fd;
        zc.mode = 0; /* the socket unit set the mode */
    }
    if ((sock = dsv4_zsock_open(s->zctx, &zc, NULL)) == NULL) {
        /* the endpoint's form, its directory, its key: the configuration's
         * fault; anything else (an address in use) a new start may not meet.
         * An adopted TCP socket still reads its CURVE key (exit 6 too: it
         * was 1, restarted in a loop); an adopted unix socket's directory is
         * the socket unit's business, not checked */
        if ((fd < 0 || strncmp(zc.endpoint, "tcp://", 6) == 0) &&
            dsv4_zsock_check(&zc) != DSV4_OK)
            fatalx_conf("%s socket: %s", what, dsv4_errmsg());
        fatalx("%s socket: %s", what, dsv4_errmsg());
    }
    log_info("%s socket on %s%s", what, zc.endpoint, fd >= 0 ? " (socket activation)" : "");
    return sock;
}

static void
sched_init(struct sched *s)
{
    int client_fd = -1, admin_fd = -1, n;
    char **names = NULL;
    const char *tp;
    sigset_t ss;

    TAILQ_INIT(&s->ranks);
    TAILQ_INIT(&s->groups);
    TAILQ_INIT(&s->queue);
    TAILQ_INIT(&s->live);
    TAILQ_INIT(&s->drains);
    TAILQ_INIT(&s->refusals);
    s->start_ms = dsv4_now_ms();
    /* Request ids differ across restarts, so a rank's stale state from the
     * previous scheduler never matches a new request. */
    s->next_req = ((uint64_t)time(NULL) << 20) | 1;
    s->eos = -1;

    if ((tp = dsv4_tok_conf_path(s->cfg.file.tokenizer)) != NULL) {
        sdnotify_status("loading tokenizer %s", tp);
        if (dsv4_tok_load(&s->tok, tp, DSV4_TOK_HF) != DSV4_OK) {
            if (s->cfg.tokenizer_required)
                fatalx_conf("tokenizer: %s", dsv4_errmsg());
            log_warnx("no tokenizer (%s): only token-id prompts, no output text",
                dsv4_errmsg());
            s->tok = NULL;
        }
    }
    if (s->tok != NULL) {
        s->vocab = dsv4_tok_vocab_size(s->tok);
        s->eos = dsv4_tok_eos(s->tok);
    }
    /* The model every rank must run (sched_rank.c model_conflict): that of
     * the configured checkpoint where this host reads it (its headers and a
     * few KiB), else the model of the ranks registered first. */
    sdnotify_status("reading the fingerprint of %s", s->cfg.file.checkpoint);
    if (dsv4_ckpt_fingerprint(s->cfg.file.checkpoint, s->model_ref) == DSV4_OK) {
        log_info("model %s (checkpoint %s): ranks of another model are refused",
            s->model_ref, s->cfg.file.checkpoint);
    } else {
        s->model_ref[0] = '\0';
        log_info("no model fingerprint of its own (%s): ranks must run the model of the "
            "ranks registered first", dsv4_errmsg());
    }

    /* Socket activation: listeners named "client" and "admin" (or "ctl"). */
    n = sd_listen_fds_with_names(1, &names);
    for (int i = 0; i < n; i++) {
        const char *nm = names != NULL && names[i] != NULL ? names[i] : "";

        if (strcmp(nm, "client") == 0)
            client_fd = SD_LISTEN_FDS_START + i;
        else if (strcmp(nm, "admin") == 0 || strcmp(nm, "ctl") == 0)
            admin_fd = SD_LISTEN_FDS_START + i;
        else   /* (a unit's FileDescriptorName= wrong: its clients would hang) */
            fatalx_conf("the service manager passed socket %d named '%s': dsv4-sched takes "
                "'client' and 'admin' (FileDescriptorName= of its socket units)",
                SD_LISTEN_FDS_START + i, nm);
    }
    for (int i = 0; names != NULL && i < n; i++)
        free(names[i]);
    free(names);

    if ((s->zctx = zmq_ctx_new()) == NULL)
        fatal("zmq_ctx_new");
    s->client = open_router(s, "client", s->cfg.file.client_endpoint, client_fd, 0, 0);
    s->rank = open_router(s, "rank", s->cfg.file.rank_endpoint, -1, 0, RANK_HWM);
    /* a listing is sent in one turn, a message an item (queue_max + the
     * live requests): the default high-water mark of 1,000 cut it short */
    s->admin = open_router(s, "admin", s->cfg.file.admin_endpoint, admin_fd,
        s->cfg.file.admin_mode, RANK_HWM);

    sigemptyset(&ss);
    sigaddset(&ss, SIGTERM);
    sigaddset(&ss, SIGINT);
    sigaddset(&ss, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &ss, NULL) != 0)
        fatal("sigprocmask");
    if ((s->sigfd = signalfd(-1, &ss, SFD_NONBLOCK | SFD_CLOEXEC)) < 0)
        fatal("signalfd");
    signal(SIGPIPE, SIG_IGN);
    s->watchdog_ms = (int64_t)(sdnotify_watchdog_interval_us() / 1000);
}

static void
on_signal(struct sched *s)
{
    struct signalfd_siginfo si;

    while (read(s->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        if (si.ssi_signo == SIGHUP) {
            if (!s->stopping)
                (void)sched_reload(s, NULL, 0);
            continue;
        }
        if (s->stopping)
            continue;
        log_notice("signal %u: stopping, finishing %u running and %u queued requests",
            si.ssi_signo, s->n_live, s->n_queued);
        sdnotify_stopping();
        s->stopping = true;
        s->stop_deadline_ms = dsv4_now_ms() + s->cfg.file.stop_timeout_ms;
    }
}

static int64_t
tmin(int64_t a, int64_t b)
{
    if (a < 0)
        return b;
    if (b < 0)
        return a;
    return a < b ? a : b;
}

/* SIGTERM: end the queued requests (`live` too: the stop timeout passed)
 * with `code`, so every client hears. */
static void
fail_left(struct sched *s, bool live, uint16_t code, const char *why)
{
    struct sched_req *r, *tmp;
    uint32_t n = s->n_queued + (live ? s->n_live : 0);

    if (n > 0)
        log_notice("stopping: %u requests left: %u %s", n, code, why);
    TAILQ_FOREACH_SAFE(r, &s->queue, qentry, tmp)
        req_fail(s, r, code, "%s", why);
    TAILQ_FOREACH_SAFE(r, &s->live, qentry, tmp) {
        if (live && !r->closing)
            req_fail(s, r, code, "%s", why);
    }
    client_flush_all(s);
}

/* SIGTERM's stop timeout passed: unless the set stops, 302 for what is left
 * (send it again with resume, docs/protocol.md §4.6: libdsv4client does so
 * on the next scheduler, and the request loses nothing); else 500. */
static void
fail_remaining(struct sched *s)
{
    if (!rank_set_stopped(s))
        fail_left(s, true, DSV4_STATUS_RESTARTING, SCHED_RESTARTING_MSG);
    else
        fail_left(s, true, DSV4_STATUS_INTERNAL, "scheduler stopping");
}

/*
 * The event loop.  Each turn, before sleeping:
 *   - rank timers: heartbeats due go out, ranks silent past liveness die
 *     (their requests are re-run);
 *   - request deadlines: requests past timeout_ms fail with 408;
 *   - dispatch: queued requests start where prefill room and decode slots are;
 *   - flush: output and final messages go to clients (blocked ones retry);
 *   - admin drain waits are answered when their work is done or timed out;
 *   - watchdog keep-alive; on SIGTERM, exit once nothing is in flight or the
 *     stop timeout passed;
 * then zmq_poll until a socket or the signalfd is readable or the nearest
 * deadline, and dispatch what arrived.
 */
static void
sched_loop(struct sched *s)
{
    zmq_pollitem_t items[POLL_MAX];

    memset(items, 0, sizeof(items));
    items[POLL_CLIENT].socket = s->client;
    items[POLL_RANKS].socket = s->rank;
    items[POLL_CTL].socket = s->admin;
    items[POLL_SIGNAL].fd = s->sigfd;
    for (int i = 0; i < POLL_MAX; i++)
        items[i].events = ZMQ_POLLIN;

    for (;;) {
        int64_t now;
        int64_t t;

        /* what the ranks sent while the last turn ran, before any rank is
         * judged silent (their heartbeats wait unread behind a long turn) */
        for (int i = 0; i < RANK_DRAIN_BATCHES && rank_dispatch(s); i++)
            ;
        now = dsv4_now_ms();
        t = rank_timers(s, now);
        t = tmin(t, req_timers(s, now));
        queue_dispatch(s);
        client_flush_all(s);
        rank_update_states(s);
        rank_tell_leavers(s);
        t = tmin(t, ctl_timers(s, now));
        if (s->n_dirty)
            t = tmin(t, SCHED_RETRY_MS);
        if (s->watchdog_ms > 0) {
            if (now - s->watchdog_last_ms >= s->watchdog_ms) {
                sdnotify_watchdog();
                s->watchdog_last_ms = now;
            }
            t = tmin(t, s->watchdog_ms - (now - s->watchdog_last_ms));
        }
        if (s->stopping) {
            /* the set stops: nothing will run what is queued (running
             * requests go on on the leaving ranks) */
            if (s->n_queued > 0 && rank_set_stopped(s))
                fail_left(s, false, DSV4_STATUS_INTERNAL,
                    "scheduler stopping, no rank left to run it");
            if (s->n_queued == 0 && s->n_live == 0)
                break;
            if (now >= s->stop_deadline_ms) {
                fail_remaining(s);
                break;
            }
            t = tmin(t, s->stop_deadline_ms - now);
        }
        if (zmq_poll(items, POLL_MAX, (long)t) < 0) {
            if (errno == EINTR)
                continue;
            fatal("zmq_poll");
        }
        if (items[POLL_SIGNAL].revents & ZMQ_POLLIN)
            on_signal(s);
        if (items[POLL_RANKS].revents & ZMQ_POLLIN)
            rank_dispatch(s);
        if (items[POLL_CLIENT].revents & ZMQ_POLLIN)
            client_dispatch(s);
        if (items[POLL_CTL].revents & ZMQ_POLLIN)
            ctl_dispatch(s);
    }
}

static void
sched_shutdown(struct sched *s)
{
    int linger = LINGER_MS;

    ctl_free_all(s);
    rank_free_all(s, "scheduler stopping");
    req_free_all(s);
    client_free_refusals(s);
    zmq_setsockopt(s->client, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s->rank, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s->admin, ZMQ_LINGER, &linger, sizeof(linger));
    dsv4_zsock_close(s->client);
    dsv4_zsock_close(s->rank);
    dsv4_zsock_close(s->admin);
    zmq_ctx_term(s->zctx);
    close(s->sigfd);
    dsv4_tok_free(s->tok);
}

int
main(int argc, char *argv[])
{
    static struct sched s; /* large (request hash): not on the stack */
    char *over[64];
    const char *path = NULL;
    int ch, n_over = 0, verbose = 0;
    bool check = false;
    sigset_t hup;

    static const struct option lopts[] = {
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };

    /* A reload (SIGHUP: systemctl reload, dsv4-launch) during the start-up
     * must not end the process, SIGHUP's default action: blocked from
     * here, it waits for the signalfd of sched_init and is read there. */
    sigemptyset(&hup);
    sigaddset(&hup, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &hup, NULL) != 0)
        fatal("sigprocmask");
    while ((ch = getopt_long(argc, argv, "f:hno:v", lopts, NULL)) != -1) {
        switch (ch) {
        case 'f':
            path = optarg;
            break;
        case 'n':
            check = true;
            break;
        case 'o':
            if (n_over == (int)(sizeof(over) / sizeof(over[0])))
                usage(2);
            over[n_over++] = optarg;
            break;
        case 'v':
            verbose++;
            break;
        case 'h':
            usage(0);
        case DSV4_CLI_OPT_VERSION:
            dsv4_cli_version("dsv4-sched");
        default:
            usage(2);
        }
    }
    if (optind != argc)
        usage(2);
    log_init(verbose);
    log_procinit("sched");
    if (sched_config_load(&s.cfg, path, n_over, over) != 0)
        exit(DSV4_EXIT_CONFIG);
    s.cfg.verbose = verbose;
    if (check) {
        if (sched_config_check(&s.cfg) != 0)
            exit(DSV4_EXIT_CONFIG);
        printf("configuration OK\n");
        return 0;
    }
    sdnotify_status("starting");
    sched_init(&s);
    sdnotify_ready();
    sdnotify_status("serving: waiting for ranks");
    log_notice("%s ready", SCHED_VERSION);
    sched_loop(&s);
    sched_shutdown(&s);
    log_notice("stopped");
    return 0;
}
