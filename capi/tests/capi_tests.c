/* capi_tests.c: the C API's own tests, against the installed layout (cargo xtask test builds and runs them on
 * libfabric tcp and on Soft-RoCE). Each test prints a libtest line; the last line is libtest's summary.
 *
 *   cc -pthread capi_tests.c $(pkg-config --cflags --libs exs) -o capi_tests
 *   EXS_BACKEND=fabric ./capi_tests [ADDR]
 */
#define _GNU_SOURCE
#include <exs.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *ip;
static int failed_checks;

/* A failed expectation: says where, and fails the test it is in. */
#define EXPECT(cond)                                                                                              \
    do {                                                                                                          \
        if (!(cond)) {                                                                                            \
            fprintf(stderr, "    %s:%d: expected %s (errno %d: %s)\n", __FILE__, __LINE__, #cond, errno,        \
                    strerror(errno));                                                                             \
            failed_checks++;                                                                                      \
        }                                                                                                         \
    } while (0)
/* A call that must fail with `err`. */
#define FAILS_WITH(call, err)                                                                                     \
    do {                                                                                                          \
        errno = 0;                                                                                                \
        EXPECT((call) == -1 && errno == (err));                                                                   \
    } while (0)

static struct timespec patience = {30, 0};

/* The next event of `qh` (type 0 if none came within 30 s). */
static exs_event_t next(exs_qhandle_t qh)
{
    exs_event_t ev;
    memset(&ev, 0, sizeof ev);
    if (exs_qdequeue(qh, &ev, 1, &patience) != 1)
        ev.exs_evt_type = 0;
    return ev;
}

/* A connected pair of sockets of `type` on `qh`; the listener is closed. Returns 0 on success. */
static int pair(int type, exs_qhandle_t qh, int *client, int *server)
{
    struct sockaddr_in a;
    socklen_t alen = sizeof a;
    int l = exs_socket(AF_INET, type, 0), i;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    inet_pton(AF_INET, ip, &a.sin_addr);
    *client = exs_socket(AF_INET, type, 0);
    *server = -1;
    if (l < 0 || *client < 0 || exs_bind(l, (struct sockaddr *)&a, sizeof a) < 0 || exs_listen(l, 4) < 0 ||
        exs_getsockname(l, (struct sockaddr *)&a, &alen) < 0 || exs_accept(l, qh, NULL) < 0 ||
        exs_connect(*client, (struct sockaddr *)&a, sizeof a, qh, NULL) < 0)
        return -1;
    for (i = 0; i < 2; i++) {
        exs_event_t ev = next(qh);
        if (ev.exs_evt_type == 0 || ev.exs_evt_errno != 0)
            return -1;
        if (ev.exs_evt_type == EXS_EVT_ACCEPT)
            *server = ev.exs_evt_accepted;
    }
    exs_close(l);
    return *server >= 0 ? 0 : -1;
}

static void close_pair(int a, int b)
{
    exs_close(a);
    exs_close(b);
}

static void calls_before_exs_init_fail_cleanly(void)
{
    char buf[16];
    FAILS_WITH(exs_socket(AF_INET, SOCK_STREAM, 0), ENODEV);
    FAILS_WITH(exs_mregister(buf, sizeof buf, EXS_ACCESS_READ), ENODEV);
    FAILS_WITH(exs_init(EXS_VERSION + 1), EINVAL);
    FAILS_WITH(exs_close(1), EBADF);
}

