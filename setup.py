"""Build hooks: the packages, found rather than listed; the cffi extensions
(slipstream.client._native, the log buffer's hot paths; slipstream.daemon._network, the driver's
network data path) and the two per-message calls as a plain CPython extension
(slipstream.client._fastpath), all compiled at install time.

Every extension is built for the limited API (abi3): cffi's by cffi, _fastpath for
:data:`LIMITED_API`; the wheel is tagged ``cp311-abi3`` and installs on every CPython from 3.11
on."""

import runpy
import tomllib
from pathlib import Path

from setuptools import Extension, find_packages, setup

HERE = Path(__file__).resolve().parent
#: The client's hot paths' build (client/_native_build.py): _fastpath compiles its SOURCES in too.
NATIVE = runpy.run_path(str(HERE / "client" / "_native_build.py"))
#: The oldest CPython whose stable ABI the extensions use (Py_LIMITED_API's hex form), and the
#: wheel's matching tag: pyproject.toml's requires-python.
LIMITED_API = 0x030B0000
LIMITED_API_TAG = "cp311"


def find_slipstream_packages() -> list[str]:
    """Every package under the roots of ``[tool.setuptools] package-dir`` in pyproject.toml
    (``"slipstream.daemon" = "daemon"``, ...): the root and each folder below it with an
    ``__init__.py``, named under the root's package (``daemon/pressure`` is
    ``slipstream.daemon.pressure``).  A listed set forgot one once, and the installed driver
    could not start."""
    with open(HERE / "pyproject.toml", "rb") as file:
        roots = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    packages = []
    for package, folder in roots.items():
        packages.append(package)
        packages += [f"{package}.{sub}" for sub in find_packages(str(HERE / folder))]
    return sorted(packages)


setup(
    packages=find_slipstream_packages(),
    cffi_modules=["client/_native_build.py:ffibuilder", "daemon/_network_build.py:ffibuilder"],
    ext_modules=[
        Extension(
            "slipstream.client._fastpath",
            sources=["client/fastpath.c", *(f"client/{name}" for name in NATIVE["SOURCES"])],
            depends=[f"client/{name}" for name in NATIVE["HEADERS"]],
            include_dirs=["client"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
            define_macros=[("Py_LIMITED_API", f"0x{LIMITED_API:08X}")],
            py_limited_api=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": LIMITED_API_TAG}},
)
