/*
 * fast_attn.cu — the fast compress (streaming compressor update, model doc
 * §3.3.4).  Used by cuda_compress when dsv4_cuda_set_kernels(be, 1) was
 * called (every call it accepts).
 *
 * The exact kernel runs one thread per channel, so a call has only d
 * threads (512 on the flash widths) and each emitting row costs that thread
 * three sequential passes over the c*r state rows (exponentials in double).
 * Here a warp owns a channel and runs the rows in the same order: the state
 * writes of a row (lanes h < c), then, when the row emits, the softmax over
 * the c*r state rows with lane l taking rows l, l + 32, ... (max by xor
 * butterfly, the denominator and the weighted sum as lane sums in row order
 * then xor butterflies), then the overlap shift (c == 2) spread over the
 * lanes.  Every term is the exact path's expression (exp(z - max) / den *
 * kv); only the order of the two sums differs, so an entry differs from the
 * exact one by fp32 rounding; the state pools are the same bits.  A channel
 * touches only its own state columns, so warps need no synchronisation;
 * within the warp, __syncwarp orders the state writes and reads.
 * Deterministic; an entry depends on its own slot's rows only.
 *
 * Decode-sized calls (T <= 64, fc_chain_kernel) also spread the rows: the
 * grid gets a y index per row, and the block of the first row of each slot
 * in the call runs that slot's rows in order (the others leave), so a
 * decode step (one row per slot) runs all rows at once instead of one
 * after the other; each row is the same fc_row code, so the bits are those
 * of the one-warp-per-channel kernel.  DSV4_CUDA_FUSE=0 keeps the
 * one-warp-per-channel kernel at every T.
 */
#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_fuse.cuh"   /* cuda_fast_fuse_enabled */

#define FC_THREADS 128
#define FC_CHAIN_MAX_T 64    /* calls up to this many rows run slot chains in parallel */

/* Row t of the channel ch on one warp: the state writes, the entry when the
 * row emits, the overlap shift at the end of a window (see above). */
static __device__ __forceinline__ void
fc_row(float *entries, float *state_kv, float *state_z, const float *a, const float *z,
       const float *ape, const int32_t *slot, const int32_t *pos, const int32_t *emit, int t,
       int64_t ch, int lane, int r, int d, int c)
{
    int ns = c * r;
    int64_t cd = (int64_t)c * d, pool = (int64_t)c * r * cd;
    float *kv = state_kv + slot[t] * pool, *zs = state_z + slot[t] * pool;
    int jj = pos[t] % r;
    int64_t dst = (int64_t)(c == 2 ? r + jj : jj) * cd;

    if (lane < c) {
        int64_t col = (int64_t)lane * d + ch;

        kv[dst + col] = a[t * cd + col];
        zs[dst + col] = z[t * cd + col] + ape[jj * cd + col];
    }
    __syncwarp();
    if (emit[t] >= 0) {
        float m = -__int_as_float(0x7f800000), den = 0.0f, acc = 0.0f;

        for (int k = lane; k < ns; k += 32) {
            float l = zs[k * cd + ((c == 2 && k >= r) ? d + ch : ch)];

            m = l > m ? l : m;
        }
        for (int o = 16; o > 0; o /= 2)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        for (int k = lane; k < ns; k += 32)
            den += cu_expf(zs[k * cd + ((c == 2 && k >= r) ? d + ch : ch)] - m);
        for (int o = 16; o > 0; o /= 2)
            den += __shfl_xor_sync(0xffffffffu, den, o);
        for (int k = lane; k < ns; k += 32) {
            int64_t col = (c == 2 && k >= r) ? d + ch : ch;

            acc += (cu_expf(zs[k * cd + col] - m) / den) * kv[k * cd + col];
        }
        for (int o = 16; o > 0; o /= 2)
            acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0)
            entries[(int64_t)emit[t] * d + ch] = acc;
    }
    if (c == 2 && jj == r - 1) {   /* the current window becomes the previous one */
        __syncwarp();
        for (int i = lane; i < r * c; i += 32) {
            int64_t col = (int64_t)(i % c) * d + ch, k = i / c;

            kv[k * cd + col] = kv[(r + k) * cd + col];
            zs[k * cd + col] = zs[(r + k) * cd + col];
        }
    }
    __syncwarp();
}

/* A warp per channel, every row in order (any T). */
static __global__ void __launch_bounds__(FC_THREADS)
fc_kernel(float *entries, float *state_kv, float *state_z, const float *a, const float *z,
          const float *ape, const int32_t *slot, const int32_t *pos, const int32_t *emit,
          int T, int r, int d, int c)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t ch = (blockIdx.x * (int64_t)FC_THREADS + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;

    if (ch >= d)
        return;   /* whole warps */
    for (int t = 0; t < T; t++)
        fc_row(entries, state_kv, state_z, a, z, ape, slot, pos, emit, t, ch, lane, r, d, c);
}

/*
 * Decode-sized calls (T <= FC_CHAIN_MAX_T): block (x, t) runs the chain of
 * row t's slot when t is that slot's first row in the call: the rows of the
 * slot, in order (rows of one sequence must be processed in order, rows of
 * different slots touch different state).  At decode every row is its own
 * slot: T times the warps of fc_kernel, each doing one row.
 */
static __global__ void __launch_bounds__(FC_THREADS)
fc_chain_kernel(float *entries, float *state_kv, float *state_z, const float *a,
                const float *z, const float *ape, const int32_t *slot, const int32_t *pos,
                const int32_t *emit, int T, int r, int d, int c)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    __shared__ int32_t sl[FC_CHAIN_MAX_T];
    int64_t ch = (blockIdx.x * (int64_t)FC_THREADS + threadIdx.x) / 32;
    int lane = threadIdx.x % 32, t = blockIdx.y, s;

    for (int i = threadIdx.x; i < T; i += FC_THREADS)
        sl[i] = slot[i];
    __syncthreads();
    s = sl[t];
    for (int i = 0; i < t; i++)
        if (sl[i] == s)
            return;   /* an earlier row's chain runs this one (block-uniform) */
    if (ch >= d)
        return;   /* whole warps */
    for (int u = t; u < T; u++)
        if (sl[u] == s)
            fc_row(entries, state_kv, state_z, a, z, ape, slot, pos, emit, u, ch, lane, r, d,
                   c);
}

enum dsv4_err
cuda_fast_compress(struct dsv4_backend *be, float *entries, float *state_kv, float *state_z,
                   const float *a, const float *z, const float *ape, const int32_t *slot,
                   const int32_t *pos, const int32_t *emit, int T, int r, int d)
{
    unsigned nb = cuda_blocks((int64_t)d * 32, FC_THREADS);

    if (T <= 0)
        return DSV4_OK;
    if (T <= FC_CHAIN_MAX_T && cuda_fast_fuse_enabled())
        cu_launch(fc_chain_kernel, dim3(nb, (unsigned)T), FC_THREADS, 0, cuda_stream(be), entries,
                  state_kv, state_z, a, z, ape, slot, pos, emit, T, r, d, r == 4 ? 2 : 1);
    else
        cu_launch(fc_kernel, nb, FC_THREADS, 0, cuda_stream(be), entries, state_kv, state_z, a, z,
                  ape, slot, pos, emit, T, r, d, r == 4 ? 2 : 1);
    CUDA_LAUNCHED("fast compress");
    return DSV4_OK;
}
