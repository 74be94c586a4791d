"""Publication: appends messages to a stream's log buffer in shared memory.

``offer()`` is one C call (claim by atomic add, header, copy, release-store commit) and returns
the new stream position, or one of Aeron's negative codes:

* ``NOT_CONNECTED`` (-1): no subscriber yet; nothing was written.
* ``BACK_PRESSURED`` (-2): the slowest subscriber is a window behind; retry later.
* ``ADMIN_ACTION`` (-3): this offer rotated the term; retry at once.
* ``CLOSED`` (-4): the publication (or its client, or the driver) is gone.
* ``MAX_POSITION_EXCEEDED`` (-5): the stream reached term_length * 2^31 bytes.

Several publishers (threads or processes) may offer to the same stream concurrently.  An
:class:`ExclusivePublication` has one writer instead, and claims with a plain store.

Every frame's header has a 64-bit ``reserved_value`` (Aeron's reserved value) that the
application may set: ``offer(message, reserved_value=...)``, ``offer_batch(...,
reserved_values=...)`` or :attr:`BufferClaim.reserved_value` (0 when not given).  Subscribers
read it as ``header.reserved_value``; slipstream never looks at it, and it travels as it is
over UDP, retransmissions included.
"""

from __future__ import annotations

import enum
import operator
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from slipstream.client import _fastpath, control
from slipstream.client._native import ffi, lib
from slipstream.client.channel import PolicySpec, parse_channel
from slipstream.client.closing import ClosedOnExit
from slipstream.client.counters import SystemCounter
from slipstream.client.errors import (
    ClosedError,
    DriverNotRunningError,
    InvalidArgumentError,
    MessageTooLongError,
    UsageError,
)
from slipstream.client.idle import IDLE_PARK_NS, IDLE_YIELD_NS, SpinThenPark
from slipstream.client.idle import progress as idle_progress
from slipstream.client.layout import HEADER_LENGTH, INT64_MAX, INT64_MIN
from slipstream.client.logbuffer import (
    LogBuffer,
    OfOneLog,
    compute_term_id,
    index_by_position,
    new_appender,
)
from slipstream.client.messages import Buffer
from slipstream.client.owner import ResourceOwner, call_handler
from slipstream.client.policy import (
    BLOCK_SPIN_NS,
    BLOCK_YIELD_NS,
    BackPressureEpisode,
    OfferPolicy,
)

_fastpath.set_errors(MessageTooLongError, InvalidArgumentError)


@attrs.frozen
class PublicationRefusal:
    """A receiver refused a network publication's image (its driver answered a SETUP with an
    ERR frame), as the publishing driver tells the publication's clients
    (PUBLICATION_REFUSED; :attr:`Publication.last_refusal`): ``receiver`` the address the
    ERR came from (``host:port``), ``reason`` its text (what that host sent, escaped and cut
    to 200 characters: it names the bound or setting that refused), ``at_ns`` when the
    driver heard it (CLOCK_MONOTONIC ns, as ``time.monotonic_ns()``), ``refusals`` how many
    ERRs the publication has had.  The driver tells at most one a second per publication."""

    receiver: str
    reason: str
    at_ns: int
    refusals: int



class OfferCall(Protocol):
    """A publication's ``offer``: a C callable bound to it (or its policy's offer)."""

    def __call__(self, message: Buffer, reserved_value: int = 0) -> int: ...


NOT_CONNECTED = -1
BACK_PRESSURED = -2
ADMIN_ACTION = -3
CLOSED = -4
MAX_POSITION_EXCEEDED = -5

_RESULT_NAMES = {
    NOT_CONNECTED: "NOT_CONNECTED",
    BACK_PRESSURED: "BACK_PRESSURED",
    ADMIN_ACTION: "ADMIN_ACTION",
    CLOSED: "CLOSED",
    MAX_POSITION_EXCEEDED: "MAX_POSITION_EXCEEDED",
}


class NotDurable(enum.Enum):
    """Why a position is not durable yet (:meth:`Publication.why_not_durable`)."""

    #: Fewer tagged receivers than ``durable=TAG/N`` names count: none connected, some went
    #: silent or left, or one joined after what it would have to hold (it holds nothing
    #: before where it joined).  Waiting helps only once enough hold the stream.
    TOO_FEW_RECEIVERS = ("too few tagged receivers count (heard within their timeout, and "
                         "joined before the position)")
    #: Enough tagged receivers are there, and have not consumed that far yet (or their
    #: status messages saying so are still to come).
    BEHIND = "the tagged receivers have not consumed that far yet"
    #: The publication is closed: its durable position no longer moves.
    CLOSED = "the publication is closed"


