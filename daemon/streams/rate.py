"""A network publication's send-rate control (``rc=``, docs/DRIVER.md §5.6) as it meets the
network: its announcements to the receivers, the NAK-strength signals it heeds (§5.7), and
the limit it hands the C data path.

The strategy (:class:`~slipstream.daemon.flow.rate_control.RateControl`) decides the limit;
:class:`PublicationRateControl` announces it every :data:`ANNOUNCE_INTERVAL_NS` and at once
to a new receiver, passes it the signals that count and the ticks it asks for, and hands its
limit to the publication's ``ss_send_publication_t`` (a token bucket the data path enforces
per datagram) and to the ``snd-rate`` counter.  The sender thread's.

Units: times in ns (monotonic), positions in bytes, rates in bytes/s.
"""

from __future__ import annotations

from slipstream.client._native import lib
from slipstream.client.counters import SystemCounter
from slipstream.client.frames import RateSignal
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.flow.flow_control import FlowControl
from slipstream.daemon.flow.rate_control import ANNOUNCE_INTERVAL_NS, RateControl
from slipstream.daemon.protocol.types import Address, Datagram, ProtocolCounters
from slipstream.daemon.streams.receivers import PublicationReceivers


class PublicationRateControl:
    """The send-rate control of one network publication: see the module docstring."""

    def __init__(self, control: RateControl, c: object, *, log: LogBuffer,
                 limit_cell: object, receivers: PublicationReceivers,
                 flow_control: FlowControl, counters: ProtocolCounters, destination: Address,
                 now_ns: int) -> None:
        """``control``: the strategy; ``c``: the publication's ``ss_send_publication_t``;
        ``limit_cell``: its ``snd-rate`` counter (cffi ``int64_t *``, or None); ``log``,
        ``receivers``, ``flow_control`` and ``destination``: the publication's.  The first
        announcement is due at ``now_ns``."""
        self.control = control
        self._c = c
        self._log = log
        self._limit_cell = limit_cell
        self._receivers = receivers
        self._flow_control = flow_control
        self._counters = counters
        self._destination = destination
        self._announce_deadline_ns = now_ns

    def check(self, now_ns: int, out: list[Datagram]) -> None:
        """The strategy's tick, if due, and the announcement, if due, added to ``out``."""
        control = self.control
        if now_ns >= control.next_deadline_ns():
            control.on_tick(now_ns, self._c.sender_position[0])
            self._apply_limit(now_ns)
        if now_ns >= self._announce_deadline_ns:
            log = self._log
            out.append(Datagram(control.announcement(log.session_id, log.stream_id).encode(),
                                self._destination))
            self._announce_deadline_ns = now_ns + ANNOUNCE_INTERVAL_NS

    def announce_at(self, now_ns: int) -> None:
        """The next announcement goes at ``now_ns`` (a new receiver: tell it to signal)."""
        self._announce_deadline_ns = now_ns

    def next_deadline_ns(self) -> int:
        """When :meth:`check` next has something to do."""
        return min(self.control.next_deadline_ns(), self._announce_deadline_ns)

    def on_signal(self, signal: RateSignal, source: Address, now_ns: int) -> None:
        """A NAK-strength signal from ``source``: the strategy hears it if it counts
        (:meth:`_counts`) and flow control heeds its group tag; a cut goes to the data path
        at once."""
        if not self._counts(signal, source):
            return
        if not self._flow_control.heeds_rate_signal(signal.group_tag):
            # fc=tagged: a receiver outside the group never holds the sender back,
            # nor does its signal.
            self._counters.add(SystemCounter.RATE_SIGNALS_IGNORED)
        elif self.control.on_signal(now_ns, signal.threshold, self._c.sender_position[0],
                                    signal.consumption_rate):
            self._counters.add(SystemCounter.RATE_CUTS)
            self._apply_limit(now_ns)

    def _counts(self, signal: RateSignal, source: Address) -> bool:
        """Whether a NAK-strength signal from ``source`` may slow the sender: it comes from a
        live receiver's address, and that receiver's own status messages show the backlog it
        claims (snd-pos minus what it acknowledged, at least the claimed threshold of its
        window: an honest receiver's acknowledged position is at or behind its slowest
        subscriber, its top at or behind snd-pos, and its SMs leave in order with its
        signals) and no more than its window beyond the
        resend window.  Each refusal is counted by its cause."""
        if not self._receivers.has_source(source):
            self._counters.add(SystemCounter.RATE_SIGNAL_UNKNOWN_SOURCE_DROPS)
            return False
        backlog, window = self._receivers.backlog_at(source, self._c.sender_position[0])
        # Nor more than a receiver can hold and still be repaired: its window beyond what the
        # publication can resend (half a term); one that far behind is left behind, and SMs
        # frozen that far back are a forger's.
        if (backlog * 100 < signal.threshold * window
                or backlog > window + (self._log.term_length >> 1)):
            self._counters.add(SystemCounter.RATE_SIGNAL_UNBACKED_DROPS)
            return False
        return True

    def _apply_limit(self, now_ns: int) -> None:
        """Hand the strategy's limit to the C data path (and the snd-rate counter)."""
        c = self._c
        limit = self.control.rate_limit
        if limit == c.rate_limit:
            return
        if not c.rate_limit:  # a new limit starts with a full bucket
            c.rate_time_ns = now_ns
            c.rate_credit = self.control.burst()
        c.rate_burst = self.control.burst()
        c.rate_limit = limit
        if self._limit_cell is not None:
            lib.ss_store_release_i64(self._limit_cell, limit)
