/*
 * launch.c — dsv4-launch: main (options, configuration, listeners) and the
 * event loop.  See launch.h for what the program does and docs/operations.md
 * for how it is used.
 *
 *   dsv4-launch [-f CONF] [-o KEY=VALUE]... [-P N] [-D N] [-G] [-w SEC] [-r MS]
 *               [-T SEC] [-t SEC] [-v] [--sched-bin P] [--prefill-bin P]
 *               [--decode-bin P] [--gateway-bin P] [--notify-log FILE]
 *               [--no-sched] [--rank-base N] [-- COMMAND [ARG]...]
 *
 * --no-sched runs ranks only (a prefill or decode host of a deployment over
 * several hosts, docs/operations.md): no scheduler and no listeners; the
 * ranks start at once and connect to rank_endpoint.  --rank-base N numbers
 * them from N so ranks of one role on different hosts have distinct indices.
 *
 * -G (or gateway_launch = yes in the configuration) also runs dsv4-gateway,
 * the HTTP gateway, started with the ranks and supervised like them.
 *
 * SIGHUP is passed to the scheduler, which reloads its configuration, and
 * to the gateway, which reloads its keys file (what `systemctl reload` of
 * their units does under systemd).
 *
 * Exit status: 0 after a clean stop; the command's status with `--`; 1 when
 * a child hit its start limit, the setup failed, or the stop was not clean
 * (a daemon killed after -t, or failing while it stopped); 2 usage error; 6 a
 * configuration fault (common/cli.h).  A child that exits 2 or 6 is not
 * restarted: the set stops with that status.
 */
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/config_file.h"
#include "common/log.h"
#include "common/sdnotify.h"
#include "tools/launch/launch.h"

enum { OPT_SCHED_BIN = 256, OPT_PREFILL_BIN, OPT_DECODE_BIN, OPT_NOTIFY_LOG,
    OPT_GATEWAY_BIN, OPT_NO_SCHED, OPT_RANK_BASE };

int64_t
launch_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void __attribute__((noreturn))
usage(int status)
{
    dsv4_cli_usage(
        "usage: dsv4-launch [-f CONF] [-o KEY=VALUE]... [-P N] [-D N] [-G] [-w SEC]\n"
        "                   [-r MS] [-T SEC] [-t SEC] [-v] [--sched-bin PATH]\n"
        "                   [--prefill-bin PATH] [--decode-bin PATH]\n"
        "                   [--gateway-bin PATH] [--notify-log FILE]\n"
        "                   [--no-sched] [--rank-base N] [-- COMMAND [ARG]...]\n",
        "Runs the dsv4 service set without systemd: the scheduler, then the ranks,\n"
        "supervised (docs/operations.md, \"Without systemd\").\n"
        "  -f CONF              configuration file (default " DSV4_CONF_DEFAULT_PATH "\n"
        "                       when it exists), passed to every daemon\n"
        "  -o KEY=VALUE         passed to every daemon (at most 16)\n"
        "  -P N, -D N           prefill and decode ranks (1 and 1)\n"
        "  -G                   also the HTTP gateway (or gateway_launch = yes)\n"
        "  -w SEC               watchdog (30; 0 off)\n"
        "  -r MS                delay before restarting a failed child (1000)\n"
        "  -T SEC               start timeout of each child (300; 0 none)\n"
        "  -t SEC               stop timeout: SIGKILL after it (30; the scheduler's\n"
        "                       counts from its SIGTERM, after the others exit)\n"
        "  -v                   more logging, passed on too\n"
        "  --sched-bin PATH, --prefill-bin PATH, --decode-bin PATH, --gateway-bin PATH\n"
        "                       the programs (default from $PATH)\n"
        "  --notify-log FILE    every start, exit and notify message, a line each\n"
        "  --no-sched           ranks only, connecting to rank_endpoint (a rank host)\n"
        "  --rank-base N        number this host's ranks from N\n"
        "  -- COMMAND [ARG]...  run COMMAND once the set is ready, then stop the set\n"
        "                       and exit with COMMAND's status\n"
        "  -h, --help           this help\n"
        "      --version        the version\n"
        "Exit status: 0 after a clean stop (or COMMAND's), 1 a child hit its start\n"
        "limit, the set-up failed or the stop was not clean (a daemon killed after -t,\n"
        "or failing as it stopped), 2 usage, 6 the configuration; a child that exits\n"
        "2 or 6 is not restarted: the set stops with its status.\n", status);
}

