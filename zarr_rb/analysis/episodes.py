"""Episodes of a store, found from its small leaves: done flags or trajectory ids.

The rows of a ring buffer are not in the order they were written once it has wrapped: the
oldest row is at the cursor. Episodes are found in the order rows were written, per
environment for ``ndim=2`` stores (``[time, n_envs]``), and never across a hole (rows a
crash or a repair withdrew): an episode a hole cuts is two incomplete episodes.

Which key marks episodes is found as TorchRL's ``SliceSampler`` finds it: a trajectory id
key (``("collector", "traj_ids")``, then ``"episode"``), else a done flag
(``("next", "done")``, ``"done"``), else ``terminated``/``truncated`` flags. Trajectory ids
mark an episode per run of one id, as ``SliceSampler(traj_key=...)`` reads them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zarr_rb.analysis._keys import shown
from zarr_rb.errors import EpisodeIndexError, NoEpisodeFlagsError, UnknownKeyError
from zarr_rb.util.keys import Key

TRAJ_KEYS: tuple[Key, ...] = (("collector", "traj_ids"), ("episode",))
DONE_KEYS: tuple[Key, ...] = (("next", "done"), ("done",))
END_KEY_PAIRS: tuple[tuple[Key, Key], ...] = (
    (("next", "terminated"), ("next", "truncated")),
    (("terminated",), ("truncated",)),
)
REWARD_KEYS: tuple[Key, ...] = (("next", "reward"), ("reward",))


@dataclasses.dataclass(frozen=True, slots=True)
class EpisodeKeys:
    """The keys episodes are read from: a trajectory id key, or end flags (ORed together),
    or both (ids split, flags say whether an episode ended); and the reward key."""

    traj: Key | None
    ends: tuple[Key, ...]
    reward: Key | None

    @property
    def keys(self) -> list[Key]:
        """Every key read (all small leaves)."""
        return [k for k in (self.traj, *self.ends, self.reward) if k is not None]


def find_keys(
    dtypes: Mapping[Key, str], *, key: Key | None = None, reward_key: Key | None = None
) -> EpisodeKeys:
    """The keys to read episodes from, among the store's leaves (``key -> dtype``).

    ``key``: the key that marks episodes (a boolean flag, or integer trajectory ids);
    ``None`` looks for TorchRL's usual keys. ``reward_key``: ``None`` takes
    ``("next", "reward")`` or ``"reward"`` if the store holds one.
    """
    for given in (key, reward_key):
        if given is not None and given not in dtypes:
            raise UnknownKeyError(
                f"the store holds no key {shown(given)}; it holds {_names(dtypes)}"
            )
    if reward_key is None:
        reward_key = next((k for k in REWARD_KEYS if k in dtypes), None)
    ends = tuple(k for k in DONE_KEYS if k in dtypes)[:1]
    if not ends:
        ends = next((pair for pair in END_KEY_PAIRS if pair[0] in dtypes), ())
        ends = tuple(k for k in ends if k in dtypes)
    if key is not None:
        if dtypes[key] == "bool":
            return EpisodeKeys(traj=None, ends=(key,), reward=reward_key)
        if dtypes[key].startswith(("int", "uint")):
            return EpisodeKeys(traj=key, ends=ends, reward=reward_key)
        raise NoEpisodeFlagsError(
            f"key {shown(key)} holds {dtypes[key]} values; episodes are marked by a boolean "
            "flag (True on an episode's last row) or by integer trajectory ids",
        )
    traj = next((k for k in TRAJ_KEYS if k in dtypes), None)
    if traj is None and not ends:
        looked = [*TRAJ_KEYS, *DONE_KEYS, *(k for pair in END_KEY_PAIRS for k in pair)]
        raise NoEpisodeFlagsError(
            f"the store holds none of the keys that mark episodes ({_names(looked)}); it "
            f"holds {_names(dtypes)}. Name the key: zarr_rb.open(path, episode_key=...) "
            "(a boolean done flag or integer trajectory ids; --episode-key on the command line)"
        )
    return EpisodeKeys(traj=traj, ends=ends, reward=reward_key)


@dataclasses.dataclass(frozen=True)
class Episodes:
    """The episodes of a store, oldest first: numpy columns, one entry per episode.

    ``start`` and ``stop`` are storage rows (``stop`` exclusive, so ``stop <= start`` for an
    episode that wraps the ring) along the time dimension, ``env`` the environment column
    of an ``ndim=2`` store (``None`` for ``ndim=1``). ``complete``: the episode ends with a
    done flag (or the next trajectory starts) and its first rows are in the store: the
    oldest episode of a full ring, and one after a hole, may have lost theirs.
    """

    keys: EpisodeKeys
    order: np.ndarray
    """Storage rows along the time dimension, oldest first."""
    first: np.ndarray
    """Position in ``order`` of each episode's first row."""
    length: np.ndarray
    env: np.ndarray | None
    returns: np.ndarray
    complete: np.ndarray
    traj_id: np.ndarray | None

    def __len__(self) -> int:
        return int(self.first.size)

    @property
    def start(self) -> np.ndarray:
        return self.order[self.first] if len(self) else self.first

    @property
    def stop(self) -> np.ndarray:
        if not len(self):
            return self.first
        stops: np.ndarray = self.order[self.first + self.length - 1] + 1
        return stops

    def rows(self, episode: int) -> np.ndarray:
        """Storage rows (along time) of ``episode``, in the order they were written."""
        n = len(self)
        if not -n <= episode < n:
            raise EpisodeIndexError(
                f"episode {episode} is out of range: the store holds {n} episodes "
                f"(0..{n - 1}, or -{n}..-1 from the newest)"
                if n
                else f"episode {episode} is out of range: the store holds no episode"
            )
        episode %= n
        first = int(self.first[episode])
        return self.order[first : first + int(self.length[episode])]

    def columns(self) -> dict[str, np.ndarray]:
        """The table's columns, in the order shown."""
        out: dict[str, np.ndarray] = {"episode": np.arange(len(self))}
        if self.env is not None:
            out["env"] = self.env
        out.update(start=self.start, stop=self.stop, length=self.length, **{"return": self.returns})
        out["complete"] = self.complete
        if self.traj_id is not None:
            out["traj_id"] = self.traj_id
        return out

    def table(self) -> Any:
        """A pandas ``DataFrame`` indexed by episode if pandas is installed, else a
        TensorDict of the same columns."""
        columns = self.columns()
        try:
            import pandas
        except ImportError:
            import torch
            from tensordict import TensorDict

            return TensorDict(
                {name: torch.from_numpy(np.ascontiguousarray(c)) for name, c in columns.items()},
                batch_size=[len(self)],
            )
        return pandas.DataFrame(columns).set_index("episode")


