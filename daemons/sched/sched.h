/*
 * sched.h — dsv4-sched, the scheduler daemon: the table of contents of the
 * program (constants, every struct, and the functions of each file grouped
 * under its name, OpenNTPD style).
 *
 * One process per deployment, one thread: a zmq_poll loop over the client
 * ROUTER, the rank ROUTER, the admin ROUTER and a signalfd, with a computed
 * timeout (heartbeats, deadlines, drain timeouts, watchdog).  It owns the
 * request table, the admission queue, the rank registry, drain state and the
 * metrics.  It holds no model state, so it restarts fast and ranks
 * re-register (docs/protocol.md §5, §6; DESIGN.md §1, §2).
 *
 * Invariant: every request lives in exactly one place of its life cycle —
 * the admission queue (QUEUED), on a prefill group (PREFILLING), between a
 * prefill and a decode group (HANDOFF), on a decode group (DECODING), or
 * closing (final message decided, waiting for ranks to confirm they freed
 * its state).  A request is freed only when its client has been answered and
 * no rank holds anything for it; that is what makes "no leaked state"
 * checkable through the admin socket.
 */
#ifndef DSV4_DAEMONS_SCHED_H
#define DSV4_DAEMONS_SCHED_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include "common/cli.h"
#include "common/config_file.h"
#include "common/tokenizer.h"
#include "ipc/proto.h"
#include "ipc/zsock.h"

/* glibc's <sys/queue.h> lacks the _SAFE iterator (BSD has it). */
#ifndef TAILQ_FOREACH_SAFE
#define TAILQ_FOREACH_SAFE(var, head, field, tvar) \
    for ((var) = TAILQ_FIRST(head); \
         (var) != NULL && ((tvar) = TAILQ_NEXT(var, field), 1); (var) = (tvar))
#endif

#define SCHED_VERSION "dsv4-sched " DSV4_VERSION
#define SCHED_MAX_GROUP 64          /* ranks per group (TP x EP) */
#define SCHED_MAX_RERUNS 4          /* re-runs of one request after rank deaths */
#define SCHED_RETRY_MS 5            /* re-try blocked client sends this often */
#define SCHED_REQ_BUCKETS 4096      /* request hash table size (power of 2) */
#define SCHED_RESUME_TEXT_AHEAD 1024 /* a resume's text may pass its tokens' text by
                                        this much (part of the token held back) */
#define SCHED_RESTARTING_MSG "scheduler restarting: send it again with resume"
                                    /* ERROR 302's message (protocol §4.3) */

/* --- Configuration (sched_config.c) ---------------------------------------- */

/* What the scheduler runs with: the shared file's settings plus what only the
 * command line gives. */
struct sched_config {
    struct dsv4_conf file;     /* /etc/dsv4/dsv4.conf with -o overrides */
    const char *path;          /* config file read, or NULL */
    int n_over;                /* the -o overrides, applied again by a reload */
    char *const *over;
    bool tokenizer_required;   /* tokenizer key given: a load failure is fatal */
    int verbose;               /* -v count */
};

/* --- Ranks and groups (sched_rank.c) ------------------------------------- */

