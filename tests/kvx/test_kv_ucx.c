/*
 * test_kv_ucx.c — the ucx decode-state transport (ipc/kvxfer.h,
 * ipc/kv_ucx.c) over TCP on the loopback device: a round trip through the
 * protocol's location descriptor (exporter and importer in one process, two
 * UCX workers), asynchronous imports reported on the event fd, an exporter
 * that stops answering (SIGSTOP: the import fails with DSV4_ERR_TIMEOUT and
 * the next import from a live exporter works; an importer of a longer
 * bound gives up at the exporter's hold), an exporter that died
 * (an error, never a hang), a cancelled import beside another one from the
 * same exporter (the other completes), 10,000 small imports polled in a
 * tight loop (the completion done with a get before it says so), a
 * cancelled import whose get
 * outlives the region's grace on the exporter (the exporter lives on), and
 * malformed handles (DSV4_ERR_PROTO).
 *
 * Exporters in child processes are forked before the parent starts UCX.
 * When UCX cannot start here (no usable TCP device; probed in a child
 * first) the program exits 77, which meson reports as SKIP; once the probe
 * worked, a UCX instance that does not open is a failure.
 */
#include <sys/wait.h>

#include <dirent.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ipc/kvxfer.h"
#include "ipc/zsock.h"   /* dsv4_now_ms */

#define TEST_TIMEOUT_MS 1500   /* import bound used by these tests */

static const struct dsv4_kvx_opts test_opts = {
    .timeout_ms = TEST_TIMEOUT_MS,
    .ucx_tls = "tcp",
    .ucx_devices = "lo",
};

/* A byte pattern that differs per position and per seed. */
static uint8_t
pat(uint64_t i, unsigned seed)
{
    return (uint8_t)((i * 2654435761u) >> 13 ^ seed);
}

/* Open a UCX instance; the probe in main said UCX works here. */
static int
open_ucx(struct dsv4_kvx **x, const char *owner)
{
    enum dsv4_err e = dsv4_kvx_open_opts(x, DSV4_TRANSPORT_UCX, owner, &test_opts);

    if (e != DSV4_OK)
        fail_msg("ucx open (%s): %s", owner, dsv4_errmsg());
    return 0;
}

/* Whether a UCX instance opens here, tried in a child (this process must
 * not start UCX before it forks the exporters): 1 yes, 0 no (the child
 * said so, exit 77: a SKIP), -1 the probe failed otherwise (a crash is a
 * failure, not a skip). */
static int
ucx_usable(void)
{
    pid_t pid = fork();
    int st;

    if (pid < 0)
        return -1;
    if (pid == 0) {
        struct dsv4_kvx *x;

        if (dsv4_kvx_open_opts(&x, DSV4_TRANSPORT_UCX, "ucx-probe", &test_opts) != DSV4_OK) {
            fprintf(stderr, "ucx unusable here: %s\n", dsv4_errmsg());
            _exit(77);
        }
        dsv4_kvx_close(x);
        _exit(0);
    }
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) ||
        (WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 77)) {
        fprintf(stderr, "the ucx probe failed (status %#x)\n", (unsigned)st);
        return -1;
    }
    return WEXITSTATUS(st) == 0;
}

/* Export, describe as a protocol location, import (sync), compare. */
static void
test_round_trip(void **state)
{
    struct dsv4_kvx *x, *y;
    struct dsv4_kvx_region r;
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;
    struct dsv4_kv_loc loc;
    uint64_t seg[2];
    const uint64_t size = (3u << 20) + 77, used = (3u << 20) + 50;

    (void)state;
    open_ucx(&x, "ucx-exp");
    assert_int_equal(open_ucx(&y, "ucx-imp"), 0);
    assert_int_equal(dsv4_kvx_export(x, 42, size, &r), DSV4_OK);
    assert_int_equal(r.desc.transport, DSV4_TRANSPORT_UCX);
    for (uint64_t i = 0; i < size; i++)
        ((uint8_t *)r.data)[i] = pat(i, 1);
    dsv4_kvx_desc_to_loc(&r, used, 9, seg, &loc);
    assert_int_equal(dsv4_kvx_desc_from_loc(&loc, &d), DSV4_OK);
    assert_int_equal(d.size, used);
    for (int round = 0; round < 2; round++) {  /* the second reuses the endpoint */
        assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_OK);
        assert_true(m.size >= used);
        for (uint64_t i = 0; i < used; i++)
            if (((const uint8_t *)m.data)[i] != pat(i, 1))
                fail_msg("byte %llu differs (round %d)", (unsigned long long)i, round);
        dsv4_kvx_unmap(y, &m);
    }
    assert_int_equal(x->n_live, 1);
    dsv4_kvx_free(x, &r);
    assert_int_equal(x->n_live, 0);
    dsv4_kvx_close(y);
    dsv4_kvx_close(x);
}

