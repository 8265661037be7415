/*
 * kv_shm.c — the `shm` decode-state transport (ipc/kvxfer.h): POSIX shared
 * memory objects on one host, for the CPU backend.
 *
 * Names: "/dsv4kv-<owner>-<req>-<n>", where <owner> is the exporting
 * process's tag ("prefill-3"), <req> the request and <n> the process's
 * export counter, so names are unique per rank and request even when a
 * request is re-run on the same rank.  The handle on the wire is the name
 * without a terminating NUL.  Objects are created 0600 (exporter and importer
 * run as the same service user), sized with posix_fallocate so a full
 * /dev/shm is an error now instead of a SIGBUS later, and unlinked when the
 * region is freed; an importer's mapping stays valid after the unlink.
 *
 * A crashed exporter leaves its objects behind; cleanup_stale lists
 * /dev/shm (Linux tmpfs, where glibc puts POSIX shm objects) for names of
 * this owner and unlinks them.  Importers accept only names with the
 * "/dsv4kv-" prefix, so a forged descriptor cannot map arbitrary objects.
 *
 * Runs in a rank's main thread.
 */
#include "ipc/kvxfer.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"

#define SHM_PREFIX "dsv4kv-"   /* object names, after the leading '/' */
#define SHM_DIR "/dev/shm"     /* where glibc keeps POSIX shm objects */
#define SHM_NAME_MAX 255       /* NAME_MAX of the object name */
#define SHM_MODE 0600          /* object permissions */
#define SHM_RETRIES 8          /* name collisions tolerated on export */

/* Write "/dsv4kv-<owner>-<req>-<n>" into name; returns its length. */
static int
shm_name(char *name, size_t cap, const char *owner, uint64_t req, uint64_t n)
{
    return snprintf(name, cap, "/" SHM_PREFIX "%s-%" PRIu64 "-%" PRIu64, owner, req, n);
}

static enum dsv4_err
shm_export_region(struct dsv4_kvx *x, uint64_t req, uint64_t size, struct dsv4_kvx_region *r)
{
    char name[SHM_NAME_MAX + 1];
    int fd = -1, len = 0, err;
    void *p;

    if (size > (uint64_t)SIZE_MAX || size > (uint64_t)INT64_MAX)
        return dsv4_err_set(DSV4_ERR_INVAL, "kv_shm: region of %" PRIu64 " bytes", size);
    for (int i = 0; i < SHM_RETRIES && fd < 0; i++) {
        len = shm_name(name, sizeof(name), x->owner, req, x->n_exported + (uint64_t)i);
        fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, SHM_MODE);
        if (fd < 0 && errno != EEXIST)
            break;
    }
    if (fd < 0) {
        log_warn("kv_shm_export: shm_open %s", name);
        return dsv4_err_set(DSV4_ERR_SYS, "kv_shm: shm_open %s: %s", name, strerror(errno));
    }
    err = posix_fallocate(fd, 0, (off_t)size);
    if (err != 0) {
        close(fd);
        shm_unlink(name);
        return dsv4_err_set(err == ENOSPC ? DSV4_ERR_NOMEM : DSV4_ERR_SYS,
                            "kv_shm: reserve %" PRIu64 " bytes for %s: %s", size, name,
                            strerror(err));
    }
    p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = errno;
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(name);
        return dsv4_err_set(DSV4_ERR_SYS, "kv_shm: mmap %s: %s", name, strerror(err));
    }
    r->data = p;
    r->size = size;
    r->req = req;
    r->desc.transport = DSV4_TRANSPORT_SHM;
    memcpy(r->desc.handle, name, (size_t)len);
    r->desc.handle_len = (uint32_t)len;
    r->desc.size = size;
    r->priv = NULL;
    return DSV4_OK;
}

/* The handle as a NUL-terminated name, or -1 when it is not one of ours. */
static int
shm_handle_name(const struct dsv4_kvx_desc *d, char name[SHM_NAME_MAX + 1])
{
    size_t pre = strlen("/" SHM_PREFIX);

    if (d->handle_len <= pre || d->handle_len > SHM_NAME_MAX)
        return -1;
    if (memcmp(d->handle, "/" SHM_PREFIX, pre) != 0)
        return -1;
    for (uint32_t i = 1; i < d->handle_len; i++) {
        uint8_t c = d->handle[i];
        if (c == '/' || c <= ' ' || c >= 0x7f)
            return -1;
    }
    memcpy(name, d->handle, d->handle_len);
    name[d->handle_len] = '\0';
    return 0;
}

