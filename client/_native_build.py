"""cffi API-mode build of slipstream.client._native, the client's hot paths (run by setup.py at
install time): native.h is its interface, and SOURCES its C files, one per piece of Aeron's
client (native.c has their map)."""

import os
import re
from pathlib import Path

from cffi import FFI  # type: ignore[import-untyped]  # cffi has no types

HERE = Path(__file__).resolve().parent
HEADER = (HERE / "native.h").read_text()
#: The hot paths' C files (native_internal.h is what they share).  setup.py's _fastpath and
#: daemon/_network_build.py compile them in too; the Makefile lists them.
SOURCES = ("native.c", "native_appender.c", "native_block_appender.c", "native_reader.c",
           "native_scanner.c", "native_rebuilder.c", "native_gap_scanner.c", "native_logbuffer.c",
           "native_park.c", "native_keeper.c", "native_thread.c")
#: What they include, for rebuilding when it changes.
HEADERS = ("native.h", "native_internal.h")
#: An integer constant as the headers write them: ``0``, ``0x40``, ``(-100)``.
_INTEGER_DEFINE = re.compile(r"\(?-?(0[xX][0-9A-Fa-f]+|[0-9]+)\)?")


def cdef_from_header(text: str) -> str:
    """The header's declarations without preprocessor lines, plus its integer #defines as
    constants (``#define NAME ...``, the value taken from the compiled header)."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#define "):
            parts = stripped.split(None, 2)
            if len(parts) == 3 and _INTEGER_DEFINE.fullmatch(parts[2].split("/*")[0].strip()):
                lines.append(f"#define {parts[1]} ...")
            continue
        if stripped.startswith("#"):
            continue
        lines.append(line)
    return "\n".join(lines)


ffibuilder = FFI()
ffibuilder.cdef(cdef_from_header(HEADER))
ffibuilder.set_source(
    "slipstream.client._native",
    '#include "native.h"',
    # setuptools wants source paths relative to the project root, where it runs this file.
    sources=[os.path.relpath(HERE / name) for name in SOURCES],
    depends=[os.path.relpath(HERE / name) for name in HEADERS],
    include_dirs=[str(HERE)],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
