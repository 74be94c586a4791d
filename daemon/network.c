/* slipstream's network data path; see network.h for the contracts. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <string.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <sys/uio.h>

#include "native.h"
#include "network.h"

#define LOAD_ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define RECV_BATCH_MAX 64

static inline void count(int64_t *counter, int64_t delta) {
    if (counter != NULL) __atomic_fetch_add(counter, delta, __ATOMIC_RELAXED);
}

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

static inline int32_t read_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ------------------------------------------------------------------------------- sender */

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103 /* linux/udp.h, Linux 4.18 */
#endif

/* One sendmmsg of spans[0..n): with p->gso, a run of spans of the first one's length that
 * follow each other in the log (the last may be shorter, a PAD's header only ends it) is one
 * message with a UDP_SEGMENT of that length.  Returns the spans sent, or -1 (errno).  A path
 * that refuses GSO (EMSGSIZE: a segment over its MTU, which a plain send would fragment;
 * EINVAL, EIO: no checksum offload) clears p->gso and the same spans go again datagram by
 * datagram. */
static int32_t send_spans(ss_send_publication_t *p, const ss_span_t *spans, int32_t n) {
    struct mmsghdr messages[SS_SEND_BATCH_MAX + SS_RETRANSMIT_MAX];
    struct iovec vectors[SS_SEND_BATCH_MAX + SS_RETRANSMIT_MAX];
    union {
        char buffer[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } controls[SS_SEND_BATCH_MAX + SS_RETRANSMIT_MAX];
    int32_t ends[SS_SEND_BATCH_MAX + SS_RETRANSMIT_MAX]; /* the span after each message's last */
    for (;;) {
        const int gso = p->gso;
        int32_t m = 0;
        memset(messages, 0, sizeof(struct mmsghdr) * (size_t)n);
        for (int32_t i = 0; i < n; m++) {
            const int32_t segment = spans[i].length;
            int64_t end = spans[i].log_offset + segment;
            int32_t j = i + 1;
            if (gso) {
                while (j < n && j - i < SS_GSO_MAX_SEGMENTS && spans[j - 1].padding == 0 &&
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
            header->msg_iovlen = 1;
            if (p->destination_length > 0) {
                header->msg_name = p->destination;
                header->msg_namelen = (socklen_t)p->destination_length;
            }
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
        int rc = sendmmsg(p->fd, messages, (unsigned int)m, MSG_DONTWAIT | MSG_NOSIGNAL);
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
    } else if (p->virtual_room >= 0) {
        /* The simulator's socket takes virtual_room datagrams (what its link's queue holds),
         * as a socket whose send buffer fills takes what fits. */
        if (sent > p->virtual_room) sent = p->virtual_room;
        const int32_t taken = sent < retransmits ? sent : retransmits;
        memcpy(p->retransmits, spans + taken, sizeof(ss_span_t) * (size_t)(retransmits - taken));
        p->retransmit_count = retransmits - taken;
        p->socket_full = sent < n;
        p->virtual_room -= sent;
        if (sent < n) count(p->short_sends, 1);
        if (sent == 0) return 0;
    } else {
        p->socket_full = 0;
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

/* -------------------------------------------------------------------------- retransmits */

int32_t ss_resend(ss_send_publication_t *p, int32_t term_id, int32_t term_offset, int32_t length) {
    if (length <= 0) return 0;
    /* Term ids wrap at 32 bits (term_count); a term before the first was never sent (and its
     * negative position would index memory before the log), nor was an offset off the term's
     * frames. */
    const int32_t terms = (int32_t)((uint32_t)term_id - (uint32_t)p->initial_term_id);
    if (terms < 0 || term_offset < 0 || term_offset > p->term_length - SS_HEADER_LENGTH ||
        (term_offset & (SS_FRAME_ALIGNMENT - 1)) != 0) return length;
    const int64_t resend_position = ((int64_t)terms << p->position_bits) + term_offset;
    const int64_t sender_position = LOAD_ACQ(p->sender_position);
    const int64_t bottom = sender_position - (p->term_length >> 1) - p->max_message_length;
    if (resend_position < bottom || resend_position >= sender_position) return length;
    const int32_t index = (int32_t)((resend_position >> p->position_bits) % SS_PARTITION_COUNT);
    const int64_t term_start = (int64_t)index * p->term_length;
    int64_t remaining = sender_position - resend_position;
    if (remaining > length) remaining = length;
    int32_t offset = term_offset;
    int64_t total = 0;
    while (remaining > 0) {
        int32_t padding = 0;
        const int32_t want = remaining < p->mtu ? (int32_t)remaining : p->mtu;
        const int32_t available = ss_scan_for_availability(p->log + term_start, offset, want,
                                                           p->term_length, &padding);
        if (available <= 0) break;
        /* The data path sends it ahead of new data (the sender agent sends right after the
         * control poll that brought the NAK). */
        if (p->retransmit_count >= SS_RETRANSMIT_MAX) {
            count(p->retransmit_overflow, 1); /* the receiver asks again */
            break;
        }
        ss_span_t *span = &p->retransmits[p->retransmit_count++];
        span->log_offset = term_start + offset;
        span->length = available;
        span->padding = padding;
        total += available;
        offset += available + padding;
        remaining -= (int64_t)available + padding;
    }
    if (total > 0) count(p->retransmits_sent, 1);
    return offset - term_offset;
}

static void resent(ss_send_publication_t *p, ss_retransmit_action_t *action, int32_t taken,
                   int64_t now_ns) {
    if (taken <= 0) { /* nothing went: no linger would hide the receiver's next NAK */
        action->state = SS_ACTION_INACTIVE;
        p->active_count--;
        return;
    }
    if (taken < action->length) action->length = taken;
    action->state = SS_ACTION_LINGERING;
    action->expiry_ns = now_ns + p->retransmit_linger_ns;
}

void ss_retransmit_process_timeouts(ss_send_publication_t *p, int64_t now_ns) {
    if (p->active_count <= 0) return;
    const int32_t n = p->action_count < SS_RETRANSMIT_ACTIONS_MAX ? p->action_count
                                                                   : SS_RETRANSMIT_ACTIONS_MAX;
    for (int32_t i = 0; i < n; i++) {
        ss_retransmit_action_t *action = &p->actions[i];
        if (action->state == SS_ACTION_INACTIVE || now_ns < action->expiry_ns) continue;
        if (action->state == SS_ACTION_DELAYED) {
            resent(p, action, ss_resend(p, action->term_id, action->term_offset, action->length),
                   now_ns);
        } else {
            action->state = SS_ACTION_INACTIVE;
            p->active_count--;
        }
    }
}

int64_t ss_retransmit_next_deadline(const ss_send_publication_t *p,
                                    int32_t delayed_only) {
    int64_t deadline = SS_NO_DEADLINE;
    if (p->active_count <= 0) return deadline;
    const int32_t n = p->action_count < SS_RETRANSMIT_ACTIONS_MAX ? p->action_count
                                                                   : SS_RETRANSMIT_ACTIONS_MAX;
    for (int32_t i = 0; i < n; i++) {
        const ss_retransmit_action_t *action = &p->actions[i];
        if (action->state == SS_ACTION_INACTIVE ||
            (delayed_only && action->state != SS_ACTION_DELAYED))
            continue;
        if (action->expiry_ns < deadline)
            deadline = action->expiry_ns;
    }
    return deadline;
}

void ss_retransmit_on_nak(ss_send_publication_t *p, int32_t term_id, int32_t term_offset,
                          int32_t length, int64_t now_ns) {
    /* Finished actions first: the caller need not have run the timers at their deadline. */
    ss_retransmit_process_timeouts(p, now_ns);
    if (term_offset < 0 || term_offset > p->term_length - SS_HEADER_LENGTH ||
        (term_offset & (SS_FRAME_ALIGNMENT - 1)) != 0 || length <= 0) {
        count(p->invalid_packets, 1);
        return;
    }
    const int32_t n = p->action_count < SS_RETRANSMIT_ACTIONS_MAX ? p->action_count
                                                                   : SS_RETRANSMIT_ACTIONS_MAX;
    ss_retransmit_action_t *available = NULL;
    for (int32_t i = 0; i < n; i++) {
        ss_retransmit_action_t *action = &p->actions[i];
        if (action->state == SS_ACTION_INACTIVE) {
            if (available == NULL) available = action;
        } else if (action->term_id == term_id && action->term_offset <= term_offset &&
                   (int64_t)term_offset < (int64_t)action->term_offset + action->length) {
            return; /* a repeat of an action in flight */
        } else if (!p->has_group_semantics) {
            available = action; /* one receiver: its newer NAK takes the single action */
        }
    }
    if (available == NULL) {
        count(p->retransmit_overflow, 1);
        return;
    }
    if (available->state == SS_ACTION_INACTIVE) p->active_count++;
    /* aeron_flow_control_calculate_retransmission_length: min(length, the receiver window x
     * a multiple, the rest of the term). */
    int64_t capped = length;
    if (p->resend_lookahead < capped) capped = p->resend_lookahead;
    if ((int64_t)p->term_length - term_offset < capped) capped = p->term_length - term_offset;
    available->term_id = term_id;
    available->term_offset = term_offset;
    available->length = (int32_t)capped;
    if (p->retransmit_delay_ns == 0) {
        resent(p, available, ss_resend(p, term_id, term_offset, available->length), now_ns);
    } else {
        available->state = SS_ACTION_DELAYED;
        available->expiry_ns = now_ns + p->retransmit_delay_ns;
    }
}

/* ------------------------------------------------------------------------ loss detector */

/* One repair time into the smoothed estimate (RFC 6298 2.2-2.3: alpha 1/8, beta 1/4). */
static void loss_repair_sample(ss_loss_detector_t *d, const ss_gap_t *gap, int64_t now_ns) {
    if (gap->naks != 1) return;
    int64_t sample = now_ns - gap->naked_ns;
    if (sample <= 0) return;
    if (d->repair_samples == 0) {
        d->repair_srtt_ns = sample;
        d->repair_rttvar_ns = sample / 2;
    } else {
        int64_t error = d->repair_srtt_ns - sample;
        if (error < 0) error = -error;
        d->repair_rttvar_ns += (error - d->repair_rttvar_ns) / 4;
        d->repair_srtt_ns += (sample - d->repair_srtt_ns) / 8;
    }
    if (d->repair_samples < INT32_MAX) d->repair_samples++;
}

int64_t ss_loss_retry_delay(const ss_loss_detector_t *d, int64_t first_delay_ns,
                            int64_t retry_delay_ns) {
    if (!d->adapt_retry || d->repair_samples == 0) return retry_delay_ns;
    int64_t delay = d->repair_srtt_ns + 4 * d->repair_rttvar_ns;
    if (delay < first_delay_ns) delay = first_delay_ns;
    return delay < retry_delay_ns ? delay : retry_delay_ns;
}

/* A gap NAKed `naks` times waits retry_ns doubled for each NAK after the first, up to
 * ceiling_ns (RFC 6298 5.5's backoff: a partition must not turn into a NAK every retry). */
static int64_t loss_backoff(int64_t retry_ns, int32_t naks, int64_t ceiling_ns) {
    int64_t delay = retry_ns;
    for (int32_t k = 1; k < naks && delay < ceiling_ns; k++) delay *= 2;
    return delay < ceiling_ns ? delay : ceiling_ns;
}

void ss_loss_all_filled(ss_loss_detector_t *d, int64_t now_ns) {
    int32_t count = d->gap_count;
    if (count > SS_LOSS_GAPS_MAX) count = SS_LOSS_GAPS_MAX;
    for (int32_t i = 0; i < count; i++) loss_repair_sample(d, &d->gaps[i], now_ns);
    d->gap_count = 0;
}

int32_t ss_loss_scan(ss_loss_detector_t *d, const uint8_t *term, int32_t term_id,
                     int32_t rebuild_offset, int32_t limit_offset, int64_t now_ns,
                     int64_t first_delay_ns, int64_t retry_delay_ns) {
    ss_gap_t previous[SS_LOSS_GAPS_MAX];
    int32_t previous_count = d->gap_count;
    if (previous_count < 0) previous_count = 0;
    if (previous_count > SS_LOSS_GAPS_MAX) previous_count = SS_LOSS_GAPS_MAX;
    memcpy(previous, d->gaps, sizeof(ss_gap_t) * (size_t)previous_count);
    int32_t gap_length = 0;
    const int32_t first = ss_scan_gap(term, rebuild_offset, limit_offset, &gap_length);
    d->due_count = 0;
    d->fresh_count = 0;
    d->fresh_bytes = 0;
    int32_t n = 0, j = 0;
    int32_t offset = first;
    for (; offset < limit_offset && n < SS_LOSS_GAPS_MAX;) {
        /* Both lists run in stream order: a gap tracked before is found by walking on, and
         * one walked past (an older term, or before this gap) has been filled, unless this
         * gap lies inside it: only its front arrived, its repair is still coming, and no
         * time is measured (adapting, this gap carries on its timer and NAK count). */
        const ss_gap_t *front_filled = NULL;
        while (j < previous_count &&
               (previous[j].term_id != term_id || previous[j].term_offset < offset)) {
            const ss_gap_t *old = &previous[j++];
            if (old->term_id == term_id && (int64_t)offset < (int64_t)old->term_offset + old->length) {
                front_filled = old;
            } else {
                loss_repair_sample(d, old, now_ns);
            }
        }
        ss_gap_t *gap = &d->gaps[n++];
        gap->term_id = term_id;
        gap->term_offset = offset;
        gap->length = gap_length;
        if (j < previous_count && previous[j].term_offset == offset) {
            gap->expiry_ns = previous[j].expiry_ns;
            gap->naked_ns = previous[j].naked_ns;
            gap->naks = previous[j++].naks;
        } else if (front_filled != NULL && d->adapt_retry) {
            gap->expiry_ns = front_filled->expiry_ns;
            gap->naked_ns = front_filled->naked_ns;
            gap->naks = front_filled->naks;
        } else {
            gap->expiry_ns = now_ns + first_delay_ns;
            gap->naked_ns = 0;
            gap->naks = 0;
            d->fresh_count++;
            d->fresh_bytes += gap_length;
        }
        if (gap_length <= 0) break; /* never: ss_scan_gap reports a gap of at least a frame */
        offset = ss_scan_gap(term, offset + gap_length, limit_offset, &gap_length);
    }
    if (offset >= limit_offset) {
        /* The scan reached the limit: what it did not find again below it was filled (past
         * the limit nothing was tracked: gaps lie below the high-water mark).  A scan cut
         * short by the gap limit knows nothing of the rest. */
        for (; j < previous_count; j++) {
            if (previous[j].term_id != term_id || previous[j].term_offset < limit_offset) {
                loss_repair_sample(d, &previous[j], now_ns);
            }
        }
    }
    /* Timers, once this scan's repairs are measured.  Adapting, a gap NAKed before is due
     * again after the current retry delay (it shortens as repairs are measured: the first
     * losses of a stream were armed with the ceiling); a multicast retry is a random draw
     * per pass, which must not be taken again at every pass. */
    const int64_t retry_ns = ss_loss_retry_delay(d, first_delay_ns, retry_delay_ns);
    for (int32_t i = 0; i < n; i++) {
        ss_gap_t *gap = &d->gaps[i];
        if (d->adapt_retry && gap->naks > 0) {
            const int64_t due_ns = gap->naked_ns + loss_backoff(retry_ns, gap->naks,
                                                                retry_delay_ns);
            if (due_ns < gap->expiry_ns) gap->expiry_ns = due_ns;
        }
        if (now_ns >= gap->expiry_ns) {
            d->due[d->due_count++] = i;
            if (gap->naks < INT32_MAX) gap->naks++;
            gap->naked_ns = now_ns;
            gap->expiry_ns = now_ns + (d->adapt_retry
                                       ? loss_backoff(retry_ns, gap->naks, retry_delay_ns)
                                       : retry_ns);
        }
    }
    d->gap_count = n;
    return first;
}

void ss_loss_record(uint8_t *entry, int64_t length, int64_t count) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const int64_t now = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    int64_t *cells = (int64_t *)(void *)entry;
    if (__atomic_fetch_add(&cells[0], count, __ATOMIC_ACQ_REL) == 0) STORE_REL(&cells[2], now);
    __atomic_fetch_add(&cells[1], length, __ATOMIC_ACQ_REL);
    STORE_REL(&cells[3], now);
}

int64_t ss_loss_next_deadline(const ss_loss_detector_t *d) {
    int64_t deadline = SS_NO_DEADLINE;
    for (int32_t i = 0; i < d->gap_count && i < SS_LOSS_GAPS_MAX; i++) {
        if (d->gaps[i].expiry_ns < deadline) deadline = d->gaps[i].expiry_ns;
    }
    return deadline;
}

/* ----------------------------------------------------------------------------- cleaning */

int32_t ss_clean_toward(ss_log_cleaner_t *c, uint8_t *log, int32_t term_length,
                        int32_t position_bits, int64_t consumer_position) {
    /* Compared before the subtraction: a client writes the consumer's cell, and a position
     * near INT64_MIN must not wrap the target past everything. */
    if (consumer_position <= c->position + term_length) {
        c->target = c->position;
        return 0;
    }
    const int64_t target = consumer_position - term_length;
    c->target = target;
    const int64_t term_end = (c->position | (int64_t)(term_length - 1)) + 1;
    int64_t end = c->position + c->chunk_length;
    if (term_end < end) end = term_end;
    if (target < end) end = target;
    const int64_t index = (c->position >> position_bits) % SS_PARTITION_COUNT;
    ss_clean(log + index * term_length + (c->position & (int64_t)(term_length - 1)),
             end - c->position);
    c->position = end;
    return 1;
}

int64_t ss_clean_due_position(const ss_log_cleaner_t *c, int32_t term_length) {
    const int64_t half_term = term_length >> 1;
    return c->position + term_length + (c->chunk_length < half_term ? c->chunk_length
                                                                    : half_term);
}

int64_t ss_reusable_limit(const ss_log_cleaner_t *c, int32_t term_length) {
    const int64_t mask = (int64_t)term_length - 1;
    return ((c->position + mask) & ~mask) + (SS_PARTITION_COUNT - 1) * (int64_t)term_length;
}

/* ----------------------------------------------------------------------------- receiver */

static inline uint32_t slot_of(int32_t session_id, int32_t stream_id, int32_t mask) {
    uint64_t key = ((uint64_t)(uint32_t)session_id << 32) | (uint32_t)stream_id;
    key *= 0x9E3779B97F4A7C15ULL; /* Fibonacci hashing: session ids are often sequential */
    return (uint32_t)(key >> 32) & (uint32_t)mask;
}

int32_t ss_receiver_set_images(ss_receiver_t *r, ss_image_t **images, int32_t count_) {
    for (int32_t i = 0; i <= r->slot_mask; i++) r->slots[i] = NULL;
    for (int32_t i = 0; i < count_; i++) {
        ss_image_t *image = images[i];
        uint32_t slot = slot_of(image->session_id, image->stream_id, r->slot_mask);
        while (r->slots[slot] != NULL) {
            if (r->slots[slot]->session_id == image->session_id &&
                r->slots[slot]->stream_id == image->stream_id) return -1;
            slot = (slot + 1) & (uint32_t)r->slot_mask;
        }
        r->slots[slot] = image;
        image->control_fd = r->fd;
        image->counters = &r->counters;
    }
    return 0;
}

int32_t ss_receiver_set_publications(ss_receiver_t *r, ss_send_publication_t **publications,
                                     int32_t count_) {
    for (int32_t i = 0; i <= r->publication_mask; i++) r->publications[i] = NULL;
    for (int32_t i = 0; i < count_; i++) {
        ss_send_publication_t *p = publications[i];
        uint32_t slot = slot_of(p->session_id, p->stream_id, r->publication_mask);
        while (r->publications[slot] != NULL) {
            if (r->publications[slot]->session_id == p->session_id &&
                r->publications[slot]->stream_id == p->stream_id) return -1;
            slot = (slot + 1) & (uint32_t)r->publication_mask;
        }
        r->publications[slot] = p;
    }
    return 0;
}

static ss_send_publication_t *find_publication(const ss_receiver_t *r, int32_t session_id,
                                               int32_t stream_id) {
    if (r->publications == NULL) return NULL;
    uint32_t slot = slot_of(session_id, stream_id, r->publication_mask);
    for (;;) {
        ss_send_publication_t *p = r->publications[slot];
        if (p == NULL) return NULL;
        if (p->session_id == session_id && p->stream_id == stream_id) return p;
        slot = (slot + 1) & (uint32_t)r->publication_mask;
    }
}

/* A NAK at a send endpoint: answered here when its publication is in the table and needs no
 * timer; anything else (malformed, unknown, a delayed resend) goes up to Python, which
 * counts or answers it with the same rules. */
static int32_t on_nak(ss_receiver_t *r, const uint8_t *data, int32_t length, int64_t now_ns) {
    if (length < SS_NAK_LENGTH) return SS_RX_TO_PYTHON;
    const int32_t frame_length = read_i32(data);
    if (frame_length < SS_NAK_LENGTH || frame_length > length) return SS_RX_TO_PYTHON;
    ss_send_publication_t *p = find_publication(r, read_i32(data + SS_NAK_SESSION_ID_FIELD),
                                                read_i32(data + SS_NAK_STREAM_ID_FIELD));
    if (p == NULL || !p->answers_naks || p->retransmit_delay_ns != 0) return SS_RX_TO_PYTHON;
    count(r->counters.bytes_received, length);
    count(p->naks_received, 1);
    ss_retransmit_on_nak(p, read_i32(data + SS_NAK_TERM_ID_FIELD), read_i32(data + SS_NAK_TERM_OFFSET_FIELD),
                         read_i32(data + SS_NAK_LENGTH_FIELD), now_ns);
    return SS_RX_CONSUMED;
}

ss_image_t *ss_receiver_find_image(const ss_receiver_t *r, int32_t session_id, int32_t stream_id) {
    uint32_t slot = slot_of(session_id, stream_id, r->slot_mask);
    for (;;) {
        ss_image_t *image = r->slots[slot];
        if (image == NULL) return NULL;
        if (image->session_id == session_id && image->stream_id == stream_id) return image;
        slot = (slot + 1) & (uint32_t)r->slot_mask;
    }
}

static int is_subscribed(const ss_receiver_t *r, int32_t stream_id) {
    for (int32_t i = 0; i < r->stream_count; i++) {
        if (r->streams[i] == stream_id) return 1;
    }
    return 0;
}

/* The address part of a struct sockaddr (family, port, address; not padding or scope). */
static int same_source(const uint8_t *a, int32_t a_length, const uint8_t *b, int32_t b_length) {
    if (a_length < 2 || b_length < 2) return 0;
    sa_family_t family_a, family_b;
    memcpy(&family_a, a, sizeof family_a);
    memcpy(&family_b, b, sizeof family_b);
    if (family_a != family_b) return 0;
    if (family_a == AF_INET) {
        if (a_length < (int32_t)sizeof(struct sockaddr_in) ||
            b_length < (int32_t)sizeof(struct sockaddr_in)) return 0;
        const struct sockaddr_in *x = (const struct sockaddr_in *)(const void *)a;
        const struct sockaddr_in *y = (const struct sockaddr_in *)(const void *)b;
        return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    if (family_a == AF_INET6) {
        if (a_length < (int32_t)sizeof(struct sockaddr_in6) ||
            b_length < (int32_t)sizeof(struct sockaddr_in6)) return 0;
        const struct sockaddr_in6 *x = (const struct sockaddr_in6 *)(const void *)a;
        const struct sockaddr_in6 *y = (const struct sockaddr_in6 *)(const void *)b;
        return x->sin6_port == y->sin6_port &&
               memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr) == 0;
    }
    return 0;
}

/* Whether `data` is frames of one session, stream and term, back to back from term_offset:
 * DATA frames, the last of which may be a PAD header standing for the rest of its term (a
 * PAD alone is one too).  Aeron's scanner sends the PAD that ends a term after the frames
 * before it in one datagram; slipstream's sends it alone.  *padding: what that PAD covers
 * beyond its header, 0 without one. */
static int valid_data_frames(const uint8_t *data, int32_t length, int32_t term_offset,
                             int64_t term_length, int32_t *padding) {
    const int32_t session_id = read_i32(data + SS_SESSION_ID_FIELD);
    const int32_t stream_id = read_i32(data + SS_STREAM_ID_FIELD);
    const int32_t term_id = read_i32(data + SS_TERM_ID_FIELD);
    int64_t offset = 0;
    *padding = 0;
    while (offset < length) {
        const uint8_t *frame = data + offset;
        if (length - offset < SS_HEADER_LENGTH) return 0;
        int32_t frame_length = read_i32(frame);
        uint16_t type = read_u16(frame + SS_TYPE_FIELD);
        if (frame[SS_VERSION_FIELD] != SS_CURRENT_VERSION ||
            (type != SS_HDR_TYPE_DATA && type != SS_HDR_TYPE_PAD)) return 0;
        if (frame_length < SS_HEADER_LENGTH) return 0;
        if (read_i32(frame + SS_TERM_OFFSET_FIELD) != (int64_t)term_offset + offset ||
            read_i32(frame + SS_SESSION_ID_FIELD) != session_id ||
            read_i32(frame + SS_STREAM_ID_FIELD) != stream_id ||
            read_i32(frame + SS_TERM_ID_FIELD) != term_id) return 0;
        if (type == SS_HDR_TYPE_PAD) {
            /* Its header alone, last in the datagram, its length aligned and within the term. */
            if (offset + SS_HEADER_LENGTH != length || (frame_length & (SS_FRAME_ALIGNMENT - 1)) != 0 ||
                (int64_t)term_offset + offset + frame_length > term_length) return 0;
            *padding = frame_length - SS_HEADER_LENGTH;
            return 1;
        }
        int64_t aligned = ((int64_t)frame_length + (SS_FRAME_ALIGNMENT - 1)) & ~(int64_t)(SS_FRAME_ALIGNMENT - 1);
        if (offset + aligned > length) return 0;
        offset += aligned;
    }
    return 1;
}

/* Raise rcv-hwm to `position` if that is higher, and publish it as the image log's tail (the
 * raw tail of its term, then the active term count), as a publisher's append would: a
 * subscriber tells "not written yet" and "cleaned or overwritten" from "held" by the tail,
 * whatever wrote the log.  Frames below the tail may still be missing (loss), never more than
 * the receiver window (at most half a term) behind it.  Returns whether it rose. */
static int raise_hwm(ss_image_t *image, int64_t position) {
    if (position <= LOAD_ACQ(image->receiver_hwm)) return 0;
    ss_publish_position(image->receiver_hwm, image->receiver_hwm_counter, position);
    const int32_t term_count = (int32_t)(position >> image->position_bits);
    const int64_t term_offset = position & (((int64_t)1 << image->position_bits) - 1);
    const uint32_t term_id = (uint32_t)image->initial_term_id + (uint32_t)term_count;
    STORE_REL((int64_t *)(image->meta + SS_META_TAIL_COUNTERS + 8 * (term_count % SS_PARTITION_COUNT)),
              (int64_t)(((uint64_t)term_id << 32) | (uint64_t)term_offset));
    STORE_REL((int32_t *)(image->meta + SS_META_ACTIVE_TERM_COUNT), term_count);
    return 1;
}

/* An over-run frame ending at `end` (see ss_image_t.overrun_position): it counts as where the
 * sender is only if it lands within a term of the over-run before it, as a sender's next
 * datagrams do. */
static void note_overrun(ss_image_t *image, int64_t end) {
    const int64_t previous = image->overrun_candidate;
    image->overrun_candidate = end;
    if (end <= image->overrun_position || previous < 0) return;
    const int64_t distance = end > previous ? end - previous : previous - end;
    if (distance <= image->term_length) image->overrun_position = end;
}

/* aeron_publication_image_insert_packet: the over-run, under-run and heartbeat rules of
 * docs/PROTOCOL.md §4.3, then the copy into the term (body first, header last). */
static void insert_packet(ss_receiver_t *r, ss_image_t *image, const uint8_t *data, int32_t length,
                          int32_t padding, int heartbeat, uint8_t flags, int32_t term_id,
                          int32_t term_offset, int64_t now_ns) {
    int32_t term_count = (int32_t)((uint32_t)term_id - (uint32_t)image->initial_term_id);
    if (term_count < 0) { /* a term before the initial term: no sender sends one */
        count(r->counters.invalid_packets, 1);
        return;
    }
    int64_t position = ((int64_t)term_count << image->position_bits) + term_offset;
    if (heartbeat) {
        /* A heartbeat is held to the over-run rule too (as Aeron's): past the window it would
         * raise the hwm, and the image's tail, to wherever a forged one says. */
        if (position > image->overrun_threshold) {
            count(r->counters.flow_control_over_runs, 1);
            note_overrun(image, position);
            return;
        }
        int64_t floor = image->last_sm_position - image->term_length;
        if (position >= (floor > 0 ? floor : 0)) {
            count(r->counters.heartbeats_received, 1);
            image->time_of_last_packet_ns = now_ns;
            if (raise_hwm(image, position)) image->dirty = 1;
            if ((flags & SS_EOS_FLAG) && image->eos_position < 0) {
                image->eos_position = position;
                image->dirty = 1;
            }
        }
        return;
    }
    if (position + length > image->overrun_threshold) {
        count(r->counters.flow_control_over_runs, 1);
        note_overrun(image, position + length);
        return;
    }
    if (position < image->last_sm_position) {
        count(r->counters.flow_control_under_runs, 1);
        return;
    }
    image->time_of_last_packet_ns = now_ns;
    /* A PAD header stands for the rest of its term. */
    int64_t proposed = position + length + padding;
    /* The tail first, as a publisher claims before it writes: a subscriber that reads the frame
     * and commits past it must find the tail there already. */
    raise_hwm(image, proposed);
    uint8_t *term = image->log + (int64_t)(term_count % SS_PARTITION_COUNT) * image->term_length;
    const int copied = ss_rebuild_insert(term, term_offset, data, length);
    if (!image->signal_pending) {
        if (r->signal_count < SS_SIGNAL_PENDING_MAX) {
            image->signal_pending = 1;
            r->signal_pending[r->signal_count++] = image;
        } else {
            ss_signal((int32_t *)(image->meta + SS_META_READER_SIGNAL),
                      (const int32_t *)(image->meta + SS_META_READER_WAITERS));
        }
    }
    /* Only a datagram copied whole extends what arrived in order: one that found a frame at
     * its offset already may overlap a shorter datagram, with the rest of its range missing. */
    if (copied && position == image->contiguous_position) {
        image->contiguous_position = proposed;
        /* In order: rcv-pos follows without waiting for Python's rebuild pass (which only
         * scans past a gap). */
        if (image->receiver_position != NULL && proposed > LOAD_ACQ(image->receiver_position))
            ss_publish_position(image->receiver_position, image->receiver_position_counter,
                                proposed);
    }
    image->dirty = 1;
}

/* Wake the readers of every image that got data since the last flush. */
static void flush_signals(ss_receiver_t *r) {
    for (int32_t i = 0; i < r->signal_count; i++) {
        ss_image_t *image = r->signal_pending[i];
        image->signal_pending = 0;
        ss_signal((int32_t *)(image->meta + SS_META_READER_SIGNAL),
                  (const int32_t *)(image->meta + SS_META_READER_WAITERS));
    }
    r->signal_count = 0;
}

/* A status message at a send endpoint: taken here when its publication reads SMs in C
 * (ss_send_publication_t.sm_in_c), else up to Python (which also counts what is invalid). */
static int32_t on_status_message(ss_receiver_t *r, const uint8_t *data, int32_t length,
                                 int64_t now_ns) {
    if (length < SS_SM_LENGTH || read_i32(data) != SS_SM_LENGTH || data[SS_FLAGS_FIELD] != 0)
        return SS_RX_TO_PYTHON;
    ss_send_publication_t *p = find_publication(r, read_i32(data + SS_SM_SESSION_ID_FIELD),
                                                read_i32(data + SS_SM_STREAM_ID_FIELD));
    if (p == NULL || !p->sm_in_c) return SS_RX_TO_PYTHON;
    int64_t receiver_id;
    memcpy(&receiver_id, data + SS_SM_RECEIVER_ID_FIELD, 8);
    const int32_t term_offset = read_i32(data + SS_SM_CONSUMPTION_TERM_OFFSET_FIELD);
    int32_t window = read_i32(data + SS_SM_RECEIVER_WINDOW_FIELD);
    const int32_t term_count = (int32_t)((uint32_t)read_i32(data + SS_SM_CONSUMPTION_TERM_ID_FIELD) -
                                         (uint32_t)p->initial_term_id);
    if (receiver_id != p->sm_receiver_id || term_count < 0 || term_offset < 0 ||
        term_offset > p->term_length || window < 0)
        return SS_RX_TO_PYTHON;
    const int64_t position = ((int64_t)term_count << p->position_bits) + term_offset;
    if (position > LOAD_ACQ(p->sender_position)) return SS_RX_TO_PYTHON;
    if (window > p->term_length / 2) window = p->term_length / 2;
    const int64_t limit = position + window;
    if (limit > LOAD_ACQ(p->sender_limit))
        ss_publish_position(p->sender_limit, p->sender_limit_counter, limit);
    p->sm_time_ns = now_ns;
    p->sm_position = position;
    p->sm_window = window;
    p->sm_count++;
    count(p->status_messages_received, 1);
    count(r->counters.bytes_received, length);
    return SS_RX_CONSUMED;
}

static int32_t on_datagram(ss_receiver_t *r, const uint8_t *data, int32_t length,
                           const uint8_t *source, int32_t source_length, int64_t now_ns) {
    if (length < SS_FRAME_HEADER_LENGTH || data[SS_VERSION_FIELD] != SS_CURRENT_VERSION) {
        count(r->counters.invalid_packets, 1);
        return SS_RX_CONSUMED;
    }
    uint16_t type = read_u16(data + SS_TYPE_FIELD);
    if (type == SS_HDR_TYPE_NAK) return on_nak(r, data, length, now_ns);
    if (type == SS_HDR_TYPE_SM) return on_status_message(r, data, length, now_ns);
    if (type != SS_HDR_TYPE_DATA && type != SS_HDR_TYPE_PAD) return SS_RX_TO_PYTHON;
    if (length < SS_HEADER_LENGTH) {
        count(r->counters.invalid_packets, 1);
        return SS_RX_CONSUMED;
    }
    int32_t frame_length = read_i32(data);
    uint8_t flags = data[SS_FLAGS_FIELD];
    int32_t term_offset = read_i32(data + SS_TERM_OFFSET_FIELD);
    int32_t session_id = read_i32(data + SS_SESSION_ID_FIELD);
    int32_t stream_id = read_i32(data + SS_STREAM_ID_FIELD);
    int32_t term_id = read_i32(data + SS_TERM_ID_FIELD);
    ss_image_t *image = ss_receiver_find_image(r, session_id, stream_id);
    if (image == NULL) {
        /* A session we have no image of: Python elicits a SETUP if the stream is wanted. */
        if (type == SS_HDR_TYPE_DATA && !(flags & SS_EOS_FLAG) && is_subscribed(r, stream_id))
            return SS_RX_TO_PYTHON;
        return SS_RX_CONSUMED;
    }
    const int64_t term_length = image->term_length;
    int valid = term_offset >= 0 && (term_offset & (SS_FRAME_ALIGNMENT - 1)) == 0 &&
                (int64_t)term_offset + length <= term_length;
    int32_t padding = 0;
    const int heartbeat = type == SS_HDR_TYPE_DATA && frame_length == 0;
    if (valid && heartbeat) {
        valid = length == SS_HEADER_LENGTH;
    } else if (valid) {
        valid = valid_data_frames(data, length, term_offset, term_length, &padding);
    }
    if (!valid) {
        count(r->counters.invalid_packets, 1);
        return SS_RX_CONSUMED;
    }
    if (image->source_length > 0 &&
        !same_source(image->source, image->source_length, source, source_length)) {
        count(r->counters.foreign_source_drops, 1);
        return SS_RX_CONSUMED;
    }
    count(r->counters.bytes_received, length);
    insert_packet(r, image, data, length, padding, heartbeat, flags, term_id, term_offset, now_ns);
    return SS_RX_CONSUMED;
}

int32_t ss_receiver_on_datagram(ss_receiver_t *r, const uint8_t *data, int32_t length,
                                const uint8_t *source, int32_t source_length, int64_t now_ns) {
    int32_t verdict = on_datagram(r, data, length, source, source_length, now_ns);
    flush_signals(r);
    return verdict;
}

#ifndef UDP_GRO
#define UDP_GRO 104 /* linux/udp.h, Linux 5.0 */
#endif

/* The segment size of a buffer the kernel coalesced (UDP_GRO), or 0. */
static int32_t gro_segment_size(struct msghdr *header) {
    for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(header); cmsg != NULL;
         cmsg = CMSG_NXTHDR(header, cmsg)) {
        if (cmsg->cmsg_level == SOL_UDP && cmsg->cmsg_type == UDP_GRO &&
            cmsg->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int size;
            memcpy(&size, CMSG_DATA(cmsg), sizeof size);
            return size > 0 ? size : 0;
        }
    }
    return 0;
}

/* The test hook: whether to drop this DATA/PAD datagram (debug_receive_data_loss). */
static int debug_drop(ss_receiver_t *r, const uint8_t *data, int32_t length) {
    if (r->loss_threshold == 0 || length < SS_FRAME_HEADER_LENGTH) return 0;
    uint16_t type = read_u16(data + SS_TYPE_FIELD);
    if (type != SS_HDR_TYPE_DATA && type != SS_HDR_TYPE_PAD) return 0;
    uint64_t x = r->loss_state;
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    r->loss_state = x;
    if ((uint32_t)(x >> 32) >= r->loss_threshold) return 0;
    count(r->counters.debug_data_loss_drops, 1);
    return 1;
}

int32_t ss_receiver_recv(ss_receiver_t *r, int32_t fd, int64_t now_ns, int32_t *to_python,
                         int32_t *to_python_count) {
    struct mmsghdr messages[RECV_BATCH_MAX];
    struct iovec vectors[RECV_BATCH_MAX];
    union {
        char buffer[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } controls[RECV_BATCH_MAX];
    int32_t batch = r->batch < RECV_BATCH_MAX ? r->batch : RECV_BATCH_MAX;
    memset(messages, 0, sizeof(struct mmsghdr) * (size_t)batch);
    for (int32_t i = 0; i < batch; i++) {
        vectors[i].iov_base = r->buffers + (int64_t)i * r->buffer_length;
        vectors[i].iov_len = (size_t)r->buffer_length;
        messages[i].msg_hdr.msg_iov = &vectors[i];
        messages[i].msg_hdr.msg_iovlen = 1;
        messages[i].msg_hdr.msg_name = r->sources + (int64_t)i * SS_SOCKADDR_MAX;
        messages[i].msg_hdr.msg_namelen = SS_SOCKADDR_MAX;
        messages[i].msg_hdr.msg_control = controls[i].buffer;
        messages[i].msg_hdr.msg_controllen = sizeof controls[i].buffer;
    }
    *to_python_count = 0;
    int received = recvmmsg(fd, messages, (unsigned int)batch, MSG_DONTWAIT, NULL);
    if (received < 0) {
        /* ECONNREFUSED: an ICMP error for an earlier send on a connected socket, reported
         * once; it is not a datagram. */
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNREFUSED || errno == EINTR)
            return 0;
        r->last_errno = errno;
        count(r->counters.receive_errors, 1);
        return -1;
    }
    for (int32_t i = 0; i < received; i++) {
        struct msghdr *header = &messages[i].msg_hdr;
        const int32_t length = (int32_t)messages[i].msg_len;
        const uint8_t *buffer = (const uint8_t *)vectors[i].iov_base;
        const uint8_t *source = (const uint8_t *)header->msg_name;
        const int32_t source_length = (int32_t)header->msg_namelen;
        r->source_lengths[i] = source_length;
        if (header->msg_flags & MSG_TRUNC) { /* larger than any frame we accept */
            count(r->counters.invalid_packets, 1);
            continue;
        }
        int32_t segment = gro_segment_size(header);
        if (segment <= 0 || segment > length) segment = length;
        /* A new session's data, coalesced, goes up once per buffer: Python only needs it to
         * ask for a SETUP. */
        uint64_t unknown_session = 0;
        int unknown_seen = 0;
        for (int32_t offset = 0; offset < length || length == 0; offset += segment) {
            const int32_t rest = length - offset;
            const int32_t datagram_length = rest < segment ? rest : segment;
            const uint8_t *datagram = buffer + offset;
            int up = !debug_drop(r, datagram, datagram_length) &&
                     on_datagram(r, datagram, datagram_length, source, source_length, now_ns) ==
                         SS_RX_TO_PYTHON;
            if (up && datagram_length >= SS_HEADER_LENGTH &&
                read_u16(datagram + SS_TYPE_FIELD) == SS_HDR_TYPE_DATA) {
                const uint64_t key = ((uint64_t)(uint32_t)read_i32(datagram + SS_SESSION_ID_FIELD) << 32) |
                                     (uint32_t)read_i32(datagram + SS_STREAM_ID_FIELD);
                up = !unknown_seen || key != unknown_session;
                unknown_session = key;
                unknown_seen = 1;
            }
            if (up) {
                if (*to_python_count < r->to_python_capacity) {
                    int32_t *entry = to_python + 3 * (*to_python_count)++;
                    entry[0] = i;
                    entry[1] = (int32_t)(datagram - r->buffers);
                    entry[2] = datagram_length;
                } else {
                    count(r->counters.receive_errors, 1);
                }
            }
            if (length == 0) break;
        }
    }
    flush_signals(r);
    return received;
}

/* ------------------------------------------------------------------------- the duty cycle */

static int64_t clock_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Read an endpoint's socket until it is empty, its datagrams for Python wait, or the batch
 * limit; returns the datagrams received. */
static int32_t receive_endpoint(ss_receiver_t *r, int64_t now_ns) {
    if (r->fd < 0 || r->pending_count > 0 || r->failed || r->pending == NULL) return 0;
    int32_t total = 0;
    for (int32_t call = 0; call < SS_MAX_RECEIVE_CALLS; call++) {
        int32_t received = ss_receiver_recv(r, r->fd, now_ns, r->pending, &r->pending_count);
        if (received < 0) {
            r->failed = 1;
            break;
        }
        total += received;
        if (received < r->batch || r->pending_count > 0) break;
    }
    return total;
}

static const int32_t band_weights[SS_BANDS] = {1, 1, 2, 4, 8};

int32_t ss_band_of(const ss_send_publication_t *p, int64_t now_ns) {
    int64_t effective = p->priority;
    if (p->waiting_since_ns > 0 && now_ns > p->waiting_since_ns) {
        int64_t boost = (now_ns - p->waiting_since_ns) / SS_AGING_NS_PER_POINT;
        effective += boost < SS_AGING_MAX ? boost : SS_AGING_MAX;
    }
    if (effective < 0) return 0;
    if (effective < 250) return 1;
    if (effective < 500) return 2;
    if (effective < 750) return 3;
    return 4;
}

/* Whether the sends of this pass (virtual: the simulator's, else the sockets') include p. */
static inline int in_pass(const ss_send_publication_t *p, int virtual) {
    return (p->fd < 0) == (virtual != 0);
}

/* Whether p shares the send socket `fd` of this pass (the simulator's pass has one). */
static inline int on_socket(const ss_send_publication_t *p, int32_t fd, int virtual) {
    return in_pass(p, virtual) && (virtual || p->fd == fd);
}

/* One ss_send_data of publication i; a virtual one's spans go to the agent's virtual output
 * (*full when it has no room left for another send). */
static int32_t send_one(ss_agent_t *a, int32_t i, int64_t now_ns, int32_t budget, int virtual,
                        int *full) {
    ss_send_publication_t *p = a->publications[i];
    if (virtual) {
        const int32_t room = a->virtual_capacity - a->virtual_count - SS_RETRANSMIT_MAX;
        if (room <= 0) {
            *full = 1;
            return 0;
        }
        if (budget > room) budget = room;
    }
    const int32_t sent = ss_send_data(p, now_ns, budget, a->spans);
    if (virtual && sent > 0) {
        memcpy(a->virtual_spans + a->virtual_count, a->spans, sizeof(ss_span_t) * (size_t)sent);
        for (int32_t k = 0; k < sent; k++) a->virtual_owners[a->virtual_count + k] = i;
        a->virtual_count += sent;
    }
    return sent;
}

/* Serve band b's publications on socket fd that have data, from its turn's start, as long as
 * the band's deficit lasts; *full is set when the socket stops taking datagrams (the turn
 * resumes there). */
static int32_t serve_band(ss_agent_t *a, ss_band_round_t *round, int32_t fd, int32_t b,
                          int64_t now_ns, int virtual, int *full) {
    int32_t sent_total = 0;
    const int32_t count = a->publication_count;
    for (int32_t k = 0; k < count && round->deficit[b] > 0; k++) {
        const int32_t i = (round->next[b] + k) % count;
        ss_send_publication_t *p = a->publications[i];
        if (!on_socket(p, fd, virtual) || ss_band_of(p, now_ns) != b || !ss_has_data_ready(p))
            continue;
        while (round->deficit[b] > 0) {
            int64_t budget = round->deficit[b];
            if (budget > a->max_datagrams) budget = a->max_datagrams;
            const int32_t sent = send_one(a, i, now_ns, (int32_t)budget, virtual, full);
            if (sent > 0) {
                sent_total += sent;
                round->deficit[b] -= sent;
                p->waiting_since_ns = 0; /* served: it ages again from its next wait */
                round->next[b] = (i + 1) % count; /* the band's next turn starts after it */
            }
            if (p->socket_full || *full) {
                round->next[b] = i; /* ... unless the socket cut its turn short */
                *full = 1;
                return sent_total;
            }
            if (sent <= 0 || !ss_has_data_ready(p)) break;
        }
    }
    return sent_total;
}

/* Deficit weighted round robin over the bands of the publications on socket fd: one round
 * visits the bands from 4 down to 0, each visit granting the band weight x max_datagrams.
 * When the socket is full the round stops where it is and goes on from there next cycle, so
 * under a bottleneck each band's share of what the socket takes follows its weight, and the
 * lowest band is served every round.  Only a socket whose publications have data runs its
 * round: a round run with nothing to send would move on and re-grant the band it stopped in,
 * starving the lower bands. */
static int32_t serve_socket(ss_agent_t *a, ss_band_round_t *round, int32_t fd, int64_t now_ns,
                            int virtual) {
    int32_t sent_total = 0;
    int full = 0;
    for (int32_t visit = 0; visit < SS_BANDS && !full; visit++) {
        const int32_t b = round->band < 0 || round->band >= SS_BANDS ? SS_BANDS - 1 : round->band;
        if (!round->granted) {
            if (!(b == 0 && a->defer_lowest_band))
                round->deficit[b] += (int64_t)band_weights[b] * a->max_datagrams;
            round->granted = 1;
        }
        sent_total += serve_band(a, round, fd, b, now_ns, virtual, &full);
        if (full) break;
        /* The visit ended with room in the socket: the band spent its grant, or what is left
         * of it found nothing to send (DRR keeps no credit for an empty queue). */
        round->deficit[b] = 0;
        round->band = b == 0 ? SS_BANDS - 1 : b - 1;
        round->granted = 0;
    }
    return sent_total;
}

static int32_t send_publications(ss_agent_t *a, int64_t now_ns, int retransmits_only,
                                 int virtual) {
    int32_t sent_total = 0;
    /* Repairs first, of every publication whatever its band or the governor's deferral: a gap
     * pins the receiver's window.  A budget of 0 sends the retransmissions only. */
    int full = 0;
    for (int32_t i = 0; i < a->publication_count && !full; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (!in_pass(p, virtual) || p->retransmit_count <= 0) continue;
        const int32_t sent = send_one(a, i, now_ns, 0, virtual, &full);
        if (sent > 0) sent_total += sent;
        if (!virtual) full = 0; /* a full socket stops only its own publications */
    }
    if (retransmits_only || full) return sent_total;
    if (a->publication_count == 1) { /* nobody to share with */
        ss_send_publication_t *p = a->publications[0];
        if (in_pass(p, virtual) && !(a->defer_lowest_band && p->priority < 0)) {
            const int32_t sent = send_one(a, 0, now_ns, a->max_datagrams, virtual, &full);
            if (sent > 0) sent_total += sent;
        }
        return sent_total;
    }
    /* One round per send socket, in the first of its publications: the bands divide what a
     * socket takes, and a socket held by a bottleneck must not hold the others back. */
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *first = a->publications[i];
        if (!in_pass(first, virtual)) continue;
        const int32_t fd = first->fd;
        int seen_before = 0;
        for (int32_t j = 0; j < i && !seen_before; j++)
            seen_before = on_socket(a->publications[j], fd, virtual);
        if (seen_before) continue;
        int any_ready = 0;
        for (int32_t j = i; j < a->publication_count && !any_ready; j++)
            any_ready = on_socket(a->publications[j], fd, virtual) &&
                        ss_has_data_ready(a->publications[j]);
        if (any_ready) sent_total += serve_socket(a, &first->round, fd, now_ns, virtual);
    }
    /* Aging: a publication with data that got nothing since it was last served waits on. */
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (!in_pass(p, virtual)) continue;
        /* A deferred publication does not age out of the lowest band: it waits on purpose. */
        if (!ss_has_data_ready(p) || (a->defer_lowest_band && p->priority < 0))
            p->waiting_since_ns = 0;
        else if (p->waiting_since_ns == 0) p->waiting_since_ns = now_ns;
    }
    return sent_total;
}

int32_t ss_sender_status_poll_due(ss_agent_t *a, int32_t sent) {
    /* A status message or NAK read late stalls the stream: never let a busy send loop starve
     * the control input for long. */
    a->datagrams_to_status_poll -= sent;
    if (sent != 0 && a->datagrams_to_status_poll > 0) return 0;
    a->datagrams_to_status_poll = 2 * a->status_poll_ratio;
    return 1;
}

int32_t ss_send_virtual(ss_agent_t *a, int64_t now_ns, int32_t retransmits_only) {
    a->virtual_count = 0;
    return send_publications(a, now_ns, retransmits_only, 1);
}

static int32_t rebuild_images(ss_agent_t *a, int64_t now_ns);
static int32_t status_messages(ss_agent_t *a, int64_t now_ns);
static int32_t heartbeats(ss_agent_t *a, int64_t now_ns);
static int32_t publisher_limits(ss_agent_t *a);

int32_t ss_agent_do_work(ss_agent_t *a, int64_t now_ns) {
    int32_t work = 0;
    if (a->is_sender) {
        int32_t sent = send_publications(a, now_ns, 0, 0);
        if (ss_sender_status_poll_due(a, sent)) {
            int32_t received = 0;
            for (int32_t i = 0; i < a->endpoint_count; i++)
                received += receive_endpoint(a->endpoints[i], now_ns);
            work += received;
            /* The NAKs just answered queued retransmissions: they go now, not a cycle of new
             * data later (a gap pins the receiver's window until it is repaired). */
            if (received) work += send_publications(a, now_ns, 1, 0);
        }
        work += sent + heartbeats(a, now_ns) + publisher_limits(a);
    } else {
        for (int32_t i = 0; i < a->endpoint_count; i++)
            work += receive_endpoint(a->endpoints[i], now_ns);
        work += rebuild_images(a, now_ns);
        work += status_messages(a, now_ns);
    }
    ss_agent_python_due(a, now_ns);
    return work;
}

/* The slowest and the furthest subscriber's positions (ss_subscriber_position_bounded). */
static int64_t min_subscriber_position(const ss_image_t *image) {
    const int64_t hwm = LOAD_ACQ(image->receiver_hwm);
    int64_t least = hwm;
    for (int32_t i = 0; i < image->subscriber_count; i++) {
        int64_t position =
            ss_subscriber_position_bounded(LOAD_ACQ(image->subscriber_positions[i]), hwm);
        if (position < least) least = position;
    }
    return least;
}

static int64_t max_subscriber_position(const ss_image_t *image) {
    const int64_t hwm = LOAD_ACQ(image->receiver_hwm);
    int64_t most = INT64_MIN;
    for (int32_t i = 0; i < image->subscriber_count; i++) {
        int64_t position =
            ss_subscriber_position_bounded(LOAD_ACQ(image->subscriber_positions[i]), hwm);
        if (position > most) most = position;
    }
    return most;
}

/* Whether the C half rebuilds this image itself (see ss_image_t.rebuild_in_c). */
static inline int rebuilt_in_c(const ss_image_t *image) {
    return image->rebuild_in_c && image->loss != NULL && !image->python_on_data &&
           image->eos_position < 0 && image->subscriber_count > 0;
}

/* The first 8 bytes of a frame the driver sends itself (a NAK, an SM, a heartbeat): its
 * length, the version, flags and type (unlike a log's frames, no commit protocol). */
static inline void put_control_header(uint8_t *frame, int32_t frame_length, uint8_t flags,
                                      uint16_t type) {
    memcpy(frame, &frame_length, 4);
    frame[SS_VERSION_FIELD] = SS_CURRENT_VERSION;
    frame[SS_FLAGS_FIELD] = flags;
    memcpy(frame + SS_TYPE_FIELD, &type, 2);
}

/* Send the queued NAKs through the image's socket; what failed with an error other than a
 * full socket stays queued, for the Python half to send and log. */
static void send_naks(ss_image_t *image) {
    if (image->control_fd < 0 || image->counters == NULL || image->control_address_length <= 0)
        return;
    ss_receiver_counters_t *counters = image->counters;
    int32_t kept = 0;
    for (int32_t i = 0; i < image->nak_count; i++) {
        const int32_t *nak = image->naks + 3 * i;
        uint8_t frame[SS_NAK_LENGTH];
        put_control_header(frame, SS_NAK_LENGTH, 0, SS_HDR_TYPE_NAK);
        memcpy(frame + SS_NAK_SESSION_ID_FIELD, &image->session_id, 4);
        memcpy(frame + SS_NAK_STREAM_ID_FIELD, &image->stream_id, 4);
        memcpy(frame + SS_NAK_TERM_ID_FIELD, &nak[0], 4);
        memcpy(frame + SS_NAK_TERM_OFFSET_FIELD, &nak[1], 4);
        memcpy(frame + SS_NAK_LENGTH_FIELD, &nak[2], 4);
        const ssize_t sent = sendto(image->control_fd, frame, sizeof frame, MSG_DONTWAIT,
                                    (const struct sockaddr *)(const void *)image->control_address,
                                    (socklen_t)image->control_address_length);
        if (sent >= 0) {
            count(counters->bytes_sent, sent);
            count(counters->nak_messages_sent, 1);
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            count(counters->short_sends, 1); /* the gap's retry timer asks again */
            count(counters->nak_messages_sent, 1);
        } else { /* Python sends it, and counts and logs the error */
            memmove(image->naks + 3 * kept++, nak, 3 * sizeof(int32_t));
        }
    }
    image->nak_count = kept;
}

int32_t ss_image_rebuild(ss_image_t *image, int64_t now_ns) {
    ss_loss_detector_t *d = image->loss;
    image->dirty = 0; /* before the scan: data that lands during it makes the next pass due */
    if (d == NULL) return 0;
    const int64_t hwm = LOAD_ACQ(image->receiver_hwm);
    const int64_t term_length = image->term_length;
    const int64_t mask = term_length - 1;
    const int64_t max_sub = image->subscriber_count > 0 ? max_subscriber_position(image) : INT64_MIN;
    int64_t rcv_pos = LOAD_ACQ(image->receiver_position);
    /* What arrived in order needs no scan: start where the data path saw it stop. */
    const int64_t in_order = image->contiguous_position < hwm ? image->contiguous_position : hwm;
    if (in_order > rcv_pos) rcv_pos = in_order;
    int32_t queued = 0;
    for (int32_t pass = 0; pass < SS_PARTITION_COUNT; pass++) {
        const int64_t rebuild = rcv_pos > max_sub ? rcv_pos : max_sub;
        const int32_t rebuild_offset = (int32_t)(rebuild & mask);
        int32_t first = rebuild_offset;
        int loss_found = 0;
        if (rebuild >= hwm) {
            if (d->gap_count) ss_loss_all_filled(d, now_ns);
        } else {
            const int64_t term_count = rebuild >> image->position_bits;
            const int32_t limit_offset = term_count == (hwm >> image->position_bits)
                                             ? (int32_t)(hwm & mask) : (int32_t)term_length;
            const int32_t term_id = (int32_t)((uint32_t)image->initial_term_id +
                                              (uint32_t)term_count);
            const uint8_t *term = image->log + (term_count % SS_PARTITION_COUNT) * term_length;
            first = ss_loss_scan(d, term, term_id, rebuild_offset, limit_offset, now_ns,
                                 image->nak_first_delay_ns, image->nak_retry_delay_ns);
            loss_found = first < limit_offset;
        }
        if (loss_found) {
            const int32_t term_id = (int32_t)((uint32_t)image->initial_term_id +
                                              (uint32_t)(rebuild >> image->position_bits));
            if (d->fresh_count && image->loss_entry != NULL)
                ss_loss_record(image->loss_entry, d->fresh_bytes, d->fresh_count);
            for (int32_t i = 0; i < d->due_count && image->nak_count < SS_LOSS_GAPS_MAX; i++) {
                const ss_gap_t *gap = &d->gaps[d->due[i]];
                int32_t *nak = image->naks + 3 * image->nak_count++;
                nak[0] = term_id;
                nak[1] = gap->term_offset;
                nak[2] = gap->length;
                queued++;
            }
        }
        const int64_t new_rebuild = rebuild - (rebuild & mask) + first;
        if (new_rebuild > rcv_pos) rcv_pos = new_rebuild;
        if (loss_found || first < term_length || rcv_pos >= hwm) break;
    }
    if (rcv_pos > LOAD_ACQ(image->receiver_position))
        ss_publish_position(image->receiver_position, image->receiver_position_counter, rcv_pos);
    if (rcv_pos > image->contiguous_position) image->contiguous_position = rcv_pos;
    image->loss_deadline_ns = ss_loss_next_deadline(d);
    if (queued) send_naks(image);
    return queued;
}

/* Whether the C half sends this image's 25 % rule status messages (ss_image_t.sm_in_c). */
static inline int sends_status_messages(const ss_image_t *image) {
    return image->sm_in_c && image->subscriber_count > 0 && !image->python_on_data &&
           image->eos_position < 0;
}

/* The 25 % rule's status message, at the slowest subscriber's position: scheduled here, and
 * sent through the image's socket (else left to the Python half: sm_unsent). */
static int64_t allowed_window(const ss_image_t *image, int64_t position);

static void send_status_message(ss_image_t *image, int64_t position, int64_t now_ns) {
    const int64_t window = allowed_window(image, position);
    image->sm_position = position;
    image->sm_window = (int32_t)window;
    image->sm_deadline_ns = now_ns + image->sm_interval_ns;
    image->last_sm_position = position;
    const int64_t overrun = position + image->term_length / 2;
    image->overrun_threshold = overrun < image->reusable_limit ? overrun : image->reusable_limit;
    image->sm_due_position = position + (window >> 2) + 1;
    ss_receiver_counters_t *counters = image->counters;
    if (image->control_fd < 0 || counters == NULL || image->control_address_length <= 0) {
        image->sm_unsent = 1;
        return;
    }
    uint8_t frame[SS_SM_LENGTH + 8];
    const int32_t frame_length = SS_SM_LENGTH + (image->has_group_tag ? 8 : 0);
    const int32_t term_count = (int32_t)(position >> image->position_bits);
    const int32_t term_id = (int32_t)((uint32_t)image->initial_term_id + (uint32_t)term_count);
    const int32_t term_offset = (int32_t)(position & (image->term_length - 1));
    const int32_t window32 = (int32_t)window;
    put_control_header(frame, frame_length, 0, SS_HDR_TYPE_SM);
    memcpy(frame + SS_SM_SESSION_ID_FIELD, &image->session_id, 4);
    memcpy(frame + SS_SM_STREAM_ID_FIELD, &image->stream_id, 4);
    memcpy(frame + SS_SM_CONSUMPTION_TERM_ID_FIELD, &term_id, 4);
    memcpy(frame + SS_SM_CONSUMPTION_TERM_OFFSET_FIELD, &term_offset, 4);
    memcpy(frame + SS_SM_RECEIVER_WINDOW_FIELD, &window32, 4);
    memcpy(frame + SS_SM_RECEIVER_ID_FIELD, &image->receiver_id, 8);
    memcpy(frame + SS_SM_LENGTH, &image->group_tag, 8);
    const ssize_t sent = sendto(image->control_fd, frame, (size_t)frame_length, MSG_DONTWAIT,
                                (const struct sockaddr *)(const void *)image->control_address,
                                (socklen_t)image->control_address_length);
    if (sent >= 0) {
        count(counters->bytes_sent, sent);
        count(counters->status_messages_sent, 1);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        count(counters->short_sends, 1);
        count(counters->status_messages_sent, 1); /* the timer's SM repeats it */
    } else {
        image->sm_unsent = 1; /* Python sends it and logs the error */
    }
}

/* The window the image may advertise at `position`: its own, never inviting data into a
 * partition that cleaning has not reached. */
static int64_t allowed_window(const ss_image_t *image, int64_t position) {
    int64_t window = image->reusable_limit - position;
    if (window > image->window) window = image->window;
    return window < 0 ? 0 : window;
}

/* Cleaning, once the slowest subscriber reached clean_due_position: a chunk toward one term
 * behind it, then the limits that follow from it. */
static void clean_image(ss_image_t *image, int64_t slowest) {
    ss_log_cleaner_t *cleaner = image->cleaner;
    ss_clean_toward(cleaner, image->log, image->term_length, image->position_bits, slowest);
    image->reusable_limit = ss_reusable_limit(cleaner, image->term_length);
    image->clean_due_position = ss_clean_due_position(cleaner, image->term_length);
}

/* The C half's status messages and cleaning: the slowest subscriber reached the 25 % rule's
 * position, or cleaning's. */
static int32_t status_messages(ss_agent_t *a, int64_t now_ns) {
    int32_t work = 0;
    for (int32_t i = 0; i < a->image_count; i++) {
        ss_image_t *image = a->images[i];
        if (!sends_status_messages(image)) continue;
        const int64_t slowest = min_subscriber_position(image);
        if (image->cleaner != NULL && slowest >= image->clean_due_position) {
            clean_image(image, slowest);
            work++;
            if (!image->sm_unsent &&
                allowed_window(image, image->sm_position) != image->sm_window) {
                send_status_message(image, slowest > image->sm_position ? slowest
                                                                         : image->sm_position,
                                    now_ns);
                continue;
            }
        }
        if (image->sm_unsent) continue;
        if (slowest >= image->sm_due_position) {
            send_status_message(image, slowest, now_ns);
            work++;
        } else if (now_ns >= image->sm_deadline_ns) {
            /* The timer's: at what the subscribers consumed by now (§4.6), never behind. */
            send_status_message(image, slowest > image->sm_position ? slowest : image->sm_position,
                                now_ns);
            work++;
        }
    }
    return work;
}

/* The heartbeats of the publications that send them here (heartbeat_in_c). */
static int32_t heartbeats(ss_agent_t *a, int64_t now_ns) {
    int32_t sent = 0;
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (!p->heartbeat_in_c || p->fd < 0 ||
            now_ns - p->time_of_last_send_ns < SS_HEARTBEAT_TIMEOUT_NS)
            continue;
        const int64_t position = LOAD_ACQ(p->sender_position);
        const int32_t term_count = (int32_t)(position >> p->position_bits);
        const int32_t term_id = (int32_t)((uint32_t)p->initial_term_id + (uint32_t)term_count);
        const int32_t term_offset = (int32_t)(position & (p->term_length - 1));
        uint8_t frame[SS_HEADER_LENGTH];
        memset(frame, 0, sizeof frame); /* the reserved value too */
        /* DATA of frame length 0: a heartbeat */
        put_control_header(frame, 0, SS_BEGIN_FLAG | SS_END_FLAG, SS_HDR_TYPE_DATA);
        memcpy(frame + SS_TERM_OFFSET_FIELD, &term_offset, 4);
        memcpy(frame + SS_SESSION_ID_FIELD, &p->session_id, 4);
        memcpy(frame + SS_STREAM_ID_FIELD, &p->stream_id, 4);
        memcpy(frame + SS_TERM_ID_FIELD, &term_id, 4);
        const ssize_t result = p->destination_length > 0
            ? sendto(p->fd, frame, sizeof frame, MSG_DONTWAIT,
                     (const struct sockaddr *)(const void *)p->destination,
                     (socklen_t)p->destination_length)
            : send(p->fd, frame, sizeof frame, MSG_DONTWAIT);
        p->time_of_last_send_ns = now_ns; /* the next in a timeout, whatever became of this */
        if (result >= 0) {
            count(p->bytes_sent, result);
            count(p->heartbeats_sent, 1);
            sent++;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            count(p->short_sends, 1);
        } else if (errno != ECONNREFUSED) { /* an earlier datagram's ICMP error: no one yet */
            count(p->send_errors, 1);
            p->last_errno = errno;
            p->notice = 1; /* Python logs it */
        }
    }
    return sent;
}

/* Whether the C half's pub-lmt rule has work for p: snd-pos reached the next step, or
 * cleaning is behind. */
static inline int limit_step_due(const ss_send_publication_t *p) {
    if (!p->limit_in_c || p->cleaner == NULL) return 0;
    return p->cleaner->position < p->cleaner->target ||
           LOAD_ACQ(p->sender_position) >=
               p->last_publisher_limit + p->trip_gain - p->term_window_length;
}

/* pub-lmt's steps for the publications whose limit the C half moves (limit_in_c): clean a
 * chunk toward one term behind snd-pos, then raise pub-lmt to snd-pos + the term window,
 * never past what cleaning allows, once that is a step (trip_gain) above the last. */
static int32_t publisher_limits(ss_agent_t *a) {
    int32_t work = 0;
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (!limit_step_due(p)) continue;
        const int64_t position = LOAD_ACQ(p->sender_position);
        work += ss_clean_toward(p->cleaner, p->log, p->term_length, p->position_bits, position);
        int64_t limit = position + p->term_window_length;
        const int64_t reusable = ss_reusable_limit(p->cleaner, p->term_length);
        if (reusable < limit) limit = reusable;
        if (limit >= p->last_publisher_limit + p->trip_gain) {
            p->last_publisher_limit = limit;
            ss_publish_limit(p->publisher_limit, limit, p->meta);
            work++;
        }
    }
    return work;
}

