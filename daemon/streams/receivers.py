"""The receivers a network publication knows, and the snapshot of them a graceful drain reads.

A receiver is *live* while its status messages arrive within the publication's connection
timeout and it has not sent EOS or an ERR (docs/PROTOCOL.md §3.3): Aeron's
ReceiverLivenessTracker (``receiver_liveness_tracker`` in aeron_network_publication.c), with
what each receiver acknowledged (the position of its last status message) and where its
status messages come from.  :class:`PublicationReceivers` is the sender thread's;
:class:`PublicationStatus` is what that thread publishes of it for the conductor's.

Units: times in ns (monotonic), positions in bytes.
"""

from __future__ import annotations

import attrs

from slipstream.daemon.protocol.types import Address


@attrs.frozen
class PublicationStatus:
    """What a graceful drain needs of a network publication, as its sender's thread last
    published it (:meth:`NetworkPublication.publish_status
    <slipstream.daemon.streams.publication.NetworkPublication.publish_status>`): one immutable
    record, swapped whole, which the conductor's thread reads while the sender's thread changes
    the publication.  The drain decides from it and from counters (the log's producer position,
    snd-pos, the C half's last status message), never from the publication's own fields."""

    #: The sender's thread has stopped the publication's credit (pub-lmt holds).
    credit_stopped: bool = False
    #: Live receivers: a status message within the connection timeout, and no EOS.
    receiver_ids: frozenset[int] = frozenset()
    #: (receiver id, the position its last status message acknowledged, bytes).
    acknowledged: tuple[tuple[int, int], ...] = ()
    #: Heartbeats sent since the end of stream (EOS-flagged).
    eos_heartbeats_sent: int = 0

    def has_receivers_except(self, receiver_ids: frozenset[int]) -> bool:
        """Whether a live receiver other than those of ``receiver_ids`` is known."""
        return not self.receiver_ids <= receiver_ids

    def is_flushed_except(self, receiver_ids: frozenset[int], *, end: int, sender_position: int,
                          c_acknowledged: tuple[int, int] | None) -> bool:
        """The credit is stopped, the log up to ``end`` (its producer position) was sent
        (``sender_position``: snd-pos) and every live receiver's status message is at
        ``end`` (true without receivers: nobody is left to take it), not waiting for the
        receivers of ``receiver_ids``.  ``c_acknowledged``: (receiver id, position) of the
        status message the C half took last (:meth:`NetworkPublication.c_acknowledged
        <slipstream.daemon.streams.publication.NetworkPublication.c_acknowledged>`), which
        counts too."""
        if not self.credit_stopped:
            return False
        if sender_position < end and self.has_receivers_except(receiver_ids):
            return False
        acknowledged = dict(self.acknowledged)
        if c_acknowledged is not None and c_acknowledged[0] in acknowledged:
            receiver_id, position = c_acknowledged
            acknowledged[receiver_id] = max(acknowledged[receiver_id], position)
        return all(position >= end for receiver_id, position in acknowledged.items()
                   if receiver_id not in receiver_ids)


