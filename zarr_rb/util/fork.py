"""TensorStore and ``fork()``: TensorStore's threads do not survive a fork, and it aborts a
child that uses it after its parent did. zarr_rb raises a typed error in such a child
instead, and its readers that must work there (the workers of a PyTorch ``DataLoader``,
which forks by default) read with zarr-python instead (see :mod:`zarr_rb.engine.forked`).
"""

from __future__ import annotations

import os

from zarr_rb.errors import NotSupportedError

_started_in: int | None = None
"""The process that started TensorStore (made a context), if one did."""


def tensorstore_usable() -> bool:
    """Whether this process may use TensorStore: it is not a fork of one that did."""
    return _started_in is None or _started_in == os.getpid()


_START_ANOTHER_WAY = (
    "start processes with the 'spawn' or 'forkserver' method "
    "(multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context='spawn')), "
    "which pass a storage to the child as a handle it opens again"
)


def refuse_if_forked(where: str) -> None:
    """Raise :class:`~zarr_rb.errors.NotSupportedError` in a fork of a process that used
    TensorStore, before ``where`` uses it (a store opened before the fork too)."""
    if not tensorstore_usable():
        raise NotSupportedError(
            f"{where}: this process was forked from one that used TensorStore, whose threads "
            f"do not survive a fork; {_START_ANOTHER_WAY}. zarr_rb.open(path).dataset() "
            "reads local stores in forked workers too"
        )


def refuse_parents_store(where: str, parent: int) -> None:
    """Raise :class:`~zarr_rb.errors.NotSupportedError`: ``where`` was opened by process
    ``parent``, and this process is a fork of it. The store stays the parent's: its rows in
    RAM, its writer's hold and its threads (TensorStore's, and any call under way) are not
    the child's, whose copy would commit, release or delete them under the parent."""
    raise NotSupportedError(
        f"{where} was opened by process {parent}, and this process ({os.getpid()}) is a "
        f"fork of it: the store stays the parent's; {_START_ANOTHER_WAY} "
        "(zarr_rb.open(path).dataset() reads local stores in forked DataLoader workers)"
    )


def starting_tensorstore(where: str) -> None:
    """Called before TensorStore starts in this process (a context is made for ``where``)."""
    global _started_in
    refuse_if_forked(where)
    _started_in = os.getpid()
