"""slipstream's image (deploy/container/, `make image`) and a driver shared across containers
on one host: the image built once per session from a copy of the source files
(tests/containers.py), a driver container that applications in other containers reach
through its /dev/shm (``--ipc=container:``) as members of its group, its health check, its
drain at ``podman stop``, and /dev/shm sized by the settings (docs/OPERATIONS.md,
Deployment).  Containers run with ``--network=none``: IPC needs no network.

Needs root and podman (``make containers``): skips without, fails under CI=true.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from containers import (
    APP_UID,
    CHECKOUT,
    LABEL,
    SESSION_LABEL,
    TEST_IMAGE,
    Containers,
    image_settings,
    podman,
    remove_stale_images,
    session_owner,
)

pytestmark = pytest.mark.timeout(900)  # the session's image build, the first time

MESSAGES = 20_000


def test_the_image_runs_the_driver_as_its_user_and_has_no_compiler(containers: Containers,
                                                                   ) -> None:
    """The installed wheel's compiled modules import in an image with no compiler and no
    Python headers: nothing could have been built there."""
    settings = image_settings()
    inspected = json.loads(podman("image", "inspect", containers.image).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == "slipstream"
    assert config["Cmd"][:2] == ["/opt/slipstream/bin/slipstream", "driver"]  # exec form
    assert inspected["Healthcheck"]["Test"] == ["CMD", "/usr/local/bin/slipstream-healthcheck"]
    assert config["StopSignal"] in ("SIGTERM", "15")
    out = containers.run("probe", "--network=none", detach=False, command=[
        "sh", "-c", "id -u; id -g; command -v gcc cc clang || echo no compiler; "
                    "python -c 'import slipstream.client._native, slipstream.daemon._network; "
                    "print(slipstream.client.__file__)'; "
                    "python -c 'import os, sysconfig; "
                    "print(os.path.exists(sysconfig.get_path(\"include\") + \"/Python.h\"))'"])
    uid, gid, compiler, module, headers = out.split("\n")[:5]
    assert (uid, gid) == (settings["SLIPSTREAM_UID"], settings["SLIPSTREAM_GID"])
    assert compiler == "no compiler"
    assert module.startswith("/opt/slipstream/lib/python")  # the installed wheel's
    assert headers == "False", "Python.h is in the image"


def test_the_image_holds_its_runtime_and_no_installer(containers: Containers) -> None:
    """Only what runs the driver and its clients (deploy/container/runtime_root.py): no
    package manager, perl, pip or setuptools, no CPython test suite; bytecode for the
    package's modules, made at the build; every RUNTIME_PACKAGES package listed for
    scanners."""
    out = containers.run("contents", "--network=none", detach=False, command=[
        "sh", "-c", "for p in apt-get dpkg perl pip pip3 gcc; do command -v $p; done; "
                    "ls /var/lib/dpkg/status.d; "
                    "python -c 'import importlib.util as u; "
                    "print([m for m in (\"pip\", \"setuptools\", \"test\", \"lib2to3\") "
                    "if u.find_spec(m)])'; "
                    "ls /opt/slipstream/lib/python3*/site-packages/slipstream/client/__pycache__"
                    " | wc -l"])
    lines = out.splitlines()
    packages = image_settings()["RUNTIME_PACKAGES"].split()
    assert lines[:len(packages)] == sorted(packages), out  # no program of the list found
    assert lines[len(packages)] == "[]", out
    assert int(lines[len(packages) + 1]) > 10, out
    size = int(podman("image", "inspect", "--format", "{{.Size}}", containers.image).stdout)
    assert size < 80e6, f"{size / 1e6:.0f} MB on disk (docs/PERFORMANCE.md: 59 MB)"


#: Run in the image: what an application expects of a Linux runtime beside the driver.
_RUNTIME_EXPECTATIONS = """
import locale, ssl, time, zoneinfo
print(ssl.create_default_context().cert_store_stats()["x509_ca"])
print(zoneinfo.ZoneInfo("Europe/Paris").key)
time.tzset()
print(time.tzname[0])
print(locale.setlocale(locale.LC_ALL, ""))
"""


def test_the_image_has_ca_certificates_time_zones_and_a_utf8_locale(
        containers: Containers) -> None:
    out = containers.run("expectations", "--network=none", "--env", "TZ=Europe/Paris",
                         "--env", "LANG=C.UTF-8", detach=False,
                         command=["python", "-c", _RUNTIME_EXPECTATIONS])
    cas, zone, zone_name, chosen_locale = out.split()
    assert int(cas) > 100, out
    assert (zone, zone_name, chosen_locale) == ("Europe/Paris", "CET", "C.UTF-8"), out


#: An application: one module, which uses the client library the image holds.
_APPLICATION = """
import slipstream.client


