/*
 * safetensors.c — mmap reader with strict validation, sharded checkpoint
 * (model.safetensors.index.json), and a streaming writer (model doc §2.1).
 *
 * Container: u64 little-endian header length N, N bytes of JSON
 * {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
 * then the data area; offsets are relative to its start.
 *
 * Invariant: a struct dsv4_st_file exists only after every tensor of its
 * header passed validation (known dtype, shape × element size == byte length,
 * range inside the data area, no two ranges overlap, names unique), so callers
 * may use any dsv4_st_tensor it hands out without further checks.  Every
 * failure is reported through dsv4_err_set() naming the file and, where there
 * is one, the tensor.
 */
#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <json-c/json.h>

#include "common/file_open.h"
#include "common/json_keys.h"

/* Largest header or index file we accept (the official library uses
 * 100 MB for headers; the 69k-entry index of the real model is ~6 MB). */
#define ST_MAX_JSON (100u << 20)

/* --- dtypes ------------------------------------------------------------ */

static const struct {
    const char *name;
    size_t size;
} st_dtypes[DSV4_ST__COUNT] = {
    [DSV4_ST_NONE] = { "NONE", 0 },
    [DSV4_ST_BF16] = { "BF16", 2 },
    [DSV4_ST_F32] = { "F32", 4 },
    [DSV4_ST_F8_E4M3] = { "F8_E4M3", 1 },
    [DSV4_ST_F8_E8M0] = { "F8_E8M0", 1 },
    [DSV4_ST_I8] = { "I8", 1 },
    [DSV4_ST_I64] = { "I64", 8 },
    [DSV4_ST_I32] = { "I32", 4 },
    [DSV4_ST_F16] = { "F16", 2 },
    [DSV4_ST_U8] = { "U8", 1 },
};

size_t
dsv4_st_dtype_size(enum dsv4_st_dtype dt)
{
    if ((unsigned)dt >= DSV4_ST__COUNT)
        return 0;
    return st_dtypes[dt].size;
}

const char *
dsv4_st_dtype_name(enum dsv4_st_dtype dt)
{
    if ((unsigned)dt >= DSV4_ST__COUNT)
        return "?";
    return st_dtypes[dt].name;
}

enum dsv4_st_dtype
dsv4_st_dtype_parse(const char *s)
{
    if (s == NULL)
        return DSV4_ST_NONE;
    for (int i = 1; i < DSV4_ST__COUNT; i++) {
        if (strcmp(s, st_dtypes[i].name) == 0)
            return (enum dsv4_st_dtype)i;
    }
    return DSV4_ST_NONE;
}

/* Byte size of a tensor; 0 with *ok = 0 on overflow. */
static size_t
st_nbytes(enum dsv4_st_dtype dt, int n_dims, const int64_t *shape, int *ok)
{
    size_t n = dsv4_st_dtype_size(dt);

    *ok = 1;
    for (int d = 0; d < n_dims; d++) {
        if (shape[d] < 0 || (uint64_t)shape[d] > SIZE_MAX ||
            __builtin_mul_overflow(n, (size_t)shape[d], &n)) {
            *ok = 0;
            return 0;
        }
    }
    return n;
}

