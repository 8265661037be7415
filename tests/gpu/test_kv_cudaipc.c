/*
 * test_kv_cudaipc.c — the cudaipc decode-state transport (ipc/kv_cudaipc.c)
 * between two processes on the GPU machine: handoff time and bit-identical
 * continuation (issue 7: "decode state handed from prefill to decode through
 * CUDA IPC handles", "handoff of an 8,192-token prompt <= 1 ms").
 *
 * usage: test_kv_cudaipc [PROMPT [STEPS [ROUNDS]]]
 *        (defaults 8192 tokens, 16 decode steps, 3 handoffs)
 *        test_kv_cudaipc full [PROMPT [ROUNDS]]
 *        (defaults 8192 tokens, 5 handoffs per importer)
 *
 * The full mode times the handoff of the FULL flash model's state (43
 * layers + MTP, about 140 MB at 8,192 tokens) without weights (the model's
 * state pools need only the config) and without a prefill (43 layers x 8,192
 * tokens would take minutes with today's kernels): the exporter fabricates
 * the slot's state by importing a host buffer with a valid header and
 * random bf16-valued floats (dsv4_model_state_import; a different seed each
 * round), then hands it over through the transport ROUNDS times to an
 * importer on device 0 (same GPU) and then ROUNDS times to one on device 1
 * (peer over NVLink; skipped with one GPU).  Each importer exports the
 * imported slot to the host and compares it byte for byte with the buffer
 * of that round's seed (first differing offset on failure).  Before that
 * the exporter checks the backend's copy_batch op on random pieces (every
 * alignment, several chunks) against a host replay.  Printed per importer:
 * "handoff 8192 tokens, 43 layers: N bytes, export X ms, import Y ms, total
 * Z ms" (the mean of the warm rounds, i.e. all but the first), and every
 * round's split (region, copies; open, copies, close).
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
#include <stddef.h>
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
    uint64_t seed;          /* full mode: the state's seed (fabricate) */
    uint8_t handle[DSV4_KVX_MAX_HANDLE];
};

/* Child -> parent: one round's import. */
struct msg_round {
    int32_t ok;
    int32_t seq_len;        /* the slot's length after the import */
    double open_ms;         /* dsv4_kvx_import (cudaIpcOpenMemHandle) */
    double copy_ms;         /* dsv4_model_state_import_dev */
    double close_ms;        /* dsv4_kvx_unmap (cudaIpcCloseMemHandle) */
    int64_t diff_at;        /* full mode: first byte of the re-export that
                               differs from the original, -1 = none */
    uint8_t diff_got, diff_want;
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

/* Decode ids[prompt, prompt + steps) in `slot`, one hash per step. */
static void
decode_steps(struct side *s, int32_t slot, uint64_t *hash)
{
    int32_t one = 1;

    for (int i = 0; i < steps; i++) {
        struct dsv4_batch b = { 1, &slot, &one, &ids[prompt + i] };
        TRY("decode step", dsv4_model_forward(s->m, &b, s->logits, 0));
        hash[i] = logits_digest(s->logits, (size_t)s->V);
    }
}

/* --- one handoff (both modes) ----------------------------------------------------- */

/* Exporter: a region for slot 0's state of `need` bytes (request req), the
 * device export into it, and the descriptor to send; *region_ms and
 * *copy_ms: the time of each half. */
static void
export_round(struct side *s, struct dsv4_kvx *x, uint64_t req, size_t need,
             struct dsv4_kvx_region *reg, struct msg_desc *d, double *region_ms,
             double *copy_ms)
{
    size_t len = 0;
    double t0, t1, t2;

    t0 = now_ms();
    TRY("kvx export", dsv4_kvx_export(x, req, need, reg));
    t1 = now_ms();
    TRY("state export (device)", dsv4_model_state_export_dev(s->m, 0, reg->data, need, &len));
    t2 = now_ms();
    d->handle_len = reg->desc.handle_len;
    d->size = reg->size;
    d->len = len;
    memcpy(d->handle, reg->desc.handle, reg->desc.handle_len);
    *region_ms = t1 - t0;
    *copy_ms = t2 - t1;
}

/* Importer: the descriptor d into slot 0 through the transport (import,
 * device copies, unmap), timed into mr (ok, seq_len and the times). */
static void
import_round(struct side *s, struct dsv4_kvx *x, const struct msg_desc *d,
             struct msg_round *mr)
{
    struct dsv4_kvx_desc kd;
    struct dsv4_kvx_map map;
    double t0, t1, t2, t3;

