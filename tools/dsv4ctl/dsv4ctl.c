/*
 * dsv4ctl — the admin tool of dsv4: talks to dsv4-sched's admin socket
 * (docs/protocol.md §7) and prints status, ranks and requests as tables for
 * people or JSON (--json) for scripts; drains and undrains; cancels a request.
 *
 *   dsv4ctl [--admin ENDPOINT] [--json] [-f CONFIG] status
 *   dsv4ctl ... ranks | requests
 *   dsv4ctl ... drain [RANK|all] [--timeout S]   (returns when drained)
 *   dsv4ctl ... undrain [RANK|all]
 *   dsv4ctl ... cancel REQ                       (REQ as `requests` lists it)
 *   dsv4ctl [-f CONFIG] keygen [DIR]   (CURVE server key pair, no scheduler)
 *
 * The endpoint comes from --admin, else $DSV4_ADMIN_ENDPOINT (dsv4-launch sets
 * it for its command), else admin_endpoint of the configuration file (-f, or
 * /etc/dsv4/dsv4.conf when present), else the default; a tcp:// endpoint's
 * server key is read from that file's key_dir.  A file that does not load
 * stops keygen (2); the other commands warn and go on with the defaults,
 * so that `reload` reaches the scheduler and reports its refusal.  Exit
 * status: 0 success; 1 the scheduler refused (no such request to cancel
 * included), a drain timed out, a listing was cut short, or keygen failed;
 * 2 usage or configuration (a bad endpoint included, or a client or rank
 * endpoint answering); 3 no answer from the
 * scheduler (beyond common/cli.h's 0/1/2: an operator's script tells "not
 * reached" from "refused").
 */
#include <sys/stat.h>

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "common/cli.h"
#include "common/config_file.h"
#include "common/log.h"
#include "ipc/proto.h"
#include "ipc/zsock.h"

#define CTL_TIMEOUT_MS 5000 /* answer wait for everything but drain */
#define CTL_HEARTBEAT_MS 1000 /* ZMTP pings: a silent peer is gone after 3 s */

struct ctl {
    void *zctx, *sock;
    void *mon;                  /* PAIR: the DEALER's connection and handshake events;
                                   NULL = none */
    bool curve;                 /* the endpoint is CURVE's (tcp://) */
    const char *key_dir;        /* where server.pub was read (CURVE) */
    const char *endpoint;       /* the admin endpoint connected to */
    bool connected;             /* the monitor saw the connection made (with
                                   CURVE: the handshake done) */
    bool json;
    int n_items;
};

static void __attribute__((noreturn))
usage(int status)
{
    dsv4_cli_usage(
        "usage: dsv4ctl [--admin ENDPOINT] [--json] [-f CONFIG] COMMAND [ARG]\n",
        "The dsv4 scheduler's admin client (docs/operations.md).  Commands:\n"
        "  status                          scheduler state and metrics\n"
        "  ranks                           registered ranks\n"
        "  requests                        requests in flight\n"
        "  drain [RANK|all] [--timeout S]  stop admissions / placements, wait until done\n"
        "                                  (at most S seconds: 408 then)\n"
        "  undrain [RANK|all]              lift a drain\n"
        "  cancel REQ                      end request REQ (the id `requests` lists) as\n"
        "                                  its client's cancel would\n"
        "  reload                          the scheduler reads its configuration again\n"
        "                                  (as on SIGHUP; 1 when the file does not load)\n"
        "  keygen [DIR]                    write DIR/server.key and server.pub (CURVE\n"
        "                                  keys of tcp:// endpoints; DIR = key_dir)\n"
        "RANK is prefill@N or decode@N.  Options:\n"
        "  -a, --admin ENDPOINT  the scheduler's admin socket ($DSV4_ADMIN_ENDPOINT, else admin_endpoint)\n"
        "  -f CONFIG             configuration file (default " DSV4_CONF_DEFAULT_PATH ")\n"
        "  -j, --json            answers as JSON\n"
        "  -t, --timeout S       drain's limit in seconds (0 ... 86400; 0: none)\n"
        "  -h, --help            this help\n"
        "      --version         the version\n"
        "Exit status: 0 done, 1 refused by the scheduler (or keygen failed), 2 usage\n"
        "or configuration (a bad endpoint included, or one that is not an admin\n"
        "endpoint), 3 no answer from the scheduler.\n",
        status);
}

