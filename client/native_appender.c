/* slipstream's client hot paths: the term appender (Aeron's TermAppender and
 * ExclusiveTermAppender, aeron_term_appender.c and aeron_exclusive_term_appender.c in its C
 * client before they were folded into its publications) and BufferClaim's commit and abort.
 * A claim checks the publication limit first, as Aeron's does, then moves the active term's
 * tail: an atomic add for a shared publication, a release store for an exclusive one.  A
 * claim that crosses the end of the term pads the rest and rotates the log.  A frame is
 * published by a release store of its positive length.  Here too: what tells a refused offer
 * apart (ss_refine), the publisher's credit (ss_has_credit), and the driver's move of the
 * publication limit (ss_publish_limit), which wakes the publishers parked for credit.  See
 * native.h for the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <string.h>

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

void ss_publish_limit(int64_t *limit, int64_t value, uint8_t *meta) {
    STORE_REL(limit, value);
    STORE_REL((int64_t *)(meta + SS_META_LIMIT_MOVED_TIME), monotonic_ns());
    ss_signal((int32_t *)(meta + SS_META_PUBLISHER_SIGNAL),
              (const int32_t *)(meta + SS_META_PUBLISHER_WAITERS));
}

int ss_has_credit(const ss_appender_t *a) { return has_credit(a); }

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
