/*
 * gw_http.c — dsv4-gateway's HTTP side (libmicrohttpd, one thread per
 * connection): the listener, routing, body-size limit, bearer-token check,
 * OpenAI-shaped errors, GET /v1/models, /health and /metrics.  Generation
 * routes are handed to gw_gen.c with the complete body.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <json-c/json.h>

#include "common/log.h"
#include "daemons/gateway/gateway.h"

/* Per-request state of MHD's access handler (*con_cls). */
struct gw_conn {
    enum gw_route route;
    char *body;          /* request body so far (POST) */
    size_t len, cap;
    bool refused;        /* an answer was queued before the body ended */
    bool too_big;        /* the body passed gateway_max_body (len counts on) */
    struct gw_gen *gen;  /* generation state, once gw_gen_handle ran */
};

static enum gw_route
gw_route_of(const char *url)
{
    if (strcmp(url, "/v1/completions") == 0)
        return GW_R_COMPLETIONS;
    if (strcmp(url, "/v1/chat/completions") == 0)
        return GW_R_CHAT;
    if (strcmp(url, "/v1/models") == 0 || strncmp(url, "/v1/models/", 11) == 0)
        return GW_R_MODELS;
    if (strcmp(url, "/health") == 0)
        return GW_R_HEALTH;
    if (strcmp(url, "/metrics") == 0)
        return GW_R_METRICS;
    return GW_R_OTHER;
}

/* Queue `body` (malloc'd, ownership passes) as the answer on `route`; not
 * counted. */
static enum MHD_Result
gw_http_queue(struct MHD_Connection *conn, enum gw_route route, unsigned status,
    const char *type, char *body, size_t len)
{
    struct MHD_Response *r;
    enum MHD_Result rc;

    r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (r == NULL) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == MHD_HTTP_UNAUTHORIZED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    /* A 405 must name the methods the route takes (RFC 9110, 15.5.6). */
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW,
            route == GW_R_COMPLETIONS || route == GW_R_CHAT ? "POST" : "GET, HEAD");
    rc = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return rc;
}

enum MHD_Result
gw_http_reply(struct gw *g, struct MHD_Connection *conn, enum gw_route route,
    unsigned status, const char *type, char *body, size_t len)
{
    gw_metrics_http(g, route, status);
    return gw_http_queue(conn, route, status, type, body, len);
}

const char *
gw_http_error_type(unsigned status)
{
    switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    case 504: return "timeout_error";
    default: return status < 500 ? "invalid_request_error" : "server_error";
    }
}

enum MHD_Result
gw_http_json(struct gw *g, struct MHD_Connection *conn, enum gw_route route,
    unsigned status, json_object *o)
{
    const char *s = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN |
        JSON_C_TO_STRING_NOSLASHESCAPE);
    char *body = s != NULL ? strdup(s) : NULL;

    json_object_put(o);
    if (body == NULL)
        return MHD_NO;
    return gw_http_reply(g, conn, route, status, "application/json", body, strlen(body));
}

enum MHD_Result
gw_http_error(struct gw *g, struct MHD_Connection *conn, enum gw_route route,
    unsigned status, const char *code, const char *fmt, ...)
{
    json_object *o, *e;
    char msg[1024];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    o = json_object_new_object();
    e = json_object_new_object();
    /* The message may echo what the client sent (a URL, a model name) or be
     * cut inside a character: make it valid UTF-8 before it goes out. */
    json_object_object_add(e, "message", gw_json_bytes(msg, strlen(msg)));
    json_object_object_add(e, "type", json_object_new_string(gw_http_error_type(status)));
    json_object_object_add(e, "param", NULL);
    json_object_object_add(e, "code", code != NULL ? json_object_new_string(code) : NULL);
    json_object_object_add(o, "error", e);
    log_debug("gw_http_error: %u %s", status, msg);
    return gw_http_json(g, conn, route, status, o);
}

