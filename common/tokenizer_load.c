/*
 * tokenizer_load.c — load a Hugging Face tokenizer.json into the tables of
 * struct dsv4_tok: pieces per id, the vocabulary hash, merge ranks and the
 * added-token trie; reject every component we do not implement.  Runs once
 * at start-up of whatever uses the tokenizer.
 *
 * The vocabulary is stored in raw bytes: each token string of the byte-level
 * alphabet (GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for
 * themselves, the 68 others for U+0100..U+0143) is mapped back to bytes at
 * load, so encode works on the input bytes directly and decode is a copy.
 */
#include "common/tokenizer_impl.h"

#include <sys/stat.h>

#include <errno.h>
#include <json-c/json.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOK_MAX_IDS (1 << 24)   /* sanity bound on ids in the file */

static uint32_t
pow2_at_least(uint32_t n)
{
    uint32_t c = 16;

    while (c < n)
        c <<= 1;
    return c;
}

/* --- byte-level alphabet ---------------------------------------------- */

/*
 * GPT-2's byte-to-unicode table: bytes 0x21-0x7e, 0xa1-0xac and 0xae-0xff
 * are their own code point; the remaining 68 bytes, in increasing order,
 * become U+0100, U+0101, ...  cp_to_byte is its inverse over U+0000-U+0143.
 */
static void
bytelevel_table(int16_t cp_to_byte[0x144])
{
    int b, n = 0;

    for (b = 0; b < 0x144; b++)
        cp_to_byte[b] = -1;
    for (b = 0; b < 256; b++) {
        if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) ||
            (b >= 0xae && b <= 0xff))
            cp_to_byte[b] = (int16_t)b;
        else
            cp_to_byte[0x100 + n++] = (int16_t)b;
    }
}

/*
 * Map a byte-level token string to raw bytes in out (capacity >= len).
 * Returns the byte count, or -1 if a character is outside the alphabet.
 */
static long
bytelevel_decode(const int16_t *cp_to_byte, const char *s, size_t len,
    unsigned char *out)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, k;
    long n = 0;
    uint32_t cp;

    while (i < len) {
        k = tok_utf8_seq(u + i, len - i);
        if (k == 1)
            cp = u[i];
        else if (k == 2)
            cp = ((uint32_t)(u[i] & 0x1f) << 6) | (u[i + 1] & 0x3f);
        else
            return -1;          /* 3- and 4-byte characters are > U+0143 */
        if (cp >= 0x144 || cp_to_byte[cp] < 0)
            return -1;
        out[n++] = (unsigned char)cp_to_byte[cp];
        i += k;
    }
    return n;
}

/* --- tables ----------------------------------------------------------- */

static enum dsv4_err
blob_add(struct dsv4_tok *tok, int32_t id, const void *b, size_t n)
{
    size_t ncap;
    char *nb;

    if (tok->blob_len + n > UINT32_MAX)
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: pieces exceed "
            "4 GiB");
    if (tok->blob_len + n > tok->blob_cap) {
        ncap = tok->blob_cap ? tok->blob_cap : 1 << 20;
        while (ncap < tok->blob_len + n)
            ncap *= 2;
        nb = realloc(tok->blob, ncap);
        if (nb == NULL)
            return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
        tok->blob = nb;
        tok->blob_cap = ncap;
    }
    memcpy(tok->blob + tok->blob_len, b, n);
    tok->piece_off[id] = (uint32_t)tok->blob_len;
    tok->piece_len[id] = (uint32_t)n;
    tok->blob_len += n;
    return DSV4_OK;
}

static void
vocab_insert(struct dsv4_tok *tok, int32_t id)
{
    size_t n;
    const char *p = tok_piece_at(tok, id, &n);
    uint32_t i = tok_hash_bytes((const unsigned char *)p, n) &
        tok->vocab.mask;

    while (tok->vocab.slot[i] >= 0)
        i = (i + 1) & tok->vocab.mask;
    tok->vocab.slot[i] = id;
}

static void
merge_put(struct dsv4_tok *tok, int32_t a, int32_t b, int32_t rank,
    int32_t id)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = tok_hash_u64(key) & tok->merge_mask;

    while (tok->merges[i].key != UINT64_MAX && tok->merges[i].key != key)
        i = (i + 1) & tok->merge_mask;
    /* A repeated pair keeps its last rank, as tokenizers and the Python
     * package both do (later map insertions win). */
    tok->merges[i].key = key;
    tok->merges[i].rank = rank;
    tok->merges[i].id = id;
}

