/*
 * samples.c — sample messages for the protocol tests (see samples.h).  Values
 * exercise every field type: optional fields present and absent, arrays,
 * floats, enums, bin, raw KV handle frames.
 */
#include "tests/ipc/samples.h"

#include <math.h>
#include <string.h>

static const int32_t prompt_ids[] = { 0, 1, 128000, 129279, 2147483647 };
static const int32_t stop_ids[] = { 1, 128001 };
static const char *const stops[] = { "\n\nUser:", "</s>", "\xc3\xa9t\xc3\xa9" };
static const int32_t out_ids[] = { 42, 43, 44 };
static const float out_lp[] = { -0.25f, 0.0f, -INFINITY };
static const uint64_t reqs[] = { 7, 8, 18446744073709551615ull };
/* most likely tokens: 2, 0 and 3 for three tokens */
static const uint64_t top_n[] = { 2, 0, 3 };
static const int32_t top_ids[] = { 42, 7, 44, 45, 2147483647 };
static const float top_lp[] = { -0.25f, -1.5f, -INFINITY, -INFINITY, -INFINITY };
static const uint64_t sizes[] = { 4096, 65536 };
static const uint64_t offsets[] = { 0, 4096 };
static const uint64_t sizes1[] = { 1 };
static const uint64_t offsets1[] = { 123456789012ull };
static const uint8_t handle_a[] = { 0xde, 0xad, 0xbe, 0xef, 0x00, 0x01 };
static const uint8_t handle_b[] = { 'd', 's', 'v', '4', '-', 'k', 'v' };
static const uint8_t comm_id[] = { 1, 2, 3, 4, 5, 6, 7, 8 };

static void
kv_fill(struct dsv4_kv_loc *kv, uint32_t part, uint32_t n_parts, enum dsv4_transport t)
{
    kv->part = part;
    kv->n_parts = n_parts;
    kv->transport = t;
    kv->n_tokens = 1000;
    kv->sizes = part == 0 ? sizes : sizes1;
    kv->offsets = part == 0 ? offsets : offsets1;
    kv->n_seg = part == 0 ? 2 : 1;
    kv->handle = part == 0 ? handle_a : handle_b;
    kv->handle_len = part == 0 ? sizeof(handle_a) : sizeof(handle_b);
}

static void
sampling_fill(struct dsv4_sampling *s)
{
    s->temperature = 0.75f;
    s->top_p = 0.5f;
    s->top_k = 40;
    s->seed = 12345678901234ull;
    s->has_seed = true;
    s->logprobs = true;
}

/* Each builder sets one sample; the table below names them. */
static void
s_generate_text(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_GENERATE);
    m->u.generate.id = 1;
    m->u.generate.prompt = "Hello, \xe4\xb8\x96\xe7\x95\x8c!";
}

static void
s_generate_full(struct dsv4_msg *m)
{
    struct dsv4_cli_generate *g = &m->u.generate;

    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_GENERATE);
    g->id = 18446744073709551615ull;
    g->tokens = prompt_ids;
    g->n_tokens = 5;
    sampling_fill(&g->s);
    g->max_tokens = 1048576;
    g->stop = stops;
    g->n_stop = 3;
    g->stop_ids = stop_ids;
    g->n_stop_ids = 2;
    g->stream = false;
    g->tag = "batch-7";
    g->timeout_ms = 30000;
}

/* A resume after a scheduler restart (docs/protocol.md §4.6). */
static void
s_generate_resume(struct dsv4_msg *m)
{
    struct dsv4_cli_generate *g = &m->u.generate;

    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_GENERATE);
    g->id = 7;
    g->tokens = prompt_ids;
    g->n_tokens = 5;
    g->s.seed = 98765;
    g->s.has_seed = true;
    g->max_tokens = 64;
    g->resume = stop_ids;
    g->n_resume = 2;
    g->resume_text = 11;
    g->has_resume_text = true;
}

static void
s_cli_ok(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_OK);
    m->u.ok.id = 1;
    m->u.ok.req = 1000;
    m->u.ok.tag = "batch-7";
}

static void
s_cli_ok_seed(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_OK);
    m->u.ok.id = 2;
    m->u.ok.req = 1001;
    m->u.ok.seed = 18446744073709551615ull;
    m->u.ok.has_seed = true;
}

static void
s_cli_error(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_ERROR);
    m->u.error.id = 3;
    m->u.error.req = 0;
    m->u.error.code = DSV4_STATUS_BAD_ARGUMENT;
    m->u.error.message = "temperature: 11 out of range [0, 10]";
}