json_object *
gw_json_bytes(const char *s, size_t n)
{
    struct dsv4_tok_stream st;
    struct dsv4_tok_text t = { 0 };
    json_object *o;

    st.tok = NULL;
    st.npend = 0;
    if (dsv4_tok_stream_bytes(&st, s, n, &t) != DSV4_OK ||
        dsv4_tok_stream_flush(&st, &t) != DSV4_OK) {
        dsv4_tok_text_free(&t);
        return json_object_new_string("");
    }
    o = json_object_new_string_len(t.s != NULL ? t.s : "", (int)t.len);
    dsv4_tok_text_free(&t);
    return o;
}

bool
gw_http_peer_gone(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci;
    struct pollfd p;

    ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci == NULL)
        return true;
    p.fd = ci->connect_fd;
    p.events = POLLRDHUP;
    p.revents = 0;
    if (poll(&p, 1, 0) < 0)
        return false;
    /* A FIN (POLLRDHUP) counts: a client that closed and one that only
     * half-closed look the same, and a request whose client closed must not
     * run on (proxies such as nginx take a client's FIN the same way). */
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* Bearer-token check; true when allowed.  Compares every key in full, so
 * the time taken does not tell how much of a key matched. */
static bool
gw_auth_ok(struct gw *g, struct MHD_Connection *conn)
{
    const char *h, *tok;
    size_t tl, i;
    bool ok;
    int k;

    h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    tok = h != NULL && strncasecmp(h, "Bearer ", 7) == 0 ? h + 7 : NULL;
    while (tok != NULL && (*tok == ' ' || *tok == '\t'))
        tok++;
    tl = tok != NULL ? strlen(tok) : 0;
    /* (blanks after the value are not part of it: RFC 9110 5.5) */
    while (tl > 0 && (tok[tl - 1] == ' ' || tok[tl - 1] == '\t'))
        tl--;
    pthread_mutex_lock(&g->klock);
    ok = g->n_keys == 0;            /* no gateway_keys: no authentication */
    for (k = 0; tok != NULL && k < g->n_keys; k++) {
        const char *key = g->keys[k];
        size_t kl = strlen(key);
        unsigned char diff = (unsigned char)(kl != tl);

        for (i = 0; i < kl; i++)
            diff |= (unsigned char)(key[i] ^ (i < tl ? tok[i] : 0));
        ok |= diff == 0;
    }
    pthread_mutex_unlock(&g->klock);
    return ok;
}

static enum MHD_Result
gw_models(struct gw *g, struct MHD_Connection *conn, const char *url)
{
    json_object *o, *m, *arr;

    if (strncmp(url, "/v1/models/", 11) == 0 && strcmp(url + 11, g->conf.gateway_model) != 0)
        return gw_http_error(g, conn, GW_R_MODELS, 404, "model_not_found",
            "model \"%s\" does not exist; this server serves \"%s\"", url + 11,
            g->conf.gateway_model);
    m = json_object_new_object();
    json_object_object_add(m, "id", json_object_new_string(g->conf.gateway_model));
    json_object_object_add(m, "object", json_object_new_string("model"));
    json_object_object_add(m, "created", json_object_new_int64(0));
    json_object_object_add(m, "owned_by", json_object_new_string("dsv4"));
    if (strncmp(url, "/v1/models/", 11) == 0) {
        o = m;
    } else {
        o = json_object_new_object();
        arr = json_object_new_array();
        json_object_array_add(arr, m);
        json_object_object_add(o, "object", json_object_new_string("list"));
        json_object_object_add(o, "data", arr);
    }
    return gw_http_json(g, conn, GW_R_MODELS, 200, o);
}

