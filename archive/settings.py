"""The archive service's settings: one table on the settings framework
(:mod:`slipstream.client.settings`), read from defaults < a TOML file < the environment
(``SLIPSTREAM_ARCHIVE_<KEY>``) < the command line (``--dir``, ``--set KEY=VALUE``), as the
driver's are.  config/archive.toml, every key documented at its default, is generated from the
table (``make config``; a test keeps it in step).  A file also holds
the streams to record (``[[record]]``) and to hold (``[[hold]]``).  A value that is not one the
key takes, and a key not in the table, are refused naming the key."""

from __future__ import annotations

import argparse
import contextlib
import enum
import ipaddress
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import attrs

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
from slipstream.client.errors import ChannelError, ConfigurationError, SlipstreamError
from slipstream.client.holder import DEFAULT_GROUP
from slipstream.client.layout import INT32_MAX, INT32_MIN
from slipstream.client.settings import (
    SettingsTable,
    checked_by,
    choice,
    duration,
    integer,
    path,
    port_table,
    size,
    sources_field,
    text,
    text_list,
    toml_string,
)

#: The environment's prefix of the archive's settings: SLIPSTREAM_ARCHIVE_CONTROL_PORT sets
#: control_port (the driver's are SLIPSTREAM_<KEY>).
ENV_PREFIX: Final = "SLIPSTREAM_ARCHIVE_"
#: Where an archive takes calls unless its settings say otherwise: Aeron Archive's control
#: request channel (localhost:8010, stream 10).
DEFAULT_CONTROL_PORT: Final = 8010
DEFAULT_CONTROL_STREAM_ID: Final = 10

_KiB = 1 << 10
_MiB = 1 << 20
_GiB = 1 << 30
_MS = 1_000_000
_S = 1_000_000_000
_HOUR = 3600 * _S
_YEARS_10 = 10 * 365 * 24 * _HOUR  # the most a retention age or a release may be


