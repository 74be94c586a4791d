"""Two archives, no single copy (docs/ARCHIVE.md, "Two archives"): :func:`locate`'s stitching
of the pieces several recordings and archives hold, and an archive that was killed catching
up from its peer (real driver and archive processes, real segment files) until it alone
serves the whole session, every message once, in order, at its position."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import free_port, message, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_archive import (
    archive_process,
    publish,
    recorded_messages,
    size_of,
    wait_for_recording,
)

from slipstream.archive import (
    ArchiveClient,
    EndReason,
    HeldRange,
    RecordingDescriptor,
    RecordingState,
    locate,
    segment_file_name,
    segment_files,
)
from slipstream.archive.locate import read_session, stitch
from slipstream.archive.merge import ReplayMerge
from slipstream.archive.reading import (
    first_message_start,
    first_recorded_message,
    message_end,
    stop_message_start,
)
from slipstream.archive.replication import missing_ranges
from slipstream.client import Client
from slipstream.client.layout import (
    BEGIN_FLAG,
    DATA_HEADER,
    END_FLAG,
    FRAME_ALIGNMENT,
    HDR_TYPE_DATA,
    HDR_TYPE_PAD,
    HEADER_LENGTH,
    align,
)

CONTROL_STREAM = 10
TERM = 64 * 1024

# -- the stitching, against a model ----------------------------------------------------------


def _piece(archive: int, recording: int, start: int, length: int) -> HeldRange:
    return HeldRange(("10.0.0.1", 8000 + archive, 10), recording, start, start + length,
                     True, int(EndReason.STOPPED))


@st.composite
def archives_held(draw) -> list[list[HeldRange]]:
    """Up to 3 archives, each holding up to 4 recordings of one session (overlapping, with
    holes), positions in units of 32 bytes."""
    out = []
    for archive in range(draw(st.integers(1, 3))):
        pieces = []
        for recording in range(draw(st.integers(0, 4))):
            start = draw(st.integers(0, 40)) * 32
            pieces.append(_piece(archive, recording, start, draw(st.integers(1, 20)) * 32))
        out.append(pieces)
    return out


def _holder(held: Sequence[Sequence[HeldRange]], position: int) -> int | None:
    """The model: the first archive that holds ``position``."""
    for index, pieces in enumerate(held):
        if any(p.start <= position < p.end for p in pieces):
            return index
    return None


@settings(max_examples=300, deadline=None)
@given(held=archives_held(), start=st.integers(0, 70), end=st.one_of(st.none(),
                                                                        st.integers(0, 70)))
def test_stitched_pieces_hold_exactly_what_the_first_archive_holding_each_position_holds(
        held: list[list[HeldRange]], start: int, end: int | None) -> None:
    """Every 32-byte unit of [start, end) that some archive holds is in exactly one piece,
    the piece is of the first archive that holds it and of a recording of that archive that
    holds it; pieces are in order, meet exactly or leave a hole nobody holds, and lie in
    [start, end)."""
    start *= 32
    end = None if end is None else end * 32
    pieces = stitch(held, start, end)
    top = max((p.end for ps in held for p in ps), default=0)
    for a, b in itertools.pairwise(pieces):
        assert a.end <= b.start
        assert all(_holder(held, u) is None for u in range(a.end, b.start, 32))
    covered = {}
    for piece in pieces:
        assert piece.start < piece.end and piece.start >= start
        assert end is None or piece.end <= end
        archive = piece.archive[1] - 8000
        recording = next(p for p in held[archive] if p.recording_id == piece.recording_id)
        assert recording.start <= piece.start and piece.end <= recording.end
        for unit in range(piece.start, piece.end, 32):
            covered[unit] = archive
    for unit in range(start, top if end is None else end, 32):
        assert covered.get(unit) == _holder(held, unit), unit


def test_a_piece_of_a_less_preferred_archive_gives_way_where_the_first_holds_again() -> None:
    """Archive 0 holds [0, 100) and [200, 300), archive 1 [0, 300): the middle comes from
    archive 1, cut exactly at 100 and 200; with no end the last piece is archive 0's to its
    recording's end."""
    first = [_piece(0, 0, 0, 100), _piece(0, 1, 200, 100)]
    second = [_piece(1, 7, 0, 300)]
    assert [(p.archive[1], p.recording_id, p.start, p.end)
            for p in stitch([first, second], 0, None)] == [
        (8000, 0, 0, 100), (8001, 7, 100, 200), (8000, 1, 200, 300)]
    # One archive: its own earlier recording, a replica, its own later one, overlapping.
    one = [_piece(0, 0, 0, 96), _piece(0, 1, 64, 96), _piece(0, 2, 160, 64)]
    assert [(p.recording_id, p.start, p.end) for p in stitch([one], 32, 200)] == [
        (0, 32, 96), (1, 96, 160), (2, 160, 200)]