/* One registered rank process. */
struct sched_rank {
    TAILQ_ENTRY(sched_rank) entry;   /* sched.ranks */
    struct dsv4_route route;         /* ROUTER identity of its DEALER */
    enum dsv4_role role;
    uint32_t index;                  /* unit instance, unique per role */
    uint32_t group, group_rank, group_size;
    uint32_t capacity;               /* prompts or stream slots it offers */
    uint32_t max_ctx;
    uint32_t transports;             /* bit set of enum dsv4_transport */
    uint32_t pid;
    char model[DSV4_PROTO_MAX_MODEL + 1]; /* READY's model fingerprint; "" = not said */
    uint32_t abi;                /* READY's abi (DSV4_RANK_ABI of its build; 0: not said) */
    bool burst;                      /* prefill: READY said burst (config `burst`) */
    uint32_t call_rows, call_rows_full; /* prefill: READY's (rows of one forward call,
                                        and before the warm-up lowered them); 0 =
                                        not said */
    uint64_t placed;                 /* requests placed on its group since it
                                        registered (dsv4ctl ranks) */
    char host[DSV4_PROTO_MAX_HOST + 1];
    char device[DSV4_PROTO_MAX_DEVICE + 1]; /* its READY's device (GPU UUID); "" = not
                                               said: may share a GPU with any rank
                                               (queue_pick_prefill) */
    enum dsv4_rank_state state;      /* JOINING .. DEAD */
    bool drain;                      /* admin asked to drain it */
    bool leaving;                    /* it sent DRAIN (stopping: finishing its work);
                                        not inherited by the next process */
    bool leave_told;                 /* leaving: DRAIN_DONE sent (its group's load 0) */
    bool unreachable;                /* a send failed: handled as lost at the next timer */
    uint32_t reported_active;        /* `active` of its last HEARTBEAT */
    uint64_t mtp_drafts, mtp_accepted; /* MTP counters of its last HEARTBEAT with them */
    bool has_mtp;                    /* it reported MTP counters (decodes with mtp = yes) */
    uint32_t comm_epoch;             /* group: epoch its last HEARTBEAT said it joined */
    bool has_comm_epoch;             /* it reports comm_epoch (else taken as joined once
                                        the group's COMM is out) */
    uint32_t graphs_refused;         /* decode: kinds of step without a CUDA graph, its
                                        last HEARTBEAT's (dsv4ctl ranks) */
    bool has_graphs_refused;         /* it reported graphs_refused */
    struct dsv4_liveness live;
    int64_t joined_ms;
};
TAILQ_HEAD(sched_rank_list, sched_rank);

/* A model replica: the ranks of one role with one `group` number.  Work is
 * placed on groups; every rank of a group gets every message of a request. */
struct sched_group {
    TAILQ_ENTRY(sched_group) entry;  /* sched.groups */
    enum dsv4_role role;
    uint32_t id;                     /* `group` of its ranks */
    uint32_t size;                   /* group_size its ranks announced */
    struct sched_rank *ranks[SCHED_MAX_GROUP]; /* by group_rank; NULL = missing */
    uint32_t n_ranks;                /* non-NULL entries */
    uint32_t capacity;               /* min over ranks, capped by max_batch */
    uint32_t max_ctx;                /* min over ranks */
    uint32_t max_ctx_last;           /* max_ctx when it last had ranks: a group
                                        whose ranks all died still counts for
                                        what can be placed (they come back;
                                        queue_ctx_possible) */
    uint32_t transports;             /* intersection over ranks */
    bool burst;                      /* prefill: every rank present is a burst rank
                                        (queue_pick_prefill) */
    uint32_t call_rows;              /* prefill: min over the ranks that said theirs
                                        (READY call_rows); 0 = none said */
    uint32_t load;                   /* requests placed here (prefill running /
                                        decode slots taken, incl. closing) */
    uint8_t *slots;                  /* decode: slot -> in use; n_slots bytes */
    uint32_t n_slots;                /* >= capacity */
    uint32_t epoch;                  /* comm_epoch: bumped when a member joins or the
                                        communicator of the epoch broke (GROUP_BROKEN) */
    uint32_t comm_asked;             /* size > 1: epoch whose id rank 0 was asked for */
    uint32_t comm_ready;             /* size > 1: epoch whose id every rank got (work
                                        is placed only when it is `epoch`) */
};
TAILQ_HEAD(sched_group_list, sched_group);

/* --- Requests (sched_req.c) ------------------------------------------------- */

/* Where a request's rank-side state is. */
struct sched_hold {
    struct sched_group *g;  /* NULL = nothing held there */
    uint32_t acks;          /* ranks of g still to answer (PREFILL_DONE parts,
                               ABORT_DONE, KV_RELEASE) */
};

/* One request, from GENERATE to its final message: its prompt, sampling,
 * output so far, where it runs and its client. */
