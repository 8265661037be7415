/*
 * test_proto.c — protocol codec tests: round trip of every sample message,
 * golden encodings (tests/ipc/golden/<sample>.hex: one frame per line in hex,
 * "-" for an empty frame), malformed input of every kind, status-code table.
 *
 *   test_proto                       run the tests (golden dir from
 *                                    $DSV4_GOLDEN_DIR)
 *   test_proto --write-golden DIR    (re)write the golden files
 *   test_proto --write-corpus DIR    write fuzz seeds DIR/{cli,rank,ctl}/<sample>
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <msgpack.h>

#include "ipc/proto.h"
#include "tests/ipc/samples.h"

#define MAX_LINE (1 << 16)

/* Frames of an encoded message, delimiter included. */
static size_t
wire_frames(const struct dsv4_wire *w, struct dsv4_frame *fr)
{
    size_t n = 0;

    fr[n++] = (struct dsv4_frame){ "", 0 };
    fr[n++] = (struct dsv4_frame){ w->sig, DSV4_PROTO_SIG_LEN };
    fr[n++] = (struct dsv4_frame){ &w->cmd, 1 };
    fr[n++] = (struct dsv4_frame){ w->body, w->body_len };
    for (uint32_t i = 0; i < w->n_raw; i++)
        fr[n++] = w->raw[i];
    return n;
}

static void
encode_ok(const struct dsv4_msg *m, struct dsv4_wire *w)
{
    struct dsv4_perr pe;
    enum dsv4_err e = dsv4_msg_encode(m, w, &pe);

    if (e != DSV4_OK)
        fail_msg("encode %s: %s", dsv4_proto_cmd_name(m->sub, m->cmd), pe.message);
}

/* --- Round trip ----------------------------------------------------------- */

static void
test_roundtrip(void **state)
{
    (void)state;
    for (size_t i = 0; i < samples_count(); i++) {
        struct dsv4_msg m, d;
        struct dsv4_wire w, w2;
        struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES];
        struct dsv4_perr pe;
        const char *name = samples_get(i, &m);
        size_t n;

        encode_ok(&m, &w);
        n = wire_frames(&w, fr);
        if (dsv4_msg_decode(&d, fr, n, &pe) != DSV4_OK)
            fail_msg("decode %s: %s", name, pe.message);
        if (!dsv4_msg_equal(&m, &d))
            fail_msg("%s: decoded message differs", name);
        /* Re-encoding the decoded message gives the same bytes. */
        encode_ok(&d, &w2);
        assert_int_equal(w.body_len, w2.body_len);
        assert_memory_equal(w.body, w2.body, w.body_len);
        assert_int_equal(w.n_raw, w2.n_raw);
        dsv4_wire_clear(&w2);
        dsv4_msg_clear(&d);
        dsv4_wire_clear(&w);
    }
}

/* Decode one body of `cmd` (sub-protocol `sig`) into *m: the decode's
 * result, its refusal in *pe. */
static enum dsv4_err
try_decode_body(const char *sig, int cmd, const void *body, size_t body_len, struct dsv4_msg *m,
                struct dsv4_perr *pe)
{
    struct dsv4_frame fr[4];
    uint8_t c = (uint8_t)cmd;

    fr[0] = (struct dsv4_frame){ "", 0 };
    fr[1] = (struct dsv4_frame){ sig, strlen(sig) };
    fr[2] = (struct dsv4_frame){ &c, 1 };
    fr[3] = (struct dsv4_frame){ body, body_len };
    return dsv4_msg_decode(m, fr, 4, pe);
}

/* Decode one body of `cmd` (sub-protocol `sig`) into *m; fails the test on error. */
static void
decode_body(const char *sig, int cmd, const void *body, size_t body_len, struct dsv4_msg *m)
{
    struct dsv4_perr pe;

    if (try_decode_body(sig, cmd, body, body_len, m, &pe) != DSV4_OK)
        fail_msg("decode %s command %d: %s", sig, cmd, pe.message);
}

static void
pk_u64(msgpack_packer *pk, const char *key, uint64_t v)
{
    msgpack_pack_str(pk, strlen(key));
    msgpack_pack_str_body(pk, key, strlen(key));
    msgpack_pack_uint64(pk, v);
}

/* Decode the HEARTBEAT body {"active": active[, "mtp_drafts": drafts]
 * [, "mtp_accepted": accepted]} (-1: no key) into *d: the decode's result,
 * its refusal in *pe. */
static enum dsv4_err
heartbeat_body(uint64_t active, int64_t drafts, int64_t accepted, struct dsv4_msg *d,
               struct dsv4_perr *pe)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    enum dsv4_err e;

    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 1 + (drafts >= 0) + (accepted >= 0));
    pk_u64(&pk, "active", active);
    if (drafts >= 0)
        pk_u64(&pk, "mtp_drafts", (uint64_t)drafts);
    if (accepted >= 0)
        pk_u64(&pk, "mtp_accepted", (uint64_t)accepted);
    e = try_decode_body(dsv4_proto_sig(DSV4_SUB_RANK), DSV4_RANK_HEARTBEAT, sb.data, sb.size, d,
                        pe);
    msgpack_sbuffer_destroy(&sb);
    return e;
}

/* Encode *m and decode it into *d; true iff the body carries an "mtp_" key. */
static bool
mtp_trip(const struct dsv4_msg *m, struct dsv4_msg *d)
{
    struct dsv4_wire w;
    bool has_key;

    encode_ok(m, &w);
    has_key = memmem(w.body, w.body_len, "mtp_", 4) != NULL;
    decode_body(dsv4_proto_sig(m->sub), m->cmd, w.body, w.body_len, d);
    dsv4_wire_clear(&w);
    return has_key;
}

/*
 * The optional MTP counters of HEARTBEAT, RANK and STATUS: a body of an older
 * peer without them decodes to zeros with has_mtp false; with them they come
 * back exactly (values above 2^32 included); has_mtp false puts no key on the
 * wire; a lone counter, or more accepted than proposed, is refused (401; a
 * lone mtp_drafts was taken with mtp_accepted 0).
 */
