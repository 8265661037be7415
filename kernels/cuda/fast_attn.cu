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
 *
 * Prefill-sized calls (T > 64) (the default since run 17 on the H200,
 * 2026-11-30: bench_fcp 24 cases bit-identical to fc_kernel, 4-26x faster
 * where the check passes; DSV4_CUDA_FC_PREFILL=0 or
 * dsv4_cuda_set_fc_prefill(0) keeps fc_kernel) compute the
 * entries in parallel: an entry is a function of its window's c*r rows
 * only, so a grid over (channel blocks, emitting rows) runs fc_row's
 * softmax on values taken straight from a, z + ape (rows of the call) or
 * from the state as it was before the call (rows streamed earlier), with
 * the same expressions and the same lane order, so the same bits (windows
 * of c*r = 8 rows: a thread per channel, fcp_entry8_kernel, the lane
 * order's sums rebuilt as trees).  Then one
 * warp per channel and slot run writes the state fc_kernel leaves: current
 * slot j <- the run's last row at a position = j mod r; overlap: previous
 * slots <- the rows of the run's last complete window.  This needs every
 * slot's rows in the call to be one run of consecutive positions and every
 * emitting row to end a window; fcp_check_kernel tests that on the device
 * and, when it does not hold, the entries kernel does nothing and the state
 * kernel runs fc_kernel's loop (same result as fc_kernel, one launch more).
 */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/fast.cuh"
#include "kernels/cuda/fast_fuse.cuh"   /* cuda_fast_fuse_enabled */
#include "kernels/cuda_fast.h"         /* dsv4_cuda_set_fc_prefill */

#define FC_THREADS 128
#define FC_CHAIN_MAX_T 64    /* calls up to this many rows run slot chains in parallel */
#define FCP_MAX_K 4          /* prefill form: window rows per lane (c*r <= 128) */
#define FCP_STATE_ROWS 32    /* prefill form: rows of a state block's chunk */

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

/*
 * The prefill form (see the head of the file).  fcp_ok: 1 when the call's
 * rows fit it (written by fcp_check_kernel, read by the two kernels after
 * it on the same stream; one per device, as are the kernels' launches on a
 * backend's stream).
 */
static __device__ int fcp_ok;

/* One block: fcp_ok = every slot's rows are one run of consecutive
 * positions and every emitting row ends a window. */
static __global__ void
fcp_check_kernel(const int32_t *slot, const int32_t *pos, const int32_t *emit, int T, int r)
{
    __shared__ int bad;

    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    if (threadIdx.x == 0)
        bad = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        int s = slot[t];

        if (emit[t] >= 0 && pos[t] % r != r - 1)
            bad = 1;
        if (t > 0 && slot[t - 1] == s) {
            if (pos[t] != pos[t - 1] + 1)
                bad = 1;
            continue;
        }
        for (int i = 0; i < t; i++)   /* t starts a run: no earlier run of s */
            if (slot[i] == s && (i == 0 || slot[i - 1] != s)) {
                bad = 1;
                break;
            }
    }
    __syncthreads();
    if (threadIdx.x == 0)
        fcp_ok = !bad;
}

/* The first row t in [t, t1) with emit[t] >= 0, else t1: the warp's lanes
 * test 32 rows a load (the result is warp-uniform). */
static __device__ __forceinline__ int
fcp_next(const int32_t *emit, int t, int t1, int lane)
{
    for (; t < t1; t += 32) {
        unsigned m = __ballot_sync(0xffffffffu, t + lane < t1 && emit[t + lane] >= 0);

        if (m != 0)
            return t + __ffs((int)m) - 1;
    }
    return t1;
}

/* The first row u in [u, u1) that ends its slot's run in the call (the
 * call's last row, or the next row is of another slot), else u1; as
 * fcp_next. */
static __device__ __forceinline__ int
fcp_next_end(const int32_t *slot, int u, int u1, int T, int lane)
{
    for (; u < u1; u += 32) {
        int v = u + lane;
        unsigned m = __ballot_sync(0xffffffffu,
                                   v < u1 && (v + 1 == T || slot[v + 1] != slot[v]));

        if (m != 0)
            return u + __ffs((int)m) - 1;
    }
    return u1;
}

/*
 * Row k of the window of row t (slot s), channel ch: lv = z + ape of call
 * row u = t - (c r - 1 - k) when that row is of the same slot, else the
 * pre-call state's z (its slot k, or the current slot r + k for an overlap
 * previous-window slot whose window shifted inside the call); vv the same
 * row's a (or kv).  kv, zs: the slot's state pools.
 */
