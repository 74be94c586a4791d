"""SETUPs from a host that is no sender, at a real driver process over loopback (issue 59, the
SETUP flood): crafted frames from plain UDP sockets (a source address each, 127.0.0.x) at the
port of a real subscription.

* a term longer than the subscription allows makes no image: counted by cause, logged once
  per source per interval however many come; ``max-term-length=`` lowers or raises it;
* one source host's images, and their log memory, are bounded; another host still gets its
  image; past the logs being made at once, a SETUP is refused;
* a log of 3 x 128 MiB is made off the conductor's thread: its cycle, the heartbeat clients
  read and their commands go on meanwhile; a log whose subscription went while it was made
  is freed, and so are those of a driver that stops while they are being made.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import counters_of, free_port, wait_for

from slipstream.client import ChannelError, ChannelRejectedError, ChannelWarning, Client, control
from slipstream.client.channel import parse_channel
from slipstream.client.counters import CountersFile, capacities, parse_position_label
from slipstream.client.frames import ErrorFrame, Setup, StatusMessage, decode, heartbeat
from slipstream.client.layout import (
    ERR_CODE_RESOURCE_TEMPORARILY_UNAVAILABLE,
    ERR_CODE_STORAGE_SPACE,
    META_DEFAULT_FRAME_HEADER,
    PARTITION_COUNT,
    SESSION_ID_FIELD,
    SM_SEND_SETUP_FLAG,
    TERM_MIN_LENGTH,
)
from slipstream.client.logbuffer import compute_log_length, term_length_of_file
from slipstream.client.publication import ExclusivePublication
from slipstream.client.subscription import Subscription
from slipstream.daemon.conductor.network_receive import HEARD_CHECK_INTERVAL_NS
from slipstream.daemon.conductor.network_send import REFUSAL_NOTICE_INTERVAL_NS
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.reports.error_log import read_error_log
from slipstream.daemon.streams.refusals import REJECTIONS_PER_PASS_MAX
from slipstream.daemon.streams.setups import SETUP_REFUSAL_WINDOW_NS, SETUP_REFUSED_INTERVAL_NS

KIB = 1024
MIB = 1024 * KIB
STREAM = 59
#: Images stay while the test counts them (the SETUPs' sources send no data).
SLOW_LIVENESS = {"image_liveness_timeout": "20s"}


def setup_frame(session_id: int, term_length: int, stream_id: int = STREAM) -> bytes:
    """A valid SETUP of a new session at the start of its first term."""
    return Setup(term_offset=0, session_id=session_id, stream_id=stream_id, initial_term_id=7,
                 active_term_id=7, term_length=term_length, mtu=1408).encode()


def send_setups(port: int, sessions: range, term_length: int, *,
                source: str = "127.0.0.1", gap_s: float = 0.0) -> None:
    """One SETUP per session in ``sessions``, from ``source`` to 127.0.0.1:``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((source, 0))
        for session_id in sessions:
            s.sendto(setup_frame(session_id, term_length), ("127.0.0.1", port))
            if gap_s:
                time.sleep(gap_s)


def image_logs(driver: MediaDriver) -> list[Path]:
    return sorted((driver.directory / control.IMAGES_DIR).glob("*.logbuffer"))


def refusals_logged(driver: MediaDriver, words: str) -> list[str]:
    return [e.message for e in read_error_log(driver.directory) if words in e.message]


@contextlib.contextmanager
def subscribed(driver: MediaDriver, params: str = "") -> Iterator[tuple[Subscription, int]]:
    """A subscription of ``driver`` to STREAM at a free port of 127.0.0.1 (``params``: the
    URI's after its endpoint) for the block: (the subscription, its port)."""
    port = free_port()
    with Client.connect(driver.directory) as client:
        yield client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}{params}", STREAM), port


def test_a_term_longer_than_the_subscription_allows_makes_no_image_and_is_logged_once(
        launch) -> None:
    """The default allows 16 MiB: 200 SETUPs of 128 MiB terms from one source make no log,
    count 200 refusals by cause, get an ERR frame back each (each refused stream's sender
    hears why: its session, the setting) and leave one line in the error log (its next,
    after the interval, says how many were held back)."""
    driver = launch(**SLOW_LIVENESS)
    port = free_port()
    with Client.connect(driver.directory) as client, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", STREAM)
        sender.bind(("127.0.0.1", 0))
        for session_id in range(1, 201):
            sender.sendto(setup_frame(session_id, 128 * MIB), ("127.0.0.1", port))
        wait_for(lambda: counters_of(driver)["IMAGE_TERM_LENGTH_REFUSED"] == 200, timeout=10,
                 what="200 refusals counted")
        sender.settimeout(0.5)
        answers = []
        with contextlib.suppress(TimeoutError):
            while True:
                answers.append(sender.recv(2048))
        errors = [decode(a) for a in answers]
        assert sorted(e.session_id for e in errors) == list(range(1, 201))
        assert all("image_term_buffer_length_max" in e.message for e in errors)
        assert image_logs(driver) == []
        counters = counters_of(driver)
        assert counters["IMAGES_REJECTED"] == 0  # counted by its cause alone
        wait_for(lambda: refusals_logged(driver, "refused the image"), what="the refusal logged")
        time.sleep(0.5)  # nothing more comes
        lines = refusals_logged(driver, "refused the image")
        assert len(lines) == 1, lines
        assert "term length 134217728 is over this receiver's image_term_buffer_length_max" \
            in lines[0]


