"""What the sender and receiver agents share: the endpoints they serve, the commands the
conductor queues for them (:mod:`slipstream.daemon.agents.commands`), and their two halves.

An agent's duty cycle has a C half and a Python half (docs/ARCHITECTURE.md, Threads).  The C
half (``ss_agent_do_work`` over :attr:`Agent.c`) does the per-datagram work of the endpoints
that have sockets (receive, insert, answer NAKs, send; a connected publication's pub-lmt and
cleaning; for a plain unicast stream also the image's rebuild pass, its NAKs and SMs, the
25 % rule's and the timer's, its cleaning and liveness, the publication's heartbeats, and
reading those SMs at the sender, with their receiver's liveness) and decides whether the
Python half is due: commands, datagrams for Python (SETUP, RTTM, an SM it does not take,
...), a rebuild pass, status message or cleaning of an image that C does not handle, the
next publisher-limit step of a publication whose limit C does not move, a liveness timeout,
or a timer of the Python half.  The Python
half (:meth:`Agent.do_python_work`) runs only then, so a busy stream costs Python per batch,
never per duty cycle.  The driver's network thread runs the C half in a C loop
(``ss_duty_loop_run``, :mod:`slipstream.daemon.agents.thread`); the simulator calls
:meth:`Agent.do_work` with its own clock, which runs the same C half and rule.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.media import send_point

Endpoint = TypeVar("Endpoint")
Command = TypeVar("Command")
Member = TypeVar("Member")

#: ``ss_agent_python_due``'s clock for "due whatever the time" (every timer in the future).
_NEVER = -NO_DEADLINE
#: Its reasons to run the Python half other than the Python half's timer.
_DUE_BUT_TIMER = ~network.SS_DUE_TIMER
#: The reason of a Python half due for its commands alone.
_DUE_COMMANDS_ONLY = network.SS_DUE_COMMANDS


class DueTimers(Generic[Member]):
    """Each member's next timer (a time in ns, the agent's clock), in a heap: a pass takes
    the members whose time came (:meth:`take_due`) without looking at the others.  A member
    has at most one timer; setting it again replaces it (the old heap entry stays, stale,
    until it comes up or the heap is compacted)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Member]] = []
        self._due_at: dict[int, tuple[int, Member]] = {}  # by id(member)
        self._order = itertools.count()  # ties go in the order set, never by member

    def __len__(self) -> int:
        """The members with a timer."""
        return len(self._due_at)

    def set(self, member: Member, due_ns: int) -> None:
        """``member``'s timer at ``due_ns`` (NO_DEADLINE: none)."""
        key = id(member)
        if due_ns >= NO_DEADLINE:
            self._due_at.pop(key, None)
            return
        entry = self._due_at.get(key)
        if entry is not None and entry[0] == due_ns:
            return
        self._due_at[key] = (due_ns, member)
        heap = self._heap
        if len(heap) > 2 * len(self._due_at) + 64:  # mostly stale: made anew, O(members)
            self._heap = heap = [(due, next(self._order), m) for due, m in self._due_at.values()]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (due_ns, next(self._order), member))

    def forget(self, member: object) -> None:
        """``member`` has no timer from now on (it left the agent)."""
        self._due_at.pop(id(member), None)

    def clear(self) -> None:
        self._heap.clear()
        self._due_at.clear()

    def _is_current(self, due_ns: int, member: Member) -> bool:
        entry = self._due_at.get(id(member))
        return entry is not None and entry[0] == due_ns and entry[1] is member

    def take_due(self, now_ns: int) -> list[Member]:
        """The members whose timer is at or before ``now_ns``, earliest first; their timers
        go (the pass that visits them sets the next)."""
        heap, due = self._heap, []
        while heap and heap[0][0] <= now_ns:
            due_ns, _, member = heapq.heappop(heap)
            if self._is_current(due_ns, member):
                del self._due_at[id(member)]
                due.append(member)
        return due

    def earliest(self) -> int:
        """The earliest timer (NO_DEADLINE: none)."""
        heap = self._heap
        while heap:
            due_ns, _, member = heap[0]
            if self._is_current(due_ns, member):
                return due_ns
            heapq.heappop(heap)
        return NO_DEADLINE


