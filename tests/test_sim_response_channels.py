"""Response channels (docs/CHANNELS.md §7.6) in the simulator, as tests/test_response_channels.py
runs them between driver processes: host 2, the client, sends requests to host 1, the
server, and its response subscription (``control-mode=response``) receives the answers on a
port its driver picked, which the server's response publication learns from the status
messages sent from there.  Both drivers are the simulator's; the applications are this
module's, which append with the C appender and read with the client's ``Image``, beside the
scenario's own stream.
"""

from __future__ import annotations

import struct
from typing import Any

from slipstream.client import control
from slipstream.client._native import ffi, lib
from slipstream.client.image import Image
from slipstream.client.logbuffer import LogBuffer, new_appender
from slipstream.sim.capture import Capture
from slipstream.sim.host import SimHost
from slipstream.sim.network import LinkFaults
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import Scenario
from slipstream.sim.transport import RECEIVE_PORT_BASE

MS = 1_000_000
S = 1_000_000_000
REQUESTS, RESPONSES = 2001, 2002
SERVER, CLIENT = "10.0.0.1", "10.0.0.2"
PORT, CONTROL_PORT = 40300, 40301
MESSAGE = struct.Struct("<I60x")  # a sequence number in 64 bytes


class _Side:
    """One host's application for the exchange: its commands, the events for its streams
    (the scenario's own go on to its host), its publications and its readers."""

    def __init__(self, host: SimHost) -> None:
        self.host = host
        assert host.driver is not None
        self.driver = host.driver
        self.events: list[dict[str, Any]] = []
        forward = self.driver._on_message

        def on_message(message: dict[str, Any]) -> None:
            if message.get("stream_id") in (REQUESTS, RESPONSES):
                self.events.append(message)
            elif message.get("type") != control.UNAVAILABLE_IMAGE or not any(
                    e["correlation_id"] == message["correlation_id"] for e in self.events):
                forward(message)

        self.driver._on_message = on_message
        self.appenders: dict[int, Any] = {}
        self.received: list[int] = []

    def command(self, **message: Any) -> dict[str, Any]:
        return self.driver.command(message)

    def publish(self, channel: str, stream_id: int) -> dict[str, Any]:
        reply = self.command(type=control.ADD_PUBLICATION, channel=channel, stream_id=stream_id)
        log = LogBuffer(reply["log_file"])
        limit = self.driver.counters.address(reply["publication_limit_counter_id"])
        self.appenders[stream_id] = (log, new_appender(log, limit))
        return reply

    def offer(self, stream_id: int, seq: int) -> bool:
        data = bytearray(MESSAGE.pack(seq))
        appended = lib.ss_offer(self.appenders[stream_id][1], ffi.from_buffer(data),
                                len(data)) > 0
        self.host.wake()
        return appended

    def image(self, stream_id: int) -> dict[str, Any] | None:
        return next((e for e in self.events if e["type"] == control.AVAILABLE_IMAGE
                     and e["stream_id"] == stream_id), None)

    def reader(self, event: dict[str, Any]) -> Image:
        cell = self.driver.counters.address(event["subscriber_position_counter_id"])
        log = self.driver.network.image_log(event["correlation_id"])
        assert log is not None
        return Image(log.borrowed(), cell, join_position=event["join_position"],
                     correlation_id=event["correlation_id"])

    def read(self, reader: Image) -> int:
        def on_message(data: memoryview, _header: object) -> None:
            self.received.append(MESSAGE.unpack_from(data)[0])

        read = reader.poll(on_message, 256)
        if read:
            self.host.wake()  # the subscriber position moved: the window opens
        return read

    def close(self) -> None:
        for log, _appender in self.appenders.values():
            log.close()


def _until(sim: Simulation, done, *, limit_ns: int = 10 * S, step_ns: int = 1 * MS,
           work=lambda: None) -> None:
    """Run the network in steps of ``step_ns``, ``work()`` between them, until ``done()``."""
    while not done():
        assert sim.loop.now_ns < limit_ns, "the exchange did not finish in virtual time"
        work()
        sim.run_until(sim.loop.now_ns + step_ns, stop_when_complete=False)


def test_a_request_and_response_exchange_reaches_the_port_the_client_sends_from() -> None:
    """The client's response subscription asks the server's control address from a port its
    driver picked (no endpoint of its own); the server's response publication, made for the
    request image, learns that port from the status messages and sends there.  2,000
    requests and their 2,000 echoes cross 64 KiB terms (each rotating about twice) over
    links with a 1 % loss, each exactly once and in order."""
    scenario = Scenario(hosts=2, messages=0, seed=5, max_virtual_ns=60 * S,
                        faults=LinkFaults(delay_ms=1.0, loss=0.01))
    with Simulation(scenario) as sim:
        capture = Capture().attach(sim.network)
        sim.run_until(1 * MS, stop_when_complete=False)
        server, client = _Side(sim.host(1)), _Side(sim.host(2))
        try:
            server.command(type=control.ADD_SUBSCRIPTION, stream_id=REQUESTS,
                           channel=f"aeron:udp?endpoint={SERVER}:{PORT}")
            responses = client.command(
                type=control.ADD_SUBSCRIPTION, stream_id=RESPONSES,
                channel=f"aeron:udp?control-mode=response|control={SERVER}:{CONTROL_PORT}")
            client.publish(f"aeron:udp?endpoint={SERVER}:{PORT}|term-length=64k"
                           f"|response-correlation-id={responses['registration_id']}", REQUESTS)
            _until(sim, lambda: server.image(REQUESTS) is not None)
            request_image = server.image(REQUESTS)
            assert request_image is not None
            published = server.publish(
                f"aeron:udp?control-mode=response|control={SERVER}:{CONTROL_PORT}"
                f"|term-length=64k|response-correlation-id={request_image['correlation_id']}",
                RESPONSES)
            _until(sim, lambda: client.image(RESPONSES) is not None)
            response_image = client.image(RESPONSES)
            assert response_image is not None
            assert response_image["session_id"] == published["session_id"]
            assert response_image["source_identity"] == f"{SERVER}:{CONTROL_PORT}"
            requests, answers = server.reader(request_image), client.reader(response_image)
            count = 2_000
            sent = [0]
            echoed = [0]

            def work() -> None:
                while sent[0] < count and client.offer(REQUESTS, sent[0]):
                    sent[0] += 1
                server.read(requests)
                while echoed[0] < len(server.received) and server.offer(
                        RESPONSES, server.received[echoed[0]]):
                    echoed[0] += 1
                client.read(answers)

            _until(sim, lambda: len(client.received) >= count, work=work)
            assert server.received == list(range(count))
            assert client.received == list(range(count))
            # The response stream went to the port the client's subscription asked from.
            data = {r.dst for r in capture.select("DATA", src=SERVER)
                    if r.session_id == published["session_id"]}
            [(host, port)] = data
            assert host == CLIENT and RECEIVE_PORT_BASE < port
            asked_from = {r.src for r in capture.select("SM", src=CLIENT)
                          if r.dst == (SERVER, CONTROL_PORT)}
            assert asked_from == {(CLIENT, port)}
        finally:
            server.close()
            client.close()