static long
num_arg(const char *s, long lo, long hi, const char *what)
{
    char *end;
    long v;

    errno = 0;
    v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || errno != 0 || v < lo || v > hi) {
        fprintf(stderr, "dsv4-launch: %s: \"%s\" not in %ld ... %ld\n", what, s, lo, hi);
        exit(2);
    }
    return v;
}

static void
parse_args(struct launch *l, int argc, char **argv)
{
    static const struct option longopts[] = {
        { "sched-bin", required_argument, NULL, OPT_SCHED_BIN },
        { "prefill-bin", required_argument, NULL, OPT_PREFILL_BIN },
        { "decode-bin", required_argument, NULL, OPT_DECODE_BIN },
        { "notify-log", required_argument, NULL, OPT_NOTIFY_LOG },
        { "gateway-bin", required_argument, NULL, OPT_GATEWAY_BIN },
        { "no-sched", no_argument, NULL, OPT_NO_SCHED },
        { "rank-base", required_argument, NULL, OPT_RANK_BASE },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };
    struct launch_opts *o = &l->o;
    struct stat st;
    int ch;

    o->n_prefill = 1;
    o->n_decode = 1;
    o->watchdog_ms = 30000;
    o->restart_ms = 1000;
    o->start_timeout_ms = 300000;
    o->stop_timeout_ms = 30000;
    while ((ch = getopt_long(argc, argv, "+f:o:P:D:Gw:r:T:t:vh", longopts, NULL)) != -1) {
        switch (ch) {
        case 'f': o->conf_path = optarg; break;
        case 'o':
            if (o->n_overrides >= LAUNCH_MAX_ARGS / 4) {
                fprintf(stderr, "dsv4-launch: at most %d -o\n", LAUNCH_MAX_ARGS / 4);
                exit(2);
            }
            o->overrides[o->n_overrides++] = optarg;
            break;
        case 'P': o->n_prefill = num_arg(optarg, 0, LAUNCH_MAX_RANKS / 2, "-P"); break;
        case 'D': o->n_decode = num_arg(optarg, 0, LAUNCH_MAX_RANKS / 2, "-D"); break;
        case 'G': o->gateway = true; break;
        case 'w': o->watchdog_ms = num_arg(optarg, 0, 86400, "-w") * 1000; break;
        case 'r': o->restart_ms = num_arg(optarg, 0, 3600000, "-r"); break;
        case 'T': o->start_timeout_ms = num_arg(optarg, 0, 86400, "-T") * 1000; break;
        case 't': o->stop_timeout_ms = num_arg(optarg, 1, 86400, "-t") * 1000; break;
        case 'v': o->verbose += o->verbose < 2; break;   /* -vv: debug, the most */
        case OPT_SCHED_BIN: o->bin[LAUNCH_SCHED] = optarg; break;
        case OPT_PREFILL_BIN: o->bin[LAUNCH_PREFILL] = optarg; break;
        case OPT_DECODE_BIN: o->bin[LAUNCH_DECODE] = optarg; break;
        case OPT_NOTIFY_LOG: o->notify_log = optarg; break;
        case OPT_GATEWAY_BIN: o->bin[LAUNCH_GATEWAY] = optarg; break;
        case OPT_NO_SCHED: o->no_sched = true; break;
        case OPT_RANK_BASE: o->rank_base = num_arg(optarg, 0, 65535 - LAUNCH_MAX_RANKS,
                                                   "--rank-base"); break;
        case 'h': usage(0);
        case DSV4_CLI_OPT_VERSION: dsv4_cli_version("dsv4-launch");
        default: usage(2);
        }
    }
    if (optind < argc)
        o->command = argv + optind;
    if (argc - optind > LAUNCH_MAX_ARGS) {   /* it would run with fewer than given */
        fprintf(stderr, "dsv4-launch: the command after -- has %d arguments, at most %d\n",
                argc - optind, LAUNCH_MAX_ARGS);
        usage(2);
    }
    if (o->no_sched && o->n_prefill == 0 && o->n_decode == 0) {
        fprintf(stderr, "dsv4-launch: --no-sched with -P 0 -D 0: nothing to run\n");
        usage(2);
    }
    /* two options that contradict: usage (gateway_launch = yes with
     * --no-sched stays the configuration's, 6, below) */
    if (o->no_sched && o->gateway) {
        fprintf(stderr, "dsv4-launch: -G with --no-sched: the gateway runs on the "
                "scheduler's host\n");
        usage(2);
    }
    if (o->conf_path == NULL && stat(DSV4_CONF_DEFAULT_PATH, &st) == 0)
        o->conf_path = DSV4_CONF_DEFAULT_PATH;
}

