"""The aarch64 wheel on an arm64 CPython, under qemu-user: ``make wheel``'s second wheel.

``scripts/build_wheel.py --aarch64`` builds it from the sdist on this machine with Debian's
cross compiler against the arm64 packages' headers and libraries (multiarch), and repairs it
with auditwheel into a ``manylinux_*_aarch64`` one with the arm64 libcrypto inside; its
dependencies' aarch64 wheels go beside it.  The arm64 root (``make arm64``: bookworm's arm64
CPython unpacked from its packages, scripts/ensure-arm64) runs every program as aarch64 code
through qemu-user (binfmt_misc): its python3 installs the wheel from that wheelhouse alone
into a virtual environment, once per session, and the tests run the driver and clients of
that environment there, in an overlay of the root that goes with each run
(``test_other_pythons.run_in_root``).

What this proves of memory ordering is bounded: the C extensions' acquire loads, release
stores, fetch-and-adds and compare-and-swaps run as aarch64 instructions, but qemu-user runs
them on this machine's x86_64 order (TSO), which reorders less than an arm64 CPU may; a
reordering only a weaker machine makes is not produced here (docs/OPERATIONS.md).

The arm64 image (``scripts/build-image --arch arm64``) is built from the session's
wheelhouse under qemu-user too (``podman build --platform linux/arm64``), and its driver
started in a container of it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from containers import (
    SESSION_LABEL,
    TEST_IMAGE,
    Containers,
    needs_podman,
    podman,
    remove_stale_images,
    session_owner,
)
from helpers import lacking
from installed import CHECKOUT, INSTALL_TIMEOUT_S, WORK_PARENT, build_wheel
from test_other_pythons import PROGRAMS, RUN_BLOCK, _blocks, run_in_root

#: The arm64 root ``make arm64`` makes (scripts/ensure-arm64 ROOT) and keeps beside the venv.
ARM64_ROOT = CHECKOUT / ".venv" / "debian-bookworm-arm64"
#: The kernel's binfmt_misc entry that hands aarch64 programs to qemu-user.
BINFMT_ENTRY = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
#: ELF's e_machine of AArch64: every shared object in the aarch64 wheel is one.
EM_AARCH64 = 183
#: Under qemu, on a loaded machine: the install (pip, emulated) and one run of the driver.
QEMU_INSTALL_TIMEOUT_S, QEMU_RUN_TIMEOUT_S = 900, 600

#: In the root, once per session: an environment at /work/venv (kept in the session's folder,
#: bound at /work in every run) with the wheel from the wheelhouse alone, binaries only, by
#: the pip wheel Debian's python3-venv ships (a venv --without-pip and pip run from its wheel:
#: ensurepip's copy and byte-compiling, minutes under qemu, are left out).
INSTALL_SCRIPT = r"""
set -eu
cd /work
python3 -m venv --without-pip /work/venv
set -- /usr/share/python-wheels/pip-*.whl
/work/venv/bin/python "$1/pip" install --disable-pip-version-check --no-cache-dir --no-compile \
    --no-index --only-binary=:all: --find-links /work/wheelhouse slipstream > pip.log 2>&1 \
    || { cat pip.log; exit 4; }
echo installed
"""

#: In the root, per test: ``uname -m``, the environment's driver, then RUN in /work/CASE
#: (the driver's directory in $SLIPSTREAM_DIR); the driver stopped, "ran".
RUN_SCRIPT = r"""
set -eu
cd /work/{case}
uname -m
export PATH=/work/venv/bin:/usr/bin:/bin SLIPSTREAM_DIR=/dev/shm/slipstream-arm64
export SLIPSTREAM_DRAIN_TIMEOUT=2s SLIPSTREAM_IPC_TERM_BUFFER_LENGTH=1m
python -c 'import slipstream.client._fastpath as f; print("fastpath", f.__file__)'
slipstream driver > driver.log 2>&1 &
driver=$!
tries=0
until grep -q "running in" driver.log; do
    tries=$((tries + 1))
    if [ "$tries" -gt 1800 ] || ! kill -0 "$driver" 2>/dev/null; then
        echo "the driver did not start:"; cat driver.log; exit 5
    fi
    sleep 0.1
