"""``zarr_rb.open``: a store as a read-only dataset, for notebooks and offline RL.

A :class:`View` takes no lock and writes nothing; it sees the rows of the last commit it
read (holes, rows a crash or a repair withdrew, are reported and never read) and moves to
a newer commit on :meth:`View.refresh`, or at a read that finds rows the writer moved
since (an episode is then found again in the newer commit's rows). Opening reads the
commit record, not a row. Its rows, keys and reads are those of
:class:`~zarr_rb.analysis.rows.StoredRows`; a view adds episodes and the other libraries'
forms (dask, xarray, a PyTorch ``Dataset``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from tensordict import TensorDict

from zarr_rb.analysis._keys import KeyLike, public_key
from zarr_rb.analysis.arrays import to_dask, to_xarray
from zarr_rb.analysis.dataset import ReplayDataset
from zarr_rb.analysis.episodes import Episodes, find_episodes, find_keys
from zarr_rb.analysis.rows import Column, StoredRows
from zarr_rb.errors import RowsNotCommittedError
from zarr_rb.locations import StoreURL
from zarr_rb.torchrl import data_kinds
from zarr_rb.torchrl.storage import ZarrStorage
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    import xarray

__all__ = ["Column", "View", "open"]


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
        >>> import torch, zarr_rb
        >>> from tensordict import TensorDict
        >>> steps = TensorDict({
        ...     "observation": torch.arange(6.0).unsqueeze(1),
        ...     "next": {"reward": torch.ones(6), "done": torch.tensor([0, 0, 1, 0, 0, 1]).bool()},
        ... }, [6])
        >>> with zarr_rb.ZarrStorage(100, "runs/pong.zarr") as storage:
        ...     storage.set(torch.arange(6), steps)
        >>> view = zarr_rb.open("runs/pong.zarr")
        >>> len(view.episodes)                      # a table, one row per episode
        2
        >>> view.episode(1)["observation"].squeeze(1)  # that episode's rows
        tensor([3., 4., 5.])
    """
    storage = ZarrStorage(
        path=path, read_only=True, storage_options=storage_options, history=history
    )
    return View(
        storage,
        episode_key=None if episode_key is None else data_kinds.key_tuple(episode_key),
        reward_key=None if reward_key is None else data_kinds.key_tuple(reward_key),
    )


class View(StoredRows):
    """A read-only view of a store's committed rows, or of some of its keys."""

    def __init__(
        self,
        storage: ZarrStorage,
        *,
        keys: Iterable[Key] | None = None,
        episode_key: Key | None = None,
        reward_key: Key | None = None,
    ) -> None:
        super().__init__(storage, keys=keys)
        self._episode_key = episode_key
        self._reward_key = reward_key
        self._episodes: tuple[tuple[int, int], Episodes] | None = None

    def select(self, *keys: KeyLike) -> View:
        """A view of some keys only: nothing else is read through it."""
        return View(
            self.storage,
            keys=[self.key_of(k) for k in keys],
            episode_key=self._episode_key,
            reward_key=self._reward_key,
        )

    # --- episodes ----------------------------------------------------------------------

    def _stamp(self) -> tuple[int, int]:
        """The rows this view reads now: a read finding rows the writer moved since moves
        it to the newest commit (the store's version), and its length with it."""
        return (self.storage.store.version, self.rows)

    def _episode_index(self) -> Episodes:
        """The episodes of the rows as they are now (found again after the view moved to a
        newer commit, and until no read moved it while they were found)."""
        for _ in range(_ATTEMPTS):
            stamp = self._stamp()
            if self._episodes is not None and self._episodes[0] == stamp:
                return self._episodes[1]
            schema = self._schema
            dtypes = {} if schema is None else {leaf.key: leaf.dtype for leaf in schema.leaves}
            keys = find_keys(dtypes, key=self._episode_key, reward_key=self._reward_key)
            whole = View(self.storage)
            length = stamp[1]
            try:
                episodes = find_episodes(
                    functools.partial(_first_rows, whole, length),
                    keys,
                    length=length,
                    capacity=self.capacity,
                    cursor=self.cursor,
                    valid=self.valid[:length],
                    envs=self.shape[1] if self.ndim == 2 else None,
                )
            except (ValueError, IndexError):
                if self._stamp() == stamp:
                    raise
                continue  # a read moved the view to a commit of another length: again
            if self._stamp() == stamp:  # (else its keys were read from several commits)
                self._episodes = (stamp, episodes)
        raise _kept_changing(self.url)

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
        for _ in range(_ATTEMPTS):
            episodes = self._episode_index()
            stamp = self._stamp()
            rows = episodes.rows(number)
            envs = None
            if episodes.env is not None:
                envs = np.full(rows.size, episodes.env[number % len(episodes)])
            out = self.read_rows(rows, envs)
            if self._stamp() == stamp:  # (else they are the rows of another commit)
                return out
        raise _kept_changing(self.url)

    # --- other libraries -----------------------------------------------------------------

    def to_dask(self) -> dict[KeyLike, Any]:
        """Each tensor key as a lazy dask array over the committed rows, one chunk per block
        of the store (its shards). Holes read as zeros (see :attr:`valid`)."""
        return to_dask(self)

    def to_xarray(self) -> xarray.Dataset:
        """An ``xarray.Dataset`` of the tensor keys (lazy, on dask), with the store's
        dimension names and a ``valid`` variable (``False`` for holes)."""
        return to_xarray(self)

    def dataset(self, keys: Iterable[KeyLike] | None = None) -> ReplayDataset:
        """A map-style PyTorch ``Dataset`` of the committed rows (see
        :class:`~zarr_rb.analysis.ReplayDataset`)."""
        chosen = self.keys() if keys is None else [public_key(self.key_of(k)) for k in keys]
        return ReplayDataset(self.url, keys=chosen, storage_options=self.storage_options)


def _first_rows(view: View, length: int, key: Key) -> np.ndarray:
    """Rows ``[0, length)`` of ``key`` (however many rows the view shows by then)."""
    return view.numpy(key, np.arange(length))


_ATTEMPTS = 20
"""Reads of an episode (or of the episodes) tried while the writer's commits move the rows."""


def _kept_changing(url: str) -> RowsNotCommittedError:
    return RowsNotCommittedError(
        f"store {url!r}: the writer kept moving the rows while the episodes were read "
        f"({_ATTEMPTS} attempts); read again, or read a save, whose rows do not move "
        "(zarr_rb.load(path, read_only=True, version=...))"
    )