def result_name(result: int) -> str:
    """``"BACK_PRESSURED"`` for -2, ``"position 4096"`` for a position."""
    return _RESULT_NAMES.get(result, f"position {result}")


class BufferClaim:
    """A claimed frame to fill in place, then :meth:`commit` (or :meth:`abort`).

    Reusable: pass the same object to every ``try_claim``.  ``buffer`` is a writable view of
    exactly the claimed payload, valid until commit or abort; so is :attr:`reserved_value`, the
    frame's reserved value (0 unless set before the commit).
    """

    __slots__ = ("_appender", "_frame", "buffer")

    def __init__(self) -> None:
        self._appender = ffi.NULL
        self._frame = ffi.NULL
        self.buffer: memoryview | None = None

    def commit(self) -> bool:
        """Make the frame visible to subscribers.  False when it was too late: the claim was
        held past ``publication_unblock_timeout`` and the driver gave it up as padding (the
        message was not published; the log carried on)."""
        if self._frame == ffi.NULL:
            raise UsageError("nothing claimed (or already committed)")
        done = bool(lib.ss_commit(self._appender, self._frame, self._frame_length()))
        self._release()
        return done

    def abort(self) -> None:
        """Give the frame up: it becomes padding that subscribers skip."""
        if self._frame == ffi.NULL:
            raise UsageError("nothing claimed (or already committed)")
        lib.ss_abort(self._appender, self._frame, self._frame_length())
        self._release()

    @property
    def reserved_value(self) -> int:
        """The claimed frame's reserved value: 0 as claimed; set it before :meth:`commit` (as
        Aeron's ``BufferClaim.reservedValue(long)``) and subscribers read it as
        ``header.reserved_value``.  An int64; raises :class:`UsageError` when nothing is
        claimed."""
        return int(ffi.cast("int64_t *", self._claimed() + lib.SS_RESERVED_VALUE_FIELD)[0])

    @reserved_value.setter
    def reserved_value(self, value: int) -> None:
        value = _int64("reserved_value", value)
        ffi.cast("int64_t *", self._claimed() + lib.SS_RESERVED_VALUE_FIELD)[0] = value

    def _claimed(self):  # -> the frame, a cffi uint8_t *
        if self._frame == ffi.NULL:
            raise UsageError("nothing claimed (or already committed)")
        return self._frame

    def _frame_length(self) -> int:
        assert self.buffer is not None
        return HEADER_LENGTH + len(self.buffer)

    def _release(self) -> None:
        self._frame = ffi.NULL
        self._appender = ffi.NULL
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None

    def __enter__(self) -> BufferClaim:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self._frame != ffi.NULL:
            self.abort() if exc_type is not None else self.commit()


