/*
 * launch_proc.c — dsv4-launch's child processes: start with the systemd
 * environment, notify messages, watchdogs, Restart=on-failure with a start
 * limit, and stopping.  Semantics follow systemd.service(5) for Type=notify
 * units; see launch.h for the mapping.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/cli.h"
#include "common/log.h"
#include "common/sdnotify.h"
#include "tools/launch/launch.h"

#define LISTEN_FDS_START 3  /* SD_LISTEN_FDS_START */

static const char *const role_prog[] = { "dsv4-sched", "dsv4-prefill", "dsv4-decode" };

/* Append one argv entry (strdup'ed); the set is fixed at startup. */
static void
argv_add(struct launch_child *k, int *n, const char *s)
{
    if (*n >= LAUNCH_MAX_ARGS)
        fatalx("proc_setup: too many arguments for %s", k->name);
    if ((k->argv[(*n)++] = strdup(s)) == NULL)
        fatal("proc_setup: strdup");
    k->argv[*n] = NULL;
}

static void
proc_setup_daemon(struct launch *l, struct launch_child *k, enum launch_role role,
    int index)
{
    char buf[32];
    int n = 0, i;

    k->role = role;
    k->index = index;
    if (role == LAUNCH_SCHED || role == LAUNCH_GATEWAY)
        snprintf(k->name, sizeof(k->name), role == LAUNCH_SCHED ? "sched" : "gateway");
    else
        snprintf(k->name, sizeof(k->name), "%s@%d",
            role == LAUNCH_PREFILL ? "prefill" : "decode", index);
    argv_add(k, &n, l->o.bin[role] != NULL ? l->o.bin[role] :
        role == LAUNCH_GATEWAY ? "dsv4-gateway" : role_prog[role]);
    if (l->o.conf_path != NULL) {
        argv_add(k, &n, "-f");
        argv_add(k, &n, l->o.conf_path);
    }
    if (role == LAUNCH_PREFILL || role == LAUNCH_DECODE) {
        snprintf(buf, sizeof(buf), "%d", index);
        argv_add(k, &n, "--rank");
        argv_add(k, &n, buf);
    }
    for (i = 0; i < l->o.n_overrides; i++) {
        argv_add(k, &n, "-o");
        argv_add(k, &n, l->o.overrides[i]);
    }
    for (i = 0; i < l->o.verbose; i++)
        argv_add(k, &n, "-v");
}

void
proc_setup(struct launch *l)
{
    struct launch_child *k;
    int i, n = 0;

    if (!l->o.no_sched)
        proc_setup_daemon(l, &l->kids[n++], LAUNCH_SCHED, 0);
    for (i = 0; i < l->o.n_prefill; i++)
        proc_setup_daemon(l, &l->kids[n++], LAUNCH_PREFILL, l->o.rank_base + i);
    for (i = 0; i < l->o.n_decode; i++)
        proc_setup_daemon(l, &l->kids[n++], LAUNCH_DECODE, l->o.rank_base + i);
    if (l->o.gateway)
        proc_setup_daemon(l, &l->kids[n++], LAUNCH_GATEWAY, 0);
    if (l->o.command != NULL) {
        k = &l->kids[n++];
        k->role = LAUNCH_COMMAND;
        snprintf(k->name, sizeof(k->name), "command");
        for (i = 0; l->o.command[i] != NULL && i < LAUNCH_MAX_ARGS; i++)
            k->argv[i] = l->o.command[i];
        k->argv[i] = NULL;
    }
    l->n_kids = n;
    for (i = 0; i < n; i++)
        l->kids[i].notify_fd = -1;
}

/* In the forked child: set up fds, environment and signals, then exec.
 * Only async-signal-safe-ish calls matter little here: the launcher is
 * single-threaded, so the child may use setenv and snprintf. */