static void
s_cli_tokens(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_TOKENS);
    m->u.tokens.id = 1;
    m->u.tokens.req = 1000;
    m->u.tokens.tokens = out_ids;
    m->u.tokens.logprobs = out_lp;
    m->u.tokens.n_tokens = 3;
    m->u.tokens.text = " wor";
}

/* The most likely tokens of three tokens (top_n). */
static void
top_fill(struct dsv4_top *t)
{
    t->top_n = top_n;
    t->top_ids = top_ids;
    t->top_logprobs = top_lp;
    t->n_top = 5;
}

/* With the most likely tokens (GENERATE top_logprobs 3). */
static void
s_cli_tokens_top(struct dsv4_msg *m)
{
    s_cli_tokens(m);
    top_fill(&m->u.tokens.top);
}

/* GENERATE asking for the most likely tokens. */
static void
s_generate_top(struct dsv4_msg *m)
{
    s_generate_text(m);
    m->u.generate.s.logprobs = true;
    m->u.generate.s.top_logprobs = DSV4_PROTO_MAX_TOP_LOGPROBS;
}

static void
s_cli_tokens_nolp(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_TOKENS);
    m->u.tokens.id = 2;
    m->u.tokens.req = 1001;
    m->u.tokens.tokens = out_ids;
    m->u.tokens.n_tokens = 1;
    m->u.tokens.text = "";
}

static void
s_cli_done(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_DONE);
    m->u.done.id = 1;
    m->u.done.req = 1000;
    m->u.done.finish = DSV4_FINISH_LENGTH;
    m->u.done.prompt_tokens = 5;
    m->u.done.completion_tokens = 256;
    m->u.done.tag = "batch-7";
}

static void
s_cli_cancel(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_CANCEL);
    m->u.cancel.id = 1;
}

static void
s_cli_heartbeat(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CLI, DSV4_CLI_HEARTBEAT);
}

static void
s_ready(struct dsv4_msg *m)
{
    struct dsv4_rank_ready *r = &m->u.ready;

    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_READY);
    r->role = DSV4_ROLE_DECODE;
    r->index = 3;
    r->group = 1;
    r->group_rank = 1;
    r->group_size = 2;
    r->capacity = 16;
    r->max_ctx = 1048576;
    r->host = "gpu-node-1";
    r->pid = 4242;
    r->transports = (1u << DSV4_TRANSPORT_SHM) | (1u << DSV4_TRANSPORT_CUDAIPC);
}

/* READY from a burst prefill rank on a GPU whose warm-up lowered its rows
 * per call (the optional keys added after version 1.0). */
static void
s_ready_prefill(struct dsv4_msg *m)
{
    struct dsv4_rank_ready *r = &m->u.ready;

    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_READY);
    r->role = DSV4_ROLE_PREFILL;
    r->index = 1;
    r->group = 1;
    r->group_rank = 0;
    r->group_size = 1;
    r->capacity = 4;
    r->max_ctx = 65536;
    r->host = "gpu-node-1";
    r->pid = 4243;
    r->transports = 1u << DSV4_TRANSPORT_CUDAIPC;
    r->burst = true;
    r->device = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0";
    r->model = "9f3c2a1b5d7e8f60";
    r->abi = DSV4_RANK_ABI;
    r->has_abi = true;
    r->call_rows = 512;
    r->call_rows_full = 2048;
    r->has_call_rows = true;
}

static void
s_welcome(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_WELCOME);
    m->u.welcome.heartbeat_ms = 1000;
    m->u.welcome.liveness = 3;
    m->u.welcome.comm_epoch = 2;
    m->u.welcome.comm_id = comm_id;
    m->u.welcome.comm_id_len = sizeof(comm_id);
}

static void
s_rank_comm(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_COMM);
    m->u.comm.comm_epoch = 5;
    m->u.comm.comm_id = comm_id;
    m->u.comm.comm_id_len = sizeof(comm_id);
}

static void
s_rank_comm_ask(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_COMM);
    m->u.comm.comm_epoch = 6;
    m->u.comm.one_host = true;
}

static void
s_rank_heartbeat(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
    m->u.heartbeat.active = 12;
}

/* A decode rank with mtp = yes: the optional MTP counters. */
static void
s_rank_heartbeat_mtp(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
    m->u.heartbeat.active = 3;
    m->u.heartbeat.mtp_drafts = 5000000000ull;
    m->u.heartbeat.mtp_accepted = 1234567;
    m->u.heartbeat.has_mtp = true;
}

