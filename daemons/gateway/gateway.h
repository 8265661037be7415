/*
 * gateway.h — dsv4-gateway, the OpenAI-compatible HTTP front end of dsv4:
 * the table of contents of the program (docs/gateway.md is the user's view).
 *
 * The gateway is a client of the scheduler like any other: every generation
 * is one libdsv4client connection and request (ipc/dsv4/client.h); health and
 * the scheduler's metrics come from the admin socket (docs/protocol.md §7,
 * SHOW_STATUS and SHOW_RANKS).  HTTP is libmicrohttpd, one thread per
 * connection: a handler may block on its own dsv4_client while other
 * connections are served.  Nothing here parses HTTP by hand.
 *
 *   gateway.c      main: options, configuration, keys, listener (or the
 *                  socket systemd passed), sd_notify, signal loop, shutdown
 *   gw_http.c      routing, body limits, auth, errors, /v1/models, /health,
 *                  /metrics, the MHD callbacks
 *   gw_req.c       the JSON body of a generation into a request, or the
 *                  refusal to answer (no I/O; fuzzed by tests/fuzz)
 *   gw_gen.c       /v1/completions and /v1/chat/completions: the scheduler
 *                  request, JSON and SSE answers
 *   gw_metrics.c   the gateway's own counters and histograms, the admin
 *                  client, Prometheus text rendering
 *
 * Threads: MHD's connection threads run gw_http/gw_gen; the main thread
 * only waits for signals and pings the watchdog.  Shared state: struct gw
 * is read-only after startup except the members marked otherwise (each with
 * the lock that guards it).
 */
#ifndef DSV4_GATEWAY_H
#define DSV4_GATEWAY_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <sys/queue.h>

#include <json-c/json.h>
#include <microhttpd.h>

#include "common/config_file.h"
#include "common/tokenizer.h"
#include "dsv4/client.h"
#include "ipc/proto.h"

#define GW_MAX_KEYS 64            /* bearer tokens in the keys file */
#define GW_KEY_LEN 256            /* bytes of one token, with NUL */
#define GW_ADMIN_TIMEOUT_MS 3000  /* wait for one admin answer */
#define GW_POLL_MS 100            /* client wait slice: check for hang-ups */
#define GW_CANCEL_WAIT_MS 5000    /* wait for DONE after a cancel */
#define GW_JSON_DEPTH 32          /* json-c nesting limit of a request body */
#define GW_DEFAULT_MAX_TOKENS 256 /* when the request gives none */
#define GW_MAX_RANKS 256          /* ranks shown in /metrics and /health */
#define GW_DISCARD_MAX (64u << 20) /* body bytes read past the limit before hanging up */
#define GW_KEEPALIVE ": keep-alive\n\n" /* SSE comment a quiet stream sends (clients skip it) */

/* Histogram with fixed buckets (seconds), Prometheus cumulative on output. */
#define GW_HIST_BUCKETS 14
struct gw_hist {
    uint64_t count[GW_HIST_BUCKETS + 1]; /* per bucket (not cumulative); last = +Inf */
    double sum;
    uint64_t n;
};

/* Outcome of one generation request as the gateway saw it. */
enum gw_outcome {
    GW_OUT_STOP = 0,     /* finish_reason "stop" */
    GW_OUT_LENGTH,       /* finish_reason "length" */
    GW_OUT_DISCONNECT,   /* the HTTP client went away; request cancelled */
    GW_OUT_TIMEOUT,      /* gateway_timeout_ms or the scheduler's 408 (504) */
    GW_OUT_REJECTED,     /* refused before it ran: bad input, busy, draining */
    GW_OUT_ERROR,        /* failed while running, or the scheduler is gone */
    GW_OUT_CANCELLED,    /* cancelled by an operator (dsv4ctl cancel): finish_reason
                            "cancelled", the output so far kept */
    GW_OUT_N,
};

/* HTTP routes counted in dsv4_gateway_http_requests_total. */
enum gw_route {
    GW_R_COMPLETIONS = 0,
    GW_R_CHAT,
    GW_R_MODELS,
    GW_R_HEALTH,
    GW_R_METRICS,
    GW_R_OTHER,
    GW_R_N,
};

