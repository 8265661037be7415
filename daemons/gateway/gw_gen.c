/*
 * gw_gen.c — POST /v1/completions and /v1/chat/completions: the OpenAI
 * request body (json-c) into one libdsv4client request, and its events back
 * into OpenAI JSON (one answer) or server-sent events (stream: true).
 *
 * Chat prompts are rendered and tokenized here with the DeepSeek-V4 rules
 * (dsv4_chat_encode: message text never becomes markers) and sent as token
 * ids; completion prompts go as text (the scheduler tokenizes, exactly as
 * for any libdsv4client user) or as token ids.  Every request stops on EOS
 * (whose text is not part of the answer).  The calling connection thread
 * blocks on its own dsv4_client connection; every wait is sliced into
 * GW_POLL_MS steps that check the HTTP peer is still there, so a client that
 * goes away cancels its request within one slice.
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <json-c/json.h>

#include "common/log.h"
#include "daemons/gateway/gateway.h"
#include "dsv4/client.h"
#include "ipc/zsock.h"

#define GW_MAX_MESSAGES 4096   /* chat turns of one request */
#define GW_MAX_STOP 16         /* stop strings (protocol limit) */

struct gw_gen {
    struct gw *g;
    struct MHD_Connection *conn;
    enum gw_route route;
    bool chat, stream, include_usage, logprobs, thinking, return_ids;
    char id[48];
    int64_t created;
    struct dsv4_client *c;
    uint64_t cid;
    bool submitted, accepted, final, counted;
    int finish;                      /* DONE: enum dsv4_client_finish */
    int err_code;                    /* ERROR: protocol code */
    char err_msg[512];
    uint32_t prompt_tokens, completion_tokens;
    int64_t t_submit, t_last, deadline;
    uint64_t n_out;                  /* output tokens seen */
    bool in_reasoning;               /* thinking mode: before </think> */
    struct dsv4_tok_text content, reasoning;
    struct dsv4_tok_ids ids, prompt_ids;
    float *lps;
    size_t lps_cap;
    char *out;                       /* SSE bytes not yet handed to MHD */
    size_t out_len, out_off, out_cap;
    bool sse_end;                    /* [DONE] queued */
    enum gw_outcome outcome;
};

static int64_t
gw_now_ms(void)
{
    return dsv4_now_ms();
}

/* --- small helpers ------------------------------------------------------- */

/* Append n bytes to t (kept NUL-terminated); -1 when out of memory. */
static int
gw_text_add(struct dsv4_tok_text *t, const char *s, size_t n)
{
    size_t ncap;
    char *nb;

    if (t->len + n + 1 > t->cap) {
        ncap = t->cap != 0 ? t->cap : 256;
        while (ncap < t->len + n + 1)
            ncap *= 2;
        if ((nb = realloc(t->s, ncap)) == NULL)
            return -1;
        t->s = nb;
        t->cap = ncap;
    }
    if (n > 0)
        memcpy(t->s + t->len, s, n);
    t->len += n;
    t->s[t->len] = '\0';
    return 0;
}

/* The bytes of t from `off` on ("" when t is empty). */
static const char *
gw_text_at(const struct dsv4_tok_text *t, size_t off)
{
    return t->s != NULL ? t->s + off : "";
}

/* A JSON string of raw bytes that may be invalid UTF-8: each maximal
 * ill-formed part becomes U+FFFD (the tokenizer's stream rule). */
static json_object *
gw_json_bytes(const char *s, size_t n)
{
    struct dsv4_tok_stream st;
    struct dsv4_tok_text t = { 0 };
    json_object *o;

    st.tok = NULL;
    st.npend = 0;
    if (dsv4_tok_stream_bytes(&st, s, n, &t) != DSV4_OK ||
        dsv4_tok_stream_flush(&st, &t) != DSV4_OK) {
        dsv4_tok_text_free(&t);
        return json_object_new_string("");
    }
    o = json_object_new_string_len(t.s != NULL ? t.s : "", (int)t.len);
    dsv4_tok_text_free(&t);
    return o;
}

static char *
gw_json_dump(json_object *o, size_t *len)
{
    const char *s = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN |
        JSON_C_TO_STRING_NOSLASHESCAPE);
    char *d = strdup(s);

    if (d != NULL && len != NULL)
        *len = strlen(d);
    return d;
}

static int
gw_out_append(struct gw_gen *q, const char *s, size_t n)
{
    char *nb;
    size_t ncap;

    if (n == 0)
        return 0;   /* (q->out may still be NULL: memcpy's arguments must not be) */
    if (q->out_len + n > q->out_cap) {
        ncap = q->out_cap != 0 ? q->out_cap : 4096;
        while (ncap < q->out_len + n)
            ncap *= 2;
        if ((nb = realloc(q->out, ncap)) == NULL)
            return -1;
        q->out = nb;
        q->out_cap = ncap;
    }
    memcpy(q->out + q->out_len, s, n);
    q->out_len += n;
    return 0;
}

/* Queue one SSE event "data: <json>\n\n"; takes the object. */
static void
gw_sse_json(struct gw_gen *q, json_object *o)
{
    size_t n;
    char *s = gw_json_dump(o, &n);

    json_object_put(o);
    if (s == NULL)
        return;
    gw_out_append(q, "data: ", 6);
    gw_out_append(q, s, n);
    gw_out_append(q, "\n\n", 2);
    free(s);
}

/* HTTP status and OpenAI code for a protocol status of an ERROR event. */
static unsigned
gw_http_status(int code, const char **ocode)
{
    switch (code) {
    case DSV4_CLIENT_BUSY: *ocode = "overloaded"; return 429;
    case DSV4_CLIENT_DRAINING: *ocode = "draining"; return 503;
    case DSV4_CLIENT_BAD_MESSAGE:
    case DSV4_CLIENT_BAD_ARGUMENT: *ocode = "invalid_request"; return 400;
    case DSV4_CLIENT_TOO_LARGE: *ocode = "context_length_exceeded"; return 400;
    case DSV4_CLIENT_TIMEOUT: *ocode = "timeout"; return 504;
    case DSV4_CLIENT_NOT_SUPPORTED: *ocode = "not_supported"; return 501;
    case DSV4_CLIENT_NO_MEMORY: *ocode = "out_of_memory"; return 503;
    case DSV4_CLIENT_UNREACHABLE: *ocode = "scheduler_unreachable"; return 503;
    default: *ocode = "internal_error"; return 500;
    }
}