static void bad_handles_are_ebadf(void)
{
    char *buf = (char *)calloc(1, 64);
    exs_qhandle_t qh = exs_qcreate(4);
    exs_mhandle_t mh = exs_mregister(buf, 64, EXS_ACCESS_READ | EXS_ACCESS_WRITE);
    exs_event_t ev;
    struct sockaddr_in a;
    socklen_t alen = sizeof a;
    int s = exs_socket(AF_INET, SOCK_SEQPACKET, 0), dead_q, dead_m;
    EXPECT(qh > 0 && mh > 0 && s > 0);
    FAILS_WITH(exs_send(-1, buf, 8, 0, mh, qh, NULL), EBADF);
    FAILS_WITH(exs_send(123456789, buf, 8, 0, mh, qh, NULL), EBADF);
    FAILS_WITH(exs_send(s, buf, 8, 0, -1, qh, NULL), EBADF);
    FAILS_WITH(exs_send(s, buf, 8, 0, mh, -1, NULL), EBADF);
    FAILS_WITH(exs_recv(s, buf, 8, 0, 987654, qh, NULL), EBADF);
    FAILS_WITH(exs_qdequeue(-1, &ev, 1, NULL), EBADF);
    FAILS_WITH(exs_qfd(777777), EBADF);
    FAILS_WITH(exs_qwait_mode(-1, EXS_WAIT_BUSY), EBADF);
    FAILS_WITH(exs_qdelete(-1), EBADF);
    FAILS_WITH(exs_mderegister(-1), EBADF);
    FAILS_WITH(exs_accept(-1, qh, NULL), EBADF);
    FAILS_WITH(exs_listen(-1, 1), EBADF);
    FAILS_WITH(exs_poll(-1, POLLIN, qh, NULL), EBADF);
    FAILS_WITH(exs_shutdown(-1, SHUT_WR, qh, NULL), EBADF);
    FAILS_WITH(exs_getsockname(-1, (struct sockaddr *)&a, &alen), EBADF);
    FAILS_WITH(exs_fcntl(-1, F_GETFL), EBADF);
    FAILS_WITH(exs_sendfile(-1, 0, 0, 1, 0, qh, NULL), EBADF);
    /* Handles that were valid once stay invalid: numbers are never reused. */
    EXPECT(exs_close(s) == 0);
    FAILS_WITH(exs_close(s), EBADF);
    FAILS_WITH(exs_send(s, buf, 8, 0, mh, qh, NULL), EBADF);
    EXPECT(exs_mderegister(mh) == 0);
    dead_m = mh;
    FAILS_WITH(exs_mderegister(dead_m), EBADF);
    EXPECT(exs_qdelete(qh) == 0);
    dead_q = qh;
    FAILS_WITH(exs_qdequeue(dead_q, &ev, 1, NULL), EBADF);
    qh = exs_qcreate(4);
    mh = exs_mregister(buf, 64, EXS_ACCESS_READ);
    EXPECT(qh != dead_q && mh != dead_m);
    exs_mderegister(mh);
    exs_qdelete(qh);
    free(buf);
}

static void bad_arguments_are_einval(void)
{
    char buf[64];
    exs_event_t ev;
    struct timespec bad = {0, 1000000000L};
    exs_qhandle_t qh = exs_qcreate(4);
    int s = exs_socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    FAILS_WITH(exs_qcreate(0), EINVAL);
    FAILS_WITH(exs_socket(AF_UNIX, SOCK_STREAM, 0), EAFNOSUPPORT);
    FAILS_WITH(exs_socket(AF_INET, SOCK_DGRAM, 0), EINVAL);
    FAILS_WITH(exs_socket(AF_INET, SOCK_STREAM, 99), EPROTONOSUPPORT);
    FAILS_WITH(exs_mregister(NULL, 64, EXS_ACCESS_READ), EINVAL);
    FAILS_WITH(exs_mregister(buf, 0, EXS_ACCESS_READ), EINVAL);
    FAILS_WITH(exs_mregister(buf, sizeof buf, 0), EINVAL);
    FAILS_WITH(exs_mregister(buf, sizeof buf, 64), EINVAL);
    FAILS_WITH(exs_qdequeue(qh, NULL, 1, NULL), EINVAL);
    FAILS_WITH(exs_qdequeue(qh, &ev, 0, NULL), EINVAL);
    FAILS_WITH(exs_qdequeue(qh, &ev, 1, &bad), EINVAL);
    FAILS_WITH(exs_qdequeue(qh, &ev, -5, NULL), EINVAL); /* more than a queue of depth 4 can hold */
    FAILS_WITH(exs_qwait_mode(qh, 42), EINVAL);
    FAILS_WITH(exs_bind(s, (struct sockaddr *)&a, sizeof a), EAFNOSUPPORT); /* an IPv4 address, IPv6 socket */
    FAILS_WITH(exs_bind(s, NULL, 0), EINVAL);
    FAILS_WITH(exs_bind(s, NULL, sizeof(struct sockaddr_in6)), EFAULT); /* as bind(2) */
    FAILS_WITH(exs_shutdown(s, 42, qh, NULL), EINVAL);
    FAILS_WITH(exs_fcntl(s, 0x7777), EINVAL);
    FAILS_WITH(exs_fcntl(s, EXS_F_SET_SEND_CREDITS, 0), EINVAL);
    FAILS_WITH(exs_getsockname(s, (struct sockaddr *)&a, NULL), EFAULT);
    FAILS_WITH(exs_getpeername(s, (struct sockaddr *)&a, NULL), ENOTCONN);
    exs_close(s);
    exs_qdelete(qh);
}