static void
test_mtp_counters(void **state)
{
    struct dsv4_msg m, d;
    struct dsv4_perr pe;

    (void)state;
    /* an old HEARTBEAT: {"active": 3} */
    assert_int_equal(heartbeat_body(3, -1, -1, &d, &pe), DSV4_OK);
    assert_int_equal(d.u.heartbeat.active, 3);
    assert_false(d.u.heartbeat.has_mtp);
    assert_int_equal(d.u.heartbeat.mtp_drafts, 0);
    assert_int_equal(d.u.heartbeat.mtp_accepted, 0);
    dsv4_msg_clear(&d);

    /* one counter alone, more accepted than proposed: refused, 401 */
    assert_int_equal(heartbeat_body(0, 77, -1, &d, &pe), DSV4_ERR_INVAL);
    assert_int_equal(pe.code, 401);
    assert_non_null(strstr(pe.message, "mtp_drafts without mtp_accepted"));
    assert_int_equal(heartbeat_body(0, -1, 5, &d, &pe), DSV4_ERR_INVAL);
    assert_non_null(strstr(pe.message, "mtp_accepted without mtp_drafts"));
    assert_int_equal(heartbeat_body(0, 3, 7, &d, &pe), DSV4_ERR_INVAL);
    assert_non_null(strstr(pe.message, "mtp_accepted 7 > mtp_drafts 3"));
    assert_int_equal(heartbeat_body(0, 7, 7, &d, &pe), DSV4_OK);
    assert_true(d.u.heartbeat.has_mtp && d.u.heartbeat.mtp_accepted == 7);
    dsv4_msg_clear(&d);

    /* with the counters: exact values back; without: no key, zeros */
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
    m.u.heartbeat.mtp_drafts = (1ull << 40) + 7;
    m.u.heartbeat.mtp_accepted = (1ull << 33) + 1;
    m.u.heartbeat.has_mtp = true;
    assert_true(mtp_trip(&m, &d));
    assert_true(d.u.heartbeat.has_mtp);
    assert_true(d.u.heartbeat.mtp_drafts == (1ull << 40) + 7);
    assert_true(d.u.heartbeat.mtp_accepted == (1ull << 33) + 1);
    dsv4_msg_clear(&d);
    m.u.heartbeat.has_mtp = false;
    assert_false(mtp_trip(&m, &d));
    assert_false(d.u.heartbeat.has_mtp);
    assert_true(d.u.heartbeat.mtp_drafts == 0 && d.u.heartbeat.mtp_accepted == 0);
    dsv4_msg_clear(&d);

    /* RANK and STATUS: same keys, same rule */
    dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_RANK);
    m.u.rank.role = DSV4_ROLE_DECODE;
    m.u.rank.host = "h";
    m.u.rank.state = DSV4_RANK_STATE_READY;
    m.u.rank.mtp_drafts = 10;
    m.u.rank.mtp_accepted = 4;
    m.u.rank.has_mtp = true;
    assert_true(mtp_trip(&m, &d));
    assert_true(d.u.rank.has_mtp);
    assert_true(d.u.rank.mtp_drafts == 10 && d.u.rank.mtp_accepted == 4);
    dsv4_msg_clear(&d);
    m.u.rank.has_mtp = false;
    assert_false(mtp_trip(&m, &d));
    assert_false(d.u.rank.has_mtp);
    assert_true(d.u.rank.mtp_drafts == 0 && d.u.rank.mtp_accepted == 0);
    dsv4_msg_clear(&d);

    dsv4_msg_init(&m, DSV4_SUB_CTL, DSV4_CTL_STATUS);
    m.u.status.version = "v";
    m.u.status.mtp_drafts = 8;
    m.u.status.mtp_accepted = 8;
    m.u.status.has_mtp = true;
    assert_true(mtp_trip(&m, &d));
    assert_true(d.u.status.has_mtp);
    assert_true(d.u.status.mtp_drafts == 8 && d.u.status.mtp_accepted == 8);
    dsv4_msg_clear(&d);
}

/* Decode a rank-protocol body of `cmd` made of the `n` (key, value) pairs;
 * returns the status code (200 when it decoded; then *d holds it). */
static uint16_t
rank_body_code(int cmd, const char *const *keys, const uint64_t *vals, int n,
    struct dsv4_msg *d)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    struct dsv4_frame fr[4];
    struct dsv4_perr pe;
    uint8_t c = (uint8_t)cmd;
    uint16_t code = 200;

    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, (size_t)n);
    for (int i = 0; i < n; i++)
        pk_u64(&pk, keys[i], vals[i]);
    fr[0] = (struct dsv4_frame){ "", 0 };
    fr[1] = (struct dsv4_frame){ DSV4_PROTO_SIG_RANK, DSV4_PROTO_SIG_LEN };
    fr[2] = (struct dsv4_frame){ &c, 1 };
    fr[3] = (struct dsv4_frame){ sb.data, sb.size };
    if (dsv4_msg_decode(d, fr, 4, &pe) != DSV4_OK)
        code = pe.code;
    msgpack_sbuffer_destroy(&sb);
    return code;
}

static void
pk_key(msgpack_packer *pk, const char *key)
{
    msgpack_pack_str(pk, strlen(key));
    msgpack_pack_str_body(pk, key, strlen(key));
}

/* Decode the packed body sb of (sub, cmd) and free sb: 200 or the decode's
 * refusal code, the message in *pe. */
static uint16_t
packed_code(enum dsv4_sub sub, int cmd, msgpack_sbuffer *sb, struct dsv4_perr *pe)
{
    struct dsv4_msg d;
    uint16_t code = 200;

    if (try_decode_body(dsv4_proto_sig(sub), cmd, sb->data, sb->size, &d, pe) != DSV4_OK)
        code = pe->code;
    else
        dsv4_msg_clear(&d);
    msgpack_sbuffer_destroy(sb);
    return code;
}

