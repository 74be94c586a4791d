"""The client's own rules on IPC streams: log density, the conductor's cycle time, loops
that park when idle, arguments refused by name, images and logs around a closing
subscription, session ids, handlers that close their client, forked children."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import (
    IPC_CHANNEL,
    hold_populate_steps,
    offer_until,
    voluntary_switches,
    wait_for,
)

from slipstream.client import (
    BACK_PRESSURED,
    NOT_CONNECTED,
    BufferClaim,
    Client,
    ClosedError,
    InvalidArgumentError,
    MessageTooLongError,
    RegistrationError,
    UsageError,
)
from slipstream.client.client import RESOURCE_LINGER_S
from slipstream.client.counters import (
    SystemCounter,
    read_system_counters,
)
from slipstream.client.idle import IDLE_PARK_NS
from slipstream.client.image import Image
from slipstream.client.layout import INT32_MAX, INT32_MIN
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon.driver import MediaDriver


def test_image_is_still_importable_from_the_subscription_module() -> None:
    """Image lives in slipstream.client.image; applications import it from
    slipstream.client.subscription too, as the same class."""
    from slipstream.client import subscription

    assert subscription.Image is Image


def test_logs_are_dense_unless_the_uri_asks_for_sparse(client: Client) -> None:
    dense = client.add_publication("aeron:ipc?term-length=64k", 1030)
    sparse = client.add_publication("aeron:ipc?term-length=64k|sparse=true", 1031)
    assert not dense._log.is_sparse
    assert sparse._log.is_sparse


def test_the_time_a_command_takes_counts_in_the_conductors_max_cycle_time(
        driver: MediaDriver, client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    # Creating a 192 MiB log (64 MiB terms) is the conductor's longest work; it is done in a
    # command, outside the duty cycle, and must show in the counter operators read (the driver
    # records it before it answers).  The driver's share of the add is the request's round
    # trip; the client then maps and populates the log itself (3x as long on AMD EPYC).
    request = client._conductor._request
    waited: list[float] = []

    def timed_request(*args, **kwargs):
        started = time.monotonic()
        try:
            return request(*args, **kwargs)
        finally:
            waited.append(time.monotonic() - started)

    monkeypatch.setattr(client._conductor, "_request", timed_request)
    publication = client.add_publication(IPC_CHANNEL + "?term-length=64m", 1018)
    longest = read_system_counters(driver.directory)[SystemCounter.CONDUCTOR_MAX_CYCLE_TIME_NS]
    publication.close()
    assert longest >= waited[0] * 1e9 / 2, (longest, waited)


def test_an_image_is_read_before_its_clients_thread_maps_its_pages_in_place(
        driver: MediaDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A subscriber's client hands an image to its subscription as it comes, and maps the
    log's pages in place after, on its conductor thread, a step at a time: held at its
    first step, the subscriber reads the stream's first message already; let go, all of the
    log is mapped."""
    stepping, go_on = hold_populate_steps(monkeypatch)
    channel = IPC_CHANNEL + "?term-length=1m"
    with Client.connect(driver.directory) as subscriber, \
            Client.connect(driver.directory) as publisher:
        try:  # let go before the clients close: a held step holds the subscriber's thread
            subscription = subscriber.add_subscription(channel, 1040)
            publication = publisher.add_publication(channel, 1040)
            assert stepping.wait(30)  # the subscriber's conductor thread, at its first step
            (image,) = subscription.images
            log = image._log
            assert log.unpopulated == log.length
            offer_until(publication, b"first")
            got: list[bytes] = []
            wait_for(lambda: subscription.poll(lambda data, _: got.append(bytes(data)), 1),
                     what="the first message")
            assert got == [b"first"] and log.unpopulated == log.length
            go_on.set()
            wait_for(lambda: log.unpopulated == 0, what="the image's pages mapped")
        finally:
            go_on.set()


