"""Forged control on a shared segment (issue 59, docs/DRIVER.md §5.7): three namespace
hosts, a publisher (host 1), its real receiver (host 2) and an attacker (host 3), a real driver
on each of the first two.  The attacker learns what it needs as a host on the path would (the
receiver's id from one of its status messages, sniffed at the publisher's host; the session's
terms from the stream), then sends, from its own address and, through a raw socket, from the
real receiver's address and port:

* status messages of a new receiver frozen at an old position (``fc=min``: before admission),
  and status messages naming the real receiver from its own address;
* NAK-strength rate signals claiming a full image;
* ERR frames naming the real receiver;
* 16,000 NAKs (each way) for ranges just behind where the stream is.

The publisher's unicast socket is connected to its receiver: the kernel drops what the
attacker sends from its own address, which is why the spoofed frames are the attack here
(tests/test_control_binding.py drives the address checks themselves).

Meanwhile the publisher offers 1 KiB messages at a steady 4,000 a second.  Proof: every
message arrives once and in order, the publisher is never NOT_CONNECTED nor held for half a
receiver timeout (the rates under each attack are printed as figures), the NAK flood costs at
most the retransmit budget, each drop is counted by its cause, and the ERRs' text reaches the
driver's error log escaped, a few lines at most.  The figures go to the test's output (``-s``).

Needs root (CI runs as root): skips without it, fails under CI=true.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from helpers import NETWORK_SETTINGS, Collector, counters_labelled, counters_of, message, wait_for

from slipstream.client import NOT_CONNECTED, Client, control
from slipstream.client.frames import ErrorFrame, RateSignal, StatusMessage
from slipstream.daemon.reports.error_log import read_error_log

pytestmark = pytest.mark.timeout(240)

PORT = 40125
RATE = 4000  # messages a second, 1 KiB each
PHASE_S = 2.0
#: The longest a forgery may hold the publisher (s): half the receiver timeout below, so a
#: forged frozen receiver (held until it times out) fails, while a loaded machine's slow
#: loop (tens of ms between offers) passes.
HELD_BOUND_S = 2.5
FRAME = 1056  # a 1 KiB message and its header
TERM = 1 << 20
SETTINGS = {**NETWORK_SETTINGS, "publication_connection_timeout": "5s",
            "image_liveness_timeout": "5s", "flow_control_receiver_timeout": "5s"}

#: Run in the publisher's host: the first status message to ``port`` from ``source_ip``,
#: printed as JSON (its receiver id and source port).
SNIFFER = r"""
import json, socket, struct, sys
from slipstream.client.frames import StatusMessage, decode
port, source_ip = int(sys.argv[1]), sys.argv[2]
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
s.settimeout(10)
while True:
    packet, (ip, _) = s.recvfrom(65536)
    header = (packet[0] & 0x0F) * 4
    sport, dport = struct.unpack_from("!HH", packet, header)
    if ip != source_ip or dport != port:
        continue
    frame = decode(packet[header + 8:])
    if isinstance(frame, StatusMessage) and not frame.is_setup_request:
        print(json.dumps({"receiver_id": frame.receiver_id, "port": sport}))
        break
"""

#: Run in the attacker's host: ``count`` datagrams cycling through ``frames`` (hex) at
#: ``rate`` a second to ``target``, from its own address or (``spoof``) another's, written
#: whole (IP header included) through a raw socket.
ATTACKER = r"""
import json, socket, struct, sys, time
args = json.loads(sys.argv[1])
frames = [bytes.fromhex(h) for h in args["frames"]]
target, spoof, count, rate = tuple(args["target"]), args["spoof"], args["count"], args["rate"]
if spoof:
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    source, destination = socket.inet_aton(spoof[0]), socket.inet_aton(target[0])
    def send(payload):
        udp = struct.pack("!HHHH", spoof[1], target[1], 8 + len(payload), 0) + payload
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, source,
                         destination)
        s.sendto(ip + udp, (target[0], 0))
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    def send(payload):
        s.sendto(payload, target)
track = args.get("track")  # NAKs just behind where the sender is now (its snd-pos)
freeze = args.get("freeze")  # SMs of a new receiver at where the sender was at the start
if track:
    from slipstream.client.counters import CountersFile
    from slipstream.client.frames import Nak, StatusMessage
    sent = CountersFile(track["counters"], writable=False)
    def sender_position():
        return sent.get(track["counter_id"])
    if freeze:
        now = sender_position()
        now -= now % track["term"] % 1056
        frames = [StatusMessage(track["session"], track["stream"],
                                track["term_id"] + now // track["term"], now % track["term"],
                                freeze["window"], freeze["receiver_id"], 0).encode()]
        track = None
