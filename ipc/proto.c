/*
 * proto.c — msgpack codec for the dsv4 wire protocol (see proto.h and
 * docs/protocol.md).
 *
 * DESIGN: every message body is described by a table of fields (key, C type,
 * offset in the body struct, range or size limit, default).  One generic
 * encoder and one generic decoder walk the tables, so the checks that the
 * receiver applies are exactly the checks the sender applies, and a new field
 * is one table line.  Checks that involve two fields live in a per-message
 * hook.  Before msgpack-c sees a body, a scanner walks its bytes and refuses
 * any array or map that declares more elements than bytes remain (msgpack-c
 * would otherwise allocate for the declared count), deep nesting, ext types
 * and trailing bytes.  Decoded strings and arrays are copied into blocks
 * owned by the message.
 */
#include "ipc/proto.h"

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

_Static_assert(sizeof(enum dsv4_finish) == sizeof(int), "enum fields are int-sized");

/* --- Field tables ------------------------------------------------------- */

enum ftype {
    T_U64,     /* uint64_t; uint */
    T_U32,     /* uint32_t; uint */
    T_U16,     /* uint16_t; uint */
    T_TOKEN,   /* int32_t; int in [0, DSV4_PROTO_MAX_TOKEN] */
    T_BOOL,    /* bool */
    T_F32,     /* float; number, never NaN */
    T_STR,     /* const char *; UTF-8, no NUL */
    T_BIN,     /* const uint8_t * + uint32_t length at aux */
    T_ENUM,    /* int-sized enum; str from names[1..] */
    T_ENUMSET, /* uint32_t bit set; [str] from names[1..] */
    T_TOKENS,  /* const int32_t * + uint32_t count at aux; [token] */
    T_U64S,    /* const uint64_t * + count at aux; [uint] */
    T_LOGPROBS, /* const float * + count at aux; [number <= 0] */
    T_STRS,    /* const char *const * + count at aux; [str 1..MAX_STOP_BYTES] */
    T_KVLOCS,  /* struct dsv4_kv_loc[] + count at aux; [map], handles in raw frames */
};

#define F_REQ 0x01  /* required key */
#define F_XMIN 0x02 /* lower bound is exclusive */
#define F_OMIT 0x04 /* a scalar left out of the encoding while it has its default (a
                       key added later: older encodings stay as they were) */

struct field {
    const char *key;           /* body map key */
    uint8_t type;              /* enum ftype */
    uint8_t flags;             /* F_* */
    uint16_t off;              /* offset of the value in the body struct */
    int16_t aux;               /* count/length offset, has-flag offset of an optional scalar, or -1 */
    double lo, hi;             /* numbers: value range; str/bin/arrays: length range */
    const char *const *names;  /* T_ENUM/T_ENUMSET: wire names, [0] unused */
    uint8_t n_names;           /* entries in names including [0] */
    double dflt;               /* default of a scalar */
};

#define U64MAX 18446744073709551615.0
#define U32MAX 4294967295.0

#define FLD(k, st, m, ty, fl, lo, hi, d) \
    { k, ty, fl, offsetof(st, m), -1, lo, hi, NULL, 0, d }
#define FHAS(k, st, m, has, ty, lo, hi) \
    { k, ty, 0, offsetof(st, m), offsetof(st, has), lo, hi, NULL, 0, 0 }
#define FARR(k, st, m, n, ty, fl, lo, hi) \
    { k, ty, fl, offsetof(st, m), offsetof(st, n), lo, hi, NULL, 0, 0 }
#define FENUM(k, st, m, names, fl) \
    { k, T_ENUM, fl, offsetof(st, m), -1, 0, 0, names, \
      sizeof(names) / sizeof(names[0]), 0 }
#define FENUMSET(k, st, m, names) \
    { k, T_ENUMSET, 0, offsetof(st, m), -1, 0, sizeof(names) / sizeof(names[0]) - 1, \
      names, sizeof(names) / sizeof(names[0]), 0 }

#define SAMPLING(st)                                                                 \
    FLD("temperature", st, s.temperature, T_F32, 0, 0, DSV4_PROTO_MAX_TEMPERATURE,   \
        DSV4_PROTO_DEFAULT_TEMPERATURE),                                             \
    FLD("top_p", st, s.top_p, T_F32, F_XMIN, 0, 1, DSV4_PROTO_DEFAULT_TOP_P),        \
    FLD("top_k", st, s.top_k, T_U32, 0, 0, DSV4_PROTO_MAX_TOP_K, 0),                 \
    FHAS("seed", st, s.seed, s.has_seed, T_U64, 0, U64MAX),                          \
    FLD("logprobs", st, s.logprobs, T_BOOL, 0, 0, 1, 0),                             \
    FLD("top_logprobs", st, s.top_logprobs, T_U32, F_OMIT, 0, DSV4_PROTO_MAX_TOP_LOGPROBS, 0)

/* A struct dsv4_top at member m of st, for messages of up to `max` tokens. */
#define TOP(st, m, count, max)                                                       \
    FARR("top_n", st, m.top_n, count, T_U64S, 0, 1, max),                            \
    FARR("top_ids", st, m.top_ids, m.n_top, T_TOKENS, 0, 1,                          \
        (max) * DSV4_PROTO_MAX_TOP_LOGPROBS),                                        \
    FARR("top_logprobs", st, m.top_logprobs, m.n_top, T_LOGPROBS, 0, 1,              \
        (max) * DSV4_PROTO_MAX_TOP_LOGPROBS)

static const char *const finish_names[] = { NULL, "stop", "length", "cancelled" };
static const char *const role_names[] = { NULL, "prefill", "decode" };
static const char *const transport_names[] = { NULL, "shm", "cudaipc", "ucx" };
static const char *const req_state_names[] = { NULL, "queued", "prefilling", "handoff",
    "decoding", "done", "cancelled", "failed" };
static const char *const rank_state_names[] = { NULL, "joining", "ready", "draining",
    "drained", "dead" };

_Static_assert(sizeof(finish_names) / sizeof(finish_names[0]) == DSV4_FINISH__COUNT, "names");
_Static_assert(sizeof(role_names) / sizeof(role_names[0]) == DSV4_ROLE__COUNT, "names");
_Static_assert(sizeof(transport_names) / sizeof(transport_names[0]) == DSV4_TRANSPORT__COUNT,
    "names");
_Static_assert(sizeof(req_state_names) / sizeof(req_state_names[0]) == DSV4_REQ__COUNT, "names");
_Static_assert(sizeof(rank_state_names) / sizeof(rank_state_names[0]) == DSV4_RANK_STATE__COUNT,
    "names");

/* Client sub-protocol. */
static const struct field f_generate[] = {
    FLD("id", struct dsv4_cli_generate, id, T_U64, F_REQ, 1, U64MAX, 0),
    FLD("prompt", struct dsv4_cli_generate, prompt, T_STR, 0, 1, DSV4_PROTO_MAX_PROMPT_BYTES, 0),
    FARR("tokens", struct dsv4_cli_generate, tokens, n_tokens, T_TOKENS, 0, 1,
        DSV4_PROTO_MAX_PROMPT_TOKENS),
    SAMPLING(struct dsv4_cli_generate),
    FLD("max_tokens", struct dsv4_cli_generate, max_tokens, T_U32, 0, 1,
        DSV4_PROTO_MAX_NEW_TOKENS, DSV4_PROTO_DEFAULT_MAX_TOKENS),
    FARR("stop", struct dsv4_cli_generate, stop, n_stop, T_STRS, 0, 0, DSV4_PROTO_MAX_STOP),
    FARR("stop_ids", struct dsv4_cli_generate, stop_ids, n_stop_ids, T_TOKENS, 0, 0,
        DSV4_PROTO_MAX_STOP_IDS),
    FLD("stream", struct dsv4_cli_generate, stream, T_BOOL, 0, 0, 1, 1),
    FLD("tag", struct dsv4_cli_generate, tag, T_STR, 0, 0, DSV4_PROTO_MAX_TAG, 0),
    FLD("timeout_ms", struct dsv4_cli_generate, timeout_ms, T_U32, 0, 0,
        DSV4_PROTO_MAX_TIMEOUT_MS, 0),
    FARR("resume", struct dsv4_cli_generate, resume, n_resume, T_TOKENS, 0, 1,
        DSV4_PROTO_MAX_NEW_TOKENS),
    FHAS("resume_text", struct dsv4_cli_generate, resume_text, has_resume_text, T_U64, 0,
        U64MAX),
};

static const struct field f_cli_ok[] = {
    FLD("id", struct dsv4_cli_ok, id, T_U64, F_REQ, 1, U64MAX, 0),
    FLD("req", struct dsv4_cli_ok, req, T_U64, F_REQ, 1, U64MAX, 0),
    FLD("tag", struct dsv4_cli_ok, tag, T_STR, 0, 0, DSV4_PROTO_MAX_TAG, 0),
    FHAS("seed", struct dsv4_cli_ok, seed, has_seed, T_U64, 0, U64MAX),
};

static const struct field f_cli_error[] = {
    FLD("id", struct dsv4_error, id, T_U64, F_REQ, 0, U64MAX, 0),
    FLD("req", struct dsv4_error, req, T_U64, 0, 0, U64MAX, 0),
    FLD("code", struct dsv4_error, code, T_U16, F_REQ, 100, 599, 0),
    FLD("message", struct dsv4_error, message, T_STR, F_REQ, 0, DSV4_PROTO_MAX_MESSAGE, 0),
    FLD("tag", struct dsv4_error, tag, T_STR, 0, 0, DSV4_PROTO_MAX_TAG, 0),
};

static const struct field f_cli_tokens[] = {
    FLD("id", struct dsv4_cli_tokens, id, T_U64, F_REQ, 1, U64MAX, 0),
    FLD("req", struct dsv4_cli_tokens, req, T_U64, F_REQ, 1, U64MAX, 0),
    FARR("tokens", struct dsv4_cli_tokens, tokens, n_tokens, T_TOKENS, F_REQ, 1,
        DSV4_PROTO_MAX_CHUNK),
    FLD("text", struct dsv4_cli_tokens, text, T_STR, F_REQ, 0, DSV4_PROTO_MAX_TEXT, 0),
    FARR("logprobs", struct dsv4_cli_tokens, logprobs, n_tokens, T_LOGPROBS, 0, 1,
        DSV4_PROTO_MAX_CHUNK),
    TOP(struct dsv4_cli_tokens, top, n_tokens, DSV4_PROTO_MAX_CHUNK),
};