/*
 * Values the docs rule out that were taken (review; the encoder refuses
 * them, so the bodies are packed here): a rank TOKENS req of 0 (§6.1:
 * 1 ... 2^64-1), a COMM comm_id of no bytes (forwarded to a whole group,
 * which then never joined), resume_text without resume.
 */
static void
test_cross_checks(void **state)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    struct dsv4_perr pe;

    (void)state;
    for (uint64_t second = 0; second <= 9; second += 9) {   /* {step, reqs [7, r], tokens} */
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 3);
        pk_u64(&pk, "step", 0);
        pk_key(&pk, "reqs");
        msgpack_pack_array(&pk, 2);
        msgpack_pack_uint64(&pk, 7);
        msgpack_pack_uint64(&pk, second);
        pk_key(&pk, "tokens");
        msgpack_pack_array(&pk, 2);
        msgpack_pack_int32(&pk, 5);
        msgpack_pack_int32(&pk, 6);
        if (second == 0) {
            assert_int_equal(packed_code(DSV4_SUB_RANK, DSV4_RANK_TOKENS, &sb, &pe), 401);
            assert_non_null(strstr(pe.message, "reqs[1] is 0"));
        } else {
            assert_int_equal(packed_code(DSV4_SUB_RANK, DSV4_RANK_TOKENS, &sb, &pe), 200);
        }
    }
    for (uint32_t len = 0; len <= 1; len++) {   /* {comm_epoch, comm_id bin(len)} */
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 2);
        pk_u64(&pk, "comm_epoch", 3);
        pk_key(&pk, "comm_id");
        msgpack_pack_bin(&pk, len);
        msgpack_pack_bin_body(&pk, "x", len);
        assert_int_equal(packed_code(DSV4_SUB_RANK, DSV4_RANK_COMM, &sb, &pe),
                         len == 0 ? 401 : 200);
    }
    for (int with_resume = 0; with_resume <= 1; with_resume++) {
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 3 + 2 * with_resume);
        pk_u64(&pk, "id", 1);
        pk_key(&pk, "tokens");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_int32(&pk, 3);
        pk_u64(&pk, "resume_text", 4);
        if (with_resume) {
            pk_u64(&pk, "seed", 5);
            pk_key(&pk, "resume");
            msgpack_pack_array(&pk, 1);
            msgpack_pack_int32(&pk, 3);
        }
        if (!with_resume) {
            assert_int_equal(packed_code(DSV4_SUB_CLI, DSV4_CLI_GENERATE, &sb, &pe), 401);
            assert_non_null(strstr(pe.message, "resume_text without resume"));
        } else {
            assert_int_equal(packed_code(DSV4_SUB_CLI, DSV4_CLI_GENERATE, &sb, &pe), 200);
        }
    }
}

/*
 * GROUP_BROKEN and HEARTBEAT's comm_epoch: the three keys of GROUP_BROKEN
 * are required and range-checked, its reason is optional, unknown keys are
 * ignored; a HEARTBEAT of an older rank (no comm_epoch) decodes with
 * has_comm_epoch false, and has_comm_epoch false puts no key on the wire.
 */
static void
test_group_broken(void **state)
{
    static const char *const k3[] = { "group", "group_rank", "comm_epoch", "later" };
    uint64_t v[] = { 2, 1, 9, 5 };
    struct dsv4_msg m, d;
    struct dsv4_perr pe;
    struct dsv4_wire w;

    (void)state;
    assert_string_equal(dsv4_proto_cmd_name(DSV4_SUB_RANK, DSV4_RANK_GROUP_BROKEN),
        "GROUP_BROKEN");
    assert_int_equal(rank_body_code(DSV4_RANK_GROUP_BROKEN, k3, v, 4, &d), 200);
    assert_int_equal(d.u.broken.group, 2);
    assert_int_equal(d.u.broken.group_rank, 1);
    assert_int_equal(d.u.broken.comm_epoch, 9);
    assert_null(d.u.broken.reason);
    dsv4_msg_clear(&d);
    /* each required key missing: 400 */
    for (int skip = 0; skip < 3; skip++) {
        const char *keys[2];
        uint64_t vals[2];
        int n = 0;

        for (int i = 0; i < 3; i++) {
            if (i == skip)
                continue;
            keys[n] = k3[i];
            vals[n++] = v[i];
        }
        assert_int_equal(rank_body_code(DSV4_RANK_GROUP_BROKEN, keys, vals, 2, &d), 400);
    }
    /* a group number past 65535: 401 */
    v[0] = 65536;
    assert_int_equal(rank_body_code(DSV4_RANK_GROUP_BROKEN, k3, v, 3, &d), 401);

    /* HEARTBEAT: an older rank's body has no comm_epoch */
    assert_int_equal(heartbeat_body(4, -1, -1, &d, &pe), DSV4_OK);
    assert_false(d.u.heartbeat.has_comm_epoch);
    assert_int_equal(d.u.heartbeat.comm_epoch, 0);
    dsv4_msg_clear(&d);
    dsv4_msg_init(&m, DSV4_SUB_RANK, DSV4_RANK_HEARTBEAT);
    m.u.heartbeat.comm_epoch = 0;
    m.u.heartbeat.has_comm_epoch = true;
    encode_ok(&m, &w);
    assert_non_null(memmem(w.body, w.body_len, "comm_epoch", 10));
    decode_body(DSV4_PROTO_SIG_RANK, DSV4_RANK_HEARTBEAT, w.body, w.body_len, &d);
    assert_true(d.u.heartbeat.has_comm_epoch);
    assert_int_equal(d.u.heartbeat.comm_epoch, 0);
    dsv4_msg_clear(&d);
    dsv4_wire_clear(&w);
    m.u.heartbeat.comm_epoch = 12;
    m.u.heartbeat.has_comm_epoch = false;
    encode_ok(&m, &w);
    assert_null(memmem(w.body, w.body_len, "comm_epoch", 10));
    dsv4_wire_clear(&w);
}

