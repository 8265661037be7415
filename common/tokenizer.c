/*
 * tokenizer.c — what reads the tables of a loaded struct dsv4_tok: UTF-8
 * and buffer helpers, vocabulary / merge / trie lookups, decode and the
 * streaming decoder.  Loading is in tokenizer_load.c, encoding in
 * tokenizer_encode.c, the chat format in tokenizer_chat.c.  Runs wherever
 * the tokenizer is used (scheduler, tools).
 */
#include "common/tokenizer_impl.h"

#include <stdlib.h>
#include <string.h>

/* --- small helpers ---------------------------------------------------- */

uint32_t
tok_hash_bytes(const unsigned char *s, size_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)n;
    uint64_t w;

    while (n >= 8) {
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    if (n > 0) {
        w = 0;
        memcpy(&w, s, n);
        h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
        h ^= h >> 29;
    }
    h *= 0x9e3779b97f4a7c15ull;
    return (uint32_t)(h >> 32) | 1u;
}

size_t
tok_utf8_seq(const unsigned char *s, size_t n)
{
    unsigned char c = s[0], lo = 0x80, hi = 0xbf;
    size_t len, i;

    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        len = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;          /* no UTF-16 surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;          /* nothing above U+10FFFF */
    } else
        return 0;
    if (n < len || s[1] < lo || s[1] > hi)
        return 0;
    for (i = 2; i < len; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    return len;
}

size_t
tok_utf8_valid_prefix(const unsigned char *s, size_t n)
{
    size_t i = 0, k;
    uint64_t w;

    while (i < n) {
        /* ASCII fast path, 8 bytes at a time. */
        while (i + 8 <= n) {
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ull)
                break;
            i += 8;
        }
        if (i >= n)
            break;
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        k = tok_utf8_seq(s + i, n - i);
        if (k == 0)
            break;
        i += k;
    }
    return i;
}

enum dsv4_err
tok_ids_push(struct dsv4_tok_ids *ids, int32_t id)
{
    int32_t *nv;
    size_t ncap;

    if (ids->len == ids->cap) {
        ncap = ids->cap ? ids->cap * 2 : 64;
        nv = realloc(ids->v, ncap * sizeof(*nv));
        if (nv == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory "
                "for %zu ids", ncap);
        ids->v = nv;
        ids->cap = ncap;
    }
    ids->v[ids->len++] = id;
    return DSV4_OK;
}

enum dsv4_err
tok_text_reserve(struct dsv4_tok_text *t, size_t extra)
{
    char *ns;
    size_t ncap;

    if (t->len + extra + 1 <= t->cap)
        return DSV4_OK;
    ncap = t->cap ? t->cap : 64;
    while (ncap < t->len + extra + 1)
        ncap *= 2;
    ns = realloc(t->s, ncap);
    if (ns == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory for "
            "%zu bytes of text", ncap);
    t->s = ns;
    t->cap = ncap;
    return DSV4_OK;
}

enum dsv4_err
tok_text_append(struct dsv4_tok_text *t, const void *b, size_t n)
{
    enum dsv4_err e;

    if ((e = tok_text_reserve(t, n)) != DSV4_OK)
        return e;
    if (n > 0)
        memcpy(t->s + t->len, b, n);
    t->len += n;
    t->s[t->len] = '\0';
    return DSV4_OK;
}

void
dsv4_tok_ids_free(struct dsv4_tok_ids *ids)
{
    free(ids->v);
    memset(ids, 0, sizeof(*ids));
}

void
dsv4_tok_text_free(struct dsv4_tok_text *t)
{
    free(t->s);
    memset(t, 0, sizeof(*t));
}

const char *
dsv4_tok_default_path(void)
{
    const char *p = getenv(DSV4_TOKENIZER_ENV);

    return (p != NULL && *p != '\0') ? p : DSV4_TOKENIZER_DEFAULT;
}

