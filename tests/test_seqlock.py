"""The one seqlock loop (:func:`zarr_rb.util.seqlock.seqlock_read`) the store's readers,
its shared writers and forked readers read through."""

from __future__ import annotations

import pytest

from zarr_rb.util.seqlock import seqlock_read


class Record:
    """A commit record that moves on at the reads listed in ``moves`` (counted from 0)."""

    def __init__(self, moves: tuple[int, ...] = ()) -> None:
        self.generation = 0
        self.reads = 0
        self.moves = moves

    def read(self) -> int:
        if self.reads in self.moves:
            self.generation += 1
        self.reads += 1
        return self.generation


def gave_up(error: Exception | None) -> Exception:
    return TimeoutError(f"gave up; last error: {error}")


def test_a_read_the_commit_did_not_move_under_is_returned_a_moved_one_read_again() -> None:
    record = Record(moves=(1, 3))  # the commit moves during the first two reads
    reads: list[int] = []

    def read(generation: int) -> str:
        reads.append(generation)
        return f"rows of {generation}"

    out = seqlock_read(
        record.read,
        read,
        lambda before, whole: whole and record.read() == before,
        attempts=5,
        gave_up=gave_up,
        pause=0,
    )
    assert out == "rows of 2"
    assert reads == [0, 1, 2]


def test_an_error_is_retried_while_the_commit_moves_and_raised_once_it_stands() -> None:
    record = Record(moves=(1,))
    calls = 0

    def read(generation: int) -> str:
        nonlocal calls
        calls += 1
        raise ValueError(f"damaged at {generation}")

    with pytest.raises(ValueError, match="damaged at 1"):
        seqlock_read(
            record.read,
            read,
            lambda before, _whole: record.read() == before,
            attempts=5,
            gave_up=gave_up,
            retried=(ValueError,),
            lasting=(ValueError,),
            pause=0,
        )
    assert calls == 2


def test_an_error_not_lasting_is_retried_then_named_when_it_gives_up() -> None:
    def read(_: int) -> str:
        raise ValueError("a shard replaced")

    with pytest.raises(TimeoutError, match="last error: a shard replaced"):
        seqlock_read(
            lambda: 0,
            read,
            lambda _before, _whole: True,
            attempts=3,
            gave_up=gave_up,
            retried=(ValueError,),
            pause=0,
        )


def test_other_errors_are_raised_at_once() -> None:
    def read(_: int) -> str:
        raise IndexError("not readable")

    with pytest.raises(IndexError, match="not readable"):
        seqlock_read(
            lambda: 0, read, lambda _b, _w: True, attempts=3, gave_up=gave_up, retried=(ValueError,)
        )


def test_it_gives_up_after_its_attempts_with_no_error_to_name() -> None:
    record = Record(moves=tuple(range(1, 100, 2)))  # moves during every read
    with pytest.raises(TimeoutError, match="last error: None"):
        seqlock_read(
            record.read,
            lambda generation: generation,
            lambda before, _whole: record.read() == before,
            attempts=4,
            gave_up=gave_up,
            pause=0,
        )
    assert record.reads == 8