done
{run} > run.out 2> run.err || {{ cat run.out run.err; exit 6; }}
kill -TERM "$driver"
wait "$driver" || {{ echo "the driver exited $?:"; cat driver.log; exit 7; }}
echo "ran"
"""


def _need_arm64() -> None:
    if os.geteuid() != 0:
        lacking("needs root (mounts, chroot, the arm64 packages)")
    if shutil.which("unshare") is None:
        lacking("unshare is missing (util-linux)")
    if not BINFMT_ENTRY.exists() or BINFMT_ENTRY.read_text().split()[0] != "enabled":
        lacking(f"{BINFMT_ENTRY} is not enabled: make arm64 sets qemu-user up")
    if not (ARM64_ROOT / "usr" / "bin" / "python3").exists():
        lacking(f"no arm64 root at {ARM64_ROOT}: make arm64 makes it")
    if shutil.which(build_wheel.AARCH64_COMPILER) is None:
        lacking(f"{build_wheel.AARCH64_COMPILER} is missing: make arm64 installs it")


@pytest.fixture(scope="session")
def arm64_wheelhouse() -> Iterator[Path]:
    """The wheelhouse ``make wheel`` builds (``build_wheel.build`` with ``aarch64``): both
    wheels of one sdist and their dependencies' wheels for both machines, under /var/tmp."""
    _need_arm64()
    with tempfile.TemporaryDirectory(prefix="slipstream-arm64-", dir=WORK_PARENT) as folder:
        wheelhouse, log = Path(folder) / "wheelhouse", Path(folder) / "build.log"
        build_wheel.build(wheelhouse, log, aarch64=True)
        yield wheelhouse


def _aarch64_wheel(wheelhouse: Path) -> Path:
    (wheel,) = wheelhouse.glob(f"{build_wheel.FILE_PREFIX}*aarch64.whl")
    return wheel


@pytest.fixture(scope="session")
def arm64_work(arm64_wheelhouse: Path) -> Iterator[Path]:
    """The session's folder bound at /work in the arm64 root: the wheelhouse, and /work/venv,
    the environment the root's CPython installed the aarch64 wheel into (:data:`INSTALL_SCRIPT`),
    with pip's log in ``pip.log``."""
    with tempfile.TemporaryDirectory(prefix="slipstream-arm64-work-", dir=WORK_PARENT) as folder:
        work = Path(folder) / "work"
        shutil.copytree(arm64_wheelhouse, work / "wheelhouse")
        scratch = Path(folder) / "scratch"
        scratch.mkdir()
        ran = run_in_root(ARM64_ROOT, work, INSTALL_SCRIPT, scratch,
                          timeout=QEMU_INSTALL_TIMEOUT_S)
        assert ran.returncode == 0, f"exited {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
        yield work