/* Print `s` as a JSON string. */
static void
json_str(const char *s)
{
    putchar('"');
    for (; s != NULL && *s != '\0'; s++) {
        unsigned char c = (unsigned char)*s;

        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

/* `s` for a table: control characters (below 0x20, and 0x7f) as '?', so
 * that a client's tag or a rank's host name cannot move the cursor, clear
 * the screen or forge table lines (--json escapes them instead).  Written
 * to buf (cut at size - 1 bytes); returns buf. */
static const char *
table_text(const char *s, char *buf, size_t size)
{
    size_t i;

    for (i = 0; s[i] != '\0' && i + 1 < size; i++)
        buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
    buf[i] = '\0';
    return buf;
}

/* Send m to the scheduler: 0, or 3 (printed) when it cannot be sent. */
static int
send_msg(struct ctl *c, const struct dsv4_msg *m)
{
    if (dsv4_zsock_send(c->sock, NULL, m, 0, NULL) != DSV4_OK) {
        fprintf(stderr, "dsv4ctl: send: %s\n", dsv4_errmsg());
        return 3;
    }
    return 0;
}

static int
send_cmd(struct ctl *c, int cmd, const char *target, uint32_t timeout_ms)
{
    struct dsv4_msg m;

    dsv4_msg_init(&m, DSV4_SUB_CTL, cmd);
    if (target != NULL) {
        m.u.drain.target = target;
        m.u.drain.timeout_ms = timeout_ms;
    }
    return send_msg(c, &m);
}

/* What the monitor's pending events say. */
enum mon_news {
    MON_NOTHING = 0,
    MON_DROPPED,                /* the connection ended */
    MON_HANDSHAKE_FAILED,       /* the peer refused the handshake (a CURVE key) */
};

/* The monitor's events of the connection and its handshake */
#define MON_EVENTS (ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | \
    ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | \
    ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

/* Read the monitor's pending events.  A connection counts once its ZMTP
 * handshake succeeded (libzmq reports it for the NULL mechanism too): a
 * socket that accepts and never greets (a listener held by a service
 * manager with no scheduler behind it) is no scheduler.  With CURVE a
 * scheduler that closes the connection during the handshake refused our
 * key (its server.pub is not ours), which is not a dropped connection. */
static enum mon_news
mon_read(struct ctl *c)
{
    enum mon_news news = MON_NOTHING;
    int ev;

    while ((ev = dsv4_zsock_mon_next(c->mon)) >= 0) {
        if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
            c->connected = true;
        else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL ||
                 ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                 ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ||
                 (ev == ZMQ_EVENT_DISCONNECTED && c->curve && !c->connected))
            news = MON_HANDSHAKE_FAILED;
        else if (ev == ZMQ_EVENT_DISCONNECTED && news == MON_NOTHING)
            news = MON_DROPPED;
    }
    return news;
}

/* Wait for one message; wait_ms < 0 = forever once connected (a drain's
 * answer), but CTL_TIMEOUT_MS at most for the connection itself, whatever
 * wait_ms: an endpoint nobody serves (a typo, no permission, the scheduler
 * down) is "no answer" in 5 s, not at the end of a drain's --timeout.
 * Heartbeats (CTL_HEARTBEAT_MS) end the wait on a scheduler that stops
 * answering once connected (stopped, its host gone).  0 ok, 3 no answer. */
static int
recv_msg(struct ctl *c, struct dsv4_msg *m, long wait_ms)
{
    zmq_pollitem_t it = { c->sock, 0, ZMQ_POLLIN, 0 };
    int64_t start = dsv4_now_ms();
    struct dsv4_perr pe;
    enum mon_news news;

    for (;;) {
        zmq_pollitem_t its[2] = { it, { c->mon, 0, ZMQ_POLLIN, 0 } };
        long now = (long)(dsv4_now_ms() - start), w = wait_ms < 0 ? -1 : wait_ms - now;
        long left = CTL_TIMEOUT_MS - now;
        bool bounded_by_connect = false;
        int rc;

        if (wait_ms >= 0 && w <= 0) {
            fprintf(stderr, "dsv4ctl: no answer from the scheduler\n");
            return 3;
        }
        if (c->mon != NULL && !c->connected) {
            if (left <= 0) {
                fprintf(stderr, "dsv4ctl: no answer from the scheduler (no connection "
                    "within %d ms)\n", CTL_TIMEOUT_MS);
                return 3;
            }
            if (w < 0 || left < w) {
                w = left;
                bounded_by_connect = true;
            }
        }
        rc = zmq_poll(its, c->mon != NULL ? 2 : 1, w);
        if (rc == 0 && (bounded_by_connect || wait_ms >= 0))
            continue;   /* the bounds, checked above */
        if (rc <= 0) {
            fprintf(stderr, "dsv4ctl: no answer from the scheduler\n");
            return 3;
        }
        /* an answer first: a scheduler that answered, then went away (a
         * drain's "drained", then its stop) did answer */
        while (its[0].revents & ZMQ_POLLIN) {
            if (dsv4_zsock_recv(c->sock, NULL, m, &pe, ZMQ_DONTWAIT) != DSV4_OK)
                break;
            if (m->sub == DSV4_SUB_CTL)
                return 0;
            if (m->sub != DSV4_SUB_NONE) {
                /* a client or rank endpoint's answer (an ERROR 400 "not a
                 * client message"): it was waited out as no answer */
                fprintf(stderr, "dsv4ctl: %s answers in %s, not DSV4A1: not the scheduler's "
                    "admin endpoint (admin_endpoint, --admin)\n", c->endpoint,
                    dsv4_proto_sig(m->sub));
                dsv4_msg_clear(m);
                return 2;
            }
            dsv4_msg_clear(m);
        }
        if (c->mon != NULL && (its[1].revents & ZMQ_POLLIN) &&
            (news = mon_read(c)) != MON_NOTHING) {
            if (news == MON_HANDSHAKE_FAILED && c->curve) {
                fprintf(stderr, "dsv4ctl: CURVE handshake failed: check server.pub in "
                    "key_dir (%s): it must be the scheduler's\n", c->key_dir);
                return 3;
            }
            if (news == MON_HANDSHAKE_FAILED) {
                fprintf(stderr, "dsv4ctl: the handshake with the scheduler failed (a "
                    "CURVE endpoint? dsv4ctl uses CURVE on tcp:// only)\n");
                return 3;
            }
            /* the scheduler that had the command went away (a restart):
             * no answer will come, whatever a new one does */
            fprintf(stderr, "dsv4ctl: the connection to the scheduler dropped while waiting "
                "for its answer (a scheduler restart, or one that stopped answering); the "
                "outcome is unknown: see dsv4ctl status\n");
            return 3;
        }
    }
}

static int
result(struct ctl *c, const struct dsv4_msg *m)
{
    const struct dsv4_error *e = &m->u.error;

    if (c->json) {
        printf("{\"code\": %u, \"message\": ", e->code);
        json_str(e->message);
        printf("}\n");
    } else if (e->code == DSV4_STATUS_OK) {
        printf("%s\n", e->message);
    } else {
        fprintf(stderr, "dsv4ctl: %u %s: %s\n", e->code, dsv4_proto_code_str(e->code),
            e->message);
    }
    return e->code == DSV4_STATUS_OK ? 0 : 1;
}

/* Accepted drafts in percent of those proposed; 0 without drafts. */
static double
mtp_rate(uint64_t drafts, uint64_t accepted)
{
    return drafts > 0 ? 100.0 * (double)accepted / (double)drafts : 0.0;
}

static void
print_status(struct ctl *c, const struct dsv4_ctl_status *st)
{
    if (c->json) {
        printf("{\"version\": ");
        json_str(st->version);
        printf(", \"uptime_ms\": %" PRIu64 ", \"draining\": %s, \"n_ranks\": %u, "
            "\"n_ranks_ready\": %u, \"n_queued\": %u, \"n_running\": %u, "
            "\"n_done\": %" PRIu64 ", \"n_failed\": %" PRIu64, st->uptime_ms,
            st->draining ? "true" : "false", st->n_ranks, st->n_ranks_ready, st->n_queued,
            st->n_running, st->n_done, st->n_failed);
        if (st->has_metrics)
            printf(", \"n_cancelled\": %" PRIu64 ", \"n_rejected\": %" PRIu64
                ", \"tokens_in\": %" PRIu64 ", \"tokens_out\": %" PRIu64
                ", \"handoffs\": %" PRIu64 ", \"reruns\": %" PRIu64
                ", \"rank_deaths\": %" PRIu64, st->n_cancelled, st->n_rejected,
                st->tokens_in, st->tokens_out, st->handoffs, st->reruns, st->rank_deaths);
        if (st->has_handoff)
            printf(", \"handoff_sum_us\": %" PRIu64 ", \"handoff_count\": %" PRIu64,
                st->handoff_sum_us, st->handoff_count);
        if (st->handoff_buckets != NULL) {
            printf(", \"handoff_buckets\": [");
            for (uint32_t i = 0; i < st->n_handoff_buckets; i++)
                printf("%s%" PRIu64, i > 0 ? ", " : "", st->handoff_buckets[i]);
            printf("]");
        }
        if (st->has_mtp)
            printf(", \"mtp_drafts\": %" PRIu64 ", \"mtp_accepted\": %" PRIu64,
                st->mtp_drafts, st->mtp_accepted);
        if (st->model != NULL) {
            printf(", \"model\": ");
            json_str(st->model);
        }
        printf("}\n");
        return;
    }
    printf("%-12s %s\n", "version", st->version);
    /* the model fingerprint every rank must run (READY `model`) */
    printf("%-12s %s\n", "model", st->model != NULL ? st->model : "- (none yet)");
    printf("%-12s %.1f s\n", "uptime", (double)st->uptime_ms / 1000.0);
    printf("%-12s %s\n", "draining", st->draining ? "yes" : "no");
    printf("%-12s %u (%u ready)\n", "ranks", st->n_ranks, st->n_ranks_ready);
    printf("%-12s %u queued, %u running\n", "requests", st->n_queued, st->n_running);
    printf("%-12s %" PRIu64 " done, %" PRIu64 " failed", "outcomes", st->n_done, st->n_failed);
    if (st->has_metrics)
        printf(", %" PRIu64 " cancelled, %" PRIu64 " rejected", st->n_cancelled,
            st->n_rejected);
    printf("\n");
    if (st->has_metrics) {
        printf("%-12s %" PRIu64 " in, %" PRIu64 " out\n", "tokens", st->tokens_in,
            st->tokens_out);
        printf("%-12s %" PRIu64 " handoffs, %" PRIu64 " re-runs, %" PRIu64 " rank deaths\n",
            "events", st->handoffs, st->reruns, st->rank_deaths);
    }
    if (st->has_handoff) {
        printf("%-12s %" PRIu64 " measured", "handoff", st->handoff_count);
        if (st->handoff_count > 0)
            printf(", mean %.3f ms", (double)st->handoff_sum_us / 1000.0 /
                (double)st->handoff_count);
        printf("\n");
    }
    if (st->has_mtp)
        printf("%-12s drafts %" PRIu64 ", accepted %" PRIu64 " (%.1f%%)\n", "mtp",
            st->mtp_drafts, st->mtp_accepted, mtp_rate(st->mtp_drafts, st->mtp_accepted));
}

static void
print_rank(struct ctl *c, const struct dsv4_ctl_rank *k)
{
    char name[48], mtp[64], rows[64] = "", graphs[64] = "";
    char host[DSV4_PROTO_MAX_HOST + 1];

    snprintf(name, sizeof(name), "%s@%u", dsv4_role_name(k->role), k->index);
    if (c->json) {
        printf("%s{\"name\": \"%s\", \"role\": \"%s\", \"index\": %u, \"group\": %u, "
            "\"group_rank\": %u, \"host\": ", c->n_items ? ",\n " : "", name,
            dsv4_role_name(k->role), k->index, k->group, k->group_rank);
        json_str(k->host);
        printf(", \"state\": \"%s\", \"active\": %u, \"capacity\": %u, "
            "\"last_seen_ms\": %" PRIu64, dsv4_rank_state_name(k->state), k->active,
            k->capacity, k->last_seen_ms);
        if (k->has_rank_active)
            printf(", \"rank_active\": %u", k->rank_active);
        if (k->has_mtp)
            printf(", \"mtp_drafts\": %" PRIu64 ", \"mtp_accepted\": %" PRIu64,
                k->mtp_drafts, k->mtp_accepted);
        printf(", \"placed\": %" PRIu64, k->placed);
        if (k->burst)
            printf(", \"burst\": true");
        if (k->device != NULL) {
            printf(", \"device\": ");
            json_str(k->device);
        }
        if (k->has_call_rows)
            printf(", \"call_rows\": %u, \"call_rows_full\": %u", k->call_rows,
                k->call_rows_full);
        if (k->has_graphs_refused)
            printf(", \"graphs_refused\": %u", k->graphs_refused);
        if (k->model != NULL) {
            printf(", \"model\": ");
            json_str(k->model);
        }
        printf("}");
    } else {
        /* MTP: "accepted/drafts (rate)", "-" for a rank without MTP */
        if (k->has_mtp)
            snprintf(mtp, sizeof(mtp), "%" PRIu64 "/%" PRIu64 " (%.1f%%)", k->mtp_accepted,
                k->mtp_drafts, mtp_rate(k->mtp_drafts, k->mtp_accepted));
        else
            snprintf(mtp, sizeof(mtp), "-");
        /* DEVICE: the GPU's UUID cut to "GPU-" and its first 8 digits
         * (nvidia-smi -L shows the whole; --json gives it whole), "-" for
         * a rank that did not say (CPU backend) */
        /* a prefill rank whose warm-up lowered its rows per call says so */
        if (k->has_call_rows && k->call_rows < k->call_rows_full)
            snprintf(rows, sizeof(rows), "  rows %u of %u a call", k->call_rows,
                k->call_rows_full);
        /* a decode rank whose steps of some batch sizes run without a CUDA
         * graph (no device memory was left to make one) says so */
        if (k->has_graphs_refused && k->graphs_refused > 0)
            snprintf(graphs, sizeof(graphs), "  %u batch size%s without a graph",
                k->graphs_refused, k->graphs_refused == 1 ? "" : "s");
        if (c->n_items == 0)
            printf("%-12s %-7s %-16s %-9s %7s %9s %9s %10s  %-12s  %s\n", "RANK", "GROUP",
                "HOST", "STATE", "ACTIVE", "CAPACITY", "PLACED", "LAST_SEEN", "DEVICE", "MTP");
        printf("%-12s %3u/%-3u %-16.16s %-9s %7u %9u %9" PRIu64 " %8.1fs  %-12.12s  %s%s%s%s\n",
            name, k->group, k->group_rank, table_text(k->host, host, sizeof(host)),
            dsv4_rank_state_name(k->state), k->active,
            k->capacity, k->placed, (double)k->last_seen_ms / 1000.0,
            k->device != NULL && k->device[0] != '\0' ? k->device : "-", mtp,
            k->burst ? "  burst prefill" : "", rows, graphs);
    }
    c->n_items++;
}

/* Print an optional group id as JSON: the number, or null. */
static void
json_group(const char *key, bool has, uint32_t id)
{
    if (has)
        printf(", \"%s\": %u", key, id);
    else
        printf(", \"%s\": null", key);
}

static void
print_request(struct ctl *c, const struct dsv4_ctl_request *r)
{
    char where[48], tag[DSV4_PROTO_MAX_TAG + 1];

    if (c->json) {
        printf("%s{\"req\": %" PRIu64 ", \"state\": \"%s\", \"prompt_tokens\": %u, "
            "\"completion_tokens\": %u, \"age_ms\": %" PRIu64 ", \"reruns\": %u",
            c->n_items ? ",\n " : "", r->req, dsv4_req_state_name(r->state),
            r->prompt_tokens, r->completion_tokens, r->age_ms, r->reruns);
        json_group("prefill_group", r->has_prefill_group, r->prefill_group);
        json_group("decode_group", r->has_decode_group, r->decode_group);
        printf(", \"tag\": ");
        if (r->tag != NULL)
            json_str(r->tag);
        else
            printf("null");
        printf("}");
    } else {
        /* WHERE: the groups holding it, "prefill/P>decode/D" while its prompt
         * runs (the decode slot is taken at placement), "-" while queued */
        if (r->has_prefill_group && r->has_decode_group)
            snprintf(where, sizeof(where), "prefill/%u>decode/%u", r->prefill_group,
                r->decode_group);
        else if (r->has_decode_group)
            snprintf(where, sizeof(where), "decode/%u", r->decode_group);
        else if (r->has_prefill_group)
            snprintf(where, sizeof(where), "prefill/%u", r->prefill_group);
        else
            snprintf(where, sizeof(where), "-");
        if (c->n_items == 0)
            printf("%-20s %-10s %-22s %8s %10s %6s %8s  %s\n", "REQ", "STATE", "WHERE",
                "PROMPT", "COMPLETION", "RERUNS", "AGE", "TAG");
        printf("%-20" PRIu64 " %-10s %-22s %8u %10u %6u %7.1fs  %s\n", r->req,
            dsv4_req_state_name(r->state), where, r->prompt_tokens, r->completion_tokens,
            r->reruns, (double)r->age_ms / 1000.0,
            r->tag != NULL ? table_text(r->tag, tag, sizeof(tag)) : "-");
    }
    c->n_items++;
}

/* Send a listing command and print items until its _END. */
static int
listing(struct ctl *c, int cmd, int item, int end)
{
    struct dsv4_msg m;
    int rc;

    if ((rc = send_cmd(c, cmd, NULL, 0)) != 0)
        return rc;
    /* the JSON array's "[" with its first item or its end: a listing that
     * fails prints nothing on stdout, not half an array */
    for (;;) {
        if ((rc = recv_msg(c, &m, CTL_TIMEOUT_MS)) != 0)
            return rc;
        if (m.cmd == DSV4_CTL_RESULT) {
            rc = result(c, &m);
            dsv4_msg_clear(&m);
            return rc != 0 ? rc : 1;
        }
        if (m.cmd == DSV4_CTL_STATUS && cmd == DSV4_CTL_SHOW_STATUS) {
            print_status(c, &m.u.status);
            dsv4_msg_clear(&m);
            return 0;
        }
        if (m.cmd == item && c->json && c->n_items == 0)
            printf("[");
        if (m.cmd == item && item == DSV4_CTL_RANK)
            print_rank(c, &m.u.rank);
        else if (m.cmd == item && item == DSV4_CTL_REQUEST)
            print_request(c, &m.u.request);
        else if (m.cmd == end) {
            uint32_t n = m.u.count.count;

            if (c->json)
                printf("%s]\n", c->n_items == 0 ? "[" : "");
            else if (c->n_items == 0)
                printf("(none)\n");
            dsv4_msg_clear(&m);
            if (n > (uint32_t)c->n_items) {   /* the scheduler could not queue them all */
                fprintf(stderr, "dsv4ctl: listing cut short: %d of %" PRIu32 " items arrived\n",
                        c->n_items, n);
                return 1;
            }
            return 0;
        }
        dsv4_msg_clear(&m);
    }
}

/* Wait up to wait_ms (< 0: forever) for the command's RESULT and print it.
 * Exit status as result(); 3 for no answer or another message. */
static int
await_result(struct ctl *c, long wait_ms)
{
    struct dsv4_msg m;
    int rc;

    if ((rc = recv_msg(c, &m, wait_ms)) != 0)
        return rc;
    if (m.cmd != DSV4_CTL_RESULT) {
        fprintf(stderr, "dsv4ctl: unexpected %s\n", dsv4_proto_cmd_name(m.sub, m.cmd));
        rc = 3;
    } else {
        rc = result(c, &m);
    }
    dsv4_msg_clear(&m);
    return rc;
}

/* Send command `cmd` (req: CANCEL's request, the scheduler's id) and wait
 * for its RESULT.  Exit status as await_result(). */
static int
command(struct ctl *c, int cmd, uint64_t req)
{
    struct dsv4_msg m;
    int rc;

    dsv4_msg_init(&m, DSV4_SUB_CTL, cmd);
    if (cmd == DSV4_CTL_CANCEL)
        m.u.ref.req = req;
    if ((rc = send_msg(c, &m)) != 0)
        return rc;
    return await_result(c, CTL_TIMEOUT_MS);
}

static int
drain(struct ctl *c, int cmd, const char *target, double timeout_s)
{
    /* a limit under 1 ms is 1 ms, not 0 (none) */
    uint32_t ms = timeout_s > 0 ? (uint32_t)(timeout_s * 1000.0) : 0;

    if (timeout_s > 0 && ms == 0)
        ms = 1;
    int rc;

    if ((rc = send_cmd(c, cmd, target, ms)) != 0)
        return rc;
    /* The scheduler answers at the timeout; wait a little longer for it. */
    return await_result(c, cmd == DSV4_CTL_UNDRAIN ? CTL_TIMEOUT_MS :
        ms > 0 ? (long)ms + CTL_TIMEOUT_MS : -1);
}

int
main(int argc, char *argv[])
{
    static const struct option longopts[] = {
        { "admin", required_argument, NULL, 'a' },
        { "json", no_argument, NULL, 'j' },
        { "timeout", required_argument, NULL, 't' },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };
    struct dsv4_zsock_cfg zc;
    struct dsv4_conf conf;
    struct ctl c = { 0 };
    const char *endpoint = NULL, *path = NULL, *cmd, *target = NULL, *env_ep;
    char *end;
    double timeout_s = 0;
    uint64_t req = 0;
    int ch, rc;

    /* GNU getopt permutes: options may follow the command too
     * ("drain decode@0 --timeout 30"). */
    while ((ch = getopt_long(argc, argv, "a:f:jt:h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'a': endpoint = optarg; break;
        case 'f': path = optarg; break;
        case 'j': c.json = true; break;
        case 't':
            errno = 0;
            timeout_s = strtod(optarg, &end);
            if (errno != 0 || end == optarg || *end != '\0' || !(timeout_s >= 0) ||
                timeout_s > DSV4_PROTO_MAX_TIMEOUT_MS / 1000) {
                fprintf(stderr, "dsv4ctl: --timeout: %s is not a number of seconds in "
                        "0 ... %u\n", optarg, DSV4_PROTO_MAX_TIMEOUT_MS / 1000);
                usage(2);
            }
            break;
        case 'h': usage(0);
        case DSV4_CLI_OPT_VERSION: dsv4_cli_version("dsv4ctl");
        default: usage(2);
        }
    }
    if (optind >= argc)
        usage(2);
    cmd = argv[optind++];
    /* named at once, before the configuration and the socket (whose
     * faults would otherwise be reported first) */
    {
        static const char *const cmds[] = { "status", "ranks", "requests", "drain",
            "undrain", "cancel", "reload", "keygen" };
        bool known = false;

        for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
            known = known || strcmp(cmd, cmds[i]) == 0;
        if (!known) {
            fprintf(stderr, "dsv4ctl: unknown command '%s'\n", cmd);
            usage(2);
        }
    }
    if (optind < argc) {
        if (strcmp(cmd, "drain") != 0 && strcmp(cmd, "undrain") != 0 &&
            strcmp(cmd, "keygen") != 0 && strcmp(cmd, "cancel") != 0) {
            fprintf(stderr, "dsv4ctl: %s takes no argument ('%s')\n", cmd, argv[optind]);
            usage(2);
        }
        target = argv[optind++];
    }
    if (optind != argc) {
        fprintf(stderr, "dsv4ctl: %s: one argument at most ('%s' is one too many)\n", cmd,
                argv[optind]);
        usage(2);
    }
    if (timeout_s > 0 && strcmp(cmd, "drain") != 0) {
        fprintf(stderr, "dsv4ctl: --timeout is drain's; %s has none\n", cmd);
        usage(2);
    }
    if ((strcmp(cmd, "drain") == 0 || strcmp(cmd, "undrain") == 0) && target != NULL &&
        strlen(target) > DSV4_PROTO_MAX_TARGET) {
        /* the protocol's bound (docs/protocol.md §7): the encoder refused it
         * and the command ended as "no answer" (3) */
        fprintf(stderr, "dsv4ctl: %s: the target is %zu bytes, at most %d (RANK is "
                "prefill@N or decode@N, or all)\n", cmd, strlen(target), DSV4_PROTO_MAX_TARGET);
        usage(2);
    }
    if (strcmp(cmd, "cancel") == 0) {
        /* the scheduler's request id: a decimal number of 1 ... 2^64 - 1 */
        errno = 0;
        if (target == NULL || target[0] < '0' || target[0] > '9' ||
            (req = strtoull(target, &end, 10)) == 0 || errno != 0 || *end != '\0') {
            fprintf(stderr, "dsv4ctl: cancel: %s is not a request id (a number from "
                    "`dsv4ctl requests`)\n", target != NULL ? target : "(none)");
            usage(2);
        }
    }
    log_init(0);
    log_procinit("dsv4ctl");
    if (endpoint == NULL && (env_ep = getenv("DSV4_ADMIN_ENDPOINT")) != NULL &&
        env_ep[0] != '\0')
        endpoint = env_ep;
    /* The file also gives key_dir (a tcp:// endpoint's server key).  One
     * that does not load stops keygen (it would write the keys elsewhere);
     * every other command goes on with the defaults, saying so: the
     * scheduler keeps serving on a file it cannot reload, and `reload`
     * must reach it to report that (exit 1).  Nothing of the broken file
     * is used: a key read before its bad line may be one a later line
     * would have changed. */
    dsv4_conf_defaults(&conf);
    if (path != NULL || access(DSV4_CONF_DEFAULT_PATH, R_OK) == 0) {
        if (dsv4_conf_load(&conf, path != NULL ? path : DSV4_CONF_DEFAULT_PATH,
                           DSV4_CONF_ROLE_NONE) != DSV4_OK) {
            if (strcmp(cmd, "keygen") == 0) {
                fprintf(stderr, "dsv4ctl: %s\n", dsv4_errmsg());
                return 2;
            }
            dsv4_conf_defaults(&conf);
            fprintf(stderr, "dsv4ctl: warning: %s; going on with the defaults: key_dir %s, "
                "admin endpoint %s%s\n", dsv4_errmsg(), conf.key_dir,
                endpoint != NULL ? endpoint : conf.admin_endpoint,
                endpoint != NULL ? "" : " (--admin names another)");
        }
    }
    if (endpoint == NULL)
        endpoint = conf.admin_endpoint;
    if (strcmp(cmd, "keygen") == 0) {
        /* Every host of a deployment gets a copy of server.pub; server.key
         * stays on the scheduler's host (docs/operations.md). */
        const char *dir = target != NULL ? target : conf.key_dir;
        if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
            fprintf(stderr, "dsv4ctl: keygen: %s: %s\n", dir, strerror(errno));
            return 1;
        }
        if (dsv4_zsock_keygen(dir, "server") != DSV4_OK) {
            fprintf(stderr, "dsv4ctl: keygen: %s\n", dsv4_errmsg());
            return 1;
        }
        printf("%s/server.key and %s/server.pub written\n", dir, dir);
        return 0;
    }
    if (target == NULL)
        target = "all";
    if ((c.zctx = zmq_ctx_new()) == NULL)
        return 3;
    dsv4_zsock_cfg_init(&zc);
    zc.endpoint = endpoint;
    zc.key_dir = conf.key_dir;
    zc.type = ZMQ_DEALER;
    zc.heartbeat_ms = CTL_HEARTBEAT_MS;
    /* attached before the connect: an event before it would be lost */
    zc.mon = &c.mon;
    zc.mon_events = MON_EVENTS;
    if ((c.sock = dsv4_zsock_open(c.zctx, &zc, NULL)) == NULL) {
        fprintf(stderr, "dsv4ctl: %s: %s\n", endpoint, dsv4_errmsg());
        zmq_ctx_term(c.zctx);
        return 2;   /* a bad endpoint: configuration */
    }
    /* Best effort: without the monitor a wait without a limit cannot
     * notice a scheduler restart. */
    c.curve = strncmp(endpoint + (endpoint[0] == '>'), "tcp://", 6) == 0;
    c.key_dir = conf.key_dir;
    c.endpoint = endpoint;
    if (strcmp(cmd, "status") == 0)
        rc = listing(&c, DSV4_CTL_SHOW_STATUS, 0, 0);
    else if (strcmp(cmd, "ranks") == 0)
        rc = listing(&c, DSV4_CTL_SHOW_RANKS, DSV4_CTL_RANK, DSV4_CTL_RANKS_END);
    else if (strcmp(cmd, "requests") == 0)
        rc = listing(&c, DSV4_CTL_SHOW_REQUESTS, DSV4_CTL_REQUEST, DSV4_CTL_REQUESTS_END);
    else if (strcmp(cmd, "drain") == 0)
        rc = drain(&c, DSV4_CTL_DRAIN, target, timeout_s);
    else if (strcmp(cmd, "undrain") == 0)
        rc = drain(&c, DSV4_CTL_UNDRAIN, target, 0);
    else if (strcmp(cmd, "cancel") == 0)
        rc = command(&c, DSV4_CTL_CANCEL, req);
    else if (strcmp(cmd, "reload") == 0)
        rc = command(&c, DSV4_CTL_RELOAD, 0);
    else
        usage(2);
    dsv4_zsock_mon_close(c.sock, c.mon);
    dsv4_zsock_close(c.sock);
    zmq_ctx_term(c.zctx);
    return rc;
}
