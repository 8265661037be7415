/*
 * fast_attention_wg.cuh — fh_kernel, the prefill attention of a fresh call
 * on Hopper's wgmma (sm_90a): whole rows, H = 64 heads, Dh = 512, the key
 * rows staged as bf16 (fa_stage_kernel).  Included by fast_attention.cu
 * after its helpers (fa_args, fa_row_of, fa_trim, fa_rows, fa_cp16), which
 * launches it in place of fa_kernel<2, 64, 1> (DSV4_CUDA_FA_WG=0: not).
 *
 * fa_kernel gives a row two CTAs of 32 heads, each loading the row's key
 * rows, and runs mma.sync, whose rate bounds it (docs/perf.md run 59).  A
 * CTA here owns one row t and all 64 heads, two warpgroups:
 *
 *   Q     64 heads x 512 dims, bf16, in shared memory (once a row): copied
 *         as it is where q is held as bf16 (a.q16, the q norm's output),
 *         else fp32 rows through the tile buffers, then converted;
 *   tile  FH_NC = 64 candidates x 512 dims, bf16, two buffers: the next
 *         tile's copies (cp.async, zero-filled where masked) are in flight
 *         while this one is used;
 *   S     warpgroup w scores candidates 32w .. 32w + 31 of the tile for
 *         every head: 32 wgmma m64n32k16 over the 512 dims (A = Q, B = the
 *         tile, both K-major), one warpgroup's sum for each score;
 *   softmax  the tile's row max from both warpgroups (shared memory, one
 *         barrier), the running max m, alpha = exp(m_old - m_new), P =
 *         exp(S - m) as bf16 hi + lo into shared memory (the A operand of
 *         P V, rows = heads, K = the tile's 64 candidates); each warpgroup
 *         keeps the running sum l of its own candidates (added at the end);
 *   P V   warpgroup w owns output dims 256w .. 256w + 255: O = O alpha + P V,
 *         4 k-steps x (hi, lo) x 2 halves of 128 dims of wgmma m64n128k16,
 *         B = the same tile read MN-major (the transposed descriptor): V = K.
 *
 * Every operand in shared memory is in the no-swizzle core-matrix layout:
 * 8 rows x 16 bytes (8 bf16) contiguous.  Q and a tile are row-group major
 * (core (r / 8, d / 8) at ((r / 8) 64 + d / 8) 128 bytes); P's core (h / 8,
 * c / 8) at ((h / 8) 8 + c / 8) 128.  Descriptors: LBO the step of a core
 * along K, SBO along M / N; for the tile read as V (K = candidates, N =
 * dims) the two swap.
 *
 * Numerics: products exact, fp32 accumulation; the differences from
 * fa_kernel are the order of the dot product's sum (one wgmma chain
 * instead of 8 warp partials), the order of the row sums (two partial
 * sums) and of P V (the tensor core's).  P keeps hi + lo as in fa_kernel.
 */
#ifndef DSV4_KERNELS_CUDA_FAST_ATTENTION_WG_CUH
#define DSV4_KERNELS_CUDA_FAST_ATTENTION_WG_CUH

#include "kernels/cuda/fast_wgmma.cuh"

#define FH_NC 64        /* candidates a tile */
#define FH_THREADS 256  /* two warpgroups */
#define FH_PG 8         /* tiles whose key rows are looked up at once */
#define FH_H 64
#define FH_DH 512

/* Shared memory (bytes): Q, two tiles, P hi and lo, the two warpgroups' row
 * maxima, the key-row table (two halves of FH_PG tiles). */
#define FH_Q_BYTES (FH_H * FH_DH * 2)
#define FH_T_BYTES (FH_NC * FH_DH * 2)
#define FH_P_BYTES (FH_H * FH_NC * 2)
#define FH_SMEM                                                                           \
    (FH_Q_BYTES + 2 * FH_T_BYTES + 2 * FH_P_BYTES + 2 * FH_H * 4 +                        \
     2 * FH_PG * FH_NC * (int)sizeof(void *))

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* A no-swizzle descriptor at shared address addr: LBO the step between
 * cores along K, SBO along M / N (bytes). */
