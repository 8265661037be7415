/*
 * test_zsock.c — ZeroMQ endpoint helpers: CURVE on tcp://127.0.0.1 (a peer
 * with the server key talks; a plain peer and a peer with a wrong key are
 * refused during the handshake and nothing reaches the server), admin socket
 * file mode (and, as root, that another user cannot connect), adopting a
 * listening fd (ZMQ_USE_FD), error replies to malformed and oversized
 * messages with the server still serving, key files, liveness arithmetic,
 * dsv4_zsock_check agreeing with what dsv4_zsock_open does, and an ipc://
 * bind refused on a socket file a live process listens on.
 */
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include <errno.h>
#include <grp.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <zmq.h>

#include "ipc/proto.h"
#include "ipc/zsock.h"

#define NOBODY_ID 65534

struct fixture {
    void *ctx;
    char dir[64];
};

static int
setup(void **state)
{
    struct fixture *f = calloc(1, sizeof(*f));

    f->ctx = zmq_ctx_new();
    snprintf(f->dir, sizeof(f->dir), "/tmp/dsv4-zsock-XXXXXX");
    if (mkdtemp(f->dir) == NULL)
        return -1;
    *state = f;
    return 0;
}

static int
teardown(void **state)
{
    struct fixture *f = *state;
    char cmd[128];

    zmq_ctx_term(f->ctx);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", f->dir);
    if (system(cmd) != 0)
        return -1;
    free(f);
    return 0;
}

static void *
open_ok(struct fixture *f, const char *ep, int type, bool bind, enum dsv4_curve curve,
    const char *server_key)
{
    struct dsv4_zsock_cfg cfg;
    void *s;

    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = ep;
    cfg.type = type;
    cfg.bind = bind;
    cfg.curve = curve;
    cfg.key_dir = f->dir;
    cfg.server_key = server_key;
    s = dsv4_zsock_open(f->ctx, &cfg, NULL);
    if (s == NULL)
        fail_msg("open %s: %s", ep, dsv4_errmsg());
    return s;
}

static void
send_heartbeat(void *s, const struct dsv4_route *to)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_HEARTBEAT);
    assert_int_equal(dsv4_zsock_send(s, to, &m, 0, NULL), DSV4_OK);
}

static void
recv_ok(void *s, struct dsv4_route *from, int cmd)
{
    struct dsv4_msg m;
    struct dsv4_perr pe;

    if (dsv4_zsock_recv(s, from, &m, &pe, 0) != DSV4_OK)
        fail_msg("recv: %s", pe.message);
    assert_int_equal(m.cmd, cmd);
    dsv4_msg_clear(&m);
}

/* Wait for the monitor to report a handshake event; returns it. */
static int
monitor_next(void *mon)
{
    for (;;) {
        zmq_msg_t a, b;
        uint16_t ev;

        zmq_msg_init(&a);
        zmq_msg_init(&b);
        assert_true(zmq_msg_recv(&a, mon, 0) >= 0);
        assert_true(zmq_msg_recv(&b, mon, 0) >= 0);
        memcpy(&ev, zmq_msg_data(&a), sizeof(ev));
        zmq_msg_close(&a);
        zmq_msg_close(&b);
        if (ev & (ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH))
            return ev;
    }
}

