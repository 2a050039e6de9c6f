"""The last row gather of a storage, kept for the next reader of the very same rows.

Samplers such as ``SliceSampler`` read ``storage[index]`` for a few flags, then the buffer
reads the very same rows: the last gather is kept, and a copy of it is handed out when the
same index comes again with no write in between and its tensors untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from zarr_rb.torchrl import compat
from zarr_rb.torchrl.data_kinds import clone, tensors_of

Revision = tuple[int, int, int | None]
"""The storage's revision (its writes), the store's version (the rows it serves: a
reader's reads move it to newer commits) and the commit a reader's sample holds."""


class GatherCache:
    """The last gather: its index, the revision of the rows it saw, its result, and the
    version counters of the result's tensors when it was made."""

    def __init__(self) -> None:
        self._last: tuple[torch.Tensor, Revision, Any, list[tuple[int, int]]] | None = None

    def get(self, index: torch.Tensor, revision: Revision) -> Any | None:
        """A copy of the kept result if it was gathered at ``index`` in ``revision`` and
        nobody changed it in place since; ``None`` otherwise."""
        if self._last is None:
            return None
        kept, kept_revision, result, versions = self._last
        if (
            revision == kept_revision
            and index.shape == kept.shape
            and bool(torch.equal(index, kept))
            # The first caller may have modified the result in place: then it is stale.
            and _versions(result) == versions
        ):
            return clone(result)
        return None

    def keep(self, index: torch.Tensor, revision: Revision, result: Any) -> None:
        self._last = (index.clone(), revision, result, _versions(result))

    def clear(self) -> None:
        self._last = None


def _versions(result: Any) -> list[tuple[int, int]]:
    return [(id(t), compat.tensor_version(t)) for t in tensors_of(result)]