const char *
dsv4_tok_conf_path(const char *key)
{
    if (strcmp(key, "none") == 0)
        return NULL;
    return strcmp(key, DSV4_TOKENIZER_DEFAULT) != 0 ? key : dsv4_tok_default_path();
}

/* --- table lookups ------------------------------------------------- */

int32_t
tok_vocab_find(const struct dsv4_tok *tok, const void *s, size_t n)
{
    uint32_t i = tok_hash_bytes(s, n) & tok->vocab.mask;
    int32_t id;

    while ((id = tok->vocab.slot[i]) >= 0) {
        if (tok->piece_len[id] == n &&
            memcmp(tok->blob + tok->piece_off[id], s, n) == 0)
            return id;
        i = (i + 1) & tok->vocab.mask;
    }
    return -1;
}

const struct tok_merge *
tok_merge_find(const struct dsv4_tok *tok, int32_t a, int32_t b)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = tok_hash_u64(key) & tok->merge_mask;
    const struct tok_merge *m;

    for (;;) {
        m = &tok->merges[i];
        if (m->key == key)
            return m;
        if (m->key == UINT64_MAX)
            return NULL;
        i = (i + 1) & tok->merge_mask;
    }
}

int32_t
tok_trie_next(const struct tok_trie *t, int32_t node, unsigned char c)
{
    uint64_t key;
    uint32_t i;

    if (node < 0)
        return t->root[c];
    key = ((uint64_t)(uint32_t)node << 8 | c) + 1;
    i = tok_hash_u64(key) & t->edge_mask;
    while (t->edge_key[i] != 0) {
        if (t->edge_key[i] == key)
            return t->edge_child[i];
        i = (i + 1) & t->edge_mask;
    }
    return -1;
}

/* --- lookups ---------------------------------------------------------- */

int32_t
dsv4_tok_vocab_size(const struct dsv4_tok *tok)
{
    return tok->nids;
}

int32_t
dsv4_tok_bos(const struct dsv4_tok *tok)
{
    return tok->bos;
}

int32_t
dsv4_tok_eos(const struct dsv4_tok *tok)
{
    return tok->eos;
}

int32_t
dsv4_tok_added_id(const struct dsv4_tok *tok, const char *s, size_t len)
{
    int32_t node = -1;
    size_t i;

    if (len == 0)
        len = strlen(s);
    for (i = 0; i < len && (i == 0 || node >= 0); i++)
        node = tok_trie_next(&tok->trie, node, (unsigned char)s[i]);
    return node >= 0 ? tok->trie.node_id[node] : -1;
}

bool
dsv4_tok_is_added(const struct dsv4_tok *tok, int32_t id)
{
    return id >= 0 && id < tok->nids &&
        (tok->kind[id] == TOK_ADDED || tok->kind[id] == TOK_SPECIAL);
}

bool
dsv4_utf8_valid(const char *s, size_t n)
{
    return tok_utf8_valid_prefix((const unsigned char *)s, n) == n;
}

bool
dsv4_tok_is_special(const struct dsv4_tok *tok, int32_t id)
{
    return id >= 0 && id < tok->nids && tok->kind[id] == TOK_SPECIAL;
}

const char *
dsv4_tok_piece(const struct dsv4_tok *tok, int32_t id, size_t *len)
{
    if (id < 0 || id >= tok->nids) {
        *len = 0;
        return NULL;
    }
    return tok_piece_at(tok, id, len);
}

/* --- decode ----------------------------------------------------------- */

enum dsv4_err
dsv4_tok_decode(const struct dsv4_tok *tok, const int32_t *ids, size_t n,
    struct dsv4_tok_text *out)
{
    size_t i, total = 0, len;
    const char *p;
    enum dsv4_err e;