static void __attribute__((noreturn))
proc_exec(struct launch *l, struct launch_child *k)
{
    char buf[64];
    sigset_t none;
    int fd0, fd1;

    /* a daemon in a process group of its own: a terminal's SIGHUP or SIGINT
     * (its session closed, Ctrl-C) reaches the launcher, which stops or
     * reloads as documented, not the ranks (a rank killed by SIGHUP counted
     * as a clean exit and was never restarted).  The command stays in the
     * launcher's group, the terminal's foreground.  Set before any signal
     * is let in (a Ctrl-C between fork and exec reached it), and by the
     * parent as well, whichever runs first. */
    if (k->role != LAUNCH_COMMAND)
        (void)setpgid(0, 0);
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    prctl(PR_SET_PDEATHSIG, k->role == LAUNCH_COMMAND ? SIGHUP : SIGTERM);
    /* the launcher died before the prctl: no one would stop us (compared
     * with its pid, not 1: a launcher that is PID 1, a container's entry
     * point, is every child's parent) */
    if (getppid() != l->self)
        _exit(1);
    /* the launcher ignores SIGPIPE (as systemd's IgnoreSIGPIPE= does for
     * the daemons); the command gets the default, as from a shell */
    if (k->role == LAUNCH_COMMAND)
        signal(SIGPIPE, SIG_DFL);
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_FDNAMES");
    unsetenv("LISTEN_PID");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
    if (k->role == LAUNCH_SCHED) {
        /* Move the listeners out of the way, then onto 3 and 4 (dup2
         * clears FD_CLOEXEC). */
        fd0 = fcntl(l->listen_fd[0], F_DUPFD_CLOEXEC, 16);
        fd1 = fcntl(l->listen_fd[1], F_DUPFD_CLOEXEC, 16);
        if (fd0 < 0 || fd1 < 0 || dup2(fd0, LISTEN_FDS_START) < 0 ||
            dup2(fd1, LISTEN_FDS_START + 1) < 0)
            _exit(127);
        snprintf(buf, sizeof(buf), "%ld", (long)getpid());
        setenv("LISTEN_PID", buf, 1);
        setenv("LISTEN_FDS", "2", 1);
        setenv("LISTEN_FDNAMES", "client:admin", 1);
    }
    if (k->role != LAUNCH_COMMAND) {
        setenv("NOTIFY_SOCKET", k->notify_path, 1);
        if (l->o.watchdog_ms > 0) {
            snprintf(buf, sizeof(buf), "%lld", (long long)l->o.watchdog_ms * 1000);
            setenv("WATCHDOG_USEC", buf, 1);
            snprintf(buf, sizeof(buf), "%ld", (long)getpid());
            setenv("WATCHDOG_PID", buf, 1);
        }
    } else {
        unsetenv("NOTIFY_SOCKET");
        setenv("DSV4_ENDPOINT", l->conf.client_endpoint, 1);
        setenv("DSV4_ADMIN_ENDPOINT", l->conf.admin_endpoint, 1);
    }
    execvp(k->argv[0], k->argv);
    fprintf(stderr, "dsv4-launch: exec %s: %s\n", k->argv[0], strerror(errno));
    _exit(127);
}

void
proc_start(struct launch *l, struct launch_child *k)
{
    int64_t now = launch_now_ms();
    char buf[256];
    pid_t pid;

    /* Drop notify messages left from the previous process. */
    if (k->notify_fd >= 0)
        while (sock_notify_recv(k, buf, sizeof(buf)) >= 0)
            ;
    pid = fork();
    if (pid < 0) {
        log_warn("proc_start: fork %s", k->name);
        k->restart_at_ms = now + l->o.restart_ms;
        return;
    }
    if (pid == 0)
        proc_exec(l, k);
    if (k->role != LAUNCH_COMMAND)
        (void)setpgid(pid, pid);   /* (EACCES once it has exec'd: set by then) */
    k->pid = pid;
    k->ready = false;
    k->started = false;
    k->stopping = false;
    k->hup_due = false;      /* a new process reads the configuration anyway */
    k->timed_out = false;
    k->stop_due = false;
    k->restart_at_ms = 0;
    k->watchdog_deadline_ms = 0;
    k->start_deadline_ms = k->role == LAUNCH_COMMAND || l->o.start_timeout_ms == 0 ?
        0 : now + l->o.start_timeout_ms;
    k->starts_ms[k->n_starts++ % LAUNCH_START_LIMIT_BURST] = now;
    log_info("proc_start: %s pid=%ld", k->name, (long)pid);
    if (l->notify_log != NULL) {
        fprintf(l->notify_log, "%s START pid=%ld\n", k->name, (long)pid);
        fflush(l->notify_log);
    }
}

