/*
 * weights_share.c — see weights_share.h.  The server is one thread per
 * process running a poll loop over a stop pipe and, while it owns the path,
 * the listening socket; a connection is answered inline (bounded waits), as
 * there are at most a few per rank start.
 *
 * Claiming the path: bind a socket to a temporary name beside it, make it
 * 0600, listen, rename(2) it over the path (atomic: a client sees the old
 * socket or the new one, never no file), remember the inode.  A server whose
 * path no longer has that inode has been replaced (or the file removed) and
 * stands by again.
 */
#include "common/weights_share.h"

#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define WS_REQ_FETCH 'F'   /* client request: send the descriptor */
#define WS_IO_MS 5000      /* bound of one request/answer exchange */
#define WS_TMP_EXTRA 32    /* room for ".<pid>.<n>.tmp" after the path */

struct dsv4_wshare_server {
    pthread_t thread;
    int wake[2];                 /* pipe: a byte (or close) stops the thread */
    int fd;                      /* the served descriptor (our dup) */
    int lfd;                     /* listening socket while serving, else -1 */
    dev_t dev;                   /* the path's inode when claimed */
    ino_t ino;
    atomic_int serving;
    bool claim_failed;           /* the last claim failed (said once, then quiet) */
    unsigned serial;             /* temporary name of this server */
    struct dsv4_wshare_hdr hdr;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

static atomic_uint ws_serial;

static int64_t
ws_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void
ws_sleep_ms(int ms)
{
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000 };

    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* --- names ---------------------------------------------------------------------- */

enum dsv4_err
dsv4_wshare_dir(char *buf, size_t n, const char *share_dir, const char *rank_endpoint)
{
    const char *p, *slash;
    size_t len;

    if (share_dir != NULL && share_dir[0] != '\0') {
        p = share_dir;
        len = strlen(p);
    } else if (rank_endpoint != NULL && strncmp(rank_endpoint, "ipc://", 6) == 0) {
        p = rank_endpoint + 6;
        slash = strrchr(p, '/');
        if (slash == NULL)
            p = ".", len = 1;
        else if (slash == p)
            len = 1;   /* "/" */
        else
            len = (size_t)(slash - p);
    } else {
        p = DSV4_WSHARE_DEFAULT_DIR;
        len = strlen(p);
    }
    if (len + 1 > n)
        return dsv4_err_set(DSV4_ERR_CONFIG, "weights share: directory name too long");
    memcpy(buf, p, len);
    buf[len] = '\0';
    return DSV4_OK;
}

enum dsv4_err
dsv4_wshare_path(char *buf, size_t n, const char *dir, const uint8_t gpu_uuid[16],
                 uint64_t fingerprint, unsigned group_rank, unsigned group_size)
{
    size_t max = sizeof(((struct sockaddr_un *)0)->sun_path) - WS_TMP_EXTRA;
    char gpu[17];
    int len;

    for (int i = 0; i < 8; i++)
        snprintf(gpu + 2 * i, 3, "%02x", gpu_uuid[i]);
    len = snprintf(buf, n, "%s%sweights-%s-%08x-p%uof%u.sock", dir,
                   dir[0] != '\0' && dir[strlen(dir) - 1] == '/' ? "" : "/", gpu,
                   (unsigned)(fingerprint & 0xffffffffu), group_rank, group_size);
    if (len < 0 || (size_t)len >= n || (size_t)len >= max)
        return dsv4_err_set(DSV4_ERR_CONFIG, "weights share: socket path in %s too long "
                            "(at most %zu bytes)", dir, max - 1);
    return DSV4_OK;
}

/* --- fingerprints --------------------------------------------------------------- */

uint64_t
dsv4_wshare_hash(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;

    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

uint64_t
dsv4_wshare_fingerprint(const struct dsv4_config *c, const char *source, int group_rank,
                        int group_size)
{
    int32_t v[] = {
        c->vocab_size, c->hidden_size, c->num_hidden_layers, c->num_attention_heads,
        c->num_key_value_heads, c->head_dim, c->qk_rope_head_dim, c->q_lora_rank,
        c->o_groups, c->o_lora_rank, c->index_n_heads, c->index_head_dim,
        c->n_routed_experts, c->num_experts_per_tok, c->n_shared_experts,
        c->moe_intermediate_size, c->num_hash_layers, c->hc_mult,
        c->num_nextn_predict_layers, group_rank, group_size,
    };
    int n_ratios = c->num_hidden_layers + c->num_nextn_predict_layers;
    uint64_t h = DSV4_WSHARE_FNV0;

    h = dsv4_wshare_hash(h, v, sizeof(v));
    if (n_ratios > DSV4_MAX_LAYERS)
        n_ratios = DSV4_MAX_LAYERS;
    if (n_ratios > 0)
        h = dsv4_wshare_hash(h, c->compress_ratios, (size_t)n_ratios * sizeof(int32_t));
    h = dsv4_wshare_hash(h, c->expert_dtype, strnlen(c->expert_dtype,
                                                     sizeof(c->expert_dtype)));
    h = dsv4_wshare_hash(h, "|", 1);
    return dsv4_wshare_hash(h, source, strlen(source));
}

enum dsv4_err
dsv4_wshare_match(const struct dsv4_wshare_hdr *got, uint64_t fingerprint, const uint8_t uuid[16])
{
    if (got->fingerprint != fingerprint)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "weights share: %.31s holds other weights "
                            "(fingerprint %016llx, ours %016llx: config, source or group "
                            "part differ)", got->owner, (unsigned long long)got->fingerprint,
                            (unsigned long long)fingerprint);
    if (memcmp(got->device_uuid, uuid, sizeof(got->device_uuid)) != 0)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "weights share: %.31s's weights are on "
                            "another GPU", got->owner);
    if (got->used_bytes > got->alloc_bytes)
        return dsv4_err_set(DSV4_ERR_WEIGHTS, "weights share: %.31s: %llu bytes used of an "
                            "allocation of %llu", got->owner,
                            (unsigned long long)got->used_bytes,
                            (unsigned long long)got->alloc_bytes);
    return DSV4_OK;
}