def find_episodes(
    read: Callable[[Key], np.ndarray],
    keys: EpisodeKeys,
    *,
    length: int,
    capacity: int,
    cursor: int,
    valid: np.ndarray,
    envs: int | None = None,
) -> Episodes:
    """Episodes of a store of ``length`` rows along time out of ``capacity``, written up to
    ``cursor``. ``read(key)`` gives a key's ``[length, ...]`` rows (``[length, envs, ...]``
    for an ``ndim=2`` store of ``envs`` environments); ``valid`` says which rows may be
    read (``False``: a hole)."""
    full = length >= capacity > 0
    order = np.roll(np.arange(capacity), -cursor) if full else np.arange(length)
    n_envs = envs or 1

    def per_env(key: Key) -> np.ndarray:
        values = read(key)
        # Not reshape(..., -1): a store of no rows has no size to infer it from.
        per_row = math.prod(values.shape[1 if envs is None else 2 :])
        return values.reshape(length, n_envs, per_row)

    ends: np.ndarray | None = None
    for key in keys.ends:
        flags = np.asarray(per_env(key).any(axis=2))
        ends = flags if ends is None else ends | flags
    traj = None if keys.traj is None else per_env(keys.traj)[..., 0]
    valid = valid[order]
    parts = [
        _split(
            None if ends is None else ends[order, env],
            None if traj is None else traj[order, env],
            valid,
            full=full,
        )
        for env in range(n_envs)
    ]
    first = np.concatenate([p[0] for p in parts])
    stop = np.concatenate([p[1] for p in parts])
    env_of = np.repeat(np.arange(n_envs), [p[0].size for p in parts])
    if keys.reward is None:
        returns = np.full(first.size, np.nan)
    else:
        per_row = per_env(keys.reward).sum(axis=2, dtype=np.float64)
        returns = np.concatenate(
            [_sums(np.where(valid, per_row[order, env], 0.0), p[0]) for env, p in enumerate(parts)]
        )
    return Episodes(
        keys=keys,
        order=order,
        first=first,
        length=stop - first,
        env=None if envs is None else env_of,
        returns=returns,
        complete=np.concatenate([p[2] for p in parts]),
        traj_id=None if traj is None else traj[order[first], env_of],
    )


def _split(
    ends: np.ndarray | None, traj: np.ndarray | None, valid: np.ndarray, *, full: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Episodes of one environment's rows, oldest first: their first positions, their stop
    positions (exclusive) and whether each is complete."""
    n = valid.size
    if not n:
        nothing = np.empty(0, dtype=np.int64)
        return nothing, nothing, np.empty(0, dtype=bool)
    if traj is not None:
        changes = np.ones(n, dtype=bool)
        changes[:-1] = traj[1:] != traj[:-1]
    else:
        assert ends is not None
        changes = ends.copy()
        changes[-1] = True
    next_invalid = np.append(~valid[1:], True)
    last = valid & (changes | next_invalid)
    after_hole = np.insert(~valid[:-1], 0, True)
    first = valid & (np.insert(last[:-1], 0, True) | after_hole)
    starts = np.flatnonzero(first)
    stops = np.flatnonzero(last) + 1
    if ends is not None:
        ended = ends[stops - 1]
    else:
        # An id run ended if the next row, in the store, has another id.
        following = np.minimum(stops, n - 1)
        ended = (stops < n) & valid[following] & changes[stops - 1]
    # The first rows of the oldest episode of a full ring were overwritten (or may have
    # been), and those of an episode right after a hole were withdrawn.
    lost_start = after_hole[starts] & ((starts > 0) | full)
    return starts, stops, ended & ~lost_start


def _sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums of ``values`` from each start to the next (rows between episodes are zeros)."""
    if not starts.size:
        return np.empty(0)
    return np.add.reduceat(values, starts)


def _names(keys: Sequence[Key] | Mapping[Key, Any]) -> str:
    return ", ".join(shown(k) for k in keys)