/* Restart=on-failure: anything but a clean exit (status 0 or the clean
 * signals SIGHUP, SIGINT, SIGTERM, SIGPIPE) is a failure; so is any exit
 * before READY=1 and any after a timeout (proc_exited), which does not
 * restart statuses 2 and 6 (RestartPreventExitStatus=). */
static bool
proc_failed(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status) != 0;
    if (WIFSIGNALED(status)) {
        switch (WTERMSIG(status)) {
        case SIGHUP: case SIGINT: case SIGTERM: case SIGPIPE:
            return false;
        }
    }
    return true;
}

static void proc_stop_sched(struct launch *l);

static void
proc_exited(struct launch *l, struct launch_child *k, int status)
{
    int64_t now = launch_now_ms();
    int64_t oldest;
    int give_up = 0;
    char how[64];

    k->pid = 0;
    k->ready = false;
    k->exit_status = status;
    if (WIFEXITED(status))
        snprintf(how, sizeof(how), "exit=%d", WEXITSTATUS(status));
    else
        snprintf(how, sizeof(how), "signal=%d", WTERMSIG(status));
    if (l->notify_log != NULL) {
        fprintf(l->notify_log, "%s EXIT %s\n", k->name, how);
        fflush(l->notify_log);
    }
    if (k->role == LAUNCH_COMMAND) {
        log_info("proc_exited: command %s", how);
        /* a child that gave up stopped the set (and so the command): the
         * set's status is the give-up's */
        if (!l->gave_up)
            l->exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (!l->stopping)
            proc_stop_set(l, now);
        else
            proc_stop_sched(l);
        return;
    }
    if (l->stopping) {
        log_info("proc_exited: %s %s (stopping)", k->name, how);
        /* systemd marks a unit failed that fails while it stops */
        if (proc_failed(status) || k->timed_out) {
            log_warnx("proc_exited: %s failed while the set stopped", k->name);
            l->stop_unclean = true;
        }
        proc_stop_sched(l);
        return;
    }
    if (!proc_failed(status) && !k->timed_out) {
        if (k->started) {
            log_notice("proc_exited: %s %s; not restarted (clean exit)", k->name, how);
            return;
        }
        /* A Type=notify service whose process ends before READY=1 failed
         * its start, whatever the status (systemd's result "protocol"). */
        log_warnx("proc_exited: %s %s before READY=1: a failed start", k->name, how);
    }
    /* Give up on the child and stop the set with give_up as the exit status:
     * RestartPreventExitStatus=2 6 (the units'), a usage or configuration
     * fault failing the same way at every start; StartLimitBurst= starts
     * within StartLimitIntervalSec=, 1. */
    oldest = k->starts_ms[k->n_starts % LAUNCH_START_LIMIT_BURST];
    if (WIFEXITED(status) && (WEXITSTATUS(status) == DSV4_EXIT_USAGE ||
                              WEXITSTATUS(status) == DSV4_EXIT_CONFIG)) {
        give_up = WEXITSTATUS(status);
        log_warnx("proc_exited: %s %s (%s); not restarted, stopping the set", k->name, how,
            give_up == DSV4_EXIT_USAGE ? "usage" : "its configuration");
    } else if (k->n_starts >= LAUNCH_START_LIMIT_BURST && now - oldest < LAUNCH_START_LIMIT_MS) {
        give_up = 1;
        log_warnx("proc_exited: %s %s; start limit hit, stopping the set", k->name, how);
    }
    if (give_up != 0) {
        k->gave_up = true;
        l->gave_up = true;
        l->exit_code = give_up;
        proc_stop_set(l, now);
        return;
    }
    log_warnx("proc_exited: %s %s; restart in %lld ms", k->name, how,
        (long long)l->o.restart_ms);
    k->restart_at_ms = now + (l->o.restart_ms > 0 ? l->o.restart_ms : 1);
}

