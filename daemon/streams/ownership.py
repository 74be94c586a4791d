"""Who runs each per-stream rule, the C half or the Python half: the one table of it; and
which thread owns each field and method of a stream object (:data:`PUBLICATION_THREADS`,
:data:`IMAGE_THREADS`; tests/test_thread_ownership.py holds the conductor to them, and the
stream objects' code to sections headed by those owners, :data:`SECTION_HEADINGS`), and of
the driver's host-name cache and resolver (:data:`NAME_THREADS`; tests/test_names.py runs a
driver and checks each was called on its owner's thread only).

A network stream's rules (status messages, heartbeats, pub-lmt's steps, cleaning, the rebuild
pass and its NAKs, liveness) run in the two halves of the network thread: the Python half
(:mod:`~slipstream.daemon.streams.publication`, :mod:`~slipstream.daemon.streams.image`) and
the C half (daemon/network_*.c).  Each rule is written once (:attr:`Rule.written_once`):
one C function of the data path, which the C duty cycle runs while the rule is C's and the
Python half calls otherwise, so the driver and the simulator run the same code (but for
the time of a keepalive: the network thread's parking loop sends the heartbeats and timer
SMs due within SS_TIMER_SLACK_NS together, the simulator each at its time).  Each rule
has an owner by default; a flag of the stream's C struct (``ss_send_publication_t``,
``ss_image_t``) hands it to the other half while the conditions of its row hold, and the
Python half sets the flags in one function per stream type, which its transitions call:

* :meth:`NetworkPublication.sync_c_half
  <slipstream.daemon.streams.publication.NetworkPublication.sync_c_half>`, after every pass
  of the sender's Python half; an event within a pass calls it for the rules decided at once
  (:attr:`Rule.at_once`), which must not outlive a pass that fails after it;
* :meth:`PublicationImage.sync_c_half
  <slipstream.daemon.streams.image.PublicationImage.sync_c_half>`, at once, by every event
  that moves what decides them: a subscriber added or removed, a transition, left behind.

Where the C half adds conditions only it sees (a loss detector, subscribers, an EOS
heartbeat), the flag is the Python half's part of the decision and an exported C function
(:attr:`Rule.c_predicate`, declared in daemon/network.h) has the last word: the Python half
asks it and never copies it, so the two halves cannot disagree.

docs/ARCHITECTURE.md ("Who runs each rule: the C half and the Python half") shows this table
as :func:`markdown` renders it; tests/test_ownership.py keeps the two the same, and checks
that each flag is set by its stream's one function and nowhere else.  The same page (Threads)
shows the threads' tables as :func:`threads_markdown` renders them, which
tests/test_thread_ownership.py keeps the same.
"""

from __future__ import annotations

import attrs

PYTHON = "Python"
C = "C"


@attrs.frozen
class Rule:
    """One rule of a stream, and who runs it."""

    stream: str
    #: What the rule does.
    rule: str
    #: Who runs it while the flag is off (0).
    default: str
    #: The field of the stream's C struct that hands it over.
    flag: str
    #: The conditions under which the C half runs it.
    c_runs_it: str
    #: What hands it back (to the Python half, or from C for a rule C runs by default).
    handed_back: str
    #: Set at once by each event that changes it within a pass, not only after the pass.
    at_once: bool
    #: The exported C function (daemon/network.h) that has the last word, if any.
    c_predicate: str = ""
    #: Not the stream's one function's to set: who sets the flag instead.
    set_elsewhere: str = ""
    #: The rule's one copy, a C function of the data path (daemon/network_*.c, exported in
    #: daemon/network.h) that both halves run: the C duty cycle while the flag hands the rule
    #: to it, the Python half otherwise (or never, when C runs it by default).
    written_once: str = ""

    def when_set(self) -> str:
        if self.set_elsewhere:
            return self.set_elsewhere
        if self.stream == IMAGE:
            return "at once"
        return "at once, and after each pass" if self.at_once else "after each pass"


PUBLICATION = "publication"
IMAGE = "image"

