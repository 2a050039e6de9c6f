"""Large run maps kept in pieces: objects written once, named by the commit record.

A run map of more than ``INLINE_RUNS`` runs (:mod:`zarr_rb.format.runs`) is cut into pieces of
``span`` positions; piece ``k`` (the runs of ``[k * span, (k + 1) * span)``, cut at its
bounds) is the object ``maps/<name>``: zlib of little-endian int64 ``[runs, 3]``, the
inline form without base64. ``name`` is 32 random hex digits drawn for that write: an
object is never written twice, so a piece read once is never stale, and only the writer
whose commit replaced the last record naming a piece deletes it. The record names the
pieces: ``{"runs": n, "span": span, "pieces": [[k, name, runs], ...]}``. See
``docs/design/ring.md``, "Step 3".

Here: the record's form of the pieces, and a map read back from the pieces a record names
through the :class:`PieceSource` its caller gives (the store's location). Writing pieces,
and reading them as files, :mod:`zarr_rb.core.pieces` and
:class:`zarr_rb.engine.forked.FilePieces`.
"""

from __future__ import annotations

import collections
import re
import threading
import zlib
from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np

from zarr_rb.errors import StoreCorruptedError
from zarr_rb.format import runs as _runs
from zarr_rb.format.ring import invalid_metadata
from zarr_rb.format.runs import RunMap, no_overflow, parse_run_map

MAPS_GROUP = "maps"
"""Where the pieces are, under the store's root."""

_NAME = re.compile(r"[0-9a-f]{32}")
_MAX_SPAN = 2**40
_CACHED_BYTES = 256 * 2**20
"""Decoded pieces kept, by name, across records (a reader reads only the new ones)."""


class PieceSource(Protocol):
    """Where a record's pieces are read from: the store's location."""

    def read(self, key: str) -> bytes | None: ...

    def identity(self) -> tuple[str, ...]: ...


