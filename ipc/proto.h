/*
 * proto.h — the dsv4 wire protocol (docs/protocol.md, version 1): frame
 * layout, sub-protocol command enums, status codes, limits, the decoded
 * message structs and the msgpack codec.
 *
 * The codec is pure (no ZeroMQ): it turns a message into frames and frames
 * into a message, validating everything on both paths (types, ranges, sizes,
 * limits, frame count).  ipc/zsock.h sends and receives these over sockets.
 * Used by the scheduler, the ranks, dsv4ctl and libdsv4client; no global
 * state, safe to call from any thread on distinct messages.
 *
 * Ownership: a message being encoded borrows every pointer it holds from the
 * caller.  A decoded message owns its strings and arrays (copies of the wire
 * bytes) until dsv4_msg_clear(); handlers copy what they keep (STYLE 7.7).
 */
#ifndef DSV4_IPC_PROTO_H
#define DSV4_IPC_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- Framing ------------------------------------------------------------ */

#define DSV4_PROTO_SIG_LEN 6         /* bytes of frame 1 */
#define DSV4_PROTO_SIG_CLI "DSV4C1"  /* client sub-protocol, version 1 */
#define DSV4_PROTO_SIG_RANK "DSV4R1" /* rank sub-protocol, version 1 */
#define DSV4_PROTO_SIG_CTL "DSV4A1"  /* admin sub-protocol, version 1 */
#define DSV4_PROTO_HDR_FRAMES 4      /* delimiter, signature, command, body */

/* --- Limits (docs/protocol.md §8) ------------------------------------------ */

#define DSV4_PROTO_MAX_BODY (16u << 20)        /* bytes of the msgpack body frame */
#define DSV4_PROTO_MAX_RAW 16                  /* raw frames after the body */
#define DSV4_PROTO_MAX_FRAMES (DSV4_PROTO_HDR_FRAMES + DSV4_PROTO_MAX_RAW)
#define DSV4_PROTO_MAX_PROMPT_BYTES (4u << 20) /* prompt text */
#define DSV4_PROTO_MAX_PROMPT_TOKENS (1u << 20)
#define DSV4_PROTO_MAX_NEW_TOKENS (1u << 20)   /* max_tokens */
#define DSV4_PROTO_MAX_CTX (1u << 20)          /* model positions */
#define DSV4_PROTO_MAX_TOP_K (1u << 20)
#define DSV4_PROTO_MAX_TOP_LOGPROBS 20         /* most likely tokens reported per token */
#define DSV4_PROTO_MAX_TEMPERATURE 10.0
/* The scheduler takes a temperature below this as 0 (greedy): logits /
 * temperature leave float's range near the smallest floats (1e-38 drew
 * the least likely token), and below it sampling is greedy in all but
 * name (a logit gap of 1e-4 is e^10 in odds). */
#define DSV4_PROTO_MIN_TEMPERATURE 1e-5f
#define DSV4_PROTO_MAX_STOP 16                 /* stop strings */
#define DSV4_PROTO_MAX_STOP_BYTES 256          /* bytes per stop string */
#define DSV4_PROTO_MAX_STOP_IDS 64
#define DSV4_PROTO_MAX_RANK_STOP_IDS (DSV4_PROTO_MAX_STOP_IDS + 1) /* DECODE: the client's
                                                   and the EOS the scheduler adds */
#define DSV4_PROTO_MAX_TAG 128                 /* bytes */
#define DSV4_PROTO_MAX_MESSAGE 1024            /* bytes of ERROR/RESULT message, reasons */
#define DSV4_PROTO_MAX_HOST 255                /* bytes */
#define DSV4_PROTO_MAX_DEVICE 64               /* bytes of a rank's device id */
#define DSV4_PROTO_MAX_MODEL 64                /* bytes of a rank's model fingerprint */
#define DSV4_PROTO_MAX_CHUNK 4096              /* ids per client TOKENS */
#define DSV4_PROTO_MAX_TEXT (1u << 20)         /* bytes of text per client TOKENS */
#define DSV4_PROTO_MAX_BATCH 1024              /* entries per rank TOKENS */
#define DSV4_PROTO_MAX_KV_PARTS 16             /* KV locations per DECODE */
#define DSV4_PROTO_MAX_KV_SEGS 64              /* segments per KV location */
#define DSV4_PROTO_MAX_HANDLE 65536            /* bytes of one KV handle frame */
#define DSV4_PROTO_MAX_COMM_ID 256             /* bytes of comm_id */
#define DSV4_PROTO_MAX_TIMEOUT_MS 86400000u    /* 24 h */
#define DSV4_PROTO_MAX_DEPTH 4                 /* msgpack nesting */
#define DSV4_PROTO_MAX_PENDING 65536           /* buffered output tokens per request */
#define DSV4_PROTO_MAX_TARGET 32               /* bytes of admin drain target */
#define DSV4_PROTO_MAX_VERSION 64              /* bytes of admin version string */
#define DSV4_PROTO_MAX_TOKEN 2147483647        /* largest token id on the wire */

