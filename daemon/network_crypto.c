/* slipstream's network data path: sealed datagrams, the encrypted streams of
 * docs/PROTOCOL.md §7.8, after QUIC's packet protection (RFC 9001 section
 * 5: an AEAD per packet, the nonce from a packet number, the clear header as associated
 * data), SRT's two keys at once, and WireGuard's counters as nonces with a sliding
 * anti-replay window (RFC 6479).  The primitives are OpenSSL libcrypto's: AES-256-GCM
 * (EVP) and HKDF-SHA256 (EVP_PKEY_HKDF); nothing here is cryptography of its own.
 *
 * One context (ss_crypto_t) per endpoint of an encrypted channel: it seals every datagram
 * the endpoint sends (network_endpoints.c) and opens every datagram it receives before
 * dispatch (network_receiver.c).  Sealing runs on the one thread that sends through the
 * endpoint, opening on the one that receives on it; the keys are set from any thread
 * through a pending slot that the data path takes over at its next use (a lock word, never
 * waited on there).
 *
 * A sealed datagram (SS_SEALED_*, client/layout.py's SEALED_HEADER):
 *
 *   0  frame_length i32   the whole datagram           \
 *   4  version u8                                       |  slipstream's EXT header
 *   5  key id u8          which of the two keys         |  (a stock Aeron driver drops
 *   6  type u16 = EXT                                   |  EXT frames unread)
 *   8  magic i32, 12 ext type u16 = SEALED, 14 ext ver /
 *  16  sender id u64      random per context (per endpoint, per driver start)
 *  24  counter u64        the sender's datagram number: never repeats under a sender id
 *  32  ciphertext         the frames, as a plain endpoint sends them
 *  end tag (16)           GCM's, over bytes 0-31 (associated data) and the ciphertext
 *
 * The AEAD key of a sender is HKDF-SHA256(ikm = the named key, salt = sender id ||
 * epoch, info = SEAL_INFO), 32 bytes of key then 12 of IV, with epoch = counter >>
 * SS_SEALED_EPOCH_BITS: a sender derives a fresh AEAD key every 2^23 datagrams (RFC 9001
 * section 6.6's confidentiality limit for AES-GCM); the nonce is that IV XOR the counter,
 * big-endian in its last 8 bytes, as QUIC's. */
#define _GNU_SOURCE
#include "network_internal.h"

#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>
#include <stdlib.h>
#include <sys/random.h>
#include <time.h>

#define IV_LENGTH 12
#define PEERS_MAX 256
#define WINDOW_WORDS 64 /* the anti-replay bitmap: 64 x 64 bits */
#define WINDOW_BITS (WINDOW_WORDS * 64)
/* The counters the window accepts below the highest one seen (RFC 6479: the bitmap less a
 * word, the one the top's word shares). */
#define WINDOW_SPAN (WINDOW_BITS - 64)
#define ARENA_LENGTH (256 * 1024)
#define SEAL_BATCH 64

static const unsigned char SEAL_INFO[] = "slipstream sealed datagram v1";

typedef struct {
    int32_t held;
    uint8_t id;
    uint8_t key[SS_CRYPTO_KEY_LENGTH];
} key_slot_t;

/* What the endpoint knows of one sender that authenticated: its current epoch's AEAD and
 * its replay window (kept across key reloads: a reload re-derives the AEAD, never forgets
 * which counters came). */
typedef struct {
    int32_t used;
    int32_t ready;                /* ctx holds (key_id, epoch)'s key and iv */
    uint64_t sender_id;
    uint8_t key_id;
    uint64_t epoch;
    EVP_CIPHER_CTX *ctx;
    uint8_t iv[IV_LENGTH];
    uint64_t top;                 /* the highest counter accepted */
    uint64_t bitmap[WINDOW_WORDS];
    uint64_t last_use;            /* the tick of its last datagram */
} peer_t;

