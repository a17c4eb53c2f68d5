/* The floor of a socket-based hand-off: a 64-byte ping-pong over a Unix SOCK_SEQPACKET pair, no
 * GPU work, once with blocking reads and once with both sides spinning on non-blocking reads (the
 * floor of a spin-wait receiver). Prints one JSON object with the round-trip percentiles in
 * microseconds. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { WARMUP = 2000, TRIPS = 20000 };

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* One message into buf: a blocking read, or non-blocking reads until one succeeds. */
static ssize_t take(int fd, char *buf, size_t len, int spin) {
    for (;;) {
        ssize_t n = recv(fd, buf, len, spin ? MSG_DONTWAIT : 0);
        if (n >= 0 || !spin || (errno != EAGAIN && errno != EWOULDBLOCK)) return n;
    }
}

/* Sorted round-trip times of TRIPS ping-pongs after WARMUP; 0 on success. */
static int ping_pong(int spin, long long *times) {
    int fds[2];
    char buf[64] = {0};
    if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, fds) != 0) return 1;
    pid_t child = fork(); /* no CUDA in this program: fork is safe here */
    if (child == 0) {
        close(fds[0]);
        while (take(fds[1], buf, sizeof buf, spin) > 0) {
            if (send(fds[1], buf, sizeof buf, 0) != sizeof buf) _exit(1);
        }
        _exit(0);
    }
    close(fds[1]);
    for (int i = 0; i < WARMUP + TRIPS; i++) {
        long long start = now_ns();
        if (send(fds[0], buf, sizeof buf, 0) != sizeof buf || take(fds[0], buf, sizeof buf, spin) != sizeof buf)
            return 1;
        if (i >= WARMUP) times[i - WARMUP] = now_ns() - start;
    }
    close(fds[0]);
    waitpid(child, NULL, 0);
    qsort(times, TRIPS, sizeof times[0], cmp);
    return 0;
}

int main(void) {
    static long long blocking[TRIPS], spinning[TRIPS];
    if (ping_pong(0, blocking) != 0 || ping_pong(1, spinning) != 0) return 1;
    printf("{\"p50_us\": %.2f, \"p99_us\": %.2f, \"p999_us\": %.2f, \"spin_p50_us\": %.2f, \"spin_p99_us\": %.2f, "
           "\"spin_p999_us\": %.2f, \"trips\": %d}\n",
           blocking[TRIPS / 2] / 1e3, blocking[TRIPS * 99 / 100] / 1e3, blocking[TRIPS * 999 / 1000] / 1e3,
           spinning[TRIPS / 2] / 1e3, spinning[TRIPS * 99 / 100] / 1e3, spinning[TRIPS * 999 / 1000] / 1e3, TRIPS);
    return 0;
}
