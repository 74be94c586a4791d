"""A recording answers a planner's questions as the live log does: :class:`RecordingView`
against :class:`ImageView` on the same frames (a real driver, a real ``slipstream-archive``
recording the stream), and the archive's ``view`` call against the local view
(docs/ARCHIVE.md, "Questions about a recording")."""

from __future__ import annotations

import time
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

import pytest
from helpers import message, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_archive import size_of, wait_for_recording
from test_archive_replay import start_archive

from slipstream.archive.client import ArchiveClient
from slipstream.archive.reading import position_at_time
from slipstream.archive.view import STAMP_SKEW_MS, RecordingView
from slipstream.client import Client
from slipstream.client.holding import CallError
from slipstream.client.logview import ImageView, walk_bound

STREAM = 10
TERM = 64 * 1024
CHANNEL = f"aeron:ipc?term-length={TERM // 1024}k"


def _publish_stamped(publication, subscription, count: int) -> list[tuple[int, int, int]]:
    """Messages ``0 ..`` of test sizes (some fragmented), each stamped with the time it was
    offered (ns); the subscription drains as they go.  (position after, size, stamp) each."""
    sent = []
    seq = 0
    deadline = time.monotonic() + 60
    while seq < count:
        assert time.monotonic() < deadline
        stamp = time.time_ns()
        result = publication.offer(message(seq, size_of(seq)), reserved_value=stamp)
        if result > 0:
            sent.append((result, size_of(seq), stamp))
            seq += 1
        subscription.poll(lambda data, header: None, 256)
    return sent


def same_place(ends: list[int]):
    """A position's place among the messages ending at ``ends``: the end of a term's last
    message and the next term's start are one place (only padding lies between: a read from
    either reads the same messages)."""
    def canonical(position: int) -> int:
        later = [end for end in ends if end > position]
        if later and position % TERM and (later[0] - 1) // TERM > position // TERM:
            return position - position % TERM + TERM
        return position
    return canonical


@contextmanager
def _recording(driver, tmp_path: Path):
    """An archive in ``tmp_path / "archive"`` recording the stream, a client with a
    subscription and a publication of it: (control port, client, subscription, publication)
    once the recording and the image are there."""
    port, process = start_archive(tmp_path, driver.directory, [("aeron:ipc", STREAM)])
    with Client.connect(driver.directory) as client, process:
        subscription = client.add_subscription(CHANNEL, STREAM)
        publication = client.add_publication(CHANNEL, STREAM)
        wait_for_recording(tmp_path / "archive")
        wait_for(lambda: subscription.images, what="the image")
        yield port, client, subscription, publication


@pytest.fixture
def recorded(driver, tmp_path: Path):
    """A stream of about 1.6 terms recorded by an archive, its log still mapped by a
    subscription: (image view, recording view, sent, archive control port)."""
    archive_dir = tmp_path / "archive"
    with _recording(driver, tmp_path) as (port, client, subscription, publication):
        sent = []
        for _ in range(4):  # bursts apart: the time index has entries between them
            sent += _publish_stamped(publication, subscription, 25)
            time.sleep(0.25)
        while len(sent) < 90:
            sent += _publish_stamped(publication, subscription, 90 - len(sent))
        last = sent[-1][0]
        assert last > TERM + TERM // 2, "the stream crosses a term"
        wait_for(lambda: subscription.images[0].position >= last, what="drained")
        # Its log stays mapped after the publication goes (until the subscription releases
        # gone images, which nothing here does).
        image = ImageView(subscription.images[0])
        publication.close()
        descriptor = wait_for_recording(archive_dir, ended=True)
        assert descriptor.stop_position == last
        time.sleep(0.3)  # the cleaner settles behind the subscription that no longer moves
        with RecordingView(archive_dir, descriptor, descriptor.stop_position) as view:
            yield image, view, sent, port, client


