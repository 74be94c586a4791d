"""Host names in channel URIs, resolved by a resolver of their own, never on the conductor's
thread, and resolved again when the peer they name goes silent.

A name in ``endpoint=``, ``interface=`` or ``control=`` is resolved before its command
reaches the conductor, and replaced by an IP literal as the channel is added
(:func:`slipstream.daemon.conductor.network_records._resolved`).  ``getaddrinfo`` blocks, for
as long as the resolver's timeouts (glibc: 5 s per try, per name server), so resolution has an
owner, :class:`NameResolver` (Aeron's conductor hands it to its executor the same way): the
driver's runner, on the conductor's thread, sends it a :class:`ResolveNames` command and goes
on serving every other client; each command is resolved on a thread of the resolver's, which
queues the :class:`NamesResolved` answer and wakes the runner.  Back on the conductor's thread,
the answers go into the driver's :class:`NameCache` and the command waiting for them is
handled; one not answered within :data:`PREFETCH_TIMEOUT_S` is refused, naming its hosts.  A
blocked resolver delays that one command and the same client's later ones, which wait behind
it in order (daemon/core.py), never the heartbeats, status messages, other clients' commands
or the systemd watchdog.

Which thread owns what (:data:`~slipstream.daemon.streams.ownership.NAME_THREADS`): the
cache is the conductor thread's alone (no lock: nothing else touches it); the resolver's
threads touch only their command and the queue of answers.

A name can move (a pod rescheduled, a host re-addressed): :class:`NameWatch` is the
conductor's schedule of names to resolve again (Aeron's re-resolution).  Every
``name_re_resolution_interval`` it names those whose users lost contact with their peer; the
driver's runner sends them to the resolver (``again``: each on its own, at most
:data:`RESOLVER_THREADS` at once) and hands the answers back (:meth:`NameWatch.answered`),
which says whose address changed.  The conductor, which only ever handles IP literals,
applies the new address (docs/CHANNELS.md §7.2).
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import queue
import threading
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
#: The resolver's threads, started as commands come: a command waits for a free one, so that
#: commands naming hosts that hang (``getaddrinfo``: 5 s a try) cannot start a thread each.
RESOLVER_POOL: Final = 16


def names_of(channel: Channel) -> list[tuple[str, str]]:
    """The (URI part, host) pairs of ``channel`` that are names, not IP literals."""
    parts = [("endpoint", channel.endpoint), ("interface", channel.interface),
             ("control", channel.control)]
    return [(part, hp.host) for part, hp in parts if hp is not None and hp.ip is None]


def ip_literal(host: str) -> str | None:
    """``host`` as an IP literal's canonical text, or None when it is a name."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


@attrs.frozen
class Answer:
    """What the resolver said of one name: its ``address`` (None: it did not resolve, and
    ``error`` says why)."""

    address: str | None
    error: str = ""


def resolve(hosts: Iterable[str]) -> dict[str, Answer]:
    """Resolve ``hosts`` now: blocking, so a resolver's thread's (:class:`NameResolver`);
    it touches nothing shared."""
    answers: dict[str, Answer] = {}
    for host in hosts:
        try:
            answers[host] = Answer(resolve_host(host))
        except (OSError, UnicodeError, ValueError) as e:  # a name IDNA cannot encode, too
            answers[host] = Answer(None, str(e))
    return answers


@attrs.frozen(eq=False)
class ResolveNames:
    """The conductor's thread asks :class:`NameResolver` for ``hosts``: answered by
    :class:`NamesResolved` with the same ``request``.  ``again``: a re-resolution
    (:class:`NameWatch`), one of at most :data:`RESOLVER_THREADS` resolving at once."""

    request: int
    hosts: tuple[str, ...]
    again: bool = False


@attrs.frozen(eq=False)
class NamesResolved:
    """The answer to :class:`ResolveNames` ``request``: an :class:`Answer` per host."""

    request: int
    answers: Mapping[str, Answer]


