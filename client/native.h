/*
 * slipstream native hot paths: atomics, futex park/wake, the concurrent term appender,
 * term scans and the receiver's rebuild/gap scans.  Layouts follow docs/PROTOCOL.md §2.
 *
 * Everything here works on raw pointers into mapped log buffers and counters; Python owns the
 * mappings and their lifetimes.  All multi-byte fields are little-endian (x86-64 native).
 */
#include <stdint.h>

/* The layout constants below are slipstream.client.layout's (SS_<NAME> is its NAME);
 * tests/test_layout.py checks that every one agrees with it. */

/* ---- frame header: byte offsets of the fields of a DATA/PAD header ---- */
#define SS_FRAME_HEADER_LENGTH 8    /* frame_length, version, flags, type: every frame's */
#define SS_VERSION_FIELD 4
#define SS_FLAGS_FIELD 5
#define SS_TYPE_FIELD 6
#define SS_TERM_OFFSET_FIELD 8
#define SS_SESSION_ID_FIELD 12
#define SS_STREAM_ID_FIELD 16
#define SS_TERM_ID_FIELD 20
#define SS_RESERVED_VALUE_FIELD 24
#define SS_HEADER_LENGTH 32
#define SS_FRAME_ALIGNMENT 32
#define SS_CURRENT_VERSION 0

#define SS_BEGIN_FLAG 0x80
#define SS_END_FLAG 0x40
#define SS_EOS_FLAG 0x20
#define SS_UNFRAGMENTED 0xC0
#define SS_HDR_TYPE_PAD 0x00
#define SS_HDR_TYPE_DATA 0x01

/* ---- log buffer descriptor (docs/PROTOCOL.md §2.1, §2.2) ---- */
#define SS_PARTITION_COUNT 3
#define SS_LOG_META_DATA_LENGTH 4096
#define SS_META_TAIL_COUNTERS 0
#define SS_META_ACTIVE_TERM_COUNT 24
#define SS_META_END_OF_STREAM_POSITION 128
#define SS_META_IS_CONNECTED 136
/* slipstream-local fields in the unused tail of the metadata page (not part of Aeron's wire
 * contract, which is only about frames): the eventcount that parked readers wait on. */
#define SS_META_READER_SIGNAL 1024
#define SS_META_READER_WAITERS 1088
/* The driver's network thread parks on its sockets, not on a futex, so a client that needs it
 * (new data for the sender, a subscriber past the point where a status message is due) rings
 * its doorbell socket, only while the driver says it is parked (waiters > 0). */
#define SS_META_DRIVER_WAITERS 1152
#define SS_META_DRIVER_WAKE_POSITION 1216
/* Publishers that wait for credit (policy=block) park on this eventcount; the driver bumps it
 * whenever it moves pub-lmt or is_connected.  The limit a publisher last found no credit at,
 * and when (CLOCK_MONOTONIC ns), tell the driver's back-pressure episodes that a publisher
 * met its limit between two of its samples. */
#define SS_META_PUBLISHER_SIGNAL 1280
#define SS_META_PUBLISHER_WAITERS 1344
#define SS_META_LIMIT_HIT_POSITION 1408
#define SS_META_LIMIT_HIT_TIME 1472
#define SS_META_LIMIT_MOVED_TIME 1536 /* when the driver last moved pub-lmt (CLOCK_MONOTONIC ns) */
/* Publishers that wait for a durable position (durable=) park on this eventcount; the driver
 * bumps it whenever it moves the publication's pub-durable counter. */
#define SS_META_DURABLE_SIGNAL 1600
#define SS_META_DURABLE_WAITERS 1664

/* offer() results, as Aeron */
#define SS_NOT_CONNECTED (-1)
#define SS_BACK_PRESSURED (-2)
#define SS_ADMIN_ACTION (-3)
#define SS_CLOSED (-4)
#define SS_MAX_POSITION_EXCEEDED (-5)
/* internal: a length outside [0, max] reached C; Python turns it into MessageTooLongError */
#define SS_INVALID_LENGTH (-100)
#define SS_INVALID_BATCH (-101)

