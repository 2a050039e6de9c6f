"""Large run maps kept in pieces, as objects: the writing of pieces (each under a new name,
written once). The pieces' form in the record, and the reading of a map back from them, is
:mod:`zarr_rb.format.pieces`; a local store's pieces read as files,
:class:`zarr_rb.engine.forked.FilePieces`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable

from zarr_rb.format import runs as _runs
from zarr_rb.format.pieces import MAPS_GROUP, encode_piece
from zarr_rb.format.runs import RunMap


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
