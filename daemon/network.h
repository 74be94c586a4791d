/*
 * slipstream's network data path: the per-datagram work of the sender and receiver agents
 * (docs/ARCHITECTURE.md, Threads), the interface of its C files (network.c has their map).
 * Python runs the protocol per batch; the C half sends committed frames straight from a
 * publication's log (sendmmsg, iovecs into the map) and receives datagrams (recvmmsg),
 * validates every frame of every datagram and inserts DATA into the image's log, and answers
 * NAKs at a send endpoint (retransmissions queued for the data path).  The rest (SETUP, SM,
 * RTTM, ERR, a new session's data, and NAKs that need a timer or are malformed) goes up to
 * Python.
 *
 * Every length and offset from the network is checked with 64-bit arithmetic before it
 * indexes memory.  Counters are int64 cells in the counters file; the driver's own positions
 * are private cells that it copies there (ss_publish_position), and a position a client writes
 * (a subscriber's) is bounded before use (ss_subscriber_position_bounded).
 */
#include <stdint.h>

#define SS_SEND_BATCH_MAX 256
/* UDP GSO (UDP_SEGMENT): the kernel takes at most 64 segments (UDP_MAX_SEGMENTS in older
 * kernels) and one UDP payload per send; 65000 leaves room for the IPv4/IPv6 headers. */
#define SS_GSO_MAX_SEGMENTS 64
#define SS_GSO_MAX_BYTES 65000
/* Retransmissions a publication queues for its next ss_send_data. */
#define SS_RETRANSMIT_MAX 256
#define SS_SOCKADDR_MAX 128
#define SS_SIGNAL_PENDING_MAX 64
/* A multi-destination subscription's receive destinations at most (each image keeps one
 * connection slot per destination: ss_image_connection_t). */
#define SS_RECEIVE_DESTINATIONS_MAX 16

/* ------------------------------------------------------------------ sealed datagrams */
/* An encrypted channel's endpoints seal every datagram they send and open every one they
 * receive (network_crypto.c; docs/CHANNELS.md §7.8): the layout, as
 * slipstream.client.layout's SEALED_* and EXT_*. */
#define SS_HDR_TYPE_EXT 0xFFFF
#define SS_EXT_MAGIC 0x534C5053
#define SS_EXT_VERSION 1
#define SS_EXT_MAGIC_FIELD 8
#define SS_EXT_TYPE_FIELD 12
#define SS_EXT_VERSION_FIELD 14
#define SS_EXT_TYPE_SEALED 3
#define SS_SEALED_HEADER_LENGTH 32
#define SS_SEALED_SENDER_ID_FIELD 16
#define SS_SEALED_COUNTER_FIELD 24
#define SS_SEALED_TAG_LENGTH 16
#define SS_SEALED_OVERHEAD 48
#define SS_SEALED_EPOCH_BITS 23
#define SS_SEALED_FRAME_MAX 65584
/* The handshake (docs/CHANNELS.md §7.8, Noise_NNpsk0_25519_AESGCM_SHA256 with the channel's
 * key as the pre-shared key): its three datagrams, as slipstream.client.layout's
 * HANDSHAKE_*. */
#define SS_EXT_TYPE_HANDSHAKE_INIT 4
#define SS_EXT_TYPE_HANDSHAKE_ANSWER 5
#define SS_EXT_TYPE_HANDSHAKE_CONFIRM 6
#define SS_HANDSHAKE_EXCHANGE_ID_FIELD 16
#define SS_HANDSHAKE_ASKED_FIELD 24
#define SS_HANDSHAKE_INIT_EPHEMERAL_FIELD 32
#define SS_HANDSHAKE_INIT_TIMESTAMP_FIELD 64
#define SS_HANDSHAKE_ANSWER_EPHEMERAL_FIELD 24
#define SS_HANDSHAKE_CONFIRM_PAYLOAD_FIELD 24
#define SS_HANDSHAKE_INIT_LENGTH 88
#define SS_HANDSHAKE_ANSWER_LENGTH 168
#define SS_HANDSHAKE_CONFIRM_LENGTH 136
/* ss_crypto_open's verdicts (each counted by its cause). */
#define SS_OPEN_PLAIN (-1)
#define SS_OPEN_UNKNOWN_KEY (-2)
#define SS_OPEN_FAILED (-3)
#define SS_OPEN_REPLAY (-4)
#define SS_OPEN_SENDERS_FULL (-5)
#define SS_OPEN_AWAITING_HANDSHAKE (-6) /* no session with its sender yet, or sent before it */
#define SS_OPEN_HANDSHAKE (-7)          /* a handshake datagram, taken (not a drop) */
#define SS_OPEN_HANDSHAKE_REFUSED (-8)  /* a handshake datagram refused (counted by cause) */
/* A key's bytes, and the keys an endpoint holds at once (the one that seals, one more that
 * opens: rotation). */
#define SS_CRYPTO_KEY_LENGTH 32
#define SS_CRYPTO_KEYS_MAX 2
/* Sender ids (docs/CHANNELS.md §7.8): a sealing endpoint draws a new one this often; an
 * opening endpoint refuses one drawn longer ago than SS_CRYPTO_SENDER_ID_MAX_AGE_S, or more
 * than SS_CRYPTO_CLOCK_SKEW_S ahead of its clock (hosts' clocks must agree within that). */
#define SS_CRYPTO_SENDER_ID_LIFETIME_S 60
#define SS_CRYPTO_CLOCK_SKEW_S 60
#define SS_CRYPTO_SENDER_ID_MAX_AGE_S 120 /* the lifetime and the skew */

/* An endpoint's keys, its sealing state and what it knows of each sender it opened
 * (opaque: made and freed here). */
typedef struct ss_crypto ss_crypto_t;
/* The system counters an endpoint's opening counts drops in (NULL: not counted). */
typedef struct {
    int64_t *plain_drops;         /* datagrams without a seal (a plain peer) */
    int64_t *unknown_key_drops;   /* sealed under a key id the endpoint does not hold */
    int64_t *auth_drops;          /* failed to open: tampered, truncated, another key */
    int64_t *replay_drops;        /* a counter the sender's window has seen, or below it, or
                                   * a sender id past its lifetime */
    int64_t *senders_full_drops;  /* a new sender while every slot holds a fresh one */
    int64_t *seal_failures;       /* datagrams not sent: not sealed (too long, libcrypto); and
                                   * seals whose new sender id, due, was not drawn */
    int64_t *awaiting_handshake_drops; /* sealed by a sender with no session here yet, or
                                        * below the counter its session began at */
    int64_t *handshake_failed_drops;   /* handshake datagrams malformed or not authentic */
    int64_t *handshake_unmatched_drops; /* answers and confirmations of no exchange here;
                                         * INITs stale or answered before */
    int64_t *handshake_limited_drops;  /* INITs past the per-source rate or a full table;
                                        * exchanges evicting or past the rate to start */
    int64_t *handshakes;               /* exchanges completed, as initiator or responder */
} ss_crypto_counters_t;

/* A context with a random sender id and no keys (NULL: out of memory, or no randomness). */
ss_crypto_t *ss_crypto_new(void);
void ss_crypto_free(ss_crypto_t *c);
ss_crypto_counters_t *ss_crypto_counters(ss_crypto_t *c);
/* Once a second of the wall clock at most, from the thread that seals and opens through the
 * endpoint (one agent's duty cycle, which runs at least once a second: the driver's agents
 * never split an endpoint's sealing and opening between threads): forget what may no longer
 * be used, traffic or not (peers' secrets past their ids' age, exchanges and answers done
 * with), and move this endpoint to its next sender id once its own is past its lifetime
 * (its secret erased).  Forward secrecy holds on an idle endpoint too. */
void ss_crypto_tick(ss_crypto_t *c);
uint64_t ss_crypto_sender_id(const ss_crypto_t *c);
/* The next datagram's counter, forward only (a test's: counters never repeat under one
 * sender id): 0, or -1 for one below the next datagram's. */
int32_t ss_crypto_set_counter(ss_crypto_t *c, uint64_t counter);
/* This context's wall clock runs `seconds` ahead of the host's (a test's: a sender id seen
 * later, or drawn earlier, without waiting). */
void ss_crypto_set_clock_offset(ss_crypto_t *c, int64_t seconds);
/* The keys, from any thread (count 1 or 2; ids[i] and 32 bytes at keys + 32 i): the first
 * seals, both open; the data path takes them over at its next datagram.  0, or -1 for a
 * count outside 1-2 or two equal ids. */
int32_t ss_crypto_set_keys(ss_crypto_t *c, const uint8_t *ids, const uint8_t *keys,
                           int32_t count);
/* Seal `length` bytes into `out` (capacity bytes, length + SS_SEALED_OVERHEAD needed): the
 * sealed length, or -1 (no key, no room). */
int32_t ss_crypto_seal(ss_crypto_t *c, const uint8_t *plain, int32_t length, uint8_t *out,
                       int32_t capacity);
