/*
 * launch_sock.c — the sockets dsv4-launch owns: the scheduler's client and
 * admin listeners (what dsv4-sched.socket declares) and one NOTIFY_SOCKET
 * per child.  All are created CLOEXEC; proc_start() hands the listeners to
 * the scheduler on fds 3 and 4.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/log.h"
#include "common/unix_sock.h"
#include "tools/launch/launch.h"

#define LISTEN_BACKLOG 128

/* mkdir -p the directory part of `path`; -1 when a part cannot be made. */
static int
sock_mkparent(const char *path)
{
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    char *p;

    snprintf(dir, sizeof(dir), "%s", path);
    for (p = dir + 1; (p = strchr(p, '/')) != NULL; p++) {
        *p = '\0';
        if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
            log_warn("sock_listen: cannot make the directory %s", dir);
            return -1;
        }
        *p = '/';
    }
    return 0;
}

static int
sock_listen_ipc(const char *path, unsigned mode, char *path_out, size_t path_len)
{
    struct sockaddr_un sa;
    struct stat st;
    int fd;

    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (*path == '@') {
        /* zsock and libzmq take ipc://@NAME as the abstract namespace; a
         * listener made here would be a file "@NAME" no client finds */
        log_warnx("sock_listen: ipc://%s: an abstract socket; dsv4-launch passes socket "
            "files to the scheduler: give a path (or start dsv4-sched without it)", path);
        return LAUNCH_SOCK_CONFIG;
    }
    if (*path == '\0' || strlen(path) >= sizeof(sa.sun_path)) {
        log_warnx("sock_listen: ipc://%s: %s", path, *path == '\0' ? "no path" :
            "path too long for a unix socket");
        return LAUNCH_SOCK_CONFIG;
    }
    strcpy(sa.sun_path, path);
    if (sock_mkparent(path) != 0)
        return LAUNCH_SOCK_CONFIG;
    /* A socket file left by a dead process is stale; one a live process
     * listens on (another launcher's set, a dsv4-sched of its own) is in
     * use; anything else is not ours to remove. */
    if (lstat(path, &st) == 0 && S_ISSOCK(st.st_mode)) {
        if (unix_sock_live(path)) {
            log_warnx("sock_listen: %s: in use (a process listens on it: another dsv4-launch "
                "or dsv4-sched?)", path);
            return -1;
        }
        unlink(path);
    }
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        log_warn("sock_listen: socket");
        return -1;
    }
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 ||
        (mode != 0 && chmod(path, mode) != 0) || listen(fd, LISTEN_BACKLOG) != 0) {
        log_warn("sock_listen: %s", path);
        close(fd);
        return -1;
    }
    snprintf(path_out, path_len, "%s", path);
    return fd;
}

static int
sock_listen_tcp(const char *hostport)
{
    struct addrinfo hints, *res, *ai;
    char host[256], *colon;
    const char *h;
    int fd = -1, one = 1, rc;

    snprintf(host, sizeof(host), "%s", hostport);
    colon = strrchr(host, ':');
    if (colon == NULL || colon[1] == '\0') {
        log_warnx("sock_listen: tcp endpoint without port: %s", hostport);
        return LAUNCH_SOCK_CONFIG;
    }
    *colon = '\0';
    h = host;
    if (strcmp(h, "*") == 0 || *h == '\0')
        h = NULL;
    else if (h[0] == '[' && h[strlen(h) - 1] == ']') {
        h++;
        host[strlen(host) - 1] = '\0';
    }
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if ((rc = getaddrinfo(h, colon + 1, &hints, &res)) != 0) {
        log_warnx("sock_listen: %s: %s", hostport, gai_strerror(rc));
        /* EAI_AGAIN (the resolver did not answer) may pass; the rest is
         * the name or the port as configured */
        return rc == EAI_AGAIN || rc == EAI_SYSTEM || rc == EAI_MEMORY ? -1 : LAUNCH_SOCK_CONFIG;
    }
    for (ai = res; ai != NULL; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0)
            continue;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
            listen(fd, LISTEN_BACKLOG) == 0)
            break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        log_warn("sock_listen: %s", hostport);
    return fd;
}

int
sock_listen(const char *endpoint, unsigned mode, char *path_out, size_t path_len)
{
    path_out[0] = '\0';
    if (endpoint[0] == '@')   /* zsock's "force bind" prefix */
        endpoint++;
    if (strncmp(endpoint, "ipc://", 6) == 0)
        return sock_listen_ipc(endpoint + 6, mode, path_out, path_len);
    if (strncmp(endpoint, "tcp://", 6) == 0)
        return sock_listen_tcp(endpoint + 6);
    log_warnx("sock_listen: unsupported endpoint %s (ipc:// or tcp://)", endpoint);
    return LAUNCH_SOCK_CONFIG;
}

int
sock_notify_open(struct launch_child *k, const char *dir)
{
    struct sockaddr_un sa;
    int n;

    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    n = snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/%s.notify", dir, k->name);
    if (n < 0 || (size_t)n >= sizeof(sa.sun_path)) {
        log_warnx("sock_notify_open: path too long in %s", dir);
        return -1;
    }
    k->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (k->notify_fd < 0 || bind(k->notify_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        log_warn("sock_notify_open: %s", sa.sun_path);
        return -1;
    }
    snprintf(k->notify_path, sizeof(k->notify_path), "%s", sa.sun_path);
    return 0;
}

ssize_t
sock_notify_recv(struct launch_child *k, char *buf, size_t size)
{
    ssize_t n;

    n = recv(k->notify_fd, buf, size - 1, MSG_DONTWAIT);
    if (n < 0)
        return -1;
    buf[n] = '\0';
    return n;
}