static enum dsv4_err
trie_edge_grow(struct tok_trie *t)
{
    uint32_t ncap = (t->edge_mask + 1) * 2, i, j;
    uint64_t *nk = calloc(ncap, sizeof(*nk));
    int32_t *nc = malloc(ncap * sizeof(*nc));

    if (nk == NULL || nc == NULL) {
        free(nk);
        free(nc);
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
    }
    for (i = 0; i <= t->edge_mask; i++) {
        if (t->edge_key[i] == 0)
            continue;
        j = tok_hash_u64(t->edge_key[i]) & (ncap - 1);
        while (nk[j] != 0)
            j = (j + 1) & (ncap - 1);
        nk[j] = t->edge_key[i];
        nc[j] = t->edge_child[i];
    }
    free(t->edge_key);
    free(t->edge_child);
    t->edge_key = nk;
    t->edge_child = nc;
    t->edge_mask = ncap - 1;
    return DSV4_OK;
}

static enum dsv4_err
trie_add(struct tok_trie *t, const unsigned char *s, size_t n, int32_t id,
    int32_t max_nodes)
{
    int32_t node = -1, child;
    uint64_t key;
    uint32_t i;
    size_t k;
    enum dsv4_err e;

    for (k = 0; k < n; k++) {
        child = tok_trie_next(t, node, s[k]);
        if (child < 0) {
            if (t->nnodes >= max_nodes)
                return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: trie "
                    "overflow");
            child = t->nnodes++;
            t->node_id[child] = -1;
            if (node < 0)
                t->root[s[k]] = child;
            else {
                if ((uint32_t)t->nnodes * 2 > t->edge_mask &&
                    (e = trie_edge_grow(t)) != DSV4_OK)
                    return e;
                key = ((uint64_t)(uint32_t)node << 8 | s[k]) + 1;
                i = tok_hash_u64(key) & t->edge_mask;
                while (t->edge_key[i] != 0)
                    i = (i + 1) & t->edge_mask;
                t->edge_key[i] = key;
                t->edge_child[i] = child;
            }
        }
        node = child;
    }
    /* Two added tokens with the same content: the later one wins, as in
     * the Python package's trie. */
    t->node_id[node] = id;
    return DSV4_OK;
}

/* --- JSON helpers ----------------------------------------------------- */

static json_object *
jget(json_object *o, const char *key)
{
    json_object *v = NULL;

    if (o == NULL || !json_object_is_type(o, json_type_object) ||
        !json_object_object_get_ex(o, key, &v))
        return NULL;
    return v;
}

static const char *
jstr(json_object *o, const char *key)
{
    json_object *v = jget(o, key);

    return (v != NULL && json_object_is_type(v, json_type_string)) ?
        json_object_get_string(v) : NULL;
}

/* Boolean field; absent or null counts as false, any other type as true
 * (so a malformed value is never silently taken as "off"). */
static bool
jflag(json_object *o, const char *key)
{
    json_object *v = jget(o, key);

    if (v == NULL || json_object_is_type(v, json_type_null))
        return false;
    if (json_object_is_type(v, json_type_boolean))
        return json_object_get_boolean(v);
    return true;
}

/* True if the field is absent, null or "" (unused optional string). */
static bool
jempty(json_object *o, const char *key)
{
    json_object *v = jget(o, key);

    return v == NULL || json_object_is_type(v, json_type_null) ||
        (json_object_is_type(v, json_type_string) &&
        json_object_get_string_len(v) == 0);
}

