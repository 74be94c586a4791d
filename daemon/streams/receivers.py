"""The receivers a network publication knows, and the snapshot of them a graceful drain reads.

A receiver is *live* while its status messages arrive within the publication's connection
timeout and it has not sent EOS or an ERR (docs/DRIVER.md §3.3): Aeron's
ReceiverLivenessTracker (``receiver_liveness_tracker`` in aeron_network_publication.c), with
what each receiver acknowledged (the position of its last status message) and where its
status messages come from.  :class:`PublicationReceivers` is the sender thread's, and keeps
the C half's copy of their addresses (the NAK rule's table, the source of the SMs the C half
takes) in step with them; :class:`PublicationStatus` is what that thread publishes of it for
the conductor's.

Units: times in ns (monotonic), positions in bytes.
"""

from __future__ import annotations

from typing import Any

import attrs

from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.protocol.types import Address, sockaddr


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
    status message, the position it acknowledged, its window, the host its status messages
    are bound to and the addresses on that host they came from.  True while it has one;
    ``receiver_id in receivers`` while that one is live.

    The binding (docs/DRIVER.md §5.7): a receiver's first status message binds its id to
    the host (IP address) it came from; while it is live, a status message naming it counts
    only from that host (:meth:`admits`), from any port there: stock Aeron gives every
    endpoint of a driver the driver's one receiver id, and a NAT may give a receiver a new
    port.  Control frames that name no receiver (NAKs, rate signals) count only from an
    address a live receiver's status messages came from (:meth:`has_source`).  A receiver
    that moved to another host (a NAT that changed its public address) is bound to it once
    the old one sent nothing for ``rebind_timeout_ns``: a forger on another host cannot take
    the id of a receiver that keeps sending."""

    def __init__(self, rebind_timeout_ns: int = 0) -> None:
        self._last_sm_ns: dict[int, int] = {}  # receiver_id -> time of last SM (liveness)
        self._acknowledged: dict[int, int] = {}  # receiver_id -> position of its last SM
        #: receiver_id -> the address its last SM came from (the C half takes SMs from it).
        self._sources: dict[int, Address] = {}
        #: receiver_id -> {address on its bound host: when an SM last came from there}.
        self._addresses: dict[int, dict[Address, int]] = {}
        self._windows: dict[int, int] = {}  # receiver_id -> the window of its last SM
        self.rebind_timeout_ns = rebind_timeout_ns
        #: Bumped whenever the set of addresses may have changed (the C half's table follows
        #: it).
        self.version = 0
        self._c_version = 0  # of the addresses in the C half's table (sync_c_sources)

    def admits(self, receiver_id: int, source: Address, now_ns: int) -> bool:
        """Whether a status message naming ``receiver_id`` from ``source`` may count at
        ``now_ns``: the receiver is not live (it binds), ``source`` is on its bound host, or
        that host was silent for ``rebind_timeout_ns`` (it rebinds)."""
        bound = self.bound_host(receiver_id)
        if bound is None or bound == source[0]:
            return True
        return now_ns - self._last_sm_ns[receiver_id] >= self.rebind_timeout_ns

    def bound_host(self, receiver_id: int) -> str | None:
        """The host a live receiver's status messages are bound to (None: not live)."""
        source = self._sources.get(receiver_id)
        return None if source is None else source[0]

    def bound_source(self, receiver_id: int) -> Address | None:
        """The address a live receiver's last status message came from (None: not live)."""
        return self._sources.get(receiver_id)

    def sources(self) -> set[Address]:
        """Every address a live receiver's status messages came from."""
        return {address for addresses in self._addresses.values() for address in addresses}

    def backlog_at(self, source: Address, sender_position: int) -> tuple[int, int]:
        """(bytes, window): the most a live receiver whose SMs came from ``source`` has
        outstanding by its last status message (``sender_position`` minus what it
        acknowledged), and that receiver's window ((0, 0) with none)."""
        best = (0, 0)
        for receiver_id, addresses in self._addresses.items():
            if source in addresses:
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
        ``window``: the receiver is live from ``now_ns``, bound to ``source``'s host (which
        :meth:`admits` allowed), and ``source`` is one of its addresses."""
        # Acknowledged first: the conductor's thread reads both (a drain).
        self._acknowledged[receiver_id] = position
        self._last_sm_ns[receiver_id] = now_ns
        self._windows[receiver_id] = window
        addresses = self._addresses.get(receiver_id)
        if addresses is None or self.bound_host(receiver_id) != source[0]:
            addresses = self._addresses[receiver_id] = {}  # bound, or bound anew
        if source not in addresses or self._sources.get(receiver_id) != source:
            self.version += 1
        addresses[source] = now_ns
        self._sources[receiver_id] = source

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
        self._addresses.pop(receiver_id, None)
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
                self._addresses.pop(rid, None)
            if expired:
                self.version += 1
        # An address of a live receiver that went silent (a port its NAT let go) goes too;
        # the one its last SM came from stays (the C half's SMs refresh the receiver only).
        for rid, addresses in self._addresses.items():
            if len(addresses) > 1:
                latest = self._sources[rid]
                stale = [a for a, t in addresses.items()
                         if a != latest and now_ns - t > timeout_ns]
                for address in stale:
                    del addresses[address]
                if stale:
                    self.version += 1

    # -- the C half's copy: what its NAK rule and status-message path read ----------------
    def set_c_sm_source(self, c: Any) -> None:
        """The C half of ``c`` (a cffi ``ss_send_publication_t *``) takes SMs of its receiver
        (``c.sm_receiver_id``) only from the address that receiver is bound to now (none
        while it is not live: then every SM goes to the Python half)."""
        bound = self.bound_source(c.sm_receiver_id)
        raw = sockaddr(bound) if bound is not None else b""
        c.sm_source_length = 0
        network_ffi.memmove(c.sm_source, raw, len(raw))
        c.sm_source_length = len(raw)

    def sync_c_sources(self, c: Any) -> None:
        """Hand the live receivers' addresses to the C half of ``c`` (the NAK rule, and the
        address its SMs come from), when they changed since the last time: at once, since the
        C half reads the rest of a batch before the pass ends."""
        if self.version == self._c_version:
            return
        self._c_version = self.version
        self.set_c_sm_source(c)
        sources = sorted(self.sources())
        if len(sources) > network.SS_CONTROL_SOURCES_MAX:
            c.control_source_count = network.SS_CONTROL_SOURCES_UNKNOWN  # Python checks
            return
        c.control_source_count = 0  # while it is rewritten: no NAK counts in between
        for i, source in enumerate(sources):
            raw = sockaddr(source)
            network_ffi.memmove(c.control_sources[i], raw, len(raw))
            c.control_source_lengths[i] = len(raw)
        c.control_source_count = len(sources)

    def last_status_message_ns(self) -> dict[int, int]:
        """receiver id -> when its last status message came (ns): a copy."""
        return dict(self._last_sm_ns)

    def acknowledged(self) -> dict[int, int]:
        """receiver id -> the position its last status message acknowledged: a copy."""
        return dict(self._acknowledged)

    def has_source(self, source: Address) -> bool:
        """Whether a live receiver's status messages came from ``source``."""
        return any(source in addresses for addresses in self._addresses.values())

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
