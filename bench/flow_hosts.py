"""Flow control on namespace hosts (the targets below; the figures in docs/FLOW.md): one
publisher, four subscriber hosts, a real driver on each, the scenarios played by
``slipstream sim --on-hosts``.  Needs root.

    sudo .venv/bin/python -m bench.flow_hosts [--only pause,slow,cubic,bands] [--plots DIR]

* **pause**: host 3's subscriber stops reading for 2 s (as a GC pause would) while the
  publisher sends 10,000 x 1 KiB messages a second; then its driver dies instead.  For each of
  ``fc=min`` (the peer: what Aeron offers for this) and ``rc=nak-strength``, the longest gap
  between two deliveries at the other three subscribers.  Target: under 100 ms with
  nak-strength; min stops them until the paused one reads again, or the dead one times out.
* **slow**: host 3 reads 1,000 messages a second (a tenth of the publisher's rate) on three
  kinds of link, with default settings: plain veths, a ``tbf`` of 100 Mbit/s on the
  publisher's uplink, and 2 % random loss (iptables, every subscriber host and the publisher's
  control traffic).  Target under nak-strength: host 3 loses nothing and the sender's rate,
  once settled (the second half of the run), is within 20 % of what host 3 takes.
* **cubic**: two streams from one host to another through one ``tbf`` of 100 Mbit/s, the
  publisher offering on both as fast as it can: two CUBIC receivers, CUBIC beside the static
  window, and two static ones (the reference); the tbf queue holds 5 ms, less than two windows
  in flight.  Target: two CUBIC streams within 20 % of each other once settled (the last
  third of a 30 s run); a CUBIC stream beside a static one does not starve it.
* **bands**: two streams on one send socket through a ``tbf`` of 100 Mbit/s whose queue is
  longer than the socket's buffer, priority=800 (band 4) against priority=0 (band 1), as
  tests/test_flow_hosts.py runs them.  Target: band 4 takes 8/9 of what goes, and the two
  use over 80 % of the link.

Every figure comes from the run's own samples (every 10 ms: snd-pos, snd-lmt and the rate
limit from the publisher's counters, each subscriber's position).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from bench.ipc_throughput import machine
from slipstream.sim.network import LinkFaults
from slipstream.sim.real.on_hosts import run_on_hosts, share_one_link
from slipstream.sim.report import Report, plot_report
from slipstream.sim.scenario import Event, Scenario

MS = 1_000_000
S = 1_000_000_000
HOSTS = 5
PUBLISH_RATE = 10_000
SLOW_RATE = PUBLISH_RATE / 10
SIZE = 1024
FRAME = SIZE + 32
SLOW_HOST = 3
LINKS = {"veth": LinkFaults(), "tbf 100 Mbit/s": LinkFaults(rate_mbit=100),
         "2 % loss": LinkFaults(loss=0.02)}


def scenario(channel: str, messages: int, **kwargs: Any) -> Scenario:
    return Scenario(hosts=HOSTS, messages=messages, size=SIZE, publish_rate=PUBLISH_RATE,
                    channel_params=f"term-length=1m|{channel}" if channel else "term-length=1m",
                    max_virtual_ns=120 * S, **kwargs)


def others(values: list) -> list:
    return [v for i, v in enumerate(values) if i + 2 != SLOW_HOST]


def play(name: str, case: Scenario, plots: Path | None) -> Report:
    report = run_on_hosts(case, sample_interval_ns=10 * MS)
    if plots is not None:
        plot_report(report, str(plots / f"flow_hosts_{name}.png"))
    return report


def pause(plots: Path | None) -> None:
    print("\n== one subscriber host pauses 2 s, then one dies (10,000 x 1 KiB/s, 4 hosts "
          "subscribe) ==")
    print(f"{'channel':<18} {'event':<7} {'others: longest gap':>20} {'others missed':>14}  "
          f"host 3")
    gaps: dict[tuple[str, str], float] = {}
    for channel in ("fc=min", "rc=nak-strength"):
        for event_name, event in (
                ("pause", Event(1 * S, "pause", hosts=(SLOW_HOST,), end_ns=3 * S)),
                ("dies", Event(1 * S, "crash", hosts=(SLOW_HOST,)))):
            tag = f"{event_name}_{channel.split('=')[1].split(',')[0].replace('-', '_')}"
            report = play(tag, scenario(channel, 50_000, events=(event,)), plots)
            gap = max(others(report.longest_gaps_ns)) / 1e6
            gaps[channel, event_name] = gap
            i = SLOW_HOST - 2
            host3 = ("driver killed" if event_name == "dies" else
                     f"got {report.delivered[i]:,}, told of "
                     f"{sum(b - a for a, b in report.lost_ranges[i]):,} bytes lost")
            print(f"{channel:<18} {event_name:<7} {gap:>17.1f} ms {sum(others(report.missing)):>14}"
                  f"  {host3}", flush=True)
    for event_name in ("pause", "dies"):
        ratio = gaps["fc=min", event_name] / gaps["rc=nak-strength", event_name]
        print(f"{event_name}: min's longest gap / nak-strength's = {ratio:.0f}x "
              f"(target: nak-strength under 100 ms: "
              f"{'met' if gaps['rc=nak-strength', event_name] < 100 else 'NOT met'})")


def settled_rates(report: Report) -> tuple[float, float, float]:
    """Over the second half of the run: the sender's rate, what host 3 took, and the mean
    send-rate limit (bytes/s; the limit 0 where none was in force)."""
    samples = [s for s in report.samples if s[1] is not None]
    end = samples[-1][0]
    half = [s for s in samples if s[0] >= end / 2]
    (t0, p0, subs0), (t1, p1, subs1) = half[0], half[-1]
    i = SLOW_HOST - 2
    sent = (p1 - p0) * S / (t1 - t0)
    taken = ((subs1[i] or 0) - (subs0[i] or 0)) * S / (t1 - t0)
    limits = [rate for t, _, rate in report.limits if t >= end / 2 and rate]
    return sent, taken, (sum(limits) / len(limits) if limits else 0.0)


def slow(plots: Path | None, messages: int) -> None:
    print(f"\n== host 3 reads {SLOW_RATE:,.0f} of {PUBLISH_RATE:,} messages/s "
          f"({messages:,} x 1 KiB, rc=nak-strength, default settings) ==")
    print(f"{'link':<16} {'host 3 missed':>13} {'others missed':>14} {'sent / taken':>13} "
          f"{'limit / taken':>14} {'took':>7}")
    for name, faults in LINKS.items():
        tag = "slow_" + name.split()[0].replace("%", "").replace("2", "loss2")
        report = play(tag, scenario("rc=nak-strength", messages, faults=faults,
                                    read_rates=((SLOW_HOST, SLOW_RATE),)), plots)
        sent, taken, limit = settled_rates(report)
        i = SLOW_HOST - 2
        print(f"{name:<16} {report.missing[i]:>13} {sum(others(report.missing)):>14} "
              f"{sent / taken:>12.3f}x {limit / taken if limit else float('nan'):>13.2f}x "
              f"{report.wall_seconds:>6.1f}s  (target: 0 missed, within 20 %: "
              f"{'met' if report.missing[i] == 0 and abs(sent / taken - 1) <= 0.2 else 'NOT met'})",
              flush=True)


CUBIC_CASES = {"cubic + cubic": ("cc=cubic", "cc=cubic"), "cubic + static": ("cc=cubic", ""),
               "static + static": ("", "")}
CUBIC_MBIT = 100
#: The tbf queue, as a switch port buffers: shallower than two windows in flight, so the
#: streams meet loss and CUBIC has something to answer (a 50 ms queue never overflowed).
CUBIC_QUEUE_MS = 5


def cubic(plots: Path | None, seconds: float) -> None:
    print(f"\n== two streams through one tbf of {CUBIC_MBIT} Mbit/s, host 1 to host 2, "
          f"{seconds:.0f} s each, default settings ==")
    print("(MB/s over the last third of the run; in brackets, stream 2 / stream 1 over the "
          "first 5 s; losses: the gaps each stream's image saw)")
    print(f"{'receivers':<16} {'stream 1 MB/s':>14} {'stream 2 MB/s':>14} {'2 / 1':>7} "
          f"{'(first 5 s)':>12} {'total / link':>13} {'losses':>11}")
    link = CUBIC_MBIT * 1e6 / 8
    for name, params in CUBIC_CASES.items():
        result = share_one_link(params, seconds, mbit=CUBIC_MBIT, queue_ms=CUBIC_QUEUE_MS,
                                size=SIZE)
        settled = len(result["bins"][0]) * 2 // 3
        rates = [sum(b[settled:]) / (len(b[settled:]) * 0.1) for b in result["bins"]]
        early = [sum(b[:50]) for b in result["bins"]]
        print(f"{name:<16} {rates[0] / 1e6:>14.2f} {rates[1] / 1e6:>14.2f} "
              f"{rates[1] / rates[0]:>7.2f} {f'({early[1] / max(1, early[0]):.2f})':>12} "
              f"{(rates[0] + rates[1]) / link:>12.0%}  "
              f"{result['losses'][0]:>4} + {result['losses'][1]:<4} gaps "
              f"(every message once, in order: "
              f"{result['sent'][0]:,} + {result['sent'][1]:,})",
              flush=True)
        if plots is not None:
            _plot_shares(name, params, result["bins"], plots)


def bands(seconds: float) -> None:
    print(f"\n== band 4 against band 1 on one send socket, through a tbf of {CUBIC_MBIT} "
          f"Mbit/s, {seconds:.0f} s ==")
    result = share_one_link(("", ""), seconds, mbit=CUBIC_MBIT, queue_ms=50,
                            publication_params=("priority=0", "priority=800"),
                            sender_settings={"socket_so_sndbuf": "64k"},
                            receiver_settings={"rcv_initial_window_length": "2m",
                                               "socket_so_rcvbuf": "4m"}, size=SIZE)
    low, high = (series[10:] for series in result["bins"])  # after the first second
    used = (sum(high) + sum(low)) / (len(high) * 0.1)
    print(f"band 4 {sum(high) / (sum(high) + sum(low)):.1%} of what went (target 88.9 %); "
          f"band 1's least 100 ms {min(low) / 1e3:.0f} KB; together "
          f"{used / 1e6:.2f} MB/s, {used / (CUBIC_MBIT * 1e6 / 8):.0%} of the link "
          f"(target > 80 %)", flush=True)


def _plot_shares(name: str, params: tuple[str, str], bins: list[list[int]],
                 plots: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.5), dpi=100)
    for k, series in enumerate(bins):
        ax.plot([0.1 * (i + 1) for i in range(len(series))], [b / 0.1 / 1e6 for b in series],
                label=f"stream {k + 1} ({params[k] or 'cc=static'})", linewidth=1)
    ax.axhline(CUBIC_MBIT / 8, color="grey", linestyle="--", linewidth=0.8,
               label=f"tbf {CUBIC_MBIT} Mbit/s")
    ax.set_xlabel("real time (s)")
    ax.set_ylabel("delivered MB/s (100 ms bins)")
    ax.set_title(f"slipstream on namespace hosts: two streams through one bottleneck, {name}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(plots / f"flow_hosts_share_{name.replace(' + ', '_')}.png", format="png")
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="pause,slow,cubic,bands",
                        help="which parts: pause, slow, cubic, bands (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=30.0,
                        help="length of each shared-link run (default: %(default)s)")
    parser.add_argument("--plots", type=Path, help="write each run's plot to this directory")
    parser.add_argument("--messages", type=int, default=15_000,
                        help="messages of each slow-receiver run (default: %(default)s)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench.flow_hosts: namespace hosts need root", file=sys.stderr)
        return 2
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
    print(machine())
    parts = set(args.only.split(","))
    if "pause" in parts:
        pause(args.plots)
    if "slow" in parts:
        slow(args.plots, args.messages)
    if "cubic" in parts:
        cubic(args.plots, args.seconds)
    if "bands" in parts:
        bands(args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
