/*
 * sched_config.c — dsv4-sched: read the configuration (the shared
 * /etc/dsv4/dsv4.conf through common/config_file.h, keys prefixed `sched.`
 * win) and the -o overrides of the command line, and -n's check of it.
 * At the start, and again for a reload (sched_reload.c).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "daemons/sched/sched.h"

int
sched_config_load(struct sched_config *c, const char *path, int n_over, char *const *over)
{
    dsv4_conf_defaults(&c->file);
    c->path = path;
    c->n_over = n_over;
    c->over = over;
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

/*
 * Whether a bound ipc:// endpoint lies in DSV4_RUN_DIR while that directory
 * does not exist: the units' RuntimeDirectory= and dsv4-launch make it at
 * the start (a host where the service has not run since the boot), so -n
 * notes it instead of failing.  Any other missing directory is an error.
 */
static bool
in_run_dir_to_make(const char *ep)
{
    size_t n = strlen("ipc://" DSV4_RUN_DIR "/");
    struct stat st;

    if (*ep == '@')
        ep++;
    return strncmp(ep, "ipc://" DSV4_RUN_DIR "/", n) == 0 && strchr(ep + n, '/') == NULL &&
        stat(DSV4_RUN_DIR, &st) != 0 && errno == ENOENT;
}

int
sched_config_check(const struct sched_config *c)
{
    static const char *const what[] = { "client", "rank", "admin" };
    const char *eps[] = { c->file.client_endpoint, c->file.rank_endpoint,
                          c->file.admin_endpoint };
    struct dsv4_zsock_cfg zc;
    struct dsv4_tok *tok;
    const char *tp = dsv4_tok_conf_path(c->file.tokenizer);

    for (int i = 0; i < 3; i++) {
        if (in_run_dir_to_make(eps[i])) {
            printf("%s socket %s (no directory " DSV4_RUN_DIR " now: the units' "
                "RuntimeDirectory= or dsv4-launch make it at the start)\n", what[i], eps[i]);
            continue;
        }
        dsv4_zsock_cfg_init(&zc);
        zc.bind = true;
        zc.endpoint = eps[i];
        zc.key_dir = c->file.key_dir;
        if (i == 2)
            zc.mode = c->file.admin_mode;   /* as the start binds it (sched.c) */
        if (dsv4_zsock_check(&zc) != DSV4_OK) {
            log_warnx("config: %s_endpoint: %s", what[i], dsv4_errmsg());
            return -1;
        }
        printf("%s socket %s\n", what[i], eps[i]);
    }
    if (tp == NULL) {
        printf("tokenizer none: token-id prompts only\n");
        return 0;
    }
    if (dsv4_tok_load(&tok, tp, DSV4_TOK_HF) != DSV4_OK) {
        if (c->tokenizer_required) {
            log_warnx("config: tokenizer: %s", dsv4_errmsg());
            return -1;
        }
        printf("no tokenizer (%s): token-id prompts only\n", dsv4_errmsg());
        return 0;
    }
    printf("tokenizer %s (%d ids)\n", tp, dsv4_tok_vocab_size(tok));
    dsv4_tok_free(tok);
    return 0;
}