    memset(&kd, 0, sizeof(kd));
    kd.transport = DSV4_TRANSPORT_CUDAIPC;
    kd.handle_len = d->handle_len;
    memcpy(kd.handle, d->handle, d->handle_len);
    kd.size = d->len;
    memset(mr, 0, sizeof(*mr));
    mr->diff_at = -1;
    TRY("seq reset", dsv4_model_seq_reset(s->m, 0));
    t0 = now_ms();
    TRY("kvx import", dsv4_kvx_import(x, &kd, &map));
    t1 = now_ms();
    TRY("state import (device)", dsv4_model_state_import_dev(s->m, 0, map.data,
                                                               (size_t)d->len));
    t2 = now_ms();
    dsv4_kvx_unmap(x, &map);
    t3 = now_ms();
    mr->ok = 1;
    mr->seq_len = dsv4_model_seq_len(s->m, 0);
    mr->open_ms = t1 - t0;
    mr->copy_ms = t2 - t1;
    mr->close_ms = t3 - t2;
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
        struct msg_round mr;

        if (!get(rfd, &d, sizeof(d)))
            return 1;
        import_round(&s, x, &d, &mr);
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
        double reg_ms, cp_ms;

        /* (warm rounds reuse the region released by the previous one) */
        memset(&d, 0, sizeof(d));
        export_round(&s, x, (uint64_t)r + 1, need, &reg, &d, &reg_ms, &cp_ms);
        put(wfd, &d, sizeof(d));
        if (r == rounds - 1) {
            /* the same region into our own slot 1 (plain device copies) */
            TRY("seq reset", dsv4_model_seq_reset(s.m, 1));
            TRY("state import (device, same process)",
                dsv4_model_state_import_dev(s.m, 1, reg.data, (size_t)d.len));
        }
        if (!get(rfd, &mr, sizeof(mr)) || !mr.ok) {
            fprintf(stderr, "FAIL: round %d: the importer failed\n", r);
            return 1;
        }
        /* KV_RELEASE: the importer is done with it (the region is kept for
         * reuse, the importer keeps its mapping) */
        dsv4_kvx_release(x, &reg);
        printf("round %d: export %.3f ms (region %.3f + copies %.3f), import %.3f ms (open %.3f + "
               "copies %.3f), close %.3f ms; handoff %.3f ms; handle %u bytes\n", r,
               reg_ms + cp_ms, reg_ms, cp_ms, mr.open_ms + mr.copy_ms, mr.open_ms, mr.copy_ms,
               mr.close_ms, reg_ms + cp_ms + mr.open_ms + mr.copy_ms, (unsigned)d.handle_len);
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

/* --- full mode: the 43-layer state, fabricated ------------------------------------- */

/* The full flash model's state pools on device `dev`: no weights (the
 * layout-only weights carry the config and each layer's compress ratio,
 * all dsv4_model_create needs); 2 slots of `prompt` tokens. */
static void
full_open(struct side *s, int dev)
{
    struct dsv4_model_opts o;
    const struct dsv4_config *c;

    memset(s, 0, sizeof(*s));
    TRY("preset", dsv4_config_preset(&s->w.cfg, "flash"));
    c = &s->w.cfg;
    s->w.n_layers = c->num_hidden_layers + dsv4_config_n_mtp(c);
    if ((s->w.layers = calloc((size_t)s->w.n_layers, sizeof(*s->w.layers))) == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (int l = 0; l < s->w.n_layers; l++) {
        s->w.layers[l].id = l;
        s->w.layers[l].ratio = c->compress_ratios[l];
    }
    TRY("cuda backend", dsv4_cuda_backend_create(&s->be, DSV4_NUMERICS_REF, dev));
    memset(&o, 0, sizeof(o));
    o.n_slots = 2;
    o.max_seq_len = prompt;
    o.max_rows = 16;
    TRY("model (full flash state pools)", dsv4_model_create(&s->m, s->be, &s->w, &o));
}

static void
full_close(struct side *s)
{
    dsv4_model_free(s->m);
    dsv4_backend_destroy(s->be);
    free(s->w.layers);
}

/*
 * A state of `prompt` tokens for seed `seed` in buf (size bytes =
 * dsv4_model_state_size): the header of an exported empty slot (slot 1)
 * with its length fields set (struct state_header of kernels/forward.c:
 * int32 len at byte 16, int32 mtp_len at byte 20; the import checks the
 * rest), then random bf16-valued floats.
 */
static void
fabricate(struct side *s, uint64_t seed, uint8_t *buf, size_t size)
{
    size_t hsize = dsv4_model_state_size(s->m, 0), got = 0;
    uint8_t *empty = malloc(hsize);
    uint64_t r = seed * 0x9e3779b97f4a7c15ull + 1;
    int32_t len = prompt;

    if (empty == NULL || size < 32 || (size - 32) % 4 != 0) {
        fprintf(stderr, "fabricate: state of %zu bytes\n", size);
        exit(1);
    }
    TRY("seq reset", dsv4_model_seq_reset(s->m, 1));
    TRY("state export (empty slot)", dsv4_model_state_export(s->m, 1, empty, hsize, &got));
    memcpy(buf, empty, 32);
    memcpy(buf + 16, &len, 4);
    memcpy(buf + 20, &len, 4);
    free(empty);
    for (size_t o = 32; o < size; o += 4) {
        float f;
        uint32_t u;

        r = r * 6364136223846793005ull + 1442695040888963407ull;
        f = (float)((int64_t)(r >> 40) % 4001 - 2000) / 512.0f;
        memcpy(&u, &f, 4);
        u &= 0xffff0000u;           /* a bf16 value */
        memcpy(buf + o, &u, 4);
    }
}

/* copy_batch on random pieces (sizes 0 … 300,000 bytes, every alignment
 * modulo 16 on both sides) against a host replay; 0 when they agree. */
static int
copy_batch_check(struct side *s)
{
    enum { N = 3000, MAXB = 300000 };
    const struct dsv4_backend_ops *ops = s->be->ops;
    size_t span = (size_t)N * (MAXB / 2 + 32), so = 0, dof = 0, moved = 0;
    uint8_t *h = malloc(span), *want = calloc(span, 1), *got = malloc(span), *ds, *dd;
    static void *dst[N];
    static const void *src[N];
    static size_t bytes[N];
    uint64_t r = 77;
    double t0, t1;
    int n = 0;

    if (h == NULL || want == NULL || got == NULL) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < span; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        h[i] = (uint8_t)(r >> 56);
    }
    ds = ops->alloc(s->be, span);
    dd = ops->alloc(s->be, span);
    if (ds == NULL || dd == NULL) {
        fprintf(stderr, "copy_batch check: no device memory\n");
        exit(1);
    }
    TRY("upload", ops->upload(s->be, ds, h, span));
    for (; n < N; n++) {
        size_t b, gs, gd;

        r = r * 6364136223846793005ull + 1442695040888963407ull;
        b = n % 29 == 0 ? 0 : (size_t)((r >> 24) % MAXB);
        gs = (r >> 8) % 16;
        gd = (r >> 12) % 16;
        if (so + gs + b > span || dof + gd + b > span)
            break;
        so += gs;
        dof += gd;
        /* destinations in the reverse order of the sources */
        src[n] = ds + so;
        dst[n] = dd + span - dof - b;
        bytes[n] = b;
        memcpy(want + span - dof - b, h + so, b);
        so += b;
        dof += b;
        moved += b;
    }
    t0 = now_ms();
    TRY("copy_batch", ops->copy_batch(s->be, n, dst, src, bytes));
    TRY("sync", ops->sync(s->be));
    t1 = now_ms();
    TRY("download", ops->download(s->be, got, dd, span));
    TRY("sync", ops->sync(s->be));
    ops->free(s->be, ds);
    ops->free(s->be, dd);
    for (size_t i = 0; i < span; i++) {
        if (got[i] != want[i]) {
            int piece = -1;

            for (int k = 0; k < n; k++)
                if ((size_t)((uint8_t *)dst[k] - dd) <= i &&
                    (size_t)((uint8_t *)dst[k] - dd) + bytes[k] > i)
                    piece = k;
            fprintf(stderr, "FAIL: copy_batch: byte %zu is %u, want %u (piece %d of %d: dst "
                    "offset %% 16 = %d, src offset %% 16 = %d, %zu bytes)\n", i, got[i],
                    want[i], piece, n,
                    piece >= 0 ? (int)(((uint8_t *)dst[piece] - dd) % 16) : -1,
                    piece >= 0 ? (int)(((const uint8_t *)src[piece] - ds) % 16) : -1,
                    piece >= 0 ? bytes[piece] : 0);
            free(h);
            free(want);
            free(got);
            return 1;
        }
    }
    printf("copy_batch check: %d pieces, %zu bytes: identical to the host replay (%.3f ms, "
           "%.0f GB/s)\n", n, moved, t1 - t0, moved / ((t1 - t0) * 1e6));
    free(h);
    free(want);
    free(got);
    return 0;
}

/* Importer of the full mode on device `dev`: ready (1, or 0 when the device
 * is missing), then per round: import, re-export to the host, compare. */
static int
run_full_child(int rfd, int wfd, int dev)
{
    struct dsv4_kvx *x;
    struct msg_desc d;
    struct side s;
    int n_dev = 0, ready = 0;
    size_t need;
    uint8_t *want, *got;

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev <= dev) {
        put(wfd, &ready, sizeof(ready));
        return 77;
    }
    full_open(&s, dev);
    need = dsv4_model_state_size(s.m, prompt);
    want = malloc(need);
    got = malloc(need);
    if (want == NULL || got == NULL) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    TRY("kvx open", dsv4_kvx_open_ops(&x, &dsv4_kvx_cudaipc_ops, DSV4_TRANSPORT_CUDAIPC,
                                      dev == 0 ? "test-decode0" : "test-decode1", NULL));
    ready = 1;
    put(wfd, &ready, sizeof(ready));
    while (get(rfd, &d, sizeof(d))) {
        struct msg_round mr;
        size_t len = 0;

        import_round(&s, x, &d, &mr);
        /* the imported slot, exported again, is the original */
        fabricate(&s, d.seed, want, need);
        TRY("state export (host)", dsv4_model_state_export(s.m, 0, got, need, &len));
        for (size_t i = 0; i < need && mr.diff_at < 0; i++) {
            if (got[i] != want[i]) {
                mr.diff_at = (int64_t)i;
                mr.diff_got = got[i];
                mr.diff_want = want[i];
            }
        }
        mr.ok = len == need && (size_t)d.len == need;
        put(wfd, &mr, sizeof(mr));
    }
    dsv4_kvx_close(x);
    free(want);
    free(got);
    full_close(&s);
    return 0;
}

/* Exporter of the full mode: ROUNDS handoffs to each importer. */
static int
run_full_parent(const int rfd[2], const int wfd[2], const pid_t child[2])
{
    struct dsv4_kvx *x;
    struct side s;
    int n_dev = 0, fail = 0;
    size_t need;
    uint8_t *buf;

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
        for (int c = 0; c < 2; c++) {
            close(wfd[c]);
            waitpid(child[c], NULL, 0);
        }
        printf("SKIP: no CUDA device\n");
        return 77;
    }
    full_open(&s, 0);
    need = dsv4_model_state_size(s.m, prompt);
    printf("devices: %d; full flash state pools (%d layers incl. MTP), %d tokens: state %zu "
           "bytes (%.1f MiB); exporter on device 0\n", n_dev, s.w.n_layers, prompt, need,
           need / (1024.0 * 1024.0));
    if (copy_batch_check(&s) != 0)
        fail = 1;
    if ((buf = malloc(need)) == NULL) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    TRY("kvx open", dsv4_kvx_open_ops(&x, &dsv4_kvx_cudaipc_ops, DSV4_TRANSPORT_CUDAIPC,
                                      "test-prefill", NULL));
    for (int c = 0; c < 2; c++) {
        double sum_ex = 0, sum_im = 0;
        int ready = 0, warm = 0;

        if (!get(rfd[c], &ready, sizeof(ready)) || ready != 1) {
            printf("importer on device %d: skipped (%d devices)\n", c, n_dev);
            continue;
        }
        for (int r = 0; r < rounds; r++) {
            struct dsv4_kvx_region reg;
            struct msg_round mr;
            struct msg_desc d;
            double reg_ms, cp_ms;

            memset(&d, 0, sizeof(d));
            d.seed = (uint64_t)c * 1000 + (uint64_t)r + 1;
            fabricate(&s, d.seed, buf, need);
            TRY("seq reset", dsv4_model_seq_reset(s.m, 0));
            TRY("state import (host, fabricated)", dsv4_model_state_import(s.m, 0, buf, need));
            if (dsv4_model_seq_len(s.m, 0) != prompt) {
                fprintf(stderr, "FAIL: fabricated state holds %d positions\n",
                        dsv4_model_seq_len(s.m, 0));
                return 1;
            }
            export_round(&s, x, (uint64_t)r + 1, need, &reg, &d, &reg_ms, &cp_ms);
            put(wfd[c], &d, sizeof(d));
            if (!get(rfd[c], &mr, sizeof(mr))) {
                fprintf(stderr, "FAIL: importer on device %d: no answer in round %d\n", c, r);
                return 1;
            }
            /* KV_RELEASE: the importer is done; the region may be reused */
            dsv4_kvx_release(x, &reg);
            printf("device %d round %d: export %.3f ms (region %.3f + copies %.3f), import "
                   "%.3f ms (open %.3f + copies %.3f), close %.3f ms\n", c, r, reg_ms + cp_ms,
                   reg_ms, cp_ms, mr.open_ms + mr.copy_ms, mr.open_ms, mr.copy_ms, mr.close_ms);
            if (!mr.ok || mr.seq_len != prompt || mr.diff_at >= 0) {
                fprintf(stderr, "FAIL: importer on device %d, round %d: ok %d, length %d (want "
                        "%d), first differing byte %" PRId64 " (%u, want %u) of %zu\n", c, r,
                        mr.ok, mr.seq_len, prompt, mr.diff_at, mr.diff_got, mr.diff_want,
                        need);
                fail = 1;
            }
            if (r > 0 || rounds == 1) {
                sum_ex += reg_ms + cp_ms;
                sum_im += mr.open_ms + mr.copy_ms;
                warm++;
            }
        }
        close(wfd[c]);
        printf("handoff %d tokens, %d layers: %zu bytes, export %.3f ms, import %.3f ms, total "
               "%.3f ms (importer on device %d, %s; mean of %d warm rounds)\n", prompt,
               s.w.cfg.num_hidden_layers, need, sum_ex / warm, sum_im / warm,
               (sum_ex + sum_im) / warm, c, c == 0 ? "same GPU" : "peer GPU", warm);
    }
    dsv4_kvx_close(x);
    free(buf);
    full_close(&s);
    for (int c = 0; c < 2; c++) {
        int status = 0;

        close(wfd[c]);
        if (waitpid(child[c], &status, 0) != child[c] || !WIFEXITED(status) ||
            (WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 77)) {
            fprintf(stderr, "FAIL: importer %d exit status %d\n", c, status);
            fail = 1;
        }
    }
    if (fail)
        return 1;
    printf("PASS: full flash state of %d tokens (%zu bytes) handed over %d times per importer, "
           "byte-identical; copy_batch identical\n", prompt, need, rounds);
    return 0;
}

