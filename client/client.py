"""Client: an application's connection to its host's media driver.

``Client.connect()`` finds the driver directory, checks that a live driver holds it, maps the
counters file and opens the control socket.  A keepalive thread in C, which needs no GIL,
writes the client's heartbeat counter (so the driver keeps our resources) and watches the
driver.  A conductor thread applies the driver's events (so subscriptions see publications
come and go) while the application thread offers and polls without ever touching the socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import select
import socket
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import zmq

from slipstream.client import control
from slipstream.client._native import lib
from slipstream.client.channel import (
    PolicySpec,
    check_stream_id,
    check_subscription_keys,
    keys_for_the_other_side,
    parse_channel,
)
from slipstream.client.counters import (
    Counter,
    CountersFile,
    check_client_type_id,
    check_counter_key,
    encode_counter_label,
)
from slipstream.client.errors import (
    ChannelRejectedError,
    ChannelWarning,
    ClosedError,
    DriverNotRunningError,
    DriverTimeoutError,
    InvalidArgumentError,
    RegistrationError,
    UsageError,
)
from slipstream.client.image import Image
from slipstream.client.logbuffer import LogBuffer
from slipstream.client.policy import BackPressureEpisode, policy_of
from slipstream.client.publication import ExclusivePublication, Publication
from slipstream.client.subscription import Subscription

log = logging.getLogger("slipstream.client")
_P = TypeVar("_P", bound=Publication)

DEFAULT_IDLE_SPIN_NS = 1_000_000
"""How long a waiting receive spins before it parks.  A futex wake-up costs ~50 µs here, so
spinning for a millisecond keeps a steady stream (even at 10k messages/s) out of the park path,
and a quiet subscriber still drops to ~0 % CPU within a millisecond."""
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
#: What a request that releases a resource ignores: the driver did not answer, is gone (also
#: noticed while it waited), no longer knows the resource, or the client closed meanwhile (a
#: handler its wait ran): close() releases everything anyway.
_RELEASE_ERRORS = (DriverTimeoutError, DriverNotRunningError, RegistrationError, ClosedError)
#: The requests a closing client still makes.
_RELEASES = frozenset({control.REMOVE_PUBLICATION, control.REMOVE_SUBSCRIPTION,
                       control.REMOVE_COUNTER, control.CLOSE_CLIENT})


DEFAULT_SPINS_BEFORE_YIELD: int | None = 16
"""The client's idle strategy for loops that retry at once: after this many offers in a row
that find no credit (back-pressured, not connected), or polls in a row that move nothing, each
further one also gives the CPU up: it waits for the credit or the data, yielding between looks
for ``IDLE_YIELD_NS`` (20 µs) at the start of the spell, then parked on the log until the
driver brings it, ``IDLE_PARK_NS`` (1 ms) at most a call (:mod:`slipstream.client.idle`).  On a
machine with fewer cores than busy threads, a loop that spins without yielding takes the core
the driver needs to move the data it waits for: 32 B through two drivers on two cores moved
4-6x less per message and 10-17x less batched; one that yields still takes CPU the driver's
network threads need (docs/ARCHITECTURE.md, Costs that shaped the design).  The count is per
thread, over all its publications and subscriptions: a loop that serves several streams waits
only when none had work.  A loop with an idle strategy of its own may pass ``None``, which
never waits.  With an embedded driver (``invoker``) the calls yield instead of
parking: the waiting thread is the one that moves the data."""


def default_directory() -> Path:
    """``$SLIPSTREAM_DIR``, else ``/dev/shm/slipstream-<user>``."""
    env = os.environ.get("SLIPSTREAM_DIR")
    return Path(env) if env else control.default_driver_directory()


def _driver_holds_lock(directory: Path) -> bool:
    """Whether a live process holds the driver lock (a crashed driver's lock is released).
    Raises :class:`DriverError` naming the directory's owner when this process may not open
    the lock: another user's driver (:func:`control.foreign_directory_error`)."""
    try:
        fd = os.open(directory / control.LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except PermissionError:
        owner = None
        for path in (directory, directory.parent):  # the parent: when even the directory
            with contextlib.suppress(OSError):      # cannot be looked at
                owner = os.stat(path).st_uid
                break
        if owner is None:
            raise DriverNotRunningError(str(directory), "this process may not look into it "
                                                        "(permission denied)") from None
        raise control.foreign_directory_error(directory, owner) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _check_stream(channel: str, stream_id: int, *, publication: bool) -> None:
    """The checks the driver makes of these two arguments, made before sending: a bad value
    raises :class:`InvalidArgumentError` or :class:`ChannelError` naming the part.  Keys only
    the other side of a stream acts on are warned of (:class:`ChannelWarning`)."""
    control.check_channel("channel", channel)
    control.check_int32("stream_id", stream_id)
    parsed = parse_channel(channel)
    check_stream_id(parsed, stream_id)
    if not publication:
        check_subscription_keys(parsed)
    ignored = keys_for_the_other_side(parsed, publication=publication)
    if ignored:
        this, other = ("publication", "subscription") if publication else (
            "subscription", "publication")
        what = (f"is a {other} key and does" if len(ignored) == 1
                else f"are {other} keys and do")
        warnings.warn(ChannelWarning(
            f"{channel!r}: {', '.join(ignored)} {what} nothing on a {this}"), stacklevel=3)
    if publication and parsed.is_ipc and parsed.linger_ns is not None:
        # Aeron's URIs carry it; an IPC log has no retransmits to linger for.
        warnings.warn(ChannelWarning(
            f"{channel!r}: linger does nothing on aeron:ipc (its log goes once every "
            f"subscriber has read it all)"), stacklevel=3)


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


def _check_callbacks(**callbacks: object) -> None:
    """Each callback is None or callable: one that is not would fail only later, on the
    client's conductor thread, where nobody sees it."""
    for name, callback in callbacks.items():
        if callback is not None and not callable(callback):
            raise InvalidArgumentError(name, f"{callback!r} is not callable")


#: The stages of a client's conductor thread (Client._thread_stage).
_THREAD_NEW, _THREAD_RUNNING, _THREAD_ENDED, _THREAD_SKIPPED = range(4)


class Client:
    """A connection to the driver.  Thread-safe for adding and closing resources; a single
    Publication may be offered to from many threads (an ExclusivePublication from one at a
    time); poll each Subscription from one thread."""

    def __init__(self, directory: Path, *, request_timeout: float, idle_spin_ns: int,
                 spins_before_yield: int | None = DEFAULT_SPINS_BEFORE_YIELD,
                 invoker: Callable[[], int] | None = None,
                 resource_linger_s: float = RESOURCE_LINGER_S) -> None:
        self.directory = directory
        #: How long a publication or subscription this client's application closes keeps
        #: its logs mapped, s (0: unmapped by close() itself; see :meth:`connect`).
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
        self._lock = threading.RLock()
        self._correlation_ids = itertools.count(1)
        self._closed = False
        self._driver_lost: str | None = None
        self._driver_still_running = False  # lost, but a driver serves the directory
        self._driver_timeout_ns = 0  # the driver's driver_timeout, from its CONNECT reply
        self._publications: dict[int, Publication] = {}
        self._subscriptions: dict[int, Subscription] = {}
        self._counters: dict[int, Counter] = {}  # by registration id
        self._pending: dict[int, dict[str, Any]] = {}
        self._images_seen = 0  # AVAILABLE_IMAGE events read, of any subscription
        self._reply_hooks: dict[int, Callable[[dict[str, Any]], object]] = {}
        #: Requests this client stopped waiting for (DriverTimeoutError), by correlation id:
        #: a late answer is dropped, and what it made is released (nothing holds it here).
        self._abandoned: set[int] = set()
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(control.conductor_endpoint(directory))
        self._fd = self._socket.getsockopt(zmq.FD)
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
        self.counters: CountersFile
        self.client_id = 0

    # -- connecting ----------------------------------------------------------------------------
    @classmethod
    def connect(cls, directory: str | os.PathLike[str] | None = None, *,
                timeout: float = 5.0, idle_spin_ns: int = DEFAULT_IDLE_SPIN_NS,
                spins_before_yield: int | None = DEFAULT_SPINS_BEFORE_YIELD,
                invoker: Callable[[], int] | None = None,
                resource_linger_s: float = RESOURCE_LINGER_S) -> Client:
        """Connect to the driver of ``directory`` (default :func:`default_directory`).

        ``spins_before_yield``: offers without credit, or empty polls, in a row before each
        further one gives the CPU up, parked until the credit or the data comes (at most
        1 ms a call; :data:`DEFAULT_SPINS_BEFORE_YIELD`; None: never, which also makes an
        embedded driver's :meth:`Subscription.receive` spin without yielding).

        ``invoker``: the duty cycle of a driver embedded in this process in invoker mode
        (``MediaDriver.embedded(...).do_work``), which has no thread of its own: the client
        runs it while it waits (a command's answer, :meth:`Subscription.receive`) and in
        :meth:`do_work`, which the application calls in its loop.

        ``resource_linger_s`` (Aeron's ``resourceLingerDurationNs``): how long a publication's
        or subscription's logs stay mapped after the application closes it
        (:data:`RESOURCE_LINGER_S`), so that another thread still inside an offer, a claim or
        a poll in C never touches an unmapped page.  0 unmaps them in ``close()`` itself,
        which lets the driver reuse their files at once (``log_reuse_bytes``): only for a
        client whose every stream is offered to or polled by the thread that closes it.
        What :meth:`close` closes lingers :data:`RESOURCE_LINGER_S` whatever this says.

        Raises :class:`DriverNotRunningError` (naming the directory) when no live driver is
        there, :class:`DriverTimeoutError` when it does not answer within ``timeout`` seconds.
        """
        timeout = control.check_timeout("timeout", timeout, forever=False, zero=False)
        control.check_int64("idle_spin_ns", idle_spin_ns, low=0)
        path = Path(directory) if directory is not None else default_directory()
        counters_path = path / control.COUNTERS_FILE
        if not path.is_dir():
            raise DriverNotRunningError(str(path), "the directory does not exist")
        control.check_directory_access(path)  # another user's: say so, not PermissionError
        if not _driver_holds_lock(path) or not counters_path.exists():
            raise DriverNotRunningError(str(path), "no driver holds its lock")
        client = cls(path, request_timeout=timeout, idle_spin_ns=idle_spin_ns,
                     spins_before_yield=spins_before_yield, invoker=invoker,
                     resource_linger_s=resource_linger_s)
        try:
            reply = client._request({"type": control.CONNECT, "version": control.PROTOCOL_VERSION,
                                     "pid": os.getpid(),
                                     "process": control.process_token()}, connecting=True)
            client.client_id = reply["client_id"]
            client._driver_timeout_ns = reply["driver_timeout_ns"]
            client.counters = CountersFile(reply["counters_file"])
            # An embedded driver beats only while the application runs it: its clients never
            # time it out (it lives as long as they do), they only watch its lock.
            client._stop_keeper = client.counters.start_heartbeat_keeper(
                reply["heartbeat_counter_id"], client.client_id,
                interval_ns=reply["keepalive_interval_ns"],
                driver_timeout_ns=0 if invoker is not None else reply["driver_timeout_ns"],
                lock_path=path / control.LOCK_FILE, notify_fd=client._notices_in)
            client._thread = threading.Thread(target=client._run_conductor, daemon=True,
                                              name=f"slipstream-client-{client.client_id}")
            client._thread.start()
        except BaseException:  # an error, or an interrupt anywhere in here
            with client._lock:
                client._closed = True
                thread_running = client._thread_stage != _THREAD_NEW
            client._stop_keeper()
            if thread_running:  # the thread owns the pipe's read end: end it as close() does
                client._end_threads()
            else:  # none started, or it will see _closed first and touch nothing
                if hasattr(client, "counters"):  # nothing was handed out: no linger needed;
                    client.counters.close()  # first: it stops a keeper that writes the pipe
                client._socket.close(0)
                os.close(client._notices)
                os.close(client._notices_in)
            raise
        return client

    # -- requests ------------------------------------------------------------------------------
    def _request(self, message: dict[str, Any], *, connecting: bool = False,
                 on_reply: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
        """Send a command and wait for its answer, applying events that arrive meanwhile.
        ``on_reply`` runs (under the lock) as soon as the answer is read."""
        self._check_process()
        correlation_id = next(self._correlation_ids)
        message["correlation_id"] = correlation_id
        with self._lock:
            self._check_open()
            if self._closing and message["type"] not in _RELEASES:
                raise ClosedError("the client is closing")
            deadline = time.monotonic() + self._request_timeout
            if on_reply is not None:
                self._reply_hooks[correlation_id] = on_reply
            self._socket.send(control.encode(message))
            try:
                reply = self._await_reply(message["type"], correlation_id, deadline, connecting)
                self._await_images(reply.get("_images_until", 0), deadline)
            except DriverTimeoutError:
                self._reply_hooks.pop(correlation_id, None)
                self._abandoned.add(correlation_id)
                raise
            finally:
                # zmq's FD is edge-triggered: after a send, only a read to EAGAIN makes it
                # say again that messages came (the conductor thread waits on it).
                with contextlib.suppress(zmq.ZMQError):
                    self._drain()
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
        while (self._images_seen < until and self._driver_lost is None
               and not self._closed):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            ready = dict(self._request_poller.poll(int(min(remaining, 0.1) * 1000)))
            if self._notices in ready:  # the driver may be gone: they would never come
                self._read_notice()
            if self._socket in ready:
                self._drain()

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
                if connecting and _driver_holds_lock(self.directory):
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
                    self._drain()
                elif not worked:
                    os.sched_yield()
            else:
                ready = dict(self._request_poller.poll(int(min(remaining, 0.1) * 1000)))
                if self._notices in ready:  # the driver may be gone: no answer would come
                    self._read_notice()
                if self._socket in ready:
                    self._drain()

    def _drain(self) -> None:
        """Read every waiting message (under the lock): answers to pending, events applied."""
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = control.decode(frame)
            except ValueError:
                log.warning("ignored a malformed message from the driver")
                continue
            kind = message.get("type")
            if kind == control.AVAILABLE_IMAGE:
                self._images_seen += 1
            if kind in (control.AVAILABLE_IMAGE, control.UNAVAILABLE_IMAGE):
                try:
                    if kind == control.AVAILABLE_IMAGE:
                        self._on_available_image(message)
                    else:
                        self._on_unavailable_image(message)
                except DriverNotRunningError as e:  # it stopped as it announced the image
                    log.warning("could not apply %s: %s", kind, e)
                except Exception:  # this thread carries the driver's events: it must not die
                    log.exception("could not apply %s", kind)
            elif kind == control.BACK_PRESSURE_EPISODE:
                publication = self._publications.get(message.get("registration_id", 0))
                if publication is not None:
                    publication._on_episode(message)
            elif kind == control.CLIENT_TIMEOUT:
                self._lose_driver("it timed this client out: no keepalive within "
                                  "client_liveness_timeout", still_running=True)
            elif kind == control.DRIVER_SHUTDOWN:
                reason = message.get("reason")
                self._lose_driver(reason if isinstance(reason, str) else "the driver stopped")
            else:
                correlation_id = message.get("correlation_id", 0)
                if correlation_id in self._abandoned:
                    self._abandoned.discard(correlation_id)
                    self._release_abandoned(message)
                    continue
                hook = self._reply_hooks.pop(correlation_id, None)
                if hook is not None:
                    hook(message)
                following = message.get("images_following")
                if isinstance(following, int) and not isinstance(following, bool):
                    message["_images_until"] = self._images_seen + following
                self._pending[correlation_id] = message
            if self._closed:  # a handler closed the client: read nothing more
                return

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
        correlation_id = next(self._correlation_ids)
        self._abandoned.add(correlation_id)
        with contextlib.suppress(zmq.ZMQError):
            self._socket.send(control.encode({"type": release,
                                              "registration_id": registration_id,
                                              "correlation_id": correlation_id}), zmq.NOBLOCK)

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
                    self._drain()
                # Events make the socket's FD readable; the timeout is a safety net only.
                with contextlib.suppress(OSError, ValueError):
                    poller.poll(EVENTS_SAFETY_NET_S * 1000)
        finally:
            with self._lock:
                self._thread_stage = _THREAD_ENDED
                left_to_thread = self._left_to_thread
            os.close(self._notices)
            if left_to_thread:
                self._socket.close(0)

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

    def _doorbell_fd(self, channel: str, name: str) -> int:
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
    def _on_available_image(self, message: dict[str, Any]) -> None:
        subscription = self._subscriptions.get(message["subscription_registration_id"])
        if subscription is None or subscription.is_closed:
            return
        try:
            log_buffer = LogBuffer(message["log_file"], writes_terms=False)
        except (OSError, ValueError) as e:
            # It may be gone already (a short-lived image): its UNAVAILABLE_IMAGE follows.
            log.info("could not map image %s: %s", message["log_file"], e)
            return
        image = subscription._new_image(log_buffer, message["subscriber_position_counter_id"],
                                        message["join_position"], message["correlation_id"],
                                        message.get("source_identity", ""),
                                        message.get("channel_key"))
        subscription._add_image(image)

    def _on_unavailable_image(self, message: dict[str, Any]) -> None:
        subscription = self._subscriptions.get(message["subscription_registration_id"])
        if subscription is not None:
            lost_from, lost_to = message.get("lost_from"), message.get("lost_to")
            subscription._remove_image(
                message["correlation_id"],
                (int(lost_from), int(lost_to)) if lost_from is not None and lost_to is not None
                else None)

    # -- resources -----------------------------------------------------------------------------
    def add_publication(self, channel: str, stream_id: int, *,
                        policy: str | PolicySpec | None = None,
                        on_back_pressure: Callable[[BackPressureEpisode], object] | None = None,
                        ) -> Publication:
        """Publish to ``stream_id`` on ``channel`` (e.g. ``"aeron:ipc"``).  Publishers of the same
        stream share one log.  Raises :class:`ChannelError` naming the bad part of the URI.

        ``policy``: what an offer does without credit (``"block"``, ``"drop-newest"``,
        ``"error"``, ``"rate-limit,messages:1000"``, ...: :mod:`slipstream.client.policy`), as
        ``policy=`` in the URI does; None: the URI's, else Aeron's codes.
        ``on_back_pressure``: called with a :class:`BackPressureEpisode` when an episode of the
        stream begins or ends (on the client's conductor thread, as image callbacks).

        Response channels (Aeron's, docs/CHANNELS.md §7.6): a client's *request* publication
        is ``aeron:udp?endpoint=SERVER:PORT|response-correlation-id=R``, R being the
        ``registration_id`` of its response subscription (:meth:`add_subscription`) on this
        client's driver; a server's *response* publication is
        ``aeron:udp?control-mode=response|control=SERVER:CTRLPORT|response-correlation-id=C``,
        C being the ``correlation_id`` of the request :class:`Image` it answers, which must
        still be available.  :class:`ChannelError` names ``response-correlation-id`` or
        ``control`` when they do not fit.  The response publication sends to the client only,
        through the address its response subscription's status messages come from; close it
        when the request image goes (``on_unavailable_image``), as Aeron's ResponseServer
        does: the driver does not."""
        # Fails here, naming the bad part, before any I/O.
        _check_stream(channel, stream_id, publication=True)
        return self._add_publication(control.ADD_PUBLICATION, Publication, channel, stream_id,
                                     policy, on_back_pressure)

    def add_exclusive_publication(
            self, channel: str, stream_id: int, *, policy: str | PolicySpec | None = None,
            on_back_pressure: Callable[[BackPressureEpisode], object] | None = None,
    ) -> ExclusivePublication:
        """Publish to ``stream_id`` on ``channel`` from one thread (Aeron's
        ``addExclusivePublication``): each call makes a publication and log of its own, with
        its own session id, that no other publisher joins, on ``aeron:ipc`` and ``aeron:udp``
        alike, taking every URI key and argument :meth:`add_publication` takes.  Its offers
        claim without an atomic add; it must be used from one thread at a time
        (:class:`ExclusivePublication`).  ``session-id=`` fixes its session, which no open
        publication of the stream there may have already: :class:`ChannelError` names
        ``session-id`` otherwise.  Raises as :meth:`add_publication` does."""
        _check_stream(channel, stream_id, publication=True)
        return self._add_publication(control.ADD_EXCLUSIVE_PUBLICATION, ExclusivePublication,
                                     channel, stream_id, policy, on_back_pressure)

    def _add_publication(self, command: str, kind: type[_P], channel: str, stream_id: int,
                         policy: str | PolicySpec | None,
                         on_back_pressure: Callable[[BackPressureEpisode], object] | None,
                         ) -> _P:
        """Ask the driver for a publication (``command``) and map it as a ``kind``."""
        _check_callbacks(on_back_pressure=on_back_pressure)
        spec = policy_of(channel, policy)
        reply = self._request({"type": command, "channel": channel, "stream_id": stream_id})
        log_buffer = LogBuffer(reply["log_file"])
        publication = kind(self, channel, stream_id, reply["registration_id"], log_buffer,
                           reply["publication_limit_counter_id"],
                           self._doorbell_fd(channel, control.SENDER_DOORBELL),
                           policy=spec, drops_counter_id=reply.get("drops_counter_id"),
                           durable_counter_ids=_durable_counter_ids(reply))
        publication.on_back_pressure = on_back_pressure
        with self._lock:
            if self._closing or self._driver_lost is not None:  # close() ran meanwhile
                publication._mark_closed()
                self._check_open()
                raise ClosedError("the client is closing")
            self._publications[publication.registration_id] = publication
        return publication

    def add_subscription(self, channel: str, stream_id: int, *,
                         on_available_image: Callable[[Image], object] | None = None,
                         on_unavailable_image: Callable[[Image], object] | None = None,
                         ) -> Subscription:
        """Receive ``stream_id`` on ``channel``.  Image callbacks run on the client's conductor
        thread as publications come and go.

        ``aeron:udp?control-mode=response|control=SERVER:CTRLPORT`` is a response
        subscription (docs/CHANNELS.md §7.6): no endpoint of its own (a port the system picks,
        on ``interface=`` if given), and no image until a request publication naming its
        ``registration_id`` (``response-correlation-id=``) is answered by the server's
        response publication of this ``stream_id``; then one image, of that session only."""
        _check_stream(channel, stream_id, publication=False)
        _check_callbacks(on_available_image=on_available_image,
                         on_unavailable_image=on_unavailable_image)
        subscription = Subscription(self, channel, stream_id, 0, on_available_image,
                                    on_unavailable_image)

        def register(reply: dict[str, Any]) -> None:
            # Runs as the answer is read, before the image events queued right behind it.
            if reply["type"] == control.SUBSCRIPTION_READY:
                subscription.registration_id = reply["registration_id"]
                self._subscriptions[subscription.registration_id] = subscription

        self._request({"type": control.ADD_SUBSCRIPTION, "channel": channel,
                       "stream_id": stream_id}, on_reply=register)
        with self._lock:
            closing = self._closing or self._driver_lost is not None
        if closing:  # close() ran meanwhile (a handler this request ran, another thread)
            subscription.close()
            self._check_open()
            raise ClosedError("the client is closing")
        return subscription

    def add_counter(self, type_id: int, label: str, key: bytes = b"") -> Counter:
        """A counter this client owns (Aeron's ``addCounter``), in the driver's counters file
        where ``slipstream stat``, the metrics exporter and other processes read it
        (``CountersFile.find(type_id, key)``).  ``type_id``: what it counts, an int in
        0..2**31-1 that is not one of the driver's own (``counters.DRIVER_TYPE_IDS``: 0..99
        and 1000..1099); ``label``: for people, at most ``counters.LABEL_MAX_LENGTH`` bytes of
        UTF-8; ``key``: what a reader finds it by (a recording id, say), at most
        ``counters.KEY_MAX_LENGTH`` bytes.  Each is refused by name
        (:class:`InvalidArgumentError`) before the driver is asked.

        The driver frees it when it is closed, when this client closes, or when the driver
        times this client out (a killed process leaks none).  Raises
        :class:`RegistrationError` (code ``resource``) when the counters file is full."""
        check_client_type_id("type_id", type_id)
        encode_counter_label("label", label)
        key = check_counter_key("key", key)
        reply = self._request({"type": control.ADD_COUNTER, "type_id": type_id,
                               "label": label, "key": key.hex()})
        counter = Counter(self.counters, reply["counter_id"], reply["registration_id"],
                          type_id=type_id, label=label, key=key, release=self._release_counter)
        with self._lock:
            if self._closing or self._driver_lost is not None:  # close() ran meanwhile
                counter._mark_closed()
                self._check_open()
                raise ClosedError("the client is closing")
            self._counters[counter.registration_id] = counter
        return counter

    def _release_counter(self, counter: Counter) -> None:
        """REMOVE_COUNTER (unless closed or cut off: the driver frees it with the client).  No
        linger: the counters file stays mapped while the client is open."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            self._counters.pop(counter.registration_id, None)
            if not self._closed and self._driver_lost is None:
                with contextlib.suppress(*_RELEASE_ERRORS):
                    self._request({"type": control.REMOVE_COUNTER,
                                   "registration_id": counter.registration_id})

    def _destination_request(self, command: str, owner: Publication | Subscription,
                             endpoint_channel: str) -> None:
        """ADD_DESTINATION or REMOVE_DESTINATION of a publication's endpoint, or
        ADD_RCV_DESTINATION or REMOVE_RCV_DESTINATION of a subscription's."""
        if not isinstance(endpoint_channel, str):
            raise TypeError(f"a destination is a channel URI (str), not "
                            f"{type(endpoint_channel).__name__}")
        if owner.is_closed:
            raise ClosedError(f"{owner!r} is closed")
        self._request({"type": command, "registration_id": owner.registration_id,
                       "channel": endpoint_channel})

    def _release_publication(self, publication: Publication) -> None:
        self._release(self._publications, publication.registration_id,
                      control.REMOVE_PUBLICATION, publication._unmap)

    def _release_subscription(self, subscription: Subscription) -> None:
        # A poll may be running in C on the polling thread: its images' logs linger too.
        self._release(self._subscriptions, subscription.registration_id,
                      control.REMOVE_SUBSCRIPTION, subscription.release_gone_images)

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
                        self._request({"type": command, "registration_id": registration_id})
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

    def do_work(self) -> int:
        """Run the embedded driver's duty cycle once (invoker mode: ``Client.connect(...,
        invoker=...)``); returns its work (0: idle).  Without an embedded driver, 0."""
        return self.invoker() if self.invoker is not None else 0

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
                or self._lock._is_owned())  # type: ignore[attr-defined]

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
                        self._request({"type": control.CLOSE_CLIENT})
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
                self._thread.join(timeout=2)
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
        # As the logs (_release_publication): a thread still inside offer_batch or a claim
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

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
