"""A legitimate stream under an attacker's floods (docs/SECURITY.md): its rate under
each flood as a ratio to its rate without one, in the same run.

Three namespace hosts on a segment that floods every frame (sim/real/hosts.py,
``shared_segment=True``), a driver with its defaults on hosts 1 and 2; host 3 is the attacker
(sim/real/attacker.py).  A publisher process offers 1 KiB messages at ``--rate`` a second (the
first program's loop: ``offer()``, retried while it is back-pressured) to a subscriber process
on host 2's driver, which counts what arrives each 100 ms.  Phases, each ``--phase`` seconds:

* unicast: quiet; SETUPs with 128 MiB terms at 10/s to the subscription's port; SETUPs with
  64 KiB terms at 250/s (2,500 in 10 s at the default phase);
* dynamic MDC (the same stream to a ``control-mode=dynamic`` publication the subscriber joins
  with ``control=``): quiet; 1,600 status messages from 200 spoofed source ports on the
  attacker's address (``--join-sms``), which the publisher would answer with the stream;
* encrypted unicast (``key=``, its session and term pinned, so that the attacker knows all of
  the stream but its key, as tests/test_hostile_network.py's): quiet; the SETUP floods; NAKs
  (4,000 a second), ERRs and rate signals spoofed as the receiver; DATA spoofed as the
  publisher; status messages of a receiver that tracks and then freezes, from the attacker's
  own address.

Printed per phase: messages a second delivered and the ratio to quiet (target: each flood
>= 0.9x), the CPU of the publisher's driver (cores; target: at most 0.3 of a core over
quiet), the longest client-seen driver heartbeat age, the subscriber driver's /dev/shm bytes
and images, the bytes that reached the attacker's spoofed ports (an iptables counter there:
the reflection), and the drops by cause.

    sudo .venv/bin/python -m bench.hostile_floods [--rate N] [--phase S] [--join-sms N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.idle_cost import cpu_s
from bench.ipc_throughput import machine

SIZE = 1024
STREAM = 21
PORT = 42100
CONTROL_PORT = 42110
BUCKET_S = 0.1
#: The encrypted run's stream, pinned so that the attacker can forge all of it but its key.
SESSION = 424242
TERM_ID = 1000
TERM_LENGTH = 1 << 20
KEY = bytes(range(32)).hex()


def _publisher(directory: str, channel: str, rate: float, stop: Any) -> None:
    from slipstream.client import Client

    with Client.connect(directory) as client:
        publication = client.add_publication(channel, STREAM)
        message = bytes(SIZE)
        start = time.monotonic()
        sent = 0
        while not stop.is_set():
            due = start + sent / rate
            now = time.monotonic()
            if due > now:
                time.sleep(min(due - now, 0.001))
                continue
            if publication.offer(message) > 0:
                sent += 1


def _subscriber(directory: str, channel: str, buckets: Any, heartbeat: Any, stop: Any) -> None:
    from slipstream.client import Client

    with Client.connect(directory) as client:
        subscription = client.add_subscription(channel, STREAM)
        count = [0]

        def handler(data: memoryview, header: object) -> None:
            count[0] += 1

        start = time.monotonic()
        worst = 0.0
        while not stop.is_set():
            subscription.poll(handler, 256)
            now = time.monotonic()
            index = int((now - start) / BUCKET_S)
            if index < len(buckets):
                buckets[index] = count[0]
            beat = client.counters.driver_heartbeat_ns
            worst = max(worst, (time.time_ns() - beat) / 1e9 if beat else 0.0)
            heartbeat.value = worst


def _shm_bytes(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


def _spoofed_bytes(host: Any) -> int:
    out = host.run("iptables", "-L", "INPUT", "-v", "-x", "-n").stdout
    text = out if isinstance(out, str) else out.decode()
    return sum(int(line.split()[1]) for line in text.splitlines()
               if "dpts:20000:20199" in line)


def _drops(directory: Path) -> dict[str, int]:
    result = subprocess.run([sys.executable, "-m", "slipstream.daemon.cli", "stat", "--once",
                             "--json", "--dir", str(directory)],
                            capture_output=True, text=True, timeout=30, check=True)
    snapshot = json.loads(result.stdout)
    return {k: v for k, v in snapshot["drops"].items() if v}


def _encrypted_floods(known: dict[str, Any], target: str,
                      phase: float) -> list[tuple[str, str, dict[str, Any]]]:
    """The encrypted run's phases: (label, attack, its arguments), each ``phase`` s long."""
    forged = {"stream_id": STREAM, "seconds": phase, "known": known}
    return [
        ("SETUP flood, 128 MiB terms, 10/s", "setup-flood",
         {"target": target, "stream_id": STREAM, "term_length": 128 << 20, "rate": 10,
          "seconds": phase}),
        ("SETUP flood, 64 KiB terms, 250/s", "setup-flood",
         {"target": target, "stream_id": STREAM, "term_length": 64 << 10, "rate": 250,
          "seconds": phase}),
        ("NAKs as the receiver, 4,000/s", "forge-control",
         {**forged, "kind": "nak", "count": int(4000 * phase)}),
        ("ERRs as the receiver, 300/s", "forge-control",
         {**forged, "kind": "err", "count": int(300 * phase)}),
        ("rate signals as the receiver, 500/s", "forge-control",
         {**forged, "kind": "rate", "count": int(500 * phase)}),
        ("DATA as the publisher, 1,000/s", "forge-data",
         {**forged, "count": int(1000 * phase)}),
        ("a receiver that freezes, 100/s", "forge-control",
         {**forged, "kind": "freeze", "count": int(100 * phase), "spoof": False,
          "freeze_after_s": 1.0}),
    ]


