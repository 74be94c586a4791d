"""Chaos: publishers, subscribers and the driver killed with SIGKILL at random points and
replaced (slipstream.sim.real.chaos; ``bench/chaos.py`` runs it for minutes)."""

from __future__ import annotations

import pytest

from slipstream.sim.real.chaos import run_chaos

pytestmark = pytest.mark.timeout(120)


def test_kills_lose_nothing_a_session_accepted_and_leak_nothing() -> None:
    report = run_chaos(14, kill_interval=0.4, driver_kill_interval=6, seed=7)
    print(report.format_text())
    assert report.publisher_kills and report.subscriber_kills and report.driver_kills == 2
    assert report.sequence_errors == 0
    assert report.leaked == []
    assert report.delivered > 10_000 and report.accepted > 5_000
