"""Reading the rows already in a store into a writer's RAM tier of frames.

A writer's tier (:class:`~zarr_rb.core.frames.FrameTier`) takes the rows it writes. The
rows already in the store when it opens, or when it loads a save, are read into it too,
newest first, while they fit without evicting a row the writer wrote (:class:`TierFill`):

- with a budget given as a number, all at once, at the first read;
- with ``ram_bytes="auto"``, behind the buffer's back, from the first read on: a thread of
  the store reads :data:`STEP_ROWS` rows at a time, each step a call of the store (it holds
  the store's lock: a step sees the rows as the buffer's calls leave them, and no call sees
  a step half done). After each step the thread waits as long as the step took, so that the
  buffer's calls get the lock at least half of the time. Until a row is read, reads decode
  it from the store, as without a tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np
import torch

from zarr_rb.core.calls import Calls, serialized
from zarr_rb.core.frames import FrameTier
from zarr_rb.core.ledger import Ledger
from zarr_rb.core.write_cache import WriteBuffer
from zarr_rb.util.keys import Key

_LOG = logging.getLogger(__name__)

FILL_ROWS = 1024
"""Rows read from the store at a time by a fill at the first read."""
STEP_ROWS = 256
"""Rows read from the store at a time by a fill behind the buffer's back: a call of the
buffer waits at most that long for the lock (about 7 ms of Atari frame stacks here)."""


class FillStore(Protocol):
    """What a fill uses of its store (:class:`~zarr_rb.core.store.Store`)."""

    @property
    def cursor(self) -> int: ...
    @property
    def ledger(self) -> Ledger | None: ...
    @property
    def write_cache(self) -> WriteBuffer | None: ...
    def read(
        self,
        rows: np.ndarray,
        keys: Iterable[Key],
        *,
        unwritten_as_zeros: bool = False,
        unreadable_as_zeros: bool = False,
    ) -> dict[Key, torch.Tensor]: ...


class FillRows(Protocol):
    """What a fill uses of the writer's RAM rows (:class:`~zarr_rb.core.ram_rows.RamRows`)."""

    @property
    def store(self) -> FillStore: ...
    @property
    def frames(self) -> FrameTier | None: ...
    def reach(self) -> int: ...
    def read(
        self,
        rows: np.ndarray,
        keys: list[Key],
        *,
        unwritten_as_zeros: bool,
        unreadable_as_zeros: bool,
    ) -> dict[Key, torch.Tensor]: ...


