"""The simulator with many hosts: a multicast group bigger than the sender's old pool of
retransmit actions, its feedback, and the addresses of hosts past 255 (bench/sim_scale.py
measures the same from 50 to 500 hosts)."""

from __future__ import annotations

from slipstream.client.counters import SystemCounter
from slipstream.sim.network import LinkFaults
from slipstream.sim.runner import Simulation
from slipstream.sim.scenario import (
    MAX_HOSTS,
    Scenario,
    ScenarioError,
    host_index,
    host_ip,
    scenario_from_mapping,
)

#: 1 publisher and 39 receivers, each link losing 5 %: nearly every datagram is lost by one of
#: them (1 - 0.95**39 = 86 %), more distinct losses a linger than Aeron's 16 retransmit
#: actions hold (which made this group send its sender 7x the NAKs).
GROUP = Scenario(hosts=40, messages=150, size=1024, seed=7,
                 faults=LinkFaults(loss=0.05, delay_ms=1.0))


def _run(scenario: Scenario) -> tuple[str, dict[str, int], int, int]:
    """The trace digest, the sender's system counters, the NAKs all receivers sent, and the
    datagrams the links from the sender lost."""
    with Simulation(scenario) as sim:
        report = sim.run()
        assert report.completed, report.format_text()
        sender = sim.publisher
        lost = sum(link.stats.lost for (src, _dst), link in sim.network.links.items()
                   if src == sender.ip)
        return report.trace_digest, sender.counters(), report.naks, lost


def test_a_forty_host_multicast_group_repeats_its_run_and_suppresses_its_naks():
    digest, counters, naks_sent, lost = _run(GROUP)
    assert (digest, counters, naks_sent, lost) == _run(GROUP)  # same seed, same run
    naks = counters["NAK_MESSAGES_RECEIVED"]
    assert lost > 200  # about 290: each receiver lost some, nearly every datagram someone
    # A receiver NAKs a loss unless the repair another asked for reaches it first: without
    # that suppression, or with NAKs dropped for want of an action and asked again, the
    # sender gets at least one NAK per receiver's loss (an unsuppressed 16-action run: 1.6).
    assert naks_sent < lost / 2, (naks_sent, lost)
    assert naks <= naks_sent
    assert counters.get("RETRANSMIT_OVERFLOW", 0) == 0, counters
    # Each retransmission answers several receivers' losses at once.
    assert counters["RETRANSMITS_SENT"] < lost / 2
    assert counters[SystemCounter.STATUS_MESSAGES_RECEIVED.name] > 0


def test_hosts_past_255_have_addresses_in_a_slash_16_and_names_that_parse_back():
    assert [host_ip(i) for i in (1, 254, 255, 256, 500, MAX_HOSTS)] == [
        "10.0.0.1", "10.0.0.254", "10.0.0.255", "10.0.1.0", "10.0.1.244", "10.0.255.254"]
    for index in (1, 255, 256, 500, MAX_HOSTS):
        assert host_index(host_ip(index)) == index
    for ip in ("10.0.0.0", "10.0.255.255", "10.1.0.1", "10.0.256.1", "10.0.1", "x"):
        assert host_index(ip) is None, ip
    scenario = scenario_from_mapping({"scenario": {"hosts": 300},
                                      "link": [{"from": "10.0.1.0", "to": 1, "loss": 0.5}]})
    assert (scenario.links[0].src, scenario.links[0].dst) == (256, 1)
    try:
        Scenario(hosts=MAX_HOSTS + 1)
    except ScenarioError as e:
        assert str(e) == f"hosts: at most {MAX_HOSTS}, not {MAX_HOSTS + 1}"
    else:
        raise AssertionError("a scenario of more hosts than addresses was taken")
