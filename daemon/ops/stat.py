"""``slipstream stat``: the driver's counters as a live table (Aeron's AeronStat and LossStat).

Eight sections, each read from the files the driver maps (it is never asked anything):

* **streams**: one row per stream (its medium: ``aeron:ipc`` or the UDP endpoint; stream id;
  session) with its positions in bytes:
  the publisher limit, sender position and limit (their difference is the flow-control window
  still open), the receiver high-water mark and position (their difference is what is missing
  or not yet rebuilt) and the slowest subscriber;
* **back pressure**: one row per publication with its episodes (docs/BACKPRESSURE.md): how
  many began, the time spent in them, the bytes of its window in use now and at most, and the
  offers ``policy=drop-newest`` dropped;
* **client counters**: the counters clients added (``Client.add_counter``): id, type, value,
  the client that owns it (and its pid), its registration, label and key;
* **driver**: the system counters (bytes, NAKs sent and received, retransmits, status
  messages, heartbeats, short sends, invalid packets, errors, ...) with rates per second;
* **drops by cause**: what the driver received and dropped, by cause (``DROP_CAUSES``: the
  same system counters under the names docs/SECURITY.md explains);
* **loss**: the loss report, per image: gaps seen, bytes lost, first and last time;
* **errors**: the error log, distinct errors with their count and first and last time (also
  shown when the driver has died: the log outlives it until the next driver cleans up);
* **counters**: every counter with its id, type and full label.

``--json`` prints one snapshot as a JSON object with the same content.  The header names the
driver's pid and heartbeat age, what each capacity a user can reach holds (the counters in
use of ``counters_capacity``, the logs' memory of ``log_buffer_memory_limit``, the image bounds:
:func:`~slipstream.client.counters.capacities`) with the setting that bounds it and its value
(``capacity`` in the JSON, by setting: used, limit, unit), and flags a driver that died (its
lock is free) or whose heartbeat is older than the default driver_timeout; when a new driver
takes the directory, the next refresh shows its counters.  ``--match`` filters every section,
the loss report by its label with ``stream=<id> session=<id>`` (as position counters' labels
carry them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Container, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs

from slipstream.client import control
from slipstream.client.channel import Channel, ChannelError, parse_channel
from slipstream.client.client import default_directory
from slipstream.client.control import driver_holds_lock
from slipstream.client.counters import (
    BACK_PRESSURE_TYPES,
    DROP_CAUSES,
    POSITION_TYPES,
    Capacity,
    CounterInfo,
    CountersFile,
    CounterType,
    PositionLabel,
    SystemCounter,
    capacities,
    is_driver_type,
    parse_position_label,
)
from slipstream.client.errors import DriverNotRunningError
from slipstream.daemon.config import DriverSettings
from slipstream.daemon.reports.error_log import PREVIOUS_FILE, ErrorEntry, read_error_log
from slipstream.daemon.reports.loss_report import LossObservation, read_loss_report

# The columns of the streams table, in the order a message passes them.
STREAM_COLUMNS = ("pub-lmt", "pub-pos", "snd-pos", "snd-lmt", "rcv-hwm", "rcv-pos", "sub-pos")


@attrs.define
class StreamRow:
    """The positions of one stream (bytes); ``sub-pos`` is the slowest subscriber's."""

    channel: str
    stream_id: int
    session_id: int
    positions: dict[str, int] = attrs.Factory(dict)
    subscribers: int = 0


@attrs.define
class BackPressureRow:
    """The back-pressure counters of one publication, by kind (``bp-episodes``, ``bp-time``
    in ns, ``bp-depth`` and ``bp-peak`` in bytes, ``pub-drops``)."""

    channel: str
    stream_id: int
    session_id: int
    counters: dict[str, int] = attrs.Factory(dict)


@attrs.define
class ClientCounterRow:
    """A counter a client added: its owner is client ``owner_id`` (process ``owner_pid``,
    None when its heartbeat is not among the counters shown); ``key`` in hex."""

    counter_id: int
    type_id: int
    type_name: str
    value: int
    owner_id: int
    owner_pid: int | None
    registration_id: int
    label: str
    key: str


_HEARTBEAT_PID = re.compile(r"pid=(\d+)")


