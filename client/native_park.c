/* slipstream's client hot paths: park and wake, slipstream's own.  Aeron's clients spin, yield
 * and sleep (its idle strategies) and its driver's agents poll; here a reader or a publisher
 * that found nothing to do parks on an eventcount in the log's metadata (a shared futex:
 * waiters and wakers are different processes), and whoever moves what it waits for bumps it
 * (ss_signal) only while someone waits.  A client wakes the driver's network thread, which
 * parks on its sockets, through its doorbell socket (ss_ring_doorbell, ss_advance_position).
 * The waits spin, then yield, then park: ss_await_frames, a reader's on many images at once
 * (futex_waitv), and ss_await_credit, a publisher's for the publication limit to move.  See
 * native.h for the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

/* ---------------------------------------------------------------- futex */
int ss_futex_wait(int32_t *addr, int32_t expected, int64_t timeout_ns) {
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = timeout_ns / 1000000000LL;
        ts.tv_nsec = timeout_ns % 1000000000LL;
        tsp = &ts;
    }
    long rc = syscall(SYS_futex, addr, FUTEX_WAIT, expected, tsp, NULL, 0);
    return rc == 0 ? 0 : errno;
}

int ss_futex_wake(int32_t *addr, int32_t count) {
    return (int)syscall(SYS_futex, addr, FUTEX_WAKE, count, NULL, NULL, 0);
}

void ss_signal(int32_t *signal, const int32_t *waiters) {
    /* seq_cst pairs with the waiter's increment of *waiters before it re-checks for data, so
     * either the waiter sees our frame or we see its registration (Dekker). */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(waiters, __ATOMIC_RELAXED) > 0) {
        __atomic_fetch_add(signal, 1, __ATOMIC_SEQ_CST);
        ss_futex_wake(signal, INT_MAX);
    }
}

struct ss_futex_waitv {
    uint64_t val;
    uint64_t uaddr;
    uint32_t flags;
    uint32_t reserved;
};
#define SS_FUTEX2_SIZE_U32 0x02

#define SS_FUTEX_WAITV_MAX 128 /* the kernel's limit per futex_waitv */

static int park_many(const ss_reader_t *readers, const int32_t *seen, int32_t count,
                     int64_t deadline_ns) {
    struct ss_futex_waitv waiters[SS_FUTEX_WAITV_MAX];
    struct timespec ts, *tsp = NULL;
    for (int32_t i = 0; i < count; i++) {
        waiters[i].val = (uint32_t)seen[i];
        waiters[i].uaddr = (uint64_t)(uintptr_t)readers[i].signal;
        waiters[i].flags = SS_FUTEX2_SIZE_U32; /* shared: no FUTEX2_PRIVATE */
        waiters[i].reserved = 0;
    }
    if (deadline_ns >= 0) {
        ts.tv_sec = deadline_ns / 1000000000LL;
        ts.tv_nsec = deadline_ns % 1000000000LL;
        tsp = &ts;
    }
    long rc = syscall(SYS_futex_waitv, waiters, count, 0, tsp, CLOCK_MONOTONIC);
    if (rc < 0 && errno == ENOSYS) {
        /* Older kernels: park on the first image with a short timeout; the caller re-checks. */
        int64_t rel = deadline_ns < 0 ? 1000000 : deadline_ns - monotonic_ns();
        if (rel > 1000000) rel = 1000000;
        if (rel < 0) rel = 0;
        return ss_futex_wait(readers[0].signal, seen[0], rel);
    }
    return rc < 0 ? errno : 0;
}

static inline int any_committed(const ss_reader_t *readers, int32_t count) {
    for (int32_t i = 0; i < count; i++) {
        const ss_reader_t *r = &readers[i];
        int64_t position = LOAD_ACQ(r->position);
        if (position < 0) continue; /* a cell another client may write: not a position */
        int32_t index = (int32_t)((position >> r->position_bits) % SS_PARTITION_COUNT);
        const uint8_t *frame = r->log + (int64_t)index * r->term_length +
                               (position & (r->term_length - 1));
        if (LOAD_ACQ((const int32_t *)frame) != 0) return 1;
    }
    return 0;
}

