/*
 * sched_config.c — dsv4-sched: read the configuration (the shared
 * /etc/dsv4/dsv4.conf through common/config_file.h, keys prefixed `sched.`
 * win) and the -o overrides of the command line.  Startup only.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "daemons/sched/sched.h"

int
sched_config_load(struct sched_config *c, const char *path, int n_over, char *const *over)
{
    dsv4_conf_defaults(&c->file);
    c->path = path;
    /* Without -f the default file is read when it exists (a bare machine or
     * a test runs on defaults and -o). */
    if (c->path == NULL && access(DSV4_CONF_DEFAULT_PATH, F_OK) == 0)
        c->path = DSV4_CONF_DEFAULT_PATH;
    if (c->path != NULL && dsv4_conf_load(&c->file, c->path, DSV4_CONF_ROLE_SCHED) != DSV4_OK) {
        log_warnx("config: %s", dsv4_errmsg());
        return -1;
    }
    for (int i = 0; i < n_over; i++) {
        if (dsv4_conf_set_kv(&c->file, over[i]) != DSV4_OK) {
            log_warnx("config: -o %s: %s", over[i], dsv4_errmsg());
            return -1;
        }
    }
    /* An explicitly configured tokenizer must load; the default is optional
     * (token-id requests need none). */
    c->tokenizer_required = strcmp(c->file.tokenizer, DSV4_TOKENIZER_DEFAULT) != 0;
    return 0;
}
