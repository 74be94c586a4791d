"""The package as ``pip install`` gives it, not as the editable install of the checkout does.

The editable install maps whole folders, so a package that pyproject.toml forgot still
imported in the checkout, while the wheel lacked it and its driver could not start
(``slipstream.daemon.pressure`` was such a package once).  Here ``make wheel``'s script builds
the sdist, the wheel from the sdist and its manylinux repair, and the wheel is installed into a
fresh environment outside the checkout from the wheelhouse alone, with no compiler
(tests/installed.py); the driver (as ``python -m slipstream``, with no compiler on its PATH),
clients over IPC and UDP, ``stat``, ``metrics``, ``sim`` and the Spark bridge are run from
there, each proving that nothing of the checkout is on its path.  A type checker reads the
installed public API; another distribution's ``slipstream`` package beside it is refused with
an error that names it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from helpers import NETWORK_SETTINGS, as_another_user, free_port, lacking, wait_for
from installed import (
    CHECKOUT,
    COMPILERS,
    INSTALL_TIMEOUT_S,
    ISOLATION_CHECK,
    NO_COMPILER,
    InstalledVenv,
    build_leftovers,
    package_roots,
    source_files,
    tree_packages,
)

pytestmark = pytest.mark.timeout(INSTALL_TIMEOUT_S)

#: A client of the installed package: streams over IPC and over UDP on 127.0.0.1, each
#: across several term rotations (the driver's terms are 64 KiB), checked message by message.
#: argv: checkout, driver directory, UDP port.
CLIENT_SCRIPT = r"""
import json, struct, sys, time
from slipstream.client import Client

directory, port = sys.argv[2], int(sys.argv[3])
COUNT, SIZE, TERM = 600, 1000, 64 * 1024

def message(seq):
    body = bytearray(SIZE)
    struct.pack_into("<I", body, 0, seq)
    struct.pack_into("<I", body, SIZE - 4, seq)
    return bytes(body)

def carry(client, channel, stream_id):
    subscription = client.add_subscription(channel, stream_id)
    publication = client.add_publication(channel, stream_id)
    received, sent = [], 0
    deadline = time.monotonic() + 60
    while len(received) < COUNT:
        assert time.monotonic() < deadline, f"{channel}: sent {sent}, received {len(received)}"
        while sent < COUNT and publication.offer(message(sent)) >= 0:
            sent += 1
        if not subscription.poll(lambda data, header: received.append(bytes(data)), 100):
            time.sleep(0.0005)
    assert received == [message(i) for i in range(COUNT)], f"{channel}: wrong messages"
    terms = publication.position // TERM
    assert terms >= 3, f"{channel}: only {publication.position} bytes, {terms} terms"
    publication.close()
    subscription.close()
    return {"channel": channel, "messages": len(received), "position": publication.position}

deadline = time.monotonic() + 20
while True:
    try:
        client = Client.connect(directory)
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
with client:
    results = [carry(client, "aeron:ipc", 1001),
               carry(client, f"aeron:udp?endpoint=127.0.0.1:{port}", 1002)]
# The settings file the package reads at run time (importlib.resources, daemon/config.py).
import importlib.resources
shipped = importlib.resources.files("slipstream.config").joinpath("driver.toml").read_text()
assert "term_buffer_length" in shipped, shipped[:500]
print(json.dumps(results))
""" + ISOLATION_CHECK

SPARK_SCRIPT = r"""
import pyspark
import slipstream.spark_bridge as bridge
from slipstream.spark_bridge import SlipstreamDataSource, register, session
assert SlipstreamDataSource.name() == "slipstream"
print("pyspark", pyspark.__version__)
""" + ISOLATION_CHECK


def _python(installed: InstalledVenv, script: str, *args: str, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = installed.run([installed.python, "-c", script, str(CHECKOUT), *args],
                           timeout=timeout, env=env or installed.env())
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert "ISOLATED" in result.stdout, result.stdout
    return result


def _wheel_names(installed: InstalledVenv) -> list[str]:
    with zipfile.ZipFile(installed.wheel) as wheel:
        return wheel.namelist()


def _sdist_names(installed: InstalledVenv) -> list[str]:
    """The sdist's files, relative to its top folder (``slipstream-0.1.0/``)."""
    with tarfile.open(installed.sdist) as sdist:
        return [PurePosixPath(*PurePosixPath(m.name).parts[1:]).as_posix()
                for m in sdist.getmembers() if m.isfile()]


