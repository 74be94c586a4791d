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
 * of it.  The destination is set here and nowhere else; a multi-destination-cast endpoint's
 * list of them (p->destinations) sits behind ss_send_channel_send, each message going to
 * every destination, without its callers knowing. */
#define _GNU_SOURCE
#include "network_internal.h"

#include <errno.h>

static int send_to_destinations(ss_send_publication_t *p, struct mmsghdr *messages,
                                uint32_t message_count) {
    const ss_destination_list_t *list = p->destinations;
    int fewest = (int)message_count;
    int failed = 0, error = 0;
    for (int32_t d = 0; d < list->count; d++) {
        for (uint32_t i = 0; i < message_count; i++) {
            messages[i].msg_hdr.msg_name = list->entries[d].address;
            messages[i].msg_hdr.msg_namelen = (socklen_t)list->entries[d].length;
        }
        const int rc = sendmmsg(p->fd, messages, message_count, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (rc >= 0) {
            if (rc < fewest) fewest = rc;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
            fewest = 0; /* the socket is full: all of it again, later */
        } else if (errno == EMSGSIZE || errno == EINVAL || errno == EIO) {
            return -1; /* the path refused GSO: its caller sends again without */
        } else {
            failed++;
            error = errno;
        }
    }
    if (failed == 0) return fewest;
    errno = error;
    if (failed == list->count) return -1; /* its caller counts it */
    count(p->send_errors, failed);
    p->last_errno = error;
    p->notice = 1; /* Python logs it */
    return fewest;
}

int ss_send_channel_send(ss_send_publication_t *p, struct mmsghdr *messages,
                         uint32_t message_count) {
    if (p->destinations != NULL) return send_to_destinations(p, messages, message_count);
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
