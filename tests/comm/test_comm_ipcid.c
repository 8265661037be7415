/*
 * test_comm_ipcid.c — the host-side parts of the cudaipc communicator that
 * need no GPU (kernels/comm.h, kernels/comm_id.c): its group ids (made,
 * recognised, told apart from shm names and NCCL ids), the choice of
 * communicator from the `comm` key (dsv4_comm_pick), the key itself in the
 * config file (common/config_file.c), dsv4_comm_check on communicators
 * without a check, and the constructor's refusal of a CPU backend; and the
 * shm communicator's refusal of ranks whose largest calls differ (which
 * breaks the group for the others), its creation stopped early (struct
 * dsv4_comm_stop), a segment rank 0 never sized, and its name removed when
 * rank 0 is killed while the group assembles.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <sys/mman.h>
#include <sys/wait.h>

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/config_file.h"
#include "kernels/backend.h"
#include "kernels/comm.h"

static void
test_ids(void **state)
{
    uint8_t a[DSV4_COMM_ID_BYTES], b[DSV4_COMM_ID_BYTES], shm[DSV4_COMM_ID_BYTES];

    (void)state;
    assert_int_equal(dsv4_comm_cudaipc_unique_id(a), DSV4_OK);
    assert_int_equal(dsv4_comm_cudaipc_unique_id(b), DSV4_OK);
    assert_true(dsv4_comm_id_is_cudaipc(a));
    assert_true(dsv4_comm_id_is_cudaipc(b));
    assert_memory_not_equal(a, b, DSV4_COMM_ID_BYTES);
    assert_int_equal(strncmp((const char *)a, DSV4_COMM_CUDAIPC_PREFIX,
                             strlen(DSV4_COMM_CUDAIPC_PREFIX)), 0);
    assert_int_equal(strlen((const char *)a), strlen(DSV4_COMM_CUDAIPC_PREFIX) + 32);
    /* a shm group name is not one */
    assert_int_equal(dsv4_comm_shm_unique_id(shm), DSV4_OK);
    assert_false(dsv4_comm_id_is_cudaipc(shm));
    /* nor bytes that only start like one */
    memcpy(b, a, sizeof(b));
    b[DSV4_COMM_ID_BYTES - 1] = 1;               /* garbage after the NUL */
    assert_false(dsv4_comm_id_is_cudaipc(b));
    memcpy(b, a, sizeof(b));
    b[strlen(DSV4_COMM_CUDAIPC_PREFIX) + 3] = 'A'; /* upper-case hex */
    assert_false(dsv4_comm_id_is_cudaipc(b));
    memcpy(b, a, sizeof(b));
    b[strlen(DSV4_COMM_CUDAIPC_PREFIX) + 31] = '\0'; /* 31 digits */
    assert_false(dsv4_comm_id_is_cudaipc(b));
    /* an NCCL-like id: random bytes */
    for (int i = 0; i < DSV4_COMM_ID_BYTES; i++)
        b[i] = (uint8_t)(i * 37 + 11);
    assert_false(dsv4_comm_id_is_cudaipc(b));
    /* a cudaipc id names a usable shm group (its bootstrap) */
    {
        struct dsv4_comm *c = NULL;
        uint64_t v = 42;

        assert_int_equal(dsv4_comm_shm_create(&c, 0, 1, a, 64, 1000, NULL), DSV4_OK);
        assert_int_equal(c->ops->allreduce_min_u64(c, NULL, &v, 1), DSV4_OK);
        assert_int_equal(v, 42);
        dsv4_comm_destroy(c);
    }
}