static void
shm_free_region(struct dsv4_kvx *x, struct dsv4_kvx_region *r)
{
    char name[SHM_NAME_MAX + 1];

    (void)x;
    munmap(r->data, (size_t)r->size);
    if (shm_handle_name(&r->desc, name) == 0 && shm_unlink(name) != 0)
        log_warn("kv_shm_free: shm_unlink %s", name);
}

static enum dsv4_err
shm_import_map(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d, struct dsv4_kvx_map *m)
{
    char name[SHM_NAME_MAX + 1];
    struct stat st;
    void *p;
    int fd, err;

    (void)x;
    if (shm_handle_name(d, name) != 0)
        return dsv4_err_set(DSV4_ERR_PROTO, "kv_shm: handle is not a dsv4 shm name");
    /* O_NONBLOCK: the name is a descriptor's word, and /dev/shm is every
     * local user's; a FIFO under it blocked the rank's loop for ever (the
     * import is synchronous, out of its timeout's reach) */
    fd = shm_open(name, O_RDONLY | O_NONBLOCK, 0);
    if (fd < 0)
        return dsv4_err_set(DSV4_ERR_SYS, "kv_shm: shm_open %s: %s", name, strerror(errno));
    if (fstat(fd, &st) != 0) {
        err = errno;
        close(fd);
        return dsv4_err_set(DSV4_ERR_SYS, "kv_shm: fstat %s: %s", name, strerror(err));
    }
    if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
        close(fd);
        return dsv4_err_set(DSV4_ERR_PROTO, "kv_shm: %s is %s, not a region of this user's "
                            "ranks", name, !S_ISREG(st.st_mode) ? "not a regular file" :
                            "another user's");
    }
    if (st.st_size <= 0 || (uint64_t)st.st_size < d->size) {
        close(fd);
        return dsv4_err_set(DSV4_ERR_PROTO, "kv_shm: %s has %lld bytes, descriptor says %"
                            PRIu64, name, (long long)st.st_size, d->size);
    }
    p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    err = errno;
    close(fd);
    if (p == MAP_FAILED)
        return dsv4_err_set(DSV4_ERR_SYS, "kv_shm: mmap %s: %s", name, strerror(err));
    m->data = p;
    m->size = (uint64_t)st.st_size;
    m->priv = NULL;
    return DSV4_OK;
}

static void
shm_unmap(struct dsv4_kvx *x, struct dsv4_kvx_map *m)
{
    (void)x;
    munmap((void *)(uintptr_t)m->data, (size_t)m->size);
}

/* True when `rest` is "<digits>-<digits>" and nothing else: the tail of a
 * name of exactly this owner (not of an owner that extends it). */
static int
shm_tail_ours(const char *rest)
{
    int groups = 0;

    for (;;) {
        const char *s = rest;
        while (*rest >= '0' && *rest <= '9')
            rest++;
        if (rest == s)
            return 0;
        groups++;
        if (*rest == '\0')
            return groups == 2;
        if (*rest != '-' || groups == 2)
            return 0;
        rest++;
    }
}

static int
shm_cleanup_stale(struct dsv4_kvx *x)
{
    char prefix[SHM_NAME_MAX + 1], name[SHM_NAME_MAX + 2];
    struct dirent *de;
    size_t pre;
    DIR *dir;
    int n = 0;

    snprintf(prefix, sizeof(prefix), SHM_PREFIX "%s-", x->owner);
    pre = strlen(prefix);
    dir = opendir(SHM_DIR);
    if (dir == NULL) {
        log_warn("kv_shm_cleanup: opendir %s", SHM_DIR);
        return 0;
    }
    while ((de = readdir(dir)) != NULL) {
        if (strncmp(de->d_name, prefix, pre) != 0 || !shm_tail_ours(de->d_name + pre))
            continue;
        snprintf(name, sizeof(name), "/%s", de->d_name);
        if (shm_unlink(name) == 0)
            n++;
        else
            log_warn("kv_shm_cleanup: shm_unlink %s", name);
    }
    closedir(dir);
    return n;
}

const struct dsv4_kvx_ops dsv4_kvx_shm_ops = {
    .export_region = shm_export_region,
    .free_region = shm_free_region,
    .import_map = shm_import_map,
    .unmap = shm_unmap,
    .cleanup_stale = shm_cleanup_stale,
};