/* Every command of every sub-protocol has a sample. */
static void
test_coverage(void **state)
{
    static const int n_cmd[DSV4_SUB__COUNT] = {
        [DSV4_SUB_CLI] = DSV4_CLI__COUNT,
        [DSV4_SUB_RANK] = DSV4_RANK__COUNT,
        [DSV4_SUB_CTL] = DSV4_CTL__COUNT,
    };

    (void)state;
    for (int s = DSV4_SUB_CLI; s < DSV4_SUB__COUNT; s++) {
        for (int c = 1; c < n_cmd[s]; c++) {
            bool found = false;

            for (size_t i = 0; i < samples_count() && !found; i++) {
                struct dsv4_msg m;

                samples_get(i, &m);
                found = (int)m.sub == s && m.cmd == c;
            }
            if (!found)
                fail_msg("no sample for %s %s", dsv4_proto_sig((enum dsv4_sub)s),
                    dsv4_proto_cmd_name((enum dsv4_sub)s, c));
        }
    }
}

/* --- Golden files ------------------------------------------------------- */

static const char *
golden_dir(void)
{
    const char *d = getenv("DSV4_GOLDEN_DIR");

    return d != NULL ? d : "tests/ipc/golden";
}

static int
hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* Read a golden file into frames (buffers malloc'd into bufs). */
static size_t
golden_read(const char *name, struct dsv4_frame *fr, uint8_t **bufs)
{
    char path[4096];
    char *line = malloc(MAX_LINE);
    size_t n = 0;
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s.hex", golden_dir(), name);
    if ((f = fopen(path, "r")) == NULL)
        fail_msg("%s: %s", path, strerror(errno));
    while (fgets(line, MAX_LINE, f) != NULL && n < DSV4_PROTO_MAX_FRAMES) {
        size_t len = strcspn(line, "\n");
        uint8_t *b = malloc(len / 2 + 1);

        if (len == 1 && line[0] == '-')
            len = 0;
        if (len % 2 != 0)
            fail_msg("%s: odd hex line", path);
        for (size_t k = 0; k < len / 2; k++) {
            int hi = hexval(line[2 * k]), lo = hexval(line[2 * k + 1]);

            if (hi < 0 || lo < 0)
                fail_msg("%s: bad hex", path);
            b[k] = (uint8_t)(hi << 4 | lo);
        }
        bufs[n] = b;
        fr[n].data = b;
        fr[n].len = len / 2;
        n++;
    }
    fclose(f);
    free(line);
    return n;
}

static void
test_golden(void **state)
{
    (void)state;
    for (size_t i = 0; i < samples_count(); i++) {
        struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES], gf[DSV4_PROTO_MAX_FRAMES];
        uint8_t *bufs[DSV4_PROTO_MAX_FRAMES];
        struct dsv4_msg m, d;
        struct dsv4_wire w;
        struct dsv4_perr pe;
        const char *name = samples_get(i, &m);
        size_t n, gn;

        encode_ok(&m, &w);
        n = wire_frames(&w, fr);
        gn = golden_read(name, gf, bufs);
        if (gn != n)
            fail_msg("%s: %zu frames, golden has %zu", name, n, gn);
        for (size_t k = 0; k < n; k++) {
            if (fr[k].len != gf[k].len || memcmp(fr[k].data, gf[k].data, fr[k].len) != 0)
                fail_msg("%s: frame %zu differs from the golden encoding", name, k);
        }
        if (dsv4_msg_decode(&d, gf, gn, &pe) != DSV4_OK)
            fail_msg("decode golden %s: %s", name, pe.message);
        if (!dsv4_msg_equal(&m, &d))
            fail_msg("%s: decoded golden differs from the sample", name);
        dsv4_msg_clear(&d);
        dsv4_wire_clear(&w);
        for (size_t k = 0; k < gn; k++)
            free(bufs[k]);
    }
}

static int
write_golden(const char *dir)
{
    for (size_t i = 0; i < samples_count(); i++) {
        struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES];
        struct dsv4_msg m;
        struct dsv4_wire w;
        struct dsv4_perr pe;
        const char *name = samples_get(i, &m);
        char path[4096];
        size_t n;
        FILE *f;

        if (dsv4_msg_encode(&m, &w, &pe) != DSV4_OK) {
            fprintf(stderr, "%s: %s\n", name, pe.message);
            return 1;
        }
        n = wire_frames(&w, fr);
        snprintf(path, sizeof(path), "%s/%s.hex", dir, name);
        if ((f = fopen(path, "w")) == NULL) {
            perror(path);
            return 1;
        }
        for (size_t k = 0; k < n; k++) {
            if (fr[k].len == 0)
                fputc('-', f);
            for (size_t b = 0; b < fr[k].len; b++)
                fprintf(f, "%02x", ((const uint8_t *)fr[k].data)[b]);
            fputc('\n', f);
        }
        fclose(f);
        dsv4_wire_clear(&w);
    }
    return 0;
}

/* Fuzz seed format (tests/fuzz/fuzz_proto.c): frames after the signature,
 * each as a 2-byte little-endian length and its bytes. */
static void
put_frame(FILE *f, const void *p, size_t len)
{
    fputc((int)(len & 0xff), f);
    fputc((int)((len >> 8) & 0xff), f);
    fwrite(p, 1, len, f);
}

static int
write_corpus(const char *dir)
{
    static const char *const subdir[DSV4_SUB__COUNT] = {
        [DSV4_SUB_CLI] = "cli", [DSV4_SUB_RANK] = "rank", [DSV4_SUB_CTL] = "ctl",
    };

    for (size_t i = 0; i < samples_count(); i++) {
        struct dsv4_msg m;
        struct dsv4_wire w;
        struct dsv4_perr pe;
        const char *name = samples_get(i, &m);
        char path[4096];
        FILE *f;

        if (dsv4_msg_encode(&m, &w, &pe) != DSV4_OK)
            return 1;
        snprintf(path, sizeof(path), "%s/%s/%s", dir, subdir[m.sub], name);
        if ((f = fopen(path, "wb")) == NULL) {
            perror(path);
            return 1;
        }
        put_frame(f, &w.cmd, 1);
        put_frame(f, w.body, w.body_len);
        for (uint32_t k = 0; k < w.n_raw; k++)
            put_frame(f, w.raw[k].data, w.raw[k].len);
        fclose(f);
        dsv4_wire_clear(&w);
    }
    return 0;
}

