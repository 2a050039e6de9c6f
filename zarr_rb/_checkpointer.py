"""TorchRL's ``rb.dumps(path)`` / ``rb.loads(path)`` route for :class:`ZarrStorage`.

``rb.dumps(dir)`` asks the storage to dump itself into ``dir/storage``:

* when ``dir`` is the store itself (or ``dir/storage`` is), the rows are already on
  disk: the storage flushes and leaves a small pointer file, nothing is copied;
* anywhere else, ``dir/storage`` becomes an independent zarr_rb store (a snapshot).

``rb.loads(dir)`` accepts both, and also the memory-mapped layout TorchRL's own
``LazyMemmapStorage`` dumps, streamed in blocks into this storage.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrl.data.replay_buffers.checkpointers import TensorStorageCheckpointer

from zarr_rb._engine import ROOT_METADATA
from zarr_rb._format import ATTRS_KEY
from zarr_rb._torchrl_state import copy_rows, copy_store

if TYPE_CHECKING:
    from zarr_rb.storage import ZarrStorage

POINTER = "zarr_rb_storage.json"
TORCHRL_METADATA = "storage_metadata.json"


def _is_store(path: Path) -> bool:
    try:
        document = json.loads((path / ROOT_METADATA).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False
    return isinstance(document, dict) and ATTRS_KEY in document.get("attributes", {})


class ZarrStorageCheckpointer(TensorStorageCheckpointer):  # type: ignore[misc]
    """Dumps a :class:`ZarrStorage` by flushing it in place, or by snapshotting it.

    With save or load hooks registered (``rb.register_save_hook``), dumps and loads take
    TorchRL's own route instead, through the hooks: the rows are read, transformed and
    written in TorchRL's layout.
    """

    def dumps(self, storage: ZarrStorage, path: str | os.PathLike[str]) -> None:
        if self._save_hooks:
            super().dumps(storage, Path(path))
            return
        path = Path(path).absolute()
        storage.flush()
        if storage.path in (path, path.parent):
            if path != storage.path:
                path.mkdir(exist_ok=True)
            pointer = {
                "store": os.path.relpath(storage.path, path),
                "length": len(storage),
                "cursor": storage.cursor,
            }
            (path / POINTER).write_text(json.dumps(pointer))
            return
        if _is_store(path):
            shutil.rmtree(path)  # a previous dump of ours: replace it
        storage._store.location.snapshot_to(path, progress=False)

    def loads(self, storage: ZarrStorage, path: str | os.PathLike[str]) -> None:
        path = Path(path).absolute()
        pointer_file = path / POINTER
        if pointer_file.is_file():
            pointer = json.loads(pointer_file.read_text())
            source = (path / pointer["store"]).resolve()
            length, cursor = int(pointer["length"]), int(pointer["cursor"])
        elif _is_store(path):
            source = path
            from zarr_rb.storage import ZarrStorage as _ZarrStorage

            with _ZarrStorage(path=path, read_only=True) as other:
                length, cursor = len(other), other.cursor
        elif (path / TORCHRL_METADATA).is_file():
            if self._load_hooks:
                super().loads(storage, path)
            else:
                self._load_torchrl_layout(storage, path)
            return
        else:
            raise FileNotFoundError(
                f"{str(path)!r} holds neither a zarr_rb store nor a TorchRL storage dump",
            )
        if source != storage.path.resolve():
            copy_store(source, storage)
        storage.restore(length=length, cursor=cursor)

    @staticmethod
    def _load_torchrl_layout(storage: ZarrStorage, path: Path) -> None:
        """Stream a ``LazyMemmapStorage`` dump (memory-mapped TensorDict) into ``storage``."""
        from tensordict import TensorDict

        metadata = json.loads((path / TORCHRL_METADATA).read_text())
        if metadata.get("is_pytree"):
            raise NotImplementedError("loading pytree-based TorchRL storage dumps is not supported")
        source: Any = TensorDict.load_memmap(path)
        length = int(metadata["len"])
        per_row = math.prod(source.batch_size[1 : storage.ndim])
        rows = min(source.shape[0], -(-length // per_row))
        copy_rows(source, storage, rows=rows)
        storage.restore(length=length, cursor=rows % source.shape[0])
