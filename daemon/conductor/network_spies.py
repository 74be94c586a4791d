"""Spy subscriptions (``aeron-spy:``): subscriptions that read this driver's network
publications' logs in place, as Aeron's spies do (DriverConductor.onAddSpySubscription,
linkSpies).

Owns the spies (by registration id), their links to publications (a sub-pos counter each, in
the publication's entry's ``spies``), the spy hold that keeps a joining spy's data in the log,
and the AVAILABLE_IMAGE messages that a new publication's spies make outside a command's
answer.  Runs on the conductor's thread.  It asks the sender, through the
:class:`~slipstream.daemon.agents.commands.SenderProxy`, to take a spy's position
(``on_add_spy``) and to let it go (``on_remove_spy``); the sender answers with
:class:`SpyLinked`, :class:`SpyUnlinked` and :class:`SpiesReleased`.  Untethered spies are
checked in :mod:`.untethered`.
"""

from __future__ import annotations

import logging

from slipstream.client._native import lib as native
from slipstream.client.counters import CountersFile, CountersFullError, CounterType, SystemCounter
from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon.agents.commands import SenderProxy
from slipstream.daemon.conductor import messages
from slipstream.daemon.conductor.messages import ClientMessage, Outgoing
from slipstream.daemon.conductor.network_records import (
    NetworkSubscription,
    NetworkTransports,
    _PublicationEntry,
    _resolved,
)
from slipstream.daemon.conductor.sharing import destination_of, endpoint_key
from slipstream.daemon.conductor.untethered import tether_for
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media.events import SpyLinked, SpyUnlinked
from slipstream.daemon.media.names import NameCache
from slipstream.daemon.streams.publication import NetworkPublication
from slipstream.daemon.streams.tether import TetherablePosition

log = logging.getLogger("slipstream.driver")

#: The source identity of a spy's image, as Aeron gives it (CommonContext.IPC_CHANNEL): the log
#: is read in place on this host.
SPY_SOURCE_IDENTITY = "aeron:ipc"