def _run(work: Path, case: str, run: str, tmp_path: Path, **kwargs: Any) -> list[str]:
    """:data:`RUN_SCRIPT` with ``run`` in /work/``case`` of the root; its output's lines,
    after checking it ran to its end on aarch64 with the wheel's abi3 extension."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ran = run_in_root(ARM64_ROOT, work, RUN_SCRIPT.format(case=case, run=run), scratch,
                      timeout=QEMU_RUN_TIMEOUT_S, **kwargs)
    assert ran.returncode == 0, f"exited {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    lines = ran.stdout.splitlines()
    assert lines[0] == "aarch64", ran.stdout
    fastpath = next(line for line in lines if line.startswith("fastpath "))
    assert fastpath.endswith("/work/venv/lib/python3.11/site-packages/slipstream/client/"
                             "_fastpath.abi3.so"), fastpath
    assert lines[-1] == "ran", ran.stdout
    return lines


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 600)
def test_the_aarch64_wheel_is_manylinux_abi3_with_aarch64_extensions_and_libcrypto(
        arm64_wheelhouse: Path) -> None:
    """The aarch64 wheel is the same kind as the x86_64 one (``cp311-abi3``, manylinux), and
    every shared object in it, the three extensions and the libcrypto auditwheel copied in,
    is an AArch64 ELF file."""
    wheel = _aarch64_wheel(arm64_wheelhouse)
    assert "-cp311-abi3-manylinux_" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as archive:
        objects = {name: archive.read(name) for name in archive.namelist()
                   if name.endswith(".so") or ".so." in name}
    names = sorted(objects)
    for extension in ("client/_fastpath", "client/_native", "daemon/_network"):
        assert f"slipstream/{extension}.abi3.so" in names, names
    assert any(n.startswith("slipstream.libs/libcrypto") for n in names), names
    for name, data in objects.items():
        assert data[:4] == b"\x7fELF", name
        assert int.from_bytes(data[18:20], "little") == EM_AARCH64, name


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 600 + QEMU_INSTALL_TIMEOUT_S + QEMU_RUN_TIMEOUT_S)
def test_arm64_cpython_installs_the_aarch64_wheel_and_runs_the_tutorials_programs(
        arm64_wheelhouse: Path, arm64_work: Path, tmp_path: Path) -> None:
    """The arm64 root's CPython (aarch64 under qemu-user) installed the aarch64 wheel from the
    wheelhouse alone, binaries only, loads its abi3 extensions, and the tutorial's subscriber
    and publisher print what the page shows through a driver of that environment."""
    assert _aarch64_wheel(arm64_wheelhouse).name in (arm64_work / "pip.log").read_text()
    case = arm64_work / "tutorial"
    case.mkdir()
    blocks = _blocks()
    for name in PROGRAMS:
        (case / name).write_text(blocks[name])
    (case / "run.sh").write_text(blocks[RUN_BLOCK])
    _run(arm64_work, "tutorial", "bash -euo pipefail run.sh", tmp_path)
    assert (case / "run.out").read_text() == blocks[f"{RUN_BLOCK} output"]


#: Both ends of the exchange, the same program on each machine: ``exchange.py OWN PEER COUNT
#: LINGER_S`` subscribes at its endpoint OWN, publishes COUNT messages to PEER (64 KiB terms)
#: while it takes the peer's, and checks every message arrives exactly once and in order (its
#: sequence number is the next one wanted).  Having all of them it sends an acknowledgement;
#: it ends once it has the peer's and has kept polling LINGER_S more (a late duplicate fails
#: it).  It prints ``exchanged SENT RECEIVED TERMS acked``: TERMS the distinct term ids the
#: peer's messages came in.
EXCHANGE_PROGRAM = r"""
import struct
import sys
import time

from slipstream.client import Client

own, peer, count, linger_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
MESSAGE = struct.Struct("<q216x")  # a sequence number and padding: a 256-byte frame
ACK = -1
wanted, terms, acked, problems = 0, set(), False, []


def handler(data, header):
    global wanted, acked
    (sequence,) = MESSAGE.unpack(data)
    if sequence == ACK:
        acked = True
        return
    terms.add(header.term_id)
    if sequence != wanted:
        problems.append(f"message {sequence} where {wanted} was wanted")
    wanted = max(wanted, sequence + 1)


def offer(publication, sequence):
    while publication.offer(MESSAGE.pack(sequence)) < 0:
        subscription.poll(handler, 64)


deadline = time.monotonic() + 300
with Client.connect() as client:
    subscription = client.add_subscription(f"aeron:udp?endpoint={own}", 1001)
    publication = client.add_publication(f"aeron:udp?endpoint={peer}|term-length=64k", 1001)
    while not publication.is_connected and time.monotonic() < deadline:
        subscription.poll(handler, 64)
        time.sleep(0.01)
    sent = 0
    while sent < count:
        offer(publication, sent)
        sent += 1
        subscription.poll(handler, 64)
    while wanted < count and not problems and time.monotonic() < deadline:
        subscription.poll(handler, 64)
    offer(publication, ACK)
    while not acked and time.monotonic() < deadline:
        subscription.poll(handler, 64)
    end = time.monotonic() + linger_s
    while time.monotonic() < end:
        subscription.poll(handler, 64)