def test_a_recording_answers_as_the_live_log_on_the_same_frames(recorded) -> None:
    """Over the range the live log still holds (crossing a term): scan with message and byte
    budgets, count_messages, position_at_time, one walk answer, is_retained and split_points
    give the live log's answers, for ranges and limits drawn by hypothesis."""
    image, view, sent, _, _ = recorded
    ends = [position for position, _, _ in sent]
    earliest = image.earliest_position()
    available = image.available_position()
    assert available == view.available_position() == ends[-1]
    boundaries = [p for p in [0, *ends] if p >= earliest]
    assert boundaries[0] < TERM < boundaries[-1], "the live log's range crosses a term"
    stamps = [stamp for _, _, stamp in sent]
    place = same_place(ends)

    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.data())
    def check(data: st.DataObject) -> None:
        begin = data.draw(st.sampled_from(boundaries))
        stop = data.draw(st.sampled_from([b for b in boundaries if b >= begin]))
        rows = data.draw(st.none() | st.integers(0, 100))
        size = data.draw(st.none() | st.integers(0, 150_000))
        assert place(view.scan(begin, stop, rows, size)) == \
            place(image.scan(begin, stop, rows, size))
        limit = data.draw(st.integers(0, 100))
        assert view.count_messages(begin, stop, limit) == image.count_messages(begin, stop,
                                                                                limit)
        stamp = data.draw(st.sampled_from(stamps)) + data.draw(st.integers(-1, 1))
        assert place(view.position_at_time(begin, stop, stamp)) == \
            place(image.position_at_time(begin, stop, stamp))
        # One walk answer, as the view call gives it: by limits, the same place, messages,
        # bytes and stop; by a time, the same place and stop (a recording's walk may begin
        # later, where its time index puts it, so it counts from elsewhere).
        take_first = data.draw(st.booleans())
        walked, live = (v.walk(begin, stop, rows, size, take_first, None)
                        for v in (view, image))
        assert (place(walked.position), walked.messages, walked.bytes, walked.stop) == \
            (place(live.position), live.messages, live.bytes, live.stop)
        walked, live = (v.walk(begin, stop, None, None, False, stamp) for v in (view, image))
        assert (place(walked.position), walked.stop) == (place(live.position), live.stop)
        assert view.is_retained(begin) and image.is_retained(begin)
        pieces = data.draw(st.integers(1, 12))
        points = view.split_points(begin, stop, pieces)
        assert len(points) <= pieces - 1
        assert points == sorted(set(points))
        assert all(begin < p < stop and (p in ends or p % TERM == 0) for p in points)

    check()


def test_a_split_cuts_a_recorded_range_into_about_equal_pieces_at_message_boundaries(
        recorded) -> None:
    """Four pieces of the whole recording: three boundaries, each within a message's length
    of its equal share (what minPartitions makes of an archived range)."""
    _, view, sent, _, _ = recorded
    ends = [position for position, _, _ in sent]
    stop = ends[-1]
    points = view.split_points(0, stop, 4)
    assert len(points) == 3
    for k, point in enumerate(points, 1):
        assert point in ends or point % TERM == 0
        assert 0 <= k * stop / 4 - point < 2 * 2700  # at or before its target, by a message


