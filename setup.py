"""Build hooks: the cffi extension (slipstream.client._native) and the two per-message calls
as a plain CPython extension (slipstream.client._fastpath), both compiled at install time."""

from setuptools import Extension, setup

setup(
    cffi_modules=["client/_native_build.py:ffibuilder"],
    ext_modules=[
        Extension(
            "slipstream.client._fastpath",
            sources=["client/fastpath.c", "client/native.c"],
            include_dirs=["client"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        )
    ],
)