struct ss_crypto {
    key_slot_t keys[SS_CRYPTO_KEYS_MAX];           /* keys[0] seals; both open */
    /* Keys set from another thread: taken over by the data path at its next use. */
    int32_t lock;
    int32_t pending;
    key_slot_t pending_keys[SS_CRYPTO_KEYS_MAX];
    /* Sealing (the sending thread). */
    uint64_t sender_id;
    uint64_t counter;             /* the next datagram's */
    int32_t seal_ready;
    uint64_t seal_epoch;
    uint8_t seal_key_id;
    uint8_t seal_iv[IV_LENGTH];
    EVP_CIPHER_CTX *seal;
    uint8_t *arena;               /* sealed datagrams of one batch */
    uint8_t *frame;               /* one sealed control frame */
    struct mmsghdr messages[SEAL_BATCH];
    struct iovec vectors[SEAL_BATCH];
    union {
        char buffer[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } controls[SEAL_BATCH];           /* a sealed GSO run's UDP_SEGMENT */
    /* Opening (the receiving thread). */
    peer_t peers[PEERS_MAX];
    uint64_t tick;
    EVP_CIPHER_CTX *trial;        /* a new sender's or a new epoch's, until it authenticates */
    int64_t clock_offset_s;       /* a test's: this context's clock ahead of the host's */
    uint8_t trial_iv[IV_LENGTH];
    ss_crypto_counters_t counters;
};

_Static_assert(SS_CRYPTO_SENDER_ID_MAX_AGE_S ==
               SS_CRYPTO_SENDER_ID_LIFETIME_S + SS_CRYPTO_CLOCK_SKEW_S,
               "a sender id is heard for its lifetime and the clock skew allowed");

static uint64_t wall_seconds(const ss_crypto_t *c);
static int draw_sender(ss_crypto_t *c, uint64_t now_s);

/* --------------------------------------------------------------------------- keys */

static void lock(ss_crypto_t *c) {
    while (__atomic_exchange_n(&c->lock, 1, __ATOMIC_ACQUIRE)) {
    }
}

static void unlock(ss_crypto_t *c) { __atomic_store_n(&c->lock, 0, __ATOMIC_RELEASE); }

int32_t ss_crypto_set_keys(ss_crypto_t *c, const uint8_t *ids, const uint8_t *keys,
                           int32_t count_of) {
    if (count_of < 1 || count_of > SS_CRYPTO_KEYS_MAX) return -1;
    if (count_of == 2 && ids[0] == ids[1]) return -1;
    lock(c);
    memset(c->pending_keys, 0, sizeof c->pending_keys);
    for (int32_t i = 0; i < count_of; i++) {
        c->pending_keys[i].held = 1;
        c->pending_keys[i].id = ids[i];
        memcpy(c->pending_keys[i].key, keys + (size_t)i * SS_CRYPTO_KEY_LENGTH, SS_CRYPTO_KEY_LENGTH);
    }
    __atomic_store_n(&c->pending, 1, __ATOMIC_RELEASE);
    unlock(c);
    return 0;
}

/* Take over keys set since the last use: each AEAD is derived again at its next datagram. */
static inline void take_keys(ss_crypto_t *c) {
    if (__builtin_expect(!__atomic_load_n(&c->pending, __ATOMIC_ACQUIRE), 1)) return;
    lock(c);
    memcpy(c->keys, c->pending_keys, sizeof c->keys);
    OPENSSL_cleanse(c->pending_keys, sizeof c->pending_keys); /* one copy of a key, not two */
    c->pending = 0;
    unlock(c);
    c->seal_ready = 0;
    for (int32_t i = 0; i < PEERS_MAX; i++) c->peers[i].ready = 0;
}

static const key_slot_t *key_of(const ss_crypto_t *c, uint8_t id) {
    for (int32_t i = 0; i < 2; i++)
        if (c->keys[i].held && c->keys[i].id == id) return &c->keys[i];
    return NULL;
}

static void store_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint64_t load_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* HKDF-SHA256 of (key, sender id, epoch) into ctx's AES-256-GCM key and `iv`. */
static int derive(EVP_CIPHER_CTX *ctx, uint8_t iv[IV_LENGTH], const key_slot_t *key,
                  uint64_t sender_id, uint64_t epoch, int encrypt) {
    uint8_t salt[16], out[SS_CRYPTO_KEY_LENGTH + IV_LENGTH];
    store_u64(salt, sender_id);
    store_u64(salt + 8, epoch);
    size_t length = sizeof out;
    EVP_PKEY_CTX *kdf = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
    int ok = kdf != NULL && EVP_PKEY_derive_init(kdf) > 0 &&
             EVP_PKEY_CTX_set_hkdf_md(kdf, EVP_sha256()) > 0 &&
             EVP_PKEY_CTX_set1_hkdf_salt(kdf, salt, sizeof salt) > 0 &&
             EVP_PKEY_CTX_set1_hkdf_key(kdf, key->key, SS_CRYPTO_KEY_LENGTH) > 0 &&
             EVP_PKEY_CTX_add1_hkdf_info(kdf, SEAL_INFO, sizeof SEAL_INFO - 1) > 0 &&
             EVP_PKEY_derive(kdf, out, &length) > 0 && length == sizeof out;
    EVP_PKEY_CTX_free(kdf);
    if (ok) {
        ok = EVP_CipherInit_ex(ctx, EVP_aes_256_gcm(), NULL, out, NULL, encrypt) > 0;
        memcpy(iv, out + SS_CRYPTO_KEY_LENGTH, IV_LENGTH);
    }
    OPENSSL_cleanse(out, sizeof out);
    return ok;
}

/* Get (set = 0, sealing) or set (set = 1, opening) the GCM tag at `tag`.  The provider's
 * parameter call directly: EVP_CIPHER_CTX_ctrl builds the same parameter and then calls it,
 * and a datagram pays the provider's name lookups once per call either way. */
static int tag_param(EVP_CIPHER_CTX *ctx, uint8_t *tag, int set) {
    OSSL_PARAM params[2] = {
        OSSL_PARAM_construct_octet_string(OSSL_CIPHER_PARAM_AEAD_TAG, tag, SS_SEALED_TAG_LENGTH),
        OSSL_PARAM_construct_end()};
    return (set ? EVP_CIPHER_CTX_set_params(ctx, params) : EVP_CIPHER_CTX_get_params(ctx, params))
           > 0;
}

static void nonce_of(uint8_t nonce[IV_LENGTH], const uint8_t iv[IV_LENGTH], uint64_t counter) {
    memcpy(nonce, iv, IV_LENGTH);
    for (int i = 0; i < 8; i++) nonce[IV_LENGTH - 1 - i] ^= (uint8_t)(counter >> (8 * i));
}

/* ----------------------------------------------------------------------- the context */

ss_crypto_t *ss_crypto_new(void) {
    ss_crypto_t *c = calloc(1, sizeof *c);
    if (c == NULL) return NULL;
    c->seal = EVP_CIPHER_CTX_new();
    c->trial = EVP_CIPHER_CTX_new();
    c->arena = malloc(ARENA_LENGTH);
    c->frame = malloc(SS_SEALED_FRAME_MAX);
    int ok = c->seal != NULL && c->trial != NULL && c->arena != NULL && c->frame != NULL &&
             draw_sender(c, wall_seconds(c));
    for (int32_t i = 0; ok && i < PEERS_MAX; i++) {
        c->peers[i].ctx = EVP_CIPHER_CTX_new();
        ok = c->peers[i].ctx != NULL;
    }
    if (!ok) {
        ss_crypto_free(c);
        return NULL;
    }
    return c;
}

void ss_crypto_free(ss_crypto_t *c) {
    if (c == NULL) return;
    EVP_CIPHER_CTX_free(c->seal);
    EVP_CIPHER_CTX_free(c->trial);
    for (int32_t i = 0; i < PEERS_MAX; i++) EVP_CIPHER_CTX_free(c->peers[i].ctx);
    free(c->arena);
    free(c->frame);
    OPENSSL_cleanse(c, sizeof *c);
    free(c);
}

ss_crypto_counters_t *ss_crypto_counters(ss_crypto_t *c) { return &c->counters; }

uint64_t ss_crypto_sender_id(const ss_crypto_t *c) { return c->sender_id; }

void ss_crypto_set_counter(ss_crypto_t *c, uint64_t counter) { c->counter = counter; }

void ss_crypto_set_clock_offset(ss_crypto_t *c, int64_t seconds) { c->clock_offset_s = seconds; }

/* --------------------------------------------------------------------- sender ids */

/* The wall clock, in seconds (a sender id's birth, and its age at a receiver). */
static uint64_t wall_seconds(const ss_crypto_t *c) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME_COARSE, &now);
    return (uint64_t)(now.tv_sec + c->clock_offset_s);
}

