"""Run a :class:`~slipstream.sim.scenario.Scenario`: build the virtual network and hosts, play
the timed events, stop when every live subscriber has everything, and report.

``run_scenario(scenario)`` is the whole thing; :class:`Simulation` exposes the parts (loop,
network, hosts) for tests that want to poke at them mid-run::

    with Simulation(scenario) as sim:
        sim.run_until(500 * MS)            # virtual ns
        sim.network.set_up("10.0.0.3", False)
        report = sim.run()

The only real clock read is ``time.perf_counter()`` for ``wall_seconds``.  Log buffers live in
a temporary directory under /dev/shm (else the system temp dir), removed by :meth:`close`.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from slipstream.client.channel import parse_channel
from slipstream.client.counters import CounterType, SystemCounter
from slipstream.client.errors import ChannelError
from slipstream.client.layout import DATA_HEADER, HDR_TYPE_DATA, HEADER_LENGTH, max_message_length
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.protocol.params import PublicationParams
from slipstream.sim.events import EventLoop
from slipstream.sim.host import PublisherHost, SimHost, SubscriberHost
from slipstream.sim.network import Address, Network, Partition
from slipstream.sim.report import Report, rejoins, subscriber_fields
from slipstream.sim.scenario import Event, Scenario, ScenarioError, host_ip, make_faults

#: Check for completion every this many event-loop actions: the check reads every subscriber's
#: position, a seventh of a 51-host run when made after each action.
_CHECK_EVERY = 32
#: And before the clock jumps this far: a run's end is seen when it happened, not only after
#: 32 more actions (which a quiet host, a timer a second, may spread over seconds).
_CHECK_BEFORE_GAP_NS = 1_000_000


class Simulation:
    """One run of a scenario.  Use as a context manager (logs are files)."""

    def __init__(self, scenario: Scenario, *, keep_trace: bool = False,
                 sample_interval_ns: int | None = None, record_drops: bool = False,
                 directory: str | Path | None = None) -> None:
        """``sample_interval_ns`` samples positions for plots (None: no samples);
        ``record_drops`` keeps the stream position of every dropped DATA datagram."""
        self.scenario = scenario
        self.seed = scenario.seed
        # Sparse logs unless the scenario says otherwise: fifty images of 3 x 16 MiB terms
        # that carry 10 MB each would otherwise hold 2.4 GB of memory they never use.
        self.settings = DriverSettings.from_mapping(
            {"term_buffer_sparse_file": True, **scenario.settings})
        try:
            channel = parse_channel(scenario.channel_uri(1))
            for index in range(2, scenario.hosts + 1):  # the subscribers' own keys, too
                parse_channel(scenario.channel_uri(index))
        except ChannelError as e:
            raise ScenarioError(f"channel: {e}") from None
        try:
            term_length = PublicationParams.for_network(channel, self.settings).term_length
        except ChannelError as e:
            raise ScenarioError(f"channel: {e}") from None
        if scenario.size > max_message_length(term_length):
            raise ScenarioError(f"size: {scenario.size} bytes exceeds the maximum message "
                                f"length {max_message_length(term_length)} of term length "
                                f"{term_length} (term/8)")
        self.loop = EventLoop()
        self.network = Network(self.loop, random.Random(f"{scenario.seed}/network"),
                               default_faults=scenario.faults, keep_trace=keep_trace)
        base = directory or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
        # The pid in the name says whose a directory is (a run ended by SIGKILL leaves it).
        self.directory = Path(tempfile.mkdtemp(prefix=f"slipstream-sim-{os.getpid()}-",
                                               dir=base))
        self.hosts: list[SimHost] = []
        try:  # a failure (or a SIGTERM's SystemExit) from here on leaves no directory
            self._pending_events = 0
            self._sample_interval_ns = sample_interval_ns
            self.samples: list[tuple[int, int | None, list[int | None]]] = []
            self.drops: list[tuple[int, int]] = []
            #: ``(t_ns, snd-lmt, send-rate limit or 0)``, sampled with the positions.
            self.limits: list[tuple[int, int, int]] = []
            #: ``(t_ns, mdc-destinations)``, sampled with the positions (transport = "mdc").
            self.destinations: list[tuple[int, int]] = []
            self._destinations_counter: tuple[int, int] | None = None
            self.completed = False
            self.wall_seconds = 0.0
            for index in range(1, scenario.hosts + 1):
                self.network.add_host(host_ip(index))
            for link in scenario.links:
                self.network.set_faults(host_ip(link.src), host_ip(link.dst), link.faults)
            self.publisher = PublisherHost(self, 1)
            self.subscribers = [SubscriberHost(self, i) for i in range(2, scenario.hosts + 1)]
            self.hosts = [self.publisher, *self.subscribers]
            for host in self.hosts:
                self.network.set_up(host.ip, False)
            for event in scenario.events:
                self._schedule(event)
            if record_drops:
                self.network.observers.append(self._on_network_event)
            if sample_interval_ns:
                self.loop.call_at(0, self._sample)
            for host in self.hosts:
                if host.index not in scenario.initially_down:
                    self.loop.call_at(0, host.start)
        except BaseException:
            self.close()
            raise

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap and delete every log."""
        for host in self.hosts:
            host.close_driver()
        shutil.rmtree(self.directory, ignore_errors=True)

    @staticmethod
    def host_ip(index: int) -> str:
        return host_ip(index)

    def host(self, index: int) -> SimHost:
        return self.hosts[index - 1]

    # -- events ----------------------------------------------------------------------------
    def _schedule(self, event: Event) -> None:
        self._pending_events += 1
        if event.action == "partition":
            assert event.end_ns is not None
            side = frozenset(host_ip(i) for i in event.hosts)
            self.network.add_partition(Partition(event.at_ns, event.end_ns, side))
            self.loop.call_at(event.end_ns, self._event_done)
            return
        self.loop.call_at(event.at_ns, lambda: self._fire(event))

    def _event_done(self) -> None:
        self._pending_events -= 1

    def _fire(self, event: Event) -> None:
        self._pending_events -= 1
        if event.action == "crash":
            for index in event.hosts:
                self.host(index).crash()
        elif event.action == "restart":
            for index in event.hosts:
                self.host(index).start()
        elif event.action == "pause":
            assert event.end_ns is not None
            for index in event.hosts:
                host = self.host(index)
                assert isinstance(host, SubscriberHost), "a pause is a subscriber's"
                host.pause_until(event.end_ns)
        elif event.action == "faults":
            sources = [event.src] if event.src is not None else range(1, self.scenario.hosts + 1)
            targets = [event.dst] if event.dst is not None else range(1, self.scenario.hosts + 1)
            if event.src is None and event.dst is None:
                self.network.default_faults = make_faults(
                    f"event {event.action}", event.faults, self.network.default_faults)
            for s in sources:
                for d in targets:
                    if s != d:
                        link = self.network.link(host_ip(s), host_ip(d))
                        self.network.set_faults(link.src, link.dst, make_faults(
                            f"event {event.action}", event.faults, link.faults))

    # -- observation -------------------------------------------------------------------------
    def _sample(self) -> None:
        self._record_sample()
        assert self._sample_interval_ns
        self.loop.call_later(self._sample_interval_ns, self._sample)

    def _record_sample(self) -> None:
        pub = self.publisher.publication
        sender = pub.sender_position if pub is not None and self.publisher.up else None
        session = pub.session_id if pub is not None else None
        subs: list[int | None] = []
        for sub in self.subscribers:
            subs.append(sub.position_of(session) if session is not None and sub.up else None)
        self.samples.append((self.loop.now_ns, sender, subs))
        if pub is not None and self.publisher.up:
            self.limits.append((self.loop.now_ns, pub.sender_limit, pub.c.rate_limit))
            count = self.destination_count()
            if count is not None:
                self.destinations.append((self.loop.now_ns, count))

    def destination_count(self) -> int | None:
        """The publisher's ``mdc-destinations`` counter: how many destinations its
        multi-destination-cast endpoint has now (None: it has none such, or is down)."""
        driver = self.publisher.driver
        if driver is None or not self.scenario.is_mdc:
            return None
        incarnation = self.publisher.incarnation
        cached = self._destinations_counter  # (incarnation, counter id)
        info = (driver.counters.info(cached[1])
                if cached is not None and cached[0] == incarnation else None)
        if info is None or info.type_id != CounterType.MDC_DESTINATIONS:
            info = next((each for each in driver.counters
                         if each.type_id == CounterType.MDC_DESTINATIONS), None)
            if info is None:
                return None
            self._destinations_counter = (incarnation, info.counter_id)
        return info.value

    def _on_network_event(self, now_ns: int, event: str, source: Address,
                          destination: Address, data: bytes) -> None:
        if (not event.startswith("drop") or source != self.publisher.source
                or len(data) < HEADER_LENGTH):
            return
        (_length, _version, _flags, kind, term_offset, _session, _stream, term_id,
         _reserved) = DATA_HEADER.unpack_from(data)
        log = self.publisher.log
        if kind != HDR_TYPE_DATA or log is None:
            return
        count = (term_id - log.initial_term_id) & 0xFFFFFFFF
        self.drops.append((now_ns, (count << log.position_bits) + term_offset))

    # -- running -----------------------------------------------------------------------------
    def is_complete(self) -> bool:
        """Every scheduled event happened and every live subscriber has everything that the
        live publisher appended (or, with the publisher down for good, no subscriber holds an
        image any more)."""
        pub = self.publisher
        if self._pending_events or not pub.incarnation:
            return False
        if pub.up and pub.publication is not None and pub.log is not None:
            if not pub.finished:
                return False
            final = pub.log.producer_position()
            session = pub.publication.session_id
            for sub in self.subscribers:
                if sub.up:
                    position = sub.position_of(session)
                    if position is None or position < final:
                        return False
            return True
        return all(not sub.up or not sub.readers for sub in self.subscribers)

    def run_until(self, until_ns: int, *, stop_when_complete: bool = True) -> bool:
        """Advance virtual time to ``until_ns`` (ns), or until complete when
        ``stop_when_complete``; True when complete."""
        started = time.perf_counter()
        try:
            if stop_when_complete:
                self.completed = self.loop.run(until_ns, self.is_complete, _CHECK_EVERY,
                                               _CHECK_BEFORE_GAP_NS)
            else:
                self.loop.run(until_ns)
                self.completed = self.is_complete()
        finally:
            self.wall_seconds += time.perf_counter() - started
        return self.completed

    def run(self) -> Report:
        """Run to completion or to the scenario's virtual-time limit; the report."""
        if not self.completed:
            self.run_until(self.scenario.max_virtual_ns)
        if self._sample_interval_ns and (not self.samples
                                         or self.samples[-1][0] < self.loop.now_ns):
            self._record_sample()  # where the run ended, between two samples
        return self.report()

    def report(self) -> Report:
        pub = self.publisher
        ranges = [(pid, first, end) for pid, first, end in pub.ranges]
        sent = sum(end - first for _, first, end in ranges)
        virtual = self.loop.now_ns / 1e9
        stats = [sub.stats for sub in self.subscribers]
        mean_bytes = sum(s.delivered_bytes for s in stats) / max(1, len(stats))
        counters = {host.ip: host.counters() for host in self.hosts}
        return Report(
            sent=sent,
            **subscriber_fields(stats, ranges),
            lost_ranges=[sub.lost_ranges for sub in self.subscribers],
            rejoins=[rejoins(sub.left, sub.joins) for sub in self.subscribers],
            naks=sum(h.counter(SystemCounter.NAK_MESSAGES_SENT) for h in self.subscribers),
            retransmits=pub.counter(SystemCounter.RETRANSMITS_SENT),
            virtual_seconds=virtual,
            wall_seconds=self.wall_seconds,
            # No virtual time passed (no delay, no rate limit): bytes per second is not a
            # number, and 0 would say nothing arrived.
            goodput=mean_bytes / virtual if virtual > 0 else None,
            completed=self.completed,
            subscribers=[sub.ip for sub in self.subscribers],
            images_lost=[sub.images_lost for sub in self.subscribers],
            network=dict(sorted(self.network.counts.items())),
            counters=counters,
            trace_digest=self.network.trace_digest(),
            events=self.loop.executed,
            samples=self.samples,
            drops=self.drops,
            limits=self.limits,
            destinations=self.destinations,
        )


def run_scenario(scenario: Scenario, *, keep_trace: bool = False,
                 sample_interval_ns: int | None = None, record_drops: bool = False,
                 **changes: Any) -> Report:
    """Run ``scenario`` (with ``changes`` applied, e.g. ``messages=100``) and report."""
    if changes:
        scenario = attrs.evolve(scenario, **changes)
    with Simulation(scenario, keep_trace=keep_trace, sample_interval_ns=sample_interval_ns,
                    record_drops=record_drops) as sim:
        return sim.run()
