/*
 * safetensors.h — read (mmap) and write safetensors files, and open a sharded
 * checkpoint through model.safetensors.index.json (model doc §2.1).
 *
 * Reading validates everything before any tensor is handed out: the 8-byte
 * header length against the file size, the JSON header, every dtype string,
 * shape × dtype size == byte length, offsets inside the data area, sorted and
 * non-overlapping ranges.  Failures return DSV4_ERR_WEIGHTS with a message
 * naming the file and the tensor; nothing crashes on a hostile file
 * (tests/fuzz/fuzz_st.c checks this and the views of an accepted one).
 */
#ifndef DSV4_COMMON_SAFETENSORS_H
#define DSV4_COMMON_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DSV4_ST_MAX_DIMS 8

/* Dtypes of the checkpoint (safetensors dtype strings in comments). */
enum dsv4_st_dtype {
    DSV4_ST_NONE = 0,
    DSV4_ST_BF16,     /* "BF16" */
    DSV4_ST_F32,      /* "F32" */
    DSV4_ST_F8_E4M3,  /* "F8_E4M3" */
    DSV4_ST_F8_E8M0,  /* "F8_E8M0" */
    DSV4_ST_I8,       /* "I8" (FP4 E2M1 pairs in this checkpoint) */
    DSV4_ST_I64,      /* "I64" */
    DSV4_ST_I32,      /* "I32" */
    DSV4_ST_F16,      /* "F16" */
    DSV4_ST_U8,       /* "U8" */
    DSV4_ST__COUNT
};

/* Bytes per element of a dtype (0 for NONE). */
size_t dsv4_st_dtype_size(enum dsv4_st_dtype dt);
/* The safetensors dtype string ("BF16", ...). */
const char *dsv4_st_dtype_name(enum dsv4_st_dtype dt);
/* Parse a dtype string; DSV4_ST_NONE if unknown. */
enum dsv4_st_dtype dsv4_st_dtype_parse(const char *s);

/* One tensor as found in a file: a view into the mapping (read-only). */
struct dsv4_st_tensor {
    const char *name;               /* owned by the file / checkpoint */
    enum dsv4_st_dtype dtype;
    int n_dims;
    int64_t shape[DSV4_ST_MAX_DIMS];
    size_t n_bytes;
    const void *data;               /* inside the mmap; valid until close */
    const char *file;               /* path of the shard holding it */
};

/* --- a single file ----------------------------------------------------- */

struct dsv4_st_file;  /* opaque: mapping + parsed header */

/* Open and validate `path`.  On success *out owns the mapping. */
enum dsv4_err dsv4_st_open(struct dsv4_st_file **out, const char *path);
/* Unmap and free (NULL is a no-op). */
void dsv4_st_close(struct dsv4_st_file *f);
/* Number of tensors and the i-th one (in header order). */
int dsv4_st_count(const struct dsv4_st_file *f);
const struct dsv4_st_tensor *dsv4_st_at(const struct dsv4_st_file *f, int i);
/* Look up by name; NULL if absent. */
const struct dsv4_st_tensor *dsv4_st_find(const struct dsv4_st_file *f, const char *name);

/* --- a sharded checkpoint directory ------------------------------------- */

struct dsv4_ckpt;  /* opaque: all shards of a directory */

/*
 * Open a checkpoint directory: model.safetensors.index.json if present
 * (every shard it names is opened and every name in weight_map must be in the
 * shard it names, and vice versa), else a single model.safetensors.
 */
enum dsv4_err dsv4_ckpt_open(struct dsv4_ckpt **out, const char *dir);
void dsv4_ckpt_close(struct dsv4_ckpt *c);
/* Look up a tensor by name across shards; NULL if absent. */
const struct dsv4_st_tensor *dsv4_ckpt_find(const struct dsv4_ckpt *c, const char *name);
/* Total number of tensors and the i-th (shard order, then header order). */
int dsv4_ckpt_count(const struct dsv4_ckpt *c);
const struct dsv4_st_tensor *dsv4_ckpt_at(const struct dsv4_ckpt *c, int i);

/* --- writing ------------------------------------------------------------ */

struct dsv4_st_writer;  /* opaque: one output file being written */

/*
 * Start a file holding `n` tensors whose names, dtypes and shapes are given
 * up front (the header is written first).  Data is then streamed in the same
 * order with dsv4_st_writer_put; each call appends bytes to the current tensor
 * and moves to the next one when it is complete.
 *
 * Layout: the JSON header is padded with spaces to a multiple of 8 bytes, so
 * the data area starts 8-byte aligned; tensors follow contiguously in the
 * given order (the format allows no gaps).  A tensor is aligned for its
 * element type only if the bytes before it are a multiple of that size; the
 * official writer orders tensors by decreasing element size to get this.
 * Errors: DSV4_ERR_INVAL for a bad tensor list (empty, reserved or duplicate
 * name, unknown dtype, negative shape), DSV4_ERR_SYS for I/O.
 */
enum dsv4_err dsv4_st_writer_open(struct dsv4_st_writer **out, const char *path, int n,
                                  const char *const *names, const enum dsv4_st_dtype *dtypes,
                                  const int *n_dims, const int64_t (*shapes)[DSV4_ST_MAX_DIMS]);
/* Append `n_bytes` of data (may span less than, or exactly, the rest of the
 * current tensor; never more). */
enum dsv4_err dsv4_st_writer_put(struct dsv4_st_writer *w, const void *data, size_t n_bytes);
/* Check every tensor was fully written, close; frees w.  The data goes to
 * `path`.tmp, renamed to `path` here, so a file already at `path` (and any
 * process that has it mapped: a running rank) keeps its bytes until then
 * and is kept as it was when the write fails.  On any failure the partial
 * file is removed (DSV4_ERR_INVAL if data is missing). */
enum dsv4_err dsv4_st_writer_close(struct dsv4_st_writer *w);

#ifdef __cplusplus
}
#endif
#endif