def test_a_time_is_found_through_the_time_index_and_the_publishers_stamps(recorded) -> None:
    """Every stamp finds its own message (the first at or after it); a time before the first
    finds the start, after the last the end; the time index puts the search's start at most
    STAMP_SKEW_MS before the time."""
    _, view, sent, _, _ = recorded
    stop = sent[-1][0]
    starts = [0, *[position for position, _, _ in sent[:-1]]]
    place = same_place([position for position, _, _ in sent])
    for (_, _, stamp), start in zip(sent, starts, strict=True):
        assert place(view.position_at_time(0, stop, stamp)) == place(start)
    assert view.position_at_time(0, stop, sent[0][2] - 10**9) == 0
    assert view.position_at_time(0, stop, sent[-1][2] + 1) == stop
    later = sent[-25][2]
    indexed = position_at_time(view.directory, view.descriptor,
                               later // 1_000_000 - STAMP_SKEW_MS)
    assert indexed <= starts[-25]


def test_the_archive_answers_view_calls_as_the_local_view_and_refuses_bad_ones(
        recorded) -> None:
    """The archive's ``view`` call (recording id, method, args) gives the local view's
    answers; a method it does not have, a position past the recording or inside no frame
    alignment, and a recording it does not hold are refused naming the cause."""
    _, view, sent, port, client = recorded
    stop = sent[-1][0]
    with ArchiveClient(client, "127.0.0.1", port, timeout_s=10) as archive:
        remote = archive.recording_view(archive.describe(view.recording_id))
        assert remote.available_position() == stop
        assert remote.earliest_position() == 0
        assert remote.scan(0, stop, 7, None) == view.scan(0, stop, 7, None)
        assert remote.count_messages(0, stop, 1000) == len(sent)
        assert remote.split_points(0, stop, 5) == view.split_points(0, stop, 5)
        assert remote.position_at_time(0, stop, sent[40][2]) == \
            view.position_at_time(0, stop, sent[40][2])
        assert remote.is_retained(sent[3][0]) and not remote.is_retained(sent[3][0] + 32)
        for method, args, why in [
                ("rewind", {}, "method 'rewind' is not one of"),
                ("walk", {"begin": 0, "end": stop + 32, "max_messages": 1,
                          "max_bytes": None, "take_first": True, "time_ns": None},
                 "is not a frame boundary"),
                ("walk", {"begin": 3, "end": stop, "max_messages": 1, "max_bytes": None,
                          "take_first": False, "time_ns": None}, "is not a frame boundary"),
                ("walk", {"begin": 0, "end": stop, "max_messages": None, "max_bytes": None,
                          "take_first": 1, "time_ns": None}, "take_first 1 is not true"),
                ("scan", {"begin": 0, "available": stop, "max_rows": 1, "max_bytes": None},
                 "method 'scan' is not one of"),
                ("split_points", {"begin": 0, "stop": stop, "pieces": 10**6}, "pieces")]:
            with pytest.raises(CallError, match=why):
                archive.view(view.recording_id, method, args)
        with pytest.raises(CallError, match="no recording 99"):
            archive.view(99, "is_retained", {"position": 0})


def _descriptor(start: int, stop: int, start_ms: int, stop_ms: int):
    from slipstream.archive.catalog import EndReason, RecordingDescriptor, RecordingState

    return RecordingDescriptor(7, RecordingState.VALID, EndReason.END_OF_STREAM, start, stop,
                               start_ms, stop_ms, 0, TERM, 4 * TERM, 1408, 1, STREAM,
                               "aeron:ipc", "test")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 40)), min_size=1, max_size=60),
       st.integers(1_000, 3_000), st.booleans())