static const char *
gw_finish_name(int finish)
{
    return finish == DSV4_CLIENT_FINISH_LENGTH ? "length" : "stop";
}

/* --- request parsing ----------------------------------------------------- */

/* What the body asked for, pointing into the json-c tree. */
struct gw_ask {
    struct dsv4_client_params p;
    const char *stops[GW_MAX_STOP];
    int32_t stop_ids[1];
    const char *prompt;               /* completions: text prompt */
    int32_t *tokens;                  /* completions: id prompt (malloc'd) */
    size_t n_tokens;
    struct dsv4_chat_msg *msgs;       /* chat (malloc'd) */
    size_t n_msgs;
    struct dsv4_chat_opts copts;
    char tag[64];                     /* p.tag: "gateway <id>" */
};

/* Parse failure: HTTP status, OpenAI code, message. */
struct gw_bad {
    unsigned status;
    const char *code;
    char msg[512];
};

static int
gw_bad(struct gw_bad *b, unsigned status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int
gw_bad(struct gw_bad *b, unsigned status, const char *code, const char *fmt, ...)
{
    va_list ap;

    b->status = status;
    b->code = code;
    va_start(ap, fmt);
    vsnprintf(b->msg, sizeof(b->msg), fmt, ap);
    va_end(ap);
    return -1;
}

/* Whether s[0..n) is JSON white space only (a NUL byte is not: json-c
 * stops at one, so what follows it would go unread). */
static bool
gw_only_blanks(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n')
            return false;
    return true;
}

/* Whether the JSON string x is not text the server takes: a U+0000
 * ("\u0000": the request's strings go on as C strings, which would end
 * there without a word), or bytes that are not well-formed UTF-8 (json-c
 * passes most of them; the scheduler refuses them in a prompt, and the
 * gateway's own chat tokenization would take them as byte tokens). */
static bool
gw_bad_text(json_object *x)
{
    const char *s = json_object_get_string(x);
    size_t n = (size_t)json_object_get_string_len(x);

    return strlen(s) != n || !dsv4_utf8_valid(s, n);
}

/* The text of the JSON string x, or NULL with 400 invalid_value ("WHAT must
 * be UTF-8 text without U+0000") when gw_bad_text refuses it. */
static const char *
gw_text(json_object *x, const char *what, struct gw_bad *b)
{
    if (gw_bad_text(x)) {
        gw_bad(b, 400, "invalid_value", "%s must be UTF-8 text without U+0000", what);
        return NULL;
    }
    return json_object_get_string(x);
}

/* Whether x is the JSON string s (false for null and every other type:
 * json_object_get_string is NULL for a JSON null, and a string of its JSON
 * text for numbers, arrays and objects). */
static bool
gw_str_is(json_object *x, const char *s)
{
    return json_object_get_type(x) == json_type_string && !gw_bad_text(x) &&
        strcmp(json_object_get_string(x), s) == 0;
}

/* Number field: absent/null -> *has false; else range-checked. */
static int
gw_num(json_object *o, const char *key, double lo, double hi, bool integer, double *v,
    bool *has, struct gw_bad *b)
{
    json_object *x;
    enum json_type t;

    *has = false;
    if (!json_object_object_get_ex(o, key, &x) || x == NULL)
        return 0;
    t = json_object_get_type(x);
    if (t != json_type_int && t != json_type_double)
        return gw_bad(b, 400, "invalid_type", "\"%s\" must be a number", key);
    if (integer && t != json_type_int)
        return gw_bad(b, 400, "invalid_type", "\"%s\" must be an integer", key);
    *v = json_object_get_double(x);
    if (isnan(*v) || *v < lo || *v > hi)
        return gw_bad(b, 400, "invalid_value", "\"%s\" = %g is outside %g ... %g", key, *v,
            lo, hi);
    *has = true;
    return 0;
}

static int
gw_bool(json_object *o, const char *key, bool *v, struct gw_bad *b)
{
    json_object *x;

    if (!json_object_object_get_ex(o, key, &x) || x == NULL)
        return 0;
    if (json_object_get_type(x) != json_type_boolean)
        return gw_bad(b, 400, "invalid_type", "\"%s\" must be true or false", key);
    *v = json_object_get_boolean(x);
    return 0;
}

/* Object field: absent/null -> *x NULL; an object -> *x; else 400. */
static int
gw_obj(json_object *o, const char *key, json_object **x, struct gw_bad *b)
{
    if (!json_object_object_get_ex(o, key, x) || *x == NULL) {
        *x = NULL;
        return 0;
    }
    if (json_object_get_type(*x) != json_type_object)
        return gw_bad(b, 400, "invalid_type", "\"%s\" must be an object", key);
    return 0;
}

/* Parameters the server does not implement: refused when set to anything
 * but their neutral value, so a client never silently gets other semantics. */
static int
gw_refuse_unsupported(json_object *o, bool chat, struct gw_bad *b)
{
    static const char *const zero_keys[] = { "presence_penalty", "frequency_penalty" };
    static const char *const null_keys[] = { "suffix", "tools", "functions", "tool_choice",
        "function_call", "logit_bias", "best_of", "response_format", "audio",
        "prediction", "modalities" };
    json_object *x;
    size_t i;

    double v;
    bool has, echo = false;

    for (i = 0; i < sizeof(zero_keys) / sizeof(zero_keys[0]); i++) {
        if (gw_num(o, zero_keys[i], -HUGE_VAL, HUGE_VAL, false, &v, &has, b) != 0)
            return -1;
        if (has && v != 0.0)
            return gw_bad(b, 400, "unsupported_parameter", "\"%s\" is not supported "
                "(only 0)", zero_keys[i]);
    }
    for (i = 0; i < sizeof(null_keys) / sizeof(null_keys[0]); i++) {
        if (!json_object_object_get_ex(o, null_keys[i], &x) || x == NULL)
            continue;
        if (strcmp(null_keys[i], "best_of") == 0 && json_object_get_type(x) == json_type_int &&
            json_object_get_int64(x) == 1)
            continue;
        if (strcmp(null_keys[i], "logit_bias") == 0 &&
            json_object_get_type(x) == json_type_object && json_object_object_length(x) == 0)
            continue;
        if (strcmp(null_keys[i], "response_format") == 0 &&
            json_object_get_type(x) == json_type_object &&
            json_object_object_get_ex(x, "type", &x) && gw_str_is(x, "text"))
            continue;
        return gw_bad(b, 400, "unsupported_parameter", "\"%s\" is not supported by this "
            "server", null_keys[i]);
    }
    if (!chat && gw_bool(o, "echo", &echo, b) != 0)
        return -1;
    if (echo)
        return gw_bad(b, 400, "unsupported_parameter", "\"echo\" is not supported");
    return 0;
}

static int
gw_parse_stop(json_object *o, struct gw_ask *a, struct gw_bad *b)
{
    json_object *x, *e;
    size_t i, n;

    if (!json_object_object_get_ex(o, "stop", &x) || x == NULL)
        return 0;
    if (json_object_get_type(x) == json_type_string) {
        if ((a->stops[0] = gw_text(x, "\"stop\" strings", b)) == NULL)
            return -1;
        a->p.n_stop = 1;
    } else if (json_object_get_type(x) == json_type_array) {
        n = json_object_array_length(x);
        if (n > GW_MAX_STOP)
            return gw_bad(b, 400, "invalid_value", "\"stop\": at most %d strings",
                GW_MAX_STOP);
        for (i = 0; i < n; i++) {
            e = json_object_array_get_idx(x, i);
            if (json_object_get_type(e) != json_type_string)
                return gw_bad(b, 400, "invalid_type", "\"stop\" must hold strings");
            if ((a->stops[i] = gw_text(e, "\"stop\" strings", b)) == NULL)
                return -1;
        }
        a->p.n_stop = n;
    } else {
        return gw_bad(b, 400, "invalid_type", "\"stop\" must be a string or an array");
    }
    for (i = 0; i < a->p.n_stop; i++)
        if (a->stops[i][0] == '\0' || strlen(a->stops[i]) > 256)
            return gw_bad(b, 400, "invalid_value", "\"stop\" strings are 1 ... 256 bytes");
    a->p.stop = a->stops;
    return 0;
}

/* Message content: a string, or an array of {"type": "text", "text": ...}
 * parts (joined).  Returns a string owned by `hold` or by the tree. */
static const char *
gw_content(json_object *x, json_object *hold, struct gw_bad *b)
{
    struct dsv4_tok_text t = { 0 };
    json_object *part, *ty, *tx, *s;
    const char *str;
    size_t i;

    if (x == NULL)
        return "";
    if (json_object_get_type(x) == json_type_string)
        return gw_text(x, "message content", b);
    if (json_object_get_type(x) != json_type_array) {
        gw_bad(b, 400, "invalid_type", "message content must be a string or an array");
        return NULL;
    }
    for (i = 0; i < json_object_array_length(x); i++) {
        part = json_object_array_get_idx(x, i);
        if (!json_object_object_get_ex(part, "type", &ty) || !gw_str_is(ty, "text") ||
            !json_object_object_get_ex(part, "text", &tx) ||
            json_object_get_type(tx) != json_type_string) {
            dsv4_tok_text_free(&t);
            gw_bad(b, 400, "unsupported_content", "only text content parts are supported");
            return NULL;
        }
        if ((str = gw_text(tx, "message content", b)) == NULL) {
            dsv4_tok_text_free(&t);
            return NULL;
        }
        gw_text_add(&t, str, (size_t)json_object_get_string_len(tx));
    }
    s = json_object_new_string_len(t.s != NULL ? t.s : "", (int)t.len);
    dsv4_tok_text_free(&t);
    json_object_array_add(hold, s);
    return json_object_get_string(s);
}

static int
gw_parse_messages(struct gw *g, json_object *o, json_object *hold, struct gw_ask *a,
    struct gw_bad *b)
{
    json_object *x, *m, *r, *c, *rc, *kw;
    const char *role;
    char what[64];
    size_t i, n;

    if (!json_object_object_get_ex(o, "messages", &x) ||
        json_object_get_type(x) != json_type_array || json_object_array_length(x) == 0)
        return gw_bad(b, 400, "invalid_request", "\"messages\" must be a non-empty array");
    n = json_object_array_length(x);
    if (n > GW_MAX_MESSAGES)
        return gw_bad(b, 400, "invalid_value", "at most %d messages", GW_MAX_MESSAGES);
    if ((a->msgs = calloc(n, sizeof(*a->msgs))) == NULL)
        return gw_bad(b, 500, "internal_error", "out of memory");
    for (i = 0; i < n; i++) {
        m = json_object_array_get_idx(x, i);
        if (json_object_get_type(m) != json_type_object ||
            !json_object_object_get_ex(m, "role", &r) ||
            json_object_get_type(r) != json_type_string)
            return gw_bad(b, 400, "invalid_request", "messages[%zu] needs a \"role\"", i);
        role = json_object_get_string(r);
        if (gw_bad_text(r))
            return gw_bad(b, 400, "unsupported_role", "messages[%zu]: the role is not UTF-8 "
                "text without U+0000 (system, user, assistant, developer)", i);
        if (strcmp(role, "system") == 0)
            a->msgs[i].role = DSV4_CHAT_SYSTEM;
        else if (strcmp(role, "user") == 0)
            a->msgs[i].role = DSV4_CHAT_USER;
        else if (strcmp(role, "assistant") == 0)
            a->msgs[i].role = DSV4_CHAT_ASSISTANT;
        else if (strcmp(role, "developer") == 0)
            a->msgs[i].role = DSV4_CHAT_DEVELOPER;
        else
            return gw_bad(b, 400, "unsupported_role", "messages[%zu]: role \"%s\" is not "
                "supported (system, user, assistant, developer)", i, role);
        c = NULL;
        json_object_object_get_ex(m, "content", &c);
        if ((a->msgs[i].content = gw_content(c, hold, b)) == NULL)
            return -1;
        if (json_object_object_get_ex(m, "reasoning_content", &rc) && rc != NULL) {
            if (json_object_get_type(rc) != json_type_string)
                return gw_bad(b, 400, "invalid_type", "messages[%zu].reasoning_content must "
                    "be a string", i);
            snprintf(what, sizeof(what), "messages[%zu].reasoning_content", i);
            if ((a->msgs[i].reasoning = gw_text(rc, what, b)) == NULL)
                return -1;
        }
    }
    a->n_msgs = n;
    /* Thinking mode: "thinking": true, or chat_template_kwargs.thinking (as
     * vLLM and SGLang take it for DeepSeek models). */
    if (gw_bool(o, "thinking", &a->copts.thinking, b) != 0)
        return -1;
    if (gw_obj(o, "chat_template_kwargs", &kw, b) != 0)
        return -1;
    if (kw != NULL && gw_bool(kw, "thinking", &a->copts.thinking, b) != 0)
        return -1;
    if (json_object_object_get_ex(o, "reasoning_effort", &x) && x != NULL) {
        if (json_object_get_type(x) != json_type_string)
            return gw_bad(b, 400, "invalid_type", "\"reasoning_effort\" must be a string");
        if (gw_str_is(x, "max"))
            a->copts.effort_max = true;
        else if (!gw_str_is(x, "high"))
            return gw_bad(b, 400, "invalid_value", "\"reasoning_effort\": \"high\" or \"max\"");
    }
    (void)g;
    return 0;
}

static int
gw_parse_prompt(struct gw *g, json_object *o, struct gw_ask *a, struct gw_bad *b)
{
    json_object *x, *e;
    size_t i, n;
    int64_t v;

    if (!json_object_object_get_ex(o, "prompt", &x) || x == NULL)
        return gw_bad(b, 400, "invalid_request", "\"prompt\" is required");
    /* A one-element array holding a string or an id array is one prompt. */
    if (json_object_get_type(x) == json_type_array && json_object_array_length(x) == 1) {
        e = json_object_array_get_idx(x, 0);
        if (json_object_get_type(e) == json_type_string ||
            json_object_get_type(e) == json_type_array)
            x = e;
    }
    if (json_object_get_type(x) == json_type_string) {
        if ((a->prompt = gw_text(x, "\"prompt\"", b)) == NULL)
            return -1;
        if (a->prompt[0] == '\0')
            return gw_bad(b, 400, "invalid_value", "\"prompt\" is empty");
        return 0;
    }
    if (json_object_get_type(x) != json_type_array || json_object_array_length(x) == 0)
        return gw_bad(b, 400, "invalid_type", "\"prompt\" must be a string, an array of "
            "token ids, or an array with one of those");
    n = json_object_array_length(x);
    if (json_object_get_type(json_object_array_get_idx(x, 0)) != json_type_int)
        return gw_bad(b, 400, "unsupported_value", "one prompt per request (n = 1): "
            "several prompts are not supported");
    if ((a->tokens = malloc(n * sizeof(*a->tokens))) == NULL)
        return gw_bad(b, 500, "internal_error", "out of memory");
    for (i = 0; i < n; i++) {
        e = json_object_array_get_idx(x, i);
        v = json_object_get_int64(e);
        if (json_object_get_type(e) != json_type_int || v < 0 ||
            v >= dsv4_tok_vocab_size(g->tok))
            return gw_bad(b, 400, "invalid_value", "prompt[%zu] is not a token id "
                "(0 ... %d)", i, dsv4_tok_vocab_size(g->tok) - 1);
        a->tokens[i] = (int32_t)v;
    }
    a->n_tokens = n;
    return 0;
}

/* Everything but the prompt/messages. */
static int
gw_parse_params(struct gw_gen *q, json_object *o, struct gw_ask *a, struct gw_bad *b)
{
    json_object *x, *so;
    double v;
    bool has;

    dsv4_client_params_init(&a->p);
    a->p.max_tokens = GW_DEFAULT_MAX_TOKENS;
    if (json_object_object_get_ex(o, "model", &x) && x != NULL &&
        !gw_str_is(x, q->g->conf.gateway_model)) {
        if (json_object_get_type(x) == json_type_string && gw_bad_text(x))
            return gw_bad(b, 404, "model_not_found", "the model name is not UTF-8 text without "
                "U+0000; this server serves \"%s\"", q->g->conf.gateway_model);
        return gw_bad(b, 404, "model_not_found", "model \"%s\" does not exist; this server "
            "serves \"%s\"", json_object_get_string(x), q->g->conf.gateway_model);
    }
    if (gw_num(o, "n", 1, 1, true, &v, &has, b) != 0)
        return gw_bad(b, 400, "unsupported_value", "\"n\" must be 1 (one choice per request)");
    if (gw_num(o, "max_tokens", 1, 1048576, true, &v, &has, b) != 0)
        return -1;
    if (has)
        a->p.max_tokens = (uint32_t)v;
    if (gw_num(o, "max_completion_tokens", 1, 1048576, true, &v, &has, b) != 0)
        return -1;
    if (has)
        a->p.max_tokens = (uint32_t)v;
    if (gw_num(o, "temperature", 0, 10, false, &v, &has, b) != 0)
        return -1;
    if (has)
        a->p.temperature = (float)v;
    if (gw_num(o, "top_p", 0, 1, false, &v, &has, b) != 0)
        return -1;
    if (has && v <= 0)
        return gw_bad(b, 400, "invalid_value", "\"top_p\" must be > 0");
    if (has)
        a->p.top_p = (float)v;
    if (gw_num(o, "top_k", -1, 1048576, true, &v, &has, b) != 0)
        return -1;
    if (has)
        a->p.top_k = v < 0 ? 0 : (uint32_t)v;  /* -1 = off, as vLLM */
    if (gw_num(o, "seed", 0, 9007199254740991.0, true, &v, &has, b) != 0)
        return -1;
    if (has) {
        a->p.has_seed = 1;
        a->p.seed = (uint64_t)json_object_get_int64(json_object_object_get(o, "seed"));
    }
    if (gw_parse_stop(o, a, b) != 0)
        return -1;
    if (gw_bool(o, "stream", &q->stream, b) != 0)
        return -1;
    if (gw_obj(o, "stream_options", &so, b) != 0)
        return -1;
    if (so != NULL && gw_bool(so, "include_usage", &q->include_usage, b) != 0)
        return -1;
    if (gw_bool(o, "return_token_ids", &q->return_ids, b) != 0)
        return -1;
    /* logprobs: chat takes a bool (+ top_logprobs), completions an integer;
     * only the sampled token's log-probability exists (no alternatives). */
    if (q->chat) {
        if (gw_bool(o, "logprobs", &q->logprobs, b) != 0)
            return -1;
        if (gw_num(o, "top_logprobs", 0, 0, true, &v, &has, b) != 0)
            return gw_bad(b, 400, "unsupported_value", "\"top_logprobs\" must be 0: only "
                "the sampled token's log-probability is available");
    } else {
        if (gw_num(o, "logprobs", 0, 0, true, &v, &has, b) != 0)
            return gw_bad(b, 400, "unsupported_value", "\"logprobs\" must be 0 or null: "
                "only the sampled token's log-probability is available (0)");
        q->logprobs = has;
    }
    a->p.logprobs = q->logprobs || q->return_ids;
    return gw_refuse_unsupported(o, q->chat, b);
}

/* --- events -------------------------------------------------------------- */

static json_object *
gw_usage(const struct gw_gen *q)
{
    json_object *u = json_object_new_object();

    json_object_object_add(u, "prompt_tokens", json_object_new_int64(q->prompt_tokens));
    json_object_object_add(u, "completion_tokens",
        json_object_new_int64(q->completion_tokens));
    json_object_object_add(u, "total_tokens",
        json_object_new_int64((int64_t)q->prompt_tokens + q->completion_tokens));
    return u;
}

/* Log-probability entries of ids[from..to). */
static json_object *
gw_logprobs(const struct gw_gen *q, size_t from, size_t to, size_t text_offset)
{
    json_object *o, *a, *b, *c = NULL, *e, *bytes;
    const char *piece;
    size_t i, j, n;

    o = json_object_new_object();
    if (q->chat)
        c = json_object_new_array();
    a = json_object_new_array();
    b = json_object_new_array();
    e = json_object_new_array();
    for (i = from; i < to; i++) {
        double lp = isfinite(q->lps[i]) ? q->lps[i] : -9999.0;

        piece = dsv4_tok_piece(q->g->tok, q->ids.v[i], &n);
        if (q->chat) {
            json_object *t = json_object_new_object();

            json_object_object_add(t, "token", gw_json_bytes(piece, n));
            json_object_object_add(t, "logprob", json_object_new_double(lp));
            bytes = json_object_new_array();
            for (j = 0; j < n; j++)
                json_object_array_add(bytes, json_object_new_int((unsigned char)piece[j]));
            json_object_object_add(t, "bytes", bytes);
            json_object_object_add(t, "top_logprobs", json_object_new_array());
            json_object_array_add(c, t);
        } else {
            json_object_array_add(a, gw_json_bytes(piece, n));
            json_object_array_add(b, json_object_new_double(lp));
            json_object_array_add(e, json_object_new_int64((int64_t)text_offset));
            text_offset += n;
        }
    }
    if (q->chat) {
        json_object_object_add(o, "content", c);
        json_object_put(a);
        json_object_put(b);
        json_object_put(e);
    } else {
        json_object_object_add(o, "tokens", a);
        json_object_object_add(o, "token_logprobs", b);
        json_object_object_add(o, "top_logprobs", NULL);
        json_object_object_add(o, "text_offset", e);
    }
    return o;
}

static json_object *
gw_ids_json(const int32_t *v, size_t from, size_t to)
{
    json_object *a = json_object_new_array();
    size_t i;

    for (i = from; i < to; i++)
        json_object_array_add(a, json_object_new_int(v[i]));
    return a;
}

/* Header of a chunk/answer: id, object, created, model. */
static json_object *
gw_head(const struct gw_gen *q, const char *object)
{
    json_object *o = json_object_new_object();

    json_object_object_add(o, "id", json_object_new_string(q->id));
    json_object_object_add(o, "object", json_object_new_string(object));
    json_object_object_add(o, "created", json_object_new_int64(q->created));
    json_object_object_add(o, "model", json_object_new_string(q->g->conf.gateway_model));
    return o;
}

/* One SSE chunk with text `c`/reasoning `r` for ids[from..to); finish NULL
 * = not the last. */
static void
gw_sse_chunk(struct gw_gen *q, const char *c, size_t cn, const char *r, size_t rn,
    size_t from, size_t to, const char *finish)
{
    json_object *o, *ch, *arr, *d;

    o = gw_head(q, q->chat ? "chat.completion.chunk" : "text_completion");
    ch = json_object_new_object();
    json_object_object_add(ch, "index", json_object_new_int(0));
    if (q->chat) {
        d = json_object_new_object();
        if (cn > 0 || (rn == 0 && finish == NULL))
            json_object_object_add(d, "content", json_object_new_string_len(c, (int)cn));
        if (rn > 0)
            json_object_object_add(d, "reasoning_content",
                json_object_new_string_len(r, (int)rn));
        json_object_object_add(ch, "delta", d);
    } else {
        json_object_object_add(ch, "text", json_object_new_string_len(c, (int)cn));
    }
    json_object_object_add(ch, "logprobs", q->logprobs && to > from ?
        gw_logprobs(q, from, to, q->content.len - cn) : NULL);
    if (q->return_ids && to > from)
        json_object_object_add(ch, "token_ids", gw_ids_json(q->ids.v, from, to));
    json_object_object_add(ch, "finish_reason", finish != NULL ?
        json_object_new_string(finish) : NULL);
    arr = json_object_new_array();
    json_object_array_add(arr, ch);
    json_object_object_add(o, "choices", arr);
    gw_sse_json(q, o);
}

/* A TOKENS event: record ids, timing, text (EOS text dropped, reasoning
 * split off at </think> in thinking mode); stream a chunk. */
static void
gw_on_tokens(struct gw_gen *q, const struct dsv4_client_event *ev)
{
    const char *text = ev->text != NULL ? ev->text : "", *cut, *eos;
    size_t tn = strlen(text), from = q->ids.len, i, eosn;
    size_t c0 = q->content.len, r0 = q->reasoning.len;
    int64_t now = gw_now_ms();

    pthread_mutex_lock(&q->g->mlock);
    if (q->n_out == 0)
        gw_hist_observe(&q->g->m.ttft, (double)(now - q->t_submit) / 1000.0);
    else
        for (i = 0; i < ev->n_tokens; i++)
            gw_hist_observe(&q->g->m.itl, (double)(now - q->t_last) / 1000.0 /
                (double)ev->n_tokens);
    pthread_mutex_unlock(&q->g->mlock);
    q->t_last = now;
    q->n_out += ev->n_tokens;
    for (i = 0; i < ev->n_tokens; i++) {
        if (q->ids.len == q->ids.cap) {
            size_t ncap = q->ids.cap != 0 ? q->ids.cap * 2 : 64;
            int32_t *nv = realloc(q->ids.v, ncap * sizeof(*nv));
            float *nl = realloc(q->lps, ncap * sizeof(*nl));

            if (nv != NULL)
                q->ids.v = nv;
            if (nl != NULL)
                q->lps = nl;
            if (nv == NULL || nl == NULL)
                return;
            q->ids.cap = ncap;
        }
        q->lps[q->ids.len] = ev->logprobs != NULL ? ev->logprobs[i] : 0.0f;
        q->ids.v[q->ids.len++] = ev->tokens[i];
    }
    /* EOS ends the request and is part of the token output; its text is not
     * part of the answer. */
    if (ev->n_tokens > 0 && ev->tokens[ev->n_tokens - 1] == q->g->eos) {
        eos = dsv4_tok_piece(q->g->tok, q->g->eos, &eosn);
        if (eos != NULL && tn >= eosn && memcmp(text + tn - eosn, eos, eosn) == 0)
            tn -= eosn;
    }
    if (q->in_reasoning) {
        cut = memmem(text, tn, "</think>", 8);
        if (cut == NULL) {
            gw_text_add(&q->reasoning, text, tn);
            tn = 0;
        } else {
            gw_text_add(&q->reasoning, text, (size_t)(cut - text));
            tn -= (size_t)(cut - text) + 8;
            text = cut + 8;
            q->in_reasoning = false;
        }
    }
    gw_text_add(&q->content, text, tn);
    if (q->stream && (q->content.len > c0 || q->reasoning.len > r0 || q->logprobs ||
        q->return_ids))
        gw_sse_chunk(q, gw_text_at(&q->content, c0), q->content.len - c0,
            gw_text_at(&q->reasoning, r0), q->reasoning.len - r0, from, q->ids.len, NULL);
}

/* An error in the stream: an OpenAI error object as an SSE event. */
static void
gw_sse_error(struct gw_gen *q)
{
    json_object *o = json_object_new_object(), *e = json_object_new_object();
    const char *code;
    unsigned st = gw_http_status(q->err_code, &code);

    json_object_object_add(e, "message", json_object_new_string(q->err_msg));
    json_object_object_add(e, "type", json_object_new_string(st < 500 ?
        "invalid_request_error" : "server_error"));
    json_object_object_add(e, "param", NULL);
    json_object_object_add(e, "code", json_object_new_string(code));
    json_object_object_add(o, "error", e);
    gw_sse_json(q, o);
}

static void
gw_on_final(struct gw_gen *q)
{
    json_object *o;

    if (!q->stream)
        return;
    if (q->err_code != 0) {
        gw_sse_error(q);
    } else {
        gw_sse_chunk(q, "", 0, "", 0, 0, 0, gw_finish_name(q->finish));
        if (q->include_usage) {
            o = gw_head(q, q->chat ? "chat.completion.chunk" : "text_completion");
            json_object_object_add(o, "choices", json_object_new_array());
            json_object_object_add(o, "usage", gw_usage(q));
            gw_sse_json(q, o);
        }
    }
    gw_out_append(q, "data: [DONE]\n\n", 14);
    q->sse_end = true;
}

/* Take one event of our request. */
static void
gw_on_event(struct gw_gen *q, const struct dsv4_client_event *ev)
{
    if (ev->id != q->cid && ev->id != 0)
        return;
    switch (ev->type) {
    case DSV4_CLIENT_EV_ACCEPTED:
        q->accepted = true;
        break;
    case DSV4_CLIENT_EV_TOKENS:
        gw_on_tokens(q, ev);
        break;
    case DSV4_CLIENT_EV_DONE:
        q->final = true;
        q->finish = ev->finish;
        q->prompt_tokens = ev->prompt_tokens;
        q->completion_tokens = ev->completion_tokens;
        if (ev->finish == DSV4_CLIENT_FINISH_CANCELLED) {
            q->err_code = DSV4_CLIENT_INTERNAL;
            snprintf(q->err_msg, sizeof(q->err_msg), "the request was cancelled");
        }
        gw_on_final(q);
        break;
    case DSV4_CLIENT_EV_ERROR:
        q->final = true;
        q->err_code = ev->code;
        snprintf(q->err_msg, sizeof(q->err_msg), "%s (%d %s)",
            ev->message != NULL ? ev->message : "", ev->code, dsv4_client_strerror(ev->code));
        gw_on_final(q);
        break;
    }
}

/* Wait for events until `until` says stop, the request ends, the peer goes
 * or the deadline passes.  Returns 0, 1 peer gone, 2 deadline. */
static int
gw_wait(struct gw_gen *q, bool (*until)(const struct gw_gen *))
{
    struct dsv4_client_event ev;
    int64_t next_check = gw_now_ms() + GW_POLL_MS;
    int rc;

    while (!q->final && !until(q)) {
        rc = dsv4_client_next(q->c, &ev, GW_POLL_MS);
        if (rc == 0) {
            gw_on_event(q, &ev);
            /* Events can arrive faster than GW_POLL_MS for the whole
             * request (tokens of a non-streamed answer): look at the peer
             * on a clock, not only when the scheduler is quiet. */
            if (gw_now_ms() >= next_check) {
                next_check = gw_now_ms() + GW_POLL_MS;
                if (gw_http_peer_gone(q->conn))
                    return 1;
            }
            continue;
        }
        if (rc != DSV4_CLIENT_NONE) {
            q->final = true;
            q->err_code = rc;
            snprintf(q->err_msg, sizeof(q->err_msg), "scheduler connection failed: %s",
                dsv4_client_errmsg(q->c));
            gw_on_final(q);
            break;
        }
        if (gw_http_peer_gone(q->conn))
            return 1;
        if (gw_now_ms() > q->deadline) {
            q->final = true;
            q->err_code = DSV4_CLIENT_TIMEOUT;
            snprintf(q->err_msg, sizeof(q->err_msg), "no answer within %d ms",
                q->g->conf.gateway_timeout_ms);
            gw_on_final(q);
            return 2;
        }
    }
    return 0;
}

static bool
gw_until_accepted(const struct gw_gen *q)
{
    return q->accepted;
}

static bool
gw_until_output(const struct gw_gen *q)
{
    return q->out_off < q->out_len;
}

static bool
gw_until_never(const struct gw_gen *q)
{
    (void)q;
    return false;
}

/* Record the outcome once. */
static void
gw_count(struct gw_gen *q, enum gw_outcome out)
{
    struct gw_metrics *m = &q->g->m;

    if (q->counted)
        return;
    q->counted = true;
    q->outcome = out;
    pthread_mutex_lock(&q->g->mlock);
    m->outcome[out]++;
    m->prompt_tokens += q->prompt_tokens;
    m->completion_tokens += q->completion_tokens;
    if (q->submitted)
        gw_hist_observe(&m->duration, (double)(gw_now_ms() - q->t_submit) / 1000.0);
    pthread_mutex_unlock(&q->g->mlock);
}

static enum gw_outcome
gw_outcome_of(const struct gw_gen *q)
{
    if (q->err_code == 0)
        return q->finish == DSV4_CLIENT_FINISH_LENGTH ? GW_OUT_LENGTH : GW_OUT_STOP;
    if (q->err_code == DSV4_CLIENT_TIMEOUT)
        return GW_OUT_TIMEOUT;
    if (!q->accepted || q->err_code / 100 == 3 || q->err_code / 100 == 4)
        return GW_OUT_REJECTED;
    return GW_OUT_ERROR;
}

/* --- answers -------------------------------------------------------------- */

static enum MHD_Result
gw_reply_error(struct gw_gen *q)
{
    const char *code;
    unsigned st = gw_http_status(q->err_code, &code);

    gw_count(q, gw_outcome_of(q));
    return gw_http_error(q->g, q->conn, q->route, st, code, "%s", q->err_msg);
}

static enum MHD_Result
gw_reply_json(struct gw_gen *q)
{
    json_object *o, *ch, *msg, *arr;

    gw_count(q, gw_outcome_of(q));
    o = gw_head(q, q->chat ? "chat.completion" : "text_completion");
    ch = json_object_new_object();
    json_object_object_add(ch, "index", json_object_new_int(0));
    if (q->chat) {
        msg = json_object_new_object();
        json_object_object_add(msg, "role", json_object_new_string("assistant"));
        json_object_object_add(msg, "content", json_object_new_string_len(
            gw_text_at(&q->content, 0), (int)q->content.len));
        if (q->thinking)
            json_object_object_add(msg, "reasoning_content", json_object_new_string_len(
                gw_text_at(&q->reasoning, 0), (int)q->reasoning.len));
        json_object_object_add(ch, "message", msg);
    } else {
        json_object_object_add(ch, "text", json_object_new_string_len(
            gw_text_at(&q->content, 0), (int)q->content.len));
    }
    json_object_object_add(ch, "logprobs", q->logprobs ?
        gw_logprobs(q, 0, q->ids.len, 0) : NULL);
    if (q->return_ids) {
        json_object_object_add(ch, "token_ids", gw_ids_json(q->ids.v, 0, q->ids.len));
        if (q->prompt_ids.len > 0)
            json_object_object_add(o, "prompt_token_ids",
                gw_ids_json(q->prompt_ids.v, 0, q->prompt_ids.len));
    }
    json_object_object_add(ch, "finish_reason",
        json_object_new_string(gw_finish_name(q->finish)));
    arr = json_object_new_array();
    json_object_array_add(arr, ch);
    json_object_object_add(o, "choices", arr);
    json_object_object_add(o, "usage", gw_usage(q));
    return gw_http_json(q->g, q->conn, q->route, 200, o);
}

/* MHD pulls the SSE body from here (connection thread; may block). */
static ssize_t
gw_sse_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct gw_gen *q = cls;
    size_t n;
    int rc;

    (void)pos;
    if (q->out_off == q->out_len) {
        q->out_off = q->out_len = 0;
        if (q->sse_end)
            return MHD_CONTENT_READER_END_OF_STREAM;
        rc = gw_wait(q, gw_until_output);
        if (rc == 1) {
            gw_count(q, GW_OUT_DISCONNECT);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (q->out_off == q->out_len)
            return q->sse_end ? MHD_CONTENT_READER_END_OF_STREAM : 0;
    }
    n = q->out_len - q->out_off;
    if (n > max)
        n = max;
    memcpy(buf, q->out + q->out_off, n);
    q->out_off += n;
    if (q->final && q->out_off == q->out_len)
        gw_count(q, gw_outcome_of(q));
    return (ssize_t)n;
}

static enum MHD_Result
gw_reply_stream(struct gw_gen *q)
{
    struct MHD_Response *r;
    enum MHD_Result rc;

    if (q->chat) {
        /* The first chunk names the role, as OpenAI's does. */
        json_object *o = gw_head(q, "chat.completion.chunk"), *ch, *d, *arr;

        ch = json_object_new_object();
        d = json_object_new_object();
        json_object_object_add(d, "role", json_object_new_string("assistant"));
        json_object_object_add(d, "content", json_object_new_string(""));
        json_object_object_add(ch, "index", json_object_new_int(0));
        json_object_object_add(ch, "delta", d);
        json_object_object_add(ch, "logprobs", NULL);
        json_object_object_add(ch, "finish_reason", NULL);
        arr = json_object_new_array();
        json_object_array_add(arr, ch);
        json_object_object_add(o, "choices", arr);
        /* Before any output that already arrived: put it first. */
        {
            char *keep = q->out;
            size_t klen = q->out_len;

            q->out = NULL;
            q->out_len = q->out_cap = 0;
            gw_sse_json(q, o);
            gw_out_append(q, keep != NULL ? keep : "", klen);
            free(keep);
        }
    }
    r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, gw_sse_read, q, NULL);
    if (r == NULL)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    rc = MHD_queue_response(q->conn, 200, r);
    MHD_destroy_response(r);
    gw_metrics_http(q->g, q->route, 200);
    return rc;
}

