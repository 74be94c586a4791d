/* slipstream's network data path: the duty cycle (Aeron's aeron_driver_sender_do_work and
 * aeron_driver_receiver_do_work, and the agent runner's idle strategy): the sender's bands, the
 * C half's rebuild passes, status messages, heartbeats and pub-lmt steps, the rule that says
 * when the Python half is due, and the network thread's loop.  See network.h for the
 * contracts. */
#define _GNU_SOURCE
#include "network_internal.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------- the duty cycle */

static int64_t clock_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* When a keepalive of `interval_ns` due at `due_ns` goes: with `slack_ns` (a parking loop's),
 * at the last multiple of SS_KEEPALIVE_GRAIN_NS, or of half the interval if less, at or
 * before due_ns (network.h); else at due_ns. */
static inline int64_t keepalive_at(int64_t due_ns, int64_t interval_ns, int64_t slack_ns) {
    const int64_t grain = interval_ns / 2 < SS_KEEPALIVE_GRAIN_NS ? interval_ns / 2
                                                                   : SS_KEEPALIVE_GRAIN_NS;
    if (slack_ns <= 0 || grain <= 0 || due_ns <= 0 || due_ns >= SS_NO_DEADLINE) return due_ns;
    return due_ns - due_ns % grain;
}

/* When publication p's next heartbeat goes (ss_publication_heartbeat's rule; keepalive_at):
 * a timeout after the last send, or after the instant the last heartbeat was due at if it
 * was the last send and went early (within the slack). */
static inline int64_t heartbeat_at(const ss_send_publication_t *p, int64_t slack_ns) {
    int64_t last = p->time_of_last_send_ns;
    const int64_t early = p->heartbeat_slot_ns - last;
    if (early > 0 && early <= slack_ns) last = p->heartbeat_slot_ns;
    return keepalive_at(last + SS_HEARTBEAT_TIMEOUT_NS, SS_HEARTBEAT_TIMEOUT_NS, slack_ns);
}

/* When the image's status-message timer is due (its SM's at sm_deadline_ns; keepalive_at). */
static inline int64_t sm_timer_at(const ss_image_t *image, int64_t slack_ns) {
    return keepalive_at(image->sm_deadline_ns, image->sm_interval_ns, slack_ns);
}

/* Read an endpoint's socket until it is empty, its datagrams for Python wait, or the batch
 * limit; returns the datagrams received. */
static int32_t receive_endpoint(ss_agent_t *a, ss_receiver_t *r, int64_t now_ns) {
    if (r->crypto != NULL) ss_crypto_tick(r->crypto); /* this thread seals and opens for it */
    else if (a->ready_stamp != 0 && r->ready_stamp != a->ready_stamp) return 0; /* no input */
    if (r->fd < 0 || r->pending_count > 0 || r->failed || r->pending == NULL) return 0;
    a->endpoints_read++;
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

/* One ss_send_data of publication i (its datagrams leave through its endpoint's send, to
 * its binding: a socket's, or the simulator's network). */
static int32_t send_one(ss_agent_t *a, int32_t i, int64_t now_ns, int32_t budget) {
    return ss_send_data(a->publications[i], now_ns, budget, a->spans);
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
            const int32_t sent = send_one(a, i, now_ns, (int32_t)budget);
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

/* The marks of send socket fd (ss_agent_t.socket_marks), or NULL beyond them. */
static inline int64_t *socket_marks(ss_agent_t *a, int32_t fd) {
    return fd >= 0 && fd < a->socket_mark_count ? a->socket_marks + 2 * (int64_t)fd : NULL;
}

static int32_t send_publications(ss_agent_t *a, int64_t now_ns, int retransmits_only,
                                 int virtual) {
    int32_t sent_total = 0;
    /* Repairs first, of every publication whatever its band or the governor's deferral: a gap
     * pins the receiver's window.  A budget of 0 sends the retransmissions only. */
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (!in_pass(p, virtual) || p->retransmit_count <= 0) continue;
        const int32_t sent = send_one(a, i, now_ns, 0);
        if (sent > 0) sent_total += sent; /* a full socket stops only its own publications */
    }
    if (retransmits_only) return sent_total;
    if (a->publication_count == 1) { /* nobody to share with */
        ss_send_publication_t *p = a->publications[0];
        if (in_pass(p, virtual) && !(a->defer_lowest_band && p->priority < 0)) {
            const int32_t sent = send_one(a, 0, now_ns, a->max_datagrams);
            if (sent > 0) sent_total += sent;
        }
        return sent_total;
    }
    /* One round per send socket, in the first of its publications: the bands divide what a
     * socket takes, and a socket held by a bottleneck must not hold the others back.  The
     * sockets with data are marked in one sweep, then each is served once (the simulator's
     * pass has one socket). */
    const int64_t pass = ++a->socket_pass;
    int virtual_ready = 0, virtual_served = 0;
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (!in_pass(p, virtual) || !ss_has_data_ready(p)) continue;
        int64_t *marks = socket_marks(a, p->fd);
        if (virtual) virtual_ready = 1;
        else if (marks != NULL) marks[0] = pass;
    }
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *first = a->publications[i];
        if (!in_pass(first, virtual)) continue;
        int any_ready = 1; /* a socket beyond the marks: its round looks for itself */
        int64_t *marks = socket_marks(a, first->fd);
        if (virtual) {
            if (virtual_served) continue;
            virtual_served = 1;
            any_ready = virtual_ready;
        } else if (marks != NULL) {
            if (marks[1] == pass) continue; /* served in its first publication */
            marks[1] = pass;
            any_ready = marks[0] == pass;
        }
        if (any_ready) sent_total += serve_socket(a, &first->round, first->fd, now_ns, virtual);
    }
    /* Aging: a publication with data that got nothing since it was last served waits on.
     * One on a socket the sweep found without data had none to wait with: its log is not
     * looked at again (an idle stream's cycle reads its log once). */
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (!in_pass(p, virtual)) continue;
        const int64_t *marks = virtual ? NULL : socket_marks(a, p->fd);
        /* A deferred publication does not age out of the lowest band: it waits on purpose. */
        if ((virtual ? !virtual_ready : marks != NULL && marks[0] != pass) ||
            !ss_has_data_ready(p) || (a->defer_lowest_band && p->priority < 0))
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
                received += receive_endpoint(a, a->endpoints[i], now_ns);
            work += received;
            /* The NAKs just answered queued retransmissions: they go now, not a cycle of new
             * data later (a gap pins the receiver's window until it is repaired). */
            if (received) work += send_publications(a, now_ns, 1, 0);
        }
        work += sent + heartbeats(a, now_ns) + publisher_limits(a);
    } else {
        for (int32_t i = 0; i < a->endpoint_count; i++)
            work += receive_endpoint(a, a->endpoints[i], now_ns);
        work += rebuild_images(a, now_ns);
        work += status_messages(a, now_ns);
    }
    ss_agent_python_due(a, now_ns);
    return work;
}

