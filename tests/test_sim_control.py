"""The retransmit budget against real loss (docs/DRIVER.md §5.7, issue 59), in the simulator
with the driver's own agents: receivers that lose 10-20 % of the datagrams on their links
still get every message exactly once, in order, with the budget at its default, which holds
a NAK flood to a share of what the stream sends (tests/test_control_binding.py)."""

from __future__ import annotations

import pytest

from slipstream.sim.network import LinkFaults
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import Scenario

S = 1_000_000_000
MESSAGES = 20_000
FRAME = 1056  # a 1 KiB message and its header


@pytest.mark.parametrize(("hosts", "loss"), [(2, 0.10), (2, 0.20), (4, 0.10), (4, 0.20)])
def test_receivers_under_heavy_loss_recover_everything_within_the_budget(
        hosts: int, loss: float) -> None:
    """Unicast (2 hosts) or multicast under fc=min (4; three receivers admitted at the
    stream's start): every link loses ``loss`` of its datagrams, both ways (data, NAKs,
    retransmissions and status messages alike), for 20,000 messages at 20,000 a second.
    The budget never refuses a NAK of theirs (nothing is missing, no NAK dropped), and the
    publisher sent less than twice the stream's own bytes."""
    channel = "term-length=1m" + ("|fc=min" if hosts > 2 else "")
    scenario = Scenario(hosts=hosts, messages=MESSAGES, seed=11, publish_rate=20_000,
                        channel_params=channel, max_virtual_ns=60 * S,
                        faults=LinkFaults(loss=loss, delay_ms=0.5))
    with Simulation(scenario) as sim:
        report = sim.run()
    assert report.exactly_once_in_order, report.format_text()
    publisher = report.counters["10.0.0.1"]
    assert publisher.get("RETRANSMITS_SENT", 0) > 0
    assert publisher.get("NAK_BUDGET_DROPS", 0) == 0
    assert publisher.get("NAK_UNKNOWN_SOURCE_DROPS", 0) == 0
    assert MESSAGES * FRAME < publisher["BYTES_SENT"] < 2 * MESSAGES * FRAME
