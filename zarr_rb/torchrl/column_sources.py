"""The sources of the lazy columns a ZarrStorage hands out (``storage[:]``,
``storage.get(key)``, its full view): how a :class:`~zarr_rb.torchrl.columns.LazyColumn`
reads and writes the rows of one entry of a store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from zarr_rb.core.store import Store
from zarr_rb.errors import NotSupportedError
from zarr_rb.util.keys import Key


class ViewCommit:
    """The commit a reader's view reads: the one the reader showed when the view was taken
    (its length is the view's). A view reads key by key, when used: each key is read as
    that commit has it, while the writer keeps its rows, and raises after
    (``Commit.kept_from``); never rows of two commits."""

    def __init__(self, store: Store) -> None:
        self.commit = store.commits.held() or store.committed


class _EntrySource:
    """One entry of a store over rows ``[0, length)``, for a lazy column."""

    def __init__(self, store: Store, key: Key, length: int) -> None:
        self._store = store
        self._key = key
        self._length = length

    @property
    def length(self) -> int:
        return self._length

    @property
    def revision(self) -> int:
        return self._store.version


class LeafSource(_EntrySource):
    """The rows of one leaf of a store, for a storage's lazy columns.

    Args:
        store: the storage's store.
        key: the leaf.
        length: rows ``[0, length)`` are the column's.
        unused_as_zeros: rows never written read as zeros (a full view).
        holes_as_zeros: asked at each read: whether rows that cannot be read read as zeros.
        write: writes ``values[i]`` into row ``rows[i]`` of some leaves, through the storage.
        view: the commit a reader's view reads (``None``: a writer's view, which reads
            the rows as they are when read).
    """

    def __init__(
        self,
        store: Store,
        key: Key,
        length: int,
        *,
        unused_as_zeros: bool,
        holes_as_zeros: Callable[[], bool],
        write: Callable[[np.ndarray, dict[Key, torch.Tensor]], None],
        view: ViewCommit | None = None,
    ) -> None:
        super().__init__(store, key, length)
        self._unused_as_zeros = unused_as_zeros
        self._holes_as_zeros = holes_as_zeros
        self._write = write
        self._view = view

    def read(self, rows: np.ndarray) -> torch.Tensor:
        values = self._store.read(
            rows,
            [self._key],
            unwritten_as_zeros=self._unused_as_zeros,
            unreadable_as_zeros=self._holes_as_zeros(),
            under=None if self._view is None else self._view.commit,
        )
        return values[self._key]

    def write(self, rows: np.ndarray, values: torch.Tensor) -> None:
        self._write(rows, {self._key: values})


class RowsOnlySource(_EntrySource):
    """Stands in a lazy view for an entry that no tensor column can hold (strings, rows of
    different lengths): reading it as a tensor says where its rows are read; the Python
    values of a values entry are read by ``tolist()`` and iteration.

    Args:
        store: the storage's store.
        key: the entry.
        length: rows ``[0, length)`` are the column's.
        what: what the entry holds, for errors ("strings", "rows of different lengths").
        values: ``values(key, rows)`` gives the Python values of rows of a values entry;
            ``None`` for an entry of rows of different lengths.
    """

    def __init__(
        self,
        store: Store,
        key: Key,
        length: int,
        what: str,
        *,
        values: Callable[[Key, np.ndarray], list[Any]] | None,
    ) -> None:
        super().__init__(store, key, length)
        self._what = what
        self._values = values

    def refuse(self) -> NotSupportedError:
        readable = "read its values with .tolist(), " if self._values is not None else ""
        return NotSupportedError(
            f"store {self._store.url!r}: entry {self._key!r} holds {self._what}, which a lazy "
            f"view (storage[:]) cannot hold as a tensor column: {readable}read rows with "
            f"storage[index] or storage.get(index), or the whole entry with "
            f"storage.get({self._key!r})",
        )

    def python_values(self, rows: np.ndarray) -> list[Any]:
        """The values of ``rows``, as ``storage.get(key)`` gives them for every row."""
        if self._values is None:
            raise self.refuse()
        return self._values(self._key, rows)

    def read(self, rows: np.ndarray) -> torch.Tensor:
        raise self.refuse()

    def write(self, rows: np.ndarray, values: torch.Tensor) -> None:
        raise self.refuse()
