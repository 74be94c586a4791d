"""The graceful drain of the network side (:meth:`DriverConductor.drain
<slipstream.daemon.conductor.conductor.DriverConductor.drain>`'s steps for the network
publications): stop the credit, wait until every publication is flushed, end the streams
(EOS), wait until their receivers answered.

Owns no state of its own: it reads the publication entries, what the sender publishes of each
publication (its :class:`PublicationStatus`) and the counters, and the receive endpoints (a
closing embedded driver does not wait for the receivers only it reads from).  Runs on the
conductor's thread; it asks the sender, through the
:class:`~slipstream.daemon.agents.commands.SenderProxy`, to stop a publication's credit
(``on_stop_credit``) and to close it (``on_close_publication``).
"""

from __future__ import annotations

from typing import Any

from slipstream.client.counters import CountersFile
from slipstream.daemon.agents.commands import SenderProxy
from slipstream.daemon.conductor.network_records import _PublicationEntry, _ReceiveEndpointEntry
from slipstream.daemon.conductor.network_spies import SpySubscriptions
from slipstream.daemon.streams.publication import NetworkPublication
from slipstream.daemon.streams.receivers import PublicationStatus

#: EOS heartbeats a draining driver sends before it stops waiting for answers: the first as
#: the publication drained, the others 100 ms apart.
EOS_HEARTBEATS_TO_END = 3


class NetworkDrain:
    """The drain's steps for the network publications (see the module's docstring)."""

    def __init__(self, *, counters: CountersFile, sender_proxy: SenderProxy,
                 publications: dict[int, _PublicationEntry],
                 shared_publications: dict[tuple[Any, ...], _PublicationEntry],
                 receive_endpoints: dict[tuple[Any, ...], _ReceiveEndpointEntry],
                 closed_receiver_ids: dict[int, None],
                 spy_subscriptions: SpySubscriptions) -> None:
        self.counters = counters
        self.sender_proxy = sender_proxy
        self.publications = publications
        self._shared_publications = shared_publications
        self._receive_endpoints = receive_endpoints
        self._closed_receiver_ids = closed_receiver_ids
        self._spy_subscriptions = spy_subscriptions

    def stop_credit(self) -> None:
        """Every network publication stops granting credit (on the sender's thread, which
        owns pub-lmt)."""
        for entry in self.publications.values():
            self.sender_proxy.on_stop_credit(entry.publication)

    def is_flushed(self, *, closing_clients: frozenset[int] | None = None) -> bool:
        """Every publication sent its log, its live receivers acknowledged the end and its
        spies read it to the end, as IPC subscribers are waited for (``closing_clients``: an
        embedded driver closing with these clients of its own process: not waiting for this
        driver's receivers that only they read from, nor for their spies).  From what the
        sender published (:class:`PublicationStatus`) and the counters only."""
        return all(self._flushed(entry, entry.publication.status,
                                 self._closing_receiver_ids(closing_clients, entry.publication))
                   and self._spies_read_all(entry, closing_clients)
                   for entry in list(self.publications.values()))

    @staticmethod
    def _flushed(entry: _PublicationEntry, status: PublicationStatus,
                 ignored: frozenset[int]) -> bool:
        """:meth:`PublicationStatus.is_flushed_except` of ``entry``'s publication, from
        ``status`` (its last) and its counters."""
        publication = entry.publication
        end = entry.log.producer_position()
        return status.is_flushed_except(
            ignored, end=end, sender_position=publication.sender_position,
            c_acknowledged=publication.c_acknowledged())

    def _spies_read_all(self, entry: _PublicationEntry,
                        closing_clients: frozenset[int] | None) -> bool:
        """Every spy of ``entry`` (but those of ``closing_clients``, and untethered ones left
        behind) has read its log to the producer position."""
        end = entry.log.producer_position()
        return all(self.counters.get(link.counter_id) >= end for link in entry.spies
                   if not link.lingering and (closing_clients is None
                                              or link.subscription.client_id
                                              not in closing_clients))

    def _closing_receiver_ids(self, closing_clients: frozenset[int] | None,
                              publication: NetworkPublication) -> frozenset[int]:
        """This driver's receivers that only ``closing_clients`` read ``publication``'s
        stream from (or nobody now: the endpoint closed), whose acknowledgements a closing
        embedded driver does not wait for; none without ``closing_clients``.  (A receiver
        another process also reads the stream from is waited for, and its acknowledgement
        is the slowest of its subscribers', the closing application's too.)"""
        if closing_clients is None:
            return frozenset()
        session_id, stream_id = publication.session_id, publication.stream_id
        ours = {entry.endpoint.channel.receiver_id
                for entry in self._receive_endpoints.values()
                if not any(s.client_id not in closing_clients and s.wants(session_id, stream_id)
                           for s in entry.subscriptions)}
        return frozenset(ours | self._closed_receiver_ids.keys())

    def end_streams(self) -> None:
        """Close every publication still open: it sends end-of-stream (EOS heartbeats).  No
        publication's linger waits for its spies any more: the flush waited for them (but
        for a closing process's own)."""
        for entry in self.publications.values():
            if not entry.closing:
                entry.closing = True
                if self._shared_publications.get(entry.key) is entry:
                    del self._shared_publications[entry.key]
                self._spy_subscriptions.drop_spies_left_behind(entry)
            self.sender_proxy.on_close_publication(entry.publication, wait_for_spies=False)

    def has_ended_streams(self, *, closing_clients: frozenset[int] | None = None) -> bool:
        """Every publication's receivers answered its end-of-stream (an EOS-flagged status
        message takes a receiver off the list), or it sent ``EOS_HEARTBEATS_TO_END`` EOS
        heartbeats and is still flushed (an offer that passed its limit check as the credit
        stopped is acknowledged too; receivers that do not answer EOS, as Aeron 1.15's, then
        miss it only if all of them are lost), or it is gone."""
        def ended(entry: _PublicationEntry) -> bool:
            ignored = self._closing_receiver_ids(closing_clients, entry.publication)
            status = entry.publication.status
            return not status.has_receivers_except(ignored) or (
                status.eos_heartbeats_sent >= EOS_HEARTBEATS_TO_END
                and self._flushed(entry, status, ignored))

        return all(ended(entry) for entry in list(self.publications.values()))
