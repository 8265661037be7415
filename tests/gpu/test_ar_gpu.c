/*
 * test_ar_gpu.c — the cudaipc communicator (kernels/cuda/cuda_ar.cu) on two
 * GPUs, with ranks in two processes (fork + exec of this program, so no
 * process inherits a CUDA context); run by tests/gpu/run.sh.
 *
 *   1. correct: a group of 2 (this process rank 0 on device 0, a child
 *      rank 1 on device 1) all-reduces buffers of many sizes (1 float ...
 *      1.8 MB, odd sizes, a misaligned start, more than one slot: several
 *      launches), exact gathers and dense sums alike; every result must be
 *      bit-identical to the host's sum in rank order.  Then a graph of three
 *      all-reduces (1.8 MB; 1001 floats at a misaligned address, twice in a
 *      row) is recorded once and replayed 1000 times with new data each time,
 *      every replay checked.
 *      Part 1's eager calls run once per kernel of the communicator (V1,
 *      PUSH, LL, AUTO: dsv4_comm_cudaipc_set_tune), the graph under the
 *      setting of DSV4_CUDA_AR (default AUTO: LL and PUSH in one graph).
 *   2. time: microseconds per all-reduce of 64 KB, 256 KB and 1.8 MB,
 *      cudaipc against NCCL (when libnccl.so.2 is there), eager and graphed.
 *      Then, not skewed by the processes' arrival: for 4 KB .. 2 MB and
 *      each kernel (and NCCL), one graph of 100 back-to-back all-reduces,
 *      replayed by both processes after a host barrier (the bootstrap shm
 *      group), best of 5 replays / 100.
 *   3. timeout: the child joins and then never all-reduces; the parent's
 *      call must give up after the group's timeout (500 ms) with
 *      DSV4_ERR_TIMEOUT and a usable stream.
 *   4. abort: the child replays a recorded graph of all-reduces five times
 *      with the parent and then SIGKILLs itself; the parent is blocked in
 *      its sixth replay.  A watchdog thread sees the death (waitpid) and
 *      calls abort: the parent's sync must return within 1 s of the abort,
 *      check() must say the group is broken, destroy must return; then the
 *      parent builds a NEW group with a fresh child in the same process
 *      (same CUDA context) and all-reduces correctly again (part 1's checks,
 *      100 graph replays).
 * One PASS/FAIL line per part (with the first mismatch, its bits, timings),
 * then "PASS test_ar_gpu" or "FAIL test_ar_gpu".
 * Exit status: 0 pass, 1 failure, 77 fewer than two CUDA devices.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "gpu_test_util.h"
#include "kernels/backend.h"
#include "kernels/comm.h"

#define SIZE 2                           /* ranks */
#define BIG 458752                       /* (16 * 6 + 16) * 4096 floats: decode's largest */
#define SMALL 1001
#define MAX_BYTES (2u << 20)             /* slot bytes: BIG fits, 600000 floats do not */
#define REPLAYS 1000
#define KILL_AFTER 5                     /* replays the victim child does before dying */

static uint64_t seed = 1;

static uint64_t
mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Element i of rank s's input of call c: an exact gather (one owner per
 * element, zeros elsewhere) or dense (every rank nonzero); some zeros of
 * either sign, magnitudes 2^-20 .. 2^20. */
static float
val(uint64_t c, int s, int64_t i, int dense)
{
    uint64_t h = mix(seed ^ mix(c * 0x100000001b3ull + (uint64_t)i));
    uint64_t g = mix(h + (uint64_t)s + 1);
    float v;

    if (!dense && (int)(h % SIZE) != s)
        return 0.0f;
    if ((g & 63) == 0)
        return (g & 64) ? -0.0f : 0.0f;
    v = ldexpf(1.0f + (float)((g >> 8) & 0x7fffff) / 8388608.0f, (int)((g >> 32) % 41) - 20);
    return ((g >> 40) & 1) ? -v : v;
}

