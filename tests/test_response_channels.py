"""Response channels (docs/CHANNELS.md §7.6) between real driver processes on loopback, each
driver a host: a client's request stream to a server, and the server's response stream back
to the client through the address the client's response subscription sends from (what a NAT
or firewall lets back in), never an endpoint the client names.

Every stream is checked message by message (helpers.Collector): in order, none missing or
twice.  Aeron's own peer here (1.15.1) predates response channels, so slipstream talks to
slipstream only.
"""

from __future__ import annotations

import contextlib
import select
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from helpers import (
    NETWORK_SETTINGS,
    Collector,
    counters_of,
    free_port,
    message,
    publisher_limits,
    wait_for,
)
from test_encrypted_streams import DROPS, KEY_A, KEY_B, drops, write_keys

from slipstream.client import ChannelRejectedError, ChannelWarning, Client
from slipstream.client.frames import SM_SEND_SETUP_FLAG, ResponseSetup, StatusMessage, decode
from slipstream.client.layout import (
    EXT_MAGIC,
    EXT_TYPE_HANDSHAKE_ANSWER,
    EXT_TYPE_HANDSHAKE_CONFIRM,
    EXT_TYPE_HANDSHAKE_INIT,
    EXT_TYPE_SEALED,
    HANDSHAKE_ANSWER_LENGTH,
    HANDSHAKE_CONFIRM_LENGTH,
    HANDSHAKE_INIT_LENGTH,
    HDR_TYPE_EXT,
    SEALED_HEADER,
    SEALED_OVERHEAD,
)
from slipstream.client.publication import Publication
from slipstream.client.subscription import Subscription
from slipstream.daemon.driver import MediaDriver

pytestmark = pytest.mark.timeout(60)

REQUESTS, RESPONSES = 1001, 1002


def _keyed(key: str | None) -> str:
    return "" if key is None else f"|key={key}"


def add_response_subscription(client: Client, control_port: int, *, key: str | None = None,
                              host: str = "127.0.0.1"):
    """The client's response subscription (RESPONSES), its control address the server's
    ``host``:``control_port``."""
    return client.add_subscription(
        f"aeron:udp?control-mode=response|control={host}:{control_port}{_keyed(key)}",
        RESPONSES)


def add_request_publication(client: Client, port: int, response_subscription, *,
                            exclusive: bool = False, key: str | None = None,
                            host: str = "127.0.0.1"):
    """The client's request publication (REQUESTS) to the server's ``host``:``port``,
    answered on ``response_subscription``."""
    add = client.add_exclusive_publication if exclusive else client.add_publication
    return add(f"aeron:udp?endpoint={host}:{port}"
               f"|response-correlation-id={response_subscription.registration_id}"
               f"{_keyed(key)}", REQUESTS)


def add_response_publication(server: Client, control_port: int, image, *,
                             exclusive: bool = False, key: str | None = None,
                             host: str = "127.0.0.1"):
    """The server's response publication (RESPONSES) to the client of request ``image``,
    from the server's ``host``:``control_port``."""
    add = server.add_exclusive_publication if exclusive else server.add_publication
    return add(f"aeron:udp?control-mode=response|control={host}:{control_port}"
               f"|response-correlation-id={image.correlation_id}{_keyed(key)}", RESPONSES)


class _Nat:
    """A port-rewriting NAT in front of a client's response subscription, in a thread: the
    subscription's control= address is the NAT's inside port; what the client sends there
    goes on to the server's control port from the NAT's outside port, and what the server
    sends to that outside port comes back to the client from the inside port.
    :meth:`rebind` gives the mapping a new outside port (the old one then drops what
    reaches it, as a NAT that forgot its mapping); :attr:`blocked` drops everything;
    :attr:`datagrams` holds every datagram it passed on, either way."""

    def __init__(self, server: tuple[str, int]) -> None:
        self.server = server
        self.inside = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.inside.bind(("127.0.0.1", 0))
        self.port = self.inside.getsockname()[1]
        self.outside = self._outside()
        self.client: tuple[str, int] | None = None
        self.blocked = False
        self.datagrams: list[bytes] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _outside() -> socket.socket:
        outside = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        outside.bind(("127.0.0.1", 0))
        return outside

    @property
    def outside_port(self) -> int:
        return self.outside.getsockname()[1]

    def rebind(self) -> None:
        with self._lock:
            old, self.outside = self.outside, self._outside()
        old.close()

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                outside = self.outside
            try:
                ready, _, _ = select.select([self.inside, outside], [], [], 0.05)
                for sock in ready:
                    data, source = sock.recvfrom(65536)
                    if self.blocked:
                        continue
                    self.datagrams.append(data)
                    if sock is self.inside:
                        self.client = source
                        outside.sendto(data, self.server)
                    elif self.client is not None:
                        self.inside.sendto(data, self.client)
            except OSError:
                continue  # the outside socket closed under us (a rebind)

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.inside.close()
        self.outside.close()


