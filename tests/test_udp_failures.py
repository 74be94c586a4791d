"""UDP streams between real driver processes on loopback, beyond the happy path: reserved
values and CUBIC under loss, what `stat` shows, peeks after an image was made again, images
and publications refused, publishers killed and receivers restarted, malformed datagrams,
ports in use, an idle driver's cost.

Every stream is checked message by message, as in test_udp.py.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import signal
import socket
import struct
import time
from array import array
from pathlib import Path

import pytest
from helpers import (
    NETWORK_SETTINGS,
    Collector,
    connect,
    connected_stream,
    counters_of,
    free_port,
    message,
    run_stat,
    runnable_s,
    stream,
    timeslices,
    wait_for,
)

from slipstream.client import (
    BufferClaim,
    ChannelRejectedError,
    Client,
    DataLossError,
    RegistrationError,
    Subscription,
    control,
)
from slipstream.daemon.config import load_settings
from slipstream.daemon.driver import MediaDriver
from slipstream.daemon.media.udp import UDP_SEGMENT
from slipstream.sim.real.fuzz import DatagramFuzzer


def reserved(i: int) -> int:
    """A reserved value for message ``i``, anywhere in the int64 range (negatives too)."""
    return (i * 0x9E3779B97F4A7C15) % 2**64 - 2**63


def test_reserved_values_cross_the_network_with_their_messages_retransmits_too(launch) -> None:
    """Each message's reserved value, set by offer, offer_batch or a claim, is what the
    subscriber's header shows on the other driver: small, MTU-sized and fragmented messages,
    at 5 % loss, so that many frames arrive in retransmits (copies of the sender's log)."""
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    a = launch()
    b = launch(debug_receive_data_loss=50_000, debug_receive_data_loss_seed=13)  # 5 %
    count = 3_000

    def size(i: int) -> int:
        length = (32, 1376, 5000, 200)[i % 4]
        by_claim = (i // 100) % 3 == 2  # runs of 100: offers, batches of 8, claims
        return min(length, 1376) if by_claim else length

    with connected_stream(a, b, uri, 14) as (publication, subscription, _):
        got: list[tuple[int, int, int]] = []  # sequence number, length, reserved value

        def on_message(data: memoryview, header) -> None:
            got.append((struct.unpack_from("<I", data)[0], len(data), header.reserved_value))

        claim = BufferClaim()
        sent = 0
        deadline = time.monotonic() + 60
        while len(got) < count:
            assert time.monotonic() < deadline, f"sent {sent}, received {len(got)}"
            if sent < count:
                run = (sent // 100) % 3
                if run == 0:
                    taken = publication.offer(message(sent, size(sent)),
                                              reserved_value=reserved(sent)) > 0
                elif run == 1:
                    ids = range(sent, min(sent + 8, count, sent - sent % 100 + 100))
                    taken = max(0, publication.offer_batch(
                        b"".join(message(i, size(i)) for i in ids), [size(i) for i in ids],
                        array("q", [reserved(i) for i in ids])))
                elif (taken := publication.try_claim(size(sent), claim) > 0):
                    claim.buffer[:] = message(sent, size(sent))
                    claim.reserved_value = reserved(sent)
                    claim.commit()
                sent += taken
            if not subscription.poll(on_message, 1000):
                time.sleep(0)
        assert got == [(i, size(i), reserved(i)) for i in range(count)]
    sent_counters, received = counters_of(a), counters_of(b)
    assert received["DEBUG_DATA_LOSS_DROPS"] > 0 and sent_counters["RETRANSMITS_SENT"] > 0


def test_a_cubic_receiver_carries_a_lossy_stream_exactly_once(launch) -> None:
    """cc=cubic on the subscription (with round trips measured): its window starts at ten
    datagrams, is cut on each loss and grows back; 20,000 messages at 5 % loss arrive once,
    in order."""
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length=256k"
    a = launch()
    b = launch(debug_receive_data_loss=50_000, debug_receive_data_loss_seed=3,
               cubic_measure_rtt=True)
    with connected_stream(a, b, uri + "|cc=cubic", 5, publication_uri=uri) as (
            publication, _, collector):
        stream(publication, [collector], 20_000, lambda i: 64 + i % 900)
        collector.assert_exactly(20_000)
    received = counters_of(b)
    assert received["DEBUG_DATA_LOSS_DROPS"] > 0 and received["NAK_MESSAGES_SENT"] > 0


def test_stat_shows_each_streams_positions_the_network_counters_and_the_loss_report(
        launch) -> None:
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    a = launch()
    b = launch(debug_receive_data_loss=50_000, debug_receive_data_loss_seed=3)  # 5 %
    with connected_stream(a, b, uri, 9) as (publication, subscription, collector):
        stream(publication, [collector], 5_000, lambda i: 200)
        collector.assert_exactly(5_000)
        end = publication.position
        wait_for(lambda: subscription.images[0].position == end, what="the subscriber's end")
        sender = json.loads(run_stat(a, "--json").stdout)
        receiver = json.loads(run_stat(b, "--json").stdout)
        text = run_stat(b).stdout
    [sent] = sender["streams"]
    assert (sent["stream_id"], sent["session_id"]) == (9, publication.session_id)
    assert sent["positions"]["snd-pos"] == end <= sent["positions"]["snd-lmt"]
    assert sent["positions"]["pub-lmt"] > end
    [received] = receiver["streams"]
    assert received["positions"]["rcv-hwm"] == received["positions"]["rcv-pos"] == end
    assert received["positions"]["sub-pos"] == end and received["subscribers"] == 1
    assert sender["driver"]["retransmits_sent"] > 0
    assert receiver["driver"]["nak_messages_sent"] > 0
    assert receiver["driver"]["status_messages_sent"] > 0
    assert sender["driver"]["status_messages_received"] > 0
    [loss] = receiver["loss_report"]
    assert (loss["session_id"], loss["stream_id"]) == (publication.session_id, 9)
    # Each gap is counted once, however many NAKs it took; at least one frame per gap.
    assert 0 < loss["observations"] <= receiver["driver"]["debug_data_loss_drops"]
    assert loss["bytes_lost"] >= loss["observations"] * 224
    assert loss["first_ns"] <= loss["last_ns"] and uri in loss["label"]
    assert sender["loss_report"] == []
    assert "loss report (1 image(s) with gaps)" in text
    assert "rcv-hwm" in text and "nak messages sent" in text


def test_a_subscriber_peeks_again_at_what_it_consumed_while_the_image_log_holds_it(
        launch) -> None:
    """The image log's tail follows what arrived (as an appender's would), so a peek behind
    the subscriber's position reads the consumed messages again, and one past the tail is
    refused (Spark's restart from a checkpoint relies on both)."""
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    a, b = launch(), launch()
    with connected_stream(a, b, uri, 12, publication_uri=f"{uri}|term-length=64k") as (
            publication, subscription, collector):
        stream(publication, [collector], 600, lambda i: 100)  # 160 B frames: over a term
        collector.assert_exactly(600)
        [image] = subscription.images
        assert image.position == publication.position > 64 * 1024
        again: list[int] = []
        end = image.peek(300 * 160, lambda data, header: again.append(
            struct.unpack_from("<i", data)[0]), image.position)
        assert end == image.position and again == list(range(300, 600))
        with pytest.raises(DataLossError):
            image.peek(image.position + 64 * 1024, lambda data, header: None,
                       image.position + 64 * 1024)


def test_a_position_from_before_an_image_was_made_again_is_data_loss_not_a_stall(
        launch) -> None:
    """The last subscription on a host goes, so does its image; while another host keeps
    the stream going, a new subscription makes the image again where the stream is now.  A
    position of the old image (a checkpoint) is not in the new log: peek says so instead of
    reading nothing forever."""
    port = free_port()
    uri = (f"aeron:udp?endpoint=224.0.1.{random.randrange(1, 250, 2)}:{port}"
           f"|interface=127.0.0.1")
    a, b, c = launch(), launch(), launch()
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb, \
            Client.connect(c.directory) as cc:
        publication = ca.add_publication(f"{uri}|term-length=64k", 13)
        first = cb.add_subscription(uri, 13)
        other_host = Collector(cc.add_subscription(uri, 13))
        connect(publication, first, other_host.subscription)
        stream(publication, [Collector(first), other_host], 50, lambda i: 100)
        checkpoint = first.images[0].position
        first.close()
        stream(publication, [other_host], 50, lambda i: 100, first=50)
        second = cb.add_subscription(uri, 13)
        wait_for(lambda: second.images, timeout=15, what="the image made again")
        [image] = second.images
        assert image.session_id == publication.session_id
        assert image.join_position > checkpoint
        with pytest.raises(DataLossError):
            image.peek(checkpoint, lambda data, header: None, image.join_position)


def test_a_second_udp_publisher_asking_for_another_term_length_is_refused_by_name(
        launch) -> None:
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(launch().directory) as client:
        first = client.add_publication(f"{uri}|term-length=64k", 14)
        with pytest.raises(RegistrationError, match="term-length: 131072 differs from the "
                                                    "existing publication's 65536"):
            client.add_publication(f"{uri}|term-length=128k", 14)
        assert client.add_publication(uri, 14).session_id == first.session_id


def test_an_image_past_the_log_budget_is_refused_counted_and_logged_once(launch) -> None:
    """A receiving driver whose log_buffer_memory_limit cannot hold a sender's log refuses
    the image: its error log says so once per refusal, naming the image once (it said it
    twice), and its errors counter counts each entry (it stayed 0)."""
    from slipstream.daemon.reports.error_log import read_error_log

    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    sender, receiver = launch(), launch(log_buffer_memory_limit="1m")
    with Client.connect(sender.directory) as a, Client.connect(receiver.directory) as b:
        b.add_subscription(uri, 5)
        a.add_publication(f"{uri}|term-length=1m", 5)
        wait_for(lambda: read_error_log(receiver.directory), what="the refusal logged")
    [entry] = read_error_log(receiver.directory)
    assert entry.message.startswith("cannot create the image of session ")
    assert entry.message.count("the image of") == 1, entry.message
    assert "past log_buffer_memory_limit" in entry.message
    assert counters_of(receiver)["ERRORS"] >= entry.count >= 1


def test_an_unreliable_stream_skips_what_is_lost_and_stays_in_order(launch) -> None:
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|reliable=false"
    a = launch()
    b = launch(debug_receive_data_loss=100_000, debug_receive_data_loss_seed=3)  # 10 %
    with connected_stream(a, b, uri, 5) as (publication, subscription, collector):
        for seq in range(5000):
            while publication.offer(message(seq, 200)) < 0:
                collector.poll()
            collector.poll()
        end = publication.position
        wait_for(lambda: collector.poll() == 0 and image_position(subscription) >= end,
                 what="the subscriber reached the end")
    assert collector.torn == 0
    assert collector.seen == sorted(set(collector.seen))  # in order, no duplicates
    assert 0 < len(collector.seen) < 5000
    assert counters_of(b)["LOSS_GAP_FILLS"] > 0 and counters_of(b)["NAK_MESSAGES_SENT"] == 0


def image_position(subscription: Subscription) -> int:
    return max((image._position for image in subscription.images), default=-1)


def test_session_ids_name_the_stream_and_filter_subscriptions(launch) -> None:
    port = free_port()
    a, b = launch(), launch()
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        wanted = cb.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}|session-id=4321", 9)
        everything = cb.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", 9)
        mine = ca.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}|session-id=4321", 9)
        other = ca.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}|session-id=5555", 9)
        assert (mine.session_id, other.session_id) == (4321, 5555)
        wait_for(lambda: len(everything.images) == 2 and len(wanted.images) == 1)
        assert wanted.images[0].session_id == 4321
        with pytest.raises(RegistrationError, match="term-length"):
            ca.add_publication(
                f"aeron:udp?endpoint=127.0.0.1:{port}|session-id=4321|term-length=128k", 9)


