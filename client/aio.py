"""Waiting for credit and for messages under trio or asyncio, without blocking the event loop.

``Publication.offer_async``, ``Subscription.receive_async``, ``Subscription.messages`` and
``Publication.wait_durable_async`` try the plain non-blocking call first; only when it finds
nothing do they wait, on the same futex eventcounts as the blocking calls (the log's publisher
signal, which the driver bumps when it moves pub-lmt, and its reader signal, which publishers
bump on commit).  The park runs in a worker thread of the running loop's own pool
(``anyio.to_thread.run_sync``: trio's thread cache under trio, anyio's workers under asyncio)
in slices of at most :data:`PARK_SLICE_NS`; cancelling the task returns at once
(``abandon_on_cancel``) and bumps the eventcount the thread is parked on, so the thread leaves
the futex too and nothing is left waiting.

The loop is whichever runs the task: trio or asyncio (:data:`LOOPS`).  The waits are anyio's,
which under trio are trio's own; the checkpoints around an append or a poll are the loop's own
(:func:`_checkpoints`).  Cancelling is each loop's own: a trio or anyio cancel scope
(level-triggered: every checkpoint raises while it is cancelled), or asyncio's
``Task.cancel()`` and what is built on it (``asyncio.timeout``, a ``TaskGroup``):
edge-triggered, the next suspension raises, once.  Under either a cancellation is taken before
a message is appended or polled, never after: one that reaches the schedule point after the
append is handed on to the caller's next suspension, and the call returns what it did.

With a driver embedded in invoker mode (``Client.connect(invoker=...)``) nothing else moves
the data: the task runs the driver's duty cycle between checkpoints instead of parking.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread
import sniffio

from slipstream.client._native import lib
from slipstream.client.channel import PolicySpec
from slipstream.client.errors import (
    BackPressuredError,
    ClosedError,
    DriverNotRunningError,
    UsageError,
)
from slipstream.client.logbuffer import LogBuffer
from slipstream.client.messages import Buffer, FragmentHandler
from slipstream.client.owner import ResourceOwner
from slipstream.client.policy import (
    BLOCK_SPIN_NS,
    BLOCK_YIELD_NS,
    DEFAULT_BLOCK_TIMEOUT_NS,
    INVOKER_PACE_SLICE_NS,
    PACE_SLICE_NS,
    OfferPolicy,
    TokenBucket,
)


class AsyncPublication(Protocol):
    """What the async calls use of a :class:`~slipstream.client.publication.Publication`,
    which calls them (they run its own offers and waits)."""

    channel: str
    stream_id: int
    policy: PolicySpec | None
    _policy: OfferPolicy | None
    _client: ResourceOwner
    _log: LogBuffer
    _appender: Any  # ss_appender_t *
    _durable_cells: tuple[Any, ...] | None
    _async_turns: int
    _attempt: Callable[[Buffer, int], int]

    @property
    def is_closed(self) -> bool: ...
    @property
    def durable_position(self) -> int | None: ...
    def cut_off_error(self) -> DriverNotRunningError | ClosedError | None: ...
    def _wake_durable_waiters(self) -> None: ...


class AsyncSubscription(Protocol):
    """What the async calls use of a :class:`~slipstream.client.subscription.Subscription`,
    which calls them."""

    _client: ResourceOwner
    _async_turns: int
    _async_pending: deque[bytes]
    _before_read_due: bool

    @property
    def is_closed(self) -> bool: ...
    def _poll(self, handler: FragmentHandler, fragment_limit: int) -> tuple[int, bool]: ...
    def wait_for_data(self, timeout_ns: int, spin_ns: int | None = None) -> bool: ...
    def _wake_waiters(self) -> None: ...

#: The longest one park in a worker thread lasts before the task looks again (a close, a lost
#: driver and new images wake it sooner).
PARK_SLICE_NS = 200_000_000
_NOT_CONNECTED, _BACK_PRESSURED, _ADMIN_ACTION, _CLOSED = (
    lib.SS_NOT_CONNECTED, lib.SS_BACK_PRESSURED, lib.SS_ADMIN_ACTION, lib.SS_CLOSED)
#: The event loops the async calls run under (as :func:`sniffio.current_async_library` names
#: them).
LOOPS = ("trio", "asyncio")
#: Of the calls on one publication or subscription, every this many is a checkpoint
#: whether or not it waits (a call that waits always is one).  The others run no scheduler: a
#: checkpoint costs ~8 µs here, and on every call it cut ``offer_async`` from 0.66 to 0.10 M/s.
#: So a loop of offers that always find credit still lets the other tasks run, and can be
#: cancelled, every 64 messages.
SCHEDULE_EVERY = 64


def _running_loop() -> str:
    """The running event loop's name, one of :data:`LOOPS`; raises :class:`UsageError` under
    another or none."""
    try:
        loop = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        loop = None
    if loop not in LOOPS:
        raise UsageError(f"slipstream's async calls run under trio or asyncio, not under "
                         f"{loop or 'no event loop'}; elsewhere, use the blocking calls in a "
                         f"thread")
    return loop


def _turn_is_due(handle: AsyncPublication | AsyncSubscription) -> bool:
    """Whether this call is the one in :data:`SCHEDULE_EVERY` that checkpoints."""
    if handle._async_turns == 0:
        # Until one call passed it: under another loop the first 63 calls would pass, and
        # the 64th fail inside anyio.
        _running_loop()
    handle._async_turns += 1
    return handle._async_turns % SCHEDULE_EVERY == 0


async def _asyncio_schedule_point() -> None:
    """asyncio's schedule point after a message was appended or polled: other tasks run, and
    no cancellation is taken here (the caller must learn what the call did).  An anyio
    scope's waits behind the shield; ``Task.cancel()`` reaches through any shield, so it is
    asked again, for the caller's next suspension, with the task's count of requests kept
    (``asyncio.timeout`` and task groups read it)."""
    try:
        await anyio.lowlevel.cancel_shielded_checkpoint()
    except asyncio.CancelledError as cancelled:
        task = asyncio.current_task()
        assert task is not None
        task.uncancel()
        task.cancel(*cancelled.args[:1])


#: Each loop's (checkpoint before an append or poll, which takes a cancellation; schedule
#: point after one, which takes none), made at its first use.  Under trio, trio's own: anyio's
#: add ~1.3 µs to every SCHEDULE_EVERY-th call, 3 % of a call that finds credit.
_CHECKPOINTS: dict[str, tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]] = {}


def _checkpoints() -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """The running loop's checkpoints around an append or a poll (see :data:`_CHECKPOINTS`)."""
    try:
        return _CHECKPOINTS[sniffio.current_async_library()]
    except (KeyError, sniffio.AsyncLibraryNotFoundError):
        loop = _running_loop()
    if loop == "trio":
        import trio  # only where trio runs: an asyncio program need not import it

        checkpoints = (trio.lowlevel.checkpoint_if_cancelled,
                       trio.lowlevel.cancel_shielded_checkpoint)
    else:
        checkpoints = (anyio.lowlevel.checkpoint_if_cancelled, _asyncio_schedule_point)
    _CHECKPOINTS[loop] = checkpoints
    return checkpoints


