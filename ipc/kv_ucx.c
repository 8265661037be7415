/*
 * kv_ucx.c — the `ucx` decode-state transport (ipc/kvxfer.h): the exporter
 * registers a host buffer with UCX and publishes its worker address, the
 * buffer's address and a packed rkey; the importer connects an endpoint to
 * that worker and reads the region with one RMA get into a buffer of its own.
 * Used between hosts (the scheduler picks it when prefill and decode ranks
 * announce different hosts); RDMA or TCP underneath, as the UCX transport
 * list (opts->ucx_tls, default "tcp") allows.
 *
 * Handle (docs/protocol.md §6.2), integers little-endian:
 *   "DSV4UX1\0" | u64 address | u64 region size | u32 worker address bytes |
 *   u32 rkey bytes | u32 owner bytes | worker address | rkey | owner tag
 *
 * DESIGN.  Over TCP, UCX emulates RMA with active messages, so the EXPORTER
 * must keep progressing its worker while an importer reads: each instance
 * runs one progress thread that sleeps on the worker's event fd (bounded by
 * UX_IDLE_MS) and calls ucp_worker_progress.  The worker is created
 * UCS_THREAD_MODE_SERIALIZED and every UCX call, from either thread, holds
 * `mu`; UCX callbacks therefore run with `mu` held and never free anything
 * the main thread may hold: they only record results, and ux_reap() (main
 * thread, under `mu`) frees.
 *
 * Imports are asynchronous: import_start posts the get and returns; the get's
 * callback marks it done and writes the instance's eventfd, which the rank
 * polls.  The generic layer (kvxfer.c) enforces the timeout: an import still
 * running at its deadline is aborted here by force-closing the endpoint to
 * that exporter, which completes every get on it with an error (they all
 * share the stalled link); the next import opens a fresh endpoint.
 * Endpoints are kept per exporter worker address (struct ux_peer) and
 * reference-counted by the gets using them.  Errors on an endpoint (peer
 * reset, keepalive) close it the same way.
 *
 * A region freed by the exporter stays mapped (not registered) for the
 * import timeout plus UX_GRACE_MS, because an emulated get that was already
 * under way reads the address without checking the registration.  The
 * handle carries that timeout (its "hold"), and an importer bounds the
 * import by the smaller of its own timeout and the hold: an importer of a
 * longer kv_timeout_ms would otherwise read on past the grace, into pages
 * dropped to zeros, and take them for the state.
 *
 * Main-thread functions: everything in the ops table.  Progress thread:
 * ux_thread and the UCX callbacks it runs.
 */
#include "ipc/kvxfer.h"

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/queue.h>

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "common/log.h"
#include "ipc/proto.h"   /* DSV4_RANK_ABI */
#include "ipc/zsock.h"

/* The handle (docs/protocol.md §6.2), part of DSV4_RANK_ABI: a change to its
 * layout fails the build below until the ABI is incremented. */
#define UX_MAGIC "DSV4UX2"     /* 8 bytes with the NUL */
#define UX_HDR 40              /* magic 8, address 8, size 8, three u32 lengths, u32 hold */
_Static_assert(DSV4_RANK_ABI >= 2 && UX_HDR == 40,
               "the ucx handle changed: increment DSV4_RANK_ABI, then update this");
#define UX_TLS_DEFAULT "tcp"   /* UCX_TLS unless configured */
#define UX_IDLE_MS 20          /* progress thread sleeps at most this long */
#define UX_PROGRESS_BATCH 16   /* ucp_worker_progress calls per hold of mu: a transfer
                                  streaming in must not keep the main thread out */
#define UX_GRACE_MS 1000       /* a freed region stays mapped timeout + this */
#define UX_TOMB_MS 600000      /* ... then its pages are dropped (reads see zeros) and its
                                  addresses kept this much longer, unmapped after */
#define UX_TOMBS_MAX 4096      /* ... or sooner, oldest first, past this many: each is a
                                  mapping of its own (vm.max_map_count is 65,530 by
                                  default); 4,096 in 10 minutes is 6.8 exports a second */
#define UX_CLOSE_MS 2000       /* bound on closing endpoints at shutdown */
#define UX_ALIGN 4096          /* buffer alignment */
#define UX_LANES_MAX 1024      /* bytes of the logged lane description */

struct ux;