def test_max_term_length_on_a_subscription_lowers_and_raises_the_bound(launch) -> None:
    driver = launch(**SLOW_LIVENESS)
    low, high = free_port(), free_port()
    with Client.connect(driver.directory) as client:
        client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{low}|max-term-length=64k",
                                STREAM)
        client.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{high}|max-term-length=32m|sparse=true", STREAM)
        send_setups(low, range(1, 3), 128 * KIB)  # over 64k: refused
        wait_for(lambda: counters_of(driver)["IMAGE_TERM_LENGTH_REFUSED"] == 2,
                 what="two refusals")
        send_setups(high, range(3, 4), 32 * MIB)  # over the driver's 16m, within the URI's
        wait_for(lambda: len(image_logs(driver)) == 1, what="the 32 MiB-term image's log")
        assert image_logs(driver)[0].stat().st_size == compute_log_length(32 * MIB)
        assert counters_of(driver)["IMAGE_TERM_LENGTH_REFUSED"] == 2
        wait_for(lambda: refusals_logged(driver, "max-term-length of 65536"),
                 what="the refusal naming the subscription's key")


def test_one_source_host_has_at_most_image_source_max_images(launch) -> None:
    """12 sessions from 127.0.0.1 (several ports) with a bound of 5: 5 images, 7 refused by
    cause; another host (127.0.0.2) still gets its image."""
    driver = launch(image_source_max_images=5, **SLOW_LIVENESS)
    with subscribed(driver) as (subscription, port):
        for first in (1, 5, 9):  # from three source ports of one host
            send_setups(port, range(first, first + 4), 64 * KIB, gap_s=0.01)
        wait_for(lambda: counters_of(driver)["IMAGE_SOURCE_IMAGES_REFUSED"] >= 7,
                 what="7 refusals")
        wait_for(lambda: len(subscription.images) == 5, what="5 images")
        assert len(image_logs(driver)) == 5
        send_setups(port, range(100, 101), 64 * KIB, source="127.0.0.2")
        wait_for(lambda: len(subscription.images) == 6, what="the other host's image")
        assert counters_of(driver)["IMAGE_SOURCE_IMAGES_REFUSED"] == 7
        lines = refusals_logged(driver, "image_source_max_images")
        assert lines == [], "a bound's refusal is a warning, not an error"


def test_images_data_came_to_leave_image_source_max_images_to_those_it_did_not(
        launch) -> None:
    """A bound of 5: SETUPs of 6 sessions from one host make 5 images, the 6th refused.  Once
    a heartbeat of each of the 5 came from that host (a sender, not SETUPs alone), 6 more
    sessions' SETUPs make 5 images again, the 6th refused: the bound counts the images no
    data came to, and holds for those.  (A source at the bound has its images looked at
    again at most every HEARD_CHECK_INTERVAL_NS.)"""
    driver = launch(image_source_max_images=5, **SLOW_LIVENESS)
    port = free_port()
    with Client.connect(driver.directory) as client, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        subscription = client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", STREAM)
        sender.bind(("127.0.0.1", 0))
        refused = lambda: counters_of(driver)["IMAGE_SOURCE_IMAGES_REFUSED"]  # noqa: E731
        for rounds, first in enumerate((1, 11), 1):
            for session_id in range(first, first + 6):
                sender.sendto(setup_frame(session_id, 64 * KIB), ("127.0.0.1", port))
                time.sleep(0.01)
            made = 5 * rounds
            wait_for(lambda n=made: len(subscription.images) == n, what="5 more images")
            wait_for(lambda n=rounds: refused() == n, what="the 6th refused")
            for image in subscription.images:
                if image.session_id >= first:
                    sender.sendto(heartbeat(image.session_id, STREAM, 7, 0),
                                  ("127.0.0.1", port))
            wait_for(lambda n=made: counters_of(driver)["HEARTBEATS_RECEIVED"] == n,
                     what="a heartbeat to each image")
            time.sleep(HEARD_CHECK_INTERVAL_NS / 1e9)  # the refusal looked; the next may
        assert sorted(image.session_id for image in subscription.images) == [
            *range(1, 6), *range(11, 16)]
        assert refused() == 2