class _Echo:
    """The server's loop for one request image: each request goes back, as it came, on the
    response publication made for that image (what the requests say is checked too)."""

    def __init__(self, image, response) -> None:
        self.image, self.response = image, response
        self.requests = Collector(image)
        self.echoed = 0

    def poll(self) -> int:
        work = self.requests.poll()
        while self.echoed < len(self.requests.seen):
            seq = self.requests.seen[self.echoed]
            if self.response.offer(message(seq, _size(seq))) < 0:
                break
            self.echoed += 1
        return work


def _size(seq: int) -> int:
    return (32, 700, 1376, 3000)[seq % 4]  # 3000: a message of three fragments


def _exchange(pairs: list[tuple], echoes: list[_Echo], count: int, timeout: float = 30.0) -> None:
    """Each (request publication, response collector, first) pair sends requests ``first ..
    first + count - 1`` and gets each back (``count`` more answers), while the server
    echoes."""
    sent = [0] * len(pairs)
    targets = [len(responses.seen) + count for _, responses, _ in pairs]
    deadline = time.monotonic() + timeout
    while any(len(r.seen) < t for (_, r, _), t in zip(pairs, targets, strict=True)):
        assert time.monotonic() < deadline, (
            f"sent {sent}, answered {[len(r.seen) for _, r, _ in pairs]} of {targets}")
        work = 0
        for i, (requests, _, first) in enumerate(pairs):
            while sent[i] < count and requests.offer(message(first + sent[i],
                                                             _size(first + sent[i]))) > 0:
                sent[i] += 1
                work += 1
        work += sum(echo.poll() for echo in echoes)
        work += sum(responses.poll() for _, responses, _ in pairs)
        if not work:
            time.sleep(0)


def _answer(server: Client, requests, control_port: int, count: int, *,
            key: str | None = None) -> list[_Echo]:
    """The server's part of the handshake: a response publication for each of ``count``
    request images (Aeron's ResponseServer), by the image's correlation id; the second, if
    any, an exclusive one."""
    wait_for(lambda: len(requests.images) == count, timeout=10, what="the request images")
    return [_Echo(image, add_response_publication(server, control_port, image, exclusive=i == 1,
                                               key=key))
            for i, image in enumerate(requests.images)]


def test_a_request_and_response_exchange_crosses_many_terms_both_ways(launch) -> None:
    """A client behind its own driver asks, the server answers on a response publication
    made for the request image: 6,000 requests and 6,000 responses (terms of 64 KiB rotate
    about 50 times each way), each stream exactly once and in order; the response stream
    goes to the port the client's response subscription sends from, learned by the server."""
    with _connected(launch) as link:
        responses, request_publication, echo = (link.responses, link.request_publication,
                                                link.echo)
        [image] = responses.images
        assert image.session_id == echo.response.session_id
        assert image.source_identity == f"127.0.0.1:{link.control_port}"
        collector = Collector(responses)
        _exchange([(request_publication, collector, 0)], [echo], 6000)
        echo.requests.assert_exactly(6000)
        collector.assert_exactly(6000)
        assert echo.response.position > 6 * 64 * 1024
    for driver in (link.server_driver, link.client_driver):
        counts = counters_of(driver)
        assert counts["INVALID_PACKETS"] == 0 and counts["SEND_ERRORS"] == 0


