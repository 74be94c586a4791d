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

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from slipstream.client.layout import NO_DEADLINE
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network
from slipstream.daemon.media import send_point

Endpoint = TypeVar("Endpoint")
Command = TypeVar("Command")

#: ``ss_agent_python_due``'s clock for "due whatever the time" (every timer in the future).
_NEVER = -NO_DEADLINE
#: Its reasons to run the Python half other than the Python half's timer.
_DUE_BUT_TIMER = ~network.SS_DUE_TIMER


class Agent(Generic[Endpoint, Command]):
    """A duty-cycle agent (Aeron's Agent): single-threaded, except :meth:`enqueue`."""

    def __init__(self, *, is_sender: bool, max_datagrams: int = 0,
                 status_poll_ratio: int = 1) -> None:
        """``max_datagrams``: datagrams one publication sends per duty cycle;
        ``status_poll_ratio``: a busy sender reads control input after 2 x this datagrams."""
        self.endpoints: list[Endpoint] = []
        self._commands: deque[Command] = deque()
        #: The C half's view of this agent (ss_agent_t); :meth:`_sync_c` keeps it current.
        self.c = c = network_ffi.new("ss_agent_t *")
        c.is_sender = int(is_sender)
        c.max_datagrams = max_datagrams
        c.status_poll_ratio = status_poll_ratio
        self._spans = network_ffi.new("ss_span_t[]", max_datagrams + network.SS_RETRANSMIT_MAX)
        c.spans = self._spans
        c.python_deadline_ns = 0
        self._arrays: tuple[object, ...] = ()
        self._c_members: tuple[object, ...] | None = None
        #: Some endpoint or publication has no socket (the simulator's): see _virtual_io.
        self._has_virtual_io = True

    def enqueue(self, command: Command) -> None:
        """Queue ``command`` for the agent's next Python pass, which runs it with that pass's
        ``now`` (:meth:`on_command`), in order (thread-safe; the caller then wakes a parked
        thread: the proxies of :mod:`~slipstream.daemon.agents.commands` do both)."""
        self._commands.append(command)
        self.c.commands = 1

    def on_command(self, command: Command, now_ns: int) -> None:
        """Run one command on the agent's thread: the agent's one dispatch of them."""
        raise NotImplementedError

    def add_endpoint(self, endpoint: Endpoint) -> None:
        self.endpoints.append(endpoint)

    def remove_endpoint(self, endpoint: Endpoint) -> None:
        """Stop using ``endpoint``; its owner closes it."""
        if endpoint in self.endpoints:
            self.endpoints.remove(endpoint)

    def _run_commands(self, now_ns: int) -> int:
        """Run the queued commands; returns how many ran."""
        self.c.commands = 0  # before the queue: a command queued meanwhile raises it again
        ran = 0
        commands = self._commands
        try:
            while commands:
                self.on_command(commands.popleft(), now_ns)
                ran += 1
        finally:
            if commands:  # one raised: the rest run at the next pass, not at some timer
                self.c.commands = 1
        return ran

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
        if c.due or python_input:
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
        """(endpoint receivers, images, send publications): the C structs the C half reads."""
        raise NotImplementedError

    def _sync_c(self, python_deadline_ns: Callable[[], int]) -> None:
        """Point the C half at the current endpoints, images and publications, then give it
        the Python half's next deadline (0, Python at once, if that fails)."""
        receivers, images, publications = members = self._c_view()
        flat = (*receivers, *images, *publications)
        if flat != self._c_members:
            self._c_members = flat
            c = self.c
            arrays = (network_ffi.new("ss_receiver_t *[]", receivers or 1),
                      network_ffi.new("ss_image_t *[]", images or 1),
                      network_ffi.new("ss_send_publication_t *[]", publications or 1))
            c.endpoints, c.images, c.publications = arrays
            c.endpoint_count, c.image_count, c.publication_count = map(len, members)
            self._arrays = (*arrays, *self._by_fd(receivers, publications))
        self._has_virtual_io = self._virtual_members()
        network.ss_agent_schedule_heartbeats(self.c)
        self.c.python_deadline_ns = 0
        self.c.python_deadline_ns = python_deadline_ns()

    def _by_fd(self, receivers: list, publications: list) -> tuple[object, ...]:
        """The C half's tables sized by the arrays: each endpoint by its fd (the network
        thread's poll marks those readable), the send sockets' marks (a pass groups its
        publications by socket) and the heartbeat timers' heap (ss_agent_t); returns them, to
        keep alive while the C half reads them."""
        c = self.c
        by_fd_count = 1 + max((r.fd for r in receivers), default=-1)
        by_fd = network_ffi.new("ss_receiver_t *[]", max(1, by_fd_count))
        for receiver in receivers:
            if receiver.fd >= 0:
                by_fd[receiver.fd] = receiver
        c.receivers_by_fd, c.receivers_by_fd_count = by_fd, by_fd_count
        mark_count = 1 + max((p.fd for p in publications), default=-1)
        marks = network_ffi.new("int64_t[]", 2 * max(1, mark_count))
        c.socket_marks, c.socket_mark_count, c.socket_pass = marks, mark_count, 0
        heap = network_ffi.new("int32_t[]", max(1, len(publications)))
        keys = network_ffi.new("int64_t[]", max(1, len(publications)))
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
