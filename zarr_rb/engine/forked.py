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
from zarr_rb.format.record import parse_current_record
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
        self._arrays = self._open()

    def _open(self) -> dict[tuple[str, ...], Any]:
        import zarr

        return {
            leaf.key: zarr.open_array(store=self._store, path=leaf.path, mode="r")
            for leaf in self._leaves
        }

    def _commit(self) -> Commit:
        def read() -> dict[str, Any]:
            document: dict[str, Any] = load_json((self._root / "zarr.json").read_bytes())
            return document

        try:
            pieces = FilePieces(self._root)
            return parse_current_record(read(), read, where=self._where, pieces=pieces).commit
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise StoreCorruptedError(
                f"{self._where}: cannot read its commit record: {err}"
            ) from None

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
            ):
                self._arrays = self._open()  # the writer added slots since they were opened
            out = {key: np.asarray(a.oindex[physical])[inverse] for key, a in self._arrays.items()}
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
