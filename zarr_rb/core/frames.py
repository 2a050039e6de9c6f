"""A writer's frames in RAM, each kept once: the frame-aware RAM tier.

Image observations stacked over time (``obs`` of ``[4, 84, 84]``: the last four frames)
share frames from row to row, and ``("next", "obs")`` of a row is ``obs`` of the next one.
The tier keeps each frame once, in a pool, and per row the ids of the frames its stacks are
made of; a batch is rebuilt with one ``index_select`` per key, bit for bit as written.
Sharing is found by comparing exactly what is written (:mod:`zarr_rb.core.frame_plans`), so
a row that fits no pattern takes more room, and is never rebuilt wrong. See
``docs/design/ram-tier.md``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from zarr_rb.core.frame_plans import (
    FrameKeys,
    KnownFrames,
    Plan,
    copy_frames,
    frame_bytes,
    plan_frames,
)
from zarr_rb.core.mirror import zeros
from zarr_rb.util.keys import Key

_ID_BYTES = 4
"""Bytes of one frame id (``int32``)."""
_EVICT_AT_LEAST = 64
"""Rows evicted at once when the tier is full (amortises the search for the oldest)."""


class _Pool:
    """Frames of one :class:`FrameKeys`, ``capacity`` at most, with how many ids name each."""

    def __init__(self, spec: FrameKeys, capacity: int) -> None:
        self.capacity = capacity
        self.frames = zeros((capacity, *spec.frame_shape), spec.dtype)
        self.frame_bytes: np.ndarray = frame_bytes(self.frames)
        """``frames`` as ``[capacity, frame_nbytes]`` bytes (the same memory)."""
        self.refs = zeros((capacity,), torch.int32).numpy()
        self._free = np.empty(capacity, dtype=np.int32)
        self._top = 0
        """Frames freed, ``_free[:_top]``, taken again before new ones."""
        self.touched = 0
        """Frames ``[0, touched)`` were ever used: the pool's pages the OS gave."""

    @property
    def available(self) -> int:
        return self._top + self.capacity - self.touched

    @property
    def used(self) -> int:
        return self.touched - self._top

    def take(self, count: int) -> np.ndarray:
        """``count`` frame ids no row names (``count <= available``)."""
        reused = min(count, self._top)
        ids = np.empty(count, dtype=np.int32)
        ids[:reused] = self._free[self._top - reused : self._top]
        self._top -= reused
        fresh = count - reused
        ids[reused:] = np.arange(self.touched, self.touched + fresh, dtype=np.int32)
        self.touched += fresh
        return ids

    def hold(self, ids: np.ndarray) -> None:
        np.add.at(self.refs, ids.ravel(), 1)

    def let_go(self, ids: np.ndarray) -> None:
        """Ids no longer named by a row; frames no id names any more are freed."""
        if not ids.size:
            return
        flat = ids.ravel()
        np.add.at(self.refs, flat, -1)
        candidates = np.unique(flat)
        freed = candidates[self.refs[candidates] == 0]
        self._free[self._top : self._top + freed.size] = freed
        self._top += freed.size

    def free_ids(self) -> np.ndarray:
        return self._free[: self._top]


