/*
 * cuda_copy.cu — the copy_batch op (kernels/backend.h): many device-to-
 * device copies (the arrays and pages of a decode state, to or from a CUDA
 * IPC region) in one table upload and ONE kernel, instead of one
 * cudaMemcpyAsync per piece (thousands for the full model's state).
 *
 * Host: the pieces (empty ones left out) are written to a pinned table with
 * each piece's first chunk (a prefix sum of ceil(bytes / COPY_CHUNK)); the
 * table goes to the backend's scratch with one cudaMemcpyAsync, an event is
 * recorded after it, and the next call waits on that event before it
 * overwrites the pinned table (so the staging is never rewritten while its
 * upload is pending).
 *
 * Device: blocks take chunks grid-stride; a block finds its chunk's piece by
 * binary search over the first-chunk column and copies the chunk's (at most
 * COPY_CHUNK) bytes: with 16-byte vectors (four loads in flight per thread
 * before the stores, which matters when the source is another GPU's memory
 * read over NVLink) when source and destination agree modulo 16, after a
 * byte head up to the alignment; else 4-byte words when they agree modulo
 * 4; else bytes.  Tails are copied bytewise.  Chunks start at multiples of
 * COPY_CHUNK inside their piece, so alignment is the same for every chunk
 * of a piece.
 *
 * DSV4_CUDA_COPY_BATCH=memcpy: one cudaMemcpyAsync per piece instead (the
 * path before this kernel), should the kernel ever be suspect.
 */
#include "kernels/cuda/cuda.cuh"

#include <stdlib.h>
#include <string.h>

#define COPY_CHUNK (64 * 1024)  /* bytes of a piece per block iteration */
#define COPY_THREADS 256
#define COPY_UNROLL 4           /* 16-byte loads in flight per thread */

/* One piece of the table (device layout, 32 bytes). */
struct copy_piece {
    unsigned long long dst, src;    /* device addresses */
    unsigned long long bytes;       /* > 0 */
    unsigned long long first;       /* its first chunk in the batch */
};

/* Copy bytes [0, n) from s to d with a block's threads, in units of T
 * (uint4 or uint32_t) once d is aligned; d and s agree modulo sizeof(T). */
template <typename T, int U>
static __device__ void
copy_units(char *d, const char *s, unsigned long long n)
{
    unsigned long long head = (sizeof(T) - ((unsigned long long)d & (sizeof(T) - 1))) &
                              (sizeof(T) - 1);
    unsigned long long nv, tail, step = (unsigned long long)U * blockDim.x;

    if (head > n)
        head = n;
    for (unsigned long long i = threadIdx.x; i < head; i += blockDim.x)
        d[i] = s[i];
    nv = (n - head) / sizeof(T);
    T *dv = (T *)(d + head);
    const T *sv = (const T *)(s + head);
    for (unsigned long long base = 0; base < nv; base += step) {
        T r[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            unsigned long long i = base + (unsigned long long)k * blockDim.x + threadIdx.x;
            if (i < nv)
                r[k] = sv[i];
        }
#pragma unroll
        for (int k = 0; k < U; k++) {
            unsigned long long i = base + (unsigned long long)k * blockDim.x + threadIdx.x;
            if (i < nv)
                dv[i] = r[k];
        }
    }
    tail = head + nv * sizeof(T);
    for (unsigned long long i = tail + threadIdx.x; i < n; i += blockDim.x)
        d[i] = s[i];
}

static __global__ void
copy_batch_kernel(const struct copy_piece *pc, int n, unsigned long long n_chunks)
{
    for (unsigned long long c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        int lo = 0, hi = n - 1;

        /* the last piece whose first chunk is <= c */
        while (lo < hi) {
            int mid = lo + (hi - lo + 1) / 2;
            if (pc[mid].first <= c)
                lo = mid;
            else
                hi = mid - 1;
        }
        struct copy_piece p = pc[lo];
        unsigned long long off = (c - p.first) * COPY_CHUNK;
        unsigned long long len = p.bytes - off < COPY_CHUNK ? p.bytes - off : COPY_CHUNK;
        char *d = (char *)p.dst + off;
        const char *s = (const char *)p.src + off;
        unsigned long long mis = (p.dst ^ p.src);

        if ((mis & 15) == 0)
            copy_units<uint4, COPY_UNROLL>(d, s, len);
        else if ((mis & 3) == 0)
            copy_units<uint32_t, COPY_UNROLL>(d, s, len);
        else
            copy_units<char, COPY_UNROLL>(d, s, len);
    }
}

