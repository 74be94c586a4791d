"""The sender side of one network stream: a sans-I/O state machine (aeron_network_publication.c).

:class:`NetworkPublication` takes SMs, NAKs, RTTMs and ERRs addressed to it and owns the
sender limit (flow control), the publisher limit (``pub-lmt``, the cell the client's appender
checks) and the publication's states and timers.  It never reads a clock: every call takes
``now_ns`` and :meth:`NetworkPublication.next_deadline_ns` says when to call again.

Heartbeats are the C half's alone (``heartbeat_in_c``, which :meth:`NetworkPublication.sync_c_half`
sets once the first SM came): one when 100 ms passed since the last data or heartbeat, flags
0xE0 (EOS) once the closed publication has sent all (``end_of_stream``), the first of those
at once (the transition to LINGER makes the C half's timer due).

The data itself never passes through Python: the sender agent hands :attr:`NetworkPublication.c`
(an ``ss_send_publication_t``) to the C data path (``ss_send_data``), which scans committed
frames from ``snd-pos`` up to ``snd-lmt`` (at most one MTU per datagram; a PAD frame goes out
as its 32-byte header and the position jumps over the padding), sends them and advances
``snd-pos``; the agent then calls :meth:`NetworkPublication.on_data_sent`.  Positions are
int64 cells (counters): ``snd-pos`` and ``snd-lmt`` and ``pub-lmt`` (:class:`SenderPositions`).

What goes out of :meth:`NetworkPublication.datagrams_to_send`, in Aeron's order:

1. SETUP every 100 ms until the first SM, and again while a receiver elicits it (S-flag SM)
   until it has live receivers, backed off while receivers refuse the image with ERRs
   (:mod:`~slipstream.daemon.streams.setups`, :mod:`~slipstream.daemon.streams.refusals`);
2. RTTM replies;
3. with ``rc=``, the rate-control announcement every second and at once to a new receiver
   (:mod:`~slipstream.daemon.streams.rate`).  Its NAK-strength signals set the send-rate
   limit that the C data path enforces per datagram.

Retransmits (from NAKs, through :class:`RetransmitHandler`) are spans of the log queued on
:attr:`NetworkPublication.c`: the data path sends them ahead of new data, in its own
``sendmmsg``.

States: :data:`~slipstream.daemon.streams.states.PUBLICATION_TRANSITIONS`, the only place
they change being :meth:`NetworkPublication._transition`.

Connection (docs/DRIVER.md §3.3, §5): a receiver is live while its SMs arrive within
``publication_connection_timeout`` (5 s; :mod:`~slipstream.daemon.streams.receivers`).  The
publication is *connected* while it has live receivers that flow control accepts; then
``pub-lmt = snd-pos + term window`` and the log is cleaned one term behind ``snd-pos`` (a
chunk at a time, :class:`LogCleaner`); the sender's C half runs that rule itself while it may
(``limit_in_c``).  Not connected: ``log.is_connected = False`` and ``pub-lmt = snd-pos`` (the
publisher gets NOT_CONNECTED / BACK_PRESSURED).

Spies (:meth:`NetworkPublication.add_spy`, :mod:`~slipstream.daemon.streams.spies`) read the
log in place and hold pub-lmt and cleaning back as snd-pos does, never the sender.

Who runs which rule, this object or the C half, is :mod:`~slipstream.daemon.streams.ownership`'s
table; the flags that hand them to the C half are set in
:meth:`NetworkPublication.sync_c_half` only.  Which thread may touch each field and method is
its table :data:`~slipstream.daemon.streams.ownership.PUBLICATION_THREADS`: the class sets its
fields, and defines its methods, in sections headed by that owner.

Units: times in ns (monotonic), positions/offsets/lengths in bytes.
"""

from __future__ import annotations

import ipaddress

import attrs

from slipstream.client._native import ffi, lib
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import ErrorFrame, Nak, RateSignal, Rttm, StatusMessage
from slipstream.client.layout import NO_DEADLINE
from slipstream.client.logbuffer import (
    LogBuffer,
    OfOneLog,
    compute_term_id,
    max_message_length,
    unblock,
)
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.flow_control import FlowControl
from slipstream.daemon.flow.registry import rate_control_for
from slipstream.daemon.pressure.governor import COALESCE_NS, TOP_STEP
from slipstream.daemon.protocol.log_cleaner import LogCleaner
from slipstream.daemon.protocol.params import PublicationParams
from slipstream.daemon.protocol.retransmit import RetransmitBudget, RetransmitHandler
from slipstream.daemon.protocol.types import Address, Datagram, ProtocolCounters
from slipstream.daemon.streams.durable import DurablePosition
from slipstream.daemon.streams.rate import PublicationRateControl
from slipstream.daemon.streams.receivers import PublicationReceivers, PublicationStatus
from slipstream.daemon.streams.refusals import PublicationRefusals
from slipstream.daemon.streams.setups import PublicationSetups
from slipstream.daemon.streams.spies import PublicationSpies
from slipstream.daemon.streams.states import (
    PUBLICATION_TRANSITIONS,
    PublicationState,
    next_state,
)

#: AERON_NETWORK_PUBLICATION_HEARTBEAT_TIMEOUT_NS.
HEARTBEAT_TIMEOUT_NS = network.SS_HEARTBEAT_TIMEOUT_NS
#: An idle publication's looks for a blocked publisher fall on whole this-many-ths of the
#: unblock timeout (see NetworkPublication._blocked_look_ns): 470 ms at the default 15 s,
#: so a thousand idle streams cost the sender about two Python passes a second.
BLOCKED_LOOK_GRAINS = 32
#: ``ss_publication_limit_step``'s cap below every position: offers refused, cleaning only.
_REFUSING = -NO_DEADLINE


