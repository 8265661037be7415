/*
 * gateway.c — dsv4-gateway: main (options, configuration, -n), the bearer
 * keys, the tokenizer, the listener (a socket passed by systemd, else
 * gateway_listen), sd_notify and the signal loop.  See gateway.h for the
 * program's map and docs/gateway.md for the API.
 *
 *   dsv4-gateway [-nv] [-f CONFIG] [-o KEY=VALUE]... [-l HOST:PORT]
 *
 * -n checks the configuration, the keys file and the tokenizer, then exits.
 * Exit status: 0 after SIGTERM/SIGINT, 1 on a setup error, 2 usage, 6 a
 * configuration fault (docs/gateway.md).
 */
#include <ctype.h>
#include <inttypes.h>
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "common/cli.h"
#include "common/config_file.h"
#include "common/log.h"
#include "common/sdnotify.h"
#include "daemons/gateway/gateway.h"
#include "ipc/zsock.h"

static void __attribute__((noreturn))
usage(int status)
{
    dsv4_cli_usage(
        "usage: dsv4-gateway [-nv] [-f CONFIG] [-o KEY=VALUE]... [-l HOST:PORT]\n",
        "The OpenAI-compatible HTTP gateway in front of the scheduler (docs/gateway.md).\n"
        "  -f CONFIG      configuration file (default " DSV4_CONF_DEFAULT_PATH " when it exists)\n"
        "  -o KEY=VALUE   set one configuration key over the file (up to 64)\n"
        "  -l HOST:PORT   listen there (over gateway_listen; a socket passed by systemd wins)\n"
        "  -n             check the configuration, the keys file, the tokenizer, the\n"
        "                 scheduler's endpoints and the listen address, print\n"
        "                 \"configuration OK\" and exit\n"
        "  -v             more logging (-vv: debug)\n"
        "  -h, --help     this help\n"
        "      --version  the version\n"
        "SIGHUP reads the keys file (gateway_keys) again; the running keys stay if it\n"
        "cannot be used.\n"
        DSV4_CLI_DAEMON_EXIT, status);
}

/* Read the bearer tokens into keys[], *n of them: one per line, blanks
 * trimmed, '#' comments.  0, or -1 with the reason logged (a missing file,
 * no key, a key too long or too many). */
static int
gw_keys_read(const char *path, char (*keys)[GW_KEY_LEN], int *n)
{
    char line[1024], *p, *e;
    struct stat st;
    FILE *f;

    if ((f = fopen(path, "re")) == NULL) {
        log_warn("gw_keys_load: %s", path);
        return -1;
    }
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & 0007) != 0)
        log_warnx("gw_keys_load: %s is readable by everyone (chmod 0640)", path);
    while (fgets(line, sizeof(line), f) != NULL) {
        for (p = line; isspace((unsigned char)*p); p++)
            ;
        if (*p == '#' || *p == '\0')
            continue;
        for (e = p + strlen(p); e > p && isspace((unsigned char)e[-1]); e--)
            ;
        *e = '\0';
        if (strlen(p) >= GW_KEY_LEN || *n >= GW_MAX_KEYS) {
            log_warnx("gw_keys_load: %s: keys are < %d bytes, at most %d of them", path,
                GW_KEY_LEN, GW_MAX_KEYS);
            fclose(f);
            return -1;
        }
        snprintf(keys[(*n)++], GW_KEY_LEN, "%s", p);
    }
    fclose(f);
    if (*n == 0) {
        log_warnx("gw_keys_load: %s holds no key", path);
        return -1;
    }
    return 0;
}

/* SIGHUP: read the keys file again and replace the keys, so a key is added
 * or revoked without a restart (requests in flight go on).  A file that
 * does not read keeps the running keys.  Authentication is on or off by
 * gateway_keys as at the start: turning it on or off takes a restart. */
