/*
 * zsock.c — ZeroMQ endpoint helpers (see zsock.h).  Library code shared by
 * the daemons and libdsv4client: it reports failures through dsv4_err_set
 * and never logs or exits.
 */
#include "ipc/zsock.h"

#include <sys/stat.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "common/unix_sock.h"

#define IPC_PREFIX "ipc://"
#define TCP_PREFIX "tcp://"
#define MAXMSG_SLACK (1 << 20) /* bytes above the body limit for the other frames */
#define HB_TIMEOUT_FACTOR 3    /* ZMTP heartbeat timeout/TTL, in intervals */
#define PATH_MAX_DSV4 4096

void
dsv4_zsock_cfg_init(struct dsv4_zsock_cfg *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->type = ZMQ_DEALER;
    cfg->fd = -1;
    cfg->curve = DSV4_CURVE_AUTO;
    cfg->maxmsgsize = (int64_t)DSV4_PROTO_MAX_BODY + MAXMSG_SLACK;
}

static enum dsv4_err
sockopt(void *s, int opt, const void *val, size_t len, const char *name)
{
    if (zmq_setsockopt(s, opt, val, len) != 0)
        return dsv4_err_set(DSV4_ERR_SYS, "zmq_setsockopt %s: %s", name, zmq_strerror(errno));
    return DSV4_OK;
}

static enum dsv4_err
sockopt_int(void *s, int opt, int val, const char *name)
{
    return sockopt(s, opt, &val, sizeof(val), name);
}

enum dsv4_err
dsv4_zsock_key_read(const char *path, char z85[DSV4_ZSOCK_Z85_LEN + 1])
{
    char buf[DSV4_ZSOCK_Z85_LEN + 8];
    uint8_t raw[32];
    size_t n;
    FILE *f;

    if ((f = fopen(path, "r")) == NULL)
        return dsv4_err_set(DSV4_ERR_CONFIG, "CURVE key %s: %s", path, strerror(errno));
    n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
        n--;
    buf[n] = '\0';
    if (n != DSV4_ZSOCK_Z85_LEN || zmq_z85_decode(raw, buf) == NULL)
        return dsv4_err_set(DSV4_ERR_CONFIG, "CURVE key %s: not one %d-character Z85 key", path,
            DSV4_ZSOCK_Z85_LEN);
    memcpy(z85, buf, DSV4_ZSOCK_Z85_LEN + 1);
    return DSV4_OK;
}

static enum dsv4_err
key_write(const char *dir, const char *name, const char *ext, const char *z85, mode_t mode)
{
    char path[PATH_MAX_DSV4];
    int fd;
    ssize_t len = DSV4_ZSOCK_Z85_LEN + 1;
    char line[DSV4_ZSOCK_Z85_LEN + 1];
    enum dsv4_err e = DSV4_OK;

    snprintf(path, sizeof(path), "%s/%s.%s", dir, name, ext);
    if ((fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode)) < 0)
        return dsv4_err_set(DSV4_ERR_SYS, "%s: %s", path, strerror(errno));
    memcpy(line, z85, DSV4_ZSOCK_Z85_LEN);
    line[DSV4_ZSOCK_Z85_LEN] = '\n';
    if (fchmod(fd, mode) != 0 || write(fd, line, (size_t)len) != len)
        e = dsv4_err_set(DSV4_ERR_SYS, "%s: %s", path, strerror(errno));
    if (close(fd) != 0 && e == DSV4_OK)
        e = dsv4_err_set(DSV4_ERR_SYS, "%s: %s", path, strerror(errno));
    return e;
}

enum dsv4_err
dsv4_zsock_keygen(const char *dir, const char *name)
{
    char pub[DSV4_ZSOCK_Z85_LEN + 1], sec[DSV4_ZSOCK_Z85_LEN + 1];
    enum dsv4_err e;

    if (!zmq_has("curve"))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "libzmq was built without CURVE");
    if (zmq_curve_keypair(pub, sec) != 0)
        return dsv4_err_set(DSV4_ERR_SYS, "zmq_curve_keypair: %s", zmq_strerror(errno));
    if ((e = key_write(dir, name, "key", sec, 0600)) != DSV4_OK)
        return e;
    return key_write(dir, name, "pub", pub, 0644);
}

