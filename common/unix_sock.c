/*
 * unix_sock.c — is a unix socket file in use (see unix_sock.h).
 */
#include "common/unix_sock.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <errno.h>
#include <string.h>
#include <unistd.h>

bool
unix_sock_live(const char *path)
{
    struct sockaddr_un sa;
    bool live;
    int fd;

    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(sa.sun_path))
        return false;
    strcpy(sa.sun_path, path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return true;    /* cannot tell: remove nothing */
    live = connect(fd, (const struct sockaddr *)&sa, sizeof(sa)) == 0 ||
        (errno != ECONNREFUSED && errno != ENOENT && errno != ENOTDIR);
    close(fd);
    return live;
}
