/* slipstream's client hot paths: the log buffer itself.  Its rotation to the next term
 * (Aeron's aeron_logbuffer_rotate_log, aeron_logbuffer_descriptor.h), idempotent and safe
 * under racing writers; cleaning a range with the header's first word last (as Aeron's
 * publications and images clean their logs behind their consumers); and the pre-touch of a
 * mapped log, every page faulted in at once (Aeron's pre-touch of mapped memory).  See
 * native.h for the contracts. */
#define _GNU_SOURCE
#include "native_internal.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>

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

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* linux/mman.h, Linux 5.14 */
#define MADV_POPULATE_WRITE 23
#endif

int32_t ss_populate(uint8_t *address, int64_t length, int32_t writable) {
    int advice = writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
    for (int64_t done = 0; done < length; done += SS_POPULATE_STEP) {
        int64_t step = length - done < SS_POPULATE_STEP ? length - done : SS_POPULATE_STEP;
        if (madvise(address + done, (size_t)step, advice) != 0) return errno;
    }
    return 0;
}

void ss_clean(uint8_t *base, int64_t length) {
    if (length <= 0) return;
    if (length > SS_FRAME_HEADER_LENGTH)
        memset(base + SS_FRAME_HEADER_LENGTH, 0, (size_t)(length - SS_FRAME_HEADER_LENGTH));
    STORE_REL((uint64_t *)base, (uint64_t)0);
}