def test_two_clients_each_get_only_their_own_responses(launch) -> None:
    """Two clients, each behind its own driver, ask one server on one request channel; the
    server's two response publications share its control port.  Each client's response
    subscription has one image, of its own response session, and gets exactly its own
    answers (the two ask for different sequence numbers).  The second client's request
    publication, and the server's second response publication, are exclusive ones."""
    server_driver = launch()
    client_drivers = [launch(), launch()]
    port, control_port = free_port(), free_port()
    clients = [Client.connect(d.directory) for d in client_drivers]
    try:
        with Client.connect(server_driver.directory) as server:
            requests = server.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}",
                                               REQUESTS)
            responses = [add_response_subscription(c, control_port) for c in clients]
            publications = [add_request_publication(c, port, r, exclusive=i == 1)
                            for i, (c, r) in enumerate(zip(clients, responses, strict=True))]
            echoes = _answer(server, requests, control_port, 2)
            wait_for(lambda: all(r.images for r in responses)
                     and all(e.response.is_connected for e in echoes), timeout=10,
                     what="both response streams connected")
            assert sorted(r.images[0].session_id for r in responses) == sorted(
                e.response.session_id for e in echoes)
            collectors = [Collector(r) for r in responses]
            firsts = (0, 1_000_000)
            _exchange(list(zip(publications, collectors, firsts, strict=True)), echoes, 2000)
            for collector, first in zip(collectors, firsts, strict=True):
                collector.assert_exactly(2000, first=first)
            assert [len(r.images) for r in responses] == [1, 1]
    finally:
        for client in clients:
            client.close()


def test_a_client_that_goes_away_leaves_nothing_at_the_server(launch) -> None:
    """The client's host dies (its driver killed): the server's request image times out,
    the server closes the response publication made for it on ``on_unavailable_image`` (as
    Aeron's ResponseServer does), and that publication, its log and its control socket go;
    the image's correlation id then names nothing, refused by name."""
    server_driver, client_driver = launch(), launch()
    port, control_port = free_port(), free_port()
    gone = []
    with Client.connect(server_driver.directory) as server:
        requests = server.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", REQUESTS,
                                           on_unavailable_image=gone.append)
        client = Client.connect(client_driver.directory)
        responses = add_response_subscription(client, control_port)
        add_request_publication(client, port, responses)
        [echo] = _answer(server, requests, control_port, 1)
        wait_for(lambda: echo.response.is_connected and responses.images, timeout=10,
                 what="the response stream connected")
        assert publisher_limits(server_driver) == 1
        client_driver.kill()
        wait_for(lambda: gone, timeout=10, what="the request image went")
        echo.response.close()
        wait_for(lambda: publisher_limits(server_driver) == 0, timeout=10,
                 what="the response publication freed")
        wait_for(lambda: _can_bind(control_port), timeout=10,
                 what="the response publication's control socket closed")
        with pytest.raises(ChannelRejectedError, match="names no image") as refused:
            add_response_publication(server, control_port, echo.image)
        assert refused.value.part == "response-correlation-id"
        client.close()  # its driver is gone: the client lets its resources go


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _response_setups(sock: socket.socket) -> int:
    """How many RSP_SETUPs wait at ``sock`` (non-blocking), read off."""
    count = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            count += isinstance(decode(sock.recv(65536)), ResponseSetup)
    return count


