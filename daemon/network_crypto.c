/* slipstream's network data path: sealed datagrams, the encrypted streams of
 * docs/CHANNELS.md §7.8, after QUIC's packet protection (RFC 9001 section
 * 5: an AEAD per packet, the nonce from a packet number, the clear header as associated
 * data), SRT's two keys at once, and WireGuard's counters as nonces with a sliding
 * anti-replay window (RFC 6479).  The primitives are OpenSSL libcrypto's: AES-256-GCM
 * (EVP) and HKDF-SHA256 (EVP_PKEY_HKDF); nothing here is cryptography of its own.
 *
 * One context (ss_crypto_t) per endpoint of an encrypted channel: it seals every datagram
 * the endpoint sends (network_endpoints.c) and opens every datagram it receives before
 * dispatch (network_receiver.c).  Sealing runs on the one thread that sends through the
 * endpoint, opening on the one that receives on it; the keys are set from any thread
 * through a pending slot whose parts each of the two takes over at its next use, into state
 * only it reads (a lock word, never waited on there).  (The driver's agents seal and open an
 * endpoint on one thread, daemon/agents' _c_view: ss_crypto_tick, which does both sides'
 * erasure, relies on it.)
 *
 * A sealed datagram (SS_SEALED_*, client/layout.py's SEALED_HEADER):
 *
 *   0  frame_length i32   the whole datagram           \
 *   4  version u8                                       |  slipstream's EXT header
 *   5  key id u8          which of the two keys         |  (a stock Aeron driver drops
 *   6  type u16 = EXT                                   |  EXT frames unread)
 *   8  magic i32, 12 ext type u16 = SEALED, 14 ext ver /
 *  16  sender id u64      drawn per endpoint every SS_CRYPTO_SENDER_ID_LIFETIME_S
 *  24  counter u64        the sender's datagram number: never repeats under a sender id
 *  32  ciphertext         the frames, as a plain endpoint sends them
 *  end tag (16)           GCM's, over bytes 0-31 (associated data) and the ciphertext
 *
 * Each sender id has a traffic secret of its own, 32 random bytes that never leave the
 * endpoint but inside a handshake.  The AEAD key of a sender is HKDF-SHA256(ikm = that
 * secret, salt = sender id || epoch, info = SEAL_INFO), 32 bytes of key then 12 of IV, with
 * epoch = counter >> SS_SEALED_EPOCH_BITS: a sender derives a fresh AEAD key every 2^23
 * datagrams (RFC 9001 section 6.6's confidentiality limit for AES-GCM); the nonce is that IV
 * XOR the counter, big-endian in its last 8 bytes, as QUIC's.
 *
 * The handshake (docs/CHANNELS.md §7.8) is Noise_NNpsk0_25519_AESGCM_SHA256 (the Noise
 * Protocol Framework, revision 34) with the channel's key as the pre-shared key, the
 * pattern WireGuard's is built from: an endpoint that receives a sealed datagram of a sender
 * id it has no session for drops it and starts an exchange with its source (INIT: -> psk,
 * e); the peer answers (ANSWER: <- e, ee) with its traffic secrets, sealed under keys only
 * the two ephemeral keys give; the initiator sends its own in the first transport message
 * (CONFIRM).  Each message says, per sender id, the counter its session begins at: what was
 * sent before, a recording included, opens nowhere.  Ephemeral keys live for one exchange,
 * traffic secrets for their sender id (SS_CRYPTO_SENDER_ID_MAX_AGE_S at most): whoever takes
 * the channel's key later cannot derive them from a capture (forward secrecy). */
#define _GNU_SOURCE
#include "network_internal.h"

#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
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
#define SECRET_LENGTH 32
#define DH_LENGTH 32
#define HASH_LENGTH 32
/* A handshake message's payload: per sender id (the current one, and the next one, drawn
 * ahead so that a peer holds it before it is used) the id, the counter its session begins
 * at, and its traffic secret. */
#define ENTRY_LENGTH (8 + 8 + SECRET_LENGTH)
#define PAYLOAD_LENGTH (2 * ENTRY_LENGTH)
#define EXCHANGES_MAX 32      /* exchanges this endpoint started and still remembers */
#define ANSWERS_MAX 32        /* exchanges this endpoint answered and still remembers */
#define OUTBOX_MAX 16
/* An INIT is sent again this often while its peer's datagrams keep coming unanswered, at
 * most RETRIES_MAX times; a new exchange with a source at most once per EXCHANGE_MIN_MS. */
#define RETRY_MS 100
#define RETRIES_MAX 20
#define EXCHANGE_MIN_MS 1000
/* A waiting exchange is given up this long after it started, however few of its tries went
 * (tries go only when its source sends again: a source that fell silent, or a forger that
 * sent once, holds no slot longer than this). */
#define EXCHANGE_WAIT_MS (RETRIES_MAX * RETRY_MS + EXCHANGE_MIN_MS)
/* An answered exchange is remembered this long: a repeated INIT gets the same answer, the
 * CONFIRM finds its key; an answer is sent again at most once per ANSWER_RESEND_MS. */
#define ANSWER_KEEP_MS 5000
#define ANSWER_RESEND_MS 50
/* New answers an endpoint makes a second at most, whoever asks (each costs an X25519 key and
 * agreement: a recording of INITs replayed from many spoofed sources costs this at most). */
#define ANSWERS_PER_SECOND 64
/* An INIT carries its initiator's wall clock (ms): one older or newer than the clock skew
 * allowed is refused, and the ephemeral key of each INIT answered is remembered as long as
 * its timestamp is within that skew (ANSWERS_PER_SECOND a second at most: the ring holds
 * every one of that span), so that a recorded INIT is answered once, never again. */
#define INIT_SKEW_MS ((uint64_t)SS_CRYPTO_CLOCK_SKEW_S * 1000u)
#define INITS_SEEN_MAX (ANSWERS_PER_SECOND * (2 * SS_CRYPTO_CLOCK_SKEW_S + 2))
/* New exchanges an endpoint starts a second at most, renewals aside (each costs an X25519
 * key: sealed datagrams of new sender ids from many spoofed sources cost this at most). */
#define EXCHANGES_PER_SECOND 64

static const unsigned char SEAL_INFO[] = "slipstream sealed datagram v2";
/* Noise's protocol name: exactly HASH_LENGTH bytes, so h starts as the name itself. */
static const char NOISE_NAME[] = "Noise_NNpsk0_25519_AESGCM_SHA256";
static const unsigned char PROLOGUE[] = "slipstream handshake v1";

_Static_assert(sizeof NOISE_NAME - 1 == HASH_LENGTH, "Noise: a name of HASHLEN is h itself");
_Static_assert(SS_HANDSHAKE_INIT_TIMESTAMP_FIELD == SS_HANDSHAKE_INIT_EPHEMERAL_FIELD + DH_LENGTH &&
               SS_HANDSHAKE_INIT_LENGTH ==
               SS_HANDSHAKE_INIT_TIMESTAMP_FIELD + 8 + SS_SEALED_TAG_LENGTH, "INIT");
_Static_assert(SS_HANDSHAKE_ANSWER_LENGTH == SS_HANDSHAKE_ANSWER_EPHEMERAL_FIELD + DH_LENGTH +
               PAYLOAD_LENGTH + SS_SEALED_TAG_LENGTH, "ANSWER");
_Static_assert(SS_HANDSHAKE_CONFIRM_LENGTH ==
               SS_HANDSHAKE_CONFIRM_PAYLOAD_FIELD + PAYLOAD_LENGTH + SS_SEALED_TAG_LENGTH,
               "CONFIRM");

typedef struct {
    int32_t held;
    uint8_t id;
    uint8_t key[SS_CRYPTO_KEY_LENGTH];
} key_slot_t;

/* What the endpoint knows of one sender it exchanged a handshake with: its traffic secret,
 * the counter its session began at, its current epoch's AEAD and its replay window (kept
 * across key reloads: a reload re-derives the AEAD, never forgets which counters came). */
typedef struct {
    int32_t used;
    int32_t ready;                /* ctx holds epoch's key and iv */
    int32_t announced;            /* learnt as its sender's next id: renew once it is used */
    uint64_t sender_id;
    uint64_t floor;               /* counters below it were sent before the exchange */
    uint8_t secret[SECRET_LENGTH];
    uint64_t epoch;
    EVP_CIPHER_CTX *ctx;
    uint8_t iv[IV_LENGTH];
    uint64_t top;                 /* the highest counter accepted */
    uint64_t bitmap[WINDOW_WORDS];
} peer_t;

