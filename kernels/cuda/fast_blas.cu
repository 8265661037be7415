/*
 * fast_blas.cu — the grouped output projection (linear_grouped: wo_a) of
 * prefill calls through cuBLASLt's BF16 GEMM (issue 7; docs/gpu.md "wo_a on
 * cuBLASLt"), and cuBLASLt's FP8 block-scaled GEMM for the FP8 linears of
 * prefill calls (cuda_blas_fp8, called by fast_gemm8.cu; docs/gpu.md "FP8
 * linears on cuBLASLt").
 *
 * fw_kernel's grouped mode (fast_gemm.cu) decodes each FP8 weight to bf16
 * in registers once per tile of 128 tokens, so a 2,048-token call decodes
 * every weight 16 times and runs its bf16 wgmma at about a quarter of the
 * tensor cores' rate (docs/perf.md run 46).  Here the weights are decoded
 * once per call into a bf16 copy (bl_w_kernel: the exact values w * s_w,
 * as fw_kernel's), x is rounded to bf16 in its own layout (bl_x_kernel:
 * the op's rounding), and cuBLASLt multiplies the G groups as one strided
 * batch (TN: each group's (R, K) weights times its (K, T) slice of x, fp32
 * accumulation, bf16 output, round to nearest even) into scratch, which
 * bl_out_kernel widens to the op's fp32 output.
 *
 * Bits.  cuBLASLt sums in its own order: values may differ from
 * fw_kernel's in the last bit (the op's bounds against the exact path hold
 * for both).  The algorithm is chosen once per backend and shape, for a
 * fixed number of token columns (BL_TUNE_T) and with split-K and its
 * reductions switched off, and then used for every T, so that a row's
 * outputs depend on that row only (tests/gpu/bench_woa.c checks this: its
 * T-independence case).  A call cuBLASLt cannot take returns
 * DSV4_ERR_NOTSUP before anything is queued, or after the conversions (then
 * harmless), and the caller falls back to fw_kernel.
 *
 * The same pieces (cuda_blas_decode, cuda_blas_gemm, cuda_blas_widen) run
 * the shared expert of the prefill MoE (fast_gemm.cu, fw_moe): its FP8
 * weights decoded with their columns in fw_kernel's B order (fw_perm), so
 * the GEMMs take fw_moe's prepared x and quantized h as they are.
 *
 * Workspace: one per queue (the side queue's FP8 linears may run beside
 * the main queue's GEMMs; an algorithm may keep a counter there).
 *
 * MPS.  In an MPS client with a share of the SMs the heuristic's algorithms
 * with thread block clusters of several blocks gave wrong outputs
 * (docs/perf.md runs 51-52), so there every plan's cluster shape is set to
 * one block (1x1x1; cublasLtMatmulAlgoCheck must accept it, else the next
 * candidate), which gives the same bits as the heuristic's shape without
 * MPS.  DSV4_CUDA_BLAS_MPS=0 keeps MPS clients off cuBLASLt altogether.
 *
 * cuBLASLt is opened at run time (dlopen, as NCCL in cuda_comm.cu): the
 * binaries need no link-time CUDA library besides the static runtime, and a
 * machine without libcublasLt keeps fw_kernel.  DSV4_CUDA_BLAS=0 switches
 * this path off.
 */
#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda/fast.cuh"        /* fk_e4m3x2 */
#include "kernels/cuda/fast_gemm.cuh"   /* fw_perm */
#include "kernels/cuda_gemm_grouped.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BL_TUNE_T 2048                 /* token columns the algorithm is chosen for */
#define BL_WS_BYTES (32u << 20)        /* cuBLASLt workspace per backend */

/* --- the library, opened once ------------------------------------------------------------- */

struct bl_api {
    void *lib;
    decltype(&cublasLtCreate) create;
    decltype(&cublasLtDestroy) destroy;
    decltype(&cublasLtMatmulDescCreate) desc_create;
    decltype(&cublasLtMatmulDescSetAttribute) desc_set;
    decltype(&cublasLtMatmulDescDestroy) desc_destroy;
    decltype(&cublasLtMatrixLayoutCreate) layout_create;
    decltype(&cublasLtMatrixLayoutSetAttribute) layout_set;
    decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
    decltype(&cublasLtMatmulPreferenceCreate) pref_create;
    decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
    decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
    decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
    decltype(&cublasLtMatmulAlgoConfigSetAttribute) algo_set;
    decltype(&cublasLtMatmul) matmul;
    /* optional: the check of a changed cluster shape (without it an MPS
     * client gets no plan) and DSV4_CUDA_BLAS_LOG's configuration */
    decltype(&cublasLtMatmulAlgoConfigGetAttribute) algo_get;
    decltype(&cublasLtMatmulAlgoCheck) algo_check;
};

static struct bl_api bl;
static pthread_once_t bl_once = PTHREAD_ONCE_INIT;
static char bl_why[256];

static void
bl_open(void)
{
    static const char *names[] = { "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so" };
    void *lib = NULL;

    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && lib == NULL; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(bl_why, sizeof(bl_why), "cannot open libcublasLt: %s", dlerror());
        return;
    }
#define BL_SYM(field, name) bl.field = (decltype(bl.field))dlsym(lib, name)
    BL_SYM(create, "cublasLtCreate");
    BL_SYM(destroy, "cublasLtDestroy");
    BL_SYM(desc_create, "cublasLtMatmulDescCreate");
    BL_SYM(desc_set, "cublasLtMatmulDescSetAttribute");
    BL_SYM(desc_destroy, "cublasLtMatmulDescDestroy");
    BL_SYM(layout_create, "cublasLtMatrixLayoutCreate");
    BL_SYM(layout_set, "cublasLtMatrixLayoutSetAttribute");
    BL_SYM(layout_destroy, "cublasLtMatrixLayoutDestroy");
    BL_SYM(pref_create, "cublasLtMatmulPreferenceCreate");
    BL_SYM(pref_set, "cublasLtMatmulPreferenceSetAttribute");
    BL_SYM(pref_destroy, "cublasLtMatmulPreferenceDestroy");
    BL_SYM(heuristic, "cublasLtMatmulAlgoGetHeuristic");
    BL_SYM(algo_set, "cublasLtMatmulAlgoConfigSetAttribute");
    BL_SYM(matmul, "cublasLtMatmul");
    BL_SYM(algo_get, "cublasLtMatmulAlgoConfigGetAttribute");
    BL_SYM(algo_check, "cublasLtMatmulAlgoCheck");
