"""Options of the ``slipstream`` data source: parsed once, validated completely.

Spark hands options over as strings in a case-insensitive map (keys arrive lower-cased).  Every
key must be one this source knows, for the direction it is used in; a bad value is an
:class:`OptionError` naming the option and the accepted values.  Parsed options are plain
frozen values, so they pickle to the executors with the reader and writer objects.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Final

from slipstream.archive.settings import DEFAULT_CONTROL_PORT, DEFAULT_CONTROL_STREAM_ID
from slipstream.client.channel import key_name_problem, parse_channel
from slipstream.client.errors import ChannelError, UsageError
from slipstream.client.holder import DEFAULT_GROUP, HOLDER_PORT
from slipstream.client.layout import FRAME_ALIGNMENT, INT32_MAX, INT32_MIN
from slipstream.client.units import parse_duration_ns, parse_size

__all__ = ["EARLIEST", "KAFKA_NAMES", "LATEST", "MAX_READER_STREAMS", "READ_OPTIONS",
           "WRITE_OPTIONS", "OptionError", "SourceOptions", "describe_stream_ids",
           "parse_options", "parse_stream_ids"]


class OptionError(UsageError, ValueError):
    """An option of the ``slipstream`` data source is unknown, misplaced or has a bad value.

    ``option`` is the option's documented (camelCase) name.
    """

    def __init__(self, option: str, problem: str) -> None:
        self.option = option
        super().__init__(f"slipstream data source: option {option!r}: {problem}")


COMMON_OPTIONS = ("channel", "streamId", "directory")
READ_OPTIONS = ("startingPosition", "endingPosition", "startingTimestamp", "endingTimestamp",
                "maxMessagesPerTrigger",
                "maxBytesPerTrigger", "minMessagesPerTrigger", "maxTriggerDelay",
                "failOnDataLoss", "minPartitions", "holder",
                "holderGroup", "holderAddress", "replayPort", "replayTimeoutMs", "archive",
                "archiveDir", "archiveKey",
                "startingOffsetsByTimestamp",
                "startingOffsetsByTimestampStrategy", "includeHeaders")
WRITE_OPTIONS = ("offerTimeoutMs", "durableTimeoutMs")
# Set by Spark itself (writeStream's checkpoint, queryName); accepted and ignored here.
_SPARK_OPTIONS = ("checkpointLocation", "queryName")
#: The Kafka source's names of options that mean the same here, and the name each is known
#: by in :attr:`SourceOptions.given` (both names are accepted; docs/SPARK.md leads with
#: Kafka's).
KAFKA_NAMES = {"startingOffsets": "startingPosition",
               "endingOffsets": "endingPosition",
               "maxOffsetsPerTrigger": "maxMessagesPerTrigger",
               "minOffsetsPerTrigger": "minMessagesPerTrigger"}
#: The Kafka source's options that have no meaning here, and what to use instead (any other
#: ``kafka.*`` option is refused too: it configures a Kafka client).
_KAFKA_ONLY = {
    "kafka.bootstrap.servers": "a stream is reached through this host's driver: name its "
                               "channel URI in 'channel' (default aeron:ipc) and, where the "
                               "driver is not the default one, its 'directory'",
    "subscribe": "a stream is named by 'streamId' (a reader may list several: 10,11, or "
                 "a range: 1000-1099)",
    "subscribePattern": "a stream is named by 'streamId' (a reader may list several: 10,11, "
                        "or a range: 1000-1099)",
    "assign": "a stream is named by 'streamId'; its sessions are all read (per-session "
              "starts: startingOffsets {\"STREAM\": {\"SESSION\": POSITION}})",
    "topic": "a writer publishes to the stream named by 'streamId'",
    "groupIdPrefix": "a query holds its own position; a standing holder's group is "
                     "'holderGroup'",
    "kafkaConsumer.pollTimeoutMs": "a read task on another host waits 'replayTimeoutMs' for "
                                   "its replay",
    "fetchOffset.numRetries": "offsets are read from the driver's shared memory, with no "
                              "fetch to retry",
    "fetchOffset.retryIntervalMs": "offsets are read from the driver's shared memory, with "
                                   "no fetch to retry",
}
_KAFKA_ONLY_LOWER = {name.lower(): name for name in _KAFKA_ONLY}
_CANONICAL = {name.lower(): name
              for name in (*COMMON_OPTIONS, *READ_OPTIONS, *WRITE_OPTIONS, *_SPARK_OPTIONS,
                           *KAFKA_NAMES)}
#: A position in a ``startingOffsets`` / ``endingOffsets`` object that stands for the oldest
#: held message, and one for the last whole message now (Kafka's -2 and -1).
EARLIEST: Final = -2
LATEST: Final = -1

DEFAULT_CHANNEL = "aeron:ipc"
DEFAULT_OFFER_TIMEOUT_MS = 30_000
#: How long a writer's task waits for its last message to be durable (channel durable=).
DEFAULT_DURABLE_TIMEOUT_MS = 30_000
DEFAULT_REPLAY_TIMEOUT_MS = 30_000
#: How long a trigger waits for minMessagesPerTrigger before it reads what there is (Kafka's
#: maxTriggerDelay default).
DEFAULT_MAX_TRIGGER_DELAY_NS = 15 * 60 * 10**9
#: A timestamp option's bound, ms: in ns it stays below a position's 2**62, as a standing
#: holder's questions require.
_TIMESTAMP_MS_LIMIT = 2**62 // 10**6


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """The validated options (the defaults are the documented ones)."""

    #: The (first) stream: a writer's, and a reader's of one stream.  0 for a writer without
    #: ``streamId`` (it routes every row by its ``stream_id`` column; ``given`` tells).
    stream_id: int
    #: A reader's streams, on ``channel`` (``streamId`` may list several and ranges of them:
    #: ``10,11``, ``1000-1099``, ``1,5-9``: :func:`parse_stream_ids`); their
    #: sessions' offsets are keyed ``"<stream>:<session>"`` when there are several.
    stream_ids: tuple[int, ...] = ()
    channel: str = DEFAULT_CHANNEL
    directory: str | None = None
    #: ``latest``, ``earliest``, or per session (keyed as the offsets key it) the position to
    #: start at, :data:`EARLIEST` or :data:`LATEST`; a session not named starts where the
    #: read starts by default (a stream: ``latest``; a batch read: ``earliest``).
    starting_position: str | dict[str, int] = "latest"
    #: Batch reads: ``latest``, or per session the position to end at, or :data:`LATEST`.
    ending_position: str | dict[str, int] = "latest"
    #: Start each session at its first message stamped at or after this time (ns since the
    #: epoch; the option is in ms, as Kafka's), in place of ``starting_position``.
    starting_timestamp_ns: int | None = None
    #: Batch reads: end each session before its first message stamped at or after this.
    ending_timestamp_ns: int | None = None
    #: ``startingOffsetsByTimestamp``: per (stream id, session id), the time (ns since the
    #: epoch) its first message to read is stamped at or after; the other sessions start as
    #: ``starting_position`` says.
    starting_timestamps_ns: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    #: ``startingOffsetsByTimestampStrategy``: what a session a starting time names, but that
    #: has no message stamped at or after it, does: ``error`` (the read fails naming it) or
    #: ``latest`` (it starts at its last whole message).
    timestamp_strategy: str = "error"
    max_messages_per_trigger: int | None = None
    max_bytes_per_trigger: int | None = None
    #: A micro-batch waits for this many messages in all, unless ``max_trigger_delay_ns``
    #: passed since the last batch that read (Kafka's minOffsetsPerTrigger).
    min_messages_per_trigger: int | None = None
    max_trigger_delay_ns: int = DEFAULT_MAX_TRIGGER_DELAY_NS
    fail_on_data_loss: bool = True
    min_partitions: int | None = None
    offer_timeout_ms: int = DEFAULT_OFFER_TIMEOUT_MS
    #: With the channel's durable=: how long a task waits, after its last offer, for its last
    #: message to be durable before it fails (0: it does not wait).
    durable_timeout_ms: int = DEFAULT_DURABLE_TIMEOUT_MS
    holder_address: str | None = None  # None: found by the holder (planning.holder_address)
    replay_port: int = HOLDER_PORT
    #: A standing holder's (address, port): the ingest host that holds the stream, or None
    #: (the query holds it itself, on the Spark driver's host).
    holder: tuple[str, int] | None = None
    holder_group: str = DEFAULT_GROUP
    replay_timeout_ms: int = DEFAULT_REPLAY_TIMEOUT_MS
    #: Archives that record the stream (``archive``: their control endpoints, address, port
    #: and control stream id, the first preferred): ranges the live log no longer holds are
    #: read from them.
    archives: tuple[tuple[str, int, int], ...] = ()
    #: ``archiveDir``: the archive directory on the archives' hosts; a task on such a host
    #: reads a recording there in place.
    archive_dir: str | None = None
    #: The key the calls to the archives and the holder are sealed under (their control
    #: endpoints of that key): the channel's ``key=``, or ``archiveKey`` for a plain stream;
    #: None: plain calls (docs/SPARK.md, "Keyed streams").
    call_key: str | None = None
    #: The reader's ``queryName`` option, if given: it names the query's lag counter.
    query_name: str | None = None
    given: frozenset[str] = frozenset()  # canonical names of the options the user set
    #: ``includeHeaders``: the read schema has the ``headers`` column.
    include_headers: bool = False
    #: (canonical name, the name the user gave it by) of options given by their Kafka name.
    spellings: tuple[tuple[str, str], ...] = ()

    def name_of(self, option: str) -> str:
        """The name the user gave ``option`` (a canonical name) by: its Kafka name or ours."""
        return dict(self.spellings).get(option, option)

    def require_stream_id(self) -> None:
        """Raise :class:`OptionError` unless ``streamId`` was given (a reader needs it; a
        writer routing by a ``stream_id`` column does not)."""
        if "streamId" not in self.given:
            raise OptionError("streamId", "is required (a 32-bit integer, e.g. 1001)")

    def check_direction(self, direction: str) -> None:
        """Raise :class:`OptionError` for an option of the other direction (``"read"`` or
        ``"write"``): ``offerTimeoutMs`` on a reader is a mistake worth reporting."""
        if direction == "read":
            self.require_stream_id()
        if direction == "write" and len(self.stream_ids) > 1:
            raise OptionError("streamId", "a writer publishes to one stream: name one")
        foreign = WRITE_OPTIONS if direction == "read" else READ_OPTIONS
        for name in foreign:
            if name in self.given:
                other = "writing" if direction == "read" else "reading"
                raise OptionError(self.name_of(name),
                                  f"applies to {other} only; remove it from this "
                                  f"{'reader' if direction == 'read' else 'writer'}")
        if direction == "write" and parse_channel(self.channel).policy is not None:
            # A policy answers back pressure in the offer itself (drop, error, block with a
            # timeout of its own); the writer waits offerTimeoutMs and retries what was not
            # appended, which a dropping policy would have counted as dropped.
            raise OptionError("channel", "policy= does not apply to a writer, which waits up "
                                         "to offerTimeoutMs under back pressure and then "
                                         "fails the task: remove policy= from the channel")
        if (direction == "write" and "durableTimeoutMs" in self.given
                and parse_channel(self.channel).durable is None):
            raise OptionError("durableTimeoutMs", "waits for the channel's durable= receivers, "
                                                  "and this channel has no durable= key: add "
                                                  "durable=<gtag>/<receivers> to it, or remove "
                                                  "durableTimeoutMs")


    def check_read_kind(self, *, streaming: bool) -> None:
        """Raise :class:`OptionError` for a read option of the other kind of read: per-trigger
        limits on a batch read, ``endingPosition`` and ``endingTimestamp`` on a stream; and
        for ``holderAddress`` beside ``holder``, or a batch read without ``holder`` or
        ``archive`` (a batch read's planner ends before its tasks run, so only a standing
        holder's log or an archive's recording holds the range for them)."""
        if "holder" in self.given and "holderAddress" in self.given:
            raise OptionError("holderAddress", "is the address of a query that holds its stream "
                                               "itself; with 'holder', the ingest host's "
                                               "holder serves the reads: remove one")
        if streaming:
            for name in ("endingPosition", "endingTimestamp"):
                if name in self.given:
                    raise OptionError(self.name_of(name), "applies to batch reads only "
                                                          "(spark.read); a stream has no end")
            return
        for name in ("maxMessagesPerTrigger", "maxBytesPerTrigger", "minMessagesPerTrigger",
                     "maxTriggerDelay"):
            if name in self.given:
                raise OptionError(self.name_of(name), "applies to streaming reads only "
                                                      "(spark.readStream)")
        if self.holder is None and not self.archives:
            raise OptionError("holder", "is required by a batch read (spark.read) that names "
                                        "no 'archive': the ingest host whose archive holds "
                                        "the stream, HOST[:PORT], or the archives that "
                                        "recorded it (docs/SPARK.md)")


#: The most streams one reader reads (``streamId``'s list and ranges in all): each is a
#: subscription of the planner's and a key of every offset the query checkpoints.
MAX_READER_STREAMS: Final = 1024
_ONE_STREAM = re.compile(r"\s*(-?\d+)\s*")
_STREAM_RANGE = re.compile(r"\s*(-?\d+)\s*-\s*(-?\d+)\s*")
_STREAM_IDS_ACCEPTED = (f"accepted: a stream id, {INT32_MIN}..{INT32_MAX}, or a reader's "
                        f"comma-separated list of ids and inclusive ranges of them: 10,11 or "
                        f"1000-1099 or 1,5-9")


def parse_stream_ids(text: str) -> tuple[int, ...]:
    """``streamId``'s stream ids in the order named: comma-separated parts, each a stream id
    (a 32-bit integer, ``-5`` too) or an inclusive range ``FIRST-LAST`` (``1000-1099``,
    ``-10--1``).  Raises :class:`OptionError` naming ``streamId`` and the bad part: one that
    is no id or range, a range whose first id is after its last, an id out of range, an id
    named twice, or more than :data:`MAX_READER_STREAMS` ids in all."""
    stream_ids: list[int] = []
    named_in: dict[int, str] = {}  # each id, and the part that named it
    for part in text.split(","):
        if not part.strip():
            raise OptionError("streamId", f"{text!r} has an empty part "
                                          f"({_STREAM_IDS_ACCEPTED})")
        single = _ONE_STREAM.fullmatch(part)
        span = None if single else _STREAM_RANGE.fullmatch(part)
        if single is None and span is None:
            raise OptionError("streamId", f"{part.strip()!r} is not a stream id or a range of "
                                          f"them ({_STREAM_IDS_ACCEPTED})")
        first, last = (int(single[1]),) * 2 if single else (int(span[1]), int(span[2]))
        for bound in (first, last):
            if not INT32_MIN <= bound <= INT32_MAX:
                raise OptionError("streamId", f"{part.strip()!r}: {bound} is out of range "
                                              f"(accepted: {INT32_MIN}..{INT32_MAX})")
        if first > last:
            raise OptionError("streamId", f"{part.strip()!r}: the range's first stream id "
                                          f"{first} is after its last, {last} (accepted: "
                                          f"FIRST-LAST with FIRST <= LAST)")
        if len(stream_ids) + last - first + 1 > MAX_READER_STREAMS:
            raise OptionError("streamId", f"{part.strip()!r}: names {last - first + 1} "
                                          f"stream{'s' if last > first else ''}, which makes "
                                          f"{len(stream_ids) + last - first + 1} in all, over "
                                          f"MAX_READER_STREAMS, the {MAX_READER_STREAMS} one "
                                          f"reader reads at most: split the streams over "
                                          f"queries")
        for stream_id in range(first, last + 1):
            if stream_id in named_in:
                raise OptionError("streamId", f"{stream_id} is named twice (by "
                                              f"{named_in[stream_id]!r} and {part.strip()!r})")
            named_in[stream_id] = part.strip()
            stream_ids.append(stream_id)
    return tuple(stream_ids)


def describe_stream_ids(stream_ids: Sequence[int]) -> str:
    """``stream_ids`` as ``streamId`` names them, runs of consecutive ids as ranges:
    ``1000-1099``, ``1,5-9`` (the inverse of :func:`parse_stream_ids`)."""
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(stream_ids), lambda pair: pair[1] - pair[0]):
        ids = [stream_id for _, stream_id in run]
        parts.append(str(ids[0]) if len(ids) == 1 else
                     f"{ids[0]},{ids[1]}" if len(ids) == 2 else f"{ids[0]}-{ids[-1]}")
    return ",".join(parts)


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise OptionError(name, f"{text!r} is not an integer (accepted: a whole number "
                                f">= 1)") from None
    if value < 1:
        raise OptionError(name, f"{value} is not >= 1 (accepted: a whole number >= 1)")
    return value


def _positions(name: str, text: str, words: tuple[str, ...], stream_ids: tuple[int, ...],
               *, ending: bool) -> str | dict[str, int]:
    """One of ``words``, or a JSON object of per-session positions keyed as the offsets key
    sessions (:func:`~slipstream.spark_bridge.planning.offset_key`).

    The object is Kafka's, ``{"STREAM": {"SESSION": POSITION}}`` (a topic is a stream, a
    partition a session), or ``{"SESSION": POSITION}`` / ``{"STREAM:SESSION": POSITION}``.
    A position is a stream position, or -2 (:data:`EARLIEST`, not for an end) or -1
    (:data:`LATEST`).  ``name`` is the option's name as the user gave it.
    """
    stripped = text.strip()
    example = stream_ids[0] if stream_ids else "STREAM"  # a writer may name no stream
    accepted = (f"{', '.join(words)}, or a JSON object of stream to session to position, "
                f"{{\"{example}\": {{\"SESSION\": POSITION}}}}, in which "
                f"{'-1 is latest' if ending else '-2 is earliest and -1 latest'}")
    if stripped.lower() in words:
        return stripped.lower()
    try:
        positions = json.loads(stripped)
    except json.JSONDecodeError:
        raise OptionError(name, f"{text!r} is not accepted (accepted: {accepted})") from None
    if not isinstance(positions, dict):
        raise OptionError(name, f"{text!r} is not accepted (accepted: {accepted})")
    named: list[tuple[str, object]] = []
    for key, value in positions.items():
        if isinstance(value, dict):  # Kafka's: a topic (stream) of partitions (sessions)
            named.extend((f"{key}:{session}", position) for session, position in value.items())
        else:
            named.append((key, value))
    result: dict[str, int] = {}
    for session, position in named:
        stream_text, _, session_text = session.rpartition(":")
        try:
            sid = int(session_text)
            stream_id = int(stream_text) if stream_text else stream_ids[0]
        except ValueError:
            raise OptionError(name, f"session {session!r} is not a session id (or "
                                    f"STREAM:SESSION)") from None
        if not INT32_MIN <= sid <= INT32_MAX:
            raise OptionError(name, f"session {session!r}: {sid} is not a session id "
                                    f"({INT32_MIN}..{INT32_MAX})")
        if stream_id not in stream_ids:
            raise OptionError(name, f"stream {stream_id} (of session {session!r}) is not read "
                                    f"by this query (streamId: "
                                    f"{describe_stream_ids(stream_ids)})")
        words_allowed = (LATEST,) if ending else (EARLIEST, LATEST)
        also = "or -1 (latest)" if ending else "or -2 (earliest) or -1 (latest)"
        if isinstance(position, bool) or not isinstance(position, int) or \
                (position < 0 and position not in words_allowed) or \
                (position >= 0 and position % FRAME_ALIGNMENT):
            raise OptionError(name, f"session {session}: {position!r} is not a stream "
                                    f"position (a multiple of {FRAME_ALIGNMENT}, >= 0) "
                                    f"{also}")
        key = f"{stream_id}:{sid}" if len(stream_ids) > 1 else str(sid)
        if key in result:
            raise OptionError(name, f"session {session!r} is named twice")
        result[key] = position
    return result


def _holder(text: str, port: int) -> tuple[str, int]:
    """``HOST[:PORT]`` of a standing holder (the port defaults to ``replayPort``)."""
    host, _, port_text = text.strip().rpartition(":") if ":" in text else (text.strip(), "", "")
    if port_text:
        try:
            port = int(port_text)
        except ValueError:
            port = 0
        if not 1 <= port <= 65535:
            raise OptionError("holder", f"{text!r}: {port_text!r} is not a UDP port (accepted: "
                                        f"HOST or HOST:PORT, the ingest host's archive)")
    if not host:
        raise OptionError("holder", f"{text!r} names no host (accepted: HOST or HOST:PORT)")
    return host, port


def _archives(text: str) -> tuple[tuple[str, int, int], ...]:
    """``HOST[:PORT[/STREAM]][,...]``: archives' control endpoints (the port and control
    stream default to an archive's own defaults).  Host names resolve where the query plans."""
    accepted = ("accepted: HOST[:PORT[/STREAM]], comma-separated, the control endpoints of "
                "archives that record the stream, e.g. 10.0.0.3:8010")
    archives = []
    for item in text.split(","):
        item = item.strip()
        where, _, stream_text = item.partition("/")
        host, _, port_text = where.rpartition(":") if ":" in where else (where, "", "")
        try:
            port = int(port_text) if port_text else DEFAULT_CONTROL_PORT
            stream = int(stream_text) if stream_text else DEFAULT_CONTROL_STREAM_ID
        except ValueError:
            raise OptionError("archive", f"{item!r} is not accepted ({accepted})") from None
        if not host or not 1 <= port <= 65535 or not INT32_MIN <= stream <= INT32_MAX:
            raise OptionError("archive", f"{item!r} is not accepted ({accepted})")
        if (host, port, stream) in archives:
            raise OptionError("archive", f"{item!r} is named twice")
        archives.append((host, port, stream))
    return tuple(archives)


