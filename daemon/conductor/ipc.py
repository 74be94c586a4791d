"""An IPC publication: one log shared by every publisher of a stream and read in place by
every subscriber on the host (``aeron:ipc``).

The driver never touches the data.  It owns the limits: ``pub-lmt = min(subscriber positions)
+ term window`` while anyone subscribes (NOT_CONNECTED otherwise), it cleans the term behind
the slowest subscriber so the partition can be reused, and it unblocks the log when a publisher
died between claim and commit.  States, as in Aeron's IpcPublication::

    ACTIVE --last publisher gone--> DRAINING --every subscriber read it all--> DONE
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

import attrs

from slipstream.client.counters import (
    BACK_PRESSURE_TYPES,
    CountersFile,
    CountersFullError,
    CounterType,
    SystemCounter,
)
from slipstream.client.layout import (
    META_ACTIVE_TERM_COUNT,
    META_LIMIT_HIT_TIME,
    META_TAIL_COUNTERS,
)
from slipstream.client.logbuffer import LogBuffer, unblock
from slipstream.daemon._network import lib as network
from slipstream.daemon.conductor.messages import ClientMessage, Outgoing
from slipstream.daemon.conductor.untethered import UntetheredStream, check_untethered
from slipstream.daemon.conductor.watch import WordWatch
from slipstream.daemon.pressure.episodes import BackPressureEpisodes, EpisodeEvent
from slipstream.daemon.protocol.log_cleaner import CLEAN_CHUNK_LENGTH, LogCleaner
from slipstream.daemon.streams.tether import Subscriber, Tether, TetherablePosition


class IpcPublicationState(enum.Enum):
    """An IPC publication's life: ACTIVE while publishers hold it, DRAINING once the last one
    closed and subscribers still read, DONE when its log may go."""

    ACTIVE = "active"
    DRAINING = "draining"
    DONE = "done"


@attrs.define(eq=False)
class IpcPublication:
    """Driver-side state of one IPC log.  All times are monotonic ns."""

    registration_id: int
    stream_id: int
    session_id: int
    channel: str
    log: LogBuffer
    counters: CountersFile
    term_window_length: int
    unblock_timeout_ns: int
    publisher_limit_id: int
    publisher_position_id: int
    cleaner: LogCleaner
    episodes: BackPressureEpisodes
    drops_counter_id: int
    other_counter_ids: list[int]  # the episodes' and pub-drops
    publisher_refs: int = 0
    state: IpcPublicationState = IpcPublicationState.ACTIVE
    #: Each subscription's link: its position counter, and its tether if it is untethered
    #: (``tether=false``: it does not hold publishers back for longer than its window limit
    #: timeout; it is left behind, rests, and rejoins at the newest position).
    subscribers: list[TetherablePosition[Subscriber]] = attrs.Factory(list)
    #: Untethered subscribers left behind, waiting out their resting timeout (no counter).
    resting: list[TetherablePosition[Subscriber]] = attrs.Factory(list)
    _last_consumer_position: int = 0
    _time_of_last_consumer_change_ns: int = 0
    #: The last pass saw the fastest subscriber behind the producer (the unblock timer runs).
    _seen_held: bool = False
    #: The slowest subscriber's position at the last update_limits (bytes).
    _last_limit_consumer: int = -1
    #: Set when the driver drains (SIGTERM): pub-lmt never rises past it again (bytes).
    credit_stop_position: int | None = None
    #: The last update_limits found no subscriber (the unblock timer restarts when one joins).
    _consumerless: bool = False
    #: The conductor's watch on the words update_limits and sample_episodes read, which it
    #: tells of every change they cannot see (:meth:`watch_words`); the slots of the log's
    #: words, and each subscriber's (by counter id).
    _watch: WordWatch | None = None
    _log_slots: list[int] = attrs.Factory(list)
    _subscriber_slots: dict[int, int] = attrs.Factory(dict)

    @classmethod
    def create(
        cls,
        *,
        path: str,
        registration_id: int,
        stream_id: int,
        session_id: int,
        initial_term_id: int,
        channel: str,
        counters: CountersFile,
        term_length: int,
        mtu: int,
        term_window_length: int,  # bytes, resolved (at most term_length / 2)
        unblock_timeout_ns: int,
        linger_timeout_ns: int,  # the log's metadata only, as Aeron's: nothing waits on it
        now_ns: int,
        initial_term_count: int = 0,
        initial_term_offset: int = 0,
        clean_chunk_length: int = CLEAN_CHUNK_LENGTH,  # bytes zeroed per duty cycle at most
        sparse: bool = True,
        watermarks: tuple[int, int] = (100, 50),  # percent: back-pressure episodes
        mode: int = 0o600,  # the log file's (DriverSettings.file_mode)
    ) -> IpcPublication:
        log = LogBuffer.create(
            path, term_length=term_length, initial_term_id=initial_term_id,
            session_id=session_id, stream_id=stream_id, mtu=mtu,
            correlation_id=registration_id, term_window_length=term_window_length,
            initial_term_count=initial_term_count, initial_term_offset=initial_term_offset,
            linger_timeout_ns=linger_timeout_ns, sparse=sparse, mode=mode,
            # The driver's view of an IPC log carries no data path (its clients map and
            # populate their own): metadata, positions and cleaning only.  Populating it up
            # front held the conductor's thread for 154 ms of a default 192 MiB log (56 ms
            # without) and cost 17 ms more to remove.  The cleaner's first lap now faults the
            # pages in instead, a chunk at a time (0.7 ms per MiB against 0.1): about the same
            # CPU for a log that lives long, spread out, and none for one that does not.
            populate=False,
        )
        label = f"{channel} stream={stream_id} session={session_id}"
        start = log.producer_position()
        try:
            allocated = counters.allocate_all(
                [(CounterType.PUBLISHER_LIMIT, "pub-lmt", start),
                 (CounterType.PUBLISHER_POSITION, "pub-pos", start), *BACK_PRESSURE_TYPES],
                label, registration_id=registration_id, session_id=session_id,
                stream_id=stream_id)
        except CountersFullError:  # leave nothing behind
            log.close()
            os.unlink(path)
            raise
        limit_id, position_id, *others = allocated
        episodes = BackPressureEpisodes(
            term_window_length, *watermarks,
            {kind: counters.address(counter_id)
             for (kind, _), counter_id in zip(BACK_PRESSURE_TYPES, others, strict=True)})
        return cls(registration_id=registration_id, stream_id=stream_id, session_id=session_id,
                   channel=channel, log=log, counters=counters,
                   term_window_length=term_window_length,
                   cleaner=LogCleaner(log, start, clean_chunk_length),
                   unblock_timeout_ns=unblock_timeout_ns,
                   publisher_limit_id=limit_id, publisher_position_id=position_id,
                   episodes=episodes, other_counter_ids=others,
                   drops_counter_id=others[[k for k, _ in BACK_PRESSURE_TYPES].index(
                       CounterType.PUBLISHER_DROPS)],
                   last_consumer_position=start,
                   time_of_last_consumer_change_ns=now_ns)

    # -- subscribers -------------------------------------------------------------------------
    def join_position(self) -> int:
        """Where a new subscriber starts: the current producer position."""
        return self.log.producer_position()

    def add_subscriber(self, subscription: Subscriber, label: str, *,
                       tether: Tether | None = None) -> TetherablePosition[Subscriber]:
        """Give a subscription a position counter at the join position (untethered, with
        ``tether``)."""
        position = self.join_position()
        counter_id = self.counters.allocate(
            CounterType.SUBSCRIBER_POSITION, f"sub-pos: {label}",
            registration_id=subscription.registration_id, session_id=self.session_id,
            stream_id=self.stream_id, owner_id=subscription.client_id, initial_value=position)
        subscriber = TetherablePosition(subscription, counter_id, self.counters.address(counter_id),
                                        tether)
        self.subscribers.append(subscriber)
        if self._watch is not None:
            self._subscriber_slots[counter_id] = self._watch.watch(subscriber.cell, self)
            self._watch.mark(self)
        return subscriber

    # -- the conductor's watch ---------------------------------------------------------------
    def watch_words(self, watch: WordWatch) -> None:
        """Have ``watch`` report this publication whenever a word its duty-cycle pass reads
        may have changed: a client writes the log's tails and its limit-hit time, and each
        subscriber's position; the publication itself marks its own changes (a subscriber
        added or gone, draining, the credit stopped).  Marked at once: a new publication is
        due."""
        self._watch = watch
        meta = self.log.meta
        self._log_slots = [watch.watch(meta + field, self)
                           for field in (META_TAIL_COUNTERS, META_TAIL_COUNTERS + 8,
                                         META_TAIL_COUNTERS + 16, META_ACTIVE_TERM_COUNT,
                                         META_LIMIT_HIT_TIME)]
        for subscriber in self.subscribers:
            self._subscriber_slots[subscriber.counter_id] = watch.watch(subscriber.cell, self)
        watch.mark(self)

    def _forget_words(self) -> None:
        watch = self._watch
        if watch is None:
            return
        for slot in (*self._log_slots, *self._subscriber_slots.values()):
            watch.forget(slot)
        self._log_slots.clear()
        self._subscriber_slots.clear()
        self._watch = None

    @property
    def is_settled(self) -> bool:
        """A pass now would find what the last found and owe no timer: ACTIVE, no untethered
        subscriber (their timers run on the clock), nothing left to clean, no open episode,
        and every subscriber at the producer's position (the unblock timer runs only behind
        it).  Until one of its watched words changes, the conductor may skip it."""
        return (self.state is IpcPublicationState.ACTIVE and not self.resting
                and self.credit_stop_position is None
                and all(s.tether is None for s in self.subscribers)
                and not self.cleaner.is_behind and not self.episodes.is_open
                and (not self.subscribers
                     or self._last_consumer_position >= self.log.producer_position()))

    def check_untethered(
            self, relink: Callable[[Subscriber], ClientMessage | None],
            now_ns: int) -> Outgoing:
        """Aeron's untethered subscriptions, as drop-oldest (:mod:`.untethered`), against the
        producer's position: one left behind loses its image with the range from its position
        to the producer's; one unlinked (RESTING) no longer counts for the limit and its
        counter is freed; one done resting is linked anew by ``relink`` (at the newest
        position, :meth:`add_subscriber`).  Returns the messages for the clients."""
        if not self.resting and all(s.tether is None for s in self.subscribers):
            return []
        producer = self.log.producer_position()
        return check_untethered(
            UntetheredStream(f"IPC stream {self.stream_id}", self.registration_id,
                             self.stream_id, producer, self.term_window_length,
                             self._unlink, relink),
            [(s, self._position_of(s, producer)) for s in self.subscribers
             if s.tether is not None],
            self.resting, self.counters, now_ns)

    def remove_subscriber(self, subscription_id: int) -> TetherablePosition[Subscriber] | None:
        for subscriber in self.resting:
            if subscriber.subscription.registration_id == subscription_id:
                self.resting.remove(subscriber)
                if self._watch is not None:
                    self._watch.mark(self)
                return subscriber
        for subscriber in self.subscribers:
            if subscriber.subscription.registration_id == subscription_id:
                self._unlink(subscriber)
                return subscriber
        return None

    def _unlink(self, subscriber: TetherablePosition[Subscriber]) -> None:
        """The subscriber's position holds the log no more, and its counter is freed."""
        self.subscribers.remove(subscriber)
        if self._watch is not None:
            self._watch.forget(self._subscriber_slots.pop(subscriber.counter_id))
            self._watch.mark(self)
        self.counters.free(subscriber.counter_id)

    def _position_of(self, subscriber: TetherablePosition[Subscriber], producer: int) -> int:
        """A subscriber's position as the driver takes it: its client writes the counter, so
        within [0, the producer's position] and on the frame alignment
        (``ss_subscriber_position_bounded``, as for a network image's subscribers): one past
        the producer would have the log cleaned under the others and their data overwritten."""
        return network.ss_subscriber_position_bounded(
            self.counters.get(subscriber.counter_id), producer)

    def consumer_position(self) -> int | None:
        """The slowest subscriber's position, None without subscribers."""
        if not self.subscribers:
            return None
        producer = self.log.producer_position()
        return min(self._position_of(s, producer) for s in self.subscribers)

    # -- duty cycle --------------------------------------------------------------------------
    def update_limits(self, now_ns: int) -> int:
        """Recompute pub-lmt, clean behind the slowest subscriber, unblock.  Returns the work
        that wants the next cycle soon (state changes, a publisher near its limit)."""
        work = 0
        producer = self.log.producer_position()
        if self.counters.get(self.publisher_position_id) != producer:
            self.counters.set(self.publisher_position_id, producer)
        consumer = self.consumer_position()
        if consumer is None:
            if self.log.is_connected:
                self.log.is_connected = False
                work += 1
            # Nobody reads: offers must fail with NOT_CONNECTED rather than fill the log.
            if self.counters.get(self.publisher_limit_id) != producer:
                self._set_limit(producer)
            self._time_of_last_consumer_change_ns = now_ns
            self._consumerless = True
            self.cleaner.hold()  # nothing to clean for until one joins
            return work
        if self._consumerless:
            # The first pass with a subscriber: the passes without one restarted the timer
            # each cycle, and the conductor skips them while nothing moves (``is_settled``).
            self._consumerless = False
            self._time_of_last_consumer_change_ns = now_ns
        # Clean first: the raised limit may let the publisher into the partition just cleaned.
        work += self.cleaner.clean_toward(consumer)
        limit = min(consumer + self.term_window_length, self.cleaner.reusable_limit())
        if self.credit_stop_position is not None:
            limit = min(limit, self.credit_stop_position)
        if limit != self.counters.get(self.publisher_limit_id):
            self._set_limit(limit)
        if not self.log.is_connected:
            # After the limit: a publisher that sees "connected" must find credit with it.
            self.log.is_connected = True
            self.log.signal_publishers()
            work += 1
        consumer_moved = consumer != self._last_limit_consumer
        self._last_limit_consumer = consumer
        if consumer_moved and limit - producer < self.term_window_length // 2:
            # Little headroom left while the subscribers read: keep the duty cycle brisk, so
            # that the limit follows them.  With plenty, or with subscribers that stopped (a
            # publisher parked at its limit behind a stalled query), the driver may back off;
            # a publisher that does reach the limit wakes it through the eventcount.
            work += 1
        # A blocked claim (a publisher that died between claim and commit) holds the fastest
        # subscriber (aeron_ipc_publication_check_for_blocked_publisher); a slow one may lag
        # anywhere behind it.
        # The timer runs from the first pass that saw the log held there: a settled stream
        # is not passed over, so the last change may be long before a claim made now.
        fastest = max(self._position_of(s, producer) for s in self.subscribers)
        behind = producer > fastest
        if fastest != self._last_consumer_position or not (behind and self._seen_held):
            self._last_consumer_position = fastest
            self._time_of_last_consumer_change_ns = now_ns
            self._seen_held = behind
        elif now_ns - self._time_of_last_consumer_change_ns > self.unblock_timeout_ns:
            if unblock(self.log, fastest, producer):
                self.counters.add(SystemCounter.UNBLOCKED_PUBLICATIONS)
                self.log.signal_readers()
                work += 1
            self._time_of_last_consumer_change_ns = now_ns
        return work

    def _set_limit(self, limit: int) -> None:
        """Store pub-lmt and wake the publishers parked for credit (policy=block)."""
        self.log.publish_limit(self.counters.address(self.publisher_limit_id), limit)

    def sample_episodes(self, now_ns: int) -> list[EpisodeEvent]:
        """The back-pressure episodes that began or ended since the last sample."""
        log_buffer = self.log
        return self.episodes.sample(now_ns, log_buffer.producer_position(),
                                    self.counters.get(self.publisher_limit_id),
                                    log_buffer.is_connected, *log_buffer.limit_hit())

    # -- life cycle --------------------------------------------------------------------------
    def stop_credit(self) -> None:
        """The driver drains: offers from now on are back-pressured (pub-lmt at the position
        the log has reached; an offer already past its limit check may still land)."""
        self.credit_stop_position = self.log.producer_position()
        if self._watch is not None:
            self._watch.mark(self)
        self._set_limit(min(self.counters.get(self.publisher_limit_id),
                            self.credit_stop_position))
        self._drop_left_behind()

    def _drop_left_behind(self) -> None:
        """The untethered timer stops (the publication drains, or the driver does): the
        subscribers left behind (LINGER) stop holding the log at once, their clients told as
        they were left, and the resting ones will not rejoin: kept, a lingering one's
        position would hold the drain for good."""
        for subscriber in [s for s in self.subscribers if s.lingering]:
            self._unlink(subscriber)
        self.resting.clear()

    def is_consumed(self, *, except_clients: frozenset[int] = frozenset()) -> bool:
        """Every subscriber (but those of ``except_clients``) has read all the log holds
        (true without subscribers: nobody is owed anything)."""
        end = self.log.producer_position()
        return all(self._position_of(s, end) >= end
                   for s in self.subscribers if s.subscription.client_id not in except_clients)

    def start_draining(self) -> None:
        """The last publisher left: subscribers may read what is there, then the log goes."""
        self.state = IpcPublicationState.DRAINING
        if self._watch is not None:
            self._watch.mark(self)
        self._drop_left_behind()
        self.log.end_of_stream_position = self.log.producer_position()
        self.log.signal_readers()

    def is_drained(self) -> bool:
        """DRAINING and every subscriber read it all (as Aeron's IpcPublication: a live
        subscriber is owed the log however long it takes; one whose client dies is removed
        at the client's liveness timeout, and then holds nothing)."""
        return self.state is IpcPublicationState.DRAINING and self.is_consumed()

    def close(self) -> None:
        """Free the counters and delete the log file (mapped readers keep their pages)."""
        self.state = IpcPublicationState.DONE
        self._forget_words()
        for subscriber in self.subscribers:
            self.counters.free(subscriber.counter_id)
        self.subscribers.clear()
        for counter_id in (self.publisher_limit_id, self.publisher_position_id,
                           *self.other_counter_ids):
            self.counters.free(counter_id)
        path = self.log.path
        self.log.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
