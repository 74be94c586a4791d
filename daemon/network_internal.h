/*
 * What the C files of slipstream's network data path share; network.h has the contracts the
 * Python side calls (cffi's cdef is made from it alone), network.c the map of the files.  Here:
 * the atomics, a counter's add, reading a frame's fields, and the two functions every datagram
 * the C half sends leaves through (network_endpoints.c).  None of it is in network.h, so
 * Python does not see it, and the functions are hidden: the module exports no symbol it did
 * not export as one file.  Each C file defines _GNU_SOURCE (sendmmsg, recvmmsg) and includes
 * this header before anything else.
 */
#ifndef SS_NETWORK_INTERNAL_H
#define SS_NETWORK_INTERNAL_H

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <netinet/in.h>
#include <netinet/udp.h>

#include "native.h"
#include "network.h"

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103 /* linux/udp.h, Linux 4.18 */
#endif

#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
/* A function of one C file that another calls: not part of the module's interface. */
#define SS_INTERNAL __attribute__((visibility("hidden")))

static inline void count(int64_t *counter, int64_t delta) {
    if (counter != NULL) __atomic_fetch_add(counter, delta, __ATOMIC_RELAXED);
}

static inline int32_t read_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* The segment size of a UDP GSO message (its UDP_SEGMENT control message), 0: one datagram. */
static inline size_t ss_gso_segment(const struct msghdr *header) {
    if (header->msg_controllen == 0) return 0;
    for (struct cmsghdr *cmsg = CMSG_FIRSTHDR((struct msghdr *)header); cmsg != NULL;
         cmsg = CMSG_NXTHDR((struct msghdr *)header, cmsg)) {
        if (cmsg->cmsg_level == SOL_UDP && cmsg->cmsg_type == UDP_SEGMENT) {
            uint16_t size;
            memcpy(&size, CMSG_DATA(cmsg), sizeof size);
            return size;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ the channel endpoints' sends */
/* One function per direction of endpoint (network_endpoints.c), as Aeron's
 * aeron_send_channel_send and aeron_receive_channel_endpoint_send, with the frame doors of
 * network.h (ss_send_channel_send_frame, ss_receive_channel_send_frame) beside them: every
 * datagram the driver sends, from either half, leaves through them, and below them a
 * transport binding's `send` makes the system call (nothing else calls sendmmsg, sendmsg,
 * sendto or send for a datagram).  These two only send; what a send counts (bytes sent,
 * short sends, errors) and what follows from its result (the GSO fallback, retransmissions
 * kept queued, a NAK or SM left to Python) stay with the callers. */

/* A transport binding's table (network.h): the system calls below the sends.  `send` has
 * sendmmsg's contract on `fd` (each message's msg_name its destination, NULL on a connected
 * socket; a UDP_SEGMENT control message makes it a run of datagrams): the messages sent, or
 * -1 (errno).  `context` is the sender's binding_context. */
struct ss_transport_binding {
    int (*send)(void *context, int32_t fd, struct mmsghdr *messages, uint32_t message_count);
};

/* The send channel endpoint's: `messages` (count of them; each one datagram, or a run of
 * datagrams as one UDP GSO message) through the publication's binding and socket (p->fd) to
 * its endpoint's destination (the connected peer when destination_length is 0).  Returns
 * what sendmmsg returns: the messages sent (a full socket takes the first ones), or -1
 * (errno).
 *
 * A table of destinations (p->destinations: multi-destination-cast, or a response
 * publication's): the same messages to every destination, starting
 * one further along the table at each call, and the most any destination took is what was
 * sent: a destination that took fewer (its share of a full socket) lost the rest, which its
 * receiver asks for again (NAKs), as a datagram lost on the way; resending to all until the
 * slowest took everything would starve the stream once the socket fills.  With no
 * destinations every message counts as sent.  A destination the kernel refuses outright
 * (unreachable, filtered, a bad address) costs the others nothing.  Counted here, since the
 * callers see only the whole: the short sends and errors of single destinations (the last
 * errno, and a notice for Python when it is a new one), and the bytes of each destination
 * beyond the one the callers count.  -1 when no destination took anything (errno EAGAIN when
 * one found the socket full, else the last error), or at once for an error every destination
 * would meet (the path refusing GSO on a message that carries UDP_SEGMENT: its caller
 * answers). */
SS_INTERNAL int ss_send_channel_send(ss_send_publication_t *p, struct mmsghdr *messages,
                                     uint32_t message_count);

/* The receive channel endpoint's control frames (NAKs, status messages) from the C half:
 * `frame` to the image's control address through its endpoint's socket (image->control_fd
 * >= 0; the UDP binding: an image's C half sends only through sockets).  Returns
 * what sendto returns: the bytes sent, or -1 (errno).
 *
 * A multi-destination subscription's image (image->connections): to each connection that has
 * a socket and whose data came within the image's liveness timeout at `now_ns`, through its
 * destination's socket (Aeron's ImageConnection).  Returns the bytes all of them took, or -1
 * when every live one failed (errno: EAGAIN if one found its socket full, else the last
 * error) or none was live with a socket (errno ENOTCONN: the Python half then sends it). */
SS_INTERNAL ssize_t ss_receive_channel_send(const ss_image_t *image, const uint8_t *frame,
                                            size_t length, int64_t now_ns);

/* Whether the C half can send an image's control frames itself (a socket and an address, or
 * a multi-destination subscription's connections); else they wait for the Python half. */
static inline int ss_receive_channel_can_send(const ss_image_t *image) {
    if (image->counters == NULL) return 0;
    if (image->connections != NULL) return 1;
    return image->control_fd >= 0 && image->control_address_length > 0;
}

/* ------------------------------------------------------------------ sealed datagrams */
/* An encrypted endpoint's sends (network_crypto.c): `messages` (each one datagram, or a UDP
 * GSO run) sealed into the context's arena, a GSO run as a run of sealed datagrams, and handed
 * to `send` (sendmmsg's contract) in batches.  Returns the caller's messages sent whole (their
 * msg_len set to their plain bytes), or -1 (errno: the send's, or ENOKEY when a datagram
 * could not be sealed).  The sending thread's alone. */
SS_INTERNAL int ss_crypto_send(ss_crypto_t *c, struct mmsghdr *messages, uint32_t message_count,
                               int (*send)(void *, struct mmsghdr *, uint32_t), void *context);
/* One frame sealed into the context's frame buffer (valid until the next call): the buffer,
 * with *length the sealed length, or NULL (not sealed: counted in seal_failures). */
SS_INTERNAL const uint8_t *ss_crypto_seal_frame(ss_crypto_t *c, const uint8_t *frame,
                                                int32_t *length);
/* ss_crypto_open in three steps, so that the receiver decrypts a datagram's frames where they
 * go (an image's term) in one pass.  _begin takes the datagram's clear header (`length` the
 * whole datagram's): the ciphertext's length, or an SS_OPEN_* verdict as ss_crypto_open's
 * (nothing to decrypt then, and no _end).  _update decrypts the next `length` bytes of the
 * ciphertext from `in` to `out` (the same, or apart; in order, all of it, before _end).
 * _end checks the tag (at the ciphertext's end): 0 when the datagram authenticates (its
 * counter then spent), SS_OPEN_FAILED otherwise (counted), when whatever _update wrote is
 * forged or damaged and must not be read.  The receiving thread's. */
SS_INTERNAL int32_t ss_crypto_open_begin(ss_crypto_t *c, const uint8_t *data, int32_t length,
                                         const uint8_t *source, int32_t source_length);
SS_INTERNAL void ss_crypto_open_update(ss_crypto_t *c, const uint8_t *in, uint8_t *out,
                                       int32_t length);
SS_INTERNAL int32_t ss_crypto_open_end(ss_crypto_t *c, const uint8_t *tag,
                                       const uint8_t *source, int32_t source_length);
/* Send what the outbox holds through `fd` (the receiving thread's, after ss_crypto_open): a
 * datagram the socket does not take is dropped, as any, and its exchange's retry covers it. */
SS_INTERNAL void ss_crypto_flush_handshakes(ss_crypto_t *c, int32_t fd);

#endif
