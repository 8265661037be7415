/*
 * test_share_gpu.c — one copy of the weights per GPU shared by two processes
 * (kernels/cuda_share.h over the socket of common/weights_share.h; docs/gpu.md
 * "Weight sharing").
 *
 * usage: test_share_gpu [LAYERS]     (default 4; the flash widths cut to
 *                                     LAYERS layers + the MTP layer)
 *
 * The program runs itself three times (fork + exec, so no process inherits
 * a CUDA context; this parent never touches CUDA) and talks to the workers
 * over pipes ("key value" lines out, commands in):
 *   A "serve": synthetic weights (seed SEED) in a shareable arena, served on
 *     a socket in a temporary directory; reports hashes of a set of tensors
 *     (their bytes, and their offsets from the embedding) and of the logits
 *     of a fixed script (prefill of 4 prompts, 8 greedy decode steps).
 *   B "map": fetches the descriptor, checks fingerprint and device, maps the
 *     weights (layout only), reports the same hashes and how much device
 *     memory the import took, then serves the socket too (standing by).
 *   Then A is killed with SIGKILL; B runs the script again on a new model
 *     (the memory stayed) and re-hashes the tensors.
 *   C "map": a restarted rank: fetches from B (which took the socket over
 *     from A's stale file) and reports the same hashes.
 * Pass: every tensor hash, offset hash and logits hash equal to A's (bit for
 * bit), each import took less than a quarter of the weights' bytes of device
 * memory, C's copy names A as its builder, every worker exits 0.
 *
 * Exit status: 0 pass, 1 failure, 77 no CUDA device.
 */
#include <sys/types.h>
#include <sys/wait.h>

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "common/model_config.h"
#include "common/weights.h"
#include "common/weights_share.h"
#include "kernels/backend.h"
#include "kernels/cuda_share.h"
#include "kernels/cuda_weights.h"
#include "kernels/forward.h"
#include "tests/gpu/gpu_test_util.h"

#define SEED 17
#define NSEQ 4
#define STEPS 8
#define OWNER "test-serve"
#define MIB (1024.0 * 1024.0)

/* --- workers (CUDA) ----------------------------------------------------------------- */

static struct dsv4_config cfg;