/* --- entry points --------------------------------------------------------- */

static int
gw_submit(struct gw_gen *q, struct gw_ask *a, struct gw_bad *b)
{
    struct dsv4_client_opts co;
    char keyfile[DSV4_CONF_STR + 16];
    enum dsv4_err e;
    int rc;

    a->stop_ids[0] = q->g->eos;
    if (q->g->eos >= 0) {
        a->p.stop_ids = a->stop_ids;
        a->p.n_stop_ids = 1;
    }
    a->p.stream = 1;
    a->p.timeout_ms = (uint32_t)q->g->conf.gateway_timeout_ms;
    snprintf(a->tag, sizeof(a->tag), "gateway %s", q->id);
    a->p.tag = a->tag;
    if (q->chat) {
        pthread_mutex_lock(&q->g->toklock);
        e = dsv4_chat_encode(q->g->tok, a->msgs, a->n_msgs, &a->copts, &q->prompt_ids);
        pthread_mutex_unlock(&q->g->toklock);
        if (e != DSV4_OK)
            return gw_bad(b, 400, "invalid_request", "messages: %s", dsv4_errmsg());
    }
    dsv4_client_opts_init(&co);
    if (strncmp(q->g->conf.client_endpoint, "tcp://", 6) == 0) {
        snprintf(keyfile, sizeof(keyfile), "%s/server.pub", q->g->conf.key_dir);
        co.server_key_file = keyfile;
    }
    rc = dsv4_client_connect(q->g->conf.client_endpoint, &co, &q->c);
    if (rc != 0)
        return gw_bad(b, 503, "scheduler_unreachable", "the scheduler at %s does not "
            "answer (%d %s)", q->g->conf.client_endpoint, rc, dsv4_client_strerror(rc));
    q->t_submit = gw_now_ms();
    q->deadline = q->t_submit + q->g->conf.gateway_timeout_ms + 5000;
    if (q->chat)
        rc = dsv4_client_submit_tokens(q->c, q->prompt_ids.v, q->prompt_ids.len, &a->p,
            &q->cid);
    else if (a->prompt != NULL)
        rc = dsv4_client_submit_text(q->c, a->prompt, &a->p, &q->cid);
    else
        rc = dsv4_client_submit_tokens(q->c, a->tokens, a->n_tokens, &a->p, &q->cid);
    if (rc != 0) {
        const char *code;
        unsigned st = gw_http_status(rc, &code);

        return gw_bad(b, st, code, "%s: %s", dsv4_client_strerror(rc),
            dsv4_client_errmsg(q->c));
    }
    q->submitted = true;
    pthread_mutex_lock(&q->g->mlock);
    q->g->m.streams_active++;
    pthread_mutex_unlock(&q->g->mlock);
    return 0;
}