def parse_options(options: Mapping[str, str]) -> SourceOptions:
    """Validate Spark's option map; raises :class:`OptionError` naming the first bad option.

    ``streamId`` is required by readers (:meth:`SourceOptions.check_direction`) and by
    writers that do not route by a ``stream_id`` column (:func:`~slipstream.spark_bridge.
    writer.check_schema`); ``channel`` defaults to ``aeron:ipc``; ``directory`` to the
    client's default driver directory ($SLIPSTREAM_DIR, else /dev/shm/slipstream-<user>).
    """
    given: dict[str, str] = {}
    spelled: dict[str, str] = {}  # canonical name -> the name it was given by
    for key, value in sorted(options.items()):
        kafka_only = _KAFKA_ONLY_LOWER.get(key.lower())
        if kafka_only is not None or key.lower().startswith("kafka."):
            instead = _KAFKA_ONLY[kafka_only] if kafka_only is not None else \
                "it configures a Kafka client, and this source reads a stream through its " \
                "host's driver (channel, streamId, directory)"
            raise OptionError(kafka_only or key, f"is the Kafka source's and has no meaning "
                                                 f"here: {instead}")
        name = _CANONICAL.get(key.lower())
        if name is None:
            known = ", ".join(sorted((*COMMON_OPTIONS, *READ_OPTIONS, *WRITE_OPTIONS,
                                      *KAFKA_NAMES), key=str.lower))
            raise OptionError(key, f"unknown option (known: {known})")
        canonical = KAFKA_NAMES.get(name, name)
        text = "" if value is None else str(value)
        if canonical in given and not _same_value(given[canonical], text):
            values = {name: text, spelled[canonical]: given[canonical]}
            kafka = name if name in KAFKA_NAMES else spelled[canonical]
            raise OptionError(kafka, f"and {canonical} are one option (Kafka's name and "
                                     f"ours), given {values[kafka]!r} and "
                                     f"{values[canonical]!r}: give one")
        given[canonical] = text
        spelled.setdefault(canonical, name)

    # Required by readers, and by writers whose frame has no stream_id column (both checked
    # once the direction and the frame are known).
    stream_ids = list(parse_stream_ids(given["streamId"])) if "streamId" in given else []

    channel = given.get("channel", DEFAULT_CHANNEL).strip()
    try:
        stream_key = parse_channel(channel).key
    except ChannelError as e:
        raise OptionError("channel", f"{e} (accepted: a channel URI such as aeron:ipc)") from None
    call_key = stream_key
    if "archiveKey" in given:
        call_key = given["archiveKey"].strip()
        problem = key_name_problem(call_key)
        if problem is not None:
            raise OptionError("archiveKey", f"{problem} (accepted: the name of the key=NAME "
                                            f"of the archives' control endpoints)")
        if stream_key is not None and call_key != stream_key:
            raise OptionError("archiveKey", f"{call_key!r}: the stream is of key={stream_key}, "
                                            f"and an archive answers about it only under that "
                                            f"key (leave archiveKey out)")

    directory = given.get("directory")
    if directory is not None and not directory.strip():
        raise OptionError("directory", "is empty (accepted: the driver directory, a path)")

    if not stream_ids and ("startingPosition" in given or "endingPosition" in given):
        raise OptionError("streamId", "is required (a 32-bit integer, e.g. 1001)")
    # A stream starts at latest by default; a batch read at earliest (check_read_kind).
    starting = _positions(spelled.get("startingPosition", "startingOffsets"),
                          given.get("startingPosition", "latest"), ("latest", "earliest"),
                          tuple(stream_ids), ending=False)
    ending = _positions(spelled.get("endingPosition", "endingOffsets"),
                        given.get("endingPosition", "latest"), ("latest",), tuple(stream_ids),
                        ending=True)

    timestamps: dict[str, int | None] = {}
    for name in ("startingTimestamp", "endingTimestamp"):
        timestamps[name] = None
        if name in given:
            text = given[name].strip()
            try:
                milliseconds = int(text)
            except ValueError:
                milliseconds = -1
            if not 0 <= milliseconds < _TIMESTAMP_MS_LIMIT:
                raise OptionError(name, f"{given[name]!r} is not accepted (accepted: "
                                        f"milliseconds since the epoch, 0 to "
                                        f"{_TIMESTAMP_MS_LIMIT - 1})")
            timestamps[name] = milliseconds * 1_000_000

    by_timestamp = _timestamps_by_session(given.get("startingOffsetsByTimestamp"), stream_ids)
    strategy = given.get("startingOffsetsByTimestampStrategy", "error").strip().lower()
    if strategy not in ("error", "latest"):
        raise OptionError("startingOffsetsByTimestampStrategy",
                          f"{given['startingOffsetsByTimestampStrategy']!r} is not accepted "
                          f"(accepted: error, latest)")

    # Kafka's precedence, so that a Kafka query runs unchanged: startingTimestamp over
    # startingOffsetsByTimestamp and startingOffsets, startingOffsetsByTimestamp over
    # startingOffsets (for the sessions it names: here sessions come and go, and the others
    # start as startingOffsets says), endingTimestamp over endingOffsets.  Every option
    # given is checked all the same.
    if timestamps["startingTimestamp"] is not None:
        by_timestamp = {}
        starting = "latest"
    if timestamps["endingTimestamp"] is not None:
        ending = "latest"

    max_messages = None
    if "maxMessagesPerTrigger" in given:
        max_messages = _positive_int(spelled["maxMessagesPerTrigger"],
                                     given["maxMessagesPerTrigger"])
    max_bytes = None
    if "maxBytesPerTrigger" in given:
        text = given["maxBytesPerTrigger"]
        try:
            max_bytes = parse_size(text)
        except ValueError:
            raise OptionError("maxBytesPerTrigger", f"{text!r} is not a size (accepted: bytes "
                                                    f"or a number with k, m or g, >= 1)") from None
        if max_bytes < 1:
            raise OptionError("maxBytesPerTrigger", f"{text!r} is not >= 1 byte")

    min_messages = None
    if "minMessagesPerTrigger" in given:
        min_messages = _positive_int(spelled["minMessagesPerTrigger"],
                                     given["minMessagesPerTrigger"])
        if max_messages is not None and min_messages > max_messages:
            raise OptionError(spelled["minMessagesPerTrigger"],
                              f"{min_messages} is over {spelled['maxMessagesPerTrigger']} "
                              f"{max_messages}")
    max_delay_ns = DEFAULT_MAX_TRIGGER_DELAY_NS
    if "maxTriggerDelay" in given:
        text = given["maxTriggerDelay"]
        if "minMessagesPerTrigger" not in given:
            raise OptionError("maxTriggerDelay", "bounds the wait for minOffsetsPerTrigger "
                                                 "(minMessagesPerTrigger), which is not set")
        try:
            if text.strip().isdigit():  # a bare number would be nanoseconds
                raise ValueError(text)
            max_delay_ns = parse_duration_ns(text.strip())
        except ValueError:
            raise OptionError("maxTriggerDelay", f"{text!r} is not a duration (accepted: "
                                                 f"e.g. 500ms, 30s, 15m)") from None
        if max_delay_ns <= 0:
            raise OptionError("maxTriggerDelay", f"{text!r} is not > 0")

    headers_text = given.get("includeHeaders", "false").strip().lower()
    if headers_text not in ("true", "false"):
        raise OptionError("includeHeaders",
                          f"{given['includeHeaders']!r} is not accepted (accepted: true, false)")
    fail_text = given.get("failOnDataLoss", "true").strip().lower()
    if fail_text not in ("true", "false"):
        raise OptionError("failOnDataLoss",
                          f"{given['failOnDataLoss']!r} is not accepted (accepted: true, false)")

    offer_timeout_ms = _milliseconds(given, "offerTimeoutMs", DEFAULT_OFFER_TIMEOUT_MS)
    durable_timeout_ms = _milliseconds(given, "durableTimeoutMs", DEFAULT_DURABLE_TIMEOUT_MS)


    min_partitions = None
    if "minPartitions" in given:
        min_partitions = _positive_int("minPartitions", given["minPartitions"])

    holder_address = given.get("holderAddress")
    if holder_address is not None:
        holder_address = holder_address.strip()
        try:
            ipaddress.IPv4Address(holder_address)
        except ValueError:
            raise OptionError("holderAddress", f"{holder_address!r} is not an IPv4 address "
                                               f"(accepted: the address executors reach this "
                                               f"host at, e.g. 10.0.0.1)") from None
    replay_port = HOLDER_PORT
    if "replayPort" in given:
        replay_port = _positive_int("replayPort", given["replayPort"])
        if replay_port > 65535:
            raise OptionError("replayPort", f"{replay_port} is not a UDP port (accepted: "
                                            f"1..65535)")
    replay_timeout_ms = DEFAULT_REPLAY_TIMEOUT_MS
    if "replayTimeoutMs" in given:
        replay_timeout_ms = _positive_int("replayTimeoutMs", given["replayTimeoutMs"])

    holder = None
    if "holder" in given:
        holder = _holder(given["holder"], replay_port)
    archives = _archives(given["archive"]) if "archive" in given else ()
    archive_dir = given.get("archiveDir", "").strip() or None
    if "archiveDir" in given and archive_dir is None:
        raise OptionError("archiveDir", "is empty (accepted: the archive directory on the "
                                        "archives' hosts, a path)")
    if archive_dir is not None and not archives:
        raise OptionError("archiveDir", "names where the archives of the 'archive' option "
                                        "keep their recordings, and 'archive' is not set")
    group = given.get("holderGroup", DEFAULT_GROUP).strip()
    if not group:
        raise OptionError("holderGroup", "is empty (accepted: a name)")

    return SourceOptions(
        stream_id=stream_ids[0] if stream_ids else 0, stream_ids=tuple(stream_ids),
        channel=channel,
        directory=directory.strip() if directory else None,
        starting_position=starting, ending_position=ending,
        starting_timestamp_ns=timestamps["startingTimestamp"],
        ending_timestamp_ns=timestamps["endingTimestamp"],
        starting_timestamps_ns=by_timestamp, timestamp_strategy=strategy,
        max_messages_per_trigger=max_messages,
        max_bytes_per_trigger=max_bytes, min_messages_per_trigger=min_messages,
        max_trigger_delay_ns=max_delay_ns, fail_on_data_loss=fail_text == "true",
        min_partitions=min_partitions,
        offer_timeout_ms=offer_timeout_ms, durable_timeout_ms=durable_timeout_ms,
        holder_address=holder_address,
        replay_port=replay_port, replay_timeout_ms=replay_timeout_ms, holder=holder,
        holder_group=group, archives=archives, archive_dir=archive_dir, call_key=call_key,
        query_name=given.get("queryName", "").strip() or None,
        include_headers=headers_text == "true",
        given=frozenset(given),
        spellings=tuple((name, spelling) for name, spelling in sorted(spelled.items())
                        if name != spelling))


