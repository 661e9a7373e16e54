"""What a server and a cluster share: started on entering a ``with`` block, stopped on leaving."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self


class StartStop(abc.ABC):
    """A context manager over :meth:`start` (which returns the object) and :meth:`stop`."""

    @abc.abstractmethod
    def start(self) -> Self:
        """Start, and return once serving."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop for good and leave nothing behind; idempotent."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
