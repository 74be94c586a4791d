"""``python -m slipstream``: the ``slipstream`` command (slipstream.cli)."""

import sys

from slipstream.cli import main

sys.exit(main())
