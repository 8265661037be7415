/*
 * generate.c — dsv4-generate: send one prompt to the dsv4 scheduler and
 * stream the completion to stdout (libdsv4client).
 *
 *   dsv4-generate [options] [PROMPT...]      prompt from the arguments, or
 *                                            stdin when none are given
 *   -e, --endpoint EP    scheduler client endpoint ($DSV4_ENDPOINT,
 *                        default ipc:///run/dsv4/client.sock)
 *   -K, --server-key F   CURVE public key file of the server (tcp endpoints)
 *   -n, --max-tokens N   -t, --temperature T   -p, --top-p P   -k, --top-k K
 *   -s, --seed S         -S, --stop STR (repeatable)   --stop-id ID (repeatable)
 *   --ids                the prompt is token ids ("1 2 3" or "1,2,3")
 *   --timeout MS         per-request timeout     --connect-timeout MS
 *   --logprobs           print "id logprob" per token on stderr
 *   --top-logprobs N     as --logprobs, each line followed by the N (0 ... 20)
 *                        most likely tokens of that position, best first, as
 *                        " id:logprob" each (temperature 1, whatever the
 *                        sampling; fewer or none where the server sent fewer)
 *   --tag TAG            label shown by dsv4ctl requests
 *   --usage              print "finish=… prompt_tokens=… completion_tokens=…" on stderr
 *
 * Ctrl-C cancels the request (the completion so far stays printed); a
 * second Ctrl-C leaves at once, without waiting for the cancel's answer.
 *
 * Exit status: 0 done, 1 the request failed or was cancelled by the server
 * (dsv4ctl cancel), or standard output could not be written, a closed pipe
 * included (status code and message on stderr; the request is cancelled),
 * 2 usage error (an endpoint of no form too), 130 cancelled by Ctrl-C.
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cli.h"
#include "dsv4/client.h"

#define DEFAULT_ENDPOINT "ipc:///run/dsv4/client.sock"
#define MAX_STOP 16
#define MAX_STOP_IDS 64
#define POLL_MS 200 /* wake up this often to notice SIGINT */

enum {
    OPT_STOP_ID = 256, OPT_IDS, OPT_TIMEOUT, OPT_CONNECT_TIMEOUT, OPT_LOGPROBS, OPT_TAG,
    OPT_USAGE, OPT_TOP_LOGPROBS,
};

static volatile sig_atomic_t interrupted;

/* The first SIGINT asks the main loop to cancel; a second one ends the
 * process (the default action, raised when the handler returns), so that
 * a scheduler that no longer answers cannot hold the terminal. */
static void
on_sigint(int sig)
{
    if (interrupted) {
        signal(sig, SIG_DFL);
        raise(sig);
    }
    interrupted = 1;
}

static void __attribute__((noreturn))
usage(int status)
{
    dsv4_cli_usage(
        "usage: dsv4-generate [-e ENDPOINT] [-K KEYFILE] [-n MAX_TOKENS] [-t TEMPERATURE]\n"
        "                     [-p TOP_P] [-k TOP_K] [-s SEED] [-S STOP]... [--stop-id ID]...\n"
        "                     [--ids] [--timeout MS] [--connect-timeout MS] [--logprobs]\n"
        "                     [--top-logprobs N] [--tag TAG] [--usage] [PROMPT...]\n",
        "Sends one prompt (the arguments, or standard input) to the dsv4 scheduler and\n"
        "streams the completion to standard output (libdsv4client).\n"
        "  -e, --endpoint EP      the scheduler's client endpoint ($DSV4_ENDPOINT, default\n"
        "                         " DEFAULT_ENDPOINT ")\n"
        "  -K, --server-key FILE  the server's CURVE public key (tcp:// endpoints)\n"
        "  -n, --max-tokens N     -t, --temperature T   -p, --top-p P   -k, --top-k K\n"
        "  -s, --seed S           -S, --stop STR (up to 16)   --stop-id ID (up to 64)\n"
        "  --ids                  the prompt is token ids (\"1 2 3\" or \"1,2,3\")\n"
        "  --timeout MS           the request's deadline (0, the default: none)\n"
        "  --connect-timeout MS   how long to wait for the scheduler (default 5000; 0:\n"
        "                         no limit, waits for one that is not there yet)\n"
        "  --logprobs             \"id logprob\" per token on standard error\n"
        "  --top-logprobs N       as --logprobs, each line followed by the N (0 ... 20) most\n"
        "                         likely tokens of the position, best first, as\n"
        "                         \" id:logprob\" each (temperature 1)\n"
        "  --tag TAG              a label that dsv4ctl requests shows\n"
        "  --usage                \"finish=... prompt_tokens=... completion_tokens=...\" on\n"
        "                         standard error\n"
        "  -h, --help             this help\n"
        "      --version          the version\n"
        "Ctrl-C cancels the request; a second Ctrl-C leaves without waiting.\n"
        "Exit status: 0 done, 1 the request failed or the server cancelled it, or\n"
        "standard output could not be written (the reason on standard error), 2 usage,\n"
        "130 cancelled by Ctrl-C.\n", status);
}

