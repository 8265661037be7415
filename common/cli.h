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
