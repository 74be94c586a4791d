"""Scenarios: what to simulate (hosts, traffic, link faults, timed events), from code or TOML.

A scenario is plain data (:class:`Scenario`); :func:`load_scenario` reads one from a TOML file
and reports a bad value as :class:`ScenarioError` naming the key.  The file format::

    [scenario]
    hosts = 3              # host 1 (10.0.0.1) publishes, hosts 2..N (10.0.0.N) subscribe;
                           # unicast when hosts = 2, multicast (224.0.1.1:40456) above
    transport = "mdc"      # or "multicast" (the default): dynamic multi-destination-cast,
                           # each subscriber joins at host 1's control address (10.0.0.1:40124);
                           # or "mds": each subscriber receives on two ports (40123, 40125) of
                           # a multi-destination subscription, host 1 sends to all of them
    messages = 20000       # messages to publish
    size = 1024            # bytes per message (>= 16: publisher id and sequence number)
    seed = 7               # every random choice derives from it
    channel = "term-length=64k|fc=min"   # extra channel URI parameters ("" = none)
    publish_rate = 0       # messages per virtual second; 0 = as fast as flow control allows
    max_virtual_s = 120    # give up after this much virtual time (s)
    initially_down = [3]   # hosts that start crashed (bring them up with a restart event)

    [faults]               # every direction of every link (LinkFaults fields)
    loss = 0.02            # probability per datagram
    burst = [0.01, 0.3]    # Gilbert-Elliott p = P(good->bad), r = P(bad->good)
    delay_ms = 1.0
    jitter_ms = 0.2
    reorder = 0.01         # probability of an extra delay up to reorder_delay_ms
    reorder_delay_ms = 5.0
    duplicate = 0.01       # probability
    rate_mbit = 100        # bandwidth, Mbit/s (0 = unlimited)
    queue_bytes = 1048576  # bytes waiting for the wire before tail drop

    [[link]]               # overrides for one direction; any LinkFaults field
    from = 1
    to = 3
    loss = 0.2

    [settings]             # DriverSettings overrides (values as in config/*.toml)
    image_liveness_timeout = "2s"

    [[event]]              # timed events, at_ms in virtual milliseconds
    at_ms = 200
    action = "partition"   # partition | crash | restart | faults
    hosts = [3]            # partition: this side is cut off from the rest ...
    end_ms = 700           # ... until end_ms (heals)

    [[subscriber]]         # a subscriber application slower than the stream
    host = 3
    read_rate = 1000       # messages it reads per virtual second (0 = all it can)
    channel = "gtag=7"     # extra URI parameters of this host's subscription only

    [[event]]
    at_ms = 300
    action = "pause"       # the subscribers of these hosts stop reading (a GC pause) ...
    hosts = [3]
    end_ms = 2300          # ... until end_ms; their drivers go on

    [[event]]
    at_ms = 1000
    action = "faults"      # change faults from now on
    from = 1               # optional: one direction (default: all links) ...
    to = 2                 # ... between two different hosts
    loss = 0.0

Hosts are named by number (1..N) or by address ("10.0.0.3").
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from slipstream.client.channel import PUBLICATION_ONLY_KEYS, SUBSCRIPTION_ONLY_KEYS
from slipstream.client.errors import SlipstreamError
from slipstream.daemon.config import DriverSettings
from slipstream.sim.network import LinkFaults

#: Where subscribers listen (unicast, and each one's endpoint under MDC) and the multicast data
#: group.
UNICAST_PORT: Final = 40123
MULTICAST_GROUP: Final = ("224.0.1.1", 40456)
#: Under ``transport = "mdc"``: the port of host 1's control address, which its dynamic
#: multi-destination-cast publication binds and its subscribers send their status messages to.
MDC_CONTROL_PORT: Final = 40124
#: Under ``transport = "mds"``: the ports each subscriber host's multi-destination
#: subscription receives the stream on, one path each, every one a destination of host 1's
#: manual multi-destination-cast publication.
MDS_PORTS: Final = (UNICAST_PORT, 40125)
#: The transports of a scenario: ``multicast`` (unicast when hosts = 2, a multicast group
#: above), ``mdc`` (dynamic multi-destination-cast: no multicast, whatever the hosts) or
#: ``mds`` (each subscriber's stream on two paths: see :data:`MDS_PORTS`).
TRANSPORTS: Final = ("multicast", "mdc", "mds")
ACTIONS: Final = ("partition", "crash", "restart", "faults", "pause")
MIN_MESSAGE_SIZE: Final = 16


class ScenarioError(ValueError):
    """A scenario value is out of range; the message names the key."""


#: The most hosts a scenario has: their addresses fill 10.0.0.0/16 but for its network and
#: broadcast addresses.
MAX_HOSTS: Final = 65534


def host_ip(index: int) -> str:
    """The address of host ``index`` (1-based, up to :data:`MAX_HOSTS`) in 10.0.0.0/16:
    10.0.0.N for N up to 255, then 10.0.1.0 and on."""
    return f"10.0.{index >> 8}.{index & 0xFF}"


def host_index(ip: str) -> int | None:
    """The host number whose address is ``ip`` (None: no simulated host's)."""
    parts = ip.split(".")
    if (len(parts) != 4 or parts[:2] != ["10", "0"]
            or not all(part.isdigit() and int(part) < 256 for part in parts[2:])):
        return None
    index = (int(parts[2]) << 8) | int(parts[3])
    return index if 1 <= index <= MAX_HOSTS else None


@attrs.frozen
class Event:
    """A timed event.  ``at_ns`` virtual time; ``params`` depend on the action."""

    at_ns: int
    action: str
    hosts: tuple[int, ...] = ()
    end_ns: int | None = None
    src: int | None = None
    dst: int | None = None
    faults: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class LinkOverride:
    """Faults for the direction ``src → dst`` (host numbers), replacing the defaults."""

    src: int
    dst: int
    faults: LinkFaults


@attrs.frozen
class Scenario:
    """Everything a run needs.  Sizes in bytes, times in ns unless the name says otherwise."""

    hosts: int = 2
    messages: int = 10_000
    size: int = 1024
    seed: int = 1
    channel_params: str = ""
    publish_rate: float = 0.0  # messages per virtual second; 0 = as fast as allowed
    max_virtual_ns: int = 300 * 1_000_000_000
    initially_down: tuple[int, ...] = ()
    faults: LinkFaults = attrs.field(factory=LinkFaults)
    links: tuple[LinkOverride, ...] = ()
    events: tuple[Event, ...] = ()
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    stream_id: int = 1001
    #: (host, messages per virtual second) of subscribers that read slower than they could.
    read_rates: tuple[tuple[int, float], ...] = ()
    #: (host, extra channel URI parameters) of subscribers whose URI adds some (``gtag=``).
    subscriber_params: tuple[tuple[int, str], ...] = ()
    #: One of :data:`TRANSPORTS`: ``multicast`` (unicast with 2 hosts), ``mdc`` (host 1
    #: publishes with ``control-mode=dynamic`` at its control address, each subscriber at its
    #: own endpoint with ``control=`` that address) or ``mds`` (host 1 publishes with
    #: ``control-mode=manual`` to every port of :data:`MDS_PORTS` of every subscriber, each
    #: of which subscribes with ``control-mode=manual`` on those destinations).
    transport: str = "multicast"

    def read_rate(self, index: int) -> float:
        """Messages per virtual second host ``index``'s subscriber reads (0: all it can)."""
        return dict(self.read_rates).get(index, 0.0)

    def __attrs_post_init__(self) -> None:
        if self.hosts < 2:
            raise ScenarioError(f"hosts: need at least 2 (a publisher and a subscriber), "
                                f"not {self.hosts}")
        if self.hosts > MAX_HOSTS:
            raise ScenarioError(f"hosts: at most {MAX_HOSTS}, not {self.hosts}")
        if self.transport not in TRANSPORTS:
            raise ScenarioError(f"transport: {self.transport!r} is not one of "
                                f"{', '.join(TRANSPORTS)}")
        if self.messages < 0:
            raise ScenarioError(f"messages: must be >= 0, not {self.messages}")
        if self.size < MIN_MESSAGE_SIZE:
            raise ScenarioError(f"size: must be >= {MIN_MESSAGE_SIZE} bytes (the publisher id "
                                f"and sequence number), not {self.size}")
        if self.publish_rate < 0:
            raise ScenarioError(f"publish_rate: must be >= 0, not {self.publish_rate}")
        if self.max_virtual_ns <= 0:
            raise ScenarioError("max_virtual_s: must be > 0")
        for index in self.initially_down:
            self.check_host("initially_down", index)
        if 1 in self.initially_down:
            raise ScenarioError("initially_down: the publisher (host 1) must start up")
        for link in self.links:
            self.check_host("link.from", link.src)
            self.check_host("link.to", link.dst)
            if link.src == link.dst:  # no host sends to itself: the faults would never apply
                raise ScenarioError(f"link.to: host {link.dst} is also link.from; a link "
                                    f"joins two different hosts")
        for index, _params in self.subscriber_params:
            self.check_host("subscriber.host", index)
            if index == 1:
                raise ScenarioError("subscriber.host: host 1 publishes; subscribers are 2..N")
        for index, rate in self.read_rates:
            self.check_host("subscriber.host", index)
            if index == 1:
                raise ScenarioError("subscriber.host: host 1 publishes; subscribers are 2..N")
            if rate < 0:
                raise ScenarioError(f"subscriber.read_rate: must be >= 0, not {rate}")
        for event in self.events:
            for index in (*event.hosts, event.src, event.dst):
                if index is not None:
                    self.check_host(f"event.{event.action}", index)
            if event.src is not None and event.src == event.dst:
                raise ScenarioError(f"event.{event.action}.to: host {event.dst} is also from; a "
                                    f"link joins two different hosts (leave out from and to "
                                    f"for every link)")
            if event.action == "pause" and 1 in event.hosts:
                raise ScenarioError("event.pause: host 1 publishes; a pause stops subscribers "
                                    "(hosts 2..N)")
            last_ns = max(event.at_ns, event.end_ns or 0)
            if last_ns > self.max_virtual_ns:
                raise ScenarioError(
                    f"event.{event.action}: at {last_ns / 1e6:g} ms, after max_virtual_s "
                    f"({self.max_virtual_ns / 1e9:g} s): the run would end before it")

    def check_host(self, key: str, index: int) -> None:
        if not 1 <= index <= self.hosts:
            raise ScenarioError(f"{key}: host {index} is not one of 1..{self.hosts}")

    @property
    def is_mdc(self) -> bool:
        """The stream goes by dynamic multi-destination-cast (``transport = "mdc"``)."""
        return self.transport == "mdc"

    @property
    def is_mds(self) -> bool:
        """Each subscriber gets the stream on two paths (``transport = "mds"``)."""
        return self.transport == "mds"

    @property
    def is_multicast(self) -> bool:
        return self.hosts > 2 and not self.is_mdc and not self.is_mds

    @property
    def data_port(self) -> int:
        """The port the stream's DATA arrives at on a subscriber host."""
        return MULTICAST_GROUP[1] if self.is_multicast else UNICAST_PORT

    def channel_uri(self, index: int, address: str | None = None,
                    destination: str | None = None, publisher: str | None = None) -> str:
        """The channel URI as host ``index`` uses it (its own interface for multicast, its own
        endpoint under MDC), with the scenario's parameters and, for a subscriber, its own;
        ``address`` is host ``index``'s, ``destination`` host 2's and ``publisher`` host 1's,
        whose control address MDC subscribers name (default: the simulator's 10.0.0.N)."""
        if self.is_mds:
            uri = "aeron:udp?control-mode=manual"
        elif self.is_mdc and index == 1:
            uri = (f"aeron:udp?control={publisher or address or host_ip(1)}:{MDC_CONTROL_PORT}"
                   f"|control-mode=dynamic")
        elif self.is_mdc:
            uri = (f"aeron:udp?endpoint={address or host_ip(index)}:{UNICAST_PORT}"
                   f"|control={publisher or host_ip(1)}:{MDC_CONTROL_PORT}")
        elif self.is_multicast:
            uri = (f"aeron:udp?endpoint={MULTICAST_GROUP[0]}:{MULTICAST_GROUP[1]}"
                   f"|interface={address or host_ip(index)}")
        else:
            uri = f"aeron:udp?endpoint={destination or host_ip(2)}:{UNICAST_PORT}"
        # The scenario's parameters are both sides': each host takes those its side acts on
        # (a client warns of the other side's keys).
        other_side = SUBSCRIPTION_ONLY_KEYS if index == 1 else PUBLICATION_ONLY_KEYS
        given = "|".join(p for p in (self.channel_params, dict(self.subscriber_params).get(index))
                         if p)
        params = [p for p in given.split("|") if p and p.partition("=")[0] not in other_side]
        return "|".join([uri, *params])

    def destinations(self, index: int) -> list[str]:
        """The destinations host ``index`` adds under ``transport = "mds"`` (none
        otherwise): host 1's publication sends to each subscriber's :data:`MDS_PORTS`, and
        each subscriber's subscription receives on its own."""
        if not self.is_mds:
            return []
        hosts = range(2, self.hosts + 1) if index == 1 else (index,)
        return [mds_destination(host, port) for host in hosts for port in MDS_PORTS]


def mds_destination(index: int, port: int) -> str:
    """The destination URI of port ``port`` of host ``index`` (``transport = "mds"``)."""
    return f"aeron:udp?endpoint={host_ip(index)}:{port}"


# -- TOML --------------------------------------------------------------------------------------

_FAULT_KEYS: Final = {f.name for f in attrs.fields(LinkFaults)}
_SCENARIO_KEYS: Final = {"hosts", "messages", "size", "seed", "channel", "publish_rate",
                         "max_virtual_s", "initially_down", "stream_id", "transport"}


def _host_index(key: str, value: Any, hosts: int) -> int:
    if isinstance(value, str):
        index = host_index(value)
        if index is None:
            raise ScenarioError(f"{key}: {value!r} is not a host number or a host's address "
                                f"(10.0.0.N)")
        value = index
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{key}: {value!r} is not a host number")
    if not 1 <= value <= hosts:
        raise ScenarioError(f"{key}: host {value} is not one of 1..{hosts}")
    return value


def _fault_values(section: str, table: Mapping[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _FAULT_KEYS:
            raise ScenarioError(f"{section}.{key}: unknown fault (known: "
                                f"{', '.join(sorted(_FAULT_KEYS))})")
        if key == "burst":
            if (not isinstance(value, list) or len(value) != 2
                    or not all(isinstance(x, int | float) for x in value)):
                raise ScenarioError(f"{section}.burst: expected [p, r], not {value!r}")
            value = (float(value[0]), float(value[1]))
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ScenarioError(f"{section}.{key}: expected a number, not {value!r}")
        values[key] = value
    return values


def make_faults(section: str, values: Mapping[str, Any],
                base: LinkFaults | None = None) -> LinkFaults:
    """``base`` (default: no faults) with ``values`` replaced; errors name ``section.key``."""
    try:
        return attrs.evolve(base or LinkFaults(), **values)
    except (ValueError, TypeError) as e:
        raise ScenarioError(f"{section}: {e}") from None


def scenario_from_mapping(data: Mapping[str, Any], *, source: str = "scenario") -> Scenario:
    """Build a :class:`Scenario` from parsed TOML (see the module docstring)."""
    known = {"scenario", "faults", "link", "settings", "event", "subscriber"}
    for key in data:
        if key not in known:
            raise ScenarioError(f"{source}: unknown table [{key}] (known: "
                                f"{', '.join(sorted(known))})")
    for key in ("scenario", "faults", "settings"):  # a table each: [key]
        if not isinstance(data.get(key, {}), Mapping):
            raise ScenarioError(f"{key}: expected a table [{key}], not {data[key]!r}")
    for key in ("link", "event", "subscriber"):  # an array of tables each: [[key]]
        tables = data.get(key, [])
        if not isinstance(tables, list) or not all(isinstance(t, Mapping) for t in tables):
            raise ScenarioError(f"{key}: expected an array of tables [[{key}]], not "
                                f"{tables!r}")
    head = dict(data.get("scenario", {}))
    for key in head:
        if key not in _SCENARIO_KEYS:
            raise ScenarioError(f"scenario.{key}: unknown key (known: "
                                f"{', '.join(sorted(_SCENARIO_KEYS))})")

    def number(key: str, kind: type, default: Any) -> Any:
        value = head.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                kind is int and not isinstance(value, int)) or not -math.inf < value < math.inf:
            raise ScenarioError(f"scenario.{key}: expected a finite {kind.__name__}, "
                                f"not {value!r}")
        return value

    hosts = number("hosts", int, 2)
    if hosts < 2:
        raise ScenarioError(f"scenario.hosts: need at least 2, not {hosts}")
    channel = head.get("channel", "")
    if not isinstance(channel, str):
        raise ScenarioError(f"scenario.channel: expected a string, not {channel!r}")
    transport = head.get("transport", "multicast")
    if transport not in TRANSPORTS:
        raise ScenarioError(f"scenario.transport: {transport!r} is not one of "
                            f"{', '.join(repr(t) for t in TRANSPORTS)}")
    faults = make_faults("faults", _fault_values("faults", data.get("faults", {})))
    links = []
    for i, table in enumerate(data.get("link", [])):
        table = dict(table)
        try:
            src = _host_index(f"link[{i}].from", table.pop("from"), hosts)
            dst = _host_index(f"link[{i}].to", table.pop("to"), hosts)
        except KeyError as e:
            raise ScenarioError(f"link[{i}]: needs from and to ({e.args[0]} missing)") from None
        if src == dst:
            raise ScenarioError(f"link[{i}].to: host {dst} is also from; a link joins two "
                                f"different hosts")
        links.append(LinkOverride(src, dst, make_faults(
            f"link[{i}]", _fault_values(f"link[{i}]", table), faults)))
    events = []
    for i, table in enumerate(data.get("event", [])):
        table = dict(table)
        name = f"event[{i}]"
        action = table.pop("action", None)
        if action not in ACTIONS:
            raise ScenarioError(f"{name}.action: {action!r} is not one of {', '.join(ACTIONS)}")
        at_ms = table.pop("at_ms", None)
        if isinstance(at_ms, bool) or not isinstance(at_ms, int | float) or \
                not 0 <= at_ms < math.inf:
            raise ScenarioError(f"{name}.at_ms: expected a time >= 0 in ms, not {at_ms!r}")
        at_ns = int(at_ms * 1_000_000)
        kwargs: dict[str, Any] = {}
        if action in ("crash", "restart"):
            if "host" in table:
                if "hosts" in table:
                    raise ScenarioError(f"{name}: give host or hosts, not both")
                table["hosts"] = [table.pop("host")]
        if action in ("partition", "crash", "restart", "pause"):
            hosts_value = table.pop("hosts", None)
            if not isinstance(hosts_value, list) or not hosts_value:
                raise ScenarioError(f"{name}.hosts: expected a non-empty list of hosts")
            kwargs["hosts"] = tuple(_host_index(f"{name}.hosts", h, hosts) for h in hosts_value)
        if action in ("partition", "pause"):
            end_ms = table.pop("end_ms", None)
            if isinstance(end_ms, bool) or not isinstance(end_ms, int | float) or \
                    not at_ms <= end_ms < math.inf:
                raise ScenarioError(f"{name}.end_ms: expected a time >= at_ms in ms, "
                                    f"not {end_ms!r}")
            kwargs["end_ns"] = int(end_ms * 1_000_000)
        if action == "faults":
            if "from" in table:
                kwargs["src"] = _host_index(f"{name}.from", table.pop("from"), hosts)
            if "to" in table:
                kwargs["dst"] = _host_index(f"{name}.to", table.pop("to"), hosts)
            if kwargs.get("src") is not None and kwargs.get("src") == kwargs.get("dst"):
                # No host sends to itself: the event would change nothing, silently.
                raise ScenarioError(f"{name}.to: host {kwargs['dst']} is also from; a link "
                                    f"joins two different hosts (leave out from and to for "
                                    f"every link)")
            kwargs["faults"] = _fault_values(name, table)
            make_faults(name, kwargs["faults"])  # validate now, not mid-run
            table = {}
        if table:
            raise ScenarioError(f"{name}.{next(iter(table))}: unknown key for {action}")
        events.append(Event(at_ns, action, **kwargs))
    read_rates = []
    subscriber_params = []
    for i, table in enumerate(data.get("subscriber", [])):
        table = dict(table)
        name = f"subscriber[{i}]"
        if "host" not in table:
            raise ScenarioError(f"{name}: needs host")
        index = _host_index(f"{name}.host", table.pop("host"), hosts)
        rate = table.pop("read_rate", 0)
        if isinstance(rate, bool) or not isinstance(rate, int | float) or \
                not 0 <= rate < math.inf:
            raise ScenarioError(f"{name}.read_rate: expected messages per second >= 0, "
                                f"not {rate!r}")
        params = table.pop("channel", "")
        if not isinstance(params, str):
            raise ScenarioError(f"{name}.channel: expected a string, not {params!r}")
        if table:
            raise ScenarioError(f"{name}.{next(iter(table))}: unknown key (known: host, "
                                f"read_rate, channel)")
        if index == 1:
            raise ScenarioError(f"{name}.host: host 1 publishes; subscribers are 2..N")
        if rate:
            read_rates.append((index, float(rate)))
        if params.strip("|"):
            subscriber_params.append((index, params.strip("|")))
    settings = dict(data.get("settings", {}))
    _check_settings(settings)
    down = head.get("initially_down", [])
    if not isinstance(down, list):
        raise ScenarioError("scenario.initially_down: expected a list of hosts")
    return Scenario(
        hosts=hosts,
        messages=number("messages", int, 10_000),
        size=number("size", int, 1024),
        seed=number("seed", int, 1),
        channel_params=channel,
        publish_rate=float(number("publish_rate", float, 0.0)),
        max_virtual_ns=int(number("max_virtual_s", float, 300) * 1_000_000_000),
        initially_down=tuple(_host_index("scenario.initially_down", h, hosts) for h in down),
        stream_id=number("stream_id", int, 1001),
        faults=faults,
        links=tuple(links),
        events=tuple(events),
        settings=settings,
        read_rates=tuple(read_rates),
        subscriber_params=tuple(subscriber_params),
        transport=transport,
    )


def _check_settings(settings: Mapping[str, Any]) -> None:
    try:
        DriverSettings.from_mapping(settings)
    except (SlipstreamError, ValueError, TypeError) as e:
        raise ScenarioError(f"settings: {e}") from None


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario TOML file; raises :class:`ScenarioError` naming the bad key."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ScenarioError(f"--scenario: cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"--scenario: {path} is not valid TOML: {e}") from None
    return scenario_from_mapping(data, source=str(path))
