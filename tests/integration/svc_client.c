/*
 * svc_client.c — the integration tests' load generator and oracle.
 *
 * Service mode (libdsv4client):
 *   svc_client -e ENDPOINT -p PROMPTS -n MAX_TOKENS [-w WINDOW] [-r REPEAT]
 *              [--timeout MS] [--cancel SEED] [--progress FILE]
 * submits every prompt (REPEAT times each; at most WINDOW in flight, default
 * all at once) as a greedy request of token ids and prints one line per
 * request, in submission order:
 *   <i> done <finish> <n> <tok>...        (finish: stop, length, cancelled)
 *   <i> error <code> <n> <tok>...         (tokens received before the error)
 * With --cancel each request is cancelled at a random moment drawn from SEED:
 * right after submission, after the OK, or after k of its tokens.  With
 * --progress the file gets one line "<i> <n_tokens>" per TOKENS event, so a
 * driver can wait until streams are under way.
 *
 * Reference mode (the single-process forward, kernels/forward.h):
 *   svc_client --reference CHECKPOINT -p PROMPTS -n MAX_TOKENS
 * prints "<i> done <finish> <n> <tok>..." computed on one CPU backend (REF
 * numerics, 1 thread): greedy argmax through the backend's sample op, the
 * checkpoint's EOS ends a sequence (included), as the scheduler does.  With
 * --top K (1 .. 20) it also prints, after those lines, one line per output
 * token with its K most likely tokens (the backend's sample_top):
 *   <i> top <j> <id>:<logprob> ...     (logprob as %.9g; j the token's index)
 *
 * PROMPTS: one prompt per line, token ids separated by blanks.
 * DSV4_SERVER_KEY_FILE in the environment names the server's CURVE public key
 * (tcp:// endpoints).
 *
 * Exit status: 0 when every request got its final event, 1 otherwise, 2 usage.
 */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/weights.h"
#include "dsv4/client.h"
#include "kernels/backend.h"
#include "kernels/forward.h"

#define MAX_PROMPTS 4096
#define MAX_PROMPT_LEN 4096

struct prompt {
    int32_t *ids;
    int n;
};

/* One request of the run. */
struct job {
    int prompt;            /* index into prompts */
    uint64_t id;           /* client id; 0 = not submitted */
    int32_t *out;          /* received tokens (max_tokens + 1 room) */
    int n_out;
    bool accepted, final;
    char status[16];       /* "done" / "error" */
    char detail[16];       /* finish or code */
    int cancel_at;         /* -1 never; 0 right after submit; 1 after OK;
                              k+1 after k tokens */
    bool cancel_sent;
};

static struct prompt prompts[MAX_PROMPTS];
static int n_prompts;

static void __attribute__((noreturn))
usage(void)
{
    fprintf(stderr, "usage: svc_client -e endpoint -p prompts -n max_tokens [-w window]\n"
        "                  [-r repeat] [--timeout ms] [--cancel seed] [--progress file]\n"
        "       svc_client --reference checkpoint -p prompts -n max_tokens [--top K]\n");
    exit(2);
}

static void
read_prompts(const char *path)
{
    char *line = NULL, *p, *end;
    size_t cap = 0;
    FILE *fp;
    long v;

    if ((fp = fopen(path, "r")) == NULL) {
        fprintf(stderr, "svc_client: %s: %s\n", path, strerror(errno));
        exit(2);
    }
    while (getline(&line, &cap, fp) >= 0 && n_prompts < MAX_PROMPTS) {
        struct prompt *pr = &prompts[n_prompts];

        pr->ids = calloc(MAX_PROMPT_LEN, sizeof(int32_t));
        for (p = line; pr->n < MAX_PROMPT_LEN; p = end) {
            v = strtol(p, &end, 10);
            if (end == p)
                break;
            pr->ids[pr->n++] = (int32_t)v;
        }
        if (pr->n > 0)
            n_prompts++;
        else
            free(pr->ids);
    }
    free(line);
    fclose(fp);
}

/* --- Reference: the single-process forward --------------------------------- */