def client_counter_rows(counters: list[CounterInfo]) -> list[ClientCounterRow]:
    """The counters clients added (a type id not the driver's), with the pid of each owner
    from its heartbeat counter (registered as the client id, labelled ``pid=``)."""
    pids: dict[int, int] = {}
    for info in counters:
        if info.type_id == CounterType.CLIENT_HEARTBEAT:
            match = _HEARTBEAT_PID.search(info.label)
            if match is not None:
                pids[info.registration_id] = int(match[1])
    return [ClientCounterRow(info.counter_id, info.type_id, _type_name(info.type_id), info.value,
                             info.owner_id, pids.get(info.owner_id), info.registration_id,
                             info.label, info.key.hex())
            for info in counters if not is_driver_type(info.type_id)]


def _type_name(type_id: int) -> str:
    try:
        return CounterType(type_id).name.lower()
    except ValueError:
        return str(type_id)


def stream_channel(channel: str) -> str:
    """What of a channel names its stream's medium: ``aeron:ipc``, or a UDP channel's
    endpoint, control address, control mode and interface (canonical).  The rest (a
    publication's term length or flow control, a subscription's alias or tether) does not
    make another stream: the publication's and its subscriptions' counters share one row.  A
    label whose channel does not parse keeps its text."""
    try:
        parsed = parse_channel(channel)
    except ChannelError:
        return channel
    return Channel(parsed.media, endpoint=parsed.endpoint, control=parsed.control,
                   interface=parsed.interface, control_mode=parsed.control_mode).canonical()


def _labelled(counters: list[CounterInfo],
              type_ids: Container[int]) -> Iterator[tuple[CounterInfo, PositionLabel]]:
    """The counters of ``type_ids`` whose labels name a stream, each with its label."""
    for info in counters:
        if info.type_id in type_ids:
            label = parse_position_label(info.label)
            if label is not None:
                yield info, label


def stream_rows(counters: list[CounterInfo]) -> list[StreamRow]:
    """The position counters grouped by stream (channel, stream id, session), in counter order.
    A stream's images from several sources share a row: their receiver positions are the
    lowest of them."""
    rows: dict[tuple[str, int, int], StreamRow] = {}
    for info, label in _labelled(counters, POSITION_TYPES):
        key = (stream_channel(label.channel), label.stream_id, label.session_id)
        row = rows.setdefault(key, StreamRow(*key))
        before = row.positions.get(label.kind)
        row.positions[label.kind] = info.value if before is None else min(before, info.value)
        if label.kind == "sub-pos":
            row.subscribers += 1
    return list(rows.values())


BACK_PRESSURE_COLUMNS = tuple(kind for _, kind in BACK_PRESSURE_TYPES)
_BACK_PRESSURE_TYPE_IDS = frozenset(type_id for type_id, _ in BACK_PRESSURE_TYPES)


def back_pressure_rows(counters: list[CounterInfo]) -> list[BackPressureRow]:
    """The back-pressure counters grouped by publication (channel, stream id, session)."""
    rows: dict[tuple[str, int, int], BackPressureRow] = {}
    for info, label in _labelled(counters, _BACK_PRESSURE_TYPE_IDS):
        key = (label.channel, label.stream_id, label.session_id)
        rows.setdefault(key, BackPressureRow(*key)).counters[label.kind] = info.value
    return list(rows.values())


def _rate(value: int, before: int | None, elapsed_s: float) -> str:
    if before is None or elapsed_s <= 0:
        return ""
    return f"{(value - before) / elapsed_s:,.0f}"


def _time(epoch_ns: int) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(epoch_ns / 1e9))
    return f"{clock}.{epoch_ns // 1_000_000 % 1000:03d}"


Row = TypeVar("Row")


def _table(title: str, header: str, rows: Sequence[Row], line: Callable[[Row], str]) -> list[str]:
    """A section of :func:`render`: its title, then, when it has rows, the column header and
    one line per row."""
    return [title, header, *map(line, rows)] if rows else [title]


def render_errors(errors: list[ErrorEntry], title: str = "errors") -> list[str]:
    """The error log section."""
    lines = [f"{title} ({len(errors)} distinct)"]
    for error in errors:
        lines.append(f"  {error.count:>8,} x  first {_time(error.first_ns)}  last "
                     f"{_time(error.last_ns)}  {error.message}")
    return lines


