/*
 * test_tokenizer_cases.c — compare our encoder with expected ids.
 *
 *   test_tokenizer_cases TOKENIZER.json hf|pypkg CASES.tsv
 *
 * TOKENIZER.json "-" means the installed default (dsv4_tok_default_path()).
 * CASES.tsv lines are "HEX<TAB>FLAGS<TAB>IDS" (tests/tokenizer/gen_cases.py
 * writes them from the Python oracles; fixture_*.tsv are committed copies).
 * For every case: encode(text, flags) must give exactly IDS, decode(IDS)
 * must give the text back, and the streaming decoder fed IDS one by one
 * must give the text too (the texts are valid UTF-8).  Lines starting
 * with '#' are comments.  Then a seeded fuzz
 * of byte strings with invalid UTF-8 checks decode(encode(b)) == b and that
 * the streaming decoder's output is always valid UTF-8.
 *
 * Exit 0 pass, 1 fail, 77 skip (tokenizer.json absent).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/err.h"
#include "common/tokenizer.h"

static int nfail;

static void
fail_case(size_t line, const char *what, const unsigned char *text,
    size_t len)
{
    size_t i;

    if (++nfail > 10)
        return;
    fprintf(stderr, "NOT OK line %zu: %s; text (%zu bytes): \"", line, what,
        len);
    for (i = 0; i < len && i < 120; i++)
        fprintf(stderr, text[i] >= 0x20 && text[i] < 0x7f ? "%c" : "\\x%02x",
            text[i]);
    fprintf(stderr, "%s\"\n", len > 120 ? "..." : "");
}

static void
print_ids(const char *label, const int32_t *v, size_t n)
{
    size_t i;

    if (nfail > 10)
        return;
    fprintf(stderr, "  %s:", label);
    for (i = 0; i < n && i < 40; i++)
        fprintf(stderr, " %d", v[i]);
    fprintf(stderr, "%s\n", n > 40 ? " ..." : "");
}

/* Independent UTF-8 check (RFC 3629), not the library's. */
static bool
valid_utf8(const unsigned char *s, size_t n)
{
    size_t i = 0, k, j;
    uint32_t cp, min;

    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        if ((s[i] & 0xe0) == 0xc0) {
            k = 2;
            cp = s[i] & 0x1f;
            min = 0x80;
        } else if ((s[i] & 0xf0) == 0xe0) {
            k = 3;
            cp = s[i] & 0x0f;
            min = 0x800;
        } else if ((s[i] & 0xf8) == 0xf0) {
            k = 4;
            cp = s[i] & 0x07;
            min = 0x10000;
        } else
            return false;
        if (i + k > n)
            return false;
        for (j = 1; j < k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                return false;
            cp = cp << 6 | (s[i + j] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += k;
    }
    return true;
}

static int
hexval(int c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ?
        c - 'a' + 10 : -1;
}

static bool
check_case(struct dsv4_tok *tok, size_t line, const unsigned char *text,
    size_t len, unsigned flags, const int32_t *want, size_t nwant)
{
    struct dsv4_tok_ids got = { 0 };
    struct dsv4_tok_text dec = { 0 }, st = { 0 };
    struct dsv4_tok_stream s;
    size_t i;
    bool ok = true;

    if (dsv4_tok_encode(tok, (const char *)text, len, flags, &got) !=
        DSV4_OK) {
        fail_case(line, dsv4_errmsg(), text, len);
        return false;
    }
    if (got.len != nwant || memcmp(got.v, want, nwant * 4) != 0) {
        fail_case(line, flags ? "ids differ (special)" : "ids differ",
            text, len);
        print_ids("want", want, nwant);
        print_ids("got ", got.v, got.len);
        ok = false;
    }
    if (dsv4_tok_decode(tok, want, nwant, &dec) != DSV4_OK ||
        dec.len != len || memcmp(dec.s, text, len) != 0) {
        fail_case(line, "decode(ids) != text", text, len);
        ok = false;
    }
    dsv4_tok_stream_init(&s, tok);
    for (i = 0; i < nwant; i++)
        if (dsv4_tok_stream_push(&s, want[i], &st) != DSV4_OK)
            break;
    dsv4_tok_stream_flush(&s, &st);
    if (st.len != len || (len > 0 && memcmp(st.s, text, len) != 0)) {
        fail_case(line, "stream decode != text", text, len);
        ok = false;
    }
    dsv4_tok_ids_free(&got);
    dsv4_tok_text_free(&dec);
    dsv4_tok_text_free(&st);
    return ok;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint32_t
rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

/* Byte strings with invalid UTF-8 mixed into real text: encode -> decode
 * must give the bytes back; streamed output must be valid UTF-8. */
static void
fuzz_invalid(struct dsv4_tok *tok)
{
    static const char *frag[] = { "hello", " world", "中文", "😀", "\n\n",
        "   ", "<｜User｜>", "123", "é", "\xe4\xb8", "\xf0\x9f\x98",
        "\xc3", "\xed\xa0\x80", "\xff", "\xfe", "\x80\x80", "\xc0\xaf",
        "\xf4\x90\x80\x80", "\xe0\x80\xaf", "\x00" };
    unsigned char buf[256];
    struct dsv4_tok_ids ids = { 0 };
    struct dsv4_tok_text dec = { 0 }, st = { 0 };
    struct dsv4_tok_stream s;
    size_t n, k, i, fl;
    int iter;

    for (iter = 0; iter < 3000; iter++) {
        n = 0;
        for (k = rnd() % 12; k > 0; k--) {
            if (rnd() % 3 == 0) {
                if (n < sizeof(buf))
                    buf[n++] = (unsigned char)rnd();
                continue;
            }
            const char *f = frag[rnd() % (sizeof(frag) / sizeof(frag[0]))];
            size_t fl2 = f[0] == '\0' ? 1 : strlen(f);

            if (n + fl2 <= sizeof(buf)) {
                memcpy(buf + n, f, fl2);
                n += fl2;
            }
        }
        for (fl = 0; fl < 2; fl++) {
            ids.len = dec.len = st.len = 0;
            if (dsv4_tok_encode(tok, (const char *)buf, n,
                fl ? DSV4_TOK_SPECIAL : 0, &ids) != DSV4_OK ||
                dsv4_tok_decode(tok, ids.v, ids.len, &dec) != DSV4_OK ||
                dec.len != n || (n > 0 && memcmp(dec.s, buf, n) != 0)) {
                fail_case((size_t)iter, "fuzz: decode(encode(b)) != b",
                    buf, n);
                continue;
            }
            dsv4_tok_stream_init(&s, tok);
            for (i = 0; i < ids.len; i++)
                dsv4_tok_stream_push(&s, ids.v[i], &st);
            dsv4_tok_stream_flush(&s, &st);
            if (!valid_utf8((const unsigned char *)st.s, st.len))
                fail_case((size_t)iter, "fuzz: stream output is not UTF-8",
                    buf, n);
            if (valid_utf8(buf, n) && (st.len != n ||
                (n > 0 && memcmp(st.s, buf, n) != 0)))
                fail_case((size_t)iter, "fuzz: stream of valid text "
                    "changed it", buf, n);
        }
    }
    dsv4_tok_ids_free(&ids);
    dsv4_tok_text_free(&dec);
    dsv4_tok_text_free(&st);
}

int
main(int argc, char **argv)
{
    struct dsv4_tok *tok;
    FILE *f;
    char *line = NULL, *p, *tab1, *tab2, *end;
    size_t cap = 0, lineno = 0, ncases = 0, nt, tlen, i;
    ssize_t n;
    unsigned char *text = NULL;
    int32_t *want = NULL;
    size_t wcap = 0, nwant;
    unsigned flags;
    long v;
    const char *path;

    if (argc != 4) {
        fprintf(stderr, "usage: %s TOKENIZER.json hf|pypkg CASES.tsv\n",
            argv[0]);
        return 2;
    }
    path = strcmp(argv[1], "-") == 0 ? dsv4_tok_default_path() : argv[1];
    if (access(path, R_OK) != 0) {
        printf("SKIP: %s not present (run tools/setup.sh)\n", path);
        return 77;
    }
    if (dsv4_tok_load(&tok, path, strcmp(argv[2], "pypkg") == 0 ?
        DSV4_TOK_PYPKG : DSV4_TOK_HF) != DSV4_OK) {
        fprintf(stderr, "NOT OK: load: %s\n", dsv4_errmsg());
        return 1;
    }
    if ((f = fopen(argv[3], "r")) == NULL) {
        perror(argv[3]);
        return 1;
    }
    while ((n = getline(&line, &cap, f)) >= 0) {
        lineno++;
        if (n > 0 && line[n - 1] == '\n')
            line[--n] = '\0';
        if (line[0] == '#')
            continue;
        tab1 = strchr(line, '\t');
        tab2 = tab1 ? strchr(tab1 + 1, '\t') : NULL;
        if (tab2 == NULL) {
            fprintf(stderr, "NOT OK: %s:%zu: malformed\n", argv[3], lineno);
            return 1;
        }
        tlen = (size_t)(tab1 - line) / 2;
        text = realloc(text, tlen + 1);
        for (i = 0; i < tlen; i++)
            text[i] = (unsigned char)(hexval(line[2 * i]) << 4 |
                hexval(line[2 * i + 1]));
        flags = tab1[1] == '1' ? DSV4_TOK_SPECIAL : 0;
        nwant = 0;
        for (p = tab2 + 1; *p != '\0'; p = end) {
            v = strtol(p, &end, 10);
            if (end == p)
                break;
            if (nwant == wcap) {
                wcap = wcap ? wcap * 2 : 256;
                want = realloc(want, wcap * sizeof(*want));
            }
            want[nwant++] = (int32_t)v;
        }
        check_case(tok, lineno, text, tlen, flags, want, nwant);
        ncases++;
    }
    fclose(f);
    nt = (size_t)nfail;
    fuzz_invalid(tok);
    printf("%s %s: %zu cases, %zu failed; invalid-UTF-8 fuzz: %d failed\n",
        argv[3], argv[2], ncases, nt, nfail - (int)nt);
    free(line);
    free(text);
    free(want);
    dsv4_tok_free(tok);
    if (ncases == 0)   /* an empty fixture checks nothing: not a pass */
        fprintf(stderr, "%s: no cases\n", argv[2]);
    return nfail == 0 && ncases > 0 ? 0 : 1;
}