/* qsort order of an array of shard names (never NULL). */
static int
cmp_name(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* --- a single file ------------------------------------------------------ */

struct dsv4_st_file {
    char *path;
    void *map;                      /* whole file, PROT_READ */
    size_t map_len;
    const uint8_t *data;            /* data area */
    size_t data_len;
    int n;
    struct dsv4_st_tensor *t;       /* header order */
    int *by_name;                   /* indices sorted by name */
    char **names;                   /* owned copies */
};

/* qsort_r-free sorting helpers: sort index arrays through a file-scope
 * pointer would not be thread-safe, so sort pointer pairs instead. */
struct name_ix {
    const char *name;
    int ix;
};

static int
cmp_name_ix(const void *a, const void *b)
{
    return strcmp(((const struct name_ix *)a)->name, ((const struct name_ix *)b)->name);
}

struct range_ix {
    uint64_t begin, end;
    int ix;
};

static int
cmp_range_ix(const void *a, const void *b)
{
    const struct range_ix *x = a, *y = b;

    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

void
dsv4_st_close(struct dsv4_st_file *f)
{
    if (f == NULL)
        return;
    if (f->map != NULL)
        munmap(f->map, f->map_len);
    if (f->names != NULL) {
        for (int i = 0; i < f->n; i++)
            free(f->names[i]);
    }
    free(f->names);
    free(f->t);
    free(f->by_name);
    free(f->path);
    free(f);
}

/* Read a non-negative JSON integer. */
static int
json_get_u64(struct json_object *o, uint64_t *v)
{
    int64_t x;

    if (!json_object_is_type(o, json_type_int))
        return -1;
    x = json_object_get_int64(o);
    if (x < 0 || (x == INT64_MAX && json_object_get_uint64(o) > (uint64_t)INT64_MAX))
        return -1;
    *v = (uint64_t)x;
    return 0;
}

/* Validate one header entry and fill t[i]; `ranges[i]` gets its offsets. */
static enum dsv4_err
st_parse_entry(struct dsv4_st_file *f, int i, const char *name, struct json_object *e,
               struct range_ix *range)
{
    struct dsv4_st_tensor *t = &f->t[i];
    struct json_object *dt, *sh, *off;
    uint64_t b, en;
    size_t nb;
    int ok;

    if (!json_object_is_type(e, json_type_object))
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': header entry is not an object",
                            f->path, name);
    if (!json_object_object_get_ex(e, "dtype", &dt) || !json_object_is_type(dt, json_type_string))
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': missing or non-string dtype",
                            f->path, name);
    t->dtype = dsv4_st_dtype_parse(json_object_get_string(dt));
    if (t->dtype == DSV4_ST_NONE)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': unknown dtype \"%s\"", f->path,
                            name, json_object_get_string(dt));
    if (!json_object_object_get_ex(e, "shape", &sh) || !json_object_is_type(sh, json_type_array))
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': missing or non-array shape",
                            f->path, name);
    if (json_object_array_length(sh) > DSV4_ST_MAX_DIMS)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': %zu dims (max %d)", f->path,
                            name, json_object_array_length(sh), DSV4_ST_MAX_DIMS);
    t->n_dims = (int)json_object_array_length(sh);
    for (int d = 0; d < t->n_dims; d++) {
        uint64_t v;

        if (json_get_u64(json_object_array_get_idx(sh, (size_t)d), &v) != 0 ||
            v > (uint64_t)INT64_MAX)
            return dsv4_err_set(DSV4_ERR_WEIGHTS,
                                "%s: tensor '%s': shape[%d] is not a non-negative integer",
                                f->path, name, d);
        t->shape[d] = (int64_t)v;
    }
    if (!json_object_object_get_ex(e, "data_offsets", &off) ||
        !json_object_is_type(off, json_type_array) || json_object_array_length(off) != 2 ||
        json_get_u64(json_object_array_get_idx(off, 0), &b) != 0 ||
        json_get_u64(json_object_array_get_idx(off, 1), &en) != 0)
        return dsv4_err_set(DSV4_ERR_WEIGHTS,
                            "%s: tensor '%s': data_offsets must be [begin, end] integers",
                            f->path, name);
    if (b > en)
        return dsv4_err_set(DSV4_ERR_WEIGHTS,
                            "%s: tensor '%s': data_offsets [%llu, %llu]: begin > end", f->path,
                            name, (unsigned long long)b, (unsigned long long)en);
    if (en > f->data_len)
        return dsv4_err_set(DSV4_ERR_WEIGHTS,
                            "%s: tensor '%s': data_offsets [%llu, %llu] outside the data area "
                            "(%zu bytes)", f->path, name, (unsigned long long)b,
                            (unsigned long long)en, f->data_len);
    nb = st_nbytes(t->dtype, t->n_dims, t->shape, &ok);
    if (!ok || nb != en - b)
        return dsv4_err_set(DSV4_ERR_WEIGHTS,
                            "%s: tensor '%s': shape x %s size is %s%zu bytes but data_offsets "
                            "span %llu", f->path, name, dsv4_st_dtype_name(t->dtype),
                            ok ? "" : "overflowing ", nb, (unsigned long long)(en - b));
    t->n_bytes = nb;
    t->data = f->data + b;
    t->file = f->path;
    range->begin = b;
    range->end = en;
    range->ix = i;
    return DSV4_OK;
}