/* Read the configuration the daemons will read, for the endpoints. */
static void
load_conf(struct launch *l)
{
    int i;

    dsv4_conf_defaults(&l->conf);
    if (l->o.conf_path != NULL &&
        dsv4_conf_load(&l->conf, l->o.conf_path, DSV4_CONF_ROLE_SCHED) != DSV4_OK)
        fatalx_conf("%s", dsv4_errmsg());
    for (i = 0; i < l->o.n_overrides; i++)
        if (dsv4_conf_set_kv(&l->conf, l->o.overrides[i]) != DSV4_OK)
            fatalx_conf("-o %s", dsv4_errmsg());
    if (strcmp(l->conf.gateway_launch, "yes") == 0)
        l->o.gateway = true;
}

/* Block the signals we take through the signalfd. */
static int
signals_open(void)
{
    sigset_t set;
    int fd;

    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &set, NULL) != 0)
        fatal("sigprocmask");
    fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    if (fd < 0)
        fatal("signalfd");
    signal(SIGPIPE, SIG_IGN);
    return fd;
}

static void
begin_stop(struct launch *l, const char *why)
{
    if (l->stopping)
        return;
    log_notice("begin_stop: %s; stopping", why);
    sdnotify_stopping();
    proc_stop_set(l, launch_now_ms());
}

/* SIGHUP to the scheduler and the gateway, the children that reload.  A
 * child not ready (still starting, or reloading) may not handle SIGHUP yet
 * (its default action ends it): it gets the signal at its READY=1. */
static void
hup_reloaders(struct launch *l)
{
    int n = 0;

    for (int i = 0; i < l->n_kids; i++) {
        struct launch_child *k = &l->kids[i];

        if ((k->role != LAUNCH_SCHED && k->role != LAUNCH_GATEWAY) || k->pid == 0)
            continue;
        n++;
        if (!k->ready) {
            log_info("handle_signals: SIGHUP to %s once it is ready", k->name);
            k->hup_due = true;
            continue;
        }
        log_info("handle_signals: SIGHUP to %s", k->name);
        kill(k->pid, SIGHUP);
    }
    if (n == 0)
        log_info("handle_signals: SIGHUP ignored (neither a scheduler nor a gateway here)");
}

