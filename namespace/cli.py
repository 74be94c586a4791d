"""The ``slipstream`` command (also ``python -m slipstream``): the driver's commands
(``driver``, ``stat``, ``metrics``, ``demo``: :mod:`slipstream.daemon.cli`) and the
simulator's (``sim``: :mod:`slipstream.sim.cli`), with ``--version``.  It sits above both: the
simulator builds its drivers from the daemon's parts, and the daemon imports nothing of the
simulator (tests/test_layers.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from slipstream.daemon import cli as daemon_cli
from slipstream.sim import cli as sim_cli


def build_parser() -> argparse.ArgumentParser:
    """The ``slipstream`` command's parser: every command."""
    parser, commands = daemon_cli.new_parser()
    daemon_cli.add_commands(commands)
    sim_cli.add_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``slipstream`` command on ``argv`` (default: the command line); returns its
    exit status (:func:`slipstream.daemon.cli.main`)."""
    return daemon_cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
