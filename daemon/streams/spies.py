"""The spies of a network publication (docs/DRIVER.md §3.7): Aeron's tethered spies.

``aeron-spy:`` subscriptions of this host read a network publication's log in place.  Each
holds pub-lmt and cleaning back as snd-pos does (both follow the consumer position, the slowest
of snd-pos and the spies), never the sender, and a closed publication reaches LINGER only once
they have read it all.  :class:`PublicationSpies` keeps their position cells and hands them to
the publication's C half (``spy_positions``, ``spy_count`` of its ``ss_send_publication_t``),
whose pub-lmt rule takes them itself; the publication decides what they change of its state
(:meth:`NetworkPublication.add_spy
<slipstream.daemon.streams.publication.NetworkPublication.add_spy>`).  The sender thread's.

Positions in bytes.
"""

from __future__ import annotations

from slipstream.client.layout import NO_DEADLINE
from slipstream.client.logbuffer import LogBuffer
from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon._network import lib as network


class PublicationSpies:
    """The position cells (cffi ``int64_t *``, their sub-pos counters, which their clients
    write) of one network publication's spies.  True while it has one."""

    def __init__(self, c: object, log: LogBuffer) -> None:
        """``c``: the publication's ``ss_send_publication_t``; ``log``: its log."""
        self._c = c
        self._log = log
        self._cells: list[object] = []
        self._array = network_ffi.NULL
        #: Whether a closed publication's linger waits for them to read its log to the end
        #: (False after close(wait_for_spies=False): the drain's ending).
        self.waited_for = True

    def __len__(self) -> int:
        return len(self._cells)

    def add(self, cell: object) -> None:
        """A spy reads the log from ``cell`` from now on."""
        self._cells.append(cell)
        self._hand_to_c()

    def remove(self, cell: object) -> bool:
        """The spy of ``cell`` went: whether it was one (a cell not added is ignored)."""
        if cell not in self._cells:
            return False
        self._cells.remove(cell)
        self._hand_to_c()
        return True

    def _hand_to_c(self) -> None:
        c = self._c
        c.spy_count = 0
        self._array = (network_ffi.new("int64_t *[]", self._cells) if self._cells
                       else network_ffi.NULL)
        c.spy_positions = self._array
        c.spy_count = len(self._cells)

    def follow(self) -> None:
        """snd-pos to the fastest spy's position (Aeron's sender, idle with spies and no
        receivers): what no receiver takes is consumed once a spy has read it.  The spies'
        positions are their clients', bounded by what was published."""
        end = self._log.producer_position()
        fastest = max(network.ss_subscriber_position_bounded(cell[0], end)
                      for cell in self._cells)
        c = self._c
        if fastest > c.sender_position[0]:
            network.ss_publish_position(c.sender_position, c.sender_position_counter, fastest)

    def consumed(self, end: int) -> bool:
        """Every spy has read the log to ``end`` (true without spies, or once the drain's
        ending said not to wait for them)."""
        return (not self._cells or not self.waited_for
                or network.ss_publication_slowest_spy(self._c, end) >= end)

    def python_position(self, *, draining: bool, driving: bool) -> int:
        """Where the slowest spy makes the publication's Python half due
        (``c.spy_python_position``): the end of a closed publication's log while its spies
        have not read it all (``draining``: DRAINING waits for them); never otherwise (the C
        half's pub-lmt rule takes the spies itself, and a rule that could not move on would
        make every cycle a pass).  ``driving``: the spies alone connect it, and move snd-pos
        on (:meth:`follow`)."""
        if self._cells and draining:
            end = self._log.producer_position()
            if not self.consumed(end):
                return end
        if driving:
            return self._c.sender_position[0] + 1  # every spy read past snd-pos: move it on
        return NO_DEADLINE