static void
test_curve(void **state)
{
    struct fixture *f = *state;
    char ep[256], pub[DSV4_ZSOCK_Z85_LEN + 1], path[256];
    char other_pub[DSV4_ZSOCK_Z85_LEN + 1], other_sec[DSV4_ZSOCK_Z85_LEN + 1];
    size_t len = sizeof(ep);
    struct dsv4_route from;
    struct dsv4_zsock_cfg cfg;
    struct dsv4_msg m;
    struct dsv4_perr pe;
    struct stat st;
    void *srv, *mon, *good, *plain, *wrong;

    if (!zmq_has("curve"))
        skip();
    assert_int_equal(dsv4_zsock_keygen(f->dir, "server"), DSV4_OK);
    assert_int_equal(dsv4_zsock_keygen(f->dir, "server"), DSV4_ERR_SYS); /* no overwrite */
    snprintf(path, sizeof(path), "%s/server.key", f->dir);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    snprintf(path, sizeof(path), "%s/server.pub", f->dir);
    assert_int_equal(dsv4_zsock_key_read(path, pub), DSV4_OK);

    /* Without CURVE keys a tcp:// server refuses to start (AUTO = on). */
    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = "tcp://127.0.0.1:*";
    cfg.type = ZMQ_ROUTER;
    cfg.bind = true;
    cfg.key_dir = "/nonexistent";
    assert_null(dsv4_zsock_open(f->ctx, &cfg, NULL));

    srv = open_ok(f, "tcp://127.0.0.1:*", ZMQ_ROUTER, true, DSV4_CURVE_AUTO, NULL);
    assert_int_equal(zmq_getsockopt(srv, ZMQ_LAST_ENDPOINT, ep, &len), 0);
    assert_int_equal(zmq_socket_monitor(srv, "inproc://mon", ZMQ_EVENT_ALL), 0);
    mon = zmq_socket(f->ctx, ZMQ_PAIR);
    assert_int_equal(zmq_connect(mon, "inproc://mon"), 0);

    /* A client that knows the server key gets through. */
    good = open_ok(f, ep, ZMQ_DEALER, false, DSV4_CURVE_AUTO, NULL); /* reads server.pub */
    assert_int_equal(monitor_next(mon), ZMQ_EVENT_HANDSHAKE_SUCCEEDED);
    send_heartbeat(good, NULL);
    recv_ok(srv, &from, DSV4_CLI_HEARTBEAT);
    send_heartbeat(srv, &from);
    recv_ok(good, NULL, DSV4_CLI_HEARTBEAT);

    /* A plain client and one with a wrong server key fail the handshake. */
    plain = open_ok(f, ep, ZMQ_DEALER, false, DSV4_CURVE_OFF, NULL);
    send_heartbeat(plain, NULL);
    assert_int_not_equal(monitor_next(mon), ZMQ_EVENT_HANDSHAKE_SUCCEEDED);
    assert_int_equal(zmq_curve_keypair(other_pub, other_sec), 0);
    wrong = open_ok(f, ep, ZMQ_DEALER, false, DSV4_CURVE_ON, other_pub);
    send_heartbeat(wrong, NULL);
    assert_int_not_equal(monitor_next(mon), ZMQ_EVENT_HANDSHAKE_SUCCEEDED);
    /* Nothing of theirs reached the server; the good client still works. */
    assert_int_equal(dsv4_zsock_recv(srv, &from, &m, &pe, ZMQ_DONTWAIT), DSV4_ERR_BUSY);
    send_heartbeat(good, NULL);
    recv_ok(srv, &from, DSV4_CLI_HEARTBEAT);

    dsv4_zsock_close(wrong);
    dsv4_zsock_close(plain);
    dsv4_zsock_close(good);
    zmq_socket_monitor(srv, NULL, 0);
    zmq_close(mon);
    dsv4_zsock_close(srv);
}