print(*problems, sep="\n")
print("exchanged", sent, wanted, len(terms), "acked" if acked else "not acked")
"""
#: Messages each way, 256-byte frames (a 32-byte header and 224 bytes): over ten 64 KiB terms.
EXCHANGE_COUNT, EXCHANGE_FRAME, EXCHANGE_TERM = 3000, 256, 64 * 1024
#: Seconds each end keeps polling once it has the peer's acknowledgement.
LINGER_S = 2.0


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 600 + QEMU_INSTALL_TIMEOUT_S + QEMU_RUN_TIMEOUT_S)
def test_an_arm64_driver_and_an_x86_64_driver_exchange_a_udp_stream_both_ways_exactly_once(
        arm64_work: Path, hosts: Any, tmp_path: Path) -> None:
    """On two namespace hosts, the arm64 root's driver and client (aarch64 under qemu-user)
    and this machine's x86_64 driver and client send each other :data:`EXCHANGE_COUNT`
    messages over UDP at once, across more than ten term rotations each way: each end gets
    every one of the other's exactly once, in order."""
    case = arm64_work / "exchange"
    case.mkdir()
    (case / "exchange.py").write_text(EXCHANGE_PROGRAM)
    arm, x86 = hosts[1], hosts[2]
    arm_end, x86_end = f"{arm.address}:40123", f"{x86.address}:40124"
    driver = hosts.start_driver(2)
    x86_run = x86.popen(
        sys.executable, str(case / "exchange.py"), x86_end, arm_end, str(EXCHANGE_COUNT),
        str(LINGER_S), env={**os.environ, "SLIPSTREAM_DIR": str(driver.directory)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        _run(arm64_work, "exchange",
             f"python exchange.py {arm_end} {x86_end} {EXCHANGE_COUNT} {LINGER_S}", tmp_path,
             prefix=arm.prefix())
        x86_output, _ = x86_run.communicate(timeout=300)
    finally:
        x86_run.kill()
        x86_run.wait()
    assert x86_run.returncode == 0, x86_output
    least_terms = EXCHANGE_COUNT * EXCHANGE_FRAME // EXCHANGE_TERM
    for side, output in (("arm64", (case / "run.out").read_text()), ("x86_64", x86_output)):
        lines = output.splitlines()
        assert lines[:-1] == [""], f"{side}: {output}"
        last = lines[-1].split()
        assert last[:3] == ["exchanged", str(EXCHANGE_COUNT), str(EXCHANGE_COUNT)], \
            f"{side}: {output}"
        assert int(last[3]) >= least_terms > 10, f"{side}: {output}"
        assert last[4] == "acked", f"{side}: {output}"


#: The checkout's tests of what the log buffer's C code orders, run by the arm64 CPython on
#: the aarch64 wheel: processes appending to one log at once (the tail's fetch-and-add, each
#: frame's length stored with release after its body, padding at the term's end), claimers
#: that died between claim and commit, and many rotations (the term count's
#: compare-and-swap) with a reader and the cleaner behind them.
ORDERING_TESTS = (
    "test_concurrent_appends_from_several_processes_never_corrupt_or_lose_a_frame",
    "test_a_dead_claimer_is_unblocked_with_padding",
    "test_a_claimer_that_died_before_writing_its_header_is_unblocked",
    "test_many_term_rotations_with_cleaning_behind_the_reader",
)
#: What those tests need beyond the wheel (the test extra's runners), at this venv's versions.
TEST_PACKAGES = ("pytest", "pytest-timeout", "pytest-trio", "hypothesis")


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 600 + QEMU_INSTALL_TIMEOUT_S + 2 * QEMU_RUN_TIMEOUT_S)
def test_the_log_buffers_concurrency_tests_pass_on_aarch64_under_qemu(
        arm64_work: Path, tmp_path: Path) -> None:
    """:data:`ORDERING_TESTS` of tests/test_logbuffer.py pass on the arm64 CPython with the
    aarch64 wheel: its acquire and release loads and stores, fetch-and-adds and
    compare-and-swaps run as aarch64 instructions (on this machine's stronger order: the
    module's docstring)."""
    case = arm64_work / "ordering"
    for name in build_wheel.source_files(CHECKOUT):
        if name.startswith("tests/") or name in ("pyproject.toml", "scripts/build_wheel.py"):
            (case / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CHECKOUT / name, case / name)
    pins = [f"{name}=={metadata.version(name)}" for name in TEST_PACKAGES]
    wheel = _aarch64_wheel(arm64_work / "wheelhouse")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
         "--only-binary", ":all:", "--python-version", "3.11",
         *(arg for tag in build_wheel.platform_tags(wheel) for arg in ("--platform", tag)),
         "--dest", arm64_work / "wheelhouse", *pins],
        check=True, capture_output=True, timeout=600)
    run = ('set -- /usr/share/python-wheels/pip-*.whl; '
           'python "$1/pip" install --disable-pip-version-check -q --no-compile --no-index '
           f'--find-links /work/wheelhouse {" ".join(pins)} && '
           'python -m pytest -q -p no:cacheprovider tests/test_logbuffer.py -k '
           f'"{" or ".join(ORDERING_TESTS)}"')
    _run(arm64_work, "ordering", f"sh -c '{run}'", tmp_path)
    output = (case / "run.out").read_text()
    summary = output.splitlines()[-1]
    assert summary.startswith(f"{len(ORDERING_TESTS)} passed, "), output
    assert "failed" not in summary and "error" not in summary, output