/* An endpoint to one exporter's worker. */
struct ux_peer {
    TAILQ_ENTRY(ux_peer) entry;  /* on ux.peers (listed) or ux.closing */
    struct ux *u;
    uint8_t *addr;               /* worker address bytes; owned */
    size_t addr_len;
    ucp_ep_h ep;                 /* NULL once closing began */
    void *close_req;             /* close still in flight, or NULL */
    bool listed;                 /* usable for new imports */
    unsigned refs;               /* list reference + gets in flight */
};
TAILQ_HEAD(ux_peer_list, ux_peer);

/* One get (struct dsv4_kvx_xfer.priv). */
struct ux_get {
    struct ux_peer *peer;        /* NULL once the get completed */
    void *buf;                   /* destination, `size` bytes; owned */
    uint64_t size;
    ucp_rkey_h rkey;
    atomic_bool done;            /* callback ran (or finished inline); set
                                    last, after status, read without mu */
    ucs_status_t status;
    bool abandoned;              /* caller gave up: the callback frees */
    int64_t deadline_ms;         /* the import's bound (monotonic) */
    TAILQ_ENTRY(ux_get) aentry;  /* on ux.abandoned while abandoned, not done */
};
TAILQ_HEAD(ux_get_list, ux_get);

/* A freed export kept mapped a while. */
struct ux_grave {
    TAILQ_ENTRY(ux_grave) entry;
    void *buf;                   /* an mmap of len bytes */
    size_t len;
    int64_t free_ms;             /* monotonic: its pages dropped from then */
};
TAILQ_HEAD(ux_grave_list, ux_grave);

/* An exported region (struct dsv4_kvx_region.priv). */
struct ux_region {
    ucp_mem_h memh;
};

/* The instance (struct dsv4_kvx.priv). */
struct ux {
    ucp_context_h ctx;
    ucp_worker_h worker;
    pthread_mutex_t mu;          /* every UCX call and every field below */
    pthread_t thr;
    bool thr_up;
    bool stop;                   /* progress thread: exit */
    int wfd;                     /* worker event fd */
    int evfd;                    /* eventfd: some get finished */
    ucp_address_t *self;         /* own worker address */
    size_t self_len;
    struct ux_peer_list peers;
    struct ux_peer_list closing;
    struct ux_grave_list graves;   /* freed, still mapped, in free order */
    struct ux_grave_list tombs;    /* past their grace, pages dropped, in the same order */
    int ntombs;
    struct ux_get_list abandoned;   /* cancelled gets still running */
    int64_t grave_ms;            /* how long a freed region stays mapped */
    char lanes[UX_LANES_MAX];    /* last lane description logged */
};

/* --- Little-endian fields --------------------------------------------------- */

static void
put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void
put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t
get_u64(const uint8_t *p)
{
    uint64_t v = 0;

    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t
get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* --- Progress thread and callbacks (mu held) ----------------------------------- */

static void
ux_signal(struct ux *u)
{
    uint64_t one = 1;

    if (write(u->evfd, &one, sizeof(one)) < 0) {
        /* EAGAIN: the counter is already non-zero, the reader will wake */
    }
}

/* Start closing p's endpoint (force: outstanding gets complete with an
 * error) and take it off the list of usable peers.  Idempotent. */
static void
ux_peer_close(struct ux *u, struct ux_peer *p)
{
    ucp_request_param_t prm;
    ucp_ep_h ep = p->ep;
    void *r;

    if (p->listed) {
        TAILQ_REMOVE(&u->peers, p, entry);
        TAILQ_INSERT_TAIL(&u->closing, p, entry);
        p->listed = false;
        p->refs--;
    }
    if (ep == NULL)
        return;
    p->ep = NULL;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    r = ucp_ep_close_nbx(ep, &prm);
    if (r != NULL && UCS_PTR_IS_PTR(r))
        p->close_req = r;
}

/* Endpoint failure (peer gone, connection reset). */
static void
ux_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    struct ux_peer *p = arg;

    (void)ep;
    (void)status;
    ux_peer_close(p->u, p);
    ux_signal(p->u);
}