#undef BL_SYM
    if (bl.create == NULL || bl.destroy == NULL || bl.desc_create == NULL ||
        bl.desc_set == NULL || bl.desc_destroy == NULL || bl.layout_create == NULL ||
        bl.layout_set == NULL || bl.layout_destroy == NULL || bl.pref_create == NULL ||
        bl.pref_set == NULL || bl.pref_destroy == NULL || bl.heuristic == NULL ||
        bl.algo_set == NULL || bl.matmul == NULL) {
        snprintf(bl_why, sizeof(bl_why), "libcublasLt lacks an entry point");
        dlclose(lib);
        memset(&bl, 0, sizeof(bl));
        return;
    }
    bl.lib = lib;
}

/* --- per backend: handle, workspace, the chosen algorithm ----------------------------------- */

/* What a plan multiplies. */
enum {
    BL_BF16 = 0,   /* bf16 weights and x (the grouped linear, the shared expert) */
    BL_FP8 = 1,    /* E4M3 weights with 128x128 fp32 block scales, E4M3 x with
                      fp32 scales per 128 columns (the FP8 linear) */
    BL_BF16F = 2,  /* bf16 weights and x, fp32 output (the BF16 linear: x as
                      hi + lo, two GEMMs into one fp32 sum) */
};

/* One shape's plan: descriptors whose sizes do not depend on T are kept;
 * the layouts of x and the output are set per call. */
struct bl_plan {
    int R, K, G, kind;
    int ok;                            /* 1 usable, -1 cuBLASLt has no algorithm */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a;          /* the weights: (K, R) column-major, batch G */
    cublasLtMatmulAlgo_t algo;
};

#define BL_PLANS 24   /* shapes a backend meets: wo_a, the shared expert, the FP8 linears */

/* A kept bf16 copy of one weight (w3 NULL) or of two stacked ones. */
struct bl_keep {
    const void *w1, *s1, *w3, *s3;     /* the FP8 codes and scales it came from */
    int n1, k1, n3, perm;
    uint16_t *wb;
    size_t bytes;
};

struct cuda_blas {
    cublasLtHandle_t h;
    void *ws;                          /* the main queue's workspace; also
                                          stands in for the scale pointers
                                          while an FP8 plan is made */
    void *ws_side;                     /* the side queue's (its linears may
                                          run beside the main queue's): made
                                          on first use there */
    struct bl_plan plan[BL_PLANS];
    int n_plan;
    int mps;                           /* the context is an MPS client */
    struct bl_keep *keep;              /* kept bf16 weight copies (cuda_blas_weights) */
    int n_keep, cap_keep;
    size_t keep_bytes;
    int keep_full;                     /* a copy did not fit: no more tries */
};

static struct cuda_switch bl_switch = CUDA_SWITCH("DSV4_CUDA_BLAS", 1);

/* DSV4_CUDA_BLAS_MPS=0: no cuBLASLt in an MPS client (our own kernels take
 * those calls).  On by default, with clusters of one block there (the
 * header comment: the heuristic's clusters gave wrong outputs with 70 and
 * 80% of the SMs, docs/perf.md runs 51-52). */
static struct cuda_switch bl_mps_switch = CUDA_SWITCH("DSV4_CUDA_BLAS_MPS", 1);

void
cuda_blas_fini(struct dsv4_backend *be)
{
    struct cuda_blas *b = (struct cuda_blas *)cuda_st(be)->blas;

    if (b == NULL)
        return;
    for (int i = 0; i < b->n_plan; i++) {
        if (b->plan[i].a != NULL)
            bl.layout_destroy(b->plan[i].a);
        if (b->plan[i].desc != NULL)
            bl.desc_destroy(b->plan[i].desc);
    }
    if (b->h != NULL)
        bl.destroy(b->h);
    cudaFree(b->ws);
    cudaFree(b->ws_side);
    for (int i = 0; i < b->n_keep; i++)
        cudaFree(b->keep[i].wb);
    free(b->keep);
    free(b);
    cuda_st(be)->blas = NULL;
}

/* The backend's cuBLASLt state, made on first use; NULL (dsv4 error set)
 * when the library or the workspace is missing, or the context is an MPS
 * client and DSV4_CUDA_BLAS_MPS=0 (bl_mps_switch) or the library cannot
 * check a plan with a changed cluster shape. */
static struct cuda_blas *
bl_state(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);
    struct cuda_blas *b = (struct cuda_blas *)st->blas;

    if (b != NULL)
        return b;
    if (cuda_mps(be) && !cuda_switch_on(&bl_mps_switch)) {
        dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: not in an MPS client (DSV4_CUDA_BLAS_MPS=0)");
        return NULL;
    }
    pthread_once(&bl_once, bl_open);
    if (bl.lib == NULL) {
        dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: %s", bl_why);
        return NULL;
    }
    if (cuda_mps(be) && bl.algo_check == NULL) {   /* no plan could be checked */
        dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: MPS client, and libcublasLt has no "
                                      "cublasLtMatmulAlgoCheck for its one-block clusters");
        return NULL;
    }
    b = (struct cuda_blas *)calloc(1, sizeof(*b));
    if (b == NULL) {
        dsv4_err_set(DSV4_ERR_NOMEM, "cuda blas: no memory");
        return NULL;
    }
    if (bl.create(&b->h) != CUBLAS_STATUS_SUCCESS ||
        cudaMalloc(&b->ws, BL_WS_BYTES) != cudaSuccess) {
        (void)cudaGetLastError();
        if (b->h != NULL)
            bl.destroy(b->h);
        free(b);
        dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: cublasLtCreate or the workspace failed");
        return NULL;
    }
    b->mps = cuda_mps(be);
    st->blas = b;
    return b;
}