static __device__ __forceinline__ uint64_t
fh_desc(uint32_t addr, uint32_t lbo, uint32_t sbo)
{
    return (uint64_t)((addr >> 4) | (lbo >> 4) << 16) | (uint64_t)(sbo >> 4) << 32;
}

/* d (64 x 32) += A (64 x 16 at da) * B (16 x 32 at db, K-major). */
static __device__ __forceinline__ void
fh_mma_s(float (&d)[16], uint64_t da, uint64_t db)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15"
                 "}, %16, %17, 1, 1, 1, 0, 0;"
                 : WG_D16(d)
                 : "l"(da), "l"(db));
}

/* d (64 x 128) += A (64 x 16 at da) * B (16 x 128 at db, MN-major). */
static __device__ __forceinline__ void
fh_mma_o(float (&d)[64], uint64_t da, uint64_t db)
{
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{"
                 WG_R64
                 "}, %64, %65, 1, 1, 1, 0, 1;"
                 : WG_D64(d)
                 : "l"(da), "l"(db));
}

/* Byte offset of element (r, d) (d even) in a row-group-major operand of
 * `cols` columns (cores (r / 8, d / 8) at ((r / 8) (cols / 8) + d / 8) 128). */
static __device__ __forceinline__ uint32_t
fh_off(int r, int d, int cols)
{
    return (uint32_t)((((r >> 3) * (cols >> 3) + (d >> 3)) << 7) + ((r & 7) << 4) + ((d & 7) << 1));
}

/* This thread's copies of one tile: the rows ptr[0 .. FH_NC) (NULL: zero-
 * filled) into tile; warp instruction k of warp w fills the 4 cores (row
 * group w, 16-byte chunks 4 k .. 4 k + 3): 512 contiguous bytes of shared
 * memory, 64 contiguous bytes of 8 key rows.  A thread's 16 copies are of
 * one key row: its address and size are worked out once. */
static __device__ __forceinline__ void
fh_issue(const uint16_t *const *ptr, unsigned char *tile, const void *dummy)
{
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint16_t *src = ptr[warp * 8 + (lane & 7)];
    const char *base = (const char *)(src != NULL ? (const void *)src : dummy);
    uint32_t dst = (uint32_t)__cvta_generic_to_shared(tile) + ((warp * 64 + (lane >> 3)) << 7) +
                   ((lane & 7) << 4);
    int n = src != NULL ? 16 : 0;

    static_assert(FH_THREADS == 256 && FH_NC == 64, "fh_issue: a warp a row group");
    static_assert(FH_THREADS == FA_THREADS, "fa_rows: FA_THREADS threads a block");
#pragma unroll
    for (int k = 0; k < 16; k++)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(dst + (k << 9)), "l"(base + (k * 4 + (lane >> 3)) * 16), "r"(n)
                     : "memory");
    fa_cp_commit();
}
#endif

/*
 * The rows of a fresh call (whole rows, H = 64, Dh = 512, a.kvb set), a
 * CTA a row at a time: out[t] (or outb[t]) as fa_kernel<2, 64, 1> writes it.  FH_THREADS
 * threads, FH_SMEM bytes of dynamic shared memory.  Persistent (a grid of
 * one CTA an SM): a CTA takes its rows from the counter a.ctr (zeroed by
 * fa_stage_kernel, one atomic add a row), the next row's number taken and
 * its q prefetched into L2 while a row runs.
 */
