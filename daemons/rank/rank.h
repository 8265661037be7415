/*
 * rank.h — dsv4-prefill and dsv4-decode, the rank daemons: the table of
 * contents of the program (constants, every struct, and the functions of
 * each file grouped under its name).  Both executables are built from the
 * same sources; RANK_ROLE (a compile-time define) fixes the role.
 *
 * One process per rank, one thread: a zmq_poll loop over the DEALER to the
 * scheduler's rank endpoint and a signalfd, with a computed timeout (READY
 * retries, heartbeats, scheduler liveness, abandoned KV exports, watchdog).
 * Between polls the rank runs at most ONE dsv4_model_forward call (a prefill
 * chunk of bounded rows, or one decode step over every running stream), so a
 * long prompt never keeps heartbeats waiting for long (docs/protocol.md §6).
 *
 * Prefill: PREFILL -> chunked forward -> first token sampled (seed, step) ->
 * decode state exported into a transfer region (ipc/kvxfer.h) ->
 * PREFILL_DONE with its location; the region lives until KV_RELEASE, ABORT,
 * a new scheduler link, or RANK_KV_TIMEOUT_MS.
 * Decode: DECODE -> state import started into a slot (a network transport
 * copies in the background, bounded by kv_timeout_ms) -> KV_RELEASE -> the
 * stream joins the running batch (or ERROR when the import failed); every
 * step: one token per stream, one TOKENS message; DECODE_DONE at max_tokens
 * / a stop id / the sequence limit; ABORT drops a stream.
 *
 * Invariant: the rank's state is exactly its jobs, exports and streams; all
 * of it belongs to the current scheduler link and is dropped when the link
 * is lost (a restarted scheduler knows none of it).
 */
#ifndef DSV4_DAEMONS_RANK_H
#define DSV4_DAEMONS_RANK_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/queue.h>

#include "common/config_file.h"
#include "common/weights.h"
#include "common/weights_fp.h"
#include "common/weights_shard.h"
#include "ipc/kvxfer.h"
#include "ipc/proto.h"
#include "ipc/zsock.h"
#include "kernels/backend.h"
#include "kernels/comm.h"
#include "kernels/forward.h"

#ifndef RANK_ROLE
#error "RANK_ROLE must be defined (DSV4_ROLE_PREFILL or DSV4_ROLE_DECODE)"
#endif

#define RANK_READY_RETRY_MS 1000     /* resend READY (fresh socket) without WELCOME */
#define RANK_KV_TIMEOUT_MS 120000    /* free an export nobody claimed after this */
#define RANK_PREFILL_ROWS 256        /* default rows per prefill forward call */
#define RANK_MAX_SLOTS DSV4_PROTO_MAX_BATCH /* upper bound of --slots (one TOKENS) */
#define RANK_STOP_REASON "rank stopping"
#define RANK_GROUP_IDLE_MS 10        /* longest poll of a group member (it ticks) */
#define RANK_JOIN_POLL_MS 5          /* longest poll while a communicator join runs */
#define RANK_JOIN_BACKOFF_MS 250     /* registering again after the 2nd failed join (or
                                        refused READY) in a row waits this long, doubling
                                        per failure ... */
#define RANK_JOIN_BACKOFF_MAX_MS 5000 /* ... up to this */

/* Test-only fault injection (read once at start; docs/operations.md "Test-only
 * environment"), each a list "ROLE@INDEX:N[,ROLE@INDEX:N]..." naming the ranks
 * it applies to; never set in a deployment:
 *   DSV4_TEST_GROUP_BREAK    the rank's N-th forward call in a group (N >= 1)
 *                            reports a collective failure, once: the group
 *                            breaks with every member alive;
 *   DSV4_TEST_JOIN_DELAY_MS  the rank's first communicator join waits N ms
 *                            before it starts (a peer slow to join; a
 *                            newer epoch or the stop ends the wait);
 *   DSV4_TEST_FORWARD_NOMEM  a rank outside a group: its N-th forward call
 *                            (N >= 1; a prefill rank's start-up warm-up is
 *                            its first, a decode rank's warm-up is not
 *                            counted) reports that the device ran out of
 *                            memory, once;
 *   DSV4_TEST_EXPORT_NOMEM   a prefill rank outside a group: its N-th
 *                            decode-state export (N >= 1; the start-up
 *                            warm-up's is its first) reports that the device
 *                            ran out of memory, once;
 *   DSV4_TEST_GRAPHS_REFUSED a decode rank: from its first step (the
 *                            warm-up's) on, N more kinds of step are counted
 *                            as run without a CUDA graph than the model's
 *                            own count (decode_graphs_check: its warning and
 *                            HEARTBEAT graphs_refused; the cpu backend has
 *                            no graphs);
 *   DSV4_TEST_MTP_DRAFTS     FILE (not RANK:N): a decode rank with mtp = yes
 *                            replaces the MTP layer's drafts of streams whose
 *                            output begins one of FILE's lines
 *                            (rank_test_drafts.c). */