static void
handle_signals(struct launch *l)
{
    struct signalfd_siginfo si;

    while (read(l->sigfd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
        switch (si.ssi_signo) {
        case SIGCHLD:
            proc_reap(l);
            break;
        case SIGTERM:
        case SIGINT:
            l->exit_code = l->exit_code != 0 ? l->exit_code : 0;
            begin_stop(l, si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
            break;
        case SIGHUP:
            /* systemctl reload's part: the scheduler reloads its
             * configuration (sched_reload.c), the gateway its keys file;
             * ranks read theirs at start */
            hup_reloaders(l);
            break;
        }
    }
    /* SIGCHLD coalesces; reap anything not yet seen. */
    proc_reap(l);
}

/*
 * Whether a connection on the scheduler's listeners should start it again:
 * it exited cleanly after it had been ready (systemctl stop dsv4-sched, or
 * the stop half of a restart) and the set goes on.  With systemd,
 * dsv4-sched.socket stays listening and its next connection activates the
 * service; so here.  (A failed scheduler is restarted by its timer instead,
 * and one that gave up stopped the set.)
 */
static bool
sched_activatable(const struct launch *l)
{
    const struct launch_child *k = &l->kids[0];

    return !l->o.no_sched && !l->stopping && k->pid == 0 && k->ever_ready &&
        k->restart_at_ms == 0 && !k->gave_up;
}

/*
 * The loop.  Each iteration: wait for a signal, a notify datagram or the
 * nearest deadline; reap children and schedule restarts; apply notify
 * messages (READY, WATCHDOG, STOPPING, STATUS); fire timers (restarts, start
 * and watchdog timeouts, the stop timeout); start the next phase (ranks
 * after the scheduler, the command after everything).  Ends when stopping
 * and no child is left.
 */
static void
launch_loop(struct launch *l)
{
    struct pollfd pfd[6 + LAUNCH_MAX_RANKS];
    int64_t wait;
    int i, n, nl;

    for (;;) {
        proc_advance(l);
        wait = proc_timers(l, launch_now_ms());
        if (l->stopping && proc_running(l) == 0)
            return;
        pfd[0].fd = l->sigfd;
        pfd[0].events = POLLIN;
        for (i = 0, n = 1; i < l->n_kids; i++) {
            pfd[n].fd = l->kids[i].notify_fd;
            pfd[n++].events = POLLIN;
        }
        /* the listeners while the scheduler is down after a clean exit */
        nl = sched_activatable(l) ? 2 : 0;
        for (i = 0; i < nl; i++) {
            pfd[n + i].fd = l->listen_fd[i];
            pfd[n + i].events = POLLIN;
        }
        if (poll(pfd, n + nl, wait < 0 ? -1 : (int)(wait > 60000 ? 60000 : wait)) < 0 &&
            errno != EINTR)
            fatal("poll");
        if (pfd[0].revents & POLLIN)
            handle_signals(l);
        for (i = 0; i < l->n_kids; i++)
            if (pfd[1 + i].fd >= 0 && (pfd[1 + i].revents & POLLIN))
                proc_notify(l, &l->kids[i]);
        for (i = 0; i < nl; i++)
            if (pfd[n + i].fd >= 0 && (pfd[n + i].revents & POLLIN) && sched_activatable(l)) {
                log_notice("launch_loop: a connection on the %s listener: starting the "
                    "scheduler again (socket activation)", i == 0 ? "client" : "admin");
                proc_start(l, &l->kids[0]);
            }
    }
}

static void
cleanup(struct launch *l)
{
    int i;

    for (i = 0; i < l->n_kids; i++)
        if (l->kids[i].notify_fd >= 0) {
            close(l->kids[i].notify_fd);
            unlink(l->kids[i].notify_path);
        }
    for (i = 0; i < 2; i++) {
        if (l->listen_fd[i] >= 0)
            close(l->listen_fd[i]);
        if (l->listen_path[i][0] != '\0')
            unlink(l->listen_path[i]);
    }
    if (l->rundir[0] != '\0')
        rmdir(l->rundir);
    if (l->notify_log != NULL)
        fclose(l->notify_log);
}

int
main(int argc, char **argv)
{
    static struct launch l;
    const char *tmp;
    int i;

    log_init(0);
    log_procinit("launch");
    parse_args(&l, argc, argv);
    if (l.o.verbose > 0)
        log_init(l.o.verbose);
    load_conf(&l);
    l.sigfd = signals_open();
    l.self = getpid();
    l.listen_fd[0] = l.listen_fd[1] = -1;
    if (l.o.no_sched && l.o.gateway)
        fatalx_conf("--no-sched: the gateway runs on the scheduler's host");
    if (!l.o.no_sched)
        l.listen_fd[0] = sock_listen(l.conf.client_endpoint, LAUNCH_CLIENT_MODE,
        l.listen_path[0], sizeof(l.listen_path[0]));
    if (!l.o.no_sched)
        l.listen_fd[1] = sock_listen(l.conf.admin_endpoint, l.conf.admin_mode,
        l.listen_path[1], sizeof(l.listen_path[1]));
    if (!l.o.no_sched && (l.listen_fd[0] < 0 || l.listen_fd[1] < 0)) {
        bool conf = l.listen_fd[0] == LAUNCH_SOCK_CONFIG || l.listen_fd[1] == LAUNCH_SOCK_CONFIG;

        cleanup(&l);
        if (conf)
            fatalx_conf("cannot bind the scheduler's listeners: client_endpoint or "
                "admin_endpoint as configured");
        fatalx("cannot bind the scheduler's listeners");
    }
    if (l.o.notify_log != NULL &&
        (l.notify_log = fopen(l.o.notify_log, "ae")) == NULL)
        fatal("%s", l.o.notify_log);
    tmp = getenv("TMPDIR");
    snprintf(l.rundir, sizeof(l.rundir), "%s/dsv4-launch.XXXXXX",
        tmp != NULL && strlen(tmp) < 40 ? tmp : "/tmp");
    if (mkdtemp(l.rundir) == NULL) {
        l.rundir[0] = '\0';
        cleanup(&l);
        fatal("mkdtemp");
    }
    proc_setup(&l);
    for (i = 0; i < l.n_kids; i++)
        if (l.kids[i].role != LAUNCH_COMMAND && sock_notify_open(&l.kids[i], l.rundir) != 0) {
            cleanup(&l);
            fatalx("cannot create notify sockets");
        }
    if (!l.o.no_sched) {
        sdnotify_status("starting dsv4-sched");
        proc_start(&l, &l.kids[0]);
    }
    launch_loop(&l);
    cleanup(&l);
    /* 0 means a clean stop: not one that needed SIGKILL, or in which a
     * daemon failed (systemd would mark those units failed) */
    if (l.exit_code == 0 && l.stop_unclean) {
        log_warnx("main: the stop was not clean (a daemon killed or failed): exit 1");
        l.exit_code = 1;
    }
    log_info("main: stopped, exit %d", l.exit_code);
    return l.exit_code;
}
