"""The commit record: the rows readers may trust (:class:`Commit`) and its parts, the slots
shared writers hold (:class:`Ring`), the slots of a writer on a lease (:class:`LeaseFloor`)
and the objects created once (:class:`ObjectEra`), as the record keeps them and parsed
back from it. The slot map and the run maps it holds are :mod:`zarr_rb.format.ring` and
:mod:`zarr_rb.format.runs`.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from zarr_rb.format._parse import _expect, _parse_int, _parse_int_list
from zarr_rb.format.pieces import PieceSource, parse_map
from zarr_rb.format.ring import SlotMap, invalid_metadata, parse_slot_map
from zarr_rb.format.runs import RunMap

RECENT_TAKES = 64
"""Slots taken last that a shared record names (readers check their reads against them)."""
LAST_COMMITS = 64
"""Writers whose last commit a shared record names (:attr:`Ring.committed`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ring:
    """How the writers of a shared store share the slots of its arrays (format 3).

    Each writer appends into a slot of its own, ``open``; the commit that publishes its
    rows maps their positions to them (:attr:`Commit.runs`). A slot is free when no run,
    no open slot and no kept save refers to it. ``capacity`` is the slots the arrays have.
    ``takes`` counts the slots taken so far (opened by a writer, or emptied by a
    collection), ``recent`` names the last of them: a reader that read rows of one of them
    under an older record reads again.

    ``legacy``: the record of a store shared under format 2 (blocks taken in ring order),
    converted to runs by the first writer that joins it.

    Where a writer that lost its hold may still write (a lease: see
    ``WriterHold.late_writes``), slots it could be writing are never taken again:
    ``retired`` are the open slots of writers taken for gone, and no slot below
    ``fresh_from`` that no run refers to is taken (the slots a store of one writer had
    when it became shared: that writer's, were it stalled).

    ``committed``: ``(writer, generation)`` of the last record each of the writers that
    published last published (at most :data:`LAST_COMMITS`, the newest last). A writer
    whose compare-and-swap was refused although it landed (its answer lost, the request
    retried) finds its own there, also under records other writers published since.
    """

    capacity: int = 0
    open: tuple[tuple[str, int], ...] = ()
    takes: int = 0
    recent: tuple[int, ...] = ()
    legacy: bool = False
    retired: tuple[int, ...] = ()
    fresh_from: int = 0
    committed: tuple[tuple[str, int], ...] = ()

    def slots_of(self, writer: str) -> list[int]:
        return [slot for who, slot in self.open if who == writer]

    def published_by(self, writer: str, generation: int) -> Ring:
        """This ring in a record of ``generation`` that ``writer`` publishes."""
        others = tuple((who, g) for who, g in self.committed if who != writer)
        committed = (*others, (writer, generation))[-LAST_COMMITS:]
        return dataclasses.replace(self, committed=committed)

    def names_commit(self, writer: str, generation: int) -> bool:
        """Whether ``writer``'s record of ``generation`` was published (this ring's record
        is it, or one published on top of it)."""
        return (writer, generation) in self.committed

    def taken_since(self, before: Ring) -> set[int] | None:
        """Slots taken since ``before`` (``None``: more than the record names)."""
        count = self.takes - before.takes
        if count > len(self.recent) or self.legacy or before.legacy:
            return None
        return set(self.recent[len(self.recent) - count :]) if count else set()

    def to_json(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "open": [[who, slot] for who, slot in self.open],
            "takes": self.takes,
            "recent": list(self.recent),
            **({"retired": list(self.retired)} if self.retired else {}),
            **({"fresh_from": self.fresh_from} if self.fresh_from else {}),
            **({"committed": [list(c) for c in self.committed]} if self.committed else {}),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectEra:
    """What readers of a store whose objects are created once need to keep their caches
    (:attr:`Commit.object_era`): a random ``token``, drawn anew by a single writer's first
    record (the writer before may have created objects after its last one), by a shared
    writer that finds a record without one, when an array was created again at a path, and
    when ``slots`` would grow past :data:`ERA_SLOTS`; and ``slots``, every slot whose
    objects were created since the token was drawn, in order, repeats kept (shared writers
    each add theirs by compare-and-swap of the record). A reader that read a record of the
    same token invalidates the cached objects of the slots added since; any other change
    revalidates every cached object."""

    token: str
    slots: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "slots": list(self.slots)}


ERA_SLOTS = 1024
"""The most slots an :class:`ObjectEra` lists (the record stays small; readers then
revalidate their caches once, at the next token)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseFloor:
    """Where the writer of a store held by a lease (S3) may write: slots below ``floor``
    are never written again (a writer that held the store before may still write them
    late, see ``WriterHold.late_writes``).

    ``held``: a writer is writing slots at or past ``floor`` (it publishes this before its
    first write). A writer that closes cleanly publishes ``held=False`` after its last
    write: the next one starts its own slots at the same ``floor``. A writer that crashed
    or stalled leaves ``held=True``: the next one starts past every slot the record names.
    """

    floor: int = 0
    held: bool = True
    avoid: tuple[int, ...] = ()
    """State groups no save writes into: those a writer that held the store before may
    still write late (the group it would have saved into next, were it stalled)."""

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"floor": self.floor, "held": self.held}
        if self.avoid:
            record["avoid"] = list(self.avoid)
        return record


@dataclasses.dataclass(frozen=True, slots=True)
class Commit:
    """The committed state that readers and a reopening writer trust.

    Rows ``[0, length)`` are readable except those in ``holes`` (half-open
    ranges): rows whose previous content was withdrawn because they are being
    rewritten. ``generation`` grows by one with every published commit.
    """

    generation: int = 0
    length: int = 0
    cursor: int = 0
    holes: tuple[tuple[int, int], ...] = ()
    unwritten: tuple[tuple[int, int], ...] = ()
    """The holes (of :attr:`holes`, half-open ranges) that no call wrote since the store
    was made or emptied: TorchRL's ``len`` counted them. The others lost their data (a
    repair withdrew them, a failed write tore them), and a save in the same slots shares
    that loss. Records of older versions leave it out: every hole counts as lost."""
    ring: Ring | None = None
    """The blocks of a store written by several writers (``None``: one writer)."""
    epoch: int = 0
    """Grows whenever rows that an earlier commit declared readable are written over (the
    ring wrapping, rows rewritten, the buffer emptied): the rows a save covered are the
    ones it saved for as long as the epoch it recorded stays (one writer)."""
    slots: SlotMap | None = None
    """Which slot of the data arrays holds each block of positions (``None``: block ``b``
    in slot ``b``, as in every store never written over)."""
    runs: RunMap | None = None
    """A shared store's map of positions to rows of the data arrays (format 3)."""
    history: RunMap | None = None
    """An archive's rows, every one an extend committed, in commit order: history index
    to row of the data arrays (``None``: the store keeps no archive)."""
    lease: LeaseFloor | None = None
    """The slots the writer on a lease owns (``None``: not recorded, as held at the
    capacity)."""
    object_era: ObjectEra | None = None
    """Set when the store's data objects are created once and never written over (its
    writers on S3, see ``docs/design/ring.md``, step 5): which slots had objects created
    since a reader's cache may last have been made whole. ``None``: objects may be written
    over; a cache revalidates them at every new commit."""
    kept_from: int | None = None
    """The oldest commit whose rows the writer of this record keeps (one writer): while
    this record stands, no slot that a commit of generation ``kept_from`` or later names
    is written, nor a row such a commit declares readable, so a reader may go on reading
    such a commit. ``None`` (a shared store, a writer of an older version): only this
    commit's rows are kept. See ``docs/design/reader-snapshots.md``."""

    def keeps(self, earlier: Commit) -> bool:
        """Whether a read of the rows of ``earlier`` still stands under this record (its
        writer keeps them: see :attr:`kept_from`)."""
        if earlier.generation == self.generation:
            return True
        kept = self.kept_from
        return (
            self.ring is None and kept is not None and kept <= earlier.generation < self.generation
        )

    def physical(self, rows: np.ndarray) -> np.ndarray:
        """The rows of the data arrays that hold positions ``rows`` in this commit."""
        if self.runs is not None:
            return self.runs.physical(rows)
        return rows if self.slots is None else self.slots.physical(rows)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "generation": self.generation,
            "length": self.length,
            "cursor": self.cursor,
            "holes": [list(h) for h in self.holes],
        }
        unwritten = _intersection(self.unwritten, self.holes)  # (a record of holes replaced)
        if unwritten:
            record["unwritten"] = [list(h) for h in unwritten]
        if self.epoch:
            record["epoch"] = self.epoch
        if self.ring is not None:
            record["ring"] = self.ring.to_json()
        if self.slots is not None:
            record["slots"] = self.slots.to_json()
        if self.runs is not None:
            record["runs"] = self.runs.to_json()
        if self.history is not None:
            record["history"] = self.history.to_json()
        if self.lease is not None:
            record["lease"] = self.lease.to_json()
        if self.object_era is not None:
            record["object_era"] = self.object_era.to_json()
        if self.kept_from is not None:
            record["kept_from"] = self.kept_from
        return record

    def slots_created_since(self, earlier: Commit) -> tuple[int, ...] | None:
        """The slots whose objects were created (anew) since the ``earlier`` commit: every
        other object it named holds what it held then, as long as it exists. ``None``:
        not known (objects may have been written over; revalidate every one)."""
        now, before = self.object_era, earlier.object_era
        if now is None or before is None or now.token != before.token:
            return None
        return now.slots[len(before.slots) :]

    def reads_alike(self, later: Commit, rows: np.ndarray, block_rows: int) -> bool:
        """Whether positions ``rows``, read through this commit of a shared store, read
        as the ``later`` commit has them: each in the same row of the arrays, none in a
        slot taken meanwhile (and written again since)."""
        if not self.still_holds(later, rows, block_rows):
            return False
        unique = np.unique(rows)
        return bool(np.array_equal(self.physical(unique), later.physical(unique)))

    def still_holds(self, later: Commit, rows: np.ndarray, block_rows: int) -> bool:
        """Whether the rows of the arrays that hold positions ``rows`` in this commit of a
        shared store still hold what they held, at ``later``: none in a slot taken
        meanwhile (and written again since). The positions may have moved to other rows
        since: read through this commit's map, they read as this commit has them."""
        if self.ring is None or later.ring is None or self.length > later.length:
            return False
        taken = later.ring.taken_since(self.ring)
        if taken is None:
            return False
        if not taken:
            return True
        physical = self.physical(np.unique(rows))
        slots = np.unique(physical[physical >= 0] // block_rows)
        return not np.isin(slots, np.fromiter(taken, dtype=np.int64)).any()

    def serves_alike(self, other: Commit, rows: int) -> bool:
        """Whether positions ``[0, rows)`` are readable alike in both commits and read the
        same rows of the arrays (rows a record keeps are never written again)."""
        positions = np.arange(rows)
        return np.array_equal(
            self.readable(positions), other.readable(positions)
        ) and np.array_equal(self.physical(positions), other.physical(positions))

    def readable(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` is readable in this commit (no mask over every row)."""
        out: np.ndarray = rows < self.length
        for start, stop in self.holes:
            out &= (rows < start) | (rows >= stop)
        return out

    def unwritten_at(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` holds nothing a call wrote (since the store was made or
        emptied): past the length, or in an unwritten hole."""
        out: np.ndarray = rows >= self.length
        for start, stop in self.unwritten:
            out |= (rows >= start) & (rows < stop)
        return out

    def readable_mask(self, rows: int) -> np.ndarray:
        """Boolean mask over ``rows`` rows: which rows this commit declares readable."""
        mask = np.zeros(rows, dtype=bool)
        mask[: self.length] = True
        for start, stop in self.holes:
            mask[start:stop] = False
        return mask


def mask_to_ranges(mask: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Half-open ranges of the ``True`` runs of a boolean mask (vectorised)."""
    padded = np.concatenate(([False], mask.astype(bool), [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True))


def declared_length(readable: np.ndarray) -> int:
    """One past the last ``True`` row of ``readable``: the length a commit of it declares
    (see :func:`commit_from_mask`)."""
    rows = np.flatnonzero(readable)
    return int(rows[-1]) + 1 if rows.size else 0


def commit_from_mask(
    readable: np.ndarray,
    *,
    generation: int,
    cursor: int,
    length: int | None = None,
) -> Commit:
    """The commit record that declares exactly the ``True`` rows of ``readable``.

    ``length`` defaults to one past the last readable row; pass the current length to
    withdraw rows at the end as holes rather than shrinking the buffer.
    """
    last = declared_length(readable)
    length = last if length is None else max(length, last)
    if length > readable.size:  # rows past the mask: none of them readable
        readable = np.concatenate((readable, np.zeros(length - readable.size, dtype=bool)))
    holes = mask_to_ranges(~readable[:length])
    return Commit(generation=generation, length=length, cursor=cursor, holes=holes)


# --- parsing (untrusted JSON -> typed records) -------------------------------------------


def parse_commit(value: object, *, rows: int, pieces: PieceSource | None = None) -> Commit:
    _expect(isinstance(value, Mapping), "'commit' to be an object", value)
    assert isinstance(value, Mapping)
    length = _parse_int(value.get("length"), "commit length", hi=rows)
    holes = _parse_ranges(value.get("holes", []), "commit hole", rows=rows, length=length)
    unwritten = _parse_ranges(value.get("unwritten", []), "unwritten", rows=rows, length=length)
    _expect(_within(unwritten, holes), "unwritten rows among the holes", value.get("unwritten"))
    generation = _parse_int(value.get("generation"), "commit generation")
    kept_from = value.get("kept_from")
    return Commit(
        generation=generation,
        length=length,
        cursor=_parse_int(value.get("cursor", 0), "commit cursor", hi=max(rows - 1, 0)),
        holes=holes,
        unwritten=unwritten,
        ring=parse_ring(value.get("ring"), rows=rows),
        epoch=_parse_int(value.get("epoch", 0), "commit epoch"),
        slots=parse_slot_map(value.get("slots"), rows=rows),
        runs=parse_map(value.get("runs"), rows=rows, pieces=pieces),
        history=parse_history(value.get("history"), pieces=pieces),
        lease=parse_lease(value.get("lease"), rows=rows),
        object_era=_parse_object_era(value, rows=rows),
        kept_from=None
        if kept_from is None
        else _parse_int(kept_from, "commit kept_from", hi=generation),
    )


def _parse_ranges(raw: object, what: str, *, rows: int, length: int) -> tuple[tuple[int, int], ...]:
    """Half-open ranges of rows inside ``[0, length)`` (a commit's holes)."""
    _expect(isinstance(raw, list) and len(raw) <= rows, f"{what}s list", raw)
    assert isinstance(raw, list)
    ranges = []
    for item in raw:
        bounds = _parse_int_list(item, what, max_len=2)
        _expect(
            len(bounds) == 2 and 0 <= bounds[0] < bounds[1] <= length,
            f"{what} [start, stop) inside [0, {length})",
            item,
        )
        ranges.append((bounds[0], bounds[1]))
    return tuple(ranges)


def _intersection(
    ranges: tuple[tuple[int, int], ...], holes: tuple[tuple[int, int], ...]
) -> list[tuple[int, int]]:
    """The parts of ``ranges`` inside ``holes`` (both sorted, apart)."""
    out, i, j = [], 0, 0
    while i < len(ranges) and j < len(holes):
        start, stop = max(ranges[i][0], holes[j][0]), min(ranges[i][1], holes[j][1])
        if start < stop:
            out.append((start, stop))
        if ranges[i][1] < holes[j][1]:
            i += 1
        else:
            j += 1
    return out


def _within(ranges: tuple[tuple[int, int], ...], holes: tuple[tuple[int, int], ...]) -> bool:
    """Whether every range lies inside one of ``holes`` (sorted, apart)."""
    starts = [start for start, _ in holes]
    for start, stop in ranges:
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or stop > holes[i][1]:
            return False
    return True


_OBJECT_ERA_TOKEN = re.compile(r"[0-9a-f]{16,64}")


def _parse_object_era(value: Mapping[str, Any], *, rows: int) -> ObjectEra | None:
    """``Commit.object_era`` of a record."""
    era = value.get("object_era")
    if era is None:
        return None
    _expect(isinstance(era, Mapping), "object_era to be an object", era)
    assert isinstance(era, Mapping)
    token = era.get("token")
    _expect(
        isinstance(token, str) and _OBJECT_ERA_TOKEN.fullmatch(token) is not None,
        "object_era token to be hex digits",
        token,
    )
    assert isinstance(token, str)
    slots = _parse_int_list(era.get("slots", []), "object_era slots", max_len=ERA_SLOTS)
    _expect(
        all(slot < max_ring_capacity(rows) for slot in slots), "object_era slots in range", slots
    )
    return ObjectEra(token=token, slots=slots)


def parse_lease(value: object, *, rows: int) -> LeaseFloor | None:
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'lease' to be an object or null", value)
    assert isinstance(value, Mapping)
    held = value.get("held")
    _expect(isinstance(held, bool), "lease held to be true or false", held)
    floor = _parse_int(value.get("floor"), "lease floor", hi=max_ring_capacity(rows))
    avoid = _parse_int_list(value.get("avoid", []), "lease avoid", max_len=_MAX_AVOIDED)
    return LeaseFloor(floor=floor, held=bool(held), avoid=avoid)


_MAX_AVOIDED = 100_000
"""State groups a record may keep saves out of (one per writer that took the store over
from one that did not close cleanly)."""


HISTORY_BOUND = 2**48
"""More rows than any archive's history holds (a bound for parsing records)."""


def parse_history(value: object, *, pieces: PieceSource | None = None) -> RunMap | None:
    """An archive's history from the commit record (untrusted): runs from index 0 on, with
    no gap."""
    history = parse_map(value, rows=HISTORY_BOUND, pieces=pieces)
    if history is not None and history.holes(history.end):
        raise invalid_metadata("a history whose runs follow each other from index 0", value)
    return history


_WRITER_ID = re.compile(r"[0-9a-f]{8,64}")


def max_ring_capacity(rows: int) -> int:
    """The most slots a shared store's record may name for ``rows`` positions (a larger
    one is damaged): as many as a record of one writer may (``ring.max_slots``: a store
    that becomes shared keeps its slots), or more."""
    return 64 * rows + 2**24


def parse_ring(value: object, *, rows: int) -> Ring | None:
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'ring' to be an object or null", value)
    assert isinstance(value, Mapping)
    if "open" not in value:
        return Ring(legacy=True)  # format 2: blocks held in ring order, converted on join
    capacity = _parse_int(value.get("capacity"), "ring capacity", hi=max_ring_capacity(rows))
    open_raw = value.get("open")
    # (Each slot open once: a writer's own, and those a collection holds.)
    opened = _parse_writer_pairs(
        open_raw,
        "ring open list",
        "an open slot [writer id, slot]",
        "open slot",
        max_len=capacity,
        hi=max(capacity - 1, 0),
    )
    _expect(len({slot for _, slot in opened}) == len(opened), "each slot open once", open_raw)
    recent = _parse_int_list(value.get("recent", []), "ring recent", max_len=RECENT_TAKES)
    retired = _parse_int_list(value.get("retired", []), "ring retired", max_len=capacity)
    _expect(all(slot < capacity for slot in retired), "retired slots inside the capacity", retired)
    committed = _parse_writer_pairs(
        value.get("committed", []),
        "ring committed list",
        "a last commit [writer id, generation]",
        "last commit generation",
        max_len=LAST_COMMITS,
    )
    return Ring(
        capacity=capacity,
        open=tuple(opened),
        takes=_parse_int(value.get("takes", 0), "ring takes"),
        recent=tuple(recent),
        retired=retired,
        fresh_from=_parse_int(value.get("fresh_from", 0), "ring fresh_from", hi=capacity),
        committed=tuple(committed),
    )


def _parse_writer_pairs(
    raw: object, listed: str, each: str, number: str, *, max_len: int, hi: int = 2**62
) -> list[tuple[str, int]]:
    """A record's list of ``[writer id, integer]`` pairs (at most ``max_len``; integers up to
    ``hi``); ``listed``, ``each`` and ``number`` name the list, a pair and its integer in
    messages."""
    _expect(isinstance(raw, list) and len(raw) <= max_len, listed, raw)
    assert isinstance(raw, list)
    pairs = []
    for entry in raw:
        _expect(
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and _WRITER_ID.fullmatch(entry[0]) is not None,
            each,
            entry,
        )
        pairs.append((entry[0], _parse_int(entry[1], number, hi=hi)))
    return pairs