def _installed_path(name: str, roots: dict[str, str]) -> str | None:
    """Where a tree file (``daemon/pressure/episodes.py``) is in the wheel
    (``slipstream/daemon/pressure/episodes.py``); None outside the package roots."""
    parts = PurePosixPath(name).parts
    for package, folder in roots.items():
        if parts[0] == folder and len(parts) > 1:
            return "/".join((*package.split("."), *parts[1:]))
    return None


def test_the_wheel_holds_every_package_and_file_of_the_tree(
        installed_venv: InstalledVenv) -> None:
    """Every folder with an __init__.py under the five roots is a package of the wheel, and
    every file under them is in the sdist and the wheel (the C sources the build needs; the
    settings file config/driver.toml that the driver reads with importlib.resources), with the
    three compiled extensions; the build left nothing in the checkout."""
    names = _wheel_names(installed_venv)
    wheel_packages = {str(PurePosixPath(n).parent).replace("/", ".") for n in names
                      if n.endswith("/__init__.py")}
    expected = tree_packages()
    assert "slipstream.daemon.pressure" in expected
    assert wheel_packages == expected, (
        f"missing from the wheel: {sorted(expected - wheel_packages)}; "
        f"not in the tree: {sorted(wheel_packages - expected)}")
    # slipstream.libs: the shared libraries auditwheel copied in (OpenSSL's libcrypto)
    version = _pyproject()["version"]
    assert {n.split("/")[0] for n in names} == {"slipstream", f"slipstream-{version}.dist-info",
                                                "slipstream.libs"}

    roots = package_roots()
    in_roots = {name: _installed_path(name, roots) for name in source_files()}
    in_roots = {name: path for name, path in in_roots.items() if path is not None}
    assert "config/driver.toml" in in_roots
    missing = sorted(path for path in in_roots.values() if path not in names)
    assert not missing, f"tree files missing from the wheel: {missing}"
    extensions = {PurePosixPath(n).name.split(".")[0] for n in names if n.endswith(".so")}
    assert extensions == {"_native", "_network", "_fastpath"}, extensions

    sdist = set(_sdist_names(installed_venv))
    missing = sorted(set(in_roots) - sdist)
    assert not missing, f"tree files missing from the sdist: {missing}"
    assert {"pyproject.toml", "setup.py", "README.md"} <= sdist

    assert build_leftovers() == installed_venv.leftovers_before, "the build wrote into the tree"
    assert not installed_venv.path.resolve().is_relative_to(CHECKOUT)
    assert installed_venv.root.stat().st_mode & 0o777 == 0o755
    shebang = installed_venv.slipstream.read_text().splitlines()[0]
    assert shebang == f"#!{installed_venv.python}", shebang


def _wait_for_metrics_port(exporter: subprocess.Popen[str]) -> int:
    assert exporter.stdout is not None
    line = exporter.stdout.readline()
    match = re.fullmatch(r"slipstream metrics: http://127\.0\.0\.1:([0-9]+)/metrics\n", line)
    assert match, f"the exporter printed {line!r}"
    return int(match[1])


def _stop(process: subprocess.Popen[str], timeout: float = 15) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
            raise
    return process.returncode


def _mapped_files(pid: int) -> set[Path]:
    """The files a process has mapped (its interpreter, the extensions it loaded)."""
    with open(f"/proc/{pid}/maps") as maps:
        fields = [line.split(None, 5) for line in maps]
    return {Path(f[5].strip()) for f in fields if len(f) == 6 and f[5].startswith("/")}


