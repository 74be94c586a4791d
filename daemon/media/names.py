"""Host names in channel URIs, resolved off the conductor's loop, and resolved again when the
peer they name goes silent.

A name in ``endpoint=``, ``interface=`` or ``control=`` is resolved as the channel is added
(:func:`slipstream.daemon.conductor.network_records._resolved` turns it into an IP literal),
never inside the duty cycle.  ``getaddrinfo`` blocks, for as long as the resolver's timeouts (glibc:
5 s per try, per name server), so the driver shell resolves a command's names in a thread
first (:func:`resolve`) and hands the command to the conductor once they are known; the
conductor then finds them here (:func:`lookup`).  A blocked resolver delays that one command,
never the heartbeats, status messages or the systemd watchdog.

A name can move (a pod rescheduled, a host re-addressed): :class:`NameWatch` is the
conductor's schedule of names to resolve again (Aeron's re-resolution).  Every
``name_re_resolution_interval`` it names those whose users lost contact with their peer; the
driver's runner resolves them in a thread, as above, and hands the answers back
(:meth:`NameWatch.answered`), which says whose address changed.  The conductor, which only
ever handles IP literals, applies the new address (docs/CHANNELS.md §7.2).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final, Generic, TypeVar

import attrs

from slipstream.client.channel import Channel, resolve_host
from slipstream.client.errors import ChannelError

log = logging.getLogger("slipstream.driver")

#: How long an answer (or a failure) is reused, s.
TTL_S: Final = 30.0
#: How long a command waits for its names before it is refused, s.
PREFETCH_TIMEOUT_S: Final = 5.0
#: How many names due are resolved again at once, each in a thread of its own and handed
#: to the conductor as it answers: a name whose resolver hangs holds one, never the others'
#: answers.  More names due wait for a free one.
RESOLVER_THREADS: Final = 4

_cache: dict[str, tuple[str | None, str, float]] = {}  # name -> (address, error, expiry)
_lock = threading.Lock()


def names_of(channel: Channel) -> list[tuple[str, str]]:
    """The (URI part, host) pairs of ``channel`` that are names, not IP literals."""
    parts = [("endpoint", channel.endpoint), ("interface", channel.interface),
             ("control", channel.control)]
    return [(part, hp.host) for part, hp in parts if hp is not None and hp.ip is None]


def needs_prefetch(channel: Channel) -> bool:
    """Whether one of the channel's names has no fresh answer yet."""
    now = time.monotonic()
    with _lock:
        return any(host not in _cache or _cache[host][2] < now
                   for _, host in names_of(channel))


def resolve(hosts: Iterable[str], *, remember_failures: bool = True) -> dict[str, str | None]:
    """Resolve ``hosts`` now (blocking: call it in a thread), remember the answers and return
    them (None: the host did not resolve).  ``remember_failures`` False (a re-resolution):
    a failure is not kept, so a transient one refuses no channel added meanwhile."""
    answers: dict[str, str | None] = {}
    for host in hosts:
        try:
            address: str | None = resolve_host(host)
            error = ""
        except (OSError, UnicodeError, ValueError) as e:  # a name IDNA cannot encode, too
            address, error = None, str(e)
        if address is not None or remember_failures:
            with _lock:
                _cache[host] = (address, error, time.monotonic() + TTL_S)
        answers[host] = address
    return answers


def resolve_again(hosts: Iterable[str]) -> dict[str, str | None]:
    """:func:`resolve` for the names :class:`NameWatch` asks for again."""
    return resolve(hosts, remember_failures=False)


