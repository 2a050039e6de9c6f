"""The store's record, ``attributes["zarr_rb"]`` of the root group (:class:`StoreMeta`): the
capacity, the schema, the commit, the saves (:class:`Saved`) and the kept versions, the
compression settings; parsed and checked whole from the root attributes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from zarr_rb.errors import FormatVersionError, StoreCorruptedError
from zarr_rb.format._parse import _MAX_DIMS, _expect, _parse_int, _parse_int_list
from zarr_rb.format.commit import Commit, parse_commit
from zarr_rb.format.names import ATTRS_KEY, FORMAT_VERSION, FRAMES_FORMAT, STATE_GROUP
from zarr_rb.format.pieces import MapPieceMissingError, PieceSource, parse_map
from zarr_rb.format.ring import SlotMap, parse_slot_map
from zarr_rb.format.runs import RunMap
from zarr_rb.format.schema import Schema, parse_schema


@dataclasses.dataclass(frozen=True, slots=True)
class Saved:
    """A :func:`zarr_rb.save`: where its buffer state lives and the rows it covered.

    Each save writes its buffer state (sampler, writer, transforms, generator) into a
    group of its own, ``state/<slot>``, written once (``slot`` counts the saves of the
    store; stores saved before format 3 alternated between ``state/0`` and ``state/1``).
    Publishing the record that names it is what makes a save take effect, so a crash
    mid-save leaves the previous save intact.

    A save of format 3 (``pinned``) also keeps the rows it covered: the slot map and the
    holes of the commit it was made at. Nothing written since changes them, for as long as
    a record names the save (the store's last save, or a kept version).
    """

    slot: int
    length: int
    cursor: int
    epoch: int = 0
    """The commit epoch the save was made at (see :attr:`Commit.epoch`)."""
    pinned: bool = False
    slots: SlotMap | None = None
    """The slot map of the rows it covered (``None``: block ``b`` in slot ``b``)."""
    holes: tuple[tuple[int, int], ...] = ()
    time: float = 0.0
    runs: RunMap | None = None
    """The runs of the rows it covered, in a store of several writers."""
    """When it was saved (seconds since the epoch)."""

    @property
    def group(self) -> str:
        return f"{STATE_GROUP}/{self.slot}"

    def commit(self, elements_per_row: int = 1) -> Commit:
        """The rows the save covered, as a commit declares them (``length`` counts
        elements: ``elements_per_row`` of them per row of a store of ``ndim > 1``)."""
        return Commit(
            length=-(-self.length // elements_per_row),
            cursor=self.cursor,
            holes=self.holes,
            epoch=self.epoch,
            slots=self.slots,
            runs=self.runs,
        )

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"slot": self.slot, "length": self.length, "cursor": self.cursor}
        if self.epoch:
            record["epoch"] = self.epoch
        if self.pinned:
            record["pinned"] = True
            record["holes"] = [list(hole) for hole in self.holes]
            record["time"] = self.time
            if self.slots is not None:
                record["slots"] = self.slots.to_json()
            if self.runs is not None:
                record["runs"] = self.runs.to_json()
        return record


@dataclasses.dataclass(frozen=True, slots=True)
class StoreMeta:
    """Everything kept in ``attributes["zarr_rb"]`` of the root group."""

    max_size: int
    ndim: int
    schema: Schema | None
    commit: Commit
    block_rows: int | None = None
    """Rows per write block (the shard height of large leaves); set with the schema."""
    saved: Saved | None = None
    format: int = FORMAT_VERSION
    compression: Mapping[str, Any] | None = None
    """The ``Compression`` settings the store was created with (``None`` in stores written
    before they were recorded)."""
    versions: Mapping[str, Saved] = dataclasses.field(default_factory=dict)
    """Saves kept by name (``zarr_rb.save(rb, tag=...)``), besides the last one."""
    store_id: str | None = None
    """Drawn at random when the store is made: tells it from a store made at the same path
    later (``None`` in stores made before it was recorded)."""

    def run_maps(self) -> list[RunMap]:
        """Every run map of the record (those kept in pieces name objects of their own)."""
        commit = self.commit
        saves = [self.saved, *self.versions.values()]
        maps = [commit.runs, commit.history, *(saved.runs for saved in saves if saved)]
        return [runs for runs in maps if runs is not None]

    def save_slots(self) -> set[int]:
        """The state groups the record's saves are in: the last one and the tagged ones."""
        saves = [self.saved, *self.versions.values()]
        return {saved.slot for saved in saves if saved is not None}

    def pinned(self) -> list[Saved]:
        """The saves whose rows the store keeps: the last one and the tagged ones."""
        saves = [self.saved, *self.versions.values()]
        return [saved for saved in saves if saved is not None and saved.pinned]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "max_size": self.max_size,
            "ndim": self.ndim,
            "block_rows": self.block_rows,
            "schema": None if self.schema is None else self.schema.to_json(),
            "commit": self.commit.to_json(),
            "saved": None if self.saved is None else self.saved.to_json(),
            "compression": (
                None if self.compression is None else _compression_json(self.compression)
            ),
            "versions": {tag: saved.to_json() for tag, saved in self.versions.items()},
            **({} if self.store_id is None else {"store_id": self.store_id}),
        }


