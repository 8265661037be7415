/*
 * test_kv_shm.c — the shm decode-state transport (ipc/kvxfer.h,
 * ipc/kv_shm.c): export/import round trip through the protocol's location
 * descriptor, a mapping that outlives the exporter's free, stale-object
 * cleanup after a crashed exporter (a child process), and malformed
 * descriptors that must give errors, never crashes.
 *
 * Owner tags carry the test's pid so parallel test runs do not collide.
 */
#include <sys/stat.h>
#include <sys/wait.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ipc/kvxfer.h"

/* True when /dev/shm holds the object named by the region's handle. */
static int
shm_exists(const struct dsv4_kvx_desc *d)
{
    char path[600];
    struct stat st;

    assert_true(d->handle_len > 1);
    snprintf(path, sizeof(path), "/dev/shm%.*s", (int)d->handle_len, (const char *)d->handle);
    return stat(path, &st) == 0;
}

static void
owner_tag(char *buf, size_t cap, const char *what)
{
    snprintf(buf, cap, "test%ld-%s", (long)getpid(), what);
}

/* Export, write, describe as a protocol location, import, compare. */
static void
test_round_trip(void **state)
{
    struct dsv4_kvx *x, *y;
    struct dsv4_kvx_region r;
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;
    struct dsv4_kv_loc loc;
    uint64_t seg[2];
    char owner[64];
    const uint64_t size = (1u << 20) + 123, used = (1u << 20) + 100;

    (void)state;
    owner_tag(owner, sizeof(owner), "rt");
    assert_int_equal(dsv4_kvx_open(&x, DSV4_TRANSPORT_SHM, owner), DSV4_OK);
    assert_int_equal(dsv4_kvx_open(&y, DSV4_TRANSPORT_SHM, "importer"), DSV4_OK);
    assert_int_equal(dsv4_kvx_export(x, 42, size, &r), DSV4_OK);
    assert_non_null(r.data);
    assert_int_equal(r.size, size);
    assert_int_equal(x->n_live, 1);
    for (uint64_t i = 0; i < size; i++)
        ((uint8_t *)r.data)[i] = (uint8_t)(i * 7 + 3);

    dsv4_kvx_desc_to_loc(&r, used, 17, seg, &loc);
    assert_int_equal(loc.n_parts, 1);
    assert_int_equal(loc.n_seg, 1);
    assert_int_equal(loc.sizes[0], used);
    assert_int_equal(loc.offsets[0], 0);
    assert_int_equal(loc.n_tokens, 17);
    assert_int_equal(loc.transport, DSV4_TRANSPORT_SHM);
    assert_int_equal(dsv4_kvx_desc_from_loc(&loc, &d), DSV4_OK);
    assert_int_equal(d.size, used);
    assert_true(shm_exists(&d));

    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_OK);
    assert_true(m.size >= used);
    assert_memory_equal(m.data, r.data, used);
    dsv4_kvx_unmap(y, &m);
    assert_null(m.data);
    dsv4_kvx_unmap(y, &m); /* idempotent */

    /* A second export for the same request gets a different name. */
    struct dsv4_kvx_region r2;
    assert_int_equal(dsv4_kvx_export(x, 42, 10, &r2), DSV4_OK);
    assert_false(r2.desc.handle_len == r.desc.handle_len &&
                 memcmp(r2.desc.handle, r.desc.handle, r.desc.handle_len) == 0);
    dsv4_kvx_free(x, &r2);

    dsv4_kvx_free(x, &r);
    assert_null(r.data);
    assert_int_equal(x->n_live, 0);
    assert_false(shm_exists(&d));
    /* Gone: importing the old descriptor is an error. */
    assert_int_equal(dsv4_kvx_import(y, &d, &m), DSV4_ERR_SYS);
    assert_null(m.data);
    dsv4_kvx_free(x, &r); /* idempotent */
    dsv4_kvx_close(y);
    dsv4_kvx_close(x);
}

