/*
 * test_config_file.c — common/config_file: the shipped example
 * units/dsv4.conf loads to exactly the built-in defaults and names every
 * key; print/load round trip; role and instance prefixes; comments and
 * quotes; errors name file and line.  argv[1] = path of units/dsv4.conf.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config_file.h"

static const char *example_path;

/* Write `text` to a fresh temporary file; returns its path (static). */
static const char *
write_tmp(const char *text)
{
    static char path[64];
    FILE *fp;

    snprintf(path, sizeof(path), "/tmp/dsv4-cfg-%ld.conf", (long)getpid());
    fp = fopen(path, "w");
    assert_non_null(fp);
    fputs(text, fp);
    fclose(fp);
    return path;
}

/* Compare two configurations field by field, through their printed form
 * (bytes after a string's NUL do not matter). */
static void
assert_conf_equal(const struct dsv4_conf *a, const struct dsv4_conf *b)
{
    char *pa = NULL, *pb = NULL;
    size_t la = 0, lb = 0;
    FILE *ma, *mb;

    ma = open_memstream(&pa, &la);
    mb = open_memstream(&pb, &lb);
    dsv4_conf_print(a, ma);
    dsv4_conf_print(b, mb);
    fclose(ma);
    fclose(mb);
    assert_string_equal(pa, pb);
    free(pa);
    free(pb);
}

static void
test_example_is_defaults(void **state)
{
    struct dsv4_conf def, got;
    char *printed = NULL, line[1024];
    size_t len = 0;
    FILE *mem, *ex;
    int n_keys = 0, n_found = 0;

    (void)state;
    dsv4_conf_defaults(&def);
    /* Start from garbage so every key must come from the file. */
    memset(&got, 0x5a, sizeof(got));
    got.client_endpoint[0] = '\0';
    assert_int_equal(dsv4_conf_load(&got, example_path, DSV4_CONF_ROLE_NONE),
        DSV4_OK);
    /* Every key the code knows appears uncommented in the example. */
    mem = open_memstream(&printed, &len);
    dsv4_conf_print(&def, mem);
    fclose(mem);
    for (char *p = printed; *p != '\0'; p = strchr(p, '\n') + 1) {
        char key[64];

        assert_int_equal(sscanf(p, "%63s", key), 1);
        n_keys++;
        ex = fopen(example_path, "r");
        assert_non_null(ex);
        while (fgets(line, sizeof(line), ex) != NULL)
            if (strncmp(line, key, strlen(key)) == 0 &&
                line[strlen(key)] == ' ') {
                n_found++;
                break;
            }
        fclose(ex);
    }
    free(printed);
    assert_int_equal(n_found, n_keys);
    assert_true(n_keys >= 19);
    assert_conf_equal(&got, &def);
}

static void
test_round_trip(void **state)
{
    struct dsv4_conf a, b;
    char *printed = NULL;
    size_t len = 0;
    FILE *mem;

    (void)state;
    dsv4_conf_defaults(&a);
    assert_int_equal(dsv4_conf_set(&a, "client_endpoint", "tcp://h:5555"), DSV4_OK);
    assert_int_equal(dsv4_conf_set(&a, "checkpoint", "/x/a #b"), DSV4_OK);
    assert_int_equal(dsv4_conf_set(&a, "key_dir", ""), DSV4_OK);
    assert_int_equal(dsv4_conf_set_kv(&a, "max_batch=7"), DSV4_OK);
    assert_int_equal(dsv4_conf_set_kv(&a, "admin_mode=0600"), DSV4_OK);
    assert_int_equal(dsv4_conf_set_kv(&a, "backend=cuda"), DSV4_OK);
    assert_int_equal(dsv4_conf_set_kv(&a, "cuda_kernels=exact"), DSV4_OK);
    assert_int_equal(dsv4_conf_set_kv(&a, "cuda_kernels=quick"), DSV4_ERR_CONFIG);
    assert_int_equal(dsv4_conf_set_kv(&a, "cuda_priority=none"), DSV4_OK);
    assert_int_equal(dsv4_conf_set_kv(&a, "cuda_priority=prefill"), DSV4_ERR_CONFIG);
    assert_int_equal(dsv4_conf_set_kv(&a, "group_split=tp"), DSV4_OK);
    assert_int_equal(dsv4_conf_set_kv(&a, "group_split=dp"), DSV4_ERR_CONFIG);
    mem = open_memstream(&printed, &len);
    dsv4_conf_print(&a, mem);
    fclose(mem);
    dsv4_conf_defaults(&b);
    assert_int_equal(dsv4_conf_load(&b, write_tmp(printed),
        DSV4_CONF_ROLE_SCHED), DSV4_OK);
    free(printed);
    assert_conf_equal(&a, &b);
    assert_int_equal(b.max_batch, 7);
    assert_int_equal(b.admin_mode, 0600);
    assert_string_equal(b.checkpoint, "/x/a #b");
    assert_string_equal(b.key_dir, "");
    assert_string_equal(b.cuda_kernels, "exact");
    assert_string_equal(b.cuda_priority, "none");
    assert_string_equal(b.group_split, "tp");
}

