/* slipstream's network data path: the retransmit handler (Aeron's aeron_retransmit_handler.c):
 * the sender's answer to NAKs.  See network.h for the contracts. */
#define _GNU_SOURCE
#include "network_internal.h"

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
    if (p->retransmit_budget_cap > 0 && total > 0) {
        /* In debt by at most a cap: the resends of one NAK may outrun what was left. */
        p->retransmit_credit -= total;
        if (p->retransmit_credit < -p->retransmit_budget_cap)
            p->retransmit_credit = -p->retransmit_budget_cap;
    }
    return offset - term_offset;
}

int64_t ss_retransmit_credit(ss_send_publication_t *p, int64_t now_ns) {
    const int64_t cap = p->retransmit_budget_cap;
    if (cap <= 0) return INT64_MAX;
    int64_t credit = p->retransmit_credit;
    const int64_t position = LOAD_ACQ(p->sender_position);
    const int64_t sent = position - p->retransmit_credit_position;
    if (sent > 0) {
        /* A share of the new data sent: what a receiver may have lost of it. */
        if (sent / 100 >= cap) credit = cap;
        else credit += sent / 100 * p->retransmit_budget_percent +
                       sent % 100 * p->retransmit_budget_percent / 100;
        p->retransmit_credit_position = position;
    }
    const int64_t elapsed = now_ns - p->retransmit_credit_time_ns;
    if (elapsed > 0 && p->retransmit_budget_interval_ns > 0) {
        /* And a cap per interval, so that a stream that stopped still repairs its tail.  The
         * clock moves on only with whole bytes credited (frequent calls lose nothing). */
        int64_t earned = elapsed >= p->retransmit_budget_interval_ns
                             ? cap
                             : (int64_t)((__int128)cap * elapsed / p->retransmit_budget_interval_ns);
        if (earned > 0) {
            credit += earned;
            p->retransmit_credit_time_ns = now_ns;
        }
    }
    if (credit > cap) credit = cap;
    p->retransmit_credit = credit;
    return credit;
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
    /* The budget (network.h, retransmit_budget_cap): a NAK beyond it is dropped, however
     * many come; the receiver's next NAK, once credit came back, is answered. */
    if (p->retransmit_budget_cap > 0 && ss_retransmit_credit(p, now_ns) <= 0) {
        count(p->nak_budget_drops, 1);
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