static const struct field f_cli_done[] = {
    FLD("id", struct dsv4_cli_done, id, T_U64, F_REQ, 1, U64MAX, 0),
    FLD("req", struct dsv4_cli_done, req, T_U64, F_REQ, 1, U64MAX, 0),
    FENUM("finish", struct dsv4_cli_done, finish, finish_names, F_REQ),
    FLD("prompt_tokens", struct dsv4_cli_done, prompt_tokens, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("completion_tokens", struct dsv4_cli_done, completion_tokens, T_U32, F_REQ, 0, U32MAX,
        0),
    FLD("tag", struct dsv4_cli_done, tag, T_STR, 0, 0, DSV4_PROTO_MAX_TAG, 0),
};

static const struct field f_cli_cancel[] = {
    FLD("id", struct dsv4_cli_cancel, id, T_U64, F_REQ, 1, U64MAX, 0),
};

/* Rank sub-protocol. */
static const struct field f_ready[] = {
    FENUM("role", struct dsv4_rank_ready, role, role_names, F_REQ),
    FLD("index", struct dsv4_rank_ready, index, T_U32, F_REQ, 0, 65535, 0),
    FLD("group", struct dsv4_rank_ready, group, T_U32, F_REQ, 0, 65535, 0),
    FLD("group_rank", struct dsv4_rank_ready, group_rank, T_U32, F_REQ, 0, 65535, 0),
    FLD("group_size", struct dsv4_rank_ready, group_size, T_U32, F_REQ, 1, 65535, 0),
    FLD("capacity", struct dsv4_rank_ready, capacity, T_U32, F_REQ, 1, 65535, 0),
    FLD("max_ctx", struct dsv4_rank_ready, max_ctx, T_U32, F_REQ, 1, DSV4_PROTO_MAX_CTX, 0),
    FLD("host", struct dsv4_rank_ready, host, T_STR, F_REQ, 0, DSV4_PROTO_MAX_HOST, 0),
    FLD("pid", struct dsv4_rank_ready, pid, T_U32, 0, 0, U32MAX, 0),
    FENUMSET("transports", struct dsv4_rank_ready, transports, transport_names),
    FLD("burst", struct dsv4_rank_ready, burst, T_BOOL, 0, 0, 1, 0),
    FLD("device", struct dsv4_rank_ready, device, T_STR, 0, 1, DSV4_PROTO_MAX_DEVICE, 0),
    FLD("model", struct dsv4_rank_ready, model, T_STR, 0, 1, DSV4_PROTO_MAX_MODEL, 0),
    FHAS("abi", struct dsv4_rank_ready, abi, has_abi, T_U32, 1, U32MAX),
    FHAS("call_rows", struct dsv4_rank_ready, call_rows, has_call_rows, T_U32, 1,
        DSV4_PROTO_MAX_CTX),
    FHAS("call_rows_full", struct dsv4_rank_ready, call_rows_full, has_call_rows, T_U32, 1,
        DSV4_PROTO_MAX_CTX),
};

static const struct field f_welcome[] = {
    FLD("heartbeat_ms", struct dsv4_rank_welcome, heartbeat_ms, T_U32, F_REQ, 10, 600000, 0),
    FLD("liveness", struct dsv4_rank_welcome, liveness, T_U32, F_REQ, 1, 100, 0),
    FLD("comm_epoch", struct dsv4_rank_welcome, comm_epoch, T_U32, 0, 0, U32MAX, 0),
    FARR("comm_id", struct dsv4_rank_welcome, comm_id, comm_id_len, T_BIN, 0, 1,
        DSV4_PROTO_MAX_COMM_ID),
};

static const struct field f_rank_comm[] = {
    FLD("comm_epoch", struct dsv4_rank_comm, comm_epoch, T_U32, F_REQ, 0, U32MAX, 0),
    FARR("comm_id", struct dsv4_rank_comm, comm_id, comm_id_len, T_BIN, 0, 1,
        DSV4_PROTO_MAX_COMM_ID),
    FLD("one_host", struct dsv4_rank_comm, one_host, T_BOOL, 0, 0, 1, 0),
};

static const struct field f_group_broken[] = {
    FLD("group", struct dsv4_rank_group_broken, group, T_U32, F_REQ, 0, 65535, 0),
    FLD("group_rank", struct dsv4_rank_group_broken, group_rank, T_U32, F_REQ, 0, 65535, 0),
    FLD("comm_epoch", struct dsv4_rank_group_broken, comm_epoch, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("reason", struct dsv4_rank_group_broken, reason, T_STR, 0, 0, DSV4_PROTO_MAX_MESSAGE,
        0),
};

static const struct field f_rank_heartbeat[] = {
    FLD("active", struct dsv4_rank_heartbeat, active, T_U32, 0, 0, U32MAX, 0),
    FHAS("mtp_drafts", struct dsv4_rank_heartbeat, mtp_drafts, has_mtp, T_U64, 0, U64MAX),
    FHAS("mtp_accepted", struct dsv4_rank_heartbeat, mtp_accepted, has_mtp, T_U64, 0, U64MAX),
    FHAS("comm_epoch", struct dsv4_rank_heartbeat, comm_epoch, has_comm_epoch, T_U32, 0,
        U32MAX),
    FHAS("graphs_refused", struct dsv4_rank_heartbeat, graphs_refused, has_graphs_refused,
        T_U32, 0, 65535),
};

static const struct field f_disconnect[] = {
    FLD("reason", struct dsv4_rank_disconnect, reason, T_STR, 0, 0, DSV4_PROTO_MAX_MESSAGE, 0),
};

static const struct field f_prefill[] = {
    FLD("req", struct dsv4_rank_prefill, req, T_U64, F_REQ, 1, U64MAX, 0),
    FARR("tokens", struct dsv4_rank_prefill, tokens, n_tokens, T_TOKENS, F_REQ, 1,
        DSV4_PROTO_MAX_PROMPT_TOKENS),
    SAMPLING(struct dsv4_rank_prefill),
    FLD("step", struct dsv4_rank_prefill, step, T_U32, 0, 0, DSV4_PROTO_MAX_NEW_TOKENS, 0),
    FLD("dst_group", struct dsv4_rank_prefill, dst_group, T_U32, F_REQ, 0, 65535, 0),
    FENUM("transport", struct dsv4_rank_prefill, transport, transport_names, F_REQ),
    FHAS("chunk", struct dsv4_rank_prefill, chunk, has_chunk, T_U32, 1,
        DSV4_PROTO_MAX_PROMPT_TOKENS),
};

static const struct field f_kvloc[] = {
    FLD("part", struct dsv4_kv_loc, part, T_U32, F_REQ, 0, DSV4_PROTO_MAX_KV_PARTS - 1, 0),
    FLD("n_parts", struct dsv4_kv_loc, n_parts, T_U32, F_REQ, 1, DSV4_PROTO_MAX_KV_PARTS, 0),
    FENUM("transport", struct dsv4_kv_loc, transport, transport_names, F_REQ),
    FLD("n_tokens", struct dsv4_kv_loc, n_tokens, T_U32, F_REQ, 1, DSV4_PROTO_MAX_CTX, 0),
    FARR("sizes", struct dsv4_kv_loc, sizes, n_seg, T_U64S, F_REQ, 1, DSV4_PROTO_MAX_KV_SEGS),
    FARR("offsets", struct dsv4_kv_loc, offsets, n_seg, T_U64S, F_REQ, 1,
        DSV4_PROTO_MAX_KV_SEGS),
};

static const struct field f_prefill_done[] = {
    FLD("req", struct dsv4_rank_prefill_done, req, T_U64, F_REQ, 1, U64MAX, 0),
    FLD("token", struct dsv4_rank_prefill_done, token, T_TOKEN, F_REQ, 0, DSV4_PROTO_MAX_TOKEN,
        0),
    FHAS("logprob", struct dsv4_rank_prefill_done, logprob, has_logprob, T_F32, -INFINITY, 0),
    FARR("top_ids", struct dsv4_rank_prefill_done, top_ids, n_top, T_TOKENS, 0, 1,
        DSV4_PROTO_MAX_TOP_LOGPROBS),
    FARR("top_logprobs", struct dsv4_rank_prefill_done, top_logprobs, n_top, T_LOGPROBS, 0, 1,
        DSV4_PROTO_MAX_TOP_LOGPROBS),
    FARR("kv", struct dsv4_rank_prefill_done, kv, n_kv, T_KVLOCS, F_REQ, 1, 1),
};

static const struct field f_decode[] = {
    FLD("req", struct dsv4_rank_decode, req, T_U64, F_REQ, 1, U64MAX, 0),
    FLD("slot", struct dsv4_rank_decode, slot, T_U32, F_REQ, 0, 65535, 0),
    FLD("token", struct dsv4_rank_decode, token, T_TOKEN, F_REQ, 0, DSV4_PROTO_MAX_TOKEN, 0),
    FLD("pos", struct dsv4_rank_decode, pos, T_U32, F_REQ, 1, DSV4_PROTO_MAX_CTX, 0),
    FLD("max_tokens", struct dsv4_rank_decode, max_tokens, T_U32, F_REQ, 1,
        DSV4_PROTO_MAX_NEW_TOKENS, 0),
    SAMPLING(struct dsv4_rank_decode),
    FARR("stop_ids", struct dsv4_rank_decode, stop_ids, n_stop_ids, T_TOKENS, 0, 0,
        DSV4_PROTO_MAX_RANK_STOP_IDS),
    FARR("kv", struct dsv4_rank_decode, kv, n_kv, T_KVLOCS, F_REQ, 1, DSV4_PROTO_MAX_KV_PARTS),
    FHAS("step", struct dsv4_rank_decode, step, has_step, T_U32, 0, DSV4_PROTO_MAX_NEW_TOKENS),
};

static const struct field f_req_ref[] = {
    FLD("req", struct dsv4_req_ref, req, T_U64, F_REQ, 1, U64MAX, 0),
};

static const struct field f_rank_tokens[] = {
    FLD("step", struct dsv4_rank_tokens, step, T_U64, F_REQ, 0, U64MAX, 0),
    FARR("reqs", struct dsv4_rank_tokens, reqs, n, T_U64S, F_REQ, 1, DSV4_PROTO_MAX_BATCH),
    FARR("tokens", struct dsv4_rank_tokens, tokens, n, T_TOKENS, F_REQ, 1, DSV4_PROTO_MAX_BATCH),
    FARR("logprobs", struct dsv4_rank_tokens, logprobs, n, T_LOGPROBS, 0, 1,
        DSV4_PROTO_MAX_BATCH),
    TOP(struct dsv4_rank_tokens, top, n, DSV4_PROTO_MAX_BATCH),
};

static const struct field f_decode_done[] = {
    FLD("req", struct dsv4_rank_decode_done, req, T_U64, F_REQ, 1, U64MAX, 0),
    FENUM("finish", struct dsv4_rank_decode_done, finish, finish_names, F_REQ),
    FLD("n_tokens", struct dsv4_rank_decode_done, n_tokens, T_U32, F_REQ, 0, U32MAX, 0),
};

static const struct field f_rank_error[] = {
    FLD("req", struct dsv4_error, req, T_U64, 0, 0, U64MAX, 0),
    FLD("code", struct dsv4_error, code, T_U16, F_REQ, 100, 599, 0),
    FLD("message", struct dsv4_error, message, T_STR, F_REQ, 0, DSV4_PROTO_MAX_MESSAGE, 0),
};

/* Admin sub-protocol. */
static const struct field f_status[] = {
    FLD("version", struct dsv4_ctl_status, version, T_STR, F_REQ, 0, DSV4_PROTO_MAX_VERSION, 0),
    FLD("uptime_ms", struct dsv4_ctl_status, uptime_ms, T_U64, F_REQ, 0, U64MAX, 0),
    FLD("draining", struct dsv4_ctl_status, draining, T_BOOL, F_REQ, 0, 1, 0),
    FLD("n_ranks", struct dsv4_ctl_status, n_ranks, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("n_ranks_ready", struct dsv4_ctl_status, n_ranks_ready, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("n_queued", struct dsv4_ctl_status, n_queued, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("n_running", struct dsv4_ctl_status, n_running, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("n_done", struct dsv4_ctl_status, n_done, T_U64, F_REQ, 0, U64MAX, 0),
    FLD("n_failed", struct dsv4_ctl_status, n_failed, T_U64, F_REQ, 0, U64MAX, 0),
#define METRIC(k) FHAS(#k, struct dsv4_ctl_status, k, has_metrics, T_U64, 0, U64MAX)
    METRIC(n_cancelled), METRIC(n_rejected), METRIC(tokens_in), METRIC(tokens_out),
    METRIC(handoffs), METRIC(reruns), METRIC(rank_deaths),
#undef METRIC
    FARR("handoff_buckets", struct dsv4_ctl_status, handoff_buckets, n_handoff_buckets, T_U64S,
        0, DSV4_PROTO_HANDOFF_BUCKETS, DSV4_PROTO_HANDOFF_BUCKETS),
    FHAS("handoff_sum_us", struct dsv4_ctl_status, handoff_sum_us, has_handoff, T_U64, 0,
        U64MAX),
    FHAS("handoff_count", struct dsv4_ctl_status, handoff_count, has_handoff, T_U64, 0,
        U64MAX),
    FHAS("mtp_drafts", struct dsv4_ctl_status, mtp_drafts, has_mtp, T_U64, 0, U64MAX),
    FHAS("mtp_accepted", struct dsv4_ctl_status, mtp_accepted, has_mtp, T_U64, 0, U64MAX),
    FLD("model", struct dsv4_ctl_status, model, T_STR, 0, 1, DSV4_PROTO_MAX_MODEL, 0),
};

static const struct field f_ctl_rank[] = {
    FENUM("role", struct dsv4_ctl_rank, role, role_names, F_REQ),
    FLD("index", struct dsv4_ctl_rank, index, T_U32, F_REQ, 0, 65535, 0),
    FLD("group", struct dsv4_ctl_rank, group, T_U32, F_REQ, 0, 65535, 0),
    FLD("group_rank", struct dsv4_ctl_rank, group_rank, T_U32, F_REQ, 0, 65535, 0),
    FLD("host", struct dsv4_ctl_rank, host, T_STR, F_REQ, 0, DSV4_PROTO_MAX_HOST, 0),
    FENUM("state", struct dsv4_ctl_rank, state, rank_state_names, F_REQ),
    FLD("active", struct dsv4_ctl_rank, active, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("capacity", struct dsv4_ctl_rank, capacity, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("last_seen_ms", struct dsv4_ctl_rank, last_seen_ms, T_U64, F_REQ, 0, U64MAX, 0),
    FHAS("rank_active", struct dsv4_ctl_rank, rank_active, has_rank_active, T_U32, 0, U32MAX),
    FHAS("mtp_drafts", struct dsv4_ctl_rank, mtp_drafts, has_mtp, T_U64, 0, U64MAX),
    FHAS("mtp_accepted", struct dsv4_ctl_rank, mtp_accepted, has_mtp, T_U64, 0, U64MAX),
    FLD("burst", struct dsv4_ctl_rank, burst, T_BOOL, 0, 0, 1, 0),
    FLD("placed", struct dsv4_ctl_rank, placed, T_U64, 0, 0, U64MAX, 0),
    FLD("device", struct dsv4_ctl_rank, device, T_STR, 0, 1, DSV4_PROTO_MAX_DEVICE, 0),
    FHAS("call_rows", struct dsv4_ctl_rank, call_rows, has_call_rows, T_U32, 1,
        DSV4_PROTO_MAX_CTX),
    FHAS("call_rows_full", struct dsv4_ctl_rank, call_rows_full, has_call_rows, T_U32, 1,
        DSV4_PROTO_MAX_CTX),
    FHAS("graphs_refused", struct dsv4_ctl_rank, graphs_refused, has_graphs_refused, T_U32, 0,
        65535),
    FLD("model", struct dsv4_ctl_rank, model, T_STR, 0, 1, DSV4_PROTO_MAX_MODEL, 0),
};

static const struct field f_count[] = {
    FLD("count", struct dsv4_count, count, T_U32, F_REQ, 0, U32MAX, 0),
};

static const struct field f_ctl_request[] = {
    FLD("req", struct dsv4_ctl_request, req, T_U64, F_REQ, 1, U64MAX, 0),
    FENUM("state", struct dsv4_ctl_request, state, req_state_names, F_REQ),
    FLD("tag", struct dsv4_ctl_request, tag, T_STR, 0, 0, DSV4_PROTO_MAX_TAG, 0),
    FLD("prompt_tokens", struct dsv4_ctl_request, prompt_tokens, T_U32, F_REQ, 0, U32MAX, 0),
    FLD("completion_tokens", struct dsv4_ctl_request, completion_tokens, T_U32, F_REQ, 0,
        U32MAX, 0),
    FLD("age_ms", struct dsv4_ctl_request, age_ms, T_U64, F_REQ, 0, U64MAX, 0),
    FHAS("prefill_group", struct dsv4_ctl_request, prefill_group, has_prefill_group, T_U32, 0,
         65535),
    FHAS("decode_group", struct dsv4_ctl_request, decode_group, has_decode_group, T_U32, 0,
         65535),
    FLD("reruns", struct dsv4_ctl_request, reruns, T_U32, 0, 0, U32MAX, 0),
};

static const struct field f_drain[] = {
    FLD("target", struct dsv4_ctl_drain, target, T_STR, F_REQ, 1, DSV4_PROTO_MAX_TARGET, 0),
    FLD("timeout_ms", struct dsv4_ctl_drain, timeout_ms, T_U32, 0, 0, DSV4_PROTO_MAX_TIMEOUT_MS,
        0),
};

static const struct field f_undrain[] = {
    FLD("target", struct dsv4_ctl_drain, target, T_STR, F_REQ, 1, DSV4_PROTO_MAX_TARGET, 0),
};

static const struct field f_result[] = {
    FLD("code", struct dsv4_error, code, T_U16, F_REQ, 100, 599, 0),
    FLD("message", struct dsv4_error, message, T_STR, F_REQ, 0, DSV4_PROTO_MAX_MESSAGE, 0),
};

/* --- Message tables ------------------------------------------------------- */

typedef enum dsv4_err (*check_fn)(const struct dsv4_msg *m, struct dsv4_perr *pe);

struct mdesc {
    const char *name;          /* command name for logs */
    const struct field *f;     /* body fields; NULL = empty body */
    uint8_t n;                 /* entries in f */
    check_fn check;            /* cross-field checks; NULL = none */
};

static enum dsv4_err check_generate(const struct dsv4_msg *m, struct dsv4_perr *pe);
static enum dsv4_err check_ready(const struct dsv4_msg *m, struct dsv4_perr *pe);
static enum dsv4_err check_ctl_rank(const struct dsv4_msg *m, struct dsv4_perr *pe);
static enum dsv4_err check_kv(const struct dsv4_msg *m, struct dsv4_perr *pe);
static enum dsv4_err check_status(const struct dsv4_msg *m, struct dsv4_perr *pe);
static enum dsv4_err check_tokens(const struct dsv4_msg *m, struct dsv4_perr *pe);
static enum dsv4_err check_prefill_done(const struct dsv4_msg *m, struct dsv4_perr *pe);
static enum dsv4_err check_heartbeat(const struct dsv4_msg *m, struct dsv4_perr *pe);

#define MD(nm, tbl, chk) { nm, tbl, sizeof(tbl) / sizeof(tbl[0]), chk }
#define MD0(nm) { nm, NULL, 0, NULL }

static const struct mdesc cli_desc[DSV4_CLI__COUNT] = {
    [DSV4_CLI_GENERATE] = MD("GENERATE", f_generate, check_generate),
    [DSV4_CLI_OK] = MD("OK", f_cli_ok, NULL),
    [DSV4_CLI_ERROR] = MD("ERROR", f_cli_error, NULL),
    [DSV4_CLI_TOKENS] = MD("TOKENS", f_cli_tokens, check_tokens),
    [DSV4_CLI_DONE] = MD("DONE", f_cli_done, NULL),
    [DSV4_CLI_CANCEL] = MD("CANCEL", f_cli_cancel, NULL),
    [DSV4_CLI_HEARTBEAT] = MD0("HEARTBEAT"),
};

static const struct mdesc rank_desc[DSV4_RANK__COUNT] = {
    [DSV4_RANK_READY] = MD("READY", f_ready, check_ready),
    [DSV4_RANK_WELCOME] = MD("WELCOME", f_welcome, NULL),
    [DSV4_RANK_HEARTBEAT] = MD("HEARTBEAT", f_rank_heartbeat, check_heartbeat),
    [DSV4_RANK_DISCONNECT] = MD("DISCONNECT", f_disconnect, NULL),
    [DSV4_RANK_PREFILL] = MD("PREFILL", f_prefill, NULL),
    [DSV4_RANK_PREFILL_DONE] = MD("PREFILL_DONE", f_prefill_done, check_prefill_done),
    [DSV4_RANK_DECODE] = MD("DECODE", f_decode, check_kv),
    [DSV4_RANK_KV_RELEASE] = MD("KV_RELEASE", f_req_ref, NULL),
    [DSV4_RANK_TOKENS] = MD("TOKENS", f_rank_tokens, check_tokens),
    [DSV4_RANK_DECODE_DONE] = MD("DECODE_DONE", f_decode_done, NULL),
    [DSV4_RANK_ABORT] = MD("ABORT", f_req_ref, NULL),
    [DSV4_RANK_ABORT_DONE] = MD("ABORT_DONE", f_req_ref, NULL),
    [DSV4_RANK_DRAIN] = MD0("DRAIN"),
    [DSV4_RANK_DRAIN_DONE] = MD0("DRAIN_DONE"),
    [DSV4_RANK_ERROR] = MD("ERROR", f_rank_error, NULL),
    [DSV4_RANK_COMM] = MD("COMM", f_rank_comm, NULL),
    [DSV4_RANK_GROUP_BROKEN] = MD("GROUP_BROKEN", f_group_broken, NULL),
};

static const struct mdesc ctl_desc[DSV4_CTL__COUNT] = {
    [DSV4_CTL_SHOW_STATUS] = MD0("SHOW_STATUS"),
    [DSV4_CTL_STATUS] = MD("STATUS", f_status, check_status),
    [DSV4_CTL_SHOW_RANKS] = MD0("SHOW_RANKS"),
    [DSV4_CTL_RANK] = MD("RANK", f_ctl_rank, check_ctl_rank),
    [DSV4_CTL_RANKS_END] = MD("RANKS_END", f_count, NULL),
    [DSV4_CTL_SHOW_REQUESTS] = MD0("SHOW_REQUESTS"),
    [DSV4_CTL_REQUEST] = MD("REQUEST", f_ctl_request, NULL),
    [DSV4_CTL_REQUESTS_END] = MD("REQUESTS_END", f_count, NULL),
    [DSV4_CTL_DRAIN] = MD("DRAIN", f_drain, NULL),
    [DSV4_CTL_UNDRAIN] = MD("UNDRAIN", f_undrain, NULL),
    [DSV4_CTL_RESULT] = MD("RESULT", f_result, NULL),
    [DSV4_CTL_CANCEL] = MD("CANCEL", f_req_ref, NULL),
    [DSV4_CTL_RELOAD] = MD0("RELOAD"),
};

static const struct {
    const char *sig;
    const struct mdesc *desc;
    int n_cmd;
} subs[DSV4_SUB__COUNT] = {
    [DSV4_SUB_CLI] = { DSV4_PROTO_SIG_CLI, cli_desc, DSV4_CLI__COUNT },
    [DSV4_SUB_RANK] = { DSV4_PROTO_SIG_RANK, rank_desc, DSV4_RANK__COUNT },
    [DSV4_SUB_CTL] = { DSV4_PROTO_SIG_CTL, ctl_desc, DSV4_CTL__COUNT },
};

static const struct mdesc *
desc_get(enum dsv4_sub sub, int cmd)
{
    if ((int)sub <= DSV4_SUB_NONE || sub >= DSV4_SUB__COUNT)
        return NULL;
    if (cmd <= 0 || cmd >= subs[sub].n_cmd)
        return NULL;
    return &subs[sub].desc[cmd];
}

/* --- Errors ----------------------------------------------------------- */

/* Record a refusal in `pe` (may be NULL) and the thread's error message;
 * return the internal error matching `code`. */
__attribute__((format(printf, 3, 4))) static enum dsv4_err
perr(struct dsv4_perr *pe, uint16_t code, const char *fmt, ...)
{
    char buf[sizeof(pe->message)];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (pe != NULL) {
        pe->code = code;
        memcpy(pe->message, buf, sizeof(buf));
    }
    return dsv4_err_set(dsv4_proto_err_from_code(code), "%s", buf);
}

/* --- Value checks shared by encoder and decoder ----------------------- */

/* Strict UTF-8 (no overlongs, surrogates or code points above U+10FFFF)
 * without NUL bytes. */
static bool
utf8_ok(const uint8_t *s, size_t n)
{
    size_t i = 0;

    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint32_t cp;

        if (c == 0)
            return false;
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xc2 && c <= 0xdf) {
            len = 2;
            cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
            len = 3;
            cp = c & 0x0f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            len = 4;
            cp = c & 0x07;
        } else {
            return false;
        }
        if (n - i < len)
            return false;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += len;
    }
    return true;
}

static enum dsv4_err
chk_num(const struct field *f, double v, struct dsv4_perr *pe)
{
    bool low = (f->flags & F_XMIN) ? v <= f->lo : v < f->lo;

    if (isnan(v) || low || v > f->hi)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "%s: %g out of range %s%g, %g]", f->key, v,
            (f->flags & F_XMIN) ? "(" : "[", f->lo, f->hi);
    return DSV4_OK;
}

/* Length/count limits: above the maximum is 413, below the minimum 401. */
static enum dsv4_err
chk_len(const char *key, size_t n, double lo, double hi, struct dsv4_perr *pe)
{
    if ((double)n > hi)
        return perr(pe, DSV4_STATUS_TOO_LARGE, "%s: %zu elements/bytes, limit %.0f", key, n, hi);
    if ((double)n < lo)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "%s: %zu elements/bytes, minimum %.0f", key, n,
            lo);
    return DSV4_OK;
}

static enum dsv4_err
chk_str(const char *key, const char *s, size_t n, double lo, double hi, struct dsv4_perr *pe)
{
    enum dsv4_err e = chk_len(key, n, lo, hi, pe);

    if (e != DSV4_OK)
        return e;
    if (!utf8_ok((const uint8_t *)s, n))
        return perr(pe, DSV4_STATUS_BAD_MESSAGE, "%s: not valid UTF-8 (or contains NUL)", key);
    return DSV4_OK;
}

static enum dsv4_err
chk_token(const char *key, int64_t v, struct dsv4_perr *pe)
{
    if (v < 0 || v > DSV4_PROTO_MAX_TOKEN)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "%s: token id %lld out of range", key,
            (long long)v);
    return DSV4_OK;
}

static enum dsv4_err
chk_logprob(const char *key, double v, struct dsv4_perr *pe)
{
    if (isnan(v) || v > 0)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "%s: log-probability %g not <= 0", key, v);
    return DSV4_OK;
}

static enum dsv4_err
check_generate(const struct dsv4_msg *m, struct dsv4_perr *pe)
{
    const struct dsv4_cli_generate *g = &m->u.generate;

    if ((g->prompt == NULL) == (g->tokens == NULL))
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT,
            "GENERATE: exactly one of prompt and tokens is required");
    if (g->has_resume_text && g->resume == NULL)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "GENERATE: resume_text without resume");
    return DSV4_OK;
}