/* --- Malformed input ------------------------------------------------------ */

/* Decode [delim, sig, cmd, body, raw...]; return the status code (200 = ok). */
static int
decode_code(const char *sig, int cmd, const void *body, size_t body_len, size_t n_raw,
    struct dsv4_perr *pe_out)
{
    struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES + 4];
    uint8_t c = (uint8_t)cmd;
    struct dsv4_perr pe;
    struct dsv4_msg m;
    size_t n = 0;
    enum dsv4_err e;

    fr[n++] = (struct dsv4_frame){ "", 0 };
    fr[n++] = (struct dsv4_frame){ sig, strlen(sig) };
    fr[n++] = (struct dsv4_frame){ &c, 1 };
    fr[n++] = (struct dsv4_frame){ body, body_len };
    for (size_t i = 0; i < n_raw; i++)
        fr[n++] = (struct dsv4_frame){ "handle", 6 };
    e = dsv4_msg_decode(&m, fr, n, &pe);
    if (pe_out != NULL)
        *pe_out = pe;
    if (e == DSV4_OK) {
        dsv4_msg_clear(&m);
        return 200;
    }
    assert_true(pe.code >= 400 && pe.code < 600);
    assert_true(pe.message[0] != '\0');
    assert_null(m.mem);
    return pe.code;
}

static void
pk_str(msgpack_packer *pk, const char *s)
{
    msgpack_pack_str(pk, strlen(s));
    msgpack_pack_str_body(pk, s, strlen(s));
}

/*
 * Build a GENERATE body {"id": 7, "prompt": "hi", KEY: value} where the value
 * is packed by `val` (KEY NULL: no extra key; KEY "prompt"/"id": replaces it).
 */
static int
generate_with(const char *key, void (*val)(msgpack_packer *), struct dsv4_perr *pe)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    bool own_prompt = key != NULL && strcmp(key, "prompt") == 0;
    bool own_id = key != NULL && strcmp(key, "id") == 0;
    int code;

    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 2 + (key != NULL) - own_prompt - own_id);
    if (!own_id) {
        pk_str(&pk, "id");
        msgpack_pack_uint64(&pk, 7);
    }
    if (!own_prompt) {
        pk_str(&pk, "prompt");
        pk_str(&pk, "hi");
    }
    if (key != NULL) {
        pk_str(&pk, key);
        val(&pk);
    }
    code = decode_code(DSV4_PROTO_SIG_CLI, DSV4_CLI_GENERATE, sb.data, sb.size, 0, pe);
    msgpack_sbuffer_destroy(&sb);
    return code;
}

static void v_str_x(msgpack_packer *pk) { pk_str(pk, "x"); }
static void v_true(msgpack_packer *pk) { msgpack_pack_true(pk); }
static void v_nil(msgpack_packer *pk) { msgpack_pack_nil(pk); }
static void v_int0(msgpack_packer *pk) { msgpack_pack_int(pk, 0); }
static void v_int1(msgpack_packer *pk) { msgpack_pack_int(pk, 1); }
static void v_neg1(msgpack_packer *pk) { msgpack_pack_int(pk, -1); }
static void v_f11(msgpack_packer *pk) { msgpack_pack_double(pk, 11.0); }
static void v_f07(msgpack_packer *pk) { msgpack_pack_double(pk, 0.7); }
static void v_nan(msgpack_packer *pk) { msgpack_pack_double(pk, NAN); }
static void v_big(msgpack_packer *pk) { msgpack_pack_uint64(pk, 1u << 21); }
static void v_u64max(msgpack_packer *pk) { msgpack_pack_uint64(pk, UINT64_MAX); }
static void v_bad_utf8(msgpack_packer *pk) { msgpack_pack_str(pk, 2); msgpack_pack_str_body(pk, "\xc0\xaf", 2); }
static void v_nul(msgpack_packer *pk) { msgpack_pack_str(pk, 3); msgpack_pack_str_body(pk, "a\0b", 3); }
static void v_map(msgpack_packer *pk) { msgpack_pack_map(pk, 0); }

static void
v_17_stops(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 17);
    for (int i = 0; i < 17; i++)
        pk_str(pk, "s");
}

static void
v_long_stop(msgpack_packer *pk)
{
    char s[DSV4_PROTO_MAX_STOP_BYTES + 2];

    memset(s, 'a', sizeof(s) - 1);
    s[sizeof(s) - 1] = '\0';
    msgpack_pack_array(pk, 1);
    pk_str(pk, s);
}

static void v_empty_stop(msgpack_packer *pk) { msgpack_pack_array(pk, 1); pk_str(pk, ""); }

static void
v_ids_neg(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 2);
    msgpack_pack_int(pk, 5);
    msgpack_pack_int(pk, -3);
}

static void
v_ids_65(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 65);
    for (int i = 0; i < 65; i++)
        msgpack_pack_int(pk, i);
}

static void
v_huge_prompt(msgpack_packer *pk)
{
    size_t n = DSV4_PROTO_MAX_PROMPT_BYTES + 1;
    char *s = malloc(n);

    memset(s, 'a', n);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
    free(s);
}

/* A double that is > 0 but 0 as a float. */
static void v_tiny(msgpack_packer *pk) { msgpack_pack_double(pk, 1e-50); }

/* 1M arrays of 15 small ints under an unknown key: 16M objects in ~16 MB. */
static void
v_many_objects(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1u << 20);
    for (int i = 0; i < 1 << 20; i++) {
        msgpack_pack_array(pk, 15);
        for (int j = 0; j < 15; j++)
            msgpack_pack_int(pk, 0);
    }
}

static void
v_deep(msgpack_packer *pk)
{
    for (int i = 0; i < 8; i++)
        msgpack_pack_array(pk, 1);
    msgpack_pack_int(pk, 1);
}

