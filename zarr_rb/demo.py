"""End-to-end demo: fill a Zarr-backed TorchRL replay buffer from a real environment.

Run it with::

    python -m zarr_rb.demo                      # ALE Pong, 100k transitions into runs/demo.zarr
    python -m zarr_rb.demo --env cartpole       # CartPole-v1, fast, no Atari needed
    python -m zarr_rb.demo --overwrite          # start from an empty store

The demo steps an environment with a seeded random policy, writes the transitions in batches
into a :class:`torchrl.data.TensorDictReplayBuffer` backed by :class:`zarr_rb.ZarrStorage`,
samples from it, closes the store, reopens it from its path alone and samples again, then prints
how many bytes the compressed store takes on disk compared to the raw tensors.

Without ``--overwrite`` an existing store at ``--path`` is reopened and the new transitions are
appended after the rows it already holds.

The environment dependencies are optional: ``pip install -e '.[demo]'`` in a checkout.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from zarr_rb import ZarrStorage
from zarr_rb.api import save
from zarr_rb.errors import ZarrRBError
from zarr_rb.util.progress import format_bytes

__all__ = [
    "ENV_IDS",
    "CollectStats",
    "collect",
    "main",
    "make_env",
    "open_storage",
    "time_sampling",
]

#: Command-line environment names and the Gymnasium ids they stand for.
ENV_IDS: dict[str, str] = {"pong": "ALE/Pong-v5", "cartpole": "CartPole-v1"}

#: Default number of transitions to collect per environment. Pong runs at roughly 700-900 env
#: steps/s on one core (frame skip 4, 84x84 grayscale, 4-frame stack), so 100k transitions take
#: about 2-3 minutes; CartPole is ~50x faster.
DEFAULT_STEPS: dict[str, int] = {"pong": 100_000, "cartpole": 100_000}

#: Capacity (rows) of a newly created store. Zarr arrays are chunked and written lazily, so
#: unused capacity costs nothing on disk; it only bounds how far repeated runs can append.
#: A reopened store keeps the capacity it was created with.
DEFAULT_MAX_SIZE = 1_000_000

_INSTALL_HINT = "pip install -e '.[demo]' in a checkout of zarr_rb (it is not on PyPI)"

TRAJ_KEY = ("collector", "traj_ids")


def _missing_dependency(exc: ImportError) -> ImportError:
    """Builds the error raised when an optional demo dependency cannot be imported.

    Args:
        exc: The original import error.

    Returns:
        An ``ImportError`` telling the user how to install the demo extras.
    """
    name = exc.name or str(exc)
    return ImportError(f"the zarr_rb demo needs {name!r}, which is not installed: {_INSTALL_HINT}")


def make_env(env: str) -> Any:
    """Creates the Gymnasium environment used by the demo.

    ``pong`` is ``ALE/Pong-v5`` with ``frameskip=1`` wrapped in ``AtariPreprocessing`` (frame skip
    4, 84x84 grayscale, up to 30 no-ops) and a 4-frame ``FrameStackObservation``: observations are
    ``uint8[4, 84, 84]``. ``cartpole`` is ``CartPole-v1`` with ``float32[4]`` observations.

    Args:
        env: ``"pong"`` or ``"cartpole"``.

    Returns:
        The (unseeded, not yet reset) ``gymnasium.Env``.

    Raises:
        ImportError: If gymnasium, ale-py or opencv are not installed.
        ValueError: If ``env`` is not a known environment name.
    """
    if env not in ENV_IDS:
        raise ValueError(f"unknown env {env!r}; expected one of {sorted(ENV_IDS)}")
    try:
        import gymnasium
    except ImportError as exc:
        raise _missing_dependency(exc) from exc
    if env == "cartpole":
        return gymnasium.make(ENV_IDS[env])
    try:
        import ale_py
        import cv2  # noqa: F401  (AtariPreprocessing resizes frames with OpenCV)
    except ImportError as exc:
        raise _missing_dependency(exc) from exc
    gymnasium.register_envs(ale_py)
    base = gymnasium.make(ENV_IDS[env], frameskip=1)
    wrapped = gymnasium.wrappers.AtariPreprocessing(
        base, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30
    )
    return gymnasium.wrappers.FrameStackObservation(wrapped, 4)


def _import_tqdm() -> Any:
    """Imports the tqdm progress-bar class.

    Returns:
        ``tqdm.tqdm``.

    Raises:
        ImportError: If tqdm is not installed.
    """
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise _missing_dependency(exc) from exc
    return tqdm


@dataclass
class CollectStats:
    """What :func:`collect` did.

    Attributes:
        steps: Transitions written to the buffer.
        episodes: Episodes that ended (terminated or truncated) during collection.
        mean_return: Mean undiscounted return of those episodes (``nan`` if none ended).
        env_seconds: Wall time spent stepping/resetting the environment and building batches.
        write_seconds: Wall time spent in ``rb.extend``.
    """

    steps: int
    episodes: int
    mean_return: float
    env_seconds: float
    write_seconds: float


def collect(
    rb: Any,
    env: Any,
    steps: int,
    *,
    batch_size: int = 256,
    seed: int = 0,
    first_traj_id: int = 0,
    progress: bool = True,
) -> CollectStats:
    """Steps ``env`` with a uniform random policy and extends ``rb`` with the transitions.

    Transitions are gathered into numpy arrays of ``batch_size`` rows and written with one
    ``rb.extend`` per batch. Each row holds ``observation``, ``action`` (int64),
    ``("next", "observation")``, ``("next", "reward")`` (float32 ``[1]``),
    ``("next", "done")``, ``("next", "terminated")``, ``("next", "truncated")`` (bool ``[1]``)
    and ``("collector", "traj_ids")`` (int64 episode counter, usable by ``SliceSampler``). The
    environment is reset whenever an episode ends.

    Args:
        rb: A ``TensorDictReplayBuffer`` (or anything with a compatible ``extend``).
        env: A ``gymnasium.Env`` with a discrete action space.
        steps: Number of transitions to collect.
        batch_size: Rows per ``rb.extend`` call.
        seed: Seeds the policy and the first ``env.reset``.
        first_traj_id: Trajectory id of the first episode.
        progress: Whether to show a tqdm progress bar.

    Returns:
        Collection statistics.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng = np.random.default_rng(seed)
    n_actions = int(env.action_space.n)
    obs_space = env.observation_space
    obs_shape: tuple[int, ...] = tuple(obs_space.shape)
    obs_dtype = np.dtype(obs_space.dtype)

    bar = (
        _import_tqdm()(total=steps, desc="collect", unit="step", unit_scale=True, mininterval=0.5)
        if progress
        else None
    )
    t0 = time.perf_counter()
    obs, _ = env.reset(seed=int(rng.integers(2**31)))
    traj_id = first_traj_id
    ep_return = 0.0
    returns: list[float] = []
    env_seconds = 0.0
    write_seconds = 0.0
    done_steps = 0
    try:
        while done_steps < steps:
            n = min(batch_size, steps - done_steps)
            actions = rng.integers(n_actions, size=n, dtype=np.int64)
            # Fresh arrays per batch: the storage may keep references to the tensors it is given.
            obs_b = np.empty((n, *obs_shape), dtype=obs_dtype)
            next_obs_b = np.empty_like(obs_b)
            reward_b = np.empty((n, 1), dtype=np.float32)
            terminated_b = np.empty((n, 1), dtype=bool)
            truncated_b = np.empty((n, 1), dtype=bool)
            traj_b = np.empty(n, dtype=np.int64)
            for i in range(n):
                obs_b[i] = obs
                next_obs, reward, terminated, truncated, _ = env.step(actions[i])
                next_obs_b[i] = next_obs
                reward_b[i, 0] = reward
                terminated_b[i, 0] = terminated
                truncated_b[i, 0] = truncated
                traj_b[i] = traj_id
                ep_return += float(reward)
                if terminated or truncated:
                    returns.append(ep_return)
                    ep_return = 0.0
                    traj_id += 1
                    obs, _ = env.reset()
                else:
                    obs = next_obs
            td = TensorDict(
                {
                    "observation": torch.from_numpy(obs_b),
                    "action": torch.from_numpy(actions),
                    "next": {
                        "observation": torch.from_numpy(next_obs_b),
                        "reward": torch.from_numpy(reward_b),
                        "done": torch.from_numpy(terminated_b | truncated_b),
                        "terminated": torch.from_numpy(terminated_b),
                        "truncated": torch.from_numpy(truncated_b),
                    },
                    "collector": {"traj_ids": torch.from_numpy(traj_b)},
                },
                batch_size=[n],
            )
            t1 = time.perf_counter()
            env_seconds += t1 - t0
            rb.extend(td)
            t0 = time.perf_counter()
            write_seconds += t0 - t1
            done_steps += n
            if bar is not None:
                bar.update(n)
    finally:
        if bar is not None:
            bar.close()
    return CollectStats(
        steps=done_steps,
        episodes=len(returns),
        mean_return=statistics.fmean(returns) if returns else float("nan"),
        env_seconds=env_seconds,
        write_seconds=write_seconds,
    )


