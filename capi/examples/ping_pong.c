/* ping_pong.c: one-way latency of SOCK_SEQPACKET messages over exs, as `exs ping` measures it (seed 002,
 * Figure 10): the client posts a receive, sends a message and waits for both events; the server echoes every
 * message; the one-way time is half the round trip. The server is a child process (forked before either side
 * calls exs_init), as `exs ping` runs its server.
 *
 *   cc ping_pong.c $(pkg-config --cflags --libs exs) -o ping_pong
 *   EXS_BACKEND=fabric ./ping_pong [-n COUNT] [-s SIZE] [-w busy|adaptive|block] [-j] [ADDR]
 *
 * Messages go as immediate data (inside the advertisement, seed 002 4.1), the queues busy-poll: `exs ping`'s
 * defaults. -j prints one JSON line (median_us, mean_us) instead of text.
 */
#define _POSIX_C_SOURCE 200809L
#include <exs.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct opts {
    long count;
    long size;
    int wait;
    int json;
    const char *ip;
};

static void die(const char *who, const char *what)
{
    fprintf(stderr, "ping_pong %s: %s: %s\n", who, what, strerror(errno));
    exit(1);
}

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* Waits for `n` events (seed 004: one wake-up for the batch) and checks that they succeeded. */
static void wait_events(exs_qhandle_t qh, int n, const char *who)
{
    exs_event_t ev[2];
    struct timespec patience = {30, 0};
    int got = exs_qdequeue(qh, ev, -n, &patience), i;
    if (got < 0)
        die(who, "exs_qdequeue");
    if (got < n) {
        fprintf(stderr, "ping_pong %s: no answer in 30 s\n", who);
        exit(1);
    }
    for (i = 0; i < got; i++) {
        if (ev[i].exs_evt_errno != 0) {
            errno = ev[i].exs_evt_errno;
            die(who, "an operation failed");
        }
    }
}

/* A seqpacket socket whose messages of `size` bytes travel as immediate data. */
static int socket_for(const struct opts *o, const char *who)
{
    int s = exs_socket(AF_INET, SOCK_SEQPACKET, 0);
    if (s < 0)
        die(who, "exs_socket");
    if (exs_fcntl(s, EXS_F_SET_SMALL_PACKET_MAX_SIZE, (int)o->size) < 0)
        die(who, "exs_fcntl");
    return s;
}