static void
test_malformed_values(void **state)
{
    struct dsv4_perr pe;

    (void)state;
    assert_int_equal(generate_with(NULL, NULL, NULL), 200);
    assert_int_equal(generate_with("max_tokens", v_str_x, NULL), 400);   /* wrong type */
    assert_int_equal(generate_with("temperature", v_true, NULL), 400);
    assert_int_equal(generate_with("stream", v_int1, NULL), 400);
    assert_int_equal(generate_with("top_k", v_nil, NULL), 400);         /* nil */
    assert_int_equal(generate_with("stop", v_map, NULL), 400);
    assert_int_equal(generate_with("temperature", v_f11, NULL), 401);   /* out of range */
    assert_int_equal(generate_with("temperature", v_nan, NULL), 401);
    assert_int_equal(generate_with("top_p", v_int0, NULL), 401);        /* exclusive bound */
    assert_int_equal(generate_with("max_tokens", v_int0, NULL), 401);
    assert_int_equal(generate_with("max_tokens", v_big, NULL), 401);
    assert_int_equal(generate_with("timeout_ms", v_neg1, NULL), 401);
    assert_int_equal(generate_with("id", v_int0, NULL), 401);
    assert_int_equal(generate_with("stop_ids", v_ids_neg, NULL), 401);
    assert_int_equal(generate_with("stop", v_empty_stop, NULL), 401);
    assert_int_equal(generate_with("stop", v_17_stops, NULL), 413);     /* limits */
    assert_int_equal(generate_with("stop", v_long_stop, NULL), 413);
    assert_int_equal(generate_with("stop_ids", v_ids_65, NULL), 413);
    assert_int_equal(generate_with("prompt", v_huge_prompt, NULL), 413);
    assert_int_equal(generate_with("prompt", v_bad_utf8, NULL), 400);   /* bad text */
    assert_int_equal(generate_with("tag", v_nul, NULL), 400);
    assert_int_equal(generate_with("x_future", v_deep, NULL), 400);     /* too deep */
    /* checked as the float it becomes (0 would be sent on and refused) */
    assert_int_equal(generate_with("top_p", v_tiny, NULL), 401);
    /* too many objects in all, however small each array */
    assert_int_equal(generate_with("x_future", v_many_objects, NULL), 413);
    assert_int_equal(generate_with("tokens", v_ids_neg, NULL), 401);    /* both given */
    /* Accepted: unknown keys, ints for reals, float64, the largest id. */
    assert_int_equal(generate_with("x_future", v_str_x, NULL), 200);
    assert_int_equal(generate_with("temperature", v_int1, NULL), 200);
    assert_int_equal(generate_with("temperature", v_f07, NULL), 200);
    assert_int_equal(generate_with("id", v_u64max, NULL), 200);
    /* The id of a refused message is recovered for the ERROR reply. */
    assert_int_equal(generate_with("max_tokens", v_int0, &pe), 401);
    assert_int_equal(pe.id, 7);
    assert_int_equal(pe.sub, DSV4_SUB_CLI);
    assert_int_equal(pe.cmd, DSV4_CLI_GENERATE);
}

static void
test_malformed_framing(void **state)
{
    /* {"id": 1, "prompt": "x"} */
    static const uint8_t ok[] = { 0x82, 0xa2, 'i', 'd', 0x01, 0xa6, 'p', 'r', 'o', 'm', 'p', 't',
        0xa1, 'x' };
    static const uint8_t dup[] = { 0x83, 0xa2, 'i', 'd', 0x01, 0xa2, 'i', 'd', 0x02, 0xa6, 'p',
        'r', 'o', 'm', 'p', 't', 0xa1, 'x' };
    static const uint8_t trailing[] = { 0x82, 0xa2, 'i', 'd', 0x01, 0xa6, 'p', 'r', 'o', 'm',
        'p', 't', 0xa1, 'x', 0xc0 };
    static const uint8_t array_body[] = { 0x91, 0x01 };
    static const uint8_t int_key[] = { 0x81, 0x01, 0x01 };
    static const uint8_t no_id[] = { 0x81, 0xa6, 'p', 'r', 'o', 'm', 'p', 't', 0xa1, 'x' };
    /* {"id": 1, "tokens": array32 claiming 2^32-1 elements} */
    static const uint8_t huge_array[] = { 0x82, 0xa2, 'i', 'd', 0x01, 0xa6, 't', 'o', 'k', 'e',
        'n', 's', 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01 };
    /* map32 claiming 2^31 pairs */
    static const uint8_t huge_map[] = { 0xdf, 0x80, 0x00, 0x00, 0x00, 0x01, 0x01 };
    static const uint8_t ext[] = { 0x81, 0xa1, 'x', 0xd4, 0x01, 0x00 };
    static const uint8_t empty_map[] = { 0x80 };
    struct dsv4_perr pe;

    (void)state;
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, ok, sizeof(ok), 0, NULL), 200);
    /* Every truncation of a valid body is refused. */
    for (size_t len = 0; len < sizeof(ok); len++)
        assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, ok, len, 0, NULL), 400);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, dup, sizeof(dup), 0, NULL), 400);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, trailing, sizeof(trailing), 0, NULL),
        400);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, array_body, sizeof(array_body), 0,
        NULL), 400);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, int_key, sizeof(int_key), 0, NULL),
        400);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, no_id, sizeof(no_id), 0, NULL), 400);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, huge_array, sizeof(huge_array), 0,
        NULL), 413);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, huge_map, sizeof(huge_map), 0, NULL),
        413);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, ext, sizeof(ext), 0, NULL), 400);
    /* Unknown commands, wrong signatures, versions. */
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 0, ok, sizeof(ok), 0, &pe), 400);
    assert_int_equal(pe.sub, DSV4_SUB_CLI);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, DSV4_CLI__COUNT, ok, sizeof(ok), 0, NULL),
        400);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CTL, 200, empty_map, 1, 0, NULL), 400);
    assert_int_equal(decode_code("DSV4C2", 1, ok, sizeof(ok), 0, &pe), 400);
    assert_int_equal(pe.sub, DSV4_SUB_NONE);
    assert_int_equal(decode_code("DSV4X1", 1, ok, sizeof(ok), 0, NULL), 400);
    assert_int_equal(decode_code("DSV4C", 1, ok, sizeof(ok), 0, NULL), 400);
    assert_int_equal(decode_code("DSV4C1x", 1, ok, sizeof(ok), 0, NULL), 400);
    /* Raw frames where none are allowed; too many frames. */
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, ok, sizeof(ok), 1, NULL), 400);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CLI, 1, ok, sizeof(ok), DSV4_PROTO_MAX_RAW + 1,
        NULL), 413);
    /* Empty-body commands accept only a map. */
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CTL, DSV4_CTL_SHOW_STATUS, empty_map, 1, 0,
        NULL), 200);
    assert_int_equal(decode_code(DSV4_PROTO_SIG_CTL, DSV4_CTL_SHOW_STATUS, array_body,
        sizeof(array_body), 0, NULL), 400);
}