class PublicationReceivers:
    """The live receivers of one network publication, by receiver id: when each last sent a
    status message, the position it acknowledged, its window and the address its status
    messages are bound to.  True while it has one; ``receiver_id in receivers`` while that
    one is live.

    The binding (docs/PROTOCOL.md §5.7): a receiver's first status message binds its id to
    its source address; while it is live, a status message naming it counts only from that
    address (:meth:`admits`), and control frames that name no receiver (NAKs, rate signals)
    count only from the address of a live receiver (:meth:`has_source`).  A receiver whose
    address legitimately changes (a NAT gave it a new port) is bound to the new one once
    the old one sent nothing for ``rebind_timeout_ns``: a forger cannot take the id of a
    receiver that keeps sending, and a receiver that moved waits that long, sending on."""

    def __init__(self, rebind_timeout_ns: int = 0) -> None:
        self._last_sm_ns: dict[int, int] = {}  # receiver_id -> time of last SM (liveness)
        self._acknowledged: dict[int, int] = {}  # receiver_id -> position of its last SM
        #: receiver_id -> the address its status messages are bound to.
        self._sources: dict[int, Address] = {}
        self._windows: dict[int, int] = {}  # receiver_id -> the window of its last SM
        self.rebind_timeout_ns = rebind_timeout_ns
        #: Bumped whenever the set of bound addresses may have changed (the C half's table
        #: follows it).
        self.version = 0

    def admits(self, receiver_id: int, source: Address, now_ns: int) -> bool:
        """Whether a status message naming ``receiver_id`` from ``source`` may count at
        ``now_ns``: the receiver is not live (it binds), ``source`` is its bound address, or
        that address was silent for ``rebind_timeout_ns`` (it rebinds)."""
        bound = self._sources.get(receiver_id)
        if bound is None or bound == source:
            return True
        return now_ns - self._last_sm_ns[receiver_id] >= self.rebind_timeout_ns

    def bound_source(self, receiver_id: int) -> Address | None:
        """The address a live receiver's status messages are bound to (None: not live)."""
        return self._sources.get(receiver_id)

    def sources(self) -> set[Address]:
        """The live receivers' bound addresses."""
        return set(self._sources.values())

    def backlog_at(self, source: Address, sender_position: int) -> tuple[int, int]:
        """(bytes, window): the most a live receiver bound to ``source`` has outstanding by
        its last status message (``sender_position`` minus what it acknowledged), and that
        receiver's window ((0, 0) with none)."""
        best = (0, 0)
        for receiver_id, bound in self._sources.items():
            if bound == source:
                backlog = sender_position - self._acknowledged.get(receiver_id, sender_position)
                if backlog >= best[0]:
                    best = (backlog, self._windows.get(receiver_id, 0))
        return best

    def __len__(self) -> int:
        return len(self._last_sm_ns)

    def __contains__(self, receiver_id: int) -> bool:
        return receiver_id in self._last_sm_ns

    def on_status_message(self, receiver_id: int, position: int, source: Address,
                          now_ns: int, window: int = 0) -> None:
        """A status message (not EOS) from ``source`` acknowledged ``position`` with
        ``window``: the receiver is live from ``now_ns``, bound to ``source`` (which
        :meth:`admits` allowed)."""
        # Acknowledged first: the conductor's thread reads both (a drain).
        self._acknowledged[receiver_id] = position
        self._last_sm_ns[receiver_id] = now_ns
        self._windows[receiver_id] = window
        if self._sources.get(receiver_id) != source:
            self._sources[receiver_id] = source
            self.version += 1

    def on_c_status_message(self, receiver_id: int, position: int, taken_ns: int) -> None:
        """The C half took a status message of ``receiver_id`` at ``taken_ns`` that
        acknowledged ``position``: recorded if that receiver is live (its source is the one
        it had)."""
        if receiver_id in self._last_sm_ns:
            # Acknowledged first: the conductor's thread reads both (a drain).
            self._acknowledged[receiver_id] = position
            self._last_sm_ns[receiver_id] = taken_ns

    def remove(self, receiver_id: int) -> None:
        """``receiver_id`` ended (EOS, an ERR): not live from now on.  Unknown: ignored."""
        self._last_sm_ns.pop(receiver_id, None)
        self._acknowledged.pop(receiver_id, None)
        self._windows.pop(receiver_id, None)
        if self._sources.pop(receiver_id, None) is not None:
            self.version += 1

    def expire(self, now_ns: int, timeout_ns: int) -> None:
        """Remove every receiver whose last status message is more than ``timeout_ns`` old."""
        last_sm_ns = self._last_sm_ns
        if last_sm_ns:
            expired = [rid for rid, t in last_sm_ns.items() if now_ns - t > timeout_ns]
            for rid in expired:
                del last_sm_ns[rid]
                self._acknowledged.pop(rid, None)
                self._windows.pop(rid, None)
                self._sources.pop(rid, None)
            if expired:
                self.version += 1

    def last_status_message_ns(self) -> dict[int, int]:
        """receiver id -> when its last status message came (ns): a copy."""
        return dict(self._last_sm_ns)

    def acknowledged(self) -> dict[int, int]:
        """receiver id -> the position its last status message acknowledged: a copy."""
        return dict(self._acknowledged)

    def has_source(self, source: Address) -> bool:
        """Whether a live receiver's status messages came from ``source``."""
        return source in self._sources.values()

    def sole(self) -> tuple[int, int] | None:
        """(receiver id, time of its last status message) of the one live receiver; None
        without one or with more."""
        if len(self._last_sm_ns) != 1:
            return None
        return next(iter(self._last_sm_ns.items()))

    def earliest_status_message_ns(self) -> int:
        """When the live receiver heard from longest ago last sent a status message (there
        must be one)."""
        return min(self._last_sm_ns.values())

    def status(self, *, credit_stopped: bool, eos_heartbeats_sent: int) -> PublicationStatus:
        """The snapshot of them that the drain reads, with the publication's credit stop and
        EOS heartbeats."""
        return PublicationStatus(credit_stopped, frozenset(self._last_sm_ns),
                                 tuple(self._acknowledged.items()), eos_heartbeats_sent)