@given(want=st.tuples(st.integers(0, 50), st.integers(0, 50)),
       held=st.lists(st.tuples(st.integers(0, 50), st.one_of(st.none(), st.integers(0, 50))),
                     max_size=5))
def test_missing_ranges_are_exactly_what_no_held_range_covers(
        want: tuple[int, int], held: list[tuple[int, int | None]]) -> None:
    held = [(s, e) for s, e in held if e is None or e > s]
    missing = missing_ranges(want, held)
    units = {u for a, b in missing for u in range(a, b)}
    assert all(a < b for a, b in missing)
    assert all(m[1] < n[0] for m, n in itertools.pairwise(missing))
    for unit in range(*want):
        covered = any(s <= unit and (e is None or unit < e) for s, e in held)
        assert (unit in units) != covered


# -- whole messages at a fetch's seams, over real segment files -----------------------------

SEAM_TERM = 64 * 1024
SEAM_SESSION, SEAM_STREAM, SEAM_TERM_ID = 0x1A2B3C4D, 33, 7


def _seam_recording(directory: Path, messages: list[list[int]]
                    ) -> tuple[RecordingDescriptor, list[int], list[tuple[int, int]]]:
    """A recording from 0 of ``messages`` (each a list of fragment payload lengths), laid
    out as the log lays them out (a message never crosses a term: padding first), in one
    segment of 4 terms; returns its descriptor, every frame's position, and every message's
    ``[begin, end)``."""
    data = bytearray()
    frames: list[int] = []
    spans: list[tuple[int, int]] = []

    def frame(length: int, flags: int, frame_type: int) -> None:
        at = len(data)
        data.extend(DATA_HEADER.pack(length, 0, flags, frame_type, at % SEAM_TERM,
                                     SEAM_SESSION, SEAM_STREAM,
                                     SEAM_TERM_ID + at // SEAM_TERM, 0).ljust(
            align(length, FRAME_ALIGNMENT), b"\x5a"))
        frames.append(at)

    for fragments in messages:
        total = sum(align(HEADER_LENGTH + f, FRAME_ALIGNMENT) for f in fragments)
        room = SEAM_TERM - len(data) % SEAM_TERM
        if total > room:
            if len(data) + room > 4 * SEAM_TERM - SEAM_TERM // 2:
                break
            frame(room, BEGIN_FLAG | END_FLAG, HDR_TYPE_PAD)
        begin = len(data)
        for i, payload in enumerate(fragments):
            flags = (BEGIN_FLAG if i == 0 else 0) | (END_FLAG if i == len(fragments) - 1
                                                    else 0)
            frame(HEADER_LENGTH + payload, flags, HDR_TYPE_DATA)
        spans.append((begin, len(data)))
    (directory / segment_file_name(0, 0)).write_bytes(bytes(data))
    descriptor = RecordingDescriptor(0, RecordingState.VALID, EndReason.STOPPED, 0, len(data),
                                     0, 0, SEAM_TERM_ID, SEAM_TERM, 4 * SEAM_TERM, 1408,
                                     SEAM_SESSION, SEAM_STREAM, "aeron:ipc", "")
    return descriptor, frames, spans


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(st.lists(st.integers(0, 1400), min_size=1, max_size=4),
                         min_size=1, max_size=150),
       cut=st.floats(0, 1))
