/*
 * fake_sched.h — a stand-in scheduler for the client-protocol tests: a
 * ROUTER on one endpoint that speaks DSV4C1 and makes up output.
 *
 * Output of a request: with a text prompt, token k is byte k of the prompt
 * (cycled) and its text is that byte; with token ids, token k is id k
 * (cycled) and its text is "[ID]".  One token per request per loop turn
 * (about 1 ms).  Ends with DONE "length" at max_tokens, DONE "stop" after a
 * token in stop_ids (stop strings are not implemented), DONE "cancelled" on
 * CANCEL, ERROR 408 when timeout_ms passes.  Logprob of token k: -k/8.
 * Prompts "__busy__" get ERROR 300; "__stall__" is accepted and then
 * ignored (no output, no timeout), to test client-side timeouts;
 * "__count__" gets ERROR 501 with the message "live N", N the requests
 * running; "__noseed__" gets an OK without a seed (an older scheduler's),
 * every other OK says seed 4242; "__restart__" gets OK, the token '_' and
 * ERROR 302 (a scheduler that stops), and its resend ERROR 300; a
 * GENERATE with `resume` (docs/protocol.md §4.6) goes on after the
 * resumed tokens when they, their text's length and the seed are this
 * request's (ERROR 401 otherwise).
 */
#ifndef DSV4_TESTS_IPC_FAKE_SCHED_H
#define DSV4_TESTS_IPC_FAKE_SCHED_H

#include <stdatomic.h>

/* Serve `endpoint` until *stop becomes nonzero.  Returns 0, or 1 when the
 * endpoint could not be bound.  Single-threaded; own ZeroMQ context. */
int fake_sched_run(const char *endpoint, atomic_int *stop);

#endif
