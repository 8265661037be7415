/*
 * fast_wgmma.cuh — the device helpers the Hopper GEMM kernels share:
 * cp.async copies and group waits, the swizzled byte offsets of operand
 * rows in shared memory, wgmma fence / commit / wait, the async-proxy
 * fence, the accumulator hold, the shared-memory matrix descriptors, the
 * weight-row map of the SwiGLU up tiles and the accumulator operand lists
 * of the wgmma inline assembly.
 *
 * Used by fast_gemm.cu (fg_kernel, fw_kernel) and fast_gemm8.cu (g8_kernel).
 * Every helper is the exact instruction sequence its users had before; where
 * users differ (memory clobber or not, descriptor strides, swizzle mode)
 * the difference is a template parameter or a separately named function.
 * Also the token-tile row maps of fw_kernel (wg_tile_rows).
 */
#ifndef DSV4_KERNELS_CUDA_FAST_WGMMA_CUH
#define DSV4_KERNELS_CUDA_FAST_WGMMA_CUH

#include <stdint.h>

#include "kernels/cuda/cuda.cuh"

/* --- cp.async ------------------------------------------------------------------------ */

/* 16 bytes global -> shared (through L2 only); valid == 0: the 16 bytes are
 * zeroed (src not read). */
static __device__ __forceinline__ void
wg_cp16(void *dst, const void *src, int valid)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);

    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(d), "l"(src), "r"(valid ? 16 : 0));
}

/* 4 bytes, the same way (through L1). */
static __device__ __forceinline__ void
wg_cp4(void *dst, const void *src, int valid)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);

    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(d), "l"(src), "r"(valid ? 4 : 0));
}

/* Close this thread's cp.async group (no memory clobber: the compiler may
 * move ordinary memory accesses across it). */
static __device__ __forceinline__ void
wg_cp_commit(void)
{
    asm volatile("cp.async.commit_group;");
}

/* Wait until at most N of this thread's cp.async groups are pending (no
 * memory clobber). */
template <int N>
static __device__ __forceinline__ void
wg_cp_wait(void)
{
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

/* wg_cp_commit with a memory clobber (a compiler barrier for memory). */
static __device__ __forceinline__ void
wg_cp_commit_mem(void)
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

/* wg_cp_wait with a memory clobber (a compiler barrier for memory). */
template <int N>
static __device__ __forceinline__ void
wg_cp_wait_mem(void)
{
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

/* --- shared-memory layouts ----------------------------------------------------------- */

/*
 * Byte offset of logical 16-byte chunk c of row `row` in a stage of rows of
 * ROWB bytes, XOR-swizzled so that the fragment reads are free of bank
 * conflicts: 256-byte rows chunk ^ 4 on odd rows; 128-byte rows chunk
 * pairs ^ (row & 3); 64-byte rows chunk ^ ((row >> 1) & 3).
 */
template <int ROWB>
static __device__ __forceinline__ int
wg_off(int row, int c)
{
    if constexpr (ROWB == 256) {
        return row * 256 + ((c ^ ((row & 1) << 2)) << 4);
    } else if constexpr (ROWB == 128) {
        return row * 128 + ((c ^ ((row & 3) << 1)) << 4);
    } else {
        static_assert(ROWB == 64, "wg_off: rows of 256, 128 or 64 bytes");
        return row * 64 + ((c ^ ((row >> 1) & 3)) << 4);
    }
}

/* Byte offset of 16-byte chunk c of 128-byte row r in the hardware's 128B
 * swizzle (chunk ^ (r & 7); the stage 1024-byte aligned). */
static __device__ __forceinline__ uint32_t
wg_off_sw128(int r, int c)
{
    return (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4));
}

/* Weight row (of L1 or L3) of CTA row r: for the SwiGLU up tiles (UP != 0)
 * rows 8..15 of each 16 are w3's (*is3 = 1), of the same columns as rows
 * 0..7; otherwise row n0 + r of L1. */
template <int UP>
static __device__ __forceinline__ int
wg_wrow(int r, int n0, int *is3)
{
    if (UP) {
        *is3 = (r >> 3) & 1;
        return n0 + (r >> 4) * 8 + (r & 7);
    }
    *is3 = 0;
    return n0 + r;
}

/*
 * The token rows of tile y of an fw_kernel / fwp_kernel launch (ARGS:
 * fw_args, a template parameter so that other argument structs naming these
 * fields alike can share it), written by
 * threads t0, t0 + nt, ... (the caller's share of the block).  Routed
 * (a.table != NULL): tile slot y of the grouping (fg_group_kernel's
 * layout); 0 for an idle slot (nothing written); else *L1 = w2 (a.down) or
 * w1, *L3 = w3, orow[i] = pick row i of the tile or -1, brow[i] = that pick
 * row (a.down) or its token (pick row / a.k).  Dense: *L1 = a.W, *L3 =
 * a.W3, rows y * BN + i of a.M, offset by a.brow0 / a.orow0, -1 past a.M.
 * Only brow (MAPS & WG_BROW) or orow (MAPS & WG_OROW) is written where
 * the caller asks for one (a compile-time choice: no test of the pointers
 * on the kernels' path).  1 then; the caller synchronises before its threads
 * read the maps.
 */
#define WG_BROW 1
#define WG_OROW 2

template <int BN, int MAPS, class ARGS>
static __device__ __forceinline__ int
wg_tile_rows_at(const ARGS &a, int y, int t0, int nt, int *brow, int *orow,
                struct dsv4_linear &L1, struct dsv4_linear &L3)
{
    if (a.table != NULL) {
        const int32_t *tl = a.grp + 1 + 3 * y, *rows;
        const struct dsv4_expert_w *E;
        int n_rows;

        if (y >= a.grp[0])
            return 0;   /* an idle slot */
        E = &a.table[tl[0]];
        rows = a.grp + 1 + 3 * a.A + tl[1];
        n_rows = tl[2];
        L1 = a.down ? E->w2 : E->w1;
        L3 = E->w3;
        for (int i = t0; i < BN; i += nt) {
            int r = i < n_rows ? rows[i] : -1;

            if (MAPS & WG_OROW)
                orow[i] = r;
            if (MAPS & WG_BROW)
                brow[i] = r < 0 ? -1 : (a.down ? r : r / a.k);
        }
    } else {
        int m0 = y * BN;

        L1 = a.W;
        L3 = a.W3;
        for (int i = t0; i < BN; i += nt) {
            int ok = m0 + i < a.M;

            if (MAPS & WG_BROW)
                brow[i] = ok ? a.brow0 + m0 + i : -1;
            if (MAPS & WG_OROW)
                orow[i] = ok ? a.orow0 + m0 + i : -1;
        }
    }
    return 1;
}

/* wg_tile_rows_at for tile blockIdx.y by the block's THREADS threads. */
template <int BN, int THREADS, class ARGS>
static __device__ __forceinline__ int
wg_tile_rows(const ARGS &a, int *brow, int *orow, struct dsv4_linear &L1,
             struct dsv4_linear &L3)
{
    return wg_tile_rows_at<BN, WG_BROW | WG_OROW>(a, (int)blockIdx.y, (int)threadIdx.x, THREADS,
                                                   brow, orow, L1, L3);
}

/* --- wgmma --------------------------------------------------------------------------- */

/* The accumulator operands ("+f") d[0..N-1] of a wgmma inline asm. */
#define WG_D8(d)                                                                        \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
        "+f"(d[7])
#define WG_D16(d)                                                                       \
    WG_D8(d), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),            \
        "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WG_D32(d)                                                                       \
    WG_D16(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),         \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]),   \
        "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_D64(d)                                                                       \
    WG_D32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),         \
        "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),   \
        "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),   \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),   \
        "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),   \
        "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

