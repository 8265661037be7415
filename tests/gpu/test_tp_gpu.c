/*
 * test_tp_gpu.c — a model group over two GPUs (kernels/forward.h "Model
 * groups": tensor-parallel attention, expert-parallel experts, NCCL) with
 * synthetic weights (dsv4_cuda_weights_synthetic_shard).
 *
 * usage: test_tp_gpu equal LAYERS STEPS
 *        test_tp_gpu full STEPS
 *
 * Script (every model, every rank): 16 sequences with prompts of mixed
 * lengths (5, 14, ..., 140 tokens) prefilled in one call, then STEPS greedy
 * decode steps of all 16 streams (decode graphs on), each step's logits
 * hashed (FNV-1a of the bytes) and its tokens kept, then 8 steps of stream 0
 * alone (batch 1).
 *
 * equal: the `flash` widths cut to LAYERS layers (+ MTP layer), all 256
 *   experts: first on one GPU holding all the weights, then as a group of
 *   two ranks (threads, one GPU each).  Pass: every step's logits of both
 *   ranks bit-identical to the one-GPU run's (hashes equal), tokens equal.
 * full: the `flash` config, all 43 layers, as a group of two (each rank
 *   holds about half of the 149 GiB); it does not fit one GPU, so the check
 *   is that both ranks compute identical, finite logits; times printed.
 *
 * Environment: DSV4_TEST_COMM=cudaipc runs the groups over the cudaipc
 * communicator (kernels/comm.h) instead of NCCL; DSV4_TEST_PREFILL=N adds,
 * after the script, a prefill of one N-token prompt (slot 0 reset, one
 * forward call) whose time is printed (the TTFT of the model alone);
 * DSV4_TEST_MOE_LOCAL=0 / 1 sets the groups' moe_local (default: on with
 * the fast kernels or the tp group split, as the rank daemons do; the
 * exact kernels' groups stay bit-identical to one GPU only with it off);
 * DSV4_TEST_GROUP_SPLIT=ep / tp / auto the groups' split
 * (common/weights_shard.h; default auto: tp with the fast kernels, as the
 * rank daemons' group_split = auto, else ep; another value: exit 2).
 *
 * Exit status: 0 pass, 1 failure, 77 fewer than two CUDA devices.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "common/model_config.h"
#include "common/weights.h"
#include "kernels/backend.h"
#include "kernels/comm.h"
#include "kernels/cuda_fast.h"
#include "kernels/cuda_weights.h"
#include "kernels/forward.h"
#include "tests/gpu/gpu_test_util.h"

#define B 16
#define B1_STEPS 8
#define SEED 11

static struct dsv4_config cfg;
static int steps;

/* What one run of the script produced. */
struct result {
    uint64_t *hash;            /* (steps + B1_STEPS + 1) per-step logits hashes */
    int32_t *tok;              /* (steps, B) greedy tokens */
    float *last;               /* (B, V) logits of the last batch-16 step */
    double ms_gen, ms_prefill, ms_b16, ms_b1;
    double ms_b16s, ms_b1s;    /* graphed steps sampled on the GPU (ids back only) */
    double ms_long;            /* DSV4_TEST_PREFILL=N: one N-token prefill */
    double gib;                /* weights on this rank's GPU */
    int finite;
    char err[512];
};

#define RTRY(what, expr)                                                           \
    do {                                                                           \
        if ((expr) != DSV4_OK) {                                                   \
            snprintf(r->err, sizeof(r->err), "%s: %s", what, dsv4_errmsg());      \
            goto out;                                                              \
        }                                                                          \
    } while (0)

/* The script on device `dev` as rank `rank` of `size` (comm NULL: alone). */
/* DSV4_TEST_COMM=cudaipc: the cudaipc communicator instead of NCCL. */
static int
use_cudaipc(void)
{
    const char *v = getenv("DSV4_TEST_COMM");

    return v != NULL && strcmp(v, "cudaipc") == 0;
}

/* DSV4_TEST_PREFILL=N: tokens of the extra one-prompt prefill (0 = none). */
static int
long_prompt(void)
{
    const char *v = getenv("DSV4_TEST_PREFILL");

    return v != NULL ? atoi(v) : 0;
}

/* The group's split: DSV4_TEST_GROUP_SPLIT=ep / tp / auto (default auto:
 * tp with the fast kernels, as the rank daemons' group_split = auto,
 * dsv4_group_split_resolve); any other value ends the test. */