def test_a_seam_inside_a_message_widens_to_the_whole_message(
        tmp_path: Path, messages: list[list[int]], cut: float) -> None:
    """At any frame boundary p of a recording of fragmented messages (over term ends and
    their padding): the message a stop at p cuts begins where ``stop_message_start`` says (p at a
    message boundary), and the first message that begins at or after p is where
    ``message_end`` says (p when none is recorded yet), the first of its fragments recorded
    being enough; the first data frame from p is p inside a message, else that message's."""
    for old in tmp_path.glob("*.rec"):
        old.unlink()
    descriptor, frames, spans = _seam_recording(tmp_path, messages)
    p = frames[min(int(cut * len(frames)), len(frames) - 1)]
    cut_message = [begin for begin, end in spans if begin < p < end]
    begins_after = [begin for begin, _ in spans if begin >= p]
    stopped_at_p = descriptor.evolve(stop_position=p)
    assert stop_message_start(tmp_path, stopped_at_p, p) == (cut_message[0] if cut_message else p)
    assert message_end(tmp_path, descriptor, p, descriptor.stop_position) == \
        (begins_after[0] if begins_after else p)
    # None, not p, when no message begins there yet: the catch-up then waits (a live
    # recording) rather than end a replica inside the message.
    assert first_message_start(tmp_path, descriptor, p, descriptor.stop_position) == \
        (begins_after[0] if begins_after else None)
    # With the data frames passed over: a fragment at p when p cuts a message, else none
    # before the message that begins (only padding).
    assert first_recorded_message(tmp_path, descriptor, p, descriptor.stop_position) == \
        ((begins_after[0] if begins_after else None),
         p if cut_message else (begins_after[0] if begins_after else None))
    if begins_after:  # recorded up to its first fragment only: it begins there already
        first_fragment = frames.index(begins_after[0])
        recorded = frames[first_fragment + 1] if first_fragment + 1 < len(frames) else \
            descriptor.stop_position
        assert first_message_start(tmp_path, descriptor, p, recorded) == begins_after[0]


# -- reading pieces across recordings, frame by frame ----------------------------------------


def read_pieces(pieces: Sequence[HeldRange], archives: dict[tuple[str, int, int], ArchiveClient],
                timeout: float = 60.0) -> list[tuple[bytes, int]]:
    """Every whole message in the pieces, with the position after it: each piece replayed
    ``[start, end)`` from its archive and read frame by frame (``block_poll``), so that a
    message whose fragments two pieces share is assembled across them."""
    out: list[tuple[bytes, int]] = []
    assembling: bytearray | None = None
    position = pieces[0].start if pieces else 0
    for piece in pieces:
        assert piece.start == position, f"a hole at [{position}, {piece.start})"
        archive = archives[piece.archive]
        with archive.replay(piece.recording_id, start=piece.start, end=piece.end) as replay:
            deadline = time.monotonic() + timeout

            def frames(block: memoryview, at: int) -> None:
                nonlocal assembling, position
                assert at == position
                offset = 0
                while offset < len(block):
                    length, _, flags, frame_type = DATA_HEADER.unpack_from(block, offset)[:4]
                    if frame_type != HDR_TYPE_PAD:
                        payload = bytes(block[offset + HEADER_LENGTH:offset + length])
                        if flags & BEGIN_FLAG:
                            assembling = bytearray()
                        if assembling is not None:
                            assembling += payload
                            if flags & END_FLAG:
                                out.append((bytes(assembling),
                                            at + offset + align(length, FRAME_ALIGNMENT)))
                                assembling = None
                    offset += align(length, FRAME_ALIGNMENT)
                position = at + len(block)

            while position < piece.end:
                image = replay.image()
                if image is None or image.block_poll(frames, 1 << 20) == 0:
                    assert time.monotonic() < deadline, f"the replay of {piece} at {position}"
                    time.sleep(0.001)
    return out


def checksum(messages: Sequence[tuple[bytes, int]]) -> int:
    crc = 0
    for data, _ in messages:
        crc = zlib.crc32(data, crc)
    return crc


def check_whole_messages(replica, archive_dir: Path) -> None:
    """A replica holds whole messages: its first frame begins one (the frames walked from its
    start meet no middle fragment first) and its last message ends at its stop."""
    messages = recorded_messages(replica, archive_dir)  # asserts on a middle fragment first
    assert messages and messages[-1][1] == replica.stop_position, replica