/* Compare n floats bit for bit; print the first mismatch. */
static int
same_bits(const char *what, const float *got, const float *want, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint32_t a, b;

        memcpy(&a, &got[i], 4);
        memcpy(&b, &want[i], 4);
        if (a != b) {
            int64_t bad = 0;

            for (int64_t j = i; j < n; j++)
                bad += memcmp(&got[j], &want[j], 4) != 0;
            fprintf(stderr, "  %s: first mismatch at %lld of %lld: got %a (0x%08x), want %a "
                    "(0x%08x); %lld elements differ\n", what, (long long)i, (long long)n,
                    (double)got[i], a, (double)want[i], b, (long long)bad);
            return 0;
        }
    }
    return 1;
}

/* On a failed call: print it and return `ret` (0 from the parts: failed;
 * 1 from main and the child: exit status). */
#define CHECK_R(ret, what, expr)                                                 \
    do {                                                                         \
        enum dsv4_err e_ = (expr);                                               \
        if (e_ != DSV4_OK) {                                                     \
            fprintf(stderr, "  rank %d: %s: %s\n", rank, what, dsv4_errmsg());   \
            return ret;                                                          \
        }                                                                        \
    } while (0)
#define CHECK(what, expr) CHECK_R(0, what, expr)

/* --- part 1: correctness -------------------------------------------------- */

/* All-reduce call c of n floats at x (device), every input from val(). */
static int
check_call(struct dsv4_backend *be, struct dsv4_comm *c, int rank, float *x, float *in,
           float *want, float *got, uint64_t call, int64_t n, int dense)
{
    char what[96];

    for (int64_t i = 0; i < n; i++) {
        float acc = val(call, 0, i, dense);

        for (int s = 1; s < SIZE; s++)
            acc += val(call, s, i, dense);
        want[i] = acc;
        in[i] = val(call, rank, i, dense);
    }
    CHECK("upload", be->ops->upload(be, x, in, (size_t)n * 4));
    CHECK("allreduce", c->ops->allreduce_sum(c, be, x, n));
    CHECK("download", be->ops->download(be, got, x, (size_t)n * 4));
    CHECK("sync", be->ops->sync(be));
    CHECK("check", dsv4_comm_check(c));
    snprintf(what, sizeof(what), "rank %d call %llu n=%lld%s%s", rank,
             (unsigned long long)call, (long long)n, dense ? " dense" : " gather",
             ((uintptr_t)x & 15) ? " misaligned" : "");
    return same_bits(what, got, want, n);
}

/* Inputs of graph replay r: big (exact gather, owner rotating, scaled by a
 * power of two) and small (dense). */
static void
replay_inputs(int rank, uint64_t r, const float *base, float *big_in, float *big_want,
              float *small_in, float *small_want)
{
    float scale = ldexpf(1.0f, (int)(r % 7) - 3);

    for (int64_t i = 0; i < BIG; i++) {
        int owner = (int)((i * 7 + (int64_t)r) % SIZE);
        float acc = owner == 0 ? base[i] * scale : 0.0f;

        for (int s = 1; s < SIZE; s++)
            acc += owner == s ? base[i] * scale : 0.0f;
        big_want[i] = acc;
        big_in[i] = owner == rank ? base[i] * scale : 0.0f;
    }
    for (int64_t i = 0; i < SMALL; i++) {
        float acc = val(100000 + r, 0, i, 1), once;

        for (int s = 1; s < SIZE; s++)
            acc += val(100000 + r, s, i, 1);
        once = acc;   /* the second all-reduce sums `once` from every rank */
        for (int s = 1; s < SIZE; s++)
            acc += once;
        small_want[i] = acc;
        small_in[i] = val(100000 + r, rank, i, 1);
    }
}

/* Kernels of the cudaipc communicator that parts 1 and 2 go through. */
static const char *const tunes[] = { "v1", "push", "ll", "auto" };
#define N_TUNES ((int)(sizeof(tunes) / sizeof(tunes[0])))

