/*
 * test_kv_cudaipc.c — the cudaipc decode-state transport (ipc/kv_cudaipc.c)
 * between two processes on the GPU machine: handoff time and bit-identical
 * continuation (issue 7: "decode state handed from prefill to decode through
 * CUDA IPC handles", "handoff of an 8,192-token prompt <= 1 ms").
 *
 * usage: test_kv_cudaipc [PROMPT [STEPS [ROUNDS]]]
 *        (defaults 8192 tokens, 16 decode steps, 3 handoffs)
 *
 * The program forks before touching CUDA (a forked child cannot use its
 * parent's CUDA context); the two processes talk over pipes:
 *   parent (the prefill side): device 0; the flash widths cut to 2 layers
 *     (compress ratios 4 and 128, so every kind of state is there) with
 *     synthetic weights (seed SEED); prefills PROMPT tokens into slot 0 in
 *     chunks, then ROUNDS times: exports the slot through the transport
 *     (cudaMalloc'd region + cudaIpcGetMemHandle + device copies) and sends
 *     the descriptor.  It also imports its own region into slot 1 directly
 *     (same process: plain device copies) as a second check.
 *   child (the decode side): device 1 when the machine has two GPUs, else
 *     device 0; the same model and seed; ROUNDS times imports the descriptor
 *     into slot 0 (cudaIpcOpenMemHandle, device copies, close), then decodes
 *     STEPS fixed tokens and sends a hash of every logits row.
 * Pass: every step's logits hash of the child equals the parent's slot 0 and
 * slot 1 (bit for bit); the byte counts agree; both exit 0.  Printed: state
 * bytes, export and import times per round (the last round is warm), and the
 * host-staged path (dsv4_model_state_export/_import through host memory, as
 * the shm transport does) for comparison.  No timing is a pass criterion.
 *
 * Exit status: 0 pass, 1 failure, 77 no CUDA device.  Not a meson test
 * (tests/gpu/run.sh runs it when packed; log in $OUT/kv_cudaipc.log).
 */
#include <sys/types.h>
#include <sys/wait.h>

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "common/model_config.h"
#include "common/weights.h"
#include "ipc/kvxfer.h"
#include "kernels/backend.h"
#include "kernels/cuda_weights.h"
#include "kernels/forward.h"
#include "tests/gpu/gpu_test_util.h"

#define SEED 23
#define CHUNK 1024          /* prefill rows per forward call */
#define MAX_STEPS 256
#define MAX_ROUNDS 16

/* Parent -> child: one exported region. */
struct msg_desc {
    uint32_t handle_len;
    uint64_t size;          /* region bytes */
    uint64_t len;           /* state bytes in it */
    uint8_t handle[DSV4_KVX_MAX_HANDLE];
};

/* Child -> parent: one round's import. */
struct msg_round {
    int32_t ok;
    int32_t seq_len;        /* the slot's length after the import */
    double open_ms;         /* dsv4_kvx_import (cudaIpcOpenMemHandle) */
    double copy_ms;         /* dsv4_model_state_import_dev */
    double close_ms;        /* dsv4_kvx_unmap (cudaIpcCloseMemHandle) */
};

static int prompt = 8192, steps = 16, rounds = 3;
static int32_t *ids;        /* prompt + steps token ids */

/* --- pipes ---------------------------------------------------------------------------- */

static void
put(int fd, const void *p, size_t n)
{
    const char *c = p;

    while (n > 0) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            perror("pipe write");
            exit(1);
        }
        c += w;
        n -= (size_t)w;
    }
}

/* Read n bytes; 0 on a clean end of file before the first byte, else exit. */
static int
get(int fd, void *p, size_t n)
{
    char *c = p;
    size_t got = 0;

    while (got < n) {
        ssize_t r = read(fd, c + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0 && got == 0)
            return 0;
        if (r <= 0) {
            fprintf(stderr, "pipe read: %s\n", r == 0 ? "short message" : strerror(errno));
            exit(1);
        }
        got += (size_t)r;
    }
    return 1;
}

