/*
 * dsv4/client.h — libdsv4client, the C client library of the dsv4 inference
 * server (DeepSeek-V4-Flash).  Public, installed, stable ABI (symbols listed
 * in client.map); link with `pkg-config --libs dsv4client`.
 *
 * One connection (struct dsv4_client) is a ZeroMQ DEALER socket to the
 * scheduler's client endpoint; any number of requests can be in flight on it.
 * Output arrives as events (accepted, tokens, done, error) from
 * dsv4_client_next(), interleaved across requests and tagged with the id that
 * dsv4_client_submit_*() returned.  Wire protocol: docs/protocol.md.
 *
 * Threads: a connection is NOT thread-safe; use it from one thread at a time
 * (different threads may use it one after the other).  Distinct connections
 * are independent and may be used concurrently from different threads.
 * dsv4_client_strerror, dsv4_client_version and the *_init functions are
 * thread-safe.
 *
 * Errors: functions return 0 on success or a status code.  Codes equal the
 * protocol's 3-digit status codes (enum dsv4_client_code): 3xx retry later,
 * 4xx caller error, 5xx server error; 504 means the server did not answer.
 *
 * Scheduler restarts (since 1.1): when the connection drops and comes back
 * (dsv4-sched killed and started again, its listener kept by systemd or
 * dsv4-launch), every request in flight is sent again with what it already
 * received (docs/protocol.md §4.6) and goes on where it was: the caller sees
 * one ACCEPTED and each token once, and the output equals an undisturbed
 * run's.  The library keeps a copy of each request's prompt and output for
 * this until its final event.  A scheduler that stays away longer than
 * connect_timeout_ms past the 1 s heartbeat still ends the requests with
 * 504, and so does a request that cannot go on exactly (the scheduler's OK
 * named no seed and tokens had come, or the resend did not fit the
 * connection's queue).  A request cancelled while the connection was down
 * is cancelled again on the new one.  Request ids stay below 2^48 (the
 * bits above mark resumes on the wire).  Since 1.3 the same holds for a
 * scheduler stopped on purpose while its ranks serve on (systemctl restart
 * dsv4-sched): what it has not finished within its stop_timeout_ms it
 * answers with 302, and the library resumes those requests on the next
 * scheduler instead of ending them (the caller sees no 302 unless the
 * request cannot go on exactly).  Since 1.4.1 a request cancelled while it
 * waits for the next scheduler ends with DONE cancelled at once, a resend
 * the next scheduler refuses ends with 504, and the server's silence is
 * counted from a heartbeat it did not answer (a caller away from
 * dsv4_client_next for a while loses nothing by it).  Since 1.4.2 a
 * connect that reaches another endpoint of the scheduler (its admin or
 * rank endpoint, which answer in DSV4A1 / DSV4R1) fails with 501 saying so
 * (before, it succeeded and every request waited for ever), and the
 * connect's HEARTBEAT goes again on each new connection and each second
 * without an answer (one lost with a scheduler killed under the connect
 * made it wait out its whole timeout, then fail with 504, while the next
 * scheduler served).
 */
#ifndef DSV4_CLIENT_H
#define DSV4_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_CLIENT_VERSION_MAJOR 1
#define DSV4_CLIENT_VERSION_MINOR 4
#define DSV4_CLIENT_VERSION_PATCH 2

#if defined(DSV4_CLIENT_BUILD)
#define DSV4_API __attribute__((visibility("default")))
#else
#define DSV4_API
#endif

/* Return and event codes (protocol status codes, docs/protocol.md §3). */
enum dsv4_client_code {
    DSV4_CLIENT_OK = 0,               /* success */
    DSV4_CLIENT_NONE = 1,             /* dsv4_client_next: no event within the wait */
    DSV4_CLIENT_BUSY = 300,           /* no capacity now; retry later */
    DSV4_CLIENT_DRAINING = 301,       /* server draining; retry later or elsewhere */
    DSV4_CLIENT_RESTARTING = 302,     /* scheduler restarting: the library resumes the
                                         request (seen only where it cannot) */
    DSV4_CLIENT_BAD_MESSAGE = 400,    /* malformed message */
    DSV4_CLIENT_BAD_ARGUMENT = 401,   /* invalid argument (range, NULL, inconsistent) */
    DSV4_CLIENT_NOT_FOUND = 404,      /* unknown request id */
    DSV4_CLIENT_TIMEOUT = 408,        /* the request's timeout passed */
    DSV4_CLIENT_CANCELLED = 409,      /* cancelled */
    DSV4_CLIENT_TOO_LARGE = 413,      /* a size limit was exceeded */
    DSV4_CLIENT_SLOW_CONSUMER = 429,  /* output was not read fast enough */
    DSV4_CLIENT_INTERNAL = 500,       /* server-side failure (or local system error) */
    DSV4_CLIENT_NOT_SUPPORTED = 501,  /* not supported by this server */
    DSV4_CLIENT_NO_MEMORY = 503,      /* out of memory */
    DSV4_CLIENT_UNREACHABLE = 504,    /* no answer from the server */
};

