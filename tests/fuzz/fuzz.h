/*
 * fuzz.h — helpers shared by the libFuzzer targets of tests/fuzz/ (each is
 * built alone by run.sh, so these are static).
 */
#ifndef DSV4_TESTS_FUZZ_H
#define DSV4_TESTS_FUZZ_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

/* Report a broken property ("TARGET: what: detail") and abort, which
 * libFuzzer records as a crash with its input. */
static inline void
fuzz_fail(const char *target, const char *what, const char *detail)
{
    fprintf(stderr, "%s: %s%s%s\n", target, what, detail != NULL ? ": " : "",
        detail != NULL ? detail : "");
    abort();
}

/* A memfd holding the n bytes at p, for readers that take a path: its path
 * (/proc/self/fd/N) in path[64].  Returns the fd; close it when done. */
static inline int
fuzz_memfile(const char *target, const void *p, size_t n, char *path)
{
    int fd = memfd_create(target, MFD_CLOEXEC);

    if (fd < 0)
        fuzz_fail(target, "memfd_create", NULL);
    if (n > 0 && write(fd, p, n) != (ssize_t)n)
        fuzz_fail(target, "write", NULL);
    snprintf(path, 64, "/proc/self/fd/%d", fd);
    return fd;
}

#ifdef DSV4_COMMON_TOKENIZER_H
/* Load the tokenizer the targets run on, flavour `fl`: $FUZZ_TOKENIZER,
 * else dsv4_tok_default_path().  With `must`, a failed load prints
 * "TARGET: PATH: why" and exits 1 (not a crash: the set-up is wrong);
 * otherwise it gives NULL.  Only for targets that include
 * common/tokenizer.h first and link the tokenizer. */
static inline struct dsv4_tok *
fuzz_tokenizer(const char *target, enum dsv4_tok_flavor fl, bool must)
{
    const char *path = getenv("FUZZ_TOKENIZER");
    struct dsv4_tok *t = NULL;

    if (path == NULL || path[0] == '\0')
        path = dsv4_tok_default_path();
    if (dsv4_tok_load(&t, path, fl) != DSV4_OK) {
        if (!must)
            return NULL;
        fprintf(stderr, "%s: %s: %s\n", target, path, dsv4_errmsg());
        exit(1);
    }
    return t;
}
#endif

#endif
