"""What a ZarrStorage does differently when its store has several writers (see
:mod:`zarr_rb.core.sharing`): extends go where the store places them, and a sampler's
draw that another writer evicted before it was read is drawn again."""

from __future__ import annotations

import multiprocessing.context
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from zarr_rb import _index
from zarr_rb.errors import NotSupportedError, RowsNotCommittedError

if TYPE_CHECKING:
    from zarr_rb.storage import ZarrStorage

_REDRAWS = 20


def spawning() -> bool:
    """Whether the object being pickled goes to a new process (``multiprocessing`` spawn or
    forkserver, as TorchRL's buffers, collectors and ``mp.Process`` use)."""
    return multiprocessing.context.get_spawning_popen() is not None


def append(storage: ZarrStorage, cursor: Any, data: Any) -> np.ndarray:
    """An extend of a shared store: the rows go where this writer's blocks have room, and
    the writer's index (the tensor ``rb.extend`` returns) is rewritten in place to say
    where. Returns the positions of ``cursor``'s rows (an ``add``'s integer cursor cannot
    be rewritten: its writer's return value is replaced, see :mod:`zarr_rb._writes`)."""
    store = storage._store
    if storage.ndim != 1:
        raise NotSupportedError(
            f"{storage._where}: shared writers place rows by blocks of a 1-D storage; "
            f"this one has ndim={storage.ndim}: flatten the batch (data.reshape(-1)) and "
            "use ndim=1",
        )
    rows, leaves = storage._rows_to_write(cursor, data)
    storage.__dict__["writes_begun"] += 1
    assert store.schema is not None
    index, _ = _index.write_rows(cursor, store.schema.rows, where=storage._where)
    # The rows go in the order extended, at the record's cursor (a trajectory stays in
    # one piece), not in the order of this writer's cursor, which other writers moved
    # past: its index may wrap where the record's does not.
    if rows.size < index.size:
        # More rows than the ring holds: each moves the cursor, as in TorchRL's storages
        # (the store keeps the last ring's worth); the rows repeated here are dropped.
        picked = torch.from_numpy(np.searchsorted(rows, index))
        leaves = {key: value[picked] for key, value in leaves.items()}
        placed = store.append(leaves, index.size)
        where = np.arange(index.size)
    else:
        order = np.argsort(_index.unique_last(index)[1], kind="stable")
        if (np.diff(order) != 1).any():
            picked = torch.from_numpy(order)
            leaves = {key: value[picked] for key, value in leaves.items()}
        placed = np.empty(rows.size, dtype=np.int64)
        placed[order] = store.append(leaves, rows.size)
        where = np.searchsorted(rows, index)
    positions: np.ndarray = placed[where]
    if isinstance(cursor, torch.Tensor) and cursor.ndim == 1 and not cursor.is_floating_point():
        cursor.copy_(torch.from_numpy(positions).to(cursor.device, cursor.dtype))
    return positions


def gather_redrawing(
    storage: ZarrStorage,
    index: torch.Tensor,
    gather: Callable[[torch.Tensor], Any],
    draw_again: Callable[[int], torch.Tensor],
) -> Any:
    """``gather(index)``; if rows the sampler just drew were evicted by another writer
    before they could be read, they are drawn again (``index`` is rewritten in place, so
    the index the buffer reports is the one read)."""
    draw = getattr(storage._thread_state, "draw", None)
    for _ in range(_REDRAWS):
        try:
            return gather(index)
        except RowsNotCommittedError:
            if draw is None or index is not draw:
                raise
            storage.refresh()
            index.copy_(draw_again(index.numel()))
    return gather(index)