static __device__ __forceinline__ void
fcp_key(const float *kv, const float *zs, const float *a, const float *z, const float *ape,
        const int32_t *slot, int s, int t, int k, int64_t ch, int r, int d, int c, int shifted,
        float *lv, float *vv)
{
    int u = t - (c * r - 1 - k);
    int64_t cd = (int64_t)c * d, col = (c == 2 && k >= r) ? d + ch : ch;

    if (u >= 0 && slot[u] == s) {
        *lv = z[u * cd + col] + ape[(int64_t)(k % r) * cd + col];
        *vv = a[u * cd + col];
    } else {
        int64_t sk = (c == 2 && k < r && shifted) ? r + k : k;

        *lv = zs[sk * cd + col];
        *vv = kv[sk * cd + col];
    }
}

/*
 * Entries: block (x, y) takes the rows of [y r, y r + r) that emit (about
 * one: in a run of consecutive positions, one window's last row); a warp
 * per channel.  State slot k of row t's window (position
 * q = pos[t] - c*r + 1 + k) is call row u = t - (c*r - 1 - k) when that row
 * is of the same slot (runs are contiguous), else the pre-call state: its
 * slot k, except for an overlap previous-window slot whose window was
 * shifted inside the call (row t - r is in the call): then the pre-call
 * current slot r + k, the one fc_row copies.  Then fc_row's softmax.
 */
static __global__ void __launch_bounds__(FC_THREADS)
fcp_entry_kernel(float *entries, const float *state_kv, const float *state_z, const float *a,
                 const float *z, const float *ape, const int32_t *slot, const int32_t *pos,
                 const int32_t *emit, int T, int r, int d, int c)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t ch = (blockIdx.x * (int64_t)FC_THREADS + threadIdx.x) / 32;
    int lane = threadIdx.x % 32, ns = c * r;
    int64_t pool = (int64_t)ns * c * d;

    if (!fcp_ok || ch >= d)
        return;   /* whole warps (fcp_ok is grid-uniform) */
    for (int t1 = min(T, (int)blockIdx.y * r + r), t = fcp_next(emit, blockIdx.y * r, t1, lane);
         t < t1; t = fcp_next(emit, t + 1, t1, lane)) {
        int s, shifted;
        const float *kv, *zs;
        float m = -__int_as_float(0x7f800000), den = 0.0f, acc = 0.0f;
        float lv[FCP_MAX_K], vv[FCP_MAX_K];

        s = slot[t];
        kv = state_kv + s * pool;
        zs = state_z + s * pool;
        shifted = c == 2 && t - r >= 0 && slot[t - r] == s;
        for (int i = 0; i < FCP_MAX_K && lane + 32 * i < ns; i++)
            fcp_key(kv, zs, a, z, ape, slot, s, t, lane + 32 * i, ch, r, d, c, shifted, &lv[i],
                    &vv[i]);
        /* fc_row's sums, the same order: lane's k = lane, lane + 32, ... */
        for (int i = 0; i < FCP_MAX_K && lane + 32 * i < ns; i++)
            m = lv[i] > m ? lv[i] : m;
        for (int o = 16; o > 0; o /= 2)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        for (int i = 0; i < FCP_MAX_K && lane + 32 * i < ns; i++)
            den += cu_expf(lv[i] - m);
        for (int o = 16; o > 0; o /= 2)
            den += __shfl_xor_sync(0xffffffffu, den, o);
        for (int i = 0; i < FCP_MAX_K && lane + 32 * i < ns; i++)
            acc += (cu_expf(lv[i] - m) / den) * vv[i];
        for (int o = 16; o > 0; o /= 2)
            acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0)
            entries[(int64_t)emit[t] * d + ch] = acc;
    }
}

/*
 * fcp_entry_kernel for windows of 8 rows (c r = 8: the CSA compressors,
 * main and indexer): a thread per (emitting row, channel), its 8 rows in
 * registers (a warp's loads cover 32 channels of a row), and the warp
 * form's sums in their order: there lane k held row k and lanes 8-31
 * nothing (max -inf, sums 0), so its xor butterflies add the lanes' values
 * in the trees below; each lane's sum starts from 0 (0 + x: -0 becomes
 * +0, as there).  The same bits (bench_fcp).
 */
