/*
 * config_file.c — see config_file.h.  One table lists every key with its
 * type, place in struct dsv4_conf and range; parsing, setting and printing
 * are driven by it, so adding a key is one table row plus a struct field.
 */
#include "common/config_file.h"

#include <sys/stat.h>

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer.h"

enum cfg_type {
    CFG_STR,    /* char array of `size` bytes */
    CFG_INT,    /* int in [min, max], decimal */
    CFG_MODE,   /* unsigned file mode, octal, 0 ... 0777 */
    CFG_ENUM,   /* char array; value must be one of `choices` */
};

struct cfg_key {
    const char *name;
    enum cfg_type type;
    size_t off;             /* offsetof(struct dsv4_conf, field) */
    size_t size;            /* CFG_STR/CFG_ENUM: array size */
    long min, max;          /* CFG_INT */
    const char *const *choices; /* CFG_ENUM: NULL-terminated */
};

static const char *const cfg_backends[] = { "cpu", "cuda", NULL };
static const char *const cfg_numerics[] = { "ref", "hf", NULL };
static const char *const cfg_yesno[] = { "no", "yes", NULL };
static const char *const cfg_kernels[] = { "fast", "exact", NULL };
static const char *const cfg_priority[] = { "decode", "none", NULL };
static const char *const cfg_split[] = { "auto", "ep", "tp", NULL };
static const char *const cfg_autoyesno[] = { "auto", "yes", "no", NULL };
static const char *const cfg_comms[] = { "auto", "nccl", "cudaipc", "shm", NULL };

#define STR(f) CFG_STR, offsetof(struct dsv4_conf, f), \
    sizeof(((struct dsv4_conf *)0)->f), 0, 0, NULL
#define INT(f, lo, hi) CFG_INT, offsetof(struct dsv4_conf, f), 0, lo, hi, NULL
#define ENUM(f, c) CFG_ENUM, offsetof(struct dsv4_conf, f), \
    sizeof(((struct dsv4_conf *)0)->f), 0, 0, c

static const struct cfg_key cfg_keys[] = {
    { "client_endpoint",    STR(client_endpoint) },
    { "rank_endpoint",      STR(rank_endpoint) },
    { "admin_endpoint",     STR(admin_endpoint) },
    { "admin_mode",         CFG_MODE, offsetof(struct dsv4_conf, admin_mode),
                            0, 0, 0777, NULL },
    { "key_dir",            STR(key_dir) },
    { "max_batch",          INT(max_batch, 1, 1024) },
    { "queue_max",          INT(queue_max, 1, 1 << 24) },   /* 0 refused every request */
    { "prefill_chunk",      INT(prefill_chunk, 1, 1 << 20) },
    { "heartbeat_ms",       INT(heartbeat_ms, 10, 600000) },
    { "liveness",           INT(liveness, 1, 100) },
    { "request_timeout_ms", INT(request_timeout_ms, 0, 86400000) },
    { "stop_timeout_ms",    INT(stop_timeout_ms, 0, 3600000) },
    { "burst_streams",      INT(burst_streams, 0, 65535) },
    { "burst_free_slots",   INT(burst_free_slots, 0, 65535) },
    { "checkpoint",         STR(checkpoint) },
    { "tokenizer",          STR(tokenizer) },
    { "backend",            ENUM(backend, cfg_backends) },
    { "numerics",           ENUM(numerics, cfg_numerics) },
    { "threads",            INT(threads, 0, 4096) },
    { "slots",              INT(slots, 1, 65535) },
    { "prefill_slots",      INT(prefill_slots, 1, 65535) },
    { "max_seq",            INT(max_seq, 1, 1 << 20) },
    { "group_size",         INT(group_size, 1, 64) },
    { "gpu",                INT(gpu, -1, 1023) },
    { "comm",               ENUM(comm, cfg_comms) },
    { "share_weights",      ENUM(share_weights, cfg_autoyesno) },
    { "share_dir",          STR(share_dir) },
    { "host",               STR(host) },
    { "ucx",                ENUM(ucx, cfg_autoyesno) },
    { "ucx_tls",            STR(ucx_tls) },
    { "ucx_devices",        STR(ucx_devices) },
    { "kv_timeout_ms",      INT(kv_timeout_ms, 100, 600000) },
    { "stop_drain_s",       INT(stop_drain_s, 0, 3600) },
    { "mtp",                ENUM(mtp, cfg_yesno) },
    { "warmup",             ENUM(warmup, cfg_yesno) },
    { "kv_cudaipc",         ENUM(kv_cudaipc, cfg_autoyesno) },
    { "kv_cudaipc_cache_mib", INT(kv_cudaipc_cache_mib, 0, 1 << 20) },
    { "cuda_kernels",       ENUM(cuda_kernels, cfg_kernels) },
    { "cuda_priority",      ENUM(cuda_priority, cfg_priority) },
    { "group_split",       ENUM(group_split, cfg_split) },
    { "burst",              ENUM(burst, cfg_yesno) },
    { "mps_sm_percent",     INT(mps_sm_percent, 0, 100) },
    { "gateway_listen",     STR(gateway_listen) },
    { "gateway_keys",       STR(gateway_keys) },
    { "gateway_model",      STR(gateway_model) },
    { "gateway_max_body",   INT(gateway_max_body, 1024, 16 << 20) },
    { "gateway_max_conns",  INT(gateway_max_conns, 1, 65535) },
    { "gateway_max_conns_per_ip", INT(gateway_max_conns_per_ip, 0, 65535) },
    { "gateway_idle_s",     INT(gateway_idle_s, 1, 86400) },
    { "gateway_timeout_ms", INT(gateway_timeout_ms, 1000, 86400000) },
    { "gateway_launch",     ENUM(gateway_launch, cfg_yesno) },
};
#define CFG_NKEYS (sizeof(cfg_keys) / sizeof(cfg_keys[0]))

