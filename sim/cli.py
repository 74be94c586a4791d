"""``slipstream sim``: run the protocol over the virtual network from the command line.

:func:`add_command` adds the subcommand to the ``slipstream`` command (:mod:`slipstream.cli`);
its options are :func:`add_arguments`' and :func:`run` runs it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable

import attrs

from slipstream.daemon.cli import Commands, int_at_least, non_negative_number
from slipstream.sim.host import CommandRefusedError
from slipstream.sim.network import LinkFaults
from slipstream.sim.report import plot_report
from slipstream.sim.runner import run_scenario
from slipstream.sim.scenario import (
    MDC_CONTROL_PORT,
    MDS_PORTS,
    MIN_MESSAGE_SIZE,
    TRANSPORTS,
    Event,
    Scenario,
    ScenarioError,
    load_scenario,
    make_faults,
)
from slipstream.sim.signals import exiting_on_sigterm

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
    a, b = non_negative_number(start), non_negative_number(end)
    if b <= a:
        raise argparse.ArgumentTypeError(f"END_MS {b:g} must be after START_MS {a:g}")
    return a, b


def add_command(commands: Commands) -> None:
    """Add ``sim`` to the ``slipstream`` command's ``commands``
    (:func:`slipstream.daemon.cli.new_parser`); it runs :func:`run`."""
    sim = commands.add_parser(
        "sim", help="run the protocol in the deterministic network simulator",
        description="One publisher to N-1 subscribers over a virtual network with faults "
                    "(unicast when N is 2, multicast above), faster than real time.")
    add_arguments(sim)
    sim.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``slipstream sim`` (a scenario file's values are the defaults when
    ``--scenario`` is given; options given on the command line override them)."""
    parser.epilog = (
        "Host 1 (10.0.0.1) publishes; hosts 2..N subscribe.  Faults apply to every direction "
        "of every link.  Output: a summary, or one JSON object with --json (goodput in "
        "delivered payload bytes per virtual second, mean per subscriber).  Same --seed, same "
        "run: the trace digest is identical.  See docs/SIMULATOR.md.")
    add = parser.add_argument
    add("--hosts", type=int_at_least(2), metavar="N",
        help=f"hosts: 1 publisher + N-1 subscribers; unicast when N = 2, multicast above "
             f"(default: {DEFAULTS['hosts']})")
    add("--transport", choices=TRANSPORTS,
        help=f"how the stream reaches the subscribers: multicast (unicast when N = 2); mdc: "
             f"dynamic multi-destination-cast, every subscriber joining at host 1's control "
             f"address (10.0.0.1:{MDC_CONTROL_PORT}); or mds: two paths to each subscriber, "
             f"a multi-destination subscription on ports {MDS_PORTS[0]} and {MDS_PORTS[1]} "
             f"that host 1 sends to (default: multicast)")
    _add_link_faults(add, delay_default=DEFAULTS["delay"], unset=True)
    add("--rate", type=non_negative_number, metavar="MBIT",
        help="bandwidth of every link, Mbit/s, with a 1 MiB tail-drop queue "
             "(default: 0 = unlimited)")
    add("--partition", type=_partition, action="append", metavar="START_MS:END_MS",
        help="cut the publisher off from every subscriber from START_MS to END_MS of virtual "
             "time, milliseconds; repeatable (default: none)")
    add("--channel", metavar="PARAMS",
        help="extra channel URI parameters joined with '|', e.g. 'fc=min,g:/2' (the "
             "publisher waits for 2 receivers) or 'term-length=64k', added to a --scenario's "
             "channel (a key both give takes this value) (default: none)")
    add("--messages", type=int_at_least(0), metavar="N",
        help=f"messages to publish (default: {DEFAULTS['messages']})")
    add("--size", type=int_at_least(MIN_MESSAGE_SIZE), metavar="BYTES",
        help=f"message size, bytes, >= {MIN_MESSAGE_SIZE} (default: {DEFAULTS['size']})")
    add("--seed", type=int, metavar="S",
        help=f"seed of every random choice (default: {DEFAULTS['seed']})")
    add("--json", action="store_true",
        help="print one JSON object: sent, delivered, duplicates, out_of_order, missing "
             "(per-subscriber lists), naks, retransmits, virtual_seconds, wall_seconds, "
             "goodput (bytes per virtual second; null when no virtual time passed), clock "
             "(virtual, or real with --on-hosts)")
    add("--plot", metavar="FILE.png",
        help="draw stream positions (publisher, each subscriber) and dropped DATA "
             "datagrams over virtual time to a PNG (needs matplotlib)")
    add("--scenario", metavar="FILE.toml",
        help="read hosts, faults per link, timed events (partition, crash, restart, faults) "
             "and traffic from a TOML file; the options above override it")
    add("--on-hosts", action="store_true",
        help="play the scenario on namespace hosts instead: a real driver in each, real "
             "sockets, iptables loss and a tbf rate, in real time (root; pause, crash and "
             "partition events; see docs/SIMULATOR.md)")
    tools = parser.add_subparsers(dest="tool", metavar="TOOL",
                                  help="or a tool for real sockets: relay, hosts")
    relay = tools.add_parser(
        "relay", help="relay UDP between real sockets, with the simulator's faults",
        description="Relay UDP from --listen to --forward (and the replies back), dropping, "
                    "delaying, reordering and duplicating datagrams as the simulator's links "
                    "do. Unicast: a peer sends to --listen, the relay forwards to --forward "
                    "from a socket of its own and returns the replies. Multicast (both "
                    "groups): --listen's data group to --forward's, and --forward's control "
                    "group (data group + 1) back to --listen's. Prints what it did every 5 s "
                    "and at the end (Ctrl-C).")
    relay.add_argument("--listen", required=True, type=_address, metavar="HOST:PORT")
    relay.add_argument("--forward", required=True, type=_address, metavar="HOST:PORT")
    relay.add_argument("--interface", metavar="IP",
                       help="the interface for multicast (default: the kernel's choice)")
    relay.add_argument("--directions", choices=("both", "data", "control"), default="both",
                       help="which directions get the faults (default: %(default)s)")
    _add_link_faults(relay.add_argument, delay_default=0.0, unset=False)
    relay.add_argument("--seed", type=int, default=1, metavar="S",
                       help="seed of the random choices (default: %(default)s)")
    hosts = tools.add_parser(
        "hosts", help="test hosts in network namespaces, a driver in each (root)",
        description="Make N hosts (network namespaces on a bridge, 10.x addresses inside "
                    "them only), start a slipstream driver in each, print where, and remove "
                    "it all on Ctrl-C or SIGTERM. Needs root and iproute2.")
    hosts.add_argument("--count", type=int_at_least(1), default=2, metavar="N",
                       help="hosts (default: %(default)s)")
    hosts.add_argument("--no-drivers", action="store_true", help="hosts only, no drivers")