static void
gw_keys_reload(struct gw *g)
{
    char (*keys)[GW_KEY_LEN];
    int n = 0;

    sdnotify_reloading();
    if (g->conf.gateway_keys[0] == '\0') {
        log_notice("gw_loop: SIGHUP: no keys file (gateway_keys): nothing to reload");
    } else if ((keys = calloc(GW_MAX_KEYS, GW_KEY_LEN)) == NULL) {
        log_warnx("gw_loop: SIGHUP: out of memory; the running keys stay");
    } else {
        if (gw_keys_read(g->conf.gateway_keys, keys, &n) != 0) {
            log_warnx("gw_loop: SIGHUP: %s cannot be used; the %d running key(s) stay",
                g->conf.gateway_keys, g->n_keys);
            sdnotify_status("serving; the last keys reload failed (see the log)");
        } else {
            pthread_mutex_lock(&g->klock);
            memcpy(g->keys, keys, (size_t)n * GW_KEY_LEN);
            g->n_keys = n;
            pthread_mutex_unlock(&g->klock);
            log_notice("gw_loop: SIGHUP: %d bearer key(s) from %s", n, g->conf.gateway_keys);
            sdnotify_status("serving; %d bearer key(s) reloaded", n);
        }
        explicit_bzero(keys, GW_MAX_KEYS * GW_KEY_LEN);
        free(keys);
    }
    sdnotify_ready();
}

/* gateway_listen must be a HOST:PORT that resolves (gw_listen_check), or
 * the gateway exits with DSV4_EXIT_CONFIG. */
static void
listen_check_or_die(const char *spec)
{
    if (gw_listen_check(spec) != 0)
        fatalx_conf("gateway_listen \"%s\" cannot be listened on", spec);
}

/* The scheduler's client_endpoint and admin_endpoint must be endpoints the
 * gateway can connect to (dsv4_zsock_check: the form, and for tcp:// the
 * CURVE key in key_dir), or the gateway exits with DSV4_EXIT_CONFIG. */
static void
endpoints_check_or_die(const struct gw *g)
{
    const char *what[] = { "client_endpoint", "admin_endpoint" };
    const char *eps[] = { g->conf.client_endpoint, g->conf.admin_endpoint };
    struct dsv4_zsock_cfg zc;

    for (int i = 0; i < 2; i++) {
        dsv4_zsock_cfg_init(&zc);
        zc.endpoint = eps[i];
        zc.key_dir = g->conf.key_dir;
        if (dsv4_zsock_check(&zc) != DSV4_OK)
            fatalx_conf("%s: %s", what[i], dsv4_errmsg());
    }
}

static int
signals_open(void)
{
    sigset_t set;
    int fd;

    /* Blocked before MHD starts its threads, so they inherit the mask and
     * only the signalfd sees these. */
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    if (pthread_sigmask(SIG_BLOCK, &set, NULL) != 0)
        fatalx("pthread_sigmask");
    if ((fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK)) < 0)
        fatal("signalfd");
    signal(SIGPIPE, SIG_IGN);
    return fd;
}

/*
 * The main thread's loop: wait for a signal or the watchdog interval; ping
 * the watchdog; SIGTERM/SIGINT end it; SIGHUP reloads the keys file.
 */
static void
gw_loop(struct gw *g, int sigfd)
{
    uint64_t wd = sdnotify_watchdog_interval_us();
    struct signalfd_siginfo si;
    struct pollfd p;

    for (;;) {
        p.fd = sigfd;
        p.events = POLLIN;
        if (poll(&p, 1, wd != 0 ? (int)(wd / 1000) : -1) < 0 && errno != EINTR)
            fatal("poll");
        if (wd != 0)
            sdnotify_watchdog();
        while (read(sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
            if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
                log_notice("gw_loop: %s; stopping", si.ssi_signo == SIGTERM ?
                    "SIGTERM" : "SIGINT");
                return;
            }
            gw_keys_reload(g);
        }
    }
}

/* Generations in flight now (read under the metrics lock). */
static uint64_t
streams_active(struct gw *g)
{
    uint64_t n;

    pthread_mutex_lock(&g->mlock);
    n = g->m.streams_active;
    pthread_mutex_unlock(&g->mlock);
    return n;
}

/*
 * A graceful stop's wait: no new connections (quiesce) and no new
 * generations (g->stopping: 503), while the generations in flight end,
 * for at most stop_drain_s (the ranks' bound: under systemd the ranks
 * finish them meanwhile) or until a second SIGTERM / SIGINT.
 */
