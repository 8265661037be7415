/*
 * bench_opts.c — dsv4-bench command line.  Parsing returns errors instead of
 * exiting so the unit tests can check every refusal (tests/bench/).
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "common/cli.h"

#define DEFAULT_ENDPOINT "ipc:///run/dsv4/client.sock"

enum {
    OPT_CONNECT_TIMEOUT = 256, OPT_TOKEN_RANGE, OPT_TOP_P, OPT_TOP_K, OPT_TOP_LOGPROBS, OPT_NO_STREAM,
    OPT_TIMEOUT, OPT_PLOT_SCRIPT,
};

void
bench_usage(FILE *f)
{
    fprintf(f, BENCH_SYNOPSIS
        "  -e, --endpoint EP       scheduler client endpoint ($DSV4_ENDPOINT,\n"
        "                          default " DEFAULT_ENDPOINT ")\n"
        "  -K, --server-key FILE   CURVE public key file of the server\n"
        "      --connect-timeout MS  end a request with 504 when the server is silent\n"
        "                          this long past its 1 s heartbeat (default 5000;\n"
        "                          0 = never: a server gone for good then hangs the run)\n"
        "  -c, --concurrency LIST  closed-loop workers, 1..%d; a comma list runs a\n"
        "                          sweep (1,2,4,8,16,32,64); default 1\n"
        "  -p, --prompt-len SPEC   prompt tokens: N | uniform:LO:HI | normal:MEAN:SD |\n"
        "                          lognormal:MEAN:SD (default 512)\n"
        "  -l, --output-len SPEC   max_tokens per request, same forms (default 128)\n"
        "      --token-range LO:HI prompt ids drawn uniformly from [LO, HI)\n"
        "                          (default 1000:100000)\n"
        "  -s, --seed N            seed of lengths, prompts and sampling (default 1)\n"
        "  -t, --temperature T     (default 1)   --top-p P   --top-k K\n"
        "      --top-logprobs N    ask for each position's N (0..20) most likely tokens\n"
        "                          (the lists' cost; top_short counts short ones)\n"
        "      --no-stream         ask for one TOKENS event per request\n"
        "      --timeout MS        per-request deadline given to the server (0 = none)\n"
        "  -w, --warmup N          unmeasured requests first, per level\n"
        "                          (default: the level's concurrency)\n"
        "  -n, --requests N        measured requests per level (default 64)\n"
        "  -d, --duration S        measure requests started in S seconds instead\n"
        "  -j, --json FILE         JSON result (\"-\" = stdout, the default)\n"
        "  -P, --plot FILE.png     draw throughput and latency vs concurrency\n"
        "      --plot-script FILE  plot.py to run ($DSV4_BENCH_PLOT; default: installed)\n"
        "  -L, --label TEXT        series name in the JSON and the plot\n"
        "  -q, --quiet             no table on stderr\n"
        "  -h, --help              this help\n"
        "      --version           the version\n"
        "Exit status: 0 every measured request done, 1 some failed, a connection was\n"
        "lost, a level was interrupted or could not run, or an output could not be\n"
        "written, 2 usage (a malformed endpoint, an output that cannot be written).\n",
        BENCH_MAX_CONCURRENCY);
}

void
bench_opts_init(struct bench_opts *o)
{
    const char *ep = getenv("DSV4_ENDPOINT");

    memset(o, 0, sizeof(*o));
    o->endpoint = ep != NULL && *ep != '\0' ? ep : DEFAULT_ENDPOINT;
    o->connect_timeout_ms = 5000;
    o->concurrency[0] = 1;
    o->n_levels = 1;
    o->prompt = (struct bench_dist){ BENCH_DIST_FIXED, 512, 512 };
    o->output = (struct bench_dist){ BENCH_DIST_FIXED, 128, 128 };
    o->id_lo = 1000;
    o->id_hi = 100000;
    o->seed = 1;
    o->temperature = 1.0f;
    o->top_p = 1.0f;
    o->stream = 1;
    o->warmup = -1;
    o->requests = 64;
    o->json_path = "-";
}

/* Integer option in [lo, hi]. */
static int
opt_int(const char *s, long long lo, long long hi, const char *what, long long *v, char *err,
    size_t errlen)
{
    char *end;

    errno = 0;
    *v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || *v < lo || *v > hi) {
        snprintf(err, errlen, "bad %s '%s' (%lld..%lld)", what, s, lo, hi);
        return -1;
    }
    return 0;
}

