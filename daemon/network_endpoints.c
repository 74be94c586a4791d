/* slipstream's network data path: the channel endpoints' sends (Aeron's
 * aeron_send_channel_endpoint_send and aeron_receive_channel_endpoint_send), the one place
 * each direction's datagrams leave the C half (network_internal.h has the contracts):
 *
 *   ss_send_channel_send     a publication's data and retransmissions (network_sender.c's
 *                            send_spans: sendmmsg batches, UDP GSO runs, and the same spans
 *                            again datagram by datagram when the path refuses GSO) and its
 *                            heartbeats (network_duty.c's heartbeats);
 *   ss_receive_channel_send  an image's NAKs and status messages (network_duty.c's send_naks
 *                            and send_status_message), to each live connection of a
 *                            multi-destination subscription's image.
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

/* The bytes of the first `taken` messages. */
static int64_t bytes_of(const struct mmsghdr *messages, int taken) {
    int64_t bytes = 0;
    for (int i = 0; i < taken; i++)
        for (size_t v = 0; v < messages[i].msg_hdr.msg_iovlen; v++)
            bytes += (int64_t)messages[i].msg_hdr.msg_iov[v].iov_len;
    return bytes;
}

static int carries_gso(const struct mmsghdr *messages, uint32_t message_count) {
    for (uint32_t i = 0; i < message_count; i++)
        if (messages[i].msg_hdr.msg_controllen > 0) return 1;
    return 0;
}

static int send_to_destinations(ss_send_publication_t *p, struct mmsghdr *messages,
                                uint32_t message_count) {
    const ss_destination_list_t *list = p->destinations;
    const int32_t count_of = list->count;
    if (count_of <= 0) return (int)message_count;
    const uint32_t start = p->next_destination++ % (uint32_t)count_of;
    int most = -1, full = 0, failed = 0, error = 0, shorter = 0;
    int64_t bytes = 0;
    for (int32_t k = 0; k < count_of; k++) {
        const ss_destination_t *d = &list->entries[(start + (uint32_t)k) % (uint32_t)count_of];
        for (uint32_t i = 0; i < message_count; i++) {
            messages[i].msg_hdr.msg_name = (void *)d->address;
            messages[i].msg_hdr.msg_namelen = (socklen_t)d->length;
        }
        const int rc = sendmmsg(p->fd, messages, message_count, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (rc >= 0) {
            if (rc < (int)message_count) shorter++;
            if (rc > most) most = rc;
            bytes += bytes_of(messages, rc);
        } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
            full++;
        } else if ((errno == EMSGSIZE || errno == EINVAL || errno == EIO) && p->gso &&
                   carries_gso(messages, message_count)) {
            return -1; /* the path refused GSO: its caller sends again without */
        } else {
            failed++;
            error = errno;
        }
    }
    if (failed > 0) {
        if (most >= 0 || full > 0) count(p->send_errors, failed); /* else its caller counts */
        if (error != p->last_errno) p->notice = 1; /* Python logs it */
        p->last_errno = error;
    }
    if (most < 0) {
        errno = full > 0 ? EAGAIN : error;
        return -1;
    }
    /* The callers count the short send of the whole and the bytes of `most` messages once. */
    if (full + shorter > (most < (int)message_count ? 1 : 0))
        count(p->short_sends, full + shorter - (most < (int)message_count ? 1 : 0));
    count(p->bytes_sent, bytes - bytes_of(messages, most));
    return most;
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

static ssize_t send_to_connections(const ss_image_t *image, const uint8_t *frame, size_t length,
                                   int64_t now_ns) {
    ssize_t total = 0; /* every path's bytes: BYTES_SENT counts what left the host */
    int tried = 0, sent_any = 0, full = 0, error = 0;
    const int32_t slots = image->connection_count < SS_RECEIVE_DESTINATIONS_MAX
                              ? image->connection_count : SS_RECEIVE_DESTINATIONS_MAX;
    for (int32_t i = 0; i < slots; i++) {
        const ss_image_connection_t *c = &image->connections[i];
        if (c->fd < 0 || c->address_length <= 0 || c->address_length > SS_SOCKADDR_MAX ||
            now_ns - c->time_of_last_frame_ns > image->liveness_timeout_ns) continue;
        tried++;
        const ssize_t rc = sendto(c->fd, frame, length, MSG_DONTWAIT,
                                  (const struct sockaddr *)(const void *)c->address,
                                  (socklen_t)c->address_length);
        if (rc >= 0) {
            sent_any = 1;
            total += rc;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            full = 1;
        } else {
            error = errno;
        }
    }
    if (sent_any) return total;
    /* None tried (no path live with a socket): the Python half has the frame, and sends it
     * wherever it can, rather than it counting as sent. */
    errno = tried == 0 ? ENOTCONN : full ? EAGAIN : error;
    return -1;
}

ssize_t ss_receive_channel_send(const ss_image_t *image, const uint8_t *frame, size_t length,
                                int64_t now_ns) {
    if (image->connections != NULL) return send_to_connections(image, frame, length, now_ns);
    return sendto(image->control_fd, frame, length, MSG_DONTWAIT,
                  (const struct sockaddr *)(const void *)image->control_address,
                  (socklen_t)image->control_address_length);
}
