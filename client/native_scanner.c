/* slipstream's client hot paths: the term scanner (Aeron's aeron_term_scanner.h): the
 * sender's scan for availability, the bytes of whole committed frames from an offset that fit
 * one datagram, a padding frame that ends the scan going as its header alone (also the block
 * scan of Image.block_poll, Aeron's TermBlockScanner); and the archive's checked scan of a
 * recorded segment, which trusts nothing it reads.  See native.h for the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <string.h>

int32_t ss_scan_for_availability(const uint8_t *term, int32_t offset, int32_t max_length, int32_t term_length,
                                 int32_t *padding) {
    int32_t available = 0;
    int32_t limit = term_length - offset;
    if (max_length < limit) limit = max_length;
    *padding = 0;
    /* Nothing committed at the offset: the scan ends in that one line, without the lines
     * below asked for (an idle log is looked at each duty cycle, at thousands of streams). */
    if (limit <= 0 || LOAD_ACQ((const int32_t *)(term + offset)) <= 0) return 0;
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

int64_t ss_scan_recorded(const uint8_t *segment, int64_t from, int64_t size, int64_t segment_base,
                         int32_t term_length, int32_t position_bits, int32_t initial_term_id,
                         int32_t session_id, int32_t stream_id, int32_t *reason, int64_t *frames) {
    int64_t offset = from;
    int64_t count = 0;
    const int64_t term_mask = (int64_t)term_length - 1;
    *reason = SS_SCAN_END;
    if (from < 0 || (from & (SS_FRAME_ALIGNMENT - 1)) || term_length < SS_HEADER_LENGTH ||
        (term_length & term_mask) || (segment_base & term_mask)) {
        *reason = SS_SCAN_INVALID;
        *frames = 0;
        return from < 0 ? 0 : from;
    }
    while (offset < size) {
        if (size - offset < SS_HEADER_LENGTH) {
            /* A header cut by the end of the file: nothing (zeros) or a torn frame. */
            const uint8_t *rest = segment + offset;
            int64_t n = size - offset, i = 0;
            while (i < n && rest[i] == 0) i++;
            if (i < n) *reason = SS_SCAN_TORN;
            break;
        }
        const uint8_t *frame = segment + offset;
        int32_t frame_length;
        memcpy(&frame_length, frame, sizeof frame_length);
        if (frame_length == 0) break;
        const int64_t position = segment_base + offset;
        const int32_t term_offset = (int32_t)(position & term_mask);
        uint16_t type;
        int32_t field_offset, field_session, field_stream, field_term_id;
        memcpy(&type, frame + SS_TYPE_FIELD, sizeof type);
        memcpy(&field_offset, frame + SS_TERM_OFFSET_FIELD, sizeof field_offset);
        memcpy(&field_session, frame + SS_SESSION_ID_FIELD, sizeof field_session);
        memcpy(&field_stream, frame + SS_STREAM_ID_FIELD, sizeof field_stream);
        memcpy(&field_term_id, frame + SS_TERM_ID_FIELD, sizeof field_term_id);
        const int32_t term_id = (int32_t)((uint32_t)initial_term_id +
                                          (uint32_t)(position >> position_bits));
        if (frame_length < SS_HEADER_LENGTH || frame_length > term_length - term_offset ||
            (type != SS_HDR_TYPE_DATA && type != SS_HDR_TYPE_PAD) ||
            field_offset != term_offset || field_term_id != term_id ||
            field_session != session_id || field_stream != stream_id) {
            *reason = SS_SCAN_INVALID;
            break;
        }
        const int64_t aligned = align32(frame_length);
        if (aligned > size - offset) {
            *reason = SS_SCAN_TORN;
            break;
        }
        offset += aligned;
        count++;
    }
    *frames = count;
    return offset;
}
