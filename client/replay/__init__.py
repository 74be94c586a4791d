"""Replay: a range of a log sent again as a stream of its own, to a reader on another host.

A log lives in the shared memory of the host whose driver holds it.  A reader elsewhere gets a
position range of it as Aeron's archive replays a recording: it asks the **holder** (a process
on the log's host that serves replays, :class:`ReplayServer`) through its own host's driver, and
the holder publishes the range to a channel the reader names.  Everything travels over
slipstream's own protocol, so the replay has flow control and NAK repair like any stream.

The exchange (all of it UDP unicast between the two hosts' drivers):

1. The reader subscribes, on its own host, at ``endpoint=<its address>:<port>`` to a fresh
   **data** stream id, and to a **response** stream.
2. It publishes a :class:`ReplayRequest` (one JSON message) on the holder's **control** stream,
   ``endpoint=<holder address>:<port>``.
3. The holder answers one JSON message on the response stream: ``replaying`` from a position
   (the start, or with ``skip_lost`` the first position the log still holds) naming the data
   stream's session, or ``lost`` / ``refused`` with the reason.
4. It publishes the range on the data stream with a publication that starts at the range's
   start position and has the source log's initial term id, term length and MTU
   (``init-term-id``, ``term-id``, ``term-offset``, ``term-length``, ``mtu`` on its URI): every
   message is framed as it was, so it has the same position in the replay as in the log.  The
   reserved values go with the messages.  Then it closes the publication (the driver drains it
   to the reader and lingers for repairs).  A range the log stops holding mid-replay ends the
   data stream early and is answered ``lost`` on the response stream.

The control publication and the response subscription are the reader's **link** to the
holder, kept from one replay to the next (as a caller keeps its link for calls,
:mod:`slipstream.client.holding`), and the holder keeps its answer publication to such a
reader: a request carries an id, which every answer repeats, so that a late answer to an
earlier replay is told apart.  A replay then sets up only its data stream.

The reader reads the data stream until the range's end position and checks that it got there
(:class:`Replay`).  A replay is read once; a reader that failed asks again.  Requests are not
authenticated, like the streams themselves: keep the port inside the cluster's network.

The package, by concern: :mod:`~slipstream.client.replay.protocol`, the request and answer
messages and the reader's state machine, with no I/O; :mod:`~slipstream.client.replay.server`,
the holder's side (:class:`ReplayServer`); :mod:`~slipstream.client.replay.reader`, the reader's
(:func:`request_replay`, :class:`Replay`).  What a log still holds, which both ask, is
:mod:`slipstream.client.retention`'s; the names below are importable from here.
"""

from __future__ import annotations

from slipstream.client.holding import local_address_towards
from slipstream.client.logbuffer import LogIdentity
from slipstream.client.replay.protocol import (
    REPLAY_VERSION,
    ReplayError,
    ReplayLostError,
    ReplayRequest,
)
from slipstream.client.replay.reader import Replay, request_replay
from slipstream.client.replay.server import ReplayServer
from slipstream.client.retention import (
    earliest_position,
    first_retained,
    is_retained,
    message_start,
    skip_message,
)

__all__ = [
    "REPLAY_VERSION",
    "LogIdentity",
    "Replay",
    "ReplayError",
    "ReplayLostError",
    "ReplayRequest",
    "ReplayServer",
    "earliest_position",
    "first_retained",
    "is_retained",
    "local_address_towards",
    "message_start",
    "request_replay",
    "skip_message",
]