# --- parsing (untrusted JSON -> typed records) -------------------------------------------


def shared_format(schema: Schema | None) -> int:
    """The format a shared store records (writers that take a store over as shared ones
    relabel it): :data:`FRAMES_FORMAT` where it stores leaves as frames, else
    :data:`FORMAT_VERSION`."""
    return FRAMES_FORMAT if schema is not None and schema.frames else FORMAT_VERSION


def parse_saved(
    value: object, *, max_size: int, rows: int, pieces: PieceSource | None = None
) -> Saved | None:
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'saved' to be an object or null", value)
    assert isinstance(value, Mapping)
    pinned = value.get("pinned", False)
    _expect(isinstance(pinned, bool), "'pinned' to be a boolean", pinned)
    length = _parse_int(value.get("length"), "saved length", hi=max_size)
    holes = []
    holes_raw = value.get("holes", [])
    _expect(isinstance(holes_raw, list) and len(holes_raw) <= rows, "saved holes", holes_raw)
    assert isinstance(holes_raw, list)
    for hole in holes_raw:
        bounds = _parse_int_list(hole, "saved hole", max_len=2)
        _expect(len(bounds) == 2 and 0 <= bounds[0] < bounds[1] <= rows, "a hole", hole)
        holes.append((bounds[0], bounds[1]))
    time = value.get("time", 0.0)
    _expect(isinstance(time, (int, float)) and not isinstance(time, bool), "a time", time)
    assert isinstance(time, (int, float))
    return Saved(
        slot=_parse_int(value.get("slot"), "saved slot"),
        length=length,
        cursor=_parse_int(value.get("cursor"), "saved cursor", hi=max_size),
        epoch=_parse_int(value.get("epoch", 0), "saved epoch"),
        pinned=pinned,
        slots=parse_slot_map(value.get("slots"), rows=rows),
        holes=tuple(holes),
        time=float(time),
        runs=parse_map(value.get("runs"), rows=rows, pieces=pieces),
    )


TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""What a version's tag may be: a name that reads well in a message and a file name."""


def parse_versions(
    value: object, *, max_size: int, rows: int, pieces: PieceSource | None = None
) -> dict[str, Saved]:
    if value is None:
        return {}
    _expect(isinstance(value, Mapping) and len(value) <= 10_000, "'versions' object", value)
    assert isinstance(value, Mapping)
    out = {}
    for tag, saved in value.items():
        _expect(isinstance(tag, str) and TAG.fullmatch(tag) is not None, "a version tag", tag)
        parsed = parse_saved(saved, max_size=max_size, rows=rows, pieces=pieces)
        _expect(parsed is not None, f"version {tag!r} to be a save", saved)
        assert parsed is not None
        out[tag] = parsed
    return out


_CODECS = ("zstd", "lz4", "none")


def parse_compression(value: object) -> dict[str, Any] | None:
    """The recorded compression settings, checked field by field (``None`` if absent)."""
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'compression' to be an object or null", value)
    assert isinstance(value, Mapping)
    codec = value.get("codec")
    _expect(codec in _CODECS, f"a codec among {_CODECS}", codec)
    block_rows = value.get("block_rows")
    return {
        "codec": codec,
        "level": _parse_int(value.get("level"), "compression level", lo=-(2**17), hi=22),
        "chunk_rows": _parse_int(value.get("chunk_rows"), "chunk_rows", lo=1, hi=2**31),
        "block_rows": None
        if block_rows is None
        else _parse_int(block_rows, "compression block_rows", lo=1, hi=2**31),
        "large_row_bytes": _parse_int(value.get("large_row_bytes"), "large_row_bytes"),
        "frames": _parse_optional_bool(value.get("frames"), "compression frames"),
    }


def _parse_optional_bool(value: object, what: str) -> bool | None:
    """True, false, or absent (``None``): a setting decided at the store's first write
    (:func:`_compression_json`)."""
    return None if value is None else _parse_bool(value, what)


def _compression_json(compression: Mapping[str, Any]) -> dict[str, Any]:
    """The recorded settings: ``frames`` left out until the first write decides it (an
    older zarr_rb, whose parser takes true or false, reads an empty store as ``false``)."""
    return {k: v for k, v in compression.items() if not (k == "frames" and v is None)}


def _parse_bool(value: object, what: str) -> bool:
    _expect(isinstance(value, bool), f"{what} to be true or false", value)
    assert isinstance(value, bool)
    return value


RECORD_RETRIES = 20
"""Times a record whose pieces were replaced while it was read is read again."""