@pytest.mark.parametrize("spins", [16, None])
def test_a_loop_that_retries_at_once_parks_after_the_clients_spins(
        driver: MediaDriver, spins: int | None) -> None:
    """Past ``spins_before_yield`` calls of a thread in a row that did nothing, an offer
    without credit and a poll without data wait for work parked (IDLE_PARK_NS at most each):
    the loop's thread takes almost no CPU while it waits.  The count is the thread's: a spell
    goes on from one publication or subscription to the next, and a call that did something
    starts it again.  None never waits."""
    misses = 200
    with Client.connect(driver.directory, spins_before_yield=spins) as client:
        publication = client.add_publication(IPC_CHANNEL, 1019)  # nobody subscribes: no credit
        subscription = client.add_subscription(IPC_CHANNEL, 1020)  # nobody publishes: nothing
        message = bytes(32)
        loops = {
            "offer": (lambda: publication.offer(message),
                      lambda: publication.offer.__self__.yields),
            "offer_batch": (lambda: publication.offer_batch(message, [32]),
                            lambda: publication._batch_idle.waits),
            "poll": (lambda: subscription.poll(lambda d, h: None, 10),
                     lambda: subscription._idle.waits),
            "poll_batch": (lambda: subscription.poll_batch(), lambda: subscription._idle.waits),
        }
        spent = {}

        def miss_each() -> None:
            for name, (call, waits) in loops.items():
                wall, slept, waited = time.monotonic(), voluntary_switches(), waits()
                for _ in range(misses):
                    assert call() in (NOT_CONNECTED, 0, None), name
                spent[name] = (time.monotonic() - wall, voluntary_switches() - slept,
                               waits() - waited)

        # On a thread of its own: the count of calls that did nothing is the thread's, and
        # this one's would go on from what an earlier test's calls left it.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(miss_each).result()
        # Credit starts the count again: the next misses spin first.
        peer = client.add_subscription(IPC_CHANNEL, 1019)
        wait_for(lambda: publication.is_connected, timeout=5, what="connected")
        assert publication.offer(message) > 0
        waited = publication.offer.__self__.yields
        while publication.offer(message) > 0:  # the window fills: back-pressured from here
            pass
        for _ in range(15):
            publication.offer(message)
        after_credit = publication.offer.__self__.yields - waited
        peer.close()
    assert after_credit == 0
    if spins is None:
        for name, (_, slept, waits) in spent.items():
            assert waits == 0, name  # no park
            # Nor a sleep of another kind at each call (a wait for the GIL is a rare one).
            assert slept < misses / 2, (name, slept)
        return
    for name, (wall, slept, waits) in spent.items():
        # The offers begin the spell; the other loops go on with it, waiting at every call.
        assert waits == misses - (spins if name == "offer" else 0), name
        assert wall >= waits * IDLE_PARK_NS / 1e9 * 0.9, (name, wall)
        # Each wait is a sleep, not a spin or a yield for its IDLE_PARK_NS (neither of which
        # is a voluntary switch), however loaded the machine; but a park on an eventcount the
        # driver bumped just before returns at once, without sleeping (183 of 184 beside a
        # CPU hog): nearly all, where spinning or yielding would give none.
        assert slept >= 0.9 * waits, (name, slept, waits)


def test_a_loop_serving_two_streams_waits_only_when_neither_has_work(
        driver: MediaDriver) -> None:
    """One thread polls an idle subscription and a busy one in turns: the busy one's
    messages start the thread's count again at each turn, so the idle one's polls never
    wait; once both are idle, the thread's polls wait."""
    with Client.connect(driver.directory) as client:
        idle = client.add_subscription(IPC_CHANNEL, 1022)
        busy = client.add_subscription(IPC_CHANNEL, 1023)
        publication = client.add_publication(IPC_CHANNEL, 1023)
        wait_for(lambda: busy.images and publication.is_connected, what="connected")
        sent = 0
        while publication.offer(bytes(32)) > 0:  # what the window holds
            sent += 1
        assert sent > 4 * client.spins_before_yield
        received = [0]

        def count(data: memoryview, header: object) -> None:
            received[0] += 1

        while received[0] < sent:
            assert idle.poll(count, 10) == 0
            assert busy.poll(count, 1) == 1
        assert idle._idle.waits == 0 and busy._idle.waits == 0
        for _ in range(2 * client.spins_before_yield):
            idle.poll(count, 10)
            busy.poll(count, 1)
        assert idle._idle.waits > 0 and busy._idle.waits > 0


