"""TorchRL's ``rb.dumps(path)`` / ``rb.loads(path)`` route for :class:`ZarrStorage`.

``rb.dumps(dir)`` asks the storage to dump itself into ``dir/storage``:

* when ``dir`` is the store itself (or ``dir/storage`` is), the rows are already on
  disk: the storage flushes and leaves a small pointer file, nothing is copied;
* inside a checkpoint that ``torchrl.checkpoint`` is staging, the rows are kept as a
  version of the store and ``dir/storage`` holds a pointer to it
  (:mod:`zarr_rb.torchrl.checkpoint_versions`): a checkpoint costs metadata;
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
from typing import Any

import torch
from torchrl.data.replay_buffers.checkpointers import TensorStorageCheckpointer

from zarr_rb.errors import NotSupportedError, StoreCorruptedError, UnsupportedDataError
from zarr_rb.format.names import ATTRS_KEY
from zarr_rb.locations.base import ROOT_METADATA
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.checkpoint_versions import POINTER as VERSION_POINTER
from zarr_rb.torchrl.checkpoint_versions import dump_as_version, load_version
from zarr_rb.torchrl.reads import StorageReads
from zarr_rb.torchrl.state_dict import copy_rows, copy_store
from zarr_rb.util.io import load_json

POINTER = "zarr_rb_storage.json"
_SINGLE_TENSOR = "_-single-tensor-_"
"""TorchRL's name for the one leaf of a tensor storage's dump."""
TORCHRL_METADATA = "storage_metadata.json"


def is_store_dir(path: Path) -> bool:
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

    def dumps(self, storage: StorageReads, path: str | os.PathLike[str]) -> None:
        if self._save_hooks:
            super().dumps(storage, Path(path))
            return
        path = Path(path).absolute()
        staged = compat.checkpoint_stage(path)
        if staged is not None and not storage.read_only:
            dump_as_version(storage, path, *staged)
            return
        if isinstance(storage.path, Path) and storage.path in (path, path.parent):
            length, cursor, epoch = storage.commit_point()
            if path != storage.path:
                path.mkdir(exist_ok=True)
            pointer = {
                "store": os.path.relpath(storage.path, path),
                "length": length,
                "cursor": cursor,
                "epoch": epoch,
            }
            (path / POINTER).write_text(json.dumps(pointer))
            return
        storage.flush()  # (a flush that fails leaves the previous dump in place)
        if is_store_dir(path):
            shutil.rmtree(path)  # a previous dump of ours: replace it
        storage.snapshot_to(path)

    def loads(self, storage: StorageReads, path: str | os.PathLike[str]) -> None:
        path = Path(path).absolute()
        if (path / VERSION_POINTER).is_file():
            load_version(storage, path)
            return
        pointer_file = path / POINTER
        if pointer_file.is_file():
            pointer = json.loads(pointer_file.read_text())
            source = (path / pointer["store"]).resolve()
            length, cursor = int(pointer["length"]), int(pointer["cursor"])
            if isinstance(storage.path, Path) and source == storage.path.resolve():
                # Rows dumped in place: still the dumped ones only while nothing wrote over
                # them (a dump elsewhere is a snapshot, which nothing touches).
                storage.check_unchanged_since(
                    length=length, cursor=cursor, epoch=int(pointer.get("epoch", 0))
                )
        elif is_store_dir(path):
            source = path
            with type(storage)(path=path, read_only=True) as other:
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
        if not isinstance(storage.path, Path) or source != storage.path.resolve():
            copy_store(source, storage)
        storage.restore(length=length, cursor=cursor)

    def _load_torchrl_layout(self, storage: StorageReads, path: Path) -> None:
        """Stream a dump of TorchRL's tensor storages (a memory-mapped TensorDict, or
        tensor) into ``storage``, in blocks."""
        metadata = _read_metadata(path)
        if metadata.get("is_pytree") and list(metadata.get("metadata", {})) != [_SINGLE_TENSOR]:
            if not storage.initialized:
                raise NotSupportedError(
                    f"{str(path)!r} holds a TorchRL dump of a pytree, whose structure the "
                    "dump does not record: write one element of the same structure into the "
                    "storage first, then load",
                )
            # TorchRL's own loader writes each leaf into the storage's writable full view.
            super().loads(storage, path)
            storage.restore(length=len(storage), cursor=storage.rows_held % storage.rows)
            return
        source, length = open_torchrl_dump(path)
        per_row = math.prod(source.shape[1 : storage.ndim])
        rows = min(source.shape[0], -(-length // per_row))
        copy_rows(source, storage, rows=rows)
        storage.restore(length=length, cursor=rows % source.shape[0])


def read_dump_json(path: Path) -> Any:
    """The parsed JSON file ``path`` of a TorchRL dump (``rb.dumps(dir)``).

    Raises:
        StoreCorruptedError: it is not valid JSON, or nested too deep (the dump is damaged).
    """
    try:
        return load_json(path.read_bytes())
    except ValueError as error:
        raise StoreCorruptedError(
            f"{str(path)!r} is not valid JSON ({error}); the TorchRL dump is damaged, "
            "write it again with rb.dumps(dir)",
        ) from error


def _read_metadata(path: Path) -> dict[str, Any]:
    value = read_dump_json(path / TORCHRL_METADATA)
    if not isinstance(value, dict):
        raise StoreCorruptedError(f"{str(path / TORCHRL_METADATA)!r} is not a JSON object")
    return value


def open_torchrl_dump(path: Path) -> tuple[Any, int]:
    """The rows of a TorchRL tensor storage's dump (memory-mapped: nothing is read yet) and
    its length: a TensorDict, or one tensor.

    Raises:
        UnsupportedDataError: a dump of a pytree of several tensors.
    """
    from tensordict import MemoryMappedTensor, TensorDict

    metadata = _read_metadata(path)
    length = int(metadata["len"])
    if not metadata.get("is_pytree"):
        rows: Any = TensorDict.load_memmap(path)
        return rows, length
    leaves = metadata.get("metadata", {})
    if set(leaves) != {_SINGLE_TENSOR}:
        raise UnsupportedDataError(
            f"{str(path)!r} holds a pytree of {len(leaves)} tensors "
            f"({', '.join(sorted(leaves))}); zarr_rb imports TensorDict, tensorclass or "
            "single-tensor storages only",
        )
    spec = leaves[_SINGLE_TENSOR]
    dtype = getattr(torch, str(spec["dtype"]).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedDataError(f"{str(path)!r}: unknown dtype {spec['dtype']!r}")
    tensor = MemoryMappedTensor.from_filename(
        filename=path / f"{_SINGLE_TENSOR}.memmap", dtype=dtype, shape=torch.Size(spec["shape"])
    )
    return tensor, length