class NameResolver:
    """The owner of name resolution: :meth:`submit` (the conductor's thread) queues a command
    for one of at most :data:`RESOLVER_POOL` threads, which resolves its hosts, queues its
    :class:`NamesResolved` and calls ``wake`` (from that thread); :meth:`answered` (the
    conductor's thread) takes the answers queued.  The threads are daemons: one that hangs in
    ``getaddrinfo`` never holds up the driver's exit."""

    def __init__(self, wake: Callable[[], None]) -> None:
        """``wake``: tells the conductor's thread an answer is queued (any thread)."""
        self._wake = wake
        self._again = threading.BoundedSemaphore(RESOLVER_THREADS)
        # Put by the conductor's thread, taken by the resolver's.
        self._commands: queue.SimpleQueue[ResolveNames | None] = queue.SimpleQueue()
        self._threads = 0  # started (the conductor thread's)
        # Appended by the resolver's threads, taken by the conductor's (a deque's append and
        # popleft are atomic).
        self._answers: collections.deque[NamesResolved] = collections.deque()

    # -- the conductor thread's: the commands, and their answers ----------------------------
    def submit(self, command: ResolveNames) -> None:
        """Queue ``command`` for the resolver's threads, starting one more while fewer than
        :data:`RESOLVER_POOL` run (the conductor's thread).  A thread that cannot be started
        leaves the command to those that run, or, with none, answers it unresolved."""
        self._commands.put(command)
        if self._threads < RESOLVER_POOL:
            try:
                threading.Thread(target=self._serve, name="ss-resolve", daemon=True).start()
            except RuntimeError as e:  # no thread to be had
                if self._threads == 0:
                    log.error("cannot start a thread to resolve %s: %s",
                              ", ".join(command.hosts), e)
                    self._answers.append(NamesResolved(command.request, {}))
                    self._commands.get()  # answered: no thread is to take it
                    self._wake()
                return
            self._threads += 1

    def close(self) -> None:
        """End the resolver's threads as they finish what they resolve (the conductor's
        thread, as the driver closes; a command queued after is never answered)."""
        for _ in range(self._threads):
            self._commands.put(None)
        self._threads = RESOLVER_POOL  # no more

    def answered(self) -> list[NamesResolved]:
        """The answers queued since the last call, oldest first (the conductor's thread)."""
        answers = []
        while self._answers:
            answers.append(self._answers.popleft())
        return answers

    # -- a resolver thread's: the commands queued, one at a time -----------------------------
    def _serve(self) -> None:
        while (command := self._commands.get()) is not None:
            self._resolve(command)

    def _resolve(self, command: ResolveNames) -> None:
        """A resolver's thread: the answer is queued whatever happens (a host missing from
        it: the resolver failed)."""
        answers: dict[str, Answer] = {}
        try:
            if command.again:
                with self._again:
                    answers = resolve(command.hosts)
            else:
                answers = resolve(command.hosts)
        finally:
            self._answers.append(NamesResolved(command.request, answers))
            self._wake()


class NameCache:
    """The driver's answers for names, each reused for :data:`TTL_S`: the conductor thread's
    alone (the resolver's threads hand their answers over, :class:`NamesResolved`).  Nothing
    here resolves: :meth:`lookup` answers from what :meth:`store` kept."""

    def __init__(self) -> None:
        self._answers: dict[str, tuple[Answer, float]] = {}  # name -> (answer, expiry, s)

    # -- the conductor thread's: every method -----------------------------------------------
    def unresolved(self, channel: Channel, now_s: float) -> list[str]:
        """The names of ``channel`` with no fresh answer (monotonic ``now_s``), each once."""
        hosts: list[str] = []
        for _, host in names_of(channel):
            kept = self._answers.get(host)
            if (kept is None or kept[1] < now_s) and host not in hosts:
                hosts.append(host)
        return hosts

    def store(self, answers: Mapping[str, Answer], now_s: float, *,
              remember_failures: bool = True) -> None:
        """Keep ``answers`` until ``now_s + TTL_S``.  ``remember_failures`` False (a
        re-resolution): a failure is not kept, so a transient one refuses no channel added
        meanwhile."""
        for host, answer in answers.items():
            if answer.address is not None or remember_failures:
                self._answers[host] = (answer, now_s + TTL_S)

    def lookup(self, channel: Channel, part: str, host: str) -> str:
        """The IP literal for ``host`` (a literal as is; a name from what was stored, fresh
        or not: its command was resolved for just before it was handled); ChannelError
        naming ``part`` when it did not resolve, or was never resolved."""
        literal = ip_literal(host)
        if literal is not None:
            return literal
        kept = self._answers.get(host)
        if kept is None:
            raise ChannelError(str(channel), part, f"{host!r} was not resolved before its "
                                                   f"channel was added")
        answer = kept[0]
        if answer.address is None:
            raise ChannelError(str(channel), part, f"cannot resolve {host!r}: {answer.error}")
        return answer.address


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
