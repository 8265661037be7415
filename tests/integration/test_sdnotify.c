/*
 * test_sdnotify.c — common/sdnotify against a NOTIFY_SOCKET listener bound
 * by the test itself: each call must produce exactly its datagram, nothing
 * is sent without NOTIFY_SOCKET, and the watchdog interval is half of
 * WATCHDOG_USEC only when WATCHDOG_PID names this process.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/sdnotify.h"

struct listener {
    int fd;
    char path[108];
};

static void
listener_open(struct listener *l)
{
    struct sockaddr_un sa;

    snprintf(l->path, sizeof(l->path), "/tmp/dsv4-sdn-%ld.sock",
        (long)getpid());
    unlink(l->path);
    l->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    assert_true(l->fd >= 0);
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    strcpy(sa.sun_path, l->path);
    assert_int_equal(bind(l->fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    setenv("NOTIFY_SOCKET", l->path, 1);
}

static void
listener_close(struct listener *l)
{
    close(l->fd);
    unlink(l->path);
    unsetenv("NOTIFY_SOCKET");
}

/* Receive one datagram (waiting at most timeout_ms); "" when none came. */
static void
listener_recv(struct listener *l, char *buf, size_t size, int timeout_ms)
{
    struct pollfd p = { .fd = l->fd, .events = POLLIN };
    ssize_t n;

    buf[0] = '\0';
    if (poll(&p, 1, timeout_ms) != 1)
        return;
    n = recv(l->fd, buf, size - 1, 0);
    assert_true(n >= 0);
    buf[n] = '\0';
}

static void
test_sequence(void **state)
{
    struct listener l;
    char buf[512], want[64];

    (void)state;
    listener_open(&l);
    sdnotify_status("loading layer %d/%d", 3, 43);
    listener_recv(&l, buf, sizeof(buf), 2000);
    assert_string_equal(buf, "STATUS=loading layer 3/43");
    sdnotify_ready();
    listener_recv(&l, buf, sizeof(buf), 2000);
    snprintf(want, sizeof(want), "READY=1\nMAINPID=%ld", (long)getpid());
    assert_string_equal(buf, want);
    sdnotify_watchdog();
    listener_recv(&l, buf, sizeof(buf), 2000);
    assert_string_equal(buf, "WATCHDOG=1");
    sdnotify_extend_timeout(5000000);
    listener_recv(&l, buf, sizeof(buf), 2000);
    assert_string_equal(buf, "EXTEND_TIMEOUT_USEC=5000000");
    sdnotify_reloading();
    listener_recv(&l, buf, sizeof(buf), 2000);
    assert_true(strncmp(buf, "RELOADING=1\nMONOTONIC_USEC=", 27) == 0);
    sdnotify_stopping();
    listener_recv(&l, buf, sizeof(buf), 2000);
    assert_string_equal(buf, "STOPPING=1");
    /* NOTIFY_SOCKET was not consumed by the calls. */
    assert_non_null(getenv("NOTIFY_SOCKET"));
    listener_close(&l);
}

static void
test_no_socket(void **state)
{
    struct listener l;
    char buf[64];

    (void)state;
    listener_open(&l);
    unsetenv("NOTIFY_SOCKET");
    sdnotify_ready();
    sdnotify_watchdog();
    listener_recv(&l, buf, sizeof(buf), 200);
    assert_string_equal(buf, "");
    listener_close(&l);
}

static void
test_watchdog_interval(void **state)
{
    char pid[32];

    (void)state;
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
    assert_int_equal(sdnotify_watchdog_interval_us(), 0);
    setenv("WATCHDOG_USEC", "3000000", 1);
    assert_int_equal(sdnotify_watchdog_interval_us(), 1500000);
    snprintf(pid, sizeof(pid), "%ld", (long)getpid());
    setenv("WATCHDOG_PID", pid, 1);
    assert_int_equal(sdnotify_watchdog_interval_us(), 1500000);
    snprintf(pid, sizeof(pid), "%ld", (long)getpid() + 1);
    setenv("WATCHDOG_PID", pid, 1);
    assert_int_equal(sdnotify_watchdog_interval_us(), 0);
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sequence),
        cmocka_unit_test(test_no_socket),
        cmocka_unit_test(test_watchdog_interval),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
