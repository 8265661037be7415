/*
 * config_file.h — /etc/dsv4/dsv4.conf, the one configuration file shared by
 * dsv4-sched, dsv4-prefill@N and dsv4-decode@N (and read by dsv4ctl and
 * dsv4-launch for the endpoints).
 *
 * Format: one `key = value` per line; `#` starts a comment (at the start of a
 * line or after whitespace); blank lines are ignored; the value is the rest
 * of the line with surrounding blanks removed, optionally in double quotes
 * (no escapes, so no value contains a double quote).  A key may carry a role prefix, `sched.`, `prefill.` or
 * `decode.`: such a line applies only to that daemon and wins over the plain
 * key whatever the line order (e.g. `decode.threads = 8`).  A rank's
 * instance prefix, `prefill@N.` or `decode@N.` (N as in the unit name
 * dsv4-prefill@N), applies to that one rank and wins over both (e.g.
 * `prefill@1.burst = yes`).  An unknown key, a malformed value or a key
 * given twice (with the same prefix) is an error naming file and line.
 * Every key has a default (struct dsv4_conf below and units/dsv4.conf
 * document them), so an empty file is valid.
 *
 * Pure functions of their arguments; no global state.
 */
#ifndef DSV4_COMMON_CONFIG_FILE_H
#define DSV4_COMMON_CONFIG_FILE_H

#include <stdio.h>

#include "common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_CONF_DEFAULT_PATH "/etc/dsv4/dsv4.conf"
#define DSV4_CONF_STR 512     /* bytes of every string value, with NUL */

/* Which daemon reads the file; selects the role-prefixed keys. */
enum dsv4_conf_role {
    DSV4_CONF_ROLE_NONE = 0,  /* tools: role-prefixed lines are checked
                                   but not applied */
    DSV4_CONF_ROLE_SCHED,
    DSV4_CONF_ROLE_PREFILL,
    DSV4_CONF_ROLE_DECODE,
};

/* The directory of the default endpoints: the units' RuntimeDirectory=,
 * made by systemd (and by dsv4-launch) when the service starts. */
#define DSV4_RUN_DIR "/run/dsv4"

