/*
 * test_wshare.c — the weights share socket (common/weights_share.h) without
 * a GPU: the descriptor handed over is a memfd, so "the same weights" means
 * the same file (inode) with the same bytes.
 *
 * Covered: directory and path rules; fingerprints and header matching;
 * hand-over of the descriptor and the header; no server, a stale socket
 * file (a refused connection) and its replacement; a standby server taking
 * over from one killed with SIGKILL (a child process) and from one stopped
 * cleanly; a second server standing by; malformed answers (short, bad
 * magic, no descriptor) refused; the start-up lock held by another open
 * file; faults: a lock file that cannot be opened (an error at once), a
 * socket path connect cannot reach (a warning, once, naming the errno).
 * Every socket lives in a fresh temporary directory.
 */
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/model_config.h"
#include "common/weights_share.h"

#define WAIT_MS 10000   /* generous bound for a takeover; never a pass criterion */

static char dir[64];
static char path[96];
/* two GPUs' UUIDs (the path takes the first 8 bytes) */
static const uint8_t uuid_a[16] = { 0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0xff, 9 };
static const uint8_t uuid_b[16] = { 0xa0, 0xb1, 0xc2, 0xd3, 0xe4, 0xf5, 0x06, 0x17, 1 };

static int
setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof(dir), "/tmp/dsv4ws.XXXXXX");
    assert_non_null(mkdtemp(dir));
    assert_int_equal(dsv4_wshare_path(path, sizeof(path), dir, uuid_a, 0, 1, 2), DSV4_OK);
    return 0;
}

static int
teardown(void **state)
{
    char cmd[128];

    (void)state;
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
    return 0;
}

/* Descriptors this process has open (/proc/self/fd, less the listing's). */
static int
open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    struct dirent *de;
    int n = 0;

    assert_non_null(d);
    while ((de = readdir(d)) != NULL)
        n += de->d_name[0] != '.';
    closedir(d);
    return n - 1;
}

/* A memfd of 4096 bytes filled with `seed` + i. */
static int
make_memfd(unsigned char seed)
{
    unsigned char buf[4096];
    int fd = memfd_create("wshare-test", MFD_CLOEXEC);

    assert_true(fd >= 0);
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (unsigned char)(seed + i);
    assert_int_equal(write(fd, buf, sizeof(buf)), (ssize_t)sizeof(buf));
    return fd;
}

static void
make_hdr(struct dsv4_wshare_hdr *h, const char *owner, uint64_t fp)
{
    memset(h, 0, sizeof(*h));
    h->fingerprint = fp;
    h->alloc_bytes = 4096;
    h->used_bytes = 4000;
    h->layout = 0x1234;
    for (int i = 0; i < 16; i++)
        h->device_uuid[i] = (uint8_t)(0xa0 + i);
    snprintf(h->owner, sizeof(h->owner), "%s", owner);
}

/* The fetched fd is the same file as `fd` and has its bytes. */
static void
assert_same_file(int got, int fd)
{
    struct stat a, b;
    unsigned char x[4096], y[4096];

    assert_int_equal(fstat(got, &a), 0);
    assert_int_equal(fstat(fd, &b), 0);
    assert_true(a.st_ino == b.st_ino && a.st_dev == b.st_dev);
    assert_int_equal(pread(got, x, sizeof(x), 0), (ssize_t)sizeof(x));
    assert_int_equal(pread(fd, y, sizeof(y), 0), (ssize_t)sizeof(y));
    assert_memory_equal(x, y, sizeof(x));
}

