/*
 * bench.h — internals of dsv4-bench, the closed-loop load generator of the
 * dsv4 inference server (tools/bench/, docs/perf.md "dsv4-bench").
 *
 * Modules:
 *   bench_stats.c   seeded RNG, length distributions, samples, percentiles,
 *                   the per-stream timing rule (TTFT, ITL, TPOT, E2E)
 *   bench_opts.c    command line -> struct bench_opts
 *   bench_run.c     one concurrency level: C worker threads on libdsv4client
 *   bench_report.c  JSON document, human table, the plot script
 *   bench.c         main
 *
 * Times are seconds of CLOCK_MONOTONIC as double; summaries are reported in
 * milliseconds.
 */
#ifndef DSV4_TOOLS_BENCH_H
#define DSV4_TOOLS_BENCH_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

struct dsv4_client;   /* ipc/dsv4/client.h */

#define BENCH_MAX_CONCURRENCY 64   /* issue 7: concurrency 1..64 */
#define BENCH_MAX_LEVELS 16        /* concurrency levels of one sweep */
#define BENCH_MAX_LEN 1048576      /* protocol limit on prompt and max_tokens */
#define BENCH_N_CODES 16           /* distinct error codes kept per level */

/* --- random numbers ------------------------------------------------- */

/*
 * splitmix64 stream.  Seeded from (seed, stream): request i of a run draws
 * everything from stream i, so the i-th request is the same whichever worker
 * sends it and however the run is timed.
 */
struct bench_rng {
    uint64_t s;
};

/* Seed `r` for sub-stream `stream` of `seed`. */
void bench_rng_seed(struct bench_rng *r, uint64_t seed, uint64_t stream);
/* Next 64 random bits. */
uint64_t bench_rng_next(struct bench_rng *r);
/* Uniform double in [0, 1). */
double bench_rng_uniform(struct bench_rng *r);
/* Standard normal (Box-Muller; one draw per call). */
double bench_rng_normal(struct bench_rng *r);

/* --- length distributions ------------------------------------------- */

/* The kind of a length distribution (bench_dist_parse's forms). */
enum bench_dist_kind {
    BENCH_DIST_FIXED = 1,     /* "N": always N */
    BENCH_DIST_UNIFORM,       /* "uniform:LO:HI": integers LO..HI inclusive */
    BENCH_DIST_NORMAL,        /* "normal:MEAN:SD" */
    BENCH_DIST_LOGNORMAL,     /* "lognormal:MEAN:SD" (mean and sd of the lengths,
                                 not of their logarithm) */
};

/* A distribution of lengths; draws are rounded and clamped to [1, BENCH_MAX_LEN]. */
struct bench_dist {
    int kind;       /* enum bench_dist_kind */
    double a;       /* FIXED: N; UNIFORM: LO; NORMAL/LOGNORMAL: mean */
    double b;       /* FIXED: N; UNIFORM: HI; NORMAL/LOGNORMAL: standard deviation */
};

/*
 * Parse a spec ("512", "uniform:256:1024", "normal:1024:128",
 * "lognormal:1024:512").  Returns 0, or -1 with a reason in err.
 */
int bench_dist_parse(struct bench_dist *d, const char *spec, char *err, size_t errlen);
/* One length drawn with r. */
uint32_t bench_dist_draw(const struct bench_dist *d, struct bench_rng *r);
/* The spec back as text (parse(format(d)) == d). */
void bench_dist_format(const struct bench_dist *d, char *buf, size_t len);

/* --- samples and summaries ------------------------------------------ */

/* A growing array of observations. */
struct bench_samples {
    double *v;
    size_t n, cap;
};

/* Append x; returns 0, or -1 when out of memory. */
int bench_samples_add(struct bench_samples *s, double x);
/* Append every observation of src to dst; 0 or -1 (out of memory). */
int bench_samples_merge(struct bench_samples *dst, const struct bench_samples *src);
void bench_samples_free(struct bench_samples *s);