#: The link-fault options the simulator and the relay share (argparse dest), each with the
#: :class:`LinkFaults` field it sets; the simulator's ``--rate`` is its own.
LINK_FAULT_OPTIONS: dict[str, str] = {
    "loss": "loss", "burst_loss": "burst", "delay": "delay_ms", "jitter": "jitter_ms",
    "reorder": "reorder", "duplicate": "duplicate"}


def _add_link_faults(add: Callable[..., object], *, delay_default: float, unset: bool) -> None:
    """Add the options of :data:`LINK_FAULT_OPTIONS` with ``add`` (a parser's
    ``add_argument``).  ``unset``: their values are None when not given (a scenario file's
    then stand, and ``delay_default`` is the delay without either), else 0 (no fault) and
    ``delay_default``."""
    def default(value: float) -> dict[str, float]:
        return {} if unset else {"default": value}

    add("--loss", type=_probability, metavar="P", **default(0.0),
        help="random loss: probability that a datagram is dropped, 0..1 (default: 0)")
    add("--burst-loss", type=_burst, metavar="P,R",
        help="bursty loss (Gilbert-Elliott): P = P(good→bad), R = P(bad→good) per datagram; "
             "all datagrams are dropped in the bad state (default: off)")
    add("--delay", type=non_negative_number, metavar="MS", **default(delay_default),
        help=f"one-way delay, milliseconds (default: {delay_default:g})")
    add("--jitter", type=non_negative_number, metavar="MS", **default(0.0),
        help="delay jitter, uniform ±MS milliseconds per datagram (default: 0)")
    add("--reorder", type=_probability, metavar="P", **default(0.0),
        help="probability that a datagram is held back up to 5 ms extra, so later ones "
             "overtake it (default: 0)")
    add("--duplicate", type=_probability, metavar="P", **default(0.0),
        help="probability that a datagram is delivered twice (default: 0)")


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def merge_channel_params(scenario: str, extra: str) -> str:
    """The scenario's channel parameters with ``--channel``'s added: a key both give takes
    the option's value (``key=value`` parts joined by ``|``, in the scenario's order, then the
    option's new keys)."""
    merged: dict[str, str] = {}
    for params in (scenario, extra):
        for part in params.split("|"):
            if part:
                merged[part.partition("=")[0]] = part
    return "|".join(merged.values())