/* Parse and validate the header text; fill f->t. */
static enum dsv4_err
st_parse_header(struct dsv4_st_file *f, const char *hdr, size_t hlen)
{
    struct json_object *root;
    struct range_ix *ranges = NULL;
    struct name_ix *names = NULL;
    enum dsv4_err err = DSV4_OK;
    const char *why;
    char dup[256];
    int n, i;

    root = dsv4_json_parse_exact(hdr, hlen, &why);
    if (root == NULL)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: header: %s", f->path, why);
    if (!json_object_is_type(root, json_type_object)) {
        json_object_put(root);
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: header is not a JSON object", f->path);
    }
    if (dsv4_json_find_dup(root, hdr, hlen, 1, dup, sizeof(dup))) {
        json_object_put(root);
        if (dup[0] != '\0')
            return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': duplicate name in header",
                                f->path, dup);
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: header: duplicate key inside an entry",
                            f->path);
    }

    n = json_object_object_length(root);
    f->t = calloc((size_t)n + 1, sizeof(*f->t));
    f->names = calloc((size_t)n + 1, sizeof(*f->names));
    f->by_name = calloc((size_t)n + 1, sizeof(*f->by_name));
    ranges = calloc((size_t)n + 1, sizeof(*ranges));
    names = calloc((size_t)n + 1, sizeof(*names));
    if (f->t == NULL || f->names == NULL || f->by_name == NULL || ranges == NULL ||
        names == NULL) {
        err = dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory for %d tensors", f->path, n);
        goto out;
    }

    i = 0;
    json_object_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0)
            continue;
        f->names[i] = strdup(key);
        f->n = i + 1;
        if (f->names[i] == NULL) {
            err = dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", f->path);
            goto out;
        }
        f->t[i].name = f->names[i];
        err = st_parse_entry(f, i, key, val, &ranges[i]);
        if (err != DSV4_OK)
            goto out;
        names[i].name = f->names[i];
        names[i].ix = i;
        i++;
    }
    f->n = i;

    /* Ranges sorted by begin must not overlap (empty tensors occupy nothing). */
    qsort(ranges, (size_t)f->n, sizeof(*ranges), cmp_range_ix);
    {
        int prev = -1;

        for (i = 0; i < f->n; i++) {
            if (ranges[i].begin == ranges[i].end)
                continue;
            if (prev >= 0 && ranges[i].begin < ranges[prev].end) {
                err = dsv4_err_set(DSV4_ERR_WEIGHTS,
                                   "%s: tensor '%s': data_offsets [%llu, %llu] overlap tensor "
                                   "'%s' [%llu, %llu]", f->path, f->t[ranges[i].ix].name,
                                   (unsigned long long)ranges[i].begin,
                                   (unsigned long long)ranges[i].end, f->t[ranges[prev].ix].name,
                                   (unsigned long long)ranges[prev].begin,
                                   (unsigned long long)ranges[prev].end);
                goto out;
            }
            prev = i;
        }
    }
    qsort(names, (size_t)f->n, sizeof(*names), cmp_name_ix);
    for (i = 0; i < f->n; i++)
        f->by_name[i] = names[i].ix;
out:
    free(ranges);
    free(names);
    json_object_put(root);
    return err;
}

enum dsv4_err
dsv4_st_open(struct dsv4_st_file **out, const char *path)
{
    struct dsv4_st_file *f;
    struct stat st;
    uint64_t hlen = 0;
    enum dsv4_err err;
    int fd;

    *out = NULL;
    f = calloc(1, sizeof(*f));
    if (f == NULL || (f->path = strdup(path)) == NULL) {
        free(f);
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", path);
    }
    if ((err = dsv4_open_regular(path, DSV4_ERR_WEIGHTS, &fd, &st)) != DSV4_OK)
        goto fail;
    if (st.st_size < 8) {
        err = dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: file shorter than the 8-byte header length",
                           path);
        close(fd);
        goto fail;
    }
    f->map_len = (size_t)st.st_size;
    f->map = mmap(NULL, f->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: mmap: %s", path, strerror(errno));
        goto fail;
    }
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | ((const uint8_t *)f->map)[i];
    if (hlen > f->map_len - 8) {
        err = dsv4_err_set(DSV4_ERR_WEIGHTS,
                           "%s: header length %llu runs past the end of the file (%zu bytes)",
                           path, (unsigned long long)hlen, f->map_len);
        goto fail;
    }
    if (hlen < 2 || hlen > ST_MAX_JSON) {
        err = dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: implausible header length %llu", path,
                           (unsigned long long)hlen);
        goto fail;
    }
    f->data = (const uint8_t *)f->map + 8 + hlen;
    f->data_len = f->map_len - 8 - (size_t)hlen;
    err = st_parse_header(f, (const char *)f->map + 8, (size_t)hlen);
    if (err != DSV4_OK)
        goto fail;
    *out = f;
    return DSV4_OK;