/* Everything an appender needs, filled once by Python when a publication is created. */
typedef struct {
    uint8_t *log;               /* start of term 0 */
    uint8_t *meta;              /* log + 3 * term_length */
    int64_t *publication_limit; /* the driver's pub-lmt counter */
    int32_t term_length;
    int32_t position_bits;      /* log2(term_length) */
    int32_t initial_term_id;
    int32_t session_id;
    int32_t stream_id;
    int32_t max_payload;        /* mtu - 32 */
    int32_t max_message_length; /* min(term_length / 8, 16 MiB) */
    int64_t max_position;       /* term_length << 31 */
    /* For telling failures apart (ss_refine): */
    int32_t closed;             /* set when the publication, its client or the driver is gone */
    int64_t *back_pressure_events; /* system counter, counted once per limit value reached */
    int32_t *driver_signal;     /* the driver's eventcount, to wake a parked driver */
    int32_t *driver_waiters;
    int32_t signal_every_refusal; /* 1: every back-pressured offer wakes the driver (IPC: its
                                   * conductor raises the limit); 0: only a new limit hit */
    int64_t last_limit_hit;
    int32_t doorbell_fd;        /* network publications: the sender's doorbell socket, else -1 */
    /* 1: an exclusive publication's appender (Aeron's ExclusivePublication): its log has one
     * writer, this appender on one thread at a time, so a claim moves the term's tail with a
     * release store of the next value rather than an atomic add.  0: shared (any number of
     * writers, threads or processes).  Every append, batch and claim below takes either. */
    int32_t exclusive;
} ss_appender_t;

/* ---- atomics on shared memory ---- */
int64_t ss_load_acquire_i64(const int64_t *addr);
void ss_store_release_i64(int64_t *addr, int64_t value);
int64_t ss_get_and_add_i64(int64_t *addr, int64_t delta);
int ss_cas_i64(int64_t *addr, int64_t expected, int64_t desired);
int ss_cas_i32(int32_t *addr, int32_t expected, int32_t desired);
int32_t ss_load_acquire_i32(const int32_t *addr);
void ss_store_release_i32(int32_t *addr, int32_t value);
int32_t ss_get_and_add_i32(int32_t *addr, int32_t delta);
/* Raise *addr to value if it is larger (a monotonic position counter). */
void ss_propose_max_i64(int64_t *addr, int64_t value);

/* ---- futex (shared, not PRIVATE: waiters and wakers are different processes) ---- */
int ss_futex_wait(int32_t *addr, int32_t expected, int64_t timeout_ns);
int ss_futex_wake(int32_t *addr, int32_t count);
/* Eventcount signal: bump *signal and wake everyone parked on it, only if *waiters > 0. */
void ss_signal(int32_t *signal, const int32_t *waiters);

/* ---- appender ---- */
/* Append one message (reserved value 0); returns the new position or a negative code,
 * refined by ss_refine. */
int64_t ss_offer(ss_appender_t *a, const char *msg, int32_t length);
/* ss_offer with `reserved_value` in the reserved_value field (SS_RESERVED_VALUE_FIELD) of the
 * message's frame, or of every frame of a fragmented message. */
int64_t ss_offer_rv(ss_appender_t *a, const char *msg, int32_t length, int64_t reserved_value);
/* Turn a raw append failure into the caller's code: CLOSED when closed, NOT_CONNECTED when no
 * subscriber, else BACK_PRESSURED.  Once per limit value reached it counts a back-pressure
 * event, records the limit and the time in the log (SS_META_LIMIT_HIT_*) and wakes the driver
 * if it is parked (its back-pressure episodes); with signal_every_refusal (IPC, where the
 * conductor raises the limit) every refusal wakes it, so it raises the limit as soon as
 * subscribers move. */
int64_t ss_refine(ss_appender_t *a, int64_t result);
/* The driver moves pub-lmt: release-store `value` into *limit, stamp the time in the log
 * (SS_META_LIMIT_MOVED_TIME) and wake the publishers parked for credit. */
