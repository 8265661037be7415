/*
 * fake_sched_main.c — `fake_sched ENDPOINT`: run the stand-in scheduler
 * (fake_sched.h) until SIGTERM/SIGINT.  Used by
 * the Python client test.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "tests/ipc/fake_sched.h"

static atomic_int stop_flag;

static void
on_signal(int sig)
{
    (void)sig;
    atomic_store(&stop_flag, 1);
}

int
main(int argc, char **argv)
{
    struct sigaction sa;

    if (argc != 2) {
        fprintf(stderr, "usage: fake_sched ENDPOINT\n");
        return 2;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    return fake_sched_run(argv[1], &stop_flag);
}
