/* slipstream's network data path: the channel endpoints' sends (Aeron's
 * aeron_send_channel_send and aeron_receive_channel_endpoint_send), the one point every
 * datagram the driver sends leaves by, whichever half made it (network_internal.h and
 * network.h have the contracts):
 *
 *   ss_send_channel_send          a publication's data and retransmissions (network_sender.c's
 *                                 send_spans: sendmmsg batches, UDP GSO runs, and the same
 *                                 spans again datagram by datagram when the path refuses GSO);
 *   ss_send_channel_send_frame    its control frames: the C half's heartbeats (network_duty.c)
 *                                 and the Python half's SETUP, RTTM, heartbeats and rate
 *                                 announcements (daemon/media/send_point.py);
 *   ss_receive_channel_send       an image's NAKs and status messages from the C half
 *                                 (network_duty.c's send_naks and send_status_message), to
 *                                 each live connection of a multi-destination subscription's
 *                                 image;
 *   ss_receive_channel_send_frame the Python half's NAKs, status messages and ERRs.
 *
 * Behind the send channel endpoint sits its destination list (Aeron's destination tracker):
 * a multi-destination-cast endpoint's table, or a response publication's own with the one
 * destination learned from its client, each message going to every destination without its
 * callers knowing.  Python decides which destinations exist (daemon/media/destinations.py)
 * and replaces the table between duty cycles; the fan-out is here and nowhere else.  A send
 * endpoint's socket, destination and table are its publications' fields (the transport's
 * attach copies them into each), so the send channel endpoint here is the publication's
 * view of it.
 *
 * Below the sends, the system call is a transport binding's (Aeron's
 * aeron_udp_channel_transport_bindings_t): the UDP one calls sendmmsg on the socket, the
 * simulator's hands each datagram with its destination to the virtual network
 * (ss_virtual_datagram, a callback daemon/media/send_point.py defines), so the simulator runs these
 * sends, fan-out included, as the driver does. */
#define _GNU_SOURCE
#include "network_internal.h"

#include <errno.h>

/* ------------------------------------------------------------------- transport bindings */

