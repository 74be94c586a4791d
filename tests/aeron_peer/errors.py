"""The harness's errors: every one is an ``AeronError``."""

from __future__ import annotations


class AeronError(RuntimeError):
    """Something in the Aeron harness failed; the message carries the process output."""


class AeronNotInstalled(AeronError):
    """The Aeron jar or the Java 11 runtime is missing: run ``scripts/ensure-aeron``."""


class SampleFailed(AeronError):
    """A Java process exited badly, timed out or did not print what was expected."""
