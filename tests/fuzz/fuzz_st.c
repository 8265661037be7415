/*
 * fuzz_st.c — libFuzzer target for the safetensors reader
 * (common/safetensors.h, "nothing crashes on a hostile file").
 *
 * Input: the bytes of one file.  They are written to a memfd and opened
 * through /proc/self/fd/N with dsv4_st_open, which maps the file as it
 * would a checkpoint shard.  Checked, aborting on the first that fails:
 *   - a refusal is DSV4_ERR_WEIGHTS with a message naming the file;
 *   - an accepted file's tensors each have a known dtype, 0..8 dimensions
 *     none negative, n_bytes == the elements × the dtype's size, data inside
 *     the input (every byte is read, so a view past the mapping faults; the
 *     views sit on the input's own bytes at one offset after the header),
 *     no two views overlapping, and dsv4_st_find gives each back by name
 *     (so names are unique).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/safetensors.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void
fail(const char *what, const char *name)
{
    fuzz_fail("fuzz_st", what, name);
}

static int
by_data(const void *a, const void *b)
{
    const struct dsv4_st_tensor *x = *(const struct dsv4_st_tensor *const *)a;
    const struct dsv4_st_tensor *y = *(const struct dsv4_st_tensor *const *)b;
    uintptr_t p = (uintptr_t)x->data, q = (uintptr_t)y->data;

    return p < q ? -1 : p > q;
}

static int
views_in_input(const struct dsv4_st_tensor **v, int n, const uint8_t *in, size_t size,
    size_t base)
{
    const uint8_t *lo = v[0]->data;

    for (size_t o = base; o + v[0]->n_bytes <= size; o++) {
        int ok = memcmp(in + o, lo, v[0]->n_bytes) == 0;

        for (int i = 1; ok && i < n; i++) {
            size_t at = o + (size_t)((const uint8_t *)v[i]->data - lo);

            ok = at + v[i]->n_bytes <= size &&
                memcmp(in + at, v[i]->data, v[i]->n_bytes) == 0;
        }
        if (ok)
            return 1;
    }
    return 0;
}

static void
check_file(const struct dsv4_st_file *f, const uint8_t *in, size_t size)
{
    int n = dsv4_st_count(f);
    const struct dsv4_st_tensor **v;
    uint64_t hlen = 0;
    size_t base;

    if (n < 0)
        fail("negative tensor count", NULL);
    if (n == 0)
        return;
    if ((v = calloc((size_t)n, sizeof(*v))) == NULL)
        fail("out of memory", NULL);
    for (int k = 0; k < 8; k++)
        hlen |= (uint64_t)in[k] << (8 * k);
    base = 8 + (size_t)hlen;   /* accepted: the header fits the file */
    for (int i = 0; i < n; i++) {
        const struct dsv4_st_tensor *t = dsv4_st_at(f, i);
        size_t elems = 1, es;

        if (t == NULL || t->name == NULL)
            fail("no tensor at an index below the count", NULL);
        es = dsv4_st_dtype_size(t->dtype);
        if (t->dtype <= DSV4_ST_NONE || t->dtype >= DSV4_ST__COUNT || es == 0)
            fail("unknown dtype", t->name);
        if (t->n_dims < 0 || t->n_dims > DSV4_ST_MAX_DIMS)
            fail("dimension count out of range", t->name);
        for (int d = 0; d < t->n_dims; d++) {
            if (t->shape[d] < 0)
                fail("negative dimension", t->name);
            if (__builtin_mul_overflow(elems, (size_t)t->shape[d], &elems))
                fail("element count overflows", t->name);
        }
        if (__builtin_mul_overflow(elems, es, &elems) || elems != t->n_bytes)
            fail("n_bytes is not the elements times the dtype's size", t->name);
        if (dsv4_st_find(f, t->name) != t)
            fail("dsv4_st_find does not give the tensor back", t->name);
        if (t->n_bytes > 0) {
            /* every byte read: a view past the mapping faults */
            const volatile uint8_t *p = t->data;
            uint8_t sink = 0;

            for (size_t k = 0; k < t->n_bytes; k++)
                sink ^= p[k];
            (void)sink;
        }
        v[i] = t;
    }
    qsort(v, (size_t)n, sizeof(*v), by_data);
    for (int i = 0; i + 1 < n; i++)
        if ((const uint8_t *)v[i]->data + v[i]->n_bytes > (const uint8_t *)v[i + 1]->data &&
            v[i]->n_bytes > 0 && v[i + 1]->n_bytes > 0)
            fail("two views overlap", v[i]->name);
    /* The views are the input's bytes: some offset of the lowest one in the
     * data area puts every view on its own bytes of the input.  (The
     * mapping's address is not known here, so each offset where the lowest
     * view's bytes occur is tried.) */
    if (!views_in_input(v, n, in, size, base))
        fail("the views are not bytes of the input's data area", v[0]->name);
    free(v);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct dsv4_st_file *f = NULL;
    char path[64];
    enum dsv4_err e;
    int fd;

    fd = fuzz_memfile("fuzz_st", data, size, path);
    e = dsv4_st_open(&f, path);
    if (getenv("FUZZ_VERBOSE") != NULL)   /* to see what a seed does */
        fprintf(stderr, "fuzz_st: %s\n", e == DSV4_OK ? "accepted" : dsv4_errmsg());
    if (e == DSV4_OK) {
        if (f == NULL)
            fail("DSV4_OK without a file", NULL);
        check_file(f, data, size);
        dsv4_st_close(f);
    } else {
        if (e != DSV4_ERR_WEIGHTS)
            fail("refused with an error other than DSV4_ERR_WEIGHTS", dsv4_errmsg());
        if (strstr(dsv4_errmsg(), path) == NULL)
            fail("the refusal does not name the file", dsv4_errmsg());
    }
    close(fd);
    return 0;
}