/* Role prefixes, indexed by enum dsv4_conf_role. */
static const char *const cfg_prefixes[] = { "", "sched.", "prefill.", "decode." };
#define CFG_NROLES 4

void
dsv4_conf_defaults(struct dsv4_conf *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    snprintf(cfg->client_endpoint, sizeof(cfg->client_endpoint), "%s",
        "ipc://" DSV4_RUN_DIR "/client.sock");
    snprintf(cfg->rank_endpoint, sizeof(cfg->rank_endpoint), "%s",
        "ipc://" DSV4_RUN_DIR "/rank.sock");
    snprintf(cfg->admin_endpoint, sizeof(cfg->admin_endpoint), "%s",
        "ipc://" DSV4_RUN_DIR "/ctl.sock");
    cfg->admin_mode = 0660;
    snprintf(cfg->key_dir, sizeof(cfg->key_dir), "%s", "/etc/dsv4");
    cfg->max_batch = 16;
    cfg->queue_max = 1024;
    cfg->prefill_chunk = 512;
    cfg->heartbeat_ms = 1000;
    cfg->liveness = 3;
    cfg->request_timeout_ms = 0;
    cfg->stop_timeout_ms = 10000;
    cfg->burst_free_slots = 1;   /* docs/operations.md "Burst prefill" */
    snprintf(cfg->checkpoint, sizeof(cfg->checkpoint), "%s",
        "/var/lib/dsv4/model");
    snprintf(cfg->tokenizer, sizeof(cfg->tokenizer), "%s",
        DSV4_TOKENIZER_DEFAULT);
    snprintf(cfg->backend, sizeof(cfg->backend), "%s", "cpu");
    snprintf(cfg->numerics, sizeof(cfg->numerics), "%s", "ref");
    cfg->threads = 0;
    cfg->slots = 16;
    cfg->prefill_slots = 1;
    cfg->max_seq = 4096;
    cfg->group_size = 1;
    cfg->gpu = -1;
    snprintf(cfg->comm, sizeof(cfg->comm), "%s", "auto");
    snprintf(cfg->share_weights, sizeof(cfg->share_weights), "%s", "auto");
    snprintf(cfg->ucx, sizeof(cfg->ucx), "%s", "auto");
    snprintf(cfg->ucx_tls, sizeof(cfg->ucx_tls), "%s", "tcp");
    cfg->kv_timeout_ms = 5000;
    cfg->stop_drain_s = 20;
    snprintf(cfg->mtp, sizeof(cfg->mtp), "%s", "no");
    snprintf(cfg->warmup, sizeof(cfg->warmup), "%s", "yes");
    snprintf(cfg->burst, sizeof(cfg->burst), "%s", "no");
    snprintf(cfg->cuda_kernels, sizeof(cfg->cuda_kernels), "%s", "fast");
    snprintf(cfg->cuda_priority, sizeof(cfg->cuda_priority), "%s", "decode");
    snprintf(cfg->group_split, sizeof(cfg->group_split), "%s", "auto");
    /* passed on the H200s (docs/gpu.md "Decode-state handoff over CUDA IPC") */
    snprintf(cfg->kv_cudaipc, sizeof(cfg->kv_cudaipc), "%s", "auto");
    cfg->kv_cudaipc_cache_mib = 4096;
    snprintf(cfg->gateway_listen, sizeof(cfg->gateway_listen), "%s", "127.0.0.1:8000");
    snprintf(cfg->gateway_model, sizeof(cfg->gateway_model), "%s", "deepseek-v4-flash");
    cfg->gateway_max_body = 1 << 20;
    cfg->gateway_max_conns = 256;
    cfg->gateway_idle_s = 60;
    cfg->gateway_timeout_ms = 600000;
    snprintf(cfg->gateway_launch, sizeof(cfg->gateway_launch), "%s", "no");
}

