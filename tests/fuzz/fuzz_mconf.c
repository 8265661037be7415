/*
 * fuzz_mconf.c — libFuzzer target for a checkpoint's config.json
 * (common/model_config.h) and the tensor inventory it implies
 * (common/model_tensors.h): a checkpoint directory is input a rank reads
 * before anything else of it.
 *
 * Input: the bytes of config.json, parsed by dsv4_config_parse.  Checked,
 * aborting on the first that fails:
 *   - a refusal is DSV4_ERR_CONFIG (or NOMEM) with a message;
 *   - an accepted config validates, and written out by dsv4_config_write
 *     loads back (dsv4_config_load) to a config that writes the same bytes;
 *   - its inventory (when its layers × routed experts stay under a bound
 *     that keeps one input fast) builds, or is refused with a message;
 *     every tensor has 1 or 2 dimensions, all positive, and the whole a
 *     positive byte count.
 * UBSan (run.sh's flags) stops on a signed overflow on the way, e.g. in
 * the byte counts of huge dimensions.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/err.h"
#include "common/model_config.h"
#include "common/model_tensors.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* layers × routed experts above which the inventory is not built */
#define INVENTORY_MAX 20000

static void
fail(const char *what, const char *detail)
{
    fuzz_fail("fuzz_mconf", what, detail);
}

/* The bytes dsv4_config_write gives for c, in a heap buffer. */
static char *
written(const struct dsv4_config *c, size_t *len)
{
    char path[64], *buf;
    int fd = fuzz_memfile("fuzz_mconf", NULL, 0, path);
    long n;
    FILE *f;

    if (dsv4_config_write(c, path) != DSV4_OK)
        fail("dsv4_config_write", dsv4_errmsg());
    if ((f = fopen(path, "rb")) == NULL || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0)
        fail("reading the written config", path);
    rewind(f);
    if ((buf = malloc((size_t)n + 1)) == NULL || fread(buf, 1, (size_t)n, f) != (size_t)n)
        fail("reading the written config", path);
    fclose(f);
    close(fd);
    *len = (size_t)n;
    return buf;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct dsv4_config *c = calloc(1, sizeof(*c)), *back = calloc(1, sizeof(*back));
    struct dsv4_inventory inv = { 0 };
    char path[64], *out, *out2;
    size_t len, len2;
    enum dsv4_err e;
    int fd;

    if (c == NULL || back == NULL)
        fail("calloc", NULL);
    e = dsv4_config_parse(c, (const char *)data, size, "config.json");
    if (e != DSV4_OK) {
        if (e != DSV4_ERR_CONFIG && e != DSV4_ERR_NOMEM)
            fail("refused with an unexpected error", dsv4_errmsg());
        if (dsv4_errmsg()[0] == '\0')
            fail("a refusal without a message", NULL);
        free(c);
        free(back);
        return 0;
    }
    if (dsv4_config_validate(c) != DSV4_OK)
        fail("accepted, then refused by dsv4_config_validate", dsv4_errmsg());
    out = written(c, &len);
    fd = fuzz_memfile("fuzz_mconf", out, len, path);
    if (dsv4_config_load(back, path) != DSV4_OK)
        fail("a written config does not load back", dsv4_errmsg());
    close(fd);
    out2 = written(back, &len2);
    if (len != len2 || memcmp(out, out2, len) != 0)
        fail("a written config loads back to another", NULL);
    free(out);
    free(out2);
    if ((int64_t)c->num_hidden_layers * c->n_routed_experts <= INVENTORY_MAX) {
        e = dsv4_inventory_build(&inv, c);
        if (e != DSV4_OK && dsv4_errmsg()[0] == '\0')
            fail("an inventory refused without a message", NULL);
        for (int i = 0; e == DSV4_OK && i < inv.n; i++) {
            const struct dsv4_tensor_spec *t = &inv.t[i];

            if (t->n_dims < 1 || t->n_dims > 2)
                fail("a tensor of no or too many dimensions", t->name);
            for (int d = 0; d < t->n_dims; d++)
                if (t->shape[d] <= 0)
                    fail("a dimension not positive", t->name);
        }
        if (e == DSV4_OK && (inv.n < 1 || inv.total_bytes == 0))
            fail("an empty inventory", NULL);
        dsv4_inventory_free(&inv);
    }
    free(c);
    free(back);
    return 0;
}
