"""The archive's calls from a trio or asyncio task (each test runs under both: tests/loops.py),
against a real archive process with keyed control endpoints (tests/test_archive_calls.py's
``keyed_archive``): every call's ``_async`` form answers as the blocking one does, a keyed
caller is served and another key refused, and a call cancelled while it waits for its answer
ends at once, leaves no worker thread parked, and its answer, when it comes, goes to no later
call."""

from __future__ import annotations

import time

import anyio
import pytest
from helpers import free_port, wait_for
from test_archive_calls import MESSAGES, STREAM, callers, keyed_archive  # noqa: F401

from slipstream.archive.reading import RecordingLostError
from slipstream.client import aio
from slipstream.client.holding import CallError
from slipstream.client.layout import META_READER_WAITERS

pytestmark = pytest.mark.anyio


async def test_every_archive_call_has_an_async_form_served_to_its_key_only(
        keyed_archive) -> None:  # noqa: F811
    recorded = keyed_archive[-1]
    with callers(keyed_archive, "k1", None, timeout_s=20) as (k1, plain):
        assert await k1.await_connected_async(20)
        listed = await k1.list_recordings_async(stream_id=STREAM)
        assert [r.descriptor.channel for r in listed] == [recorded]
        assert await k1.list_all_recordings_async(stream_id=STREAM) == listed
        recording_id = listed[0].recording_id
        assert await k1.describe_async(recording_id) == k1.describe(recording_id)
        stop = listed[0].descriptor.stop_position
        assert await k1.recording_position_async(recording_id) == (stop, False)
        retained = {"position": listed[0].descriptor.start_position}
        assert await k1.view_async(recording_id, "is_retained", retained) is True
        with pytest.raises(RecordingLostError):
            await k1.replay_async(recording_id, start=stop + 4096)
        # A replay to this host's reply endpoint (sealed under k1), read in the task.
        async with await k1.replay_async(recording_id) as replay:
            seen: list[bytes] = []
            await replay.read_all_async(lambda data, _: seen.append(bytes(data)), 30)
            assert len(seen) == MESSAGES and replay.position == stop
        assert replay.subscription.is_closed
        # One left before it is read is stopped at the archive as it closes.
        async with await k1.replay_async(recording_id, end=stop) as unread:
            assert not unread.done
        assert unread.subscription.is_closed
        assert [r for r in await k1._call_async("replays")
                if r["replay_id"] == unread.replay_id] == []
        # A replay to a channel nobody subscribes at waits for its subscriber: it is running
        # until stopped by its id.
        channel = f"aeron:udp?endpoint=127.0.0.1:{free_port()}|key=k1"
        started = await k1.start_replay_async(recording_id, channel, 31)
        assert started.recording_id == recording_id and started.end is None
        assert await k1.stop_replay_async(started.replay_id) is True
        assert await k1.stop_replay_async(started.replay_id) is False  # stopped already
        # The plain endpoint: the k1 recording is not listed, and asking for it is answered
        # as for one that does not exist, as the blocking call is.
        assert await plain.list_recordings_async() == []
        with pytest.raises(CallError, match=f"no recording {recording_id} in"):
            await plain.describe_async(recording_id)
        with pytest.raises(CallError, match=f"no recording {recording_id} in"):
            plain.describe(recording_id)


async def test_a_cancelled_call_ends_at_once_and_its_answer_goes_to_no_later_call(
        keyed_archive, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """A ``describe_async`` cancelled after its call went, while it waits for the answer: the
    task ends at once (the park's slice is far longer), the worker thread leaves the futex,
    the answer arrives and is dropped, and the calls after it get their own answers (a
    ``recording_position`` answered with the describe would raise)."""
    monkeypatch.setattr(aio, "PARK_SLICE_NS", 30_000_000_000)
    with callers(keyed_archive, "k1", timeout_s=20) as [k1]:
        [listed] = await k1.list_recordings_async(stream_id=STREAM)
        recording_id = listed.recording_id
        link = k1._link
        response = link._response
        wait_for(lambda: response.images, what="the answers' image")
        image = response.images[0]
        cancelled = 0
        for _ in range(20):  # the answer may win the race to the cancel: then again
            sent = link.control.position
            answered = image.producer_position()
            result: list[object] = []

            async def describe() -> None:
                result.append(await k1.describe_async(recording_id))  # noqa: B023

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(describe)
                deadline = time.monotonic() + 5
                while link.control.position == sent or \
                        image._log.meta_i32(META_READER_WAITERS) == 0:
                    assert time.monotonic() < deadline, "the call never parked for its answer"
                    if result:
                        break
                    await anyio.sleep(0)
                started = time.monotonic()
                tasks.cancel_scope.cancel()
            if result:
                continue  # answered before the cancel
            cancelled += 1
            assert time.monotonic() - started < 1.0, "the cancelled call did not end at once"
            wait_for(lambda: image._log.meta_i32(META_READER_WAITERS) == 0,
                     timeout=5, what="the worker thread left the futex")
            assert link._awaited is None and not link._calling.locked()
            # Its answer comes: it waits on the response stream for the next call's poll.
            wait_for(lambda: image.producer_position() > answered,  # noqa: B023
                     timeout=10, what="the cancelled call's answer")
            assert await k1.recording_position_async(recording_id) == \
                (listed.descriptor.stop_position, False)
            assert (await k1.describe_async(recording_id)).recording_id == recording_id
            break
        assert cancelled == 1, "every call was answered before it could be cancelled"