static const struct cfg_key *
cfg_find(const char *name, size_t len)
{
    size_t i;

    for (i = 0; i < CFG_NKEYS; i++)
        if (strlen(cfg_keys[i].name) == len &&
            memcmp(cfg_keys[i].name, name, len) == 0)
            return &cfg_keys[i];
    return NULL;
}

/* Check `value` for key `k` and, when `cfg` is not NULL, store it. */
static enum dsv4_err
cfg_apply(struct dsv4_conf *cfg, const struct cfg_key *k, const char *value)
{
    char *end, *dst;
    long v;
    size_t i;

    /* Every value fits DSV4_CONF_STR bytes, numbers too (strtol takes any
     * number of leading zeros): a prefixed line's value is kept in a
     * buffer of that size until the plain keys are applied. */
    if (strlen(value) >= DSV4_CONF_STR)
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: value longer than %d bytes", k->name,
            DSV4_CONF_STR - 1);
    switch (k->type) {
    case CFG_STR:
    case CFG_ENUM:
        if (strlen(value) >= k->size)
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: value longer than %zu bytes",
                k->name, k->size - 1);
        /* No escapes: a quote inside a value would end a quoted one, and
         * dsv4_conf_print could not write it back. */
        if (strchr(value, '"') != NULL)
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: a value cannot contain '\"' (quotes "
                "may only enclose the whole value)", k->name);
        if (k->type == CFG_ENUM) {
            for (i = 0; k->choices[i] != NULL; i++)
                if (strcmp(k->choices[i], value) == 0)
                    break;
            if (k->choices[i] == NULL)
                return dsv4_err_set(DSV4_ERR_CONFIG, "%s: unknown value \"%s\"",
                    k->name, value);
        }
        if (cfg != NULL) {
            dst = (char *)cfg + k->off;
            memcpy(dst, value, strlen(value) + 1);
        }
        return DSV4_OK;
    case CFG_INT:
    case CFG_MODE:
        errno = 0;
        v = strtol(value, &end, k->type == CFG_MODE ? 8 : 10);
        if (errno == ERANGE && value[0] != '\0' && *end == '\0')
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: %s out of range", k->name, value);
        if (value[0] == '\0' || *end != '\0' || errno != 0 ||
            (k->type == CFG_INT && (value[0] == '+' || value[0] == ' ')) ||
            (k->type == CFG_MODE && (value[0] < '0' || value[0] > '7')))
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: \"%s\" is not %s",
                k->name, value, k->type == CFG_MODE ? "an octal mode" : "an integer");
        if (v < k->min || v > k->max)
            return dsv4_err_set(DSV4_ERR_CONFIG, k->type == CFG_MODE ?
                "%s: %#lo outside %#lo ... %#lo" : "%s: %ld outside %ld ... %ld",
                k->name, v, k->min, k->max);
        if (cfg != NULL) {
            if (k->type == CFG_MODE)
                *(unsigned *)((char *)cfg + k->off) = (unsigned)v;
            else
                *(int *)((char *)cfg + k->off) = (int)v;
        }
        return DSV4_OK;
    }
    return dsv4_err_set(DSV4_ERR_CONFIG, "%s: bad key type", k->name);
}