static enum dsv4_err
read_file(const char *path, char **buf, size_t *len)
{
    FILE *f = fopen(path, "rb");
    struct stat st;
    long sz;
    char *b;

    if (f == NULL)
        /* read by the daemons (the configuration key) and dsv4-tokenize
         * (its option) alike: name both ways */
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: cannot open %s: "
            "%s (install it with tools/setup.sh, or name it: the configuration "
            "key `tokenizer`, dsv4-tokenize --tokenizer PATH, or $%s)", path,
            strerror(errno), DSV4_TOKENIZER_ENV);
    /* a directory opens, and seeks to a size of LLONG_MAX ("too large") */
    if (fstat(fileno(f), &st) == 0 && !S_ISREG(st.st_mode)) {
        fclose(f);
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: %s is %s, not a file",
            path, S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
    }
    if (fseek(f, 0, SEEK_END) != 0 || (sz = ftell(f)) < 0 ||
        fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: cannot read %s: "
            "%s", path, strerror(errno));
    }
    if (sz > INT_MAX - 1) {
        fclose(f);
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: %s is too large "
            "(%ld bytes)", path, sz);
    }
    b = malloc((size_t)sz + 1);
    if (b == NULL) {
        fclose(f);
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
    }
    if (fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        fclose(f);
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "tokenizer: short read on "
            "%s", path);
    }
    fclose(f);
    b[sz] = '\0';
    *buf = b;
    *len = (size_t)sz;
    return DSV4_OK;
}

/* --- loading ---------------------------------------------------------- */

#define TERR(...) dsv4_err_set(DSV4_ERR_TOKENIZER, __VA_ARGS__)

/* Check normalizer, post_processor and decoder: only what DeepSeek-V4 uses
 * (and what does not change ids) is accepted. */
static enum dsv4_err
check_components(json_object *root, const char *path)
{
    json_object *norm = jget(root, "normalizer"), *v;
    const char *type;

    if (norm != NULL && !json_object_is_type(norm, json_type_null)) {
        type = jstr(norm, "type");
        v = jget(norm, "normalizers");
        if (type == NULL || strcmp(type, "Sequence") != 0 || v == NULL ||
            !json_object_is_type(v, json_type_array) ||
            json_object_array_length(v) != 0)
            return TERR("tokenizer: %s: normalizer %s is not supported "
                "(only none or an empty Sequence)", path,
                type ? type : "(no type)");
    }
    v = jget(root, "post_processor");
    if (v != NULL && !json_object_is_type(v, json_type_null)) {
        /* ByteLevel as a post-processor only adjusts offsets. */
        type = jstr(v, "type");
        if (type == NULL || strcmp(type, "ByteLevel") != 0)
            return TERR("tokenizer: %s: post_processor %s is not supported "
                "(only ByteLevel)", path, type ? type : "(no type)");
    }
    v = jget(root, "decoder");
    type = jstr(v, "type");
    if (type == NULL || strcmp(type, "ByteLevel") != 0)
        return TERR("tokenizer: %s: decoder %s is not supported (only "
            "ByteLevel)", path, type ? type : "(missing)");
    return DSV4_OK;
}

/* Collect the Split patterns of pre_tokenizer into pats[]. */
static enum dsv4_err
parse_pretok(json_object *root, const char *path, const char **pats,
    int *npats)
{
    json_object *pt = jget(root, "pre_tokenizer"), *list, *p, *pat;
    const char *type, *beh;
    size_t i, n;
    bool seen_bl = false;

    type = jstr(pt, "type");
    if (type == NULL || strcmp(type, "Sequence") != 0)
        return TERR("tokenizer: %s: pre_tokenizer %s is not supported (only "
            "a Sequence of Split and ByteLevel)", path,
            type ? type : "(missing)");
    list = jget(pt, "pretokenizers");
    if (list == NULL || !json_object_is_type(list, json_type_array))
        return TERR("tokenizer: %s: pre_tokenizer.pretokenizers missing",
            path);
    n = json_object_array_length(list);
    *npats = 0;
    for (i = 0; i < n; i++) {
        p = json_object_array_get_idx(list, i);
        type = jstr(p, "type");
        if (type == NULL)
            return TERR("tokenizer: %s: pretokenizers[%zu] has no type",
                path, i);
        if (seen_bl)
            return TERR("tokenizer: %s: pretokenizers[%zu] (%s) after "
                "ByteLevel is not supported", path, i, type);
        if (strcmp(type, "ByteLevel") == 0) {
            if (jflag(p, "add_prefix_space") || jflag(p, "use_regex"))
                return TERR("tokenizer: %s: ByteLevel pre-tokenizer with "
                    "add_prefix_space or use_regex is not supported", path);
            seen_bl = true;
            continue;
        }
        if (strcmp(type, "Split") != 0)
            return TERR("tokenizer: %s: pre-tokenizer %s is not supported",
                path, type);
        beh = jstr(p, "behavior");
        if (beh == NULL || strcmp(beh, "Isolated") != 0 ||
            jflag(p, "invert"))
            return TERR("tokenizer: %s: Split behavior %s (invert %d) is not "
                "supported (only Isolated, not inverted)", path,
                beh ? beh : "(missing)", (int)jflag(p, "invert"));
        pat = jget(p, "pattern");
        if (jstr(pat, "Regex") == NULL)
            return TERR("tokenizer: %s: pretokenizers[%zu]: only "
                "{\"Regex\": ...} patterns are supported", path, i);
        if (*npats >= TOK_MAX_SPLITS)
            return TERR("tokenizer: %s: more than %d Split pre-tokenizers",
                path, TOK_MAX_SPLITS);
        pats[(*npats)++] = jstr(pat, "Regex");
    }
    if (!seen_bl)
        return TERR("tokenizer: %s: no ByteLevel pre-tokenizer (only "
            "byte-level BPE is supported)", path);
    return DSV4_OK;
}

