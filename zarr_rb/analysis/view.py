"""``zarr_rb.open``: a store as a read-only dataset, for notebooks and offline RL.

A :class:`View` takes no lock and writes nothing; it sees the rows of the last commit it
read (holes, rows a crash or a repair withdrew, are reported and never read) and moves to
a newer commit only on :meth:`View.refresh`. Opening reads the commit record, not a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import TensorDict

from zarr_rb.analysis._keys import TENSOR_KEY, KeyLike, public_key, shown
from zarr_rb.analysis.episodes import Episodes, find_episodes, find_keys
from zarr_rb.core.dtypes import TORCH_DTYPES, numpy_dtype, to_numpy
from zarr_rb.core.format import LeafSpec, Schema, mask_to_ranges
from zarr_rb.errors import UnknownKeyError
from zarr_rb.locations import StoreURL
from zarr_rb.torchrl import compat, data_kinds, index_forms
from zarr_rb.torchrl.storage import ZarrStorage
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    import xarray

    from zarr_rb.analysis.dataset import ReplayDataset

_KINDS = {"tensor": "tensor", "ragged": "ragged"}


@dataclasses.dataclass(frozen=True, slots=True)
class Column:
    """One key of a store: the dtype and shape of one element (``None`` along the dimension
    whose length varies from row to row), and what it holds: ``"tensor"``, ``"ragged"``
    (rows of different lengths) or ``"values"`` (strings and other Python values)."""

    dtype: torch.dtype
    shape: tuple[int | None, ...]
    kind: str

    def __repr__(self) -> str:
        shape = ", ".join("*" if n is None else str(n) for n in self.shape)
        kind = "" if self.kind == "tensor" else f", {self.kind}"
        return f"Column({str(self.dtype).removeprefix('torch.')}[{shape}]{kind})"


def open(
    path: StoreURL,
    *,
    storage_options: Mapping[str, Any] | None = None,
    episode_key: KeyLike | None = None,
    reward_key: KeyLike | None = None,
    history: bool = False,
) -> View:
    """Open the store at ``path`` (a local path or an ``s3://`` URL) read-only.

    Args:
        storage_options: for an object store (see :class:`~zarr_rb.ZarrStorage`).
        episode_key: the key that marks episodes: a boolean flag (``True`` on an
            episode's last row) or integer trajectory ids. By default the first of
            ``("collector", "traj_ids")``, ``"episode"``, ``("next", "done")``, ``"done"``
            and ``terminated``/``truncated`` the store holds.
        reward_key: summed into each episode's return (default ``("next", "reward")`` or
            ``"reward"``).
        history: the rows of an archive (a store written with ``archive=True``): every row
            extended, in the order committed, across the ring's rounds, instead of the rows
            the ring holds now.

    Examples:
        >>> view = zarr_rb.open("runs/pong.zarr")
        >>> view.episodes                     # a table, one row per episode
        >>> view.episode(3)["observation"]    # that episode's frames
    """
    storage = ZarrStorage(
        path=path, read_only=True, storage_options=storage_options, history=history
    )
    return View(
        storage,
        episode_key=None if episode_key is None else data_kinds.key_tuple(episode_key),
        reward_key=None if reward_key is None else data_kinds.key_tuple(reward_key),
    )


class View:
    """A read-only view of a store's committed rows, or of some of its keys."""

    def __init__(
        self,
        storage: ZarrStorage,
        *,
        keys: Iterable[Key] | None = None,
        episode_key: Key | None = None,
        reward_key: Key | None = None,
    ) -> None:
        self.storage = storage
        """The read-only :class:`~zarr_rb.ZarrStorage` underneath (for TorchRL samplers)."""
        self._keys = None if keys is None else tuple(keys)
        self._episode_key = episode_key
        self._reward_key = reward_key
        self._episodes: tuple[tuple[int, int], Episodes] | None = None

    # --- what the store holds --------------------------------------------------------

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.storage.storage_options

    @property
    def _schema(self) -> Schema | None:
        return self.storage.schema

    def _leaves(self) -> list[LeafSpec]:
        """The leaves shown (lengths of ragged leaves are part of those)."""
        schema = self._schema
        if schema is None:
            return []
        leaves = [leaf for leaf in schema.leaves if leaf.value != "lengths"]
        if self._keys is not None:
            leaves = [leaf for leaf in leaves if leaf.key in self._keys]
        return leaves

    def __len__(self) -> int:
        """Elements (rows, times environments for ``ndim=2``) of the last commit read."""
        return len(self.storage) if self.storage.initialized else 0

    @property
    def rows(self) -> int:
        """Rows along the first (time) dimension."""
        return compat.length_along_dim0(self.storage) if self.storage.initialized else 0

    @property
    def shape(self) -> torch.Size:
        """``[rows]``, or ``[time, n_envs]`` for ``ndim=2``."""
        schema = self._schema
        return torch.Size((self.rows, *(() if schema is None else schema.batch_shape[1:])))

    @property
    def ndim(self) -> int:
        return int(self.storage.ndim)

    @property
    def capacity(self) -> int:
        """Rows along the first dimension the store holds at most (its ring)."""
        schema = self._schema
        return self.storage.max_size if schema is None else schema.rows

    @property
    def cursor(self) -> int:
        """The row the next write goes to (the oldest row, once the ring is full)."""
        return self.storage.cursor

    def keys(self) -> list[KeyLike]:
        """The keys, nested ones as tuples (as ``TensorDict.keys(True, True)``)."""
        return [public_key(leaf.key) for leaf in self._leaves()]

    @property
    def schema(self) -> dict[KeyLike, Column]:
        """Each key's element dtype, shape and kind."""
        out = {}
        for leaf in self._leaves():
            shape: tuple[int | None, ...] = leaf.shape
            if leaf.ragged:
                shape = (None, *leaf.shape)
            kind = _KINDS.get(leaf.value, "values")
            dtype = TORCH_DTYPES[leaf.dtype] if kind != "values" else torch.uint8
            out[public_key(leaf.key)] = Column(dtype=dtype, shape=shape, kind=kind)
        return out

    @property
    def valid(self) -> np.ndarray:
        """Which rows (along time) may be read: ``False`` for holes."""
        mask = np.ones(self.rows, dtype=bool)
        mask[self.storage._store.unreadable_rows()] = False
        return mask

    @property
    def holes(self) -> list[tuple[int, int]]:
        """Row ranges ``[start, stop)`` inside the length that cannot be read: withdrawn by
        a crash or a repair, and not written since."""
        return list(mask_to_ranges(~self.valid))

    def refresh(self) -> View:
        """Move to the writer's latest commit (rows, keys and holes)."""
        self.storage.refresh()
        return self

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        keys = ", ".join(f"{shown(k)}: {c!r}" for k, c in self.schema.items())
        holes = f", holes={self.holes}" if self.holes else ""
        return f"View({self.url!r}, shape={list(self.shape)}{holes}, keys={{{keys}}})"

    # --- rows --------------------------------------------------------------------------

    def select(self, *keys: KeyLike) -> View:
        """A view of some keys only: nothing else is read through it."""
        wanted = [self._key(k) for k in keys]
        return View(
            self.storage,
            keys=wanted,
            episode_key=self._episode_key,
            reward_key=self._reward_key,
        )

    def _key(self, key: KeyLike) -> Key:
        key = data_kinds.key_tuple(key)
        if not any(leaf.key == key for leaf in self._leaves()):
            held = ", ".join(shown(k) for k in self.keys()) or "no key"
            raise UnknownKeyError(f"{self.url!r} has no key {shown(key)}: it holds {held}")
        return key

    def _lazy(self) -> TensorDict:
        storage = self.storage
        columns, _ = storage.lazy_columns(self.rows)
        wanted = {leaf.key for leaf in self._leaves()}
        return TensorDict(
            {k or (TENSOR_KEY,): c for k, c in columns.items() if k in wanted},
            batch_size=self.shape,
        )

    def __getitem__(self, index: Any) -> Any:
        """A key: its column (lazy: ``view["obs"][17]`` reads one row). Rows (an int, a
        slice, an index tensor or a mask): a TensorDict of them; ints and slices stay lazy,
        index tensors and masks read the rows of this view's keys, together."""
        if index_forms.is_key(index):
            key = self._key(index)
            return self._lazy()[key or (TENSOR_KEY,)]
        if self.ndim == 1 and isinstance(index, (torch.Tensor, np.ndarray, list)):
            # Every key read together, from one commit (key by key, each could come from
            # another commit of a writer at work).
            try:
                picked = np.arange(self.rows)[np.asarray(index)]
            except IndexError:
                return self._lazy()[index]  # which says what is out of range
            if picked.ndim == 1:
                return self.read_rows(picked)
        return self._lazy()[index]

    def read_rows(self, rows: np.ndarray, envs: np.ndarray | None = None) -> TensorDict:
        """Rows (along time; with ``envs``, the elements ``(rows[i], envs[i])`` of an
        ``ndim=2`` store) of this view's keys, read together (never torn)."""
        schema = self._schema
        assert schema is not None
        leaves = [
            leaf
            for chosen in self._leaves()
            for leaf in ((chosen, chosen.lengths_leaf()) if chosen.ragged else (chosen,))
        ]
        values = self.storage._store.read(rows, [leaf.key for leaf in leaves])
        batch_shape = (rows.size, *schema.batch_shape[1:])
        if schema.kind == "tensor":
            out = TensorDict({TENSOR_KEY: values[()]}, batch_size=batch_shape)
        else:
            sub = dataclasses.replace(
                schema, kind="tensordict", leaves=tuple(leaves), tensorclass=None, treespec=None
            )
            out = data_kinds.build(values, schema=sub, batch_shape=batch_shape, device=None)
        if envs is not None:
            out = out[torch.arange(rows.size), torch.from_numpy(envs)]
        return out

    def numpy(self, key: KeyLike, rows: Any = None) -> np.ndarray:
        """The rows of one key as a NumPy array (bfloat16 as ``ml_dtypes.bfloat16``); holes
        read as zeros (see :attr:`valid`).

        ``rows`` picks rows as a NumPy index of the first dimension does: an integer gives
        one element (no row dimension), a slice, a list, an array of row numbers or a
        boolean mask give rows in that order and shape.
        """
        leaf = self._leaf(self._key(key))
        picked = np.arange(self.rows)[slice(None) if rows is None else rows]
        store = self.storage._store
        values = store.read(picked.reshape(-1), [leaf.key], unreadable_as_zeros=True)[leaf.key]
        out = to_numpy(values).view(numpy_dtype(leaf.dtype))
        return out.reshape((*picked.shape, *out.shape[1:]))

    def _leaf(self, key: Key) -> LeafSpec:
        return next(leaf for leaf in self._leaves() if leaf.key == key)

    # --- episodes ----------------------------------------------------------------------

    def _episode_index(self) -> Episodes:
        stamp = (self.storage._store.version, self.rows)
        if self._episodes is None or self._episodes[0] != stamp:
            schema = self._schema
            dtypes = {} if schema is None else {leaf.key: leaf.dtype for leaf in schema.leaves}
            keys = find_keys(dtypes, key=self._episode_key, reward_key=self._reward_key)
            whole = View(self.storage)
            episodes = find_episodes(
                whole.numpy,
                keys,
                length=self.rows,
                capacity=self.capacity,
                cursor=self.cursor,
                valid=self.valid,
                envs=self.shape[1] if self.ndim == 2 else None,
            )
            self._episodes = (stamp, episodes)
        return self._episodes[1]

    @property
    def episodes(self) -> Any:
        """One row per episode, oldest first: ``start``, ``stop`` (storage rows, ``stop``
        exclusive: ``stop <= start`` for an episode that wraps the ring), ``length``,
        ``return`` and ``complete`` (and ``env`` for ``ndim=2``, ``traj_id`` where
        trajectory ids mark episodes). A pandas DataFrame if pandas is installed, else a
        TensorDict. Read from small leaves only (flags, ids, rewards)."""
        return self._episode_index().table()

    def episode(self, number: int) -> TensorDict:
        """The rows of episode ``number`` (as numbered in :attr:`episodes`; negative from the
        newest), in the order they were written, with this view's keys."""
        episodes = self._episode_index()
        rows = episodes.rows(number)
        envs = None
        if episodes.env is not None:
            envs = np.full(rows.size, episodes.env[number % len(episodes)])
        return self.read_rows(rows, envs)

    # --- other libraries -----------------------------------------------------------------

    def to_dask(self) -> dict[KeyLike, Any]:
        """Each tensor key as a lazy dask array over the committed rows, one chunk per block
        of the store (its shards). Holes read as zeros (see :attr:`valid`)."""
        from zarr_rb.analysis.arrays import to_dask

        return to_dask(self)

    def to_xarray(self) -> xarray.Dataset:
        """An ``xarray.Dataset`` of the tensor keys (lazy, on dask), with the store's
        dimension names and a ``valid`` variable (``False`` for holes)."""
        from zarr_rb.analysis.arrays import to_xarray

        return to_xarray(self)

    def dataset(self, keys: Iterable[KeyLike] | None = None) -> ReplayDataset:
        """A map-style PyTorch ``Dataset`` of the committed rows (see
        :class:`~zarr_rb.analysis.ReplayDataset`)."""
        from zarr_rb.analysis.dataset import ReplayDataset

        chosen = self.keys() if keys is None else [public_key(self._key(k)) for k in keys]
        return ReplayDataset(self.url, keys=chosen, storage_options=self.storage_options)