enum dsv4_err
dsv4_conf_set(struct dsv4_conf *cfg, const char *key, const char *value)
{
    const struct cfg_key *k = cfg_find(key, strlen(key));

    if (k == NULL)
        return dsv4_err_set(DSV4_ERR_CONFIG, "unknown key \"%s\"", key);
    return cfg_apply(cfg, k, value);
}

enum dsv4_err
dsv4_conf_set_kv(struct dsv4_conf *cfg, const char *kv)
{
    const char *eq = strchr(kv, '=');
    char key[64];

    if (eq == NULL || eq == kv)
        return dsv4_err_set(DSV4_ERR_CONFIG, "\"%s\": expected key=value", kv);
    if ((size_t)(eq - kv) >= sizeof(key))
        return dsv4_err_set(DSV4_ERR_CONFIG, "unknown key \"%.*s...\": %zu bytes, longer "
            "than any key", (int)sizeof(key) / 2, kv, (size_t)(eq - kv));
    memcpy(key, kv, eq - kv);
    key[eq - kv] = '\0';
    return dsv4_conf_set(cfg, key, eq + 1);
}

/* Trim blanks at both ends of s in place; returns the new start. */
static char *
cfg_trim(char *s)
{
    char *e;

    while (*s == ' ' || *s == '\t')
        s++;
    e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1]))
        *--e = '\0';
    return s;
}

/* A role-prefixed line kept until the plain keys are applied. */
struct cfg_deferred {
    const struct cfg_key *key;
    char value[DSV4_CONF_STR];
};

/*
 * Parse one line (NUL-terminated, newline removed) into key, role, instance
 * (*inst: N of a `prefill@N.` / `decode@N.` prefix, else -1) and value.
 * Returns DSV4_OK with *k NULL for blank/comment lines.
 */
static enum dsv4_err
cfg_parse_line(char *line, const struct cfg_key **k, int *role, long *inst, char **value)
{
    char *p, *eq, *key, *val, *q, *full;
    size_t plen;
    int r;

    *k = NULL;
    /* Cut a comment: '#' at the start or after a blank, outside quotes. */
    for (p = line, q = NULL; *p != '\0'; p++) {
        if (*p == '"')
            q = q == NULL ? p : NULL;
        else if (*p == '#' && q == NULL && (p == line || p[-1] == ' ' ||
            p[-1] == '\t')) {
            *p = '\0';
            break;
        }
    }
    key = cfg_trim(line);
    if (*key == '\0')
        return DSV4_OK;
    eq = strchr(key, '=');
    if (eq == NULL)
        return dsv4_err_set(DSV4_ERR_CONFIG, "expected key = value");
    *eq = '\0';
    val = cfg_trim(eq + 1);
    key = cfg_trim(key);
    if (val[0] == '"') {
        q = strrchr(val + 1, '"');
        if (q == NULL || q[1] != '\0')
            return dsv4_err_set(DSV4_ERR_CONFIG, "%s: unterminated quote", key);
        *q = '\0';
        val++;
    }
    *role = DSV4_CONF_ROLE_NONE;
    *inst = -1;
    full = key;
    for (r = 1; r < CFG_NROLES; r++) {
        plen = strlen(cfg_prefixes[r]);
        if (strncmp(key, cfg_prefixes[r], plen) == 0) {
            *role = r;
            key += plen;
            break;
        }
        /* `prefill@N.` / `decode@N.`: the role's name, '@', decimal N, '.' */
        if (r != DSV4_CONF_ROLE_SCHED && strncmp(key, cfg_prefixes[r], plen - 1) == 0 &&
            key[plen - 1] == '@') {
            char *end;

            errno = 0;
            if (!isdigit((unsigned char)key[plen]) ||
                (*inst = strtol(key + plen, &end, 10), *end != '.') || errno != 0 ||
                *inst > 65535)
                return dsv4_err_set(DSV4_ERR_CONFIG, "\"%s\": expected %.*s@N.key with N "
                    "0-65535", key, (int)plen - 1, cfg_prefixes[r]);
            *role = r;
            key = end + 1;
            break;
        }
    }
    *k = cfg_find(key, strlen(key));
    if (*k == NULL)
        return dsv4_err_set(DSV4_ERR_CONFIG, "unknown key \"%s\"", full);
    *value = val;
    return DSV4_OK;
}

