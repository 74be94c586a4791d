"""The receivers' refusals of a network publication: the ERR frames it gets (docs/DRIVER.md
§5.7, Aeron's ``aeron_network_publication_on_error``).

An ERR says a receiver rejected the image.  :class:`PublicationRefusals` keeps each one's
reason for the conductor to log, and decides what it changes:

* one naming a live receiver from another host than its bound one is forged or stray: dropped
  (``ERR_SOURCE_MISMATCH_DROPS``), not logged;
* one naming no live receiver changes no receiver; while the publication has none, its SETUPs
  back off (:meth:`PublicationSetups.back_off
  <slipstream.daemon.streams.setups.PublicationSetups.back_off>`: to the receiver's cool-down
  for a refusal that passes with its load, RESOURCE_TEMPORARILY_UNAVAILABLE, further each
  time for any other);
* one naming a live receiver counts once a grace (two ``status_message_timeout``) passed with
  no status message of that receiver (one that rejected the image sends none for it); a status
  message of it within the grace says it goes on, and the ERR, forged from its address, is
  dropped (``ERR_CONTRADICTED_DROPS``).  Then the publication removes the receiver
  (:meth:`PublicationRefusals.take_due`).

The sender thread's; the sender agent hands :attr:`PublicationRefusals.rejections` to the
conductor after each pass.  Units: times in ns (monotonic).
"""

from __future__ import annotations

from slipstream.client.counters import SystemCounter
from slipstream.client.frames import ErrorFrame
from slipstream.client.layout import ERR_CODE_RESOURCE_TEMPORARILY_UNAVAILABLE, NO_DEADLINE
from slipstream.daemon.protocol.types import Address, ProtocolCounters
from slipstream.daemon.streams.receivers import PublicationReceivers
from slipstream.daemon.streams.setups import PublicationSetups

#: ERR reasons a publication keeps for the conductor between two passes of its sender.
REJECTIONS_PER_PASS_MAX = 16


class PublicationRefusals:
    """The ERRs of one network publication's receivers: the reasons kept for the conductor,
    and those of live receivers waiting out their grace."""

    def __init__(self, receivers: PublicationReceivers, setups: PublicationSetups,
                 counters: ProtocolCounters, grace_ns: int) -> None:
        """``receivers`` and ``setups``: the publication's; ``grace_ns``: how long an ERR of
        a live receiver waits for a status message of it that contradicts it."""
        self._receivers = receivers
        self._setups = setups
        self._counters = counters
        self._grace_ns = grace_ns
        #: ERR frames since the sender last looked: (the receiver's address, its reason).
        self.rejections: list[tuple[Address, str]] = []
        self.rejections_unkept = 0  # the pass's further ERRs: counted, their text not kept
        #: ERRs naming a live receiver, from its address: receiver id -> (the ERR, when it
        #: came).
        self._pending: dict[int, tuple[ErrorFrame, int]] = {}

    def on_error(self, frame: ErrorFrame, source: Address, now_ns: int) -> bool:
        """An ERR from ``source`` at ``now_ns``: whether it names a live receiver from that
        receiver's host (it waits out its grace)."""
        bound = self._receivers.bound_host(frame.receiver_id)
        if bound is not None and bound != source[0]:
            # Naming a live receiver from another host: forged or stray, it changes nothing.
            self._counters.add(SystemCounter.ERR_SOURCE_MISMATCH_DROPS)
            return False
        # For the conductor to log (Sender: PublicationRejected): the operator of this
        # host sees the stream stay unconnected, and this is the only word why.  The
        # conductor logs a few a second at most; more in one pass are not kept.
        if len(self.rejections) < REJECTIONS_PER_PASS_MAX:
            self.rejections.append((source, frame.message))
        else:
            self.rejections_unkept += 1
            self._counters.add(SystemCounter.REMOTE_TEXT_SUPPRESSED_DROPS)
        if bound is None:
            # No live receiver of that id: a receiver refused the image.  While none is
            # live, SETUPs back off (less for a refusal that passes with the receiver's
            # load); nothing else of the stream changes.
            if not self._receivers:
                self._setups.back_off(
                    now_ns, lasting=frame.error_code != ERR_CODE_RESOURCE_TEMPORARILY_UNAVAILABLE)
            return False
        # A live receiver's: it counts once the receiver's SMs stop (a receiver that
        # rejected the image sends none for it), within the grace; an SM of it after the
        # ERR says it is still there, and the ERR (forged from its address) is dropped.
        self._pending.setdefault(frame.receiver_id, (frame, now_ns))
        return True

    def on_status_message(self, receiver_id: int, taken_ns: int | None = None) -> None:
        """A status message of ``receiver_id`` came after its ERR, if one waits: the receiver
        goes on, so the ERR was not its.  ``taken_ns``: when the C half took it (only an ERR
        that came before then is contradicted); None: it came now, after every ERR."""
        pending = self._pending.get(receiver_id)
        if pending is None or (taken_ns is not None and taken_ns <= pending[1]):
            return
        del self._pending[receiver_id]
        self._counters.add(SystemCounter.ERR_CONTRADICTED_DROPS)

    def take_due(self, now_ns: int) -> list[ErrorFrame]:
        """The ERRs whose grace passed by ``now_ns`` with no status message of their
        receiver, in the order they came: those receivers rejected the image, and are gone
        (Aeron's onError, one grace late)."""
        if not self._pending:
            return []
        grace = self._grace_ns
        due = [rid for rid, (_, at) in self._pending.items() if now_ns >= at + grace]
        return [self._pending.pop(receiver_id)[0] for receiver_id in due]

    def next_deadline_ns(self) -> int:
        """When :meth:`take_due` next has an ERR (NO_DEADLINE: none waits)."""
        if not self._pending:
            return NO_DEADLINE
        return min(at for _, at in self._pending.values()) + self._grace_ns
