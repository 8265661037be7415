/*
 * bench_stream.cu — the practical floor of a kernel that reads B bytes from
 * DRAM inside a decode step (issue 7): a CUDA graph of N kernels on one
 * stream, each launched with PDL (griddepcontrol.wait, then
 * launch_dependents, as every fast kernel), each reading its own B-byte
 * region of a 4 GiB buffer (the regions rotate over more than the L2
 * holds, so every read comes from DRAM), timed per kernel.  A decode step's
 * big kernels read 2-700 MB each (a linear's weights, the MoE's picked
 * experts); what one of them can reach is this floor, not B / 4.3 TB/s:
 * at small B the launch ramp and the grid's last loads are a large part of
 * the time.  docs/perf.md run 37 compares the step's kernels with it.
 *
 * usage: bench_stream [N]      (N kernels a graph, default 32)
 *        bench_stream tile [N] (the decode MoE's access patterns, below)
 *
 * Each kernel: blocks of 256 threads, grid-stride 16-byte streaming loads
 * (ld.global.cs), four in flight per thread, summed per block as 32-bit
 * words into sums[block] (checked after the graph: the last kernel's block
 * sums must add up to its region's sum, the buffer being 0x01 bytes, so a
 * kernel that read nothing or the wrong bytes fails).  Grids of 132, 264,
 * 528 and 1,056 blocks; sizes 2 to 480 MB.  Printed: microseconds a kernel
 * (graph replay time / N, the best of 5 replays after one), TB/s and the
 * share of 4.3 TB/s.  Exit status 0, 1 when a check fails, 77 without a
 * CUDA device.  A measurement program for the GPU machine, not a meson
 * test; no time is checked.
 *
 * `tile` mode: the same graphs, but each kernel reads its bytes as the decode
 * MoE's fm5_kernel does (docs/perf.md run 43): persistent warps (blocks of 4
 * warps, 4 blocks an SM), each warp taking items of 32 KB (a tile of 16
 * rows of 2,048 bytes: FP4 weight rows of K = 4,096), streaming an item in
 * 2 KB stages through its own ring of 3 stages in shared memory
 * (cp.async.cg, 16 bytes a lane, wait_group 1), then summing the stage from
 * shared memory.  Patterns of a stage: rows (fm5's: 128 bytes of each of
 * the 16 rows), q4 (512 bytes of 4 rows, the rows in turn), contig (2 KB
 * in one run: a tile stored stage by stage).
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BS_BUF ((size_t)4 << 30)   /* bytes of the buffer the regions rotate over */
#define BS_THREADS 256
#define BS_U 4                     /* 16-byte loads in flight per thread */
#define BS_MAX_GRID 1056

#define BS_TRY(x)                                                                          \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "bench_stream: %s: %s (line %d)\n", #x, cudaGetErrorString(e_),  \
                    __LINE__);                                                             \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* sums[block] = the sum of every thread's acc over the block of NW warps
 * (mod 2^32); every thread of the block calls it. */
template <int NW>
static __device__ void
bs_block_sum(uint32_t acc, uint32_t *sums)
{
    __shared__ uint32_t red[NW];

    for (int o = 16; o > 0; o /= 2)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t s = 0;

        for (int w = 0; w < NW; w++)
            s += red[w];
        sums[blockIdx.x] = s;
    }
}

/* Read n4 16-byte words from p; sums[block] = the block's sum of their
 * 32-bit words (mod 2^32). */