/* STATUS handoff histogram (docs/protocol.md §7): handoff_buckets[i] counts
 * the handoffs (scheduler: PREFILL_DONE of every part -> the decode group's
 * KV_RELEASE) that took at most DSV4_PROTO_HANDOFF_BOUNDS_US[i] microseconds;
 * the +Inf bucket is handoff_count.  The list is fixed: changing it needs a
 * new field name. */
#define DSV4_PROTO_HANDOFF_BUCKETS 14
#define DSV4_PROTO_HANDOFF_BOUNDS_US                                          \
    { 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000,     \
      1000000, 2500000, 5000000, 10000000 }

/* Defaults of optional GENERATE fields. */
#define DSV4_PROTO_DEFAULT_MAX_TOKENS 256
#define DSV4_PROTO_DEFAULT_TEMPERATURE 1.0f
#define DSV4_PROTO_DEFAULT_TOP_P 1.0f

/* --- Sub-protocols and commands (append-only numbering) ----------------- */

/* The three sub-protocols, by signature frame. */
enum dsv4_sub {
    DSV4_SUB_NONE = 0,
    DSV4_SUB_CLI,  /* DSV4C1: clients <-> scheduler */
    DSV4_SUB_RANK, /* DSV4R1: ranks <-> scheduler */
    DSV4_SUB_CTL,  /* DSV4A1: dsv4ctl <-> scheduler */
    DSV4_SUB__COUNT
};

/* Client sub-protocol commands (docs/protocol.md §4). */
enum dsv4_cli {
    DSV4_CLI_NONE = 0,
    DSV4_CLI_GENERATE,  /* C->S  start a request (struct dsv4_cli_generate) */
    DSV4_CLI_OK,        /* S->C  request accepted (struct dsv4_cli_ok) */
    DSV4_CLI_ERROR,     /* S->C  request failed/refused (struct dsv4_error) */
    DSV4_CLI_TOKENS,    /* S->C  streamed output chunk (struct dsv4_cli_tokens) */
    DSV4_CLI_DONE,      /* S->C  request finished (struct dsv4_cli_done) */
    DSV4_CLI_CANCEL,    /* C->S  cancel a request (struct dsv4_cli_cancel) */
    DSV4_CLI_HEARTBEAT, /* both  liveness probe / answer; empty body */
    DSV4_CLI__COUNT
};

/* Rank sub-protocol commands (docs/protocol.md §6). */
enum dsv4_rank {
    DSV4_RANK_NONE = 0,
    DSV4_RANK_READY,        /* R->S  register (struct dsv4_rank_ready) */
    DSV4_RANK_WELCOME,      /* S->R  registration accepted (struct dsv4_rank_welcome) */
    DSV4_RANK_HEARTBEAT,    /* both  liveness when idle (struct dsv4_rank_heartbeat) */
    DSV4_RANK_DISCONNECT,   /* both  link closing (struct dsv4_rank_disconnect) */
    DSV4_RANK_PREFILL,      /* S->R  run a prompt (struct dsv4_rank_prefill) */
    DSV4_RANK_PREFILL_DONE, /* R->S  first token + KV location (struct dsv4_rank_prefill_done) */
    DSV4_RANK_DECODE,       /* S->R  import KV, start a stream (struct dsv4_rank_decode) */
    DSV4_RANK_KV_RELEASE,   /* both  KV imported; exporter may free (struct dsv4_req_ref) */
    DSV4_RANK_TOKENS,       /* R->S  one decode step's tokens (struct dsv4_rank_tokens) */
    DSV4_RANK_DECODE_DONE,  /* R->S  stream ended on the rank (struct dsv4_rank_decode_done) */
    DSV4_RANK_ABORT,        /* S->R  drop a request (struct dsv4_req_ref) */
    DSV4_RANK_ABORT_DONE,   /* R->S  request's state freed (struct dsv4_req_ref) */
    DSV4_RANK_DRAIN,        /* S->R  report when idle; R->S  the rank is stopping
                               (SIGTERM): place nothing new on its group, it
                               finishes what it holds; empty body */
    DSV4_RANK_DRAIN_DONE,   /* R->S  idle now; S->R  to a rank that sent DRAIN:
                               nothing is booked on its group any more, it
                               may stop; empty body */
    DSV4_RANK_ERROR,        /* both  failure, maybe of one request (struct dsv4_error) */
    DSV4_RANK_COMM,         /* both  group communicator of an epoch (struct dsv4_rank_comm) */
    DSV4_RANK_GROUP_BROKEN, /* R->S  the rank left its group's broken communicator
                               (struct dsv4_rank_group_broken) */
    DSV4_RANK__COUNT
};