static void
test_malformed_frames(void **state)
{
    struct dsv4_frame fr[4] = { { "x", 1 }, { DSV4_PROTO_SIG_CLI, 6 }, { "\x07", 1 },
        { "\x80", 1 } };
    struct dsv4_msg m;
    struct dsv4_perr pe;

    (void)state;
    /* Non-empty delimiter, too few frames, two-byte command. */
    assert_int_equal(dsv4_msg_decode(&m, fr, 4, &pe), DSV4_ERR_PROTO);
    fr[0].len = 0;
    assert_int_equal(dsv4_msg_decode(&m, fr, 4, &pe), DSV4_OK);
    dsv4_msg_clear(&m);
    assert_int_equal(dsv4_msg_decode(&m, fr, 3, &pe), DSV4_ERR_PROTO);
    assert_int_equal(dsv4_msg_decode(&m, fr, 0, &pe), DSV4_ERR_PROTO);
    fr[2].len = 2;
    fr[2].data = "\x07\x00";
    assert_int_equal(dsv4_msg_decode(&m, fr, 4, &pe), DSV4_ERR_PROTO);
}

/* Cross-field checks on messages with KV locations and parallel arrays. */
static void
test_malformed_rank(void **state)
{
    struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES];
    struct dsv4_msg m, d;
    struct dsv4_wire w;
    struct dsv4_perr pe;
    uint64_t bad_offsets[1] = { 0 };
    size_t n;

    (void)state;
    for (size_t i = 0; i < samples_count(); i++) {
        samples_get(i, &m);
        if (m.sub == DSV4_SUB_RANK && m.cmd == DSV4_RANK_DECODE)
            break;
    }
    encode_ok(&m, &w);
    n = wire_frames(&w, fr);
    /* A handle frame missing, one too many, one empty. */
    assert_int_equal(dsv4_msg_decode(&d, fr, n - 1, &pe), DSV4_ERR_PROTO);
    fr[n] = fr[n - 1];
    assert_int_equal(dsv4_msg_decode(&d, fr, n + 1, &pe), DSV4_ERR_PROTO);
    fr[n - 1].len = 0;
    assert_int_equal(dsv4_msg_decode(&d, fr, n, &pe), DSV4_ERR_INVAL);
    assert_int_equal(pe.code, 401);
    dsv4_wire_clear(&w);

    /* The encoder refuses what the decoder would refuse. */
    m.u.decode.kv[0].part = 2; /* n_parts is 2 */
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
    assert_int_equal(pe.code, 401);
    m.u.decode.kv[0].part = 0;
    m.u.decode.s.temperature = 11;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
    m.u.decode.s.temperature = 1;
    m.u.decode.n_kv = 0;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);

    /* sizes and offsets of different lengths on the wire: 401. */
    {
        msgpack_sbuffer sb;
        msgpack_packer pk;
        uint8_t c = DSV4_RANK_PREFILL_DONE;

        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 3);
        pk_str(&pk, "req");
        msgpack_pack_uint64(&pk, 1);
        pk_str(&pk, "token");
        msgpack_pack_int(&pk, 5);
        pk_str(&pk, "kv");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_map(&pk, 6);
        pk_str(&pk, "part");
        msgpack_pack_int(&pk, 0);
        pk_str(&pk, "n_parts");
        msgpack_pack_int(&pk, 1);
        pk_str(&pk, "transport");
        pk_str(&pk, "shm");
        pk_str(&pk, "n_tokens");
        msgpack_pack_int(&pk, 3);
        pk_str(&pk, "sizes");
        msgpack_pack_array(&pk, 2);
        msgpack_pack_int(&pk, 1);
        msgpack_pack_int(&pk, 2);
        pk_str(&pk, "offsets");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_int(&pk, bad_offsets[0]);
        fr[0] = (struct dsv4_frame){ "", 0 };
        fr[1] = (struct dsv4_frame){ DSV4_PROTO_SIG_RANK, 6 };
        fr[2] = (struct dsv4_frame){ &c, 1 };
        fr[3] = (struct dsv4_frame){ sb.data, sb.size };
        fr[4] = (struct dsv4_frame){ "h", 1 };
        assert_int_equal(dsv4_msg_decode(&d, fr, 5, &pe), DSV4_ERR_INVAL);
        assert_int_equal(pe.code, 401);
        msgpack_sbuffer_destroy(&sb);
    }

    /* Rank TOKENS with logprobs shorter than tokens: the encoder cannot even
     * express it (one count); group_rank >= group_size is refused. */
    for (size_t i = 0; i < samples_count(); i++) {
        samples_get(i, &m);
        if (m.sub == DSV4_SUB_RANK && m.cmd == DSV4_RANK_READY)
            break;
    }
    m.u.ready.group_rank = m.u.ready.group_size;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
    /* call_rows above call_rows_full, or without it, is refused */
    m.u.ready.group_rank = 0;
    m.u.ready.has_call_rows = true;
    m.u.ready.call_rows = 1024;
    m.u.ready.call_rows_full = 512;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
    m.u.ready.call_rows_full = 0;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
    m.u.ready.call_rows_full = 1024;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_OK);
    dsv4_wire_clear(&w);
    /* and so in RANK, which repeats them */
    for (size_t i = 0; i < samples_count(); i++) {
        if (strcmp(samples_get(i, &m), "ctl_rank_prefill") == 0)
            break;
    }
    assert_true(m.sub == DSV4_SUB_CTL && m.cmd == DSV4_CTL_RANK && m.u.rank.has_call_rows);
    m.u.rank.call_rows = m.u.rank.call_rows_full + 1;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);

    /* TOKENS' most likely tokens: counts that do not sum to the arrays'
     * length, a count above 20, arrays without counts or without each
     * other, are refused (rank and client TOKENS share the check). */
    for (int sub = 0; sub < 2; sub++) {
        static const uint64_t n_bad[] = { 2, 1, 3 }, n_big[] = { 21, 0, 0 };
        struct dsv4_top *t;

        for (size_t i = 0; i < samples_count(); i++) {
            if (strcmp(samples_get(i, &m), sub ? "cli_tokens_top" : "rank_tokens_top") == 0)
                break;
        }
        t = sub ? &m.u.tokens.top : &m.u.step.top;
        assert_non_null(t->top_n);
        assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_OK);
        dsv4_wire_clear(&w);
        t->top_n = n_bad;
        assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
        assert_int_equal(pe.code, 401);
        t->top_n = n_big;
        assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
        t->top_n = NULL;
        assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
    }
    for (size_t i = 0; i < samples_count(); i++) {
        if (strcmp(samples_get(i, &m), "rank_prefill_done_top") == 0)
            break;
    }
    m.u.prefill_done.top_logprobs = NULL;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_ERR_INVAL);
    m.u.prefill_done.top_ids = NULL;
    assert_int_equal(dsv4_msg_encode(&m, &w, &pe), DSV4_OK);
    dsv4_wire_clear(&w);
}

