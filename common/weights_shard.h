/*
 * weights_shard.h — the part of the weights one rank of a model group holds
 * (tensor-parallel attention, experts whole or sliced; kernels/forward.h
 * and kernels/comm.h).  Rank r of S holds:
 *
 *   attention  query heads [r*H/S, (r+1)*H/S): rows of attn.wq_b and of
 *              attn.attn_sink; output groups [r*G/S, (r+1)*G/S): rows of
 *              attn.wo_a; and attn.wo_b by the group's split (enum
 *              dsv4_group_split): output rows [r*D/S, (r+1)*D/S) (EP: the
 *              ranks' outputs are gathered) or input columns
 *              [r*G*R/S, (r+1)*G*R/S), the outputs of its own wo_a groups
 *              (TP: each rank's output is a partial sum, the group adds
 *              them; no gather of wo_a's outputs).  Everything else of
 *              attention (wq_a, wkv, compressors, indexer) on every rank.
 *   experts    by the split: EP  routed experts [r*E/S, (r+1)*E/S) of
 *                  every layer, whole; the shared expert of layer l on
 *                  rank l % S;
 *              TP  every routed expert and the shared expert on every
 *                  rank, cut along the intermediate size I: rows
 *                  [r*I/S, (r+1)*I/S) of w1 and w3, the same columns of
 *                  w2 (and of their scales).  Each rank then computes every
 *                  picked expert's partial output, a sum over its slice of
 *                  I, and the group's all-reduce adds the partials: every
 *                  rank reads the same bytes whatever the routing (EP's
 *                  ranks wait for the one whose experts were picked more).
 *   head       vocabulary rows [r*V/S, (r+1)*V/S) of head.weight
 *              (dsv4_shard_vocab; V need not divide): each rank computes
 *              its slice of the logits and the group gathers them (the
 *              all-reduce of a zero-filled row, kernels/forward.c), so the
 *              logits are the full model's bit for bit under either split.
 *   the rest   embedding, norms, mHC, router: on every rank.
 *
 * EP keeps a group's results bit-identical to one rank (every all-reduce
 * adds one rank's value to zeros); TP's partial sums round differently.
 * Row slices start at multiples of 128, so an FP8 slice keeps whole
 * 128x128 scale blocks; so do TP's column slices (I/S and G*R/S multiples
 * of 128), which also keep whole 32-column FP4 scale groups.  A group of
 * one rank holds everything.
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

/* How a group splits the experts and wo_b (see above). */
enum dsv4_group_split {
    DSV4_GROUP_SPLIT_EP = 0,   /* whole routed experts, wo_b rows: bit-exact */
    DSV4_GROUP_SPLIT_TP = 1,   /* experts cut along I, wo_b columns: partial sums */
};

/* "ep" / "tp" -> *split; DSV4_ERR_CONFIG for anything else. */
enum dsv4_err dsv4_group_split_parse(const char *s, enum dsv4_group_split *split);

/* The split a group runs for the group_split key's value s: "ep" / "tp" as
 * dsv4_group_split_parse; "auto": tp where the ranks run the CUDA fast
 * kernels (fast_kernels != 0: every rank then reads the same bytes a step),
 * else ep (the exact kernels' and the CPU's groups stay bit-identical to
 * one rank).  DSV4_ERR_CONFIG for anything else, *split unchanged. */
enum dsv4_err dsv4_group_split_resolve(const char *s, int fast_kernels,
                                       enum dsv4_group_split *split);

/* The name of a split ("ep", "tp"). */
const char *dsv4_group_split_name(enum dsv4_group_split split);

/* Whether cfg can be split over `size` ranks as above; DSV4_ERR_CONFIG
 * naming the dimension that does not divide. */
enum dsv4_err dsv4_shard_check(const struct dsv4_config *cfg, int size,
                               enum dsv4_group_split split);

/* The vocabulary rows of head.weight rank `rank` of `size` holds:
 * [*row0, *row0 + *rows) = [rank*V/size, (rank+1)*V/size) (integer
 * division; the slices of the ranks cover [0, V) once). */
void dsv4_shard_vocab(int V, int rank, int size, int32_t *row0, int32_t *rows);

/* The part of a 2-D tensor one rank holds: rows [row0, row0 + rows) and
 * columns [col0, col0 + cols) (in the tensor's stored elements: an FP4
 * weight's columns are bytes of two values, a .scale tensor's are its
 * block columns). */
struct dsv4_shard_part {
    int64_t row0, rows, col0, cols;
};

/*
 * The rule above by tensor name (checkpoint names, common/model_tensors.h):
 * 0 when rank `rank` of `size` does not hold tensor `name`; else 1 with
 * *part the part it holds of the tensor's shape0 x shape1 (1-D tensors:
 * shape1 = 1).  A column slice never comes without the full rows.
 */
int dsv4_shard_part(const struct dsv4_config *cfg, const char *name, int rank, int size,
                    enum dsv4_group_split split, int64_t shape0, int64_t shape1,
                    struct dsv4_shard_part *part);

/*
 * A view of `in` holding rank `rank`'s part: the same tensors (pointers
 * into in's memory) with the sliced linears' pointers and n_out moved, and
 * the experts not held zeroed (w == NULL).  Column slices (TP's w2 and
 * wo_b) cannot point into `in`: they are copied into memory the view
 * owns.  `in` must outlive the view.  Free with dsv4_weights_shard_free.
 */
enum dsv4_err dsv4_weights_shard(struct dsv4_weights *out, const struct dsv4_weights *in,
                                 int rank, int size, enum dsv4_group_split split);
void dsv4_weights_shard_free(struct dsv4_weights *w);

#ifdef __cplusplus
}
#endif
#endif
