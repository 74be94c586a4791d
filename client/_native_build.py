"""cffi API-mode build of slipstream.client._native (run by setup.py at install time)."""

import os
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADER = (HERE / "native.h").read_text()
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
    sources=[os.path.relpath(HERE / "native.c")],
    include_dirs=[str(HERE)],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