void
proc_reap(struct launch *l)
{
    pid_t pid;
    int status, i;

    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (i = 0; i < l->n_kids; i++)
            if (l->kids[i].pid == pid) {
                /* what it sent before it ended counts first: a READY=1
                 * queued beside the SIGCHLD makes its exit 0 a clean one */
                if (l->kids[i].role != LAUNCH_COMMAND)
                    proc_notify(l, &l->kids[i]);
                proc_exited(l, &l->kids[i], status);
                break;
            }
    }
}

/*
 * EXTEND_TIMEOUT_USEC=v (sd_notify(3)): the child must send its next
 * message within v µs, and the timeout of its current state does not fire
 * before then.  As systemd, an extension never brings a deadline nearer:
 * the start timeout (-T) stands until now + v passes it, and so does the
 * watchdog's (or, after a timeout's SIGTERM, the stop timeout's) deadline.
 * While the set stops, the set's stop deadline (-t) is extended the same
 * way: one deadline for every child, so a child still finishing its work
 * keeps the others' SIGKILL away too (they have their SIGTERM).  A value
 * that is not a number is ignored.
 */
static void
proc_extend(struct launch *l, struct launch_child *k, const char *value, int64_t now)
{
    char *end;
    long long us;
    int64_t until;

    errno = 0;
    us = strtoll(value, &end, 10);
    if (end == value || *end != '\0' || errno != 0 || us < 0) {
        log_debug("proc_notify: %s: EXTEND_TIMEOUT_USEC=%s ignored", k->name, value);
        return;
    }
    until = now + us / 1000;
    if (l->stopping) {
        if (until > l->stop_deadline_ms) {
            log_info("proc_notify: %s extends the stop timeout by %lld ms", k->name,
                (long long)(until - l->stop_deadline_ms));
            l->stop_deadline_ms = until;
        }
        return;
    }
    if (k->start_deadline_ms != 0) {
        if (until > k->start_deadline_ms)
            k->start_deadline_ms = until;
    } else if (k->watchdog_deadline_ms != 0 && until > k->watchdog_deadline_ms) {
        k->watchdog_deadline_ms = until;
    }
}

/* Apply one "KEY=VALUE" line of a notify message. */
static void
proc_notify_line(struct launch *l, struct launch_child *k, const char *line)
{
    int64_t now = launch_now_ms();

    if (strcmp(line, "READY=1") == 0) {
        if (!k->ready)
            log_info("proc_notify: %s ready", k->name);
        k->ready = true;
        k->started = true;
        k->ever_ready = true;
        k->start_deadline_ms = 0;
        if (l->o.watchdog_ms > 0)
            k->watchdog_deadline_ms = now + l->o.watchdog_ms;
        if (k->hup_due && !l->stopping) {
            /* a reload asked while it started (systemd queues the reload
             * job after the start job) */
            log_info("proc_notify: %s ready: the SIGHUP held back goes out", k->name);
            kill(k->pid, SIGHUP);
        }
        k->hup_due = false;
    } else if (strcmp(line, "WATCHDOG=1") == 0) {
        /* while it runs, a reload (RELOADING=1 .. READY=1) included, as
         * systemd counts them; not once it stops */
        if (l->o.watchdog_ms > 0 && k->watchdog_deadline_ms != 0 && !k->stopping)
            k->watchdog_deadline_ms = now + l->o.watchdog_ms;
    } else if (strcmp(line, "STOPPING=1") == 0) {
        k->stopping = true;
        k->watchdog_deadline_ms = 0;
        /* stopping on its own (a SIGTERM from elsewhere): systemd's
         * TimeoutStopSec= from here on, then SIGKILL, a failure; in a set
         * stop, the set's deadline rules */
        if (!l->stopping && !k->stop_due) {
            k->stop_due = true;
            k->watchdog_deadline_ms = now + l->o.stop_timeout_ms;
        }
    } else if (strncmp(line, "STATUS=", 7) == 0) {
        log_info("proc_notify: %s: %s", k->name, line + 7);
    } else if (strncmp(line, "EXTEND_TIMEOUT_USEC=", 20) == 0) {
        proc_extend(l, k, line + 20, now);
    } else if (strcmp(line, "RELOADING=1") == 0) {
        k->ready = false;
    }
}

