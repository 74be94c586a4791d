"""What the sender and receiver agents share: the endpoints they serve, the commands other
threads hand them, and the doorbells they arm before their thread parks."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from slipstream.client._native import lib

Endpoint = TypeVar("Endpoint")


class Agent(Generic[Endpoint]):
    """A duty-cycle agent (Aeron's Agent): single-threaded, except :meth:`submit`."""

    def __init__(self) -> None:
        self.endpoints: list[Endpoint] = []
        self._commands: deque[Callable[[int], None]] = deque()
        self._armed: list[object] = []  # the driver-waiters words raised by prepare_to_park

    def submit(self, command: Callable[[int], None]) -> None:
        """Run ``command(now_ns)`` on the agent's thread at its next duty cycle (thread-safe)."""
        self._commands.append(command)

    def add_endpoint(self, endpoint: Endpoint) -> None:
        self.endpoints.append(endpoint)

    def remove_endpoint(self, endpoint: Endpoint) -> None:
        """Stop using ``endpoint``; its owner closes it."""
        if endpoint in self.endpoints:
            self.endpoints.remove(endpoint)

    def _run_commands(self, now_ns: int) -> int:
        """Run the submitted commands; returns how many ran."""
        ran = 0
        commands = self._commands
        while commands:
            commands.popleft()(now_ns)
            ran += 1
        return ran

    def _arm(self, waiters: object) -> None:
        """Raise a log's driver-waiters word (cffi ``int32_t *``) so its client rings the
        doorbell; :meth:`unpark` lowers it again."""
        lib.ss_get_and_add_i32(waiters, 1)  # seq_cst: pairs with the client's fence
        self._armed.append(waiters)

    def unpark(self) -> None:
        """After a park (woken by a socket, a doorbell or a timer), or instead of one: lower
        every doorbell :meth:`prepare_to_park` raised."""
        for waiters in self._armed:
            lib.ss_get_and_add_i32(waiters, -1)
        self._armed.clear()

    @property
    def has_commands(self) -> bool:
        return bool(self._commands)