int64_t ss_agent_c_deadline(const ss_agent_t *a) {
    int64_t deadline = SS_NO_DEADLINE;
    for (int32_t i = 0; i < a->publication_count; i++) {
        const ss_send_publication_t *p = a->publications[i];
        if (p->limit_in_c && p->cleaner != NULL && p->cleaner->position < p->cleaner->target)
            return 0; /* cleaning is behind: the next cycle goes on with it */
        if (p->heartbeat_in_c && p->fd >= 0 &&
            p->time_of_last_send_ns + SS_HEARTBEAT_TIMEOUT_NS < deadline)
            deadline = p->time_of_last_send_ns + SS_HEARTBEAT_TIMEOUT_NS;
        if (p->sm_in_c && p->sm_time_ns + p->connection_timeout_ns + 1 < deadline)
            deadline = p->sm_time_ns + p->connection_timeout_ns + 1; /* its receiver's liveness */
    }
    for (int32_t i = 0; i < a->image_count; i++) {
        const ss_image_t *image = a->images[i];
        if (rebuilt_in_c(image) && image->loss_deadline_ns < deadline)
            deadline = image->loss_deadline_ns;
        if (!sends_status_messages(image)) continue;
        if (!image->sm_unsent && image->sm_deadline_ns < deadline)
            deadline = image->sm_deadline_ns;
        if (image->time_of_last_packet_ns + image->liveness_timeout_ns < deadline)
            deadline = image->time_of_last_packet_ns + image->liveness_timeout_ns;
    }
    return deadline;
}

