"""Stores saved by zarr_rb into TorchRL's own ``rb.dumps`` layout.

:func:`export_torchrl` writes a store saved with :func:`zarr_rb.save` as a directory that
TorchRL alone restores with ``rb.loads(dir)`` (the reverse of
:func:`~zarr_rb.interop.dumps.import_torchrl`). Rows are streamed in blocks of about
:data:`~zarr_rb.interop.dumps.BLOCK_BYTES` bytes, written with ``pwrite`` into the
memory-mapped files TorchRL reads, so memory stays bounded whatever the size of the store.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zarr_rb.api import load
from zarr_rb.errors import (
    NotAStoreError,
    NotSupportedError,
)
from zarr_rb.format.schema import LeafSpec
from zarr_rb.interop.dumps import check_block_bytes, resolve_block_bytes
from zarr_rb.locations import is_remote
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.checkpointer import (
    TORCHRL_METADATA,
    is_store_dir,
)
from zarr_rb.torchrl.storage import ZarrStorage
from zarr_rb.util.progress import copy_in_blocks, format_bytes

__all__ = ["ExportSize", "export_torchrl"]


def export_torchrl(
    source: str | os.PathLike[str],
    dest_dir: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    transform: Any = None,
    progress: bool = True,
    block_bytes: int | None = None,
) -> Path:
    """Export a store saved with :func:`zarr_rb.save` to the layout of TorchRL's ``rb.dumps``.

    A replay buffer built the same way on ``LazyMemmapStorage`` then restores it with
    TorchRL alone, ``rb.loads(dest_dir)``: same length and rows, same sampler state (e.g.
    priorities), writer cursor, generator state, transform state and batch size. The rows
    are written as memory-mapped files in ``dest_dir/storage``, in blocks of about
    ``block_bytes``; ``source`` is not modified.

    What TorchRL's layout cannot hold does not come across: TorchRL restores no storage
    cursor (a ``SliceSampler`` on a full buffer may then cut trajectories at another row)
    and a plain-tensor (not TensorDict) storage can only be loaded by TorchRL into a
    buffer that was already filled once.

    Args:
        source: a zarr_rb store holding a buffer saved with :func:`zarr_rb.save` (a path,
            or a URL such as ``s3://bucket/runs/pong.zarr``).
        dest_dir: a new or empty directory (TorchRL's layout is memory-mapped files).
        storage_options: for an object-store ``source`` (see :class:`~zarr_rb.ZarrStorage`).
        allow_pickle: unpickle the saved transforms (see :func:`zarr_rb.load`); only for
            stores you trust.
        transform: a transform built like the saved one, to restore its state without
            unpickling (see :func:`zarr_rb.load`).
        progress: show a progress bar while rows are copied.
        block_bytes: bytes of rows held in RAM at once (default
            :data:`~zarr_rb.interop.dumps.BLOCK_BYTES`).

    Returns:
        The absolute path of ``dest_dir``.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        NotAStoreError: ``source`` is not a zarr_rb store.
        NoSavedBufferError: ``source`` holds data but no buffer saved with ``zarr_rb.save``.
        FileExistsError: ``dest_dir`` exists and is not an empty directory.
        zarr_rb.PickleNotAllowedError: the buffer has transforms; pass ``allow_pickle`` or
            ``transform``.
        ValueError: the store has never been written to (TorchRL cannot dump an
            uninitialised storage).
        NotSupportedError: the store holds Python values or rows of different lengths,
            which TorchRL's layout cannot keep.

    Examples:
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
        >>> from zarr_rb.interop import export_torchrl
        >>> rb = TensorDictReplayBuffer(storage=zarr_rb.ZarrStorage(1000, "runs/a.zarr"))
        >>> _ = rb.extend(TensorDict({"obs": torch.ones(50, 3)}, [50]))
        >>> zarr_rb.save(rb)
        PosixPath('.../runs/a.zarr')
        >>> export_torchrl("runs/a.zarr", "ckpt", progress=False)
        PosixPath('.../ckpt')
        >>> torchrl_rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(1000))
        >>> torchrl_rb.loads("ckpt")
        >>> len(torchrl_rb)
        50
    """
    from torchrl.data import LazyMemmapStorage

    check_block_bytes(block_bytes)
    src: Path | str = str(source) if is_remote(source) else Path(source).absolute()
    dest = Path(dest_dir).absolute()
    if isinstance(src, Path):
        _check_export_source(src)
    _check_export_destination(dest)
    rb = load(
        src,
        storage_options=storage_options,
        allow_pickle=allow_pickle,
        transform=transform,
        read_only=True,
    )
    storage: ZarrStorage = rb.storage
    created = not dest.exists()
    try:
        schema = storage.schema
        if schema is None:
            raise ValueError(
                f"store {str(src)!r} has never been written to, and TorchRL cannot dump an "
                "uninitialised storage; extend the buffer before exporting it",
            )
        kept_apart = [leaf for leaf in schema.leaves if leaf.value not in ("tensor", "lengths")]
        if kept_apart:
            raise NotSupportedError(
                f"store {str(src)!r} holds {_kinds_of(kept_apart)}, which TorchRL's "
                "memory-mapped layout cannot keep (LazyMemmapStorage keeps one string for "
                "all rows, and no rows of different lengths); load it into RAM with "
                "zarr_rb.load(path, storage='memory') instead",
            )
        memmap = LazyMemmapStorage(
            storage.max_size,
            scratch_dir=dest / "storage",
            ndim=storage.ndim,
            auto_cleanup=False,
        )
        rows = compat.length_along_dim0(storage)
        size = ExportSize(
            rows=rows, nbytes=rows * schema.row_nbytes, apparent=schema.rows * schema.row_nbytes
        )
        _check_room(dest, size)
        if progress:
            print(f"export: {size.describe()} into {dest}", file=sys.stderr)

        def read(start: int, stop: int) -> Any:
            return storage.read_rows(np.arange(start, stop, dtype=np.int64))

        # The first row through TorchRL allocates the files; then every block is written
        # into them with pwrite, not through their memory maps, whose pages would stay in
        # this process's memory (its RSS) as long as the maps do: the whole buffer.
        memmap.set(slice(0, 1), read(0, 1), set_cursor=False)
        with _MemmapFiles(compat.get(memmap, "_storage")) as files:
            copy_in_blocks(
                read,
                files.write,
                rows=rows,
                row_nbytes=schema.row_nbytes,
                block_bytes=resolve_block_bytes(block_bytes),
                progress=progress,
                desc="export rows",
            )
        compat.set_length(memmap, len(storage))
        if rows:
            compat.set_last_cursor(memmap, (storage.cursor - 1) % schema.rows)
        # TorchRL's own ReplayBuffer.dumps writes the layout, around the memory-mapped
        # copy: the storage only refreshes its metadata (it dumps into its own files).
        previous = compat.swap_storage(rb, memmap)
        try:
            rb.dumps(dest)
        finally:
            compat.swap_storage(rb, previous)
    except BaseException:
        _remove_partial_export(dest, created=created)
        raise
    finally:
        storage.close()
    return dest


@dataclasses.dataclass(frozen=True, slots=True)
class ExportSize:
    """What an export writes: ``rows`` rows of ``nbytes`` bytes, into files of ``apparent``
    bytes (TorchRL's layout holds the storage's whole capacity; the files are sparse past
    the rows written)."""

    rows: int
    nbytes: int
    apparent: int

    def describe(self) -> str:
        text = f"{self.rows:,} rows, {format_bytes(self.nbytes)}"
        if self.apparent > self.nbytes:
            text += (
                f" (in files of {format_bytes(self.apparent)} apparent size, sparse past the "
                "rows: TorchRL's layout holds the buffer's whole capacity)"
            )
        return text


def _check_room(dest: Path, size: ExportSize) -> None:
    """Refuse an export that the disk under ``dest`` has no room for, before writing."""
    parent = next(path for path in (dest, *dest.parents) if path.exists())
    free = shutil.disk_usage(parent).free
    if size.nbytes > free:
        raise OSError(
            errno.ENOSPC,
            f"export of {size.describe()} into {str(dest)!r} needs more than the "
            f"{format_bytes(free)} free there; nothing was written. Free space or export "
            "to another disk",
        )


class _MemmapFiles:
    """The files behind the memory-mapped leaves of a ``LazyMemmapStorage``, written row
    blocks at a time with ``pwrite`` (through the page cache, never mapped here)."""

    def __init__(self, storage: Any) -> None:
        self._targets: list[tuple[Any, int, int]] = []
        try:
            for key, tensor in storage.items(include_nested=True, leaves_only=True):
                row_bytes = tensor[0].numel() * tensor.element_size()
                fd = os.open(tensor.filename, os.O_WRONLY)
                self._targets.append((key, fd, row_bytes))
        except BaseException:
            self.close()
            raise

    def write(self, where: slice, block: Any) -> None:
        for key, fd, row_bytes in self._targets:
            data = block.get(key).contiguous().reshape(-1).view(torch.uint8).numpy()
            view = memoryview(data)
            offset = where.start * row_bytes
            while view.nbytes:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written

    def close(self) -> None:
        for _, fd, _ in self._targets:
            os.close(fd)
        self._targets = []

    def __enter__(self) -> _MemmapFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_export_source(src: Path) -> None:
    if not src.exists():
        raise FileNotFoundError(
            f"zarr_rb store {str(src)!r} does not exist; pass the path of a store saved "
            "with zarr_rb.save",
        )
    if src.is_dir() and not is_store_dir(src) and (src / "storage" / TORCHRL_METADATA).is_file():
        raise NotAStoreError(
            f"{str(src)!r} is a TorchRL dump, not a zarr_rb store; convert it with "
            "zarr_rb.import_torchrl",
        )


def _check_export_destination(dest: Path) -> None:
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(
            f"export destination {str(dest)!r} is a file; pass a new or empty directory",
        )
    if dest.is_dir() and any(dest.iterdir()):
        raise FileExistsError(
            f"export destination {str(dest)!r} is not empty; pass a new or empty directory "
            "(or remove it first)",
        )


def _remove_partial_export(dest: Path, *, created: bool) -> None:
    """Undo a failed export: ``dest`` was new or empty, so all of its content is ours."""
    if created:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for child in dest.iterdir() if dest.is_dir() else ():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _kinds_of(leaves: list[LeafSpec]) -> str:
    """``"rows of different lengths at ('tokens',), str values at ('prompt',)"``."""
    return ", ".join(
        f"{'rows of different lengths' if leaf.value == 'ragged' else leaf.value + ' values'} "
        f"at {leaf.key!r}"
        for leaf in leaves
    )