/* Noise's symmetric state (its section 5.2): the chaining key, the handshake hash, the
 * cipher key and its nonce. */
typedef struct {
    uint8_t ck[HASH_LENGTH];
    uint8_t h[HASH_LENGTH];
    uint8_t k[SECRET_LENGTH];
    uint64_t n;
} noise_t;

/* An exchange this endpoint started (the initiator's side): with whom (the source of the
 * datagram that wanted it), its ephemeral key and Noise state after the INIT, and the INIT
 * itself, sent again until answered. */
typedef struct {
    int32_t state;                /* EXCHANGE_FREE, _PENDING, _DONE */
    uint64_t exchange_id;
    int32_t address_length;
    uint8_t address[SS_SOCKADDR_MAX];
    EVP_PKEY *ephemeral;
    noise_t noise;
    uint8_t init[SS_HANDSHAKE_INIT_LENGTH];
    uint64_t started_ms, sent_ms;
    int32_t tries;
    int32_t renewal;              /* asked by a sender with a session: strangers never evict it */
} exchange_t;

enum { EXCHANGE_FREE, EXCHANGE_PENDING, EXCHANGE_DONE };

/* An exchange this endpoint answered (the responder's side): the INIT as it came (a repeated
 * INIT is the same bytes: the initiator sends its INIT again unchanged), the answer (the same
 * one for a repeated INIT), and the key of the initiator's CONFIRM. */
typedef struct {
    int32_t used;
    int32_t confirmed;
    uint64_t exchange_id;
    int32_t address_length;
    uint8_t address[SS_SOCKADDR_MAX];
    uint8_t init[SS_HANDSHAKE_INIT_LENGTH];
    uint8_t answer[SS_HANDSHAKE_ANSWER_LENGTH];
    uint8_t confirm_key[SECRET_LENGTH];
    uint64_t answered_ms, sent_ms;
} answer_t;

/* An INIT answered: its ephemeral key's first 8 bytes, and its timestamp (wall ms). */
typedef struct {
    uint64_t ephemeral;
    uint64_t sent_ms;
} init_seen_t;

typedef struct {
    int32_t length;
    int32_t address_length;
    uint8_t address[SS_SOCKADDR_MAX];
    uint8_t data[SS_HANDSHAKE_ANSWER_LENGTH];
} outgoing_t;

struct ss_crypto {
    /* The receiving thread's keys: both open, keys[0] makes its INITs. */
    key_slot_t keys[SS_CRYPTO_KEYS_MAX];
    /* Keys set from another thread: each of the two threads takes over its own part at its
     * next use (pending_open: the receiving thread's keys; pending_seal: the sealing thread's
     * key id), so that neither reads what the other writes.  The lock also guards the sender
     * ids and secrets below against the receiving thread's reads. */
    int32_t lock;
    int32_t pending_open, pending_seal;
    key_slot_t pending_keys[SS_CRYPTO_KEYS_MAX];
    uint8_t pending_seal_id;
    /* Sealing (the sending thread). */
    int32_t sealing_held;         /* a key to seal under, whose id is sealing_id */
    uint8_t sealing_id;
    uint64_t sender_id;
    uint64_t counter;             /* the next datagram's */
    uint8_t secret[SECRET_LENGTH];        /* sender_id's traffic secret */
    uint64_t next_sender_id;              /* the one after it, drawn ahead */
    uint64_t previous_sender_id;          /* the one before it (its secret is gone) */
    uint8_t next_secret[SECRET_LENGTH];
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
    /* Opening and handshakes (the receiving thread). */
    peer_t peers[PEERS_MAX];
    EVP_CIPHER_CTX *trial;        /* a new epoch's, until it authenticates */
    /* The datagram between ss_crypto_open_begin and _end: its sender, the context that opens
     * it (the sender's, or the trial one), whether every piece decrypted, its counter and
     * epoch. */
    peer_t *opening;
    EVP_CIPHER_CTX *opening_ctx;
    int32_t opening_trial, opening_decrypted;
    uint64_t opening_counter, opening_epoch;
    int64_t clock_offset_s;       /* a test's: this context's clock ahead of the host's */
    uint8_t trial_iv[IV_LENGTH];
    exchange_t exchanges[EXCHANGES_MAX];
    answer_t answers[ANSWERS_MAX];
    init_seen_t inits_seen[INITS_SEEN_MAX]; /* a ring, the oldest overwritten */
    int32_t inits_seen_next;
    outgoing_t outbox[OUTBOX_MAX];
    int32_t outbox_count;
    int32_t handshake_address_length;
    uint8_t handshake_address[SS_SOCKADDR_MAX];
    uint64_t swept_s;             /* the wall clock's second of the last sweep */
    uint64_t answers_second;      /* the second of answers_made */
    int32_t answers_made;
    uint64_t exchanges_second;    /* the second of exchanges_made */
    int32_t exchanges_made;
    ss_crypto_counters_t counters;
};

_Static_assert(SS_CRYPTO_SENDER_ID_MAX_AGE_S ==
               SS_CRYPTO_SENDER_ID_LIFETIME_S + SS_CRYPTO_CLOCK_SKEW_S,
               "a sender id is heard for its lifetime and the clock skew allowed");

static uint64_t wall_seconds(const ss_crypto_t *c);
static int draw_senders(ss_crypto_t *c, uint64_t now_s);

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
    c->pending_seal_id = ids[0];
    __atomic_store_n(&c->pending_open, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&c->pending_seal, 1, __ATOMIC_RELEASE);
    unlock(c);
    return 0;
}

/* The receiving thread's: take over keys set since its last use (each peer's AEAD is derived
 * again at its next datagram). */
static inline void take_open_keys(ss_crypto_t *c) {
    if (__builtin_expect(!__atomic_load_n(&c->pending_open, __ATOMIC_ACQUIRE), 1)) return;
    lock(c);
    memcpy(c->keys, c->pending_keys, sizeof c->keys);
    OPENSSL_cleanse(c->pending_keys, sizeof c->pending_keys); /* one copy of a key, not two */
    c->pending_open = 0;
    unlock(c);
    for (int32_t i = 0; i < PEERS_MAX; i++) c->peers[i].ready = 0;
}

/* The sealing thread's: take over the id of the key that seals (its datagrams' key id; the
 * AEAD comes from the sender's traffic secret, derived again at the next datagram). */
static inline void take_seal_key(ss_crypto_t *c) {
    if (__builtin_expect(!__atomic_load_n(&c->pending_seal, __ATOMIC_ACQUIRE), 1)) return;
    lock(c);
    c->sealing_id = c->pending_seal_id;
    c->sealing_held = 1;
    c->pending_seal = 0;
    unlock(c);
    c->seal_ready = 0;
}

static const key_slot_t *key_of(const ss_crypto_t *c, uint8_t id) {
    for (int32_t i = 0; i < 2; i++)
        if (c->keys[i].held && c->keys[i].id == id) return &c->keys[i];
    return NULL;
}