def run(rate: float, phase: float, join_sms: int) -> None:
    from slipstream.sim.real.hosts import NamespaceHosts

    print(f"machine: {machine()}; a 1 KiB stream at {rate:,.0f} msg/s; phases of {phase} s")
    ctx = multiprocessing.get_context("fork")
    with NamespaceHosts(3, shared_segment=True) as hosts, \
            tempfile.TemporaryDirectory() as keys_parent:
        keys = Path(keys_parent) / "keys"
        keys.mkdir(mode=0o750)
        (keys / "k.key").write_text(f"1 {KEY}\n")
        (keys / "k.key").chmod(0o640)
        publisher_driver = hosts.start_driver(1, keys_dir=str(keys))
        subscriber_driver = hosts.start_driver(2, keys_dir=str(keys))
        attacker = hosts[3]
        attacker.run("iptables", "-A", "INPUT", "-p", "udp", "--dport", "20000:20199",
                     "-j", "DROP")
        a1, a2 = hosts[1].address, hosts[2].address
        runs = [
            ("unicast", f"aeron:udp?endpoint={a2}:{PORT}", f"aeron:udp?endpoint={a2}:{PORT}",
             [("SETUP flood, 128 MiB terms, 10/s",
               "setup-flood", {"target": f"{a2}:{PORT}", "stream_id": STREAM,
                               "term_length": 128 << 20, "rate": 10, "seconds": phase}),
              ("SETUP flood, 64 KiB terms, 250/s",
               "setup-flood", {"target": f"{a2}:{PORT}", "stream_id": STREAM,
                               "term_length": 64 << 10, "rate": 250, "seconds": phase})]),
            ("dynamic MDC",
             f"aeron:udp?control={a1}:{CONTROL_PORT}|control-mode=dynamic",
             f"aeron:udp?endpoint={a2}:{PORT + 1}|control={a1}:{CONTROL_PORT}",
             [(f"{join_sms:,} status messages from 200 spoofed ports",
               "status-flood", {"control": f"{a1}:{CONTROL_PORT}", "stream_id": STREAM,
                                "count": join_sms, "seconds": phase,
                                "spoof_host": hosts[3].address, "spoof_ports": 200})]),
            ("encrypted unicast",
             f"aeron:udp?endpoint={a2}:{PORT + 2}|control={a1}:{CONTROL_PORT + 1}|key=k|"
             f"term-length={TERM_LENGTH}|session-id={SESSION}|init-term-id={TERM_ID}|"
             f"term-id={TERM_ID}|term-offset=0",
             f"aeron:udp?endpoint={a2}:{PORT + 2}|key=k", _encrypted_floods(
                 {"session_id": SESSION, "publisher": [a1, CONTROL_PORT + 1],
                  "subscriber": [a2, PORT + 2], "receiver": [a2, PORT + 2], "receiver_id": 1,
                  "term_id": TERM_ID, "term_offset": 0, "term_length": TERM_LENGTH},
                 f"{a2}:{PORT + 2}", phase)),
        ]
        for name, pub_channel, sub_channel, floods in runs:
            phases = [("quiet", None, {})] + [(label, attack, args)
                                               for label, attack, args in floods]
            # Room for a flood that stalls the run far past its phases (10 min).
            buckets = ctx.Array("q", int(600 / BUCKET_S))
            heartbeat = ctx.Value("d", 0.0)
            stop = ctx.Event()
            subscriber = ctx.Process(target=_subscriber, args=(
                str(subscriber_driver.directory), sub_channel, buckets, heartbeat, stop))
            publisher = ctx.Process(target=_publisher, args=(
                str(publisher_driver.directory), pub_channel, rate, stop))
            subscriber.start()
            time.sleep(0.5)
            publisher.start()
            time.sleep(2.0)  # connected and at its rate
            start = time.monotonic()
            print(f"\n{name}: {pub_channel}")
            print(f"  {'phase':<44} {'msg/s':>10} {'ratio':>7} {'pub cores':>9} "
                  f"{'heartbeat age':>14} {'shm MiB':>8} {'reflected B':>12}")
            quiet_rate = None
            for label, attack, args in phases:
                t0 = time.monotonic() - start
                reflected0 = _spoofed_bytes(attacker)
                cpu0 = cpu_s(publisher_driver.pid)
                if attack is None:
                    time.sleep(phase)
                else:
                    attacker.run(sys.executable, "-m", "slipstream.sim.real.attacker", attack,
                                 json.dumps(args), timeout=phase + 60)
                t1 = time.monotonic() - start
                cores = (cpu_s(publisher_driver.pid) - cpu0) / (t1 - t0)
                # whole buckets inside the phase, counted from the subscriber's clock origin
                # (it began 2.5 s before ``start``)
                offset = 2.5
                i0, i1 = int((t0 + offset) / BUCKET_S) + 1, int((t1 + offset) / BUCKET_S) - 1
                delivered = buckets[i1] - buckets[i0]
                phase_rate = delivered / ((i1 - i0) * BUCKET_S)
                if quiet_rate is None:
                    quiet_rate = phase_rate
                print(f"  {label:<44} {phase_rate:>10,.0f} {phase_rate / quiet_rate:>6.2f}x "
                      f"{cores:>9.2f} {heartbeat.value:>12.2f} s "
                      f"{_shm_bytes(subscriber_driver.directory) / (1 << 20):>8.1f} "
                      f"{_spoofed_bytes(attacker) - reflected0:>12,}")
            stop.set()
            publisher.join(10)
            subscriber.join(10)
            if subscriber.exitcode not in (0, None) or publisher.exitcode not in (0, None):
                print(f"  a client failed: subscriber exit {subscriber.exitcode}, publisher "
                      f"exit {publisher.exitcode} (its driver lost?)")
            print(f"  drops by cause, subscriber: {_drops(subscriber_driver.directory)}; "
                  f"publisher: {_drops(publisher_driver.directory)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10_000)
    parser.add_argument("--phase", type=float, default=10.0)
    parser.add_argument("--join-sms", type=int, default=1600)
    args = parser.parse_args()
    run(args.rate, args.phase, args.join_sms)


if __name__ == "__main__":
    main()
