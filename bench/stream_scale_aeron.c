/* Aeron's C client adding K stream pairs to aeronmd, the peer of bench/stream_scale.py.
 *
 *   stream_scale_aeron DIR ipc|udp K FIRST_PORT IDLE_S
 *
 * For each pair i (stream 1000 + i; UDP: endpoint 127.0.0.1:FIRST_PORT + i) it adds a
 * subscription, then a publication (aeron_async_add_* polled to completion), and prints the
 * pair's time in ns, one line each.  Then one message goes through every pair (offered until
 * taken, polled until read), it prints "connected SECONDS" (UDP: the time until every
 * publication was connected and its message read) and "idle", stays idle IDLE_S seconds
 * (the caller measures aeronmd meanwhile), and exits.  Built by bench/stream_scale.py against
 * an Aeron build (aeronc.h, libaeron_static.a). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "aeronc.h"

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void on_fragment(void *clientd, const uint8_t *buffer, size_t length,
                        aeron_header_t *header) {
    (void)buffer; (void)length; (void)header;
    (*(int *)clientd)++;
}

static void fail(const char *what) {
    fprintf(stderr, "%s: %s\n", what, aeron_errmsg());
    exit(1);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s DIR ipc|udp K FIRST_PORT IDLE_S\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    int udp = strcmp(argv[2], "udp") == 0;
    int count = atoi(argv[3]), first_port = atoi(argv[4]), idle_s = atoi(argv[5]);
    aeron_context_t *context;
    aeron_t *aeron;
    if (aeron_context_init(&context) < 0) fail("aeron_context_init");
    aeron_context_set_dir(context, dir);
    if (aeron_init(&aeron, context) < 0) fail("aeron_init");
    if (aeron_start(aeron) < 0) fail("aeron_start");
    aeron_subscription_t **subscriptions = calloc(count, sizeof(*subscriptions));
    aeron_publication_t **publications = calloc(count, sizeof(*publications));
    char uri[128];
    for (int i = 0; i < count; i++) {
        if (udp) snprintf(uri, sizeof(uri), "aeron:udp?endpoint=127.0.0.1:%d", first_port + i);
        else snprintf(uri, sizeof(uri), "aeron:ipc");
        int64_t began = now_ns();
        aeron_async_add_subscription_t *add_subscription;
        if (aeron_async_add_subscription(&add_subscription, aeron, uri, 1000 + i, NULL, NULL,
                                         NULL, NULL) < 0) fail("aeron_async_add_subscription");
        int done;
        while ((done = aeron_async_add_subscription_poll(&subscriptions[i], add_subscription)) == 0)
            sched_yield();
        if (done < 0) fail("add subscription");
        aeron_async_add_publication_t *add_publication;
        if (aeron_async_add_publication(&add_publication, aeron, uri, 1000 + i) < 0)
            fail("aeron_async_add_publication");
        while ((done = aeron_async_add_publication_poll(&publications[i], add_publication)) == 0)
            sched_yield();
        if (done < 0) fail("add publication");
        printf("%lld\n", (long long)(now_ns() - began));
    }
    fflush(stdout);
    int64_t began = now_ns();
    uint8_t message[32] = {0};
    for (int i = 0; i < count; i++) {
        while (aeron_publication_offer(publications[i], message, sizeof(message), NULL, NULL) < 0)
            sched_yield();
    }
    for (int i = 0; i < count; i++) {
        int read = 0;
        while (read == 0) {
            if (aeron_subscription_poll(subscriptions[i], on_fragment, &read, 1) == 0)
                sched_yield();
        }
    }
    printf("connected %.3f\nidle\n", (now_ns() - began) / 1e9);
    fflush(stdout);
    sleep(idle_s);
    aeron_close(aeron);
    aeron_context_close(context);
    return 0;
}