    for (i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->nids)
            return dsv4_err_set(DSV4_ERR_INVAL, "tokenizer: decode: id %d "
                "at position %zu is out of range [0, %d)", ids[i], i,
                tok->nids);
        total += tok->piece_len[ids[i]];
    }
    if ((e = tok_text_reserve(out, total)) != DSV4_OK)
        return e;
    for (i = 0; i < n; i++) {
        p = tok_piece_at(tok, ids[i], &len);
        memcpy(out->s + out->len, p, len);
        out->len += len;
    }
    out->s[out->len] = '\0';
    return DSV4_OK;
}

/* --- streaming decoder ------------------------------------------------ */

static const char replacement[3] = { '\xef', '\xbf', '\xbd' };  /* U+FFFD */

void
dsv4_tok_stream_init(struct dsv4_tok_stream *st, const struct dsv4_tok *tok)
{
    memset(st, 0, sizeof(*st));
    st->tok = tok;
}

/* Expected length of a sequence starting with lead byte c (0 = invalid
 * lead) and the allowed range of its second byte. */
static size_t
utf8_lead(unsigned char c, unsigned char *lo, unsigned char *hi)
{
    *lo = 0x80;
    *hi = 0xbf;
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        return 2;
    if (c >= 0xe0 && c <= 0xef) {
        if (c == 0xe0)
            *lo = 0xa0;
        if (c == 0xed)
            *hi = 0x9f;
        return 3;
    }
    if (c >= 0xf0 && c <= 0xf4) {
        if (c == 0xf0)
            *lo = 0x90;
        if (c == 0xf4)
            *hi = 0x8f;
        return 4;
    }
    return 0;
}

enum dsv4_err
dsv4_tok_stream_bytes(struct dsv4_tok_stream *st, const char *b, size_t n,
    struct dsv4_tok_text *out)
{
    const unsigned char *u = (const unsigned char *)b;
    size_t i = 0, need, run;
    unsigned char lo, hi, c;
    enum dsv4_err e;

    while (i < n) {
        if (st->npend == 0) {
            /* Copy the longest valid run in one go. */
            run = tok_utf8_valid_prefix(u + i, n - i);
            if (run > 0) {
                if ((e = tok_text_append(out, u + i, run)) != DSV4_OK)
                    return e;
                i += run;
                continue;
            }
            need = utf8_lead(u[i], &lo, &hi);
            if (need == 0) {
                if ((e = tok_text_append(out, replacement, 3)) != DSV4_OK)
                    return e;
                i++;
                continue;
            }
            st->pend[st->npend++] = u[i++];     /* truncated: wait */
            continue;
        }
        need = utf8_lead(st->pend[0], &lo, &hi);
        c = u[i];
        if (st->npend == 1 ? (c < lo || c > hi) : (c & 0xc0) != 0x80) {
            /* The pending prefix is a maximal ill-formed subpart; c is
             * looked at again as a possible start. */
            st->npend = 0;
            if ((e = tok_text_append(out, replacement, 3)) != DSV4_OK)
                return e;
            continue;
        }
        st->pend[st->npend++] = c;
        i++;
        if (st->npend == need) {
            if ((e = tok_text_append(out, st->pend, need)) != DSV4_OK)
                return e;
            st->npend = 0;
        }
    }
    return tok_text_append(out, NULL, 0);
}

enum dsv4_err
dsv4_tok_stream_push(struct dsv4_tok_stream *st, int32_t id,
    struct dsv4_tok_text *out)
{
    size_t len;
    const char *p = dsv4_tok_piece(st->tok, id, &len);

    if (p == NULL)
        return dsv4_err_set(DSV4_ERR_INVAL, "tokenizer: stream: id %d is "
            "out of range [0, %d)", id, st->tok->nids);
    return dsv4_tok_stream_bytes(st, p, len, out);
}

enum dsv4_err
dsv4_tok_stream_flush(struct dsv4_tok_stream *st, struct dsv4_tok_text *out)
{
    if (st->npend == 0)
        return tok_text_append(out, NULL, 0);
    st->npend = 0;
    return tok_text_append(out, replacement, 3);
}