/* The workspace of the queue whose ops are being queued: the main queue's
 * or the side queue's (cuda.cuh, side), whose kernels may run at the same
 * time and must not share one; NULL (dsv4 error set) when it cannot be
 * made. */
static void *
bl_ws(struct dsv4_backend *be, struct cuda_blas *b)
{
    if (cuda_st(be)->side != 1)
        return b->ws;
    if (b->ws_side == NULL && cudaMalloc(&b->ws_side, BL_WS_BYTES) != cudaSuccess) {
        (void)cudaGetLastError();
        b->ws_side = NULL;
        dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: no side-queue workspace");
    }
    return b->ws_side;
}

/* A column-major layout of rows x cols elements of type ty, leading
 * dimension ld, batch of G with `stride` elements between matrices; NULL
 * on failure. */
static cublasLtMatrixLayout_t
bl_layout(cudaDataType_t ty, uint64_t rows, uint64_t cols, int64_t ld, int G, int64_t stride)
{
    cublasLtMatrixLayout_t l = NULL;
    int32_t n = G;

    if (bl.layout_create(&l, ty, rows, cols, ld) != CUBLAS_STATUS_SUCCESS)
        return NULL;
    if (bl.layout_set(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n)) !=
            CUBLAS_STATUS_SUCCESS ||
        bl.layout_set(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)) !=
            CUBLAS_STATUS_SUCCESS) {
        bl.layout_destroy(l);
        return NULL;
    }
    return l;
}

/* Knobs: DSV4_CUDA_BLAS_CLUSTER=N sets every plan's thread block cluster
 * shape (CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cublasLtClusterShape_t: 2 =
 * 1x1x1, 0 = the heuristic's), kept only if cublasLtMatmulAlgoCheck accepts
 * it; unset: 1x1x1 in an MPS client, the heuristic's elsewhere.
 * DSV4_CUDA_BLAS_LOG=1 writes each plan's configuration to stderr when it
 * is made. */
static struct cuda_switch bl_log_switch = CUDA_SWITCH("DSV4_CUDA_BLAS_LOG", 0);

static int
bl_cluster_shape(const struct cuda_blas *b)
{
    const char *e = getenv("DSV4_CUDA_BLAS_CLUSTER");
    char *end = NULL;
    long n = e != NULL && *e != '\0' ? strtol(e, &end, 10) : -1;

    if (end != NULL && *end != '\0')
        n = -1;   /* not a whole number ("auto"): unset, not 0 (the heuristic's) */

    if (n < 0 || n >= 1000)
        return b->mps ? CUBLASLT_CLUSTER_SHAPE_1x1x1 : 0;
    return (int)n;
}

/* One line on stderr: the configuration of p's algorithm (DSV4_CUDA_BLAS_LOG);
 * workspace and waves are the heuristic's figures for its own form. */
static void
bl_plan_log(const struct bl_plan *p, const cublasLtMatmulHeuristicResult_t *hr)
{
    int32_t id = -1, splitk = -1;
    uint32_t tile = 0, red = 0, swz = 0, custom = 0, stages = 0;
    uint16_t inner = 0, cluster = 0;
    size_t n;

    if (bl.algo_get == NULL)
        return;
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &n);
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &n);
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &n);
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof(red), &n);
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof(swz), &n);
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &n);
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &n);
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof(inner), &n);
    bl.algo_get(&p->algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &n);
    fprintf(stderr,
            "cuda blas plan R %d K %d G %d kind %d: algo %d tile %u stages %u cluster %u "
            "inner %u splitk %d reduction %u swizzle %u custom %u; workspace %zu, waves %.2f\n",
            p->R, p->K, p->G, p->kind, (int)id, tile, stages, (unsigned)cluster,
            (unsigned)inner, (int)splitk, red, swz, custom, hr->workspaceSize,
            (double)hr->wavesCount);
}

/* The plan of shape (R, K, G) and kind for b, made on first use: the
 * descriptor, the weights' layout and one algorithm chosen at BL_TUNE_T
 * token columns, without split-K (in an MPS client with clusters of one
 * block: bl_cluster_shape).  BL_FP8: G == 1, the weights' scales
 * 128x128 blocks (A), x's one per token and 128 columns (B); the scale
 * pointers are set per call (b->ws stands in for them while the algorithm
 * is chosen).  NULL when cuBLASLt offers none. */