@pytest.fixture
def installed_driver(installed_venv: InstalledVenv) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """``python -m slipstream driver`` of the installed package, with no compiler to be found
    (:meth:`InstalledVenv.no_compiler_env`), a real process with short timers and 64 KiB
    terms; stopped by SIGTERM afterwards (it must exit 0)."""
    directory = Path("/dev/shm") / f"slipstream-installed-{uuid.uuid4().hex[:12]}"
    settings = [arg for key, value in NETWORK_SETTINGS.items()
                for arg in ("--set", f"{key}={value}")]
    log = installed_venv.root / f"driver-{directory.name}.log"
    # Stopped by SIGTERM below; the pipe on its stdin stops it too should this process die.
    with open(log, "w") as err:
        driver = subprocess.Popen(
            [str(installed_venv.python), "-m", "slipstream", "driver", "--dir", str(directory),
             *settings, "--stop-when-stdin-closes"],
            stdin=subprocess.PIPE, stdout=err, stderr=subprocess.STDOUT, text=True,
            cwd=installed_venv.root, env=installed_venv.no_compiler_env())
    try:
        wait_for(lambda: driver.poll() is not None or (
            (directory / "conductor.sock").exists() and (directory / "counters.dat").exists()),
            timeout=30, what="the installed driver's start")
        assert driver.poll() is None, f"the driver exited {driver.returncode}: {log.read_text()}"
        yield driver, directory
        status = _stop(driver)
        assert status == 0, f"the driver exited {status}: {log.read_text()}"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(5)
        if driver.stdin is not None:
            driver.stdin.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_the_installed_driver_carries_ipc_and_udp_streams_and_reports_them(
        installed_venv: InstalledVenv,
        installed_driver: tuple[subprocess.Popen[str], Path]) -> None:
    """From the fresh environment, outside the checkout: the driver and a client over IPC and
    over UDP on 127.0.0.1 (600 messages of 1000 bytes each, about nine 64 KiB terms), both with
    no compiler to be found, the driver's data path on the wheel's own libcrypto;
    ``slipstream stat --once`` and ``--json``, and one scrape of ``slipstream metrics``."""
    driver, directory = installed_driver
    mapped = _mapped_files(driver.pid)
    network = [p for p in mapped if p.name.startswith("_network")]
    assert network and all(p.is_relative_to(installed_venv.path) for p in network), mapped
    assert not [p for p in mapped if p.is_relative_to(CHECKOUT)], mapped
    # The wheel's own copy (Python's hashlib may map the system's too: each extension binds
    # to the libraries it was linked with)
    crypto = [p for p in mapped if p.name.startswith("libcrypto")]
    assert [p for p in crypto if p.parent.name == "slipstream.libs"
            and p.is_relative_to(installed_venv.path)], crypto

    result = _python(installed_venv, CLIENT_SCRIPT, str(directory), str(free_port()),
                     env=installed_venv.no_compiler_env())
    streams = json.loads(result.stdout.splitlines()[0])
    assert [s["messages"] for s in streams] == [600, 600], streams

    stat = installed_venv.run([installed_venv.slipstream, "stat", "--once", "--dir", directory])
    assert stat.returncode == 0, stat.stderr
    assert str(driver.pid) in stat.stdout, stat.stdout
    stat_json = installed_venv.run([installed_venv.slipstream, "stat", "--json", "--dir",
                                    directory])
    assert stat_json.returncode == 0, stat_json.stderr
    snapshot = json.loads(stat_json.stdout)
    assert snapshot["driver_pid"] == driver.pid
    assert snapshot["counters"] and snapshot["driver"], snapshot

    exporter = subprocess.Popen(
        [str(installed_venv.slipstream), "metrics", "--dir", str(directory), "--address",
         "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=installed_venv.root, env=installed_venv.env())
    try:
        port = _wait_for_metrics_port(exporter)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert "slipstream_errors_total" in text and "slipstream_clients" in text, text[:2000]
        mapped = _mapped_files(exporter.pid)
        assert not [p for p in mapped if p.is_relative_to(CHECKOUT)], mapped
    finally:
        exporter.terminate()
        exporter.wait(10)


def test_the_installed_simulator_runs(installed_venv: InstalledVenv) -> None:
    result = installed_venv.run([installed_venv.slipstream, "sim", "--json", "--hosts", "3",
                                 "--messages", "300", "--loss", "0.02", "--size", "512"])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["delivered"] == [300, 300], report


def test_another_user_can_run_the_installed_package(installed_venv: InstalledVenv) -> None:
    """The environment is made from an interpreter outside /root and is world-readable: a
    process of another user (nobody) runs its command and imports the driver."""
    prefix = as_another_user(65534)
    result = installed_venv.run([*prefix, installed_venv.python, "-c",
                                 "import slipstream.daemon.driver, slipstream.client._fastpath"
                                 + ISOLATION_CHECK, CHECKOUT])
    assert result.returncode == 0, f"{installed_venv.base_python}: {result.stderr}"
    help_text = installed_venv.run([*prefix, installed_venv.slipstream, "--help"])
    assert help_text.returncode == 0 and "driver" in help_text.stdout, help_text.stderr


def test_the_installed_holder_command_names_the_archive_for_another_user(
        installed_venv: InstalledVenv) -> None:
    """The wheel's ``slipstream-holder`` command starts for another user (nobody), shows its
    help, and refuses (exit 2) naming the ``slipstream-archive`` settings that replace it,
    with the directory it was given."""
    prefix = as_another_user(65534)
    holder = installed_venv.path / "bin" / "slipstream-holder"
    help_text = installed_venv.run([*prefix, holder, "--help"])
    assert help_text.returncode == 0 and "--hold" in help_text.stdout, help_text.stderr
    missing = "/dev/shm/slipstream-no-driver-here"
    result = installed_venv.run([*prefix, holder, "--dir", missing])
    assert result.returncode == 2 and "slipstream-archive run" in result.stderr and \
        f'driver_dir = "{missing}"' in result.stderr, result.stderr


def test_the_installed_spark_bridge_imports(installed_venv: InstalledVenv) -> None:
    """``import slipstream.spark_bridge`` with the pyspark the spark extra installs."""
    result = _python(installed_venv, SPARK_SCRIPT)
    assert result.stdout.startswith("pyspark 4."), result.stdout


# -- the wheel as published: manylinux, no compiler, --version, types, the name clash ----------


def _pyproject() -> dict[str, Any]:
    with open(CHECKOUT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]


def _oldest_python() -> str:
    """The wheel's Python tag: ``cp311`` for requires-python ``>=3.11``."""
    floor = re.fullmatch(r">=3\.([0-9]+)", _pyproject()["requires-python"])
    assert floor, _pyproject()["requires-python"]
    return f"cp3{floor[1]}"


def test_the_wheel_is_manylinux_and_installs_from_the_wheelhouse_with_no_compiler(
        installed_venv: InstalledVenv) -> None:
    """``make wheel`` gives one abi3 manylinux wheel of this machine for every CPython from
    the oldest one requires-python allows (``cp311-abi3``) that auditwheel vouches for, with
    OpenSSL's libcrypto inside; the environment installed it from the wheelhouse alone
    (``--no-index``) where no compiler could be found, and pip processed wheels only: it
    built nothing."""
    version = _pyproject()["version"]
    python = _oldest_python()
    tag = re.fullmatch(rf"slipstream-{re.escape(version)}-{python}-abi3-"
                       rf"(manylinux_2_[0-9]+_{platform.machine()})\.whl",
                       installed_venv.wheel.name)
    assert tag, installed_venv.wheel.name
    show = subprocess.run([sys.executable, "-m", "auditwheel", "show", installed_venv.wheel],
                          capture_output=True, text=True, timeout=120)
    assert show.returncode == 0, show.stderr
    assert f'consistent with the following platform tag: "{tag[1]}"' in " ".join(
        show.stdout.split()), show.stdout
    assert [n for n in _wheel_names(installed_venv)
            if n.startswith("slipstream.libs/libcrypto")], _wheel_names(installed_venv)

    env = installed_venv.no_compiler_env()
    assert not Path(NO_COMPILER).exists()
    assert not [c for c in COMPILERS if shutil.which(c, path=env["PATH"])], env["PATH"]
    log = installed_venv.offline_install
    processed = re.findall(r"^Processing (\S+)", log, re.MULTILINE)
    assert processed and all(p.endswith(".whl") for p in processed), log
    assert any(Path(p).name == installed_venv.wheel.name for p in processed), log
    for building in ("Building wheel", "setup.py", "Preparing metadata", "build dependencies"):
        assert building not in log, log
    assert re.search(rf"^Successfully installed .*\bslipstream-{re.escape(version)}\b", log,
                     re.MULTILINE), log
    (record,) = installed_venv.path.glob(f"lib/python*/site-packages/slipstream-{version}"
                                         ".dist-info/WHEEL")
    assert f"Tag: {python}-abi3-{tag[1]}" in record.read_text().splitlines()


def test_abi3audit_finds_nothing_in_the_wheel(installed_venv: InstalledVenv) -> None:
    """abi3audit reads every extension of the wheel (the three of them) and finds each one
    abi3, using no symbol outside the stable ABI and none newer than the wheel's tag
    (``cp311-abi3``: the stable ABI of 3.11) allows."""
    abi3audit = Path(sys.executable).with_name("abi3audit")
    if not abi3audit.exists():
        lacking("abi3audit is missing: make install brings it (the test extra)")
    audit = subprocess.run([abi3audit, "--strict", "--report", installed_venv.wheel],
                           capture_output=True, text=True, timeout=300)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    (spec,) = json.loads(audit.stdout)["specs"].values()
    assert spec["kind"] == "wheel", spec
    results = {Path(found["name"]).name.split(".")[0]: found["result"]
               for found in spec["wheel"]}
    assert set(results) == {"_native", "_network", "_fastpath"}, results
    floor = _oldest_python().removeprefix("cp3")
    for name, result in results.items():
        assert result["is_abi3"] and result["is_abi3_baseline_compatible"], (name, result)
        assert result["baseline"] == f"3.{floor}", (name, result)
        assert not result["non_abi3_symbols"], (name, result)
        newer = {symbol: since for symbol, since in result["future_abi3_objects"].items()
                 if int(since.split(".")[1]) > int(floor)}
        assert not newer, (name, newer)


def test_the_wheel_says_it_is_for_linux_and_typed(installed_venv: InstalledVenv) -> None:
    """The published metadata: Linux only, CPython 3.11 on, typed; every folder of the package
    carries py.typed (PEP 561: a namespace package's portions each carry it) and the compiled
    modules their .pyi."""
    with zipfile.ZipFile(installed_venv.wheel) as wheel:
        metadata = wheel.read(
            f"slipstream-{_pyproject()['version']}.dist-info/METADATA").decode()
    classifiers = set(re.findall(r"^Classifier: (.*)$", metadata, re.MULTILINE))
    assert classifiers == set(_pyproject()["classifiers"]), classifiers
    assert {"Operating System :: POSIX :: Linux", "Typing :: Typed",
            "Programming Language :: Python :: 3.11"} <= classifiers
    assert "Requires-Python: >=3.11" in metadata.splitlines()
    names = set(_wheel_names(installed_venv))
    folders = {package.replace(".", "/") for package in package_roots()}
    assert not [f for f in folders if f"{f}/py.typed" not in names], sorted(names)
    compiled = {n.split(".")[0] for n in names if n.endswith(".so") and "/" in n
                and not n.startswith("slipstream.libs/")}
    assert {f"{c}.pyi" for c in compiled} <= names, compiled


def test_version_and_python_m_are_the_slipstream_command(installed_venv: InstalledVenv) -> None:
    """``slipstream --version`` prints the installed distribution's version (its metadata,
    pyproject.toml's); ``python -m slipstream`` is the same command."""
    version = _pyproject()["version"]
    metadata = installed_venv.run([installed_venv.python, "-c", "import importlib.metadata as m; "
                                   "print(m.version('slipstream'))"])
    assert metadata.stdout == f"{version}\n", metadata.stderr
    for command in ([installed_venv.slipstream], [installed_venv.python, "-m", "slipstream"]):
        result = installed_venv.run([*command, "--version"])
        assert (result.returncode, result.stdout) == (0, f"slipstream {version}\n"), result
    script = installed_venv.run([installed_venv.slipstream, "--help"])
    module = installed_venv.run([installed_venv.python, "-m", "slipstream", "--help"])
    assert script.returncode == module.returncode == 0, (script.stderr, module.stderr)
    assert module.stdout == script.stdout and "--version" in script.stdout, module.stdout


#: A user's program of the public client API, which a type checker must accept in its strict
#: mode against the installed package: typed parameters and results, no Any leaking in.
TYPED_PROGRAM = """
from slipstream.client import (BACK_PRESSURED, NOT_CONNECTED, Client, DriverError, Header,
                               Image, Publication, Subscription)


def handler(data: memoryview, header: Header) -> None:
    print(bytes(data).decode(), header.position, header.session_id)


def images(subscription: Subscription) -> list[int]:
    return [image.position for image in subscription.images]


def run(directory: str) -> int:
    try:
        with Client.connect(directory, timeout=2.0) as client:
            subscription: Subscription = client.add_subscription("aeron:ipc", 1001)
            publication: Publication = client.add_publication("aeron:ipc", 1001)
            position: int = publication.offer(b"hello")
            if position in (NOT_CONNECTED, BACK_PRESSURED):
                return 1
            received: int = subscription.poll(handler, 10)
            received += subscription.receive(handler, 10, timeout=1.0)
            first: Image | None = subscription.images[0] if subscription.images else None
            print(first, images(subscription), publication.position)
            return received
    except DriverError as e:
        print(e)
        return 2
"""

#: The same calls with wrong types: the type checker must name each line.
MISTYPED_PROGRAM = """
from slipstream.client import Client

with Client.connect() as client:
    client.add_publication(1001, "aeron:ipc")
    client.add_subscription("aeron:ipc", 1001).poll(10)
    position: str = client.add_publication("aeron:ipc", 1001).offer(b"x")
"""
#: (line, mypy error code) of MISTYPED_PROGRAM's errors.
MISTYPED_ERRORS = {(5, "arg-type"), (6, "arg-type"), (7, "assignment")}


def test_a_type_checker_accepts_the_installed_public_api(installed_venv: InstalledVenv) -> None:
    """mypy, given the installed environment's interpreter (as a user's editor or CI runs it):
    the whole client package (``slipstream.client``, the public API and its modules, with
    the compiled modules' .pyi) and ``slipstream._distribution`` check clean with mypy's
    defaults; a user's program of the public API checks clean with ``--strict``, which
    needs py.typed (else mypy refuses the import as untyped); and the same calls with wrong
    types are caught, line by line."""
    if importlib.util.find_spec("mypy") is None:
        lacking("needs mypy (pip install 'slipstream[test]'; make install)")
    work = Path(tempfile.mkdtemp(prefix="types-", dir=installed_venv.root))
    (work / "typed_program.py").write_text(TYPED_PROGRAM)
    (work / "mistyped_program.py").write_text(MISTYPED_PROGRAM)
    mypy = [sys.executable, "-m", "mypy", "--python-executable", str(installed_venv.python),
            "--cache-dir", str(work / "cache"), "--no-error-summary", "--show-error-codes"]

    def check(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*mypy, *args], capture_output=True, text=True, timeout=300,
                              cwd=work, env=installed_venv.env())

    package = check("-p", "slipstream.client", "-m", "slipstream._distribution")
    assert package.returncode == 0, package.stdout + package.stderr
    program = check("--strict", "typed_program.py")
    assert program.returncode == 0, program.stdout + program.stderr
    mistyped = check("--strict", "mistyped_program.py")
    found = {(int(line), code) for line, code in re.findall(
        r"^mistyped_program\.py:([0-9]+): error: .*\[([a-z-]+)\]$", mistyped.stdout,
        re.MULTILINE)}
    assert mistyped.returncode == 1 and found == MISTYPED_ERRORS, mistyped.stdout


#: Another distribution on PyPI whose import package is named ``slipstream`` too (a Kafka
#: stream-processing library), at the version this test was written against.
CLASHING = ("slipstream-async", "1.0.5")


def test_another_distributions_slipstream_package_is_refused_naming_it(
        installed_venv: InstalledVenv) -> None:
    """slipstream-async installed beside the wheel in one environment: the two share the
    folder ``slipstream/`` but no file, so the order of installing does not matter, and its
    ``__init__.py`` makes the folder a regular package.  The command, ``python -m slipstream``
    and ``import slipstream.client`` then fail with one error that names slipstream-async and
    what to do; ``import slipstream`` is still slipstream-async's.  Once it is uninstalled,
    slipstream works."""
    name, version = CLASHING
    root = Path(tempfile.mkdtemp(prefix="clash-", dir=installed_venv.root))
    venv = root / "venv"
    python, command = venv / "bin" / "python", venv / "bin" / "slipstream"
    env = {**installed_venv.env(), "VIRTUAL_ENV": str(venv),
           "PATH": os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "/usr/bin")])}

    def run(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
        return installed_venv.run(args, env=env, cwd=root, timeout=300)

    try:
        for step in ([installed_venv.base_python, "-m", "venv", venv],
                     [python, "-m", "pip", "install", "--disable-pip-version-check",
                      "--no-index", "--find-links", installed_venv.wheelhouse, "slipstream"],
                     [python, "-m", "pip", "install", "--disable-pip-version-check",
                      f"{name}=={version}"]):
            done = run(*step)
            assert done.returncode == 0, done.stdout + done.stderr
        files = run(python, "-c", "import importlib.metadata as m, json, sys; print(json.dumps("
                    "[sorted(str(f) for f in m.files(d)) for d in sys.argv[1:]]))",
                    "slipstream", name)
        ours, theirs = (
            {f for f in names if f.startswith("slipstream/") and "__pycache__" not in f}
            for names in json.loads(files.stdout))
        assert "slipstream/__init__.py" in theirs and not ours & theirs, ours & theirs

        for refused in ([command, "--version"], [python, "-m", "slipstream", "--help"],
                        [python, "-c", "import slipstream.client"]):
            result = run(*refused)
            last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
            assert result.returncode == 1 and last.startswith(
                "slipstream._distribution.ForeignPackageError: `import slipstream` found "), (
                refused, result.stderr)
            assert (f"installed by {name} {version}, not by slipstream" in last
                    and f"pip uninstall {name}" in last), last
        theirs_imports = run(python, "-c", "import slipstream; print(slipstream.stream)")
        assert theirs_imports.returncode == 0, theirs_imports.stderr

        removed = run(python, "-m", "pip", "uninstall", "--disable-pip-version-check", "-y",
                      name)
        assert removed.returncode == 0, removed.stderr
        result = run(command, "--version")
        assert (result.returncode, result.stdout) == (
            0, f"slipstream {_pyproject()['version']}\n"), result.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)