/* The slowest subscriber's position (the hwm without one), or with `furthest` the furthest's
 * (INT64_MIN without one), each bounded by ss_subscriber_position_bounded. */
static int64_t subscriber_position(const ss_image_t *image, int furthest) {
    const int64_t hwm = LOAD_ACQ(image->receiver_hwm);
    int64_t bound = furthest ? INT64_MIN : hwm;
    for (int32_t i = 0; i < image->subscriber_count; i++) {
        int64_t position =
            ss_subscriber_position_bounded(LOAD_ACQ(image->subscriber_positions[i]), hwm);
        if (furthest ? position > bound : position < bound) bound = position;
    }
    return bound;
}

static int64_t min_subscriber_position(const ss_image_t *image) {
    return subscriber_position(image, 0);
}

static int64_t max_subscriber_position(const ss_image_t *image) {
    return subscriber_position(image, 1);
}

/* Whether the C half rebuilds this image itself (see ss_image_t.rebuild_in_c): Python's flag,
 * and what only the C half knows of.  Python asks it through ss_image_rebuilt_in_c. */
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
static void send_naks(ss_image_t *image, int64_t now_ns) {
    if (!ss_receive_channel_can_send(image)) return;
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
        const ssize_t sent = ss_receive_channel_send(image, frame, sizeof frame, now_ns);
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

int32_t ss_image_track_rebuild(ss_image_t *image, int64_t now_ns) {
    ss_loss_detector_t *d = image->loss;
    image->dirty = 0; /* before the scan: data that lands during it makes the next pass due */
    if (d == NULL) return 0;
    d->fresh_count = d->due_count = 0; /* a pass that scans nothing saw no gap */
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
    return queued;
}

int32_t ss_image_rebuild(ss_image_t *image, int64_t now_ns) {
    const int32_t queued = ss_image_track_rebuild(image, now_ns);
    if (queued) send_naks(image, now_ns);
    return queued;
}

/* Whether the C half sends this image's 25 % rule status messages (ss_image_t.sm_in_c), and
 * cleans its log and keeps its liveness timer with them.  Python asks it through
 * ss_image_sends_status_messages. */
static inline int sends_status_messages(const ss_image_t *image) {
    return image->sm_in_c && image->subscriber_count > 0 && !image->python_on_data &&
           image->eos_position < 0;
}

/* The catch-up rule's position: an image with a group tag (its receivers are those that make
 * a publisher's messages durable, docs/CHANNELS.md §7.7) owes its sender an SM once its
 * slowest subscriber has consumed all it received, rcv-hwm, when that is past the last
 * scheduled SM.  A publisher waiting for its last message would otherwise wait for the timer
 * (200 ms): one message never moves consumption by the 25 % rule's quarter window.  Untagged
 * images keep Aeron's two rules: a subscriber that keeps up would make an SM per receive
 * batch, a load on every sender (an SM each, where the 25 % rule sends one per quarter
 * window) that only a durable publisher repays.  SS_NO_DEADLINE: none owed. */
static inline int64_t catch_up_position(const ss_image_t *image) {
    if (!image->has_group_tag || image->subscriber_count <= 0) return SS_NO_DEADLINE;
    const int64_t hwm = LOAD_ACQ(image->receiver_hwm);
    return hwm > image->sm_position ? hwm : SS_NO_DEADLINE;
}

/* The catch-up rule: at the catch-up position, and no SM within sm_catch_up_interval_ns (a
 * subscriber that keeps up with a steady stream catches up on every batch: the interval
 * bounds those SMs to one per interval). */
static inline int catch_up_due(const ss_image_t *image, int64_t slowest, int64_t now_ns) {
    return slowest >= catch_up_position(image) && now_ns >= image->sm_catch_up_ns;
}

/* The window the image may advertise at `position`: its own, never inviting data into a
 * partition that cleaning has not reached. */
static int64_t allowed_window(const ss_image_t *image, int64_t position) {
    int64_t window = image->reusable_limit - position;
    if (window > image->window) window = image->window;
    return window < 0 ? 0 : window;
}

int64_t ss_image_allowed_window(const ss_image_t *image, int64_t position) {
    return allowed_window(image, position);
}

/* Whether the subscribers' progress makes an SM due (the window's quarter consumed, or a
 * catch-up), rather than its timer or a changed window. */
static inline int status_message_progress_due(const ss_image_t *image, int64_t slowest,
                                              int64_t now_ns) {
    return slowest > image->sm_position + (image->sm_window >> 2) ||
           catch_up_due(image, slowest, now_ns);
}

/* ss_image_status_message_due's rule, its timer taken up to `slack_ns` early (the network
 * thread's loop: SS_TIMER_SLACK_NS). */
static int64_t status_message_due(const ss_image_t *image, int64_t slowest, int64_t now_ns,
                                  int64_t slack_ns) {
    if (status_message_progress_due(image, slowest, now_ns)) return slowest;
    /* The timer's, or a window that changed: at what the subscribers consumed by now (§4.6),
     * never behind. */
    if (now_ns + slack_ns >= sm_timer_at(image, slack_ns) ||
        allowed_window(image, image->sm_position) != image->sm_window)
        return slowest > image->sm_position ? slowest : image->sm_position;
    return -1;
}

int64_t ss_image_status_message_due(const ss_image_t *image, int64_t slowest, int64_t now_ns) {
    return status_message_due(image, slowest, now_ns, 0);
}

void ss_image_status_message_taken(ss_image_t *image, int64_t position, int64_t now_ns) {
    const int64_t window = allowed_window(image, position);
    image->sm_position = position;
    image->sm_window = (int32_t)window;
    image->sm_deadline_ns = now_ns + image->sm_interval_ns;
    image->sm_catch_up_ns = now_ns + image->sm_catch_up_interval_ns;
    image->last_sm_position = position;
    const int64_t overrun = position + image->term_length / 2;
    image->overrun_threshold = overrun < image->reusable_limit ? overrun : image->reusable_limit;
    image->sm_due_position = position + (window >> 2) + 1;
}

/* A status message at `position` (ss_image_status_message_due's), sent through the image's
 * socket (else left to the Python half: sm_unsent). */
static void send_status_message(ss_image_t *image, int64_t position, int64_t now_ns) {
    ss_image_status_message_taken(image, position, now_ns);
    const int64_t window = image->sm_window;
    ss_receiver_counters_t *counters = image->counters;
    if (!ss_receive_channel_can_send(image)) {
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
    const ssize_t sent = ss_receive_channel_send(image, frame, (size_t)frame_length, now_ns);
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

int64_t ss_image_liveness_deadline(const ss_image_t *image) {
    return image->time_of_last_packet_ns + image->liveness_timeout_ns;
}

int32_t ss_image_clean(ss_image_t *image, int64_t slowest) {
    ss_log_cleaner_t *cleaner = image->cleaner;
    const int32_t cleaned =
        ss_clean_toward(cleaner, image->log, image->term_length, image->position_bits, slowest);
    image->reusable_limit = ss_reusable_limit(cleaner, image->term_length);
    image->clean_due_position = ss_clean_due_position(cleaner, image->term_length);
    return cleaned;
}

/* Whether socket fd may take one more keepalive in the cycle at now_ns (SS_KEEPALIVE_BURST_MAX;
 * the simulator's, fd -1, has no buffer to overflow), counting it if so. */
static int keepalive_room(ss_agent_t *a, int32_t fd, int64_t now_ns) {
    if (fd < 0) return 1;
    if (a->keepalive_cycle_ns != now_ns) {
        memset(a->keepalives_sent, 0, sizeof a->keepalives_sent);
        a->keepalive_cycle_ns = now_ns;
    }
    const int32_t slots = (int32_t)(sizeof a->keepalives_sent / sizeof a->keepalives_sent[0]);
    int32_t *sent = &a->keepalives_sent[fd % slots];
    if (*sent >= SS_KEEPALIVE_BURST_MAX) return 0;
    ++*sent;
    return 1;
}

/* The C half's status messages and cleaning: the slowest subscriber reached the 25 % rule's
 * position, the catch-up rule's (a tagged image), or cleaning's. */
static int32_t status_messages(ss_agent_t *a, int64_t now_ns) {
    int32_t work = 0;
    for (int32_t i = 0; i < a->image_count; i++) {
        ss_image_t *image = a->images[i];
        if (!sends_status_messages(image)) continue;
        const int64_t slowest = min_subscriber_position(image);
        if (image->cleaner != NULL && slowest >= image->clean_due_position) {
            ss_image_clean(image, slowest);
            work++;
        }
        if (image->sm_unsent) continue;
        const int64_t position = status_message_due(image, slowest, now_ns,
                                                    a->keepalive_slack_ns);
        /* The flow's SMs go whatever the bound (one held back would be the Python half's). */
        if (position >= 0 && (status_message_progress_due(image, slowest, now_ns) ||
                              keepalive_room(a, image->control_fd, now_ns))) {
            const int64_t slot = sm_timer_at(image, a->keepalive_slack_ns);
            send_status_message(image, position, now_ns);
            /* The timer's SM taken early: the next from the instant it was due at, so that
             * the stream keeps its instants (network.h, SS_KEEPALIVE_GRAIN_NS). */
            if (slot > now_ns && slot <= now_ns + a->keepalive_slack_ns)
                image->sm_deadline_ns = slot + image->sm_interval_ns;
            work++;
        }
    }
    return work;
}

int64_t ss_publication_receiver_deadline(const ss_send_publication_t *p, int64_t last_sm_ns) {
    return last_sm_ns + p->connection_timeout_ns;
}

/* ss_publication_heartbeat's rule, taken up to `slack_ns` early (the network thread's loop:
 * SS_TIMER_SLACK_NS). */
static int32_t publication_heartbeat(ss_send_publication_t *p, int64_t now_ns, int64_t slack_ns) {
    const int64_t slot = heartbeat_at(p, slack_ns);
    if (!p->heartbeat_in_c || now_ns + slack_ns < slot) return 0;
    const int64_t position = LOAD_ACQ(p->sender_position);
    const int32_t term_count = (int32_t)(position >> p->position_bits);
    const int32_t term_id = (int32_t)((uint32_t)p->initial_term_id + (uint32_t)term_count);
    const int32_t term_offset = (int32_t)(position & (p->term_length - 1));
    uint8_t frame[SS_HEADER_LENGTH];
    memset(frame, 0, sizeof frame); /* the reserved value too */
    /* DATA of frame length 0: a heartbeat */
    const int eos = p->end_of_stream && p->signal_eos;
    put_control_header(frame, 0, SS_BEGIN_FLAG | SS_END_FLAG | (eos ? SS_EOS_FLAG : 0),
                       SS_HDR_TYPE_DATA);
    memcpy(frame + SS_TERM_OFFSET_FIELD, &term_offset, 4);
    memcpy(frame + SS_SESSION_ID_FIELD, &p->session_id, 4);
    memcpy(frame + SS_STREAM_ID_FIELD, &p->stream_id, 4);
    memcpy(frame + SS_TERM_ID_FIELD, &term_id, 4);
    /* Through the endpoint's send as the data goes, counted there. */
    const int32_t result = ss_send_channel_send_frame(p, frame, sizeof frame, NULL, 0);
    p->time_of_last_send_ns = now_ns; /* the next in a timeout, whatever became of this */
    p->heartbeat_slot_ns = slot;        /* ... from its instant if it went early */
    if (result < 0) return 0; /* not sent: a drain waits for one that is, or its timeout */
    if (p->end_of_stream) p->eos_heartbeats_sent++;
    count(p->heartbeats_sent, 1);
    return 1;
}

int32_t ss_publication_heartbeat(ss_send_publication_t *p, int64_t now_ns) {
    return publication_heartbeat(p, now_ns, 0);
}

/* The heartbeats of every publication (ss_publication_heartbeat), from a heap of timers keyed by
 * when each is due next (a key may be early, never late). */
/* Restore the heap order of the heartbeat timers below slot k. */
static void heartbeat_sift_down(ss_agent_t *a, int32_t k) {
    int32_t *heap = a->heartbeat_heap;
    int64_t *keys = a->heartbeat_keys;
    const int32_t count = a->heartbeat_count;
    for (;;) {
        const int32_t left = 2 * k + 1, right = left + 1;
        int32_t least = k;
        if (left < count && keys[left] < keys[least]) least = left;
        if (right < count && keys[right] < keys[least]) least = right;
        if (least == k) return;
        const int32_t index = heap[k];
        const int64_t key = keys[k];
        heap[k] = heap[least], keys[k] = keys[least];
        heap[least] = index, keys[least] = key;
        k = least;
    }
}

void ss_agent_schedule_heartbeats(ss_agent_t *a) {
    int32_t count = 0;
    if (a->heartbeat_heap != NULL)
        for (int32_t i = 0; i < a->publication_count; i++) {
            const ss_send_publication_t *p = a->publications[i];
            if (!p->heartbeat_in_c) continue;
            a->heartbeat_heap[count] = i;
            a->heartbeat_keys[count++] = heartbeat_at(p, a->keepalive_slack_ns);
        }
    a->heartbeat_count = count;
    for (int32_t k = count / 2 - 1; k >= 0; k--) heartbeat_sift_down(a, k);
}

/* The heartbeats due: the publications whose timer came, each keyed again (or dropped from the
 * timers once it no longer sends them in C, until the next Python pass keys them anew). */
static int32_t heartbeats(ss_agent_t *a, int64_t now_ns) {
    int32_t sent = 0;
    const int64_t slack_ns = a->keepalive_slack_ns;
    while (a->heartbeat_count > 0 && a->heartbeat_keys[0] <= now_ns + slack_ns) {
        ss_send_publication_t *p = a->publications[a->heartbeat_heap[0]];
        /* A key may be early (data went since): only a heartbeat due takes the bound's room. */
        if (p->heartbeat_in_c && now_ns + slack_ns >= heartbeat_at(p, slack_ns) &&
            !keepalive_room(a, p->fd, now_ns)) {
            a->heartbeat_keys[0] = now_ns + slack_ns + 1; /* its socket's next cycle */
            heartbeat_sift_down(a, 0);
            continue;
        }
        sent += publication_heartbeat(p, now_ns, slack_ns);
        if (p->heartbeat_in_c) {
            const int64_t due = heartbeat_at(p, slack_ns);
            /* unsent: the next cycle */
            a->heartbeat_keys[0] = due > now_ns + slack_ns ? due : now_ns + slack_ns + 1;
        } else {
            const int32_t last = --a->heartbeat_count;
            a->heartbeat_heap[0] = a->heartbeat_heap[last];
            a->heartbeat_keys[0] = a->heartbeat_keys[last];
        }
        heartbeat_sift_down(a, 0);
    }
    return sent;
}

int64_t ss_publication_slowest_spy(const ss_send_publication_t *p, int64_t bound) {
    int64_t least = bound;
    for (int32_t i = 0; i < p->spy_count; i++) {
        const int64_t position =
            ss_subscriber_position_bounded(LOAD_ACQ(p->spy_positions[i]), bound);
        if (position < least) least = position;
    }
    return least;
}

/* The consumer position without the fence: a look whether a step may be due (the step itself
 * takes ss_publication_consumer_position). */
static inline int64_t consumer_position_seen(const ss_send_publication_t *p) {
    int64_t position = LOAD_ACQ(p->sender_position);
    if (p->spy_hold != NULL) {
        const int64_t hold = LOAD_ACQ(p->spy_hold);
        if (hold < position) position = hold;
    }
    return p->spy_count > 0 ? ss_publication_slowest_spy(p, position) : position;
}

int64_t ss_publication_consumer_position(const ss_send_publication_t *p) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* snd-pos stored before the hold is read */
    return consumer_position_seen(p);
}

/* Whether the C half's pub-lmt rule has work for p: the consumer position (snd-pos, or a
 * slower spy) reached the next step, or cleaning is behind. */
static inline int limit_step_due(const ss_send_publication_t *p) {
    if (!p->limit_in_c || p->cleaner == NULL) return 0;
    return p->cleaner->position < p->cleaner->target ||
           consumer_position_seen(p) >=
               p->last_publisher_limit + p->trip_gain - p->term_window_length;
}

int32_t ss_publication_limit_step(ss_send_publication_t *p, int64_t limit_cap) {
    const int64_t position = ss_publication_consumer_position(p);
    int32_t work = ss_clean_toward(p->cleaner, p->log, p->term_length, p->position_bits, position);
    int64_t limit = position + p->term_window_length;
    const int64_t reusable = ss_reusable_limit(p->cleaner, p->term_length);
    if (reusable < limit) limit = reusable;
    if (limit_cap < limit) limit = limit_cap;
    if (limit >= p->last_publisher_limit + p->trip_gain) {
        p->last_publisher_limit = limit;
        ss_publish_limit(p->publisher_limit, limit, p->meta);
        work++;
    }
    return work;
}

/* pub-lmt's steps for the publications whose limit the C half moves (limit_in_c), with no
 * cap: they take offers and their credit is not stopped. */
static int32_t publisher_limits(ss_agent_t *a) {
    int32_t work = 0;
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (limit_step_due(p)) work += ss_publication_limit_step(p, SS_NO_DEADLINE);
    }
    return work;
}

/* The C half's timers (ss_agent_c_deadline's), split by what lateness costs: `timers`, the
 * earliest of those it acts on at their time (the gaps' NAKs, a catch-up SM, cleaning that is
 * behind, and the keepalives: a heartbeat's, an SM's timer, which a duty cycle of the network
 * thread's loop takes up to keepalive_slack_ns early, so that those falling due within it go
 * in one wake-up); `liveness`, the earliest liveness check (an image's, a receiver's), which
 * the loop's park may take up to SS_TIMER_SLACK_NS late. */
static void agent_deadlines(const ss_agent_t *a, int64_t *timers, int64_t *liveness) {
    int64_t exact = SS_NO_DEADLINE, late = SS_NO_DEADLINE;
    for (int32_t i = 0; i < a->publication_count; i++) {
        const ss_send_publication_t *p = a->publications[i];
        if (p->limit_in_c && p->cleaner != NULL && p->cleaner->position < p->cleaner->target) {
            *timers = 0, *liveness = SS_NO_DEADLINE; /* cleaning is behind: the next cycle */
            return;
        }
        if (p->heartbeat_in_c && heartbeat_at(p, a->keepalive_slack_ns) < exact)
            exact = heartbeat_at(p, a->keepalive_slack_ns);
        /* The liveness of the receiver whose SMs it takes: */
        if (p->sm_in_c && ss_publication_receiver_deadline(p, p->sm_time_ns) + 1 < late)
            late = ss_publication_receiver_deadline(p, p->sm_time_ns) + 1;
    }
    for (int32_t i = 0; i < a->image_count; i++) {
        const ss_image_t *image = a->images[i];
        if (rebuilt_in_c(image) && image->loss_deadline_ns < exact)
            exact = image->loss_deadline_ns;
        /* Caught up within the interval: the catch-up SM goes at its end, whichever half
         * sends it (the Python half's is due then: image_needs_python). */
        if (image->has_group_tag && image->sm_catch_up_ns < exact &&
            min_subscriber_position(image) >= catch_up_position(image))
            exact = image->sm_catch_up_ns;
        if (!sends_status_messages(image)) continue;
        if (!image->sm_unsent && sm_timer_at(image, a->keepalive_slack_ns) < exact)
            exact = sm_timer_at(image, a->keepalive_slack_ns);
        if (ss_image_liveness_deadline(image) < late)
            late = ss_image_liveness_deadline(image);
    }
    *timers = exact, *liveness = late;
}

int64_t ss_agent_c_deadline(const ss_agent_t *a) {
    int64_t timers, liveness;
    agent_deadlines(a, &timers, &liveness);
    return timers < liveness ? timers : liveness;
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

/* The slowest subscriber's position from which the Python half is due: the 25 % rule's SM,
 * or cleaning's unless the C half cleans.  Python asks it through
 * ss_image_python_due_position. */
static inline int64_t python_due_position(const ss_image_t *image) {
    if ((image->cleaner == NULL || !sends_status_messages(image)) &&
        image->clean_due_position < image->sm_due_position)
        return image->clean_due_position;
    return image->sm_due_position;
}

/* The predicates above, for the Python half (network.h): it asks them, never copies them. */
int32_t ss_image_rebuilt_in_c(const ss_image_t *image) { return rebuilt_in_c(image); }

int32_t ss_image_sends_status_messages(const ss_image_t *image) {
    return sends_status_messages(image);
}

int64_t ss_image_python_due_position(const ss_image_t *image) {
    return python_due_position(image);
}

int32_t ss_image_catch_up_due(const ss_image_t *image, int64_t now_ns) {
    return catch_up_due(image, min_subscriber_position(image), now_ns);
}

static int image_needs_python(const ss_image_t *image, int64_t now_ns) {
    if (image->nak_count > 0 || image->sm_unsent) return 1;
    /* Sums, not differences: ss_agent_python_due is asked at now = -INT64_MAX too. */
    if (sends_status_messages(image) &&
        now_ns >= ss_image_liveness_deadline(image))
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
    return slowest >= python_due_position(image) || catch_up_due(image, slowest, now_ns);
}

int32_t ss_agent_python_due(ss_agent_t *a, int64_t now_ns) {
    int32_t due = 0;
    if (LOAD_ACQ(&a->commands)) due |= SS_DUE_COMMANDS;
    if (now_ns >= a->python_deadline_ns) due |= SS_DUE_TIMER;
    int32_t *listed = a->due_members;
    int32_t count = 0;
    for (int32_t i = 0; i < a->endpoint_count; i++) {
        const ss_receiver_t *r = a->endpoints[i];
        if (r->pending_count > 0 || r->failed || r->handshake_taken) {
            due |= SS_DUE_INPUT;
            if (listed != NULL) listed[count++] = i;
        }
    }
    /* Without the list the first image (the first publication) due settles it. */
    for (int32_t i = 0; i < a->image_count && (listed != NULL || !(due & SS_DUE_IMAGE)); i++)
        if (image_needs_python(a->images[i], now_ns)) {
            due |= SS_DUE_IMAGE;
            if (listed != NULL) listed[count++] = a->endpoint_count + i;
        }
    const int32_t publications_listed = a->endpoint_count + a->image_count;
    for (int32_t i = 0;
         i < a->publication_count && (listed != NULL || !(due & SS_DUE_PUBLICATION)); i++) {
        const ss_send_publication_t *p = a->publications[i];
        if (p->notice || (p->sent_since_python &&
                          LOAD_ACQ(p->sender_position) >= p->python_send_position) ||
            (p->sm_in_c && now_ns > ss_publication_receiver_deadline(p, p->sm_time_ns)) ||
            (p->spy_count > 0 && p->spy_python_position != SS_NO_DEADLINE &&
             ss_publication_slowest_spy(p, p->spy_python_position) >= p->spy_python_position)) {
            due |= SS_DUE_PUBLICATION;
            if (listed != NULL) listed[count++] = publications_listed + i;
        }
    }
    a->due_members_count = count;
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
 * position where a status message is due, spies where pub-lmt's next step or the Python half
 * is due), then look once more; 0 when there is work after all.  disarm (delta -1) undoes
 * it. */
static int arm(ss_agent_t *a, int32_t delta, int64_t now_ns, int64_t *deadline) {
    int may_park = 1;
    for (int32_t i = 0; i < a->publication_count; i++) {
        ss_send_publication_t *p = a->publications[i];
        if (p->meta == NULL) continue;
        if (delta > 0 && p->spy_count > 0) {
            /* Its spies ring where the Python half is due, or pub-lmt's next step once
             * snd-pos has reached it: below, the step waits for the sender, not a spy, so a
             * spy ahead of the sender would ring on every advance for nothing (the
             * publishers ring at any position: they pass INT64_MAX). */
            int64_t wake = p->spy_python_position;
            const int64_t step = p->last_publisher_limit + p->trip_gain - p->term_window_length;
            if (p->limit_in_c && step < wake && LOAD_ACQ(p->sender_position) >= step)
                wake = step;
            STORE_REL((int64_t *)(p->meta + SS_META_DRIVER_WAKE_POSITION), wake);
        }
        __atomic_fetch_add(driver_waiters(p->meta), delta, __ATOMIC_SEQ_CST);
        /* A spy that moved before it could see us parked did not ring. */
        if (delta > 0 && p->spy_count > 0 && limit_step_due(p)) may_park = 0;
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
            int64_t wake = image->sm_due_position < image->clean_due_position
                               ? image->sm_due_position : image->clean_due_position;
            const int64_t catch_up = catch_up_position(image);
            if (catch_up < wake) wake = catch_up;
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
        int64_t timers, liveness;
        agent_deadlines(a, &timers, &liveness);
        if (timers < deadline) deadline = timers;
        /* Checked in the wake-up of a keepalive within the slack (SS_NO_DEADLINE, none, is
         * never below the difference). */
        if (liveness < deadline - SS_TIMER_SLACK_NS) deadline = liveness + SS_TIMER_SLACK_NS;
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

int32_t ss_epoll_event_size(void) { return (int32_t)sizeof(struct epoll_event); }

/* Mark the endpoints whose sockets epoll finds readable with a new stamp, and give it the
 * agents (ss_agent_t.ready_stamp): their cycle reads only those.  Stamp 0, every endpoint read,
 * below SS_POLL_ENDPOINTS_MIN endpoints, without the poll's arrays, or when the poll failed or
 * filled its array (a readable socket may be missing from it). */
static void poll_readable(ss_duty_loop_t *l) {
    int32_t endpoints = 0;
    for (int32_t i = 0; i < l->agent_count; i++) endpoints += l->agents[i]->endpoint_count;
    int64_t stamp = 0;
    if (l->epoll_fd >= 0 && l->poll_events != NULL && endpoints >= SS_POLL_ENDPOINTS_MIN) {
        struct epoll_event *events = l->poll_events;
        const int ready = epoll_wait(l->epoll_fd, events, l->poll_capacity, 0);
        if (ready >= 0 && ready < l->poll_capacity) {
            stamp = ++l->poll_stamp;
            for (int k = 0; k < ready; k++) {
                const int fd = events[k].data.fd;
                for (int32_t i = 0; i < l->agent_count; i++) {
                    const ss_agent_t *a = l->agents[i];
                    ss_receiver_t *r = fd >= 0 && fd < a->receivers_by_fd_count
                                           ? a->receivers_by_fd[fd] : NULL;
                    if (r != NULL && r->fd == fd) r->ready_stamp = stamp;
                }
            }
        }
    }
    for (int32_t i = 0; i < l->agent_count; i++) {
        ss_agent_t *a = l->agents[i];
        a->ready_stamp = a->receivers_by_fd != NULL ? stamp : 0;
    }
}

int32_t ss_duty_loop_once(ss_duty_loop_t *l) {
    const int64_t now_ns = clock_ns();
    int32_t work = 0;
    int32_t due = 0;
    poll_readable(l);
    for (int32_t i = 0; i < l->agent_count; i++) {
        ss_agent_t *a = l->agents[i];
        work += ss_agent_do_work(a, now_ns);
        due |= a->due;
        if (a->endpoints_read && l->endpoint_reads) count(l->endpoint_reads, a->endpoints_read);
        a->endpoints_read = 0;
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
    /* A loop that parks: the keepalives due within the slack share a wake-up.  Cycles run
     * without parks (an embedded driver's ss_duty_loop_once, the simulator's ss_agent_do_work)
     * save none by it, and take each at its time. */
    for (int32_t i = 0; i < l->agent_count; i++)
        l->agents[i]->keepalive_slack_ns = SS_TIMER_SLACK_NS;
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