/* A get finished (status UCS_OK) or failed. */
static void
ux_get_done(void *request, ucs_status_t status, void *user_data)
{
    struct ux_get *g = user_data;
    struct ux_peer *p = g->peer;
    struct ux *u = p->u;

    ucp_request_free(request);
    g->status = status;
    ucp_rkey_destroy(g->rkey);
    g->rkey = NULL;
    g->peer = NULL;
    p->refs--;
    if (status != UCS_OK)
        ux_peer_close(u, p);  /* the link is suspect: reconnect next time */
    if (g->abandoned) {
        TAILQ_REMOVE(&u->abandoned, g, aentry);
        free(g->buf);
        free(g);
        return;
    }
    /* Last, and nothing of g after it: ux_import_test reads `done` without
     * mu and frees g as soon as it sees it (ux_import_abort, under mu, sees
     * the callback either not run, and marks g abandoned, or done). */
    atomic_store_explicit(&g->done, true, memory_order_release);
    ux_signal(u);
}

/* Cancelled gets still running past their import's bound: their peer is
 * closed (force), which ends them (the callback frees each).  The exporter
 * keeps a freed region for its own bound + UX_GRACE_MS only: a get left to
 * run longer read freed memory there (mu held). */
static void
ux_abandoned_check(struct ux *u, int64_t now)
{
    struct ux_get *g;

    /* from the head again after each close: were the force close to end
     * the peer's gets at once, their callbacks would free them, the next
     * one of the list among them (a closed peer's ep is NULL: not again) */
again:
    TAILQ_FOREACH(g, &u->abandoned, aentry) {
        if (g->peer != NULL && g->peer->ep != NULL && now >= g->deadline_ms) {
            ux_peer_close(u, g->peer);
            goto again;
        }
    }
}

static void ux_reap(struct ux *u, int64_t now);

static void *
ux_thread(void *arg)
{
    struct ux *u = arg;

    for (;;) {
        struct pollfd pfd = { .fd = u->wfd, .events = POLLIN };
        ucs_status_t st;

        int64_t now;
        int i;

        pthread_mutex_lock(&u->mu);
        if (u->stop) {
            pthread_mutex_unlock(&u->mu);
            break;
        }
        for (i = 0; i < UX_PROGRESS_BATCH; i++)
            if (ucp_worker_progress(u->worker) == 0)
                break;
        if (i == UX_PROGRESS_BATCH) {
            /* more to do: let the main thread have mu in between */
            pthread_mutex_unlock(&u->mu);
            sched_yield();
            continue;
        }
        now = dsv4_now_ms();
        ux_abandoned_check(u, now);
        ux_reap(u, now);   /* freed regions go when their time is up, idle or not */
        st = ucp_worker_arm(u->worker);
        pthread_mutex_unlock(&u->mu);
        if (st == UCS_ERR_BUSY)
            continue;
        poll(&pfd, 1, UX_IDLE_MS);
    }
    return NULL;
}

/* --- Housekeeping (mu held) ------------------------------------------------------- */

/* Free closed peers nobody uses and regions past their grace time. */
static void
ux_reap(struct ux *u, int64_t now)
{
    struct ux_peer *p, *pn;
    struct ux_grave *g, *gn;

    for (p = TAILQ_FIRST(&u->closing); p != NULL; p = pn) {
        pn = TAILQ_NEXT(p, entry);
        if (p->close_req != NULL && ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
            ucp_request_free(p->close_req);
            p->close_req = NULL;
        }
        if (p->close_req == NULL && p->refs == 0) {
            TAILQ_REMOVE(&u->closing, p, entry);
            free(p->addr);
            free(p);
        }
    }
    /* A get that outlives the region's grace (a cancelled import on a
     * stalled link, an importer of a longer kv_timeout_ms) still reads it:
     * over TCP this process's own code does, so its pages are dropped
     * (memory back, reads see zeros) and its addresses stay mapped
     * UX_TOMB_MS more, or until UX_TOMBS_MAX younger ones wait, before they
     * go.  Both lists are in free order, so each walk stops at the first
     * that stays. */
    for (g = TAILQ_FIRST(&u->graves); g != NULL; g = gn) {
        gn = TAILQ_NEXT(g, entry);
        if (now >= 0 && now < g->free_ms)
            break;   /* in free order: the rest are younger */
        TAILQ_REMOVE(&u->graves, g, entry);
        if (now >= 0) {
            (void)madvise(g->buf, g->len, MADV_DONTNEED);
            TAILQ_INSERT_TAIL(&u->tombs, g, entry);
            u->ntombs++;
        } else {
            munmap(g->buf, g->len);
            free(g);
        }
    }
    while ((g = TAILQ_FIRST(&u->tombs)) != NULL &&
           (now < 0 || now >= g->free_ms + UX_TOMB_MS || u->ntombs > UX_TOMBS_MAX)) {
        TAILQ_REMOVE(&u->tombs, g, entry);
        u->ntombs--;
        munmap(g->buf, g->len);
        free(g);
    }
}