/* The C half's rebuild passes: data past a gap arrived, or a gap's timer is due. */
static int32_t rebuild_images(ss_agent_t *a, int64_t now_ns) {
    int32_t work = 0;
    for (int32_t i = 0; i < a->image_count; i++) {
        ss_image_t *image = a->images[i];
        if (!rebuilt_in_c(image)) continue;
        if ((image->dirty && LOAD_ACQ(image->receiver_hwm) > image->contiguous_position) ||
            now_ns >= image->loss_deadline_ns)
            work += 1 + ss_image_rebuild(image, now_ns);
    }
    return work;
}

int64_t ss_image_rate_signal_top(const ss_image_t *image) {
    const int64_t hwm = LOAD_ACQ(image->receiver_hwm);
    const ss_loss_detector_t *loss = image->loss;
    if (loss == NULL || loss->gap_count <= 0 || loss->gaps[0].naks >= SS_RATE_SIGNAL_GAP_NAKS)
        return hwm;
    return image->contiguous_position < hwm ? image->contiguous_position : hwm;
}

static int image_needs_python(const ss_image_t *image, int64_t now_ns) {
    if (image->nak_count > 0 || image->sm_unsent) return 1;
    /* Sums, not differences: ss_agent_python_due is asked at now = -INT64_MAX too. */
    if (sends_status_messages(image) &&
        now_ns >= image->time_of_last_packet_ns + image->liveness_timeout_ns)
        return 1;
    if (image->dirty && (image->python_on_data || image->eos_position >= 0 ||
                         (LOAD_ACQ(image->receiver_hwm) > image->contiguous_position &&
                          !rebuilt_in_c(image))))
        return 1;
    if (ss_image_rate_signal_top(image) >= image->rate_signal_position) return 1;
    if (image->subscriber_count <= 0) return 0;
    /* An SM the C half sends usually went in this cycle, before this rule is asked
     * (ss_agent_do_work); a subscriber that moved since costs one Python pass. */
    const int64_t slowest = min_subscriber_position(image);
    return slowest >= image->sm_due_position ||
           (slowest >= image->clean_due_position &&
            (image->cleaner == NULL || !sends_status_messages(image)));
}

