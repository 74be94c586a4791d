"""Build hooks: the cffi extensions (slipstream.client._native, the log buffer's hot paths;
slipstream.daemon._network, the driver's network data path) and the two per-message calls as a
plain CPython extension (slipstream.client._fastpath), all compiled at install time."""

from setuptools import Extension, setup

setup(
    cffi_modules=["client/_native_build.py:ffibuilder", "daemon/_network_build.py:ffibuilder"],
    ext_modules=[
        Extension(
            "slipstream.client._fastpath",
            sources=["client/fastpath.c", "client/native.c"],
            include_dirs=["client"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        )
    ],
)