def time_sampling(rb: Any, n_batches: int) -> list[float]:
    """Draws ``n_batches`` batches from ``rb`` and times each.

    Args:
        rb: A replay buffer with a default ``batch_size``.
        n_batches: How many batches to draw.

    Returns:
        The wall time of each ``rb.sample()`` call, in seconds.
    """
    times: list[float] = []
    for _ in range(n_batches):
        t0 = time.perf_counter()
        rb.sample()
        times.append(time.perf_counter() - t0)
    return times


def open_storage(max_size: int | None, path: Path, *, overwrite: bool) -> tuple[ZarrStorage, bool]:
    """Opens (or creates) the store at ``path``.

    Args:
        max_size: Replay buffer capacity in rows. ``None`` keeps the capacity of an existing
            store and uses :data:`DEFAULT_MAX_SIZE` for a new one.
        path: Location of the Zarr store.
        overwrite: Start the store over (``mode="w"``): its rows and saved state go.

    Returns:
        The storage and whether an existing store was started over.

    Raises:
        zarr_rb.errors.ZarrRBError: If the store cannot be opened, e.g. its capacity is not
            ``max_size``, or ``path`` holds something else than a zarr_rb store.
    """
    exists = (path / "zarr.json").is_file()
    if max_size is None and not exists:
        max_size = DEFAULT_MAX_SIZE
    return ZarrStorage(max_size, path, mode="w" if overwrite else "a"), overwrite and exists


