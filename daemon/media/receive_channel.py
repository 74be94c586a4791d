"""A receive channel endpoint's dispatcher (sans-I/O): what arrives at a subscribed endpoint
goes to its images, or asks for one.

:class:`ReceiveChannel` is one subscribed channel endpoint on a host (Aeron's
``aeron_receive_channel_endpoint`` + ``aeron_data_packet_dispatcher``).  It owns the
:class:`PublicationImage` objects of that endpoint, keyed by ``(session_id, stream_id)``, and
the C image table (:attr:`ReceiveChannel.c`, an ``ss_receiver_t``) through which the data path
inserts DATA without Python.  Dispatch rules (docs/DRIVER.md §4.1):

* DATA/PAD/heartbeat for a known image → the C data path (every frame validated, over- and
  under-runs dropped, the hwm raised); never Python;
* with ``control=`` on a unicast endpoint (a dynamic multi-destination-cast receiver), a
  setup-eliciting SM (S flag, session and stream 0) to the control address at once and every
  second while it has subscriptions: the sender adds it as a destination and sends SETUP;
  its images' SMs and NAKs go to the control address too.  A response subscription's
  endpoint (``control-mode=response``) names each session it wants and has had no image
  of instead (docs/CHANNELS.md §7.6);
* DATA/heartbeat (not EOS) for a subscribed stream whose session has no image → an
  *elicited SETUP*: an SM with the S flag (0x80), term id/offset/window 0, to the source
  (or the control group for multicast); the session is then PENDING_SETUP for 1 s;
* SETUP for a subscribed stream and a session without image (and not filtered out by
  ``session-id=``, not cooling down) → an :class:`ImageRequested` event: the conductor makes
  the log and counters off the receive loop and answers with :meth:`add_image` (or
  :meth:`reject_image`); the session is PENDING_IMAGE meanwhile;
* RTTM → the image; malformed datagrams → ``INVALID_PACKETS``, dropped, never raised;
* a multi-destination subscription (``control-mode=manual``, docs/CHANNELS.md §7.5) has no
  socket of its own: each destination's C receiver (:meth:`attach_destination`) reads its
  socket into this channel's image table, its images take data from any source and keep a
  path per destination, and what Python answers leaves through the destination it came by
  (:attr:`arrival_destination`, ``Datagram.via``).

When an image reaches LINGER an :class:`ImageUnavailable` event tells the conductor (which tells
the subscribers); when it is DONE it is removed, :class:`ImageDone` lets the conductor free its
log and counters, and its session cools down (``cool_down_ns``, default 1 s) so stray packets
of the old stream do not recreate it at once.

:class:`~slipstream.daemon.agents.receiver.Receiver`, the agent, drains each endpoint's
transport into its channel and runs the images' timers.

Units: times in ns, sizes in bytes.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

from slipstream.client.channel import Channel
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
    ErrorFrame,
    RateAnnounce,
    RateSignal,
    Rttm,
    Sealed,
    Setup,
    StatusMessage,
    decode,
)
from slipstream.client.layout import (
    ERR_CODE_IMAGE_REJECTED,
    ERR_CODE_RESOURCE_TEMPORARILY_UNAVAILABLE,
    ERR_CODE_STORAGE_SPACE,
    FRAME_ALIGNMENT,
    FRAME_HEADER_LENGTH,
    HDR_TYPE_DATA,
    HDR_TYPE_ERR,
    HDR_TYPE_EXT,
    HDR_TYPE_NAK,
    HDR_TYPE_RSP_SETUP,
    HDR_TYPE_RTTM,
    HDR_TYPE_SETUP,
    HDR_TYPE_SM,
    NO_DEADLINE,
    SESSION_ID_FIELD,
    SM_SEND_SETUP_FLAG,
    STREAM_ID_FIELD,
    TERM_ID_FIELD,
    TYPE_FIELD,
)
from slipstream.client.logbuffer import LogBuffer, check_mtu, check_term_length, term_count
from slipstream.client.notices import SourceNotices
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media.destinations import ControlMode
from slipstream.daemon.media.events import (
    ImageDone,
    ImageRejected,
    ImageRequested,
    ImageUnavailable,
    ReceiverEvent,
)
from slipstream.daemon.media.slot_table import SlotTable
from slipstream.daemon.protocol.params import SubscriptionParams
from slipstream.daemon.protocol.types import (
    Address,
    Datagram,
    ProtocolCounters,
    sockaddr,
)
from slipstream.daemon.reports.loss_report import LossEntry
from slipstream.daemon.streams.image import (
    ImagePositions,
    ImageState,
    PublicationImage,
)

#: AERON_DRIVER_RECEIVER_PENDING_SETUP_TIMEOUT_NS
PENDING_SETUP_TIMEOUT_NS = 1_000_000_000
#: How often a dynamic multi-destination-cast receiver sends its setup-eliciting SM to the
#: control address (Aeron's periodic pending setup, 1 s; the sender drops a destination
#: silent for 5 s: daemon/media/destinations.py).
ELICIT_SETUP_INTERVAL_NS = 1_000_000_000
#: A response endpoint asks again for a session that has its image every this many
#: ELICIT_SETUP_INTERVAL_NS (as Aeron's response subscription keeps asking): well within an
#: image's liveness timeout, so that a response publication that lost its client's address
#: (a NAT that moved the client's port) has it again before the image goes.
RESPONSE_REQUEST_ROUNDS = 4
#: How long a removed image's session is ignored (slipstream choice, see module docstring).
DEFAULT_COOL_DOWN_NS = 1_000_000_000
#: How long a SETUP waits for the conductor's image before it may ask again.
PENDING_IMAGE_TIMEOUT_NS = 1_000_000_000
#: The most refused streams (source, session, stream) an endpoint answers with an ERR per
#: cool-down: a legitimate peer's refused streams are each told, a flood's new sessions
#: draw at most this many ERRs a cool-down.
ERR_STREAMS_MAX = 1024
#: The most bytes of text an ERR answering a SETUP carries: the frame is then at most 3x the
#: SETUP on the wire (IPv4: 196 bytes for 68), so an address a SETUP is spoofed from gets no
#: more than that (docs/SECURITY.md).  Each bound's reason fits, its setting named.
ERR_ANSWER_TEXT_MAX = 128
#: A session refused again within two cool-downs of the end of its last one cools down
#: twice as long as before, up to this many cool-downs: a stream the bounds keep refusing
#: (its sender asks again, or its data elicits a SETUP) costs the receiver a refusal every
#: 8 s, not every second (slipstream).
REFUSED_COOL_DOWNS_MAX = 8
#: The most refused sessions an endpoint remembers for that: past it, those it would have
#: forgotten go, then the oldest half.
REFUSED_SESSIONS_MAX = 4096


class _LeftEnd(NamedTuple):
    """Where a session's image left behind lost its stream to (the sender then), until when
    a next image of the session may count the rest up to its join as lost too, and the
    framing (initial term id, term length) of the log those positions are of."""

    position: int
    expires_ns: int
    framing: tuple[int, int]


_NOT_FOR_A_RECEIVER = frozenset((HDR_TYPE_NAK, HDR_TYPE_SM, HDR_TYPE_ERR, HDR_TYPE_RSP_SETUP))


def ignore_member_change(member: object, image: bool, added: bool) -> None:
    """A channel's ``on_member_change`` while no agent serves it."""