static struct bl_plan *
bl_plan_get(struct cuda_blas *b, int R, int K, int G, int kind)
{
    struct bl_plan *p = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatrixLayout_t lx = NULL, lo = NULL;
    cublasLtMatmulHeuristicResult_t hr[8];
    int n_hr = 0;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulMatrixScale_t blk = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    cublasLtMatmulMatrixScale_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    cudaDataType_t ty = kind == BL_FP8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    cudaDataType_t to = kind == BL_BF16F ? CUDA_R_32F : CUDA_R_16BF;
    uint64_t wsb = BL_WS_BYTES;
    int cluster = bl_cluster_shape(b), chosen = -1;

    for (int i = 0; i < b->n_plan; i++)
        if (b->plan[i].R == R && b->plan[i].K == K && b->plan[i].G == G &&
            b->plan[i].kind == kind)
            return b->plan[i].ok > 0 ? &b->plan[i] : NULL;
    if (b->n_plan == BL_PLANS)
        return NULL;
    p = &b->plan[b->n_plan++];
    memset(p, 0, sizeof(*p));
    p->R = R, p->K = K, p->G = G, p->kind = kind, p->ok = -1;
    if (bl.desc_create(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) {
        p->desc = NULL;
        return NULL;
    }
    if (bl.desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) !=
            CUBLAS_STATUS_SUCCESS ||
        bl.desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) !=
            CUBLAS_STATUS_SUCCESS)
        return NULL;
    if (kind == BL_FP8 &&
        (bl.desc_set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &blk, sizeof(blk)) !=
             CUBLAS_STATUS_SUCCESS ||
         bl.desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, sizeof(vec)) !=
             CUBLAS_STATUS_SUCCESS ||
         bl.desc_set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b->ws, sizeof(b->ws)) !=
             CUBLAS_STATUS_SUCCESS ||
         bl.desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b->ws, sizeof(b->ws)) !=
             CUBLAS_STATUS_SUCCESS))
        return NULL;
    /* weights: group g's rows (R, K) row-major = (K, R) column-major, op T */
    p->a = bl_layout(ty, (uint64_t)K, (uint64_t)R, K, G, (int64_t)R * K);
    /* x: group g's columns of the (T, G K) rows = (K, T) column-major, ld G K;
     * out: (T, G R) rows = (R, T) column-major per group, ld G R */
    lx = bl_layout(ty, (uint64_t)K, BL_TUNE_T, (int64_t)G * K, G, K);
    lo = bl_layout(to, (uint64_t)R, BL_TUNE_T, (int64_t)G * R, G, R);
    if (p->a != NULL && lx != NULL && lo != NULL &&
        bl.pref_create(&pref) == CUBLAS_STATUS_SUCCESS &&
        bl.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)) ==
            CUBLAS_STATUS_SUCCESS &&
        bl.heuristic(b->h, p->desc, p->a, lx, lo, lo, pref, 8, hr, &n_hr) ==
            CUBLAS_STATUS_SUCCESS) {
        for (int i = 0; i < n_hr && p->ok < 0; i++) {
            uint32_t one = 1, none = CUBLASLT_REDUCTION_SCHEME_NONE;
            cublasLtMatmulAlgo_t algo = hr[i].algo;

            if (hr[i].state != CUBLAS_STATUS_SUCCESS)
                continue;
            /* one pass over K per output: no split, no reduction order
             * that could depend on the grid */
            if (bl.algo_set(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) !=
                    CUBLAS_STATUS_SUCCESS ||
                bl.algo_set(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none,
                            sizeof(none)) != CUBLAS_STATUS_SUCCESS)
                continue;
            if (cluster > 0) {   /* MPS, or DSV4_CUDA_BLAS_CLUSTER=N */
                uint16_t c = (uint16_t)cluster;
                cublasLtMatmulHeuristicResult_t chk;

                if (bl.algo_check == NULL ||
                    bl.algo_set(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c, sizeof(c)) !=
                        CUBLAS_STATUS_SUCCESS ||
                    bl.algo_check(b->h, p->desc, p->a, lx, lo, lo, &algo, &chk) !=
                        CUBLAS_STATUS_SUCCESS ||
                    chk.workspaceSize > wsb)
                    continue;
            }
            p->algo = algo;
            p->ok = 1;
            chosen = i;
        }
        if (chosen >= 0 && cuda_switch_on(&bl_log_switch))
            bl_plan_log(p, &hr[chosen]);
    }
    if (pref != NULL)
        bl.pref_destroy(pref);
    if (lx != NULL)
        bl.layout_destroy(lx);
    if (lo != NULL)
        bl.layout_destroy(lo);
    return p->ok > 0 ? p : NULL;
}

/* --- the conversions ---------------------------------------------------------------------- */

/* W (N, K) FP8 with 128x128 E8M0 block scales -> bf16 (N, K): the exact
 * values w * s_w (fw_kernel's decoded weights); PERM: column k of a row at
 * fw_perm(k).  A thread per NC = 16 codes (PERM: 32, one 32-column group;
 * either way one block scale): E4M3 pairs through the hardware's exact
 * conversion to f16 (fk_e4m3x2; NaN stays NaN), times s_w in fp32 (exact:
 * a power of two), whose upper half is the bf16 value (at most 4
 * significant bits); the group's permutation is done in registers
 * (constant indices once unrolled), so the stores stay contiguous (16 codes
 * a thread measured faster where nothing is permuted). */
template <int PERM>
static __global__ void
bl_w_kernel(uint16_t *wb, const uint8_t *codes, const uint8_t *scale, int N, int K)
{
    constexpr int NC = PERM ? 32 : 16;
    int64_t e = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * NC;

    if (e >= (int64_t)N * K)
        return;
    {
        int64_t n = e / K;
        int k = (int)(e % K);
        float s = cu_e8m0_to_f32(scale[(n / 128) * (K / 128) + k / 128]);
        uint32_t cw[NC / 4], o[NC / 2];
        uint16_t v[NC];

#pragma unroll
        for (int j = 0; j < NC / 16; j++) {
            uint4 c = *(const uint4 *)(codes + e + 16 * j);

            cw[4 * j] = c.x, cw[4 * j + 1] = c.y, cw[4 * j + 2] = c.z, cw[4 * j + 3] = c.w;
        }
#pragma unroll
        for (int j = 0; j < NC / 2; j++) {
            __half2 h;
            uint32_t p = fk_e4m3x2(cw[j / 2] >> (16 * (j % 2)));

            memcpy(&h, &p, 4);
            /* columns 2j and 2j + 1, at their places */
            v[PERM ? fw_perm(2 * j) : 2 * j] =
                (uint16_t)(__float_as_uint(__low2float(h) * s) >> 16);
            v[PERM ? fw_perm(2 * j + 1) : 2 * j + 1] =
                (uint16_t)(__float_as_uint(__high2float(h) * s) >> 16);
        }
#pragma unroll
        for (int j = 0; j < NC / 2; j++)
            o[j] = (uint32_t)v[2 * j] | (uint32_t)v[2 * j + 1] << 16;
#pragma unroll
        for (int j = 0; j < NC / 8; j++)
            *(uint4 *)(wb + e + 8 * j) = make_uint4(o[4 * j], o[4 * j + 1], o[4 * j + 2],
                                                    o[4 * j + 3]);
    }
}

