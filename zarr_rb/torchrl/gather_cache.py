"""The last row gather of a storage, kept for the next reader of the very same rows.

Samplers such as ``SliceSampler`` read ``storage[index]`` for a few flags, then the buffer
reads the very same rows: the leaves of the sampler's read are kept, and copies of them are
handed to the buffer's gather of the same index, once, if nothing was written in between and
its tensors were not changed in place. Only a sampler's reads are kept: a caller handed
other rows may change them in ways no version counter shows (through numpy, ``.data``).

The cache keeps the leaves as read, in a dictionary of its own, never the object a caller
was handed: the first caller goes on changing that object (TorchRL adds ``index`` and the
weights to it, in another thread with ``prefetch=``), and a copy made meanwhile would read
it half changed. A caller changing a tensor in place changes the kept leaf too: its version
counter moves, and the kept leaves are not served again.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from zarr_rb.torchrl import compat
from zarr_rb.util.keys import Key

Revision = tuple[int, int, int | None]
"""The storage's revision (its writes), the store's version (the rows it serves: a
reader's reads move it to newer commits) and the commit a reader's sample holds."""

_Kept = tuple[torch.Tensor, Revision, dict[Key, torch.Tensor], list[int]]
"""The index of a gather, the revision of the rows it saw, its leaves, and their version
counters then."""


class GatherCache:
    """The leaves of the last gather (see the module's docstring)."""

    def __init__(self) -> None:
        self._last: _Kept | None = None

    def take(self, index: torch.Tensor, revision: Revision) -> dict[Key, torch.Tensor] | None:
        """Copies of the kept leaves if they were gathered at ``index`` in ``revision`` and
        nobody changed them in place since (they are then no longer kept); ``None``
        otherwise."""
        last = self._last
        if last is None:
            return None
        self._last = None
        kept, kept_revision, leaves, versions = last
        if not (
            revision == kept_revision
            and index.shape == kept.shape
            and bool(torch.equal(index, kept))
            and _versions(leaves) == versions
        ):
            return None
        copies = {key: _copy(value) for key, value in leaves.items()}
        # (Changed while copied: the copies may hold half of the change.)
        return copies if _versions(leaves) == versions else None

    def keep(
        self, index: torch.Tensor, revision: Revision, leaves: Mapping[Key, torch.Tensor]
    ) -> None:
        """Keep the leaves of a gather (the tensors the caller's result is built of); not
        those read under ``torch.inference_mode()``, which keep no version counter."""
        kept = dict(leaves)
        if any(tensor.is_inference() for tensor in kept.values()):
            self._last = None
            return
        self._last = (index.clone(), revision, kept, _versions(kept))

    def clear(self) -> None:
        self._last = None


def _versions(leaves: Mapping[Key, torch.Tensor]) -> list[int]:
    return [compat.tensor_version(t) for t in leaves.values()]


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy, bit for bit (``clone`` keeps ``-0.0`` and NaN payloads as they are)."""
    return tensor.clone()