/* The exporter frees (unlinks) while an importer still maps: the mapping
 * stays readable, the name is gone at once. */
static void
test_free_while_mapped(void **state)
{
    struct dsv4_kvx *x;
    struct dsv4_kvx_region r;
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;
    char owner[64];

    (void)state;
    owner_tag(owner, sizeof(owner), "fm");
    assert_int_equal(dsv4_kvx_open(&x, DSV4_TRANSPORT_SHM, owner), DSV4_OK);
    assert_int_equal(dsv4_kvx_export(x, 7, 4096, &r), DSV4_OK);
    memset(r.data, 0x5a, 4096);
    d = r.desc;
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_OK);
    dsv4_kvx_free(x, &r);
    assert_false(shm_exists(&d));
    for (int i = 0; i < 4096; i++)
        assert_int_equal(((const uint8_t *)m.data)[i], 0x5a);
    dsv4_kvx_unmap(x, &m);
    dsv4_kvx_close(x);
}

/* A child exports and dies without freeing; a new instance of the same owner
 * removes exactly those objects, not those of an owner that extends the tag. */
static void
test_stale_cleanup(void **state)
{
    char owner[48], other[64];
    struct dsv4_kvx *x, *o;
    struct dsv4_kvx_region keep;
    int fds[2], status;
    struct dsv4_kvx_desc left[2];
    pid_t pid;

    (void)state;
    owner_tag(owner, sizeof(owner), "st");
    snprintf(other, sizeof(other), "%s-1", owner);
    assert_int_equal(pipe(fds), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct dsv4_kvx *c;
        struct dsv4_kvx_region a, b;
        close(fds[0]);
        if (dsv4_kvx_open(&c, DSV4_TRANSPORT_SHM, owner) != DSV4_OK ||
            dsv4_kvx_export(c, 1, 100, &a) != DSV4_OK ||
            dsv4_kvx_export(c, 2, 200, &b) != DSV4_OK)
            _exit(1);
        if (write(fds[1], &a.desc, sizeof(a.desc)) != (ssize_t)sizeof(a.desc) ||
            write(fds[1], &b.desc, sizeof(b.desc)) != (ssize_t)sizeof(b.desc))
            _exit(1);
        _exit(0); /* crash: nothing freed */
    }
    close(fds[1]);
    assert_int_equal(read(fds[0], &left[0], sizeof(left[0])), (ssize_t)sizeof(left[0]));
    assert_int_equal(read(fds[0], &left[1], sizeof(left[1])), (ssize_t)sizeof(left[1]));
    close(fds[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_true(shm_exists(&left[0]));
    assert_true(shm_exists(&left[1]));

    assert_int_equal(dsv4_kvx_open(&o, DSV4_TRANSPORT_SHM, other), DSV4_OK);
    assert_int_equal(dsv4_kvx_export(o, 3, 300, &keep), DSV4_OK);

    assert_int_equal(dsv4_kvx_open(&x, DSV4_TRANSPORT_SHM, owner), DSV4_OK);
    assert_int_equal(dsv4_kvx_cleanup_stale(x), 2);
    assert_false(shm_exists(&left[0]));
    assert_false(shm_exists(&left[1]));
    assert_true(shm_exists(&keep.desc));
    assert_int_equal(dsv4_kvx_cleanup_stale(x), 0);
    left[0] = keep.desc;
    dsv4_kvx_free(o, &keep);
    assert_false(shm_exists(&left[0]));
    dsv4_kvx_close(o);
    dsv4_kvx_close(x);
}

static void
desc_set(struct dsv4_kvx_desc *d, const char *handle, uint64_t size)
{
    memset(d, 0, sizeof(*d));
    d->transport = DSV4_TRANSPORT_SHM;
    d->handle_len = (uint32_t)strlen(handle);
    memcpy(d->handle, handle, d->handle_len);
    d->size = size;
}

/* Malformed descriptors and locations are errors. */
static void
test_bad_descriptor(void **state)
{
    struct dsv4_kvx *x, *t;
    struct dsv4_kvx_region r;
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;
    struct dsv4_kv_loc loc;
    uint64_t sizes[2], offs[2];
    char owner[64];

    (void)state;
    owner_tag(owner, sizeof(owner), "bad");
    assert_int_equal(dsv4_kvx_open(&x, DSV4_TRANSPORT_SHM, owner), DSV4_OK);

    /* Owners and transports. */
    assert_int_equal(dsv4_kvx_open(&t, DSV4_TRANSPORT_SHM, ""), DSV4_ERR_INVAL);
    assert_int_equal(dsv4_kvx_open(&t, DSV4_TRANSPORT_SHM, "a/b"), DSV4_ERR_INVAL);
    assert_int_equal(dsv4_kvx_open(&t, DSV4_TRANSPORT_SHM, NULL), DSV4_ERR_INVAL);
    assert_int_equal(dsv4_kvx_open(&t, DSV4_TRANSPORT_CUDAIPC, "x"), DSV4_ERR_NOTSUP);
    assert_int_equal(dsv4_kvx_open(&t, DSV4_TRANSPORT_NONE, "x"), DSV4_ERR_INVAL);
    assert_int_equal(dsv4_kvx_export(x, 1, 0, &r), DSV4_ERR_INVAL);

    /* Handles that are not ours, malformed, or name nothing. */
    desc_set(&d, "/etc", 1);
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    desc_set(&d, "/dsv4kv-", 1);
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    desc_set(&d, "/dsv4kv-../../etc/passwd", 1);
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    desc_set(&d, "/dsv4kv-a b", 1);
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    desc_set(&d, "/dsv4kv-nosuchobject-1-1", 1);
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_SYS);
    /* a FIFO of that name (/dev/shm is every local user's): refused at once
     * as no region (the open blocked the rank's loop for ever); a directory
     * the same */
    {
        char fifo[128];

        snprintf(fifo, sizeof(fifo), "/dev/shm/dsv4kv-fifo%d-1-1", (int)getpid());
        assert_int_equal(mkfifo(fifo, 0600), 0);
        desc_set(&d, fifo + strlen("/dev/shm"), 1);
        assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
        assert_non_null(strstr(dsv4_errmsg(), "not a regular file"));
        unlink(fifo);
    }
    desc_set(&d, "/dsv4kv-x", 1);
    d.handle[3] = '\0';
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    desc_set(&d, "/dsv4kv-x", 1);
    d.handle_len = 0;
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    d.handle_len = DSV4_KVX_MAX_HANDLE + 1;
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    desc_set(&d, "/dsv4kv-x", 0);
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    desc_set(&d, "/dsv4kv-x", 1);
    d.transport = DSV4_TRANSPORT_UCX;
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    assert_null(m.data);

    /* A real region, but the descriptor claims more bytes than it has. */
    assert_int_equal(dsv4_kvx_export(x, 9, 1000, &r), DSV4_OK);
    d = r.desc;
    d.size = 1u << 20;
    assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_ERR_PROTO);
    assert_null(m.data);
    dsv4_kvx_free(x, &r);

    /* Locations: overflowing segment, no handle, no segments, bad transport. */
    dsv4_kvx_desc_to_loc(&r, 1, 1, sizes, &loc);
    loc.handle = (const uint8_t *)"/dsv4kv-x";
    loc.handle_len = 9;
    sizes[0] = UINT64_MAX;
    offs[0] = 2;
    loc.sizes = sizes;
    loc.offsets = offs;
    loc.transport = DSV4_TRANSPORT_SHM;
    assert_int_equal(dsv4_kvx_desc_from_loc(&loc, &d), DSV4_ERR_PROTO);
    sizes[0] = 0;
    offs[0] = 0;
    assert_int_equal(dsv4_kvx_desc_from_loc(&loc, &d), DSV4_ERR_PROTO);
    sizes[0] = 10;
    sizes[1] = 5;
    offs[1] = 100;
    loc.n_seg = 2;
    assert_int_equal(dsv4_kvx_desc_from_loc(&loc, &d), DSV4_OK);
    assert_int_equal(d.size, 105);
    loc.n_seg = 0;
    assert_int_equal(dsv4_kvx_desc_from_loc(&loc, &d), DSV4_ERR_PROTO);
    loc.n_seg = 1;
    loc.handle_len = 0;
    assert_int_equal(dsv4_kvx_desc_from_loc(&loc, &d), DSV4_ERR_PROTO);
    loc.handle_len = 9;
    loc.transport = DSV4_TRANSPORT__COUNT;
    assert_int_equal(dsv4_kvx_desc_from_loc(&loc, &d), DSV4_ERR_PROTO);
    dsv4_kvx_close(x);
}

