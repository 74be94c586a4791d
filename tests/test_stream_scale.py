"""A driver with thousands of streams (issue 70): what a command and a duty cycle cost does not
grow with the streams, counted in operations rather than timed; the watch on shared words that
lets a cycle pass over only what moved; the counters' free list and high water; and 10,000
IPC pairs under the default settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import NETWORK_SETTINGS, free_port, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.client import Client, control
from slipstream.client.counters import CountersFile, CountersFullError, CounterType
from slipstream.client.errors import SlipstreamError
from slipstream.daemon._network import ffi
from slipstream.daemon.conductor import ipc
from slipstream.daemon.conductor.conductor import DriverConductor
from slipstream.daemon.conductor.watch import SPACING_NS_PER_WORD, UNSPACED_WORDS, WordWatch
from slipstream.daemon.config import DriverSettings, load_settings
from slipstream.daemon.driver import MediaDriver

CHANNEL = "aeron:ipc?term-length=64k|sparse=true"


class _Passes:
    """Counts IpcPublication.update_limits calls: the conductor's passes over publications."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = ipc.IpcPublication.update_limits

        def counted(publication: ipc.IpcPublication, now_ns: int) -> int:
            self.count += 1
            return original(publication, now_ns)

        monkeypatch.setattr(ipc.IpcPublication, "update_limits", counted)

    def during(self, action) -> int:
        before = self.count
        action()
        return self.count - before