static enum MHD_Result
gw_health(struct gw *g, struct MHD_Connection *conn)
{
    struct gw_sched *s;
    char why[128], *body;
    bool ok;

    if ((s = malloc(sizeof(*s))) == NULL)
        return MHD_NO;
    gw_sched_query(g, s);
    ok = gw_sched_serving(s, why, sizeof(why));
    free(s);
    if (atomic_load(&g->stopping)) {
        ok = false;
        snprintf(why, sizeof(why), "the gateway is stopping");
    }
    if (!ok)
        return gw_http_error(g, conn, GW_R_HEALTH, 503, "unavailable", "%s", why);
    if ((body = strdup("{\"status\":\"ok\"}")) == NULL)
        return MHD_NO;
    return gw_http_reply(g, conn, GW_R_HEALTH, 200, "application/json", body, strlen(body));
}

static enum MHD_Result
gw_metrics(struct gw *g, struct MHD_Connection *conn)
{
    size_t len;
    char *body;

    /* Count this scrape before rendering, so it shows in its own answer. */
    gw_metrics_http(g, GW_R_METRICS, 200);
    if ((body = gw_metrics_render(g, &len)) == NULL)
        return MHD_NO;
    return gw_http_queue(conn, GW_R_METRICS, 200, "text/plain; version=0.0.4; charset=utf-8",
        body, len);
}

/* The whole request has arrived: answer it. */
static enum MHD_Result
gw_dispatch(struct gw *g, struct MHD_Connection *conn, struct gw_conn *c, const char *url,
    const char *method)
{
    bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    bool post = strcmp(method, "POST") == 0;

    switch (c->route) {
    case GW_R_COMPLETIONS:
    case GW_R_CHAT:
        if (!post)
            return gw_http_error(g, conn, c->route, 405, "method_not_allowed",
                "%s %s: use POST", method, url);
        return gw_gen_handle(g, conn, c->route == GW_R_CHAT, c->body != NULL ? c->body : "",
            c->len, &c->gen);
    case GW_R_MODELS:
    case GW_R_HEALTH:
    case GW_R_METRICS:
        if (!get)
            return gw_http_error(g, conn, c->route, 405, "method_not_allowed",
                "%s %s: use GET", method, url);
        if (c->route == GW_R_MODELS)
            return gw_models(g, conn, url);
        return c->route == GW_R_HEALTH ? gw_health(g, conn) : gw_metrics(g, conn);
    default:
        return gw_http_error(g, conn, GW_R_OTHER, 404, "not_found",
            "no route %s %s (routes: POST /v1/completions, POST /v1/chat/completions, "
            "GET /v1/models, GET /health, GET /metrics)", method, url);
    }
}

/* gw_framing_ambiguous's count of the Content-Length headers. */
struct gw_cl_seen {
    const char *first;
    bool differ;
};

static enum MHD_Result
gw_cl_each(void *cls, enum MHD_ValueKind kind, const char *key, const char *value)
{
    struct gw_cl_seen *cl = cls;

    (void)kind;
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) != 0)
        return MHD_YES;
    if (cl->first == NULL)
        cl->first = value != NULL ? value : "";
    else if (strcmp(cl->first, value != NULL ? value : "") != 0)
        cl->differ = true;
    return MHD_YES;
}

/* RFC 9112 §6.3: a request with both Content-Length and Transfer-Encoding,
 * or with Content-Length headers that differ, has a length a proxy in front
 * may read otherwise than libmicrohttpd (which takes the chunks, or the
 * first length): a request hidden in a body.  Refused with 400. */
static bool
gw_framing_ambiguous(struct MHD_Connection *conn)
{
    struct gw_cl_seen cl = { NULL, false };

    (void)MHD_get_connection_values(conn, MHD_HEADER_KIND, gw_cl_each, &cl);
    return cl.differ || (cl.first != NULL && MHD_lookup_connection_value(conn,
        MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING) != NULL);
}

