"""Large run maps kept in pieces, as objects: the writing of pieces (each under a new name,
written once). The pieces' form in the record, and the reading of a map back from them, is
:mod:`zarr_rb.format.pieces`; a local store's pieces read as files,
:class:`zarr_rb.engine.forked.FilePieces`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable

from zarr_rb.format import runs as _runs
from zarr_rb.format.pieces import MAPS_GROUP, encode_piece, is_piece_key, piece_keys
from zarr_rb.format.record import StoreMeta
from zarr_rb.format.runs import RunMap
from zarr_rb.locations import Location


class MapPieces:
    """The pieces of one store's run maps, as its writer stores and deletes them."""

    def __init__(self, location: Location, meta: StoreMeta, *, listed: bool) -> None:
        self._location = location
        self._listed: set[str] = set()
        """Pieces that were in the store when this writer opened it (``listed``) and that
        no record named then, or named since: those a writer that crashed between its
        pieces and its record left. Deleted after this writer's first commit (any writer
        whose pieces they are lost its swap to it)."""
        if listed:
            found = {key for key in location.list(MAPS_GROUP) if is_piece_key(key)}
            self._listed = found - piece_keys(meta.run_maps())

    def store(self, meta: StoreMeta) -> list[str]:
        """Write the pieces of the run maps of ``meta`` that its record will name and that
        are not stored yet (before the record that names them). Returns their keys."""
        return store_pieces(meta.run_maps(), self._location.write)

    def drop(self, before: StoreMeta, after: StoreMeta) -> None:
        """Delete the pieces that the record ``before`` named and ``after``, which replaced
        it, does not (a reader of ``before`` that meets one gone reads the record again)."""
        named = piece_keys(after.run_maps())
        stale = piece_keys(before.run_maps()) - named
        if self._listed:
            # Listed before the record that ``after`` replaced was read: a writer that
            # wrote them for a swap of its own against that record, or an earlier one,
            # lost it to this one.
            stale |= self._listed - named
            self._listed = set()
        for key in sorted(stale):
            self._location.delete(key)


def store_pieces(maps: Iterable[RunMap | None], write: Callable[[str, bytes], object]) -> list[str]:
    """Write the pieces of ``maps`` that are too large to keep inline and not stored yet
    (each under a new name; the maps remember them). Returns the keys written."""
    written = []
    for runs in maps:
        if runs is None or len(runs) <= _runs.INLINE_RUNS or runs.stored():
            continue
        for k in runs.held_pieces().tolist():
            if k in runs.names:
                continue
            piece = runs.piece(k)
            name = secrets.token_hex(16)
            key = f"{MAPS_GROUP}/{name}"
            write(key, encode_piece(piece))
            runs.names[k] = (name, len(piece))
            written.append(key)
    return written


def forget_pieces(maps: Iterable[RunMap | None], keys: Iterable[str]) -> None:
    """The pieces ``keys`` are not stored after all (their record was not published, and
    they are deleted): ``maps`` no longer name them (a next record writes them again)."""
    names = {key.rpartition("/")[2] for key in keys}
    for runs in maps:
        if runs is not None:
            for k in [k for k, (name, _) in runs.names.items() if name in names]:
                del runs.names[k]