static enum dsv4_err
check_model(json_object *model, const char *path)
{
    const char *type = jstr(model, "type");
    json_object *v;

    if (type == NULL || strcmp(type, "BPE") != 0)
        return TERR("tokenizer: %s: model type %s is not supported (only "
            "BPE)", path, type ? type : "(missing)");
    v = jget(model, "dropout");
    if (v != NULL && !json_object_is_type(v, json_type_null))
        return TERR("tokenizer: %s: BPE dropout is not supported", path);
    if (jflag(model, "byte_fallback") || jflag(model, "ignore_merges") ||
        !jempty(model, "continuing_subword_prefix") ||
        !jempty(model, "end_of_word_suffix"))
        return TERR("tokenizer: %s: BPE byte_fallback, ignore_merges or "
            "subword prefix/suffix are not supported", path);
    v = jget(model, "vocab");
    if (v == NULL || !json_object_is_type(v, json_type_object))
        return TERR("tokenizer: %s: model.vocab missing", path);
    v = jget(model, "merges");
    if (v == NULL || !json_object_is_type(v, json_type_array))
        return TERR("tokenizer: %s: model.merges missing", path);
    return DSV4_OK;
}

/* Highest id in vocab and added_tokens, validating their types. */
static enum dsv4_err
max_id(json_object *vocab, json_object *added, const char *path,
    int32_t *out)
{
    int64_t m = -1, id;
    json_object *a, *v;
    size_t i, n;

    json_object_object_foreach(vocab, key, val) {
        if (!json_object_is_type(val, json_type_int))
            return TERR("tokenizer: %s: vocab entry \"%s\" is not an "
                "integer", path, key);
        id = json_object_get_int64(val);
        if (id < 0 || id >= TOK_MAX_IDS)
            return TERR("tokenizer: %s: vocab id %lld out of range", path,
                (long long)id);
        if (id > m)
            m = id;
    }
    n = json_object_array_length(added);
    for (i = 0; i < n; i++) {
        a = json_object_array_get_idx(added, i);
        v = jget(a, "id");
        if (v == NULL || !json_object_is_type(v, json_type_int) ||
            jstr(a, "content") == NULL)
            return TERR("tokenizer: %s: added_tokens[%zu] needs an integer "
                "id and a string content", path, i);
        id = json_object_get_int64(v);
        if (id < 0 || id >= TOK_MAX_IDS)
            return TERR("tokenizer: %s: added token id %lld out of range",
                path, (long long)id);
        if (id > m)
            m = id;
    }
    if (m < 255)
        return TERR("tokenizer: %s: vocabulary too small", path);
    *out = (int32_t)(m + 1);
    return DSV4_OK;
}

