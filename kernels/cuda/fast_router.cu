/*
 * fast_router.cu — the fast router (model doc §3.4): the gate logits by the
 * fast BF16 linear (fp32 out) when it applies (at T > 64 the prefill GEMM,
 * fast_gemm.cu, where cuda_fast_gemm_bf16_ok agrees), then one block per token
 * instead of one thread per token (cuda_moe.cu).  Used by cuda_router for
 * every call it accepts when dsv4_cuda_set_kernels(be, 1) was called.
 *
 * Per token t (block t, the logits and the values in shared memory):
 *   1. s[i] = sqrtf(softplus(l[i])) (the exact path's expression), and the
 *      ranking value v[i] = s[i] + bias[i], one thread per expert, strided;
 *   2. learned routing: k rounds of a block argmax over the experts not yet
 *      picked, by v then by the lower id (each thread its strided experts,
 *      an xor butterfly per warp, the warps' winners in warp order; up to
 *      FR_WARP_E experts, the model's 256, warp 0 alone with 8 values a
 *      lane in registers, a butterfly a round and no block barrier: the
 *      same winners, perf.md run 35); round j's winner is ids[t, j].  That is the order of the rank "experts j
 *      with v[j] > v[i], plus those with v[j] == v[i] and j < i": for
 *      values that are not NaN exactly the exact path's insertion top-k
 *      (best first, ties to the lower id); a NaN ranks as -inf here (the
 *      exact path's insertion order around a NaN is not a ranking).  (The
 *      first kernel counted each expert's rank over all E others: E^2 / 256
 *      dependent loads per thread, 16 us a call on the H200, perf.md run
 *      29.)  Hash routing: ids = tid2eid[tokens[t]] clamped into [0, E), as
 *      the exact path does;
 *   3. weights = s[id] / Σ_j s[ids_j] * route_scale, the sum in pick order
 *      (+ 1e-20 under HF numerics), by one thread as the exact path does.
 * Given the same logits the outputs are the exact path's bits; the logits
 * come from the fast linear (another summation order), so a pick can differ
 * where two experts' scores are within rounding of each other (near ties).
 *
 * Scratch: logits (T, E), then the fast linear's own scratch
 * (cuda_fast_linear_at or cuda_fast_gemm_bf16_at at the offset after them),
 * one reservation so that no buffer moves.
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_gemm.cuh"

#include <limits.h>

#define FR_THREADS 256
#define FR_MAX_K 64      /* the exact router's bound */
#define FR_MAX_E 4096    /* s and v of one token in shared memory (32 KiB) */
#define FR_WARP_E 256    /* up to this many experts the picks are made by one warp */