def render(counters: list[CounterInfo], previous: dict[int, int], elapsed_s: float,
           header: str, now_ns: int | None = None,
           losses: list[LossObservation] | None = None,
           errors: list[ErrorEntry] | None = None,
           previous_errors: list[ErrorEntry] | None = None) -> str:
    """The sections (module docstring).  Rates are per second since ``previous`` (values
    by counter id, ``elapsed_s`` ago); a client heartbeat (a monotonic timestamp) shows as its
    age at ``now_ns`` (default: now)."""
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    lines = [header, ""]

    def stream_line(row: StreamRow) -> str:
        cells = " ".join(f"{row.positions[c]:>15,}" if c in row.positions else f"{'-':>15}"
                         for c in STREAM_COLUMNS)
        return (f"  {row.stream_id:>8} {row.session_id:>11} {cells}  "
                f"{row.subscribers:>4}  {row.channel}")

    rows = stream_rows(counters)
    lines += _table(f"streams ({len(rows)})",
                    f"  {'stream':>8} {'session':>11} "
                    + " ".join(f"{c:>15}" for c in STREAM_COLUMNS) + "  subs  channel",
                    rows, stream_line)

    def back_pressure_line(row: BackPressureRow) -> str:
        values = row.counters
        return (f"  {row.stream_id:>8} {row.session_id:>11} "
                f"{values.get('bp-episodes', 0):>10,} "
                f"{values.get('bp-time', 0) / 1e9:>12.3f} s "
                f"{values.get('bp-depth', 0):>13,} {values.get('bp-peak', 0):>13,} "
                f"{values.get('pub-drops', 0):>12,}  {row.channel}")

    pressured = back_pressure_rows(counters)
    lines += ["", *_table(f"back pressure ({len(pressured)} publications)",
                          f"  {'stream':>8} {'session':>11} {'episodes':>10} "
                          f"{'time in them':>14} {'depth':>13} {'peak':>13} {'dropped':>12}  "
                          f"channel", pressured, back_pressure_line)]

    def client_counter_line(row: ClientCounterRow) -> str:
        owner = f"client {row.owner_id}" + (f" pid {row.owner_pid}"
                                             if row.owner_pid is not None else "")
        key = f"  key={row.key}" if row.key else ""
        return (f"  {row.counter_id:>5} {row.type_name:<20} {row.value:>20,} "
                f"{owner:<26} {row.registration_id:>14}  {row.label}{key}")

    owned = client_counter_rows(counters)
    lines += ["", *_table(f"client counters ({len(owned)})",
                          f"  {'id':>5} {'type':<20} {'value':>20} {'owner':<26} "
                          f"{'registration':>14}  label", owned, client_counter_line)]

    lines += ["", "driver"]
    for info in counters:
        if info.type_id == CounterType.SYSTEM:
            rate = _rate(info.value, previous.get(info.counter_id), elapsed_s)
            lines.append(f"  {info.label:<28} {info.value:>20,} {rate:>14}")

    drops = drop_rows(counters)
    lines += ["", f"drops by cause ({sum(1 for info in drops.values() if info.value)} seen)"]
    for cause, info in drops.items():
        rate = _rate(info.value, previous.get(info.counter_id), elapsed_s)
        lines.append(f"  {cause:<28} {info.value:>20,} {rate:>14}")

    def loss_line(loss: LossObservation) -> str:
        return (f"  {loss.observations:>10,} {loss.bytes_lost:>16,} "
                f"{_time(loss.first_ns):>12} {_time(loss.last_ns):>12} "
                f"{loss.session_id:>11} {loss.stream_id:>8}  {loss.label}")

    losses = losses or []
    lines += ["", *_table(f"loss report ({len(losses)} image(s) with gaps)",
                          f"  {'gaps':>10} {'bytes lost':>16} {'first':>12} {'last':>12} "
                          f"{'session':>11} {'stream':>8}  channel", losses, loss_line)]

    lines += ["", *render_errors(errors or [])]
    if previous_errors:
        lines += ["", *render_errors(previous_errors,
                                     "errors of the driver before this one, which died")]

    lines += ["", "counters",
              f"  {'id':>5} {'type':<20} {'value':>20} {'per second':>14}  label"]
    for info in counters:
        if info.type_id == CounterType.CLIENT_HEARTBEAT:
            value, rate = f"{(now_ns - info.value) // 1_000_000:,} ms ago", ""
        else:
            value = f"{info.value:,}"
            rate = _rate(info.value, previous.get(info.counter_id), elapsed_s)
        lines.append(f"  {info.counter_id:>5} {_type_name(info.type_id):<20} {value:>20} "
                     f"{rate:>14}  {info.label}")
    return "\n".join(lines)


def drop_rows(counters: list[CounterInfo]) -> dict[str, CounterInfo]:
    """The system counters of :data:`DROP_CAUSES`, by cause, in the order of the table."""
    by_id = {info.counter_id: info for info in counters if info.type_id == CounterType.SYSTEM}
    return {cause: by_id[counter.value] for counter, cause in DROP_CAUSES.items()
            if counter.value in by_id}