static void store_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint64_t load_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* HKDF-SHA256 of (a sender's traffic secret, its id, epoch) into ctx's AES-256-GCM key and
 * `iv`. */
static int derive(EVP_CIPHER_CTX *ctx, uint8_t iv[IV_LENGTH], const uint8_t secret[SECRET_LENGTH],
                  uint64_t sender_id, uint64_t epoch, int encrypt) {
    uint8_t salt[16], out[SS_CRYPTO_KEY_LENGTH + IV_LENGTH];
    store_u64(salt, sender_id);
    store_u64(salt + 8, epoch);
    size_t length = sizeof out;
    EVP_PKEY_CTX *kdf = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
    int ok = kdf != NULL && EVP_PKEY_derive_init(kdf) > 0 &&
             EVP_PKEY_CTX_set_hkdf_md(kdf, EVP_sha256()) > 0 &&
             EVP_PKEY_CTX_set1_hkdf_salt(kdf, salt, sizeof salt) > 0 &&
             EVP_PKEY_CTX_set1_hkdf_key(kdf, secret, SECRET_LENGTH) > 0 &&
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
             draw_senders(c, wall_seconds(c));
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

static void forget_exchange(exchange_t *x);

void ss_crypto_free(ss_crypto_t *c) {
    if (c == NULL) return;
    for (int32_t i = 0; i < EXCHANGES_MAX; i++) forget_exchange(&c->exchanges[i]);
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

int32_t ss_crypto_set_counter(ss_crypto_t *c, uint64_t counter) {
    if (counter < __atomic_load_n(&c->counter, __ATOMIC_RELAXED)) return -1;
    __atomic_store_n(&c->counter, counter, __ATOMIC_RELAXED);
    return 0;
}

void ss_crypto_set_handshake_address(ss_crypto_t *c, const uint8_t *address,
                                     int32_t address_length) {
    if (address_length < 0 || address_length > SS_SOCKADDR_MAX) address_length = 0;
    if (address_length > 0) memcpy(c->handshake_address, address, (size_t)address_length);
    c->handshake_address_length = address_length;
}

void ss_crypto_set_clock_offset(ss_crypto_t *c, int64_t seconds) { c->clock_offset_s = seconds; }

/* --------------------------------------------------------------------- sender ids */

/* The wall clock, in seconds (a sender id's birth, and its age at a receiver). */
static uint64_t wall_seconds(const ss_crypto_t *c) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME_COARSE, &now);
    return (uint64_t)(now.tv_sec + c->clock_offset_s);
}

/* The wall clock, in milliseconds (an INIT's timestamp). */
static uint64_t wall_ms(const ss_crypto_t *c) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME_COARSE, &now);
    return (uint64_t)(now.tv_sec + c->clock_offset_s) * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}

/* When a sender id was drawn: its high 32 bits (docs/CHANNELS.md §7.8, freshness). */
static uint64_t born_of(uint64_t sender_id) { return sender_id >> 32; }

/* Whether a sender id may be heard now: drawn within SS_CRYPTO_SENDER_ID_MAX_AGE_S, and not
 * more than SS_CRYPTO_CLOCK_SKEW_S ahead of this clock.  A recording replayed later names an
 * id no sender uses any more, whose datagrams no endpoint opens again, remembered or not. */
static int sender_is_fresh(uint64_t sender_id, uint64_t now_s) {
    const uint64_t born = born_of(sender_id), low = now_s & 0xFFFFFFFFu;
    return born + SS_CRYPTO_SENDER_ID_MAX_AGE_S >= low && born <= low + SS_CRYPTO_CLOCK_SKEW_S;
}

/* A sender id born at `born_s` (the clock's seconds above 32 random bits) and its traffic
 * secret; nothing written unless both were drawn. */
static int draw_id(uint64_t born_s, uint64_t *id, uint8_t secret[SECRET_LENGTH]) {
    uint32_t random = 0;
    uint8_t drawn[SECRET_LENGTH];
    const int ok = getrandom(&random, sizeof random, 0) == (ssize_t)sizeof random &&
                   getrandom(drawn, SECRET_LENGTH, 0) == SECRET_LENGTH;
    if (ok) {
        *id = ((born_s & 0xFFFFFFFFu) << 32) | random;
        memcpy(secret, drawn, SECRET_LENGTH);
    }
    OPENSSL_cleanse(drawn, sizeof drawn);
    return ok;
}

/* The sender id to seal with from now on, its counter from 0: the next one drawn ahead, whom
 * peers of an earlier exchange already hold, while it is within its lifetime; else a new one.
 * Then a new next one, born when this one's lifetime ends.  The id given up, and its secret,
 * are gone (forward secrecy).  If no randomness came, the id in use goes on with its secret
 * and its counter (a counter never starts again under one id: its nonces would repeat), and
 * the next one is none: 0, and a later call draws again.  Under the lock: the receiving
 * thread's answers read them. */
static int draw_senders(ss_crypto_t *c, uint64_t now_s) {
    now_s &= 0xFFFFFFFFu;
    const uint64_t next_born = born_of(c->next_sender_id), before = c->sender_id;
    int ok = 1;
    if (c->next_sender_id != 0 && next_born <= now_s + SS_CRYPTO_CLOCK_SKEW_S &&
        now_s < next_born + SS_CRYPTO_SENDER_ID_LIFETIME_S) {
        c->sender_id = c->next_sender_id;
        memcpy(c->secret, c->next_secret, SECRET_LENGTH);
    } else {
        ok = draw_id(now_s, &c->sender_id, c->secret);
    }
    if (c->sender_id != before) {
        c->previous_sender_id = before;
        __atomic_store_n(&c->counter, 0, __ATOMIC_RELAXED);
        c->seal_ready = 0;
    }
    if (!draw_id(born_of(c->sender_id) + SS_CRYPTO_SENDER_ID_LIFETIME_S, &c->next_sender_id,
                 c->next_secret)) {
        ok = 0;
        c->next_sender_id = 0;
        OPENSSL_cleanse(c->next_secret, SECRET_LENGTH);
    }
    return ok && c->sender_id != 0;
}

/* The sealing thread's: a sender id older than SS_CRYPTO_SENDER_ID_LIFETIME_S gives way to
 * the next one (the receivers take it as a new sender), so that no live sender's id is ever
 * older than its lifetime, and a receiver can refuse one that is. */
static void fresh_sender(ss_crypto_t *c) {
    const uint64_t now_s = wall_seconds(c) & 0xFFFFFFFFu, born = born_of(c->sender_id);
    if (now_s >= born + SS_CRYPTO_SENDER_ID_LIFETIME_S || born > now_s + SS_CRYPTO_CLOCK_SKEW_S) {
        lock(c);
        const int drawn = draw_senders(c, now_s);
        unlock(c);
        if (!drawn) count(c->counters.seal_failures, 1); /* no randomness: drawn again next */
    }
}

/* ------------------------------------------------------------------------- sealing */

