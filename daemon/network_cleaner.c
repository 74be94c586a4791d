/* slipstream's network data path: cleaning a log behind its consumers (Aeron's log cleaning in
 * the network publication and the publication image).  See network.h for the contracts. */
#define _GNU_SOURCE
#include "network_internal.h"

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