/* The MTP counters (HEARTBEAT, RANK, STATUS): no more accepted than
 * proposed (§6.1). */
static enum dsv4_err
check_mtp(const char *what, bool has, uint64_t drafts, uint64_t accepted,
    struct dsv4_perr *pe)
{
    if (has && accepted > drafts)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "%s: mtp_accepted %llu > mtp_drafts %llu",
            what, (unsigned long long)accepted, (unsigned long long)drafts);
    return DSV4_OK;
}

static enum dsv4_err
check_heartbeat(const struct dsv4_msg *m, struct dsv4_perr *pe)
{
    const struct dsv4_rank_heartbeat *h = &m->u.heartbeat;

    return check_mtp("HEARTBEAT", h->has_mtp, h->mtp_drafts, h->mtp_accepted, pe);
}

/* call_rows and call_rows_full (READY, RANK) come together, each at least 1,
 * the first no more than the second. */
static enum dsv4_err
check_call_rows(const char *what, bool has, uint32_t rows, uint32_t full,
    struct dsv4_perr *pe)
{
    if (has && (rows == 0 || full < rows))
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "%s: call_rows %u without call_rows_full or "
            "above it (%u)", what, rows, full);
    return DSV4_OK;
}

static enum dsv4_err
check_ready(const struct dsv4_msg *m, struct dsv4_perr *pe)
{
    if (m->u.ready.group_rank >= m->u.ready.group_size)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "READY: group_rank %u >= group_size %u",
            m->u.ready.group_rank, m->u.ready.group_size);
    return check_call_rows("READY", m->u.ready.has_call_rows, m->u.ready.call_rows,
        m->u.ready.call_rows_full, pe);
}