def _int64(name: str, value: int) -> int:
    """``value`` as an int64, else InvalidArgumentError naming ``name`` (the C offer's words)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise InvalidArgumentError(name, f"{value!r} is not an int64 (a signed 64-bit integer)")
    number = operator.index(value)
    if not INT64_MIN <= number <= INT64_MAX:
        raise InvalidArgumentError(name, f"{value!r} is outside the int64 range "
                                         f"[-2**63, 2**63 - 1]")
    return number


def _int64_values(values: Sequence[int] | Buffer, count: int) -> array | memoryview:
    """``offer_batch``'s ``reserved_values`` as ``count`` contiguous native int64s: a view of a
    buffer that already holds them (``array('q')``, an int64 numpy array), else a converted
    copy; InvalidArgumentError naming the argument otherwise."""
    try:
        view = memoryview(values)  # type: ignore[arg-type]
    except TypeError:
        view = None
    converted: array | memoryview | None = None
    if view is not None:
        little = sys.byteorder == "little"
        native = ("q", "=q", "l", "=l", "<q" if little else ">q", "<l" if little else ">l")
        if view.ndim == 1 and view.itemsize == 8 and view.format in native and view.c_contiguous:
            converted = view
        elif view.format in ("B", "b", "c"):  # array("q", bytes) would read raw int64s
            raise InvalidArgumentError("reserved_values", "a byte buffer is not a list of "
                                                          "values: give ints, or an int64 array")
    if converted is None:
        try:
            converted = array("q", values)  # type: ignore[arg-type]
        except (TypeError, OverflowError, ValueError, NotImplementedError) as e:
            raise InvalidArgumentError("reserved_values", f"not a sequence of int64 values: "
                                                          f"{e}") from None
    if len(converted) != count:
        raise InvalidArgumentError("reserved_values", f"{len(converted)} values for {count} "
                                                      f"messages (lengths): one per message")
    return converted


def _int32_lengths(lengths: Sequence[int] | Buffer) -> array | memoryview:
    """``lengths`` as contiguous native int32s: a view of a buffer that already holds them (an
    int32 numpy array), else a converted copy (a byte buffer is refused, never reinterpreted)."""
    try:
        view = memoryview(lengths)  # type: ignore[arg-type]
    except TypeError:
        view = None
    if view is not None:
        native = ("i", "=i", "<i" if sys.byteorder == "little" else ">i")
        if view.ndim == 1 and view.itemsize == 4 and view.format in native and view.c_contiguous:
            return view
        if view.format in ("B", "b", "c"):  # array("i", bytes) would read it as raw int32s
            raise InvalidArgumentError("lengths", "a byte buffer is not a list of lengths: "
                                                  "give ints, or an int32 array")
    try:
        return array("i", lengths)  # type: ignore[arg-type]
    except (TypeError, OverflowError) as e:
        raise InvalidArgumentError("lengths", f"not a sequence of int32 lengths: {e}") from None


class Publication(ClosedOnExit, OfOneLog):
    """A handle on a stream for offering messages.  Create with ``Client.add_publication``."""

    def __init__(self, client: ResourceOwner, channel: str, stream_id: int, registration_id: int,
                 log: LogBuffer, limit_counter_id: int, doorbell_fd: int = -1, *,
                 policy: PolicySpec | None = None, drops_counter_id: int | None = None,
                 durable_counter_ids: tuple[int, int] | None = None) -> None:
        """``client``: the client conductor that made it.  ``doorbell_fd``: for a network
        stream, the driver sender's doorbell (rung on new data while the sender is parked);
        -1 for IPC.  ``policy``: what an offer does without
        credit (None: Aeron's codes); ``drops_counter_id``: the stream's ``pub-drops``;
        ``durable_counter_ids``: with ``durable=``, its ``pub-durable`` and ``durable-rcv``."""
        self.channel = channel
        self.registration_id = registration_id
        #: What names its log (its initial term id: the term id the stream started at, which
        #: its SETUP carries and its positions count from); its fields are its attributes too.
        self.identity = log.identity
        self.max_message_length = log.max_message_length
        self.max_payload_length = log.max_payload
        self._client = client
        self._log = log
        self._limit = client.counters.address(limit_counter_id)
        appender = new_appender(log, self._limit)
        appender.back_pressure_events = client.counters.address(
            SystemCounter.BACK_PRESSURE_EVENTS)
        # A new limit hit wakes a parked conductor (its back-pressure episodes).  On IPC every
        # refusal does: the conductor raises an IPC stream's limit.  A network stream's limit is
        # the sender's to raise (on status messages), and waking the conductor for each refusal
        # cost a core's fifth per back-pressured stream.
        appender.driver_signal = client.counters.driver_signal
        appender.driver_waiters = client.counters.driver_waiters
        appender.signal_every_refusal = 1 if doorbell_fd < 0 else 0
        appender.last_limit_hit = -1
        appender.doorbell_fd = doorbell_fd
        self._appender = appender
        self._released = False  # close() ran: its log goes after the linger
        self._last_position = 0
        self._async_turns = 0  # calls of the async API (aio.py)
        self._batch_result = ffi.new("int64_t *")
        self._claim_offset = ffi.new("int64_t *")
        #: ``offer(message, reserved_value=0) -> int``: append one message; returns the new
        #: position (> 0) or a negative code (module doc; under a :attr:`policy`, what it
        #: says); raises :class:`MessageTooLongError` beyond ``max_message_length``.
        #: ``reserved_value`` (an int64, positional or by keyword) goes into the header of the
        #: message's frame, and of every frame of a message fragmented over several (Aeron
        #: calls its ``reservedValueSupplier`` once per fragment; here all the fragments of one
        #: offer carry the same value); subscribers read it as ``header.reserved_value``; a
        #: value that is not an int64 raises :class:`InvalidArgumentError`, appending nothing.
        #: A C callable bound to this publication, so that a call costs about one C call
        #: (``offer(message)`` parses nothing more).
        self._drops_cell = (client.counters.address(drops_counter_id)
                            if drops_counter_id is not None else None)
        durable = parse_channel(channel).durable
        #: durable=TAG/N of the channel: how many tagged receivers make a message durable
        #: (None without the key).
        self.durable_required = durable.count if durable is not None else None
        self._durable_cells = None if durable_counter_ids is None else tuple(
            client.counters.address(counter_id) for counter_id in durable_counter_ids)
        self._last_durable = (-1, 0)  # (pub-durable, durable-rcv) as last read before close
        spins = client.spins_before_yield
        address = int(ffi.cast("uintptr_t", appender))
        #: The publication's back-pressure policy (None: Aeron's codes).
        self.policy = policy
        self._policy: OfferPolicy | None = None
        # One offer, no idling (the async calls' and the policies' attempts).
        self._attempt: Callable[[Buffer, int], int] = _fastpath.Offerer(address, appender).offer
        # Past the spins an idle offer waits for credit; an embedded driver's client yields
        # instead (park_ns 0): a park would stop the driver that brings the credit.
        embedded = client.invoker is not None
        if policy is None:
            self.offer: OfferCall = _fastpath.Offerer(
                address, appender, -1 if spins is None else spins,
                yield_ns=IDLE_YIELD_NS, park_ns=0 if embedded else IDLE_PARK_NS).offer
        else:
            self._policy = OfferPolicy(
                policy, self._attempt, self._offer_batch_once, channel=channel,
                stream_id=stream_id, appender=appender, drops_cell=self._drops_cell,
                invoker=client.invoker, closed=lambda: self.is_closed or client.is_closed)
            if policy.name == "rate-limit":
                self.offer = self._policy.offer
            else:
                self.offer = _fastpath.Offerer(address, appender,
                                               on_refused=self._policy.on_refused).offer
        # offer_batch calls that found no credit
        self._batch_idle = SpinThenPark(spins, None if embedded else (
            lambda yield_ns, park_ns: lib.ss_await_credit(appender, 0, yield_ns, park_ns)))
        #: Called with a :class:`BackPressureEpisode` as the stream's episodes begin and end
        #: (``Client.add_publication(on_back_pressure=...)``); the last one is kept.
        self.on_back_pressure: Callable[[BackPressureEpisode], object] | None = None
        self.last_episode: BackPressureEpisode | None = None
        #: The last refusal of the stream's image by a receiver that the driver told of
        #: (None: none): why a network publication does not connect.
        self.last_refusal: PublicationRefusal | None = None

    # -- publishing ----------------------------------------------------------------------------
    def offer_batch(self, data: Buffer, lengths: Sequence[int] | Buffer,
                    reserved_values: Sequence[int] | Buffer | None = None) -> int:
        """Append many messages in one call: ``data`` holds them back to back, ``lengths`` their
        sizes (an ``array('i')`` or int32 numpy array avoids a conversion).

        ``reserved_values``: one int64 per message (an ``array('q')`` or int64 numpy array
        avoids a conversion; any sequence of ints does), written into the header of each
        frame of that message as ``offer(message, reserved_value)`` does; None: 0 for all.
        :class:`InvalidArgumentError` names it when it does not hold ``len(lengths)`` int64s.

        Returns how many messages were appended (a prefix of the batch: offer the rest again,
        with the rest of its reserved values), or a negative code when none was.  Under a
        :attr:`policy`, the whole batch goes in (``block``, ``rate-limit``), or what did not fit
        is dropped (``drop-newest``) or raises (``error``); see :mod:`slipstream.client.policy`.
        """
        if not (isinstance(lengths, array) and lengths.typecode == "i"):
            lengths = _int32_lengths(lengths)
        if reserved_values is not None:
            reserved_values = _int64_values(reserved_values, len(lengths))
        if len(lengths) == 0:
            return 0
        if self._policy is not None:
            return self._policy.offer_batch(data, lengths, reserved_values)
        done, code = self._offer_batch_once(data, lengths, reserved_values)
        if done > 0:
            idle_progress()
            return done
        if code == BACK_PRESSURED or code == NOT_CONNECTED:
            self._batch_idle.idle()
        return code

    async def offer_async(self, message: Buffer, reserved_value: int = 0, *,
                          timeout: float | None = None) -> int:
        """Append one message (with ``reserved_value`` in its frames' headers, as :meth:`offer`)
        from a trio or asyncio task, waiting for credit without blocking the event loop
        (``block``'s behaviour, whatever the :attr:`policy`; under ``rate-limit`` it is paced by
        the publication's token bucket first, as :meth:`offer` is, and waits for the bucket
        even with ``when-empty:refuse``): returns the new position, or
        ``MAX_POSITION_EXCEEDED`` once the stream has reached its end (no wait helps then: a
        new publication is needed).

        Waits for credit at most ``timeout`` seconds (None: the policy's timeout if the
        publication has one, else 10 s), then raises :class:`BackPressuredError`; raises
        :class:`ClosedError` when the publication is closed meanwhile and
        :class:`DriverNotRunningError` when the driver is lost.  Cancellable by the loop's own
        means (trio's cancel scopes, asyncio's ``Task.cancel()``: nothing is appended then).
        See :mod:`slipstream.client.aio`."""
        from slipstream.client import aio  # anyio, asyncio: ~20 ms, paid only by who awaits

        if timeout is not None:  # None is the policy's; a number is a finite wait
            timeout = control.check_timeout("timeout", timeout, forever=False)
        if type(reserved_value) is not int or not INT64_MIN <= reserved_value <= INT64_MAX:
            reserved_value = _int64("reserved_value", reserved_value)  # before any wait
        return await aio.offer(self, message, timeout, reserved_value)

    def _offer_batch_once(self, data: Buffer, lengths: array | memoryview,
                          reserved_values: array | memoryview | None = None) -> tuple[int, int]:
        """One C batch append: (messages appended, the refined code when none was);
        ``reserved_values``: as many int64s as ``lengths``, or None (0s)."""
        result = self._batch_result
        count = len(lengths)
        with ffi.from_buffer("int32_t[]", lengths) as sizes:
            if reserved_values is not None:
                with ffi.from_buffer("int64_t[]", reserved_values) as values, \
                        ffi.from_buffer(data) as source:
                    done = lib.ss_offer_batch_rv(self._appender, source, len(source), sizes,
                                                 values, count, result)
            elif isinstance(data, bytes):
                done = lib.ss_offer_batch(self._appender, data, len(data), sizes, count, result)
            else:
                with ffi.from_buffer(data) as source:
                    done = lib.ss_offer_batch(self._appender, source, len(source), sizes, count,
                                              result)
        if done > 0:
            return done, 0
        code = result[0]
        if code == lib.SS_INVALID_LENGTH:
            for index, length in enumerate(lengths):
                if length < 0:
                    raise InvalidArgumentError(
                        "lengths", f"lengths[{index}] is {length}: a length is 0 or more")
            raise MessageTooLongError(max(lengths), self.max_message_length)
        if code == lib.SS_INVALID_BATCH:
            raise InvalidArgumentError(
                "lengths", f"the lengths add up to {sum(lengths)} bytes but data holds "
                           f"{len(memoryview(data))}")
        return 0, code

    def try_claim(self, length: int, claim: BufferClaim) -> int:
        """Claim ``length`` bytes (≤ ``max_payload_length``) to fill in place; returns the new
        position and sets up ``claim`` (its ``buffer``, and its ``reserved_value``, 0 until set
        before the commit), or a negative code.  Commit or abort promptly: readers wait behind
        an open claim.  Raises :class:`InvalidArgumentError` when ``claim`` is not a
        :class:`BufferClaim` and :class:`UsageError` when it still holds an open claim, before
        anything is claimed: a claim taken and then lost stalls every reader of the stream
        until the driver gives it up (``publication_unblock_timeout``)."""
        if not isinstance(claim, BufferClaim):
            raise InvalidArgumentError("claim", f"{type(claim).__name__} is not a BufferClaim")
        if claim._frame != ffi.NULL:
            raise UsageError("this BufferClaim holds a claim not yet committed or aborted: "
                             "commit() or abort() it first (its readers wait behind it)")
        frame_offset = self._claim_offset
        try:
            result = lib.ss_try_claim(self._appender, length, frame_offset)
        except (OverflowError, TypeError):  # past int32, or not an int: cffi's words
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                raise MessageTooLongError(length, self.max_payload_length, claim=True) from None
            raise InvalidArgumentError("length", f"{length!r} is not a number of bytes "
                                                 f">= 0") from None
        if result > 0:
            offset = frame_offset[0]
            claim._frame = self._log.address + offset
            claim._appender = self._appender
            claim.buffer = self._log.view[offset + HEADER_LENGTH:offset + HEADER_LENGTH + length]
            return result
        if result == lib.SS_INVALID_LENGTH:
            if length < 0:
                raise InvalidArgumentError("length", f"a claim of {length} bytes: 0 or more")
            raise MessageTooLongError(length, self.max_payload_length, claim=True)
        return result

    # -- state ---------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """The stream position the next message will be appended at (the last one known once
        closed: the log is unmapped then)."""
        if not self.is_closed:
            self._last_position = self._log.producer_position()
        return self._last_position

    @property
    def publication_limit(self) -> int:
        """Position beyond which offers are back-pressured (0 once closed)."""
        return 0 if self.is_closed else lib.ss_load_acquire_i64(self._limit)

    # -- durability (durable=TAG/N, docs/CHANNELS.md §7.7) --------------------------------------
    def _durable_values(self) -> tuple[int, int]:
        cells = self._durable_cells
        if cells is None:
            raise UsageError(f"{self.channel!r} has no durable= key: name the receivers that "
                             f"make a message durable, e.g. durable=<gtag>/1, and subscribe "
                             f"them with gtag=<gtag>")
        if not self.is_closed:  # the counters go with the publication
            self._last_durable = (lib.ss_load_acquire_i64(cells[0]),
                                  lib.ss_load_acquire_i64(cells[1]))
        return self._last_durable

    @property
    def durable_position(self) -> int | None:
        """The stream position (bytes) that N receivers tagged ``gtag=TAG`` have reported
        consuming, for ``durable=TAG/N``: every message whose offer returned a position at or
        below it is held by N of them (each as its own subscriber promises: an archive's,
        written and synced under its sync policy).  It never goes back; it starts at the
        position the publication started at.  None when the channel has no ``durable=`` key
        (the last known value once closed).  Read from a counter: no round trip."""
        if self._durable_cells is None:
            return None
        return self._durable_values()[0]

    @property
    def durable_receivers(self) -> int | None:
        """How many receivers tagged ``durable=``'s TAG the driver heard from within their
        timeout (the flow control receiver timeout, 5 s by default); None without the key."""
        if self._durable_cells is None:
            return None
        return self._durable_values()[1]

    def why_not_durable(self, position: int) -> NotDurable | None:
        """None when ``position`` (an offer's result) is durable, else why not: too few tagged
        receivers, the receivers are behind, or the publication is closed.  UsageError
        without a ``durable=`` key."""
        durable, receivers = self._durable_values()
        if durable >= position:
            return None
        if self.is_closed:
            return NotDurable.CLOSED
        assert self.durable_required is not None
        if receivers < self.durable_required:
            return NotDurable.TOO_FEW_RECEIVERS
        return NotDurable.BEHIND

    @property
    def has_credit(self) -> bool:
        """Whether an offer may go now: connected and the position below the publication
        limit (true once closed: an offer then returns CLOSED at once)."""
        return bool(lib.ss_has_credit(self._appender)) if not self.is_closed else True

    def await_credit(self, timeout_ns: int) -> bool:
        """Wait until :attr:`has_credit`, at most ``timeout_ns``: parked at once on the log's
        publisher eventcount, which the driver bumps when it moves the limit (the GIL
        released meanwhile).  Returns :attr:`has_credit`.  For a loop that serves other
        work too and so bounds the wait; an offer that waits for credit by itself parks
        the same way (the client's idle strategy).  :class:`InvalidArgumentError` for a
        ``timeout_ns`` that is not an int of 0 or more."""
        control.check_int64("timeout_ns", timeout_ns, low=0)
        if self.is_closed:
            return True
        credit = bool(lib.ss_await_credit(self._appender, 0, 0, timeout_ns))
        return credit or self.is_closed  # closed meanwhile: an offer returns CLOSED at once

    def wait_durable(self, position: int, timeout_s: float) -> bool:
        """Wait until :attr:`durable_position` reaches ``position`` (an offer's result, or
        :attr:`position` for everything offered so far): True once it did, False when
        ``timeout_s`` seconds passed first or the publication closed
        (:meth:`why_not_durable` says which, and whether tagged receivers are missing).
        Spins briefly, yields, then parks on the log's durable eventcount, which the driver
        bumps as status messages move the position; the GIL is released meanwhile.  A
        pipelined publisher waits for message k while it offers k + window: each status
        message of the tagged receivers (one per quarter of their window, or every 200 ms)
        moves the position.  UsageError without a ``durable=`` key."""
        cells = self._durable_cells
        # Reached already: one load (a pipelined publisher calls this once per message).
        if (cells is not None and type(position) is int
                and lib.ss_load_acquire_i64(cells[0]) >= position and not self.is_closed):
            return True
        position = control.check_int64("position", position)
        timeout_s = control.check_timeout("timeout_s", timeout_s, forever=False)
        assert timeout_s is not None
        self._durable_values()  # raises without the key
        assert cells is not None
        if self.is_closed:
            return self._last_durable[0] >= position
        return bool(lib.ss_await_durable(self._appender, cells[0], position, BLOCK_SPIN_NS,
                                         BLOCK_YIELD_NS, int(timeout_s * 1e9)))

    async def wait_durable_async(self, position: int, timeout_s: float) -> bool:
        """:meth:`wait_durable` from a trio or asyncio task, without blocking the event loop
        (the park runs in a worker thread, in slices; cancelling the task ends it at once)."""
        from slipstream.client import aio  # anyio, asyncio: ~20 ms, paid only by who awaits

        position = control.check_int64("position", position)
        timeout_s = control.check_timeout("timeout_s", timeout_s, forever=False)
        assert timeout_s is not None
        self._durable_values()  # raises without the key
        return await aio.wait_durable(self, position, int(timeout_s * 1e9))

    def _wake_durable_waiters(self) -> None:
        if not self.is_closed:
            self._log.signal_durable_waiters()

    @property
    def is_connected(self) -> bool:
        """Whether at least one subscriber is connected (offers can succeed)."""
        return not self.is_closed and self._log.is_connected

    @property
    def is_closed(self) -> bool:
        return bool(self._appender.closed)

    def cut_off_error(self) -> DriverNotRunningError | ClosedError | None:
        """Why offers say CLOSED when the client is the reason (its driver went, or the client
        closed): the error to raise; None when the application closed this publication.
        May wait for the client's lock, which a request holds as long as it waits."""
        return self._client.cut_off_error()

    def _on_episode(self, message: dict) -> None:
        """The driver's BACK_PRESSURE_EPISODE (client conductor thread): keep it and call the
        user's callback, whose exceptions are logged and go no further (that thread carries
        the driver's events)."""
        episode = BackPressureEpisode(bool(message["started"]), int(message["at_ns"]),
                                      int(message["depth"]), int(message["duration_ns"]),
                                      int(message["episodes"]))
        self.last_episode = episode
        call_handler("back-pressure callback", self.on_back_pressure, episode, self)

    def _on_refused(self, message: dict) -> None:
        """The driver's PUBLICATION_REFUSED (client conductor thread): kept as
        :attr:`last_refusal`."""
        self.last_refusal = PublicationRefusal(
            str(message["receiver"]), str(message["reason"]), int(message["at_ns"]),
            int(message["refusals"]))

    @property
    def dropped(self) -> int:
        """Messages ``policy=drop-newest`` dropped through this publication object (the
        stream's ``pub-drops`` counter counts every publisher's)."""
        return self._policy.dropped if self._policy is not None else 0

    def _mark_closed(self) -> None:
        """Every further offer returns CLOSED, without touching the log (which may go); an
        offer parked for credit (``policy=block``) is woken and returns CLOSED."""
        if self.is_closed:
            return
        self._last_position = self._log.producer_position()
        if self._durable_cells is not None:
            self._durable_values()  # the last values, kept: the counters go with it
        self._appender.closed = 1
        self._log.signal_publishers()  # the log is still mapped: it is unmapped after a linger
        self._log.signal_durable_waiters()

    def close(self) -> None:
        """Release the publication; further offers return CLOSED.  Its log is unmapped after
        the client's resource linger, also when the publication was cut off before (the
        driver lost: offers said CLOSED already, and the log was still mapped)."""
        if self._released:
            return
        self._released = True
        self._mark_closed()
        self._client.release_publication(self.registration_id, self._unmap)

    def add_destination(self, endpoint_channel: str) -> None:
        """Send this stream to ``endpoint_channel`` (``aeron:udp?endpoint=HOST:PORT``) too:
        the publication's channel is ``control-mode=manual`` multi-destination-cast, whose
        destinations are its publishers' to add (Aeron's ``Publication.addDestination``).  They
        belong to the channel's send endpoint, so every publication of the same channel sends
        to them.  Returns once the driver added it; ChannelRejectedError names the part it
        refused (another control mode, a destination it has, a host that does not resolve)."""
        self._client.destination_request(control.ADD_DESTINATION, self, endpoint_channel)

    def remove_destination(self, endpoint_channel: str) -> None:
        """Stop sending to ``endpoint_channel``, a destination :meth:`add_destination` added
        (ChannelRejectedError if it is not one)."""
        self._client.destination_request(control.REMOVE_DESTINATION, self, endpoint_channel)

    def _unmap(self) -> None:
        self._log.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(channel={self.channel!r}, stream_id={self.stream_id}, "
                f"session_id={self.session_id}, position={self.position})")


class ExclusivePublication(Publication):
    """A publication with one writer (Aeron's ``ExclusivePublication``): create with
    ``Client.add_exclusive_publication``.

    The driver makes it a publication and log of its own, with its own session id, that no
    other publisher joins (two adds of one channel and stream are two sessions, and a
    subscriber sees two images).  Its log has one writer, this object, so a claim moves the
    term's tail with a plain release store where a shared publication's takes an atomic add;
    the frames, the positions and the wire are a shared publication's, and so is everything
    else: :meth:`offer`, :meth:`offer_batch`, :meth:`try_claim`, reserved values, the codes,
    policies, :meth:`offer_async`.

    **One thread at a time.**  Offer, batch and claim from one thread (or hand the object
    over under a lock).  Two threads appending at once is the caller's error, and is not
    detected: ``offer_batch`` and ``try_claim`` run in C without the GIL, and two claims that
    read the same tail write their frames over each other, which corrupts the stream for
    every subscriber.  A forked child may not append to it either (its writes would land in
    the parent's log).
    """

    def __init__(self, client: ResourceOwner, channel: str, stream_id: int, registration_id: int,
                 log: LogBuffer, limit_counter_id: int, doorbell_fd: int = -1, *,
                 policy: PolicySpec | None = None, drops_counter_id: int | None = None,
                 durable_counter_ids: tuple[int, int] | None = None) -> None:
        """As :class:`Publication`'s; ``log`` is this publication's alone."""
        super().__init__(client, channel, stream_id, registration_id, log, limit_counter_id,
                         doorbell_fd, policy=policy, drops_counter_id=drops_counter_id,
                         durable_counter_ids=durable_counter_ids)
        self._appender.exclusive = 1  # before any append: claims are plain stores from now
        self._block_result = ffi.new("int64_t *")

    def offer_block(self, block: Buffer) -> int:
        """Append ``block``, whole frames the caller wrote (Aeron's ``offerBlock``), at the
        publication's position, whole or not at all: to move frames a recorder or archive has
        as they are, without a call per message.  Its frames follow each other from the term
        offset and term id of :attr:`position` (``term_offset``, ``term_id`` of
        :class:`~slipstream.client.messages.Header` fields: the layout of docs/PROTOCOL.md
        §1.2), each with this publication's session and stream ids, DATA frames of at most an
        MTU, the last one possibly padding that ends the term; the block ends within the
        term.  Returns the new position, or a negative code as :meth:`offer` (it goes when the
        position is below the limit, then all of it).  A block that is not such raises
        :class:`InvalidArgumentError` and appends nothing."""
        with ffi.from_buffer(block) as data:
            length = len(data)
            for _ in range(2):  # once more after a rotation (ADMIN_ACTION)
                result = lib.ss_offer_block(self._appender, data, length)
                if result != ADMIN_ACTION:
                    break
        if result == lib.SS_INVALID_BATCH:
            log, position = self._log, self.position
            raise InvalidArgumentError(
                "block", f"not {length} bytes of whole frames of session {self.session_id} "
                f"stream {self.stream_id} from term offset {position & (log.term_length - 1)} "
                f"of term {compute_term_id(position, log.position_bits, log.initial_term_id)} "
                f"(each frame's term offset and term id its own, "
                f"DATA of at most {log.mtu - HEADER_LENGTH} payload bytes, padding only to "
                f"the term's end, the block within the term)")
        return int(result)

    def append_block_from(self, source: LogBuffer, position: int, end: int,
                          max_length: int) -> tuple[int, int]:
        """Copy the frames of ``source``, another log framed alike (the same initial term id,
        term length and MTU), from ``position``, this publication's position, as they are:
        up to ``max_length`` bytes (at least the first frame), none at or past ``end``,
        within the term, in one C call (``ss_append_block``: Aeron's ``offerBlock`` from a
        log, for a replay).  It stops before a frame that is not the term's, not DATA, or
        padding inside the term; padding that ends the term is copied.

        Returns ``(bytes appended, the position after them)``; or ``(0, code)``: 0 when
        nothing at ``position`` could be copied (not a frame this copies, or the source
        changed under the copy: look at what is there), ``ADMIN_ACTION`` after a rotation
        (call again), ``lib.SS_INVALID_BATCH`` when this publication is not at ``position``,
        else an offer's code (no credit, CLOSED)."""
        term = source.term_address(index_by_position(position, source.position_bits))
        return self.append_block_from_term(term, source.term_length, position, end, max_length)

    def append_block_from_term(self, term: Any, term_length: int, position: int, end: int,
                               max_length: int) -> tuple[int, int]:
        """:meth:`append_block_from` with the source term given by its address (a cffi
        ``uint8_t *`` to the first byte of the term that holds ``position``, of
        ``term_length`` bytes, readable at least up to ``end``'s offset in it): a term of a
        recording's segment file, mapped.  The same returns."""
        copied = lib.ss_append_block(self._appender, term, term_length, position, end,
                                     max_length, self._block_result)
        return copied, self._block_result[0]

    def __enter__(self) -> ExclusivePublication:
        return self
