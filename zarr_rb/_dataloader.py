"""A :class:`~zarr_rb.ZarrStorage` as a map-style dataset of PyTorch's ``DataLoader``:
``DataLoader(rb.storage, batch_size=256, shuffle=True, num_workers=2, collate_fn=torch.stack)``.

Item ``i`` is ``storage[i]``. A batch is read with one read of the store
(``__getitems__``). A worker started by ``spawn`` or ``forkserver`` gets the storage pickled
as a handle to a reader: it opens the store read-only, never as one more writer, so the
store is not made shared for it (as it is for a collector's process). A worker forked from
a process that used TensorStore cannot read the store (TensorStore does not survive a fork)
and raises :class:`~zarr_rb.errors.NotSupportedError` saying to use ``spawn``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDictBase
from torch.utils._pytree import tree_map

from zarr_rb import _shared
from zarr_rb.errors import NotSupportedError, StoreClosedError
from zarr_rb.util.fork import refuse_if_forked

if TYPE_CHECKING:
    from zarr_rb.storage import ZarrStorage

_DATALOADER_MODULE = "torch.utils.data.dataloader"


def pickled_for_a_worker() -> bool:
    """Whether the object being pickled goes to a ``DataLoader`` worker: a process that a
    spawn or forkserver context starts while the ``DataLoader``'s module is on the stack."""
    if not _shared.spawning():
        return False
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == _DATALOADER_MODULE:
            return True
        frame = frame.f_back
    return False


def check_open(storage: ZarrStorage) -> None:
    if storage.closed:
        raise StoreClosedError(
            f"store {storage.url!r} is closed: a closed ZarrStorage is not pickled (for "
            "DataLoader workers or any other process) and not read by a DataLoader; open the "
            "store again, e.g. ZarrStorage(path=..., read_only=True) or "
            "zarr_rb.open(path).dataset()"
        )


def items(storage: ZarrStorage, indices: Sequence[int]) -> list[Any]:
    """``[storage[i] for i in indices]``, read together."""
    check_open(storage)
    refuse_if_forked(f"store {storage.url!r}")  # before len(), which may read the record
    if storage.ndim != 1:
        raise NotSupportedError(
            f"store {storage.url!r} has ndim={storage.ndim}: its len counts elements while "
            "storage[i] is a whole time step, so it is not a flat dataset; "
            "zarr_rb.open(path).dataset() has one item per [time, env] element"
        )
    index = np.asarray(indices, dtype=np.int64).reshape(-1)
    if storage.read_only and index.size and index.max() >= len(storage):
        storage.refresh()  # a persistent worker: the writer committed rows since it opened
    # An array index (not a tensor) reads these very rows, one gather, even from a shared
    # store, where a sampler's tensor index may be redrawn if its rows were evicted.
    batch = storage.get(index)
    if isinstance(batch, (torch.Tensor, TensorDictBase)):
        return list(batch.unbind(0))
    return [tree_map(lambda leaf, k=k: leaf[k], batch) for k in range(index.size)]
