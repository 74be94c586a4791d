"""Calls: small request/answer exchanges over slipstream streams, to the archive.

The archive (:mod:`slipstream.archive.control`: the one server that answers them) takes
**calls** on its control stream: a planner on another host asks it what the logs of the
streams it holds hold, where a range of messages ends, or to move a subscriber position
(:mod:`slipstream.archive.holding`), and for its recordings and replays.  A call is one JSON
message on the control stream, an answer one JSON message on the caller's response stream,
matched by the call's ``id``::

    {"version": 1, "kind": "call", "id": 7, "op": "state", "args": {...},
     "reply_channel": "aeron:udp?endpoint=10.0.0.2:40190", "response_stream_id": 91}
    {"id": 7, "status": "ok", "result": ...}  or  {"id": 7, "status": "error", "message": ...}

A caller with a key (``HolderLink(..., key=NAME)``) calls the holder's endpoint of that key:
its call and the answer are sealed under it, and the holder answers about what is of that
key (docs/ARCHIVE.md, "Protected calls").

Unlike a replay, a caller keeps its two streams (:class:`HolderLink`) and the holder its answer
publication (:class:`Answers`) for as long as calls keep coming, so a call costs one round
trip through the two hosts' drivers, not a stream's set-up.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from slipstream.client.channel import channel_with_key
from slipstream.client.client import Client
from slipstream.client.errors import BackPressuredError, RegistrationError, SlipstreamError
from slipstream.client.layout import INT32_MAX
from slipstream.client.publication import Publication
from slipstream.client.subscription import Subscription

__all__ = ["ANSWER_TERM_LENGTH", "CALL_VERSION", "REPLY_WINDOW", "Answers", "CallError",
           "HolderLink", "answer_channel", "forget_reply_port", "local_address_towards",
           "offer_until",
           "open_holder_streams", "reply_channel_towards", "reply_subscription_channel",
           "small_channel"]

#: The call format's version; a holder answers calls of another with an error.
CALL_VERSION: Final = 1
_ANSWER_IDLE_S: Final = 60.0  # an answer publication unused this long is closed
_ANSWER_TIMEOUT_S: Final = 10.0  # an answer not sent by then (no caller listening) is dropped
#: The receiver window of every subscription at a host's reply endpoint, bytes.  A replay is a
#: burst: 2 MiB where the default is 128 KiB (an image caps it at half its term).  Replays
#: and answers to one host share one endpoint, and an endpoint has one receive window, so
#: every subscription there asks for the same.
REPLY_WINDOW: Final = 2 << 20


class CallError(SlipstreamError):
    """A call failed: the holder did not answer in time, or answered with an error (the
    message is the holder's, prefixed with who it is; ``answer`` is the holder's whole
    answer, with any fields it added, or None when there was none)."""

    def __init__(self, message: str, answer: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.answer = answer


def small_channel(channel: str) -> str:
    """``channel`` for an exchange's few small messages: a log of the shortest terms, made at
    once (a default one is tens of MiB to prepare)."""
    return f"{channel}|term-length=64k|sparse=true"


#: The term length of a holder's answer streams: an answer is at most an eighth of it (128
#: KiB: the state of about 500 sessions), and the log is sparse, so only what is sent costs.
ANSWER_TERM_LENGTH: Final = "1m"


def answer_channel(channel: str) -> str:
    """``channel`` for a holder's answers to one caller: sparse terms long enough for the
    state of a stream with hundreds of sessions (:data:`ANSWER_TERM_LENGTH`)."""
    return f"{channel}|term-length={ANSWER_TERM_LENGTH}|sparse=true"


#: The longest term a replay's image may have at a reader: a replay's terms are its source
#: log's (an IPC stream's are 64 MiB by default), longer than a driver takes from the
#: network unless a subscription says so (image_term_buffer_length_max, 16 MiB).
REPLY_MAX_TERM_LENGTH: Final = 128 << 20


def reply_subscription_channel(reply_channel: str) -> str:
    """The channel a reader or caller subscribes with at its reply endpoint ``reply_channel``:
    the shared window (:data:`REPLY_WINDOW`), a sparse image log (a replay's is as long as
    the source's, but only its range is written) and terms up to
    :data:`REPLY_MAX_TERM_LENGTH`."""
    return (f"{reply_channel}|rcv-wnd={REPLY_WINDOW}|so-rcvbuf={2 * REPLY_WINDOW}"
            f"|sparse=true|max-term-length={REPLY_MAX_TERM_LENGTH}")


def local_address_towards(address: str, port: int) -> str:
    """The address of this host that the kernel would send from to reach ``address`` (an
    IPv4 address, or a host name resolved now): the one a holder there can answer to.  Sends
    nothing.  Raises SlipstreamError naming ``address`` when it does not resolve or no route
    leads there."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, port))
        return str(probe.getsockname()[0])
    except OSError as e:  # socket.gaierror too: a name that does not resolve
        raise SlipstreamError(f"no address of this host towards the holder at "
                              f"{address}:{port}: {e}") from e
    finally:
        probe.close()


#: The reply port of this process for each holder on its own host, by (the client's driver
#: directory, holder address, holder port).
_own_host_reply_ports: dict[tuple[str, str, int], int] = {}


def _free_udp_port(address: str) -> int | None:
    """A UDP port free at ``address`` now, or None when ``address`` is not this host's."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])
    except OSError:
        return None
    finally:
        probe.close()


def reply_channel_towards(client: Client, address: str, port: int,
                          reply_address: str | None = None) -> str:
    """The channel a caller or replay reader using ``client`` gets the answers of the holder
    at ``address:port`` at: this host's address towards it (:func:`local_address_towards`,
    or ``reply_address``) and the same port, so that one UDP port open between two hosts
    serves both ways.  On the holder's own host (``address`` is one of this host's) that
    port is the holder's own endpoint, whose receive window is not a reply endpoint's (or,
    bound to every address, which no other endpoint may share): there, a port that was free,
    drawn once per holder and driver for this process (:func:`forget_reply_port` draws
    another)."""
    if reply_address is None:
        reply_address = local_address_towards(address, port)
    key = (str(client.directory), address, port)
    reply_port = _own_host_reply_ports.get(key)
    if reply_port is None:
        if _free_udp_port(address) is None:  # another host's: the holder's port is free here
            return f"aeron:udp?endpoint={reply_address}:{port}"
        reply_port = _free_udp_port(reply_address)
        if reply_port is None:
            raise SlipstreamError(f"the reply address {reply_address} for the answers of the "
                                  f"holder at {address}:{port} is not an address of this host")
        _own_host_reply_ports[key] = reply_port
    return f"aeron:udp?endpoint={reply_address}:{reply_port}"


def forget_reply_port(client: Client, address: str, port: int) -> bool:
    """Forget the reply port drawn for the holder at ``address:port`` (something else took it
    since it was drawn); whether there was one (then a retry draws another)."""
    return _own_host_reply_ports.pop((str(client.directory), address, port), None) is not None


def open_holder_streams(client: Client, address: str, port: int, control_stream_id: int,
                        reply_channel: str, response_stream_id: int, key: str | None = None
                        ) -> tuple[Subscription, Publication]:
    """A caller's or reader's two streams to the holder at ``address:port``: the response
    subscription at its reply endpoint ``reply_channel`` (``response_stream_id``) and the
    control publication to the holder's ``control_stream_id``, both sealed under ``key``
    when given (the holder's endpoint of that key); neither is left open when the other
    cannot be made."""
    # Every subscription at the reply endpoint asks for the same window (its first one makes
    # it): reply_subscription_channel.
    response = client.add_subscription(
        reply_subscription_channel(channel_with_key(reply_channel, key)), response_stream_id)
    try:
        control = client.add_publication(
            small_channel(channel_with_key(f"aeron:udp?endpoint={address}:{port}", key)),
            control_stream_id)
    except BaseException:
        response.close()
        raise
    return response, control


def offer_until(publication: Publication, data: bytes, deadline: float) -> bool:
    """Offer ``data`` until ``publication`` takes it (True) or ``time.monotonic()`` passes
    ``deadline`` (False), trying again every millisecond: for an exchange's request, whose
    publication is refused until the holder's subscription connects."""
    while publication.offer(data) < 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def decode_call(fields: dict[str, Any]) -> tuple[int, str, dict[str, Any], str, int]:
    """``(id, op, args, reply_channel, response_stream_id)`` of a call's JSON fields; raises
    ValueError naming the field that is wrong."""
    if fields.get("version") != CALL_VERSION:
        raise ValueError(f"version {fields.get('version')!r} (this holder speaks "
                         f"{CALL_VERSION})")
    call_id, op, args = fields.get("id"), fields.get("op"), fields.get("args", {})
    reply, stream = fields.get("reply_channel"), fields.get("response_stream_id")
    if isinstance(call_id, bool) or not isinstance(call_id, int):
        raise ValueError(f"id {call_id!r} is not an integer")
    if not isinstance(op, str):
        raise ValueError(f"op {op!r} is not a string")
    if not isinstance(args, dict):
        raise ValueError(f"args {args!r} is not an object")
    if not isinstance(reply, str) or not reply.startswith("aeron:udp?"):
        raise ValueError(f"reply_channel {reply!r} is not a UDP channel URI")
    if isinstance(stream, bool) or not isinstance(stream, int) \
            or not -INT32_MAX - 1 <= stream <= INT32_MAX:
        raise ValueError(f"response_stream_id {stream!r} is not a 32-bit integer")
    return call_id, op, args, reply, stream


class Answers:
    """The holder's side of calls: one answer publication per caller, kept while the caller
    keeps calling.  An answer whose caller does not listen yet waits for it up to 10 s."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._publications: dict[tuple[str, int], tuple[Publication, float]] = {}
        self._waiting: list[tuple[tuple[str, int], bytes, float]] = []

    def send(self, reply_channel: str, stream_id: int, answer: dict[str, Any]) -> None:
        """Queue ``answer`` to the caller at ``reply_channel`` / ``stream_id``; raises
        SlipstreamError when no publication can be made there (the channel is refused)."""
        key = (reply_channel, stream_id)
        if key not in self._publications:
            publication = self._client.add_publication(answer_channel(reply_channel),
                                                       stream_id)
            self._publications[key] = (publication, time.monotonic())
        publication = self._publications[key][0]
        data = json.dumps(answer).encode()
        if len(data) > publication.max_message_length:  # told so, rather than never answered
            data = json.dumps({
                "id": answer.get("id"), "status": "error",
                "message": f"the answer is {len(data)} bytes, over the answer stream's "
                           f"{publication.max_message_length}: ask for less"}).encode()
        self._waiting.append((key, data, time.monotonic() + _ANSWER_TIMEOUT_S))
        self.do_work()

    def do_work(self) -> int:
        """Offer what waits, close what is idle; returns how many answers went."""
        now = time.monotonic()
        sent = 0
        still: list[tuple[tuple[str, int], bytes, float]] = []
        for key, data, deadline in self._waiting:
            publication, _ = self._publications[key]
            if publication.offer(data) >= 0:
                self._publications[key] = (publication, now)
                sent += 1
            elif now < deadline:
                still.append((key, data, deadline))
        self._waiting = still
        waiting = {key for key, _, _ in still}
        for key, (publication, used) in list(self._publications.items()):
            if key not in waiting and now - used > _ANSWER_IDLE_S:
                publication.close()
                del self._publications[key]
        return sent

    @property
    def pending(self) -> int:
        """Answers not sent yet."""
        return len(self._waiting)

    def close(self) -> None:
        for publication, _ in self._publications.values():
            publication.close()
        self._publications.clear()
        self._waiting.clear()


class HolderLink:
    """A caller's standing link to a holder's control stream ``control_stream_id`` at
    ``endpoint=address:port``: answers come back to this host's driver at ``reply_address``
    (this host's address towards the holder when None), at the holder's port (another on the
    holder's own host: :func:`reply_channel_towards`), on a stream of its own; or at
    ``reply_port``, where the holder's port is taken here (a holder calling another on the
    same port).

    ``address`` may be a host name (a Kubernetes service's, say): it stays a name in the
    control channel, so this host's driver resolves it again while the holder is silent and
    sends to where it moved (docs/CHANNELS.md §7.2, "Names that follow their peer").  Before
    each call the reply channel is worked out again (:meth:`wait_for_contact`): this host's
    address towards the holder's new place may be another, and the answers come there.

    :meth:`call` sends one call and waits for its answer; :meth:`call_async` is the same call
    from a trio or asyncio task.  One call at a time: a second waits for the first to end.
    """

    def __init__(self, client: Client, address: str, port: int, control_stream_id: int, *,
                 timeout_s: float = 30.0, reply_address: str | None = None,
                 reply_port: int | None = None, key: str | None = None) -> None:
        self.holder = f"{address}:{port} (control stream {control_stream_id}" + \
            (f", key={key})" if key is not None else ")")
        self.address = address
        self.port = port
        #: The key the calls and their answers are sealed under (None: plain).
        self.key = key
        self.timeout_s = timeout_s
        self.response_stream_id = random.randrange(1, INT32_MAX)
        self._client = client
        self._reply_address = reply_address
        self._reply_port = reply_port
        self._next_id = 1
        #: The id of the call whose answer is awaited now (None: none is); an answer of
        #: another id (a call that timed out or was cancelled) is dropped when it arrives.
        self._awaited: int | None = None
        self._answer: dict[str, Any] | None = None
        self._calling = threading.Lock()
        self._control: Publication | None = None
        self._response = self._open_response(
            lambda channel: open_holder_streams(client, address, port, control_stream_id,
                                                channel, self.response_stream_id, key))

    def _reply_channel_now(self) -> str:
        """Where the answers should come now (this host's address towards the holder is
        worked out again when not given)."""
        if self._reply_port is not None:  # the caller's own: e.g. a holder calling a holder
            reply_address = (self._reply_address
                             or local_address_towards(self.address, self.port))
            return f"aeron:udp?endpoint={reply_address}:{self._reply_port}"
        return reply_channel_towards(self._client, self.address, self.port,
                                     self._reply_address)

    def _open_response(self, open_streams: Callable[[str], tuple[Subscription, Publication]]
                       ) -> Subscription:
        """``open_streams(reply_channel)`` at the reply channel of now, trying a second port
        when one drawn here was taken since; sets :attr:`reply_channel` (and the control
        publication, when it makes one); returns the response subscription."""
        for attempt in range(2):
            channel = self._reply_channel_now()
            try:
                response, control = open_streams(channel)
                break
            except RegistrationError:
                if attempt or not forget_reply_port(self._client, self.address, self.port):
                    raise  # not a port drawn here, or taken again
        self.reply_channel = channel
        if self._control is None:
            self._control = control
        return response

    def wait_for_contact(self, deadline: float) -> bool:
        """Wait until the holder's control stream is connected or ``time.monotonic()`` passes
        ``deadline``; whether it is.  Once it is, the reply channel is worked out again and
        the response subscription moves there if it changed: the holder may answer from
        elsewhere now (its name moved, and this host's driver followed it, whether or not a
        call was waiting then).  A name that does not resolve now, or no route to it, keeps
        the channel it has."""
        while not self.is_connected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        self._follow_reply_channel()
        return True

    async def wait_for_contact_async(self, deadline: float) -> bool:
        """:meth:`wait_for_contact` from a trio or asyncio task: the wait for the holder's
        subscriber sleeps on the event loop, not on its thread."""
        import anyio

        while not self.is_connected:
            if time.monotonic() > deadline:
                return False
            await anyio.sleep(0.001)
        self._follow_reply_channel()
        return True

    def _follow_reply_channel(self) -> None:
        """Work the reply channel out again and move the response subscription there if it
        changed (:meth:`wait_for_contact`)."""
        try:
            channel = self._reply_channel_now()
        except SlipstreamError:
            return  # no route or name now: the answers are asked at the channel of before
        if channel != self.reply_channel:
            previous = self._response
            self._response = self._open_response(
                lambda channel: (self._client.add_subscription(
                    reply_subscription_channel(channel_with_key(channel, self.key)),
                    self.response_stream_id),
                    self.control))
            previous.close()

    @property
    def control(self) -> Publication:
        """The publication to the holder's control stream."""
        assert self._control is not None
        return self._control

    def call(self, op: str, **args: Any) -> Any:
        """Call ``op`` with ``args`` (JSON values); returns the holder's result.  Raises
        :class:`CallError` when the holder answers with an error or not within the link's
        ``timeout_s``."""
        # One call at a time: every call polls the one response stream and awaits one id
        # (a blocking call in a worker thread and a task's call_async too).
        with self._calling:
            return self._call(op, args)

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        deadline = time.monotonic() + self.timeout_s
        contact = self.wait_for_contact(deadline)
        data = self._request(op, args)
        try:
            if not contact or not offer_until(self.control, data, deadline):
                raise self._not_taken(op)
            while self._answer is None:
                self._response.poll(self._take, 16)
                if self._answer is not None:
                    break
                if time.monotonic() > deadline:
                    raise self._not_answered(op)
                # Parked at once: an answer takes a round trip through two drivers, which a
                # spinning waiter would take a core from.
                self._response.wait_for_data(10_000_000, 0)
            return self._result()
        finally:
            self._awaited = None

    async def call_async(self, op: str, **args: Any) -> Any:
        """:meth:`call` from a trio or asyncio task, without blocking the event loop: the
        wait for the holder's subscriber sleeps on the loop, the call is offered as
        :meth:`~slipstream.client.publication.Publication.offer_async` and the answer waited
        for as :meth:`~slipstream.client.subscription.Subscription.receive_async` (parked on
        the response stream's eventcount in a worker thread: :mod:`slipstream.client.aio`).
        Cancelling the task ends the call at once and leaves nothing parked; its answer,
        when it comes, is dropped (no later call takes it for its own)."""
        import anyio

        # One call at a time, with the blocking calls too (one may run in a worker thread);
        # the lock is asked without blocking the loop.
        while not self._calling.acquire(blocking=False):
            await anyio.sleep(0.001)
        try:
            return await self._call_async(op, args)
        finally:
            self._calling.release()

    async def _call_async(self, op: str, args: dict[str, Any]) -> Any:
        deadline = time.monotonic() + self.timeout_s
        contact = await self.wait_for_contact_async(deadline)
        data = self._request(op, args)
        try:
            taken = False
            if contact:
                try:
                    taken = await self.control.offer_async(
                        data, timeout=max(deadline - time.monotonic(), 0.0)) > 0
                except BackPressuredError:
                    pass  # not connected or no credit until the deadline: not taken
            if not taken:
                raise self._not_taken(op)
            while self._answer is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._not_answered(op)
                await self._response.receive_async(self._take, 16, timeout=remaining)
            return self._result()
        finally:
            self._awaited = None

    def _request(self, op: str, args: dict[str, Any]) -> bytes:
        """A new call's message; from now its answer is the one awaited."""
        call_id = self._next_id
        self._next_id += 1
        self._awaited, self._answer = call_id, None
        return json.dumps({"version": CALL_VERSION, "kind": "call", "id": call_id, "op": op,
                           "args": args, "reply_channel": self.reply_channel,
                           "response_stream_id": self.response_stream_id}).encode()

    def _not_taken(self, op: str) -> CallError:
        return CallError(f"the holder at {self.holder} did not take the call {op!r} within "
                         f"{self.timeout_s:g} s: is it running, and UDP port {self.port} open "
                         f"between this host and {self.address} both ways?")

    def _not_answered(self, op: str) -> CallError:
        return CallError(f"the holder at {self.holder} took the call {op!r} but did not "
                         f"answer within {self.timeout_s:g} s (is UDP port {self.port} "
                         f"open towards this host?)")

    def _result(self) -> Any:
        """The awaited answer's result; raises :class:`CallError` for an error answer."""
        answer = self._answer
        assert answer is not None
        self._answer = None
        if answer.get("status") != "ok":
            raise CallError(f"the holder at {self.holder}: {answer.get('message', answer)}",
                            answer)
        return answer.get("result")

    @property
    def is_connected(self) -> bool:
        """Whether the holder's control stream has a subscriber (its status messages come):
        a call to a holder that is not running waits for the link's timeout."""
        return self.control.is_connected

    def _take(self, data: memoryview, _header: object) -> None:
        try:
            answer = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return  # not an answer: the stream is ours, so nothing to tell anyone
        # The awaited call's answer; another's (a call that timed out or was cancelled) is
        # dropped.
        if isinstance(answer, dict) and type(answer.get("id")) is int \
                and answer["id"] == self._awaited:
            self._answer = answer

    def close(self) -> None:
        self.control.close()
        self._response.close()