static enum dsv4_err
load_vocab(struct dsv4_tok *tok, json_object *vocab, const char *path)
{
    int16_t cp_to_byte[0x144];
    unsigned char *buf = NULL;
    size_t bufcap = 0, klen;
    long n;
    int32_t id, b;
    enum dsv4_err e;

    bytelevel_table(cp_to_byte);
    json_object_object_foreach(vocab, key, val) {
        id = (int32_t)json_object_get_int64(val);
        klen = strlen(key);
        if (klen == 0) {
            free(buf);
            return TERR("tokenizer: %s: empty vocab entry (id %d)", path,
                id);
        }
        if (tok->kind[id] != TOK_NONE) {
            free(buf);
            return TERR("tokenizer: %s: vocab id %d used twice", path, id);
        }
        if (klen > bufcap) {
            bufcap = klen * 2;
            free(buf);
            if ((buf = malloc(bufcap)) == NULL)
                return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of "
                    "memory");
        }
        n = bytelevel_decode(cp_to_byte, key, klen, buf);
        /* A token outside the byte-level alphabet decodes to its own text
         * (what tokenizers' ByteLevel decoder does); BPE never makes it. */
        e = n < 0 ? blob_add(tok, id, key, klen) :
            blob_add(tok, id, buf, (size_t)n);
        if (e != DSV4_OK) {
            free(buf);
            return e;
        }
        tok->kind[id] = n < 0 ? TOK_ADDED : TOK_VOCAB;
    }
    free(buf);
    for (id = 0; id < tok->nids; id++)
        if (tok->kind[id] == TOK_VOCAB) {
            size_t pl;
            const char *p = tok_piece_at(tok, id, &pl);

            if (tok_vocab_find(tok, p, pl) >= 0)
                return TERR("tokenizer: %s: two vocab entries for the "
                    "same bytes (id %d)", path, id);
            vocab_insert(tok, id);
        }
    for (b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;

        tok->byte_id[b] = tok_vocab_find(tok, &c, 1);
        if (tok->byte_id[b] < 0)
            return TERR("tokenizer: %s: byte 0x%02x has no token (the "
                "vocabulary must hold all 256 byte-level symbols)", path, b);
    }
    /* Ids that are vocab entries outside the alphabet were marked
     * TOK_ADDED above only temporarily; they stay decodable. */
    for (id = 0; id < tok->nids; id++)
        if (tok->kind[id] == TOK_ADDED)
            tok->kind[id] = TOK_VOCAB;
    return DSV4_OK;
}

/* Split one merges entry ("a b" or ["a", "b"]) into byte-level strings. */
static enum dsv4_err
merge_parts(json_object *m, size_t idx, const char *path, const char **a,
    size_t *alen, const char **b, size_t *blen)
{
    const char *s, *sp;

    if (json_object_is_type(m, json_type_string)) {
        s = json_object_get_string(m);
        sp = strchr(s, ' ');
        if (sp == NULL || sp == s || sp[1] == '\0' || strchr(sp + 1, ' '))
            return TERR("tokenizer: %s: merges[%zu] \"%s\" is not \"a b\"",
                path, idx, s);
        *a = s;
        *alen = (size_t)(sp - s);
        *b = sp + 1;
        *blen = strlen(sp + 1);
        return DSV4_OK;
    }
    if (json_object_is_type(m, json_type_array) &&
        json_object_array_length(m) == 2 &&
        json_object_is_type(json_object_array_get_idx(m, 0),
        json_type_string) &&
        json_object_is_type(json_object_array_get_idx(m, 1),
        json_type_string)) {
        *a = json_object_get_string(json_object_array_get_idx(m, 0));
        *alen = strlen(*a);
        *b = json_object_get_string(json_object_array_get_idx(m, 1));
        *blen = strlen(*b);
        return DSV4_OK;
    }
    return TERR("tokenizer: %s: merges[%zu] is neither \"a b\" nor [a, b]",
        path, idx);
}