/*
 * Percentile p (0..100) of n sorted values: linear interpolation between
 * the closest ranks (rank (n-1)*p/100; numpy's default "linear" method).
 * n must be > 0.
 */
double bench_percentile(const double *sorted, size_t n, double p);

/* Summary of one metric; all fields 0 when n == 0. */
struct bench_summary {
    size_t n;
    double mean, min, max;
    double p50, p90, p99;
};

/* Summarise s (sorts s->v in place), each value multiplied by `scale`. */
void bench_summarize(struct bench_samples *s, double scale, struct bench_summary *out);

/* --- timing of one stream ------------------------------------------- */

/*
 * Timing of one request.  Token events are fed in arrival order with
 * bench_stream_tokens().  Counting rule for events that carry several
 * tokens (the scheduler merges tokens when the client reads slowly, and a
 * non-streamed request carries all in one): the gap since the previous
 * token event is split evenly over the event's k tokens, i.e. k ITL samples
 * of gap/k.  The first event's first token is the TTFT; its other tokens
 * arrived with it and give no ITL sample.  So the ITL samples of a request
 * sum to t_last - t_first, and TPOT = (t_last - t_first) / (n - 1).
 */
struct bench_stream {
    double t_submit;   /* s; when the request was sent */
    double t_first;    /* s; first token event (0 = none yet) */
    double t_last;     /* s; latest token event */
    uint32_t n_tokens; /* tokens received */
};

/* Start timing a request sent at t_submit. */
void bench_stream_begin(struct bench_stream *st, double t_submit);
/*
 * k tokens arrived at t.  Appends the ITL samples to itl when itl != NULL.
 * Returns 0, or -1 when out of memory.
 */
int bench_stream_tokens(struct bench_stream *st, double t, size_t k, struct bench_samples *itl);

/* --- options -------------------------------------------------------- */

/* dsv4-bench's command line, parsed (bench_opts_parse). */
struct bench_opts {
    const char *endpoint;          /* scheduler client endpoint */
    const char *server_key_file;   /* CURVE public key file, or NULL */
    int connect_timeout_ms;
    int concurrency[BENCH_MAX_LEVELS]; /* levels, run in this order */
    int n_levels;
    struct bench_dist prompt;      /* prompt lengths (tokens) */
    struct bench_dist output;      /* max_tokens per request */
    int32_t id_lo, id_hi;          /* prompt token ids drawn from [id_lo, id_hi) */
    uint64_t seed;
    float temperature, top_p;
    uint32_t top_k;
    uint32_t top_logprobs;         /* most likely tokens asked per position (0 ... 20) */
    int stream;                    /* 1: streamed output (default) */
    uint32_t timeout_ms;           /* per-request deadline given to the server */
    int warmup;                    /* warm-up requests per level; -1 = concurrency */
    uint32_t requests;             /* measured requests per level (when duration 0) */
    double duration_s;             /* measured phase length; 0 = count requests */
    const char *json_path;         /* "-" = stdout, NULL = none */
    const char *plot_path;         /* PNG to draw, or NULL */
    const char *plot_script;       /* plot.py to use, or NULL = look it up */
    const char *label;             /* series name in the JSON and the plot */
    int quiet;                     /* no table on stderr */
};

/* Defaults (endpoint from $DSV4_ENDPOINT). */
void bench_opts_init(struct bench_opts *o);
/*
 * Parse argv (getopt_long; resets getopt, so it may be called repeatedly).
 * Returns 0; 1 when --help or --version was answered (on stdout); -1 on a usage
 * error with the reason in err.
 */
