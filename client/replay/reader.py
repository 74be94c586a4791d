"""The reader's side of replays: :func:`request_replay` asks a holder for a range and returns
the :class:`Replay` that receives it; the streams to a holder are kept from one replay to the
next (see :mod:`slipstream.client.replay` for the exchange)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from typing import Final

from slipstream.client.client import Client
from slipstream.client.errors import RegistrationError, SlipstreamError
from slipstream.client.holding import (
    forget_reply_port,
    offer_until,
    open_holder_streams,
    reply_channel_towards,
    reply_subscription_channel,
)
from slipstream.client.image import Image
from slipstream.client.layout import INT32_MAX
from slipstream.client.logbuffer import LogIdentity
from slipstream.client.messages import FragmentHandler, GatheredMessages
from slipstream.client.replay.protocol import (
    WAIT_SPIN_NS,
    ReaderState,
    ReplayError,
    ReplayExchange,
    ReplayRequest,
)
from slipstream.client.subscription import Subscription

__all__ = ["Replay", "request_replay"]

_ANSWER_AFTER_END_S: Final = 1.0  # how long a reader waits for the answer to an early end
#: How long a reader keeps an idle link (:class:`_Link`; the holder keeps its answer
#: publication longer).
_LINK_IDLE_S: Final = 50.0
_IDLE_LINKS: Final = 4  # idle links a process keeps per holder and reply endpoint


class _Link:
    """A reader's streams to one holder, kept from one replay to the next as a
    :class:`~slipstream.client.holding.HolderLink` keeps its call streams: the control
    publication to the holder (connected: a request goes at once) and the response
    subscription at this host's reply endpoint.  Each replay has a data subscription of its
    own, closed when it ends: an ended image goes only once no subscription holds it, and a
    kept one would hold its log (the range's pages, and a share of the driver's log memory
    limit) for the image liveness timeout.

    One replay uses a link at a time.  A link goes back to its pool (:func:`_take_link`) only
    after a replay read to its end through a holder that names the request in its answers
    (:attr:`ReplayRequest.request_id`): what is left of that replay on the link (its
    ``complete`` answer) is then told apart from the next's answers.  Any other end closes
    it."""

    def __init__(self, client: Client, holder_address: str, port: int,
                 control_stream_id: int, reply_channel: str) -> None:
        self.client = client
        self.key = (holder_address, port, control_stream_id, reply_channel)
        self.reply_channel = reply_channel
        self.response_stream_id = random.randrange(1, INT32_MAX)
        self.idle_since = 0.0
        self.response, self.control = open_holder_streams(
            client, holder_address, port, control_stream_id, reply_channel,
            self.response_stream_id)

    def data_subscription(self) -> tuple[Subscription, int]:
        """A new subscription for one replay's data, and its stream id (not the response
        stream's)."""
        stream_id = random.randrange(1, INT32_MAX)
        while stream_id == self.response_stream_id:
            stream_id = random.randrange(1, INT32_MAX)
        return (self.client.add_subscription(reply_subscription_channel(self.reply_channel),
                                             stream_id), stream_id)

    @property
    def usable(self) -> bool:
        return not (self.client.is_closed or self.response.is_closed or self.control.is_closed)

    def close(self) -> None:
        for resource in (self.response, self.control):
            resource.close()


_links: dict[tuple[int, str, int, int, str], list[_Link]] = {}
_links_lock = threading.Lock()
_reaper: threading.Thread | None = None  # closes idle links while the pool holds any


def _reset_links_after_fork() -> None:
    """A forked child (a Spark Python worker) starts with no links: the parent's streams are
    its client's, and a lock held at the fork would never be released in the child."""
    global _links_lock, _reaper
    _links.clear()
    _links_lock = threading.Lock()
    _reaper = None


os.register_at_fork(after_in_child=_reset_links_after_fork)


def _stale_links(now: float) -> list[_Link]:
    """Take out of the pool (under ``_links_lock``) the links idle longer than
    :data:`_LINK_IDLE_S` or no longer usable, for the caller to close."""
    stale: list[_Link] = []
    for key, idle in list(_links.items()):
        keep = [link for link in idle if link.usable and now - link.idle_since <= _LINK_IDLE_S]
        stale += [link for link in idle if link not in keep]
        if keep:
            _links[key] = keep
        else:
            del _links[key]
    return stale


def _close_links(links: list[_Link]) -> None:
    for link in links:
        with contextlib.suppress(SlipstreamError):
            link.close()


