"""The one exception hierarchy of slipstream.

Every error a user can meet is a :class:`SlipstreamError`, and every message says what to do.
As in h11, errors split by who is at fault: the local side misusing the API or configuration
(:class:`UsageError` and its children) versus the driver or the remote side (the rest).  Any
other exception escaping slipstream is a bug.
"""

from __future__ import annotations


class SlipstreamError(Exception):
    """Base of every error raised by slipstream."""


class UsageError(SlipstreamError):
    """The caller asked for something invalid; fix the call or the configuration."""


class ChannelError(UsageError):
    """A channel URI is malformed; ``part`` names the offending part (e.g. ``endpoint``)."""

    def __init__(self, uri: str, part: str, problem: str) -> None:
        self.uri = uri
        self.part = part
        self.problem = problem
        super().__init__(f"bad channel URI {uri!r}: {part}: {problem}")


class ChannelWarning(UserWarning):
    """A channel URI names a key that only the other side of a stream acts on (``fc=`` on a
    subscription, ``cc=`` on a publication, ...): it is accepted, so that one URI can serve
    both sides as in Aeron applications, and does nothing here."""


class ConfigurationError(UsageError):
    """A configuration value is invalid; ``key`` names it and the message gives the range."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"configuration key {key!r}: {problem}")


class InvalidArgumentError(UsageError, ValueError):
    """An argument (or a field of a control command) is out of range or of the wrong type;
    ``field`` names it (``stream_id``, ``channel``, ...)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class MessageTooLongError(UsageError):
    """A message exceeds the publication's maximum message length (``limit`` bytes)."""

    def __init__(self, length: int, limit: int, *, claim: bool = False) -> None:
        self.length = length
        self.limit = limit
        if claim:  # a claim is one unfragmented frame
            text = (f"a claim of {length} bytes exceeds the {limit} bytes one frame can carry "
                    f"(the MTU less the 32-byte header); offer() fragments longer messages, or "
                    f"use a larger mtu in the channel URI")
        else:
            text = (f"message of {length} bytes exceeds the maximum message length of {limit} "
                    f"bytes (min(term length / 8, 16 MiB)); use a longer term-length in the "
                    f"channel URI or split the message")
        super().__init__(text)


class ClosedError(UsageError):
    """The client, publication or subscription was already closed."""


class LocalProtocolError(SlipstreamError):
    """slipstream's own code drove a protocol state machine through a transition its table does
    not have (h11's LocalProtocolError): a bug in slipstream, never the peer's doing."""


class DataLossError(SlipstreamError):
    """Data a reader asked for is no longer in the log (the publisher moved past it)."""

    def __init__(self, position: int, producer_position: int) -> None:
        self.position = position
        self.producer_position = producer_position
        super().__init__(
            f"data at stream position {position} is no longer in the log (the publisher is at "
            f"{producer_position}; the driver cleans a log one term behind its slowest "
            f"subscriber)")


class BackPressuredError(SlipstreamError):
    """An offer under ``policy=block``, ``error`` or ``rate-limit`` found no credit: at once
    (``error``) or after waiting ``waited_s`` seconds (the policy's timeout).  ``connected`` is
    False when no subscriber was there at all; ``appended`` is how many messages of an
    ``offer_batch`` did go in (0 for ``offer``)."""

    def __init__(self, channel: str, stream_id: int, policy: str, waited_s: float, *,
                 connected: bool, appended: int = 0) -> None:
        self.channel = channel
        self.stream_id = stream_id
        self.policy = policy
        self.waited_s = waited_s
        self.connected = connected
        self.appended = appended
        if connected:
            why = "the slowest subscriber is a window behind"
        elif "aeron:udp" in channel:  # min / tagged flow control count receivers
            why = ("not connected: no subscriber, or fewer receivers than min or tagged flow "
                   "control waits for (its group size g:/N, or a tag no receiver has)")
        else:
            why = "no subscriber is connected"
        waited = f"after waiting {waited_s:.3f} s" if waited_s > 0 else "at once"
        batch = f"; {appended} messages of the batch went in" if appended else ""
        super().__init__(f"stream {stream_id} on {channel}: no credit {waited} ({why}; "
                         f"policy={policy}){batch}")


class DriverError(SlipstreamError):
    """The media driver refused a request or could not be reached."""


class DriverNotRunningError(DriverError):
    """No live driver holds the directory the client tried to use."""

    def __init__(self, directory: str, detail: str = "", *, still_running: bool = False) -> None:
        """``still_running``: a driver runs there but no longer serves this client (it timed
        the client out, or a new one took the directory): the fix is to connect again."""
        self.directory = directory
        extra = f" ({detail})" if detail else ""
        if still_running:
            super().__init__(
                f"the slipstream driver in {directory} no longer serves this client{extra}: "
                f"connect again (Client.connect) for a new client")
            return
        super().__init__(
            f"no slipstream driver is running in {directory}{extra}: start one with "
            f"`slipstream driver --dir {directory}` or point SLIPSTREAM_DIR at a running driver"
        )


class DriverTimeoutError(DriverError):
    """The driver stopped answering (it died or is stalled)."""


class RegistrationError(DriverError):
    """The driver rejected a request (add publication, add subscription, ...)."""

    def __init__(self, message: str, code: str = "generic") -> None:
        self.code = code
        super().__init__(message)


class ChannelRejectedError(RegistrationError, ChannelError):
    """The driver refused a channel URI the client could not check alone (a host that does not
    resolve, a term length that differs from the stream's, a part it does not carry): both a
    :class:`RegistrationError` (the driver said no) and a :class:`ChannelError` (fix the URI).
    ``part`` and ``problem`` are empty when the driver did not name them."""

    def __init__(self, message: str, code: str, uri: str = "", part: str = "",
                 problem: str = "") -> None:
        self.code = code
        self.uri = uri
        self.part = part
        self.problem = problem
        # Not the parents' constructors: the driver's message is already whole.
        Exception.__init__(self, message)


class DriverAlreadyRunningError(DriverError):
    """Another live driver holds the directory."""


class DriverDirectoryError(DriverError):
    """The driver directory holds entries that no driver made: the driver refuses it rather
    than remove what it was not given."""
