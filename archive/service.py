"""The archive service: a client of this host's driver that records the configured streams
(Aeron Archive's ``ArchiveConductor`` with its recorder, on one thread).

At start it takes the archive directory's lock (one service per directory), opens the
catalog and recovers what a previous run left active (:mod:`.recovery`), then subscribes to
each ``[[record]]`` stream: a local UDP stream through a spy on its publication's log, IPC
directly, a remote stream with a plain subscription.  Every image of those subscriptions (one
per publisher session) becomes a :class:`~slipstream.archive.recorder.Recording`.  Its loop
records what the images hold, runs the sync policy's timer and retention, and ends each
recording as its image ends.  A write that fails (the disk full) ends that recording and
closes its subscription, so the archive holds no publisher it cannot record; the other
recordings and the service go on.  :meth:`ArchiveService.stop` (SIGTERM) stops every
recording (synced under the policy) and the catalog says where each ended.

It also holds streams for groups of readers (:mod:`.holding`: each ``[[hold]]``, and what
the control stream's calls ask to hold), whose replays its control stream serves beside the
recordings'.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from slipstream.archive.catalog import Catalog, EndReason
from slipstream.archive.control import ArchiveControl, channel_key
from slipstream.archive.holding import HeldStreams
from slipstream.archive.reading import TimeIndexWriter, recording_position_key
from slipstream.archive.recorder import PositionListener, Recording
from slipstream.archive.recovery import recover
from slipstream.archive.replication import Replicator
from slipstream.archive.retention import apply_retention
from slipstream.archive.settings import ArchiveSettings, RecordSpec
from slipstream.client import Client, SlipstreamError
from slipstream.client.counters import Counter, CounterType, fit_label
from slipstream.client.image import Image, await_frames
from slipstream.client.subscription import Subscription

log = logging.getLogger("slipstream.archive")

LOCK_FILE: Final = "archive.lock"
#: An idle loop (a pass that recorded nothing) waits for the next frame of any recording: it
#: spins this long first (yielding the CPU every few microseconds: the publisher and the driver
#: need the cores of a small machine), as a stream in flight brings the next block within it...
_IDLE_SPIN_NS = 50_000
#: ...then parks on the logs' eventcounts (no CPU) for at most this long, so that new images,
#: the retention timer and a stop are seen within it (a signal ends the park at once).
_IDLE_PARK_NS = 10_000_000
#: An idle loop with replays in progress waits this long, s: their publications' limits move
#: as their requesters' status messages come, which no eventcount here tells.
_REPLAY_WAIT_S = 0.0005


class ArchiveLockedError(RuntimeError):
    """Another archive process holds the directory."""


def lock_directory(directory: Path) -> int:
    """Take the archive directory's lock (an flock of ``archive.lock``), or raise
    :class:`ArchiveLockedError`; returns the lock's fd (closing it lets go)."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ArchiveLockedError(f"another archive process holds {directory} "
                                 f"({directory / LOCK_FILE})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class _Source:
    """One ``[[record]]`` entry's subscription and the images it made."""

    def __init__(self, spec: RecordSpec) -> None:
        self.spec = spec
        self.subscription: Subscription | None = None
        self.failed = False


