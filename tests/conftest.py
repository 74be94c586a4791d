"""Shared fixtures: real driver processes in private directories under /dev/shm."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAST_DRIVER_SETTINGS, lacking

pytest_plugins = ["installed"]  # the installed_venv fixture: the wheel in a fresh venv


@pytest.fixture
def driver_dir() -> Iterator[Path]:
    """A fresh driver directory path (not created), removed afterwards whatever happened."""
    path = Path("/dev/shm") / f"slipstream-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def driver(driver_dir: Path):  # -> Iterator[MediaDriver]
    """A real driver process with fast timers."""
    from slipstream.daemon.driver import MediaDriver

    with MediaDriver.launch(directory=driver_dir, **FAST_DRIVER_SETTINGS) as media_driver:
        yield media_driver


@pytest.fixture
def client(driver):  # -> Iterator[Client]
    from slipstream.client import Client

    with Client.connect(driver.directory) as connected:
        yield connected


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory in /dev/shm for log buffers and counters files, removed afterwards."""
    path = Path("/dev/shm") / f"slipstream-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def needs_hosts() -> None:
    """Namespace hosts can be made here (root, iproute2): skips without, fails under
    CI=true."""
    from slipstream.sim.real import hosts as namespace

    problem = namespace.unavailable()
    if problem is not None:
        lacking(f"test hosts: {problem}")


@pytest.fixture
def hosts(request: pytest.FixtureRequest, needs_hosts: None):  # -> Iterator[NamespaceHosts]
    """Test hosts: network namespaces on a bridge (2, or ``indirect`` parametrised), removed
    afterwards.  Needs root: skips without it, fails under CI=true."""
    from slipstream.sim.real import hosts as namespace

    count = getattr(request, "param", 2)
    with namespace.namespace_hosts(count) as made:
        yield made
