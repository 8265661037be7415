/*
 * ktrace.c — a kernel timeline of any CUDA program, as it runs (graphs and
 * programmatic dependent launch included): an LD_PRELOAD library that asks
 * CUPTI for its concurrent-kernel activity records and writes one line per
 * kernel to $KTRACE_OUT (default /tmp/ktrace.txt) when the program exits:
 *
 *   DEVICE STREAM START_NS END_NS GRID_BLOCKS BLOCK_THREADS MANGLED_NAME
 *
 * Nsight Compute replays each kernel alone (no graph, no overlap, caches
 * flushed); this shows what a decode step's kernels cost inside the graph.
 * tools/ktrace/ktrace_sum.py charges each kernel of a step the time from its
 * predecessor's end to its own end (with PDL a kernel starts before its
 * predecessor ends) and sums by kernel.  Usage (docs/perf.md run 26):
 *
 *   KTRACE_OUT=trace.txt LD_PRELOAD=libdsv4ktrace.so test_tp_gpu equal 4 16
 *   tools/ktrace/ktrace_sum.py trace.txt --device 1 --kernels 203 --skip 16 --steps 4
 *
 * A measuring aid, not part of the service: CUPTI adds a little time per
 * kernel.  Records are flushed by the exit handler, so a program that ends
 * with _exit() or a signal writes nothing.
 */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#define KT_BUF (16u << 20)   /* bytes per CUPTI activity buffer */

static FILE *kt_out;

/* CUPTI wants a buffer for activity records. */
static void CUPTIAPI
kt_request(uint8_t **buf, size_t *size, size_t *max_records)
{
    *buf = aligned_alloc(8, KT_BUF);
    *size = *buf != NULL ? KT_BUF : 0;
    *max_records = 0;
}

/* CUPTI hands a filled buffer back: one line per kernel record. */
static void CUPTIAPI
kt_complete(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid)
{
    CUpti_Activity *r = NULL;

    (void)ctx;
    (void)stream;
    (void)size;
    while (kt_out != NULL && cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;

        if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
            continue;
        fprintf(kt_out, "%u %u %llu %llu %d %d %s\n", k->deviceId, k->streamId,
                (unsigned long long)k->start, (unsigned long long)k->end,
                k->gridX * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ, k->name);
    }
    free(buf);
}

/* At load: open the output, enable kernel records. */
__attribute__((constructor)) static void
kt_start(void)
{
    const char *path = getenv("KTRACE_OUT");

    kt_out = fopen(path != NULL ? path : "/tmp/ktrace.txt", "w");
    if (kt_out == NULL) {
        perror("ktrace: output");
        return;
    }
    if (cuptiActivityRegisterCallbacks(kt_request, kt_complete) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS)
        fprintf(stderr, "ktrace: CUPTI refused the activity callbacks; no trace\n");
}

/* At exit: flush what CUPTI still holds, close the output. */
__attribute__((destructor)) static void
kt_stop(void)
{
    cuptiActivityFlushAll(1);
    if (kt_out != NULL)
        fclose(kt_out);
    kt_out = NULL;
}