/* Try connect() on a unix socket as user nobody; returns its errno (0 = ok). */
static int
connect_as_nobody(const char *path)
{
    pid_t pid = fork();
    int status;

    if (pid == 0) {
        struct sockaddr_un sa;
        int fd;

        if (setgroups(0, NULL) != 0 || setgid(NOBODY_ID) != 0 || setuid(NOBODY_ID) != 0)
            _exit(100);
        fd = socket(AF_UNIX, SOCK_STREAM, 0);
        memset(&sa, 0, sizeof(sa));
        sa.sun_family = AF_UNIX;
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
        _exit(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 ? 0 : errno);
    }
    assert_true(pid > 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_not_equal(WEXITSTATUS(status), 100);
    return WEXITSTATUS(status);
}

static void
test_admin_mode(void **state)
{
    struct fixture *f = *state;
    struct dsv4_zsock_cfg cfg;
    char ep[300], path[128];
    struct stat st;
    void *s;

    snprintf(path, sizeof(path), "%s/ctl.sock", f->dir);
    snprintf(ep, sizeof(ep), "ipc://%s", path);
    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = ep;
    cfg.type = ZMQ_ROUTER;
    cfg.bind = true;
    cfg.mode = DSV4_ZSOCK_CTL_MODE;
    s = dsv4_zsock_open(f->ctx, &cfg, NULL);
    assert_non_null(s);
    assert_int_equal(stat(path, &st), 0);
    assert_true(S_ISSOCK(st.st_mode));
    assert_int_equal(st.st_mode & 0777, DSV4_ZSOCK_CTL_MODE);
    if (geteuid() == 0) {
        /* The directory is open to all, so only the socket's mode decides. */
        assert_int_equal(chmod(f->dir, 0755), 0);
        assert_int_equal(connect_as_nobody(path), EACCES);
        assert_int_equal(chmod(path, 0666), 0); /* control: now nobody may */
        assert_int_equal(connect_as_nobody(path), 0);
    }
    dsv4_zsock_close(s);
}

static void
test_use_fd(void **state)
{
    struct fixture *f = *state;
    struct dsv4_zsock_cfg cfg;
    struct sockaddr_un sa;
    struct dsv4_route from;
    char ep[sizeof(sa.sun_path) + 8];
    void *srv, *cli;
    int fd;

    /* What systemd would pass: a bound, listening unix socket. */
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/activated.sock", f->dir);
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(fd, 16), 0);
    snprintf(ep, sizeof(ep), "ipc://%s", sa.sun_path);

    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = ep;
    cfg.type = ZMQ_ROUTER;
    cfg.bind = true;
    cfg.fd = fd;
    srv = dsv4_zsock_open(f->ctx, &cfg, NULL);
    assert_non_null(srv);
    cli = open_ok(f, ep, ZMQ_DEALER, false, DSV4_CURVE_AUTO, NULL);
    send_heartbeat(cli, NULL);
    recv_ok(srv, &from, DSV4_CLI_HEARTBEAT);
    assert_true(from.len > 0);
    send_heartbeat(srv, &from);
    recv_ok(cli, NULL, DSV4_CLI_HEARTBEAT);
    /* '>' forces connect, and an fd cannot be adopted by a connect. */
    cfg.endpoint = ep;
    cfg.bind = false;
    assert_null(dsv4_zsock_open(f->ctx, &cfg, NULL));
    dsv4_zsock_close(cli);
    dsv4_zsock_close(srv);
}

