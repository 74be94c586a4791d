"""Build hook: compiles the cffi extension (slipstream.client._native) at install time."""

from setuptools import setup

setup(cffi_modules=["client/_native_build.py:ffibuilder"])