/* The operand placeholders %0 .. %63 of the 64 accumulators (WG_D64) in a
 * wgmma inline asm string. */
#define WG_R64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, " \
    "%8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/* Order the warpgroup's register and shared-memory accesses before the
 * wgmma that follow. */
static __device__ __forceinline__ void
wg_fence(void)
{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

/* Close the warpgroup's group of wgmma issued since the last commit. */
static __device__ __forceinline__ void
wg_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

/* Wait until at most N wgmma groups of the warpgroup are pending. */
template <int N>
static __device__ __forceinline__ void
wg_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

/* cp.async writes (generic proxy) made visible to wgmma's reads (async proxy). */
static __device__ __forceinline__ void
wg_fence_proxy(void)
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* --- mbarriers and named barriers ------------------------------------------------------ */

/* Initialise the mbarrier at shared address bar for `count` arrivals a phase. */
static __device__ __forceinline__ void
wg_bar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

/* One arrival of this thread at bar. */
static __device__ __forceinline__ void
wg_bar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

/* One arrival at bar once every cp.async this thread issued before has
 * landed (the arrival is not counted in advance: bar's count includes it). */
static __device__ __forceinline__ void
wg_bar_cp_arrive(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}

/* Wait until the phase of parity `parity` of bar has completed.  The retry
 * loop is inside the asm, so the compiler sees no divergent branch (values
 * after the wait stay uniform: warp-uniform registers, wgmma descriptors). */
static __device__ __forceinline__ void
wg_bar_wait(uint32_t bar, uint32_t parity)
{
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "WG_BAR_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WG_BAR_WAIT;\n"
                 "}\n"
                 :: "r"(bar), "r"(parity) : "memory");
}

/* Named barrier ID for N threads (a multiple of 32; shared memory ordered). */
template <int ID, int N>
static __device__ __forceinline__ void
wg_sync(void)
{
    asm volatile("bar.sync %0, %1;" :: "n"(ID), "n"(N) : "memory");
}

/* Keep the accumulators in place until the wgmma that writes them is waited for. */
template <int N>
static __device__ __forceinline__ void
wg_hold(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

/*
 * Descriptor of K step s of a K-major operand without swizzle at shared
 * address base (steps 256 bytes apart: two core matrices of K): leading
 * byte offset LBO (next 16 bytes of K), stride byte offset SBO (next 8
 * rows).
 */
template <int LBO, int SBO>
static __device__ __forceinline__ uint64_t
wg_desc(uint32_t base, int s)
{
    /* shared addresses are below 2^18: the 14-bit start field needs no mask,
     * and step s is an add to the low word (no per-step masking and shifts) */
    uint32_t lo = (base >> 4) + 16u * (uint32_t)s + (uint32_t)(LBO >> 4 << 16);

    return (uint64_t)lo | (uint64_t)(SBO >> 4) << 32;
}

/* Descriptor of a K-major, 128B-swizzled operand at shared address addr
 * (stride byte offset 1024: 8 rows of 128 bytes). */
static __device__ __forceinline__ uint64_t
wg_desc_sw128(uint32_t addr)
{
    return (uint64_t)((addr & 0x3ffffu) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}

#endif   /* __CUDA_ARCH_FEAT_SM90_ALL */

#endif