int32_t ss_agent_python_due(ss_agent_t *a, int64_t now_ns) {
    int32_t due = 0;
    if (LOAD_ACQ(&a->commands)) due |= SS_DUE_COMMANDS;
    if (now_ns >= a->python_deadline_ns) due |= SS_DUE_TIMER;
    for (int32_t i = 0; i < a->endpoint_count; i++) {
        const ss_receiver_t *r = a->endpoints[i];
        if (r->pending_count > 0 || r->failed) due |= SS_DUE_INPUT;
    }
    for (int32_t i = 0; i < a->image_count && !(due & SS_DUE_IMAGE); i++)
        if (image_needs_python(a->images[i], now_ns)) due |= SS_DUE_IMAGE;
    for (int32_t i = 0; i < a->publication_count; i++) {
        const ss_send_publication_t *p = a->publications[i];
        if (p->notice || (p->sent_since_python &&
                          LOAD_ACQ(p->sender_position) >= p->python_send_position) ||
            (p->sm_in_c && now_ns > p->sm_time_ns + p->connection_timeout_ns)) {
            due |= SS_DUE_PUBLICATION;
            break;
        }
    }
    a->due = due;
    return due;
}

int32_t ss_has_data_ready(const ss_send_publication_t *p) {
    if (p->retransmit_count > 0) return 1;
    const int64_t position = LOAD_ACQ(p->sender_position);
    const int64_t window = LOAD_ACQ(p->sender_limit) - position;
    if (window <= 0) return 0;
    const int32_t index = (int32_t)((position >> p->position_bits) % SS_PARTITION_COUNT);
    const int32_t offset = (int32_t)(position & (p->term_length - 1));
    int32_t padding;
    return ss_scan_for_availability(p->log + (int64_t)index * p->term_length, offset,
                                    window < p->mtu ? (int32_t)window : p->mtu, p->term_length,
                                    &padding) > 0;
}

