/*
 * test_log.c — common/log.c: the journal form only when standard error is
 * the stream $JOURNAL_STREAM names, and one line per event whatever the
 * message holds.
 */
#include <sys/stat.h>

#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/log.h"

/* Standard error goes to a temporary file for the test's length. */
static char path[] = "/tmp/dsv4-test-log-XXXXXX";
static int saved_err = -1;

static int
setup(void **state)
{
    int fd = mkstemp(path);

    (void)state;
    if (fd < 0)
        return -1;
    saved_err = dup(STDERR_FILENO);
    if (saved_err < 0 || dup2(fd, STDERR_FILENO) < 0)
        return -1;
    close(fd);
    return 0;
}

static int
teardown(void **state)
{
    (void)state;
    fflush(stderr);
    dup2(saved_err, STDERR_FILENO);
    close(saved_err);
    unlink(path);
    return 0;
}

/* What was written to standard error since the last call (file emptied). */
static char *
take(void)
{
    static char buf[4096];
    FILE *f;
    size_t n;

    fflush(stderr);
    f = fopen(path, "r");
    assert_non_null(f);
    n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = '\0';
    fclose(f);
    assert_int_equal(ftruncate(STDERR_FILENO, 0), 0);
    assert_int_equal(lseek(STDERR_FILENO, 0, SEEK_SET), 0);
    return buf;
}

static int
lines(const char *s)
{
    int n = 0;

    for (; *s != '\0'; s++)
        n += *s == '\n';
    return n;
}

static void
test_journal_stream(void **state)
{
    struct stat st;
    char v[64];
    const char *out;

    (void)state;
    log_procinit("t");
    /* inherited, but stderr is another file: the people's form */
    setenv("JOURNAL_STREAM", "1:1", 1);
    log_init(0);
    log_notice("hello");
    out = take();
    assert_null(strstr(out, "<5>"));
    assert_non_null(strstr(out, "Z N t: hello\n"));
    /* malformed: the people's form */
    setenv("JOURNAL_STREAM", "x", 1);
    log_init(0);
    log_notice("hello");
    assert_null(strstr(take(), "<5>"));
    /* stderr is the named stream: the journal's form */
    assert_int_equal(fstat(STDERR_FILENO, &st), 0);
    snprintf(v, sizeof(v), "%ju:%ju", (uintmax_t)st.st_dev, (uintmax_t)st.st_ino);
    setenv("JOURNAL_STREAM", v, 1);
    log_init(0);
    log_notice("hello");
    assert_string_equal(take(), "<5>t: hello\n");
    unsetenv("JOURNAL_STREAM");
    log_init(0);
    log_warnx("w");
    assert_non_null(strstr(take(), "Z W t: w\n"));
}

static void
test_one_line(void **state)
{
    const char *out;

    (void)state;
    unsetenv("JOURNAL_STREAM");
    log_init(0);
    log_procinit("t");
    log_notice("GET /x%s", "\n2026-12-06T00:00:00.000Z C sched: forged\r\x1b[2J");
    out = take();
    assert_int_equal(lines(out), 1);
    assert_non_null(strstr(out, "GET /x?2026-12-06T00:00:00.000Z C sched: forged??[2J\n"));
    /* below the verbosity nothing is written */
    log_debug("quiet");
    assert_string_equal(take(), "");
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_journal_stream),
        cmocka_unit_test(test_one_line),
    };

    return cmocka_run_group_tests(tests, setup, teardown);
}