static enum dsv4_err
check_ctl_rank(const struct dsv4_msg *m, struct dsv4_perr *pe)
{
    const struct dsv4_ctl_rank *r = &m->u.rank;

    if (check_mtp("RANK", r->has_mtp, r->mtp_drafts, r->mtp_accepted, pe) != DSV4_OK)
        return DSV4_ERR_INVAL;
    return check_call_rows("RANK", r->has_call_rows, r->call_rows, r->call_rows_full, pe);
}

/* The handoff histogram: buckets only with sum and count (which share one
 * has-flag), cumulative and at most the count. */
static enum dsv4_err
check_status(const struct dsv4_msg *m, struct dsv4_perr *pe)
{
    const struct dsv4_ctl_status *st = &m->u.status;
    uint64_t prev = 0;

    if (check_mtp("STATUS", st->has_mtp, st->mtp_drafts, st->mtp_accepted, pe) != DSV4_OK)
        return DSV4_ERR_INVAL;
    if (st->handoff_buckets == NULL)
        return DSV4_OK;
    if (!st->has_handoff)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT,
            "STATUS: handoff_buckets without handoff_sum_us and handoff_count");
    for (uint32_t i = 0; i < st->n_handoff_buckets; i++) {
        if (st->handoff_buckets[i] < prev || st->handoff_buckets[i] > st->handoff_count)
            return perr(pe, DSV4_STATUS_BAD_ARGUMENT,
                "STATUS: handoff_buckets[%u] not cumulative up to handoff_count", i);
        prev = st->handoff_buckets[i];
    }
    return DSV4_OK;
}

static enum dsv4_err
check_kv(const struct dsv4_msg *m, struct dsv4_perr *pe)
{
    const struct dsv4_kv_loc *kv;
    uint32_t n;

    if (m->cmd == DSV4_RANK_DECODE) {
        kv = m->u.decode.kv;
        n = m->u.decode.n_kv;
    } else {
        kv = m->u.prefill_done.kv;
        n = m->u.prefill_done.n_kv;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (kv[i].part >= kv[i].n_parts)
            return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "kv[%u]: part %u >= n_parts %u", i,
                kv[i].part, kv[i].n_parts);
    }
    return DSV4_OK;
}

/* A TOKENS' most likely tokens (struct dsv4_top over n tokens): top_n, when
 * present, has each count <= DSV4_PROTO_MAX_TOP_LOGPROBS and sums to the
 * length of top_ids and top_logprobs, which come together. */
static enum dsv4_err
check_top(const struct dsv4_top *t, uint32_t n, struct dsv4_perr *pe)
{
    uint64_t sum = 0;

    if ((t->top_ids == NULL) != (t->top_logprobs == NULL))
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "top_ids and top_logprobs come together");
    if (t->top_n == NULL) {
        if (t->top_ids != NULL)
            return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "top_ids without top_n");
        return DSV4_OK;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (t->top_n[i] > DSV4_PROTO_MAX_TOP_LOGPROBS)
            return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "top_n[%u]: %llu > %u", i,
                (unsigned long long)t->top_n[i], DSV4_PROTO_MAX_TOP_LOGPROBS);
        sum += t->top_n[i];
    }
    if (sum != (t->top_ids != NULL ? t->n_top : 0))
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "top_n sums to %llu, top_ids has %u",
            (unsigned long long)sum, t->top_ids != NULL ? t->n_top : 0);
    return DSV4_OK;
}