static void
test_roles_comments(void **state)
{
    const char *text =
        "# comment\n"
        "decode.threads = 8   # trailing comment\n"
        "   \n"
        "threads = 2\n"
        "prefill.threads = 4\n"
        "tokenizer = \"/a b/tok.json\"\n"
        "rank_endpoint=ipc:///tmp/r#1.sock\n";
    const char *path = write_tmp(text);
    struct dsv4_conf c;

    (void)state;
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load(&c, path, DSV4_CONF_ROLE_DECODE), DSV4_OK);
    assert_int_equal(c.threads, 8);
    assert_string_equal(c.tokenizer, "/a b/tok.json");
    /* '#' not after a blank is part of the value. */
    assert_string_equal(c.rank_endpoint, "ipc:///tmp/r#1.sock");
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load(&c, path, DSV4_CONF_ROLE_PREFILL), DSV4_OK);
    assert_int_equal(c.threads, 4);
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load(&c, path, DSV4_CONF_ROLE_SCHED), DSV4_OK);
    assert_int_equal(c.threads, 2);
    unlink(path);
}

/* `prefill@N.` / `decode@N.` lines reach rank N of that role only, and win
 * over the role's and the plain lines whatever the order. */
static void
test_instances(void **state)
{
    const char *text =
        "prefill@1.mps_sm_percent = 100\n"
        "prefill@1.burst = yes\n"
        "prefill.mps_sm_percent = 40\n"
        "mps_sm_percent = 10\n"
        "decode@1.threads = 3\n"
        "prefill@12.threads = 5\n";
    const char *path = write_tmp(text);
    struct dsv4_conf c;

    (void)state;
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load_rank(&c, path, DSV4_CONF_ROLE_PREFILL, 1), DSV4_OK);
    assert_int_equal(c.mps_sm_percent, 100);
    assert_string_equal(c.burst, "yes");
    assert_int_equal(c.threads, 0);
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load_rank(&c, path, DSV4_CONF_ROLE_PREFILL, 0), DSV4_OK);
    assert_int_equal(c.mps_sm_percent, 40);
    assert_string_equal(c.burst, "no");
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load_rank(&c, path, DSV4_CONF_ROLE_PREFILL, 12), DSV4_OK);
    assert_int_equal(c.threads, 5);
    assert_int_equal(c.mps_sm_percent, 40);
    /* decode@1 is not prefill@1 */
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load_rank(&c, path, DSV4_CONF_ROLE_DECODE, 1), DSV4_OK);
    assert_int_equal(c.threads, 3);
    assert_int_equal(c.mps_sm_percent, 10);
    assert_string_equal(c.burst, "no");
    /* dsv4_conf_load applies no instance line */
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load(&c, path, DSV4_CONF_ROLE_PREFILL), DSV4_OK);
    assert_int_equal(c.mps_sm_percent, 40);
    assert_string_equal(c.burst, "no");
    unlink(path);
}

static void
expect_error(const char *text, const char *needle)
{
    struct dsv4_conf c;
    const char *path = write_tmp(text);

    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load(&c, path, DSV4_CONF_ROLE_DECODE),
        DSV4_ERR_CONFIG);
    if (strstr(dsv4_errmsg(), needle) == NULL)
        fail_msg("error \"%s\" lacks \"%s\"", dsv4_errmsg(), needle);
    unlink(path);
}