static __global__ void __launch_bounds__(FR_THREADS)
fr_kernel(float *weights, int32_t *ids, const float *logits, const float *bias,
          const int64_t *tid2eid, const int32_t *tokens, int E, int k, float route_scale,
          int hf)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    extern __shared__ float fr_smem[];   /* s (E), v (E) */
    __shared__ int32_t sid[FR_MAX_K];
    __shared__ float wbv[FR_THREADS / 32];
    __shared__ int wbi[FR_THREADS / 32];
    __shared__ float ssum;
    int64_t t = blockIdx.x;
    const float *lt = logits + t * E;
    float *st = fr_smem, *vt = fr_smem + E;

    for (int i = threadIdx.x; i < E; i += FR_THREADS) {
        float l = lt[i], sv = sqrtf(l > 20.0f ? l : cu_log1pf(cu_expf(l)));
        float rv = sv + (bias != NULL ? bias[i] : 0.0f);

        st[i] = sv;
        vt[i] = isnan(rv) ? -__int_as_float(0x7f800000) : rv;
    }
    __syncthreads();
    if (tid2eid != NULL) {
        for (int j = threadIdx.x; j < k; j += FR_THREADS) {
            int64_t e = tid2eid[(int64_t)tokens[t] * k + j];

            sid[j] = (int32_t)(e < 0 ? 0 : (e >= E ? E - 1 : e));
        }
    } else if (E <= FR_WARP_E) {
        /* warp 0 alone, each lane's ranking values in registers: a round is
         * a scan of 8 registers and one butterfly, no block barrier (the
         * same winner: the best by cu_ranks_before, a strict order) */
        if (threadIdx.x < 32) {
            float rv[FR_WARP_E / 32];
            int lane = threadIdx.x;

#pragma unroll
            for (int m = 0; m < FR_WARP_E / 32; m++) {
                int i = lane + 32 * m;

                rv[m] = i < E ? vt[i] : __int_as_float(0x7fffffff);   /* NaN: never */
            }
            for (int j = 0; j < k; j++) {
                float bv = -__int_as_float(0x7f800000);
                int bi = INT_MAX;

#pragma unroll
                for (int m = 0; m < FR_WARP_E / 32; m++)
                    if (cu_ranks_before(rv[m], lane + 32 * m, bv, bi))
                        bv = rv[m], bi = lane + 32 * m;
                cu_warp_best(bv, bi);
                if (lane == 0)
                    sid[j] = bi;
#pragma unroll
                for (int m = 0; m < FR_WARP_E / 32; m++)
                    if (lane + 32 * m == bi)
                        rv[m] = __int_as_float(0x7fffffff);   /* picked: NaN */
            }
        }
    } else {
        for (int j = 0; j < k; j++) {
            float bv = -__int_as_float(0x7f800000);
            int bi = INT_MAX;

            for (int i = threadIdx.x; i < E; i += FR_THREADS)
                if (cu_ranks_before(vt[i], i, bv, bi))
                    bv = vt[i], bi = i;
            cu_block_best(bv, bi, wbv, wbi);
            if (threadIdx.x == 0) {
                sid[j] = bi;
                vt[bi] = __int_as_float(0x7fffffff);   /* picked: NaN */
            }
            __syncthreads();
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;

        for (int j = 0; j < k; j++)
            sum += st[sid[j]];
        if (hf)
            sum += 1e-20f;
        ssum = sum;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < k; j += FR_THREADS) {
        ids[t * k + j] = sid[j];
        weights[t * k + j] = st[sid[j]] / ssum * route_scale;
    }
}

enum dsv4_err
cuda_fast_router(struct dsv4_backend *be, float *weights, int32_t *ids, const float *x,
                 const struct dsv4_linear *gate, const float *bias, const int64_t *tid2eid,
                 const int32_t *tokens, int T, int k, float route_scale)
{
    int E = gate->n_out, fg = cuda_fast_gemm_bf16_ok(be, gate, T);
    int fl = !fg && cuda_fast_linear_ok(be, gate);
    size_t sb = cuda_align((size_t)T * E * sizeof(float));
    size_t lb = fg ? cuda_fast_gemm_bf16_scratch(gate, T)
                   : fl ? cuda_fast_linear_scratch(gate, T, 0) : 0;
    float *s;
    enum dsv4_err e;

    if (E > FR_MAX_E || k > FR_MAX_K)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "cuda fast router: E=%d (max %d), k=%d (max %d)",
                            E, FR_MAX_E, k, FR_MAX_K);
    if (T <= 0)
        return DSV4_OK;
    s = (float *)cuda_scratch(be, sb + lb);
    if (s == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast router: no scratch");
    /* the exact linear (when the fast one does not apply) takes no scratch */
    e = fg ? cuda_fast_gemm_bf16_at(be, s, x, gate, T, DSV4_LIN_F32_OUT, sb)   /* prefill */
        : fl ? cuda_fast_linear_at(be, s, x, gate, T, DSV4_LIN_F32_OUT, 0, sb)
             : cuda_linear(be, s, x, gate, T, DSV4_LIN_F32_OUT);
    if (e != DSV4_OK)
        return e;
    cu_launch(fr_kernel, T, FR_THREADS, 2 * (size_t)E * sizeof(float), cuda_stream(be),
              weights, ids, (const float *)s, bias, tid2eid, tokens, E, k, route_scale,
              be->numerics == DSV4_NUMERICS_HF);
    CUDA_LAUNCHED("fast router");
    return DSV4_OK;
}
