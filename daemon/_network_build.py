"""cffi API-mode build of slipstream.daemon._network, the driver's network data path (run by
setup.py at install time): network.h is its interface, and SOURCES its C files, one per component
(network.c has their map).  It compiles the client's hot paths in as well (the SOURCES of
client/_native_build.py), for the log-buffer scans."""

import importlib.util
import os
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
CLIENT = HERE.parent / "client"


def _native_build():  # the client's build module: its header-to-cdef rule, its SOURCES
    spec = importlib.util.spec_from_file_location("_native_build", CLIENT / "_native_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NATIVE = _native_build()
#: The data path's C files (network_internal.h is what they share; the Makefile lists them too).
SOURCES = ("network.c", "network_sender.c", "network_retransmit.c", "network_loss.c",
           "network_cleaner.c", "network_receiver.c", "network_endpoints.c", "network_duty.c",
           "network_crypto.c")

#: The simulator's transport binding calls back into Python with each datagram
#: (network_endpoints.c's virtual binding; daemon/media/send_point.py defines it).  "Python+C": the
#: data path's own C files call it, not only this module's.
VIRTUAL_DATAGRAM = ('extern "Python+C" int32_t ss_virtual_datagram(void *context, '
                    'const uint8_t *address, int32_t address_length, const uint8_t *data, '
                    'int32_t length);')

ffibuilder = FFI()
ffibuilder.cdef(NATIVE.cdef_from_header((HERE / "network.h").read_text())
                + "\n" + VIRTUAL_DATAGRAM)
ffibuilder.set_source(
    "slipstream.daemon._network",
    '#include "native.h"\n#include "network.h"',
    sources=[*(os.path.relpath(HERE / name) for name in SOURCES),
             *(os.path.relpath(CLIENT / name) for name in NATIVE.SOURCES)],
    depends=[os.path.relpath(HERE / name) for name in ("network.h", "network_internal.h")],
    include_dirs=[str(HERE), str(CLIENT)],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
    # libcrypto (OpenSSL): the AEAD and HKDF of encrypted channels (network_crypto.c).
    libraries=["crypto"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