/* The gateway's own measurements (guarded by gw.mlock). */
struct gw_metrics {
    uint64_t http[GW_R_N][6];    /* by route and status class 1xx..5xx; [0] unused */
    uint64_t outcome[GW_OUT_N];
    uint64_t prompt_tokens, completion_tokens; /* usage of finished requests */
    uint64_t streams_active;     /* generations in flight now */
    struct gw_hist ttft;         /* submit -> first token */
    struct gw_hist itl;          /* between tokens (gap / tokens of the event) */
    struct gw_hist duration;     /* submit -> final event */
};

/* Where a connection's current request is (gw_deadline.c): its headers or
 * body are still coming (bounded by gateway_idle_s as a whole), or it is
 * being served (no bound here: gateway_timeout_ms). */
enum gw_phase { GW_PH_HEAD, GW_PH_BODY, GW_PH_SERVING };

/* A connection the deadline reaper watches (MHD's socket context). */
struct gw_sock {
    TAILQ_ENTRY(gw_sock) entry;
    int fd;
    enum gw_phase phase;
    int64_t since_ms;            /* when the phase began (monotonic) */
    bool cut;                    /* shut down by the reaper */
};
TAILQ_HEAD(gw_sock_list, gw_sock);

/* The gateway process: configuration, tokenizer, bearer keys, the HTTP
 * daemon, the admin connection to the scheduler, the metrics and the
 * connections whose requests are still arriving. */
struct gw {
    struct dsv4_conf conf;
    struct dsv4_tok *tok;        /* chat rendering, token pieces; encode under toklock */
    pthread_mutex_t toklock;
    int32_t eos;                 /* <｜end▁of▁sentence｜>, a stop id of every request */
    int32_t think_id;            /* <think>: a chat prompt ending with it asks for
                                    reasoning first (thinking mode) */
    /* bearer tokens, guarded by klock (SIGHUP replaces them while
     * connection threads check them) */
    pthread_mutex_t klock;
    char keys[GW_MAX_KEYS][GW_KEY_LEN];
    int n_keys;                  /* 0 = no authentication (no gateway_keys) */
    struct MHD_Daemon *mhd;
    atomic_bool stopping;        /* SIGTERM seen: refuse new generations (503) */
    /* admin client (gw_metrics.c), guarded by alock */
    pthread_mutex_t alock;
    void *zctx;
    void *admin;                 /* DEALER to admin_endpoint; NULL until first use */
    /* the status query in flight, shared by the callers that arrive while
     * it runs (gw_sched_query), guarded by qlock */
    pthread_mutex_t qlock;
    pthread_cond_t qdone;
    bool q_busy;                 /* a query is in flight */
    uint64_t q_count;            /* queries completed */
    struct gw_sched *q_last;     /* the last completed query's answer */
    int q_rc;                    /* ... and its result */
    /* metrics, guarded by mlock */
    pthread_mutex_t mlock;
    struct gw_metrics m;
    /* connections whose request is still arriving, guarded by dlock */
    pthread_mutex_t dlock;
    struct gw_sock_list socks;
    pthread_t reaper;
    bool reaper_up;
    atomic_bool reaper_stop;
};

/* --- gw_deadline.c ----------------------------------------------------- */

/* Start the reaper: a thread that shuts down every connection whose
 * request (headers, then body) has been arriving for longer than
 * gateway_idle_s — a client trickling a byte at a time never trips
 * libmicrohttpd's idle timeout.  0, or -1 with the reason logged. */
int gw_deadline_start(struct gw *g);
/* Stop and join the reaper (after MHD_stop_daemon). */
void gw_deadline_stop(struct gw *g);
/* MHD_OPTION_NOTIFY_CONNECTION: a connection opens (watched, its first
 * request's headers due) or closes. */
void gw_deadline_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
    enum MHD_ConnectionNotificationCode toe);
/* The request on `conn` moved to `phase` (gw_access: headers in, body in;
 * gw_completed: the next request's headers due). */
void gw_deadline_phase(struct gw *g, struct MHD_Connection *conn, enum gw_phase phase);