/* Why a request finished (DONE event). */
enum dsv4_client_finish {
    DSV4_CLIENT_FINISH_STOP = 1,      /* stop string or stop token */
    DSV4_CLIENT_FINISH_LENGTH = 2,    /* max_tokens reached */
    DSV4_CLIENT_FINISH_CANCELLED = 3, /* dsv4_client_cancel */
};

/* What an event of dsv4_client_next is. */
enum dsv4_client_event_type {
    DSV4_CLIENT_EV_ACCEPTED = 1, /* the scheduler queued the request (req is set) */
    DSV4_CLIENT_EV_TOKENS = 2,   /* tokens, text, logprobs */
    DSV4_CLIENT_EV_DONE = 3,     /* final: finish, usage */
    DSV4_CLIENT_EV_ERROR = 4,    /* final: code, message */
};

/* Connection options.  Fill with dsv4_client_opts_init, then override. */
struct dsv4_client_opts {
    size_t size;                 /* sizeof(struct dsv4_client_opts); set by init */
    const char *server_key;      /* Z85 CURVE public key of the server (40 chars);
                                    enables CURVE; NULL = none */
    const char *server_key_file; /* file holding it (e.g. /etc/dsv4/server.pub);
                                    used when server_key is NULL; NULL = none */
    int connect_timeout_ms;      /* connect: wait this long for the server to answer
                                    (504 otherwise); later: declare the server lost
                                    after this much silence past the 1 s heartbeat.
                                    Default 5000; 0 = do not check */
};

/* Per-request parameters.  Fill with dsv4_client_params_init, then override.
 * Ranges are those of docs/protocol.md §4.1; violations return 401/413 (a
 * prompt or stop string that is not UTF-8 text: 400, as the scheduler
 * answers such a message). */
struct dsv4_client_params {
    size_t size;                  /* sizeof(struct dsv4_client_params); set by init */
    float temperature;            /* [0, 10], 0 = greedy; default 1 */
    float top_p;                  /* (0, 1]; default 1 */
    uint32_t top_k;               /* 0 = off (default) */
    uint64_t seed;                /* used when has_seed */
    int has_seed;                 /* default 0: the server picks a seed */
    uint32_t max_tokens;          /* [1, 1048576]; default 256 */
    const char *const *stop;      /* stop strings, n_stop of them (<= 16, 1..256 bytes) */
    size_t n_stop;
    const int32_t *stop_ids;      /* stop token ids (<= 64) */
    size_t n_stop_ids;
    int logprobs;                 /* report log-probabilities; default 0 */
    int stream;                   /* default 1; 0 = one TOKENS event before DONE */
    const char *tag;              /* label shown by dsv4ctl (<= 128 bytes); NULL = none */
    uint32_t timeout_ms;          /* per-request deadline; 0 = none (default) */
    uint32_t reserved0;           /* 0; (the 1.3 struct's tail padding: a caller built
                                     against 1.3 passes a size that ends here, so what it
                                     left in those bytes is never read) */
    uint32_t top_logprobs;        /* since 1.4.0: report this many (<= 20) most likely
                                     tokens of each output position with their
                                     log-probabilities (dsv4_client_event_top);
                                     default 0 */
};

/*
 * One event.  Pointers stay valid until the next dsv4_client_next or
 * dsv4_client_close on the same connection.
 */
struct dsv4_client_event {
    int type;                  /* enum dsv4_client_event_type */
    uint64_t id;               /* request id from dsv4_client_submit_*; 0 for a
                                  connection-level ERROR */
    uint64_t req;              /* scheduler's id (0 until accepted) */
    const int32_t *tokens;     /* TOKENS: n_tokens ids */
    const float *logprobs;     /* TOKENS: n_tokens values, or NULL */
    size_t n_tokens;
    const char *text;          /* TOKENS: UTF-8 piece (may be ""); else NULL */
    int finish;                /* DONE: enum dsv4_client_finish */
    uint32_t prompt_tokens;    /* DONE: usage */
    uint32_t completion_tokens;
    int code;                  /* ERROR: enum dsv4_client_code */
    const char *message;       /* ERROR: human-readable reason; else NULL */
    const char *tag;           /* ACCEPTED/DONE/ERROR: the request's tag, or NULL */
};