static enum dsv4_err
check_tokens(const struct dsv4_msg *m, struct dsv4_perr *pe)
{
    if (m->sub == DSV4_SUB_CLI)
        return check_top(&m->u.tokens.top, m->u.tokens.n_tokens, pe);
    for (uint32_t i = 0; i < m->u.step.n; i++)   /* req 1 ... 2^64-1 (§6.1) */
        if (m->u.step.reqs[i] == 0)
            return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "TOKENS: reqs[%u] is 0", i);
    return check_top(&m->u.step.top, m->u.step.n, pe);
}

static enum dsv4_err
check_prefill_done(const struct dsv4_msg *m, struct dsv4_perr *pe)
{
    const struct dsv4_rank_prefill_done *d = &m->u.prefill_done;

    if ((d->top_ids == NULL) != (d->top_logprobs == NULL))
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "top_ids and top_logprobs come together");
    return check_kv(m, pe);
}

/* --- Struct access helpers ------------------------------------------------ */

#define AT(base, off, T) ((T *)((char *)(base) + (off)))
#define CAT(base, off, T) ((T const *)((const char *)(base) + (off)))

static double
scalar_get(const struct field *f, const void *base)
{
    switch (f->type) {
    case T_U64: return (double)*CAT(base, f->off, uint64_t);
    case T_U32: return *CAT(base, f->off, uint32_t);
    case T_U16: return *CAT(base, f->off, uint16_t);
    case T_TOKEN: return *CAT(base, f->off, int32_t);
    case T_BOOL: return *CAT(base, f->off, bool);
    case T_F32: return *CAT(base, f->off, float);
    default: return 0;
    }
}

static void
scalar_set_default(const struct field *f, void *base)
{
    switch (f->type) {
    case T_U32: *AT(base, f->off, uint32_t) = (uint32_t)f->dflt; break;
    case T_BOOL: *AT(base, f->off, bool) = f->dflt != 0; break;
    case T_F32: *AT(base, f->off, float) = (float)f->dflt; break;
    default: break; /* zero */
    }
}

static uint32_t
count_get(const struct field *f, const void *base)
{
    return *CAT(base, f->aux, uint32_t);
}

/* --- Encoder ----------------------------------------------------------- */

struct ectx {
    msgpack_packer pk;
    struct dsv4_wire *w;
    struct dsv4_perr *pe;
};

static enum dsv4_err enc_map(struct ectx *c, const struct field *f, size_t nf, const void *base);

static void
pack_str(msgpack_packer *pk, const char *s, size_t n)
{
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* Is field `f` of `base` present in the encoding? */
static bool
enc_present(const struct field *f, const void *base)
{
    switch (f->type) {
    case T_STR: case T_BIN: case T_TOKENS: case T_U64S: case T_LOGPROBS: case T_STRS:
        return *CAT(base, f->off, const void *) != NULL;
    case T_KVLOCS:
        return true;
    default:
        if ((f->flags & F_OMIT) && scalar_get(f, base) == f->dflt)
            return false;
        return f->aux < 0 || *CAT(base, f->aux, bool);
    }
}

static enum dsv4_err
enc_value(struct ectx *c, const struct field *f, const void *base)
{
    msgpack_packer *pk = &c->pk;
    enum dsv4_err e;
    uint32_t n;

    switch (f->type) {
    case T_U64: case T_U32: case T_U16:
        if ((e = chk_num(f, scalar_get(f, base), c->pe)) != DSV4_OK)
            return e;
        if (f->type == T_U64)
            msgpack_pack_uint64(pk, *CAT(base, f->off, uint64_t));
        else
            msgpack_pack_uint64(pk, (uint64_t)scalar_get(f, base));
        return DSV4_OK;
    case T_TOKEN:
        if ((e = chk_token(f->key, *CAT(base, f->off, int32_t), c->pe)) != DSV4_OK)
            return e;
        msgpack_pack_int64(pk, *CAT(base, f->off, int32_t));
        return DSV4_OK;
    case T_BOOL:
        if (*CAT(base, f->off, bool))
            msgpack_pack_true(pk);
        else
            msgpack_pack_false(pk);
        return DSV4_OK;
    case T_F32:
        if ((e = chk_num(f, scalar_get(f, base), c->pe)) != DSV4_OK)
            return e;
        msgpack_pack_float(pk, *CAT(base, f->off, float));
        return DSV4_OK;
    case T_STR: {
        const char *s = *CAT(base, f->off, const char *);
        size_t len = strlen(s);

        if ((e = chk_str(f->key, s, len, f->lo, f->hi, c->pe)) != DSV4_OK)
            return e;
        pack_str(pk, s, len);
        return DSV4_OK;
    }
    case T_BIN:
        n = count_get(f, base);
        if ((e = chk_len(f->key, n, f->lo, f->hi, c->pe)) != DSV4_OK)
            return e;
        msgpack_pack_bin(pk, n);
        msgpack_pack_bin_body(pk, *CAT(base, f->off, const uint8_t *), n);
        return DSV4_OK;
    case T_ENUM: {
        int v = *CAT(base, f->off, int);

        if (v <= 0 || v >= f->n_names)
            return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "%s: value %d out of range", f->key, v);
        pack_str(pk, f->names[v], strlen(f->names[v]));
        return DSV4_OK;
    }
    case T_ENUMSET: {
        uint32_t set = *CAT(base, f->off, uint32_t);

        if ((set & 1u) != 0 || set >= (1u << f->n_names))
            return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "%s: bad set 0x%x", f->key, set);
        msgpack_pack_array(pk, (size_t)__builtin_popcount(set));
        for (int i = 1; i < f->n_names; i++) {
            if (set & (1u << i))
                pack_str(pk, f->names[i], strlen(f->names[i]));
        }
        return DSV4_OK;
    }
    default:
        break;
    }

    /* Arrays. */
    n = count_get(f, base);
    if ((e = chk_len(f->key, n, f->lo, f->hi, c->pe)) != DSV4_OK)
        return e;
    msgpack_pack_array(pk, n);
    for (uint32_t i = 0; i < n; i++) {
        switch (f->type) {
        case T_TOKENS: {
            int32_t v = (*CAT(base, f->off, const int32_t *))[i];

            if ((e = chk_token(f->key, v, c->pe)) != DSV4_OK)
                return e;
            msgpack_pack_int64(pk, v);
            break;
        }
        case T_U64S:
            msgpack_pack_uint64(pk, (*CAT(base, f->off, const uint64_t *))[i]);
            break;
        case T_LOGPROBS: {
            float v = (*CAT(base, f->off, const float *))[i];

            if ((e = chk_logprob(f->key, v, c->pe)) != DSV4_OK)
                return e;
            msgpack_pack_float(pk, v);
            break;
        }
        case T_STRS: {
            const char *s = (*CAT(base, f->off, const char *const *))[i];

            if (s == NULL)
                return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "%s[%u]: NULL", f->key, i);
            if ((e = chk_str(f->key, s, strlen(s), 1, DSV4_PROTO_MAX_STOP_BYTES, c->pe)) !=
                DSV4_OK)
                return e;
            pack_str(pk, s, strlen(s));
            break;
        }
        case T_KVLOCS: {
            const struct dsv4_kv_loc *kv = &CAT(base, f->off, struct dsv4_kv_loc)[i];

            if ((e = enc_map(c, f_kvloc, sizeof(f_kvloc) / sizeof(f_kvloc[0]), kv)) != DSV4_OK)
                return e;
            if ((e = chk_len("kv handle", kv->handle_len, 1, DSV4_PROTO_MAX_HANDLE, c->pe)) !=
                DSV4_OK)
                return e;
            if (kv->handle == NULL)
                return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "kv[%u]: NULL handle", i);
            c->w->raw[c->w->n_raw].data = kv->handle;
            c->w->raw[c->w->n_raw].len = kv->handle_len;
            c->w->n_raw++;
            break;
        }
        default:
            return perr(c->pe, DSV4_STATUS_INTERNAL, "%s: bad field type", f->key);
        }
    }
    return DSV4_OK;
}

static enum dsv4_err
enc_map(struct ectx *c, const struct field *f, size_t nf, const void *base)
{
    size_t n_present = 0;
    enum dsv4_err e;

    for (size_t i = 0; i < nf; i++) {
        if (enc_present(&f[i], base))
            n_present++;
        else if (f[i].flags & F_REQ)
            return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "%s: required field missing",
                f[i].key);
    }
    msgpack_pack_map(&c->pk, n_present);
    for (size_t i = 0; i < nf; i++) {
        if (!enc_present(&f[i], base))
            continue;
        pack_str(&c->pk, f[i].key, strlen(f[i].key));
        if ((e = enc_value(c, &f[i], base)) != DSV4_OK)
            return e;
    }
    return DSV4_OK;
}

enum dsv4_err
dsv4_msg_encode(const struct dsv4_msg *m, struct dsv4_wire *w, struct dsv4_perr *pe)
{
    const struct mdesc *d = desc_get(m->sub, m->cmd);
    msgpack_sbuffer sb;
    struct ectx c;
    enum dsv4_err e;

    memset(w, 0, sizeof(*w));
    if (d == NULL)
        return perr(pe, DSV4_STATUS_BAD_ARGUMENT, "encode: unknown command %d of sub-protocol %d",
            m->cmd, (int)m->sub);
    if (d->check != NULL && (e = d->check(m, pe)) != DSV4_OK)
        return e;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&c.pk, &sb, msgpack_sbuffer_write);
    c.w = w;
    c.pe = pe;
    if (d->f == NULL) {
        msgpack_pack_map(&c.pk, 0);
        e = DSV4_OK;
    } else {
        e = enc_map(&c, d->f, d->n, &m->u);
    }
    if (e == DSV4_OK && sb.size > DSV4_PROTO_MAX_BODY)
        e = perr(pe, DSV4_STATUS_TOO_LARGE, "%s: body of %zu bytes over the limit", d->name,
            sb.size);
    if (e == DSV4_OK && sb.data == NULL)
        e = perr(pe, DSV4_STATUS_NO_MEMORY, "%s: out of memory", d->name);
    if (e != DSV4_OK) {
        msgpack_sbuffer_destroy(&sb);
        memset(w, 0, sizeof(*w));
        return e;
    }
    memcpy(w->sig, subs[m->sub].sig, DSV4_PROTO_SIG_LEN);
    w->cmd = (uint8_t)m->cmd;
    w->body_len = sb.size;
    w->body = msgpack_sbuffer_release(&sb);
    return DSV4_OK;
}