/* Admin sub-protocol commands (docs/protocol.md §7). */
enum dsv4_ctl {
    DSV4_CTL_NONE = 0,
    DSV4_CTL_SHOW_STATUS,   /* C->S  empty body */
    DSV4_CTL_STATUS,        /* S->C  struct dsv4_ctl_status */
    DSV4_CTL_SHOW_RANKS,    /* C->S  empty body */
    DSV4_CTL_RANK,          /* S->C  one rank (struct dsv4_ctl_rank) */
    DSV4_CTL_RANKS_END,     /* S->C  struct dsv4_count */
    DSV4_CTL_SHOW_REQUESTS, /* C->S  empty body */
    DSV4_CTL_REQUEST,       /* S->C  one request (struct dsv4_ctl_request) */
    DSV4_CTL_REQUESTS_END,  /* S->C  struct dsv4_count */
    DSV4_CTL_DRAIN,         /* C->S  struct dsv4_ctl_drain */
    DSV4_CTL_UNDRAIN,       /* C->S  struct dsv4_ctl_drain (timeout_ms unused) */
    DSV4_CTL_RESULT,        /* S->C  final status of a command (struct dsv4_error) */
    DSV4_CTL_CANCEL,        /* C->S  end a request as its client's CANCEL would
                               (struct dsv4_req_ref: the id REQUEST lists);
                               RESULT 200, or 404 when none is in flight */
    DSV4_CTL_RELOAD,        /* C->S  reload the configuration as SIGHUP does;
                               empty body; RESULT 200 with what changed, or 500
                               when the file does not load (nothing changes) */
    DSV4_CTL__COUNT
};

/* Wire status codes (docs/protocol.md §3); append-only. */
enum dsv4_status {
    DSV4_STATUS_OK = 200,
    DSV4_STATUS_BUSY = 300,
    DSV4_STATUS_DRAINING = 301,
    DSV4_STATUS_RESTARTING = 302,  /* the scheduler stops while its ranks serve on:
                                      send the request again with resume (§4.6) */
    DSV4_STATUS_BAD_MESSAGE = 400,
    DSV4_STATUS_BAD_ARGUMENT = 401,
    DSV4_STATUS_NOT_FOUND = 404,
    DSV4_STATUS_TIMEOUT = 408,
    DSV4_STATUS_CANCELLED = 409,
    DSV4_STATUS_TOO_LARGE = 413,
    DSV4_STATUS_SLOW_CONSUMER = 429,
    DSV4_STATUS_INTERNAL = 500,
    DSV4_STATUS_NOT_SUPPORTED = 501,
    DSV4_STATUS_NO_MEMORY = 503,
    DSV4_STATUS_UNREACHABLE = 504, /* client library only; never sent */
};

/* --- Field enumerations (wire: strings; index 0 is never sent) ---------- */

/* Why a request ended (DONE `finish`). */
enum dsv4_finish {
    DSV4_FINISH_NONE = 0,
    DSV4_FINISH_STOP,      /* "stop": stop string or stop id */
    DSV4_FINISH_LENGTH,    /* "length": max_tokens reached */
    DSV4_FINISH_CANCELLED, /* "cancelled" */
    DSV4_FINISH__COUNT
};

/* A rank's role (READY `role`). */
enum dsv4_role {
    DSV4_ROLE_NONE = 0,
    DSV4_ROLE_PREFILL, /* "prefill" */
    DSV4_ROLE_DECODE,  /* "decode" */
    DSV4_ROLE__COUNT
};

/* How decode state moves from a prefill rank to a decode rank (§6.3). */
enum dsv4_transport {
    DSV4_TRANSPORT_NONE = 0,
    DSV4_TRANSPORT_SHM,     /* "shm": POSIX shared memory (CPU backend) */
    DSV4_TRANSPORT_CUDAIPC, /* "cudaipc": cudaIpcMemHandle_t on one host */
    DSV4_TRANSPORT_UCX,     /* "ucx": UCX rkey, across hosts */
    DSV4_TRANSPORT__COUNT
};

/* Request states (docs/protocol.md §5). */
enum dsv4_req_state {
    DSV4_REQ_NONE = 0,
    DSV4_REQ_QUEUED,     /* "queued" */
    DSV4_REQ_PREFILLING, /* "prefilling" */
    DSV4_REQ_HANDOFF,    /* "handoff" */
    DSV4_REQ_DECODING,   /* "decoding" */
    DSV4_REQ_DONE,       /* "done" */
    DSV4_REQ_CANCELLED,  /* "cancelled" */
    DSV4_REQ_FAILED,     /* "failed" */
    DSV4_REQ__COUNT
};

/* Rank states as the scheduler sees them. */
enum dsv4_rank_state {
    DSV4_RANK_STATE_NONE = 0,
    DSV4_RANK_STATE_JOINING,  /* "joining": READY seen, group incomplete */
    DSV4_RANK_STATE_READY,    /* "ready" */
    DSV4_RANK_STATE_DRAINING, /* "draining" */
    DSV4_RANK_STATE_DRAINED,  /* "drained" */
    DSV4_RANK_STATE_DEAD,     /* "dead": liveness expired */
    DSV4_RANK_STATE__COUNT
};

/* --- Message bodies ------------------------------------------------------- */

/* Sampling parameters shared by GENERATE, PREFILL and DECODE. */
struct dsv4_sampling {
    float temperature; /* [0, 10]; 0 = greedy; default 1 */
    float top_p;       /* (0, 1]; default 1 */
    uint32_t top_k;    /* 0 = off; <= DSV4_PROTO_MAX_TOP_K */
    uint64_t seed;     /* valid iff has_seed */
    bool has_seed;     /* false: the scheduler picks a seed */
    bool logprobs;     /* report the sampled token's log-probability */
    uint32_t top_logprobs; /* report this many most likely tokens of each position
                              with their log-probabilities; <=
                              DSV4_PROTO_MAX_TOP_LOGPROBS; default 0 */
};

