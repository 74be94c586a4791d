"""What a read hands over: the :class:`Header` of the message a handler is given, a
:class:`MessageBatch` of messages in place (valid until the next poll), and
:class:`GatheredMessages` copied out of the log with their offsets, positions and reserved
values (the caller's to keep); and what a controlled poll's handler hands back, a
:class:`ControlledPollAction`.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Callable, Iterator
from typing import Protocol

import attrs

from slipstream.client.layout import (
    CURRENT_VERSION,
    DATA_HEADER,
    END_FLAG,
    FRAME_ALIGNMENT,
    HDR_TYPE_DATA,
    HEADER_LENGTH,
    UNFRAGMENTED,
)
from slipstream.client.logbuffer import compute_term_id

#: What an offer takes: anything exposing the buffer protocol (numpy arrays too);
#: ``collections.abc.Buffer`` is 3.12+.
Buffer = bytes | bytearray | memoryview


class FramedStream(Protocol):
    """What a :class:`Header` reads of the image its message came from
    (:class:`~slipstream.client.image.Image`): the stream's ids and how its positions are
    framed."""

    @property
    def session_id(self) -> int: ...
    @property
    def stream_id(self) -> int: ...
    @property
    def initial_term_id(self) -> int: ...
    @property
    def term_length(self) -> int: ...
    @property
    def mtu(self) -> int: ...


class Header:
    """The header of the message being delivered (a flyweight: valid during the call only)."""

    __slots__ = ("_image", "_payload", "_term", "_term_base")

    def __init__(self, image: FramedStream) -> None:
        self._image = image
        self._term: memoryview = memoryview(b"")
        self._term_base = 0
        self._payload = HEADER_LENGTH  # offset of the payload in the term

    def _fields(self) -> tuple[int, ...]:
        return DATA_HEADER.unpack_from(self._term, self._payload - HEADER_LENGTH)

    @property
    def session_id(self) -> int:
        """The session of the image this message came from (read-only: the image's)."""
        return self._image.session_id

    @property
    def stream_id(self) -> int:
        """The stream of the image this message came from (read-only: the image's)."""
        return self._image.stream_id

    @property
    def frame_length(self) -> int:
        return self._fields()[0]

    @property
    def flags(self) -> int:
        return self._fields()[2]

    @property
    def term_offset(self) -> int:
        return self._payload - HEADER_LENGTH

    @property
    def term_id(self) -> int:
        return self._fields()[7]

    @property
    def reserved_value(self) -> int:
        return self._fields()[8]

    @property
    def position(self) -> int:
        """Stream position just after this message (aligned), as Aeron's Header.position()."""
        length = self._fields()[0]
        aligned = (length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT  # inline: per call
        return self._term_base + self._payload - HEADER_LENGTH + aligned

    def __repr__(self) -> str:
        return (f"Header(session_id={self.session_id}, stream_id={self.stream_id}, "
                f"term_id={self.term_id}, term_offset={self.term_offset}, "
                f"position={self.position})")


class GatheredHeader(Header):
    """The header of a message handed on from :class:`GatheredMessages` copied out of a log
    framed as ``image``'s (its session, stream, initial term id, term length and MTU): the
    fields of the message's last frame, worked out from where the message ends and its length
    as a publication frames it (fragments of ``mtu - HEADER_LENGTH`` payload bytes, the last
    holding the rest), rather than read from a log.  A flyweight: :meth:`of` sets it for
    each message."""

    __slots__ = ("_held",)

    def __init__(self, image: FramedStream) -> None:
        super().__init__(image)
        self._held: tuple[int, ...] = ()

    def _fields(self) -> tuple[int, ...]:
        return self._held

    def of(self, chunk: GatheredMessages, index: int) -> GatheredHeader:
        """This header, set to message ``index`` of ``chunk``."""
        image = self._image
        length = chunk.lengths[index]
        max_payload = image.mtu - HEADER_LENGTH
        if length <= max_payload:
            last, flags = length, UNFRAGMENTED
        else:
            last, flags = length - (length - 1) // max_payload * max_payload, END_FLAG
        frame_length = HEADER_LENGTH + last
        frame = chunk.positions[index] - ((frame_length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
        term_offset = frame & (image.term_length - 1)
        self._term_base = frame - term_offset
        self._payload = term_offset + HEADER_LENGTH
        self._held = (frame_length, CURRENT_VERSION, flags, HDR_TYPE_DATA, term_offset,
                      image.session_id, image.stream_id,
                      compute_term_id(frame, image.term_length.bit_length() - 1,
                                      image.initial_term_id),
                      chunk.reserved_values[index])
        return self


FragmentHandler = Callable[[memoryview, Header], object]
#: What :meth:`Image.block_poll` hands whole frames to: ``(block, position)``, a view of the
#: log's bytes (headers included) valid during the call and the stream position of its start
#: (Aeron's ``BlockHandler``).
BlockHandler = Callable[[memoryview, int], object]


class ControlledPollAction(enum.Enum):
    """What a controlled poll's handler returns for the message it was given (Aeron's
    ``ControlledFragmentHandler.Action``; its C++ client's ``ControlledPollAction``).

    The subscriber position is what the publishers' flow control sees: it bounds how far they
    may write.  ``Image.controlled_poll`` moves it past a consumed message at a COMMIT or a
    BREAK, else at the latest at the end of the poll; a fragmented message's frames move it as
    they are read (the fragments before its last are consumed as they are assembled, and its
    last as its handler answers).  It never moves past a message whose handler has not
    answered.
    """

    #: Do not consume this message and stop: the next poll delivers it again.
    ABORT = "abort"
    #: Consume this message and stop the poll here.
    BREAK = "break"
    #: Consume this message and move the subscriber position past it now, then go on.
    COMMIT = "commit"
    #: Consume this message and go on; the position moves past it at the latest at the end of
    #: the poll.
    CONTINUE = "continue"


ControlledFragmentHandler = Callable[[memoryview, Header], ControlledPollAction]


@attrs.define(eq=False, repr=False)
class MessageBatch:
    """Whole messages from one poll_batch, in place: message i is ``buffer[starts[i]:ends[i]]``.

    ``starts`` and ``ends`` are int32 memoryviews (``numpy.frombuffer(batch.starts, "i4")``
    works), so a batch costs no Python work per message.  Valid until the next poll of the
    same subscription.
    """

    buffer: memoryview
    starts: memoryview
    ends: memoryview
    session_id: int
    position: int

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self) -> Iterator[memoryview]:
        buffer = self.buffer
        for start, end in zip(self.starts, self.ends, strict=True):
            yield buffer[start:end]

    @property
    def lengths(self) -> list[int]:
        return [end - start for start, end in zip(self.starts, self.ends, strict=True)]

    @property
    def total_bytes(self) -> int:
        return sum(self.ends) - sum(self.starts)


@attrs.define(eq=False, repr=False)
class GatheredMessages:
    """Whole messages from one :meth:`Image.poll_gathered`, copied out of the log back to back:
    message i is ``data[offsets[i]:offsets[i + 1]]`` (``lengths[i]`` bytes), ``positions[i]``
    the stream position after it and ``reserved_values[i]`` its frame's reserved value.
    ``data`` is a bytearray, ``offsets`` (len + 1 entries) and ``lengths`` ``array('i')``, the
    other two ``array('q')``: the buffers of an Arrow binary column and two int64 columns as
    they are (``pyarrow`` wraps them without a copy), and what ``offer_batch`` takes.  Owned by
    the caller."""

    data: bytearray
    offsets: array
    lengths: array
    positions: array
    reserved_values: array
    session_id: int

    @classmethod
    def one(cls, message: bytes, position: int, reserved_value: int,
            session_id: int) -> GatheredMessages:
        """One message (an assembled fragmented one), ending at stream ``position``."""
        return cls(bytearray(message), array("i", [0, len(message)]), array("i", [len(message)]),
                   array("q", [position]), array("q", [reserved_value]), session_id)

    def __len__(self) -> int:
        return len(self.positions)
