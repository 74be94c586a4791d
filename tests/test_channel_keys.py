"""Channel keys the driver once parsed and ignored, through real driver processes: ``stream-id``
is compared with the stream argument, the subnet form of ``interface=`` chooses the local
interface in that subnet among the addresses the transports give (never an IPv6 link-local
one; a unicast wildcard stays the wildcard; ``interface=``'s port is a unicast publication's
local port),
and ``tags``, ``session-id=tag:N`` and ``control=`` on a subscription are refused by name."""

from __future__ import annotations

import errno
import ipaddress
import json
import os

import pytest
import zmq
from helpers import connect, free_port, offer_until, wait_for

from slipstream.client import ChannelError, ChannelRejectedError, Client, control
from slipstream.client.channel import parse_channel
from slipstream.daemon.media.interfaces import (
    IFF_LOOPBACK,
    IFF_MULTICAST,
    IFF_UP,
    InterfaceAddress,
    address_in_subnet,
    local_addresses,
)


def _udp(suffix: str = "") -> str:
    return f"aeron:udp?endpoint=127.0.0.1:{free_port()}{suffix}"


# -- refused by name ------------------------------------------------------------------------

def test_channel_tags_are_refused_by_name_on_either_side(client: Client) -> None:
    for channel, part, why in [
            ("aeron:ipc?tags=1001", "tags", "channel tags"),
            ("aeron:ipc?tags=1001,7", "tags", "channel tags"),
            ("aeron:ipc?session-id=tag:7", "session-id", "session-id=tag:N"),
            (_udp("|tags=1001"), "tags", "channel tags"),
            ("aeron:udp?tags=1001", "tags", "channel tags"),  # a tag in place of the endpoint
            (_udp("|session-id=tag:7"), "session-id", "session-id=tag:N")]:
        for add in (client.add_publication, client.add_subscription):
            with pytest.raises(ChannelRejectedError, match=f"{part}: {why}.*not supported by "
                                                           f"this driver yet") as refused:
                add(channel, 1)
            assert refused.value.part == part, (channel, add)
    assert client.add_subscription("aeron:ipc", 1) is not None  # it serves on


def test_control_on_a_subscription_joins_there_and_is_refused_on_multicast(launch) -> None:
    """On a unicast subscription ``control=`` is the dynamic multi-destination-cast
    publication it joins (tests/test_mdc.py); one endpoint joins one control address, so a
    second subscription there that names another is refused by name; on a multicast
    subscription (whose control group is the endpoint's) it is refused; on a publication it
    is the socket's local address, and carried."""
    driver = launch()
    port, control_port = free_port(), free_port()
    uri = f"aeron:udp?endpoint=127.0.0.1:{port}|interface=127.0.0.1"
    with Client.connect(driver.directory) as client:
        with pytest.raises(ChannelRejectedError, match=r"control: control= on a multicast "
                                                       r"subscription") as refused:
            client.add_subscription(f"aeron:udp?endpoint=224.0.1.3:{port}|interface=127.0.0.1"
                                    f"|control=127.0.0.1:{control_port}", 2)
        assert refused.value.part == "control"
        joining = client.add_subscription(f"{uri}|control=127.0.0.1:{control_port}", 3)
        with pytest.raises(ChannelRejectedError, match="differs") as other:
            client.add_subscription(f"{uri}|control=127.0.0.1:{free_port()}", 3)
        assert other.value.part == "control"
        joining.close()
        uri = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|interface=127.0.0.1"
        subscription = client.add_subscription(uri, 2)
        publication = client.add_publication(f"{uri}|control=127.0.0.1:{control_port}", 2)
        connect(publication, subscription)
        assert subscription.images[0].source_identity == f"127.0.0.1:{control_port}"


# -- stream-id ------------------------------------------------------------------------------

@pytest.mark.parametrize("channel", ["aeron:ipc", "UDP"])
def test_a_stream_id_in_the_uri_must_be_the_stream_argument(client: Client,
                                                            channel: str) -> None:
    channel = channel.replace("UDP", _udp())
    separator = "|" if "?" in channel else "?"
    for add in (client.add_publication, client.add_subscription):
        with pytest.raises(ChannelError, match="stream-id: 1002 does not match the stream id "
                                               "1001") as refused:
            add(f"{channel}{separator}stream-id=1002", 1001)
        assert refused.value.part == "stream-id"
    publication = client.add_publication(f"{channel}{separator}stream-id=1001", 1001)
    subscription = client.add_subscription(f"{channel}{separator}stream-id=1001", 1001)
    connect(publication, subscription)


