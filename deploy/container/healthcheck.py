#!/opt/slipstream/bin/python
"""slipstream-healthcheck [--dir DIR] [--timeout SECONDS]: exit 0 when the driver of DIR
(default ``$SLIPSTREAM_DIR``) accepts a client, else print why on stderr and exit 1.

It connects as an application does (``Client.connect``: the driver holds its directory's
lock, and its conductor answers CONNECT on the control socket), then closes: a driver that
has started but not yet opened its socket, or one that is draining or stuck, is not healthy.
The image's HEALTHCHECK and the Kubernetes probes (deploy/kubernetes/) run it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from slipstream.client import Client
from slipstream.client.errors import SlipstreamError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream-healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="driver directory (default: $SLIPSTREAM_DIR)")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="seconds to wait for the driver's answer (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        with Client.connect(args.dir, timeout=args.timeout) as client:
            directory = client.directory
    except SlipstreamError as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    print(f"healthy: the driver in {directory} accepts clients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
