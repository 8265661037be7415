/*
 * err.c — error strings and the per-thread last-error message (see err.h).
 */
#include "common/err.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char err_msg[1024];

static const char *const err_names[DSV4_ERR__COUNT] = {
    [DSV4_OK] = "success",
    [DSV4_ERR_SYS] = "system call failed",
    [DSV4_ERR_NOMEM] = "out of memory",
    [DSV4_ERR_CUDA] = "CUDA error",
    [DSV4_ERR_CONFIG] = "invalid configuration",
    [DSV4_ERR_WEIGHTS] = "bad weights",
    [DSV4_ERR_PROTO] = "protocol error",
    [DSV4_ERR_NOTSUP] = "not supported",
    [DSV4_ERR_BUSY] = "busy",
    [DSV4_ERR_TIMEOUT] = "timed out",
    [DSV4_ERR_CANCELED] = "cancelled",
    [DSV4_ERR_INVAL] = "invalid argument",
    [DSV4_ERR_TOKENIZER] = "bad tokenizer",
};

const char *
dsv4_strerror(enum dsv4_err e)
{
    if ((int)e < 0 || e >= DSV4_ERR__COUNT || err_names[e] == NULL)
        return "unknown error";
    return err_names[e];
}

enum dsv4_err
(dsv4_err_set)(enum dsv4_err e, const char *fmt, ...)   /* (the analyzer's macro, err.h) */
{
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(err_msg, sizeof(err_msg), fmt, ap);
    va_end(ap);
    return e;
}

const char *
dsv4_errmsg(void)
{
    return err_msg;
}

void
dsv4_err_clear(void)
{
    err_msg[0] = '\0';
}