static int32_t *driver_waiters(uint8_t *meta) { return (int32_t *)(meta + SS_META_DRIVER_WAITERS); }

/* Ask every client to ring the doorbell on news (publishers on new data, subscribers at the
 * position where a status message is due), then look once more; 0 when there is work after
 * all.  disarm (delta -1) undoes it. */
static int arm(ss_agent_t *a, int32_t delta, int64_t now_ns, int64_t *deadline) {
    int may_park = 1;
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (p->meta == NULL) continue;
        __atomic_fetch_add(driver_waiters(p->meta), delta, __ATOMIC_SEQ_CST);
        /* Data of a deferred band waits for the governor's word (a command wakes us). */
        const int deferred = a->defer_lowest_band && p->retransmit_count == 0 &&
                             p->priority < 0;
        if (delta > 0 && !deferred && ss_has_data_ready(p)) {
            /* Data held back by the rate limit: park until the bucket has room for it. */
            int64_t wait = p->retransmit_count > 0 ? 0 : ss_rate_wait_ns(p, now_ns);
            const int64_t coalesced = ss_coalesce_ready_ns(p); /* INT64_MIN: not held */
            if (coalesced > now_ns && coalesced - now_ns > wait) wait = coalesced - now_ns;
            if (wait == 0) may_park = 0;
            else if (now_ns + wait < *deadline) *deadline = now_ns + wait;
        }
    }
    for (int32_t i = 0; i < a->image_count; i++) {
        ss_image_t *image = a->images[i];
        if (delta > 0) {
            const int64_t wake = image->sm_due_position < image->clean_due_position
                                     ? image->sm_due_position : image->clean_due_position;
            STORE_REL((int64_t *)(image->meta + SS_META_DRIVER_WAKE_POSITION), wake);
        }
        __atomic_fetch_add(driver_waiters(image->meta), delta, __ATOMIC_SEQ_CST);
    }
    return may_park;
}