def _conductor_with_pairs(shm: Path, pairs: int) -> tuple[DriverConductor, CountersFile,
                                                           list[dict]]:
    """A conductor (sans I/O) whose one client added ``pairs`` IPC pairs, and their
    AVAILABLE_IMAGE events."""
    (shm / control.PUBLICATIONS_DIR).mkdir()
    counters = CountersFile.create(shm / control.COUNTERS_FILE, 16 * pairs + 256)
    conductor = DriverConductor(DriverSettings(dir=str(shm)), shm, counters)
    now = 1_000_000
    conductor.on_command(b"k", {"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                                "pid": 1, "process": 1, "correlation_id": 1}, now)
    images = []
    for i in range(pairs):
        for kind in (control.ADD_SUBSCRIPTION, control.ADD_PUBLICATION):
            out = conductor.on_command(b"k", {"type": kind, "channel": CHANNEL,
                                              "stream_id": 1000 + i,
                                              "correlation_id": 10 + i}, now)
            assert out[0][1]["type"] != control.ERROR, out
            images += [m for _, m in out if m["type"] == control.AVAILABLE_IMAGE]
        conductor.do_work(now)
    return conductor, counters, images


@pytest.mark.parametrize("pairs", [10, 400])
def test_an_idle_cycle_passes_over_no_publication_and_one_that_moved_alone(
        shm: Path, monkeypatch: pytest.MonkeyPatch, pairs: int) -> None:
    """Settled, a conductor cycle passes over none of the IPC publications; when one
    subscriber's position moves, over that one publication alone, whatever the count (the
    cycles 10 ms apart: each looks at the watched words)."""
    passes = _Passes(monkeypatch)
    conductor, counters, images = _conductor_with_pairs(shm, pairs)
    try:
        times = iter(range(2_000_000, 10**12, 10_000_000))
        for _ in range(3):  # settle
            conductor.do_work(next(times))
        assert passes.during(lambda: conductor.do_work(next(times))) == 0
        counters.set(images[pairs // 2]["subscriber_position_counter_id"], 64)
        assert passes.during(lambda: conductor.do_work(next(times))) == 1
        assert passes.during(lambda: conductor.do_work(next(times))) == 0
    finally:
        conductor.close(0)
        counters.close()


def test_a_change_between_the_watchs_looks_is_found_at_the_deadline_the_conductor_asks(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cycles closer together than the watch's spacing (commands, marks) do not look at the
    watched words: a subscriber position that moved meanwhile is passed over by the cycle at
    the deadline the conductor then asks for, no later than the spacing of its words after
    the last look, and a conductor owing no look asks for none."""
    passes = _Passes(monkeypatch)
    pairs = 400
    conductor, counters, images = _conductor_with_pairs(shm, pairs)
    try:
        now = 2_000_000
        for _ in range(3):  # settle
            now += 10_000_000
            conductor.do_work(now)
        idle_deadline = conductor.next_deadline_ns()
        assert idle_deadline >= now + 100_000_000  # the timer's, not the watch's
        spacing = len(conductor._ipc_watch) * SPACING_NS_PER_WORD
        counters.set(images[pairs // 2]["subscriber_position_counter_id"], 64)
        assert passes.during(lambda: conductor.do_work(now + 1)) == 0
        deadline = conductor.next_deadline_ns()
        assert now + 1 < deadline <= now + spacing
        assert passes.during(lambda: conductor.do_work(deadline)) == 1
        assert conductor.next_deadline_ns() == idle_deadline
    finally:
        conductor.close(0)
        counters.close()


@pytest.mark.parametrize("pairs", [10, 400])
def test_adding_and_removing_a_pair_passes_over_that_pair_alone(
        shm: Path, monkeypatch: pytest.MonkeyPatch, pairs: int) -> None:
    """The commands and the cycle after them touch the new (or removed) stream's publication
    only: as many passes at 10 pairs as at 400."""
    passes = _Passes(monkeypatch)
    conductor, counters, _ = _conductor_with_pairs(shm, pairs)
    removals = 0
    original_remove = ipc.IpcPublication.remove_subscriber

    def counted_remove(publication: ipc.IpcPublication, subscription_id: int):
        nonlocal removals
        removals += 1
        return original_remove(publication, subscription_id)

    monkeypatch.setattr(ipc.IpcPublication, "remove_subscriber", counted_remove)
    try:
        now = 2_000_000
        for _ in range(3):
            conductor.do_work(now)
        replies = {}

        def add() -> None:
            for kind in (control.ADD_SUBSCRIPTION, control.ADD_PUBLICATION):
                (_, reply), *_ = conductor.on_command(b"k", {
                    "type": kind, "channel": CHANNEL, "stream_id": 7, "correlation_id": 5}, now)
                replies[kind] = reply
            conductor.do_work(now)

        # The attach's own limit update, then the cycle's pass over the new publication.
        assert passes.during(add) == 2
        subscription_id = replies[control.ADD_SUBSCRIPTION]["registration_id"]
        assert passes.during(lambda: conductor.do_work(now)) == 0

        def remove() -> None:
            conductor.on_command(b"k", {"type": control.REMOVE_SUBSCRIPTION,
                                        "registration_id": subscription_id,
                                        "correlation_id": 6}, now)
            conductor.do_work(now)

        assert passes.during(remove) == 1
        assert removals == 1  # the stream's one publication, not every publication
    finally:
        conductor.close(0)
        counters.close()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["watch", "forget", "write", "mark", "changed"]),
                          st.integers(0, 40), st.integers(-3, 3)), max_size=120))
def test_a_word_watch_reports_exactly_the_owners_whose_words_changed(ops) -> None:
    """Against a model: :meth:`WordWatch.changed` answers the owners of the watched words whose
    value differs from the one last reported (or watched), and the marked ones; a forgotten
    word is never reported; slots are reused, the arrays grow as needed."""
    watch = WordWatch(slots=2)
    cells = [ffi.new("int64_t *") for _ in range(41)]
    slots: dict[int, int] = {}  # cell -> slot
    seen: dict[int, int] = {}  # cell -> value last reported
    marked: set[int] = set()
    for op, cell, value in ops:
        owner = cell % 7
        if op == "watch" and cell not in slots:
            slots[cell] = watch.watch(cells[cell], (cell, owner))
            seen[cell] = cells[cell][0]
        elif op == "forget" and cell in slots:
            watch.forget(slots.pop(cell))
            del seen[cell]
        elif op == "write":
            cells[cell][0] = value
        elif op == "mark":
            marked.add((cell, owner))
            watch.mark((cell, owner))
        elif op == "changed":
            expected = {(c, c % 7) for c in slots if cells[c][0] != seen[c]} | marked
            assert watch.changed() == expected
            seen = {c: cells[c][0] for c in slots}
            marked.clear()
        assert len(watch) == len(slots)
        assert watch.capacity >= len(slots)
    assert len(set(slots.values())) == len(slots)


def test_a_word_watchs_looks_scan_at_most_once_per_spacing_and_owe_the_scan_they_skip(
        ) -> None:
    """:meth:`WordWatch.look` scans the words when the spacing (per word) since its last scan
    has passed, or when told to; a look before that answers the marked owners alone and owes
    the scan, due at the spacing, which finds what moved meanwhile.  A watch of few words is
    scanned at every look (it owes nothing), and so is one of none."""
    words = UNSPACED_WORDS + 44
    watch = WordWatch()
    cells = [ffi.new("int64_t *") for _ in range(words)]
    for i, cell in enumerate(cells):
        watch.watch(cell, i)
    spacing = words * SPACING_NS_PER_WORD
    now = 1_000_000
    assert watch.look(now) == set()  # nothing moved yet
    assert watch.owed_scan_ns is None
    cells[7][0] = 1
    watch.mark(9)
    assert watch.look(now + 1) == {9}  # the mark alone: no scan within the spacing
    assert watch.owed_scan_ns == now + spacing
    assert watch.look(now + spacing - 1) == set()
    assert watch.look(now + spacing) == {7}
    assert watch.owed_scan_ns is None
    cells[8][0] = 1
    assert watch.look(now + spacing + 1, scan=True) == {8}  # told to: at once
    cells[3][0] = 1
    assert watch.look(now + spacing + 2) == set()
    assert watch.owed_scan_ns == now + 2 * spacing + 1
    for slot in range(words - UNSPACED_WORDS):
        watch.forget(slot)
    assert watch.look(now + spacing + 3) == set()  # slot 3 went with the rest
    cells[words - 1][0] = 1
    assert watch.look(now + spacing + 4) == {words - 1}  # few words: scanned every look
    assert watch.owed_scan_ns is None
    for slot in range(words - UNSPACED_WORDS, words):
        watch.forget(slot)
    assert watch.owed_scan_ns is None


def test_counters_take_freed_slots_again_and_readers_stop_at_the_high_water(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocation takes the oldest freed slot whose delay passed, else a slot never used; the
    high water says how far readers look, so a large capacity costs them nothing unused; a
    full file names the setting and its value."""
    from slipstream.client import counters as counters_module

    counters = CountersFile.create(shm / "counters.dat", 100_000)
    try:
        system = counters.high_water
        ids = [counters.allocate(CounterType.SUBSCRIBER_POSITION, f"s{i}") for i in range(50)]
        assert ids == list(range(system, system + 50))
        assert counters.high_water == system + 50
        assert len(list(counters)) == system + 50
        monkeypatch.setattr(counters_module, "FREE_TO_REUSE_TIMEOUT_NS", 0)
        for counter_id in ids[10:20]:
            counters.free(counter_id)
        again = [counters.allocate(CounterType.SUBSCRIBER_POSITION, "again") for _ in range(10)]
        assert sorted(again) == ids[10:20]
        assert counters.high_water == system + 50
        reader = CountersFile(shm / "counters.dat", writable=False)
        assert reader.high_water == system + 50
        reader.close()
    finally:
        counters.close()
    small = CountersFile.create(shm / "small.dat", 256)
    try:
        with pytest.raises(CountersFullError, match=r"counters_capacity = 256: raise "):
            for _ in range(300):
                small.allocate(CounterType.SUBSCRIBER_POSITION, "x")
    finally:
        small.close()


def test_the_default_counters_capacity_holds_ten_thousand_ipc_pairs() -> None:
    """The default settings' counters (8 an IPC pair: pub-lmt, pub-pos, the five
    back-pressure counters, sub-pos) hold 10,000 pairs and the system counters."""
    defaults = load_settings(env={})
    assert defaults.counters_capacity >= 10_000 * 8 + 72


def _publish_each(directory: str, pairs: int, answer) -> None:
    """A second client process (each mapped log holds a file descriptor in Python's mmap:
    10,000 images and 10,000 publications in one process pass the 20,000 a process may hold
    here): a publication on each stream; answers how many were refused and how many are
    connected."""
    refused, connected = 0, 0
    with Client.connect(directory, timeout=30.0) as client:
        publications = []
        for i in range(pairs):
            try:
                publications.append(client.add_publication(CHANNEL, 1000 + i))
            except SlipstreamError:
                refused += 1
        connected = sum(1 for publication in publications if publication.is_connected)
        answer.send((refused, connected))
        answer.recv()  # held open until the subscribers saw their images


def test_ten_thousand_ipc_pairs_are_added_under_the_default_settings(shm: Path) -> None:
    """A driver with its default settings takes 10,000 IPC pairs (64 KiB sparse terms): none
    refused, each publication connected, each subscription with its image."""
    import multiprocessing

    pairs = 10_000
    with MediaDriver.launch(directory=shm / "driver") as driver, \
            Client.connect(driver.directory, timeout=30.0) as client:
        subscriptions = [client.add_subscription(CHANNEL, 1000 + i) for i in range(pairs)]
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        publisher = context.Process(target=_publish_each,
                                    args=(str(driver.directory), pairs, theirs))
        publisher.start()
        try:
            assert ours.poll(600), "the publishing client did not finish"
            assert ours.recv() == (0, pairs)
            wait_for(lambda: all(len(s.images) == 1 for s in subscriptions), timeout=60)
        finally:
            ours.send("done")
            # Its client closes 10,000 publications and unmaps their logs: minutes on a
            # loaded host, as long as the adds themselves may take.
            publisher.join(600)
        assert publisher.exitcode == 0


def test_a_network_episode_scan_a_cycle_skipped_is_owed_and_the_conductor_wakes_for_it(
        shm: Path) -> None:
    """Enough UDP publications that their episode words are spaced (over UNSPACED_WORDS): a
    sample within the spacing after a scan skips it, and a publication whose log moved
    meanwhile is found by the sample at the owed time, which the conductor's deadline asks
    for; then nothing is owed and the deadline is the idle one again."""
    driver = MediaDriver.embedded(shm / "driver", **NETWORK_SETTINGS)
    try:
        network = driver.conductor.network
        assert network is not None
        uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length=64k"
        with Client.connect(driver.directory, invoker=driver.do_work) as client:
            subscription = client.add_subscription(uri, 1000)
            publications = [client.add_publication(uri, 1000 + i) for i in range(80)]
            wait_for(lambda: (driver.do_work(), publications[0].is_connected)[1],
                     what="the first stream connected")
            side = network._send_side
            watch = side._episode_watch
            assert len(watch) > UNSPACED_WORDS
            for _ in range(3):
                driver.do_work()
            conductor = driver.conductor
            now = conductor._last_cycle_ns
            side.sample_episodes(now)
            watch.look(now, scan=True)  # a scan at `now`: the next is due a spacing later
            side._backlog_due.clear()
            idle_deadline = conductor.next_deadline_ns()
            spacing = len(watch) * SPACING_NS_PER_WORD
            assert idle_deadline > now + spacing
            assert publications[0].offer(b"x" * 32) > 0  # its log's tail moves
            side.sample_episodes(now + 1)
            assert not side._backlog_due  # no scan: not found yet
            assert network.owed_episode_scan_ns == now + spacing
            assert conductor.next_deadline_ns() == now + spacing
            side.sample_episodes(now + spacing)
            assert [entry.publication.stream_id for entry in side._backlog_due] == [1000]
            assert network.owed_episode_scan_ns is None
            assert conductor.next_deadline_ns() == idle_deadline
            subscription.close()
    finally:
        driver.close()


def test_removing_one_of_many_udp_endpoints_leaves_the_others_found(shm: Path) -> None:
    """Each UDP pair on an endpoint of its own; the middle pair removed: its send and receive
    endpoints close (the agents' events find them among the others), the other pairs still
    carry messages, and a pair added again on the removed port connects anew."""
    driver = MediaDriver.embedded(shm / "driver", **NETWORK_SETTINGS)
    try:
        network = driver.conductor.network
        assert network is not None
        uris = [f"aeron:udp?endpoint=127.0.0.1:{free_port()}" for _ in range(5)]
        with Client.connect(driver.directory, invoker=driver.do_work) as client:

            def add(i: int):
                return (client.add_subscription(uris[i], 1000 + i),
                        client.add_publication(uris[i], 1000 + i))

            def connected(pair) -> bool:
                subscription, publication = pair
                return bool(publication.is_connected and subscription.images)

            def carries(pair, text: bytes) -> bool:
                subscription, publication = pair
                wait_for(lambda: (driver.do_work(), publication.offer(text) > 0)[1],
                         what="the offer taken")
                seen: list[bytes] = []
                wait_for(lambda: (driver.do_work(), subscription.poll(
                    lambda data, _h: seen.append(bytes(data)), 10))[1], what="the message")
                return seen == [text]

            pairs = [add(i) for i in range(len(uris))]
            wait_for(lambda: (driver.do_work(), all(connected(p) for p in pairs))[1],
                     what="every pair connected")
            endpoints = (len(network._send_side._send_endpoints),
                         len(network._receive_side._receive_endpoints))
            assert endpoints == (5, 5)
            for part in pairs[2]:
                part.close()
            wait_for(lambda: (driver.do_work(),
                              (len(network._send_side._send_endpoints),
                               len(network._receive_side._receive_endpoints)) == (4, 4))[1],
                     what="the removed pair's endpoints closed")
            assert all(carries(pairs[i], b"still here %d" % i) for i in (0, 1, 3, 4))
            pairs[2] = add(2)
            wait_for(lambda: (driver.do_work(), connected(pairs[2]))[1],
                     what="the pair added again connected")
            assert carries(pairs[2], b"back")
    finally:
        driver.close()