def _reap_idle_links() -> None:
    """The reaper's loop: idle links are closed within :data:`_LINK_IDLE_S` plus a tenth of
    it even when no replay comes to take one; it ends once the pool is empty."""
    global _reaper
    while True:
        time.sleep(_LINK_IDLE_S / 10)
        with _links_lock:
            stale = _stale_links(time.monotonic())
            if not _links:
                _reaper = None
        _close_links(stale)
        if _reaper is not threading.current_thread():
            return


def _take_link(client: Client, holder_address: str, port: int, control_stream_id: int,
               reply_channel: str) -> _Link:
    """An idle link of ``client`` to the holder, else a new one."""
    found: _Link | None = None
    with _links_lock:
        stale = _stale_links(time.monotonic())
        idle = _links.get((id(client), holder_address, port, control_stream_id, reply_channel))
        while idle and found is None:
            link = idle.pop()
            if link.client is client:
                found = link
            else:
                stale.append(link)
    _close_links(stale)
    if found is not None:
        return found
    return _Link(client, holder_address, port, control_stream_id, reply_channel)


def _give_back(link: _Link) -> None:
    """Keep ``link`` for the next replay (up to :data:`_IDLE_LINKS` per holder; closed by the
    reaper after :data:`_LINK_IDLE_S` idle), else close it."""
    global _reaper
    if link.usable:
        link.idle_since = time.monotonic()
        with _links_lock:
            idle = _links.setdefault((id(link.client), *link.key), [])
            if len(idle) < _IDLE_LINKS:
                idle.append(link)
                if _reaper is None:
                    _reaper = threading.Thread(target=_reap_idle_links,
                                               name="slipstream-replay-links", daemon=True)
                    _reaper.start()
                return
    with contextlib.suppress(SlipstreamError):
        link.close()