def parse_current_record(
    document: Mapping[str, Any],
    read_again: Callable[[], Mapping[str, Any] | None],
    *,
    where: str,
    pieces: PieceSource,
) -> StoreMeta:
    """The store record ``document`` (a root ``zarr.json`` known to be a store's), its run
    maps read from the pieces it names.

    A piece that is gone means the record moved on since it was read (the writer that
    replaced it deleted the pieces it no longer names): the record is read again
    (``read_again()``, which checks it is still a store's) and parsed anew.

    Raises:
        MapPieceMissingError: a piece the record as it is now names is missing (damage),
            or the record kept moving on over ``RECORD_RETRIES`` reads.
    """
    for _ in range(RECORD_RETRIES):
        try:
            return parse_store_meta(document["attributes"], where=where, pieces=pieces)
        except MapPieceMissingError:
            again = read_again()
            if again is None or again == document:
                raise  # not a record that moved on: a piece it names is gone
            document = again
    return parse_store_meta(document["attributes"], where=where, pieces=pieces)


def parse_store_meta(
    attributes: Mapping[str, Any], *, where: str, pieces: PieceSource | None = None
) -> StoreMeta:
    """Validate the root attributes of a store and return them as a :class:`StoreMeta`.

    ``pieces``: where the run maps that the record keeps in pieces are read from (the
    store's location); without it, a record that keeps one raises.

    Raises:
        NotAStoreError: handled by the caller; this function assumes the key exists.
        FormatVersionError: the store was written by a newer major format.
        StoreCorruptedError: any field is missing, of the wrong type or out of range.
    """
    value = attributes.get(ATTRS_KEY)
    try:
        _expect(isinstance(value, Mapping), f"attributes[{ATTRS_KEY!r}] to be an object", value)
        assert isinstance(value, Mapping)
        fmt = _parse_int(value.get("format"), "format version")
        if fmt > FRAMES_FORMAT:
            raise FormatVersionError(
                f"{where} was written in zarr_rb store format {fmt}; this zarr_rb reads "
                f"format {FRAMES_FORMAT} and older. Upgrade zarr_rb to open it.",
            )
        _expect(fmt >= 1, "format version >= 1", fmt)
        max_size = _parse_int(value.get("max_size"), "max_size", lo=1)
        ndim = _parse_int(value.get("ndim"), "ndim", lo=1, hi=_MAX_DIMS)
        schema = parse_schema(value.get("schema"), ndim=ndim)
        if schema is not None:
            per_row = math.prod(schema.batch_shape[1:])
            _expect(
                schema.rows == -(-max_size // per_row),
                f"batch_shape {list(schema.batch_shape)} to hold max_size={max_size}",
                list(schema.batch_shape),
            )
        if schema is not None:
            _expect(
                (fmt == FRAMES_FORMAT) == bool(schema.frames),
                f"leaves stored as frames in a store of format {FRAMES_FORMAT} (and only there)",
                fmt,
            )
        rows = schema.rows if schema is not None else max_size
        block_rows = value.get("block_rows")
        if block_rows is not None:
            block_rows = _parse_int(block_rows, "block_rows", lo=1)
        _expect(
            (schema is None) == (block_rows is None), "block_rows set with the schema", block_rows
        )
        commit = parse_commit(value.get("commit"), rows=rows, pieces=pieces)
        if commit.slots is not None:
            _expect(
                fmt >= 3 and commit.slots.block_rows == block_rows,
                f"a slot map (format 3) of blocks of {block_rows} rows",
                commit.slots.to_json(),
            )
        if commit.runs is not None:
            ring = commit.ring
            _expect(
                fmt >= 3 and ring is not None and commit.slots is None,
                "runs (format 3) in the record of a shared store",
                value.get("commit"),
            )
            assert ring is not None
            bound = ring.capacity * (block_rows or 1)
            _expect(
                not len(commit.runs)
                or int((commit.runs.firsts + commit.runs.counts).max()) <= bound,
                f"runs inside the {ring.capacity} slots of the arrays",
                commit.runs.to_json(),
            )
        if commit.history is not None:
            history = commit.history
            # Every row of the history is a row of the arrays, each once: within the slots
            # the record gives them (the arrays have at least those).
            slots = (
                commit.ring.capacity
                if commit.ring is not None and commit.ring.capacity
                else commit.slots.capacity
                if commit.slots is not None
                else -(-rows // (block_rows or 1))
            )
            bound = max(rows, slots * (block_rows or 1))
            _expect(
                history.end <= bound
                and (not len(history) or int((history.firsts + history.counts).max()) <= bound),
                f"a history of rows inside the {bound} rows of the arrays",
                history.to_json(),
            )
        saved = parse_saved(value.get("saved"), max_size=max_size, rows=rows, pieces=pieces)
        versions = parse_versions(
            value.get("versions"), max_size=max_size, rows=rows, pieces=pieces
        )
        compression = parse_compression(value.get("compression"))
        store_id = value.get("store_id")
        _expect(
            store_id is None or (isinstance(store_id, str) and 0 < len(store_id) <= 64),
            "a store id string",
            store_id,
        )
    except MapPieceMissingError as err:
        raise MapPieceMissingError(f"{where}: {err}", key=err.key) from None
    except StoreCorruptedError as err:
        raise StoreCorruptedError(f"{where}: {err}") from None
    return StoreMeta(
        max_size=max_size,
        ndim=ndim,
        schema=schema,
        commit=commit,
        block_rows=block_rows,
        saved=saved,
        versions=versions,
        format=fmt,
        compression=compression,
        store_id=store_id,
    )
