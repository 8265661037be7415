/*
 * kvxfer.c — the transport-independent half of the decode-state transfer
 * layer (ipc/kvxfer.h): instance creation by transport, argument checks and
 * live-region accounting around the transport's ops, and the conversion
 * between a region and the protocol's KV location descriptor.
 *
 * Runs in a rank's main thread; no global state.
 */
#include "ipc/kvxfer.h"

#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ipc/zsock.h"

/* True when `owner` is 1 … DSV4_KVX_MAX_OWNER-1 bytes of [A-Za-z0-9._-]. */
static int
kvx_owner_valid(const char *owner)
{
    size_t n = 0;

    if (owner == NULL)
        return 0;
    for (; owner[n] != '\0'; n++) {
        char c = owner[n];
        if (n + 1 >= DSV4_KVX_MAX_OWNER)
            return 0;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return 0;
    }
    return n > 0;
}

/* The ops table of transport t, or NULL when it is not built in. */
static const struct dsv4_kvx_ops *
kvx_ops_of(enum dsv4_transport t)
{
    switch (t) {
    case DSV4_TRANSPORT_SHM:
        return &dsv4_kvx_shm_ops;
#ifdef DSV4_HAVE_UCX
    case DSV4_TRANSPORT_UCX:
        return &dsv4_kvx_ucx_ops;
#endif
    default:
        return NULL;
    }
}

bool
dsv4_kvx_available(enum dsv4_transport t)
{
    return kvx_ops_of(t) != NULL;
}

enum dsv4_err
dsv4_kvx_open(struct dsv4_kvx **out, enum dsv4_transport t, const char *owner)
{
    return dsv4_kvx_open_opts(out, t, owner, NULL);
}

enum dsv4_err
dsv4_kvx_open_opts(struct dsv4_kvx **out, enum dsv4_transport t, const char *owner,
                   const struct dsv4_kvx_opts *o)
{
    const struct dsv4_kvx_ops *ops;

    *out = NULL;
    if (t <= DSV4_TRANSPORT_NONE || t >= DSV4_TRANSPORT__COUNT)
        return dsv4_err_set(DSV4_ERR_INVAL, "kvx_open: unknown transport %d", (int)t);
    if ((ops = kvx_ops_of(t)) == NULL)
        return dsv4_err_set(DSV4_ERR_NOTSUP, "kvx_open: transport %s not built in",
                            dsv4_transport_name(t));
    return dsv4_kvx_open_ops(out, ops, t, owner, o);
}

enum dsv4_err
dsv4_kvx_open_ops(struct dsv4_kvx **out, const struct dsv4_kvx_ops *ops, enum dsv4_transport t,
                  const char *owner, const struct dsv4_kvx_opts *o)
{
    struct dsv4_kvx_opts none;
    struct dsv4_kvx *x;
    enum dsv4_err e;

    *out = NULL;
    if (t <= DSV4_TRANSPORT_NONE || t >= DSV4_TRANSPORT__COUNT)
        return dsv4_err_set(DSV4_ERR_INVAL, "kvx_open: unknown transport %d", (int)t);
    if (ops == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "kvx_open: no ops table for %s",
                            dsv4_transport_name(t));
    if (!kvx_owner_valid(owner))
        return dsv4_err_set(DSV4_ERR_INVAL, "kvx_open: bad owner tag");
    if (o == NULL) {
        memset(&none, 0, sizeof(none));
        o = &none;
    }
    if (o->timeout_ms < 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "kvx_open: negative timeout");
    x = calloc(1, sizeof(*x));
    if (x == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "kvx_open: out of memory");
    x->ops = ops;
    x->transport = t;
    x->timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : DSV4_KVX_TIMEOUT_MS;
    strcpy(x->owner, owner);
    if (ops->init != NULL && (e = ops->init(x, o)) != DSV4_OK) {
        free(x);
        return e;
    }
    *out = x;
    return DSV4_OK;
}

void
dsv4_kvx_close(struct dsv4_kvx *x)
{
    if (x == NULL)
        return;
    if (x->ops->fini != NULL)
        x->ops->fini(x);
    free(x);
}

enum dsv4_err
dsv4_kvx_export(struct dsv4_kvx *x, uint64_t req, uint64_t size, struct dsv4_kvx_region *r)
{
    enum dsv4_err e;

    memset(r, 0, sizeof(*r));
    if (size == 0)
        return dsv4_err_set(DSV4_ERR_INVAL, "kvx_export: empty region req=%llu",
                            (unsigned long long)req);
    e = x->ops->export_region(x, req, size, r);
    if (e != DSV4_OK) {
        memset(r, 0, sizeof(*r));
        return e;
    }
    x->n_exported++;
    x->n_live++;
    return DSV4_OK;
}

