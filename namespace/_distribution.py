"""Which distribution this is, and a clear refusal when another one's ``slipstream`` hides it.

``slipstream`` is a namespace package: the distribution installs its subpackages
(``slipstream.client``, ``slipstream.daemon``, ...) and two modules of its own (this one and
``__main__``) under it, never ``slipstream/__init__.py``.  Were it a regular package, another
distribution's ``slipstream/__init__.py`` would be the same file: pip would overwrite one with
the other, and uninstalling either would take it from under the other.  As it is, they share
no file.

Another distribution that installs a regular ``slipstream`` package (``slipstream-async``, a
Kafka stream-processing library, is one) still takes the name over: in the same site-packages
its ``__init__.py`` makes the shared folder its regular package, whose ``__init__`` runs
before any of these modules; elsewhere on ``sys.path`` it hides these modules entirely.
:func:`refuse_a_foreign_package` turns the first case into one error that names the other
distribution and what to do.  The second, no code of this distribution gets to see: Python
reports ``No module named 'slipstream.daemon'`` (docs/OPERATIONS.md, "The wheel").
"""

from __future__ import annotations

import sys
from pathlib import Path

#: The distribution's name, as pip and PyPI know it (``slipstream --version`` reports its
#: version; the clash below names any other owner of ``slipstream``).
DISTRIBUTION = "slipstream"
#: The namespace's one module name the refusal checks.
NAMESPACE = "slipstream"


class ForeignPackageError(ImportError):
    """``import slipstream`` found another distribution's regular package: the two cannot share
    one Python environment."""


def version() -> str:
    """This distribution's installed version (its metadata), or ``"unknown"`` when the modules
    run without being installed."""
    import importlib.metadata  # here: ~30 ms to import, which every process would pay

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _owner(init: Path) -> str | None:
    """The installed distribution (with its version) whose files include ``init``, or None."""
    import importlib.metadata

    for dist in importlib.metadata.distributions():
        for file in dist.files or ():
            if file.parts == (NAMESPACE, "__init__.py") and Path(
                    str(dist.locate_file(file))).resolve() == init:
                return f"{dist.metadata['Name']} {dist.version}"
    return None


def refuse_a_foreign_package() -> None:
    """Raise :class:`ForeignPackageError` when ``slipstream`` is a regular package (someone's
    ``__init__.py``) rather than this distribution's namespace.  Called first by the
    subpackages every command and client imports; costs one attribute lookup when all is
    well."""
    init = getattr(sys.modules.get(NAMESPACE), "__file__", None)
    if init is None:
        return
    path = Path(init).resolve()
    owner = _owner(path)
    if owner is None:
        raise ForeignPackageError(
            f"`import {NAMESPACE}` found the regular package {path}, which no installed "
            f"distribution claims (or one installed it without a file list: a system "
            f"package manager's); {DISTRIBUTION} (the media driver) is a namespace package "
            f"with no __init__.py. Take that folder off the Python path (PYTHONPATH, the "
            f"working directory), or remove its package, to use {DISTRIBUTION}.")
    name = owner.split()[0]
    raise ForeignPackageError(
        f"`import {NAMESPACE}` found {path}, installed by {owner}, not by {DISTRIBUTION} (the "
        f"media driver). Both install an import package named `{NAMESPACE}`, so they cannot "
        f"be used in one Python environment: install {DISTRIBUTION} in a virtual environment "
        f"without {name}, or remove it from this one (pip uninstall {name}).")


# At import: the subpackages every command and client imports (slipstream.client,
# slipstream.daemon) import this module before anything else.
refuse_a_foreign_package()