/* --- start-up lock ------------------------------------------------------------------ */

enum dsv4_err
dsv4_wshare_lock(const char *path, int wait_ms, int *lockfd)
{
    char name[sizeof(((struct sockaddr_un *)0)->sun_path) + 8];
    int64_t deadline = ws_now_ms() + (wait_ms > 0 ? wait_ms : 0);
    int fd;

    *lockfd = -1;
    if ((size_t)snprintf(name, sizeof(name), "%s.lock", path) >= sizeof(name))
        return dsv4_err_set(DSV4_ERR_CONFIG, "weights share: %s: name too long", path);
    fd = open(name, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return dsv4_err_set(DSV4_ERR_SYS, "weights share: %s: %s", name, strerror(errno));
    for (;;) {
        int64_t left;

        if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
            *lockfd = fd;
            return DSV4_OK;
        }
        if (errno != EWOULDBLOCK && errno != EINTR) {
            int e = errno;

            close(fd);
            return dsv4_err_set(DSV4_ERR_SYS, "weights share: flock %s: %s", name,
                                strerror(e));
        }
        left = deadline - ws_now_ms();
        if (left <= 0) {
            close(fd);
            return dsv4_err_set(DSV4_ERR_TIMEOUT, "weights share: %s held by another "
                                "process", name);
        }
        ws_sleep_ms(left < 50 ? (int)left : 50);
    }
}

void
dsv4_wshare_unlock(int lockfd)
{
    if (lockfd >= 0)
        close(lockfd);   /* releases the flock */
}

/* --- client ---------------------------------------------------------------------------- */

/* A connected (blocking) socket to `path`, or -1 with errno: EAGAIN when
 * the listener's backlog is full (a server that stopped accepting: frozen,
 * stopped, dumping core), at once, not once it accepts again. */
