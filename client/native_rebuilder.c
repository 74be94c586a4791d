/* slipstream's client hot paths: the term rebuilder (Aeron's aeron_term_rebuilder.h): the
 * receiver's insert of a datagram's frames into an image's term where they are not yet, the
 * header's first word last, so a reader that sees a frame's length sees all of it.  See
 * native.h for the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <string.h>

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
