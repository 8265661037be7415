/*
 * bench_report.c — dsv4-bench output: the JSON document (schema in
 * docs/perf.md, "dsv4-bench"), the human table on stderr, and the plot
 * (tools/bench/plot.py run with the document on its standard input).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <json-c/json.h>

#include "dsv4/client.h"

#include "bench.h"

#define SCHEMA_VERSION 1

/* A number printed with `prec` decimals (json-c would print 17 digits). */
static struct json_object *
num(double v, int prec)
{
    char buf[64];

    snprintf(buf, sizeof(buf), "%.*f", prec, v);
    return json_object_new_double_s(v, buf);
}

/* A setting's value as given: the shortest of 7 significant digits (a
 * float's: 0.0004f reads 0.0004, not 0.00039999999). */
static struct json_object *
num_g(double v)
{
    char buf[64];

    snprintf(buf, sizeof(buf), "%.7g", v);
    return json_object_new_double_s(v, buf);
}

static struct json_object *
u64(uint64_t v)
{
    return json_object_new_uint64(v);
}

static struct json_object *
summary(const struct bench_summary *s)
{
    struct json_object *o = json_object_new_object();
    const struct {
        const char *key;
        double v;
    } f[] = {
        { "mean", s->mean }, { "min", s->min }, { "p50", s->p50 }, { "p90", s->p90 },
        { "p99", s->p99 }, { "max", s->max },
    };

    json_object_object_add(o, "n", u64(s->n));
    for (size_t i = 0; i < sizeof(f) / sizeof(f[0]); i++)
        json_object_object_add(o, f[i].key, s->n > 0 ? num(f[i].v, 3) : NULL);
    return o;
}

static struct json_object *
config(const struct bench_opts *o)
{
    struct json_object *c = json_object_new_object(), *a;
    char buf[128];

    json_object_object_add(c, "endpoint", json_object_new_string(o->endpoint));
    a = json_object_new_array();
    for (int i = 0; i < o->n_levels; i++)
        json_object_array_add(a, json_object_new_int(o->concurrency[i]));
    json_object_object_add(c, "concurrency", a);
    bench_dist_format(&o->prompt, buf, sizeof(buf));
    json_object_object_add(c, "prompt_len", json_object_new_string(buf));
    bench_dist_format(&o->output, buf, sizeof(buf));
    json_object_object_add(c, "output_len", json_object_new_string(buf));
    a = json_object_new_array();
    json_object_array_add(a, json_object_new_int(o->id_lo));
    json_object_array_add(a, json_object_new_int(o->id_hi));
    json_object_object_add(c, "token_range", a);
    json_object_object_add(c, "seed", u64(o->seed));
    /* the settings as given: 3 decimals made -t 0.0004 read "0.0", greedy */
    json_object_object_add(c, "temperature", num_g(o->temperature));
    json_object_object_add(c, "top_p", num_g(o->top_p));
    json_object_object_add(c, "top_k", json_object_new_int64(o->top_k));
    json_object_object_add(c, "top_logprobs", json_object_new_int64(o->top_logprobs));
    json_object_object_add(c, "stream", json_object_new_boolean(o->stream));
    json_object_object_add(c, "timeout_ms", json_object_new_int64(o->timeout_ms));
    json_object_object_add(c, "warmup", o->warmup < 0 ? NULL : json_object_new_int(o->warmup));
    json_object_object_add(c, "requests", o->duration_s > 0 ? NULL : u64(o->requests));
    json_object_object_add(c, "duration_s", o->duration_s > 0 ? num_g(o->duration_s) : NULL);
    return c;
}

static struct json_object *
run(const struct bench_result *r)
{
    struct json_object *o = json_object_new_object(), *e;
    char code[16];

    json_object_object_add(o, "concurrency", json_object_new_int(r->concurrency));
    json_object_object_add(o, "warmup_requests", json_object_new_int(r->warmup));
    json_object_object_add(o, "measured_requests", u64(r->measured));
    json_object_object_add(o, "done", u64(r->done));
    json_object_object_add(o, "failed", u64(r->failed));
    e = json_object_new_object();
    for (int i = 0; i < r->n_codes; i++) {
        snprintf(code, sizeof(code), "%d", r->err_code[i]);
        json_object_object_add(e, code, u64(r->err_count[i]));
    }
    json_object_object_add(o, "errors", e);
    e = json_object_new_object();
    json_object_object_add(e, "length", u64(r->finish_length));
    json_object_object_add(e, "stop", u64(r->finish_stop));
    json_object_object_add(e, "cancelled", u64(r->finish_cancelled));
    json_object_object_add(o, "finish", e);
    json_object_object_add(o, "prompt_tokens", u64(r->prompt_tokens));
    json_object_object_add(o, "output_tokens", u64(r->output_tokens));
    json_object_object_add(o, "output_tokens_requested", u64(r->output_requested));
    json_object_object_add(o, "short_outputs", u64(r->short_outputs));
    json_object_object_add(o, "usage_mismatch", u64(r->usage_mismatch));
    json_object_object_add(o, "top_short", u64(r->top_short));
    json_object_object_add(o, "unmeasured_cancelled", u64(r->extra_cancelled));
    json_object_object_add(o, "unmeasured_failed", u64(r->unmeasured_failed));
    json_object_object_add(o, "server_cancelled", u64(r->server_cancelled));
    json_object_object_add(o, "refused", json_object_new_boolean(r->refused));
    json_object_object_add(o, "workers_lost", json_object_new_int(r->workers_lost));
    json_object_object_add(o, "interrupted", json_object_new_boolean(r->interrupted));
    json_object_object_add(o, "duration_s", num(r->duration_s, 6));
    json_object_object_add(o, "window_output_tokens", u64(r->window_tokens));
    json_object_object_add(o, "output_tok_s", num(r->output_tok_s, 3));
    json_object_object_add(o, "requests_per_s", num(r->requests_s, 4));
    json_object_object_add(o, "ttft_ms", summary(&r->ttft));
    json_object_object_add(o, "itl_ms", summary(&r->itl));
    json_object_object_add(o, "tpot_ms", summary(&r->tpot));
    json_object_object_add(o, "e2e_ms", summary(&r->e2e));
    return o;
}

