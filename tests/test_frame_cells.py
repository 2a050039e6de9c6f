"""Frames on disk, each once per block (zarr_rb.core.frame_cells): rows read back bit for bit,
cells a row may name are never written again in place, and the marks survive a reopen."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from zarr_rb.core.frame_cells import FrameCells, RegionFullError, cell_layouts
from zarr_rb.core.frame_plans import FrameKeys
from zarr_rb.core.frames import FrameTier
from zarr_rb.engine.layout import Compression
from zarr_rb.engine.tensorstore import Engine
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.locations import open_location

OBS, NEXT = ("obs",), ("next", "obs")


def _spec(*, lanes: int = 1, stack: int = 4, frame=(6, 5), dtype=torch.uint8) -> FrameKeys:
    element = (lanes, stack, *frame) if lanes > 1 else (stack, *frame)
    return FrameKeys(
        key=OBS,
        next_key=NEXT,
        element_shape=element,
        lanes=lanes,
        stack=stack,
        frame_shape=frame,
        dtype=dtype,
    )


def _open(path, spec: FrameKeys, rows: int, block_rows: int, *, create: bool) -> FrameCells:
    engine = Engine(open_location(str(path)))
    cells_layout, ids_layout = cell_layouts(spec, rows, block_rows)
    dtype = str(torch.empty(0, dtype=spec.dtype).numpy().dtype)
    paths = {OBS: "frame_ids/obs", NEXT: "frame_ids/next/obs"}
    if create:
        compression = Compression()
        engine.create_array(
            "data/obs", layout=cells_layout, dtype=dtype, compression=compression, attributes={}
        )
        for where in paths.values():
            engine.create_array(
                where, layout=ids_layout, dtype="int32", compression=compression, attributes={}
            )
    cells = engine.open_array("data/obs", read_only=False)
    ids = {key: engine.open_array(where, read_only=False) for key, where in paths.items()}
    return FrameCells(spec, cells, ids, block_rows)


def _episodes(spec: FrameKeys, rows: int, seed: int, *, resets: int = 3) -> dict:
    """Transitions of a run of frames with ``resets`` episode starts: ``obs`` stacks the
    last ``S`` frames (a reset repeats its first frame), ``next`` is the stack after."""
    gen = torch.Generator().manual_seed(seed)
    lanes, stack = spec.lanes, spec.stack
    frames = torch.randint(0, 256, (rows + stack + 1, lanes, *spec.frame_shape), generator=gen)
    frames = frames.to(spec.dtype)
    starts = set(torch.randint(1, rows, (resets,), generator=gen).tolist())
    obs, nxt = [], []
    history: list[torch.Tensor] = []
    for t in range(rows + 1):
        restart = t == 0 or t in starts
        history = [frames[t]] * stack if restart else [*history[1:], frames[t]]
        obs.append(torch.stack(history, dim=1))  # [lanes, S, *frame]
    for t in range(rows):
        following = (
            obs[t + 1]
            if t + 1 not in starts
            else torch.stack([*obs[t].unbind(1)[1:], frames[-1]], 1)
        )
        nxt.append(following)
    shape = (rows, *spec.element_shape)
    return {OBS: torch.stack(obs[:rows]).reshape(shape), NEXT: torch.stack(nxt).reshape(shape)}


def _write(cells: FrameCells, rows: np.ndarray, values: dict) -> None:
    for _, future, _ in cells.start_write(rows, values):
        future.result()


def _check(cells: FrameCells, expected: dict, rows: np.ndarray) -> None:
    got = cells.read(rows, [OBS, NEXT])
    for key in (OBS, NEXT):
        want = expected[key][torch.from_numpy(rows)]
        assert torch.equal(got[key].view(torch.uint8), want.view(torch.uint8)), key


def test_rows_read_back_bit_for_bit_and_a_reopen_continues_a_block(tmp_path):
    spec, rows, block = _spec(), 64, 16
    values = _episodes(spec, rows, seed=1)
    cells = _open(tmp_path, spec, rows, block, create=True)
    # Extends of odd sizes, some ending in the middle of a block.
    bounds = [0, 5, 6, 21, 40]
    for start, stop in itertools.pairwise(bounds):
        at = np.arange(start, stop)
        _write(cells, at, {key: v[start:stop] for key, v in values.items()})
    reopened = _open(tmp_path, spec, rows, block, create=False)
    assert reopened.mark(2) == cells.mark(2)  # found from the ids on disk
    _write(reopened, np.arange(40, rows), {key: v[40:] for key, v in values.items()})
    everything = np.random.default_rng(0).integers(0, rows, 300)  # any order, repeats
    _check(reopened, values, everything)
    _check(_open(tmp_path, spec, rows, block, create=False), values, np.arange(rows))


def test_a_block_of_one_episode_takes_about_one_cell_per_row(tmp_path):
    spec, rows, block = _spec(), 64, 32
    values = _episodes(spec, rows, seed=2, resets=0)
    cells = _open(tmp_path, spec, rows, block, create=True)
    _write(cells, np.arange(rows), values)
    per_row = cells.cells_per_row
    # The first row of each block stores its 4 frames and the newest of its next; every
    # other row one frame: block + 4 cells, rounded up to whole rows of 8.
    assert cells.mark(0) == cells.mark(1) == -(-(block + 4) // per_row) * per_row
    _check(cells, values, np.arange(rows))


def test_cells_a_row_named_are_not_written_again_in_place(tmp_path):
    spec, rows, block = _spec(), 16, 16
    first, second = _episodes(spec, rows, seed=3), _episodes(spec, rows, seed=4)
    cells = _open(tmp_path, spec, rows, block, create=True)
    _write(cells, np.arange(rows), first)
    before = {
        key: array.read_rows(np.arange(rows)).result().copy() for key, array in cells.ids.items()
    }
    mark = cells.mark(0)
    rewritten = np.array([3, 4, 9])
    _write(cells, rewritten, {key: v[torch.from_numpy(rewritten)] for key, v in second.items()})
    assert cells.mark(0) > mark
    now = {key: v.clone() for key, v in first.items()}
    for key in now:
        now[key][torch.from_numpy(rewritten)] = second[key][torch.from_numpy(rewritten)]
    _check(cells, now, np.arange(rows))
    # The ids of before (a commit's) still name the frames they named: none was written over.
    for key, array in cells.ids.items():
        array.write_rows(np.arange(rows), before[key]).result()
    _check(cells, first, np.arange(rows))


def test_a_write_past_the_region_raises_before_writing_and_a_taken_slot_starts_afresh(tmp_path):
    spec, rows, block = _spec(), 8, 4
    values = _episodes(spec, rows, seed=5)
    cells = _open(tmp_path, spec, rows, block, create=True)
    row = np.array([1])
    writes = 0
    while cells.room(0, 1) and writes <= block:
        _write(cells, row, {key: v[1:2] for key, v in values.items()})
        writes += 1
    assert writes == block  # a row takes at most a row of cells: the region holds 4 such
    other = _episodes(spec, rows, seed=6)
    ids = cells.ids[OBS].read_rows(row).result().copy()
    with pytest.raises(RegionFullError):
        cells.start_write(row, {key: v[1:2] for key, v in other.items()})
    assert np.array_equal(cells.ids[OBS].read_rows(row).result(), ids)  # nothing written
    _check(cells, values, row)
    cells.take_slots([0])  # the ring took the slot afresh (no record refers to it)
    assert cells.mark(0) == 0
    _write(cells, np.arange(block), {key: v[:block] for key, v in other.items()})
    _check(cells, other, np.arange(block))


def test_a_block_copied_as_stored_reads_the_same_in_its_new_slot(tmp_path):
    spec, rows, block = _spec(), 32, 8
    values = _episodes(spec, rows, seed=7)
    cells = _open(tmp_path, spec, rows, block, create=True)
    _write(cells, np.arange(block), {key: v[:block] for key, v in values.items()})
    cells.copy_chunk(0, 3)
    assert cells.mark(3) == cells.mark(0)
    got = cells.read(np.arange(3 * block, 4 * block), [OBS, NEXT])
    for key in (OBS, NEXT):
        assert torch.equal(got[key], values[key][:block])


def test_a_write_of_one_key_leaves_the_other_as_it_was(tmp_path):
    spec, rows, block = _spec(), 16, 16
    first, second = _episodes(spec, rows, seed=8), _episodes(spec, rows, seed=9)
    cells = _open(tmp_path, spec, rows, block, create=True)
    _write(cells, np.arange(rows), first)
    picked = np.array([0, 5, 6, 15])
    _write(cells, picked, {OBS: second[OBS][torch.from_numpy(picked)]})
    expected = {OBS: first[OBS].clone(), NEXT: first[NEXT]}
    expected[OBS][torch.from_numpy(picked)] = second[OBS][torch.from_numpy(picked)]
    _check(cells, expected, np.arange(rows))


def test_lanes_and_float_frames_come_back_bit_for_bit(tmp_path):
    spec, rows, block = _spec(lanes=2, stack=3, frame=(4, 3), dtype=torch.float32), 24, 8
    values = _episodes(spec, rows, seed=10)
    for key in values:  # bytes, not values: -0.0 and NaN as written
        flat = values[key].view(-1)
        flat[::7] = -0.0
        flat[::11] = float("nan")
    cells = _open(tmp_path, spec, rows, block, create=True)
    _write(cells, np.arange(rows), values)
    _check(cells, values, np.arange(rows)[::-1].copy())


@pytest.mark.parametrize("lanes", [1, 2])
def test_cells_taken_from_the_tiers_plan_read_back_as_compared_ones(tmp_path, lanes):
    """A block whose rows the RAM tier holds takes its cells from the tier's ids, without
    comparing its frames again: the same cells as compared, rows bit for bit. A block with
    a row the tier does not hold (here released) compares them."""
    spec, rows, block = _spec(lanes=lanes), 48, 16
    values = _episodes(spec, rows, seed=12, resets=4)
    tier = FrameTier([spec], rows=rows, budget=2**22)
    known_cells = _open(tmp_path / "known", spec, rows, block, create=True)
    compared = _open(tmp_path / "compared", spec, rows, block, create=True)
    for start, stop in itertools.pairwise([0, 7, 16, 30, 48]):  # extends across blocks
        at = np.arange(start, stop)
        given = {key: v[start:stop] for key, v in values.items()}
        assert tier.put(at, given)
        if start == 30:
            tier.release(np.array([40]))  # block 2: one row not held
        known = tier.known(OBS, at)
        assert known.known.all() == (start != 30)
        for _, future, _ in known_cells.start_write(at, given, known=known):
            future.result()
        _write(compared, at, given)
    assert [known_cells.mark(b) for b in range(3)] == [compared.mark(b) for b in range(3)]
    _check(known_cells, values, np.arange(rows))
    _check(_open(tmp_path / "known", spec, rows, block, create=False), values, np.arange(rows))


def test_an_id_outside_its_region_is_damage(tmp_path):
    spec, rows, block = _spec(), 16, 8
    values = _episodes(spec, rows, seed=11)
    cells = _open(tmp_path, spec, rows, block, create=True)
    _write(cells, np.arange(rows), values)
    bad = np.full((1, spec.stack), block * cells.cells_per_row, dtype=np.int32)
    cells.ids[NEXT].write_rows(np.array([2]), bad).result()
    with pytest.raises(StoreCorruptedError, match="outside its block"):
        cells.read(np.array([2]), [OBS, NEXT])