/* Several imports in flight at once; completion comes through the event fd. */
static void
test_async(void **state)
{
    enum { N = 4 };
    struct dsv4_kvx *x, *y;
    struct dsv4_kvx_region r[N];
    struct dsv4_kvx_xfer *t[N];
    struct dsv4_kvx_map m;
    int left = N, fd;

    (void)state;
    open_ucx(&x, "ucx-aexp");
    assert_int_equal(open_ucx(&y, "ucx-aimp"), 0);
    fd = dsv4_kvx_event_fd(y);
    assert_true(fd >= 0);
    for (int i = 0; i < N; i++) {
        uint64_t size = 4096u * (uint64_t)(i + 1) + 5;
        assert_int_equal(dsv4_kvx_export(x, (uint64_t)i, size, &r[i]), DSV4_OK);
        for (uint64_t j = 0; j < size; j++)
            ((uint8_t *)r[i].data)[j] = pat(j, (unsigned)i + 10);
        assert_int_equal(dsv4_kvx_import_start(y, &r[i].desc, &t[i]), DSV4_OK);
    }
    while (left > 0) {
        struct pollfd p = { .fd = fd, .events = POLLIN };

        assert_true(poll(&p, 1, 100) >= 0);
        dsv4_kvx_event_clear(y);
        for (int i = 0; i < N; i++) {
            enum dsv4_err e;

            if (t[i] == NULL)
                continue;
            e = dsv4_kvx_import_test(y, t[i], &m);
            if (e == DSV4_ERR_BUSY)
                continue;
            assert_int_equal(e, DSV4_OK);
            t[i] = NULL;
            left--;
            assert_int_equal(m.size, r[i].size);
            for (uint64_t j = 0; j < m.size; j++)
                assert_int_equal(((const uint8_t *)m.data)[j], pat(j, (unsigned)i + 10));
            dsv4_kvx_unmap(y, &m);
        }
    }
    for (int i = 0; i < N; i++)
        dsv4_kvx_free(x, &r[i]);
    dsv4_kvx_close(y);
    dsv4_kvx_close(x);
}

/* Two imports from one exporter at once, the first cancelled (a client's
 * cancel, not a timeout): the second completes with its bytes.  (The
 * abort used to force-close the endpoint both share, failing the second
 * with "Request canceled".) */
static void
test_cancel_beside(void **state)
{
    const uint64_t size = 16u << 20;   /* long enough to be in flight at the abort */
    struct dsv4_kvx *x, *y;
    struct dsv4_kvx_region a, b;
    struct dsv4_kvx_xfer *ta, *tb;
    struct dsv4_kvx_map m;
    enum dsv4_err e;

    (void)state;
    open_ucx(&x, "ucx-cexp");
    assert_int_equal(open_ucx(&y, "ucx-cimp"), 0);
    assert_int_equal(dsv4_kvx_export(x, 1, size, &a), DSV4_OK);
    assert_int_equal(dsv4_kvx_export(x, 2, size, &b), DSV4_OK);
    for (uint64_t j = 0; j < size; j++) {
        ((uint8_t *)a.data)[j] = pat(j, 1);
        ((uint8_t *)b.data)[j] = pat(j, 2);
    }
    /* the endpoint made by a first import, as in a rank that has served */
    assert_int_equal(dsv4_kvx_import(y, &a.desc, &m), DSV4_OK);
    dsv4_kvx_unmap(y, &m);
    assert_int_equal(dsv4_kvx_import_start(y, &a.desc, &ta), DSV4_OK);
    assert_int_equal(dsv4_kvx_import_start(y, &b.desc, &tb), DSV4_OK);
    dsv4_kvx_import_abort(y, ta);
    while ((e = dsv4_kvx_import_test(y, tb, &m)) == DSV4_ERR_BUSY) {
        struct pollfd p = { .fd = dsv4_kvx_event_fd(y), .events = POLLIN };

        assert_true(poll(&p, 1, 100) >= 0);
        dsv4_kvx_event_clear(y);
    }
    if (e != DSV4_OK)
        fail_msg("the import beside a cancelled one: %s", dsv4_errmsg());
    assert_int_equal(m.size, size);
    for (uint64_t j = 0; j < size; j++)
        if (((const uint8_t *)m.data)[j] != pat(j, 2))
            fail_msg("byte %llu differs", (unsigned long long)j);
    dsv4_kvx_unmap(y, &m);
    dsv4_kvx_free(x, &a);
    dsv4_kvx_free(x, &b);
    dsv4_kvx_close(y);
    dsv4_kvx_close(x);
}

