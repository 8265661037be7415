/*
 * comm_shm.c — the shm group of kernels/comm.h: ranks are processes on one
 * host whose backend memory the host can read (the CPU backend).
 *
 * One POSIX shared-memory segment per group: a header with a barrier (an
 * arrival count and a generation number, both atomic) and one slot of
 * max_bytes per rank.  A reduction: each rank copies its buffer into its
 * slot; barrier; each rank reduces all slots in rank order into private
 * scratch; barrier (nobody reads a slot any more); each copies the result
 * back.  Waits spin briefly, then sleep 20 µs at a time, up to the group's
 * timeout; a timeout or an abort marks the group broken for every rank.
 * The name is unlinked by every rank as soon as every rank has mapped the
 * segment (at the end of create), and by any rank whose creation fails, so
 * a group that does not assemble (rank 0 killed while it waits) leaves
 * nothing in /dev/shm once its other ranks give up.  One whose rank 0 was
 * killed before any peer opened the name (both killed while it formed)
 * is left: a name older than SHM_STALE_S is swept by the next id made on
 * the host (dsv4_comm_shm_unique_id; a name lives only while its group
 * forms, at most the join's timeout).  Rank 0 reserves the
 * segment's pages (posix_fallocate): a full /dev/shm is an error at
 * create, not a SIGBUS at the first collective.
 */
#include "kernels/comm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SHM_MAGIC 0x3130434d4d4f4344ull   /* "DCOMMC01" */
#define SHM_MAX_RANKS 64
#define SHM_PREFIX "dsv4comm-"
#define SHM_STALE_S 600    /* a name this old outlived any join (60 s at most) */

struct shm_hdr {
    _Atomic uint64_t magic;     /* set last by rank 0 */
    int32_t size;
    uint64_t max_bytes;
    _Atomic uint32_t count;     /* arrivals in the current generation */
    _Atomic uint32_t gen;       /* barrier generation */
    _Atomic uint32_t broken;    /* a rank timed out or aborted */
    _Atomic uint32_t joined;    /* ranks that mapped the segment */
    int64_t n[SHM_MAX_RANKS];   /* element counts of the collective */
};

struct shm_rank {
    struct shm_hdr *h;
    size_t map_bytes;
    char *slots;                /* size * max_bytes after the header */
    void *scratch;
    int timeout_ms;
    const struct dsv4_comm_stop *stop;  /* during the creation only, else NULL */
    int timed_out;              /* a wait of this rank reached its deadline */
    char name[64];
};

/* The creation's `stop` says to give up. */
static int
shm_stopped(const struct shm_rank *sr)
{
    return sr->stop != NULL && sr->stop->fn(sr->stop->arg);
}

static int64_t
now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait for the generation to move past `gen`; false on timeout or abort. */
static int
shm_wait(struct shm_rank *sr, uint32_t gen)
{
    int64_t deadline = now_ms() + sr->timeout_ms;
    struct timespec nap = { 0, 20000 };

    for (int spin = 0;; spin++) {
        if (atomic_load(&sr->h->gen) != gen)
            return 1;
        if (atomic_load(&sr->h->broken))
            return 0;
        if (spin < 2000) {
            sched_yield();
            continue;
        }
        if ((spin & 63) == 0 && (now_ms() > deadline || shm_stopped(sr))) {
            sr->timed_out = now_ms() > deadline;
            atomic_store(&sr->h->broken, 1);
            return 0;
        }
        nanosleep(&nap, NULL);
    }
}

static int
shm_barrier(struct shm_rank *sr)
{
    struct shm_hdr *h = sr->h;
    uint32_t gen = atomic_load(&h->gen);

    if (atomic_load(&h->broken))
        return 0;
    if (atomic_fetch_add(&h->count, 1) + 1 == (uint32_t)h->size) {
        atomic_store(&h->count, 0);
        atomic_fetch_add(&h->gen, 1);
        return 1;
    }
    return shm_wait(sr, gen);
}

