"""Run a simulator :class:`~slipstream.sim.scenario.Scenario` on namespace hosts instead: real
drivers, real sockets, the kernel's links, real time.

``slipstream sim --scenario F --on-hosts`` (root) makes ``scenario.hosts`` namespace hosts
(:mod:`slipstream.sim.real.hosts`), a driver in each, and plays the scenario from this process:
host 1's application publishes ``messages`` at ``publish_rate``, each other host's subscribes
(at its ``read_rate``), and the same :class:`~slipstream.sim.report.Report` comes out, times in
real seconds, so ``--plot`` draws the same figure from a host run.

What a real link can be given here is what the kernel has (no netem): ``faults.loss`` drops
that share of datagrams at random with ``iptables -m statistic`` (DATA from the publisher
arriving at each subscriber host, and everything from a subscriber arriving at the
publisher's), ``faults.rate_mbit`` is a ``tbf`` on the publisher's veth (its uplink: the
stream's bottleneck). A ``[[link]]`` between the publisher and a subscriber may give that
direction a loss of its own (the same rules, for that host only). Events: ``pause`` (a
subscriber stops reading), ``crash`` (its driver is killed, SIGKILL) and ``partition``
(iptables between the side and the rest, healed at ``end_ms``). Any other fault or event is
refused by name (:class:`ScenarioError`), except a delay or jitter, which the run leaves to the
veths (and says so): reordering and delay need the relay, which carries one stream only.

Under ``transport = "mdc"`` host 1's publication is bound to its control address on its own
veth (``control=<host 1>:MDC_CONTROL_PORT|control-mode=dynamic``) and each subscriber joins
it from its own address (``endpoint=<its address>:UNICAST_PORT|control=<host 1>:...``); the
report's ``destinations`` sample the publisher's ``mdc-destinations`` counter.

:func:`share_one_link` is the other host scenario: two streams from one host to another
through one ``tbf`` bottleneck (how congestion control shares it).

Sequence numbers and the report's accounting are the simulator's
(:class:`~slipstream.sim.host.SubscriberStats`): exactly once, in order, intact, the longest gap
between deliveries, what a subscriber left behind was told it lost.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import attrs

from slipstream.client import Client, control
from slipstream.client.channel import parse_channel
from slipstream.client.counters import (
    CountersFile,
    CounterType,
    SystemCounter,
    parse_position_label,
    read_system_counters,
)
from slipstream.client.layout import max_message_length
from slipstream.daemon.reports.loss_report import read_loss_report
from slipstream.sim.host import MESSAGE_HEADER, MESSAGE_TRAILER, SubscriberStats
from slipstream.sim.network import LinkFaults
from slipstream.sim.real.hosts import NamespaceHosts
from slipstream.sim.report import Report, rejoins, subscriber_fields
from slipstream.sim.scenario import (
    UNICAST_PORT,
    Event,
    Scenario,
    ScenarioError,
)

#: The faults a host run applies; every other field of LinkFaults must keep its default.
APPLIED_FAULTS: Final = ("loss", "rate_mbit")
#: The events a host run plays.
APPLIED_EVENTS: Final = ("pause", "crash", "partition")
#: How long the stream has to connect (s).
CONNECT_TIMEOUT_S: Final = 20.0
#: Samples for a plot come at most this often (ns).
MIN_SAMPLE_INTERVAL_NS: Final = 10_000_000
#: Messages one subscriber reads per pass, and the publisher offers per pass, at most.
BATCH: Final = 64


#: Faults a host run leaves to the real links (it says so): the veth's own delay stands in.
UNAPPLIED_FAULTS: Final = ("delay_ms", "jitter_ms")


def check_applicable(scenario: Scenario) -> list[str]:
    """What of ``scenario`` a host run leaves out (one line each: the delay a veth has
    instead); raises :class:`ScenarioError` naming the first fault, event or option it cannot
    give as the simulator would."""
    defaults = LinkFaults()
    notes = []
    for field in attrs.fields(LinkFaults):
        value = getattr(scenario.faults, field.name)
        if field.name in APPLIED_FAULTS or value == getattr(defaults, field.name):
            continue
        if field.name in UNAPPLIED_FAULTS:
            notes.append(f"faults.{field.name} = {value:g} not applied: real links have their "
                         f"own (no netem here)")
            continue
        raise ScenarioError(
            f"faults.{field.name}: a host run applies only {', '.join(APPLIED_FAULTS)} "
            f"(the kernel here has no netem; reordering needs the relay)")
    for link in scenario.links:
        if 1 not in (link.src, link.dst):
            raise ScenarioError(f"link: a host run applies a link's faults between the "
                                f"publisher (host 1) and a subscriber only, not from "
                                f"{link.src} to {link.dst}")
        for field in attrs.fields(LinkFaults):
            if field.name != "loss" and getattr(link.faults, field.name) != getattr(
                    scenario.faults, field.name):
                raise ScenarioError(f"link.{field.name}: a host run gives a link a loss of "
                                    f"its own, nothing else ([faults] is every link's)")
    if scenario.initially_down:
        raise ScenarioError("scenario.initially_down: a host run starts every host")
    if scenario.is_mds:
        raise ScenarioError("scenario.transport: a host run plays multicast and mdc; mds is "
                            "the simulator's (tests/test_mds.py runs it between drivers)")
    for event in scenario.events:
        if event.action not in APPLIED_EVENTS:
            raise ScenarioError(f"event.action: {event.action!r} is not played on hosts "
                                f"(these are: {', '.join(APPLIED_EVENTS)})")
        if 1 in event.hosts and event.action != "partition":
            raise ScenarioError(f"event.{event.action}: host 1 publishes; a host run "
                                f"{event.action}es subscribers only")
    return notes


class _Subscriber:
    """One subscriber host's application: its client, subscription, pace and tallies."""

    def __init__(self, index: int, client: Client, uri: str, stream_id: int,
                 stats: SubscriberStats, read_rate: float) -> None:
        self.index = index
        self.client = client
        self.stats = stats
        self.read_rate = read_rate
        # The client's conductor thread tells of images that go; this one reads the tallies.
        self._tallies = threading.Lock()
        self.lost_ranges: list[tuple[int, int]] = []
        #: Per image (by its correlation id, in the order the driver made them): its session,
        #: join position and when this process first saw it (time.monotonic(), s); and per
        #: entry of ``lost_ranges``, the image that went with it, its session and when
        #: (sim/report.py's ``rejoins``).
        self.joins: dict[int, tuple[int, int, float]] = {}
        self.left: list[tuple[int, int, float]] = []
        self.images_lost = 0
        self.subscription = client.add_subscription(
            uri, stream_id, on_unavailable_image=self._on_unavailable_image)
        self.paused_until = 0.0
        self.crashed = False
        self.read = 0
        self.started_at: float | None = None

    def _note_join(self, image: Any) -> None:
        if image.correlation_id not in self.joins:
            with self._tallies:
                self.joins[image.correlation_id] = (image.session_id, image.join_position,
                                                    time.monotonic())

    def _on_unavailable_image(self, image: Any) -> None:  # on the client's conductor thread
        self._note_join(image)
        with self._tallies:
            self.images_lost += 1
            if image.lost_range is not None:
                self.left.append((image.correlation_id, image.session_id, time.monotonic()))
                self.lost_ranges.append(image.lost_range)

    def tallies(self) -> tuple[int, list[tuple[int, int]], list[tuple[int, float] | None]]:
        """What the report takes of this subscriber's images, at one instant: how many went,
        the ranges those left behind lost, and how each rejoined (``Report.rejoins``)."""
        with self._tallies:
            return self.images_lost, list(self.lost_ranges), rejoins(self.left, self.joins)

    def poll(self, now: float) -> int:
        if self.crashed:
            return 0
        for image in self.subscription.images:
            self._note_join(image)
        if now < self.paused_until:
            return 0
        budget = BATCH
        if self.read_rate:
            if self.started_at is None:
                self.started_at = now
            budget = min(budget, int((now - self.started_at) * self.read_rate) + 1 - self.read)
            if budget <= 0:
                return 0
        count = self.subscription.poll(self.stats.on_message, budget)
        self.read += count
        if count:
            self.stats.note_deliveries(time.monotonic_ns())
        return count

    def caught_up(self, final: int) -> bool:
        """Every image this subscriber has is read to ``final`` (and it has one)."""
        images = self.subscription.images
        return bool(images) and all(image.position >= final for image in images)


