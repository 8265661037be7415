/*
 * rank_kv.c — the rank's side of the decode-state handoff: the transfer
 * regions a prefill rank exported and still owns (released on KV_RELEASE,
 * when the transport may recycle them: cudaipc keeps the region for the
 * next export; freed on ABORT, link loss or timeout), and the import of a
 * location into a decode slot.  Transport details live behind ipc/kvxfer.h.  A rank opens shm (one
 * host) and, unless `ucx = no`, ucx (across hosts); with the cuda backend
 * and `kv_cudaipc` auto or yes, also cudaipc (one host, device memory: the
 * state is exported and imported with the model's _dev state functions and
 * never visits the host).  The scheduler names the transport in PREFILL and
 * the location carries it to the decode rank.  Imports are asynchronous and
 * bounded by kv_timeout_ms.
 *
 * Rank main thread only.
 */
#include "rank.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

/* Open the cudaipc transport when the config and the backend allow it
 * (kv_cudaipc: no / auto / yes); -1 only when `yes` cannot be met. */
static int
kv_open_cudaipc(struct rank *k, const char *owner, const struct dsv4_kvx_opts *o)
{
    bool yes = strcmp(k->o.conf.kv_cudaipc, "yes") == 0;
    const char *why;

    if (strcmp(k->o.conf.kv_cudaipc, "no") == 0)
        return 0;
    if (strcmp(k->be->name, "cuda") != 0) {
        why = "not the cuda backend";
    } else {
#ifdef DSV4_HAVE_CUDA
        /* the backend made its device current on this thread; the transport
         * keeps using it */
        if (dsv4_kvx_open_ops(&k->kvx[DSV4_TRANSPORT_CUDAIPC], &dsv4_kvx_cudaipc_ops,
                              DSV4_TRANSPORT_CUDAIPC, owner, o) == DSV4_OK) {
            k->transports |= 1u << DSV4_TRANSPORT_CUDAIPC;
            return 0;
        }
        why = dsv4_errmsg();
#else
        (void)owner;
        (void)o;
        why = "built without CUDA";
#endif
    }
    if (yes) {
        log_warnx("kv_open: kv_cudaipc = yes: %s", why);
        return -1;
    }
    log_notice("kv_open: no cudaipc transport: %s", why);
    return 0;
}

int
kv_open(struct rank *k)
{
    char owner[DSV4_KVX_MAX_OWNER];
    struct dsv4_kvx_opts o;
    int n;

    /* The owner tag names this rank's shm regions and what a restart cleans
     * up.  It carries a hash of the scheduler's rank endpoint so that two
     * deployments on one host (two schedulers) never touch each other's
     * regions: "<hash>-prefill-0". */
    uint32_t h = 2166136261u;
    for (const char *c = k->o.conf.rank_endpoint; *c != '\0'; c++)
        h = (h ^ (uint8_t)*c) * 16777619u;
    snprintf(owner, sizeof(owner), "%08x-%s-%u", (unsigned)h, dsv4_role_name(k->o.role),
             (unsigned)k->o.index);
    memset(&o, 0, sizeof(o));
    o.timeout_ms = k->o.conf.kv_timeout_ms;
    o.ucx_tls = k->o.conf.ucx_tls;
    o.ucx_devices = k->o.conf.ucx_devices;
    o.cache_bytes = k->o.conf.kv_cudaipc_cache_mib > 0 ?
                        (int64_t)k->o.conf.kv_cudaipc_cache_mib << 20 : -1;
    TAILQ_INIT(&k->exports);
    if (dsv4_kvx_open_opts(&k->kvx[DSV4_TRANSPORT_SHM], DSV4_TRANSPORT_SHM, owner, &o) !=
        DSV4_OK) {
        log_warnx("kv_open: %s", dsv4_errmsg());
        return -1;
    }
    k->transports = 1u << DSV4_TRANSPORT_SHM;
    n = dsv4_kvx_cleanup_stale(k->kvx[DSV4_TRANSPORT_SHM]);
    if (n > 0)
        log_notice("kv_open: removed %d stale exports of %s", n, owner);
    if (strcmp(k->o.conf.ucx, "no") != 0) {
        if (dsv4_kvx_open_opts(&k->kvx[DSV4_TRANSPORT_UCX], DSV4_TRANSPORT_UCX, owner, &o) ==
            DSV4_OK) {
            k->transports |= 1u << DSV4_TRANSPORT_UCX;
        } else if (strcmp(k->o.conf.ucx, "yes") == 0) {
            log_warnx("kv_open: ucx = yes: %s", dsv4_errmsg());
            return -1;
        } else {
            log_notice("kv_open: no ucx transport (one host only): %s", dsv4_errmsg());
        }
    }
    if (kv_open_cudaipc(k, owner, &o) != 0)
        return -1;
    log_info("kv_open: %s: transports%s%s%s, import bound %d ms", owner,
             k->kvx[DSV4_TRANSPORT_SHM] != NULL ? " shm" : "",
             k->kvx[DSV4_TRANSPORT_CUDAIPC] != NULL ? " cudaipc" : "",
             k->kvx[DSV4_TRANSPORT_UCX] != NULL ? " ucx" : "", k->o.conf.kv_timeout_ms);
    return 0;
}

