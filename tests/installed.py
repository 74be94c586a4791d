"""The package as a user installs it, for tests that must not see the checkout.

``python -m build`` makes the sdist, and the wheel from the sdist, of a copy of the tree (the
files git tracks or would track: a fresh clone's, with this tree's edits), so nothing is
written into the checkout; the wheel, with its ``spark`` extra, goes into a fresh virtual
environment under /var/tmp, outside the checkout.  Its dependencies come from the package
index (pip's cache makes repeats fast).

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
#: Tree folders that are never part of the source (when there is no git to ask).
_NOT_SOURCE = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache",
               ".hypothesis", ".eggs", "tmp"}

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
    """The tree's source files, relative to the checkout: what git tracks or would track
    (not ignored), present on disk; without git, every file outside the folders that are never
    source (.venv, build, caches) and not compiled."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(CHECKOUT), "ls-files", "-z", "--cached", "--others",
             "--exclude-standard"], check=True, capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        found = []
        for folder, dirs, files in os.walk(CHECKOUT):
            dirs[:] = [d for d in dirs if d not in _NOT_SOURCE and not d.endswith(".egg-info")]
            found += [os.path.relpath(os.path.join(folder, f), CHECKOUT) for f in files
                      if not f.endswith((".so", ".pyc", ".o"))]
        return sorted(found)
    names = {name.decode() for name in listed.split(b"\0") if name}
    return sorted(name for name in names if (CHECKOUT / name).is_file())


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
    wheel: Path
    base_python: str  #: the interpreter the environment was made from
    #: seconds of each step: build (sdist, then wheel from it), venv, install
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


def make_installed_venv(root: Path) -> InstalledVenv:
    """Build the sdist and the wheel from it, and install the wheel with its spark extra into
    a fresh environment, all in ``root``."""
    before = build_leftovers()
    source, dist, venv, log = root / "source", root / "dist", root / "venv", root / "install.log"
    for name in source_files():  # a copy: the build writes egg-info into the tree it builds
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(CHECKOUT / name, target)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_USER"))}
    timings = {}
    # As `python -m build` does by default: the sdist, then the wheel from the sdist.
    timings["build"] = _step("python -m build", [sys.executable, "-m", "build", "--outdir",
                                                 dist, source], log, env, root, 600)
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in dist.iterdir())
    base = _base_python()
    timings["venv"] = _step("making the virtual environment", [base, "-m", "venv", venv],
                            log, env, root, 300)
    python = venv / "bin" / "python"
    timings["venv"] += _step("upgrading pip (as make install does)",
                             [python, "-m", "pip", "install", "--disable-pip-version-check",
                              "--upgrade", "pip"], log, env, root, 300)
    timings["install"] = _step(
        "installing the wheel", [python, "-m", "pip", "install", "--disable-pip-version-check",
                                 f"{wheels[0]}[spark]"], log, env, root, 900)
    return InstalledVenv(root=root, path=venv, python=python,
                         slipstream=venv / "bin" / "slipstream", sdist=sdists[0],
                         wheel=wheels[0], base_python=base, timings=timings,
                         leftovers_before=before)


@pytest.fixture(scope="session")
def installed_venv() -> Iterator[InstalledVenv]:
    """The package built (sdist, then the wheel from it) and installed with its spark extra
    into a fresh virtual environment under /var/tmp, world-readable; removed at the end of
    the session.  Needs the ``build`` package (``pip install 'slipstream[test]'``): skips
    without it, fails under CI=true."""
    if importlib.util.find_spec("build") is None:
        lacking("needs the build package (pip install 'slipstream[test]'; make install)")
    parent = WORK_PARENT if WORK_PARENT.is_dir() else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="slipstream-installed-", dir=parent))
    try:
        root.chmod(0o755)
        yield make_installed_venv(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