static int seal_keyed(ss_crypto_t *c, uint64_t epoch) {
    if (c->seal_ready && c->seal_epoch == epoch) return 1;
    if (!c->sealing_held) return 0;
    c->seal_ready = derive(c->seal, c->seal_iv, c->secret, c->sender_id, epoch, 1);
    c->seal_epoch = epoch;
    c->seal_key_id = c->sealing_id;
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
    /* Spent even if this fails: a nonce is never used twice.  (Atomic: an answer on the
     * receiving thread reads it as the counter a peer's session begins at.) */
    __atomic_store_n(&c->counter, counter + 1, __ATOMIC_RELAXED);
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
    take_seal_key(c);
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
    take_seal_key(c);
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

/* Whether a sender id was drawn longer ago than any datagram of it may be heard. */
static int sender_is_past(uint64_t sender_id, uint64_t now_s) {
    return born_of(sender_id) + SS_CRYPTO_SENDER_ID_MAX_AGE_S < (now_s & 0xFFFFFFFFu);
}

/* A sender forgotten: its secret and its AEAD's key schedule erased. */
static void forget_peer(peer_t *p) {
    EVP_CIPHER_CTX *ctx = p->ctx;
    EVP_CIPHER_CTX_reset(ctx); /* cleanses the key schedule */
    OPENSSL_cleanse(p, sizeof *p);
    p->ctx = ctx;
}

/* The slot for a sender learnt in a handshake: a free one, else one whose id is past (no
 * datagram of it opens any more, so forgetting its window reopens nothing), else NULL: every
 * slot holds a sender that may still be heard, whose window must stay. */
static peer_t *new_peer(ss_crypto_t *c, uint64_t now_s) {
    for (int32_t i = 0; i < PEERS_MAX; i++) {
        if (!c->peers[i].used || sender_is_past(c->peers[i].sender_id, now_s)) {
            forget_peer(&c->peers[i]);
            return &c->peers[i];
        }
    }
    return NULL;
}

/* The trial context's key schedule and IV erased (after each use: it holds an epoch given
 * up, or one a single late datagram needed). */
static void forget_trial(ss_crypto_t *c) {
    EVP_CIPHER_CTX_reset(c->trial); /* cleanses the key schedule */
    OPENSSL_cleanse(c->trial_iv, IV_LENGTH);
}

/* The AEAD of one datagram started: `ctx` set to the nonce of `counter`, the clear header
 * (the associated data) taken. */
static int decrypt_begin(EVP_CIPHER_CTX *ctx, const uint8_t iv[IV_LENGTH], uint64_t counter,
                         const uint8_t *data) {
    uint8_t nonce[IV_LENGTH];
    nonce_of(nonce, iv, counter);
    int out = 0;
    return EVP_DecryptInit_ex(ctx, NULL, NULL, NULL, nonce) > 0 &&
           EVP_DecryptUpdate(ctx, NULL, &out, data, SS_SEALED_HEADER_LENGTH) > 0;
}

static uint64_t now_ms(const ss_crypto_t *c);
static void sweep(ss_crypto_t *c, uint64_t now_s);
static void want_exchange(ss_crypto_t *c, const uint8_t *source, int32_t source_length,
                          uint64_t sender_id, uint64_t ms, int renewal);
static int32_t take_handshake(ss_crypto_t *c, const uint8_t *data, int32_t length,
                              uint16_t ext_type, const uint8_t *source, int32_t source_length,
                              uint64_t ms);

int32_t ss_crypto_open_begin(ss_crypto_t *c, const uint8_t *data, int32_t length,
                             const uint8_t *source, int32_t source_length) {
    c->opening = NULL;
    take_open_keys(c);
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
    if (source_length <= 0 || source_length > SS_SOCKADDR_MAX) source = NULL;
    const int handshake = ext_type == SS_EXT_TYPE_HANDSHAKE_INIT ||
                          ext_type == SS_EXT_TYPE_HANDSHAKE_ANSWER ||
                          ext_type == SS_EXT_TYPE_HANDSHAKE_CONFIRM;
    if (type != SS_HDR_TYPE_EXT || magic != SS_EXT_MAGIC ||
        (ext_type != SS_EXT_TYPE_SEALED && !handshake)) {
        count(c->counters.plain_drops, 1); /* a plain peer, or nothing of ours */
        return SS_OPEN_PLAIN;
    }
    const uint64_t now_s = wall_seconds(c);
    if (now_s != c->swept_s) sweep(c, now_s); /* once a second, on the clock this reads */
    if (handshake)
        return take_handshake(c, data, length, ext_type, source,
                              source != NULL ? source_length : 0, now_ms(c));
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
    if (!sender_is_fresh(sender_id, now_s)) {
        count(c->counters.replay_drops, 1); /* a sender id past its lifetime: a recording */
        return SS_OPEN_REPLAY;
    }
    peer_t *p = find_peer(c, sender_id);
    if (p == NULL || counter < p->floor) {
        /* No session with this sender, or a datagram from before it began (a recording
         * replayed to an endpoint that exchanged anew): nothing of it is read.  Its source is
         * asked for a session (not for one sent before: it answers with a floor above). */
        count(c->counters.awaiting_handshake_drops, 1);
        if (p == NULL && source != NULL)
            want_exchange(c, source, source_length, sender_id, now_ms(c), 0);
        return SS_OPEN_AWAITING_HANDSHAKE;
    }
    if (!window_fresh(p, counter)) {
        count(c->counters.replay_drops, 1);
        return SS_OPEN_REPLAY;
    }
    /* The sender's current epoch, or a new one (or keys reloaded) derived into the trial
     * context, which takes the sender's place only once the datagram authenticates (a forged
     * one changes nothing). */
    const int trial = !(p->ready && p->epoch == epoch);
    EVP_CIPHER_CTX *ctx = trial ? c->trial : p->ctx;
    if ((trial && !derive(c->trial, c->trial_iv, p->secret, sender_id, epoch, 0)) ||
        !decrypt_begin(ctx, trial ? c->trial_iv : p->iv, counter, data)) {
        if (trial) forget_trial(c);
        count(c->counters.auth_drops, 1);
        return SS_OPEN_FAILED;
    }
    c->opening = p;
    c->opening_ctx = ctx;
    c->opening_trial = trial;
    c->opening_decrypted = 1;
    c->opening_counter = counter;
    c->opening_epoch = epoch;
    return length - SS_SEALED_OVERHEAD;
}

void ss_crypto_open_update(ss_crypto_t *c, const uint8_t *in, uint8_t *out, int32_t length) {
    int written = 0;
    if (c->opening == NULL || length <= 0) return;
    if (EVP_DecryptUpdate(c->opening_ctx, out, &written, in, length) <= 0 || written != length)
        c->opening_decrypted = 0;
}

int32_t ss_crypto_open_end(ss_crypto_t *c, const uint8_t *tag, const uint8_t *source,
                           int32_t source_length) {
    peer_t *p = c->opening;
    if (p == NULL) return SS_OPEN_FAILED; /* no open begun: refused, counted there */
    c->opening = NULL;
    uint8_t rest[16]; /* GCM's final writes nothing */
    int out = 0;
    if (!c->opening_decrypted || !tag_param(c->opening_ctx, (uint8_t *)tag, 1) ||
        EVP_DecryptFinal_ex(c->opening_ctx, rest, &out) <= 0) {
        if (c->opening_trial) forget_trial(c);
        count(c->counters.auth_drops, 1);
        return SS_OPEN_FAILED;
    }
    const uint64_t counter = c->opening_counter, epoch = c->opening_epoch;
    if (c->opening_trial) {
        if (!p->ready || epoch >= p->epoch) {
            EVP_CIPHER_CTX *ctx = p->ctx;
            p->ctx = c->trial;
            c->trial = ctx;
            memcpy(p->iv, c->trial_iv, IV_LENGTH);
            p->epoch = epoch;
            p->ready = 1;
        }
        forget_trial(c); /* the epoch given up, or the late datagram's: no key kept twice */
    }
    window_mark(p, counter);
    if (p->announced) {
        /* Its sender moved on to the id drawn ahead: an exchange now gets the one after,
         * before the sender uses it. */
        p->announced = 0;
        if (source_length <= 0 || source_length > SS_SOCKADDR_MAX) source = NULL;
        if (source != NULL)
            want_exchange(c, source, source_length, p->sender_id, now_ms(c), 1);
    }
    return 0;
}

int32_t ss_crypto_open(ss_crypto_t *c, uint8_t *data, int32_t length, const uint8_t *source,
                       int32_t source_length) {
    const int32_t body = ss_crypto_open_begin(c, data, length, source, source_length);
    if (body < 0) return body;
    uint8_t *text = data + SS_SEALED_HEADER_LENGTH;
    ss_crypto_open_update(c, text, text, body);
    const int32_t verdict = ss_crypto_open_end(c, text + body, source, source_length);
    return verdict < 0 ? verdict : body;
}

/* ----------------------------------------------------------------------- handshakes */

static uint64_t now_ms(const ss_crypto_t *c) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &now);
    return (uint64_t)(now.tv_sec + c->clock_offset_s) * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}

static void forget_exchange(exchange_t *x) {
    EVP_PKEY_free(x->ephemeral);
    OPENSSL_cleanse(x, sizeof *x);
}

static void forget_answer(answer_t *a) { OPENSSL_cleanse(a, sizeof *a); }

/* Whether a waiting exchange is given up: out of tries, or older than EXCHANGE_WAIT_MS. */
static int exchange_given_up(const exchange_t *x, uint64_t ms) {
    return x->tries >= RETRIES_MAX || ms >= x->started_ms + EXCHANGE_WAIT_MS;
}

/* Erase what may no longer be used: senders past their age (their secrets: forward secrecy),
 * exchanges that ran out of tries, answers no INIT or CONFIRM will need. */
static void sweep(ss_crypto_t *c, uint64_t now_s) {
    const uint64_t ms = now_ms(c);
    c->swept_s = now_s;
    for (int32_t i = 0; i < PEERS_MAX; i++)
        if (c->peers[i].used && sender_is_past(c->peers[i].sender_id, now_s))
            forget_peer(&c->peers[i]);
    for (int32_t i = 0; i < EXCHANGES_MAX; i++) {
        exchange_t *x = &c->exchanges[i];
        if (x->state == EXCHANGE_PENDING && exchange_given_up(x, ms) &&
            ms >= x->sent_ms + 10 * EXCHANGE_MIN_MS) /* remembered: the next one asks for any */
            forget_exchange(x);
        else if (x->state == EXCHANGE_DONE && ms >= x->started_ms + EXCHANGE_MIN_MS)
            forget_exchange(x);
    }
    for (int32_t i = 0; i < ANSWERS_MAX; i++)
        if (c->answers[i].used && ms >= c->answers[i].answered_ms + ANSWER_KEEP_MS)
            forget_answer(&c->answers[i]);
}