class TierFill:
    """When and how the rows in the store are read into the tier of ``ram``: not at all,
    at the first read (:attr:`at_first_read`) or behind (:attr:`behind`)."""

    def __init__(self, ram: FillRows, calls: Calls) -> None:
        self.ram = ram
        self.calls = calls
        self.at_first_read = False
        self.behind = False
        self._pending = False
        """A fill is due at the next read (a new tier, or one emptied)."""
        self._order = np.empty(0, dtype=np.int64)
        """Behind: the rows to read, oldest first, and how many of them are left (from the
        end, the newest)."""
        self._left = 0
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._done.set()
        self._closed = threading.Event()
        self._busy = False
        """A fill is reading (its reads start none)."""

    def ask(self, *, at_first_read: bool, behind: bool) -> None:
        """Fill at the first read (a budget given as a number: it wins over ``behind``),
        or behind (``"auto"``)."""
        if at_first_read and not self.at_first_read:
            self.at_first_read = self._pending = True
        elif behind and not self.at_first_read and not self.behind:
            self.behind = self._pending = True

    def again(self, *, rows_changed: bool = False) -> None:
        """The tier is new, emptied, or lost rows (``rows_changed``: rows a failed call or
        other writers changed): fill it again at the next read. A fill behind starts again
        only for a new or emptied tier; rows changed otherwise are read from the store."""
        if self.at_first_read or (self.behind and not rows_changed):
            self._pending = True

    def before_read(self) -> None:
        """A read is about to start (under the store's lock): fill first, or start filling
        behind, if due."""
        if not self._pending or self.ram.frames is None or self._busy:
            return
        self._pending = False
        if self.at_first_read:
            order = self._order_of_rows()
            self._busy = True  # (its reads are reads)
            try:
                for stop in range(order.size, 0, -FILL_ROWS):
                    if not self._read_in(order[max(0, stop - FILL_ROWS) : stop], behind=False):
                        return
            finally:
                self._busy = False
        elif self.behind and not self._closed.is_set():
            order = self._order_of_rows()
            self._order = order[~self.ram.frames.resident[order]]  # (none when it wrote all)
            self._left = self._order.size
            if self._thread is None and self._left:
                self._done = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._done,), name="zarr_rb-ram-fill", daemon=True
                )
                self._thread.start()

    @serialized
    def start(self) -> None:
        """Fill now what the next read would (a call of the store of its own)."""
        self.before_read()

    def close(self) -> None:
        """The store is closed: a fill behind stops at its next step."""
        self._closed.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no fill runs behind (the last one ended, the tier full, or the store
        closed); whether none does."""
        return self._done.wait(timeout)

    # --- behind ----------------------------------------------------------------------------

    def _run(self, done: threading.Event) -> None:
        try:
            while True:
                started = time.monotonic()
                if not self._step():
                    return
                self._closed.wait(time.monotonic() - started)  # the buffer's turn
        except Exception as err:  # (a flush the step's end made for a dropped user)
            _LOG.debug("reading rows into RAM stopped: %s", err)
            with self.calls.mutex:
                self._thread = None
        finally:
            done.set()

    @serialized
    def _step(self) -> bool:
        """Read the next rows behind; whether to go on (when not, the thread ends, under
        the lock: a fill asked meanwhile starts a thread of its own)."""
        try:
            if not self._closed.is_set() and self._left > 0 and self.ram.frames is not None:
                part = self._order[max(0, self._left - STEP_ROWS) : self._left]
                self._left -= part.size
                self._busy = True
                try:
                    if self._read_in(part, behind=True) and self._left > 0:
                        return True
                finally:
                    self._busy = False
        except Exception as err:  # rows not read in are read from the store, as before
            _LOG.debug("reading rows into RAM stopped: %s", err)
        self._thread = None
        return False

    # --- both ------------------------------------------------------------------------------

    def _order_of_rows(self) -> np.ndarray:
        """The rows the writer may have reached, oldest first (in the ring's order once it
        went around)."""
        tier = self.ram.frames
        assert tier is not None
        reach = min(self.ram.reach(), tier.rows)
        order = np.arange(reach)
        if reach == tier.rows:
            order = np.roll(order, -(self.ram.store.cursor % reach))
        return order

    def _read_in(self, part: np.ndarray, *, behind: bool) -> bool:
        """Read the rows of ``part`` (oldest first) that the tier does not hold and that are
        readable into the tier, the newest of them first if not all fit; whether there is
        room for more. ``behind``: in a step of its own, not within a read of the store."""
        tier, store = self.ram.frames, self.ram.store
        assert tier is not None
        assert store.ledger is not None
        assert store.write_cache is not None
        keys = sorted(tier.keys)
        staged, _ = store.write_cache.staged_rows(part)
        readable = np.logical_and.reduce([store.ledger.readable(part, key) for key in keys])
        part = part[(readable | staged) & ~tier.resident[part]]
        if not part.size:
            return True
        # Only rows that may fit are read: a full tier (filled again after each change of
        # other writers) would otherwise decode a chunk to throw it away.
        room = tier.room_rows()
        if room <= 0:
            return False
        part = part[-room:]
        values: Mapping[Key, torch.Tensor]
        if behind:
            # The store's read: a shared store's checks that other writers took none of the
            # slots read meanwhile (and reads again if they did).
            values = store.read(part, keys)
        else:  # (within the store's read, which checks it)
            values = self.ram.read(part, keys, unwritten_as_zeros=False, unreadable_as_zeros=False)
        return tier.put(part, values, older=True)