def _next_traj_id(storage: ZarrStorage, max_size: int) -> int:
    """The first trajectory id an appending run may use: one past the last row's.

    A buffer built on a reopened store appends after its last row by itself; the
    trajectory ids of the new episodes must go on from the stored ones too.
    """
    if not len(storage):
        return 0
    last = (storage.cursor - 1) % max_size
    traj_ids = storage[last].get(TRAJ_KEY, None)
    return 0 if traj_ids is None else int(traj_ids) + 1


def _fmt_ms(seconds: list[float]) -> str:
    """Formats the median of ``seconds`` in milliseconds (``n/a`` when empty)."""
    return f"{statistics.median(seconds) * 1e3:.1f} ms" if seconds else "n/a"


def _schema_lines(sample: Any) -> list[str]:
    """Describes the keys of a sampled batch as ``key  dtype  [per-row shape]`` lines.

    Args:
        sample: A batched ``TensorDict`` as returned by ``rb.sample()``.

    Returns:
        One formatted line per leaf key (the sampler's ``index`` entry is skipped).
    """
    rows: list[tuple[str, str, str]] = []
    for key in sample.keys(include_nested=True, leaves_only=True):
        if key == "index":
            continue
        value = sample.get(key)
        name = "/".join(key) if isinstance(key, tuple) else str(key)
        rows.append((name, str(value.dtype).removeprefix("torch."), str(list(value.shape[1:]))))
    rows.sort()
    width = max((len(r[0]) for r in rows), default=0)
    return [f"    {name:<{width}}  {dtype:<8} {shape}" for name, dtype, shape in rows]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses the demo's command line.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The parsed arguments.
    """
    parser = argparse.ArgumentParser(
        prog="python -m zarr_rb.demo",
        description="Fill a Zarr-backed TorchRL replay buffer from ALE Pong (or CartPole) with a "
        "random policy, then reopen it from disk and sample.",
    )
    parser.add_argument(
        "--path",
        type=Path,
        default=Path("runs/demo.zarr"),
        help="store location (default: %(default)s)",
    )
    parser.add_argument("--env", choices=sorted(ENV_IDS), default="pong", help="default: pong")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="transitions to collect (default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items())
        + ")",
    )
    parser.add_argument("--seed", type=int, default=0, help="policy/env seed (default: 0)")
    parser.add_argument(
        "--batch-size", type=int, default=256, help="rows per extend and per sample (default: 256)"
    )
    parser.add_argument(
        "--max-size",
        type=int,
        default=None,
        help=f"capacity in rows of a new store (default: {DEFAULT_MAX_SIZE}); an existing store"
        " keeps its own",
    )
    parser.add_argument(
        "--sample-batches",
        type=int,
        default=10,
        help="batches sampled before and after reopening (default: 10)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an existing store at --path first (default: reopen it and append)",
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.env]
    for name in ("steps", "batch_size", "max_size", "sample_batches"):
        minimum = 0 if name in ("steps", "sample_batches") else 1
        value = getattr(args, name)
        if value is not None and value < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo.

    Args:
        argv: Command-line arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The process exit code: 0 on success; 1 if an optional dependency is missing, the store
        at ``--path`` cannot take this run's data (other capacity or schema), or the reopened
        store does not hold the rows written.
    """
    args = _parse_args(argv)
    path: Path = args.path

    try:
        env = make_env(args.env)
        _import_tqdm()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    obs_space = env.observation_space
    print(
        f"zarr_rb demo | env {ENV_IDS[args.env]} obs {obs_space.dtype}{list(obs_space.shape)}"
        f" actions {env.action_space.n} | seed {args.seed}"
    )

    try:
        storage, deleted = open_storage(args.max_size, path, overwrite=args.overwrite)
    except ZarrRBError as exc:
        env.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    max_size = int(storage.max_size)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=args.batch_size)
    start_rows = len(storage)
    first_traj_id = _next_traj_id(storage, max_size)
    if start_rows:
        print(
            f"store  {path}: reopened, {start_rows} rows already there -> appending at row "
            f"{storage.cursor}"
        )
    else:
        print(
            f"store  {path}: {'deleted and ' if deleted else ''}created (capacity {max_size} rows)"
        )
    if start_rows + args.steps > max_size:
        print(f"note   capacity {max_size} reached: the oldest rows will be overwritten")

    # Mix the rows already stored into the seed so an appending run does not replay the
    # same episodes as the run before it.
    seed = int(np.random.SeedSequence([args.seed, start_rows]).generate_state(1)[0])
    t0 = time.perf_counter()
    try:
        stats = collect(
            rb,
            env,
            args.steps,
            batch_size=args.batch_size,
            seed=seed,
            first_traj_id=first_traj_id,
        )
    except BaseException as exc:
        # Ctrl-C or a failure mid-collection: keep what was already written.
        storage.close()
        if isinstance(exc, ZarrRBError):  # e.g. appending CartPole rows to a Pong store
            print(f"error: {exc}\n(use --overwrite or another --path)", file=sys.stderr)
            return 1
        raise
    finally:
        env.close()
    t1 = time.perf_counter()
    save(rb, progress=False)  # the rows still in RAM, and the sampler and writer state
    flush_s = time.perf_counter() - t1
    collect_s = time.perf_counter() - t0
    rows = len(storage)

    sample_before = time_sampling(rb, args.sample_batches) if rows else []
    t0 = time.perf_counter()
    storage.close()
    close_s = time.perf_counter() - t0
    del rb, storage

    t0 = time.perf_counter()
    reopened = ZarrStorage(max_size, path)
    reopen_s = time.perf_counter() - t0
    rb2 = TensorDictReplayBuffer(storage=reopened, batch_size=args.batch_size)
    rows_reopened = len(reopened)
    sample_after = time_sampling(rb2, args.sample_batches) if rows_reopened else []
    t0 = time.perf_counter()
    reopened.wait_for_ram()  # the rows are read into RAM behind the buffer's back
    in_ram_s = time.perf_counter() - t0
    sample_in_ram = time_sampling(rb2, args.sample_batches) if rows_reopened else []
    schema = _schema_lines(rb2.sample()) if rows_reopened else []
    on_disk = reopened.nbytes_on_disk()
    raw = reopened.nbytes_raw()
    reopened.close()

    ok = rows_reopened == rows
    ret = "n/a" if stats.episodes == 0 else f"{stats.mean_return:.1f}"
    steps_s = stats.steps / stats.env_seconds if stats.env_seconds else float("inf")
    print(
        f"collect {stats.steps} steps in {collect_s:.1f} s: env {stats.env_seconds:.1f} s"
        f" ({steps_s:.0f} steps/s), extend {stats.write_seconds:.1f} s, save {flush_s:.2f} s"
        f" | {stats.episodes} episodes ended, mean return {ret}"
    )
    print(f"rows    {rows} ({start_rows} before this run)")
    print(
        f"sample  batch {args.batch_size}: median {_fmt_ms(sample_before)} before close,"
        f" {_fmt_ms(sample_after)} after reopen while its rows are read into RAM,"
        f" {_fmt_ms(sample_in_ram)} once they are, {in_ram_s:.1f} s later"
        f" ({args.sample_batches} batches each)"
    )
    print(
        f"reopen  close {close_s:.2f} s, reopen from path {reopen_s * 1e3:.0f} ms:"
        f" {rows_reopened} rows {'(matches)' if ok else f'!= {rows} expected'}"
    )
    print(f"keys    ({len(schema)}, per row)")
    for line in schema:
        print(line)
    ratio = f"{raw / on_disk:.1f}x" if on_disk else "n/a"
    print(f"disk    {format_bytes(on_disk)} on disk, {format_bytes(raw)} raw: compression {ratio}")
    if not ok:
        print(f"error: reopened store has {rows_reopened} rows, expected {rows}", file=sys.stderr)
        return 1
    _print_next_steps(path, pong=args.env == "pong")
    return 0


def _print_next_steps(path: Path, *, pong: bool) -> None:
    """The commands to try next on the store (the command line next to this Python: a
    virtual environment's, which is not on PATH unless it is activated)."""
    beside = Path(sys.executable).parent / "zarr-rb"
    cli = str(beside) if beside.exists() else "zarr-rb"
    where = shlex.quote(str(path))
    print(f"next    {cli} info {where}")
    print(f"        {cli} episodes {where}")
    if pong:
        print(f"        {cli} show {where} --episode 0 --stride 2 -o episode0.gif")
    print(f"        {cli} plot {where} -o returns.png")
    print("        (a second run of the demo appends to the store; --overwrite starts over)")


if __name__ == "__main__":
    raise SystemExit(main())
