/* The floor under a parked publisher's resume (docs/BACKPRESSURE.md): how long one process
 * takes to run again after another wakes it, in plain C, with nothing of slipstream in the way.
 *
 *   wake_floor MECHANISM WAKER_CPU WAKEE_CPU WAKER SAMPLES INTERVAL_US
 *
 * MECHANISM: futex (FUTEX_WAKE on a word in shared memory, as the driver wakes a publisher)
 * or pipe (an 8-byte write, as a socket or pipe wakes a blocking read).  CPU -1: not pinned.
 * WAKER: "sleeps" (nanosleep until the next wake, so it leaves its CPU at once) or "busy"
 * (spins between wakes, as the driver's conductor goes on with its cycle).  Prints one line:
 * "p50_ns p99_ns p999_ns", the time from the waker's clock read before the wake to the
 * wakee's clock read after it returned. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_SAMPLES 100000

struct shared {
    volatile uint32_t wakes;     /* the futex word: how many wakes the waker has sent */
    volatile int64_t woken_at;   /* the waker's clock just before its latest wake */
    int64_t latency_ns[MAX_SAMPLES];
};

static int64_t monotonic_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void pin(int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) { perror("sched_setaffinity"); exit(2); }
}

static int by_value(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s futex|pipe WAKER_CPU WAKEE_CPU sleeps|busy SAMPLES INTERVAL_US\n",
                argv[0]);
        return 2;
    }
    int use_futex = strcmp(argv[1], "futex") == 0;
    int waker_cpu = atoi(argv[2]), wakee_cpu = atoi(argv[3]);
    int waker_busy = strcmp(argv[4], "busy") == 0;
    int samples = atoi(argv[5]);
    int64_t interval_ns = (int64_t)atoi(argv[6]) * 1000;
    if (samples < 1 || samples > MAX_SAMPLES || interval_ns <= 0) { fprintf(stderr, "bad size\n"); return 2; }

    struct shared *shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE,
                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int fds[2];
    if (shared == MAP_FAILED || pipe(fds) != 0) { perror("setup"); return 2; }
    pid_t wakee = fork();
    if (wakee == 0) {
        pin(wakee_cpu);
        for (int i = 0; i < samples; i++) {
            if (use_futex) {
                uint32_t seen;
                /* A wake that came before we slept is not waited for: FUTEX_WAIT returns. */
                while ((int32_t)((seen = shared->wakes) - (uint32_t)(i + 1)) < 0)
                    syscall(SYS_futex, &shared->wakes, FUTEX_WAIT, seen, NULL, NULL, 0);
            } else {
                uint64_t token;
                if (read(fds[0], &token, sizeof token) != sizeof token) _exit(3);
            }
            shared->latency_ns[i] = monotonic_ns() - shared->woken_at;
        }
        _exit(0);
    }
    pin(waker_cpu);
    usleep(100000);
    for (int i = 0; i < samples; i++) {
        int64_t next = monotonic_ns() + interval_ns;
        if (waker_busy) {
            while (monotonic_ns() < next) {}
        } else {
            struct timespec pause = {interval_ns / 1000000000LL, interval_ns % 1000000000LL};
            nanosleep(&pause, NULL);
        }
        shared->woken_at = monotonic_ns();
        if (use_futex) {
            __atomic_add_fetch(&shared->wakes, 1, __ATOMIC_SEQ_CST);
            syscall(SYS_futex, &shared->wakes, FUTEX_WAKE, 1, NULL, NULL, 0);
        } else {
            uint64_t token = 1;
            if (write(fds[1], &token, sizeof token) != sizeof token) return 3;
        }
    }
    int status;
    waitpid(wakee, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { fprintf(stderr, "wakee failed\n"); return 3; }
    qsort(shared->latency_ns, samples, sizeof(int64_t), by_value);
    printf("%lld %lld %lld\n", (long long)shared->latency_ns[samples / 2],
           (long long)shared->latency_ns[(int64_t)samples * 99 / 100],
           (long long)shared->latency_ns[(int64_t)samples * 999 / 1000]);
    return 0;
}