fail:
    dsv4_st_close(f);
    return err;
}

int
dsv4_st_count(const struct dsv4_st_file *f)
{
    return f->n;
}

const struct dsv4_st_tensor *
dsv4_st_at(const struct dsv4_st_file *f, int i)
{
    if (i < 0 || i >= f->n)
        return NULL;
    return &f->t[i];
}

const struct dsv4_st_tensor *
dsv4_st_find(const struct dsv4_st_file *f, const char *name)
{
    int lo = 0, hi = f->n - 1;

    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(name, f->t[f->by_name[mid]].name);

        if (c == 0)
            return &f->t[f->by_name[mid]];
        if (c < 0)
            hi = mid - 1;
        else
            lo = mid + 1;
    }
    return NULL;
}

/* --- a sharded checkpoint ---------------------------------------------- */

struct dsv4_ckpt {
    int n_files;
    struct dsv4_st_file **files;     /* shard order (sorted file names) */
    int n;
    const struct dsv4_st_tensor **all;    /* shard order, then header order */
    const struct dsv4_st_tensor **sorted; /* by name */
};

void
dsv4_ckpt_close(struct dsv4_ckpt *c)
{
    if (c == NULL)
        return;
    for (int i = 0; i < c->n_files; i++)
        dsv4_st_close(c->files[i]);
    free(c->files);
    free(c->all);
    free(c->sorted);
    free(c);
}

static int
cmp_tensor_name(const void *a, const void *b)
{
    return strcmp((*(const struct dsv4_st_tensor *const *)a)->name,
                  (*(const struct dsv4_st_tensor *const *)b)->name);
}

/* Read a whole (small) file into a NUL-terminated buffer. */
static enum dsv4_err
read_small_file(const char *path, char **buf, size_t *len)
{
    struct stat st;
    enum dsv4_err err;
    size_t got = 0;
    int fd;

    *buf = NULL;
    if ((err = dsv4_open_regular(path, DSV4_ERR_WEIGHTS, &fd, &st)) != DSV4_OK)
        return err;
    if ((uint64_t)st.st_size > ST_MAX_JSON) {
        close(fd);
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: %lld bytes, more than the %u accepted",
                            path, (long long)st.st_size, ST_MAX_JSON);
    }
    *buf = malloc((size_t)st.st_size + 1);
    if (*buf == NULL) {
        close(fd);
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", path);
    }
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, *buf + got, (size_t)st.st_size - got);

        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;

            close(fd);
            free(*buf);
            *buf = NULL;
            return dsv4_err_set(DSV4_ERR_SYS, "%s: read: %s", path, strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    (*buf)[got] = '\0';
    *len = got;
    return DSV4_OK;
}

/* A shard name from the index must be a plain file name in the directory. */
static int
shard_name_ok(const char *s)
{
    return s[0] != '\0' && strchr(s, '/') == NULL && strcmp(s, ".") != 0 &&
           strcmp(s, "..") != 0;
}

/* Index of s in the sorted names[0..n), or -1; *hint (the last answer)
 * is tried first: an index lists its tensors shard by shard, so
 * consecutive entries mostly name the same shard. */
static int
file_index(const char *const *names, int n, const char *s, int *hint)
{
    const char *const *hit;

    if (*hint >= 0 && *hint < n && strcmp(names[*hint], s) == 0)
        return *hint;
    hit = bsearch(&s, names, (size_t)n, sizeof(*names), cmp_name);
    if (hit == NULL)
        return -1;
    return *hint = (int)(hit - names);
}

/* Build c->all and c->sorted from the open files. */
static enum dsv4_err
ckpt_index(struct dsv4_ckpt *c, const char *dir)
{
    int k = 0;

    c->n = 0;
    for (int i = 0; i < c->n_files; i++)
        c->n += dsv4_st_count(c->files[i]);
    c->all = calloc((size_t)c->n + 1, sizeof(*c->all));
    c->sorted = calloc((size_t)c->n + 1, sizeof(*c->sorted));
    if (c->all == NULL || c->sorted == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", dir);
    for (int i = 0; i < c->n_files; i++) {
        for (int j = 0; j < dsv4_st_count(c->files[i]); j++)
            c->all[k++] = dsv4_st_at(c->files[i], j);
    }
    memcpy(c->sorted, c->all, (size_t)c->n * sizeof(*c->all));
    qsort(c->sorted, (size_t)c->n, sizeof(*c->sorted), cmp_tensor_name);
    for (int i = 1; i < c->n; i++) {
        if (strcmp(c->sorted[i]->name, c->sorted[i - 1]->name) == 0)
            return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': present in %s and in %s",
                                dir, c->sorted[i]->name, c->sorted[i - 1]->file,
                                c->sorted[i]->file);
    }
    return DSV4_OK;
}