void ss_publish_limit(int64_t *limit, int64_t value, uint8_t *meta);
/* Whether an offer could append now: closed (it would return CLOSED at once), or connected and
 * the producer position below pub-lmt. */
int ss_has_credit(const ss_appender_t *a);
/* Spin for up to spin_ns, then yield the CPU between looks for up to yield_ns more, then park
 * on the log's publisher eventcount, until ss_has_credit or timeout_ns passes (-1: no timeout)
 * or a signal interrupts the park.  Returns 1 when credit is (probably) there, 0 otherwise. */
int ss_await_credit(const ss_appender_t *a, int64_t spin_ns, int64_t yield_ns,
                    int64_t timeout_ns);
/* Spin for up to spin_ns, then yield between looks for up to yield_ns more, then park on the
 * log's durable eventcount, until *durable (the pub-durable counter) reaches `target`,
 * timeout_ns passes (-1: no timeout), a signal interrupts the park, or the publication is
 * closed.  Returns 1 when reached, 0 otherwise (the caller looks at why). */
int ss_await_durable(const ss_appender_t *a, const int64_t *durable, int64_t target,
                     int64_t spin_ns, int64_t yield_ns, int64_t timeout_ns);
/* Append `count` messages packed back to back in `data` (data_length bytes) with their lengths
 * in `lengths`.  Runs of unfragmented messages are claimed with one atomic add.  Stops early at
 * the publication limit; rotates terms itself.  Returns how many were appended and stores the
 * last position (or, when none was appended, the refined failure code) in *result.
 * SS_INVALID_LENGTH: a length is out of range; SS_INVALID_BATCH: lengths exceed data_length. */
int32_t ss_offer_batch(ss_appender_t *a, const char *data, int64_t data_length,
                       const int32_t *lengths, int32_t count, int64_t *result);
/* ss_offer_batch with message i's frames carrying reserved_values[i] (`count` of them; NULL:
 * 0 for every message, as ss_offer_batch). */
int32_t ss_offer_batch_rv(ss_appender_t *a, const char *data, int64_t data_length,
                          const int32_t *lengths, const int64_t *reserved_values, int32_t count,
                          int64_t *result);

/* A replay's block append (Aeron's ExclusivePublication.offerBlock): copy the frames of
 * `source`, one term of another log (source_term_length bytes, which must be this log's term
 * length), from stream `position` into this log at the same position, which must be the
 * publication's: its log has the source's initial term id and term length, and no other
 * writer (nothing else appends to a replay's publication).  Copies whole committed frames,
 * up to max_length bytes (at least the first frame), none at or past `end_position`, from
 * the publication limit's point of view as a claim (the first frame goes when `position` is
 * below it).  Stops before a frame that is not this term's (its term id and term offset
 * fields), not DATA, longer than the publication's frames, or padding that does not end the
 * term (that padding is copied: the next call rotates the log).  Each frame is written as
 * the appender writes one: length, flags, type, reserved value and payload from the source;
 * term offset, term id, session and stream id this log's.  The first frame is committed last,
 * and only if the source still holds it after the copy (a writer lapping the log, or its
 * cleaner, reaches it first); else nothing is published and the copy is zeroed again.
 * Returns the bytes appended and stores the position after them in *result; or 0, with
 * *result = 0 when nothing at `position` could be copied (not a frame this copies, or the
 * source changed: the caller looks at what is there), SS_ADMIN_ACTION after a rotation (call
 * again), SS_INVALID_BATCH when an argument is out of range (positions not frame-aligned),
 * the publication is not exclusive (ss_appender_t.exclusive) or not at `position`, else the
 * refined code of an offer. */
int32_t ss_append_block(ss_appender_t *a, const uint8_t *source, int32_t source_term_length,
                        int64_t position, int64_t end_position, int32_t max_length,
                        int64_t *result);