static void
test_pick(void **state)
{
    (void)state;
    /* cpu: shm only */
    assert_int_equal(dsv4_comm_pick("auto", "cpu", 1, 2), DSV4_COMM_SHM);
    assert_int_equal(dsv4_comm_pick("auto", "cpu", 0, 2), DSV4_COMM_SHM);
    assert_int_equal(dsv4_comm_pick("shm", "cpu", 0, 16), DSV4_COMM_SHM);
    assert_int_equal(dsv4_comm_pick("nccl", "cpu", 1, 2), DSV4_COMM_NONE);
    assert_int_equal(dsv4_comm_pick("cudaipc", "cpu", 1, 2), DSV4_COMM_NONE);
    /* cuda: auto is cudaipc on one host (2..8 ranks), else nccl */
    assert_int_equal(dsv4_comm_pick("auto", "cuda", 1, 2), DSV4_COMM_CUDAIPC);
    assert_int_equal(dsv4_comm_pick("auto", "cuda", 1, 8), DSV4_COMM_CUDAIPC);
    assert_int_equal(dsv4_comm_pick("auto", "cuda", 1, 9), DSV4_COMM_NCCL);
    assert_int_equal(dsv4_comm_pick("auto", "cuda", 0, 2), DSV4_COMM_NCCL);
    assert_int_equal(dsv4_comm_pick("nccl", "cuda", 1, 2), DSV4_COMM_NCCL);
    assert_int_equal(dsv4_comm_pick("cudaipc", "cuda", 1, 4), DSV4_COMM_CUDAIPC);
    assert_int_equal(dsv4_comm_pick("cudaipc", "cuda", 0, 4), DSV4_COMM_CUDAIPC);
    assert_int_equal(dsv4_comm_pick("cudaipc", "cuda", 1, 9), DSV4_COMM_NONE);
    assert_non_null(strstr(dsv4_errmsg(), "cudaipc"));
    assert_int_equal(dsv4_comm_pick("shm", "cuda", 1, 2), DSV4_COMM_NONE);
}

static void
test_config_key(void **state)
{
    struct dsv4_conf cfg;
    char path[] = "/tmp/test_comm_ipcid.XXXXXX";
    int fd;
    FILE *f;

    (void)state;
    dsv4_conf_defaults(&cfg);
    assert_string_equal(cfg.comm, "auto");
    assert_int_equal(dsv4_conf_set(&cfg, "comm", "cudaipc"), DSV4_OK);
    assert_string_equal(cfg.comm, "cudaipc");
    assert_int_equal(dsv4_conf_set(&cfg, "comm", "nccl"), DSV4_OK);
    assert_int_equal(dsv4_conf_set(&cfg, "comm", "shm"), DSV4_OK);
    assert_int_equal(dsv4_conf_set_kv(&cfg, "comm=auto"), DSV4_OK);
    assert_string_equal(cfg.comm, "auto");
    assert_int_not_equal(dsv4_conf_set(&cfg, "comm", "ucx"), DSV4_OK);
    assert_int_not_equal(dsv4_conf_set(&cfg, "comm", ""), DSV4_OK);
    assert_string_equal(cfg.comm, "auto");
    /* in a file, with a role prefix that wins for that role only */
    fd = mkstemp(path);
    assert_true(fd >= 0);
    f = fdopen(fd, "w");
    assert_non_null(f);
    fprintf(f, "decode.comm = cudaipc\ncomm = nccl\n");
    fclose(f);
    dsv4_conf_defaults(&cfg);
    assert_int_equal(dsv4_conf_load(&cfg, path, DSV4_CONF_ROLE_DECODE), DSV4_OK);
    assert_string_equal(cfg.comm, "cudaipc");
    dsv4_conf_defaults(&cfg);
    assert_int_equal(dsv4_conf_load(&cfg, path, DSV4_CONF_ROLE_PREFILL), DSV4_OK);
    assert_string_equal(cfg.comm, "nccl");
    f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f, "comm = gloo\n");
    fclose(f);
    assert_int_equal(dsv4_conf_load(&cfg, path, DSV4_CONF_ROLE_DECODE), DSV4_ERR_CONFIG);
    assert_non_null(strstr(dsv4_errmsg(), ":1:"));
    unlink(path);
}

