"""What a ZarrStorage's reads hand out: the sources of its lazy columns, and the last row
gather (kept for the sampler and the buffer that read the same rows one after the other)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from zarr_rb import _convert
from zarr_rb.errors import NotSupportedError

if TYPE_CHECKING:
    from zarr_rb.storage import ZarrStorage

Key = tuple[str, ...]


class _EntrySource:
    """One entry of a :class:`ZarrStorage` over rows ``[0, length)``, for a lazy column."""

    def __init__(self, storage: ZarrStorage, key: Key, length: int) -> None:
        self._owner = storage
        self._key = key
        self._length = length

    @property
    def length(self) -> int:
        return self._length

    @property
    def revision(self) -> int:
        return self._owner._store.version


class LeafSource(_EntrySource):
    """The rows of one leaf of a :class:`ZarrStorage`, for its lazy columns."""

    def __init__(
        self, storage: ZarrStorage, key: Key, length: int, *, unused_as_zeros: bool
    ) -> None:
        super().__init__(storage, key, length)
        self._unused_as_zeros = unused_as_zeros

    def read(self, rows: np.ndarray) -> torch.Tensor:
        storage = self._owner
        values = storage._store.read(
            rows,
            [self._key],
            unwritten_as_zeros=self._unused_as_zeros,
            unreadable_as_zeros=storage._unreadable_as_zeros,
        )
        return values[self._key]

    def write(self, rows: np.ndarray, values: torch.Tensor) -> None:
        self._owner.write_leaves(rows, {self._key: values})


class RowsOnlySource(_EntrySource):
    """Stands in a lazy view for an entry that no tensor column can hold (strings, rows of
    different lengths): reading it as a tensor says where its rows are read; the Python
    values of a values entry are read by ``tolist()`` and iteration."""

    def __init__(
        self, storage: ZarrStorage, key: Key, length: int, what: str, *, values: bool
    ) -> None:
        super().__init__(storage, key, length)
        self._what = what
        self._values = values

    def refuse(self) -> NotSupportedError:
        readable = "read its values with .tolist(), " if self._values else ""
        return NotSupportedError(
            f"{self._owner._where}: entry {self._key!r} holds {self._what}, which a lazy view "
            f"(storage[:]) cannot hold as a tensor column: {readable}read rows with "
            f"storage[index] or storage.get(index), or the whole entry with "
            f"storage.get({self._key!r})",
        )

    def python_values(self, rows: np.ndarray) -> list[Any]:
        """The values of ``rows``, as ``storage.get(key)`` gives them for every row."""
        if not self._values:
            raise self.refuse()
        return self._owner.entry_values(self._key, rows)

    def read(self, rows: np.ndarray) -> torch.Tensor:
        raise self.refuse()

    def write(self, rows: np.ndarray, values: torch.Tensor) -> None:
        raise self.refuse()


class Gather:
    """The last row gather: its index, the storage revision it saw, and its result."""

    def __init__(self, index: torch.Tensor, revision: int, result: Any) -> None:
        self.index = index
        self.revision = revision
        self.result = result
        self._versions = self._leaf_versions()

    def _leaf_versions(self) -> list[tuple[int, int]]:
        return [(id(t), t._version) for t in _convert.tensors_of(self.result)]

    def matches(self, index: torch.Tensor, revision: int) -> bool:
        return (
            revision == self.revision
            and index.shape == self.index.shape
            and bool(torch.equal(index, self.index))
            # The first caller may have modified the result in place: then it is stale.
            and self._leaf_versions() == self._versions
        )