RULES: tuple[Rule, ...] = (
    Rule(PUBLICATION, "pub-lmt's steps, and cleaning the log one term behind snd-pos (or a "
         "slower spy)", PYTHON,
         "limit_in_c",
         "ACTIVE, connected, taking offers, no credit stop",
         "close (DRAINING), the connection lost, the governor refusing offers, the drain's "
         "credit stop",
         at_once=True, written_once="ss_publication_limit_step"),
    Rule(PUBLICATION, "heartbeats (EOS-flagged from the end of stream)", C, "heartbeat_in_c",
         "the first SM came, not DONE; through a socket or the simulator's virtual send",
         "DONE (the Python half only sets the flag and `end_of_stream`, and makes the first EOS "
         "heartbeat due at once)",
         at_once=False, written_once="ss_publication_heartbeat"),
    Rule(PUBLICATION, "status messages: snd-lmt", PYTHON, "sm_in_c",
         "ACTIVE, connected, `fc=unicast`, no `rc=`, one live receiver, no SETUP elicited; "
         "per SM, a valid one from that receiver's bound address (§5.7) with no flags and no "
         "group tag",
         "any of those ending; any other SM goes up to Python",
         at_once=False, written_once="ss_publication_status_message"),
    Rule(PUBLICATION, "the liveness timer of the receiver whose SMs C takes", PYTHON, "sm_in_c",
         "with the status messages (Python is due when it expires)",
         "with the status messages",
         at_once=False, written_once="ss_publication_receiver_deadline"),
    Rule(PUBLICATION, "answering NAKs", C, "retransmit_delay_ns",
         "no `retransmit_unicast_delay`; until DONE (`answers_naks`)",
         "a delay (every NAK waits on Python's timer); DONE",
         at_once=False,
         set_elsewhere="when made (RetransmitHandler)", written_once="ss_retransmit_on_nak"),
    Rule(IMAGE, "the rebuild pass: gaps, NAK timers, NAKs, the loss report", PYTHON,
         "rebuild_in_c",
         "reliable, unicast NAK delay, static cc, not left behind, INIT/ACTIVE/DRAINING; "
         "and C's: a loss detector, a subscriber, no EOS heartbeat, not `python_on_data`",
         "left behind, LINGER, an EOS heartbeat, the last subscriber gone",
         at_once=True, c_predicate="ss_image_rebuilt_in_c",
         written_once="ss_image_track_rebuild"),
    Rule(IMAGE, "status messages: the 25 % rule's and the timer's", PYTHON, "sm_in_c",
         "as the rebuild pass, and ACTIVE",
         "DRAINING (SMs carry EOS), and as the rebuild pass; an SM C could not send "
         "(`sm_unsent`) goes from Python",
         at_once=True, c_predicate="ss_image_sends_status_messages",
         written_once="ss_image_status_message_due"),
    Rule(IMAGE, "status messages: the catch-up rule's (a tagged image whose subscribers "
         "consumed all it received, at most one per `status_message_catch_up_interval`)",
         PYTHON, "sm_in_c",
         "with the status messages",
         "with the status messages; the Python half asks C's rule, which keeps the interval",
         at_once=True, c_predicate="ss_image_catch_up_due",
         written_once="ss_image_status_message_due"),
    Rule(IMAGE, "cleaning the log behind the slowest subscriber", PYTHON, "sm_in_c",
         "with the status messages (and a cleaner)",
         "with the status messages",
         at_once=True, c_predicate="ss_image_python_due_position",
         written_once="ss_image_clean"),
    Rule(IMAGE, "the liveness timer (no packet for `image_liveness_timeout`)", PYTHON,
         "sm_in_c",
         "with the status messages (Python is due when it expires, and moves the state)",
         "with the status messages",
         at_once=True, c_predicate="ss_image_sends_status_messages",
         written_once="ss_image_liveness_deadline"),
    Rule(IMAGE, "data that arrives in order (no pass for it)", C, "python_on_data",
         "static cc, a subscriber",
         "congestion control to consult, no subscriber (SMs follow rcv-pos): a pass per "
         "arrival",
         at_once=True, written_once="ss_receiver_on_datagram"),
)


def rules_of(stream: str) -> tuple[Rule, ...]:
    return tuple(rule for rule in RULES if rule.stream == stream)


def flags_set_by_sync(stream: str) -> frozenset[str]:
    """The flags the stream's one function (``sync_c_half``) sets, and nothing else does."""
    return frozenset(rule.flag for rule in rules_of(stream) if not rule.set_elsewhere)