/* When a sender id was drawn: its high 32 bits (docs/PROTOCOL.md §7.8, freshness). */
static uint64_t born_of(uint64_t sender_id) { return sender_id >> 32; }

/* Whether a sender id may be heard now: drawn within SS_CRYPTO_SENDER_ID_MAX_AGE_S, and not
 * more than SS_CRYPTO_CLOCK_SKEW_S ahead of this clock.  A recording replayed later names an
 * id no sender uses any more, whose datagrams no endpoint opens again, remembered or not. */
static int sender_is_fresh(uint64_t sender_id, uint64_t now_s) {
    const uint64_t born = born_of(sender_id), low = now_s & 0xFFFFFFFFu;
    return born + SS_CRYPTO_SENDER_ID_MAX_AGE_S >= low && born <= low + SS_CRYPTO_CLOCK_SKEW_S;
}

/* A new sender id: the clock's seconds above 32 random bits; its counter from 0. */
static int draw_sender(ss_crypto_t *c, uint64_t now_s) {
    uint32_t random = 0;
    if (getrandom(&random, sizeof random, 0) != (ssize_t)sizeof random) return 0;
    c->sender_id = ((now_s & 0xFFFFFFFFu) << 32) | random;
    c->counter = 0;
    c->seal_ready = 0;
    return 1;
}

