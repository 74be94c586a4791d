/* slipstream's client hot paths: the term scanner (Aeron's aeron_term_scanner.h): the
 * sender's scan for availability, the bytes of whole committed frames from an offset that fit
 * one datagram, a padding frame that ends the scan going as its header alone.  See native.h
 * for the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

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