struct sched_req {
    TAILQ_ENTRY(sched_req) qentry;   /* admission queue or sched.live */
    struct sched_req *hnext;         /* hash chain by rid */
    uint64_t req;                    /* scheduler id (shown to the client) */
    uint64_t rid;                    /* id of the current run in the rank
                                        protocol: `req` at first, a new one
                                        for every re-run, so that what a rank
                                        says late about an earlier run (a
                                        PREFILL_DONE, ERROR, KV_RELEASE or
                                        TOKENS crossing the ABORT) is unknown
                                        and never taken for the new run's */
    uint64_t id;                     /* client's id */
    struct dsv4_route client;        /* client ROUTER identity */
    bool client_gone;                /* unroutable: drop output */
    enum dsv4_req_state state;
    bool closing;                    /* final outcome decided */
    bool queued;                     /* on the admission queue */
    char *tag;                       /* NULL = none */
    int64_t t_recv_ms, deadline_ms;  /* deadline 0 = none */
    uint32_t reruns;
    uint32_t avoid_pre;              /* 1 + id of the prefill group that last answered
                                        it with NO_MEMORY: its re-runs go to another
                                        prefill group while one is usable; 0 = none */

    /* What to compute. */
    int32_t *prompt;
    uint32_t n_prompt;
    struct dsv4_sampling s;
    uint32_t max_tokens;
    int32_t *stop_ids;               /* client's plus EOS */
    uint32_t n_stop_ids;
    char **stop;                     /* stop strings */
    uint32_t n_stop;
    size_t stop_maxlen;
    bool stream;

    /* Where it runs. */
    struct sched_hold pre;           /* prefill group */
    struct sched_hold dec;           /* decode group */
    uint32_t slot;                   /* decode slot in dec.g */
    bool dec_started;                /* DECODE sent on this attempt */
    bool dec_self_end;               /* the rank ends it by itself (length/stop id) */
    uint32_t dec_early;              /* decode group ranks other than 0 that reported
                                        the stream's end before rank 0 did */
    struct dsv4_msg kv;              /* PREFILL_DONE parts merged for DECODE */
    uint8_t *kv_handles[DSV4_PROTO_MAX_KV_PARTS];
    uint64_t *kv_arrays[DSV4_PROTO_MAX_KV_PARTS]; /* sizes then offsets */
    uint32_t kv_parts;               /* parts received */
    int32_t first_token;
    float first_lp;
    bool first_has_lp;
    int32_t first_top_ids[DSV4_PROTO_MAX_TOP_LOGPROBS];  /* its most likely tokens */
    float first_top_lp[DSV4_PROTO_MAX_TOP_LOGPROBS];
    uint32_t first_n_top;
    int64_t t_prefilled_us;          /* monotonic us when the last PREFILL_DONE
                                        part arrived; 0 = no handoff timed */
    int64_t handoff_us;              /* PREFILL_DONE to KV_RELEASE, counted at the
                                        decode group's first tokens (an import
                                        refused after KV_RELEASE is not); -1 none */

    /* Output. */
    int32_t *out;                    /* tokens emitted (accepted by the scheduler) */
    float *out_lp;
    size_t *out_text_end;            /* text.len once out[i] was pushed: where a
                                        TOKENS ending with out[i] ends its text */
    /* with s.top_logprobs = N > 0, the most likely tokens of the output not
     * yet sent (out[top_base .. n_out); the sent ones' are dropped): out[i]'s
     * out_top_n[i - top_base] (<= N) of them at (i - top_base) * N, room for
     * top_cap tokens (NULL while N = 0) */
    int32_t *out_top_ids;
    float *out_top_lp;
    uint8_t *out_top_n;
    uint32_t top_base, top_cap;
    uint32_t n_out, cap_out;
    uint32_t n_sent;                 /* of out[], sent to the client */
    struct dsv4_tok_stream ts;       /* detokenizer */
    struct dsv4_tok_text text;       /* whole output text so far */
    size_t text_safe;                /* text[0..safe) cannot become a stop match */
    size_t text_barrier;             /* end of the last added token's text: stop
                                        strings are matched after it only */
    size_t text_sent;                /* text[0..sent) sent to the client */
    bool resume_ahead;               /* text_sent is past the text: a resume's
                                        count not yet checked (req_emit) */
    size_t text_cut;                 /* stop-string cut: text ends here */
    enum dsv4_finish finish;         /* NONE while running */
    uint16_t err_code;               /* failed: status code; 0 = none */
    char *err_msg;
    bool ok_sent;                    /* OK went to the client */
    bool final_sent;                 /* DONE / ERROR went to the client */
};
TAILQ_HEAD(sched_req_list, sched_req);