/* The sealing thread's: a sender id older than SS_CRYPTO_SENDER_ID_LIFETIME_S gives way to
 * a new one (the receivers take it as a new sender), so that no live sender's id is ever
 * older than its lifetime, and a receiver can refuse one that is. */
static void fresh_sender(ss_crypto_t *c) {
    const uint64_t now_s = wall_seconds(c) & 0xFFFFFFFFu, born = born_of(c->sender_id);
    if (now_s >= born + SS_CRYPTO_SENDER_ID_LIFETIME_S || born > now_s + SS_CRYPTO_CLOCK_SKEW_S)
        draw_sender(c, now_s);  /* no randomness: the old id goes on, still unique */
}

/* ------------------------------------------------------------------------- sealing */

static int seal_keyed(ss_crypto_t *c, uint64_t epoch) {
    if (c->seal_ready && c->seal_epoch == epoch) return 1;
    const key_slot_t *key = &c->keys[0];
    if (!key->held) return 0;
    c->seal_ready = derive(c->seal, c->seal_iv, key, c->sender_id, epoch, 1);
    c->seal_epoch = epoch;
    c->seal_key_id = key->id;
    return c->seal_ready;
}

/* Seal the `vector_count` pieces of one datagram (total bytes of plaintext) into `out`
 * (capacity bytes).  Returns the sealed length, or -1 (no key, no room, libcrypto failed). */