void ss_crypto_tick(ss_crypto_t *c) {
    const uint64_t now_s = wall_seconds(c);
    if (now_s != c->swept_s) sweep(c, now_s);
    fresh_sender(c);
}

/* A handshake datagram for the outbox, to `address` or this endpoint's handshake address. */
static void post(ss_crypto_t *c, const uint8_t *data, int32_t length, const uint8_t *address,
                 int32_t address_length) {
    if (c->outbox_count >= OUTBOX_MAX) return; /* the exchange's retry covers it */
    outgoing_t *o = &c->outbox[c->outbox_count++];
    if (c->handshake_address_length > 0) {
        address = c->handshake_address;
        address_length = c->handshake_address_length;
    }
    memcpy(o->data, data, (size_t)length);
    o->length = length;
    memcpy(o->address, address, (size_t)address_length);
    o->address_length = address_length;
}

int32_t ss_crypto_take_handshake(ss_crypto_t *c, uint8_t *out, int32_t capacity,
                                 uint8_t *address, int32_t *address_length) {
    if (c->outbox_count <= 0) return 0;
    const outgoing_t *o = &c->outbox[0];
    const int32_t length = o->length;
    if (capacity < length) return -1;
    memcpy(out, o->data, (size_t)length);
    memcpy(address, o->address, (size_t)o->address_length);
    *address_length = o->address_length;
    c->outbox_count--;
    memmove(&c->outbox[0], &c->outbox[1], sizeof c->outbox[0] * (size_t)c->outbox_count);
    return length;
}

void ss_crypto_flush_handshakes(ss_crypto_t *c, int32_t fd) {
    for (int32_t i = 0; i < c->outbox_count; i++) {
        const outgoing_t *o = &c->outbox[i];
        (void)sendto(fd, o->data, (size_t)o->length, MSG_DONTWAIT,
                     (const struct sockaddr *)o->address, (socklen_t)o->address_length);
    }
    c->outbox_count = 0;
}

/* -- Noise (the Noise Protocol Framework, revision 34), from libcrypto's primitives */

/* HKDF(chaining_key, input_key_material, n) of Noise's section 4.3, as it defines it from
 * HMAC-SHA256 (RFC 5869's HKDF with the chaining key as salt and no info; libcrypto's HKDF
 * refuses the empty input key material Split() gives): `length` = 32 n bytes, n 2 or 3. */
static int noise_hkdf(const uint8_t ck[HASH_LENGTH], const uint8_t *ikm, size_t ikm_length,
                      uint8_t *out, size_t length) {
    static const uint8_t empty[1] = {0};
    uint8_t temp_key[HASH_LENGTH], block[HASH_LENGTH + 1];
    unsigned int produced = 0;
    int ok = HMAC(EVP_sha256(), ck, HASH_LENGTH, ikm_length > 0 ? ikm : empty, ikm_length,
                  temp_key, &produced) != NULL && produced == HASH_LENGTH;
    size_t previous = 0; /* bytes of the block before, in front of the counter byte */
    for (size_t at = 0; ok && at < length; at += HASH_LENGTH) {
        block[previous] = (uint8_t)(at / HASH_LENGTH + 1);
        ok = HMAC(EVP_sha256(), temp_key, HASH_LENGTH, block, previous + 1, out + at,
                  &produced) != NULL && produced == HASH_LENGTH;
        if (ok) memcpy(block, out + at, HASH_LENGTH);
        previous = HASH_LENGTH;
    }
    OPENSSL_cleanse(temp_key, sizeof temp_key);
    OPENSSL_cleanse(block, sizeof block);
    return ok;
}

/* MixHash: h = SHA-256(h || data). */
static int mix_hash(noise_t *s, const uint8_t *data, size_t length) {
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned int produced = 0;
    const int ok = md != NULL && EVP_DigestInit_ex(md, EVP_sha256(), NULL) > 0 &&
                   EVP_DigestUpdate(md, s->h, HASH_LENGTH) > 0 &&
                   (length == 0 || EVP_DigestUpdate(md, data, length) > 0) &&
                   EVP_DigestFinal_ex(md, s->h, &produced) > 0 && produced == HASH_LENGTH;
    EVP_MD_CTX_free(md);
    return ok;
}

/* MixKey: ck, k = HKDF(ck, ikm, 2); n = 0. */
static int mix_key(noise_t *s, const uint8_t *ikm, size_t length) {
    uint8_t out[2 * HASH_LENGTH];
    const int ok = noise_hkdf(s->ck, ikm, length, out, sizeof out);
    if (ok) {
        memcpy(s->ck, out, HASH_LENGTH);
        memcpy(s->k, out + HASH_LENGTH, SECRET_LENGTH);
        s->n = 0;
    }
    OPENSSL_cleanse(out, sizeof out);
    return ok;
}

/* MixKeyAndHash (the psk token): ck, temp_h, k = HKDF(ck, psk, 3); MixHash(temp_h); n = 0. */
static int mix_key_and_hash(noise_t *s, const uint8_t *psk, size_t length) {
    uint8_t out[3 * HASH_LENGTH];
    int ok = noise_hkdf(s->ck, psk, length, out, sizeof out);
    if (ok) {
        memcpy(s->ck, out, HASH_LENGTH);
        ok = mix_hash(s, out + HASH_LENGTH, HASH_LENGTH);
        memcpy(s->k, out + 2 * HASH_LENGTH, SECRET_LENGTH);
        s->n = 0;
    }
    OPENSSL_cleanse(out, sizeof out);
    return ok;
}

/* Noise's AESGCM cipher: ENCRYPT/DECRYPT(k, n, ad, text), the nonce 32 zero bits and n
 * big-endian; `in` of `length` bytes (and its tag after it when opening) into `out` (and the
 * tag after it when sealing). */
static int noise_aead(const uint8_t k[SECRET_LENGTH], uint64_t n, const uint8_t *ad,
                      size_t ad_length, const uint8_t *in, size_t length, uint8_t *out,
                      int encrypt) {
    uint8_t nonce[IV_LENGTH] = {0};
    for (int i = 0; i < 8; i++) nonce[IV_LENGTH - 1 - i] = (uint8_t)(n >> (8 * i));
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    int produced = 0, ok = ctx != NULL &&
        EVP_CipherInit_ex(ctx, EVP_aes_256_gcm(), NULL, k, nonce, encrypt) > 0 &&
        (ad_length == 0 || EVP_CipherUpdate(ctx, NULL, &produced, ad, (int)ad_length) > 0) &&
        (length == 0 || EVP_CipherUpdate(ctx, out, &produced, in, (int)length) > 0);
    if (ok && !encrypt) ok = tag_param(ctx, (uint8_t *)in + length, 1);
    ok = ok && EVP_CipherFinal_ex(ctx, out + length, &produced) > 0;
    if (ok && encrypt) ok = tag_param(ctx, out + length, 0);
    EVP_CIPHER_CTX_free(ctx);
    return ok;
}

/* EncryptAndHash: out = ENCRYPT(k, n++, h, plain) (length + 16 bytes); MixHash(out). */
static int encrypt_and_hash(noise_t *s, const uint8_t *plain, size_t length, uint8_t *out) {
    return noise_aead(s->k, s->n++, s->h, HASH_LENGTH, plain, length, out, 1) &&
           mix_hash(s, out, length + SS_SEALED_TAG_LENGTH);
}

/* DecryptAndHash: plain = DECRYPT(k, n++, h, in) (length + 16 bytes in); MixHash(in). */
static int decrypt_and_hash(noise_t *s, const uint8_t *in, size_t length, uint8_t *plain) {
    return noise_aead(s->k, s->n++, s->h, HASH_LENGTH, in, length, plain, 0) &&
           mix_hash(s, in, length + SS_SEALED_TAG_LENGTH);
}

/* Initialize(NNpsk0, prologue): h = the protocol's name, ck = h, MixHash(prologue), the
 * prologue binding the INIT's clear fields: the key id, the exchange id, the sender id
 * asked for. */