def capacity_use(capacity: Capacity) -> str:
    """One capacity's use, naming the setting that bounds it and its value."""
    if capacity.unit == "bytes":
        used, limit = f"{capacity.used / 2**20:,.1f} MiB", f"{capacity.limit / 2**20:,g} MiB"
    else:
        used, limit = f"{capacity.used:,}", f"{capacity.limit:,}"
    share = capacity.used / capacity.limit if capacity.limit > 0 else 0.0
    return f"{capacity.setting} {used} of {limit} ({share:.0%})"


def capacities_line(found: Sequence[Capacity]) -> str:
    """The header's line of every capacity's use."""
    return "capacities: " + ", ".join(capacity_use(capacity) for capacity in found)


def snapshot_json(counters: list[CounterInfo], losses: list[LossObservation], *, pid: int,
                  heartbeat_age_s: float,
                  errors: list[ErrorEntry] | None = None,
                  capacity: Sequence[Capacity] = ()) -> dict[str, Any]:
    """One snapshot as plain data (``slipstream stat --json``); ``capacity``: what each
    capacity holds now (:func:`capacities`), by its setting."""
    system = {}
    for info in counters:
        if info.type_id == CounterType.SYSTEM:
            try:
                system[SystemCounter(info.counter_id).name.lower()] = info.value
            except ValueError:
                system[str(info.counter_id)] = info.value
    return {
        "driver_pid": pid,
        "heartbeat_age_s": heartbeat_age_s,
        "capacity": {c.setting: {"used": c.used, "limit": c.limit, "unit": c.unit}
                     for c in capacity},
        "streams": [attrs.asdict(row) for row in stream_rows(counters)],
        "back_pressure": [attrs.asdict(row) for row in back_pressure_rows(counters)],
        "client_counters": [attrs.asdict(row) for row in client_counter_rows(counters)],
        "driver": system,
        "drops": {cause: info.value for cause, info in drop_rows(counters).items()},
        "loss_report": [attrs.asdict(loss) for loss in losses],
        "errors": [attrs.asdict(error) for error in errors or []],
        "counters": [{**attrs.asdict(info), "key": info.key.hex()} for info in counters],
    }


def label_matches(label: str, match: str) -> bool:
    """Whether ``--match`` keeps ``label``: it contains ``match``, where a number at either
    end of ``match`` is whole in the label (``stream=7`` is not ``stream=77``'s)."""
    before = r"(?<!\d)" if match[:1].isdigit() else ""
    after = r"(?!\d)" if match[-1:].isdigit() else ""
    return re.search(before + re.escape(match) + after, label) is not None


def loss_match_label(loss: LossObservation) -> str:
    """What ``--match`` looks in for a loss-report entry: its label (channel and source) with
    ``stream=<id> session=<id>`` added, as the position counters' labels carry them, so that
    ``--match stream=7`` keeps stream 7's entries as it keeps its counters."""
    return f"{loss.label} stream={loss.stream_id} session={loss.session_id}"


#: A driver beats at least four times within its driver_timeout; stat cannot read that
#: setting (the driver does not publish it), so it flags a heartbeat older than the default.
STALE_HEARTBEAT_S = DriverSettings().driver_timeout / 1e9


def _identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``path``, None when it is gone: a new driver in the directory makes
    a new counters file, while the one mapped stays readable after its unlink."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _open_counters(path: Path) -> tuple[CountersFile, tuple[int, int]] | None:
    """The counters file at ``path`` mapped, with its identity; None when it is not there or
    not whole yet (a driver starting)."""
    for _ in range(3):  # a driver replacing it between the stat and the open: look again
        before = _identity(path)
        if before is None:
            return None
        try:
            counters = CountersFile(path, writable=False)
        except (FileNotFoundError, ValueError):
            return None
        if _identity(path) == before:
            return counters, before
        counters.close()
    return None


def _driver_state(path: Path, counters: CountersFile, age_s: float) -> str:
    """What the header adds when the driver shown may be gone: its lock free, or its
    heartbeat older than :data:`STALE_HEARTBEAT_S`."""
    if not driver_holds_lock(path):
        return "  DEAD: no driver holds the lock (it was killed or crashed)"
    if age_s > STALE_HEARTBEAT_S:
        return (f"  STALE: no heartbeat for {age_s:.1f} s, past the default driver_timeout "
                f"of {STALE_HEARTBEAT_S:g} s (stopped, e.g. SIGSTOP, or stuck)")
    return ""


