"""A ZarrStorage's state in TorchRL's format, and any TorchRL storage's state loaded into one.

TorchRL's tensor storages describe themselves as ``{"_storage": rows, "initialized": ...,
"_len": ...}``, where ``rows`` is the full-capacity tensor, or a TensorDict's
``state_dict()``. A ZarrStorage hands out the same, with its rows as lazy columns (read
from disk only when the receiver copies them), plus the path and cursor of its store, so
that loading it back into the same store copies nothing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict, is_tensor_collection

from zarr_rb._convert import clone, row_nbytes, select
from zarr_rb._engine import copy_in_blocks

if TYPE_CHECKING:
    from zarr_rb.storage import ZarrStorage

STATE_KEY = "zarr_rb"
"""Where a ZarrStorage's state dict names its store (ignored by TorchRL's storages)."""

COPY_BLOCK_BYTES = 64 * 2**20


def state_dict(storage: ZarrStorage) -> dict[str, Any]:
    storage.flush()
    rows: Any = {}
    if storage.initialized:
        rows = storage.full_view()
        if is_tensor_collection(rows):
            rows = rows.state_dict()
    return {
        "_storage": rows,
        "initialized": storage.initialized,
        "_len": len(storage),
        STATE_KEY: {"path": str(storage.path), "cursor": storage.cursor},
    }


def load_state_dict(storage: ZarrStorage, state: dict[str, Any]) -> None:
    length = int(state["_len"])
    ours = state.get(STATE_KEY)
    if ours is not None and Path(ours["path"]).resolve() == storage.path.resolve():
        storage.restore(length=length, cursor=int(ours["cursor"]))
        return
    rows = state["_storage"]
    if isinstance(rows, dict):
        if not rows or not state.get("initialized", True):
            storage.restore(length=0, cursor=0)
            return
        # By reference: lazy columns stay lazy until copied block by block.
        rows = TensorDict().load_state_dict(rows, strict=False)
    elif not isinstance(rows, torch.Tensor):
        raise TypeError(
            f"expected the rows of a tensor storage (a tensor or a TensorDict state dict), got "
            f"{type(rows).__name__}; for other storages use rb.dumps/rb.loads or "
            "zarr_rb.save",
        )
    per_row = math.prod(rows.shape[1 : storage.ndim])
    n_rows = min(rows.shape[0], -(-length // per_row))
    copy_rows(rows, storage, rows=n_rows)
    cursor = int(ours["cursor"]) if ours is not None else n_rows % rows.shape[0]
    storage.restore(length=length, cursor=cursor)


def copy_store(source: str | os.PathLike[str], storage: ZarrStorage) -> None:
    """Copy the committed rows of the store at ``source`` into ``storage``."""
    from zarr_rb.storage import ZarrStorage

    with ZarrStorage(path=source, ndim=storage.ndim, read_only=True) as other:
        if other.schema is not None:
            copy_rows(other[:], storage, rows=-(-len(other) // _per_row(other)))


def _per_row(storage: ZarrStorage) -> int:
    schema = storage.schema
    return 1 if schema is None else math.prod(schema.batch_shape[1:])


def copy_rows(source: Any, storage: ZarrStorage, *, rows: int, progress: bool = False) -> None:
    """Copy rows ``[0, rows)`` of ``source`` (anything sliceable by rows: a storage, a
    TensorDict, a tensor) into ``storage``, in blocks of about 64 MiB."""
    if rows <= 0:
        return
    copy_in_blocks(
        lambda start, stop: clone(select(source, slice(start, stop))),
        lambda where, block: storage.set(where, block, set_cursor=False),
        rows=rows,
        row_nbytes=row_nbytes(source),
        block_bytes=COPY_BLOCK_BYTES,
        progress=progress,
        desc="copy rows",
    )
