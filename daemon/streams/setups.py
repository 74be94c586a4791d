"""The SETUP frames of a network publication: what they say and when they go
(``aeron_network_publication_setup_message_check``, docs/DRIVER.md §3.1).

A publication sends a SETUP every :data:`SETUP_TIMEOUT_NS` until its first status message
comes, and again while a receiver elicits it (an S-flagged status message) until it has live
receivers.  While no receiver is live, each ERR (a receiver refused the image:
:class:`~slipstream.daemon.streams.refusals.PublicationRefusals`) spaces them further apart
(:meth:`PublicationSetups.back_off`).  :class:`PublicationSetups` keeps that timing and makes
the frames; the publication decides when they are due at all (no status message yet, or
elicited).  The sender thread's.

Units: times in ns (monotonic), positions in bytes.
"""

from __future__ import annotations

from slipstream.client.frames import (
    SETUP_GROUP_FLAG,
    SETUP_SEND_RESPONSE_FLAG,
    Setup,
    StatusMessage,
)
from slipstream.client.logbuffer import LogBuffer, compute_term_id
from slipstream.daemon.flow.flow_control import FlowControl
from slipstream.daemon.protocol.params import PublicationParams
from slipstream.daemon.protocol.types import Address, Datagram

#: AERON_NETWORK_PUBLICATION_SETUP_TIMEOUT_NS.
SETUP_TIMEOUT_NS = 100_000_000
#: While no receiver is live, an ERR (a receiver refused the image) spaces SETUPs at least
#: this far apart (a refusing receiver cools the session down for a second: sooner ones
#: would be dropped unread), each further refused SETUP twice as far, up to
#: SETUP_BACKOFF_MAX_NS (slipstream).
SETUP_REFUSED_INTERVAL_NS = 1_000_000_000
SETUP_BACKOFF_MAX_NS = 8_000_000_000
#: The interval after a refusal runs from its ERR (the receiver's cool-down runs from the
#: refusal, a little after the SETUP came), but from no later than this after the SETUP
#: refused: ERRs, forged or not, hold a stream's next SETUP off by at most this more.
SETUP_REFUSAL_WINDOW_NS = 500_000_000
#: A time before any SETUP.
_NEVER_SENT = -(1 << 62)