static enum dsv4_err
curve_setup(void *s, const struct dsv4_zsock_cfg *cfg, bool bind)
{
    const char *dir = cfg->key_dir != NULL ? cfg->key_dir : DSV4_ZSOCK_KEY_DIR;
    char path[PATH_MAX_DSV4];
    char key[DSV4_ZSOCK_Z85_LEN + 1];
    char pub[DSV4_ZSOCK_Z85_LEN + 1], sec[DSV4_ZSOCK_Z85_LEN + 1];
    enum dsv4_err e;

    if (!zmq_has("curve"))
        return dsv4_err_set(DSV4_ERR_NOTSUP, "libzmq was built without CURVE");
    if (bind) {
        snprintf(path, sizeof(path), "%s/server.key", dir);
        if ((e = dsv4_zsock_key_read(path, key)) != DSV4_OK)
            return e;
        if ((e = sockopt_int(s, ZMQ_CURVE_SERVER, 1, "CURVE_SERVER")) != DSV4_OK)
            return e;
        e = sockopt(s, ZMQ_CURVE_SECRETKEY, key, DSV4_ZSOCK_Z85_LEN, "CURVE_SECRETKEY");
        memset(key, 0, sizeof(key));
        return e;
    }
    if (cfg->server_key != NULL) {
        if (strlen(cfg->server_key) != DSV4_ZSOCK_Z85_LEN)
            return dsv4_err_set(DSV4_ERR_CONFIG, "CURVE server key is not %d Z85 characters",
                DSV4_ZSOCK_Z85_LEN);
        memcpy(key, cfg->server_key, sizeof(key));
    } else {
        snprintf(path, sizeof(path), "%s/server.pub", dir);
        if ((e = dsv4_zsock_key_read(path, key)) != DSV4_OK)
            return e;
    }
    if (zmq_curve_keypair(pub, sec) != 0)
        return dsv4_err_set(DSV4_ERR_SYS, "zmq_curve_keypair: %s", zmq_strerror(errno));
    if ((e = sockopt(s, ZMQ_CURVE_SERVERKEY, key, DSV4_ZSOCK_Z85_LEN, "CURVE_SERVERKEY")) !=
            DSV4_OK ||
        (e = sockopt(s, ZMQ_CURVE_PUBLICKEY, pub, DSV4_ZSOCK_Z85_LEN, "CURVE_PUBLICKEY")) !=
            DSV4_OK ||
        (e = sockopt(s, ZMQ_CURVE_SECRETKEY, sec, DSV4_ZSOCK_Z85_LEN, "CURVE_SECRETKEY")) !=
            DSV4_OK)
        return e;
    memset(sec, 0, sizeof(sec));
    return DSV4_OK;
}

/* The refusal of an abstract (ipc://@NAME) bind with a file mode, by the
 * check and by the open alike: it has no file, so its access cannot be
 * limited. */
static enum dsv4_err
abstract_mode_refused(const char *ep, unsigned mode)
{
    return dsv4_err_set(DSV4_ERR_CONFIG, "%s: an abstract socket has no file mode, so its "
        "access cannot be limited (mode %o): use a path", ep, mode);
}

/* chmod the file of the ipc:// endpoint `s` is bound to. */
static enum dsv4_err
ipc_chmod(void *s, unsigned mode)
{
    char ep[PATH_MAX_DSV4];
    size_t len = sizeof(ep);

    if (zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len) != 0)
        return dsv4_err_set(DSV4_ERR_SYS, "ZMQ_LAST_ENDPOINT: %s", zmq_strerror(errno));
    if (strncmp(ep, IPC_PREFIX, strlen(IPC_PREFIX)) != 0)
        return DSV4_OK;
    if (ep[strlen(IPC_PREFIX)] == '@')
        return abstract_mode_refused(ep, mode);
    if (chmod(ep + strlen(IPC_PREFIX), (mode_t)mode) != 0)
        return dsv4_err_set(DSV4_ERR_SYS, "chmod %s: %s", ep + strlen(IPC_PREFIX),
            strerror(errno));
    return DSV4_OK;
}

/* Before an ipc:// bind: libzmq unlinks the file at the path and binds
 * afresh, so a socket a live process listens on (another scheduler of the
 * same configuration) would be taken from it without a word.  A stale
 * file, or none, is libzmq's to replace; '*' and '@NAME' have no file. */
static enum dsv4_err
ipc_bind_free(const char *ep)
{
    const char *path = ep + strlen(IPC_PREFIX);

    if (strncmp(ep, IPC_PREFIX, strlen(IPC_PREFIX)) != 0 || strcmp(path, "*") == 0 ||
        path[0] == '@' || path[0] == '\0')
        return DSV4_OK;
    if (unix_sock_live(path))
        return dsv4_err_set(DSV4_ERR_BUSY, "%s: in use by a running process", ep);
    return DSV4_OK;
}