def archive_config(path: Path, archive_dir: Path, driver_dir: Path, port: int,
                   records: Sequence[tuple[str, int, str]], peers: Sequence[str] = (),
                   address: str = "127.0.0.1", reply_address: str = "") -> Path:
    """An archive's settings with a control stream and ``peers`` (two archives: 64k terms
    and 128k segments, a replication look every 300 ms)."""
    lines = [f'dir = "{archive_dir}"', f'driver_dir = "{driver_dir}"',
             'segment_length = "128k"', f'control_address = "{address}"',
             f"control_port = {port}", f"control_stream_id = {CONTROL_STREAM}",
             f"peers = [{', '.join(repr(p).replace(chr(39), chr(34)) for p in peers)}]",
             'replication_interval = "300ms"', 'replication_timeout = "2s"',
             f'replication_address = "{reply_address}"']
    for channel, stream_id, source in records:
        lines += ["[[record]]", f'channel = "{channel}"', f"stream_id = {stream_id}",
                  f'source = "{source}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def peered_archives(tmp_path: Path, driver_dir: Path, b_dir: Path | None = None
                    ) -> tuple[int, int, Path, Path]:
    """Settings of archives A (``tmp_path``/a) and B (``b_dir``, default ``tmp_path``/b),
    both recording IPC stream 20, B catching up from A: their control ports and settings
    files."""
    port_a, port_b = free_port(), free_port()
    records = [("aeron:ipc", 20, "local")]
    config_a = archive_config(tmp_path / "a.toml", tmp_path / "a", driver_dir, port_a, records)
    config_b = archive_config(tmp_path / "b.toml", b_dir or tmp_path / "b", driver_dir, port_b,
                              records, peers=[f"127.0.0.1:{port_a}"])
    return port_a, port_b, config_a, config_b


def whole_at(archive: ArchiveClient, stream_id: int, session_id: int,
             framing: tuple[int, int], start: int, stop: int) -> bool:
    """Whether ``archive`` alone holds [start, stop) of the session, its last piece stopped
    there for good."""
    pieces = locate([archive], stream_id, session_id, framing, start, None)
    return bool(pieces) and pieces[0].start == start and pieces[-1].end == stop and \
        pieces[-1].stopped and all(a.end == b.start for a, b in itertools.pairwise(pieces))