struct dsv4_client; /* opaque connection */

/* Library version (DSV4_CLIENT_VERSION_* of the built library). */
DSV4_API void dsv4_client_version(int *major, int *minor, int *patch);

/* Static description of a code ("invalid argument"); never NULL. */
DSV4_API const char *dsv4_client_strerror(int code);

/* Fill opts with the defaults (no CURVE key, connect_timeout_ms 5000) and
 * its size; call before setting any field. */
DSV4_API void dsv4_client_opts_init(struct dsv4_client_opts *opts);
/* Fill params with the defaults given beside each field (temperature 1,
 * top_p 1, max_tokens 256, streaming, no stops, no seed, no deadline) and
 * its size; call before setting any field. */
DSV4_API void dsv4_client_params_init(struct dsv4_client_params *params);

/*
 * Connect to `endpoint` ("ipc:///run/dsv4/client.sock", "tcp://host:port").
 * `opts` may be NULL (defaults).  With connect_timeout_ms > 0 this waits for
 * the server to answer a heartbeat.  On success *out is the connection.  A
 * connection may stay idle for any time: the server's silence counts only
 * while requests are in flight.
 */
DSV4_API int dsv4_client_connect(const char *endpoint, const struct dsv4_client_opts *opts,
    struct dsv4_client **out);

/* Close the connection and forget every request in flight.  No CANCEL is
 * sent and the scheduler keeps no client liveness (docs/protocol.md §4.4):
 * a streamed request ends at its next TOKENS that cannot be delivered, a
 * non-streamed one runs to its end.  Cancel first (dsv4_client_cancel) to
 * free the server at once.  NULL is a no-op. */
DSV4_API void dsv4_client_close(struct dsv4_client *c);

/*
 * Submit a request with a text prompt (UTF-8) or with token ids.  `params`
 * may be NULL (defaults).  Validates locally (a NULL stop string is 401),
 * sends GENERATE and returns at once; *id (may be NULL) receives the
 * request's id, unique on this connection.  The request's events then come
 * from dsv4_client_next.  300 (BUSY) when the connection's send queue is
 * full (its high-water mark: the server is not connected, or not reading);
 * nothing was sent then.
 */
DSV4_API int dsv4_client_submit_text(struct dsv4_client *c, const char *prompt,
    const struct dsv4_client_params *params, uint64_t *id);
DSV4_API int dsv4_client_submit_tokens(struct dsv4_client *c, const int32_t *ids, size_t n_ids,
    const struct dsv4_client_params *params, uint64_t *id);

/*
 * Wait up to timeout_ms (-1 = no limit, 0 = poll) for the next event of any
 * request on this connection.  Returns 0 with *ev filled, DSV4_CLIENT_NONE
 * when nothing happened in time, no request is in flight or a signal ended
 * the wait, or an error code when the connection failed.  Every request ends with exactly one DONE or
 * ERROR event; per-request timeouts and a lost server produce ERROR events
 * (408, 504) even when the server says nothing.
 */
DSV4_API int dsv4_client_next(struct dsv4_client *c, struct dsv4_client_event *ev,
    int timeout_ms);

/* Ask the server to cancel request `id`; it ends with a DONE event whose
 * finish is CANCELLED (or its normal end, if that came first).  404 when `id`
 * is not in flight; 300 (BUSY) when the send queue is full (call again). */
DSV4_API int dsv4_client_cancel(struct dsv4_client *c, uint64_t id);

/* Number of requests in flight (submitted, final event not yet returned). */
DSV4_API size_t dsv4_client_pending(const struct dsv4_client *c);

/*
 * Since 1.4.0.  For the TOKENS event the last dsv4_client_next on c
 * returned: the most likely tokens at the position of its token i (< its
 * n_tokens), best first (by probability at temperature 1, whatever the
 * request's sampling; the token sampled need not be among them), in *ids
 * with their log-probabilities in *logprobs (either may be NULL).  Returns
 * their count: at most the request's top_logprobs; 0 when it asked for
 * none, the server sent none (a server older than 1.4.0), i is out of
 * range or that event was not TOKENS.  The arrays stay valid as the event's
 * pointers do.
 */
DSV4_API size_t dsv4_client_event_top(const struct dsv4_client *c, size_t i,
    const int32_t **ids, const float **logprobs);

/* Detail of the last failure on this connection ("" if none).  With c NULL
 * (since 1.2.0): the calling thread's detail of its last failed
 * dsv4_client_connect (the file of a key that could not be read, a CURVE
 * handshake the server refused, ...), "" after a connect that worked. */
DSV4_API const char *dsv4_client_errmsg(const struct dsv4_client *c);

#ifdef __cplusplus
}
#endif
#endif