/* Log the endpoint's lanes (transport/device per lane), at notice level when
 * they differ from the last ones logged: operators and the multi-host test
 * read which UCX transport carries decode state from this line. */
static void
ux_log_lanes(struct ux *u, ucp_ep_h ep, const char *owner)
{
    char line[UX_LANES_MAX], *txt = NULL, *s, *e;
    size_t n = 0, len = 0;
    FILE *f;

    if ((f = open_memstream(&txt, &n)) == NULL)
        return;
    ucp_ep_print_info(ep, f);
    fclose(f);
    line[0] = '\0';
    for (s = txt; s != NULL && *s != '\0'; s = e) {
        char *lane;

        e = strchr(s, '\n');
        if (e != NULL)
            *e++ = '\0';
        if ((lane = strstr(s, "lane[")) == NULL)
            continue;
        /* "lane[0]:  1:tcp/veth0.0 md[1] -> ..." -> "lane[0] 1:tcp/veth0.0 ..."
         * with blanks collapsed */
        for (char *c = lane; *c != '\0' && len + 2 < sizeof(line); c++) {
            if ((*c == ' ' || *c == '\t') && len > 0 && line[len - 1] == ' ')
                continue;
            line[len++] = *c == '\t' ? ' ' : *c;
        }
        if (len + 3 < sizeof(line)) {
            line[len++] = ';';
            line[len++] = ' ';
        }
        line[len] = '\0';
    }
    free(txt);
    if (strcmp(line, u->lanes) != 0) {
        log_notice("kv_ucx: endpoint to %s: %s", owner, line);
        snprintf(u->lanes, sizeof(u->lanes), "%s", line);
    } else {
        log_debug("kv_ucx: endpoint to %s: same lanes", owner);
    }
}

/* The usable endpoint to the worker at addr, made when missing. */
static enum dsv4_err
ux_peer_get(struct ux *u, const uint8_t *addr, size_t len, const char *owner,
            struct ux_peer **out)
{
    ucp_ep_params_t ep;
    struct ux_peer *p;
    ucs_status_t st;

    TAILQ_FOREACH(p, &u->peers, entry) {
        if (p->addr_len == len && memcmp(p->addr, addr, len) == 0) {
            *out = p;
            return DSV4_OK;
        }
    }
    /* UCX parses an address without its length: one cut short on the wire
     * reads on into zeros here, not past the allocation (every address fits
     * a handle) */
    if ((p = calloc(1, sizeof(*p))) == NULL ||
        (p->addr = calloc(1, DSV4_KVX_MAX_HANDLE)) == NULL) {
        free(p);
        return dsv4_err_set(DSV4_ERR_NOMEM, "kv_ucx: out of memory");
    }
    memcpy(p->addr, addr, len);
    p->addr_len = len;
    p->u = u;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = (const ucp_address_t *)p->addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = ux_ep_error;
    ep.err_handler.arg = p;
    st = ucp_ep_create(u->worker, &ep, &p->ep);
    if (st != UCS_OK) {
        free(p->addr);
        free(p);
        return dsv4_err_set(DSV4_ERR_SYS, "kv_ucx: endpoint to %s: %s", owner,
                            ucs_status_string(st));
    }
    p->listed = true;
    p->refs = 1;
    TAILQ_INSERT_TAIL(&u->peers, p, entry);
    ux_log_lanes(u, p->ep, owner);
    *out = p;
    return DSV4_OK;
}

/* --- Exporter ------------------------------------------------------------------------ */

/* Bytes of the mapping of a region of `size` bytes. */
static size_t
ux_region_len(uint64_t size)
{
    return (size_t)((size + UX_ALIGN - 1) / UX_ALIGN * UX_ALIGN);
}

/* The handle's hold: how long after its free a region stays readable (it
 * stays mapped UX_GRACE_MS longer still, for a get already under way). */
