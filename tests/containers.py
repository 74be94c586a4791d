"""slipstream's image and the containers the tests run of it (the containers lane).

The session fixture :func:`slipstream_image` builds the image once per test session, as a user
does, with ``make image`` run in a copy of the source files (a fresh clone's, with this tree's
edits: nothing is written into the checkout), under the repository :data:`TEST_IMAGE` (never
the user's ``localhost/slipstream``).  Its tag is ``src-<hash of the source files>``
(``scripts/build-image --print-tag``), and it carries the label :data:`SESSION_LABEL`, naming
the test process that built it.  At the start, the names in that repository of images whose
builder has ended (a session interrupted before its end) are removed, unless a container
still uses the image; an image of the tag whose builder still runs (a session beside this
one) is used as it is, and left; one this session built is removed at its end, by name and
unless a container uses it.  The base image
(``scripts/ensure-containers``) is the set-up's, made once per machine and kept, as ``.venv``
is.

:func:`containers` gives a test a :class:`Containers`: every container it starts carries the
test's label and all of them are removed after the test, whatever happened.

Needs root and podman (``make test`` installs it: ``make containers``): skips without them,
fails under CI=true.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from helpers import lacking
from installed import CHECKOUT, WORK_PARENT, build_wheel, source_files

#: The repository the tests' image is tagged in (the user's images are not touched).
TEST_IMAGE = "localhost/slipstream-test"
#: The label every container and pod the tests make carries (its value: the test's id).
LABEL = "org.slipstream.test"
#: The label of the images the tests build (its value: :func:`session_owner` of the builder).
SESSION_LABEL = "org.slipstream.test-session"
#: What the session's build may take: the wheels (the C extensions compiled), the
#: dependencies' download (a warm pip cache makes it quick) and podman's build.
BUILD_TIMEOUT_S = 900
#: A uid of an application in the tests' containers: not the driver's, with the driver's
#: group as its primary group (docs/OPERATIONS.md, Deployment).
APP_UID = 10002


def image_settings() -> dict[str, str]:
    """deploy/container/image.env: the image's names and numbers."""
    settings = {}
    for line in (CHECKOUT / "deploy" / "container" / "image.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings[key] = value.strip('"')
    return settings


def session_owner(pid: int | None = None) -> str:
    """``PID:START`` of a process (this one by default): its id and its start time in clock
    ticks since boot, which a later process of the same id does not share."""
    pid = os.getpid() if pid is None else pid
    stat = Path(f"/proc/{pid}/stat").read_text()
    return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}"


def owner_alive(owner: str) -> bool:
    """Whether the process :func:`session_owner` named ``owner`` still runs."""
    pid, _, _ = owner.partition(":")
    try:
        return pid.isdigit() and session_owner(int(pid)) == owner
    except (OSError, IndexError):
        return False


def remove_stale_images() -> list[str]:
    """Untag the names in :data:`TEST_IMAGE` of images whose builder no longer runs; the
    names untagged.  By name and without force: an image that has names elsewhere keeps
    them (and itself), and one that a container still uses (a session beside this one) is
    left as it is.  One without :data:`SESSION_LABEL` (built by an older checkout's tests,
    perhaps running now) is left."""
    owner = "{{index .Labels \"" + SESSION_LABEL + "\"}}"
    listed = podman("images", "--filter", f"reference={TEST_IMAGE}", "--format",
                    "{{.Repository}} {{.Tag}} " + owner, check=False).stdout
    untagged = []
    for line in listed.splitlines():
        # The filter matches other repositories whose names begin with this one's too.
        repository, tag, *owner = line.split()
        name = f"{repository}:{tag}"
        if repository == TEST_IMAGE and owner and owner[0] != "<no" and \
                not owner_alive(owner[0]) and podman("rmi", name, check=False).returncode == 0:
            untagged.append(name)
    return untagged