def _publish_forever(directory: str, uri: str, ready: multiprocessing.Event) -> None:
    with Client.connect(directory) as client:
        publication = client.add_publication(uri, 3)
        seq = 0
        while True:
            if publication.offer(message(seq, 100)) > 0:
                seq += 1
                if seq == 1000:
                    ready.set()
            else:
                time.sleep(0.0001)


def test_a_publisher_killed_mid_stream_leaves_a_clean_prefix_and_its_image_goes(launch) -> None:
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    a, b = launch(), launch()
    with Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(uri, 3)
        collector = Collector(subscription)
        context = multiprocessing.get_context("spawn")
        ready = context.Event()
        process = context.Process(target=_publish_forever, args=(str(a.directory), uri, ready))
        process.start()
        try:
            deadline = time.monotonic() + 20
            while not ready.is_set():
                assert time.monotonic() < deadline, "the publisher did not get going"
                collector.poll()
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.join(10)
        # Its driver times the client out (1 s), closes the publication: drain, EOS, gone.
        # The 1000 offers before `ready` were committed; a kill that comes at once may find
        # the next one claimed only, which becomes padding (so at least 1000, maybe no more).
        wait_for(lambda: collector.poll() >= 0 and not subscription.images and
                 len(collector.seen) >= 1000, timeout=15, what="the image went away")
        collector.poll()
        collector.assert_exactly(len(collector.seen))
    wait_for(lambda: not any((a.directory / control.PUBLICATIONS_DIR).iterdir()), timeout=10,
             what="the publisher's log was removed")