class ArchiveService:
    """Records ``settings.records`` from the driver of ``settings.driver_dir`` into
    ``settings.dir``.  Each active recording's recorded position is a counter in the driver's
    counters file (``RECORDING_POSITION``, keyed by :func:`recording_position_key`; `slipstream
    stat` and the metrics exporter show it), freed when the recording ends;
    ``on_position(recording, position)`` is told it too as it moves."""

    def __init__(self, settings: ArchiveSettings, *,
                 on_position: PositionListener | None = None,
                 client: Client | None = None) -> None:
        self.settings = settings
        self.directory = settings.dir
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_directory(self.directory)
        self._on_position = on_position
        self._counters: dict[int, Counter] = {}
        self._time_indexes: dict[int, TimeIndexWriter] = {}
        self.control: ArchiveControl | None = None
        self.replicator: Replicator | None = None
        self.recordings: dict[int, Recording] = {}
        self._source_of: dict[int, _Source] = {}
        self._events: queue.SimpleQueue[tuple[str, _Source, Image]] = queue.SimpleQueue()
        self._sources: list[_Source] = []
        try:
            self.catalog = Catalog.open(self.directory)
            self.recovered = recover(self.catalog, self.directory)
            self._own_client = client is None
            # The service's thread alone uses and closes its streams (the replication's
            # caller thread its own links): a replay's or a call's logs go as it ends, for
            # the driver to give their files to the next (log_reuse_bytes).
            self.client = client if client is not None else Client.connect(
                settings.driver_dir, resource_linger_s=0)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.holds = HeldStreams(self.client, settings.release_after / 1e9
                                 if settings.release_after else None)
        self._next_retention_ns = 0
        self._closed = False
        try:
            if settings.control_port or settings.control_keys:
                self.control = ArchiveControl(self, settings.control_address,
                                              settings.control_port, settings.control_stream_id,
                                              keys=settings.control_keys,
                                              subnets=settings.subnets,
                                              configured_holds=frozenset(
                                                  held.channel for held in settings.holds))
            if settings.peers:
                self.replicator = Replicator(self)
            for spec in settings.records:
                self.record(spec)
            for held in settings.holds:
                self.holds.hold(held.channel, held.stream_id, held.group)
        except BaseException:
            self.stop()
            raise

    def record(self, spec: RecordSpec) -> None:
        """Subscribe to ``spec``'s stream; each of its images is recorded from where it
        joins."""
        source = _Source(spec)
        self._sources.append(source)

        def available(image: Image) -> None:  # the client's conductor thread
            self._events.put(("available", source, image))

        def unavailable(image: Image) -> None:
            self._events.put(("unavailable", source, image))

        source.subscription = self.client.add_subscription(
            spec.subscription_channel, spec.stream_id, on_available_image=available,
            on_unavailable_image=unavailable)
        log.info("subscribed to %s stream %d", spec.subscription_channel, spec.stream_id)

    def _recording_of(self, image: Image) -> Recording | None:
        for recording in self.recordings.values():
            if recording.image is image and recording.is_active:
                return recording
        return None

    def _handle_events(self) -> None:
        while True:
            try:
                kind, source, image = self._events.get_nowait()
            except queue.Empty:
                return
            if kind == "available":
                if source.failed or source.subscription is None or \
                        source.subscription.is_closed:
                    continue
                channel = source.spec.recorded_channel(image.channel_key)
                if channel_key(source.spec.channel) not in (None, image.channel_key):
                    log.warning("%s stream %d session %d is sealed under %s on the network: "
                                "recorded as %s", source.spec.channel, source.spec.stream_id,
                                image.session_id, "no key" if image.channel_key is None else
                                f"key={image.channel_key}", channel)
                try:
                    recording = Recording(
                        self.catalog, self.directory, image, channel,
                        segment_length=self.settings.segment_length, sync=self.settings.sync,
                        sync_interval_ns=self.settings.sync_interval,
                        block_length=self.settings.block_length,
                        on_position=self.position_moved,
                        write_behind=self.settings.write_behind)
                except OSError as e:
                    log.error("%s stream %d session %d: no recording started: the catalog "
                              "could not be written (%s)", source.spec.channel,
                              source.spec.stream_id, image.session_id, e)
                    self._fail_source(source)
                    continue
                self._source_of[recording.recording_id] = source
                self.adopt(recording)
            else:
                recording = self._recording_of(image)
                if recording is not None:
                    # Whatever it still holds first (gone images read nothing more).
                    recording.poll()
                    if recording.is_active:
                        # Where the subscription noted the log ended, not the gone image's
                        # own position (which the recording may hold back to what it synced).
                        complete = image.ended_with_mark and image.final_position is not None \
                            and recording.writer.position >= image.final_position
                        recording.stop(EndReason.END_OF_STREAM if complete
                                       else EndReason.ENDED_ABRUPTLY)
                if source.subscription is not None and not source.subscription.is_closed:
                    # The gone image's log (its file unlinked) is unmapped here, on the
                    # thread that reads the images, now the recording let go of it.
                    source.subscription.release_gone_images()

    def adopt(self, recording: Recording) -> None:
        """Record ``recording`` in this service's loop from now on, with its position counter
        (a stream's, or a replica the :class:`Replicator` made)."""
        self.recordings[recording.recording_id] = recording
        self._add_counter(recording)

    def _add_counter(self, recording: Recording) -> None:
        image = recording.image
        try:
            counter = self.client.add_counter(
                CounterType.RECORDING_POSITION,
                fit_label(f"rec-pos: {recording.recording_id} {image.session_id} "
                          f"{image.stream_id} {recording.channel}"),
                recording_position_key(recording.recording_id, image.session_id,
                                       image.stream_id, self.directory))
        except SlipstreamError as e:  # the recording goes on; only the counter is missing
            log.error("recording %d: no position counter (%s)", recording.recording_id, e)
            return
        counter.set(recording.recorded_position)
        self._counters[recording.recording_id] = counter

    def position_moved(self, recording: Recording, position: int) -> None:
        """A recording's recorded position moved: its counter, its time index, the
        listener."""
        counter = self._counters.get(recording.recording_id)
        if counter is not None:
            counter.set(position)
        index = self._time_indexes.get(recording.recording_id)
        if index is None:
            try:
                index = self._time_indexes[recording.recording_id] = TimeIndexWriter(
                    self.directory, recording.recording_id)
            except OSError as e:
                log.error("recording %d: no time index (%s)", recording.recording_id, e)
        if index is not None:
            self._index(index, recording)
        if self._on_position is not None:
            self._on_position(recording, position)

    @staticmethod
    def _index(index: TimeIndexWriter, recording: Recording) -> None:
        """The recording's time index told its recorded position now."""
        try:
            index.moved(time.time_ns() // 1_000_000, recording.recorded_position,
                        force=not recording.is_active)
        except OSError as e:  # the recording goes on; a replay from a time is coarser
            log.error("recording %d: the time index could not be written (%s)",
                      recording.recording_id, e)

    def _release_counters(self) -> None:
        """Let go of the recordings that ended: their position counters freed, their time
        indexes closed, and the recordings themselves (the catalog says where they stopped)."""
        for recording_id in [r for r, rec in self.recordings.items() if not rec.is_active]:
            counter = self._counters.pop(recording_id, None)
            if counter is not None:
                counter.close()
            index = self._time_indexes.pop(recording_id, None)
            if index is not None:
                index.close()
            del self.recordings[recording_id]
            self._source_of.pop(recording_id, None)

    def _fail_source(self, source: _Source) -> None:
        """A write for ``source`` failed: stop its other recordings and close its
        subscription, so the archive holds none of its publishers."""
        if source.failed:
            return
        source.failed = True
        for recording in self.recordings.values():
            if self._source_of.get(recording.recording_id) is source and recording.is_active:
                recording.stop(EndReason.STOPPED)
        if source.subscription is not None:
            source.subscription.close()
        log.error("%s stream %d: no longer recorded (its subscription is closed); restart the "
                  "archive once the cause is fixed", source.spec.channel, source.spec.stream_id)

    def do_work(self, now_ns: int | None = None) -> int:
        """One pass: image events, every active recording polled, the sync timer, retention
        when due.  Returns the bytes recorded."""
        if now_ns is None:
            now_ns = time.monotonic_ns()
        self._handle_events()
        work = 0
        for recording in list(self.recordings.values()):
            if not recording.is_active:
                continue
            work += recording.poll()
            recording.tick(now_ns)
            index = self._time_indexes.get(recording.recording_id)
            if index is not None and recording.is_active:
                self._index(index, recording)
            source = self._source_of.get(recording.recording_id)
            if recording.error is not None and source is not None:  # a replica: none
                self._fail_source(source)
        if self.replicator is not None:
            work += self.replicator.do_work(now_ns)
        self._release_counters()
        if self.control is not None:
            work += self.control.do_work()
        self.holds.do_work(self.control.logs_in_use if self.control is not None else set())
        if now_ns >= self._next_retention_ns:
            self._next_retention_ns = now_ns + self.settings.retention_check_interval
            self.run_retention()
        return work

    def run_retention(self) -> list[Path]:
        """Apply the retention settings now; returns the files removed."""
        if not (self.settings.retention_max_bytes or self.settings.retention_max_age or
                any(spec.retention_max_bytes or spec.retention_max_age_ns
                    for spec in self.settings.records)):
            return []
        live = {}
        for recording in self.recordings.values():
            if recording.is_active:
                base = recording.writer.writing_base
                # No segment open yet: the one its position falls in comes next; keep it.
                live[recording.recording_id] = recording.writer.position if base is None \
                    else base
        try:
            return apply_retention(self.catalog, self.directory,
                                   max_bytes=self.settings.retention_max_bytes,
                                   max_age_ns=self.settings.retention_max_age, live=live,
                                   now_ns=time.time_ns(), streams=self.settings.records)
        except OSError as e:
            log.error("retention: %s", e)
            return []

    def run(self, stopping: Callable[[], bool]) -> None:
        """Record until ``stopping()`` says so (checked every pass), then :meth:`stop`."""
        try:
            while not stopping():
                if self.do_work():
                    continue
                error = self.client.cut_off_error()
                if error is not None:
                    raise error
                self.idle()
        finally:
            self.stop()

    def idle(self) -> None:
        """Wait for the next frame of any active recording (at its reader's position) or of
        a call on the control stream (so a call is answered at once, not after the park):
        spin briefly, then park on the logs' eventcounts, at most :data:`_IDLE_PARK_NS`; with
        replays in progress, :data:`_REPLAY_WAIT_S`."""
        if self.control is not None and self.control.replays:
            time.sleep(_REPLAY_WAIT_S)  # the replays' credit comes back unannounced
            return
        readers = [r.reader for r in self.recordings.values()
                   if r.is_active and not r.image.is_closed]
        if self.control is not None:
            readers += [i for i in self.control.call_images() if not i.is_closed]
        if readers:
            await_frames(readers, _IDLE_PARK_NS, _IDLE_SPIN_NS)
        elif self.control is not None:
            self.control.wait_for_call(_IDLE_PARK_NS)
        else:
            time.sleep(_IDLE_PARK_NS / 1e9)

    def stop(self) -> None:
        """Stop every recording (durable under the sync policy, the catalog updated), close
        the subscriptions and the client, let go of the lock."""
        if self._closed:
            return
        self._closed = True
        if self.replicator is not None:
            self.replicator.close()
        if self.control is not None:
            self.control.close()
        self.holds.close()
        for recording in self.recordings.values():
            if recording.is_active:
                recording.poll()
                recording.stop(EndReason.STOPPED)
        self._release_counters()
        for source in self._sources:
            if source.subscription is not None and not source.subscription.is_closed:
                source.subscription.close()
        if self._own_client:
            self.client.close()
        self.catalog.close()
        os.close(self._lock_fd)

    def __enter__(self) -> ArchiveService:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