def test_one_source_hosts_images_take_at_most_image_source_memory_limit(launch) -> None:
    log_length = compute_log_length(64 * KIB)
    driver = launch(image_source_memory_limit=f"{3 * log_length + 1}", **SLOW_LIVENESS)
    with subscribed(driver) as (subscription, port):
        send_setups(port, range(1, 9), 64 * KIB, gap_s=0.01)
        wait_for(lambda: counters_of(driver)["IMAGE_SOURCE_MEMORY_REFUSED"] == 5,
                 what="5 refusals")
        wait_for(lambda: len(subscription.images) == 3, what="3 images")
        assert sum(p.stat().st_size for p in image_logs(driver)) == 3 * log_length


def test_setups_past_the_logs_being_made_at_once_are_refused(launch) -> None:
    """One log at a time (image_pending_max=1), each of 3 x 64 MiB allocated in full: a burst
    of SETUPs gets the first image made and the others refused by cause; their senders ask
    again (the session cools down for a second) and get theirs then."""
    driver = launch(image_pending_max=1, **SLOW_LIVENESS)
    with subscribed(driver, "|max-term-length=64m") as (subscription, port):
        send_setups(port, range(1, 4), 64 * MIB)
        wait_for(lambda: counters_of(driver)["IMAGE_PENDING_REFUSED"] >= 1, timeout=10,
                 what="a refusal while a log is made")
        wait_for(lambda: len(subscription.images) >= 1, timeout=10, what="the first image")
        # As their senders do, each refused session asks again past its cool-down (a
        # second) until its image is made: one log at a time, however long each takes.
        deadline = time.monotonic() + 30
        while len(subscription.images) < 3:
            assert time.monotonic() < deadline, "not all three images within 30 s"
            time.sleep(1.2)
            made = {image.session_id for image in subscription.images}
            for session_id in set(range(1, 4)) - made:
                send_setups(port, range(session_id, session_id + 1), 64 * MIB)


def test_one_source_host_takes_at_most_half_of_the_logs_being_made(launch) -> None:
    """image_pending_max=4: a burst of four 3 x 64 MiB logs from one host gets two queued and
    two refused; another host's SETUP right after still finds room."""
    driver = launch(image_pending_max=4, **SLOW_LIVENESS)
    with subscribed(driver, "|max-term-length=64m") as (subscription, port):
        send_setups(port, range(1, 5), 64 * MIB)
        send_setups(port, range(100, 101), 64 * MIB, source="127.0.0.2")
        wait_for(lambda: len(subscription.images) == 3, timeout=20, what="three images")
        assert counters_of(driver)["IMAGE_PENDING_REFUSED"] == 2
        assert 100 in {image.session_id for image in subscription.images}


def _logs_not_attached(driver: MediaDriver) -> set[str]:
    """The image log files of ``STREAM`` whose image the conductor has not attached (no
    ``rcv-hwm`` counter of their session): logs being made, or made and not yet taken back.
    A conductor that made a log itself attached its image in the same cycle."""
    counters = CountersFile(driver.directory / control.COUNTERS_FILE, writable=False)
    try:
        attached = {label.session_id for info in counters
                    if (label := parse_position_label(info.label)) is not None
                    and label.kind == "rcv-hwm" and label.stream_id == STREAM}
    finally:
        counters.close()
    pending = set()
    for path in image_logs(driver):
        try:
            with path.open("rb") as log_file:
                size = os.fstat(log_file.fileno()).st_size
                if size < compute_log_length(TERM_MIN_LENGTH):
                    pending.add(path.name)  # made, not sized yet: being made
                    continue
                # Its metadata is written first: the session, or zeros just before.
                term_length = term_length_of_file(size)
                log_file.seek(PARTITION_COUNT * term_length + META_DEFAULT_FRAME_HEADER
                              + SESSION_ID_FIELD)
                field = log_file.read(4)
        except FileNotFoundError:
            continue
        if len(field) < 4:  # still growing to its length: being made
            pending.add(path.name)
            continue
        [session_id] = struct.unpack("<i", field)
        if session_id not in attached:
            pending.add(path.name)
    return pending