static long long
num(const char *s, long long lo, long long hi, const char *what)
{
    char *end;
    long long v;

    errno = 0;
    v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "dsv4-generate: bad %s: %s\n", what, s);
        exit(2);
    }
    return v;
}

/* A seed: 0 .. 2^64 - 1 (the protocol's range; the scheduler draws any). */
static uint64_t
seed_arg(const char *s)
{
    unsigned long long v;
    char *end;

    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || s[0] < '0' || s[0] > '9') {
        fprintf(stderr, "dsv4-generate: bad seed: %s\n", s);
        exit(2);
    }
    return (uint64_t)v;
}

static float
real(const char *s, const char *what)
{
    char *end;
    float v = strtof(s, &end);

    if (end == s || *end != '\0') {
        fprintf(stderr, "dsv4-generate: bad %s: %s\n", what, s);
        exit(2);
    }
    return v;
}

/* Join argv[0..argc) with spaces, or read stdin when argc == 0. */
static char *
prompt_read(int argc, char **argv)
{
    size_t len = 0, cap = 4096;
    char *s = malloc(cap), *ns;
    size_t n;

    if (s == NULL)
        return NULL;
    if (argc > 0) {
        s[0] = '\0';
        for (int i = 0; i < argc; i++) {
            size_t add = strlen(argv[i]) + 1;

            if (len + add + 1 > cap) {
                cap = 2 * (len + add + 1);
                if ((ns = realloc(s, cap)) == NULL) {
                    free(s);
                    return NULL;
                }
                s = ns;
            }
            if (i > 0)
                s[len++] = ' ';
            memcpy(s + len, argv[i], add);
            len += add - 1;
        }
        return s;
    }
    while ((n = fread(s + len, 1, cap - len - 1, stdin)) > 0) {
        len += n;
        if (len + 1 == cap) {
            if ((ns = realloc(s, cap *= 2)) == NULL) {
                free(s);
                return NULL;
            }
            s = ns;
        }
    }
    s[len] = '\0';
    return s;
}

/* Parse "1 2 3" / "1,2,3" into *ids; returns the count.  Out of memory:
 * a message and exit 1. */
static size_t
ids_parse(const char *s, int32_t **ids)
{
    size_t n = 0, cap = 64;
    char *copy = strdup(s), *save = NULL;
    int32_t *v = malloc(cap * sizeof(*v));

    if (copy == NULL || v == NULL)
        goto nomem;
    for (char *t = strtok_r(copy, " ,\t\n", &save); t != NULL;
         t = strtok_r(NULL, " ,\t\n", &save)) {
        if (n == cap) {
            int32_t *nv = realloc(v, (cap *= 2) * sizeof(*v));

            if (nv == NULL)
                goto nomem;
            v = nv;
        }
        v[n++] = (int32_t)num(t, 0, 2147483647, "token id");
    }
    free(copy);
    *ids = v;
    return n;
nomem:
    fprintf(stderr, "dsv4-generate: out of memory for the token ids\n");
    exit(1);
}

