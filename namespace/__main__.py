"""``python -m slipstream``: the ``slipstream`` command (slipstream.daemon.cli)."""

import sys

from slipstream.daemon.cli import main

sys.exit(main())
