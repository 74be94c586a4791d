"""Per-process clients and publications, safe across the fork of Spark's Python workers.

Spark starts Python workers by forking a daemon, and reuses them between tasks.  A
:class:`~slipstream.client.Client` owns a thread and a socket, which do not survive a fork, so
every process creates its own lazily, keyed by pid, and a forked child starts with an empty
cache.  Cached clients and publications live as long as the worker: tasks then pay no
connection cost, and the driver reclaims them when the worker exits (client liveness timeout).
"""

from __future__ import annotations

import os
import threading

from slipstream.client import Client, Publication

_lock = threading.Lock()
_clients: dict[tuple[int, str], Client] = {}
_publications: dict[tuple[int, str, str, int], Publication] = {}


def _reset_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _clients.clear()  # the parent's clients: their threads do not exist in the child
    _publications.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def client_for(directory: str | None) -> Client:
    """This process's client of the driver in ``directory`` (None: the client default).

    Raises :class:`~slipstream.client.DriverNotRunningError` naming the directory when no
    driver runs there.
    """
    key = (os.getpid(), directory or "")
    with _lock:
        client = _clients.get(key)
        if client is None or client.is_closed:
            if client is not None:
                # Cut off (its driver was lost or restarted): close it, or its thread, its
                # socket and every log of its publications stay until the worker ends.
                client.close()
            # A worker runs its tasks one at a time, each on one thread, which offers to,
            # polls and closes its streams: a closed replay's logs go at once, so that the
            # driver gives their files to the next replay (log_reuse_bytes).
            client = Client.connect(directory, resource_linger_s=0)
            _clients[key] = client
        return client


def publication_for(directory: str | None, channel: str, stream_id: int) -> Publication:
    """This process's publication of (channel, stream) through its driver, created once."""
    key = (os.getpid(), directory or "", channel, stream_id)
    with _lock:
        publication = _publications.get(key)
        if publication is not None and not publication.is_closed:
            return publication
    if publication is not None:
        publication.close()  # cut off: its log is unmapped after the client's linger
    client = client_for(directory)
    publication = client.add_publication(channel, stream_id)
    with _lock:
        existing = _publications.get(key)
        if existing is not None and not existing.is_closed:
            publication.close()
            return existing
        _publications[key] = publication
    return publication


def close_all() -> None:
    """Close this process's cached publications and clients (tests and benchmarks)."""
    pid = os.getpid()
    with _lock:
        publications = [p for k, p in _publications.items() if k[0] == pid]
        clients = [c for k, c in _clients.items() if k[0] == pid]
        for key in [k for k in _publications if k[0] == pid]:
            del _publications[key]
        for key in [k for k in _clients if k[0] == pid]:
            del _clients[key]
    for publication in publications:
        publication.close()
    for client in clients:
        client.close()