void
dsv4_wire_clear(struct dsv4_wire *w)
{
    free(w->body);
    memset(w, 0, sizeof(*w));
}

/* --- Message memory --------------------------------------------------- */

struct blk {
    struct blk *next;
    max_align_t data[];
};

static void *
msg_alloc(struct dsv4_msg *m, size_t n)
{
    struct blk *b = malloc(sizeof(*b) + (n == 0 ? 1 : n));

    if (b == NULL)
        return NULL;
    b->next = m->mem;
    m->mem = b;
    return b->data;
}

void
dsv4_msg_init(struct dsv4_msg *m, enum dsv4_sub sub, int cmd)
{
    const struct mdesc *d = desc_get(sub, cmd);

    memset(m, 0, sizeof(*m));
    m->sub = sub;
    m->cmd = cmd;
    if (d == NULL || d->f == NULL)
        return;
    for (size_t i = 0; i < d->n; i++)
        scalar_set_default(&d->f[i], &m->u);
}

void
dsv4_msg_clear(struct dsv4_msg *m)
{
    struct blk *b = m->mem;

    while (b != NULL) {
        struct blk *next = b->next;

        free(b);
        b = next;
    }
    memset(m, 0, sizeof(*m));
}

/* --- Pre-scan of msgpack bytes ------------------------------------------ */

/* Largest array and map the scanner lets through (largest legal array: a
 * prompt; maps: our bodies plus room for future optional keys). */
#define SCAN_MAX_ARRAY DSV4_PROTO_MAX_PROMPT_TOKENS
#define SCAN_MAX_MAP 256
/* Objects of one body, nested ones included: the most a legal body holds (a
 * GENERATE's prompt, resumed tokens and their logprobs) and room for the
 * rest.  Without it a 16 MiB body of small nested arrays (16M objects)
 * cost the decoder ~400 MB and most of a second on the scheduler's thread. */
#define SCAN_MAX_OBJECTS (3 * (size_t)SCAN_MAX_ARRAY + 65536)

/*
 * Walk one msgpack object at p[0..len) and return its encoded size, or 0 when
 * it is truncated, uses ext types or the reserved byte, nests deeper than
 * `depth` or declares more elements than bytes remain; *big is set when an
 * array or map is over SCAN_MAX_ARRAY/SCAN_MAX_MAP, or when *objs (objects
 * seen so far, this one counted) passes SCAN_MAX_OBJECTS.  Bounded work and
 * recursion; no allocation.
 */
static size_t
mp_scan(const uint8_t *p, size_t len, int depth, bool *big, size_t *objs)
{
    size_t hdr, n = 0, used;
    uint8_t b;
    bool container = false, pairs = false;

    if (len == 0)
        return 0;
    if (++*objs > SCAN_MAX_OBJECTS) {
        *big = true;
        return 0;
    }
    b = p[0];
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
        return 1;
    if (b >= 0x80 && b <= 0x8f) {
        hdr = 1, n = b & 0x0f, container = pairs = true;
    } else if (b >= 0x90 && b <= 0x9f) {
        hdr = 1, n = b & 0x0f, container = true;
    } else if (b >= 0xa0 && b <= 0xbf) {
        hdr = 1, n = b & 0x1f;
    } else {
        static const uint8_t fixed[] = {
            [0xca - 0xca] = 4, [0xcb - 0xca] = 8, [0xcc - 0xca] = 1, [0xcd - 0xca] = 2,
            [0xce - 0xca] = 4, [0xcf - 0xca] = 8, [0xd0 - 0xca] = 1, [0xd1 - 0xca] = 2,
            [0xd2 - 0xca] = 4, [0xd3 - 0xca] = 8,
        };
        size_t k;

        if (b >= 0xca && b <= 0xd3)
            return len >= 1u + fixed[b - 0xca] ? 1u + fixed[b - 0xca] : 0;
        switch (b) {
        case 0xc4: case 0xd9: k = 1; break;          /* bin8, str8 */
        case 0xc5: case 0xda: k = 2; break;          /* bin16, str16 */
        case 0xc6: case 0xdb: k = 4; break;          /* bin32, str32 */
        case 0xdc: k = 2; container = true; break;   /* array16 */
        case 0xdd: k = 4; container = true; break;   /* array32 */
        case 0xde: k = 2; container = pairs = true; break; /* map16 */
        case 0xdf: k = 4; container = pairs = true; break; /* map32 */
        default: return 0;                           /* 0xc1, ext */
        }
        if (len < 1 + k)
            return 0;
        for (size_t i = 0; i < k; i++)
            n = (n << 8) | p[1 + i];
        hdr = 1 + k;
    }
    if (!container)
        return n <= len - hdr ? hdr + n : 0;
    if (depth <= 0)
        return 0;
    if (n > (pairs ? SCAN_MAX_MAP : SCAN_MAX_ARRAY)) {
        *big = true;
        return 0;
    }
    if (pairs) {
        if (n > (len - hdr) / 2)
            return 0;
        n *= 2;
    } else if (n > len - hdr) {
        return 0;
    }
    used = hdr;
    for (size_t i = 0; i < n; i++) {
        size_t k = mp_scan(p + used, len - used, depth - 1, big, objs);

        if (k == 0)
            return 0;
        used += k;
    }
    return used;
}

/* --- Decoder ----------------------------------------------------------- */

struct dctx {
    struct dsv4_msg *m;              /* owns the copies */
    struct dsv4_perr *pe;
    const struct dsv4_frame *raw;    /* raw frames after the body */
    size_t n_raw;
    size_t raw_used;                 /* raw frames claimed by KV locations */
};

static enum dsv4_err dec_map(struct dctx *c, const msgpack_object *o, const struct field *f,
    size_t nf, void *base);

static enum dsv4_err
type_err(struct dctx *c, const char *key, const char *want)
{
    return perr(c->pe, DSV4_STATUS_BAD_MESSAGE, "%s: expected %s", key, want);
}

/* Read an integer object; *neg set when negative. */
static bool
obj_int(const msgpack_object *o, uint64_t *u, int64_t *s, bool *neg)
{
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        *u = o->via.u64;
        *s = o->via.u64 > INT64_MAX ? INT64_MAX : (int64_t)o->via.u64;
        *neg = false;
        return true;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *u = 0;
        *s = o->via.i64;
        *neg = true;
        return true;
    }
    return false;
}

static bool
obj_num(const msgpack_object *o, double *v)
{
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER: *v = (double)o->via.u64; return true;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *v = (double)o->via.i64; return true;
    case MSGPACK_OBJECT_FLOAT32: case MSGPACK_OBJECT_FLOAT64: *v = o->via.f64; return true;
    default: return false;
    }
}

static enum dsv4_err
dec_token(struct dctx *c, const char *key, const msgpack_object *o, int32_t *out)
{
    uint64_t u;
    int64_t s;
    bool neg;
    enum dsv4_err e;

    if (!obj_int(o, &u, &s, &neg))
        return type_err(c, key, "integer token id");
    if ((e = chk_token(key, s, c->pe)) != DSV4_OK)
        return e;
    *out = (int32_t)s;
    return DSV4_OK;
}

static enum dsv4_err
dec_str(struct dctx *c, const char *key, const msgpack_object *o, double lo, double hi,
    const char **out)
{
    enum dsv4_err e;
    char *s;

    if (o->type != MSGPACK_OBJECT_STR)
        return type_err(c, key, "string");
    if ((e = chk_str(key, o->via.str.ptr, o->via.str.size, lo, hi, c->pe)) != DSV4_OK)
        return e;
    if ((s = msg_alloc(c->m, o->via.str.size + 1)) == NULL)
        return perr(c->pe, DSV4_STATUS_NO_MEMORY, "%s: out of memory", key);
    memcpy(s, o->via.str.ptr, o->via.str.size);
    s[o->via.str.size] = '\0';
    *out = s;
    return DSV4_OK;
}

static enum dsv4_err
dec_enum(struct dctx *c, const struct field *f, const msgpack_object *o, int *out)
{
    if (o->type != MSGPACK_OBJECT_STR)
        return type_err(c, f->key, "string");
    for (int i = 1; i < f->n_names; i++) {
        if (o->via.str.size == strlen(f->names[i]) &&
            memcmp(o->via.str.ptr, f->names[i], o->via.str.size) == 0) {
            *out = i;
            return DSV4_OK;
        }
    }
    return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "%s: unknown value", f->key);
}

static enum dsv4_err
dec_array(struct dctx *c, const struct field *f, const msgpack_object *o, void *base)
{
    static const size_t elem[] = { [T_TOKENS] = sizeof(int32_t), [T_U64S] = sizeof(uint64_t),
        [T_LOGPROBS] = sizeof(float), [T_STRS] = sizeof(char *),
        [T_KVLOCS] = 0 };
    uint32_t n;
    enum dsv4_err e;
    void *arr;

    if (o->type != MSGPACK_OBJECT_ARRAY)
        return type_err(c, f->key, "array");
    n = o->via.array.size;
    if ((e = chk_len(f->key, n, f->lo, f->hi, c->pe)) != DSV4_OK)
        return e;
    if (f->type == T_KVLOCS) {
        arr = AT(base, f->off, struct dsv4_kv_loc);
    } else {
        if ((arr = msg_alloc(c->m, (size_t)n * elem[f->type])) == NULL)
            return perr(c->pe, DSV4_STATUS_NO_MEMORY, "%s: out of memory", f->key);
        *AT(base, f->off, void *) = arr;
    }
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *x = &o->via.array.ptr[i];
        uint64_t u;
        int64_t s;
        bool neg;
        double v;

        switch (f->type) {
        case T_TOKENS:
            if ((e = dec_token(c, f->key, x, &((int32_t *)arr)[i])) != DSV4_OK)
                return e;
            break;
        case T_U64S:
            if (!obj_int(x, &u, &s, &neg))
                return type_err(c, f->key, "array of unsigned integers");
            if (neg)
                return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "%s: negative value", f->key);
            ((uint64_t *)arr)[i] = u;
            break;
        case T_LOGPROBS:
            if (!obj_num(x, &v))
                return type_err(c, f->key, "array of numbers");
            if ((e = chk_logprob(f->key, v, c->pe)) != DSV4_OK)
                return e;
            ((float *)arr)[i] = (float)v;
            break;
        case T_STRS:
            if ((e = dec_str(c, f->key, x, 1, DSV4_PROTO_MAX_STOP_BYTES,
                     &((const char **)arr)[i])) != DSV4_OK)
                return e;
            break;
        case T_KVLOCS: {
            struct dsv4_kv_loc *kv = &((struct dsv4_kv_loc *)arr)[i];

            if ((e = dec_map(c, x, f_kvloc, sizeof(f_kvloc) / sizeof(f_kvloc[0]), kv)) !=
                DSV4_OK)
                return e;
            if (c->raw_used >= c->n_raw)
                return perr(c->pe, DSV4_STATUS_BAD_MESSAGE, "kv[%u]: handle frame missing", i);
            if ((e = chk_len("kv handle", c->raw[c->raw_used].len, 1, DSV4_PROTO_MAX_HANDLE,
                     c->pe)) != DSV4_OK)
                return e;
            uint8_t *h = msg_alloc(c->m, c->raw[c->raw_used].len);

            if (h == NULL)
                return perr(c->pe, DSV4_STATUS_NO_MEMORY, "kv: out of memory");
            memcpy(h, c->raw[c->raw_used].data, c->raw[c->raw_used].len);
            kv->handle = h;
            kv->handle_len = (uint32_t)c->raw[c->raw_used].len;
            c->raw_used++;
            break;
        }
        default:
            return perr(c->pe, DSV4_STATUS_INTERNAL, "%s: bad field type", f->key);
        }
    }
    *AT(base, f->aux, uint32_t) = n;
    return DSV4_OK;
}