static int udp_send(void *context, int32_t fd, struct mmsghdr *messages, uint32_t count_of) {
    (void)context;
    return sendmmsg(fd, messages, count_of, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* cffi's extern "Python+C" (_network_build.py): the virtual network takes one datagram
 * from `context` (the sending transport) to `address`.  Returns what it took (length), or
 * -1 when the port raised (the exception is kept for the Python caller). */
int32_t ss_virtual_datagram(void *context, const uint8_t *address, int32_t address_length,
                            const uint8_t *data, int32_t length);

/* Each message as the datagrams the kernel would make of it (a GSO run cut at its segment
 * size), to the network; the senders give each message one iovec. */
static int virtual_send(void *context, int32_t fd, struct mmsghdr *messages,
                        uint32_t count_of) {
    (void)fd;
    for (uint32_t i = 0; i < count_of; i++) {
        struct msghdr *header = &messages[i].msg_hdr;
        if (header->msg_iovlen != 1 || header->msg_name == NULL) {
            if (i > 0) return (int)i;
            errno = header->msg_name == NULL ? EDESTADDRREQ : EINVAL;
            return -1;
        }
        const uint8_t *data = header->msg_iov[0].iov_base;
        const size_t length = header->msg_iov[0].iov_len;
        const size_t segment = ss_gso_segment(header);
        const size_t step = segment > 0 ? segment : length;
        for (size_t offset = 0; offset < length; offset += step) {
            const size_t piece = length - offset < step ? length - offset : step;
            if (ss_virtual_datagram(context, header->msg_name, (int32_t)header->msg_namelen,
                                    data + offset, (int32_t)piece) < 0) {
                /* The port raised: its exception waits for the Python caller of this send
                 * (send_point.raise_port_errors), and the datagram counts as not sent. */
                if (i > 0) return (int)i;
                errno = EIO;
                return -1;
            }
        }
        messages[i].msg_len = (unsigned int)length;
    }
    return (int)count_of;
}

static const ss_transport_binding_t UDP_BINDING = {.send = udp_send};
static const ss_transport_binding_t VIRTUAL_BINDING = {.send = virtual_send};

const ss_transport_binding_t *ss_udp_binding(void) { return &UDP_BINDING; }
const ss_transport_binding_t *ss_virtual_binding(void) { return &VIRTUAL_BINDING; }

static inline const ss_transport_binding_t *binding_or_udp(const ss_transport_binding_t *b) {
    return b != NULL ? b : &UDP_BINDING;
}

/* One frame in one message of one iovec, to `address` (NULL: connected). */
static void frame_message(struct mmsghdr *message, struct iovec *vector, const uint8_t *frame,
                          size_t length, const uint8_t *address, int32_t address_length) {
    memset(message, 0, sizeof *message);
    vector->iov_base = (void *)frame;
    vector->iov_len = length;
    message->msg_hdr.msg_iov = vector;
    message->msg_hdr.msg_iovlen = 1;
    if (address != NULL && address_length > 0) {
        message->msg_hdr.msg_name = (void *)address;
        message->msg_hdr.msg_namelen = (socklen_t)address_length;
    }
}

/* ---------------------------------------------------------- the send channel endpoint */

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
    const ss_transport_binding_t *binding = binding_or_udp(p->binding);
    const uint32_t start = p->next_destination++ % (uint32_t)count_of;
    int most = -1, full = 0, failed = 0, error = 0, shorter = 0;
    int64_t bytes = 0;
    for (int32_t k = 0; k < count_of; k++) {
        const ss_destination_t *d = &list->entries[(start + (uint32_t)k) % (uint32_t)count_of];
        for (uint32_t i = 0; i < message_count; i++) {
            messages[i].msg_hdr.msg_name = (void *)d->address;
            messages[i].msg_hdr.msg_namelen = (socklen_t)d->length;
        }
        const int rc = binding->send(p->binding_context, p->fd, messages, message_count);
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
        /* One count per failed destination; when every one failed, the caller counts the
         * last as it counts a failed send to one address. */
        count(p->send_errors, most >= 0 || full > 0 ? failed : failed - 1);
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

/* The send of a plain endpoint, and below the sealing of an encrypted one. */
static int send_plain(ss_send_publication_t *p, struct mmsghdr *messages,
                      uint32_t message_count) {
    if (p->destinations != NULL) return send_to_destinations(p, messages, message_count);
    if (p->destination_length > 0) { /* else connected: msg_name stays NULL */
        for (uint32_t i = 0; i < message_count; i++) {
            messages[i].msg_hdr.msg_name = p->destination;
            messages[i].msg_hdr.msg_namelen = (socklen_t)p->destination_length;
        }
    }
    return binding_or_udp(p->binding)->send(p->binding_context, p->fd, messages,
                                            message_count);
}

static int send_sealed(void *p, struct mmsghdr *messages, uint32_t message_count) {
    return send_plain((ss_send_publication_t *)p, messages, message_count);
}

int ss_send_channel_send(ss_send_publication_t *p, struct mmsghdr *messages,
                         uint32_t message_count) {
    if (p->crypto != NULL) return ss_crypto_send(p->crypto, messages, message_count, send_sealed, p);
    return send_plain(p, messages, message_count);
}

int32_t ss_send_channel_send_frame(ss_send_publication_t *p, const uint8_t *frame,
                                   int32_t length, const uint8_t *address,
                                   int32_t address_length) {
    if (address_length <= 0 && p->destinations != NULL && p->destinations->count <= 0)
        return 0;
    const int32_t plain_length = length;
    if (p->crypto != NULL) {
        frame = ss_crypto_seal_frame(p->crypto, frame, &length);
        if (frame == NULL) { /* counted there */
            errno = ENOKEY;
            return -1;
        }
    }
    struct iovec vector;
    struct mmsghdr message;
    frame_message(&message, &vector, frame, (size_t)length, address, address_length);
    int rc;
    if (address_length > 0) { /* to one address: past the endpoint's destinations */
        rc = binding_or_udp(p->binding)->send(p->binding_context, p->fd, &message, 1);
    } else {
        rc = send_plain(p, &message, 1);
    }
    if (rc > 0) {
        count(p->bytes_sent, (int64_t)message.msg_len);
        return p->crypto != NULL ? plain_length : (int32_t)message.msg_len;
    }
    if (rc == 0 || errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
        count(p->short_sends, 1);
        errno = EAGAIN;
    } else if (errno != ECONNREFUSED) { /* an earlier datagram's ICMP error: no one yet */
        count(p->send_errors, 1);
        if (errno != p->last_errno) p->notice = 1; /* Python logs it */
        p->last_errno = errno;
    }
    return -1;
}

/* ------------------------------------------------------- the receive channel endpoint */

/* One frame to `address` through `fd`: the bytes sent, or -1 (errno). */
static ssize_t send_frame(const ss_transport_binding_t *binding, void *context, int32_t fd,
                          const uint8_t *frame, size_t length, const uint8_t *address,
                          int32_t address_length) {
    struct iovec vector;
    struct mmsghdr message;
    frame_message(&message, &vector, frame, length, address, address_length);
    const int rc = binding_or_udp(binding)->send(context, fd, &message, 1);
    if (rc == 1) return (ssize_t)message.msg_len;
    if (rc == 0) errno = EAGAIN;
    return -1;
}

static ssize_t send_to_connections(const ss_image_t *image, const uint8_t *frame, size_t length,
                                   int64_t now_ns) {
    ssize_t total = 0; /* every path's bytes: BYTES_SENT counts what left the host */
    int tried = 0, sent_any = 0, full = 0, error = 0;
    int64_t refused = 0; /* paths whose socket was full: SHORT_SENDS counts each datagram */
    const int32_t slots = image->connection_count < SS_RECEIVE_DESTINATIONS_MAX
                              ? image->connection_count : SS_RECEIVE_DESTINATIONS_MAX;
    for (int32_t i = 0; i < slots; i++) {
        const ss_image_connection_t *c = &image->connections[i];
        if (c->fd < 0 || c->address_length <= 0 || c->address_length > SS_SOCKADDR_MAX ||
            now_ns - c->time_of_last_frame_ns > image->liveness_timeout_ns) continue;
        tried++;
        const ssize_t rc = send_frame(NULL, NULL, c->fd, frame, length, c->address,
                                      c->address_length);
        if (rc >= 0) {
            sent_any = 1;
            total += rc;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            full = 1;
            refused++;
        } else {
            error = errno;
        }
    }
    /* The caller counts one short send when none left (EAGAIN): the others here. */
    if (refused > (sent_any ? 0 : 1))
        count(image->counters->short_sends, refused - (sent_any ? 0 : 1));
    if (sent_any) return total;
    /* None tried (no path live with a socket): the Python half has the frame, and sends it
     * wherever it can, rather than it counting as sent. */
    errno = tried == 0 ? ENOTCONN : full ? EAGAIN : error;
    return -1;
}

/* An image's C half sends only through sockets (ss_receive_channel_can_send): the UDP
 * binding. */
ssize_t ss_receive_channel_send(const ss_image_t *image, const uint8_t *frame, size_t length,
                                int64_t now_ns) {
    if (image->crypto != NULL) {
        int32_t sealed = (int32_t)length;
        frame = ss_crypto_seal_frame(image->crypto, frame, &sealed);
        if (frame == NULL) {
            errno = ENOKEY;
            return -1;
        }
        length = (size_t)sealed;
    }
    if (image->connections != NULL) return send_to_connections(image, frame, length, now_ns);
    return send_frame(NULL, NULL, image->control_fd, frame, length, image->control_address,
                      image->control_address_length);
}

int32_t ss_receive_channel_send_frame(const ss_receiver_t *r, const uint8_t *frame,
                                      int32_t length, const uint8_t *address,
                                      int32_t address_length) {
    if (r->crypto != NULL) {
        frame = ss_crypto_seal_frame(r->crypto, frame, &length);
        if (frame == NULL) {
            errno = ENOKEY;
            return -1;
        }
    }
    const ssize_t sent = send_frame(r->binding, r->binding_context, r->fd, frame,
                                    (size_t)length, address, address_length);
    if (sent >= 0) {
        count(r->counters.bytes_sent, sent);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) {
        count(r->counters.short_sends, 1);
        errno = EAGAIN;
    }
    return (int32_t)sent;
}
