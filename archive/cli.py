"""``slipstream-archive``: the archive service and its operator's commands.

    slipstream-archive run [--config FILE] [--dir DIR] [--set KEY=VALUE ...] [--print-config]
                                               record the configured streams until SIGTERM
    slipstream-archive list [--dir DIR | --config FILE]
    slipstream-archive describe ID [...]       (list and describe: live positions too)
    slipstream-archive replay ID [--channel URI --stream N] [--from POS | --from-time ISO]
                       [--to POS] [--config FILE]   print a replay, or have it sent there
                       [--key NAME]                 through the control endpoint of that key
                       [--archive HOST:PORT[/STREAM][|key=NAME] ...]   from several archives
    slipstream-archive verify [ID] [...]       scan segments for torn or invalid frames
    slipstream-archive purge ID [...]          delete a recording (the service stopped)

Exit status: 0 done; 1 a failure named on stderr (verify: a problem found); 2 bad usage or
settings.

Every command reads the settings as the service does: defaults < ``--config`` file <
``SLIPSTREAM_ARCHIVE_<KEY>`` environment < ``run``'s ``--dir`` and ``--set`` (config/archive.toml
documents every key).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from slipstream.archive.catalog import (
    CATALOG_FILE,
    NULL_POSITION,
    Catalog,
    CatalogError,
    RecordingDescriptor,
)
from slipstream.archive.client import ArchiveClient
from slipstream.archive.locate import read_session
from slipstream.archive.reading import RecordingLostError, live_positions
from slipstream.archive.recovery import verify
from slipstream.archive.retention import purge
from slipstream.archive.service import ArchiveService, lock_directory
from slipstream.archive.settings import (
    ArchiveSettings,
    ArchiveSettingsError,
    add_arguments,
    format_settings,
    load_settings,
    load_settings_from_args,
    parse_peer,
)
from slipstream.client import Client
from slipstream.client.control import default_driver_directory
from slipstream.client.errors import SlipstreamError

PROG = "slipstream-archive"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="slipstream's archive: streams "
                                     "recorded to segment files (docs/ARCHIVE.md)")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="record the streams of the settings until SIGTERM")
    add_arguments(run)
    for name, text in (("list", "the recordings of the catalog"),
                       ("describe", "every field of one recording"),
                       ("verify", "scan the segments of one recording (or all) for torn or "
                                  "invalid frames; changes nothing"),
                       ("purge", "delete one recording's segments and mark it deleted (with "
                                 "the service stopped)")):
        command = commands.add_parser(name, help=text)
        if name in ("describe", "purge"):
            command.add_argument("id", type=int, help="recording id")
        elif name == "verify":
            command.add_argument("id", type=int, nargs="?", help="recording id (all if none)")
        where = command.add_mutually_exclusive_group()
        where.add_argument("--dir", type=Path, help="the archive directory")
        where.add_argument("--config", type=Path, help="the settings whose dir to use")
        if name == "list":
            command.add_argument("--all", action="store_true", help="deleted ones too")
    replay = commands.add_parser("replay", help="replay a recording through the running "
                                 "archive: printed here, or sent to --channel/--stream")
    replay.add_argument("id", type=int, help="recording id")
    replay.add_argument("--config", type=Path, help="the archive's settings (its control "
                        "stream and driver directory; default: the defaults)")
    replay.add_argument("--channel", help="send the replay to this channel (a subscriber "
                        "there reads it) instead of printing it")
    replay.add_argument("--stream", type=int, help="the stream id on --channel")
    start = replay.add_mutually_exclusive_group()
    start.add_argument("--from", dest="start", type=int, help="start position (default: the "
                       "recording's start)")
    start.add_argument("--from-time", help="start at the time index's position for this "
                       "time (ISO 8601, e.g. 2026-11-28T08:00:00Z)")
    replay.add_argument("--to", type=int, help="end position (default: follow the recording "
                        "until it stops)")
    replay.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the "
                        "archive's answer")
    replay.add_argument("--archive", action="append", default=[],
                        metavar="HOST:PORT[/STREAM][|key=NAME]",
                        help="another archive recording the same stream (repeatable): the "
                        "recording's session is read from --from to --to (or as far as "
                        "recorded) piece by piece from whichever holds it, this one first; "
                        "|key=NAME: its control endpoint keyed NAME")
    replay.add_argument("--key", help="call the archive's control endpoint of this key (its "
                        "control_keys): needed for a recording of key=NAME, whose replay "
                        "comes sealed under it")
    return parser


def _directory(args: argparse.Namespace) -> Path:
    return args.dir if args.dir is not None else _settings(args).dir


def _time(ms: int) -> str:
    if ms < 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def _describe(descriptor: RecordingDescriptor) -> str:
    stop = "-" if descriptor.stop_position == NULL_POSITION else str(descriptor.stop_position)
    rows = [
        ("recording id", descriptor.recording_id),
        ("state", descriptor.state.name.lower()),
        ("ended", descriptor.end_reason.name.lower().replace("_", " ")),
        ("channel", descriptor.channel),
        ("stream id", descriptor.stream_id),
        ("session id", descriptor.session_id),
        ("source identity", descriptor.source_identity),
        ("start position", descriptor.start_position),
        ("stop position", stop),
        ("start time", _time(descriptor.start_time_ms)),
        ("stop time", _time(descriptor.stop_time_ms)),
        ("initial term id", descriptor.initial_term_id),
        ("term length", descriptor.term_length),
        ("segment length", descriptor.segment_length),
        ("mtu", descriptor.mtu),
    ]
    return "\n".join(f"{name:16} {value}" for name, value in rows)


def _open_catalog(directory: Path, *, writable: bool = False) -> Catalog:
    if not (directory / CATALOG_FILE).exists():
        raise CatalogError(f"no archive catalog in {directory} ({CATALOG_FILE})")
    return Catalog.open(directory, writable=writable)


def _settings(args: argparse.Namespace) -> ArchiveSettings:
    return load_settings(getattr(args, "config", None))


def _live_positions(args: argparse.Namespace) -> dict[int, int]:
    """The archive's live recordings' recorded positions from the driver's counters (the
    driver of the settings named, else the default one); none when no driver is there."""
    settings = _settings(args)
    return live_positions(settings.driver_dir or default_driver_directory(),
                          _directory(args))


def _recorded(descriptor: RecordingDescriptor, live: dict[int, int]) -> str:
    """How far a recording is recorded: a stopped one's stop, a live one's counter (``?``
    when its counter is not found: the archive is not running, or another driver's)."""
    if descriptor.stop_position != NULL_POSITION:
        return str(descriptor.stop_position)
    return str(live.get(descriptor.recording_id, "?"))


def _epoch_ms(text: str) -> int:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ArchiveSettingsError("--from-time", f"{text!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def _replay(args: argparse.Namespace) -> int:
    """``replay``: forwarded to --channel/--stream, or received here and printed, one line
    per message (its end position, length and first bytes), until its end (or the
    recording's stop; Ctrl-C stops it)."""
    settings = _settings(args)
    if (args.channel is None) != (args.stream is None):
        raise ArchiveSettingsError("--stream", "give --channel and --stream together")
    port = _control_port(args, settings)
    from_time = None if args.from_time is None else _epoch_ms(args.from_time)
    if args.archive:
        if args.channel is not None or from_time is not None:
            raise ArchiveSettingsError("--archive", "reads here, by position: not with "
                                       "--channel or --from-time")
        return _replay_session(args, settings, port)
    with Client.connect(settings.driver_dir) as client, \
            ArchiveClient(client, settings.control_address, port, settings.control_stream_id,
                          timeout_s=args.timeout, key=args.key) as archive:
        if args.channel is not None:
            started = archive.start_replay(args.id, args.channel, args.stream,
                                           start=args.start, end=args.to,
                                           from_time_ms=from_time)
            end = "its stop" if started.end is None else started.end
            print(f"replay {started.replay_id}: recording {args.id} from {started.start} to "
                  f"{end}, to {args.channel} stream {args.stream} (session "
                  f"{started.session_id})")
            return 0

        with archive.replay(args.id, start=args.start, end=args.to,
                            from_time_ms=from_time) as replay:
            print(f"replay {replay.replay_id}: recording {args.id} from {replay.start}")
            print(f"{'position':>14} {'length':>8}  first bytes")
            try:
                while not replay.done:
                    if replay.poll(_show, 256) == 0:
                        replay.wait(0.1)
            except KeyboardInterrupt:
                pass
    return 0


def _show(data: memoryview, header: object) -> None:
    """One line per message: its end position, length and first bytes."""
    head = bytes(data[:24])
    print(f"{header.position:>14} {len(data):>8}  {head.hex()}")  # type: ignore[attr-defined]


def _control_port(args: argparse.Namespace, settings: ArchiveSettings) -> int:
    """The archive's control port a command calls: its plain one, or ``--key``'s."""
    if args.key is not None:
        port = settings.control_keys.get(args.key)
        if port is None:
            known = ", ".join(settings.control_keys) or "none"
            raise ArchiveSettingsError("--key", f"{args.key!r} is not one of the archive's "
                                       f"control_keys ({known})")
        return port
    if not settings.control_port:
        raise ArchiveSettingsError("control_port", "0: the archive takes no plain calls "
                                   "(--key NAME calls a keyed endpoint)")
    return settings.control_port


def _replay_session(args: argparse.Namespace, settings: ArchiveSettings, port: int) -> int:
    """``replay ID --archive ...``: the session of recording ID read from this archive (at
    its control ``port``) and the others, failing over
    (:func:`~slipstream.archive.locate.read_session`)."""
    peers = [parse_peer(text, "--archive") for text in args.archive]
    with Client.connect(settings.driver_dir) as client, contextlib.ExitStack() as links:
        archives = [links.enter_context(ArchiveClient(
            client, settings.control_address, port, settings.control_stream_id,
            timeout_s=args.timeout, key=args.key))]
        archives += [links.enter_context(ArchiveClient(
            client, peer.address, peer.port, peer.control_stream_id, timeout_s=args.timeout,
            key=peer.key)) for peer in peers]
        d = archives[0].describe(args.id).descriptor
        start = d.start_position if args.start is None else args.start
        print(f"session {d.session_id} of recording {args.id}, from {start}, from "
              f"{len(archives)} archives")
        print(f"{'position':>14} {'length':>8}  first bytes")
        try:
            # Closed on Ctrl-C too: a replay being read stops at its archive then.
            reader = links.enter_context(contextlib.closing(read_session(
                archives, d.stream_id, d.session_id, (d.initial_term_id, d.term_length),
                start, args.to, directory=settings.dir)))
            for chunk in reader:
                for i in range(len(chunk)):
                    at = chunk.offsets[i]
                    head = bytes(chunk.data[at:at + min(24, chunk.lengths[i])])
                    print(f"{chunk.positions[i]:>14} {chunk.lengths[i]:>8}  {head.hex()}")
        except KeyboardInterrupt:
            pass
    return 0


def _run(args: argparse.Namespace) -> int:
    settings = load_settings_from_args(args)
    if args.print_config:
        sys.stdout.write(format_settings(settings))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    service = ArchiveService(settings)
    logging.getLogger("slipstream.archive").info(
        "archive in %s: %d streams to record, %d held, sync %s", settings.dir,
        len(settings.records), len(settings.holds), settings.sync.value)
    service.run(lambda: stopping)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``slipstream-archive``; see the module."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "replay":
            return _replay(args)
        directory = _directory(args)
        if args.command == "purge":
            # The lock first: opened writable, the catalog cuts a torn last descriptor,
            # which must not be one a running service is writing.
            lock = lock_directory(directory)
            try:
                with _open_catalog(directory, writable=True) as catalog:
                    removed = purge(catalog, directory, args.id)
            finally:
                os.close(lock)
            print(f"recording {args.id} purged: {len(removed)} segment files removed")
            return 0
        with _open_catalog(directory) as catalog:
            if args.command == "list":
                live = _live_positions(args)
                print(f"{'id':>6} {'state':8} {'ended':16} {'stream':>8} {'session':>11} "
                      f"{'start':>14} {'stop':>14} {'recorded':>14}  channel")
                for d in catalog.recordings(include_deleted=args.all):
                    stop = "-" if d.stop_position == NULL_POSITION else d.stop_position
                    print(f"{d.recording_id:>6} {d.state.name.lower():8} "
                          f"{d.end_reason.name.lower():16} {d.stream_id:>8} {d.session_id:>11}"
                          f" {d.start_position:>14} {stop!s:>14} {_recorded(d, live):>14}"
                          f"  {d.channel}")
                return 0
            if args.command == "describe":
                descriptor = catalog.get(args.id)
                if descriptor is None:
                    raise KeyError(f"no recording {args.id} in {catalog.path}")
                print(_describe(descriptor))
                print(f"{'recorded':16} {_recorded(descriptor, _live_positions(args))}")
                return 0
            # verify
            if args.id is not None:
                descriptor = catalog.get(args.id)
                if descriptor is None:
                    raise KeyError(f"no recording {args.id} in {catalog.path}")
                targets = [descriptor]
            else:
                targets = catalog.recordings()
            failed = False
            for descriptor in targets:
                report = verify(descriptor, directory)
                if report.ok:
                    print(f"recording {report.recording_id}: ok, {report.frames} frames in "
                          f"{report.segments} segments")
                else:
                    failed = True
                    for problem in report.problems:
                        print(f"recording {report.recording_id}: {problem}")
            return 1 if failed else 0
    except ArchiveSettingsError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except KeyError as e:
        print(f"{PROG}: {e.args[0]}", file=sys.stderr)
        return 1
    except RecordingLostError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except (CatalogError, OSError, SlipstreamError, RuntimeError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
