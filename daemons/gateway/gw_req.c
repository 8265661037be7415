/*
 * gw_req.c — the body of POST /v1/completions and /v1/chat/completions
 * (untrusted JSON) into what the request asks for (struct gw_req), or the
 * refusal an OpenAI client gets (struct gw_bad): status, code, message.
 * Every field is checked for type and range here; unsupported parameters
 * are refused unless neutral; strings must be UTF-8 without U+0000.  No
 * I/O: tests/fuzz/fuzz_gwreq.c runs it on any bytes.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "daemons/gateway/gateway.h"
#include "dsv4/client.h"

#define GW_MAX_MESSAGES 4096   /* chat turns of one request */

/* --- helpers --------------------------------------------------------------- */

int
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

int
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

/* v as the shortest text that reads back as v, a whole number below 2^53
 * without exponent ("%g" printed 10.0000001 as 10, so "= 10 is outside 0
 * ... 10"). */
static const char *
gw_num_text(double v, char buf[32])
{
    if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        snprintf(buf, 32, "%.0f", v);
        return buf;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, 32, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    return buf;
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
    if (isnan(*v) || *v < lo || *v > hi) {
        char tv[32], tl[32], th[32];

        /* an integer past int64 reads as its clamp: the text as sent */
        return gw_bad(b, 400, "invalid_value", "\"%s\" = %s is outside %s ... %s", key,
            t == json_type_int ? json_object_to_json_string(x) : gw_num_text(*v, tv),
            gw_num_text(lo, tl), gw_num_text(hi, th));
    }
    *has = true;
    return 0;
}

/* A count of most likely tokens (chat "top_logprobs", completions
 * "logprobs"): absent/null -> *has false, *n 0; a number that is not an
 * integer 0 ... GW_MAX_TOP_LOGPROBS -> 400 invalid_value naming the field;
 * another type -> 400 invalid_type. */
static int
gw_top_n(json_object *o, const char *key, uint32_t *n, bool *has, struct gw_bad *b)
{
    json_object *x;
    enum json_type t;
    int64_t v;

    *has = false;
    *n = 0;
    if (!json_object_object_get_ex(o, key, &x) || x == NULL)
        return 0;
    t = json_object_get_type(x);
    if (t != json_type_int && t != json_type_double)
        return gw_bad(b, 400, "invalid_type", "\"%s\" must be an integer 0 ... %d", key,
            GW_MAX_TOP_LOGPROBS);
    v = json_object_get_int64(x);   /* (clamped for ints beyond int64) */
    if (t != json_type_int || v < 0 || v > GW_MAX_TOP_LOGPROBS)
        return gw_bad(b, 400, "invalid_value", "\"%s\" = %s: must be an integer 0 ... %d",
            key, json_object_to_json_string_ext(x, JSON_C_TO_STRING_PLAIN),
            GW_MAX_TOP_LOGPROBS);
    *n = (uint32_t)v;
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
gw_parse_stop(json_object *o, struct gw_req *a, struct gw_bad *b)
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
 * parts (joined with "\n", as vLLM joins them).  Returns a string owned by
 * `hold` or by the tree. */
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
        if ((i > 0 && gw_text_add(&t, "\n", 1) != 0) ||
            gw_text_add(&t, str, (size_t)json_object_get_string_len(tx)) != 0) {
            dsv4_tok_text_free(&t);
            gw_bad(b, 500, "internal_error", "out of memory");
            return NULL;
        }
    }
    s = json_object_new_string_len(t.s != NULL ? t.s : "", (int)t.len);
    dsv4_tok_text_free(&t);
    if (s == NULL || json_object_array_add(hold, s) != 0) {
        json_object_put(s);
        gw_bad(b, 500, "internal_error", "out of memory");
        return NULL;
    }
    return json_object_get_string(s);
}

/* The chat route's "messages" and thinking options into `a`; joined
 * content strings are kept in a->hold. */