def test_a_restarted_receiving_driver_gets_the_stream_again(launch, driver_dir: Path) -> None:
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    a = launch()
    with Client.connect(a.directory) as ca:
        publication = ca.add_publication(uri, 4)
        with MediaDriver.launch(directory=driver_dir, **NETWORK_SETTINGS) as b:
            orphan = Client.connect(driver_dir, timeout=0.5)
            subscription = orphan.add_subscription(uri, 4)
            connect(publication, subscription)
            b.kill()  # a crash: its files stay for the next driver to clean
        orphan.close()
        wait_for(lambda: not publication.is_connected, timeout=10,
                 what="the publication noticed the receiver is gone")
        with MediaDriver.launch(directory=driver_dir, **NETWORK_SETTINGS), \
                Client.connect(driver_dir) as cb2:
            subscription = cb2.add_subscription(uri, 4)
            connect(publication, subscription)  # heartbeats elicit a SETUP: a new image
            collector = Collector(subscription)
            base = publication.position
            offered = 0
            while len(collector.seen) < 2000:
                if offered < 2000 and publication.offer(message(offered, 64)) > 0:
                    offered += 1
                collector.poll()
            collector.assert_exactly(2000)
            assert subscription.images[0].join_position == base


@pytest.mark.parametrize("multicast", [False, True], ids=["unicast", "multicast"])
def test_malformed_and_mutated_datagrams_are_counted_and_the_stream_carries_on(
        launch, multicast: bool) -> None:
    """Garbage goes at the receiver's socket and at the sender's: unicast, the sender's socket
    is connected to the endpoint, so the kernel keeps strangers' datagrams from it; multicast,
    the sender listens on the control group, where anyone may send."""
    port, control_port = free_port(), free_port()
    if multicast:
        group = random.randrange(1, 250, 2)
        uri = f"aeron:udp?endpoint=224.0.2.{group}:{port}|interface=127.0.0.1"
        targets = [(f"224.0.2.{group}", port), (f"224.0.2.{group + 1}", port)]
        publication_uri = uri
    else:
        uri = f"aeron:udp?endpoint=127.0.0.1:{port}"
        # control= pins the publication's local address; a subscription refuses it.
        publication_uri = f"{uri}|control=127.0.0.1:{control_port}"
        targets = [("127.0.0.1", port), ("127.0.0.1", control_port)]
    a, b = launch(), launch()
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF,
                          socket.inet_aton("127.0.0.1"))
        subscription = cb.add_subscription(uri, 11)
        publication = ca.add_publication(publication_uri, 11)
        connect(publication, subscription)
        collector = Collector(subscription)
        fuzzer = DatagramFuzzer(publication.session_id, 11, seed=20261122,
                                initial_term_id=publication.initial_term_id)
        sent = offered = 0
        deadline = time.monotonic() + 60
        while len(collector.seen) < 20_000 or sent < 20_000:
            assert time.monotonic() < deadline, f"{sent} sent, {len(collector.seen)} received"
            for _ in range(20):
                with contextlib.suppress(OSError):
                    sender.sendto(fuzzer.next(), targets[sent % 2])
                sent += 1
            # And a run of them as one GSO send: the receiving driver takes it coalesced
            # (UDP_GRO) and must cut it and check each datagram on its own.
            run = [fuzzer.next() for _ in range(8)]
            size = min(max(32, len(run[0])), 1400)  # eight fit in one UDP payload
            run = [d[:size].ljust(size, b"\0") for d in run[:-1]] + [run[-1][:size]]
            with contextlib.suppress(OSError):
                sender.sendmsg([b"".join(run)], [(socket.IPPROTO_UDP, UDP_SEGMENT,
                                                  struct.pack("=H", size))], 0, targets[0])
            sent += len(run)
            while offered < 20_000 and publication.offer(message(offered, 200)) > 0:
                offered += 1
            collector.poll()
        collector.assert_exactly(20_000)
    dropped = counters_of(b)
    assert dropped["INVALID_PACKETS"] + dropped["FOREIGN_SOURCE_DROPS"] > 0
    assert (counters_of(a)["INVALID_PACKETS"] > 0) == multicast