int ss_await_frames(const ss_reader_t *readers, int32_t count, int64_t spin_ns, int64_t timeout_ns) {
    int64_t start = monotonic_ns();
    int64_t deadline = timeout_ns < 0 ? -1 : start + timeout_ns;
    int32_t seen[SS_FUTEX_WAITV_MAX];
    int32_t watched = count > SS_FUTEX_WAITV_MAX ? SS_FUTEX_WAITV_MAX : count;
    if (count <= 0) return 0;
    /* Spin phase: cheap while traffic flows, it is what keeps latency low. */
    for (uint32_t n = 0;; n++) {
        if (any_committed(readers, count)) return 1;
        if ((n & 63) == 63) {
            int64_t now = monotonic_ns();
            if (now - start >= spin_ns) break;
            if (deadline >= 0 && now >= deadline) return 0;
            /* Every few microseconds let a waiting thread have the core: on a small machine
             * the driver thread that brings our data may be queued behind this spinner. */
            sched_yield();
        }
        cpu_relax();
    }
    /* Park phase: register as a waiter, re-check (the writer may have committed in between),
     * then sleep until a writer bumps a signal word. */
    for (int32_t i = 0; i < count; i++) __atomic_fetch_add(readers[i].waiters, 1, __ATOMIC_SEQ_CST);
    int result = 0;
    for (;;) {
        for (int32_t i = 0; i < watched; i++) seen[i] = __atomic_load_n(readers[i].signal, __ATOMIC_SEQ_CST);
        if (any_committed(readers, count)) { result = 1; break; }
        int64_t now = monotonic_ns();
        if (deadline >= 0 && now >= deadline) break;
        int64_t wake = deadline;
        if (count > watched && (wake < 0 || wake > now + 1000000)) {
            /* More images than one futex_waitv takes: park on the first ones for a
             * millisecond at most, then look at all of them again. */
            wake = now + 1000000;
        }
        int rc = park_many(readers, seen, watched, wake);
        if (rc == EAGAIN) continue; /* the word moved before we slept: look again */
        /* Woken (data, or an image change the caller must see), timed out, or interrupted
         * (EINTR: Python delivers signals such as KeyboardInterrupt): return either way. */
        result = any_committed(readers, count);
        break;
    }
    for (int32_t i = 0; i < count; i++) __atomic_fetch_sub(readers[i].waiters, 1, __ATOMIC_SEQ_CST);
    return result;
}