/* x (n floats) -> bf16 bits (cu_bf16_round's rounding), four a thread. */
static __global__ void
bl_x_kernel(uint16_t *xb, const float *x, int64_t n)
{
    int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;

    if (i >= n)
        return;
    {
        float4 v = *(const float4 *)(x + i);

        *(uint2 *)(xb + i) = make_uint2(cu_bf16x2_round(v.x, v.y), cu_bf16x2_round(v.z, v.w));
    }
}

/* bf16 bits (n) -> fp32 values, four a thread. */
static __global__ void
bl_out_kernel(float *out, const uint16_t *ob, int64_t n)
{
    int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;

    if (i >= n)
        return;
    {
        uint2 v = *(const uint2 *)(ob + i);

        *(float4 *)(out + i) = make_float4(__uint_as_float(v.x << 16),
                                           __uint_as_float(v.x & 0xffff0000u),
                                           __uint_as_float(v.y << 16),
                                           __uint_as_float(v.y & 0xffff0000u));
    }
}

/* --- the pieces ---------------------------------------------------------------------------- */

void
dsv4_cuda_set_blas(int on)
{
    cuda_switch_set(&bl_switch, on);
}

int
dsv4_cuda_blas_on(void)
{
    return cuda_switch_on(&bl_switch);
}

int
dsv4_cuda_blas_usable(struct dsv4_backend *be)
{
    if (!cuda_switch_on(&bl_switch)) {
        dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: switched off (DSV4_CUDA_BLAS)");
        return 0;
    }
    return bl_state(be) != NULL;
}

/* The FP8 formats the decode takes: 128x128 block scales, codes 16-byte
 * aligned, K a multiple of 128. */
static int
bl_fp8_ok(const struct dsv4_linear *W)
{
    return W->fmt == DSV4_WFMT_FP8 && W->w != NULL && W->scale != NULL && W->n_out > 0 &&
           W->n_out % 128 == 0 && W->n_in > 0 && W->n_in % 128 == 0 &&
           (uintptr_t)W->w % 16 == 0;
}

enum dsv4_err
cuda_blas_decode(struct dsv4_backend *be, uint16_t *wb, const struct dsv4_linear *W, int perm)
{
    int64_t nw = (int64_t)W->n_out * W->n_in;
    unsigned blocks = (unsigned)((nw / (perm ? 32 : 16) + 255) / 256);

    if (!bl_fp8_ok(W))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: no decode for fmt %d, %d x %d",
                            (int)W->fmt, W->n_out, W->n_in);
    if (perm)
        bl_w_kernel<1><<<blocks, 256, 0, cuda_stream(be)>>>(wb, (const uint8_t *)W->w, W->scale,
                                                             W->n_out, W->n_in);
    else
        bl_w_kernel<0><<<blocks, 256, 0, cuda_stream(be)>>>(wb, (const uint8_t *)W->w, W->scale,
                                                             W->n_out, W->n_in);
    CUDA_LAUNCHED("cuda blas decode");
    return DSV4_OK;
}

/* --- kept bf16 weight copies ------------------------------------------------------------ */

#define BL_KEEP_RESERVE ((size_t)8 << 30)   /* device memory a new copy leaves free */

#define BL_KEEP_MB_DEFAULT 4096LL
#define BL_KEEP_MB_MAX (1LL << 30)   /* 1 PB: beyond it the byte count would overflow */

/* DSV4_CUDA_BLAS_KEEP_MB: bytes of kept copies at most (default 4,096 MB; 0
 * keeps none, every call decodes its weights as before).  Operators set it
 * in a prefill unit (docs/operations.md), so a value that is not a whole
 * number of MB in [0, BL_KEEP_MB_MAX] is reported on stderr (the journal)
 * once, naming the default taken instead. */
static size_t
bl_keep_budget(void)
{
    static long long mb = -1;

    if (mb < 0) {
        const char *e = getenv("DSV4_CUDA_BLAS_KEEP_MB");
        char *end = NULL;
        long long v = e != NULL ? strtoll(e, &end, 10) : BL_KEEP_MB_DEFAULT;

        if (e != NULL && (end == e || *end != '\0' || v < 0 || v > BL_KEEP_MB_MAX)) {
            fprintf(stderr,
                    "dsv4 cuda: DSV4_CUDA_BLAS_KEEP_MB=\"%s\" is not a number of MB from 0 to "
                    "%lld; using the default, %lld\n",
                    e, BL_KEEP_MB_MAX, BL_KEEP_MB_DEFAULT);
            v = BL_KEEP_MB_DEFAULT;
        }
        mb = v;
    }
    return (size_t)mb << 20;
}

/* The kept copy of (W1, W3, perm) in b, or NULL. */
static const uint16_t *
bl_keep_find(const struct cuda_blas *b, const struct dsv4_linear *W1,
             const struct dsv4_linear *W3, int perm)
{
    for (int i = 0; i < b->n_keep; i++) {
        const struct bl_keep *k = &b->keep[i];

        if (k->w1 == W1->w && k->s1 == W1->scale && k->n1 == W1->n_out && k->k1 == W1->n_in &&
            k->perm == perm && k->w3 == (W3 != NULL ? W3->w : NULL) &&
            (W3 == NULL || (k->s3 == W3->scale && k->n3 == W3->n_out)))
            return k->wb;
    }
    return NULL;
}

/* A new kept buffer of `bytes` for (W1, W3, perm), or NULL: no cuBLASLt
 * state, past the budget or the free-memory reserve, no memory, or the
 * queue is being recorded into a graph (cuda_blas_weights waits for a new
 * copy's decode, which a recording cannot). */
