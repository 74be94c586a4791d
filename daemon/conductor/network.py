"""The conductor's network half: UDP publications, subscriptions, images, spies and endpoints.

The :class:`~slipstream.daemon.conductor.conductor.DriverConductor` hands every ``aeron:udp``
command here.  This object creates what the network agents need (logs, position counters, the
sans-I/O :class:`NetworkPublication` and :class:`PublicationImage` objects, endpoint transports)
on the conductor's thread and hands them to the :class:`Sender` and :class:`Receiver` agents with
commands; the agents answer with events (a SETUP asks for an image, an image or publication is
done, an endpoint was removed).  A resource is freed only on the event that says the agent no
longer uses it, so the network thread never touches an unmapped log.  As in Aeron
(DriverConductor / Sender / Receiver): the threads share no mutable object except through
these queues, and position counters (and each publication's spy hold, a position cell this
thread lowers while it links a spy: docs/DRIVER.md §3.7).

:class:`NetworkConductor` is a facade: it makes the agents, their proxies and the entry
dictionaries, and hands each part what it needs of them.  Every part runs on the conductor's
thread and asks the agents only through the proxies:

- :mod:`.network_send`: network publications, send endpoints, multi-destination-cast
  destinations, response publications, and what the pressure governor samples (asks the
  sender; the receiver to have a request image send RSP_SETUP);
- :mod:`.network_receive`: subscriptions, receive endpoints, a multi-destination
  subscription's destinations, images (asks the receiver);
- :mod:`.network_spies`: spy subscriptions and their links to publications (asks the sender);
- :mod:`.untethered`: the untethered check of spies and images;
- :mod:`.network_drain`: the graceful drain's steps (asks the sender);
- :mod:`.network_records`: the records they share, and the transports' interface.

Here: the agents' events, each handed to its part in the conductor's duty cycle, and freeing
everything at close.

Names in a channel become IP literals in the parts when the channel is added
(:func:`~.network_records._resolved`; the driver shell resolved them in a thread first,
:mod:`slipstream.daemon.media.names`); the protocol core only ever sees IP literals.  A
unicast endpoint's name is resolved again while its peer is silent (:attr:`names`: the
runner resolves what :meth:`names_due` asks for, off this thread, and hands the answers to
:meth:`on_names_resolved`, which moves the endpoint to a changed address).  Sockets
are opened, and the host's interface addresses listed (for ``interface=`` as a subnet), by the
injected :class:`NetworkTransports` (real UDP sockets and ``getifaddrs`` in the driver, a
virtual network and the simulated host's address in the simulator), so the network side does
no I/O of its own beyond creating log files.

Units: times in ns, sizes in bytes.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Container, Mapping
from pathlib import Path
from typing import Any

from slipstream.client import control
from slipstream.client.channel import Channel
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.client.logbuffer import LogBuffer
from slipstream.client.publication import PublicationRefusal
from slipstream.daemon.agents.commands import ReceiverProxy, SenderProxy
from slipstream.daemon.agents.receiver import Receiver
from slipstream.daemon.agents.sender import Sender
from slipstream.daemon.conductor.image_logs import ImageLogMaker, LogMaking
from slipstream.daemon.conductor.log_pool import LogPool
from slipstream.daemon.conductor.messages import Outgoing
from slipstream.daemon.conductor.network_drain import NetworkDrain
from slipstream.daemon.conductor.network_receive import ReceiveSide
from slipstream.daemon.conductor.network_records import (
    NetworkSubscription,
    NetworkTransports,
    _NamedDestination,
    _PublicationEntry,
    _ReceiveEndpointEntry,
    _SendEndpointEntry,
)
from slipstream.daemon.conductor.network_send import SendSide
from slipstream.daemon.conductor.network_spies import SpySubscriptions
from slipstream.daemon.conductor.resources import LogBudget
from slipstream.daemon.conductor.untethered import NetworkUntethered
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.media.events import (
    DestinationsSilent,
    EndpointRemoved,
    ImageDone,
    ImageRejected,
    ImageRequested,
    ImageUnavailable,
    NetworkEvent,
    PublicationDone,
    PublicationRejected,
    ReceiveDestinationFailed,
    ResponseSetupArrived,
    RetargetFailed,
    SpiesReleased,
    SpyLinked,
    SpyUnlinked,
)
from slipstream.daemon.media.names import NameCache, NameWatch
from slipstream.daemon.media.send_channel import SendChannel
from slipstream.daemon.pressure.episodes import EpisodeEvent
from slipstream.daemon.reports.loss_report import FILE as LOSS_REPORT_FILE
from slipstream.daemon.reports.loss_report import LossReport

__all__ = ["NetworkConductor", "NetworkSubscription", "NetworkTransports"]

log = logging.getLogger("slipstream.driver")

#: Agent events handled per conductor duty cycle; the rest wait for the next (at once).
MAX_EVENTS_PER_CYCLE = 64


class NetworkConductor:
    """Owns the driver's network resources.  Single-threaded: the conductor's thread calls it;
    the agents it creates run on the network thread (see the module docstring)."""

    def __init__(self, *, settings: DriverSettings, directory: Path, counters: CountersFile,
                 transports: NetworkTransports, budget: LogBudget, rng: random.Random,
                 token_rng: random.Random,
                 new_id: Callable[[], int], new_session_id: Callable[[], int],
                 wake_network: Callable[[], None] = lambda: None,
                 wake_conductor: Callable[[], None] = lambda: None,
                 image_logs: LogMaking = LogMaking.INLINE,
                 name_cache: NameCache | None = None) -> None:
        """``image_logs``: where images' logs are made (:mod:`.image_logs`): on a worker
        thread (a driver process's), one per cycle on this thread (an embedded driver's),
        or at once (the simulator's, deterministic).  ``name_cache``: the driver's
        resolver's answers, which channels' names are replaced with (None: an empty one:
        IP literals only).  ``rng``: the network side's random choices (initial term ids,
        NAK delays); ``token_rng``: the values a forger must not guess, the dynamic
        multi-destination-cast endpoints' validation tokens and the receiver ids (the
        sender's and the conductor's threads draw them: a generator that keeps no state, or
        the simulator's, where one thread runs everything)."""
        self.settings = settings
        self.directory = directory
        self.counters = counters
        self.transports = transports
        self.budget = budget
        self.name_cache = name_cache if name_cache is not None else NameCache()
        self._wake_conductor = wake_conductor
        self._events: deque[NetworkEvent] = deque()
        #: Receivers' refusals of publications' images, for their publishers
        #: (:meth:`take_refusals`).
        self._refusals: list[tuple[int, PublicationRefusal]] = []
        self.loss_report = LossReport(directory / LOSS_REPORT_FILE,
                                      mode=settings.file_mode(clients_write=False))
        self.sender = Sender(
            on_event=self._post,
            max_datagrams_per_send=settings.network_publication_max_messages_per_send,
            status_poll_ratio=settings.send_to_status_poll_ratio)
        self.receiver = Receiver(on_event=self._post)
        #: The conductor's only way to ask the agents for work (their command queues).
        self.sender_proxy = SenderProxy(self.sender.enqueue, wake_network)
        self.receiver_proxy = ReceiverProxy(self.receiver.enqueue, wake_network)
        self._send_endpoints: dict[tuple[Any, ...], _SendEndpointEntry] = {}
        self._receive_endpoints: dict[tuple[Any, ...], _ReceiveEndpointEntry] = {}
        #: Receiver ids of this driver's receive endpoints that closed (random 63-bit: no
        #: other driver's): their status messages may still count at a publication.  An
        #: ordered set, the newest RECEIVER_IDS_KEPT kept; open endpoints' are in
        #: _receive_endpoints.
        self._closed_receiver_ids: dict[int, None] = {}
        self.publications: dict[int, _PublicationEntry] = {}
        #: The publications later publishers of their key join (not exclusive ones), by key.
        self._shared_publications: dict[tuple[Any, ...], _PublicationEntry] = {}
        self.subscriptions: dict[int, NetworkSubscription] = {}
        #: Spy subscriptions (``aeron-spy:``), by registration id; they have no endpoint.
        self.spies: dict[int, NetworkSubscription] = {}
        #: Response publications whose request images send RSP_SETUP for them, until they are
        #: connected or closed (SendSide.check_response_connections).
        self._answering: list[_PublicationEntry] = []

        self._spy_subscriptions = SpySubscriptions(
            settings=settings, counters=counters, transports=transports,
            sender_proxy=self.sender_proxy, publications=self.publications, spies=self.spies,
            name_cache=self.name_cache)
        #: Unicast send endpoints whose endpoint= is a host name, resolved again while their
        #: peers are silent (the driver's runner resolves, off this thread).
        self.names: NameWatch[_SendEndpointEntry | _NamedDestination
                              | _ReceiveEndpointEntry] = NameWatch(
            settings.name_re_resolution_interval)
        #: Released logs' files kept for new logs of the same length (``log_reuse_bytes``).
        self.log_pool = LogPool(directory / control.RELEASED_LOGS_DIR,
                                settings.log_reuse_bytes, settings.log_reuse_timeout)
        #: Makes the images' logs and zeroes or deletes every released log (off this thread
        #: in a driver process: ``image_logs``).
        self.log_maker = ImageLogMaker(making=image_logs, wake=wake_conductor,
                                       pool=self.log_pool)
        budget.share_with(self.log_pool)
        self._pool_changes = 0  # the pool's changes last shown in the system counters
        self._send_side = SendSide(
            settings=settings, directory=directory, counters=counters, transports=transports,
            budget=budget, rng=rng, token_rng=token_rng, new_id=new_id,
            new_session_id=new_session_id, sender_proxy=self.sender_proxy,
            receiver_proxy=self.receiver_proxy,
            send_endpoints=self._send_endpoints, publications=self.publications,
            shared_publications=self._shared_publications, answering=self._answering,
            subscriptions=self.subscriptions, receive_endpoints=self._receive_endpoints,
            spy_subscriptions=self._spy_subscriptions, names=self.names,
            name_cache=self.name_cache, log_maker=self.log_maker)
        self._receive_side = ReceiveSide(
            settings=settings, directory=directory, counters=counters, transports=transports,
            budget=budget, rng=rng, token_rng=token_rng, new_id=new_id,
            receiver_proxy=self.receiver_proxy, loss_report=self.loss_report,
            receive_endpoints=self._receive_endpoints,
            closed_receiver_ids=self._closed_receiver_ids, subscriptions=self.subscriptions,
            log_maker=self.log_maker, names=self.names, name_cache=self.name_cache)
        self._untethered = NetworkUntethered(
            counters=counters, publications=self.publications,
            receive_endpoints=self._receive_endpoints, subscriptions=self.subscriptions,
            spy_subscriptions=self._spy_subscriptions, receive_side=self._receive_side)
        self._drain = NetworkDrain(
            counters=counters, sender_proxy=self.sender_proxy, publications=self.publications,
            shared_publications=self._shared_publications,
            receive_endpoints=self._receive_endpoints,
            closed_receiver_ids=self._closed_receiver_ids,
            spy_subscriptions=self._spy_subscriptions)

    # -- plumbing -----------------------------------------------------------------------------
    def _post(self, event: NetworkEvent) -> None:
        """An agent's event (any thread): queued for the conductor's next duty cycle."""
        self._events.append(event)
        self._wake_conductor()

    @property
    def image_count(self) -> int:
        return sum(len(entry.images) for entry in self._receive_endpoints.values())

    @property
    def has_events(self) -> bool:
        return (bool(self._events) or self._spy_subscriptions.has_messages
                or self.log_maker.has_done or self.log_pool.changes != self._pool_changes)

    @property
    def used_session_ids(self) -> Container[int]:
        """The session ids of the network publications (a count of each)."""
        return self._send_side.session_ids

    # -- host names resolved again (docs/CHANNELS.md §7.2) ----------------------------------
    def names_due(self, now_ns: int) -> list[str]:
        """The host names to resolve again now (those whose peers are silent), for the
        driver's runner to resolve off this thread and hand to :meth:`on_names_resolved`."""
        check = self.names.next_check_ns
        if check is not None and now_ns >= check:
            self._send_side.check_destinations()  # what the next check goes by
        return self.names.due(now_ns)

    def on_names_resolved(self, names: list[str], answers: Mapping[str, str | None]) -> None:
        """The runner resolved ``names`` (``answers``; a name missing: the resolver gave up):
        each endpoint whose peer's address changed sends to the new one."""
        for user, old, new in self.names.answered(names, answers):
            try:
                if isinstance(user, _NamedDestination):
                    self._send_side.on_destination_moved(user, old, new)
                elif isinstance(user, _ReceiveEndpointEntry):
                    self._receive_side.on_control_moved(user, old, new)
                else:
                    self._send_side.on_resolution_change(user, old, new)
            except Exception:  # a bug: counted and logged; the conductor serves on
                self.counters.add(SystemCounter.ERRORS)
                log.exception("moving %r from %s to %s failed", user, old, new)

    # -- the client's commands ----------------------------------------------------------------
    def add_publication(self, client_key: bytes, channel: Channel, stream_id: int,
                        now_ns: int, *, exclusive: bool = False) -> tuple[_PublicationEntry, int]:
        """A publisher of ``stream_id`` on ``channel`` (:meth:`SendSide.add_publication`):
        the publication and the registration id of this publisher."""
        return self._send_side.add_publication(client_key, channel, stream_id, now_ns,
                                               exclusive=exclusive)

    def release_publication(self, registration_id: int, now_ns: int) -> None:
        """One publisher left (:meth:`SendSide.release_publication`)."""
        self._send_side.release_publication(registration_id, now_ns)

    def add_destination(self, publication_id: int, destination: Channel, now_ns: int) -> None:
        """A manual multi-destination-cast publication sends to ``destination`` too
        (:meth:`SendSide.add_destination`)."""
        self._send_side.add_destination(publication_id, destination, now_ns)

    def remove_destination(self, publication_id: int, destination: Channel) -> None:
        """A manual multi-destination-cast publication no longer sends to ``destination``
        (:meth:`SendSide.remove_destination`)."""
        self._send_side.remove_destination(publication_id, destination)

    def add_subscription(self, subscription: NetworkSubscription, now_ns: int) -> Outgoing:
        """Receive ``subscription``'s stream (:meth:`ReceiveSide.add_subscription`), or for a
        spy (``aeron-spy:``) read this driver's publications
        (:meth:`SpySubscriptions.add_spy`); returns the AVAILABLE_IMAGE messages of the
        images it has at once."""
        if subscription.channel.is_spy:
            return self._spy_subscriptions.add_spy(subscription, now_ns)
        return self._receive_side.add_subscription(subscription, now_ns)

    def remove_subscription(self, registration_id: int) -> None:
        """The subscription or spy goes: its positions stop holding images (or publications)
        back; an endpoint left without subscriptions is removed."""
        if not self._spy_subscriptions.remove_spy(registration_id):
            self._receive_side.remove_subscription(registration_id)

    def add_receive_destination(self, registration_id: int, destination: Channel) -> None:
        """A multi-destination subscription receives on ``destination`` too
        (:meth:`ReceiveSide.add_receive_destination`)."""
        self._receive_side.add_receive_destination(registration_id, destination)

    def remove_receive_destination(self, registration_id: int, destination: Channel) -> None:
        """A multi-destination subscription no longer receives on ``destination``
        (:meth:`ReceiveSide.remove_receive_destination`)."""
        self._receive_side.remove_receive_destination(registration_id, destination)

    def capacity_use(self) -> dict[str, int]:
        """The use now of the network side's capacities (:meth:`ReceiveSide.capacity_use`)."""
        return self._receive_side.capacity_use()

    def image_log(self, registration_id: int) -> LogBuffer | None:
        """The driver's mapping of image ``registration_id``'s log, None once it is gone
        (:meth:`ReceiveSide.image_log`)."""
        return self._receive_side.image_log(registration_id)

    # -- duty cycle ---------------------------------------------------------------------------
    def do_work(self, now_ns: int) -> tuple[int, Outgoing]:
        """Handle the agents' events; returns (work done, messages to clients)."""
        out = self._spy_subscriptions.take_messages()
        work = len(out)
        self._send_side.check_response_connections()
        if self.log_maker.has_done:
            try:
                self.log_maker.step()  # an embedded driver's: one a cycle
                attached = self._receive_side.attach_done(now_ns)
            except Exception:  # a bug: counted and logged; the conductor serves on
                self.counters.add(SystemCounter.ERRORS)
                log.exception("attaching the images whose logs were made failed")
                attached = []
            work += 1 + len(attached)
            out.extend(attached)
        if self.log_pool.changes != self._pool_changes:
            self._pool_changes = self.log_pool.changes
            self.counters.set(SystemCounter.LOGS_REUSED, self.log_pool.reused)
            self.counters.set(SystemCounter.RELEASED_LOG_BYTES, self.log_pool.bytes)
            self.counters.set(SystemCounter.RELEASED_LOGS_READY, self.log_pool.ready_count)
        events = self._events
        # Bounded: a flood of SETUPs must not hold the conductor (and its heartbeat) for long.
        while events and work < MAX_EVENTS_PER_CYCLE:
            event = events.popleft()
            work += 1
            try:
                out.extend(self._on_event(event, now_ns))
            except Exception:  # a bug: counted and logged; the conductor serves on
                self.counters.add(SystemCounter.ERRORS)
                log.exception("handling %r failed", event)
        return work, out

    def _on_event(self, event: NetworkEvent, now_ns: int) -> Outgoing:
        """One agent's event, handed to the part it concerns; the messages to clients."""
        if isinstance(event, ImageRequested):
            return self._receive_side.on_image_requested(event, now_ns)
        if isinstance(event, ImageUnavailable):
            self._send_side.forget_response_image(event.image)
            return self._receive_side.on_image_unavailable(event)
        if isinstance(event, ImageDone):
            self._send_side.forget_response_image(event.image)
            self._receive_side.on_image_done(event)
        elif isinstance(event, ImageRejected):
            self._receive_side.on_image_rejected(event)
        elif isinstance(event, PublicationDone):
            return self._send_side.on_publication_done(event)
        elif isinstance(event, DestinationsSilent):
            self._send_side.on_destinations_silent(event)
        elif isinstance(event, RetargetFailed):
            self._send_side.on_retarget_failed(event)
        elif isinstance(event, SpiesReleased):
            return self._spy_subscriptions.on_spies_released(event.publication)
        elif isinstance(event, SpyLinked):
            self._spy_subscriptions.on_spy_linked(event)
        elif isinstance(event, SpyUnlinked):
            self._spy_subscriptions.on_spy_unlinked(event)
        elif isinstance(event, PublicationRejected):
            self._refusals.extend(self._send_side.on_publication_rejected(event, now_ns))
        elif isinstance(event, EndpointRemoved):
            if isinstance(event.channel, SendChannel):
                self._send_side.on_endpoint_removed(event)
            else:
                self._receive_side.on_endpoint_removed(event)
        elif isinstance(event, ReceiveDestinationFailed):
            self._receive_side.on_destination_failed(event)
        elif isinstance(event, ResponseSetupArrived):
            self._receive_side.on_response_setup(event)
        return []

    def check_spies(self, now_ns: int) -> Outgoing:
        """On the conductor's timer: the spies a publication missed as it was made (the
        counters were full) are linked if there is room now
        (:meth:`SpySubscriptions.link_missed_spies`), and untethered spies and image
        subscriptions are looked at (:class:`NetworkUntethered`)."""
        out = self._spy_subscriptions.link_missed_spies(now_ns)
        out.extend(self._untethered.check_untethered_spies(now_ns))
        out.extend(self._untethered.check_untethered_images(now_ns))
        return out

    # -- pressure -----------------------------------------------------------------------------
    def send_backlog(self, *, deferring: bool) -> float:
        """The governor's send backlog (:meth:`SendSide.send_backlog`)."""
        return self._send_side.send_backlog(deferring=deferring)

    @property
    def carries_streams(self) -> bool:
        """Whether it has publications or images (what the governor watches; asked after
        every idle duty cycle, so a plain loop)."""
        if self.publications:
            return True
        for entry in self._receive_endpoints.values():
            if entry.images:
                return True
        return False

    def apply_pressure_step(self, step: int) -> None:
        """Hand the governor's step to the agents (on their thread)."""
        self.sender_proxy.on_pressure_step(step)
        self.receiver_proxy.on_pressure_step(step)

    @property
    def has_open_episode(self) -> bool:
        """Whether a publication is in a back-pressure episode."""
        return self._send_side.has_open_episode

    @property
    def owed_episode_scan_ns(self) -> int | None:
        """When a sample of the episodes owes its scan of their words (ns), None when none
        is owed (:meth:`SendSide.sample_episodes`)."""
        return self._send_side.owed_episode_scan_ns

    def sample_episodes(self, now_ns: int) -> list[tuple[int, EpisodeEvent]]:
        """Each publication's back-pressure episodes that began or ended since the last
        sample (:meth:`SendSide.sample_episodes`)."""
        return self._send_side.sample_episodes(now_ns)

    def take_refusals(self) -> list[tuple[int, PublicationRefusal]]:
        """The refusals of publications' images by their receivers that :meth:`do_work`
        handled since the last call, each with its publication's registration id, for its
        publishers (:meth:`SendSide.on_publication_rejected`)."""
        refusals, self._refusals = self._refusals, []
        return refusals

    # -- graceful drain (DriverConductor.drain; :class:`NetworkDrain`) ------------------------
    def stop_credit(self) -> None:
        """Every network publication stops granting credit."""
        self._drain.stop_credit()

    def is_flushed(self, *, closing_clients: frozenset[int] | None = None) -> bool:
        """Every publication sent its log, its live receivers acknowledged the end and its
        spies read it to the end (:meth:`NetworkDrain.is_flushed`)."""
        return self._drain.is_flushed(closing_clients=closing_clients)

    def end_streams(self) -> None:
        """Close every publication still open: it sends end-of-stream."""
        self._drain.end_streams()

    def has_ended_streams(self, *, closing_clients: frozenset[int] | None = None) -> bool:
        """Every publication's end-of-stream was answered, or sent long enough, or it is gone
        (:meth:`NetworkDrain.has_ended_streams`)."""
        return self._drain.has_ended_streams(closing_clients=closing_clients)

    def close(self, now_ns: int) -> None:
        """Free everything (the network thread has stopped).  The images first tell their
        senders that this receiver leaves, as a closed subscription's do."""
        try:
            self.receiver.leave(now_ns)
        except Exception:  # the farewell only: what follows frees everything regardless
            log.exception("telling the senders this receiver leaves failed")
        self._send_side.free_publications()
        self._spy_subscriptions.close()
        self._send_side.close_endpoints()
        self._receive_side.close()
        self.loss_report.close()
