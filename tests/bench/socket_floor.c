/* The floor of a socket-based hand-off: a 64-byte ping-pong over a Unix SOCK_SEQPACKET pair,
 * no GPU work. Prints one JSON object with the round-trip percentiles in microseconds. */
#define _GNU_SOURCE
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

int main(void) {
    int fds[2];
    char buf[64] = {0};
    if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, fds) != 0) return 1;
    pid_t child = fork(); /* no CUDA in this program: fork is safe here */
    if (child == 0) {
        close(fds[0]);
        while (read(fds[1], buf, sizeof buf) > 0) {
            if (write(fds[1], buf, sizeof buf) != sizeof buf) return 1;
        }
        return 0;
    }
    close(fds[1]);
    static long long times[TRIPS];
    for (int i = 0; i < WARMUP + TRIPS; i++) {
        long long start = now_ns();
        if (write(fds[0], buf, sizeof buf) != sizeof buf || read(fds[0], buf, sizeof buf) != sizeof buf) return 1;
        if (i >= WARMUP) times[i - WARMUP] = now_ns() - start;
    }
    close(fds[0]);
    waitpid(child, NULL, 0);
    qsort(times, TRIPS, sizeof times[0], cmp);
    printf("{\"p50_us\": %.2f, \"p99_us\": %.2f, \"p999_us\": %.2f, \"trips\": %d}\n", times[TRIPS / 2] / 1e3,
           times[TRIPS * 99 / 100] / 1e3, times[TRIPS * 999 / 1000] / 1e3, TRIPS);
    return 0;
}
