# The compiled cffi module slipstream.daemon._network (daemon/_network_build.py): cffi builds
# ``ffi`` and ``lib`` from C declarations at run time, which no type checker reads.
from typing import Any

ffi: Any
lib: Any