/* --- gw_http.c -------------------------------------------------------- */

/* Start libmicrohttpd on `listen_fd` (>= 0: socket passed by systemd) or on
 * conf.gateway_listen.  Returns 0, or -1 with the reason logged. */
int gw_http_start(struct gw *g, int listen_fd);

/* Whether `spec` is a listen address gw_http_start could use: HOST:PORT
 * ("[::1]:8000" for IPv6) that resolves; nothing is bound (dsv4-gateway
 * -n checks conf.gateway_listen with it).  0, or -1 with the reason
 * logged. */
int gw_listen_check(const char *spec);

/* Stop accepting, close every connection, join MHD's threads. */
void gw_http_stop(struct gw *g);

/* Stop accepting connections (libmicrohttpd's quiesce; the listening
 * socket is closed), the ones open are served on: the first step of a
 * graceful stop. */
void gw_http_quiesce(struct gw *g);

/* Queue a JSON error answer in the OpenAI shape:
 * {"error": {"message", "type", "param", "code"}}.  `code` may be NULL. */
enum MHD_Result gw_http_error(struct gw *g, struct MHD_Connection *conn,
    enum gw_route route, unsigned status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* Queue `body` (malloc'd, ownership passes) with `status` and `type`. */
enum MHD_Result gw_http_reply(struct gw *g, struct MHD_Connection *conn,
    enum gw_route route, unsigned status, const char *type, char *body, size_t len);

/* Queue the JSON text of `o` (released here) with `status`. */
enum MHD_Result gw_http_json(struct gw *g, struct MHD_Connection *conn,
    enum gw_route route, unsigned status, struct json_object *o);

/* True when the peer of `conn` has closed, half-closed or reset its socket
 * (docs/gateway.md "Client disconnects"). */
bool gw_http_peer_gone(struct MHD_Connection *conn);

/* OpenAI's error "type" for an HTTP status ("timeout_error" for 504, ...):
 * one table for JSON answers and stream error events alike. */
const char *gw_http_error_type(unsigned status);

/* A JSON string of raw bytes that may be invalid UTF-8 (a token piece, a
 * URL echoed in an error, a message cut mid-character): each maximal
 * ill-formed part becomes U+FFFD (the tokenizer's stream rule), so the
 * answer is valid UTF-8 JSON. */
struct json_object *gw_json_bytes(const char *s, size_t n);

/* --- gw_req.c ---------------------------------------------------------- */

#define GW_MAX_STOP 16            /* stop strings of a request (protocol limit) */
#define GW_MAX_TOP_LOGPROBS 20    /* top_logprobs (OpenAI's and the protocol's bound) */

/* A refused request: HTTP status, OpenAI error code, message. */
struct gw_bad {
    unsigned status;
    const char *code;
    char msg[512];
};

/* Record a refusal in b (the message printf-formatted, cut at its size);
 * returns -1. */
int gw_bad(struct gw_bad *b, unsigned status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* What a request body asks for (gw_req_parse).  Its strings point into the
 * body's json-c tree `o` or into `hold` (joined content parts); free with
 * gw_req_free.  stop_ids and tag are filled when it is submitted. */
struct gw_req {
    struct json_object *o;            /* the body, parsed */
    struct json_object *hold;         /* strings made while parsing */
    struct dsv4_client_params p;      /* sampling, limits, stops (p.stop = stops) */
    const char *stops[GW_MAX_STOP];
    int32_t stop_ids[1];
    const char *prompt;               /* completions: text prompt */
    int32_t *tokens;                  /* completions: id prompt (malloc'd) */
    size_t n_tokens;
    struct dsv4_chat_msg *msgs;       /* chat (malloc'd) */
    size_t n_msgs;
    struct dsv4_chat_opts copts;      /* chat: thinking, reasoning effort */
    bool stream;                      /* "stream" */
    bool include_usage;               /* "stream_options": {"include_usage"} */
    bool logprobs;                    /* chat "logprobs", completions "logprobs" set; the
                                         count of most likely tokens in p.top_logprobs */
    bool return_ids;                  /* "return_token_ids" */
    char tag[64];                     /* p.tag: "gateway <id>" */
};

/* Parse the body of POST /v1/chat/completions (chat) or /v1/completions:
 * one JSON object of at most GW_JSON_DEPTH levels, nothing after it, every
 * field checked (docs/gateway.md).  0 with *r filled; -1 with *b (400 for
 * a bad body, 404 for another model, 500 out of memory), *r then holding
 * what was parsed so far.  Either way free *r with gw_req_free. */
int gw_req_parse(const struct gw *g, bool chat, const char *body, size_t len, struct gw_req *r,
    struct gw_bad *b);
void gw_req_free(struct gw_req *r);

/* Append n bytes to t (kept NUL-terminated); -1 when out of memory. */
int gw_text_add(struct dsv4_tok_text *t, const char *s, size_t n);

/* --- gw_gen.c ---------------------------------------------------------- */

/* One generation request's state; lives in MHD's per-request pointer. */
struct gw_gen;

/* Serve POST /v1/completions (chat false) or /v1/chat/completions with the
 * complete body.  Queues the answer (JSON, or an SSE stream that the
 * connection thread then pulls).  *genp receives the state that
 * gw_gen_finish must release. */
enum MHD_Result gw_gen_handle(struct gw *g, struct MHD_Connection *conn, bool chat,
    const char *body, size_t len, struct gw_gen **genp);

/* The connection is done (answer sent, client gone, or timeout): cancel the
 * request if it still runs, count its outcome, free the state. */
void gw_gen_finish(struct gw *g, struct gw_gen *gen, bool client_gone);

/* --- gw_metrics.c ------------------------------------------------------- */

/* Count one observation of `seconds` into its bucket (the first upper
 * bound not below it) and the histogram's sum and count. */
void gw_hist_observe(struct gw_hist *h, double seconds);

/* Count an HTTP answer (route, status). */
void gw_metrics_http(struct gw *g, enum gw_route route, unsigned status);

/* Scheduler state for /health and /metrics, from SHOW_STATUS + SHOW_RANKS. */
struct gw_rank {
    char role[16];
    uint32_t index, group, group_rank, active, capacity, rank_active;
    bool has_rank_active;
    uint32_t call_rows, call_rows_full;   /* a prefill rank's; valid iff has_call_rows */
    bool has_call_rows;
    uint32_t graphs_refused;              /* a decode rank's kinds of step without a CUDA
                                             graph; valid iff has_graphs_refused */
    bool has_graphs_refused;
    char state[16];
};

/* The scheduler's state as its admin socket last reported it (/metrics,
 * /health). */
struct gw_sched {
    bool up;                    /* the admin socket answered */
    bool draining;
    bool has_metrics;
    uint64_t uptime_ms, n_done, n_failed, n_cancelled, n_rejected;
    uint64_t tokens_in, tokens_out, handoffs, reruns, rank_deaths;
    bool has_handoff;           /* the scheduler sent its handoff histogram */
    uint64_t handoff_le[DSV4_PROTO_HANDOFF_BUCKETS]; /* cumulative, per bound */
    uint64_t handoff_sum_us, handoff_count;
    uint32_t n_ranks, n_ranks_ready, n_queued, n_running;
    struct gw_rank ranks[GW_MAX_RANKS];
    int n;
};

/* Ask the scheduler (admin socket) for its status and ranks.  0, or -1 when
 * it did not answer in GW_ADMIN_TIMEOUT_MS (s->up false).  A caller that
 * arrives while another's query is in flight takes that query's answer
 * instead of waiting behind it for one of its own (so probes and scrapes
 * of a silent scheduler each wait one timeout at most, not one apiece). */
int gw_sched_query(struct gw *g, struct gw_sched *s);

/* True when some decode group has every known member ready and a prefill
 * rank is ready: the set can serve a request.  `why` gets the reason if not. */
bool gw_sched_serving(const struct gw_sched *s, char *why, size_t len);

/* Render /metrics (Prometheus text format 0.0.4) into a malloc'd string. */
char *gw_metrics_render(struct gw *g, size_t *len);

/* Close the admin socket and context. */
void gw_admin_close(struct gw *g);

#endif
