"""Back-pressure policies of a publication (docs/BACKPRESSURE.md): what an offer does when the
stream has no credit, chosen per publication with ``policy=`` in its channel URI or
``Client.add_publication(..., policy=...)``.  See :class:`~slipstream.client.channel.PolicySpec`
for the forms.

Without a policy an offer returns Aeron's codes (NOT_CONNECTED, BACK_PRESSURED), as Aeron users
expect.  With one:

* ``block``: the offer waits for credit: it spins for ``BLOCK_SPIN_NS``, yields the CPU between
  looks for ``BLOCK_YIELD_NS``, then parks on the log's publisher eventcount, which the driver
  bumps whenever it moves pub-lmt or connects the stream; after the timeout it raises
  :class:`BackPressuredError`.
* ``drop-newest``: the message is dropped, counted (``Publication.dropped`` and the driver's
  ``pub-drops`` counter of the stream) and the code is returned at once; nothing needs a retry.
* ``error``: :class:`BackPressuredError` at once.
* ``rate-limit``: a :class:`TokenBucket` paces the offers; past it, back pressure waits as
  ``block`` does (or, ``when-empty:refuse``, every refusal returns BACK_PRESSURED).

ADMIN_ACTION (a term rotation) is retried at once under every policy; CLOSED and
MAX_POSITION_EXCEEDED are returned as they are.  Successful offers pay nothing for a policy
other than ``rate-limit``: the C offer calls into Python only when it was refused.  A retried
offer carries the reserved value (or values, for a batch) it was given.
"""

from __future__ import annotations

import math
import os
import time
from array import array
from collections.abc import Callable
from typing import Any

import attrs

from slipstream.client._native import lib
from slipstream.client.channel import PolicySpec, parse_channel, parse_policy
from slipstream.client.errors import BackPressuredError, ChannelError
from slipstream.client.messages import Buffer

#: How long ``block`` waits for credit when the policy names no ``timeout``.
DEFAULT_BLOCK_TIMEOUT_NS = 10_000_000_000
#: How much of its rate a ``rate-limit`` bucket holds when the policy names no ``burst``.
DEFAULT_BURST_NS = 10_000_000
#: A waiting offer spins this long before it parks: credit that comes back within it costs no
#: wake-up, and a longer spin would take the core the driver or the subscriber needs.
BLOCK_SPIN_NS = 20_000
#: Then it yields the CPU between looks this long before it parks: the conductor moves an IPC
#: limit every millisecond while the stream is busy, and a park's wake-up costs tens of µs on a
#: VM whose idle vCPU sleeps.
BLOCK_YIELD_NS = 1_000_000
# A parked offer looks at its publication at least this often (a safety net: the driver's
# signal, a close and a lost driver wake it at once).
_PARK_SLICE_NS = 1_000_000_000

#: A rate-limit offer waiting on its token bucket looks at its publication this often (a close
#: from another thread ends the wait).
PACE_SLICE_NS = 10_000_000
#: With an embedded driver in invoker mode, a rate-limit offer waiting on its bucket runs the
#: driver's duty cycle, sleeping at most this long between idle cycles.
INVOKER_PACE_SLICE_NS = 1_000_000

# The offer codes (native.h's; publication.py names them for users).
_NOT_CONNECTED, _BACK_PRESSURED, _ADMIN_ACTION, _CLOSED = (
    lib.SS_NOT_CONNECTED, lib.SS_BACK_PRESSURED, lib.SS_ADMIN_ACTION, lib.SS_CLOSED)


@attrs.frozen
class BackPressureEpisode:
    """A back-pressure episode of a publication's stream began (``started``) or ended, as the
    driver saw it (its watermarks: ``watermarks=`` in the channel; docs/BACKPRESSURE.md):
    ``at_ns`` when (CLOCK_MONOTONIC ns, as ``time.monotonic_ns()``), ``depth`` the bytes of
    the window in use then, ``duration_ns`` how long an ended one lasted (0 for a start),
    ``episodes`` how many began so far."""

    started: bool
    at_ns: int
    depth: int
    duration_ns: int
    episodes: int