async def _park(wait: Callable[[int], Any], wake: Callable[[], None], slice_ns: int,
                invoker: Callable[[], int] | None) -> None:
    """One wait of at most ``slice_ns``: ``wait(slice_ns)`` in a worker thread (``wake()``
    frees it when the task is cancelled), or one embedded duty cycle."""
    if invoker is not None:
        # A checkpoint after every cycle, work or not: the task that would give us what we
        # wait for (a publisher in the same program) must get its turn.
        invoker()
        await anyio.sleep(0)
        return
    try:
        await anyio.to_thread.run_sync(wait, slice_ns, abandon_on_cancel=True)
    except BaseException:  # a cancellation (of either loop), KeyboardInterrupt: free it
        wake()
        raise


async def offer(publication: AsyncPublication, message: Buffer, timeout: float | None,
                reserved_value: int = 0) -> int:
    """``Publication.offer_async``: see there.  Every attempt carries ``reserved_value``."""
    attempt = publication._attempt
    policy = publication.policy
    # rate-limit paces these offers too, from the bucket the blocking ones draw on.
    bucket = publication._policy.bucket if publication._policy is not None else None
    if bucket is not None:
        return await _paced_offer(publication, bucket, message, timeout, reserved_value)
    # As the loops' own sends: a cancellation is taken before the append, never after it (the
    # caller would think the message was not sent); after it, only a schedule point.
    if _turn_is_due(publication):
        before, after = _checkpoints()
        await before()
        result = attempt(message, reserved_value)
        if result > 0:
            await after()
            return result
    else:
        result = attempt(message, reserved_value)
        if result > 0:
            return result
    return await _wait_for_credit(publication, message, result, time.monotonic_ns(),
                                  _timeout_ns(policy, timeout), reserved_value)