class ArchiveSettingsError(ConfigurationError, ValueError):
    """A setting the archive refuses; ``key`` names it."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason)
        self.args = (f"archive setting {key!r}: {reason}",)


@contextlib.contextmanager
def _named_archive_errors() -> Iterator[None]:
    """A ConfigurationError raised within, as the :class:`ArchiveSettingsError` it is."""
    try:
        yield
    except ArchiveSettingsError:
        raise
    except ConfigurationError as e:
        raise ArchiveSettingsError(e.key, e.problem) from None


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




def _peer(entry: str) -> Peer:
    """One ``peers`` entry (:func:`parse_peer`); ValueError naming its problem otherwise."""
    peer_key = None
    if "|" in entry:
        entry, _, keyed = entry.partition("|")
        peer_key = keyed.removeprefix("key=")
        if not keyed.startswith("key=") or key_name_problem(peer_key) is not None:
            raise ValueError(f"{entry}|{keyed!r}: after '|' only key=NAME (a key name) is "
                             f"accepted")
    endpoint, _, stream = entry.partition("/")
    try:
        where = parse_address(endpoint, "peers")
        if where.port is None or ":" in where.host:
            raise ValueError(endpoint)
        peer = Peer(where.host, where.port,
                    int(stream) if stream else DEFAULT_CONTROL_STREAM_ID, peer_key)
    except (ValueError, ChannelError):
        raise ValueError(f"{entry!r} is not \"host:port\" or \"host:port/stream_id\" (an "
                         f"IPv4 address or a host name)") from None
    if not 0 < peer.port <= 65535 or not INT32_MIN <= peer.control_stream_id <= INT32_MAX:
        raise ValueError(f"{entry!r}: the port is not in 1..65535, or the stream id not an "
                         f"int32")
    return peer


def parse_peer(entry: Any, key: str = "peers") -> Peer:
    """``"host:port"`` or ``"host:port/stream_id"`` (the stream id defaults to Aeron
    Archive's control stream, :data:`DEFAULT_CONTROL_STREAM_ID`), either followed by
    ``|key=NAME`` for a control endpoint keyed NAME (the peer's ``control_keys``); the host
    an IPv4 address or a host name, which is kept as a name: the link to the peer follows it
    when the peer moves (docs/CHANNELS.md §7.2, "Names that follow their peer").  Raises
    :class:`ArchiveSettingsError` naming ``key``."""
    if not isinstance(entry, str):
        raise ArchiveSettingsError(key, f"{entry!r} is not \"host:port\"")
    try:
        return _peer(entry)
    except ValueError as e:
        raise ArchiveSettingsError(key, str(e)) from None


def _check_ipv4(value: str) -> str | None:
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return "is not an IPv4 address of this host"
    return None


def _check_write_behind(value: int) -> str | None:
    return "is neither 0 nor at least 64k" if 0 < value < 64 * _KiB else None


def _check_control_keys(value: Mapping[str, int]) -> str | None:
    for name, port in value.items():
        problem = key_name_problem(name)
        if problem is not None:
            return problem
        if not 0 < port <= 65535:
            return f"{name} = {port!r} is not a UDP port (1..65535)"
    if len(set(value.values())) != len(value):
        return "two keys on one port: an endpoint has one key (docs/CHANNELS.md §7.8)"
    return None


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



@attrs.frozen(kw_only=True)
class ArchiveSettings:
    """The archive's settings: one field per key; sizes in bytes, durations in nanoseconds;
    0 for a retention limit is none.  ``records`` and ``holds`` are the file's
    ``[[record]]`` and ``[[hold]]`` tables; ``sources`` where each value came from
    (default/file/env/cli), for ``--print-config``.  Construct with native values or text
    with units; every value is checked, then the rules across keys apply."""

    # ---------------------------------------------------------------- storage
    dir: Path = path(
        Path("/var/lib/slipstream-archive"),
        "The archive directory: the catalog (archive.catalog), the lock (archive.lock) and "
        "the segment files (<recording id>-<segment base position>.rec). Made if absent. The "
        "archive removes only segment files of its own recordings in its catalog, nothing "
        "else there.",
        section="Storage",
    )
    driver_dir: Path | None = path(
        None,
        "The driver directory of this host's driver, whose client the archive is; \"\" means "
        "the client's default (SLIPSTREAM_DIR, else /dev/shm/slipstream-<user>).",
        optional=True,
    )
    segment_length: int = size(
        DEFAULT_SEGMENT_LENGTH,
        "Length of a segment file. A stream whose term is longer gets segments of one term (a "
        "segment holds whole terms). Aeron Archive's default.",
        low=MIN_SEGMENT_LENGTH, high=MAX_SEGMENT_LENGTH, power_of_two=True,
    )
    sync: SyncPolicy = choice(
        SyncPolicy.NONE, SyncPolicy,
        "When recorded bytes are made durable, and so which recorded position is reported "
        "outward. none: written to the page cache, which survives the archive's kill -9, not "
        "the machine's crash (the last seconds may be lost; recovery finds the last whole "
        "frame). segment: fdatasync of a segment as it fills and at stop, the catalog after: "
        "a machine crash loses at most the segment being written. interval: fdatasync of the "
        "segment being written at least every sync_interval while bytes wait: a machine crash "
        "loses at most that much time's bytes. The archive's subscriber position (what holds "
        "the stream's publisher, and what a network stream's status messages report) never "
        "passes the reported position: under segment and interval the archive therefore also "
        "syncs whenever it has caught up with the stream.",
    )
    sync_interval: int = duration(
        100 * _MS,
        "With sync = \"interval\": the most time between two fdatasyncs of a segment being "
        "written (above 0 then).",
    )
    block_length: int = size(
        _MiB,
        "The most bytes one write takes from a stream's log (whole frames within one term): "
        "Aeron Archive's file-io-max-length. Larger blocks mean fewer system calls per byte.",
        low=4096, high=64 * _MiB,
    )
    write_behind: int = size(
        8 * _MiB,
        "Write-behind: each time this many more bytes of a segment were written, the kernel "
        "starts writing them to the disk, and the chunk before, once on the disk, leaves the "
        "page cache (sync_file_range, then POSIX_FADV_DONTNEED), four chunks kept under way. "
        "The archive then holds about five chunks of cache per recording (40 MiB at 8 MiB), "
        "none of a closed segment, and writes at the disk's pace from the start, instead of "
        "filling the page cache at memory speed until the kernel's dirty limit stops it for "
        "seconds (and, on a VM, taking new pages the host must back). Not durability (the sync "
        "policy is); a replay of what is older than those chunks reads the disk. Below "
        "segment_length (left out: off when the default is not). 0 = off: the page cache "
        "keeps everything (a burst up to the dirty limit is absorbed at memory speed).",
        low=0, high=_GiB, check=_check_write_behind,
        accepted_text="0 (off) or a size in 64k..1g",
    )
    # ---------------------------------------------------------------- retention
    retention_max_bytes: int = size(
        0,
        "Retention by total size: while the archive's segment files take more than this, whole "
        "oldest segments are removed, of stopped recordings first, never a live recording's "
        "segment being written. 0 = no limit. Each [[record]] may bound its own stream too "
        "(below).",
        low=0, high=1 << 50, section="Retention",
    )
    retention_max_age: int = duration(
        0,
        "Retention by age: a segment not written for longer than this is removed (from its "
        "recording's start, never the segment being written). 0 = no limit.",
        high=_YEARS_10,
    )
    retention_check_interval: int = duration(
        10 * _S, "How often retention looks.", low=_MS,
    )
    # ---------------------------------------------------------------- the control stream
    control_address: str = text(
        "127.0.0.1",
        "The control stream: where the archive takes calls (list, describe, "
        "recording_position, replay, stop_replay, and state, view, ended, release about held "
        "streams: docs/ARCHIVE.md, \"The control stream\"), a UDP endpoint of this host "
        "(control_address, control_port) and a stream id (control_stream_id), as Aeron "
        "Archive's control request channel (localhost:8010, stream 10). Answers and replays "
        "go to the channels callers name. A call on this plain endpoint is anyone's: it is "
        "answered only about plain recordings and streams (docs/ARCHIVE.md, \"Protected "
        "calls\").",
        check=_check_ipv4, accepted_text="an IPv4 address of this host",
        section="The control stream",
    )
    control_port: int = integer(
        DEFAULT_CONTROL_PORT,
        "The control stream's UDP port. 0 = no control stream (recording only, unless "
        "control_keys names endpoints).",
        low=0, high=65535,
    )
    control_stream_id: int = integer(
        DEFAULT_CONTROL_STREAM_ID, "The control stream's stream id.",
        low=INT32_MIN, high=INT32_MAX,
    )
    control_keys: Mapping[str, int] = port_table(
        "Keyed control endpoints, one per key name: { NAME = port, ... }, each a UDP port of "
        "control_address taking calls sealed under key=NAME (NAME.key in the driver's "
        "keys_dir, docs/CHANNELS.md §7.8). A call that arrives on NAME's endpoint is from a "
        "holder of NAME: it is answered about recordings and held streams of key=NAME (and "
        "plain ones), its answers and replays sealed under NAME. A recording or held stream "
        "of a key is answered only on that key's endpoint; elsewhere each call about it is "
        "refused, named and counted (calls-refused counters), and list leaves it out. One "
        "archive serves callers of several keys with one endpoint each (an endpoint has one "
        "key); a port may not be control_port's nor another key's. {} = none. E.g. "
        "control_keys = { k1 = 8012, k2 = 8014 }; from the environment or --set: "
        "k1=8012,k2=8014.",
        check=_check_control_keys,
        accepted_text="{} or { NAME = port, ... } (text: NAME=port,...), a port in 1..65535",
    )
    control_subnets: str = text(
        "",
        "The subnets whose calls are answered, as join= takes them: \"10.1.0.0/16,fd00::/8\" (a "
        "bare address its own /32). A call is refused and counted (call-outside-subnets) when "
        "its source address (its image's: the address its stream set up from), its reply "
        "channel or a replay channel it names lies outside; one from outside is not answered "
        "at all. A source address is what the datagram says: on a plain endpoint a host that "
        "spoofs addresses passes this; on a keyed one only a key holder can. \"\" = any "
        "source.",
        check=checked_by(parse_join),
        accepted_text='"" (any) or subnets ADDRESS/PREFIX separated by commas',
    )
    # ---------------------------------------------------------------- catch-up from peers
    peers: tuple[Peer, ...] = text_list(
        "Catch-up from other archives that record the same streams (docs/ARCHIVE.md, \"Two "
        "archives\"): their control streams, \"host:port\" or \"host:port/stream_id\" (stream "
        "id 10 when not given; the host an IPv4 address or a name, followed when it moves). "
        "Every replication_interval the archive lists each peer's recordings of the stream ids "
        "of its [[record]] tables and fetches, one range at a time, what it does not hold of "
        "each session (same session id, initial term id and term length): the peer replays "
        "the range to this host and the archive records it as a recording of its own, a "
        "replica, at the same positions. An archive that was down thus catches up from one "
        "that was not. An entry may end in |key=NAME (\"10.0.0.2:8012/10|key=k1\"): the "
        "peer's control endpoint of that key (its control_keys); the calls, answers and "
        "replays are then sealed under NAME, and only that key's recordings (and plain ones) "
        "are listed to it. A peer's recording is replicated only under a [[record]] of the "
        "same key. [] = none; from the environment or --set, entries separated by commas.",
        _peer, section="Catch-up from peers",
        accepted_text='a list of "host:port[/stream_id][|key=NAME]"',
    )
    replication_interval: int = duration(
        5 * _S,
        "How often the archive looks at its peers for ranges it lacks (and retries a fetch a "
        "peer's death cut short). The first look is one interval after the archive starts, "
        "when it has joined the live streams again (so it fetches only what it missed before "
        "that).",
        low=_MS,
    )
    replication_timeout: int = duration(
        2 * _S,
        "How long a call to a peer waits for its answer. A peer whose control stream has no "
        "subscriber is passed over without a call; one that stops answering delays the "
        "catch-up by this long, once per interval (the calls run on a thread of their own, "
        "never on the one that records).",
        low=_MS,
    )
    replication_address: str | None = text(
        None,
        "This host's address that the peers' answers and replays come to; \"\" = the address "
        "of this host towards each peer (its route).",
        optional=True, check=_check_ipv4,
        accepted_text='an IPv4 address of this host, or "" for the one towards each peer',
    )
    replication_port: int = integer(
        0,
        "The UDP port on this host that the peers' answers and replays come to (open it to the "
        "peers); 0 = control_port + 1 (not the peer's port, which is this archive's own "
        "control port when both use the same). The answers of peers entered with |key=NAME "
        "come to a port each key of its own: replication_port + 1 + n, n the key's place "
        "among the peers' key names in order (an endpoint has one key).",
        low=0, high=65535,
    )
    # ---------------------------------------------------------------- held streams
    release_after: int = duration(
        0,
        "A held stream's group that no query called (state, view, ended) for this long is "
        "released: its subscription closes and stops holding the stream's publishers. 0 = "
        "never.",
        high=_YEARS_10, section="Held streams",
    )

    records: tuple[RecordSpec, ...] = ()
    holds: tuple[HoldSpec, ...] = ()
    sources: Mapping[str, str] = sources_field()

    def __attrs_post_init__(self) -> None:
        if self.write_behind >= self.segment_length and "write_behind" not in self.sources \
                and self.write_behind == SETTINGS["write_behind"].default:
            # The default's chunk does not fit a short segment: write-behind is off there.
            object.__setattr__(self, "write_behind", 0)
        if self.sync_interval <= 0 and self.sync is SyncPolicy.INTERVAL:
            raise ArchiveSettingsError("sync_interval", "must be > 0 with sync = \"interval\"")
        if self.write_behind >= self.segment_length:
            raise ArchiveSettingsError(
                "write_behind", f"{self.write_behind} bytes is not below segment_length "
                f"({self.segment_length} bytes): a chunk must fit in a segment (0 = off)")
        if self.control_port in self.control_keys.values():
            raise ArchiveSettingsError("control_keys", f"port {self.control_port} is "
                                       f"control_port's (the plain endpoint's)")
        control_ports = {self.control_port, *self.control_keys.values()}
        peer_keys = {peer.key for peer in self.peers}
        for name, port in replication_reply_ports(self.replication_port, self.control_port,
                                                  self.peers).items():
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
        if self.holds and self.control_port == 0 and not self.control_keys:
            # Only a group's commit (the view call's advance_to) moves a held position: with
            # no control stream nothing would, and the publishers would be held for good.
            raise ArchiveSettingsError("hold", "needs the control stream (control_port is 0, "
                                               "no control_keys): a held stream moves only "
                                               "by its readers' calls")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *,
                     sources: Mapping[str, str] | None = None) -> ArchiveSettings:
        """Settings from a TOML document's table (``record`` and ``hold`` the arrays of
        tables); raises :class:`ArchiveSettingsError` naming an unknown key or a bad
        value.  Without ``sources`` every key given counts as the file's."""
        with _named_archive_errors():
            for key in values:
                TABLE.require_known(key)
            flat = {key: value for key, value in values.items() if key not in _TABLES}
            return cls(**flat, records=_records(values.get("record", [])),
                       holds=_holds(values.get("hold", [])),
                       sources=dict.fromkeys(flat, "file") if sources is None else sources)

    @property
    def subnets(self) -> tuple[Subnet, ...]:
        """``control_subnets`` parsed: the subnets whose calls are answered (none: any)."""
        return parse_join(self.control_subnets) if self.control_subnets else ()


TABLE: Final = SettingsTable(ArchiveSettings, name="archive", env_prefix=ENV_PREFIX,
                             shipped="archive.toml", tables=_TABLES)
"""The archive's table on the settings framework: its layers and its texts."""

SETTINGS: Final = TABLE.settings
"""Every setting by key, in definition order (the table ArchiveSettings is built from)."""


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
        for key in ("retention_max_bytes", "retention_max_age"):
            # Parsed and checked as the archive-wide key of the same name is.
            spec = SETTINGS[key]
            try:
                value = spec.parse(f"record.{key}", entry.get(key, 0))
                spec.validate(f"record.{key}", value)
            except ConfigurationError as e:
                raise ArchiveSettingsError(e.key, f"{where}: {e.problem}") from None
            bounds.append(value)
        specs.append(RecordSpec(channel, stream_id, source, retention_max_bytes=bounds[0],
                                retention_max_age_ns=bounds[1]))
    return tuple(specs)



def load_settings(config_file: str | Path | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> ArchiveSettings:
    """Defaults < ``config_file`` (TOML) < ``env`` (``SLIPSTREAM_ARCHIVE_<KEY>``; default
    ``os.environ``) < ``overrides``.  Raises :class:`ArchiveSettingsError` naming the key for
    a bad key or value (and where it was set), and for a file that is not TOML."""
    with _named_archive_errors():
        return TABLE.load(config_file, env, overrides)


def load_settings_from_args(namespace: argparse.Namespace,
                            env: Mapping[str, str] | None = None) -> ArchiveSettings:
    """:func:`load_settings` with the file and overrides :func:`add_arguments` flags give."""
    with _named_archive_errors():
        return TABLE.load_from_args(namespace, env)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE``, ``--dir DIR``, ``--set KEY=VALUE`` (repeatable) and
    ``--print-config`` to the service's command."""
    TABLE.add_arguments(parser, set_example="segment_length=64m",
                        dir_help="the archive directory (its dir setting)")


def _stream_tables(settings: ArchiveSettings) -> list[str]:
    """The ``[[record]]`` and ``[[hold]]`` tables of ``settings``, as TOML lines."""
    lines = []
    for spec in settings.records:
        lines += ["", "[[record]]", f"channel = {toml_string(spec.channel)}",
                  f"stream_id = {spec.stream_id}", f"source = {toml_string(spec.source.value)}",
                  f"retention_max_bytes = {spec.retention_max_bytes}",
                  f"retention_max_age = {spec.retention_max_age_ns}"]
    for held in settings.holds:
        lines += ["", "[[hold]]", f"channel = {toml_string(held.channel)}",
                  f"stream_id = {held.stream_id}", f"group = {toml_string(held.group)}"]
    return lines


def format_settings(settings: ArchiveSettings) -> str:
    """The resolved settings as loadable TOML (``--print-config``): one ``key = value  #
    source`` line each, then the streams to record and hold.  Loading the text as a config
    file gives settings equal to ``settings``."""
    return TABLE.format(settings) + "".join(line + "\n" for line in _stream_tables(settings))


_STREAM_TABLES_DOC: Final = """\
# ==============================================================================
# The streams to record and to hold (in a file only)
# ==============================================================================

# The streams to record, one [[record]] table each: every publisher session of the stream is
# a recording of its own, from where the archive joins it.
#   channel    the publication's channel (aeron:ipc, or aeron:udp?endpoint=...)
#   stream_id  the stream id
#   source     "local" (default): a publication of this host's driver, read from its own log
#              (a UDP one through an aeron-spy: subscription, no copy through the network; the
#              spy holds the publisher within a window of what the archive recorded);
#              "remote": another host's, through a subscription like any receiver's.
#   retention_max_bytes, retention_max_age
#              this stream's own retention bounds (its recordings together), within the
#              archive's above; the same rules (docs/ARCHIVE.md, "Retention"). 0 = none.
# [[record]]
# channel = "aeron:udp?endpoint=127.0.0.1:40123"
# stream_id = 1001
# source = "local"
# retention_max_bytes = 0
# retention_max_age = 0

# The streams to hold for groups of readers from the start, one [[hold]] table each
# (docs/ARCHIVE.md, "Holding streams for readers"): a subscription that never reads, its
# position moved only by a group's commit (the view call's advance_to), so the log keeps
# what the group has not committed. Spark's holder option names this archive's control
# stream. A query's first state call holds a stream not listed here too.
#   channel    the stream's channel (the one its publishers send to)
#   stream_id  the stream id
#   group      the readers' group (Spark's holderGroup), default "spark"
# [[hold]]
# channel = "aeron:udp?endpoint=0.0.0.0:40456"
# stream_id = 10
# group = "spark"
"""


def render_default_config() -> str:
    """The text of config/archive.toml: every key at its default, its doc and range above
    it, then the streams' tables, documented."""
    return TABLE.render_default([
        "# slipstream archive configuration: every setting at its default value "
        "(docs/ARCHIVE.md).",
        "#",
        "# Load with `slipstream-archive run --config FILE`. Precedence: built-in defaults <",
        "# this file < environment SLIPSTREAM_ARCHIVE_<KEY> (e.g.",
        "# SLIPSTREAM_ARCHIVE_CONTROL_PORT=8020) < --dir and --set KEY=VALUE. Sizes take k/m/g",
        "# (powers of 1024) or bytes; durations take ns/us/ms/s/m/h or bare nanoseconds. A key",
        "# not listed here, or a value a key does not take, is refused naming the key.",
        "#",
        "# Generated from the table in slipstream/archive/settings.py (make config); edit the",
        "# table there, not this file.",
    ], _STREAM_TABLES_DOC)