/* Open a datagram from `source` (a struct sockaddr of source_length bytes; NULL: none known,
 * no exchange is started) in place: its frames are then at data + SS_SEALED_HEADER_LENGTH and
 * the result is their length; or an SS_OPEN_* verdict (< 0), counted by its cause.  A
 * datagram opens at most once per sender and counter within the sender's window, and only
 * once the endpoint exchanged a handshake with its sender.  Handshake datagrams are taken
 * here (SS_OPEN_HANDSHAKE); what the endpoint sends in answer, or to start an exchange, waits
 * in its outbox (ss_crypto_take_handshake). */
int32_t ss_crypto_open(ss_crypto_t *c, uint8_t *data, int32_t length, const uint8_t *source,
                       int32_t source_length);
/* The next handshake datagram to send: its bytes into `out` (capacity at least
 * SS_HANDSHAKE_ANSWER_LENGTH) and where to (into address, SS_SOCKADDR_MAX bytes, its length
 * at *address_length).  Returns its length, or 0 when the outbox is empty. */
int32_t ss_crypto_take_handshake(ss_crypto_t *c, uint8_t *out, int32_t capacity,
                                 uint8_t *address, int32_t *address_length);
/* Where this endpoint's handshake datagrams go instead of their peer's source (a multicast
 * endpoint's group: its socket is bound to the group, so unicast never reaches a peer's);
 * length 0: to the source. */
void ss_crypto_set_handshake_address(ss_crypto_t *c, const uint8_t *address,
                                     int32_t address_length);

/* Store `value` in a position's private cell, then in its counter (NULL: none). */
void ss_publish_position(int64_t *cell, int64_t *counter, int64_t value);
/* A subscriber's position (a cell its client writes) as the driver takes it: within
 * [0, hwm], rounded down to the frame alignment. */
int64_t ss_subscriber_position_bounded(int64_t position, int64_t hwm);

/* The words among `count` that changed since the last look: each of `words[i]` is
 * acquire-loaded and compared with `last[i]`; a changed one's index goes to `changed` (room for
 * `count`) and its value to `last[i]`.  Returns how many changed.  The conductor's watch on the
 * words its per-publication pass reads (a log's tails, a subscriber's position), so that a
 * cycle passes over the publications that moved, not all of them. */
int32_t ss_words_changed(int64_t *const *words, int64_t *last, int32_t count,
                         int32_t *changed);

/* NAK: its type, length and field offsets, as slipstream.client.layout's
 * (SS_<NAME> is its NAME; tests/test_layout.py checks them).  The DATA/PAD header is native.h's. */
#define SS_HDR_TYPE_NAK 0x02
#define SS_NAK_LENGTH 28
#define SS_NAK_SESSION_ID_FIELD 8
#define SS_NAK_STREAM_ID_FIELD 12
#define SS_NAK_TERM_ID_FIELD 16
#define SS_NAK_TERM_OFFSET_FIELD 20
#define SS_NAK_LENGTH_FIELD 24

/* SM: its type, length and field offsets (the untagged frame). */
#define SS_HDR_TYPE_SM 0x03
#define SS_SM_LENGTH 36
#define SS_SM_SESSION_ID_FIELD 8
#define SS_SM_STREAM_ID_FIELD 12
#define SS_SM_CONSUMPTION_TERM_ID_FIELD 16
#define SS_SM_CONSUMPTION_TERM_OFFSET_FIELD 20
#define SS_SM_RECEIVER_WINDOW_FIELD 24
#define SS_SM_RECEIVER_ID_FIELD 28

/* A publication's heartbeat goes when nothing was sent for this long (Aeron's 100 ms). */
#define SS_HEARTBEAT_TIMEOUT_NS 100000000
/* How early a network thread's duty cycle may send a keepalive (a heartbeat, an SM's timer),
 * and how late its park may take a liveness check, so that the timers falling due within it
 * go in one wake-up: with thousands of idle streams, timers spread over the interval would
 * each cost a wake-up and a duty cycle over every stream.  A tenth of the heartbeat's
 * interval (the earliest of a batch wakes the thread at its time). */
#define SS_TIMER_SLACK_NS 10000000
/* In such a loop a keepalive is due at the last whole multiple of this (of half its interval
 * if that is less), on the monotonic clock, at or before its time: the first after other
 * traffic comes between half its interval and its interval after it, never later; and one
 * sent early, within the slack, times the next from the instant it was due at, not from its
 * send.  An idle stream's keepalives (a heartbeat's interval is 100 ms, an SM's 200 ms or
 * what the governor widens it to) then go every interval on multiples of 50 ms whatever the
 * phase the stream began in, each at most the slack early, and thousands of streams' timers
 * share at most 20 wake-ups a second instead of one per slack. */
#define SS_KEEPALIVE_GRAIN_NS 50000000
/* The most keepalives (heartbeats, and the SMs of an image's timer or changed window; not
 * those the subscribers' progress makes due) one duty cycle sends through one socket; the
 * rest go in the cycles after, which follow at once.  Streams sharing an endpoint share its
 * instants: 1,000 streams on one channel are 500 heartbeats at once, more than a receiver's
 * socket buffer holds (socket_so_rcvbuf's 128 KiB, doubled by the kernel: about 314
 * datagrams of 32-40 bytes), and the kernel dropped those past it, SETUPs' answers among
 * them.  A receiver's cycle reads 256 datagrams of a data socket and 128 of a control
 * socket; one that takes its cycles on another thread or host is not waited for. */
#define SS_KEEPALIVE_BURST_MAX 64

/* ss_receiver_on_datagram results */
#define SS_RX_CONSUMED 0
#define SS_RX_TO_PYTHON 1

/* Cleaning a log behind its consumers (daemon/protocol/log_cleaner.py has the contract, and
 * its LogCleaner is a handle on this struct): term n reuses the partition of term n - 3, so
 * the log is zeroed toward one term behind the slowest consumer, at most chunk_length bytes
 * per call.  The Python half and the C half of one agent's thread share a cleaner. */
typedef struct {
    int64_t position;             /* zeroed up to here (bytes from the start of term 0) */
    int64_t target;               /* where the last call was asked to reach */
    int64_t chunk_length;
} ss_log_cleaner_t;

/* Zero up to one chunk (never across a term's end) of `log` (start of term 0) toward one term
 * behind consumer_position.  Returns 1 when it zeroed something, else 0. */
int32_t ss_clean_toward(ss_log_cleaner_t *c, uint8_t *log, int32_t term_length,
                        int32_t position_bits, int64_t consumer_position);
/* The highest limit partition reuse allows writers: the cleaned position rounded up to a term
 * boundary plus two terms (a writer below it may claim to the end of its term and rotate). */
int64_t ss_reusable_limit(const ss_log_cleaner_t *c, int32_t term_length);
/* The slowest subscriber's position from which an image's cleaning is due again: half a term
 * (or a chunk, if less) more to clean, so that the reusable limit stays a window ahead. */
int64_t ss_clean_due_position(const ss_log_cleaner_t *c, int32_t term_length);

/* One datagram's worth of a publication's log: log_offset counts from the start of term 0.
 * `padding` is the part of a PAD frame that stays behind (only its header is sent), so the
 * sender position moves by length + padding. */
typedef struct {
    int64_t log_offset;
    int32_t length;
    int32_t padding;
} ss_span_t;

/* The sender's answer to NAKs (docs/DRIVER.md §3.5, aeron_retransmit_handler.c; the state
 * machine is drawn in daemon/protocol/retransmit.py).  Each NAK takes a retransmit action:
 * INACTIVE, DELAYED (sent when the delay expires) or LINGERING (NAKs inside its range are
 * repeats, ignored). */
#define SS_RETRANSMIT_ACTIONS_MAX 256
#define SS_ACTION_INACTIVE 0
#define SS_ACTION_DELAYED 1
#define SS_ACTION_LINGERING 2
#define SS_NO_DEADLINE 9223372036854775807 /* INT64_MAX, layout.NO_DEADLINE */

typedef struct {
    int64_t expiry_ns;
    int32_t state;
    int32_t term_id;
    int32_t term_offset;
    int32_t length;
} ss_retransmit_action_t;

/* The sender's deficit weighted round robin over the bands of the publications that share one
 * send socket (the bottleneck the bands divide), carried across cycles: the band being served,
 * whether it had its grant this visit, each band's deficit (datagrams) and where each band's
 * next turn starts among the agent's publications. */
typedef struct {
    int32_t band;
    int32_t granted;
    int64_t deficit[5];           /* SS_BANDS */
    int32_t next[5];
} ss_band_round_t;

