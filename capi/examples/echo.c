/* echo.c: a SOCK_STREAM echo over exs, server and client in one program (and one event queue).
 *
 * The client sends 1 MiB; the server receives it whole (MSG_WAITALL) and sends it back; the client receives it
 * whole and checks every byte. Then the client shuts its side down and the server sees end-of-stream (a receive
 * of 0 bytes). Every buffer is the program's own calloc'ed memory, registered in place: the device moves the
 * bytes straight from one to the other.
 *
 *   cc echo.c $(pkg-config --cflags --libs exs) -o echo      (or c++: the file is C and C++)
 *   EXS_BACKEND=fabric ./echo [ADDR]                           (ADDR: 127.0.0.1, or EXS_ADDR)
 *   EXS_BACKEND=verbs EXS_ADDR=192.168.77.1 ./echo
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

enum { LEN = 1 << 20 };
/* What each operation is, as its event's context says. */
enum { CONNECTED = 1, ACCEPTED, SERVER_RECV, SERVER_SEND, CLIENT_SEND, CLIENT_RECV, SHUT, END };
#define CTX(what) ((void *)(intptr_t)(what))

static void die(const char *what)
{
    fprintf(stderr, "echo: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void check(int rc, const char *what)
{
    if (rc < 0)
        die(what);
}

/* A registered buffer of LEN bytes of the program's own memory. */
static char *region(exs_mhandle_t *mh)
{
    char *p = (char *)calloc(1, LEN);
    if (p == NULL)
        die("calloc");
    *mh = exs_mregister(p, LEN, EXS_ACCESS_READ | EXS_ACCESS_WRITE);
    check(*mh, "exs_mregister");
    return p;
}

int main(int argc, char **argv)
{
    const char *ip = argc > 1 ? argv[1] : getenv("EXS_ADDR") ? getenv("EXS_ADDR") : "127.0.0.1";
    struct sockaddr_in addr;
    socklen_t alen = sizeof addr;
    exs_mhandle_t mout, msrv, mback;
    char *out, *srv, *back;
    exs_qhandle_t qh;
    int listener, client, server = -1, done = 0, pending = 2, i;

    check(exs_init(EXS_VERSION), "exs_init");
    qh = exs_qcreate(16);
    check(qh, "exs_qcreate");

    memset(&addr, 0, sizeof addr);
    addr.sin_family = AF_INET;
    if (inet_pton(AF_INET, ip, &addr.sin_addr) != 1) {
        fprintf(stderr, "echo: %s is not an IPv4 address\n", ip);
        return 1;
    }
    listener = exs_socket(AF_INET, SOCK_STREAM, 0);
    check(listener, "exs_socket");
    check(exs_bind(listener, (struct sockaddr *)&addr, sizeof addr), "exs_bind");
    check(exs_listen(listener, 1), "exs_listen");
    check(exs_getsockname(listener, (struct sockaddr *)&addr, &alen), "exs_getsockname");
    check(exs_accept(listener, qh, CTX(ACCEPTED)), "exs_accept");
    client = exs_socket(AF_INET, SOCK_STREAM, 0);
    check(client, "exs_socket");
    check(exs_connect(client, (struct sockaddr *)&addr, sizeof addr, qh, CTX(CONNECTED)), "exs_connect");

    out = region(&mout);
    srv = region(&msrv);
    back = region(&mback);
    for (i = 0; i < LEN; i++)
        out[i] = (char)(i * 7 + i / 4096);

    /* Until end-of-stream has come and every operation started has completed (its memory is free again). */
    while (!done || pending > 0) {
        exs_event_t ev;
        check(exs_qdequeue(qh, &ev, 1, NULL), "exs_qdequeue");
        pending--;
        if (ev.exs_evt_errno != 0) {
            errno = ev.exs_evt_errno;
            die("an operation failed");
        }
        switch ((intptr_t)ev.exs_evt_context) {
        case ACCEPTED:
            server = ev.exs_evt_accepted;
            check(exs_recv(server, srv, LEN, MSG_WAITALL, msrv, qh, CTX(SERVER_RECV)), "server exs_recv");
            pending++;
            break;
        case CONNECTED:
            check(exs_send(client, out, LEN, 0, mout, qh, CTX(CLIENT_SEND)), "client exs_send");
            check(exs_recv(client, back, LEN, MSG_WAITALL, mback, qh, CTX(CLIENT_RECV)), "client exs_recv");
            pending += 2;
            break;
        case SERVER_RECV:
            if (ev.exs_evt_bytes != LEN) {
                fprintf(stderr, "echo: the server received %ld bytes, not %d\n", (long)ev.exs_evt_bytes, LEN);
                return 1;
            }
            check(exs_send(server, srv, LEN, 0, msrv, qh, CTX(SERVER_SEND)), "server exs_send");
            pending++;
            break;
        case SERVER_SEND: /* its buffer is free again: wait there for the end of the stream */
            check(exs_recv(server, srv, LEN, 0, msrv, qh, CTX(END)), "server exs_recv");
            pending++;
            break;
        case CLIENT_RECV:
            if (ev.exs_evt_bytes != LEN || memcmp(out, back, LEN) != 0) {
                fprintf(stderr, "echo: %ld bytes came back, not the %d sent\n", (long)ev.exs_evt_bytes, LEN);
                return 1;
            }
            check(exs_shutdown(client, SHUT_WR, qh, CTX(SHUT)), "exs_shutdown");
            pending++;
            break;
        case END:
            if (ev.exs_evt_bytes != 0) {
                fprintf(stderr, "echo: %ld bytes after the shutdown\n", (long)ev.exs_evt_bytes);
                return 1;
            }
            done = 1;
            break;
        default: /* the client's send and its shutdown completing */
            break;
        }
    }
    check(exs_close(client), "exs_close");
    check(exs_close(server), "exs_close");
    check(exs_close(listener), "exs_close");
    check(exs_mderegister(mout), "exs_mderegister");
    check(exs_mderegister(msrv), "exs_mderegister");
    check(exs_mderegister(mback), "exs_mderegister");
    free(out);
    free(srv);
    free(back);
    printf("echo: %d bytes sent, echoed and checked over SOCK_STREAM, then end-of-stream\n", LEN);
    return 0;
}
