"""``slipstream sim``: run the protocol over the virtual network from the command line.

``daemon/cli.py`` wires the subcommand to :func:`add_arguments` and :func:`run`.
"""

from __future__ import annotations

import argparse
import sys

import attrs

from slipstream.sim.network import LinkFaults
from slipstream.sim.scenario import (
    MIN_MESSAGE_SIZE,
    Event,
    Scenario,
    ScenarioError,
    load_scenario,
    make_faults,
)

#: Defaults when neither the command line nor a scenario file sets a value.
DEFAULTS = {"hosts": 2, "messages": 10_000, "size": 1024, "seed": 1, "delay": 1.0}
#: Position samples for --plot, virtual ns apart.
PLOT_SAMPLE_INTERVAL_NS = 2_000_000


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a probability in [0, 1]")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _int_at_least(low: int):  # -> Callable[[str], int]
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {low}")
        return value
    return parse


def _burst(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not P,R (two probabilities)")
    p, r = (_probability(x.strip()) for x in parts)
    if r == 0:
        raise argparse.ArgumentTypeError("R (bad→good) must be > 0, or the loss never ends")
    return p, r


def _partition(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not START_MS:END_MS")
    a, b = _non_negative(start), _non_negative(end)
    if b <= a:
        raise argparse.ArgumentTypeError(f"END_MS {b:g} must be after START_MS {a:g}")
    return a, b


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``slipstream sim`` (a scenario file's values are the defaults when
    ``--scenario`` is given; options given on the command line override them)."""
    parser.epilog = (
        "Host 1 (10.0.0.1) publishes; hosts 2..N subscribe.  Faults apply to every direction "
        "of every link.  Output: a summary, or one JSON object with --json (goodput in "
        "delivered payload bytes per virtual second, mean per subscriber).  Same --seed, same "
        "run: the trace digest is identical.  See docs/SIMULATOR.md.")
    add = parser.add_argument
    add("--hosts", type=_int_at_least(2), metavar="N",
        help=f"hosts: 1 publisher + N-1 subscribers; unicast when N = 2, multicast above "
             f"(default: {DEFAULTS['hosts']})")
    add("--loss", type=_probability, metavar="P",
        help="random loss: probability that a datagram is dropped, 0..1 (default: 0)")
    add("--burst-loss", type=_burst, metavar="P,R",
        help="bursty loss (Gilbert-Elliott): P = P(good→bad), R = P(bad→good) per datagram; "
             "all datagrams are dropped in the bad state (default: off)")
    add("--delay", type=_non_negative, metavar="MS",
        help=f"one-way delay of every link, milliseconds (default: {DEFAULTS['delay']:g})")
    add("--jitter", type=_non_negative, metavar="MS",
        help="delay jitter, uniform ±MS milliseconds per datagram (default: 0)")
    add("--reorder", type=_probability, metavar="P",
        help="probability that a datagram is held back up to 5 ms extra, so later ones "
             "overtake it (default: 0)")
    add("--duplicate", type=_probability, metavar="P",
        help="probability that a datagram is delivered twice (default: 0)")
    add("--rate", type=_non_negative, metavar="MBIT",
        help="bandwidth of every link, Mbit/s, with a 1 MiB tail-drop queue "
             "(default: 0 = unlimited)")
    add("--partition", type=_partition, action="append", metavar="START_MS:END_MS",
        help="cut the publisher off from every subscriber from START_MS to END_MS of virtual "
             "time, milliseconds; repeatable (default: none)")
    add("--channel", metavar="PARAMS",
        help="extra channel URI parameters joined with '|', e.g. 'fc=min,g:/2' (the "
             "publisher waits for 2 receivers) or 'term-length=64k' (default: none)")
    add("--messages", type=_int_at_least(0), metavar="N",
        help=f"messages to publish (default: {DEFAULTS['messages']})")
    add("--size", type=_int_at_least(MIN_MESSAGE_SIZE), metavar="BYTES",
        help=f"message size, bytes, >= {MIN_MESSAGE_SIZE} (default: {DEFAULTS['size']})")
    add("--seed", type=int, metavar="S",
        help=f"seed of every random choice (default: {DEFAULTS['seed']})")
    add("--json", action="store_true",
        help="print one JSON object: sent, delivered, duplicates, out_of_order, missing "
             "(per-subscriber lists), naks, retransmits, virtual_seconds, wall_seconds, "
             "goodput (bytes per virtual second)")
    add("--plot", metavar="FILE.png",
        help="draw stream positions (publisher, each subscriber) and dropped DATA "
             "datagrams over virtual time to a PNG (needs matplotlib)")
    add("--scenario", metavar="FILE.toml",
        help="read hosts, faults per link, timed events (partition, crash, restart, faults) "
             "and traffic from a TOML file; the options above override it")


def build_scenario(args: argparse.Namespace) -> Scenario:
    """The scenario of the command line (raises ScenarioError naming the option)."""
    base = load_scenario(args.scenario) if args.scenario else Scenario(
        hosts=DEFAULTS["hosts"], messages=DEFAULTS["messages"], size=DEFAULTS["size"],
        seed=DEFAULTS["seed"], faults=LinkFaults(delay_ms=DEFAULTS["delay"]))
    changes: dict[str, object] = {}
    for name in ("hosts", "messages", "size", "seed"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.channel is not None:
        changes["channel_params"] = args.channel.strip("|")
    fault_options = {"loss": "loss", "burst_loss": "burst", "delay": "delay_ms",
                     "jitter": "jitter_ms", "reorder": "reorder", "duplicate": "duplicate",
                     "rate": "rate_mbit"}
    faults = {field: getattr(args, option) for option, field in fault_options.items()
              if getattr(args, option) is not None}
    if faults:
        changes["faults"] = make_faults("options", faults, base.faults)
        if base.links:  # command-line faults win on every link
            changes["links"] = tuple(attrs.evolve(link, faults=make_faults(
                "options", faults, link.faults)) for link in base.links)
    if args.partition:
        events = [Event(int(a * 1e6), "partition", hosts=(1,), end_ns=int(b * 1e6))
                  for a, b in args.partition]
        changes["events"] = (*base.events, *events)
    try:
        return attrs.evolve(base, **changes)
    except ScenarioError as e:
        if args.scenario and "hosts" in changes:
            raise ScenarioError(f"--hosts: {e} (in {args.scenario})") from None
        raise


def run(args: argparse.Namespace) -> int:
    """Run the simulation the options describe; print the report.  Exit status 0 when every
    live subscriber got everything exactly once in order, 1 otherwise, 2 for bad options."""
    from slipstream.sim.report import plot_report
    from slipstream.sim.runner import run_scenario

    try:
        scenario = build_scenario(args)
    except ScenarioError as e:
        print(f"slipstream sim: {e}", file=sys.stderr)
        return 2
    if args.plot and not args.plot.lower().endswith(".png"):
        print(f"slipstream sim: --plot: {args.plot!r} must be a .png file", file=sys.stderr)
        return 2
    try:
        report = run_scenario(scenario, sample_interval_ns=PLOT_SAMPLE_INTERVAL_NS
                              if args.plot else None, record_drops=bool(args.plot))
    except ScenarioError as e:
        print(f"slipstream sim: {e}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            plot_report(report, args.plot)
        except ImportError:
            print("slipstream sim: --plot needs matplotlib (pip install 'slipstream[sim]')",
                  file=sys.stderr)
            return 2
        except OSError as e:
            print(f"slipstream sim: --plot: cannot write {args.plot}: {e.strerror}",
                  file=sys.stderr)
            return 2
    if args.json:
        print(report.to_json())
    else:
        print(report.format_text())
        if args.plot:
            print(f"plot          {args.plot}")
    clean = (report.completed and not any(report.duplicates) and not any(report.out_of_order)
             and not any(report.corrupt) and not any(report.missing))
    return 0 if clean else 1
