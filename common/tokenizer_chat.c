/*
 * tokenizer_chat.c — the DeepSeek-V4 chat prompt: render system / user /
 * developer / assistant turns the way encoding_dsv4.py's encode_messages()
 * does (thinking and chat modes, dropping of old reasoning, the "max"
 * reasoning-effort preamble), either to a string or straight to ids with
 * the markers as ids and the message text encoded as plain text.
 * docs/tokenizer.md ("Chat format") lists the rules R0..R7 cited below.
 * Not supported (rejected by the API's shape): tools, tool calls and tool
 * results, response_format, tasks, latest_reminder, context prefixes.
 */
#include "common/tokenizer_impl.h"

#include <stdlib.h>
#include <string.h>

#define M_BOS "<\xef\xbd\x9c" "begin\xe2\x96\x81" "of\xe2\x96\x81" \
    "sentence\xef\xbd\x9c>"
#define M_EOS "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" \
    "sentence\xef\xbd\x9c>"
#define M_USER "<\xef\xbd\x9cUser\xef\xbd\x9c>"
#define M_ASSISTANT "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>"
#define M_THINK "<think>"
#define M_END_THINK "</think>"

/* R3: prepended to the first message in thinking mode with
 * reasoning_effort "max" (text fixed by the model's training format). */
static const char effort_max_text[] =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively "
    "decompose the problem to resolve the root cause, rigorously "
    "stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting "
    "every intermediate step, considered alternative, and rejected "
    "hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/* Where rendered output goes: a string, or ids (tok != NULL). */
struct chat_sink {
    struct dsv4_tok_text *text;         /* string mode */
    struct dsv4_tok *tok;               /* ids mode */
    struct dsv4_tok_ids *ids;
    struct dsv4_tok_text pend;          /* ids mode: text since last marker */
};

/* A turn after R1 (consecutive user messages merged). */
struct chat_turn {
    enum dsv4_chat_role role;
    const struct dsv4_chat_msg *msg;    /* first message of the turn */
    size_t nmsg;                        /* > 1 only for merged user turns */
    bool drop_reasoning;                /* R2 */
};

static enum dsv4_err
sink_text(struct chat_sink *k, const char *s)
{
    if (s == NULL || *s == '\0')
        return DSV4_OK;
    return tok_text_append(k->tok ? &k->pend : k->text, s, strlen(s));
}

static enum dsv4_err
sink_flush(struct chat_sink *k)
{
    enum dsv4_err e;

    if (k->tok == NULL || k->pend.len == 0)
        return DSV4_OK;
    e = dsv4_tok_encode(k->tok, k->pend.s, k->pend.len, 0, k->ids);
    k->pend.len = 0;
    return e;
}

static enum dsv4_err
sink_marker(struct chat_sink *k, const char *marker)
{
    int32_t id;
    enum dsv4_err e;

    if (k->tok == NULL)
        return tok_text_append(k->text, marker, strlen(marker));
    if ((e = sink_flush(k)) != DSV4_OK)
        return e;
    id = dsv4_tok_added_id(k->tok, marker, 0);
    if (id < 0)
        return dsv4_err_set(DSV4_ERR_TOKENIZER, "chat: marker %s is not an "
            "added token of this tokenizer", marker);
    return tok_ids_push(k->ids, id);
}

static bool
is_user_like(enum dsv4_chat_role r)
{
    return r == DSV4_CHAT_USER || r == DSV4_CHAT_DEVELOPER;
}

/* R1 and R2: merge user runs; in thinking mode with dropping, remove
 * reasoning before the last user turn and developer turns before it. */
static size_t
chat_turns(const struct dsv4_chat_msg *msgs, size_t n,
    const struct dsv4_chat_opts *o, struct chat_turn *t)
{
    size_t i, nt = 0, last_user = SIZE_MAX, out = 0;

    for (i = 0; i < n; i++) {
        if (msgs[i].role == DSV4_CHAT_USER && nt > 0 &&
            t[nt - 1].role == DSV4_CHAT_USER) {
            t[nt - 1].nmsg++;
            continue;
        }
        t[nt].role = msgs[i].role;
        t[nt].msg = &msgs[i];
        t[nt].nmsg = 1;
        t[nt].drop_reasoning = false;
        nt++;
    }
    if (!o->thinking || o->keep_reasoning)
        return nt;
    for (i = 0; i < nt; i++)
        if (is_user_like(t[i].role))
            last_user = i;
    for (i = 0; i < nt; i++) {
        if (last_user != SIZE_MAX && i < last_user) {
            if (t[i].role == DSV4_CHAT_DEVELOPER)
                continue;
            if (t[i].role == DSV4_CHAT_ASSISTANT)
                t[i].drop_reasoning = true;
        }
        t[out++] = t[i];
    }
    return out;
}