def test_a_request_image_that_goes_before_its_response_publication_connects(launch) -> None:
    """The client's host dies just as the server makes the response publication for its
    request image, which so never connects: while the image lives it sends RSP_SETUP to
    the client's address; once it has gone it sends none, the server's conductor holds the
    publication pending no more, and closing it frees its log and its control socket.  The
    server's driver is embedded (run by this test), to look at its conductor."""
    directory = Path("/dev/shm") / f"slipstream-embedded-{uuid.uuid4().hex[:12]}"
    server_driver = MediaDriver.embedded(directory, **NETWORK_SETTINGS)
    client_driver = launch()
    port, control_port = free_port(), free_port()
    gone: list = []

    def run_until(condition, what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"{what} did not come within {timeout} s"
            if not server_driver.do_work():
                time.sleep(0.0001)

    try:
        with Client.connect(server_driver.directory, invoker=server_driver.do_work) as server, \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client_address:
            network = server_driver.conductor.network
            requests = server.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}",
                                               REQUESTS, on_unavailable_image=gone.append)
            client = Client.connect(client_driver.directory)
            responses = add_response_subscription(client, control_port)
            add_request_publication(client, port, responses)
            run_until(lambda: requests.images, "the request image")
            [image] = requests.images
            host, source_port = image.source_identity.rsplit(":", 1)
            client_driver.kill()
            client_address.bind((host, int(source_port)))  # where RSP_SETUPs go
            client_address.setblocking(False)
            response = add_response_publication(server, control_port, image)
            assert [e.publication.session_id for e in network._answering] == [
                response.session_id]
            setups = 0

            def image_gone() -> bool:
                nonlocal setups
                setups += _response_setups(client_address)
                return bool(gone)

            run_until(image_gone, "the request image went")
            assert setups >= 1 and not response.is_connected
            assert network._answering == []
            time.sleep(0.05)
            _response_setups(client_address)  # any sent before it went
            deadline = time.monotonic() + 1.5  # more than a status-message timeout
            while time.monotonic() < deadline:
                server_driver.do_work()
                assert _response_setups(client_address) == 0
                time.sleep(0.001)
            response.close()
            run_until(lambda: publisher_limits(server_driver) == 0
                      and _can_bind(control_port), "the response publication freed")
            client.close()
    finally:
        server_driver.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_response_subscription_that_cannot_work_is_refused_by_name(launch) -> None:
    """On aeron:ipc, on a spy, with an endpoint of its own, without a control address."""
    driver = launch()
    port, control_port = free_port(), free_port()
    with Client.connect(driver.directory) as client:
        for uri, part, problem in [
            ("aeron:ipc?control-mode=response", "control-mode", "aeron:ipc"),
            (f"aeron-spy:aeron:udp?control-mode=response|control=127.0.0.1:{control_port}",
             "control-mode", "not spied on"),
            (f"aeron:udp?control-mode=response|endpoint=127.0.0.1:{port}"
             f"|control=127.0.0.1:{control_port}", "endpoint", "leave endpoint= out"),
            ("aeron:udp?control-mode=response|interface=127.0.0.1", "control",
             "control=HOST:PORT"),
        ]:
            with pytest.raises(ChannelRejectedError, match=problem) as refused:
                client.add_subscription(uri, RESPONSES)
            assert refused.value.part == part, uri


def test_response_keys_that_name_nothing_are_refused_by_name(launch) -> None:
    """A request publication naming no response subscription (or a plain one), a response
    publication naming no image, an image that asked for no response, no image at all or
    no control address; the response keys on aeron:ipc and on a spy: each refused, naming
    the key, and nothing is made."""
    server_driver, client_driver = launch(), launch()
    port, control_port = free_port(), free_port()
    with Client.connect(server_driver.directory) as server, \
            Client.connect(client_driver.directory) as client:
        plain = client.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{free_port()}", 7)
        requests = server.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}", REQUESTS)
        refusals = [
            (client.add_publication, f"aeron:udp?endpoint=127.0.0.1:{port}"
             f"|response-correlation-id=424242", "response-correlation-id",
             "not the registration id of a response subscription"),
            (client.add_publication, f"aeron:udp?endpoint=127.0.0.1:{port}"
             f"|response-correlation-id={plain.registration_id}", "response-correlation-id",
             "not the registration id of a response subscription"),
            (server.add_publication, f"aeron:udp?control-mode=response"
             f"|control=127.0.0.1:{control_port}|response-correlation-id=424242",
             "response-correlation-id", "names no image"),
            (server.add_publication, f"aeron:udp?control-mode=response"
             f"|control=127.0.0.1:{control_port}", "response-correlation-id",
             "answers one request image"),
            (server.add_publication, "aeron:udp?control-mode=response"
             "|response-correlation-id=1", "control", "control=HOST:PORT"),
            (server.add_publication, f"aeron:udp?control-mode=response|endpoint=127.0.0.1:"
             f"{port}|control=127.0.0.1:{control_port}|response-correlation-id=1", "endpoint",
             "leave endpoint= out"),
            (server.add_publication, "aeron:ipc?control-mode=response"
             "|response-correlation-id=1", "control-mode", "aeron:ipc"),
            (server.add_publication, "aeron:ipc?response-correlation-id=1",
             "response-correlation-id", "aeron:ipc"),
        ]
        for add, uri, part, problem in refusals:
            with pytest.raises(ChannelRejectedError, match=problem) as refused:
                add(uri, REQUESTS)
            assert refused.value.part == part, uri
        # The client warns that the key is a publication's; the driver refuses it on a spy.
        with pytest.raises(ChannelRejectedError, match="not spied on") as spy, \
                pytest.warns(ChannelWarning, match="publication key"):
            server.add_subscription(f"aeron-spy:aeron:udp?control=127.0.0.1:{control_port}"
                                    f"|response-correlation-id=1", RESPONSES)
        assert spy.value.part == "response-correlation-id"

        # An image whose publication asked for no response cannot be answered.
        plain_request = client.add_publication(f"aeron:udp?endpoint=127.0.0.1:{port}",
                                               REQUESTS)
        wait_for(lambda: requests.images and plain_request.is_connected, timeout=10,
                 what="the plain request stream")
        with pytest.raises(ChannelRejectedError, match="did not ask for responses") as unasked:
            add_response_publication(server, control_port, requests.images[0])
        assert unasked.value.part == "response-correlation-id"
        assert publisher_limits(server_driver) == 0


