/*
 * weights_share.h — handing the descriptor of a GPU's weights from the
 * process that holds them to another process of the same GPU (prefill@N and
 * decode@N, docs/gpu.md "Weight sharing").  No CUDA here: the descriptor is
 * any file descriptor (kernels/cuda_share.h makes and maps the CUDA one; the
 * unit tests pass a memfd).
 *
 * One unix stream socket per GPU and part of the weights,
 * <dir>/weights-<GPU>-p<part>of<parts>.sock (every rank of the GPU holding
 * that part, of whatever group: several decode groups on the same GPUs
 * share one copy too).
 * A client connects, sends one request byte ('F') and receives a struct
 * dsv4_wshare_hdr with the descriptor attached (SCM_RIGHTS); then the
 * connection closes.  Only clients of the server's effective uid are served.
 *
 * Every process holding the weights runs a server on the same path; one of
 * them owns the path (serves), the others stand by: every
 * DSV4_WSHARE_POLL_MS a standby server probes the path and takes it over
 * when nobody answers (a stale file after a kill -9, or none), and a serving
 * one that finds the path replaced or gone goes back to standby.  So the
 * weights stay reachable while any holder lives.
 *
 * Start-up (dsv4_wshare_lock): a process about to build its own copy holds
 * an exclusive flock(2) on <path>.lock until it serves, so two ranks
 * starting together do not both build one; the second waits, then maps the
 * first one's copy.  The lock dies with its process.
 */
#ifndef DSV4_COMMON_WEIGHTS_SHARE_H
#define DSV4_COMMON_WEIGHTS_SHARE_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "common/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_WSHARE_MAGIC 0x57565344u   /* "DSVW" little-endian */
#define DSV4_WSHARE_VERSION 1u
#define DSV4_WSHARE_POLL_MS 250         /* standby probe / owner check period */
#define DSV4_WSHARE_DEFAULT_DIR "/run/dsv4"

/* What travels with the descriptor (host byte order: same host).  88 bytes,
 * no padding. */
struct dsv4_wshare_hdr {
    uint32_t magic;            /* DSV4_WSHARE_MAGIC */
    uint32_t version;          /* DSV4_WSHARE_VERSION */
    uint64_t fingerprint;      /* dsv4_wshare_fingerprint of the weights */
    uint64_t alloc_bytes;      /* size of the allocation behind the fd */
    uint64_t used_bytes;       /* bytes of it the tensors use */
    uint64_t layout;           /* hash of the tensors' places (offset, bytes) */
    uint8_t device_uuid[16];   /* the GPU the allocation lives on */
    char owner[32];            /* who built it, for logs ("decode@0") */
};

/*
 * The directory of the sockets: `share_dir` when not empty, else the
 * directory of `rank_endpoint` when that is ipc://, else
 * DSV4_WSHARE_DEFAULT_DIR.  DSV4_ERR_CONFIG when it does not fit in n bytes.
 */
enum dsv4_err dsv4_wshare_dir(char *buf, size_t n, const char *share_dir,
                              const char *rank_endpoint);

/* <dir>/weights-<GPU>-<FP>-p<group_rank>of<group_size>.sock into buf, <GPU>
 * the first 8 bytes of the device's UUID in hex, <FP> the low 32 bits of the
 * weights' `fingerprint` (dsv4_wshare_fingerprint) in hex: the ranks of one
 * GPU that hold the same part of the same weights meet on one path
 * whatever their group, and ranks of another model on that GPU on another
 * path (on one they waited for each other's lock and shared with nobody).
 * DSV4_ERR_CONFIG when longer than n or than a unix socket address holds. */
enum dsv4_err dsv4_wshare_path(char *buf, size_t n, const char *dir, const uint8_t gpu_uuid[16],
                               uint64_t fingerprint, unsigned group_rank, unsigned group_size);

/* FNV-1a 64's offset basis: the h to start dsv4_wshare_hash with. */
#define DSV4_WSHARE_FNV0 0xcbf29ce484222325ull
/* FNV-1a 64 of n bytes, continuing from h. */
uint64_t dsv4_wshare_hash(uint64_t h, const void *p, size_t n);

/*
 * Fingerprint of a rank's weights: the config's shape fields (sizes,
 * compress ratios, expert counts), the source (e.g. "synthetic:SEED" or
 * "checkpoint:/path") and the part held (group_rank of group_size).  Two
 * ranks may share their weights only when their fingerprints are equal.
 */
uint64_t dsv4_wshare_fingerprint(const struct dsv4_config *cfg, const char *source,
                                 int group_rank, int group_size);

/*
 * Whether `got` (from dsv4_wshare_fetch) may be used by a process whose
 * weights have fingerprint `fingerprint` and which runs on the GPU `uuid`:
 * DSV4_OK, else DSV4_ERR_WEIGHTS saying what differs.
 */
enum dsv4_err dsv4_wshare_match(const struct dsv4_wshare_hdr *got, uint64_t fingerprint,
                                const uint8_t uuid[16]);

/*
 * Take the start-up lock of `path` (<path>.lock, created 0600), waiting at
 * most wait_ms.  DSV4_OK with *lockfd (release with dsv4_wshare_unlock);
 * DSV4_ERR_TIMEOUT when another process still holds it; DSV4_ERR_SYS.
 */
enum dsv4_err dsv4_wshare_lock(const char *path, int wait_ms, int *lockfd);
void dsv4_wshare_unlock(int lockfd);

/*
 * Ask the server of `path` for its descriptor.  A refused connection (stale
 * socket file, a standby taking over) is retried for wait_ms; no socket file
 * is an immediate answer.  DSV4_OK with *fd (close-on-exec, the caller's) and
 * *hdr; DSV4_ERR_TIMEOUT when nobody serves; DSV4_ERR_PROTO for a server of
 * another user (SO_PEERCRED) or a malformed answer (short, wrong magic or
 * version, no descriptor or more than one: every one received is closed);
 * DSV4_ERR_SYS.
 * The header is not matched: see dsv4_wshare_match.
 */
enum dsv4_err dsv4_wshare_fetch(const char *path, int wait_ms, int *fd,
                                struct dsv4_wshare_hdr *hdr);

struct dsv4_wshare_server;

/*
 * Serve `fd` with `hdr` on `path` (the directory must exist) from a thread
 * of this process, as described above: the path is claimed at once when
 * free or stale, else the server stands by.  fd is dup'd (the caller keeps
 * its own).  DSV4_ERR_SYS / DSV4_ERR_NOMEM.
 */
enum dsv4_err dsv4_wshare_serve(struct dsv4_wshare_server **out, const char *path, int fd,
                                const struct dsv4_wshare_hdr *hdr);

/* 1 while this server owns the path, 0 while it stands by. */
int dsv4_wshare_serving(struct dsv4_wshare_server *s);

/* Stop the thread, remove the path if this server owns it, close.  NULL is a
 * no-op. */
void dsv4_wshare_stop(struct dsv4_wshare_server *s);

#ifdef __cplusplus
}
#endif
#endif