def test_a_port_in_use_is_a_clear_error(launch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        port = squatter.getsockname()[1]
        a = launch()
        with Client.connect(a.directory) as client:
            with pytest.raises(RegistrationError, match=f"127.0.0.1:{port}.*in use"):
                client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", 1)
            with pytest.raises(RegistrationError, match="endpoint"):
                client.add_publication("aeron:udp?endpoint=127.0.0.1:0", 1)
            ipc = client.add_subscription("aeron:ipc", 1)  # still serving
            publication = client.add_publication("aeron:ipc", 1)
            wait_for(lambda: publication.is_connected and ipc.is_connected, what="connected")


def test_a_socket_buffer_the_kernel_caps_is_named_in_the_log(launch, capfd) -> None:
    maximum = int(Path("/proc/sys/net/core/rmem_max").read_text())
    a = launch(socket_so_rcvbuf=min(maximum * 4, 1 << 30))
    with Client.connect(a.directory) as client:
        client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 1)
        # Kept across reads: each read takes what came since the last, and a line can arrive
        # in two of them.
        err: list[str] = []
        wait_for(lambda: err.append(capfd.readouterr().err) or "net.core.rmem_max" in "".join(err),
                 timeout=5, what="a warning naming net.core.rmem_max")


SENDER_HEARTBEAT_S = 0.1  # SS_HEARTBEAT_TIMEOUT_NS (daemon/network.h): an idle sender's beat


