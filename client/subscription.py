"""Subscription: receiving a stream, one :class:`~slipstream.client.image.Image` per session.

A subscription has one :class:`Image` per publication session it receives (for IPC, the shared
log of the stream), and reads them in turn: ``poll(handler, limit)`` without blocking,
``receive`` waiting on a futex in the logs, ``poll_batch`` many messages in place,
``controlled_poll`` asking the handler per message (Aeron's controlled poll).  Images come and
go on the client conductor thread; their logs are unmapped from the polling thread.

The ``data`` view and ``header`` passed to a handler are valid only during the call (as in
Aeron): copy what you keep.  A :class:`MessageBatch` is valid until the next poll.
"""

from __future__ import annotations

import operator
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from slipstream.client import control
from slipstream.client._native import ffi, lib
from slipstream.client.closing import ClosedOnExit
from slipstream.client.errors import InvalidArgumentError, UsageError
from slipstream.client.idle import SpinThenPark
from slipstream.client.idle import progress as idle_progress
from slipstream.client.image import Image  # users import Image from here too
from slipstream.client.logbuffer import LogBuffer
from slipstream.client.messages import ControlledFragmentHandler, FragmentHandler, MessageBatch
from slipstream.client.owner import ResourceOwner, call_handler

# A parked receive re-checks its images at least this often.  Image changes wake it at once
# (through the eventcounts), so this is a safety net; each wake-up of an idle vCPU costs
# hundreds of µs of CPU here, so it is rare.
_PARK_SLICE_NS = 1_000_000_000


def _check_fragment_limit(fragment_limit: int) -> None:
    """A wait for messages that may take none would spin until its timeout (poll may)."""
    if fragment_limit < 1:
        raise InvalidArgumentError("fragment_limit", f"{fragment_limit}: a wait for messages "
                                                     f"needs at least 1")