static void
test_check_and_create(void **state)
{
    struct dsv4_comm *g[2] = { NULL, NULL }, *c = (struct dsv4_comm *)&c;
    struct dsv4_backend *be = NULL;
    uint8_t id[DSV4_COMM_ID_BYTES];

    (void)state;
    assert_int_equal(dsv4_comm_check(NULL), DSV4_OK);
    assert_int_equal(dsv4_comm_local_create(g, 2), DSV4_OK);
    assert_null(g[0]->ops->check);
    assert_int_equal(dsv4_comm_check(g[0]), DSV4_OK);
    dsv4_comm_destroy(g[0]);
    dsv4_comm_destroy(g[1]);
    /* a CPU backend is refused (any build), leaving *out NULL */
    assert_int_equal(dsv4_cpu_backend_create(&be, DSV4_NUMERICS_REF, 1), DSV4_OK);
    assert_int_equal(dsv4_comm_cudaipc_unique_id(id), DSV4_OK);
    assert_int_not_equal(dsv4_comm_cudaipc_create(&c, be, 0, 2, id, 4096, 100, NULL), DSV4_OK);
    assert_null(c);
    dsv4_backend_destroy(be);
}

/* Whether shm object `id` exists. */
static bool
shm_exists(const uint8_t *id)
{
    int fd = shm_open((const char *)id, O_RDONLY, 0);

    if (fd < 0)
        return false;
    close(fd);
    return true;
}

/* Rank 0 of a shm group of two, which rank 1 never completes. */
struct shm_rank0 {
    const uint8_t *id;
    enum dsv4_err e;
    char msg[256];
};

static void *
shm_rank0_main(void *arg)
{
    struct shm_rank0 *r = arg;
    struct dsv4_comm *c = NULL;

    r->e = dsv4_comm_shm_create(&c, 0, 2, r->id, 4096, 60000, NULL);
    if (r->e != DSV4_OK)
        snprintf(r->msg, sizeof(r->msg), "%s", dsv4_errmsg());
    if (c != NULL)
        dsv4_comm_destroy(c);
    return NULL;
}

/* A rank whose largest calls differ from rank 0's is refused with an error
 * that says so (a group of ranks with different slots or prefill_chunk). */
static void
test_shm_sizes(void **state)
{
    uint8_t id[DSV4_COMM_ID_BYTES];
    struct shm_rank0 r0 = { id, DSV4_OK, "" };
    struct dsv4_comm *c = NULL;
    enum dsv4_err e;
    pthread_t th;

    (void)state;
    assert_int_equal(dsv4_comm_shm_unique_id(id), DSV4_OK);
    assert_int_equal(pthread_create(&th, NULL, shm_rank0_main, &r0), 0);
    e = dsv4_comm_shm_create(&c, 1, 2, id, 8192, 500, NULL);
    assert_int_equal(e, DSV4_ERR_CONFIG);
    assert_null(c);
    assert_non_null(strstr(dsv4_errmsg(), "the ranks' largest calls differ (4096 bytes at "
                                          "rank 0, 8192 here)"));
    assert_int_equal(pthread_join(th, NULL), 0);
    /* rank 1 broke the group: rank 0 stopped waiting (it waited out its
     * whole timeout, 60 s, and said the group did not assemble) */
    assert_int_equal(r0.e, DSV4_ERR_TIMEOUT);
    if (strstr(r0.msg, "the group broke while it assembled") == NULL)
        fail_msg("rank 0: %s", r0.msg);
    assert_false(shm_exists(id));
}

/* Write an empty file dir/name last modified `age` seconds ago. */
static void
aged_file(const char *dir, const char *name, int age)
{
    char path[256];
    struct timespec t[2];
    int fd;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    fd = open(path, O_CREAT | O_WRONLY, 0600);
    assert_true(fd >= 0);
    clock_gettime(CLOCK_REALTIME, &t[0]);
    t[0].tv_sec -= age;
    t[1] = t[0];
    assert_int_equal(futimens(fd, t), 0);
    close(fd);
}

/* The sweep of segments left by groups that never formed (rank 0 killed
 * before any peer opened the name: nobody unlinked it): this user's
 * dsv4comm-* names last written stale_s or more ago go, fresh ones and
 * other names stay. */
static void
test_shm_sweep(void **state)
{
    char dir[] = "/tmp/dsv4-sweep-XXXXXX", path[300];

    (void)state;
    assert_non_null(mkdtemp(dir));
    aged_file(dir, "dsv4comm-old", 700);
    aged_file(dir, "dsv4comm-forming", 5);
    aged_file(dir, "dsv4kv-old", 700);
    dsv4_comm_shm_sweep(dir, 600);
    snprintf(path, sizeof(path), "%s/dsv4comm-old", dir);
    assert_int_equal(access(path, F_OK), -1);
    snprintf(path, sizeof(path), "%s/dsv4comm-forming", dir);
    assert_int_equal(access(path, F_OK), 0);
    unlink(path);
    snprintf(path, sizeof(path), "%s/dsv4kv-old", dir);
    assert_int_equal(access(path, F_OK), 0);
    unlink(path);
    assert_int_equal(rmdir(dir), 0);
}