def _settings(scenario: Scenario) -> dict[str, Any]:
    return {"term_buffer_sparse_file": True, "log_level": "warning", **scenario.settings}


def _channel(scenario: Scenario, hosts: NamespaceHosts, index: int) -> str:
    return scenario.channel_uri(index, hosts[index].address, hosts[2].address,
                                publisher=hosts[1].address)


def link_loss(scenario: Scenario, src: int, dst: int) -> float:
    """The loss of the direction from host ``src`` to host ``dst``: its ``[[link]]``'s (the
    last one given, as in the simulator), or else that of ``[faults]``."""
    for link in reversed(scenario.links):
        if (link.src, link.dst) == (src, dst):
            return link.faults.loss
    return scenario.faults.loss


def _sender_counters(counters: CountersFile, session_id: int) -> dict[str, int]:
    """The ids of the publication's snd-pos, snd-lmt, (with rc=) snd-rate and (under min or
    tagged flow control) fc-receivers counters."""
    found: dict[str, int] = {}
    for info in counters:
        label = parse_position_label(info.label)
        if label is not None and label.session_id == session_id and label.kind in (
                "snd-pos", "snd-lmt", "snd-rate", "fc-receivers"):
            found[label.kind] = info.counter_id
    return found


def _stop_all(drivers: list[Any]) -> None:
    """Stop ``drivers`` at once (each drains on its own; one after another, five took 2.5 s);
    what fails here is left to the hosts' close(), which stops them again."""
    with ThreadPoolExecutor(len(drivers)) as pool:
        for future in [pool.submit(driver.stop) for driver in drivers]:
            with contextlib.suppress(Exception):
                future.result()


