/*
 * file_open.h — opening a file a loader reads (a checkpoint's shards, its
 * index, config.json) only when it is a regular file: a FIFO in its place
 * would block the open until a writer came, and the load (or `-n`) with it.
 */
#ifndef DSV4_COMMON_FILE_OPEN_H
#define DSV4_COMMON_FILE_OPEN_H

#include <sys/stat.h>

#include "common/err.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Open `path` read-only (close-on-exec) into *fd, only if it is a regular
 * file (*st: its fstat).  It is opened with O_NONBLOCK, so a FIFO or a
 * device is refused at once, then made blocking again.  DSV4_OK, or the
 * error set naming the file with *fd = -1: DSV4_ERR_SYS when open, fstat or
 * fcntl fails, `not_regular` (the caller's kind of fault: DSV4_ERR_WEIGHTS,
 * DSV4_ERR_CONFIG) for anything but a regular file ("a FIFO", "a
 * directory", "a socket", "a device").
 */
enum dsv4_err dsv4_open_regular(const char *path, enum dsv4_err not_regular, int *fd,
                                struct stat *st);

#ifdef __cplusplus
}
#endif

#endif
