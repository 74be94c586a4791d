"""The event loops the async tests run under: each test marked ``anyio`` runs once per loop
(anyio's pytest plugin parametrizes it by its ``anyio_backend`` fixture: ``asyncio`` and
``trio``).  Under trio it runs as every other async test here does, by pytest-trio's
``trio.run`` (``trio_mode``), so that trio's own loop is what the trio runs test, not anyio's
guest-mode runner; under asyncio it runs by anyio's runner (``asyncio.run``'s loop).  And
:func:`another_task`, which shows whether a call lets the loop's other tasks run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest


@pytest.hookimpl(trylast=True)  # after pytest-trio's trio_mode marked every coroutine test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The asyncio run of a test marked ``anyio`` keeps no ``trio`` mark: with one,
    pytest-trio would run it under ``trio.run`` too."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("anyio_backend") == "asyncio":
            item.own_markers[:] = [mark for mark in item.own_markers if mark.name != "trio"]


class Turns:
    """How many turns a task has had (:attr:`count`)."""

    def __init__(self) -> None:
        self.count = 0


@asynccontextmanager
async def another_task(pause_s: float = 0) -> AsyncIterator[Turns]:
    """Another task of the running loop for the body's time: it counts a turn, sleeps
    ``pause_s`` (0: yields to the loop only), and again, until the body ends; yields its
    :class:`Turns`."""
    turns = Turns()

    async def take_turns() -> None:
        while True:
            turns.count += 1
            await anyio.sleep(pause_s)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(take_turns)
        yield turns
        tasks.cancel_scope.cancel()