/*
 * A child exports a region and sends its descriptor through a pipe, then
 * waits for the parent to close the pipe.  Returns the child's pid; the
 * descriptor is in *d.  The child exits 3 when UCX cannot start (a failure: main probed it).
 */
static pid_t
spawn_exporter(struct dsv4_kvx_desc *d, int *keep_fd)
{
    int to_parent[2], hold[2];
    pid_t pid;

    assert_int_equal(pipe(to_parent), 0);
    assert_int_equal(pipe(hold), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct dsv4_kvx *x;
        struct dsv4_kvx_region r;
        char c;

        close(to_parent[0]);
        close(hold[1]);
        if (dsv4_kvx_open_opts(&x, DSV4_TRANSPORT_UCX, "ucx-child", &test_opts) != DSV4_OK)
            _exit(3);
        if (dsv4_kvx_export(x, 7, 1u << 20, &r) != DSV4_OK)
            _exit(1);
        memset(r.data, 0x5a, r.size);
        if (write(to_parent[1], &r.desc, sizeof(r.desc)) != (ssize_t)sizeof(r.desc))
            _exit(1);
        while (read(hold[0], &c, 1) > 0)
            ;
        dsv4_kvx_free(x, &r);
        dsv4_kvx_close(x);
        _exit(0);
    }
    close(to_parent[1]);
    close(hold[0]);
    if (read(to_parent[0], d, sizeof(*d)) != (ssize_t)sizeof(*d)) {
        int st;
        waitpid(pid, &st, 0);
        close(to_parent[0]);
        close(hold[1]);
        fail_msg("exporter child failed (status %d)", st);
    }
    close(to_parent[0]);
    *keep_fd = hold[1];
    return pid;
}

/* Wait until every thread of `pid` is stopped (kill returns before a
 * thread running on another CPU has taken the SIGSTOP; one that serves the
 * import meanwhile made the import succeed). */
static void
wait_stopped(pid_t pid)
{
    char path[64], tpath[64 + 256 + 8], buf[512];

    snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
    for (int i = 0; i < 1000; i++) {
        DIR *dir = opendir(path);
        struct dirent *de;
        int running = dir == NULL;

        while (dir != NULL && (de = readdir(dir)) != NULL) {
            FILE *f;
            const char *st = NULL;

            if (de->d_name[0] == '.')
                continue;
            snprintf(tpath, sizeof(tpath), "%s/%s/stat", path, de->d_name);
            if ((f = fopen(tpath, "r")) == NULL)
                continue;
            if (fgets(buf, sizeof(buf), f) != NULL && (st = strrchr(buf, ')')) != NULL)
                st += 2;             /* "tid (comm) S ..." */
            fclose(f);
            running += st == NULL || *st != 'T';
        }
        if (dir != NULL)
            closedir(dir);
        if (running == 0)
            return;
        usleep(1000);
    }
    fail_msg("exporter %d did not stop", (int)pid);
}

/* An exporter that stops progressing: the import times out; a live
 * exporter afterwards is imported from normally. */
static void
test_stalled_exporter(void **state)
{
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;
    struct dsv4_kvx *y;
    int hold, st;
    pid_t pid;

    (void)state;
    pid = spawn_exporter(&d, &hold);
    assert_int_equal(kill(pid, SIGSTOP), 0);
    wait_stopped(pid);
    assert_int_equal(open_ucx(&y, "ucx-simp"), 0);
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_TIMEOUT);
    assert_null(m.data);
    assert_int_equal(y->n_timeouts, 1);
    print_message("stalled exporter: %s\n", dsv4_errmsg());
    /* Let it run again: the importer reconnects and gets the data. */
    assert_int_equal(kill(pid, SIGCONT), 0);
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_OK);
    assert_int_equal(((const uint8_t *)m.data)[12345], 0x5a);
    dsv4_kvx_unmap(y, &m);
    close(hold);
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    dsv4_kvx_close(y);
}

/* Many small imports, each polled with import_test in a tight loop (as a
 * decode rank polls between steps): the progress thread's completion must
 * be finished with the get before the main thread may see it done and free
 * it (it was not: ASan saw the callback write to the freed get within a
 * few thousand imports). */
