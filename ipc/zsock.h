/*
 * zsock.h — ZeroMQ endpoints for dsv4: open a socket from a configuration
 * (bind or connect, ipc:// or tcp://, an fd passed by systemd, CURVE on TCP,
 * unix-socket file mode), send and receive whole protocol messages as
 * decoded structs (routing identity handled for ROUTER sockets), Z85 CURVE
 * key files, and protocol-level liveness bookkeeping.
 *
 * Made for one thread running a zmq_poll loop (the scheduler, a rank,
 * dsv4ctl, the client library).  Functions that take a socket must be called
 * from the thread that uses that socket; nothing here keeps global state.
 */
#ifndef DSV4_IPC_ZSOCK_H
#define DSV4_IPC_ZSOCK_H

#include <stdbool.h>
#include <stdint.h>

#include "common/err.h"
#include "ipc/proto.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_ZSOCK_KEY_DIR "/etc/dsv4"  /* default CURVE key directory */
#define DSV4_ZSOCK_Z85_LEN 40           /* characters of a Z85 CURVE key */
#define DSV4_ZSOCK_CTL_MODE 0660        /* default admin socket file mode */
#define DSV4_ZSOCK_MAX_ROUTE 255        /* bytes of a ZeroMQ routing identity */

/* CURVE policy of an endpoint. */
enum dsv4_curve {
    DSV4_CURVE_AUTO = 0, /* on for tcp://, off for ipc:// and inproc:// */
    DSV4_CURVE_OFF,      /* never (tests, trusted networks) */
    DSV4_CURVE_ON,       /* always; fails if keys are missing */
};

/* How to open one socket.  Start from dsv4_zsock_cfg_init(). */
struct dsv4_zsock_cfg {
    const char *endpoint;   /* "ipc://PATH" or "tcp://HOST:PORT"; a leading '@'
                               forces bind, '>' forces connect */
    int type;               /* ZMQ_ROUTER, ZMQ_DEALER, ... */
    bool bind;              /* direction without a prefix; default false */
    int fd;                 /* >= 0: adopt this bound+listening fd (ZMQ_USE_FD,
                               systemd socket activation); bind only; -1 = none */
    enum dsv4_curve curve;  /* default AUTO */
    const char *key_dir;    /* server.key / server.pub; NULL = DSV4_ZSOCK_KEY_DIR */
    const char *server_key; /* connecting side: Z85 server public key; NULL =
                               read <key_dir>/server.pub when CURVE is on */
    unsigned mode;          /* ipc:// bind: chmod the socket file; 0 = leave */
    int heartbeat_ms;       /* ZMTP heartbeats (IVL; TIMEOUT/TTL = 3x); 0 = off */
    int hwm;                /* send and receive high-water marks; 0 = default */
    int64_t maxmsgsize;     /* ZMQ_MAXMSGSIZE; default body limit + 1 MiB; -1 = none */
    void **mon;             /* not NULL: a monitor of the events mon_events
                               (dsv4_zsock_mon_open) attached BEFORE the bind or
                               connect, so that none of its events is missed,
                               into *mon (NULL when it could not be made; closed
                               with the socket when the open fails) */
    int mon_events;
};

/* Defaults: no endpoint, DEALER, connect, fd -1, CURVE AUTO, key_dir NULL,
 * mode 0, no heartbeat, default HWM, maxmsgsize as documented above, no
 * monitor. */
void dsv4_zsock_cfg_init(struct dsv4_zsock_cfg *cfg);

/*
 * Create a socket in `zctx` and bind or connect it as `cfg` says.  ROUTER
 * sockets get ZMQ_ROUTER_MANDATORY (unroutable sends fail with EHOSTUNREACH
 * instead of vanishing); every socket gets ZMQ_LINGER 0.  A CURVE server
 * reads its secret key from <key_dir>/server.key; a CURVE client makes an
 * ephemeral key pair.  After binding an ipc:// endpoint with cfg->mode != 0
 * the socket file is chmod'ed (do this in a directory only the service can
 * write, so nobody connects in between).  A tcp:// port outside 1 ... 65535
 * ('*' to bind a free one) is refused (libzmq would take it modulo 65536).
 * An ipc:// bind (not an adopted fd) to a socket file a live process
 * listens on is refused with DSV4_ERR_BUSY ("ENDPOINT: in use by a running
 * process"): libzmq would unlink the file and take the endpoint from it;
 * a stale file is replaced as before.  Returns the socket, or NULL with
 * the reason in dsv4_errmsg() (*err set when err != NULL).
 */
void *dsv4_zsock_open(void *zctx, const struct dsv4_zsock_cfg *cfg, enum dsv4_err *err);

/*
 * What dsv4_zsock_open would refuse in `cfg`, found without a socket (the
 * daemons' -n check, their units' ExecStartPre=): the endpoint's form
 * (ipc://PATH with PATH at most 107 bytes, tcp://HOST:PORT with PORT a
 * number of 1 ... 65535, or '*' when binding, inproc://NAME); for an ipc://
 * bind, a writable directory; with CURVE on, the key file the socket would
 * read (server.key to bind, server.pub to connect unless server_key is set).
 * Returns DSV4_OK or DSV4_ERR_CONFIG with the reason in dsv4_errmsg().  Name resolution and address conflicts
 * are left to the open.
 */
enum dsv4_err dsv4_zsock_check(const struct dsv4_zsock_cfg *cfg);

/* Close a socket from dsv4_zsock_open; NULL is a no-op. */
void dsv4_zsock_close(void *sock);

/* --- CURVE keys ------------------------------------------------------- */