/* --- the model (both processes) ---------------------------------------------------- */

struct side {
    struct dsv4_backend *be;
    struct dsv4_weights w;
    struct dsv4_model *m;
    int V;
    float *logits;          /* (V) host */
};

/* The flash widths cut to 2 layers (ratios 4, 128) + the MTP layer, on
 * device `dev`, synthetic weights of SEED. */
static void
side_open(struct side *s, int dev)
{
    const char *sets[] = { "num_hidden_layers=2", "compress_ratios=[4,128,0]",
                           "num_hash_layers=1" };
    struct dsv4_model_opts o;
    struct dsv4_config cfg;

    memset(s, 0, sizeof(*s));
    TRY("preset", dsv4_config_preset(&cfg, "flash"));
    TRY("flash override", dsv4_config_override(&cfg, 3, sets));
    TRY("cuda backend", dsv4_cuda_backend_create(&s->be, DSV4_NUMERICS_REF, dev));
    TRY("synthetic weights", dsv4_cuda_weights_synthetic(s->be, &s->w, &cfg, SEED, NULL));
    memset(&o, 0, sizeof(o));
    o.n_slots = 2;
    o.max_seq_len = prompt + steps;
    o.max_rows = CHUNK;
    TRY("model", dsv4_model_create(&s->m, s->be, &s->w, &o));
    s->V = dsv4_model_vocab(s->m);
    if ((s->logits = malloc((size_t)s->V * sizeof(float))) == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
}

static void
side_close(struct side *s)
{
    free(s->logits);
    dsv4_model_free(s->m);
    dsv4_cuda_weights_free(s->be, &s->w);
    dsv4_backend_destroy(s->be);
}

/* FNV-1a of a logits row. */
static uint64_t
row_hash(const float *l, int V)
{
    const unsigned char *b = (const unsigned char *)l;
    uint64_t h = 1469598103934665603ull;

    for (size_t i = 0; i < (size_t)V * sizeof(float); i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Decode ids[prompt, prompt + steps) in `slot`, one hash per step. */
static void
decode_steps(struct side *s, int32_t slot, uint64_t *hash)
{
    int32_t one = 1;

    for (int i = 0; i < steps; i++) {
        struct dsv4_batch b = { 1, &slot, &one, &ids[prompt + i] };
        TRY("decode step", dsv4_model_forward(s->m, &b, s->logits, 0));
        hash[i] = row_hash(s->logits, s->V);
    }
}

/* --- child: the decode side --------------------------------------------------------- */

static int
run_child(int rfd, int wfd)
{
    struct dsv4_kvx *x;
    struct msg_desc d;
    struct side s;
    uint64_t hash[MAX_STEPS];
    int n_dev = 0, ready = 1;

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1)
        return 77;
    side_open(&s, n_dev >= 2 ? 1 : 0);
    TRY("kvx open", dsv4_kvx_open_ops(&x, &dsv4_kvx_cudaipc_ops, DSV4_TRANSPORT_CUDAIPC,
                                      "test-decode", NULL));
    put(wfd, &ready, sizeof(ready));
    for (int r = 0; r < rounds; r++) {
        struct dsv4_kvx_desc kd;
        struct dsv4_kvx_map map;
        struct msg_round mr;
        double t0, t1, t2, t3;

        if (!get(rfd, &d, sizeof(d)))
            return 1;
        memset(&kd, 0, sizeof(kd));
        kd.transport = DSV4_TRANSPORT_CUDAIPC;
        kd.handle_len = d.handle_len;
        memcpy(kd.handle, d.handle, d.handle_len);
        kd.size = d.len;
        memset(&mr, 0, sizeof(mr));
        TRY("seq reset", dsv4_model_seq_reset(s.m, 0));
        t0 = now_ms();
        TRY("kvx import", dsv4_kvx_import(x, &kd, &map));
        t1 = now_ms();
        TRY("state import (device)", dsv4_model_state_import_dev(s.m, 0, map.data,
                                                                   (size_t)d.len));
        t2 = now_ms();
        dsv4_kvx_unmap(x, &map);
        t3 = now_ms();
        mr.ok = 1;
        mr.seq_len = dsv4_model_seq_len(s.m, 0);
        mr.open_ms = t1 - t0;
        mr.copy_ms = t2 - t1;
        mr.close_ms = t3 - t2;
        put(wfd, &mr, sizeof(mr));
    }
    decode_steps(&s, 0, hash);
    put(wfd, hash, (size_t)steps * sizeof(hash[0]));
    dsv4_kvx_close(x);
    side_close(&s);
    return 0;
}

/* --- parent: the prefill side -------------------------------------------------------- */

/* The host-staged handoff of the same state (what shm does), timed. */
static void
host_path(struct side *s, size_t len)
{
    void *buf = malloc(len);
    double t0, t1, t2;
    size_t got = 0;

    if (buf == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    t0 = now_ms();
    TRY("state export (host)", dsv4_model_state_export(s->m, 0, buf, len, &got));
    t1 = now_ms();
    TRY("state import (host)", dsv4_model_state_import(s->m, 1, buf, got));
    t2 = now_ms();
    printf("host-staged path (same process, pageable memory): export %.3f ms, import %.3f ms\n",
           t1 - t0, t2 - t1);
    free(buf);
}

static int
run_parent(int rfd, int wfd, pid_t child)
{
    uint64_t mine[MAX_STEPS], own[MAX_STEPS], theirs[MAX_STEPS];
    struct dsv4_kvx *x;
    struct side s;
    int n_dev = 0, ready = 0, fail = 0, status = 0;
    size_t need = 0;

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
        close(wfd);
        waitpid(child, NULL, 0);
        printf("SKIP: no CUDA device\n");
        return 77;
    }
    side_open(&s, 0);
    printf("devices: %d; exporter on device 0, importer on device %d; flash widths, 2 layers "
           "(ratios 4, 128)\n", n_dev, n_dev >= 2 ? 1 : 0);
    TRY("kvx open", dsv4_kvx_open_ops(&x, &dsv4_kvx_cudaipc_ops, DSV4_TRANSPORT_CUDAIPC,
                                      "test-prefill", NULL));
    TRY("seq reset", dsv4_model_seq_reset(s.m, 0));
    double tp = now_ms();
    for (int at = 0; at < prompt; at += CHUNK) {
        int32_t slot = 0, n = prompt - at < CHUNK ? prompt - at : CHUNK;
        struct dsv4_batch b = { 1, &slot, &n, &ids[at] };
        TRY("prefill", dsv4_model_forward(s.m, &b, s.logits, 0));
    }
    need = dsv4_model_state_size(s.m, prompt);
    printf("prefill of %d tokens: %.1f ms; state %zu bytes (%.2f MiB)\n", prompt,
           now_ms() - tp, need, need / (1024.0 * 1024.0));
    host_path(&s, need);
    if (!get(rfd, &ready, sizeof(ready)) || ready != 1) {
        fprintf(stderr, "FAIL: the importer did not start\n");
        return 1;
    }
    for (int r = 0; r < rounds; r++) {
        struct dsv4_kvx_region reg;
        struct msg_round mr;
        struct msg_desc d;
        size_t len = 0;
        double t0, t1, t2;

        t0 = now_ms();
        TRY("kvx export", dsv4_kvx_export(x, (uint64_t)r + 1, need, &reg));
        t1 = now_ms();
        TRY("state export (device)", dsv4_model_state_export_dev(s.m, 0, reg.data, need, &len));
        t2 = now_ms();
        memset(&d, 0, sizeof(d));
        d.handle_len = reg.desc.handle_len;
        d.size = reg.size;
        d.len = len;
        memcpy(d.handle, reg.desc.handle, reg.desc.handle_len);
        put(wfd, &d, sizeof(d));
        if (r == rounds - 1) {
            /* the same region into our own slot 1 (plain device copies) */
            TRY("seq reset", dsv4_model_seq_reset(s.m, 1));
            TRY("state import (device, same process)",
                dsv4_model_state_import_dev(s.m, 1, reg.data, len));
        }
        if (!get(rfd, &mr, sizeof(mr)) || !mr.ok) {
            fprintf(stderr, "FAIL: round %d: the importer failed\n", r);
            return 1;
        }
        /* KV_RELEASE: the importer has closed its mapping */
        dsv4_kvx_free(x, &reg);
        printf("round %d: export %.3f ms (region %.3f + copies %.3f), import %.3f ms (open %.3f + "
               "copies %.3f), close %.3f ms; handoff %.3f ms; handle %u bytes\n", r,
               t2 - t0, t1 - t0, t2 - t1, mr.open_ms + mr.copy_ms, mr.open_ms, mr.copy_ms,
               mr.close_ms, (t2 - t0) + mr.open_ms + mr.copy_ms, (unsigned)d.handle_len);
        if (mr.seq_len != prompt) {
            fprintf(stderr, "FAIL: round %d: imported length %d, want %d\n", r, mr.seq_len,
                    prompt);
            fail = 1;
        }
    }
    if (!get(rfd, theirs, (size_t)steps * sizeof(theirs[0]))) {
        fprintf(stderr, "FAIL: no logits from the importer\n");
        return 1;
    }
    decode_steps(&s, 0, mine);
    decode_steps(&s, 1, own);
    for (int i = 0; i < steps; i++) {
        if (theirs[i] != mine[i] || own[i] != mine[i]) {
            fprintf(stderr, "FAIL: step %d: logits hash %016" PRIx64 " (importer) %016" PRIx64
                    " (same-process import) vs %016" PRIx64 " (exporter's slot)\n", i,
                    theirs[i], own[i], mine[i]);
            fail = 1;
        }
    }
    dsv4_kvx_close(x);
    side_close(&s);
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "FAIL: importer exit status %d\n", status);
        fail = 1;
    }
    if (fail)
        return 1;
    printf("PASS: %d decode steps after %d handoffs of %zu bytes: logits bit-identical\n",
           steps, rounds, need);
    return 0;
}

