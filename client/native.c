/* slipstream native hot paths; see native.h for the contracts. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>

#include "native.h"

#ifndef SYS_futex_waitv
#define SYS_futex_waitv 449
#endif

#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static inline int32_t align32(int32_t v) { return (v + (SS_FRAME_ALIGNMENT - 1)) & ~(SS_FRAME_ALIGNMENT - 1); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---------------------------------------------------------------- atomics */
int64_t ss_load_acquire_i64(const int64_t *addr) { return LOAD_ACQ(addr); }
void ss_store_release_i64(int64_t *addr, int64_t value) { STORE_REL(addr, value); }
int64_t ss_get_and_add_i64(int64_t *addr, int64_t delta) { return __atomic_fetch_add(addr, delta, __ATOMIC_SEQ_CST); }
int ss_cas_i64(int64_t *addr, int64_t expected, int64_t desired) {
    return __atomic_compare_exchange_n(addr, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

int ss_cas_i32(int32_t *addr, int32_t expected, int32_t desired) {
    return __atomic_compare_exchange_n(addr, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
int32_t ss_load_acquire_i32(const int32_t *addr) { return LOAD_ACQ(addr); }
void ss_store_release_i32(int32_t *addr, int32_t value) { STORE_REL(addr, value); }
int32_t ss_get_and_add_i32(int32_t *addr, int32_t delta) { return __atomic_fetch_add(addr, delta, __ATOMIC_SEQ_CST); }
void ss_propose_max_i64(int64_t *addr, int64_t value) {
    int64_t current = LOAD_ACQ(addr);
    while (value > current) {
        if (__atomic_compare_exchange_n(addr, &current, value, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) break;
    }
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

/* ---------------------------------------------------------------- appender */
static inline int64_t *tail_counter(uint8_t *meta, int32_t index) {
    return (int64_t *)(meta + SS_META_TAIL_COUNTERS + 8 * index);
}

static inline int32_t *active_term_count_ptr(uint8_t *meta) {
    return (int32_t *)(meta + SS_META_ACTIVE_TERM_COUNT);
}

static inline int64_t compute_position(int32_t term_id, int32_t term_offset, int32_t bits, int32_t initial_term_id) {
    int64_t term_count = (int64_t)(int32_t)((uint32_t)term_id - (uint32_t)initial_term_id);
    return term_count * ((int64_t)1 << bits) + term_offset; /* a shift of a negative is UB */
}

/* The active term count of a log's metadata, which every process of the stream maps writable:
 * a negative one is no term (a log holds 2^31 terms at most), and would index before it. */
static inline int32_t active_term_count(uint8_t *meta) {
    return LOAD_ACQ(active_term_count_ptr(meta));
}

/* The header goes in as length (negative: "being written") + version/flags/type in one
 * 8-byte release store, then the rest; the commit is a release store of the positive length. */
static inline void write_header(uint8_t *frame, int32_t frame_length, uint8_t flags, uint16_t type,
                                int32_t term_offset, int32_t session_id, int32_t stream_id, int32_t term_id) {
    uint64_t first = (uint32_t)(-frame_length) | ((uint64_t)SS_CURRENT_VERSION << (8 * SS_VERSION_FIELD)) |
                     ((uint64_t)flags << (8 * SS_FLAGS_FIELD)) | ((uint64_t)type << (8 * SS_TYPE_FIELD));
    STORE_REL((uint64_t *)frame, first);
    *(int32_t *)(frame + SS_TERM_OFFSET_FIELD) = term_offset;
    *(int32_t *)(frame + SS_SESSION_ID_FIELD) = session_id;
    *(int32_t *)(frame + SS_STREAM_ID_FIELD) = stream_id;
    *(int32_t *)(frame + SS_TERM_ID_FIELD) = term_id;
}

int ss_rotate_log(uint8_t *meta, int32_t current_term_count, int32_t current_term_id) {
    /* Term ids wrap (an initial term id is random, so INT32_MAX + 1 comes in normal use):
     * their arithmetic is unsigned.  The caller never rotates past term count INT32_MAX. */
    if (current_term_count < 0 || current_term_count == INT32_MAX) return 0;
    int32_t next_term_id = (int32_t)((uint32_t)current_term_id + 1);
    int32_t next_term_count = current_term_count + 1;
    int32_t next_index = next_term_count % SS_PARTITION_COUNT;
    int32_t expected_term_id = (int32_t)((uint32_t)next_term_id - SS_PARTITION_COUNT);
    int64_t *tail = tail_counter(meta, next_index);
    for (;;) {
        int64_t raw = LOAD_ACQ(tail);
        if ((int32_t)(raw >> 32) != expected_term_id) break; /* already rotated by another writer */
        if (ss_cas_i64(tail, raw, (int64_t)((uint64_t)(uint32_t)next_term_id << 32))) break;
    }
    int32_t expected = current_term_count;
    return __atomic_compare_exchange_n(active_term_count_ptr(meta), &expected, next_term_count, 0,
                                       __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
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

static inline void signal_readers(const ss_appender_t *a) {
    ss_signal((int32_t *)(a->meta + SS_META_READER_SIGNAL), (const int32_t *)(a->meta + SS_META_READER_WAITERS));
    /* The sender waits for any new data: INT64_MAX passes whatever wake position is set. */
    if (a->doorbell_fd >= 0) ss_ring_doorbell(a->meta, a->doorbell_fd, INT64_MAX);
}

/* The claim ran past the end of the term: pad the rest (if this writer crossed the end) and
 * rotate.  Returns ADMIN_ACTION, or MAX_POSITION_EXCEEDED when the next term is beyond reach. */
static int64_t end_of_term(const ss_appender_t *a, uint8_t *term, int32_t term_offset, int32_t term_id,
                           int32_t term_count) {
    if (term_offset < a->term_length) {
        int32_t padding = a->term_length - term_offset;
        uint8_t *frame = term + term_offset;
        write_header(frame, padding, SS_UNFRAGMENTED, SS_HDR_TYPE_PAD, term_offset, a->session_id,
                     a->stream_id, term_id);
        STORE_REL((int32_t *)frame, padding);
    }
    if (term_count == INT32_MAX) return SS_MAX_POSITION_EXCEEDED;
    int64_t next_term_position = ((int64_t)term_count + 1) << a->position_bits;
    if (next_term_position >= a->max_position) return SS_MAX_POSITION_EXCEEDED;
    ss_rotate_log(a->meta, term_count, term_id);
    return SS_ADMIN_ACTION;
}

static inline int32_t fragmented_length(const ss_appender_t *a, int32_t length) {
    int32_t full = length / a->max_payload;
    int32_t rem = length % a->max_payload;
    int32_t last = rem > 0 ? align32(rem + SS_HEADER_LENGTH) : 0;
    return full * (a->max_payload + SS_HEADER_LENGTH) + last;
}

/* Where a claim landed. */
typedef struct {
    uint8_t *term;
    int32_t term_offset;
    int32_t term_id;
    int32_t term_count;
    int32_t index;
} claim_t;

/* Claim `length` aligned bytes in the active term: 0 on success (*out filled), or ADMIN_ACTION
 * (rotation in progress, or this claim crossed the term's end and rotated), BACK_PRESSURED,
 * MAX_POSITION_EXCEEDED.  The limit is checked before the atomic add, as Aeron does.  An
 * exclusive appender (a->exclusive) claims with a release store of the tail instead. */
static inline __attribute__((always_inline)) int64_t claim(const ss_appender_t *a, int32_t length,
                                                          claim_t *out) {
    uint8_t *meta = a->meta;
    int32_t term_count = active_term_count(meta);
    if (term_count < 0) return SS_MAX_POSITION_EXCEEDED;
    int32_t index = term_count % SS_PARTITION_COUNT;
    int64_t *tail = tail_counter(meta, index);
    int64_t raw = __atomic_load_n(tail, __ATOMIC_ACQUIRE);
    int32_t term_id = (int32_t)(raw >> 32);
    int64_t raw_offset = raw & 0xFFFFFFFFLL;
    int32_t term_offset = raw_offset > a->term_length ? a->term_length : (int32_t)raw_offset;
    if (term_count != (int32_t)((uint32_t)term_id - (uint32_t)a->initial_term_id)) return SS_ADMIN_ACTION;
    int64_t position = ((int64_t)term_count << a->position_bits) + term_offset;
    if (position >= LOAD_ACQ(a->publication_limit)) return SS_BACK_PRESSURED;

    uint8_t *term = a->log + (int64_t)index * a->term_length;
    if (a->exclusive) {
        /* The log's only writer: the tail just read is still the tail, so the claim is a
         * release store of the next one (Aeron's ExclusiveTermAppender), never an atomic add.
         * The tail moves as the add would move it, past the term's end too (end_of_term pads
         * the rest), so both leave the same log. */
        STORE_REL(tail, raw + length);
        if ((int64_t)term_offset + length > a->term_length)
            return end_of_term(a, term, term_offset, term_id, term_count);
    } else {
        raw = __atomic_fetch_add(tail, (int64_t)length, __ATOMIC_SEQ_CST);
        term_id = (int32_t)(raw >> 32);
        raw_offset = raw & 0xFFFFFFFFLL;
        term_offset = raw_offset > a->term_length ? a->term_length : (int32_t)raw_offset;
        if ((int64_t)term_offset + length > a->term_length) return end_of_term(a, term, term_offset, term_id, term_count);
    }
    out->term = term;
    out->term_offset = term_offset;
    out->term_id = term_id;
    out->term_count = term_count;
    out->index = index;
    return 0;
}

/* One append attempt: returns the new position, or a negative code.  Every frame of the
 * message carries reserved_value (Aeron calls its supplier per fragment; one value for all the
 * fragments of one message here).  Inlined in append (reserved value 0: the plain offer's code
 * as it was) and append_rv. */
static inline __attribute__((always_inline)) int64_t
append_frames(const ss_appender_t *a, const uint8_t *msg, int32_t length, int64_t reserved_value) {
    int32_t total = length <= a->max_payload ? align32(length + SS_HEADER_LENGTH) : fragmented_length(a, length);
    claim_t at;
    int64_t rc = claim(a, total, &at);
    if (rc != 0) return rc;
    uint8_t *term = at.term;
    int32_t term_offset = at.term_offset, term_id = at.term_id;

    if (length <= a->max_payload) {
        uint8_t *frame = term + term_offset;
        int32_t frame_length = length + SS_HEADER_LENGTH;
        write_header(frame, frame_length, SS_UNFRAGMENTED, SS_HDR_TYPE_DATA, term_offset, a->session_id,
                     a->stream_id, term_id);
        *(int64_t *)(frame + SS_RESERVED_VALUE_FIELD) = reserved_value;
        memcpy(frame + SS_HEADER_LENGTH, msg, (size_t)length);
        STORE_REL((int32_t *)frame, frame_length);
    } else {
        int32_t remaining = length, offset = term_offset, consumed = 0;
        uint8_t flags = SS_BEGIN_FLAG;
        while (remaining > 0) {
            int32_t chunk = remaining < a->max_payload ? remaining : a->max_payload;
            int32_t frame_length = chunk + SS_HEADER_LENGTH;
            if (chunk == remaining) flags |= SS_END_FLAG;
            uint8_t *frame = term + offset;
            write_header(frame, frame_length, flags, SS_HDR_TYPE_DATA, offset, a->session_id, a->stream_id, term_id);
            *(int64_t *)(frame + SS_RESERVED_VALUE_FIELD) = reserved_value;
            memcpy(frame + SS_HEADER_LENGTH, msg + consumed, (size_t)chunk);
            STORE_REL((int32_t *)frame, frame_length);
            consumed += chunk;
            remaining -= chunk;
            offset += align32(frame_length);
            flags = 0;
        }
    }
    /* The position after this message, from where the claim actually landed. */
    return ((int64_t)at.term_count << a->position_bits) + term_offset + total;
}

static int64_t append(const ss_appender_t *a, const uint8_t *msg, int32_t length) {
    return append_frames(a, msg, length, 0);
}

static int64_t append_rv(const ss_appender_t *a, const uint8_t *msg, int32_t length,
                         int64_t reserved_value) {
    return append_frames(a, msg, length, reserved_value);
}

int64_t ss_refine(ss_appender_t *a, int64_t result) {
    if (a->closed) return SS_CLOSED;
    if (result != SS_BACK_PRESSURED) return result;
    if (LOAD_ACQ((const int32_t *)(a->meta + SS_META_IS_CONNECTED)) != 1) return SS_NOT_CONNECTED;
    int64_t limit = LOAD_ACQ(a->publication_limit);
    int new_hit = limit != a->last_limit_hit;
    if (new_hit) {
        a->last_limit_hit = limit;
        if (a->back_pressure_events) __atomic_fetch_add(a->back_pressure_events, 1, __ATOMIC_SEQ_CST);
        /* The time first: the driver reads the position, then the time that goes with it. */
        STORE_REL((int64_t *)(a->meta + SS_META_LIMIT_HIT_TIME), monotonic_ns());
        STORE_REL((int64_t *)(a->meta + SS_META_LIMIT_HIT_POSITION), limit);
    }
    if (a->driver_signal && (new_hit || a->signal_every_refusal)) ss_signal(a->driver_signal, a->driver_waiters);
    return SS_BACK_PRESSURED;
}

/* The position the next append would start at (the active term's tail, capped at its end). */
static inline int64_t producer_position(const ss_appender_t *a) {
    int32_t term_count = active_term_count(a->meta);
    if (term_count < 0) return 0;
    int32_t index = term_count % SS_PARTITION_COUNT;
    int64_t raw = LOAD_ACQ((const int64_t *)(a->meta + SS_META_TAIL_COUNTERS + 8 * index));
    int64_t offset = raw & 0xFFFFFFFFLL;
    if (offset > a->term_length) offset = a->term_length;
    return ((int64_t)term_count << a->position_bits) + offset;
}

void ss_publish_limit(int64_t *limit, int64_t value, uint8_t *meta) {
    STORE_REL(limit, value);
    STORE_REL((int64_t *)(meta + SS_META_LIMIT_MOVED_TIME), monotonic_ns());
    ss_signal((int32_t *)(meta + SS_META_PUBLISHER_SIGNAL),
              (const int32_t *)(meta + SS_META_PUBLISHER_WAITERS));
}

int ss_has_credit(const ss_appender_t *a) {
    if (LOAD_ACQ(&a->closed)) return 1;
    if (LOAD_ACQ((const int32_t *)(a->meta + SS_META_IS_CONNECTED)) != 1) return 0;
    /* As claim(): an append starts while the position is below the limit. */
    return producer_position(a) < LOAD_ACQ(a->publication_limit);
}

int ss_await_credit(const ss_appender_t *a, int64_t spin_ns, int64_t yield_ns,
                    int64_t timeout_ns) {
    int64_t start = monotonic_ns();
    int64_t deadline = timeout_ns < 0 ? -1 : start + timeout_ns;
    for (uint32_t n = 0;; n++) {
        if (ss_has_credit(a)) return 1;
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
        if (ss_has_credit(a)) return 1;
        int64_t now = monotonic_ns();
        if (now - start >= spin_ns + yield_ns) break;
        if (deadline >= 0 && now >= deadline) return 0;
        sched_yield();
    }
    int32_t *signal = (int32_t *)(a->meta + SS_META_PUBLISHER_SIGNAL);
    int32_t *waiters = (int32_t *)(a->meta + SS_META_PUBLISHER_WAITERS);
    __atomic_fetch_add(waiters, 1, __ATOMIC_SEQ_CST);
    int result = 0;
    for (;;) {
        int32_t seen = __atomic_load_n(signal, __ATOMIC_SEQ_CST);
        /* Registered, then re-checked: the driver stores the limit, then reads the waiters
         * (ss_signal), so either it sees us or we see its limit. */
        if (ss_has_credit(a)) { result = 1; break; }
        int64_t remaining = -1;
        if (deadline >= 0) {
            remaining = deadline - monotonic_ns();
            if (remaining <= 0) break;
        }
        int rc = ss_futex_wait(signal, seen, remaining);
        if (rc == EAGAIN) continue; /* the word moved before we slept: look again */
        /* Woken, timed out or interrupted (EINTR: Python delivers signals such as
         * KeyboardInterrupt): return either way, the caller looks again. */
        result = ss_has_credit(a);
        break;
    }
    __atomic_fetch_sub(waiters, 1, __ATOMIC_SEQ_CST);
    return result;
}

int64_t ss_offer(ss_appender_t *a, const char *msg, int32_t length) {
    if (a->closed) return SS_CLOSED; /* before touching a log that may be unmapped */
    if (length < 0 || length > a->max_message_length) return SS_INVALID_LENGTH;
    int64_t result = append(a, (const uint8_t *)msg, length);
    if (result > 0) {
        signal_readers(a);
        return result;
    }
    return ss_refine(a, result);
}

int64_t ss_offer_rv(ss_appender_t *a, const char *msg, int32_t length, int64_t reserved_value) {
    if (a->closed) return SS_CLOSED;
    if (length < 0 || length > a->max_message_length) return SS_INVALID_LENGTH;
    int64_t result = append_rv(a, (const uint8_t *)msg, length, reserved_value);
    if (result > 0) {
        signal_readers(a);
        return result;
    }
    return ss_refine(a, result);
}

/* Claim a run of unfragmented messages with one atomic add (one store, exclusive) and write
 * them; returns how many were written (0: nothing fits here, the caller falls back to single
 * appends). */
static int32_t append_run(ss_appender_t *a, const uint8_t *data, const int32_t *lengths,
                          const int64_t *reserved_values, int32_t count, int64_t *position_out) {
    uint8_t *meta = a->meta;
    int32_t term_count = active_term_count(meta);
    if (term_count < 0) return 0; /* the single appends say why */
    int32_t index = term_count % SS_PARTITION_COUNT;
    int64_t *tail = tail_counter(meta, index);
    int64_t raw = __atomic_load_n(tail, __ATOMIC_ACQUIRE);
    int32_t term_id = (int32_t)(raw >> 32);
    int64_t raw_offset = raw & 0xFFFFFFFFLL;
    if (raw_offset >= a->term_length) return 0;
    if (term_count != (int32_t)((uint32_t)term_id - (uint32_t)a->initial_term_id)) return 0;
    int64_t position = ((int64_t)term_count << a->position_bits) + raw_offset;
    int64_t room = LOAD_ACQ(a->publication_limit) - position;
    if (a->term_length - raw_offset < room) room = a->term_length - raw_offset;
    int32_t run = 0;
    int64_t total = 0;
    while (run < count && lengths[run] <= a->max_payload) {
        int32_t aligned = align32(lengths[run] + SS_HEADER_LENGTH);
        if (total + aligned > room) break;
        total += aligned;
        run++;
    }
    if (run == 0) return 0;
    if (a->exclusive) {
        /* The only writer (claim()): the run fits in the term, and the tail moves by a store. */
        STORE_REL(tail, raw + total);
    } else {
        raw = __atomic_fetch_add(tail, total, __ATOMIC_SEQ_CST);
        term_id = (int32_t)(raw >> 32);
        raw_offset = raw & 0xFFFFFFFFLL;
    }
    int32_t term_offset = raw_offset > a->term_length ? a->term_length : (int32_t)raw_offset;
    uint8_t *term = a->log + (int64_t)index * a->term_length;
    if ((int64_t)term_offset + total > a->term_length) {
        /* Another writer moved the tail meanwhile and the run no longer fits: this claim
         * crossed the end of the term, so pad and rotate exactly as a single append would. */
        end_of_term(a, term, term_offset, term_id, term_count);
        return 0;
    }
    int32_t offset = term_offset;
    for (int32_t i = 0; i < run; i++) {
        int32_t frame_length = lengths[i] + SS_HEADER_LENGTH;
        uint8_t *frame = term + offset;
        write_header(frame, frame_length, SS_UNFRAGMENTED, SS_HDR_TYPE_DATA, offset, a->session_id,
                     a->stream_id, term_id);
        *(int64_t *)(frame + SS_RESERVED_VALUE_FIELD) = reserved_values ? reserved_values[i] : 0;
        memcpy(frame + SS_HEADER_LENGTH, data, (size_t)lengths[i]);
        STORE_REL((int32_t *)frame, frame_length);
        data += lengths[i];
        offset += align32(frame_length);
    }
    *position_out = ((int64_t)term_count << a->position_bits) + offset;
    return run;
}

int32_t ss_offer_batch(ss_appender_t *a, const char *data, int64_t data_length,
                       const int32_t *lengths, int32_t count, int64_t *result) {
    return ss_offer_batch_rv(a, data, data_length, lengths, NULL, count, result);
}

int32_t ss_offer_batch_rv(ss_appender_t *a, const char *data, int64_t data_length,
                          const int32_t *lengths, const int64_t *reserved_values, int32_t count,
                          int64_t *result) {
    if (a->closed) { *result = SS_CLOSED; return 0; }
    int64_t needed = 0;
    for (int32_t i = 0; i < count; i++) {
        if (lengths[i] < 0 || lengths[i] > a->max_message_length) { *result = SS_INVALID_LENGTH; return 0; }
        needed += lengths[i];
    }
    if (needed > data_length) { *result = SS_INVALID_BATCH; return 0; }
    int32_t done = 0;
    int64_t last = 0;
    const uint8_t *cursor = (const uint8_t *)data;
    while (done < count) {
        int64_t run_position = 0;
        int32_t run = append_run(a, cursor, lengths + done,
                                 reserved_values ? reserved_values + done : NULL, count - done,
                                 &run_position);
        if (run > 0) {
            for (int32_t i = 0; i < run; i++) cursor += lengths[done + i];
            done += run;
            last = run_position;
            continue;
        }
        /* A fragmented message, the end of the term or the limit: one at a time. */
        int32_t length = lengths[done];
        int64_t rc = append_rv(a, cursor, length, reserved_values ? reserved_values[done] : 0);
        if (rc == SS_ADMIN_ACTION) continue; /* the rotation is done: retry in the new term */
        if (rc < 0) { if (done == 0) last = ss_refine(a, rc); break; }
        last = rc;
        cursor += length;
        done++;
    }
    if (done > 0) signal_readers(a);
    *result = last;
    return done;
}

int64_t ss_try_claim(ss_appender_t *a, int32_t length, int64_t *frame_offset) {
    if (a->closed) return SS_CLOSED;
    if (length < 0 || length > a->max_payload) return SS_INVALID_LENGTH;
    int32_t frame_length = length + SS_HEADER_LENGTH;
    int32_t total = align32(frame_length);
    claim_t at;
    int64_t rc = claim(a, total, &at);
    if (rc != 0) return ss_refine(a, rc);
    uint8_t *frame = at.term + at.term_offset;
    write_header(frame, frame_length, SS_UNFRAGMENTED, SS_HDR_TYPE_DATA, at.term_offset,
                 a->session_id, a->stream_id, at.term_id);
    *(int64_t *)(frame + SS_RESERVED_VALUE_FIELD) = 0;
    *frame_offset = (int64_t)at.index * a->term_length + at.term_offset;
    return ((int64_t)at.term_count << a->position_bits) + at.term_offset + total;
}

int32_t ss_commit(ss_appender_t *a, uint8_t *frame, int32_t frame_length) {
    /* Only our own claim, still open: the driver may have given it up as padding (a claim
     * held past publication_unblock_timeout), and flipping that back would block the log. */
    int32_t expected = -frame_length;
    int32_t ok = __atomic_compare_exchange_n((int32_t *)frame, &expected, frame_length, 0,
                                             __ATOMIC_RELEASE, __ATOMIC_RELAXED);
    signal_readers(a);
    return ok;
}

int32_t ss_abort(ss_appender_t *a, uint8_t *frame, int32_t frame_length) {
    int32_t expected = -frame_length;
    if (LOAD_ACQ((int32_t *)frame) != expected) return 0; /* given up by the driver already */
    *(uint16_t *)(frame + SS_TYPE_FIELD) = SS_HDR_TYPE_PAD;
    int32_t ok = __atomic_compare_exchange_n((int32_t *)frame, &expected, frame_length, 0,
                                             __ATOMIC_RELEASE, __ATOMIC_RELAXED);
    signal_readers(a);
    return ok;
}

/* ---------------------------------------------------------------- replay block */
int32_t ss_append_block(ss_appender_t *a, const uint8_t *source, int32_t source_term_length,
                        int64_t position, int64_t end_position, int32_t max_length,
                        int64_t *result) {
    if (a->closed) { *result = SS_CLOSED; return 0; } /* before touching a log that may go */
    /* Only an exclusive publication's log: the block is written past the tail before the tail
     * is claimed, which another writer's claim would interleave with. */
    if (!a->exclusive || source_term_length != a->term_length || position < 0 ||
        end_position <= position || (position & (SS_FRAME_ALIGNMENT - 1)) != 0 ||
        (end_position & (SS_FRAME_ALIGNMENT - 1)) != 0 || max_length <= 0) {
        *result = SS_INVALID_BATCH;
        return 0;
    }
    uint8_t *meta = a->meta;
    int32_t term_count = active_term_count(meta);
    if (term_count < 0) { *result = ss_refine(a, SS_MAX_POSITION_EXCEEDED); return 0; }
    int32_t index = term_count % SS_PARTITION_COUNT;
    int64_t *tail = tail_counter(meta, index);
    int64_t raw = LOAD_ACQ(tail);
    int32_t term_id = (int32_t)(raw >> 32);
    int64_t raw_offset = raw & 0xFFFFFFFFLL;
    if (term_count != (int32_t)((uint32_t)term_id - (uint32_t)a->initial_term_id)) {
        *result = SS_ADMIN_ACTION; /* a rotation half done: look again */
        return 0;
    }
    int64_t wanted_count = position >> a->position_bits;
    if (raw_offset >= a->term_length && wanted_count == (int64_t)term_count + 1) {
        /* The last block filled the term (its padding included): into the next one, as an
         * append that meets the end of the term does. */
        if (term_count == INT32_MAX || position >= a->max_position) {
            *result = ss_refine(a, SS_MAX_POSITION_EXCEEDED);
            return 0;
        }
        ss_rotate_log(meta, term_count, term_id);
        *result = SS_ADMIN_ACTION;
        return 0;
    }
    int32_t offset = (int32_t)(position & (a->term_length - 1));
    if (wanted_count != term_count || raw_offset != offset) {
        *result = SS_INVALID_BATCH; /* the publication is elsewhere: not the log's position */
        return 0;
    }
    int64_t limit = LOAD_ACQ(a->publication_limit);
    if (position >= limit) { *result = ss_refine(a, SS_BACK_PRESSURED); return 0; }
    int64_t room = limit - position;
    if (room > max_length) room = max_length;
    int32_t scan_end = a->term_length;
    if (end_position - position < (int64_t)(scan_end - offset))
        scan_end = offset + (int32_t)(end_position - position);
    uint8_t *term = a->log + (int64_t)index * a->term_length;
    int32_t at = offset, first_length = 0;
    while (at < scan_end) {
        const uint8_t *from = source + at;
        /* Another process's log: every field is checked before it moves or sizes anything. */
        int32_t frame_length = LOAD_ACQ((const int32_t *)from);
        if (frame_length < SS_HEADER_LENGTH || frame_length > scan_end - at) break;
        int32_t aligned = align32(frame_length);
        if (at > offset && (int64_t)(at - offset) + aligned > room) break;
        uint16_t type = *(const uint16_t *)(from + SS_TYPE_FIELD);
        uint8_t flags = from[SS_FLAGS_FIELD];
        if (*(const int32_t *)(from + SS_TERM_OFFSET_FIELD) != at ||
            *(const int32_t *)(from + SS_TERM_ID_FIELD) != term_id) break;
        if (type == SS_HDR_TYPE_PAD) {
            if (at + aligned != a->term_length) break; /* padding inside the term */
            flags = SS_UNFRAGMENTED;
        } else if (type != SS_HDR_TYPE_DATA || frame_length - SS_HEADER_LENGTH > a->max_payload) {
            break;
        }
        uint8_t *frame = term + at;
        /* Written as an appender writes a frame: the length negative until the rest is in. */
        write_header(frame, frame_length, flags, type, at, a->session_id, a->stream_id, term_id);
        memcpy(frame + SS_RESERVED_VALUE_FIELD, from + SS_RESERVED_VALUE_FIELD, sizeof(int64_t));
        if (type == SS_HDR_TYPE_DATA)
            memcpy(frame + SS_HEADER_LENGTH, from + SS_HEADER_LENGTH,
                   (size_t)(frame_length - SS_HEADER_LENGTH));
        if (at == offset) first_length = frame_length; /* held: it publishes the block */
        else STORE_REL((int32_t *)frame, frame_length);
        at += aligned;
    }
    int32_t copied = at - offset;
    if (copied == 0) { *result = 0; return 0; } /* the caller looks at what is there */
    uint8_t *first = term + offset;
    const uint8_t *source_first = source + offset;
    /* Copied whole only if the source still holds its first frame (a writer lapping the log
     * or its cleaner reaches that one first); else the block is taken back, unpublished. */
    if (LOAD_ACQ((const int32_t *)source_first) != first_length ||
        *(const int32_t *)(source_first + SS_TERM_ID_FIELD) != term_id) {
        ss_clean(first, copied); /* clean again past the tail, for the next append */
        *result = 0;
        return 0;
    }
    /* The claim: the tail moves from where it was only (an exclusive writer's). */
    if (!__atomic_compare_exchange_n(tail, &raw, raw + copied, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST)) {
        *result = SS_INVALID_BATCH;
        return 0;
    }
    STORE_REL((int32_t *)first, first_length);
    signal_readers(a);
    *result = position + copied;
    return copied;
}

int64_t ss_offer_block(ss_appender_t *a, const uint8_t *block, int32_t length) {
    if (a->closed) return SS_CLOSED; /* before touching a log that may go */
    if (!a->exclusive || length < SS_HEADER_LENGTH || (length & (SS_FRAME_ALIGNMENT - 1)) != 0)
        return SS_INVALID_BATCH;
    uint8_t *meta = a->meta;
    int32_t term_count = active_term_count(meta);
    if (term_count < 0) return ss_refine(a, SS_MAX_POSITION_EXCEEDED);
    int32_t index = term_count % SS_PARTITION_COUNT;
    int64_t *tail = tail_counter(meta, index);
    int64_t raw = LOAD_ACQ(tail);
    int32_t term_id = (int32_t)(raw >> 32);
    int64_t raw_offset = raw & 0xFFFFFFFFLL;
    if (term_count != (int32_t)((uint32_t)term_id - (uint32_t)a->initial_term_id))
        return SS_ADMIN_ACTION; /* a rotation half done: look again */
    if (raw_offset >= a->term_length) { /* the last block or offer ended the term */
        if (term_count == INT32_MAX) return ss_refine(a, SS_MAX_POSITION_EXCEEDED);
        ss_rotate_log(meta, term_count, term_id);
        return SS_ADMIN_ACTION;
    }
    const int32_t offset = (int32_t)raw_offset;
    const int64_t position = ((int64_t)term_count << a->position_bits) + offset;
    if (position >= a->max_position) return ss_refine(a, SS_MAX_POSITION_EXCEEDED);
    if (length > a->term_length - offset) return SS_INVALID_BATCH;
    if (position >= LOAD_ACQ(a->publication_limit)) return ss_refine(a, SS_BACK_PRESSURED);
    /* The caller's memory: every field is checked before the block goes in, and the first
     * frame's length, which publishes it, is the one checked (another thread may write the
     * buffer meanwhile: its bytes are the caller's to keep still). */
    int32_t first_length = 0;
    for (int32_t at = 0; at < length;) {
        const uint8_t *frame = block + at;
        int32_t frame_length;
        memcpy(&frame_length, frame, 4);
        if (frame_length < SS_HEADER_LENGTH || frame_length > length - at) return SS_INVALID_BATCH;
        if (at == 0) first_length = frame_length;
        const int32_t aligned = align32(frame_length);
        uint16_t type;
        int32_t term_offset, session_id, stream_id, frame_term_id;
        memcpy(&type, frame + SS_TYPE_FIELD, 2);
        memcpy(&term_offset, frame + SS_TERM_OFFSET_FIELD, 4);
        memcpy(&session_id, frame + SS_SESSION_ID_FIELD, 4);
        memcpy(&stream_id, frame + SS_STREAM_ID_FIELD, 4);
        memcpy(&frame_term_id, frame + SS_TERM_ID_FIELD, 4);
        if (term_offset != offset + at || frame_term_id != term_id ||
            session_id != a->session_id || stream_id != a->stream_id)
            return SS_INVALID_BATCH;
        if (type == SS_HDR_TYPE_PAD) {
            if (at == 0 || offset + at + aligned != a->term_length) return SS_INVALID_BATCH;
        } else if (type != SS_HDR_TYPE_DATA || frame_length - SS_HEADER_LENGTH > a->max_payload) {
            return SS_INVALID_BATCH;
        }
        at += aligned;
        if (at > length) return SS_INVALID_BATCH; /* the last frame's padding is the block's */
    }
    uint8_t *to = a->log + (int64_t)index * a->term_length + offset;
    /* All but the first frame's length, which publishes the block once the tail moved. */
    memcpy(to + 4, block + 4, (size_t)length - 4);
    if (!__atomic_compare_exchange_n(tail, &raw, raw + length, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_SEQ_CST)) {
        ss_clean(to, length); /* another writer: not an exclusive publication's use */
        return SS_INVALID_BATCH;
    }
    STORE_REL((int32_t *)to, first_length);
    signal_readers(a);
    return position + length;
}

/* ---------------------------------------------------------------- reader */
int32_t ss_term_read(const uint8_t *term, int32_t offset, int32_t scan_end, int32_t max_frames,
                     int32_t *starts, int32_t *ends, int32_t *next_offset) {
    int32_t count = 0;
    const int32_t start = offset;
    while (count < max_frames && offset < scan_end) {
        int32_t frame_length = LOAD_ACQ((const int32_t *)(term + offset));
        /* Another process wrote it: a length past the scan would overflow align32 and send
         * the scan backwards (a frame never crosses its term, and scan_end <= term end). */
        if (frame_length <= 0) break;
        if (frame_length > scan_end - offset) {
            if (offset == start) count = -1;
            break;
        }
        if (*(const uint16_t *)(term + offset + SS_TYPE_FIELD) != SS_HDR_TYPE_PAD) {
            if (term[offset + SS_FLAGS_FIELD] != SS_UNFRAGMENTED) {
                if (offset == start) count = -1;
                break;
            }
            starts[count] = offset + SS_HEADER_LENGTH;
            ends[count] = offset + frame_length;
            count++;
        }
        offset += align32(frame_length);
    }
    *next_offset = offset;
    return count;
}

int32_t ss_gather_messages(const uint8_t *term, int32_t term_length, const int32_t *starts,
                           const int32_t *ends, int32_t count, int64_t term_base, uint8_t *out,
                           int64_t out_capacity, int32_t *offsets, int32_t *lengths,
                           int64_t *positions, int64_t *reserved) {
    int64_t used = 0;
    offsets[0] = 0;
    for (int32_t i = 0; i < count; i++) {
        int32_t start = starts[i], end = ends[i];
        if (start < SS_HEADER_LENGTH || end < start || end > term_length) return -1;
        int64_t length = end - start;
        if (used + length > out_capacity || used + length > INT32_MAX) return i;
        memcpy(out + used, term + start, (size_t)length);
        used += length;
        offsets[i + 1] = (int32_t)used;
        lengths[i] = (int32_t)length;
        positions[i] = term_base + align32(end);
        memcpy(&reserved[i], term + start - SS_HEADER_LENGTH + SS_RESERVED_VALUE_FIELD,
               sizeof(int64_t));
    }
    return count;
}

/* ---------------------------------------------------------------- sender scan */
int32_t ss_scan_for_availability(const uint8_t *term, int32_t offset, int32_t max_length, int32_t term_length,
                                 int32_t *padding) {
    int32_t available = 0;
    int32_t limit = term_length - offset;
    if (max_length < limit) limit = max_length;
    *padding = 0;
    /* The publisher wrote these lines on another core: ask for a datagram's worth at once
     * rather than miss on each frame header in turn (not more: with a large MTU the scan
     * mostly stops at the first large frame). */
    const int32_t prefetch = limit < 1536 ? limit : 1536;
    for (int32_t line = 0; line < prefetch; line += 64) __builtin_prefetch(term + offset + line);
    while (available < limit) {
        const uint8_t *frame = term + offset + available;
        int32_t frame_length = LOAD_ACQ((const int32_t *)frame);
        /* A publisher (another process) wrote it: a frame never crosses the end of its term,
         * and a longer one would overflow align32 or send a PAD's jump past the term. */
        if (frame_length <= 0 || frame_length > term_length - offset - available) break;
        int32_t aligned = align32(frame_length);
        if (*(const uint16_t *)(frame + SS_TYPE_FIELD) == SS_HDR_TYPE_PAD) {
            /* Padding ends a datagram: it goes out as its header alone, after the data before it. */
            if (available == 0) { *padding = aligned - SS_HEADER_LENGTH; available = SS_HEADER_LENGTH; }
            break;
        }
        if (available + aligned > limit) break;
        available += aligned;
    }
    return available;
}

/* ---------------------------------------------------------------- receiver */
int32_t ss_rebuild_insert(uint8_t *term, int32_t offset, const uint8_t *packet, int32_t length) {
    uint8_t *dst = term + offset;
    if (LOAD_ACQ((const int32_t *)dst) != 0) return 0; /* already there (a duplicate) */
    /* The header's first word (length, version, flags, type) goes last, in one release store:
     * a reader that sees the length sees the whole frame. */
    if (length > SS_FRAME_HEADER_LENGTH)
        memcpy(dst + SS_FRAME_HEADER_LENGTH, packet + SS_FRAME_HEADER_LENGTH,
               (size_t)(length - SS_FRAME_HEADER_LENGTH));
    STORE_REL((uint64_t *)dst, *(const uint64_t *)packet);
    return 1;
}

int32_t ss_scan_gap(const uint8_t *term, int32_t rebuild_offset, int32_t limit_offset, int32_t *gap_length) {
    int32_t offset = rebuild_offset;
    while (offset < limit_offset) {
        int32_t frame_length = LOAD_ACQ((const int32_t *)(term + offset));
        if (frame_length <= 0 || frame_length > limit_offset - offset) break;
        offset += align32(frame_length);
    }
    if (offset >= limit_offset) { *gap_length = 0; return limit_offset; }
    int32_t gap_begin = offset;
    offset += SS_FRAME_ALIGNMENT;
    while (offset < limit_offset && LOAD_ACQ((const int32_t *)(term + offset)) == 0) offset += SS_FRAME_ALIGNMENT;
    *gap_length = offset - gap_begin;
    return gap_begin;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* linux/mman.h, Linux 5.14 */
#define MADV_POPULATE_WRITE 23
#endif

int32_t ss_populate(uint8_t *address, int64_t length, int32_t writable) {
    if (madvise(address, (size_t)length, writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) != 0)
        return errno;
    return 0;
}

void ss_clean(uint8_t *base, int64_t length) {
    if (length <= 0) return;
    if (length > SS_FRAME_HEADER_LENGTH)
        memset(base + SS_FRAME_HEADER_LENGTH, 0, (size_t)(length - SS_FRAME_HEADER_LENGTH));
    STORE_REL((uint64_t *)base, (uint64_t)0);
}

/* ---------------------------------------------------------------- keepalive thread */
struct ss_keeper {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t stop_changed;  /* on CLOCK_MONOTONIC */
    int stop;
    ss_keeper_params_t p;  /* its paths point at the two below */
    char *lock_path;
    char *counters_path;
};

/* Whether some process holds the driver's lock: a shared lock we could take means none does. */
static int keeper_driver_holds_lock(const char *lock_path) {
    int fd = open(lock_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno != ENOENT;  /* only a missing file says the driver is gone */
    int held = 1;  /* EWOULDBLOCK; any other failure is no verdict: look again next beat */
    if (flock(fd, LOCK_SH | LOCK_NB) == 0) {
        flock(fd, LOCK_UN);
        held = 0;
    }
    close(fd);
    return held;
}

static int keeper_owns_heartbeat(const struct ss_keeper *k) {
    return LOAD_ACQ(k->p.state) == k->p.allocated_state
        && LOAD_ACQ(k->p.type) == k->p.heartbeat_type
        && LOAD_ACQ(k->p.registration) == k->p.registration_id;
}

void ss_name_thread(const char *name) {
    static const char prefix[] = "slipstream-";
    char short_name[16] = "ss-";
    size_t used = 0;
    if (strncmp(name, prefix, sizeof prefix - 1) == 0) {
        name += sizeof prefix - 1;
        used = 3;
    }
    strncpy(short_name + used, name, sizeof short_name - 1 - used);
    short_name[sizeof short_name - 1] = 0;
    prctl(PR_SET_NAME, short_name, 0, 0, 0);
}

static void *keeper_run(void *arg) {
    struct ss_keeper *k = arg;
    struct timespec due;
    clock_gettime(CLOCK_MONOTONIC, &due);
    pthread_mutex_lock(&k->lock);
    while (!k->stop) {
        pthread_mutex_unlock(&k->lock);
        if (keeper_owns_heartbeat(k)) STORE_REL(k->p.heartbeat, monotonic_ns());
        uint8_t verdict = 0;
        struct stat counters;
        const int counters_seen = stat(k->counters_path, &counters) == 0;
        const int counters_gone = !counters_seen && errno == ENOENT;
        if (!keeper_driver_holds_lock(k->lock_path) || counters_gone) {
            verdict = SS_KEEPER_DRIVER_EXITED;
        } else if (counters_seen && ((uint64_t)counters.st_dev != k->p.counters_device
                                     || (uint64_t)counters.st_ino != k->p.counters_inode)) {
            /* A driver that crashed and was restarted between two beats holds the lock
             * again, in new files: ours are no longer anyone's. */
            verdict = SS_KEEPER_DRIVER_REPLACED;
        } else if (k->p.driver_timeout_ns > 0) {  /* also when stat failed otherwise */
            struct timespec wall;
            clock_gettime(CLOCK_REALTIME, &wall);
            const int64_t wall_ns = (int64_t)wall.tv_sec * 1000000000LL + wall.tv_nsec;
            if (wall_ns - LOAD_ACQ(k->p.driver_heartbeat) > k->p.driver_timeout_ns)
                verdict = SS_KEEPER_DRIVER_STOPPED;
        }
        if (verdict) {
            while (write(k->p.notify_fd, &verdict, 1) < 0 && errno == EINTR) {}
            return NULL;
        }
        int64_t next = (int64_t)due.tv_sec * 1000000000LL + due.tv_nsec + k->p.interval_ns;
        const int64_t now_ns = monotonic_ns();
        if (next < now_ns) next = now_ns + k->p.interval_ns;  /* after a stop (SIGSTOP): no burst */
        due.tv_sec = next / 1000000000LL;
        due.tv_nsec = next % 1000000000LL;
        pthread_mutex_lock(&k->lock);
        while (!k->stop && pthread_cond_timedwait(&k->stop_changed, &k->lock, &due) != ETIMEDOUT) {}
    }
    pthread_mutex_unlock(&k->lock);
    return NULL;
}

static void keeper_free(struct ss_keeper *k) {
    free(k->lock_path);
    free(k->counters_path);
    free(k);
}

ss_keeper_t *ss_keeper_start(const ss_keeper_params_t *params) {
    if (params->interval_ns <= 0) {
        errno = EINVAL;
        return NULL;
    }
    struct ss_keeper *k = calloc(1, sizeof *k);
    if (k == NULL) return NULL;
    k->p = *params;
    k->lock_path = strdup(params->lock_path);
    k->counters_path = strdup(params->counters_path);
    if (k->lock_path == NULL || k->counters_path == NULL) {
        keeper_free(k);
        errno = ENOMEM;
        return NULL;
    }
    k->p.lock_path = k->lock_path;
    k->p.counters_path = k->counters_path;
    pthread_condattr_t attributes;
    pthread_condattr_init(&attributes);
    pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC);
    pthread_cond_init(&k->stop_changed, &attributes);
    pthread_condattr_destroy(&attributes);
    pthread_mutex_init(&k->lock, NULL);
    /* The thread takes no signal: they stay the application's (Python's main thread).  A
     * fault of its own still gets the process's handlers (faulthandler's traceback). */
    sigset_t blocked, previous;
    sigfillset(&blocked);
    sigdelset(&blocked, SIGSEGV);
    sigdelset(&blocked, SIGBUS);
    sigdelset(&blocked, SIGFPE);
    sigdelset(&blocked, SIGILL);
    pthread_sigmask(SIG_SETMASK, &blocked, &previous);
    int error = pthread_create(&k->thread, NULL, keeper_run, k);
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    if (error == 0) pthread_setname_np(k->thread, "ss-keepalive");  /* as top -H shows it */
    if (error != 0) {
        pthread_cond_destroy(&k->stop_changed);
        pthread_mutex_destroy(&k->lock);
        keeper_free(k);
        errno = error;
        return NULL;
    }
    return k;
}

void ss_keeper_stop(ss_keeper_t *keeper) {
    if (keeper == NULL) return;
    pthread_mutex_lock(&keeper->lock);
    keeper->stop = 1;
    pthread_cond_signal(&keeper->stop_changed);
    pthread_mutex_unlock(&keeper->lock);
    pthread_join(keeper->thread, NULL);
    pthread_cond_destroy(&keeper->stop_changed);
    pthread_mutex_destroy(&keeper->lock);
    keeper_free(keeper);
}
