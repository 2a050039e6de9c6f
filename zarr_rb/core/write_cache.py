"""Write combining: rows wait in RAM, grouped by block, until a whole block can be
written at once (one shard per large leaf, so no read-modify-write of shards).

Blocks are only staged for sequential writes (the round-robin pattern of
TorchRL's writers); scattered writes go straight to disk, so a random
``storage[idx] = data`` never allocates a block per touched row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from zarr_rb.core.mirror import zeros
from zarr_rb.engine.rows import is_run
from zarr_rb.util.keys import Key

Write = tuple[np.ndarray, Mapping[Key, torch.Tensor]]
"""Rows (sorted and unique) and the values of some leaves to write there."""


@dataclasses.dataclass(slots=True)
class Block:
    """Rows ``[index * rows, (index + 1) * rows)`` of every leaf, and which of them are set."""

    index: int
    values: dict[Key, torch.Tensor]
    dirty: np.ndarray
    length: int
    """Rows of this block inside the array (the last block may be shorter)."""

    @property
    def full(self) -> bool:
        return bool(self.dirty[: self.length].all())


def block_write(block: Block) -> Write:
    """The rows a block holds and their values (all of them when the block is full)."""
    offsets = np.flatnonzero(block.dirty[: block.length])
    start = block.index * block.dirty.size
    if offsets.size == block.length:
        return start + offsets, {key: v[: block.length] for key, v in block.values.items()}
    index = torch.from_numpy(offsets)
    return start + offsets, {key: v[index] for key, v in block.values.items()}


class WriteBuffer:
    """Blocks of rows written by this process and not yet on disk."""

    def __init__(
        self,
        *,
        element_shapes: Mapping[Key, tuple[int, ...]],
        dtypes: Mapping[Key, torch.dtype],
        block_rows: int,
        rows: int,
        ragged: frozenset[Key] = frozenset(),
    ) -> None:
        self.block_rows = block_rows
        self.rows = rows
        self._element_shapes = dict(element_shapes)
        self._dtypes = dict(dtypes)
        self._ragged = set(ragged)
        """Keys whose rows differ in length (their first element dimension): a block holds
        them padded with zeros to the longest row it holds, and grows wider as needed."""
        self._blocks: dict[int, Block] = {}
        self._spare: dict[Key, torch.Tensor] | None = None
        """The tensors of a block written to disk, for the next new block (see :meth:`reuse`)."""
        self._writing: Block | None = None
        """A full block whose write to disk was started and has not finished: its rows are
        read from here (they are not on disk yet), and nothing else writes into it."""
        self._restored: list[np.ndarray] = []
        """Rows whose values a copy interrupted between two keys put back (see
        :meth:`_put_rows`), until :meth:`take_restored`."""
        self._patches: list[Write] = []
        """Writes of rows not held in a block, whose write to disk failed, in the order
        made (of some keys, and whole rows written before one of them): the next flush
        writes them again, and reads take those cells from here (a newer write of the
        same cells drops them, see :meth:`supersede`)."""

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[Block]:
        """The blocks waiting to be written (not the one being written)."""
        return iter(list(self._blocks.values()))

    @property
    def nbytes(self) -> int:
        """RAM of the blocks held here (waiting and being written) and of the spare one
        kept for the next block."""
        tensors = [v for block in self.held() for v in block.values.values()]
        tensors += list((self._spare or {}).values())
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def held(self) -> Iterator[Block]:
        """Every block whose rows are read from here: those waiting and the one being
        written."""
        blocks = list(self._blocks.values())
        if self._writing is not None:
            blocks.append(self._writing)
        return iter(blocks)

    def clear(self) -> None:
        """Let go of the blocks waiting (taken to be written)."""
        self._blocks.clear()

    def forget(self) -> None:
        """Forget every row held, blocks and patches (``empty``; no block is being
        written)."""
        assert self._writing is None
        self._blocks.clear()
        self._patches.clear()

    # --- the block being written -----------------------------------------------------------

    @property
    def writing(self) -> Block | None:
        return self._writing

    def start_writing(self, block: Block) -> None:
        """``block`` (popped) is being written: its rows are read from here until then."""
        assert self._writing is None
        self._writing = block

    def written(self, *, released: bool) -> None:
        """The block being written is on disk. TensorStore wrote it without a copy: its
        memory serves the next block once TensorStore let go of it (``released``), and is
        otherwise left to TensorStore (unmapped once neither holds it)."""
        assert self._writing is not None
        block, self._writing = self._writing, None
        if released:
            self.reuse([block])

    def not_written(self) -> None:
        """The block's write failed: a copy of it waits again, for the next flush (the
        memory written from stays as it is: TensorStore may keep it)."""
        assert self._writing is not None
        block, self._writing = self._writing, None
        assert block.index not in self._blocks
        values = {}
        for key, value in block.values.items():
            values[key] = zeros(tuple(value.shape), value.dtype)
            values[key].copy_(value)
        self._blocks[block.index] = dataclasses.replace(block, values=values)

    # --- patches: failed writes kept in order ---------------------------------------------

    def keep_patch(self, write: Write) -> None:
        """Keep a write that failed, for the next flush and for reads."""
        self._patches.append(write)

    @property
    def patches(self) -> int:
        """How many patches are kept."""
        return len(self._patches)

    def take_patches(self) -> list[Write]:
        """Every patch kept, oldest first (to write again: kept again if that fails)."""
        patches, self._patches = self._patches, []
        return patches

    def supersede(self, rows: np.ndarray, keys: Iterable[Key]) -> None:
        """A newer write holds the cells of ``keys`` in ``rows``: patches drop them (the
        next flush must not write older values over newer ones)."""
        if self._patches:
            self._patches = without_cells(self._patches, rows, keys)

    def held_rows(self, *, writing: bool = True) -> np.ndarray:
        """The rows held here (sorted, unique): in a block waiting (and in the one being
        written, with ``writing``), or with cells in a patch."""
        blocks = self.held() if writing else iter(self)
        parts = [self.patched_rows()]
        parts += [block.index * self.block_rows + np.flatnonzero(block.dirty) for block in blocks]
        return np.unique(np.concatenate(parts))

    def patched_rows(self) -> np.ndarray:
        """The rows some patch holds cells of (sorted, unique)."""
        return np.unique(np.concatenate([np.empty(0, np.int64), *(r for r, _ in self._patches)]))

    def patched_mask(self, rows: np.ndarray, key: Key) -> np.ndarray:
        """Which of ``rows`` have their cell of ``key`` in a patch."""
        mask = np.zeros(rows.size, dtype=bool)
        for positions, _, _ in self._matches(rows, key):
            mask[positions] = True
        return mask

    def patched(self, rows: np.ndarray, key: Key) -> list[tuple[np.ndarray, torch.Tensor]]:
        """The cells of ``key`` that patches hold for ``rows`` (any order, repeats
        allowed), oldest first: the positions (into ``rows``) and their values."""
        return [
            (positions, values[torch.from_numpy(where)])
            for positions, where, values in self._matches(rows, key)
        ]

    def _matches(
        self, rows: np.ndarray, key: Key
    ) -> Iterator[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        """For each patch holding cells of ``key`` for some of ``rows``, oldest first: the
        positions (into ``rows``), where the patch holds them, and its values of ``key``."""
        for written, values in self._patches:
            if key in values:
                where = np.searchsorted(written, rows).clip(max=written.size - 1)
                positions = np.flatnonzero(written[where] == rows)
                if positions.size:
                    yield positions, where[positions], values[key]

    def pop(self, index: int) -> Block:
        return self._blocks.pop(index)

    def take(self, indices: Iterable[int]) -> tuple[list[Block], list[Write]]:
        """Take blocks out to be written, and their writes: those are made first (a copy
        of the rows of a block partly filled may fail), so that a failure leaves every
        block here."""
        blocks = [self._blocks[index] for index in indices]
        writes = [block_write(block) for block in blocks]
        for block in blocks:
            del self._blocks[block.index]
        return blocks, writes

    def _block_rows_in_array(self, index: int) -> int:
        return min(self.block_rows, self.rows - index * self.block_rows)

    def reuse(self, blocks: list[Block]) -> None:
        """Blocks popped and now written to disk: the next new block takes the memory of
        one (pages the process holds already: filling a new block's 50 MB of Atari rows
        took 2-4 times as long in fresh pages, each faulted in on first write)."""
        for block in blocks:
            if not self._ragged and block.values.keys() == self._element_shapes.keys():
                self._spare = block.values

    def _new_block(self, index: int) -> Block:
        n = self.block_rows
        # Zeros, as ragged leaves' padding must be (other leaves: only rows marked dirty
        # are ever read or written).
        values, self._spare = self._spare, None
        if values is None:
            # (Large ones are mappings of their own: given back whole once let go.)
            values = {
                key: zeros((n, *shape), self._dtypes[key])
                for key, shape in self._element_shapes.items()
            }
        dirty = np.zeros(n, dtype=bool)
        block = Block(
            index=index, values=values, dirty=dirty, length=self._block_rows_in_array(index)
        )
        self._blocks[index] = block
        return block

    def stage(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, force: bool = False
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Stage what belongs in RAM (everything, with ``force``).

        ``rows`` is sorted and unique, ``values[key][i]`` belongs to ``rows[i]``.

        Returns:
            The ranges of positions (into ``rows``) that were *not* staged and must be
            written directly (whole blocks, and scattered rows of blocks not in RAM), and
            the indices of blocks that became full.
        """
        if not rows.size:
            return [], []
        block_ids = rows // self.block_rows
        # Boundaries of the runs of equal block ids (rows are sorted).
        starts = np.flatnonzero(np.diff(block_ids, prepend=-1))
        stops = np.append(starts[1:], rows.size)
        direct: list[tuple[int, int]] = []
        full: list[int] = []
        for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
            index = int(block_ids[start])
            offsets = rows[start:stop] - index * self.block_rows
            block = self._blocks.get(index)
            contiguous = offsets[-1] - offsets[0] + 1 == offsets.size
            whole = (
                contiguous and offsets[0] == 0 and offsets.size == self._block_rows_in_array(index)
            )
            if block is None and (whole or not contiguous) and not force:
                # A whole block needs no staging; scattered rows are not worth a block.
                direct.append((start, stop))
                continue
            new = block is None
            if block is None:
                block = self._new_block(index)
            try:
                self._put_rows(block, offsets, {k: t[start:stop] for k, t in values.items()})
            except BaseException:
                if new:  # (a block that holds no row: not left here)
                    self.reuse([self._blocks.pop(index)])
                raise
            block.dirty[offsets] = True
            if block.full:
                full.append(index)
        return direct, full

    def patch(self, rows: np.ndarray, values: Mapping[Key, torch.Tensor]) -> np.ndarray:
        """Write some keys of rows held in RAM there (``rows`` sorted and unique).

        Returns:
            A mask over ``rows``: which were held in RAM and took the new values. No block is
            created: the other keys of a row that is not held would be unknown.
        """
        hit, served = self.staged_rows(rows)
        for block, positions in served:
            picked = torch.from_numpy(positions)
            self._put_rows(
                block,
                rows[positions] - block.index * self.block_rows,
                {key: tensor[picked] for key, tensor in values.items()},
            )
        return hit

    def take_restored(self) -> np.ndarray:
        """The rows whose values a copy interrupted between two keys put back since the
        last call: they hold their values from before the write that failed, not its."""
        restored, self._restored = self._restored, []
        return np.concatenate(restored) if restored else np.empty(0, dtype=np.int64)

    def _put_rows(
        self, block: Block, offsets: np.ndarray, values: Mapping[Key, torch.Tensor]
    ) -> None:
        """Put ``values`` (of some keys) into rows ``offsets`` of ``block``, whole or not at
        all: interrupted after a key, rows the block held get back the values they held
        (copied first), and the others stop being held here."""
        positions = torch.from_numpy(offsets)
        held = block.dirty[offsets]
        again = positions[torch.from_numpy(held)]
        before = {key: block.values[key][again].clone() for key in values} if again.numel() else {}
        put: list[Key] = []
        try:
            for key, tensor in values.items():
                put.append(key)
                self._put(block, key, positions, tensor)
        except BaseException:
            block.dirty[offsets] = False  # (torn until their values are back)
            if before:
                for key in put:
                    self._put(block, key, again, before[key])
                block.dirty[offsets[held]] = True
                self._restored.append(block.index * self.block_rows + offsets[held])
            raise

    def _put(self, block: Block, key: Key, offsets: torch.Tensor, values: torch.Tensor) -> None:
        """``block.values[key][offsets] = values``; ragged rows padded with zeros to the
        block's width, which grows to the width of ``values``."""
        target = block.values[key]
        if key not in self._ragged:
            if is_run(offsets.numpy()):
                first = int(offsets[0])
                target[first : first + offsets.numel()] = values  # a run of rows: one copy
            else:
                target[offsets] = values
            return
        width = values.shape[1]
        if width > target.shape[1]:
            wider = target.new_zeros((target.shape[0], width, *target.shape[2:]))
            wider[:, : target.shape[1]] = target
            block.values[key] = target = wider
        target[offsets, :width] = values
        target[offsets, width:] = 0

    def add_key(
        self,
        key: Key,
        element_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        ragged: bool = False,
    ) -> None:
        """A new leaf: held rows read as zeros in it until written. Each patch takes the
        zeros of its rows (rows kept only there may never have been written to disk), so
        that they land with the patch, in its place in the order."""
        self._element_shapes[key] = element_shape
        self._dtypes[key] = dtype
        self._spare = None
        if ragged:
            self._ragged.add(key)
        for block in self._blocks.values():
            block.values[key] = torch.zeros((self.block_rows, *element_shape), dtype=dtype)
        self._patches = [
            (rows, {**values, key: torch.zeros((rows.size, *element_shape), dtype=dtype)})
            for rows, values in self._patches
        ]

    def staged_rows(self, rows: np.ndarray) -> tuple[np.ndarray, list[tuple[Block, np.ndarray]]]:
        """Which of ``rows`` (any order, repeats allowed) are held in RAM.

        Returns:
            A boolean mask over ``rows``, and for each block involved the block with
            the positions (into ``rows``) it serves.
        """
        hit = np.zeros(rows.size, dtype=bool)
        served: list[tuple[Block, np.ndarray]] = []
        if not self._blocks and self._writing is None:
            return hit, served
        block_ids = rows // self.block_rows
        for block in self.held():
            index = block.index
            positions = np.flatnonzero(block_ids == index)
            if not positions.size:
                continue
            offsets = rows[positions] - index * self.block_rows
            positions = positions[block.dirty[offsets]]
            if positions.size:
                hit[positions] = True
                served.append((block, positions))
        return hit, served


def without_cells(writes: Sequence[Write], rows: np.ndarray, keys: Iterable[Key]) -> list[Write]:
    """``writes`` without the cells of ``keys`` in ``rows`` (a newer write holds them)."""
    keys = set(keys)
    out: list[Write] = []
    for written, values in writes:
        kept = ~np.isin(written, rows)
        index = torch.from_numpy(np.flatnonzero(kept))
        covered = {key: value[index] for key, value in values.items() if key in keys}
        others = {key: value for key, value in values.items() if key not in keys}
        if covered and kept.any():
            out.append((written[kept], covered))
        if others:
            out.append((written, others))
    return out