static void
test_names(void **state)
{
    char b[128];

    (void)state;
    assert_int_equal(dsv4_wshare_dir(b, sizeof(b), "/srv/x", "ipc:///run/a/rank.sock"),
                     DSV4_OK);
    assert_string_equal(b, "/srv/x");
    assert_int_equal(dsv4_wshare_dir(b, sizeof(b), "", "ipc:///run/a/rank.sock"), DSV4_OK);
    assert_string_equal(b, "/run/a");
    assert_int_equal(dsv4_wshare_dir(b, sizeof(b), "", "ipc:///rank.sock"), DSV4_OK);
    assert_string_equal(b, "/");
    assert_int_equal(dsv4_wshare_dir(b, sizeof(b), "", "ipc://rank.sock"), DSV4_OK);
    assert_string_equal(b, ".");
    assert_int_equal(dsv4_wshare_dir(b, sizeof(b), "", "tcp://10.0.0.1:5555"), DSV4_OK);
    assert_string_equal(b, DSV4_WSHARE_DEFAULT_DIR);
    assert_int_equal(dsv4_wshare_dir(b, 4, "/long/dir", NULL), DSV4_ERR_CONFIG);

    assert_int_equal(dsv4_wshare_path(b, sizeof(b), "/run/dsv4", uuid_a, 0x123456789abcdefull,
                                      1, 2), DSV4_OK);
    assert_string_equal(b, "/run/dsv4/weights-00112233445566ff-89abcdef-p1of2.sock");
    assert_int_equal(dsv4_wshare_path(b, sizeof(b), "/", uuid_b, 7, 0, 1), DSV4_OK);
    assert_string_equal(b, "/weights-a0b1c2d3e4f50617-00000007-p0of1.sock");
    /* longer than a socket address (with room for the temporary name) */
    {
        char longdir[100], big[256];

        memset(longdir, 'd', sizeof(longdir) - 1);
        longdir[0] = '/';
        longdir[sizeof(longdir) - 1] = '\0';
        assert_int_equal(dsv4_wshare_path(big, sizeof(big), longdir, uuid_a, 0, 0, 1),
                         DSV4_ERR_CONFIG);
    }
}

static void
test_fingerprint(void **state)
{
    struct dsv4_config c, c2;
    uint64_t f;

    (void)state;
    assert_int_equal(dsv4_config_preset(&c, "tiny"), DSV4_OK);
    f = dsv4_wshare_fingerprint(&c, "synthetic:3", 0, 1);
    assert_true(f == dsv4_wshare_fingerprint(&c, "synthetic:3", 0, 1));
    assert_true(f != dsv4_wshare_fingerprint(&c, "synthetic:4", 0, 1));
    assert_true(f != dsv4_wshare_fingerprint(&c, "synthetic:3", 1, 2));
    assert_true(f != dsv4_wshare_fingerprint(&c, "synthetic:3", 0, 2));
    c2 = c;
    c2.n_routed_experts *= 2;
    assert_true(f != dsv4_wshare_fingerprint(&c2, "synthetic:3", 0, 1));
    c2 = c;
    c2.compress_ratios[0] = c.compress_ratios[0] == 4 ? 128 : 4;
    assert_true(f != dsv4_wshare_fingerprint(&c2, "synthetic:3", 0, 1));
    /* fields that do not shape the weights do not matter */
    c2 = c;
    c2.rope_theta *= 2;
    assert_true(f == dsv4_wshare_fingerprint(&c2, "synthetic:3", 0, 1));
}

static void
test_match(void **state)
{
    struct dsv4_wshare_hdr h;
    uint8_t uuid[16];

    (void)state;
    make_hdr(&h, "decode@0", 77);
    memcpy(uuid, h.device_uuid, 16);
    assert_int_equal(dsv4_wshare_match(&h, 77, uuid), DSV4_OK);
    assert_int_equal(dsv4_wshare_match(&h, 78, uuid), DSV4_ERR_WEIGHTS);
    assert_non_null(strstr(dsv4_errmsg(), "decode@0"));
    uuid[5] ^= 1;
    assert_int_equal(dsv4_wshare_match(&h, 77, uuid), DSV4_ERR_WEIGHTS);
    uuid[5] ^= 1;
    h.used_bytes = h.alloc_bytes + 1;
    assert_int_equal(dsv4_wshare_match(&h, 77, uuid), DSV4_ERR_WEIGHTS);
}