/* A region's location rides in PREFILL_DONE and DECODE (docs/protocol.md
 * §6.2) and imports on the other side; DECODE's optional `step` survives. */
static void
test_protocol_location(void **state)
{
    struct dsv4_kvx *x;
    struct dsv4_kvx_region r;
    struct dsv4_kvx_desc d;
    struct dsv4_kvx_map m;
    struct dsv4_msg a, b;
    struct dsv4_wire w;
    struct dsv4_perr pe;
    struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES];
    uint64_t seg[2];
    char owner[64];

    (void)state;
    owner_tag(owner, sizeof(owner), "loc");
    assert_int_equal(dsv4_kvx_open(&x, DSV4_TRANSPORT_SHM, owner), DSV4_OK);
    assert_int_equal(dsv4_kvx_export(x, 5, 777, &r), DSV4_OK);
    memset(r.data, 0xc3, 777);

    for (int has_step = 0; has_step < 2; has_step++) {
        dsv4_msg_init(&a, DSV4_SUB_RANK, DSV4_RANK_DECODE);
        a.u.decode.req = 5;
        a.u.decode.slot = 3;
        a.u.decode.token = 11;
        a.u.decode.pos = 9;
        a.u.decode.max_tokens = 4;
        a.u.decode.step = 6;
        a.u.decode.has_step = has_step;
        a.u.decode.n_kv = 1;
        dsv4_kvx_desc_to_loc(&r, 700, 9, seg, &a.u.decode.kv[0]);
        assert_int_equal(dsv4_msg_encode(&a, &w, &pe), DSV4_OK);
        assert_int_equal(w.n_raw, 1);
        fr[0].data = "";
        fr[0].len = 0;
        fr[1].data = w.sig;
        fr[1].len = DSV4_PROTO_SIG_LEN;
        fr[2].data = &w.cmd;
        fr[2].len = 1;
        fr[3].data = w.body;
        fr[3].len = w.body_len;
        fr[4] = w.raw[0];
        assert_int_equal(dsv4_msg_decode(&b, fr, 5, &pe), DSV4_OK);
        assert_true(dsv4_msg_equal(&a, &b));
        assert_int_equal(b.u.decode.has_step, has_step);
        if (has_step)
            assert_int_equal(b.u.decode.step, 6);
        dsv4_wire_clear(&w);
        assert_int_equal(dsv4_kvx_desc_from_loc(&b.u.decode.kv[0], &d), DSV4_OK);
        dsv4_msg_clear(&b);
        assert_int_equal(d.size, 700);
        assert_int_equal(dsv4_kvx_import(x, &d, &m), DSV4_OK);
        assert_int_equal(((const uint8_t *)m.data)[699], 0xc3);
        dsv4_kvx_unmap(x, &m);
    }
    dsv4_kvx_free(x, &r);
    dsv4_kvx_close(x);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_free_while_mapped),
        cmocka_unit_test(test_stale_cleanup),
        cmocka_unit_test(test_bad_descriptor),
        cmocka_unit_test(test_protocol_location),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
