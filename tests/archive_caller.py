"""A caller of an archive named by host name (run inside a test host, through its driver):
it lists the archive's recordings and replays the first, then waits for a line on stdin (the
archive moved meanwhile) and does it again with the same :class:`ArchiveClient`, timing the
first call from that line.  Prints one JSON line per round: the time to the list's answer
(s), the reply channel it used, and the replay's messages (their count, and whether they are
the sequence numbers 0 .. count-1 once each, in order).

    python tests/archive_caller.py DRIVER_DIR NAME PORT CONTROL_STREAM TIMEOUT_S
"""

from __future__ import annotations

import json
import sys
import time

from helpers import SEQUENCE  # tests/helpers.py's message(): its sequence number first

from slipstream.archive import ArchiveClient
from slipstream.client import Client
from slipstream.client.holding import CallError


def one_round(archive: ArchiveClient, timeout_s: float) -> dict[str, object]:
    """List until the archive answers (each call up to its timeout), then replay the first
    recording whole."""
    started = time.monotonic()
    deadline = started + timeout_s
    failures = 0
    while True:
        try:
            recordings = archive.list_recordings()
            break
        except CallError:
            failures += 1
            if time.monotonic() > deadline:
                raise
    answered_s = time.monotonic() - started
    seqs: list[int] = []
    with archive.replay(recordings[0].recording_id) as replay:
        replay.read_all(lambda data, _h: seqs.append(SEQUENCE.unpack_from(data)[0]),
                        timeout_s=timeout_s)
    return {"answered_s": answered_s, "failed_calls": failures,
            "reply_channel": archive.reply_channel, "recordings": len(recordings),
            "messages": len(seqs), "in_order": seqs == list(range(len(seqs)))}


def main() -> None:
    directory, name, port, stream, timeout = sys.argv[1:6]
    with Client.connect(directory) as client, \
            ArchiveClient(client, name, int(port), int(stream), timeout_s=2.0) as archive:
        print(json.dumps(one_round(archive, float(timeout))), flush=True)
        sys.stdin.readline()  # the archive moved, its name with it
        print(json.dumps(one_round(archive, float(timeout))), flush=True)


if __name__ == "__main__":
    main()
