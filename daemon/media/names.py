"""Host names in channel URIs, resolved off the conductor's loop.

A name in ``endpoint=``, ``interface=`` or ``control=`` is resolved once, as the channel is added
(:func:`slipstream.daemon.conductor.network_records._resolved` turns it into an IP literal),
never inside the duty cycle.  ``getaddrinfo`` blocks, for as long as the resolver's timeouts (glibc:
5 s per try, per name server), so the driver shell resolves a command's names in a thread
first (:func:`resolve`) and hands the command to the conductor once they are known; the
conductor then finds them here (:func:`lookup`).  A blocked resolver delays that one command,
never the heartbeats, status messages or the systemd watchdog.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Iterable
from typing import Final

from slipstream.client.channel import Channel, resolve_host
from slipstream.client.errors import ChannelError

#: How long an answer (or a failure) is reused, s.
TTL_S: Final = 30.0
#: How long a command waits for its names before it is refused, s.
PREFETCH_TIMEOUT_S: Final = 5.0

_cache: dict[str, tuple[str | None, str, float]] = {}  # name -> (address, error, expiry)
_lock = threading.Lock()


def names_of(channel: Channel) -> list[tuple[str, str]]:
    """The (URI part, host) pairs of ``channel`` that are names, not IP literals."""
    parts = [("endpoint", channel.endpoint), ("interface", channel.interface),
             ("control", channel.control)]
    return [(part, hp.host) for part, hp in parts if hp is not None and hp.ip is None]


def needs_prefetch(channel: Channel) -> bool:
    """Whether one of the channel's names has no fresh answer yet."""
    now = time.monotonic()
    with _lock:
        return any(host not in _cache or _cache[host][2] < now
                   for _, host in names_of(channel))


def resolve(hosts: Iterable[str]) -> None:
    """Resolve ``hosts`` now (blocking: call it in a thread) and remember the answers."""
    for host in hosts:
        try:
            address: str | None = resolve_host(host)
            error = ""
        except OSError as e:
            address, error = None, str(e)
        with _lock:
            _cache[host] = (address, error, time.monotonic() + TTL_S)


def lookup(channel: Channel, part: str, host: str) -> str:
    """The IP literal for ``host`` (a literal as is; a name from the cache, or resolved now
    when nothing prefetched it: the simulator, tests); ChannelError naming ``part`` when it
    does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    with _lock:
        cached = _cache.get(host)
    if cached is None or cached[2] < time.monotonic():
        resolve([host])
        with _lock:
            cached = _cache[host]
    address, error, _ = cached
    if address is None:
        raise ChannelError(str(channel), part, f"cannot resolve {host!r}: {error}")
    return address