/* Open every shard named by the index at `ipath` and cross-check. */
/*
 * Open the c->n_files shards named in `shards` (in that order) into
 * c->files.  Each open parses a JSON header of up to a few MB (the flash
 * checkpoint's 46 headers hold 69,187 tensors: about a second on one
 * core), so up to CKPT_OPEN_THREADS threads open them side by side.  The
 * error, if any, is that of the first failing shard in order, as a
 * sequential open would give; no shard past a known failure is opened.
 * Files opened stay in c->files (closed by dsv4_ckpt_close); a failed one
 * is NULL.
 */
#define CKPT_OPEN_THREADS 16

struct open_job {
    struct dsv4_ckpt *c;
    const char *dir;
    const char *const *shards;
    atomic_int next;
    pthread_mutex_t mu;     /* guards the three below */
    int fail;               /* lowest failing shard so far; n_files: none */
    enum dsv4_err err;      /* its error */
    char msg[1024];         /* and its message */
};

static void *
open_worker(void *arg)
{
    struct open_job *j = arg;
    char path[4096];
    enum dsv4_err e;
    int i, stop;

    while ((i = atomic_fetch_add(&j->next, 1)) < j->c->n_files) {
        pthread_mutex_lock(&j->mu);
        stop = i > j->fail;
        pthread_mutex_unlock(&j->mu);
        if (stop)
            break;
        snprintf(path, sizeof(path), "%s/%s", j->dir, j->shards[i]);
        if ((e = dsv4_st_open(&j->c->files[i], path)) == DSV4_OK)
            continue;
        pthread_mutex_lock(&j->mu);
        if (i < j->fail) {
            j->fail = i;
            j->err = e;
            snprintf(j->msg, sizeof(j->msg), "%s", dsv4_errmsg());
        }
        pthread_mutex_unlock(&j->mu);
    }
    return NULL;
}