def run_stat(directory: str | None, *, interval: float = 1.0, once: bool = False,
             match: str = "", as_json: bool = False) -> int:
    """Print the counters of the driver in ``directory`` every ``interval`` s (or once; always
    once with ``as_json``).  ``match`` keeps the counters whose label contains it, and the
    loss-report entries whose :func:`loss_match_label` does (:func:`label_matches`).

    Each refresh checks that the driver shown is still the directory's: a driver that died
    (its lock free) or whose heartbeat is older than :data:`STALE_HEARTBEAT_S` is flagged in
    the header, and a new driver's counters file (another inode) is mapped in place of the
    old one, which stays readable after it is deleted.  Raises :class:`DriverError` naming
    the owner when the directory is another user's."""
    path = Path(directory) if directory else default_directory()
    control.check_directory_access(path)  # another user's: say whose, not PermissionError
    counters_path = path / control.COUNTERS_FILE
    # A driver that crashed leaves its counters file (a stop removes it): its last values
    # are what an operator looks into a crash for, shown under the header's DEAD.
    opened = _open_counters(counters_path)
    if opened is None:
        errors = read_error_log(path)
        if not errors:
            raise DriverNotRunningError(str(path), "no counters to show")
        # A driver that died leaves its error log behind: that is what its operator needs.
        if as_json:
            json.dump({"driver_running": False,
                       "errors": [attrs.asdict(error) for error in errors]}, sys.stdout,
                      indent=1)
            sys.stdout.write("\n")
        else:
            print(f"no slipstream driver is running in {path}; the last one's error log:")
            print("\n".join(render_errors(errors)))
        return 1
    counters, identity = opened
    previous: dict[int, int] = {}
    last = time.monotonic()
    interactive = sys.stdout.isatty() and not once and not as_json
    notice = ""
    try:
        while True:
            now = time.monotonic()
            every = list(counters)
            snapshot = [c for c in every if label_matches(c.label, match)]
            losses = [loss for loss in read_loss_report(path)
                      if label_matches(loss_match_label(loss), match)]
            errors = read_error_log(path)
            previous_errors = read_error_log(path, PREVIOUS_FILE)
            age = (time.time_ns() - counters.driver_heartbeat_ns) / 1e9
            running = driver_holds_lock(path)
            found = capacities(counters, every)
            if as_json:
                snapshot_data = snapshot_json(
                    snapshot, losses, pid=counters.driver_pid, heartbeat_age_s=age,
                    errors=errors, capacity=found)
                snapshot_data["previous_errors"] = [attrs.asdict(e) for e in previous_errors]
                snapshot_data["driver_running"] = running
                json.dump(snapshot_data, sys.stdout, indent=1)
                sys.stdout.write("\n")
                return 0 if running else 1
            header = (f"slipstream driver pid {counters.driver_pid} in {path}  "
                      f"heartbeat {age:.1f} s ago  {time.strftime('%H:%M:%S')}"
                      f"{_driver_state(path, counters, age)}\n"
                      f"{capacities_line(found)}")
            if notice:
                header += f"\n{notice}"
                notice = ""
            if match:  # every table below is filtered: say so where a reader looks first
                header += f"\nonly labels containing {match!r} (--match)"
            table = render(snapshot, previous, now - last, header, losses=losses,
                           errors=errors, previous_errors=previous_errors)
            if interactive:
                rows = shutil.get_terminal_size().lines - 1
                table = "\n".join(table.splitlines()[:rows])
                sys.stdout.write("\x1b[H\x1b[2J" + table + "\n")
            else:
                sys.stdout.write(table + "\n\n")
            sys.stdout.flush()
            if once:
                return 0 if running else 1
            previous = {c.counter_id: c.value for c in snapshot}
            last = now
            time.sleep(interval)
            current = _identity(counters_path)
            if current is None and not driver_holds_lock(path):
                print("the driver stopped", file=sys.stderr)
                return 0
            if current is not None and current != identity:
                # A new driver took the directory (the one shown died, or was stopped and
                # a new one started within an interval): show its counters from here.
                reopened = _open_counters(counters_path)
                if reopened is not None:
                    old_pid = counters.driver_pid
                    counters.close()
                    counters, identity = reopened
                    previous = {}  # another driver's values: no rates against them
                    notice = (f"a new driver (pid {counters.driver_pid}) took the directory "
                              f"from pid {old_pid}")
            # Else: the same driver, or a new one not done making its file: look again.
    except KeyboardInterrupt:
        return 0
    finally:
        counters.close()
