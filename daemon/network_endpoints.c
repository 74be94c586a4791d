/* slipstream's network data path: the channel endpoints' sends (Aeron's
 * aeron_send_channel_endpoint_send and aeron_receive_channel_endpoint_send), the one place
 * each direction's datagrams leave the C half (network_internal.h has the contracts):
 *
 *   ss_send_channel_send     a publication's data and retransmissions (network_sender.c's
 *                            send_spans: sendmmsg batches, UDP GSO runs, and the same spans
 *                            again datagram by datagram when the path refuses GSO) and its
 *                            heartbeats (network_duty.c's heartbeats);
 *   ss_receive_channel_send  an image's NAKs and status messages (network_duty.c's send_naks
 *                            and send_status_message).
 *
 * The Python half's sends (SETUP, RTTM, ERR, and the NAKs, SMs and heartbeats it sends itself)
 * go through daemon/media/udp.py's transports, not here.
 *
 * A send endpoint's socket and destination are its publications' fields (the transport's
 * attach copies them into each), so the send channel endpoint here is the publication's view
 * of it.  The destination is set here and nowhere else: a destination list
 * (multi-destination-cast) would sit behind ss_send_channel_send, each message going to every
 * destination, without its callers changing. */
#define _GNU_SOURCE
#include "network_internal.h"

int ss_send_channel_send(ss_send_publication_t *p, struct mmsghdr *messages,
                         uint32_t message_count) {
    if (p->destination_length > 0) { /* else connected: msg_name stays NULL */
        for (uint32_t i = 0; i < message_count; i++) {
            messages[i].msg_hdr.msg_name = p->destination;
            messages[i].msg_hdr.msg_namelen = (socklen_t)p->destination_length;
        }
    }
    return sendmmsg(p->fd, messages, message_count, MSG_DONTWAIT | MSG_NOSIGNAL);
}

ssize_t ss_receive_channel_send(const ss_image_t *image, const uint8_t *frame, size_t length) {
    return sendto(image->control_fd, frame, length, MSG_DONTWAIT,
                  (const struct sockaddr *)(const void *)image->control_address,
                  (socklen_t)image->control_address_length);
}
