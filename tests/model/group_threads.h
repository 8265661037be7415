/*
 * group_threads.h — a model group of ranks as threads of one test process
 * (kernels/forward.h "Model groups"): one thread per rank of a local
 * communicator group (kernels/comm.h dsv4_comm_local_create), each with its
 * own CPU backend, its shard of the full weights (common/weights_shard.h)
 * and its model, running the test's function on that model.  Used by
 * test_tp.c and test_spec.c.
 */
#ifndef DSV4_TESTS_GROUP_THREADS_H
#define DSV4_TESTS_GROUP_THREADS_H

#include "common/err.h"
#include "common/weights.h"
#include "common/weights_shard.h"
#include "kernels/forward.h"

/*
 * Run fn(m, rank, ctx) on every rank 0 .. n-1 of a new local group of n
 * ranks, one thread per rank, and wait for all of them.  Rank r's model m
 * is made on a CPU backend (reference numerics, one thread) from shard r of
 * n of `full` (group split `split`) with *opts, whose comm is replaced by rank r's; the model,
 * backend, shard and communicators are freed before this returns.  ctx is
 * the caller's, the same for every rank (fn writes only its rank's part).
 *
 * DSV4_OK when every rank was set up and ran fn; else the error of the
 * lowest rank whose set-up failed, with "rank R set-up: ..." as this
 * thread's dsv4_errmsg() (a rank that fails does not run fn, so its peers
 * block in their first collective and the test runner's timeout ends the
 * test, loudly), or of making the group or its threads.
 */
enum dsv4_err group_threads_run(const struct dsv4_weights *full, int n,
                                enum dsv4_group_split split,
                                const struct dsv4_model_opts *opts,
                                void (*fn)(struct dsv4_model *m, int rank, void *ctx),
                                void *ctx);

#endif
