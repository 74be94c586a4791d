"""The archive service's settings: one table, read from a TOML file (config/archive.toml has
every key, documented).  A value that is not one the key takes, and a key not in the table,
are refused naming the key."""

from __future__ import annotations

import enum
import ipaddress
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from slipstream.archive.segments import (
    DEFAULT_SEGMENT_LENGTH,
    MAX_SEGMENT_LENGTH,
    MIN_SEGMENT_LENGTH,
)
from slipstream.client.channel import (
    SPY_PREFIX,
    Subnet,
    channel_with_key,
    key_name_problem,
    parse_address,
    parse_channel,
    parse_join,
)
from slipstream.client.errors import ChannelError, SlipstreamError
from slipstream.client.holder import DEFAULT_GROUP
from slipstream.client.layout import INT32_MAX, INT32_MIN
from slipstream.client.units import parse_duration_ns, parse_size


class ArchiveSettingsError(ValueError):
    """A setting the archive refuses; ``key`` names it."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"archive setting {key!r}: {reason}")
        self.key = key


class SyncPolicy(enum.Enum):
    """When recorded bytes are made durable (docs/ARCHIVE.md, "Sync policy")."""

    NONE = "none"  # the page cache: survives the archive's death, not the machine's
    # Both also fdatasync when the archive caught up with the stream (its subscriber
    # position, which holds the publisher, never passes what was synced).
    SEGMENT = "segment"  # fdatasync as each segment fills and at stop; the catalog after
    INTERVAL = "interval"  # fdatasync at least every sync_interval while bytes wait


class Source(enum.Enum):
    """Where a recorded stream comes from (Aeron's SourceLocation)."""

    LOCAL = "local"  # a publication of this host's driver: its own log (spy or IPC)
    REMOTE = "remote"  # another host's: a plain subscription to the channel


@dataclass(frozen=True)
class RecordSpec:
    """One ``[[record]]`` entry: record every session of ``stream_id`` on ``channel``.

    ``retention_max_bytes`` / ``retention_max_age_ns`` bound the stream's recordings together
    (bytes of their segment files; ns since a segment's last write; 0: no bound of the
    stream's own), within the archive's total bounds."""

    channel: str
    stream_id: int
    source: Source = Source.LOCAL
    retention_max_bytes: int = 0
    retention_max_age_ns: int = 0

    @property
    def subscription_channel(self) -> str:
        """What the archive subscribes to: a local UDP stream through a spy on its
        publication's log (no copy through the network), IPC as it is, a remote one as a
        plain subscription.  An encrypted channel's spy names no key (``key=``): the log it
        reads holds the stream in plain text (docs/CHANNELS.md §7.8)."""
        if self.source is Source.LOCAL and self.channel.startswith("aeron:udp"):
            return SPY_PREFIX + channel_with_key(self.channel, None)
        return self.channel

    def recorded_channel(self, channel_key: str | None) -> str:
        """The channel a recording of one of the stream's images is catalogued under, by which
        calls about it are authorized: ``channel`` with ``key=`` the key the image's stream is
        sealed under on the network (:attr:`~slipstream.client.image.Image.channel_key`, as
        the driver says; None: plain), whatever ``channel`` names, so a keyed publication
        read through a spy is a recording of its key."""
        return channel_with_key(self.channel, channel_key)


@dataclass(frozen=True)
class HoldSpec:
    """One ``[[hold]]`` entry: hold ``stream_id`` on ``channel`` for ``group`` from the
    start (:mod:`slipstream.archive.holding`), as a query's first call would."""

    channel: str
    stream_id: int
    group: str = DEFAULT_GROUP


def _positive_size(name: str, low: int, high: int, power_of_two: bool = False
                   ) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            size = parse_size(value)
        except ValueError as e:
            raise ArchiveSettingsError(name, str(e)) from None
        if not low <= size <= high:
            raise ArchiveSettingsError(name, f"{size} is outside [{low}, {high}] bytes")
        if power_of_two and size & (size - 1):
            raise ArchiveSettingsError(name, f"{size} is not a power of two")
        return size
    return parse


def _size(name: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            return parse_size(value)
        except ValueError as e:
            raise ArchiveSettingsError(name, str(e)) from None
    return parse


def _duration(name: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            return parse_duration_ns(value)
        except ValueError as e:
            raise ArchiveSettingsError(name, str(e)) from None
    return parse


def _path(name: str, *, optional: bool = False) -> Callable[[Any], Path | None]:
    def parse(value: Any) -> Path | None:
        if optional and value == "":
            return None
        if not isinstance(value, str) or not value:
            raise ArchiveSettingsError(name, f"{value!r} is not a path")
        return Path(value)
    return parse


def _write_behind(value: Any) -> int:
    """0 (off), or a chunk of at least 64 KiB (fewer bytes a call would cost more calls than
    the writes they follow) and at most 1 GiB."""
    size = _size("write_behind")(value)
    if size != 0 and not 64 * 1024 <= size <= 1 << 30:
        raise ArchiveSettingsError("write_behind", f"{size} is neither 0 nor within "
                                   f"[65536, {1 << 30}] bytes")
    return size


def _sync(value: Any) -> SyncPolicy:
    try:
        return SyncPolicy(value)
    except ValueError:
        raise ArchiveSettingsError(
            "sync", f"{value!r} is not one of {', '.join(p.value for p in SyncPolicy)}"
        ) from None


def _address(value: Any) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except (ipaddress.AddressValueError, ValueError):
        raise ArchiveSettingsError("control_address", f"{value!r} is not an IPv4 address "
                                   f"of this host") from None


def _port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ArchiveSettingsError("control_port", f"{value!r} is not a UDP port (0..65535; "
                                   f"0: no control stream)")
    return value


def _control_keys(value: Any) -> dict[str, int]:
    """``{NAME = port, ...}``: a control endpoint keyed ``key=NAME`` on each port."""
    if not isinstance(value, dict):
        raise ArchiveSettingsError("control_keys", f"{value!r} is not a table of key names to "
                                   f"UDP ports ({{ k1 = 8012 }})")
    for name, port in value.items():
        problem = key_name_problem(name)
        if problem is not None:
            raise ArchiveSettingsError("control_keys", problem)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            raise ArchiveSettingsError("control_keys", f"{name} = {port!r} is not a UDP port "
                                       f"(1..65535)")
    ports = list(value.values())
    if len(set(ports)) != len(ports):
        raise ArchiveSettingsError("control_keys", "two keys on one port: an endpoint has "
                                   "one key (docs/CHANNELS.md §7.8)")
    return dict(value)


def _control_subnets(value: Any) -> tuple[Subnet, ...]:
    """``"10.1.0.0/16,fd00::/8"`` (as ``join=``), or "" for any source."""
    if value == "":
        return ()
    if not isinstance(value, str):
        raise ArchiveSettingsError("control_subnets", f"{value!r} is not a string of subnets")
    try:
        return parse_join(value)
    except ValueError as e:
        raise ArchiveSettingsError("control_subnets", str(e)) from None


def _stream_id(name: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or \
                not INT32_MIN <= value <= INT32_MAX:
            raise ArchiveSettingsError(name, f"{value!r} is not a stream id (an int32)")
        return value
    return parse


@dataclass(frozen=True)
class Peer:
    """Another archive's control stream (a ``peers`` entry): its address, port and stream,
    and the key its endpoint there is of (None: plain)."""

    address: str
    port: int
    control_stream_id: int
    key: str | None = None

    def __str__(self) -> str:
        keyed = f"|key={self.key}" if self.key is not None else ""
        return f"{self.address}:{self.port}/{self.control_stream_id}{keyed}"


def parse_peer(entry: Any, key: str = "peers") -> Peer:
    """``"host:port"`` or ``"host:port/stream_id"`` (the stream id defaults to Aeron
    Archive's control stream, :data:`DEFAULT_CONTROL_STREAM_ID`), either followed by
    ``|key=NAME`` for a control endpoint keyed NAME (the peer's ``control_keys``); the host
    an IPv4 address or a host name, which is kept as a name: the link to the peer follows it
    when the peer moves (docs/CHANNELS.md §7.2, "Names that follow their peer").  Raises
    :class:`ArchiveSettingsError` naming ``key``."""
    peer_key = None
    if isinstance(entry, str) and "|" in entry:
        entry, _, keyed = entry.partition("|")
        peer_key = keyed.removeprefix("key=")
        if not keyed.startswith("key=") or key_name_problem(peer_key) is not None:
            raise ArchiveSettingsError(key, f"{entry}|{keyed!r}: after '|' only key=NAME (a "
                                       f"key name) is accepted")
    endpoint, _, stream = entry.partition("/") if isinstance(entry, str) else ("", "", "")
    try:
        where = parse_address(endpoint, key)
        if where.port is None or ":" in where.host:
            raise ValueError(endpoint)
        peer = Peer(where.host, where.port,
                    int(stream) if stream else DEFAULT_CONTROL_STREAM_ID, peer_key)
    except (ValueError, ChannelError):
        raise ArchiveSettingsError(key, f"{entry!r} is not \"host:port\" or "
                                   f"\"host:port/stream_id\" (an IPv4 address or a host "
                                   f"name)") from None
    if not 0 < peer.port <= 65535 or not INT32_MIN <= peer.control_stream_id <= INT32_MAX:
        raise ArchiveSettingsError(key, f"{entry!r}: the port is not in 1..65535, or the "
                                   f"stream id not an int32")
    return peer


def _peers(value: Any) -> tuple[Peer, ...]:
    """``["host:port", "host:port/stream_id", ...]`` (:func:`parse_peer`)."""
    if not isinstance(value, list):
        raise ArchiveSettingsError("peers", f"{value!r} is not a list of \"host:port\" "
                                   f"strings")
    return tuple(parse_peer(entry) for entry in value)


def _optional_address(value: Any) -> str | None:
    if value == "":
        return None
    try:
        return str(ipaddress.IPv4Address(value))
    except (ipaddress.AddressValueError, ValueError):
        raise ArchiveSettingsError("replication_address", f"{value!r} is not an IPv4 address "
                                   f"of this host (\"\": the one towards each peer)") from None


def _replication_port(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ArchiveSettingsError("replication_port", f"{value!r} is not a UDP port (1..65535;"
                                   f" 0: control_port + 1)")
    return value


#: Every top-level key: (its parser, its default).  config/archive.toml documents each one.
#: Where an archive takes calls unless its settings say otherwise: Aeron Archive's control
#: request channel (localhost:8010, stream 10).
DEFAULT_CONTROL_PORT: Final = 8010
DEFAULT_CONTROL_STREAM_ID: Final = 10

SETTINGS: Final[dict[str, tuple[Callable[[Any], Any], Any]]] = {
    "dir": (_path("dir"), "/var/lib/slipstream-archive"),
    "driver_dir": (_path("driver_dir", optional=True), ""),
    "segment_length": (_positive_size("segment_length", MIN_SEGMENT_LENGTH, MAX_SEGMENT_LENGTH,
                                      power_of_two=True), DEFAULT_SEGMENT_LENGTH),
    "sync": (_sync, "none"),
    "sync_interval": (_duration("sync_interval"), "100ms"),
    "block_length": (_positive_size("block_length", 4096, 64 * 1024 * 1024), "1m"),
    "write_behind": (_write_behind, "8m"),
    "retention_max_bytes": (_size("retention_max_bytes"), 0),
    "retention_max_age": (_duration("retention_max_age"), 0),
    "retention_check_interval": (_duration("retention_check_interval"), "10s"),
    "control_address": (_address, "127.0.0.1"),
    "control_port": (_port, DEFAULT_CONTROL_PORT),
    "control_stream_id": (_stream_id("control_stream_id"), DEFAULT_CONTROL_STREAM_ID),
    "control_keys": (_control_keys, {}),
    "control_subnets": (_control_subnets, ""),
    "peers": (_peers, []),
    "replication_interval": (_duration("replication_interval"), "5s"),
    "replication_timeout": (_duration("replication_timeout"), "2s"),
    "replication_address": (_optional_address, ""),
    "replication_port": (_replication_port, 0),
    "release_after": (_duration("release_after"), 0),
}
_RECORD_KEYS: Final = ("channel", "stream_id", "source", "retention_max_bytes",
                       "retention_max_age")
_HOLD_KEYS: Final = ("channel", "stream_id", "group")
_TABLES: Final = ("record", "hold")


def replication_reply_ports(replication_port: int, control_port: int,
                            peers: Sequence[Peer]) -> dict[str | None, int | None]:
    """Where the peers' answers and replays come, by the peers' key (None: plain peers):
    ``replication_port`` (0: ``control_port + 1``; None when both are 0: the port towards
    each peer), and for each key a port of its own after it, in the keys' name order (an
    endpoint has one key)."""
    base = replication_port or (control_port + 1 if control_port else None)
    keys = sorted({peer.key for peer in peers if peer.key is not None})
    ports: dict[str | None, int | None] = {
        key: None if base is None else base + 1 + n for n, key in enumerate(keys)}
    ports[None] = base
    return ports


def spec_of(specs: Sequence[RecordSpec], stream_id: int, channel: str) -> RecordSpec | None:
    """The ``[[record]]`` a recording of ``stream_id`` on ``channel`` (its catalog channel,
    or a peer's) is one of: the one of its stream id (the channels may differ: with MDC or
    multicast each host subscribes at its own endpoint), the one of its channel too where
    several share the stream id, whatever key either names (a recording is catalogued under
    its stream's own: :meth:`RecordSpec.recorded_channel`); None when no table, or no one
    table, is its."""
    found = [s for s in specs if s.stream_id == stream_id]
    if len(found) > 1:
        plain = channel_with_key(channel, None)
        found = [s for s in found if channel_with_key(s.channel, None) == plain]
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class ArchiveSettings:
    """The archive's settings (defaults: :data:`SETTINGS`).  Sizes in bytes, durations in
    nanoseconds; 0 for a retention limit is none."""

    dir: Path = Path("/var/lib/slipstream-archive")
    driver_dir: Path | None = None
    segment_length: int = DEFAULT_SEGMENT_LENGTH
    sync: SyncPolicy = SyncPolicy.NONE
    sync_interval_ns: int = 100_000_000
    block_length: int = 1 << 20
    write_behind: int = 8 << 20
    retention_max_bytes: int = 0
    retention_max_age_ns: int = 0
    retention_check_interval_ns: int = 10_000_000_000
    control_address: str = "127.0.0.1"
    control_port: int = DEFAULT_CONTROL_PORT
    control_stream_id: int = DEFAULT_CONTROL_STREAM_ID
    #: The keyed control endpoints: a key name's port on ``control_address``; a call that
    #: arrives there comes from a holder of that key (docs/ARCHIVE.md, "Protected calls").
    control_keys: Mapping[str, int] = field(default_factory=dict)
    #: The subnets whose calls are answered (none: any source).
    control_subnets: tuple[Subnet, ...] = ()
    peers: tuple[Peer, ...] = ()
    replication_interval_ns: int = 5_000_000_000
    replication_timeout_ns: int = 2_000_000_000
    replication_address: str | None = None
    replication_port: int = 0
    records: tuple[RecordSpec, ...] = field(default_factory=tuple)
    #: A held stream's group no query called for this long is released (0: never).
    release_after_ns: int = 0
    holds: tuple[HoldSpec, ...] = field(default_factory=tuple)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ArchiveSettings:
        """Settings from a TOML document's table; raises :class:`ArchiveSettingsError` naming
        an unknown key or a bad value."""
        parsed: dict[str, Any] = {}
        for key in values:
            if key not in _TABLES and key not in SETTINGS:
                raise ArchiveSettingsError(
                    key, f"unknown key (known: {', '.join([*SETTINGS, *_TABLES])})")
        for key, (parse, default) in SETTINGS.items():
            value = values.get(key, default)
            parsed[key] = parse(value)
        if parsed["sync_interval"] <= 0 and parsed["sync"] is SyncPolicy.INTERVAL:
            raise ArchiveSettingsError("sync_interval", "must be > 0 with sync = \"interval\"")
        if parsed["write_behind"] >= parsed["segment_length"] and "write_behind" not in values:
            parsed["write_behind"] = 0  # the default's chunk does not fit a short segment
        if parsed["write_behind"] >= parsed["segment_length"]:
            raise ArchiveSettingsError(
                "write_behind", f"{parsed['write_behind']} bytes is not below segment_length "
                f"({parsed['segment_length']} bytes): a chunk must fit in a segment (0 = off)")
        for key in ("retention_check_interval", "replication_interval", "replication_timeout"):
            if parsed[key] <= 0:
                raise ArchiveSettingsError(key, "must be > 0")
        if parsed["release_after"] < 0:
            raise ArchiveSettingsError("release_after", "must be >= 0 (0: never)")
        holds = _holds(values.get("hold", []))
        if parsed["control_port"] in parsed["control_keys"].values():
            raise ArchiveSettingsError("control_keys", f"port {parsed['control_port']} is "
                                       f"control_port's (the plain endpoint's)")
        control_ports = {parsed["control_port"], *parsed["control_keys"].values()}
        peer_keys = {peer.key for peer in parsed["peers"]}
        for name, port in replication_reply_ports(parsed["replication_port"],
                                                  parsed["control_port"],
                                                  parsed["peers"]).items():
            if name not in peer_keys:
                continue
            whose = "plain peers" if name is None else f"peers keyed {name}"
            if port is None and name is not None:
                # The port towards each peer: its own control port of the key, which is
                # this archive's too where the hosts share their settings.
                raise ArchiveSettingsError(
                    "replication_port", f"the answers of the {whose} need a port of their own "
                    f"(an endpoint has one key), and with control_port and replication_port "
                    f"0 they would come at the peer's port: set replication_port")
            if port in control_ports:
                raise ArchiveSettingsError(
                    "replication_port", f"the answers of the {whose} would come at port "
                    f"{port}, one of this archive's control ports: set replication_port so "
                    f"that it and the ports after it, one per peers' key, are free")
        if holds and parsed["control_port"] == 0 and not parsed["control_keys"]:
            # Only a group's commit (the view call's advance_to) moves a held position: with
            # no control stream nothing would, and the publishers would be held for good.
            raise ArchiveSettingsError("hold", "needs the control stream (control_port is 0, "
                                               "no control_keys): a held stream moves only "
                                               "by its readers' calls")
        return cls(dir=parsed["dir"], driver_dir=parsed["driver_dir"],
                   segment_length=parsed["segment_length"], sync=parsed["sync"],
                   sync_interval_ns=parsed["sync_interval"],
                   block_length=parsed["block_length"],
                   write_behind=parsed["write_behind"],
                   retention_max_bytes=parsed["retention_max_bytes"],
                   retention_max_age_ns=parsed["retention_max_age"],
                   retention_check_interval_ns=parsed["retention_check_interval"],
                   control_address=parsed["control_address"],
                   control_port=parsed["control_port"],
                   control_stream_id=parsed["control_stream_id"],
                   control_keys=parsed["control_keys"],
                   control_subnets=parsed["control_subnets"],
                   peers=parsed["peers"],
                   replication_interval_ns=parsed["replication_interval"],
                   replication_timeout_ns=parsed["replication_timeout"],
                   replication_address=parsed["replication_address"],
                   replication_port=parsed["replication_port"],
                   records=_records(values.get("record", [])),
                   release_after_ns=parsed["release_after"],
                   holds=holds)


def _stream_entries(table: str, entries: Any, keys: tuple[str, ...]
                    ) -> list[tuple[str, dict[str, Any], str, Any, int]]:
    """The ``[[table]]`` entries checked for what ``[[record]]`` and ``[[hold]]`` share: only
    ``keys``, a ``channel`` URI (not a spy) and a ``stream_id``; each as (where, the entry,
    its channel, the channel parsed, its stream id)."""
    if not isinstance(entries, list):
        raise ArchiveSettingsError(table, f"not an array of tables ([[{table}]])")
    out = []
    for number, entry in enumerate(entries, start=1):
        where = f"{table} #{number}"
        if not isinstance(entry, dict):
            raise ArchiveSettingsError(table, f"{where} is not a table")
        for key in entry:
            if key not in keys:
                raise ArchiveSettingsError(f"{table}.{key}", f"unknown key in {where} (known: "
                                           f"{', '.join(keys)})")
        channel = entry.get("channel")
        if not isinstance(channel, str):
            raise ArchiveSettingsError(f"{table}.channel", f"{where}: {channel!r} is not a "
                                       f"channel URI")
        try:
            parsed = parse_channel(channel)
        except (SlipstreamError, ValueError) as e:
            raise ArchiveSettingsError(f"{table}.channel", f"{where}: {e}") from None
        if parsed.spy:
            raise ArchiveSettingsError(f"{table}.channel", f"{where}: name the publication's "
                                       f"channel; the archive adds {SPY_PREFIX} itself")
        stream_id = entry.get("stream_id")
        if isinstance(stream_id, bool) or not isinstance(stream_id, int) or \
                not INT32_MIN <= stream_id <= INT32_MAX:
            raise ArchiveSettingsError(f"{table}.stream_id", f"{where}: {stream_id!r} is not "
                                       f"a stream id (an int32)")
        out.append((where, entry, channel, parsed, stream_id))
    return out


def _holds(entries: Any) -> tuple[HoldSpec, ...]:
    specs = []
    for where, entry, channel, _, stream_id in _stream_entries("hold", entries, _HOLD_KEYS):
        group = entry.get("group", DEFAULT_GROUP)
        if not isinstance(group, str) or not group:
            raise ArchiveSettingsError("hold.group", f"{where}: {group!r} is not a name")
        specs.append(HoldSpec(channel, stream_id, group))
    return tuple(specs)


def _records(entries: Any) -> tuple[RecordSpec, ...]:
    specs = []
    for where, entry, channel, parsed, stream_id in _stream_entries("record", entries,
                                                                    _RECORD_KEYS):
        try:
            source = Source(entry.get("source", "local"))
        except ValueError:
            raise ArchiveSettingsError("record.source", f"{where}: {entry.get('source')!r} is "
                                       f"not local or remote") from None
        if source is Source.REMOTE and parsed.media == "ipc":
            raise ArchiveSettingsError("record.source", f"{where}: aeron:ipc is always local")
        bounds = []
        for key, parse in (("retention_max_bytes", parse_size),
                           ("retention_max_age", parse_duration_ns)):
            try:
                bounds.append(parse(entry.get(key, 0)))
            except ValueError as e:
                raise ArchiveSettingsError(f"record.{key}", f"{where}: {e}") from None
        specs.append(RecordSpec(channel, stream_id, source, retention_max_bytes=bounds[0],
                                retention_max_age_ns=bounds[1]))
    return tuple(specs)


def load_settings(path: str | Path) -> ArchiveSettings:
    """The settings of the TOML file at ``path``; raises :class:`ArchiveSettingsError` for a
    bad key or value, and for a file that is not TOML (naming it)."""
    try:
        with open(path, "rb") as file:
            values = tomllib.load(file)
    except tomllib.TOMLDecodeError as e:
        raise ArchiveSettingsError("(file)", f"{path} is not TOML: {e}") from None
    return ArchiveSettings.from_mapping(values)