def test_a_server_that_makes_its_response_publication_again_is_answered_again(launch) -> None:
    """The server closes the response publication of a request image and makes another (a
    new session): the client's response subscription, whose image of the first session went,
    takes the new session from the new RSP_SETUP, and the exchange goes on."""
    with _connected(launch) as link:
        responses, request_publication, echo = (link.responses, link.request_publication,
                                                link.echo)
        collector = Collector(responses)
        _exchange([(request_publication, collector, 0)], [echo], 500)
        first_session = echo.response.session_id
        echo.response.close()
        wait_for(lambda: not responses.images, timeout=10, what="the first response image went")
        echo.response = add_response_publication(link.server, link.control_port, echo.image)
        assert echo.response.session_id != first_session
        wait_for(lambda: responses.images and echo.response.is_connected, timeout=10,
                 what="the second response stream connected")
        assert [i.session_id for i in responses.images] == [echo.response.session_id]
        _exchange([(request_publication, collector, 500)], [echo], 500)
        echo.requests.assert_exactly(1000)
        collector.assert_exactly(1000)


def test_a_response_channel_over_ipv6(launch) -> None:
    """The response subscription binds the wildcard of its control address's IP version, and
    the response publication learns an IPv6 client: 200 requests answered over [::1]."""
    server_driver, client_driver = launch(), launch()
    port, control_port = free_port(), free_port()
    with Client.connect(server_driver.directory) as server, \
            Client.connect(client_driver.directory) as client:
        requests = server.add_subscription(f"aeron:udp?endpoint=[::1]:{port}", REQUESTS)
        responses = add_response_subscription(client, control_port, host="[::1]")
        request_publication = add_request_publication(client, port, responses, host="[::1]")
        wait_for(lambda: requests.images, timeout=10, what="the request image")
        [image] = requests.images
        echo = _Echo(image, add_response_publication(server, control_port, image, host="[::1]"))
        wait_for(lambda: responses.images and echo.response.is_connected, timeout=10,
                 what="the response stream connected")
        assert responses.images[0].source_identity == f"::1:{control_port}"
        collector = Collector(responses)
        _exchange([(request_publication, collector, 0)], [echo], 200)
        collector.assert_exactly(200)


class _Connected(NamedTuple):
    """A request stream to the server and its response stream back, connected."""

    server_driver: MediaDriver
    client_driver: MediaDriver
    server: Client  # the server's client, of the server's driver
    control_port: int  # the response publication's control port at the server
    nat: _Nat | None  # in front of the client's response subscription, if any
    responses: Subscription  # the client's response subscription
    request_publication: Publication  # the client's
    echo: _Echo  # the server's answer to the request image


@contextlib.contextmanager
def _connected(launch, *, through_nat: bool = False) -> Iterator[_Connected]:
    """A server's and a client's driver: a request stream to the server and a response
    stream back (through a NAT in front of the client's response subscription if
    ``through_nat``), both connected.  The NAT is closed at the end."""
    server_driver, client_driver = launch(), launch()
    port, control_port = free_port(), free_port()
    nat = _Nat(("127.0.0.1", control_port)) if through_nat else None
    try:
        with Client.connect(server_driver.directory) as server, \
                Client.connect(client_driver.directory) as client:
            requests = server.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}",
                                               REQUESTS)
            responses = add_response_subscription(client, nat.port if nat else control_port)
            request_publication = add_request_publication(client, port, responses)
            [echo] = _answer(server, requests, control_port, 1)
            wait_for(lambda: responses.images and echo.response.is_connected
                     and request_publication.is_connected, timeout=10,
                     what="the response stream connected")
            yield _Connected(server_driver, client_driver, server, control_port, nat, responses,
                             request_publication, echo)
    finally:
        if nat:
            nat.close()