/* Body of GENERATE (client -> scheduler, §4.1). */
struct dsv4_cli_generate {
    uint64_t id;                /* client's id, >= 1 */
    const char *prompt;         /* UTF-8 text, or NULL when tokens given */
    const int32_t *tokens;      /* prompt ids, or NULL when prompt given */
    uint32_t n_tokens;          /* length of tokens */
    struct dsv4_sampling s;
    uint32_t max_tokens;        /* [1, DSV4_PROTO_MAX_NEW_TOKENS]; default 256 */
    const char *const *stop;    /* stop strings (NULL when none) */
    uint32_t n_stop;            /* <= DSV4_PROTO_MAX_STOP */
    const int32_t *stop_ids;    /* stop token ids (NULL when none) */
    uint32_t n_stop_ids;        /* <= DSV4_PROTO_MAX_STOP_IDS */
    bool stream;                /* default true */
    const char *tag;            /* NULL = none */
    uint32_t timeout_ms;        /* 0 = none */
    /* Resume (docs/protocol.md §4.6): the output tokens the client already
     * has of this request from an earlier scheduler (NULL = a new request),
     * and the bytes of text it has.  Needs `seed` (the one OK gave). */
    const int32_t *resume;
    uint32_t n_resume;          /* [1, max_tokens] when resume is given */
    uint64_t resume_text;       /* bytes of text received, iff has_resume_text */
    bool has_resume_text;
};

/* Body of OK (scheduler -> client): the request was accepted (§4). */
struct dsv4_cli_ok {
    uint64_t id;     /* client's id */
    uint64_t req;    /* scheduler's id */
    const char *tag; /* echoed; NULL = none */
    uint64_t seed;   /* the sampling seed in effect (given or drawn), iff has_seed;
                        a resume sends it back */
    bool has_seed;
};

/* ERROR (client, rank) and RESULT (admin).  Rank ERROR has no id/tag;
 * admin RESULT has only code and message. */
struct dsv4_error {
    uint64_t id;         /* client's id; 0 = unknown */
    uint64_t req;        /* scheduler's id; 0 = none */
    uint16_t code;       /* enum dsv4_status value, 100..599 */
    const char *message; /* human-readable, <= DSV4_PROTO_MAX_MESSAGE bytes */
    const char *tag;     /* echoed; NULL = none */
};

/*
 * The most likely tokens of each of n output tokens (§4.2, §6): top_n[i]
 * (<= DSV4_PROTO_MAX_TOP_LOGPROBS) entries for token i, the tokens' entries
 * one after the other in top_ids / top_logprobs (n_top = Σ top_n), best
 * first.  All NULL (n_top 0) when none is carried.
 */
struct dsv4_top {
    const uint64_t *top_n;       /* n counts, or NULL */
    const int32_t *top_ids;      /* n_top ids, or NULL */
    const float *top_logprobs;   /* n_top log-probabilities (<= 0), or NULL */
    uint32_t n_top;              /* length of top_ids and top_logprobs */
};

/* Body of client TOKENS (scheduler -> client): streamed output (§4.2). */
struct dsv4_cli_tokens {
    uint64_t id;
    uint64_t req;
    const int32_t *tokens;  /* n_tokens ids */
    const float *logprobs;  /* n_tokens values, or NULL when not requested */
    uint32_t n_tokens;      /* [1, DSV4_PROTO_MAX_CHUNK] */
    const char *text;       /* UTF-8 piece; may be "" */
    struct dsv4_top top;    /* with GENERATE top_logprobs > 0: n_tokens counts */
};

/* Body of DONE (scheduler -> client): the request's end (§4.2). */
struct dsv4_cli_done {
    uint64_t id;
    uint64_t req;
    enum dsv4_finish finish;
    uint32_t prompt_tokens;
    uint32_t completion_tokens;
    const char *tag; /* NULL = none */
};

/* Body of CANCEL (client -> scheduler, §4.3). */
struct dsv4_cli_cancel {
    uint64_t id;
};

/*
 * The version of what ranks exchange among themselves outside this protocol:
 * a group's collectives (daemons/rank/rank_group.c: the join's exchange and
 * the tick descriptor) and the decode state a prefill rank exports for a
 * decode rank (kernels/forward.h, dsv4_model_state_export) with the
 * transports' handles for it (ipc/kv_*.c, docs/protocol.md §6.2).  A build
 * that changes any of them increments it: 2 since the ucx handle carries
 * the exporter's hold, 3 since a group's join compares its ranks' layouts.  Ranks send it in READY `abi`
 * (docs/protocol.md §6.1); the scheduler refuses a rank whose abi differs
 * from a live registered rank's, since ranks of two layouts would hang in a
 * collective or hand over state the other cannot read.
 */
#define DSV4_RANK_ABI 3u

