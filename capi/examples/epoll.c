/* epoll.c: an exs event queue in an epoll loop, beside the program's other descriptors.
 *
 * exs_qfd gives a descriptor that is readable while the queue holds events (level-triggered). The loop sleeps
 * in epoll_wait on it and on a timerfd (standing for the program's other work: sockets, pipes, timers), and
 * takes the queue's events without waiting (a zero timeout) whenever it is readable. Nothing else drives exs:
 * its progress thread makes the descriptor readable. A client and a server in this program bounce a
 * SOCK_SEQPACKET message back and forth ROUNDS times (1000, or -n ROUNDS), each message one more than the last.
 *
 *   cc epoll.c $(pkg-config --cflags --libs exs) -o epoll
 *   EXS_BACKEND=fabric ./epoll [-n ROUNDS] [ADDR]
 */
#define _GNU_SOURCE
#include <exs.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

enum { BATCH = 8 };
enum { CLIENT = 1, SERVER = 2 };
#define CTX(who) ((void *)(intptr_t)(who))

static void die(const char *what)
{
    fprintf(stderr, "epoll: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void check(int rc, const char *what)
{
    if (rc < 0)
        die(what);
}

struct side {
    int fd;
    uint64_t *msg;
    exs_mhandle_t mh;
};

static void side_init(struct side *s, int fd)
{
    s->fd = fd;
    s->msg = (uint64_t *)calloc(1, sizeof(uint64_t));
    if (s->msg == NULL)
        die("calloc");
    s->mh = exs_mregister(s->msg, sizeof(uint64_t), EXS_ACCESS_READ | EXS_ACCESS_WRITE);
    check(s->mh, "exs_mregister");
}

int main(int argc, char **argv)
{
    const char *ip;
    struct sockaddr_in addr;
    socklen_t alen = sizeof addr;
    struct epoll_event ee, ready[2];
    struct itimerspec tick = {{0, 50000000}, {0, 50000000}};
    struct timespec zero = {0, 0};
    struct side client, server;
    exs_qhandle_t qh;
    int listener, cfd, ep, tfd, qfd, n, pending = 2, ticks = 0, wakeups = 0;
    uint64_t last = 0, rounds = 1000;

    while ((n = getopt(argc, argv, "n:")) != -1) {
        char *end = NULL;
        errno = 0;
        if (n == 'n' && optarg[0] >= '0' && optarg[0] <= '9')
            rounds = strtoull(optarg, &end, 10);
        if (n != 'n' || end == NULL || *end != '\0' || errno == ERANGE || rounds < 1) {
            fprintf(stderr, "usage: epoll [-n ROUNDS (1 or more)] [ADDR]\n");
            return 2;
        }
    }
    ip = optind < argc ? argv[optind] : getenv("EXS_ADDR") ? getenv("EXS_ADDR") : "127.0.0.1";
    check(exs_init(EXS_VERSION), "exs_init");
    qh = exs_qcreate(16);
    check(qh, "exs_qcreate");
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    if (inet_pton(AF_INET, ip, &addr.sin_addr) != 1) {
        fprintf(stderr, "epoll: %s is not an IPv4 address\n", ip);
        return 1;
    }
    listener = exs_socket(AF_INET, SOCK_SEQPACKET, 0);
    check(listener, "exs_socket");
    check(exs_bind(listener, (struct sockaddr *)&addr, sizeof addr), "exs_bind");
    check(exs_listen(listener, 1), "exs_listen");
    check(exs_getsockname(listener, (struct sockaddr *)&addr, &alen), "exs_getsockname");
    check(exs_accept(listener, qh, CTX(SERVER)), "exs_accept");
    cfd = exs_socket(AF_INET, SOCK_SEQPACKET, 0);
    check(cfd, "exs_socket");
    check(exs_connect(cfd, (struct sockaddr *)&addr, sizeof addr, qh, CTX(CLIENT)), "exs_connect");
    side_init(&client, cfd);
    server.fd = -1;

    ep = epoll_create1(EPOLL_CLOEXEC);
    qfd = exs_qfd(qh);
    tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
    check(ep, "epoll_create1");
    check(qfd, "exs_qfd");
    check(tfd, "timerfd_create");
    check(timerfd_settime(tfd, 0, &tick, NULL), "timerfd_settime");
    memset(&ee, 0, sizeof ee);
    ee.events = EPOLLIN;
    ee.data.fd = qfd;
    check(epoll_ctl(ep, EPOLL_CTL_ADD, qfd, &ee), "epoll_ctl");
    ee.data.fd = tfd;
    check(epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ee), "epoll_ctl");

    while (last < rounds) {
        int i;
        n = epoll_wait(ep, ready, 2, 10000);
        if (n < 0 && errno == EINTR)
            continue;
        check(n, "epoll_wait");
        if (n == 0) {
            fprintf(stderr, "epoll: nothing happened for 10 s\n");
            return 1;
        }
        for (i = 0; i < n; i++) {
            exs_event_t evs[BATCH];
            int got, j;
            if (ready[i].data.fd == tfd) {
                uint64_t expirations;
                if (read(tfd, &expirations, sizeof expirations) == (ssize_t)sizeof expirations)
                    ticks += (int)expirations;
                continue;
            }
            wakeups++;
            got = exs_qdequeue(qh, evs, BATCH, &zero);
            check(got, "exs_qdequeue");
            pending -= got;
            for (j = 0; j < got; j++) {
                exs_event_t *ev = &evs[j];
                struct side *s = (intptr_t)ev->exs_evt_context == CLIENT ? &client : &server;
                if (ev->exs_evt_errno != 0) {
                    errno = ev->exs_evt_errno;
                    die("an operation failed");
                }
                if (ev->exs_evt_type == EXS_EVT_ACCEPT) {
                    side_init(&server, ev->exs_evt_accepted);
                    check(exs_recv(server.fd, server.msg, sizeof(uint64_t), 0, server.mh, qh, CTX(SERVER)),
                          "exs_recv");
                    pending++;
                } else if (ev->exs_evt_type == EXS_EVT_CONNECT) {
                    *client.msg = 1;
                    check(exs_send(client.fd, client.msg, sizeof(uint64_t), 0, client.mh, qh, CTX(CLIENT)),
                          "exs_send");
                    pending++;
                } else if (ev->exs_evt_type == EXS_EVT_SEND) {
                    /* The message is on its way and its memory free: wait for the answer in it. */
                    check(exs_recv(s->fd, s->msg, sizeof(uint64_t), 0, s->mh, qh, CTX(s == &client ? CLIENT : SERVER)),
                          "exs_recv");
                    pending++;
                } else if (ev->exs_evt_type == EXS_EVT_RECV) {
                    if (ev->exs_evt_bytes != (ssize_t)sizeof(uint64_t) || !(ev->exs_evt_flags & MSG_EOR) ||
                        *s->msg != last + 1) {
                        fprintf(stderr, "epoll: got %llu, expected %llu\n", (unsigned long long)*s->msg,
                                (unsigned long long)(last + 1));
                        return 1;
                    }
                    last = *s->msg;
                    if (last == rounds)
                        break;
                    *s->msg = last + 1;
                    check(exs_send(s->fd, s->msg, sizeof(uint64_t), 0, s->mh, qh, CTX(s == &client ? CLIENT : SERVER)),
                          "exs_send");
                    pending++;
                }
            }
        }
    }
    /* What is still in flight (the last sender's receive, perhaps its send) ends with the closes: a receive with
     * ECANCELED, a send once delivered. The memory is free once every event is in. */
    check(exs_close(client.fd), "exs_close");
    check(exs_close(server.fd), "exs_close");
    check(exs_close(listener), "exs_close");
    for (; pending > 0; pending--) {
        exs_event_t ev;
        struct timespec patience = {10, 0};
        if (exs_qdequeue(qh, &ev, 1, &patience) != 1)
            die("exs_qdequeue after the close");
    }
    check(exs_mderegister(client.mh), "exs_mderegister");
    check(exs_mderegister(server.mh), "exs_mderegister");
    free(client.msg);
    free(server.msg);
    close(tfd);
    close(ep);
    printf("epoll: %llu messages bounced, %d wake-ups of epoll_wait for the queue, %d timer ticks beside\n",
           (unsigned long long)rounds, wakeups, ticks);
    return 0;
}