static int
ws_connect(const char *path)
{
    struct sockaddr_un sa;
    int fd, e;

    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(sa.sun_path)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(sa.sun_path, path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
        e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static void
ws_timeouts(int fd, int ms)
{
    struct timeval tv = { ms / 1000, (ms % 1000) * 1000 };

    (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    (void)setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

/* Receive the header and the descriptor on c. */
static enum dsv4_err
ws_receive(int c, const char *path, int *fd, struct dsv4_wshare_hdr *hdr)
{
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } cm;
    struct iovec iov = { hdr, sizeof(*hdr) };
    struct msghdr mh;
    struct cmsghdr *ch;
    size_t got = 0;
    ssize_t n;
    int rfd = -1, n_fd = 0;

    memset(&mh, 0, sizeof(mh));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cm.buf;
    mh.msg_controllen = sizeof(cm.buf);
    n = recvmsg(c, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0)
        return dsv4_err_set(errno == EAGAIN ? DSV4_ERR_TIMEOUT : DSV4_ERR_SYS,
                            "weights share: %s: receive: %s", path, strerror(errno));
    /* every descriptor received is ours to close: an answer of more than
     * one (two fit the buffer) is refused, and none of them stays open */
    for (ch = CMSG_FIRSTHDR(&mh); ch != NULL; ch = CMSG_NXTHDR(&mh, ch)) {
        if (ch->cmsg_level != SOL_SOCKET || ch->cmsg_type != SCM_RIGHTS)
            continue;
        for (size_t i = 0; i < (ch->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
            int one;

            memcpy(&one, CMSG_DATA(ch) + i * sizeof(int), sizeof(int));
            if (rfd >= 0)
                close(rfd);
            rfd = one;
            n_fd++;
        }
    }
    if (n_fd > 1) {
        close(rfd);
        return dsv4_err_set(DSV4_ERR_PROTO, "weights share: %s: malformed answer (%d "
                            "descriptors)", path, n_fd);
    }
    got = (size_t)n;
    while (n > 0 && got < sizeof(*hdr)) {
        n = recv(c, (char *)hdr + got, sizeof(*hdr) - got, 0);
        if (n > 0)
            got += (size_t)n;
    }
    if ((mh.msg_flags & MSG_CTRUNC) != 0 || rfd < 0 || got < sizeof(*hdr) ||
        hdr->magic != DSV4_WSHARE_MAGIC || hdr->version != DSV4_WSHARE_VERSION) {
        const char *why = (mh.msg_flags & MSG_CTRUNC) != 0 ? "unexpected descriptors" :
                          rfd < 0 ? "no descriptor" :
                          got < sizeof(*hdr) ? "short header" :
                          hdr->magic != DSV4_WSHARE_MAGIC ? "bad magic" : "other version";

        if (rfd >= 0)
            close(rfd);
        return dsv4_err_set(DSV4_ERR_PROTO, "weights share: %s: malformed answer (%s)", path,
                            why);
    }
    hdr->owner[sizeof(hdr->owner) - 1] = '\0';
    *fd = rfd;
    return DSV4_OK;
}

enum dsv4_err
dsv4_wshare_fetch(const char *path, int wait_ms, int *fd, struct dsv4_wshare_hdr *hdr)
{
    int64_t deadline = ws_now_ms() + (wait_ms > 0 ? wait_ms : 0);
    char req = WS_REQ_FETCH;
    enum dsv4_err e;
    int c;

    *fd = -1;
    memset(hdr, 0, sizeof(*hdr));
    for (;;) {
        int64_t left;

        c = ws_connect(path);
        if (c >= 0)
            break;
        if (errno == ENOENT)
            return dsv4_err_set(DSV4_ERR_TIMEOUT, "weights share: %s: nobody serves", path);
        if (errno != ECONNREFUSED && errno != EAGAIN && errno != EINTR)
            return dsv4_err_set(DSV4_ERR_SYS, "weights share: connect %s: %s", path,
                                strerror(errno));
        left = deadline - ws_now_ms();
        if (left <= 0)
            return dsv4_err_set(DSV4_ERR_TIMEOUT, "weights share: %s: nobody answers", path);
        ws_sleep_ms(left < 50 ? (int)left : 50);
    }
    ws_timeouts(c, WS_IO_MS);
    /* as the server asks of its clients: a process of our user, so that no
     * other user's socket at the path lends us its memory to run */
    {
        struct ucred cred;
        socklen_t clen = sizeof(cred);

        if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 ||
            cred.uid != geteuid()) {
            e = dsv4_err_set(DSV4_ERR_PROTO, "weights share: %s: served by uid %d, not ours "
                             "(%d): not fetched", path, (int)cred.uid, (int)geteuid());
            close(c);
            return e;
        }
    }
    if (send(c, &req, 1, MSG_NOSIGNAL) != 1) {
        e = dsv4_err_set(DSV4_ERR_SYS, "weights share: %s: send: %s", path, strerror(errno));
        close(c);
        return e;
    }
    e = ws_receive(c, path, fd, hdr);
    close(c);
    return e;
}

/* --- server ------------------------------------------------------------------------------ */

/* Give up the path (it is someone else's now, or we stop). */
static void
ws_release(struct dsv4_wshare_server *s)
{
    if (s->lfd >= 0)
        close(s->lfd);
    s->lfd = -1;
    atomic_store(&s->serving, 0);
}

/* Take the path when nobody answers on it. */
static void
ws_claim(struct dsv4_wshare_server *s)
{
    struct sockaddr_un sa;
    struct stat st;
    int c, lfd;

    c = ws_connect(s->path);
    if (c >= 0) {
        close(c);   /* a live server: stand by */
        return;
    }
    if (errno == EAGAIN || errno == EINTR)
        return;     /* a live server with a full backlog, or try again */
    if (errno != ENOENT && errno != ECONNREFUSED) {
        /* the path cannot be reached (EACCES, ENOTDIR, ...): neither a live
         * server nor a stale file, so not claimed; said once, as below,
         * or the process would say it shares and never serve */
        if (!s->claim_failed)
            log_warn("weights share: cannot serve %s: connect (trying again, quietly)",
                     s->path);
        s->claim_failed = true;
        return;
    }
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    {
        char tmp[sizeof(s->path) + WS_TMP_EXTRA];
        int n = snprintf(tmp, sizeof(tmp), "%s.%d.%u.tmp", s->path, (int)getpid(), s->serial);

        if (n < 0 || (size_t)n >= sizeof(sa.sun_path))
            return;   /* dsv4_wshare_serve checked the length */
        memcpy(sa.sun_path, tmp, (size_t)n + 1);
    }
    (void)unlink(sa.sun_path);
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (lfd < 0)
        return;
    /* the inode is taken from the name bound, before the rename: a stat of
     * s->path after it could see another standby's socket renamed over
     * ours in between (rename keeps the inode) */
    if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || chmod(sa.sun_path, 0600) != 0 ||
        listen(lfd, 16) != 0 || stat(sa.sun_path, &st) != 0 ||
        rename(sa.sun_path, s->path) != 0) {
        if (!s->claim_failed)   /* retried every poll: said once */
            log_warn("weights share: cannot serve %s (trying again, quietly)", s->path);
        s->claim_failed = true;
        (void)unlink(sa.sun_path);
        close(lfd);
        return;
    }
    s->claim_failed = false;
    s->dev = st.st_dev;
    s->ino = st.st_ino;
    s->lfd = lfd;
    atomic_store(&s->serving, 1);
    log_info("weights share: serving %s", s->path);
}

/* Still ours?  Else stand by. */
static void
ws_check_owner(struct dsv4_wshare_server *s)
{
    struct stat st;

    if (stat(s->path, &st) == 0 && st.st_dev == s->dev && st.st_ino == s->ino)
        return;
    log_info("weights share: %s taken over by another process; standing by", s->path);
    ws_release(s);
}

/* Answer one connection: 'F' from a process of our uid gets the descriptor. */
static void
ws_answer(struct dsv4_wshare_server *s)
{
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } cm;
    struct iovec iov = { &s->hdr, sizeof(s->hdr) };
    struct pollfd pf;
    struct msghdr mh;
    struct cmsghdr *ch;
    struct ucred cred;
    socklen_t clen = sizeof(cred);
    char req = 0;
    int c;

    c = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0)
        return;
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || cred.uid != geteuid()) {
        log_warnx("weights share: %s: refused a client of another user", s->path);
        close(c);
        return;
    }
    pf.fd = c;
    pf.events = POLLIN;
    if (poll(&pf, 1, WS_IO_MS) != 1 || read(c, &req, 1) != 1 || req != WS_REQ_FETCH) {
        close(c);   /* a probe, or nothing asked */
        return;
    }
    memset(&mh, 0, sizeof(mh));
    memset(&cm, 0, sizeof(cm));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cm.buf;
    mh.msg_controllen = sizeof(cm.buf);
    ch = CMSG_FIRSTHDR(&mh);
    ch->cmsg_level = SOL_SOCKET;
    ch->cmsg_type = SCM_RIGHTS;
    ch->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(ch), &s->fd, sizeof(int));
    ws_timeouts(c, WS_IO_MS);
    if (sendmsg(c, &mh, MSG_NOSIGNAL) != (ssize_t)sizeof(s->hdr))
        log_warn("weights share: %s: send to pid %d", s->path, (int)cred.pid);
    else
        log_info("weights share: handed the weights to pid %d", (int)cred.pid);
    close(c);
}