static void buffers_outside_a_region_are_einval(void)
{
    char *mem = (char *)calloc(1, 8192);
    exs_qhandle_t qh = exs_qcreate(8);
    exs_mhandle_t mh = exs_mregister(mem + 1024, 4096, EXS_ACCESS_READ | EXS_ACCESS_WRITE);
    exs_mhandle_t ro = exs_mregister(mem + 6000, 100, EXS_ACCESS_READ);
    int c, s;
    EXPECT(pair(SOCK_SEQPACKET, qh, &c, &s) == 0);
    FAILS_WITH(exs_send(c, mem, 16, 0, mh, qh, NULL), EINVAL);               /* before the region */
    FAILS_WITH(exs_send(c, mem + 1023, 16, 0, mh, qh, NULL), EINVAL);        /* starts one byte before */
    FAILS_WITH(exs_send(c, mem + 1024 + 4090, 16, 0, mh, qh, NULL), EINVAL); /* runs past its end */
    FAILS_WITH(exs_recv(s, mem + 1024, (size_t)-1, 0, mh, qh, NULL), EINVAL); /* a length that wraps */
    FAILS_WITH(exs_send(c, NULL, 16, 0, mh, qh, NULL), EINVAL);
    FAILS_WITH(exs_send(c, mem + 6000, 16, 0, mh, qh, NULL), EINVAL);        /* another region's memory */
    FAILS_WITH(exs_recv(s, mem + 6000, 16, 0, ro, qh, NULL), EACCES);        /* registered for sending only */
    /* The whole region, to its last byte, is fine. */
    memset(mem + 1024, 7, 4096);
    EXPECT(exs_recv(s, mem + 5120 - 100, 100, 0, mh, qh, NULL) == 0);
    EXPECT(exs_send(c, mem + 1024, 100, 0, mh, qh, NULL) == 0);
    EXPECT(next(qh).exs_evt_errno == 0 && next(qh).exs_evt_errno == 0);
    close_pair(c, s);
    EXPECT(exs_mderegister(mh) == 0 && exs_mderegister(ro) == 0);
    exs_qdelete(qh);
    free(mem);
}

static void deregister_while_a_send_is_in_flight_is_ebusy(void)
{
    char *out = (char *)calloc(1, 65536), *in = (char *)calloc(1, 65536);
    exs_qhandle_t qh = exs_qcreate(8);
    exs_mhandle_t mo, mi;
    exs_event_t a, b;
    int c, s;
    EXPECT(pair(SOCK_SEQPACKET, qh, &c, &s) == 0);
    memset(out, 'x', 65536);
    mo = exs_mregister(out, 65536, EXS_ACCESS_READ);
    mi = exs_mregister(in, 65536, EXS_ACCESS_WRITE);
    /* 64 KiB is beyond the immediate-data size: the send stays in flight until the peer pulls it. */
    EXPECT(exs_send(c, out, 65536, 0, mo, qh, NULL) == 0);
    FAILS_WITH(exs_mderegister(mo), EBUSY);
    FAILS_WITH(exs_mderegister(mo), EBUSY); /* still the same handle: nothing changed */
    /* (Whether the receive is still in flight when it is posted is the transport's race: not checked.) */
    EXPECT(exs_recv(s, in, 65536, 0, mi, qh, NULL) == 0);
    a = next(qh);
    b = next(qh);
    EXPECT(a.exs_evt_errno == 0 && b.exs_evt_errno == 0 && a.exs_evt_bytes == 65536 && b.exs_evt_bytes == 65536);
    EXPECT(memcmp(in, out, 65536) == 0);
    EXPECT(exs_mderegister(mo) == 0);
    EXPECT(exs_mderegister(mi) == 0);
    free(out); /* exs holds nothing of it any more */
    free(in);
    close_pair(c, s);
    exs_qdelete(qh);
}

