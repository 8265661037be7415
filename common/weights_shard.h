/*
 * weights_shard.h — the part of the weights one rank of a model group holds
 * (tensor-parallel attention, expert-parallel experts; kernels/forward.h
 * and kernels/comm.h).  Rank r of S holds:
 *
 *   attention  query heads [r*H/S, (r+1)*H/S): rows of attn.wq_b and of
 *              attn.attn_sink; output groups [r*G/S, (r+1)*G/S): rows of
 *              attn.wo_a; output columns [r*D/S, (r+1)*D/S): rows of
 *              attn.wo_b.  Everything else of attention (wq_a, wkv,
 *              compressors, indexer) on every rank.
 *   experts    routed experts [r*E/S, (r+1)*E/S) of every layer; the shared
 *              expert of layer l on rank l % S.
 *   the rest   embedding, head, norms, mHC, router: on every rank.
 *
 * Row slices start at multiples of 128, so an FP8 slice keeps whole
 * 128x128 scale blocks.  A group of one rank holds everything.
 */
#ifndef DSV4_COMMON_WEIGHTS_SHARD_H
#define DSV4_COMMON_WEIGHTS_SHARD_H

#include <stdint.h>

#include "common/err.h"
#include "common/model_config.h"
#include "common/weights.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Whether cfg can be split over `size` ranks as above; DSV4_ERR_CONFIG
 * naming the dimension that does not divide. */
enum dsv4_err dsv4_shard_check(const struct dsv4_config *cfg, int size);

/*
 * The rule above by tensor name (checkpoint names, common/model_tensors.h):
 * 0 when rank `rank` of `size` does not hold tensor `name`; else 1 with
 * [*row0, *row0 + *rows) the rows it holds of the tensor's `shape0` rows
 * (an FP8 .scale tensor: its block rows).
 */
int dsv4_shard_rows(const struct dsv4_config *cfg, const char *name, int rank, int size,
                    int64_t shape0, int64_t *row0, int64_t *rows);

/*
 * A view of `in` holding rank `rank`'s part: the same tensors (pointers
 * into in's memory) with the sliced linears' pointers and n_out moved, and
 * the experts not held zeroed (w == NULL).  `in` must outlive the view.
 * Free with dsv4_weights_shard_free.
 */
enum dsv4_err dsv4_weights_shard(struct dsv4_weights *out, const struct dsv4_weights *in,
                                 int rank, int size);
void dsv4_weights_shard_free(struct dsv4_weights *w);

#ifdef __cplusplus
}
#endif
#endif
