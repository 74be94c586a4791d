"""Host names in channels resolve off the driver's loop: a slow resolver delays that one
command, never the driver's heartbeat (nor its systemd watchdog) nor another client's commands,
and one that does not answer in time gets the command refused, naming the host.  The name
cache and the resolver run on the threads daemon/streams/ownership.py names.  A unicast
endpoint's name is resolved again while its peer is silent, off the loop too, and the endpoint
follows a changed address (the whole path through the system's resolver:
tests/test_re_resolution_hosts.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import FAST_DRIVER_SETTINGS, Collector, RawClient, free_port, stream, wait_for

from slipstream.client import (
    ChannelError,
    ChannelRejectedError,
    Client,
    RegistrationError,
    control,
)
from slipstream.client.counters import CountersFile, SystemCounter
from slipstream.daemon.config import load_settings
from slipstream.daemon.core import HELD_COMMANDS_MAX
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.media import names
from slipstream.daemon.shell import _DriverShell
from slipstream.daemon.streams import ownership

#: How long the stuck name's resolver takes to answer, s: a name that waited for it would
#: be followed no sooner.
STUCK_S = 6.0


def _slow_resolver(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> threading.Event:
    """``slow.test`` resolves to 127.0.0.1 after ``delay_s``, as a resolver timing out does
    (every other name as the system's resolver says); the event is set as its lookup
    begins."""
    real = socket.getaddrinfo
    asked = threading.Event()

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.test":
            asked.set()
            time.sleep(delay_s)
            return real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


@dataclasses.dataclass
class _Records:
    """The records of names a test changes as it goes: each name's address, and how long a
    lookup of it takes (s, 0 unless set)."""

    address: dict[str, str]
    delay: dict[str, float] = dataclasses.field(default_factory=dict)


def _moving_names(monkeypatch: pytest.MonkeyPatch, **records: str) -> _Records:
    """``records`` (name -> the address it resolves to now) answered by the resolver from
    the returned :class:`_Records`, which the test rewrites.  Nothing is cached."""
    real = socket.getaddrinfo
    table = _Records(dict(records))

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host in table.address:
            time.sleep(table.delay.get(host, 0.0))
            return real(table.address[host], *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table


def _resolution_changes(directory: Path) -> int:
    """The driver's RESOLUTION_CHANGES counter."""
    counters = CountersFile(directory / "counters.dat", writable=False)
    try:
        return counters.get(SystemCounter.RESOLUTION_CHANGES)
    finally:
        counters.close()


async def _with_driver(action: Any, **overrides: str) -> tuple[Any, list[int]]:
    """Run a real driver shell in this process, ``action(directory)`` in a thread, and
    sample the driver's heartbeat (ms) meanwhile."""
    directory = Path("/dev/shm") / f"slipstream-test-{uuid.uuid4().hex[:12]}"
    # A client's keepalives wait while its request does: a liveness timeout above the delay.
    settings = load_settings(env={}, overrides={**FAST_DRIVER_SETTINGS, "dir": str(directory),
                                                "client_liveness_timeout": "5s",
                                                "publication_unblock_timeout": "10s",
                                                **overrides})
    beats: list[int] = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(_DriverShell(settings).run)
            counters = CountersFile(directory / "counters.dat", writable=False)

            async def sample() -> None:
                while True:
                    beats.append(counters.driver_heartbeat_ns // 1_000_000)
                    await trio.sleep(0.05)

            nursery.start_soon(sample)
            result = await trio.to_thread.run_sync(action, directory)
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return result, beats


async def test_a_slow_resolver_delays_the_command_not_the_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_resolver(monkeypatch, 1.5)
    port = free_port()

    def add(directory: Path) -> float:
        with Client.connect(directory) as client:
            started = time.monotonic()
            client.add_subscription(f"aeron:udp?endpoint=slow.test:{port}", 5)
            return time.monotonic() - started

    took, beats = await _with_driver(add)
    assert took >= 1.5
    # The heartbeat went on while the name resolved: no gap near the resolver's delay.
    gaps = [b - a for a, b in itertools.pairwise(beats) if b != a]
    assert gaps and max(gaps) < 700, gaps


#: How long ``slow.test`` takes to resolve in the tests of other clients served meanwhile, s:
#: far longer than a client's add and a hundred IPC messages take.
SLOW_S = 4.0


def _served_meanwhile(directory: Path, asked: threading.Event) -> tuple[bool, float]:
    """A client adds a subscription at ``slow.test`` from a thread; once the driver asked the
    resolver for it, another client of the same driver adds an IPC subscription and
    publication and streams 100 messages.  Returns whether the first client's add was still
    waiting for its name when the second was done, and how long the first one's add took."""
    took: list[float] = []

    def add_named() -> None:
        with Client.connect(directory) as client:
            started = time.monotonic()
            client.add_subscription(f"aeron:udp?endpoint=slow.test:{free_port()}", 5)
            took.append(time.monotonic() - started)

    named = threading.Thread(target=add_named)
    named.start()
    try:
        assert asked.wait(10), "the driver never asked the resolver for slow.test"
        with Client.connect(directory) as client:
            collector = Collector(client.add_subscription("aeron:ipc", 6))
            stream(client.add_publication("aeron:ipc", 6), [collector], 100, lambda _: 64)
            collector.assert_exactly(100)
        waiting = named.is_alive()
    finally:
        named.join(SLOW_S + 10)
    assert took, "the named subscription was not added"
    return waiting, took[0]


async def test_a_driver_serves_other_clients_while_a_name_resolves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _slow_resolver(monkeypatch, SLOW_S)
    (waiting, took), _ = await _with_driver(lambda d: _served_meanwhile(d, asked))
    assert waiting and took >= SLOW_S - 0.5


def _embedded_pumped(**settings: str) -> tuple[Any, threading.Thread, threading.Event]:
    """An embedded driver whose duty cycle a thread of its own runs (its conductor's thread)
    until the event is set."""
    directory = Path("/dev/shm") / f"slipstream-test-{uuid.uuid4().hex[:12]}"
    driver = MediaDriver.embedded(directory, **settings)
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            if not driver.do_work():
                time.sleep(0.0005)

    pumping = threading.Thread(target=pump, name="embedded-conductor")
    pumping.start()
    return driver, pumping, stop


def test_an_embedded_driver_serves_other_clients_while_a_name_resolves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded driver's conductor runs on its caller's thread: the name is resolved on
    a thread of the resolver's, and the caller's calls serve every other client meanwhile."""
    asked = _slow_resolver(monkeypatch, SLOW_S)
    driver, pumping, stop = _embedded_pumped()
    try:
        waiting, took = _served_meanwhile(driver.directory, asked)
    finally:
        stop.set()
        pumping.join(10)
        driver.close()
    assert waiting and took >= SLOW_S - 0.5


def test_a_clients_commands_take_effect_in_its_order_while_one_waits_for_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends commands without waiting for their answers (Aeron's async adds)
    sees them take effect in its order though the first waits for its channel's name: a
    destination removed right after it was added is gone, not added after its removal, and
    an IPC add sent behind them is answered after them.  Another client is served
    meanwhile.  (The embedded driver's conductor: the driver process's shares it.)"""
    asked = _slow_resolver(monkeypatch, 1.0)
    driver, pumping, stop = _embedded_pumped()
    raw = _connected_raw(driver.directory)
    try:
        ready = raw.request({"type": control.ADD_PUBLICATION, "stream_id": 5,
                             "channel": "aeron:udp?control-mode=manual", "correlation_id": 2})
        assert ready["type"] == control.PUBLICATION_READY, ready
        publication = ready["registration_id"]
        named = f"aeron:udp?endpoint=slow.test:{free_port()}"
        for correlation_id, command in ((3, control.ADD_DESTINATION),
                                        (4, control.REMOVE_DESTINATION)):
            raw.send_raw(json.dumps({"type": command, "registration_id": publication,
                                     "channel": named,
                                     "correlation_id": correlation_id}).encode())
        raw.send_raw(json.dumps({"type": control.ADD_SUBSCRIPTION, "channel": "aeron:ipc",
                                 "stream_id": 6, "correlation_id": 5}).encode())
        assert asked.wait(10), "the driver never asked the resolver for slow.test"
        with Client.connect(driver.directory) as other:
            other.add_subscription("aeron:ipc", 7)
        answers = [raw.reply(10_000) for _ in range(3)]
        assert [(a["type"], a["correlation_id"]) for a in answers] == [
            (control.OPERATION_SUCCESS, 3), (control.OPERATION_SUCCESS, 4),
            (control.SUBSCRIPTION_READY, 5)], answers
        assert raw.silent(), "an answer too many"
    finally:
        raw.close()
        stop.set()
        pumping.join(10)
        driver.close()


def _connected_raw(directory: Path) -> RawClient:
    raw = RawClient(directory)
    assert raw.request({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                        "pid": 1, "process": 1, "correlation_id": 1}
                       )["type"] == control.CONNECTED
    return raw


def test_commands_past_the_held_limit_are_refused_and_those_naming_a_host_that_timed_out_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a command waiting for a name that never comes in time: the client's next
    HELD_COMMANDS_MAX commands wait, the one past them is refused at once (``resource``);
    when the first is refused for its host, the held ones naming that host are refused with
    it, not after as long again each, and the others are handled in order."""
    _slow_resolver(monkeypatch, 3.0)
    monkeypatch.setattr(names, "PREFETCH_TIMEOUT_S", 0.5)
    asked: list[str] = []
    slow_getaddrinfo = socket.getaddrinfo

    def counted(host: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(host)
        return slow_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counted)
    driver, pumping, stop = _embedded_pumped()
    raw = _connected_raw(driver.directory)
    slow = f"aeron:udp?endpoint=slow.test:{free_port()}"
    try:
        commands = [{"type": control.ADD_SUBSCRIPTION, "channel": slow, "stream_id": 5},
                    {"type": control.ADD_SUBSCRIPTION, "channel": slow, "stream_id": 6}]
        commands += [{"type": control.REMOVE_SUBSCRIPTION, "registration_id": 12345}
                     for _ in range(HELD_COMMANDS_MAX)]  # the first of them, plus the limit
        for correlation_id, command in enumerate(commands, start=10):
            raw.send_raw(json.dumps({**command, "correlation_id": correlation_id}).encode())
        past = 10 + len(commands) - 1
        answers = [raw.reply(10_000) for _ in commands]
        assert (answers[0]["correlation_id"], answers[0]["code"]) == (past,
                                                                      control.ERR_RESOURCE)
        assert [a["correlation_id"] for a in answers[1:]] == list(range(10, past))
        assert [a["code"] for a in answers[1:3]] == [control.ERR_INVALID_CHANNEL] * 2
        assert all("slow.test" in a["message"] for a in answers[1:3])
        assert {a["code"] for a in answers[3:]} == {control.ERR_UNKNOWN_SUBSCRIPTION}
        assert raw.silent(), "an answer too many"
        assert asked.count("slow.test") == 1, asked  # the second was not waited for again
    finally:
        raw.close()
        stop.set()
        pumping.join(10)
        driver.close()


async def test_the_name_cache_and_the_resolver_run_on_the_threads_the_ownership_table_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every method of :data:`ownership.NAME_THREADS` is called, while a driver adds a channel
    by name, serves a second command of the same name from its cache and resolves the name
    again, only on its owner's thread: the conductor's (the driver shell's trio thread, this
    test's) or a resolver's (never the conductor's)."""
    _slow_resolver(monkeypatch, 0.5)
    calls: dict[str, list[str]] = {}  # the threads that called each, a call each

    def recorded(name: str, function: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            calls.setdefault(name, []).append(threading.current_thread().name)
            return function(*args, **kwargs)
        return record

    expected: dict[str, str] = {}
    for owner_name, table in ownership.NAME_THREADS.items():
        for method, owner in table.items():
            if owner_name == method:  # a module function
                expected[method] = owner
                monkeypatch.setattr(names, method, recorded(method, getattr(names, method)))
            else:
                cls = getattr(names, owner_name)
                expected[f"{owner_name}.{method}"] = owner
                monkeypatch.setattr(cls, method, recorded(f"{owner_name}.{method}",
                                                          getattr(cls, method)))

    def add_and_wait(directory: Path) -> None:
        with Client.connect(directory) as client:
            port = free_port()
            client.add_publication(f"aeron:udp?endpoint=slow.test:{port}", 8)  # nobody there
            client.add_subscription(f"aeron:udp?endpoint=slow.test:{port}", 9)
            # Silent past its connection timeout: its name is resolved again (the second
            # command found the first one's answer).
            wait_for(lambda: len(calls.get("resolve", [])) >= 2, timeout=10,
                     what="a re-resolution")

    await _with_driver(add_and_wait, name_re_resolution_interval="200ms",
                       publication_connection_timeout="500ms")
    conductor = threading.current_thread().name
    assert set(calls) == set(expected), f"not called: {set(expected) - set(calls)}"
    for name, owner in expected.items():
        if owner == ownership.CONDUCTOR:
            assert set(calls[name]) == {conductor}, (name, set(calls[name]))
        else:
            assert owner == ownership.RESOLVER
            assert conductor not in calls[name], (name, set(calls[name]))


async def test_a_resolver_that_does_not_answer_in_time_gets_the_command_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_resolver(monkeypatch, 3.0)
    monkeypatch.setattr(names, "PREFETCH_TIMEOUT_S", 0.5)

    def add(directory: Path) -> str:
        with Client.connect(directory) as client:
            with pytest.raises(RegistrationError) as refused:
                client.add_publication(f"aeron:udp?endpoint=slow.test:{free_port()}", 6)
            return str(refused.value)

    message, _ = await _with_driver(add)
    assert "slow.test" in message and "did not answer" in message


async def test_a_host_that_does_not_resolve_is_a_channel_error_naming_the_endpoint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "nowhere.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    def add(directory: Path) -> tuple[ChannelRejectedError, str]:
        with Client.connect(directory) as client:
            # One except clause catches every bad URI, whichever side found it.
            with pytest.raises(ChannelError) as refused:
                client.add_publication(f"aeron:udp?endpoint=nowhere.test:{free_port()}", 7)
            served = client.add_publication("aeron:ipc", 7)  # the driver serves on
            return refused.value, served.channel

    refused, served = (await _with_driver(add))[0]
    assert isinstance(refused, ChannelRejectedError) and isinstance(refused, RegistrationError)
    assert refused.part == "endpoint" and "nowhere.test" in refused.problem
    assert refused.code == "invalid_channel" and served == "aeron:ipc"


async def test_a_silent_endpoints_name_is_resolved_again_off_the_loop_and_followed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``moving.test`` names 127.0.0.1, where nobody listens, then 127.0.0.2, where the
    subscriber is, and its resolver takes 1.5 s to say so: the publication, never connected,
    has its name resolved again, the heartbeat goes on meanwhile, and the stream then flows
    to the new address, counted as a resolution change."""
    record = _moving_names(monkeypatch, **{"moving.test": "127.0.0.1"})
    port = free_port()

    def follow(directory: Path) -> tuple[list[int], int]:
        with Client.connect(directory) as client:
            subscription = client.add_subscription(f"aeron:udp?endpoint=127.0.0.2:{port}", 8)
            publication = client.add_publication(f"aeron:udp?endpoint=moving.test:{port}", 8)
            time.sleep(0.5)
            assert not publication.is_connected  # 127.0.0.1: nobody there
            record.address["moving.test"] = "127.0.0.2"
            record.delay["moving.test"] = 1.5
            wait_for(lambda: publication.is_connected, timeout=6.0,
                     what="the publication connected at the name's new address")
            collector = Collector(subscription)
            stream(publication, [collector], 200, lambda _: 64)
            collector.assert_exactly(200)
            return collector.seen, _resolution_changes(directory)

    (seen, changes), beats = await _with_driver(
        follow, name_re_resolution_interval="200ms", publication_connection_timeout="1s")
    assert len(seen) == 200 and changes == 1
    gaps = [b - a for a, b in itertools.pairwise(beats) if b != a]
    assert gaps and max(gaps) < 700, gaps


async def test_a_name_whose_resolver_hangs_delays_no_other_name_due_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two silent endpoints' names are due at the same checks: ``stuck.test``, whose
    resolver then takes 6 s for each answer, and ``moving.test``, which moves to where its
    subscriber is.  Each name is resolved in a thread of its own and handed over as it
    answers: the moving one is followed within a few intervals, not after the stuck one."""
    record = _moving_names(monkeypatch, **{"stuck.test": "127.0.0.1",
                                           "moving.test": "127.0.0.1"})
    port, stuck_port = free_port(), free_port()

    def follow(directory: Path) -> tuple[float, int]:
        with Client.connect(directory) as client:
            subscription = client.add_subscription(f"aeron:udp?endpoint=127.0.0.2:{port}", 8)
            # Watched first: its name comes first in every check's list.
            client.add_publication(f"aeron:udp?endpoint=stuck.test:{stuck_port}", 8)
            publication = client.add_publication(f"aeron:udp?endpoint=moving.test:{port}", 8)
            record.delay["stuck.test"] = STUCK_S
            time.sleep(1.5)  # past publication_connection_timeout: both silent, both due
            assert not publication.is_connected
            record.address["moving.test"] = "127.0.0.2"
            moved = time.monotonic()
            wait_for(lambda: publication.is_connected, timeout=STUCK_S / 2,
                     what="the publication connected at the name's new address")
            followed_s = time.monotonic() - moved
            collector = Collector(subscription)
            stream(publication, [collector], 100, lambda _: 64)
            collector.assert_exactly(100)
            return followed_s, _resolution_changes(directory)

    (followed_s, changes), _ = await _with_driver(
        follow, name_re_resolution_interval="200ms", publication_connection_timeout="1s")
    # A check at most an interval away, the answer, the connection cycle; not the STUCK_S
    # of the stuck name asked at the same check.
    assert followed_s < STUCK_S / 2, followed_s
    assert changes == 1


async def test_a_silent_manual_destinations_name_is_followed_and_the_others_lose_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A control-mode=manual publication sends to ``moving.test`` (127.0.0.1, nobody there,
    then 127.0.0.2, a subscriber) and to 127.0.0.3 (a subscriber that stays): the named
    destination is resolved again and moved, and the one that stays gets every message."""
    record = _moving_names(monkeypatch, **{"moving.test": "127.0.0.1"})
    # No answer is reused: each command that names moving.test asks the resolver.
    monkeypatch.setattr(names, "TTL_S", 0.0)
    port = free_port()

    def follow(directory: Path) -> int:
        with Client.connect(directory) as client:
            moved = Collector(client.add_subscription(f"aeron:udp?endpoint=127.0.0.2:{port}",
                                                      9))
            stays = Collector(client.add_subscription(f"aeron:udp?endpoint=127.0.0.3:{port}",
                                                      9))
            publication = client.add_publication("aeron:udp?control-mode=manual", 9)
            publication.add_destination(f"aeron:udp?endpoint=127.0.0.3:{port}")
            publication.add_destination(f"aeron:udp?endpoint=moving.test:{port}")
            stream(publication, [stays], 300, lambda _: 64)
            assert moved.poll() == 0  # its name is 127.0.0.1 yet: nothing there
            record.address["moving.test"] = "127.0.0.2"
            sent = 300
            deadline = time.monotonic() + 8.0
            while not moved.seen:
                assert time.monotonic() < deadline, "the named destination was not followed"
                stream(publication, [stays], 10, lambda _: 64, first=sent)
                sent += 10
                moved.poll()
                time.sleep(0.02)
            stream(publication, [stays, moved], 300, lambda _: 64, first=sent)
            stays.assert_exactly(sent + 300)
            first = moved.seen[0]
            assert moved.seen == list(range(first, sent + 300))
            # Removed by its name, whatever the name resolves to by then (a record changed
            # again while the destination is in contact does not move it).
            record.address["moving.test"] = "127.0.0.9"
            publication.remove_destination(f"aeron:udp?endpoint=moving.test:{port}")
            sent += 300
            # The sender applies the removal at its next duty cycle, which the answer does
            # not wait for: a cycle under way may still send it what is offered at once.
            stream(publication, [stays], 50, lambda _: 64, first=sent)
            time.sleep(0.1)
            moved.poll()
            reached = len(moved.seen)
            stream(publication, [stays], 50, lambda _: 64, first=sent + 50)
            time.sleep(0.1)
            moved.poll()
            assert len(moved.seen) == reached  # no longer a destination
            stays.assert_exactly(sent + 100)
            return _resolution_changes(directory)

    changes, _ = await _with_driver(
        follow, name_re_resolution_interval="200ms", publication_connection_timeout="1s")
    assert changes == 1


async def test_a_dynamic_receivers_control_name_follows_the_publisher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic multi-destination-cast receiver joins at ``control=moving.test``: 127.0.0.1,
    where no publisher is, then 127.0.0.2, where one is.  With no image, its endpoint's
    control name is resolved again, and it joins the publisher there."""
    record = _moving_names(monkeypatch, **{"moving.test": "127.0.0.1"})
    port, control = free_port(), free_port()

    def follow(directory: Path) -> int:
        with Client.connect(directory) as client:
            publication = client.add_publication(
                f"aeron:udp?control-mode=dynamic|control=127.0.0.2:{control}", 10)
            subscription = client.add_subscription(
                f"aeron:udp?endpoint=127.0.0.3:{port}|control=moving.test:{control}", 10)
            time.sleep(0.5)
            assert not subscription.images  # nobody at 127.0.0.1
            record.address["moving.test"] = "127.0.0.2"
            collector = Collector(subscription)
            wait_for(lambda: subscription.images and publication.is_connected, timeout=8.0,
                     what="the receiver joined the publisher at its name's new address")
            stream(publication, [collector], 100, lambda _: 64)
            return _resolution_changes(directory)

    changes, _ = await _with_driver(follow, name_re_resolution_interval="200ms")
    assert changes == 1


def test_commands_naming_hanging_hosts_share_a_bounded_pool_of_resolver_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three times as many commands as the resolver has threads, each naming a host whose
    lookup hangs: at most RESOLVER_POOL threads resolve (the rest of the commands wait in
    the queue), once the lookups end every command is answered, with its host, and the
    threads end as the resolver closes."""
    real = socket.getaddrinfo
    release = threading.Event()

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host.endswith(".hang.test"):
            release.wait(30)
            return real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    woken = threading.Semaphore(0)
    resolver = names.NameResolver(woken.release)
    commands = 3 * names.RESOLVER_POOL

    # This resolver's threads: an earlier test's (a driver closed in this process) may still
    # be ending.
    before = set(threading.enumerate())

    def resolving() -> int:
        return sum(t.name == "ss-resolve" and t not in before for t in threading.enumerate())

    for request in range(commands):
        resolver.submit(names.ResolveNames(request, (f"h{request}.hang.test",)))
    wait_for(lambda: resolving() == names.RESOLVER_POOL, what="the pool's threads started")
    time.sleep(0.2)  # a thread per command would have started by now
    assert resolving() == names.RESOLVER_POOL
    release.set()
    answers: dict[int, names.NamesResolved] = {}
    while len(answers) < commands:
        assert woken.acquire(timeout=10), f"{len(answers)} of {commands} answered"
        answers.update((a.request, a) for a in resolver.answered())
    assert all(answers[r].answers[f"h{r}.hang.test"].address == "127.0.0.1"
               for r in range(commands))
    resolver.close()  # as the driver closes: its threads end
    wait_for(lambda: resolving() == 0, what="the resolver's threads ended")