/* Garbage and oversized messages get error replies; the server keeps going. */
static void
test_error_replies(void **state)
{
    struct fixture *f = *state;
    struct dsv4_route from;
    struct dsv4_perr pe;
    struct dsv4_msg m;
    char ep[256];
    void *srv, *cli;
    uint8_t cmd;

    snprintf(ep, sizeof(ep), "@ipc://%s/e.sock", f->dir);
    srv = open_ok(f, ep, ZMQ_ROUTER, false, DSV4_CURVE_AUTO, NULL); /* '@' forces bind */
    cli = open_ok(f, ep + 1, ZMQ_DEALER, false, DSV4_CURVE_AUTO, NULL);

    /* Wrong version: no reply possible; the server just drops it. */
    zmq_send(cli, "", 0, ZMQ_SNDMORE);
    zmq_send(cli, "DSV4C9", 6, ZMQ_SNDMORE);
    cmd = DSV4_CLI_GENERATE;
    zmq_send(cli, &cmd, 1, ZMQ_SNDMORE);
    zmq_send(cli, "\x80", 1, 0);
    assert_int_equal(dsv4_zsock_recv(srv, &from, &m, &pe, 0), DSV4_ERR_PROTO);
    assert_int_equal(pe.sub, DSV4_SUB_NONE);
    assert_int_equal(dsv4_zsock_send_perr(srv, &from, &pe), DSV4_OK);

    /* GENERATE with a truncated body: ERROR 400. */
    zmq_send(cli, "", 0, ZMQ_SNDMORE);
    zmq_send(cli, DSV4_PROTO_SIG_CLI, 6, ZMQ_SNDMORE);
    zmq_send(cli, &cmd, 1, ZMQ_SNDMORE);
    zmq_send(cli, "\x82\xa2id\x07", 5, 0);
    assert_int_equal(dsv4_zsock_recv(srv, &from, &m, &pe, 0), DSV4_ERR_PROTO);
    assert_int_equal(dsv4_zsock_send_perr(srv, &from, &pe), DSV4_OK);
    assert_int_equal(dsv4_zsock_recv(cli, NULL, &m, &pe, 0), DSV4_OK);
    assert_int_equal(m.cmd, DSV4_CLI_ERROR);
    assert_int_equal(m.u.error.code, 400);
    dsv4_msg_clear(&m);

    /* Too many frames: ERROR 413. */
    zmq_send(cli, "", 0, ZMQ_SNDMORE);
    zmq_send(cli, DSV4_PROTO_SIG_CLI, 6, ZMQ_SNDMORE);
    zmq_send(cli, &cmd, 1, ZMQ_SNDMORE);
    zmq_send(cli, "\x82\xa2id\x07\xa6prompt\xa1x", 14, ZMQ_SNDMORE);
    for (int i = 0; i < DSV4_PROTO_MAX_FRAMES; i++)
        zmq_send(cli, "raw", 3, i + 1 < DSV4_PROTO_MAX_FRAMES ? ZMQ_SNDMORE : 0);
    assert_int_equal(dsv4_zsock_recv(srv, &from, &m, &pe, 0), DSV4_ERR_INVAL);
    assert_int_equal(pe.code, 413);
    assert_int_equal(dsv4_zsock_send_perr(srv, &from, &pe), DSV4_OK);
    assert_int_equal(dsv4_zsock_recv(cli, NULL, &m, &pe, 0), DSV4_OK);
    assert_int_equal(m.u.error.code, 413);
    assert_int_equal(m.u.error.id, 7);
    dsv4_msg_clear(&m);

    /* Still serving. */
    send_heartbeat(cli, NULL);
    recv_ok(srv, &from, DSV4_CLI_HEARTBEAT);
    /* A ROUTER send to a peer that does not exist is reported. */
    memcpy(from.id, "nobody", 6);
    from.len = 6;
    dsv4_msg_init(&m, DSV4_SUB_CLI, DSV4_CLI_HEARTBEAT);
    assert_int_equal(dsv4_zsock_send(srv, &from, &m, ZMQ_DONTWAIT, NULL), DSV4_ERR_SYS);
    assert_int_equal(errno, EHOSTUNREACH);
    assert_int_equal(dsv4_zsock_send(srv, NULL, &m, 0, NULL), DSV4_ERR_INVAL);
    dsv4_zsock_close(cli);
    dsv4_zsock_close(srv);
}

static void
test_key_files(void **state)
{
    struct fixture *f = *state;
    char path[256], key[DSV4_ZSOCK_Z85_LEN + 1];
    FILE *fp;

    snprintf(path, sizeof(path), "%s/bad.pub", f->dir);
    fp = fopen(path, "w");
    fputs("not-a-key\n", fp);
    fclose(fp);
    assert_int_equal(dsv4_zsock_key_read(path, key), DSV4_ERR_CONFIG);
    snprintf(path, sizeof(path), "%s/missing.pub", f->dir);
    assert_int_equal(dsv4_zsock_key_read(path, key), DSV4_ERR_CONFIG);
}

/* dsv4_zsock_check against dsv4_zsock_open on the same configuration: the
 * check must refuse what the open refuses and accept what it opens (where
 * the open can tell: a connect to a missing ipc:// path succeeds, as ZeroMQ
 * connects later). */