static enum dsv4_err
load_merges(struct dsv4_tok *tok, json_object *merges, const char *path)
{
    int16_t cp_to_byte[0x144];
    size_t i, n = json_object_array_length(merges), alen = 0, blen = 0;
    const char *a = NULL, *b = NULL;
    unsigned char *buf = NULL;
    size_t bufcap = 0;
    long na, nb;
    int32_t ia, ib, ir;
    enum dsv4_err e;

    if (n > (size_t)TOK_MAX_IDS)
        return TERR("tokenizer: %s: too many merges (%zu)", path, n);
    bytelevel_table(cp_to_byte);
    tok->merge_mask = pow2_at_least((uint32_t)n * 2 + 1) - 1;
    tok->merges = malloc(((size_t)tok->merge_mask + 1) *
        sizeof(*tok->merges));
    if (tok->merges == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
    for (i = 0; i <= tok->merge_mask; i++)
        tok->merges[i].key = UINT64_MAX;
    for (i = 0; i < n; i++) {
        e = merge_parts(json_object_array_get_idx(merges, i), i, path, &a,
            &alen, &b, &blen);
        if (e != DSV4_OK)
            goto fail;
        if (alen + blen > bufcap) {
            bufcap = (alen + blen) * 2;
            free(buf);
            if ((buf = malloc(bufcap)) == NULL) {
                e = dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
                goto fail;
            }
        }
        na = bytelevel_decode(cp_to_byte, a, alen, buf);
        nb = na < 0 ? -1 : bytelevel_decode(cp_to_byte, b, blen, buf + na);
        if (na < 0 || nb < 0 ||
            (ia = tok_vocab_find(tok, buf, (size_t)na)) < 0 ||
            (ib = tok_vocab_find(tok, buf + na, (size_t)nb)) < 0 ||
            (ir = tok_vocab_find(tok, buf, (size_t)(na + nb))) < 0) {
            e = TERR("tokenizer: %s: merges[%zu] \"%.*s\" + \"%.*s\": a part "
                "or the result is not in the vocabulary", path, i, (int)alen,
                a, (int)blen, b);
            goto fail;
        }
        merge_put(tok, ia, ib, (int32_t)i, ir);
    }
    free(buf);
    return DSV4_OK;
fail:
    free(buf);
    return e;
}

static enum dsv4_err
load_added(struct dsv4_tok *tok, json_object *added, const char *path)
{
    size_t i, n = json_object_array_length(added), total = 0, clen;
    json_object *a;
    const char *c;
    int32_t id;
    enum dsv4_err e;

    for (i = 0; i < n; i++)
        total += strlen(jstr(json_object_array_get_idx(added, i),
            "content"));
    if (total > (size_t)TOK_MAX_IDS)
        return TERR("tokenizer: %s: added tokens too long", path);
    tok->trie.node_id = malloc((total + 1) * sizeof(int32_t));
    tok->trie.edge_mask = 1023;
    tok->trie.edge_key = calloc(1024, sizeof(uint64_t));
    tok->trie.edge_child = malloc(1024 * sizeof(int32_t));
    if (tok->trie.node_id == NULL || tok->trie.edge_key == NULL ||
        tok->trie.edge_child == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
    for (i = 0; i < 256; i++)
        tok->trie.root[i] = -1;
    for (i = 0; i < n; i++) {
        a = json_object_array_get_idx(added, i);
        id = (int32_t)json_object_get_int64(jget(a, "id"));
        c = jstr(a, "content");
        clen = strlen(c);
        if (clen == 0)
            return TERR("tokenizer: %s: added token %d has empty content",
                path, id);
        if (jflag(a, "lstrip") || jflag(a, "rstrip") ||
            jflag(a, "single_word"))
            return TERR("tokenizer: %s: added token \"%s\": lstrip, rstrip "
                "and single_word are not supported", path, c);
        if ((e = blob_add(tok, id, c, clen)) != DSV4_OK)
            return e;
        tok->kind[id] = jflag(a, "special") ? TOK_SPECIAL : TOK_ADDED;
        e = trie_add(&tok->trie, (const unsigned char *)c, clen, id,
            (int32_t)total + 1);
        if (e != DSV4_OK)
            return e;
    }
    tok->bos = dsv4_tok_added_id(tok, "<\xef\xbd\x9c" "begin\xe2\x96\x81"
        "of\xe2\x96\x81" "sentence\xef\xbd\x9c>", 0);
    tok->eos = dsv4_tok_added_id(tok, "<\xef\xbd\x9c" "end\xe2\x96\x81"
        "of\xe2\x96\x81" "sentence\xef\xbd\x9c>", 0);
    return DSV4_OK;
}

static enum dsv4_err
load_json(struct dsv4_tok *tok, json_object *root, const char *path)
{
    json_object *model = jget(root, "model"), *vocab, *added;
    const char *pats[TOK_MAX_SPLITS];
    int npats = 0;
    int32_t id;
    enum dsv4_err e;

    if (!json_object_is_type(root, json_type_object))
        return TERR("tokenizer: %s: not a JSON object", path);
    if ((e = check_components(root, path)) != DSV4_OK ||
        (e = parse_pretok(root, path, pats, &npats)) != DSV4_OK ||
        (e = check_model(model, path)) != DSV4_OK)
        return e;
    vocab = jget(model, "vocab");
    added = jget(root, "added_tokens");
    if (added == NULL || !json_object_is_type(added, json_type_array))
        return TERR("tokenizer: %s: added_tokens missing", path);
    if ((e = max_id(vocab, added, path, &tok->nids)) != DSV4_OK)
        return e;
    tok->kind = calloc((size_t)tok->nids, 1);
    tok->piece_off = calloc((size_t)tok->nids, sizeof(uint32_t));
    tok->piece_len = calloc((size_t)tok->nids, sizeof(uint32_t));
    tok->vocab.mask = pow2_at_least((uint32_t)tok->nids * 2) - 1;
    tok->vocab.slot = malloc(((size_t)tok->vocab.mask + 1) *
        sizeof(int32_t));
    if (tok->kind == NULL || tok->piece_off == NULL ||
        tok->piece_len == NULL || tok->vocab.slot == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
    memset(tok->vocab.slot, 0xff, ((size_t)tok->vocab.mask + 1) *
        sizeof(int32_t));
    if ((e = load_vocab(tok, vocab, path)) != DSV4_OK ||
        (e = load_merges(tok, jget(model, "merges"), path)) != DSV4_OK ||
        (e = load_added(tok, added, path)) != DSV4_OK)
        return e;
    for (id = 0; id < tok->nids; id++)
        if (tok->kind[id] == TOK_NONE)
            return TERR("tokenizer: %s: id %d is neither in the vocabulary "
                "nor an added token", path, id);
    return tok_pretok_init(tok, pats, npats, path);
}

enum dsv4_err
dsv4_tok_load(struct dsv4_tok **out, const char *path,
    enum dsv4_tok_flavor flavor)
{
    struct dsv4_tok *tok;
    struct json_tokener *jt;
    json_object *root;
    char *buf = NULL;
    size_t len = 0;
    enum dsv4_err e;

    *out = NULL;
    if (path == NULL)
        path = dsv4_tok_default_path();
    if (flavor != DSV4_TOK_HF && flavor != DSV4_TOK_PYPKG)
        return dsv4_err_set(DSV4_ERR_INVAL, "tokenizer: unknown flavor %d",
            (int)flavor);
    if ((e = read_file(path, &buf, &len)) != DSV4_OK)
        return e;
    jt = json_tokener_new();
    if (jt == NULL) {
        free(buf);
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
    }
    root = json_tokener_parse_ex(jt, buf, (int)len);
    if (root == NULL || json_tokener_get_error(jt) != json_tokener_success ||
        json_tokener_get_parse_end(jt) < len) {
        e = TERR("tokenizer: %s: invalid JSON near byte %zu: %s", path,
            json_tokener_get_parse_end(jt),
            json_tokener_get_error(jt) == json_tokener_success ?
            "trailing data or truncated file" :
            /* json-c's word for a document that ends early */
            json_tokener_get_error(jt) == json_tokener_continue ?
            "the file ends inside the JSON (empty or truncated)" :
            json_tokener_error_desc(json_tokener_get_error(jt)));
        json_object_put(root);
        json_tokener_free(jt);
        free(buf);
        return e;
    }
    json_tokener_free(jt);
    free(buf);
    tok = calloc(1, sizeof(*tok));
    if (tok == NULL) {
        json_object_put(root);
        return dsv4_err_set(DSV4_ERR_NOMEM, "tokenizer: out of memory");
    }
    tok->flavor = flavor;
    tok->bos = tok->eos = -1;
    e = load_json(tok, root, path);
    json_object_put(root);
    if (e != DSV4_OK) {
        dsv4_tok_free(tok);
        return e;
    }
    *out = tok;
    return DSV4_OK;
}

void
dsv4_tok_free(struct dsv4_tok *tok)
{
    if (tok == NULL)
        return;
    tok_pretok_free(tok);
    free(tok->kind);
    free(tok->piece_off);
    free(tok->piece_len);
    free(tok->blob);
    free(tok->vocab.slot);
    free(tok->merges);
    free(tok->trie.node_id);
    free(tok->trie.edge_key);
    free(tok->trie.edge_child);
    free(tok);
}