def test_a_big_log_is_made_while_the_conductor_serves_clients(launch) -> None:
    """Three SETUPs of 128 MiB terms (the subscription allows them), logs allocated in full:
    3 x 384 MiB written and mapped, off the conductor's thread.  Meanwhile a client's
    commands are answered: some while a log was seen unattached before and after them,
    which a conductor that made the logs itself (attaching each in the cycle that made it)
    could not do, however fast or loaded the machine."""
    driver = launch(**SLOW_LIVENESS)
    port = free_port()
    # The commands come from a client of their own: the subscriber's client maps each
    # image's 384 MiB as it hears of it, before it reads the answers behind that.
    with Client.connect(driver.directory) as subscriber, \
            Client.connect(driver.directory) as client:
        subscription = subscriber.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{port}|max-term-length=128m", STREAM)
        before = counters_of(driver)["CONDUCTOR_MAX_CYCLE_TIME_NS"]
        started = time.monotonic()
        send_setups(port, range(1, 4), 128 * MIB)
        answers: list[float] = []
        answered_while_made = 0
        while not (len(subscription.images) == 3 and len(image_logs(driver)) == 3):
            making = _logs_not_attached(driver)
            asked = time.monotonic()
            client.add_publication("aeron:ipc?term-length=64k", 7).close()
            answers.append(time.monotonic() - asked)
            answered_while_made += bool(making & _logs_not_attached(driver))
            assert time.monotonic() - started < 60, "the images never came"
        made_s = time.monotonic() - started
        worst_cycle_ns = counters_of(driver)["CONDUCTOR_MAX_CYCLE_TIME_NS"]
        print(f"3 logs of 384 MiB made in {made_s:.2f} s; {len(answers)} commands answered "
              f"meanwhile ({answered_while_made} while a log was made), slowest "
              f"{max(answers) * 1e3:.1f} ms; conductor's longest cycle "
              f"{worst_cycle_ns / 1e6:.1f} ms (before: {before / 1e6:.1f} ms)")
        assert answered_while_made >= 1, "no command was answered while a log was made"


def test_a_log_whose_subscription_went_while_it_was_made_is_freed(launch) -> None:
    """The subscription closes while its image's 384 MiB log is made: the log is freed (no
    file, counted), and its memory is back in the budget, which holds one such log only: a
    new subscription's image of another session gets one."""
    driver = launch(log_buffer_memory_limit="400m", **SLOW_LIVENESS)
    port = free_port()
    uri = f"aeron:udp?endpoint=127.0.0.1:{port}|max-term-length=128m"
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(uri, STREAM)
        send_setups(port, range(1, 2), 128 * MIB)
        wait_for(lambda: image_logs(driver), what="its log begun")  # it takes ~0.3 s
        subscription.close()
        wait_for(lambda: counters_of(driver)["IMAGE_LOGS_ABANDONED"] == 1, timeout=20,
                 what="the log abandoned")
        wait_for(lambda: image_logs(driver) == [], what="its file deleted")
        subscription = client.add_subscription(uri, STREAM)

        def asked_until_made() -> bool:  # as a sender repeats its SETUP until connected
            send_setups(port, range(2, 3), 128 * MIB)
            return len(subscription.images) == 1 or time.sleep(0.1)

        wait_for(asked_until_made, timeout=20, what="the next image")


@pytest.mark.parametrize("count", [1, 6])
def test_a_driver_stopping_while_logs_are_made_leaves_none(tmp_path: Path, count: int) -> None:
    """The driver stops (SIGTERM) while one log of 384 MiB is being made and others wait:
    it stops, and leaves no log file behind."""
    from helpers import NETWORK_SETTINGS

    directory = Path("/dev/shm") / f"slipstream-flood-{tmp_path.name[-20:]}"
    port = free_port()
    with MediaDriver.launch(directory=directory, **{**NETWORK_SETTINGS, **SLOW_LIVENESS}) \
            as driver:
        with Client.connect(driver.directory) as client:
            client.add_subscription(
                f"aeron:udp?endpoint=127.0.0.1:{port}|max-term-length=128m", STREAM)
            send_setups(port, range(1, count + 1), 128 * MIB)
            wait_for(lambda: image_logs(driver), what="a log begun")
    assert not directory.exists() or not list(directory.rglob("*.logbuffer"))


