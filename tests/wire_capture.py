"""A host on the segment that records a stream and plays the recording back (run inside a
test host made with ``shared_segment=True``, as root; tests/test_encrypted_hosts.py):

    python tests/wire_capture.py capture FILE SECONDS PORT...
        every UDP datagram to or from one of the ports seen on the link, one JSON line each
        (source, destination, payload in hex) into FILE, until FILE.stop exists or SECONDS
        passed; prints their count
    python tests/wire_capture.py replay FILE SOURCE_IP SOURCE_PORT DEST_IP DEST_PORT
        the recorded datagrams from SOURCE to DEST, sent again spoofed from SOURCE, paced;
        prints how many
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from slipstream.sim.real.attacker import RawSender, Sniffer


def capture(path: Path, seconds: float, ports: set[int]) -> int:
    sniffer = Sniffer()
    count = 0
    stop = path.with_name(path.name + ".stop")
    deadline = time.monotonic() + seconds
    with path.open("w") as out:
        print("ready", flush=True)
        last = False
        while not last:
            # Once told to stop, one more pass for what the socket still holds.
            last = stop.exists() or time.monotonic() >= deadline
            for seen in sniffer.datagrams(0.2 if last else 0.1):
                if seen.source[1] in ports or seen.destination[1] in ports:
                    out.write(json.dumps([list(seen.source), list(seen.destination),
                                          seen.payload.hex()]) + "\n")
                    count += 1
    sniffer.close()
    return count


def replay(path: Path, source: tuple[str, int], destination: tuple[str, int]) -> int:
    raw = RawSender()
    sent = 0
    for line in path.read_text().splitlines():
        origin, target, payload = json.loads(line)
        if tuple(origin) == source and tuple(target) == destination:
            raw.send(source, destination, bytes.fromhex(payload))
            sent += 1
            if sent % 32 == 0:
                time.sleep(0.002)  # a burst would overflow the receiving socket's buffer
    raw.close()
    return sent


def main() -> int:
    if sys.argv[1] == "capture":
        print(capture(Path(sys.argv[2]), float(sys.argv[3]), {int(p) for p in sys.argv[4:]}),
              flush=True)
    else:
        source_ip, source_port, dest_ip, dest_port = sys.argv[3:7]
        print(replay(Path(sys.argv[2]), (source_ip, int(source_port)),
                     (dest_ip, int(dest_port))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
