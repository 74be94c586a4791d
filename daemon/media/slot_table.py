"""The C open-addressing tables an endpoint's dispatch looks streams up in, per datagram.

A receive endpoint finds an image, and a send endpoint a publication, by (session, stream) in
a table of ``hash_table_slots`` slots (daemon/network_receiver.c).  Python owns the slots'
memory and sizes it; C fills it (``ss_receiver_set_images``, ``ss_receiver_set_publications``)
and refuses a (session, stream) that repeats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slipstream.daemon._network import ffi as network_ffi
from slipstream.daemon.protocol.types import hash_table_slots


class SlotTable:
    """One such table of one ``ss_receiver_t``: its slots in fields ``slots_field`` and
    ``mask_field`` of that receiver, of C type ``entry_type *``, filled by ``fill``; the
    first :meth:`load` makes them."""

    def __init__(self, entry_type: str, slots_field: str, mask_field: str,
                 fill: Callable[[Any, Any, int], int]) -> None:
        self._pointer_array = f"{entry_type} *[]"
        self._slots_field = slots_field
        self._mask_field = mask_field
        self._fill = fill
        self._slots: Any = network_ffi.NULL  # kept alive here while the receiver points at it
        self._slot_count = 0

    def load(self, receiver: Any, entries: list[Any]) -> None:
        """Point ``receiver``'s table at ``entries`` (their C structs) alone, growing or
        shrinking its slots to fit.  Raises AssertionError when a (session, stream) repeats:
        the callers keep them unique, so that is a bug."""
        slots = hash_table_slots(len(entries))
        if slots != self._slot_count:
            self._slots = network_ffi.new(self._pointer_array, slots)
            self._slot_count = slots
            setattr(receiver, self._slots_field, self._slots)
            setattr(receiver, self._mask_field, slots - 1)
        table = network_ffi.new(self._pointer_array, entries or 1)
        if self._fill(receiver, table, len(entries)) != 0:
            raise AssertionError(f"two entries of one (session, stream) in {self._slots_field}")