static int
gw_parse_messages(json_object *o, struct gw_req *a, struct gw_bad *b)
{
    json_object *x = NULL, *m, *r, *c, *rc, *kw;
    const char *role;
    char what[64];
    size_t i, n;

    if (json_object_object_get_ex(o, "messages", &x) && x != NULL &&
        json_object_get_type(x) != json_type_array)
        return gw_bad(b, 400, "invalid_type", "\"messages\" must be a non-empty array");
    if (x == NULL || json_object_array_length(x) == 0)
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
        if ((a->msgs[i].content = gw_content(c, a->hold, b)) == NULL)
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
    /* (the name vLLM's DeepSeek tokenizers take too) */
    if (kw != NULL && gw_bool(kw, "enable_thinking", &a->copts.thinking, b) != 0)
        return -1;
    if (json_object_object_get_ex(o, "reasoning_effort", &x) && x != NULL) {
        if (json_object_get_type(x) != json_type_string)
            return gw_bad(b, 400, "invalid_type", "\"reasoning_effort\" must be a string");
        if (gw_str_is(x, "max"))
            a->copts.effort_max = true;
        else if (!gw_str_is(x, "high"))
            return gw_bad(b, 400, "invalid_value", "\"reasoning_effort\": \"high\" or \"max\"");
    }
    return 0;
}

static int
gw_parse_prompt(const struct gw *g, json_object *o, struct gw_req *a, struct gw_bad *b)
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
gw_parse_params(const struct gw *g, bool chat, json_object *o, struct gw_req *a,
    struct gw_bad *b)
{
    json_object *x, *so;
    double v;
    bool has;

    dsv4_client_params_init(&a->p);
    a->p.max_tokens = GW_DEFAULT_MAX_TOKENS;
    if (json_object_object_get_ex(o, "model", &x) && x != NULL &&
        !gw_str_is(x, g->conf.gateway_model)) {
        if (json_object_get_type(x) == json_type_string && gw_bad_text(x))
            return gw_bad(b, 404, "model_not_found", "the model name is not UTF-8 text without "
                "U+0000; this server serves \"%s\"", g->conf.gateway_model);
        return gw_bad(b, 404, "model_not_found", "model \"%s\" does not exist; this server "
            "serves \"%s\"", json_object_get_string(x), g->conf.gateway_model);
    }
    /* (a value of another type keeps its invalid_type) */
    if (gw_num(o, "n", 1, 1, true, &v, &has, b) != 0 && strcmp(b->code, "invalid_type") != 0)
        return gw_bad(b, 400, "unsupported_value", "\"n\" must be 1 (one choice per request)");
    if (b->status != 0)
        return -1;
    if (gw_num(o, "max_tokens", 1, 1048576, true, &v, &has, b) != 0)
        return -1;
    if (has)
        a->p.max_tokens = (uint32_t)v;
    if (gw_num(o, "max_completion_tokens", 1, 1048576, true, &v, &has, b) != 0)
        return -1;
    if (has && json_object_object_get_ex(o, "max_tokens", &x) && x != NULL &&
        (uint32_t)v != a->p.max_tokens)
        return gw_bad(b, 400, "invalid_value", "\"max_tokens\" (%u) and "
            "\"max_completion_tokens\" (%u) differ: give one", a->p.max_tokens, (unsigned)v);
    if (has)
        a->p.max_tokens = (uint32_t)v;
    if (gw_num(o, "temperature", 0, 10, false, &v, &has, b) != 0)
        return -1;
    if (has)
        a->p.temperature = (float)v;
    if (gw_num(o, "top_p", 0, 1, false, &v, &has, b) != 0)
        return -1;
    if (has && (float)v <= 0) {
        char tv[32];

        if (v > 0)   /* passed on as a float, refused as 0 naming a value not sent */
            return gw_bad(b, 400, "invalid_value", "\"top_p\" = %s is 0 as a float: it must "
                "be > 0", gw_num_text(v, tv));
        return gw_bad(b, 400, "invalid_value", "\"top_p\" must be > 0");
    }
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
    if (gw_bool(o, "stream", &a->stream, b) != 0)
        return -1;
    if (gw_obj(o, "stream_options", &so, b) != 0)
        return -1;
    if (so != NULL && gw_bool(so, "include_usage", &a->include_usage, b) != 0)
        return -1;
    if (gw_bool(o, "return_token_ids", &a->return_ids, b) != 0)
        return -1;
    /* logprobs: chat takes a bool and top_logprobs (the number of most
     * likely tokens per position, which needs logprobs: true, as OpenAI
     * has it); completions an integer, the number of most likely tokens
     * (0 = only the sampled token's log-probability; null = none). */
    if (chat) {
        if (gw_bool(o, "logprobs", &a->logprobs, b) != 0)
            return -1;
        if (gw_top_n(o, "top_logprobs", &a->p.top_logprobs, &has, b) != 0)
            return -1;
        if (a->p.top_logprobs > 0 && !a->logprobs)
            return gw_bad(b, 400, "invalid_value", "\"top_logprobs\" needs \"logprobs\": "
                "true");
    } else {
        if (gw_top_n(o, "logprobs", &a->p.top_logprobs, &has, b) != 0)
            return -1;
        a->logprobs = has;
    }
    a->p.logprobs = a->logprobs || a->return_ids;
    return gw_refuse_unsupported(o, chat, b);
}