static int32_t seal_vectors(ss_crypto_t *c, const struct iovec *vectors, size_t vector_count,
                            size_t total, uint8_t *out, size_t capacity) {
    const size_t sealed = total + SS_SEALED_OVERHEAD;
    if (sealed > capacity || sealed > INT32_MAX) return -1;
    const uint64_t counter = c->counter;
    if (!seal_keyed(c, counter >> SS_SEALED_EPOCH_BITS)) return -1;
    c->counter = counter + 1; /* spent even if this fails: a nonce is never used twice */
    const int32_t frame_length = (int32_t)sealed;
    const uint16_t type = SS_HDR_TYPE_EXT, ext_type = SS_EXT_TYPE_SEALED,
                   ext_version = SS_EXT_VERSION;
    const int32_t magic = SS_EXT_MAGIC;
    memcpy(out, &frame_length, 4);
    out[SS_VERSION_FIELD] = SS_CURRENT_VERSION;
    out[SS_FLAGS_FIELD] = c->seal_key_id;
    memcpy(out + SS_TYPE_FIELD, &type, 2);
    memcpy(out + SS_EXT_MAGIC_FIELD, &magic, 4);
    memcpy(out + SS_EXT_TYPE_FIELD, &ext_type, 2);
    memcpy(out + SS_EXT_VERSION_FIELD, &ext_version, 2);
    store_u64(out + SS_SEALED_SENDER_ID_FIELD, c->sender_id);
    store_u64(out + SS_SEALED_COUNTER_FIELD, counter);
    uint8_t nonce[IV_LENGTH];
    nonce_of(nonce, c->seal_iv, counter);
    int length = 0;
    if (EVP_EncryptInit_ex(c->seal, NULL, NULL, NULL, nonce) <= 0 ||
        EVP_EncryptUpdate(c->seal, NULL, &length, out, SS_SEALED_HEADER_LENGTH) <= 0)
        return -1;
    size_t at = SS_SEALED_HEADER_LENGTH;
    for (size_t v = 0; v < vector_count; v++) {
        if (vectors[v].iov_len == 0) continue;
        if (EVP_EncryptUpdate(c->seal, out + at, &length, vectors[v].iov_base,
                              (int)vectors[v].iov_len) <= 0)
            return -1;
        at += (size_t)length;
    }
    if (EVP_EncryptFinal_ex(c->seal, out + at, &length) <= 0) return -1;
    at += (size_t)length;
    if (at != SS_SEALED_HEADER_LENGTH + total || !tag_param(c->seal, out + at, 0)) return -1;
    return frame_length;
}

int32_t ss_crypto_seal(ss_crypto_t *c, const uint8_t *plain, int32_t length, uint8_t *out,
                       int32_t capacity) {
    if (length < 0 || capacity < 0) return -1;
    take_keys(c);
    fresh_sender(c);
    struct iovec vector = {.iov_base = (void *)plain, .iov_len = (size_t)length};
    return seal_vectors(c, &vector, 1, (size_t)length, out, (size_t)capacity);
}

const uint8_t *ss_crypto_seal_frame(ss_crypto_t *c, const uint8_t *frame, int32_t *length) {
    const int32_t sealed = ss_crypto_seal(c, frame, *length, c->frame, SS_SEALED_FRAME_MAX);
    if (sealed < 0) {
        count(c->counters.seal_failures, 1);
        return NULL;
    }
    *length = sealed;
    return c->frame;
}

/* One sealed message of the batch: `length` bytes at `out`, a GSO run of `segment`-byte
 * datagrams when segment > 0. */