void
dsv4_kvx_free(struct dsv4_kvx *x, struct dsv4_kvx_region *r)
{
    if (r->data == NULL)
        return;
    x->ops->free_region(x, r);
    x->n_live--;
    memset(r, 0, sizeof(*r));
}

void
dsv4_kvx_release(struct dsv4_kvx *x, struct dsv4_kvx_region *r)
{
    if (r->data == NULL)
        return;
    if (x->ops->recycle_region != NULL)
        x->ops->recycle_region(x, r);
    else
        x->ops->free_region(x, r);
    x->n_live--;
    memset(r, 0, sizeof(*r));
}

/* Checks shared by every import path. */
static enum dsv4_err
kvx_import_check(const struct dsv4_kvx *x, const struct dsv4_kvx_desc *d)
{
    if (d->transport != x->transport)
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_import: descriptor transport %s, expected %s",
                            dsv4_transport_name(d->transport) != NULL ?
                                dsv4_transport_name(d->transport) : "?",
                            dsv4_transport_name(x->transport));
    if (d->handle_len == 0 || d->handle_len > DSV4_KVX_MAX_HANDLE || d->size == 0)
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_import: empty handle or region");
    return DSV4_OK;
}

/* A finished mapping must cover the descriptor's region. */
static enum dsv4_err
kvx_import_size(struct dsv4_kvx *x, uint64_t want, struct dsv4_kvx_map *m)
{
    uint64_t got = m->size;

    if (got >= want)
        return DSV4_OK;
    x->ops->unmap(x, m);
    memset(m, 0, sizeof(*m));
    return dsv4_err_set(DSV4_ERR_PROTO, "kvx_import: region has %llu bytes, descriptor "
                        "says %llu", (unsigned long long)got, (unsigned long long)want);
}

enum dsv4_err
dsv4_kvx_import(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d, struct dsv4_kvx_map *m)
{
    struct dsv4_kvx_xfer *t;
    enum dsv4_err e;

    memset(m, 0, sizeof(*m));
    if (x->ops->import_start != NULL) {
        /* A network transport: start, then wait on its event fd. */
        if ((e = dsv4_kvx_import_start(x, d, &t)) != DSV4_OK)
            return e;
        while ((e = dsv4_kvx_import_test(x, t, m)) == DSV4_ERR_BUSY) {
            struct pollfd p = { .fd = dsv4_kvx_event_fd(x), .events = POLLIN };
            int64_t left = t->deadline_ms - dsv4_now_ms();

            poll(&p, p.fd >= 0 ? 1 : 0, left < 1 ? 1 : left > 100 ? 100 : (int)left);
            dsv4_kvx_event_clear(x);
        }
        return e;
    }
    if ((e = kvx_import_check(x, d)) != DSV4_OK)
        return e;
    x->n_imports++;
    e = x->ops->import_map(x, d, m);
    if (e != DSV4_OK) {
        memset(m, 0, sizeof(*m));
        return e;
    }
    return kvx_import_size(x, d->size, m);
}

enum dsv4_err
dsv4_kvx_import_start(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d,
                      struct dsv4_kvx_xfer **out)
{
    struct dsv4_kvx_xfer *t;
    enum dsv4_err e;

    *out = NULL;
    if ((e = kvx_import_check(x, d)) != DSV4_OK)
        return e;
    if ((t = calloc(1, sizeof(*t))) == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "kvx_import: out of memory");
    t->size = d->size;
    t->bound_ms = x->timeout_ms;
    t->deadline_ms = dsv4_now_ms() + t->bound_ms;
    x->n_imports++;
    if (x->ops->import_start == NULL) {
        /* A local transport maps at once; _test hands the result over. */
        if ((e = x->ops->import_map(x, d, &t->map)) != DSV4_OK) {
            free(t);
            return e;
        }
        t->done = true;
        *out = t;
        return DSV4_OK;
    }
    if ((e = x->ops->import_start(x, d, t)) != DSV4_OK) {
        free(t);
        return e;
    }
    t->deadline_ms += t->bound_ms - x->timeout_ms;   /* the transport's bound */
    *out = t;
    return DSV4_OK;
}