/*
 * Generate a CURVE key pair and write <dir>/<name>.key (secret, mode 0600)
 * and <dir>/<name>.pub (public, mode 0644), each one Z85 line.  Refuses to
 * overwrite existing files.  This is what `dsv4ctl keygen` calls.
 */
enum dsv4_err dsv4_zsock_keygen(const char *dir, const char *name);

/* Read one Z85 key (40 characters, optional trailing newline) from `path`
 * into z85 (NUL-terminated).  DSV4_ERR_CONFIG when malformed. */
enum dsv4_err dsv4_zsock_key_read(const char *path, char z85[DSV4_ZSOCK_Z85_LEN + 1]);

/* --- Messages over sockets ---------------------------------------------- */

/* A ROUTER routing identity; len 0 on DEALER sockets. */
struct dsv4_route {
    uint8_t id[DSV4_ZSOCK_MAX_ROUTE];
    uint8_t len;
};

/*
 * Encode `m` and send it as one multipart message: the routing frame (ROUTER
 * sockets: `to` is required), the empty delimiter, signature, command, body,
 * raw frames.  `flags` is 0 or ZMQ_DONTWAIT.  Returns DSV4_OK; DSV4_ERR_INVAL
 * when `m` fails validation (nothing sent; the status code and reason go to
 * `pe` when not NULL); DSV4_ERR_BUSY when the send would
 * block (ZMQ_DONTWAIT, high-water mark; nothing sent); DSV4_ERR_SYS otherwise
 * (errno kept: EHOSTUNREACH = the ROUTER peer is gone).
 */
enum dsv4_err dsv4_zsock_send(void *sock, const struct dsv4_route *to, const struct dsv4_msg *m,
    int flags, struct dsv4_perr *pe);

/*
 * Receive one whole multipart message and decode it into `m` (cleared
 * first; release with dsv4_msg_clear).  On ROUTER sockets the identity goes
 * into `from` (may be NULL elsewhere).  `flags` is 0 or ZMQ_DONTWAIT.
 * Returns DSV4_OK; DSV4_ERR_BUSY when nothing is waiting (ZMQ_DONTWAIT);
 * DSV4_ERR_PROTO / DSV4_ERR_INVAL when the message was malformed: it has been
 * consumed completely, `pe` (required) says why, and `from` still names the
 * sender so the caller can reply with dsv4_zsock_send_error; DSV4_ERR_SYS on
 * socket errors (ETERM, EINTR).
 */
enum dsv4_err dsv4_zsock_recv(void *sock, struct dsv4_route *from, struct dsv4_msg *m,
    struct dsv4_perr *pe, int flags);

/*
 * Reply to a refused message: client ERROR {id, req, code, message}, rank
 * ERROR {req, code, message} or admin RESULT {code, message}, as `pe->sub`
 * says (DSV4_SUB_NONE: nothing is sent, a peer that cannot speak the
 * protocol gets no answer).  Uses ZMQ_DONTWAIT.
 */
enum dsv4_err dsv4_zsock_send_perr(void *sock, const struct dsv4_route *to,
    const struct dsv4_perr *pe);

/* --- Liveness (docs/protocol.md §6) -------------------------------------- */

/* Monotonic clock in milliseconds. */
int64_t dsv4_now_ms(void);

/* The same clock in microseconds. */
int64_t dsv4_now_us(void);

/* Watch the events `events` (ZMQ_EVENT_* bits) of socket `sock` of
 * context `zctx`: zmq_socket_monitor publishes them on an inproc endpoint
 * named after `sock`, and a PAIR with no linger is connected to it.
 * Returns the PAIR (read it with dsv4_zsock_mon_next, close it with
 * dsv4_zsock_mon_close), or NULL when the monitor cannot be set up (then
 * nothing is left behind). */
void *dsv4_zsock_mon_open(void *zctx, void *sock, int events);

/* Stop the monitor of `sock` and close its PAIR `mon` (NULL: nothing). */
void dsv4_zsock_mon_close(void *sock, void *mon);

/* The next event of a socket monitor (the PAIR connected to the endpoint
 * zmq_socket_monitor publishes on): its ZMQ_EVENT_* number, its endpoint
 * frame read and dropped; -1 when none is waiting.  Does not block. */
int dsv4_zsock_mon_next(void *mon);

/* Heartbeat state of one peer. */
struct dsv4_liveness {
    int64_t last_rx_ms;   /* when anything last arrived from the peer */
    int64_t last_tx_ms;   /* when we last sent anything to it */
    uint32_t interval_ms; /* heartbeat interval */
    uint32_t liveness;    /* missed intervals until dead */
};

/* Start tracking at `now_ms` (counts as both received and sent). */
void dsv4_liveness_init(struct dsv4_liveness *l, uint32_t interval_ms, uint32_t liveness,
    int64_t now_ms);
/* Record that a message arrived from / was sent to the peer. */
void dsv4_liveness_rx(struct dsv4_liveness *l, int64_t now_ms);
void dsv4_liveness_tx(struct dsv4_liveness *l, int64_t now_ms);
/* True when nothing arrived for liveness * interval. */
bool dsv4_liveness_dead(const struct dsv4_liveness *l, int64_t now_ms);
/* True when we sent nothing for one interval: send HEARTBEAT now. */
bool dsv4_liveness_due(const struct dsv4_liveness *l, int64_t now_ms);
/* Milliseconds until the next of the two events above (>= 0): a zmq_poll
 * timeout. */
int64_t dsv4_liveness_next_ms(const struct dsv4_liveness *l, int64_t now_ms);

#ifdef __cplusplus
}
#endif
#endif