/* An instance-prefixed key seen in the file (duplicates are errors). */
struct cfg_inst_seen {
    int role;
    long inst;
    size_t key;
};

/* Whether (role, inst, key) was seen before; records it if not.  false and
 * *err set when out of memory. */
static bool
cfg_inst_dup(struct cfg_inst_seen **seen, size_t *n, int role, long inst, size_t key,
    enum dsv4_err *err)
{
    struct cfg_inst_seen *p;

    for (size_t i = 0; i < *n; i++)
        if ((*seen)[i].role == role && (*seen)[i].inst == inst && (*seen)[i].key == key)
            return true;
    if ((p = realloc(*seen, (*n + 1) * sizeof(*p))) == NULL) {
        *err = dsv4_err_set(DSV4_ERR_NOMEM, "out of memory");
        return false;
    }
    p[*n].role = role;
    p[*n].inst = inst;
    p[*n].key = key;
    *seen = p;
    (*n)++;
    return false;
}

enum dsv4_err
dsv4_conf_load(struct dsv4_conf *cfg, const char *path,
    enum dsv4_conf_role role)
{
    return dsv4_conf_load_rank(cfg, path, role, -1);
}

enum dsv4_err
dsv4_conf_load_rank(struct dsv4_conf *cfg, const char *path,
    enum dsv4_conf_role role, int index)
{
    struct cfg_deferred def[CFG_NKEYS], idef[CFG_NKEYS];
    unsigned char seen[CFG_NROLES][CFG_NKEYS];
    struct cfg_inst_seen *iseen = NULL;
    const struct cfg_key *k;
    char *line = NULL, *value;
    size_t cap = 0, n_def = 0, n_idef = 0, n_iseen = 0, i;
    ssize_t len;
    enum dsv4_err err = DSV4_OK;
    int lineno = 0, lrole;
    long linst;
    struct stat st;
    FILE *fp;