void ss_ring_doorbell(uint8_t *meta, int32_t doorbell_fd, int64_t position) {
    /* seq_cst pairs with the driver's increment of its waiters before it re-checks the log:
     * either it sees what we wrote, or we see it parked (as in ss_signal). */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n((const int32_t *)(meta + SS_META_DRIVER_WAITERS), __ATOMIC_RELAXED) > 0 &&
        position >= LOAD_ACQ((const int64_t *)(meta + SS_META_DRIVER_WAKE_POSITION))) {
        /* One byte; a full queue (EAGAIN) means the driver has a ring pending already. */
        (void)send(doorbell_fd, "", 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
}

void ss_advance_position(int64_t *position_counter, int64_t position, uint8_t *meta,
                         int32_t doorbell_fd) {
    STORE_REL(position_counter, position);
    if (doorbell_fd >= 0) ss_ring_doorbell(meta, doorbell_fd, position);
}

/* A publisher's wait until ready(context) (credit, a durable position): spin for spin_ns, then
 * give the core up between looks until spin_ns + yield_ns, then park on `signal`, registered in
 * `waiters`: the driver stores what ready reads, then bumps `signal` if anyone waits
 * (ss_signal).  Returns 1 when ready, 0 when the deadline (timeout_ns after the start; -1:
 * none) passed; else what ready says as the park ends, which is at the first wake-up, or with
 * `until_ready` only at one that finds it ready, a time-out or a signal (EINTR). */
static inline __attribute__((always_inline)) int await_ready(
    int (*ready)(const void *context), const void *context, int32_t *signal,
    int32_t *waiters, int64_t spin_ns, int64_t yield_ns, int64_t timeout_ns, int until_ready) {
    int64_t start = monotonic_ns();
    int64_t deadline = timeout_ns < 0 ? -1 : start + timeout_ns;
    for (uint32_t n = 0;; n++) {
        if (ready(context)) return 1;
        if ((n & 63) == 63) {
            int64_t now = monotonic_ns();
            if (now - start >= spin_ns) break;
            if (deadline >= 0 && now >= deadline) return 0;
        }
        cpu_relax();
    }
    /* Then give the core up between looks: the driver that moves the limit, or the
     * subscriber it waits for, may need it; a park's wake-up costs an idle vCPU tens of us. */
    for (;;) {
        if (ready(context)) return 1;
        int64_t now = monotonic_ns();
        if (now - start >= spin_ns + yield_ns) break;
        if (deadline >= 0 && now >= deadline) return 0;
        sched_yield();
    }
    __atomic_fetch_add(waiters, 1, __ATOMIC_SEQ_CST);
    int result = 0;
    for (;;) {
        int32_t seen = __atomic_load_n(signal, __ATOMIC_SEQ_CST);
        /* Registered, then re-checked: the driver stores, then reads the waiters (ss_signal),
         * so either it sees us or we see what it stored. */
        if (ready(context)) { result = 1; break; }
        int64_t remaining = -1;
        if (deadline >= 0) {
            remaining = deadline - monotonic_ns();
            if (remaining <= 0) break;
        }
        int rc = ss_futex_wait(signal, seen, remaining);
        if (rc == EAGAIN) continue; /* the word moved before we slept: look again */
        /* Woken, with until_ready: it moved, maybe not far enough yet: look again. */
        if (until_ready && rc != ETIMEDOUT && rc != EINTR) continue;
        /* Timed out or interrupted (EINTR: Python delivers signals such as
         * KeyboardInterrupt), or woken once: return either way, the caller looks again. */
        result = ready(context);
        break;
    }
    __atomic_fetch_sub(waiters, 1, __ATOMIC_SEQ_CST);
    return result;
}

static int credit_ready(const void *appender) {
    return has_credit((const ss_appender_t *)appender);
}

int ss_await_credit(const ss_appender_t *a, int64_t spin_ns, int64_t yield_ns,
                    int64_t timeout_ns) {
    return await_ready(credit_ready, a, (int32_t *)(a->meta + SS_META_PUBLISHER_SIGNAL),
                       (int32_t *)(a->meta + SS_META_PUBLISHER_WAITERS), spin_ns, yield_ns,
                       timeout_ns, 0);
}

struct durable_wait {
    const ss_appender_t *appender;
    const int64_t *durable;
    int64_t target;
};

/* Reached, or closed (the wait ends; the caller looks at why). */
static int durable_ready(const void *context) {
    const struct durable_wait *w = context;
    return LOAD_ACQ(w->durable) >= w->target || LOAD_ACQ(&w->appender->closed);
}

int ss_await_durable(const ss_appender_t *a, const int64_t *durable, int64_t target,
                     int64_t spin_ns, int64_t yield_ns, int64_t timeout_ns) {
    /* As ss_await_credit: a status message moves the position every quarter window, so a
     * pipelined publisher finds it moved within a short spin; a lone one parks, woken at each
     * move until it reaches the target. */
    const struct durable_wait wait = {a, durable, target};
    await_ready(durable_ready, &wait, (int32_t *)(a->meta + SS_META_DURABLE_SIGNAL),
                (int32_t *)(a->meta + SS_META_DURABLE_WAITERS), spin_ns, yield_ns, timeout_ns,
                1);
    return LOAD_ACQ(durable) >= target;
}