static void close_with_operations_pending_ends_them(void)
{
    static char bufs[4][32];
    exs_qhandle_t qh = exs_qcreate(16);
    exs_mhandle_t mh = exs_mregister(bufs, sizeof bufs, EXS_ACCESS_WRITE);
    int c, s, i, cancelled = 0, eof = 0;
    EXPECT(pair(SOCK_STREAM, qh, &c, &s) == 0);
    for (i = 0; i < 3; i++)
        EXPECT(exs_recv(c, bufs[i], 32, 0, mh, qh, (void *)(intptr_t)(10 + i)) == 0);
    EXPECT(exs_recv(s, bufs[3], 32, 0, mh, qh, (void *)(intptr_t)20) == 0);
    FAILS_WITH(exs_qdelete(qh), EBUSY); /* operations started on it have not completed */
    EXPECT(exs_close(c) == 0);
    for (i = 0; i < 4; i++) {
        exs_event_t ev = next(qh);
        EXPECT(ev.exs_evt_type == EXS_EVT_RECV);
        if ((intptr_t)ev.exs_evt_context >= 10 && (intptr_t)ev.exs_evt_context < 13) {
            EXPECT(ev.exs_evt_fd == c); /* the closed socket's number, still */
            cancelled += ev.exs_evt_errno == ECANCELED;
        } else if ((intptr_t)ev.exs_evt_context == 20) {
            /* the peer sees end-of-stream */
            eof += ev.exs_evt_errno == 0 && ev.exs_evt_bytes == 0 && (ev.exs_evt_flags & EXS_EOF);
        }
    }
    EXPECT(cancelled == 3 && eof == 1);
    FAILS_WITH(exs_recv(c, bufs[0], 32, 0, mh, qh, NULL), EBADF);
    EXPECT(exs_close(s) == 0);
    EXPECT(exs_mderegister(mh) == 0);
    EXPECT(exs_qdelete(qh) == 0);
}

static void events_carry_the_errno_of_the_operation(void)
{
    struct sockaddr_in a;
    socklen_t alen = sizeof a;
    exs_qhandle_t qh = exs_qcreate(4);
    int l = exs_socket(AF_INET, SOCK_SEQPACKET, 0), c = exs_socket(AF_INET, SOCK_SEQPACKET, 0);
    exs_event_t ev;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    inet_pton(AF_INET, ip, &a.sin_addr);
    /* A port that was listened on and is not any more: nobody answers there. */
    EXPECT(exs_bind(l, (struct sockaddr *)&a, sizeof a) == 0 && exs_listen(l, 1) == 0);
    EXPECT(exs_getsockname(l, (struct sockaddr *)&a, &alen) == 0);
    EXPECT(exs_close(l) == 0);
    EXPECT(exs_connect(c, (struct sockaddr *)&a, sizeof a, qh, (void *)&a) == 0);
    ev = next(qh);
    EXPECT(ev.exs_evt_type == EXS_EVT_CONNECT && ev.exs_evt_errno == ECONNREFUSED);
    EXPECT(ev.exs_evt_context == (void *)&a && ev.exs_evt_fd == c);
    exs_close(c);
    exs_qdelete(qh);
}

static void a_full_queue_is_eagain_and_messages_say_eor_and_trunc(void)
{
    char *mem = (char *)calloc(1, 256);
    exs_qhandle_t qh = exs_qcreate(8), small = exs_qcreate(1);
    exs_mhandle_t mh = exs_mregister(mem, 256, EXS_ACCESS_READ | EXS_ACCESS_WRITE);
    exs_event_t r, s1;
    int c, s;
    EXPECT(pair(SOCK_SEQPACKET, qh, &c, &s) == 0);
    EXPECT(exs_recv(s, mem, 10, 0, mh, small, NULL) == 0);
    FAILS_WITH(exs_recv(s, mem + 10, 10, 0, mh, small, NULL), EAGAIN);
    memset(mem + 100, 'm', 100);
    EXPECT(exs_send(c, mem + 100, 100, 0, mh, qh, NULL) == 0);
    r = next(small);
    s1 = next(qh);
    EXPECT(r.exs_evt_type == EXS_EVT_RECV && r.exs_evt_bytes == 10);
    EXPECT((r.exs_evt_flags & MSG_TRUNC) && (r.exs_evt_flags & MSG_EOR));
    EXPECT(s1.exs_evt_type == EXS_EVT_SEND && s1.exs_evt_bytes == 100 && s1.exs_evt_flags == 0);
    close_pair(c, s);
    exs_mderegister(mh);
    exs_qdelete(qh);
    exs_qdelete(small);
    free(mem);
}

