/*
 * sched_reload.c — dsv4-sched: reload the configuration on SIGHUP
 * (`systemctl reload dsv4-sched`, ExecReload=) or the admin command RELOAD
 * (`dsv4ctl reload`), without dropping a request.
 *
 * The file is read again with the same -o overrides (which still win).  A
 * file that does not load changes nothing: the scheduler keeps its running
 * settings and says why.  Of the keys the scheduler uses, the admission and
 * batching ones take effect at once (queue_max, request_timeout_ms for
 * requests admitted from now on, stop_timeout_ms for the next SIGTERM,
 * prefill_chunk, burst_streams,
 * burst_free_slots, max_batch:
 * streams already decoding beyond a lowered max_batch finish where they
 * are); the rest (endpoints, admin_mode, key_dir, heartbeat_ms, liveness,
 * tokenizer) are bound at the start, so a change of one is logged and keeps
 * the running value until dsv4-sched restarts.  Keys only ranks read are not
 * the scheduler's business and are ignored here.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/sdnotify.h"
#include "daemons/sched/sched.h"

/* A key of struct dsv4_conf: its name and where it is. */
struct reload_key {
    const char *name;
    size_t off;
};

/* int keys applied at once. */
static const struct reload_key live_keys[] = {
    { "queue_max", offsetof(struct dsv4_conf, queue_max) },
    { "request_timeout_ms", offsetof(struct dsv4_conf, request_timeout_ms) },
    { "stop_timeout_ms", offsetof(struct dsv4_conf, stop_timeout_ms) },
    { "prefill_chunk", offsetof(struct dsv4_conf, prefill_chunk) },
    { "burst_streams", offsetof(struct dsv4_conf, burst_streams) },
    { "burst_free_slots", offsetof(struct dsv4_conf, burst_free_slots) },
    { "max_batch", offsetof(struct dsv4_conf, max_batch) },
};

/* int and string keys bound at the start: a change waits for a restart. */
static const struct reload_key start_ints[] = {
    { "heartbeat_ms", offsetof(struct dsv4_conf, heartbeat_ms) },
    { "liveness", offsetof(struct dsv4_conf, liveness) },
};

static const struct reload_key start_strs[] = {
    { "client_endpoint", offsetof(struct dsv4_conf, client_endpoint) },
    { "rank_endpoint", offsetof(struct dsv4_conf, rank_endpoint) },
    { "admin_endpoint", offsetof(struct dsv4_conf, admin_endpoint) },
    { "key_dir", offsetof(struct dsv4_conf, key_dir) },
    { "tokenizer", offsetof(struct dsv4_conf, tokenizer) },
    /* read at the start for the model's fingerprint (ranks are matched to
     * it): a change waits for a restart like the others */
    { "checkpoint", offsetof(struct dsv4_conf, checkpoint) },
};

static int *
int_at(struct dsv4_conf *c, size_t off)
{
    return (int *)((char *)c + off);
}

static const char *
str_at(const struct dsv4_conf *c, size_t off)
{
    return (const char *)c + off;
}

int
sched_reload(struct sched *s, char *msg, size_t len)
{
    struct sched_config nc;
    unsigned changed = 0, waiting = 0;
    int max_batch = s->cfg.file.max_batch;

    sdnotify_reloading();
    /* the file read is the load's choice: without -f the default file,
     * which may have appeared since the start */
    if (sched_config_load(&nc, s->cfg.path, s->cfg.n_over, s->cfg.over) != 0) {
        snprintf(msg, len, "the configuration does not load (%s); the running settings stay",
            dsv4_errmsg());
        log_warnx("reload: the configuration does not load; the running settings stay");
        sdnotify_status("serving; the last reload failed (see the log)");
        sdnotify_ready();
        return -1;
    }
    log_notice("reload: read %s", nc.path != NULL ? nc.path : "no file (defaults)");
    for (size_t i = 0; i < sizeof(live_keys) / sizeof(live_keys[0]); i++) {
        int *cur = int_at(&s->cfg.file, live_keys[i].off);
        int v = *int_at(&nc.file, live_keys[i].off);

        if (*cur == v)
            continue;
        log_notice("reload: %s %d -> %d", live_keys[i].name, *cur, v);
        if (live_keys[i].off == offsetof(struct dsv4_conf, prefill_chunk) && v > *cur)
            log_warnx("reload: prefill ranks cut chunks to the rows per call they sized at "
                "their start: restart them for chunks of %d", v);
        *cur = v;
        changed++;
    }
    for (size_t i = 0; i < sizeof(start_ints) / sizeof(start_ints[0]); i++) {
        int cur = *int_at(&s->cfg.file, start_ints[i].off);
        int v = *int_at(&nc.file, start_ints[i].off);

        if (cur == v)
            continue;
        log_warnx("reload: %s %d -> %d takes effect at the next start of dsv4-sched; "
            "%d stays", start_ints[i].name, cur, v, cur);
        waiting++;
    }
    for (size_t i = 0; i < sizeof(start_strs) / sizeof(start_strs[0]); i++) {
        if (strcmp(str_at(&s->cfg.file, start_strs[i].off), str_at(&nc.file,
            start_strs[i].off)) == 0)
            continue;
        log_warnx("reload: %s \"%s\" takes effect at the next start of dsv4-sched; \"%s\" "
            "stays", start_strs[i].name, str_at(&nc.file, start_strs[i].off),
            str_at(&s->cfg.file, start_strs[i].off));
        waiting++;
    }
    if (s->cfg.file.admin_mode != nc.file.admin_mode) {
        log_warnx("reload: admin_mode %04o takes effect at the next start of dsv4-sched; "
            "%04o stays", nc.file.admin_mode, s->cfg.file.admin_mode);
        waiting++;
    }
    if (s->cfg.file.max_batch != max_batch)
        rank_groups_update(s);
    log_notice("reload: done, %u setting(s) changed, %u waiting for a restart", changed,
        waiting);
    snprintf(msg, len, "%u setting(s) changed, %u waiting for a restart (the log says which)",
        changed, waiting);
    sdnotify_status("serving; configuration reloaded (%u changed, %u waiting for a restart)",
        changed, waiting);
    sdnotify_ready();
    return 0;
}
