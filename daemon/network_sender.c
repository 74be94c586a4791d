/* slipstream's network data path: the sender's (Aeron's network publication's send and the
 * sender's data path): committed frames straight from a publication's log, UDP GSO runs, the
 * rate limit and the governor's coalescing.  See network.h for the contracts. */
#define _GNU_SOURCE
#include "network_internal.h"

#include <netinet/in.h>
#include <netinet/udp.h>

/* ------------------------------------------------------------------------------- sender */

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103 /* linux/udp.h, Linux 4.18 */
#endif

/* One sendmmsg (ss_send_channel_send) of spans[0..n): with p->gso, a run of spans of the first
 * one's length that follow each other in the log (the last may be shorter, a PAD's header only
 * ends it) is one message with a UDP_SEGMENT of that length.  Returns the spans sent, or -1
 * (errno).  A path that refuses GSO (EMSGSIZE: a segment over its MTU, which a plain send would
 * fragment; EINVAL, EIO: no checksum offload) clears p->gso and the same spans go again
 * datagram by datagram. */
static int32_t send_spans(ss_send_publication_t *p, const ss_span_t *spans, int32_t n) {
    struct mmsghdr messages[SS_SEND_BATCH_MAX + SS_RETRANSMIT_MAX];
    struct iovec vectors[SS_SEND_BATCH_MAX + SS_RETRANSMIT_MAX];
    union {
        char buffer[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } controls[SS_SEND_BATCH_MAX + SS_RETRANSMIT_MAX];
    int32_t ends[SS_SEND_BATCH_MAX + SS_RETRANSMIT_MAX]; /* the span after each message's last */
    /* An encrypted channel seals a run whole, each datagram SS_SEALED_OVERHEAD longer: the run
     * ends where its sealed form still fits one send, or ss_crypto_send would cut it into a
     * full send and a short tail (two GSO buffers for both kernels, and the receiver). */
    const int64_t seal = p->crypto != NULL ? SS_SEALED_OVERHEAD : 0;
    for (;;) {
        const int gso = p->gso;
        int32_t m = 0;
        memset(messages, 0, sizeof(struct mmsghdr) * (size_t)n);
        for (int32_t i = 0; i < n; m++) {
            const int32_t segment = spans[i].length;
            int64_t end = spans[i].log_offset + segment;
            int32_t j = i + 1;
            if (gso) {
                const int64_t most = seal > 0 ? SS_GSO_MAX_BYTES / (segment + seal)
                                              : SS_GSO_MAX_SEGMENTS;
                while (j < n && j - i < SS_GSO_MAX_SEGMENTS && j - i < most &&
                       spans[j - 1].padding == 0 &&
                       spans[j].log_offset == end && spans[j].length <= segment &&
                       end + spans[j].length - spans[i].log_offset <= SS_GSO_MAX_BYTES) {
                    end += spans[j].length;
                    if (spans[j++].length < segment) break; /* a shorter one ends a run */
                }
            }
            struct msghdr *header = &messages[m].msg_hdr;
            vectors[m].iov_base = p->log + spans[i].log_offset;
            vectors[m].iov_len = (size_t)(end - spans[i].log_offset);
            header->msg_iov = &vectors[m];
            header->msg_iovlen = 1; /* msg_name: ss_send_channel_send sets it */
            if (j - i > 1) {
                header->msg_control = controls[m].buffer;
                header->msg_controllen = sizeof controls[m].buffer;
                struct cmsghdr *cmsg = CMSG_FIRSTHDR(header);
                cmsg->cmsg_level = SOL_UDP;
                cmsg->cmsg_type = UDP_SEGMENT;
                cmsg->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                uint16_t size = (uint16_t)segment;
                memcpy(CMSG_DATA(cmsg), &size, sizeof size);
            }
            ends[m] = j;
            i = j;
        }
        int rc = ss_send_channel_send(p, messages, (uint32_t)m);
        if (rc > 0) return ends[rc - 1];
        if (rc < 0 && gso && m < n && (errno == EMSGSIZE || errno == EINVAL || errno == EIO)) {
            p->last_errno = errno;
            p->gso = 0;
            p->notice = 1;
            continue;
        }
        return rc < 0 ? -1 : 0;
    }
}

/* Fill the rate bucket for the time since it was last filled. */
static void fill_rate_credit(ss_send_publication_t *p, int64_t now_ns) {
    const int64_t elapsed = now_ns - p->rate_time_ns;
    if (elapsed <= 0) return;
    const int64_t burst = p->rate_burst > 0 ? p->rate_burst : 1;
    /* 128-bit: a second of a fast link overflows 64 bits as ns x bytes/s. */
    const __int128 gained = (__int128)elapsed * p->rate_limit / 1000000000;
    const __int128 credit = (__int128)p->rate_credit + gained;
    if (credit >= burst) {
        p->rate_credit = burst;
        p->rate_time_ns = now_ns;
    } else if (gained > 0) {
        /* The clock moves on by the time of the whole bytes gained only: the fraction of a
         * byte stays for the next call (a slow rate read every microsecond still fills). */
        p->rate_credit = (int64_t)credit;
        p->rate_time_ns += (int64_t)(gained * 1000000000 / p->rate_limit);
    }
}

/* New data goes once the bucket holds half of it: a batch per wake-up, not a datagram as soon
 * as one byte of credit came back (which would keep the loop from ever parking). */
static int64_t rate_batch(const ss_send_publication_t *p) {
    return p->rate_burst > 1 ? p->rate_burst / 2 : 1;
}

int64_t ss_rate_ready_ns(const ss_send_publication_t *p) {
    const int64_t batch = rate_batch(p);
    if (p->rate_limit <= 0 || p->rate_credit >= batch) return INT64_MIN;
    /* Until the bucket holds a batch: rounded up, never early. */
    const __int128 wait = (((__int128)batch - p->rate_credit) * 1000000000 + p->rate_limit - 1) /
                          p->rate_limit;
    return p->rate_time_ns + (wait > 1000000000 ? 1000000000 : (int64_t)wait);
}

int64_t ss_coalesce_ready_ns(const ss_send_publication_t *p) {
    if (p->coalesce_ns <= 0 || p->retransmit_count > 0) return INT64_MIN;
    const int64_t position = LOAD_ACQ(p->sender_position);
    if (LOAD_ACQ(p->sender_limit) - position < p->mtu) return INT64_MIN; /* the window decides */
    const int32_t index = (int32_t)((position >> p->position_bits) % SS_PARTITION_COUNT);
    int32_t padding = 0;
    const int32_t available = ss_scan_for_availability(
        p->log + (int64_t)index * p->term_length, (int32_t)(position & (p->term_length - 1)),
        p->mtu, p->term_length, &padding);
    if (available <= 0 || available >= p->mtu / 2 || padding) return INT64_MIN;
    return p->time_of_last_send_ns + p->coalesce_ns;
}

int64_t ss_rate_wait_ns(ss_send_publication_t *p, int64_t now_ns) {
    if (p->rate_limit <= 0) return 0;
    fill_rate_credit(p, now_ns);
    const int64_t ready = ss_rate_ready_ns(p);
    return ready <= now_ns ? 0 : ready - now_ns;
}

int32_t ss_send_data(ss_send_publication_t *p, int64_t now_ns, int32_t max_datagrams,
                     ss_span_t *spans) {
    if (max_datagrams > SS_SEND_BATCH_MAX) max_datagrams = SS_SEND_BATCH_MAX;
    if (max_datagrams < 0) max_datagrams = 0;
    /* Of this call only: one that sends nothing (a rate or a coalescing wait) did not find the
     * socket full, and the sender's round must not stop on an earlier call's word. */
    p->socket_full = 0;
    const int64_t start = LOAD_ACQ(p->sender_position); /* this thread is its only writer */
    int64_t position = start;
    const int64_t limit = LOAD_ACQ(p->sender_limit);
    const int32_t mask = p->term_length - 1;
    int32_t retransmits = p->retransmit_count;
    if (retransmits < 0) retransmits = 0;
    if (retransmits > SS_RETRANSMIT_MAX) retransmits = SS_RETRANSMIT_MAX;
    memcpy(spans, p->retransmits, sizeof(ss_span_t) * (size_t)retransmits);
    p->retransmit_count = 0;
    int32_t n = retransmits;
    max_datagrams += retransmits;
    /* New data may take what the rate bucket holds once it holds a batch (the last span may
     * overdraw it); retransmissions draw on it first. */
    int64_t credit = ss_rate_wait_ns(p, now_ns) == 0 ? (p->rate_limit > 0 ? p->rate_credit
                                                                            : INT64_MAX)
                                                      : 0;
    for (int32_t i = 0; i < retransmits; i++) credit -= spans[i].length;
    if (ss_coalesce_ready_ns(p) > now_ns) credit = 0; /* new data waits: retransmits only */
    while (n < max_datagrams && position < limit && credit > 0) {
        int32_t index = (int32_t)((position >> p->position_bits) % SS_PARTITION_COUNT);
        int32_t offset = (int32_t)(position & mask);
        int64_t window = limit - position;
        int32_t max_length = window < p->mtu ? (int32_t)window : p->mtu;
        int32_t padding = 0;
        int32_t available = ss_scan_for_availability(p->log + (int64_t)index * p->term_length,
                                                     offset, max_length, p->term_length, &padding);
        if (available <= 0) break;
        spans[n].log_offset = (int64_t)index * p->term_length + offset;
        spans[n].length = available;
        spans[n].padding = padding;
        n++;
        position += (int64_t)available + padding;
        credit -= available;
    }
    if (n == 0) return 0;
    int32_t sent = n;
    if (p->fd >= 0) {
        sent = send_spans(p, spans, n);
        const int full = sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS);
        if (sent >= 0 || full) {
            /* Retransmissions the socket did not take wait for the next send (this thread is
             * the queue's only user); after another error they are gone, asked for again. */
            const int32_t taken = sent < 0 ? 0 : sent < retransmits ? sent : retransmits;
            memcpy(p->retransmits, spans + taken, sizeof(ss_span_t) * (size_t)(retransmits - taken));
            p->retransmit_count = retransmits - taken;
        }
        p->socket_full = full || (sent >= 0 && sent < n);
        if (sent < 0) {
            if (full) {
                count(p->short_sends, 1);
                return 0;
            }
            /* ECONNREFUSED (an ICMP error of an earlier datagram, reported once), unreachable
             * networks, ...: nothing was sent; the next duty cycle tries again. */
            if (errno != p->last_errno) p->notice = 1; /* logged once per kind of failure */
            p->last_errno = errno;
            count(p->send_errors, 1);
            return -1;
        }
        if (sent < n) count(p->short_sends, 1);
    } else {
        if (p->virtual_room >= 0) {
            /* The simulator's socket takes virtual_room datagrams (what its link's queue
             * holds), as a socket whose send buffer fills takes what fits. */
            if (sent > p->virtual_room) sent = p->virtual_room;
            const int32_t taken = sent < retransmits ? sent : retransmits;
            memcpy(p->retransmits, spans + taken,
                   sizeof(ss_span_t) * (size_t)(retransmits - taken));
            p->retransmit_count = retransmits - taken;
            p->socket_full = sent < n;
            p->virtual_room -= sent;
            if (sent < n) count(p->short_sends, 1);
            if (sent == 0) return 0;
        } else {
            p->socket_full = 0;
        }
        /* Its network takes them all (without a binding the spans are only filled). */
        if (p->binding != NULL) send_spans(p, spans, sent);
    }
    int64_t sent_position = start;
    int64_t bytes = 0;
    for (int32_t i = 0; i < sent; i++) {
        if (i >= retransmits) sent_position += (int64_t)spans[i].length + spans[i].padding;
        bytes += spans[i].length;
    }
    if (sent > retransmits) { /* new data went: the heartbeat timer starts again */
        ss_publish_position(p->sender_position, p->sender_position_counter, sent_position);
        p->time_of_last_send_ns = now_ns;
        p->heartbeat_slot_ns = 0; /* the next heartbeat a timeout after this, not a slot */
    }
    count(p->bytes_sent, bytes);
    if (p->rate_limit > 0) {
        /* Retransmissions may leave the bucket in debt, at most one burst deep: a big repair
         * at a low rate must not hold new data back for seconds. */
        p->rate_credit -= bytes;
        if (p->rate_credit < -p->rate_burst) p->rate_credit = -p->rate_burst;
    }
    if (sent > 0) p->sent_since_python = 1;
    return sent;
}