/* One report line to the parent. */
static void
say(const char *key, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void
say(const char *key, const char *fmt, ...)
{
    va_list ap;

    printf("%s ", key);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
}

/* FNV-1a continued over n bytes of device memory. */
static uint64_t
dev_hash(uint64_t h, const void *d, size_t n)
{
    static unsigned char *buf;
    const size_t chunk = 64u << 20;

    if (buf == NULL && (buf = malloc(chunk)) == NULL) {
        fprintf(stderr, "no host memory\n");
        exit(1);
    }
    for (size_t at = 0; at < n; at += chunk) {
        size_t len = n - at < chunk ? n - at : chunk;

        if (cudaMemcpy(buf, (const char *)d + at, len, cudaMemcpyDeviceToHost) != cudaSuccess) {
            fprintf(stderr, "cudaMemcpy from the weights failed\n");
            exit(1);
        }
        h = dsv4_wshare_hash(h, buf, len);
    }
    return h;
}

struct tensor_hashes {
    uint64_t bytes;     /* the tensors' contents */
    uint64_t offsets;   /* their places relative to the embedding */
};

static void
add(struct tensor_hashes *t, const void *base, const void *p, size_t n)
{
    int64_t off = (const char *)p - (const char *)base;

    if (p == NULL || n == 0)
        return;
    t->bytes = dev_hash(t->bytes, p, n);
    t->offsets = dsv4_wshare_hash(t->offsets, &off, sizeof(off));
}

static void
add_linear(struct tensor_hashes *t, const void *base, const struct dsv4_linear *L)
{
    size_t n = (size_t)L->n_out, k = (size_t)L->n_in;

    switch (L->fmt) {
    case DSV4_WFMT_BF16:
        add(t, base, L->w, n * k * 2);
        break;
    case DSV4_WFMT_FP8:
        add(t, base, L->w, n * k);
        add(t, base, L->scale, ((n + 127) / 128) * ((k + 127) / 128));
        break;
    case DSV4_WFMT_FP4:
        add(t, base, L->w, n * k / 2);
        add(t, base, L->scale, n * (k / 32));
        break;
    }
}

/* Hashes of a sample of tensors: the whole embedding and head, and from
 * every layer its norms, attention projections, router, first and last
 * routed expert, shared expert and sink. */
static struct tensor_hashes
hash_tensors(const struct dsv4_weights *w)
{
    struct tensor_hashes t = { DSV4_WSHARE_FNV0, DSV4_WSHARE_FNV0 };
    size_t V = (size_t)cfg.vocab_size, D = (size_t)cfg.hidden_size, n = (size_t)cfg.hc_mult;
    int E = cfg.n_routed_experts;
    const void *base = w->embed;

    add(&t, base, w->embed, V * D * 2);
    add(&t, base, w->head, V * D * 2);
    add(&t, base, w->norm, D * 2);
    add(&t, base, w->hc_head.fn, n * n * D * 4);
    for (int l = 0; l < w->n_layers; l++) {
        const struct dsv4_layer_w *lw = &w->layers[l];

        add(&t, base, lw->attn_norm, D * 2);
        add(&t, base, lw->ffn_norm, D * 2);
        add(&t, base, lw->attn_sink, (size_t)cfg.num_attention_heads * 4);
        add_linear(&t, base, &lw->wq_a);
        add_linear(&t, base, &lw->wq_b);
        add_linear(&t, base, &lw->wkv);
        add_linear(&t, base, &lw->wo_b);
        add_linear(&t, base, &lw->gate);
        add_linear(&t, base, &lw->shared.w3);
        if (lw->experts != NULL) {
            add_linear(&t, base, &lw->experts[0].w1);
            add_linear(&t, base, &lw->experts[E - 1].w2);
        }
    }
    return t;
}

/* The script: NSEQ prompts prefilled in one call, STEPS greedy decode steps
 * of all of them; FNV-1a of every logits row. */
static uint64_t
script(struct dsv4_backend *be, const struct dsv4_weights *w)
{
    struct dsv4_model *m = NULL;
    struct dsv4_model_opts o;
    int V = cfg.vocab_size, rows = 0, plen[NSEQ] = { 7, 19, 33, 64 };
    int32_t slot[NSEQ], ntok[NSEQ], cur[NSEQ], *tok;
    float *lg;
    uint64_t h = DSV4_WSHARE_FNV0;

    for (int i = 0; i < NSEQ; i++) {
        rows += plen[i];
        slot[i] = i;
        ntok[i] = 1;
    }
    memset(&o, 0, sizeof(o));
    o.n_slots = NSEQ;
    o.max_seq_len = 128;
    o.max_rows = rows;
    o.graphs = 1;
    TRY("model", dsv4_model_create(&m, be, w, &o));
    tok = malloc((size_t)rows * sizeof(*tok));
    lg = malloc((size_t)NSEQ * V * sizeof(float));
    if (tok == NULL || lg == NULL) {
        fprintf(stderr, "no host memory\n");
        exit(1);
    }
    for (int i = 0; i < rows; i++)
        tok[i] = (int32_t)((i * 2654435761u + 11) % (unsigned)V);
    {
        struct dsv4_batch b = { NSEQ, slot, plen, tok };

        TRY("prefill", dsv4_model_forward(m, &b, lg, 0));
    }
    for (int s = 0; s <= STEPS; s++) {
        h = dsv4_wshare_hash(h, lg, (size_t)NSEQ * V * sizeof(float));
        for (int i = 0; i < NSEQ; i++)
            cur[i] = argmax(lg + (size_t)i * V, V);
        if (s < STEPS) {
            struct dsv4_batch b = { NSEQ, slot, ntok, cur };

            TRY("decode", dsv4_model_forward(m, &b, lg, 0));
        }
    }
    dsv4_model_free(m);
    free(tok);
    free(lg);
    return h;
}

static void
report(const char *suffix, struct dsv4_backend *be, const struct dsv4_weights *w)
{
    struct tensor_hashes t = hash_tensors(w);
    char k1[32], k2[32], k3[32];

    snprintf(k1, sizeof(k1), "tensors%s", suffix);
    snprintf(k2, sizeof(k2), "offsets%s", suffix);
    snprintf(k3, sizeof(k3), "logits%s", suffix);
    say(k1, "%016" PRIx64, t.bytes);
    say(k2, "%016" PRIx64, t.offsets);
    say(k3, "%016" PRIx64, script(be, w));
}

/* Wait for a command line from the parent; NULL at EOF. */
static char *
command(char *buf, size_t n)
{
    if (fgets(buf, (int)n, stdin) == NULL)
        return NULL;
    buf[strcspn(buf, "\n")] = '\0';
    return buf;
}

static int
worker(const char *mode, const char *sock, int layers)
{
    struct dsv4_backend *be = NULL;
    struct dsv4_weights w;
    struct dsv4_cuda_arena a;
    struct dsv4_wshare_hdr hdr;
    struct dsv4_wshare_server *srv = NULL;
    uint8_t uuid[16];
    uint64_t fp;
    int n_dev = 0, fd;
    char cmd[64];

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1)
        return 77;
    flash_cut(&cfg, layers);
    TRY("cuda backend", dsv4_cuda_backend_create(&be, DSV4_NUMERICS_REF, 0));
    if (!dsv4_cuda_share_supported(be)) {
        fprintf(stderr, "%s: sharing not supported: %s\n", mode, dsv4_errmsg());
        return 1;
    }
    TRY("uuid", dsv4_cuda_device_uuid(be, uuid));
    snprintf(cmd, sizeof(cmd), "synthetic:%d", SEED);
    fp = dsv4_wshare_fingerprint(&cfg, cmd, 0, 1);
    memset(&w, 0, sizeof(w));
    memset(&a, 0, sizeof(a));
    if (strcmp(mode, "serve") == 0) {
        a.kind = DSV4_CUDA_ARENA_SHAREABLE;
        TRY("shareable synthetic weights",
            dsv4_cuda_weights_synthetic_arena(be, &w, &cfg, SEED, 0, 1, DSV4_GROUP_SPLIT_EP, NULL, &a));
        memset(&hdr, 0, sizeof(hdr));
        fd = dsv4_cuda_weights_share_fd(&w, &hdr.alloc_bytes, &hdr.used_bytes, &hdr.layout);
        if (fd < 0) {
            fprintf(stderr, "serve: no shareable descriptor\n");
            return 1;
        }
        hdr.fingerprint = fp;
        memcpy(hdr.device_uuid, uuid, 16);
        snprintf(hdr.owner, sizeof(hdr.owner), "%s", OWNER);
        TRY("serve", dsv4_wshare_serve(&srv, sock, fd, &hdr));
        say("arena_mib", "%.1f", hdr.used_bytes / MIB);
        report("", be, &w);
    } else {
        size_t f0, f1, tot;

        TRY("fetch", dsv4_wshare_fetch(sock, 5000, &fd, &hdr));
        TRY("match", dsv4_wshare_match(&hdr, fp, uuid));
        say("owner", "%s", hdr.owner);
        a.kind = DSV4_CUDA_ARENA_IMPORT;
        a.fd = fd;
        a.alloc_bytes = hdr.alloc_bytes;
        a.used_bytes = hdr.used_bytes;
        a.layout = hdr.layout;
        cudaDeviceSynchronize();
        cudaMemGetInfo(&f0, &tot);
        TRY("import", dsv4_cuda_weights_synthetic_arena(be, &w, &cfg, SEED, 0, 1, DSV4_GROUP_SPLIT_EP, NULL, &a));
        cudaDeviceSynchronize();
        cudaMemGetInfo(&f1, &tot);
        say("import_mib", "%.1f", f0 > f1 ? (f0 - f1) / MIB : 0.0);
        close(fd);   /* the weights hold their own */
        report("", be, &w);
        fd = dsv4_cuda_weights_share_fd(&w, &hdr.alloc_bytes, &hdr.used_bytes, &hdr.layout);
        TRY("serve", dsv4_wshare_serve(&srv, sock, fd, &hdr));
    }
    say("ready", "%d", (int)getpid());
    while (command(cmd, sizeof(cmd)) != NULL && strcmp(cmd, "quit") != 0) {
        if (strcmp(cmd, "again") == 0)
            report("2", be, &w);
        else if (strcmp(cmd, "serving") == 0)
            say("serving", "%d", dsv4_wshare_serving(srv));
    }
    dsv4_wshare_stop(srv);
    dsv4_cuda_weights_free(be, &w);
    dsv4_backend_destroy(be);
    return 0;
}