static uint32_t
ux_hold_ms(const struct dsv4_kvx *x)
{
    return x->timeout_ms < UINT32_MAX ? (uint32_t)x->timeout_ms : UINT32_MAX;
}

static enum dsv4_err
ux_export_region(struct dsv4_kvx *x, uint64_t req, uint64_t size, struct dsv4_kvx_region *r)
{
    struct ux *u = x->priv;
    ucp_mem_map_params_t mp;
    struct ux_region *xr;
    void *buf = NULL, *rk = NULL;
    size_t rk_len = 0, olen = strlen(x->owner), need;
    uint64_t alloc;
    ucs_status_t st;
    uint8_t *h;

    if (size > (uint64_t)SIZE_MAX - UX_ALIGN)
        return dsv4_err_set(DSV4_ERR_INVAL, "kv_ucx: region of %" PRIu64 " bytes", size);
    alloc = ux_region_len(size);
    /* a mapping of its own: its pages can be dropped apart (ux_reap) */
    if ((xr = calloc(1, sizeof(*xr))) == NULL ||
        (buf = mmap(NULL, alloc, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)) ==
            MAP_FAILED) {
        free(xr);
        return dsv4_err_set(DSV4_ERR_NOMEM, "kv_ucx: no memory for %" PRIu64 " bytes", size);
    }
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = buf;
    mp.length = alloc;
    pthread_mutex_lock(&u->mu);
    ux_reap(u, dsv4_now_ms());
    st = ucp_mem_map(u->ctx, &mp, &xr->memh);
    if (st == UCS_OK && (st = ucp_rkey_pack(u->ctx, xr->memh, &rk, &rk_len)) != UCS_OK)
        ucp_mem_unmap(u->ctx, xr->memh);
    need = UX_HDR + u->self_len + rk_len + olen;
    if (st == UCS_OK && need > DSV4_KVX_MAX_HANDLE) {
        ucp_rkey_buffer_release(rk);
        ucp_mem_unmap(u->ctx, xr->memh);
        pthread_mutex_unlock(&u->mu);
        munmap(buf, alloc);
        free(xr);
        return dsv4_err_set(DSV4_ERR_NOTSUP, "kv_ucx: handle of %zu bytes (worker address "
                            "%zu, rkey %zu) exceeds %d", need, u->self_len, rk_len,
                            DSV4_KVX_MAX_HANDLE);
    }
    if (st != UCS_OK) {
        pthread_mutex_unlock(&u->mu);
        munmap(buf, alloc);
        free(xr);
        return dsv4_err_set(DSV4_ERR_SYS, "kv_ucx: register %" PRIu64 " bytes: %s", size,
                            ucs_status_string(st));
    }
    h = r->desc.handle;
    memcpy(h, UX_MAGIC, 8);
    put_u64(h + 8, (uint64_t)(uintptr_t)buf);
    put_u64(h + 16, size);
    put_u32(h + 24, (uint32_t)u->self_len);
    put_u32(h + 28, (uint32_t)rk_len);
    put_u32(h + 32, (uint32_t)olen);
    put_u32(h + 36, ux_hold_ms(x));
    memcpy(h + UX_HDR, u->self, u->self_len);
    memcpy(h + UX_HDR + u->self_len, rk, rk_len);
    memcpy(h + UX_HDR + u->self_len + rk_len, x->owner, olen);
    ucp_rkey_buffer_release(rk);
    pthread_mutex_unlock(&u->mu);
    r->data = buf;
    r->size = size;
    r->req = req;
    r->desc.transport = DSV4_TRANSPORT_UCX;
    r->desc.handle_len = (uint32_t)need;
    r->desc.size = size;
    r->priv = xr;
    return DSV4_OK;
}

static void
ux_free_region(struct dsv4_kvx *x, struct dsv4_kvx_region *r)
{
    struct ux *u = x->priv;
    struct ux_region *xr = r->priv;
    struct ux_grave *g = calloc(1, sizeof(*g));
    int64_t now = dsv4_now_ms();

    pthread_mutex_lock(&u->mu);
    ucp_mem_unmap(u->ctx, xr->memh);
    if (g != NULL) {
        g->buf = r->data;
        g->len = ux_region_len(r->size);
        g->free_ms = now + u->grave_ms;
        TAILQ_INSERT_TAIL(&u->graves, g, entry);
    } else {
        munmap(r->data, ux_region_len(r->size));  /* no memory for the bookkeeping */
    }
    ux_reap(u, now);
    pthread_mutex_unlock(&u->mu);
    free(xr);
}