static __global__ void __launch_bounds__(FH_THREADS, 1)
fh_kernel(struct fa_args a)
{
    cu_pdl_wait();   /* PDL: before any global access */
    cu_pdl_trigger();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char fh_sm[];
    unsigned char *sq = fh_sm, *st = sq + FH_Q_BYTES, *sph = st + 2 * FH_T_BYTES;
    unsigned char *spl = sph + FH_P_BYTES;
    float *red = (float *)(spl + FH_P_BYTES);   /* [2][FH_H] row maxima */
    const uint16_t **s_ptr = (const uint16_t **)(red + 2 * FH_H);
    __shared__ int s_next[2];   /* the CTA's next rows, by parity of the row count */
    int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3;
    int lane = tid & 31, g = lane >> 2, q = lane & 3, warp = tid >> 5;
    int r0 = wi * 16 + g;   /* this thread's heads r0, r0 + 8 */
    uint32_t aq = (uint32_t)__cvta_generic_to_shared(sq);
    uint32_t at = (uint32_t)__cvta_generic_to_shared(st);
    uint32_t aph = (uint32_t)__cvta_generic_to_shared(sph);
    uint32_t apl = (uint32_t)__cvta_generic_to_shared(spl);
    float o0[64], o1[64], s[16];
    float m_run[2], l_run[2];

    if (tid == 0)
        s_next[0] = atomicAdd(a.ctr, 1);
    __syncthreads();
    for (int t = s_next[0], rc = 0; t < a.T; t = s_next[++rc & 1]) {
        if (a.q16) {
            /* Q's bf16 row (64 KB, prefetched into L2 during the CTA's row
             * before) straight into its cores; waited for with tile 0's
             * copies.  Warp w, item k: heads 8 hb + (lane & 7), 16-byte
             * chunks 4 dq + (lane >> 3) (dims 8 of them each): 512
             * contiguous bytes of shared memory, 64 of each of 8 heads */
            const uint16_t *qr = (const uint16_t *)a.q + (int64_t)t * FH_H * FH_DH;

            __syncthreads();   /* the row before's output copy out of Q's cores */
            for (int k = 0; k < 16; k++) {
                int G = k * 8 + warp, hb = G >> 4, c = (G & 15) * 4 + (lane >> 3);
                int h = hb * 8 + (lane & 7);

                fa_cp16(sq + fh_off(h, 8 * c, FH_DH), qr + h * FH_DH + 8 * c, 1);
            }
            fa_cp_commit();
        } else {
            /* Q's fp32 rows copied into the tile buffers (128 KB, prefetched
             * into L2 during the CTA's row before; in flight while the row's
             * candidates are looked up): a warp instruction copies 512
             * contiguous bytes of one head; 16-byte chunk c of head h goes
             * to h 2048 + (c ^ (h & 7)) 16, so that the conversion's reads
             * below (8 heads x 64 bytes a warp) are free of bank conflicts */
            const float *qr = a.q + (int64_t)t * FH_H * FH_DH;

            for (int k = 0; k < 32; k++) {
                int i = k * FH_THREADS + tid, h = i >> 7, c = i & 127;

                fa_cp16(st + h * 2048 + ((c ^ (h & 7)) << 4), qr + 4 * i, 1);
            }
            fa_cp_commit();
        }
        /* the CTA's next row (read after the row's barriers) */
        if (tid == 0)
            s_next[(rc + 1) & 1] = atomicAdd(a.ctr, 1);
        struct fa_row r = fa_row_of(a, t);
        int c_end = fa_trim(a, r, t, r.n_cand);
        int n_tiles = (c_end + FH_NC - 1) / FH_NC;

        fa_rows<1, FH_PG * FH_NC>(a, r, t, 0, c_end, (const void **)s_ptr);
        if (n_tiles > FH_PG)
            fa_rows<1, FH_PG * FH_NC>(a, r, t, FH_PG * FH_NC, c_end,
                                      (const void **)s_ptr + FH_PG * FH_NC);
        /* fp32 Q as bf16 into its cores: warp w, item k: heads 8 hb + (lane
         * & 7), dims 16 dg + 4 (lane >> 3) .. + 3 (256 contiguous bytes a
         * warp) */
        if (!a.q16) {
            fa_cp_wait<0>();
            __syncthreads();   /* Q's fp32 rows landed for all */
            for (int k = 0; k < 32; k++) {
                int G = k * 8 + warp, hb = G >> 5, dg = G & 31;
                int h = hb * 8 + (lane & 7), c = dg * 4 + (lane >> 3), d = 4 * c;
                float4 v = *(const float4 *)(st + h * 2048 + ((c ^ (h & 7)) << 4));

                *(uint2 *)(sq + fh_off(h, d, FH_DH)) =
                    make_uint2(fa_pack(v.x, v.y), fa_pack(v.z, v.w));
            }
        }
#pragma unroll
        for (int i = 0; i < 64; i++)
            o0[i] = o1[i] = 0.0f;
        m_run[0] = m_run[1] = -__int_as_float(0x7f800000);
        l_run[0] = l_run[1] = 0.0f;
        __syncthreads();   /* s_ptr, Q, s_next; the staging's reads done */
        {
            int tn = s_next[(rc + 1) & 1];

            if (tn < a.T) {   /* its q into L2 (lines of 128 bytes) */
                int qbytes = FH_H * FH_DH * (a.q16 ? 2 : 4);
                const char *qn = (const char *)a.q + (int64_t)tn * qbytes;

                for (int i = tid; i < qbytes / 128; i += FH_THREADS)
                    asm volatile("prefetch.global.L2 [%0];" :: "l"(qn + i * 128));
            }
        }
        if (n_tiles > 0)
            fh_issue(s_ptr, st, a.q);

        for (int it = 0; it < n_tiles; it++) {
            const uint16_t *const *tp = s_ptr + (it % (2 * FH_PG)) * FH_NC;
            uint32_t tb = at + (uint32_t)(it & 1) * FH_T_BYTES;
            float mx[2], sum[2], al[2], m_use[2];

            fa_cp_wait<0>();
            wg_wait<0>();   /* tile it - 1's P V: its buffer, P and O free */
            /* from tile FH_PG on, every FH_PG tiles: the rows of tiles it + FH_PG ..
             * into the half whose tiles were all read (their copies landed) */
            if (it >= FH_PG && it % FH_PG == 0 && it + FH_PG < n_tiles)
                fa_rows<1, FH_PG * FH_NC>(a, r, t, (it + FH_PG) * FH_NC, c_end,
                                          (const void **)s_ptr +
                                              ((it / FH_PG + 1) % 2) * FH_PG * FH_NC);
            wg_fence_proxy();   /* the tile's cp.async writes, before wgmma reads them */
            __syncthreads();    /* tile it landed for all; tile it - 1 read by all */

            /* S: this warpgroup's 32 candidates, all heads, 32 k-steps */
#pragma unroll
            for (int i = 0; i < 16; i++)
                s[i] = 0.0f;
            wg_fence();
#pragma unroll
            for (int k = 0; k < FH_DH / 16; k++)
                fh_mma_s(s, fh_desc(aq + k * 256, 128, (FH_DH / 8) * 128),
                         fh_desc(tb + (uint32_t)(wg * 4 * 64 + 2 * k) * 128, 128, 64 * 128));
            wg_commit();
            if (it + 1 < n_tiles)   /* issued while S runs; in flight during the softmax and P V */
                fh_issue(s_ptr + ((it + 1) % (2 * FH_PG)) * FH_NC,
                         st + (size_t)((it + 1) & 1) * FH_T_BYTES, a.q);
            wg_wait<0>();
            wg_hold(s);

            /* the row maxima of this warpgroup's candidates (masked: -inf) */
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                float m = -__int_as_float(0x7f800000);

#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        int c = wg * 32 + 8 * j + 2 * q + e;
                        float v = tp[c] != NULL ? s[4 * j + 2 * hh + e] * a.scale
                                                : -__int_as_float(0x7f800000);

                        s[4 * j + 2 * hh + e] = v;
                        m = fmaxf(m, v);
                    }
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                mx[hh] = m;
                if (q == 0)
                    red[wg * FH_H + r0 + 8 * hh] = m;
            }
            __syncthreads();   /* both warpgroups' maxima */
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                float m_new = fmaxf(m_run[hh], fmaxf(mx[hh], red[(1 - wg) * FH_H + r0 + 8 * hh]));

                m_use[hh] = m_new == -__int_as_float(0x7f800000) ? 0.0f : m_new;
                al[hh] = expf(m_run[hh] - m_use[hh]);
                m_run[hh] = m_new;
                sum[hh] = 0.0f;
            }
            /* P = exp(S - m) as bf16 hi + lo into P's cores (rows = heads) */
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    float p0 = expf(s[4 * j + 2 * hh] - m_use[hh]);
                    float p1 = expf(s[4 * j + 2 * hh + 1] - m_use[hh]);
                    uint32_t hi, lo, off = fh_off(r0 + 8 * hh, wg * 32 + 8 * j + 2 * q, FH_NC);

                    sum[hh] += p0 + p1;
                    fa_split2(p0, p1, hi, lo);
                    *(uint32_t *)(sph + off) = hi;
                    *(uint32_t *)(spl + off) = lo;
                }
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                sum[hh] += __shfl_xor_sync(0xffffffffu, sum[hh], 1);
                sum[hh] += __shfl_xor_sync(0xffffffffu, sum[hh], 2);
                l_run[hh] = l_run[hh] * al[hh] + sum[hh];
            }
            /* O *= alpha: o[4 j + 0, 1] head r0, o[4 j + 2, 3] head r0 + 8
             * (not where the warp's every alpha is 1: the same values) */
            if (__any_sync(0xffffffffu, al[0] != 1.0f || al[1] != 1.0f)) {
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    o0[4 * j] *= al[0];
                    o0[4 * j + 1] *= al[0];
                    o0[4 * j + 2] *= al[1];
                    o0[4 * j + 3] *= al[1];
                    o1[4 * j] *= al[0];
                    o1[4 * j + 1] *= al[0];
                    o1[4 * j + 2] *= al[1];
                    o1[4 * j + 3] *= al[1];
                }
            }
            wg_fence_proxy();   /* P's stores, before wgmma reads them */
            __syncthreads();    /* both warpgroups' P */

            /* O += P V: dims 256 wg .. + 255 in two halves of 128 */
            wg_fence();
