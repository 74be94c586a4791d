"""Image: one publication session's log, read in place from shared memory.

An image is what a :class:`~slipstream.client.subscription.Subscription` reads one session
through (for IPC, the shared log of the stream).  ``poll(handler, limit)`` makes one C scan
and one handler call per whole message; fragments are assembled first, so handlers only ever
see whole messages.  The subscriber's position counter advances after each scan, which is what
returns credit to the publishers (the publication limit follows the slowest subscriber).
``controlled_poll(handler, limit)`` reads the same scan, and its handler says per message
whether to consume it (a :class:`ControlledPollAction`: Aeron's controlled poll).  Readers
that are not the subscriber (:meth:`Image.detached`, :meth:`Image.reader_at`) read the same
log at a private position, and ``peek`` re-reads what the log still holds.

The ``data`` view and ``header`` passed to a handler are valid only during the call (as in
Aeron): copy what you keep.  A :class:`MessageBatch` is valid until the next poll.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator, Sequence

from slipstream.client import _fastpath
from slipstream.client._native import ffi, lib
from slipstream.client.errors import (
    ClosedError,
    DataLossError,
    InvalidArgumentError,
    SlipstreamError,
    UsageError,
)
from slipstream.client.layout import (
    BEGIN_FLAG,
    DATA_HEADER,
    END_FLAG,
    FRAME_ALIGNMENT,
    HDR_TYPE_PAD,
    HEADER_LENGTH,
    INT64_MAX,
    PARTITION_COUNT,
    UNFRAGMENTED,
    align,
)
from slipstream.client.logbuffer import (
    LogBuffer,
    OfOneLog,
    compute_term_id,
    index_by_position,
)
from slipstream.client.messages import (
    BlockHandler,
    ControlledFragmentHandler,
    ControlledPollAction,
    FragmentHandler,
    GatheredMessages,
    Header,
    MessageBatch,
)

_dispatch = _fastpath.dispatch
_payload_buffer = _fastpath.payload_buffer
_controlled_dispatch = _fastpath.controlled_dispatch
_ABORT, _BREAK, _COMMIT, _CONTINUE = (ControlledPollAction.ABORT, ControlledPollAction.BREAK,
                                      ControlledPollAction.COMMIT, ControlledPollAction.CONTINUE)
_MAX_SCAN = 4096  # frames per C scan; a poll's fragment limit is split into scans this big


class Image(OfOneLog):
    """One publication session as seen by one subscription."""

    def __init__(self, log: LogBuffer, position_counter, *, join_position: int,
                 correlation_id: int = 0, source_identity: str = "",
                 channel_key: str | None = None, subscription: object = None,
                 doorbell_fd: int = -1) -> None:
        """``position_counter`` is a cffi ``int64_t *``: this subscriber's position counter.
        ``doorbell_fd``: for an image of a network stream, the driver receiver's doorbell
        (rung when the receiver parks and this subscriber reaches the position it waits
        for), for a spy's the sender's; -1 for IPC."""
        self.subscription = subscription
        #: What names the log and frames its positions (a replay framed alike has the same
        #: positions); its fields are this image's attributes too.
        self.identity = log.identity
        #: The image's registration id in its driver (Aeron's ``Image.correlationId``): a
        #: server answers a request image by naming it in its response publication's URI,
        #: ``aeron:udp?control-mode=response|control=HOST:PORT|response-correlation-id=``
        #: this (docs/CHANNELS.md §7.6).
        self.correlation_id = correlation_id
        self.join_position = join_position
        self.source_identity = source_identity
        #: The name of the key the stream is sealed under on the network (``key=``, docs/
        #: CHANNELS.md §7.8; None: plain), as the driver says: for a spy's image, whose URI
        #: names no key, the key of the publication's endpoint.
        self.channel_key = channel_key
        #: Set as the image goes (``on_unavailable_image``) when its receiver was left behind:
        #: the ``(from, to)`` stream positions it lost, because the sender had moved on past
        #: what it could resend.  The stream's next image starts where the sender is.
        self.lost_range: tuple[int, int] | None = None
        #: Set as the image goes (before ``on_unavailable_image``, while its log is surely
        #: mapped): where its log ended (its end-of-stream position, else what its producer
        #: had written), and whether the stream ended there with its end-of-stream mark.
        self.final_position: int | None = None
        self.ended_with_mark = False
        self._log = log
        # The hot paths' (reading an identity field through OfOneLog costs a call).
        self._session_id = log.session_id
        self._term_length = log.term_length
        self._position_bits = log.position_bits
        self._term_mask = log.term_length - 1
        self._position_ptr = position_counter
        self._position = join_position
        self._terms = [log.term_view(i) for i in range(PARTITION_COUNT)]
        self._term_ptrs = [log.term_address(i) for i in range(PARTITION_COUNT)]
        self._starts = ffi.new("int32_t[]", _MAX_SCAN)
        self._ends = ffi.new("int32_t[]", _MAX_SCAN)
        self._starts_view = memoryview(ffi.buffer(self._starts)).cast("B").cast("i")
        self._ends_view = memoryview(ffi.buffer(self._ends)).cast("B").cast("i")
        self._starts_address = int(ffi.cast("uintptr_t", self._starts))
        self._ends_address = int(ffi.cast("uintptr_t", self._ends))
        self._next_offset = ffi.new("int32_t *")
        self._padding_cell = ffi.new("int32_t *")  # block_poll's: a padding frame's rest
        self._header = Header(self)
        self._assembly = bytearray()
        self._assembling = False
        self._assembly_start = 0  # the position of the BEGIN frame of the message assembling
        self._gone = False  # unavailable or its subscription closed: its counter is not ours
        # _gone for a controlled poll's C loop, which reads it before each message.
        self._gone_cell = ffi.new("uint8_t *")
        self._gone_address = int(ffi.cast("uintptr_t", self._gone_cell))
        self._closed = False
        self._ended = False  # is_end_of_stream when it closed
        #: Readers of this log that :meth:`available_position` and :meth:`peek` made and
        #: put back, rewound for the next question (making one costs more than most scans).
        self._spare_readers: list[Image] = []
        self._doorbell_fd = doorbell_fd
        self.signal = log.reader_signal()
        self.waiters = log.reader_waiters()

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def is_end_of_stream(self) -> bool:
        """The publisher is gone and everything it wrote has been consumed (for an image that
        is gone: whether that was so when it went)."""
        if self._closed:
            return self._ended
        return self._position >= self._log.end_of_stream_position

    @property
    def end_of_stream_position(self) -> int | None:
        """Where the publisher ended the stream (its end-of-stream mark), or None while it
        has not (or once the image is gone: see :attr:`final_position`)."""
        if self._closed:
            return None
        eos = self._log.end_of_stream_position
        return eos if eos < INT64_MAX else None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the image is gone: its log is no longer mapped")

    def _describe(self, reader) -> None:  # reader: cffi ss_reader_t
        """Fill in what a parked reader watches for this image."""
        reader.log = self._log.address
        reader.position = self._position_ptr
        reader.signal = self.signal
        reader.waiters = self.waiters
        reader.term_length = self.term_length
        reader.position_bits = self._position_bits

    def _record_end(self) -> None:
        """Note where the log ended (:attr:`final_position`): called as the image goes,
        before it is retired (a reading thread unmaps retired images)."""
        if self._closed:
            return
        eos = self._log.end_of_stream_position
        self.ended_with_mark = eos < INT64_MAX
        self.final_position = eos if self.ended_with_mark else self._log.producer_position()

    def _go(self) -> None:
        """The image is gone (unavailable, or its subscription closed): nothing more is read
        from it, a controlled poll's C loop included."""
        self._gone = True
        self._gone_cell[0] = 1

    def _advance(self, position: int) -> None:
        self._position = position
        if self._gone:
            # Its subscription closed (or the image went) while a handler ran: the counter
            # is no longer this subscriber's, and after the linger no longer mapped.
            return
        if self._doorbell_fd < 0:
            lib.ss_store_release_i64(self._position_ptr, position)
        else:
            lib.ss_advance_position(self._position_ptr, position, self._log.meta,
                                    self._doorbell_fd)

    def _scan(self, scan_end: int, frame_limit: int) -> tuple[int, int, int]:
        """One C scan of the term at this image's position, up to the term offset
        ``scan_end`` and at most ``frame_limit`` frames (and :data:`_MAX_SCAN`): ``(partition
        index, the position's term offset, frames found)``, their bounds in ``_starts`` and
        ``_ends``, the offset after them in ``_next_offset``.  A negative count: a fragment
        is at the position (the cold path reads it)."""
        offset = self._position & self._term_mask
        index = index_by_position(self._position, self._position_bits)
        count = lib.ss_term_read(self._term_ptrs[index], offset, scan_end,
                                 min(frame_limit, _MAX_SCAN), self._starts, self._ends,
                                 self._next_offset)
        return index, offset, count

    def poll(self, handler: FragmentHandler, fragment_limit: int) -> int:
        """Deliver up to ``fragment_limit`` fragments; returns how many messages were handled
        (0 once the image is gone, as for a closed subscription)."""
        if self._closed or self._gone:  # unmapped, or soon: nothing more is read from it
            return 0
        return self._read(handler, fragment_limit, self._term_length)

    def _read(self, handler: FragmentHandler, fragment_limit: int, scan_end: int) -> int:
        """poll(), scanning the current term no further than offset ``scan_end``."""
        if self._assembling:
            # Inside a fragmented message: the cold path, which drops it at padding (a gap an
            # unreliable image gave up on) or at an unfragmented frame.  The C scan skips
            # padding, and the next fragments would join the half-built message.
            count = self._read_fragments(handler, fragment_limit, scan_end)
            if count or self._assembling:
                return count
            # It was dropped at an unfragmented frame: read on at once.
        position = self._position
        # _scan's steps (and index_by_position's arithmetic), written out: this is every
        # poll's path, where the calls cost a one-message poll about 8 % (about 110 ns).
        index = (position >> self._position_bits) % PARTITION_COUNT
        offset = position & self._term_mask
        count = lib.ss_term_read(self._term_ptrs[index], offset, scan_end,
                                 min(fragment_limit, _MAX_SCAN), self._starts, self._ends,
                                 self._next_offset)
        if count < 0:  # a fragment at the position
            return self._read_fragments(handler, fragment_limit, scan_end)
        next_offset = self._next_offset[0]
        if next_offset == offset:
            return 0
        if count:
            term = self._terms[index]
            header = self._header
            header._term = term
            header._term_base = position - offset
            try:
                # The hot loop, in C: one slice and one handler call per message.
                _dispatch(handler, header, term, self._starts_address, self._ends_address, count)
            except BaseException:
                # The failing message counts as consumed, as in Aeron: never redeliver forever.
                failed = self._starts[_fastpath.failed_index()] - HEADER_LENGTH
                length = DATA_HEADER.unpack_from(term, failed)[0]
                self._advance(position - offset + failed + align(length, FRAME_ALIGNMENT))
                raise
        self._advance(position + next_offset - offset)
        return count

    def _read_fragments(self, handler: FragmentHandler, fragment_limit: int,
                        scan_end: int, message_limit: int = 1 << 62) -> int:
        """The cold path: frames of fragmented messages, assembled into whole messages; stops
        after ``fragment_limit`` frames or ``message_limit`` messages delivered."""
        delivered = 0
        header = self._header
        # scan_end is an offset in the term being read: never past it, nor into the next term
        # (as the C scan; peek's limits are cut per term).
        limit = self._position - (self._position & self._term_mask) + scan_end
        for _ in range(fragment_limit):
            if self._gone:  # closed by a handler (or another thread): read no further
                break
            frame = self._cold_frame(limit, scan_end)
            if frame is None:
                break
            term, offset, frame_length, flags, frame_type = frame
            position = self._position
            self._advance(position + ((frame_length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT))
            if frame_type == HDR_TYPE_PAD:
                continue
            if flags & BEGIN_FLAG:
                self._assembly_start = position
            header._term = term
            header._term_base = position - offset
            header._payload = offset + HEADER_LENGTH
            if self._assemble(term[offset + HEADER_LENGTH:offset + frame_length], flags,
                              header, handler):
                delivered += 1
                if delivered >= message_limit:
                    break
        return delivered

    def _cold_frame(self, limit: int, scan_end: int
                    ) -> tuple[memoryview, int, int, int, int] | None:
        """The frame at this image's position for a cold path, as ``(term, offset,
        frame_length, flags, frame_type)``; None where the cold path stops: nothing committed
        there, the position at ``limit`` (a stream position), an unfragmented message (back to
        the fast path), not a frame, or a frame past ``scan_end`` (an offset in the term, as
        the C scan: never past the term).  A message being assembled whose remaining fragments
        are gone (padding or an unfragmented frame where they would be) is dropped first."""
        position = self._position
        index = index_by_position(position, self._position_bits)
        offset = position & self._term_mask
        if position >= limit or self._log.frame_length_volatile(index, offset) <= 0:
            return None
        term = self._terms[index]
        frame_length, _, flags, frame_type = DATA_HEADER.unpack_from(term, offset)[:4]
        if self._assembling and (frame_type == HDR_TYPE_PAD or flags == UNFRAGMENTED):
            # The message being assembled was abandoned (its publisher died between
            # fragments: the rest became padding, or others' messages follow).
            self._assembling = False
            self._assembly = bytearray()
        if frame_type != HDR_TYPE_PAD and flags == UNFRAGMENTED:
            return None
        if frame_length < HEADER_LENGTH or frame_length > scan_end - offset:
            return None
        return term, offset, frame_length, flags, frame_type

    def _assemble(self, payload: memoryview, flags: int, header: Header,
                  handler: FragmentHandler) -> bool:
        if flags & BEGIN_FLAG:
            self._assembly = bytearray(payload)
            self._assembling = True
        elif self._assembling:
            self._assembly += payload
        else:
            return False  # a middle fragment after a join: drop until the next BEGIN
        if flags & END_FLAG:
            self._assembling = False
            message = memoryview(self._assembly)
            try:
                handler(message, header)
            finally:
                message.release()
            return True
        return False

    def block_poll(self, handler: BlockHandler, block_length_limit: int) -> int:
        """Hand ``handler`` the next block of whole committed frames as the log holds them
        (Aeron's ``Image.blockPoll``): contiguous frames from this image's position within one
        term, headers and alignment included, at most ``block_length_limit`` bytes (but at
        least one frame when one is there); a padding frame goes whole, alone, at a term's
        end.  ``handler(block, position)`` gets a view of the log (valid only during the
        call: copy or write it out) and the stream position of its first byte.  The position
        moves past the block after the handler returns; if it raises, it does not move.
        Returns the block's length in bytes (0 when nothing is there, or the image is gone).
        For recorders of the stream as it is framed (the archive); messages are not assembled,
        so do not mix it with the message polls on one image."""
        if self._closed or self._gone:
            return 0
        if block_length_limit < FRAME_ALIGNMENT:
            raise InvalidArgumentError("block_length_limit",
                                       f"{block_length_limit} is less than a frame's alignment "
                                       f"({FRAME_ALIGNMENT} bytes)")
        position = self._position
        index = (position >> self._position_bits) % PARTITION_COUNT
        offset = position & self._term_mask
        # The sender's scan: whole aligned frames; a padding frame at the position comes back
        # as its header, with the rest of its length in the padding cell.
        length = lib.ss_scan_for_availability(self._term_ptrs[index], offset,
                                              block_length_limit, self._term_length,
                                              self._padding_cell)
        length += self._padding_cell[0]
        if length <= 0:
            return 0
        handler(self._terms[index][offset:offset + length], position)
        self._advance(position + length)
        return length

    def controlled_poll(self, handler: ControlledFragmentHandler, fragment_limit: int) -> int:
        """Aeron's ``Image.controlledPoll``: deliver up to ``fragment_limit`` fragments as
        whole messages, as :meth:`poll` does, and act on what ``handler(data, header)``
        returns for each (a :class:`ControlledPollAction`):

        * ``ABORT``: the message is not consumed and the poll stops; the next poll (controlled
          or not) delivers it again, whole;
        * ``BREAK``: consumed, and the poll stops;
        * ``COMMIT``: consumed, and the subscriber position (what the publishers' flow
          control sees) moves past it before the next message is handed over;
        * ``CONTINUE``: consumed; the position moves past it at the latest at the end of the
          poll (a fragmented message's frames move it as they are read).

        Returns how many messages were consumed (an aborted one is not); 0 once the image is
        gone.  A handler that closes the subscription (or an image that goes while a handler
        runs) ends the read: no further message is handed over.  A handler that raises, or
        returns anything but an action (:class:`UsageError`, raised after the message), has
        consumed its message, as in :meth:`poll`.
        """
        if self._closed or self._gone:
            return 0
        if self._assembling:
            # Inside a fragmented message (an aborted one, or one a poll began): the cold path.
            count, stopped = self._controlled_fragments(handler, fragment_limit)
            if count or stopped or self._assembling:
                return count
        position = self._position
        index, offset, count = self._scan(self._term_length, fragment_limit)
        if count < 0:  # a fragment at the position
            return self._controlled_fragments(handler, fragment_limit)[0]
        next_offset = self._next_offset[0]
        if next_offset == offset:
            return 0
        term_base = position - offset
        first = 0
        while first < count:
            term = self._terms[index]
            header = self._header
            header._term = term
            header._term_base = term_base
            try:
                # The loop in C: one slice and one handler call per message, until a handler
                # returns something other than CONTINUE or the image is gone.
                stop, action = _controlled_dispatch(handler, header, term, self._starts_address,
                                                    self._ends_address, first, count, _CONTINUE,
                                                    self._gone_address)
            except BaseException:
                # The failing message counts as consumed, as in poll (and Aeron).
                self._advance(term_base + align(self._ends[_fastpath.failed_index()],
                                                FRAME_ALIGNMENT))
                raise
            if action is _CONTINUE:  # every message up to `stop` went on
                if stop == count:
                    break
                # The image is gone (a handler closed the subscription) before message
                # `stop`: those before it were consumed, and nothing more is read.
                if stop > first:
                    self._advance(term_base + align(self._ends[stop - 1], FRAME_ALIGNMENT))
                return stop
            if action is _ABORT:
                frame = term_base + self._starts[stop] - HEADER_LENGTH
                if frame != self._position:  # what came before it was consumed
                    self._advance(frame)
                return stop
            self._advance(term_base + align(self._ends[stop], FRAME_ALIGNMENT))
            if action is _BREAK:
                return stop + 1
            if action is not _COMMIT:
                raise _not_an_action(action)
            first = stop + 1  # COMMIT: the position moved; on with the next message
        self._advance(position + next_offset - offset)  # with the padding after the last
        return count

    def _controlled_fragments(self, handler: ControlledFragmentHandler,
                              fragment_limit: int) -> tuple[int, bool]:
        """controlled_poll's cold path: frames of fragmented messages, as Aeron's
        ``ControlledFragmentAssembler`` takes them.  The fragments before a message's last
        are consumed into the assembly; the handler's action applies to the last, so an
        ABORT leaves the position on it and keeps what was assembled before it, and the next
        read delivers the whole message again.  Returns the messages consumed, and whether a
        BREAK or ABORT stopped the read; stops after ``fragment_limit`` frames."""
        delivered = 0
        header = self._header
        limit = self._position - (self._position & self._term_mask) + self._term_length
        for _ in range(fragment_limit):
            if self._gone:  # closed by a handler (or another thread): read no further
                break
            frame = self._cold_frame(limit, self._term_length)
            if frame is None:
                break
            term, offset, frame_length, flags, frame_type = frame
            position = self._position
            end = position + ((frame_length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
            payload = term[offset + HEADER_LENGTH:offset + frame_length]
            if frame_type == HDR_TYPE_PAD or not flags & END_FLAG or not self._assembling:
                if frame_type != HDR_TYPE_PAD and flags & BEGIN_FLAG:
                    self._assembly_start = position
                    self._assembly = bytearray(payload)
                    self._assembling = True
                elif frame_type != HDR_TYPE_PAD and self._assembling:
                    self._assembly += payload
                # else: padding, or a fragment after a join: dropped until the next BEGIN
                self._advance(end)
                continue
            kept = len(self._assembly)
            self._assembly += payload
            self._assembling = False
            header._term = term
            header._term_base = position - offset
            header._payload = offset + HEADER_LENGTH
            message = memoryview(self._assembly)
            try:
                action = handler(message, header)
            except BaseException:
                self._assembly = bytearray()
                self._advance(end)  # consumed, as in poll
                raise
            finally:
                message.release()
            if action is _ABORT:
                # A copy, not a cut in place: a view the handler kept would forbid the resize.
                self._assembly = self._assembly[:kept]
                self._assembling = True
                return delivered, True
            self._assembly = bytearray()
            self._advance(end)
            if action is _BREAK:
                return delivered + 1, True
            if action is not _COMMIT and action is not _CONTINUE:
                raise _not_an_action(action)
            delivered += 1
        return delivered, False

    def poll_batch(self, max_messages: int) -> MessageBatch | None:
        """Up to ``max_messages`` whole messages in place, or None when nothing is there (or
        the image is gone)."""
        if self._closed or self._gone:
            return None
        if self._assembling:  # as in _read: the cold path drops a message that lost a part
            batch = self._assemble_batch()
            if batch is not None or self._assembling:
                return batch
        position = self._position
        # _scan's steps, written out, as in _read: every batch poll's path.
        index = (position >> self._position_bits) % PARTITION_COUNT
        offset = position & self._term_mask
        count = lib.ss_term_read(self._term_ptrs[index], offset, self._term_length,
                                 min(max_messages, _MAX_SCAN), self._starts, self._ends,
                                 self._next_offset)
        if count < 0:  # a fragment at the position
            return self._assemble_batch()
        next_offset = self._next_offset[0]
        if next_offset != offset:
            self._advance(position + next_offset - offset)
        if count:
            return MessageBatch(self._terms[index], self._starts_view[:count],
                                self._ends_view[:count], self._session_id, self._position)
        return None

    def poll_gathered(self, max_messages: int, limit_position: int | None = None
                      ) -> GatheredMessages | None:
        """Up to ``max_messages`` whole messages from this image's position, none past
        ``limit_position`` (a message boundary, or None), copied out of the log in one C pass
        (:class:`GatheredMessages`); moves the position past them.  None when nothing is
        there (or the image is gone).  A fragmented message comes assembled, alone."""
        if self._closed or self._gone:
            return None
        position = self._position
        if limit_position is not None and position >= limit_position:
            return None
        offset = position & self._term_mask
        scan_end = self._term_length if limit_position is None else \
            min(self._term_length, offset + limit_position - position)
        if self._assembling:
            return self._gather_fragmented(scan_end)
        index, offset, count = self._scan(scan_end, max_messages)
        if count < 0:  # a fragment at the position
            return self._gather_fragmented(scan_end)
        next_offset = self._next_offset[0]
        if count == 0:
            if next_offset == offset:
                return None
            self._advance(position + next_offset - offset)  # padding: on into the next term
            return self.poll_gathered(max_messages, limit_position)
        gathered = gather_scanned(self._term_ptrs[index], self._term_length, position - offset,
                                  self._starts, self._ends, count, self._session_id)
        if gathered is None:
            raise SlipstreamError(f"image {self._session_id}: a scan of the log gave frame "
                                  f"bounds outside its term")
        self._advance(position + next_offset - offset)
        return gathered

    def _gather_fragmented(self, scan_end: int) -> GatheredMessages | None:
        """poll_gathered's cold path: one fragmented message, assembled."""
        got: list[tuple[bytes, int, int]] = []
        self._read_fragments(
            lambda data, header: got.append((bytes(data), header.position,
                                             header.reserved_value)),
            1 << 30, scan_end, message_limit=1)
        if not got:
            return None
        return GatheredMessages.one(*got[0], self._session_id)

    def _assemble_batch(self) -> MessageBatch | None:
        """The next message is fragmented: assemble it (if complete) as a batch of one."""
        collected: list[bytes] = []
        self._read_fragments(lambda data, header: collected.append(bytes(data)), 1 << 30,
                             self._term_length, message_limit=1)
        if not collected:
            return None
        message = collected[0]
        bounds = memoryview(array("i", [0, len(message)]))
        return MessageBatch(memoryview(message), bounds[:1], bounds[1:], self._session_id,
                            self._position)

    # -- reading without consuming (credit held until commit) ---------------------------------
    @classmethod
    def detached(cls, log_path: str, position: int, channel_key: str | None = None) -> Image:
        """An image of the log at ``log_path`` with a private position, for readers that are not
        the subscriber (e.g. Spark executors reading a range the subscriber will commit).  Its
        mapping is the caller's: :meth:`close` it when done.  ``channel_key``: the key of the
        stream the log is of (:attr:`channel_key`: the subscriber's image's)."""
        # Not populated: a short-lived reader touches only the range it reads.
        log = LogBuffer(log_path, populate=False)
        return cls(log, ffi.new("int64_t *", position), join_position=position,
                   channel_key=channel_key)

    def reader_at(self, position: int) -> Image:
        """Another reader of this image's log, with a private position starting at
        ``position`` (a message boundary): it moves no subscriber position and returns no
        credit.  It borrows this image's mapping: it is usable while this image is, and
        closing it lets go of the mapping without unmapping it."""
        return Image(self._log.borrowed(), ffi.new("int64_t *", position),
                     join_position=position)

    @contextlib.contextmanager
    def _probe(self, position: int) -> Iterator[Image]:
        """A :meth:`reader_at` ``position`` for one question of this image's, put back after
        it for the next (the list pop and append are atomic: another thread asking at once
        gets a reader of its own)."""
        try:
            probe = self._spare_readers.pop()
        except IndexError:
            probe = self.reader_at(position)
        else:
            probe._rewind(position)
        try:
            yield probe
        except BaseException:  # a handler's exception: its traceback may hold the views
            probe.close()
            raise
        if self._closed:
            probe.close()
            return
        self._spare_readers.append(probe)
        if self._closed:  # closed meanwhile: its close() may have emptied the list before
            with contextlib.suppress(ValueError):  # ValueError: close() took it
                self._spare_readers.remove(probe)
                probe.close()

    def _rewind(self, position: int) -> None:
        """Start this private reader (:meth:`reader_at`'s) over at ``position``, a message
        boundary, as if made there."""
        self._position = position
        self._position_ptr[0] = position
        self.join_position = position
        self._assembling = False
        self._assembly = bytearray()
        self._assembly_start = 0

    @property
    def log_path(self) -> str:
        """The log file, for :meth:`detached` readers in other processes."""
        return str(self._log.path)

    @property
    def log_buffer(self) -> LogBuffer:
        """The mapped log this image reads (its terms, metadata and position arithmetic), for
        readers of the log as it is (retention, replay); valid until the image is closed."""
        return self._log

    def producer_position(self) -> int:
        """The position the log's producer (the publisher, or the receiver rebuilding it)
        reached: nothing past it is written yet.  Raises :class:`ClosedError` once the image
        is gone."""
        self._check_open()
        return self._log.producer_position()

    @property
    def at_message_boundary(self) -> bool:
        """Whether this reader's position is a message boundary: not inside a fragmented
        message whose first fragments it read."""
        return not self._assembling

    def frame_header(self, position: int) -> tuple[int, ...]:
        """The header fields of the frame at ``position`` as the log holds them now
        (:data:`~slipstream.client.layout.DATA_HEADER`'s: frame length, version, flags,
        type, term offset, session id, stream id, term id, reserved value).  Another process
        writes them: check them before stepping by a length.  Raises :class:`ClosedError`
        once the image is gone."""
        self._check_open()
        return self._log.frame_header(index_by_position(position, self._position_bits),
                                      position & self._term_mask)

    def available_position(self) -> int:
        """How far committed frames reach from this reader's position (not consuming them):
        the position after the last whole message that is ready.  Raises
        :class:`ClosedError` once the image is gone."""
        self._check_open()
        with self._probe(self._position) as probe:
            boundary = probe._position
            while True:
                before = probe._position
                probe.poll_batch(_MAX_SCAN)
                if probe.at_message_boundary:  # mid-message positions are not boundaries
                    boundary = probe._position
                if probe._position == before:
                    return boundary

    def peek(self, position: int, handler: FragmentHandler, limit_position: int) -> int:
        """Deliver the whole messages in [position, limit_position) without moving this
        subscriber's position; returns the position after the last one delivered.

        Both positions must be message boundaries (from :meth:`available_position` or an
        earlier peek).  ``position`` may lie behind this subscriber (data it already consumed)
        as long as the log still holds it; :class:`DataLossError` says when it does not, and
        :class:`ClosedError` when the image is gone.
        """
        self._check_open()
        self.check_retained(position)
        with self._probe(position) as reader:
            while reader._position < limit_position:
                offset = reader._position & self._term_mask
                scan_end = min(self._term_length, offset + limit_position - reader._position)
                before = reader._position
                reader._read(handler, _MAX_SCAN, scan_end)
                if reader._position == before:
                    break
            self.check_retained(position)  # a writer may have lapped the reader meanwhile
            # A message the limit cut: its first frame is the boundary (what was delivered
            # ends there), so a commit of this position never skips it.
            return reader._assembly_start if reader._assembling else reader._position

    def check_retained(self, position: int) -> None:
        """Raise :class:`DataLossError` unless the log still holds the frame at ``position``
        (a frame boundary): a copy of frames read from there is whole if this passes after
        the copy (a writer lapping the reader cleans and rewrites the term first)."""
        fields = self.frame_header(position)
        frame_length, frame_term_id = fields[0], fields[7]
        expected_term_id = compute_term_id(position, self._position_bits,
                                           self._log.initial_term_id)
        producer = self._log.producer_position()
        # A different term id: the partition was reused.  Nothing there behind this reader's
        # own position (which only passes what was there), or while the producer is a whole
        # term ahead: it was cleaned (a live writer's open claim is never that old), or this
        # log never held it (an image made again joins its stream where the stream is now).
        if (frame_length != 0 and frame_term_id != expected_term_id) or \
                (frame_length == 0 and (position < self._position
                                        or producer - position >= self._term_length)) or \
                position > producer:
            raise DataLossError(position, producer)

    @property
    def position(self) -> int:
        """This subscriber's position in the stream (bytes consumed)."""
        return self._position

    @position.setter
    def position(self, new_position: int) -> None:
        """Move this subscriber's position forward to a message boundary (a commit after
        :meth:`peek`), returning credit to the publishers.  Raises
        :class:`InvalidArgumentError` for a position behind this one, not a multiple of 32,
        or beyond what the log holds (the publishers' limit follows this position), and
        :class:`ClosedError` once the image is gone (its counter is no longer this
        subscriber's)."""
        if self._closed or self._gone:
            raise ClosedError("the image is gone: its position is no longer this subscriber's")
        if new_position < self._position or new_position & (FRAME_ALIGNMENT - 1):
            raise InvalidArgumentError(
                "position", f"{new_position} is behind {self._position} or not a multiple "
                            f"of {FRAME_ALIGNMENT}")
        written = self._log.producer_position()
        if new_position > written:
            raise InvalidArgumentError(
                "position", f"{new_position} is beyond what the log holds ({written})")
        if new_position < written:
            # A committed frame that is there must begin here (its header says where it is),
            # or the position lies inside one.  A frame being written has a length of zero
            # or below (a writer stores the negative length first, then the other fields,
            # then the length), so its other fields say nothing yet.
            fields = self.frame_header(new_position)
            if fields[0] > 0 and (fields[4] != new_position & self._term_mask
                                   or fields[7] != compute_term_id(
                                       new_position, self._position_bits,
                                       self._log.initial_term_id)):
                raise InvalidArgumentError(
                    "position", f"{new_position} is not where a message begins")
        self._assembling = False  # a message being assembled is left behind with the rest
        self._assembly = bytearray()
        self._advance(new_position)

    def close(self) -> None:
        """Unmap the image's log; further reads find nothing.  A subscription closes its
        images itself (after the client's resource linger); a :meth:`detached` image is its
        caller's to close."""
        if self._closed:
            return
        self._ended = self._position >= self._log.end_of_stream_position
        self._closed = True
        while True:  # their views of the mapping go first: it can unmap now
            try:  # a question on another thread may take one meanwhile: it closes its own
                spare = self._spare_readers.pop()
            except IndexError:
                break
            spare.close()
        self._terms = []
        self._term_ptrs = []
        self._header._term = memoryview(b"")
        self._log.close()


    def __repr__(self) -> str:
        return (f"Image(session_id={self.session_id}, stream_id={self.stream_id}, "
                f"position={self._position}, source={self.source_identity!r})")


def gather_scanned(term, term_length: int, term_base: int, starts, ends, count: int,
                   session_id: int) -> GatheredMessages | None:
    """The payloads of the ``count`` messages ``ss_term_read`` found in ``term`` (a cffi
    ``uint8_t *``, readable for ``term_length`` bytes; its first byte at stream position
    ``term_base``), bounds in ``starts``/``ends`` (cffi ``int32_t[]``), copied out in one C
    pass (``ss_gather_messages``) with their positions and reserved values; None when a bound
    lies outside the term (the caller names what it read)."""
    starts_address = int(ffi.cast("uintptr_t", starts))
    ends_address = int(ffi.cast("uintptr_t", ends))
    # Exactly the payloads, not zeroed: the gather writes every byte (or this returns None).
    data = _payload_buffer(starts_address, ends_address, count)
    size = len(data)
    offsets = array("i", [0]) * (count + 1)
    lengths = array("i", [0]) * count
    positions = array("q", [0]) * count
    reserved = array("q", [0]) * count
    with ffi.from_buffer(data) as out, ffi.from_buffer("int32_t[]", offsets) as offs, \
            ffi.from_buffer("int32_t[]", lengths) as lens, \
            ffi.from_buffer("int64_t[]", positions) as pos, \
            ffi.from_buffer("int64_t[]", reserved) as res:
        copied = lib.ss_gather_messages(term, term_length, starts, ends, count, term_base, out,
                                        size, offs, lens, pos, res)
    if copied != count or offsets[count] != size:
        return None
    return GatheredMessages(data, offsets, lengths, positions, reserved, session_id)


def await_frames(images: Sequence[Image], timeout_ns: int, spin_ns: int = 0) -> bool:
    """Wait until a frame is committed at the position of any of ``images`` (each one's
    own: a :meth:`~Image.reader_at` or :meth:`~Image.detached` reader waits at its private
    position), or ``timeout_ns`` passed: spin ``spin_ns`` first (yielding the CPU every few
    microseconds), then park on the logs' eventcounts (futexes the publishers and receivers
    bump), costing no CPU.  Returns whether a frame is there (a signal, or an image change a
    subscription wakes its waiters for, may end the wait early with nothing).  For a loop
    that reads many images, or readers that are not a subscription's (the archive); a
    subscription's own readers wait with :meth:`Subscription.wait_for_data
    <slipstream.client.subscription.Subscription.wait_for_data>`.  Raises
    :class:`ClosedError` for an image that is closed (its log is no longer mapped)."""
    if not images:
        return False
    readers = ffi.new("ss_reader_t[]", len(images))
    for reader, image in zip(readers, images, strict=True):
        image._check_open()
        image._describe(reader)
    return bool(lib.ss_await_frames(readers, len(images), spin_ns, timeout_ns))


def _not_an_action(result: object) -> UsageError:
    """What a controlled poll raises for a handler that returned ``result``, not an action."""
    return UsageError(f"a controlled poll's handler returned {result!r}, not a "
                      f"ControlledPollAction: return CONTINUE to consume the message and go on "
                      f"(the message was consumed)")