@attrs.frozen
class SenderPositions:
    """The position cells of one network publication (cffi ``int64_t *``, counters of the
    counters file in the driver): ``pub-lmt`` (the appender reads it), ``snd-pos`` and
    ``snd-lmt`` (copies of the publication's private cells, which the C data path and flow
    control move: network.h, ss_publish_position); with ``rc=``, ``snd-rate``
    (the send-rate limit in bytes/s, 0 for none; None without ``rc=``); with a strategy that
    tracks receivers (min, tagged), ``fc-receivers`` (how many; None otherwise); with
    ``durable=``, ``pub-durable`` and ``durable-rcv`` (None otherwise)."""

    publisher_limit: object
    sender_position: object
    sender_limit: object
    sender_rate_limit: object = None
    flow_control_receivers: object = None
    durable_position: object = None
    durable_receivers: object = None

    @classmethod
    def in_process(cls) -> SenderPositions:
        """Cells in this process's memory, for tests."""
        return cls(*(ffi.new("int64_t *") for _ in range(7)))


class NetworkPublication(OfOneLog):
    """Sender state of one (session, stream) on a UDP channel.  See the module docstring."""

    def __init__(self, *, log: LogBuffer, params: PublicationParams, settings: DriverSettings,
                 positions: SenderPositions, flow_control: FlowControl,
                 counters: ProtocolCounters, now_ns: int, destination: Address) -> None:
        """``log`` was made with ``params``; ``settings`` give the timers; ``destination`` is
        the endpoint (unicast) or the data group (multicast)."""
        if (params.term_length, params.mtu) != (log.term_length, log.mtu):
            raise ValueError(f"the log ({log.term_length}, mtu {log.mtu}) was not made with "
                             f"these parameters ({params.term_length}, mtu {params.mtu})")
        # -- fixed at creation: any thread reads them --------------------------------------
        self.log = log
        self.params = params
        self.counters = counters
        self.destination = destination
        self.positions = positions
        self.publisher_limit = positions.publisher_limit
        self.identity = log.identity  # its fields are this object's attributes too
        self.position_bits = log.position_bits
        self._mask = log.term_length - 1
        window = params.term_window_length
        self.term_window_length = window
        self._trip_gain = window // 8
        self.linger_timeout_ns = params.linger_timeout_ns
        self.connection_timeout_ns = settings.publication_connection_timeout
        self.unblock_timeout_ns = settings.publication_unblock_timeout
        self.signal_eos = params.signal_eos
        self.is_group = params.group
        self.is_unicast = not self.is_group
        #: DATA goes to a multicast group (not to one receiver).
        self._to_group = _is_multicast(destination[0])
        #: response-correlation-id= (docs/CHANNELS.md §7.6): a request publication's response
        #: subscription (RSP_SETUP names it to the conductor), or a response publication's
        #: request image; None without.
        self.response_correlation_id = params.response_correlation_id
        #: priority= of its URI: its band in the sender's round robin (docs/BACKPRESSURE.md).
        self.priority = params.priority
        #: ssc=true: its spies connect it as receivers would, and while it has no receiver
        #: they move snd-pos on (Aeron's spiesSimulateConnection).
        self.spies_simulate_connection = params.spies_simulate_connection

        # -- sampled: counters and words the sender publishes; any thread reads them -------
        join = log.producer_position()
        lib.ss_store_release_i64(positions.publisher_limit, join)
        # snd-pos and snd-lmt live in the driver's own memory: their counters, which every
        # client maps writable, are copies (network.h, ss_publish_position).
        self._snd_pos = network_ffi.new("int64_t *")
        self._snd_lmt = network_ffi.new("int64_t *")
        self._snd_lmt_counter = positions.sender_limit
        network.ss_publish_position(self._snd_pos, positions.sender_position, join)
        network.ss_publish_position(self._snd_lmt, positions.sender_limit, join)
        #: What the drain reads on the conductor's thread (publish_status).
        self.status = PublicationStatus()

        # -- the conductor thread's --------------------------------------------------------
        #: The conductor's to lower while it links a spy (the join position), the C half's to
        #: read (network.h, spy_hold); NO_DEADLINE while no link is pending.
        self.spy_hold = network_ffi.new("int64_t *", NO_DEADLINE)

        # -- the sender thread's: the C half's struct and the strategies -------------------
        self.flow_control = flow_control
        #: What the C data path (``ss_send_data``) works from; the send endpoint sets ``fd``
        #: and the destination when it takes the publication on.
        self.c = c = network_ffi.new("ss_send_publication_t *")
        c.log = log.address
        c.sender_position = self._snd_pos
        c.sender_limit = self._snd_lmt
        c.sender_position_counter = positions.sender_position
        c.sender_limit_counter = positions.sender_limit
        c.bytes_sent = counters.address(SystemCounter.BYTES_SENT)
        c.short_sends = counters.address(SystemCounter.SHORT_SENDS)
        c.send_errors = counters.address(SystemCounter.SEND_ERRORS)
        c.time_of_last_send_ns = now_ns - HEARTBEAT_TIMEOUT_NS
        self.identity.copy_into(c)
        c.mtu = log.mtu
        c.fd = -1
        c.virtual_room = -1  # without a socket: as many datagrams as it sends
        c.meta = log.meta
        c.max_message_length = max_message_length(log.term_length)
        c.signal_eos = int(self.signal_eos)
        c.priority = params.priority
        c.status_messages_received = counters.address(SystemCounter.STATUS_MESSAGES_RECEIVED)
        c.heartbeats_sent = counters.address(SystemCounter.HEARTBEATS_SENT)
        c.connection_timeout_ns = self.connection_timeout_ns
        c.nak_unknown_source_drops = counters.address(SystemCounter.NAK_UNKNOWN_SOURCE_DROPS)
        c.control_source_count = 0  # no receiver yet: no NAK counts
        self._c_sm_seen = 0  # the C control path's SMs already taken (sm_count)
        self.retransmit_handler = RetransmitHandler(
            c, counters=counters, delay_ns=settings.retransmit_unicast_delay,
            # A group's receivers NAK a loss at random times up to nak_multicast_max_backoff
            # apart, each unaware of the others: the linger covers that spread.
            linger_ns=(max(settings.retransmit_unicast_linger, settings.nak_multicast_max_backoff)
                       if self.is_group else settings.retransmit_unicast_linger),
            has_group_semantics=self.is_group,
            max_resend=params.max_resend,
            budget=RetransmitBudget(settings.retransmit_budget_percent,
                                    settings.retransmit_budget_interval, window, join, now_ns))
        self.retransmit_handler.set_resend_lookahead(
            flow_control.retransmission_lookahead(log.mtu))
        self.cleaner = LogCleaner(log, join)
        # pub-lmt's rule, which the C half runs too while limit_in_c (sync_c_half).
        c.publisher_limit = positions.publisher_limit
        c.last_publisher_limit = join
        c.term_window_length = window
        c.trip_gain = self._trip_gain
        c.cleaner = self.cleaner.c
        c.spy_hold = self.spy_hold
        c.spy_python_position = NO_DEADLINE
        #: NAK-strength send-rate adaptation (rc=), None without: the strategy of ``_rate``.
        self.rate_control = rate_control_for(params, now_ns, join)

        # -- the sender thread's: state, receivers and spies -------------------------------
        self.state = PublicationState.ACTIVE
        self._refusing_offers = False
        self._spies = PublicationSpies(c, log)
        #: Set as a closed publication that has spies reaches LINGER (they read it all): the
        #: sender tells the conductor, which ends their images (Aeron's cleanupSpies).
        self.spies_released = False
        self.has_initial_connection = False
        #: Its endpoint learns destinations from status messages (dynamic
        #: multi-destination-cast): they all come to Python, which keeps them alive.
        self.learns_destinations = False
        self.is_end_of_stream = False
        self.has_received_unicast_eos = False
        #: Set when the driver drains (SIGTERM): pub-lmt never rises past it again (bytes).
        self.credit_stop_position: int | None = None
        self._connected = False
        log.is_connected = False
        # At most half the connection timeout: a receiver that moved is bound anew before
        # the publication (and its image, by its own liveness) counts it gone.
        self._receivers = PublicationReceivers(min(settings.receiver_rebind_timeout,
                                                   self.connection_timeout_ns // 2))
        #: durable=: the position its tagged receivers consumed to (None without).
        self.durable = (DurablePosition(params.durable, params.durable_receiver_timeout_ns,
                                        join, term_length=self.term_length, mtu=self.mtu)
                        if params.durable is not None else None)
        self._publish_durable()
        #: Its SETUPs (the first at once), and its receivers' ERRs, which may back them off.
        self.setups = PublicationSetups(c, log, params, flow_control, destination, now_ns)
        self.refusals = PublicationRefusals(self._receivers, self.setups, counters,
                                            2 * settings.status_message_timeout)
        #: With rc=: its announcements, the signals it heeds, its limit handed to the C half.
        self._rate = (PublicationRateControl(
            self.rate_control, c, log=log, limit_cell=positions.sender_rate_limit,
            receivers=self._receivers, flow_control=flow_control, counters=counters,
            destination=destination, now_ns=now_ns) if self.rate_control is not None else None)

        # -- the sender thread's: timers ---------------------------------------------------
        self._status_message_deadline_ns = NO_DEADLINE
        self._linger_start_ns = 0
        self._outbox: list[Datagram] = []  # RTTM replies made in on_frame
        self._now_ns = now_ns
        self._next_due_ns = now_ns  # next_deadline_ns() as of the last datagrams_to_send
        self._last_sender_position = join  # and when it last moved: _check_for_blocked_publisher
        self._time_of_last_sender_progress_ns = self._time_of_last_blocked_check_ns = now_ns
        self._seen_held = False  # the last check saw snd-pos behind the producer

    # -- sampled: counters and words the sender publishes; any thread reads them -----------
    @property
    def sender_position(self) -> int:
        """snd-pos: everything before it has been sent (bytes)."""
        return self._snd_pos[0]

    @property
    def sender_limit(self) -> int:
        """snd-lmt: flow control lets data go out up to here (bytes)."""
        return self._snd_lmt[0]

    @sender_limit.setter
    def sender_limit(self, position: int) -> None:
        network.ss_publish_position(self._snd_lmt, self._snd_lmt_counter, position)

    @property
    def is_rate_limited(self) -> bool:
        """Its sends are paced by a send-rate limit (``rc=``) now: a word its sender writes."""
        return self.c.rate_limit > 0

    def has_data_ready(self) -> bool:
        """Retransmissions are queued, or a committed frame at snd-pos fits in the window: what
        the C data path would send next (``ss_has_data_ready``, a parking thread's last look
        after it told publishers to wake it)."""
        return self.state is not PublicationState.DONE and bool(network.ss_has_data_ready(self.c))

    def c_acknowledged(self) -> tuple[int, int] | None:
        """(receiver id, position) of the last status message the C half took (``sm_in_c``)
        since the receiver it takes them from was last chosen, or None: words the C half
        writes, read from any thread.  Read twice around the position: the sender's
        thread may choose another receiver meanwhile (it zeroes the count, then names it)."""
        c = self.c
        receiver_id = c.sm_receiver_id
        position = c.sm_position
        if not c.sm_count or c.sm_receiver_id != receiver_id:
            return None
        return receiver_id, position

    # -- the sender thread's: the state machine, and the drain's credit stop ---------------
    def _transition(self, event: str, now_ns: int) -> None:
        self.state = next_state(PUBLICATION_TRANSITIONS, self.state, event)
        self.sync_c_half(within_pass=True)
        if self.state is PublicationState.LINGER:
            self._linger_start_ns = now_ns
            self.is_end_of_stream = True  # heartbeats now carry EOS (0xE0)
            # The first goes now, not a heartbeat timeout after the last data: a receiver
            # whose subscriber read to the end learns at once that nothing follows, and
            # lets the image's log go.
            self.c.time_of_last_send_ns = now_ns - HEARTBEAT_TIMEOUT_NS
            self.spies_released = bool(self._spies)
        elif self.state is PublicationState.DONE:
            self.retransmit_handler.stop()

    def close(self, now_ns: int, *, wait_for_spies: bool = True) -> None:
        """The last publisher went away: send what is in the log, then EOS, then linger.
        ``wait_for_spies=False`` (the driver's drain, which waited for its spies while it
        flushed): the linger does not wait for the spies to read the log to its end; it may
        be given to a publication closed already."""
        self._next_due_ns = 0
        if not wait_for_spies:
            self._spies.waited_for = False
        if self.state is PublicationState.ACTIVE:
            # Where its spies' images end (aeron_network_publication_decref): nothing is
            # offered after the last publisher went.
            self.log.end_of_stream_position = self.log.producer_position()
            self._transition("close", now_ns)
            self._conductor_duties(now_ns)

    def stop_credit(self) -> None:
        """The driver drains: offers from now on are back-pressured (pub-lmt at the position
        the log has reached; an offer already past its limit check may still land)."""
        position = self.log.producer_position()
        self.credit_stop_position = position
        self.sync_c_half(within_pass=True)
        if self._last_publisher_limit > position:
            self._set_publisher_limit(position)

    @property
    def is_flushed(self) -> bool:
        """The credit is stopped, everything the log holds was sent and every live receiver's
        status message is at its end (true without receivers: nobody is left to take it):
        :meth:`PublicationStatus.is_flushed_except`'s rule, on the sender's thread."""
        return self._status().is_flushed_except(
            frozenset(), end=self.log.producer_position(),
            sender_position=self.sender_position, c_acknowledged=self.c_acknowledged())

    def _status(self) -> PublicationStatus:
        return self._receivers.status(credit_stopped=self.credit_stop_position is not None,
                                      eos_heartbeats_sent=self.eos_heartbeats_sent)

    def publish_status(self) -> None:
        """Publish :attr:`status` for the drain (the sender's thread, after each pass).  Only
        once the credit is stopped: the drain, its only reader, waits for that first."""
        if self.credit_stop_position is not None:
            self.status = self._status()

    # -- the sender thread's: spies --------------------------------------------------------
    def add_spy(self, position_cell: object) -> None:
        """A spy (an ``aeron-spy:`` subscription of this host) reads the log in place from
        ``position_cell`` (a cffi ``int64_t *``, its sub-pos counter, which its client writes):
        from now on it holds pub-lmt and cleaning back as snd-pos does, and once the
        publication is closed its LINGER waits until the spy has read it all (Aeron's
        NetworkPublication.addSubscriber, a tethered spy).  The sender never waits for it.  On
        the sender's thread."""
        self._spies.add(position_cell)
        self._on_spies_changed()

    def remove_spy(self, position_cell: object) -> None:
        """The spy of ``position_cell`` went (its subscription closed, or its image ended):
        it holds nothing back from now on.  A cell not added is ignored."""
        if self._spies.remove(position_cell):
            self._on_spies_changed()

    def _on_spies_changed(self) -> None:
        """Look again at once: a closed publication may have waited only for the spy that
        went; one with ``ssc=true`` is connected by its spies."""
        self.c.spy_python_position = self._spy_python_position()
        self._next_due_ns = 0
        if self.spies_simulate_connection and self.state is PublicationState.ACTIVE:
            self._update_connected(self._now_ns)

    def _spies_connect(self) -> bool:
        """ssc=true and a spy: connected whatever the receivers (Aeron's
        spiesSimulateConnection)."""
        return self.spies_simulate_connection and bool(self._spies)

    def _spies_drive(self) -> bool:
        """Connected by its spies alone (no receiver): they, not sends, move snd-pos on."""
        return (self._spies_connect() and not self._receivers
                and self.state is PublicationState.ACTIVE)

    @property
    def spy_count(self) -> int:
        return len(self._spies)

    def consumer_position(self) -> int:
        """The position the log is consumed to (bytes), which pub-lmt and cleaning follow:
        the least of snd-pos, each spy's and the conductor's hold while it links one
        (``ss_publication_consumer_position``, which the C half's rule takes too)."""
        return network.ss_publication_consumer_position(self.c)

    def _spy_python_position(self) -> int:
        """:meth:`PublicationSpies.python_position
        <slipstream.daemon.streams.spies.PublicationSpies.python_position>` in this state."""
        return self._spies.python_position(draining=self.state is PublicationState.DRAINING,
                                           driving=self._spies_drive())

    # -- the sender thread's: properties ---------------------------------------------------
    @property
    def _last_publisher_limit(self) -> int:
        """The pub-lmt last published (bytes), by this half or the C half."""
        return self.c.last_publisher_limit

    @property
    def is_connected(self) -> bool:
        """A live receiver sent an SM within the connection timeout (and flow control has the
        receivers it requires)."""
        return self._connected

    @property
    def has_receivers(self) -> bool:
        return bool(self._receivers)

    def has_live_receiver(self, receiver_id: int) -> bool:
        """Whether ``receiver_id`` sent an SM within the connection timeout (and no EOS)."""
        return receiver_id in self._receivers

    def has_receiver_at(self, source: Address) -> bool:
        """Whether a live receiver's status messages came from ``source``."""
        return self._receivers.has_source(source)

    @property
    def is_done(self) -> bool:
        return self.state is PublicationState.DONE

    @property
    def term_offset(self) -> int:
        return self.sender_position & self._mask

    @property
    def active_term_id(self) -> int:
        return self._term_id(self.sender_position)

    def _term_id(self, position: int) -> int:
        return compute_term_id(position, self.position_bits, self.initial_term_id)

    # -- the sender thread's: input --------------------------------------------------------
    def on_frame(self, frame: object, source: Address, now_ns: int) -> None:
        """A decoded SM, NAK, RTTM or ERR frame for this publication from ``source``."""
        self.take_c_status_messages()
        self._now_ns = now_ns
        self._next_due_ns = 0
        if isinstance(frame, StatusMessage):
            self.counters.add(SystemCounter.STATUS_MESSAGES_RECEIVED)
            if not self.admits_status_message(frame, source, now_ns):
                return
            if not frame.is_setup_request:
                self._on_status_message(frame, source, now_ns)
            elif not self.is_end_of_stream:  # a SETUP asked for: not once EOS is signalled
                self.setups.on_request(frame, source, now_ns)
        elif isinstance(frame, Nak):
            self.counters.add(SystemCounter.NAK_MESSAGES_RECEIVED)
            if not self._receivers.has_source(source):
                # A NAK names no receiver: only a live receiver's address may ask for data.
                self.counters.add(SystemCounter.NAK_UNKNOWN_SOURCE_DROPS)
            elif self.state is not PublicationState.DONE:
                self.retransmit_handler.on_nak(frame.term_id, frame.term_offset, frame.length,
                                               now_ns)
        elif isinstance(frame, Rttm):
            if frame.is_reply:
                # Echo it (aeron_network_publication_on_rttm): same echo timestamp and id.
                # For multicast to the group, as Aeron (its channel's destination): a
                # receiver's socket is bound to the group, so an echo to its source address
                # would be dropped unread; each receiver takes only its own receiver_id's.
                reply = Rttm(self.session_id, self.stream_id, frame.echo_timestamp, 0,
                             frame.receiver_id, 0)
                self._outbox.append(Datagram(
                    reply.encode(), self.destination if self._to_group else source))
        elif isinstance(frame, RateSignal):
            self.counters.add(SystemCounter.RATE_SIGNALS_RECEIVED)
            if self._rate is not None:
                self._rate.on_signal(frame, source, now_ns)
        elif isinstance(frame, ErrorFrame) and not self.refusals.on_error(frame, source, now_ns):
            return  # it changes no receiver
        self._receivers.sync_c_sources(self.c)

    def admits_status_message(self, sm: StatusMessage, source: Address, now_ns: int) -> bool:
        """Whether a status message naming ``sm.receiver_id`` from ``source`` may count
        (:meth:`PublicationReceivers.admits
        <slipstream.daemon.streams.receivers.PublicationReceivers.admits>`): a live
        receiver's from another host is counted (``SM_SOURCE_MISMATCH_DROPS``) and
        dropped.  Its endpoint asks before anything else reads the SM (its destinations)."""
        self.take_c_status_messages()
        if self._receivers.admits(sm.receiver_id, source, now_ns):
            return True
        self.counters.add(SystemCounter.SM_SOURCE_MISMATCH_DROPS)
        return False

    def take_c_status_messages(self) -> None:
        """Record the status messages the C control path took since the last look (see
        ``sm_in_c``) as :meth:`_on_status_message` records one: the receiver's liveness, the
        position it acknowledged and its window."""
        c = self.c
        if c.sm_count == self._c_sm_seen:
            return
        self._c_sm_seen = c.sm_count
        taken_ns = c.sm_time_ns
        self._status_message_deadline_ns = network.ss_publication_receiver_deadline(c, taken_ns)
        self._receivers.on_c_status_message(c.sm_receiver_id, c.sm_position, taken_ns)
        self.refusals.on_status_message(c.sm_receiver_id, taken_ns)
        self.flow_control.receiver_window = c.sm_window
        self.retransmit_handler.set_resend_lookahead(
            self.flow_control.retransmission_lookahead(self.mtu))

    def sync_c_half(self, *, within_pass: bool = False) -> None:
        """The publication's one ownership function: what its C half runs until the next
        call, as the publication's rows of :data:`~slipstream.daemon.streams.ownership.RULES`
        say; nothing else sets its flags.  After a pass (the sender agent calls it for every
        publication): whether the C half moves pub-lmt (``limit_in_c``), sends the heartbeats
        (``heartbeat_in_c``) and takes the status messages (``sm_in_c``): the last while
        nothing of them needs Python (unicast flow control, which only raises snd-lmt to
        position + window, no rate control, active and connected to its one receiver; its
        other SMs, EOS, a SETUP request, another receiver, a group tag, come to Python); and
        when a send needs the Python half (``python_send_position``).

        ``within_pass``: an event of a pass that moves a rule set at once (``limit_in_c``: a
        transition, the connection, the governor's refusal, the credit stop) sets that rule
        only, so that a pass that fails after it does not leave the C half raising pub-lmt.
        The others wait for the end of the pass: the C control path may read them before it
        (the simulator hands a batch's SMs to Python one by one as it dispatches them)."""
        c = self.c
        c.limit_in_c = int(self._steps_limit_in_c())
        if within_pass:
            return
        sole = self._receivers.sole()
        take = (self.state is PublicationState.ACTIVE and self._connected
                and self.rate_control is None and self.flow_control.c_fast_path
                and sole is not None and not self.setups.elicited
                and not self.learns_destinations)
        c.python_send_position = self.python_send_position()
        c.spy_python_position = self._spy_python_position()
        c.heartbeat_in_c = int(self.has_initial_connection
                                and self.state is not PublicationState.DONE)
        c.end_of_stream = int(self.is_end_of_stream)
        if take and sole is not None:
            receiver_id, last_sm_ns = sole
            if receiver_id != c.sm_receiver_id:  # what C took was another receiver's
                c.sm_count = c.sm_position = self._c_sm_seen = 0
                c.sm_receiver_id = receiver_id
                c.sm_time_ns = last_sm_ns
            self._receivers.set_c_sm_source(c)
            # The C half's liveness rule reads it: an SM this half took counts too.
            c.sm_time_ns = max(c.sm_time_ns, last_sm_ns)
        c.sm_in_c = int(take)

    def on_peer_handshake(self, now_ns: int) -> None:
        """A peer of its encrypted endpoint just got its session (docs/CHANNELS.md §7.8),
        having dropped the SETUP that made it ask: while SETUPs are due, the next goes at
        once rather than a SETUP interval later."""
        self.setups.send_next_at(now_ns)
        self._next_due_ns = 0

    def _on_status_message(self, sm: StatusMessage, source: Address, now_ns: int) -> None:
        # What an honest receiver could report (ss_publication_status_message, docs/DRIVER.md
        # §3.3); anything else would let a stray or forged SM drive the sender past every
        # real receiver, or hold a drain on a position no receiver has: counted and dropped,
        # as the C half hands it here.
        window = network_ffi.new("int32_t *", sm.receiver_window)
        position = network.ss_publication_status_message(
            self.c, sm.consumption_term_id, sm.consumption_term_offset, window)
        if position == network.SS_SM_INVALID:
            self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        if position == network.SS_SM_AHEAD_OF_SENDER:
            self.counters.add(SystemCounter.SM_AHEAD_OF_SENDER_DROPS)
            return
        if window[0] != sm.receiver_window:
            sm = attrs.evolve(sm, receiver_window=window[0])
        self._status_message_deadline_ns = network.ss_publication_receiver_deadline(
            self.c, now_ns)
        if sm.is_eos:
            self._receivers.remove(sm.receiver_id)
            if self.is_unicast:
                self.has_received_unicast_eos = True
        else:
            self.refusals.on_status_message(sm.receiver_id)
            if self._rate is not None and sm.receiver_id not in self._receivers:
                self._rate.announce_at(now_ns)  # a new receiver: tell it to signal
            self._receivers.on_status_message(sm.receiver_id, position, source, now_ns,
                                              sm.receiver_window)
        if self.durable is not None and self.durable.on_status_message(
                sm.receiver_id, source, sm.group_tag, position, sm.is_eos, now_ns):
            self._publish_durable()
        self.has_initial_connection = True
        self.flow_control.sender_position = self.sender_position
        self.sender_limit = self.flow_control.on_status_message(
            sm, source, self.sender_limit, self.initial_term_id, self.position_bits, now_ns)
        self.retransmit_handler.set_resend_lookahead(
            self.flow_control.retransmission_lookahead(self.mtu))
        self._count_receivers()
        self._update_connected(now_ns)

    def _publish_durable(self) -> None:
        """Store the durable position and its receivers' count in their counters, then wake
        the publishers parked for it (``Publication.wait_durable``)."""
        durable = self.durable
        if durable is None or self.positions.durable_position is None:
            return
        lib.ss_store_release_i64(self.positions.durable_receivers, durable.receiver_count)
        lib.ss_store_release_i64(self.positions.durable_position, durable.position)
        self.log.signal_durable_waiters()

    def _count_receivers(self) -> None:
        cell = self.positions.flow_control_receivers
        if cell is not None:
            lib.ss_store_release_i64(cell, self.flow_control.receiver_count())

    # -- the sender thread's: output -------------------------------------------------------
    def on_data_sent(self, now_ns: int) -> None:
        """The C data path sent (new data, advancing snd-pos, or queued retransmissions): raise
        pub-lmt (cleaning first) and see whether a draining publication has sent everything."""
        self.take_c_status_messages()
        self._now_ns = now_ns
        state = self.state
        self._conductor_duties(now_ns)
        if self.state is not state or self._python_cleaning_behind():
            self._next_due_ns = 0

    def python_send_position(self) -> int:
        """The snd-pos from which a send needs :meth:`on_data_sent` (the agent's C half
        watches it): never while the C half moves pub-lmt, nor when not connected (status
        messages move it then); pub-lmt's next step of window/8 while otherwise ACTIVE
        (offers refused, or credit stopped); the end of the log while draining (then it is
        drained); never while lingering (its timers and SMs move it on)."""
        state = self.state
        if state is PublicationState.ACTIVE:
            if not self._connected or self._steps_limit_in_c():
                return NO_DEADLINE
            return self._last_publisher_limit + self._trip_gain - self.term_window_length
        if state is PublicationState.DRAINING:
            return self.log.producer_position()
        return NO_DEADLINE

    def python_deadline_ns(self) -> int:
        """The agent's deadline for this publication: :meth:`next_deadline_ns` without the
        timers the C half keeps.  :meth:`due` turns true by then too (a deadline of the agent
        that found no publication due would make a Python pass of every duty cycle)."""
        deadline = self.next_deadline_ns(c_timers=False)
        if deadline < self._next_due_ns:
            self._next_due_ns = deadline
        return deadline

    def _python_cleaning_behind(self) -> bool:
        """Cleaning is behind, and the Python half's to catch up: while ACTIVE and connected
        (what :meth:`_update_publisher_limit` runs in), unless the C half cleans.  A closed
        publication's log takes no more data: cleaning stops with it (a deadline of "now"
        there was a Python pass of every duty cycle until the stream went)."""
        return (self.state is PublicationState.ACTIVE and self._connected
                and self.cleaner.is_behind and not self._steps_limit_in_c())

    def _steps_limit_in_c(self) -> bool:
        """Whether the C half runs pub-lmt's rule (``c.limit_in_c``, which :meth:`sync_c_half`
        sets at once wherever this changes): ACTIVE and connected, taking offers, credit not
        stopped."""
        return (self.state is PublicationState.ACTIVE and self._connected
                and not self._refusing_offers and self.credit_stop_position is None)

    def due(self, now_ns: int) -> bool:
        """Whether :meth:`datagrams_to_send` has something to do at ``now_ns`` (cheap: the
        deadline as of the last call, moved earlier by any input since)."""
        return now_ns >= self._next_due_ns

    @property
    def next_due_ns(self) -> int:
        """When :meth:`due` turns true with no input (every timer, the C half's too; a parking
        thread waits for :meth:`python_deadline_ns` and the C half's own timers)."""
        return self._next_due_ns

    def datagrams_to_send(self, now_ns: int) -> list[Datagram]:
        """The control frames due at ``now_ns``; retransmissions whose delay expired are queued
        for the C data path, which sends the data (see the module docstring)."""
        self.take_c_status_messages()
        self._now_ns = now_ns
        out = self._outbox
        self._outbox = []
        if self.state is PublicationState.DONE:
            return out
        if not self.has_initial_connection or self.setups.elicited:
            self.setups.check(now_ns, out, has_receivers=bool(self._receivers))
        if self._rate is not None:
            self._rate.check(now_ns, out)
        self.flow_control.sender_position = self.sender_position
        self.sender_limit = self.flow_control.on_idle(
            now_ns, self.sender_limit, self.sender_position, self.is_end_of_stream)
        self._count_receivers()
        self._update_has_receivers(now_ns)
        if self.durable is not None and self.durable.expire(now_ns):
            self._publish_durable()
        self.retransmit_handler.process_timeouts(now_ns)
        self._conductor_duties(now_ns)
        if self.state is PublicationState.ACTIVE or self.state is PublicationState.DRAINING:
            self._check_for_blocked_publisher(now_ns)
        self._next_due_ns = self.next_deadline_ns()
        return out

    def _blocked_look_ns(self) -> int:
        """When an idle publication next looks for a blocked publisher: half the unblock
        timeout after the start of the BLOCKED_LOOK_GRAINS-th of the timeout its last look
        fell in, so that the looks of streams made at different times fall in one Python
        pass of the sender, not one pass each, still half a timeout apart (a look is at most
        a grain early, never late; a publisher found held still gets the whole timeout from
        that look)."""
        grain = max(1, self.unblock_timeout_ns // BLOCKED_LOOK_GRAINS)
        look = (self._time_of_last_blocked_check_ns // grain * grain
                + self.unblock_timeout_ns // 2)
        return -(-look // grain) * grain

    def _check_for_blocked_publisher(self, now_ns: int) -> None:
        """A publisher that died between claim and commit leaves a claimed frame (or a hole
        before later frames) at snd-pos, which the data path never passes: once snd-pos has
        not moved for ``unblock_timeout_ns`` while the log holds more, that frame becomes
        padding and the stream goes on (NetworkPublication.checkForBlockedPublisher).
        :func:`unblock` pads only an uncommitted frame: a sender held by flow control is left
        alone.  The timeout runs from the first check that saw snd-pos held (an idle
        publication's last progress may be long before a claim made now)."""
        sender_position = self.sender_position
        self._time_of_last_blocked_check_ns = now_ns
        behind = self.log.producer_position() > sender_position
        if sender_position != self._last_sender_position or not (behind and self._seen_held):
            self._last_sender_position = sender_position
            self._time_of_last_sender_progress_ns = now_ns
            self._seen_held = behind
        elif now_ns - self._time_of_last_sender_progress_ns > self.unblock_timeout_ns:
            if unblock(self.log, sender_position, self.log.producer_position()):
                self.counters.add(SystemCounter.UNBLOCKED_PUBLICATIONS)
            self._time_of_last_sender_progress_ns = now_ns

    @property
    def eos_heartbeats_sent(self) -> int:
        """Heartbeats the C half sent since the end of stream (a closed publication that sent
        all: flagged EOS unless the channel says ``eos=false``)."""
        return self.c.eos_heartbeats_sent

    # -- the sender thread's: liveness, limits and state (the conductor's duties in Aeron) ---
    def _update_has_receivers(self, now_ns: int) -> None:
        self._receivers.expire(now_ns, self.connection_timeout_ns)
        self._receivers.sync_c_sources(self.c)

    def _update_connected(self, now_ns: int) -> None:
        connected = ((bool(self._receivers) and self.flow_control.has_required_receivers()
                      and now_ns <= self._status_message_deadline_ns)
                     or self._spies_connect())
        if connected != self._connected:
            self._connected = connected
            self.sync_c_half(within_pass=True)
            if connected:
                # The limit first: an offer that sees the stream connected under the limit it
                # had while disconnected would record a hit and open a false episode.
                self._update_publisher_limit()
                self.log.is_connected = True
            else:
                self.log.is_connected = False
                # aeron_network_publication_update_pub_pos_and_lmt: no credit beyond snd-pos.
                self._set_publisher_limit(self.sender_position)
            self.log.signal_publishers()  # a publisher waiting to connect, or for credit

    def _update_publisher_limit(self) -> None:
        """pub-lmt's rule (``ss_publication_limit_step``, the C half's): clean toward one term
        behind the consumer position, then pub-lmt = that position + term window in steps of
        window/8 (Aeron's trip gain), never past what cleaning allows nor the drain's credit
        stop; while offers are refused, the cleaning alone."""
        cap = NO_DEADLINE if self.credit_stop_position is None else self.credit_stop_position
        network.ss_publication_limit_step(self.c, _REFUSING if self._refusing_offers else cap)

    def apply_pressure_step(self, step: int) -> bool:
        """The governor's step: from step 1 new data short of a datagram waits a little for
        more; at step 4 a publication of the lowest band (priority < 0) takes no new offers
        (its pub-lmt stays at the producer's position: BACK_PRESSURED); what it accepted
        still goes.  Returns whether its offers are refused or taken anew."""
        self.c.coalesce_ns = COALESCE_NS if step >= 1 else 0
        refusing = step >= TOP_STEP and self.priority < 0
        if refusing == self._refusing_offers:
            return False
        self._refusing_offers = refusing
        self.sync_c_half(within_pass=True)
        if refusing:
            self._set_publisher_limit(min(self._last_publisher_limit,
                                          max(self.log.producer_position(),
                                              self.sender_position)))
        elif self.state is PublicationState.ACTIVE and self._connected:
            self._update_publisher_limit()
        return True

    def _set_publisher_limit(self, limit: int) -> None:
        """Store pub-lmt and wake the publishers parked for credit (policy=block)."""
        self.c.last_publisher_limit = limit
        self.log.publish_limit(self.publisher_limit, limit)

    def _apply_errors(self, now_ns: int) -> None:
        """The ERRs whose grace passed with no SM of their receiver (``refusals.take_due``):
        those receivers rejected the image, and are gone."""
        due = self.refusals.take_due(now_ns)
        for frame in due:
            self.flow_control.on_error(frame, now_ns)
            self._count_receivers()
            self._receivers.remove(frame.receiver_id)
            if self.durable is not None and self.durable.on_error(frame.receiver_id):
                self._publish_durable()
        if due:
            self._update_connected(now_ns)
            self._receivers.sync_c_sources(self.c)

    def _conductor_duties(self, now_ns: int) -> None:
        self.take_c_status_messages()  # the receivers' liveness first
        self._apply_errors(now_ns)
        if self._connected and (now_ns > self._status_message_deadline_ns
                                or not self._receivers):
            self._update_has_receivers(now_ns)
            self._update_connected(now_ns)
        state = self.state
        if state is PublicationState.ACTIVE:
            if self._spies_drive():
                self._spies.follow()
            if self._connected:
                self._update_publisher_limit()
        elif state is PublicationState.DRAINING:
            end = self.log.producer_position()
            if ((end <= self.sender_position or not self._receivers)
                    and self._spies.consumed(end)):
                self._transition("drained", now_ns)
        elif state is PublicationState.LINGER:
            if self.has_received_unicast_eos:
                self._transition("unicast_eos", now_ns)
            elif now_ns - self._linger_start_ns >= self.linger_timeout_ns:
                self._transition("linger_expired", now_ns)

    # -- the sender thread's: timers -------------------------------------------------------
    def next_deadline_ns(self, *, c_timers: bool = True) -> int:
        """The earliest time :meth:`datagrams_to_send` has something to do; a value ``<=``
        the last ``now`` means "now" (cleaning to catch up, a drained publication to move on).
        ``c_timers=False``: the Python half's timers only (while the C half takes the SMs,
        it also keeps their receiver's liveness timer, ``c.sm_in_c``).
        NO_DEADLINE once DONE.  Data is not a timer, nor are queued retransmissions: the C
        data path sends both when the socket takes them (the sender agent's deadline says when
        that is; a timer of "now" here kept the simulator's clock from ever reaching the time
        a full link had room again)."""
        if self.state is PublicationState.DONE:
            return NO_DEADLINE
        now = self._now_ns
        if self._outbox or self._python_cleaning_behind():
            return now
        deadline = self.retransmit_handler.next_resend_ns()
        if not self.has_initial_connection or self.setups.elicited:
            deadline = min(deadline, self.setups.next_deadline_ns())
        deadline = min(deadline, self.flow_control.next_deadline_ns(),
                       self.refusals.next_deadline_ns())
        if self.durable is not None:
            deadline = min(deadline, self.durable.next_deadline_ns())
        if self._rate is not None:
            deadline = min(deadline, self._rate.next_deadline_ns())
        if c_timers or not self.c.sm_in_c:
            if self._connected:
                deadline = min(deadline, self._status_message_deadline_ns + 1)
            if self._receivers:
                deadline = min(deadline, 1 + network.ss_publication_receiver_deadline(
                    self.c, self._receivers.earliest_status_message_ns()))
        if self.state in (PublicationState.ACTIVE, PublicationState.DRAINING):
            # The blocked check: its timeout once held, else a look each half timeout.
            if self._seen_held:
                deadline = min(deadline, self._time_of_last_sender_progress_ns
                               + self.unblock_timeout_ns + 1)
            else:
                deadline = min(deadline, self._blocked_look_ns())
        if self.state is PublicationState.DRAINING:
            end = self.log.producer_position()
            if ((end <= self.sender_position or not self._receivers)
                    and self._spies.consumed(end)):
                deadline = min(deadline, now)  # drained: move to LINGER
        elif self.state is PublicationState.LINGER:
            deadline = min(deadline, now if self.has_received_unicast_eos
                           else self._linger_start_ns + self.linger_timeout_ns)
        return deadline

    def __repr__(self) -> str:
        return (f"<NetworkPublication session={self.session_id} stream={self.stream_id} "
                f"{self.state.name} snd-pos={self.sender_position} snd-lmt={self.sender_limit}"
                f" connected={self._connected}>")


def _is_multicast(host: str) -> bool:
    """Whether ``host`` (an address, as publications get it) is a multicast group."""
    try:
        return ipaddress.ip_address(host).is_multicast
    except ValueError:  # not an address: not a group
        return False