/* A transport binding (Aeron's aeron_udp_channel_transport_bindings_t): the table of
 * functions below the channel endpoints' sends (network_endpoints.c) that makes the system
 * call.  ss_udp_binding() sends through the socket (sendmmsg); ss_virtual_binding() hands
 * each datagram, with its destination, to a virtual network, the simulator's (the callback
 * ss_virtual_datagram, which daemon/media/send_point.py defines).  Opaque to Python, which
 * only chooses one (NULL: the UDP one). */
typedef struct ss_transport_binding ss_transport_binding_t;
const ss_transport_binding_t *ss_udp_binding(void);
const ss_transport_binding_t *ss_virtual_binding(void);

/* A send endpoint's destinations (Aeron's destination tracker): every datagram its
 * publications send to the endpoint goes to each, in order.  A multi-destination-cast
 * endpoint's table (every publication of the endpoint points at the one table), or a
 * response publication's own (at most one destination, learned from its client's status
 * message).  Python owns it (daemon/media/destinations.py: which destinations exist) and
 * changes it only on the sender's thread, between duty cycles. */
typedef struct {
    int32_t length;               /* of the struct sockaddr in address */
    uint8_t address[128];         /* SS_SOCKADDR_MAX */
} ss_destination_t;

typedef struct {
    ss_destination_t *entries;
    int32_t count;
} ss_destination_list_t;

/* A network publication as the sender's data path sees it.  Python fills it when it makes the
 * publication, keeps resend_lookahead current (after each SM) and clears answers_naks when it
 * is done; the send endpoint's receive path and Python's control path both update the
 * retransmit actions, on the sender's thread. */
typedef struct {
    uint8_t *log;                 /* start of term 0 */
    /* The driver's own positions live in its private memory (Python allocates the cells) and
     * are copied to their counters in the counters file, which every client maps writable:
     * the driver never reads back a value a client could have written (ss_publish_position). */
    int64_t *sender_position;     /* snd-pos: advanced here (and by Python, on the sender's
                                   * thread, to its spies' under ssc=true with no receiver) */
    int64_t *sender_limit;        /* snd-lmt: set by flow control in Python (may go back) */
    int64_t *sender_position_counter; /* their counters (NULL: none, e.g. in a unit test) */
    int64_t *sender_limit_counter;
    int64_t *bytes_sent;          /* system counters */
    int64_t *short_sends;
    int64_t *send_errors;
    int64_t time_of_last_send_ns; /* when data last went out (the heartbeat timer; Python
                                   * backdates it a timeout at LINGER: the EOS goes at once) */
    int64_t heartbeat_slot_ns;    /* the instant the last heartbeat was due at: one a parking
                                   * loop sent early (within its slack) times the next from
                                   * it (SS_KEEPALIVE_GRAIN_NS); a data send
                                   * forgets it (0) */
    int32_t term_length;
    int32_t position_bits;
    int32_t mtu;
    int32_t fd;                   /* the send socket; -1: the simulator's (sent through
                                   * binding, else only filled into spans) */
    int32_t last_errno;           /* of the last failed send, for the driver's log */
    int32_t gso;                  /* 1: runs of equal datagrams go as one UDP GSO send; cleared
                                   * here when the path refuses it (see send_spans) */
    int32_t destination_length;   /* 0: the socket is connected */
    uint8_t destination[128];     /* SS_SOCKADDR_MAX (cffi wants a literal here) */
    const ss_destination_list_t *destinations; /* the endpoint's table (multi-destination-
                                   * cast) or its own (a response publication), which
                                   * replaces destination (NULL: neither) */
    uint32_t next_destination;    /* where the next send starts in it (round robin) */
    const ss_transport_binding_t *binding; /* below the send (NULL: ss_udp_binding) */
    void *binding_context;        /* the binding's (the virtual one's: its port) */
    int32_t retransmit_count;     /* spans of the log to send again (answers to NAKs), sent
                                   * ahead of new data by the next ss_send_data */
    ss_span_t retransmits[256];   /* SS_RETRANSMIT_MAX */
    /* NAKs: the control path answers them here (ss_retransmit_on_nak), from the socket's
     * receive path or from Python's, with the same rules. */
    int32_t session_id;
    int32_t stream_id;
    int32_t initial_term_id;
    int32_t max_message_length;   /* the resend window: [snd-pos - term/2 - this, snd-pos) */
    int32_t answers_naks;         /* 0 once the publication is done (its log goes soon) */
    int32_t has_group_semantics;  /* a pool of action_count actions; else one, reused */
    int32_t action_count;
    int32_t active_count;
    int64_t resend_lookahead;     /* flow control's cap on one NAK's resend, bytes: the
                                   * receiver window x a multiple (Python keeps it current) */
    int64_t retransmit_delay_ns;
    int64_t retransmit_linger_ns;
    int64_t *naks_received;       /* system counters */
    int64_t *retransmits_sent;
    int64_t *retransmit_overflow;
    int64_t *invalid_packets;
    ss_retransmit_action_t actions[256]; /* SS_RETRANSMIT_ACTIONS_MAX */
    /* The duty cycle (ss_agent_t): what makes this publication's Python half due. */
    uint8_t *meta;                /* the log's metadata page (the driver-waiters word) */
    int32_t sent_since_python;    /* set by ss_send_data when it sent; Python clears it */
    int32_t notice;               /* a send failed or the path refused GSO: Python logs it */
    int64_t python_send_position; /* once data was sent and snd-pos reached this, Python is
                                   * due (pub-lmt's next step; 0: after every send) */
    /* The send-rate limit (rc=nak-strength; daemon/flow/rate_control.py sets it per signal):
     * a token bucket that every datagram sent (retransmissions too) draws on and that fills
     * at rate_limit bytes/s up to rate_burst bytes.  New data waits until it holds half a
     * burst (a batch per wake-up); retransmissions go anyway (a gap pins the receiver) and
     * leave it in debt, at most a burst deep. */
    int64_t rate_limit;           /* bytes/s; 0: no limit */
    int64_t rate_burst;           /* bytes */
    int64_t rate_credit;          /* bytes that may go now (negative: in debt) */
    int64_t rate_time_ns;         /* when rate_credit was last filled */
    /* Its place in the sender's deficit weighted round robin (ss_agent_do_work): priority=
     * of its URI, and since when it has had data ready without being served (aging). */
    int32_t priority;             /* SS_PRIORITY_MIN..SS_PRIORITY_MAX */
    int32_t socket_full;          /* out: the last ss_send_data found the socket full */
    int64_t waiting_since_ns;     /* 0: served (or nothing to send) in the last cycle */
    /* The round of its socket's publications, kept in the first of them in the agent's array
     * (this one's is used while it is that first one). */
    ss_band_round_t round;
    /* The pressure governor (daemon/pressure/governor.py): new data short of a datagram waits
     * this long after the last send for more to fill it (0: it goes at once). */
    int64_t coalesce_ns;
    /* fd < 0 (the simulator's socket): how many more datagrams it takes, as a socket whose
     * send buffer fills takes what fits (-1: any number). */
    int32_t virtual_room;
    /* Status messages read here (the send endpoint's control path), not by Python, while
     * Python sets sm_in_c: unicast flow control with the one receiver it knows
     * (sm_receiver_id), connected and active.  An untagged SM from that receiver with no
     * flags, at a position already sent, raises snd-lmt to position + window (the window
     * held to half a term); anything else goes up to Python.  Python takes the out fields
     * at its next pass (the receiver's liveness, what it acknowledged), and is due when that
     * receiver sent none for connection_timeout_ns (sm_time_ns, which Python also moves to
     * the last SM it took itself). */
    int32_t sm_in_c;
    int32_t sm_window;            /* out: the window of the last SM taken here */
    int64_t sm_receiver_id;
    int64_t sm_time_ns;           /* when the last SM was taken here (out), or Python took
                                   * one of that receiver's (in, the liveness rule) */
    int64_t sm_position;          /* out: its consumption position */
    int64_t sm_count;             /* out: SMs taken here (Python zeroes it with the receiver) */
    int64_t *status_messages_received; /* system counter */
    int64_t connection_timeout_ns;
    /* Heartbeats, sent by the C half alone (through the endpoint's send, a socket's or the
     * simulator's) while Python sets heartbeat_in_c (connected once, not DONE): a DATA
     * header with frame length 0 at snd-pos, flags BEGIN|END (and EOS, unless the channel
     * says eos=false, once Python sets end_of_stream: a closed publication that sent all),
     * once nothing went out for SS_HEARTBEAT_TIMEOUT_NS (time_of_last_send_ns), and the
     * first EOS-flagged one at once (Python backdates that timer as it sets end_of_stream). */
    int32_t heartbeat_in_c;
    int32_t end_of_stream;
    int32_t signal_eos;
    int64_t eos_heartbeats_sent;  /* out: those sent since end_of_stream (a failed send not) */
    int64_t *heartbeats_sent;     /* system counter */
    /* pub-lmt, moved by the C half while Python sets limit_in_c (active, connected, taking
     * offers, no credit stop): once snd-pos reached pub-lmt's next step (last_publisher_limit
     * + trip_gain - term_window_length; trip_gain is Aeron's window / 8), or while cleaning
     * is behind, the log is cleaned a
     * chunk toward one term behind snd-pos and pub-lmt goes to min(snd-pos + term_window,
     * what cleaning allows): ss_publication_limit_step, which the Python half runs
     * otherwise. */
    int32_t limit_in_c;
    int64_t *publisher_limit;     /* the pub-lmt cell */
    int64_t last_publisher_limit;
    int64_t term_window_length;
    int64_t trip_gain;
    ss_log_cleaner_t *cleaner;
    /* Spies (aeron-spy: subscriptions of this host that read the log in place, as Aeron's
     * NetworkPublication spyPositions): their sub-pos cells, which their clients write, hold
     * pub-lmt and cleaning back as snd-pos does (ss_publication_consumer_position).  Python
     * keeps the array (on the sender's thread).  spy_hold: a cell the conductor lowers to a
     * spy's join position while it links one, so that the log is not cleaned under it before
     * the spy's cell is in the array (INT64_MAX: no link pending; NULL: none).  Once every spy
     * reached spy_python_position (SS_NO_DEADLINE: never), the Python half is due (a closed
     * publication waits for its spies to read it all); while the sender parks, the log's
     * driver wake position asks the spies to ring its doorbell there, or at pub-lmt's next
     * step. */
    int32_t spy_count;
    int64_t **spy_positions;
    int64_t *spy_hold;
    int64_t spy_python_position;
    /* An encrypted channel's endpoint: every datagram sealed (NULL: plain, one branch). */
    ss_crypto_t *crypto;
    /* Control only from the receivers' addresses (docs/DRIVER.md §5.7): the addresses the
     * live receivers' status messages are bound to, which Python keeps (on the sender's
     * thread) as its receivers come and go.  A NAK from another address is dropped here and
     * counted (nak_unknown_source_drops); SS_CONTROL_SOURCES_UNKNOWN: more receivers than
     * fit, every NAK goes up to Python, which checks it.  An SM taken here (sm_in_c) must
     * come from sm_source, the address sm_receiver_id is bound to; one from elsewhere goes
     * up to Python, which drops and counts it. */
    int32_t control_source_count;
    int32_t control_source_lengths[32];    /* SS_CONTROL_SOURCES_MAX */
    uint8_t control_sources[32][32];       /* SS_CONTROL_SOURCES_MAX x SS_CONTROL_SOURCE_LENGTH */
    int32_t sm_source_length;
    uint8_t sm_source[32];                 /* SS_CONTROL_SOURCE_LENGTH */
    int64_t *nak_unknown_source_drops;     /* system counter */
    /* The retransmit budget (docs/DRIVER.md §5.7): credit in bytes that the resends of NAKs
     * draw on.  It grows by retransmit_budget_percent % of each byte of new data sent (snd-pos
     * since retransmit_credit_position) and by retransmit_budget_cap bytes per
     * retransmit_budget_interval_ns of time, up to retransmit_budget_cap bytes; a NAK that
     * finds none left is dropped and counted (nak_budget_drops).  retransmit_budget_cap 0:
     * no budget (Aeron's behaviour). */
    int64_t retransmit_budget_cap;
    int64_t retransmit_budget_percent;
    int64_t retransmit_budget_interval_ns;
    int64_t retransmit_credit;
    int64_t retransmit_credit_position;
    int64_t retransmit_credit_time_ns;
    int64_t *nak_budget_drops;             /* system counter */
} ss_send_publication_t;
#define SS_CONTROL_SOURCES_MAX 32
#define SS_CONTROL_SOURCE_LENGTH 32
#define SS_CONTROL_SOURCES_UNKNOWN -1