static enum dsv4_err
zsock_setup(void *s, const struct dsv4_zsock_cfg *cfg, const char *ep, bool bind)
{
    enum dsv4_err e;
    bool curve;

    if ((e = sockopt_int(s, ZMQ_LINGER, 0, "LINGER")) != DSV4_OK)
        return e;
    if (cfg->type == ZMQ_ROUTER &&
        (e = sockopt_int(s, ZMQ_ROUTER_MANDATORY, 1, "ROUTER_MANDATORY")) != DSV4_OK)
        return e;
    if (cfg->hwm > 0 &&
        ((e = sockopt_int(s, ZMQ_SNDHWM, cfg->hwm, "SNDHWM")) != DSV4_OK ||
            (e = sockopt_int(s, ZMQ_RCVHWM, cfg->hwm, "RCVHWM")) != DSV4_OK))
        return e;
    if (cfg->maxmsgsize != 0 &&
        (e = sockopt(s, ZMQ_MAXMSGSIZE, &cfg->maxmsgsize, sizeof(cfg->maxmsgsize),
             "MAXMSGSIZE")) != DSV4_OK)
        return e;
    if (cfg->heartbeat_ms > 0 &&
        ((e = sockopt_int(s, ZMQ_HEARTBEAT_IVL, cfg->heartbeat_ms, "HEARTBEAT_IVL")) != DSV4_OK ||
            (e = sockopt_int(s, ZMQ_HEARTBEAT_TIMEOUT, HB_TIMEOUT_FACTOR * cfg->heartbeat_ms,
                 "HEARTBEAT_TIMEOUT")) != DSV4_OK ||
            (e = sockopt_int(s, ZMQ_HEARTBEAT_TTL, HB_TIMEOUT_FACTOR * cfg->heartbeat_ms,
                 "HEARTBEAT_TTL")) != DSV4_OK))
        return e;
    curve = cfg->curve == DSV4_CURVE_ON ||
        (cfg->curve == DSV4_CURVE_AUTO && strncmp(ep, TCP_PREFIX, strlen(TCP_PREFIX)) == 0);
    if (curve && (e = curve_setup(s, cfg, bind)) != DSV4_OK)
        return e;
    if (cfg->fd >= 0) {
        if (!bind)
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: an adopted fd needs a bind endpoint", ep);
        if ((e = sockopt_int(s, ZMQ_USE_FD, cfg->fd, "USE_FD")) != DSV4_OK)
            return e;
    }
    if (bind && cfg->fd < 0 && (e = ipc_bind_free(ep)) != DSV4_OK)
        return e;
    if (bind ? zmq_bind(s, ep) != 0 : zmq_connect(s, ep) != 0)
        return dsv4_err_set(DSV4_ERR_SYS, "%s %s: %s", bind ? "bind" : "connect", ep,
            zmq_strerror(errno));
    if (bind && cfg->mode != 0)
        return ipc_chmod(s, cfg->mode);
    return DSV4_OK;
}

#define IPC_PATH_MAX 107   /* sockaddr_un.sun_path less its NUL, as libzmq checks */
#define INPROC_PREFIX "inproc://"

/* ipc://PATH: the path fits; a bind's directory exists and is writable
 * ("*" binds a fresh temporary name, "@NAME" the abstract namespace). */
static enum dsv4_err
check_ipc(const char *ep, const char *path, bool bind, unsigned mode)
{
    char dir[PATH_MAX_DSV4];
    const char *slash = strrchr(path, '/');
    struct stat st;

    if (*path == '\0')
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: no socket path", ep);
    if (strlen(path) > IPC_PATH_MAX)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: the socket path is longer than %d bytes",
            ep, IPC_PATH_MAX);
    if (bind && path[0] == '@' && mode != 0)
        return abstract_mode_refused(ep, mode);
    if (!bind || strcmp(path, "*") == 0 || path[0] == '@')
        return DSV4_OK;
    if (slash == NULL)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == path)
        snprintf(dir, sizeof(dir), "/");
    else
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: no directory %s", ep, dir);
    if (access(dir, W_OK | X_OK) != 0)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: cannot create the socket in %s: %s", ep,
            dir, strerror(errno));
    return DSV4_OK;
}