start = time.monotonic()
for i in range(count):
    if track:
        back = sender_position() - (1 + i % 32) * 8 * 1056
        offset = back % track["term"] // 1056 * 1056
        send(Nak(track["session"], track["stream"], track["term_id"] + back // track["term"],
                 offset, 8 * 1056).encode())
    else:
        send(frames[i % len(frames)])
    delay = start + (i + 1) / rate - time.monotonic()
    if delay > 0:
        time.sleep(delay)
"""


def sender_position_counter(driver, stream_id: int) -> dict[str, object]:
    """Where an attacker process reads the snd-pos of ``driver``'s one publication of
    ``stream_id``: its counters file and the counter's id."""
    [info] = [info for info in counters_labelled(driver, "snd-pos")
              if info.stream_id == stream_id]
    return {"counters": str(driver.view / control.COUNTERS_FILE), "counter_id": info.counter_id}


class Stream:
    """The publisher's paced offers and the receiver's collector, run a phase at a time."""

    def __init__(self, publication, collector: Collector) -> None:
        self.publication = publication
        self.collector = collector
        self.sent = 0
        self.not_connected = 0
        #: The longest the publication refused a message that was due (s): a forged SM of a
        #: frozen receiver, or forged rate signals, would hold it up to a receiver timeout.
        self.longest_held_s = 0.0

    def run(self, seconds: float, attack: subprocess.Popen | None = None) -> float:
        """Offer at RATE for ``seconds`` (and until ``attack`` ended), polling; returns the
        messages a second the publication took (a figure: the machine's load moves it)."""
        start = time.monotonic()
        sent = self.sent
        held_since: float | None = None
        while True:
            now = time.monotonic()
            if now - start >= seconds and (attack is None or attack.poll() is not None):
                break
            due = int((now - start) * RATE) + sent
            while self.sent < due:
                result = self.publication.offer(message(self.sent, 1024))
                if result == NOT_CONNECTED:
                    self.not_connected += 1
                if result < 0:
                    held_since = now if held_since is None else held_since
                    self.longest_held_s = max(self.longest_held_s, now - held_since)
                    break
                held_since = None
                self.sent += 1
            if not self.collector.poll():
                time.sleep(0.0002)
        return (self.sent - sent) / (time.monotonic() - start)

    def read_the_rest(self, timeout: float = 20.0) -> None:
        """Poll until every message sent arrived (within ``timeout`` s): each exactly once,
        in order."""
        deadline = time.monotonic() + timeout
        while len(self.collector.seen) < self.sent:
            assert time.monotonic() < deadline, (len(self.collector.seen), self.sent)
            self.collector.poll()
        self.collector.assert_exactly(self.sent)


def attack(host, frames: list[bytes], target: tuple[str, int], *, count: int, rate: float,
           spoof: tuple[str, int] | None = None, track: dict | None = None,
           freeze: dict | None = None) -> subprocess.Popen:
    args = json.dumps({"frames": [f.hex() for f in frames], "target": list(target),
                       "spoof": list(spoof) if spoof else None, "count": count, "rate": rate,
                       "track": track, "freeze": freeze})
    return host.popen(sys.executable, "-c", ATTACKER, args)