def build_scenario(args: argparse.Namespace) -> Scenario:
    """The scenario of the command line (raises ScenarioError naming the option)."""
    base = load_scenario(args.scenario) if args.scenario else Scenario(
        hosts=DEFAULTS["hosts"], messages=DEFAULTS["messages"], size=DEFAULTS["size"],
        seed=DEFAULTS["seed"], faults=LinkFaults(delay_ms=DEFAULTS["delay"]))
    changes: dict[str, object] = {}
    for name in ("hosts", "messages", "size", "seed", "transport"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.channel is not None:
        changes["channel_params"] = merge_channel_params(base.channel_params, args.channel)
    fault_options = {**LINK_FAULT_OPTIONS, "rate": "rate_mbit"}
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
        for _, end_ms in args.partition:
            if end_ms * 1e6 > base.max_virtual_ns:
                raise ScenarioError(f"--partition: it ends at {end_ms:g} ms, after the run's "
                                    f"max_virtual_s ({base.max_virtual_ns / 1e9:g} s)")
        changes["events"] = (*base.events, *events)
    try:
        return attrs.evolve(base, **changes)
    except ScenarioError as e:
        if args.scenario and "hosts" in changes and (": host " in str(e)
                                                     or str(e).startswith("hosts:")):
            raise ScenarioError(f"--hosts: {e} (in {args.scenario})") from None
        raise


def run_relay(args: argparse.Namespace) -> int:
    """``slipstream sim relay``: relay until interrupted (Ctrl-C, SIGTERM), printing the
    counters every 5 s and at the end."""
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    from slipstream.sim.real.relay import Relay

    faults = LinkFaults(**{field: getattr(args, option)
                           for option, field in LINK_FAULT_OPTIONS.items()})
    try:
        relay = Relay(args.listen, args.forward, faults, directions=args.directions,
                      interface=args.interface, seed=args.seed)
    except (ValueError, OSError) as e:
        print(f"slipstream sim relay: {e}", file=sys.stderr)
        return 2
    print(f"relaying {args.listen[0]}:{args.listen[1]} -> {args.forward[0]}:{args.forward[1]}",
          flush=True)
    with relay:
        try:
            while True:
                time.sleep(5)
                _print_relay(relay)
        except KeyboardInterrupt:
            pass
    _print_relay(relay)
    return 0


def _print_relay(relay: object) -> None:
    for direction, stats in relay.stats.items():  # type: ignore[attr-defined]
        print(f"{direction:<8} offered {stats.offered} delivered {stats.delivered} "
              f"lost {stats.lost} burst-lost {stats.burst_lost} duplicated {stats.duplicated} "
              f"reordered {stats.reordered}", flush=True)


def run_hosts(args: argparse.Namespace) -> int:
    """``slipstream sim hosts``: make the hosts, print them, remove them on Ctrl-C/SIGTERM."""
    from slipstream.sim.real.hosts import HostsError, NamespaceHosts

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        hosts = NamespaceHosts(args.count)
    except HostsError as e:
        print(f"slipstream sim hosts: {e}", file=sys.stderr)
        return 2
    with hosts:
        for host in hosts.hosts:
            line = f"host {host.index}  {host.address:<14} netns {host.namespace}"
            if not args.no_drivers:
                line += f"  driver {hosts.start_driver(host.index).directory}"
            print(line, flush=True)
        print("Ctrl-C removes them all", flush=True)
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the simulation the options describe; print the report.  Exit status 0 when every
    subscriber got everything it was owed exactly once in order
    (:attr:`~slipstream.sim.report.Report.exactly_once_in_order`, as the verdict line says),
    1 otherwise, 2 for bad options."""
    with exiting_on_sigterm():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "tool", None) == "relay":
        return run_relay(args)
    if getattr(args, "tool", None) == "hosts":
        return run_hosts(args)
    try:
        scenario = build_scenario(args)
    except ScenarioError as e:
        print(f"slipstream sim: {e}", file=sys.stderr)
        return 2
    if args.plot and not args.plot.lower().endswith(".png"):
        print(f"slipstream sim: --plot: {args.plot!r} must be a .png file", file=sys.stderr)
        return 2
    try:
        if args.on_hosts:
            from slipstream.sim.real.hosts import HostsError
            from slipstream.sim.real.on_hosts import run_on_hosts

            try:
                report = run_on_hosts(scenario, sample_interval_ns=PLOT_SAMPLE_INTERVAL_NS
                                      if args.plot else None)
            except (HostsError, TimeoutError) as e:
                print(f"slipstream sim --on-hosts: {e}", file=sys.stderr)
                return 2
        else:
            report = run_scenario(scenario, sample_interval_ns=PLOT_SAMPLE_INTERVAL_NS
                                  if args.plot else None, record_drops=bool(args.plot))
    except (ScenarioError, CommandRefusedError) as e:  # a --channel the driver does not take
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
    return 0 if report.exactly_once_in_order else 1  # the verdict line's own check
