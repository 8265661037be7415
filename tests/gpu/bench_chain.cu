/*
 * bench_chain.cu — what a kernel boundary costs on this GPU (issue 7): a CUDA
 * graph of N dependent kernels on one stream, replayed, timed per kernel.
 * The decode step is such a chain (about 38 kernels a layer, docs/perf.md
 * run 35), so this is the floor a step pays for its boundaries alone, the
 * number that decides whether fusing kernels (or one persistent kernel a
 * layer) is worth its cost.
 *
 * usage: bench_chain [N]      (N kernels a graph, default 512)
 *
 * Each kernel of a chain reads what the kernel before it wrote and writes
 * for the one after it (a real dependency, checked at the end: the last
 * value must be N, so a graph that ran the kernels out of order or not at
 * all fails).  Forms, each without and with programmatic dependent launch
 * (PDL: cudaLaunchAttributeProgrammaticStreamSerialization, the kernel
 * waiting with griddepcontrol.wait before its first global access and then
 * letting its dependent start, as kernels/cuda/cuda.cuh's cu_launch and
 * every fast kernel do):
 *   tiny  one block of 128 threads; thread 0 adds 1 to the value;
 *   wide  264 blocks of 256 threads (two an SM), each block's thread 0 its
 *         own value;
 *   work  264 blocks of 256 threads, each thread also reading 64 bytes of a
 *         16 MiB buffer (4 MiB a kernel) and adding them into its block's
 *         value: a small kernel with some memory traffic.
 * Printed: microseconds a kernel (graph replay time / N, the best of 5
 * replays after one warm-up), and for work also one kernel timed alone.
 * Then the same N steps inside one kernel instead: a cooperative launch of
 * 264 blocks that separates the steps by grid-wide barriers
 * (cooperative_groups grid.sync), the persistent-kernel alternative to a
 * chain of launches; microseconds a step.
 * Exit status 0, 1 when a check fails, 77 without a CUDA device.  A
 * measurement program for the GPU machine, not a meson test; no timing is
 * checked.
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define BC_WIDE_BLOCKS 264
#define BC_WORK_BYTES ((size_t)16 << 20)
#define BC_WORK_SLICE ((size_t)4 << 20)   /* bytes one work kernel reads */

enum bc_form { BC_TINY, BC_WIDE, BC_WORK };

static const char *const bc_name[] = { "tiny", "wide", "work" };

/* Kernel i of a chain: val[b] (one per block) = the previous kernel's
 * val[b] + 1 (+ the block's sum of its slice of buf, which is zero). */
template <int FORM>
static __global__ void
bc_kernel(float *val, const float4 *buf, int i, int pdl)
{
    if (pdl)
        asm volatile("griddepcontrol.wait;" ::: "memory");
    float add = 1.0f;

    if (FORM == BC_WORK) {
        size_t n4 = BC_WORK_SLICE / 16, base = (size_t)(i % 4) * n4;
        size_t per = n4 / gridDim.x, j0 = base + blockIdx.x * per;
        float s = 0.0f;

        for (size_t j = j0 + threadIdx.x; j < j0 + per; j += blockDim.x) {
            float4 v = __ldg(buf + j);

            s += v.x + v.y + v.z + v.w;
        }
        for (int o = 16; o > 0; o /= 2)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        if ((threadIdx.x & 31) == 0 && s != 0.0f)
            atomicAdd(&val[blockIdx.x], s);   /* never: buf is zero */
    }
    if (pdl)
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0)
        val[blockIdx.x] += add;
}

/* n steps in one kernel: each block's thread 0 adds 1 to its value, then
 * every block of the grid waits for all (grid.sync); val[b] ends at n. */
static __global__ void
bc_grid_kernel(float *val, int n)
{
    cooperative_groups::grid_group g = cooperative_groups::this_grid();

    for (int i = 0; i < n; i++) {
        if (threadIdx.x == 0)
            val[blockIdx.x] += 1.0f;
        g.sync();
    }
}

/* Launch kernel i of a chain of `form` on st, with PDL or not. */
static cudaError_t
bc_launch(enum bc_form form, int pdl, float *val, const float4 *buf, int i, cudaStream_t st)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1] = {};

    cfg.gridDim = dim3(form == BC_TINY ? 1 : BC_WIDE_BLOCKS);
    cfg.blockDim = dim3(form == BC_TINY ? 128 : 256);
    cfg.stream = st;
    if (pdl) {
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
    }
    switch (form) {
    case BC_TINY:
        return cudaLaunchKernelEx(&cfg, bc_kernel<BC_TINY>, val, buf, i, pdl);
    case BC_WIDE:
        return cudaLaunchKernelEx(&cfg, bc_kernel<BC_WIDE>, val, buf, i, pdl);
    default:
        return cudaLaunchKernelEx(&cfg, bc_kernel<BC_WORK>, val, buf, i, pdl);
    }
}

#define BC_TRY(what, call)                                                             \
    do {                                                                               \
        cudaError_t e_ = (call);                                                       \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "bench_chain: %s: %s\n", (what), cudaGetErrorString(e_));  \
            exit(1);                                                                   \
        }                                                                              \
    } while (0)

/* One chain of n kernels as a graph: microseconds a kernel (best of 5
 * replays) and whether every block's value came out right. */
