"""Client: an application's connection to its host's media driver (Aeron's ``Aeron``).

``Client.connect()`` finds the driver directory, checks that a live driver holds it, and
starts the client's conductor, which opens the control socket, maps the counters file and
runs the client's threads.  A keepalive thread in C, which needs no GIL, writes the client's
heartbeat counter (so the driver keeps our resources) and watches the driver.  The conductor
thread applies the driver's events (so subscriptions see publications come and go) while the
application thread offers and polls without ever touching the socket.

The client is Aeron's division of work: this class checks the application's arguments and
hands each call to the :class:`~slipstream.client.conductor.ClientConductor` (the client's
state: its publications, subscriptions, images and counters, and the driver's events), which
sends commands through the :class:`~slipstream.client.driver_proxy.DriverProxy` and reads
the driver's answers and events with the
:class:`~slipstream.client.driver_events.DriverEventsAdapter`.  Offers and polls go to the
publications and subscriptions themselves, past all of these.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

from slipstream.client import control
from slipstream.client.channel import (
    PolicySpec,
    check_stream_id,
    check_subscription_keys,
    keys_for_the_other_side,
    parse_channel,
)
from slipstream.client.conductor import RESOURCE_LINGER_S, ClientConductor
from slipstream.client.counter_record import (
    check_client_type_id,
    check_counter_key,
    encode_counter_label,
)
from slipstream.client.counters import Counter, CountersFile
from slipstream.client.errors import (
    ChannelWarning,
    ClosedError,
    DriverNotRunningError,
    InvalidArgumentError,
)
from slipstream.client.image import Image
from slipstream.client.policy import BackPressureEpisode, policy_of
from slipstream.client.publication import ExclusivePublication, Publication
from slipstream.client.subscription import Subscription

DEFAULT_IDLE_SPIN_NS = 1_000_000
"""How long a waiting receive spins before it parks.  A futex wake-up costs ~50 µs here, so
spinning for a millisecond keeps a steady stream (even at 10k messages/s) out of the park path,
and a quiet subscriber still drops to ~0 % CPU within a millisecond."""
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


def _check_callbacks(**callbacks: object) -> None:
    """Each callback is None or callable: one that is not would fail only later, on the
    client's conductor thread, where nobody sees it."""
    for name, callback in callbacks.items():
        if callback is not None and not callable(callback):
            raise InvalidArgumentError(name, f"{callback!r} is not callable")


class Client:
    """A connection to the driver.  Thread-safe for adding and closing resources; a single
    Publication may be offered to from many threads (an ExclusivePublication from one at a
    time); poll each Subscription from one thread."""

    def __init__(self, conductor: ClientConductor) -> None:
        """A client of ``conductor``'s driver: made by :meth:`connect`."""
        self._conductor = conductor

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
        if not control.driver_holds_lock(path) or not counters_path.exists():
            raise DriverNotRunningError(str(path), "no driver holds its lock")
        conductor = ClientConductor(path, request_timeout=timeout, idle_spin_ns=idle_spin_ns,
                                    spins_before_yield=spins_before_yield, invoker=invoker,
                                    resource_linger_s=resource_linger_s)
        conductor.connect()
        return cls(conductor)

    # -- what it is connected to ---------------------------------------------------------------
    @property
    def directory(self) -> Path:
        """The driver directory."""
        return self._conductor.directory

    @property
    def client_id(self) -> int:
        """This client's id in its driver."""
        return self._conductor.client_id

    @property
    def counters(self) -> CountersFile:
        """The driver's counters file, mapped (while the client is open)."""
        return self._conductor.counters

    @property
    def invoker(self) -> Callable[[], int] | None:
        """The embedded driver's duty cycle this client runs while it waits (invoker mode)."""
        return self._conductor.invoker

    @property
    def idle_spin_ns(self) -> int:
        """How long a waiting receive spins before it parks, ns."""
        return self._conductor.idle_spin_ns

    @property
    def spins_before_yield(self) -> int | None:
        """:data:`DEFAULT_SPINS_BEFORE_YIELD`, or what :meth:`connect` was given."""
        return self._conductor.spins_before_yield

    @property
    def resource_linger_s(self) -> float:
        """How long a publication or subscription this client's application closes keeps
        its logs mapped, s (0: unmapped by close() itself; see :meth:`connect`)."""
        return self._conductor.resource_linger_s

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
        _check_callbacks(on_back_pressure=on_back_pressure)
        return self._conductor.add_publication(control.ADD_PUBLICATION, Publication, channel,
                                               stream_id, policy_of(channel, policy),
                                               on_back_pressure)

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
        _check_callbacks(on_back_pressure=on_back_pressure)
        return self._conductor.add_publication(control.ADD_EXCLUSIVE_PUBLICATION,
                                               ExclusivePublication, channel, stream_id,
                                               policy_of(channel, policy), on_back_pressure)

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
        return self._conductor.add_subscription(channel, stream_id, on_available_image,
                                                on_unavailable_image)

    def add_counter(self, type_id: int, label: str, key: bytes = b"") -> Counter:
        """A counter this client owns (Aeron's ``addCounter``), in the driver's counters file
        where ``slipstream stat``, the metrics exporter and other processes read it
        (``CountersFile.find(type_id, key)``).  ``type_id``: what it counts, an int in
        0..2**31-1 that is not one of the driver's own (``counter_record.DRIVER_TYPE_IDS``: 0..99
        and 1000..1099); ``label``: for people, at most ``counter_record.LABEL_MAX_LENGTH`` bytes of
        UTF-8; ``key``: what a reader finds it by (a recording id, say), at most
        ``counter_record.KEY_MAX_LENGTH`` bytes.  Each is refused by name
        (:class:`InvalidArgumentError`) before the driver is asked.

        The driver frees it when it is closed, when this client closes, or when the driver
        times this client out (a killed process leaks none).  Raises
        :class:`RegistrationError` (code ``resource``) when the counters file is full."""
        check_client_type_id("type_id", type_id)
        encode_counter_label("label", label)
        key = check_counter_key("key", key)
        return self._conductor.add_counter(type_id, label, key)

    # -- its state -----------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        """Closed by the application, or cut off from the driver."""
        return self._conductor.is_closed

    def driver_lost_error(self) -> DriverNotRunningError | ClosedError:
        """The error calls raise once the driver is gone (or the client closed with
        resources it could not release: an interrupted close())."""
        return self._conductor.driver_lost_error()

    def cut_off_error(self) -> DriverNotRunningError | ClosedError | None:
        """Why an offer of this client said CLOSED, when the client is the reason: the driver
        went (:class:`DriverNotRunningError`) or the client closed (:class:`ClosedError`);
        None when the client is open and its publication alone was closed.  Losing the driver
        closes the publications before it marks the client: this looks under the client's
        lock, which shows the two together."""
        return self._conductor.cut_off_error()

    def do_work(self) -> int:
        """Run the embedded driver's duty cycle once (invoker mode: ``Client.connect(...,
        invoker=...)``); returns its work (0: idle).  Without an embedded driver, 0."""
        invoker = self._conductor.invoker
        return invoker() if invoker is not None else 0

    def close(self) -> None:
        """Close every publication and subscription and leave the driver.  A second call
        returns once the first has, or at once where the first may be waiting for it: on the
        conductor thread or in a handler (image, back pressure), or within the first.  In a
        forked child it does nothing: the client is the parent's (the child's copies of its
        mappings go with the child)."""
        self._conductor.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