static int
ux_cleanup_stale(struct dsv4_kvx *x)
{
    /* Regions are process memory: nothing outlives a crash. */
    (void)x;
    return 0;
}

/* --- Importer ------------------------------------------------------------------------- */

/* Split a handle (*hold_ms: how long the exporter keeps a freed region
 * readable); -1 when malformed. */
static int
ux_parse(const struct dsv4_kvx_desc *d, uint64_t *raddr, const uint8_t **addr,
         uint32_t *alen, const uint8_t **rk, uint32_t *rlen_out, uint32_t *hold_ms,
         char owner[DSV4_KVX_MAX_OWNER])
{
    const uint8_t *h = d->handle;
    uint32_t rlen, olen;

    if (d->handle_len < UX_HDR || memcmp(h, UX_MAGIC, 8) != 0)
        return -1;
    *raddr = get_u64(h + 8);
    *alen = get_u32(h + 24);
    rlen = get_u32(h + 28);
    olen = get_u32(h + 32);
    *hold_ms = get_u32(h + 36);
    if (*alen == 0 || rlen == 0 || olen >= DSV4_KVX_MAX_OWNER || *hold_ms == 0 ||
        (uint64_t)UX_HDR + *alen + rlen + olen != d->handle_len)
        return -1;
    if (get_u64(h + 16) < d->size || *raddr == 0)
        return -1;
    *addr = h + UX_HDR;
    *rk = h + UX_HDR + *alen;
    *rlen_out = rlen;
    memcpy(owner, h + UX_HDR + *alen + rlen, olen);
    owner[olen] = '\0';
    for (uint32_t i = 0; i < olen; i++)
        if (owner[i] < '!' || owner[i] > '~')
            owner[i] = '?';
    return 0;
}

static enum dsv4_err
ux_import_start(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d, struct dsv4_kvx_xfer *t)
{
    struct ux *u = x->priv;
    char owner[DSV4_KVX_MAX_OWNER];
    const uint8_t *addr, *rkb;
    ucp_request_param_t prm;
    struct ux_peer *p = NULL;
    struct ux_get *g;
    uint64_t raddr;
    uint32_t alen, rlen, hold_ms;
    /* the rkey in a zeroed buffer of a handle's bound: UCX reads it by its
     * own fields, not by rlen, so what follows it is zeros, not whatever
     * the descriptor's array held */
    uint8_t rkey[DSV4_KVX_MAX_HANDLE] = { 0 };
    enum dsv4_err e;
    ucs_status_t st;
    void *sp;

    if (ux_parse(d, &raddr, &addr, &alen, &rkb, &rlen, &hold_ms, owner) != 0)
        return dsv4_err_set(DSV4_ERR_PROTO, "kv_ucx: malformed handle (%u bytes)",
                            (unsigned)d->handle_len);
    if (d->size > SIZE_MAX - UX_ALIGN)   /* a descriptor's fault, not a lack of memory */
        return dsv4_err_set(DSV4_ERR_PROTO, "kv_ucx: a region of %" PRIu64 " bytes",
                            d->size);
    memcpy(rkey, rkb, rlen);
    if ((g = calloc(1, sizeof(*g))) == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "kv_ucx: out of memory");
    if (posix_memalign(&g->buf, UX_ALIGN, (d->size + UX_ALIGN - 1) / UX_ALIGN * UX_ALIGN) !=
        0) {
        free(g);
        return dsv4_err_set(DSV4_ERR_NOMEM, "kv_ucx: no memory for %" PRIu64 " bytes",
                            d->size);
    }
    g->size = d->size;
    /* not past the exporter's hold: a get after it may read dropped pages */
    if (hold_ms < t->bound_ms)
        t->bound_ms = hold_ms;
    g->deadline_ms = dsv4_now_ms() + t->bound_ms;
    pthread_mutex_lock(&u->mu);
    ux_reap(u, dsv4_now_ms());
    if ((e = ux_peer_get(u, addr, alen, owner, &p)) != DSV4_OK)
        goto fail;
    st = ucp_ep_rkey_unpack(p->ep, rkey, &g->rkey);
    if (st != UCS_OK) {
        e = dsv4_err_set(DSV4_ERR_PROTO, "kv_ucx: rkey from %s: %s", owner,
                         ucs_status_string(st));
        goto fail;
    }
    g->peer = p;
    p->refs++;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.send = ux_get_done;
    prm.user_data = g;
    sp = ucp_get_nbx(p->ep, g->buf, (size_t)d->size, raddr, g->rkey, &prm);
    if (sp == NULL || UCS_PTR_IS_ERR(sp)) {
        /* finished inline: no callback */
        st = sp == NULL ? UCS_OK : UCS_PTR_STATUS(sp);
        g->status = st;
        atomic_store_explicit(&g->done, true, memory_order_release);
        ucp_rkey_destroy(g->rkey);
        g->rkey = NULL;
        g->peer = NULL;
        p->refs--;
        if (st != UCS_OK) {
            ux_peer_close(u, p);
            e = dsv4_err_set(DSV4_ERR_SYS, "kv_ucx: get from %s: %s", owner,
                             ucs_status_string(st));
            goto fail;
        }
    }
    ucp_worker_signal(u->worker);
    pthread_mutex_unlock(&u->mu);
    t->priv = g;
    log_debug("kv_ucx: get %" PRIu64 " bytes from %s", d->size, owner);
    return DSV4_OK;
fail:
    pthread_mutex_unlock(&u->mu);
    free(g->buf);
    free(g);
    return e;
}