static void
test_spin_imports(void **state)
{
    struct dsv4_kvx *x, *y;
    struct dsv4_kvx_region r;
    struct dsv4_kvx_xfer *t;
    struct dsv4_kvx_map m;
    enum dsv4_err e;

    (void)state;
    assert_int_equal(open_ucx(&x, "ucx-sexp"), 0);
    assert_int_equal(open_ucx(&y, "ucx-simp2"), 0);
    assert_int_equal(dsv4_kvx_export(x, 1, 64, &r), DSV4_OK);
    memset(r.data, 1, 64);
    for (int i = 0; i < 10000; i++) {
        void *junk;

        assert_int_equal(dsv4_kvx_import_start(y, &r.desc, &t), DSV4_OK);
        while ((e = dsv4_kvx_import_test(y, t, &m)) == DSV4_ERR_BUSY)
            ;
        assert_int_equal(e, DSV4_OK);
        assert_int_equal(((const uint8_t *)m.data)[63], 1);
        dsv4_kvx_unmap(y, &m);
        /* the freed get's memory taken again at once, as a rank's next
         * allocation would */
        junk = malloc(sizeof(void *) * 8);
        assert_non_null(junk);
        memset(junk, 0xff, sizeof(void *) * 8);
        free(junk);
    }
    dsv4_kvx_free(x, &r);
    dsv4_kvx_close(y);
    dsv4_kvx_close(x);
}

/* An importer whose own bound is longer than the exporter's hold (the
 * handle's kv_timeout_ms of the exporter): the import is bounded by the
 * hold, so a get never reads on into the dropped pages of a freed region.
 * The exporter stops (SIGSTOP), so the import times out at the hold. */
static void
test_bound_by_hold(void **state)
{
    struct dsv4_kvx_opts lo = test_opts;
    struct dsv4_kvx_xfer *t;
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;
    struct dsv4_kvx *y;
    enum dsv4_err e;
    int64_t t0;
    int hold, st;
    pid_t pid;

    (void)state;
    lo.timeout_ms = 60 * TEST_TIMEOUT_MS;
    pid = spawn_exporter(&d, &hold);
    assert_int_equal(kill(pid, SIGSTOP), 0);
    wait_stopped(pid);
    if (dsv4_kvx_open_opts(&y, DSV4_TRANSPORT_UCX, "ucx-himp", &lo) != DSV4_OK)
        fail_msg("ucx open: %s", dsv4_errmsg());
    t0 = dsv4_now_ms();
    assert_int_equal(dsv4_kvx_import_start(y, &d, &t), DSV4_OK);
    assert_int_equal(t->bound_ms, TEST_TIMEOUT_MS);
    assert_true(t->deadline_ms <= dsv4_now_ms() + TEST_TIMEOUT_MS);
    assert_true(t->deadline_ms >= t0 + TEST_TIMEOUT_MS);
    while ((e = dsv4_kvx_import_test(y, t, &m)) == DSV4_ERR_BUSY)
        usleep(10000);
    assert_int_equal(e, DSV4_ERR_TIMEOUT);
    assert_non_null(strstr(dsv4_errmsg(), "within 1500 ms"));
    assert_null(m.data);
    assert_int_equal(kill(pid, SIGCONT), 0);
    close(hold);
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    dsv4_kvx_close(y);
}

/* A cancelled import whose get outlives the region's grace on the
 * exporter (the importer stalls: SIGSTOP, past TEST_TIMEOUT_MS + 1 s): the
 * exporter frees the region, its grace ends at its next export, then the
 * get goes on.  Over TCP the exporter's own code serves it from the freed
 * addresses: it used to die of SIGSEGV there; the region's pages are
 * dropped and its addresses kept instead, and the exporter lives on. */
