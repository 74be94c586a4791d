"""The driver's commands of ``slipstream``: ``driver``, ``stat``, ``metrics`` and ``demo``
(:func:`add_commands`), and the command's parser and error handling (:func:`new_parser`,
:func:`main`).  The ``slipstream`` command itself, with the simulator's ``sim`` beside these,
is :mod:`slipstream.cli`; ``python -m slipstream.daemon.cli`` runs these four alone (the
launcher's :meth:`~slipstream.daemon.driver.MediaDriver.start` runs ``driver`` so)."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import math
import sys
from collections.abc import Callable, Sequence

from slipstream._distribution import DISTRIBUTION, version
from slipstream.client.errors import (
    DriverAlreadyRunningError,
    DriverDirectoryError,
    InvalidArgumentError,
    SlipstreamError,
)
from slipstream.daemon.directory import (
    EXIT_ALREADY_RUNNING,
    EXIT_DIRECTORY_REFUSED,
    STACK_DUMP_SIGNAL,
)

#: What :func:`new_parser` hands the commands' adders: argparse's set of subcommands.
Commands = argparse._SubParsersAction  # argparse names no public type for it


def _driver(args: argparse.Namespace) -> int:
    # First, before the imports that are most of a start: a start that hangs there says where.
    # A process without a stderr to print to (started with 2>&-) runs without the printer.
    with contextlib.suppress(RuntimeError, OSError, ValueError, AttributeError):
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    from slipstream.daemon.config import format_settings, load_settings_from_args
    from slipstream.daemon.shell import run_driver

    # Before the settings: what loading them warns of (a file's line outranked) is shown too.
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_settings_from_args(args)
    if args.print_config:
        print(format_settings(settings))
        return 0
    logging.getLogger().setLevel(settings.log_level.upper())
    run_driver(settings, stop_when_stdin_closes=args.stop_when_stdin_closes)
    return 0


def _stat(args: argparse.Namespace) -> int:
    from slipstream.daemon.ops.stat import run_stat

    return run_stat(args.dir, interval=args.interval, once=args.once, match=args.match,
                    as_json=args.json)


def _metrics(args: argparse.Namespace) -> int:
    from slipstream.daemon.ops.metrics import run_metrics

    return run_metrics(args.dir, args.address)


def _demo(args: argparse.Namespace) -> int:
    from slipstream.daemon.demo import run_demo

    return run_demo(directory=args.dir, rate=args.rate, size=args.size, duration=args.duration,
                    slow_consumer=args.slow_consumer, policy=args.policy)


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return seconds


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (the commands' and ``slipstream sim``'s)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {low}")
        return value
    return parse


def non_negative_number(text: str) -> float:
    """An argparse type: a finite number >= 0 (seconds, milliseconds, Mbit/s: the option's)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{value} is not a number >= 0 (and finite)")
    return value


def _demo_message_size(text: str) -> int:
    """A demo message size, bytes (:func:`~slipstream.daemon.demo.check_message_size`;
    ``--slow-consumer``'s shorter limit is checked by run_demo, which knows whether it is
    asked for)."""
    from slipstream.daemon.demo import check_message_size

    size = int_at_least(-(2**63))(text)
    try:
        check_message_size(size)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(e.problem) from None
    return size


class _VersionAction(argparse.Action):
    """``--version``: argparse's own, but reading the version only when asked (importing
    importlib.metadata is ~10-30 ms that every command would pay)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None,
                 ) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(f"{DISTRIBUTION} {version()}")
        parser.exit()


def new_parser() -> tuple[argparse.ArgumentParser, Commands]:
    """The ``slipstream`` command's parser, with ``--version`` and no command yet, and the
    set its commands are added to (:func:`add_commands`, ``slipstream.sim.cli``'s)."""
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Aeron-style media driver: reliable UDP and shared-memory streams.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the installed distribution's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, commands


def build_parser() -> argparse.ArgumentParser:
    """The parser of the driver's commands alone (``python -m slipstream.daemon.cli``)."""
    parser, commands = new_parser()
    add_commands(commands)
    return parser


def _directory_command(commands: Commands, name: str, *, help: str,
                       description: str) -> argparse.ArgumentParser:
    """A command for the driver directory ``--dir`` (its argument, the one default for
    all of them): ``stat`` and ``metrics`` read the driver there, ``demo`` starts one."""
    command = commands.add_parser(name, help=help, description=description)
    command.add_argument("--dir", help="driver directory (default: $SLIPSTREAM_DIR or "
                                       "/dev/shm/slipstream-<user>)")
    return command


def add_commands(commands: Commands) -> None:
    """Add ``driver``, ``stat``, ``metrics`` and ``demo`` to ``commands``; each sets ``func``,
    which :func:`main` calls with the parsed arguments."""
    from slipstream.daemon.config import add_arguments

    driver = commands.add_parser(
        "driver", help="run the media driver in the foreground",
        description="Run the media driver in the foreground. The first SIGTERM/SIGINT drains "
                    "it (no new credit; what the logs hold is sent and read, for at most "
                    "drain_timeout), the second stops it at once. Settings: config file < "
                    "SLIPSTREAM_* environment < command line; --print-config shows every "
                    "key with its value and where it came from. Exit 3 when a live driver "
                    "holds the directory, 4 when the directory is not a driver's to use, 2 "
                    "for any other error (a bad setting).")
    add_arguments(driver)
    driver.add_argument("--stop-when-stdin-closes", action="store_true",
                        help="drain and stop, as at the first SIGTERM, when standard input "
                             "ends: for a driver whose starter holds a pipe to it "
                             "(MediaDriver.launch), so that it goes with its starter")
    driver.set_defaults(func=_driver)

    stat = _directory_command(
        commands, "stat", help="show the driver's counters as a live table",
        description="Show what the driver in --dir is doing, read from its files (the driver "
                    "is not asked): per stream the positions a message passes (pub-lmt, "
                    "pub-pos of IPC streams, snd-pos, snd-lmt, rcv-hwm, rcv-pos, sub-pos; '-' for "
                    "what a stream does not have), the driver's "
                    "counters with rates, the loss report, the error log and every counter. "
                    "Refreshes until Ctrl-C; the header flags a driver that died or whose "
                    "heartbeat is older than the default driver_timeout (10 s), and a new "
                    "driver in the "
                    "directory is shown from the next refresh. Exit 2 without a driver or "
                    "when the directory is another user's; 1 when only a dead "
                    "driver's error log is left (it is printed).")
    stat.add_argument("--interval", type=_positive_seconds, default=1.0,
                      help="refresh period in seconds (default: %(default)s)")
    stat.add_argument("--once", action="store_true", help="print one snapshot and exit")
    stat.add_argument("--match", default="",
                      help="only counters and loss-report entries whose label contains this "
                           "(a channel, 'stream=7', a counter's name; a number at its end is "
                           "whole: 'stream=7' is not 'stream=77'); the stream tables are made "
                           "from the counters that match (default: all)")
    stat.add_argument("--json", action="store_true",
                      help="print one snapshot as JSON (streams, driver, loss report, errors, "
                           "counters)")
    stat.set_defaults(func=_stat)

    metrics = _directory_command(
        commands, "metrics", help="serve the driver's counters to Prometheus",
        description="Serve the counters of the driver in --dir as Prometheus metrics at "
                    "http://ADDRESS/metrics, read at each scrape; the driver is not touched.")
    metrics.add_argument("--address", default="127.0.0.1:9100",
                         help="host:port to listen on (default: %(default)s, loopback only)")
    metrics.set_defaults(func=_metrics)

    demo = _directory_command(
        commands, "demo",
        help="a driver, a publisher and a subscriber with live rates (Ctrl-C stops)",
        description="Start a driver and two streams, one over IPC and one over UDP multicast "
                    "on loopback (1 % of its datagrams dropped, so NAKs and retransmits "
                    "show), each with a publisher and a subscriber process, and print "
                    "their rates, NAKs, retransmits and flow-control limits every second. "
                    "Ctrl-C or SIGTERM stops all of it (exit 0). Exit 2 for a bad argument, "
                    "or when the demo's driver or one of its processes ends on its own.")
    demo.add_argument("--rate", type=int_at_least(0), default=100_000,
                      help="messages per second (0: as fast as possible; default: "
                           "%(default)s)")
    demo.add_argument("--size", type=_demo_message_size, default=64,
                      help="message size in bytes, 8 to 2 MiB (128 KiB with --slow-consumer; "
                           "default: %(default)s)")
    demo.add_argument("--duration", type=non_negative_number, default=0.0,
                      help="stop after this many seconds of streaming, counted once every "
                           "stream carries messages (0: run until Ctrl-C; default: "
                           "%(default)s)")
    demo.add_argument("--slow-consumer", action="store_true",
                      help="a third stream whose subscriber slows down every other 2 s: its "
                           "back-pressure episodes and policy show live")
    demo.add_argument("--policy", default=None,
                      help="the slow stream's publication policy, as policy= in a URI "
                           "(block, drop-newest, error, rate-limit,messages:N; default block); "
                           "with --slow-consumer only")
    demo.set_defaults(func=_demo)


def main(argv: Sequence[str] | None = None,
         parser: argparse.ArgumentParser | None = None) -> int:
    """Parse ``argv`` (default: the command line) with ``parser`` (default:
    :func:`build_parser`'s) and run its command; returns the exit status: the command's, 2
    for a :class:`SlipstreamError` (printed), :data:`EXIT_ALREADY_RUNNING` and
    :data:`EXIT_DIRECTORY_REFUSED` for ``driver``'s refusals, 130 after Ctrl-C."""
    args = (parser or build_parser()).parse_args(argv)
    try:
        return args.func(args)
    except SlipstreamError as e:
        print(f"slipstream {args.command}: {e}", file=sys.stderr)
        if args.command == "driver" and isinstance(e, DriverAlreadyRunningError):
            return EXIT_ALREADY_RUNNING
        if args.command == "driver" and isinstance(e, DriverDirectoryError):
            return EXIT_DIRECTORY_REFUSED
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