void
proc_notify(struct launch *l, struct launch_child *k)
{
    char buf[4096], *line, *save;

    while (sock_notify_recv(k, buf, sizeof(buf)) >= 0) {
        if (l->notify_log != NULL) {
            fprintf(l->notify_log, "%s NOTIFY ", k->name);
            for (line = buf; *line != '\0'; line++)
                fputc(*line == '\n' ? ' ' : *line, l->notify_log);
            fputc('\n', l->notify_log);
            fflush(l->notify_log);
        }
        if (k->pid == 0)
            continue;    /* from a process already reaped */
        for (line = strtok_r(buf, "\n", &save); line != NULL;
            line = strtok_r(NULL, "\n", &save))
            proc_notify_line(l, k, line);
    }
}

int64_t
proc_timers(struct launch *l, int64_t now)
{
    struct launch_child *k;
    int64_t next = -1, t;
    int i;

#define NEXT(d) do { t = (d) - now; if (t < 0) t = 0; \
    if (next < 0 || t < next) next = t; } while (0)
    if (l->stopping) {
        if (now >= l->stop_deadline_ms) {
            /* systemd's TimeoutStopSec= is per unit: a scheduler still
             * waiting for its SIGTERM (the others have not exited) is not
             * killed; its SIGTERM brings it a stop timeout of its own */
            log_warnx("proc_timers: stop timeout; killing what is left%s",
                l->sched_term_due ? " but the scheduler (its SIGTERM is still due)" : "");
            for (i = l->n_kids - 1; i >= 0; i--)
                if (l->kids[i].pid != 0 && !(i == 0 && l->sched_term_due)) {
                    log_warnx("proc_timers: SIGKILL %s", l->kids[i].name);
                    kill(l->kids[i].pid, SIGKILL);
                    l->stop_unclean = true;
                }
            l->stop_deadline_ms = now + 1000;
        }
        NEXT(l->stop_deadline_ms);
        return next;
    }
    for (i = 0; i < l->n_kids; i++) {
        k = &l->kids[i];
        if (k->pid == 0 && k->restart_at_ms != 0) {
            if (now >= k->restart_at_ms)
                proc_start(l, k);
            else
                NEXT(k->restart_at_ms);
        }
        if (k->pid == 0)
            continue;
        if (k->start_deadline_ms != 0 && now >= k->start_deadline_ms) {
            log_warnx("proc_timers: %s not ready in time; SIGTERM", k->name);
            kill(k->pid, SIGTERM);
            k->start_deadline_ms = 0;
            /* systemd counts a start timeout as a failure, whatever the
             * exit status; SIGKILL if it does not stop either. */
            k->timed_out = true;
            k->watchdog_deadline_ms = now + l->o.stop_timeout_ms;
        } else if (k->start_deadline_ms != 0)
            NEXT(k->start_deadline_ms);
        if (k->watchdog_deadline_ms != 0 && now >= k->watchdog_deadline_ms) {
            bool kill9 = k->timed_out || k->stop_due;

            if (kill9)
                log_warnx("proc_timers: %s did not stop in time; SIGKILL", k->name);
            else
                log_warnx("proc_timers: %s watchdog timeout; SIGABRT", k->name);
            kill(k->pid, kill9 ? SIGKILL : SIGABRT);
            k->timed_out = true;
            k->watchdog_deadline_ms = now + l->o.stop_timeout_ms;
            k->ready = false;
        }
        if (k->watchdog_deadline_ms != 0)
            NEXT(k->watchdog_deadline_ms);
    }
