/*
 * fuzz_conf.c — libFuzzer target for the configuration file reader
 * (common/config_file.h).
 *
 * Input: byte 0 picks the reader (bits 0-1: the role, none / sched /
 * prefill / decode; bits 2-3: the rank index for prefill and decode, 3 =
 * none); the rest is the file, written to a memfd and read through
 * /proc/self/fd/N.  Checked, aborting on the first that fails:
 *   - a refusal is DSV4_ERR_CONFIG whose message starts with "PATH:LINE: ";
 *   - an accepted file's settings, written out by dsv4_conf_print, load
 *     back (into defaults, as a plain file) to settings that print the
 *     same: the header's promise that the output "loads back to the same
 *     settings".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config_file.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void
fail(const char *what, const char *detail)
{
    fuzz_fail("fuzz_conf", what, detail);
}

/* dsv4_conf_print's output as a heap string. */
static char *
printed(const struct dsv4_conf *c, size_t *len)
{
    char *buf = NULL;
    FILE *fp = open_memstream(&buf, len);

    if (fp == NULL)
        fail("open_memstream", NULL);
    dsv4_conf_print(c, fp);
    fclose(fp);
    return buf;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const enum dsv4_conf_role roles[] = {
        DSV4_CONF_ROLE_NONE, DSV4_CONF_ROLE_SCHED, DSV4_CONF_ROLE_PREFILL,
        DSV4_CONF_ROLE_DECODE,
    };
    struct dsv4_conf *c, *back;
    enum dsv4_conf_role role;
    char path[64], path2[64], *out, *out2;
    size_t len, len2;
    int fd, fd2, index;
    enum dsv4_err e;

    if (size == 0)
        return 0;
    role = roles[data[0] & 3];
    index = (data[0] >> 2 & 3) == 3 ? -1 : data[0] >> 2 & 3;
    if ((c = malloc(sizeof(*c))) == NULL || (back = malloc(sizeof(*back))) == NULL)
        fail("out of memory", NULL);
    dsv4_conf_defaults(c);
    fd = fuzz_memfile("fuzz_conf", data + 1, size - 1, path);
    if (role == DSV4_CONF_ROLE_PREFILL || role == DSV4_CONF_ROLE_DECODE)
        e = dsv4_conf_load_rank(c, path, role, index);
    else
        e = dsv4_conf_load(c, path, role);
    if (e != DSV4_OK) {
        const char *m = dsv4_errmsg();
        size_t pl = strlen(path);

        if (e != DSV4_ERR_CONFIG)
            fail("refused with an error other than DSV4_ERR_CONFIG", m);
        if (strncmp(m, path, pl) != 0 || m[pl] != ':' || m[pl + 1] < '1' ||
            m[pl + 1] > '9' || strstr(m + pl + 1, ": ") == NULL)
            fail("the refusal does not start with PATH:LINE: ", m);
    } else {
        out = printed(c, &len);
        fd2 = fuzz_memfile("fuzz_conf", out, len, path2);
        dsv4_conf_defaults(back);
        if (dsv4_conf_load(back, path2, DSV4_CONF_ROLE_NONE) != DSV4_OK) {
            fprintf(stderr, "%s", out);
            fail("the printed settings do not load back", dsv4_errmsg());
        }
        out2 = printed(back, &len2);
        if (len != len2 || memcmp(out, out2, len) != 0) {
            fprintf(stderr, "printed:\n%s\nloaded back and printed:\n%s", out, out2);
            fail("the printed settings load back to other settings", NULL);
        }
        free(out);
        free(out2);
        close(fd2);
    }
    close(fd);
    free(c);
    free(back);
    return 0;
}