def _timeout_ns(policy: PolicySpec | None, timeout: float | None) -> int:
    """``offer_async``'s wait: ``timeout`` (s), else the policy's, else block's default."""
    if timeout is not None:
        return int(timeout * 1e9)
    return (policy.timeout_ns if policy is not None and policy.timeout_ns is not None
            else DEFAULT_BLOCK_TIMEOUT_NS)


async def _paced_offer(publication: AsyncPublication, bucket: TokenBucket, message: Buffer,
                       timeout: float | None, reserved_value: int) -> int:
    """``offer_async`` under ``rate-limit``: wait (cancellable) until the bucket lets the
    message go (the pacing is the rate asked for: ``timeout`` bounds only the wait for credit
    after it, and ``when-empty:refuse`` waits too, as ``offer_async`` always waits), then
    append it as any ``offer_async`` does, and spend the bucket."""
    length = len(message) if isinstance(message, bytes) else memoryview(message).nbytes
    due = _turn_is_due(publication)  # first: under another loop it says what is wrong
    paced = False
    invoker = publication._client.invoker
    while delay := bucket.delay_ns(time.monotonic_ns(), 1, length):
        if publication.is_closed or publication._client.is_closed:
            break  # the attempt below says CLOSED, and raises as any offer_async does
        if invoker is not None and invoker():  # an embedded driver runs while we wait
            await anyio.sleep(0)
        else:
            slice_ns = PACE_SLICE_NS if invoker is None else INVOKER_PACE_SLICE_NS
            await anyio.sleep(min(delay, slice_ns) / 1e9)
        paced = True
    # As the plain path: a cancellation before the append, and a schedule point every
    # SCHEDULE_EVERY calls (a wait on the bucket was one).
    checkpoints = _checkpoints() if due and not paced else None
    if checkpoints is not None:
        await checkpoints[0]()
    result = publication._attempt(message, reserved_value)
    if result <= 0:
        result = await _wait_for_credit(publication, message, result, time.monotonic_ns(),
                                        _timeout_ns(publication.policy, timeout),
                                        reserved_value)
    elif checkpoints is not None:
        await checkpoints[1]()
    if result > 0:
        bucket.take(1, length)
    return result


def _back_pressured(publication: AsyncPublication, waited_ns: int, *,
                    connected: bool) -> BackPressuredError:
    policy = publication.policy
    return BackPressuredError(publication.channel, publication.stream_id,
                              f"{policy if policy is not None else 'none'}, offer_async",
                              waited_ns / 1e9, connected=connected)


async def _wait_for_credit(publication: AsyncPublication, message: Buffer, result: int,
                           started_ns: int, timeout_ns: int, reserved_value: int) -> int:
    """``offer_async`` after an attempt that found no credit (``result``): park without
    blocking the event loop until an attempt appends it (with ``reserved_value``); the final
    result."""
    attempt = publication._attempt
    deadline_ns = started_ns + timeout_ns
    appender = publication._appender
    log_buffer = publication._log
    invoker = publication._client.invoker

    def wait(slice_ns: int) -> None:
        lib.ss_await_credit(appender, BLOCK_SPIN_NS, BLOCK_YIELD_NS, slice_ns)

    def wake() -> None:
        if not publication.is_closed:
            lib.ss_signal(log_buffer.publisher_signal(), log_buffer.publisher_waiters())

    while True:
        if result > 0:
            return result
        if result == _ADMIN_ACTION:
            result = attempt(message, reserved_value)
            continue
        if result == _CLOSED:
            # The client's lock may be held a whole request long by another thread: ask in a
            # worker thread, not on the event loop (CLOSED comes once; the hop costs nothing).
            cut_off = await anyio.to_thread.run_sync(publication.cut_off_error)
            if cut_off is not None:
                raise cut_off
            raise ClosedError(f"the publication of stream {publication.stream_id} on "
                              f"{publication.channel} is closed")
        if result not in (_BACK_PRESSURED, _NOT_CONNECTED):
            return result  # MAX_POSITION_EXCEEDED
        remaining = deadline_ns - time.monotonic_ns()
        if remaining <= 0:
            raise _back_pressured(publication, time.monotonic_ns() - started_ns,
                                  connected=result == _BACK_PRESSURED)
        await _park(wait, wake, min(remaining, PARK_SLICE_NS), invoker)
        await anyio.lowlevel.checkpoint_if_cancelled()
        result = attempt(message, reserved_value)