static void
gw_finish(struct gw *g, int sigfd)
{
    uint64_t wd = sdnotify_watchdog_interval_us(), n;
    int64_t end = dsv4_now_ms() + (int64_t)g->conf.stop_drain_s * 1000;
    struct signalfd_siginfo si;
    struct pollfd p;

    gw_http_quiesce(g);
    n = streams_active(g);
    if (n == 0 || g->conf.stop_drain_s == 0)
        return;
    log_notice("gw_finish: waiting for %" PRIu64 " generations (at most %d s); a second signal "
        "stops at once", n, g->conf.stop_drain_s);
    sdnotify_status("stopping: finishing %" PRIu64 " generations", n);
    while (dsv4_now_ms() < end) {
        p.fd = sigfd;
        p.events = POLLIN;
        (void)poll(&p, 1, 50);
        if (wd != 0)
            sdnotify_watchdog();
        while (read(sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si))
            if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) {
                log_notice("gw_finish: a second signal; stopping now");
                return;
            }
        if ((n = streams_active(g)) == 0)
            return;
    }
    log_warnx("gw_finish: stop_drain_s passed with %" PRIu64 " generations in flight", n);
}

/* Descriptors a connection costs at most: its HTTP socket and the
 * scheduler connection of its generation (a ZeroMQ context: mailboxes,
 * I/O thread, socket, monitor: about 10 measured). */
#define GW_FDS_PER_CONN 12
#define GW_FDS_SPARE 64   /* the listener, the log, the tokenizer, signals */

/* Raise the soft limit on open files to the hard one (a start by hand or
 * under dsv4-launch has 1,024: about 80 generations), and hold
 * gateway_max_conns to what the limit can serve: past it libmicrohttpd's
 * accept() fails with EMFILE in a loop that spins a core. */
static void
fd_budget(struct gw *g)
{
    struct rlimit rl;
    rlim_t need = (rlim_t)g->conf.gateway_max_conns * GW_FDS_PER_CONN + GW_FDS_SPARE;
    int fit;

    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    if (rl.rlim_cur < rl.rlim_max && rl.rlim_cur < need) {
        rl.rlim_cur = rl.rlim_max != RLIM_INFINITY && rl.rlim_max < need ? rl.rlim_max : need;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            (void)getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= need)
        return;
    fit = rl.rlim_cur > GW_FDS_SPARE + GW_FDS_PER_CONN ?
        (int)((rl.rlim_cur - GW_FDS_SPARE) / GW_FDS_PER_CONN) : 1;
    log_warnx("main: gateway_max_conns = %d needs about %llu open files, the limit is %llu: "
        "serving %d connections (raise LimitNOFILE= / ulimit -n)", g->conf.gateway_max_conns,
        (unsigned long long)need, (unsigned long long)rl.rlim_cur, fit);
    g->conf.gateway_max_conns = fit;
}