def policy_of(channel: str, policy: str | PolicySpec | None) -> PolicySpec | None:
    """The policy a publication of ``channel`` runs: ``policy`` (the URI value's form, or a
    parsed spec) or the channel's ``policy=``; giving both raises ChannelError."""
    in_uri = parse_channel(channel).policy
    if policy is None:
        return in_uri
    if isinstance(policy, PolicySpec):
        # Checked as its URI form is: a spec made by hand gets the same checks and errors.
        policy = parse_policy(str(policy))
    elif isinstance(policy, str):
        policy = parse_policy(policy)
    else:
        raise TypeError(f"policy must be a str or a PolicySpec, not {type(policy).__name__}")
    if in_uri is not None and in_uri != policy:
        raise ChannelError(channel, "policy", f"given in the URI and as policy={policy}: "
                                              f"choose one")
    return policy


class TokenBucket:
    """Paces offers to ``messages_per_s`` messages and ``bytes_per_s`` bytes per second (either
    may be None: not limited), holding ``burst_ns`` worth of each.  Sans-I/O: every call takes
    ``now_ns`` (CLOCK_MONOTONIC).

    A take larger than the bucket (a big batch) waits for a full bucket and then leaves it in
    debt, so the long-run rate holds whatever the batch sizes."""

    __slots__ = ("_bytes", "_capacity_bytes", "_capacity_messages", "_last_ns", "_messages",
                 "bytes_per_s", "messages_per_s")

    def __init__(self, messages_per_s: int | None, bytes_per_s: int | None, burst_ns: int,
                 now_ns: int) -> None:
        if messages_per_s is None and bytes_per_s is None:
            raise ValueError("a token bucket needs a message rate, a byte rate or both")
        self.messages_per_s = messages_per_s
        self.bytes_per_s = bytes_per_s
        # At least one message's worth, or a rate below 1/burst could never send.
        self._capacity_messages = (max(1.0, messages_per_s * burst_ns / 1e9)
                                   if messages_per_s else 0.0)
        self._capacity_bytes = max(1.0, bytes_per_s * burst_ns / 1e9) if bytes_per_s else 0.0
        self._messages = self._capacity_messages
        self._bytes = self._capacity_bytes
        self._last_ns = now_ns

    def _refill(self, now_ns: int) -> None:
        elapsed = max(0, now_ns - self._last_ns) / 1e9
        self._last_ns = max(self._last_ns, now_ns)
        if self.messages_per_s:
            self._messages = min(self._capacity_messages,
                                 self._messages + elapsed * self.messages_per_s)
        if self.bytes_per_s:
            self._bytes = min(self._capacity_bytes, self._bytes + elapsed * self.bytes_per_s)

    def delay_ns(self, now_ns: int, messages: int, length: int) -> int:
        """How long until ``messages`` messages of ``length`` bytes in all may go (0: now);
        takes nothing."""
        self._refill(now_ns)
        wait = 0.0
        if self.messages_per_s:
            need = min(float(messages), self._capacity_messages)
            if self._messages < need:
                wait = (need - self._messages) / self.messages_per_s
        if self.bytes_per_s:
            need = min(float(length), self._capacity_bytes)
            if self._bytes < need:
                wait = max(wait, (need - self._bytes) / self.bytes_per_s)
        return 0 if wait <= 0 else math.ceil(wait * 1e9)

    def take(self, messages: int, length: int) -> None:
        """Spend what went out (after :meth:`delay_ns` said 0)."""
        if self.messages_per_s:
            self._messages -= messages
        if self.bytes_per_s:
            self._bytes -= length