static void add_message(ss_crypto_t *c, uint32_t index, uint8_t *out, size_t length,
                        size_t segment, const struct msghdr *plain) {
    struct mmsghdr *m = &c->messages[index];
    memset(m, 0, sizeof *m);
    c->vectors[index].iov_base = out;
    c->vectors[index].iov_len = length;
    m->msg_hdr.msg_iov = &c->vectors[index];
    m->msg_hdr.msg_iovlen = 1;
    m->msg_hdr.msg_name = plain->msg_name;
    m->msg_hdr.msg_namelen = plain->msg_namelen;
    if (segment > 0) {
        m->msg_hdr.msg_control = c->controls[index].buffer;
        m->msg_hdr.msg_controllen = sizeof c->controls[index].buffer;
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&m->msg_hdr);
        cmsg->cmsg_level = SOL_UDP;
        cmsg->cmsg_type = UDP_SEGMENT;
        cmsg->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        const uint16_t size = (uint16_t)segment;
        memcpy(CMSG_DATA(cmsg), &size, sizeof size);
    }
}

int ss_crypto_send(ss_crypto_t *c, struct mmsghdr *messages, uint32_t message_count,
                   int (*send)(void *, struct mmsghdr *, uint32_t), void *context) {
    take_keys(c);
    fresh_sender(c);
    uint32_t done = 0; /* the caller's messages sent whole */
    while (done < message_count) {
        /* Seal as many whole messages as the arena and the batch take.  A GSO run stays one:
         * its datagrams sealed back to back are equal still (each SS_SEALED_OVERHEAD longer),
         * the kernel cuts it at the sealed size, and the receiver's GRO coalesces them again.
         * send_spans ends a run where its sealed form fits one send; a longer one (another
         * caller's) goes as two or more. */
        uint32_t sealed_count = 0, taken = 0;
        uint32_t ends[SEAL_BATCH]; /* the sealed count after each message taken */
        size_t used = 0;
        for (uint32_t i = done; i < message_count; i++) {
            const struct msghdr *header = &messages[i].msg_hdr;
            size_t total = 0;
            for (size_t v = 0; v < header->msg_iovlen; v++) total += header->msg_iov[v].iov_len;
            size_t segment = header->msg_iovlen == 1 ? ss_gso_segment(header) : 0;
            if (segment >= total) segment = 0;
            const size_t pieces = segment > 0 ? (total + segment - 1) / segment : 1;
            const size_t sealed_segment = segment + SS_SEALED_OVERHEAD;
            size_t per_send = segment > 0 ? SS_GSO_MAX_BYTES / sealed_segment : 1;
            if (per_send < 1) per_send = 1;
            if (per_send > SS_GSO_MAX_SEGMENTS) per_send = SS_GSO_MAX_SEGMENTS;
            const size_t sends = (pieces + per_send - 1) / per_send;
            if (sealed_count + sends > SEAL_BATCH ||
                used + total + pieces * SS_SEALED_OVERHEAD + 8 > ARENA_LENGTH) {
                if (taken == 0) { errno = EMSGSIZE; return done > 0 ? (int)done : -1; }
                break;
            }
            if (segment == 0) {
                uint8_t *out = c->arena + used;
                const int32_t sealed = seal_vectors(c, header->msg_iov, header->msg_iovlen,
                                                    total, out, ARENA_LENGTH - used);
                if (sealed < 0) goto refused;
                add_message(c, sealed_count++, out, (size_t)sealed, 0, header);
                used += ((size_t)sealed + 7) & ~(size_t)7;
            } else {
                const uint8_t *base = header->msg_iov[0].iov_base;
                for (size_t first = 0; first < pieces; first += per_send) {
                    uint8_t *out = c->arena + used;
                    size_t length = 0;
                    const size_t last = first + per_send < pieces ? first + per_send : pieces;
                    for (size_t k = first; k < last; k++) {
                        const size_t offset = k * segment;
                        struct iovec piece = {
                            .iov_base = (void *)(base + offset),
                            .iov_len = total - offset < segment ? total - offset : segment};
                        const int32_t sealed = seal_vectors(c, &piece, 1, piece.iov_len,
                                                            out + length,
                                                            ARENA_LENGTH - used - length);
                        if (sealed < 0) goto refused;
                        length += (size_t)sealed;
                    }
                    add_message(c, sealed_count++, out, length,
                                last - first > 1 ? sealed_segment : 0, header);
                    used += (length + 7) & ~(size_t)7;
                }
            }
            ends[taken++] = sealed_count;
        }
        const int rc = send(context, c->messages, sealed_count);
        if (rc < 0) return done > 0 ? (int)done : -1;
        uint32_t whole = 0;
        while (whole < taken && ends[whole] <= (uint32_t)rc) whole++;
        /* The caller's accounting (bytes sent, what is sent again) is of its plain messages. */
        for (uint32_t i = 0; i < whole; i++) {
            size_t total = 0;
            for (size_t v = 0; v < messages[done + i].msg_hdr.msg_iovlen; v++)
                total += messages[done + i].msg_hdr.msg_iov[v].iov_len;
            messages[done + i].msg_len = (unsigned int)total;
        }
        done += whole;
        if ((uint32_t)rc < sealed_count) break; /* the socket is full */
    }
    return (int)done;
refused: /* a datagram could not be sealed: nothing of this batch goes */
    count(c->counters.seal_failures, 1);
    errno = ENOKEY;
    return done > 0 ? (int)done : -1;
}

