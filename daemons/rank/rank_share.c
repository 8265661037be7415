/*
 * rank_share.c — one copy of the weights per GPU, shared by the prefill and
 * decode ranks of a GPU slot (rank.h "rank_share.c"; docs/gpu.md "Weight
 * sharing").  Built only with CUDA.
 *
 * Start-up of a sharing rank:
 *   1. take the slot's start-up lock (a peer building its copy holds it; we
 *      wait, telling systemd to extend the start timeout);
 *   2. ask the socket for a copy: one whose header matches our fingerprint
 *      and device is mapped (IMPORT); none: we build one (SHAREABLE), still
 *      holding the lock; a mismatched one: warn and build a private copy;
 *   3. once the weights are on the device, serve their descriptor on the
 *      socket (standing by when the peer serves already) and drop the lock.
 * Both ranks serve, so a restarted rank maps the survivor's copy.
 */
#include "rank.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/sdnotify.h"
#include "common/weights_share.h"
#include "kernels/cuda_share.h"

#define SHARE_LOCK_SLICE_MS 5000   /* lock wait between systemd timeout extensions */
#define SHARE_FETCH_MS 1000        /* retry refused connections (a standby taking
                                      over; > DSV4_WSHARE_POLL_MS) */

struct rank_share {
    char path[128];
    int lockfd;                        /* start-up lock, -1 once released */
    int fd;                            /* received descriptor (IMPORT), else -1 */
    uint64_t fingerprint;
    uint8_t uuid[16];
    char from[sizeof(((struct dsv4_wshare_hdr *)0)->owner)]; /* "" = built here */
    struct dsv4_wshare_server *server;
};

/* Whether this rank shares at all; fatal for share_weights = yes when it
 * cannot. */
static bool
share_wanted(struct rank *k, const char *dir)
{
    bool yes = strcmp(k->o.conf.share_weights, "yes") == 0;
    const char *why = NULL;

    if (strcmp(k->o.conf.share_weights, "no") == 0)
        return false;
    if (strcmp(k->be->name, "cuda") != 0)
        why = "not the cuda backend";
    else if (!dsv4_cuda_share_supported(k->be))
        why = dsv4_errmsg();
    else if (access(dir, W_OK | X_OK) != 0)
        why = "the share directory is not writable";
    if (why == NULL)
        return true;
    if (yes)   /* exit 6: a restart would meet the same */
        fatalx_conf("rank_init: share_weights = yes: %s (%s)", why, dir);
    log_info("rank_init: weights not shared: %s", why);
    return false;
}

void
rank_share_begin(struct rank *k, const struct dsv4_config *cfg, const char *source,
                 struct dsv4_cuda_arena *a)
{
    struct rank_share *s;
    struct dsv4_wshare_hdr hdr;
    char dir[DSV4_CONF_STR];
    enum dsv4_err e;
    int fd, waited = 0;

    memset(a, 0, sizeof(*a));
    a->kind = DSV4_CUDA_ARENA_PRIVATE;
    a->fd = -1;
    if (dsv4_wshare_dir(dir, sizeof(dir), k->o.conf.share_dir, k->o.conf.rank_endpoint) !=
        DSV4_OK)
        fatalx("rank_init: %s", dsv4_errmsg());
    if (!share_wanted(k, dir))
        return;
    s = calloc(1, sizeof(*s));
    if (s == NULL)
        fatalx("rank_init: out of memory");
    s->lockfd = s->fd = -1;
    if (dsv4_cuda_device_uuid(k->be, s->uuid) != DSV4_OK)
        fatalx("rank_init: weights share: %s", dsv4_errmsg());
    s->fingerprint = dsv4_wshare_fingerprint(cfg, source, (int)k->o.group_rank,
                                             (int)k->o.group_size);
    if (dsv4_wshare_path(s->path, sizeof(s->path), dir, s->uuid, s->fingerprint,
                         k->o.group_rank, k->o.group_size) != DSV4_OK) {
        /* a share directory too long for a socket path: the configuration's
         * fault under yes (exit 6, not restarted), one copy under auto */
        if (strcmp(k->o.conf.share_weights, "yes") == 0)
            fatalx_conf("rank_init: share_weights = yes: %s", dsv4_errmsg());
        log_warnx("rank_init: weights not shared: %s (set share_dir to a shorter directory)",
                  dsv4_errmsg());
        free(s);
        return;
    }
    k->share = s;