static void options_names_poll_and_sendfile(void)
{
    char *mem = (char *)calloc(1, 8192), tmpl[] = "/tmp/exs-capi-XXXXXX";
    exs_qhandle_t qh = exs_qcreate(8);
    exs_mhandle_t mh = exs_mregister(mem, 8192, EXS_ACCESS_READ | EXS_ACCESS_WRITE);
    struct sockaddr_in6 peer6;
    struct sockaddr_in me, peer;
    socklen_t len = sizeof me;
    exs_event_t ev;
    int c, s, file, i, got_poll = 0, got_file = 0, got_recv = 0;
    EXPECT(pair(SOCK_STREAM, qh, &c, &s) == 0);
    EXPECT(exs_fcntl(c, EXS_F_GET_SEND_CREDITS) == 16);
    EXPECT(exs_fcntl(c, F_GETFL) & O_NONBLOCK);
    EXPECT(exs_fcntl(c, F_SETFL, O_NONBLOCK) == 0);
    EXPECT(exs_fcntl(c, EXS_F_GETERROR) == 0);
    FAILS_WITH(exs_fcntl(c, EXS_F_SET_SEND_CREDITS, 8), EISCONN); /* negotiated at connect */
    /* The non-variadic form, for callers that cannot call a variadic function: the same results. */
    EXPECT(exs_fcntl_int(c, EXS_F_GET_SEND_CREDITS, 0) == 16);
    FAILS_WITH(exs_fcntl_int(c, EXS_F_SET_SEND_CREDITS, 8), EISCONN);
    FAILS_WITH(exs_fcntl_int(-1, F_GETFL, 0), EBADF);
    EXPECT(exs_getsockname(c, (struct sockaddr *)&me, &len) == 0 && len == sizeof me);
    len = sizeof peer;
    EXPECT(exs_getpeername(s, (struct sockaddr *)&peer, &len) == 0 && len == sizeof peer);
    EXPECT(peer.sin_port == me.sin_port && peer.sin_addr.s_addr == me.sin_addr.s_addr);
    len = 4; /* too small: truncated, and the full length reported */
    EXPECT(exs_getpeername(s, (struct sockaddr *)&peer6, &len) == 0 && len == sizeof peer);
    /* A file sent with exs_sendfile, announced to the receiver by exs_poll. */
    file = mkstemp(tmpl);
    for (i = 0; i < 5000; i++)
        mem[i] = (char)(i % 251);
    EXPECT(file >= 0 && write(file, mem, 5000) == 5000);
    unlink(tmpl);
    /* poll(2)'s other names for reading and writing are taken; what exs cannot report is refused. */
    FAILS_WITH(exs_poll(s, POLLPRI, qh, NULL), EINVAL);
    FAILS_WITH(exs_poll(s, POLLIN | POLLRDBAND, qh, NULL), EINVAL);
    EXPECT(exs_poll(s, POLLRDNORM | POLLRDHUP | POLLERR, qh, NULL) == 0);
    EXPECT(exs_sendfile(c, file, 1000, 3000, 0, qh, NULL) == 0);
    close(file); /* exs has what it needs */
    FAILS_WITH(exs_sendfile(c, file, 0, 10, 0, qh, NULL), EBADF);
    for (i = 0; i < 2; i++) {
        ev = next(qh);
        got_poll += ev.exs_evt_type == EXS_EVT_POLL && (ev.exs_evt_revents & POLLIN) &&
                    (ev.exs_evt_revents & POLLRDNORM) && ev.exs_evt_fd == s;
        got_file += ev.exs_evt_type == EXS_EVT_SENDFILE && ev.exs_evt_bytes == 3000 && ev.exs_evt_errno == 0;
    }
    EXPECT(got_poll == 1 && got_file == 1);
    EXPECT(exs_recv(s, mem + 5000, 3000, MSG_WAITALL, mh, qh, NULL) == 0);
    ev = next(qh);
    got_recv = ev.exs_evt_bytes == 3000 && memcmp(mem + 5000, mem + 1000, 3000) == 0;
    EXPECT(got_recv);
    FAILS_WITH(exs_shutdown(c, SHUT_RD, qh, NULL), EOPNOTSUPP);
    close_pair(c, s);
    exs_mderegister(mh);
    exs_qdelete(qh);
    free(mem);
}

