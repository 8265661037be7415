/*
 * json_keys.h — strict JSON parsing of a byte range and the duplicated keys
 * json-c keeps quietly (the last of them wins).
 */
#ifndef DSV4_COMMON_JSON_KEYS_H
#define DSV4_COMMON_JSON_KEYS_H

#include <stddef.h>

#include <json-c/json.h>

/*
 * Parse exactly `len` bytes as one JSON value (strict mode; trailing
 * whitespace allowed, anything else after the value — including NUL — is an
 * error).  Returns NULL on failure with *why set (a static string).
 */
struct json_object *dsv4_json_parse_exact(const char *s, size_t len, const char **why);

/*
 * 0 if `root` (parsed from the `len` bytes at s) lost no duplicated key.
 * Otherwise 1, with `buf` (blen bytes) naming a key written twice in one
 * object at depth `at` (1: the keys of the top-level object; 2: those of
 * the objects inside it: the tensor name of a safetensors header at 1, the
 * weight_map entry of an index at 2), or "" if the duplicate is at another
 * depth (one key in two sibling objects is no duplicate).  The keys are
 * counted in the raw text, which must be what json-c parsed (strict or
 * plain: quotes of either kind).
 */
int dsv4_json_find_dup(struct json_object *root, const char *s, size_t len, int at, char *buf,
                       size_t blen);

#endif