static void
test_handover(void **state)
{
    struct dsv4_wshare_server *s;
    struct dsv4_wshare_hdr h, got;
    struct stat st;
    int fd = make_memfd(7), gfd = -1;

    (void)state;
    /* nobody serves: an immediate answer */
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_ERR_TIMEOUT);
    assert_int_equal(gfd, -1);

    make_hdr(&h, "prefill@1", 99);
    assert_int_equal(dsv4_wshare_serve(&s, path, fd, &h), DSV4_OK);
    assert_int_equal(dsv4_wshare_serving(s), 1);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    /* the caller may close its own descriptor: the server has a copy */
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_OK);
    assert_same_file(gfd, fd);
    assert_int_equal(got.magic, DSV4_WSHARE_MAGIC);
    assert_int_equal(got.version, DSV4_WSHARE_VERSION);
    assert_true(got.fingerprint == 99 && got.alloc_bytes == 4096 && got.used_bytes == 4000 &&
                got.layout == 0x1234);
    assert_memory_equal(got.device_uuid, h.device_uuid, 16);
    assert_string_equal(got.owner, "prefill@1");
    close(gfd);
    /* again (one connection per fetch) */
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_OK);
    assert_same_file(gfd, fd);
    close(gfd);
    dsv4_wshare_stop(s);
    assert_int_equal(stat(path, &st), -1);   /* removed on a clean stop */
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_ERR_TIMEOUT);
    close(fd);
}

/* A socket file nobody listens on (what a kill -9 leaves). */
static void
make_stale(const char *p)
{
    struct sockaddr_un sa;
    int l = socket(AF_UNIX, SOCK_STREAM, 0);

    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", p);
    assert_int_equal(bind(l, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(l, 1), 0);
    close(l);
}

static void
test_stale(void **state)
{
    struct dsv4_wshare_server *s;
    struct dsv4_wshare_hdr h, got;
    struct stat st;
    int fd = make_memfd(1), gfd = -1;

    (void)state;
    make_stale(path);
    assert_int_equal(stat(path, &st), 0);
    /* refused connections are retried for the wait, then: nobody */
    assert_int_equal(dsv4_wshare_fetch(path, 100, &gfd, &got), DSV4_ERR_TIMEOUT);
    make_hdr(&h, "decode@0", 5);
    assert_int_equal(dsv4_wshare_serve(&s, path, fd, &h), DSV4_OK);
    assert_int_equal(dsv4_wshare_serving(s), 1);   /* replaced the stale file */
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_OK);
    assert_same_file(gfd, fd);
    close(gfd);
    dsv4_wshare_stop(s);
    close(fd);
}

static void
test_standby(void **state)
{
    struct dsv4_wshare_server *a, *b;
    struct dsv4_wshare_hdr h, got;
    int fa = make_memfd(1), fb = make_memfd(2), gfd = -1;

    (void)state;
    make_hdr(&h, "A", 5);
    assert_int_equal(dsv4_wshare_serve(&a, path, fa, &h), DSV4_OK);
    make_hdr(&h, "B", 5);
    assert_int_equal(dsv4_wshare_serve(&b, path, fb, &h), DSV4_OK);
    assert_int_equal(dsv4_wshare_serving(a), 1);
    assert_int_equal(dsv4_wshare_serving(b), 0);   /* A answers: B stands by */
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_OK);
    assert_string_equal(got.owner, "A");
    assert_same_file(gfd, fa);
    close(gfd);
    /* A stops cleanly (removes the path): B takes over */
    dsv4_wshare_stop(a);
    for (int i = 0; i < WAIT_MS / 10 && !dsv4_wshare_serving(b); i++)
        usleep(10000);
    assert_int_equal(dsv4_wshare_serving(b), 1);
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_OK);
    assert_string_equal(got.owner, "B");
    assert_same_file(gfd, fb);
    close(gfd);
    dsv4_wshare_stop(b);
    close(fa);
    close(fb);
}

/* A child process serving `path` (owner "child", a memfd of seed 1), once
 * it serves; the caller stops or kills it. */