    fp = fopen(path, "re");
    if (fp == NULL)
        return dsv4_err_set(DSV4_ERR_SYS, "%s: %s", path, strerror(errno));
    /* a directory opens, and reading it fails ("read error" said no more) */
    if (fstat(fileno(fp), &st) == 0 && S_ISDIR(st.st_mode)) {
        fclose(fp);
        return dsv4_err_set(DSV4_ERR_CONFIG, "%s: is a directory, not a configuration file",
            path);
    }
    memset(seen, 0, sizeof(seen));
    while ((len = getline(&line, &cap, fp)) >= 0) {
        lineno++;
        if (len > 0 && line[len - 1] == '\n')
            line[--len] = '\0';
        if (strlen(line) != (size_t)len) {
            err = DSV4_ERR_CONFIG;
            dsv4_err_set(err, "%s:%d: NUL byte in line", path, lineno);
            break;
        }
        err = cfg_parse_line(line, &k, &lrole, &linst, &value);
        if (err == DSV4_OK && k != NULL) {
            i = (size_t)(k - cfg_keys);
            if (linst >= 0) {
                if (cfg_inst_dup(&iseen, &n_iseen, lrole, linst, i, &err))
                    err = dsv4_err_set(DSV4_ERR_CONFIG, "%.*s@%ld.%s given twice",
                        (int)strlen(cfg_prefixes[lrole]) - 1, cfg_prefixes[lrole], linst,
                        k->name);
            } else {
                if (seen[lrole][i])
                    err = dsv4_err_set(DSV4_ERR_CONFIG, "%s%s given twice",
                        cfg_prefixes[lrole], k->name);
                seen[lrole][i] = 1;
            }
        }
        if (err == DSV4_OK && k != NULL) {
            if (lrole == DSV4_CONF_ROLE_NONE) {
                err = cfg_apply(cfg, k, value);
            } else {
                /* Validate now, apply after the plain keys (instance lines
                 * after the role's). */
                struct cfg_deferred *d;

                err = cfg_apply(NULL, k, value);
                d = err != DSV4_OK || lrole != (int)role ? NULL
                    : linst < 0                          ? &def[n_def++]
                    : linst == index                     ? &idef[n_idef++]
                                                         : NULL;
                if (d != NULL) {
                    d->key = k;
                    memcpy(d->value, value, strlen(value) + 1);
                }
            }
        }
        if (err != DSV4_OK) {
            char msg[1024], pfx[32] = "";

            snprintf(msg, sizeof(msg), "%s", dsv4_errmsg());
            /* a value's error names the key as the line has it
             * ("decode@1.burst: ...", not "burst: ...") */
            if (k != NULL && lrole != DSV4_CONF_ROLE_NONE &&
                strncmp(msg, k->name, strlen(k->name)) == 0 && msg[strlen(k->name)] == ':') {
                if (linst >= 0)
                    snprintf(pfx, sizeof(pfx), "%.*s@%ld.",
                        (int)strlen(cfg_prefixes[lrole]) - 1, cfg_prefixes[lrole], linst);
                else
                    snprintf(pfx, sizeof(pfx), "%s", cfg_prefixes[lrole]);
            }
            dsv4_err_set(err, "%s:%d: %s%s", path, lineno, pfx, msg);
            break;
        }
    }
    if (err == DSV4_OK && ferror(fp))
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: read error: %s", path, strerror(errno));
    free(line);
    free(iseen);
    fclose(fp);
    for (i = 0; err == DSV4_OK && i < n_def; i++)
        err = cfg_apply(cfg, def[i].key, def[i].value);
    for (i = 0; err == DSV4_OK && i < n_idef; i++)
        err = cfg_apply(cfg, idef[i].key, idef[i].value);
    return err;
}

void
dsv4_conf_print(const struct dsv4_conf *cfg, FILE *fp)
{
    const struct cfg_key *k;
    const char *s;
    size_t i;

    for (i = 0; i < CFG_NKEYS; i++) {
        k = &cfg_keys[i];
        switch (k->type) {
        case CFG_STR:
        case CFG_ENUM:
            s = (const char *)cfg + k->off;
            /* Quote what would not survive unquoted: empty, '#', edges. */
            if (s[0] == '\0' || strchr(s, '#') != NULL || s[0] == '"' ||
                isspace((unsigned char)s[0]) ||
                isspace((unsigned char)s[strlen(s) - 1]))
                fprintf(fp, "%s = \"%s\"\n", k->name, s);
            else
                fprintf(fp, "%s = %s\n", k->name, s);
            break;
        case CFG_INT:
            fprintf(fp, "%s = %d\n", k->name,
                *(const int *)((const char *)cfg + k->off));
            break;
        case CFG_MODE:
            fprintf(fp, "%s = %04o\n", k->name,
                *(const unsigned *)((const char *)cfg + k->off));
            break;
        }
    }
}
