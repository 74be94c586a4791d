"""What moved since the conductor's last cycle: a watch on the shared-memory words its
per-stream passes read (a log's tails, a subscriber's position counter), so that a cycle
passes over the streams whose words changed and those not yet settled, not over all of them.

The words sit in slots of flat arrays that C scans in one call (``ss_words_changed``): 5-30 ns
a word, their cache lines cold, where a Python pass over a stream costs tens of microseconds.
:meth:`WordWatch.look` spaces the scans by :data:`SPACING_NS_PER_WORD` a word, so that their
share of the conductor's time stays bounded however many streams there are.  Slots are taken
and given back through a free list, and the arrays double when full, so watching or
forgetting a word costs O(1) (amortised) whatever the number of streams.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from slipstream.client._native import lib as native
from slipstream.daemon._network import ffi
from slipstream.daemon._network import lib as network

#: Slots the arrays start with (they double as needed).
INITIAL_SLOTS = 64

#: The time between two of :meth:`WordWatch.look`'s scans, per word watched (ns): a scan
#: costs 5-30 ns a word (the 60,000 words of 10,000 IPC pairs take 0.3-1 ms, the 4,000 of
#: 1,000 UDP publications about 0.1 ms, their cache lines cold), so scans take at most about
#: a third of the time, and a change waits at most 2.4 ms at 10,000 IPC pairs, 2.4 us at 10.
SPACING_NS_PER_WORD = 40

#: A watch of at most this many words is scanned at every look: its scan (at most about
#: 8 us, cold) costs less than the conductor's cycle that looks, and a scan skipped would
#: owe a cycle of its own.
UNSPACED_WORDS = 256


class WordWatch:
    """Slots of (64-bit word, its owner).  :meth:`changed` answers the owners of the words
    that changed since the last call, and those marked (:meth:`mark`), each once, in no
    particular order."""

    def __init__(self, slots: int = INITIAL_SLOTS) -> None:
        # A slot not in use watches this cell, which nothing writes.
        self._idle_cell = ffi.new("int64_t *")
        self._capacity = 0
        self._used = 0  # slots below this index have been handed out at least once
        self._words: Any = ffi.NULL
        self._last: Any = ffi.NULL
        self._changed: Any = ffi.NULL
        self._owners: list[Hashable | None] = []
        self._free: list[int] = []
        self._marked: set[Hashable] = set()
        self._next_look_ns = 0
        self._look_owed = False
        self._grow(max(1, slots))

    def __len__(self) -> int:
        """The words watched."""
        return self._used - len(self._free)

    @property
    def capacity(self) -> int:
        """Slots the arrays hold (in use or free)."""
        return self._capacity

    def watch(self, word: Any, owner: Hashable) -> int:
        """Watch ``word`` (a cffi ``int64_t *``, 8-byte aligned, mapped while watched) for
        ``owner``; returns its slot, for :meth:`forget`.  Its present value is the baseline:
        only a later change reports ``owner``."""
        if self._free:
            slot = self._free.pop()
        else:
            if self._used == self._capacity:
                self._grow(2 * self._capacity)
            slot = self._used
            self._used += 1
        self._words[slot] = ffi.cast("int64_t *", word)
        self._last[slot] = native.ss_load_acquire_i64(self._words[slot])
        self._owners[slot] = owner
        return slot

    def forget(self, slot: int) -> None:
        """Stop watching ``slot``'s word (before its memory is unmapped)."""
        if self._owners[slot] is None:
            raise ValueError(f"slot {slot} is not watched")
        self._words[slot] = self._idle_cell
        self._last[slot] = 0
        self._owners[slot] = None
        self._free.append(slot)

    def mark(self, owner: Hashable) -> None:
        """Report ``owner`` at the next :meth:`changed`: a change no watched word shows."""
        self._marked.add(owner)

    def marked(self) -> set[Hashable]:
        """The owners marked since the last call (or :meth:`changed`), without a look at the
        words: those that changed are reported by the next :meth:`changed`."""
        moved, self._marked = self._marked, set()
        return moved

    def look(self, now_ns: int, *, scan: bool = False) -> set[Hashable]:
        """:meth:`changed` when a scan is due (:data:`SPACING_NS_PER_WORD` a word after the
        last), ``scan`` says so or the watch is small (:data:`UNSPACED_WORDS`), else
        :meth:`marked`; a look without a scan owes one, due at :attr:`owed_scan_ns`."""
        if scan or now_ns >= self._next_look_ns or len(self) <= UNSPACED_WORDS:
            self._next_look_ns = now_ns + len(self) * SPACING_NS_PER_WORD
            self._look_owed = False
            return self.changed()
        self._look_owed = True
        return self.marked()

    @property
    def owed_scan_ns(self) -> int | None:
        """When the scan a look went without is due (ns, :meth:`look`'s clock); None when
        none is owed, or when no word is watched (a scan would find nothing)."""
        return self._next_look_ns if self._look_owed and len(self) else None

    def changed(self) -> set[Hashable]:
        """The owners of the words that changed since they were watched or last reported,
        and those marked since the last call."""
        count = network.ss_words_changed(self._words, self._last, self._used, self._changed)
        owners = self._owners
        changed = self._changed
        moved, self._marked = self._marked, set()
        moved.update(owners[changed[i]] for i in range(count))
        return moved

    def _grow(self, capacity: int) -> None:
        words = ffi.new("int64_t *[]", capacity)
        last = ffi.new("int64_t[]", capacity)
        for slot in range(capacity):
            words[slot] = self._idle_cell
        if self._capacity:
            ffi.memmove(words, self._words, self._capacity * ffi.sizeof("int64_t *"))
            ffi.memmove(last, self._last, self._capacity * ffi.sizeof("int64_t"))
        self._words, self._last = words, last
        self._changed = ffi.new("int32_t[]", capacity)
        self._owners.extend([None] * (capacity - self._capacity))
        self._capacity = capacity
