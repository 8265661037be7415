/*
 * fuzz_ckpt.c — libFuzzer target for a sharded checkpoint's index
 * (dsv4_ckpt_open on model.safetensors.index.json, common/safetensors.h:
 * "nothing crashes on a hostile index").
 *
 * Fixed: a scratch directory holding three valid shards,
 * model-0000{1,2,3}-of-00003.safetensors, with two tensors each (made
 * once, removed at exit).  Input: the bytes of the index, written as the
 * directory's model.safetensors.index.json.  Checked, aborting on the
 * first that fails:
 *   - a refusal is DSV4_ERR_WEIGHTS or DSV4_ERR_NOMEM, with a message, and
 *     leaves no checkpoint;
 *   - an accepted index gives a checkpoint whose tensors are those of the
 *     shards it names, all of them (the index must list every tensor of
 *     every shard it names, each under its own shard): the count is two
 *     per shard named (none for an empty weight_map), every name is one of
 *     the shards' and dsv4_ckpt_find gives each back.
 * (A bad value after a good one in weight_map once crashed the close of a
 * half-opened checkpoint: seed `late-bad`.)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/err.h"
#include "common/safetensors.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define N_SHARDS 3
#define PER_SHARD 2

static char dir[64];

static void
fail(const char *what, const char *detail)
{
    fuzz_fail("fuzz_ckpt", what, detail);
}

static void
shard_path(char *out, size_t len, int s)
{
    snprintf(out, len, "%s/model-%05d-of-%05d.safetensors", dir, s + 1, N_SHARDS);
}

static void
remove_dir(void)
{
    char p[128];

    for (int s = 0; s < N_SHARDS; s++) {
        shard_path(p, sizeof(p), s);
        unlink(p);
    }
    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", dir);
    unlink(p);
    rmdir(dir);
}

/* Shard s holds "s<s>.a" (F32 [2]) and "s<s>.b" (BF16 [3]). */
static void
make_dir(void)
{
    static const enum dsv4_st_dtype dt[PER_SHARD] = { DSV4_ST_F32, DSV4_ST_BF16 };
    static const int nd[PER_SHARD] = { 1, 1 };
    static const int64_t shapes[PER_SHARD][DSV4_ST_MAX_DIMS] = { { 2 }, { 3 } };
    static const uint8_t zeros[8] = { 0 };
    char names[PER_SHARD][8], p[128];
    const char *np[PER_SHARD];
    struct dsv4_st_writer *w;

    snprintf(dir, sizeof(dir), "/tmp/dsv4-fuzz-ckpt-XXXXXX");
    if (mkdtemp(dir) == NULL)
        fail("mkdtemp", NULL);
    atexit(remove_dir);
    for (int s = 0; s < N_SHARDS; s++) {
        for (int i = 0; i < PER_SHARD; i++) {
            snprintf(names[i], sizeof(names[i]), "s%d.%c", s + 1, 'a' + i);
            np[i] = names[i];
        }
        shard_path(p, sizeof(p), s);
        if (dsv4_st_writer_open(&w, p, PER_SHARD, np, dt, nd, shapes) != DSV4_OK ||
            dsv4_st_writer_put(w, zeros, 8) != DSV4_OK ||
            dsv4_st_writer_put(w, zeros, 6) != DSV4_OK || dsv4_st_writer_close(w) != DSV4_OK)
            fail("writing a shard", dsv4_errmsg());
    }
}

/* Shard number (1..N_SHARDS) of a tensor name "s<n>.a" / "s<n>.b", else 0. */
static int
shard_of(const char *name)
{
    if (name[0] == 's' && name[1] >= '1' && name[1] < '1' + N_SHARDS && name[2] == '.' &&
        (name[3] == 'a' || name[3] == 'b') && name[4] == '\0')
        return name[1] - '0';
    return 0;
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct dsv4_ckpt *c = (struct dsv4_ckpt *)&c;   /* not NULL: a refusal must clear it */
    char p[128];
    enum dsv4_err e;
    int seen[N_SHARDS + 1] = { 0 }, n, named = 0;
    FILE *f;

    if (dir[0] == '\0')
        make_dir();
    snprintf(p, sizeof(p), "%s/model.safetensors.index.json", dir);
    if ((f = fopen(p, "wb")) == NULL || (size > 0 && fwrite(data, 1, size, f) != size) ||
        fclose(f) != 0)
        fail("writing the index", p);
    e = dsv4_ckpt_open(&c, dir);
    if (e != DSV4_OK) {
        if (e != DSV4_ERR_WEIGHTS && e != DSV4_ERR_NOMEM)
            fail("refused with an unexpected error", dsv4_errmsg());
        if (c != NULL)
            fail("a refusal left a checkpoint", NULL);
        if (dsv4_errmsg()[0] == '\0')
            fail("a refusal without a message", NULL);
        return 0;
    }
    if (c == NULL)
        fail("accepted without a checkpoint", NULL);
    n = dsv4_ckpt_count(c);
    for (int i = 0; i < n; i++) {
        const struct dsv4_st_tensor *t = dsv4_ckpt_at(c, i);
        int s = shard_of(t->name);

        if (s == 0)
            fail("a tensor no shard holds", t->name);
        if (dsv4_ckpt_find(c, t->name) != t)
            fail("dsv4_ckpt_find does not give the tensor back", t->name);
        seen[s]++;
    }
    for (int s = 1; s <= N_SHARDS; s++) {
        if (seen[s] != 0 && seen[s] != PER_SHARD)
            fail("a shard named with only some of its tensors", NULL);
        named += seen[s] != 0;
    }
    if (n != named * PER_SHARD)
        fail("tensor count", NULL);
    dsv4_ckpt_close(c);
    return 0;
}