/* Real option in [lo, hi] (lo excluded when open_lo). */
static int
opt_real(const char *s, double lo, double hi, int open_lo, const char *what, double *v,
    char *err, size_t errlen)
{
    char *end;

    errno = 0;
    *v = strtod(s, &end);
    /* open at lo: above it as a float too (1e-50 passed, then ran as 0) */
    if (errno != 0 || end == s || *end != '\0' || !isfinite(*v) || *v < lo || *v > hi ||
        (open_lo && (float)*v <= (float)lo)) {
        snprintf(err, errlen, "bad %s '%s' (%s%g..%g)", what, s, open_lo ? ">" : "", lo, hi);
        return -1;
    }
    return 0;
}

int
bench_parse_levels(struct bench_opts *o, const char *s, char *err, size_t errlen)
{
    char buf[256], *tok, *save = NULL;
    long long v;

    /* strtok_r would skip empty items: refuse ",1", "1,,2" and "1," here */
    if (strlen(s) >= sizeof(buf) || s[0] == '\0' || s[0] == ',' || s[strlen(s) - 1] == ',' ||
        strstr(s, ",,") != NULL) {
        snprintf(err, errlen, "bad concurrency list '%s'", s);
        return -1;
    }
    strcpy(buf, s);
    o->n_levels = 0;
    for (tok = strtok_r(buf, ",", &save); tok != NULL; tok = strtok_r(NULL, ",", &save)) {
        if (o->n_levels == BENCH_MAX_LEVELS) {
            snprintf(err, errlen, "more than %d concurrency levels", BENCH_MAX_LEVELS);
            return -1;
        }
        if (opt_int(tok, 1, BENCH_MAX_CONCURRENCY, "concurrency", &v, err, errlen) != 0)
            return -1;
        o->concurrency[o->n_levels++] = (int)v;
    }
    return 0;
}

/* "LO:HI" with 0 <= LO < HI <= INT32_MAX. */
static int
parse_range(struct bench_opts *o, const char *s, char *err, size_t errlen)
{
    const char *colon = strchr(s, ':');
    char lo[32];
    long long a, b;

    if (colon == NULL || (size_t)(colon - s) >= sizeof(lo)) {
        snprintf(err, errlen, "bad token range '%s' (LO:HI)", s);
        return -1;
    }
    memcpy(lo, s, (size_t)(colon - s));
    lo[colon - s] = '\0';
    if (opt_int(lo, 0, INT32_MAX - 1, "token range start", &a, err, errlen) != 0 ||
        opt_int(colon + 1, a + 1, INT32_MAX, "token range end", &b, err, errlen) != 0)
        return -1;
    o->id_lo = (int32_t)a;
    o->id_hi = (int32_t)b;
    return 0;
}

