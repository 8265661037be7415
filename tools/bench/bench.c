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
 * Exit status: 0 every measured request done; 1 some failed, a level could
 * not run, or an output could not be written; 2 usage error.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/cli.h"

static void
on_sigint(int sig)
{
    (void)sig;
    bench_interrupted = 1;
}

int
main(int argc, char **argv)
{
    struct bench_result res[BENCH_MAX_LEVELS];
    struct bench_opts o;
    struct sigaction sa;
    char err[256];
    int rc, n = 0, status = 0;

    bench_opts_init(&o);
    rc = bench_opts_parse(&o, argc, argv, err, sizeof(err));
    if (rc == 1)
        return 0;
    if (rc != 0) {
        fprintf(stderr, "dsv4-bench: %s\n", err);
        dsv4_cli_usage(BENCH_SYNOPSIS, "", 2);
    }
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);

    if (!o.quiet)
        bench_report_header();
    for (int i = 0; i < o.n_levels && !bench_interrupted; i++) {
        if (bench_run(&o, o.concurrency[i], &res[n]) != 0) {
            status = 1;
            break;
        }
        if (!o.quiet)
            bench_report_row(&res[n]);
        if (res[n].failed > 0 || res[n].workers_lost > 0 || res[n].interrupted)
            status = 1;
        n++;
    }
    if (o.json_path != NULL && bench_report_json(&o, res, n) != 0)
        status = 1;
    if (o.plot_path != NULL && n > 0) {
        char *json = bench_report_json_string(&o, res, n);

        if (json == NULL || bench_report_plot(&o, json) != 0)
            status = 1;
        free(json);
    }
    return status;
}