static uint16_t *
bl_keep_new(struct dsv4_backend *be, const struct dsv4_linear *W1,
            const struct dsv4_linear *W3, int perm, size_t bytes)
{
    struct cuda_blas *b = (struct cuda_blas *)cuda_st(be)->blas;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    size_t fr = 0, tot = 0;
    struct bl_keep *k;
    void *p = NULL;

    if (b == NULL || b->keep_full || b->keep_bytes + bytes > bl_keep_budget())
        return NULL;
    if (cudaStreamIsCapturing(cuda_stream(be), &cap) != cudaSuccess ||
        cap != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return NULL;
    }
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess || fr < bytes + BL_KEEP_RESERVE) {
        (void)cudaGetLastError();
        b->keep_full = 1;
        return NULL;
    }
    if (b->n_keep == b->cap_keep) {
        int cap = b->cap_keep ? 2 * b->cap_keep : 64;
        struct bl_keep *nk = (struct bl_keep *)realloc(b->keep, (size_t)cap * sizeof(*nk));

        if (nk == NULL)
            return NULL;
        b->keep = nk;
        b->cap_keep = cap;
    }
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        b->keep_full = 1;
        return NULL;
    }
    k = &b->keep[b->n_keep++];
    memset(k, 0, sizeof(*k));
    k->w1 = W1->w;
    k->s1 = W1->scale;
    k->n1 = W1->n_out;
    k->k1 = W1->n_in;
    k->perm = perm;
    if (W3 != NULL) {
        k->w3 = W3->w;
        k->s3 = W3->scale;
        k->n3 = W3->n_out;
    }
    k->wb = (uint16_t *)p;
    k->bytes = bytes;
    b->keep_bytes += bytes;
    return k->wb;
}

/* Take back the kept copy bl_keep_new just made (`keep`; NULL: none) whose
 * decode failed: a later call would find it undecoded (wrong outputs). */
static void
bl_keep_undo(struct dsv4_backend *be, struct cuda_blas *b, uint16_t *keep)
{
    if (keep == NULL || b == NULL || b->n_keep == 0 || b->keep[b->n_keep - 1].wb != keep)
        return;
    (void)cudaStreamSynchronize(cuda_stream(be));   /* a decode queued before the failure */
    (void)cudaGetLastError();
    b->n_keep--;
    b->keep_bytes -= b->keep[b->n_keep].bytes;
    cudaFree(keep);
}

void
cuda_arena_note(struct dsv4_backend *be, const void *base, size_t bytes)
{
    struct cuda_state *st = cuda_st(be);

    if (base == NULL || bytes == 0 || st->n_arena == CUDA_MAX_ARENAS)
        return;   /* past the table: its weights are decoded every call */
    st->arena[st->n_arena] = (const char *)base;
    st->arena_bytes[st->n_arena++] = bytes;
}

void
cuda_arena_forget(struct dsv4_backend *be, const void *base)
{
    struct cuda_state *st = cuda_st(be);

    for (int i = 0; i < st->n_arena; i++)
        if (st->arena[i] == (const char *)base) {
            st->arena[i] = st->arena[st->n_arena - 1];
            st->arena_bytes[i] = st->arena_bytes[st->n_arena - 1];
            st->n_arena--;
            return;
        }
}

/* Whether [p, p + n) lies in one of be's noted weight arenas. */
static int
bl_in_arena(struct dsv4_backend *be, const void *p, size_t n)
{
    const struct cuda_state *st = cuda_st(be);
    const char *c = (const char *)p;

    for (int i = 0; i < st->n_arena; i++)
        if (c >= st->arena[i] && n <= st->arena_bytes[i] &&
            (size_t)(c - st->arena[i]) <= st->arena_bytes[i] - n)
            return 1;
    return 0;
}

/* Whether W's codes and scales lie in a noted arena (fixed weights). */
static int
bl_fixed(struct dsv4_backend *be, const struct dsv4_linear *W)
{
    size_t nw = (size_t)W->n_out * W->n_in, ns = (size_t)(W->n_out / 128) * (W->n_in / 128);

    return bl_in_arena(be, W->w, nw) && bl_in_arena(be, W->scale, ns);
}

const uint16_t *
cuda_blas_weights(struct dsv4_backend *be, uint16_t *wb, const struct dsv4_linear *W1,
                  const struct dsv4_linear *W3, int perm)
{
    struct cuda_blas *b = (struct cuda_blas *)cuda_st(be)->blas;
    size_t n1 = (size_t)W1->n_out * W1->n_in;
    size_t bytes = (n1 + (W3 != NULL ? (size_t)W3->n_out * W3->n_in : 0)) * sizeof(uint16_t);
    const uint16_t *kept;
    uint16_t *dst, *keep;

    if (!bl_fp8_ok(W1) || (W3 != NULL && (!bl_fp8_ok(W3) || W3->n_in != W1->n_in))) {
        dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: no decode for these weights");
        return NULL;
    }
    if (b != NULL && (kept = bl_keep_find(b, W1, W3, perm)) != NULL)
        return kept;
    keep = bl_fixed(be, W1) && (W3 == NULL || bl_fixed(be, W3)) ?
           bl_keep_new(be, W1, W3, perm, bytes) : NULL;
    dst = keep != NULL ? keep : wb;
    if (cuda_blas_decode(be, dst, W1, perm) != DSV4_OK ||
        (W3 != NULL && cuda_blas_decode(be, dst + n1, W3, perm) != DSV4_OK)) {
        bl_keep_undo(be, b, keep);
        return NULL;
    }
    /* a new copy's decode done before any queue (the side queue too) may
     * read it: once per weight */
    if (keep != NULL && cudaStreamSynchronize(cuda_stream(be)) != cudaSuccess) {
        dsv4_err_set(DSV4_ERR_CUDA, "cuda blas: %s", cudaGetErrorString(cudaGetLastError()));
        bl_keep_undo(be, b, keep);
        return NULL;
    }
    return dst;
}

