/* persistent.c: a persistent send read with exs_recv_offset (seed 002, sections 4.2 and 4.4).
 *
 * A "simulation" publishes its state, an array of 4096 counters, with one persistent send: from then on the peer
 * pulls any part of it, at any time, by RDMA read, and the simulation's CPU takes no part (no event, no call).
 * The simulation keeps updating its memory in place; each read sees the values of that moment. Here both sides
 * live in one program: the simulation updates its counters between the reads of the display side, which
 * samples a few slices with exs_recv_offset and checks what it sees. Then the simulation ends its persistent
 * send (EXS_F_END_PERSISTENT), whose event comes once the peer has let go.
 *
 *   cc persistent.c $(pkg-config --cflags --libs exs) -o persistent
 *   EXS_BACKEND=fabric ./persistent [ADDR]
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

enum { COUNTERS = 4096, SLICE = 256 };
#define STATE_BYTES (COUNTERS * sizeof(uint32_t))

static void die(const char *what)
{
    fprintf(stderr, "persistent: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void check(int rc, const char *what)
{
    if (rc < 0)
        die(what);
}

/* Waits for one event and checks that it succeeded; returns it. */
static exs_event_t next(exs_qhandle_t qh)
{
    exs_event_t ev;
    struct timespec patience = {30, 0};
    if (exs_qdequeue(qh, &ev, 1, &patience) != 1)
        die("exs_qdequeue (no event in 30 s?)");
    if (ev.exs_evt_errno != 0) {
        errno = ev.exs_evt_errno;
        die("an operation failed");
    }
    return ev;
}

/* A connected pair: `*sim` accepted on a listener, `*display` connected to it. */
static void connect_pair(const char *ip, exs_qhandle_t qh, int *listener, int *sim, int *display)
{
    struct sockaddr_in addr;
    socklen_t alen = sizeof addr;
    int i;
    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    if (inet_pton(AF_INET, ip, &addr.sin_addr) != 1) {
        fprintf(stderr, "persistent: %s is not an IPv4 address\n", ip);
        exit(1);
    }
    *listener = exs_socket(AF_INET, SOCK_SEQPACKET, 0);
    check(*listener, "exs_socket");
    check(exs_bind(*listener, (struct sockaddr *)&addr, sizeof addr), "exs_bind");
    check(exs_listen(*listener, 1), "exs_listen");
    check(exs_getsockname(*listener, (struct sockaddr *)&addr, &alen), "exs_getsockname");
    check(exs_accept(*listener, qh, NULL), "exs_accept");
    *display = exs_socket(AF_INET, SOCK_SEQPACKET, 0);
    check(*display, "exs_socket");
    check(exs_connect(*display, (struct sockaddr *)&addr, sizeof addr, qh, NULL), "exs_connect");
    for (i = 0; i < 2; i++) {
        exs_event_t ev = next(qh);
        if (ev.exs_evt_type == EXS_EVT_ACCEPT)
            *sim = ev.exs_evt_accepted;
    }
}

/* Reads counters [first, first + SLICE) of the peer's state into `view` and checks they all hold `step`. */
static int sample(int display, uint32_t *view, exs_mhandle_t mview, exs_qhandle_t qh, int first, uint32_t step)
{
    exs_event_t ev;
    int i;
    check(exs_recv_offset(display, view, SLICE * sizeof(uint32_t), 0, mview, (uint64_t)first * sizeof(uint32_t),
                          qh, NULL),
          "exs_recv_offset");
    ev = next(qh);
    if (ev.exs_evt_bytes != (ssize_t)(SLICE * sizeof(uint32_t)))
        return -1;
    for (i = 0; i < SLICE; i++)
        if (view[i] != step * 100000u + (uint32_t)(first + i))
            return -1;
    return 0;
}

int main(int argc, char **argv)
{
    const char *ip = argc > 1 ? argv[1] : getenv("EXS_ADDR") ? getenv("EXS_ADDR") : "127.0.0.1";
    static uint32_t state[COUNTERS]; /* the simulation's own memory, a static array */
    uint32_t *whole, *view;
    exs_mhandle_t mstate, mwhole, mview;
    exs_qhandle_t qh;
    exs_event_t ev;
    int listener, sim = -1, display, i, reads = 0;
    uint32_t step;

    check(exs_init(EXS_VERSION), "exs_init");
    qh = exs_qcreate(16);
    check(qh, "exs_qcreate");
    connect_pair(ip, qh, &listener, &sim, &display);

    for (i = 0; i < COUNTERS; i++)
        state[i] = (uint32_t)i;
    mstate = exs_mregister(state, STATE_BYTES, EXS_ACCESS_READ);
    check(mstate, "exs_mregister");
    check(exs_send(sim, state, STATE_BYTES, EXS_PERSISTENT, mstate, qh, NULL), "exs_send(EXS_PERSISTENT)");

    /* The display's first receive takes the whole state (and learns of the persistent send). */
    whole = (uint32_t *)calloc(1, STATE_BYTES);
    view = (uint32_t *)calloc(SLICE, sizeof(uint32_t));
    if (whole == NULL || view == NULL)
        die("calloc");
    mwhole = exs_mregister(whole, STATE_BYTES, EXS_ACCESS_WRITE);
    mview = exs_mregister(view, SLICE * sizeof(uint32_t), EXS_ACCESS_WRITE);
    check(mwhole, "exs_mregister");
    check(mview, "exs_mregister");
    check(exs_recv(display, whole, STATE_BYTES, 0, mwhole, qh, NULL), "exs_recv");
    ev = next(qh);
    if (ev.exs_evt_bytes != (ssize_t)STATE_BYTES || whole[COUNTERS - 1] != COUNTERS - 1) {
        fprintf(stderr, "persistent: the first receive did not see the state\n");
        return 1;
    }

    /* The simulation advances (in place, no call to exs); the display samples slices of each step. */
    for (step = 1; step <= 5; step++) {
        for (i = 0; i < COUNTERS; i++)
            state[i] = step * 100000u + (uint32_t)i;
        for (i = 0; i + SLICE <= COUNTERS; i += 3 * SLICE, reads++) {
            if (sample(display, view, mview, qh, i, step) != 0) {
                fprintf(stderr, "persistent: step %u, counters %d..%d: not what the simulation wrote\n",
                        (unsigned)step, i, i + SLICE);
                return 1;
            }
        }
    }

    /* The simulation ends its persistent send: the send's event comes once the display let go. */
    check(exs_fcntl(sim, EXS_F_END_PERSISTENT), "exs_fcntl(EXS_F_END_PERSISTENT)");
    ev = next(qh);
    if (ev.exs_evt_type != EXS_EVT_SEND || ev.exs_evt_fd != sim) {
        fprintf(stderr, "persistent: expected the persistent send's event, got type %d\n", ev.exs_evt_type);
        return 1;
    }
    check(exs_close(display), "exs_close");
    check(exs_close(sim), "exs_close");
    check(exs_close(listener), "exs_close");
    check(exs_mderegister(mstate), "exs_mderegister");
    check(exs_mderegister(mwhole), "exs_mderegister");
    check(exs_mderegister(mview), "exs_mderegister");
    free(whole);
    free(view);
    printf("persistent: %d offset reads of %d B from a persistent send of %d B, each saw the state of its moment\n",
           reads, (int)(SLICE * sizeof(uint32_t)), (int)STATE_BYTES);
    return 0;
}