def lookup(channel: Channel, part: str, host: str) -> str:
    """The IP literal for ``host`` (a literal as is; a name from the cache, or resolved now
    when nothing prefetched it: the simulator, tests); ChannelError naming ``part`` when it
    does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    with _lock:
        cached = _cache.get(host)
    if cached is None or cached[2] < time.monotonic():
        resolve([host])
        with _lock:
            cached = _cache[host]
    address, error, _ = cached
    if address is None:
        raise ChannelError(str(channel), part, f"cannot resolve {host!r}: {error}")
    return address


U = TypeVar("U")


@attrs.define(eq=False)
class _Watched(Generic[U]):
    user: U
    name: str
    address: str
    has_contact: Callable[[], bool]
    #: The move to ``address`` did not take (:meth:`NameWatch.retry`): the next answer is
    #: applied even when it is the same address.
    unapplied: bool = False
    #: An answer of the other IP version last warned about (logged once per change).
    refused: str | None = None


class NameWatch(Generic[U]):
    """Which names to resolve again, and when (sans-I/O: time is an argument).

    A *user* (a send endpoint whose ``endpoint=`` is a name, say) is watched with its name,
    the address it sends to now and a way to ask whether it is in contact with its peer.
    Every ``interval_ns`` :meth:`due` names the names of users out of contact, each once,
    except those still being resolved (a slow resolver is never asked twice at once); users
    in contact keep their address, so a name with several records (a round-robin service)
    never moves a stream that flows.  :meth:`answered` takes the resolver's answers and
    returns the users whose address changed, with the new one; a name that did not resolve
    keeps its address and is asked again at the next check, as is one whose move did not
    take (:meth:`retry`).  ``interval_ns`` 0: never."""

    def __init__(self, interval_ns: int) -> None:
        self.interval_ns = interval_ns
        self._watched: list[_Watched[U]] = []
        self._resolving: set[str] = set()
        self._next_check_ns: int | None = None

    def watch(self, user: U, name: str, address: str, has_contact: Callable[[], bool],
              now_ns: int) -> None:
        """Resolve ``name`` again for ``user`` (which sends to ``address`` now) whenever
        ``has_contact()`` is False at a check, the first ``interval_ns`` after ``now_ns``."""
        self._watched.append(_Watched(user, name, address, has_contact))
        if self._next_check_ns is None:
            self._next_check_ns = now_ns + self.interval_ns

    def unwatch(self, user: U) -> None:
        """``user`` is gone: nothing of it is resolved or changed any more."""
        self._watched = [w for w in self._watched if w.user is not user]
        if not self._watched:
            self._next_check_ns = None

    def retry(self, user: U, address: str) -> None:
        """The move of ``user`` to ``address`` did not take (its socket could not connect
        there, and still sends where it did): the next check asks for its name again, even if
        the answer is that same address.  A failure that comes after ``user`` was moved on to
        another address is no longer about where it sends, and changes nothing."""
        for watched in self._watched:
            if watched.user is user and watched.address == address:
                watched.unapplied = True

    def address_of(self, user: U) -> str | None:
        """The address ``user`` sends to now (None: not watched)."""
        return next((w.address for w in self._watched if w.user is user), None)

    @property
    def next_check_ns(self) -> int | None:
        """When :meth:`due` next has something to say (None: nothing watched, or never)."""
        return None if self.interval_ns <= 0 else self._next_check_ns

    def due(self, now_ns: int) -> list[str]:
        """The names to resolve now (the caller resolves them off its loop and hands the
        answers to :meth:`answered`); empty between checks."""
        check = self.next_check_ns
        if check is None or now_ns < check:
            return []
        self._next_check_ns = now_ns + self.interval_ns
        names: list[str] = []
        for watched in self._watched:
            if (watched.name not in self._resolving and watched.name not in names
                    and not watched.has_contact()):
                names.append(watched.name)
        self._resolving.update(names)
        return names

    def answered(self, names: Iterable[str],
                 answers: Mapping[str, str | None]) -> list[tuple[U, str, str]]:
        """The resolver is done with ``names`` (``answers``: an address, or None for a name
        that did not resolve; a name missing: the resolver gave up): the users whose address
        changed and that are still out of contact, as ``(user, old, new)``, which now count as
        at the new one (one whose move did not take, :meth:`retry`, comes again with its
        address as both).  An address of the other IP version is not followed (logged)."""
        names = set(names)
        self._resolving -= names
        changes: list[tuple[U, str, str]] = []
        for watched in self._watched:
            new = answers.get(watched.name) if watched.name in names else None
            if new is None:
                continue
            if ipaddress.ip_address(new).version != ipaddress.ip_address(watched.address).version:
                # The socket is of one IP version: a name that moved to the other is not
                # followed (the channel must be added again).  Said once per such answer,
                # not at every check.
                if new != watched.refused and not watched.has_contact():
                    watched.refused = new
                    log.warning("%s resolves to %s now, another IP version than %s: not "
                                "followed", watched.name, new, watched.address)
                continue
            watched.refused = None
            if (new == watched.address and not watched.unapplied) or watched.has_contact():
                continue
            changes.append((watched.user, watched.address, new))
            watched.address = new
            watched.unapplied = False
        return changes
