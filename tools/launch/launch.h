/*
 * launch.h — dsv4-launch, the service manager for machines where systemd is
 * not PID 1 (containers, CI, a laptop): the table of contents of the program.
 *
 * It does for the dsv4 set what systemd does with units/: binds the client
 * and admin listeners of dsv4-sched.socket and passes them to the scheduler
 * as LISTEN_FDS/LISTEN_FDNAMES (names "client" and "admin"), gives every
 * child a NOTIFY_SOCKET of its own and waits for READY=1 (Type=notify),
 * starts the ranks once the scheduler is ready (After=), arms WATCHDOG_USEC
 * and kills a child that stops pinging (SIGABRT, WatchdogSec=), restarts a
 * child that failed (Restart=on-failure, RestartSec=, StartLimitBurst=), and
 * on SIGTERM/SIGINT stops everything (SIGTERM, then SIGKILL after the stop
 * timeout).  With a command after `--` it runs that command once the set is
 * ready and stops the set when it exits (exit status = the command's).
 *
 * One thread: a poll loop over a signalfd and the notify sockets with a
 * computed timeout (STYLE.md §7.10).  Invariant: a child slot has at most one
 * process; the listeners stay open in the launcher for its whole life, so a
 * restarted scheduler gets the same sockets and clients never see a refused
 * connection.
 */
#ifndef DSV4_TOOLS_LAUNCH_H
#define DSV4_TOOLS_LAUNCH_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/un.h>

#include "common/config_file.h"

#define LAUNCH_MAX_RANKS 64          /* prefill + decode ranks */
#define LAUNCH_MAX_ARGS 64           /* argv entries of one child */
#define LAUNCH_START_LIMIT_BURST 5   /* StartLimitBurst= */
#define LAUNCH_START_LIMIT_MS 10000  /* StartLimitIntervalSec= */
#define LAUNCH_CLIENT_MODE 0666      /* the client listener's file mode:
                                        dsv4-sched.socket's SocketMode= (the
                                        admin one's is admin_mode) */

/* What a child of the launcher is. */
enum launch_role {
    LAUNCH_SCHED = 0,
    LAUNCH_PREFILL,
    LAUNCH_DECODE,
    LAUNCH_COMMAND,                  /* the command after `--` (never restarted) */
    LAUNCH_GATEWAY,                  /* dsv4-gateway (-G, gateway_launch = yes);
                                        started with the ranks */
};

/* One supervised process slot. */
struct launch_child {
    enum launch_role role;
    int index;                       /* rank instance (--rank, %i); 0 for sched */
    char name[32];                   /* "sched", "decode@1", "command" */
    char *argv[LAUNCH_MAX_ARGS + 1];
    pid_t pid;                       /* 0 = not running */
    int notify_fd;                   /* its NOTIFY_SOCKET (bound, datagram) */
    char notify_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    bool ready;                      /* READY=1 since the last start (or reload) */
    bool started;                    /* READY=1 since the last start: an exit
                                        before it failed the start */
    bool ever_ready;
    bool stopping;                   /* STOPPING=1 seen */
    bool hup_due;                    /* a SIGHUP came while it was not ready
                                        (starting, reloading): sent at READY=1 */
    bool gave_up;                    /* start limit hit, or exit 2 / 6 */
    bool timed_out;                  /* killed for a start or watchdog timeout:
                                        a failure whatever the exit status */
    bool stop_due;                   /* STOPPING=1 outside a set stop: its
                                        watchdog_deadline_ms is the stop's
                                        (TimeoutStopSec=), then SIGKILL */
    int64_t start_deadline_ms;       /* READY expected by then; 0 = n/a */
    int64_t watchdog_deadline_ms;    /* next WATCHDOG=1 due; 0 = off */
    int64_t restart_at_ms;           /* 0 = no restart pending */
    int64_t starts_ms[LAUNCH_START_LIMIT_BURST]; /* ring of recent start times */
    int n_starts;
    int exit_status;                 /* last wait status */
};

/* Settings from the command line. */
struct launch_opts {
    const char *conf_path;           /* -f, or the default path if it exists; NULL */
    char *overrides[LAUNCH_MAX_ARGS];/* -o key=value, passed to every daemon */
    int n_overrides;
    int n_prefill, n_decode;         /* -P, -D */
    const char *bin[LAUNCH_GATEWAY + 1]; /* program paths by role (COMMAND unused) */
    bool gateway;                    /* -G: also run dsv4-gateway */
    int64_t watchdog_ms;             /* -w; 0 = no watchdog */
    int64_t restart_ms;              /* -r: RestartSec */
    int64_t start_timeout_ms;        /* -T: TimeoutStartSec */
    int64_t stop_timeout_ms;         /* -t: TimeoutStopSec */
    int verbose;                     /* -v count, passed on as -v */
    const char *notify_log;          /* --notify-log FILE: every notify message */
    bool no_sched;                   /* --no-sched: ranks only (a rank host of a
                                        multi-host deployment); no listeners */
    int rank_base;                   /* --rank-base N: first rank index (-P/-D
                                        ranks are N, N+1, ...) */
    char **command;                  /* after `--`; NULL = none */
};