enum MHD_Result
gw_gen_handle(struct gw *g, struct MHD_Connection *conn, bool chat, const char *body,
    size_t len, struct gw_gen **genp)
{
    static atomic_uint_fast64_t serial;
    struct json_tokener *tk;
    json_object *o = NULL, *hold;
    struct gw_ask a;
    struct gw_bad b = { 0 };
    struct gw_gen *q;
    enum MHD_Result ret;
    int rc = -1, w;

    if ((q = calloc(1, sizeof(*q))) == NULL)
        return MHD_NO;
    *genp = q;
    q->g = g;
    q->conn = conn;
    q->chat = chat;
    q->route = chat ? GW_R_CHAT : GW_R_COMPLETIONS;
    q->created = (int64_t)time(NULL);
    snprintf(q->id, sizeof(q->id), "%s-%d-%" PRIu64, chat ? "chatcmpl" : "cmpl",
        (int)getpid(), (uint64_t)atomic_fetch_add(&serial, 1) + 1);
    memset(&a, 0, sizeof(a));
    hold = json_object_new_array();
    if (atomic_load(&g->stopping)) {
        gw_bad(&b, 503, "stopping", "the gateway is shutting down");
        goto out;
    }
    /* Parse: one JSON object, nothing after it, bounded nesting. */
    tk = json_tokener_new_ex(GW_JSON_DEPTH);
    if (tk != NULL) {
        o = json_tokener_parse_ex(tk, body, (int)len);
        if (json_tokener_get_error(tk) != json_tokener_success) {
            gw_bad(&b, 400, "invalid_json", "the body is not valid JSON: %s (at byte %zu)",
                json_tokener_error_desc(json_tokener_get_error(tk)),
                json_tokener_get_parse_end(tk));
            json_object_put(o);
            o = NULL;
        } else if (!gw_only_blanks(body + json_tokener_get_parse_end(tk),
            len - json_tokener_get_parse_end(tk))) {
            gw_bad(&b, 400, "invalid_json", "trailing bytes after the JSON object");
            json_object_put(o);
            o = NULL;
        }
        json_tokener_free(tk);
    }
    if (o == NULL) {
        if (b.status == 0)
            gw_bad(&b, 400, "invalid_json", "the body is not valid JSON");
        goto out;
    }
    if (json_object_get_type(o) != json_type_object) {
        gw_bad(&b, 400, "invalid_json", "the body must be a JSON object");
        goto out;
    }
    if (gw_parse_params(q, o, &a, &b) != 0)
        goto out;
    if (chat ? gw_parse_messages(g, o, hold, &a, &b) : gw_parse_prompt(g, o, &a, &b))
        goto out;
    q->thinking = chat && a.copts.thinking;
    q->in_reasoning = q->thinking;
    if (gw_submit(q, &a, &b) != 0)
        goto out;
    rc = 0;
out:
    free(a.tokens);
    free(a.msgs);
    json_object_put(hold);
    json_object_put(o);
    if (rc != 0) {
        gw_count(q, GW_OUT_REJECTED);
        return gw_http_error(g, conn, q->route, b.status, b.code, "%s", b.msg);
    }
    /* Wait for the scheduler to take the request, so refusals (busy,
     * draining, too long) get their own HTTP status, streaming or not. */
    w = gw_wait(q, q->stream ? gw_until_accepted : gw_until_never);
    if (w == 1) {
        gw_count(q, GW_OUT_DISCONNECT);
        return MHD_NO;
    }
    if (q->final && q->err_code != 0 && (!q->stream || q->n_out == 0)) {
        q->out_len = q->out_off = 0;
        return gw_reply_error(q);
    }
    if (!q->stream)
        return gw_reply_json(q);
    ret = gw_reply_stream(q);
    return ret;
}

