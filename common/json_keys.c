/*
 * json_keys.c — strict JSON parsing of a byte range and the duplicated keys
 * json-c keeps quietly (the last one wins), for the files whose keys must be
 * unique: safetensors headers, the checkpoint index, config.json.
 */
#include "common/json_keys.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct json_object *
dsv4_json_parse_exact(const char *s, size_t len, const char **why)
{
    struct json_tokener *tok;
    struct json_object *o;

    *why = "malformed JSON";
    if (len > INT_MAX)
        return NULL;
    tok = json_tokener_new();
    if (tok == NULL) {
        *why = "out of memory";
        return NULL;
    }
    json_tokener_set_flags(tok, JSON_TOKENER_STRICT);
    o = json_tokener_parse_ex(tok, s, (int)len);
    if (o == NULL) {
        enum json_tokener_error je = json_tokener_get_error(tok);

        *why = je == json_tokener_continue ? "truncated JSON" : json_tokener_error_desc(je);
    } else if (json_tokener_get_parse_end(tok) != len) {
        *why = "trailing bytes after JSON";
        json_object_put(o);
        o = NULL;
    }
    json_tokener_free(tok);
    return o;
}

/*
 * json-c keeps the last of duplicated object keys silently, so duplicates
 * are found by counting object keys in the raw text and comparing with the
 * parsed tree.  The text already parsed successfully; strings may still use
 * either quote (json-c accepts '...' outside strict mode), and comments
 * (skipped outside strict mode; strict parsing refuses them: their brackets
 * and quotes are text).
 *
 * Counts the keys of every object at any depth; records each key at depth
 * `at` (1 = keys of the top-level object) in `keys`, unquoted, with the
 * serial number of its object (objects at depth `at` are numbered in order),
 * so that keys of two sibling objects are not taken for one duplicate.
 * Returns -1 if nesting is deeper than the scanner tracks, or the brackets
 * do not match as the scanner reads them.
 */
#define JSON_SCAN_DEPTH 64

struct key_item {
    char *key;
    long obj;       /* serial of its object among those at depth `at` */
};

struct key_list {
    struct key_item *k;
    int n, cap;
};

static long
json_scan_keys(const char *s, size_t len, int at, struct key_list *keys)
{
    char is_obj[JSON_SCAN_DEPTH];
    int depth = 0, expect_key = 0;
    long n = 0, obj = 0;

    for (size_t i = 0; i < len; i++) {
        char c = s[i];

        if (c == '/' && i + 1 < len && (s[i + 1] == '/' || s[i + 1] == '*')) {
            /* a comment: to the end of the line, or past its closing */
            if (s[i + 1] == '/') {
                while (i < len && s[i] != '\n')
                    i++;
            } else {
                for (i += 2; i + 1 < len && !(s[i] == '*' && s[i + 1] == '/'); i++)
                    ;
                i++;
            }
        } else if (c == '"' || c == '\'') {
            size_t start = i;

            for (i++; i < len && s[i] != c; i++) {
                if (s[i] == '\\')
                    i++;
            }
            if (i >= len)
                break;
            if (expect_key) {
                n++;
                expect_key = 0;
                if (keys != NULL && depth == at && keys->n < keys->cap) {
                    const char *why;
                    struct json_object *o = dsv4_json_parse_exact(s + start, i - start + 1, &why);

                    if (o != NULL && json_object_is_type(o, json_type_string)) {
                        keys->k[keys->n].key = strdup(json_object_get_string(o));
                        keys->k[keys->n++].obj = obj;
                    }
                    json_object_put(o);
                }
            }
        } else if (c == '{' || c == '[') {
            if (++depth >= JSON_SCAN_DEPTH)
                return -1;
            is_obj[depth] = c == '{';
            expect_key = c == '{';
            obj += c == '{' && depth == at;
        } else if (c == '}' || c == ']') {
            if (depth == 0)
                return -1;
            depth--;
            expect_key = 0;
        } else if (c == ',') {
            expect_key = depth > 0 && is_obj[depth];
        }
    }
    return n;
}

/* Keys of all objects in a parsed tree. */
static long
json_count_keys(struct json_object *o)
{
    long n = 0;

    if (json_object_is_type(o, json_type_object)) {
        json_object_object_foreach(o, k, v) {
            (void)k;
            n += 1 + json_count_keys(v);
        }
    } else if (json_object_is_type(o, json_type_array)) {
        for (size_t i = 0; i < json_object_array_length(o); i++)
            n += json_count_keys(json_object_array_get_idx(o, i));
    }
    return n;
}

/* By object, then by key (NULL, a key strdup could not copy, first). */
static int
cmp_item(const void *a, const void *b)
{
    const struct key_item *x = a, *y = b;

    if (x->obj != y->obj)
        return x->obj < y->obj ? -1 : 1;
    if (x->key == NULL || y->key == NULL)
        return (x->key != NULL) - (y->key != NULL);
    return strcmp(x->key, y->key);
}

int
dsv4_json_find_dup(struct json_object *root, const char *s, size_t len, int at, char *buf,
              size_t blen)
{
    struct key_list kl = { 0 };
    long total = json_scan_keys(s, len, at, NULL);

    buf[0] = '\0';
    if (total == json_count_keys(root))
        return 0;
    kl.cap = total > 0 ? (int)(total < INT_MAX ? total : INT_MAX) : 0;
    kl.k = calloc((size_t)kl.cap + 1, sizeof(*kl.k));
    if (kl.k == NULL)
        return 1;
    json_scan_keys(s, len, at, &kl);
    qsort(kl.k, (size_t)kl.n, sizeof(*kl.k), cmp_item);
    for (int i = 1; i < kl.n; i++) {
        const struct key_item *x = &kl.k[i - 1], *y = &kl.k[i];

        if (x->obj == y->obj && x->key != NULL && y->key != NULL &&
            strcmp(x->key, y->key) == 0) {
            snprintf(buf, blen, "%s", y->key);
            break;
        }
    }
    for (int i = 0; i < kl.n; i++)
        free(kl.k[i].key);
    free(kl.k);
    return 1;
}