int
main(int argc, char **argv)
{
    static struct gw g;
    static const struct option lopts[] = {
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };
    const char *conf_path = NULL, *listen = NULL, *tok_path;
    bool check = false;
    int ch, verbose = 0, sigfd, n_fds, listen_fd = -1;
    char *overrides[64];
    int n_over = 0, i;
    sigset_t hup;

    log_init(0);
    log_procinit("gateway");
    /* A reload (SIGHUP) during the start-up (the tokenizer's load) must not
     * end the process, SIGHUP's default action: blocked from here, it
     * waits for the signalfd of signals_open and is read by gw_loop. */
    sigemptyset(&hup);
    sigaddset(&hup, SIGHUP);
    if (pthread_sigmask(SIG_BLOCK, &hup, NULL) != 0)
        fatalx("pthread_sigmask");
    while ((ch = getopt_long(argc, argv, "hnvf:o:l:", lopts, NULL)) != -1) {
        switch (ch) {
        case 'n': check = true; break;
        case 'v': verbose++; break;
        case 'f': conf_path = optarg; break;
        case 'o':
            if (n_over >= 64)
                usage(2);
            overrides[n_over++] = optarg;
            break;
        case 'l': listen = optarg; break;
        case 'h': usage(0);
        case DSV4_CLI_OPT_VERSION: dsv4_cli_version("dsv4-gateway");
        default: usage(2);
        }
    }
    if (optind != argc)
        usage(2);
    log_init(verbose);
    dsv4_conf_defaults(&g.conf);
    if (conf_path == NULL && access(DSV4_CONF_DEFAULT_PATH, F_OK) == 0)
        conf_path = DSV4_CONF_DEFAULT_PATH;
    if (conf_path != NULL && dsv4_conf_load(&g.conf, conf_path, DSV4_CONF_ROLE_NONE) != DSV4_OK)
        fatalx_conf("%s", dsv4_errmsg());
    for (i = 0; i < n_over; i++)
        if (dsv4_conf_set_kv(&g.conf, overrides[i]) != DSV4_OK)
            fatalx_conf("-o %s", dsv4_errmsg());
    if (listen != NULL && dsv4_conf_set(&g.conf, "gateway_listen", listen) != DSV4_OK)
        fatalx_conf("-l %s", dsv4_errmsg());
    if (g.conf.gateway_keys[0] != '\0' &&
        gw_keys_read(g.conf.gateway_keys, g.keys, &g.n_keys) != 0)
        fatalx_conf("cannot use the keys file %s", g.conf.gateway_keys);
    sdnotify_status("loading the tokenizer");
    /* the file as the scheduler picks it: the key at its default defers to
     * $DSV4_TOKENIZER, so the two read one file */
    if ((tok_path = dsv4_tok_conf_path(g.conf.tokenizer)) == NULL)
        fatalx_conf("tokenizer = none: the gateway needs a tokenizer (the text of every "
            "route is tokenized here)");
    if (dsv4_tok_load(&g.tok, tok_path, DSV4_TOK_HF) != DSV4_OK)
        fatalx_conf("tokenizer: %s", dsv4_errmsg());
    /* (else every chat request would fail, each blamed on its client) */
    if (dsv4_chat_markers_check(g.tok) != DSV4_OK)
        fatalx_conf("tokenizer %s: %s", tok_path, dsv4_errmsg());
    g.eos = dsv4_tok_eos(g.tok);
    g.think_id = dsv4_chat_think_id(g.tok);
    /* The scheduler's endpoints as the gateway connects to them (form and
     * CURVE key: dsv4_zsock_check; nothing is connected), at every start as
     * well as under -n: a start that would fail every request exits 6 and is
     * not restarted (the unit has no ExecStartPre= check, whose failure
     * systemd would restart). */
    endpoints_check_or_die(&g);
    if (check) {
        /* the listen address as gw_http_start would resolve it (not bound:
         * a running gateway may hold it) */
        listen_check_or_die(g.conf.gateway_listen);
        printf("configuration OK (%s); %d bearer key(s); tokenizer %s; listen %s\n",
            conf_path != NULL ? conf_path : "defaults", g.n_keys, tok_path,
            g.conf.gateway_listen);
        dsv4_tok_free(g.tok);
        return 0;
    }
    fd_budget(&g);
    pthread_mutex_init(&g.toklock, NULL);
    pthread_mutex_init(&g.klock, NULL);
    pthread_mutex_init(&g.alock, NULL);
    pthread_mutex_init(&g.qlock, NULL);
    pthread_cond_init(&g.qdone, NULL);
    if ((g.q_last = calloc(1, sizeof(*g.q_last))) == NULL)
        fatalx("out of memory");
    pthread_mutex_init(&g.mlock, NULL);
    sigfd = signals_open();
    /* Socket activation (dsv4-gateway.socket): one listening stream socket. */
    n_fds = sd_listen_fds(1);
    if (n_fds < 0)
        fatalx("sd_listen_fds: %s", strerror(-n_fds));
    if (n_fds > 1)
        fatalx_conf("systemd passed %d sockets; dsv4-gateway takes one", n_fds);
    if (n_fds == 1) {
        if (sd_is_socket(SD_LISTEN_FDS_START, AF_UNSPEC, SOCK_STREAM, 1) <= 0)
            fatalx_conf("the socket systemd passed is not a listening stream socket");
        listen_fd = SD_LISTEN_FDS_START;
    }
    if (gw_http_start(&g, listen_fd) != 0) {
        /* an address that cannot be listened on is the configuration's
         * fault; one in use may be free at the next start */
        if (listen_fd < 0)
            listen_check_or_die(g.conf.gateway_listen);
        fatalx("cannot start the HTTP listener");
    }
    log_notice("main: serving %s on %s; scheduler %s, admin %s; %s", g.conf.gateway_model,
        listen_fd >= 0 ? "the socket passed by systemd" : g.conf.gateway_listen,
        g.conf.client_endpoint, g.conf.admin_endpoint,
        g.n_keys > 0 ? "bearer tokens required" : "no authentication");
    sdnotify_status("serving on %s", listen_fd >= 0 ? "the socket passed by systemd" :
        g.conf.gateway_listen);
    sdnotify_ready();
    gw_loop(&g, sigfd);
    sdnotify_stopping();
    atomic_store(&g.stopping, true);
    gw_finish(&g, sigfd);
    gw_http_stop(&g);
    gw_admin_close(&g);
    free(g.q_last);
    dsv4_tok_free(g.tok);
    close(sigfd);
    log_info("main: stopped");
    return 0;
}
