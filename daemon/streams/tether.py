"""Aeron's untethered subscriptions (``tether=false``): the one rule for every kind of stream
a subscriber holds back (an IPC publication, a network publication's spies, a network image).

A tethered subscriber holds its stream as long as it takes to read.  An untethered one holds it
only while it keeps up: the conductor looks at it on its timer, and a subscriber that stays
near the end of the stream's window (what the slowest subscriber may hold its publishers or
sender to) for longer than its *window limit timeout* is left behind.  What follows is Aeron's
(IpcPublication, NetworkPublication and PublicationImage ``checkUntetheredSubscriptions``):

```
ACTIVE   --near the window's end for window_limit_timeout--> LINGER   (its image goes: tell it)
LINGER   --window_limit_timeout again------------------->  RESTING  (unlink: it holds nothing)
RESTING  --resting_timeout------------------------------->  ACTIVE   (link it again, anew)
```

In LINGER its position still holds the stream, so that its client, told the image is gone,
stops writing a position counter that the driver is about to free.  A subscriber's link to a
stream is one :class:`TetherablePosition` whatever the stream; the end of the window is one
rule, :func:`untethered_window_end`, from where each kind of stream is (its *head*).  This
module owns the links, the states, the timers and that rule; the conductor's check that acts on
them is :mod:`slipstream.daemon.conductor.untethered`.  All times are monotonic ns, positions
in bytes.
"""

from __future__ import annotations

import enum
from typing import Generic, Protocol, TypeVar

import attrs


def untethered_window_end(head: int, window: int) -> int:
    """The end of a stream's window as the untethered check sees it: a subscriber at or below
    it holds the stream back.  ``head`` is where the stream is (an IPC log's producer
    position, a network publication's ``snd-pos``, an image's fastest subscriber), ``window``
    the window its slowest subscriber may hold it to (the term window; an image's receiver
    window).  Aeron's rule since 1.30 for all three: the bottom quarter of the window, that is
    a subscriber within a quarter of a window of ``head - window`` (docs/DRIVER.md §4.7)."""
    return head - window + (window >> 2)


class TetherState(enum.Enum):
    ACTIVE = "active"  # linked, holding the stream as any subscriber while it keeps up
    LINGER = "linger"  # left behind: its image is gone, its position still held a while
    RESTING = "resting"  # unlinked, waiting out its resting timeout before it rejoins


class _UntetheredChannel(Protocol):
    """The URI keys that override the settings (client/channel.py ``Channel``)."""

    untethered_window_limit_timeout_ns: int | None
    untethered_resting_timeout_ns: int | None


class _UntetheredSettings(Protocol):
    untethered_window_limit_timeout: int
    untethered_resting_timeout: int


@attrs.define
class Tether:
    """One untethered subscriber's state and timer (see the module's docstring).

    ``since_ns``: ACTIVE, when it was last clear of the window's end; LINGER, when it was left
    behind; RESTING, when it was unlinked."""

    window_limit_timeout_ns: int
    resting_timeout_ns: int
    since_ns: int
    state: TetherState = TetherState.ACTIVE

    @classmethod
    def of(cls, channel: _UntetheredChannel, settings: _UntetheredSettings,
           now_ns: int) -> Tether:
        """An ACTIVE tether as of ``now_ns``, with the timeouts of ``channel``'s URI, else of
        the driver's settings."""
        window_limit = channel.untethered_window_limit_timeout_ns
        resting = channel.untethered_resting_timeout_ns
        return cls(settings.untethered_window_limit_timeout if window_limit is None
                   else window_limit,
                   settings.untethered_resting_timeout if resting is None else resting,
                   now_ns)

    @property
    def lingering(self) -> bool:
        return self.state is TetherState.LINGER

    def check(self, position: int, window_end: int, now_ns: int) -> TetherState | None:
        """On the conductor's timer, while linked (ACTIVE or LINGER): the subscriber is at
        ``position``, and a position at or below ``window_end`` is what holds the stream back.
        Returns the state it entered now: LINGER (left behind: its image goes, with the range
        from ``position`` on), RESTING (unlink it); else None."""
        if self.state is TetherState.ACTIVE:
            if position > window_end:
                self.since_ns = now_ns
            elif now_ns - self.since_ns > self.window_limit_timeout_ns:
                self.state, self.since_ns = TetherState.LINGER, now_ns
                return TetherState.LINGER
        elif self.state is TetherState.LINGER:
            if now_ns - self.since_ns > self.window_limit_timeout_ns:
                self.state, self.since_ns = TetherState.RESTING, now_ns
                return TetherState.RESTING
        return None

    def rest_again(self, now_ns: int) -> None:
        """Back to RESTING as of ``now_ns``: linking it anew failed (no counter was free for
        its position), so it tries again after another resting timeout, not at once."""
        self.state, self.since_ns = TetherState.RESTING, now_ns

    def rested(self, now_ns: int) -> bool:
        """On the conductor's timer, while RESTING: whether its resting timeout has passed,
        when it becomes ACTIVE again as of ``now_ns`` (link it anew)."""
        if self.state is not TetherState.RESTING \
                or now_ns - self.since_ns < self.resting_timeout_ns:
            return False
        self.state, self.since_ns = TetherState.ACTIVE, now_ns
        return True


class Subscriber(Protocol):
    """What a link needs of its subscription (the conductor's IPC and network ones)."""

    @property
    def registration_id(self) -> int: ...

    @property
    def client_id(self) -> int: ...

    @property
    def client_key(self) -> bytes: ...  # its client's on the command socket


S = TypeVar("S", bound=Subscriber)


@attrs.define(eq=False)
class TetherablePosition(Generic[S]):
    """A subscription's link to one stream (Aeron's ``aeron_tetherable_position_t``), for an
    IPC log, a network publication's spy and a network image alike: the ``sub-pos`` counter
    its client writes and that counter's ``cell`` (cffi ``int64_t *``, which the agent that
    reads the stream's positions holds), and its :class:`Tether` if it is untethered
    (``tether=false``; None: tethered).  A resting one keeps its link object with its counter
    freed; it links anew, with a new counter, when it rejoins."""

    subscription: S
    counter_id: int
    cell: object
    tether: Tether | None = None

    @property
    def lingering(self) -> bool:
        """Left behind: its image gone, its position still held a while (Aeron's LINGER)."""
        return self.tether is not None and self.tether.lingering