static void
test_errors(void **state)
{
    struct dsv4_conf c;

    (void)state;
    expect_error("threads = 1\nbogus = 3\n", ":2: unknown key \"bogus\"");
    expect_error("\n\nthreads\n", ":3: expected key = value");
    expect_error("threads = 1\nthreads = 2\n", ":2: threads given twice");
    expect_error("decode.slots = 1\ndecode.slots = 2\n", "decode.slots given twice");
    expect_error("max_batch = 0\n", "max_batch: 0 outside 1");
    expect_error("max_batch = 12x\n", "not an integer");
    expect_error("max_batch =\n", "not an integer");
    expect_error("admin_mode = 0999\n", "not an octal mode");
    expect_error("admin_mode = 01777\n", "outside");
    /* a mode's range in octal, as it is written (it said 1000 outside 0 ... 511) */
    expect_error("admin_mode = 01750\n", "admin_mode: 01750 outside 0 ... 0777");
    /* a sign is no octal mode (-1 was "01777777777777777777777 outside") */
    expect_error("admin_mode = -1\n", "admin_mode: \"-1\" is not an octal mode");
    expect_error("admin_mode = +0660\n", "is not an octal mode");
    expect_error("backend = tpu\n", "unknown value \"tpu\"");
    expect_error("tokenizer = \"abc\n", "unterminated quote");
    /* No escapes, so no quote inside a value: this one (found by
     * tests/fuzz/fuzz_conf.c) loaded as `a"b # c"` and printed as a line
     * that did not load back. */
    expect_error("key_dir = a\"b # c\"\n", "key_dir: a value cannot contain '\"'");
    expect_error("host = \"a\"b\"\n", "host: a value cannot contain '\"'");
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_set(&c, "share_dir", "/x\"y"), DSV4_ERR_CONFIG);
    /* Prefixed lines of other roles are still validated. */
    expect_error("prefill.slots = -1\n", "prefill.slots: -1 outside");
    expect_error("sched.nosuch = 1\n", "unknown key");
    /* Instance lines: validated for every instance, duplicates per instance. */
    expect_error("prefill@3.slots = 0\n", "prefill@3.slots: 0 outside");
    /* the key as the line has it (it said "burst: ...") */
    expect_error("decode@1.burst = maybe\n", ":1: decode@1.burst: unknown value \"maybe\"");
    expect_error("prefill@1.burst = 1\nprefill@1.burst = 2\n", "unknown value");
    expect_error("prefill@1.burst = yes\nprefill@1.burst = no\n",
        "prefill@1.burst given twice");
    expect_error("prefill@x.burst = yes\n", "expected prefill@N.key");
    expect_error("decode@70000.threads = 1\n", "expected decode@N.key");
    expect_error("sched@1.threads = 1\n", "unknown key");
    expect_error("prefill@2.nosuch = 1\n", "unknown key \"prefill@2.nosuch\"");
    /* A number of thousands of leading zeros on a prefixed line: checked
     * against the buffer it is kept in until applied (it overran it). */
    {
        char text[6100];
        int n = snprintf(text, sizeof(text), "decode.threads = ");

        memset(text + n, '0', 6000);
        snprintf(text + n + 6000, sizeof(text) - (size_t)n - 6000, "8\n");
        expect_error(text, "threads: value longer than 511 bytes");
        n = snprintf(text, sizeof(text), "prefill@0.admin_mode = ");
        memset(text + n, '0', 600);
        snprintf(text + n + 600, sizeof(text) - (size_t)n - 600, "600\n");
        expect_error(text, "admin_mode: value longer than 511 bytes");
    }
    expect_error("max_batch = 99999999999999999999999\n", "max_batch: 99999999999999999999999 out of range");
    /* 0 refused every request with 300 (0 means "none" for other keys) */
    expect_error("queue_max = 0\n", "queue_max");
    dsv4_conf_defaults(&c);
    assert_int_equal(dsv4_conf_load(&c, "/nonexistent/dsv4.conf",
        DSV4_CONF_ROLE_NONE), DSV4_ERR_SYS);
    /* a directory: it said "read error" */
    assert_int_equal(dsv4_conf_load(&c, "/tmp", DSV4_CONF_ROLE_NONE), DSV4_ERR_CONFIG);
    if (strstr(dsv4_errmsg(), "/tmp: is a directory") == NULL)
        fail_msg("a directory: \"%s\"", dsv4_errmsg());
    assert_int_equal(dsv4_conf_set_kv(&c, "noequals"), DSV4_ERR_CONFIG);
    /* -o with a key of 64 bytes or more: it said "expected key=value" */
    {
        char kv[100];

        memset(kv, 'k', 80);
        snprintf(kv + 80, sizeof(kv) - 80, "=1");
        assert_int_equal(dsv4_conf_set_kv(&c, kv), DSV4_ERR_CONFIG);
        if (strstr(dsv4_errmsg(), "80 bytes, longer than any key") == NULL ||
            strstr(dsv4_errmsg(), "expected key=value") != NULL)
            fail_msg("a key of 80 bytes: \"%s\"", dsv4_errmsg());
    }
    assert_int_equal(dsv4_conf_set(&c, "nosuch", "1"), DSV4_ERR_CONFIG);
}

int
main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_example_is_defaults),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_roles_comments),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_instances),
    };

    if (argc != 2) {
        fprintf(stderr, "usage: %s units/dsv4.conf\n", argv[0]);
        return 2;
    }
    example_path = argv[1];
    return cmocka_run_group_tests(tests, NULL, NULL);
}