#define RANK_TEST_GROUP_BREAK "DSV4_TEST_GROUP_BREAK"
#define RANK_TEST_JOIN_DELAY "DSV4_TEST_JOIN_DELAY_MS"
#define RANK_TEST_FORWARD_NOMEM "DSV4_TEST_FORWARD_NOMEM"
#define RANK_TEST_EXPORT_NOMEM "DSV4_TEST_EXPORT_NOMEM"
#define RANK_TEST_GRAPHS_REFUSED "DSV4_TEST_GRAPHS_REFUSED"
#define RANK_TEST_MTP_DRAFTS "DSV4_TEST_MTP_DRAFTS"

/* --- Options (rank.c) ----------------------------------------------------- */

/* A rank's command line and configuration file, parsed. */
struct rank_opts {
    struct dsv4_conf conf;      /* file + -o overrides (checkpoint, endpoint, ...) */
    const char *conf_path;      /* file read, or NULL */
    enum dsv4_role role;        /* RANK_ROLE */
    uint32_t index;             /* --rank N: unit instance number */
    uint32_t group;             /* --group N: model replica [index / group_size] */
    uint32_t group_rank;        /* index % group_size: place in the group */
    uint32_t group_size;        /* conf group_size: ranks running one model */
    int slots;                  /* prefill: concurrent prompts; decode: streams */
    int rows;                   /* prefill: rows per forward call */
    int64_t kv_timeout_ms;      /* abandoned exports */
    int verbose;                /* -v count */
    /* --synthetic-weights SEED (CUDA backend): weights generated on the GPU
     * for the model config of --preset NAME or --config FILE (config.json),
     * with --set K=V overrides, instead of loading the checkpoint */
    bool synthetic;
    uint64_t synth_seed;
    const char *model_preset;   /* --preset */
    const char *model_config;   /* --config */
    const char *model_sets[32]; /* --set */
    int n_model_sets;
    bool no_graphs;             /* --no-graphs: decode steps not as CUDA graphs */
    bool burst;                 /* a prefill rank with conf burst = yes (READY's burst) */
};

/* --- State ------------------------------------------------------------------ */

/* Where the scheduler link is. */
enum rank_link {
    RANK_LINK_NONE = 0,
    RANK_LINK_JOINING,  /* READY sent, waiting for WELCOME */
    RANK_LINK_UP,       /* WELCOME received; work accepted */
};

/* A prompt being prefilled in model slot `slot`. */
struct rank_job {
    bool active;
    uint64_t req;
    int32_t *tokens;            /* prompt (+ emitted tokens on a re-run); owned */
    uint32_t n_tokens;
    uint32_t done;              /* tokens already through the model */
    uint32_t chunk;             /* rows per call for this prompt */
    struct dsv4_sampling s;
    uint32_t step;              /* RNG step of the token it samples */
    enum dsv4_transport transport; /* how to export its state (PREFILL) */
    uint32_t gen;               /* k->comm_gen when it arrived (its epoch) */
    int64_t t_us;               /* when it arrived (dsv4_now_us): logged with
                                   its prefill_done */
    bool clean;                 /* not active: the model slot was reset when
                                   the last job left it (prefill_job_clear),
                                   so the next PREFILL needs no reset */
};

/* An exported decode state waiting for KV_RELEASE. */
struct rank_export {
    TAILQ_ENTRY(rank_export) entry;
    struct dsv4_kvx *x;         /* transport that exported it */
    struct dsv4_kvx_region r;   /* region (r.req = request) */
    int64_t t_ms;               /* when exported (monotonic) */
};
TAILQ_HEAD(rank_export_list, rank_export);

