/*
 * model_tensors.h — the tensor inventory implied by a config (model doc §2.4):
 * every tensor's name, dtype, shape and shard in the official layout.  Used by
 * dsv4-mkmodel (what to write), by the loader (what must be there, and with
 * which dtype and shape), and by `dsv4-mkmodel --inventory`.
 *
 * Shards follow the official file (model doc §2.1): shard 1 = embed, shard
 * 2+L = layer L, then one shard for the head/norm/hc_head, then one for the MTP
 * layer(s): 2 + L + (n_mtp > 0) shards in all (46 for the real model).
 */
#ifndef DSV4_COMMON_MODEL_TENSORS_H
#define DSV4_COMMON_MODEL_TENSORS_H

#include <stdint.h>

#include "common/err.h"
#include "common/model_config.h"
#include "common/safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a tensor is, so a generator knows how to fill it. */
enum dsv4_tkind {
    DSV4_TK_EMBED,       /* bf16 embedding / head rows */
    DSV4_TK_NORM,        /* bf16 RMSNorm weight (around 1) */
    DSV4_TK_LINEAR_BF16, /* bf16 [out, in] dense weight */
    DSV4_TK_FP8_WEIGHT,  /* FP8 E4M3 [out, in] */
    DSV4_TK_FP8_SCALE,   /* E8M0 [ceil(out/128), ceil(in/128)] */
    DSV4_TK_FP4_WEIGHT,  /* I8 [out, in/2] packed E2M1 */
    DSV4_TK_FP4_SCALE,   /* E8M0 [out, in/32] */
    DSV4_TK_HC_FN,       /* F32 mHC projection [mix, n*D] */
    DSV4_TK_HC_BASE,     /* F32 [mix] */
    DSV4_TK_HC_SCALE,    /* F32 [3] or [1] */
    DSV4_TK_SINK,        /* F32 [H] attention sink logits */
    DSV4_TK_GATE_BIAS,   /* F32 [E] router correction bias */
    DSV4_TK_TID2EID,     /* I64 [V, k] hash routing table */
    DSV4_TK_APE,         /* F32 [r, c*d] compressor position bias */
    DSV4_TK_HEAD,        /* bf16 [V, D] output head (head.weight) */
};

/* One tensor the configuration implies: its name, dtype, shape, shard,
 * kind and layer. */
struct dsv4_tensor_spec {
    char name[96];
    enum dsv4_st_dtype dtype;
    int n_dims;
    int64_t shape[2];
    int shard;               /* 1-based shard number */
    enum dsv4_tkind kind;
    int layer;               /* layer id (main 0..L-1, MTP L..), -1 top level */
};

/* Every tensor of a configuration (dsv4_inventory_build). */
struct dsv4_inventory {
    struct dsv4_tensor_spec *t;  /* n entries, in file order: by shard, and
                                  * inside a shard largest element size first
                                  * (so every tensor is naturally aligned) */
    int n;
    int n_shards;
    uint64_t total_bytes;        /* sum of tensor byte sizes */
};

/* Build the inventory for `cfg` (allocates inv->t). */
enum dsv4_err dsv4_inventory_build(struct dsv4_inventory *inv, const struct dsv4_config *cfg);
/* Free inv->t. */
void dsv4_inventory_free(struct dsv4_inventory *inv);
/* Byte size of one tensor spec. */
uint64_t dsv4_tensor_spec_bytes(const struct dsv4_tensor_spec *s);
/* Shard file name "model-000NN-of-000MM.safetensors" into buf. */
void dsv4_shard_name(char *buf, size_t len, int shard, int n_shards);

#ifdef __cplusplus
}
#endif
#endif
