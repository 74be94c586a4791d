/* slipstream's network data path: the receiver's (Aeron's receive channel endpoint's dispatch
 * and the publication image's insert): recvmmsg, every frame checked, DATA inserted into the
 * image's log, and a send endpoint's control input (NAKs, status messages) taken without
 * Python.  See network.h for the contracts. */
#define _GNU_SOURCE
#include "network_internal.h"

#include <netinet/in.h>
#include <netinet/udp.h>

#define RECV_BATCH_MAX 64

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
        image->crypto = r->crypto;
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

static int same_source(const uint8_t *a, int32_t a_length, const uint8_t *b, int32_t b_length);

int32_t ss_publication_control_source_known(const ss_send_publication_t *p, const uint8_t *source,
                                            int32_t source_length) {
    if (p->control_source_count == SS_CONTROL_SOURCES_UNKNOWN) return 1;
    if (source == NULL) return 0;
    const int32_t n = p->control_source_count < SS_CONTROL_SOURCES_MAX ? p->control_source_count
                                                                       : SS_CONTROL_SOURCES_MAX;
    for (int32_t i = 0; i < n; i++) {
        if (same_source(p->control_sources[i], p->control_source_lengths[i], source,
                        source_length)) return 1;
    }
    return 0;
}

/* A NAK at a send endpoint: answered here when its publication is in the table and needs no
 * timer, and it came from one of the publication's receivers (a NAK names none: its source
 * must be the address a live receiver's status messages come from, else it is dropped and
 * counted); anything else (malformed, unknown, a delayed resend) goes up to Python, which
 * counts or answers it with the same rules. */
static int32_t on_nak(ss_receiver_t *r, const uint8_t *data, int32_t length,
                      const uint8_t *source, int32_t source_length, int64_t now_ns) {
    if (length < SS_NAK_LENGTH) return SS_RX_TO_PYTHON;
    const int32_t frame_length = read_i32(data);
    if (frame_length < SS_NAK_LENGTH || frame_length > length) return SS_RX_TO_PYTHON;
    ss_send_publication_t *p = find_publication(r, read_i32(data + SS_NAK_SESSION_ID_FIELD),
                                                read_i32(data + SS_NAK_STREAM_ID_FIELD));
    if (p == NULL || !p->answers_naks || p->retransmit_delay_ns != 0) return SS_RX_TO_PYTHON;
    count(r->counters.bytes_received, length);
    count(p->naks_received, 1);
    if (!ss_publication_control_source_known(p, source, source_length)) {
        count(p->nak_unknown_source_drops, 1);
        return SS_RX_CONSUMED;
    }
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
    if (a == NULL || b == NULL) return 0;
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
 * beyond its header, 0 without one.  `first`: the first frame's header (SS_HEADER_LENGTH
 * bytes), `data`'s own or apart (the rest of a datagram decrypted into a term before it). */
