/* What the data path's sealing costs beyond the cipher (docs/CHANNELS.md §7.8): the real
 * network_crypto.c, compiled into this program, seals `count` datagrams of `size` bytes
 * through ss_crypto_send in batches of `batch` (as an endpoint's sendmmsg hands them over)
 * and opens each batch's last with ss_crypto_open, once the two contexts exchanged their
 * handshake.  Prints nanoseconds of this thread's CPU per datagram, and the wall time the
 * handshake took at both ends together; the bare EVP sequence of one datagram, to hold it
 * against, is bench/aes_gcm_rate.c's loop.
 * The plaintexts are taken in turn from a ring of RING bytes (default: one batch, which stays
 * in the core's cache as the bare loop's buffer does); a ring larger than the core's caches
 * (a 16 MiB term's worth) makes the seal fetch its plaintext from farther away, as the data
 * path's fetches a term another core wrote: the difference is what that fetch costs a seal.
 * Under `valgrind --tool=callgrind` the instruction counts repeat on a shared machine, and
 * callgrind_annotate says where they go.
 *
 *     cc -O2 -std=gnu11 -I daemon -I client -o /tmp/seal_cost bench/seal_cost.c \
 *         daemon/network_crypto.c -lcrypto
 *     /tmp/seal_cost SIZE COUNT BATCH [RING] */
#define _GNU_SOURCE
#include "network_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BATCH_MAX 64

static const uint8_t *last_sent;
static size_t last_length;

/* The socket's place: takes every sealed message, keeps where the last one is. */
static int take(void *context, struct mmsghdr *messages, uint32_t count_of) {
    (void)context;
    last_sent = messages[count_of - 1].msg_hdr.msg_iov[0].iov_base;
    last_length = messages[count_of - 1].msg_hdr.msg_iov[0].iov_len;
    return (int)count_of;
}

static double seconds_of(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static double seconds(void) { return seconds_of(CLOCK_MONOTONIC); }

/* This thread's CPU time: what sealing and opening cost, however loaded the machine. */
static double cpu_seconds(void) { return seconds_of(CLOCK_THREAD_CPUTIME_ID); }

/* The handshake `receiver` starts on hearing `sender`, run to its end in this thread: each
 * one's outbox delivered to the other until both are empty.  0, or -1 if no session came. */
static int shake(ss_crypto_t *sender, ss_crypto_t *receiver) {
    static const uint8_t at_sender[16] = {2, 0, 0x9c, 0x41, 10, 0, 0, 1};
    static const uint8_t at_receiver[16] = {2, 0, 0x9c, 0x42, 10, 0, 0, 2};
    uint8_t datagram[SS_HANDSHAKE_ANSWER_LENGTH + SS_SEALED_OVERHEAD], address[SS_SOCKADDR_MAX];
    int32_t address_length = 0;
    const uint8_t nothing[1] = {0};
    int32_t length = ss_crypto_seal(sender, nothing, 0, datagram, (int32_t)sizeof datagram);
    if (length < 0 || ss_crypto_open(receiver, datagram, length, at_sender, 16) !=
                          SS_OPEN_AWAITING_HANDSHAKE)
        return -1;
    for (int moved = 1; moved;) {
        moved = 0;
        while ((length = ss_crypto_take_handshake(receiver, datagram, (int32_t)sizeof datagram,
                                                  address, &address_length)) > 0) {
            ss_crypto_open(sender, datagram, length, at_receiver, 16);
            moved = 1;
        }
        while ((length = ss_crypto_take_handshake(sender, datagram, (int32_t)sizeof datagram,
                                                  address, &address_length)) > 0) {
            ss_crypto_open(receiver, datagram, length, at_sender, 16);
            moved = 1;
        }
    }
    length = ss_crypto_seal(sender, nothing, 0, datagram, (int32_t)sizeof datagram);
    return ss_crypto_open(receiver, datagram, length, at_sender, 16) == 0 ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: seal_cost SIZE COUNT BATCH [RING]\n");
        return 2;
    }
    const int size = atoi(argv[1]);
    const long count = atol(argv[2]);
    const int batch = atoi(argv[3]);
    if (size <= 0 || size > SS_SEALED_FRAME_MAX - SS_SEALED_OVERHEAD || count <= 0 ||
        batch <= 0 || batch > BATCH_MAX)
        return 2;
    const size_t batch_bytes = (size_t)batch * (size_t)size;
    const size_t ring = argc == 5 ? strtoull(argv[4], NULL, 10) : batch_bytes;
    if (ring < batch_bytes) {
        fprintf(stderr, "seal_cost: RING (%zu) holds less than a batch (%zu)\n", ring,
                batch_bytes);
        return 2;
    }
    const size_t batches_in_ring = ring / batch_bytes;
    ss_crypto_t *sender = ss_crypto_new(), *receiver = ss_crypto_new();
    const uint8_t id = 1, key[32] = {7};
    uint8_t *plain = malloc(batches_in_ring * batch_bytes);
    uint8_t *copy = malloc((size_t)size + SS_SEALED_OVERHEAD);
    if (sender == NULL || receiver == NULL || plain == NULL || copy == NULL ||
        ss_crypto_set_keys(sender, &id, key, 1) != 0 ||
        ss_crypto_set_keys(receiver, &id, key, 1) != 0)
        return 1;
    const double shaking = seconds();
    if (shake(sender, receiver) != 0) return 1;
    const double shaken = seconds();
    memset(plain, 0, batches_in_ring * batch_bytes); /* every page mapped before the timing */
    struct mmsghdr messages[BATCH_MAX];
    struct iovec vectors[BATCH_MAX];
    memset(messages, 0, sizeof messages);
    for (int i = 0; i < batch; i++) {
        vectors[i].iov_len = (size_t)size;
        messages[i].msg_hdr.msg_iov = &vectors[i];
        messages[i].msg_hdr.msg_iovlen = 1;
    }
    double sealing = 0, opening = 0;
    long opened = 0;
    for (long n = 0; n < count; n += batch, opened++) {
        const uint8_t *taken = plain + (size_t)(opened % (long)batches_in_ring) * batch_bytes;
        for (int i = 0; i < batch; i++) vectors[i].iov_base = (void *)(taken + (size_t)i * size);
        const double start = cpu_seconds();
        if (ss_crypto_send(sender, messages, (uint32_t)batch, take, NULL) != batch) return 1;
        const double sent = cpu_seconds();
        memcpy(copy, last_sent, last_length); /* opened in place: a fresh copy each time */
        const double copied = cpu_seconds();
        if (ss_crypto_open(receiver, copy, (int32_t)last_length, NULL, 0) != size) return 1;
        sealing += sent - start;
        opening += cpu_seconds() - copied;
    }
    const long sealed = opened * batch;
    printf("%d B: ss_crypto_send %.0f ns/datagram (batches of %d, plaintext from a ring of "
           "%zu B), ss_crypto_open %.0f ns; the handshake %.0f us at both ends\n",
           size, sealing / (double)sealed * 1e9, batch, batches_in_ring * batch_bytes,
           opening / (double)opened * 1e9, (shaken - shaking) * 1e6);
    ss_crypto_free(sender);
    ss_crypto_free(receiver);
    free(plain);
    free(copy);
    return 0;
}
