"""ClientConductor: a client's state and its side of the conversation with the driver (Aeron's
``ClientConductor``).

It holds what the client has (publications, subscriptions and their images, counters), waits
for the answers to the commands the driver proxy sends (:mod:`.driver_proxy`), applies the
driver's events the driver events adapter reads (:mod:`.driver_events`), and runs the client's
conductor thread, which applies them while the application thread offers and polls without
ever touching the socket.  What the keepalive thread (C, :meth:`CountersFile.
start_heartbeat_keeper`) finds wrong comes through a pipe.  It makes the publications and
subscriptions, which know it by :class:`~slipstream.client.owner.ResourceOwner`; the
application reaches it through :class:`~slipstream.client.client.Client`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import zmq

from slipstream.client import control
from slipstream.client._native import lib
from slipstream.client.channel import PolicySpec
from slipstream.client.counters import Counter, CountersFile
from slipstream.client.driver_events import DriverEventsAdapter
from slipstream.client.driver_proxy import DriverProxy
from slipstream.client.errors import (
    ChannelRejectedError,
    ClosedError,
    DriverNotRunningError,
    DriverTimeoutError,
    InvalidArgumentError,
    RegistrationError,
    UsageError,
)
from slipstream.client.image import Image
from slipstream.client.logbuffer import LogBuffer
from slipstream.client.owner import Handle
from slipstream.client.policy import BackPressureEpisode
from slipstream.client.publication import Publication
from slipstream.client.subscription import Subscription

log = logging.getLogger("slipstream.client")
_P = TypeVar("_P", bound=Publication)

#: How long a closed stream's logs stay mapped by default (Aeron's resource linger, 3 s):
#: another thread may still be inside offer_batch, try_claim or a poll, which run in C
#: without the GIL and must never touch an unmapped page; they see CLOSED from the flag set
#: at close.  A client whose every stream is used and closed by one thread may pass
#: ``resource_linger_s=0`` to :meth:`Client.connect` (the client's own close() keeps this).
#: A count of the threads inside C per log would need an atomic add and subtract on every
#: offer: 12 ns here, against a 41 ns offer from Python and a 15 ns one from C.
RESOURCE_LINGER_S = 3.0
#: How often the client's conductor thread looks for the driver's events even when zmq's FD
#: did not say there are any, s: a safety net only (each look takes the GIL from the
#: application's thread).
EVENTS_SAFETY_NET_S = 5.0
#: Seconds close() waits for the conductor thread to end (it ends at its next look, unless a
#: handler it runs is slow); the thread closes what is left itself if it is still running.
THREAD_JOIN_TIMEOUT_S = 2.0
#: What a request that releases a resource ignores: the driver did not answer, is gone (also
#: noticed while it waited), no longer knows the resource, or the client closed meanwhile (a
#: handler its wait ran): close() releases everything anyway.
_RELEASE_ERRORS = (DriverTimeoutError, DriverNotRunningError, RegistrationError, ClosedError)
#: The requests a closing client still makes.
_RELEASES = frozenset({control.REMOVE_PUBLICATION, control.REMOVE_SUBSCRIPTION,
                       control.REMOVE_COUNTER, control.CLOSE_CLIENT})


def _durable_counter_ids(reply: dict) -> tuple[int, int] | None:
    """A durable= publication's pub-durable and durable-rcv counter ids from its
    PUBLICATION_READY (None without)."""
    if "durable_counter_id" not in reply:
        return None
    return int(reply["durable_counter_id"]), int(reply["durable_receivers_counter_id"])


def _after_linger(release: Callable[[], None], linger_s: float | None = None) -> None:
    """Run ``release`` (an unmapping, a close) on a timer thread after ``linger_s`` seconds
    (None: :data:`RESOURCE_LINGER_S`), once no thread can still be inside C on what it
    releases."""
    timer = threading.Timer(RESOURCE_LINGER_S if linger_s is None else linger_s, release)
    timer.daemon = True
    timer.start()


#: The stages of a client's conductor thread (ClientConductor._thread_stage).
_THREAD_NEW, _THREAD_RUNNING, _THREAD_ENDED, _THREAD_SKIPPED = range(4)



class _OwnedRLock:
    """A reentrant lock that can say whether the calling thread holds it, which
    ``threading.RLock`` answers only through a private method."""

    __slots__ = ("_depth", "_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None  # the holding thread's ident; None while free
        self._depth = 0  # how many times the holder entered it

    def __enter__(self) -> _OwnedRLock:
        self._lock.acquire()
        # An exception raised here (a KeyboardInterrupt from a signal handler) would leave the
        # lock held with no ``__exit__`` to release it: release it before the exception goes
        # on.  What remains is a signal taken as ``acquire`` returns, before the ``try``, the
        # window ``with`` on a ``threading.RLock`` has too.
        try:
            self._owner = threading.get_ident()
            self._depth += 1
        except BaseException:
            if self._depth == 0:
                self._owner = None
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def held_by_this_thread(self) -> bool:
        """Whether the calling thread holds the lock.  Read without the lock: only the
        holder ever writes its own ident here, so another thread never sees its own."""
        return self._owner == threading.get_ident()

class ClientConductor:
    """A client's resources and its conversation with its driver (module doc).  Thread-safe:
    its lock is held while the driver's messages are read and applied, by the conductor
    thread or by a request waiting for its answer."""

    def __init__(self, directory: Path, *, request_timeout: float, idle_spin_ns: int,
                 spins_before_yield: int | None, invoker: Callable[[], int] | None,
                 resource_linger_s: float) -> None:
        """For the driver of ``directory``, as :meth:`Client.connect
        <slipstream.client.client.Client.connect>` says (which checks the other arguments);
        opens the socket, which :meth:`connect` uses."""
        self.directory = directory
        #: How long a publication or subscription this client's application closes keeps
        #: its logs mapped, s (0: unmapped by close() itself; see ``Client.connect``).
        self.resource_linger_s = control.check_timeout("resource_linger_s", resource_linger_s,
                                                       forever=False)
        # Held while publications are cut off and while a log is unmapped at close: the
        # conductor thread's cut-off wakes parked offers on a log's futex, which must
        # still be mapped.
        self._unmap_lock = threading.Lock()
        #: The embedded driver's duty cycle this client runs while it waits (invoker mode).
        self.invoker = invoker
        self.idle_spin_ns = idle_spin_ns
        if spins_before_yield is not None and (
                not isinstance(spins_before_yield, int) or not 0 <= spins_before_yield < 2**31):
            raise InvalidArgumentError("spins_before_yield", f"must be None or an int in "
                                                             f"0..2**31-1, not "
                                                             f"{spins_before_yield!r}")
        #: The process that connected: a forked child shares the parent's socket and locks
        #: (one held at the fork stays held), so it may not use this client.
        self._pid = os.getpid()
        self.spins_before_yield = spins_before_yield
        self._request_timeout = request_timeout
        self._lock = _OwnedRLock()
        self._closed = False
        self._driver_lost: str | None = None
        self._driver_still_running = False  # lost, but a driver serves the directory
        self._driver_timeout_ns = 0  # the driver's driver_timeout, from its CONNECT reply
        self._publications: dict[int, Publication] = {}
        self._subscriptions: dict[int, Subscription] = {}
        self._counters: dict[int, Counter] = {}  # by registration id
        self._pending: dict[int, dict[str, Any]] = {}
        self._reply_hooks: dict[int, Callable[[dict[str, Any]], object]] = {}
        #: Requests this client stopped waiting for (DriverTimeoutError), by correlation id:
        #: a late answer is dropped, and what it made is released (nothing holds it here).
        self._abandoned: set[int] = set()
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(control.conductor_endpoint(directory))
        self._fd = self._socket.getsockopt(zmq.FD)
        self._proxy = DriverProxy(self._socket)
        self._events = DriverEventsAdapter(self._socket, self)
        # What the keepalive thread found wrong, and close()'s wake-up, for the conductor thread.
        self._notices, self._notices_in = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop_keeper: Callable[[], None] = lambda: None
        # A request waits for its answer and for what the keepalive thread finds: it holds
        # the lock, and only a holder of the lock reads the pipe.
        self._request_poller = zmq.Poller()
        self._request_poller.register(self._socket, zmq.POLLIN)
        self._request_poller.register(self._notices, zmq.POLLIN)
        self._closing = False
        # The conductor thread and its stage (_THREAD_*, under the lock): once RUNNING it owns
        # the read end of the notices pipe, and closes it as it ends; the socket too if a
        # close() left that to it (_left_to_thread: one that could not wait for it).
        self._thread: threading.Thread | None = None
        self._thread_stage = _THREAD_NEW
        self._left_to_thread = False
        self._closing_thread: threading.Thread | None = None
        self._torn_down = False
        self._close_done = threading.Event()
        self._doorbells: dict[str, socket.socket] = {}
        #: Image logs handed to their subscriptions before their pages were mapped in
        #: place: the conductor thread maps them, a step at a time, between its events.
        self._populating: collections.deque[LogBuffer] = collections.deque()
        self.counters: CountersFile
        self.client_id = 0

    def connect(self) -> None:
        """CONNECT; then map the counters, start the keepalive thread and the conductor
        thread.  Whatever fails or interrupts it, everything is let go before it raises."""
        try:
            reply = self._request(control.CONNECT, self._proxy.connect, connecting=True)
            self.client_id = reply["client_id"]
            self._driver_timeout_ns = reply["driver_timeout_ns"]
            self.counters = CountersFile(reply["counters_file"])
            # An embedded driver beats only while the application runs it: its clients never
            # time it out (it lives as long as they do), they only watch its lock.
            self._stop_keeper = self.counters.start_heartbeat_keeper(
                reply["heartbeat_counter_id"], self.client_id,
                interval_ns=reply["keepalive_interval_ns"],
                driver_timeout_ns=0 if self.invoker is not None else reply["driver_timeout_ns"],
                lock_path=self.directory / control.LOCK_FILE, notify_fd=self._notices_in)
            self._thread = threading.Thread(target=self._run_conductor, daemon=True,
                                            name=f"slipstream-client-{self.client_id}")
            self._thread.start()
        except BaseException:  # an error, or an interrupt anywhere in here
            with self._lock:
                self._closed = True
                thread_running = self._thread_stage != _THREAD_NEW
            self._stop_keeper()
            if thread_running:  # the thread owns the pipe's read end: end it as close() does
                self._end_threads()
            else:  # none started, or it will see _closed first and touch nothing
                if hasattr(self, "counters"):  # nothing was handed out: no linger needed;
                    self.counters.close()  # first: it stops a keeper that writes the pipe
                self._socket.close(0)
                os.close(self._notices)
                os.close(self._notices_in)
            raise

    # -- requests ------------------------------------------------------------------------------
    def _request(self, kind: str, send: Callable[[], int], *, connecting: bool = False,
                 on_reply: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
        """Send a ``kind`` command (``send()``: the driver proxy's, which returns its
        correlation id) and wait for its answer, applying events that arrive meanwhile.
        ``on_reply`` runs (under the lock) as soon as the answer is read."""
        self._check_process()
        with self._lock:
            self._check_open()
            if self._closing and kind not in _RELEASES:
                raise ClosedError("the client is closing")
            deadline = time.monotonic() + self._request_timeout
            correlation_id = send()  # only a holder of the lock reads its answer
            if on_reply is not None:
                self._reply_hooks[correlation_id] = on_reply
            try:
                reply = self._await_reply(kind, correlation_id, deadline, connecting)
                self._await_images(reply.get("_images_until", 0), deadline)
            except DriverTimeoutError:
                self._reply_hooks.pop(correlation_id, None)
                self._abandoned.add(correlation_id)
                raise
            finally:
                # zmq's FD is edge-triggered: after a send, only a read to EAGAIN makes it
                # say again that messages came (the conductor thread waits on it).
                with contextlib.suppress(zmq.ZMQError):
                    self._events.receive()
        if reply["type"] == control.ERROR:
            code = reply.get("code", control.ERR_GENERIC)
            if code == control.ERR_INVALID_CHANNEL:
                raise ChannelRejectedError(reply["message"], code, reply.get("uri", ""),
                                           reply.get("part", ""), reply.get("problem", ""))
            raise RegistrationError(reply["message"], code)
        return reply

    def _await_images(self, until: int, deadline: float) -> None:
        """Read on (under the lock) until ``until`` AVAILABLE_IMAGE events were read: the
        driver queues an answer's images right behind it (``images_following``), and a call
        returns with them in place (a poll right after add_subscription found no image now
        and then).  Gives up quietly at the deadline: they then come as events."""
        while (self._events.images_seen < until and self._driver_lost is None
               and not self._closed):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            ready = dict(self._request_poller.poll(int(min(remaining, 0.1) * 1000)))
            if self._notices in ready:  # the driver may be gone: they would never come
                self._read_notice()
            if self._socket in ready:
                self._events.receive()

    def _await_reply(self, kind: str, correlation_id: int, deadline: float,
                     connecting: bool) -> dict[str, Any]:
        """The answer to request ``correlation_id`` (a ``kind`` command; under the lock),
        read by the deadline (time.monotonic()), applying the events that come first."""
        while True:
            reply = self._pending.pop(correlation_id, None)
            if reply is not None:
                return reply
            if self._driver_lost is not None:  # told while waiting (DRIVER_SHUTDOWN)
                raise self.driver_lost_error()
            if self._closed:  # a handler run by this wait closed the client
                raise ClosedError("the client is closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if connecting and control.driver_holds_lock(self.directory):
                    refusal = control.socket_refusal(self.directory)
                    if refusal is not None:  # its socket drops us unread: waiting is no use
                        raise refusal
                    holder = control.lock_holder_pid(self.directory)
                    if holder == os.getpid() and self.invoker is None:
                        # An embedded driver of this very process: it has no thread, and
                        # this wait does not run it.
                        cause = ("it is embedded in this process (MediaDriver.embedded), and "
                                 "an embedded driver answers only while its application calls "
                                 "its do_work(): connect with invoker=driver.do_work")
                    else:
                        embedded_in = "" if holder is None else f" (pid {holder})"
                        cause = ("it is stopped, stuck or overloaded (`slipstream stat --dir "
                                 f"{self.directory}` shows how old its heartbeat is); if it "
                                 f"is embedded in an application{embedded_in}, that "
                                 "application is not calling its do_work(), and an embedded "
                                 "driver answers only then")
                    raise DriverTimeoutError(
                        f"the driver in {self.directory} holds its lock but did not answer "
                        f"within {self._request_timeout} s: {cause}")
                if connecting:
                    raise DriverNotRunningError(
                        str(self.directory),
                        f"the driver did not answer within {self._request_timeout} s")
                raise DriverTimeoutError(
                    f"the driver in {self.directory} did not answer {kind} "
                    f"within {self._request_timeout} s")
            if self.invoker is not None:  # the driver answers only when it is run
                self._read_notice()  # a non-blocking read: the lock is ours
                if self._driver_lost is not None:
                    raise self.driver_lost_error()
                worked = self.invoker()
                if self._socket.poll(0, zmq.POLLIN):
                    self._events.receive()
                elif not worked:
                    os.sched_yield()
            else:
                ready = dict(self._request_poller.poll(int(min(remaining, 0.1) * 1000)))
                if self._notices in ready:  # the driver may be gone: no answer would come
                    self._read_notice()
                if self._socket in ready:
                    self._events.receive()

    # -- the driver's messages (DriverEventsListener; under the lock) ------------------------
    @property
    def closed(self) -> bool:
        """close() ran: the events adapter reads nothing more."""
        return self._closed

    def on_response(self, message: dict[str, Any]) -> None:
        """An answer: kept for the request waiting for it; a late one to an abandoned request
        releases what it made."""
        correlation_id = message.get("correlation_id", 0)
        if correlation_id in self._abandoned:
            self._abandoned.discard(correlation_id)
            self._release_abandoned(message)
            return
        hook = self._reply_hooks.pop(correlation_id, None)
        if hook is not None:
            hook(message)
        following = message.get("images_following")
        if isinstance(following, int) and not isinstance(following, bool):
            message["_images_until"] = self._events.images_seen + following
        self._pending[correlation_id] = message

    def on_back_pressure_episode(self, message: dict[str, Any]) -> None:
        publication = self._publications.get(message.get("registration_id", 0))
        if publication is not None:
            publication._on_episode(message)

    def on_publication_refused(self, message: dict[str, Any]) -> None:
        publication = self._publications.get(message.get("registration_id", 0))
        if publication is not None:
            publication._on_refused(message)

    def on_client_timeout(self) -> None:
        self._lose_driver("it timed this client out: no keepalive within "
                          "client_liveness_timeout", still_running=True)

    def on_driver_shutdown(self, reason: str) -> None:
        self._lose_driver(reason)

    def _release_abandoned(self, reply: dict[str, Any]) -> None:
        """The late answer to a request this client gave up on (under the lock): what it made
        (a publication or subscription the application never got) is released at once, or
        it would hold its stream (a subscription nobody polls holds every publisher back)
        until the client closes.  The release's own answer is dropped as well."""
        release = {control.PUBLICATION_READY: control.REMOVE_PUBLICATION,
                   control.SUBSCRIPTION_READY: control.REMOVE_SUBSCRIPTION,
                   control.COUNTER_READY: control.REMOVE_COUNTER}.get(reply["type"])
        registration_id = reply.get("registration_id")
        if release is None or not isinstance(registration_id, int):
            return
        log.warning("the driver answered a request after this client gave up on it; "
                    "releasing what it made (registration %d)", registration_id)
        correlation_id = self._proxy.remove_now(release, registration_id)
        if correlation_id is not None:
            self._abandoned.add(correlation_id)

    def _run_conductor(self) -> None:
        """Thread: the driver's events, and what the keepalive thread found, until close;
        it closes the read end of the notices pipe as it ends.  The keepalives themselves are
        C's (:meth:`CountersFile.start_heartbeat_keeper`): a Python thread that woke for each
        would take the GIL from the application's thread twice a second, and on a small
        machine hand it back only a scheduler slice later."""
        lib.ss_name_thread(b"slipstream-client")
        with self._lock:
            if self._closed:  # closed before this thread's first step
                self._thread_stage = _THREAD_SKIPPED
                left_to_thread = self._left_to_thread
            else:
                self._thread_stage = _THREAD_RUNNING
                left_to_thread = None
        if left_to_thread is not None:
            if left_to_thread:  # a close() that could not wait for this thread
                os.close(self._notices)
                self._socket.close(0)
            return
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._notices, select.POLLIN)
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    self._read_notice()
                    self._events.receive()
                # Without the lock: the application reads the image meanwhile.
                populating = self._populate_step()
                # Events make the socket's FD readable; the timeout is a safety net only.
                with contextlib.suppress(OSError, ValueError):
                    poller.poll(0 if populating else EVENTS_SAFETY_NET_S * 1000)
        finally:
            with self._lock:
                self._thread_stage = _THREAD_ENDED
                left_to_thread = self._left_to_thread
            os.close(self._notices)
            if left_to_thread:
                self._socket.close(0)

    def _populate_step(self) -> bool:
        """(The conductor thread.)  A step of mapping the first image log left to map in
        place (one closed meanwhile has none left); whether any is left."""
        populating = self._populating
        if populating and not populating[0].populate_step():
            populating.popleft()
        return bool(populating)

    def _read_notice(self) -> None:
        """Under the lock: apply what the keepalive thread found, if it wrote anything (close()
        writes a zero byte to wake the conductor thread)."""
        try:
            notice = os.read(self._notices, 1)
        except BlockingIOError:
            return
        if self._closed:
            return
        if notice == bytes([lib.SS_KEEPER_DRIVER_EXITED]):
            self._lose_driver("the driver exited")
        elif notice == bytes([lib.SS_KEEPER_DRIVER_REPLACED]):
            self._lose_driver("the driver exited, and a new one took its directory",
                              still_running=True)
        elif notice == bytes([lib.SS_KEEPER_DRIVER_STOPPED]):
            # The keeper saw no heartbeat for driver_timeout; the heartbeat's age now says
            # nothing (a driver that stalled may beat again by the time this is read).
            self._lose_driver(f"the driver stopped: no heartbeat for "
                              f"{self._driver_timeout_ns / 1e9:g} s (driver_timeout)")

    def _lose_driver(self, reason: str, *, still_running: bool = False) -> None:
        """Cut off from the driver: offers return CLOSED from now on, and every other call
        (polls and waits too; a parked receive is woken) raises DriverNotRunningError
        (``still_running``: one that says to connect again, not to start a driver)."""
        if self._driver_lost is None:
            self._driver_still_running = still_running
            try:  # before is_closed says so: offers say CLOSED by then
                self._cut_off_publications()
            finally:  # whatever interrupts it: the keeper's notice is read only once
                self._driver_lost = reason
            self._stop_keeper()
            self._cut_off_resources()  # after: a woken receive raises with the reason
            log.error("the driver in %s %s: %s", self.directory,
                      "no longer serves this client" if still_running else "is gone", reason)

    def _cut_off_resources(self) -> None:
        """Offers return CLOSED and polls raise from now on; a parked receive is woken; the
        client's counters are closed (the driver frees them, or has)."""
        self._cut_off_publications()
        for counter in list(self._counters.values()):
            counter._mark_closed()
        for subscription in list(self._subscriptions.values()):
            subscription._lose_driver()

    def _cut_off_publications(self) -> None:
        with self._unmap_lock:
            for publication in list(self._publications.values()):
                publication._mark_closed()

    def driver_lost_error(self) -> DriverNotRunningError | ClosedError:
        """The error calls raise once the driver is gone (or the client closed with
        resources it could not release: an interrupted close())."""
        if self._driver_lost is None and self._closed:
            return ClosedError("the client is closed")
        return DriverNotRunningError(str(self.directory), self._driver_lost or "",
                                     still_running=self._driver_still_running)

    def cut_off_error(self) -> DriverNotRunningError | ClosedError | None:
        """Why an offer of this client said CLOSED, when the client is the reason: the driver
        went (:class:`DriverNotRunningError`) or the client closed (:class:`ClosedError`);
        None when the client is open and its publication alone was closed.  Losing the driver
        closes the publications before it marks the client: this looks under the client's
        lock, which shows the two together."""
        with self._lock:
            return self.driver_lost_error() if self.is_closed else None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the client is closed")
        if self._driver_lost is not None:
            raise self.driver_lost_error()

    def doorbell_fd(self, channel: str, name: str) -> int:
        """For a network channel (a spy's too), the fd of a socket connected to the driver's
        doorbell ``name`` (opened once per client); -1 for IPC (nothing to ring)."""
        if not channel.startswith(("aeron:udp", "aeron-spy:aeron:udp")):
            return -1
        with self._lock:
            if self._closing:  # its publication is closed as it is made: nothing to ring
                return -1
            doorbell = self._doorbells.get(name)
            if doorbell is None:
                doorbell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                doorbell.setblocking(False)
                try:
                    doorbell.connect(str(self.directory / name))
                except OSError as e:
                    doorbell.close()
                    raise DriverNotRunningError(str(self.directory),
                                                f"no doorbell {name}: {e.strerror}") from None
                self._doorbells[name] = doorbell
            return doorbell.fileno()

    # -- events --------------------------------------------------------------------------------
    def on_available_image(self, message: dict[str, Any]) -> None:
        subscription = self._subscriptions.get(message["subscription_registration_id"])
        if subscription is None or subscription.is_closed:
            return
        # On the conductor thread its pages are mapped after the image is handed over, so
        # that the subscriber may read as the image comes (a request's wait, on the
        # application's thread, maps them at once).
        behind = threading.current_thread() is self._thread
        try:
            log_buffer = LogBuffer(message["log_file"], behind=behind)
        except (OSError, ValueError) as e:
            # It may be gone already (a short-lived image): its UNAVAILABLE_IMAGE follows.
            log.info("could not map image %s: %s", message["log_file"], e)
            return
        image = subscription._new_image(log_buffer, message["subscriber_position_counter_id"],
                                        message["join_position"], message["correlation_id"],
                                        message.get("source_identity", ""),
                                        message.get("channel_key"))
        subscription._add_image(image)
        if behind and log_buffer.unpopulated:
            self._populating.append(log_buffer)

    def on_unavailable_image(self, message: dict[str, Any]) -> None:
        subscription = self._subscriptions.get(message["subscription_registration_id"])
        if subscription is not None:
            lost_from, lost_to = message.get("lost_from"), message.get("lost_to")
            subscription._remove_image(
                message["correlation_id"],
                (int(lost_from), int(lost_to)) if lost_from is not None and lost_to is not None
                else None)

    # -- resources (their arguments checked by Client) -------------------------------------------
    def add_publication(self, command: str, kind: type[_P], channel: str, stream_id: int,
                        policy: PolicySpec | None,
                        on_back_pressure: Callable[[BackPressureEpisode], object] | None,
                        ) -> _P:
        """Ask the driver for a publication (``command``: ADD_PUBLICATION or
        ADD_EXCLUSIVE_PUBLICATION) and map it as a ``kind``."""
        reply = self._request(command, lambda: self._proxy.add_publication(
            command, channel, stream_id))
        log_buffer = LogBuffer(reply["log_file"])
        publication = kind(self, channel, stream_id, reply["registration_id"], log_buffer,
                           reply["publication_limit_counter_id"],
                           self.doorbell_fd(channel, control.SENDER_DOORBELL),
                           policy=policy, drops_counter_id=reply.get("drops_counter_id"),
                           durable_counter_ids=_durable_counter_ids(reply))
        publication.on_back_pressure = on_back_pressure
        self._hold(self._publications, publication.registration_id, publication,
                   publication._mark_closed)
        return publication

    def add_subscription(self, channel: str, stream_id: int,
                         on_available_image: Callable[[Image], object] | None,
                         on_unavailable_image: Callable[[Image], object] | None,
                         ) -> Subscription:
        """Ask the driver for a subscription; its images come as events (those the driver
        has already right behind its answer, in place when this returns)."""
        subscription = Subscription(self, channel, stream_id, 0, on_available_image,
                                    on_unavailable_image)

        def register(reply: dict[str, Any]) -> None:
            # Runs as the answer is read, before the image events queued right behind it.
            if reply["type"] == control.SUBSCRIPTION_READY:
                subscription.registration_id = reply["registration_id"]
                self._subscriptions[subscription.registration_id] = subscription

        self._request(control.ADD_SUBSCRIPTION,
                      lambda: self._proxy.add_subscription(channel, stream_id),
                      on_reply=register)
        with self._lock:
            closing = self._closing or self._driver_lost is not None
        if closing:  # close() ran meanwhile (a handler this request ran, another thread)
            subscription.close()
            self._check_open()
            raise ClosedError("the client is closing")
        return subscription

    def add_counter(self, type_id: int, label: str, key: bytes) -> Counter:
        """Ask the driver for a counter of this client's."""
        reply = self._request(control.ADD_COUNTER,
                              lambda: self._proxy.add_counter(type_id, label, key))
        counter = Counter(self.counters, reply["counter_id"], reply["registration_id"],
                          type_id=type_id, label=label, key=key, release=self._release_counter)
        self._hold(self._counters, counter.registration_id, counter, counter._mark_closed)
        return counter

    def _hold(self, table: dict[int, Any], registration_id: int, resource: object,
              mark_closed: Callable[[], None]) -> None:
        """Keep a new ``resource`` in ``table``; if close() ran meanwhile (or the driver
        went), ``mark_closed()`` it and raise instead."""
        with self._lock:
            if self._closing or self._driver_lost is not None:
                mark_closed()
                self._check_open()
                raise ClosedError("the client is closing")
            table[registration_id] = resource

    def _release_counter(self, counter: Counter) -> None:
        """REMOVE_COUNTER (unless closed or cut off: the driver frees it with the client).  No
        linger: the counters file stays mapped while the client is open."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            self._counters.pop(counter.registration_id, None)
            if not self._closed and self._driver_lost is None:
                with contextlib.suppress(*_RELEASE_ERRORS):
                    self._request(control.REMOVE_COUNTER, lambda: self._proxy.remove(
                        control.REMOVE_COUNTER, counter.registration_id))

    def destination_request(self, command: str, owner: Handle, endpoint_channel: str) -> None:
        """ADD_DESTINATION or REMOVE_DESTINATION of a publication's endpoint, or
        ADD_RCV_DESTINATION or REMOVE_RCV_DESTINATION of a subscription's."""
        if not isinstance(endpoint_channel, str):
            raise TypeError(f"a destination is a channel URI (str), not "
                            f"{type(endpoint_channel).__name__}")
        if owner.is_closed:
            raise ClosedError(f"{owner!r} is closed")
        self._request(command, lambda: self._proxy.destination(
            command, owner.registration_id, endpoint_channel))

    def release_publication(self, registration_id: int, unmap: Callable[[], None]) -> None:
        """REMOVE_PUBLICATION; ``unmap()`` its log after the linger (:meth:`_release`)."""
        self._release(self._publications, registration_id, control.REMOVE_PUBLICATION, unmap)

    def release_subscription(self, registration_id: int,
                             release_images: Callable[[], None]) -> None:
        """REMOVE_SUBSCRIPTION; ``release_images()`` after the linger: a poll may be running
        in C on the polling thread (:meth:`_release`)."""
        self._release(self._subscriptions, registration_id, control.REMOVE_SUBSCRIPTION,
                      release_images)

    def _release(self, table: dict[int, Any], registration_id: int, command: str,
                 unmap: Callable[[], None]) -> None:
        """Forget a resource, tell the driver (unless closed or cut off), and unmap its logs
        after the resource linger (``resource_linger_s``; :data:`RESOURCE_LINGER_S` within
        :meth:`close`, which may come from any thread): a thread may still be inside an
        offer, a claim or a poll.  In a forked child, nothing: the resource is the parent's
        (its lock, which a thread may have held at the fork, and its socket are too)."""
        if os.getpid() != self._pid:
            return
        linger_s = RESOURCE_LINGER_S if self._closing else self.resource_linger_s
        try:
            with self._lock:
                table.pop(registration_id, None)
                if not self._closed and self._driver_lost is None:
                    with contextlib.suppress(*_RELEASE_ERRORS):
                        self._request(command,
                                      lambda: self._proxy.remove(command, registration_id))
        finally:  # whatever happened to the request, the logs go after the linger
            if linger_s:
                _after_linger(unmap, linger_s)
            else:
                with self._unmap_lock:
                    unmap()

    @property
    def is_closed(self) -> bool:
        """Closed by the application, or cut off from the driver."""
        return self._closed or self._driver_lost is not None

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise UsageError(f"this client was connected by process {self._pid}, which forked "
                             f"this one: it shares that process's socket to the driver, so a "
                             f"child connects its own (Client.connect())")

    def close(self) -> None:
        """Close every publication and subscription and leave the driver.  A second call
        returns once the first has, or at once where the first may be waiting for it: on the
        conductor thread or in a handler (image, back pressure), or within the first.  In a
        forked child it does nothing: the client is the parent's (the child's copies of its
        mappings go with the child)."""
        if os.getpid() != self._pid:
            return
        first = False
        try:
            with self._lock:
                first = not self._closing
                if first:
                    self._closing = True
                    self._closing_thread = threading.current_thread()
            if first:
                self._close()
        finally:  # also after an interrupt: a second close() must not wait for ever
            if first:
                try:
                    self._tear_down()  # if an interrupt came before _close() could
                finally:
                    self._close_done.set()
        if not first and not (self._inside_the_conductors_work()
                              or threading.current_thread() is self._closing_thread):
            self._close_done.wait()

    def _inside_the_conductors_work(self) -> bool:
        """Whether this thread is the conductor thread or holds the client's lock (a handler,
        run by the conductor thread or by a request's wait): it must not wait for the
        conductor thread, which may be waiting for the lock."""
        return (threading.current_thread() is self._thread
                or self._lock.held_by_this_thread())

    def _close(self) -> None:
        try:
            for publication in list(self._publications.values()):
                publication.close()
            for subscription in list(self._subscriptions.values()):
                subscription.close()
            with self._lock:
                # CLOSE_CLIENT frees them all: no request each.
                for counter in list(self._counters.values()):
                    counter._mark_closed()
                self._counters.clear()
                if self._driver_lost is None:
                    with contextlib.suppress(*_RELEASE_ERRORS, ClosedError):
                        self._request(control.CLOSE_CLIENT, self._proxy.close_client)
        finally:  # whatever failed above (an interrupt), the client's threads end
            self._tear_down()

    def _tear_down(self) -> None:
        """The end of close(), once, whatever interrupts it: closed, the keepalives stopped,
        what is left open cut off, the threads ended."""
        if self._torn_down:
            return
        self._torn_down = True
        # Without the lock: a wait for it (a request to a hung driver holds it) could be
        # interrupted, and the conductor thread must see this to end.  The rest is
        # idempotent, as _lose_driver's.
        self._cut_off_publications()  # before is_closed says so: offers say CLOSED by then
        self._closed = True
        try:
            self._stop_keeper()  # before the pipe it writes is closed
            # What an interrupt left open must not touch the counters once unmapped.
            self._cut_off_resources()
        finally:
            self._end_threads()

    def _end_threads(self) -> None:
        """The rest of close() (the client is closed): the conductor thread, the socket, and
        the mappings after the resource linger."""
        try:
            try:
                with contextlib.suppress(OSError):  # EPIPE: the thread has ended already
                    os.write(self._notices_in, b"\0")  # wake the conductor thread to see it
            finally:
                os.close(self._notices_in)
            assert self._thread is not None
            if not self._inside_the_conductors_work():
                self._thread.join(timeout=THREAD_JOIN_TIMEOUT_S)
        finally:  # also if interrupted: the thread or this closes what is left
            self._release_endpoints()

    def _release_endpoints(self) -> None:
        """The socket and the pipe's read end, now (the thread ended) or by the thread as it
        ends; then the counters and doorbells after the resource linger."""
        with self._lock:
            stage = self._thread_stage
            if stage in (_THREAD_NEW, _THREAD_RUNNING):
                # close() from a handler (the thread, or a request's wait that holds the
                # lock, is still reading from the socket), or a thread that ran past the
                # join: the thread closes the socket and its pipe end as it ends.
                self._left_to_thread = True
        if stage == _THREAD_SKIPPED:  # it ended without taking its pipe end
            os.close(self._notices)
        if stage in (_THREAD_SKIPPED, _THREAD_ENDED):
            self._socket.close(0)
        # As the logs (release_publication): a thread still inside offer_batch or a claim
        # (no GIL) reads pub-lmt from the counters and may ring a doorbell; closed at once,
        # the counters would be unmapped under it and the doorbell's fd reused by another
        # socket of the application.
        doorbells = list(self._doorbells.values())
        counters = self.counters

        def release() -> None:
            for doorbell in doorbells:
                doorbell.close()
            counters.close()

        _after_linger(release)