static enum MHD_Result
gw_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
    const char *version, const char *upload_data, size_t *upload_data_size, void **con_cls)
{
    struct gw *g = cls;
    struct gw_conn *c = *con_cls;
    const char *cl;
    size_t need;
    char *nb;

    (void)version;
    if (c == NULL) {
        if ((c = calloc(1, sizeof(*c))) == NULL)
            return MHD_NO;
        *con_cls = c;
        gw_deadline_phase(g, conn, GW_PH_BODY);   /* the headers are in */
        c->route = gw_route_of(url);
        /* Refuse before reading the body (libmicrohttpd then closes the
         * connection): framing a proxy could read otherwise, auth (every
         * /v1/ URL, a route or not), then a declared size. */
        if (gw_framing_ambiguous(conn)) {
            c->refused = true;
            return gw_http_error(g, conn, c->route, 400, "invalid_request",
                "ambiguous body length: Content-Length with Transfer-Encoding, or "
                "Content-Length headers that differ");
        }
        if (strncmp(url, "/v1/", 4) == 0 && !gw_auth_ok(g, conn)) {
            c->refused = true;
            return gw_http_error(g, conn, c->route, 401, "invalid_api_key",
                "missing or invalid bearer token (Authorization: Bearer KEY)");
        }
        cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
            MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl != NULL && strtoull(cl, NULL, 10) > (unsigned long long)g->conf.gateway_max_body) {
            c->refused = true;
            return gw_http_error(g, conn, c->route, 413, "request_too_large",
                "request body of %s bytes exceeds the limit of %d bytes", cl,
                g->conf.gateway_max_body);
        }
        return MHD_YES;
    }
    if (*upload_data_size != 0) {
        if (c->refused) {
            *upload_data_size = 0;
            return MHD_YES;
        }
        need = c->len + *upload_data_size;
        if (need > (size_t)g->conf.gateway_max_body) {
            /* A body without Content-Length that grew too big: MHD lets us
             * answer only once the body has ended, so drop what comes (up
             * to GW_DISCARD_MAX bytes, then hang up) and answer 413 then. */
            free(c->body);
            c->body = NULL;
            c->cap = 0;
            c->len = need;
            c->too_big = true;
            *upload_data_size = 0;
            return c->len > GW_DISCARD_MAX ? MHD_NO : MHD_YES;
        }
        if (need + 1 > c->cap) {
            size_t ncap = c->cap != 0 ? c->cap : 4096;

            while (ncap < need + 1)
                ncap *= 2;
            if ((nb = realloc(c->body, ncap)) == NULL)
                return MHD_NO;
            c->body = nb;
            c->cap = ncap;
        }
        memcpy(c->body + c->len, upload_data, *upload_data_size);
        c->len = need;
        c->body[c->len] = '\0';
        *upload_data_size = 0;
        return MHD_YES;
    }
    gw_deadline_phase(g, conn, GW_PH_SERVING);   /* the whole request is in */
    if (c->refused)
        return MHD_YES;
    c->refused = true; /* answered now; later calls (none expected) do nothing */
    if (c->too_big)
        return gw_http_error(g, conn, c->route, 413, "request_too_large",
            "request body exceeds the limit of %d bytes", g->conf.gateway_max_body);
    return gw_dispatch(g, conn, c, url, method);
}

static void
gw_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
    enum MHD_RequestTerminationCode toe)
{
    struct gw *g = cls;
    struct gw_conn *c = *con_cls;

    gw_deadline_phase(g, conn, GW_PH_HEAD);   /* the next request's headers are due */
    if (c == NULL)
        return;
    if (c->gen != NULL)
        gw_gen_finish(g, c->gen, toe != MHD_REQUEST_TERMINATED_COMPLETED_OK);
    free(c->body);
    free(c);
    *con_cls = NULL;
}

static void
gw_mhd_log(void *cls, const char *fmt, va_list ap)
{
    char buf[512];

    (void)cls;
    vsnprintf(buf, sizeof(buf), fmt, ap);
    buf[strcspn(buf, "\n")] = '\0';
    log_info("libmicrohttpd: %s", buf);
}

/* HOST:PORT ("[::1]:8000" for IPv6) resolved for a listening stream
 * socket into *res (the caller frees it); -1 with a warning when spec is
 * not HOST:PORT or does not resolve. */