static enum dsv4_err
chat_emit(const struct dsv4_chat_msg *msgs, size_t n,
    const struct dsv4_chat_opts *o, struct chat_sink *k)
{
    struct chat_turn *t;
    size_t nt, i, j, last_user = SIZE_MAX;
    bool think_open;
    enum dsv4_err e = DSV4_OK;

    for (i = 0; i < n; i++) {
        if (msgs[i].role != DSV4_CHAT_SYSTEM &&
            msgs[i].role != DSV4_CHAT_USER &&
            msgs[i].role != DSV4_CHAT_ASSISTANT &&
            msgs[i].role != DSV4_CHAT_DEVELOPER)
            return dsv4_err_set(DSV4_ERR_INVAL, "chat: message %zu has "
                "unknown role %d", i, (int)msgs[i].role);
        if (msgs[i].role == DSV4_CHAT_DEVELOPER &&
            (msgs[i].content == NULL || msgs[i].content[0] == '\0'))
            return dsv4_err_set(DSV4_ERR_INVAL, "chat: developer message "
                "%zu is empty", i);
    }
    if ((t = calloc(n ? n : 1, sizeof(*t))) == NULL)
        return dsv4_err_set(DSV4_ERR_NOMEM, "chat: out of memory");
    nt = chat_turns(msgs, n, o, t);
    for (i = 0; i < nt; i++)
        if (is_user_like(t[i].role))
            last_user = i;
    if (!o->no_bos)
        e = sink_marker(k, M_BOS);                              /* R0 */
    for (i = 0; e == DSV4_OK && i < nt; i++) {
        if (i == 0 && o->thinking && o->effort_max)
            e = sink_text(k, effort_max_text);                  /* R3 */
        if (e != DSV4_OK)
            break;
        switch (t[i].role) {
        case DSV4_CHAT_SYSTEM:                                  /* R4 */
            e = sink_text(k, t[i].msg->content);
            break;
        case DSV4_CHAT_DEVELOPER:                               /* R5 */
            if ((e = sink_marker(k, M_USER)) == DSV4_OK)
                e = sink_text(k, t[i].msg->content);
            break;
        case DSV4_CHAT_USER:                                    /* R5 */
            e = sink_marker(k, M_USER);
            for (j = 0; e == DSV4_OK && j < t[i].nmsg; j++) {
                if (j > 0)
                    e = sink_text(k, "\n\n");
                if (e == DSV4_OK)
                    e = sink_text(k, t[i].msg[j].content);
            }
            break;
        case DSV4_CHAT_ASSISTANT:                               /* R6 */
            if (o->thinking && !t[i].drop_reasoning &&
                (o->keep_reasoning || last_user == SIZE_MAX ||
                i > last_user)) {
                if ((e = sink_text(k, t[i].msg->reasoning)) == DSV4_OK)
                    e = sink_marker(k, M_END_THINK);
            }
            if (e == DSV4_OK)
                e = sink_text(k, t[i].msg->content);
            if (e == DSV4_OK)
                e = sink_marker(k, M_EOS);
            break;
        }
        if (e != DSV4_OK)
            break;
        /* R7: a user turn that is last or followed by the assistant opens
         * the assistant turn. */
        if (!is_user_like(t[i].role) ||
            (i + 1 < nt && t[i + 1].role != DSV4_CHAT_ASSISTANT))
            continue;
        think_open = o->thinking && (o->keep_reasoning ||
            last_user == SIZE_MAX || i >= last_user);
        if ((e = sink_marker(k, M_ASSISTANT)) == DSV4_OK)
            e = sink_marker(k, think_open ? M_THINK : M_END_THINK);
    }
    free(t);
    if (e == DSV4_OK)
        e = sink_flush(k);
    return e;
}

enum dsv4_err
dsv4_chat_render(const struct dsv4_chat_msg *msgs, size_t n,
    const struct dsv4_chat_opts *opts, struct dsv4_tok_text *out)
{
    struct chat_sink k = { .text = out };
    enum dsv4_err e;

    if ((e = tok_text_append(out, NULL, 0)) != DSV4_OK)
        return e;
    return chat_emit(msgs, n, opts, &k);
}

enum dsv4_err
dsv4_chat_encode(struct dsv4_tok *tok, const struct dsv4_chat_msg *msgs,
    size_t n, const struct dsv4_chat_opts *opts, struct dsv4_tok_ids *out)
{
    struct chat_sink k = { .tok = tok, .ids = out };
    enum dsv4_err e;

    e = chat_emit(msgs, n, opts, &k);
    dsv4_tok_text_free(&k.pend);
    return e;
}

enum dsv4_err
dsv4_chat_markers_check(const struct dsv4_tok *tok)
{
    static const char *const markers[] = { M_BOS, M_EOS, M_USER, M_ASSISTANT, M_THINK,
                                           M_END_THINK };

    for (size_t i = 0; i < sizeof(markers) / sizeof(markers[0]); i++)
        if (dsv4_tok_added_id(tok, markers[i], 0) < 0)
            return dsv4_err_set(DSV4_ERR_TOKENIZER, "chat: marker %s is not an added token "
                "of this tokenizer (not DeepSeek-V4's tokenizer.json?)", markers[i]);
    return DSV4_OK;
}

int32_t
dsv4_chat_think_id(const struct dsv4_tok *tok)
{
    return dsv4_tok_added_id(tok, M_THINK, 0);
}