/* The whole part 1 as `rank`; `replays` graph replays.  1 = pass. */
static int
run_correct(struct dsv4_backend *be, struct dsv4_comm *c, int rank, int replays)
{
    static const int64_t sizes[] = { 1, 2, 3, 4, 5, 7, 8, 31, 64, 255, 256, 1000, 4097,
                                     16387, 65536, 131071, BIG, BIG + 3, 600000 };
    const int64_t cap = 600004;
    float *x = be->ops->alloc(be, (size_t)cap * 4), *xs = be->ops->alloc(be, 4096 * 4);
    float *in = malloc((size_t)cap * 4), *want = malloc((size_t)cap * 4);
    float *got = malloc((size_t)cap * 4), *base = malloc((size_t)BIG * 4);
    float *sin_ = malloc(SMALL * 4), *swant = malloc(SMALL * 4), *sgot = malloc(SMALL * 4);
    void *g = NULL;
    uint64_t call = 0;
    int ok = 1;
    double t0;

    if (x == NULL || xs == NULL || in == NULL || want == NULL || got == NULL || base == NULL ||
        sin_ == NULL || swant == NULL || sgot == NULL) {
        fprintf(stderr, "  rank %d: no memory\n", rank);
        return 0;
    }
    for (int v = 0; v < N_TUNES && ok; v++) {
        CHECK("set_tune", dsv4_comm_cudaipc_set_tune(c, tunes[v]));
        for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]) && ok; k++)
            for (int dense = 0; dense < 2 && ok; dense++)
                ok = check_call(be, c, rank, x, in, want, got, call++, sizes[k], dense);
        /* misaligned starts: the scalar path */
        for (int off = 1; off < 4 && ok; off++)
            ok = check_call(be, c, rank, x + off, in, want, got, call++, 1001 + off, off & 1);
        if (!ok)
            fprintf(stderr, "  rank %d: kernel setting '%s' failed\n", rank, tunes[v]);
    }
    if (!ok)
        return 0;
    CHECK("set_tune (DSV4_CUDA_AR)", dsv4_comm_cudaipc_set_tune(c, getenv("DSV4_CUDA_AR")));
    /* a recorded graph replayed with new data */
    for (int64_t i = 0; i < BIG; i++)
        base[i] = val(7777, 0, i, 1);
    CHECK("graph_begin", be->ops->graph_begin(be));
    CHECK("graph allreduce big", c->ops->allreduce_sum(c, be, x, BIG));
    CHECK("graph allreduce small", c->ops->allreduce_sum(c, be, xs + 1, SMALL));
    CHECK("graph allreduce small again", c->ops->allreduce_sum(c, be, xs + 1, SMALL));
    CHECK("graph_end", be->ops->graph_end(be, &g));
    t0 = now_ms();
    for (int r = 0; r < replays && ok; r++) {
        char what[64];

        replay_inputs(rank, (uint64_t)r, base, in, want, sin_, swant);
        CHECK("upload", be->ops->upload(be, x, in, (size_t)BIG * 4));
        CHECK("upload", be->ops->upload(be, xs + 1, sin_, SMALL * 4));
        CHECK("graph_launch", be->ops->graph_launch(be, g));
        CHECK("download", be->ops->download(be, got, x, (size_t)BIG * 4));
        CHECK("download", be->ops->download(be, sgot, xs + 1, SMALL * 4));
        CHECK("sync", be->ops->sync(be));
        CHECK("check", dsv4_comm_check(c));
        snprintf(what, sizeof(what), "rank %d replay %d big", rank, r);
        ok = same_bits(what, got, want, BIG);
        snprintf(what, sizeof(what), "rank %d replay %d small (twice)", rank, r);
        ok = ok && same_bits(what, sgot, swant, SMALL);
    }
    if (ok && rank == 0)
        printf("  %llu eager calls and %d graph replays (3 all-reduces each, %.1f ms) "
               "bit-identical\n", (unsigned long long)call, replays, now_ms() - t0);
    be->ops->graph_free(be, g);
    be->ops->free(be, x);
    be->ops->free(be, xs);
    free(in);
    free(want);
    free(got);
    free(base);
    free(sin_);
    free(swant);
    free(sgot);
    return ok;
}

