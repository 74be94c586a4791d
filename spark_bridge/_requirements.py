"""The pyspark the bridge needs, checked when ``slipstream.spark_bridge`` is imported, before
any pyspark name: an older pyspark would fail on the first name it lacks, with an ImportError
that says nothing of versions.

The floor is the first pyspark that has every name the bridge uses:
``pyspark.sql.streaming.datasource`` (``ReadLimit``, ``ReadAllAvailable``, ``ReadMaxRows``,
``ReadMaxBytes``, ``SupportsTriggerAvailableNow``) is new in 4.2.0, and
``pyspark.sql.datasource.DataSourceStreamArrowWriter`` in 4.1.0.  pyproject.toml's ``spark``
extra pins the same floor.
"""

from __future__ import annotations

import re
from typing import Final

#: The oldest pyspark release the bridge runs on (major, minor).
PYSPARK_FLOOR: Final = (4, 2)
INSTALL_HINT: Final = "pip install 'slipstream[spark]'"


class PysparkVersionError(ImportError):
    """pyspark is missing, or older than :data:`PYSPARK_FLOOR`: the message names the version
    needed, the one found and how to install it."""


def release(version: str) -> tuple[int, ...] | None:
    """The release numbers at the start of a version string (``"4.2.0.dev1"`` -> ``(4, 2,
    0)``), or None when it has none.  Pre- and dev releases count as their release: a 4.2
    release candidate has the 4.2 names."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match[1].split(".")) if match else None


def require_pyspark() -> str:
    """The version of the pyspark importable here; :class:`PysparkVersionError` when there is
    none or it is older than :data:`PYSPARK_FLOOR` (a version that cannot be read passes: the
    imports tell then)."""
    needed = ".".join(map(str, PYSPARK_FLOOR))
    try:
        import pyspark
    except ImportError as e:
        raise PysparkVersionError(
            f"slipstream.spark_bridge needs pyspark >= {needed} (found none: {e}): "
            f"{INSTALL_HINT}", name="pyspark") from e
    found = str(getattr(pyspark, "__version__", ""))
    numbers = release(found)
    if numbers is not None and numbers < PYSPARK_FLOOR:
        raise PysparkVersionError(
            f"slipstream.spark_bridge needs pyspark >= {needed} (found {found}): "
            f"{INSTALL_HINT}", name="pyspark")
    return found


#: The pyspark version found (the check runs once, at import).
PYSPARK_VERSION: Final = require_pyspark()