class MemberArray:
    """One of the C half's arrays of members (cffi pointers of ``ctype``: its endpoints'
    receivers, images or send publications), each with its owner on the Python side (an
    endpoint, a publication's pair), in the C half's order: the indices of its list of
    members due (``due_members``).  Grown by doubling: adding a member costs the same at 10
    members and at 10,000; removing one moves those after it down, in C."""

    def __init__(self, ctype: str) -> None:
        self._ctype = ctype
        self._size = network_ffi.sizeof(ctype)
        self.members: list = []  # the cffi pointers
        self.owners: list = []
        self.array = network_ffi.new(f"{ctype}[]", 1)
        self.capacity = 1

    def __len__(self) -> int:
        return len(self.members)

    def reset(self, members: list[tuple[object, object]]) -> None:
        """Hold ``members``, (pointer, owner) each, and nothing else."""
        self.members = [member for member, _ in members]
        self.owners = [owner for _, owner in members]
        self.capacity = max(1, len(members))
        self.array = network_ffi.new(f"{self._ctype}[]", self.members or 1)

    def append(self, member: object, owner: object) -> bool:
        """Add ``member`` last; whether the array moved (grew)."""
        count = len(self.members)
        grew = count == self.capacity
        if grew:
            array = network_ffi.new(f"{self._ctype}[]", 2 * self.capacity)
            network_ffi.memmove(array, self.array, count * self._size)
            self.array, self.capacity = array, 2 * self.capacity
        self.array[count] = member
        self.members.append(member)
        self.owners.append(owner)
        return grew

    def remove(self, member: object) -> bool:
        """Take ``member`` out (whether it was in)."""
        members = self.members
        for i in range(len(members) - 1, -1, -1):  # the newest first: images come and go
            if members[i] == member:
                break
        else:
            return False
        moved = len(members) - i - 1
        if moved:
            network_ffi.memmove(self.array + i, self.array + i + 1, moved * self._size)
        del members[i], self.owners[i]
        self.array[len(members)] = network_ffi.NULL  # no copy of it left behind
        return True

    def remove_owned_by(self, owner: object) -> list:
        """Take out every member ``owner`` owns; returns them."""
        kept = [(m, o) for m, o in zip(self.members, self.owners, strict=True) if o is not owner]
        if len(kept) == len(self.members):
            return []
        gone = [m for m, o in zip(self.members, self.owners, strict=True) if o is owner]
        self.reset(kept)
        return gone


