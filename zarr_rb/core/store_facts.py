"""What every part of a store reads of it: the protocol its parts (arrays, reads, RAM rows,
saves, the owner of its commits) name instead of :class:`~zarr_rb.core.store.Store`, which
imports them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from zarr_rb.core.dtypes import TORCH_DTYPES
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


def whole_rows(
    store: StoreFacts, rows: np.ndarray, values: Mapping[Key, torch.Tensor]
) -> Mapping[Key, torch.Tensor]:
    """``values`` with zeros for the keys of ``store`` an extend left out (the rows it goes
    to are new ones, as in a new TorchRL storage: what they held belongs to evicted rows)."""
    missing = [key for key in store.leaves if key not in values]
    if not missing:
        return values
    out = dict(values)
    for key in missing:
        leaf = store.leaf(key)
        shape = (rows.size, *store.element_shape(leaf))
        out[key] = torch.zeros(shape, dtype=TORCH_DTYPES[leaf.dtype])
    return out