/* The launcher: options, the listeners it hands to the scheduler, the
 * notify sockets' directory, its children and its stop state. */
struct launch {
    struct launch_opts o;
    struct dsv4_conf conf;           /* endpoints of the listeners */
    int listen_fd[2];                /* client, admin */
    char listen_path[2][sizeof(((struct sockaddr_un *)0)->sun_path)]; /* ipc: unlink */
    char rundir[64];                 /* notify sockets live here */
    int sigfd;
    struct launch_child kids[3 + LAUNCH_MAX_RANKS]; /* [0] sched (unless
                                        --no-sched), then ranks, the gateway,
                                        then the command */
    int n_kids;
    bool all_ready_once;             /* READY sent to our own manager */
    bool stopping;
    bool sched_term_due;             /* stopping: the scheduler gets SIGTERM once every
                                        other child has exited (systemd's order: the
                                        ranks finish their work while it serves) */
    int64_t stop_deadline_ms;        /* SIGKILL those left then, but a
                                        scheduler whose SIGTERM is still due;
                                        its SIGTERM sets it afresh (-t) */
    int exit_code;
    bool gave_up;                    /* a child's give-up set exit_code: the
                                        command's status does not replace it */
    bool stop_unclean;               /* the set's stop needed SIGKILL, or a
                                        daemon failed while it stopped: exit 1
                                        where it would be 0 */
    pid_t self;                      /* the launcher's pid (its children's
                                        parent; 1 in a container) */
    FILE *notify_log;
};

/* --- launch.c ----------------------------------------------------------- */

/* CLOCK_MONOTONIC in milliseconds (every deadline of the launcher). */
int64_t launch_now_ms(void);

/* --- launch_sock.c: listeners and notify sockets ------------------------ */

/* What sock_listen returns when the configuration is at fault: the
 * endpoint's form (not ipc://PATH or tcp://HOST:PORT, no port, a path too
 * long for a unix socket), a host name that does not resolve, a parent
 * directory that cannot be made (exit status 6, DSV4_EXIT_CONFIG). */
#define LAUNCH_SOCK_CONFIG (-2)

/* Bind and listen on `endpoint` (ipc://PATH or tcp://HOST:PORT); for ipc://
 * unlink a stale file first, create the parent directory, chmod to `mode`
 * when not 0 and record the path in `path_out` (else ""); CLOEXEC.  Returns
 * the fd; LAUNCH_SOCK_CONFIG, or -1 for any other failure (an address in
 * use, a system error), with the reason logged. */
int sock_listen(const char *endpoint, unsigned mode, char *path_out, size_t path_len);

/* Bind a datagram unix socket for child `k`'s NOTIFY_SOCKET in `dir`. */
int sock_notify_open(struct launch_child *k, const char *dir);

/* Read one pending notify datagram of `k` into buf (NUL-terminated);
 * returns its length, or -1 when nothing was waiting. */
ssize_t sock_notify_recv(struct launch_child *k, char *buf, size_t size);

/* --- launch_proc.c: child processes ------------------------------------- */

/* Fill the slots (sched, prefill@0.., decode@0.., gateway, command) from the
 * options. */
void proc_setup(struct launch *l);

/* Fork and exec child `k` with its environment (NOTIFY_SOCKET, LISTEN_*,
 * WATCHDOG_*); the child dies with the launcher (PR_SET_PDEATHSIG). */
void proc_start(struct launch *l, struct launch_child *k);

/* Reap exited children; schedule restarts of failed ones (on-failure);
 * note the command's exit. */
void proc_reap(struct launch *l);

/* Handle the notify messages waiting on k's socket. */
void proc_notify(struct launch *l, struct launch_child *k);

/* Deadlines: start timeouts, watchdogs, restarts, stop timeout.  Returns
 * ms until the next one (-1 = none). */
int64_t proc_timers(struct launch *l, int64_t now);

/* Send `sig` to every running child (rank first, then the scheduler). */
void proc_signal_all(struct launch *l, int sig);

/* Stop the set: stopping from now on, SIGTERM to every child but the
 * scheduler, to the scheduler once the others have exited (as systemd
 * orders the units' stops), SIGKILL to those left at now + the stop
 * timeout (-t).  As systemd's TimeoutStopSec= is per unit, the scheduler
 * is never killed before its SIGTERM, and gets the whole stop timeout
 * from its SIGTERM on. */
void proc_stop_set(struct launch *l, int64_t now);

/* Number of running children. */
int proc_running(const struct launch *l);

/* Start the set's next phase: ranks once the scheduler is ready, the
 * command once everything is ready. */
void proc_advance(struct launch *l);

#endif