def main() -> None:
    print("an application beside", slipstream.client.__name__)
"""


def test_an_applications_image_installs_its_wheels_into_the_images_environment(
        containers: Containers, tmp_path: Path) -> None:
    """deploy/container/Containerfile.app, as its comment says to build it, with a wheel of
    a one-module application: the module imports beside slipstream's client library, run as
    the image's user, and the image still has no pip."""
    source = tmp_path / "source"
    (source / "hello_app").mkdir(parents=True)
    (source / "hello_app" / "__init__.py").write_text(_APPLICATION)
    (source / "pyproject.toml").write_text(
        '[project]\nname = "hello-app"\nversion = "0.1"\n'
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n')
    context = tmp_path / "context"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "-w", str(context / "wheels"),
                    str(source)], check=True, capture_output=True, timeout=120)
    run = uuid.uuid4().hex[:8]
    image = f"{TEST_IMAGE}-app:{run}"
    try:
        # Not --layers=false: with it podman 4.3 removed the session's image at the end of the
        # build (the image of the stage that is only its FROM).
        # --network=none: a RUN on podman's bridge network leaves its iptables chains.
        podman("build", "--quiet", "--pull=never", "--format", "docker", "--network=none",
               "--build-arg", f"BUILD_STAGE_ID={run}",
               "--build-arg", f"SLIPSTREAM_IMAGE={containers.image}",
               "--build-arg", f"BASE_IMAGE={image_settings()['BASE_IMAGE']}",
               "--file", str(CHECKOUT / "deploy" / "container" / "Containerfile.app"),
               "--tag", image, str(context), timeout=300)
        out = podman("run", "--rm", "--network=none", "--label", f"{LABEL}={containers.id}",
                     image, "sh", "-c", "id -un; command -v pip || echo no pip; "
                     "python -c 'import hello_app; hello_app.main()'").stdout
        assert out.split("\n")[:3] == ["slipstream", "no pip",
                                       "an application beside slipstream.client"], out
        inspected = json.loads(podman("image", "inspect", image).stdout)[0]
        assert inspected["Healthcheck"]["Test"][-1] == "/usr/local/bin/slipstream-healthcheck"
    finally:
        stage = podman("images", "--quiet", "--filter",
                       f"label=org.slipstream.build-stage={run}").stdout.split()
        podman("rmi", image, *stage, check=False)


def test_the_images_of_an_ended_session_are_removed_and_a_running_ones_kept(
        slipstream_image: str) -> None:
    """An image of the tests' repository labelled with a process that has ended (a session
    interrupted before its end) loses its name there at the next session's start, and only
    that name: under another it stays.  One of a running session stays."""
    settings = image_settings()
    run = uuid.uuid4().hex[:8]
    ended, running = f"{TEST_IMAGE}:ended-{run}", f"{TEST_IMAGE}:running-{run}"
    elsewhere = f"{TEST_IMAGE}-elsewhere:{run}"  # a name someone else gave it
    with tempfile.TemporaryDirectory() as context:
        (Path(context) / "Containerfile").write_text(f"FROM {settings['BASE_IMAGE']}\n")
        for tag, owner in ((ended, "4194304:1"), (running, session_owner())):  # > pid_max
            podman("build", "--quiet", "--pull=never", "--layers=false", "--label",
                   f"{SESSION_LABEL}={owner}", "--tag", tag, context)
    podman("tag", ended, elsewhere)
    try:
        removed = remove_stale_images()
        assert ended in removed and running not in removed, removed
        assert podman("image", "exists", ended, check=False).returncode == 1
        assert podman("image", "exists", elsewhere, check=False).returncode == 0
        assert podman("image", "exists", running, check=False).returncode == 0
        assert podman("image", "exists", slipstream_image, check=False).returncode == 0
    finally:
        podman("rmi", ended, elsewhere, running, check=False)