static __global__ void __launch_bounds__(FC_THREADS)
fcp_entry8_kernel(float *entries, const float *state_kv, const float *state_z, const float *a,
                  const float *z, const float *ape, const int32_t *slot, const int32_t *emit,
                  int T, int r, int d, int c)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t ch = blockIdx.x * (int64_t)FC_THREADS + threadIdx.x, pool = (int64_t)8 * c * d;
    float ninf = -__int_as_float(0x7f800000);

    if (!fcp_ok || ch >= d)
        return;   /* fcp_ok is grid-uniform */
    for (int t = blockIdx.y * r, t1 = min(T, t + r); t < t1; t++) {
        float lv[8], vv[8], x[8], m, den, acc;
        int s, shifted;

        if (emit[t] < 0)
            continue;
        s = slot[t];
        shifted = c == 2 && t - r >= 0 && slot[t - r] == s;
#pragma unroll
        for (int k = 0; k < 8; k++)
            fcp_key(state_kv + s * pool, state_z + s * pool, a, z, ape, slot, s, t, k, ch, r, d,
                    c, shifted, &lv[k], &vv[k]);
#pragma unroll
        for (int k = 0; k < 8; k++)
            x[k] = lv[k] > ninf ? lv[k] : ninf;
        m = fmaxf(fmaxf(fmaxf(x[0], x[4]), fmaxf(x[2], x[6])),
                  fmaxf(fmaxf(x[1], x[5]), fmaxf(x[3], x[7])));
#pragma unroll
        for (int k = 0; k < 8; k++)
            x[k] = 0.0f + cu_expf(lv[k] - m);
        den = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
#pragma unroll
        for (int k = 0; k < 8; k++)
            x[k] = 0.0f + (cu_expf(lv[k] - m) / den) * vv[k];
        acc = ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7]));
        entries[(int64_t)emit[t] * d + ch] = acc;
    }
}

/* ((x mod r) + r) mod r for x possibly negative. */
static __device__ __forceinline__ int
fcp_mod(int x, int r)
{
    return (x % r + r) % r;
}

/* The state fc_kernel leaves after row u1, the last of its slot's run in
 * the call, for channel ch (one warp; see fcp_state_kernel). */
static __device__ __forceinline__ void
fcp_state_row(float *state_kv, float *state_z, const float *a, const float *z,
              const float *ape, const int32_t *slot, const int32_t *pos, int u1, int64_t ch,
              int lane, int r, int d, int c)
{
    int64_t cd = (int64_t)c * d, pool = (int64_t)c * r * cd;
    int s = slot[u1], p1 = pos[u1];
    float *kv = state_kv + s * pool, *zs = state_z + s * pool;

    if (c == 1) {
        for (int j = lane; j < r; j += 32) {
            int u = u1 - fcp_mod(p1 - j, r);

            if (u >= 0 && slot[u] == s) {
                kv[(int64_t)j * cd + ch] = a[u * cd + ch];
                zs[(int64_t)j * cd + ch] = z[u * cd + ch] + ape[(int64_t)j * cd + ch];
            }
        }
        return;
    }
    /* overlap: lane i < c*r takes slot j = i / c, half h = i % c */
    {
        int i = lane, j = i / c, has_cur = 0, has_prev = 0;
        int64_t col = (int64_t)(i % c) * d + ch;
        float ck = 0.0f, cz = 0.0f, pk = 0.0f, pz = 0.0f;

        if (i < c * r) {
            int u = u1 - fcp_mod(p1 - j, r), ue = u1 - fcp_mod(p1 - (r - 1), r);

            if (u >= 0 && slot[u] == s) {
                has_cur = 1;
                ck = a[u * cd + col];
                cz = z[u * cd + col] + ape[(int64_t)j * cd + col];
            }
            if (ue >= 0 && slot[ue] == s) {   /* a window ended in the run */
                int v = ue - (r - 1) + j;

                has_prev = 1;
                if (v >= 0 && slot[v] == s) {
                    pk = a[v * cd + col];
                    pz = z[v * cd + col] + ape[(int64_t)j * cd + col];
                } else {
                    pk = kv[(int64_t)(r + j) * cd + col];
                    pz = zs[(int64_t)(r + j) * cd + col];
                }
            }
        }
        __syncwarp();
        if (has_prev) {
            kv[(int64_t)j * cd + col] = pk;
            zs[(int64_t)j * cd + col] = pz;
        }
        if (has_cur) {
            kv[(int64_t)(r + j) * cd + col] = ck;
            zs[(int64_t)(r + j) * cd + col] = cz;
        }
        __syncwarp();
    }
}

