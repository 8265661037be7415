/*
 * samples.h — one or more filled-in messages for every command of every
 * sub-protocol.  The round-trip and golden tests (test_proto.c), the golden
 * writer and the fuzz seed corpus all use these, so a new command needs one
 * entry in samples.c and a regenerated golden file.
 */
#ifndef DSV4_TESTS_IPC_SAMPLES_H
#define DSV4_TESTS_IPC_SAMPLES_H

#include <stddef.h>

#include "ipc/proto.h"

/* Number of samples. */
size_t samples_count(void);

/* Fill `m` with sample `i` (< samples_count()); `m` borrows static data and
 * needs no clear.  Returns the sample's name (file stem of its golden file). */
const char *samples_get(size_t i, struct dsv4_msg *m);

#endif