async def wait_durable(publication: AsyncPublication, position: int, timeout_ns: int) -> bool:
    """``Publication.wait_durable_async``: see there."""
    cells = publication._durable_cells
    assert cells is not None
    deadline_ns = time.monotonic_ns() + timeout_ns
    appender = publication._appender
    invoker = publication._client.invoker

    def wait(slice_ns: int) -> None:
        lib.ss_await_durable(appender, cells[0], position, BLOCK_SPIN_NS, BLOCK_YIELD_NS,
                             slice_ns)

    await anyio.lowlevel.checkpoint()
    while True:
        durable = publication.durable_position
        assert durable is not None
        if durable >= position:
            return True
        remaining = deadline_ns - time.monotonic_ns()
        if remaining <= 0 or publication.is_closed:
            return False
        await _park(wait, publication._wake_durable_waiters, min(remaining, PARK_SLICE_NS),
                    invoker)


async def receive(subscription: AsyncSubscription, handler: FragmentHandler, fragment_limit: int,
                  timeout: float | None) -> int:
    """``Subscription.receive_async``: see there."""
    # A cancellation before the poll, never after it: what the poll handed to the handler
    # is consumed, and the caller must learn of it.
    checkpoints = _checkpoints() if _turn_is_due(subscription) else None
    if checkpoints is not None:
        await checkpoints[0]()
    count, _ = subscription._poll(handler, fragment_limit)  # an event loop never parks
    if count:
        if checkpoints is not None:
            await checkpoints[1]()
        return count
    deadline_ns = None if timeout is None else time.monotonic_ns() + int(timeout * 1e9)
    while not subscription.is_closed:
        remaining = PARK_SLICE_NS if deadline_ns is None else deadline_ns - time.monotonic_ns()
        if remaining <= 0:
            return 0
        await wait_for_data(subscription, remaining)
        count, _ = subscription._poll(handler, fragment_limit)  # an event loop never parks
        if count:
            return count
    return 0


async def messages(subscription: AsyncSubscription, fragment_limit: int) -> AsyncIterator[bytes]:
    """``Subscription.messages``: see there."""
    # The messages polled and not yet yielded live on the subscription, so that a loop left
    # early (a break, a cancellation) leaves them to the next ``messages()``, not to nobody.
    pending = subscription._async_pending

    def keep(data: memoryview, _header: object) -> None:
        pending.append(bytes(data))

    while True:
        while pending:
            yield pending.popleft()
        if subscription.is_closed:
            return
        try:
            await receive(subscription, keep, fragment_limit, None)
        finally:
            if pending:  # the subscription's reads refuse to pass them until they are yielded
                subscription._before_read_due = True


async def poll_async(poll: Callable[[], int]) -> int:
    """``poll()`` (a poll of some log that returns what it handled) as a checkpoint of the
    running loop: a cancellation is taken before it, never after it, and the other tasks run
    after one that handled something.  For a caller's own read loop over large polls (an
    archive replay's): each call costs a checkpoint (~8 µs under trio)."""
    before, after = _checkpoints()
    await before()
    count = poll()
    if count:
        await after()
    return count


async def wait_for_data(subscription: AsyncSubscription, timeout_ns: int) -> None:
    """``Subscription.wait_for_data`` without blocking the event loop: park (in a worker
    thread, cancellable, the thread freed at once) until a frame is committed at one of its
    images' positions, for at most ``timeout_ns`` (and :data:`PARK_SLICE_NS`), or run one
    embedded duty cycle."""
    if subscription.is_closed:
        await anyio.lowlevel.checkpoint()
        return

    def wait(slice_ns: int) -> None:
        subscription.wait_for_data(slice_ns, 0)

    await _park(wait, subscription._wake_waiters, min(max(timeout_ns, 0), PARK_SLICE_NS),
                subscription._client.invoker)