enum dsv4_err
dsv4_kvx_import_test(struct dsv4_kvx *x, struct dsv4_kvx_xfer *t, struct dsv4_kvx_map *m)
{
    enum dsv4_err e;
    uint64_t want = t->size;

    memset(m, 0, sizeof(*m));
    if (t->done) {
        *m = t->map;
        free(t);
        return kvx_import_size(x, want, m);
    }
    e = x->ops->import_test(x, t, m);
    if (e == DSV4_ERR_BUSY && dsv4_now_ms() >= t->deadline_ms) {
        int64_t bound = t->bound_ms;

        t->timed_out = true;
        x->ops->import_abort(x, t);
        x->n_timeouts++;
        free(t);
        return dsv4_err_set(DSV4_ERR_TIMEOUT, "kvx_import: %s transfer of %llu bytes did not "
                            "finish within %lld ms", dsv4_transport_name(x->transport),
                            (unsigned long long)want, (long long)bound);
    }
    if (e == DSV4_ERR_BUSY)
        return e;
    free(t);
    if (e != DSV4_OK) {
        memset(m, 0, sizeof(*m));
        return e;
    }
    return kvx_import_size(x, want, m);
}

void
dsv4_kvx_import_abort(struct dsv4_kvx *x, struct dsv4_kvx_xfer *t)
{
    if (t == NULL)
        return;
    if (t->done) {
        if (t->map.data != NULL)
            x->ops->unmap(x, &t->map);
    } else {
        x->ops->import_abort(x, t);
    }
    free(t);
}

int
dsv4_kvx_event_fd(struct dsv4_kvx *x)
{
    return x->ops->event_fd != NULL ? x->ops->event_fd(x) : -1;
}

void
dsv4_kvx_event_clear(struct dsv4_kvx *x)
{
    uint64_t v;
    int fd = dsv4_kvx_event_fd(x);

    /* An eventfd (or a pipe): read what is there, never block. */
    while (fd >= 0 && read(fd, &v, sizeof(v)) > 0)
        ;
}

void
dsv4_kvx_unmap(struct dsv4_kvx *x, struct dsv4_kvx_map *m)
{
    if (m->data == NULL)
        return;
    x->ops->unmap(x, m);
    memset(m, 0, sizeof(*m));
}

int64_t
dsv4_kvx_tick(struct dsv4_kvx *x, int64_t now_ms)
{
    return x->ops->tick != NULL ? x->ops->tick(x, now_ms) : -1;
}

int
dsv4_kvx_cleanup_stale(struct dsv4_kvx *x)
{
    return x->ops->cleanup_stale(x);
}

void
dsv4_kvx_desc_to_loc(const struct dsv4_kvx_region *r, uint64_t len, uint32_t n_tokens,
                     uint64_t seg[2], struct dsv4_kv_loc *loc)
{
    seg[0] = len;
    seg[1] = 0;
    memset(loc, 0, sizeof(*loc));
    loc->part = 0;
    loc->n_parts = 1;
    loc->transport = r->desc.transport;
    loc->n_tokens = n_tokens;
    loc->sizes = &seg[0];
    loc->offsets = &seg[1];
    loc->n_seg = 1;
    loc->handle = r->desc.handle;
    loc->handle_len = r->desc.handle_len;
}

enum dsv4_err
dsv4_kvx_desc_from_loc(const struct dsv4_kv_loc *loc, struct dsv4_kvx_desc *d)
{
    uint64_t end = 0;

    memset(d, 0, sizeof(*d));
    if (loc->transport <= DSV4_TRANSPORT_NONE || loc->transport >= DSV4_TRANSPORT__COUNT)
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_desc: unknown transport");
    if (loc->handle == NULL || loc->handle_len == 0 || loc->handle_len > DSV4_KVX_MAX_HANDLE)
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_desc: handle of %u bytes",
                            (unsigned)loc->handle_len);
    if (loc->n_seg == 0 || loc->sizes == NULL || loc->offsets == NULL)
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_desc: no segments");
    for (uint32_t i = 0; i < loc->n_seg; i++) {
        uint64_t o = loc->offsets[i], s = loc->sizes[i];
        if (s > UINT64_MAX - o)
            return dsv4_err_set(DSV4_ERR_PROTO, "kvx_desc: segment %u overflows", (unsigned)i);
        if (o + s > end)
            end = o + s;
    }
    if (end == 0)
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_desc: empty region");
    d->transport = loc->transport;
    memcpy(d->handle, loc->handle, loc->handle_len);
    d->handle_len = loc->handle_len;
    d->size = end;
    return DSV4_OK;
}