def test_a_parked_loop_wakes_when_its_credit_or_data_comes(
        driver: MediaDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll parked for data wakes when a message is committed, and an offer parked for
    credit when the subscriber moves on: the log's eventcount wakes them, not the end of the
    park (made 30 s long here)."""
    from slipstream.client import idle
    from slipstream.client import publication as publication_module

    park_ns = 30_000_000_000
    monkeypatch.setattr(idle, "IDLE_PARK_NS", park_ns)
    monkeypatch.setattr(publication_module, "IDLE_PARK_NS", park_ns)
    with Client.connect(driver.directory) as client:
        publication = client.add_publication(IPC_CHANNEL, 1021)
        subscription = client.add_subscription(IPC_CHANNEL, 1021)
        wait_for(lambda: publication.is_connected and subscription.images, what="connected")
        got: list[bytes] = []

        def poll_loop() -> None:
            while not got:
                subscription.poll(lambda data, header: got.append(bytes(data)), 10)

        poller = threading.Thread(target=poll_loop)
        poller.start()
        wait_for(lambda: subscription._idle.waits > 0, what="the poll loop parked")
        time.sleep(0.1)
        woken = time.monotonic()
        assert publication.offer(b"wake") > 0
        # Woken by the message, not at the park's end: a sixth of it is a loaded machine's.
        poller.join(timeout=park_ns / 1e9 / 6)
        assert got == [b"wake"] and time.monotonic() - woken < park_ns / 1e9 / 6

        message = bytes(1024)
        for _ in range(10):  # the window fills; the conductor moves the limit every ms
            while publication.offer(message) != BACK_PRESSURED:  # (term rotations too)
                pass
            time.sleep(0.02)
        offered: list[int] = []

        def offer_loop() -> None:
            while not offered:
                result = publication.offer(message)
                if result > 0:
                    offered.append(result)

        offerer = threading.Thread(target=offer_loop)
        offerer.start()
        wait_for(lambda: publication.offer.__self__.yields > 0, what="the offer loop parked")
        time.sleep(0.1)
        woken = time.monotonic()
        drained = 0
        while not offered and time.monotonic() - woken < park_ns / 1e9 / 6:
            drained += subscription.poll(lambda data, header: None, 1000)
        offerer.join(timeout=5)
        assert offered and drained > 0 and time.monotonic() - woken < park_ns / 1e9 / 6


def test_a_bad_spins_before_yield_names_itself(driver: MediaDriver) -> None:
    for bad in (-1, 1.5, 2**31):
        with pytest.raises(ValueError, match="spins_before_yield"):
            Client.connect(driver.directory, spins_before_yield=bad)


def test_bad_arguments_are_refused_by_name_before_anything_is_sent(
        driver: MediaDriver, client: Client) -> None:
    """Each raises InvalidArgumentError (or MessageTooLongError) naming the argument, at the
    call, not a TypeError or OverflowError from deep inside, nor a DriverTimeoutError that
    blames the driver, nor a byte buffer read as raw int32 lengths."""
    for bad in (0, -1, float("nan"), float("inf"), 1e300, "5", None):
        with pytest.raises(InvalidArgumentError, match=r"^timeout: "):
            Client.connect(driver.directory, timeout=bad)
    for bad in ("x", 1.5, -1, 10**30):
        with pytest.raises(InvalidArgumentError, match=r"^idle_spin_ns: "):
            Client.connect(driver.directory, idle_spin_ns=bad)
    with pytest.raises(InvalidArgumentError, match=r"^on_available_image: 3 is not callable"):
        client.add_subscription(IPC_CHANNEL, 29, on_available_image=3)
    with pytest.raises(InvalidArgumentError, match=r"^on_back_pressure: "):
        client.add_publication(IPC_CHANNEL, 29, on_back_pressure=5)
    publication = client.add_publication(IPC_CHANNEL, 29)
    subscription = client.add_subscription(IPC_CHANNEL, 29)
    for bad in (-1, float("nan"), "1"):
        with pytest.raises(InvalidArgumentError, match=r"^timeout: "):
            subscription.receive(lambda data, header: None, 10, timeout=bad)
    # inf is no limit, as None: it waits for the message that comes 0.2 s later (it raised
    # OverflowError once it came to wait)
    later = threading.Timer(0.2, offer_until, (publication, b"x"))
    later.start()
    try:
        assert subscription.receive(lambda data, header: None, 10, timeout=float("inf")) == 1
    finally:
        later.join()
    for lengths in (b"\x03\x00\x00\x00\x05\x00\x00\x00", bytearray([1, 1, 1, 1]), [2**31]):
        with pytest.raises(InvalidArgumentError, match=r"^lengths: "):
            publication.offer_batch(b"abcdefgh", lengths)
    claim = BufferClaim()
    with pytest.raises(MessageTooLongError):
        publication.try_claim(2**31, claim)
    with pytest.raises(InvalidArgumentError, match=r"^length: "):
        publication.try_claim("8", claim)
    publication.close()
    subscription.close()


def test_an_image_that_arrives_as_its_subscription_closes_is_unmapped_not_kept(
        client: Client) -> None:
    """The client's conductor saw the subscription open and mapped a new image's log; the
    application closed the subscription before the image was added: the closed subscription
    gets no image, and the log is unmapped (the linger of the others may be over)."""
    subscription = client.add_subscription("aeron:ipc", 28)
    publication = client.add_publication("aeron:ipc", 28)
    wait_for(lambda: subscription.images, what="the image")
    [image] = subscription.images
    late = Image(LogBuffer(image.log_path), client.counters.address(0), join_position=0,
                 correlation_id=image.correlation_id + 1, subscription=subscription)
    subscription.close()
    subscription._add_image(late)  # as the conductor thread would, a moment too late
    assert subscription.images == ()
    assert late._log.closed and late.is_closed
    publication.close()


def test_a_closed_subscriptions_image_logs_stay_mapped_for_the_resource_linger(
        client: Client) -> None:
    """close() may come from any thread (an image handler too) while a poll of the
    subscription runs in C on the polling thread: its images' logs are unmapped after the
    client's resource linger, as a closed publication's log, not at once under that poll."""
    from slipstream.client.client import RESOURCE_LINGER_S

    subscription = client.add_subscription("aeron:ipc", 27)
    publication = client.add_publication("aeron:ipc", 27)
    wait_for(lambda: subscription.images, what="the image")
    [image] = subscription.images
    subscription.close()
    assert not image._log.closed
    time.sleep(RESOURCE_LINGER_S + 0.5)
    assert image._log.closed  # not left to a poll that may never come
    publication.close()


def test_when_the_reserved_range_leaves_few_session_ids_the_last_free_ones_are_used_then_refused(
        driver_dir: Path) -> None:
    """Two ids outside the reserved range: two publications take them, a third is refused by
    name (the conductor used to draw at random for ever), and one freed is taken again."""
    with MediaDriver.launch(directory=driver_dir, ipc_term_buffer_length="64k",
                            publication_reserved_session_id_low=INT32_MIN,
                            publication_reserved_session_id_high=INT32_MAX - 2) as driver, \
            Client.connect(driver_dir) as client:
        first = client.add_publication("aeron:ipc", 1)
        second = client.add_publication("aeron:ipc", 2)
        assert {first.session_id, second.session_id} == {INT32_MAX - 1, INT32_MAX}
        with pytest.raises(RegistrationError, match="no session id is free"):
            client.add_publication("aeron:ipc", 3)
        freed = first.session_id
        first.close()
        # Freed once the driver has let the closed publication go (a cycle or so later).
        deadline = time.monotonic() + 10
        while True:
            try:
                third = client.add_publication("aeron:ipc", 3)
                break
            except RegistrationError:
                assert time.monotonic() < deadline, "the freed session id was never taken"
                time.sleep(0.05)
        assert third.session_id == freed
        third.close()
        second.close()
        assert driver.stop() == 0


def test_an_image_kept_after_its_subscription_closed_reads_nothing_and_never_crashes(
        client: Client) -> None:
    """A user may hold an Image past the client's resource linger, when its log is unmapped:
    poll and poll_batch find nothing and is_end_of_stream answers as it was (they used to
    read the unmapped log and kill the process with SIGSEGV); peek and available_position
    raise ClosedError."""
    publication = client.add_publication(IPC_CHANNEL, 1018)
    subscription = client.add_subscription(IPC_CHANNEL, 1018)
    wait_for(lambda: publication.is_connected and subscription.images, what="the image")
    offer_until(publication, b"one")
    image = subscription.images[0]
    subscription.close()
    wait_for(lambda: image.is_closed, timeout=RESOURCE_LINGER_S + 5, what="the image unmapped")
    assert image.poll(lambda data, header: None, 10) == 0
    assert image.poll_batch(10) is None
    assert image.is_end_of_stream is False
    with pytest.raises(ClosedError, match="the image is gone"):
        image.available_position()
    with pytest.raises(ClosedError, match="the image is gone"):
        image.peek(0, lambda data, header: None, 64)
    publication.close()


_CLOSE_IN_HANDLER = """
import sys, time
import slipstream.client.conductor as conductor_module
from slipstream.client import Client
conductor_module.RESOURCE_LINGER_S = 0.1  # the counters are unmapped while the handler sleeps
directory, size = sys.argv[1], int(sys.argv[2])
client = Client.connect(directory)
publication = client.add_publication("aeron:ipc", 61)
subscription = client.add_subscription("aeron:ipc", 61)
while not (publication.is_connected and subscription.is_connected):
    time.sleep(0.01)
for _ in range(3):
    while publication.offer(b"m" * size) < 0:
        pass
def handler(data, header):
    client.close()
    time.sleep(1.0)  # ten lingers: the unmap has surely run
print(subscription.poll(handler, 10), flush=True)
print(subscription.poll(handler, 10), flush=True)
"""


@pytest.mark.parametrize("size", [100, 3000], ids=["whole", "fragmented"])
def test_a_handler_that_closes_its_client_and_runs_past_the_linger_ends_its_poll_cleanly(
        driver, size: int) -> None:
    """A handler may close the client (or another thread may) while a poll runs: the poll
    ends cleanly (the messages its scan took are still handed over, from the log their views
    keep mapped; a fragmented message's assembly stops), stores nothing into the counters the
    linger unmapped meanwhile (it crashed with SIGSEGV; a fragmented message raised
    IndexError), and the next poll finds nothing."""
    result = subprocess.run([sys.executable, "-c", _CLOSE_IN_HANDLER, str(driver.directory),
                             str(size)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = ["3", "0"] if size == 100 else ["1", "0"]
    assert result.stdout.split() == expected, (result.stdout, result.stderr[-2000:])


def test_a_claim_into_no_buffer_claim_or_an_open_one_is_refused_before_claiming(
        client: Client) -> None:
    """``try_claim(n, None)`` and a second claim into a BufferClaim still open used to claim
    the frame first and then lose it: every reader of the stream waited for the driver to
    give it up (15 s).  Both are refused before anything is claimed."""
    publication = client.add_publication("aeron:ipc", 62)
    subscription = client.add_subscription("aeron:ipc", 62)
    wait_for(lambda: publication.is_connected, what="connected")
    with pytest.raises(InvalidArgumentError, match="claim"):
        publication.try_claim(10, None)  # type: ignore[arg-type]
    claim = BufferClaim()
    assert publication.try_claim(5, claim) > 0
    with pytest.raises(UsageError, match="not yet committed"):
        publication.try_claim(5, claim)
    claim.buffer[:] = b"first"
    assert claim.commit()
    with pytest.raises(UsageError):
        claim.commit()
    assert publication.offer(b"second") > 0
    got: list[bytes] = []
    wait_for(lambda: subscription.poll(lambda data, _h: got.append(bytes(data)), 10) >= 0
             and len(got) == 2, timeout=5, what="both messages, well within the 15 s stall")
    assert got == [b"first", b"second"]


def test_a_forked_child_may_not_use_its_parents_client_and_its_close_does_nothing(
        client: Client) -> None:
    """The child shares the parent's socket to the driver and its locks (one the conductor
    thread held at the fork stays held): a request hung past its timeout, and close() with
    it.  Now a request raises UsageError at once, close() of the client or of one of its
    publications leaves the parent's alone, and the parent goes on."""
    publication = client.add_publication("aeron:ipc", 63)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report, then leave without the parent's atexit hooks
        outcome = b"?"
        try:
            try:
                client.add_subscription("aeron:ipc", 63)
                outcome = b"no error"
            except UsageError:
                outcome = b"UsageError"
            publication.close()  # the parent's: nothing to tell the driver from here
            client.close()
        finally:
            os.write(write_end, outcome)
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 10
    while (status := os.waitpid(child, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the child hung on its parent's client")
        time.sleep(0.01)
    status = status[1]
    with os.fdopen(read_end, "rb") as reader:
        assert reader.read() == b"UsageError" and status == 0
    subscription = client.add_subscription("aeron:ipc", 63)  # the parent's client still works
    wait_for(lambda: publication.is_connected and subscription.is_connected, what="connected")


def test_a_handler_that_keeps_its_arguments_keeps_each_messages_own(client: Client) -> None:
    """The C dispatch passes (data, header) in one tuple that it reuses for the next message;
    a handler that keeps that very tuple (an exception type stores it as ``args``) makes it
    take a new one, so every kept pair holds its own message, and the header is the image's
    one flyweight."""
    kept: list[Kept] = []

    class Kept(Exception):
        def __init__(self, *args: object) -> None:
            kept.append(self)

    publication = client.add_publication(IPC_CHANNEL, 1040)
    subscription = client.add_subscription(IPC_CHANNEL, 1040)
    wait_for(lambda: publication.is_connected and subscription.images, what="connected")
    messages = [f"message {i}".encode() for i in range(25)]
    for message in messages:
        offer_until(publication, message)
    read = 0
    while read < len(messages):
        read += subscription.poll(Kept, 10)
    assert [bytes(k.args[0]) for k in kept] == messages
    assert len({id(k.args) for k in kept}) == len(messages)
    assert {id(k.args[1]) for k in kept} == {id(kept[0].args[1])}


def test_a_subscription_finds_its_image_by_session_id(client: Client) -> None:
    """Two exclusive publications of one stream are two sessions: each image is found by its
    session id, and a session that has no image finds none."""
    subscription = client.add_subscription(IPC_CHANNEL, 71)
    first = client.add_exclusive_publication(IPC_CHANNEL, 71)
    second = client.add_exclusive_publication(IPC_CHANNEL, 71)
    wait_for(lambda: len(subscription.images) == 2, what="both images")
    for publication in (first, second):
        image = subscription.image_by_session_id(publication.session_id)
        assert image is not None and image.session_id == publication.session_id
    unknown = next(s for s in range(1, 4) if s not in (first.session_id, second.session_id))
    assert subscription.image_by_session_id(unknown) is None