int
main(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "endpoint", required_argument, NULL, 'e' },
        { "server-key", required_argument, NULL, 'K' },
        { "max-tokens", required_argument, NULL, 'n' },
        { "temperature", required_argument, NULL, 't' },
        { "top-p", required_argument, NULL, 'p' },
        { "top-k", required_argument, NULL, 'k' },
        { "seed", required_argument, NULL, 's' },
        { "stop", required_argument, NULL, 'S' },
        { "stop-id", required_argument, NULL, OPT_STOP_ID },
        { "ids", no_argument, NULL, OPT_IDS },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "connect-timeout", required_argument, NULL, OPT_CONNECT_TIMEOUT },
        { "logprobs", no_argument, NULL, OPT_LOGPROBS },
        { "top-logprobs", required_argument, NULL, OPT_TOP_LOGPROBS },
        { "tag", required_argument, NULL, OPT_TAG },
        { "usage", no_argument, NULL, OPT_USAGE },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };
    const char *endpoint = getenv("DSV4_ENDPOINT");
    const char *stop[MAX_STOP];
    int32_t stop_ids[MAX_STOP_IDS];
    struct dsv4_client_params p;
    struct dsv4_client_opts o;
    struct dsv4_client *c = NULL;
    bool as_ids = false, show_usage = false, cancelled = false;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    uint64_t id;
    char *prompt;
    int ch, rc, status = 1, out_errno = 0;

    dsv4_client_params_init(&p);
    dsv4_client_opts_init(&o);
    while ((ch = getopt_long(argc, argv, "e:K:n:t:p:k:s:S:h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'e': endpoint = optarg; break;
        case 'K': o.server_key_file = optarg; break;
        case 'n': p.max_tokens = (uint32_t)num(optarg, 1, 1048576, "max tokens"); break;
        /* (the protocol's ranges, checked here: a bad option value exits 2) */
        case 't':
            p.temperature = real(optarg, "temperature");
            if (!(p.temperature >= 0.0f && p.temperature <= 10.0f)) {
                fprintf(stderr, "dsv4-generate: bad temperature: %s (0 ... 10)\n", optarg);
                exit(2);
            }
            break;
        case 'p':
            p.top_p = real(optarg, "top-p");
            if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
                fprintf(stderr, "dsv4-generate: bad top-p: %s (above 0, at most 1)\n", optarg);
                exit(2);
            }
            break;
        case 'k': p.top_k = (uint32_t)num(optarg, 0, 1048576, "top-k"); break;
        case 's':
            p.seed = seed_arg(optarg);
            p.has_seed = 1;
            break;
        case 'S':
            if (p.n_stop == MAX_STOP) {
                fprintf(stderr, "dsv4-generate: at most %d --stop\n", MAX_STOP);
                exit(2);
            }
            stop[p.n_stop++] = optarg;
            break;
        case OPT_STOP_ID:
            if (p.n_stop_ids == MAX_STOP_IDS) {
                fprintf(stderr, "dsv4-generate: at most %d --stop-id\n", MAX_STOP_IDS);
                exit(2);
            }
            stop_ids[p.n_stop_ids++] = (int32_t)num(optarg, 0, 2147483647, "stop id");
            break;
        case OPT_IDS: as_ids = true; break;
        case OPT_TIMEOUT: p.timeout_ms = (uint32_t)num(optarg, 0, 86400000, "timeout"); break;
        case OPT_CONNECT_TIMEOUT:
            o.connect_timeout_ms = (int)num(optarg, 0, 86400000, "connect timeout");
            break;
        case OPT_LOGPROBS: p.logprobs = 1; break;
        case OPT_TOP_LOGPROBS:
            p.top_logprobs = (uint32_t)num(optarg, 0, 20, "top-logprobs");
            p.logprobs = 1;
            break;
        case OPT_TAG: p.tag = optarg; break;
        case OPT_USAGE: show_usage = true; break;
        case 'h': usage(0);
        case DSV4_CLI_OPT_VERSION: dsv4_cli_version("dsv4-generate");
        default: usage(2);
        }
    }
    p.stop = stop;
    p.stop_ids = stop_ids;
    if (endpoint == NULL || endpoint[0] == '\0')   /* empty: unset, as dsv4-bench takes it */
        endpoint = DEFAULT_ENDPOINT;
    if ((prompt = prompt_read(argc - optind, argv + optind)) == NULL) {
        fprintf(stderr, "dsv4-generate: out of memory\n");
        return 1;
    }
    if (as_ids && (n_ids = ids_parse(prompt, &ids)) == 0) {
        fprintf(stderr, "dsv4-generate: --ids: no token ids in the prompt\n");
        status = 2;
        goto out;
    }

    /* before the submit: a Ctrl-C from then on cancels the request (the
     * loop sends the CANCEL once it runs) */
    signal(SIGINT, on_sigint);
    signal(SIGPIPE, SIG_IGN);   /* a closed reader: EPIPE, said and exit 1 */
    if ((rc = dsv4_client_connect(endpoint, &o, &c)) != 0) {
        const char *why = dsv4_client_errmsg(NULL);

        fprintf(stderr, "dsv4-generate: %s: %d %s%s%s\n", endpoint, rc, dsv4_client_strerror(rc),
            why[0] != '\0' ? ": " : "", why);
        if (rc == DSV4_CLIENT_BAD_ARGUMENT)   /* an endpoint of no form: a usage error */
            status = 2;
        goto out;
    }
    rc = as_ids ? dsv4_client_submit_tokens(c, ids, n_ids, &p, &id) :
                  dsv4_client_submit_text(c, prompt, &p, &id);
    if (rc != 0) {
        fprintf(stderr, "dsv4-generate: %d %s: %s\n", rc, dsv4_client_strerror(rc),
            dsv4_client_errmsg(c));
        goto out;
    }
    for (;;) {
        struct dsv4_client_event ev;

        /* (ends with DONE cancelled; a full send queue: again next turn) */
        if (interrupted && !cancelled && dsv4_client_cancel(c, id) != DSV4_CLIENT_BUSY)
            cancelled = true;
        rc = dsv4_client_next(c, &ev, POLL_MS);
        if (rc == DSV4_CLIENT_NONE)
            continue;
        if (rc != 0) {
            fprintf(stderr, "dsv4-generate: %d %s: %s\n", rc, dsv4_client_strerror(rc),
                dsv4_client_errmsg(c));
            break;
        }
        if (ev.type == DSV4_CLIENT_EV_TOKENS) {
            /* a reader gone (a closed pipe: EPIPE, SIGPIPE being ignored)
             * or a full disk: the rest would go nowhere; cancelled */
            if ((fputs(ev.text, stdout) == EOF || fflush(stdout) != 0) && out_errno == 0) {
                out_errno = errno != 0 ? errno : EIO;
                (void)dsv4_client_cancel(c, id);
                break;
            }
            for (size_t i = 0; ev.logprobs != NULL && i < ev.n_tokens; i++) {
                const int32_t *tids;
                const float *tlps;
                size_t nt = dsv4_client_event_top(c, i, &tids, &tlps);

                fprintf(stderr, "%d %.6f", ev.tokens[i], ev.logprobs[i]);
                for (size_t j = 0; j < nt; j++)
                    fprintf(stderr, " %d:%.6f", tids[j], tlps[j]);
                fputc('\n', stderr);
            }
        } else if (ev.type == DSV4_CLIENT_EV_DONE) {
            static const char *const finish[] = { "?", "stop", "length", "cancelled" };

            putchar('\n');
            fflush(stdout);   /* before the stderr line: a shared file keeps the order */
            if (show_usage)
                fprintf(stderr, "finish=%s prompt_tokens=%u completion_tokens=%u\n",
                    finish[ev.finish >= 1 && ev.finish <= 3 ? ev.finish : 0], ev.prompt_tokens,
                    ev.completion_tokens);
            if (ev.finish != DSV4_CLIENT_FINISH_CANCELLED)
                status = 0;
            else if (cancelled)
                status = 130;
            else
                fprintf(stderr, "dsv4-generate: the request was cancelled by the server\n");
            break;
        } else if (ev.type == DSV4_CLIENT_EV_ERROR) {
            fprintf(stderr, "\ndsv4-generate: error %d %s: %s\n", ev.code,
                dsv4_client_strerror(ev.code), ev.message);
            break;
        }
    }
    /* A completion that did not reach its reader is not a success (the
     * errno of the first failed write: later calls overwrite it). */
    if ((fflush(stdout) != 0 || ferror(stdout)) && out_errno == 0)
        out_errno = errno != 0 ? errno : EIO;
    if (out_errno != 0) {
        fprintf(stderr, "dsv4-generate: standard output: %s\n", strerror(out_errno));
        status = 1;
    }
out:
    dsv4_client_close(c);
    free(prompt);
    free(ids);
    return status;
}