void
kv_close(struct rank *k)
{
    kv_release_all(k);
    for (int t = 0; t < DSV4_TRANSPORT__COUNT; t++) {
        dsv4_kvx_close(k->kvx[t]);
        k->kvx[t] = NULL;
    }
    k->transports = 0;
}

/* A region of transport x for `req` holding slot `slot`'s state of `need`
 * bytes (*len written), in device memory where x's regions are (cudaipc:
 * device-to-device copies); on failure the region is freed. */
static enum dsv4_err
kv_fill(struct rank *k, struct dsv4_kvx *x, uint64_t req, int slot, size_t need,
    struct dsv4_kvx_region *r, size_t *len)
{
    enum dsv4_err e = rank_test_nomem(&k->test_export_nomem, RANK_TEST_EXPORT_NOMEM, DSV4_OK);

    k->kv_shm_full = false;
    if (e != DSV4_OK)
        return e;
    if ((e = dsv4_kvx_export(x, req, need, r)) != DSV4_OK) {
        k->kv_shm_full = e == DSV4_ERR_NOMEM && x->transport == DSV4_TRANSPORT_SHM;
        return e;
    }
    e = x->device_memory ? dsv4_model_state_export_dev(k->m, slot, r->data, need, len)
                         : dsv4_model_state_export(k->m, slot, r->data, need, len);
    if (e != DSV4_OK)
        dsv4_kvx_free(x, r);
    return e;
}

enum dsv4_err
kv_export(struct rank *k, enum dsv4_transport t, uint64_t req, int slot, uint32_t n_tokens,
    uint64_t seg[2], struct dsv4_kv_loc *loc)
{
    struct rank_export *x;
    size_t need, len = 0;
    enum dsv4_err e;

    if (t <= DSV4_TRANSPORT_NONE || t >= DSV4_TRANSPORT__COUNT || k->kvx[t] == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "kv_export: transport %s not open",
                            dsv4_transport_name(t) != NULL ? dsv4_transport_name(t) : "?");
    need = dsv4_model_state_size(k->m, (int)n_tokens);
    x = calloc(1, sizeof(*x));
    if (x == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "kv_export: out of memory");
    x->x = k->kvx[t];
    e = kv_fill(k, x->x, req, slot, need, &x->r, &len);
    if (e != DSV4_OK) {
        log_warnx("kv_export: req=%" PRIu64 " bytes=%zu: %s", req, need, dsv4_errmsg());
        free(x);
        return e;
    }
    x->t_ms = dsv4_now_ms();
    TAILQ_INSERT_TAIL(&k->exports, x, entry);
    k->n_exports++;
    dsv4_kvx_desc_to_loc(&x->r, len, n_tokens, seg, loc);
    log_debug("kv_export: req=%" PRIu64 " n_tokens=%u bytes=%zu via %s", req, n_tokens, len,
              dsv4_transport_name(t));
    return DSV4_OK;
}

enum dsv4_err
kv_warmup_export(struct rank *k, int slot, int n_tokens, int region_tokens, size_t *bytes,
                 const char **via)
{
    enum dsv4_transport t = k->kvx[DSV4_TRANSPORT_CUDAIPC] != NULL ? DSV4_TRANSPORT_CUDAIPC :
                                                                      DSV4_TRANSPORT_SHM;
    struct dsv4_kvx *x = k->kvx[t];
    struct dsv4_kvx_region r;
    size_t need = dsv4_model_state_size(k->m, region_tokens > n_tokens ? region_tokens :
                                                                         n_tokens), len = 0;
    enum dsv4_err e;

    *bytes = need;
    *via = dsv4_transport_name(t);
    if (x == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "kv_warmup_export: transport %s not open", *via);
    e = kv_fill(k, x, 0, slot, need, &r, &len);
    if (e == DSV4_OK)
        dsv4_kvx_release(x, &r);   /* nobody reads it: recycled (cudaipc: cached) */
    return e;
}

/* Forget export x; `acked`: its importer is done with it, so the transport
 * may recycle the region (cudaipc keeps it for the next export). */
static void
kv_drop(struct rank *k, struct rank_export *x, bool acked)
{
    TAILQ_REMOVE(&k->exports, x, entry);
    k->n_exports--;
    if (acked)
        dsv4_kvx_release(x->x, &x->r);
    else
        dsv4_kvx_free(x->x, &x->r);
    free(x);
}

/* Drop every export of req; true if there was one. */
static bool
kv_drop_req(struct rank *k, uint64_t req, bool acked)
{
    struct rank_export *x, *t;
    bool found = false;

    for (x = TAILQ_FIRST(&k->exports); x != NULL; x = t) {
        t = TAILQ_NEXT(x, entry);
        if (x->r.req == req) {
            kv_drop(k, x, acked);
            found = true;
        }
    }
    return found;
}

bool
kv_release(struct rank *k, uint64_t req)
{
    return kv_drop_req(k, req, false);
}

bool
kv_released(struct rank *k, uint64_t req)
{
    return kv_drop_req(k, req, true);
}

