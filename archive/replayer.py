"""Replays: a range of a stream's past published again as a new stream to the channel and
stream id the requester names (Aeron Archive's ``ReplaySession``), from a recording's segment
files (:class:`SegmentSource`) or from the live log of a stream the archive holds
(:class:`LogSource`, :mod:`.holding`).

The replay's publication is exclusive and positioned (:func:`positioned_channel`: the
source's initial term id, term length and MTU, and the term id and offset of the range's
start), so every message has the position it had in the source.  The frames go from the
mapped segment or log into the publication's log a block at a time, as they are
(``ss_append_block``: Aeron's ``offerBlock``; per-frame work in C), as fast as the
publication's limit lets them: flow control paces a replay, the disk, the page cache or the
log in shared memory feeds it.

A replay's states (one place, :data:`_TRANSITIONS`)::

    CONNECTING --the requester's subscription connected--> REPLAYING
    CONNECTING --not within the connect timeout--> FAILED
    REPLAYING  --the range's end, or the stop of a recording followed to it--> DONE
    REPLAYING  --stop_replay, the service stopping--> STOPPED
    REPLAYING  --a segment gone (retention), a live log cleaned past the replay, a frame not
                 the source's, the requester gone for the connect timeout--> FAILED
    CONNECTING --stop_replay, the service stopping--> STOPPED

DONE, STOPPED and FAILED close the publication: the driver drains what it holds to the
requester (a DONE replay's requester sees the stream end at the range's end) and lingers for
repairs.  ``end`` None follows a live recording: the replay goes as far as the recorded
position, waits there for more, and is DONE at the recording's stop.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import Final, Protocol

from slipstream.archive.catalog import RecordingDescriptor
from slipstream.archive.reading import RecordingLostError, Segments
from slipstream.client import Client
from slipstream.client._native import lib
from slipstream.client.errors import DataLossError
from slipstream.client.image import Image
from slipstream.client.logbuffer import LogIdentity, compute_term_id
from slipstream.client.publication import ADMIN_ACTION, CLOSED, ExclusivePublication
from slipstream.client.retention import first_retained, is_retained, message_start

log = logging.getLogger("slipstream.archive")

#: The most one block copy takes (``ss_append_block``), and one turn of the service's loop per
#: replay: a block is published (the sender may send it) before the next is copied, and the
#: other replays and recordings get their turn.
BLOCK_BYTES: Final = 1 << 20
ADVANCE_BYTES: Final = 8 << 20
#: How long a replay waits for its requester's subscription, and for it to come back.
CONNECT_TIMEOUT_S: Final = 10.0
#: The channel keys the archive sets on a replay's channel itself (the requester may not).
POSITIONING_KEYS: Final = ("init-term-id", "term-id", "term-offset", "term-length", "mtu",
                           "sparse")


def positioned_channel(channel: str, log: LogIdentity, position: int) -> str:
    """``channel`` with the URI keys that start a publication at ``position`` of a log
    framed like ``log`` (same initial term id, term length and MTU: the same positions)."""
    bits = log.term_length.bit_length() - 1
    term_id = compute_term_id(position, bits, log.initial_term_id)
    # Sparse: the log is as long as the source's (the positions need its term length), but a
    # replay writes only its range; a dense one would be zeroed whole first.
    joint = "|" if "?" in channel else "?"  # aeron:ipc has no parameters yet
    return (f"{channel}{joint}init-term-id={log.initial_term_id}|term-id={term_id}"
            f"|term-offset={position % log.term_length}|term-length={log.term_length}"
            f"|mtu={log.mtu}|sparse=true")


class ReplayState(enum.Enum):
    CONNECTING = "connecting"
    REPLAYING = "replaying"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"


_TRANSITIONS: Final = {
    ReplayState.CONNECTING: {ReplayState.REPLAYING, ReplayState.FAILED, ReplayState.STOPPED},
    ReplayState.REPLAYING: {ReplayState.DONE, ReplayState.STOPPED, ReplayState.FAILED},
    ReplayState.DONE: set(),
    ReplayState.STOPPED: set(),
    ReplayState.FAILED: set(),
}


class ReplaySource(Protocol):
    """What a replay copies from: frames at the positions of a log framed as ``identity``
    with ``mtu`` (``name`` says which, in words)."""

    name: str
    identity: LogIdentity

    def copy(self, publication: ExclusivePublication, position: int, end: int
             ) -> tuple[int, int]:
        """Copy the frames from ``position`` up to ``end`` (within one term) into
        ``publication`` at the same position, at most :data:`BLOCK_BYTES`:
        :meth:`ExclusivePublication.append_block_from`'s returns.  Raises
        :class:`RecordingLostError` when the source no longer holds ``position``."""
        ...

    def close(self) -> None: ...


class SegmentSource:
    """A recording's segment files (mapped a segment at a time)."""

    def __init__(self, directory: Path, descriptor: RecordingDescriptor) -> None:
        self.name = f"recording {descriptor.recording_id}"
        self.identity = descriptor.identity
        self._segments = Segments(directory, descriptor)

    def copy(self, publication: ExclusivePublication, position: int, end: int
             ) -> tuple[int, int]:
        term_length = self.identity.term_length
        term_base = position - position % term_length
        segment = self._segments.at(position, end)
        return publication.append_block_from_term(segment.term(term_base), term_length,
                                                  position, end, BLOCK_BYTES)

    def close(self) -> None:
        self._segments.close()