class SpySubscriptions:
    """The spies of this driver's network publications, and their links to them."""

    def __init__(self, *, settings: DriverSettings, counters: CountersFile,
                 transports: NetworkTransports, sender_proxy: SenderProxy,
                 publications: dict[int, _PublicationEntry],
                 spies: dict[int, NetworkSubscription], name_cache: NameCache) -> None:
        self.settings = settings
        self.counters = counters
        self.transports = transports
        self.sender_proxy = sender_proxy
        self.publications = publications
        #: Spy subscriptions (``aeron-spy:``), by registration id; they have no endpoint.
        self.spies = spies
        #: The resolver's answers, which a spy's channel's names are replaced with.
        self.name_cache = name_cache
        #: Messages to clients made outside a command's answer (the images of spies linked to
        #: a new publication), sent on the next duty cycle.
        self._spy_out: Outgoing = []
        #: Sub-pos counters of unlinked spies the sender has not dropped yet (SpyUnlinked).
        self._spy_counters_unlinking: set[int] = set()

    def add_spy(self, spy: NetworkSubscription, now_ns: int) -> Outgoing:
        """An ``aeron-spy:`` subscription: it reads every publication of this driver on its
        channel's send endpoint (address and interface) whose stream, and session if it names
        one, it wants, those present and those made later (Aeron's onAddSpySubscription and
        linkSpies); the AVAILABLE_IMAGE messages of those present are returned.  A closing
        publication takes no new spy."""
        channel = spy.channel = _resolved(spy.channel, self.name_cache,
                                          self.transports.local_addresses)
        spy.spied_key = endpoint_key(channel, destination_of(channel))
        self.spies[spy.registration_id] = spy
        out: Outgoing = []
        try:
            for entry in list(self.publications.values()):
                if _spies_on(spy, entry):
                    out.append(self.link_spy(entry, spy, now_ns))
        except CountersFullError:
            # All or nothing, as add_subscription: a spy nobody owns would hold its
            # publications back for good.
            self.remove_spy(spy.registration_id)
            raise
        return out

    def remove_spy(self, registration_id: int) -> bool:
        """The spy ``registration_id`` goes (False if it is none): its positions stop holding
        publications back."""
        spy = self.spies.pop(registration_id, None)
        if spy is None:
            return False
        for entry in self.publications.values():
            for link in [k for k in entry.spies if k.subscription is spy]:
                self.unlink_spy(entry, link)
            entry.resting_spies = [k for k in entry.resting_spies if k.subscription is not spy]
        return True

    def link_spies(self, entry: _PublicationEntry, now_ns: int) -> None:
        """A new publication: every spy that wants it reads it (Aeron's linkSpies); one the
        counters have no room for is logged and linked later, on the timer, once there is
        room (:meth:`link_missed_spies`).  Their AVAILABLE_IMAGE messages go out on the next
        duty cycle (:meth:`take_messages`)."""
        out: Outgoing = []
        for spy in list(self.spies.values()):
            if _spies_on(spy, entry):
                try:
                    out.append(self.link_spy(entry, spy, now_ns))
                except CountersFullError as e:
                    self.counters.add(SystemCounter.ERRORS)
                    log.error("cannot link spy subscription %d to publication %d yet (tried "
                              "again on the timer): %s", spy.registration_id,
                              entry.registration_id, e)
                    entry.missed_spies.append(spy)
        self._spy_out.extend(out)

    def link_missed_spies(self, now_ns: int) -> Outgoing:
        """On the conductor's timer: the spies a publication missed as it was made (the
        counters were full) are linked if there is room now."""
        out: Outgoing = []
        for entry in self.publications.values():
            for spy in list(entry.missed_spies):
                if entry.closing or self.spies.get(spy.registration_id) is not spy:
                    entry.missed_spies.remove(spy)  # it takes no spy, or the spy went
                    continue
                try:
                    out.append(self.link_spy(entry, spy, now_ns))
                except CountersFullError:
                    continue  # logged once, as it was missed
                entry.missed_spies.remove(spy)
        return out

    def link_spy(self, entry: _PublicationEntry, spy: NetworkSubscription,
                 now_ns: int) -> ClientMessage:
        """A sub-pos counter for ``spy`` at the publication's sender position (Aeron's
        linkSpy: a spy joins where the network is), handed to the sender, and the
        AVAILABLE_IMAGE of it: the publication's own log, under the publication's
        registration id."""
        publication = entry.publication
        join = self._hold_for_spy(entry)
        try:
            counter_id = self.counters.allocate(
                CounterType.SUBSCRIBER_POSITION,
                f"sub-pos: {spy.channel} stream={publication.stream_id} "
                f"session={publication.session_id} sub={spy.registration_id}",
                registration_id=spy.registration_id, session_id=publication.session_id,
                stream_id=publication.stream_id, owner_id=spy.client_id, initial_value=join)
        except CountersFullError:
            self._release_join(entry)  # no link after all: its hold goes
            raise
        cell = self.counters.address(counter_id)
        entry.spies.append(TetherablePosition(spy, counter_id, cell,
                                              tether_for(spy.channel, self.settings, now_ns)))
        self.sender_proxy.on_add_spy(publication, cell, entry.registration_id)
        return (spy.client_key, messages.available_image(
            image_registration_id=entry.registration_id,
            subscription_registration_id=spy.registration_id,
            session_id=publication.session_id, stream_id=publication.stream_id,
            log_file=entry.log.path, subscriber_position_counter_id=counter_id,
            join_position=join, source_identity=SPY_SOURCE_IDENTITY,
            # A spy names no key; the stream it reads leaves sealed under its endpoint's.
            channel_key=entry.endpoint.channel.key))

    def _hold_for_spy(self, entry: _PublicationEntry) -> int:
        """A spy's join position: the publication's sender position, which its log keeps
        until the sender has taken the spy (:class:`SpyLinked`).  The publication's spy hold
        is lowered to it with a full fence, then the sender position read again: cleaning
        stays a term behind what the C half read, so unless the sender went a term further
        meanwhile nothing from the join position on was cleaned, and from the hold on nothing
        will be (network.h, ``spy_hold``).  Otherwise it tries again from there."""
        publication = entry.publication
        hold = publication.spy_hold
        term_length = entry.log.term_length
        entry.spy_joins_pending += 1
        while True:
            join = publication.sender_position
            held = native.ss_load_acquire_i64(hold)
            native.ss_cas_i64(hold, held, min(held, join))  # only this thread writes it
            if publication.sender_position <= join + term_length:
                return join

    def _release_join(self, entry: _PublicationEntry) -> None:
        """A spy link is no longer pending: once none is, the hold goes."""
        entry.spy_joins_pending -= 1
        if entry.spy_joins_pending == 0:
            native.ss_store_release_i64(entry.publication.spy_hold, NO_DEADLINE)

    def unlink_spy(self, entry: _PublicationEntry,
                   link: TetherablePosition[NetworkSubscription], *,
                   tell: bool = False) -> Outgoing:
        """The spy of ``link`` stops reading ``entry``'s publication: its position holds
        nothing back from the sender's next command on; with ``tell``, its client hears that
        the image is gone (UNAVAILABLE_IMAGE).  Its counter is freed once the sender has
        dropped it (:class:`SpyUnlinked`), so the sender never reads a counter reused."""
        entry.spies.remove(link)
        publication, cell, counter_id = entry.publication, link.cell, link.counter_id
        self._spy_counters_unlinking.add(counter_id)
        self.sender_proxy.on_remove_spy(publication, cell, counter_id)
        if not tell:
            return []
        return [(link.subscription.client_key, messages.unavailable_image(
            image_registration_id=entry.registration_id,
            subscription_registration_id=link.subscription.registration_id,
            stream_id=publication.stream_id))]

    def drop_spies_left_behind(self, entry: _PublicationEntry) -> None:
        """``entry`` starts closing (before its close command goes to the sender): its
        untethered spies left behind stop holding it at once (their clients were told as they
        were left), and its resting ones will not rejoin it (a closing publication takes no
        spy).  The timer leaves a closing publication alone, so a lingering spy kept would
        hold its DRAINING for good."""
        for link in [k for k in entry.spies if k.lingering]:
            self.unlink_spy(entry, link)
        entry.resting_spies.clear()

    def on_spies_released(self, publication: NetworkPublication) -> Outgoing:
        """A closed publication's spies read it all (:class:`SpiesReleased`), or it is done:
        their images end."""
        entry = next((e for e in self.publications.values() if e.publication is publication),
                     None)
        if entry is None:
            return []
        out: Outgoing = []
        for link in list(entry.spies):  # a lingering one's client was told already
            out.extend(self.unlink_spy(entry, link, tell=not link.lingering))
        entry.resting_spies.clear()
        return out

    def on_spy_linked(self, event: SpyLinked) -> None:
        """The sender took a spy's position: the publication's hold goes once no link is
        pending."""
        linked = self.publications.get(event.registration_id)
        if linked is not None:  # else it is done, and its hold gone with it
            self._release_join(linked)

    def on_spy_unlinked(self, event: SpyUnlinked) -> None:
        """The sender dropped an unlinked spy's position: its counter is freed."""
        if event.counter_id in self._spy_counters_unlinking:
            self._spy_counters_unlinking.discard(event.counter_id)
            self.counters.free(event.counter_id)

    @property
    def has_messages(self) -> bool:
        """Whether messages to clients wait for the next duty cycle (:meth:`take_messages`)."""
        return bool(self._spy_out)

    def take_messages(self) -> Outgoing:
        """The messages to clients made outside a command's answer since the last call."""
        out, self._spy_out = self._spy_out, []
        return out

    def close(self) -> None:
        """Free what is left (the network thread has stopped): the counters of spies the
        sender had not dropped; and forget every spy."""
        for counter_id in self._spy_counters_unlinking:  # the sender stopped first
            self.counters.free(counter_id)
        self._spy_counters_unlinking.clear()
        self.spies.clear()


def _spies_on(spy: NetworkSubscription, entry: _PublicationEntry) -> bool:
    """Whether ``spy`` reads ``entry``'s publication (Aeron's SpySubscriptionLink.matches): the
    same send endpoint (whatever its key: a spy takes none, and reads the logs of both a plain
    and a keyed endpoint to its address), its stream, and its session if the spy names one;
    not once closing."""
    return (not entry.closing and spy.spied_key == entry.endpoint.key[0]
            and spy.wants(entry.publication.session_id, entry.publication.stream_id))