static enum dsv4_err
shm_reduce(struct dsv4_comm *c, void *x, int64_t n, int min)
{
    struct shm_rank *sr = c->priv;
    struct shm_hdr *h = sr->h;
    size_t es = min ? sizeof(uint64_t) : sizeof(float), bytes = (size_t)n * es;
    int ok;

    if (bytes > h->max_bytes)
        return dsv4_err_set(DSV4_ERR_INVAL, "comm shm: %zu bytes, the group holds %llu", bytes,
                            (unsigned long long)h->max_bytes);
    memcpy(sr->slots + (size_t)c->rank * h->max_bytes, x, bytes);
    h->n[c->rank] = n;
    ok = shm_barrier(sr);
    for (int r = 0; ok && r < c->size; r++)
        ok = h->n[r] == n;
    if (ok && min) {
        uint64_t *o = sr->scratch;

        for (int64_t i = 0; i < n; i++) {
            uint64_t v = ((const uint64_t *)sr->slots)[i];

            for (int r = 1; r < c->size; r++) {
                uint64_t w = ((const uint64_t *)(sr->slots + (size_t)r * h->max_bytes))[i];

                v = w < v ? w : v;
            }
            o[i] = v;
        }
    } else if (ok) {
        float *o = sr->scratch;

        for (int64_t i = 0; i < n; i++) {
            float s = 0.0f;

            for (int r = 0; r < c->size; r++)
                s += ((const float *)(sr->slots + (size_t)r * h->max_bytes))[i];
            o[i] = s;
        }
    }
    if (!ok && atomic_load(&h->broken) == 0) {
        /* every rank arrived, with different counts: a bug, but the group
         * must not go on */
        atomic_store(&h->broken, 1);
        return dsv4_err_set(DSV4_ERR_PROTO, "comm shm: rank %d: the ranks' calls differ (%lld "
                            "values here); the group is broken", c->rank, (long long)n);
    }
    if (ok)
        ok = shm_barrier(sr);
    if (!ok)
        return dsv4_err_set(DSV4_ERR_TIMEOUT, "comm shm: rank %d: the group is broken (a rank "
                            "did not arrive within %d ms, or aborted)", c->rank,
                            sr->timeout_ms);
    memcpy(x, sr->scratch, bytes);
    return DSV4_OK;
}

static enum dsv4_err
shm_allreduce(struct dsv4_comm *c, struct dsv4_backend *be, float *x, int64_t n)
{
    (void)be;
    return shm_reduce(c, x, n, 0);
}

static enum dsv4_err
shm_min_u64(struct dsv4_comm *c, struct dsv4_backend *be, uint64_t *x, int64_t n)
{
    (void)be;
    return shm_reduce(c, x, n, 1);
}

static void
shm_abort(struct dsv4_comm *c)
{
    struct shm_rank *sr = c->priv;

    atomic_store(&sr->h->broken, 1);
}

static void
shm_destroy(struct dsv4_comm *c)
{
    struct shm_rank *sr = c->priv;

    if (sr != NULL) {
        if (sr->h != NULL)
            munmap(sr->h, sr->map_bytes);
        if (sr->name[0] != '\0')
            shm_unlink(sr->name);   /* create failed: the group will not form */
        free(sr->scratch);
        free(sr);
    }
    free(c);
}

static const struct dsv4_comm_ops shm_ops = {
    .allreduce_sum = shm_allreduce,
    .allreduce_min_u64 = shm_min_u64,
    .abort = shm_abort,
    .destroy = shm_destroy,
};

void
dsv4_comm_shm_sweep(const char *dir, int stale_s)
{
    DIR *d = opendir(dir);
    struct dirent *de;
    time_t now = time(NULL);

    if (d == NULL)
        return;
    while ((de = readdir(d)) != NULL) {
        struct stat st;

        if (strncmp(de->d_name, SHM_PREFIX, strlen(SHM_PREFIX)) != 0 ||
            fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISREG(st.st_mode) || st.st_uid != geteuid() || now - st.st_mtime < stale_s)
            continue;
        if (unlinkat(dirfd(d), de->d_name, 0) == 0)
            fprintf(stderr, "comm shm: removed %s/%s, left by a group that never formed "
                    "(%lld s old)\n", dir, de->d_name, (long long)(now - st.st_mtime));
    }
    closedir(d);
}