def test_a_publisher_and_a_subscriber_in_containers_stream_through_a_driver_container(
        containers: Containers) -> None:
    """Three containers: the driver (its /dev/shm shareable, sized for one IPC stream of the
    default 64 MiB terms), a subscriber and a publisher, each of a uid of its own with the
    driver's group; then `podman stop` drains the driver, PID 1, which exits 0."""
    driver = containers.driver(shm_size="256m")
    subscriber = containers.client("subscriber", driver, "slipstream-sample", "subscribe",
                                   "aeron:ipc", "1001", f"--count={MESSAGES}")
    publisher = containers.client("publisher", driver, "slipstream-sample", "publish",
                                  "aeron:ipc", "1001", f"--count={MESSAGES}", "--size=256")
    received = containers.assert_succeeds(subscriber)
    assert f"received {MESSAGES} in order (0..{MESSAGES - 1})" in received, received
    assert f"published {MESSAGES}" in containers.assert_succeeds(publisher)
    assert containers.inspect(subscriber)["Config"]["User"] == f"{APP_UID}:" + (
        containers.settings["SLIPSTREAM_GID"])

    started = time.monotonic()
    podman("stop", "--time=15", driver)
    stopped_in = time.monotonic() - started
    log = containers.logs(driver)
    assert containers.inspect(driver)["State"]["ExitCode"] == 0, log
    assert "received SIGTERM: draining" in log, log
    assert stopped_in < 10, f"{stopped_in:.1f} s: the SIGTERM did not reach the driver\n{log}"


def test_a_stream_whose_log_does_not_fit_the_shm_is_refused_saying_so(
        containers: Containers) -> None:
    """Podman's default /dev/shm (64 MiB) holds no IPC stream of the default terms (192
    MiB): the publisher is told, and a stream with smaller terms fits."""
    driver = containers.run("driver", "--ipc=shareable", "--network=none")  # 64 MiB
    containers.wait_healthy(driver)
    refused = containers.client("refused", driver, "slipstream-sample", "publish",
                                "aeron:ipc", "1001", "--count=1", "--timeout=5")
    assert containers.wait(refused) == 1
    error = containers.logs(refused)
    assert "cannot create the log of stream 1001 (192 MiB" in error, error
    assert "use smaller terms" in error, error
    channel = "aeron:ipc?term-length=4m"
    subscriber = containers.client("subscriber", driver, "slipstream-sample", "subscribe",
                                   channel, "1001", "--count=1000")
    publisher = containers.client("publisher", driver, "slipstream-sample", "publish",
                                  channel, "1001", "--count=1000")
    containers.assert_succeeds(subscriber)
    containers.assert_succeeds(publisher)


def test_an_application_with_the_group_only_as_a_supplementary_one_is_told_what_to_do(
        containers: Containers) -> None:
    """In another container the driver's group database lists no member: the control socket
    admits the group as a primary group only, and the error says so."""
    gid = containers.settings["SLIPSTREAM_GID"]
    driver = containers.driver()
    refused = containers.run("refused", f"--ipc=container:{driver}", "--network=none",
                             "--no-healthcheck", f"--user={APP_UID}:{APP_UID}",
                             f"--group-add={gid}", command=["slipstream-healthcheck"])
    assert containers.wait(refused) == 1
    error = containers.logs(refused)
    assert "the group database does not list" in error, error
    assert f"primary group (in a container, whose group database is its image's: `--user " \
           f"UID:{gid}`)" in error, error