class Agent(Generic[Endpoint, Command]):
    """A duty-cycle agent (Aeron's Agent): single-threaded, except :meth:`enqueue`."""

    def __init__(self, *, is_sender: bool, max_datagrams: int = 0,
                 status_poll_ratio: int = 1) -> None:
        """``max_datagrams``: datagrams one publication sends per duty cycle;
        ``status_poll_ratio``: a busy sender reads control input after 2 x this datagrams."""
        self.endpoints: list[Endpoint] = []
        self._endpoint_ids: dict[int, Endpoint] = {}  # the endpoints, by id
        #: Each member (an endpoint; a sender's publication) by id: its place in the
        #: agent's order (they are added at the end), kept as they come and go, so that a
        #: pass orders the members it visits without a look at the others.
        self._order: dict[int, int] = {}
        self._next_order = 0
        #: The endpoints added or removed since the network thread last took them
        #: (:meth:`take_endpoint_changes`), by id: it registers their sockets with its poll,
        #: or unregisters them, without a look at the other endpoints.  Kept only for a
        #: thread that takes them (:meth:`track_endpoint_changes`).
        self._endpoint_changes: dict[int, Endpoint] | None = None
        self._commands: deque[Command] = deque()
        #: The C half's view of this agent (ss_agent_t); :meth:`_sync_c` keeps it current.
        self.c = c = network_ffi.new("ss_agent_t *")
        c.is_sender = int(is_sender)
        c.max_datagrams = max_datagrams
        c.status_poll_ratio = status_poll_ratio
        self._spans = network_ffi.new("ss_span_t[]", max_datagrams + network.SS_RETRANSMIT_MAX)
        c.spans = self._spans
        c.python_deadline_ns = 0
        #: The C half's arrays of members (see _sync_members) and its tables sized by them
        #: (_by_fd), kept alive while it reads them.
        self._receivers = MemberArray("ss_receiver_t *")
        self._images = MemberArray("ss_image_t *")
        self._sends = MemberArray("ss_send_publication_t *")
        self._tables: tuple[object, ...] = ()
        self._due_list: object = network_ffi.NULL  # the C half's due_members
        self._due_room = 0
        #: Whether the C half's view is to be made anew from _c_view at the next _sync_c (at
        #: first, and after a change the agent did not follow member by member).
        self._members_changed = True
        #: Some endpoint or publication has no socket (the simulator's): see _virtual_io.
        self._has_virtual_io = True
        #: Commands run since the agent was made that may have changed its members (its
        #: endpoints change only by them): all but those :meth:`on_command` said False of.
        self.member_commands = 0
        #: The streams (publications, images) the last Python pass visited: the ones whose
        #: rules and timers it ran and whose deadlines it asked (0: a pass of commands that
        #: changed no stream's rules or timers, see :meth:`on_command`).
        self.streams_visited = 0

    def enqueue(self, command: Command) -> None:
        """Queue ``command`` for the agent's next Python pass, which runs it with that pass's
        ``now`` (:meth:`on_command`), in order (thread-safe; the caller then wakes a parked
        thread: the proxies of :mod:`~slipstream.daemon.agents.commands` do both)."""
        self._commands.append(command)
        self.c.commands = 1

    def on_command(self, command: Command, now_ns: int) -> bool | None:
        """Run one command on the agent's thread: the agent's one dispatch of them.  Returns
        False when it changed no stream's rules or timers (nor the agent's members): a pass
        due for such commands alone visits no stream."""
        raise NotImplementedError

    def add_endpoint(self, endpoint: Endpoint) -> None:
        self.endpoints.append(endpoint)
        self._endpoint_ids[id(endpoint)] = endpoint
        if self._endpoint_changes is not None:
            self._endpoint_changes[id(endpoint)] = endpoint
        self._place(endpoint)

    def remove_endpoint(self, endpoint: Endpoint) -> None:
        """Stop using ``endpoint``; its owner closes it."""
        if self.serves(endpoint):
            self.endpoints.remove(endpoint)
            del self._endpoint_ids[id(endpoint)], self._order[id(endpoint)]
            if self._endpoint_changes is not None:
                self._endpoint_changes[id(endpoint)] = endpoint

    def _place(self, member: object) -> None:
        """``member`` (an endpoint, a publication) goes last in the agent's order."""
        self._order[id(member)] = self._next_order
        self._next_order += 1

    def _in_order(self, members: Iterable[Member]) -> list[Member]:
        """``members`` that are the agent's still, in its order."""
        order = self._order
        return sorted((m for m in members if id(m) in order), key=lambda m: order[id(m)])

    def serves(self, endpoint: object) -> bool:
        """Whether ``endpoint`` is one of the agent's endpoints."""
        return self._endpoint_ids.get(id(endpoint)) is endpoint

    def track_endpoint_changes(self) -> dict[int, Endpoint]:
        """From now on keep the endpoints added or removed for :meth:`take_endpoint_changes`
        (the network thread that polls their sockets calls this once); returns the
        endpoints there are now, by id."""
        self._endpoint_changes = {}
        return dict(self._endpoint_ids)

    def take_endpoint_changes(self) -> dict[int, Endpoint]:
        """The endpoints added or removed since the last call, by id."""
        changes, self._endpoint_changes = self._endpoint_changes or {}, {}
        return changes

    def _run_commands(self, now_ns: int) -> tuple[int, bool]:
        """Run the queued commands: (how many ran, whether the pass need not visit the
        streams for them).  The latter holds when the pass is due for its commands alone
        (``c.due``: no input, no stream's rule, no timer) and each of them changed no
        stream's rules or timers nor the agent's members (:meth:`on_command` said False, as
        a governor step that keeps every interval does): the C half's view and the Python
        half's deadline then stay as they are."""
        light = self.c.due == _DUE_COMMANDS_ONLY
        self.c.commands = 0  # before the queue: a command queued meanwhile raises it again
        ran = 0
        commands = self._commands
        try:
            while commands:
                # Counted first: one that raises may have changed the members.
                self.member_commands += 1
                if self.on_command(commands.popleft(), now_ns) is False:
                    self.member_commands -= 1
                else:
                    light = False
                ran += 1
        finally:
            if commands:  # one raised: the rest run at the next pass, not at some timer
                self.c.commands = 1
        if light:
            self.streams_visited = 0
        return ran, light

    @property
    def has_commands(self) -> bool:
        return bool(self._commands)

    # -- the two halves -----------------------------------------------------------------------
    def do_work(self, now_ns: int) -> int:
        """One whole duty cycle at ``now_ns`` (the simulator's and the tests' entry; the
        driver's thread runs the C half in its C loop): the simulator's I/O, the C half, and
        the Python half if due.  Returns the work done (0: idle)."""
        c = self.c
        work, python_input = self._virtual_io(now_ns) if self._has_virtual_io else (0, False)
        work += network.ss_agent_do_work(c, now_ns)
        send_point.raise_port_errors()  # the C half's sends through the simulator's ports
        if python_input:
            c.due |= network.SS_DUE_INPUT  # the simulator's: for do_python_work to see
        if c.due:
            work += self.do_python_work(now_ns)
        return work

    def do_python_work(self, now_ns: int) -> int:
        """The Python half: commands, input for Python, timers; then the C half's view is
        brought up to date (:meth:`_sync_c`).  Returns the work done."""
        raise NotImplementedError

    def _virtual_io(self, now_ns: int) -> tuple[int, bool]:
        """The I/O of endpoints without sockets (the simulator's): (work, whether any input
        was handed to Python)."""
        raise NotImplementedError

    def _virtual_members(self) -> bool:
        """Whether an endpoint or publication has no socket (its I/O is _virtual_io's)."""
        raise NotImplementedError

    def _c_view(self) -> tuple[list, list, list]:
        """(endpoint receivers, images, send publications): the C structs the C half reads,
        each as (pointer, owner)."""
        raise NotImplementedError

    def _sync_c(self, python_deadline_ns: Callable[[], int]) -> None:
        """Point the C half at the current endpoints, images and publications (made anew
        from :meth:`_c_view` when a change was not followed member by member), then give it
        the Python half's next deadline (0, Python at once, if that fails)."""
        if self._members_changed:
            self._sync_members()
        network.ss_agent_schedule_heartbeats(self.c)
        self.c.python_deadline_ns = 0
        self.c.python_deadline_ns = python_deadline_ns()

    def _sync_members(self) -> None:
        """The C half's arrays made anew from :meth:`_c_view`.  If that fails the C half
        sees no member (not one that may have gone) until a later call succeeds."""
        self._members_changed = True  # until they are made
        try:
            receivers, images, publications = self._c_view()
            self._receivers.reset(receivers)
            self._images.reset(images)
            self._sends.reset(publications)
            self._point_c()
            self._tables = self._by_fd()
            self._has_virtual_io = self._virtual_members()
        except BaseException:
            c = self.c
            c.endpoint_count = c.image_count = c.publication_count = c.heartbeat_count = 0
            raise
        self._members_changed = False

    def _member_added(self, view: MemberArray, member: object, owner: object) -> None:
        """``member`` (a cffi pointer in ``view``, one of the C half's arrays) came, owned by
        ``owner``: the C half's view follows, at a cost that does not grow with the members
        (unless a view made anew is due anyway)."""
        if self._members_changed:
            return
        view.append(member, owner)
        self._point_c()  # before the array it may have outgrown is freed
        by_fd, marks, heap, keys = self._tables
        c = self.c
        if view is self._receivers and member.fd >= 0:  # type: ignore[attr-defined]
            fd = member.fd  # type: ignore[attr-defined]
            if fd >= c.receivers_by_fd_count:
                by_fd = self._grown(by_fd, "ss_receiver_t *[]", c.receivers_by_fd_count, fd)
                c.receivers_by_fd, c.receivers_by_fd_count = by_fd, len(by_fd)
            by_fd[fd] = member
        elif view is self._sends:
            fd = member.fd  # type: ignore[attr-defined]
            if fd >= c.socket_mark_count:
                marks = network_ffi.new("int64_t[]", 2 * 2 * (fd + 1))
                c.socket_marks, c.socket_mark_count = marks, 2 * (fd + 1)
            if len(self._sends) > len(heap):
                heap = network_ffi.new("int32_t[]", self._sends.capacity)
                keys = network_ffi.new("int64_t[]", self._sends.capacity)
                c.heartbeat_heap, c.heartbeat_keys, c.heartbeat_count = heap, keys, 0
        self._tables = (by_fd, marks, heap, keys)
        self._point_c()

    def _member_removed(self, view: MemberArray, member: object) -> None:
        """``member`` left ``view``: the C half's view follows (see _member_added)."""
        if self._members_changed or not view.remove(member):
            return
        self._forget_fd(view, member)
        self._point_c()
        if view is self._sends:  # the heartbeats' heap holds indices: keyed anew by _sync_c
            self.c.heartbeat_count = 0

    def _members_removed(self, view: MemberArray, owner: object) -> None:
        """Every member of ``view`` that ``owner`` owns left."""
        if self._members_changed:
            return
        for member in view.remove_owned_by(owner):
            self._forget_fd(view, member)
        self._point_c()
        if view is self._sends:
            self.c.heartbeat_count = 0

    def _forget_fd(self, view: MemberArray, member: object) -> None:
        """An endpoint's receiver that left is no longer found by its fd."""
        if view is not self._receivers:
            return
        by_fd = self._tables[0]
        fd = member.fd  # type: ignore[attr-defined]
        if 0 <= fd < self.c.receivers_by_fd_count and by_fd[fd] == member:
            by_fd[fd] = network_ffi.NULL

    @staticmethod
    def _grown(table: object, ctype: str, count: int, index: int) -> object:
        """A copy of ``table`` (``count`` entries, an array of ``ctype``) with room for
        ``index``."""
        grown = network_ffi.new(ctype, max(2 * count, index + 1))
        item = network_ffi.sizeof(network_ffi.typeof(grown).item)
        network_ffi.memmove(grown, table, count * item)
        return grown

    def _point_c(self) -> None:
        """The C half reads the arrays as they are now: their counts, and room in its list of
        members due for every member (set with the counts it is sized by)."""
        c = self.c
        receivers, images, sends = self._receivers, self._images, self._sends
        c.endpoints, c.images, c.publications = receivers.array, images.array, sends.array
        room = receivers.capacity + images.capacity + sends.capacity
        if room != self._due_room:
            self._due_list = network_ffi.new("int32_t[]", room)
            self._due_room = room
            c.due_members = self._due_list
        c.due_members_count = 0
        c.endpoint_count, c.image_count, c.publication_count = (
            len(receivers), len(images), len(sends))

    def _by_fd(self) -> tuple[object, ...]:
        """The C half's tables sized by the arrays: each endpoint by its fd (the network
        thread's poll marks those readable), the send sockets' marks (a pass groups its
        publications by socket) and the heartbeat timers' heap (ss_agent_t); returns them, to
        keep alive while the C half reads them."""
        c = self.c
        receivers, publications = self._receivers.members, self._sends.members
        by_fd_count = 1 + max((r.fd for r in receivers), default=-1)
        by_fd = network_ffi.new("ss_receiver_t *[]", max(1, by_fd_count))
        for receiver in receivers:
            if receiver.fd >= 0:
                by_fd[receiver.fd] = receiver
        c.receivers_by_fd, c.receivers_by_fd_count = by_fd, by_fd_count
        mark_count = 1 + max((p.fd for p in publications), default=-1)
        marks = network_ffi.new("int64_t[]", 2 * max(1, mark_count))
        c.socket_marks, c.socket_mark_count, c.socket_pass = marks, mark_count, 0
        heap = network_ffi.new("int32_t[]", self._sends.capacity)
        keys = network_ffi.new("int64_t[]", self._sends.capacity)
        c.heartbeat_heap, c.heartbeat_keys, c.heartbeat_count = heap, keys, 0
        return by_fd, marks, heap, keys

    def next_deadline_ns(self) -> int:
        """When a duty cycle is next due with no input (0: now; NO_DEADLINE: none): what the
        C half's rule says, given what the Python half last published."""
        # The simulator asks after every idle cycle of every host: locals, no property.
        if self._commands:
            return 0
        c = self.c
        if network.ss_agent_python_due(c, _NEVER) & _DUE_BUT_TIMER:
            return 0
        c_deadline = network.ss_agent_c_deadline(c)
        python_deadline = c.python_deadline_ns
        return python_deadline if python_deadline < c_deadline else c_deadline