/* Body of READY (rank -> scheduler): registration (§6, §6.1). */
struct dsv4_rank_ready {
    enum dsv4_role role;
    uint32_t index;      /* unit instance number, unique per role */
    uint32_t group;      /* model replica */
    uint32_t group_rank; /* < group_size */
    uint32_t group_size; /* >= 1 */
    uint32_t capacity;   /* prompts (prefill) or stream slots (decode) */
    uint32_t max_ctx;    /* longest sequence the KV pool holds */
    const char *host;
    uint32_t pid;        /* 0 = unknown */
    uint32_t transports; /* bit (1 << enum dsv4_transport) per supported kind */
    bool burst;          /* prefill: a burst prefill rank (config `burst`: its
                            group takes prompts while the decode groups are
                            idle); optional, false when absent */
    const char *device;  /* the GPU the rank runs on, as its CUDA UUID in
                            nvidia-smi's form ("GPU-" and 32 hex digits in
                            groups 8-4-4-4-12), unique across hosts: which
                            decode groups a burst prefill group shares its
                            GPUs with (queue_pick_prefill); optional, NULL
                            when absent (the cpu backend: unknown) */
    uint32_t call_rows;  /* prefill: the most prompt tokens the rank runs in
                            one forward call, after its warm-up (a call that
                            did not fit the device halves it: docs/
                            operations.md "prefill_chunk"); a longer prompt
                            runs in several calls */
    uint32_t call_rows_full; /* prefill: what call_rows would be had no
                            warm-up call run out of device memory (its rows
                            per call, at most max_ctx); >= call_rows */
    const char *model;   /* the fingerprint of the model the rank runs
                            (common/weights_fp.h: 16 hex digits); the
                            scheduler refuses a rank whose model differs
                            from the registered ranks'; optional, NULL when
                            absent (not compared) */
    uint32_t abi;        /* DSV4_RANK_ABI of the rank's build, >= 1 (sent
                            iff has_abi; absent, a rank older than the key,
                            it reads 0): the scheduler refuses a rank whose
                            abi differs from the live registered ranks' */
    bool has_abi;
    bool has_call_rows;  /* call_rows and call_rows_full are sent (together,
                            optional): a prefill rank sends them; absent (a
                            decode rank, an older rank) they read 0 */
};

/* Body of WELCOME (scheduler -> rank): registration accepted (§6). */
struct dsv4_rank_welcome {
    uint32_t heartbeat_ms;  /* [10, 600000] */
    uint32_t liveness;      /* [1, 100] */
    uint32_t comm_epoch;
    const uint8_t *comm_id; /* NCCL unique id; NULL = none */
    uint32_t comm_id_len;   /* <= DSV4_PROTO_MAX_COMM_ID */
};

/* Body of rank HEARTBEAT (both ways): liveness when idle (§6). */
struct dsv4_rank_heartbeat {
    uint32_t active; /* requests held now */
    /* Optional speculative-decoding counters (docs/protocol.md §6.1), sent
     * together iff has_mtp, by a decode rank running with mtp = yes (never by
     * the scheduler): MTP drafts proposed and accepted since the rank
     * started, cumulative; accepted <= drafts.  Absent: zeros, has_mtp false. */
    uint64_t mtp_drafts, mtp_accepted;
    bool has_mtp;
    /* Optional (docs/protocol.md §6.1), sent by the ranks of a group of
     * group_size > 1 (never by the scheduler): the epoch of the communicator
     * the rank works on, 0 while it has none (joining one, or waiting for
     * COMM after its group broke).  Valid iff has_comm_epoch. */
    uint32_t comm_epoch;
    bool has_comm_epoch;
    /* Optional (docs/protocol.md §6.1), sent by decode ranks (never by the
     * scheduler): the kinds of decode step (batch sizes) that now run
     * without a CUDA graph because none could be made for want of device
     * memory (kernels/forward.h "Decode graphs"); 0 when all run as graphs,
     * always 0 on the cpu backend.  Valid iff has_graphs_refused. */
    uint32_t graphs_refused;
    bool has_graphs_refused;
};

/*
 * COMM (docs/protocol.md §6.4): the communicator of a group of ranks.
 * S->R to group rank 0 without comm_id: make the id of epoch comm_epoch;
 * R->S from rank 0 with comm_id: the id; S->R to every rank with comm_id:
 * join epoch comm_epoch's communicator with it.
 */
struct dsv4_rank_comm {
    uint32_t comm_epoch;
    const uint8_t *comm_id; /* NULL = asking for one */
    uint32_t comm_id_len;   /* <= DSV4_PROTO_MAX_COMM_ID */
    bool one_host;          /* asking: every rank of the group announced the
                               same host (rank 0 may pick a one-host
                               communicator, cudaipc); default false */
};

/*
 * GROUP_BROKEN (docs/protocol.md §6.5): a rank of a group of group_size > 1
 * dropped the communicator of epoch comm_epoch because it broke (a
 * collective failed or timed out, the peer watchdog aborted it, a forward
 * call failed) and with it every request it held; it stays registered and
 * waits for the next COMM.  The scheduler re-forms the group under a new
 * epoch when comm_epoch is the group's current one, and ignores older
 * epochs.  group and group_rank repeat the rank's READY values.
 */
struct dsv4_rank_group_broken {
    uint32_t group;
    uint32_t group_rank;
    uint32_t comm_epoch;
    const char *reason; /* NULL = none */
};

/* Body of DISCONNECT (both ways): the link closes, with why (§6). */
struct dsv4_rank_disconnect {
    const char *reason; /* NULL = none */
};