/* A rank of a group: the epoch of its communicator. */
static void
s_rank_heartbeat_comm(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
    m->u.heartbeat.active = 2;
    m->u.heartbeat.comm_epoch = 7;
    m->u.heartbeat.has_comm_epoch = true;
}

/* A decode rank some of whose batch sizes run without a CUDA graph. */
static void
s_rank_heartbeat_graphs(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
    m->u.heartbeat.active = 16;
    m->u.heartbeat.graphs_refused = 3;
    m->u.heartbeat.has_graphs_refused = true;
}

static void
s_group_broken(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_GROUP_BROKEN);
    m->u.broken.group = 3;
    m->u.broken.group_rank = 1;
    m->u.broken.comm_epoch = 70000;
    m->u.broken.reason = "collective timed out";
}

/* Without the optional reason. */
static void
s_group_broken_bare(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_GROUP_BROKEN);
    m->u.broken.group = 0;
    m->u.broken.group_rank = 0;
    m->u.broken.comm_epoch = 1;
}

static void
s_disconnect(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_DISCONNECT);
    m->u.disconnect.reason = "unexpected PREFILL_DONE";
}

static void
s_prefill(struct dsv4_msg *m)
{
    struct dsv4_rank_prefill *p = &m->u.prefill;

    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_PREFILL);
    p->req = 1000;
    p->tokens = prompt_ids;
    p->n_tokens = 5;
    sampling_fill(&p->s);
    p->step = 2;
    p->dst_group = 1;
    p->transport = DSV4_TRANSPORT_CUDAIPC;
}

static void
s_prefill_done(struct dsv4_msg *m)
{
    struct dsv4_rank_prefill_done *p = &m->u.prefill_done;

    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_PREFILL_DONE);
    p->req = 1000;
    p->token = 128000;
    p->logprob = -1.5f;
    p->has_logprob = true;
    kv_fill(&p->kv[0], 0, 2, DSV4_TRANSPORT_CUDAIPC);
    p->n_kv = 1;
}

static void
s_prefill_done_top(struct dsv4_msg *m)
{
    s_prefill_done(m);
    m->u.prefill_done.top_ids = top_ids;
    m->u.prefill_done.top_logprobs = top_lp;
    m->u.prefill_done.n_top = 2;
}

static void
s_decode(struct dsv4_msg *m)
{
    struct dsv4_rank_decode *d = &m->u.decode;

    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_DECODE);
    d->req = 1000;
    d->slot = 15;
    d->token = 128000;
    d->pos = 5;
    d->max_tokens = 255;
    sampling_fill(&d->s);
    d->s.has_seed = false;
    d->s.seed = 0;
    d->stop_ids = stop_ids;
    d->n_stop_ids = 2;
    kv_fill(&d->kv[0], 0, 2, DSV4_TRANSPORT_CUDAIPC);
    kv_fill(&d->kv[1], 1, 2, DSV4_TRANSPORT_SHM);
    d->n_kv = 2;
}

static void
s_kv_release(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_KV_RELEASE);
    m->u.ref.req = 1000;
}

static void
s_rank_tokens(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_TOKENS);
    m->u.step.step = 99;
    m->u.step.reqs = reqs;
    m->u.step.tokens = out_ids;
    m->u.step.logprobs = out_lp;
    m->u.step.n = 3;
}

static void
s_rank_tokens_top(struct dsv4_msg *m)
{
    s_rank_tokens(m);
    top_fill(&m->u.step.top);
}

static void
s_decode_done(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_DECODE_DONE);
    m->u.decode_done.req = 1000;
    m->u.decode_done.finish = DSV4_FINISH_STOP;
    m->u.decode_done.n_tokens = 17;
}

static void
s_abort(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_ABORT);
    m->u.ref.req = 1000;
}

static void
s_abort_done(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_ABORT_DONE);
    m->u.ref.req = 1000;
}

static void
s_drain(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_DRAIN);
}

static void
s_drain_done(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_DRAIN_DONE);
}

static void
s_rank_error(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_RANK, DSV4_RANK_ERROR);
    m->u.error.req = 1000;
    m->u.error.code = DSV4_STATUS_NO_MEMORY;
    m->u.error.message = "kv_pool_alloc_pages: pool exhausted need=32 free=7";
}

static void
s_show_status(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_SHOW_STATUS);
}