/* --- parent (no CUDA) ------------------------------------------------------------------- */

#define MAXKV 16

struct proc {
    const char *name;
    pid_t pid;
    FILE *out;          /* its reports */
    FILE *in;           /* our commands */
    char key[MAXKV][32], val[MAXKV][64];
    int n;
};

static int failures;

static void
check(int ok, const char *what)
{
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    failures += !ok;
}

static void
spawn(struct proc *p, const char *name, const char *mode, const char *sock, const char *layers)
{
    int to[2], from[2];

    memset(p, 0, sizeof(*p));
    p->name = name;
    if (pipe(to) != 0 || pipe(from) != 0) {
        perror("pipe");
        exit(1);
    }
    fflush(NULL);
    p->pid = fork();
    if (p->pid < 0) {
        perror("fork");
        exit(1);
    }
    if (p->pid == 0) {
        dup2(to[0], 0);
        dup2(from[1], 1);
        close(to[0]);
        close(to[1]);
        close(from[0]);
        close(from[1]);
        execl("/proc/self/exe", "test_share_gpu", mode, sock, layers, (char *)NULL);
        perror("exec");
        _exit(1);
    }
    close(to[0]);
    close(from[1]);
    p->out = fdopen(from[0], "r");
    p->in = fdopen(to[1], "w");
}