def test_a_nat_rebind_mid_stream_moves_the_response_stream_to_the_new_port(launch) -> None:
    """The client's NAT gives its response subscription a new outside port mid-stream (the
    old one drops what still reaches it): the response publication takes the new port from
    the client's next SMs (same receiver id), and the stream goes on exactly once, in order,
    on the same image."""
    with _connected(launch, through_nat=True) as link:
        nat, responses, request_publication, echo = (link.nat, link.responses,
                                                     link.request_publication, link.echo)
        [image] = responses.images
        collector = Collector(responses)
        _exchange([(request_publication, collector, 0)], [echo], 500)
        nat.rebind()
        _exchange([(request_publication, collector, 500)], [echo], 1500)
        collector.assert_exactly(2000)
        assert [i.session_id for i in responses.images] == [image.session_id]


def test_a_forged_setup_request_does_not_take_the_response_stream(launch) -> None:
    """Someone who knows the response session sends its publication setup-eliciting SMs of
    another receiver id from elsewhere: the publication keeps its live client (counting
    them UNMATCHED_STATUS_MESSAGES) and the stream goes on exactly once, in order."""
    with _connected(launch) as link, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as forger:
        server_driver, control_port = link.server_driver, link.control_port
        responses, request_publication, echo = (link.responses, link.request_publication,
                                                link.echo)
        collector = Collector(responses)
        _exchange([(request_publication, collector, 0)], [echo], 300)
        forged = StatusMessage(echo.response.session_id, RESPONSES, 0, 0, 0, 0x5EED,
                               SM_SEND_SETUP_FLAG).encode()
        forger.bind(("127.0.0.1", 0))
        unmatched = counters_of(server_driver)["UNMATCHED_STATUS_MESSAGES"]
        for _ in range(3):
            forger.sendto(forged, ("127.0.0.1", control_port))
        wait_for(lambda: counters_of(server_driver)["UNMATCHED_STATUS_MESSAGES"]
                 >= unmatched + 3, timeout=5, what="the forged SMs dropped")
        _exchange([(request_publication, collector, 300)], [echo], 1000)
        collector.assert_exactly(1300)
        forger.setblocking(False)
        with pytest.raises(BlockingIOError):
            forger.recv(65536)  # nothing of the stream came to the forger


def test_an_image_lost_while_its_response_publication_stays_is_asked_for_again(
        launch) -> None:
    """Everything between the client and the server's response publication is dropped long
    enough for the client's response image to time out (the publication stays open); once
    the path is back, the client's endpoint asks for the session again and a new image of
    it carries the exchange on."""
    with _connected(launch, through_nat=True) as link:
        nat, responses, request_publication, echo = (link.nat, link.responses,
                                                     link.request_publication, link.echo)
        session_id = echo.response.session_id
        _exchange([(request_publication, Collector(responses), 0)], [echo], 200)
        nat.blocked = True
        wait_for(lambda: not responses.images and not echo.response.is_connected,
                 timeout=10, what="the response image went")
        nat.blocked = False
        wait_for(lambda: responses.images and echo.response.is_connected, timeout=10,
                 what="the response stream back")
        assert [i.session_id for i in responses.images] == [session_id]
        collector = Collector(responses)
        _exchange([(request_publication, collector, 200)], [echo], 300)
        collector.assert_exactly(300, first=200)


# -- response channels on encrypted streams (docs/CHANNELS.md §7.6, §7.8) ---------------------
def _keyed_driver(launch, keys_dir: Path, keys: list[tuple[int, bytes]] | None = None):
    """A driver whose keys_dir holds key ``k`` (KEY_A as id 1 unless ``keys`` says)."""
    write_keys(keys_dir, "k", [(1, KEY_A)] if keys is None else keys)
    return launch(keys_dir=str(keys_dir))


_HANDSHAKE_LENGTHS = {EXT_TYPE_HANDSHAKE_INIT: HANDSHAKE_INIT_LENGTH,
                      EXT_TYPE_HANDSHAKE_ANSWER: HANDSHAKE_ANSWER_LENGTH,
                      EXT_TYPE_HANDSHAKE_CONFIRM: HANDSHAKE_CONFIRM_LENGTH}


