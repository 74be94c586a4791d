"""Files mapped shared into this process for the C halves to read and write: one way to map
one, and one way to let it go (the counters file, logs, the driver's loss report)."""

from __future__ import annotations

import mmap
from typing import Any

from slipstream.client._native import ffi


def map_shared(fd: int, length: int, *, writable: bool) -> mmap.mmap:
    """``length`` bytes of the open file ``fd`` mapped shared, read-only unless ``writable``
    (the caller may close ``fd`` at once: the mapping keeps the file)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, length, mmap.MAP_SHARED, prot)


def unmap(mapping: mmap.mmap, cdata: Any) -> None:
    """Let go of ``mapping`` and of ``cdata``, cffi's buffer over it (``ffi.from_buffer``).  A
    mapping that a Python view still exports (a message handed to an application) is unmapped
    when that view goes, not now (mmap's ``BufferError``)."""
    ffi.release(cdata)
    try:
        mapping.close()
    except BufferError:
        pass