/* A segment rank 0 made and never sized (killed in between): the other
 * rank gives up with an error (it mapped it and died of SIGBUS) and
 * removes the name. */
static void
test_shm_unsized(void **state)
{
    uint8_t id[DSV4_COMM_ID_BYTES];
    struct dsv4_comm *c = NULL;
    int fd;

    (void)state;
    assert_int_equal(dsv4_comm_shm_unique_id(id), DSV4_OK);
    fd = shm_open((const char *)id, O_CREAT | O_EXCL | O_RDWR, 0600);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(dsv4_comm_shm_create(&c, 1, 2, id, 4096, 200, NULL), DSV4_ERR_TIMEOUT);
    assert_null(c);
    assert_non_null(strstr(dsv4_errmsg(), "never sized by rank 0"));
    assert_false(shm_exists(id));
}

/* Rank 0 killed while it waits for rank 1: once rank 1 has come and gone
 * nothing is left in /dev/shm (only rank 0 unlinked the name). */
static void
test_shm_rank0_killed(void **state)
{
    uint8_t id[DSV4_COMM_ID_BYTES];
    struct dsv4_comm *c = NULL;
    pid_t pid;
    int st;

    (void)state;
    assert_int_equal(dsv4_comm_shm_unique_id(id), DSV4_OK);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        (void)dsv4_comm_shm_create(&c, 0, 2, id, 4096, 60000, NULL);
        _exit(0);
    }
    while (!shm_exists(id))
        usleep(1000);
    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(shm_exists(id));
    /* rank 0's arrival was counted: the creation may succeed, the group
     * fails at its first collective; either way the name goes */
    if (dsv4_comm_shm_create(&c, 1, 2, id, 4096, 300, NULL) == DSV4_OK)
        dsv4_comm_destroy(c);
    assert_false(shm_exists(id));
}

/* A stop that says so from its `n`-th poll on (*arg counts the polls down). */
static int
stop_after(void *arg)
{
    int *n = arg;

    return --*n <= 0;
}

/* A creation waiting for ranks that never come gives up when its stop says
 * so (DSV4_ERR_CANCELED, long before its timeout), as rank 0 (in the
 * barrier) and as another rank (waiting for the segment). */
static void
test_shm_stop(void **state)
{
    uint8_t id[DSV4_COMM_ID_BYTES];
    struct dsv4_comm *c = NULL;
    int polls = 50;
    struct dsv4_comm_stop stop = { stop_after, &polls };

    (void)state;
    assert_int_equal(dsv4_comm_shm_unique_id(id), DSV4_OK);
    assert_int_equal(dsv4_comm_shm_create(&c, 0, 2, id, 64, 600000, &stop), DSV4_ERR_CANCELED);
    assert_null(c);
    assert_non_null(strstr(dsv4_errmsg(), "the join was stopped"));
    assert_true(polls <= 0);
    polls = 50;
    assert_int_equal(dsv4_comm_shm_create(&c, 1, 2, id, 64, 600000, &stop), DSV4_ERR_CANCELED);
    assert_null(c);
    assert_true(polls <= 0);
    /* the id is free again: a group of one under it works */
    assert_int_equal(dsv4_comm_shm_create(&c, 0, 1, id, 64, 1000, &stop), DSV4_OK);
    dsv4_comm_destroy(c);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ids),
        cmocka_unit_test(test_pick),
        cmocka_unit_test(test_config_key),
        cmocka_unit_test(test_check_and_create),
        cmocka_unit_test(test_shm_sizes),
        cmocka_unit_test(test_shm_unsized),
        cmocka_unit_test(test_shm_sweep),
        cmocka_unit_test(test_shm_rank0_killed),
        cmocka_unit_test(test_shm_stop),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