static enum dsv4_err
ux_import_test(struct dsv4_kvx *x, struct dsv4_kvx_xfer *t, struct dsv4_kvx_map *m)
{
    struct ux_get *g = t->priv;
    ucs_status_t st;

    (void)x;
    /* without mu: the progress thread holds it while data streams in */
    if (!atomic_load_explicit(&g->done, memory_order_acquire))
        return DSV4_ERR_BUSY;
    st = g->status;
    t->priv = NULL;
    if (st != UCS_OK) {
        free(g->buf);
        free(g);
        return dsv4_err_set(DSV4_ERR_SYS, "kv_ucx: get of %" PRIu64 " bytes failed: %s",
                            t->size, ucs_status_string(st));
    }
    m->data = g->buf;
    m->size = g->size;
    m->priv = NULL;
    free(g);
    return DSV4_OK;
}

static void
ux_import_abort(struct dsv4_kvx *x, struct dsv4_kvx_xfer *t)
{
    struct ux *u = x->priv;
    struct ux_get *g = t->priv;

    t->priv = NULL;
    if (g == NULL)
        return;
    pthread_mutex_lock(&u->mu);
    if (atomic_load_explicit(&g->done, memory_order_acquire)) {
        pthread_mutex_unlock(&u->mu);
        free(g->buf);
        free(g);
        return;
    }
    /* The callback frees g once UCX lets go of the buffer.  After a timeout
     * the link may be stalled: closing the endpoint (force) makes that
     * happen now.  A cancel leaves the endpoint alone (the other gets from
     * the same exporter share it, and a forced close failed them all) until
     * the import's bound: then ux_abandoned_check closes it. */
    g->abandoned = true;
    TAILQ_INSERT_TAIL(&u->abandoned, g, aentry);
    if (t->timed_out)
        ux_peer_close(u, g->peer);
    ucp_worker_signal(u->worker);
    pthread_mutex_unlock(&u->mu);
}

static void
ux_unmap(struct dsv4_kvx *x, struct dsv4_kvx_map *m)
{
    (void)x;
    free((void *)(uintptr_t)m->data);
}

static int
ux_event_fd(struct dsv4_kvx *x)
{
    return ((struct ux *)x->priv)->evfd;
}

/* --- Instance -------------------------------------------------------------------------- */

static void ux_fini(struct dsv4_kvx *x);

