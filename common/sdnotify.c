/*
 * sdnotify.c — see sdnotify.h.  All messages go through sd_notify(3) with
 * unset_environment = 0, so a daemon that re-reads the environment later (or
 * a child it spawns for a self-test) still finds $NOTIFY_SOCKET.
 */
#include "common/sdnotify.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

/* Send one state string; a missing NOTIFY_SOCKET makes this a no-op. */
static void
sdnotify_send(const char *state)
{
    if (getenv("NOTIFY_SOCKET") == NULL)
        return;
    (void)sd_notify(0, state);
}

void
sdnotify_ready(void)
{
    char buf[64];

    snprintf(buf, sizeof(buf), "READY=1\nMAINPID=%ld", (long)getpid());
    sdnotify_send(buf);
}

void
sdnotify_status(const char *fmt, ...)
{
    char buf[sizeof("STATUS=") + 255];
    va_list ap;
    int n;

    n = snprintf(buf, sizeof(buf), "STATUS=");
    va_start(ap, fmt);
    vsnprintf(buf + n, sizeof(buf) - n, fmt, ap);
    va_end(ap);
    sdnotify_send(buf);
}

void
sdnotify_watchdog(void)
{
    sdnotify_send("WATCHDOG=1");
}

void
sdnotify_stopping(void)
{
    sdnotify_send("STOPPING=1");
}

void
sdnotify_reloading(void)
{
    struct timespec ts;
    char buf[96];
    unsigned long long us;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    us = (unsigned long long)ts.tv_sec * 1000000ULL +
        (unsigned long long)ts.tv_nsec / 1000ULL;
    snprintf(buf, sizeof(buf), "RELOADING=1\nMONOTONIC_USEC=%llu", us);
    sdnotify_send(buf);
}

void
sdnotify_extend_timeout(uint64_t usec)
{
    char buf[64];

    snprintf(buf, sizeof(buf), "EXTEND_TIMEOUT_USEC=%llu",
        (unsigned long long)usec);
    sdnotify_send(buf);
}

uint64_t
sdnotify_watchdog_interval_us(void)
{
    uint64_t usec = 0;

    if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0)
        return 0;
    return usec / 2 > 0 ? usec / 2 : 1;
}
