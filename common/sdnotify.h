/*
 * sdnotify.h — the systemd notify protocol for the dsv4 daemons (scheduler,
 * prefill and decode ranks), a thin wrapper over libsystemd's sd_notify(3).
 *
 * Every function is a no-op when $NOTIFY_SOCKET is unset (a daemon started by
 * hand or by a test without a listener), and the return value of sd_notify is
 * ignored: failing to notify must never stop a daemon from serving.  Under
 * systemd (Type=notify, NotifyAccess=main) or dsv4-launch, which implements the
 * same datagram protocol, the service manager sees:
 *
 *   STATUS=...        progress while loading weights / binding sockets
 *   READY=1           once weights are resident and sockets bound
 *   WATCHDOG=1        from the main loop, every sdnotify_watchdog_interval_us
 *   STOPPING=1        on SIGTERM, before the shutdown work starts
 *
 * Main thread only (sd_notify itself is thread-safe, but the order of the
 * messages is part of the contract and only one thread should own it).
 */
#ifndef DSV4_COMMON_SDNOTIFY_H
#define DSV4_COMMON_SDNOTIFY_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Tell the manager the service can serve: "READY=1" plus the current PID
 * ("MAINPID=") so a manager that forked through a wrapper knows the daemon. */
void sdnotify_ready(void);

/* Free-form one-line status ("STATUS=loading layer 3/43"), printf format.
 * Shown by `systemctl status`; truncated at 255 bytes. */
void sdnotify_status(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));

/* Watchdog keep-alive ("WATCHDOG=1").  Call from the main loop at the
 * interval returned by sdnotify_watchdog_interval_us(). */
void sdnotify_watchdog(void);

/* The service is shutting down ("STOPPING=1"); sent once on SIGTERM. */
void sdnotify_stopping(void);

/* The service is reloading its configuration ("RELOADING=1" with the
 * CLOCK_MONOTONIC time); follow with sdnotify_ready() when done. */
void sdnotify_reloading(void);

/* Ask the manager for `usec` more microseconds of start/stop timeout
 * ("EXTEND_TIMEOUT_USEC="), for a long phase such as loading weights. */
void sdnotify_extend_timeout(uint64_t usec);

/*
 * How often the main loop must call sdnotify_watchdog(), in microseconds:
 * half of $WATCHDOG_USEC when the manager enabled the watchdog for this
 * process (sd_watchdog_enabled(3), which also checks $WATCHDOG_PID), 0 when
 * no watchdog is expected.  Cheap; callers may cache it at startup.
 */
uint64_t sdnotify_watchdog_interval_us(void);

#ifdef __cplusplus
}
#endif
#endif