#: The arm64 image's build, cold but for its base (bookworm's arm64 packages unpacked, kept as
#: the x86_64 one is): the build stage under qemu-user on a loaded machine.
ARM64_IMAGE_BUILD_TIMEOUT_S = 600
#: The arm64 driver's start in its container under qemu, to its health check's first pass.
ARM64_DRIVER_START_S = 120


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 600 + ARM64_IMAGE_BUILD_TIMEOUT_S + 300)
def test_the_arm64_image_builds_under_qemu_and_its_driver_runs_in_a_container_of_it(
        arm64_wheelhouse: Path) -> None:
    """``scripts/build-image --arch arm64`` builds the image for arm64 from the session's
    wheelhouse (its aarch64 wheel; the build stage under qemu-user): an arm64 image whose
    container runs the driver as aarch64 code, healthy (the image's health check connects
    to it), ``slipstream stat`` in it reads the running driver, and ``podman stop`` ends it
    with status 0 (drained).  The image and containers made here are removed after."""
    needs_podman()
    env = build_wheel.clean_environment()
    env.update(IMAGE=TEST_IMAGE, PYTHON=sys.executable)
    build_image = [str(CHECKOUT / "scripts" / "build-image"), "--arch", "arm64"]
    remove_stale_images()
    tag = subprocess.run([*build_image, "--print-tag"], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout.strip()
    assert tag.endswith("-arm64"), tag
    built = False
    made = Containers(tag)
    try:
        if podman("image", "exists", tag, check=False).returncode != 0:
            built = True
            build = subprocess.run(
                [*build_image, "--no-latest", "--wheelhouse", str(arm64_wheelhouse),
                 "--label", f"{SESSION_LABEL}={session_owner()}"],
                env=env, capture_output=True, text=True, timeout=ARM64_IMAGE_BUILD_TIMEOUT_S,
                stdin=subprocess.DEVNULL)
            assert build.returncode == 0, f"{build.stdout[-4000:]}{build.stderr[-4000:]}"
            assert build.stdout.strip().splitlines()[-1] == tag, build.stdout
        platform = podman("image", "inspect", "--format", "{{.Os}}/{{.Architecture}}",
                          tag).stdout.strip()
        assert platform == "linux/arm64", platform
        name = made.run("driver", "--platform=linux/arm64", "--ipc=shareable",
                        "--shm-size=256m", "--network=none", "--stop-timeout=15")
        made.wait_healthy(name, timeout=ARM64_DRIVER_START_S)
        assert "running in /dev/shm/slipstream" in made.logs(name)
        machine = podman("exec", name, "uname", "-m").stdout.strip()
        assert machine == "aarch64", machine
        stat = podman("exec", name, "slipstream", "stat", "--once",
                      timeout=ARM64_DRIVER_START_S).stdout
        assert stat.startswith("slipstream driver pid 1 in /dev/shm/slipstream"), stat
        podman("stop", "--time=15", name, timeout=60)
        assert made.wait(name) == 0, made.logs(name)
    finally:
        made.remove_all()
        if built:  # by name, not forced: only what this test made
            podman("rmi", tag, check=False)
