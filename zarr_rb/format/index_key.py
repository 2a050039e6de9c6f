"""The ``"index"`` entry of rows that shared writers place.

TorchRL's TensorDict writers give each row an ``"index"`` entry: the position it is written
at. A shared writer writes a row before the commit that gives it its position (see
:mod:`zarr_rb.core.sharing`), and never writes over an object, so it stores
:data:`POSITION_MARK` there instead, and every read puts the row's position in its place:
the entry reads as it would in a TorchRL storage after the same extends, in the order the
commits placed them. An entry a writer did not set to the positions it was given is stored
as it is (a value equal to the mark is refused at the write).

A reader without zarr_rb does the same: where ``data/index`` holds ``-2**62``, the row's
position (see ``docs/reading-without-zarr_rb.md``).
"""

from __future__ import annotations

import numpy as np

INDEX_KEY = ("index",)
POSITION_MARK = -(2**62)
"""What a shared writer stores as the ``"index"`` of a row whose position a commit decides."""


def put_positions(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``values`` (the ``"index"`` leaf of rows at ``positions``, any trailing shape) with
    each mark replaced by its row's position (in place, unless ``values`` is read-only)."""
    if values.dtype != np.int64 or not values.size:
        return values
    marked = values == POSITION_MARK
    if marked.any():
        if not values.flags.writeable:
            values = values.copy()
        spread = np.broadcast_to(
            np.asarray(positions, dtype=np.int64).reshape(-1, *(1,) * (values.ndim - 1)),
            values.shape,
        )
        values[marked] = spread[marked]
    return values