static void
test_check(void **state)
{
    struct fixture *f = *state;
    char ipc_ok[128], ipc_nodir[128], ipc_long[200];
    struct {
        const char *ep;
        bool bind, ok, compare;
    } cases[] = {
        { "", true, false, true },
        { "abc", true, false, true },
        { "abc", false, false, true },
        { "udp://127.0.0.1:5555", true, false, true },
        { "ipc://", true, false, true },
        { ipc_ok, true, true, true },
        { ipc_ok, false, true, true },
        { ipc_nodir, true, false, true },
        { ipc_nodir, false, true, true },
        { ipc_long, true, false, true },
        { "tcp://127.0.0.1", true, false, true },
        /* libzmq alone binds port 99999 as 99999 mod 65536 */
        { "tcp://127.0.0.1:99999", true, false, true },
        { "tcp://*:5555", false, false, true },
        { "tcp://127.0.0.1:", true, false, true },
        { "inproc://checked", true, true, true },
        { "inproc://", true, false, false },
    };
    struct dsv4_zsock_cfg cfg;

    (void)state;
    snprintf(ipc_ok, sizeof(ipc_ok), "ipc://%s/s.sock", f->dir);
    snprintf(ipc_nodir, sizeof(ipc_nodir), "ipc://%s/no-dir/s.sock", f->dir);
    snprintf(ipc_long, sizeof(ipc_long), "ipc://%s/%0120d", f->dir, 0);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        enum dsv4_err e;
        void *s;

        dsv4_zsock_cfg_init(&cfg);
        cfg.endpoint = cases[i].ep;
        cfg.bind = cases[i].bind;
        cfg.type = cases[i].bind ? ZMQ_ROUTER : ZMQ_DEALER;
        cfg.curve = DSV4_CURVE_OFF;   /* the form alone; CURVE below */
        cfg.key_dir = f->dir;
        e = dsv4_zsock_check(&cfg);
        if ((e == DSV4_OK) != cases[i].ok)
            fail_msg("check %s %s: %s", cases[i].bind ? "bind" : "connect", cases[i].ep,
                     e == DSV4_OK ? "accepted" : dsv4_errmsg());
        if (!cases[i].compare)
            continue;
        /* closed before any failure: an open socket would hang teardown */
        s = dsv4_zsock_open(f->ctx, &cfg, NULL);
        dsv4_zsock_close(s);
        if ((s != NULL) != cases[i].ok)
            fail_msg("open %s %s: %s, the check said %s", cases[i].bind ? "bind" : "connect",
                     cases[i].ep, s != NULL ? "opened" : dsv4_errmsg(),
                     cases[i].ok ? "yes" : "no");
    }
    /* An abstract socket bound with a mode (admin_mode): no file to
     * chmod, so no way to limit its access: refused by the check and the
     * open alike (the check passed and the open failed, or chmod'ed a
     * file of that name in the working directory); without a mode fine. */
    for (int m = 0; m < 2; m++) {
        void *s;

        dsv4_zsock_cfg_init(&cfg);
        cfg.endpoint = "ipc://@dsv4-test-zsock-abstract";
        cfg.bind = true;
        cfg.type = ZMQ_ROUTER;
        cfg.curve = DSV4_CURVE_OFF;
        cfg.mode = m ? 0660 : 0;
        assert_int_equal(dsv4_zsock_check(&cfg) == DSV4_OK, m == 0);
        if (m)
            assert_non_null(strstr(dsv4_errmsg(), "abstract socket has no file mode"));
        s = dsv4_zsock_open(f->ctx, &cfg, NULL);
        dsv4_zsock_close(s);
        assert_int_equal(s != NULL, m == 0);
    }
    /* CURVE (tcp:// by default): without the key files both refuse; with
     * them both accept. */
    for (int k = 0; k < 2; k++) {
        for (int b = 0; b < 2; b++) {
            void *s;

            dsv4_zsock_cfg_init(&cfg);
            cfg.endpoint = b ? "tcp://127.0.0.1:*" : "tcp://127.0.0.1:5999";
            cfg.bind = b;
            cfg.type = b ? ZMQ_ROUTER : ZMQ_DEALER;
            cfg.key_dir = f->dir;
            assert_int_equal(dsv4_zsock_check(&cfg) == DSV4_OK, k == 1);
            if (k == 0)
                assert_non_null(strstr(dsv4_errmsg(), b ? "server.key" : "server.pub"));
            s = dsv4_zsock_open(f->ctx, &cfg, NULL);
            dsv4_zsock_close(s);
            assert_int_equal(s != NULL, k == 1);
        }
        if (k == 0)
            assert_int_equal(dsv4_zsock_keygen(f->dir, "server"), DSV4_OK);
    }
}