static enum dsv4_err
ux_init(struct dsv4_kvx *x, const struct dsv4_kvx_opts *o)
{
    const char *tls = o->ucx_tls != NULL && o->ucx_tls[0] != '\0' ? o->ucx_tls : UX_TLS_DEFAULT;
    const char *dev = o->ucx_devices != NULL && o->ucx_devices[0] != '\0' ? o->ucx_devices :
                                                                                NULL;
    ucp_worker_params_t wp;
    ucp_config_t *cfg;
    ucp_params_t p;
    ucs_status_t st;
    struct ux *u;

    if ((u = calloc(1, sizeof(*u))) == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "kv_ucx: out of memory");
    pthread_mutex_init(&u->mu, NULL);
    TAILQ_INIT(&u->peers);
    TAILQ_INIT(&u->closing);
    TAILQ_INIT(&u->graves);
    TAILQ_INIT(&u->tombs);
    TAILQ_INIT(&u->abandoned);
    u->wfd = u->evfd = -1;
    u->grave_ms = x->timeout_ms + UX_GRACE_MS;
    x->priv = u;
    st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK)
        goto fail;
    st = ucp_config_modify(cfg, "TLS", tls);
    if (st == UCS_OK && dev != NULL)
        st = ucp_config_modify(cfg, "NET_DEVICES", dev);
    if (st != UCS_OK) {
        ucp_config_release(cfg);
        goto fail;
    }
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    st = ucp_init(&p, cfg, &u->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK)
        goto fail;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    if ((st = ucp_worker_create(u->ctx, &wp, &u->worker)) != UCS_OK ||
        (st = ucp_worker_get_address(u->worker, &u->self, &u->self_len)) != UCS_OK ||
        (st = ucp_worker_get_efd(u->worker, &u->wfd)) != UCS_OK)
        goto fail;
    if ((u->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        int err = errno;
        ux_fini(x);
        return dsv4_err_set(DSV4_ERR_SYS, "kv_ucx: eventfd: %s", strerror(err));
    }
    if (pthread_create(&u->thr, NULL, ux_thread, u) != 0) {
        ux_fini(x);
        return dsv4_err_set(DSV4_ERR_SYS, "kv_ucx: cannot start the progress thread");
    }
    u->thr_up = true;
    log_info("kv_ucx: %s worker up (UCX %s, tls %s, devices %s, address %zu bytes)", x->owner,
             ucp_get_version_string(), tls, dev != NULL ? dev : "all", u->self_len);
    return DSV4_OK;
fail:
    ux_fini(x);
    return dsv4_err_set(DSV4_ERR_SYS, "kv_ucx: UCX (tls %s, devices %s): %s", tls,
                        dev != NULL ? dev : "all", ucs_status_string(st));
}

static void
ux_fini(struct dsv4_kvx *x)
{
    struct ux *u = x->priv;
    int64_t end = dsv4_now_ms() + UX_CLOSE_MS;
    struct ux_peer *p;

    if (u == NULL)
        return;
    if (u->thr_up) {
        pthread_mutex_lock(&u->mu);
        u->stop = true;
        ucp_worker_signal(u->worker);
        pthread_mutex_unlock(&u->mu);
        pthread_join(u->thr, NULL);
    }
    /* Only this thread is left: close every endpoint, progress until the
     * closes (and the gets they cancel) are done or the bound passed. */
    while ((p = TAILQ_FIRST(&u->peers)) != NULL)
        ux_peer_close(u, p);
    while (u->worker != NULL && !TAILQ_EMPTY(&u->closing) && dsv4_now_ms() < end) {
        ucp_worker_progress(u->worker);
        ux_reap(u, 0);
    }
    if (!TAILQ_EMPTY(&u->closing))
        log_warnx("kv_ucx: endpoints still closing at shutdown");
    ux_reap(u, -1);
    if (u->self != NULL)
        ucp_worker_release_address(u->worker, u->self);
    if (u->worker != NULL)
        ucp_worker_destroy(u->worker);
    if (u->ctx != NULL)
        ucp_cleanup(u->ctx);
    if (u->evfd >= 0)
        close(u->evfd);
    pthread_mutex_destroy(&u->mu);
    free(u);
    x->priv = NULL;
}

const struct dsv4_kvx_ops dsv4_kvx_ucx_ops = {
    .export_region = ux_export_region,
    .free_region = ux_free_region,
    .import_map = NULL,
    .unmap = ux_unmap,
    .cleanup_stale = ux_cleanup_stale,
    .init = ux_init,
    .fini = ux_fini,
    .import_start = ux_import_start,
    .import_test = ux_import_test,
    .import_abort = ux_import_abort,
    .event_fd = ux_event_fd,
};