char *
bench_report_json_string(const struct bench_opts *o, const struct bench_result *res, int n)
{
    struct json_object *doc = json_object_new_object(), *runs;
    char date[32], host[256] = "";
    time_t now = time(NULL);
    struct tm tm;
    int major, minor, patch;
    char ver[32], *s;

    gmtime_r(&now, &tm);
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", &tm);
    gethostname(host, sizeof(host) - 1);
    dsv4_client_version(&major, &minor, &patch);
    snprintf(ver, sizeof(ver), "%d.%d.%d", major, minor, patch);
    json_object_object_add(doc, "tool", json_object_new_string("dsv4-bench"));
    json_object_object_add(doc, "schema", json_object_new_int(SCHEMA_VERSION));
    json_object_object_add(doc, "label", o->label != NULL ?
        json_object_new_string(o->label) : NULL);
    json_object_object_add(doc, "date", json_object_new_string(date));
    json_object_object_add(doc, "host", json_object_new_string(host));
    json_object_object_add(doc, "client_version", json_object_new_string(ver));
    json_object_object_add(doc, "config", config(o));
    runs = json_object_new_array();
    for (int i = 0; i < n; i++)
        json_object_array_add(runs, run(&res[i]));
    json_object_object_add(doc, "runs", runs);
    s = strdup(json_object_to_json_string_ext(doc, JSON_C_TO_STRING_PRETTY |
        JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE));
    json_object_put(doc);
    return s;
}

int
bench_report_json(const struct bench_opts *o, const struct bench_result *res, int n)
{
    char *s = bench_report_json_string(o, res, n);
    FILE *f;
    int rc = 0;

    if (s == NULL) {
        fprintf(stderr, "dsv4-bench: out of memory\n");
        return -1;
    }
    if (strcmp(o->json_path, "-") == 0) {
        f = stdout;
    } else if ((f = fopen(o->json_path, "w")) == NULL) {
        fprintf(stderr, "dsv4-bench: %s: %s\n", o->json_path, strerror(errno));
        free(s);
        return -1;
    }
    if (fprintf(f, "%s\n", s) < 0 || fflush(f) != 0)
        rc = -1;
    if (f != stdout && fclose(f) != 0)
        rc = -1;
    if (rc != 0)
        fprintf(stderr, "dsv4-bench: %s: write failed\n", o->json_path);
    free(s);
    return rc;
}

/* --- table ----------------------------------------------------------- */

void
bench_report_header(void)
{
    fprintf(stderr, "%4s %6s %5s %10s %7s %17s %17s %17s\n", "C", "done", "fail",
        "out_tok/s", "req/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 ms");
}

/* "P50/P99" of a latency column at its width: "n/a" without samples (every
 * request failed: a 0.0 would read as a measured 0 ms). */
static const char *
pair(char *buf, size_t len, const struct bench_summary *x, int decimals)
{
    if (x->n == 0)
        snprintf(buf, len, "%8s/%-8s", "n/a", "n/a");
    else
        snprintf(buf, len, "%8.*f/%-8.*f", decimals, x->p50, decimals, x->p99);
    return buf;
}

