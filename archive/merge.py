"""Replay merge: a subscriber that joins a live stream late catches up from the archive's
replay of its recording, then reads the live image on, with no gap and no duplicate (Aeron
Archive's ``ReplayMerge``).

Aeron merges inside the driver: one multi-destination subscription whose image the replay
and then the live destination both feed.  slipstream merges in the client, over two images
of the same positions, and switches at a position both hold:

* the **live image** (the caller's subscription to the live channel) joins at ``J``; the
  merge never reads it before the switch, so its subscriber position stays at ``J`` and
  holds what the stream sends from ``J`` on in its log (a tethered subscriber's position
  bounds the receiver's window, so nothing past ``J`` + window is taken in, nor lost);
* the **replay** of the recording, from the caller's start position, open-ended, has the
  recording's positions (the archive's replays are positioned), so a position means the
  same message in both;
* the **switch position** ``S`` is the first message boundary at or after ``J`` in the live
  image (``J`` may fall between the fragments of a message the live image cannot assemble:
  then the message's end).  The replay is read up to ``S``, never past it (``Image.peek``
  with ``S`` as the limit), the live image's position is set to ``S``, and the replay is
  stopped.  The replay delivered ``[start, S)``, the live image delivers ``[S, ...)``: each
  message once, in order.

States (:class:`MergeState`), one transition each::

    AWAIT_LIVE  --the live image of the recording's session appeared (J known)-->
                  CATCHING_UP (a replay from the start requested), or LIVE when the start
                  is at or past J (the live image holds it)
    CATCHING_UP --the replay reached S--> LIVE (the replay stopped)
    any         --the replay or the live image ended first--> FAILED (raises)

Loss on either stream is repaired below the merge, by the streams' own NAKs.
"""

from __future__ import annotations

import enum
from typing import Final

from slipstream.archive.client import ArchiveClient, ArchiveReplay
from slipstream.client.errors import SlipstreamError
from slipstream.client.image import Image
from slipstream.client.layout import BEGIN_FLAG, FRAME_ALIGNMENT, HDR_TYPE_PAD, HEADER_LENGTH
from slipstream.client.logbuffer import compute_term_id
from slipstream.client.messages import FragmentHandler
from slipstream.client.subscription import Subscription

__all__ = ["MergeState", "ReplayMerge"]

#: Frames the search for the switch position looks at per poll (fragments of one message).
_FRAMES_PER_LOOK: Final = 256


class MergeState(enum.Enum):
    AWAIT_LIVE = "await live"
    CATCHING_UP = "catching up"
    LIVE = "live"
    FAILED = "failed"


class ReplayMerge:
    """Messages of recording ``recording_id`` from ``start_position`` (a message boundary in
    it), first from the archive's replay, then from ``live``, the caller's subscription to
    the recorded stream's live channel (made before this; not polled by the caller while the
    merge runs).  Read with :meth:`poll` as an image; ``header.position`` is the stream's.
    The replay comes to ``replay_channel`` (default this host's reply endpoint of the
    archive link).  One thread."""

    def __init__(self, archive: ArchiveClient, live: Subscription, recording_id: int,
                 start_position: int, *, replay_channel: str | None = None) -> None:
        self.archive = archive
        self.live = live
        self.recording_id = recording_id
        self.descriptor = archive.describe(recording_id).descriptor
        self.position = start_position
        self.state = MergeState.AWAIT_LIVE
        self.join_position: int | None = None  # J
        self.switch_position: int | None = None  # S
        self._replay_channel = replay_channel
        self._replay: ArchiveReplay | None = None
        self._live_image: Image | None = None

    @property
    def is_live(self) -> bool:
        return self.state is MergeState.LIVE

    def poll(self, handler: FragmentHandler, fragment_limit: int = 256) -> int:
        """Deliver the next messages; returns how many (0: none now)."""
        if self.state is MergeState.AWAIT_LIVE:
            self._await_live()
        if self.state is MergeState.CATCHING_UP:
            return self._catch_up(handler)
        if self.state is MergeState.LIVE:
            image = self._live_image
            assert image is not None
            count = image.poll(handler, fragment_limit)
            self.position = image.position
            if count == 0 and image.is_closed:
                self._fail(f"the live image of session {self.descriptor.session_id} went at "
                           f"{self.position}")
            return count
        return 0

    def _fail(self, why: str) -> None:
        self.state = MergeState.FAILED
        self.close()
        raise SlipstreamError(f"replay merge of recording {self.recording_id}: {why}")

    def _await_live(self) -> None:
        for image in self.live.images:
            if image.session_id == self.descriptor.session_id:
                self._live_image = image
                break
        else:
            return
        image = self._live_image
        self.join_position = image.position
        if self.position >= self.join_position:
            # The live image holds the start: no replay (it must have arrived there first).
            self.switch_position = self.position
            self.state = MergeState.CATCHING_UP
            return
        self._replay = self.archive.replay(self.recording_id, start=self.position,
                                           channel=self._replay_channel)
        self.state = MergeState.CATCHING_UP

    def _find_switch(self) -> int | None:
        """S: the first position at or after J where a message begins in the live image, once
        its frames are there (None until then)."""
        image = self._live_image
        assert image is not None and self.join_position is not None
        position = self.join_position
        bits = image.term_length.bit_length() - 1
        for _ in range(_FRAMES_PER_LOOK):
            length, _, flags, frame_type, _, _, _, term_id = image.frame_header(position)[:8]
            term_offset = position & (image.term_length - 1)
            if length < HEADER_LENGTH or length > image.term_length - term_offset or \
                    term_id != compute_term_id(position, bits, image.initial_term_id):
                return None  # not received yet
            if frame_type != HDR_TYPE_PAD and flags & BEGIN_FLAG:
                return position
            position += (length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT
        return None

    def _catch_up(self, handler: FragmentHandler) -> int:
        if self.switch_position is None:
            self.switch_position = self._find_switch()
        switch = self.switch_position
        live = self._live_image
        assert live is not None and self.join_position is not None
        delivered = 0
        replay = self._replay
        if replay is not None:
            image = replay.image()
            if image is None:
                return 0
            limit = self.join_position if switch is None else switch
            if image.position < limit:
                cap = min(limit, image.position + max(1 << 20, image.term_length))
                counted = [0]

                def deliver(data: memoryview, header: object) -> None:
                    counted[0] += 1
                    handler(data, header)  # type: ignore[arg-type]

                try:
                    after = image.peek(image.position, deliver, cap)
                except SlipstreamError as e:
                    self._fail(f"the replay could not be read at {image.position}: {e}")
                if after > image.position:
                    image.position = after
                self.position = image.position
                delivered = counted[0]
                if delivered == 0 and image.is_end_of_stream:
                    self._fail(f"the replay ended at {image.position}, before the switch to "
                               f"live at {limit}")
        if switch is None or self.position < switch:
            return delivered
        # The replay delivered [start, S): the live image goes on from S.
        if live.position < switch:
            if live.producer_position() < switch:
                return delivered  # S's frame was seen: the log reaches it; a look again
            live.position = switch
        if replay is not None:
            replay.close()  # stops the replay at the archive
            self._replay = None
        self.state = MergeState.LIVE
        return delivered

    def close(self) -> None:
        """Stop the replay if one runs (the live subscription is the caller's)."""
        if self._replay is not None:
            replay, self._replay = self._replay, None
            try:
                replay.close()
            except SlipstreamError:
                pass