static enum dsv4_err
ckpt_open_shards(struct dsv4_ckpt *c, const char *dir, const char *const *shards,
                 const char *ipath)
{
    pthread_t tid[CKPT_OPEN_THREADS];
    struct open_job j = { .c = c, .dir = dir, .shards = shards, .fail = c->n_files };
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int nt, started = 0;

    atomic_init(&j.next, 0);
    pthread_mutex_init(&j.mu, NULL);
    nt = (int)(cpus < 1 ? 1 : cpus > CKPT_OPEN_THREADS ? CKPT_OPEN_THREADS : cpus);
    if (nt > c->n_files)
        nt = c->n_files;
    /* this thread is one of the nt; a thread that cannot start leaves its
     * share to the others */
    for (int t = 1; t < nt; t++)
        if (pthread_create(&tid[started], NULL, open_worker, &j) == 0)
            started++;
    open_worker(&j);
    for (int t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
    pthread_mutex_destroy(&j.mu);
    if (j.fail == c->n_files)
        return DSV4_OK;
    if (j.err == DSV4_ERR_SYS)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s (shard named by %s)", j.msg, ipath);
    return dsv4_err_set(j.err, "%s", j.msg);
}

static enum dsv4_err
ckpt_open_index(struct dsv4_ckpt *c, const char *dir, const char *ipath)
{
    struct json_object *root = NULL, *wm;
    const char **shards = NULL;
    enum dsv4_err err = DSV4_OK;
    char *text, dup[256];
    const char *why;
    size_t len = 0;
    int n_map, nf = 0, hint = -1;

    err = read_small_file(ipath, &text, &len);
    if (err != DSV4_OK)
        return err;
    root = dsv4_json_parse_exact(text, len, &why);
    if (root == NULL) {
        free(text);
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: %s", ipath, why);
    }
    if (dsv4_json_find_dup(root, text, len, 2, dup, sizeof(dup))) {
        if (dup[0] != '\0')
            err = dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: tensor '%s': duplicate key", ipath, dup);
        else   /* a top-level key ("weight_map", "metadata") or one inside metadata */
            err = dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: duplicate key outside weight_map", ipath);
        goto out;
    }
    if (!json_object_is_type(root, json_type_object) ||
        !json_object_object_get_ex(root, "weight_map", &wm) ||
        !json_object_is_type(wm, json_type_object)) {
        err = dsv4_err_set(DSV4_ERR_WEIGHTS, "%s: no \"weight_map\" object", ipath);
        goto out;
    }
    n_map = json_object_object_length(wm);
    shards = calloc((size_t)n_map + 1, sizeof(*shards));
    if (shards == NULL) {
        err = dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", ipath);
        goto out;
    }

    /* Distinct shard names, sorted: that is the shard order.  Every entry's
     * name is collected (consecutive repeats skipped), then sorted and
     * deduplicated: n log n in the entries, whatever the number of
     * distinct shards.  Counted in nf: c->n_files counts opened files only
     * (dsv4_ckpt_close reads c->files[0 .. n_files), so it stays 0 until
     * c->files exists). */
    json_object_object_foreach(wm, name, sv) {
        const char *s;

        if (!json_object_is_type(sv, json_type_string) ||
            !shard_name_ok(s = json_object_get_string(sv))) {
            err = dsv4_err_set(DSV4_ERR_WEIGHTS,
                               "%s: tensor '%s': weight_map value is not a shard file name",
                               ipath, name);
            goto out;
        }
        if (nf == 0 || strcmp(shards[nf - 1], s) != 0)
            shards[nf++] = s;
    }
    qsort(shards, (size_t)nf, sizeof(*shards), cmp_name);
    {
        int m = 0;

        for (int i = 0; i < nf; i++) {
            if (m == 0 || strcmp(shards[m - 1], shards[i]) != 0)
                shards[m++] = shards[i];
        }
        nf = m;
    }
    c->files = calloc((size_t)nf + 1, sizeof(*c->files));
    if (c->files == NULL) {
        err = dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", ipath);
        goto out;
    }
    c->n_files = nf;
    if ((err = ckpt_open_shards(c, dir, shards, ipath)) != DSV4_OK)
        goto out;

    /* weight_map -> shard: the tensor must be there. */
    json_object_object_foreach(wm, name2, sv2) {
        int fi = file_index(shards, c->n_files, json_object_get_string(sv2), &hint);

        if (dsv4_st_find(c->files[fi], name2) == NULL) {
            err = dsv4_err_set(DSV4_ERR_WEIGHTS,
                               "%s: tensor '%s': listed in %s but not present in the shard",
                               c->files[fi]->path, name2, ipath);
            goto out;
        }
    }
    /* shard -> weight_map: every tensor must be listed, for this shard. */
    for (int i = 0; i < c->n_files; i++) {
        for (int j = 0; j < c->files[i]->n; j++) {
            const char *tn = c->files[i]->t[j].name;
            struct json_object *v;

            if (!json_object_object_get_ex(wm, tn, &v) ||
                strcmp(json_object_get_string(v), shards[i]) != 0) {
                err = dsv4_err_set(DSV4_ERR_WEIGHTS,
                                   "%s: tensor '%s': not listed for this shard in %s",
                                   c->files[i]->path, tn, ipath);
                goto out;
            }
        }
    }
    err = ckpt_index(c, dir);
out:
    free(shards);
    free(text);
    json_object_put(root);
    return err;
}

enum dsv4_err
dsv4_ckpt_open(struct dsv4_ckpt **out, const char *dir)
{
    struct dsv4_ckpt *c;
    enum dsv4_err err;
    char path[4096];
    struct stat st;

    *out = NULL;
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", dir);
    if ((size_t)snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir) >=
        sizeof(path)) {
        free(c);
        return dsv4_err_set(DSV4_ERR_INVAL, "%s: path too long", dir);
    }
    /* lstat: a dangling index link (a download cut short) is an index that
     * cannot be read, not the single-file layout */
    if (lstat(path, &st) == 0) {
        err = ckpt_open_index(c, dir, path);
    } else if (errno == ENOENT) {
        snprintf(path, sizeof(path), "%s/model.safetensors", dir);
        c->files = calloc(1, sizeof(*c->files));
        if (c->files == NULL) {
            err = dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", dir);
        } else {
            err = dsv4_st_open(&c->files[0], path);
            if (err == DSV4_OK) {
                c->n_files = 1;
                err = ckpt_index(c, dir);
            }
        }
    } else {
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: stat: %s", path, strerror(errno));
    }
    if (err != DSV4_OK) {
        dsv4_ckpt_close(c);
        return err;
    }
    *out = c;
    return DSV4_OK;
}

