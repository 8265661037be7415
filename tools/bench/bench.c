/*
 * bench.c — dsv4-bench: closed-loop load through libdsv4client at one or
 * more concurrency levels; output tok/s, TTFT, inter-token latency, TPOT and
 * end-to-end latency (mean, p50, p90, p99) as JSON, a table on stderr and,
 * with --plot, a PNG of throughput and latency against concurrency.
 *
 *   dsv4-bench -e ipc:///run/dsv4/client.sock -c 1,2,4,8,16,32,64 \
 *              -p 1024 -l 512 -n 128 -j sweep.json -P sweep.png
 *
 * How the load is generated and measured: bench_run.c; options:
 * bench_opts.c (or --help); the JSON schema and how figures are recorded:
 * docs/perf.md, "dsv4-bench".
 *
 * Before any load it checks what it will need (the endpoint's form and the
 * key file, the JSON file and the plot can be written), so that a sweep is
 * not lost at its end; a JSON file (not stdout) is written again after each
 * level, so an interrupted or failed sweep keeps what it measured.
 *
 * Exit status: 0 every measured request done; 1 some failed, a connection
 * was lost, a level was interrupted or could not run, or an output could
 * not be written; 2 usage error, a malformed endpoint, or an output that
 * cannot be written (found before any load).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/cli.h"
#include "dsv4/client.h"

static void
on_sigint(int sig)
{
    (void)sig;
    atomic_store(&bench_interrupted, 1);
}

/* The endpoint's form and the key file, once (not once per worker): 0,
 * 1 (the library could not connect: exit 1) or 2 (a malformed endpoint or
 * option: exit 2). */
static int
check_endpoint(const struct bench_opts *o)
{
    struct dsv4_client *c;
    int rc = bench_connect(o, &c);

    if (rc == 0) {
        dsv4_client_close(c);
        return 0;
    }
    fprintf(stderr, "dsv4-bench: %s: %d %s: %s\n", o->endpoint, rc, dsv4_client_strerror(rc),
        dsv4_client_errmsg(NULL));
    return rc / 100 == 4 ? 2 : 1;
}

int
main(int argc, char **argv)
{
    struct bench_result res[BENCH_MAX_LEVELS];
    struct bench_opts o;
    struct sigaction sa;
    char err[256];
    int rc, n = 0, status = 0;
    int json_file;

    bench_opts_init(&o);
    rc = bench_opts_parse(&o, argc, argv, err, sizeof(err));
    if (rc == 1)
        return 0;
    if (rc != 0) {
        fprintf(stderr, "dsv4-bench: %s\n", err);
        dsv4_cli_usage(BENCH_SYNOPSIS, "", 2);
    }
    json_file = o.json_path != NULL && strcmp(o.json_path, "-") != 0;
    /* (an empty document now: the file is there, and writable) */
    if ((json_file && bench_report_json(&o, res, 0) != 0) ||
        (o.plot_path != NULL && bench_report_plot_check(&o) != 0))
        return 2;
    if ((rc = check_endpoint(&o)) != 0)
        return rc;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);

    if (!o.quiet)
        bench_report_header();
    for (int i = 0; i < o.n_levels && !atomic_load(&bench_interrupted); i++) {
        if (bench_run(&o, o.concurrency[i], &res[n]) != 0) {
            status = 1;
            break;
        }
        if (!o.quiet)
            bench_report_row(&res[n]);
        if (res[n].failed > 0 || res[n].workers_lost > 0 || res[n].interrupted ||
            res[n].unmeasured_failed > 0 || res[n].server_cancelled > 0 || res[n].refused)
            status = 1;
        n++;
        if (json_file && bench_report_json(&o, res, n) != 0)
            status = 1;
    }
    if (o.json_path != NULL && !json_file && bench_report_json(&o, res, n) != 0)
        status = 1;
    if (o.plot_path != NULL && n > 0) {
        char *json = bench_report_json_string(&o, res, n);

        if (json == NULL || bench_report_plot(&o, json) != 0)
            status = 1;
        free(json);
    }
    return status;
}