/* All settings.  Defaults in brackets (dsv4_conf_defaults). */
struct dsv4_conf {
    /* --- endpoints (scheduler binds, ranks/clients connect) --- */
    char client_endpoint[DSV4_CONF_STR]; /* [ipc:///run/dsv4/client.sock] */
    char rank_endpoint[DSV4_CONF_STR];   /* [ipc:///run/dsv4/rank.sock] */
    char admin_endpoint[DSV4_CONF_STR];  /* [ipc:///run/dsv4/ctl.sock] */
    unsigned admin_mode;                   /* [0660] file mode of the admin
                                              socket; octal in the file; 0 =
                                              left as the umask made it; under
                                              socket activation the unit's
                                              SocketMode= instead */
    char key_dir[DSV4_CONF_STR];         /* [/etc/dsv4] CURVE server.key/pub */
    /* --- scheduler --- */
    int max_batch;          /* [16] decode streams per decode group at once */
    int queue_max;          /* [1024] queued requests before 300 BUSY */
    int prefill_chunk;      /* [512] prompt tokens per prefill chunk */
    int heartbeat_ms;       /* [1000] rank heartbeat interval */
    int liveness;           /* [3] missed intervals until a rank is dead */
    int request_timeout_ms; /* [0] deadline for requests that set none; 0 = none */
    int stop_timeout_ms;    /* [10000] SIGTERM: how long the scheduler finishes
                               in-flight work before it hands the rest over */
    int burst_streams;      /* [0] a burst prefill group (key `burst`) takes a
                               prompt only while at most this many streams
                               decode beside it: summed over the decode groups
                               that may share a GPU with it (queue_pick_prefill) */
    int burst_free_slots;   /* [1] a burst prefill group also takes a prompt
                               that would wait for a busy plain prefill group
                               while at least this many decode slots are free
                               beside it; 0 = never (queue_pick_prefill) */
    /* --- ranks --- */
    char checkpoint[DSV4_CONF_STR]; /* [/var/lib/dsv4/model] dsv4-mkmodel or
                                         converted checkpoint directory */
    char tokenizer[DSV4_CONF_STR];  /* [DSV4_TOKENIZER_DEFAULT] tokenizer.json
                                         (the scheduler and the gateway tokenize
                                         prompts); at the default,
                                         $DSV4_TOKENIZER when set; "none": the
                                         scheduler takes token ids only (the
                                         gateway refuses to start) */
    char backend[32];       /* [cpu] "cpu" or "cuda" */
    char numerics[32];      /* [ref] "ref" or "hf" (backend numerics mode) */
    int threads;            /* [0] backend worker threads; 0 = all cores */
    int slots;              /* [16] decode stream slots of a decode rank */
    int prefill_slots;      /* [1] concurrent prompts of a prefill rank */
    int max_seq;            /* [4096] longest sequence (prompt + output) */
    int group_size;         /* [1] ranks that run one model together (tensor-
                               parallel attention, experts split as
                               group_split says;
                               kernels/forward.h): rank N of a role is rank
                               N % group_size of group N / group_size */
    int gpu;                /* [-1] first CUDA device of the rank's group:
                               rank r of the group runs on gpu + r (usually
                               per role: prefill.gpu = 0, decode.gpu = 2 puts
                               the groups on separate GPUs); -1 = rank r on
                               device r modulo the devices present */
    char comm[16];          /* [auto] communicator of a model group: "auto"
                               (cuda backend: cudaipc when every rank of the
                               group is on this host, else nccl; cpu backend:
                               shm), "nccl", "cudaipc" (one-shot all-reduce
                               over CUDA IPC, docs/gpu.md), "shm" (cpu
                               backend only) */
    char share_weights[8];  /* [auto] one copy of the weights per GPU, shared
                               by its prefill and decode ranks (CUDA VMM,
                               docs/gpu.md "Weight sharing"): "auto" (on with
                               the cuda backend when the device can), "yes"
                               (a rank that cannot share fails), "no" */
    char share_dir[DSV4_CONF_STR]; /* [""] directory of the weight share
                               sockets; "" = that of rank_endpoint when it is
                               ipc://, else /run/dsv4 */
    /* --- several hosts (docs/operations.md "Several hosts") --- */
    char host[256];         /* [""] this host's name in READY (the scheduler
                               picks shm between ranks of one host, UCX
                               between hosts); "" = gethostname() */
    char ucx[8];            /* [auto] UCX decode-state transport: "auto" (on
                               when built in and it starts), "yes" (must
                               start), "no" */
    char ucx_tls[128];      /* [tcp] UCX_TLS of the transport ("rc_x,tcp"
                               for RDMA) */
    char ucx_devices[256];  /* [""] UCX_NET_DEVICES (e.g. "eth1"); "" = all */
    int kv_timeout_ms;      /* [5000] bound of one decode-state import; a
                               stalled one fails the handoff and the
                               scheduler re-runs the request */
    int stop_drain_s;       /* [20] ranks: on SIGTERM, ask the scheduler for
                               no new work and finish what they hold and what
                               is booked on them (streams, prompts, exports
                               not yet taken) for at most this long, then
                               stop (what is left re-runs elsewhere); the
                               gateway: its streams in flight; 0 = stop at
                               once.  Below the units' TimeoutStopSec (30) */
    char mtp[8];            /* [no] decode ranks: speculative decoding with
                               the checkpoint's MTP layer, one draft token per
                               stream and step ("yes"/"no"; kernels/forward.h
                               "Speculative decoding"); the tokens are those
                               of plain decoding */
    char warmup[8];         /* [yes] ranks outside a group: before they
                               register, run the calls they will serve (a
                               prefill rank one call of its largest size,
                               halving its rows per call until one fits; a
                               decode rank a step of `slots` streams); "no"
                               starts faster and leaves it to the first
                               requests */
    char burst[8];          /* [no] prefill ranks: "yes" marks the rank a
                               burst prefill rank (usually one instance:
                               prefill@N.burst = yes, with its own
                               prefill@N.mps_sm_percent): the scheduler gives
                               its group prompts only while the decode groups
                               are idle (burst_streams), or when no other
                               prefill group can take any (docs/operations.md
                               "Burst prefill"); decode ranks ignore it */
    int mps_sm_percent;     /* [0] with an MPS server on the GPU (docs/gpu.md
                               "Prefill beside decode"): the share of the
                               SMs this rank's kernels may use, 1-100, set
                               as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE before
                               the rank touches CUDA (usually per role:
                               prefill.mps_sm_percent); 0 = leave it */
    char cuda_kernels[8];   /* [fast] CUDA kernels of the ranks: "fast" (the
                               decode/prefill kernels of kernels/cuda_fast.h,
                               results within fp32 rounding of the exact
                               ones) or "exact" (bit-identical to the CPU
                               backend); the environment variable
                               DSV4_CUDA_KERNELS, when set, wins */
    char cuda_priority[8];  /* [decode] CUDA stream priority of the ranks:
                               "decode" (decode ranks' streams at the
                               highest priority, prefill ranks' at the
                               lowest: decode steps go first on a GPU both
                               use; under MPS prefill ranks are clients of
                               below-normal priority) or "none"; the
                               environment variables DSV4_CUDA_STREAM_PRIORITY
                               (high / low) and CUDA_MPS_CLIENT_PRIORITY,
                               when set, win */
    char group_split[8];    /* [auto] how a group of ranks splits the
                               experts and wo_b (common/weights_shard.h):
                               "ep" (whole routed experts per rank, a
                               layer's shared expert on one rank, wo_b by
                               output rows: bit-identical to one rank),
                               "tp" (every expert on every rank cut along
                               the intermediate size, wo_b by input
                               columns: partial sums, the ranks read the
                               same bytes whatever the routing) or "auto"
                               (tp with the CUDA fast kernels, else ep).
                               Prefill and decode ranks sharing weights
                               must agree */
    char kv_cudaipc[8];     /* [auto] decode state between the ranks of one
                               host through CUDA IPC handles (device memory,
                               no host copy; docs/gpu.md): "auto" (offered
                               with the cuda backend when it starts), "yes"
                               (a cuda rank that cannot fails), "no" */
    int kv_cudaipc_cache_mib; /* [4096] cudaipc: MiB of released regions a
                               prefill rank keeps for reuse, and of
                               mappings a decode rank keeps open; 0 = none
                               (DSV4_KV_CUDAIPC_CACHE_MIB wins when set) */
    /* --- HTTP gateway (dsv4-gateway, docs/gateway.md) --- */
    char gateway_listen[DSV4_CONF_STR]; /* [127.0.0.1:8000] HOST:PORT of the HTTP
                                           listener (unless socket-activated) */
    char gateway_keys[DSV4_CONF_STR];   /* [""] bearer-token file (one key a
                                           line, e.g. /etc/dsv4/gateway.keys);
                                           "" = no authentication */
    char gateway_model[128];  /* [deepseek-v4-flash] model id of /v1/models */
    int gateway_max_body;     /* [1048576] request body bytes before 413 */
    int gateway_max_conns;    /* [256] concurrent HTTP connections */
    int gateway_max_conns_per_ip; /* [0] of them from one client address; 0 = no
                                     bound (behind a proxy all share its address) */
    int gateway_idle_s;       /* [60] close a connection idle (no bytes either
                                 way) this long: slow or stalled clients */
    int gateway_timeout_ms;   /* [600000] deadline of one generation (504) */
    char gateway_launch[8];   /* [no] "yes": dsv4-launch starts dsv4-gateway */
};