static pid_t
spawn_owner(void)
{
    struct dsv4_wshare_hdr h;
    int ready[2];
    pid_t pid;
    char c;

    assert_int_equal(pipe(ready), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct dsv4_wshare_server *a;
        int fa = make_memfd(1);

        close(ready[0]);
        make_hdr(&h, "child", 5);
        if (dsv4_wshare_serve(&a, path, fa, &h) != DSV4_OK || !dsv4_wshare_serving(a))
            _exit(1);
        if (write(ready[1], "r", 1) != 1)
            _exit(1);
        for (;;)
            pause();   /* stopped or killed by the parent */
    }
    close(ready[1]);
    assert_int_equal(read(ready[0], &c, 1), 1);
    close(ready[0]);
    return pid;
}

static void
test_takeover_after_kill(void **state)
{
    struct dsv4_wshare_server *b;
    struct dsv4_wshare_hdr h, got;
    int fb = make_memfd(2), gfd = -1, status;
    pid_t pid;

    (void)state;
    pid = spawn_owner();
    make_hdr(&h, "parent", 5);
    assert_int_equal(dsv4_wshare_serve(&b, path, fb, &h), DSV4_OK);
    assert_int_equal(dsv4_wshare_serving(b), 0);
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_OK);
    assert_string_equal(got.owner, "child");
    close(gfd);
    /* kill -9: the socket file stays; the standby replaces it, a client
     * retries refused connections until then */
    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_OK);
    assert_string_equal(got.owner, "parent");
    assert_same_file(gfd, fb);
    assert_int_equal(dsv4_wshare_serving(b), 1);
    close(gfd);
    dsv4_wshare_stop(b);
    close(fb);
}

/* An owner that stops accepting (SIGSTOP: a debugger, a frozen cgroup, a
 * core being written) with its socket open: the standby's probes fill its
 * backlog, then used to block in connect(), so stopping the standby (a
 * rank's shutdown) and a new rank's fetch hung until the owner ran again.
 * Both end now: the stop at once, the fetch at its wait. */
static void
test_frozen_owner(void **state)
{
    struct dsv4_wshare_server *b;
    struct dsv4_wshare_hdr h, got;
    int fb = make_memfd(2), gfd = -1, status;
    pid_t pid;

    (void)state;
    pid = spawn_owner();
    assert_int_equal(kill(pid, SIGSTOP), 0);
    make_hdr(&h, "parent", 5);
    assert_int_equal(dsv4_wshare_serve(&b, path, fb, &h), DSV4_OK);
    assert_int_equal(dsv4_wshare_serving(b), 0);
    sleep(6);   /* the standby probes every 250 ms: the owner's backlog (16) fills */
    assert_int_equal(dsv4_wshare_fetch(path, 1000, &gfd, &got), DSV4_ERR_TIMEOUT);
    assert_int_equal(gfd, -1);
    dsv4_wshare_stop(b);   /* returns: the test would hang here before */
    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    close(fb);
}

/* --- malformed answers: a fake server thread ------------------------------------ */

enum fake_kind { FAKE_SHORT, FAKE_MAGIC, FAKE_NOFD, FAKE_VERSION, FAKE_TWOFD };

struct fake {
    int lfd;
    enum fake_kind kind;
};

static void *
fake_thread(void *arg)
{
    struct fake *f = arg;
    struct dsv4_wshare_hdr h;
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(2 * sizeof(int))];
    } cm;
    struct iovec iov = { &h, sizeof(h) };
    int two[2];
    struct msghdr mh;
    struct cmsghdr *ch;
    char req;
    int c = accept(f->lfd, NULL, NULL), mfd = make_memfd(3);

    if (c < 0 || read(c, &req, 1) != 1)
        abort();
    make_hdr(&h, "fake", 1);
    h.magic = f->kind == FAKE_MAGIC ? 0xdeadbeef : DSV4_WSHARE_MAGIC;
    h.version = f->kind == FAKE_VERSION ? DSV4_WSHARE_VERSION + 1 : DSV4_WSHARE_VERSION;
    if (f->kind == FAKE_SHORT)
        iov.iov_len = 10;
    memset(&mh, 0, sizeof(mh));
    memset(&cm, 0, sizeof(cm));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (f->kind != FAKE_NOFD) {
        int n = f->kind == FAKE_TWOFD ? 2 : 1;

        two[0] = two[1] = mfd;
        mh.msg_control = cm.buf;
        mh.msg_controllen = CMSG_SPACE(n * sizeof(int));
        ch = CMSG_FIRSTHDR(&mh);
        ch->cmsg_level = SOL_SOCKET;
        ch->cmsg_type = SCM_RIGHTS;
        ch->cmsg_len = CMSG_LEN(n * sizeof(int));
        memcpy(CMSG_DATA(ch), two, n * sizeof(int));
    }
    if (sendmsg(c, &mh, 0) < 0)
        abort();
    close(c);
    close(mfd);
    return NULL;
}