#undef NEXT
    return next;
}

void
proc_signal_all(struct launch *l, int sig)
{
    int i;

    for (i = l->n_kids - 1; i >= 0; i--)
        if (l->kids[i].pid != 0) {
            if (sig == SIGKILL)
                log_warnx("proc_signal_all: SIGKILL %s", l->kids[i].name);
            kill(l->kids[i].pid, sig);
        }
}

/* Stopping: SIGTERM to the scheduler once it is the last child running. */
static void
proc_stop_sched(struct launch *l)
{
    if (!l->sched_term_due || proc_running(l) > (l->kids[0].pid != 0))
        return;
    l->sched_term_due = false;
    if (l->kids[0].pid != 0) {
        kill(l->kids[0].pid, SIGTERM);
        /* its own stop timeout from its SIGTERM on (TimeoutStopSec= of
         * dsv4-sched.service), however long the ranks took */
        l->stop_deadline_ms = launch_now_ms() + l->o.stop_timeout_ms;
    }
}

void
proc_stop_set(struct launch *l, int64_t now)
{
    l->stopping = true;
    l->stop_deadline_ms = now + l->o.stop_timeout_ms;
    if (l->o.no_sched) {
        proc_signal_all(l, SIGTERM);
        return;
    }
    for (int i = l->n_kids - 1; i >= 1; i--)
        if (l->kids[i].pid != 0)
            kill(l->kids[i].pid, SIGTERM);
    l->sched_term_due = true;
    proc_stop_sched(l);
}

int
proc_running(const struct launch *l)
{
    int i, n = 0;

    for (i = 0; i < l->n_kids; i++)
        n += l->kids[i].pid != 0;
    return n;
}

void
proc_advance(struct launch *l)
{
    struct launch_child *k;
    bool ranks_started = false, all_ready = true;
    int first = l->o.no_sched ? 0 : 1;  /* kids[0] is the scheduler unless --no-sched */
    int i, n_ranks = 0;                 /* ranks and gateway: started after the scheduler */

    if (l->stopping)
        return;
    for (i = first; i < l->n_kids; i++) {
        k = &l->kids[i];
        if (k->role == LAUNCH_COMMAND)
            continue;
        n_ranks++;
        if (k->pid != 0 || k->n_starts > 0)
            ranks_started = true;
        if (!k->ever_ready)
            all_ready = false;
    }
    if (!l->o.no_sched && !l->kids[0].ever_ready)
        return;
    /* (with no rank, -P 0 -D 0, the scheduler alone is the set) */
    if (!ranks_started && n_ranks > 0) {
        for (i = first; i < l->n_kids; i++)
            if (l->kids[i].role != LAUNCH_COMMAND)
                proc_start(l, &l->kids[i]);
        return;
    }
    if (all_ready && !l->all_ready_once) {
        l->all_ready_once = true;
        log_notice("proc_advance: ready: %d process(es); client %s admin %s",
            proc_running(l), l->conf.client_endpoint, l->conf.admin_endpoint);
        sdnotify_status("%d process(es) running", proc_running(l));
        sdnotify_ready();
        k = &l->kids[l->n_kids - 1];
        if (k->role == LAUNCH_COMMAND)
            proc_start(l, k);
    }
}
