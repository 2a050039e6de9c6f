"""A store as a map-style PyTorch ``Dataset``, for offline RL with a ``DataLoader``.

How it relates to ``rb.sample()``: a replay buffer samples batches (with replacement, or as
its sampler says), in the training process, and applies its transforms. A
:class:`ReplayDataset` is indexed by position, one item per committed row (``len(ds)``
of them, holes left out), so a ``DataLoader`` visits every row once per epoch, with
``shuffle=True`` in random order, read by its worker processes; no transform is applied.
:class:`TorchRLBatches` draws the batches with one of TorchRL's samplers instead
(``SliceSampler`` for trajectories, prioritized samplers need their buffer's priorities
and are not for this).

The dataset pickles as its path and keys: each worker opens the store read-only (TorchRL
makes ``spawn`` the default start method when it is imported). Workers forked from a
process that used TensorStore (``multiprocessing_context="fork"``) cannot use it, and read
local stores with zarr-python instead; object stores need ``"spawn"`` or ``"forkserver"``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import Dataset, Sampler

from zarr_rb.analysis._keys import KeyLike, public_key
from zarr_rb.analysis.rows import StoredRows, open_rows
from zarr_rb.core.dtypes import TORCH_DTYPES, from_numpy
from zarr_rb.errors import NotSupportedError, RowIndexError
from zarr_rb.format.schema import LeafSpec
from zarr_rb.locations import StoreURL, is_remote
from zarr_rb.util.fork import tensorstore_usable


class ReplayDataset(Dataset[TensorDict]):
    """The committed rows of a store as a map-style ``Dataset`` of TensorDicts.

    Item ``i`` holds the chosen keys of the ``i``-th readable row and its ``"index"`` in the
    storage (a row number, or ``[time, env]`` for ``ndim=2``). The rows are those of the
    commit read when the dataset was made (a writer's later rows are not added).

    Examples:
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> from torch.utils.data import DataLoader
        >>> with zarr_rb.ZarrStorage(100, "runs/pong.zarr") as storage:
        ...     storage.set(torch.arange(10), TensorDict(
        ...         {"observation": torch.ones(10, 3), "next": {"reward": torch.ones(10)}}, [10]))
        >>> ds = zarr_rb.open("runs/pong.zarr").dataset(keys=["observation", ("next", "reward")])
        >>> loader = DataLoader(ds, batch_size=4, shuffle=True, collate_fn=torch.stack)
        >>> next(iter(loader))["observation"].shape
        torch.Size([4, 3])
    """

    def __init__(
        self,
        path: StoreURL,
        *,
        keys: Iterable[KeyLike] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        view = open_rows(path, storage_options=storage_options)
        chosen = view.keys() if keys is None else list(keys)
        self._url = view.url
        self._options = dict(storage_options or {})
        self._leaves = tuple(_tensor_leaf(view, key) for key in chosen)
        self._rows = view.rows
        self._envs = view.shape[1] if view.ndim == 2 else None
        self._holes = np.flatnonzero(~view.valid)
        self._readers: dict[int, Any] = {os.getpid(): view.select(*chosen)}

    @property
    def url(self) -> str:
        return self._url

    @property
    def storage_options(self) -> dict[str, Any]:
        return dict(self._options)

    @property
    def keys(self) -> list[KeyLike]:
        return [public_key(leaf.key) for leaf in self._leaves]

    def __len__(self) -> int:
        return (self._rows - self._holes.size) * (self._envs or 1)

    @property
    def envs(self) -> int | None:
        """Environments of an ``ndim=2`` store (``None`` for ``ndim=1``)."""
        return self._envs

    def __getstate__(self) -> dict[str, Any]:
        # Pickled as a handle: each process opens its own reader.
        return {**self.__dict__, "_readers": {}}

    # --- positions and rows ----------------------------------------------------------------

    def rows_of(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The storage rows (and environments, ``ndim=2``) of dataset positions."""
        n = len(self)
        if positions.size and (positions.min() < -n or positions.max() >= n):
            raise RowIndexError(
                f"dataset of {n} rows of {self._url!r}: positions "
                f"{positions[(positions < -n) | (positions >= n)][:5].tolist()} are out of range"
            )
        positions = positions % n if n else positions
        steps, envs = (positions, None) if self._envs is None else np.divmod(positions, self._envs)
        # The k-th readable row: k plus the holes at or before it.
        shifted = self._holes - np.arange(self._holes.size)
        return steps + np.searchsorted(shifted, steps, side="right"), envs

    def positions_of(self, rows: np.ndarray) -> np.ndarray:
        """Dataset positions of storage rows (``ndim=1``), e.g. a TorchRL sampler's index."""
        if self._envs is not None:
            raise NotSupportedError("positions of rows are for ndim=1 stores")
        bad = (rows < 0) | (rows >= self._rows) | np.isin(rows, self._holes)
        if bad.any():
            raise RowIndexError(
                f"rows {rows[bad][:5].tolist()} are not readable rows of {self._url!r}"
            )
        return rows - np.searchsorted(self._holes, rows)

    # --- items -------------------------------------------------------------------------

    def __getitem__(self, position: int) -> TensorDict:
        return self.__getitems__([position])[0]

    def __getitems__(self, positions: Sequence[int]) -> list[TensorDict]:
        """The items at ``positions``, read together (a ``DataLoader`` fetches a batch so)."""
        rows, envs = self.rows_of(np.asarray(positions, dtype=np.int64).reshape(-1))
        batch = self._read(rows, envs)
        index = torch.from_numpy(rows)
        if envs is not None:
            index = torch.stack([index, torch.from_numpy(envs)], dim=-1)
        batch.set("index", index)
        return list(batch.unbind(0))

    def _read(self, rows: np.ndarray, envs: np.ndarray | None) -> TensorDict:
        reader = self._readers.get(os.getpid())
        if reader is None:
            reader = self._readers[os.getpid()] = self._open_reader()
        if isinstance(reader, _ForkedRows):
            return reader.read(rows, envs)
        rows_read: TensorDict = reader.read_rows(rows, envs)
        return rows_read

    def _open_reader(self) -> Any:
        if tensorstore_usable():
            return open_rows(self._url, storage_options=self._options).select(*self.keys)
        if is_remote(self._url):
            raise NotSupportedError(
                f"store {self._url!r}: a DataLoader worker forked from a process that used "
                "TensorStore cannot read an object store; pass "
                "multiprocessing_context='spawn' (or 'forkserver') to the DataLoader"
            )
        return _ForkedRows(Path(self._url), self._leaves, self._envs)


class _ForkedRows:
    """Rows read with zarr-python, in a process forked from one that used TensorStore."""

    def __init__(self, root: Path, leaves: Sequence[LeafSpec], envs: int | None) -> None:
        from zarr_rb.engine.forked import ForkedReader

        self._reader = ForkedReader(root, leaves)
        self._leaves = leaves
        self._envs = envs

    def read(self, rows: np.ndarray, envs: np.ndarray | None) -> TensorDict:
        values = self._reader.read(rows)
        out = {}
        for leaf in self._leaves:
            value = values[leaf.key]
            if envs is not None:
                value = value[np.arange(rows.size), envs]
            out[leaf.key] = from_numpy(value, TORCH_DTYPES[leaf.dtype])
        return TensorDict(out, batch_size=[rows.size])


def _tensor_leaf(view: StoredRows, key: KeyLike) -> LeafSpec:
    leaf: LeafSpec = view.leaf(view.key_of(key))
    if leaf.value != "tensor":
        raise NotSupportedError(
            f"key {key!r} of {view.url!r} holds {leaf.value} rows, which a ReplayDataset does "
            "not batch; read them with zarr_rb.open(path).episode(i) or view[rows]"
        )
    return leaf


class TorchRLBatches(Sampler[list[int]]):
    """Batches of dataset positions drawn by one of TorchRL's samplers, for
    ``DataLoader(ds, batch_sampler=TorchRLBatches(ds, SliceSampler(num_slices=8), 256))``:
    the batches ``rb.sample()`` would draw from a buffer on the store, read by the
    ``DataLoader``'s workers."""

    def __init__(
        self,
        dataset: ReplayDataset,
        sampler: Any,
        batch_size: int,
        *,
        num_batches: int | None = None,
    ) -> None:
        from zarr_rb.torchrl.storage import ZarrStorage

        if dataset.envs is not None:
            raise NotSupportedError("TorchRLBatches draws from ndim=1 stores")
        self._dataset = dataset
        self._sampler = sampler
        self._batch_size = int(batch_size)
        self._num_batches = num_batches
        self.storage = ZarrStorage(
            path=dataset.url, read_only=True, storage_options=dataset.storage_options
        )

    def __len__(self) -> int:
        if self._num_batches is not None:
            return self._num_batches
        return max(1, len(self._dataset) // self._batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(len(self)):
            index, _info = self._sampler.sample(self.storage, self._batch_size)
            if isinstance(index, tuple):  # one index tensor per storage dimension
                (index,) = index
            rows = torch.as_tensor(index).reshape(-1).cpu().numpy()
            yield self._dataset.positions_of(rows).tolist()