def test_the_time_index_is_searched_as_its_entries_say(steps, asked: int, corrupt: bool
                                                       ) -> None:
    """Entries in time and position order (as the service writes them): a time finds the
    last entry at or before it, the start before the first, however many there are; an
    entry that goes backwards is passed over, never taken for the time's position."""
    import struct
    import tempfile

    from slipstream.archive.reading import time_index_path

    entries = []
    at_ms, position = 1_001, 0  # after the recording began (1000: its start answers)
    for more_ms, frames in steps:
        at_ms += more_ms
        position += frames * 32
        entries.append((at_ms, position))
    written = list(entries)
    if corrupt and len(entries) > 2:  # a stray entry far back, between two good ones
        written.insert(len(written) // 2, (0, 64 * 1024 * 1024))
    descriptor = _descriptor(0, position, 1_000, -1)
    with tempfile.TemporaryDirectory() as directory:
        time_index_path(Path(directory), 7).write_bytes(
            b"".join(struct.pack("<qq", t, p) for t, p in written))
        found = position_at_time(Path(directory), descriptor, asked)
    expected = max([p for t, p in entries if t <= asked], default=0)
    assert found <= expected if corrupt else found == expected
    assert found in {0, *(p for _, p in entries)}


def test_a_live_recording_is_asked_up_to_its_recorded_position(driver, tmp_path: Path
                                                                ) -> None:
    """While it records: the archive answers up to the recorded position (its counter),
    the last whole message there is what is available, and a question past it is refused
    naming the bound."""
    with _recording(driver, tmp_path) as (port, client, subscription, publication):
        sent = _publish_stamped(publication, subscription, 60)
        last = sent[-1][0]
        with ArchiveClient(client, "127.0.0.1", port, timeout_s=10) as archive:
            wait_for(lambda: archive.recording_position(0) == (last, True),
                     what="recorded to the last message")
            listed = archive.describe(0)
            assert listed.is_active
            remote = archive.recording_view(listed)
            assert remote.available_position() == last
            assert remote.count_messages(0, last, 1000) == 60
            assert remote.scan(0, last, None, None) == last
            assert remote.scan(0, last, 10, None) == sent[9][0]
            with pytest.raises(CallError, match=f"not a frame boundary of this log held "
                                                f"here, \\[0, {last}\\]"):
                archive.view(0, "walk", {"begin": 0, "end": last + 32, "max_messages": 1,
                                         "max_bytes": None, "take_first": True,
                                         "time_ns": None})
        publication.close()


def test_a_question_over_a_long_recording_is_answered_in_bounded_walks(
        driver, tmp_path: Path) -> None:
    """A recording of 10 terms and more, asked for the whole of it (every message counted,
    scanned with no limit, a time after every stamp, and before the first): each answer of
    the archive walks at most ``walk_bound`` bytes (four terms) and says where it stopped,
    and the caller's loop asks again from there until the answer is the whole one, the
    local view's."""
    archive_dir = tmp_path / "archive"
    with _recording(driver, tmp_path) as (port, client, subscription, publication):
        sent = []
        while not sent or sent[-1][0] < 10 * TERM:
            sent += _publish_stamped(publication, subscription, 100)
        publication.close()
        descriptor = wait_for_recording(archive_dir, ended=True)
        stop = descriptor.stop_position
        assert stop == sent[-1][0]
        bound = walk_bound(TERM)
        assert stop > 2 * bound, "the range crosses the bound of one answer twice"
        with ArchiveClient(client, "127.0.0.1", port, timeout_s=10) as archive, \
                RecordingView(archive_dir, descriptor, stop) as local:
            answer = archive.view(0, "walk", {"begin": 0, "end": stop, "max_messages": None,
                                              "max_bytes": None, "take_first": False,
                                              "time_ns": None})
            assert answer["stop"] == "more"
            assert bound - TERM < answer["position"] <= bound
            assert answer["messages"] == sum(1 for p, _, _ in sent if p <= answer["position"])
            remote = archive.recording_view(archive.describe(0))
            asked: list[dict] = []
            ask = remote._ask
            remote._ask = lambda method, **args: asked.append(args) or ask(method, **args)
            assert remote.count_messages(0, stop, 2**62) == len(sent) == \
                local.count_messages(0, stop, 2**62)
            assert len(asked) >= stop // bound + 1
            assert all(b["begin"] - a["begin"] <= bound for a, b in pairwise(asked))
            assert remote.scan(0, stop, None, None) == stop == local.scan(0, stop, None, None)
            assert remote.scan(0, stop, len(sent) - 1, None) == sent[-2][0]
            size = sum(length for _, length, _ in sent[:-3])
            assert remote.scan(0, stop, None, size) == sent[-4][0] == \
                local.scan(0, stop, None, size)
            assert remote.position_at_time(0, stop, sent[-1][2] + 1) == stop
            assert remote.position_at_time(0, stop, sent[-2][2]) == \
                local.position_at_time(0, stop, sent[-2][2])
            assert remote.position_at_time(0, stop, sent[0][2] - 10**9) == 0
