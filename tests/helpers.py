"""Small helpers shared by the test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 5.0,
             what: str = "condition") -> None:
    """Poll ``predicate`` every 10 ms until it is true; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(0.01)
