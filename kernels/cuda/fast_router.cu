/*
 * fast_router.cu — the fast router (model doc §3.4): the gate logits by the
 * fast BF16 linear (fp32 out) when it applies (at T > 64 the prefill GEMM,
 * fast_gemm.cu, where cuda_fast_gemm_bf16_ok agrees), then one block per token
 * instead of one thread per token (cuda_moe.cu).  Used by cuda_router for
 * every call it accepts when dsv4_cuda_set_kernels(be, 1) was called.
 *
 * Per token t (block t):
 *   1. s[i] = sqrtf(softplus(l[i])) (the exact path's expression), and the
 *      ranking value v[i] = s[i] + bias[i], one thread per expert, strided;
 *   2. learned routing: the rank of expert i is the number of experts j with
 *      v[j] > v[i], plus those with v[j] == v[i] and j < i; the experts of
 *      rank < k are the picks, ids[t, rank] = i.  For values that are not
 *      NaN this is exactly the exact path's insertion top-k (best first,
 *      ties to the lower id); a NaN ranks as -inf here (the exact path's
 *      insertion order around a NaN is not a ranking).  Hash routing:
 *      ids = tid2eid[tokens[t]] clamped into [0, E), as the exact path does;
 *   3. weights = s[id] / Σ_j s[ids_j] * route_scale, the sum in pick order
 *      (+ 1e-20 under HF numerics), by one thread as the exact path does.
 * Given the same logits the outputs are the exact path's bits; the logits
 * come from the fast linear (another summation order), so a pick can differ
 * where two experts' scores are within rounding of each other (near ties).
 *
 * Scratch: logits s (T, E), ranking values v (T, E), then the fast linear's
 * own scratch (cuda_fast_linear_at or cuda_fast_gemm_bf16_at at the offset
 * after them), one reservation so that no buffer moves.
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_gemm.cuh"

#define FR_THREADS 256
#define FR_MAX_K 64      /* the exact router's bound */

static __global__ void __launch_bounds__(FR_THREADS)
fr_kernel(float *weights, int32_t *ids, float *s, float *v, const float *bias,
          const int64_t *tid2eid, const int32_t *tokens, int E, int k, float route_scale,
          int hf)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ int32_t sid[FR_MAX_K];
    __shared__ float ssum;
    int64_t t = blockIdx.x;
    float *st = s + t * E, *vt = v + t * E;

    for (int i = threadIdx.x; i < E; i += FR_THREADS) {
        float l = st[i], sv = sqrtf(l > 20.0f ? l : cu_log1pf(cu_expf(l)));
        float rv = sv + (bias != NULL ? bias[i] : 0.0f);

        st[i] = sv;
        vt[i] = isnan(rv) ? -__int_as_float(0x7f800000) : rv;
    }
    __syncthreads();   /* st, vt (global) visible to the block */
    if (tid2eid != NULL) {
        for (int j = threadIdx.x; j < k; j += FR_THREADS) {
            int64_t e = tid2eid[(int64_t)tokens[t] * k + j];

            sid[j] = (int32_t)(e < 0 ? 0 : (e >= E ? E - 1 : e));
        }
    } else {
        for (int i = threadIdx.x; i < E; i += FR_THREADS) {
            float vi = vt[i];
            int rank = 0;

            for (int j = 0; j < E && rank < k; j++) {
                float vj = vt[j];

                rank += vj > vi || (vj == vi && j < i);
            }
            if (rank < k)
                sid[rank] = i;
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
    float *s, *v;
    enum dsv4_err e;

    if (T <= 0)
        return DSV4_OK;
    s = (float *)cuda_scratch(be, 2 * sb + lb);
    if (s == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "cuda fast router: no scratch");
    v = (float *)((char *)s + sb);
    /* the exact linear (when the fast one does not apply) takes no scratch */
    e = fg ? cuda_fast_gemm_bf16_at(be, s, x, gate, T, DSV4_LIN_F32_OUT, 2 * sb)   /* prefill */
        : fl ? cuda_fast_linear_at(be, s, x, gate, T, DSV4_LIN_F32_OUT, 0, 2 * sb)
             : cuda_linear(be, s, x, gate, T, DSV4_LIN_F32_OUT);
    if (e != DSV4_OK)
        return e;
    cu_launch(fr_kernel, T, FR_THREADS, 0, cuda_stream(be), weights, ids, s, v, bias, tid2eid,
              tokens, E, k, route_scale, be->numerics == DSV4_NUMERICS_HF);
    CUDA_LAUNCHED("fast router");
    return DSV4_OK;
}