/* A decode stream in model slot `slot`.  While `xfer` is set the slot is
 * held but the state is still arriving (not in the batch yet). */
struct rank_stream {
    bool active;
    uint64_t req;
    struct dsv4_kvx_xfer *xfer; /* import in flight, or NULL */
    struct dsv4_kvx *xk;        /* its transport */
    uint64_t kv_off, kv_len;    /* the state's segment in the region */
    uint32_t pos;               /* positions the imported state must hold */
    int32_t next;               /* token to feed in the next step */
    uint32_t max_tokens;        /* tokens it may emit */
    uint32_t n_emitted;
    uint64_t step;              /* RNG step of its next sample */
    struct dsv4_sampling s;
    int32_t stop_ids[DSV4_PROTO_MAX_RANK_STOP_IDS];
    uint32_t n_stop_ids;
    /* speculative decoding (conf mtp; rank_decode.c decode_work_spec) */
    uint32_t gen;               /* k->comm_gen when it arrived (its epoch) */
    bool has_draft;             /* `draft` follows `next` (from the MTP layer) */
    int32_t draft;
    uint32_t n_drafts, n_accepted; /* this stream's drafts, accepted ones */
};

/* A rank process: options, model and backend, the link to the scheduler,
 * its group, the decode state exports and the streams it holds. */
struct rank {
    struct rank_opts o;
    char name[32];              /* "prefill@3" for logs */

    /* Model. */
    struct dsv4_weights w;
    bool w_loaded;
    struct dsv4_weights wdev;   /* CUDA backend: the weights on the device */
    bool wdev_loaded;
    struct rank_share *share;   /* weights shared with the other rank of the
                                   GPU (rank_share.c); NULL = not shared */
    enum dsv4_group_split group_split;   /* the group's (rank_group_split) */
    bool moe_local;                      /* the model's opts.moe_local (a group's
                                            ranks must agree: group_peers) */
    struct dsv4_backend *be;
    struct dsv4_model *m;
    int V;                      /* vocabulary */
    int max_seq;                /* positions per slot (model's, rounded) */
    int rows_full;              /* prefill: the rows per call the warm-up tried
                                   first (o.rows, at most max_seq), before any
                                   lowering; 0 = no warm-up ran (READY's
                                   call_rows_full) */
    int32_t *b_slot, *b_ntok, *b_tok;  /* batch arrays (rows / slots entries) */
    struct dsv4_sample_params *sp;     /* (slots) */
    int32_t *out_tok;           /* (slots * spec_k1) */
    float *out_lp;              /* (slots * spec_k1) */
    struct dsv4_top_out out_top; /* (slots * spec_k1, DSV4_TOP_MAX): the most
                                   likely ids of streams that ask (top_logprobs),
                                   their counts in out_top.n */
    uint64_t *out_top_n;        /* (slots * spec_k1) TOKENS' top_n */
    int32_t *msg_top_ids;       /* (slots * spec_k1 * DSV4_TOP_MAX) TOKENS' top, */
    float *msg_top_lp;          /*   packed (rank_top_pack) */
    /* speculative decoding (conf mtp = yes, decode ranks with an MTP layer) */
    bool mtp;
    int spec_k1;                /* tokens a stream may emit per step: 1, or
                                   DSV4_SPEC_MAX_DRAFT + 1 with mtp */
    int32_t *spec_nd, *spec_draft, *spec_n;   /* (slots) verify arrays */
    uint64_t spec_drafts, spec_accepted;      /* since start */
    int64_t spec_status_ms;     /* last STATUS= with the counters */
    /* decode steps of the current STATUS= window (decode_stats; plain
     * decode, not mtp): monotonic microseconds */
    int64_t st_win_us;          /* the window's first step's start, 0: none */
    int64_t st_fwd_end_us;      /* the previous step's forward end, 0: idle since */
    int64_t st_fwd_us;          /* forward + sampling time of the window's steps */
    int64_t st_host_us;         /* time between a forward's end and the next one's start */
    uint64_t st_steps, st_rows, st_gaps;