def test_an_idle_driver_with_open_udp_channels_sleeps_between_its_timers(
        driver_dir: Path) -> None:
    """Idle, a UDP stream open both ways on one driver, its threads wake for their timers
    only: the sender's heartbeats and the receiver's status messages (the network thread,
    the C half's), the conductor's cycles; none of them is runnable for long (a thread that
    spins is runnable the whole window however loaded the machine).  What it costs in CPU
    is bench/idle_cost.py's figure."""
    settings = load_settings(env={})
    rings_per_s = (1 / SENDER_HEARTBEAT_S + 1e9 / settings.status_message_timeout
                   + 2e9 / settings.timer_interval)  # the conductor's and the network park's
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    window_s = 6.0
    with MediaDriver.launch(directory=driver_dir) as driver, \
            Client.connect(driver_dir) as client:
        subscription = client.add_subscription(uri, 10)
        publication = client.add_publication(uri, 10)
        connect(publication, subscription)
        time.sleep(1.0)
        passes_before = counters_of(driver)["NETWORK_PYTHON_PASSES"]
        runnable, woken = runnable_s(pid=driver.pid), timeslices(driver.pid)
        started = time.monotonic()
        time.sleep(window_s)
        runnable = runnable_s(pid=driver.pid) - runnable
        woken = timeslices(driver.pid) - woken
        passes_per_s = ((counters_of(driver)["NETWORK_PYTHON_PASSES"] - passes_before)
                        / (time.monotonic() - started))
    # Twice the rings: a wake-up preempted midway on a loaded machine returns to a CPU again.
    assert woken <= 2 * rings_per_s * window_s + 4, f"woke {woken} times in {window_s} s"
    assert runnable < window_s / 2, f"runnable {runnable:.2f} s of {window_s}"
    # Its heartbeats and the timer's status messages are the C half's: the network thread's
    # Python half has nothing to do (it ran 15 times a second when they were Python's).
    assert passes_per_s < 3, passes_per_s


def test_dedicated_threads_carry_the_stream_too(launch) -> None:
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    a, b = launch(threading_mode="dedicated"), launch(threading_mode="dedicated")
    with connected_stream(a, b, uri, 2) as (publication, _, collector):
        stream(publication, [collector], 10_000, lambda i: 32 + i % 2000)
        collector.assert_exactly(10_000)
    shared = launch()

    def threads(pid: int) -> list[str]:
        """The process's threads but the log worker, which a driver starts at its first
        log to make or free off the conductor's thread."""
        names = [Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                 for tid in os.listdir(f"/proc/{pid}/task")]
        return [name for name in names if name != "ss-image-logs"]

    assert len(threads(a.pid)) == len(threads(shared.pid)) + 1  # a sender and a receiver