static int noise_start(noise_t *s, uint8_t key_id, uint64_t exchange_id, uint64_t asked) {
    uint8_t prologue[sizeof PROLOGUE - 1 + 1 + 8 + 8];
    memcpy(prologue, PROLOGUE, sizeof PROLOGUE - 1);
    prologue[sizeof PROLOGUE - 1] = key_id;
    store_u64(prologue + sizeof PROLOGUE, exchange_id);
    store_u64(prologue + sizeof PROLOGUE + 8, asked);
    memset(s, 0, sizeof *s);
    memcpy(s->h, NOISE_NAME, HASH_LENGTH);
    memcpy(s->ck, s->h, HASH_LENGTH);
    return mix_hash(s, prologue, sizeof prologue);
}

/* The `e` token with the psk modifier: MixHash(e.public), MixKey(e.public). */
static int mix_ephemeral(noise_t *s, const uint8_t public_key[DH_LENGTH]) {
    return mix_hash(s, public_key, DH_LENGTH) && mix_key(s, public_key, DH_LENGTH);
}

/* Split(): the first transport key, initiator to responder (the second is not used). */
static int split(const noise_t *s, uint8_t k1[SECRET_LENGTH]) {
    uint8_t out[2 * HASH_LENGTH];
    const int ok = noise_hkdf(s->ck, NULL, 0, out, sizeof out);
    memcpy(k1, out, SECRET_LENGTH);
    OPENSSL_cleanse(out, sizeof out);
    return ok;
}

/* GENERATE_KEYPAIR: a fresh X25519 key and its public half. */
static EVP_PKEY *x25519_new(uint8_t public_key[DH_LENGTH]) {
    EVP_PKEY *key = NULL;
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_X25519, NULL);
    size_t length = DH_LENGTH;
    if (ctx == NULL || EVP_PKEY_keygen_init(ctx) <= 0 || EVP_PKEY_keygen(ctx, &key) <= 0 ||
        EVP_PKEY_get_raw_public_key(key, public_key, &length) <= 0 || length != DH_LENGTH) {
        EVP_PKEY_free(key);
        key = NULL;
    }
    EVP_PKEY_CTX_free(ctx);
    return key;
}

/* DH(own, peer): X25519; a peer key of low order (an all-zero result) fails, as
 * WireGuard's. */
static int x25519(EVP_PKEY *own, const uint8_t peer_public[DH_LENGTH], uint8_t out[DH_LENGTH]) {
    EVP_PKEY *peer = EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, NULL, peer_public, DH_LENGTH);
    EVP_PKEY_CTX *ctx = peer != NULL ? EVP_PKEY_CTX_new(own, NULL) : NULL;
    size_t length = DH_LENGTH;
    int ok = ctx != NULL && EVP_PKEY_derive_init(ctx) > 0 &&
             EVP_PKEY_derive_set_peer(ctx, peer) > 0 && EVP_PKEY_derive(ctx, out, &length) > 0 &&
             length == DH_LENGTH;
    EVP_PKEY_CTX_free(ctx);
    EVP_PKEY_free(peer);
    uint8_t any = 0;
    for (int i = 0; i < DH_LENGTH; i++) any |= out[i];
    return ok && any != 0;
}

/* -- the messages */

/* The 16-byte EXT header of a handshake message, its exchange id after it. */
static void handshake_header(uint8_t *out, int32_t length, uint16_t ext_type, uint8_t key_id,
                             uint64_t exchange_id) {
    const uint16_t type = SS_HDR_TYPE_EXT, version = SS_EXT_VERSION;
    const int32_t magic = SS_EXT_MAGIC;
    memcpy(out, &length, 4);
    out[SS_VERSION_FIELD] = SS_CURRENT_VERSION;
    out[SS_FLAGS_FIELD] = key_id;
    memcpy(out + SS_TYPE_FIELD, &type, 2);
    memcpy(out + SS_EXT_MAGIC_FIELD, &magic, 4);
    memcpy(out + SS_EXT_TYPE_FIELD, &ext_type, 2);
    memcpy(out + SS_EXT_VERSION_FIELD, &version, 2);
    store_u64(out + SS_HANDSHAKE_EXCHANGE_ID_FIELD, exchange_id);
}

/* This endpoint's sender ids for a peer: the current one with the counter its next datagram
 * takes (the peer's session begins there), and the next one from 0. */
static void own_senders(ss_crypto_t *c, uint8_t payload[PAYLOAD_LENGTH]) {
    lock(c);
    store_u64(payload, c->sender_id);
    store_u64(payload + 8, __atomic_load_n(&c->counter, __ATOMIC_RELAXED));
    memcpy(payload + 16, c->secret, SECRET_LENGTH);
    store_u64(payload + ENTRY_LENGTH, c->next_sender_id);
    store_u64(payload + ENTRY_LENGTH + 8, 0);
    memcpy(payload + ENTRY_LENGTH + 16, c->next_secret, SECRET_LENGTH);
    unlock(c);
}

/* A peer's sender ids from a handshake: each one not known yet gets a session, beginning at
 * the counter given. */
static void learn_senders(ss_crypto_t *c, const uint8_t payload[PAYLOAD_LENGTH]) {
    const uint64_t now_s = wall_seconds(c);
    for (int32_t i = 0; i < 2; i++) {
        const uint8_t *entry = payload + i * ENTRY_LENGTH;
        const uint64_t sender_id = load_u64(entry);
        if (sender_id == 0 || sender_is_past(sender_id, now_s) || find_peer(c, sender_id))
            continue;
        peer_t *p = new_peer(c, now_s);
        if (p == NULL) {
            count(c->counters.senders_full_drops, 1);
            continue;
        }
        p->used = 1;
        p->sender_id = sender_id;
        p->floor = load_u64(entry + 8);
        p->top = p->floor;
        memcpy(p->secret, entry + 16, SECRET_LENGTH);
        p->announced = i == 1;
    }
    count(c->counters.handshakes, 1);
}

static int same_address(const uint8_t *a, int32_t a_length, const uint8_t *b,
                        int32_t b_length) {
    return a_length == b_length && memcmp(a, b, (size_t)a_length) == 0;
}

/* A sealed datagram of `sender_id` from `source` found no session: start an exchange with
 * it, or send its INIT again (every RETRY_MS, RETRIES_MAX times, within EXCHANGE_WAIT_MS), at
 * most one exchange with a source at once and a new one per EXCHANGE_MIN_MS; a renewal (its
 * sender moved on to the id drawn ahead) starts one whenever none is under way.  An exchange
 * that named a sender id and got no answer is followed by one that asks for any: the id may
 * have been a forgery spoofed from the source, and on a multicast group only the source's own
 * endpoints hear where this one sends.  With every slot taken, the oldest waiting exchange
 * gives way (a renewal's only to another renewal): whoever fills the table from many sources
 * delays a real peer by one exchange, never refuses it. */
