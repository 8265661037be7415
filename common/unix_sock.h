/*
 * unix_sock.h — whether a process listens on a unix socket file.  Asked
 * before a bind that would replace the file: libzmq's ipc:// bind unlinks
 * whatever is at the path, and dsv4-launch removes a stale socket file
 * before binding its listeners; neither may take a live set's socket.
 */
#ifndef DSV4_COMMON_UNIX_SOCK_H
#define DSV4_COMMON_UNIX_SOCK_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Whether the unix socket file at `path` is live: a stream connect to it
 * is taken (or its backlog is full).  Only a refused connect (a socket
 * file nobody listens on, or not a socket) or no file at all says it is
 * stale or absent; any other failure (no permission to connect, no socket
 * to ask with) counts as live, so that nothing is removed that may be in
 * use.  A path too long for sockaddr_un is not live (it cannot be bound
 * either).
 */
bool unix_sock_live(const char *path);

#ifdef __cplusplus
}
#endif
#endif