/* Whether `source` (a struct sockaddr of source_length bytes) may send p control frames that
 * name no receiver (NAKs): it is one of control_sources, or control_source_count is
 * SS_CONTROL_SOURCES_UNKNOWN (1: Python decides).  A NULL source is never one. */
int32_t ss_publication_control_source_known(const ss_send_publication_t *p, const uint8_t *source,
                                            int32_t source_length);
/* Fill p's retransmit credit to now_ns (see retransmit_budget_cap) and return it (bytes). */
int64_t ss_retransmit_credit(ss_send_publication_t *p, int64_t now_ns);

/* The position p's log is consumed to, which pub-lmt and cleaning follow: the least of snd-pos,
 * the spy hold and each spy's position (ss_subscriber_position_bounded by snd-pos).  Ordered
 * after the caller's last store to snd-pos (a full fence) against the conductor's lowering of
 * spy_hold: either the hold is seen here, or the conductor sees this snd-pos after it. */
int64_t ss_publication_consumer_position(const ss_send_publication_t *p);
/* pub-lmt's rule, one step of it: clean a chunk toward one term behind the consumer position
 * (ss_publication_consumer_position), then raise pub-lmt to min(that position + the term
 * window, what cleaning allows, limit_cap) once that is a step (trip_gain) above
 * last_publisher_limit.  limit_cap: SS_NO_DEADLINE for none, the drain's credit stop, or a
 * value below every position (offers refused: the cleaning alone).  The C half runs it while
 * limit_in_c, the Python half otherwise.  Returns the work done (chunks cleaned, a step). */
int32_t ss_publication_limit_step(ss_send_publication_t *p, int64_t limit_cap);
/* A status message's check, its one copy (the C half's control path takes an SM of its
 * receiver by it while sm_in_c, the Python half checks every other SM by it): the consumption
 * position (term_id, term_offset) an honest receiver could report, within the stream (not
 * before its initial term, an offset within a term) with a window >= 0, and never past snd-pos.
 * Returns the position, or SS_SM_INVALID or SS_SM_AHEAD_OF_SENDER; *window is held to half a
 * term (what a receiver may invite beyond that position). */
int64_t ss_publication_status_message(const ss_send_publication_t *p, int32_t term_id,
                                      int32_t term_offset, int32_t *window);
#define SS_SM_INVALID -1
#define SS_SM_AHEAD_OF_SENDER -2
/* The liveness timer of p's receivers, its one copy: the last time a receiver whose last
 * status message came at last_sm_ns is live (last_sm_ns + connection_timeout_ns; after it,
 * it is gone).  The C half makes the Python half due after it for the receiver whose SMs it
 * takes (sm_time_ns, while sm_in_c); the Python half times its receivers and the
 * connection by it otherwise. */
int64_t ss_publication_receiver_deadline(const ss_send_publication_t *p, int64_t last_sm_ns);
/* The heartbeat rule of p, its one copy (the duty cycle runs it for every publication, with
 * a socket or the simulator's virtual send): while heartbeat_in_c, once nothing went out for
 * SS_HEARTBEAT_TIMEOUT_NS, a heartbeat at snd-pos (EOS-flagged: see end_of_stream) through
 * the endpoint's send.  Returns 1 when one was sent. */
int32_t ss_publication_heartbeat(ss_send_publication_t *p, int64_t now_ns);
/* The slowest spy's position, each bounded by `bound` (ss_subscriber_position_bounded);
 * `bound` when there is none. */
int64_t ss_publication_slowest_spy(const ss_send_publication_t *p, int64_t bound);

/* Take every queued retransmission, then scan committed frames from snd-pos up to snd-lmt into
 * at most max_datagrams more spans of at most one MTU each (`spans` has room for
 * max_datagrams + SS_RETRANSMIT_MAX), send them (one sendmmsg when fd >= 0) and advance
 * snd-pos past the new data sent.  Retransmissions a full socket did not take stay queued;
 * after another error they are gone, as if lost on the way: the receiver asks again.
 * With gso set, a run of spans of one length that follow each other in the log (the last may
 * be shorter) is one message of that sendmmsg, which the kernel cuts into those datagrams:
 * the wire carries the same datagrams, for one pass through the stack instead of one each.
 * Returns the datagrams sent (retransmissions included); 0 when nothing was ready or the
 * socket was full (counted as a short send); -1 on another error (counted, errno in
 * last_errno; nothing advanced). */
int32_t ss_send_data(ss_send_publication_t *p, int64_t now_ns, int32_t max_datagrams,
                     ss_span_t *spans);

/* Whether ss_send_data would send now: retransmissions queued, or a committed frame at snd-pos
 * that fits in the window (a parking thread's last look).  The rate limit is not looked at:
 * see ss_rate_wait_ns. */
int32_t ss_has_data_ready(const ss_send_publication_t *p);
/* How long new data must wait for the rate limit at now_ns (0: it may go; fills the bucket). */
int64_t ss_rate_wait_ns(ss_send_publication_t *p, int64_t now_ns);
/* When new data may go by the bucket as last filled (INT64_MIN: now; the simulator's clock
 * jumps there). */
int64_t ss_rate_ready_ns(const ss_send_publication_t *p);
/* When the governor's coalescing lets the new data at snd-pos go: less than half a datagram
 * of it waits coalesce_ns after the last send for more (INT64_MIN: it does not hold it). */