void
cuda_blas_weights_drop(struct dsv4_backend *be)
{
    struct cuda_blas *b = (struct cuda_blas *)cuda_st(be)->blas;

    if (b == NULL || (b->n_keep == 0 && !b->keep_full))
        return;
    cudaStreamSynchronize(cuda_stream(be));
    for (int i = 0; i < b->n_keep; i++)
        cudaFree(b->keep[i].wb);
    b->n_keep = 0;
    b->keep_bytes = 0;
    b->keep_full = 0;
}

/* out (T, G R) (bf16; BL_BF16F: fp32) = plan p's weights w times x (T, G
 * K) of type tx, plus beta times out, on the queue's workspace: one
 * cublasLtMatmul with this call's layouts. */
static enum dsv4_err
bl_matmul(struct dsv4_backend *be, struct cuda_blas *b, struct bl_plan *p, void *out,
          const void *w, const void *x, cudaDataType_t tx, int T, float beta)
{
    int R = p->R, K = p->K, G = p->G;
    cublasLtMatrixLayout_t lx, lo;
    float one = 1.0f;
    cublasStatus_t rc;
    void *ws = bl_ws(be, b);

    if (ws == NULL)
        return DSV4_ERR_NOTSUP;
    lx = bl_layout(tx, (uint64_t)K, (uint64_t)T, (int64_t)G * K, G, K);
    lo = bl_layout(p->kind == BL_BF16F ? CUDA_R_32F : CUDA_R_16BF, (uint64_t)R, (uint64_t)T,
                   (int64_t)G * R, G, R);
    if (lx == NULL || lo == NULL) {
        if (lx != NULL)
            bl.layout_destroy(lx);
        if (lo != NULL)
            bl.layout_destroy(lo);
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: layouts");
    }
    rc = bl.matmul(b->h, p->desc, &one, w, p->a, x, lx, &beta, out, lo, out, lo, &p->algo, ws,
                   BL_WS_BYTES, cuda_stream(be));
    bl.layout_destroy(lx);
    bl.layout_destroy(lo);
    if (rc != CUBLAS_STATUS_SUCCESS)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: cublasLtMatmul: status %d", (int)rc);
    return DSV4_OK;
}

enum dsv4_err
cuda_blas_gemm(struct dsv4_backend *be, uint16_t *out, const uint16_t *wb, const uint16_t *xb,
               int R, int K, int G, int T)
{
    struct cuda_blas *b;
    struct bl_plan *p;

    if (T <= 0)
        return DSV4_OK;
    if (!cuda_switch_on(&bl_switch))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: switched off (DSV4_CUDA_BLAS)");
    if ((b = bl_state(be)) == NULL)
        return DSV4_ERR_NOTSUP;
    if ((p = bl_plan_get(b, R, K, G, BL_BF16)) == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: no algorithm for %d x %d, G=%d", R, K,
                            G);
    return bl_matmul(be, b, p, out, wb, xb, CUDA_R_16BF, T, 0.0f);
}

/* The FP8 plan of W (N, K) on be, or NULL: the cuBLASLt paths off, no
 * library, a shape not in 128 blocks, no algorithm. */
static struct bl_plan *
bl_fp8_plan(struct dsv4_backend *be, int N, int K)
{
    struct cuda_blas *b;

    if (!cuda_switch_on(&bl_switch) || N <= 0 || N % 128 != 0 || K <= 0 || K % 128 != 0 ||
        (b = bl_state(be)) == NULL)
        return NULL;
    return bl_plan_get(b, N, K, 1, BL_FP8);
}

int
cuda_blas_fp8_ready(struct dsv4_backend *be, int N, int K)
{
    return bl_fp8_plan(be, N, K) != NULL;
}

enum dsv4_err
cuda_blas_fp8(struct dsv4_backend *be, uint16_t *out, const struct dsv4_linear *W,
              const float *ws, const uint8_t *xq, const float *sx, int T)
{
    int N = W->n_out, K = W->n_in;
    struct bl_plan *p;

    if (T <= 0)
        return DSV4_OK;
    if (T % BL_FP8_ROWS != 0 || (p = bl_fp8_plan(be, N, K)) == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: no FP8 algorithm for %d x %d, T=%d", N,
                            K, T);
    /* the plan's descriptor takes this call's scales (read when the call is queued) */
    if (bl.desc_set(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof(ws)) !=
            CUBLAS_STATUS_SUCCESS ||
        bl.desc_set(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof(sx)) !=
            CUBLAS_STATUS_SUCCESS)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: FP8 scale pointers");
    return bl_matmul(be, (struct cuda_blas *)cuda_st(be)->blas, p, out, W->w, xq, CUDA_R_8F_E4M3,
                     T, 0.0f);
}

enum dsv4_err
cuda_blas_widen(struct dsv4_backend *be, float *out, const uint16_t *ob, int64_t n)
{
    if (n <= 0)
        return DSV4_OK;
    bl_out_kernel<<<(unsigned)((n / 4 + 255) / 256), 256, 0, cuda_stream(be)>>>(out, ob, n);
    CUDA_LAUNCHED("cuda blas widen");
    return DSV4_OK;
}

/* --- the BF16 linear ------------------------------------------------------------------------ */

/* out[i] = bf16(out[i]) in place (n % 4 == 0): the linear's rounding. */
static __global__ void
bl_round_kernel(float *out, int64_t n)
{
    int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;

    if (i >= n)
        return;
    {
        float4 v = *(const float4 *)(out + i);

        *(float4 *)(out + i) = make_float4(cu_bf16_round(v.x), cu_bf16_round(v.y),
                                           cu_bf16_round(v.z), cu_bf16_round(v.w));
    }
}