def test_a_stray_slipstream_folder_is_refused_naming_its_path(tmp_path: Path) -> None:
    """A regular ``slipstream`` package that no distribution installed (an application's own
    folder of that name, on PYTHONPATH), seen by the checkout's editable install, whose
    finder still reaches ``slipstream.client``: the error names the folder and what to do."""
    stray = tmp_path / "slipstream"
    stray.mkdir()
    (stray / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", "import slipstream.client"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    assert result.returncode == 1 and last.startswith(
        "slipstream._distribution.ForeignPackageError:"), result.stderr
    assert (f"found the regular package {stray / '__init__.py'}, which no installed "
            f"distribution claims" in last and "Take that folder off the Python path" in last), last

# -- the pyspark floor --------------------------------------------------------------------------

#: argv: the version pyspark pretends to be.  Run by the checkout's interpreter, whose pyspark
#: is new enough; the fake is the one way to see an old one without installing it.
OLD_PYSPARK_SCRIPT = r"""
import sys
import pyspark
pyspark.__version__ = sys.argv[1]
try:
    import slipstream.spark_bridge
except ImportError as e:
    print(type(e).__name__, "|", e)
else:
    print("imported")
"""


@pytest.mark.parametrize(("version", "outcome"), [
    ("4.1.0", "refused"), ("4.0.1", "refused"), ("3.5.3", "refused"),
    ("4.2.0", "imported"), ("4.2.0.dev0", "imported"), ("4.3.0", "imported"),
])
def test_an_older_pyspark_is_refused_with_the_version_needed(version: str, outcome: str) -> None:
    pytest.importorskip("pyspark", reason="needs pyspark (pip install 'slipstream[spark]')")
    result = subprocess.run([sys.executable, "-c", OLD_PYSPARK_SCRIPT, version],
                            capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stderr
    if outcome == "imported":
        assert result.stdout.strip() == "imported", result.stdout
    else:
        assert result.stdout.strip() == (
            f"PysparkVersionError | slipstream.spark_bridge needs pyspark >= 4.2 (found "
            f"{version}): pip install 'slipstream[spark]'"), result.stdout


def test_the_floor_is_the_one_pyproject_pins() -> None:
    pytest.importorskip("pyspark", reason="needs pyspark (pip install 'slipstream[spark]')")
    from slipstream.spark_bridge._requirements import PYSPARK_FLOOR, release

    with open(CHECKOUT / "pyproject.toml", "rb") as file:
        extras = tomllib.load(file)["project"]["optional-dependencies"]["spark"]
    floor = ".".join(map(str, PYSPARK_FLOOR))
    assert f"pyspark>={floor},<5" in extras, extras
    assert release("4.2.0rc1") == (4, 2, 0) and release("4.10") == (4, 10)
    assert release("unknown") is None