    /* Scheduler link. */
    void *zctx;
    void *sock;                 /* DEALER */
    bool send_lost;             /* a message to the scheduler found its queue
                                   full (RANK_HWM): the link is lost
                                   (link_timers), not the message alone */
    int sigfd;
    enum rank_link link;
    int64_t ready_ms;           /* last READY sent */
    struct dsv4_liveness live;  /* valid when UP */
    bool notified_ready;        /* READY=1 sent to the service manager */
    bool drain;                 /* DRAIN received, DRAIN_DONE not yet sent */
    bool stopping;
    int64_t leave_ms;           /* SIGTERM with work in hand: the scheduler was
                                   sent DRAIN; stop once idle or at this time
                                   (conf stop_drain_s); 0 = not leaving */
    bool leave_done;            /* leaving: the scheduler's DRAIN_DONE came (nothing
                                   more is booked on the group) */
    bool leave_now;             /* leaving, in a group: exit after the next tick, which
                                   tells the peers (group_tick) */

    /* Work. */
    struct dsv4_kvx *kvx[DSV4_TRANSPORT__COUNT]; /* open transports; NULL = not offered */
    uint32_t transports;        /* bit (1 << transport) per open one (READY) */
    char host[DSV4_PROTO_MAX_HOST + 1]; /* announced in READY (conf host or hostname) */
    char device[DSV4_PROTO_MAX_DEVICE + 1]; /* announced in READY: the GPU's UUID
                                               (rank_device_id); "" on the cpu
                                               backend (not announced) */
    char model_fp[DSV4_FP_CHARS + 1]; /* announced in READY: the fingerprint of
                                         the model (common/weights_fp.h), set
                                         when the weights are loaded; "" =
                                         none (not sent) */
    struct rank_job *jobs;      /* prefill: (slots) */
    uint32_t rr;                /* prefill: round-robin start */
    struct rank_export_list exports;
    uint32_t n_exports;
    bool kv_shm_full;            /* the last kv_fill found no room for its region in
                                    /dev/shm (shm transport): not the device's memory */
    struct rank_stream *streams; /* decode: (slots) */
    uint64_t n_steps;           /* decode steps run (TOKENS step) */

    int64_t wd_interval_ms;     /* 0 = no watchdog */
    int64_t wd_last_ms;

    struct dsv4_config cfg;     /* the model's configuration */
    struct dsv4_weights wshard; /* group, CPU backend: this rank's shard of w */
    bool wshard_on;

    /* Model group (rank_group.c; group_size > 1). */
    struct dsv4_comm *comm;     /* communicator of comm_epoch, or NULL */
    uint32_t comm_epoch;
    uint32_t pend_epoch;        /* COMM received, not yet switched to; 0 = none */
    uint32_t comm_gen;          /* COMMs with an id received: work that arrives
                                   after the last one belongs to its epoch and
                                   survives the switch (rank_group.c) */
    uint8_t *pend_id;           /* its id (DSV4_COMM_ID_BYTES) */
    uint64_t *tick_h;           /* (2 * slots + 3) host: the tick's descriptor (the
                                   requests, the pending epoch, "a rank exits") */
    uint64_t *tick_d;           /* the same in backend memory */
    struct rank_watch *watch;   /* peer watchdog thread */
    struct rank_join *join;     /* communicator join running in its thread, or NULL */
    long test_break;            /* DSV4_TEST_GROUP_BREAK: forward calls left; 0 = off */
    long test_join_delay_ms;    /* DSV4_TEST_JOIN_DELAY_MS, first join only; 0 = off */
    long test_nomem;            /* DSV4_TEST_FORWARD_NOMEM: forward calls left;
                                   0 = off */
    long test_export_nomem;     /* DSV4_TEST_EXPORT_NOMEM: exports left; 0 = off */
    bool warmed;                /* the warm-up calls ran (rank_warmup), or
                                   warmup = no: none are owed */
    int join_fails;             /* joins failed in a row (0 after one succeeds) */
    int refusals;               /* READYs answered with DISCONNECT in a row (0 at
                                   WELCOME) */
    struct rank_test_drafts *test_drafts; /* DSV4_TEST_MTP_DRAFTS, or NULL */
    long test_graphs_refused;   /* DSV4_TEST_GRAPHS_REFUSED: added to the count;
                                   0 = off */
    int graphs_refused;         /* decode: kinds of step without a CUDA graph
                                   (dsv4_model_graphs_refused) after the last
                                   step; HEARTBEAT graphs_refused */
    int graphs_warned;          /* decode: graphs_refused at the last warning
                                   (decode_graphs_check) */
    int64_t hb_ms;              /* when the last HEARTBEAT was tried (a send
                                   that failed is not retried before the next
                                   interval) */
    int64_t relink_delay_ms;    /* link_lost: wait this long before READY (once) */
    uint64_t agreed[RANK_MAX_SLOTS]; /* this iteration's work: requests, ascending */
    int n_agreed;
};

