/* slipstream's client hot paths: an exclusive publication's block appends (Aeron's
 * ExclusivePublication.offerBlock, once ExclusiveTermAppender.appendBlock).  ss_offer_block
 * appends whole frames the caller wrote; ss_append_block copies a range of another log's term
 * (a replay's).  Both write at the publication's position, past the tail, move the tail from
 * where it was with one compare-and-set (a log with one writer only), and publish the block
 * by storing its first frame's length last.  See native.h for the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <string.h>

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