/* ------------------------------------------------------------------------- opening */

/* RFC 6479: whether `counter` is new to the window (not below it, not seen). */
static int window_fresh(const peer_t *p, uint64_t counter) {
    if (counter > p->top) return 1;
    if (p->top - counter >= WINDOW_SPAN) return 0;
    return !(p->bitmap[(counter >> 6) % WINDOW_WORDS] & (1ULL << (counter & 63)));
}

static void window_mark(peer_t *p, uint64_t counter) {
    if (counter > p->top) {
        const uint64_t current = p->top >> 6, next = counter >> 6;
        uint64_t words = next - current;
        if (words > WINDOW_WORDS) words = WINDOW_WORDS;
        for (uint64_t i = 1; i <= words; i++) p->bitmap[(current + i) % WINDOW_WORDS] = 0;
        p->top = counter;
    }
    p->bitmap[(counter >> 6) % WINDOW_WORDS] |= 1ULL << (counter & 63);
}

static peer_t *find_peer(ss_crypto_t *c, uint64_t sender_id) {
    for (int32_t i = 0; i < PEERS_MAX; i++)
        if (c->peers[i].used && c->peers[i].sender_id == sender_id) return &c->peers[i];
    return NULL;
}

/* The slot for a sender that just authenticated: a free one, else one whose id is no longer
 * fresh (no datagram of it opens any more, so forgetting its window reopens nothing), else
 * NULL: every slot holds a sender that may still be heard, whose window must stay. */
static peer_t *new_peer(ss_crypto_t *c, uint64_t now_s) {
    for (int32_t i = 0; i < PEERS_MAX; i++) {
        if (!c->peers[i].used || !sender_is_fresh(c->peers[i].sender_id, now_s))
            return &c->peers[i];
    }
    return NULL;
}

/* Decrypt in place (the plaintext stays at data + header) and check the tag. */
static int decrypt(EVP_CIPHER_CTX *ctx, const uint8_t iv[IV_LENGTH], uint64_t counter,
                   uint8_t *data, int32_t length) {
    uint8_t nonce[IV_LENGTH];
    nonce_of(nonce, iv, counter);
    const int32_t body = length - SS_SEALED_OVERHEAD;
    uint8_t *text = data + SS_SEALED_HEADER_LENGTH;
    int out = 0;
    return EVP_DecryptInit_ex(ctx, NULL, NULL, NULL, nonce) > 0 &&
           EVP_DecryptUpdate(ctx, NULL, &out, data, SS_SEALED_HEADER_LENGTH) > 0 &&
           (body == 0 || EVP_DecryptUpdate(ctx, text, &out, text, body) > 0) &&
           tag_param(ctx, text + body, 1) &&
           EVP_DecryptFinal_ex(ctx, text + body, &out) > 0;
}