static void
s_status(struct dsv4_msg *m)
{
    struct dsv4_ctl_status *s = &m->u.status;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_STATUS);
    s->version = "0.1.0";
    s->uptime_ms = 86400123;
    s->draining = true;
    s->n_ranks = 4;
    s->n_ranks_ready = 3;
    s->n_queued = 10;
    s->n_running = 16;
    s->n_done = 5000000000ull;
    s->n_failed = 2;
}

static void
s_show_ranks(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_SHOW_RANKS);
}

static void
s_ctl_rank(struct dsv4_msg *m)
{
    struct dsv4_ctl_rank *r = &m->u.rank;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_RANK);
    r->role = DSV4_ROLE_PREFILL;
    r->index = 0;
    r->group = 0;
    r->group_rank = 0;
    r->host = "localhost";
    r->state = DSV4_RANK_STATE_DRAINING;
    r->active = 1;
    r->capacity = 4;
    r->last_seen_ms = 250;
}

/* A decode rank with MTP counters and its own `active`. */
static void
s_ctl_rank_mtp(struct dsv4_msg *m)
{
    struct dsv4_ctl_rank *r = &m->u.rank;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_RANK);
    r->role = DSV4_ROLE_DECODE;
    r->index = 1;
    r->group = 1;
    r->group_rank = 0;
    r->host = "gpu7";
    r->state = DSV4_RANK_STATE_READY;
    r->active = 2;
    r->capacity = 64;
    r->last_seen_ms = 12;
    r->rank_active = 2;
    r->has_rank_active = true;
    r->mtp_drafts = 900;
    r->mtp_accepted = 0;
    r->has_mtp = true;
}

/* RANK of a decode rank that reported batch sizes without a CUDA graph. */
static void
s_ctl_rank_graphs(struct dsv4_msg *m)
{
    struct dsv4_ctl_rank *r = &m->u.rank;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_RANK);
    r->role = DSV4_ROLE_DECODE;
    r->index = 0;
    r->group = 0;
    r->group_rank = 0;
    r->host = "gpu0";
    r->state = DSV4_RANK_STATE_READY;
    r->active = 16;
    r->capacity = 16;
    r->last_seen_ms = 3;
    r->rank_active = 16;
    r->has_rank_active = true;
    r->placed = 300;
    r->graphs_refused = 8;
    r->has_graphs_refused = true;
}

/* RANK of a burst prefill rank with its device and lowered rows per call. */
static void
s_ctl_rank_prefill(struct dsv4_msg *m)
{
    struct dsv4_ctl_rank *r = &m->u.rank;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_RANK);
    r->role = DSV4_ROLE_PREFILL;
    r->index = 1;
    r->group = 1;
    r->group_rank = 0;
    r->host = "gpu7";
    r->state = DSV4_RANK_STATE_READY;
    r->active = 1;
    r->capacity = 4;
    r->last_seen_ms = 40;
    r->burst = true;
    r->placed = 77;
    r->device = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0";
    r->call_rows = 512;
    r->call_rows_full = 2048;
    r->has_call_rows = true;
}

/* RANK of a decode rank that said its model fingerprint. */
static void
s_ctl_rank_model(struct dsv4_msg *m)
{
    struct dsv4_ctl_rank *r = &m->u.rank;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_RANK);
    r->role = DSV4_ROLE_DECODE;
    r->index = 2;
    r->group = 2;
    r->group_rank = 0;
    r->host = "gpu1";
    r->state = DSV4_RANK_STATE_READY;
    r->active = 0;
    r->capacity = 16;
    r->last_seen_ms = 100;
    r->model = "dca417a6eb4d374e";
}

/* STATUS of a scheduler with its reference model. */
static void
s_status_model(struct dsv4_msg *m)
{
    struct dsv4_ctl_status *s = &m->u.status;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_STATUS);
    s->version = "0.1.0";
    s->uptime_ms = 500;
    s->n_ranks = 2;
    s->n_ranks_ready = 1;
    s->model = "0123456789abcdef";
}

/* STATUS with the MTP totals only (no metrics, no histogram). */
static void
s_status_mtp(struct dsv4_msg *m)
{
    struct dsv4_ctl_status *s = &m->u.status;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_STATUS);
    s->version = "0.1.0";
    s->uptime_ms = 1000;
    s->n_ranks = 2;
    s->n_ranks_ready = 2;
    s->n_done = 16;
    s->mtp_drafts = 4096;
    s->mtp_accepted = 1025;
    s->has_mtp = true;
}

static void
s_ranks_end(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_RANKS_END);
    m->u.count.count = 1;
}

static void
s_show_requests(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_SHOW_REQUESTS);
}

