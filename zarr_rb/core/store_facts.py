"""What every part of a store reads of it: the protocol its parts (arrays, reads, RAM rows,
saves, the owner of its commits) name instead of :class:`~zarr_rb.core.store.Store`, which
imports them."""

from __future__ import annotations

from typing import Protocol

from zarr_rb.format.commit import Commit
from zarr_rb.format.record import StoreMeta
from zarr_rb.format.schema import LeafSpec, Schema
from zarr_rb.util.keys import Key


class StoreFacts(Protocol):
    """A store's location, schema and record, as its parts read them."""

    leaves: dict[Key, LeafSpec]

    @property
    def url(self) -> str: ...
    @property
    def read_only(self) -> bool: ...
    @property
    def schema(self) -> Schema | None: ...
    @property
    def meta(self) -> StoreMeta: ...
    @property
    def committed(self) -> Commit: ...
    @property
    def rows(self) -> int: ...
    def leaf(self, key: Key) -> LeafSpec: ...
    def element_shape(self, leaf: LeafSpec, width: int = 0) -> tuple[int, ...]: ...