def podman(*args: str, prefix: Sequence[str] = (), check: bool = True,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` (``prefix`` before it: ``nsenter --net=/run/netns/NS``), output captured; an
    AssertionError with its output when it fails and ``check``."""
    result = subprocess.run([*prefix, "podman", *args], capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result


def needs_podman() -> None:
    """Root and podman, else :func:`lacking`."""
    if os.geteuid() != 0:
        lacking("containers: podman's storage here is root's (run the lane as root)")
    if shutil.which("podman") is None:
        lacking("containers: podman is missing (make containers installs it)")


class Containers:
    """The containers of one test, all labelled ``LABEL=<its id>`` and removed by
    :meth:`remove_all`."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.id = uuid.uuid4().hex[:8]
        self.settings = image_settings()
        #: The prefixes podman ran under (a namespace host's network): remove_all lists there.
        self._prefixes: list[tuple[str, ...]] = [()]

    def name(self, role: str) -> str:
        return f"slipstream-test-{self.id}-{role}"

    def run(self, role: str, *args: str, command: Sequence[str] = (),
            prefix: Sequence[str] = (), detach: bool = True) -> str:
        """``podman run`` of the image as container ``name(role)`` with ``args`` (options)
        and ``command``; its name (detached) or its output (not detached)."""
        if tuple(prefix) not in self._prefixes:
            self._prefixes.append(tuple(prefix))
        name = self.name(role)
        result = podman("run", *(("--detach",) if detach else ("--rm",)), "--name", name,
                        "--label", f"{LABEL}={self.id}", *args, self.image, *command,
                        prefix=prefix)
        return name if detach else result.stdout

    def driver(self, role: str = "driver", *args: str, shm_size: str = "256m",
               prefix: Sequence[str] = (), network: str = "none") -> str:
        """A driver container, its /dev/shm shareable (``--ipc=shareable``) and sized for
        ``shm_size``, on ``network``; returned once healthy."""
        name = self.run(role, "--ipc=shareable", f"--shm-size={shm_size}",
                        f"--network={network}", "--stop-timeout=15", *args, prefix=prefix)
        self.wait_healthy(name, prefix=prefix)
        return name

    def client(self, role: str, driver: str, *command: str,
               prefix: Sequence[str] = (), network: str = "none") -> str:
        """An application container beside ``driver``: its /dev/shm (``--ipc=container:``),
        a uid of its own with the driver's group as its primary group, and not the image's
        health check, which is the driver's."""
        return self.run(role, f"--ipc=container:{driver}", f"--network={network}",
                        "--no-healthcheck",
                        f"--user={APP_UID}:{self.settings['SLIPSTREAM_GID']}",
                        command=command, prefix=prefix)

    def wait_healthy(self, name: str, timeout: float = 30.0,
                     prefix: Sequence[str] = ()) -> float:
        """Run the image's health check until it passes (podman runs it only on request
        without systemd); the seconds it took.  AssertionError with the container's log
        after ``timeout``."""
        started = time.monotonic()
        while True:
            check = podman("healthcheck", "run", name, check=False, prefix=prefix)
            if check.returncode == 0:
                return time.monotonic() - started
            state = self.inspect(name, prefix=prefix)["State"]
            if not state["Running"] or time.monotonic() - started > timeout:
                raise AssertionError(f"{name} not healthy ({check.stdout}{check.stderr}, "
                                     f"state {state['Status']}):\n{self.logs(name, prefix)}")
            time.sleep(0.05)

    def inspect(self, name: str, prefix: Sequence[str] = ()) -> dict:
        return json.loads(podman("container", "inspect", name, prefix=prefix).stdout)[0]

    def logs(self, name: str, prefix: Sequence[str] = ()) -> str:
        result = podman("logs", name, check=False, prefix=prefix)
        return result.stdout + result.stderr

    def wait(self, name: str, timeout: float = 60.0, prefix: Sequence[str] = ()) -> int:
        """The container's exit status once it ends; AssertionError after ``timeout``."""
        try:
            result = podman("wait", name, timeout=timeout, prefix=prefix)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still runs after {timeout} s:\n"
                                 f"{self.logs(name, prefix)}") from None
        return int(result.stdout.strip())

    def assert_succeeds(self, name: str, timeout: float = 60.0,
                        prefix: Sequence[str] = ()) -> str:
        """Wait for ``name`` to exit 0; its log."""
        status = self.wait(name, timeout, prefix)
        log = self.logs(name, prefix)
        assert status == 0, f"{name} exited with {status}:\n{log}"
        return log

    def remove_all(self) -> None:
        for prefix in self._prefixes:
            listed = podman("ps", "--all", "--quiet", "--filter", f"label={LABEL}={self.id}",
                            prefix=prefix, check=False)
            ids = listed.stdout.split()
            if ids:  # --depend: the clients of a driver (--ipc=container:) go with it
                podman("rm", "--force", "--depend", "--time=0", *ids, prefix=prefix,
                       check=False)


@pytest.fixture(scope="session")
def slipstream_image() -> Iterator[str]:
    """The image built from a copy of the source files by ``make image``: its tag."""
    needs_podman()
    root = Path(tempfile.mkdtemp(prefix="slipstream-image-src-", dir=WORK_PARENT))
    built = False
    try:
        source = root / "source"
        for name in source_files():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CHECKOUT / name, target)
        env = build_wheel.clean_environment()
        env["IMAGE"] = TEST_IMAGE
        remove_stale_images()
        tag = subprocess.run([str(source / "scripts" / "build-image"), "--print-tag"],
                             env=env, check=True, capture_output=True, text=True,
                             timeout=120).stdout.strip()
        if podman("image", "exists", tag, check=False).returncode != 0:
            built = True
            make = subprocess.run(["make", "--no-print-directory", "-C", str(source), "image",
                                   f"IMAGE={TEST_IMAGE}", f"IMAGE_PYTHON={sys.executable}",
                                   f"IMAGE_LABEL={SESSION_LABEL}={session_owner()}"],
                                  env=env, capture_output=True,
                                  text=True, timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
            if make.returncode != 0:
                pytest.fail(f"make image failed ({make.returncode}):\n{make.stdout[-4000:]}"
                            f"{make.stderr[-4000:]}", pytrace=False)
            assert make.stdout.strip().splitlines()[-1] == tag, make.stdout
        shutil.rmtree(root, ignore_errors=True)
        yield tag
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if built:  # by name, not forced: a session beside this one may use it still
            podman("rmi", tag, f"{TEST_IMAGE}:latest", check=False)


@pytest.fixture
def containers(slipstream_image: str) -> Iterator[Containers]:
    """The test's containers, removed afterwards."""
    made = Containers(slipstream_image)
    try:
        yield made
    finally:
        made.remove_all()