/* --- part 2: timing --------------------------------------------------------- */

/* Microseconds per all-reduce of n floats: eager (*eager) and graphed. */
static int
time_one(struct dsv4_backend *be, struct dsv4_comm *c, int rank, float *x, int64_t n,
         double *eager, double *graphed)
{
    enum { WARM = 20, CALLS = 200, PER_GRAPH = 20, LAUNCHES = 20 };
    void *g = NULL;
    double t0;

    for (int i = 0; i < WARM; i++)
        CHECK("allreduce", c->ops->allreduce_sum(c, be, x, n));
    CHECK("sync", be->ops->sync(be));
    t0 = now_ms();
    for (int i = 0; i < CALLS; i++)
        CHECK("allreduce", c->ops->allreduce_sum(c, be, x, n));
    CHECK("sync", be->ops->sync(be));
    *eager = (now_ms() - t0) * 1e3 / CALLS;
    CHECK("graph_begin", be->ops->graph_begin(be));
    for (int i = 0; i < PER_GRAPH; i++)
        CHECK("allreduce", c->ops->allreduce_sum(c, be, x, n));
    CHECK("graph_end", be->ops->graph_end(be, &g));
    CHECK("graph_launch", be->ops->graph_launch(be, g));
    CHECK("sync", be->ops->sync(be));
    t0 = now_ms();
    for (int i = 0; i < LAUNCHES; i++)
        CHECK("graph_launch", be->ops->graph_launch(be, g));
    CHECK("sync", be->ops->sync(be));
    *graphed = (now_ms() - t0) * 1e3 / (LAUNCHES * PER_GRAPH);
    be->ops->graph_free(be, g);
    CHECK("check", dsv4_comm_check(c));
    return 1;
}

static int
run_time(struct dsv4_backend *be, struct dsv4_comm *ipc, struct dsv4_comm *nccl, int rank)
{
    static const int64_t sizes[] = { 16384, 65536, BIG };
    float *x = be->ops->alloc(be, (size_t)BIG * 4);
    double t[2][2][3];

    if (x == NULL)
        return 0;
    for (int k = 0; k < 3; k++) {
        if (!time_one(be, ipc, rank, x, sizes[k], &t[0][0][k], &t[0][1][k]))
            return 0;
        if (nccl != NULL && !time_one(be, nccl, rank, x, sizes[k], &t[1][0][k], &t[1][1][k]))
            return 0;
    }
    if (rank == 0) {
        printf("  | us per all-reduce | 64 KB | 256 KB | 1.8 MB |\n");
        printf("  |---|---|---|---|\n");
        for (int w = 0; w < (nccl != NULL ? 2 : 1); w++)
            for (int m = 0; m < 2; m++)
                printf("  | %s %s | %.1f | %.1f | %.1f |\n", w ? "nccl" : "cudaipc",
                       m ? "graphed" : "eager", t[w][m][0], t[w][m][1], t[w][m][2]);
        if (nccl == NULL)
            printf("  | nccl | not available: %s |\n", dsv4_errmsg());
    }
    be->ops->free(be, x);
    return 1;
}

/*
 * Microseconds per all-reduce inside one graph of 100, for each size and
 * each kernel setting (then NCCL when there): both processes replay the
 * graph right after a host barrier, best of 5 replays.
 */