int64_t ss_coalesce_ready_ns(const ss_send_publication_t *p);

/* Queue MTU-sized spans of `length` bytes at term_offset of term_id for the next ss_send_data,
 * if the range is still in the resend window (aeron_network_publication_resend).  Returns the
 * bytes of the range taken from term_offset: all of it when it is out of the window (nothing
 * to send), less when the queue filled (counted as RETRANSMIT_OVERFLOW). */
int32_t ss_resend(ss_send_publication_t *p, int32_t term_id, int32_t term_offset, int32_t length);
/* A NAK for `length` bytes at term_offset of term_id: expire finished actions, then resend at
 * once (delay 0) or after the delay, unless an action in flight covers it.  A NAK at a
 * misaligned or out-of-range offset, or of no length, is counted invalid and dropped. */
void ss_retransmit_on_nak(ss_send_publication_t *p, int32_t term_id, int32_t term_offset,
                          int32_t length, int64_t now_ns);
/* Fire DELAYED actions whose delay passed; free LINGERING ones whose linger passed. */
void ss_retransmit_process_timeouts(ss_send_publication_t *p, int64_t now_ns);
/* When an action next expires (SS_NO_DEADLINE: none active); delayed_only: only a DELAYED
 * one, whose expiry resends (a LINGERING one's only frees it, which the next NAK does). */
int64_t ss_retransmit_next_deadline(const ss_send_publication_t *p, int32_t delayed_only);

/* The gaps of an image's rebuild term and their NAK timers (daemon/protocol/loss_detector.py has the
 * rules; aeron_loss_detector.c tracks one gap, this up to SS_LOSS_GAPS_MAX in stream order). */
#define SS_LOSS_GAPS_MAX 256

typedef struct {
    int64_t expiry_ns;            /* when it is NAKed (again) */
    int64_t naked_ns;             /* when it was last NAKed */
    int32_t term_id;
    int32_t term_offset;
    int32_t length;
    int32_t naks;                 /* NAKs sent for it */
} ss_gap_t;

typedef struct {
    int32_t gap_count;
    int32_t due_count;            /* out of the last scan: gaps to NAK now (their timers are */
    int32_t due[256];             /* re-armed), as indices into gaps */
    int32_t fresh_count;          /* out of the last scan: gaps seen for the first time, and */
    int64_t fresh_bytes;          /* their bytes (the loss report) */
    /* The repair time (NAK to the scan that found the gap filled), smoothed as RFC 6298
     * smooths a round trip, from gaps NAKed once (Karn: a gap NAKed twice cannot tell which
     * NAK was answered).  With adapt_retry set, once a repair was measured, a gap is NAKed
     * again after srtt + 4 rttvar within [first delay, retry_delay_ns], doubled for each
     * further NAK of the same gap up to retry_delay_ns. */
    int32_t adapt_retry;
    int32_t repair_samples;
    int64_t repair_srtt_ns;
    int64_t repair_rttvar_ns;
    ss_gap_t gaps[256];           /* SS_LOSS_GAPS_MAX, in stream order */
} ss_loss_detector_t;

/* Scan term_id's term (`term`) for gaps from rebuild_offset up to limit_offset: a gap seen
 * for the first time gets expiry now + first_delay_ns (counted in fresh_*); one whose
 * expiry has come is listed in due and re-armed at now + its retry delay (retry_delay_ns,
 * or less once adapt_retry has a repair time); gaps no longer there (filled) are forgotten,
 * and their repair times measured.  Returns the offset of the first gap, or limit_offset
 * when there is none (all gaps then forgotten). */
int32_t ss_loss_scan(ss_loss_detector_t *d, const uint8_t *term, int32_t term_id,
                     int32_t rebuild_offset, int32_t limit_offset, int64_t now_ns,
                     int64_t first_delay_ns, int64_t retry_delay_ns);
/* Every tracked gap was filled (the rebuild position reached the high-water mark): measure
 * their repairs and forget them. */
void ss_loss_all_filled(ss_loss_detector_t *d, int64_t now_ns);
/* The retry delay a gap NAKed now gets: retry_delay_ns unless adapt_retry has a repair time,
 * then srtt + 4 rttvar within [first_delay_ns, retry_delay_ns]. */
int64_t ss_loss_retry_delay(const ss_loss_detector_t *d, int64_t first_delay_ns,
                            int64_t retry_delay_ns);
/* The earliest expiry of a tracked gap (SS_NO_DEADLINE: none). */
int64_t ss_loss_next_deadline(const ss_loss_detector_t *d);
/* Record `count` gaps of `length` bytes in all in a loss report entry (its layout is
 * daemon/reports/loss_report.py's: observations, bytes lost, first and last observation in
 * epoch ns), with atomic adds: `stat` reads the mapped file while the driver writes it. */
void ss_loss_record(uint8_t *entry, int64_t length, int64_t count);

/* Counters a receive endpoint's data path counts into (cells of the counters file). */
typedef struct {
    int64_t *bytes_received;
    int64_t *invalid_packets;
    int64_t *heartbeats_received;
    int64_t *flow_control_over_runs;
    int64_t *flow_control_under_runs;
    int64_t *foreign_source_drops;
    int64_t *receive_errors;
    int64_t *debug_data_loss_drops;
    /* The NAKs and status messages the C half sends (ss_image_rebuild, the 25 % rule) through
     * the endpoint's socket. */
    int64_t *nak_messages_sent;
    int64_t *status_messages_sent;
    int64_t *bytes_sent;
    int64_t *short_sends;
} ss_receiver_counters_t;

/* One path of a multi-destination subscription's image (Aeron's ImageConnection): the
 * destination (receive socket) its data arrived on, where its control frames go (the data's
 * source, or a multicast destination's control group) and when data last came that way.
 * The data path fills it (ss_receiver_t.destination); Python seeds it from the SETUP and
 * clears it when its destination is removed (fd -1). */
typedef struct {
    int64_t time_of_last_frame_ns;
    int32_t fd;                   /* the destination's socket (-1: none, not sent to) */
    int32_t address_length;       /* of the struct sockaddr in address (0: none) */
    uint8_t address[128];         /* SS_SOCKADDR_MAX */
} ss_image_connection_t;

/* An image as the receiver's data path sees it.  Python owns it and sets the SM fields after
 * each status message it sends (as the C half does after its own), and reads the rest on its
 * rebuild pass. */