/* The echo side: accepts one connection and returns every message until the client closes. */
static int serve(const struct opts *o, int port_pipe)
{
    struct sockaddr_in addr;
    socklen_t alen = sizeof addr;
    exs_qhandle_t qh;
    exs_mhandle_t mh;
    exs_event_t ev;
    char *buf;
    int l, s;
    uint16_t port;

    if (exs_init(EXS_VERSION) < 0)
        die("server", "exs_init");
    qh = exs_qcreate(16);
    if (qh < 0 || exs_qwait_mode(qh, o->wait) < 0)
        die("server", "exs_qcreate");
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    inet_pton(AF_INET, o->ip, &addr.sin_addr);
    l = socket_for(o, "server");
    if (exs_bind(l, (struct sockaddr *)&addr, sizeof addr) < 0 || exs_listen(l, 1) < 0 ||
        exs_getsockname(l, (struct sockaddr *)&addr, &alen) < 0 || exs_accept(l, qh, NULL) < 0)
        die("server", "listening");
    port = addr.sin_port;
    if (write(port_pipe, &port, sizeof port) != (ssize_t)sizeof port)
        die("server", "write");
    close(port_pipe);
    if (exs_qdequeue(qh, &ev, 1, NULL) != 1 || ev.exs_evt_errno != 0)
        die("server", "accept");
    s = ev.exs_evt_accepted;
    buf = (char *)calloc(1, (size_t)o->size);
    mh = exs_mregister(buf, (size_t)o->size, EXS_ACCESS_READ | EXS_ACCESS_WRITE);
    if (buf == NULL || mh < 0)
        die("server", "exs_mregister");
    for (;;) {
        if (exs_recv(s, buf, (size_t)o->size, 0, mh, qh, NULL) < 0)
            die("server", "exs_recv");
        if (exs_qdequeue(qh, &ev, 1, NULL) != 1)
            die("server", "exs_qdequeue");
        if (ev.exs_evt_errno != 0 || (ev.exs_evt_flags & EXS_EOF))
            break; /* the client closed */
        if (exs_send(s, buf, (size_t)ev.exs_evt_bytes, 0, mh, qh, NULL) < 0)
            die("server", "exs_send");
        wait_events(qh, 1, "server");
    }
    exs_close(s);
    exs_close(l);
    exs_mderegister(mh);
    free(buf);
    return 0;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The pinging side: one-way times of `count` pings after a 10% warm-up, like `exs ping`. */
static int ping(const struct opts *o, uint16_t port)
{
    struct sockaddr_in addr;
    long warm = o->count / 10 + 1, i, n = o->count;
    double *samples = (double *)malloc((size_t)n * sizeof(double)), sum = 0;
    char *out = (char *)calloc(1, (size_t)o->size), *back = (char *)calloc(1, (size_t)o->size);
    exs_mhandle_t mout, mback;
    exs_qhandle_t qh;
    int s;

    if (samples == NULL || out == NULL || back == NULL)
        die("client", "malloc");
    if (exs_init(EXS_VERSION) < 0)
        die("client", "exs_init");
    qh = exs_qcreate(16);
    if (qh < 0 || exs_qwait_mode(qh, o->wait) < 0)
        die("client", "exs_qcreate");
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    addr.sin_port = port;
    inet_pton(AF_INET, o->ip, &addr.sin_addr);
    s = socket_for(o, "client");
    if (exs_connect(s, (struct sockaddr *)&addr, sizeof addr, qh, NULL) < 0)
        die("client", "exs_connect");
    wait_events(qh, 1, "client");
    memset(out, 0x42, (size_t)o->size);
    mout = exs_mregister(out, (size_t)o->size, EXS_ACCESS_READ);
    mback = exs_mregister(back, (size_t)o->size, EXS_ACCESS_WRITE);
    if (mout < 0 || mback < 0)
        die("client", "exs_mregister");
    for (i = 0; i < warm + n; i++) {
        double t0 = now_us(), dt;
        if (exs_recv(s, back, (size_t)o->size, 0, mback, qh, NULL) < 0)
            die("client", "exs_recv");
        if (exs_send(s, out, (size_t)o->size, 0, mout, qh, NULL) < 0)
            die("client", "exs_send");
        wait_events(qh, 2, "client");
        dt = (now_us() - t0) / 2;
        if (i >= warm) {
            samples[i - warm] = dt;
            sum += dt;
        }
    }
    exs_close(s);
    qsort(samples, (size_t)n, sizeof(double), by_value);
    if (o->json)
        printf("{\"tool\": \"exs-c-ping\", \"size\": %ld, \"count\": %ld, \"median_us\": %.3f, \"mean_us\": %.3f}\n",
               o->size, n, samples[n / 2], sum / (double)n);
    else
        printf("ping_pong: %ld B SOCK_SEQPACKET messages, %ld pings: median one-way %.2f us, mean %.2f us\n",
               o->size, n, samples[n / 2], sum / (double)n);
    exs_mderegister(mout);
    exs_mderegister(mback);
    free(samples);
    free(out);
    free(back);
    return 0;
}

int main(int argc, char **argv)
{
    struct opts o;
    int fds[2], c, status;
    uint16_t port;
    pid_t child;

    o.count = 2000;
    o.size = 8;
    o.wait = EXS_WAIT_BUSY;
    o.json = 0;
    while ((c = getopt(argc, argv, "n:s:w:j")) != -1) {
        switch (c) {
        case 'n': o.count = atol(optarg); break;
        case 's': o.size = atol(optarg); break;
        case 'w':
            o.wait = strcmp(optarg, "adaptive") == 0 ? EXS_WAIT_ADAPTIVE
                   : strcmp(optarg, "block") == 0    ? EXS_WAIT_BLOCK
                                                     : EXS_WAIT_BUSY;
            break;
        case 'j': o.json = 1; break;
        default:
            fprintf(stderr, "usage: ping_pong [-n COUNT] [-s SIZE] [-w busy|adaptive|block] [-j] [ADDR]\n");
            return 2;
        }
    }
    o.ip = optind < argc ? argv[optind] : getenv("EXS_ADDR") ? getenv("EXS_ADDR") : "127.0.0.1";
    if (o.count < 10 || o.size < 1 || o.size > 32768) {
        fprintf(stderr, "ping_pong: -n at least 10, -s 1..32768 (immediate data)\n");
        return 2;
    }
    /* Fork first: a process that opened RDMA resources should not fork. */
    if (pipe(fds) < 0)
        die("main", "pipe");
    child = fork();
    if (child < 0)
        die("main", "fork");
    if (child == 0) {
        close(fds[0]);
        return serve(&o, fds[1]);
    }
    close(fds[1]);
    if (read(fds[0], &port, sizeof port) != (ssize_t)sizeof port) {
        fprintf(stderr, "ping_pong: the server did not start\n");
        return 1;
    }
    close(fds[0]);
    c = ping(&o, port);
    if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "ping_pong: the server failed\n");
        return 1;
    }
    return c;
}