def _same_value(first: str, second: str) -> bool:
    """Whether two values given to one option by its two names say the same (JSON objects
    are compared as objects, words and numbers without case or spaces)."""
    if first.strip().lower() == second.strip().lower():
        return True
    try:
        objects = json.loads(first), json.loads(second)
    except json.JSONDecodeError:
        return False
    return all(isinstance(o, dict) for o in objects) and objects[0] == objects[1]


def _timestamps_by_session(text: str | None, stream_ids: list[int]
                           ) -> dict[tuple[int, int], int]:
    """``startingOffsetsByTimestamp``: Kafka's JSON object of topic to partition to time (ms),
    here stream id to session id to time: ``{"10": {"-1525614849": 1700000000000}}``; as
    (stream id, session id) -> ns."""
    name = "startingOffsetsByTimestamp"
    if text is None:
        return {}
    accepted = ('accepted: a JSON object of stream id to an object of session id to '
                'milliseconds since the epoch, e.g. {"10": {"-1525614849": 1700000000000}}')
    try:
        streams = json.loads(text)
    except ValueError:
        raise OptionError(name, f"{text!r} is not JSON ({accepted})") from None
    if not isinstance(streams, dict) or not streams:
        raise OptionError(name, f"{text!r} is not accepted ({accepted})")
    found: dict[tuple[int, int], int] = {}
    for stream, sessions in streams.items():
        try:
            stream_id = int(stream)
        except ValueError:
            raise OptionError(name, f"{stream!r} is not a stream id ({accepted})") from None
        if stream_id not in stream_ids:
            raise OptionError(name, f"stream {stream_id} is not one this reader reads "
                                    f"(streamId: {describe_stream_ids(stream_ids)})")
        if not isinstance(sessions, dict) or not sessions:
            raise OptionError(name, f"stream {stream}: {sessions!r} is not accepted "
                                    f"({accepted})")
        for session, milliseconds in sessions.items():
            try:
                session_id = int(session)
            except ValueError:
                raise OptionError(name, f"{session!r} is not a session id ({accepted})"
                                  ) from None
            if isinstance(milliseconds, bool) or not isinstance(milliseconds, int) or \
                    not 0 <= milliseconds < _TIMESTAMP_MS_LIMIT or \
                    not INT32_MIN <= session_id <= INT32_MAX:
                raise OptionError(name, f"stream {stream} session {session}: "
                                        f"{milliseconds!r} is not accepted ({accepted})")
            found[(stream_id, session_id)] = milliseconds * 1_000_000
    return found


def _milliseconds(given: dict[str, str], name: str, default: int) -> int:
    """The option ``name`` as milliseconds >= 0 (``default`` when not given); OptionError
    naming it otherwise."""
    if name not in given:
        return default
    text = given[name]
    try:
        value = int(text.strip())
    except ValueError:
        raise OptionError(name, f"{text!r} is not an integer (accepted: milliseconds >= 0)"
                          ) from None
    if value < 0:
        raise OptionError(name, f"{value} is negative (accepted: milliseconds >= 0)")
    return value
