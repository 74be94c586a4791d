"""The receiver side of one network stream: a sans-I/O state machine (aeron_publication_image.c).

A :class:`PublicationImage` is made for a SETUP that a receive channel
(:class:`~slipstream.daemon.media.receive_channel.ReceiveChannel`) reported (the conductor makes
the log and the position counters, so a receive loop never waits on a file).  The C data path
(``ss_receiver_on_datagram``, working from :attr:`PublicationImage.c`) copies DATA datagrams
straight into the image's log at their term offset (body first, header last with a release
store) and raises the receiver high-water mark ``rcv-hwm``; this object finds the gaps
between the rebuild position and the hwm (:class:`LossDetector`, up to 256) and NAKs them,
and tells the sender where its subscribers are with status messages.  Subscribers read the log
in place (``client.image.Image``) and publish their positions in int64 cells
(``sub-pos`` counters) that this object reads.  Frames for the image from an address other
than its SETUP's are dropped (FOREIGN_SOURCE_DROPS).

Receiving (docs/DRIVER.md §4.3, ``aeron_publication_image_insert_packet``, done in C):

* frames of terms before the initial term are dropped;
* over-run: ``position + length > last SM position + term_length/2`` → dropped
  (FLOW_CONTROL_OVER_RUNS);
* a heartbeat at ``position >= max(0, last SM position - term_length)`` raises the hwm and
  may carry EOS (flags 0xE0);
* under-run: DATA below the last SM position (already consumed) → dropped
  (FLOW_CONTROL_UNDER_RUNS);
* a PAD header (alone, or last after DATA frames) raises the hwm to the end of its term.

Rebuild pass (``aeron_publication_image_track_rebuild``; its one copy is the C half's
``ss_image_track_rebuild``, which :meth:`datagrams_to_send` runs after new data or when a
timer is due for an image the C half does not rebuild itself): scan from ``rebuild =
max(rcv_pos, max subscriber position)`` to the hwm, advance ``rcv_pos`` over complete
frames, NAK each gap after the
NAK delay (static 100 µs for unicast; optimal multicast backoff for group images), or pad it
for ``reliable=false`` (LOSS_GAP_FILLS).  Then an SM goes (the rules' one copy is the C
half's ``ss_image_status_message_due``, which this object runs too) when the minimum
subscriber position moved past ``last scheduled + window/4`` (the 25 % rule) or the window
changed, and one goes every ``status_message_timeout`` (200 ms) at the position subscribers
have reached by then.  An image with a group tag (``gtag=``, the
receivers that make messages durable, docs/CHANNELS.md §7.7) also sends one as soon as its
slowest subscriber consumed all it received (the catch-up rule, at most one per
``status_message_catch_up_interval``; the C half's, ``ss_image_catch_up_due``).  Window
(static congestion control) = ``min(rcv-wnd or 128 KiB, term_length/2)``.  For a reliable
unicast image with static congestion control the C half runs the rebuild pass
(``ss_image_rebuild``, the same rule) and sends the 25 % rule's, the catch-up rule's and the
timer's SMs and cleans the log (see :meth:`sync_c_half`);
this object then takes their output at its next pass and keeps liveness and end of stream.
Who runs which rule is :mod:`~slipstream.daemon.streams.ownership`'s table; the flags that
hand them to the C half are set in :meth:`PublicationImage.sync_c_half` only, and where the C
half has the last word this object asks it (``ss_image_rebuilt_in_c``,
``ss_image_sends_status_messages``, ``ss_image_python_due_position``).  Which thread may touch
each field and method is :data:`~slipstream.daemon.streams.ownership.IMAGE_THREADS`: the class
sets its fields, and defines its methods, in sections headed by that owner.

NAK-strength signals (``rc=`` on the sender, which announces it): each rebuild pass measures
how full the image is (what its slowest subscriber could have read and did not, against the
window) and signals the thresholds it crosses
(:class:`~slipstream.daemon.flow.rate_control.NakStrengthSignaller`); the C half wakes the
pass when the fill's top (``ss_image_rate_signal_top``) reaches the next threshold
(``rate_signal_position``).

States: :data:`~slipstream.daemon.streams.states.IMAGE_TRANSITIONS`, the only place they
change being :meth:`PublicationImage._transition`.

Units: times in ns, positions/offsets/lengths in bytes.
"""

from __future__ import annotations

import random

import attrs

from slipstream.client._native import ffi, lib
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
    RTTM_REPLY_FLAG,
    SM_EOS_FLAG,
    Nak,
    RateAnnounce,
    RateSignal,
    ResponseSetup,
    Rttm,
    Setup,
    StatusMessage,
)
from slipstream.client.layout import NO_DEADLINE, resend_reach
from slipstream.client.logbuffer import (
    LogBuffer,
    OfOneLog,
    compute_position,
    compute_term_id,
    write_padding,
)
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.flow.rate_control import NakStrengthSignaller
from slipstream.daemon.flow.registry import congestion_control_for
from slipstream.daemon.pressure.governor import widest_status_interval_ns
from slipstream.daemon.protocol.log_cleaner import LogCleaner
from slipstream.daemon.protocol.loss_detector import (
    LossDetector,
    OptimalMulticastDelayGenerator,
    StaticDelayGenerator,
)
from slipstream.daemon.protocol.params import SubscriptionParams
from slipstream.daemon.protocol.types import (
    Address,
    Datagram,
    ProtocolCounters,
    address_of,
    sockaddr,
)
from slipstream.daemon.reports.loss_report import LossEntry
from slipstream.daemon.streams.states import IMAGE_TRANSITIONS, ImageState, next_state