#define PARK_TIMEOUT_MAX_NS ((int64_t)1000 * 1000000000) /* a park is re-armed within this */

/* Whether epoll_pwait2 is missing (Linux before 5.11, or headers that do not know it) or
 * refused (a seccomp filter older than it, as systemd's @system-service before v249 is:
 * EPERM): then timeouts are milliseconds. */
#ifdef SYS_epoll_pwait2
static int epoll_ms_only;
#else
static const int epoll_ms_only = 1;
#endif

/* Wait on `epoll_fd` for at most `timeout_ns`: with epoll_pwait2 to the nanosecond, so that a
 * NAK timer of 100 us is not a parked millisecond (epoll_wait counts whole milliseconds,
 * rounded up, since a timer is never early).  The system call itself, not glibc's wrapper
 * (glibc 2.35 and later only).  Returns what the wait returned. */
static int wait_events(int epoll_fd, int64_t timeout_ns) {
    struct epoll_event events[16];
#ifdef SYS_epoll_pwait2
    if (!epoll_ms_only) {
        /* The kernel's timespec: two 64-bit fields on every architecture. */
        const struct { int64_t tv_sec; int64_t tv_nsec; } timeout = {
            timeout_ns / 1000000000, timeout_ns % 1000000000};
        const long ready = syscall(SYS_epoll_pwait2, epoll_fd, events, 16, &timeout, NULL, 0);
        if (ready >= 0 || (errno != ENOSYS && errno != EPERM)) return (int)ready;
        epoll_ms_only = 1;
    }
#endif
    return epoll_wait(epoll_fd, events, 16, (int)((timeout_ns + 999999) / 1000000));
}