static int valid_data_frames(const uint8_t *first, const uint8_t *data, int32_t length,
                             int32_t term_offset, int64_t term_length, int32_t *padding) {
    const int32_t session_id = read_i32(first + SS_SESSION_ID_FIELD);
    const int32_t stream_id = read_i32(first + SS_STREAM_ID_FIELD);
    const int32_t term_id = read_i32(first + SS_TERM_ID_FIELD);
    int64_t offset = 0;
    *padding = 0;
    while (offset < length) {
        const uint8_t *frame = offset == 0 ? first : data + offset;
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
        int64_t aligned = ((int64_t)frame_length + (SS_FRAME_ALIGNMENT - 1)) & ~(int64_t)(SS_FRAME_ALIGNMENT - 1);
        if (type == SS_HDR_TYPE_PAD) {
            /* Its header alone, last in the datagram, standing for its aligned length within
             * the term.  The length itself need not be aligned: an aborted claim's PAD keeps
             * the claim's frame length (32 + payload), as Aeron's BufferClaim.abort writes it
             * and both scanners send it, and readers step over align(frame_length). */
            if (offset + SS_HEADER_LENGTH != length ||
                (int64_t)term_offset + offset + aligned > term_length) return 0;
            *padding = (int32_t)(aligned - SS_HEADER_LENGTH);
            return 1;
        }
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
 * docs/DRIVER.md §4.3, then the copy into the term (body first, header last; `placed`: the
 * body is there already, `data` only the first frame's header).  Returns 1
 * when the frame was inside the window (a multi-destination image's path is live then, as
 * Aeron's trackConnection), 0 when a rule dropped it. */
static int insert_packet(ss_receiver_t *r, ss_image_t *image, const uint8_t *data, int32_t length,
                         int32_t padding, int heartbeat, uint8_t flags, int32_t term_id,
                         int32_t term_offset, int placed, int64_t now_ns) {
    int32_t term_count = (int32_t)((uint32_t)term_id - (uint32_t)image->initial_term_id);
    if (term_count < 0) { /* a term before the initial term: no sender sends one */
        count(r->counters.invalid_packets, 1);
        return 0;
    }
    int64_t position = ((int64_t)term_count << image->position_bits) + term_offset;
    if (heartbeat) {
        /* A heartbeat is held to the over-run rule too (as Aeron's): past the window it would
         * raise the hwm, and the image's tail, to wherever a forged one says.  But a sender
         * whose PAD's header was within the window stands at the start of the next term,
         * past it: a PAD data frame may raise the hwm there, and so may the heartbeat that
         * follows it, or an image that lost that PAD and the data before it would never see
         * the gap (its hwm below the loss, the sender's heartbeats all over-runs). */
        const int64_t term_start = position & ~(int64_t)(image->term_length - 1);
        if (position > image->overrun_threshold &&
            !(position == term_start && position - image->term_length < image->overrun_threshold)) {
            count(r->counters.flow_control_over_runs, 1);
            note_overrun(image, position);
            return 0;
        }
        int64_t floor = image->last_sm_position - image->term_length;
        if (position < (floor > 0 ? floor : 0)) return 0;
        count(r->counters.heartbeats_received, 1);
        image->time_of_last_packet_ns = now_ns;
        if (raise_hwm(image, position)) image->dirty = 1;
        if ((flags & SS_EOS_FLAG) && image->eos_position < 0) {
            image->eos_position = position;
            image->dirty = 1;
        }
        return 1;
    }
    if (position + length > image->overrun_threshold) {
        count(r->counters.flow_control_over_runs, 1);
        note_overrun(image, position + length);
        return 0;
    }
    if (position < image->last_sm_position) {
        count(r->counters.flow_control_under_runs, 1);
        return 0;
    }
    image->time_of_last_packet_ns = now_ns;
    /* A PAD header stands for the rest of its term. */
    int64_t proposed = position + length + padding;
    /* The tail first, as a publisher claims before it writes: a subscriber that reads the frame
     * and commits past it must find the tail there already. */
    raise_hwm(image, proposed);
    uint8_t *term = image->log + (int64_t)(term_count % SS_PARTITION_COUNT) * image->term_length;
    /* placed: all but the first frame's header is in the term already (open_sealed), `data`
     * that header, which goes in as a datagram of its own would, its first word last. */
    const int copied = ss_rebuild_insert(term, term_offset, data,
                                         placed ? SS_HEADER_LENGTH : length);
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
    return 1;
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

int64_t ss_publication_status_message(const ss_send_publication_t *p, int32_t term_id,
                                      int32_t term_offset, int32_t *window) {
    const int32_t term_count = (int32_t)((uint32_t)term_id - (uint32_t)p->initial_term_id);
    if (term_count < 0 || term_offset < 0 || term_offset > p->term_length || *window < 0)
        return SS_SM_INVALID;
    const int64_t position = ((int64_t)term_count << p->position_bits) + term_offset;
    if (position > LOAD_ACQ(p->sender_position)) return SS_SM_AHEAD_OF_SENDER;
    if (*window > p->term_length / 2) *window = p->term_length / 2;
    return position;
}

/* A status message at a send endpoint: taken here when its publication reads SMs in C
 * (ss_send_publication_t.sm_in_c) and it came from the address its receiver is bound to
 * (sm_source), else up to Python (which also counts what is invalid or forged). */
static int32_t on_status_message(ss_receiver_t *r, const uint8_t *data, int32_t length,
                                 const uint8_t *source, int32_t source_length, int64_t now_ns) {
    if (length < SS_SM_LENGTH || read_i32(data) != SS_SM_LENGTH || data[SS_FLAGS_FIELD] != 0)
        return SS_RX_TO_PYTHON;
    ss_send_publication_t *p = find_publication(r, read_i32(data + SS_SM_SESSION_ID_FIELD),
                                                read_i32(data + SS_SM_STREAM_ID_FIELD));
    if (p == NULL || !p->sm_in_c) return SS_RX_TO_PYTHON;
    int64_t receiver_id;
    memcpy(&receiver_id, data + SS_SM_RECEIVER_ID_FIELD, 8);
    const int32_t term_offset = read_i32(data + SS_SM_CONSUMPTION_TERM_OFFSET_FIELD);
    int32_t window = read_i32(data + SS_SM_RECEIVER_WINDOW_FIELD);
    if (receiver_id != p->sm_receiver_id ||
        !same_source(p->sm_source, p->sm_source_length, source, source_length))
        return SS_RX_TO_PYTHON;
    const int64_t position = ss_publication_status_message(
        p, read_i32(data + SS_SM_CONSUMPTION_TERM_ID_FIELD), term_offset, &window);
    if (position < 0) return SS_RX_TO_PYTHON; /* Python counts and drops it */
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

/* Data of a multi-destination subscription's image came through destination r, inside the
 * image's window (insert_packet took it): that path is live now, and its control frames go to
 * the destination's control address (a multicast group's) or to where the data came from,
 * through the destination's socket.  As Aeron's trackConnection, the address is set only when
 * the slot has none (or its path went quiet past the liveness timeout): later data, from
 * whatever source, only keeps the path live, so a datagram from elsewhere does not redirect
 * it.  A receiver that is no destination (an endpoint of its own, or the simulator's) records
 * nothing. */
static void note_connection(const ss_receiver_t *r, ss_image_t *image, const uint8_t *source,
                            int32_t source_length, int64_t now_ns) {
    if (r->destination < 0 || r->destination >= image->connection_count ||
        r->destination >= SS_RECEIVE_DESTINATIONS_MAX) return;
    ss_image_connection_t *c = &image->connections[r->destination];
    const uint8_t *address = source;
    int32_t address_length = source_length;
    if (r->control_address_length > 0) {
        address = r->control_address;
        address_length = r->control_address_length;
    }
    if (address_length <= 0 || address_length > SS_SOCKADDR_MAX) return;
    if (c->address_length <= 0 || now_ns - c->time_of_last_frame_ns > image->liveness_timeout_ns) {
        memcpy(c->address, address, (size_t)address_length);
        c->address_length = address_length;
    }
    c->fd = r->fd;
    c->time_of_last_frame_ns = now_ns;
}

/* Where a DATA or PAD datagram's frames go: its image, term, offset and what its frames
 * are (data_target). */
typedef struct {
    ss_image_t *image;
    int32_t term_id, term_offset, padding;
    uint8_t flags;
    int heartbeat;
} target_t;

/* The image a DATA or PAD datagram of `length` bytes belongs to, its offsets, frames and
 * source checked: `first` the first frame's header (SS_HEADER_LENGTH bytes at least), `data`
 * the datagram, read from its second frame on (NULL: the rest not known yet, its frames
 * unchecked, nothing counted).  t->image set when the frames may go in (then SS_RX_CONSUMED);
 * else NULL and the datagram's verdict (counted, unless data is NULL). */
static int32_t data_target(ss_receiver_t *r, const uint8_t *first, const uint8_t *data,
                           int32_t length, const uint8_t *source, int32_t source_length,
                           target_t *t) {
    t->image = NULL;
    const uint16_t type = read_u16(first + SS_TYPE_FIELD);
    const int32_t frame_length = read_i32(first);
    t->flags = first[SS_FLAGS_FIELD];
    t->term_offset = read_i32(first + SS_TERM_OFFSET_FIELD);
    t->term_id = read_i32(first + SS_TERM_ID_FIELD);
    const int32_t session_id = read_i32(first + SS_SESSION_ID_FIELD);
    const int32_t stream_id = read_i32(first + SS_STREAM_ID_FIELD);
    ss_image_t *image = ss_receiver_find_image(r, session_id, stream_id);
    if (image == NULL) {
        /* A session we have no image of: Python elicits a SETUP if the stream is wanted. */
        if (type == SS_HDR_TYPE_DATA && !(t->flags & SS_EOS_FLAG) && is_subscribed(r, stream_id))
            return SS_RX_TO_PYTHON;
        return SS_RX_CONSUMED;
    }
    const int64_t term_length = image->term_length;
    int valid = t->term_offset >= 0 && (t->term_offset & (SS_FRAME_ALIGNMENT - 1)) == 0 &&
                (int64_t)t->term_offset + length <= term_length;
    t->padding = 0;
    t->heartbeat = type == SS_HDR_TYPE_DATA && frame_length == 0;
    if (valid && t->heartbeat) {
        valid = length == SS_HEADER_LENGTH;
    } else if (valid && data != NULL) {
        valid = valid_data_frames(first, data, length, t->term_offset, term_length, &t->padding);
    }
    if (!valid) {
        if (data != NULL) count(r->counters.invalid_packets, 1);
        return SS_RX_CONSUMED;
    }
    if (image->source_length > 0 &&
        !same_source(image->source, image->source_length, source, source_length)) {
        if (data != NULL) count(r->counters.foreign_source_drops, 1);
        return SS_RX_CONSUMED;
    }
    t->image = image;
    return SS_RX_CONSUMED;
}

/* The frames of a datagram data_target let in, inserted (`placed`: as insert_packet's). */
static int32_t insert_target(ss_receiver_t *r, const target_t *t, const uint8_t *data,
                             int32_t length, const uint8_t *source, int32_t source_length,
                             int placed, int64_t now_ns) {
    count(r->counters.bytes_received, length);
    if (insert_packet(r, t->image, data, length, t->padding, t->heartbeat, t->flags, t->term_id,
                      t->term_offset, placed, now_ns) &&
        t->image->connections != NULL)
        note_connection(r, t->image, source, source_length, now_ns);
    return SS_RX_CONSUMED;
}

static int32_t on_datagram(ss_receiver_t *r, const uint8_t *data, int32_t length,
                           const uint8_t *source, int32_t source_length, int64_t now_ns) {
    if (length < SS_FRAME_HEADER_LENGTH || data[SS_VERSION_FIELD] != SS_CURRENT_VERSION) {
        count(r->counters.invalid_packets, 1);
        return SS_RX_CONSUMED;
    }
    uint16_t type = read_u16(data + SS_TYPE_FIELD);
    if (type == SS_HDR_TYPE_NAK) return on_nak(r, data, length, source, source_length, now_ns);
    if (type == SS_HDR_TYPE_SM)
        return on_status_message(r, data, length, source, source_length, now_ns);
    if (type != SS_HDR_TYPE_DATA && type != SS_HDR_TYPE_PAD) return SS_RX_TO_PYTHON;
    if (length < SS_HEADER_LENGTH) {
        count(r->counters.invalid_packets, 1);
        return SS_RX_CONSUMED;
    }
    target_t t;
    const int32_t verdict = data_target(r, data, data, length, source, source_length, &t);
    if (t.image == NULL) return verdict;
    return insert_target(r, &t, data, length, source, source_length, 0, now_ns);
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

/* The shortest encrypted datagram whose frames are decrypted straight into a term: below it
 * the copy that saves costs less than the second decrypt call and the checks it takes. */
#define PLACED_MIN_LENGTH 4096

/* Where an encrypted datagram's frames may be decrypted straight into: the term of `t`'s
 * image at its offset, when the first frame's header (`first`, decrypted) names a DATA
 * datagram of `length` bytes that goes whole where nothing was written yet (at or past the
 * image's hwm, within the window, its first word 0), so that nothing there is read before
 * the header goes in last, and a forgery's bytes can be wiped without a trace.  NULL
 * otherwise: the datagram is opened in place and goes the way of any (and is counted there). */
static uint8_t *placement(ss_receiver_t *r, const uint8_t *first, int32_t length,
                          const uint8_t *source, int32_t source_length, target_t *t) {
    if (first[SS_VERSION_FIELD] != SS_CURRENT_VERSION ||
        read_u16(first + SS_TYPE_FIELD) != SS_HDR_TYPE_DATA ||
        read_i32(first) < SS_HEADER_LENGTH)
        return NULL;
    data_target(r, first, NULL, length, source, source_length, t);
    ss_image_t *image = t->image;
    if (image == NULL) return NULL;
    const int32_t term_count = (int32_t)((uint32_t)t->term_id - (uint32_t)image->initial_term_id);
    if (term_count < 0) return NULL;
    const int64_t position = ((int64_t)term_count << image->position_bits) + t->term_offset;
    if (position < LOAD_ACQ(image->receiver_hwm) || position < image->last_sm_position ||
        position + length > image->overrun_threshold)
        return NULL;
    uint8_t *at = image->log + (int64_t)(term_count % SS_PARTITION_COUNT) * image->term_length +
                  t->term_offset;
    return LOAD_ACQ((const int32_t *)at) == 0 ? at : NULL;
}

/* An encrypted endpoint's datagram opened.  Its frames are decrypted straight into their
 * image's term where placement allows (one pass, no copy): checked, authenticated, then
 * inserted (*placed = 1), or wiped from there and dropped; otherwise decrypted in place
 * (the result: their length, at data + SS_SEALED_HEADER_LENGTH).  Or an SS_OPEN_* verdict. */
static int32_t open_sealed(ss_receiver_t *r, uint8_t *data, int32_t length,
                           const uint8_t *source, int32_t source_length, int64_t now_ns,
                           int *placed) {
    ss_crypto_t *c = r->crypto;
    const int32_t body = ss_crypto_open_begin(c, data, length, source, source_length);
    if (body < 0) return body;
    uint8_t *text = data + SS_SEALED_HEADER_LENGTH;
    const uint8_t *tag = text + body;
    int32_t done = 0;
    if (body >= PLACED_MIN_LENGTH) {
        ss_crypto_open_update(c, text, text, SS_HEADER_LENGTH); /* the first frame's header */
        done = SS_HEADER_LENGTH;
        target_t t;
        uint8_t *at = placement(r, text, body, source, source_length, &t);
        if (at != NULL) {
            const size_t rest = (size_t)(body - SS_HEADER_LENGTH);
            ss_crypto_open_update(c, text + SS_HEADER_LENGTH, at + SS_HEADER_LENGTH,
                                  (int32_t)rest);
            *placed = 1;
            const int32_t verdict = ss_crypto_open_end(c, tag, source, source_length);
            int kept = verdict == 0 && !debug_drop(r, text, body);
            if (kept && !valid_data_frames(text, at, body, t.term_offset, t.image->term_length,
                                           &t.padding)) {
                count(r->counters.invalid_packets, 1);
                kept = 0;
            }
            if (!kept) {
                /* Forged, damaged, or frames no image takes: what went into the term is
                 * wiped (beyond the hwm, unread: the term stays as a sender left it). */
                memset(at + SS_HEADER_LENGTH, 0, rest);
                return verdict;
            }
            insert_target(r, &t, text, body, source, source_length, 1, now_ns);
            return body;
        }
    }
    ss_crypto_open_update(c, text + done, text + done, body - done);
    const int32_t verdict = ss_crypto_open_end(c, tag, source, source_length);
    return verdict < 0 ? verdict : body;
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
            int32_t datagram_length = rest < segment ? rest : segment;
            const uint8_t *datagram = buffer + offset;
            if (r->crypto != NULL) { /* an encrypted endpoint: opened, or dropped */
                int placed = 0;
                const int32_t opened = open_sealed(r, (uint8_t *)datagram, datagram_length,
                                                   source, source_length, now_ns, &placed);
                /* A handshake it answered or started leaves from this socket, now. */
                ss_crypto_flush_handshakes(r->crypto, r->fd);
                if (placed) {
                    if (length == 0) break;
                    continue;
                }
                if (opened < 0) {
                    if (opened == SS_OPEN_HANDSHAKE) r->handshake_taken = 1;
                    if (length == 0) break;
                    continue;
                }
                datagram += SS_SEALED_HEADER_LENGTH;
                datagram_length = opened;
            }
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