static int
run_reference(const char *dir, int max_tokens, int top)
{
    struct dsv4_weights w;
    struct dsv4_backend *be;
    struct dsv4_model *m;
    struct dsv4_model_opts mo;
    struct dsv4_sample_params sp;
    struct dsv4_batch b;
    int *n_top_out;
    int32_t slot = 0, n, tok, *tid;
    float *logits, lp, *tlp;
    int i, j, V, max_len = 1;

    if (dsv4_weights_load(&w, dir) != DSV4_OK ||
        dsv4_backend_create(&be, "cpu", DSV4_NUMERICS_REF, 1) != DSV4_OK) {
        fprintf(stderr, "svc_client: reference: %s\n", dsv4_errmsg());
        return 1;
    }
    for (i = 0; i < n_prompts; i++)
        if (prompts[i].n > max_len)
            max_len = prompts[i].n;
    n_top_out = calloc((size_t)n_prompts, sizeof(int));
    if (n_top_out == NULL)
        return 1;
    memset(&mo, 0, sizeof(mo));
    mo.n_slots = 1;
    mo.max_seq_len = max_len + max_tokens + 1;
    mo.max_rows = max_len;
    if (dsv4_model_create(&m, be, &w, &mo) != DSV4_OK) {
        fprintf(stderr, "svc_client: reference: %s\n", dsv4_errmsg());
        return 1;
    }
    V = dsv4_model_vocab(m);
    logits = malloc((size_t)V * sizeof(float));
    /* every output token's K best, printed after the outputs */
    tid = top > 0 ? malloc((size_t)n_prompts * MAX_PROMPT_LEN * DSV4_TOP_MAX * sizeof(int32_t))
                  : NULL;
    tlp = top > 0 ? malloc((size_t)n_prompts * MAX_PROMPT_LEN * DSV4_TOP_MAX * sizeof(float))
                  : NULL;
    if (logits == NULL || (top > 0 && (tid == NULL || tlp == NULL))) {
        fprintf(stderr, "svc_client: reference: out of memory\n");
        return 1;
    }
    memset(&sp, 0, sizeof(sp));
    sp.temperature = 0.0f;
    sp.top_p = 1.0f;
    sp.n_top = top;
    for (i = 0; i < n_prompts; i++) {
        int32_t out[MAX_PROMPT_LEN];
        int n_out = 0;
        const char *finish = "length";

        dsv4_model_seq_reset(m, 0);
        b.n_seqs = 1;
        b.slot = &slot;
        n = prompts[i].n;
        b.n_tokens = &n;
        b.tokens = prompts[i].ids;
        for (j = 0; j < max_tokens && j < MAX_PROMPT_LEN; j++) {
            if (dsv4_model_forward(m, &b, logits, 0) != DSV4_OK) {
                fprintf(stderr, "svc_client: reference: %s\n", dsv4_errmsg());
                return 1;
            }
            sp.step = (uint64_t)j;
            be->ops->sample(be, &tok, &lp, logits, &sp, 1, V);
            if (top > 0 && be->ops->sample_top(be, tid + ((size_t)i * MAX_PROMPT_LEN + n_out) *
                                               DSV4_TOP_MAX, tlp + ((size_t)i * MAX_PROMPT_LEN +
                                               n_out) * DSV4_TOP_MAX, logits, &sp, 1, V) !=
                DSV4_OK) {
                fprintf(stderr, "svc_client: reference: %s\n", dsv4_errmsg());
                return 1;
            }
            out[n_out++] = tok;
            if (tok == w.cfg.eos_token_id) {
                finish = "stop";
                break;
            }
            n = 1;
            b.tokens = &out[n_out - 1];
        }
        printf("%d done %s %d", i, finish, n_out);
        for (j = 0; j < n_out; j++)
            printf(" %d", out[j]);
        printf("\n");
        n_top_out[i] = n_out;
    }
    for (i = 0; i < n_prompts && top > 0; i++) {
        for (j = 0; j < n_top_out[i]; j++) {
            size_t at = ((size_t)i * MAX_PROMPT_LEN + j) * DSV4_TOP_MAX;

            printf("%d top %d", i, j);
            for (int k = 0; k < top && k < V; k++)
                printf(" %d:%.9g", tid[at + k], (double)tlp[at + k]);
            printf("\n");
        }
    }
    free(n_top_out);
    free(tid);
    free(tlp);
    free(logits);
    dsv4_model_free(m);
    dsv4_backend_destroy(be);
    dsv4_weights_free(&w);
    return 0;
}

