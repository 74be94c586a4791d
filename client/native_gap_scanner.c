/* slipstream's client hot paths: the term gap scanner (Aeron's aeron_term_gap_scanner.h):
 * from an image's rebuild offset, over the frames already there, to the first gap below a
 * limit, its offset and length (what the loss detector asks for again).  See native.h for
 * the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

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