def test_an_archive_killed_mid_stream_catches_up_from_its_peer(driver, tmp_path: Path) -> None:
    """Archives A and B record one IPC stream (64k terms, 128k segments); B is killed (-9) a
    third in and restarted after more than a term was published.  B recovers its recording,
    records the stream again from where it rejoins, and fetches what it missed from A into a
    replica.  Killed again, B misses the session's end: restarted, it fetches the rest up to
    A's stop, the end of stream carried over.  Then B alone holds the whole session (A
    stopped), each message once, in order, at its position, the replicas naming A; and a
    second session published whole while B was down, in one replica."""
    port_a, port_b, config_a, config_b = peered_archives(tmp_path, driver.directory)
    total = 3000
    with Client.connect(driver.directory) as client, \
            archive_process(config_a, tmp_path / "a.log") as process_a:
        b = archive_process(config_b, tmp_path / "b.log")
        process_b = b.__enter__()
        try:
            publication = client.add_publication("aeron:ipc", 20)
            wait_for_recording(tmp_path / "a")
            wait_for_recording(tmp_path / "b")
            positions = publish(publication, total // 3)
            os.kill(process_b.pid, signal.SIGKILL)
            process_b.wait(10)
            b.__exit__(None, None, None)
            before = positions[-1]
            # A second session of the stream, whole while B is down: B fetches all of it.
            other = client.add_exclusive_publication("aeron:ipc", 20)
            other_positions = publish(other, 300, first=total)
            other_identity = (other.session_id, (other.initial_term_id, other.term_length))
            other.close()
            positions += publish(publication, total // 3, first=total // 3)
            assert positions[-1] - before > TERM  # more than a term published while B was down
            b = archive_process(config_b, tmp_path / "b.log")
            process_b = b.__enter__()
            wait_for_recording(tmp_path / "b", index=1)  # B records the stream again
            positions += publish(publication, total // 6, first=len(positions))
            os.kill(process_b.pid, signal.SIGKILL)  # again: the session ends while B is down
            process_b.wait(10)
            b.__exit__(None, None, None)
            positions += publish(publication, total - len(positions), first=len(positions))
            session_id = publication.session_id
            framing = (publication.initial_term_id, publication.term_length)
            publication.close()
            stop = positions[-1]
            wait_for_recording(tmp_path / "a", ended=True)
            b = archive_process(config_b, tmp_path / "b.log")
            process_b = b.__enter__()
            with ArchiveClient(client, "127.0.0.1", port_b, CONTROL_STREAM,
                               timeout_s=5) as archive_b:
                wait_for(lambda: whole_at(archive_b, 20, session_id, framing, 0, stop),
                         timeout=60, what="B holds the whole session")
                other_session, other_framing = other_identity
                wait_for(lambda: whole_at(archive_b, 20, other_session, other_framing, 0,
                                          other_positions[-1]),
                         timeout=30, what="B holds the session it missed whole")
                process_a.send_signal(signal.SIGTERM)
                process_a.wait(20)
                pieces = locate([archive_b], 20, session_id, framing, 0, None)
                listed = {r.recording_id: r.descriptor for r in archive_b.list_recordings()}
                got = read_pieces(pieces, {archive_b.archive: archive_b})
                whole: list[tuple[bytes, int]] = []  # message by message, across the seams
                for chunk in read_session([archive_b], 20, session_id, framing, 0, None):
                    whole += [(bytes(chunk.data[chunk.offsets[i]:chunk.offsets[i + 1]]),
                               chunk.positions[i]) for i in range(len(chunk))]
                other_pieces = locate([archive_b], 20, other_session, other_framing, 0, None)
                got_other = read_pieces(other_pieces, {archive_b.archive: archive_b})
            # The command line, given B and A (stopped): B's pieces, one line per message.
            printed = subprocess.run(
                [sys.executable, "-m", "slipstream.archive.cli", "replay", "0", "--config",
                 str(config_b), "--archive", f"127.0.0.1:{port_a}", "--timeout", "3"],
                capture_output=True, text=True, timeout=120)
        finally:
            b.__exit__(None, None, None)
    want = [(message(seq, size_of(seq)), p) for seq, p in enumerate(positions)]
    assert got == want
    assert whole == want
    assert printed.returncode == 0, printed.stderr
    assert [int(line.split()[0]) for line in printed.stdout.splitlines()[2:]] == positions
    assert checksum(got) == checksum(want)
    # B's first recording, a replica, B's second, a replica up to A's stop (at least).
    assert len(pieces) >= 4, pieces
    assert listed[pieces[-1].recording_id].source_identity.startswith("replica of ")
    replicas = [d for d in listed.values() if d.source_identity.startswith("replica of ")]
    assert replicas and all(f"127.0.0.1:{port_a}/" in d.source_identity for d in replicas)
    for replica in replicas:
        check_whole_messages(replica, tmp_path / "b")
    assert listed[0].end_reason is EndReason.RECOVERED and listed[0].stop_position <= before
    # A healthy peer's fetches all complete (two fetches of one session back to back among
    # them, the same session id to the same endpoint): none was cut short or stalled.
    log_text = (tmp_path / "b.log").read_text()
    assert log_text.count("replication: fetched [") == 3
    assert "replication: the fetch of" not in log_text
    assert listed[pieces[-1].recording_id].end_reason is EndReason.END_OF_STREAM
    # The session B never saw: one replica, whole, its end of stream carried over from A's.
    assert got_other == [(message(total + i, size_of(total + i)), p)
                         for i, p in enumerate(other_positions)]
    assert len(other_pieces) == 1
    assert listed[other_pieces[0].recording_id].source_identity.startswith("replica of ")
    assert other_pieces[0].end_reason == EndReason.END_OF_STREAM



def test_a_range_the_peer_cannot_give_waits_while_the_rest_is_fetched(driver,
                                                                     tmp_path: Path) -> None:
    """A holds two stopped sessions; the first one's segments are gone (A cannot replay
    it).  B, catching up from A, fails on the first session's range, backs off from it
    (once in the first few seconds, not at every 300 ms look), fetches the second session
    whole meanwhile, and adds no empty replica for the fetch that brought nothing."""
    _, port_b, config_a, config_b = peered_archives(tmp_path, driver.directory)
    with Client.connect(driver.directory) as client, \
            archive_process(config_a, tmp_path / "a.log"):
        sessions = []
        for index, first in enumerate((0, 500)):
            publication = client.add_exclusive_publication("aeron:ipc", 20)
            wait_for_recording(tmp_path / "a", index=index)
            positions = publish(publication, 300, first=first)
            sessions.append((publication.session_id,
                             (publication.initial_term_id, publication.term_length),
                             positions[-1]))
            publication.close()
            wait_for_recording(tmp_path / "a", index=index, ended=True)
        for _base, path in segment_files(tmp_path / "a", 0):
            path.unlink()  # A's own recording 0 lost: its replay cannot be served
        with archive_process(config_b, tmp_path / "b.log"), \
                ArchiveClient(client, "127.0.0.1", port_b, CONTROL_STREAM,
                              timeout_s=5) as archive_b:
            good_session, good_framing, good_stop = sessions[1]
            wait_for(lambda: whole_at(archive_b, 20, good_session, good_framing, 0, good_stop),
                     timeout=30, what="B holds the session A can give")
            time.sleep(3)  # more looks: the failed range waits out its back-off (5 s)
            listed = archive_b.list_recordings()
    log_text = (tmp_path / "b.log").read_text()
    failed = log_text.count("replication: the fetch from position 0 of recording 0 at the peer")
    assert 1 <= failed <= 2, log_text
    bad_session = sessions[0][0]
    assert not [r for r in listed if r.descriptor.session_id == bad_session], listed


@pytest.mark.parametrize("made", ["before A died (its id)", "after (A's descriptor)"])
def test_a_replay_merge_starts_from_the_second_archive_when_the_first_is_down(
        driver, tmp_path: Path, made: str) -> None:
    """Archives A and B record one IPC stream; A is killed.  A replay merge given A first
    and B (made with the recording's id while A answered, or after, with A's descriptor of
    it) opens its first replay at B, through locate, and then goes live: every message
    once, in order, at its position."""
    port_a, port_b = free_port(), free_port()
    records = [("aeron:ipc", 20, "local")]
    configs = [archive_config(tmp_path / f"{n}.toml", tmp_path / n, driver.directory, port,
                              records) for n, port in (("a", port_a), ("b", port_b))]
    with Client.connect(driver.directory) as client, \
            archive_process(configs[0], tmp_path / "a.log") as process_a, \
            archive_process(configs[1], tmp_path / "b.log"):
        publication = client.add_publication("aeron:ipc", 20)
        wait_for_recording(tmp_path / "a")
        wait_for_recording(tmp_path / "b")
        positions = publish(publication, 400)
        with ArchiveClient(client, "127.0.0.1", port_a, CONTROL_STREAM,
                           timeout_s=2) as archive_a, \
                ArchiveClient(client, "127.0.0.1", port_b, CONTROL_STREAM,
                              timeout_s=5) as archive_b:
            recording = archive_a.list_recordings(stream_id=20)[0]
            wait_for(lambda: whole_at(archive_b, 20, publication.session_id,
                                      (publication.initial_term_id, publication.term_length),
                                      0, positions[-1]) or
                     archive_b.list_recordings(stream_id=20)[0].recorded_position >=
                     positions[-1], what="B recorded what was published")
            live = client.add_subscription("aeron:ipc", 20)
            if made.startswith("before"):
                merge = ReplayMerge([archive_a, archive_b], live, recording.recording_id, 0)
            os.kill(process_a.pid, signal.SIGKILL)
            process_a.wait(10)
            if made.startswith("after"):
                merge = ReplayMerge([archive_a, archive_b], live, recording.descriptor, 0)
            merged: list[tuple[bytes, int]] = []
            total = 800
            deadline = time.monotonic() + 60
            while len(merged) < total:
                assert time.monotonic() < deadline, (len(merged), merge.state)
                if len(positions) < total:  # offered as the merge lets the stream go on
                    seq = len(positions)
                    result = publication.offer(message(seq, size_of(seq)))
                    if result > 0:
                        positions.append(result)
                if merge.poll(lambda d, h: merged.append((bytes(d), h.position)), 256) == 0:
                    time.sleep(0.001)
            assert merge.is_live and merge.failovers >= 1
            assert merge.archive is archive_b
            merge.close()
    assert merged == [(message(seq, size_of(seq)), p) for seq, p in enumerate(positions)]

pytestmark = pytest.mark.timeout(180)