@attrs.frozen
class ImagePositions:
    """The position counters of one image (cffi ``int64_t *``, cells of the counters file in
    the driver): ``rcv-hwm`` and ``rcv-pos``, copies of the image's private cells, which the
    C data path and the rebuild pass move (network.h, ss_publish_position); and one cell for
    each of its congestion control's ``indicators`` (none: no counters for them)."""

    receiver_hwm: object
    receiver_position: object
    indicators: tuple[object, ...] = ()

    @classmethod
    def in_process(cls) -> ImagePositions:
        """Cells in this process's memory, for tests."""
        return cls(ffi.new("int64_t *"), ffi.new("int64_t *"))


class PublicationImage(OfOneLog):
    """Receiver state of one (session, stream) from one sender.  See the module docstring."""

    def __init__(self, *, log: LogBuffer, setup: Setup, params: SubscriptionParams,
                 settings: DriverSettings, receiver_id: int, counters: ProtocolCounters,
                 positions: ImagePositions, control_address: Address, source: Address,
                 now_ns: int, rng: random.Random, loss_entry: LossEntry | None = None,
                 destinations: int = 0, via: int = -1) -> None:
        """``log`` was created for ``setup`` (its term length, initial term id, join term and
        offset); SMs, NAKs and RTTM replies go to ``control_address`` (the SETUP's source for
        unicast, the control group for multicast).  ``params`` are the receive channel's;
        ``settings`` give the timers.

        ``destinations`` > 0: an image of a multi-destination subscription with that many
        destination slots (Aeron's ImageConnections): it takes data from any source, and its
        control frames go to every path whose data came within the liveness timeout
        (:meth:`control_datagrams`); the SETUP came through destination ``via`` from
        ``control_address``, the first such path."""
        # -- fixed at creation: any thread reads them --------------------------------------
        self.log = log
        self.counters = counters
        self.positions = positions
        self.identity = log.identity  # the SETUP's; its fields are this object's attributes too
        term_length = setup.term_length
        self.position_bits = log.position_bits
        self._mask = term_length - 1
        self.join_position = join = self._position(setup.active_term_id, setup.term_offset)
        cc = congestion_control_for(params, term_length, setup.mtu, now_ns)
        #: Its SETUP carried SEND_RESPONSE: a request stream, whose client wants a response
        #: publication made for it (docs/CHANNELS.md §7.6).
        self.wants_response = setup.wants_response
        self._made_ns = now_ns

        # -- sampled: counters the receiver publishes; any thread reads them ---------------
        # rcv-hwm and rcv-pos live in the driver's own memory: their counters, which every
        # client maps writable, are copies (network.h, ss_publish_position).
        self._rcv_hwm = network_ffi.new("int64_t *")
        self._rcv_pos = network_ffi.new("int64_t *")
        network.ss_publish_position(self._rcv_hwm, positions.receiver_hwm, join)
        network.ss_publish_position(self._rcv_pos, positions.receiver_position, join)
        #: The receiver window congestion control gives now (bytes): the receiver rebinds it,
        #: the conductor's untethered check reads it as a sample.
        self.window = cc.initial_window_length()

        # -- the receiver thread's: set as it is made --------------------------------------
        self.receiver_id = receiver_id
        self.control_address = control_address
        self.source = source
        self.reliable = params.reliable
        self.is_group = params.image_is_group(setup.is_group)
        self.group_tag = params.group_tag
        self.status_message_timeout_ns = settings.status_message_timeout
        self.liveness_timeout_ns = settings.image_liveness_timeout
        #: What a sender still resends behind its position (its resend window, docs/PROTOCOL.md
        #: §3.5): a receiver that lacks data further back than this is left behind.
        self._resend_reach = resend_reach(term_length)

        # -- the receiver thread's: the strategies, loss and cleaning ----------------------
        self.congestion_control = cc
        self._consults_congestion_control = not cc.is_static
        self._published_indicators: tuple[int, ...] = ()
        self._publish_indicators()
        self._status_interval_factor = 1  # the governor's (status_interval_factor)
        if self.is_group:
            generator: StaticDelayGenerator | OptimalMulticastDelayGenerator = (
                OptimalMulticastDelayGenerator(settings.nak_multicast_max_backoff,
                                               settings.nak_multicast_group_size, rng))
        else:
            delay = params.nak_delay_ns
            generator = StaticDelayGenerator(delay,
                                             delay * settings.nak_unicast_retry_delay_ratio)
        self.loss_detector = LossDetector(generator, adapt_retry=not self.is_group)
        self._loss_entry = loss_entry
        self.cleaner = LogCleaner(log, join)
        #: NAK-strength signals (rc=), once the sender announced it adapts to them.
        self.rate_signaller: NakStrengthSignaller | None = None

        # -- the receiver thread's: state and subscribers ----------------------------------
        self.state = ImageState.INIT
        self._time_of_last_state_change_ns = now_ns
        self.is_end_of_stream = False  # EOS seen and everything up to it rebuilt
        #: An EOS-flagged SM went (DRAINING's): the sender knows this receiver is done, so it
        #: ends its linger at once rather than after ``publication_linger_timeout``.
        self._sent_end_of_stream_sm = False
        #: ``(from, to)`` stream positions this image lost because it was left behind (under
        #: fc=max, or rc=, a slow receiver can fall out of the sender's resend window); None
        #: while it is not.  Its subscribers read up to ``from``, then the image goes and the
        #: stream is joined again where the sender is.
        self.left_behind: tuple[int, int] | None = None
        self._subscriber_positions: list = []  # cffi int64_t * cells
        #: The session of the response publication made for it, which RSP_SETUP tells the
        #: client's driver (set_response_session), until that publication is connected.
        self._response_session_id: int | None = None
        self._response_setup_deadline_ns = NO_DEADLINE
        self._outbox: list[Datagram] = []
        self._now_ns = now_ns
        self._next_due_ns = now_ns  # next_deadline_ns() as of the last datagrams_to_send

        # -- the receiver thread's: the C half's struct ------------------------------------
        #: What the C data path works from (ss_image_t): the last SM sent bounds what it
        #: accepts (over- and under-runs); it reports packets, the hwm and EOS back.
        self.c = c = network_ffi.new("ss_image_t *")
        c.log = log.address
        c.meta = log.meta
        c.receiver_hwm = self._rcv_hwm
        c.receiver_hwm_counter = positions.receiver_hwm
        c.receiver_position_counter = positions.receiver_position
        self.identity.copy_into(c)
        c.time_of_last_packet_ns = now_ns
        c.liveness_timeout_ns = self.liveness_timeout_ns
        c.eos_position = -1
        c.contiguous_position = join
        raw_source = sockaddr(source)
        c.source = raw_source
        # A multi-destination image hears its sender on several paths, each from its own
        # address (docs/CHANNELS.md §7.5): its data is checked by session, not by source.
        c.source_length = 0 if destinations else len(raw_source)
        self._connections = None
        if destinations:
            self._connections = network_ffi.new("ss_image_connection_t[]", destinations)
            for connection in self._connections:
                connection.fd = -1
            c.connections = self._connections
            c.connection_count = destinations
            self.seed_connection(via, control_address, now_ns)
        c.receiver_position = self._rcv_pos
        c.rate_signal_position = NO_DEADLINE
        c.overrun_position = join
        c.overrun_candidate = -1
        # The rebuild pass in C (ss_image_rebuild) for the images whose rules are all C's: a
        # static NAK delay (unicast) and no congestion control to consult (sync_c_half).
        c.loss = self.loss_detector.c
        if isinstance(generator, StaticDelayGenerator):
            c.nak_first_delay_ns = generator.first_delay()
            c.nak_retry_delay_ns = generator.retry_delay()
        c.loss_deadline_ns = NO_DEADLINE
        if loss_entry is not None:
            c.loss_entry = loss_entry.address
        raw_control = sockaddr(control_address)
        c.control_address = raw_control
        c.control_address_length = len(raw_control)
        c.control_fd = -1  # until a receive channel takes the image (ss_receiver_set_images)
        # The status-message rules' intervals: the timer's, and the catch-up rule's (a tagged
        # image's, ss_image_catch_up_due); their state is set below.
        c.sm_interval_ns = self.status_message_timeout_ns
        self._widest_sm_interval_ns = widest_status_interval_ns(
            self.status_message_timeout_ns, (settings.publication_connection_timeout,
                                             settings.flow_control_receiver_timeout))
        self._catch_up_interval_ns = settings.status_message_catch_up_interval
        c.sm_catch_up_interval_ns = self._catch_up_interval_ns
        c.window = self.window
        c.receiver_id = receiver_id
        if self.group_tag is not None:
            c.has_group_tag = 1
            c.group_tag = self.group_tag
        c.cleaner = self.cleaner.c  # the C half cleans with it while it sends the SMs
        c.reusable_limit = self.cleaner.reusable_limit()
        c.clean_due_position = NO_DEADLINE
        self._sync_subscribers_c()
        # The rules' state as an SM at the join position leaves it; the first SM is due at once.
        network.ss_image_status_message_taken(c, join, now_ns)
        c.sm_deadline_ns = c.sm_catch_up_ns = now_ns
        log.is_connected = True

    # -- sampled: counters the receiver publishes; any thread reads them -------------------
    @property
    def rcv_hwm(self) -> int:
        """The receiver high-water mark: the highest position data arrived for (bytes)."""
        return self.c.receiver_hwm[0]

    @property
    def rcv_pos(self) -> int:
        """The receiver position: everything below is in the log, no gap (bytes)."""
        return self._rcv_pos[0]

    @property
    def has_been_heard(self) -> bool:
        """Whether data or a heartbeat of its sender arrived since the image was made (the
        data path's liveness word moved): a sender, not only SETUPs, is there.  A word the
        receiver's C half stores whole."""
        return self.c.time_of_last_packet_ns > self._made_ns

    # -- the receiver thread's: paths of a multi-destination subscription ------------------
    def seed_connection(self, via: int, address: Address, now_ns: int, fd: int = -1) -> None:
        """A SETUP came through destination ``via`` (its socket ``fd``, -1: not known yet)
        from ``address``: that path is live, and its control frames go there (the data path
        keeps it so while data comes).  As Aeron's trackConnection, a path that has an address
        and was heard from within the liveness timeout keeps it: a SETUP from elsewhere does
        not redirect it."""
        connections = self._connections
        if connections is None or not 0 <= via < len(connections):
            return
        connection = connections[via]
        if (connection.address_length > 0
                and now_ns - connection.time_of_last_frame_ns <= self.liveness_timeout_ns):
            if connection.fd < 0:
                connection.fd = fd
            return
        raw = sockaddr(address)
        network_ffi.memmove(connection.address, raw, len(raw))
        connection.address_length = len(raw)
        connection.fd = fd
        connection.time_of_last_frame_ns = now_ns

    def attach_paths(self, fds: dict[int, int]) -> None:
        """The image starts receiving (on the receiver's thread): ``fds`` are the attached
        destinations' sockets by slot.  A path seeded before (its SETUP's) takes its
        destination's socket, so the C half sends its control frames; one whose destination
        was removed meanwhile is dropped."""
        connections = self._connections
        if connections is None:
            return
        for via, connection in enumerate(connections):
            if connection.address_length <= 0:
                continue
            fd = fds.get(via)
            if fd is None:
                self.drop_connection(via)
            else:
                connection.fd = fd

    def drop_connection(self, via: int) -> None:
        """Destination ``via`` was removed: nothing more goes that way (a destination added
        later in its slot starts afresh)."""
        connections = self._connections
        if connections is not None and 0 <= via < len(connections):
            connection = connections[via]
            connection.fd = -1
            connection.address_length = 0
            connection.time_of_last_frame_ns = 0

    def control_datagrams(self, data: bytes) -> list[Datagram]:
        """``data`` (a control frame) to where this image's control frames go: its control
        address, or for a multi-destination subscription's image each path heard from within
        the liveness timeout, through its destination (Aeron's ImageConnections)."""
        connections = self._connections
        if connections is None:
            return [Datagram(data, self.control_address)]
        now_ns = self._now_ns
        out = []
        for via, connection in enumerate(connections):
            length = connection.address_length
            if (0 < length <= network.SS_SOCKADDR_MAX
                    and now_ns - connection.time_of_last_frame_ns <= self.liveness_timeout_ns):
                address = address_of(bytes(network_ffi.buffer(connection.address, length)))
                out.append(Datagram(data, address, via))
        return out

    # -- the receiver thread's: positions --------------------------------------------------
    @property
    def last_sm_position(self) -> int:
        """The position of the last status message sent (bytes)."""
        return self.c.last_sm_position

    def status_message_due_position(self) -> int:
        """The subscriber position from which the image's Python half is due for its next SM
        (the 25 % rule's, which ``ss_image_status_message_taken`` sets; a left-behind image's
        end, once its pass is over): a parked receiver asks its subscribers to ring its
        doorbell there (bytes)."""
        return self.c.sm_due_position

    def _position(self, term_id: int, term_offset: int) -> int:
        return compute_position(term_id, term_offset, self.position_bits, self.initial_term_id)

    def _term_id(self, position: int) -> int:
        return compute_term_id(position, self.position_bits, self.initial_term_id)

    # -- the receiver thread's: subscribers (the conductor adds the first ones) ------------
    def add_subscriber_position(self, cell) -> None:
        """Track a subscriber's position (cffi ``int64_t *``); it should start at
        :attr:`join_position`."""
        self._subscriber_positions.append(cell)
        self._sync_subscribers_c()
        self._next_due_ns = 0
        if self.state is ImageState.INIT:
            self._transition("subscriber_added", self._now_ns)

    def remove_subscriber_position(self, cell) -> None:
        self._subscriber_positions = [c for c in self._subscriber_positions if c != cell]
        self._sync_subscribers_c()
        self._next_due_ns = 0
        if not self._subscriber_positions and self.state is ImageState.ACTIVE:
            self._transition("no_subscribers", self._now_ns)

    def leave(self, now_ns: int) -> None:
        """This receiver goes (its driver stops): an active image drains and an image still
        waiting for its first subscriber ends, either way telling its sender at once (an
        EOS-flagged status message, from the next :meth:`datagrams_to_send`)."""
        self._now_ns = now_ns
        if self.state is ImageState.ACTIVE:
            self._transition("no_subscribers", now_ns)
            self._next_due_ns = 0
        else:
            self.end_without_subscribers(now_ns)

    def end_without_subscribers(self, now_ns: int) -> None:
        """The stream's last subscription went before any subscriber joined: drain."""
        if self.state is ImageState.INIT:
            self._transition("liveness_timeout", now_ns)
            self._next_due_ns = 0

    def _sync_subscribers_c(self) -> None:
        """Give the C half the subscriber cells (the 25 % rule), and decide again what it
        runs (:meth:`sync_c_half`)."""
        cells = self._subscriber_positions
        self._c_cells = network_ffi.new("int64_t *[]", cells or 1)
        self.c.subscriber_positions = self._c_cells
        self.c.subscriber_count = len(cells)
        self.sync_c_half()

    def sync_c_half(self) -> None:
        """The image's one ownership function: what its C half runs, as the image's rows of
        :data:`~slipstream.daemon.streams.ownership.RULES` say; nothing else sets its flags.
        Called at once by every event that moves what decides them: a subscriber added or
        removed, a transition (:meth:`_transition`), left behind.

        * ``python_on_data``: every arrival needs the Python half: congestion control to
          consult, or no subscriber (the SMs then follow rcv-pos);
        * ``rebuild_in_c``: the rebuild pass, for a reliable image with a static NAK delay
          (not a group's random one) and no congestion control, not left behind, in a state
          that rebuilds;
        * ``sm_in_c``: the same while ACTIVE (a draining image's SMs carry EOS): the 25 %
          rule's and the timer's SMs, cleaning, the liveness timer.

        The C half adds conditions only it sees (a loss detector, subscribers, an EOS
        heartbeat): :meth:`_rebuilt_in_c` and :meth:`_sends_sm_in_c` ask it."""
        c = self.c
        c.python_on_data = int(self._consults_congestion_control
                               or not self._subscriber_positions)
        eligible = (self.reliable and not self.is_group and not self._consults_congestion_control
                    and self.left_behind is None)
        c.rebuild_in_c = int(eligible and self.state in (ImageState.INIT, ImageState.ACTIVE,
                                                         ImageState.DRAINING))
        c.sm_in_c = int(eligible and self.state is ImageState.ACTIVE)
        c.loss_deadline_ns = self.loss_detector.next_deadline_ns()
        self._sync_cleaning_c()

    @property
    def status_interval_factor(self) -> int:
        """The pressure governor's multiple of the status-message intervals (step 2): the
        keepalive interval widens no further than ``widest_status_interval_ns``; the
        catch-up rule's interval by the whole factor (an SM the keepalive timer sends moves
        both deadlines)."""
        return self._status_interval_factor

    @status_interval_factor.setter
    def status_interval_factor(self, factor: int) -> None:
        self._status_interval_factor = factor
        self.c.sm_interval_ns = min(self.status_message_timeout_ns * factor,
                                    self._widest_sm_interval_ns)
        self.c.sm_catch_up_interval_ns = self._catch_up_interval_ns * factor

    def _sends_sm_in_c(self) -> bool:
        """Whether the C half sends the SMs, cleans and keeps the liveness timer now: its own
        rule, asked (``ss_image_sends_status_messages``)."""
        return bool(network.ss_image_sends_status_messages(self.c))

    def _rebuilt_in_c(self) -> bool:
        """Whether the C half runs the rebuild pass now: its own rule, asked
        (``ss_image_rebuilt_in_c``)."""
        return bool(network.ss_image_rebuilt_in_c(self.c))

    @property
    def subscriber_count(self) -> int:
        return len(self._subscriber_positions)

    def min_subscriber_position(self) -> int:
        """The slowest subscriber's position (rcv-pos without subscribers), bytes, as the
        driver takes the cells its clients write: within [0, rcv-hwm] and on the frame
        alignment, as the C half takes them (``ss_subscriber_position_bounded``)."""
        cells = self._subscriber_positions
        if not cells:
            return self.rcv_pos
        load = lib.ss_load_acquire_i64
        bounded = network.ss_subscriber_position_bounded
        hwm = self.rcv_hwm
        return min(bounded(load(cell), hwm) for cell in cells)

    # -- the receiver thread's: state machine ----------------------------------------------
    def _transition(self, event: str, now_ns: int) -> None:
        self.state = next_state(IMAGE_TRANSITIONS, self.state, event)
        self._time_of_last_state_change_ns = now_ns
        self.sync_c_half()
        if self.state is ImageState.DRAINING:
            self.c.sm_deadline_ns = now_ns  # tell the sender at once (EOS-flagged SM)
        elif self.state is ImageState.LINGER:
            self.log.is_connected = False
            self.log.signal_readers()

    @property
    def is_done(self) -> bool:
        return self.state is ImageState.DONE

    # -- the receiver thread's: input ------------------------------------------------------
    def on_rttm(self, rttm: Rttm, now_ns: int) -> None:
        """Echo a REPLY-flagged RTTM from the sender; an unflagged one addressed to this
        receiver is the sender's echo of ours: a round trip for congestion control
        (aeron_publication_image_on_rttm)."""
        if rttm.flags & RTTM_REPLY_FLAG:
            if rttm.receiver_id in (0, self.receiver_id):
                reply = Rttm(self.session_id, self.stream_id, rttm.echo_timestamp, 0,
                             self.receiver_id, 0)
                self._outbox.extend(self.control_datagrams(reply.encode()))
        elif rttm.receiver_id == self.receiver_id:
            rtt_ns = now_ns - rttm.echo_timestamp - rttm.reception_delta
            # A shorter round trip brings the next measurement forward: python_deadline_ns,
            # which the agent asks after this input, makes due() see it.
            self.congestion_control.on_rtt_measurement(now_ns, max(rtt_ns, 0), self.source)
            self._publish_indicators()

    def _publish_indicators(self) -> None:
        """Congestion control's state to its counters (rcv-cc-cubic-rtt, -wnd), if it has any
        and it changed."""
        cells = self.positions.indicators
        if cells:
            values = self.congestion_control.indicator_values()
            if values != self._published_indicators:
                self._published_indicators = values
                for cell, value in zip(cells, values, strict=True):
                    lib.ss_store_release_i64(cell, value)

    def on_rate_announce(self, announce: RateAnnounce, now_ns: int) -> None:
        """The sender adapts its rate to NAK-strength signals: send them from now on."""
        if self.rate_signaller is None:
            self.rate_signaller = NakStrengthSignaller(announce)
        else:
            self.rate_signaller.on_announce(announce)
        self._next_due_ns = 0  # the next pass measures the fill and arms the C half

    def _signal_rate(self, now_ns: int, consumption_position: int) -> None:
        """Signal the threshold the image's fill crossed, if any, and tell the C half the top
        of the fill (``ss_image_rate_signal_top``: the hwm, or what arrived in order while the
        first gap is young) at which the next one is crossed."""
        signaller = self.rate_signaller
        assert signaller is not None
        signalled = signaller.signal(now_ns, consumption_position,
                                     network.ss_image_rate_signal_top(self.c), self.window)
        if signalled is not None:
            threshold, fill, rate = signalled
            signal = RateSignal(self.session_id, self.stream_id, fill, threshold, rate,
                                self.group_tag)
            self._outbox.extend(self.control_datagrams(signal.encode()))
            self.counters.add(SystemCounter.RATE_SIGNALS_SENT)
        self.c.rate_signal_position = signaller.next_signal_position(consumption_position,
                                                                     self.window)

    # -- the receiver thread's: loss -------------------------------------------------------
    def missed_before_join(self, left_at: int) -> None:
        """This image follows one of its session that was left behind and went when the
        sender was at ``left_at`` (its lost range's end): the sender went on until this image
        joined, so what lies between was lost too, and the loss report counts it as a gap of
        this image's (docs/FLOW.md)."""
        missed = self.join_position - left_at
        if missed > 0 and self._loss_entry is not None:
            self._loss_entry.record(missed)

    def _on_loss(self, term_id: int, term_offset: int, length: int) -> None:
        if self.left_behind is not None:
            return  # what it lacks is gone from the sender: asking again would be in vain
        if self.reliable:
            nak = Nak(self.session_id, self.stream_id, term_id, term_offset, length)
            self._outbox.extend(self.control_datagrams(nak.encode()))
            self.counters.add(SystemCounter.NAK_MESSAGES_SENT)
        else:
            # Unreliable: skip the gap with a PAD frame (aeron_term_gap_filler).
            position = self._position(term_id, term_offset)
            write_padding(self.log, position, length)
            self.log.signal_readers()
            self.counters.add(SystemCounter.LOSS_GAP_FILLS)
            self.c.dirty = 1

    def set_response_session(self, session_id: int | None, now_ns: int) -> None:
        """A response publication of session ``session_id`` was made for this request image:
        tell the client's driver with an RSP_SETUP to the control address at once and every
        status-message timeout (Aeron sends one with each SM of its timer), until the
        conductor sees that publication connected and calls this with None."""
        self._response_session_id = session_id
        self._response_setup_deadline_ns = NO_DEADLINE if session_id is None else now_ns
        self._next_due_ns = min(self._next_due_ns, self._response_setup_deadline_ns)

    def _response_setup_check(self, now_ns: int, out: list[Datagram]) -> None:
        if now_ns < self._response_setup_deadline_ns or self._response_session_id is None:
            return
        frame = ResponseSetup(self.session_id, self.stream_id, self._response_session_id)
        out.append(Datagram(frame.encode(), self.control_address))
        self._response_setup_deadline_ns = now_ns + self.status_message_timeout_ns

    # -- the receiver thread's: output -----------------------------------------------------
    def due(self, now_ns: int) -> bool:
        """Whether :meth:`datagrams_to_send` has something to do at ``now_ns``, cheaply: data
        arrived, output is queued (here, or NAKs and an SM the C half left), a timer is due,
        the fill's top reached the next NAK-strength threshold, or a subscriber reached the position
        where the 25 % rule schedules a status message or where cleaning is due, or the catch-up
        rule's status message is due (a tagged image)."""
        c = self.c
        if c.dirty or self._outbox or c.nak_count or c.sm_unsent or now_ns >= self._next_due_ns:
            return True
        if (c.rate_signal_position != NO_DEADLINE
                and network.ss_image_rate_signal_top(c) >= c.rate_signal_position):
            return True
        cells = self._subscriber_positions
        if c.has_group_tag and network.ss_image_catch_up_due(c, now_ns):
            return True
        # The C half's rule, asked: the 25 % rule's SM, and cleaning's unless the C half cleans.
        due_position = network.ss_image_python_due_position(c)
        if len(cells) == 1:
            return network.ss_subscriber_position_bounded(cells[0][0], self.rcv_hwm) >= due_position
        return bool(cells) and self.min_subscriber_position() >= due_position

    def datagrams_to_send(self, now_ns: int, out: list[Datagram]) -> None:
        """Run the rebuild pass and timers; append SMs, NAKs and RTTM replies to ``out``."""
        self._now_ns = now_ns
        state = self.state
        if state is ImageState.DONE:
            self._take_c_rebuild_output()  # no NAK goes any more
            return
        self._take_c_status_message()
        if state is ImageState.INIT or state is ImageState.ACTIVE or state is ImageState.DRAINING:
            self._track_rebuild(now_ns)
        self._take_c_rebuild_output()
        if self._outbox:
            out.extend(self._outbox)
            self._outbox = []
        self._check_state(now_ns)
        if self.state in (ImageState.INIT, ImageState.ACTIVE, ImageState.DRAINING):
            self._status_message_check(now_ns, out)
            self._response_setup_check(now_ns, out)
            if self._consults_congestion_control and (
                    self.congestion_control.should_measure_rtt(now_ns)):
                rttm = Rttm(self.session_id, self.stream_id, now_ns, 0, self.receiver_id,
                            RTTM_REPLY_FLAG)
                out.extend(self.control_datagrams(rttm.encode()))
                self.congestion_control.on_rtt_measurement_sent(now_ns)
        if self.state in (ImageState.INIT, ImageState.ACTIVE, ImageState.DRAINING):
            if self.left_behind is not None:  # wake as the subscribers reach its end
                self.c.sm_due_position = min(self.c.sm_due_position, self.left_behind[0])
            self._sync_cleaning_c()
        else:  # no rebuild pass, SM or cleaning any more: nothing in C makes this due again
            self.c.dirty = 0
            self.c.sm_due_position = self.c.clean_due_position = NO_DEADLINE
            self.c.sm_catch_up_ns = NO_DEADLINE
            self.c.rate_signal_position = NO_DEADLINE
        self._next_due_ns = self.next_deadline_ns()

    def _track_rebuild(self, now_ns: int) -> None:
        c = self.c
        min_sub = self.min_subscriber_position()
        hwm = self.rcv_hwm
        start = self.rcv_pos  # (what congestion control is told; no strategy reads it)
        if self._rebuilt_in_c():
            network.ss_image_rebuild(c, now_ns)
            new_loss = False
        else:
            new_loss = self._rebuild_here(now_ns)
        rcv_pos = self.rcv_pos
        eos = c.eos_position
        if eos >= 0 and not self.is_end_of_stream and rcv_pos >= eos:
            self.is_end_of_stream = True
            self.log.end_of_stream_position = eos
            self.log.signal_readers()
        if self._consults_congestion_control:
            force_sm, self.window = self.congestion_control.on_track_rebuild(
                now_ns, consumption_position=min_sub, last_sm_position=c.last_sm_position,
                hwm_position=hwm, rebuild_start_position=start, rebuild_end_position=rcv_pos,
                loss_found=new_loss)
            c.window = self.window  # what the status-message rules advertise
            if force_sm:
                c.sm_deadline_ns = now_ns  # congestion control asks for one now
            self._publish_indicators()
        if self.rate_signaller is not None:
            self._signal_rate(now_ns, min_sub)
        network.ss_image_clean(c, min_sub)

    def _rebuild_here(self, now_ns: int) -> bool:
        """The rebuild pass, the C half's rule (``ss_image_track_rebuild``), for an image whose
        gaps this half answers: with the delays its detector drew (a group's random backoff),
        each due gap NAKed, or for ``reliable=false`` padded (:meth:`_on_loss`).  Returns
        whether the pass saw a gap first (what congestion control hears)."""
        c = self.c
        detector = self.loss_detector
        c.nak_first_delay_ns, c.nak_retry_delay_ns = detector.delays()
        queued_before = c.nak_count  # the C half's, which _take_c_rebuild_output sends
        network.ss_image_track_rebuild(c, now_ns)
        detector.used_delays()
        naks = c.naks
        for i in range(3 * queued_before, 3 * c.nak_count, 3):
            self._on_loss(naks[i], naks[i + 1], naks[i + 2])
        c.nak_count = queued_before
        return detector.c.fresh_count > 0

    def _take_c_status_message(self) -> None:
        """A status message the C half could not send (``c.sm_unsent``) goes now, from its
        fields."""
        c = self.c
        if c.sm_unsent:
            c.sm_unsent = 0
            self._outbox.extend(self._status_message(c.sm_position, 0))

    def _status_message(self, position: int, flags: int) -> list[Datagram]:
        """The SM of the rules' state (``c.sm_window``) at ``position``, to where control
        frames go; counted."""
        sm = StatusMessage(self.session_id, self.stream_id, self._term_id(position),
                           position & self._mask, self.c.sm_window, self.receiver_id, flags,
                           self.group_tag)
        self.counters.add(SystemCounter.STATUS_MESSAGES_SENT)
        return self.control_datagrams(sm.encode())

    def _sync_cleaning_c(self) -> None:
        """What the C half's status messages need of cleaning: the window it allows, and the
        slowest subscriber's position from which there is half a term (or a chunk) to clean,
        so that the window never waits for it (the C half cleans from there while it sends
        the SMs, and moves both on; the Python half does otherwise).  One rule for both:
        ``ss_clean_due_position``."""
        c = self.c
        cleaner = self.cleaner
        c.reusable_limit = cleaner.reusable_limit()
        c.clean_due_position = cleaner.due_position() if c.sm_in_c else NO_DEADLINE

    def _take_c_rebuild_output(self) -> None:
        """What the C rebuild passes left: the NAKs they could not send (the simulator's, or
        a send error the transport logs).  The gaps they saw first are in the loss report
        already (``c.loss_entry``)."""
        c = self.c
        if c.nak_count and (self.left_behind is not None or self.state is ImageState.DONE):
            c.nak_count = 0  # what it lacks is gone from the sender, or it is gone itself
        if c.nak_count:
            naks = c.naks
            for i in range(0, 3 * c.nak_count, 3):
                nak = Nak(self.session_id, self.stream_id, naks[i], naks[i + 1], naks[i + 2])
                self._outbox.extend(self.control_datagrams(nak.encode()))
            self.counters.add(SystemCounter.NAK_MESSAGES_SENT, c.nak_count)
            c.nak_count = 0

    def _status_message_check(self, now_ns: int, out: list[Datagram]) -> None:
        """The status-message rules, the C half's (``ss_image_status_message_due``, then
        ``ss_image_status_message_taken``): the 25 % rule's, the catch-up rule's, the timer's
        (also set for now by a transition to DRAINING, whose SMs carry EOS, and by congestion
        control) and a changed window's.  A repeat on the timeout reports what subscribers
        consumed by now, not the values last scheduled as Aeron's C driver does
        (docs/DRIVER.md §4.6, seen on the wire): a sender that drains learns its receivers
        took the last bytes of the stream (Aeron 1.15's Java receiver did too,
        tests/test_interop.py)."""
        c = self.c
        position = network.ss_image_status_message_due(c, self.min_subscriber_position(), now_ns)
        if position < 0:
            return
        network.ss_image_status_message_taken(c, position, now_ns)
        if self.left_behind is not None:  # nothing past the end its subscribers read to
            c.overrun_threshold = min(c.overrun_threshold, self.left_behind[0])
        draining = self.state is ImageState.DRAINING
        out.extend(self._status_message(position, SM_EOS_FLAG if draining else 0))
        self._sent_end_of_stream_sm = self._sent_end_of_stream_sm or draining

    def _check_left_behind(self) -> None:
        """Whether the sender has moved so far on that the data this image lacks (from
        rcv-pos) has left its resend window: then the image stops asking, records the loss,
        and ends at rcv-pos (its subscribers read what it has; the receive channel joins the
        stream again where the sender is)."""
        rcv_pos = self.rcv_pos
        sender_seen = max(self.rcv_hwm, self.c.overrun_position)
        if sender_seen - rcv_pos <= self._resend_reach:
            return
        self.left_behind = (rcv_pos, sender_seen)
        self.sync_c_half()
        self.counters.add(SystemCounter.IMAGES_LEFT_BEHIND)
        beyond = sender_seen - max(self.rcv_hwm, rcv_pos)  # gaps below the hwm are recorded
        if self._loss_entry is not None and beyond > 0:
            self._loss_entry.record(beyond)
        self.is_end_of_stream = True
        self.log.end_of_stream_position = rcv_pos
        self.c.overrun_threshold = min(self.c.overrun_threshold, rcv_pos)  # take no more
        self.log.signal_readers()

    def _extend_left_behind(self) -> None:
        """As the image goes: the sender went on while its subscribers read what it had, so
        the loss runs to where the sender is now, near where the next image will join."""
        assert self.left_behind is not None
        start, end = self.left_behind
        sender_seen = max(self.rcv_hwm, self.c.overrun_position)
        if sender_seen > end:
            self.left_behind = (start, sender_seen)
            if self._loss_entry is not None:
                self._loss_entry.record(sender_seen - end, 0)

    def _check_state(self, now_ns: int) -> None:
        state = self.state
        if (self.left_behind is None and state is ImageState.ACTIVE
                and self.c.overrun_position > self.rcv_pos):
            self._check_left_behind()
        if state is ImageState.INIT or state is ImageState.ACTIVE:
            if now_ns >= network.ss_image_liveness_deadline(self.c):
                self._transition("liveness_timeout", now_ns)
            elif self.is_end_of_stream:
                self._transition("end_of_stream", now_ns)
        elif state is ImageState.DRAINING:
            min_sub = self.min_subscriber_position()
            end = self.left_behind[0] if self.left_behind is not None else self.rcv_pos
            drained = min_sub >= end or not self._subscriber_positions
            # The EOS-flagged SMs of the wait tell a sender that is still there that this
            # receiver went; a stream that ended (its sender's EOS, rebuilt up to) and that no
            # subscriber reads any more waits for nothing once one such SM told its sender
            # (which then ends its linger at once): its log goes now.
            if drained and (self.left_behind is not None  # nothing to wait for from the sender
                            or (self.is_end_of_stream and not self._subscriber_positions
                                and self._sent_end_of_stream_sm)
                            or now_ns - self._time_of_last_state_change_ns
                            >= 5 * self.status_message_timeout_ns):
                if self.left_behind is not None:
                    self._extend_left_behind()
                self._transition("drained", now_ns)
        elif state is ImageState.LINGER:
            if (not self._subscriber_positions
                    or now_ns - self._time_of_last_state_change_ns >= self.liveness_timeout_ns):
                self._transition("done", now_ns)

    def python_deadline_ns(self) -> int:
        """The agent's deadline for this image: :meth:`next_deadline_ns` without the timers
        the C half keeps.  :meth:`due` turns true by then too, whatever input moved it since
        the last pass (a deadline of the agent that found no image due would make a Python
        pass of every duty cycle: an RTTM answer that shortened the round trip did)."""
        deadline = self.next_deadline_ns(c_timers=False)
        if deadline < self._next_due_ns:
            self._next_due_ns = deadline
        return deadline

    def next_deadline_ns(self, *, c_timers: bool = True) -> int:
        """Earliest time :meth:`datagrams_to_send` has work: ``<=`` the last ``now`` after new
        data (a rebuild pass is due) or queued output; then the SM, NAK, liveness and state
        timers.  Data in order and subscriber progress are not timers: the agent's C half
        watches them (``c.dirty`` with a gap or EOS, ``c.sm_due_position`` for the 25 %
        rule) and makes the Python half due.  ``c_timers=False``: the Python half's timers
        only (an image rebuilt in C has its gaps' NAK timers kept by the C half)."""
        state = self.state
        if state is ImageState.DONE:
            return NO_DEADLINE
        if state is ImageState.LINGER:
            if not self._subscriber_positions or self._outbox:
                return self._now_ns
            return self._time_of_last_state_change_ns + self.liveness_timeout_ns
        if self.c.dirty or self._outbox or (self.cleaner.is_behind
                                            and not self._sends_sm_in_c()):
            return self._now_ns  # (the C half cleans from clean_due_position by itself)
        deadline = self.c.sm_deadline_ns if c_timers or not self._sends_sm_in_c() else NO_DEADLINE
        deadline = min(deadline, self._response_setup_deadline_ns)
        if c_timers or not self._rebuilt_in_c():
            deadline = min(deadline, self.loss_detector.next_deadline_ns())
        if self._consults_congestion_control:
            deadline = min(deadline, self.congestion_control.next_deadline_ns())
        if self.rate_signaller is not None:
            deadline = min(deadline, self.rate_signaller.next_deadline_ns())
        if state is ImageState.DRAINING:
            drain_wait_end = self._time_of_last_state_change_ns + 5 * self.status_message_timeout_ns
            if drain_wait_end > self._now_ns:
                return min(deadline, drain_wait_end)
            # Waited: only the subscribers are left to drain; their progress wakes the pass
            # (the C half's 25 % rule, and the SM timer), a deadline of now would spin.
            return deadline
        if c_timers or not self._sends_sm_in_c():  # else the C half keeps this one too
            deadline = min(deadline, network.ss_image_liveness_deadline(self.c))
        return deadline

    def __repr__(self) -> str:
        return (f"<PublicationImage session={self.session_id} stream={self.stream_id} "
                f"{self.state.name} rcv-pos={self.rcv_pos} hwm={self.rcv_hwm}>")