/* tcp://HOST:PORT (HOST may be [v6], a name, an interface or '*'). */
static enum dsv4_err
check_tcp(const char *ep, const char *addr, bool bind)
{
    const char *colon = strrchr(addr, ':');
    char *end;
    long port;

    if (colon == NULL || colon == addr)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: not tcp://HOST:PORT", ep);
    if (!bind && colon - addr == 1 && addr[0] == '*')
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: '*' is no host to connect to", ep);
    if (bind && strcmp(colon + 1, "*") == 0)
        return DSV4_OK;
    errno = 0;
    port = strtol(colon + 1, &end, 10);
    if (colon[1] == '\0' || *end != '\0' || errno != 0 || port < 1 || port > 65535)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: the port is not a number of 1 ... 65535%s",
            ep, bind ? " or *" : "");
    return DSV4_OK;
}

void *
dsv4_zsock_open(void *zctx, const struct dsv4_zsock_cfg *cfg, enum dsv4_err *err)
{
    const char *ep = cfg->endpoint;
    bool bind = cfg->bind;
    enum dsv4_err e;
    void *s;

    if (ep == NULL || *ep == '\0') {
        e = dsv4_err_set(DSV4_ERR_CONFIG, "no endpoint configured");
        goto fail;
    }
    if (*ep == '@' || *ep == '>') {
        bind = *ep == '@';
        ep++;
    }
    /* libzmq takes tcp ports modulo 65536: 99999 would bind 34463 */
    if (strncmp(ep, TCP_PREFIX, strlen(TCP_PREFIX)) == 0 &&
        (e = check_tcp(ep, ep + strlen(TCP_PREFIX), bind)) != DSV4_OK)
        goto fail;
    if ((s = zmq_socket(zctx, cfg->type)) == NULL) {
        e = dsv4_err_set(DSV4_ERR_SYS, "zmq_socket: %s", zmq_strerror(errno));
        goto fail;
    }
    /* before the connect: libzmq's I/O thread may report the connection
     * before a monitor attached after it listens */
    if (cfg->mon != NULL)
        *cfg->mon = dsv4_zsock_mon_open(zctx, s, cfg->mon_events);
    if ((e = zsock_setup(s, cfg, ep, bind)) != DSV4_OK) {
        if (cfg->mon != NULL) {
            dsv4_zsock_mon_close(s, *cfg->mon);
            *cfg->mon = NULL;
        }
        zmq_close(s);
        goto fail;
    }
    if (err != NULL)
        *err = DSV4_OK;
    return s;
fail:
    if (err != NULL)
        *err = e;
    return NULL;
}

enum dsv4_err
dsv4_zsock_check(const struct dsv4_zsock_cfg *cfg)
{
    const char *ep = cfg->endpoint, *dir;
    char path[PATH_MAX_DSV4], key[DSV4_ZSOCK_Z85_LEN + 1];
    bool bind = cfg->bind, curve;
    enum dsv4_err e;

    if (ep == NULL || *ep == '\0')
        return dsv4_err_set(DSV4_ERR_CONFIG, "no endpoint configured");
    if (*ep == '@' || *ep == '>') {
        bind = *ep == '@';
        ep++;
    }
    if (strncmp(ep, IPC_PREFIX, strlen(IPC_PREFIX)) == 0)
        e = check_ipc(ep, ep + strlen(IPC_PREFIX), bind, cfg->mode);
    else if (strncmp(ep, TCP_PREFIX, strlen(TCP_PREFIX)) == 0)
        e = check_tcp(ep, ep + strlen(TCP_PREFIX), bind);
    else if (strncmp(ep, INPROC_PREFIX, strlen(INPROC_PREFIX)) == 0 &&
             ep[strlen(INPROC_PREFIX)] != '\0')
        e = DSV4_OK;
    else
        e = dsv4_err_set(DSV4_ERR_CONFIG, "%s: not ipc://PATH, tcp://HOST:PORT or "
            "inproc://NAME", ep);
    if (e != DSV4_OK)
        return e;
    curve = cfg->curve == DSV4_CURVE_ON ||
        (cfg->curve == DSV4_CURVE_AUTO && strncmp(ep, TCP_PREFIX, strlen(TCP_PREFIX)) == 0);
    if (!curve || (!bind && cfg->server_key != NULL))
        return DSV4_OK;
    dir = cfg->key_dir != NULL ? cfg->key_dir : DSV4_ZSOCK_KEY_DIR;
    snprintf(path, sizeof(path), "%s/server.%s", dir, bind ? "key" : "pub");
    e = dsv4_zsock_key_read(path, key);
    memset(key, 0, sizeof(key));
    return e;
}