int
main(int argc, char **argv)
{
    int p2c[2], c2p[2];
    pid_t pid;

    if (argc > 1)
        prompt = atoi(argv[1]);
    if (argc > 2)
        steps = atoi(argv[2]);
    if (argc > 3)
        rounds = atoi(argv[3]);
    if (prompt < 1 || steps < 1 || steps > MAX_STEPS || rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "usage: %s [PROMPT [STEPS (1-%d) [ROUNDS (1-%d)]]]\n", argv[0],
                MAX_STEPS, MAX_ROUNDS);
        return 2;
    }
    if ((ids = malloc((size_t)(prompt + steps) * sizeof(*ids))) == NULL)
        return 1;
    for (int i = 0; i < prompt + steps; i++)
        ids[i] = (int32_t)(((uint64_t)i * 2654435761u + 17) % 100000);
    if (pipe(p2c) != 0 || pipe(c2p) != 0) {
        perror("pipe");
        return 1;
    }
    /* fork before any CUDA call: each process makes its own context */
    if ((pid = fork()) < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) {
        close(p2c[1]);
        close(c2p[0]);
        _exit(run_child(p2c[0], c2p[1]));
    }
    close(p2c[0]);
    close(c2p[1]);
    signal(SIGPIPE, SIG_IGN);
    return run_parent(c2p[0], p2c[1], pid);
}