/* Aeron's ExclusivePublication.offerBlock: append `block`, `length` bytes of whole frames the
 * caller wrote, at the publication's position, whole or not at all.  Its frames follow each
 * other from the term offset and term id of that position, each with this publication's
 * session and stream ids: DATA frames of at most a frame's payload, and the last may be
 * padding that ends the term.  The block must end within the term.  As an offer, it goes when
 * the position is below the publication limit (then all of it, as Aeron's).  Only an
 * exclusive publication's.  Returns the new position, SS_INVALID_BATCH when the block is not
 * such (nothing appended; the caller names why), or an offer's refined code (SS_ADMIN_ACTION
 * after a rotation: call again). */
int64_t ss_offer_block(ss_appender_t *a, const uint8_t *block, int32_t length);

/* Claim a single unfragmented frame of `length` payload bytes; on success *frame_offset is the
 * frame's offset from the start of the log (header included) and the new position is returned.
 * Its reserved value is 0 until the claimer writes another before the commit. */
int64_t ss_try_claim(ss_appender_t *a, int32_t length, int64_t *frame_offset);
/* Publish (commit) or give up as padding (abort) the frame of a claim of frame_length bytes
 * (header included); 1 when done, 0 when the driver had already given the claim up. */
int32_t ss_commit(ss_appender_t *a, uint8_t *frame, int32_t frame_length);
int32_t ss_abort(ss_appender_t *a, uint8_t *frame, int32_t frame_length);
/* Rotate from term_count to term_count + 1 (idempotent, safe under races). */
int ss_rotate_log(uint8_t *meta, int32_t current_term_count, int32_t current_term_id);

/* Ring the driver's doorbell (a connected datagram socket) if the driver is parked on this log
 * (SS_META_DRIVER_WAITERS > 0) and `position` reached the position it waits for. */
void ss_ring_doorbell(uint8_t *meta, int32_t doorbell_fd, int64_t position);
/* A subscriber's position moves: release-store it, then ring the receiver's doorbell if the
 * receiver is parked and waits for this position (doorbell_fd < 0: an IPC image, no ring). */
void ss_advance_position(int64_t *position_counter, int64_t position, uint8_t *meta,
                         int32_t doorbell_fd);

/* ---- reader: term scan for the subscriber (TermReader) ----
 * Scans committed unfragmented DATA frames from `offset` in one term, stepping over PAD frames.
 * For each frame writes the payload's start and end offsets (start = frame offset + 32, end =
 * frame offset + frame_length) into starts[i] and ends[i].  Stops after max_frames frames, at
 * the first uncommitted frame, at scan_end (a term offset, at most the term length), or before
 * a fragment (BEGIN/END not both set: the caller assembles those).  Returns the count, or -1
 * when the frame at `offset` itself is committed but not one this scan takes (a fragment, or
 * one that ends past scan_end): the caller's cold path (never with max_frames <= 0, which reads
 * nothing and returns 0); *next_offset is where scanning stopped. */
int32_t ss_term_read(const uint8_t *term, int32_t offset, int32_t scan_end, int32_t max_frames,
                     int32_t *starts, int32_t *ends, int32_t *next_offset);

/* Copies the payloads ss_term_read found in one term, term[starts[i]:ends[i]] for i < count,
 * back to back into out (out_capacity bytes), and writes what an Arrow binary column and its
 * neighbours need: offsets[0..count] (offsets[0] = 0), each message's length into lengths
 * (what offer_batch takes), its stream position after it (term_base + its frame's aligned
 * end) into positions, and its frame's reserved value into reserved.  Checks every start and
 * end against term_length and the copy against out_capacity.  Returns the count copied (the
 * messages that fit), or -1 for a start or end outside the term. */
int32_t ss_gather_messages(const uint8_t *term, int32_t term_length, const int32_t *starts,
                           const int32_t *ends, int32_t count, int64_t term_base, uint8_t *out,
                           int64_t out_capacity, int32_t *offsets, int32_t *lengths,
                           int64_t *positions, int64_t *reserved);