def markdown() -> str:
    """The table as docs/ARCHITECTURE.md shows it."""
    lines = ["| stream | rule | by default | flag | the C half runs it while | handed back by "
             "| flag set | C's last word | written once |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rule in RULES:
        predicate = f"`{rule.c_predicate}`" if rule.c_predicate else ""
        once = f"`{rule.written_once}`" if rule.written_once else "no: a copy in each half"
        lines.append(f"| {rule.stream} | {rule.rule} | {rule.default} | `{rule.flag}` | "
                     f"{rule.c_runs_it} | {rule.handed_back} | {rule.when_set()} | {predicate} "
                     f"| {once} |")
    return "\n".join(lines) + "\n"


# -- who may touch what: the threads --------------------------------------------------------
#: The threads (and the two kinds of shared state) that a stream object's fields and methods
#: belong to, as aeron_network_publication.h groups its fields.  The conductor makes a
#: publication or an image, then hands it to its agent with a command; from then on,
#: :data:`OWNERS` says who may touch what each owner has.
CONDUCTOR = "conductor"
SENDER = "sender"
RECEIVER = "receiver"
RESOLVER = "resolver"
FIXED = "fixed"
SAMPLED = "sampled"

#: owner -> who may touch what it has, in the order docs/ARCHITECTURE.md shows them.
OWNERS: dict[str, str] = {
    FIXED: "set as it is made, never changed: any thread reads it",
    SAMPLED: "a counter, or a word or snapshot its owner publishes whole: any thread reads "
             "it, a sample's worth (never a collection the owner changes)",
    CONDUCTOR: "the conductor's thread alone",
    SENDER: "the sender's thread alone (its Python half, and its C half's words)",
    RECEIVER: "the receiver's thread alone",
    RESOLVER: "one of the resolver's pool of threads (daemon/media/names.py): what it resolves "
              "alone",
}


def _owned(**groups: str) -> dict[str, str]:
    """``owner="name name ..."`` -> {name: owner}, each name once."""
    table: dict[str, str] = {}
    for owner, names in groups.items():
        for name in names.split():
            assert name not in table, f"{name} is in two groups"
            table[name] = owner
    return table


#: Every public field and method of
#: :class:`~slipstream.daemon.streams.publication.NetworkPublication`, by owner.
PUBLICATION_THREADS: dict[str, str] = _owned(
    fixed="""identity session_id stream_id initial_term_id term_length position_bits mtu
        term_window_length params destination is_group is_unicast linger_timeout_ns
        connection_timeout_ns unblock_timeout_ns signal_eos response_correlation_id priority
        spies_simulate_connection positions publisher_limit log counters""",
    sampled="sender_position sender_limit status c_acknowledged has_data_ready is_rate_limited",
    conductor="spy_hold",  # lowered while a spy links; the C half reads it (network.h)
    sender="""c cleaner close stop_credit add_spy remove_spy apply_pressure_step
        datagrams_to_send due next_deadline_ns next_due_ns python_deadline_ns
        python_send_position on_data_sent on_frame on_peer_handshake admits_status_message
        take_c_status_messages
        sync_c_half
        publish_status state is_done is_connected is_flushed is_end_of_stream
        has_initial_connection has_live_receiver has_receiver_at
        has_receivers has_received_unicast_eos learns_destinations credit_stop_position
        eos_heartbeats_sent flow_control rate_control durable retransmit_handler refusals
        setups
        spies_released spy_count consumer_position active_term_id term_offset""",
)

#: Every public field and method of :class:`~slipstream.daemon.streams.image.PublicationImage`,
#: by owner.
IMAGE_THREADS: dict[str, str] = _owned(
    fixed="""identity session_id stream_id initial_term_id term_length mtu position_bits
        join_position wants_response log positions counters""",
    # window: an int the receiver rebinds as congestion control moves it (Aeron's
    # nextSmReceiverWindowLength, which its conductor reads the same way).
    sampled="rcv_pos rcv_hwm window has_been_heard",
    receiver="""c cleaner congestion_control loss_detector rate_signaller state is_done
        is_end_of_stream left_behind add_subscriber_position remove_subscriber_position
        subscriber_count min_subscriber_position set_response_session attach_paths
        control_address control_datagrams datagrams_to_send due next_deadline_ns
        python_deadline_ns drop_connection end_without_subscribers leave on_rate_announce
        missed_before_join
        on_rttm seed_connection sync_c_half status_interval_factor
        status_message_due_position status_message_timeout_ns last_sm_position
        liveness_timeout_ns group_tag is_group reliable receiver_id source""",
)

#: Every public method of :class:`~slipstream.daemon.media.names.NameCache` (its answers:
#: no lock, for nothing else touches them) and
#: :class:`~slipstream.daemon.media.names.NameResolver`, by owner, with ``resolve``: the
#: blocking resolution itself, which a resolver's thread runs, never the conductor's.
NAME_THREADS: dict[str, dict[str, str]] = {
    "NameCache": _owned(conductor="unresolved store lookup"),
    "NameResolver": _owned(conductor="submit answered close"),
    "resolve": _owned(resolver="resolve"),
}

#: What the conductor's thread may touch of a handed-over stream object.
CONDUCTOR_MAY = frozenset((CONDUCTOR, FIXED, SAMPLED))

#: How the code of a stream object heads each section of its ``__init__`` and of its methods
#: (``# -- <heading>: <what>``): by the owner of what follows, as the tables have it.
SECTION_HEADINGS: dict[str, str] = {
    FIXED: "fixed at creation",
    SAMPLED: "sampled",
    CONDUCTOR: "the conductor thread's",
    SENDER: "the sender thread's",
    RECEIVER: "the receiver thread's",
    RESOLVER: "a resolver thread's",
}


def threads_markdown() -> str:
    """:data:`PUBLICATION_THREADS`, :data:`IMAGE_THREADS` and :data:`NAME_THREADS` as
    docs/ARCHITECTURE.md shows them: a row per object and owner."""
    lines = ["| object | owner | who may touch it | fields and methods |", "|---|---|---|---|"]
    tables = ((PUBLICATION, PUBLICATION_THREADS), (IMAGE, IMAGE_THREADS),
              *((f"names: `{name}`", table) for name, table in NAME_THREADS.items()))
    for stream, table in tables:
        for owner, meaning in OWNERS.items():
            names = ", ".join(f"`{name}`" for name, o in table.items() if o == owner)
            if names:
                lines.append(f"| {stream} | {owner} | {meaning} | {names} |")
    return "\n".join(lines) + "\n"