int32_t ss_crypto_open(ss_crypto_t *c, uint8_t *data, int32_t length) {
    take_keys(c);
    uint16_t type = 0, ext_type = 0, ext_version = 0;
    int32_t magic = 0, frame_length = 0;
    if (length >= SS_FRAME_HEADER_LENGTH) {
        memcpy(&frame_length, data, 4);
        memcpy(&type, data + SS_TYPE_FIELD, 2);
    }
    if (length >= SS_EXT_VERSION_FIELD + 2) {
        memcpy(&magic, data + SS_EXT_MAGIC_FIELD, 4);
        memcpy(&ext_type, data + SS_EXT_TYPE_FIELD, 2);
        memcpy(&ext_version, data + SS_EXT_VERSION_FIELD, 2);
    }
    if (type != SS_HDR_TYPE_EXT || magic != SS_EXT_MAGIC || ext_type != SS_EXT_TYPE_SEALED) {
        count(c->counters.plain_drops, 1); /* a plain peer, or nothing of ours */
        return SS_OPEN_PLAIN;
    }
    if (length < SS_SEALED_OVERHEAD || frame_length != length ||
        data[SS_VERSION_FIELD] != SS_CURRENT_VERSION || ext_version != SS_EXT_VERSION) {
        count(c->counters.auth_drops, 1); /* truncated, or a header no sender of ours made */
        return SS_OPEN_FAILED;
    }
    const key_slot_t *key = key_of(c, data[SS_FLAGS_FIELD]);
    if (key == NULL) {
        count(c->counters.unknown_key_drops, 1);
        return SS_OPEN_UNKNOWN_KEY;
    }
    const uint64_t sender_id = load_u64(data + SS_SEALED_SENDER_ID_FIELD);
    const uint64_t counter = load_u64(data + SS_SEALED_COUNTER_FIELD);
    const uint64_t epoch = counter >> SS_SEALED_EPOCH_BITS;
    const uint64_t now_s = wall_seconds(c);
    if (!sender_is_fresh(sender_id, now_s)) {
        count(c->counters.replay_drops, 1); /* a sender id past its lifetime: a recording */
        return SS_OPEN_REPLAY;
    }
    peer_t *p = find_peer(c, sender_id);
    if (p != NULL && !window_fresh(p, counter)) {
        count(c->counters.replay_drops, 1);
        return SS_OPEN_REPLAY;
    }
    if (p != NULL && p->ready && p->key_id == key->id && p->epoch == epoch) {
        if (!decrypt(p->ctx, p->iv, counter, data, length)) {
            count(c->counters.auth_drops, 1);
            return SS_OPEN_FAILED;
        }
    } else {
        /* A new sender, a new epoch or key: derived into the trial context, which takes the
         * sender's place only once the datagram authenticates (a forged one evicts no one). */
        if (!derive(c->trial, c->trial_iv, key, sender_id, epoch, 0) ||
            !decrypt(c->trial, c->trial_iv, counter, data, length)) {
            count(c->counters.auth_drops, 1);
            return SS_OPEN_FAILED;
        }
        if (p == NULL) {
            p = new_peer(c, now_s);
            if (p == NULL) {
                count(c->counters.senders_full_drops, 1);
                return SS_OPEN_SENDERS_FULL;
            }
            EVP_CIPHER_CTX *ctx = p->ctx;
            memset(p, 0, sizeof *p);
            p->ctx = ctx;
            p->used = 1;
            p->sender_id = sender_id;
            p->top = counter;
        }
        if (!p->ready || epoch >= p->epoch || p->key_id != key->id) {
            EVP_CIPHER_CTX *ctx = p->ctx;
            p->ctx = c->trial;
            c->trial = ctx;
            memcpy(p->iv, c->trial_iv, IV_LENGTH);
            p->key_id = key->id;
            p->epoch = epoch;
            p->ready = 1;
        }
    }
    window_mark(p, counter);
    p->last_use = ++c->tick;
    return length - SS_SEALED_OVERHEAD;
}