static void
s_ctl_request(struct dsv4_msg *m)
{
    struct dsv4_ctl_request *r = &m->u.request;

    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_REQUEST);
    r->req = 1000;
    r->state = DSV4_REQ_HANDOFF;
    r->tag = "batch-7";
    r->prompt_tokens = 5;
    r->completion_tokens = 1;
    r->age_ms = 1234;
    r->prefill_group = 2;
    r->has_prefill_group = true;
    r->decode_group = 1;
    r->has_decode_group = true;
    r->reruns = 3;
}

static void
s_requests_end(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_REQUESTS_END);
    m->u.count.count = 0;
}

static void
s_ctl_drain(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_DRAIN);
    m->u.drain.target = "decode@3";
    m->u.drain.timeout_ms = 60000;
}

static void
s_undrain(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_UNDRAIN);
    m->u.drain.target = "all";
}

static void
s_result(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_RESULT);
    m->u.error.code = DSV4_STATUS_OK;
    m->u.error.message = "drained";
}

static void
s_ctl_cancel(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_CANCEL);
    m->u.ref.req = 0x1234567890ull;
}

static void
s_ctl_reload(struct dsv4_msg *m)
{
    dsv4_msg_init(m, DSV4_SUB_CTL, DSV4_CTL_RELOAD);
}

static const struct {
    const char *name;
    void (*fill)(struct dsv4_msg *m);
} table[] = {
    { "cli_generate_text", s_generate_text },
    { "cli_generate_full", s_generate_full },
    { "cli_generate_resume", s_generate_resume },
    { "cli_ok", s_cli_ok },
    { "cli_ok_seed", s_cli_ok_seed },
    { "cli_error", s_cli_error },
    { "cli_tokens", s_cli_tokens },
    { "cli_tokens_nolp", s_cli_tokens_nolp },
    { "cli_tokens_top", s_cli_tokens_top },
    { "cli_generate_top", s_generate_top },
    { "cli_done", s_cli_done },
    { "cli_cancel", s_cli_cancel },
    { "cli_heartbeat", s_cli_heartbeat },
    { "rank_ready", s_ready },
    { "rank_ready_prefill", s_ready_prefill },
    { "rank_welcome", s_welcome },
    { "rank_heartbeat", s_rank_heartbeat },
    { "rank_heartbeat_mtp", s_rank_heartbeat_mtp },
    { "rank_disconnect", s_disconnect },
    { "rank_prefill", s_prefill },
    { "rank_prefill_done", s_prefill_done },
    { "rank_prefill_done_top", s_prefill_done_top },
    { "rank_decode", s_decode },
    { "rank_kv_release", s_kv_release },
    { "rank_tokens", s_rank_tokens },
    { "rank_tokens_top", s_rank_tokens_top },
    { "rank_decode_done", s_decode_done },
    { "rank_abort", s_abort },
    { "rank_abort_done", s_abort_done },
    { "rank_drain", s_drain },
    { "rank_drain_done", s_drain_done },
    { "rank_error", s_rank_error },
    { "rank_comm", s_rank_comm },
    { "rank_comm_ask", s_rank_comm_ask },
    { "rank_heartbeat_comm", s_rank_heartbeat_comm },
    { "rank_heartbeat_graphs", s_rank_heartbeat_graphs },
    { "rank_group_broken", s_group_broken },
    { "rank_group_broken_bare", s_group_broken_bare },
    { "ctl_show_status", s_show_status },
    { "ctl_status", s_status },
    { "ctl_status_mtp", s_status_mtp },
    { "ctl_status_model", s_status_model },
    { "ctl_show_ranks", s_show_ranks },
    { "ctl_rank", s_ctl_rank },
    { "ctl_rank_mtp", s_ctl_rank_mtp },
    { "ctl_rank_prefill", s_ctl_rank_prefill },
    { "ctl_rank_model", s_ctl_rank_model },
    { "ctl_rank_graphs", s_ctl_rank_graphs },
    { "ctl_ranks_end", s_ranks_end },
    { "ctl_show_requests", s_show_requests },
    { "ctl_request", s_ctl_request },
    { "ctl_requests_end", s_requests_end },
    { "ctl_drain", s_ctl_drain },
    { "ctl_undrain", s_undrain },
    { "ctl_result", s_result },
    { "ctl_cancel", s_ctl_cancel },
    { "ctl_reload", s_ctl_reload },
};

size_t
samples_count(void)
{
    return sizeof(table) / sizeof(table[0]);
}

const char *
samples_get(size_t i, struct dsv4_msg *m)
{
    table[i].fill(m);
    return table[i].name;
}