def _sealed(datagram: bytes) -> bool:
    """Whether ``datagram`` is one sealed datagram (§7.8's clear header), or one of the
    handshake's at its exact length (an ephemeral public key and sealed payloads), nothing
    else."""
    if len(datagram) < SEALED_OVERHEAD:
        return False
    length, _, _, kind, magic, extension, _, _, _ = SEALED_HEADER.unpack_from(datagram)
    if length != len(datagram) or kind != HDR_TYPE_EXT or magic != EXT_MAGIC:
        return False
    return extension == EXT_TYPE_SEALED or _HANDSHAKE_LENGTHS.get(extension) == length


def test_a_keyed_request_and_response_exchange_is_sealed_both_ways_and_carried_once(
        launch, tmp_path: Path) -> None:
    """Request and response channels with ``key=`` on both drivers: 6,000 requests and
    6,000 responses (64 KiB terms rotate about 50 times each way), each exactly once and in
    order; every datagram between the client's response subscription and the server's
    response publication (through a NAT that keeps them) is a sealed one, both ways, and
    neither driver drops or refuses one."""
    server_driver = _keyed_driver(launch, tmp_path / "server-keys")
    client_driver = _keyed_driver(launch, tmp_path / "client-keys")
    port, control_port = free_port(), free_port()
    nat = _Nat(("127.0.0.1", control_port))
    try:
        with Client.connect(server_driver.directory) as server, \
                Client.connect(client_driver.directory) as client:
            requests = server.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}|key=k",
                                               REQUESTS)
            responses = add_response_subscription(client, nat.port, key="k")
            request_publication = add_request_publication(client, port, responses, key="k")
            [echo] = _answer(server, requests, control_port, 1, key="k")
            wait_for(lambda: responses.images and echo.response.is_connected
                     and request_publication.is_connected, timeout=10,
                     what="the keyed response stream connected")
            collector = Collector(responses)
            _exchange([(request_publication, collector, 0)], [echo], 6000)
            echo.requests.assert_exactly(6000)
            collector.assert_exactly(6000)
            assert echo.response.position > 6 * 64 * 1024
    finally:
        nat.close()
    assert len(nat.datagrams) > 1000
    assert all(_sealed(d) for d in nat.datagrams), "a datagram of the response path in clear"
    for driver in (server_driver, client_driver):
        counts = counters_of(driver)
        assert counts["INVALID_PACKETS"] == 0 and counts["SEND_ERRORS"] == 0
        assert drops(driver) == dict.fromkeys(DROPS, 0)