static double
bc_chain(enum bc_form form, int pdl, int n, float *val, const float4 *buf, cudaStream_t st,
         int *ok)
{
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaEvent_t e0, e1;
    int blocks = form == BC_TINY ? 1 : BC_WIDE_BLOCKS;
    float best = 1e30f, h[BC_WIDE_BLOCKS];

    BC_TRY("capture", cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; i++)
        BC_TRY("launch", bc_launch(form, pdl, val, buf, i, st));
    BC_TRY("capture end", cudaStreamEndCapture(st, &g));
    BC_TRY("instantiate", cudaGraphInstantiate(&ge, g, 0));
    BC_TRY("event", cudaEventCreate(&e0));
    BC_TRY("event", cudaEventCreate(&e1));
    for (int r = 0; r < 6; r++) {
        float ms = 0.0f;

        BC_TRY("memset", cudaMemsetAsync(val, 0, BC_WIDE_BLOCKS * sizeof(float), st));
        BC_TRY("record", cudaEventRecord(e0, st));
        BC_TRY("replay", cudaGraphLaunch(ge, st));
        BC_TRY("record", cudaEventRecord(e1, st));
        BC_TRY("sync", cudaEventSynchronize(e1));
        BC_TRY("elapsed", cudaEventElapsedTime(&ms, e0, e1));
        if (r > 0 && ms < best)
            best = ms;
    }
    BC_TRY("download", cudaMemcpy(h, val, blocks * sizeof(float), cudaMemcpyDeviceToHost));
    *ok = 1;
    for (int b = 0; b < blocks; b++)
        if (h[b] != (float)n)
            *ok = 0;
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    return best * 1000.0 / n;
}

int
main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 512, n_dev = 0, bad = 0;
    float *val;
    float4 *buf;
    cudaStream_t st;

    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
        printf("skip: no CUDA device\n");
        return 77;
    }
    if (n < 1 || n > 100000) {
        fprintf(stderr, "usage: bench_chain [N]   (1 <= N <= 100000 kernels a graph)\n");
        return 2;
    }
    BC_TRY("alloc", cudaMalloc(&val, BC_WIDE_BLOCKS * sizeof(float)));
    BC_TRY("alloc", cudaMalloc(&buf, BC_WORK_BYTES));
    BC_TRY("memset", cudaMemset(buf, 0, BC_WORK_BYTES));
    BC_TRY("stream", cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    printf("bench_chain: %d dependent kernels a graph, microseconds a kernel (best of 5 "
           "replays)\n", n);
    for (int f = BC_TINY; f <= BC_WORK; f++)
        for (int pdl = 0; pdl < 2; pdl++) {
            int ok = 0;
            double us = bc_chain((enum bc_form)f, pdl, n, val, buf, st, &ok);

            printf("%s chain %-4s pdl %d: %7.3f us a kernel\n", ok ? "ok  " : "FAIL", bc_name[f],
                   pdl, us);
            bad += !ok;
        }
    {   /* the steps behind grid-wide barriers in one cooperative kernel */
        cudaEvent_t e0, e1;
        float best = 1e30f, h[BC_WIDE_BLOCKS];
        int ok = 1, coop = 0;

        BC_TRY("attribute", cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
        BC_TRY("event", cudaEventCreate(&e0));
        BC_TRY("event", cudaEventCreate(&e1));
        for (int r = 0; coop && r < 6; r++) {
            void *args[] = { &val, &n };
            float ms = 0.0f;

            BC_TRY("memset", cudaMemsetAsync(val, 0, BC_WIDE_BLOCKS * sizeof(float), st));
            BC_TRY("record", cudaEventRecord(e0, st));
            BC_TRY("cooperative launch",
                   cudaLaunchCooperativeKernel((const void *)bc_grid_kernel,
                                               dim3(BC_WIDE_BLOCKS), dim3(256), args, 0, st));
            BC_TRY("record", cudaEventRecord(e1, st));
            BC_TRY("sync", cudaEventSynchronize(e1));
            BC_TRY("elapsed", cudaEventElapsedTime(&ms, e0, e1));
            if (r > 0 && ms < best)
                best = ms;
        }
        if (coop) {
            BC_TRY("download", cudaMemcpy(h, val, sizeof(h), cudaMemcpyDeviceToHost));
            for (int b = 0; b < BC_WIDE_BLOCKS; b++)
                ok &= h[b] == (float)n;
            printf("%s grid sync, %d blocks of 256 in one kernel: %7.3f us a step\n",
                   ok ? "ok  " : "FAIL", BC_WIDE_BLOCKS, best * 1000.0 / n);
            bad += !ok;
        } else {
            printf("skip grid sync: no cooperative launch on this device\n");
        }
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    {   /* one work kernel alone: its own time, the rest of its chain figure is the boundary */
        int ok = 0;
        double us = bc_chain(BC_WORK, 0, 1, val, buf, st, &ok);

        printf("%s one work kernel alone (a graph of 1): %7.3f us\n", ok ? "ok  " : "FAIL", us);
        bad += !ok;
    }
    cudaFree(val);
    cudaFree(buf);
    cudaStreamDestroy(st);
    printf("summary: %s\n", bad ? "FAIL" : "ok");
    return bad ? 1 : 0;
}