def test_forged_control_from_the_segment_changes_nothing(needs_hosts) -> None:
    from slipstream.sim.real.hosts import namespace_hosts

    with namespace_hosts(3) as hosts:
        publisher_driver = hosts.start_driver(1, **SETTINGS)
        subscriber_driver = hosts.start_driver(2, **SETTINGS)
        receiver = (hosts[2].address, PORT)
        uri = (f"aeron:udp?endpoint={receiver[0]}:{PORT}|term-length=1m|fc=min"
               f"|rc=nak-strength")
        with Client.connect(publisher_driver.directory) as a, \
                Client.connect(subscriber_driver.directory) as b:
            subscription = b.add_subscription(uri, 7)
            publication = a.add_publication(uri, 7)
            wait_for(lambda: publication.is_connected and subscription.images, timeout=15,
                     what="the stream connected")
            [image] = subscription.images
            publisher_ip, send_port = image.source_identity.rsplit(":", 1)
            target = (publisher_ip, int(send_port))
            stream = Stream(publication, Collector(subscription))
            sniffer = hosts[1].popen(sys.executable, "-c", SNIFFER, str(target[1]), receiver[0],
                                     stdout=subprocess.PIPE, text=True)
            stream.run(1.0)
            out, _ = sniffer.communicate(timeout=15)
            receiver_id = json.loads(out)["receiver_id"]
            session, term_id0 = image.session_id, image.initial_term_id

            def at(position: int) -> tuple[int, int]:
                """(term id, offset) of the frame at or before ``position``."""
                return term_id0 + position // TERM, position % TERM // FRAME * FRAME

            figures: dict[str, object] = {}
            before = counters_of(publisher_driver)
            baseline = stream.run(PHASE_S)
            baseline_counters = counters_of(publisher_driver)
            figures["rate without attacks (msg/s)"] = round(baseline)

            # 1. fc=min: a newcomer frozen at an old position, from the attacker's own
            # address; and SMs naming the real receiver, frozen, from the same.
            old = at(1 << 16)
            frozen = StatusMessage(session, 7, *old, 128 * 1024, 0xBAD, 0).encode()
            named = StatusMessage(session, 7, *old, 0, receiver_id, 0).encode()
            attacker = attack(hosts[3], [frozen, named], target, count=400, rate=200)
            figures["rate under forged SMs"] = round(stream.run(PHASE_S, attacker))

            # 2. NAK-strength signals claiming a full image, spoofed and not.
            signal = RateSignal(session, 7, 1000, 100, 1024).encode()
            spoofed = attack(hosts[3], [signal], target, count=400, rate=200, spoof=receiver)
            own = attack(hosts[3], [signal], target, count=400, rate=200)
            figures["rate under forged rate signals"] = round(stream.run(PHASE_S, spoofed))
            own.wait(timeout=10)

            # 3. ERRs naming the real receiver, spoofed and not.
            err = ErrorFrame(session, 7, receiver_id, 1, "go away\n\x1b[31mERROR").encode()
            spoofed = attack(hosts[3], [err], target, count=300, rate=150, spoof=receiver)
            own = attack(hosts[3], [err], target, count=300, rate=150)
            figures["rate under forged ERRs"] = round(stream.run(PHASE_S, spoofed))
            own.wait(timeout=10)

            # 4. 16,000 NAKs for the last quarter term, spoofed as the receiver, and 16,000
            # from the attacker's own address.
            # Behind the sender's own position (its counter, in /dev/shm, which every host
            # shares), however a loaded machine paces the stream: NAKs ahead of it would ask
            # for nothing and cost no budget.
            track = {**sender_position_counter(publisher_driver, 7),
                     "term": TERM, "term_id": term_id0, "session": session, "stream": 7}
            before_flood = counters_of(publisher_driver)
            spoofed = attack(hosts[3], [], target, count=16_000, rate=8000, spoof=receiver,
                             track=track)
            own = attack(hosts[3], [], target, count=16_000, rate=8000, track=track)
            sent_before = stream.sent
            figures["rate under the NAK flood"] = round(stream.run(PHASE_S, spoofed))
            own.wait(timeout=20)
            stream.run(0.5)
            after = counters_of(publisher_driver)

            # The rest of the stream arrives.
            stream.read_the_rest()
            refusals = [e for e in read_error_log(publisher_driver.directory)
                        if "refused the image" in e.message]

        def extra(a: dict, b: dict, data_messages: int) -> int:
            """Bytes sent beyond the new data (retransmissions, control)."""
            return b["BYTES_SENT"] - a["BYTES_SENT"] - data_messages * FRAME

        baseline_messages = int(baseline * PHASE_S)
        figures["bytes beyond data, no attack"] = extra(before, baseline_counters,
                                                        baseline_messages)
        figures["bytes beyond data, NAK flood"] = extra(before_flood, after,
                                                        stream.sent - sent_before)
        drops = {k: v for k, v in after.items() if k.endswith("_DROPS") and v}
        figures["drops"] = drops
        figures["NAKs received"] = after["NAK_MESSAGES_RECEIVED"] - before_flood[
            "NAK_MESSAGES_RECEIVED"]
        figures["attackers' exit"] = [spoofed.returncode, own.returncode]
        print("\nforged control figures:", json.dumps(figures, indent=1))

        assert stream.not_connected == 0
        # The rates are figures (bench/hostile_floods.py); what the forgeries must not do is
        # hold the publisher: a frozen receiver's SMs would, up to its receiver timeout.
        assert stream.longest_held_s < HELD_BOUND_S, (stream.longest_held_s, figures)
        # A cut, if any, was the real receiver's (it signalled).
        assert after["RATE_CUTS"] <= counters_of(subscriber_driver)["RATE_SIGNALS_SENT"]
        # What came from the receiver's own address (spoofed) was dropped by its cause; what
        # came from the attacker's own address never reached the driver: a unicast
        # publication's socket is connected to its receiver, and the kernel drops the rest.
        for cause in ("RATE_SIGNAL_UNBACKED_DROPS", "ERR_CONTRADICTED_DROPS",
                      "NAK_BUDGET_DROPS", "REMOTE_TEXT_SUPPRESSED_DROPS"):
            assert drops.get(cause, 0) > 0, (cause, drops)
        # The forged ERRs' text reached the log escaped, a few lines for the host at most.
        [refusal] = refusals
        assert refusal.count <= 5 and "\\x1b[31mERROR" in refusal.message, refusal
        assert "\n" not in refusal.message and "\x1b" not in refusal.message
        # The flood cost at most the budget: a term window (512 KiB) to start, one more per
        # second of it, and what the stream itself earned (100 % of its data).
        flood_s = PHASE_S + 0.5 + 2.0
        allowed = (TERM // 2) * (2 + flood_s) + (stream.sent - sent_before) * FRAME
        assert figures["bytes beyond data, NAK flood"] <= allowed, figures


def test_forged_control_from_the_attackers_own_address_on_multicast(needs_hosts) -> None:
    """A multicast publication's control socket (its control group) takes datagrams from
    anyone: here the attacker sends from its own address, with no raw socket.  NAKs, rate
    signals and ERRs naming the real receiver are dropped by their causes
    (NAK_UNKNOWN_SOURCE_DROPS, RATE_SIGNAL_UNKNOWN_SOURCE_DROPS, ERR_SOURCE_MISMATCH_DROPS),
    SMs naming the real receiver too (SM_SOURCE_MISMATCH_DROPS); then SMs of a new receiver
    at the stream's position when it starts, frozen there, are never admitted under fc=min
    (Aeron's rule alone, ``flow_control_admission_interval = 0``, takes it and the stream
    stalls for the receiver timeout): the publisher is never held for half the receiver
    timeout, no offer is NOT_CONNECTED, every message arrives once and in order."""
    from slipstream.sim.real.hosts import namespace_hosts

    with namespace_hosts(3) as hosts:
        publisher_driver = hosts.start_driver(1, **SETTINGS)
        subscriber_driver = hosts.start_driver(2, **SETTINGS)
        group, control_group = "224.0.9.1", ("224.0.9.2", PORT)
        uri = f"aeron:udp?endpoint={group}:{PORT}|term-length=1m"
        with Client.connect(publisher_driver.directory) as a, \
                Client.connect(subscriber_driver.directory) as b:
            subscription = b.add_subscription(f"{uri}|interface={hosts[2].address}", 8)
            publication = a.add_publication(
                f"{uri}|interface={hosts[1].address}|fc=min|rc=nak-strength", 8)
            wait_for(lambda: publication.is_connected and subscription.images, timeout=15,
                     what="the stream connected")
            [image] = subscription.images
            stream = Stream(publication, Collector(subscription))
            sniffer = hosts[1].popen(sys.executable, "-c", SNIFFER, str(PORT),
                                     hosts[2].address, stdout=subprocess.PIPE, text=True)
            stream.run(1.0)
            out, _ = sniffer.communicate(timeout=15)
            receiver_id = json.loads(out)["receiver_id"]
            session, term_id0 = image.session_id, image.initial_term_id
            figures: dict[str, object] = {"rate without attacks (msg/s)": round(
                stream.run(PHASE_S))}

            track = {**sender_position_counter(publisher_driver, 8), "term": TERM,
                     "term_id": term_id0, "session": session, "stream": 8}
            naks = attack(hosts[3], [], control_group, count=16_000, rate=8000, track=track)
            signal = RateSignal(session, 8, 1000, 100, 1024).encode()
            err = ErrorFrame(session, 8, receiver_id, 1, "go away").encode()
            position = (term_id0 + (1 << 16) // TERM, (1 << 16) % TERM)
            named = StatusMessage(session, 8, *position, 0, receiver_id, 0).encode()
            others = attack(hosts[3], [signal, err, named], control_group, count=600, rate=300)
            figures["rate under forged NAKs, signals, ERRs, SMs"] = round(
                stream.run(PHASE_S, naks))
            others.wait(timeout=10)
            # A newcomer at the front when it starts (as Aeron would take it), then frozen.
            newcomer = attack(hosts[3], [], control_group, count=400, rate=200, track=track,
                              freeze={"receiver_id": 0xBAD, "window": 128 * 1024})
            figures["rate under a frozen newcomer"] = round(stream.run(PHASE_S, newcomer))
            after = counters_of(publisher_driver)
            stream.read_the_rest()

        drops = {k: v for k, v in after.items() if k.endswith("_DROPS") and v}
        figures["drops"] = drops
        print("\nforged control figures (multicast):", json.dumps(figures, indent=1))
        assert stream.not_connected == 0
        assert stream.longest_held_s < HELD_BOUND_S, (stream.longest_held_s, figures)
        assert after["RATE_CUTS"] <= counters_of(subscriber_driver)["RATE_SIGNALS_SENT"]
        assert after["RETRANSMITS_SENT"] <= counters_of(subscriber_driver)["NAK_MESSAGES_SENT"]
        for cause in ("NAK_UNKNOWN_SOURCE_DROPS", "RATE_SIGNAL_UNKNOWN_SOURCE_DROPS",
                      "ERR_SOURCE_MISMATCH_DROPS", "SM_SOURCE_MISMATCH_DROPS"):
            assert drops.get(cause, 0) > 0, (cause, drops)
