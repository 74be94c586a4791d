/* slipstream's client hot paths, the log buffer in C; see native.h for the contracts.  One C
 * file per piece of Aeron's client, sharing native_internal.h:
 *   native_appender.c        the term appender: offer, batch, claim, commit and abort, what
 *                            tells a refusal apart, the publisher's credit
 *   native_block_appender.c  an exclusive publication's block appends (a replay's)
 *   native_reader.c          the term reader (the subscriber's scan) and the gather of what it
 *                            found into a batch
 *   native_scanner.c         the term scanner (the sender's scan for availability)
 *   native_rebuilder.c       the term rebuilder (the receiver's insert)
 *   native_gap_scanner.c     the term gap scanner (the receiver's scan for loss)
 *   native_logbuffer.c       the log's rotation to its next term, cleaning and pre-touch
 *   native_park.c            park and wake: the futex eventcounts, the driver's doorbell, the
 *                            readers' wait for frames and the publishers' wait for credit
 *   native_keeper.c          the client's keepalive thread
 *   native_thread.c          a thread's name
 * and this file, the atomics on shared memory that Python calls (Aeron's aeron_atomic.h).
 * A file includes and calls only files below it (tests/test_layers.py, C_LAYERS): this file
 * and native_thread.c, then native_park.c, native_logbuffer.c, the readers and the keeper,
 * native_appender.c, native_block_appender.c, and fastpath.c above them all. */
#define _GNU_SOURCE
#include "native_internal.h"

/* ---------------------------------------------------------------- atomics */
int64_t ss_load_acquire_i64(const int64_t *addr) { return LOAD_ACQ(addr); }
void ss_store_release_i64(int64_t *addr, int64_t value) { STORE_REL(addr, value); }
int64_t ss_get_and_add_i64(int64_t *addr, int64_t delta) { return __atomic_fetch_add(addr, delta, __ATOMIC_SEQ_CST); }
int ss_cas_i64(int64_t *addr, int64_t expected, int64_t desired) {
    return __atomic_compare_exchange_n(addr, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

int ss_cas_i32(int32_t *addr, int32_t expected, int32_t desired) {
    return __atomic_compare_exchange_n(addr, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
int32_t ss_load_acquire_i32(const int32_t *addr) { return LOAD_ACQ(addr); }
void ss_store_release_i32(int32_t *addr, int32_t value) { STORE_REL(addr, value); }
int32_t ss_get_and_add_i32(int32_t *addr, int32_t delta) { return __atomic_fetch_add(addr, delta, __ATOMIC_SEQ_CST); }
void ss_propose_max_i64(int64_t *addr, int64_t value) {
    int64_t current = LOAD_ACQ(addr);
    while (value > current) {
        if (__atomic_compare_exchange_n(addr, &current, value, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) break;
    }
}