static enum dsv4_group_split
group_split(struct dsv4_backend *be)
{
    const char *v = getenv("DSV4_TEST_GROUP_SPLIT");
    enum dsv4_group_split split = DSV4_GROUP_SPLIT_EP;

    if (dsv4_group_split_resolve(v != NULL ? v : "auto", dsv4_cuda_get_kernels(be), &split) !=
        DSV4_OK) {
        fprintf(stderr, "DSV4_TEST_GROUP_SPLIT: %s\n", dsv4_errmsg());
        exit(2);
    }
    return split;
}

/* The group's moe_local (kernels/forward.h): on with the fast kernels or
 * the tp split, as the rank daemons set it; DSV4_TEST_MOE_LOCAL=0 / 1
 * overrides. */
static int
moe_local(struct dsv4_backend *be)
{
    const char *v = getenv("DSV4_TEST_MOE_LOCAL");

    return v != NULL ? atoi(v) != 0
                     : dsv4_cuda_get_kernels(be) != 0 ||
                           group_split(be) == DSV4_GROUP_SPLIT_TP;
}

static void
run(struct result *r, int dev, int rank, int size, struct dsv4_comm **comm,
    const uint8_t *nccl_id)
{
    struct dsv4_backend *be = NULL;
    struct dsv4_weights w;
    struct dsv4_model *m = NULL;
    struct dsv4_model_opts o = { 0 };
    int V = cfg.vocab_size, plen[B], rows = 0;
    int32_t slot[B], ntok[B], *tok = NULL, cur[B];
    float *lg = NULL;
    double t0;
    size_t freeb, totb;

    memset(&w, 0, sizeof(w));
    for (int i = 0; i < B; i++) {
        plen[i] = 5 + 9 * i;
        rows += plen[i];
        slot[i] = i;
    }
    RTRY("cuda backend", dsv4_cuda_backend_create(&be, DSV4_NUMERICS_REF, dev));
    cudaMemGetInfo(&freeb, &totb);
    t0 = now_ms();
    RTRY("synthetic weights", dsv4_cuda_weights_synthetic_shard(be, &w, &cfg, SEED, rank, size,
                                                                group_split(be), NULL));
    r->ms_gen = now_ms() - t0;
    {
        size_t f2;

        cudaMemGetInfo(&f2, &totb);
        r->gib = (double)(freeb - f2) / (1u << 30);
    }
    if (size > 1 && use_cudaipc())
        RTRY("cudaipc", dsv4_comm_cudaipc_create(comm, be, rank, size, nccl_id,
                                                 (size_t)64 << 20, 60000, NULL));
    else if (size > 1)
        RTRY("nccl", dsv4_comm_nccl_create(comm, be, rank, size, nccl_id, 60000, NULL));
    o.n_slots = B;
    o.max_seq_len = 160 + steps + B1_STEPS + 64;
    o.max_rows = rows;
    if (long_prompt() > 0) {
        o.max_rows = rows > long_prompt() ? rows : long_prompt();
        if (o.max_seq_len < long_prompt() + 64)
            o.max_seq_len = long_prompt() + 64;
    }
    o.graphs = 1;
    o.comm = size > 1 ? *comm : NULL;
    o.moe_local = moe_local(be);
    RTRY("model", dsv4_model_create(&m, be, &w, &o));
    tok = malloc((size_t)rows * sizeof(*tok));
    lg = malloc((size_t)B * V * sizeof(float));
    if (tok == NULL || lg == NULL) {
        snprintf(r->err, sizeof(r->err), "no host memory");
        goto out;
    }
    for (int i = 0; i < rows; i++)
        tok[i] = (int32_t)((i * 2654435761u + 5) % (unsigned)V);
    {
        struct dsv4_batch b = { B, slot, plen, tok };

        t0 = now_ms();
        RTRY("prefill", dsv4_model_forward(m, &b, lg, 0));
        r->ms_prefill = now_ms() - t0;
    }
    r->hash[0] = digest_bytes(lg, (size_t)B * V * sizeof(float));
    for (int i = 0; i < B; i++) {
        cur[i] = argmax(lg + (size_t)i * V, V);
        ntok[i] = 1;
    }
    t0 = now_ms();
    for (int s = 0; s < steps; s++) {
        struct dsv4_batch b = { B, slot, ntok, cur };

        RTRY("decode b16", dsv4_model_forward(m, &b, lg, 0));
        r->hash[1 + s] = digest_bytes(lg, (size_t)B * V * sizeof(float));
        for (int i = 0; i < B; i++) {
            cur[i] = argmax(lg + (size_t)i * V, V);
            r->tok[(size_t)s * B + i] = cur[i];
        }
    }
    r->ms_b16 = steps > 0 ? (now_ms() - t0) / steps : 0;
    memcpy(r->last, lg, (size_t)B * V * sizeof(float));
    r->finite = 1;
    for (int64_t i = 0; i < (int64_t)B * V; i++)
        r->finite &= isfinite(lg[i]) != 0;
    t0 = now_ms();
    for (int s = 0; s < B1_STEPS; s++) {
        struct dsv4_batch b = { 1, slot, ntok, cur };

        RTRY("decode b1", dsv4_model_forward(m, &b, lg, 0));
        r->hash[1 + steps + s] = digest_bytes(lg, (size_t)V * sizeof(float));
        cur[0] = argmax(lg, V);
    }
    r->ms_b1 = (now_ms() - t0) / B1_STEPS;
    /* timing as the ranks run it: graphed, sampled on the GPU, ids back */
    {
        struct dsv4_sample_params sp[B];
        struct dsv4_batch b = { B, slot, ntok, cur };

        memset(sp, 0, sizeof(sp));
        for (int i = 0; i < B; i++)
            sp[i].top_p = 1.0f;
        RTRY("sampled decode", dsv4_model_forward_sample(m, &b, sp, cur, NULL, NULL));
        t0 = now_ms();
        for (int s = 0; s < 16; s++)
            RTRY("sampled decode", dsv4_model_forward_sample(m, &b, sp, cur, NULL, NULL));
        r->ms_b16s = (now_ms() - t0) / 16;
        b.n_seqs = 1;
        RTRY("sampled decode", dsv4_model_forward_sample(m, &b, sp, cur, NULL, NULL));
        t0 = now_ms();
        for (int s = 0; s < 16; s++)
            RTRY("sampled decode", dsv4_model_forward_sample(m, &b, sp, cur, NULL, NULL));
        r->ms_b1s = (now_ms() - t0) / 16;
    }
    if (long_prompt() > 0) {
        int32_t n = long_prompt();
        int32_t *lt = malloc((size_t)n * sizeof(*lt));
        struct dsv4_batch b = { 1, slot, &n, lt };

        if (lt == NULL) {
            snprintf(r->err, sizeof(r->err), "no host memory");
            goto out;
        }
        for (int i = 0; i < n; i++)
            lt[i] = (int32_t)((i * 2246822519u + 7) % (unsigned)V);
        enum dsv4_err e = dsv4_model_seq_reset(m, 0);

        cudaDeviceSynchronize();
        t0 = now_ms();
        if (e == DSV4_OK)
            e = dsv4_model_forward(m, &b, lg, 0);
        cudaDeviceSynchronize();
        r->ms_long = now_ms() - t0;
        free(lt);
        RTRY("long prefill", e);
    }
out:
    free(tok);
    free(lg);
    dsv4_model_free(m);
    if (size > 1 && *comm != NULL)
        dsv4_comm_destroy(*comm), *comm = NULL;
    dsv4_cuda_weights_free(be, &w);
    dsv4_backend_destroy(be);
}