/* One thread's work: its own queue, pair and memory, 200 messages both ways, and handles made and dropped. */
static void *worker(void *arg)
{
    long id = (long)(intptr_t)arg, errors = 0;
    char *mem = (char *)calloc(1, 1536);
    exs_qhandle_t qh = exs_qcreate(8);
    exs_mhandle_t mh = exs_mregister(mem, 1024, EXS_ACCESS_READ | EXS_ACCESS_WRITE);
    int c, s, i;
    if (pair(SOCK_SEQPACKET, qh, &c, &s) != 0)
        return (void *)(intptr_t)1;
    for (i = 0; i < 200; i++) {
        exs_event_t evs[2];
        int got = 0, n;
        /* Beside mh, not over it: a byte is registered once (an overlapping range is EBUSY). */
        exs_mhandle_t extra = exs_mregister(mem + 1024, 512, EXS_ACCESS_READ);
        mem[0] = (char)(id + i);
        if (exs_recv(s, mem + 100, 100, 0, mh, qh, NULL) < 0 || exs_send(c, mem, 100, 0, mh, qh, NULL) < 0)
            errors++;
        while (got < 2 && (n = exs_qdequeue(qh, evs, 2 - got, &patience)) > 0)
            got += n;
        if (got != 2 || mem[100] != (char)(id + i) || extra < 0 || exs_mderegister(extra) != 0)
            errors++;
        if (exs_close(-(int)id) != -1 || errno != EBADF)
            errors++;
    }
    close_pair(c, s);
    exs_mderegister(mh);
    exs_qdelete(qh);
    free(mem);
    return (void *)(intptr_t)errors;
}

static void calls_from_several_threads(void)
{
    pthread_t t[4];
    long i;
    for (i = 0; i < 4; i++)
        EXPECT(pthread_create(&t[i], NULL, worker, (void *)(intptr_t)(i + 1)) == 0);
    for (i = 0; i < 4; i++) {
        void *errors = NULL;
        EXPECT(pthread_join(t[i], &errors) == 0 && errors == NULL);
    }
}

struct test {
    const char *name;
    void (*run)(void);
};

static int run(const struct test *t, int *failed)
{
    failed_checks = 0;
    t->run();
    printf("test capi::%s ... %s\n", t->name, failed_checks ? "FAILED" : "ok");
    fflush(stdout);
    *failed += failed_checks != 0;
    return failed_checks == 0;
}

int main(int argc, char **argv)
{
    static const struct test before = {"calls_before_exs_init_fail_cleanly", calls_before_exs_init_fail_cleanly};
    static const struct test tests[] = {
        {"bad_handles_are_ebadf", bad_handles_are_ebadf},
        {"bad_arguments_are_einval", bad_arguments_are_einval},
        {"buffers_outside_a_region_are_einval", buffers_outside_a_region_are_einval},
        {"deregister_while_a_send_is_in_flight_is_ebusy", deregister_while_a_send_is_in_flight_is_ebusy},
        {"close_with_operations_pending_ends_them", close_with_operations_pending_ends_them},
        {"events_carry_the_errno_of_the_operation", events_carry_the_errno_of_the_operation},
        {"a_full_queue_is_eagain_and_messages_say_eor_and_trunc", a_full_queue_is_eagain_and_messages_say_eor_and_trunc},
        {"options_names_poll_and_sendfile", options_names_poll_and_sendfile},
        {"calls_from_several_threads", calls_from_several_threads},
    };
    size_t i, n = sizeof tests / sizeof tests[0];
    int passed = 0, failed = 0;
    ip = argc > 1 ? argv[1] : getenv("EXS_ADDR") ? getenv("EXS_ADDR") : "127.0.0.1";
    printf("running %d tests\n", (int)n + 1);
    passed += run(&before, &failed);
    if (exs_init(EXS_VERSION) != 0) {
        fprintf(stderr, "capi_tests: exs_init: %s\n", strerror(errno));
        return 1;
    }
    for (i = 0; i < n; i++)
        passed += run(&tests[i], &failed);
    printf("\ntest result: %s. %d passed; %d failed; 0 ignored\n", failed ? "FAILED" : "ok", passed, failed);
    return failed ? 1 : 0;
}
