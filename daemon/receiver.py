"""A receive channel endpoint: dispatch of incoming datagrams to images (sans-I/O).

One :class:`ReceiveChannel` per subscribed channel endpoint on a host (Aeron's
``aeron_receive_channel_endpoint`` + ``aeron_data_packet_dispatcher``).  It owns the
:class:`PublicationImage` objects of that endpoint, keyed by ``(session_id, stream_id)``.

Dispatch rules (PROTOCOL.md §3.1):

* DATA/PAD/heartbeat for a known image → :meth:`PublicationImage.insert_packet` (the hot
  path: the 32-byte header is unpacked with one precompiled struct, nothing else decoded);
* DATA/heartbeat (not EOS) for a subscribed stream whose session has no image → an
  *elicited SETUP*: an SM with the S flag (0x80), term id/offset/window 0, to the source
  (or the control group for multicast); the session is then PENDING_SETUP for 1 s;
* SETUP for a subscribed stream and a session without image (and not filtered out by
  ``session-id=``, not cooling down) → a log from ``log_factory(setup)`` and a new image,
  announced by :class:`ImageAvailable`;
* RTTM → the image; malformed datagrams → ``INVALID_PACKETS``, dropped, never raised.

When an image is DONE it is removed and its session cools down (``cool_down_ns``, default
1 s) so stray packets of the old stream do not recreate it at once.

Units: times in ns, sizes in bytes.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

from slipstream.client.channel import Channel
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import (
    EOS_FLAG,
    SM_SEND_SETUP_FLAG,
    Rttm,
    Setup,
    StatusMessage,
    decode,
)
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.protocol_types import (
    NO_DEADLINE,
    Address,
    Datagram,
    ImageAvailable,
    ImageEvent,
    ImageUnavailable,
    ProtocolCounters,
)
from slipstream.daemon.publication_image import ImageState, PublicationImage

#: AERON_DRIVER_RECEIVER_PENDING_SETUP_TIMEOUT_NS
PENDING_SETUP_TIMEOUT_NS = 1_000_000_000
#: How long a removed image's session is ignored (slipstream choice, see module docstring).
DEFAULT_COOL_DOWN_NS = 1_000_000_000

_HEADER = struct.Struct("<iBBHiiii")  # frame_length version flags type term_offset session
#                                       stream term_id (the first 24 of the 32 bytes)
_HDR_TYPE_PAD = 0x00
_HDR_TYPE_DATA = 0x01
_HDR_TYPE_SETUP = 0x05
_HDR_TYPE_RTTM = 0x06
_CONTROL_TYPES = frozenset((0x02, 0x03, 0x04, 0x0B))  # NAK, SM, ERR, RSP_SETUP: not for us


class ReceiveChannel:
    """All images of one receive endpoint.  See the module docstring."""

    def __init__(self, *, channel: Channel, settings: DriverSettings, receiver_id: int,
                 counters: ProtocolCounters, log_factory: Callable[[Setup], LogBuffer],
                 now_ns: int, rng: random.Random,
                 cool_down_ns: int = DEFAULT_COOL_DOWN_NS) -> None:
        """``log_factory(setup)`` creates the image log: term length, initial term id,
        session, stream and mtu from the SETUP, starting at (active_term_id, term_offset)."""
        self.channel = channel
        self.settings = settings
        self.receiver_id = receiver_id
        self.counters = counters
        self.log_factory = log_factory
        self.rng = rng
        self.cool_down_ns = cool_down_ns
        control = channel.control_group if channel.endpoint is not None else None
        #: Multicast: where SMs/NAKs go (the control group); None: reply to the source.
        self.control_address: Address | None = (
            (control.host, control.port or 0) if control is not None else None)
        self.images: dict[tuple[int, int], PublicationImage] = {}
        self._subscriptions: dict[int, set[int] | None] = {}  # stream -> sessions (None: all)
        self._pending_setup: dict[tuple[int, int], int] = {}  # -> expiry ns
        self._cool_down: dict[tuple[int, int], int] = {}  # -> expiry ns
        self._outbox: list[Datagram] = []
        self._events: list[ImageEvent] = []
        self._now_ns = now_ns

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

    def remove_subscription(self, stream_id: int) -> None:
        """No more interest in ``stream_id``: its images drain (as with no subscribers)."""
        self._subscriptions.pop(stream_id, None)
        for (_session, stream), image in self.images.items():
            if stream == stream_id and image.state in (ImageState.INIT, ImageState.ACTIVE):
                for cell in list(image._subscriber_positions):
                    image.remove_subscriber_position(cell)
                if image.state is ImageState.INIT:
                    image._transition("liveness_timeout", self._now_ns)

    def _wants(self, session_id: int, stream_id: int) -> bool:
        if stream_id not in self._subscriptions:
            return False
        sessions = self._subscriptions[stream_id]
        return sessions is None or session_id in sessions

    def _reply_address(self, source: Address) -> Address:
        return self.control_address if self.control_address is not None else source

    # -- input ----------------------------------------------------------------------------
    def on_datagram(self, data: bytes | bytearray | memoryview, source: Address,
                    now_ns: int) -> None:
        """One received datagram.  Never raises on malformed input (counted, dropped)."""
        self._now_ns = now_ns
        length = len(data)
        if length < 32:
            if length >= 8 and data[4] == 0 and (data[6] | data[7] << 8) in _CONTROL_TYPES:
                return
            self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        (frame_length, version, flags, frame_type, term_offset, session_id, stream_id,
         term_id) = _HEADER.unpack_from(data)
        if version != 0:
            self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        if frame_type == _HDR_TYPE_DATA or frame_type == _HDR_TYPE_PAD:
            image = self.images.get((session_id, stream_id))
            if image is not None:
                term_length = image.term_length
                if (term_offset & 0x8000001F or term_offset + length > term_length or (
                        frame_type == _HDR_TYPE_DATA and (
                            (frame_length == 0 and length != 32)
                            or (frame_length != 0 and not 32 <= frame_length <= length))) or (
                        frame_type == _HDR_TYPE_PAD and (
                            frame_length < 32 or frame_length & 31 or length != 32
                            or term_offset + frame_length > term_length))):
                    self.counters.add(SystemCounter.INVALID_PACKETS)
                    return
                self.counters.add(SystemCounter.BYTES_RECEIVED, length)
                image.insert_packet(data, length, frame_length, flags, frame_type, term_id,
                                    term_offset, now_ns)
            elif frame_type == _HDR_TYPE_DATA and not flags & EOS_FLAG:
                self._on_unknown_session(session_id, stream_id, source, now_ns)
            return
        if frame_type == _HDR_TYPE_SETUP:
            frame = decode(data)
            if isinstance(frame, Setup):
                self._on_setup(frame, source, now_ns)
            else:
                self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        if frame_type == _HDR_TYPE_RTTM:
            frame = decode(data)
            if isinstance(frame, Rttm):
                image = self.images.get((frame.session_id, frame.stream_id))
                if image is not None:
                    image.on_rttm(frame, now_ns)
            else:
                self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        if frame_type not in _CONTROL_TYPES:
            self.counters.add(SystemCounter.INVALID_PACKETS)

    def _on_unknown_session(self, session_id: int, stream_id: int, source: Address,
                            now_ns: int) -> None:
        """Elicit a SETUP (aeron_data_packet_dispatcher_elicit_setup_from_source)."""
        if not self._wants(session_id, stream_id):
            return
        key = (session_id, stream_id)
        if now_ns < self._pending_setup.get(key, -1) or now_ns < self._cool_down.get(key, -1):
            return
        self._pending_setup[key] = now_ns + PENDING_SETUP_TIMEOUT_NS
        sm = StatusMessage(session_id, stream_id, 0, 0, 0, self.receiver_id, SM_SEND_SETUP_FLAG)
        self._outbox.append(Datagram(sm.encode(), self._reply_address(source)))
        self.counters.add(SystemCounter.STATUS_MESSAGES_SENT)

    def _on_setup(self, setup: Setup, source: Address, now_ns: int) -> None:
        key = (setup.session_id, setup.stream_id)
        if key in self.images or not self._wants(*key):
            return
        if now_ns < self._cool_down.get(key, -1):
            return
        if (setup.mtu < 32 or setup.mtu > 65504 or setup.mtu % 32
                or setup.term_length < 65536 or setup.term_length & (setup.term_length - 1)):
            self.counters.add(SystemCounter.INVALID_PACKETS)
            return
        self._pending_setup.pop(key, None)
        log = self.log_factory(setup)
        image = PublicationImage(
            log=log, setup=setup, channel=self.channel, settings=self.settings,
            receiver_id=self.receiver_id, counters=self.counters,
            control_address=self._reply_address(source), source=source, now_ns=now_ns,
            rng=self.rng)
        self.images[key] = image
        self._events.append(ImageAvailable(image))

    # -- output ---------------------------------------------------------------------------
    def datagrams_to_send(self, now_ns: int) -> list[Datagram]:
        """SMs, NAKs, elicited-SETUP SMs and RTTM replies due at ``now_ns``; also advances
        image states (events for :meth:`poll_events`)."""
        self._now_ns = now_ns
        out = self._outbox
        self._outbox = []
        done = []
        for key, image in self.images.items():
            before = image.state
            image.datagrams_to_send(now_ns, out)
            after = image.state
            if after is not before and after is ImageState.LINGER:
                self._events.append(ImageUnavailable(image))
            if after is ImageState.DONE:
                if before is not ImageState.LINGER and before is not ImageState.DONE:
                    self._events.append(ImageUnavailable(image))
                done.append(key)
        for key in done:
            del self.images[key]
            self._cool_down[key] = now_ns + self.cool_down_ns
        if self._pending_setup:
            for key in [k for k, t in self._pending_setup.items() if t <= now_ns]:
                del self._pending_setup[key]
        return out

    def next_deadline_ns(self) -> int:
        """Earliest deadline of the images (``<=`` now when output is queued)."""
        if self._outbox:
            return self._now_ns
        return min((image.next_deadline_ns() for image in self.images.values()),
                   default=NO_DEADLINE)

    def poll_events(self) -> list[ImageEvent]:
        """Image available/unavailable events since the last call, oldest first."""
        events = self._events
        self._events = []
        return events

    def __repr__(self) -> str:
        return f"<ReceiveChannel {self.channel} images={list(self.images)}>"