static enum dsv4_err
dec_value(struct dctx *c, const struct field *f, const msgpack_object *o, void *base)
{
    uint64_t u;
    int64_t s;
    bool neg;
    double v;
    enum dsv4_err e;

    switch (f->type) {
    case T_U64: case T_U32: case T_U16:
        if (!obj_int(o, &u, &s, &neg))
            return type_err(c, f->key, "unsigned integer");
        if (neg)
            return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "%s: negative value", f->key);
        if ((e = chk_num(f, (double)u, c->pe)) != DSV4_OK)
            return e;
        if (f->type == T_U64)
            *AT(base, f->off, uint64_t) = u;
        else if (f->type == T_U32)
            *AT(base, f->off, uint32_t) = (uint32_t)u;
        else
            *AT(base, f->off, uint16_t) = (uint16_t)u;
        break;
    case T_TOKEN:
        return dec_token(c, f->key, o, AT(base, f->off, int32_t));
    case T_BOOL:
        if (o->type != MSGPACK_OBJECT_BOOLEAN)
            return type_err(c, f->key, "boolean");
        *AT(base, f->off, bool) = o->via.boolean;
        break;
    case T_F32:
        if (!obj_num(o, &v))
            return type_err(c, f->key, "number");
        /* checked as the float it becomes, as the encoder checks it: a
         * top_p of 1e-50 passed "> 0" as a double and became 0.0f, which
         * the scheduler then could not send on (the request hung) */
        if ((e = chk_num(f, (double)(float)v, c->pe)) != DSV4_OK)
            return e;
        *AT(base, f->off, float) = (float)v;
        break;
    case T_STR:
        return dec_str(c, f->key, o, f->lo, f->hi, AT(base, f->off, const char *));
    case T_BIN: {
        uint8_t *b;

        if (o->type != MSGPACK_OBJECT_BIN)
            return type_err(c, f->key, "binary");
        if ((e = chk_len(f->key, o->via.bin.size, f->lo, f->hi, c->pe)) != DSV4_OK)
            return e;
        if ((b = msg_alloc(c->m, o->via.bin.size)) == NULL)
            return perr(c->pe, DSV4_STATUS_NO_MEMORY, "%s: out of memory", f->key);
        memcpy(b, o->via.bin.ptr, o->via.bin.size);
        *AT(base, f->off, const uint8_t *) = b;
        *AT(base, f->aux, uint32_t) = o->via.bin.size;
        return DSV4_OK;
    }
    case T_ENUM:
        return dec_enum(c, f, o, AT(base, f->off, int));
    case T_ENUMSET: {
        uint32_t set = 0;

        if (o->type != MSGPACK_OBJECT_ARRAY)
            return type_err(c, f->key, "array of strings");
        if ((e = chk_len(f->key, o->via.array.size, f->lo, f->hi, c->pe)) != DSV4_OK)
            return e;
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            int x;

            if ((e = dec_enum(c, f, &o->via.array.ptr[i], &x)) != DSV4_OK)
                return e;
            set |= 1u << x;
        }
        *AT(base, f->off, uint32_t) = set;
        break;
    }
    default:
        return dec_array(c, f, o, base);
    }
    if (f->aux >= 0)
        *AT(base, f->aux, bool) = true; /* has-flag of an optional scalar */
    return DSV4_OK;
}

static bool
is_array_type(uint8_t t)
{
    return t == T_TOKENS || t == T_U64S || t == T_LOGPROBS || t == T_STRS || t == T_KVLOCS;
}

/* Whether f is an optional scalar with a has-flag (FHAS: aux is the flag). */
static bool
is_has_field(const struct field *f)
{
    return f->aux >= 0 && !is_array_type(f->type) && f->type != T_BIN;
}

static enum dsv4_err
dec_map(struct dctx *c, const msgpack_object *o, const struct field *f, size_t nf, void *base)
{
    uint64_t seen = 0;
    enum dsv4_err e;

    if (o->type != MSGPACK_OBJECT_MAP)
        return perr(c->pe, DSV4_STATUS_BAD_MESSAGE, "expected a map");
    for (uint32_t k = 0; k < o->via.map.size; k++) {
        const msgpack_object_kv *kv = &o->via.map.ptr[k];
        size_t i;

        if (kv->key.type != MSGPACK_OBJECT_STR)
            return perr(c->pe, DSV4_STATUS_BAD_MESSAGE, "map key is not a string");
        for (i = 0; i < nf; i++) {
            if (kv->key.via.str.size == strlen(f[i].key) &&
                memcmp(kv->key.via.str.ptr, f[i].key, kv->key.via.str.size) == 0)
                break;
        }
        if (i == nf)
            continue; /* unknown keys are ignored */
        if (seen & (1ull << i))
            return perr(c->pe, DSV4_STATUS_BAD_MESSAGE, "%s: duplicate key", f[i].key);
        /* Arrays sharing one count must agree with those decoded before. */
        if (is_array_type(f[i].type) && kv->val.type == MSGPACK_OBJECT_ARRAY) {
            for (size_t j = 0; j < nf; j++) {
                if (j != i && (seen & (1ull << j)) && f[j].aux == f[i].aux &&
                    is_array_type(f[j].type) &&
                    *AT(base, f[j].aux, uint32_t) != kv->val.via.array.size)
                    return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT,
                        "%s and %s: lengths differ", f[j].key, f[i].key);
            }
        }
        if ((e = dec_value(c, &f[i], &kv->val, base)) != DSV4_OK)
            return e;
        seen |= 1ull << i;
    }
    for (size_t i = 0; i < nf; i++) {
        if ((f[i].flags & F_REQ) && !(seen & (1ull << i)))
            return perr(c->pe, DSV4_STATUS_BAD_MESSAGE, "%s: required key missing", f[i].key);
    }
    /* Optional scalars of one has-flag come together (the handoff figures,
     * the MTP counters, the metrics, call_rows): one alone read the others
     * as 0. */
    for (size_t i = 0; i < nf; i++) {
        if (!is_has_field(&f[i]) || !(seen & (1ull << i)))
            continue;
        for (size_t j = 0; j < nf; j++)
            if (j != i && is_has_field(&f[j]) && f[j].aux == f[i].aux && !(seen & (1ull << j)))
                return perr(c->pe, DSV4_STATUS_BAD_ARGUMENT, "%s without %s: they come "
                    "together", f[i].key, f[j].key);
    }
    return DSV4_OK;
}

