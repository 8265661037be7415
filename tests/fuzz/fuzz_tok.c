/*
 * fuzz_tok.c — libFuzzer target for the tokenizer (common/tokenizer.h) on
 * any bytes: the properties its header promises, checked on every input.
 *
 * Input: byte 0 holds flags (bit 0: encode with DSV4_TOK_SPECIAL; bit 1: the
 * DSV4_TOK_PYPKG flavour when that loads; bit 2: thinking mode for the chat
 * check); the rest is the text.  The tokenizer is $FUZZ_TOKENIZER, else
 * dsv4_tok_default_path() (the DeepSeek-V4 file tools/setup.sh installs).
 *
 * Checked, aborting on the first that fails:
 *   1. every id is in the vocabulary, and decode(encode(s)) == s exactly;
 *   2. encoding s again (the pre-token cache now warm) gives the same ids;
 *   3. the streaming decoder gives the same text whether fed the ids one by
 *      one, all of s's bytes at once or one byte at a time; that text is
 *      well-formed UTF-8, and equals s when s is well-formed UTF-8;
 *   4. dsv4_utf8_valid agrees with an independent check;
 *   5. chat: with s (up to its first NUL) as a user turn, the ids of
 *      dsv4_chat_encode decode to dsv4_chat_render's string, and hold as
 *      many special tokens as the same turn with no text (message text never
 *      becomes a marker).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct dsv4_tok *tok_hf, *tok_py;

static void
fail(const char *what)
{
    fuzz_fail("fuzz_tok", what, NULL);
}

static void
load(void)
{
    tok_hf = fuzz_tokenizer("fuzz_tok", DSV4_TOK_HF, true);
    /* only the DeepSeek-V4 patterns have that flavour */
    tok_py = fuzz_tokenizer("fuzz_tok", DSV4_TOK_PYPKG, false);
}

/* Length of the well-formed UTF-8 sequence at s (RFC 3629: no overlong
 * forms, no surrogates, nothing past U+10FFFF), 0 if there is none.
 * Written here, not taken from the tokenizer, so the check is independent. */
static size_t
utf8_char(const unsigned char *s, size_t n)
{
    uint32_t c;
    size_t len;

    if (s[0] < 0x80)
        return 1;
    if (s[0] >= 0xc2 && s[0] <= 0xdf)
        len = 2, c = s[0] & 0x1f;
    else if (s[0] >= 0xe0 && s[0] <= 0xef)
        len = 3, c = s[0] & 0x0f;
    else if (s[0] >= 0xf0 && s[0] <= 0xf4)
        len = 4, c = s[0] & 0x07;
    else
        return 0;
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = c << 6 | (s[i] & 0x3f);
    }
    if ((len == 3 && c < 0x800) || (len == 4 && c < 0x10000) || c > 0x10ffff ||
        (c >= 0xd800 && c <= 0xdfff))
        return 0;
    return len;
}

static bool
utf8_valid(const unsigned char *s, size_t n)
{
    size_t k;

    for (size_t i = 0; i < n; i += k)
        if ((k = utf8_char(s + i, n - i)) == 0)
            return false;
    return true;
}

static void
check_stream(struct dsv4_tok *tok, const struct dsv4_tok_ids *ids, const uint8_t *s,
    size_t n)
{
    struct dsv4_tok_stream st;
    struct dsv4_tok_text by_id = { 0 }, at_once = { 0 }, by_byte = { 0 };

    dsv4_tok_stream_init(&st, tok);
    for (size_t i = 0; i < ids->len; i++)
        if (dsv4_tok_stream_push(&st, ids->v[i], &by_id) != DSV4_OK)
            fail("stream_push failed");
    if (dsv4_tok_stream_flush(&st, &by_id) != DSV4_OK)
        fail("stream_flush failed");
    dsv4_tok_stream_init(&st, tok);
    if (dsv4_tok_stream_bytes(&st, (const char *)s, n, &at_once) != DSV4_OK ||
        dsv4_tok_stream_flush(&st, &at_once) != DSV4_OK)
        fail("stream_bytes failed");
    dsv4_tok_stream_init(&st, tok);
    for (size_t i = 0; i < n; i++)
        if (dsv4_tok_stream_bytes(&st, (const char *)s + i, 1, &by_byte) != DSV4_OK)
            fail("stream_bytes (a byte) failed");
    if (dsv4_tok_stream_flush(&st, &by_byte) != DSV4_OK)
        fail("stream_flush failed");
    if (by_id.len != at_once.len || (by_id.len > 0 && memcmp(by_id.s, at_once.s, by_id.len)))
        fail("streamed text: ids one by one != the bytes at once");
    if (by_byte.len != at_once.len ||
        (at_once.len > 0 && memcmp(by_byte.s, at_once.s, at_once.len)))
        fail("streamed text: a byte at a time != the bytes at once");
    if (!utf8_valid((const unsigned char *)at_once.s, at_once.len))
        fail("streamed text is not well-formed UTF-8");
    if (utf8_valid(s, n) && (at_once.len != n || (n > 0 && memcmp(at_once.s, s, n))))
        fail("streamed text of well-formed UTF-8 differs from it");
    dsv4_tok_text_free(&by_id);
    dsv4_tok_text_free(&at_once);
    dsv4_tok_text_free(&by_byte);
}

