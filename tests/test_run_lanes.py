"""`make test` runs every lane: scripts/run-lanes' groups cover each lane of tests/conftest.py
exactly once."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import LANES

RUN_LANES = Path(__file__).resolve().parent.parent / "scripts" / "run-lanes"


def _groups() -> list[tuple[int, list[str]]]:
    """(nice level, lanes) of each group the script starts."""
    text = RUN_LANES.read_text()
    block = re.search(r"^groups=\(\n(.*?)^\)", text, re.M | re.S)
    assert block is not None, "scripts/run-lanes has no groups=( ... ) array"
    groups = []
    for entry in re.findall(r'"(\d+)\|([^"|]+)(?:\|[^"]*)?"', block.group(1)):
        groups.append((int(entry[0]), entry[1].split(" or ")))
    return groups


def test_the_groups_of_make_test_run_every_lane_once() -> None:
    lanes = [lane for _, group in _groups() for lane in group]
    assert sorted(lanes) == sorted(LANES), (
        f"scripts/run-lanes runs {lanes}; tests/conftest.py's lanes are {LANES}: "
        "each lane in exactly one group")


def test_the_lanes_that_run_drivers_keep_their_cpu_and_the_computing_ones_are_niced() -> None:
    levels = {lane: level for level, group in _groups() for lane in group}
    assert all(levels[lane] == 0 for lane in ("sockets", "hosts", "interop", "spark"))
    assert all(levels[lane] > 0 for lane in ("unit", "sim", "untimed", "containers", "arm64",
                                                      "installed"))