/* Body of PREFILL (scheduler -> prefill rank): run a prompt (§6). */
struct dsv4_rank_prefill {
    uint64_t req;
    const int32_t *tokens; /* prompt (+ emitted tokens on a re-run) */
    uint32_t n_tokens;     /* [1, DSV4_PROTO_MAX_PROMPT_TOKENS] */
    struct dsv4_sampling s;
    uint32_t step;         /* output tokens already emitted (RNG position) */
    uint32_t dst_group;    /* decode group that will import the KV */
    enum dsv4_transport transport;
    uint32_t chunk;        /* prefill chunk size in tokens; valid iff has_chunk */
    bool has_chunk;        /* false: the rank picks its own chunk size */
};

/* One exported KV shard (docs/protocol.md §6.2).  The handle rides in a raw
 * frame; segments are (offset, size) pairs inside the exported region. */
struct dsv4_kv_loc {
    uint32_t part;                 /* < n_parts */
    uint32_t n_parts;              /* [1, DSV4_PROTO_MAX_KV_PARTS] */
    enum dsv4_transport transport;
    uint32_t n_tokens;             /* positions covered */
    const uint64_t *sizes;         /* n_seg byte sizes */
    const uint64_t *offsets;       /* n_seg byte offsets */
    uint32_t n_seg;                /* [1, DSV4_PROTO_MAX_KV_SEGS]; both arrays */
    const uint8_t *handle;         /* opaque transport handle */
    uint32_t handle_len;           /* [1, DSV4_PROTO_MAX_HANDLE] */
};

/* Body of PREFILL_DONE (prefill rank -> scheduler): the first token and
 * where its decode state is (§6.2). */
struct dsv4_rank_prefill_done {
    uint64_t req;
    int32_t token;       /* first sampled token */
    float logprob;       /* valid iff has_logprob */
    bool has_logprob;
    const int32_t *top_ids;     /* with PREFILL top_logprobs > 0: the first token's
                                   most likely tokens, best first; NULL = none */
    const float *top_logprobs;  /* their log-probabilities (<= 0) */
    uint32_t n_top;             /* <= DSV4_PROTO_MAX_TOP_LOGPROBS; both arrays */
    struct dsv4_kv_loc kv[1];
    uint32_t n_kv;       /* always 1 */
};

/* Body of DECODE (scheduler -> decode group): import the decode state and
 * start a stream (§6). */
struct dsv4_rank_decode {
    uint64_t req;
    uint32_t slot;         /* stream slot in the decode group */
    int32_t token;         /* token to feed first */
    uint32_t pos;          /* its position = tokens whose KV is present */
    uint32_t max_tokens;   /* tokens the rank may still emit */
    struct dsv4_sampling s;
    const int32_t *stop_ids;
    uint32_t n_stop_ids;   /* <= DSV4_PROTO_MAX_RANK_STOP_IDS (the EOS added) */
    struct dsv4_kv_loc kv[DSV4_PROTO_MAX_KV_PARTS];
    uint32_t n_kv;         /* [1, DSV4_PROTO_MAX_KV_PARTS] */
    uint32_t step;         /* RNG step of the first token the rank samples; valid iff has_step */
    bool has_step;         /* false: step 1 (PREFILL sampled step 0) */
};

/* KV_RELEASE, ABORT, ABORT_DONE. */
struct dsv4_req_ref {
    uint64_t req;
};

/* Body of rank TOKENS (decode rank -> scheduler): one step's tokens of
 * several streams (§6). */
struct dsv4_rank_tokens {
    uint64_t step;         /* decode step counter of the group */
    const uint64_t *reqs;  /* n entries */
    const int32_t *tokens; /* n entries */
    const float *logprobs; /* n entries, or NULL */
    uint32_t n;            /* [1, DSV4_PROTO_MAX_BATCH]; all arrays */
    struct dsv4_top top;   /* for streams with top_logprobs > 0: n counts */
};

/* Body of DECODE_DONE (decode rank -> scheduler): a stream ended (§6). */
struct dsv4_rank_decode_done {
    uint64_t req;
    enum dsv4_finish finish;
    uint32_t n_tokens; /* tokens emitted for the request */
};

/* Body of STATUS (scheduler -> dsv4ctl, §7). */
struct dsv4_ctl_status {
    const char *version;
    uint64_t uptime_ms;
    bool draining;
    uint32_t n_ranks;
    uint32_t n_ranks_ready;
    uint32_t n_queued;
    uint32_t n_running;
    uint64_t n_done;
    uint64_t n_failed;
    /* Optional metrics (sent together, iff has_metrics): requests cancelled
     * and refused at admission, prompt and output tokens, prefill->decode
     * handoffs, re-runs after rank failures, rank deaths. */
    uint64_t n_cancelled, n_rejected, tokens_in, tokens_out;
    uint64_t handoffs, reruns, rank_deaths;
    bool has_metrics;
    /* Optional handoff histogram: handoff_buckets (NULL = absent) holds
     * n_handoff_buckets == DSV4_PROTO_HANDOFF_BUCKETS cumulative counts, one
     * per DSV4_PROTO_HANDOFF_BOUNDS_US entry; handoff_sum_us and
     * handoff_count (valid iff has_handoff) are the total time in
     * microseconds and the number of handoffs measured.  Buckets require
     * has_handoff, never decrease and never exceed handoff_count. */
    const uint64_t *handoff_buckets;
    uint32_t n_handoff_buckets;
    uint64_t handoff_sum_us, handoff_count;
    bool has_handoff;
    /* Optional MTP totals (sent together iff has_mtp, i.e. some rank summed
     * reported MTP counters): the sums of mtp_drafts / mtp_accepted of
     * struct dsv4_ctl_rank over the live (not DEAD) ranks with group_rank 0
     * (every rank of a group runs the same steps, so each group counts once). */
    uint64_t mtp_drafts, mtp_accepted;
    bool has_mtp;
    const char *model;       /* the scheduler's reference model fingerprint
                                (§6.1 READY `model`: its checkpoint's, or
                                else the registered ranks'); optional, NULL
                                when it has none */
};

