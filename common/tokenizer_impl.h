/*
 * tokenizer_impl.h — private layout of struct dsv4_tok, shared by
 * tokenizer.c (loading, tables, decode), tokenizer_encode.c (pre-tokenizer,
 * BPE, cache) and tokenizer_chat.c.  Not installed; include only from those.
 *
 * Ids are int32 in [0, nids).  Every id has a piece: its raw bytes (the
 * byte-level alphabet of the vocabulary already mapped back to bytes, or an
 * added token's content), stored in one blob.
 */
#ifndef DSV4_COMMON_TOKENIZER_IMPL_H
#define DSV4_COMMON_TOKENIZER_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "common/tokenizer.h"

#define TOK_MAX_SPLITS 8        /* Split pre-tokenizers in the Sequence */

/* Per-id kind. */
enum tok_kind {
    TOK_NONE = 0,               /* id not defined by the file */
    TOK_VOCAB,                  /* BPE vocabulary entry */
    TOK_ADDED,                  /* added token, special false */
    TOK_SPECIAL,                /* added token, special true */
};

/* Open-addressing table: raw bytes -> vocabulary id (BPE lookups). */
struct tok_strmap {
    int32_t *slot;              /* id, or -1 = empty */
    uint32_t mask;              /* capacity - 1, power of two */
};

/* Open-addressing table: (left id, right id) -> merge rank and result. */
struct tok_merge {
    uint64_t key;               /* left << 32 | right; UINT64_MAX = empty */
    int32_t rank;               /* position in "merges"; lower merges first */
    int32_t id;                 /* id of the merged token */
};

/* Byte trie over added-token contents, for leftmost-longest matching. */
struct tok_trie {
    int32_t root[256];          /* child of the root per byte, -1 = none */
    int32_t *node_id;           /* per node: token id ending here, or -1 */
    uint64_t *edge_key;         /* hash of (node << 8 | byte) + 1; 0 = empty */
    int32_t *edge_child;
    uint32_t edge_mask;
    int32_t nnodes;
};

/* Pre-token -> ids cache (short pieces only); wiped when full. */
struct tok_cache {
    uint32_t *slot_hash;        /* 0 = empty (hashes are forced non-zero) */
    uint32_t *slot_off;         /* entry offset in arena */
    uint32_t mask;
    uint32_t used;
    unsigned char *arena;       /* entries: u16 len, u16 nids, bytes, ids */
    size_t arena_len;
    size_t arena_cap;
};

/* A loaded tokenizer (common/tokenizer.h's opaque type): its flavour, the
 * vocabulary, merges, added tokens and pre-tokenizer. */
struct dsv4_tok {
    enum dsv4_tok_flavor flavor;
    int32_t nids;               /* highest id + 1 */
    unsigned char *kind;        /* [nids] enum tok_kind */
    uint32_t *piece_off;        /* [nids] offset of the piece in blob */
    uint32_t *piece_len;        /* [nids] its length in bytes */
    char *blob;
    size_t blob_len, blob_cap;
    int32_t byte_id[256];       /* id of the single-byte token per byte */
    int32_t bos, eos;

    struct tok_strmap vocab;
    struct tok_merge *merges;
    uint32_t merge_mask;
    struct tok_trie trie;

    /* Pre-tokenizer: Split patterns applied in order. */
    int nsplit;
    pcre2_code *split[TOK_MAX_SPLITS];
    pcre2_match_data *md;       /* sized for the largest pattern */
    bool jit;                   /* every pattern JIT-compiled */
    pcre2_jit_stack *jit_stack;
    pcre2_match_context *mctx;

    struct tok_cache cache;

    /* BPE scratch, grown to the longest pre-token seen. */
    int32_t *w_id;
    int32_t *w_prev;
    int32_t *w_next;
    uint64_t *w_heap;
    size_t w_cap;
};

/* Hash of a byte string; never 0. */
uint32_t tok_hash_bytes(const unsigned char *s, size_t n);

/* 64-bit mixer for the integer-keyed tables. */
static inline uint32_t
tok_hash_u64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return (uint32_t)k;
}

/* Vocabulary id of the raw bytes s[0..n) (BPE tokens only), or -1. */
int32_t tok_vocab_find(const struct dsv4_tok *tok, const void *s, size_t n);

/* Piece of id (no range check). */
static inline const char *
tok_piece_at(const struct dsv4_tok *tok, int32_t id, size_t *len)
{
    *len = tok->piece_len[id];
    return tok->blob + tok->piece_off[id];
}

/* Lengths of the longest well-formed UTF-8 prefix of s[0..n). */
size_t tok_utf8_valid_prefix(const unsigned char *s, size_t n);

/* Length of the well-formed UTF-8 sequence starting at s[0] (1..4), or 0 if
 * s[0..n) does not start with one (including a truncated sequence). */
size_t tok_utf8_seq(const unsigned char *s, size_t n);

/* Append helpers (DSV4_ERR_NOMEM on failure, message set). */
enum dsv4_err tok_ids_push(struct dsv4_tok_ids *ids, int32_t id);
enum dsv4_err tok_text_reserve(struct dsv4_tok_text *t, size_t extra);
enum dsv4_err tok_text_append(struct dsv4_tok_text *t, const void *b,
    size_t n);

/* tokenizer.c: merge of the pair (a, b) or NULL; trie step (node -1 =
 * root) or -1. */
const struct tok_merge *tok_merge_find(const struct dsv4_tok *tok,
    int32_t a, int32_t b);
int32_t tok_trie_next(const struct tok_trie *t, int32_t node, unsigned char c);

/* tokenizer_encode.c: set up / tear down the pre-tokenizer and cache. */
enum dsv4_err tok_pretok_init(struct dsv4_tok *tok, const char **patterns,
    int npatterns, const char *path);
void tok_pretok_free(struct dsv4_tok *tok);

#endif