/* Room for n pieces in the pinned table (waits for the last upload first,
 * which every caller does anyway before writing the table). */
static enum dsv4_err
copy_staging(struct dsv4_backend *be, int n)
{
    struct cuda_state *st = cuda_st(be);
    size_t need = (size_t)n * sizeof(struct copy_piece);

    if (st->batch_ev == NULL)
        CUDA_TRY(cudaEventCreateWithFlags(&st->batch_ev, cudaEventDisableTiming));
    CUDA_TRY(cudaEventSynchronize(st->batch_ev));
    if (need <= st->batch_bytes)
        return DSV4_OK;
    if (st->batch_host != NULL)
        cudaFreeHost(st->batch_host);
    st->batch_host = NULL;
    st->batch_bytes = 0;
    need = need < 4096 ? 4096 : need + need / 2;
    CUDA_TRY(cudaMallocHost(&st->batch_host, need));
    st->batch_bytes = need;
    return DSV4_OK;
}

enum dsv4_err
cuda_copy_batch(struct dsv4_backend *be, int n, void *const *dst, const void *const *src,
                const size_t *bytes)
{
    struct cuda_state *st = cuda_st(be);
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    const char *env = getenv("DSV4_CUDA_COPY_BATCH");
    unsigned long long chunks = 0;
    struct copy_piece *tab;
    enum dsv4_err e;
    int m = 0, sms = 0, grid;
    void *dev;

    TRY_HC_JOIN(be);
    if (n < 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "copy_batch: %d pieces", n);
    if (n == 0)
        return DSV4_OK;
    if (env != NULL && strcmp(env, "memcpy") == 0) {
        for (int i = 0; i < n; i++)
            if (bytes[i] > 0)
                CUDA_TRY(cudaMemcpyAsync(dst[i], src[i], bytes[i], cudaMemcpyDeviceToDevice,
                                         st->stream));
        return DSV4_OK;
    }
    CUDA_TRY(cudaStreamIsCapturing(st->stream, &cap));
    if (cap != cudaStreamCaptureStatusNone)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "copy_batch: not while recording a graph");
    if ((e = copy_staging(be, n)) != DSV4_OK)
        return e;
    tab = (struct copy_piece *)st->batch_host;
    for (int i = 0; i < n; i++) {
        if (bytes[i] == 0)
            continue;
        tab[m].dst = (unsigned long long)(uintptr_t)dst[i];
        tab[m].src = (unsigned long long)(uintptr_t)src[i];
        tab[m].bytes = bytes[i];
        tab[m].first = chunks;
        chunks += (bytes[i] + COPY_CHUNK - 1) / COPY_CHUNK;
        m++;
    }
    if (m == 0)
        return DSV4_OK;
    if ((dev = cuda_scratch(be, (size_t)m * sizeof(*tab))) == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "copy_batch: no scratch for %d pieces", m);
    CUDA_TRY(cudaMemcpyAsync(dev, tab, (size_t)m * sizeof(*tab), cudaMemcpyHostToDevice,
                             st->stream));
    CUDA_TRY(cudaEventRecord(st->batch_ev, st->stream));
    sms = cuda_sms(be);
    grid = chunks < (unsigned long long)sms * 8 ? (int)chunks : sms * 8;
    copy_batch_kernel<<<grid, COPY_THREADS, 0, st->stream>>>((const struct copy_piece *)dev, m,
                                                              chunks);
    CUDA_LAUNCHED("copy_batch");
    return DSV4_OK;
}

void
cuda_copy_fini(struct dsv4_backend *be)
{
    struct cuda_state *st = cuda_st(be);

    if (st->batch_ev != NULL) {
        cudaEventSynchronize(st->batch_ev);
        cudaEventDestroy(st->batch_ev);
        st->batch_ev = NULL;
    }
    if (st->batch_host != NULL)
        cudaFreeHost(st->batch_host);
    st->batch_host = NULL;
    st->batch_bytes = 0;
}
