"""The wheel on a CPython other than the one that built it: Debian 13's CPython 3.13.

``make wheel`` builds one ``cp311-abi3`` wheel (the extensions use the limited API of 3.11)
and puts its dependencies' wheels for every CPython version the classifiers name beside it.
Here Debian trixie's own python3 (3.13), in a Debian root made by debootstrap, installs it
from that wheelhouse alone (no index, no compiler in the root) into a virtual environment,
and the tutorial's first programs run there (docs/TUTORIAL.md, "A subscriber and a
publisher": ``subscriber.py``, ``publisher.py`` and the block that runs them) against a
driver the environment's ``slipstream driver`` started, printing what the page shows.

The root is debootstrap's minbase of trixie with python3 and python3-venv, from the mirror
apt uses; made once (1-2 minutes) and kept in the checkout's .venv beside the stock Aeron
driver's jar (``.venv/aeron``, scripts/ensure-aeron), as :data:`ROOT_CACHE`.  Each run works
on an overlay of it in a mount and pid namespace of its own (``unshare``): its writes land
in a tmpfs and go with the namespace, so the kept root stays as debootstrap made it, and so
does every process the run started (the driver included) when the run ends or is killed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import lacking
from installed import CHECKOUT, COMPILERS, INSTALL_TIMEOUT_S, InstalledVenv
from test_docs import code_blocks

#: The Debian suite whose python3 is another CPython than this one, and that version.
SUITE, SUITE_PYTHON = "trixie", (3, 13)
PACKAGES = "python3,python3-venv"
#: The kept root (debootstrap's, about 270 MB), made when missing.
ROOT_CACHE = CHECKOUT / ".venv" / f"debian-{SUITE}"
TUTORIAL = "docs/TUTORIAL.md"
#: The page's blocks the run uses: the two programs, the block that runs them.
PROGRAMS, RUN_BLOCK = ("subscriber.py", "publisher.py"), "ipc-run"

#: Run by ``unshare`` as ``sh -c SCRIPT sh ROOT SCRATCH WORK``: the overlay of ROOT (the
#: writes in a tmpfs at SCRATCH), /proc, /dev with a /dev/shm of its own, and WORK at /work,
#: then /work/inside.sh in the root as root with a bare environment.
NAMESPACE_SCRIPT = r"""
set -eu
root=$1 scratch=$2 work=$3
mount -t tmpfs tmpfs "$scratch"
mkdir "$scratch/upper" "$scratch/overlay" "$scratch/merged"
mount -t overlay overlay \
    -o "lowerdir=$root,upperdir=$scratch/upper,workdir=$scratch/overlay" "$scratch/merged"
mount -t proc proc "$scratch/merged/proc"
mount --rbind /dev "$scratch/merged/dev"
mount -t tmpfs -o mode=1777 tmpfs "$scratch/merged/dev/shm"
mkdir -p "$scratch/merged/work"
mount --bind "$work" "$scratch/merged/work"
exec chroot "$scratch/merged" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    /bin/sh /work/inside.sh
"""

#: In the root: the environment from the wheelhouse alone, the driver, the page's block.
INSIDE_SCRIPT = r"""
set -eu
cd /work
for compiler in {compilers}; do
    if command -v "$compiler" >/dev/null; then echo "a compiler in the root: $compiler"; exit 3; fi
done
python3 -c 'import sys; print("python", *sys.version_info[:2])'
python3 -m venv /opt/slipstream
/opt/slipstream/bin/pip install --disable-pip-version-check --no-cache-dir --no-index \
    --only-binary=:all: --find-links /work/wheelhouse slipstream > pip.log 2>&1 \
    || {{ cat pip.log; exit 4; }}
export PATH=/opt/slipstream/bin:/usr/bin:/bin SLIPSTREAM_DIR=/dev/shm/slipstream-{suite}
export SLIPSTREAM_DRAIN_TIMEOUT=2s SLIPSTREAM_IPC_TERM_BUFFER_LENGTH=1m
python -c 'import slipstream.client._fastpath as f; print("fastpath", f.__file__)'
slipstream driver > driver.log 2>&1 &
driver=$!
tries=0
until grep -q "running in" driver.log; do
    tries=$((tries + 1))
    if [ "$tries" -gt 600 ] || ! kill -0 "$driver" 2>/dev/null; then
        echo "the driver did not start:"; cat driver.log; exit 5
    fi
    sleep 0.1