enum dsv4_err
dsv4_comm_shm_unique_id(uint8_t id[DSV4_COMM_ID_BYTES])
{
    uint64_t r[2];
    FILE *f;

    dsv4_comm_shm_sweep("/dev/shm", SHM_STALE_S);
    f = fopen("/dev/urandom", "rb");
    if (f == NULL || fread(r, sizeof(r), 1, f) != 1) {
        if (f != NULL)
            fclose(f);
        return dsv4_err_set(DSV4_ERR_SYS, "comm shm: /dev/urandom: %s", strerror(errno));
    }
    fclose(f);
    memset(id, 0, DSV4_COMM_ID_BYTES);
    snprintf((char *)id, DSV4_COMM_ID_BYTES, "/" SHM_PREFIX "%016llx%016llx",
             (unsigned long long)r[0], (unsigned long long)r[1]);
    return DSV4_OK;
}

enum dsv4_err
dsv4_comm_shm_create(struct dsv4_comm **out, int rank, int size,
                     const uint8_t id[DSV4_COMM_ID_BYTES], size_t max_bytes, int timeout_ms,
                     const struct dsv4_comm_stop *stop)
{
    struct dsv4_comm *c;
    struct shm_rank *sr;
    size_t hb = (sizeof(struct shm_hdr) + 63) / 64 * 64;
    int64_t deadline = now_ms() + timeout_ms;
    int fd = -1;

    *out = NULL;
    if (size < 1 || size > SHM_MAX_RANKS || rank < 0 || rank >= size || max_bytes == 0 ||
        memchr(id, '\0', DSV4_COMM_ID_BYTES) == NULL || id[0] != '/')
        return dsv4_err_set(DSV4_ERR_INVAL, "comm shm: rank %d of %d, %zu bytes, or a bad id",
                            rank, size, max_bytes);
    c = calloc(1, sizeof(*c));
    sr = calloc(1, sizeof(*sr));
    if (c == NULL || sr == NULL || (sr->scratch = malloc(max_bytes)) == NULL) {
        free(c);
        if (sr != NULL)
            free(sr->scratch);
        free(sr);
        return dsv4_err_set(DSV4_ERR_NOMEM, "comm shm: no memory");
    }
    c->ops = &shm_ops;
    c->rank = rank;
    c->size = size;
    c->priv = sr;
    sr->timeout_ms = timeout_ms;
    sr->stop = stop;
    snprintf(sr->name, sizeof(sr->name), "%s", (const char *)id);
    sr->map_bytes = hb + (size_t)size * max_bytes;
    if (rank == 0) {
        int rc = 0;

        fd = shm_open(sr->name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd >= 0 && (ftruncate(fd, (off_t)sr->map_bytes) != 0 ||
                        (rc = posix_fallocate(fd, 0, (off_t)sr->map_bytes)) != 0)) {
            if (rc != 0)
                errno = rc;   /* posix_fallocate returns its error */
            dsv4_err_set(DSV4_ERR_SYS, "comm shm: %s: %zu bytes: %s (is /dev/shm full?)",
                         (const char *)id, sr->map_bytes, strerror(errno));
            close(fd);
            shm_destroy(c);
            return DSV4_ERR_SYS;
        }
    } else {
        while ((fd = shm_open((const char *)id, O_RDWR, 0)) < 0 && errno == ENOENT &&
               now_ms() < deadline && !shm_stopped(sr))
            usleep(2000);
    }
    if (fd < 0 && errno == ENOENT && shm_stopped(sr))
        goto stopped;
    if (fd < 0 && errno == EEXIST)
        sr->name[0] = '\0';  /* someone else's: not ours to unlink */
    if (fd < 0) {
        dsv4_err_set(DSV4_ERR_SYS, "comm shm: rank %d: %s: %s", rank, (const char *)id,
                     strerror(errno));
        shm_destroy(c);
        return DSV4_ERR_SYS;
    }
    /* rank 0 truncated it; another rank may see it before that: wait */
    for (;;) {
        off_t end = lseek(fd, 0, SEEK_END);

        if (end > 0 && end != (off_t)sr->map_bytes) {
            /* sized by a rank with other calls: one size for all; the
             * group is marked broken, so that the others stop waiting */
            size_t theirs = ((size_t)end - hb) / (size_t)size;
            struct shm_hdr *h = (size_t)end >= hb ?
                mmap(NULL, hb, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;

            if (h != MAP_FAILED) {
                atomic_store(&h->broken, 1);
                munmap(h, hb);
            }
            close(fd);
            shm_destroy(c);
            return dsv4_err_set(DSV4_ERR_CONFIG, "comm shm: %s: the ranks' largest calls "
                                "differ (%zu bytes at rank 0, %zu here)", (const char *)id,
                                theirs, max_bytes);
        }
        if (end > 0)
            break;
        if (now_ms() > deadline) {
            /* rank 0 made it and never sized it (killed in between):
             * mapping it would fault (SIGBUS) at the first read */
            close(fd);
            shm_destroy(c);
            return dsv4_err_set(DSV4_ERR_TIMEOUT, "comm shm: rank %d: %s was never sized by "
                                "rank 0 within %d ms", rank, (const char *)id, timeout_ms);
        }
        if (shm_stopped(sr)) {
            close(fd);
            goto stopped;
        }
        usleep(1000);
    }
    sr->h = mmap(NULL, sr->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (sr->h == MAP_FAILED) {
        sr->h = NULL;
        dsv4_err_set(DSV4_ERR_SYS, "comm shm: mmap: %s", strerror(errno));
        shm_destroy(c);
        return DSV4_ERR_SYS;
    }
    sr->slots = (char *)sr->h + hb;
    if (rank == 0) {
        sr->h->size = size;
        sr->h->max_bytes = max_bytes;
        atomic_store(&sr->h->magic, SHM_MAGIC);
    } else {
        while (atomic_load(&sr->h->magic) != SHM_MAGIC && now_ms() < deadline) {
            if (shm_stopped(sr))
                goto stopped;
            usleep(1000);
        }
        if (atomic_load(&sr->h->magic) != SHM_MAGIC || sr->h->size != size ||
            sr->h->max_bytes != max_bytes) {
            atomic_store(&sr->h->broken, 1);
            shm_destroy(c);
            return dsv4_err_set(DSV4_ERR_PROTO, "comm shm: %s is not a group of %d ranks of "
                                "%zu bytes", (const char *)id, size, max_bytes);
        }
    }
    atomic_fetch_add(&sr->h->joined, 1);
    if (!shm_barrier(sr)) {
        int late = sr->timed_out;

        if (shm_stopped(sr))
            goto stopped;
        shm_destroy(c);
        if (!late)
            return dsv4_err_set(DSV4_ERR_TIMEOUT, "comm shm: rank %d: the group broke while "
                                "it assembled (a rank refused it or gave up: its log says "
                                "why)", rank);
        return dsv4_err_set(DSV4_ERR_TIMEOUT, "comm shm: rank %d: the group did not assemble "
                            "within %d ms", rank, timeout_ms);
    }
    sr->stop = NULL;   /* the caller's, valid during the creation only */
    shm_unlink(sr->name);   /* every rank has it mapped (ENOENT: another rank's unlink) */
    sr->name[0] = '\0';
    *out = c;
    return DSV4_OK;
stopped:
    if (sr->h != NULL)
        atomic_store(&sr->h->broken, 1);   /* the ranks that joined give up too */
    shm_destroy(c);
    return dsv4_err_set(DSV4_ERR_CANCELED, "comm shm: rank %d: %s: the join was stopped", rank,
                        (const char *)id);
}