/*
 * State: block (x, y) takes the rows of its chunks of FCP_STATE_ROWS rows
 * (chunks y, y + gridDim.y, ...) that end their slot's run (u1), found 32
 * rows a load; a warp per channel writes the state fc_kernel leaves
 * after the run (see the head of the file), reading before it writes (the
 * previous-window values may come from the pre-call current slots).  When
 * fcp_ok is 0, blocks y == 0 run fc_kernel's loop instead.
 */
static __global__ void __launch_bounds__(FC_THREADS)
fcp_state_kernel(float *entries, float *state_kv, float *state_z, const float *a,
                 const float *z, const float *ape, const int32_t *slot, const int32_t *pos,
                 const int32_t *emit, int T, int r, int d, int c)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
    int64_t ch = (blockIdx.x * (int64_t)FC_THREADS + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;

    if (ch >= d)
        return;   /* whole warps */
    if (!fcp_ok) {
        if (blockIdx.y == 0)
            for (int t = 0; t < T; t++)
                fc_row(entries, state_kv, state_z, a, z, ape, slot, pos, emit, t, ch, lane, r,
                       d, c);
        return;
    }
    for (int q = blockIdx.y * FCP_STATE_ROWS; q < T; q += gridDim.y * FCP_STATE_ROWS) {
        int q1 = min(T, q + FCP_STATE_ROWS);

        for (int u1 = fcp_next_end(slot, q, q1, T, lane); u1 < q1;
             u1 = fcp_next_end(slot, u1 + 1, q1, T, lane))
            fcp_state_row(state_kv, state_z, a, z, ape, slot, pos, u1, ch, lane, r, d, c);
    }
}

/* dsv4_cuda_set_fc_prefill */
static struct cuda_switch fcp_switch = CUDA_SWITCH("DSV4_CUDA_FC_PREFILL", 1);

void
dsv4_cuda_set_fc_prefill(int on)
{
    cuda_switch_set(&fcp_switch, on);
}

/* Whether calls of T > FC_CHAIN_MAX_T rows take the prefill form. */
static int
fcp_enabled(void)
{
    return cuda_switch_on(&fcp_switch);
}

enum dsv4_err
cuda_fast_compress(struct dsv4_backend *be, float *entries, float *state_kv, float *state_z,
                   const float *a, const float *z, const float *ape, const int32_t *slot,
                   const int32_t *pos, const int32_t *emit, int T, int r, int d)
{
    unsigned nb = cuda_blocks((int64_t)d * 32, FC_THREADS);
    int c = r == 4 ? 2 : 1;

    if (T <= 0)
        return DSV4_OK;
    if (T <= FC_CHAIN_MAX_T && cuda_fast_fuse_enabled()) {
        cu_launch(fc_chain_kernel, dim3(nb, (unsigned)T), FC_THREADS, 0, cuda_stream(be), entries,
                  state_kv, state_z, a, z, ape, slot, pos, emit, T, r, d, c);
    } else if (T > FC_CHAIN_MAX_T && c * r <= 32 * FCP_MAX_K && fcp_enabled()) {
        /* about one emitting row per entry block, a few run ends per state block */
        unsigned ny = (unsigned)((T + r - 1) / r), ns = (unsigned)(T < 64 ? T : 64);

        cu_launch(fcp_check_kernel, 1, 1024, 0, cuda_stream(be), slot, pos, emit, T, r);
        CUDA_LAUNCHED("fast compress check");
        if (c * r == 8)
            cu_launch(fcp_entry8_kernel, dim3((unsigned)((d + FC_THREADS - 1) / FC_THREADS), ny),
                      FC_THREADS, 0, cuda_stream(be), entries, (const float *)state_kv,
                      (const float *)state_z, a, z, ape, slot, emit, T, r, d, c);
        else
            cu_launch(fcp_entry_kernel, dim3(nb, ny), FC_THREADS, 0, cuda_stream(be), entries,
                      (const float *)state_kv, (const float *)state_z, a, z, ape, slot, pos,
                      emit, T, r, d, c);
        CUDA_LAUNCHED("fast compress entries");
        cu_launch(fcp_state_kernel, dim3(nb, ns), FC_THREADS, 0, cuda_stream(be), entries,
                  state_kv, state_z, a, z, ape, slot, pos, emit, T, r, d, c);
    } else {
        cu_launch(fc_kernel, nb, FC_THREADS, 0, cuda_stream(be), entries, state_kv, state_z, a, z,
                  ape, slot, pos, emit, T, r, d, c);
    }
    CUDA_LAUNCHED("fast compress");
    return DSV4_OK;
}
