"""A :class:`~zarr_rb.ZarrStorage` as a map-style dataset of PyTorch's ``DataLoader``:
``DataLoader(rb.storage, batch_size=256, shuffle=True, num_workers=2, collate_fn=torch.stack)``.

Item ``i`` is ``storage[i]``. A batch is read with one read of the store
(``__getitems__``, see :mod:`zarr_rb.torchrl.reads`). A worker started by ``spawn`` or
``forkserver`` gets the storage pickled as a handle to a reader: it opens the store
read-only, never as one more writer, so the store is not made shared for it (as it is for
a collector's process). A worker forked from a process that used TensorStore cannot read
the store (TensorStore does not survive a fork) and raises
:class:`~zarr_rb.errors.NotSupportedError` saying to use ``spawn``.
"""

from __future__ import annotations

import inspect

from zarr_rb.errors import StoreClosedError
from zarr_rb.torchrl import sharing
from zarr_rb.torchrl.store_backed import StoreBacked

_DATALOADER_MODULE = "torch.utils.data.dataloader"


def pickled_for_a_worker() -> bool:
    """Whether the object being pickled goes to a ``DataLoader`` worker: a process that a
    spawn or forkserver context starts while the ``DataLoader``'s module is on the stack."""
    if not sharing.spawning():
        return False
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == _DATALOADER_MODULE:
            return True
        frame = frame.f_back
    return False


def check_open(storage: StoreBacked) -> None:
    """Raise :class:`~zarr_rb.errors.StoreClosedError` if ``storage`` was closed."""
    if storage.closed:
        raise StoreClosedError(
            f"store {storage.url!r} is closed: a closed ZarrStorage is not pickled (for "
            "DataLoader workers or any other process) and not read by a DataLoader; open the "
            "store again, e.g. ZarrStorage(path=..., read_only=True) or "
            "zarr_rb.open(path).dataset()"
        )