class ReceiveChannel:
    """All images of one receive endpoint.  See the module docstring."""

    def __init__(self, *, channel: Channel, settings: DriverSettings, receiver_id: int,
                 counters: ProtocolCounters, now_ns: int, rng: random.Random,
                 cool_down_ns: int = DEFAULT_COOL_DOWN_NS) -> None:
        self.channel = channel
        self.settings = settings
        #: What its images are made with, resolved once from ``channel`` and ``settings``.
        self.params = SubscriptionParams.resolve(channel, settings)
        self.receiver_id = receiver_id
        self.counters = counters
        self.rng = rng
        #: The pressure governor's multiple of its images' status-message interval.
        self.status_interval_factor = 1
        self.cool_down_ns = cool_down_ns
        control = channel.control_group if channel.endpoint is not None else None
        if control is None and channel.control is not None:
            control = channel.control
        #: Where SMs/NAKs go: the control group (multicast) or the control= address (a
        #: receiver of a dynamic multi-destination-cast channel); None: reply to the source.
        self.control_address: Address | None = (
            (control.host, control.port or 0) if control is not None else None)
        #: A dynamic multi-destination-cast receiver (control= on a unicast endpoint): it
        #: joins by sending setup-eliciting SMs to the control address while it has
        #: subscriptions, every ELICIT_SETUP_INTERVAL_NS (:meth:`datagrams_to_send`).
        self.joins_at_control = channel.control is not None and channel.control_group is None
        #: A multi-destination subscription (control-mode=manual, docs/CHANNELS.md §7.5): no
        #: socket of its own; each destination's C receiver (attach_destination) reads one
        #: socket into this channel's images, and its images keep a path per destination.
        self.multi_destination = channel.control_mode == ControlMode.MANUAL.value
        self._destinations: dict[int, tuple[object, Address | None]] = {}  # -> (C, control)
        #: The destination whose datagrams Python is handling now (its transport sets it
        #: around dispatch): replies to them leave through it.  -1: none.
        self.arrival_destination = -1
        #: A response subscription's endpoint (control-mode=response, docs/CHANNELS.md §7.6):
        #: its joins name each session it was told of (RSP_SETUP) that a subscription wants,
        #: not session 0, since a response publication learns its one client from those.
        self.is_response = channel.is_response
        #: A response endpoint's sessions that have an image: asked for every
        #: RESPONSE_REQUEST_ROUNDS joins only (their response publication answered); one
        #: whose image goes is asked for every join again.
        self._answered: set[tuple[int, int]] = set()
        self._join_round = 0
        self._next_join_ns = NO_DEADLINE
        self.images: dict[tuple[int, int], PublicationImage] = {}
        #: Called as (member, image, added) when a C member it holds comes or goes: an
        #: image's ``ss_image_t *`` (image True) or a destination's ``ss_receiver_t *``; the
        #: agent that serves the channel follows in its C half's view.
        self.on_member_change: Callable[[object, bool, bool], None] = ignore_member_change
        self._subscriptions: dict[int, set[int] | None] = {}  # stream -> sessions (None: all)
        self._pending_setup: dict[tuple[int, int], int] = {}  # -> expiry ns
        self._pending_image: dict[tuple[int, int], int] = {}  # -> expiry ns
        self._cool_down: dict[tuple[int, int], int] = {}  # -> expiry ns
        #: Sessions whose image was left behind and went, until their next image comes or
        #: an image liveness timeout passes: where its lost range ended (the sender then).
        self._left_ends: dict[tuple[int, int], _LeftEnd] = {}
        #: Refused SETUPs are logged once per source address per interval: a host sending
        #: thousands gets no thousands of lines.
        self._refusal_notices = SourceNotices()
        #: Each refused stream's sender hears why (an ERR frame) at each refusal, which its
        #: cool-down spaces at least ``cool_down_ns`` apart; at most ERR_STREAMS_MAX streams
        #: are told per cool-down, so a flood of new sessions draws a bounded number of ERRs,
        #: each the answer to one SETUP from its address.
        self._err_notices = SourceNotices(cool_down_ns, ERR_STREAMS_MAX)
        #: Refused sessions: (session, stream) -> (their last cool-down, ns; when it is
        #: forgotten, ns).
        self._refused: dict[tuple[int, int], tuple[int, int]] = {}
        self._outbox: list[Datagram] = []
        self._events: list[ReceiverEvent] = []
        self._now_ns = now_ns
        self._sockaddrs: dict[Address, bytes] = {}
        # The C side: the image table and the counters it counts into.  Receive buffers are
        # the transport's (a socket needs them, the simulator does not).
        self.c = c = network_ffi.new("ss_receiver_t *")
        self._image_table = SlotTable("ss_image_t", "slots", "slot_mask",
                                      network.ss_receiver_set_images)
        self._image_table.load(c, [])
        self._streams = network_ffi.new("int32_t[]", 16)
        c.streams = self._streams
        c.stream_capacity = 16
        c.fd = -1  # until a transport with a socket attaches
        c.destination = -1
        #: A datagram went to Python (on_control) since the last datagrams_to_send: the
        #: simulator's agent then runs its Python half.
        self.has_python_work = False
        for field, counter in (
                ("bytes_received", SystemCounter.BYTES_RECEIVED),
                ("invalid_packets", SystemCounter.INVALID_PACKETS),
                ("heartbeats_received", SystemCounter.HEARTBEATS_RECEIVED),
                ("flow_control_over_runs", SystemCounter.FLOW_CONTROL_OVER_RUNS),
                ("flow_control_under_runs", SystemCounter.FLOW_CONTROL_UNDER_RUNS),
                ("foreign_source_drops", SystemCounter.FOREIGN_SOURCE_DROPS),
                ("receive_errors", SystemCounter.RECEIVE_ERRORS),
                ("debug_data_loss_drops", SystemCounter.DEBUG_DATA_LOSS_DROPS),
                ("nak_messages_sent", SystemCounter.NAK_MESSAGES_SENT),
                ("status_messages_sent", SystemCounter.STATUS_MESSAGES_SENT),
                ("bytes_sent", SystemCounter.BYTES_SENT),
                ("short_sends", SystemCounter.SHORT_SENDS)):
            setattr(c.counters, field, counters.address(counter))

    # -- subscriptions --------------------------------------------------------------------
    def add_subscription(self, stream_id: int, session_id: int | None = None) -> None:
        """Interest in ``stream_id`` (all sessions, or only ``session_id``)."""
        if session_id is None:
            self._subscriptions[stream_id] = None
        else:
            sessions = self._subscriptions.get(stream_id, set())
            if sessions is not None:
                sessions.add(session_id)
                self._subscriptions[stream_id] = sessions
        self._sync_streams()

    def remove_subscription(self, stream_id: int) -> None:
        """No more interest in ``stream_id``: no new images (existing ones drain once their
        subscriber positions are removed)."""
        self._subscriptions.pop(stream_id, None)
        self._sync_streams()
        self._answered = {key for key in self._answered if key[1] != stream_id}
        for key in [k for k in self._left_ends if k[1] == stream_id]:
            del self._left_ends[key]  # a subscription made later had none of it
        for key in [k for k in self._cool_down if k[1] == stream_id and not self.params.rejoin]:
            del self._cool_down[key]  # rejoin=false holds a session off while it is wanted
        for (_session, stream), image in self.images.items():
            if stream == stream_id and image.state is ImageState.INIT:
                image.end_without_subscribers(self._now_ns)

    def leave(self, now_ns: int) -> None:
        """This receiver goes (its driver stops): every image tells its sender
        (:meth:`PublicationImage.leave`)."""
        self._now_ns = now_ns
        for image in self.images.values():
            image.leave(now_ns)

    def set_interest(self, stream_id: int, sessions: set[int] | None) -> None:
        """The sessions of ``stream_id`` that subscriptions here want: None for all, an empty
        set for none (as :meth:`remove_subscription`)."""
        if sessions is not None and not sessions:
            self.remove_subscription(stream_id)
            return
        self._subscriptions[stream_id] = None if sessions is None else set(sessions)
        self._sync_streams()
        if self._answered:  # only the sessions still wanted are remembered
            self._answered = {key for key in self._answered if self.wants(*key)}

    def _sync_streams(self) -> None:
        streams = list(self._subscriptions)
        if self.joins_at_control:
            self._next_join_ns = (NO_DEADLINE if not streams
                                  else min(self._next_join_ns, self._now_ns))
        if len(streams) > self.c.stream_capacity:
            capacity = 1 << (len(streams) - 1).bit_length()
            self._streams = network_ffi.new("int32_t[]", capacity)
            self.c.streams = self._streams
            self.c.stream_capacity = capacity
        for i, stream_id in enumerate(streams):
            self._streams[i] = stream_id
        self.c.stream_count = len(streams)
        self._share_tables()

    def wants(self, session_id: int, stream_id: int) -> bool:
        """Whether a subscription here takes ``session_id`` of ``stream_id``."""
        if stream_id not in self._subscriptions:
            return False
        sessions = self._subscriptions[stream_id]
        return sessions is None or session_id in sessions

    def _reply_address(self, source: Address) -> Address:
        return self.control_address if self.control_address is not None else source

    # -- destinations (a multi-destination subscription's) -----------------------------------
    def attach_destination(self, index: int, receiver, control: Address | None) -> None:
        """Destination ``index``'s C receiver (cffi ``ss_receiver_t *``, its socket and
        buffers set by its transport) reads into this channel's images from now: it shares
        the channel's image and stream tables and counters.  ``control``: where its paths'
        control frames go (a multicast destination's control group), else each path's
        source."""
        if not 0 <= index < network.SS_RECEIVE_DESTINATIONS_MAX or index in self._destinations:
            raise ValueError(f"destination slot {index} is taken or out of range")
        receiver.destination = index
        receiver.publications = network_ffi.NULL
        if control is not None:
            raw = sockaddr(control)
            network_ffi.memmove(receiver.control_address, raw, len(raw))
            receiver.control_address_length = len(raw)
        self._destinations[index] = (receiver, control)
        self._share_tables()
        self.on_member_change(receiver, False, True)

    def detach_destination(self, index: int) -> None:
        """Destination ``index`` is removed: its receiver no longer reads into the images, and
        their paths through it end (no more status messages or NAKs that way)."""
        destination = self._destinations.pop(index, None)
        if destination is None:
            return
        self.on_member_change(destination[0], False, False)
        for image in self.images.values():
            image.drop_connection(index)

    @property
    def socket_receivers(self) -> list:
        """The C receivers that read sockets into this channel's images (cffi
        ``ss_receiver_t *``): its own, or a multi-destination subscription's destinations'."""
        receivers = [self.c] if self.c.fd >= 0 else []
        receivers.extend(receiver for receiver, _ in self._destinations.values()
                         if receiver.fd >= 0)
        return receivers

    @property
    def reads_without_sockets(self) -> bool:
        """Whether datagrams reach this channel through its transport's ``receive`` (the
        simulator's: a C receiver with no socket) rather than the C half's socket reads."""
        if self.multi_destination:
            return any(receiver.fd < 0 for receiver, _ in self._destinations.values())
        return self.c.fd < 0

    def _share_tables(self) -> None:
        """Each destination's C receiver reads the channel's current tables (they are made
        anew as images and streams come and go)."""
        c = self.c
        for receiver, _ in self._destinations.values():
            receiver.slots = c.slots
            receiver.slot_mask = c.slot_mask
            receiver.streams = c.streams
            receiver.stream_count = c.stream_count
            receiver.stream_capacity = c.stream_capacity
            receiver.counters = c.counters

    # -- images (commands from the conductor) ---------------------------------------------
    def new_image(self, request: ImageRequested, log: LogBuffer, positions: ImagePositions,
                  now_ns: int, loss_entry: LossEntry | None = None) -> PublicationImage:
        """The image for ``request`` over ``log`` (created for its SETUP): pure, so the
        conductor may build it on its own thread before :meth:`add_image` hands it over."""
        destinations = network.SS_RECEIVE_DESTINATIONS_MAX if self.multi_destination else 0
        return PublicationImage(
            log=log, setup=request.setup, params=self.params, settings=self.settings,
            receiver_id=self.receiver_id, counters=self.counters, positions=positions,
            control_address=self._path_control(request.via, request.source),
            source=request.source, now_ns=now_ns, rng=self.rng, loss_entry=loss_entry,
            destinations=destinations, via=request.via)

    def _path_control(self, via: int, source: Address) -> Address:
        """Where control frames answering ``source``'s data on destination ``via`` go."""
        destination = self._destinations.get(via)
        if destination is not None and destination[1] is not None:
            return destination[1]
        return self._reply_address(source)

    def set_status_interval_factor(self, factor: int) -> None:
        """The pressure governor widens (or restores) the status-message interval of every
        image of this channel, and of those it makes from now on."""
        self.status_interval_factor = factor
        for image in self.images.values():
            image.status_interval_factor = factor

    def add_image(self, image: PublicationImage) -> None:
        """Start receiving into ``image`` (made by :meth:`new_image`)."""
        image.status_interval_factor = self.status_interval_factor
        key = (image.session_id, image.stream_id)
        self._pending_image.pop(key, None)
        self._refused.pop(key, None)
        left_end = self._left_ends.pop(key, None)
        if (left_end is not None and left_end.expires_ns > self._now_ns
                and left_end.framing == image.log.identity.framing):
            image.missed_before_join(left_end.position)
        self.images[key] = image
        self.on_member_change(image.c, True, True)
        if self.is_response:
            self._answered.add(key)
        if self.multi_destination:
            image.attach_paths({index: receiver.fd
                                for index, (receiver, _) in self._destinations.items()})
        self._sync_images()

    def _refusal(self, setup: Setup) -> tuple[str, int] | None:
        """Why this receiver cannot take the image a valid SETUP offers, and the ERR frame's
        code, or None: a term past what its subscription allows (``max-term-length=``, else
        image_term_buffer_length_max; slipstream), or, as Aeron, datagrams longer than the
        window (no frame of that length could ever be let go: the stream would stall,
        connected; the window is within the socket's receive buffer, SubscriptionParams)."""
        limit = self.params.image_term_length_max
        if setup.term_length > limit:
            self.counters.add(SystemCounter.IMAGE_TERM_LENGTH_REFUSED)
            setting = ("max-term-length" if self.channel.max_term_length is not None
                       else "image_term_buffer_length_max")
            return (f"term length {setup.term_length} is over this receiver's "
                    f"{setting} of {limit}", ERR_CODE_STORAGE_SPACE)
        window = min(self.params.receiver_window_length, setup.term_length // 2)
        if setup.mtu > window:
            self.counters.add(SystemCounter.IMAGES_REJECTED)
            return (f"the sender's mtu {setup.mtu} is more than this receiver's window "
                    f"{window} (rcv-wnd, at most half a term)", ERR_CODE_IMAGE_REJECTED)
        return None

    def reject_image(self, request: ImageRequested, now_ns: int, reason: str,
                     code: int = ERR_CODE_STORAGE_SPACE, *, lasting: bool = True) -> int | None:
        """The image of ``request`` is not made (the conductor's bounds, no space, counters
        full; or this receiver's own refusal): the session cools down (twice as long as
        last time when refused again soon for a ``lasting`` cause) and its sender hears
        why (an ERR frame of ``code``, docs/PROTOCOL.md §1.7; RESOURCE_TEMPORARILY_UNAVAILABLE
        for a cause that is not ``lasting``, so that the sender asks again after the
        cool-down, not ever later) at this refusal, within ERR_STREAMS_MAX streams per
        cool-down.  Returns None when the refusal is not to be logged (one of
        its source's was, within the interval), else how many of that source's were not
        since the last logged."""
        key = (request.setup.session_id, request.setup.stream_id)
        if not lasting:
            code = ERR_CODE_RESOURCE_TEMPORARILY_UNAVAILABLE
        self._pending_image.pop(key, None)
        self._cool_down[key] = now_ns + (self._refused_cool_down(key, now_ns) if lasting
                                         else self.cool_down_ns)
        # Counted by whoever refused, under its cause (DROP_CAUSES: one cause each).
        if self._err_notices.tell((request.source[0], *key), now_ns) is not None:
            # The text is bytes on the wire: cut it there, at a character boundary.
            text = reason.encode()[:ERR_ANSWER_TEXT_MAX].decode(errors="ignore")
            error = ErrorFrame(key[0], key[1], self.receiver_id, code, text)
            self._outbox.append(Datagram(error.encode(),
                                         self._path_control(request.via, request.source),
                                         request.via))
        return self._refusal_notices.tell(request.source[0], now_ns)

    def _refused_cool_down(self, key: tuple[int, int], now_ns: int) -> int:
        """How long session ``key``, refused now, cools down (ns): ``cool_down_ns``, or twice
        its last cool-down when that ended less than two cool-downs ago, up to
        REFUSED_COOL_DOWNS_MAX of them."""
        refused = self._refused
        last = refused.get(key)
        cool_down = self.cool_down_ns
        if last is not None and now_ns < last[1]:
            cool_down = min(2 * last[0], REFUSED_COOL_DOWNS_MAX * self.cool_down_ns)
        refused[key] = (cool_down, now_ns + 3 * cool_down)
        if len(refused) > REFUSED_SESSIONS_MAX:
            kept = {k: v for k, v in refused.items() if now_ns < v[1]}
            if len(kept) > REFUSED_SESSIONS_MAX // 2:
                kept = dict(list(kept.items())[-(REFUSED_SESSIONS_MAX // 2):])
            self._refused = kept
        return cool_down

    def _sync_images(self) -> None:
        self._image_table.load(self.c, [image.c for image in self.images.values()])
        self._share_tables()

    # -- input ----------------------------------------------------------------------------
    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address,
                    now_ns: int, via: int = -1) -> None:
        """One received datagram (a transport without a socket: the simulator's), through the
        C data path as the socket path does and, if it is not data of a known image,
        :meth:`on_control`.  ``via``: the destination it came through (a multi-destination
        subscription's; its C receiver takes it, and Python's replies leave that way); one
        not attached is dropped.  Never raises on malformed input."""
        self._now_ns = now_ns
        if via < 0:
            receiver = self.c
        else:
            destination = self._destinations.get(via)
            if destination is None:
                return
            receiver = destination[0]
        raw = self._sockaddrs.get(source)
        if raw is None:
            raw = self._sockaddrs[source] = sockaddr(source)
        with network_ffi.from_buffer(data) as buffer:
            verdict = network.ss_receiver_on_datagram(receiver, buffer, len(buffer), raw,
                                                      len(raw), now_ns)
        if verdict == network.SS_RX_TO_PYTHON:
            self.arrival_destination = via
            try:
                self.on_control(data, source, now_ns)
            finally:
                self.arrival_destination = -1

    def on_control(self, data: bytes | bytearray | memoryview, source: Address,
                   now_ns: int) -> None:
        """A datagram the C data path passed up: SETUP, RTTM, a rate-control announcement,
        data of an unknown session of a subscribed stream, or a frame that is not for a
        receiver."""
        self._now_ns = now_ns
        self.has_python_work = True
        # A header field runs up to the next field's offset.
        frame_type = int.from_bytes(data[TYPE_FIELD:FRAME_HEADER_LENGTH], "little")
        if frame_type == HDR_TYPE_DATA:
            session = int.from_bytes(data[SESSION_ID_FIELD:STREAM_ID_FIELD], "little", signed=True)
            stream = int.from_bytes(data[STREAM_ID_FIELD:TERM_ID_FIELD], "little", signed=True)
            self._on_unknown_session(session, stream, source, now_ns)
            return
        if frame_type in _NOT_FOR_A_RECEIVER:
            return
        frame = (decode(data) if frame_type in (HDR_TYPE_SETUP, HDR_TYPE_RTTM, HDR_TYPE_EXT)
                 else None)
        if isinstance(frame, Setup):
            self._on_setup(frame, source, now_ns)
        elif isinstance(frame, Rttm):
            image = self.images.get((frame.session_id, frame.stream_id))
            if image is not None:
                image.on_rttm(frame, now_ns)
        elif isinstance(frame, RateAnnounce):
            image = self.images.get((frame.session_id, frame.stream_id))
            # The image's sender only (any of its paths, for a multi-destination one).
            if image is not None and (self.multi_destination or source == image.source):
                image.on_rate_announce(frame, now_ns)
        elif isinstance(frame, RateSignal):
            return  # another receiver's, to a sender: not for a receiver
        elif isinstance(frame, Sealed):  # an encrypted channel's, at this plain endpoint
            self.counters.add(SystemCounter.CRYPTO_SEALED_AT_PLAIN_DROPS)
        else:
            self.counters.add(SystemCounter.INVALID_PACKETS)

    def _on_unknown_session(self, session_id: int, stream_id: int, source: Address,
                            now_ns: int) -> None:
        """Elicit a SETUP (aeron_data_packet_dispatcher_elicit_setup_from_source)."""
        if not self.wants(session_id, stream_id):
            return
        key = (session_id, stream_id)
        if (now_ns < self._pending_setup.get(key, -1) or now_ns < self._cool_down.get(key, -1)
                or key in self._pending_image):
            return
        self._pending_setup[key] = now_ns + PENDING_SETUP_TIMEOUT_NS
        sm = StatusMessage(session_id, stream_id, 0, 0, 0, self.receiver_id, SM_SEND_SETUP_FLAG)
        via = self.arrival_destination
        self._outbox.append(Datagram(sm.encode(), self._path_control(via, source), via))
        self.counters.add(SystemCounter.STATUS_MESSAGES_SENT)

    def _on_setup(self, setup: Setup, source: Address, now_ns: int) -> None:
        key = (setup.session_id, setup.stream_id)
        image = self.images.get(key)
        if image is not None:
            # Another path of a multi-destination image (Aeron's addDestinationConnection):
            # its control frames go that way too from now.
            via = self.arrival_destination
            destination = self._destinations.get(via)
            if self.multi_destination and destination is not None:
                image.seed_connection(via, self._path_control(via, source), now_ns,
                                      destination[0].fd)
            return
        if not self.wants(*key):
            return
        if now_ns < self._cool_down.get(key, -1) or now_ns < self._pending_image.get(key, -1):
            return
        try:
            check_term_length(setup.term_length)
            check_mtu(setup.mtu)
            # The join position must be a frame boundary inside a term, at or after the start.
            if (not 0 <= setup.term_offset < setup.term_length
                    or setup.term_offset & (FRAME_ALIGNMENT - 1)
                    or term_count(setup.active_term_id, setup.initial_term_id) < 0):
                raise ValueError("join position")
        except ValueError:
            self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        self._pending_setup.pop(key, None)
        refusal = self._refusal(setup)
        if refusal is not None:
            reason, code = refusal
            held = self.reject_image(
                ImageRequested(self, setup, source, self.arrival_destination), now_ns, reason,
                code)
            if held is not None:  # the conductor logs it: once per source per interval
                self._events.append(ImageRejected(self, setup, source, reason, held))
            return
        self._pending_image[key] = now_ns + PENDING_IMAGE_TIMEOUT_NS
        self._events.append(ImageRequested(self, setup, source, self.arrival_destination))

    # -- output ---------------------------------------------------------------------------
    def datagrams_to_send(self, now_ns: int) -> list[Datagram]:
        """SMs, NAKs, elicited-SETUP SMs, ERRs and RTTM replies due at ``now_ns``; also
        advances image states (events for :meth:`poll_events`)."""
        self._now_ns = now_ns
        self.has_python_work = False
        out = self._outbox
        self._outbox = []
        done = []
        for key, image in self.images.items():
            if not image.due(now_ns):
                continue
            before = image.state
            image.datagrams_to_send(now_ns, out)
            after = image.state
            if after is not before and after is ImageState.LINGER:
                self._events.append(ImageUnavailable(self, image, image.left_behind))
            if after is ImageState.DONE:
                if before is not ImageState.LINGER and before is not ImageState.DONE:
                    self._events.append(ImageUnavailable(self, image, image.left_behind))
                done.append(key)
        if done:
            for key in done:
                image = self.images.pop(key)
                self.on_member_change(image.c, True, False)
                self._events.append(ImageDone(self, image))
                self._answered.discard(key)  # a response session is asked for again
                # One left behind joins again at once, if it got anywhere: one left behind as
                # it joined (a sender far ahead of its SETUP) waits, or it would loop.  With
                # rejoin=false the session never comes back (until its stream's interest
                # goes: remove_subscription).
                left = image.left_behind
                if not self.params.rejoin:
                    self._cool_down[key] = NO_DEADLINE
                elif left is None or left[0] <= image.join_position:
                    self._cool_down[key] = now_ns + self.cool_down_ns
                if left is not None and self.params.rejoin:
                    self._left_ends[key] = _LeftEnd(
                        left[1], now_ns + self.settings.image_liveness_timeout,
                        image.log.identity.framing)
            self._sync_images()
        for pending in (self._pending_setup, self._pending_image, self._cool_down):
            if pending:
                for key in [k for k, t in pending.items() if t <= now_ns]:
                    del pending[key]
        if self._left_ends:
            for key in [k for k, v in self._left_ends.items() if v.expires_ns <= now_ns]:
                del self._left_ends[key]
        if now_ns >= self._next_join_ns:
            self._send_join(out, now_ns)
        return out

    def _send_join(self, out: list[Datagram], now_ns: int) -> None:
        """A setup-eliciting SM to the control address (session and stream 0, as Aeron's
        receivers send it): the sender learns this endpoint as a destination, or keeps it,
        and its publications send SETUP.  A response endpoint sends one per wanted session
        instead (Aeron's requestSetup): that session's response publication learns this
        endpoint as its destination and sends SETUP; every join while the session has no
        image, every RESPONSE_REQUEST_ROUNDS-th once it has one, as long as a subscription
        wants it (as Aeron's response subscription, which keeps asking): a publication that
        lost this endpoint's address (its NAT moved the port) learns it again."""
        assert self.control_address is not None
        if self.is_response:
            self._join_round += 1
            every = self._join_round % RESPONSE_REQUEST_ROUNDS == 0
            keys = [(session_id, stream_id)
                    for stream_id, sessions in self._subscriptions.items()
                    for session_id in sessions or ()
                    if every or (session_id, stream_id) not in self._answered]
        else:
            keys = [(0, 0)]
        for session_id, stream_id in keys:
            sm = StatusMessage(session_id, stream_id, 0, 0, 0, self.receiver_id,
                               SM_SEND_SETUP_FLAG)
            out.append(Datagram(sm.encode(), self.control_address))
            self.counters.add(SystemCounter.STATUS_MESSAGES_SENT)
        self._next_join_ns = now_ns + ELICIT_SETUP_INTERVAL_NS

    def move_control(self, address: Address, now_ns: int) -> None:
        """The ``control=`` name resolved to ``address`` now (the publisher moved): the joining
        SMs go there from now on, the next at once, and so do the control frames of the images
        made from now on (an image of the old publisher keeps its own until it ends)."""
        self.control_address = address
        if self._next_join_ns != NO_DEADLINE:
            self._next_join_ns = now_ns

    def on_peer_handshake(self, now_ns: int) -> None:
        """A peer of this encrypted endpoint exchanged a handshake with it (docs/CHANNELS.md
        §7.8), having dropped what made it ask, a joining SM perhaps: the next join goes at
        once rather than an ELICIT_SETUP_INTERVAL_NS later."""
        if self._next_join_ns != NO_DEADLINE:
            self._next_join_ns = now_ns

    def next_deadline_ns(self) -> int:
        """Earliest deadline of the images, the C half's timers included (``<=`` now when
        output is queued)."""
        if self._outbox:
            return self._now_ns
        images = self.images.values()
        return min(self._next_join_ns,
                   min((image.next_deadline_ns() for image in images), default=NO_DEADLINE))

    def python_deadline_ns(self) -> int:
        """The agent's deadline for this channel: the images' Python halves
        (PublicationImage.python_deadline_ns, which keeps their due checks in step), or now
        while output is queued."""
        if self._outbox:
            return self._now_ns
        images = self.images.values()
        return min(self._next_join_ns,
                   min((image.python_deadline_ns() for image in images), default=NO_DEADLINE))

    def poll_events(self) -> list[ReceiverEvent]:
        """Events since the last call, oldest first."""
        events = self._events
        self._events = []
        return events

    def __repr__(self) -> str:
        return f"<ReceiveChannel {self.channel} images={list(self.images)}>"