static void want_exchange(ss_crypto_t *c, const uint8_t *source, int32_t source_length,
                          uint64_t sender_id, uint64_t ms, int renewal) {
    exchange_t *slot = NULL;
    int unanswered_name = 0;
    for (int32_t i = 0; i < EXCHANGES_MAX && slot == NULL; i++) {
        exchange_t *x = &c->exchanges[i];
        if (x->state == EXCHANGE_FREE ||
            !same_address(x->address, x->address_length, source, source_length))
            continue;
        if (x->state == EXCHANGE_PENDING && !exchange_given_up(x, ms)) {
            if (ms >= x->sent_ms + RETRY_MS) {
                x->sent_ms = ms;
                x->tries++;
                x->renewal |= renewal;
                post(c, x->init, SS_HANDSHAKE_INIT_LENGTH, x->address, x->address_length);
            }
            return;
        }
        const uint64_t last = x->state == EXCHANGE_PENDING ? x->sent_ms : x->started_ms;
        if (!renewal && ms < last + EXCHANGE_MIN_MS) return;
        unanswered_name = x->state == EXCHANGE_PENDING &&
                          load_u64(x->init + SS_HANDSHAKE_ASKED_FIELD) != 0;
        slot = x;
    }
    exchange_t *oldest = NULL;
    for (int32_t i = 0; i < EXCHANGES_MAX && slot == NULL; i++) {
        exchange_t *x = &c->exchanges[i];
        if (x->state == EXCHANGE_FREE ||
            (x->state == EXCHANGE_DONE && ms >= x->started_ms + EXCHANGE_MIN_MS) ||
            (x->state == EXCHANGE_PENDING && exchange_given_up(x, ms) &&
             ms >= x->sent_ms + EXCHANGE_MIN_MS))
            slot = x;
        else if (x->state == EXCHANGE_PENDING && (renewal || !x->renewal) &&
                 (oldest == NULL || (oldest->renewal && !x->renewal) ||
                  (oldest->renewal == x->renewal && x->started_ms < oldest->started_ms)))
            oldest = x; /* a stranger's before a renewal's, the oldest first */
    }
    if (slot == NULL) {
        count(c->counters.handshake_limited_drops, 1); /* the table full */
        slot = oldest;
    }
    const key_slot_t *key = &c->keys[0];
    if (slot == NULL || !key->held) return; /* every slot busy: the next datagram asks again */
    if (ms / 1000 != c->exchanges_second) {
        c->exchanges_second = ms / 1000;
        c->exchanges_made = 0;
    }
    if (!renewal && c->exchanges_made >= EXCHANGES_PER_SECOND) {
        count(c->counters.handshake_limited_drops, 1); /* the next datagram asks again */
        return;
    }
    c->exchanges_made++;
    forget_exchange(slot);
    /* The sender id asked for: on a multicast group, where every receiver (or every sender
     * of the group) hears the INIT, the one whose datagram wanted it; elsewhere, and after a
     * named exchange no one answered, any (0), whatever the datagram named, so that a forged
     * one (any id, spoofed from the peer's address) delays no exchange with the peer. */
    const uint64_t asked = c->handshake_address_length > 0 && !unanswered_name ? sender_id : 0;
    uint8_t public_key[DH_LENGTH];
    uint8_t *init = slot->init;
    if (getrandom(&slot->exchange_id, sizeof slot->exchange_id, 0) != sizeof slot->exchange_id ||
        (slot->ephemeral = x25519_new(public_key)) == NULL) {
        forget_exchange(slot);
        return;
    }
    /* -> psk, e; the payload the wall clock's milliseconds (only a holder of the key makes
     * its tag: a responder refuses it once it is older than the skew allowed). */
    uint8_t timestamp[8];
    store_u64(timestamp, wall_ms(c));
    handshake_header(init, SS_HANDSHAKE_INIT_LENGTH, SS_EXT_TYPE_HANDSHAKE_INIT, key->id,
                     slot->exchange_id);
    store_u64(init + SS_HANDSHAKE_ASKED_FIELD, asked);
    memcpy(init + SS_HANDSHAKE_INIT_EPHEMERAL_FIELD, public_key, DH_LENGTH);
    if (!noise_start(&slot->noise, key->id, slot->exchange_id, asked) ||
        !mix_key_and_hash(&slot->noise, key->key, SS_CRYPTO_KEY_LENGTH) ||
        !mix_ephemeral(&slot->noise, public_key) ||
        !encrypt_and_hash(&slot->noise, timestamp, sizeof timestamp,
                          init + SS_HANDSHAKE_INIT_TIMESTAMP_FIELD)) {
        forget_exchange(slot);
        return;
    }
    slot->state = EXCHANGE_PENDING;
    memcpy(slot->address, source, (size_t)source_length);
    slot->address_length = source_length;
    slot->started_ms = slot->sent_ms = ms;
    slot->tries = 1;
    slot->renewal = renewal;
    post(c, init, SS_HANDSHAKE_INIT_LENGTH, source, source_length);
}

/* Whether an authentic INIT stamped `sent_ms` with ephemeral key `initiator` may be answered:
 * stamped within the clock skew allowed of this clock, and its ephemeral key not among those
 * answered within that span. */
static int init_is_new(const ss_crypto_t *c, const uint8_t *initiator, uint64_t sent_ms) {
    const uint64_t now = wall_ms(c);
    if (sent_ms + INIT_SKEW_MS < now || sent_ms > now + INIT_SKEW_MS) return 0;
    const uint64_t ephemeral = load_u64(initiator);
    for (int32_t i = 0; i < INITS_SEEN_MAX; i++)
        if (c->inits_seen[i].ephemeral == ephemeral && c->inits_seen[i].sent_ms != 0 &&
            c->inits_seen[i].sent_ms + INIT_SKEW_MS >= now)
            return 0;
    return 1;
}

/* An INIT answered: its ephemeral key is not answered again while its timestamp is fresh. */
static void init_answered(ss_crypto_t *c, const uint8_t *initiator, uint64_t sent_ms) {
    init_seen_t *seen = &c->inits_seen[c->inits_seen_next];
    c->inits_seen_next = (c->inits_seen_next + 1) % INITS_SEEN_MAX;
    seen->ephemeral = load_u64(initiator);
    seen->sent_ms = sent_ms;
}

/* An INIT: answered if a holder of the key made it (<- e, ee, the payload our sender ids),
 * the same answer again for a repeated one. */