/* Fill `cfg` with the defaults listed in the struct. */
void dsv4_conf_defaults(struct dsv4_conf *cfg);

/*
 * Read `path` into `cfg` (which holds defaults or earlier values; keys not in
 * the file keep them).  Lines prefixed with another role than `role` are
 * validated but skipped, and so is every instance-prefixed line (`prefill@N.`,
 * `decode@N.`; dsv4_conf_load_rank applies those).  Returns DSV4_OK;
 * DSV4_ERR_SYS when the file cannot be read; DSV4_ERR_CONFIG with
 * "path:line: reason" in dsv4_errmsg() on the first bad line (the key named
 * as the line has it, prefix included; cfg may then be partly updated), or
 * "path: is a directory ..." for a directory.
 */
enum dsv4_err dsv4_conf_load(struct dsv4_conf *cfg, const char *path,
    enum dsv4_conf_role role);

/*
 * dsv4_conf_load for rank `index` of `role` (DSV4_CONF_ROLE_PREFILL or
 * DSV4_CONF_ROLE_DECODE): lines prefixed `<role>@<index>.` apply too, after
 * the plain and the role-prefixed ones (so they win).  index < 0 applies no
 * instance line (dsv4_conf_load).  Same returns.
 */
enum dsv4_err dsv4_conf_load_rank(struct dsv4_conf *cfg, const char *path,
    enum dsv4_conf_role role, int index);

/*
 * Set one key from a string, as a file line would (no role prefix; used for
 * `-o key=value` command-line overrides).  DSV4_ERR_CONFIG for an unknown key
 * or a bad value, with the reason in dsv4_errmsg().
 */
enum dsv4_err dsv4_conf_set(struct dsv4_conf *cfg, const char *key,
    const char *value);

/* Split "key=value" (from -o) and call dsv4_conf_set. */
enum dsv4_err dsv4_conf_set_kv(struct dsv4_conf *cfg, const char *kv);

/* Write every key as a `key = value` line, in the file format (so the output
 * loads back to the same settings); for `-n` and for logs. */
void dsv4_conf_print(const struct dsv4_conf *cfg, FILE *fp);

#ifdef __cplusplus
}
#endif
#endif