/* After a failed decode, recover "id" and "req" for the error reply. */
static void
salvage_ids(const msgpack_object *o, struct dsv4_perr *pe)
{
    if (o->type != MSGPACK_OBJECT_MAP)
        return;
    for (uint32_t k = 0; k < o->via.map.size; k++) {
        const msgpack_object_kv *kv = &o->via.map.ptr[k];

        if (kv->key.type != MSGPACK_OBJECT_STR || kv->val.type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            continue;
        if (kv->key.via.str.size == 2 && memcmp(kv->key.via.str.ptr, "id", 2) == 0)
            pe->id = kv->val.via.u64;
        else if (kv->key.via.str.size == 3 && memcmp(kv->key.via.str.ptr, "req", 3) == 0)
            pe->req = kv->val.via.u64;
    }
}

enum dsv4_err
dsv4_msg_decode(struct dsv4_msg *m, const struct dsv4_frame *fr, size_t n_frames,
    struct dsv4_perr *pe)
{
    const struct mdesc *d;
    msgpack_unpacked up;
    struct dctx c;
    enum dsv4_sub sub = DSV4_SUB_NONE;
    enum dsv4_err e;
    size_t off = 0;
    bool big = false;
    size_t objs = 0;
    int cmd;

    memset(m, 0, sizeof(*m));
    memset(pe, 0, sizeof(*pe));
    if (n_frames < DSV4_PROTO_HDR_FRAMES)
        return perr(pe, DSV4_STATUS_BAD_MESSAGE, "%zu frames, need at least %d", n_frames,
            DSV4_PROTO_HDR_FRAMES);
    if (fr[0].len != 0)
        return perr(pe, DSV4_STATUS_BAD_MESSAGE, "frame 0 is not the empty delimiter");
    for (int s = DSV4_SUB_CLI; s < DSV4_SUB__COUNT; s++) {
        if (fr[1].len == DSV4_PROTO_SIG_LEN &&
            memcmp(fr[1].data, subs[s].sig, DSV4_PROTO_SIG_LEN) == 0)
            sub = (enum dsv4_sub)s;
    }
    if (sub == DSV4_SUB_NONE)
        return perr(pe, DSV4_STATUS_BAD_MESSAGE, "unknown protocol signature or version");
    pe->sub = sub;
    if (fr[2].len != 1)
        return perr(pe, DSV4_STATUS_BAD_MESSAGE, "command frame is %zu bytes, not 1", fr[2].len);
    cmd = *(const uint8_t *)fr[2].data;
    if ((d = desc_get(sub, cmd)) == NULL)
        return perr(pe, DSV4_STATUS_BAD_MESSAGE, "unknown command %d", cmd);
    pe->cmd = cmd;
    if (fr[3].len > DSV4_PROTO_MAX_BODY)
        return perr(pe, DSV4_STATUS_TOO_LARGE, "%s: body of %zu bytes over the limit", d->name,
            fr[3].len);
    if (fr[3].len == 0 || ((const uint8_t *)fr[3].data)[0] < 0x80 ||
        (((const uint8_t *)fr[3].data)[0] > 0x8f && ((const uint8_t *)fr[3].data)[0] != 0xde &&
            ((const uint8_t *)fr[3].data)[0] != 0xdf))
        return perr(pe, DSV4_STATUS_BAD_MESSAGE, "%s: body is not a msgpack map", d->name);
    if (mp_scan(fr[3].data, fr[3].len, DSV4_PROTO_MAX_DEPTH, &big, &objs) != fr[3].len)
        return perr(pe, big ? DSV4_STATUS_TOO_LARGE : DSV4_STATUS_BAD_MESSAGE,
            "%s: body is not one well-formed msgpack map (truncated, trailing bytes, "
            "too deep, or oversized array)", d->name);

    msgpack_unpacked_init(&up);
    if (msgpack_unpack_next(&up, fr[3].data, fr[3].len, &off) != MSGPACK_UNPACK_SUCCESS) {
        msgpack_unpacked_destroy(&up);
        return perr(pe, DSV4_STATUS_BAD_MESSAGE, "%s: msgpack body does not parse", d->name);
    }
    salvage_ids(&up.data, pe);

    dsv4_msg_init(m, sub, cmd);
    c.m = m;
    c.pe = pe;
    c.raw = fr + DSV4_PROTO_HDR_FRAMES;
    c.n_raw = n_frames - DSV4_PROTO_HDR_FRAMES;
    c.raw_used = 0;
    if (d->f != NULL)
        e = dec_map(&c, &up.data, d->f, d->n, &m->u);
    else
        e = up.data.type == MSGPACK_OBJECT_MAP ? DSV4_OK :
            perr(pe, DSV4_STATUS_BAD_MESSAGE, "%s: body is not a map", d->name);
    msgpack_unpacked_destroy(&up);
    if (e == DSV4_OK && c.n_raw != c.raw_used)
        e = perr(pe, n_frames > DSV4_PROTO_MAX_FRAMES ? DSV4_STATUS_TOO_LARGE :
                DSV4_STATUS_BAD_MESSAGE,
            "%s: %zu raw frames, expected %zu", d->name, c.n_raw, c.raw_used);
    if (e == DSV4_OK && d->check != NULL)
        e = d->check(m, pe);
    if (e != DSV4_OK) {
        dsv4_msg_clear(m);
        return e;
    }
    return DSV4_OK;
}

/* --- Equality --------------------------------------------------------- */

static bool
str_eq(const char *a, const char *b)
{
    if (a == NULL || b == NULL)
        return a == b;
    return strcmp(a, b) == 0;
}

static bool
fields_equal(const struct field *f, size_t nf, const void *a, const void *b)
{
    static const size_t elem[] = { [T_TOKENS] = sizeof(int32_t), [T_U64S] = sizeof(uint64_t),
        [T_LOGPROBS] = sizeof(float), [T_KVLOCS] = 0, [T_STRS] = 0 };

    for (size_t i = 0; i < nf; i++) {
        const struct field *x = &f[i];
        const void *pa, *pb;
        uint32_t n;

        switch (x->type) {
        case T_U64: case T_U32: case T_U16: case T_TOKEN: case T_BOOL: case T_F32:
            if (x->aux >= 0) {
                if (*CAT(a, x->aux, bool) != *CAT(b, x->aux, bool))
                    return false;
                if (!*CAT(a, x->aux, bool))
                    continue;
            }
            if (x->type == T_U64 ? *CAT(a, x->off, uint64_t) != *CAT(b, x->off, uint64_t) :
                                   scalar_get(x, a) != scalar_get(x, b))
                return false;
            continue;
        case T_ENUM:
            if (*CAT(a, x->off, int) != *CAT(b, x->off, int))
                return false;
            continue;
        case T_ENUMSET:
            if (*CAT(a, x->off, uint32_t) != *CAT(b, x->off, uint32_t))
                return false;
            continue;
        case T_STR:
            if (!str_eq(*CAT(a, x->off, const char *), *CAT(b, x->off, const char *)))
                return false;
            continue;
        default:
            break;
        }
        n = count_get(x, a);
        if (n != count_get(x, b))
            return false;
        if (x->type == T_KVLOCS) {
            for (uint32_t k = 0; k < n; k++) {
                const struct dsv4_kv_loc *ka = &CAT(a, x->off, struct dsv4_kv_loc)[k];
                const struct dsv4_kv_loc *kb = &CAT(b, x->off, struct dsv4_kv_loc)[k];

                if (!fields_equal(f_kvloc, sizeof(f_kvloc) / sizeof(f_kvloc[0]), ka, kb) ||
                    ka->handle_len != kb->handle_len ||
                    memcmp(ka->handle, kb->handle, ka->handle_len) != 0)
                    return false;
            }
            continue;
        }
        pa = *CAT(a, x->off, const void *);
        pb = *CAT(b, x->off, const void *);
        if ((pa == NULL) != (pb == NULL))
            return false;
        if (pa == NULL || n == 0)
            continue;
        if (x->type == T_BIN) {
            if (memcmp(pa, pb, n) != 0)
                return false;
        } else if (x->type == T_STRS) {
            for (uint32_t k = 0; k < n; k++) {
                if (!str_eq(((const char *const *)pa)[k], ((const char *const *)pb)[k]))
                    return false;
            }
        } else if (memcmp(pa, pb, (size_t)n * elem[x->type]) != 0) {
            return false;
        }
    }
    return true;
}

bool
dsv4_msg_equal(const struct dsv4_msg *a, const struct dsv4_msg *b)
{
    const struct mdesc *d;

    if (a->sub != b->sub || a->cmd != b->cmd)
        return false;
    if ((d = desc_get(a->sub, a->cmd)) == NULL)
        return false;
    return d->f == NULL || fields_equal(d->f, d->n, &a->u, &b->u);
}

/* --- Names and status codes ---------------------------------------------- */

const char *
dsv4_proto_cmd_name(enum dsv4_sub sub, int cmd)
{
    const struct mdesc *d = desc_get(sub, cmd);

    return d == NULL ? "?" : d->name;
}

const char *
dsv4_proto_sig(enum dsv4_sub sub)
{
    if ((int)sub <= DSV4_SUB_NONE || sub >= DSV4_SUB__COUNT)
        return NULL;
    return subs[sub].sig;
}

#define NAME_GET(tbl, v) \
    (((int)(v) <= 0 || (size_t)(v) >= sizeof(tbl) / sizeof(tbl[0])) ? NULL : tbl[v])

const char *
dsv4_finish_name(enum dsv4_finish f)
{
    return NAME_GET(finish_names, f);
}

const char *
dsv4_role_name(enum dsv4_role r)
{
    return NAME_GET(role_names, r);
}

const char *
dsv4_transport_name(enum dsv4_transport t)
{
    return NAME_GET(transport_names, t);
}

const char *
dsv4_req_state_name(enum dsv4_req_state s)
{
    return NAME_GET(req_state_names, s);
}

const char *
dsv4_rank_state_name(enum dsv4_rank_state s)
{
    return NAME_GET(rank_state_names, s);
}

/* The one table from internal errors to wire status codes (docs §3). */
static const uint16_t err_code[DSV4_ERR__COUNT] = {
    [DSV4_OK] = DSV4_STATUS_OK,
    [DSV4_ERR_SYS] = DSV4_STATUS_INTERNAL,
    [DSV4_ERR_NOMEM] = DSV4_STATUS_NO_MEMORY,
    [DSV4_ERR_CUDA] = DSV4_STATUS_INTERNAL,
    [DSV4_ERR_CONFIG] = DSV4_STATUS_INTERNAL,
    [DSV4_ERR_WEIGHTS] = DSV4_STATUS_INTERNAL,
    [DSV4_ERR_PROTO] = DSV4_STATUS_BAD_MESSAGE,
    [DSV4_ERR_NOTSUP] = DSV4_STATUS_NOT_SUPPORTED,
    [DSV4_ERR_BUSY] = DSV4_STATUS_BUSY,
    [DSV4_ERR_TIMEOUT] = DSV4_STATUS_TIMEOUT,
    [DSV4_ERR_CANCELED] = DSV4_STATUS_CANCELLED,
    [DSV4_ERR_INVAL] = DSV4_STATUS_BAD_ARGUMENT,
    [DSV4_ERR_TOKENIZER] = DSV4_STATUS_INTERNAL,
};

uint16_t
dsv4_proto_code_from_err(enum dsv4_err e)
{
    if ((int)e < 0 || e >= DSV4_ERR__COUNT || err_code[e] == 0)
        return DSV4_STATUS_INTERNAL;
    return err_code[e];
}

static const struct {
    uint16_t code;
    enum dsv4_err err;
    const char *str;
} codes[] = {
    { DSV4_STATUS_OK, DSV4_OK, "success" },
    { DSV4_STATUS_BUSY, DSV4_ERR_BUSY, "server busy, retry later" },
    { DSV4_STATUS_DRAINING, DSV4_ERR_BUSY, "server draining, not admitting requests" },
    { DSV4_STATUS_RESTARTING, DSV4_ERR_BUSY, "server restarting, resume the request" },
    { DSV4_STATUS_BAD_MESSAGE, DSV4_ERR_PROTO, "malformed message" },
    { DSV4_STATUS_BAD_ARGUMENT, DSV4_ERR_INVAL, "invalid argument" },
    { DSV4_STATUS_NOT_FOUND, DSV4_ERR_INVAL, "no such request or rank" },
    { DSV4_STATUS_TIMEOUT, DSV4_ERR_TIMEOUT, "timed out" },
    { DSV4_STATUS_CANCELLED, DSV4_ERR_CANCELED, "cancelled" },
    { DSV4_STATUS_TOO_LARGE, DSV4_ERR_INVAL, "size limit exceeded" },
    { DSV4_STATUS_SLOW_CONSUMER, DSV4_ERR_BUSY, "client too slow to read its output" },
    { DSV4_STATUS_INTERNAL, DSV4_ERR_SYS, "internal server error" },
    { DSV4_STATUS_NOT_SUPPORTED, DSV4_ERR_NOTSUP, "not supported" },
    { DSV4_STATUS_NO_MEMORY, DSV4_ERR_NOMEM, "server out of memory" },
    { DSV4_STATUS_UNREACHABLE, DSV4_ERR_TIMEOUT, "server unreachable" },
};

enum dsv4_err
dsv4_proto_err_from_code(uint16_t code)
{
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++) {
        if (codes[i].code == code)
            return codes[i].err;
    }
    if (code >= 200 && code < 300)
        return DSV4_OK;
    if (code >= 300 && code < 400)
        return DSV4_ERR_BUSY;
    if (code >= 400 && code < 500)
        return DSV4_ERR_INVAL;
    return DSV4_ERR_SYS;
}

const char *
dsv4_proto_code_str(uint16_t code)
{
    for (size_t i = 0; i < sizeof(codes) / sizeof(codes[0]); i++) {
        if (codes[i].code == code)
            return codes[i].str;
    }
    if (code >= 300 && code < 400)
        return "temporary failure";
    if (code >= 400 && code < 500)
        return "request error";
    if (code >= 500 && code < 600)
        return "server error";
    return "unknown status";
}
