"""Per-process clients and publications, safe across the fork of Spark's Python workers.

Spark starts Python workers by forking a daemon, and reuses them between tasks.  A
:class:`~slipstream.client.Client` owns a thread and a socket, which do not survive a fork, so
every process creates its own lazily, in a :class:`ProcessCache`, which a forked child finds
empty (:mod:`slipstream.spark_bridge.archived` keeps its archive links so too).  Cached
clients and publications live as long as the worker: tasks then pay no connection cost, and
the driver reclaims them when the worker exits (client liveness timeout).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from slipstream.client import Client, Publication

Key = TypeVar("Key", bound=Hashable)
Value = TypeVar("Value")


class ProcessCache(Generic[Key, Value]):
    """Values this process made, by key, under a lock of the cache's own; a forked child
    finds the cache empty, with a new lock (the parent's values, clients with threads and
    sockets, are not the child's to use; a parent thread may have held the lock at the
    fork).  Read and changed only inside :meth:`entries`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Key, Value] = {}
        _CACHES.add(self)

    @contextlib.contextmanager
    def entries(self) -> Iterator[dict[Key, Value]]:
        """This process's entries, for the block, under the cache's lock."""
        with self._lock:
            yield self._entries

    def _forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._entries = {}


#: Every cache, emptied in a forked child.
_CACHES: weakref.WeakSet[ProcessCache] = weakref.WeakSet()


def _forget_after_fork() -> None:
    for cache in list(_CACHES):
        cache._forget_after_fork()


os.register_at_fork(after_in_child=_forget_after_fork)

#: This process's clients, by driver directory ("": the client default).
_clients: ProcessCache[str, Client] = ProcessCache()
#: This process's publications, by (driver directory, channel, stream id).
_publications: ProcessCache[tuple[str, str, int], Publication] = ProcessCache()


def client_for(directory: str | None) -> Client:
    """This process's client of the driver in ``directory`` (None: the client default).

    Raises :class:`~slipstream.client.DriverNotRunningError` naming the directory when no
    driver runs there.
    """
    key = directory or ""
    with _clients.entries() as clients:
        client = clients.get(key)
        if client is None or client.is_closed:
            if client is not None:
                # Cut off (its driver was lost or restarted): close it, or its thread, its
                # socket and every log of its publications stay until the worker ends.
                client.close()
            # A worker runs its tasks one at a time, each on one thread, which offers to,
            # polls and closes its streams: a closed replay's logs go at once, so that the
            # driver gives their files to the next replay (log_reuse_bytes).
            client = Client.connect(directory, resource_linger_s=0)
            clients[key] = client
        return client


def publication_for(directory: str | None, channel: str, stream_id: int) -> Publication:
    """This process's publication of (channel, stream) through its driver, created once."""
    key = (directory or "", channel, stream_id)
    with _publications.entries() as publications:
        publication = publications.get(key)
        if publication is not None and not publication.is_closed:
            return publication
    if publication is not None:
        publication.close()  # cut off: its log is unmapped after the client's linger
    client = client_for(directory)
    publication = client.add_publication(channel, stream_id)
    with _publications.entries() as publications:
        existing = publications.get(key)
        if existing is not None and not existing.is_closed:
            publication.close()
            return existing
        publications[key] = publication
    return publication


def close_all() -> None:
    """Close this process's cached publications and clients (tests and benchmarks)."""
    with _publications.entries() as entries:
        publications = list(entries.values())
        entries.clear()
    with _clients.entries() as entries:
        clients = list(entries.values())
        entries.clear()
    for publication in publications:
        publication.close()
    for client in clients:
        client.close()