/* The timeout wait_events(timeout_ns) waits for, ns: the grain of the call it makes. */
static int64_t wait_granted_ns(int64_t timeout_ns) {
    return epoll_ms_only ? (timeout_ns + 999999) / 1000000 * 1000000 : timeout_ns;
}

static void park(ss_duty_loop_t *l, int64_t now_ns) {
    int may_park = 1;
    int64_t deadline = now_ns + l->max_park_ns;
    for (int32_t i = 0; i < l->agent_count; i++) {
        ss_agent_t *a = l->agents[i];
        may_park &= arm(a, 1, now_ns, &deadline);
        if (a->python_deadline_ns < deadline) deadline = a->python_deadline_ns;
        const int64_t c_deadline = ss_agent_c_deadline(a);
        if (c_deadline < deadline) deadline = c_deadline;
    }
    /* After arming, so a client that moved in between either rang or is seen here. */
    for (int32_t i = 0; i < l->agent_count; i++)
        if (ss_agent_python_due(l->agents[i], now_ns) & ~SS_DUE_TIMER) may_park = 0;
    const int64_t parked_ns = clock_ns();
    const int64_t timeout_ns = deadline - parked_ns;
    if (may_park && timeout_ns > 0) {
        l->parks++;
        const int64_t asked_ns = timeout_ns < PARK_TIMEOUT_MAX_NS ? timeout_ns : PARK_TIMEOUT_MAX_NS;
        const int ready = wait_events(l->epoll_fd, asked_ns);
        if (ready == 0) { /* woken by its timer: how late, against the timeout it asked for */
            const int64_t woken_ns = clock_ns();
            int64_t late = woken_ns - (parked_ns + wait_granted_ns(asked_ns));
            if (late < 0) late = 0;
            l->lag_ns += (late - l->lag_ns) / 8;
            l->lag_sampled_ns = woken_ns;
        }
    }
    for (int32_t i = 0; i < l->agent_count; i++) {
        arm(l->agents[i], -1, now_ns, &deadline);
        /* Whatever woke the thread, the control input is read at the next cycle. */
        l->agents[i]->datagrams_to_status_poll = 0;
    }
    uint64_t value;
    while (read(l->wake_fd, &value, sizeof value) > 0) {
    }
    char ring[64];
    for (int32_t i = 0; i < l->doorbell_count; i++) /* a ring is a wake-up, not a message */
        while (recv(l->doorbell_fds[i], ring, sizeof ring, MSG_DONTWAIT) >= 0) {
        }
}