void
dsv4_zsock_close(void *sock)
{
    if (sock != NULL)
        zmq_close(sock);
}

/* --- Messages --------------------------------------------------------- */

static bool
is_router(void *sock)
{
    int type = 0;
    size_t len = sizeof(type);

    return zmq_getsockopt(sock, ZMQ_TYPE, &type, &len) == 0 && type == ZMQ_ROUTER;
}

enum dsv4_err
dsv4_zsock_send(void *sock, const struct dsv4_route *to, const struct dsv4_msg *m, int flags,
    struct dsv4_perr *pe)
{
    struct dsv4_wire w;
    enum dsv4_err e;
    bool first = true;
    int rc;

    if ((e = dsv4_msg_encode(m, &w, pe)) != DSV4_OK)
        return e;
#define SEND(p, n, more)                                                        \
    do {                                                                        \
        rc = zmq_send(sock, p, n, (first ? flags : 0) | ((more) ? ZMQ_SNDMORE : 0)); \
        if (rc < 0)                                                             \
            goto fail;                                                          \
        first = false;                                                          \
    } while (0)
    if (is_router(sock)) {
        if (to == NULL || to->len == 0) {
            dsv4_wire_clear(&w);
            return dsv4_err_set(DSV4_ERR_INVAL, "send on a ROUTER socket without a route");
        }
        SEND(to->id, to->len, true);
    }
    SEND("", 0, true);
    SEND(w.sig, DSV4_PROTO_SIG_LEN, true);
    SEND(&w.cmd, 1, true);
    SEND(w.body, w.body_len, w.n_raw > 0);
    for (uint32_t i = 0; i < w.n_raw; i++)
        SEND(w.raw[i].data, w.raw[i].len, i + 1 < w.n_raw);
#undef SEND
    dsv4_wire_clear(&w);
    return DSV4_OK;
fail:
    e = errno == EAGAIN && first ? DSV4_ERR_BUSY : DSV4_ERR_SYS;
    dsv4_err_set(e, "send %s: %s", dsv4_proto_cmd_name(m->sub, m->cmd), zmq_strerror(errno));
    dsv4_wire_clear(&w);
    return e;
}

enum dsv4_err
dsv4_zsock_recv(void *sock, struct dsv4_route *from, struct dsv4_msg *m, struct dsv4_perr *pe,
    int flags)
{
    zmq_msg_t part[DSV4_PROTO_MAX_FRAMES + 1];
    struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES];
    const size_t cap = sizeof(part) / sizeof(part[0]);
    size_t n = 0, extra = 0, skip;
    bool router = is_router(sock), more;
    enum dsv4_err e;

    memset(m, 0, sizeof(*m));
    memset(pe, 0, sizeof(*pe));
    if (from != NULL)
        from->len = 0;
    do {
        zmq_msg_t tmp;

        zmq_msg_init(&tmp);
        if (zmq_msg_recv(&tmp, sock, n + extra == 0 ? flags : 0) < 0) {
            int saved = errno;

            zmq_msg_close(&tmp);
            for (size_t i = 0; i < n; i++)
                zmq_msg_close(&part[i]);
            errno = saved;
            if (n + extra == 0 && saved == EAGAIN)
                return DSV4_ERR_BUSY;
            return dsv4_err_set(DSV4_ERR_SYS, "recv: %s", zmq_strerror(saved));
        }
        more = zmq_msg_more(&tmp);
        if (n < cap)
            part[n++] = tmp;
        else {
            zmq_msg_close(&tmp);
            extra++;
        }
    } while (more);

    skip = 0;
    if (router) {
        skip = 1;
        if (from != NULL && zmq_msg_size(&part[0]) <= DSV4_ZSOCK_MAX_ROUTE) {
            from->len = (uint8_t)zmq_msg_size(&part[0]);
            memcpy(from->id, zmq_msg_data(&part[0]), from->len);
        }
    }
    for (size_t i = skip; i < n && i - skip < DSV4_PROTO_MAX_FRAMES; i++) {
        fr[i - skip].data = zmq_msg_data(&part[i]);
        fr[i - skip].len = zmq_msg_size(&part[i]);
    }
    if (n - skip > DSV4_PROTO_MAX_FRAMES)
        extra += n - skip - DSV4_PROTO_MAX_FRAMES;
    e = dsv4_msg_decode(m, fr, n - skip > DSV4_PROTO_MAX_FRAMES ? DSV4_PROTO_MAX_FRAMES :
        n - skip, pe);
    if (extra > 0) {
        dsv4_msg_clear(m);
        pe->code = DSV4_STATUS_TOO_LARGE;
        snprintf(pe->message, sizeof(pe->message), "more than %d frames",
            DSV4_PROTO_MAX_FRAMES);
        e = dsv4_err_set(DSV4_ERR_INVAL, "%s", pe->message);
    }
    for (size_t i = 0; i < n; i++)
        zmq_msg_close(&part[i]);
    return e;
}