int bench_opts_parse(struct bench_opts *o, int argc, char **argv, char *err, size_t errlen);
/* Parse "1,2,4,8" into o->concurrency; 0 or -1 with the reason in err. */
int bench_parse_levels(struct bench_opts *o, const char *s, char *err, size_t errlen);
/* Print the usage text on f. */
void bench_usage(FILE *f);
/* The usage's first lines: dsv4_cli_usage's synopsis (common/cli.h). */
#define BENCH_SYNOPSIS \
    "usage: dsv4-bench [-e endpoint] [-K keyfile] [-c list] [-p spec] [-l spec]\n" \
    "                  [-n requests | -d seconds] [-w warmup] [-s seed] [-t temp]\n" \
    "                  [-j file.json] [-P file.png] [-L label] [-q] [more options]\n"

/* --- one concurrency level ------------------------------------------ */

/* What one level measured (see docs/perf.md for the meaning of each field). */
struct bench_result {
    int concurrency;
    int warmup;                    /* warm-up requests sent */
    uint64_t measured;             /* measured requests sent */
    uint64_t done, failed;         /* of the measured ones */
    int err_code[BENCH_N_CODES];   /* error codes of failed measured requests */
    uint64_t err_count[BENCH_N_CODES];
    int n_codes;
    uint64_t finish_length, finish_stop, finish_cancelled;
    uint64_t prompt_tokens;        /* sum over measured requests */
    uint64_t output_tokens;        /* received by measured requests */
    uint64_t output_requested;     /* sum of their max_tokens */
    uint64_t short_outputs;        /* measured DONE with fewer tokens than asked */
    uint64_t usage_mismatch;       /* DONE whose completion_tokens != tokens received */
    uint64_t top_short;            /* tokens of measured requests given fewer most likely
                                      tokens than top_logprobs */
    uint64_t extra_cancelled;      /* unmeasured requests cancelled at the end */
    uint64_t unmeasured_failed;    /* warm-up / extra requests that ended with ERROR
                                      (the load was below C meanwhile) */
    uint64_t server_cancelled;     /* measured requests cancelled by someone else
                                      (dsv4ctl cancel): not done, not measured */
    int refused;                   /* the level stopped: the server refuses its
                                      requests (401 / 413 every time) */
    double duration_s;             /* measurement window */
    uint64_t window_tokens;        /* tokens of any request inside the window */
    double output_tok_s;           /* window_tokens / duration_s */
    double requests_s;             /* (done - finish_cancelled) / duration_s */
    struct bench_summary ttft, itl, tpot, e2e; /* ms */
    int interrupted;               /* SIGINT stopped the level */
    int workers_lost;              /* connections that failed */
};

/*
 * One connection to o->endpoint with o's server key and connect timeout, as
 * every worker and the pre-flight check make it.  Returns 0 with *c set, or
 * the client library's error code (dsv4_client_strerror; the reason in
 * dsv4_client_errmsg(NULL)).
 */
int bench_connect(const struct bench_opts *o, struct dsv4_client **c);
/*
 * Run one level of closed-loop load at `concurrency` and fill *res.  Returns
 * 0, or -1 when no worker could connect (reason on stderr).
 */
int bench_run(const struct bench_opts *o, int concurrency, struct bench_result *res);
/* Set by SIGINT (a lock-free atomic: a signal handler may store it): stop
 * the current level and report what was measured. */
extern atomic_int bench_interrupted;

/* --- reports --------------------------------------------------------- */

/* Write the JSON document for results[0..n) to o->json_path; 0 or -1. */
int bench_report_json(const struct bench_opts *o, const struct bench_result *res, int n);
/* The document as a malloc'd string (NULL when out of memory). */
char *bench_report_json_string(const struct bench_opts *o, const struct bench_result *res,
    int n);
/* Print the table header (once) and one row per result on stderr. */
void bench_report_header(void);
void bench_report_row(const struct bench_result *r);
/* Run the plot script on the JSON document, writing o->plot_path; 0 or -1. */
int bench_report_plot(const struct bench_opts *o, const char *json);
/* Before any load: whether the plot can be made (o->plot_path's directory
 * writable, python3 with matplotlib to run the script); 0, or -1 with the
 * reason on stderr. */
int bench_report_plot_check(const struct bench_opts *o);

#endif