def test_the_driver_compares_stream_id_itself(driver) -> None:
    """A client that does not check (another implementation, an older one) is answered by
    the driver, naming the key and both ids."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(control.conductor_endpoint(driver.directory))

    def request(message: dict) -> dict:
        socket.send(json.dumps(message).encode())
        assert socket.poll(5000, zmq.POLLIN), "the driver did not answer"
        return control.decode(socket.recv())

    try:
        assert request({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                        "pid": 1, "process": 1, "correlation_id": 1})["type"] == control.CONNECTED
        for number, kind in enumerate((control.ADD_PUBLICATION, control.ADD_SUBSCRIPTION)):
            reply = request({"type": kind, "channel": "aeron:ipc?stream-id=5", "stream_id": 6,
                             "correlation_id": 2 + number})
            assert (reply["type"], reply["code"]) == (control.ERROR, control.ERR_INVALID_CHANNEL)
            assert reply["part"] == "stream-id"
            assert reply["problem"].startswith("5 does not match the stream id 6")
    finally:
        socket.close(0)


# -- interface=ADDRESS/PREFIX ---------------------------------------------------------------

def test_a_multicast_stream_flows_on_the_interface_a_subnet_names(launch) -> None:
    a, b = launch(), launch()
    group = f"aeron:udp?endpoint=224.0.1.5:{free_port()}"
    with Client.connect(a.directory) as ca, Client.connect(b.directory) as cb:
        subscription = cb.add_subscription(f"{group}|interface=127.0.0.0/8", 3)
        publication = ca.add_publication(f"{group}|interface=127.1.2.3/8", 3)  # host bits: any
        connect(publication, subscription)
        got: list[bytes] = []
        offer_until(publication, b"on the loopback")
        wait_for(lambda: subscription.poll(lambda d, _h: got.append(bytes(d)), 10)
                 or got, what="the message")
        assert got == [b"on the loopback"]
        assert subscription.images[0].source_identity.startswith("127.0.0.1:")


def test_a_unicast_publication_binds_the_address_and_port_interface_names(launch) -> None:
    """Aeron's local address of a unicast publication: interface='s address, and its port."""
    driver = launch()
    uri, local_port = _udp(), free_port()
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(uri, 4)
        publication = client.add_publication(f"{uri}|interface=127.0.0.1:{local_port}/8", 4)
        connect(publication, subscription)
        assert subscription.images[0].source_identity == f"127.0.0.1:{local_port}"


def test_a_unicast_wildcard_subnet_binds_the_wildcard(launch) -> None:
    """As Aeron's UdpChannel: ``interface=0.0.0.0/0`` on a unicast channel is any local
    address (the kernel's choice per destination), not one interface's."""
    driver = launch()
    uri, local_port = _udp(), free_port()
    with Client.connect(driver.directory) as client:
        subscription = client.add_subscription(f"{uri}|interface=0.0.0.0/0", 6)
        publication = client.add_publication(f"{uri}|interface=0.0.0.0:{local_port}/0", 6)
        connect(publication, subscription)
        assert subscription.images[0].source_identity == f"127.0.0.1:{local_port}"


def test_a_subnet_no_interface_is_in_is_refused_naming_interface_and_the_hosts_addresses(
        launch) -> None:
    driver = launch()
    taken = [a.address.network for a in local_addresses()]
    subnet = next(f"10.{n}.0.0/16" for n in range(256)
                  if not any(ipaddress.ip_network(f"10.{n}.0.0/16").overlaps(t)
                             for t in taken if t.version == 4))
    with Client.connect(driver.directory) as client:
        for add in (client.add_publication, client.add_subscription):
            with pytest.raises(ChannelRejectedError, match=f"interface: no interface of this "
                                                           f"host .* in {subnet}; its "
                                                           f"addresses: .*127.0.0.1/8") as no:
                add(_udp(f"|interface={subnet}"), 5)
            assert no.value.part == "interface"


def _address(name: str, text: str, flags: int = IFF_UP | IFF_MULTICAST) -> InterfaceAddress:
    return InterfaceAddress(name, flags, ipaddress.ip_interface(text))


@pytest.mark.unit
def test_the_interface_chosen_is_aerons() -> None:
    """Up and multicast (or the loopback); not the loopback first; then the narrowest network
    of the interface's first address in the subnet; then the first listed."""
    channel = parse_channel("aeron:udp?endpoint=127.0.0.1:1|interface=10.0.0.0/8")
    loopback = IFF_UP | IFF_LOOPBACK
    addresses = [_address("lo", "127.0.0.1/8", loopback),
                 _address("down0", "10.1.0.1/24", 0),
                 _address("nomc0", "10.1.0.2/24", IFF_UP),
                 _address("wide0", "10.2.0.1/16"),
                 _address("wide0", "10.3.0.1/30"),  # its second: Aeron looks at the first
                 _address("narrow0", "10.4.0.1/24"),
                 _address("narrow1", "10.5.0.1/24"),
                 _address("v6", "fd00::1/64")]

    def chosen(subnet: str, among: list[InterfaceAddress] = addresses) -> str:
        return address_in_subnet(channel, "interface", ipaddress.ip_network(subnet),
                                 lambda: among)

    assert chosen("10.0.0.0/8") == "10.4.0.1"
    assert chosen("10.2.0.0/15") == "10.2.0.1"  # wide0 alone (its first address) matches
    assert chosen("10.3.0.0/16") == "10.3.0.1"
    assert chosen("0.0.0.0/0") == "10.4.0.1"  # not the loopback, for all its /8
    assert chosen("127.0.0.0/8") == "127.0.0.1"
    assert chosen("fd00::/8") == "fd00::1"
    for unusable in ("10.1.0.0/24", "192.168.0.0/16"):
        with pytest.raises(ChannelError, match=f"in {unusable}; its addresses: lo 127.0.0.1/8 "
                                               f"\\(up\\), down0 10.1.0.1/24 \\(down\\), "
                                               f"nomc0 10.1.0.2/24 \\(up, no multicast\\)"):
            chosen(unusable)


@pytest.mark.unit
def test_ipv6_link_local_addresses_are_left_out_and_a_link_local_subnet_is_refused() -> None:
    """A link-local address means something only with its interface's scope, which a
    channel's address does not carry: bound without it, it fails (EINVAL)."""
    channel = parse_channel("aeron:udp?endpoint=[fd00::9]:1|interface=[fe80::]/64")
    addresses = [_address("eth0", "fe80::1/64"), _address("eth0", "fd00::2/64"),
                 _address("eth1", "fe80::3/64"), _address("lo", "::1/128", IFF_UP | IFF_LOOPBACK)]

    def chosen(subnet: str) -> str:
        return address_in_subnet(channel, "interface", ipaddress.ip_network(subnet),
                                 lambda: addresses)

    for link_local in ("fe80::/64", "fe80::/10", "fe80::3/128"):
        with pytest.raises(ChannelError, match=f"{link_local} is IPv6 link-local: .*scope"
                           ) as refused:
            chosen(link_local)
        assert refused.value.part == "interface"
    # A wider subnet takes the interface's global or unique-local address, never a
    # link-local one: eth1 has none other, and is not chosen.
    assert chosen("::/0") == "fd00::2"
    assert chosen("8000::/1") == "fd00::2"
    with pytest.raises(ChannelError, match=r"in fe00::/8 other than a link-local one; its "
                                           r"addresses: eth0 fe80::1/64 \(up\)"):
        address_in_subnet(channel, "interface", ipaddress.ip_network("fe00::/8"),
                          lambda: [a for a in addresses if a.name != "eth0"
                                   or a.address.ip.is_link_local])


@pytest.mark.unit
def test_the_subnet_is_chosen_among_the_addresses_the_transports_give() -> None:
    """The conductor asks its transports for the host's addresses (the simulator gives its
    host's own); a unicast wildcard subnet stays the wildcard and asks for none."""
    from slipstream.daemon.conductor.network_records import _resolved
    from slipstream.daemon.media.names import NameCache

    host = [_address("sim0", "10.0.0.3/24")]

    def never() -> list[InterfaceAddress]:
        raise AssertionError("the host's addresses were listed")

    def interface_of(uri: str, local=lambda: host) -> str:
        resolved = _resolved(parse_channel(uri), NameCache(), local)
        assert resolved.interface is not None and resolved.interface.prefix_length is None
        return str(resolved.interface)

    assert interface_of("aeron:udp?endpoint=10.0.0.1:4000|interface=10.0.0.0/24") == "10.0.0.3"
    assert interface_of("aeron:udp?endpoint=224.0.1.1:4000|interface=10.0.0.0:7000/24"
                        ) == "10.0.0.3:7000"
    assert interface_of("aeron:udp?endpoint=224.0.1.1:4000|interface=0.0.0.0/0") == "10.0.0.3"
    for wildcard, kept in [("0.0.0.0/0", "0.0.0.0"), ("0.0.0.0:7000/0", "0.0.0.0:7000"),
                           ("0.0.0.0/8", "0.0.0.0"), ("[::]/0", "[::]")]:
        endpoint = "[::1]" if ":" in kept else "127.0.0.1"
        assert interface_of(f"aeron:udp?endpoint={endpoint}:4000|interface={wildcard}",
                            never) == kept
    with pytest.raises(ChannelError, match="no interface .* in 127.0.0.0/8; its addresses: "
                                           r"sim0 10.0.0.3/24 \(up\)"):
        interface_of("aeron:udp?endpoint=10.0.0.1:4000|interface=127.0.0.0/8")

    def failing() -> list[InterfaceAddress]:
        raise OSError(errno.ENOBUFS, os.strerror(errno.ENOBUFS))

    with pytest.raises(ChannelError, match=r"cannot list this host's interfaces to find "
                                           r"10\.0\.0\.0/24: No buffer space") as failed:
        interface_of("aeron:udp?endpoint=10.0.0.1:4000|interface=10.0.0.0/24", failing)
    assert failed.value.part == "interface"


def test_a_simulated_host_chooses_among_its_own_addresses_not_the_machines() -> None:
    from slipstream.sim.host import CommandRefusedError
    from slipstream.sim.runner import Simulation
    from slipstream.sim.scenario import Scenario

    with Simulation(Scenario(hosts=3, messages=1)) as sim:
        host = sim.host(3)
        host.start()
        assert host.driver is not None
        group = "aeron:udp?endpoint=224.0.1.1:4000"
        host.driver.command({"type": control.ADD_SUBSCRIPTION, "stream_id": 99,
                             "channel": f"{group}|interface=10.0.0.0/24"})
        [subscription] = [s for s in host.driver.network.subscriptions.values()
                          if s.stream_id == 99]
        assert str(subscription.channel.interface) == "10.0.0.3"
        with pytest.raises(CommandRefusedError, match=r"interface.*sim0 10\.0\.0\.3/16"):
            host.driver.command({"type": control.ADD_SUBSCRIPTION, "stream_id": 98,
                                 "channel": f"{group}|interface=127.0.0.0/8",
                                 "correlation_id": 2})


@pytest.mark.unit
def test_each_refusal_says_its_side_and_a_subscription_only_key_refuses_no_publication(
        ) -> None:
    """The conductor's refusals (``_NOT_CARRIED_YET``) each say which side they apply to: a
    key only a subscription acts on is a publication's to ignore (the client warns)."""
    from slipstream.client.channel import SUBSCRIPTION_ONLY_KEYS
    from slipstream.daemon.conductor.conductor import _NOT_CARRIED_YET, _carried

    asked = {"rejoin": "aeron:ipc?rejoin=false"}
    assert {part for part, _, _ in _NOT_CARRIED_YET if part in SUBSCRIPTION_ONLY_KEYS} \
        == set(asked)
    for part, uri in asked.items():
        channel = parse_channel(uri)
        assert _carried(channel, subscription=False) is channel
        with pytest.raises(ChannelError, match="not supported by this driver yet") as refused:
            _carried(channel, subscription=True)
        assert refused.value.part == part
