/*
 * log.c — see log.h.  Formatting is skipped below the verbosity; each line is
 * written with one fprintf so lines from several threads do not interleave.
 */
#include "common/log.h"

#include <sys/stat.h>

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/cli.h"

enum log_level {
    LOG_LEVEL_CRIT = 2,
    LOG_LEVEL_WARN = 4,
    LOG_LEVEL_NOTICE = 5,
    LOG_LEVEL_INFO = 6,
    LOG_LEVEL_DEBUG = 7,
};

static int log_verbosity;
static int log_journal = -1;     /* -1 = not yet probed */
static char log_name[64] = "dsv4";

/* True when standard error is the stream systemd connected to the journal:
 * $JOURNAL_STREAM ("DEVICE:INODE") names it, and a child that inherited
 * the variable but writes elsewhere (a terminal, a file) must not take
 * the journal's form (systemd.exec(5), $JOURNAL_STREAM). */
static int
journal_stream(void)
{
    const char *v = getenv("JOURNAL_STREAM");
    uintmax_t dev, ino;
    struct stat st;
    char end;

    if (v == NULL || sscanf(v, "%ju:%ju%c", &dev, &ino, &end) != 2)
        return 0;
    if (fstat(STDERR_FILENO, &st) != 0)
        return 0;
    return (uintmax_t)st.st_dev == dev && (uintmax_t)st.st_ino == ino;
}

void
log_init(int verbose)
{
    log_verbosity = verbose;
    log_journal = journal_stream();
}

void
log_procinit(const char *name)
{
    snprintf(log_name, sizeof(log_name), "%s", name);
}

int
log_verbose(void)
{
    return log_verbosity;
}

static void
log_vwrite(enum log_level level, const char *fmt, va_list ap, int with_errno)
{
    static const char letters[8] = { 'E', 'A', 'C', 'E', 'W', 'N', 'I', 'D' };
    char msg[2048];
    int saved = errno;

    if (level == LOG_LEVEL_INFO && log_verbosity < 1)
        return;
    if (level == LOG_LEVEL_DEBUG && log_verbosity < 2)
        return;
    if (log_journal < 0)
        log_journal = journal_stream();
    vsnprintf(msg, sizeof(msg), fmt, ap);
    /* One event, one line: control characters from outside (a URL, a
     * peer's message) could otherwise start a forged line. */
    for (char *c = msg; *c != '\0'; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';
    if (log_journal) {
        if (with_errno)
            fprintf(stderr, "<%d>%s: %s: %s\n", level, log_name, msg, strerror(saved));
        else
            fprintf(stderr, "<%d>%s: %s\n", level, log_name, msg);
    } else {
        char ts[32];
        struct timespec now;
        struct tm tm;

        clock_gettime(CLOCK_REALTIME, &now);
        gmtime_r(&now.tv_sec, &tm);
        strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%S", &tm);
        if (with_errno)
            fprintf(stderr, "%s.%03ldZ %c %s: %s: %s\n", ts, now.tv_nsec / 1000000,
                    letters[level], log_name, msg, strerror(saved));
        else
            fprintf(stderr, "%s.%03ldZ %c %s: %s\n", ts, now.tv_nsec / 1000000,
                    letters[level], log_name, msg);
    }
    errno = saved;
}

#define LOG_FN(name, level, with_errno)          \
    void                                         \
    name(const char *fmt, ...)                   \
    {                                            \
        va_list ap;                              \
        va_start(ap, fmt);                       \
        log_vwrite(level, fmt, ap, with_errno);  \
        va_end(ap);                              \
    }

LOG_FN(log_debug, LOG_LEVEL_DEBUG, 0)
LOG_FN(log_info, LOG_LEVEL_INFO, 0)
LOG_FN(log_notice, LOG_LEVEL_NOTICE, 0)
LOG_FN(log_warn, LOG_LEVEL_WARN, 1)
LOG_FN(log_warnx, LOG_LEVEL_WARN, 0)

/* log at CRIT, then exit with `status` */
#define FATAL_FN(name, with_errno, status)                \
    void                                                  \
    name(const char *fmt, ...)                            \
    {                                                     \
        va_list ap;                                       \
        va_start(ap, fmt);                                \
        log_vwrite(LOG_LEVEL_CRIT, fmt, ap, with_errno);  \
        va_end(ap);                                       \
        exit(status);                                     \
    }

FATAL_FN(fatal, 1, EXIT_FAILURE)
FATAL_FN(fatalx, 0, EXIT_FAILURE)
FATAL_FN(fatalx_conf, 0, DSV4_EXIT_CONFIG)