typedef struct {
    uint8_t *log;                 /* start of term 0 */
    uint8_t *meta;                /* the log's metadata page (reader eventcount) */
    int64_t *receiver_hwm;        /* rcv-hwm: raised here only (private, as snd-pos is) */
    int64_t *receiver_hwm_counter; /* its counter, and rcv-pos's (NULL: none) */
    int64_t *receiver_position_counter;
    int64_t last_sm_position;     /* position of the last SM sent (under-run check) */
    int64_t overrun_threshold;    /* last_sm_position + term_length / 2 (over-run check) */
    int64_t time_of_last_packet_ns;
    int64_t liveness_timeout_ns;  /* while the C half sends the SMs, Python is due when no
                                   * packet came for this long (else it keeps the timer) */
    int64_t eos_position;         /* -1 until a heartbeat with EOS arrives */
    int64_t contiguous_position;  /* the end of what arrived in order: a datagram landing here
                                   * moves it on; the rebuild pass scans from here, never what
                                   * arrived in order, and sets it to rcv-pos when ahead */
    int32_t term_length;
    int32_t position_bits;
    int32_t initial_term_id;
    int32_t session_id;
    int32_t stream_id;
    int32_t dirty;                /* data or a new hwm arrived since Python's last rebuild */
    int32_t signal_pending;       /* data inserted, its readers not signalled yet */
    int32_t source_length;        /* > 0: frames from another address are dropped */
    uint8_t source[128];          /* SS_SOCKADDR_MAX */
    /* The duty cycle (ss_agent_t): rcv-pos follows what arrived in order here; Python is due
     * when data needs its rebuild pass (a gap, EOS, python_on_data) or the slowest subscriber
     * reached sm_due_position (the 25 % rule). */
    int64_t *receiver_position;   /* rcv-pos (private, as snd-pos is) */
    int64_t **subscriber_positions;
    int32_t subscriber_count;
    int32_t python_on_data;       /* every arrival needs Python (congestion control, or no
                                   * subscriber: SMs then follow rcv-pos) */
    int64_t sm_due_position;
    int64_t rate_signal_position; /* ss_image_rate_signal_top from which the image crosses
                                   * its next NAK-strength threshold: Python is due to signal
                                   * (SS_NO_DEADLINE: none) */
    int64_t overrun_position;     /* the end of the furthest frame dropped as an over-run: where
                                   * the sender is, for a receiver left behind (Python's rule);
                                   * raised only by an over-run within a term of the one before
                                   * (overrun_candidate), as a sender's next datagrams land: one
                                   * stray or forged datagram does not move it (two forged ones
                                   * close together do) */
    int64_t overrun_candidate;    /* the end of the last over-run frame (-1: none yet) */
    /* The rebuild pass in C (ss_image_rebuild), when Python sets rebuild_in_c (a reliable
     * unicast image with static congestion control, subscribers and no EOS yet): the C half
     * runs it on data past a gap and when a gap's timer is due, without the Python half. */
    int32_t rebuild_in_c;
    ss_loss_detector_t *loss;     /* the image's detector (Python's LossDetector.c) */
    int64_t nak_first_delay_ns;   /* the delays drawn ahead (LossDetector): the static
                                   * generator's, or the Python half's draw for its pass */
    int64_t nak_retry_delay_ns;
    int64_t loss_deadline_ns;     /* out: the earliest gap timer after the last C pass */
    uint8_t *loss_entry;          /* the image's loss report entry (NULL: none): C passes
                                   * record the gaps they see first there (ss_loss_record) */
    /* Where NAKs go (struct sockaddr), through the receive endpoint's socket (control_fd, -1:
     * the simulator's) and counters; ss_receiver_set_images sets those two.  A
     * multi-destination subscription's image (connections != NULL, connection_count slots,
     * one per destination index) sends them instead to every connection with a socket whose
     * data came within liveness_timeout_ns (network_endpoints.c), and takes data from any
     * source (source_length 0). */
    ss_image_connection_t *connections;
    int32_t connection_count;
    uint8_t control_address[128]; /* SS_SOCKADDR_MAX */
    int32_t control_address_length;
    int32_t control_fd;
    ss_receiver_counters_t *counters;
    /* NAKs queued and not sent: the simulator's (no socket), or a send that failed with an
     * error Python logs.  (term_id, term_offset, length) each; the Python half sends them. */
    int32_t nak_count;
    int32_t naks[768];            /* 3 x SS_LOSS_GAPS_MAX */
    /* Status messages.  sm_position and sm_window are the last scheduled (Python's rules read
     * and write them too).  While Python sets sm_in_c (as rebuild_in_c, and ACTIVE: no EOS
     * flag), the C half sends the 25 % rule's SM itself: at the slowest subscriber's position,
     * the window held to what cleaning allows (min(window, reusable_limit - position)), and
     * the timer's SM at sm_deadline_ns (both halves keep it: sm_interval_ns after any SM);
     * sm_unsent says one still has to go (no socket, or a send error: the Python half sends
     * it from these fields).  Cleaning (below) moves reusable_limit. */
    int32_t sm_in_c;
    int32_t sm_window;
    int32_t window;               /* the window the image advertises (static) */
    int32_t sm_unsent;
    int32_t has_group_tag;
    int64_t group_tag;
    int64_t receiver_id;
    int64_t sm_position;
    int64_t sm_deadline_ns;
    int64_t sm_interval_ns;       /* status_message_timeout x the governor's factor, at most
                                   * widest_status_interval_ns (daemon/pressure/governor.py) */
    /* The catch-up rule (ss_image_catch_up_due): an image with a group tag sends an SM as
     * soon as its slowest subscriber has consumed everything it received (rcv-hwm, past the
     * last scheduled SM), but not before sm_catch_up_ns, which every SM sent moves to
     * sm_catch_up_interval_ns after it (status_message_catch_up_interval x the governor's
     * factor). */
    int64_t sm_catch_up_ns;
    int64_t sm_catch_up_interval_ns;
    int64_t reusable_limit;
    int64_t clean_due_position;   /* SS_NO_DEADLINE: none */
    /* The image's cleaner (Python's LogCleaner.c): while the C half sends the SMs, it also
     * cleans, a chunk each time the slowest subscriber reaches clean_due_position, and moves
     * reusable_limit and clean_due_position on (an SM goes at once when that widened the
     * window it advertised); otherwise the Python half cleans from that position. */
    ss_log_cleaner_t *cleaner;
    /* Its receive endpoint's (ss_receiver_set_images copies it): control frames sealed. */
    ss_crypto_t *crypto;
} ss_image_t;

/* The rebuild pass (docs/DRIVER.md §4.4, aeron_publication_image_track_rebuild): scan from
 * max(rcv-pos, the furthest subscriber) to rcv-hwm, move rcv-pos over every complete frame,
 * keep the gaps' timers (nak_first_delay_ns, nak_retry_delay_ns), record the gaps seen first
 * in loss_entry, and queue a NAK for each gap whose timer is due (naks, up to
 * SS_LOSS_GAPS_MAX in all); the detector's fresh_count and due_count say what the pass saw.
 * Clears `dirty`.  Returns the NAKs queued.  The one copy of the rule: the Python half runs
 * it for the images it rebuilds (and sends, or for reliable=false pads, what it queued). */
int32_t ss_image_track_rebuild(ss_image_t *image, int64_t now_ns);
/* ss_image_track_rebuild, then the queued NAKs sent through control_fd when there is one: the
 * pass of an image with rebuild_in_c, from the C half or the Python half alike. */
int32_t ss_image_rebuild(ss_image_t *image, int64_t now_ns);

/* The status-message rules, their one copy (the C half runs them while sm_in_c, the Python
 * half each pass): the position of the SM due now given the slowest subscriber's position
 * `slowest`, or -1 for none.  At `slowest` by the 25 % rule (past sm_position + a quarter of
 * sm_window) or the catch-up rule (a tagged image); at max(slowest, sm_position) by the timer
 * (sm_deadline_ns) or a window that changed (ss_image_allowed_window at sm_position is no
 * longer sm_window). */
int64_t ss_image_status_message_due(const ss_image_t *image, int64_t slowest, int64_t now_ns);
/* An SM at `position` goes now: sm_position, sm_window (ss_image_allowed_window there), the
 * timer's and the catch-up rule's next times, last_sm_position, the over-run threshold (half
 * a term past it, never past reusable_limit) and sm_due_position follow. */
void ss_image_status_message_taken(ss_image_t *image, int64_t position, int64_t now_ns);
/* The window the image may advertise at `position` (bytes): `window`, never inviting data
 * into a partition that cleaning has not reached (reusable_limit). */
int64_t ss_image_allowed_window(const ss_image_t *image, int64_t position);

/* The image's liveness timer, its one copy: when no packet for liveness_timeout_ns ends an
 * INIT or ACTIVE image (ns).  The C half makes the Python half due then (while it keeps the
 * timer, with its status messages); the Python half moves the state at it. */
int64_t ss_image_liveness_deadline(const ss_image_t *image);

/* Cleaning behind the slowest subscriber (at `slowest`), its one copy: a chunk toward one
 * term behind it (ss_clean_toward), then reusable_limit and clean_due_position that follow.
 * The C half runs it with its status messages (from clean_due_position), the Python half
 * otherwise (each pass).  Returns what ss_clean_toward returned. */
int32_t ss_image_clean(ss_image_t *image, int64_t slowest);

/* NAK-strength (daemon/flow/rate_control.py): data above the image's first gap counts in its
 * fill only once that gap's timer fired this many times (NAKed, and NAKed again after each of
 * two repairs that did not come): a repair that comes in time is a one-off loss, not a
 * receiver that cannot keep up, and slowing the sender would not have prevented it. */
#define SS_RATE_SIGNAL_GAP_NAKS 3
/* The top of the fill NAK-strength counts: rcv-hwm, or while the first gap is younger than
 * SS_RATE_SIGNAL_GAP_NAKS NAKs, what arrived in order below it (bytes). */
int64_t ss_image_rate_signal_top(const ss_image_t *image);

/* Who runs an image's rules (docs/ARCHITECTURE.md, "Who runs each rule"): Python's flags
 * (rebuild_in_c, sm_in_c, python_on_data) say what the C half may take, and these add what
 * only the C half sees (a loss detector, subscribers, an EOS heartbeat).  They are the rules
 * the duty cycle runs by; the Python half asks them (daemon/streams/image.py), never copies
 * them.  1 when the C half runs the image's rebuild pass (NAK timers, NAKs): */
int32_t ss_image_rebuilt_in_c(const ss_image_t *image);
/* 1 when the C half sends its status messages (the 25 % rule's and the timer's), cleans its
 * log (with a cleaner) and keeps its liveness timer: */
int32_t ss_image_sends_status_messages(const ss_image_t *image);
/* The slowest subscriber's position from which its Python half is due: the 25 % rule's
 * (sm_due_position), or cleaning's (clean_due_position) when the C half does not clean. */
int64_t ss_image_python_due_position(const ss_image_t *image);
/* 1 when the catch-up rule's status message is due at now_ns: the image has a group tag
 * (its receivers are the ones that make messages durable, docs/CHANNELS.md §7.7), its
 * slowest subscriber consumed all the image received (rcv-hwm) and more than the last
 * scheduled SM reported, and no SM went within sm_catch_up_interval_ns.  The C half sends it
 * with the 25 % rule's while it sends the SMs; otherwise the Python half asks this. */