static void *
ws_thread(void *arg)
{
    struct dsv4_wshare_server *s = arg;

    for (;;) {
        struct pollfd pf[2];
        int n = 1;

        if (s->lfd < 0)
            ws_claim(s);
        pf[0].fd = s->wake[0];
        pf[0].events = POLLIN;
        pf[0].revents = 0;
        if (s->lfd >= 0) {
            pf[1].fd = s->lfd;
            pf[1].events = POLLIN;
            pf[1].revents = 0;
            n = 2;
        }
        if (poll(pf, (nfds_t)n, DSV4_WSHARE_POLL_MS) < 0 && errno != EINTR)
            break;
        if (pf[0].revents != 0)
            break;
        if (n == 2 && (pf[1].revents & POLLIN) != 0)
            ws_answer(s);
        if (s->lfd >= 0)
            ws_check_owner(s);
    }
    return NULL;
}

enum dsv4_err
dsv4_wshare_serve(struct dsv4_wshare_server **out, const char *path, int fd,
                  const struct dsv4_wshare_hdr *hdr)
{
    struct dsv4_wshare_server *s;
    int rc;

    *out = NULL;
    if (strlen(path) + WS_TMP_EXTRA > sizeof(s->path))
        return dsv4_err_set(DSV4_ERR_CONFIG, "weights share: %s: path too long", path);
    s = calloc(1, sizeof(*s));
    if (s == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "weights share: no memory");
    s->lfd = -1;
    s->wake[0] = s->wake[1] = -1;
    s->hdr = *hdr;
    s->hdr.magic = DSV4_WSHARE_MAGIC;
    s->hdr.version = DSV4_WSHARE_VERSION;
    s->hdr.owner[sizeof(s->hdr.owner) - 1] = '\0';
    s->serial = atomic_fetch_add(&ws_serial, 1);
    strcpy(s->path, path);
    s->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (s->fd < 0 || pipe2(s->wake, O_CLOEXEC) != 0) {
        enum dsv4_err e = dsv4_err_set(DSV4_ERR_SYS, "weights share: %s", strerror(errno));

        if (s->fd >= 0)
            close(s->fd);
        free(s);
        return e;
    }
    ws_claim(s);
    rc = pthread_create(&s->thread, NULL, ws_thread, s);
    if (rc != 0) {
        if (s->lfd >= 0)
            (void)unlink(s->path);
        ws_release(s);
        close(s->wake[0]);
        close(s->wake[1]);
        close(s->fd);
        free(s);
        return dsv4_err_set(DSV4_ERR_SYS, "weights share: thread: %s", strerror(rc));
    }
    *out = s;
    return DSV4_OK;
}

int
dsv4_wshare_serving(struct dsv4_wshare_server *s)
{
    return s != NULL && atomic_load(&s->serving) != 0;
}

void
dsv4_wshare_stop(struct dsv4_wshare_server *s)
{
    struct stat st;

    if (s == NULL)
        return;
    close(s->wake[1]);   /* POLLHUP on wake[0] */
    pthread_join(s->thread, NULL);
    if (s->lfd >= 0 && stat(s->path, &st) == 0 && st.st_dev == s->dev && st.st_ino == s->ino)
        (void)unlink(s->path);
    ws_release(s);
    close(s->wake[0]);
    close(s->fd);
    free(s);
}
