/*
 * file_open.c — open a loader's file only when it is a regular file
 * (file_open.h).
 */
#include "common/file_open.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

enum dsv4_err
dsv4_open_regular(const char *path, enum dsv4_err not_regular, int *fd, struct stat *st)
{
    enum dsv4_err err;
    int fl;

    *fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (*fd < 0)
        return dsv4_err_set(DSV4_ERR_SYS, "%s: open: %s", path, strerror(errno));
    if (fstat(*fd, st) != 0)
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: fstat: %s", path, strerror(errno));
    else if (!S_ISREG(st->st_mode))
        err = dsv4_err_set(not_regular, "%s: not a regular file (%s)", path,
                           S_ISFIFO(st->st_mode) ? "a FIFO" :
                           S_ISDIR(st->st_mode) ? "a directory" :
                           S_ISSOCK(st->st_mode) ? "a socket" : "a device");
    else if ((fl = fcntl(*fd, F_GETFL)) < 0 || fcntl(*fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        err = dsv4_err_set(DSV4_ERR_SYS, "%s: fcntl: %s", path, strerror(errno));
    else
        return DSV4_OK;
    close(*fd);
    *fd = -1;
    return err;
}