int32_t ss_image_catch_up_due(const ss_image_t *image, int64_t now_ns);


/* A receive endpoint's image table and receive buffers, all memory owned by Python. */
typedef struct {
    ss_image_t **slots;           /* open addressing on (session, stream), NULL = empty */
    int32_t slot_mask;            /* slots - 1, slots a power of two */
    int32_t stream_count;
    int32_t *streams;             /* stream ids with a subscription (unknown sessions of these
                                   * go up to Python, which elicits a SETUP) */
    int32_t stream_capacity;
    int32_t batch;                /* datagrams per recvmmsg */
    int32_t buffer_length;        /* bytes per datagram buffer (>= the largest datagram) */
    uint8_t *buffers;             /* batch x buffer_length; with UDP_GRO on the socket, one
                                   * buffer may hold several datagrams (segments) */
    uint8_t *sources;             /* batch x SS_SOCKADDR_MAX: struct sockaddr of each */
    int32_t *source_lengths;
    int32_t to_python_capacity;   /* datagrams for Python per call; more are counted in
                                   * receive_errors and dropped (a flood of coalesced ones) */
    int32_t last_errno;
    /* A test hook, as Aeron's debug receive channel endpoint: a DATA/PAD datagram arriving on
     * the socket is dropped with probability loss_threshold / 2^32 (0: never), drawn from a
     * xorshift64 generator whose state is loss_state (seed it non-zero). */
    uint32_t loss_threshold;
    uint64_t loss_state;
    ss_receiver_counters_t counters;
    /* Images given data in this batch: their readers are signalled once, after it (a futex
     * wake, or at least a full fence, per datagram costs more than the insert). */
    int32_t signal_count;
    ss_image_t *signal_pending[64]; /* SS_SIGNAL_PENDING_MAX */
    /* A send endpoint's publications (open addressing on (session, stream), NULL = empty;
     * publication_mask = slots - 1): NAKs for them are answered here, without Python, when
     * they need no timer (retransmit delay 0).  NULL: none. */
    ss_send_publication_t **publications;
    int32_t publication_mask;
    /* The duty cycle (ss_agent_t) reads the socket fd (-1: the simulator feeds it); datagrams
     * for Python wait in the buffers as `pending` triples (see ss_receiver_recv) and the socket
     * is not read again until Python took them (pending_count = 0); `failed`: a receive failed
     * (errno in last_errno), for Python to log. */
    int32_t fd;
    int32_t pending_count;
    int32_t *pending;
    int32_t failed;
    /* One destination of a multi-destination subscription (-1: an endpoint of its own): its
     * index in the images' connections.  Its table fields (slots, streams, counters) are
     * its channel's, shared; the data of an image it reads records the connection there,
     * with control_address as its control address when control_address_length > 0 (a
     * multicast destination's control group), else the data's source. */
    int32_t destination;
    int32_t control_address_length;
    uint8_t control_address[128]; /* SS_SOCKADDR_MAX */
    /* Below the endpoint's sends of the Python half's frames (NULL: ss_udp_binding through
     * fd), and the binding's context (the virtual one's: its port). */
    const ss_transport_binding_t *binding;
    void *binding_context;
    /* An encrypted channel's endpoint: every datagram opened before dispatch, every frame
     * sent sealed (NULL: plain, one branch).  handshake_taken: a handshake datagram came
     * (the Python half is due, and clears it: a send endpoint's publications send their next
     * SETUP at once, which a peer that just got its session dropped the last of). */
    ss_crypto_t *crypto;
    int32_t handshake_taken;
    /* The network thread's loop found the socket readable in its poll of this stamp
     * (ss_agent_t.ready_stamp): a duty cycle of that poll reads it. */
    int64_t ready_stamp;
} ss_receiver_t;

/* ------------------------------------------------- the channel endpoints' sends, for Python */
/* The one point every datagram of the driver leaves by is a channel endpoint's send
 * (network_endpoints.c); these are its doors for the frames the Python half sends.
 *
 * A send endpoint's (SETUP, RTTM, heartbeats, rate announcements; p is the endpoint as its
 * publication sees it): `frame` (length bytes) to `address` (a struct sockaddr of
 * address_length bytes), or with address_length 0 to where the endpoint sends its data (its
 * destination, the connected peer, or each destination of its table, as
 * ss_send_channel_send).  Counts as the data path does: the bytes sent, a short send (a full
 * socket), an error other than ECONNREFUSED (the ICMP answer to an earlier datagram: nobody
 * listens there yet), a new kind of which raises p->notice for Python to log.  Returns the
 * bytes sent (0: a table without destinations), or -1 (errno). */
int32_t ss_send_channel_send_frame(ss_send_publication_t *p, const uint8_t *frame,
                                   int32_t length, const uint8_t *address,
                                   int32_t address_length);
/* A receive endpoint's (NAKs, status messages, ERRs; r is the endpoint's, or a
 * multi-destination subscription's destination's): `frame` to `address` through r's socket
 * (r->fd) and binding.  Counts the bytes sent and a short send in r->counters; returns the
 * bytes sent, or -1 (errno; the caller counts and logs an error other than a full socket). */
int32_t ss_receive_channel_send_frame(const ss_receiver_t *r, const uint8_t *frame,
                                      int32_t length, const uint8_t *address,
                                      int32_t address_length);

/* Rebuild the image table from `images` (count of them; the table must have room for them at
 * a load of at most one half).  Returns 0, or -1 when a (session, stream) repeats. */
int32_t ss_receiver_set_images(ss_receiver_t *r, ss_image_t **images, int32_t count);
/* Rebuild a send endpoint's publication table (room for count at a load of at most one
 * half).  Returns 0, or -1 when a (session, stream) repeats. */
int32_t ss_receiver_set_publications(ss_receiver_t *r, ss_send_publication_t **publications,
                                     int32_t count);
/* The image of (session, stream), or NULL. */
ss_image_t *ss_receiver_find_image(const ss_receiver_t *r, int32_t session_id, int32_t stream_id);
/* One datagram from the network (`source`: its struct sockaddr): SS_RX_CONSUMED when it was
 * data for a known image (inserted, or dropped and counted), a NAK answered for a publication
 * of the table, an invalid datagram (counted), or data nobody wants; SS_RX_TO_PYTHON for
 * everything else (SETUP, RTTM, SM, NAK, ERR, and data
 * of an unknown session of a subscribed stream). */
int32_t ss_receiver_on_datagram(ss_receiver_t *r, const uint8_t *data, int32_t length,
                                const uint8_t *source, int32_t source_length, int64_t now_ns);
/* recvmmsg up to `batch` buffers from fd (non-blocking) and dispatch each datagram in them (a
 * buffer the kernel coalesced, UDP_GRO, is cut at its segment size); those for Python go to
 * to_python as (buffer index, byte offset in buffers, length) triples, *to_python_count of
 * them.  Returns the number of buffers received (0: none waiting), or -1 on an error (errno
 * in last_errno). */
int32_t ss_receiver_recv(ss_receiver_t *r, int32_t fd, int64_t now_ns, int32_t *to_python,
                         int32_t *to_python_count);

/* ------------------------------------------------------------------------- the duty cycle */
/* A network agent's duty cycle (daemon/agents/, docs/ARCHITECTURE.md, Threads): the per-datagram
 * work of its endpoints in C, and the rule that says when its Python half (commands, SETUP and
 * SM handling, the timers, the rebuild pass) is due.  Python keeps the arrays current. */
#define SS_DUE_COMMANDS 1
#define SS_DUE_INPUT 2
#define SS_DUE_IMAGE 4
#define SS_DUE_PUBLICATION 8
#define SS_DUE_TIMER 16
#define SS_DUE_STOP 32
/* The sender's bands (docs/BACKPRESSURE.md): a publication's effective priority (its priority=
 * plus one point per SS_AGING_NS_PER_POINT it has waited with data ready, at most
 * SS_AGING_MAX) puts it in band 4 (>= 750), 3 (500..749), 2 (250..499), 1 (0..249) or 0 (< 0);
 * the sender serves the bands by deficit weighted round robin, weights 8/4/2/1/1, each visit
 * granting a band its weight x max_datagrams datagrams, one round per send socket
 * (ss_band_round_t); within a band the publications take turns. */
#define SS_BANDS 5
#define SS_PRIORITY_MIN (-1000)
#define SS_PRIORITY_MAX 1000
#define SS_AGING_NS_PER_POINT 10000000
#define SS_AGING_MAX 1000
/* The band of publication p at now_ns (0..SS_BANDS-1). */
int32_t ss_band_of(const ss_send_publication_t *p, int64_t now_ns);

/* recvmmsg calls per endpoint per duty cycle while its socket stays full. */
#define SS_MAX_RECEIVE_CALLS 8

