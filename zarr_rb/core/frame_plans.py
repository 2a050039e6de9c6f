"""Which leaves a writer keeps by frame, and which frames of a write are new.

Image observations stacked over time (``obs`` of ``[4, 84, 84]``: the last four frames)
share frames from row to row, and ``("next", "obs")`` of a row is ``obs`` of the next one.
:func:`plan_frames` finds, by exact comparison of bytes, which frames of a write repeat a
frame written before it (in the write, or the row given before it) and which are new: a
row that fits no pattern gets new frames, never a wrong one. The RAM tier
(:mod:`zarr_rb.core.frames`) and the frames on disk (:mod:`zarr_rb.core.frame_cells`) keep
each new frame once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from zarr_rb.core.dtypes import TORCH_DTYPES
from zarr_rb.engine.layout import leaf_row_nbytes
from zarr_rb.engine.rows import is_run
from zarr_rb.format.schema import FrameLeaf, LeafSpec, Schema, leaves_by_key
from zarr_rb.util.keys import Key


@dataclasses.dataclass(frozen=True, slots=True)
class FrameKeys:
    """A leaf the tier keeps and its ``("next", ...)`` twin when the store has one."""

    key: Key
    next_key: Key | None
    element_shape: tuple[int, ...]
    """One row of the leaf: the storage's trailing batch dimensions, then the leaf's."""
    lanes: int
    """Elements per row (the product of the storage's trailing batch dimensions)."""
    stack: int
    """Frames per element: the first dimension of a stack of images, else 1."""
    frame_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def keys(self) -> tuple[Key, ...]:
        return (self.key,) if self.next_key is None else (self.key, self.next_key)

    @property
    def frame_nbytes(self) -> int:
        return math.prod(self.frame_shape) * self.dtype.itemsize

    @property
    def slots_per_row(self) -> int:
        """Frame ids one row holds, over both keys."""
        return self.lanes * self.stack * len(self.keys)


def frame_keys(
    leaves: Sequence[LeafSpec], batch_shape: tuple[int, ...], large_row_bytes: int
) -> list[FrameKeys]:
    """The tier's leaves among a schema's: fixed-shape tensors of ``large_row_bytes`` per
    row or more, each with its ``("next", ...)`` twin (same shape and dtype) if there is one.

    A leaf whose shape is ``[S, *frame]`` with ``S`` smaller than each frame dimension (a
    stack of ``S`` images, ``[4, 84, 84]``) is kept by frame; any other, by element.
    """
    large = {
        leaf.key: leaf
        for leaf in leaves
        if leaf.value == "tensor" and leaf_row_nbytes(leaf, batch_shape) >= large_row_bytes
    }
    lanes = math.prod(batch_shape[1:])
    out = []
    for key, leaf in large.items():
        if key[:1] == ("next",) and key[1:] in large and _twins(large[key[1:]], leaf):
            continue  # kept with its twin
        twin = large.get(("next", *key))
        next_key = twin.key if twin is not None and _twins(leaf, twin) else None
        shape = leaf.shape
        stacked = len(shape) >= 3 and shape[0] < min(shape[1:])
        out.append(
            FrameKeys(
                key=key,
                next_key=next_key,
                element_shape=(*batch_shape[1:], *shape),
                lanes=lanes,
                stack=shape[0] if stacked else 1,
                frame_shape=shape[1:] if stacked else shape,
                dtype=TORCH_DTYPES[leaf.dtype],
            )
        )
    return out


def frame_leaves(
    leaves: Sequence[LeafSpec],
    batch_shape: tuple[int, ...],
    large_row_bytes: int,
    setting: bool | None,
    samples: Mapping[Key, torch.Tensor] | None = None,
) -> tuple[FrameLeaf, ...]:
    """The leaves a store stores as frames, as its schema records them, by its setting
    (``Compression.frames``): none with ``False``; with ``True``, every leaf
    :func:`frame_keys` gives; with ``None``, those of them that share frames: a stack of
    images, or a leaf with a ``("next", ...)`` twin, whose first rows written (``samples``,
    when two or more) link a frame to another (:func:`links_frames`)."""
    if setting is False:
        return ()
    specs = frame_keys(leaves, batch_shape, large_row_bytes)
    if setting is None:
        specs = [
            spec
            for spec in specs
            if (spec.stack > 1 or spec.next_key is not None) and links_frames(spec, samples)
        ]
    return tuple(
        FrameLeaf(key=spec.key, next_key=spec.next_key, stack=spec.stack) for spec in specs
    )


LINK_SAMPLE_ROWS = 64
"""Rows of a first write that :func:`links_frames` compares, at most."""


def links_frames(spec: FrameKeys, samples: Mapping[Key, torch.Tensor] | None) -> bool:
    """Whether the first rows written of ``spec``'s leaf (``samples``, in the order written)
    link any frame to a frame before it, as the RAM tier plans them (:func:`plan_frames`: a
    stack shifting by a frame, a twin one row ahead). Of fewer than two rows, or rows not
    given, the leaf's shape alone decides: true. (A share would mislead: a first write of
    one Atari row links 3 of its 8 frames, of a vector state with its twin none.)"""
    if samples is None or any(key not in samples for key in spec.keys):
        return True
    rows = min(LINK_SAMPLE_ROWS, *(samples[key].shape[0] for key in spec.keys))
    if rows < 2:
        return True
    first = {key: samples[key][:rows].reshape(rows, *spec.element_shape) for key in spec.keys}
    plan = plan_frames(spec, first, None)
    return plan.fresh_count < plan.slots_per_key * len(spec.keys)


def stored_frame_keys(schema: Schema) -> list[FrameKeys]:
    """The leaves ``schema`` records as stored as frames (:attr:`Schema.frames`)."""
    leaves = leaves_by_key(schema.leaves)
    lanes = math.prod(schema.batch_shape[1:])
    out = []
    for stored in schema.frames:
        shape = leaves[stored.key].shape
        out.append(
            FrameKeys(
                key=stored.key,
                next_key=stored.next_key,
                element_shape=(*schema.batch_shape[1:], *shape),
                lanes=lanes,
                stack=stored.stack,
                frame_shape=shape[1:] if stored.stack > 1 else shape,
                dtype=TORCH_DTYPES[leaves[stored.key].dtype],
            )
        )
    return out


def _twins(a: LeafSpec, b: LeafSpec) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """How the frame slots of a write take their ids.

    Slots are numbered key by key (``key``, then ``("next", key)``), row by row, lane by
    lane, frame by frame, then the last row's slots follow (they hold its ids). ``links[s]``
    is the slot whose id slot ``s`` takes: itself for a new frame or one of the last row's.
    """

    links: np.ndarray
    fresh_slots: np.ndarray
    slots_per_key: int

    @property
    def fresh_count(self) -> int:
        return int(self.fresh_slots.size)


def plan_frames(
    spec: FrameKeys, values: Mapping[Key, torch.Tensor], last: dict[Key, torch.Tensor] | None
) -> Plan:
    """Which frames of a write are new, and which repeat a frame of the write or of the
    last row admitted (``last``: its values), found by exact comparison.

    For row ``k`` and lane ``e`` (``p``: the row before, in the write or the last one):
    ``obs[k]`` is ``next[p]`` whole, or continues ``obs[p]`` (its first ``S - 1`` frames are
    the last ``S - 1`` of ``obs[p]``); ``next[k]`` continues ``obs[k]``. Anything else is new.
    """
    stack, lanes = spec.stack, spec.lanes
    obs = values[spec.key].reshape(-1, lanes, stack, math.prod(spec.frame_shape))
    nxt = values[spec.next_key].reshape(obs.shape) if spec.next_key is not None else None
    n = obs.shape[0]
    per_key = n * lanes * stack
    keys = len(spec.keys)
    base = keys * per_key  # the last row's slots
    links = np.arange(base + (keys * lanes * stack if last is not None else 0))
    grid = np.arange(per_key).reshape(n, lanes, stack)
    # The slots of the row before each row (in the write, or the last row): obs, next.
    before = np.empty((n, lanes, stack), dtype=np.int64)
    before[1:] = grid[:-1]
    before_next = before + per_key
    if last is not None:
        before[0] = base + np.arange(lanes * stack).reshape(lanes, stack)
        before_next[0] = before[0] + lanes * stack
        last_obs = last[spec.key].reshape(1, lanes, stack, -1)
    whole = np.zeros((n, lanes), dtype=bool)
    if nxt is not None and spec.next_key is not None:
        # obs[k] == next[k - 1]: every frame of obs[k] is one of next[k - 1].
        whole[1:] = _same(obs[1:], nxt[:-1])
        if last is not None:
            whole[0] = _same(obs[:1], last[spec.next_key].reshape(1, lanes, stack, -1))[0]
        rows_w, lanes_w = np.nonzero(whole)
        links[grid[rows_w, lanes_w]] = before_next[rows_w, lanes_w]
    shifted = np.zeros((n, lanes), dtype=bool)
    if stack > 1:
        # Only where obs[k] is not next[k - 1] whole (a write's first row, a reset).
        rest = ~whole
        later = np.flatnonzero(rest[1:].any(1)) + 1
        if later.size:
            picked = torch.from_numpy(later)
            shifted[later] = rest[later] & _same(
                obs.index_select(0, picked)[:, :, :-1], obs.index_select(0, picked - 1)[:, :, 1:]
            )
        if last is not None and rest[0].any():
            shifted[0] = rest[0] & _same(obs[:1, :, :-1], last_obs[:, :, 1:])[0]
        rows_s, lanes_s = np.nonzero(shifted)
        links[grid[rows_s, lanes_s, :-1]] = before[rows_s, lanes_s, 1:]
    if nxt is not None and stack > 1:
        # next[k] continues obs[k]: its first S - 1 frames are the last S - 1 of obs[k].
        cont = _same(nxt[:, :, :-1], obs[:, :, 1:])
        rows_c, lanes_c = np.nonzero(cont)
        links[grid[rows_c, lanes_c, :-1] + per_key] = grid[rows_c, lanes_c, 1:]
    links = _resolve(links)
    fresh = np.flatnonzero(links[:base] == np.arange(base))
    return Plan(links=links, fresh_slots=fresh, slots_per_key=per_key)


@dataclasses.dataclass(frozen=True, slots=True)
class KnownFrames:
    """The frames of a write's rows as the RAM tier holds them, each once: the plan the
    tier made of them when they were written (:meth:`~zarr_rb.core.frames.FrameTier.known`).
    """

    known: np.ndarray
    """Per row, whether its ids below are those of the values written last (the row is
    resident in the tier)."""
    ids: Mapping[Key, np.ndarray]
    """Per key, ``[rows, lanes, stack]``: the frame each slot holds, as rows of
    :attr:`frames`."""
    frames: np.ndarray
    """The tier's frames, ``[frames, frame_nbytes]`` bytes."""

    def part(self, start: int, stop: int) -> KnownFrames:
        """The rows ``[start, stop)`` of the write."""
        ids = {key: value[start:stop] for key, value in self.ids.items()}
        return KnownFrames(self.known[start:stop], ids, self.frames)


def cells_from_ids(known: KnownFrames, keys: Sequence[Key]) -> tuple[np.ndarray, np.ndarray]:
    """The cells of rows whose frames are all :attr:`KnownFrames.known`, without comparing
    them again: each frame the rows name, once, in the order first named. Returns the
    frames of the cells (rows of :attr:`KnownFrames.frames`) and, per slot (numbered as
    :class:`Plan`'s, without the last row's), the cell it takes."""
    named = np.concatenate([known.ids[key].reshape(-1) for key in keys])
    frames, first, inverse = np.unique(named, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    cell_of = np.empty(order.size, dtype=np.int64)
    cell_of[order] = np.arange(order.size)
    return frames[order], cell_of[inverse.reshape(-1)]


def _resolve(links: np.ndarray) -> np.ndarray:
    """Follow the links to their ends (pointer jumping: a chain of length ``m`` takes
    ``log2(m)`` passes)."""
    while True:
        jumped = links[links]
        if np.array_equal(jumped, links):
            return links
        links = jumped


def _same(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Whether ``a[k, e]`` and ``b[k, e]`` hold the same bytes, for every row and lane (bytes,
    not values: ``-0.0`` is not ``0.0``, and a NaN equals itself).

    Compared by numpy, on one core: torch's kernels would take the other core too, and spin
    there after each one, while it encodes the rows for the disk.
    """
    if not a.numel():
        return np.zeros(a.shape[:2], dtype=bool)
    words_a, words_b = _words(a), _words(b)
    if words_a.shape[-1] <= 2 * _HEAD:
        same: np.ndarray = (words_a == words_b).all(-1)
        return same
    # The heads first: frames that differ (another episode, frames no codec shrinks)
    # mostly differ there, and are not read whole.
    same = (words_a[..., :_HEAD] == words_b[..., :_HEAD]).all(-1)
    rows, lanes = same.nonzero()
    if rows.size > same.size // 2:
        same &= (words_a == words_b).all(-1)
    elif rows.size:
        same[rows, lanes] = (words_a[rows, lanes] == words_b[rows, lanes]).all(-1)
    return same


_HEAD = 16
"""Words of each frame compared before the whole frames (:func:`_same`)."""


def _words(t: torch.Tensor) -> np.ndarray:
    """``t`` as ``[rows, lanes, words]`` of its bytes: 8 at a time where they line up."""
    words = _bytes_of(t.reshape(*t.shape[:2], -1))
    if words.shape[-1] % 8 == 0:
        if words.strides[-1] != 1:
            # Frames of 1-byte values every other byte, say: bytes that line up, a copy.
            words = np.ascontiguousarray(words)
        return words.view(np.int64)  # (numpy reads words that do not start on 8 bytes too)
    return words


def copy_frames(
    frame_bytes: np.ndarray, ids: np.ndarray, source: np.ndarray, picked: np.ndarray
) -> None:
    """``frame_bytes[ids] = source[picked]``, in one copy where ``ids`` or ``picked`` is a
    run (a pool's new frames are, and all of a write's frames where none repeats: a slice
    of each instead of a gather into a temporary, then a scatter; 3.6 times as fast on
    57 MB of frames)."""
    if is_run(ids):
        out = frame_bytes[int(ids[0]) : int(ids[0]) + ids.size]
        if is_run(picked):
            out[...] = source[int(picked[0]) : int(picked[0]) + picked.size]
        else:
            np.take(source, picked, axis=0, out=out, mode="clip")  # (clip: unbuffered)
    elif is_run(picked):
        frame_bytes[ids] = source[int(picked[0]) : int(picked[0]) + picked.size]
    else:
        frame_bytes[ids] = source[picked]


def frame_bytes(frames: torch.Tensor) -> np.ndarray:
    """``frames`` (``[n, *frame]``) as ``[n, frame_nbytes]`` bytes: the same memory where
    it can be, else a copy."""
    return _bytes_of(frames.reshape(frames.shape[0], math.prod(frames.shape[1:])))


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """``t``'s elements as bytes along its last dimension, in numpy: the same memory where
    it can be, else a copy."""
    try:
        raw = t.view(torch.uint8)
    except RuntimeError:
        raw = t.contiguous().view(torch.uint8)
    out: np.ndarray = raw.numpy()
    return out
