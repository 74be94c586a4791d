/* slipstream's network data path; see network.h for the contracts.  One C file per component
 * of Aeron's driver, sharing network_internal.h:
 *   network_sender.c      the sender's data path (ss_send_data: the log into sendmmsg, GSO)
 *   network_retransmit.c  the retransmit handler (the answer to NAKs)
 *   network_loss.c        the loss detector (gaps, NAK timers, the loss report)
 *   network_cleaner.c     cleaning a log behind its consumers
 *   network_receiver.c    the receive path (recvmmsg, frames checked, DATA inserted) and a
 *                         send endpoint's control input
 *   network_endpoints.c   the send and receive channel endpoints' sends: where every datagram
 *                         the C half sends leaves
 *   network_duty.c        the duty cycle (the agents' C halves, the Python-due rule, the loop)
 *   network_crypto.c      an encrypted endpoint's sealed datagrams (libcrypto's AEAD and HKDF,
 *                         the anti-replay windows, the Noise handshake that hands each peer
 *                         a sender's traffic secret; docs/CHANNELS.md §7.8)
 * and this file, the positions they all publish and read, and the conductor's watch on the
 * words it reads (ss_words_changed). */
#define _GNU_SOURCE
#include "network_internal.h"

void ss_publish_position(int64_t *cell, int64_t *counter, int64_t value) {
    STORE_REL(cell, value);
    if (counter != NULL) STORE_REL(counter, value);
}

/* A subscriber's position as the driver takes it: a client writes these cells, so a value
 * past rcv-hwm (no subscriber can have read it) is hwm, a negative one 0, and one off the
 * frame alignment is rounded down to it (the scans' and the cleaning's atomic loads and
 * stores need it).  An aligned position inside a frame is taken as it is, as Aeron takes it:
 * only that subscriber's own reading suffers. */
int64_t ss_subscriber_position_bounded(int64_t position, int64_t hwm) {
    if (position > hwm) position = hwm;
    if (position < 0) position = 0;
    return position & ~(int64_t)(SS_FRAME_ALIGNMENT - 1);
}

int32_t ss_words_changed(int64_t *const *words, int64_t *last, int32_t count,
                         int32_t *changed) {
    int32_t n = 0;
    for (int32_t i = 0; i < count; i++) {
        int64_t value = LOAD_ACQ(words[i]);
        if (value != last[i]) {
            last[i] = value;
            changed[n++] = i;
        }
    }
    return n;
}
