/*
 * What the C files of the client's hot paths share; native.h has the contracts the Python side
 * calls (cffi's cdef is made from it alone), native.c the map of the files.  Here: acquire and
 * release accesses, the frame alignment, the monotonic clock, the log metadata's tail counters
 * and active term count (Aeron's aeron_logbuffer_descriptor.h), the frame header's writer
 * (Aeron's HeaderWriter), a publisher's credit (the appender's and its wait's) and the
 * wake-up of a log's readers after an append.  All of it is
 * static inline: the appends of two files inline it, so a file boundary costs the hot path
 * no call.  None of it is in native.h, so Python does not see it.  Each C file defines
 * _GNU_SOURCE and includes this header before anything else.
 */
#ifndef SS_NATIVE_INTERNAL_H
#define SS_NATIVE_INTERNAL_H

#include <stdint.h>
#include <time.h>

#include "native.h"

#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static inline int32_t align32(int32_t v) { return (v + (SS_FRAME_ALIGNMENT - 1)) & ~(SS_FRAME_ALIGNMENT - 1); }

static inline int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------ the log's metadata */
static inline int64_t *tail_counter(uint8_t *meta, int32_t index) {
    return (int64_t *)(meta + SS_META_TAIL_COUNTERS + 8 * index);
}

static inline int32_t *active_term_count_ptr(uint8_t *meta) {
    return (int32_t *)(meta + SS_META_ACTIVE_TERM_COUNT);
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

/* ss_has_credit (native.h), which the publisher's wait (ss_await_credit) looks at too. */
static inline int has_credit(const ss_appender_t *a) {
    if (LOAD_ACQ(&a->closed)) return 1;
    if (LOAD_ACQ((const int32_t *)(a->meta + SS_META_IS_CONNECTED)) != 1) return 0;
    /* As claim(): an append starts while the position is below the limit. */
    return producer_position(a) < LOAD_ACQ(a->publication_limit);
}

static inline void signal_readers(const ss_appender_t *a) {
    ss_signal((int32_t *)(a->meta + SS_META_READER_SIGNAL), (const int32_t *)(a->meta + SS_META_READER_WAITERS));
    /* The sender waits for any new data: INT64_MAX passes whatever wake position is set. */
    if (a->doorbell_fd >= 0) ss_ring_doorbell(a->meta, a->doorbell_fd, INT64_MAX);
}

#endif