/* the BF16 linear alone back on fw_kernel (A/B runs) */
static struct cuda_switch bl_bf16_switch = CUDA_SWITCH("DSV4_CUDA_BLAS_BF16", 1);

enum dsv4_err
cuda_blas_bf16(struct dsv4_backend *be, float *out, const float *x, const struct dsv4_linear *W,
               int T, unsigned flags, size_t off, int split)
{
    int N = W->n_out, K = W->n_in;
    int64_t nx = (int64_t)T * K, no = (int64_t)T * N;
    size_t bx = cuda_align((size_t)nx * 2);
    struct cuda_blas *b;
    struct bl_plan *p;
    unsigned char *sc;
    uint16_t *hi, *lo;
    enum dsv4_err e;

    if (!cuda_switch_on(&bl_switch) || !cuda_switch_on(&bl_bf16_switch))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: switched off");
    if (W->fmt != DSV4_WFMT_BF16 || W->w == NULL || N <= 0 || N % 4 != 0 || K <= 0 ||
        K % 8 != 0 || (uintptr_t)W->w % 16 != 0 || (uintptr_t)x % 16 != 0 ||
        (uintptr_t)out % 16 != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: not for fmt %d, %d x %d", (int)W->fmt,
                            N, K);
    if (T <= 0)
        return DSV4_OK;
    /* library and algorithm first: NOTSUP before anything is queued */
    if ((b = bl_state(be)) == NULL)
        return DSV4_ERR_NOTSUP;
    if ((p = bl_plan_get(b, N, K, 1, BL_BF16F)) == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: no BF16 algorithm for %d x %d", N, K);
    sc = (unsigned char *)cuda_scratch(be, off + 2 * bx);
    if (sc == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda blas: no scratch");
    hi = (uint16_t *)(sc + off);
    lo = (uint16_t *)(sc + off + bx);
    /* fw_kernel's split of x (fast_linear.cu), unless a call before made it */
    if ((split && (e = fk_split(be, hi, lo, x, nx)) != DSV4_OK) ||
        (e = bl_matmul(be, b, p, out, W->w, hi, CUDA_R_16BF, T, 0.0f)) != DSV4_OK ||
        (e = bl_matmul(be, b, p, out, W->w, lo, CUDA_R_16BF, T, 1.0f)) != DSV4_OK)
        return e;
    if (flags & DSV4_LIN_F32_OUT)
        return DSV4_OK;
    bl_round_kernel<<<(unsigned)((no / 4 + 255) / 256), 256, 0, cuda_stream(be)>>>(out, no);
    CUDA_LAUNCHED("cuda blas round");
    return DSV4_OK;
}

/* --- the grouped linear --------------------------------------------------------------------- */

int
cuda_blas_grouped_ready(struct dsv4_backend *be, const struct dsv4_linear *W, int G)
{
    int N = W->n_out, K = W->n_in, R = G > 0 ? N / G : 0;
    struct cuda_blas *b;

    if (!cuda_switch_on(&bl_switch) || !bl_fp8_ok(W) || G <= 0 || N % G != 0 || R % 128 != 0)
        return 0;
    return (b = bl_state(be)) != NULL && bl_plan_get(b, R, K, G, BL_BF16) != NULL;
}

size_t
cuda_blas_grouped_b16_scratch(const struct dsv4_linear *W, int T)
{
    return cuda_align((size_t)W->n_out * W->n_in * 2) + cuda_align((size_t)T * W->n_out * 2);
}

enum dsv4_err
cuda_blas_grouped_b16(struct dsv4_backend *be, float *out, const uint16_t *xb,
                      const struct dsv4_linear *W, int T, int G, unsigned char *sc)
{
    int N = W->n_out, K = W->n_in, R = N / G;
    size_t bw = cuda_align((size_t)N * K * 2);
    const uint16_t *wk;
    enum dsv4_err e;

    if (T <= 0)
        return DSV4_OK;
    if ((wk = cuda_blas_weights(be, (uint16_t *)sc, W, NULL, 0)) == NULL)
        return DSV4_ERR_NOTSUP;
    if ((e = cuda_blas_gemm(be, (uint16_t *)(sc + bw), wk, xb, R, K, G, T)) != DSV4_OK)
        return e;
    return cuda_blas_widen(be, out, (const uint16_t *)(sc + bw), (int64_t)T * N);
}

enum dsv4_err
cuda_blas_grouped(struct dsv4_backend *be, float *out, const float *x,
                  const struct dsv4_linear *W, int T, int G)
{
    int N = W->n_out, K = W->n_in;
    int64_t nx = (int64_t)T * G * K;
    size_t bx = cuda_align((size_t)nx * 2);
    unsigned char *sc;

    if (!cuda_switch_on(&bl_switch))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: switched off (DSV4_CUDA_BLAS)");
    if (!bl_fp8_ok(W) || G <= 0 || N % G != 0 || (N / G) % 128 != 0 ||
        (uintptr_t)x % 16 != 0 || (uintptr_t)out % 16 != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: not for fmt %d, %d x %d, G=%d",
                            (int)W->fmt, N, K, G);
    if (T <= 0)
        return DSV4_OK;
    /* library and algorithm first: NOTSUP before anything is queued */
    if (!cuda_blas_grouped_ready(be, W, G))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda blas: no algorithm for %d x %d, G=%d",
                            N / G, K, G);
    sc = (unsigned char *)cuda_scratch(be, bx + cuda_blas_grouped_b16_scratch(W, T));
    if (sc == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda blas: no scratch");
    bl_x_kernel<<<(unsigned)((nx / 4 + 255) / 256), 256, 0, cuda_stream(be)>>>((uint16_t *)sc,
                                                                                x, nx);
    CUDA_LAUNCHED("cuda blas x");
    return cuda_blas_grouped_b16(be, out, (const uint16_t *)sc, W, T, G, sc + bx);
}