/* An ipc:// bind to a socket file a live process listens on is refused
 * and leaves it alone (libzmq unlinked it and took the endpoint: a second
 * scheduler took a running set's sockets); a stale file is replaced. */
static void
test_bind_in_use(void **state)
{
    struct fixture *f = *state;
    struct sockaddr_un sa;
    struct dsv4_zsock_cfg cfg;
    char ep[128];
    void *first, *second, *peer;
    int fd;

    snprintf(ep, sizeof(ep), "ipc://%s/live.sock", f->dir);
    first = open_ok(f, ep, ZMQ_ROUTER, true, DSV4_CURVE_OFF, NULL);
    dsv4_zsock_cfg_init(&cfg);
    cfg.endpoint = ep;
    cfg.type = ZMQ_ROUTER;
    cfg.bind = true;
    second = dsv4_zsock_open(f->ctx, &cfg, NULL);
    if (second != NULL) {
        /* closed first: an open socket would hang teardown */
        dsv4_zsock_close(second);
        dsv4_zsock_close(first);
        fail_msg("a second bind took the live %s", ep);
    }
    assert_non_null(strstr(dsv4_errmsg(), "in use by a running process"));
    /* the first still gets what is sent to the path */
    peer = open_ok(f, ep, ZMQ_DEALER, false, DSV4_CURVE_OFF, NULL);
    send_heartbeat(peer, NULL);
    recv_ok(first, &(struct dsv4_route){ 0 }, DSV4_CLI_HEARTBEAT);
    dsv4_zsock_close(peer);
    dsv4_zsock_close(first);
    /* a socket file nobody listens on (a crashed scheduler's) is stale */
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/stale.sock", f->dir);
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    close(fd);
    snprintf(ep, sizeof(ep), "ipc://%s", sa.sun_path);
    dsv4_zsock_close(open_ok(f, ep, ZMQ_ROUTER, true, DSV4_CURVE_OFF, NULL));
}

static void
test_liveness(void **state)
{
    struct dsv4_liveness l;

    (void)state;
    dsv4_liveness_init(&l, 1000, 3, 10000);
    assert_false(dsv4_liveness_due(&l, 10999));
    assert_true(dsv4_liveness_due(&l, 11000));
    assert_int_equal(dsv4_liveness_next_ms(&l, 10500), 500);
    dsv4_liveness_tx(&l, 11000);
    assert_false(dsv4_liveness_dead(&l, 12999));
    assert_true(dsv4_liveness_dead(&l, 13000));
    dsv4_liveness_rx(&l, 12500);
    assert_false(dsv4_liveness_dead(&l, 13000));
    assert_int_equal(dsv4_liveness_next_ms(&l, 11500), 500);
    assert_int_equal(dsv4_liveness_next_ms(&l, 99999), 0);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_curve, setup, teardown),
        cmocka_unit_test_setup_teardown(test_admin_mode, setup, teardown),
        cmocka_unit_test_setup_teardown(test_use_fd, setup, teardown),
        cmocka_unit_test_setup_teardown(test_error_replies, setup, teardown),
        cmocka_unit_test_setup_teardown(test_key_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_check, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bind_in_use, setup, teardown),
        cmocka_unit_test(test_liveness),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