int
bench_opts_parse(struct bench_opts *o, int argc, char **argv, char *err, size_t errlen)
{
    static const struct option longopts[] = {
        { "endpoint", required_argument, NULL, 'e' },
        { "server-key", required_argument, NULL, 'K' },
        { "connect-timeout", required_argument, NULL, OPT_CONNECT_TIMEOUT },
        { "concurrency", required_argument, NULL, 'c' },
        { "prompt-len", required_argument, NULL, 'p' },
        { "output-len", required_argument, NULL, 'l' },
        { "token-range", required_argument, NULL, OPT_TOKEN_RANGE },
        { "seed", required_argument, NULL, 's' },
        { "temperature", required_argument, NULL, 't' },
        { "top-p", required_argument, NULL, OPT_TOP_P },
        { "top-k", required_argument, NULL, OPT_TOP_K },
        { "top-logprobs", required_argument, NULL, OPT_TOP_LOGPROBS },
        { "no-stream", no_argument, NULL, OPT_NO_STREAM },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "warmup", required_argument, NULL, 'w' },
        { "requests", required_argument, NULL, 'n' },
        { "duration", required_argument, NULL, 'd' },
        { "json", required_argument, NULL, 'j' },
        { "plot", required_argument, NULL, 'P' },
        { "plot-script", required_argument, NULL, OPT_PLOT_SCRIPT },
        { "label", required_argument, NULL, 'L' },
        { "quiet", no_argument, NULL, 'q' },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };
    long long v;
    double d;
    int ch, rc = 0, have_n = 0, have_d = 0;

    optind = 0;   /* GNU: full re-initialisation, so parsing can run again */
    opterr = 0;   /* errors are reported through err */
    while (rc == 0 &&
           (ch = getopt_long(argc, argv, ":e:K:c:p:l:s:t:w:n:d:j:P:L:qh", longopts, NULL)) != -1) {
        switch (ch) {
        case 'e': o->endpoint = optarg; break;
        case 'K': o->server_key_file = optarg; break;
        case OPT_CONNECT_TIMEOUT:
            rc = opt_int(optarg, 0, 86400000, "connect timeout", &v, err, errlen);
            o->connect_timeout_ms = (int)v;
            break;
        case 'c': rc = bench_parse_levels(o, optarg, err, errlen); break;
        case 'p': rc = bench_dist_parse(&o->prompt, optarg, err, errlen); break;
        case 'l': rc = bench_dist_parse(&o->output, optarg, err, errlen); break;
        case OPT_TOKEN_RANGE: rc = parse_range(o, optarg, err, errlen); break;
        case 's':
            rc = opt_int(optarg, 0, INT64_MAX, "seed", &v, err, errlen);
            o->seed = (uint64_t)v;
            break;
        case 't':
            rc = opt_real(optarg, 0, 10, 0, "temperature", &d, err, errlen);
            o->temperature = (float)d;
            break;
        case OPT_TOP_P:
            rc = opt_real(optarg, 0, 1, 1, "top-p", &d, err, errlen);
            o->top_p = (float)d;
            break;
        case OPT_TOP_K:
            rc = opt_int(optarg, 0, 1048576, "top-k", &v, err, errlen);
            o->top_k = (uint32_t)v;
            break;
        case OPT_TOP_LOGPROBS:
            rc = opt_int(optarg, 0, 20, "top-logprobs", &v, err, errlen);
            o->top_logprobs = (uint32_t)v;
            break;
        case OPT_NO_STREAM: o->stream = 0; break;
        case OPT_TIMEOUT:
            rc = opt_int(optarg, 0, 86400000, "timeout", &v, err, errlen);
            o->timeout_ms = (uint32_t)v;
            break;
        case 'w':
            rc = opt_int(optarg, 0, 1000000, "warm-up count", &v, err, errlen);
            o->warmup = (int)v;
            break;
        case 'n':
            rc = opt_int(optarg, 1, 100000000, "request count", &v, err, errlen);
            o->requests = (uint32_t)v;
            have_n = 1;
            break;
        case 'd':
            rc = opt_real(optarg, 0, 31 * 86400, 1, "duration", &o->duration_s, err, errlen);
            have_d = 1;
            break;
        case 'j': o->json_path = optarg; break;
        case 'P': o->plot_path = optarg; break;
        case OPT_PLOT_SCRIPT: o->plot_script = optarg; break;
        case 'L': o->label = optarg; break;
        case 'q': o->quiet = 1; break;
        case 'h':
            bench_usage(stdout);
            return 1;
        case DSV4_CLI_OPT_VERSION:
            /* not dsv4_cli_version, which exits: the unit tests call this parser */
            printf("dsv4-bench %s\n", DSV4_VERSION);
            return 1;
        case ':':
            snprintf(err, errlen, "option '%s' needs an argument", argv[optind - 1]);
            return -1;
        default:
            /* getopt_long sets optopt: an unknown short option's letter, a
             * long option's value when it was given an argument it takes
             * none of, 0 for an unknown or ambiguous long option (and then
             * argv[optind - 1] is it; for a short one in a cluster optind
             * has not moved past it) */
            /* (a long option given "=VALUE" it takes none of reports its
             * short letter as optopt: the word says which it was) */
            if (optopt > 0 && optopt < 256 && strncmp(argv[optind - 1], "--", 2) == 0 &&
                strchr(argv[optind - 1], '=') != NULL)
                snprintf(err, errlen, "option '%.*s' takes no argument",
                    (int)(strchr(argv[optind - 1], '=') - argv[optind - 1]), argv[optind - 1]);
            else if (optopt > 0 && optopt < 256)
                snprintf(err, errlen, "unknown option '-%c'", optopt);
            else if (optopt >= 256)
                snprintf(err, errlen, "option '%s' takes no argument", argv[optind - 1]);
            else
                snprintf(err, errlen, "unknown or ambiguous option '%s'", argv[optind - 1]);
            return -1;
        }
    }
    if (rc != 0)
        return -1;
    if (optind < argc) {
        snprintf(err, errlen, "unexpected argument '%s'", argv[optind]);
        return -1;
    }
    if ((o->json_path != NULL && o->json_path[0] == '\0') ||
        (o->plot_path != NULL && o->plot_path[0] == '\0')) {
        snprintf(err, errlen, "--json and --plot need a file name");
        return -1;
    }
    if (have_n && have_d) {
        snprintf(err, errlen, "--requests and --duration exclude each other");
        return -1;
    }
    if (o->plot_path != NULL && o->json_path != NULL && strcmp(o->json_path, "-") != 0 &&
        strcmp(o->json_path, o->plot_path) == 0) {
        snprintf(err, errlen, "--json and --plot name the same file");
        return -1;
    }
    return 0;
}