class PublicationSetups:
    """The SETUPs of one network publication: their frame, their interval (backed off while
    receivers refuse the image) and whether a receiver elicits them."""

    def __init__(self, c: object, log: LogBuffer, params: PublicationParams,
                 flow_control: FlowControl, destination: Address, now_ns: int) -> None:
        """``c``: the publication's ``ss_send_publication_t`` (its snd-pos and snd-lmt);
        ``log``, ``params``, ``flow_control`` and ``destination`` (the endpoint, or the data
        group): the publication's; the first SETUP is due at ``now_ns``."""
        self._c = c
        self._log = log
        self._flow_control = flow_control
        self._destination = destination
        self._mask = log.term_length - 1
        self._ttl = params.setup_ttl
        # SEND_RESPONSE: a request publication asks its image's driver for an RSP_SETUP.
        self._flags = ((SETUP_GROUP_FLAG if params.group else 0)
                       | (SETUP_SEND_RESPONSE_FLAG if params.sends_response_setup else 0))
        #: A receiver asked for a SETUP (an S-flagged status message) and there is no live
        #: receiver yet to have sent one since.
        self.elicited = False
        self._time_of_last_ns = now_ns - SETUP_TIMEOUT_NS  # first SETUP at once
        #: SETUP_TIMEOUT_NS, or longer while receivers refuse the image (ERR frames).
        self._interval_ns = SETUP_TIMEOUT_NS
        self._last_sent_ns = _NEVER_SENT
        #: The SETUP (its time) whose refusals set the interval last, the interval before
        #: them, and whether one of them was for a lasting cause (back_off); the SETUP after
        #: which a receiver asked for the next at once (on_request).
        self._refused_sent_ns = _NEVER_SENT
        self._asked_after_ns = _NEVER_SENT
        self._interval_before_ns = SETUP_TIMEOUT_NS
        self._refused_lasting = False

    def frame(self) -> bytes:
        """A SETUP for the stream as it is now (at snd-pos): what a receiver makes its image
        from.  Whoever sends it calls :meth:`sent`."""
        position = self._c.sender_position[0]
        log = self._log
        return Setup(position & self._mask, log.session_id, log.stream_id, log.initial_term_id,
                     compute_term_id(position, log.position_bits, log.initial_term_id),
                     log.term_length, log.mtu, self._ttl, self._flags).encode()

    def sent(self, now_ns: int) -> None:
        """A :meth:`frame` went out: flow control hears where it puts a receiver (``fc=min``
        admission)."""
        self._last_sent_ns = now_ns
        self._flow_control.on_setup_frame(self._c.sender_position[0], now_ns)

    def check(self, now_ns: int, out: list[Datagram], *, has_receivers: bool) -> None:
        """While SETUPs are due: add one to ``out`` once the interval passed since the last.
        ``has_receivers``: the publication has live receivers (the interval is back to
        :data:`SETUP_TIMEOUT_NS`, and the SETUP answers what elicited it)."""
        if has_receivers:
            self._interval_ns = SETUP_TIMEOUT_NS
        if now_ns - self._time_of_last_ns < self._interval_ns:
            return
        out.append(Datagram(self.frame(), self._destination))
        self.sent(now_ns)
        self._time_of_last_ns = now_ns
        self._flow_control.on_setup(now_ns, self._c.sender_limit[0])
        if has_receivers:
            self.elicited = False

    def next_deadline_ns(self) -> int:
        """When the next SETUP goes, while they are due."""
        return self._time_of_last_ns + self._interval_ns

    def send_next_at(self, now_ns: int) -> None:
        """While SETUPs are due, the next goes at ``now_ns`` rather than an interval after
        the last."""
        self._time_of_last_ns = now_ns - self._interval_ns

    def on_request(self, sm: StatusMessage, source: Address, now_ns: int) -> None:
        """A receiver at ``source`` asks for a SETUP (``sm``, S-flagged;
        ``aeron_network_publication_trigger_send_setup_frame``, which the publication calls
        only before its end of stream): SETUPs are due until it is live (flow control hears
        of it), and one goes at once if they were backed off (its cool-down over, it may have
        room now)."""
        self.elicited = True
        self._flow_control.on_trigger_send_setup(sm, source, now_ns)
        if self._interval_ns > SETUP_TIMEOUT_NS:
            self.send_next_at(now_ns)
            self._asked_after_ns = self._last_sent_ns

    def back_off(self, now_ns: int, *, lasting: bool = True) -> None:
        """A receiver refused the image while none is live (its ERR came at ``now_ns``): for
        a ``lasting`` cause the interval doubles, at least
        :data:`SETUP_REFUSED_INTERVAL_NS`, at most :data:`SETUP_BACKOFF_MAX_NS`; for one that
        passes with the receiver's load (its logs in the making, its images not yet heard)
        it is SETUP_REFUSED_INTERVAL_NS, the receiver's cool-down: a peer adding thousands
        of streams at once has each asked again as soon as the receiver listens, not ever
        later.  One SETUP refused moves the interval once, whatever the number of receivers
        that refused it (a lasting cause's refusal over the others').  The interval runs
        from the ERR, or from SETUP_REFUSAL_WINDOW_NS after the SETUP refused if the ERR
        comes later.  An ERR changes nothing before the first SETUP (it answers none), nor
        once a receiver asked for the next SETUP at once (it has room now)."""
        if self._last_sent_ns in (_NEVER_SENT, self._asked_after_ns):
            return
        if self._refused_sent_ns != self._last_sent_ns:  # the first refusal of this SETUP
            self._refused_sent_ns = self._last_sent_ns
            self._interval_before_ns = self._interval_ns
            self._refused_lasting = False
            if not lasting:
                self._interval_ns = SETUP_REFUSED_INTERVAL_NS
        if lasting and not self._refused_lasting:
            self._refused_lasting = True
            self._interval_ns = min(max(2 * self._interval_before_ns, SETUP_REFUSED_INTERVAL_NS),
                                    SETUP_BACKOFF_MAX_NS)
        self._time_of_last_ns = max(self._time_of_last_ns,
                                    min(now_ns, self._last_sent_ns + SETUP_REFUSAL_WINDOW_NS))