def _conductor_with_a_subscription(shm: Path):  # -> (conductor, counters, channel, heartbeat)
    """In this process: a conductor whose image logs are made on its worker, one client and
    one subscription (allowing 64 MiB terms); its receive channel, to post SETUPs' image
    requests to as its receiver would (the agents do not run), and the client's heartbeat
    counter."""
    from slipstream.client.counters import CountersFile
    from slipstream.daemon.conductor.conductor import DriverConductor
    from slipstream.daemon.conductor.image_logs import LogMaking
    from slipstream.daemon.config import DriverSettings
    from slipstream.daemon.media.udp import UdpTransports

    settings = DriverSettings(dir=str(shm))
    for folder in (control.PUBLICATIONS_DIR, control.IMAGES_DIR):
        (shm / folder).mkdir()
    counters = CountersFile.create(shm / "counters.dat", 256)
    conductor = DriverConductor(settings, shm, counters,
                                transports=UdpTransports(settings, counters),
                                image_logs=LogMaking.THREADED)
    network = conductor.network
    assert network is not None
    now = time.monotonic_ns()
    ((_, connected),) = conductor.on_command(b"k", {
        "type": control.CONNECT, "version": control.PROTOCOL_VERSION, "pid": 1, "process": 1,
        "correlation_id": 1}, now)
    replies = conductor.on_command(b"k", {
        "type": control.ADD_SUBSCRIPTION, "stream_id": STREAM, "correlation_id": 2,
        "channel": f"aeron:udp?endpoint=127.0.0.1:{free_port()}|max-term-length=64m"}, now)
    assert replies[0][1]["type"] == control.SUBSCRIPTION_READY, replies
    (entry,) = network._receive_endpoints.values()
    return conductor, counters, entry.endpoint.channel, connected["heartbeat_counter_id"]


def _request(channel, session_id: int, term_length: int):  # -> ImageRequested
    from slipstream.daemon.media.events import ImageRequested

    setup = Setup(term_offset=0, session_id=session_id, stream_id=STREAM, initial_term_id=7,
                  active_term_id=7, term_length=term_length, mtu=1408)
    return ImageRequested(channel, setup, ("127.0.0.9", 4000))


def test_a_conductor_closing_with_logs_being_made_gives_their_memory_back(shm: Path) -> None:
    """Six SETUPs' logs of 3 x 64 MiB submitted to the worker, the conductor closed while the
    first is being made.  The budget held all six at once; after the close it holds none,
    and no log file is left (made, being made or never begun)."""
    from slipstream.client.counters import SystemCounter

    conductor, counters, channel, _ = _conductor_with_a_subscription(shm)
    network = conductor.network
    now = time.monotonic_ns()
    try:
        for session_id in range(1, 7):
            network._post(_request(channel, session_id, 64 * MIB))
        conductor.do_work(now)
        assert conductor.budget.used == 6 * compute_log_length(64 * MIB)
        # The sender asks again while its log is made (after the receiver's second): noted.
        network._post(_request(channel, 6, 64 * MIB))
        conductor.do_work(now + 1_100_000_000)
        assert conductor.budget.used == 6 * compute_log_length(64 * MIB)
        assert counters.get(SystemCounter.ERRORS) == 0
        wait_for(lambda: list((shm / control.IMAGES_DIR).iterdir()), what="a log begun")
    finally:
        conductor.close(time.monotonic_ns())
        counters.close()
    assert conductor.budget.used == 0
    assert list((shm / control.IMAGES_DIR).iterdir()) == []


def test_a_log_made_for_a_sender_that_stopped_asking_is_freed(shm: Path) -> None:
    """Its log (3 x 64 MiB: made in tens of ms, after the conductor's cycle that asked for
    it) is done after the sender's last SETUP is older than image_liveness_timeout: no
    image, the log freed and counted, the budget whole again."""
    from slipstream.client.counters import SystemCounter

    conductor, counters, channel, heartbeat = _conductor_with_a_subscription(shm)
    network = conductor.network
    now = time.monotonic_ns()
    try:
        network._post(_request(channel, 1, 64 * MIB))
        conductor.do_work(now)
        wait_for(lambda: network.has_events, what="the log made")
        late = now + conductor.settings.image_liveness_timeout + 1
        counters.set(heartbeat, late)  # the client is alive
        conductor.do_work(late)
        assert counters.get(SystemCounter.IMAGE_LOGS_ABANDONED) == 1
        assert network.image_count == 0
        wait_for(lambda: not list((shm / control.IMAGES_DIR).iterdir()), what="its file gone")
        wait_for(lambda: network.has_events, what="the deletion told")
        assert conductor.budget.used == compute_log_length(64 * MIB)  # until its file went
        conductor.do_work(late)
        assert conductor.budget.used == 0
        network._post(_request(channel, 2, 64 * MIB))  # one whose sender is there: attached
        conductor.do_work(late)
        wait_for(lambda: network.has_events, what="the log made")
        conductor.do_work(late + 1)
        assert network.image_count == 1
    finally:
        conductor.close(time.monotonic_ns())
        counters.close()


@pytest.mark.unit
def test_notices_are_told_once_per_source_per_interval_with_what_was_held_back() -> None:
    from slipstream.client.notices import SourceNotices

    notices = SourceNotices(interval_ns=100, capacity=2)
    assert notices.tell("a", 0) == 0
    assert [notices.tell("a", t) for t in (1, 50, 99)] == [None, None, None]
    assert notices.tell("b", 10) == 0
    assert notices.tell("c", 20) is None  # the table is full: held back, counted
    assert notices.tell("a", 100) == 3 + 1  # a's three, and c's
    assert notices.tell("c", 120) == 0  # b's interval ended with nothing held: room again