const struct dsv4_st_tensor *
dsv4_ckpt_find(const struct dsv4_ckpt *c, const char *name)
{
    struct dsv4_st_tensor key = { .name = name };
    const struct dsv4_st_tensor *kp = &key, *const *hit;

    hit = bsearch(&kp, c->sorted, (size_t)c->n, sizeof(*c->sorted), cmp_tensor_name);
    return hit != NULL ? *hit : NULL;
}

int
dsv4_ckpt_count(const struct dsv4_ckpt *c)
{
    return c->n;
}

const struct dsv4_st_tensor *
dsv4_ckpt_at(const struct dsv4_ckpt *c, int i)
{
    if (i < 0 || i >= c->n)
        return NULL;
    return c->all[i];
}

/* --- writing ------------------------------------------------------------ */

struct dsv4_st_writer {
    FILE *fp;
    char *path;
    char *tmp;            /* path + ".tmp": written, renamed to path at close */
    int n;
    size_t *sizes;        /* byte size per tensor */
    char **names;
    int cur;              /* tensor being written */
    size_t done;          /* bytes of it written so far */
    int failed;           /* an I/O error happened */
};

static void
writer_free(struct dsv4_st_writer *w)
{
    if (w->fp != NULL) {
        fclose(w->fp);
        unlink(w->tmp);   /* a writer given up before its close */
    }
    if (w->names != NULL) {
        for (int i = 0; i < w->n; i++)
            free(w->names[i]);
    }
    free(w->names);
    free(w->sizes);
    free(w->path);
    free(w->tmp);
    free(w);
}

/* Skip over tensors that are complete (including empty ones). */
static void
writer_advance(struct dsv4_st_writer *w)
{
    while (w->cur < w->n && w->done == w->sizes[w->cur]) {
        w->cur++;
        w->done = 0;
    }
}

/* Validate the tensor list and build the JSON header; NULL on error. */
static struct json_object *
writer_header(struct dsv4_st_writer *w, const char *const *names,
              const enum dsv4_st_dtype *dtypes, const int *n_dims,
              const int64_t (*shapes)[DSV4_ST_MAX_DIMS], enum dsv4_err *err)
{
    struct json_object *root = json_object_new_object();
    uint64_t off = 0;

    *err = DSV4_ERR_NOMEM;
    if (root == NULL)
        return NULL;
    for (int i = 0; i < w->n; i++) {
        struct json_object *e, *sh, *of;
        int ok;

        if (names[i] == NULL || names[i][0] == '\0' || strcmp(names[i], "__metadata__") == 0 ||
            json_object_object_get_ex(root, names[i], NULL)) {
            *err = dsv4_err_set(DSV4_ERR_INVAL, "%s: tensor %d '%s': empty, reserved or "
                                "duplicate name", w->path, i, names[i] ? names[i] : "(null)");
            goto fail;
        }
        if (dsv4_st_dtype_size(dtypes[i]) == 0 || n_dims[i] < 0 ||
            n_dims[i] > DSV4_ST_MAX_DIMS) {
            *err = dsv4_err_set(DSV4_ERR_INVAL, "%s: tensor '%s': bad dtype or dims", w->path,
                                names[i]);
            goto fail;
        }
        w->sizes[i] = st_nbytes(dtypes[i], n_dims[i], shapes[i], &ok);
        if (!ok) {
            *err = dsv4_err_set(DSV4_ERR_INVAL, "%s: tensor '%s': negative or overflowing shape",
                                w->path, names[i]);
            goto fail;
        }
        w->names[i] = strdup(names[i]);
        e = json_object_new_object();
        sh = json_object_new_array();
        of = json_object_new_array();
        if (w->names[i] == NULL || e == NULL || sh == NULL || of == NULL) {
            json_object_put(e);
            json_object_put(sh);
            json_object_put(of);
            *err = dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", w->path);
            goto fail;
        }
        json_object_object_add(e, "dtype", json_object_new_string(dsv4_st_dtype_name(dtypes[i])));
        for (int d = 0; d < n_dims[i]; d++)
            json_object_array_add(sh, json_object_new_int64(shapes[i][d]));
        json_object_object_add(e, "shape", sh);
        json_object_array_add(of, json_object_new_int64((int64_t)off));
        off += w->sizes[i];
        json_object_array_add(of, json_object_new_int64((int64_t)off));
        json_object_object_add(e, "data_offsets", of);
        json_object_object_add(root, names[i], e);
    }
    return root;
fail:
    json_object_put(root);
    return NULL;
}