int32_t ss_duty_loop_once(ss_duty_loop_t *l) {
    const int64_t now_ns = clock_ns();
    int32_t work = 0;
    int32_t due = 0;
    for (int32_t i = 0; i < l->agent_count; i++) {
        work += ss_agent_do_work(l->agents[i], now_ns);
        due |= l->agents[i]->due;
    }
    l->now_ns = now_ns;
    l->due = due;
    l->last_cycle_ns = now_ns;
    count(l->cycles, 1);
    if (work) {
        l->last_work_ns = now_ns;
        count(l->work_cycles, 1);
        if (l->busy_ns) count(l->busy_ns, clock_ns() - now_ns);
    }
    return work;
}

int32_t ss_duty_loop_run(ss_duty_loop_t *l) {
    for (;;) {
        if (LOAD_ACQ(&l->stopping)) return SS_DUE_STOP;
        const int32_t work = ss_duty_loop_once(l);
        if (l->due) return l->due;
        if (work) {
            continue;
        } else if (l->now_ns - l->last_work_ns >= l->idle_spin_ns) {
            park(l, l->now_ns);
            /* Woken with nothing to do (a stray ring): park again at once. */
            l->last_work_ns = INT64_MIN / 2;
        } else {
            /* Aeron's backoff between spinning and parking: another thread of this host (an
             * application, the other driver) may need the core more. */
            sched_yield();
        }
    }
}
