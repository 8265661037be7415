/*
 * log.h — process logging with OpenBSD names (log_warn appends strerror(errno),
 * the x-suffixed forms do not).  One line per event on stderr: control
 * characters in a message (newlines included) are written as '?'.  Under
 * systemd (stderr is the stream $JOURNAL_STREAM names) each line starts with
 * the sd-daemon "<N>" priority and has no timestamp (journald stamps it);
 * otherwise an ISO-8601 UTC time and a level letter are printed for people.
 *
 * Line shape: "procname: message" — callers put the function name and stable
 * key=value pairs into the message ("kv_alloc: pool exhausted req=12").
 */
#ifndef DSV4_COMMON_LOG_H
#define DSV4_COMMON_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

/* Set verbosity: 0 = notice and above, 1 = info, 2 = debug. */
void log_init(int verbose);
/* Tag every following line with `name` (e.g. "decode/3"); copied. */
void log_procinit(const char *name);
/* Current verbosity as given to log_init. */
int log_verbose(void);

/* One printf-formatted line at the level of the name, tagged as
 * log_procinit said: log_debug shown at verbosity 2, log_info at 1 or
 * more, log_notice always. */
void log_debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_notice(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Warning with ": strerror(errno)" appended; errno is preserved. */
void log_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Warning without errno. */
void log_warnx(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Critical: log (with errno) and exit(EXIT_FAILURE). */
void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* Critical: log (without errno) and exit(EXIT_FAILURE). */
void fatalx(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* Critical, a configuration fault: log (without errno) and exit with
 * DSV4_EXIT_CONFIG (common/cli.h), which no unit or dsv4-launch restarts. */
void fatalx_conf(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#ifdef __cplusplus
}
#endif
#endif