def test_a_peer_without_the_key_gets_no_answer_and_its_datagrams_are_counted(
        launch, tmp_path: Path) -> None:
    """A server answers keyed requests: a client with the key is answered; a plain client and
    one with other key bytes under the same id send the same requests to the same port and
    get nothing, no request image and no response stream, their datagrams counted at the
    server as plain (CRYPTO_PLAIN_DROPS) and unopenable (CRYPTO_AUTH_DROPS); plain
    setup-eliciting SMs for the response session, sent to the server's control port from
    elsewhere, are plain drops too and take nothing: the keyed exchange goes on once."""
    server_driver = _keyed_driver(launch, tmp_path / "server-keys")
    client_driver = _keyed_driver(launch, tmp_path / "client-keys")
    wrong_driver = _keyed_driver(launch, tmp_path / "wrong-keys", [(1, KEY_B)])
    plain_driver = launch()
    port, control_port = free_port(), free_port()
    with Client.connect(server_driver.directory) as server, \
            Client.connect(client_driver.directory) as client, \
            Client.connect(wrong_driver.directory) as wrong, \
            Client.connect(plain_driver.directory) as plain, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as forger:
        requests = server.add_subscription(f"aeron:udp?endpoint=127.0.0.1:{port}|key=k",
                                           REQUESTS)
        responses = add_response_subscription(client, control_port, key="k")
        request_publication = add_request_publication(client, port, responses, key="k")
        [echo] = _answer(server, requests, control_port, 1, key="k")
        wait_for(lambda: responses.images and echo.response.is_connected, timeout=10,
                 what="the keyed response stream connected")
        collector = Collector(responses)
        _exchange([(request_publication, collector, 0)], [echo], 300)

        plain_drops = drops(server_driver)["CRYPTO_PLAIN_DROPS"]
        forged = StatusMessage(echo.response.session_id, RESPONSES, 0, 0, 0, 0x5EED,
                               SM_SEND_SETUP_FLAG).encode()
        forger.bind(("127.0.0.1", 0))
        for _ in range(3):
            forger.sendto(forged, ("127.0.0.1", control_port))
        wait_for(lambda: drops(server_driver)["CRYPTO_PLAIN_DROPS"] >= plain_drops + 3,
                 timeout=10, what="the forged SMs dropped and counted")
        before = drops(server_driver)
        others_before = counters_of(server_driver)
        outsiders = []
        for outsider, key in ((wrong, "k"), (plain, None)):
            outsider_responses = add_response_subscription(outsider, free_port(), key=key)
            outsiders.append((outsider_responses, add_request_publication(
                outsider, port, outsider_responses, key=key)))
        # The plain peer's datagrams are plain; the other key's are sealed under a sender id
        # no exchange gave (its handshakes fail: §7.8), or fail to open.
        other_key = ("CRYPTO_AUTH_DROPS", "CRYPTO_AWAITING_HANDSHAKE_DROPS",
                     "CRYPTO_HANDSHAKE_FAILED_DROPS")
        wait_for(lambda: (drops(server_driver)["CRYPTO_PLAIN_DROPS"]
                          >= before["CRYPTO_PLAIN_DROPS"] + 3
                          and sum(counters_of(server_driver)[name] - others_before[name]
                                  for name in other_key) >= 3),
                 timeout=10, what="the outsiders' requests dropped and counted")
        _exchange([(request_publication, collector, 300)], [echo], 1000)
        collector.assert_exactly(1300)
        assert [image.correlation_id for image in requests.images] == [
            echo.image.correlation_id]
        for outsider_responses, outsider_requests in outsiders:
            assert not outsider_responses.images and not outsider_requests.is_connected
        forger.setblocking(False)
        with pytest.raises(BlockingIOError):
            forger.recv(65536)  # nothing of the stream came to the forger


def test_a_request_and_its_responses_under_different_keys_are_refused_by_name(
        launch, tmp_path: Path) -> None:
    """A request stream and its responses carry the same key= (or none): a request
    publication whose response subscription is plain, under another key, or keyed where the
    request is plain, and a response publication plain, under another key, or keyed for a
    plain request image: each refused naming ``key``, and nothing is made."""
    server_keys, client_keys = tmp_path / "server-keys", tmp_path / "client-keys"
    server_driver = _keyed_driver(launch, server_keys)
    client_driver = _keyed_driver(launch, client_keys)
    for directory in (server_keys, client_keys):
        write_keys(directory, "other", [(2, KEY_B)])
    keyed_port, plain_port = free_port(), free_port()
    with Client.connect(server_driver.directory) as server, \
            Client.connect(client_driver.directory) as client:
        keyed_requests = server.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{keyed_port}|key=k", REQUESTS)
        plain_requests = server.add_subscription(
            f"aeron:udp?endpoint=127.0.0.1:{plain_port}", REQUESTS)
        subscriptions = {key: add_response_subscription(client, free_port(), key=key)
                         for key in ("k", "other", None)}
        for request_key, response_key in (("k", None), ("k", "other"), (None, "k")):
            port = keyed_port if request_key else plain_port
            with pytest.raises(ChannelRejectedError, match="a request and its responses "
                               "carry the same key=") as refused:
                add_request_publication(client, port, subscriptions[response_key],
                                     key=request_key)
            assert refused.value.part == "key", (request_key, response_key)
        assert publisher_limits(client_driver) == 0

        keyed = add_request_publication(client, keyed_port, subscriptions["k"], key="k")
        plain = add_request_publication(client, plain_port, subscriptions[None])
        wait_for(lambda: keyed_requests.images and plain_requests.images and keyed.is_connected
                 and plain.is_connected, timeout=10, what="both request streams")
        for image, response_key, port in ((keyed_requests.images[0], None, keyed_port),
                                          (keyed_requests.images[0], "other", keyed_port),
                                          (plain_requests.images[0], "k", plain_port)):
            with pytest.raises(ChannelRejectedError, match="the request stream it answers"
                               ) as refused:
                add_response_publication(server, free_port(), image, key=response_key)
            assert refused.value.part == "key", (port, response_key)
        assert publisher_limits(server_driver) == 0