static void
test_malformed(void **state)
{
    static const enum fake_kind kinds[] = { FAKE_SHORT, FAKE_MAGIC, FAKE_NOFD, FAKE_VERSION,
                                            FAKE_TWOFD };
    static const char *const why[] = { "short header", "bad magic", "no descriptor",
                                       "other version", "2 descriptors" };
    int fds0 = open_fds();

    (void)state;
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        struct sockaddr_un sa;
        struct dsv4_wshare_hdr got;
        struct fake f;
        pthread_t th;
        int gfd = 7;

        memset(&sa, 0, sizeof(sa));
        sa.sun_family = AF_UNIX;
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        unlink(path);
        f.lfd = socket(AF_UNIX, SOCK_STREAM, 0);
        f.kind = kinds[k];
        assert_int_equal(bind(f.lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        assert_int_equal(listen(f.lfd, 1), 0);
        assert_int_equal(pthread_create(&th, NULL, fake_thread, &f), 0);
        assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_ERR_PROTO);
        assert_int_equal(gfd, -1);
        assert_non_null(strstr(dsv4_errmsg(), why[k]));
        pthread_join(th, NULL);
        close(f.lfd);
        unlink(path);
        /* nothing received stays open (two descriptors: both closed) */
        assert_int_equal(open_fds(), fds0);
    }
}

/* A server of another user at the path (any local user who can write the
 * directory): its descriptor is not fetched, and is not mapped.  Shown
 * where the test runs as root (a child serves as nobody); skipped else. */
