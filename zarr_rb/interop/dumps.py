"""Replay buffers from TorchRL's own ``rb.dumps`` layout into zarr_rb stores.

:func:`import_torchrl` turns a directory written by TorchRL's ``rb.dumps(dir)`` (a buffer
on ``LazyMemmapStorage`` or ``LazyTensorStorage``) into a zarr_rb store that
:func:`zarr_rb.load` rebuilds on its own. :func:`~zarr_rb.interop.export.export_torchrl`
goes the other way: a store saved with :func:`zarr_rb.save` becomes a directory that
TorchRL alone restores with ``rb.loads(dir)``.

Both stream the rows in blocks of about :data:`BLOCK_BYTES` bytes, so memory stays
bounded whatever the size of the buffer, and show a progress bar while rows are copied.

Examples:
    >>> import torch, zarr_rb
    >>> from tensordict import TensorDict
    >>> from torchrl.data import LazyMemmapStorage, TensorDictPrioritizedReplayBuffer
    >>> from zarr_rb.interop import export_torchrl, import_torchrl
    >>> old = TensorDictPrioritizedReplayBuffer(
    ...     alpha=0.7, beta=0.5, storage=LazyMemmapStorage(100_000))
    >>> _ = old.extend(TensorDict({"obs": torch.ones(100, 3)}, [100]))
    >>> old.dumps("ckpt")                               # TorchRL's own checkpoint
    >>> rb = TensorDictPrioritizedReplayBuffer(         # ... into a zarr_rb store
    ...     alpha=0.7, beta=0.5, storage=zarr_rb.ZarrStorage(100_000, "runs/run1.zarr"))
    >>> import_torchrl("ckpt", rb, progress=False)
    PosixPath('.../runs/run1.zarr')
    >>> rb.storage.close()
    >>> len(zarr_rb.load("runs/run1.zarr"))
    100
    >>> export_torchrl("runs/run1.zarr", "ckpt_out", progress=False)  # ... and back
    PosixPath('.../ckpt_out')
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from torchrl.data.replay_buffers.samplers import PrioritizedSampler, SamplerWithoutReplacement
from torchrl.data.replay_buffers.writers import RoundRobinWriter, TensorDictMaxValueWriter

from zarr_rb.api import save
from zarr_rb.core.open import Mode
from zarr_rb.errors import (
    ReadOnlyError,
    SchemaMismatchError,
    UnsupportedDataError,
)
from zarr_rb.state import check_savable
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.checkpointer import (
    TORCHRL_METADATA,
    ZarrStorageCheckpointer,
    is_store_dir,
    open_torchrl_dump,
    read_dump_json,
)
from zarr_rb.torchrl.data_kinds import nbytes_per_row
from zarr_rb.torchrl.storage import ZarrStorage
from zarr_rb.util.progress import copy_in_blocks

__all__ = ["BLOCK_BYTES", "buffer_like_dump", "import_torchrl"]

BLOCK_BYTES: int = 64 * 2**20
"""Bytes of rows held in RAM at once while copying (at least one row per block)."""

_BUFFER_METADATA = "buffer_metadata.json"
# Files TorchRL's samplers and writers write in their ``dumps`` directory, used to tell
# which kind of component made a dump (TorchRL does not record the class).
_PRIORITIZED_STATE = "sampler_metadata.json"
_WITHOUT_REPLACEMENT_STATE = "meta.json"
_WRITER_STATE = "metadata.json"


# --- shared helpers ----------------------------------------------------------------------------


def check_block_bytes(block_bytes: int | None) -> None:
    if block_bytes is not None and int(block_bytes) < 1:
        raise ValueError(f"expected block_bytes >= 1 (or None for BLOCK_BYTES), got {block_bytes}")


def resolve_block_bytes(block_bytes: int | None) -> int:
    # BLOCK_BYTES is read at call time so that it can be tuned (and patched) module-wide.
    return BLOCK_BYTES if block_bytes is None else int(block_bytes)


# --- import ------------------------------------------------------------------------------------


def import_torchrl(
    source_dir: str | os.PathLike[str],
    buffer: Any,
    *,
    progress: bool = True,
    block_bytes: int | None = None,
) -> Path | str:
    """Import a directory written by TorchRL's ``rb.dumps(dir)`` into a zarr_rb store.

    TorchRL's dump does not record which buffer, sampler and writer classes made it, so
    the caller passes ``buffer``: a replay buffer built the same way as the dumped one
    but on a :class:`~zarr_rb.ZarrStorage`, whose path is the destination. The rows are
    streamed into that store in blocks of about ``block_bytes``; the sampler, writer,
    generator, transform state and batch size are restored by TorchRL's own
    ``rb.loads`` route; then :func:`zarr_rb.save` writes that state next to the data, so
    that :func:`zarr_rb.load` alone rebuilds the buffer.

    Rows the destination store already holds are overwritten; its length becomes that of
    the dump. Like TorchRL's ``rb.loads``, this unpickles the dump's ``prefetch.pkl`` (and
    reads its ``transform.t`` with ``torch.load``): import only dumps you trust.

    Args:
        source_dir: the directory given to ``rb.dumps`` (it holds ``storage/``,
            ``buffer_metadata.json`` and, depending on the components, ``sampler/``,
            ``writer/`` and ``rng_state/``). Dumps of ``LazyMemmapStorage`` and
            ``LazyTensorStorage`` buffers are accepted.
        buffer: a ``ReplayBuffer``, ``TensorDictReplayBuffer``, ``PrioritizedReplayBuffer``
            or ``TensorDictPrioritizedReplayBuffer`` on a writable ``ZarrStorage`` of the
            same capacity, with the same sampler and writer classes as the dumped buffer.
        progress: show a progress bar while rows are copied.
        block_bytes: bytes of rows held in RAM at once (default :data:`BLOCK_BYTES`).

    Returns:
        The path of the store (``buffer.storage.path``); ``buffer`` itself holds the
        imported state too.

    Raises:
        FileNotFoundError: ``source_dir`` is missing or is not a whole-buffer TorchRL dump.
        UnsupportedDataError: ``buffer`` is not on a ``ZarrStorage``, a component of it has
            no zarr_rb state adapter, or the dump holds data a store cannot hold.
        ReadOnlyError: ``buffer``'s storage was opened read-only.
        SchemaMismatchError: capacity, batch dimensions, sampler or writer kind differ
            between the dump and ``buffer`` (nothing is written then).
        StoreCorruptedError: a JSON file of the dump cannot be parsed.

    An error raised by TorchRL while it restores the sampler or writer (after the rows
    were copied) leaves the store with the dumped rows and without a new saved state.

    Examples:
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
        >>> from zarr_rb.interop import import_torchrl
        >>> old = TensorDictReplayBuffer(storage=LazyMemmapStorage(1000), batch_size=32)
        >>> _ = old.extend(TensorDict({"obs": torch.ones(50, 3)}, [50]))
        >>> old.dumps("old_ckpt")
        >>> new = TensorDictReplayBuffer(
        ...     storage=zarr_rb.ZarrStorage(1000, "runs/imported.zarr"), batch_size=32)
        >>> path = import_torchrl("old_ckpt", new, progress=False)
        >>> new.storage.close()
        >>> rb = zarr_rb.load(path)           # later, from the path alone
        >>> len(rb), rb.sample()["obs"].shape
        (50, torch.Size([32, 3]))
    """
    check_block_bytes(block_bytes)
    source = Path(source_dir).absolute()
    storage = _import_destination(buffer, source)
    _check_torchrl_dump(source)
    _check_components(buffer, storage, source)
    checkpointer = _StreamingCheckpointer(progress=progress, block_bytes=block_bytes)
    previous = storage.checkpointer
    storage.checkpointer = checkpointer
    try:
        buffer.loads(source)
    finally:
        storage.checkpointer = previous
    writer = buffer.writer
    if isinstance(writer, RoundRobinWriter) and len(storage) and storage.schema is not None:
        # TorchRL's storage dump has no cursor: the writer's is the row written next.
        storage.restore(
            length=len(storage), cursor=int(compat.get(writer, "_cursor")) % storage.schema.rows
        )
    return save(buffer, progress=progress)


def buffer_like_dump(
    source_dir: str | os.PathLike[str], path: str | os.PathLike[str], *, mode: Mode = "w-"
) -> Any:
    """A replay buffer built as the one TorchRL dumped into ``source_dir`` was, on a new
    ``ZarrStorage`` at ``path``, for :func:`import_torchrl` (what ``zarr-rb import`` does).

    The dump's files tell its capacity and its components' kinds: a prioritized sampler
    (with its ``alpha``, ``beta``, ``eps``), a sampler without replacement, a
    ``TensorDictMaxValueWriter``, or TorchRL's defaults. TensorDict rows get a
    ``TensorDict*ReplayBuffer``. A dump of an ``ndim>1`` storage or of custom
    components needs the buffer built by hand.
    """
    from tensordict import is_tensor_collection
    from torchrl.data import (
        PrioritizedReplayBuffer,
        ReplayBuffer,
        TensorDictPrioritizedReplayBuffer,
        TensorDictReplayBuffer,
    )

    source = Path(source_dir).absolute()
    _check_torchrl_dump(source)
    rows, _ = open_torchrl_dump(source / "storage")
    storage = ZarrStorage(int(rows.shape[0]), path, mode=mode)
    tensordict = is_tensor_collection(rows)
    writer = TensorDictMaxValueWriter() if _dumped_max_value_writer(source) else None
    components: dict[str, Any] = {"storage": storage}
    if writer is not None:
        components["writer"] = writer
    prioritized = source / "sampler" / _PRIORITIZED_STATE
    if prioritized.is_file():
        state = read_dump_json(prioritized)
        cls = TensorDictPrioritizedReplayBuffer if tensordict else PrioritizedReplayBuffer
        return cls(
            alpha=float(state["_alpha"]),
            beta=float(state["_beta"]),
            eps=float(state["_eps"]),
            **components,
        )
    if (source / "sampler" / _WITHOUT_REPLACEMENT_STATE).is_file():
        components["sampler"] = SamplerWithoutReplacement()
    return (TensorDictReplayBuffer if tensordict else ReplayBuffer)(**components)


def _dumped_max_value_writer(source: Path) -> bool:
    state = source / "writer" / _WRITER_STATE
    return state.is_file() and "rank_key" in read_dump_json(state)


def _import_destination(buffer: Any, source: Path) -> ZarrStorage:
    storage = getattr(buffer, "storage", None)
    if not isinstance(storage, ZarrStorage):
        kind = type(buffer).__name__ if storage is None else type(storage).__name__
        raise UnsupportedDataError(
            f"import_torchrl({str(source)!r}, buffer) needs a replay buffer whose storage is "
            f"a zarr_rb.ZarrStorage, got {kind}; build the buffer like the dumped one, with "
            "storage=zarr_rb.ZarrStorage(max_size, path)",
        )
    if storage.read_only:
        raise ReadOnlyError(
            f"cannot import {str(source)!r} into read-only store {str(storage.path)!r}; "
            "open the destination with read_only=False",
        )
    # Fail before copying any row if zarr_rb.save would refuse the buffer afterwards.
    check_savable(buffer)
    return storage


def _check_torchrl_dump(source: Path) -> None:
    if not source.exists():
        raise FileNotFoundError(f"TorchRL dump {str(source)!r} does not exist")
    if not source.is_dir():
        raise FileNotFoundError(
            f"{str(source)!r} is a file; import_torchrl expects the directory given to "
            "TorchRL's rb.dumps(dir)",
        )
    if is_store_dir(source):
        raise FileNotFoundError(
            f"{str(source)!r} is a zarr_rb store, not a TorchRL dump (no "
            f"storage/{TORCHRL_METADATA}); open it with zarr_rb.load({str(source)!r})",
        )
    if (source / TORCHRL_METADATA).is_file():
        raise FileNotFoundError(
            f"{str(source)!r} holds a storage-only dump (storage.dumps(dir)), not a whole "
            f"buffer (no storage/{TORCHRL_METADATA}); dump the buffer with rb.dumps(dir), or "
            "load rows only with buffer.storage.loads(dir)",
        )
    for required in (Path("storage") / TORCHRL_METADATA, Path(_BUFFER_METADATA)):
        if not (source / required).is_file():
            raise FileNotFoundError(
                f"{str(source)!r} is not a TorchRL buffer dump: {str(source / required)!r} is "
                "missing; pass the directory given to TorchRL's rb.dumps(dir)",
            )


def _check_components(buffer: Any, storage: ZarrStorage, source: Path) -> None:
    """Refuse, before any write, a dump whose shape or components differ from ``buffer``'s."""
    rows, _ = open_torchrl_dump(source / "storage")
    shape = tuple(rows.shape)
    where = f"TorchRL dump {str(source)!r}"
    if len(shape) < storage.ndim:
        raise SchemaMismatchError(
            f"{where} has batch shape {list(shape)}, fewer dimensions than the destination's "
            f"ndim={storage.ndim}; build the ZarrStorage with the ndim of the dumped storage",
        )
    per_row = math.prod(shape[1 : storage.ndim])
    capacity = (
        storage.schema.rows if storage.schema is not None else -(-storage.max_size // per_row)
    )
    if capacity != shape[0]:
        raise SchemaMismatchError(
            f"{where} holds a storage of {shape[0] * per_row} elements (batch shape "
            f"{list(shape[: storage.ndim])}) but store {str(storage.path)!r} has "
            f"max_size={storage.max_size}; build ZarrStorage(max_size={shape[0] * per_row}, "
            "...) like the dumped storage",
        )
    _check_sampler(buffer.sampler, source / "sampler", where)
    _check_writer(buffer.writer, source / "writer", where)


def _kind_error(where: str, role: str, dumped: str, built: Any) -> SchemaMismatchError:
    return SchemaMismatchError(
        f"{where} was written by a buffer with {dumped}, but the destination buffer's "
        f"{role} is a {type(built).__name__}; TorchRL's dump does not record the {role} "
        f"class: build the destination buffer with the {role} the dumped buffer used",
    )


def _check_sampler(sampler: Any, path: Path, where: str) -> None:
    prioritized_dump = (path / _PRIORITIZED_STATE).is_file()
    without_replacement_dump = (path / _WITHOUT_REPLACEMENT_STATE).is_file()
    if isinstance(sampler, PrioritizedSampler):
        if not prioritized_dump:
            raise _kind_error(where, "sampler", "no prioritized sampler state", sampler)
        capacity = int(read_dump_json(path / _PRIORITIZED_STATE)["_max_capacity"])
        if capacity != compat.get(sampler, "_max_capacity"):
            raise SchemaMismatchError(
                f"{where}: the dumped PrioritizedSampler has max_capacity={capacity}, the "
                f"destination's has {compat.get(sampler, '_max_capacity')}; build it with "
                f"max_capacity={capacity}",
            )
    elif prioritized_dump:
        raise _kind_error(where, "sampler", "a prioritized sampler", sampler)
    if isinstance(sampler, SamplerWithoutReplacement) != without_replacement_dump:
        dumped = (
            "a sampler without replacement"
            if without_replacement_dump
            else "no sampler-without-replacement state"
        )
        raise _kind_error(where, "sampler", dumped, sampler)


def _check_writer(writer: Any, path: Path, where: str) -> None:
    state_file = path / _WRITER_STATE
    if not state_file.is_file():
        raise FileNotFoundError(
            f"{where} has no writer state ({str(state_file)!r} is missing); pass the "
            "directory given to TorchRL's rb.dumps(dir)",
        )
    max_value_dump = _dumped_max_value_writer(path.parent)
    if isinstance(writer, TensorDictMaxValueWriter) != max_value_dump:
        dumped = "a TensorDictMaxValueWriter" if max_value_dump else "a round-robin writer"
        raise _kind_error(where, "writer", dumped, writer)


class _StreamingCheckpointer(ZarrStorageCheckpointer):
    """Loads a TorchRL storage dump (checked beforehand) in blocks, with a progress bar."""

    def __init__(self, *, progress: bool, block_bytes: int | None) -> None:
        super().__init__()
        self.progress = progress
        self.block_bytes = block_bytes

    def loads(self, storage: ZarrStorage, path: str | os.PathLike[str]) -> None:
        source, length = open_torchrl_dump(Path(path).absolute())
        capacity = int(source.shape[0])
        per_row = math.prod(source.shape[1 : storage.ndim])
        rows = min(capacity, -(-length // per_row))

        def read(start: int, stop: int) -> Any:
            return source[start:stop].clone()

        def write(where: slice, block: Any) -> None:
            storage.set(where, block, set_cursor=False)

        copy_in_blocks(
            read,
            write,
            rows=rows,
            row_nbytes=nbytes_per_row(source),
            block_bytes=resolve_block_bytes(self.block_bytes),
            progress=self.progress,
            desc="import rows",
        )
        storage.restore(length=length, cursor=rows % capacity)
