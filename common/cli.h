/*
 * cli.h — what every dsv4 program's command line shares: `-h` / `--help`
 * and `--version` answer on standard output and exit 0; a usage error
 * (unknown option, missing or bad argument) prints the synopsis on standard
 * error and exits 2.  The GNU coding standards' conventions, so that
 * `dsv4-sched --help | less` and scripts testing `$?` work on every program.
 *
 * Header only: dsv4-generate and dsv4-bench link libdsv4client alone.
 */
#ifndef DSV4_COMMON_CLI_H
#define DSV4_COMMON_CLI_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The release every program reports: meson's project version (meson.build
 * passes it as -DDSV4_VERSION). */
#ifndef DSV4_VERSION
#define DSV4_VERSION "unknown"
#endif

/* Exit statuses (docs/operations.md "Exit statuses").  Every program: 0
 * done; 1 a failure that a new start may get past (a device error, a
 * socket in use, a request that failed); DSV4_EXIT_USAGE a usage error.  The
 * daemons and dsv4-launch also: DSV4_EXIT_CONFIG when the configuration or
 * what it names is wrong (the file, a -o line, an endpoint's form, a key
 * file, the tokenizer, the checkpoint, socket units).  The units'
 * RestartPreventExitStatus= and dsv4-launch restart a daemon after neither
 * of the last two: the same start would fail the same way. */
#define DSV4_EXIT_USAGE 2
/* systemd's EXIT_NOTCONFIGURED, the LSB's "program is not configured" */
#define DSV4_EXIT_CONFIG 6

/* The daemons' and dsv4-launch's --help line on the statuses above. */
#define DSV4_CLI_DAEMON_EXIT \
    "Exit status: 0 stopped, 1 a failure, 2 usage, 6 the configuration (neither 2\n" \
    "nor 6 is restarted by the units or dsv4-launch).\n"

/* getopt_long's value for --version, above every single-character option. */
#define DSV4_CLI_OPT_VERSION 0x7f00

/* Print "PROG VERSION" on standard output and exit 0. */
static inline void __attribute__((noreturn))
dsv4_cli_version(const char *prog)
{
    printf("%s %s\n", prog, DSV4_VERSION);
    exit(0);
}

/* Exit with `status` after the usage.  0 (the answer to --help): `synopsis`
 * and `details` on standard output.  Anything else (a usage error): the
 * synopsis and a pointer to --help on standard error.  `synopsis` starts
 * "usage: PROG " and ends in a newline; so does `details` (the options, one
 * a line). */
static inline void __attribute__((noreturn))
dsv4_cli_usage(const char *synopsis, const char *details, int status)
{
    const char *prog = synopsis + 7;   /* after "usage: " */

    if (status == 0) {
        fputs(synopsis, stdout);
        fputs(details, stdout);
    } else {
        fputs(synopsis, stderr);
        fprintf(stderr, "Try '%.*s --help' for more information.\n",
            (int)strcspn(prog, " \n"), prog);
    }
    exit(status);
}

#endif
