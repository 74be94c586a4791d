/* The offer of client/native_appender.c in a loop of C calls, a shared appender's against an
 * exclusive one's (bench/exclusive_offer.py builds this with the client's C files that an offer
 * runs included, and runs it): what the exclusive claim, a store of the tail where the shared
 * one takes an atomic add, saves with no interpreter in the way.
 *
 *   exclusive_offer TERM_BITS SIZE MESSAGES ROUNDS
 *
 * One log of 2^TERM_BITS-byte terms in this process's memory, no limit, no reader; each round
 * offers MESSAGES messages of SIZE bytes with ss_offer through the shared appender, then as
 * many through the exclusive one (the same log, going on from where the other stopped, so
 * both meet the same term rotations).  Prints one line: "shared_ns exclusive_ns", the best
 * round of each, ns per offer. */
#include "native.c"
#include "native_appender.c"
#include "native_logbuffer.c"
#include "native_park.c"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: exclusive_offer TERM_BITS SIZE MESSAGES ROUNDS\n");
        return 2;
    }
    int32_t bits = atoi(argv[1]), size = atoi(argv[2]), messages = atoi(argv[3]);
    int32_t rounds = atoi(argv[4]);
    if (bits < 16 || bits > 30 || size < 0 || size > 1376 || messages <= 0 || rounds <= 0) {
        fprintf(stderr, "TERM_BITS 16..30, SIZE 0..1376, MESSAGES and ROUNDS > 0\n");
        return 2;
    }
    int32_t term_length = 1 << bits;
    size_t length = 3 * (size_t)term_length + SS_LOG_META_DATA_LENGTH;
    uint8_t *log = mmap(NULL, length, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (log == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    uint8_t *meta = log + 3 * (size_t)term_length;
    /* As LogBuffer.create: term 0 active, the others three terms back (the rotation's CAS). */
    for (int32_t i = 1; i < SS_PARTITION_COUNT; i++)
        *tail_counter(meta, i) = (int64_t)((uint64_t)(uint32_t)(i - SS_PARTITION_COUNT) << 32);
    *(int32_t *)(meta + SS_META_IS_CONNECTED) = 1;
    int64_t limit = INT64_MAX;
    ss_appender_t appender = {
        .log = log, .meta = meta, .publication_limit = &limit, .term_length = term_length,
        .position_bits = bits, .initial_term_id = 0, .session_id = 1, .stream_id = 2,
        .max_payload = 1408 - SS_HEADER_LENGTH, .max_message_length = term_length / 8,
        .max_position = (int64_t)term_length << 31, .doorbell_fd = -1,
    };
    char message[1376] = {0};
    double best[2] = {1e18, 1e18};
    for (int32_t round = 0; round < rounds; round++) {
        for (int exclusive = 0; exclusive < 2; exclusive++) {
            appender.exclusive = exclusive;
            int64_t started = now_ns();
            for (int32_t i = 0; i < messages; i++) ss_offer(&appender, message, size);
            double per_offer = (double)(now_ns() - started) / messages;
            if (per_offer < best[exclusive]) best[exclusive] = per_offer;
        }
    }
    printf("%.2f %.2f\n", best[0], best[1]);
    return 0;
}