static __global__ void __launch_bounds__(BS_THREADS)
bs_kernel(const uint4 *__restrict__ p, size_t n4, uint32_t *sums)
{
    size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t nt = (size_t)gridDim.x * blockDim.x;
    uint32_t acc = 0;

    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (size_t i = tid; i < n4; i += nt * BS_U) {
        uint4 v[BS_U];

#pragma unroll
        for (int u = 0; u < BS_U; u++) {
            size_t j = i + u * nt;

            v[u] = j < n4 ? __ldcs(p + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < BS_U; u++)
            acc += v[u].x + v[u].y + v[u].z + v[u].w;
    }
    bs_block_sum<BS_THREADS / 32>(acc, sums);
}

#define BT_WARPS 4
#define BT_BLOCKS 4                /* an SM */
#define BT_NS 3
#define BT_STAGE 2048
#define BT_ITEM 32768              /* 16 rows of 2,048 bytes */

/* Item-streaming reader (tile mode): pattern 0 rows, 1 q4, 2 contig. */
static __global__ void __launch_bounds__(BT_WARPS * 32, BT_BLOCKS)
bt_kernel(const char *__restrict__ p, size_t items, uint32_t *sums, int pat)
{
    __shared__ __align__(16) char ring[BT_WARPS][BT_NS][BT_STAGE];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    size_t gw = (size_t)blockIdx.x * BT_WARPS + w, nw = (size_t)gridDim.x * BT_WARPS;
    uint32_t acc = 0;
    const int nst = BT_ITEM / BT_STAGE;

    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (size_t it = gw; it < items; it += nw) {
        const char *base = p + it * BT_ITEM;

        for (int st = 0; st < nst + BT_NS - 1; st++) {
            if (st < nst) {
                uint32_t sb = (uint32_t)__cvta_generic_to_shared(ring[w][st % BT_NS]);

                for (int i = 0; i < 4; i++) {
                    size_t off;

                    if (pat == 0)
                        off = (size_t)(i * 4 + lane / 8) * 2048 + st * 128 + (lane % 8) * 16;
                    else if (pat == 1)
                        off = (size_t)((st % 4) * 4 + i) * 2048 + (st / 4) * 512 + lane * 16;
                    else
                        off = (size_t)st * BT_STAGE + (i * 32 + lane) * 16;
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sb + (i * 32 + lane) * 16),
                                 "l"(base + off) : "memory");
                }
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
            if (st >= BT_NS - 1) {
                const uint4 *v = (const uint4 *)ring[w][(st - (BT_NS - 1)) % BT_NS];

                asm volatile("cp.async.wait_group %0;" ::"n"(BT_NS - 1) : "memory");
                __syncwarp();
                for (int i = 0; i < 4; i++) {
                    uint4 x = v[i * 32 + lane];

                    acc += x.x + x.y + x.z + x.w;
                }
                __syncwarp();
            }
        }
    }
    bs_block_sum<BT_WARPS>(acc, sums);
}

/* One graph of n kernels of `grid` blocks, each reading `bytes` of its own
 * region; returns microseconds a kernel (best of 5 replays) and checks the
 * last kernel's sums (0 ok). */