/* --- Service mode ------------------------------------------------------------ */

/* xorshift64*: the cancel moments, reproducible from --cancel SEED. */
static uint64_t
rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ULL;
}

static struct job *
job_by_id(struct job *jobs, int n, uint64_t id)
{
    int i;

    for (i = 0; i < n; i++)
        if (jobs[i].id == id)
            return &jobs[i];
    return NULL;
}

static void
job_cancel(struct dsv4_client *c, struct job *j)
{
    if (j->cancel_sent || j->final)
        return;
    j->cancel_sent = true;
    (void)dsv4_client_cancel(c, j->id);
}

static int
run_service(const char *endpoint, int max_tokens, int window, int repeat,
    uint32_t timeout_ms, bool cancel, uint64_t seed, const char *progress_path)
{
    struct dsv4_client_opts o;
    struct dsv4_client_params p;
    struct dsv4_client_event ev;
    struct dsv4_client *c;
    struct job *jobs, *j;
    FILE *progress = NULL;
    int n_jobs = n_prompts * repeat, next = 0, in_flight = 0, n_final = 0;
    int i, rc;

    jobs = calloc((size_t)n_jobs, sizeof(*jobs));
    for (i = 0; i < n_jobs; i++) {
        jobs[i].prompt = i % n_prompts;
        jobs[i].out = malloc(((size_t)max_tokens + 1) * sizeof(int32_t));
        jobs[i].cancel_at = -1;
        if (cancel)
            jobs[i].cancel_at = (int)(rng_next(&seed) % (uint64_t)(max_tokens + 1));
    }
    if (progress_path != NULL && (progress = fopen(progress_path, "w")) == NULL) {
        fprintf(stderr, "svc_client: %s: %s\n", progress_path, strerror(errno));
        return 2;
    }
    dsv4_client_opts_init(&o);
    o.connect_timeout_ms = 10000;
    /* CURVE on a tcp:// endpoint (the multi-host rig): the server's key file */
    o.server_key_file = getenv("DSV4_SERVER_KEY_FILE");
    if ((rc = dsv4_client_connect(endpoint, &o, &c)) != 0) {
        fprintf(stderr, "svc_client: connect %s: %s\n", endpoint, dsv4_client_strerror(rc));
        return 1;
    }
    dsv4_client_params_init(&p);
    p.temperature = 0.0f;
    p.max_tokens = (uint32_t)max_tokens;
    p.timeout_ms = timeout_ms;
    p.tag = "svc_client";
    while (n_final < n_jobs) {
        while (next < n_jobs && (window <= 0 || in_flight < window)) {
            j = &jobs[next++];
            rc = dsv4_client_submit_tokens(c, prompts[j->prompt].ids,
                (size_t)prompts[j->prompt].n, &p, &j->id);
            if (rc != 0) {
                j->final = true;
                snprintf(j->status, sizeof(j->status), "error");
                snprintf(j->detail, sizeof(j->detail), "%d", rc);
                n_final++;
                continue;
            }
            in_flight++;
            if (j->cancel_at == 0)
                job_cancel(c, j);
        }
        rc = dsv4_client_next(c, &ev, 60000);
        if (rc == DSV4_CLIENT_NONE)
            continue;
        if (rc != 0) {
            fprintf(stderr, "svc_client: connection failed: %s\n", dsv4_client_strerror(rc));
            break;
        }
        if ((j = job_by_id(jobs, next, ev.id)) == NULL || j->final)
            continue;
        switch (ev.type) {
        case DSV4_CLIENT_EV_ACCEPTED:
            j->accepted = true;
            if (j->cancel_at == 1)
                job_cancel(c, j);
            break;
        case DSV4_CLIENT_EV_TOKENS:
            for (i = 0; i < (int)ev.n_tokens && j->n_out <= max_tokens; i++)
                j->out[j->n_out++] = ev.tokens[i];
            if (ev.n_tokens > (size_t)max_tokens)
                j->n_out = max_tokens + 1;  /* too many: shows in the output */
            if (progress != NULL) {
                fprintf(progress, "%d %d\n", (int)(j - jobs), j->n_out);
                fflush(progress);
            }
            if (j->cancel_at > 1 && j->n_out >= j->cancel_at - 1)
                job_cancel(c, j);
            break;
        case DSV4_CLIENT_EV_DONE:
        case DSV4_CLIENT_EV_ERROR:
            j->final = true;
            n_final++;
            in_flight--;
            if (ev.type == DSV4_CLIENT_EV_DONE) {
                snprintf(j->status, sizeof(j->status), "done");
                snprintf(j->detail, sizeof(j->detail), "%s",
                    ev.finish == DSV4_CLIENT_FINISH_STOP ? "stop" :
                    ev.finish == DSV4_CLIENT_FINISH_LENGTH ? "length" : "cancelled");
            } else {
                snprintf(j->status, sizeof(j->status), "error");
                snprintf(j->detail, sizeof(j->detail), "%d", ev.code);
                fprintf(stderr, "svc_client: request %d: error %d: %s\n",
                    (int)(j - jobs), ev.code, ev.message != NULL ? ev.message : "");
            }
            break;
        }
    }
    for (i = 0; i < n_jobs; i++) {
        j = &jobs[i];
        printf("%d %s %s %d", i, j->final ? j->status : "lost",
            j->final ? j->detail : "-", j->n_out);
        for (int k = 0; k < j->n_out; k++)
            printf(" %d", j->out[k]);
        printf("\n");
        free(j->out);
    }
    free(jobs);
    dsv4_client_close(c);
    if (progress != NULL)
        fclose(progress);
    return n_final == n_jobs ? 0 : 1;
}

