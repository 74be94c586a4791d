"""A caller with no key (run inside a test host, through its own driver): it calls an
archive's plain control endpoint as any caller does and tries every operation on the
archive's first recording and on the stream it records (held for a group), replays to its
own endpoint, and calls the archive's keyed endpoint in plain.  Prints one JSON object:
each operation's outcome (``ok`` with its result, or ``error`` with the archive's reason,
cause and message) and the messages its own subscriptions received.

    python tests/archive_outsider.py DRIVER_DIR ADDRESS PLAIN_PORT KEYED_PORT CONTROL_STREAM
        STREAM_CHANNEL STREAM_ID
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from slipstream.archive import ArchiveClient
from slipstream.client import Client
from slipstream.client.channel import channel_with_key
from slipstream.client.holding import CallError, HolderLink


def outcome(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        result = call()
    except CallError as e:
        answer = e.answer or {}
        return {"status": "error", "reason": answer.get("reason"),
                "cause": answer.get("cause"), "message": str(e)}
    return {"status": "ok", "result": repr(result)}


def main() -> None:
    directory, address, plain_port, keyed_port, control, channel, stream = sys.argv[1:8]
    stream_id = int(stream)
    held = {"channel": channel, "stream_id": stream_id, "group": "spark"}
    # The stream's channel as a host without its key would name it.
    unkeyed = {**held, "channel": channel_with_key(channel, None)}
    received = 0

    def count(_data: memoryview, _header: object) -> None:
        nonlocal received
        received += 1

    out: dict[str, Any] = {}
    with Client.connect(directory) as client, \
            ArchiveClient(client, address, int(plain_port), int(control),
                          timeout_s=5) as archive:
        # A plain endpoint of this host of its own, where it asks a replay to come.
        here = archive.reply_channel.split("endpoint=")[1].rsplit(":", 1)[0]
        own = f"aeron:udp?endpoint={here}:40999"
        mine = client.add_subscription(own, 77)
        ops: dict[str, Callable[[], Any]] = {
            "list": archive.list_recordings,
            "list_all": lambda: archive.list_all_recordings(stream_id=stream_id),
            "describe": lambda: archive.describe(0),
            "recording_position": lambda: archive.recording_position(0),
            "view": lambda: archive.view(0, "is_retained", {"position": 0}),
            "start_replay": lambda: archive.start_replay(0, own, 77),
            "replay": lambda: archive.replay(0).read_all(count, timeout_s=3),
            "replays": lambda: archive._call("replays"),
            "stop_replay": lambda: archive.stop_replay(1),
        }
        for op in ("state", "ended", "release"):
            ops[op] = lambda op=op: archive._link.call(op, **held, sessions=[1])
            ops[f"{op}_unkeyed"] = lambda op=op: archive._link.call(op, **unkeyed,
                                                                      sessions=[1])
        ops["held_view"] = lambda: archive._link.call(
            "view", **held, session_id=1, log=[0, 65536], method="is_retained",
            args={"position": 0})
        ops["replay_held"] = lambda: archive.replay_held(held, 1, (0, 65536), 0, 32) \
            .read_all(count, timeout_s=3)
        for name, call in ops.items():
            out[name] = outcome(call)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # anything a replay sent here anyway
            mine.poll(count, 100)
            time.sleep(0.01)
        # The keyed endpoint, called in plain: its driver opens nothing of it.
        link = HolderLink(client, address, int(keyed_port), int(control), timeout_s=2)
        out["keyed_port_in_plain"] = outcome(lambda: link.call("list", from_id=0))
        link.close()
    out["received"] = received
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
