"""Response channels (docs/CHANNELS.md §7.6) to a client behind a NAT and a firewall, on
namespace hosts: host 1 serves, host 2's own iptables rewrites the source port of every UDP
datagram it sends (a port-rewriting NAT) and drops every UDP datagram that comes in but
the answers to what it sent (a stateful firewall).  The server cannot reach the client's
endpoint, and its response stream still reaches the client's response subscription, through
the NAT's port for it.

Needs root (CI runs as root): skips without it, fails under CI=true.
"""

from __future__ import annotations

import time

import pytest
from helpers import NETWORK_SETTINGS, Collector, message, wait_for
from test_response_channels import (
    REQUESTS,
    add_request_publication,
    add_response_publication,
    add_response_subscription,
)

from slipstream.client import Client

pytestmark = pytest.mark.timeout(120)

PLAIN = 1003
PORT, CONTROL_PORT, CLIENT_PORT = 40123, 40124, 40125
NAT_PORTS = (20000, 29999)


def _behind_nat_and_firewall(host) -> None:
    low, high = NAT_PORTS
    host.run("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", host.veth, "-p", "udp",
             "-j", "SNAT", "--to-source", f"{host.address}:{low}-{high}", "--random")
    host.run("iptables", "-A", "INPUT", "-i", host.veth, "-p", "udp", "-m", "conntrack",
             "!", "--ctstate", "ESTABLISHED,RELATED", "-j", "DROP")


def test_the_response_stream_reaches_a_client_behind_a_nat_and_a_firewall(hosts) -> None:
    """A stream the server publishes to the client's endpoint never connects (the firewall);
    the request stream arrives from a NAT port, not the client's; and 3,000 requests and
    their responses (terms rotating both ways) go through, exactly once, in order."""
    server_driver = hosts.start_driver(1, **NETWORK_SETTINGS)
    client_driver = hosts.start_driver(2, **NETWORK_SETTINGS)
    server_ip, client_ip = hosts[1].address, hosts[2].address
    _behind_nat_and_firewall(hosts[2])
    with Client.connect(server_driver.directory) as server, \
            Client.connect(client_driver.directory) as client:
        blocked = client.add_subscription(f"aeron:udp?endpoint={client_ip}:{CLIENT_PORT}",
                                          PLAIN)
        pushed = server.add_publication(f"aeron:udp?endpoint={client_ip}:{CLIENT_PORT}", PLAIN)

        requests = server.add_subscription(f"aeron:udp?endpoint={server_ip}:{PORT}", REQUESTS)
        responses = add_response_subscription(client, CONTROL_PORT, host=server_ip)
        request_publication = add_request_publication(client, PORT, responses, host=server_ip)
        wait_for(lambda: requests.images, timeout=15, what="the request image")
        [request_image] = requests.images
        host, port = request_image.source_identity.rsplit(":", 1)
        assert host == client_ip and NAT_PORTS[0] <= int(port) <= NAT_PORTS[1]
        response = add_response_publication(server, CONTROL_PORT, request_image, host=server_ip)
        wait_for(lambda: responses.images and response.is_connected
                 and request_publication.is_connected, timeout=15,
                 what="the response stream connected through the NAT")

        count, sent, echoed = 3000, 0, 0
        asked, answered = Collector(request_image), Collector(responses)
        deadline = time.monotonic() + 60
        while len(answered.seen) < count:
            assert time.monotonic() < deadline, (sent, len(asked.seen), len(answered.seen))
            while sent < count and request_publication.offer(message(sent, 1000)) > 0:
                sent += 1
            asked.poll()
            while echoed < len(asked.seen) and response.offer(
                    message(asked.seen[echoed], 1000)) > 0:
                echoed += 1
            if not answered.poll():
                time.sleep(0)
        asked.assert_exactly(count)
        answered.assert_exactly(count)
        # Meanwhile (seconds), the stream to the client's own endpoint never got in.
        assert not pushed.is_connected and not blocked.images