class Subscription(ClosedOnExit):
    """Receives a stream: ``poll`` (non-blocking), ``receive`` (waits), ``poll_batch``."""

    def __init__(self, client: ResourceOwner, channel: str, stream_id: int, registration_id: int,
                 on_available_image: Callable[[Image], object] | None = None,
                 on_unavailable_image: Callable[[Image], object] | None = None) -> None:
        """``client``: the client conductor that makes it (Client.add_subscription)."""
        self.channel = channel
        self.stream_id = stream_id
        self.registration_id = registration_id
        self.on_available_image = on_available_image
        self.on_unavailable_image = on_unavailable_image
        self._client = client
        self._async_turns = 0  # calls of the async API (aio.py)
        #: Polled by ``messages()`` and not yet yielded (aio.py).
        self._async_pending: deque[bytes] = deque()
        self._images: tuple[Image, ...] = ()
        self._retired: list[Image] = []
        #: A read has rare work first (_before_read): retired images, or messages a
        #: ``messages()`` loop left.  One flag, so that a poll pays one attribute check.
        self._before_read_due = False
        self._round_robin = 0
        self._closed = False
        self._driver_lost = False
        self._images_changed = threading.Condition()
        self._spin_ns = client.idle_spin_ns
        # Polls that moved nothing; past the spins they wait for a frame (an embedded
        # driver's client yields instead: a park would stop the driver that brings it).
        self._idle = SpinThenPark(client.spins_before_yield,
                                  None if client.invoker is not None else self._idle_wait)
        self._readers: Any = None  # ffi.new("ss_reader_t[]"), built when first waited on
        self._readers_for: tuple[Image, ...] | None = None

    def _new_image(self, log: LogBuffer, position_counter_id: int, join_position: int,
                   correlation_id: int, source_identity: str,
                   channel_key: str | None) -> Image:
        # A spy reads a publication's log in place: its sender moves pub-lmt behind the spy.
        doorbell = (control.SENDER_DOORBELL if self.channel.startswith("aeron-spy:")
                    else control.RECEIVER_DOORBELL)
        return Image(log, self._client.counters.address(position_counter_id),
                     join_position=join_position, correlation_id=correlation_id,
                     source_identity=source_identity, channel_key=channel_key,
                     subscription=self,
                     doorbell_fd=self._client.doorbell_fd(self.channel, doorbell))

    @property
    def images(self) -> tuple[Image, ...]:
        """The images currently available (an immutable snapshot)."""
        return self._images

    def image_by_session_id(self, session_id: int) -> Image | None:
        """The available image of session ``session_id`` (None: none now; Aeron's
        ``Subscription.imageBySessionId``)."""
        return next((image for image in self._images if image.session_id == session_id), None)

    @property
    def is_connected(self) -> bool:
        return bool(self._images)

    @property
    def is_closed(self) -> bool:
        return self._closed

    def add_destination(self, endpoint_channel: str) -> None:
        """Receive this subscription's streams on ``endpoint_channel`` too
        (``aeron:udp?endpoint=HOST:PORT``, or a multicast group ``aeron:udp?endpoint=GROUP:PORT|
        interface=IF``): the subscription's channel is ``control-mode=manual``, a
        multi-destination subscription (Aeron's ``Subscription.addDestination``).  A stream
        that arrives on several destinations is one image, each message once.  Destinations
        belong to the channel's receive endpoint, so every subscription of the same channel
        receives on them.  Returns once the driver opened its socket (its receiver thread
        reads it, and mds-destinations counts it, from its next duty cycle);
        ChannelRejectedError names the part it refused (another control mode, a destination
        it has, another key, a host that does not resolve, a 17th destination),
        ResourceError when the port cannot be bound."""
        self._client.destination_request(control.ADD_RCV_DESTINATION, self, endpoint_channel)

    def remove_destination(self, endpoint_channel: str) -> None:
        """Stop receiving on ``endpoint_channel``, a destination :meth:`add_destination`
        added (ChannelRejectedError if it is not one): its status messages and NAKs stop
        going back that way.  Returns once the driver took the removal; its receiver thread
        stops reading the socket and closes it (and mds-destinations follows) at its next
        duty cycle.  Adding the same destination again at once takes that socket back, so
        its port is never found in use."""
        self._client.destination_request(control.REMOVE_RCV_DESTINATION, self,
                                          endpoint_channel)

    def poll(self, handler: FragmentHandler, fragment_limit: int = 10) -> int:
        """Deliver up to ``fragment_limit`` fragments across images without blocking; returns
        the number of whole messages handed to ``handler(data, header)``.  Raises
        :class:`DriverNotRunningError` once the client lost its driver."""
        count, moved = self._poll(handler, fragment_limit)
        if not moved:
            self._idle.idle()
        else:
            idle_progress()
        return count

    def _poll(self, handler: FragmentHandler, fragment_limit: int) -> tuple[int, bool]:
        """:meth:`poll` without the idle strategy (the async API's polls, on the thread of
        an event loop, which must never park): (messages handled, whether any image moved)."""
        if self._driver_lost:
            raise self._client.driver_lost_error()
        if self._before_read_due:
            self._before_read()
        images = self._images
        if len(images) == 1:
            image = images[0]
            before = image._position
            count = image.poll(handler, fragment_limit)
            moved = count or image._position != before  # a fragment or padding is progress
        else:
            before = sum(image._position for image in images)
            count = 0
            start = self._round_robin = (self._round_robin + 1) % max(1, len(images))
            for i in range(len(images)):
                count += images[(start + i) % len(images)].poll(handler, fragment_limit - count)
                if count >= fragment_limit:
                    break
            moved = count or sum(image._position for image in images) != before
        return count, bool(moved)

    def controlled_poll(self, handler: ControlledFragmentHandler,
                        fragment_limit: int = 10) -> int:
        """Aeron's ``Subscription.controlledPoll``: :meth:`Image.controlled_poll` on each image
        in turn (the first one rotates, as in :meth:`poll`) until ``fragment_limit``
        fragments; ``handler(data, header)`` returns a :class:`ControlledPollAction` per whole
        message.  An ABORT or BREAK stops the read of its image only; the next image is read
        as in Aeron.  Returns the number of messages consumed.  Raises
        :class:`DriverNotRunningError` once the client lost its driver."""
        if self._driver_lost:
            raise self._client.driver_lost_error()
        if self._before_read_due:
            self._before_read()
        images = self._images
        before = sum(image._position for image in images)
        count = 0
        start = self._round_robin = (self._round_robin + 1) % max(1, len(images))
        for i in range(len(images)):
            count += images[(start + i) % len(images)].controlled_poll(handler,
                                                                       fragment_limit - count)
            if count >= fragment_limit:
                break
        if not count and sum(image._position for image in images) == before:
            self._idle.idle()  # a fragment or padding is progress; an ABORT alone is not
        else:
            idle_progress()
        return count

    def poll_batch(self, max_messages: int = 4096) -> MessageBatch | None:
        """Many whole messages in one call, in place (see :class:`MessageBatch`), from one
        image; None when no image has anything."""
        if self._driver_lost:
            raise self._client.driver_lost_error()
        if self._before_read_due:
            self._before_read()
        images = self._images
        if len(images) == 1:  # the common case, without the loop below
            image = images[0]
            before = image._position
            batch = image.poll_batch(max_messages)
            moved = batch is not None or image._position != before  # padding is progress
        else:
            before = sum(image._position for image in images)
            batch = None
            for _ in range(len(images)):
                self._round_robin = (self._round_robin + 1) % len(images)
                batch = images[self._round_robin].poll_batch(max_messages)
                if batch is not None:
                    break
            moved = batch is not None or sum(image._position for image in images) != before
        if not moved:
            self._idle.idle()
        else:
            idle_progress()
        return batch

    def receive(self, handler: FragmentHandler, fragment_limit: int = 10,
                timeout: float | None = None) -> int:
        """Like :meth:`poll`, but wait up to ``timeout`` seconds (None: forever) for a message.

        Waiting spins briefly (``Client.connect(idle_spin_ns=...)``), which keeps latency low
        while traffic flows, then parks on a futex in the log, which costs no CPU.  Returns the
        number of messages handled, 0 on timeout; raises :class:`DriverNotRunningError` once
        the client lost its driver (a receive waiting then is woken).  With an embedded
        driver (invoker mode) it runs the driver's duty cycle instead of parking: nothing
        else would move the data, so it yields the CPU only as :meth:`poll` does.
        """
        _check_fragment_limit(fragment_limit)
        if timeout is not None and (type(timeout) is not float
                                    or not 0.0 <= timeout <= control.MAX_TIMEOUT_S):
            timeout = control.check_timeout("timeout", timeout)  # the rare forms, or refused
        count = self.poll(handler, fragment_limit)
        if count:
            return count
        deadline = None if timeout is None else time.monotonic_ns() + int(timeout * 1e9)
        invoker = self._client.invoker
        if invoker is not None:
            while not self._closed:
                invoker()
                # An empty poll gives the CPU up past spins_before_yield in a row (the
                # client's one idle rule): a peer process may share this core.
                count = self.poll(handler, fragment_limit)
                if count:
                    return count
                if deadline is not None and time.monotonic_ns() >= deadline:
                    return 0
            return 0
        spin_ns = self._spin_ns  # spin once per wait; later slices only park
        while not self._closed:
            remaining = _PARK_SLICE_NS if deadline is None else deadline - time.monotonic_ns()
            if remaining <= 0:
                return 0
            self.wait_for_data(min(remaining, _PARK_SLICE_NS), spin_ns)
            spin_ns = 0
            count = self.poll(handler, fragment_limit)
            if count:
                return count
        return 0

    async def receive_async(self, handler: FragmentHandler, fragment_limit: int = 10,
                            timeout: float | None = None) -> int:
        """:meth:`receive` for a trio or asyncio task: waits for a message without blocking the
        event loop (in a worker thread, on the same futex), cancellable by the loop's own means
        (trio's cancel scopes, asyncio's ``Task.cancel()``).
        Returns the messages handled, 0 on timeout or once the subscription is closed; raises
        :class:`DriverNotRunningError` once the driver is lost.  See
        :mod:`slipstream.client.aio`."""
        from slipstream.client import aio  # anyio, asyncio: ~20 ms, paid only by who awaits

        _check_fragment_limit(fragment_limit)
        return await aio.receive(self, handler, fragment_limit,
                                 control.check_timeout("timeout", timeout))

    def messages(self, fragment_limit: int = 64) -> AsyncIterator[bytes]:
        """``async for message in subscription.messages():`` each message as ``bytes`` (a
        copy: it outlives the log), in order per image; ends when the subscription is closed,
        raises :class:`DriverNotRunningError` when the driver is lost.  A loop left early (a
        ``break``, a cancellation) leaves what its last poll took to the next ``messages()``
        loop of this subscription: until that loop has yielded them, ``poll``, ``poll_batch``,
        ``receive`` and ``receive_async`` raise :class:`UsageError` rather than read past
        them."""
        from slipstream.client import aio  # anyio, asyncio: ~20 ms, paid only by who awaits

        _check_fragment_limit(fragment_limit)
        return aio.messages(self, fragment_limit)

    def _wake_waiters(self) -> None:
        """Wake whatever waits on this subscription (a cancelled task's worker thread)."""
        with self._images_changed:
            self._images_changed.notify_all()
            for image in self._images:
                lib.ss_signal(image.signal, image.waiters)

    def wait_for_data(self, timeout_ns: int, spin_ns: int | None = None) -> bool:
        """Block until a frame is committed at some image's position, or ``timeout_ns``;
        spin for ``spin_ns`` first (default: the client's ``idle_spin_ns``).  Returns whether
        one is.  With an embedded driver (invoker mode) it runs the driver's duty cycle while
        it waits, as :meth:`receive` does (``spin_ns`` does not apply: a park would stop the
        driver that brings the data, and the heartbeat attached processes watch), and raises
        :class:`DriverNotRunningError` once that driver is gone, as a poll would."""
        try:
            timeout_ns = operator.index(timeout_ns)
        except TypeError:
            timeout_ns = -1
        if timeout_ns < 0:  # C takes a negative as forever
            raise InvalidArgumentError("timeout_ns", "not a number of ns >= 0")
        invoker = self._client.invoker
        if invoker is None:
            return self._await_frames(timeout_ns, spin_ns)
        deadline = time.monotonic_ns() + timeout_ns
        while True:
            worked = invoker()
            if self._await_frames(0, 0):
                return True
            if self._driver_lost:
                raise self._client.driver_lost_error()
            if self._closed or time.monotonic_ns() >= deadline:
                return False
            if not worked:
                os.sched_yield()

    def _idle_wait(self, yield_ns: int, park_ns: int) -> None:
        """The idle strategy's wait (:class:`SpinThenPark`): a frame at some image, or
        ``park_ns``, whichever comes first, giving the CPU up between looks for ``yield_ns``
        first."""
        self._await_frames(park_ns, yield_ns)

    def _await_frames(self, timeout_ns: int, spin_ns: int | None) -> bool:
        """:meth:`wait_for_data` without running an embedded driver."""
        images = self._images
        if not images:
            with self._images_changed:
                if not self._images and not self._driver_lost:
                    self._images_changed.wait(timeout_ns / 1e9)
            return bool(self._images)
        if self._readers_for is not images:
            # What C watches, built once per set of images: waiting allocates nothing.
            self._readers = readers = ffi.new("ss_reader_t[]", len(images))
            for reader, image in zip(readers, images, strict=False):
                image._describe(reader)
            self._readers_for = images
        return bool(lib.ss_await_frames(self._readers, len(self._readers),
                                        self._spin_ns if spin_ns is None else spin_ns,
                                        timeout_ns))

    # -- image life cycle (called from the client conductor thread) ---------------------------
    def _add_image(self, image: Image) -> None:
        with self._images_changed:
            if self._closed:
                # close() ran after the client looked: nothing can poll this image (it was
                # never visible), and the linger that unmaps the others may be over already.
                image._go()
                image.close()
                return
            previous, self._images = self._images, (*self._images, image)
            self._images_changed.notify_all()
        for parked_on in previous:  # a receive parked on the old images must wait on all now
            lib.ss_signal(parked_on.signal, parked_on.waiters)
        call_handler("image handler", self.on_available_image, image, image)

    def _remove_image(self, correlation_id: int,
                      lost: tuple[int, int] | None = None) -> Image | None:
        with self._images_changed:
            for image in self._images:
                if image.correlation_id == correlation_id:
                    image.lost_range = lost
                    image._record_end()
                    image._go()
                    self._images = tuple(i for i in self._images if i is not image)
                    # Wake a receiver parked on this image so it notices; while the log is
                    # surely mapped (the polling thread unmaps retired images).
                    lib.ss_signal(image.signal, image.waiters)
                    # Unmapped later from the polling thread, never under a running poll.
                    self._retired.append(image)
                    self._before_read_due = True
                    break
            else:
                return None
        call_handler("image handler", self.on_unavailable_image, image, image)
        return image

    def _lose_driver(self) -> None:
        """The client lost its driver: wake a parked receive so that it raises."""
        with self._images_changed:
            self._driver_lost = True
            for image in self._images:
                lib.ss_signal(image.signal, image.waiters)
            self._images_changed.notify_all()

    def _before_read(self) -> None:
        """A read's rare work first: release retired images; refuse to read past messages a
        ``messages()`` loop left (they would be skipped, and read out of order later)."""
        if self._async_pending:
            raise UsageError(
                f"{len(self._async_pending)} messages that a messages() loop polled and did "
                f"not yield (it was left early) come first: read them with messages()")
        self.release_gone_images()

    def release_gone_images(self) -> None:
        """Unmap the logs of the images that went (unavailable, or the subscription closed).
        A read does it first, on the reading thread; a thread that uses the images without
        polling them (a planner that peeks and moves positions) calls this, or their logs
        stay mapped, their files unlinked, for as long as the subscription lives.  Call it
        from the thread that reads the images, never under one of its polls."""
        with self._images_changed:
            retired, self._retired = self._retired, []
            self._before_read_due = bool(self._async_pending)
        for image in retired:
            image.close()

    def close(self) -> None:
        """Stop receiving: the driver drops this subscriber's position (it no longer holds
        publishers back)."""
        if self._closed:
            return
        self._closed = True
        with self._images_changed:
            images, self._images = self._images, ()
            self._images_changed.notify_all()
            for image in images:  # a receive parked on an image's futex returns now
                image._go()
                lib.ss_signal(image.signal, image.waiters)
            self._retired.extend(images)
            self._before_read_due = True
        # Its images' logs are unmapped after the client's resource linger, not here: close()
        # may come from any thread (an image handler too) while a poll runs in C.
        self._client.release_subscription(self.registration_id, self.release_gone_images)

    def __repr__(self) -> str:
        return (f"Subscription(channel={self.channel!r}, stream_id={self.stream_id}, "
                f"images={len(self._images)})")