def run_on_hosts(scenario: Scenario, *, sample_interval_ns: int | None = None,
                 hold_pause_s: float = 0.0) -> Report:
    """Play ``scenario`` on namespace hosts (see the module docstring); the report, in real
    seconds.  Needs root; :class:`~slipstream.sim.real.hosts.HostsError` says what is missing.

    ``hold_pause_s``: a paused subscriber reads again only once its driver has left its image
    behind (its ``IMAGES_LEFT_BEHIND`` counter moved), or this many seconds after its pause
    began, whichever is first, if that is after the pause's own end: on a busy machine the
    publisher may go at a fraction of its pace, so a pause of fixed length need not outrun
    what the sender can still repair.  The report's notes say how long each pause was held."""
    notes = check_applicable(scenario)
    if sample_interval_ns is not None:  # a real clock's samples jitter: fewer, steadier
        sample_interval_ns = max(sample_interval_ns, MIN_SAMPLE_INTERVAL_NS)
    with NamespaceHosts(scenario.hosts) as hosts, contextlib.ExitStack() as stack:
        report = _Run(scenario, hosts, stack, sample_interval_ns, hold_pause_s).run()
    report.notes = notes + report.notes
    return report


class _Run:
    """One host run: the drivers, the clients, the publisher's loop and the samples."""

    def __init__(self, scenario: Scenario, hosts: NamespaceHosts, stack: contextlib.ExitStack,
                 sample_interval_ns: int | None, hold_pause_s: float = 0.0) -> None:
        self.scenario = scenario
        self.hosts = hosts
        self.hold_pause_s = hold_pause_s
        #: Paused subscribers held until their driver leaves them behind: host -> (when the
        #: pause began, its cap, its driver's IMAGES_LEFT_BEHIND then).
        self._held: dict[int, tuple[float, float, int]] = {}
        self._notes: list[str] = []
        self.sample_interval = sample_interval_ns / 1e9 if sample_interval_ns else None
        settings = _settings(scenario)
        # All at once: a driver's start is mostly its interpreter's imports (five one after
        # another took 16 s of a busy 2-core machine, 6 s at once).  One that fails raises
        # here once all have started, and the hosts' close() stops every one.
        with ThreadPoolExecutor(scenario.hosts) as pool:
            self.drivers = list(pool.map(lambda i: hosts.start_driver(i, **settings),
                                         range(1, scenario.hosts + 1)))
        stack.callback(_stop_all, self.drivers)  # after the clients and counters below
        self.counters = [stack.enter_context(contextlib.closing(CountersFile(
            Path(d.directory) / control.COUNTERS_FILE, writable=False))) for d in self.drivers]
        clients = [stack.enter_context(Client.connect(d.directory)) for d in self.drivers]
        self.subscribers = [
            _Subscriber(i, clients[i - 1], _channel(scenario, hosts, i), scenario.stream_id,
                        SubscriberStats(scenario.messages), scenario.read_rate(i))
            for i in range(2, scenario.hosts + 1)]
        self.publication = clients[0].add_publication(_channel(scenario, hosts, 1),
                                                      scenario.stream_id)
        if scenario.size > max_message_length(self.publication.term_length):
            raise ScenarioError(f"size: {scenario.size} bytes exceeds the maximum message "
                                f"length of term length {self.publication.term_length}")
        self.sender_counters: dict[str, int] = {}  # snd-pos, snd-lmt, snd-rate: their ids
        self.destinations_counter: int | None = None  # mdc-destinations (transport = "mdc")
        self.destinations: list[tuple[int, int]] = []
        self.samples: list[tuple[int, int | None, list[int | None]]] = []
        self.limits: list[tuple[int, int, int]] = []
        self.sent = 0

    def _connect(self) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while not (self.publication.is_connected
                   and all(s.subscription.images for s in self.subscribers)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stream did not connect in {CONNECT_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        self.sender_counters = _sender_counters(self.counters[0], self.publication.session_id)
        fc = parse_channel(self.publication.channel).fc
        if fc is not None and fc.name == "min" and "fc-receivers" in self.sender_counters:
            # The run starts with the sender holding to every subscriber, as a run in the
            # simulator does.  A subscriber's image can be up before its first SM reaches
            # the sender (its driver descheduled on a busy machine); the others would take
            # the first window meanwhile, and min would rightly refuse it as a newcomer a
            # window behind (docs/DRIVER.md §5.3).
            receivers = self.sender_counters["fc-receivers"]
            while self.counters[0].get(receivers) < len(self.subscribers):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"min flow control held the sender to {self.counters[0].get(receivers)} "
                        f"of {len(self.subscribers)} subscribers after {CONNECT_TIMEOUT_S:.0f} s")
                time.sleep(0.01)
        if self.scenario.is_mdc:
            self.destinations_counter = next(
                (info.counter_id for info in self.counters[0]
                 if info.type_id == CounterType.MDC_DESTINATIONS), None)

    def _apply_faults(self) -> None:
        scenario = self.scenario
        faults = scenario.faults
        for sub in self.subscribers:
            down = link_loss(scenario, 1, sub.index)  # DATA (and SETUP, ...) to it
            if down:
                self.hosts.drop(sub.index, port=scenario.data_port, probability=down, source=1)
            up = link_loss(scenario, sub.index, 1)  # its SMs and NAKs (and signals)
            if up:
                self.hosts.drop(1, probability=up, source=sub.index)
        if faults.rate_mbit:
            self.hosts.rate_limit(1, faults.rate_mbit)

    def _sample(self, t_ns: int) -> None:
        publisher = self.counters[0]
        ids = self.sender_counters
        sender = publisher.get(ids["snd-pos"]) if "snd-pos" in ids else None
        positions: list[int | None] = []
        for sub in self.subscribers:
            images = () if sub.crashed else sub.subscription.images
            positions.append(max(image.position for image in images) if images else None)
        self.samples.append((t_ns, sender, positions))
        if "snd-lmt" in ids:
            self.limits.append((t_ns, publisher.get(ids["snd-lmt"]),
                                publisher.get(ids["snd-rate"]) if "snd-rate" in ids else 0))
        if self.destinations_counter is not None:
            self.destinations.append((t_ns, publisher.get(self.destinations_counter)))

    def _fire(self, event: Event, now: float) -> None:
        if event.action == "pause":
            for index in event.hosts:
                self.subscribers[index - 2].paused_until = now + (
                    event.end_ns - event.at_ns) / 1e9
                if self.hold_pause_s:
                    self._held[index] = (now, now + self.hold_pause_s, self._left_behind(index))
        elif event.action == "crash":
            for index in event.hosts:
                self.subscribers[index - 2].crashed = True
                self.drivers[index - 1].kill()
        elif event.action == "partition":
            side = set(event.hosts)
            for a in side:
                for b in range(1, self.scenario.hosts + 1):
                    if b not in side:
                        self.hosts.partition(a, b)

    def _left_behind(self, index: int) -> int:
        """Host ``index``'s driver's IMAGES_LEFT_BEHIND."""
        return self.counters[index - 1].get(SystemCounter.IMAGES_LEFT_BEHIND.value)

    def _hold_pauses(self, now: float) -> None:
        """Keep each held subscriber paused until its driver left it behind, or its cap."""
        for index, (began, cap, before) in list(self._held.items()):
            sub = self.subscribers[index - 2]
            left = self._left_behind(index) > before
            if left or now >= cap:
                del self._held[index]
                how = "left behind" if left else "not left behind"
                self._notes.append(f"host {index}: paused {now - began:.2f} s, {how}")
            else:
                sub.paused_until = max(sub.paused_until, now + 0.001)

    def _heal(self, event: Event) -> None:
        side = set(event.hosts)
        for a in side:
            for b in range(1, self.scenario.hosts + 1):
                if b not in side:
                    self.hosts.heal(a, b)

    def run(self) -> Report:
        scenario = self.scenario
        self._connect()
        self._apply_faults()
        message = bytearray(scenario.size)
        publication = self.publication
        limit_s = scenario.max_virtual_ns / 1e9
        pending = sorted(scenario.events, key=lambda e: e.at_ns)
        heals = sorted((e for e in scenario.events if e.action == "partition"),
                       key=lambda e: e.end_ns)
        started = time.monotonic()
        start_ns = time.monotonic_ns()
        next_sample = 0.0
        final: int | None = None
        completed = False
        while True:
            now = time.monotonic()
            elapsed = now - started
            if elapsed > limit_s:
                break
            while pending and pending[0].at_ns / 1e9 <= elapsed:
                self._fire(pending.pop(0), now)
            while heals and heals[0].end_ns / 1e9 <= elapsed:
                self._heal(heals.pop(0))
            if self._held:
                self._hold_pauses(now)
            if self.sample_interval is not None and elapsed >= next_sample:
                self._sample(time.monotonic_ns() - start_ns)
                next_sample = elapsed + self.sample_interval
            work = 0
            allowed = scenario.messages - self.sent
            if scenario.publish_rate:
                allowed = min(allowed, int(elapsed * scenario.publish_rate) + 1 - self.sent)
            for _ in range(min(allowed, BATCH)):
                MESSAGE_HEADER.pack_into(message, 0, 1, self.sent)
                MESSAGE_TRAILER.pack_into(message, scenario.size - 4, self.sent)
                if publication.offer(message) < 0:
                    break
                self.sent += 1
                work += 1
            for sub in self.subscribers:
                work += sub.poll(now)
            if self.sent == scenario.messages and not pending and not heals:
                if final is None:
                    final = publication.position
                if all(sub.crashed or sub.caught_up(final) for sub in self.subscribers):
                    completed = True
                    break
            if not work:
                time.sleep(0.0002)  # leave the cores to the drivers
        wall = time.monotonic() - started
        if self.sample_interval is not None:
            self._sample(time.monotonic_ns() - start_ns)
        return self._report(completed, wall)

    def _report(self, completed: bool, wall: float) -> Report:
        ranges = [(1, 0, self.sent)]
        stats = [sub.stats for sub in self.subscribers]
        tallies = [sub.tallies() for sub in self.subscribers]
        counters = {}
        for index in range(1, len(self.drivers) + 1):
            if index > 1 and self.subscribers[index - 2].crashed:
                continue
            counters[self.hosts[index].address] = {
                c.name: self.counters[index - 1].get(c.value) for c in SystemCounter}
        publisher = counters[self.hosts[1].address]
        return Report(
            sent=self.sent,
            **subscriber_fields(stats, ranges),
            lost_ranges=[lost for _, lost, _ in tallies],
            rejoins=[rejoined for _, _, rejoined in tallies],
            notes=self._notes,
            naks=sum(c.get("NAK_MESSAGES_SENT", 0) for ip, c in counters.items()
                     if ip != self.hosts[1].address),
            retransmits=publisher["RETRANSMITS_SENT"],
            virtual_seconds=wall,
            wall_seconds=wall,
            goodput=sum(s.delivered_bytes for s in stats) / max(1, len(stats)) / wall,
            completed=completed,
            subscribers=[self.hosts[sub.index].address for sub in self.subscribers],
            images_lost=[lost for lost, _, _ in tallies],
            counters=counters,
            samples=self.samples,
            limits=self.limits,
            destinations=self.destinations,
            clock="real",
        )


def share_one_link(subscription_params: tuple[str, str], seconds: float, *, mbit: float,
                   queue_ms: int, size: int = 1024,
                   receiver_settings: dict[str, Any] | None = None,
                   publication_params: tuple[str, str] = ("", ""),
                   sender_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Two streams of ``size``-byte messages from host 1 to host 2 through a ``tbf`` of
    ``mbit`` Mbit/s holding ``queue_ms`` on host 1's uplink, the publisher offering on both as
    fast as it can for ``seconds``, the subscriptions with ``subscription_params`` (e.g.
    ``cc=cubic``): ``{"bins": each stream's delivered bytes per 100 ms, "sent": messages per
    stream, "naks": NAKs the receiving driver sent, "losses": gaps its loss report saw per
    stream}``, every message checked (once, in
    order); ``receiver_settings`` are the receiving driver's (``cubic_tcp_mode``, ...),
    ``sender_settings`` the sending one's, and ``publication_params`` go in each publication's
    URI (``priority=800``: the two share one send socket, so its bands decide)."""
    with NamespaceHosts(2) as hosts:
        hosts.rate_limit(1, mbit, latency_ms=queue_ms)
        sender = hosts.start_driver(1, **{"log_level": "warning", **(sender_settings or {})})
        receiver = hosts.start_driver(2, **{"log_level": "warning", **(receiver_settings or {})})
        uri = f"aeron:udp?endpoint={hosts[2].address}:{UNICAST_PORT}"
        with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
            subscriptions = [b.add_subscription(f"{uri}|{params}" if params else uri, 1 + k)
                             for k, params in enumerate(subscription_params)]
            publications = [a.add_publication(f"{uri}|{params}" if params else uri, 1 + k)
                            for k, params in enumerate(publication_params)]
            deadline = time.monotonic() + 20
            while not all(p.is_connected for p in publications) or not all(
                    s.images for s in subscriptions):
                if time.monotonic() > deadline:
                    raise TimeoutError("the streams did not connect")
                time.sleep(0.01)
            message = bytearray(size)
            sent = [0, 0]
            got = [0, 0]
            bins: list[list[int]] = [[], []]
            counts = [0, 0]

            def handler(k: int) -> Callable[[memoryview, object], None]:
                def on_message(data: memoryview, _header: object) -> None:
                    seq = int.from_bytes(data[:8], "little")
                    if seq != got[k]:
                        raise AssertionError(f"stream {k + 1}: {seq} where {got[k]} was due")
                    got[k] += 1
                    counts[k] += len(data)
                return on_message

            handlers = [handler(0), handler(1)]
            started = time.monotonic()
            next_bin = started + 0.1
            while (now := time.monotonic()) < started + seconds:
                for k in (0, 1):
                    for _ in range(16):
                        message[:8] = sent[k].to_bytes(8, "little")
                        if publications[k].offer(message) < 0:
                            break
                        sent[k] += 1
                    subscriptions[k].poll(handlers[k], 64)
                if now >= next_bin:
                    for k in (0, 1):
                        bins[k].append(counts[k])
                        counts[k] = 0
                    next_bin += 0.1
            deadline = time.monotonic() + 30
            while got != sent:  # the rest, and the check that nothing was lost
                if time.monotonic() > deadline:
                    raise AssertionError(f"got {got} of {sent}: messages were lost")
                for k in (0, 1):
                    subscriptions[k].poll(handlers[k], 256)
        naks = read_system_counters(receiver.directory)[SystemCounter.NAK_MESSAGES_SENT]
        losses = [sum(entry.observations for entry in read_loss_report(receiver.directory)
                      if entry.stream_id == 1 + k) for k in (0, 1)]
    return {"bins": bins, "sent": sent, "naks": naks, "losses": losses}
