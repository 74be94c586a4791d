/* slipstream's network data path: the loss detector (Aeron's aeron_loss_detector.c): an image's
 * gaps and their NAK timers, and the loss report.  See network.h for the contracts. */
#define _GNU_SOURCE
#include "network_internal.h"

#include <time.h>

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
