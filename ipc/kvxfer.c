/*
 * kvxfer.c — the transport-independent half of the decode-state transfer
 * layer (ipc/kvxfer.h): instance creation by transport, argument checks and
 * live-region accounting around the transport's ops, and the conversion
 * between a region and the protocol's KV location descriptor.
 *
 * Runs in a rank's main thread; no global state.
 */
#include "ipc/kvxfer.h"

#include <stdlib.h>
#include <string.h>

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

enum dsv4_err
dsv4_kvx_open(struct dsv4_kvx **out, enum dsv4_transport t, const char *owner)
{
    const struct dsv4_kvx_ops *ops;
    struct dsv4_kvx *x;

    *out = NULL;
    switch (t) {
    case DSV4_TRANSPORT_SHM:
        ops = &dsv4_kvx_shm_ops;
        break;
    case DSV4_TRANSPORT_CUDAIPC:
    case DSV4_TRANSPORT_UCX:
        return dsv4_err_set(DSV4_ERR_NOTSUP, "kvx_open: transport %s not built in",
                            dsv4_transport_name(t));
    default:
        return dsv4_err_set(DSV4_ERR_INVAL, "kvx_open: unknown transport %d", (int)t);
    }
    if (!kvx_owner_valid(owner))
        return dsv4_err_set(DSV4_ERR_INVAL, "kvx_open: bad owner tag");
    x = calloc(1, sizeof(*x));
    if (x == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "kvx_open: out of memory");
    x->ops = ops;
    x->transport = t;
    strcpy(x->owner, owner);
    *out = x;
    return DSV4_OK;
}

void
dsv4_kvx_close(struct dsv4_kvx *x)
{
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

enum dsv4_err
dsv4_kvx_import(struct dsv4_kvx *x, const struct dsv4_kvx_desc *d, struct dsv4_kvx_map *m)
{
    enum dsv4_err e;

    memset(m, 0, sizeof(*m));
    if (d->transport != x->transport)
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_import: descriptor transport %s, expected %s",
                            dsv4_transport_name(d->transport) != NULL ?
                                dsv4_transport_name(d->transport) : "?",
                            dsv4_transport_name(x->transport));
    if (d->handle_len == 0 || d->handle_len > DSV4_KVX_MAX_HANDLE || d->size == 0)
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_import: empty handle or region");
    e = x->ops->import_map(x, d, m);
    if (e != DSV4_OK) {
        memset(m, 0, sizeof(*m));
        return e;
    }
    if (m->size < d->size) {
        x->ops->unmap(x, m);
        memset(m, 0, sizeof(*m));
        return dsv4_err_set(DSV4_ERR_PROTO, "kvx_import: region has %llu bytes, descriptor "
                            "says %llu", (unsigned long long)m->size,
                            (unsigned long long)d->size);
    }
    return DSV4_OK;
}

void
dsv4_kvx_unmap(struct dsv4_kvx *x, struct dsv4_kvx_map *m)
{
    if (m->data == NULL)
        return;
    x->ops->unmap(x, m);
    memset(m, 0, sizeof(*m));
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