int
gw_req_parse(const struct gw *g, bool chat, const char *body, size_t len, struct gw_req *r,
    struct gw_bad *b)
{
    struct json_tokener *tk;
    json_object *o = NULL;

    memset(r, 0, sizeof(*r));
    memset(b, 0, sizeof(*b));
    if ((r->hold = json_object_new_array()) == NULL)
        return gw_bad(b, 500, "internal_error", "out of memory");
    /* One JSON object, nothing after it, bounded nesting. */
    tk = json_tokener_new_ex(GW_JSON_DEPTH);
    if (tk != NULL) {
        o = json_tokener_parse_ex(tk, body, (int)len);
        if (json_tokener_get_error(tk) == json_tokener_continue) {
            /* (the tokener waits for more: nothing, an object cut short, or
             * a top-level number that might go on) */
            size_t i = 0;

            while (i < len && gw_only_blanks(body + i, 1))
                i++;
            if (i == len)
                gw_bad(b, 400, "invalid_json", "the body is empty; it must be a JSON object");
            else if (body[i] == '{')
                gw_bad(b, 400, "invalid_json", "the body ends inside its JSON object (%zu "
                    "bytes)", len);
            else
                gw_bad(b, 400, "invalid_json", "the body must be a JSON object");
            json_object_put(o);
            o = NULL;
        } else if (json_tokener_get_error(tk) != json_tokener_success) {
            gw_bad(b, 400, "invalid_json", "the body is not valid JSON: %s (at byte %zu)",
                json_tokener_error_desc(json_tokener_get_error(tk)),
                json_tokener_get_parse_end(tk));
            json_object_put(o);
            o = NULL;
        } else if (!gw_only_blanks(body + json_tokener_get_parse_end(tk),
            len - json_tokener_get_parse_end(tk))) {
            gw_bad(b, 400, "invalid_json", "trailing bytes after the JSON object");
            json_object_put(o);
            o = NULL;
        }
        json_tokener_free(tk);
    }
    if (o == NULL)
        return b->status != 0 ? -1 : gw_bad(b, 400, "invalid_json",
            "the body is not valid JSON");
    r->o = o;
    if (json_object_get_type(o) != json_type_object)
        return gw_bad(b, 400, "invalid_json", "the body must be a JSON object");
    if (gw_parse_params(g, chat, o, r, b) != 0)
        return -1;
    return chat ? gw_parse_messages(o, r, b) : gw_parse_prompt(g, o, r, b);
}

void
gw_req_free(struct gw_req *r)
{
    free(r->tokens);
    free(r->msgs);
    json_object_put(r->hold);
    json_object_put(r->o);
    memset(r, 0, sizeof(*r));
}