void
bench_report_row(const struct bench_result *r)
{
    char a[48], b[48], c[48];

    fprintf(stderr, "%4d %6llu %5llu %10.1f %7.2f %s %s %s\n",
        r->concurrency, (unsigned long long)r->done, (unsigned long long)r->failed,
        r->output_tok_s, r->requests_s, pair(a, sizeof(a), &r->ttft, 1),
        pair(b, sizeof(b), &r->itl, 2), pair(c, sizeof(c), &r->e2e, 1));
    if (r->unmeasured_failed > 0)
        fprintf(stderr, "     %llu warm-up or extra requests failed (the load was below "
            "C meanwhile)\n", (unsigned long long)r->unmeasured_failed);
    if (r->server_cancelled > 0)
        fprintf(stderr, "     %llu measured requests cancelled by the server side "
            "(dsv4ctl cancel)\n", (unsigned long long)r->server_cancelled);
    if (r->refused)
        fprintf(stderr, "     stopped: the server refuses the requests (401 / 413)\n");
    if (r->short_outputs > 0)
        fprintf(stderr, "     %llu of %llu requests ended before max_tokens (EOS or a stop "
            "id; the protocol has no ignore-EOS): output_tokens %llu of %llu asked\n",
            (unsigned long long)r->short_outputs,
            (unsigned long long)(r->done - r->finish_cancelled),
            (unsigned long long)r->output_tokens, (unsigned long long)r->output_requested);
    if (r->top_short > 0)
        fprintf(stderr, "     %llu tokens came with fewer most likely tokens than asked "
            "(--top-logprobs)\n", (unsigned long long)r->top_short);
    if (r->workers_lost > 0)
        fprintf(stderr, "     %d of %d workers lost (connection failed or server silent)\n",
            r->workers_lost, r->concurrency);
    if (r->interrupted)
        fprintf(stderr, "     interrupted\n");
}

/* --- plot ------------------------------------------------------------ */

/* The plot script: --plot-script, $DSV4_BENCH_PLOT, installed, source tree. */
static const char *
plot_script(const struct bench_opts *o)
{
    const char *env = getenv("DSV4_BENCH_PLOT");

    if (o->plot_script != NULL)
        return o->plot_script;
    if (env != NULL && *env != '\0')
        return env;
    if (access(BENCH_PLOT_INSTALLED, R_OK) == 0)
        return BENCH_PLOT_INSTALLED;
    return BENCH_PLOT_SOURCE;
}

/* Run `python3 script args...` with `input` on its stdin (NULL: none);
 * 0 when it exits 0. */
static int
run_python(const char *script, const char *a1, const char *a2, const char *a3,
    const char *input)
{
    char *argv[] = { strdup("python3"), strdup(script), a1 != NULL ? strdup(a1) : NULL,
                     a2 != NULL ? strdup(a2) : NULL, a3 != NULL ? strdup(a3) : NULL, NULL };
    size_t len = input != NULL ? strlen(input) : 0, off = 0;
    void (*old)(int);
    int fd[2], status, rc = 0;
    pid_t pid;

    if (pipe(fd) != 0) {
        fprintf(stderr, "dsv4-bench: pipe: %s\n", strerror(errno));
        rc = -1;
        goto out;
    }
    if ((pid = fork()) < 0) {
        fprintf(stderr, "dsv4-bench: fork: %s\n", strerror(errno));
        close(fd[0]);
        close(fd[1]);
        rc = -1;
        goto out;
    }
    if (pid == 0) {
        dup2(fd[0], STDIN_FILENO);
        close(fd[0]);
        close(fd[1]);
        execvp(argv[0], argv);
        fprintf(stderr, "dsv4-bench: python3: %s\n", strerror(errno));
        _exit(127);
    }
    close(fd[0]);
    old = signal(SIGPIPE, SIG_IGN); /* a script that dies early must not kill us */
    while (off < len) {
        ssize_t w = write(fd[1], input + off, len - off);

        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            rc = -1;
            break;
        }
        off += (size_t)w;
    }
    close(fd[1]);
    signal(SIGPIPE, old);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        rc = -1;
out:
    for (int i = 0; i < 5; i++)
        free(argv[i]);
    return rc;
}

int
bench_report_plot(const struct bench_opts *o, const char *json)
{
    const char *script = plot_script(o);

    if (run_python(script, "-o", o->plot_path, "-", json) != 0) {
        fprintf(stderr, "dsv4-bench: %s failed; no plot written to %s\n", script,
            o->plot_path);
        return -1;
    }
    return 0;
}

int
bench_report_plot_check(const struct bench_opts *o)
{
    const char *script = plot_script(o), *slash = strrchr(o->plot_path, '/');
    char dir[4096];

    if (slash == NULL)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == o->plot_path)
        snprintf(dir, sizeof(dir), "/");
    else
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - o->plot_path), o->plot_path);
    if (access(dir, W_OK) != 0) {
        fprintf(stderr, "dsv4-bench: --plot %s: cannot write in %s: %s\n", o->plot_path, dir,
            strerror(errno));
        return -1;
    }
    if (access(script, R_OK) != 0) {
        fprintf(stderr, "dsv4-bench: plot script %s: %s\n", script, strerror(errno));
        return -1;
    }
    /* (the script names what is missing: matplotlib, python3) */
    if (run_python(script, "--check", NULL, NULL, NULL) != 0) {
        fprintf(stderr, "dsv4-bench: %s --check failed: no plot could be made\n", script);
        return -1;
    }
    return 0;
}
