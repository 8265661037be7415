/*
 * fuzz_gwreq.c — libFuzzer target for the gateway's request bodies
 * (daemons/gateway/gw_req.c, gw_req_parse): what any HTTP client can send
 * to POST /v1/completions and /v1/chat/completions.
 *
 * Input: byte 0 bit 0 picks the route (1: chat); the rest is the body.  The
 * tokenizer (prompt ids are checked against its vocabulary, chat messages
 * are encoded with it) is $FUZZ_TOKENIZER, else dsv4_tok_default_path().
 *
 * Checked, aborting on the first that fails:
 *   1. a refusal has status 400, 404 or 500, a code and a message;
 *   2. an accepted body is an object, its limits in range (max_tokens 1 ...
 *      1048576, temperature 0 ... 10, top_p in (0, 1], at most 16 stop
 *      strings of 1 ... 256 bytes of UTF-8), and it holds exactly what its
 *      route takes: chat, 1 ... 4096 messages of a known role whose texts
 *      are UTF-8 without U+0000 (and they encode with the chat template to
 *      ids of the vocabulary, or fail with a message); completions, a
 *      non-empty UTF-8 prompt or 1 ... n token ids of the vocabulary;
 *   3. parsing the same body again gives the same answer.
 * ASan and UBSan (run.sh's flags) check every access and gw_req_free's
 * release of whatever was parsed.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"
#include "daemons/gateway/gateway.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct gw gw;

static void
fail(const char *what, const char *detail)
{
    fuzz_fail("fuzz_gwreq", what, detail);
}

static void
setup(void)
{
    gw.tok = fuzz_tokenizer("fuzz_gwreq", DSV4_TOK_HF, true);
    snprintf(gw.conf.gateway_model, sizeof(gw.conf.gateway_model), "deepseek-v4-flash");
    gw.eos = dsv4_tok_eos(gw.tok);
}

/* Whether s is text a request may carry: UTF-8 without U+0000. */
static bool
text_ok(const char *s)
{
    return s != NULL && dsv4_utf8_valid(s, strlen(s));
}

static void
check_ok(const struct gw_req *r, bool chat)
{
    int V = dsv4_tok_vocab_size(gw.tok);

    if (r->o == NULL || json_object_get_type(r->o) != json_type_object)
        fail("accepted a body that is not an object", NULL);
    if (r->p.max_tokens < 1 || r->p.max_tokens > 1048576)
        fail("max_tokens out of range", NULL);
    if (!(r->p.temperature >= 0.0f && r->p.temperature <= 10.0f))
        fail("temperature out of range", NULL);
    if (!(r->p.top_p > 0.0f && r->p.top_p <= 1.0f))
        fail("top_p out of range", NULL);
    if (r->p.n_stop > GW_MAX_STOP || (r->p.n_stop > 0 && r->p.stop != r->stops))
        fail("stop strings", NULL);
    for (size_t i = 0; i < r->p.n_stop; i++) {
        size_t n = strlen(r->stops[i]);

        if (n < 1 || n > 256 || !text_ok(r->stops[i]))
            fail("a stop string", r->stops[i]);
    }
    if (chat) {
        struct dsv4_tok_ids ids = { 0 };

        if (r->prompt != NULL || r->tokens != NULL || r->n_msgs < 1 || r->n_msgs > 4096 ||
            r->msgs == NULL)
            fail("chat: not 1 ... 4096 messages alone", NULL);
        for (size_t i = 0; i < r->n_msgs; i++) {
            if ((int)r->msgs[i].role < DSV4_CHAT_SYSTEM ||
                (int)r->msgs[i].role > DSV4_CHAT_DEVELOPER)
                fail("chat: a role", NULL);
            if (!text_ok(r->msgs[i].content) ||
                (r->msgs[i].reasoning != NULL && !text_ok(r->msgs[i].reasoning)))
                fail("chat: a text is not UTF-8 without U+0000", NULL);
        }
        if (dsv4_chat_encode(gw.tok, r->msgs, r->n_msgs, &r->copts, &ids) == DSV4_OK) {
            for (size_t i = 0; i < ids.len; i++)
                if (ids.v[i] < 0 || ids.v[i] >= V)
                    fail("chat: an id outside the vocabulary", NULL);
        } else if (dsv4_errmsg()[0] == '\0') {
            fail("chat: encoding failed without a message", NULL);
        }
        dsv4_tok_ids_free(&ids);
    } else if (r->prompt != NULL) {
        if (r->tokens != NULL || r->msgs != NULL || r->prompt[0] == '\0' ||
            !text_ok(r->prompt))
            fail("completions: the text prompt", NULL);
    } else {
        if (r->tokens == NULL || r->n_tokens < 1 || r->msgs != NULL)
            fail("completions: neither a prompt nor ids", NULL);
        for (size_t i = 0; i < r->n_tokens; i++)
            if (r->tokens[i] < 0 || r->tokens[i] >= V)
                fail("completions: an id outside the vocabulary", NULL);
    }
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct gw_req r, r2;
    struct gw_bad b, b2;
    bool chat;
    int rc, rc2;

    if (gw.tok == NULL)
        setup();
    if (size < 1)
        return 0;
    chat = data[0] & 1;
    rc = gw_req_parse(&gw, chat, (const char *)data + 1, size - 1, &r, &b);
    if (rc == 0) {
        check_ok(&r, chat);
    } else if (rc != -1) {
        fail("neither 0 nor -1", NULL);
    } else if ((b.status != 400 && b.status != 404 && b.status != 500) || b.code == NULL ||
               b.msg[0] == '\0' || strnlen(b.msg, sizeof(b.msg)) == sizeof(b.msg)) {
        fail("a refusal without status, code or message", b.msg);
    }
    rc2 = gw_req_parse(&gw, chat, (const char *)data + 1, size - 1, &r2, &b2);
    if (rc2 != rc || (rc != 0 && (b2.status != b.status || strcmp(b2.code, b.code) != 0 ||
                                  strcmp(b2.msg, b.msg) != 0)))
        fail("a second parse answered otherwise", b2.msg);
    gw_req_free(&r);
    gw_req_free(&r2);
    return 0;
}