/* Every truncation and every single-byte change of every sample body either
 * decodes or is refused with a code; nothing crashes (ASan build). */
static void
test_mutations(void **state)
{
    (void)state;
    for (size_t i = 0; i < samples_count(); i++) {
        struct dsv4_frame fr[DSV4_PROTO_MAX_FRAMES];
        struct dsv4_msg m, d;
        struct dsv4_wire w;
        struct dsv4_perr pe;
        uint8_t *body;
        size_t n;

        samples_get(i, &m);
        encode_ok(&m, &w);
        n = wire_frames(&w, fr);
        body = malloc(w.body_len);
        memcpy(body, w.body, w.body_len);
        fr[3].data = body;
        for (size_t len = 0; len < w.body_len; len++) {
            fr[3].len = len;
            assert_int_not_equal(dsv4_msg_decode(&d, fr, n, &pe), DSV4_OK);
        }
        fr[3].len = w.body_len;
        for (size_t k = 0; k < w.body_len; k++) {
            static const uint8_t flips[] = { 0x00, 0x7f, 0x80, 0xc0, 0xc1, 0xd9, 0xdd, 0xdf,
                0xff };

            for (size_t f = 0; f < sizeof(flips); f++) {
                uint8_t saved = body[k];

                body[k] = flips[f];
                if (dsv4_msg_decode(&d, fr, n, &pe) == DSV4_OK)
                    dsv4_msg_clear(&d);
                else
                    assert_true(pe.code >= 400 && pe.code < 600);
                body[k] = saved;
            }
        }
        free(body);
        dsv4_wire_clear(&w);
    }
}

static void
test_codes(void **state)
{
    (void)state;
    for (int e = 0; e < DSV4_ERR__COUNT; e++) {
        uint16_t c = dsv4_proto_code_from_err((enum dsv4_err)e);

        assert_true(c >= 200 && c < 600);
        assert_int_equal(c == 200, e == DSV4_OK);
    }
    assert_int_equal(dsv4_proto_code_from_err(DSV4_ERR_BUSY), 300);
    assert_int_equal(dsv4_proto_code_from_err(DSV4_ERR_PROTO), 400);
    assert_int_equal(dsv4_proto_code_from_err(DSV4_ERR_INVAL), 401);
    assert_int_equal(dsv4_proto_code_from_err(DSV4_ERR_TIMEOUT), 408);
    assert_int_equal(dsv4_proto_code_from_err(DSV4_ERR_CUDA), 500);
    assert_int_equal(dsv4_proto_code_from_err((enum dsv4_err)999), 500);
    assert_int_equal(dsv4_proto_err_from_code(401), DSV4_ERR_INVAL);
    assert_int_equal(dsv4_proto_err_from_code(200), DSV4_OK);
    assert_int_equal(dsv4_proto_err_from_code(399), DSV4_ERR_BUSY);
    assert_string_equal(dsv4_proto_cmd_name(DSV4_SUB_RANK, DSV4_RANK_PREFILL_DONE),
        "PREFILL_DONE");
    assert_string_equal(dsv4_proto_cmd_name(DSV4_SUB_RANK, 99), "?");
    assert_string_equal(dsv4_req_state_name(DSV4_REQ_HANDOFF), "handoff");
    assert_null(dsv4_finish_name(DSV4_FINISH_NONE));
    assert_string_equal(dsv4_proto_code_str(599), "server error");
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_coverage),
        cmocka_unit_test(test_mtp_counters),
        cmocka_unit_test(test_cross_checks),
        cmocka_unit_test(test_group_broken),
        cmocka_unit_test(test_golden),
        cmocka_unit_test(test_malformed_values),
        cmocka_unit_test(test_malformed_framing),
        cmocka_unit_test(test_malformed_frames),
        cmocka_unit_test(test_malformed_rank),
        cmocka_unit_test(test_mutations),
        cmocka_unit_test(test_codes),
    };

    if (argc == 3 && strcmp(argv[1], "--write-golden") == 0)
        return write_golden(argv[2]);
    if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0)
        return write_corpus(argv[2]);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