void
kv_release_all(struct rank *k)
{
    while (!TAILQ_EMPTY(&k->exports))
        kv_drop(k, TAILQ_FIRST(&k->exports), false);
}

int64_t
kv_timers(struct rank *k, int64_t now)
{
    struct rank_export *x;
    int64_t next = -1, t;

    for (int i = 0; i < DSV4_TRANSPORT__COUNT; i++) {
        if (k->kvx[i] != NULL && (t = dsv4_kvx_tick(k->kvx[i], now)) >= 0 &&
            (next < 0 || t < next))
            next = t;
    }
    /* Exports are in creation order: expire from the head. */
    while ((x = TAILQ_FIRST(&k->exports)) != NULL && now - x->t_ms >= k->o.kv_timeout_ms) {
        log_warnx("kv_timers: export unclaimed for %" PRId64 " ms, freed req=%" PRIu64,
                  now - x->t_ms, x->r.req);
        kv_drop(k, x, false);
    }
    if (x != NULL && (next < 0 || x->t_ms + k->o.kv_timeout_ms - now < next))
        next = x->t_ms + k->o.kv_timeout_ms - now;
    return next;
}

enum dsv4_err
kv_import_start(struct rank *k, struct rank_stream *st, const struct dsv4_kv_loc *loc,
    uint32_t n_kv, uint32_t pos)
{
    struct dsv4_kvx_desc d;
    enum dsv4_err e;
    size_t want;

    /* every part holds the whole state (the prefill group's ranks each
     * export their replica): take the one of the same group rank, so that a
     * decode rank reads from the prefill rank on its own GPU */
    if (n_kv < 1)
        return dsv4_err_set(DSV4_ERR_PROTO, "kv_import: no location");
    loc += k->o.group_rank % n_kv;
    if (loc->n_parts != n_kv || loc->n_seg != 1)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "kv_import: %u locations / %u parts / %u "
                            "segments; expected one segment per part", (unsigned)n_kv,
                            (unsigned)loc->n_parts, (unsigned)loc->n_seg);
    /* exporters write the state at offset 0 (dsv4_kvx_desc_to_loc); the
     * transports fetch the region from 0 to the segment's end, so another
     * offset would only make them read more */
    if (loc->offsets[0] != 0)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "kv_import: a segment at offset %" PRIu64
                            "; expected the state at 0", loc->offsets[0]);
    if (loc->n_tokens != pos)
        return dsv4_err_set(DSV4_ERR_PROTO, "kv_import: location covers %u positions, pos %u",
                            (unsigned)loc->n_tokens, (unsigned)pos);
    /* the import checks the same after the transfer; here before a transport
     * (ucx) sizes its buffer by the segment (pos < max_seq: decode_start) */
    want = dsv4_model_state_size(k->m, (int)pos);
    if (loc->sizes[0] != want)
        return dsv4_err_set(DSV4_ERR_PROTO, "kv_import: a segment of %" PRIu64 " bytes; the "
                            "state of %u positions has %zu", loc->sizes[0], (unsigned)pos, want);
    e = dsv4_kvx_desc_from_loc(loc, &d);
    if (e != DSV4_OK)
        return e;
    if (k->kvx[d.transport] == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "kv_import: transport %s not supported",
                            dsv4_transport_name(d.transport));
    e = dsv4_kvx_import_start(k->kvx[d.transport], &d, &st->xfer);
    if (e != DSV4_OK)
        return e;
    st->xk = k->kvx[d.transport];
    st->kv_off = loc->offsets[0];
    st->kv_len = loc->sizes[0];
    st->pos = pos;
    return DSV4_OK;
}

enum dsv4_err
kv_import_poll(struct rank *k, struct rank_stream *st, int slot)
{
    struct dsv4_kvx_map map;
    enum dsv4_err e;

    e = dsv4_kvx_import_test(st->xk, st->xfer, &map);
    if (e == DSV4_ERR_BUSY)
        return e;
    st->xfer = NULL;
    if (e != DSV4_OK)
        return e;
    /* a cudaipc mapping is device memory: device-to-device copies */
    if (st->xk->device_memory)
        e = dsv4_model_state_import_dev(k->m, slot, (const uint8_t *)map.data + st->kv_off,
                                        (size_t)st->kv_len);
    else
        e = dsv4_model_state_import(k->m, slot, (const uint8_t *)map.data + st->kv_off,
                                    (size_t)st->kv_len);
    dsv4_kvx_unmap(st->xk, &map);
    if (e == DSV4_OK && dsv4_model_seq_len(k->m, slot) != (int)st->pos)
        e = dsv4_err_set(DSV4_ERR_PROTO, "kv_import: state holds %d positions, pos %u",
                         dsv4_model_seq_len(k->m, slot), (unsigned)st->pos);
    if (e != DSV4_OK)
        dsv4_model_seq_reset(k->m, slot);
    return e;
}

void
kv_import_abort(struct rank *k, struct rank_stream *st)
{
    (void)k;
    dsv4_kvx_import_abort(st->xk, st->xfer);
    st->xfer = NULL;
}