static size_t
count_special(struct dsv4_tok *tok, const struct dsv4_tok_ids *ids)
{
    size_t k = 0;

    for (size_t i = 0; i < ids->len; i++)
        k += dsv4_tok_is_special(tok, ids->v[i]);
    return k;
}

static void
check_chat(struct dsv4_tok *tok, const uint8_t *s, size_t n, bool thinking)
{
    char *content = malloc(n + 1);
    struct dsv4_chat_msg m[2];
    struct dsv4_chat_opts o = { .thinking = thinking };
    struct dsv4_tok_ids ids = { 0 }, bare = { 0 };
    struct dsv4_tok_text want = { 0 }, got = { 0 };

    if (content == NULL)
        fail("out of memory");
    memcpy(content, s, n);
    content[n] = '\0';
    m[0] = (struct dsv4_chat_msg){ .role = DSV4_CHAT_SYSTEM, .content = "sys" };
    m[1] = (struct dsv4_chat_msg){ .role = DSV4_CHAT_USER, .content = content };
    if (dsv4_chat_encode(tok, m, 2, &o, &ids) != DSV4_OK) {
        /* the tiny test tokenizer has no markers: nothing to check */
        free(content);
        dsv4_tok_ids_free(&ids);
        return;
    }
    if (dsv4_chat_render(m, 2, &o, &want) != DSV4_OK)
        fail("chat_render failed where chat_encode did not");
    if (dsv4_tok_decode(tok, ids.v, ids.len, &got) != DSV4_OK)
        fail("decode of chat ids failed");
    if (got.len != want.len || (got.len > 0 && memcmp(got.s, want.s, got.len)))
        fail("chat: decode(chat_encode(msgs)) != chat_render(msgs)");
    m[1].content = "";
    if (dsv4_chat_encode(tok, m, 2, &o, &bare) != DSV4_OK)
        fail("chat_encode of an empty turn failed");
    if (count_special(tok, &ids) != count_special(tok, &bare))
        fail("chat: message text became a special token");
    free(content);
    dsv4_tok_ids_free(&ids);
    dsv4_tok_ids_free(&bare);
    dsv4_tok_text_free(&want);
    dsv4_tok_text_free(&got);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct dsv4_tok *tok;
    struct dsv4_tok_ids ids = { 0 }, again = { 0 };
    struct dsv4_tok_text back = { 0 };
    unsigned flags;
    const uint8_t *s;
    size_t n;
    int32_t vocab;

    if (tok_hf == NULL)
        load();
    if (size == 0)
        return 0;
    flags = data[0] & 1 ? DSV4_TOK_SPECIAL : 0;
    tok = data[0] & 2 && tok_py != NULL ? tok_py : tok_hf;
    s = data + 1;
    n = size - 1;
    vocab = dsv4_tok_vocab_size(tok);

    if (dsv4_tok_encode(tok, (const char *)s, n, flags, &ids) != DSV4_OK)
        fail(dsv4_errmsg());
    for (size_t i = 0; i < ids.len; i++)
        if (ids.v[i] < 0 || ids.v[i] >= vocab)
            fail("an id out of the vocabulary");
    if (dsv4_tok_decode(tok, ids.v, ids.len, &back) != DSV4_OK)
        fail("decode failed");
    if (back.len != n || (n > 0 && memcmp(back.s, s, n) != 0))
        fail("decode(encode(s)) != s");
    if (dsv4_tok_encode(tok, (const char *)s, n, flags, &again) != DSV4_OK)
        fail("second encode failed");
    if (again.len != ids.len || (ids.len > 0 && memcmp(again.v, ids.v,
        ids.len * sizeof(*ids.v)) != 0))
        fail("a second encode (cache warm) gave other ids");
    if (dsv4_utf8_valid((const char *)s, n) != utf8_valid(s, n))
        fail("dsv4_utf8_valid disagrees with the independent check");
    check_stream(tok, &ids, s, n);
    check_chat(tok, s, strnlen((const char *)s, n), data[0] & 4);
    dsv4_tok_ids_free(&ids);
    dsv4_tok_ids_free(&again);
    dsv4_tok_text_free(&back);
    return 0;
}