/* Read reports until `until` (kept too); 0 at EOF. */
static int
collect(struct proc *p, const char *until)
{
    char line[160];

    while (fgets(line, sizeof(line), p->out) != NULL) {
        char k[32], v[64];

        if (sscanf(line, "%31s %63s", k, v) != 2)
            continue;
        printf("  %s: %s %s\n", p->name, k, v);
        if (p->n < MAXKV) {
            snprintf(p->key[p->n], sizeof(p->key[0]), "%s", k);
            snprintf(p->val[p->n], sizeof(p->val[0]), "%s", v);
            p->n++;
        }
        if (strcmp(k, until) == 0)
            return 1;
    }
    return 0;
}

static const char *
get(const struct proc *p, const char *key)
{
    for (int i = p->n - 1; i >= 0; i--)
        if (strcmp(p->key[i], key) == 0)
            return p->val[i];
    return "(none)";
}

static void
send_cmd(struct proc *p, const char *cmd)
{
    fprintf(p->in, "%s\n", cmd);
    fflush(p->in);
}

static int
finish(struct proc *p)
{
    int status = 0;

    if (p->in != NULL)
        fclose(p->in);
    p->in = NULL;
    if (waitpid(p->pid, &status, 0) != p->pid)
        return -1;
    fclose(p->out);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void
same(const struct proc *a, const char *ka, const struct proc *b, const char *kb)
{
    char what[128];

    snprintf(what, sizeof(what), "%s %s == %s %s (%s)", b->name, kb, a->name, ka, get(a, ka));
    check(strcmp(get(a, ka), get(b, kb)) == 0 && strcmp(get(a, ka), "(none)") != 0, what);
}

static void
small_import(const struct proc *a, const struct proc *b)
{
    char what[128];
    double arena = atof(get(a, "arena_mib")), imp = atof(get(b, "import_mib"));

    snprintf(what, sizeof(what), "%s's import took %.1f MiB of device memory (weights %.1f MiB)",
             b->name, imp, arena);
    check(arena > 0 && imp < arena / 4, what);
}

int
main(int argc, char **argv)
{
    struct proc A, B, C;
    static const uint8_t zero_uuid[16];   /* the test's own socket: any GPU key */
    char dir[] = "/tmp/dsv4share.XXXXXX", sock[128], cmd[160];
    const char *layers = "4";
    int rc;

    if (argc == 4)
        return worker(argv[1], argv[2], atoi(argv[3]));
    if (argc == 2)
        layers = argv[1];
    else if (argc != 1) {
        fprintf(stderr, "usage: test_share_gpu [LAYERS]\n");
        return 2;
    }
    if (mkdtemp(dir) == NULL ||
        dsv4_wshare_path(sock, sizeof(sock), dir, zero_uuid, 0, 0, 1) != DSV4_OK) {
        perror("mkdtemp");
        return 1;
    }
    printf("test_share_gpu: flash widths, %s layers, socket %s\n", layers, sock);

    spawn(&A, "A", "serve", sock, layers);
    if (!collect(&A, "ready")) {
        rc = finish(&A);
        rmdir(dir);
        if (rc == 77) {
            printf("SKIP: no CUDA device\n");
            return 77;
        }
        printf("FAIL A (serve) exited %d before serving\n", rc);
        return 1;
    }
    spawn(&B, "B", "map", sock, layers);
    check(collect(&B, "ready"), "B mapped A's weights");
    check(strcmp(get(&B, "owner"), OWNER) == 0, "B's copy was built by A");
    same(&A, "tensors", &B, "tensors");
    same(&A, "offsets", &B, "offsets");
    same(&A, "logits", &B, "logits");
    small_import(&A, &B);

    /* A dies (kill -9): B keeps the memory and takes the socket over */
    kill(A.pid, SIGKILL);
    rc = finish(&A);
    check(rc == 128 + SIGKILL, "A killed");
    send_cmd(&B, "again");
    check(collect(&B, "logits2"), "B ran again after A's death");
    same(&A, "tensors", &B, "tensors2");
    same(&A, "logits", &B, "logits2");

    /* C: a restarted rank maps the survivor's copy */
    spawn(&C, "C", "map", sock, layers);
    check(collect(&C, "ready"), "C mapped the weights from B");
    check(strcmp(get(&C, "owner"), OWNER) == 0, "C's copy still names its builder");
    same(&A, "tensors", &C, "tensors");
    same(&A, "offsets", &C, "offsets");
    same(&A, "logits", &C, "logits");
    small_import(&A, &C);
    send_cmd(&B, "serving");
    check(collect(&B, "serving") && strcmp(get(&B, "serving"), "1") == 0,
          "B serves the socket (took it over from A's stale file)");

    send_cmd(&C, "quit");
    send_cmd(&B, "quit");
    check(finish(&C) == 0, "C exited 0");
    check(finish(&B) == 0, "B exited 0");
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    printf("%s: %d failed check(s)\n", failures == 0 ? "PASS" : "FAIL", failures);
    return failures == 0 ? 0 : 1;
}
