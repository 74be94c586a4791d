"""What a publication or subscription asks of the client conductor that made it
(:class:`~slipstream.client.conductor.ClientConductor`, as Aeron's resources hold their
``ClientConductor``): the counters file, the idle settings, the requests that release it or
change its destinations, a doorbell, and why it was cut off.  The resources are below the
conductor, which makes them: they know it by this interface alone."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from slipstream.client.counters import CountersFile
from slipstream.client.errors import ClosedError, DriverNotRunningError

log = logging.getLogger("slipstream.client")

Argument = TypeVar("Argument")


class Handle(Protocol):
    """A publication or subscription as a request names it."""

    registration_id: int

    @property
    def is_closed(self) -> bool: ...


class ResourceOwner(Protocol):
    """The conductor of the client a resource belongs to."""

    #: The driver's counters file, mapped.
    counters: CountersFile
    #: The embedded driver's duty cycle a waiting call runs (invoker mode), else None.
    invoker: Callable[[], int] | None
    #: The idle strategy's spins (``Client.connect(spins_before_yield=...)``).
    spins_before_yield: int | None
    #: How long a waiting receive spins before it parks, ns.
    idle_spin_ns: int

    @property
    def is_closed(self) -> bool:
        """Closed by the application, or cut off from the driver."""
        ...

    def release_publication(self, registration_id: int, unmap: Callable[[], None]) -> None:
        """Forget the publication, tell the driver, and ``unmap()`` its log after the linger."""
        ...

    def release_subscription(self, registration_id: int,
                             release_images: Callable[[], None]) -> None:
        """Forget the subscription, tell the driver, and ``release_images()`` after the
        linger."""
        ...

    def destination_request(self, command: str, owner: Handle, endpoint_channel: str) -> None:
        """Ask the driver to add or remove a destination (``command``) of ``owner``."""
        ...

    def doorbell_fd(self, channel: str, name: str) -> int:
        """The fd of the driver's doorbell ``name`` for a network ``channel``; -1 for IPC."""
        ...

    def driver_lost_error(self) -> DriverNotRunningError | ClosedError:
        """The error calls raise once the driver is gone."""
        ...

    def cut_off_error(self) -> DriverNotRunningError | ClosedError | None:
        """Why an offer said CLOSED when the client is the reason; None otherwise."""
        ...


def call_handler(what: str, handler: Callable[[Argument], object] | None, argument: Argument,
                 on: object) -> None:
    """A user's ``handler`` (None: none) called with ``argument`` on the client conductor
    thread: what it raises is logged as the ``what`` of ``on`` and goes no further (that thread
    carries the driver's events: if it died, the client would no longer see images come and
    go, nor the driver go)."""
    if handler is None:
        return
    try:
        handler(argument)
    except Exception:
        log.exception("the %s %r raised on %r", what, handler, on)