class Replay:
    """A replay being received: read it with :meth:`poll` until :attr:`done`.

    ``start`` is where it begins (the request's start, or past a loss the holder skipped:
    ``lost`` is then that ``(from, to)``); messages carry their positions in the source log.
    ``session_id``: the replay's session on the data stream, when the holder named it.
    """

    def __init__(self, exchange: ReplayExchange, link: _Link, data: Subscription) -> None:
        self.request = exchange.request
        #: How far the replay was read (a position of the source log).
        self.position = exchange.start
        self._exchange = exchange
        self._link = link
        self._data = data
        self._response = link.response
        self._closed = False

    @property
    def holder(self) -> str:
        return self._exchange.holder

    @property
    def start(self) -> int:
        return self._exchange.start

    @property
    def lost(self) -> tuple[int, int] | None:
        return self._exchange.lost

    @property
    def session_id(self) -> int | None:
        return self._exchange.session_id

    @property
    def complete_at(self) -> int | None:
        """Where the last message ends, once the holder said it sent them all (a range may
        end with padding, which a replay does not send)."""
        return self._exchange.complete_at

    @property
    def done(self) -> bool:
        return self.position >= self.request.end or (
            self.complete_at is not None and self.position >= self.complete_at)

    def describe(self) -> str:
        return self._exchange.describe()

    def poll(self, handler: FragmentHandler, fragment_limit: int = 256) -> int:
        """Deliver the next messages (``handler(data, header)``; ``header.position`` is the
        source log's); returns how many fragments were read.  Raises :class:`ReplayLostError`
        when the holder lost the range meanwhile, :class:`ReplayError` when the stream ended
        before the range did or went past it."""
        end = self.request.end
        image = self._image()
        if image is None:
            return 0
        count = image.poll(handler, fragment_limit)
        self.position = image.position
        if self.position > end:
            self._exchange.fail()
            raise ReplayError(f"{self.describe()} went past its end, to {self.position}: the "
                              f"replay is framed otherwise than the log")
        if count == 0 and not self.done:
            self._check_response()
            if image.is_end_of_stream and not self.done:
                self._ended_early()
        return count

    def poll_gathered(self, max_messages: int = 4096) -> GatheredMessages | None:
        """The next messages, copied out in one C pass (:meth:`Image.poll_gathered`), or None;
        raises as :meth:`poll` does."""
        end = self.request.end
        image = self._image()
        if image is None:
            return None
        chunk = image.poll_gathered(max_messages, end)
        self.position = image.position
        if chunk is None and not self.done:
            self._check_response()
            if image.is_end_of_stream and not self.done:
                self._ended_early()
        return chunk

    def _image(self) -> Image | None:
        """The replay's image once it is there (checking where it began), else None."""
        images = self._data.images
        image = None
        if self.session_id is None:
            image = images[0] if images else None
        else:  # the one the holder named (the only publication of the stream, but for a stray)
            for candidate in images:
                if candidate.session_id == self.session_id:
                    image = candidate
                    break
        if image is None:
            self._check_response()
            return None
        if image.join_position != self.start and self.position == self.start:
            self._exchange.fail()
            raise ReplayError(f"{self.describe()} began at position {image.join_position}, "
                              f"not {self.start}: the replay is framed otherwise than the log")
        return image

    def _ended_early(self) -> None:
        """The data stream ended before the range did.  The holder answers why (``lost``, or
        ``complete`` where padding ends the range) on the response stream, which may arrive
        after the end of the data stream: wait for it a moment, so that a loss is reported as
        a loss.  Raises unless the answer says the replay is whole."""
        deadline = time.monotonic() + _ANSWER_AFTER_END_S
        while not self.done and time.monotonic() < deadline:
            self._check_response()  # raises ReplayLostError / ReplayError on those answers
            if not self.done:
                self._response.wait_for_data(10_000_000, WAIT_SPIN_NS)
        if not self.done:
            self._exchange.fail()
            raise ReplayError(f"{self.describe()} ended at position {self.position}")

    def _check_response(self) -> None:
        answers: list[bytes] = []
        self._response.poll(lambda data, _h: answers.append(bytes(data)), 4)
        for answer in answers:
            self._exchange.receive(answer, self.position)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for data, parked at once (:data:`WAIT_SPIN_NS`); whether
        some came."""
        return self._data.wait_for_data(int(timeout_s * 1e9), WAIT_SPIN_NS)

    def close(self) -> None:
        """Done with the replay: its data subscription is closed; the link's streams are kept
        for the next replay when this one was read to its end (and the holder names its
        answers), else closed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._data.close()
        finally:
            if (self._exchange.names_request and self.done
                    and self._exchange.state is not ReaderState.FAILED):
                _give_back(self._link)
            else:
                self._link.close()

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def request_replay(client: Client, holder_address: str, port: int, control_stream_id: int,
                   stream_id: int, log_identity: LogIdentity, start: int, end: int, *,
                   skip_lost: bool = False, timeout_s: float = 30.0,
                   reply_address: str | None = None) -> Replay:
    """Ask the holder at ``holder_address:port`` (control stream ``control_stream_id``) for
    ``[start, end)`` of the log ``log_identity`` of ``stream_id``, to be received through
    ``client``'s driver at ``reply_address`` (None: this host's address towards the holder),
    same ``port`` (on the holder's own host, another:
    :func:`~slipstream.client.holding.reply_channel_towards`).

    The control and response streams are kept from one replay to the next (:class:`_Link`):
    a replay after the first to the same holder sets up only its data stream.

    Returns the :class:`Replay` once the holder answered ``replaying``.  Raises
    :class:`ReplayLostError` when it answers ``lost`` (and ``skip_lost`` is false or nothing
    is left), :class:`ReplayError` when it refuses or does not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    for attempt in range(2):  # a second, after a port drawn here was taken
        reply_channel = reply_channel_towards(client, holder_address, port, reply_address)
        try:
            link = _take_link(client, holder_address, port, control_stream_id, reply_channel)
            break
        except RegistrationError:
            if attempt or not forget_reply_port(client, holder_address, port):
                raise  # not a port drawn here, or taken again
    try:
        data, data_stream_id = link.data_subscription()
    except BaseException:
        link.close()
        raise
    request = ReplayRequest(stream_id, log_identity, start, end, reply_channel,
                            data_stream_id, link.response_stream_id, skip_lost,
                            random.randrange(1, 2**63))
    exchange = ReplayExchange(request, holder_address, port, control_stream_id, deadline)
    try:
        if not offer_until(link.control, exchange.request_data(), deadline):
            raise exchange.timed_out(timeout_s)
        exchange.request_sent()
        answers: list[bytes] = []
        while exchange.state is ReaderState.ASKING:
            link.response.poll(lambda payload, _h: answers.append(bytes(payload)), 1)
            while answers and exchange.state is ReaderState.ASKING:
                exchange.receive(answers.pop(0), start)
            if exchange.state is not ReaderState.ASKING:
                break
            if exchange.expired(time.monotonic()):
                raise exchange.timed_out(timeout_s)
            link.response.wait_for_data(10_000_000, WAIT_SPIN_NS)
        return Replay(exchange, link, data)
    except BaseException:
        data.close()
        if exchange.names_request:  # an answer that names the request leaves nothing of it
            _give_back(link)
        else:
            link.close()
        raise