@pytest.mark.parametrize(("parameter", "part"), [
    ("tags=1001", "tags"),
    ("session-id=tag:1001", "session-id"),
])
def test_what_the_driver_does_not_carry_yet_is_refused_by_name(launch, parameter: str,
                                                              part: str) -> None:
    a = launch()
    with Client.connect(a.directory) as client:
        with pytest.raises(RegistrationError, match=f"{part}: .*not supported"):
            client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{free_port()}|{parameter}", 1)


def test_a_channel_named_by_host_name_is_resolved_once_as_it_is_added(launch) -> None:
    import time

    from slipstream.client.channel import parse_channel
    from slipstream.daemon.conductor.network_records import _resolved
    from slipstream.daemon.media import names

    named = parse_channel("aeron:udp?endpoint=localhost:40123|term-length=64k")
    cache = names.NameCache()  # what the driver's resolver answered, as the command came
    cache.store(names.resolve(["localhost"]), time.monotonic())
    resolved = _resolved(named, cache, lambda: [])  # no interface=: the addresses unasked
    assert resolved.endpoint is not None and resolved.endpoint.host == "127.0.0.1"
    assert str(resolved) == str(named)  # labels keep the name the user gave
    uri = f"aeron:udp?endpoint=localhost:{free_port()}"
    a, b = launch(), launch()
    with connected_stream(a, b, uri, 33) as (publication, _, collector):
        stream(publication, [collector], 2000, lambda i: 100)
        collector.assert_exactly(2000)


def _sockets_of(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed while we look: not a socket
            count += os.readlink(fd).startswith("socket:")
    return count


def test_a_publication_refused_leaves_no_send_socket_open(launch) -> None:
    driver = launch(log_buffer_memory_limit="1m")
    with Client.connect(driver.directory) as client:
        before = _sockets_of(driver.pid)
        for _ in range(5):  # each on an endpoint of its own
            with pytest.raises(RegistrationError, match="log_buffer_memory_limit"):
                client.add_publication(
                    f"aeron:udp?endpoint=127.0.0.1:{free_port()}|term-length=1m", 34)
        wait_for(lambda: _sockets_of(driver.pid) == before, timeout=5,
                 what=f"the driver's sockets back to {before}")


def test_a_second_subscription_asking_for_other_image_parameters_on_an_endpoint_is_refused(
        client: Client) -> None:
    """An endpoint's images and socket are made with what its first subscription asked for:
    another subscription there that asks for something else is refused by name (it used to be
    accepted and ignored); one that names nothing, or the same, joins."""
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    first = client.add_subscription(uri + "|rcv-wnd=64k", 1)
    for asked, part in (("|rcv-wnd=32k", "rcv-wnd"), ("|cc=cubic", "cc"),
                        ("|reliable=false", "reliable"), ("|so-rcvbuf=256k", "so-rcvbuf")):
        with pytest.raises(ChannelRejectedError, match=f"{part}: .* differs from") as refused:
            client.add_subscription(uri + asked, 2)
        assert refused.value.part == part
    joined = [client.add_subscription(uri, 2), client.add_subscription(uri + "|rcv-wnd=64k", 3),
              client.add_subscription(uri + "|cc=static|reliable=true", 4)]
    for subscription in (first, *joined):
        subscription.close()


def test_an_image_a_receiver_refuses_is_logged_with_its_reason_on_both_hosts(launch) -> None:
    """A term longer than the receiver takes: the receiving driver logs why it refused, and
    the sending driver logs the reason its ERR frame carried (both showed only a counter)."""
    from slipstream.daemon.reports.error_log import read_error_log

    sender, receiver = launch(), launch(image_term_buffer_length_max="1m")
    uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}"
    with Client.connect(sender.directory) as ca, Client.connect(receiver.directory) as cb:
        cb.add_subscription(uri, 7)
        publication = ca.add_publication(uri + "|term-length=2m|sparse=true", 7)
        reason = "term length 2097152 is over this receiver's image_term_buffer_length_max"

        def logged(driver: MediaDriver, words: str) -> bool:
            return any(words in e.message and reason in e.message
                       for e in read_error_log(driver.directory))

        wait_for(lambda: logged(receiver, "refused the image of session")
                 and logged(sender, "refused the image of session"), timeout=10,
                 what="the refusal logged on both drivers")
        assert not publication.is_connected
        # Counted as errors too, as every entry of the error log is.
        assert counters_of(receiver)["ERRORS"] >= 1 and counters_of(sender)["ERRORS"] >= 1