typedef struct {
    ss_receiver_t **endpoints;    /* receive endpoints, or a sender's send endpoints (control) */
    int32_t endpoint_count;
    int32_t is_sender;            /* endpoints are read by the status-poll rule, not each cycle */
    ss_image_t **images;
    int32_t image_count;
    ss_send_publication_t **publications;
    int32_t publication_count;
    ss_span_t *spans;             /* max_datagrams + SS_RETRANSMIT_MAX */
    int32_t max_datagrams;
    int32_t status_poll_ratio;    /* control input every 2 x this datagrams sent (Aeron's) */
    int32_t datagrams_to_status_poll;
    int32_t commands;             /* raised by another thread that submitted a command */
    int32_t due;                  /* out: SS_DUE_* of the last cycle */
    int64_t python_deadline_ns;   /* the earliest timer of the Python half */
    /* The pressure governor: the lowest band (priority < 0) gets no turn and does not age (its
     * new data waits in the log; its retransmissions still go). */
    int32_t defer_lowest_band;
    /* 0: a duty cycle reads every endpoint (the simulator's, an embedded driver's); else the
     * network thread's loop polled its epoll (ss_duty_loop_once) and the cycle reads the
     * endpoints whose socket it found readable (ss_receiver_t.ready_stamp equal to this), and
     * the encrypted ones (their sealing keeps timers).  receivers_by_fd (receivers_by_fd_count
     * slots, NULL where no endpoint has that fd) is how the loop finds them; Python sizes and
     * fills it with the arrays. */
    int64_t ready_stamp;
    ss_receiver_t **receivers_by_fd;
    int32_t receivers_by_fd_count;
    /* The sender's marks of its send sockets per pass, indexed by fd (2 per fd: the pass
     * that found data on it, the pass that served it; socket_mark_count fds), so that a pass
     * groups its publications by socket in one sweep; Python sizes it with the arrays. */
    int64_t *socket_marks;
    int32_t socket_mark_count;
    int64_t socket_pass;
    int64_t endpoints_read;       /* out: endpoints read since the loop last took them */
    /* The sender's heartbeat timers: a binary min-heap of publication indices (heartbeat_heap,
     * heartbeat_count of them; Python gives it room for every publication) keyed by when each
     * is next due (heartbeat_keys: the heartbeat rule's time as of its keying, on the
     * keepalive instants in a parking loop, never later than the truth, since a send only
     * moves it on).  A duty cycle looks
     * at the publications whose key came, not at every one. */
    int32_t *heartbeat_heap;
    int64_t *heartbeat_keys;
    int32_t heartbeat_count;
    /* out: the members for which ss_agent_python_due last found the Python half due, so that
     * its pass visits those alone: due_members_count indices, an endpoint's (SS_DUE_INPUT) as
     * its index in endpoints, an image's (SS_DUE_IMAGE) as endpoint_count + its index in
     * images, a publication's (SS_DUE_PUBLICATION) as endpoint_count + image_count + its
     * index in publications.  Without the array (NULL: Python gives it room for every
     * member), none are listed. */
    int32_t *due_members;
    int32_t due_members_count;
    /* How early its cycles send a keepalive (a heartbeat, an SM's timer): SS_TIMER_SLACK_NS,
     * set by the network thread's parking loop (ss_duty_loop_run); 0 (each at its time) for
     * cycles that never park (an embedded driver's, the simulator's). */
    int64_t keepalive_slack_ns;
    /* The keepalives sent per socket in the cycle at keepalive_cycle_ns, a slot by fd modulo
     * their number (two sockets in one slot share it): SS_KEEPALIVE_BURST_MAX bounds each.
     * The C half's own. */
    int64_t keepalive_cycle_ns;
    int32_t keepalives_sent[256];
} ss_agent_t;

/* Key the heartbeat timers anew from the publications that send their heartbeats in C
 * (heartbeat_in_c): after each Python pass, which sets that flag and the arrays. */
void ss_agent_schedule_heartbeats(ss_agent_t *a);

/* One duty cycle at now_ns: a receiver reads every endpoint with a socket (fd >= 0) that the
 * loop's poll found readable (every one without the poll: ss_duty_loop_t); a sender
 * sends what each publication with a socket has ready (retransmissions first) and reads its
 * endpoints by the status-poll rule.  Then it decides whether the Python half is due (a->due,
 * see ss_agent_python_due).  Returns the work done. */
int32_t ss_agent_do_work(ss_agent_t *a, int64_t now_ns);
/* The sender's sends of its publications without a socket (the simulator's), by the same rules
 * as ss_agent_do_work's for sockets (retransmissions first, the bands, each one's
 * virtual_room): the datagrams leave through the send channel endpoint's send, to each
 * publication's binding (ss_virtual_binding: the simulator's network).  Returns the
 * datagrams sent. */
int32_t ss_send_virtual(ss_agent_t *a, int64_t now_ns, int32_t retransmits_only);
/* The sender's rule for reading control input (status messages, NAKs) after a cycle that sent
 * `sent` datagrams: every cycle that sent nothing, else every 2 x status_poll_ratio datagrams
 * (aeron_driver_sender_do_work counts cycles of 2).  Returns 1 when the input is due now (and
 * starts the next count).  ss_agent_do_work and the simulator's sender share it. */
int32_t ss_sender_status_poll_due(ss_agent_t *a, int32_t sent);
/* Whether the Python half is due at now_ns: SS_DUE_* bits, also stored in a->due. */
int32_t ss_agent_python_due(ss_agent_t *a, int64_t now_ns);
/* The earliest timer the agent's C half keeps itself (the gaps of images rebuilt in C, the
 * status-message and liveness timers of images whose SMs it sends, the heartbeats of
 * publications that send them here and the liveness of the receiver whose SMs it takes; 0
 * while a publication's cleaning is behind), or SS_NO_DEADLINE: the C loop parks no later,
 * and the simulator's clock moves there. */
int64_t ss_agent_c_deadline(const ss_agent_t *a);

/* A network thread's loop: duty cycles of its agents, spinning while there is work, yielding
 * between idle cycles, and after idle_spin_ns without work parking in epoll (its sockets,
 * the doorbells and the wake eventfd, registered by Python) until the earliest deadline. */
typedef struct {
    ss_agent_t **agents;
    int32_t agent_count;
    int32_t epoll_fd;
    int32_t wake_fd;
    int32_t doorbell_count;
    int32_t *doorbell_fds;
    int32_t stopping;             /* raised by another thread (then the wake eventfd) */
    int32_t due;                  /* out: the SS_DUE_* bits of the last cycle */
    int64_t idle_spin_ns;
    int64_t max_park_ns;
    int64_t now_ns;               /* out: the time of the last cycle */
    int64_t last_work_ns;
    int64_t last_cycle_ns;        /* the watchdog's evidence */
    int64_t *cycles;              /* a counter cell (NETWORK_DUTY_CYCLES), or NULL */
    int64_t parks;
    int64_t *work_cycles;         /* NETWORK_WORK_CYCLES: cycles that did work, or NULL */
    int64_t *busy_ns;             /* NETWORK_BUSY_NS: the time those cycles took, or NULL */
    /* out: how late the park's timed wake-ups come, smoothed (1/8 per sample), ns: a starved
     * thread wakes late (the pressure governor's duty-cycle lag); and when the last sample was
     * taken (a thread that stopped parking on its timer has no news of its lag). */
    int64_t lag_ns;
    int64_t lag_sampled_ns;
    /* Its poll of the readable sockets (SS_POLL_ENDPOINTS_MIN endpoints or more): the
     * events array (poll_capacity of them, Python's) and the stamp of the last poll. */
    void *poll_events;
    int32_t poll_capacity;
    int64_t poll_stamp;
    int64_t *endpoint_reads;      /* NETWORK_ENDPOINT_READS: endpoints its cycles read, or NULL */
} ss_duty_loop_t;

/* The size of one epoll event (struct epoll_event), for the poll's array. */
int32_t ss_epoll_event_size(void);

/* From this many endpoints a network thread's loop asks epoll which sockets are readable, one
 * system call a cycle, and reads only those (Aeron's transport poller): an idle endpoint costs
 * its cycles nothing.  Below it, reading each socket costs less than the poll. */
#define SS_POLL_ENDPOINTS_MIN 8

/* Run duty cycles until an agent's Python half is due or the loop is stopping; returns the
 * SS_DUE_* bits of all agents (SS_DUE_STOP when stopping).  Runs without the GIL. */
int32_t ss_duty_loop_run(ss_duty_loop_t *l);
/* One duty cycle of every agent at the clock's now, counted as ss_duty_loop_run counts its
 * cycles; never parks (an embedded driver's do_work in invoker mode).  Sets l->now_ns and
 * l->due (the SS_DUE_* bits of all agents); returns the work done. */
int32_t ss_duty_loop_once(ss_duty_loop_t *l);