static int
gw_listen_resolve(const char *spec, struct addrinfo **res)
{
    struct addrinfo hints;
    char host[256], *port;
    int rc;

    snprintf(host, sizeof(host), "%s", spec);
    if ((port = strrchr(host, ':')) == NULL) {
        log_warnx("gw_listen: \"%s\": expected HOST:PORT", spec);
        return -1;
    }
    *port++ = '\0';
    {
        /* a decimal 1 .. 65535 (getaddrinfo would take 65536 modulo 2^16,
         * and 0 as "any free port", while the log named the one given) */
        char *end;
        long v;

        errno = 0;
        v = strtol(port, &end, 10);
        if (port[0] < '0' || port[0] > '9' || *end != '\0' || errno != 0 || v < 1 ||
            v > 65535) {
            log_warnx("gw_listen: \"%s\": the port is not a number 1 ... 65535", spec);
            return -1;
        }
    }
    memmove(host, host[0] == '[' ? host + 1 : host, strlen(host) + 1);
    if (host[0] != '\0' && host[strlen(host) - 1] == ']')
        host[strlen(host) - 1] = '\0';
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if ((rc = getaddrinfo(host[0] != '\0' ? host : NULL, port, &hints, res)) != 0) {
        log_warnx("gw_listen: %s: %s", spec, gai_strerror(rc));
        return -1;
    }
    return 0;
}

int
gw_listen_check(const char *spec)
{
    struct addrinfo *res;

    if (gw_listen_resolve(spec, &res) != 0)
        return -1;
    freeaddrinfo(res);
    return 0;
}

/* Bind and listen on HOST:PORT (gw_listen_resolve). */
static int
gw_listen(const char *spec)
{
    struct addrinfo *res, *ai;
    int fd = -1, one = 1;

    if (gw_listen_resolve(spec, &res) != 0)
        return -1;
    for (ai = res; ai != NULL; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0)
            continue;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 128) == 0)
            break;
        log_warn("gw_listen: %s", spec);
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    return fd;
}

int
gw_http_start(struct gw *g, int listen_fd)
{
    if (listen_fd < 0 && (listen_fd = gw_listen(g->conf.gateway_listen)) < 0)
        return -1;
    if (gw_deadline_start(g) != 0) {
        close(listen_fd);
        return -1;
    }
    /* MHD_USE_ITC: gw_http_quiesce can stop the accepts of this mode */
    g->mhd = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
        MHD_USE_POLL | MHD_USE_ITC | MHD_USE_ERROR_LOG, 0, NULL, NULL, gw_access, g,
        MHD_OPTION_EXTERNAL_LOGGER, gw_mhd_log, NULL,   /* first: it logs the others */
        MHD_OPTION_LISTEN_SOCKET, listen_fd,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned int)g->conf.gateway_max_conns,
        /* 0: no bound (libmicrohttpd's meaning too) */
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned int)g->conf.gateway_max_conns_per_ip,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)g->conf.gateway_idle_s,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)65536,
        MHD_OPTION_NOTIFY_COMPLETED, gw_completed, g,
        MHD_OPTION_NOTIFY_CONNECTION, gw_deadline_notify, g,
        MHD_OPTION_END);
    if (g->mhd == NULL) {
        log_warnx("gw_http_start: libmicrohttpd did not start");
        gw_deadline_stop(g);
        close(listen_fd);
        return -1;
    }
    return 0;
}

void
gw_http_quiesce(struct gw *g)
{
    MHD_socket fd;

    if (g->mhd == NULL)
        return;
    fd = MHD_quiesce_daemon(g->mhd);
    if (fd != MHD_INVALID_SOCKET)
        close(fd);
}

void
gw_http_stop(struct gw *g)
{
    if (g->mhd != NULL)
        MHD_stop_daemon(g->mhd);
    g->mhd = NULL;
    gw_deadline_stop(g);
}