/* --- Admin drain waits (sched_ctl.c) --------------------------------------- */

/* A dsv4ctl drain waiting for its answer (a rank, or all, to be idle). */
struct sched_drain_wait {
    TAILQ_ENTRY(sched_drain_wait) entry;
    struct dsv4_route route;       /* dsv4ctl that asked */
    struct sched_rank *rank;       /* NULL = all */
    int64_t deadline_ms;           /* 0 = none */
};
TAILQ_HEAD(sched_drain_list, sched_drain_wait);

/* --- Refusals waiting for the client socket (sched_client.c) ---------------- */

/* An ERROR for a message that made no request (a GENERATE refused, a
 * malformed message) that the client's pipe could not take (its
 * high-water mark): sent by client_flush_all, in order per client, so
 * every GENERATE gets its answer. */
struct sched_refusal {
    TAILQ_ENTRY(sched_refusal) entry;
    struct dsv4_route to;
    uint64_t id;
    uint16_t code;
    char *text, *tag;              /* owned; tag may be NULL */
    bool held;                     /* refusals_flush: an earlier one of its client
                                      is still blocked */
};
TAILQ_HEAD(sched_refusal_list, sched_refusal);
#define SCHED_MAX_REFUSALS 1024   /* kept at most (past it one is dropped, logged) */

/* --- Metrics --------------------------------------------------------------- */

/* Counters since start (dsv4ctl status, the gateway's /metrics). */
struct sched_metrics {
    uint64_t n_done, n_cancelled, n_failed, n_rejected;
    uint64_t tokens_in, tokens_out;
    uint64_t handoffs, reruns, rank_deaths;
    /* Handoff time (PREFILL_DONE of every part -> the decode group's
     * KV_RELEASE): cumulative counts per DSV4_PROTO_HANDOFF_BOUNDS_US bound,
     * total microseconds, number measured. */
    uint64_t handoff_le[DSV4_PROTO_HANDOFF_BUCKETS];
    uint64_t handoff_sum_us, handoff_count;
};

/* --- The scheduler ---------------------------------------------------------- */

/* The scheduler process: configuration, sockets, request table, queue,
 * ranks and groups, drain state and metrics. */
struct sched {
    struct sched_config cfg;
    void *zctx;
    void *client, *rank, *admin;     /* ROUTER sockets */
    int sigfd;
    struct dsv4_tok *tok;            /* NULL = token-id prompts only */
    int32_t vocab;                   /* ids >= vocab refused; 0 = no check */
    int32_t eos;                     /* -1 = none */
    char model_ref[DSV4_PROTO_MAX_MODEL + 1]; /* the model every rank must run: the
                                        fingerprint of the configured checkpoint
                                        (common/weights_fp.h) when this host reads
                                        it; "" = the registered ranks' */

    struct sched_rank_list ranks;
    struct sched_group_list groups;
    struct sched_req_list queue;     /* admission queue, FIFO */
    uint32_t n_queued;
    struct sched_req_list live;      /* every request not queued */
    uint32_t n_live;
    struct sched_req *hash[SCHED_REQ_BUCKETS];
    uint64_t next_req;
    uint32_t n_dirty;                /* requests with output to flush */

    bool draining;                   /* global drain: admit nothing */
    bool stopping;                   /* SIGTERM received */
    int64_t stop_deadline_ms;
    struct sched_drain_list drains;
    struct sched_refusal_list refusals;   /* ERRORs not yet taken by the client socket */
    uint32_t n_refusals;
    struct sched_metrics m;
    int64_t start_ms;
    int64_t watchdog_ms, watchdog_last_ms;
};

/* --- sched_config.c --------------------------------------------------------- */

/* Defaults, then the file (path NULL: the default path if it exists), then
 * -o overrides (n "key=value" strings, kept by reference for a reload).
 * 0, or -1 with the reason logged. */
int sched_config_load(struct sched_config *c, const char *path, int n_over,
    char *const *over);