class LogSource:
    """The live log of a held stream's session, in this host's shared memory: ``image``, a
    mapping of the log the caller keeps (it is unmapped when the held subscription's image
    goes, under a replay that may still read it).  The log is cleaned behind its slowest
    subscriber; each block is checked after it is copied (a cleaner that passed it meanwhile
    would have torn it)."""

    def __init__(self, image: Image, name: str) -> None:
        self.name = name
        self.image = image
        self.identity = image.identity

    def held(self, start: int, end: int) -> tuple[int, int]:
        """``[first, last)``: what the log holds of ``[start, end)`` now, from the first
        message it holds whole."""
        if is_retained(self.image, start):
            return start, end
        first = first_retained(self.image, start, end)
        return message_start(self.image, first, end), end

    def copy(self, publication: ExclusivePublication, position: int, end: int
             ) -> tuple[int, int]:
        copied, code = publication.append_block_from(self.image.log_buffer, position, end,
                                                     BLOCK_BYTES)
        if copied > 0 or code == 0:  # a frame cleaned meanwhile reads as none
            try:
                self.image.check_retained(position)
            except DataLossError as e:
                raise RecordingLostError(
                    f"{self.name}: the live log no longer holds position {position} (its "
                    f"publisher is at {e.producer_position})",
                    self.held(position, max(end, position))) from None
        return copied, code

    def close(self) -> None:
        pass  # the mapping is the holder's (HeldStreams.do_work lets go of it)


