"""Reads of a local store with zarr-python, for processes forked from one that used
TensorStore (which cannot run there, see :mod:`zarr_rb.util.fork`). zarr-python resets its I/O
loop after a fork.

Only what the last commit declares readable is read, and never a torn transition: the
commit record is read before and after the rows, and the read repeated if it moved (the
seqlock of :mod:`zarr_rb.util.seqlock`, as :mod:`zarr_rb.core.reader` reads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zarr_rb.errors import RowsNotCommittedError, StoreCorruptedError
from zarr_rb.format.commit import Commit
from zarr_rb.format.index_key import INDEX_KEY, put_positions
from zarr_rb.format.messages import preview_rows
from zarr_rb.format.names import array_path, frame_ids_path
from zarr_rb.format.record import StoreMeta, parse_current_record
from zarr_rb.format.schema import LeafSpec
from zarr_rb.util.io import load_json
from zarr_rb.util.seqlock import seqlock_read

_RETRIES = 20


class FilePieces:
    """The pieces of the store at ``root`` on a local disk, read as files (by readers that
    read the store's files without its location)."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def read(self, key: str) -> bytes | None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            return (self._root / key).read_bytes()
        return None

    def identity(self) -> tuple[str, ...]:
        return ("files", str(self._root))


class ForkedReader:
    """Rows of some fixed-shape leaves of the local store at ``root``, read with zarr-python."""

    def __init__(self, root: Path, leaves: Sequence[LeafSpec]) -> None:
        from zarr.storage import LocalStore

        self._root = root
        self._where = f"store {str(root)!r}"
        self._leaves = list(leaves)
        self._store = LocalStore(root, read_only=True)
        meta = self._meta()
        schema = meta.schema
        # Leaves stored as frames: their ids, and the cells of their pair's first key.
        self._frames = {
            key: (stored.key, stored.stack)
            for stored in (schema.frames if schema is not None else ())
            for key in stored.keys
        }
        self._block_rows = meta.block_rows or 1
        self._arrays = self._open()

    def _open(self) -> dict[tuple[str, ...], Any]:
        import zarr

        out = {}
        for leaf in self._leaves:
            path = frame_ids_path(leaf.key) if leaf.key in self._frames else leaf.path
            out[leaf.key] = zarr.open_array(store=self._store, path=path, mode="r")
        for first, _ in self._frames.values():
            out[("", "cells", *first)] = zarr.open_array(
                store=self._store, path=array_path(first), mode="r"
            )
        return out

    def _meta(self) -> StoreMeta:
        def read() -> dict[str, Any]:
            document: dict[str, Any] = load_json((self._root / "zarr.json").read_bytes())
            return document

        try:
            pieces = FilePieces(self._root)
            return parse_current_record(read(), read, where=self._where, pieces=pieces)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise StoreCorruptedError(
                f"{self._where}: cannot read its commit record: {err}"
            ) from None

    def _commit(self) -> Commit:
        return self._meta().commit

    def _read_leaf(self, key: tuple[str, ...], physical: np.ndarray) -> np.ndarray:
        """Rows ``physical`` (unique, sorted) of the arrays, of ``key``."""
        array = self._arrays[key]
        if key not in self._frames:
            return np.asarray(array.oindex[physical])
        first, _ = self._frames[key]
        cells = self._arrays[("", "cells", *first)]
        per_row = int(cells.shape[1])
        named = np.asarray(array.oindex[physical]).astype(np.int64)  # [rows, (lanes,) stack]
        base = (physical - physical % self._block_rows) * per_row
        at = base.reshape(-1, *[1] * (named.ndim - 1)) + named
        wanted, where = np.unique(at // per_row, return_inverse=True)
        stored = np.asarray(cells.oindex[wanted]).reshape(wanted.size * per_row, -1)
        frames = stored[where.reshape(at.shape) * per_row + at % per_row]
        leaf = next(leaf for leaf in self._leaves if leaf.key == key)
        lanes = named[0].size // (
            named.shape[-1] or 1
        )  # (ids: [rows, stack] or [rows, lanes, stack])
        element = tuple(leaf.shape) if lanes == 1 else (lanes, *leaf.shape)
        out: np.ndarray = frames.reshape(physical.size, *element)
        return out

    def read(self, rows: np.ndarray) -> dict[tuple[str, ...], np.ndarray]:
        """``rows`` (any order, repeats allowed) of every leaf, as the last commit has them, in
        their stored dtypes (bfloat16 as its uint16 bits)."""
        unique, inverse = np.unique(rows, return_inverse=True)

        def read(commit: Commit) -> dict[tuple[str, ...], np.ndarray]:
            readable = commit.readable(unique)
            if not readable.all():
                raise RowsNotCommittedError(
                    f"{self._where}: rows {preview_rows(unique[~readable])} are not readable "
                    f"in commit {commit.generation} (length {commit.length}, holes "
                    f"{list(commit.holes)})",
                )
            # Positions live in the slots the commit's map gives their blocks.
            physical = commit.physical(unique)
            if physical.size and any(
                int(physical.max()) >= a.shape[0] for a in self._arrays.values()
            ):  # (the cells array has as many rows as the others)
                self._arrays = self._open()  # the writer added slots since they were opened
            out = {leaf.key: self._read_leaf(leaf.key, physical)[inverse] for leaf in self._leaves}
            if INDEX_KEY in out:
                out[INDEX_KEY] = put_positions(out[INDEX_KEY], rows)
            return out

        return seqlock_read(
            self._commit,
            read,
            lambda commit, _whole: self._commit().generation == commit.generation,
            attempts=_RETRIES,
            gave_up=lambda _: RowsNotCommittedError(
                f"{self._where}: rows kept changing while being read ({_RETRIES} attempts)"
            ),
        )