static int
bs_case(char *buf, uint32_t *sums, cudaStream_t st, int grid, size_t bytes, int n, double *us,
        int pat)
{
    size_t n4 = bytes / 16, stride = (bytes / 4096 + 257) * 4096;
    int slots = (int)(BS_BUF / stride), last = 0;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaEvent_t a, b;
    float best = 1e30f;
    uint32_t h[BS_MAX_GRID], total = 0;

    if (slots > n)
        slots = n;
    BS_TRY(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; i++) {
        cudaLaunchConfig_t c = {};
        cudaLaunchAttribute at[1] = {};

        c.gridDim = dim3((unsigned)grid);
        c.blockDim = dim3(pat < 0 ? BS_THREADS : BT_WARPS * 32);
        c.stream = st;
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        c.attrs = at;
        c.numAttrs = 1;
        last = i % slots;
        if (pat < 0)
            BS_TRY(cudaLaunchKernelEx(&c, bs_kernel,
                                      (const uint4 *)(buf + (size_t)last * stride), n4, sums));
        else
            BS_TRY(cudaLaunchKernelEx(&c, bt_kernel, (const char *)(buf + (size_t)last * stride),
                                      bytes / BT_ITEM, sums, pat));
    }
    BS_TRY(cudaStreamEndCapture(st, &g));
    BS_TRY(cudaGraphInstantiate(&ge, g, 0));
    BS_TRY(cudaEventCreate(&a));
    BS_TRY(cudaEventCreate(&b));
    for (int r = 0; r < 6; r++) {
        float ms;

        BS_TRY(cudaEventRecord(a, st));
        BS_TRY(cudaGraphLaunch(ge, st));
        BS_TRY(cudaEventRecord(b, st));
        BS_TRY(cudaEventSynchronize(b));
        BS_TRY(cudaEventElapsedTime(&ms, a, b));
        if (r > 0 && ms < best)
            best = ms;
    }
    *us = best * 1e3 / n;
    BS_TRY(cudaMemcpy(h, sums, (size_t)grid * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    for (int i = 0; i < grid; i++)
        total += h[i];
    BS_TRY(cudaEventDestroy(a));
    BS_TRY(cudaEventDestroy(b));
    BS_TRY(cudaGraphExecDestroy(ge));
    BS_TRY(cudaGraphDestroy(g));
    /* every 32-bit word is 0x01010101: 4 of them a 16-byte load */
    if (pat >= 0)
        n4 = bytes / BT_ITEM * (BT_ITEM / 16);
    return total != (uint32_t)(n4 * 4u * 0x01010101u);
}

int
main(int argc, char **argv)
{
    static const double mb[] = { 2, 4, 8, 15, 22, 30, 45, 60, 90, 120, 240, 480 };
    static const int grids[] = { 132, 264, 528, BS_MAX_GRID };
    int tile = argc > 1 && strcmp(argv[1], "tile") == 0;
    int n = argc > 1 + tile ? atoi(argv[1 + tile]) : 32, n_dev = 0, bad = 0;
    char *buf;
    uint32_t *sums;
    cudaStream_t st;

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
        printf("SKIP: no CUDA device\n");
        return 77;
    }
    if (n < 1)
        n = 32;
    BS_TRY(cudaMalloc((void **)&buf, BS_BUF));
    BS_TRY(cudaMemset(buf, 1, BS_BUF));
    BS_TRY(cudaMalloc((void **)&sums, BS_MAX_GRID * sizeof(uint32_t)));
    BS_TRY(cudaStreamCreate(&st));
    if (tile) {
        static const double tmb[] = { 30, 120, 344, 690 };
        static const char *pn[] = { "rows", "q4", "contig" };
        int sms = 0;

        BS_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        printf("| pattern | MB read | us a kernel | TB/s | of 4.3 TB/s | check |\n"
               "|---|---|---|---|---|---|\n");
        for (size_t mi = 0; mi < sizeof(tmb) / sizeof(tmb[0]); mi++)
            for (int pat = 0; pat < 3; pat++) {
                size_t bytes = (size_t)(tmb[mi] * 1e6) / BT_ITEM * BT_ITEM;
                double us;
                int fail = bs_case(buf, sums, st, sms * BT_BLOCKS, bytes, n, &us, pat);

                bad |= fail;
                printf("| %s | %.0f | %.2f | %.2f | %.2f | %s |\n", pn[pat], tmb[mi], us,
                       bytes / us / 1e6, bytes / us / 1e6 / 4.3, fail ? "FAIL" : "ok");
            }
        printf("%s bench_stream tile (%d kernels a graph)\n", bad ? "FAIL" : "PASS", n);
        return bad;
    }
    printf("| grid | MB read | us a kernel | TB/s | of 4.3 TB/s | check |\n|---|---|---|---|---|---|\n");
    for (size_t gi = 0; gi < sizeof(grids) / sizeof(grids[0]); gi++)
        for (size_t mi = 0; mi < sizeof(mb) / sizeof(mb[0]); mi++) {
            size_t bytes = (size_t)(mb[mi] * 1e6) / 16 * 16;
            double us;
            int fail = bs_case(buf, sums, st, grids[gi], bytes, n, &us, -1);

            bad |= fail;
            printf("| %d | %.0f | %.2f | %.2f | %.2f | %s |\n", grids[gi], mb[mi], us,
                   bytes / us / 1e6, bytes / us / 1e6 / 4.3, fail ? "FAIL" : "ok");
        }
    printf("%s bench_stream (%d kernels a graph)\n", bad ? "FAIL" : "PASS", n);
    cudaFree(sums);
    cudaFree(buf);
    return bad;
}
