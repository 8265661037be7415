/*
 * model_util.h — helpers shared by the forward-pass tests: load a generated
 * checkpoint on the CPU backend, run token sequences, compare logits.
 */
#ifndef DSV4_TESTS_MODEL_UTIL_H
#define DSV4_TESTS_MODEL_UTIL_H

#include <stdint.h>

#include "common/weights.h"
#include "kernels/backend.h"
#include "kernels/forward.h"

/* A loaded model on a CPU backend, or on the CUDA backend when the
 * environment has DSV4_TEST_BACKEND=cuda (builds with CUDA; the weights are
 * uploaded, dw). */
struct tmodel {
    struct dsv4_weights w;
    struct dsv4_weights dw;   /* device copy (CUDA backend), else zeroed */
    struct dsv4_backend *be;
    struct dsv4_model *m;
    int V;
};

/* Load `dir` with the given numerics, slots and row/sequence bounds; aborts
 * the test program with the loader's message on failure. */
void tmodel_open(struct tmodel *t, const char *dir, enum dsv4_numerics num, int n_slots,
                 int max_seq, int max_rows);
void tmodel_close(struct tmodel *t);

/* Deterministic token ids in [0, V). */
void tmodel_tokens(int32_t *ids, int n, int V, uint64_t seed);

/* Largest |a - b| over n values, and largest |a|; a NaN on either side
 * counts as infinite (a check against a bound then fails). */
double tmodel_max_diff(const float *a, const float *b, int64_t n, double *max_abs_a);

#endif
