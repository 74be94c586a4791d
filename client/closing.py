"""The ``with`` protocol of the client library's resources (and the archive's): one base for
every object that a ``with`` block closes."""

from __future__ import annotations

from typing import Self


class ClosedOnExit:
    """A resource that ``with`` closes: ``__enter__`` gives the resource itself and
    ``__exit__`` calls its ``close()`` however the block ended (an exception still
    propagates).  A subclass defines ``close``."""

    def close(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} defines no close()")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
