"""Containers on two namespace hosts (``NamespaceHosts``): on each host a driver container and
application containers beside it, podman run inside the host's network namespace with
``--network=host``, which is then the host's network.  Podman enters the namespace by
``nsenter --net``, not ``ip netns exec``, which also mounts a /sys of its own without the
cgroup file systems runc needs ("no cgroup mount found in mountinfo").  One stream goes over
UDP unicast from host 1 to host 2, another by dynamic multi-destination-cast (host 1's
control address, host 2 joining by its status messages), at once.

Needs root, podman and iproute2: skips without, fails under CI=true.
"""

from __future__ import annotations

import pytest
from containers import Containers

pytestmark = pytest.mark.timeout(900)  # the session's image build, the first time

MESSAGES = 5000


def test_containers_on_two_hosts_carry_a_stream_over_udp_and_over_dynamic_mdc(
        containers: Containers, hosts) -> None:
    one, two = hosts[1], hosts[2]
    on = {host.index: ("nsenter", f"--net=/run/netns/{host.namespace}") for host in (one, two)}
    drivers = {i: containers.driver(f"driver-{i}", prefix=on[i], network="host")
               for i in (1, 2)}
    streams = {
        "udp": (f"aeron:udp?endpoint={two.address}:40456",) * 2,
        "mdc": (f"aeron:udp?control={one.address}:40458|control-mode=dynamic",
                f"aeron:udp?endpoint={two.address}:40457|control={one.address}:40458"),
    }
    started = []
    for stream_id, (kind, (publication, subscription)) in enumerate(streams.items(), 1001):
        started.append((kind, 2, containers.client(
            f"subscriber-{kind}", drivers[2], "slipstream-sample", "subscribe", subscription,
            str(stream_id), f"--count={MESSAGES}", prefix=on[2], network="host")))
        started.append((kind, 1, containers.client(
            f"publisher-{kind}", drivers[1], "slipstream-sample", "publish", publication,
            str(stream_id), f"--count={MESSAGES}", "--size=512", prefix=on[1],
            network="host")))
    for kind, host, name in started:
        log = containers.assert_succeeds(name, prefix=on[host])
        expected = (f"received {MESSAGES} in order (0..{MESSAGES - 1})"
                    if "subscriber" in name else f"published {MESSAGES}")
        assert expected in log, (kind, log)