class OfferPolicy:
    """Applies one publication's :class:`PolicySpec` to its refused offers (module doc)."""

    def __init__(self, spec: PolicySpec, attempt: Callable[[Buffer, int], int],
                 attempt_batch: Callable[[Buffer, array | memoryview,
                                          array | memoryview | None], tuple[int, int]], *,
                 channel: str, stream_id: int, appender: Any, drops_cell: Any,
                 invoker: Callable[[], int] | None, closed: Callable[[], bool]) -> None:
        """For the publication of ``stream_id`` on ``channel``: ``attempt(message,
        reserved_value)``, one plain offer of it (no idle strategy, no policy);
        ``attempt_batch(data, lengths, reserved_values)``, one C batch append (messages
        appended, the refined code when none was); ``appender``, its ``ss_appender_t *``,
        whose credit a wait awaits; ``drops_cell``, its ``pub-drops`` counter (None: not
        counted); ``invoker``, its client's embedded driver (invoker mode); ``closed()``,
        whether it or its client is closed."""
        self.spec = spec
        self.name = spec.name
        self._attempt = attempt
        self._attempt_batch = attempt_batch
        self._channel = channel
        self._stream_id = stream_id
        self._appender = appender
        self._drops_cell = drops_cell
        self._invoker = invoker
        self._closed = closed
        self._timeout_ns = (spec.timeout_ns if spec.timeout_ns is not None
                            else DEFAULT_BLOCK_TIMEOUT_NS)
        self._waits = spec.name == "block" or (spec.name == "rate-limit" and not spec.refuse)
        self.bucket: TokenBucket | None = None
        if spec.name == "rate-limit":
            self.bucket = TokenBucket(spec.messages_per_s, spec.bytes_per_s,
                                      spec.burst_ns if spec.burst_ns is not None
                                      else DEFAULT_BURST_NS, time.monotonic_ns())
        #: Messages ``drop-newest`` dropped through this publication object.
        self.dropped = 0

    # -- one message --------------------------------------------------------------------------
    def on_refused(self, message: Buffer, result: int, reserved_value: int = 0) -> int:
        """The C offer's hook: ``message`` (with ``reserved_value``) was refused with
        ``result`` (< 0)."""
        return self._settle(result, lambda: self._attempt(message, reserved_value), 1)

    def offer(self, message: Buffer, reserved_value: int = 0) -> int:
        """``rate-limit``'s offer: pace, then append (with back pressure handled as above);
        ``reserved_value`` as ``Publication.offer``'s."""
        bucket = self.bucket
        assert bucket is not None
        length = len(message) if isinstance(message, bytes) else memoryview(message).nbytes
        refused = self._paced(bucket, 1, length)
        if refused:
            return refused
        result = self._attempt(message, reserved_value)
        if result < 0:
            result = self._settle(result, lambda: self._attempt(message, reserved_value), 1)
        if result > 0:
            bucket.take(1, length)
        return result

    # -- a batch ------------------------------------------------------------------------------
    def offer_batch(self, data: Buffer, lengths: array | memoryview,
                    reserved_values: array | memoryview | None = None) -> int:
        """``Publication.offer_batch`` under this policy: every message of the batch goes in
        (waiting as the policy says) or what did not is dropped (``drop-newest``: returns how
        many went in) or refused (``rate-limit`` with ``when-empty:refuse``: returns how many
        went in, or BACK_PRESSURED when none did).  ``reserved_values``: checked already,
        one per message, or None."""
        count = len(lengths)
        bucket = self.bucket
        if bucket is not None:
            total = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
            refused = self._paced(bucket, count, total)
            if refused:
                return refused
        appended = 0
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        offset = 0
        started_ns = deadline_ns = 0
        while appended < count:
            rest = lengths[appended:]
            values = reserved_values[appended:] if reserved_values is not None else None
            done, code = self._attempt_batch(view[offset:], rest, values)
            if done > 0:
                offset += sum(rest[:done])
                appended += done
                continue
            if code == _ADMIN_ACTION:
                continue
            if code not in (_BACK_PRESSURED, _NOT_CONNECTED):
                return appended or code  # CLOSED, MAX_POSITION_EXCEEDED
            if self.name == "drop-newest":
                self._count_drops(count - appended)
                return appended or code
            if not self._waits:
                if self.name == "error":
                    raise self._error(code, 0, appended)
                return appended or code  # rate-limit, when-empty:refuse
            now_ns = time.monotonic_ns()
            if not started_ns:
                started_ns, deadline_ns = now_ns, now_ns + self._timeout_ns
            if now_ns >= deadline_ns:
                raise self._error(code, now_ns - started_ns, appended)
            self._wait(deadline_ns - now_ns)
        if bucket is not None:
            bucket.take(count, offset)
        return appended

    # -- the rules ------------------------------------------------------------------------------
    def _settle(self, result: int, attempt: Callable[[], int], messages: int) -> int:
        """Apply the policy to a refusal, retrying ``attempt`` as it says; the final result."""
        started_ns = deadline_ns = 0
        while True:
            if result == _ADMIN_ACTION:
                result = attempt()
                continue
            if result not in (_BACK_PRESSURED, _NOT_CONNECTED):
                return result  # a position, CLOSED or MAX_POSITION_EXCEEDED
            if self.name == "drop-newest":
                self._count_drops(messages)
                return result
            if not self._waits:
                if self.name == "error":
                    raise self._error(result, 0, 0)
                return result  # rate-limit, when-empty:refuse
            now_ns = time.monotonic_ns()
            if not started_ns:
                started_ns, deadline_ns = now_ns, now_ns + self._timeout_ns
            if now_ns >= deadline_ns:
                raise self._error(result, now_ns - started_ns, 0)
            self._wait(deadline_ns - now_ns)
            result = attempt()

    def _wait(self, remaining_ns: int) -> None:
        """Wait for credit (or a close, or a lost driver) for at most ``remaining_ns``."""
        invoker = self._invoker
        if invoker is not None:
            # An embedded driver moves the limit only when someone runs it: this caller.
            if not invoker():
                os.sched_yield()
            return
        lib.ss_await_credit(self._appender, BLOCK_SPIN_NS, BLOCK_YIELD_NS,
                            min(remaining_ns, _PARK_SLICE_NS))

    def _paced(self, bucket: TokenBucket, messages: int, length: int) -> int:
        """Wait until the bucket lets ``messages`` go: 0 then, or the code to return instead
        (BACK_PRESSURED: it is empty and the policy refuses; CLOSED: the publication closed
        meanwhile, from another thread or with its client).  The pacing is the rate asked
        for, not back pressure: ``timeout:`` bounds only the wait for credit after it."""
        invoker = self._invoker
        while True:
            delay = bucket.delay_ns(time.monotonic_ns(), messages, length)
            if not delay:
                return 0
            if self.spec.refuse:
                return _BACK_PRESSURED
            if self._closed():
                return _CLOSED
            if invoker is not None:
                # An embedded driver works only while its application calls it: a paced loop
                # would otherwise send nothing, and attached processes would deem it dead.
                if not invoker():
                    time.sleep(min(delay, INVOKER_PACE_SLICE_NS) / 1e9)
                continue
            # In slices, so that a close from another thread is seen within one.
            time.sleep(min(delay, PACE_SLICE_NS) / 1e9)

    def _count_drops(self, messages: int) -> None:
        self.dropped += messages
        cell = self._drops_cell
        if cell is not None:
            lib.ss_get_and_add_i64(cell, messages)

    def _error(self, code: int, waited_ns: int, appended: int) -> BackPressuredError:
        return BackPressuredError(self._channel, self._stream_id, str(self.spec),
                                  waited_ns / 1e9, connected=code != _NOT_CONNECTED,
                                  appended=appended)

