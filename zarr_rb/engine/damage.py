"""What a read of a :class:`~zarr_rb.engine.rows.RowArray` that failed found damaged: the
chunks among the rows asked that cannot be read back intact, and the error that names them.
"""

from __future__ import annotations

import numpy as np

from zarr_rb.engine.rows import RowArray
from zarr_rb.errors import ChunkCorruptedError
from zarr_rb.format.messages import describe_runs
from zarr_rb.util.io import short_reason


def damaged_runs(
    array: RowArray, start: int, stop: int, width: int | None = None
) -> list[tuple[int, int, str]]:
    """The stored chunks of ``array`` among rows ``[start, stop)`` (up to ``width``) that
    cannot be read back intact.

    Returns:
        ``(first_row, end_row, reason)`` for each damaged chunk (rows clipped to the range
        asked).
    """
    if start >= stop:
        return []
    try:
        array.read_rows(np.arange(start, stop), width).result()
        return []
    except ValueError:
        pass
    step = array.read_chunk_rows
    damaged = []
    for first in range(start - start % step, stop, step):
        a, b = max(first, start), min(first + step, stop)
        try:
            array.read_rows(np.arange(a, b), width).result()
        except ValueError as err:
            damaged.append((a, b, short_reason(err)))
    return damaged


def damage_error(
    array: RowArray, rows: np.ndarray, err: ValueError, width: int | None = None
) -> ValueError:
    """Why reading ``rows`` of ``array`` failed: a :class:`ChunkCorruptedError` naming the
    damaged chunks among them, or ``err`` when none is damaged now (a chunk replaced while it
    was read)."""
    step = array.read_chunk_rows
    damaged: list[tuple[int, int, str]] = []
    for chunk in np.unique(rows // step).tolist():
        stop = min(array.shape[0], (chunk + 1) * step)
        damaged.extend(damaged_runs(array, chunk * step, stop, width))
    if not damaged:
        return err
    return ChunkCorruptedError(
        f"store {array.url!r}: array {array.path!r}, "
        f"{describe_runs(damaged)}, cannot be read back intact ({damaged[0][2]}). "
        "Nothing was returned. `python -m zarr_rb verify <store>` lists every damaged "
        "chunk; `--repair` withdraws the damaged rows from the readable range",
        array=array.path,
        rows=[(a, b) for a, b, _ in damaged],
    )
