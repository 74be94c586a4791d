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
