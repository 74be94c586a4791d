/* slipstream's client hot paths: the term reader (Aeron's TermReader): a subscriber's scan of
 * one term for committed unfragmented DATA frames, stepping over padding, whose payloads'
 * bounds fastpath.c hands to the application's handler; and the gather of the messages it
 * found into the columns of a batch (slipstream's own, for Image.poll_gathered).  See
 * native.h for the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <string.h>

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

int32_t ss_scan_messages(const uint8_t *term, int32_t offset, int32_t scan_end,
                         int64_t max_messages, int64_t max_bytes, int32_t take_first,
                         int32_t find_time, int64_t time_ns, int64_t *messages, int64_t *bytes,
                         int32_t *reason, int32_t *first_data) {
    int64_t count = 0, size = 0, pending = 0;
    int32_t boundary = offset, at = offset, in_message = 0;
    *reason = SS_MESSAGES_END;
    *first_data = -1;
    while (at <= scan_end - SS_HEADER_LENGTH) {
        int32_t frame_length = LOAD_ACQ((const int32_t *)(term + at));
        /* Another process wrote it: checked before its length moves the walk. */
        if (frame_length < SS_HEADER_LENGTH || frame_length > scan_end - at) break;
        const int32_t aligned = align32(frame_length);
        if (aligned > scan_end - at) break;
        uint16_t type;
        memcpy(&type, term + at + SS_TYPE_FIELD, sizeof type);
        if (type == SS_HDR_TYPE_PAD) {
            at += aligned;
            if (!in_message) boundary = at;
            continue;
        }
        const uint8_t flags = term[at + SS_FLAGS_FIELD];
        if (*first_data < 0) *first_data = at;
        if (flags & SS_BEGIN_FLAG) {
            /* A message past the count is known at its first fragment, whole or not. */
            if (!(take_first && count == 0) && count >= max_messages) {
                *reason = SS_MESSAGES_LIMIT;
                break;
            }
            in_message = 1;
            pending = 0;
        }
        if (!in_message) { /* a fragment of a message begun before `offset` */
            at += aligned;
            if (flags & SS_END_FLAG) boundary = at;
            continue;
        }
        pending += frame_length - SS_HEADER_LENGTH;
        if (flags & SS_END_FLAG) {
            int64_t stamp;
            memcpy(&stamp, term + at + SS_RESERVED_VALUE_FIELD, sizeof stamp);
            /* The top bit marks an envelope (layout.py RESERVED_VALUE_ENVELOPE_BIT): no part
             * of the time. */
            if (find_time && (stamp & INT64_MAX) >= time_ns) {
                *reason = SS_MESSAGES_TIME;
                break;
            }
            if (!(take_first && count == 0) &&
                (count >= max_messages || size + pending > max_bytes)) {
                *reason = SS_MESSAGES_LIMIT;
                break;
            }
            count++;
            size += pending;
            in_message = 0;
            at += aligned;
            boundary = at;
            continue;
        }
        at += aligned;
    }
    *messages = count;
    *bytes = size;
    return boundary;
}