/* -n: what the start would refuse, found without binding: each endpoint's
 * form, directory and CURVE key (dsv4_zsock_check), and the tokenizer (a
 * configured one must load; the default may be missing).  Prints one line
 * per item on stdout; 0, or -1 with the reason logged. */
int sched_config_check(const struct sched_config *c);

/* --- sched_reload.c: SIGHUP ------------------------------------------------- */

/* Read the configuration again (same file, same -o overrides) and apply
 * what can change while serving: queue_max, request_timeout_ms,
 * stop_timeout_ms, prefill_chunk, burst_streams, burst_free_slots,
 * max_batch.  A change of a key bound at the
 * start (endpoints, admin_mode, key_dir, heartbeat_ms, liveness, tokenizer)
 * is logged and waits for a restart; a file that does not load changes
 * nothing.  Tells systemd RELOADING=1, then READY=1.  SIGHUP and the admin
 * command RELOAD call it.  Returns 0 (msg: how many changed and wait), or
 * -1 when the file does not load (msg: why); msg may be NULL with len 0. */
int sched_reload(struct sched *s, char *msg, size_t len);

/* --- sched_queue.c: admission and batching policy (pure) ------------------- */

/* Status for a new request: 200 admit, 301 draining, 300 queue full. */
uint16_t queue_admit_status(uint32_t n_queued, uint32_t queue_max, bool draining);

/* Add to the tail (new) or the head (re-run, keeps its place in line). */
void queue_push(struct sched *s, struct sched_req *r, bool front);
void queue_remove(struct sched *s, struct sched_req *r);

/* Can group `g` take one more request needing `ctx` positions with
 * `transport`?  (Ready, not draining, load below capacity, ctx fits.) */
bool queue_group_fits(const struct sched_group *g, uint32_t ctx, enum dsv4_transport t);

/* The group of `role` numbered `id`, or NULL. */
struct sched_group *queue_group_find(struct sched_group_list *groups, enum dsv4_role role,
    uint32_t id);

/* The least loaded group of `role` that fits, lowest id on ties; NULL. */
struct sched_group *queue_pick(struct sched_group_list *groups, enum dsv4_role role,
    uint32_t ctx, enum dsv4_transport t);

/*
 * The prefill group for a prompt needing `ctx` positions (docs/operations.md
 * "Burst prefill"): the least loaded burst group that fits and beside which
 * at most `burst_streams` streams decode, else the least loaded other group
 * that fits; a burst group past `burst_streams` is taken only when none of
 * the other groups is usable with that context at all (none registered, all
 * drained, dead or too short): then a burst group rather than none.  NULL =
 * wait.  "Beside": the loads (slots taken, the prompts being prefilled for
 * them included) of the decode groups that may share a GPU with the burst
 * group (queue_groups_share_gpu), so a burst group on idle GPUs serves while
 * other GPUs' decode groups are busy.  With `burst_free` > 0 a burst group
 * that fits also takes a prompt that would wait for a busy plain group,
 * while at least burst_free decode slots are free beside it (capacity minus
 * load of the usable decode groups that may share a GPU with it): the
 * prompts' prefill, not decode, is then what holds the service back.
 * Among groups of one kind the least loaded wins; on equal loads the one
 * that runs the prompt in fewer forward calls (its call_rows: a rank whose
 * warm-up lowered them), then the lowest id.  Without burst groups and
 * lowered rows this is queue_pick(DSV4_ROLE_PREFILL).  `skip` (NULL: none)
 * is left out as if it were not registered.
 */
struct sched_group *queue_pick_prefill(struct sched_group_list *groups, uint32_t ctx,
    uint32_t burst_streams, uint32_t burst_free, const struct sched_group *skip);

/* Whether a group of `role` other than `skip` (NULL: none) is usable
 * (complete, ready, not drained) for `ctx` positions, busy or not. */
bool queue_usable_besides(struct sched_group_list *groups, enum dsv4_role role,
    const struct sched_group *skip, uint32_t ctx);

/*
 * Whether groups a and b may run on a common GPU: false only when every
 * rank of both is present and said its device (READY `device`) and no
 * device is in both; a rank missing or silent about its device (the cpu
 * backend, an older rank) may be anywhere.
 */
