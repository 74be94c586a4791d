"""``slipstream-archive``: the archive service and its operator's commands.

    slipstream-archive run --config FILE      record the configured streams until SIGTERM
    slipstream-archive list [--dir DIR | --config FILE]
    slipstream-archive describe ID [...]
    slipstream-archive verify [ID] [...]       scan segments for torn or invalid frames
    slipstream-archive purge ID [...]          delete a recording (the service stopped)

Exit status: 0 done; 1 a failure named on stderr (verify: a problem found); 2 bad usage or
settings.
"""

from __future__ import annotations

import argparse
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
from slipstream.archive.recovery import verify
from slipstream.archive.retention import purge
from slipstream.archive.service import ArchiveService, lock_directory
from slipstream.archive.settings import ArchiveSettings, ArchiveSettingsError, load_settings
from slipstream.client.errors import SlipstreamError

PROG = "slipstream-archive"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="slipstream's archive: streams "
                                     "recorded to segment files (docs/ARCHIVE.md)")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="record the streams of the settings until SIGTERM")
    run.add_argument("--config", required=True, type=Path, help="the settings (TOML; "
                     "config/archive.toml documents every key)")
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
    return parser


def _directory(args: argparse.Namespace) -> Path:
    if args.dir is not None:
        return args.dir
    if args.config is not None:
        return load_settings(args.config).dir
    return ArchiveSettings().dir


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


def _run(config: Path) -> int:
    settings = load_settings(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    service = ArchiveService(settings)
    logging.getLogger("slipstream.archive").info(
        "archive in %s: %d streams to record, sync %s", settings.dir, len(settings.records),
        settings.sync.value)
    service.run(lambda: stopping)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``slipstream-archive``; see the module."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args.config)
        directory = _directory(args)
        if args.command == "purge":
            with _open_catalog(directory, writable=True) as catalog:
                lock = lock_directory(directory)
                try:
                    removed = purge(catalog, directory, args.id)
                finally:
                    os.close(lock)
            print(f"recording {args.id} purged: {len(removed)} segment files removed")
            return 0
        with _open_catalog(directory) as catalog:
            if args.command == "list":
                print(f"{'id':>6} {'state':8} {'ended':16} {'stream':>8} {'session':>11} "
                      f"{'start':>14} {'stop':>14}  channel")
                for d in catalog.recordings(include_deleted=args.all):
                    stop = "-" if d.stop_position == NULL_POSITION else d.stop_position
                    print(f"{d.recording_id:>6} {d.state.name.lower():8} "
                          f"{d.end_reason.name.lower():16} {d.stream_id:>8} {d.session_id:>11}"
                          f" {d.start_position:>14} {stop!s:>14}  {d.channel}")
                return 0
            if args.command == "describe":
                descriptor = catalog.get(args.id)
                if descriptor is None:
                    raise KeyError(f"no recording {args.id} in {catalog.path}")
                print(_describe(descriptor))
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
    except (CatalogError, OSError, SlipstreamError, RuntimeError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
