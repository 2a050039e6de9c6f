"""One thread at a time in a store: a buffer's prefetch threads, a training loop and a
writer thread may share one. The store and the parts that take calls for it (its saves,
its lifetime) serialize their public methods on one :class:`Calls`.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from zarr_rb.errors import FencedError
from zarr_rb.util.fork import refuse_parents_store

_F = TypeVar("_F", bound=Callable[..., Any])


class Calls:
    """The calls of one store under way, and the fence that ends its writes."""

    def __init__(self, flush: Callable[[], None], *, where: str) -> None:
        self.where = where
        self.process = os.getpid()
        """The process that opened the store: a child forked from it has a copy of the
        store's state, and of this lock as it was at the fork, but none of its threads."""
        self.mutex = threading.RLock()
        self.depth = 0
        """Calls under way (on the thread that holds :attr:`mutex`)."""
        self.flush_on_exit = False
        """A user was dropped inside a call: the call commits its rows as it ends."""
        self.fenced: FencedError | None = None
        """Why this writer was fenced (another writer took the store over): it then
        commits nothing more, and closing it releases it without a flush."""
        self._flush = flush

    @property
    def forked(self) -> bool:
        """Whether this is a process forked from the one that opened the store."""
        return os.getpid() != self.process

    def check_process(self) -> None:
        """Raise :class:`~zarr_rb.errors.NotSupportedError` in a child forked from the
        process that opened the store (see :func:`~zarr_rb.util.fork.refuse_parents_store`)."""
        if self.forked:
            refuse_parents_store(self.where, self.process)

    def end(self) -> None:
        """The outermost call ends: commit the rows of a user dropped inside it."""
        if not self.depth and self.flush_on_exit:
            self.flush_on_exit = False
            self._flush()


class TakesCalls(Protocol):
    calls: Calls


def serialized(method: _F) -> _F:
    """Run a method of an object with ``calls`` holding its store's lock (in the process
    that opened the store: a forked child gets :class:`~zarr_rb.errors.NotSupportedError`)."""

    @functools.wraps(method)
    def wrapper(self: TakesCalls, *args: Any, **kwargs: Any) -> Any:
        calls = self.calls
        calls.check_process()  # (before the lock, which a thread the child lacks may hold)
        with calls.mutex:
            calls.depth += 1
            try:
                result = method(self, *args, **kwargs)
            except FencedError as err:
                calls.fenced = err  # nothing more is written: see Lifetime.close
                raise
            finally:
                calls.depth -= 1
            calls.end()
            return result

    return cast(_F, wrapper)
