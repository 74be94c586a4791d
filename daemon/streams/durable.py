"""A publication's durable position (``durable=TAG/N``, docs/CHANNELS.md §7.7): the position
that at least N receivers of group tag TAG have reported consuming in their status messages.

A receiver's status message carries its host's slowest subscriber position (the consumption
position, §1.5), so a receiver whose subscriber moves its position only once what it read is
safe (an archive: written, and synced under its sync policy) never reports more than it holds.
The sender already reads every tagged status message in Python (the C half takes only the
untagged ones of unicast flow control's one receiver, daemon/network_receiver.c), so this rule
is the Python half's alone, run per status message on the sender's thread, and no round trip
is added: the position is what the SMs the stream sends anyway say.

Rules:

* a receiver is (receiver id, source address), as flow control identifies receivers; only
  status messages with ``group_tag == TAG`` count (an untagged or other-tagged receiver never
  does);
* the durable position is the N-th highest of the positions of the receivers heard within
  ``receiver_timeout_ns``; a receiver that went silent stops counting at its timeout, one that
  left (an EOS status message, an ERR naming it) at once; with fewer than N it stays;
* a receiver counts only if the first position it was heard at is at or below the durable
  position: one that joined later holds nothing of what lies between, so it cannot make that
  durable (it never counts on this publication; its first heard position is forgotten when it
  leaves, and set anew when it is heard after its timeout or further on than its image could
  have taken since its last SM: a new image of it, which may have missed what lay between).
  Nothing is sent before a receiver is heard under unicast, or before N tagged receivers are
  there under ``fc=tagged,g:TAG/N``, so there the receivers count from the start; under
  ``max`` or ``min`` a tagged receiver that joins after data went out never counts;
* what an image takes since an SM at position p: frames that end within half a term of p
  (its over-run bound, docs/DRIVER.md §4.3, whatever window the SMs advertise: the cleaner
  narrows it, another receiver's SMs may move the sender further), then a padding frame whose
  header ends there, which stands for its whole length (the rest of a term, or an aborted
  claim: the sender sends its header alone, past its limit). Its consumption moves as far in
  one step when its subscriber reads all it has (an archive). A receiver left behind leaves
  with EOS status messages and joins again beyond the resend reach (half a term and a
  message) past what it had;
* it never goes back: a receiver that rejoins behind, or a new one, holds nothing back.

The sender publishes it to the publication's ``pub-durable`` counter and the number of tagged
receivers that count to its ``durable-rcv`` counter, then wakes the publishers parked for it (the
log's durable eventcount, ``META_DURABLE_SIGNAL``).

Units: positions in bytes, times in ns (monotonic).
"""

from __future__ import annotations

from slipstream.client.channel import DurableSpec
from slipstream.client.layout import HEADER_LENGTH, NO_DEADLINE, align, max_message_length
from slipstream.daemon.protocol.types import Address

#: The most receivers whose first heard position is kept after they went silent (oldest
#: forgotten first): a bound on what receivers that come and go can make the sender keep.
FIRST_HEARD_KEPT = 1024


class DurablePosition:
    """The durable position of one publication: see the module docstring.  The sender
    thread's; :attr:`position` and :attr:`receiver_count` are what it publishes."""

    def __init__(self, spec: DurableSpec, receiver_timeout_ns: int, start: int, *,
                 term_length: int, mtu: int) -> None:
        """``start``: the publication's join position (nothing before it was offered on it);
        ``term_length`` and ``mtu``: its log's (bytes)."""
        self.group_tag = spec.group_tag
        self.required = spec.count
        self.receiver_timeout_ns = receiver_timeout_ns
        self._term_length = term_length
        #: The longest padding frame (bytes): an aborted claim's (at most an MTU), or what is
        #: left of a term that the longest message (its fragments, each with its header) did
        #: not fit in (shorter than that message).
        longest = max_message_length(term_length)
        framed = align(longest + HEADER_LENGTH * -(-longest // (mtu - HEADER_LENGTH)),
                       HEADER_LENGTH)
        self._longest_padding = max(mtu, framed - HEADER_LENGTH)
        #: The durable position (bytes): never decreases.
        self.position = start
        # (receiver id, source) -> (position of its last SM, time of it): heard lately
        self._receivers: dict[tuple[int, Address], tuple[int, int]] = {}
        # (receiver id, source) -> the position it was first heard at (kept while silent)
        self._first_heard: dict[tuple[int, Address], int] = {}

    @property
    def receiver_count(self) -> int:
        """Tagged receivers heard within the timeout that count (joined at or before the
        durable position), as of the last call."""
        return sum(1 for key in self._receivers if self._counts(key))

    def _counts(self, key: tuple[int, Address]) -> bool:
        return self._first_heard[key] <= self.position

    def on_status_message(self, receiver_id: int, source: Address, group_tag: int | None,
                          position: int, is_eos: bool, now_ns: int) -> bool:
        """A (checked, not S-flagged) status message at consumption ``position`` (bytes);
        True when the durable position or the receiver count changed."""
        if group_tag != self.group_tag:
            return False
        key = (receiver_id, source)
        if is_eos:
            self._first_heard.pop(key, None)
            return self._receivers.pop(key, None) is not None
        count = self.receiver_count
        last = self._receivers.get(key)
        if key in self._first_heard and (
                last is None or not self._image_could_take(last[0], position)):
            # Heard again after its timeout, or further on than its image could take since
            # its last SM: a new image of that receiver (it rejoined, or was left behind and
            # joined where the sender was), which holds nothing of what lay between.
            del self._first_heard[key]
        if key not in self._first_heard:
            if len(self._first_heard) >= FIRST_HEARD_KEPT:
                silent = next((k for k in self._first_heard if k not in self._receivers), None)
                if silent is not None:
                    del self._first_heard[silent]
            self._first_heard[key] = position
        self._receivers[key] = (position, now_ns)
        return self._advance() or self.receiver_count != count

    def _image_could_take(self, last: int, position: int) -> bool:
        """Whether one image of a receiver, whose SM said ``last``, can have consumed up to
        ``position`` (bytes): frames ending within half a term of ``last`` (its over-run
        bound), then a padding frame whose header ends within it, to the padding's end."""
        bound = last + (self._term_length >> 1)
        return position <= bound - HEADER_LENGTH + self._longest_padding

    def on_error(self, receiver_id: int) -> bool:
        """An ERR named ``receiver_id``: it left.  True when one was removed."""
        gone = [key for key in self._receivers if key[0] == receiver_id]
        for key in gone:
            del self._receivers[key]
            self._first_heard.pop(key, None)
        return bool(gone)

    def expire(self, now_ns: int) -> bool:
        """Forget the receivers silent for the timeout; True when one was forgotten."""
        timeout = self.receiver_timeout_ns
        gone = [key for key, (_, heard) in self._receivers.items() if now_ns - heard > timeout]
        for key in gone:
            del self._receivers[key]
        return bool(gone)

    def next_deadline_ns(self) -> int:
        """When :meth:`expire` may next forget a receiver."""
        if not self._receivers:
            return NO_DEADLINE
        return min(heard for _, heard in self._receivers.values()) + self.receiver_timeout_ns + 1

    def _advance(self) -> bool:
        positions = sorted((p for key, (p, _) in self._receivers.items() if self._counts(key)),
                           reverse=True)
        if len(positions) < self.required:
            return False
        nth = positions[self.required - 1]
        if nth <= self.position:
            return False
        self.position = nth
        return True