static void
test_get_outlives_grace(void **state)
{
    const uint64_t size = 256u << 20;   /* still in flight when the importer stops */
    struct dsv4_kvx_region r, r2;
    struct dsv4_kvx *x;
    int to_imp[2], to_exp[2], st;
    char c = 0;
    pid_t pid;

    (void)state;
    assert_int_equal(pipe(to_imp), 0);
    assert_int_equal(pipe(to_exp), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {   /* the importer: a decode rank whose client cancelled */
        struct dsv4_kvx_desc d, small;
        struct dsv4_kvx_xfer *t;
        struct dsv4_kvx_map m;
        struct dsv4_kvx *y;

        if (read(to_imp[0], &d, sizeof(d)) != (ssize_t)sizeof(d) ||
            dsv4_kvx_open_opts(&y, DSV4_TRANSPORT_UCX, "ucx-gimp", &test_opts) != DSV4_OK)
            _exit(1);
        small = d;
        small.size = 4096;   /* the endpoint up first */
        if (dsv4_kvx_import(y, &small, &m) != DSV4_OK)
            _exit(2);
        dsv4_kvx_unmap(y, &m);
        if (dsv4_kvx_import_start(y, &d, &t) != DSV4_OK)
            _exit(3);
        dsv4_kvx_import_abort(y, t);
        if (write(to_exp[1], &c, 1) != 1)
            _exit(4);
        raise(SIGSTOP);
        sleep(3);
        _exit(0);
    }
    assert_int_equal(open_ucx(&x, "ucx-gexp"), 0);
    assert_int_equal(dsv4_kvx_export(x, 1, size, &r), DSV4_OK);
    memset(r.data, 0x5a, size);
    assert_int_equal(write(to_imp[1], &r.desc, sizeof(r.desc)), (ssize_t)sizeof(r.desc));
    assert_int_equal(read(to_exp[0], &c, 1), 1);
    wait_stopped(pid);
    dsv4_kvx_free(x, &r);                       /* the ABORT reaches the prefill rank */
    usleep((TEST_TIMEOUT_MS + 1500) * 1000);    /* past the grace */
    assert_int_equal(dsv4_kvx_export(x, 2, 4096, &r2), DSV4_OK);   /* reaps */
    assert_int_equal(kill(pid, SIGCONT), 0);
    sleep(2);                                   /* the get runs on the exporter */
    assert_int_equal(dsv4_kvx_export(x, 3, 4096, &r), DSV4_OK);    /* alive and serving */
    dsv4_kvx_free(x, &r);
    dsv4_kvx_free(x, &r2);
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    dsv4_kvx_close(x);
    for (int i = 0; i < 2; i++) {
        close(to_imp[i]);
        close(to_exp[i]);
    }
}

/* An exporter that is gone: an error (connection refused / reset, or the
 * timeout), never a hang and never success. */
static void
test_dead_exporter(void **state)
{
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;
    struct dsv4_kvx *y;
    enum dsv4_err e;
    int hold, st;
    pid_t pid;

    (void)state;
    pid = spawn_exporter(&d, &hold);
    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(waitpid(pid, &st, 0), pid);
    close(hold);
    assert_int_equal(open_ucx(&y, "ucx-dimp"), 0);
    e = dsv4_kvx_import(y, &d, &m);
    print_message("dead exporter: %s\n", dsv4_errmsg());
    assert_true(e == DSV4_ERR_SYS || e == DSV4_ERR_TIMEOUT);
    assert_null(m.data);
    dsv4_kvx_close(y);
}

/* Malformed handles are refused before any network traffic. */
static void
test_bad_handle(void **state)
{
    struct dsv4_kvx *x, *y;
    struct dsv4_kvx_region r;
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;

    (void)state;
    open_ucx(&x, "ucx-bexp");
    assert_int_equal(open_ucx(&y, "ucx-bimp"), 0);
    assert_int_equal(dsv4_kvx_export(x, 1, 1000, &r), DSV4_OK);

    d = r.desc;
    d.handle[0] ^= 1;                        /* magic */
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_PROTO);
    d = r.desc;
    d.handle_len -= 1;                       /* lengths do not add up */
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_PROTO);
    d = r.desc;
    d.size = r.size + 1;                     /* more than the region holds */
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_PROTO);
    d = r.desc;
    d.handle[24] ^= 0x40;                    /* worker address length */
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_PROTO);
    d = r.desc;
    d.handle_len = 20;                       /* shorter than the header */
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_PROTO);
    d = r.desc;
    memset(d.handle + 16, 0xff, 8);          /* a region of 2^64 - 1 bytes, */
    d.size = UINT64_MAX - 1;                 /* and as many claimed: no lack of memory */
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_PROTO);
    d = r.desc;
    d.transport = DSV4_TRANSPORT_SHM;        /* not this instance's */
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_PROTO);
    assert_null(m.data);
    /* the genuine one still works */
    memset(r.data, 3, 1000);
    assert_int_equal(dsv4_kvx_import(y, &r.desc, &m), DSV4_OK);
    assert_int_equal(((const uint8_t *)m.data)[999], 3);
    dsv4_kvx_unmap(y, &m);
    dsv4_kvx_free(x, &r);
    dsv4_kvx_close(y);
    dsv4_kvx_close(x);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stalled_exporter),
        cmocka_unit_test(test_bound_by_hold),
        cmocka_unit_test(test_dead_exporter),
        cmocka_unit_test(test_get_outlives_grace),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_async),
        cmocka_unit_test(test_spin_imports),
        cmocka_unit_test(test_cancel_beside),
        cmocka_unit_test(test_bad_handle),
    };

    signal(SIGPIPE, SIG_IGN);
    switch (ucx_usable()) {
    case 0:
        return 77;   /* meson: SKIP */
    case -1:
        return 1;
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