class ReplaySession:
    """One replay of ``[start, end)`` of ``source`` (``end`` None: follow it; a recording's
    only) to ``channel`` / ``stream_id``.  Made by the service for a ``replay`` call;
    :meth:`do_work` moves it, told how far the source reaches.  ``recording_id`` names the
    recording replayed (None for a live log).  Raises the client's errors where the
    publication cannot be made (the call is answered with them)."""

    def __init__(self, replay_id: int, client: Client, source: ReplaySource, start: int,
                 end: int | None, channel: str, stream_id: int, now: float, *,
                 recording_id: int | None = None) -> None:
        self.replay_id = replay_id
        self.recording_id = recording_id
        self.source = source
        self.start = start
        self.end = end
        self.channel = channel
        self.stream_id = stream_id
        self.position = start
        self.state = ReplayState.CONNECTING
        self.reason = ""
        self.publication: ExclusivePublication = client.add_exclusive_publication(
            positioned_channel(channel, source.identity, start), stream_id)
        self.session_id = self.publication.session_id
        self._deadline = now + CONNECT_TIMEOUT_S
        self._disconnected_since: float | None = None

    @property
    def is_over(self) -> bool:
        return not _TRANSITIONS[self.state]

    def _go(self, state: ReplayState, reason: str = "") -> None:
        if state not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"replay {self.replay_id}: {self.state.value} -> {state.value} "
                               f"is not a transition")
        self.state = state
        self.reason = reason
        if self.is_over:
            self.publication.close()
            self.source.close()
            level = logging.WARNING if state is ReplayState.FAILED else logging.INFO
            log.log(level, "replay %d of %s to %s stream %d: %s at position %d%s",
                    self.replay_id, self.source.name, self.channel, self.stream_id,
                    state.value, self.position, f" ({reason})" if reason else "")

    def fail(self, reason: str) -> None:
        """The replay cannot go on (``reason``): FAILED, its publication closed."""
        if not self.is_over:
            self._go(ReplayState.FAILED, reason)

    def stop(self, reason: str = "stopped") -> None:
        """stop_replay, or the service stopping."""
        if not self.is_over:
            self._go(ReplayState.STOPPED, reason)

    def do_work(self, recorded: int, stopped: bool, now: float) -> int:
        """Copy what flow control lets go, up to ``recorded`` (how far the source reaches:
        a recording's recorded position; ``stopped``: it reaches no further); returns the
        bytes copied."""
        if self.is_over:
            return 0
        if self.state is ReplayState.CONNECTING:
            if not self.publication.is_connected:
                if now > self._deadline:
                    self._go(ReplayState.FAILED, f"the requester's subscription at "
                                                 f"{self.channel} stream {self.stream_id} did "
                                                 f"not connect within {CONNECT_TIMEOUT_S:g} s")
                return 0
            self._go(ReplayState.REPLAYING)
        target = recorded if self.end is None else min(self.end, recorded)
        try:
            moved = self._copy(target)
        except RecordingLostError as e:
            self._go(ReplayState.FAILED, f"lost: {e}")
            return 0
        except _FramingError as e:
            self._go(ReplayState.FAILED, str(e))
            return 0
        if self.state is ReplayState.REPLAYING:
            if (self.end is not None and self.position >= self.end) or \
                    (stopped and self.position >= recorded):
                self._go(ReplayState.DONE)
            elif moved == 0 and not self.publication.is_connected:
                if self._disconnected_since is None:
                    self._disconnected_since = now
                elif now - self._disconnected_since > CONNECT_TIMEOUT_S:
                    self._go(ReplayState.FAILED, "the requester went (its subscription "
                                                 "disconnected)")
            else:
                self._disconnected_since = None
        return moved

    def _copy(self, target: int) -> int:
        term_length = self.source.identity.term_length
        publication = self.publication
        moved = 0
        while moved < ADVANCE_BYTES and self.position < target:
            position = self.position
            term_base = position - position % term_length
            block_end = min(target, term_base + term_length)
            copied, code = self.source.copy(publication, position, block_end)
            if copied > 0:
                self.position = code
                moved += copied
                continue
            if code == ADMIN_ACTION:  # the replay's log rotated into the next term
                continue
            if code == 0 or code == lib.SS_INVALID_BATCH:
                raise _FramingError(
                    f"{self.source.name}: no frame a replay copies at position {position} "
                    f"(padding inside a term, or a frame not its place's)"
                    + (": the segment is not as recorded; verify it"
                       if isinstance(self.source, SegmentSource) else "")
                    if code == 0 else
                    f"the replay's log is at {publication.position}, not at the recording's "
                    f"{position}")
            if code == CLOSED:
                self._go(ReplayState.FAILED, "the replay's publication was closed")
            break  # back pressure, or not connected: later
        return moved


class _FramingError(Exception):
    """The segment's frames are not where the recording's positions say."""