#pragma unroll
            for (int k = 0; k < FH_NC / 16; k++) {
                uint64_t dh = fh_desc(aph + k * 256, 128, (FH_NC / 8) * 128);
                uint64_t dl = fh_desc(apl + k * 256, 128, (FH_NC / 8) * 128);
                uint32_t vb = tb + (uint32_t)(2 * k * 64 + 32 * wg) * 128;
                uint64_t v0 = fh_desc(vb, 64 * 128, 128), v1 = fh_desc(vb + 16 * 128, 64 * 128, 128);

                fh_mma_o(o0, dh, v0);
                fh_mma_o(o0, dl, v0);
                fh_mma_o(o1, dh, v1);
                fh_mma_o(o1, dl, v1);
            }
            wg_commit();
            /* waited for at the next tile's start (or after the loop) */
        }
        fa_cp_wait<0>();   /* no tile: Q's bf16 copy still in flight */
        wg_wait<0>();
        wg_hold(o0);
        wg_hold(o1);

        /* l = both warpgroups' sums; out = bf16(O (1 / (l + exp(sink - m)))) */
        __syncthreads();   /* red's last reads done */
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            if (q == 0)
                red[wg * FH_H + r0 + 8 * hh] = l_run[hh];
        __syncthreads();
        /* bf16 output: through Q's cores, free since the row's last S
         * (row h at h 1024, 16-byte chunk k at (k ^ (h & 7)) 16: the
         * pairs' stores free of bank conflicts), then 16-byte stores, a
         * warp 512 contiguous bytes of a head's row */
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int h = r0 + 8 * hh;
            float l = red[h] + red[FH_H + h];
            float inv = 1.0f / (l + expf(a.sink[h] - m_run[hh]));
            int64_t oi = ((int64_t)t * FH_H + h) * FH_DH + wg * 256 + 2 * q;

#pragma unroll
            for (int j = 0; j < 32; j++) {
                const float *oo = j < 16 ? o0 : o1;
                int jj = j & 15, k = wg * 32 + j;   /* chunk of dims 8 k .. 8 k + 7 */
                uint32_t b = fa_pack(oo[4 * jj + 2 * hh] * inv, oo[4 * jj + 2 * hh + 1] * inv);

                if (a.outb != NULL)
                    *(uint32_t *)(sq + h * 1024 + ((k ^ (h & 7)) << 4) + 4 * q) = b;
                else
                    *(float2 *)(a.out + oi + 8 * j) =
                        make_float2(__uint_as_float(b << 16), __uint_as_float(b & 0xffff0000u));
            }
        }
        if (a.outb != NULL) {
            uint16_t *ob = a.outb + (int64_t)t * FH_H * FH_DH;

            __syncthreads();   /* the row's bf16 output in Q's place */
            for (int i = tid; i < FH_H * FH_DH / 8; i += FH_THREADS) {
                int h = i >> 6, k = i & 63;

                *(uint4 *)(ob + 8 * i) = *(const uint4 *)(sq + h * 1024 + ((k ^ (h & 7)) << 4));
            }
        }
    }
#endif
}

#endif
