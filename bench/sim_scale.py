"""How the simulator and a group's feedback grow with the hosts: one publisher and N - 1
receivers in ``slipstream sim``, with N = 50, 100, 200 and 500 by default, for

* **multicast**: host 1 multicasts to every other host (``aeron:udp?endpoint=224.0.1.1...``);
* **mdc**: host 1 publishes by dynamic multi-destination-cast and every other host joins it.

Every link loses ``--loss`` (5 %) of its datagrams, 1 ms each way; ``--messages`` (200)
messages of ``--size`` (1024) bytes, seed ``--seed`` (7).  The publisher waits for every
receiver (``fc=min,g:/N-1``) so that each gets every message and repairs its own losses;
``--fc-max`` leaves the product's default (``fc=max``: the fastest receiver sets the pace, and
one whose SETUP or first status message is lost joins later, where the stream then is, and
shows what came before as ``missing``).  For each run, in a process of its own, it prints:

* the wall time and CPU time of the run (the CPU time is what the load of a shared machine
  changes least), and the process's peak RSS;
* what the sender received: NAKs and status messages, per message sent and per virtual
  second, and what it did with them: retransmissions, and NAKs it had no retransmit action
  for (``RETRANSMIT_OVERFLOW``);
* the NAKs all receivers sent per datagram they lost: below 1 is suppression at work (a
  receiver whose random NAK delay has not run out when the retransmission someone else asked
  for arrives sends none);
* the trace digest (equal for equal runs).

    .venv/bin/python -m bench.sim_scale [--hosts 50,100,200,500] [--transport multicast,mdc]
        [--loss 0.05] [--messages 200] [--size 1024] [--seed 7] [--fc-max] [--channel PARAMS]

Figures are of one run each; the machine is shared by whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from typing import Any

from bench.ipc_throughput import bench_parser, machine


def run_one(hosts: int, transport: str, loss: float, messages: int, size: int, seed: int,
            channel: str) -> dict[str, Any]:
    """One simulation in this process; its figures (see the module docstring)."""
    from slipstream.client.counters import SystemCounter
    from slipstream.sim import LinkFaults, Scenario, Simulation

    scenario = Scenario(hosts=hosts, transport=transport, messages=messages, size=size,
                        seed=seed, channel_params=channel,
                        faults=LinkFaults(loss=loss, delay_ms=1.0))
    cpu = time.process_time()
    with Simulation(scenario) as sim:
        report = sim.run()
        sender = sim.publisher
        naks = sender.counter(SystemCounter.NAK_MESSAGES_RECEIVED)
        sms = sender.counter(SystemCounter.STATUS_MESSAGES_RECEIVED)
        overflow = sender.counter(SystemCounter.RETRANSMIT_OVERFLOW)
        # What the receivers lost of what the sender sent (data, retransmissions, heartbeats).
        lost = sum(link.stats.lost for (src, _dst), link in sim.network.links.items()
                   if src == sender.ip)
    virtual = report.virtual_seconds
    return {
        "hosts": hosts, "transport": transport, "loss": loss, "messages": report.sent,
        "wall_s": report.wall_seconds, "cpu_s": time.process_time() - cpu,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "virtual_s": virtual,
        "naks_at_sender": naks, "sms_at_sender": sms,
        "naks_per_message": naks / max(1, report.sent),
        "sms_per_message": sms / max(1, report.sent),
        "naks_per_virtual_s": naks / virtual if virtual > 0 else None,
        "sms_per_virtual_s": sms / virtual if virtual > 0 else None,
        "naks_sent_per_loss": report.naks / max(1, lost),
        "retransmits": report.retransmits, "retransmit_overflow": overflow,
        "missing": sum(report.missing), "completed": report.completed,
        "digest": report.trace_digest,
    }


def _list(text: str, kind: type) -> list[Any]:
    try:
        values = [kind(each) for each in text.split(",") if each]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    if not values:
        raise argparse.ArgumentTypeError("an empty list")
    return values


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--hosts", type=lambda t: _list(t, int), default=[50, 100, 200, 500])
    parser.add_argument("--transport", type=lambda t: _list(t, str),
                        default=["multicast", "mdc"])
    parser.add_argument("--loss", type=float, default=0.05)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--fc-max", action="store_true",
                        help="the default flow control, not min over every receiver")
    parser.add_argument("--channel", default="", help="extra channel URI parameters")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one run, its figures as JSON
        print(json.dumps(run_one(args.hosts[0], args.transport[0], args.loss, args.messages,
                                 args.size, args.seed, args.channel)))
        return 0
    flow = "fc=max (default)" if args.fc_max else "fc=min,g:/N-1"
    print(f"# {machine()}; loss {args.loss:g} per link, 1 ms, {args.messages} x {args.size} B, "
          f"seed {args.seed}, {flow}, channel {args.channel or '(defaults)'}")
    print(f"{'transport':>9} {'hosts':>5} {'wall s':>7} {'cpu s':>6} {'RSS MB':>7} "
          f"{'virt s':>7} {'NAK/msg':>8} {'SM/msg':>7} {'NAK/s':>8} {'SM/s':>7} "
          f"{'NAK/loss':>8} {'retx':>6} {'ovfl':>6} {'missing':>7}  digest")
    for transport in args.transport:
        for hosts in args.hosts:
            channel = "|".join(each for each in (
                "" if args.fc_max else f"fc=min,g:/{hosts - 1}", args.channel) if each)
            command = [sys.executable, "-m", "bench.sim_scale", "--one",
                       "--hosts", str(hosts), "--transport", transport,
                       "--loss", str(args.loss), "--messages", str(args.messages),
                       "--size", str(args.size), "--seed", str(args.seed),
                       "--channel", channel]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"{transport:>9} {hosts:>5} failed: {done.stderr.strip()[-500:]}")
                continue
            r = json.loads(done.stdout.splitlines()[-1])
            print(f"{transport:>9} {hosts:>5} {r['wall_s']:7.1f} {r['cpu_s']:6.1f} "
                  f"{r['peak_rss_mb']:7.0f} {r['virtual_s']:7.3f} "
                  f"{r['naks_per_message']:8.2f} {r['sms_per_message']:7.2f} "
                  f"{r['naks_per_virtual_s'] or 0:8.0f} {r['sms_per_virtual_s'] or 0:7.0f} "
                  f"{r['naks_sent_per_loss']:8.2f} {r['retransmits']:6} "
                  f"{r['retransmit_overflow']:6} {r['missing']:7}  {r['digest'][:16]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