static void
test_other_user(void **state)
{
    struct sockaddr_un sa;
    struct dsv4_wshare_hdr got;
    int gfd = 7, st, sync[2];
    pid_t pid;

    (void)state;
    if (geteuid() != 0)
        skip();
    assert_int_equal(pipe(sync), 0);
    unlink(path);
    assert_int_equal(chmod(dir, 0777), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct fake f = { -1, FAKE_MAGIC };

        if (setgid(65534) != 0 || setuid(65534) != 0)
            _exit(3);
        memset(&sa, 0, sizeof(sa));
        sa.sun_family = AF_UNIX;
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        f.lfd = socket(AF_UNIX, SOCK_STREAM, 0);
        if (bind(f.lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(f.lfd, 1) != 0)
            _exit(4);
        if (write(sync[1], "r", 1) != 1)
            _exit(5);
        fake_thread(&f);   /* a well-formed answer but for its magic: never read */
        _exit(0);
    }
    close(sync[1]);
    assert_int_equal(read(sync[0], &st, 1), 1);
    close(sync[0]);
    assert_int_equal(dsv4_wshare_fetch(path, WAIT_MS, &gfd, &got), DSV4_ERR_PROTO);
    assert_int_equal(gfd, -1);
    assert_non_null(strstr(dsv4_errmsg(), "served by uid 65534"));
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    unlink(path);
    assert_int_equal(chmod(dir, 0700), 0);
}

static void
test_lock(void **state)
{
    int a = -1, b = -1;

    (void)state;
    assert_int_equal(dsv4_wshare_lock(path, 0, &a), DSV4_OK);
    assert_true(a >= 0);
    /* another open file (as another process would have) waits, then gives up */
    assert_int_equal(dsv4_wshare_lock(path, 100, &b), DSV4_ERR_TIMEOUT);
    assert_int_equal(b, -1);
    dsv4_wshare_unlock(a);
    assert_int_equal(dsv4_wshare_lock(path, 0, &b), DSV4_OK);
    dsv4_wshare_unlock(b);
}

/* The start-up lock's file cannot be opened (a directory in its place,
 * which root cannot open for writing either): an error at once, not the
 * timeout of a held lock, so a rank under share_weights = auto keeps its
 * own copy (daemons/rank/rank_share.c) instead of waiting or dying. */
static void
test_lock_unopenable(void **state)
{
    char lock[128];
    int a = -1;

    (void)state;
    snprintf(lock, sizeof(lock), "%s.lock", path);
    assert_int_equal(mkdir(lock, 0700), 0);
    alarm(WAIT_MS / 1000 / 2);   /* the lock's wait would be a failure */
    assert_int_equal(dsv4_wshare_lock(path, WAIT_MS, &a), DSV4_ERR_SYS);
    alarm(0);
    assert_int_equal(a, -1);
    if (strstr(dsv4_errmsg(), lock) == NULL)
        fail_msg("\"%s\" does not name %s", dsv4_errmsg(), lock);
}

/* The socket path cannot be reached (connect fails with neither ENOENT nor
 * ECONNREFUSED: here ENOTDIR, its directory being a regular file; EACCES for
 * a non-root user): the server does not serve and says so once, with the
 * errno, instead of nothing while the rank logs that it shares. */
static void
test_unreachable(void **state)
{
    struct dsv4_wshare_server *s;
    struct dsv4_wshare_hdr h;
    char file[96], bad[128], log[96], text[4096];
    int fd, saved, lfd, n;
    const char *at;
    ssize_t got;

    (void)state;
    fd = memfd_create("wshare-faults", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, 4096), 0);
    snprintf(file, sizeof(file), "%s/a-file", dir);
    snprintf(bad, sizeof(bad), "%s/sock", file);
    snprintf(log, sizeof(log), "%s/stderr", dir);
    lfd = open(file, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    assert_true(lfd >= 0);
    close(lfd);
    lfd = open(log, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    assert_true(lfd >= 0);

    /* stderr (the log) into the file for the server's life */
    fflush(stderr);
    saved = dup(2);
    assert_true(saved >= 0);
    assert_int_equal(dup2(lfd, 2), 2);
    memset(&h, 0, sizeof(h));
    h.alloc_bytes = 4096;
    h.used_bytes = 4096;
    snprintf(h.owner, sizeof(h.owner), "decode@0");
    assert_int_equal(dsv4_wshare_serve(&s, bad, fd, &h), DSV4_OK);
    assert_int_equal(dsv4_wshare_serving(s), 0);
    usleep(3 * DSV4_WSHARE_POLL_MS * 1000);   /* a few more tries: no more lines */
    dsv4_wshare_stop(s);
    fflush(stderr);
    assert_int_equal(dup2(saved, 2), 2);
    close(saved);

    got = pread(lfd, text, sizeof(text) - 1, 0);
    close(lfd);
    close(fd);
    assert_true(got >= 0);
    text[got] = '\0';
    if (strstr(text, bad) == NULL || strstr(text, "connect") == NULL ||
        strstr(text, strerror(ENOTDIR)) == NULL)
        fail_msg("no warning naming %s, connect and \"%s\" in: \"%s\"", bad, strerror(ENOTDIR),
                 text);
    for (n = 0, at = text; (at = strstr(at, "cannot serve")) != NULL; at++)
        n++;
    assert_int_equal(n, 1);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_fingerprint),
        cmocka_unit_test(test_match),
        cmocka_unit_test_setup_teardown(test_handover, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stale, setup, teardown),
        cmocka_unit_test_setup_teardown(test_standby, setup, teardown),
        cmocka_unit_test_setup_teardown(test_takeover_after_kill, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frozen_owner, setup, teardown),
        cmocka_unit_test_setup_teardown(test_malformed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_other_user, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lock, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lock_unopenable, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unreachable, setup, teardown),
    };

    signal(SIGPIPE, SIG_IGN);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
