"""cffi API-mode build of slipstream.client._native (run by setup.py at install time)."""

import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADER = (HERE / "native.h").read_text()


def _cdef_from_header(text: str) -> str:
    """The header's declarations without preprocessor lines, plus its #defines as constants."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#define "):
            parts = stripped.split(None, 2)
            if len(parts) == 3 and parts[2].lstrip("(-").rstrip(")").lstrip("0x").isalnum():
                lines.append(f"#define {parts[1]} ...")
            continue
        if stripped.startswith("#"):
            continue
        lines.append(line)
    return "\n".join(lines)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_from_header(HEADER))
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