static void
result_init(struct result *r)
{
    memset(r, 0, sizeof(*r));
    r->hash = calloc((size_t)steps + B1_STEPS + 1, sizeof(*r->hash));
    r->tok = calloc((size_t)steps * B + 1, sizeof(*r->tok));
    r->last = calloc((size_t)B * cfg.vocab_size, sizeof(float));
    if (r->hash == NULL || r->tok == NULL || r->last == NULL) {
        fprintf(stderr, "no host memory\n");
        exit(1);
    }
}

struct rank_arg {
    struct result res;
    int rank;
    struct dsv4_comm *comm;
    const uint8_t *id;
};

static void *
rank_main(void *p)
{
    struct rank_arg *a = p;

    run(&a->res, a->rank, a->rank, 2, &a->comm, a->id);
    return NULL;
}

/* Run the script as a group of two; 0 when both ranks finished. */
static int
run_group(struct rank_arg ra[2])
{
    uint8_t id[DSV4_COMM_ID_BYTES];
    pthread_t th[2];
    int bad = 0;

    if (use_cudaipc())
        TRY("cudaipc unique id", dsv4_comm_cudaipc_unique_id(id));
    else
        TRY("nccl unique id", dsv4_comm_nccl_unique_id(id));
    for (int i = 0; i < 2; i++) {
        result_init(&ra[i].res);
        ra[i].rank = i;
        ra[i].comm = NULL;
        ra[i].id = id;
        if (pthread_create(&th[i], NULL, rank_main, &ra[i]) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            exit(1);
        }
    }
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++)
        if (ra[i].res.err[0] != '\0') {
            printf("FAIL rank %d: %s\n", i, ra[i].res.err);
            bad = 1;
        }
    return bad;
}

