"""The memory of a write buffer's blocks (:class:`~zarr_rb.core.write_cache.WriteBuffer`):
the tensors a new block takes, those of the block written last when they may serve again
(pages the process holds already), or fresh zeros.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from zarr_rb.core.mirror import zeros
from zarr_rb.util.keys import Key


class Block(Protocol):
    """What the memory uses of a write buffer's block
    (:class:`~zarr_rb.core.write_cache.Block`)."""

    values: dict[Key, torch.Tensor]
    frames_touched: bool


class BlockMemory:
    """The leaves of a block (their element shapes and dtypes, and which are ragged) and the
    tensors of a block written to disk, kept for the next new block (see :meth:`reuse`);
    those of the tier's keys wait for the next block written (:meth:`spare_frames`)."""

    def __init__(
        self,
        element_shapes: Mapping[Key, tuple[int, ...]],
        dtypes: Mapping[Key, torch.dtype],
        ragged: frozenset[Key],
    ) -> None:
        self._element_shapes = dict(element_shapes)
        self._dtypes = dict(dtypes)
        self.ragged = set(ragged)
        """Keys whose rows differ in length (their first element dimension): a block holds
        them padded with zeros to the longest row it holds, and grows wider as needed."""
        self._spare: dict[Key, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """RAM of the tensors kept for the next block."""
        return sum(t.untyped_storage().nbytes() for t in self._spare.values())

    def new_values(self, rows: int, lendable: frozenset[Key]) -> dict[Key, torch.Tensor]:
        """The tensors of a new block of ``rows`` rows: the spare ones, but those of the
        ``lendable`` keys (the tier's), which the next block written takes."""
        # Zeros, as ragged leaves' padding must be (other leaves: only rows marked dirty
        # are ever read or written). (Large ones are mappings of their own: given back
        # whole once let go, and taking no RAM until written.)
        values = {}
        for key, shape in self._element_shapes.items():
            spare = None if key in lendable else self._spare.pop(key, None)
            values[key] = zeros((rows, *shape), self._dtypes[key]) if spare is None else spare
        self._spare = {key: value for key, value in self._spare.items() if key in lendable}
        return values

    def reuse(self, block: Block, lendable: frozenset[Key]) -> None:
        """``block`` is on disk: the next new block takes its tensors (filling a new block's
        50 MB of Atari rows took 2-4 times as long in fresh pages, each faulted in on first
        write), and the next block written those of the ``lendable`` keys."""
        if not self.ragged and block.values.keys() == self._element_shapes.keys():
            # (Tensors of the tier's keys never written into hold no pages: not kept.)
            untouched = frozenset() if block.frames_touched else lendable
            self._spare = {k: v for k, v in block.values.items() if k not in untouched}

    def spare_frames(self, block: Block, lendable: frozenset[Key]) -> None:
        """``block``, whose rows all lent their frames, takes the spare tensors of the
        ``lendable`` keys, to copy its frames into (pages held already)."""
        for key in lendable:
            spare = self._spare.pop(key, None)
            if spare is not None:
                block.values[key] = spare

    def add_key(
        self, key: Key, element_shape: tuple[int, ...], dtype: torch.dtype, *, ragged: bool
    ) -> None:
        """A new leaf: no tensor kept fits the blocks any more."""
        self._element_shapes[key] = element_shape
        self._dtypes[key] = dtype
        self._spare = {}
        if ragged:
            self.ragged.add(key)