static int
run_time100(struct dsv4_backend *be, struct dsv4_comm *ipc, struct dsv4_comm *nccl, int rank)
{
    enum { CALLS = 100, REPS = 5, N_SIZES = 7 };
    static const int64_t kb[N_SIZES] = { 4, 32, 64, 128, 256, 1024, 2048 };
    const int rows = N_TUNES + (nccl != NULL);
    float *x = be->ops->alloc(be, (size_t)2048 << 10);
    uint64_t *u = be->ops->alloc(be, sizeof(uint64_t));
    double us[N_TUNES + 1][N_SIZES];

    if (x == NULL || u == NULL)
        return 0;
    for (int w = 0; w < rows; w++) {
        struct dsv4_comm *c = w < N_TUNES ? ipc : nccl;

        if (w < N_TUNES)
            CHECK("set_tune", dsv4_comm_cudaipc_set_tune(ipc, tunes[w]));
        for (int k = 0; k < N_SIZES; k++) {
            int64_t n = kb[k] * 1024 / 4;
            double best = 1e30;
            void *g = NULL;

            CHECK("graph_begin", be->ops->graph_begin(be));
            for (int i = 0; i < CALLS; i++)
                CHECK("allreduce", c->ops->allreduce_sum(c, be, x, n));
            CHECK("graph_end", be->ops->graph_end(be, &g));
            CHECK("graph_launch", be->ops->graph_launch(be, g));
            CHECK("sync", be->ops->sync(be));
            for (int r = 0; r < REPS; r++) {
                double t0;

                /* host barrier: a min over the bootstrap shm group */
                CHECK("barrier", ipc->ops->allreduce_min_u64(ipc, be, u, 1));
                t0 = now_ms();
                CHECK("graph_launch", be->ops->graph_launch(be, g));
                CHECK("sync", be->ops->sync(be));
                if (now_ms() - t0 < best)
                    best = now_ms() - t0;
            }
            us[w][k] = best * 1e3 / CALLS;
            be->ops->graph_free(be, g);
            CHECK("check", dsv4_comm_check(c));
        }
    }
    CHECK("set_tune (DSV4_CUDA_AR)", dsv4_comm_cudaipc_set_tune(ipc, getenv("DSV4_CUDA_AR")));
    if (rank == 0) {
        printf("  | us per all-reduce, graph of %d | 4 KB | 32 KB | 64 KB | 128 KB | 256 KB | "
               "1 MB | 2 MB |\n", CALLS);
        printf("  |---|---|---|---|---|---|---|---|\n");
        for (int w = 0; w < rows; w++) {
            printf("  | %s%s |", w < N_TUNES ? "cudaipc " : "nccl", w < N_TUNES ? tunes[w] : "");
            for (int k = 0; k < N_SIZES; k++)
                printf(" %.2f |", us[w][k]);
            printf("\n");
        }
        if (nccl != NULL) {
            printf("  | cudaipc auto / nccl |");
            for (int k = 0; k < N_SIZES; k++)
                printf(" %.2f |", us[N_TUNES - 1][k] / us[N_TUNES][k]);
            printf("\n");
        }
    }
    be->ops->free(be, x);
    be->ops->free(be, u);
    return 1;
}

/* --- processes ------------------------------------------------------------- */

static void
hex_put(char *out, const uint8_t *id)
{
    for (int i = 0; i < DSV4_COMM_ID_BYTES; i++)
        sprintf(out + 2 * i, "%02x", id[i]);
}

static int
hex_get(uint8_t *id, const char *s)
{
    if (strlen(s) != 2 * DSV4_COMM_ID_BYTES)
        return 0;
    for (int i = 0; i < DSV4_COMM_ID_BYTES; i++) {
        unsigned v;

        if (sscanf(s + 2 * i, "%2x", &v) != 1)
            return 0;
        id[i] = (uint8_t)v;
    }
    return 1;
}

/* Start this program as rank 1: `mode`, the cudaipc id, an NCCL id or "-". */
static pid_t
spawn(const char *mode, const uint8_t *id, const uint8_t *nccl_id)
{
    char hid[2 * DSV4_COMM_ID_BYTES + 1], hn[2 * DSV4_COMM_ID_BYTES + 1], sd[32];
    pid_t pid;

    hex_put(hid, id);
    if (nccl_id != NULL)
        hex_put(hn, nccl_id);
    else
        snprintf(hn, sizeof(hn), "-");
    snprintf(sd, sizeof(sd), "%llu", (unsigned long long)seed);
    fflush(NULL);
    pid = fork();
    if (pid == 0) {
        execl("/proc/self/exe", "test_ar_gpu", "child", mode, hid, hn, sd, (char *)NULL);
        perror("exec");
        _exit(127);
    }
    return pid;
}