class MapPieceMissingError(StoreCorruptedError):
    """A piece the record names is not there: the record moved since it was read (its
    writer deleted the pieces it replaced), or the store is damaged."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


def encode_piece(runs: np.ndarray) -> bytes:
    return zlib.compress(np.ascontiguousarray(runs, dtype="<i8").tobytes(), 1)


def is_piece_key(key: str) -> bool:
    """Whether ``key`` names a piece (not a temporary of one being written)."""
    group, _, name = key.partition("/")
    return group == MAPS_GROUP and _NAME.fullmatch(name) is not None


def piece_keys(maps: Iterable[RunMap | None]) -> set[str]:
    """The objects a record that holds ``maps`` names (those it keeps in pieces)."""
    keys: set[str] = set()
    for runs in maps:
        if runs is not None and len(runs) > _runs.INLINE_RUNS and runs.stored():
            held = runs.held_pieces().tolist()
            keys.update(f"{MAPS_GROUP}/{runs.names[k][0]}" for k in held)
    return keys


def parse_map(value: object, *, rows: int, pieces: PieceSource | None) -> RunMap | None:
    """A run map from the record (untrusted), inline or in pieces (read from ``pieces``)."""
    if not (isinstance(value, Mapping) and "pieces" in value):
        return parse_run_map(value, rows=rows)

    def bad(what: str) -> StoreCorruptedError:
        return invalid_metadata(what, value)

    span, entries, total = value.get("span"), value.get("pieces"), value.get("runs")
    if not (isinstance(span, int) and _is_int(span) and 1 <= span <= _MAX_SPAN):
        raise bad(f"a map's 'span' to be an integer in [1, {_MAX_SPAN}]")
    if not (isinstance(total, int) and _is_int(total) and 0 <= total <= rows):
        raise bad(f"a map's 'runs' to count at most {rows} runs")
    if not (isinstance(entries, list) and len(entries) <= rows // span + 1):
        raise bad("a map's 'pieces' to be a list of [piece, name, runs]")
    parsed: list[tuple[int, str, int]] = []
    for entry in entries:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and _is_int(entry[0])
            and isinstance(entry[1], str)
            and _NAME.fullmatch(entry[1]) is not None
            and _is_int(entry[2])
        ):
            raise bad("map pieces [piece, 32 hex digits, runs]")
        k, name, count = entry
        if not (0 <= k * span < rows and 1 <= count <= span):
            raise bad(f"map pieces inside the {rows} positions, of 1 to {span} runs")
        if parsed and k <= parsed[-1][0]:
            raise bad("map pieces sorted by piece, each once")
        parsed.append((k, name, count))
    if sum(count for _, _, count in parsed) != total:
        raise bad(f"map pieces that hold {total} runs in all")
    if pieces is None:
        raise StoreCorruptedError(
            "the record keeps a map in pieces, which this reader cannot read (it reads the "
            "record alone): open the store with zarr_rb.open or ZarrStorage",
        )
    return _assembled(pieces, span, tuple(parsed), rows)


_ASSEMBLED: collections.OrderedDict[tuple[object, ...], RunMap] = collections.OrderedDict()
_ASSEMBLED_MAPS = 4
_DECODED: collections.OrderedDict[tuple[object, ...], np.ndarray] = collections.OrderedDict()
_decoded_bytes = 0
_CACHE_LOCK = threading.Lock()


def _assembled(
    source: PieceSource, span: int, parsed: tuple[tuple[int, str, int], ...], rows: int
) -> RunMap:
    key = (source.identity(), span, parsed, rows)
    with _CACHE_LOCK:
        known = _ASSEMBLED.get(key)
    if known is not None:
        return known
    arrays = [_piece(source, span, k, name, count) for k, name, count in parsed]
    if not arrays:
        arrays = [np.empty((0, 3), np.int64)]
    starts, firsts, counts = (np.concatenate([a[:, c] for a in arrays]) for c in range(3))
    if starts.size and int(starts[-1] + counts[-1]) > rows:
        raise invalid_metadata(f"map pieces inside [0, {rows})", parsed[-1])
    # Each piece holds its runs merged; a run cut at a piece's bound joins again.
    bounds = np.cumsum([len(a) for a in arrays])[:-1]
    bounds = bounds[(bounds > 0) & (bounds < starts.size)]
    before = bounds - 1
    join = (starts[bounds] == starts[before] + counts[before]) & (
        firsts[bounds] == firsts[before] + counts[before]
    )
    if join.any():
        joined = bounds[join]
        for at in joined[::-1].tolist():  # (backwards: a run cut into several joins whole)
            counts[at - 1] += counts[at]
        keep = np.ones(starts.size, dtype=bool)
        keep[joined] = False
        starts, firsts, counts = starts[keep], firsts[keep], counts[keep]
    names = {k: (name, count) for k, name, count in parsed}
    out = RunMap.from_columns(starts, firsts, counts, span=span, names=names)
    with _CACHE_LOCK:
        _ASSEMBLED[key] = out
        while len(_ASSEMBLED) > _ASSEMBLED_MAPS:
            _ASSEMBLED.popitem(last=False)
    return out


def _piece(source: PieceSource, span: int, k: int, name: str, count: int) -> np.ndarray:
    """Piece ``k`` as object ``name`` holds it (decoded once per name and source, and
    checked once per place: a damaged record may name a piece read before at another)."""
    global _decoded_bytes
    key = (source.identity(), name, k, span)
    with _CACHE_LOCK:
        known = _DECODED.get(key)
    if known is None:
        object_key = f"{MAPS_GROUP}/{name}"
        data = source.read(object_key)
        if data is None:
            raise MapPieceMissingError(
                f"the map piece {object_key!r} that the commit record names is missing",
                key=object_key,
            )
        known = _decode(data, count, k, span, object_key)
        with _CACHE_LOCK:
            _DECODED[key] = known
            _decoded_bytes += known.nbytes
            while _decoded_bytes > _CACHED_BYTES and len(_DECODED) > 1:
                _, dropped = _DECODED.popitem(last=False)
                _decoded_bytes -= dropped.nbytes
    if len(known) != count:
        raise invalid_metadata(f"map piece {name} to hold {count} runs", len(known))
    return known


def _decode(data: bytes, count: int, k: int, span: int, where: str) -> np.ndarray:
    def bad(what: str) -> StoreCorruptedError:
        return StoreCorruptedError(f"the map piece {where!r} is damaged: expected {what}")

    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(data, count * 24 + 1)
    except zlib.error:
        raise bad("zlib-compressed int64 runs") from None
    if len(raw) != count * 24 or inflater.unconsumed_tail or not inflater.eof:
        raise bad(f"{count} runs of 3 int64, whole")
    runs = np.frombuffer(raw, dtype="<i8").astype(np.int64).reshape(count, 3)
    runs.flags.writeable = False
    starts, firsts, counts = runs[:, 0], runs[:, 1], runs[:, 2]
    lo, hi = k * span, (k + 1) * span
    if not (
        (counts >= 1).all()
        and (starts >= lo).all()
        and no_overflow(starts, firsts, counts, bound=hi)
        and int((starts + counts).max()) <= hi
        and (starts[1:] >= starts[:-1] + counts[:-1]).all()
    ):
        raise bad(f"runs sorted, disjoint and inside [{lo}, {hi})")
    return runs


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
