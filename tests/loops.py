"""The event loops the async tests run under: each test marked ``anyio`` runs once per loop
(anyio's pytest plugin parametrizes it by its ``anyio_backend`` fixture: ``asyncio`` and
``trio``).  Under trio it runs as every other async test here does, by pytest-trio's
``trio.run`` (``trio_mode``), so that trio's own loop is what the trio runs test, not anyio's
guest-mode runner; under asyncio it runs by anyio's runner (``asyncio.run``'s loop)."""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)  # after pytest-trio's trio_mode marked every coroutine test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The asyncio run of a test marked ``anyio`` keeps no ``trio`` mark: with one,
    pytest-trio would run it under ``trio.run`` too."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("anyio_backend") == "asyncio":
            item.own_markers[:] = [mark for mark in item.own_markers if mark.name != "trio"]
