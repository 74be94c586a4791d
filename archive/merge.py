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
* the **replay** of the recording, from the caller's start position up to ``J``, has the
  recording's positions (the archive's replays are positioned), so a position means the
  same message in both;
* the **switch position** ``S`` is the first message boundary at or after ``J`` in the live
  image (``J`` may fall between the fragments of a message the live image cannot assemble:
  then the message's end).  The replay delivers every message that begins before ``J``,
  the one ``J`` cuts whole, and so ends at ``S``; then the live image's position is set to
  ``S``.  The replay delivered ``[start, S)``, the live image delivers ``[S, ...)``: each
  message once, in order.

States (:class:`MergeState`), one transition each::

    AWAIT_LIVE  --the live image of the recording's session appeared (J known)-->
                  CATCHING_UP (a replay from the start requested), or LIVE when the start
                  is at or past J (the live image holds it)
    CATCHING_UP --the replay delivered [start, S) and the live image holds S--> LIVE
    any         --the replay or the live image ended first--> FAILED (raises)

Loss on either stream is repaired below the merge, by the streams' own NAKs.

**Reading the replay.**  The replay part is read by the archives' one failover reader,
:class:`~slipstream.archive.locate.SessionReader` that
:func:`~slipstream.archive.locate.read_session` makes, polled once per :meth:`poll`:
every message of the session that begins in ``[start, J)``, whole.  No message begins in
``[J, S)``, so these are the messages of ``[start, S)``: one that ``J`` cuts is finished.
The reader prefers the recording named, at the first archive, and goes on from another
recording or archive when its replay fails: its image goes, or does not come, or no frame of
it arrives for ``stall_timeout_s``, or its stream ends before ``J`` (the archive stopped it,
or the recording ends there: a recovered recording, a replica piece).  The positions are the
recording's in every archive, so the merge goes on with no gap and no duplicate.  Where a
message's fragments lie across two recordings it is read whole from a recording that holds
it; where none does, the merge fails naming its range.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

from slipstream.archive.catalog import RecordingDescriptor
from slipstream.archive.client import ArchiveClient
from slipstream.archive.locate import SessionReader, read_session
from slipstream.client.errors import SlipstreamError
from slipstream.client.image import Image
from slipstream.client.layout import BEGIN_FLAG, FRAME_ALIGNMENT, HDR_TYPE_PAD, HEADER_LENGTH
from slipstream.client.logbuffer import compute_term_id
from slipstream.client.messages import FragmentHandler, GatheredHeader, GatheredMessages
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
    merge runs).  Read with :meth:`poll` as an image; ``header.position`` is the stream's,
    and a replayed message's header holds its last frame's fields as the stream framed it.
    The replay comes to ``replay_channel`` (default this host's reply endpoint of the
    archive link).  One thread.

    ``archive`` may be several archives recording the same stream, the first preferred
    (``recording`` is the first one's: its id, asked of the first archive, or its
    descriptor, from any archive's list, which spares that call): the replay fails over
    to the next (see the module), its first one too.  A replay from which no frame arrives
    for ``stall_timeout_s`` seconds counts as its archive not answering; an archive that
    does not answer a call costs its client's ``timeout_s``."""

    def __init__(self, archive: ArchiveClient | Sequence[ArchiveClient], live: Subscription,
                 recording: int | RecordingDescriptor, start_position: int, *,
                 replay_channel: str | None = None, stall_timeout_s: float = 10.0) -> None:
        self.archives: list[ArchiveClient] = [archive] if isinstance(archive, ArchiveClient) \
            else list(archive)
        if not self.archives:
            raise ValueError("a replay merge needs an archive")
        #: The archive replaying now (the last one that did, once the replay is over).
        self.archive = self.archives[0]
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
        self.position = start_position
        self.state = MergeState.AWAIT_LIVE
        self.join_position: int | None = None  # J
        self.switch_position: int | None = None  # S
        self._replay_channel = replay_channel
        self._reader: SessionReader | None = None
        # The chunk the reader gave and how many of its messages were handed on.
        self._chunk: GatheredMessages | None = None
        self._handed = 0
        self._header: GatheredHeader | None = None
        self._live_image: Image | None = None

    @property
    def failovers(self) -> int:
        """How many times the replay went on from another recording or archive."""
        return 0 if self._reader is None else self._reader.failovers

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
        """Deliver up to ``fragment_limit`` next messages; returns how many (0: none now).
        Never waits for the replay (a call to an archive, to start or fail over a replay,
        costs up to its client's ``timeout_s``)."""
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
            return self._catch_up(handler, fragment_limit)
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
        image = self.live.image_by_session_id(self.descriptor.session_id)
        if image is None:
            return
        self._live_image = image
        self.join_position = image.position
        self.state = MergeState.CATCHING_UP
        if self.position >= self.join_position:
            # The live image holds the start: no replay (it must have arrived there first).
            self.switch_position = self.position
            return
        d = self.descriptor
        self._header = GatheredHeader(image)
        self._reader = read_session(
            self.archives, d.stream_id, d.session_id, (d.initial_term_id, d.term_length),
            self.position, self.join_position, prefer=(self.archives[0].archive, d.recording_id),
            timeout_s=self.stall_timeout_s, replay_channel=self._replay_channel)

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

    def _replayed(self, handler: FragmentHandler, fragment_limit: int) -> int:
        """Hand on up to ``fragment_limit`` messages the reader read (one poll of it when
        none is left of its last chunk); returns how many."""
        reader = self._reader
        assert reader is not None and self._header is not None
        chunk = self._chunk
        if chunk is None:
            try:
                chunk = reader.poll()
            except SlipstreamError as e:
                self._fail(f"the replay failed at {self.position}: {e}")
            if reader.replaying is not None:
                self.archive = reader.replaying
            if chunk is None:
                return 0
            self._chunk, self._handed = chunk, 0
        data = memoryview(chunk.data)
        offsets = chunk.offsets
        count = min(fragment_limit, len(chunk) - self._handed)
        for _ in range(count):
            index = self._handed
            # Handed on before the handler runs: a message whose handler fails is consumed,
            # as an image's poll does it.
            self._handed += 1
            self.position = chunk.positions[index]
            handler(data[offsets[index]:offsets[index + 1]], self._header.of(chunk, index))
        if self._handed >= len(chunk):
            self._chunk = None
        return count

    def _catch_up(self, handler: FragmentHandler, fragment_limit: int) -> int:
        live = self._live_image
        assert live is not None and self.join_position is not None
        if self.switch_position is None:
            self.switch_position = self._find_switch()
        reader = self._reader
        if reader is not None and (self._chunk is not None or not reader.done):
            # [start, S): every message that begins before J, the last one whole.
            delivered = self._replayed(handler, fragment_limit)
            if delivered or self._chunk is not None or not reader.done:
                return delivered
        switch = self.switch_position
        if switch is None:
            return 0
        # The replay delivered [start, S): the live image goes on from S.
        if live.position < switch:
            if live.producer_position() < switch:
                return 0  # S's frame was seen: the log reaches it; a look again
            live.position = switch
        self.position = max(self.position, switch)
        self.state = MergeState.LIVE
        return 0

    def close(self) -> None:
        """Stop the replay if one runs (the live subscription is the caller's)."""
        if self._reader is not None:
            try:
                self._reader.close()
            except SlipstreamError:
                pass  # the archive ends a replay whose requester went, in time