/* ---- reader: a planner's walk over whole messages of one term ----
 * From term offset `offset` up to scan_end (a term offset, at most the term length), step over
 * the whole committed messages, a fragmented one's frames as one message, PAD frames stepped
 * over, and the fragments of a message begun before `offset` stepped over uncounted (a read
 * from there skips them).  Each frame is checked (a length of at least the header whose aligned
 * end lies within scan_end) before its fields are read.  Stops at the first frame not written
 * or not whole before scan_end; before the message that would make the count exceed
 * max_messages or its payload bytes exceed max_bytes, unless it is the first and take_first
 * (SS_MESSAGES_LIMIT); when find_time, before the first message whose reserved value (its
 * last frame's; its top bit, the envelope's mark, masked off) is at least time_ns
 * (SS_MESSAGES_TIME); a message past max_messages is known at its first fragment, so with
 * max_messages 0 the walk stops at the first message that begins at or after `offset` (whole
 * or not).  Returns the term offset after the last message stepped over (a message boundary:
 * never inside a message): from a term's start up to a cut, where the message the cut lies
 * in begins; *messages and *bytes count those messages and their payload bytes; *reason says
 * why it stopped; *first_data is the term offset of the first DATA frame (not padding) the
 * walk came to, the one it stopped at too, counted or not (-1: none). */
#define SS_MESSAGES_END 0
#define SS_MESSAGES_LIMIT 1
#define SS_MESSAGES_TIME 2
int32_t ss_scan_messages(const uint8_t *term, int32_t offset, int32_t scan_end,
                         int64_t max_messages, int64_t max_bytes, int32_t take_first,
                         int32_t find_time, int64_t time_ns, int64_t *messages, int64_t *bytes,
                         int32_t *reason, int32_t *first_data);

/* What a parked reader watches for one image: the frame at its subscriber position. */
typedef struct {
    const uint8_t *log;      /* start of term 0 */
    const int64_t *position; /* the subscriber's position counter */
    int32_t *signal;         /* the log's eventcount */
    int32_t *waiters;
    int32_t term_length;
    int32_t position_bits;
} ss_reader_t;

/* Spin for up to spin_ns, then park, until a frame is committed at one of `count` readers'
 * positions or timeout_ns passes (-1: no timeout).  Returns 1 if data is
 * (probably) there, 0 on timeout. */
int ss_await_frames(const ss_reader_t *readers, int32_t count, int64_t spin_ns, int64_t timeout_ns);

/* ---- sender: scan for availability (TermScanner) ----
 * Bytes of committed frames from `offset`, whole aligned frames only, at most max_length.
 * *padding is set to the aligned length of a PAD frame that ends the scan (sent as a header
 * only), else 0.  Returns the available byte count. */
int32_t ss_scan_for_availability(const uint8_t *term, int32_t offset, int32_t max_length,
                                 int32_t term_length, int32_t *padding);

/* ---- the archive's recovery and verify scan: the whole frames of a recorded segment ----
 * A segment is a file of whole terms laid out as in the log, its first byte at stream position
 * segment_base (a multiple of term_length).  From segment offset `from` (frame-aligned, at
 * most `size`), step over frames while each one is whole and valid: its header lies within
 * `size` bytes, its frame_length is at least the header, it is DATA or PAD, its term offset,
 * term id (initial_term_id + position >> position_bits), session id and stream id fields are
 * those of its place, it does not cross the end of its term, and its aligned end is within
 * `size` (the file's size).  Returns the segment offset after the last such frame; *reason says
 * why it stopped: SS_SCAN_END (a zero length, or `size` reached exactly), SS_SCAN_TORN (a
 * frame whose end, or header, lies past `size`), SS_SCAN_INVALID (a header that is no frame
 * of this place); *frames counts the frames stepped over. */
#define SS_SCAN_END 0
#define SS_SCAN_TORN 1
#define SS_SCAN_INVALID 2
int64_t ss_scan_recorded(const uint8_t *segment, int64_t from, int64_t size, int64_t segment_base,
                         int32_t term_length, int32_t position_bits, int32_t initial_term_id,
                         int32_t session_id, int32_t stream_id, int32_t *reason, int64_t *frames);