    /* 1. the start-up lock: a peer building its copy holds it */
    while ((e = dsv4_wshare_lock(s->path, SHARE_LOCK_SLICE_MS, &s->lockfd)) == DSV4_ERR_TIMEOUT) {
        rank_exit_if_stopped(k, "waiting for the weights lock");
        waited += SHARE_LOCK_SLICE_MS / 1000;
        sdnotify_status("waiting for the other rank of this GPU to build the weights (%d s)",
                        waited);
        sdnotify_extend_timeout(2ull * SHARE_LOCK_SLICE_MS * 1000);
        if (waited % 60 == 0)
            log_info("rank_init: still waiting for the weights lock %s.lock (%d s)", s->path,
                     waited);
    }
    if (e != DSV4_OK) {
        /* the lock file cannot be opened or locked (a directory in its
         * place, another user's file): fatal only under yes (exit 6 when
         * it is the configuration's, a name too long); under auto this
         * rank keeps its own copy, as for the other share faults above */
        if (strcmp(k->o.conf.share_weights, "yes") == 0) {
            if (e == DSV4_ERR_CONFIG)
                fatalx_conf("rank_init: share_weights = yes: %s", dsv4_errmsg());
            fatalx("rank_init: share_weights = yes: %s", dsv4_errmsg());
        }
        log_warnx("rank_init: weights not shared: %s; this rank keeps its own copy",
                  dsv4_errmsg());
        rank_share_free(k);
        return;
    }

    /* 2. a peer's copy? */
    e = dsv4_wshare_fetch(s->path, SHARE_FETCH_MS, &fd, &hdr);
    if (e == DSV4_OK && dsv4_wshare_match(&hdr, s->fingerprint, s->uuid) == DSV4_OK) {
        s->fd = fd;
        snprintf(s->from, sizeof(s->from), "%s", hdr.owner);
        a->kind = DSV4_CUDA_ARENA_IMPORT;
        a->fd = fd;
        a->alloc_bytes = hdr.alloc_bytes;
        a->used_bytes = hdr.used_bytes;
        a->layout = hdr.layout;
        sdnotify_status("weights: mapping %s's copy", s->from);
        return;
    }
    if (e == DSV4_OK) {
        /* other weights (config, source, part or GPU differ): ours alone */
        log_warnx("rank_init: %s; this rank keeps its own copy", dsv4_errmsg());
        close(fd);
        rank_share_free(k);
        return;
    }
    if (e != DSV4_ERR_TIMEOUT)
        log_warnx("rank_init: %s; building the weights here", dsv4_errmsg());
    a->kind = DSV4_CUDA_ARENA_SHAREABLE;
}

void
rank_share_fallback(struct rank *k, struct dsv4_cuda_arena *a)
{
    struct rank_share *s = k->share;

    log_warnx("rank_init: mapping %s's weights failed: %s; building them here",
              s != NULL ? s->from : "?", dsv4_errmsg());
    if (s != NULL) {
        if (s->fd >= 0)
            close(s->fd);
        s->fd = -1;
        s->from[0] = '\0';
    }
    memset(a, 0, sizeof(*a));
    a->fd = -1;
    a->kind = s != NULL ? DSV4_CUDA_ARENA_SHAREABLE : DSV4_CUDA_ARENA_PRIVATE;
}

void
rank_share_done(struct rank *k, const struct dsv4_cuda_arena *a)
{
    struct rank_share *s = k->share;
    struct dsv4_wshare_hdr hdr;
    double gib = 1024.0 * 1024.0 * 1024.0;
    int fd;

    if (s == NULL || a->kind == DSV4_CUDA_ARENA_PRIVATE) {
        log_info("rank_init: weights: %s (not shared)", k->o.synthetic ? "generated" :
                                                                         "uploaded");
        return;
    }
    memset(&hdr, 0, sizeof(hdr));
    fd = dsv4_cuda_weights_share_fd(&k->wdev, &hdr.alloc_bytes, &hdr.used_bytes, &hdr.layout);
    if (fd < 0)
        fatalx("rank_init: weights share: the weights have no shareable descriptor");
    hdr.fingerprint = s->fingerprint;
    memcpy(hdr.device_uuid, s->uuid, sizeof(hdr.device_uuid));
    /* the copy keeps its builder's name, whoever serves it */
    snprintf(hdr.owner, sizeof(hdr.owner), "%s", s->from[0] != '\0' ? s->from : k->name);
    if (dsv4_wshare_serve(&s->server, s->path, fd, &hdr) != DSV4_OK)
        log_warnx("rank_init: %s; the weights are not offered to the other rank",
                  dsv4_errmsg());
    dsv4_wshare_unlock(s->lockfd);
    s->lockfd = -1;
    if (a->kind == DSV4_CUDA_ARENA_IMPORT) {
        log_notice("rank_init: weights: mapped from %s's copy (%.2f GiB, %s)", s->from,
                   hdr.used_bytes / gib, s->path);
        sdnotify_status("weights: mapped from %s's copy", s->from);
    } else {
        log_notice("rank_init: weights: %s, shared on %s (%.2f GiB)",
                   k->o.synthetic ? "generated" : "uploaded", s->path, hdr.used_bytes / gib);
        sdnotify_status("weights: %s, shared", k->o.synthetic ? "generated" : "uploaded");
    }
}

void
rank_share_free(struct rank *k)
{
    struct rank_share *s = k->share;

    if (s == NULL)
        return;
    dsv4_wshare_stop(s->server);
    dsv4_wshare_unlock(s->lockfd);
    if (s->fd >= 0)
        close(s->fd);
    free(s);
    k->share = NULL;
}
