/*
 * weights_fp.h — a fingerprint of the model a rank runs.  Ranks send it in
 * READY (`model`, docs/protocol.md §6.1) and the scheduler refuses a rank
 * whose model differs from its reference (the fingerprint of the checkpoint
 * it is configured with, or else the registered ranks'): a prefill rank of
 * one checkpoint handing its decode state to a decode rank of another
 * would stream text of neither, without any error.
 */
#ifndef DSV4_COMMON_WEIGHTS_FP_H
#define DSV4_COMMON_WEIGHTS_FP_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "common/model_config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Characters of a fingerprint string (16 hex digits), without the NUL. */
#define DSV4_FP_CHARS 16

/*
 * The fingerprint of the checkpoint in `dir` (its config.json and its
 * safetensors shards): FNV-1a (64 bits) over the configuration's every
 * field (dsv4_config_text: a rope_theta or sliding_window of its own makes
 * another model of the same tensors), then every tensor's name, dtype and
 * shape, in name order, and the first 64 bytes of the data of every tensor
 * but the routed experts' (expert 0's included).  Checkpoints of one
 * architecture with other weights (another training step, a fine-tune,
 * another mkmodel seed) differ with near certainty.  It reads the shards'
 * headers and a few thousand 64-byte pieces, not the weights: cheap enough
 * for the scheduler, which does not load the model.  Written as 16
 * lowercase hex digits into out (at least DSV4_FP_CHARS + 1 bytes).
 * Errors: those of dsv4_config_load and dsv4_ckpt_open; DSV4_ERR_NOMEM.
 */
enum dsv4_err dsv4_ckpt_fingerprint(const char *dir, char *out);

struct dsv4_ckpt;

/*
 * The same fingerprint of a checkpoint already open (dsv4_ckpt_open, or the
 * `ckpt` of weights from dsv4_weights_load) with its configuration `cfg`
 * (the weights' `cfg`).  A rank takes it from what it loaded, so that it
 * describes the model it runs even when the directory was replaced after
 * the load, and nothing is read a second time.  Errors: DSV4_ERR_INVAL for
 * a NULL checkpoint or configuration; DSV4_ERR_NOMEM.
 */
enum dsv4_err dsv4_ckpt_fingerprint_of(const struct dsv4_ckpt *c, const struct dsv4_config *cfg,
                                       char *out);

/*
 * The fingerprint of synthetic weights (rank --synthetic-weights SEED):
 * the configuration's every field and the seed, marked so that it never
 * equals a checkpoint's.  Same format as dsv4_ckpt_fingerprint.  Errors:
 * DSV4_ERR_NOMEM.
 */
enum dsv4_err dsv4_synthetic_fingerprint(const struct dsv4_config *cfg, uint64_t seed, char *out);

#ifdef __cplusplus
}
#endif

#endif /* DSV4_COMMON_WEIGHTS_FP_H */
