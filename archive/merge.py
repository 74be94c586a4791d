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

**Failing over between archives.**  Given several archives (the first preferred), the merge
goes on from another one when the archive it replays from stops answering: its replay's
image goes, or does not come, or does not move for ``stall_timeout_s``, or its stream ends
before the switch position (the archive stopped it, or the recording it replays ends there:
a recovered recording, a replica piece).  :func:`~slipstream.archive.locate.go_on_from`,
the failed archive asked last, names the recording to go on with, as the archives' one
failover reader (:func:`~slipstream.archive.locate.read_session`) chooses it: one that holds
the position the merge reached, and a replay of it goes on from there: the positions are
the recording's in every archive, so no gap and no duplicate.  Where a message's fragments
lie across two recordings (the first ended between them) the replay goes on from the
message's start in a recording that holds all of it, or the merge fails naming it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Final

from slipstream.archive.catalog import RecordingDescriptor
from slipstream.archive.client import ArchiveClient, ArchiveReplay
from slipstream.archive.locate import go_on_from
from slipstream.client.errors import SlipstreamError
from slipstream.client.image import Image
from slipstream.client.layout import BEGIN_FLAG, FRAME_ALIGNMENT, HDR_TYPE_PAD, HEADER_LENGTH
from slipstream.client.logbuffer import compute_term_id
from slipstream.client.messages import FragmentHandler
from slipstream.client.subscription import Subscription

__all__ = ["MergeState", "ReplayMerge"]