int
main(int argc, char **argv)
{
    enum { OPT_REFERENCE = 256, OPT_TIMEOUT, OPT_CANCEL, OPT_PROGRESS, OPT_TOP };
    static const struct option longopts[] = {
        { "reference", required_argument, NULL, OPT_REFERENCE },
        { "timeout", required_argument, NULL, OPT_TIMEOUT },
        { "cancel", required_argument, NULL, OPT_CANCEL },
        { "progress", required_argument, NULL, OPT_PROGRESS },
        { "top", required_argument, NULL, OPT_TOP },
        { NULL, 0, NULL, 0 },
    };
    const char *endpoint = NULL, *prompts_path = NULL, *reference = NULL;
    const char *progress = NULL;
    int max_tokens = 16, window = 0, repeat = 1, top = 0, ch;
    uint32_t timeout_ms = 0;
    uint64_t seed = 0;
    bool cancel = false;

    while ((ch = getopt_long(argc, argv, "e:p:n:w:r:", longopts, NULL)) != -1) {
        switch (ch) {
        case 'e': endpoint = optarg; break;
        case 'p': prompts_path = optarg; break;
        case 'n': max_tokens = atoi(optarg); break;
        case 'w': window = atoi(optarg); break;
        case 'r': repeat = atoi(optarg); break;
        case OPT_REFERENCE: reference = optarg; break;
        case OPT_TIMEOUT: timeout_ms = (uint32_t)strtoul(optarg, NULL, 10); break;
        case OPT_CANCEL:
            cancel = true;
            seed = strtoull(optarg, NULL, 10) | 1;
            break;
        case OPT_PROGRESS: progress = optarg; break;
        case OPT_TOP: top = atoi(optarg); break;
        default: usage();
        }
    }
    if (prompts_path == NULL || max_tokens < 1 || max_tokens >= MAX_PROMPT_LEN ||
        repeat < 1 || (reference == NULL && endpoint == NULL) || top < 0 ||
        top > DSV4_TOP_MAX || (top > 0 && reference == NULL))
        usage();
    read_prompts(prompts_path);
    if (n_prompts == 0 || (long)n_prompts * repeat > 1000000)
        usage();
    setvbuf(stdout, NULL, _IOFBF, 1 << 16);
    if (reference != NULL)
        return run_reference(reference, max_tokens, top);
    return run_service(endpoint, max_tokens, window, repeat, timeout_ms, cancel, seed,
        progress);
}