/* --- rank.c: main, loop, link, dispatch --------------------------------------- */

/* Send `m` to the scheduler (DONTWAIT); logs and returns false on failure. */
bool rank_send(struct rank *k, const struct dsv4_msg *m);
/* Send ERROR {req, code, message}. */
void rank_send_error(struct rank *k, uint64_t req, uint16_t code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Send a body of just `req` (KV_RELEASE, ABORT_DONE). */
void rank_send_ref(struct rank *k, int cmd, uint64_t req);
/* Requests this rank holds now (HEARTBEAT `active`, drain). */
uint32_t rank_active(const struct rank *k);
/* The N this rank is given in test-only variable `var` ("ROLE@INDEX:N,...";
 * logged as a warning when it applies); 0 when unset or not naming it. */
long rank_test_env(const struct rank *k, const char *var);
/* An operation's result `e`, turned into DSV4_ERR_NOMEM when the rank's
 * count of such operations left before test-only variable `var` applies
 * (*left: k->test_nomem, k->test_export_nomem) reaches 0; test only. */
enum dsv4_err rank_test_nomem(long *left, const char *var, enum dsv4_err e);
/* The role's warm-up calls (prefill_warmup, decode_warmup), which set
 * k->warmed: before registering for a rank outside a group; in a group in
 * the communicator's join (rank_group.c), every rank together.  DSV4_OK,
 * or the error with its message. */
enum dsv4_err rank_warmup(struct rank *k);
/* Inputs of a start-up warm-up call (prefill_warmup, decode_warmup): n_tok
 * token ids in b_tok, varied so that the router spreads them as a prompt
 * would, and n_seqs rows of sampling at temperature 1 in sp, each asking for
 * DSV4_TOP_MAX most likely ids (so that the top path is loaded too). */
void rank_warmup_inputs(struct rank *k, int n_tok, int n_seqs);
/*
 * TOKENS' most likely tokens (*t) for the n tokens whose entries are in
 * k->out_top (token i's out_top.n[i] at i * DSV4_TOP_MAX): packed into k's
 * message arrays; *t is all NULL when no token has any.  Valid until the
 * next call.
 */
void rank_top_pack(struct rank *k, struct dsv4_top *t, int n);
/* Sampling parameters of one row from protocol sampling + step. */
void rank_sample_params(struct dsv4_sample_params *p, const struct dsv4_sampling *s,
    uint64_t step);

/*
 * The pause before registering again after the n-th failure in a row of a
 * kind that can last (a failed group join, a refused READY): none for the
 * first (a passing cause: a peer that died meanwhile, a DISCONNECT meant for
 * the link before), then RANK_JOIN_BACKOFF_MS doubling per failure up to
 * RANK_JOIN_BACKOFF_MAX_MS.
 */
int64_t rank_backoff_ms(int n);

/* Read the pending signals; after SIGTERM or SIGINT exit at once (status 0,
 * STOPPING=1 sent, `phase` in the log: "loading weights").  For the start-up
 * phases outside the loop, which would otherwise hold a stop until they end. */
void rank_exit_if_stopped(struct rank *k, const char *phase);

/* Leave the scheduler link (DISCONNECT `why`), drop everything and register
 * again; used when the model group broke (a member died). */
void rank_relink(struct rank *k, const char *why);
/* Send a HEARTBEAT now (active, MTP counters, in a group the epoch of the
 * communicator the rank works on, 0 = none, and a decode rank's kinds of step
 * without a CUDA graph); no-op unless the link is up.  The loop sends one at
 * least once a heartbeat interval, busy or not (docs/protocol.md §6), and
 * callers when a figure the scheduler shows changed. */
void rank_heartbeat(struct rank *k);

/* --- rank_share.c: one copy of the weights per GPU (CUDA builds) ----------------- */

/*
 * The prefill and decode ranks of a GPU slot (same group, same group rank)
 * hold one copy of the weights between them (share_weights; docs/gpu.md
 * "Weight sharing", common/weights_share.h, kernels/cuda_share.h).
 *
 * rank_share_begin decides whether this rank shares (share_weights, backend,
 * device) and, if so, takes the slot's start-up lock and asks the socket for
 * a peer's copy: *a becomes IMPORT (map the peer's copy), SHAREABLE (no peer:
 * build a copy here, the lock stays held) or PRIVATE (not shared).  `cfg`
 * and `source` ("synthetic:SEED", "checkpoint:PATH") make the fingerprint.
 * rank_share_fallback: the import failed; build here instead (*a becomes
 * SHAREABLE).  rank_share_done, once k->wdev holds the weights: serve them,
 * release the lock, log and report (STATUS=) which way they came.
 */
struct dsv4_cuda_arena;
void rank_share_begin(struct rank *k, const struct dsv4_config *cfg, const char *source,
    struct dsv4_cuda_arena *a);
void rank_share_fallback(struct rank *k, struct dsv4_cuda_arena *a);
void rank_share_done(struct rank *k, const struct dsv4_cuda_arena *a);
/* Stop serving, release everything (safe when not shared). */
void rank_share_free(struct rank *k);

/* --- rank_group.c: a rank of a model group ----------------------------------------- */

/*
 * A group of group_size ranks runs one model (tensor-parallel attention,
 * expert-parallel experts; kernels/forward.h "Model groups").  Every forward
 * call is a collective, so the ranks must run the same calls on the same
 * requests in the same order although messages reach them at different
 * moments: every loop iteration ends in one tick, an all-reduce (minimum)
 * of each rank's runnable requests (ascending, and their complements), and
 * the iteration's work is the leading requests every rank can run, in that
 * order (docs/architecture.md "Model groups").  A peer watchdog thread
 * aborts the communicator when a peer process on this host dies during a
 * collective, so survivors never hang; they re-register and the group
 * re-forms with a new communicator (COMM, docs/protocol.md §6.4).
 */

/* Set up the group state (descriptor buffers, watchdog, the test-only
 * environment above); no-op alone. */
void group_init(struct rank *k, const struct dsv4_config *cfg);
/* Free it (waits for a join in flight first). */
void group_free(struct rank *k);
/* COMM: make the id (rank 0, asked) or join the epoch's communicator. */
void group_comm(struct rank *k, const struct dsv4_rank_comm *c);
/*
 * Joining a communicator waits for the peers (up to a minute when one is
 * slow or stuck in a collective of the old one), so it runs in a thread of
 * its own: making the communicator, binding the model to it and the first
 * exchange (process ids, hosts).  Meanwhile the main loop keeps the link
 * (heartbeats, the scheduler's liveness, signals) and touches neither the
 * backend nor the model: scheduler messages are held (group_hold) and
 * handled in order once the join ended (group_join_poll).  True while a join
 * runs.
 */
bool group_joining(const struct rank *k);
/* Finish the join when its thread is done (then the held messages are
 * dispatched through `dispatch`); no-op otherwise. */
void group_join_poll(struct rank *k, void (*dispatch)(struct rank *, const struct dsv4_msg *));
/* Keep a scheduler message (moved: `m` is left empty) until the join ends. */
void group_hold(struct rank *k, struct dsv4_msg *m);
/* The epoch being joined; 0 when no join runs. */
uint32_t group_joining_epoch(const struct rank *k);
/* A COMM of a newer epoch arrived during the join (held like the others):
 * give the join up now instead of waiting for peers that moved on (the
 * communicator's creation stops waiting at once; a made shm or cudaipc
 * communicator is aborted, a made NCCL one runs its exchange and warm-up to
 * their end).  The join then ends without a re-registration and the held
 * messages start the newer one. */
void group_join_cancel(struct rank *k);
/* Give a join in flight up as group_join_cancel does, wait for it to end
 * and drop its result and the held messages (link lost, shutdown). */
void group_join_abandon(struct rank *k);
/* The tick: fills k->agreed / n_agreed from the local runnable requests
 * (`mine`, n, any order; sorted in place); true when done, false when there is no work this iteration
 * (the communicator broke, or the group switched to a new one). */
bool group_tick(struct rank *k, uint64_t *mine, int n);
/* The communicator failed (`why`): drop it and the work; wait for COMM. */
void group_broken(struct rank *k, const char *why);
/* After a forward call returned: DSV4_OK when no collective it queued has
 * failed since (cudaipc all-reduces give up inside the kernel and report
 * here; dsv4_comm_check), else the error: the call's results are garbage
 * and the group is broken. */
enum dsv4_err group_check(struct rank *k);
/* Bracket collectives (the watchdog acts only inside). */
void group_enter(struct rank *k);
void group_leave(struct rank *k);
/* End the collective section of a forward call (group_enter before the
 * call; `e` its result): in a group, group_check after a call that
 * succeeded, group_leave, and on failure group_broken.  True when the
 * call's results may be used; false when the group broke (the work is
 * dropped).  Outside a group a failure is fatal ("<fmt ...>: <error>"); a
 * prefill call out of device memory is taken care of before
 * (rank_prefill.c: the rank stays up). */
bool group_forward_end(struct rank *k, enum dsv4_err e, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Drop the communicator (new epoch, link lost, shutdown); abort_peers:
 * make the peers' collectives with it fail now. */
void group_close(struct rank *k, bool abort_peers);

/* --- rank_prefill.c ------------------------------------------------------------ */

/* The warm-up (rank_warmup): one forward call of o.rows rows (at most
 * max_seq) to take the backend's working memory now.  Alone, out of device
 * memory, o.rows is halved until a call fits (a warning); in a group that
 * cannot be agreed (a rank out of memory may leave its peers inside a
 * collective), so there it is an error like any other.  DSV4_OK, or the
 * error (not even one row fits, a failed collective...) with its message. */
enum dsv4_err prefill_warmup(struct rank *k);
/* PREFILL: validate, take a job slot, start.  Replies ERROR on refusal. */
void prefill_start(struct rank *k, const struct dsv4_rank_prefill *p);
/* True when some job has tokens left to run. */
bool prefill_pending(const struct rank *k);
/* One forward call over the pending jobs (at most o.rows rows); finished
 * prompts are sampled, exported and reported.  Fatal on model errors
 * (alone); in a group only the requests of k->agreed, in that order, and a
 * failed forward breaks the group. */
void prefill_work(struct rank *k);
/* The requests with prompt tokens left; their count. */
int prefill_runnable(const struct rank *k, uint64_t *reqs);
/* Drop request `req`'s job and export (ABORT); true if anything was held. */
bool prefill_abort(struct rank *k, uint64_t req);
/* Drop every job and export (link lost, shutdown). */
void prefill_reset(struct rank *k);
/* Drop the jobs that arrived before COMM number `gen` (gen < gen) and every
 * export (a group switching epochs, rank_group.c). */
void prefill_reset_before(struct rank *k, uint32_t gen);

/* --- rank_decode.c ---------------------------------------------------------------- */

/* The warm-up (rank_warmup): a step of `slots` streams on slots 0 .. slots
 * - 1, which must be idle, reset after (plain: one with the indexer's
 * scores, one sampled without; with mtp a verify and a draft step), so
 * that the backend's working memory for a full batch is taken, and its
 * graphs recorded, before the first stream.  Smaller batches record their
 * graphs at their first step.  DSV4_OK, or the error with its message (out
 * of device memory included: the rank could not serve a full batch). */
enum dsv4_err decode_warmup(struct rank *k);
/* DECODE: import the state into a slot, KV_RELEASE, add the stream. */
void decode_start(struct rank *k, const struct dsv4_rank_decode *d);
/* True when some stream is running. */
bool decode_pending(const struct rank *k);
/* One step: one token per running stream, TOKENS, DECODE_DONE for ended ones
 * (in a group: the streams of k->agreed, in that order).  A step out of
 * device memory alone gives its streams back to the scheduler (ERROR
 * NO_MEMORY, which re-runs them) and the rank stays up; other model errors
 * are fatal alone; in a group a failed step breaks the group. */
void decode_work(struct rank *k);
/* decode_work with speculative decoding (conf mtp): one verify + draft
 * step, 1 or 2 tokens per stream in the TOKENS message (a stream's in
 * order); drafts proposed and accepted counted for STATUS=. */
void decode_work_spec(struct rank *k);
/* The requests whose stream can step (imported); their count. */
int decode_runnable(const struct rank *k, uint64_t *reqs);
/* Drop request `req`'s stream (ABORT); true if it was running. */
bool decode_abort(struct rank *k, uint64_t req);
/* Finish the imports that completed, fail the ones past their bound;
 * returns ms until the nearest import deadline, or -1 when none runs. */
int64_t decode_imports(struct rank *k, int64_t now);
/* Drop every stream. */
void decode_reset(struct rank *k);
/* Drop the streams that arrived before COMM number `gen` (rank_group.c). */
void decode_reset_before(struct rank *k, uint32_t gen);

/* --- rank_test_drafts.c: test only, forced MTP drafts ------------------------------ */

/* Read DSV4_TEST_MTP_DRAFTS's file into k->test_drafts (a decode rank with
 * mtp; nothing when the variable is unset; a file that cannot be read is
 * logged and ignored). */
void rank_test_drafts_load(struct rank *k);
void rank_test_drafts_free(struct rank *k);
/* Stream `slot` starts with DECODE's `token` (its output's first known). */
void rank_test_drafts_start(struct rank *k, int slot, int32_t token);
/* Stream `slot` emitted `token`. */
void rank_test_drafts_emit(struct rank *k, int slot, int32_t token);
/* Replace *draft, stream `slot`'s next draft, as the file says (no-op
 * without the variable). */
void rank_test_drafts_pick(struct rank *k, int slot, int32_t *draft);

/* --- rank_kv.c: transfer regions ---------------------------------------------------- */

/* Open the transports for this rank (owner "<hash>-prefill-3"): shm always,
 * ucx as the `ucx` key says, cudaipc (cuda backend) as `kv_cudaipc` says;
 * remove the regions a previous process of the same rank left behind.  0 or
 * -1 (logged). */
int kv_open(struct rank *k);
void kv_close(struct rank *k);
/* The warm-up's export (prefill_warmup): slot `slot`'s state of n_tokens
 * into a region sized for region_tokens (>= n_tokens: the longest prompt's
 * state, max_seq) of the transport whose regions are device memory
 * (cudaipc) when it is open, else shm (its name in *via), released at once:
 * a cudaipc region stays in the transport's cache, so the memory the
 * longest prompt's export needs is taken before the rank serves.  DSV4_OK,
 * or the error with its message; *bytes: the region's size. */
enum dsv4_err kv_warmup_export(struct rank *k, int slot, int n_tokens, int region_tokens,
                               size_t *bytes, const char **via);
/* Export slot `slot` (sequence of n_tokens) for `req` over transport t;
 * fills the protocol location (borrowing the export's handle and `seg`).
 * On failure returns the error (logged) and keeps nothing. */
enum dsv4_err kv_export(struct rank *k, enum dsv4_transport t, uint64_t req, int slot,
    uint32_t n_tokens, uint64_t seg[2], struct dsv4_kv_loc *loc);
/* Free `req`'s export; true if there was one. */
bool kv_release(struct rank *k, uint64_t req);
/* The same on KV_RELEASE: the importer has finished reading, so the
 * transport may keep the region for reuse (cudaipc); kv_release is for the
 * unacknowledged cases (abort, a PREFILL_DONE that could not be sent). */
bool kv_released(struct rank *k, uint64_t req);
/* Free every export. */
void kv_release_all(struct rank *k);
/* Free exports older than the timeout, and run the transports' housekeeping
 * (dsv4_kvx_tick); returns ms until the next of either is due, or -1. */
int64_t kv_timers(struct rank *k, int64_t now);
/* Start importing location `loc` for stream st (which must hold `pos`
 * positions afterwards): sets st->xfer, xk, kv_off, kv_len, pos.
 * DSV4_ERR_* with the reason in dsv4_errmsg(). */
enum dsv4_err kv_import_start(struct rank *k, struct rank_stream *st,
    const struct dsv4_kv_loc *loc, uint32_t n_kv, uint32_t pos);
/* Poll st's import; when it finished, copy the state into model slot
 * `slot`.  DSV4_ERR_BUSY while it runs; DSV4_OK or the error when it ended
 * (st->xfer is then NULL). */
enum dsv4_err kv_import_poll(struct rank *k, struct rank_stream *st, int slot);
/* Give up st's import (abort, reset). */
void kv_import_abort(struct rank *k, struct rank_stream *st);

#endif