bool queue_groups_share_gpu(const struct sched_group *a, const struct sched_group *b);

/* True when some group of `role` (in any state, its ranks all dead included:
 * with the context they had) could ever hold `ctx` positions, or when no
 * group of `role` was ever registered; false means the request can never
 * run (413). */
bool queue_ctx_possible(struct sched_group_list *groups, enum dsv4_role role, uint32_t ctx);

/* Free decode slot of `g` (lowest index), or -1. */
int queue_slot_take(struct sched_group *g);
void queue_slot_put(struct sched_group *g, uint32_t slot);

/* The transport to use between two groups (shm preferred on the CPU). */
enum dsv4_transport queue_transport(const struct sched_group *p, const struct sched_group *d);

/* Start queued requests while groups have room: PREFILL to a prefill group
 * with a decode slot reserved.  Fails requests that can never fit. */
void queue_dispatch(struct sched *s);

/* --- sched_req.c: request table and life cycle ----------------------------- */

/* A new request in state QUEUED with the next request id, in the id hash
 * (not yet in any list); NULL when out of memory. */
struct sched_req *req_new(struct sched *s);
/* Move a queued request to the live list (dispatch, failure). */
void req_unqueue(struct sched *s, struct sched_req *r);
/* The request whose current run has rank-protocol id `req` (its rid: a
 * message about an earlier run finds nothing); NULL. */
struct sched_req *req_find(struct sched *s, uint64_t req);
/* The live request of client `route` with client id `id`; NULL. */
struct sched_req *req_find_client(struct sched *s, const struct dsv4_route *route, uint64_t id);

/* One output token as a rank reported it (req_emit). */
struct sched_tok {
    int32_t id;
    bool has_lp;               /* lp is its log-probability */
    float lp;
    const int32_t *top_ids;    /* its n_top most likely tokens, best first; NULL = none */
    const float *top_lp;       /* their log-probabilities */
    uint32_t n_top;
};

/* Record an emitted token; applies stop ids, max_tokens and stop strings.
 * Of its most likely tokens, those the request asked for (top_logprobs) are
 * kept.  Returns true when the request finished with this token (rest
 * ignored). */
bool req_emit(struct sched *s, struct sched_req *r, const struct sched_tok *t);

/* Text helpers (exposed for tests): after text grew, find a stop string
 * starting at or after `from`; returns its offset or -1. */
long req_stop_find(char *const *stop, uint32_t n_stop, const char *text, size_t len,
    size_t from);
/* Length of the longest suffix of text that is a proper prefix of a stop
 * string (must be held back). */
size_t req_stop_holdback(char *const *stop, uint32_t n_stop, const char *text, size_t len);

/* End the request: finish reason (DONE) or error code+message (ERROR).
 * Tells ranks to free what they hold, queues the final client message. */
