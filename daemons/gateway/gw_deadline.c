/*
 * gw_deadline.c — dsv4-gateway: a deadline on the arrival of a whole
 * request.  libmicrohttpd closes a connection that moves no byte for
 * gateway_idle_s, but one that sends a byte of its headers every few
 * seconds keeps its slot for good, so gateway_max_conns such clients shut
 * everyone else out.  Each connection is watched from its start
 * (MHD_OPTION_NOTIFY_CONNECTION) through the phases of its current request:
 * headers (until gw_access is first called), body (until its last call),
 * served (no bound here: gateway_timeout_ms bounds a generation); after a
 * request, the next one's headers are due.  A reaper thread shuts down
 * (shutdown(2), so libmicrohttpd's thread sees the end and closes) every
 * connection in the headers or body phase for longer than gateway_idle_s.
 *
 * The list and each entry are guarded by g->dlock; an entry lives from the
 * connection's STARTED notification to its CLOSED one, which comes before
 * libmicrohttpd closes the fd, so the reaper never shuts down an fd that
 * another connection has taken.
 */
#include <sys/socket.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "daemons/gateway/gateway.h"

#define GW_REAP_MS 500   /* the reaper looks this often */

static int64_t
dl_now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void
gw_deadline_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
    enum MHD_ConnectionNotificationCode toe)
{
    struct gw *g = cls;
    struct gw_sock *gs = *socket_context;

    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);

        if (ci == NULL || (gs = calloc(1, sizeof(*gs))) == NULL)
            return;   /* not watched: libmicrohttpd's idle timeout still applies */
        gs->fd = ci->connect_fd;
        gs->phase = GW_PH_HEAD;
        gs->since_ms = dl_now_ms();
        pthread_mutex_lock(&g->dlock);
        TAILQ_INSERT_TAIL(&g->socks, gs, entry);
        pthread_mutex_unlock(&g->dlock);
        *socket_context = gs;
        return;
    }
    if (gs == NULL)
        return;
    pthread_mutex_lock(&g->dlock);
    TAILQ_REMOVE(&g->socks, gs, entry);
    pthread_mutex_unlock(&g->dlock);
    free(gs);
    *socket_context = NULL;
}

void
gw_deadline_phase(struct gw *g, struct MHD_Connection *conn, enum gw_phase phase)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    struct gw_sock *gs = ci != NULL ? ci->socket_context : NULL;

    if (gs == NULL)
        return;
    pthread_mutex_lock(&g->dlock);
    if (gs->phase != phase) {
        gs->phase = phase;
        gs->since_ms = dl_now_ms();
    }
    pthread_mutex_unlock(&g->dlock);
}

static void *
dl_reaper(void *arg)
{
    struct gw *g = arg;

    while (!atomic_load(&g->reaper_stop)) {
        int64_t now = dl_now_ms(), bound = (int64_t)g->conf.gateway_idle_s * 1000;
        struct gw_sock *gs;
        struct timespec ts = { 0, GW_REAP_MS * 1000000L };

        pthread_mutex_lock(&g->dlock);
        TAILQ_FOREACH(gs, &g->socks, entry) {
            if (gs->phase == GW_PH_SERVING || gs->cut || now - gs->since_ms < bound)
                continue;
            log_info("gw_deadline: a request still arriving after %d s (%s): connection "
                "closed", g->conf.gateway_idle_s, gs->phase == GW_PH_HEAD ? "headers" : "body");
            (void)shutdown(gs->fd, SHUT_RDWR);
            gs->cut = true;
        }
        pthread_mutex_unlock(&g->dlock);
        nanosleep(&ts, NULL);
    }
    return NULL;
}

int
gw_deadline_start(struct gw *g)
{
    int e;

    pthread_mutex_init(&g->dlock, NULL);
    TAILQ_INIT(&g->socks);
    atomic_store(&g->reaper_stop, false);
    if ((e = pthread_create(&g->reaper, NULL, dl_reaper, g)) != 0) {
        log_warnx("gw_deadline_start: pthread_create: %s", strerror(e));
        return -1;
    }
    g->reaper_up = true;
    return 0;
}

void
gw_deadline_stop(struct gw *g)
{
    if (!g->reaper_up)
        return;
    atomic_store(&g->reaper_stop, true);
    pthread_join(g->reaper, NULL);
    g->reaper_up = false;
}
