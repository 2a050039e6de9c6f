"""What a ZarrStorage does differently when its store has several writers (see
:mod:`zarr_rb.core.sharing`): extends go where the store places them, and a sampler's
draw that another writer evicted before it was read is drawn again."""

from __future__ import annotations

import multiprocessing.context
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from zarr_rb.core.store import Store
from zarr_rb.errors import RowsNotCommittedError
from zarr_rb.format.index_key import INDEX_KEY, POSITION_MARK
from zarr_rb.torchrl import index_forms
from zarr_rb.util.keys import Key

_REDRAWS = 20


def spawning() -> bool:
    """Whether the object being pickled goes to a new process (``multiprocessing`` spawn or
    forkserver, as TorchRL's buffers, collectors and ``mp.Process`` use)."""
    return multiprocessing.context.get_spawning_popen() is not None


def append(
    store: Store,
    cursor: Any,
    rows: np.ndarray,
    leaves: dict[Key, torch.Tensor],
    *,
    where: str,
    index_is_position: bool | None = None,
) -> np.ndarray:
    """Append the validated ``leaves`` of an extend at ``cursor`` (sorted unique ``rows``,
    as the storage would write them) to a shared store: the rows go where this writer's
    blocks have room, and the writer's index (the tensor ``rb.extend`` returns) is
    rewritten in place to say where. ``index_is_position``: whether the writer set the
    ``"index"`` entry to the positions it gave (``None``: no writer is known, and it is
    taken to have if the values are those positions). Returns the positions of ``cursor``'s rows (an
    ``add``'s integer cursor cannot be rewritten: its writer's return value is replaced,
    see :mod:`zarr_rb.torchrl.guards`)."""
    assert store.schema is not None
    index, _ = index_forms.write_rows(cursor, store.schema.rows, where=where)
    if index_is_position is not False:  # (a writer that leaves "index" to the data: kept)
        leaves = _positions_marked(leaves, rows)
    # The rows go in the order extended, at the record's cursor (a trajectory stays in
    # one piece), not in the order of this writer's cursor, which other writers moved
    # past: its index may wrap where the record's does not.
    if rows.size < index.size:
        # More rows than the ring holds: each moves the cursor, as in TorchRL's storages
        # (the store keeps the last ring's worth); the rows repeated here are dropped.
        picked = torch.from_numpy(np.searchsorted(rows, index))
        leaves = {key: value[picked] for key, value in leaves.items()}
        placed = store.append(leaves, index.size)
        position = np.arange(index.size)
    else:
        order = np.argsort(index_forms.unique_last(index)[1], kind="stable")
        if (np.diff(order) != 1).any():
            picked = torch.from_numpy(order)
            leaves = {key: value[picked] for key, value in leaves.items()}
        placed = np.empty(rows.size, dtype=np.int64)
        placed[order] = store.append(leaves, rows.size)
        position = np.searchsorted(rows, index)
    positions: np.ndarray = placed[position]
    if isinstance(cursor, torch.Tensor) and cursor.ndim == 1 and not cursor.is_floating_point():
        cursor.copy_(torch.from_numpy(positions).to(cursor.device, cursor.dtype))
    return positions


def _positions_marked(leaves: dict[Key, torch.Tensor], rows: np.ndarray) -> dict[Key, torch.Tensor]:
    """``leaves`` (those of ``rows``) with an ``"index"`` entry that holds the rows it is
    written at (as TorchRL's TensorDict writers write it) replaced by marks: the commit
    decides the positions, and readers put them in (see :mod:`zarr_rb.format.index_key`)."""
    value = leaves.get(INDEX_KEY)
    if value is None or value.dtype != torch.int64 or value.shape[:1] != (rows.size,):
        return leaves
    given = torch.from_numpy(rows).view(-1, *(1,) * (value.ndim - 1)).to(value.device)
    if not bool((value == given).all()):
        return leaves  # the writer's own values: stored as they are
    return {**leaves, INDEX_KEY: torch.full(value.shape, POSITION_MARK, dtype=torch.int64)}


def gather_redrawing(
    index: torch.Tensor,
    gather: Callable[[torch.Tensor], Any],
    draw_again: Callable[[int], torch.Tensor],
    *,
    draw: torch.Tensor | None,
    refresh: Callable[[], None],
) -> Any:
    """``gather(index)``; if rows the sampler just drew (``draw``, the index its last draw
    returned) were evicted by another writer before they could be read, the storage is
    refreshed and they are drawn again (``index`` is rewritten in place, so the index the
    buffer reports is the one read)."""
    for _ in range(_REDRAWS):
        try:
            return gather(index)
        except RowsNotCommittedError:
            if draw is None or index is not draw:
                raise
            refresh()
            index.copy_(draw_again(index.numel()))
    return gather(index)