enum dsv4_err
dsv4_zsock_send_perr(void *sock, const struct dsv4_route *to, const struct dsv4_perr *pe)
{
    static const int err_cmd[DSV4_SUB__COUNT] = {
        [DSV4_SUB_CLI] = DSV4_CLI_ERROR,
        [DSV4_SUB_RANK] = DSV4_RANK_ERROR,
        [DSV4_SUB_CTL] = DSV4_CTL_RESULT,
    };
    struct dsv4_msg m;

    if ((int)pe->sub <= DSV4_SUB_NONE || pe->sub >= DSV4_SUB__COUNT)
        return DSV4_OK;
    dsv4_msg_init(&m, pe->sub, err_cmd[pe->sub]);
    m.u.error.id = pe->id;
    m.u.error.req = pe->req;
    m.u.error.code = pe->code;
    m.u.error.message = pe->message;
    return dsv4_zsock_send(sock, to, &m, ZMQ_DONTWAIT, NULL);
}

/* --- Liveness ------------------------------------------------------------ */

int64_t
dsv4_now_ms(void)
{
    return dsv4_now_us() / 1000;
}

int64_t
dsv4_now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void
dsv4_liveness_init(struct dsv4_liveness *l, uint32_t interval_ms, uint32_t liveness,
    int64_t now_ms)
{
    l->interval_ms = interval_ms;
    l->liveness = liveness;
    l->last_rx_ms = now_ms;
    l->last_tx_ms = now_ms;
}

void
dsv4_liveness_rx(struct dsv4_liveness *l, int64_t now_ms)
{
    l->last_rx_ms = now_ms;
}

void
dsv4_liveness_tx(struct dsv4_liveness *l, int64_t now_ms)
{
    l->last_tx_ms = now_ms;
}

bool
dsv4_liveness_dead(const struct dsv4_liveness *l, int64_t now_ms)
{
    return now_ms - l->last_rx_ms >= (int64_t)l->interval_ms * l->liveness;
}

bool
dsv4_liveness_due(const struct dsv4_liveness *l, int64_t now_ms)
{
    return now_ms - l->last_tx_ms >= (int64_t)l->interval_ms;
}

int64_t
dsv4_liveness_next_ms(const struct dsv4_liveness *l, int64_t now_ms)
{
    int64_t due = l->last_tx_ms + l->interval_ms - now_ms;
    int64_t dead = l->last_rx_ms + (int64_t)l->interval_ms * l->liveness - now_ms;
    int64_t t = due < dead ? due : dead;

    return t < 0 ? 0 : t;
}

void *
dsv4_zsock_mon_open(void *zctx, void *sock, int events)
{
    char ep[64];
    int zero = 0;
    void *mon;

    snprintf(ep, sizeof(ep), "inproc://dsv4-monitor-%p", sock);
    if (zmq_socket_monitor(sock, ep, events) != 0)
        return NULL;
    if ((mon = zmq_socket(zctx, ZMQ_PAIR)) != NULL) {
        (void)zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof(zero));
        if (zmq_connect(mon, ep) == 0)
            return mon;
        zmq_close(mon);
    }
    (void)zmq_socket_monitor(sock, NULL, 0);
    return NULL;
}

void
dsv4_zsock_mon_close(void *sock, void *mon)
{
    if (mon == NULL)
        return;
    (void)zmq_socket_monitor(sock, NULL, 0);
    zmq_close(mon);
}

int
dsv4_zsock_mon_next(void *mon)
{
    zmq_msg_t f;
    uint16_t ev = 0;
    bool more;

    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, mon, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&f);
        return -1;
    }
    if (zmq_msg_size(&f) >= sizeof(ev))
        memcpy(&ev, zmq_msg_data(&f), sizeof(ev));
    more = zmq_msg_more(&f) != 0;
    zmq_msg_close(&f);
    while (more) {          /* the endpoint frame */
        zmq_msg_init(&f);
        more = zmq_msg_recv(&f, mon, 0) >= 0 && zmq_msg_more(&f) != 0;
        zmq_msg_close(&f);
    }
    return ev;
}