/* Steps whose hashes differ between a and b; prints the first. */
static int
compare(const char *what, const struct result *a, const struct result *b)
{
    int n = steps + B1_STEPS + 1, diff = 0, tokd = 0;
    double md = 0, ma = 0;

    for (int s = 0; s < n; s++)
        if (a->hash[s] != b->hash[s]) {
            if (diff == 0)
                printf("   %s: first differing logits at step %d\n", what, s);
            diff++;
        }
    for (int64_t i = 0; i < (int64_t)steps * B; i++)
        tokd += a->tok[i] != b->tok[i];
    for (int64_t i = 0; i < (int64_t)B * cfg.vocab_size; i++) {
        md = fmax(md, fabs((double)a->last[i] - b->last[i]));
        ma = fmax(ma, fabs((double)a->last[i]));
    }
    printf("| %s | steps with differing logits: %d of %d | tokens differing: %d of %d | "
           "last step max |diff| %.3g (max |logit| %.3g) |\n", what, diff, n, tokd, steps * B,
           md, ma);
    return diff != 0 || tokd != 0;
}

static void
times(const char *what, const struct result *r)
{
    uint64_t digest = digest_bytes(r->hash, (size_t)(steps + B1_STEPS + 1) * sizeof(*r->hash));
    printf("| %s | weights %.1f GiB in %.0f ms | prefill 16 prompts (1,160 tokens) %.0f ms | "
           "decode b16 %.2f ms/step | b1 %.2f ms/step (logits to the host, checked) | "
           "GPU-sampled b16 %.2f ms/step, b1 %.2f ms/step | finite %s | logits digest "
           "%016llx (equal across builds and switches when the bits are) |\n", what, r->gib,
           r->ms_gen, r->ms_prefill, r->ms_b16, r->ms_b1, r->ms_b16s, r->ms_b1s,
           r->finite ? "yes" : "NO", (unsigned long long)digest);
    if (r->ms_long > 0)
        printf("| %s | prefill of one %d-token prompt (one call): %.1f ms (%.3f ms per token) "
               "| comm %s | moe_local %s | group split %s |\n", what, long_prompt(), r->ms_long,
               r->ms_long / long_prompt(), use_cudaipc() ? "cudaipc" : "nccl",
               getenv("DSV4_TEST_MOE_LOCAL") != NULL ? getenv("DSV4_TEST_MOE_LOCAL") : "default",
               getenv("DSV4_TEST_GROUP_SPLIT") != NULL ? getenv("DSV4_TEST_GROUP_SPLIT")
                                                        : "default");
}

int
main(int argc, char **argv)
{
    struct rank_arg ra[2];
    int n_dev = 0, bad = 0;

    if (argc < 3 || (strcmp(argv[1], "equal") != 0 && strcmp(argv[1], "full") != 0) ||
        (strcmp(argv[1], "equal") == 0 && argc < 4)) {
        fprintf(stderr, "usage: test_tp_gpu equal LAYERS STEPS\n"
                        "       test_tp_gpu full STEPS\n");
        return 2;
    }
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 2) {
        printf("SKIP: %d CUDA devices, need 2\n", n_dev);
        return 77;
    }
    TRY("preset", dsv4_config_preset(&cfg, "flash"));
    if (strcmp(argv[1], "equal") == 0) {
        struct result one;

        flash_cut(&cfg, atoi(argv[2]));
        steps = atoi(argv[3]);
        result_init(&one);
        run(&one, 0, 0, 1, NULL, NULL);
        if (one.err[0] != '\0') {
            printf("FAIL one GPU: %s\n", one.err);
            return 1;
        }
        times("flash widths, one GPU", &one);
        bad |= run_group(ra);
        if (!bad) {
            times("flash widths, rank 0 of 2", &ra[0].res);
            times("flash widths, rank 1 of 2", &ra[1].res);
            bad |= compare("rank 0 of 2 vs one GPU", &ra[0].res, &one);
            bad |= compare("rank 1 of 2 vs one GPU", &ra[1].res, &one);
            bad |= !one.finite;
        }
        printf("%s tp equal (%d layers, %d steps)\n", bad ? "FAIL" : "PASS",
               cfg.num_hidden_layers, steps);
    } else {
        steps = atoi(argv[2]);
        bad |= run_group(ra);
        if (!bad) {
            times("flash 43 layers, rank 0 of 2", &ra[0].res);
            times("flash 43 layers, rank 1 of 2", &ra[1].res);
            bad |= compare("rank 1 vs rank 0", &ra[1].res, &ra[0].res);
            bad |= !ra[0].res.finite;
        }
        printf("%s tp full (%d layers, %d steps)\n", bad ? "FAIL" : "PASS",
               cfg.num_hidden_layers, steps);
    }
    return bad ? 1 : 0;
}