/* Body of RANK (scheduler -> dsv4ctl): one rank of SHOW_RANKS (§7). */
struct dsv4_ctl_rank {
    enum dsv4_role role;
    uint32_t index;
    uint32_t group;
    uint32_t group_rank;
    const char *host;
    enum dsv4_rank_state state;
    uint32_t active;
    uint32_t capacity;
    uint64_t last_seen_ms;
    uint32_t rank_active;    /* `active` of the rank's last HEARTBEAT; valid iff
                                has_rank_active */
    bool has_rank_active;
    /* MTP counters of the rank's last HEARTBEAT that carried them (cumulative
     * drafts proposed, drafts accepted); sent together iff has_mtp, i.e. the
     * rank decodes with mtp = yes. */
    uint64_t mtp_drafts, mtp_accepted;
    bool has_mtp;
    bool burst;              /* a burst prefill rank (its READY said so);
                                optional, false when absent */
    uint64_t placed;         /* requests the scheduler placed on the rank's
                                group since the rank registered (prompts on a
                                prefill rank, streams on a decode rank; re-runs
                                count again); optional, 0 when absent */
    const char *device;      /* its READY's device; optional, NULL when absent
                                (the rank did not say) */
    uint32_t call_rows, call_rows_full; /* a prefill rank's READY's call_rows
                                and call_rows_full (struct dsv4_rank_ready);
                                valid iff has_call_rows (optional, sent
                                together) */
    bool has_call_rows;
    uint32_t graphs_refused; /* a decode rank's last HEARTBEAT's graphs_refused
                                (struct dsv4_rank_heartbeat); valid iff
                                has_graphs_refused (optional) */
    bool has_graphs_refused;
    const char *model;       /* its READY's model fingerprint; optional, NULL
                                when absent (the rank did not say) */
};

/* Body of REQUEST (scheduler -> dsv4ctl): one request of SHOW_REQUESTS
 * (§7). */
struct dsv4_ctl_request {
    uint64_t req;
    enum dsv4_req_state state;
    const char *tag; /* NULL = none */
    uint32_t prompt_tokens;
    uint32_t completion_tokens;
    uint64_t age_ms;
    /* Where it runs (optional; added after version 1.0): the prefill group
     * running its prompt, valid iff has_prefill_group; the decode group whose
     * slot it holds, valid iff has_decode_group (from placement on, so a
     * prefilling request has both). */
    uint32_t prefill_group;
    bool has_prefill_group;
    uint32_t decode_group;
    bool has_decode_group;
    uint32_t reruns; /* re-runs after a rank or group failure; optional, 0 when absent */
};

/* RANKS_END, REQUESTS_END. */
struct dsv4_count {
    uint32_t count;
};

/* Body of DRAIN and UNDRAIN (dsv4ctl -> scheduler, §7). */
struct dsv4_ctl_drain {
    const char *target;  /* "all", "prefill@N" or "decode@N" */
    uint32_t timeout_ms; /* DRAIN only; 0 = wait forever */
};

/*
 * One message of any sub-protocol.  `u` holds the body named in the command
 * enum's comment; commands with an empty body use no member.  Initialise with
 * dsv4_msg_init() (sets the documented defaults), release a decoded message
 * with dsv4_msg_clear().
 */
struct dsv4_msg {
    enum dsv4_sub sub;
    int cmd; /* enum dsv4_cli / dsv4_rank / dsv4_ctl value of `sub` */
    union {
        struct dsv4_cli_generate generate;
        struct dsv4_cli_ok ok;
        struct dsv4_error error; /* CLI ERROR, RANK ERROR, CTL RESULT */
        struct dsv4_cli_tokens tokens;
        struct dsv4_cli_done done;
        struct dsv4_cli_cancel cancel;
        struct dsv4_rank_ready ready;
        struct dsv4_rank_welcome welcome;
        struct dsv4_rank_heartbeat heartbeat;
        struct dsv4_rank_comm comm;
        struct dsv4_rank_group_broken broken;
        struct dsv4_rank_disconnect disconnect;
        struct dsv4_rank_prefill prefill;
        struct dsv4_rank_prefill_done prefill_done;
        struct dsv4_rank_decode decode;
        struct dsv4_req_ref ref; /* KV_RELEASE, ABORT, ABORT_DONE */
        struct dsv4_rank_tokens step;
        struct dsv4_rank_decode_done decode_done;
        struct dsv4_ctl_status status;
        struct dsv4_ctl_rank rank;
        struct dsv4_ctl_request request;
        struct dsv4_count count; /* RANKS_END, REQUESTS_END */
        struct dsv4_ctl_drain drain;
    } u;
    void *mem; /* decoder-owned copies; freed by dsv4_msg_clear */
};