#: Frames the search for the switch position looks at per poll (fragments of one message).
_FRAMES_PER_LOOK: Final = 256
#: Continuations from one recording at one position that may follow each other before the
#: merge gives up (a stall may pass; a segment that is gone does not).
_MAX_REPEATS: Final = 2


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
    archive link).  One thread.

    ``archive`` may be several archives recording the same stream, the first preferred
    (``recording`` is the first one's: its id, asked of the first archive, or its
    descriptor, from any archive's list, which spares that call): the replay fails over
    to the next (see the module), its first one too.  A replay that does not move for
    ``stall_timeout_s`` seconds while its archive has not sent up to the position the
    merge reads to counts as failed (not one waiting, as the live image does, for the
    publisher to send the rest of a message); an archive that does not answer a call
    costs its client's ``timeout_s``."""

    def __init__(self, archive: ArchiveClient | Sequence[ArchiveClient], live: Subscription,
                 recording: int | RecordingDescriptor, start_position: int, *,
                 replay_channel: str | None = None, stall_timeout_s: float = 10.0) -> None:
        self.archives: list[ArchiveClient] = [archive] if isinstance(archive, ArchiveClient) \
            else list(archive)
        if not self.archives:
            raise ValueError("a replay merge needs an archive")
        self.archive = self.archives[0]  # the one replaying now
        self.live = live
        if isinstance(recording, RecordingDescriptor):
            self.descriptor = recording
        else:
            try:
                self.descriptor = self.archive.describe(recording).descriptor
            except SlipstreamError as e:
                raise SlipstreamError(
                    f"replay merge of recording {recording}: the first archive does not "
                    f"describe it ({e}); give the recording's descriptor (any archive's "
                    f"list_recordings) to start from another archive") from e
        self.recording_id = self.descriptor.recording_id  # the first archive's
        self.stall_timeout_s = stall_timeout_s
        self.failovers = 0  # replays continued from another archive or recording
        self._replay_seen = False
        self._replay_since = 0.0
        self._moved_at = 0.0
        self._replay_producer = -1  # the replay image's producer position when last looked
        # The last continuation (archive, recording, position) and how often it came again:
        # a replay that fails where it starts (a segment gone) is not asked for forever.
        self._last_continuation: tuple[object, int, int] | None = None
        self._repeats = 0
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

    @property
    def is_end_of_stream(self) -> bool:
        """Live, and the stream ended there: its publisher closed it and every message was
        delivered (polls give nothing more; a stream that was lost fails instead)."""
        image = self._live_image
        return (self.state is MergeState.LIVE and image is not None and image.is_closed
                and image.ended_with_mark and image.lost_range is None
                and image.final_position is not None and self.position >= image.final_position)

    def poll(self, handler: FragmentHandler, fragment_limit: int = 256) -> int:
        """Deliver the next messages; returns how many (0: none now)."""
        # The merge reads the live image without polling its subscription: an image that
        # went is closed here, or the merge would wait on it for ever.  The driver lets an
        # image go once its subscribers read all it had (or it was left behind).
        self.live.release_gone_images()
        live = self._live_image
        if live is not None and live.is_closed and self.state is not MergeState.FAILED:
            if self.is_end_of_stream:
                return 0
            lost = live.lost_range
            self._fail(f"the live image of session {self.descriptor.session_id} went at "
                       f"{live.position}" + ("" if lost is None else
                                             f", left behind: [{lost[0]}, {lost[1]}) lost"))
        if self.state is MergeState.AWAIT_LIVE:
            self._await_live()
        if self.state is MergeState.CATCHING_UP:
            return self._catch_up(handler)
        if self.state is MergeState.LIVE:
            image = self._live_image
            assert image is not None
            count = image.poll(handler, fragment_limit)
            self.position = image.position
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
        self.state = MergeState.CATCHING_UP
        try:
            self._open_replay(self.archive, self.recording_id)
        except SlipstreamError as e:  # the first archive down: another holds the start
            self._fail_over(f"the first archive refused the replay: {e}", self.position)

    def _open_replay(self, archive: ArchiveClient, recording_id: int) -> None:
        self._replay = archive.replay(recording_id, start=self.position,
                                      channel=self._replay_channel)
        self.archive = archive
        self._replay_seen = False
        self._replay_producer = -1
        self._replay_since = self._moved_at = time.monotonic()

    def _fail_over(self, why: str, reached: int) -> None:
        """The replay failed (``why``) with its frames at ``reached`` (past :attr:`position`
        when its recording ended inside a message): on from :attr:`position` in the
        recording that :func:`go_on_from` names, the failed archive asked last."""
        failed = self.archive
        replay, self._replay = self._replay, None
        if replay is not None:
            replay.close(stop_at_archive=False)  # it may not answer; a replay whose
            # requester went ends at the archive
        order = [a for a in self.archives if a is not failed] + [failed]
        d = self.descriptor
        if reached > self.position and reached % d.term_length == 0:
            # A message never crosses a term: what lies between the last message and a
            # term's end is its padding, not a message cut.
            self.position = reached
        # On from the message at position, in a recording that holds it whole across the
        # seam when the replay's recording ended inside it.
        piece = go_on_from(order, d.stream_id, d.session_id,
                           (d.initial_term_id, d.term_length), self.position,
                           max(reached, self.position))
        if piece is None:
            if reached > self.position:
                self._fail(f"the message at {self.position} lies across two recordings, the "
                           f"first ending at {reached} ({why}); no archive holds it whole")
            self._fail(f"the replay failed at {self.position} ({why}), and no archive holds "
                       f"position {reached} of session {d.session_id}")
        assert piece is not None
        archive = next(a for a in order if a.archive == piece.archive)
        again = (archive.archive, piece.recording_id, self.position)
        self._repeats = self._repeats + 1 if again == self._last_continuation else 0
        self._last_continuation = again
        if self._repeats >= _MAX_REPEATS:
            self._fail(f"the replay of recording {piece.recording_id} at {piece.archive} failed "
                       f"at {self.position} {_MAX_REPEATS + 1} times running ({why})")
        self.failovers += 1
        try:
            self._open_replay(archive, piece.recording_id)
        except SlipstreamError as e:
            self._fail(f"the replay failed at {self.position} ({why}), and its continuation "
                       f"from recording {piece.recording_id} at {piece.archive} was refused: "
                       f"{e}")

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
        limit = self.join_position if switch is None else switch
        # A replay that ends or goes once it is at the limit is not needed (unless S, known
        # later, lies past it: then it is looked at again, and failed over from).
        if replay is not None and self.position < limit:
            image = replay.image()
            now = time.monotonic()
            if image is None or image.is_closed:
                if self._replay_seen:
                    self._fail_over("its image went", self.position)
                elif now - self._replay_since > self.stall_timeout_s:
                    self._fail_over(f"it did not come within {self.stall_timeout_s:g} s",
                                    self.position)
                return 0
            self._replay_seen = True
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
                if delivered:
                    self._moved_at = now
                else:
                    ended = image.end_of_stream_position
                    producer = image.producer_position()
                    if producer != self._replay_producer:  # the archive sends: no stall
                        self._replay_producer = producer
                        self._moved_at = now
                    # Ended, and every frame of it here: nothing more comes of this replay.
                    if ended is not None and producer >= ended:
                        self._fail_over(f"its stream ended at {ended}, before the switch to "
                                        f"live at {limit}", max(ended, self.position))
                    # A replay that sent up to the limit waits, as the live image does, for
                    # the publisher (J inside a message, S not yet there): no stall.
                    elif producer < limit and now - self._moved_at > self.stall_timeout_s:
                        self._fail_over(f"it did not move for {self.stall_timeout_s:g} s",
                                        self.position)
                    return 0
        if switch is None or self.position < switch:
            return delivered
        # The replay delivered [start, S): the live image goes on from S.
        if live.position < switch:
            if live.producer_position() < switch:
                return delivered  # S's frame was seen: the log reaches it; a look again
            live.position = switch
        if replay is not None:
            image = replay.image()
            # Stopped at the archive, unless it ended or its archive went.
            replay.close(stop_at_archive=image is not None and not image.is_closed
                         and image.end_of_stream_position is None
                         and self.archive.is_connected)
            self._replay = None
        self.state = MergeState.LIVE
        return delivered

    def close(self) -> None:
        """Stop the replay if one runs (the live subscription is the caller's)."""
        if self._replay is not None:
            replay, self._replay = self._replay, None
            try:
                replay.close(stop_at_archive=self.archive.is_connected)
            except SlipstreamError:
                pass
