"""``slipstream-holder``: the standing holder's old command, which names what runs instead.

Streams are held for read queries by the archive (``slipstream-archive run``: its
``[[hold]]`` settings and the calls of :mod:`slipstream.archive.holding`), the one service
where a stream's past lives.  This command takes the holder's arguments, prints the archive's
settings that do the same, and exits 2 (docs/SPARK.md, "Moving from slipstream-holder").

The names the Spark options' defaults come from live here, in the client library.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Final

__all__ = ["DEFAULT_GROUP", "HOLDER_PORT", "main"]

#: The UDP port of the holding archive's control stream a ``holder`` option names when it
#: gives none (``replayPort``'s default too).
HOLDER_PORT: Final = 40190
#: The group of a query that names none (``holderGroup``).
DEFAULT_GROUP: Final = "spark"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream-holder",
        description="Replaced by the archive (slipstream-archive run): prints the archive "
                    "settings equivalent to these arguments and exits 2.")
    parser.add_argument("--dir", help="the driver directory")
    parser.add_argument("--address", default="0.0.0.0", help="the address to listen on")
    parser.add_argument("--port", type=int, default=HOLDER_PORT,
                        help=f"the UDP port of the control stream (default {HOLDER_PORT})")
    parser.add_argument("--hold", nargs=2, action="append", default=[],
                        metavar=("CHANNEL", "STREAM_ID"), help="a stream held from the start")
    parser.add_argument("--release-after", type=float, default=None, metavar="SECONDS",
                        help="release a group no query called for this long")
    return parser


def archive_settings(args: argparse.Namespace) -> str:
    """The archive's settings (TOML) that hold what ``args`` held, where they held it."""
    lines = ['dir = "/var/lib/slipstream-archive"  # its recordings (none unless [[record]])']
    if args.dir:
        lines.append(f"driver_dir = {json.dumps(args.dir)}")
    lines += [f"control_address = {json.dumps(args.address)}",
              f"control_port = {args.port}"]
    if args.release_after is not None:
        lines.append(f'release_after = "{args.release_after:g}s"')
    for channel, stream in args.hold:
        lines += ["", "[[hold]]", f"channel = {json.dumps(channel)}", f"stream_id = {stream}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print what to run instead; 2 (the command is refused)."""
    args = _parser().parse_args(argv)
    print("slipstream-holder: streams are held by the archive now; run\n\n"
          "    slipstream-archive run --config holder.toml\n\n"
          "with holder.toml (config/archive.toml documents every key):\n\n"
          f"{archive_settings(args)}\n\n"
          "Spark's holder=HOST[:PORT] option names that archive as it named this holder "
          "(docs/SPARK.md, \"Moving from slipstream-holder\").", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
