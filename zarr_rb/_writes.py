"""A write the storage refuses leaves TorchRL's writer as it was.

TorchRL's writers move before they write: ``RoundRobinWriter`` advances its cursor and
write count, ``TensorDictMaxValueWriter`` pushes the new rows into its heap, and only then
call ``storage.set``. When a ZarrStorage refuses the rows (a string UTF-8 cannot encode, a
value of another type...), the writer would point past rows that were never written, and
the next write would leave them empty. The writers of buffers on a ZarrStorage get their
``add`` and ``extend`` routed through :func:`_undone_on_refusal`.

On a store of several writers, ``add`` returns the position its row got (the writer's
cursor, which it returns, is its own, and other writers moved past it): the sampler
(priorities) and the caller get that one, as ``extend``'s index rewritten in place.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from zarr_rb import _compat

if TYPE_CHECKING:
    from zarr_rb.storage import ZarrStorage


def guard_writer(writer: Any, storage: ZarrStorage) -> None:
    """Route ``writer``'s writes so that a write ``storage`` refuses puts it back (once per
    writer; writers zarr_rb does not know keep their own ways, and so do the writers of a
    ``compilable=True`` storage, whose writes ``torch.compile`` traces)."""
    if _compat.writer_state(writer) is None or _compat.is_compilable(storage):
        return
    for name in ("add", "extend"):
        _compat.route_method(writer, name, functools.partial(_undone_on_refusal, storage=storage))


def _undone_on_refusal(method: Any, *args: Any, storage: ZarrStorage, **kwargs: Any) -> Any:
    writer = method.__self__
    before = _compat.writer_state(writer)
    begun = storage.writes_begun
    try:
        index = method(*args, **kwargs)
    except BaseException:
        # Put the writer back only if the storage refused the rows before touching anything
        # (a write that failed on disk keeps its rows for a retry, where the writer put
        # them, and the length that counts them).
        if before is not None and storage.writes_begun == begun:
            _compat.restore_writer_state(writer, before)
        raise
    placed = storage.placed_last()  # (set by the writes of a shared store only)
    if method.__name__ != "add" or placed is None or placed.size != 1:
        return index
    if isinstance(index, torch.Tensor):
        return torch.full_like(index, int(placed[0]))
    return int(placed[0])