enum dsv4_err
dsv4_st_writer_open(struct dsv4_st_writer **out, const char *path, int n,
                    const char *const *names, const enum dsv4_st_dtype *dtypes,
                    const int *n_dims, const int64_t (*shapes)[DSV4_ST_MAX_DIMS])
{
    struct dsv4_st_writer *w;
    struct json_object *root;
    enum dsv4_err err;
    const char *js;
    size_t jlen, padded;
    uint8_t len8[8];

    *out = NULL;
    if (n < 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "%s: negative tensor count", path);
    w = calloc(1, sizeof(*w));
    if (w == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", path);
    w->n = n;
    w->path = strdup(path);
    w->tmp = malloc(strlen(path) + 5);
    w->sizes = calloc((size_t)n + 1, sizeof(*w->sizes));
    w->names = calloc((size_t)n + 1, sizeof(*w->names));
    if (w->path == NULL || w->tmp == NULL || w->sizes == NULL || w->names == NULL) {
        writer_free(w);
        return dsv4_err_set(DSV4_ERR_NOMEM, "%s: out of memory", path);
    }
    root = writer_header(w, names, dtypes, n_dims, shapes, &err);
    if (root == NULL) {
        if (err == DSV4_ERR_NOMEM)
            dsv4_err_set(err, "%s: out of memory", path);
        writer_free(w);
        return err;
    }
    js = json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN |
                                              JSON_C_TO_STRING_NOSLASHESCAPE);
    jlen = strlen(js);
    padded = (jlen + 7) & ~(size_t)7;  /* data area starts 8-aligned */
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)padded >> (8 * i));

    /* a new file renamed over path at close: a process that has the old
     * file mapped keeps its bytes, and a failed write leaves the old file */
    sprintf(w->tmp, "%s.tmp", path);
    w->fp = fopen(w->tmp, "wb");
    if (w->fp == NULL) {
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: open: %s", w->tmp, strerror(errno));
        json_object_put(root);
        writer_free(w);
        return err;
    }
    if (fwrite(len8, 1, 8, w->fp) != 8 || fwrite(js, 1, jlen, w->fp) != jlen ||
        fwrite("       ", 1, padded - jlen, w->fp) != padded - jlen) {
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: write: %s", path, strerror(errno));
        json_object_put(root);
        writer_free(w);
        return err;
    }
    json_object_put(root);
    writer_advance(w);
    *out = w;
    return DSV4_OK;
}

enum dsv4_err
dsv4_st_writer_put(struct dsv4_st_writer *w, const void *data, size_t n_bytes)
{
    if (n_bytes == 0)
        return DSV4_OK;
    if (w->cur >= w->n || n_bytes > w->sizes[w->cur] - w->done)
        return dsv4_err_set(DSV4_ERR_INVAL, "%s: tensor '%s': %zu bytes exceed the %zu left",
                            w->path, w->cur < w->n ? w->names[w->cur] : "(none left)", n_bytes,
                            w->cur < w->n ? w->sizes[w->cur] - w->done : 0);
    if (fwrite(data, 1, n_bytes, w->fp) != n_bytes) {
        w->failed = 1;
        return dsv4_err_set(DSV4_ERR_SYS, "%s: tensor '%s': write: %s", w->path,
                            w->names[w->cur], strerror(errno));
    }
    w->done += n_bytes;
    writer_advance(w);
    return DSV4_OK;
}

enum dsv4_err
dsv4_st_writer_close(struct dsv4_st_writer *w)
{
    enum dsv4_err err = DSV4_OK;
    FILE *fp;

    if (w == NULL)
        return DSV4_OK;
    if (w->cur < w->n)
        err = dsv4_err_set(DSV4_ERR_INVAL, "%s: tensor '%s': only %zu of %zu bytes written",
                           w->path, w->names[w->cur], w->done, w->sizes[w->cur]);
    fp = w->fp;
    w->fp = NULL;
    if (fclose(fp) != 0 && err == DSV4_OK)
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: close: %s", w->tmp, strerror(errno));
    if (w->failed && err == DSV4_OK)
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: an earlier write failed", w->path);
    if (err == DSV4_OK && rename(w->tmp, w->path) != 0)
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: rename from %s: %s", w->path, w->tmp,
                           strerror(errno));
    if (err != DSV4_OK)
        unlink(w->tmp);   /* never leave a file that looks complete but is not */
    writer_free(w);
    return err;
}