/* The full mode: two importers (devices 0 and 1), forked before CUDA. */
static int
main_full(int argc, char **argv)
{
    int p2c[2][2], c2p[2][2], rfd[2], wfd[2];
    pid_t pid[2];

    rounds = 5;
    if (argc > 2)
        prompt = atoi(argv[2]);
    if (argc > 3)
        rounds = atoi(argv[3]);
    if (prompt < 1 || rounds < 1 || rounds > 1000) {
        fprintf(stderr, "usage: %s full [PROMPT [ROUNDS (1-1000)]]\n", argv[0]);
        return 2;
    }
    for (int c = 0; c < 2; c++) {
        if (pipe(p2c[c]) != 0 || pipe(c2p[c]) != 0) {
            perror("pipe");
            return 1;
        }
    }
    for (int c = 0; c < 2; c++) {
        if ((pid[c] = fork()) < 0) {
            perror("fork");
            return 1;
        }
        if (pid[c] == 0) {
            for (int o = 0; o < 2; o++) {
                close(p2c[o][1]);
                close(c2p[o][0]);
                if (o != c) {
                    close(p2c[o][0]);
                    close(c2p[o][1]);
                }
            }
            _exit(run_full_child(p2c[c][0], c2p[c][1], c));
        }
    }
    for (int c = 0; c < 2; c++) {
        close(p2c[c][0]);
        close(c2p[c][1]);
        rfd[c] = c2p[c][0];
        wfd[c] = p2c[c][1];
    }
    signal(SIGPIPE, SIG_IGN);
    return run_full_parent(rfd, wfd, pid);
}

int
main(int argc, char **argv)
{
    int p2c[2], c2p[2];
    pid_t pid;

    if (argc > 1 && strcmp(argv[1], "full") == 0)
        return main_full(argc, argv);

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