/* A borrowed byte range: one ZeroMQ frame. */
struct dsv4_frame {
    const void *data;
    size_t len;
};

/* Encoded message: header frames, body and raw frames, ready to send.
 * Frame 0 (empty delimiter) is implicit. */
struct dsv4_wire {
    uint8_t sig[DSV4_PROTO_SIG_LEN];            /* frame 1 */
    uint8_t cmd;                                /* frame 2 */
    char *body;                                 /* frame 3; malloc'd */
    size_t body_len;
    uint32_t n_raw;                             /* frames 4.. */
    struct dsv4_frame raw[DSV4_PROTO_MAX_RAW];  /* borrowed from the message */
};

/* Why a message was refused: a wire status code and a message for the
 * ERROR/RESULT reply, plus what could be recovered of the message so the
 * reply can be addressed (sub = NONE when the signature was bad). */
struct dsv4_perr {
    uint16_t code;                      /* enum dsv4_status */
    enum dsv4_sub sub;                  /* sub-protocol, when recognised */
    int cmd;                            /* command, when recognised; else 0 */
    uint64_t id;                        /* body's "id" if readable; else 0 */
    uint64_t req;                       /* body's "req" if readable; else 0 */
    char message[DSV4_PROTO_MAX_MESSAGE / 4]; /* short human-readable reason */
};

/* --- Codec ------------------------------------------------------------- */

/* Set `m` to command `cmd` of `sub` with every field at its documented
 * default (and mem = NULL).  Does not validate cmd; encode does. */
void dsv4_msg_init(struct dsv4_msg *m, enum dsv4_sub sub, int cmd);

/* Free what a decode allocated and reset `m` to an empty message; idempotent.
 * Pointers previously read from `m` become invalid. */
void dsv4_msg_clear(struct dsv4_msg *m);

/*
 * Validate `m` and encode it into `w` (body malloc'd; raw frames borrowed
 * from `m`, so `m` must outlive `w`).  Returns DSV4_OK, DSV4_ERR_INVAL for a
 * value out of range / limit exceeded / unknown command (reason in `pe` if
 * not NULL and in dsv4_errmsg()), DSV4_ERR_NOMEM.  On failure `w` holds
 * nothing to free.  Release with dsv4_wire_clear().
 */
enum dsv4_err dsv4_msg_encode(const struct dsv4_msg *m, struct dsv4_wire *w,
    struct dsv4_perr *pe);

/* Free the body of `w`; idempotent. */
void dsv4_wire_clear(struct dsv4_wire *w);

/*
 * Decode one message from its frames (after the routing envelope: frame 0 is
 * the empty delimiter).  On success `m` owns copies of all data and the
 * frames may be released.  On failure returns DSV4_ERR_PROTO (bad framing,
 * types, missing keys: code 400), DSV4_ERR_INVAL (401 out of range, 413 too
 * large) or DSV4_ERR_NOMEM, fills `pe` (required) and leaves `m` cleared.
 * Never reads outside the frames; accepts any input.
 */
enum dsv4_err dsv4_msg_decode(struct dsv4_msg *m, const struct dsv4_frame *frames,
    size_t n_frames, struct dsv4_perr *pe);

/* True when both messages have the same command and field values (strings
 * and arrays compared by content).  For tests and the fuzzers. */
bool dsv4_msg_equal(const struct dsv4_msg *a, const struct dsv4_msg *b);

/* --- Names and codes --------------------------------------------------- */

/* "GENERATE", "PREFILL_DONE", ... for logs; "?" when unknown.  Never NULL. */
const char *dsv4_proto_cmd_name(enum dsv4_sub sub, int cmd);

/* "DSV4C1"-style signature of `sub` (6 bytes, not NUL-terminated in the
 * wire, but this string is); NULL for DSV4_SUB_NONE / out of range. */
const char *dsv4_proto_sig(enum dsv4_sub sub);

/* Wire string of an enumeration value ("stop", "decode", "cudaipc",
 * "handoff", "draining"); NULL when out of range. */
const char *dsv4_finish_name(enum dsv4_finish f);
const char *dsv4_role_name(enum dsv4_role r);
const char *dsv4_transport_name(enum dsv4_transport t);
const char *dsv4_req_state_name(enum dsv4_req_state s);
const char *dsv4_rank_state_name(enum dsv4_rank_state s);

/* Map an internal error to its wire status (one table, docs §3). */
uint16_t dsv4_proto_code_from_err(enum dsv4_err e);

/* Map a wire status back to the closest internal error (200 -> DSV4_OK). */
enum dsv4_err dsv4_proto_err_from_code(uint16_t code);

/* Short static description of a wire status ("bad argument"); never NULL. */
const char *dsv4_proto_code_str(uint16_t code);

#ifdef __cplusplus
}
#endif
#endif