static int32_t answer_init(ss_crypto_t *c, const uint8_t *data, const key_slot_t *key,
                           const uint8_t *source, int32_t source_length, uint64_t ms) {
    const uint64_t exchange_id = load_u64(data + SS_HANDSHAKE_EXCHANGE_ID_FIELD);
    const uint64_t asked = load_u64(data + SS_HANDSHAKE_ASKED_FIELD);
    const uint8_t *initiator = data + SS_HANDSHAKE_INIT_EPHEMERAL_FIELD;
    lock(c);
    const int ours = asked == 0 || asked == c->sender_id || asked == c->next_sender_id ||
                     asked == c->previous_sender_id;
    unlock(c);
    if (!ours) {
        /* Asking another endpoint (on a multicast group every receiver hears a sender's
         * INIT), or one of ours long gone: a replay. */
        count(c->counters.handshake_unmatched_drops, 1);
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    answer_t *slot = NULL, *oldest = NULL;
    for (int32_t i = 0; i < ANSWERS_MAX; i++) {
        answer_t *a = &c->answers[i];
        if (a->used && memcmp(a->init, data, SS_HANDSHAKE_INIT_LENGTH) == 0) {
            /* A repeated INIT (its answer lost, or a replay): the same answer, which only
             * the holder of the INIT's ephemeral key can read.  Every byte is compared, the
             * sealed timestamp and its tag too: one that differs anywhere was not verified,
             * and is verified below like any new INIT. */
            if (ms < a->sent_ms + ANSWER_RESEND_MS || source == NULL) {
                count(c->counters.handshake_limited_drops, 1);
                return SS_OPEN_HANDSHAKE_REFUSED;
            }
            a->sent_ms = ms;
            post(c, a->answer, SS_HANDSHAKE_ANSWER_LENGTH, source, source_length);
            return SS_OPEN_HANDSHAKE;
        }
        if (!a->used) {
            if (slot == NULL) slot = a;
        } else if (source != NULL &&
                   same_address(a->address, a->address_length, source, source_length) &&
                   ms < a->answered_ms + ANSWER_RESEND_MS) {
            /* A new exchange from a source just answered: at most one per
             * ANSWER_RESEND_MS each (its initiator starts one a second at most). */
            count(c->counters.handshake_limited_drops, 1);
            return SS_OPEN_HANDSHAKE_REFUSED;
        } else if (oldest == NULL || a->answered_ms < oldest->answered_ms) {
            oldest = a;
        }
    }
    noise_t s;
    uint8_t payload[PAYLOAD_LENGTH], shared[DH_LENGTH], public_key[DH_LENGTH];
    if (!noise_start(&s, key->id, exchange_id, asked) ||
        !mix_key_and_hash(&s, key->key, SS_CRYPTO_KEY_LENGTH) ||
        !mix_ephemeral(&s, initiator) ||
        !decrypt_and_hash(&s, data + SS_HANDSHAKE_INIT_TIMESTAMP_FIELD, 8, payload)) {
        OPENSSL_cleanse(&s, sizeof s);
        count(c->counters.handshake_failed_drops, 1); /* not made with this key */
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    const uint64_t init_sent_ms = load_u64(payload);
    if (!init_is_new(c, initiator, init_sent_ms)) {
        /* Made longer ago than the skew allowed, or answered before: a recording. */
        OPENSSL_cleanse(&s, sizeof s);
        count(c->counters.handshake_unmatched_drops, 1);
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    if (slot == NULL && oldest != NULL && ms >= oldest->answered_ms + ANSWER_RESEND_MS)
        slot = oldest;
    if (ms / 1000 != c->answers_second) {
        c->answers_second = ms / 1000;
        c->answers_made = 0;
    }
    if (slot == NULL || source == NULL || c->answers_made >= ANSWERS_PER_SECOND) {
        OPENSSL_cleanse(&s, sizeof s);
        count(c->counters.handshake_limited_drops, 1);
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    forget_answer(slot);
    uint8_t *answer = slot->answer;
    EVP_PKEY *ephemeral = x25519_new(public_key);
    int ok = ephemeral != NULL;
    if (ok) {
        handshake_header(answer, SS_HANDSHAKE_ANSWER_LENGTH, SS_EXT_TYPE_HANDSHAKE_ANSWER,
                         key->id, exchange_id);
        memcpy(answer + SS_HANDSHAKE_ANSWER_EPHEMERAL_FIELD, public_key, DH_LENGTH);
        own_senders(c, payload);
        ok = mix_ephemeral(&s, public_key) && x25519(ephemeral, initiator, shared) &&
             mix_key(&s, shared, DH_LENGTH) &&
             encrypt_and_hash(&s, payload, PAYLOAD_LENGTH,
                              answer + SS_HANDSHAKE_ANSWER_EPHEMERAL_FIELD + DH_LENGTH) &&
             split(&s, slot->confirm_key);
    }
    EVP_PKEY_free(ephemeral); /* the responder's ephemeral key lives for one answer */
    OPENSSL_cleanse(&s, sizeof s);
    OPENSSL_cleanse(shared, sizeof shared);
    OPENSSL_cleanse(payload, sizeof payload);
    if (!ok) {
        forget_answer(slot);
        count(c->counters.handshake_failed_drops, 1); /* a low-order key, or libcrypto */
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    c->answers_made++;
    init_answered(c, initiator, init_sent_ms);
    slot->used = 1;
    slot->exchange_id = exchange_id;
    memcpy(slot->init, data, SS_HANDSHAKE_INIT_LENGTH);
    memcpy(slot->address, source, (size_t)source_length);
    slot->address_length = source_length;
    slot->answered_ms = slot->sent_ms = ms;
    post(c, answer, SS_HANDSHAKE_ANSWER_LENGTH, source, source_length);
    return SS_OPEN_HANDSHAKE;
}

/* An ANSWER to an exchange of ours: the peer's sender ids, then our CONFIRM with ours. */
static int32_t take_answer(ss_crypto_t *c, const uint8_t *data, uint8_t key_id) {
    const uint64_t exchange_id = load_u64(data + SS_HANDSHAKE_EXCHANGE_ID_FIELD);
    exchange_t *x = NULL;
    for (int32_t i = 0; i < EXCHANGES_MAX && x == NULL; i++)
        if (c->exchanges[i].state == EXCHANGE_PENDING &&
            c->exchanges[i].exchange_id == exchange_id)
            x = &c->exchanges[i];
    if (x == NULL || x->init[SS_FLAGS_FIELD] != key_id) {
        /* Another receiver's on a multicast group, one repeated, or a replay. */
        count(c->counters.handshake_unmatched_drops, 1);
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    noise_t s = x->noise; /* a forged answer leaves the exchange as it was */
    uint8_t payload[PAYLOAD_LENGTH], shared[DH_LENGTH], k1[SECRET_LENGTH];
    const uint8_t *responder = data + SS_HANDSHAKE_ANSWER_EPHEMERAL_FIELD;
    int ok = mix_ephemeral(&s, responder) && x25519(x->ephemeral, responder, shared) &&
             mix_key(&s, shared, DH_LENGTH) &&
             decrypt_and_hash(&s, responder + DH_LENGTH, PAYLOAD_LENGTH, payload) &&
             split(&s, k1);
    OPENSSL_cleanse(&s, sizeof s);
    OPENSSL_cleanse(shared, sizeof shared);
    if (!ok) {
        OPENSSL_cleanse(k1, sizeof k1);
        count(c->counters.handshake_failed_drops, 1);
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    learn_senders(c, payload);
    /* The first transport message: our sender ids, under the initiator's key of Split()
     * (nonce 0, no associated data: the clear header is bound by the handshake's hash). */
    uint8_t confirm[SS_HANDSHAKE_CONFIRM_LENGTH];
    handshake_header(confirm, SS_HANDSHAKE_CONFIRM_LENGTH, SS_EXT_TYPE_HANDSHAKE_CONFIRM,
                     key_id, exchange_id);
    own_senders(c, payload);
    ok = noise_aead(k1, 0, NULL, 0, payload, PAYLOAD_LENGTH,
                    confirm + SS_HANDSHAKE_CONFIRM_PAYLOAD_FIELD, 1);
    OPENSSL_cleanse(k1, sizeof k1);
    OPENSSL_cleanse(payload, sizeof payload);
    if (ok) post(c, confirm, SS_HANDSHAKE_CONFIRM_LENGTH, x->address, x->address_length);
    /* Done: the ephemeral key and the state erased; the slot remembers its source for
     * EXCHANGE_MIN_MS. */
    const uint64_t started = x->started_ms;
    uint8_t address[SS_SOCKADDR_MAX];
    const int32_t address_length = x->address_length;
    memcpy(address, x->address, (size_t)address_length);
    forget_exchange(x);
    x->state = EXCHANGE_DONE;
    x->started_ms = started;
    memcpy(x->address, address, (size_t)address_length);
    x->address_length = address_length;
    return SS_OPEN_HANDSHAKE;
}

/* A CONFIRM of an exchange we answered: the initiator's sender ids. */
static int32_t take_confirm(ss_crypto_t *c, const uint8_t *data, uint8_t key_id) {
    const uint64_t exchange_id = load_u64(data + SS_HANDSHAKE_EXCHANGE_ID_FIELD);
    answer_t *a = NULL;
    for (int32_t i = 0; i < ANSWERS_MAX && a == NULL; i++)
        if (c->answers[i].used && !c->answers[i].confirmed &&
            c->answers[i].exchange_id == exchange_id)
            a = &c->answers[i];
    if (a == NULL || a->answer[SS_FLAGS_FIELD] != key_id) {
        count(c->counters.handshake_unmatched_drops, 1);
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    uint8_t payload[PAYLOAD_LENGTH];
    if (!noise_aead(a->confirm_key, 0, NULL, 0, data + SS_HANDSHAKE_CONFIRM_PAYLOAD_FIELD,
                    PAYLOAD_LENGTH, payload, 0)) {
        OPENSSL_cleanse(payload, sizeof payload);
        count(c->counters.handshake_failed_drops, 1);
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    learn_senders(c, payload);
    OPENSSL_cleanse(payload, sizeof payload);
    /* Confirmed: its key erased; the answer stays for a repeated INIT until it expires. */
    OPENSSL_cleanse(a->confirm_key, sizeof a->confirm_key);
    a->confirmed = 1;
    return SS_OPEN_HANDSHAKE;
}

static int32_t take_handshake(ss_crypto_t *c, const uint8_t *data, int32_t length,
                              uint16_t ext_type, const uint8_t *source, int32_t source_length,
                              uint64_t ms) {
    const int32_t expected = ext_type == SS_EXT_TYPE_HANDSHAKE_INIT ? SS_HANDSHAKE_INIT_LENGTH
                             : ext_type == SS_EXT_TYPE_HANDSHAKE_ANSWER
                                 ? SS_HANDSHAKE_ANSWER_LENGTH
                                 : SS_HANDSHAKE_CONFIRM_LENGTH;
    int32_t frame_length = 0;
    uint16_t ext_version = 0;
    if (length == expected) {
        memcpy(&frame_length, data, 4);
        memcpy(&ext_version, data + SS_EXT_VERSION_FIELD, 2);
    }
    if (length != expected || frame_length != length ||
        data[SS_VERSION_FIELD] != SS_CURRENT_VERSION || ext_version != SS_EXT_VERSION) {
        count(c->counters.handshake_failed_drops, 1);
        return SS_OPEN_HANDSHAKE_REFUSED;
    }
    const key_slot_t *key = key_of(c, data[SS_FLAGS_FIELD]);
    if (key == NULL) {
        count(c->counters.unknown_key_drops, 1);
        return SS_OPEN_UNKNOWN_KEY;
    }
    if (ext_type == SS_EXT_TYPE_HANDSHAKE_INIT)
        return answer_init(c, data, key, source, source_length, ms);
    if (ext_type == SS_EXT_TYPE_HANDSHAKE_ANSWER) return take_answer(c, data, key->id);
    return take_confirm(c, data, key->id);
}
