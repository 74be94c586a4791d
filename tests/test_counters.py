"""The counters file: allocation, freeing and the reuse delay."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slipstream.client import counters as counters_module
from slipstream.client.counters import (
    CountersFile,
    CountersFullError,
    CounterType,
    SystemCounter,
)


@pytest.fixture
def counters(shm: Path) -> Iterator[CountersFile]:
    file = CountersFile.create(shm / "counters.dat", capacity=len(SystemCounter) + 2)  # 2 free
    yield file
    file.close()


def test_a_freed_counter_is_not_handed_out_again_at_once(counters: CountersFile,
                                                         monkeypatch) -> None:
    """A process that has not yet learned its counter was freed may still write it: the slot
    waits before it can carry someone else's position."""
    first = counters.allocate(CounterType.CLIENT_HEARTBEAT, "a", registration_id=1)
    second = counters.allocate(CounterType.SUBSCRIBER_POSITION, "b", registration_id=2)
    counters.free(first)
    assert counters.info(first) is None
    with pytest.raises(CountersFullError, match="counters are in use or freed less than 1 s ago"):
        counters.allocate(CounterType.SUBSCRIBER_POSITION, "c")
    monkeypatch.setattr(counters_module, "FREE_TO_REUSE_TIMEOUT_NS", 0)
    counters.free(second)
    assert counters.allocate(CounterType.SUBSCRIBER_POSITION, "d", registration_id=4) == second