void req_finish(struct sched *s, struct sched_req *r, enum dsv4_finish f);
void req_fail(struct sched *s, struct sched_req *r, uint16_t code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Client asked to cancel. */
void req_cancel(struct sched *s, struct sched_req *r);
/* A rank of a group holding `r` died or lost its state: re-run from prompt
 * plus output, or fail after SCHED_MAX_RERUNS. */
void req_rank_lost(struct sched *s, struct sched_req *r, struct sched_group *g);
/* A rank of group `g` answered ERROR (or dropped `r`): an ack while closing,
 * else a re-run (decode; prefill BUSY/NO_MEMORY) or a failure (prefill). */
void req_rank_error(struct sched *s, struct sched_req *r, struct sched_group *g, uint16_t code,
    const char *msg);
/* Release `r` if it is over and nothing holds it. */
void req_maybe_free(struct sched *s, struct sched_req *r);
/* Drop a hold on `g` (acks 0) and forget the slot. */
void req_hold_clear(struct sched *s, struct sched_req *r, struct sched_hold *h);
/* Free the KV locations kept from PREFILL_DONE. */
void req_kv_clear(struct sched_req *r);
/* Deadlines: fail requests past timeout; returns ms to the next one (or -1). */
int64_t req_timers(struct sched *s, int64_t now);
/* Destroy every request (shutdown). */
void req_free_all(struct sched *s);

/* --- sched_client.c: client sub-protocol ------------------------------------ */

/* Handle the client messages waiting on the client socket (a batch at a
 * time, and for CLIENT_TURN_MS at most, so the other sockets and the
 * timers are served in between: a burst of large prompt texts to tokenize
 * must not hold the loop past the ranks' liveness interval); a message
 * outside the protocol is answered with its error. */
void client_dispatch(struct sched *s);
/* Send what can be sent of r's output and final message; mark dirty when
 * blocked.  Returns false when the client socket would block. */
bool client_flush(struct sched *s, struct sched_req *r);
/* Flush every request with pending output and the refusals waiting
 * (before sleeping). */
void client_flush_all(struct sched *s);
/* Free the refusals still waiting (shutdown). */
void client_free_refusals(struct sched *s);

/* --- sched_rank.c: rank sub-protocol and registry --------------------------- */

/* Handle the rank messages waiting on the rank socket (a batch at a time);
 * each counts as a sign of life of the rank that sent it.  Returns true
 * when it stopped at the batch's end (more may wait). */
bool rank_dispatch(struct sched *s);
/* Send `m` to every rank of group `g`.  DSV4_ERR_PROTO when the message
 * could not be encoded (the same for every rank: none got it; the caller
 * fails its request), else DSV4_OK (a rank that could not be reached is
 * marked for the timers). */
enum dsv4_err rank_send_group(struct sched *s, struct sched_group *g, const struct dsv4_msg *m);
/* Send `m` to rank k; as rank_send_group for one rank. */
enum dsv4_err rank_send(struct sched *s, struct sched_rank *k, const struct dsv4_msg *m);
/* Send a message with just `req` (ABORT, KV_RELEASE) to every rank of g. */
void rank_send_ref(struct sched *s, struct sched_group *g, int cmd, uint64_t req);
/* Heartbeats out, deaths in; returns ms to the next rank timer. */
int64_t rank_timers(struct sched *s, int64_t now);
/* Name "decode@3" into buf. */
const char *rank_name(const struct sched_rank *k, char *buf, size_t len);
struct sched_rank *rank_by_name(struct sched *s, const char *name);
/* Update DRAINING/DRAINED/READY states from drain flags and loads. */
void rank_update_states(struct sched *s);
/* Send DRAIN_DONE to each rank that asked to leave (DRAIN, protocol §6) once
 * nothing is booked on its group; once per rank. Called every loop turn. */
void rank_tell_leavers(struct sched *s);
/* Recompute what every group offers (capacity, context, transports) from
 * its members and the configuration, after max_batch changed. */
void rank_groups_update(struct sched *s);
/* Requests placed on rank k's group (what it holds, by our books). */
uint32_t rank_load(const struct sched_rank *k, struct sched *s);
/* Send DISCONNECT to every rank and forget them (shutdown). */
void rank_free_all(struct sched *s, const char *reason);
/* Whether the set stops: no rank takes work and one left on purpose (its
 * stopping DRAIN).  While the scheduler stops and the set does not, it is
 * restarting: what it cannot finish, and what comes meanwhile, gets 302. */
bool rank_set_stopped(const struct sched *s);

/* --- sched_ctl.c: admin sub-protocol ------------------------------------------ */

/* Handle the admin (dsv4ctl) messages waiting on the control socket. */
void ctl_dispatch(struct sched *s);
/* Answer drain waits that are satisfied or timed out; ms to the next. */
int64_t ctl_timers(struct sched *s, int64_t now);
/* Rank entry `k` is being freed: its drain waits move to `heir` (the same
 * rank registered again; may be NULL) or are answered. */
void ctl_rank_gone(struct sched *s, struct sched_rank *k, struct sched_rank *heir);
void ctl_free_all(struct sched *s);
/* Count one handoff of `us` microseconds in the metrics' histogram. */
void ctl_handoff_observe(struct sched_metrics *m, uint64_t us);
/* Monotonic clock in microseconds (handoff timing). */
int64_t ctl_now_us(void);

#endif