class FrameTier:
    """The frames of the leaves ``specs`` for ``rows`` rows, in ``budget`` bytes at most.

    A row is ``resident`` when its frames are in the tier. Rows are admitted as this writer
    writes them; past the budget the rows admitted first are evicted (a ring samples every
    row alike, and reads of rows not resident go to the store, at its usual cost).
    """

    def __init__(self, specs: Sequence[FrameKeys], *, rows: int, budget: int) -> None:
        self.specs = tuple(specs)
        self.rows = rows
        self.budget = budget
        self.keys: frozenset[Key] = frozenset(key for spec in self.specs for key in spec.keys)
        self._spec_of = {key: spec for spec in self.specs for key in spec.keys}
        total = sum(spec.frame_nbytes * spec.slots_per_row for spec in self.specs) or 1
        self._pools: dict[Key, _Pool] = {}
        self._ids: dict[Key, np.ndarray] = {}
        for spec in self.specs:
            share = budget * spec.frame_nbytes * spec.slots_per_row // total
            ids_bytes = rows * spec.slots_per_row * _ID_BYTES
            frames = max(0, share - ids_bytes) // spec.frame_nbytes
            capacity = int(min(frames, rows * spec.slots_per_row))
            self._pools[spec.key] = _Pool(spec, capacity)
            for key in spec.keys:
                shape = (rows, spec.lanes, spec.stack)
                self._ids[key] = zeros(shape, torch.int32).numpy() if capacity else np.empty(0)
        self.resident = np.zeros(rows, dtype=bool)
        self._stamps = np.zeros(rows, dtype=np.int64)
        self._clock = 0
        self._admitted: collections.deque[tuple[np.ndarray, int]] = collections.deque()
        """Rows in the order they were admitted, with their stamp then (entries whose row
        was released or admitted again since are skipped, and dropped now and then: see
        :meth:`_note`)."""
        self._compact_at = _EVICT_AT_LEAST
        """Entries of ``_admitted`` past which those no longer live are dropped."""
        self._last: int | None = None
        """The row admitted last: the next write's rows may continue it."""
        self.before_release: Callable[[np.ndarray], None] | None = None
        """Called with resident rows (sorted, unique) before they stop being resident, while
        their frames can still be gathered: the write buffer copies there the frames of the
        rows it left to the tier (:meth:`~zarr_rb.core.write_cache.WriteBuffer.keep_frames`).
        If it raises, the rows stay resident."""

    @property
    def capacity(self) -> int:
        """Frames the tier may hold, over its pools; 0 when one of them can hold none (a row
        needs frames in every pool: none could be admitted)."""
        capacities = [pool.capacity for pool in self._pools.values()]
        return sum(capacities) if min(capacities, default=0) else 0

    @property
    def nbytes(self) -> int:
        """RAM the tier holds: the frames it used so far and the ids of every row."""
        return sum(
            pool.touched * spec.frame_nbytes + self.rows * spec.slots_per_row * _ID_BYTES
            for spec, pool in zip(self.specs, self._pools.values(), strict=True)
        )

    @property
    def frames_nbytes(self) -> int:
        """RAM of the frames the tier used so far (pages touched), without the ids."""
        return sum(
            pool.touched * spec.frame_nbytes
            for spec, pool in zip(self.specs, self._pools.values(), strict=True)
        )

    def room_rows(self) -> int:
        """About how many more rows fit without evicting: each pool's free frames over the
        frames a resident row takes there on average (one, while no row is resident)."""
        held = int(self.resident.sum())
        return min(
            pool.available // (max(1, -(-pool.used // held)) if held else 1)
            for pool in self._pools.values()
        )

    def resident_rows(self, rows: np.ndarray) -> np.ndarray:
        held: np.ndarray = self.resident[rows]
        return held

    def gather(self, key: Key, rows: np.ndarray) -> torch.Tensor:
        """Rows (all resident) of ``key``, rebuilt from their frames."""
        spec = self._spec_of[key]
        out = torch.empty((rows.size, *spec.element_shape), dtype=spec.dtype)
        self.gather_into(key, rows, out)
        return out

    def gather_into(self, key: Key, rows: np.ndarray, out: torch.Tensor) -> None:
        """:meth:`gather` into ``out``: ``rows.size`` contiguous rows of ``key``'s shape and
        dtype (no tensor in between)."""
        spec = self._spec_of[key]
        ids = torch.from_numpy(self._ids[key][rows].reshape(-1))
        frames = self._pools[spec.key].frames
        torch.index_select(frames, 0, ids, out=out.view(-1, *spec.frame_shape))

    def known(self, key: Key, rows: np.ndarray) -> KnownFrames:
        """The frames of ``rows`` (unique) of the leaf of ``key`` and its twin, as held here
        (see :class:`~zarr_rb.core.frame_plans.KnownFrames`)."""
        spec = self._spec_of[key]
        inside = rows < self.rows
        known = np.zeros(rows.size, dtype=bool)
        known[inside] = self.resident[rows[inside]]
        ids = {
            k: self._ids[k][np.where(inside, rows, 0)] if self._ids[k].size else np.empty(0)
            for k in spec.keys
        }
        if not all(value.size for value in ids.values()):
            known[:] = False
        return KnownFrames(known, ids, self._pools[spec.key].frame_bytes)

    # --- writes ----------------------------------------------------------------------------

    def put(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, older: bool = False
    ) -> bool:
        """Rows (unique) this writer wrote, with their values: admitted when every kept leaf
        is among ``values`` and they fit, otherwise no longer resident; whether admitted.

        ``older``: rows older than every resident row (a fill from the store, newest first):
        admitted only where they fit without evicting, and evicted before the others.

        A put that fails leaves the rows it was given with frames out of the tier: they are
        read from where their new values are, never as their old frames.
        """
        try:
            return self._put(rows, values, older=older)
        except BaseException:
            if self.keys & values.keys():
                self.release(rows)
            raise

    def _put(
        self, rows: np.ndarray, values: Mapping[Key, torch.Tensor], *, older: bool = False
    ) -> bool:
        if not rows.size or not self.keys:
            return False
        written = self.keys & values.keys()
        if not written:
            return bool(self.resident[rows].all())  # other keys: the frames stand
        if written != self.keys:
            self.release(rows)  # some frames changed, their twins not given: read from disk
            return False
        last = None if older or self._last is None or not self.resident[self._last] else self._last
        plans = {
            spec.key: plan_frames(spec, values, self._frames_of(spec, last)) for spec in self.specs
        }
        needed = {key: plan.fresh_count for key, plan in plans.items()}
        room = min(self._pools[key].capacity / max(1, count) for key, count in needed.items())
        if room < 1:
            # More frames than the tier holds: its newest rows that fit, if any.
            self.release(rows)
            keep = int(rows.size * room * 0.9)
            if not keep:
                return False
            newest = {key: values[key][-keep:] for key in self.keys}
            return self._put(rows[-keep:], newest, older=older)
        pins = {spec.key: self._ids_of(spec, last) for spec in self.specs}
        for key, ids in pins.items():
            self._pools[key].hold(ids)  # the last row's frames stay while they are linked to
        try:
            self.release(rows)
            admitted = (
                all(count <= self._pools[key].available for key, count in needed.items())
                if older
                else self._make_room(needed)
            )
            if admitted:
                for spec in self.specs:
                    self._admit(spec, rows, values, plans[spec.key], pins[spec.key])
        finally:
            for key, ids in pins.items():
                self._pools[key].let_go(ids)
        if admitted:
            self.resident[rows] = True
            self._clock += 1
            self._stamps[rows] = self._clock
            self._note(rows, older=older)
            if not older:
                self._last = int(rows[-1])
        return admitted

    def _note(self, rows: np.ndarray, *, older: bool) -> None:
        """Rows just admitted, in ``_admitted``. Entries of rows written over since are only
        skipped at eviction, and a tier that never evicts would keep one per write for ever:
        past ``_compact_at`` entries, those with no live row go (amortised: the next
        compaction waits for twice the entries left)."""
        entry = (rows.copy(), self._clock)
        if older:
            self._admitted.appendleft(entry)
        else:
            self._admitted.append(entry)
        if len(self._admitted) > self._compact_at:
            kept: collections.deque[tuple[np.ndarray, int]] = collections.deque()
            for held, stamp in self._admitted:
                live = held[self.resident[held] & (self._stamps[held] == stamp)]
                if live.size:
                    kept.append((live, stamp))
            self._admitted = kept
            self._compact_at = max(_EVICT_AT_LEAST, 2 * len(kept))

    def release(self, rows: np.ndarray) -> None:
        """Rows no longer resident (written over, withdrawn, changed by another writer)."""
        rows = np.unique(rows[self.resident[rows]])
        if not rows.size:
            return
        if self.before_release is not None:
            self.before_release(rows)
        self.resident[rows] = False
        for spec in self.specs:
            pool = self._pools[spec.key]
            for key in spec.keys:
                pool.let_go(self._ids[key][rows])

    def clear(self) -> None:
        """No row resident (``empty``, a save loaded)."""
        self.release(np.flatnonzero(self.resident))
        self._admitted.clear()
        self._compact_at = _EVICT_AT_LEAST
        self._last = None

    def _frames_of(self, spec: FrameKeys, row: int | None) -> dict[Key, torch.Tensor] | None:
        if row is None:
            return None
        return {key: self.gather(key, np.array([row])) for key in spec.keys}

    def _ids_of(self, spec: FrameKeys, row: int | None) -> np.ndarray:
        if row is None:
            return np.empty(0, dtype=np.int32)
        return np.concatenate([self._ids[key][row].ravel() for key in spec.keys])

    def _make_room(self, needed: Mapping[Key, int]) -> bool:
        """Evict the rows admitted first until each pool has the frames ``needed``; False
        when a pool cannot hold them at all."""
        pools = self._pools
        if any(count > pools[key].capacity for key, count in needed.items()):
            return False
        while True:
            short = max(count - pools[key].available for key, count in needed.items())
            if short <= 0:
                return True
            held = int(self.resident.sum())
            per_row = max(1, max(pool.used for pool in pools.values()) // max(1, held))
            if not self._evict_oldest(max(-(-short // per_row), _EVICT_AT_LEAST)):
                return False  # only the pinned frames are left

    def _evict_oldest(self, count: int) -> bool:
        """Release up to ``count`` rows, those admitted first; False when none is left."""
        picked: list[tuple[np.ndarray, int]] = []
        found = 0
        while self._admitted and found < count:
            rows, stamp = self._admitted.popleft()
            live = rows[self.resident[rows] & (self._stamps[rows] == stamp)]
            if live.size > count - found:
                self._admitted.appendleft((live[count - found :], stamp))
                live = live[: count - found]
            picked.append((live, stamp))
            found += live.size
        if not found:
            return False
        try:
            self.release(np.concatenate([rows for rows, _ in picked]))
        except BaseException:
            # (Interrupted before the rows went, in the write buffer's copy of their frames:
            # they stay resident, and the first to be evicted.)
            self._admitted.extendleft(reversed(picked))
            raise
        return True

    def _admit(
        self,
        spec: FrameKeys,
        rows: np.ndarray,
        values: Mapping[Key, torch.Tensor],
        plan: Plan,
        pinned: np.ndarray,
    ) -> None:
        pool = self._pools[spec.key]
        fresh = pool.take(plan.fresh_count)
        slot_ids = np.empty(plan.links.size, dtype=np.int32)
        slot_ids[plan.fresh_slots] = fresh
        slot_ids[plan.links.size - pinned.size :] = pinned
        slot_ids = slot_ids[plan.links]  # every slot takes the id of the slot it links to
        per_key = plan.slots_per_key
        for i, key in enumerate(spec.keys):
            source = values[key].reshape(-1, *spec.frame_shape)
            chosen = plan.fresh_slots[
                (plan.fresh_slots >= i * per_key) & (plan.fresh_slots < (i + 1) * per_key)
            ]
            if chosen.size:
                # (Copied by numpy, as bytes: torch's index_copy_ takes 5 times as long, and
                # its threads spin on the cores that encode the rows for the disk.)
                picked = chosen - i * per_key
                if source.dtype == spec.dtype:
                    copy_frames(pool.frame_bytes, slot_ids[chosen], frame_bytes(source), picked)
                else:
                    taken = frame_bytes(
                        source.index_select(0, torch.from_numpy(picked)).to(spec.dtype)
                    )
                    pool.frame_bytes[slot_ids[chosen]] = taken
            ids = slot_ids[i * per_key : (i + 1) * per_key].reshape(
                rows.size, spec.lanes, spec.stack
            )
            self._ids[key][rows] = ids
            pool.hold(ids)

    # --- checks ----------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the tier's invariants (for tests): each frame's count is the number of ids
        of resident rows naming it, and the free frames are those no id names."""
        rows = np.flatnonzero(self.resident)
        for spec in self.specs:
            pool = self._pools[spec.key]
            named = np.concatenate([self._ids[key][rows].ravel() for key in spec.keys])
            counts = np.bincount(named, minlength=pool.touched)[: pool.touched]
            assert named.size == 0 or int(named.max()) < pool.touched, "an id past the pool"
            assert np.array_equal(counts, pool.refs[: pool.touched]), "frame counts drifted"
            free = pool.free_ids()
            assert np.unique(free).size == free.size, "a frame freed twice"
            assert not pool.refs[free].any(), "a named frame is free"
            assert free.size == int((counts == 0).sum()), "an unnamed frame is not free"