done
bash -euo pipefail run.sh > run.out 2> run.err || {{ cat run.out run.err; exit 6; }}
kill -TERM "$driver"
wait "$driver" || {{ echo "the driver exited $?:"; cat driver.log; exit 7; }}
echo "ran"
"""


def _mirror() -> str:
    """The mirror apt uses here (deb822 sources first, then sources.list), else Debian's:
    as scripts/build-base-image chooses it."""
    for path, key in ((Path("/etc/apt/sources.list.d/debian.sources"), "URIs:"),
                      (Path("/etc/apt/sources.list"), "deb")):
        if path.exists():
            for line in path.read_text().splitlines():
                words = line.split()
                if len(words) > 1 and words[0] == key:
                    return words[1] if key == "URIs:" else words[-3]
    return "http://deb.debian.org/debian"


def _root() -> Path:
    """The kept Debian root (module docstring), made by debootstrap when missing; a
    half-made one (``.partial``) is made again."""
    if (ROOT_CACHE / "usr" / "bin" / "python3").exists():
        return ROOT_CACHE
    partial = ROOT_CACHE.with_name(ROOT_CACHE.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    made = subprocess.run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE,
                           str(partial), _mirror()], capture_output=True, text=True,
                          timeout=900)
    assert made.returncode == 0, f"debootstrap failed:\n{(made.stdout + made.stderr)[-4000:]}"
    partial.rename(ROOT_CACHE)
    return ROOT_CACHE


def run_in_root(root: Path, work: Path, script: str, scratch: Path, timeout: float,
                prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """``script`` (sh) run as root in the Debian root ``root`` (:data:`NAMESPACE_SCRIPT`: an
    overlay of it whose writes land in a tmpfs at the empty folder ``scratch``, with ``work``
    at /work, as /work/inside.sh), in a mount and pid namespace of its own that ends every
    process it started; its output captured.  ``prefix`` runs it in another network
    namespace (``Host.prefix()``: a namespace host's)."""
    (work / "inside.sh").write_text(script)
    return subprocess.run(
        [*prefix, "unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation",
         "private", "sh", "-c", NAMESPACE_SCRIPT, "sh", str(root), str(scratch), str(work)],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _blocks() -> dict[str, str]:
    """The tutorial's programs and the block that runs them, by name; and its output."""
    blocks = {b.name if b.mark == "block" else f"{b.name} output": b.text
              for b in code_blocks(TUTORIAL)
              if b.mark in ("block", "output") and b.name in (*PROGRAMS, RUN_BLOCK)}
    assert set(blocks) == {*PROGRAMS, RUN_BLOCK, f"{RUN_BLOCK} output"}, sorted(blocks)
    return blocks


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 900)
def test_debians_python_3_13_installs_the_wheel_and_runs_the_tutorials_programs(
        installed_venv: InstalledVenv, tmp_path: Path) -> None:
    """Debian trixie's CPython 3.13 (not the 3.11 that built the wheel) installs the
    ``cp311-abi3`` wheel from the wheelhouse alone with no compiler, loads its extensions
    (the abi3 builds), and the tutorial's subscriber and publisher print the five messages
    the page shows, through a driver of that environment."""
    if os.geteuid() != 0:
        lacking("needs root (debootstrap, mounts, chroot)")
    for tool, package in (("debootstrap", "debootstrap"), ("unshare", "util-linux"),
                          ("chroot", "coreutils")):
        if shutil.which(tool) is None:
            lacking(f"{tool} is missing: make tools installs {package}")
    root = _root()
    work = tmp_path / "work"
    shutil.copytree(installed_venv.wheelhouse, work / "wheelhouse",
                    ignore=shutil.ignore_patterns("sdist"))
    blocks = _blocks()
    for name in PROGRAMS:
        (work / name).write_text(blocks[name])
    (work / "run.sh").write_text(blocks[RUN_BLOCK])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ran = run_in_root(root, work, INSIDE_SCRIPT.format(compilers=" ".join(COMPILERS),
                                                       suite=SUITE), scratch, timeout=600)
    assert ran.returncode == 0, f"exited {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    lines = ran.stdout.splitlines()
    assert f"python {SUITE_PYTHON[0]} {SUITE_PYTHON[1]}" in lines, ran.stdout
    assert SUITE_PYTHON != sys.version_info[:2], "the root's Python is this one"
    fastpath = next(line for line in lines if line.startswith("fastpath "))
    assert fastpath.endswith("/_fastpath.abi3.so"), fastpath
    assert lines[-1] == "ran", ran.stdout
    assert (work / "run.out").read_text() == blocks[f"{RUN_BLOCK} output"]
    assert "slipstream-" in (work / "pip.log").read_text()
