/*
 * err.h — the one error enum of dsv4, and a per-thread "last error" message.
 *
 * Runtime failures (I/O, bad config, corrupt weights, malformed message, no
 * capacity, timeout) are returned as enum dsv4_err.  The function that detects
 * the failure also records a human-readable message naming the object involved
 * (file, tensor, field) with dsv4_err_set(); callers print it with
 * dsv4_errmsg().  Programming errors are assert()s, never error codes.
 */
#ifndef DSV4_COMMON_ERR_H
#define DSV4_COMMON_ERR_H

#ifdef __cplusplus
extern "C" {
#endif

/* Every value but DSV4_OK is a failure.  Append-only: the wire protocol maps
 * these through a table, so renumbering would not break clients, but keep it
 * stable anyway. */
enum dsv4_err {
    DSV4_OK = 0,
    DSV4_ERR_SYS,       /* system call failed; errno text in the message */
    DSV4_ERR_NOMEM,     /* host or device allocation failed */
    DSV4_ERR_CUDA,      /* recoverable CUDA error */
    DSV4_ERR_CONFIG,    /* invalid configuration (config.json, options) */
    DSV4_ERR_WEIGHTS,   /* missing, corrupt or mismatched weight file/tensor */
    DSV4_ERR_PROTO,     /* malformed or unexpected message */
    DSV4_ERR_NOTSUP,    /* backend cannot run this op/dtype/shape */
    DSV4_ERR_BUSY,      /* no capacity now; retry later */
    DSV4_ERR_TIMEOUT,   /* a deadline passed */
    DSV4_ERR_CANCELED,  /* the work was cancelled */
    DSV4_ERR_INVAL,     /* invalid argument from a caller (bad input) */
    DSV4_ERR_TOKENIZER, /* tokenizer file missing or corrupt */
    DSV4_ERR__COUNT
};

/* Short static description of a code ("corrupt weights"); never NULL. */
const char *dsv4_strerror(enum dsv4_err e);

/*
 * Record the calling thread's last error message (printf format) and return
 * `e`, so a failing function can `return dsv4_err_set(DSV4_ERR_X, "...")`.
 * The message is truncated at 1023 bytes.
 */
enum dsv4_err dsv4_err_set(enum dsv4_err e, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
#ifdef __clang_analyzer__
/* For clang's static analyzer (tools/analyze.sh), which sees one file at a
 * time: what the call returns, so that it does not follow a failure path
 * as if it had returned DSV4_OK.  Never part of a build. */
#define dsv4_err_set(e, ...) (dsv4_err_set((e), __VA_ARGS__), (e))
#endif

/* The calling thread's last message set by dsv4_err_set ("" if none).  Valid
 * until the next dsv4_err_set on this thread. */
const char *dsv4_errmsg(void);

/* Clear the calling thread's last message. */
void dsv4_err_clear(void);

#ifdef __cplusplus
}
#endif
#endif