static int
reap(pid_t pid)
{
    int st;

    if (waitpid(pid, &st, 0) != pid)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Rank 1 in a child process. */
static int
child_main(const char *mode, const char *hid, const char *hn)
{
    const int rank = 1;
    struct dsv4_backend *be = NULL;
    struct dsv4_comm *c = NULL, *nccl = NULL;
    uint8_t id[DSV4_COMM_ID_BYTES], nid[DSV4_COMM_ID_BYTES];
    int ok = 1;

    if (!hex_get(id, hid))
        return 2;
    CHECK_R(1, "cuda backend", dsv4_cuda_backend_create(&be, DSV4_NUMERICS_REF, 1));
    CHECK_R(1, "cudaipc create",
            dsv4_comm_cudaipc_create(&c, be, rank, SIZE, id, MAX_BYTES,
                                     strcmp(mode, "idle") == 0 ? 500 : 10000, NULL));
    if (strcmp(mode, "correct") == 0 || strcmp(mode, "again") == 0) {
        ok = run_correct(be, c, rank, strcmp(mode, "again") == 0 ? 100 : REPLAYS);
    } else if (strcmp(mode, "time") == 0) {
        if (strcmp(hn, "-") != 0 && hex_get(nid, hn) &&
            dsv4_comm_nccl_create(&nccl, be, rank, SIZE, nid, 60000, NULL) != DSV4_OK)
            nccl = NULL;
        ok = run_time(be, c, nccl, rank) && run_time100(be, c, nccl, rank);
    } else if (strcmp(mode, "idle") == 0) {
        sleep(3);      /* joined, never all-reduces */
    } else if (strcmp(mode, "victim") == 0) {
        float *x = be->ops->alloc(be, (size_t)BIG * 4);
        void *g = NULL;

        CHECK_R(1, "graph_begin", be->ops->graph_begin(be));
        for (int i = 0; i < 8; i++)
            CHECK_R(1, "allreduce", c->ops->allreduce_sum(c, be, x, BIG));
        CHECK_R(1, "graph_end", be->ops->graph_end(be, &g));
        for (int r = 0; r < KILL_AFTER; r++)
            CHECK_R(1, "graph_launch", be->ops->graph_launch(be, g));
        CHECK_R(1, "sync", be->ops->sync(be));
        raise(SIGKILL);   /* inside the group: the parent waits in replay 6 */
    }
    if (nccl != NULL)
        dsv4_comm_destroy(nccl);
    dsv4_comm_destroy(c);
    dsv4_backend_destroy(be);
    return ok ? 0 : 1;
}

/* Watchdog of part 4: abort the communicator when the child is gone. */
struct watch {
    pid_t pid;
    struct dsv4_comm *c;
    atomic_int stop;
    double t_abort;       /* ms, when abort was called; 0 = not yet */
    int status;
};

static void *
watch_main(void *arg)
{
    struct watch *w = arg;

    while (!atomic_load(&w->stop)) {
        int st;

        if (waitpid(w->pid, &st, WNOHANG) == w->pid) {
            w->status = st;
            w->t_abort = now_ms();
            w->c->ops->abort(w->c);
            return NULL;
        }
        usleep(2000);
    }
    return NULL;
}

/* Part 4 as the parent (rank 0). */
static int
run_abort(struct dsv4_backend *be)
{
    const int rank = 0;
    struct dsv4_comm *c = NULL;
    uint8_t id[DSV4_COMM_ID_BYTES];
    struct watch w;
    pthread_t th;
    float *x = be->ops->alloc(be, (size_t)BIG * 4);
    void *g = NULL;
    enum dsv4_err ce;
    double t_ret, t0;
    int ok = 1, rc;
    pid_t pid;

    CHECK("cudaipc id", dsv4_comm_cudaipc_unique_id(id));
    pid = spawn("victim", id, NULL);
    CHECK("cudaipc create", dsv4_comm_cudaipc_create(&c, be, rank, SIZE, id, MAX_BYTES, 10000, NULL));
    memset(&w, 0, sizeof(w));
    w.pid = pid;
    w.c = c;
    if (pthread_create(&th, NULL, watch_main, &w) != 0)
        return 0;
    CHECK("graph_begin", be->ops->graph_begin(be));
    for (int i = 0; i < 8; i++)
        CHECK("allreduce", c->ops->allreduce_sum(c, be, x, BIG));
    CHECK("graph_end", be->ops->graph_end(be, &g));
    for (int r = 0; r < KILL_AFTER + 1; r++)
        CHECK("graph_launch", be->ops->graph_launch(be, g));
    CHECK("sync (must return after the abort)", be->ops->sync(be));
    t_ret = now_ms();
    atomic_store(&w.stop, 1);
    pthread_join(th, NULL);
    ce = dsv4_comm_check(c);
    if (w.t_abort == 0) {
        fprintf(stderr, "  the graph finished without the child (it did not die?)\n");
        ok = 0;
    } else {
        printf("  child died (%s); sync returned %.1f ms after the abort; check: %s\n",
               WIFSIGNALED(w.status) && WTERMSIG(w.status) == SIGKILL ? "SIGKILL" : "other",
               t_ret - w.t_abort, ce == DSV4_OK ? "OK (wrong)" : dsv4_errmsg());
        /* the time is reported, not bounded (no timing thresholds in
         * tests): a sync that never returns is caught by the run's
         * timeout */
        if (ce != DSV4_ERR_CANCELED)
            ok = 0;
    }
    if (c->ops->allreduce_sum(c, be, x, 16) == DSV4_OK) {
        fprintf(stderr, "  an all-reduce on the broken group was accepted\n");
        ok = 0;
    }
    if (cudaGetLastError() != cudaSuccess) {
        fprintf(stderr, "  a CUDA error is pending after the abort\n");
        ok = 0;
    }
    be->ops->graph_free(be, g);
    t0 = now_ms();
    dsv4_comm_destroy(c);
    printf("  destroy of the broken group: %.1f ms\n", now_ms() - t0);
    be->ops->free(be, x);
    if (!ok)
        return 0;
    /* the same process, a new group with a fresh child */
    CHECK("cudaipc id", dsv4_comm_cudaipc_unique_id(id));
    pid = spawn("again", id, NULL);
    CHECK("cudaipc create (new group)", dsv4_comm_cudaipc_create(&c, be, rank, SIZE, id,
                                                                 MAX_BYTES, 10000, NULL));
    ok = run_correct(be, c, rank, 100);
    dsv4_comm_destroy(c);
    rc = reap(pid);
    if (rc != 0)
        fprintf(stderr, "  the new group's child exited %d\n", rc);
    return ok && rc == 0;
}

/* Part 3 as the parent: the child never comes to the all-reduce. */
static int
run_timeout(struct dsv4_backend *be)
{
    const int rank = 0;
    struct dsv4_comm *c = NULL;
    uint8_t id[DSV4_COMM_ID_BYTES];
    float *x = be->ops->alloc(be, 4096 * 4);
    enum dsv4_err e;
    double t0, dt;
    int ok;
    pid_t pid;

    CHECK("cudaipc id", dsv4_comm_cudaipc_unique_id(id));
    pid = spawn("idle", id, NULL);
    CHECK("cudaipc create", dsv4_comm_cudaipc_create(&c, be, rank, SIZE, id, MAX_BYTES, 500, NULL));
    t0 = now_ms();
    CHECK("allreduce", c->ops->allreduce_sum(c, be, x, 4096));
    CHECK("sync (must return at the timeout)", be->ops->sync(be));
    dt = now_ms() - t0;
    e = dsv4_comm_check(c);
    printf("  gave up after %.1f ms (timeout 500 ms): %s\n", dt,
           e == DSV4_OK ? "OK (wrong)" : dsv4_errmsg());
    ok = e == DSV4_ERR_TIMEOUT && dt >= 450.0 && dt < 5000.0;
    t0 = now_ms();
    dsv4_comm_destroy(c);
    printf("  destroy: %.1f ms\n", now_ms() - t0);
    be->ops->free(be, x);
    reap(pid);
    return ok;
}

int
main(int argc, char **argv)
{
    struct dsv4_backend *be = NULL;
    struct dsv4_comm *c = NULL, *nccl = NULL;
    uint8_t id[DSV4_COMM_ID_BYTES], nid[DSV4_COMM_ID_BYTES];
    int n_dev = 0, ok[4] = { 0 }, rc, have_nccl;
    const int rank = 0;
    pid_t pid;

    setenv("NCCL_NVLS_ENABLE", "0", 0);
    if (argc == 6 && strcmp(argv[1], "child") == 0) {
        seed = strtoull(argv[5], NULL, 10);
        return child_main(argv[2], argv[3], argv[4]);
    }
    seed = argc > 1 ? strtoull(argv[1], NULL, 10) : (uint64_t)time(NULL);
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < SIZE) {
        printf("SKIP test_ar_gpu: fewer than two CUDA devices\n");
        return 77;
    }
    printf("test_ar_gpu: seed %llu, %d devices\n", (unsigned long long)seed, n_dev);
    CHECK_R(1, "cuda backend", dsv4_cuda_backend_create(&be, DSV4_NUMERICS_REF, 0));

    /* 1. correctness */
    CHECK_R(1, "cudaipc id", dsv4_comm_cudaipc_unique_id(id));
    pid = spawn("correct", id, NULL);
    CHECK_R(1, "cudaipc create",
            dsv4_comm_cudaipc_create(&c, be, rank, SIZE, id, MAX_BYTES, 10000, NULL));
    ok[0] = run_correct(be, c, rank, REPLAYS);
    dsv4_comm_destroy(c);
    rc = reap(pid);
    ok[0] = ok[0] && rc == 0;
    printf("%s correct: sizes 1 .. 600000 floats, exact gathers and dense sums, %d graph "
           "replays (child exit %d)\n", ok[0] ? "PASS" : "FAIL", REPLAYS, rc);

    /* 2. timing (the child joins in the same order: cudaipc, then NCCL) */
    CHECK_R(1, "cudaipc id", dsv4_comm_cudaipc_unique_id(id));
    have_nccl = dsv4_comm_nccl_unique_id(nid) == DSV4_OK;
    if (!have_nccl)
        printf("  nccl: %s\n", dsv4_errmsg());
    pid = spawn("time", id, have_nccl ? nid : NULL);
    CHECK_R(1, "cudaipc create",
            dsv4_comm_cudaipc_create(&c, be, rank, SIZE, id, MAX_BYTES, 10000, NULL));
    if (have_nccl && dsv4_comm_nccl_create(&nccl, be, rank, SIZE, nid, 60000, NULL) != DSV4_OK) {
        printf("  nccl: %s\n", dsv4_errmsg());
        nccl = NULL;
    }
    ok[1] = run_time(be, c, nccl, rank) && run_time100(be, c, nccl, rank);
    dsv4_comm_destroy(c);
    if (nccl != NULL)
        dsv4_comm_destroy(nccl);
    rc = reap(pid);
    ok[1] = ok[1] && rc == 0;
    printf("%s time (child exit %d)\n", ok[1] ? "PASS" : "FAIL", rc);

    /* 3. timeout, 4. abort after a kill -9, then a new group */
    ok[2] = run_timeout(be);
    printf("%s timeout: a rank that never comes fails the call with DSV4_ERR_TIMEOUT\n",
           ok[2] ? "PASS" : "FAIL");
    ok[3] = run_abort(be);
    printf("%s abort: kill -9 of the peer inside a graphed all-reduce, abort within 1 s, "
           "new group in the same process\n", ok[3] ? "PASS" : "FAIL");
    dsv4_backend_destroy(be);
    rc = ok[0] && ok[1] && ok[2] && ok[3];
    printf("%s test_ar_gpu\n", rc ? "PASS" : "FAIL");
    return rc ? 0 : 1;
}