/* ---- receiver: rebuild and gap scan (TermRebuilder, TermGapScanner) ---- */
/* Copy a datagram of frames into the term at offset, only where the first frame is not yet
 * there; the body goes first and the first 8 header bytes last with a release store.  Returns
 * 1 when it copied, 0 when a frame was there already (which may be shorter than this datagram:
 * another datagram's, so the rest of this range can still be missing). */
int32_t ss_rebuild_insert(uint8_t *term, int32_t offset, const uint8_t *packet, int32_t length);
/* From rebuild_offset, step over committed frames up to limit_offset.  Returns the offset of
 * the first gap (or limit_offset when none); *gap_length gets its length (0 when none). */
int32_t ss_scan_gap(const uint8_t *term, int32_t rebuild_offset, int32_t limit_offset,
                    int32_t *gap_length);

/* Zero [offset, offset+length) with the first 8 bytes last (release), so readers never see a
 * half-cleaned header. */
void ss_clean(uint8_t *base, int64_t length);

/* The bytes one madvise of ss_populate maps at most (4 MiB): the kernel holds the process's
 * mmap lock through one madvise, and another thread's mmap or munmap (the driver's conductor
 * making a publication's log while a worker populates an image's 3 x 128 MiB) would wait for
 * all of it.  A log mapped behind its hand-over (LogBuffer.populate_step) is mapped a step at
 * a time too. */
#define SS_POPULATE_STEP 4194304

/* Fault in every page of [address, address+length) now (MADV_POPULATE_WRITE, or _READ for a
 * read-only mapping; Linux >= 5.14), SS_POPULATE_STEP bytes a madvise.  Called through cffi,
 * so the GIL is released meanwhile: filling a 192 MiB log takes tens of ms.  Returns 0 or an
 * errno value. */
int32_t ss_populate(uint8_t *address, int64_t length, int32_t writable);

/* Name the calling thread for ps -T, top -H, perf and /proc/<pid>/task/<tid>/comm: a leading
 * "slipstream-" becomes "ss-", and Linux keeps the first 15 bytes. */
void ss_name_thread(const char *name);

/* ---- the client's keepalive, without the GIL ----
 * A thread of the client process that, every interval_ns, writes CLOCK_MONOTONIC ns into the
 * client's heartbeat counter (`heartbeat`), only while that counter's metadata fields (`state`,
 * `type`, `registration`) still say allocated_state, heartbeat_type and registration_id: a
 * driver that timed the client out may have given the slot to someone else.  It then checks
 * the driver: some process holds the flock of `lock_path`; `counters_path` is still the file
 * the client mapped (counters_device, counters_inode), not a new driver's; and, when
 * driver_timeout_ns > 0, the driver's heartbeat (`driver_heartbeat`, CLOCK_REALTIME ns) is at
 * most driver_timeout_ns old.  At the first check that fails it writes one byte
 * (SS_KEEPER_DRIVER_*) to notify_fd and ends.  Python's own threads would take the GIL from the
 * application's thread at every beat.  The thread blocks every signal. */
#define SS_KEEPER_DRIVER_EXITED 1
#define SS_KEEPER_DRIVER_STOPPED 2
#define SS_KEEPER_DRIVER_REPLACED 3
typedef struct {
    int64_t *heartbeat;
    const int32_t *state;
    const int32_t *type;
    const int64_t *registration;
    int32_t allocated_state;
    int32_t heartbeat_type;
    int64_t registration_id;
    const int64_t *driver_heartbeat;
    int64_t driver_timeout_ns;
    const char *lock_path;      /* copied */
    const char *counters_path;  /* copied */
    uint64_t counters_device;
    uint64_t counters_inode;
    int64_t interval_ns;
    int32_t notify_fd;
} ss_keeper_params_t;
typedef struct ss_keeper ss_keeper_t;
/* Start it; NULL when it could not start (errno says why: EINVAL for interval_ns <= 0). */
ss_keeper_t *ss_keeper_start(const ss_keeper_params_t *params);
/* Stop the thread (at once, even mid-interval), wait for it to end and free it; NULL: nothing. */
void ss_keeper_stop(ss_keeper_t *keeper);