@pytest.mark.unit
def test_notices_keep_a_bounded_table_whatever_the_sources() -> None:
    from slipstream.client.notices import SourceNotices

    notices = SourceNotices(interval_ns=1_000, capacity=64)
    told = sum(notices.tell(f"10.0.{i // 256}.{i % 256}", i) is not None for i in range(10_000))
    assert len(notices._sources) <= 64
    assert told <= 64 * (10_000 // 1_000 + 1)  # at most the table's worth per interval


def test_max_term_length_is_refused_by_name_where_it_does_nothing_or_differs(launch) -> None:
    """Not a power of two, or on aeron:ipc: the client refuses it; on a spy, or a second
    subscription of an endpoint asking for another bound: the driver; on a publication it is
    the other side's key (a warning)."""
    driver = launch()
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(driver.directory) as client:
        for channel in (f"{uri}|max-term-length=100k", "aeron:ipc?max-term-length=64m"):
            with pytest.raises(ChannelError) as refused:
                parse_channel(channel)
            assert refused.value.part == "max-term-length"
        first = client.add_subscription(f"{uri}|max-term-length=32m", 1)
        for channel, words in ((f"{uri}|max-term-length=64m", "differs from"),
                               (f"aeron-spy:{uri}|max-term-length=64m", "does nothing on a spy")):
            with pytest.raises(ChannelRejectedError, match=words) as rejected:
                client.add_subscription(channel, 2)
            assert rejected.value.part == "max-term-length"
        client.add_subscription(f"{uri}|max-term-length=32m", 3).close()  # the same: joins
        with pytest.warns(ChannelWarning, match="max-term-length is a subscription key"):
            client.add_publication(f"{uri}|max-term-length=32m", 4).close()
        first.close()


def test_an_embedded_driver_makes_one_image_log_per_call(tmp_path: Path) -> None:
    """An embedded driver has no thread of its own: three SETUPs of 3 x 64 MiB logs are made
    by three of its application's do_work() calls, one each, not by one call that would hold
    the application (and the driver's heartbeat) for all three; no worker thread starts."""
    import threading

    from helpers import NETWORK_SETTINGS

    directory = Path("/dev/shm") / f"slipstream-flood-{tmp_path.name[-20:]}"
    port = free_port()
    with MediaDriver.embedded(directory, **{**NETWORK_SETTINGS, **SLOW_LIVENESS}) as driver, \
            Client.connect(driver.directory, invoker=driver.do_work) as client:
        subscription = client.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{port}|max-term-length=64m", STREAM)
        send_setups(port, range(1, 4), 64 * MIB)
        images = directory / control.IMAGES_DIR
        made: list[int] = []  # the image logs each call made
        deadline = time.monotonic() + 20
        while len(subscription.images) < 3:
            assert time.monotonic() < deadline, "the images never came"
            before = len(list(images.glob("*.logbuffer")))
            client.do_work()  # the client's events, and the driver's cycle (its invoker)
            made.append(len(list(images.glob("*.logbuffer"))) - before)
        assert sum(made) == 3 and max(made) == 1, made
        assert not any(t.name == "ss-image-logs" for t in threading.enumerate())


@contextlib.contextmanager
def peer_streams(launch, count: int, **receiving_settings: object
                 ) -> Iterator[tuple[Subscription, list[ExclusivePublication], MediaDriver, int,
                                     MediaDriver]]:
    """A subscription on a driver with ``receiving_settings`` and ``count`` streams of 64 KiB
    terms to it from another driver (exclusive publications: a session each), with that
    driver, the subscription's port and the subscription's driver."""
    receiving = launch(**receiving_settings)
    publishing = launch()
    port = free_port()
    channel = f"aeron:udp?endpoint=127.0.0.1:{port}|term-length=64k"
    with Client.connect(receiving.directory) as subscriber, \
            Client.connect(publishing.directory) as publisher:
        subscription = subscriber.add_subscription(channel, STREAM)
        yield (subscription, [publisher.add_exclusive_publication(channel, STREAM)
                              for _ in range(count)], publishing, port, receiving)


def test_one_peer_connects_five_times_image_source_max_images_streams(launch) -> None:
    """A peer's streams that carry data are no SETUP flood: one publishing driver adds 100
    streams (exclusive publications, a session each) to a subscription whose driver allows
    20 images per source that no data came to yet; every one connects and delivers its
    message once."""
    streams = 100
    with peer_streams(launch, streams, image_source_max_images=streams // 5) as (
            subscription, publications, _, _, _):
        wait_for(lambda: len(subscription.images) == streams, timeout=60,
                 what=f"{streams} images")
        wait_for(lambda: all(p.is_connected for p in publications), timeout=10,
                 what="every publication connected")
        for publication in publications:
            message = publication.session_id.to_bytes(4, "little", signed=True)
            wait_for(lambda p=publication, m=message: p.offer(m) > 0, what="an offer taken")
        received: list[tuple[int, int]] = []

        def on_message(data: memoryview, header) -> None:
            received.append((header.session_id,
                             int.from_bytes(data, "little", signed=True)))

        wait_for(lambda: subscription.poll(on_message, 1000) >= 0
                 and len(received) >= streams, timeout=20, what="every stream's message")
        assert sorted(received) == sorted((p.session_id, p.session_id) for p in publications)


def test_a_refused_streams_publication_hears_why_and_its_driver_logs_it(launch) -> None:
    """The receiving driver's memory bound for one source takes two 64 KiB-term logs: the
    third stream of the publishing driver is refused, and its publication says why (the
    receiver, the setting and its value), as the publishing driver's error log does, once;
    the two others connect, and the receiving driver's counters (stat's, the metrics') show
    the two logs' bytes of the bound and the other image bounds with their settings."""
    log_length = compute_log_length(64 * KIB)
    limit = 2 * log_length + 1
    with peer_streams(launch, 3, image_source_memory_limit=f"{limit}") as (
            subscription, publications, publishing, port, receiving):
        wait_for(lambda: sum(p.is_connected for p in publications) == 2, timeout=10,
                 what="two publications connected")
        refused = next(p for p in publications if not p.is_connected)
        wait_for(lambda: refused.last_refusal is not None, what="the refusal told")
        refusal = refused.last_refusal
        assert refusal is not None and refusal.receiver == f"127.0.0.1:{port}"
        assert f"image_source_memory_limit ({limit / 2**20:g} MiB)" in refusal.reason
        assert refusal.refusals >= 1
        assert all(p.last_refusal is None for p in publications if p is not refused)
        lines = refusals_logged(publishing, "image_source_memory_limit")
        assert len(lines) == 1 and f"stream {STREAM}" in lines[0], lines
        assert len(subscription.images) == 2

        def shown() -> dict[str, tuple[int, int]]:
            counters = CountersFile(receiving.directory / control.COUNTERS_FILE,
                                    writable=False)
            try:
                return {c.setting: (c.used, c.limit)
                        for c in capacities(counters, list(counters))}
            finally:
                counters.close()

        wait_for(lambda: shown()["image_source_memory_limit"] == (2 * log_length, limit),
                 what="the source's two logs of the bound shown")
        # Once data came to both images (the conductor looks on its timer), no image is
        # unheard, and no log is being made.
        wait_for(lambda: shown()["image_source_max_images"][0] == 0,
                 what="both images heard from")
        found = shown()
        defaults = DriverSettings()
        assert found["image_source_max_images"] == (0, defaults.image_source_max_images)
        assert found["image_pending_max"] == (0, defaults.image_pending_max)
        assert found["log_buffer_memory_limit"][0] >= 2 * log_length


def test_a_publications_refusals_count_every_err_and_the_next_notice_tells_the_total(
        launch) -> None:
    """A receiver (a plain socket) answers a SETUP with 64 x REJECTIONS_PER_PASS_MAX ERRs at
    once: the publication is told of the first at once and of the total with the next ERR
    past the notice interval (once a second at most), every ERR that reached the driver
    counted (the kernel may drop some of the burst: the driver's BYTES_RECEIVED says how many
    came).  A pass given more than it keeps the text of: test_control_binding."""
    publishing = launch()
    burst = 64 * REJECTIONS_PER_PASS_MAX
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver, \
            Client.connect(publishing.directory) as publisher:
        receiver.bind(("127.0.0.1", 0))
        publication = publisher.add_publication(
            f"aeron:udp?endpoint=127.0.0.1:{receiver.getsockname()[1]}", STREAM)
        receiver.settimeout(5)
        while not isinstance(frame := decode((datagram := receiver.recvfrom(2048))[0]), Setup):
            pass
        err = ErrorFrame(frame.session_id, STREAM, 77, 12, "no room").encode()
        before = counters_of(publishing)["BYTES_RECEIVED"]
        for _ in range(burst):
            receiver.sendto(err, datagram[1])
        wait_for(lambda: publication.last_refusal is not None, what="the first refusal told")
        time.sleep(REFUSAL_NOTICE_INTERVAL_NS / 1e9 + 0.2)
        receiver.sendto(err, datagram[1])  # told again: the interval passed
        time.sleep(0.2)
        came = (counters_of(publishing)["BYTES_RECEIVED"] - before) // len(err)
        assert came > 4 * REJECTIONS_PER_PASS_MAX, came
        wait_for(lambda: publication.last_refusal is not None
                 and publication.last_refusal.refusals == came, timeout=10,
                 what=f"the {came} refusals that came counted")


def _refuse_setups(receiver: socket.socket, code: int, reason: str, deadline: float, *,
                   count: int | None = None, forge_every_s: float | None = None
                   ) -> tuple[list[float], tuple[str, int] | None]:
    """A plain socket as the receiver: answer each SETUP that comes to ``receiver`` with an
    ERR of ``code`` until ``deadline`` (monotonic s) or ``count`` SETUPs came, and with
    ``forge_every_s`` send the last ERR again that often in between.  Returns when each
    SETUP came, and the publication's address."""
    receiver.settimeout(0.05)
    setups: list[float] = []
    err, source, forged_at = b"", None, 0.0
    while (count is None or len(setups) < count) and time.monotonic() < deadline:
        now = time.monotonic()
        if forge_every_s is not None and source is not None and now - forged_at >= forge_every_s:
            receiver.sendto(err, source)
            forged_at = now
        try:
            data, source = receiver.recvfrom(2048)
        except TimeoutError:
            continue
        frame = decode(data)
        if isinstance(frame, Setup):
            setups.append(time.monotonic())
            err = ErrorFrame(frame.session_id, STREAM, 77, code, reason).encode()
            receiver.sendto(err, source)
    return setups, source


@pytest.mark.parametrize("forged", [False, True], ids=["answered", "forged-errs-between"])
def test_a_publication_refused_for_a_while_asks_again_each_cool_down(
        launch, forged: bool) -> None:
    """A receiver (a plain socket) answers each SETUP with an ERR for a cause that passes
    with its load (RESOURCE_TEMPORARILY_UNAVAILABLE: its logs being made): each SETUP comes
    1 s after that ERR, the receiver's cool-down, however many were refused (a lasting
    cause's come further apart each time: the test below).  ERRs forged every 0.2 s in
    between hold each SETUP off by at most SETUP_REFUSAL_WINDOW_NS more."""
    interval = SETUP_REFUSED_INTERVAL_NS / 1e9
    longest = interval + (SETUP_REFUSAL_WINDOW_NS / 1e9 if forged else 0)
    publishing = launch()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver, \
            Client.connect(publishing.directory) as publisher:
        receiver.bind(("127.0.0.1", 0))
        publisher.add_publication(
            f"aeron:udp?endpoint=127.0.0.1:{receiver.getsockname()[1]}", STREAM)
        setups, _ = _refuse_setups(receiver, ERR_CODE_RESOURCE_TEMPORARILY_UNAVAILABLE, "busy",
                                   time.monotonic() + 3 * longest + 5, count=4,
                                   forge_every_s=0.2 if forged else None)
        gaps = [b - a for a, b in itertools.pairwise(setups)]
        assert len(gaps) == 3, gaps
        assert all(interval * 0.9 < gap < longest + 0.5 for gap in gaps), gaps


def test_a_refused_publication_backs_its_setups_off_until_a_receiver_asks(launch) -> None:
    """A receiver (a plain socket) answers each SETUP with an ERR: the publication's SETUPs,
    100 ms apart until then, come 1 s, then 2 s apart (3 in 4.5 s, not 45), and the
    publication says why; a setup-eliciting status message from the receiver gets one at
    once."""
    publishing = launch()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver, \
            Client.connect(publishing.directory) as publisher:
        receiver.bind(("127.0.0.1", 0))
        port = receiver.getsockname()[1]
        publication = publisher.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}",
                                                STREAM)
        setups, source = _refuse_setups(receiver, ERR_CODE_STORAGE_SPACE, "no room here",
                                        time.monotonic() + 4.5)
        gaps = [b - a for a, b in itertools.pairwise(setups)]
        assert len(setups) == 3, gaps
        for gap, interval in zip(gaps, (1.0, 2.0), strict=True):
            assert interval * 0.9 < gap < interval + 0.5, gaps
        assert publication.last_refusal is not None
        assert publication.last_refusal.reason == "no room here"
        assert source is not None
        receiver.settimeout(0.5)
        asked = time.monotonic()
        receiver.sendto(StatusMessage(publication.session_id, STREAM, 0, 0, 0, 77,
                                      SM_SEND_SETUP_FLAG).encode(), source)
        while not isinstance(decode(receiver.recv(2048)), Setup):
            pass
        assert time.monotonic() - asked < 0.5