void
gw_gen_finish(struct gw *g, struct gw_gen *q, bool client_gone)
{
    struct dsv4_client_event ev;
    int64_t end;

    if (q == NULL)
        return;
    if (q->submitted && !q->final) {
        /* Still running: the client went away or the connection timed out.
         * Cancel and wait for the request's end so nothing is left behind. */
        dsv4_client_cancel(q->c, q->cid);
        end = gw_now_ms() + GW_CANCEL_WAIT_MS;
        while (!q->final && gw_now_ms() < end)
            if (dsv4_client_next(q->c, &ev, GW_POLL_MS) == 0 &&
                (ev.type == DSV4_CLIENT_EV_DONE || ev.type == DSV4_CLIENT_EV_ERROR) &&
                ev.id == q->cid)
                q->final = true;
        gw_count(q, client_gone ? GW_OUT_DISCONNECT : GW_OUT_ERROR);
    } else if (q->submitted) {
        gw_count(q, client_gone && q->out_off < q->out_len ? GW_OUT_DISCONNECT :
            gw_outcome_of(q));
    }
    if (q->submitted) {
        pthread_mutex_lock(&g->mlock);
        g->m.streams_active--;
        pthread_mutex_unlock(&g->mlock);
    }
    dsv4_client_close(q->c);
    dsv4_tok_text_free(&q->content);
    dsv4_tok_text_free(&q->reasoning);
    dsv4_tok_ids_free(&q->ids);
    dsv4_tok_ids_free(&q->prompt_ids);
    free(q->lps);
    free(q->out);
    free(q);
}
