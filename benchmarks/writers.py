"""Many writers: aggregate extend throughput of 1, 2, 4 and 8 writer processes into one
buffer, zarr_rb (shared store, on local disk and, with ``--s3``, on a SeaweedFS server on
loopback) against TorchRL's shared LazyMemmapStorage, in one run.

Each writer process extends ``--batches`` batches of ``--batch`` rows. A row is an
Atari-sized frame stack (4x84x84 uint8) with a stamp, a reward and a done flag, all
derived from the stamp, so that a torn row (leaves of two writes) is recognised and
every writer's rows can be counted after the run. Figures: rows per second over the
whole run (first write to last), the median time of one extend (so the cost of making
each extend visible to other processes shows against a single writer), rows lost, rows torn,
and rows whose ``"index"`` is not their position.

    python benchmarks/writers.py --s3 --json benchmarks/writers.json

``--frames``: rows as an Atari collector writes them, each writer's rows the steps of one
episode (``obs`` the last 4 frames, ``("next", "obs")`` the next 4: one new frame a row),
which zarr_rb stores as frames, each once, by default; and zarr_rb with every leaf stored
as stacks (``Compression(frames=False)``) too::

    python benchmarks/writers.py --frames --writers 1,2,4 --json benchmarks/writers-frames.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

from zarr_rb import Compression, ZarrStorage

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))  # s3_server: SeaweedFS

SPAWN = mp.get_context("spawn")
STACKS_ON_DISK = "zarr_rb, stacks on disk"
"""(``--frames``) A shared store of ``Compression(frames=False)``."""
STRIDE = 1_000_000


def batch(writer: int, first: int, count: int, *, frames: bool = False) -> TensorDict:
    """Rows ``first`` to ``first + count`` of ``writer``: a stack of 4 frames each, all
    the row's own; ``frames``: the frames of steps ``t - 3`` to ``t`` and, as
    ``("next", "obs")``, ``t - 2`` to ``t + 1``."""
    stamp = writer * STRIDE + torch.arange(first, first + count)
    steps = stamp.view(-1, 1) + (
        torch.arange(-3, 2) if frames else torch.zeros(4, dtype=torch.long)
    )
    frame = (steps % 251).to(torch.uint8).view(count, -1, 1, 1).expand(-1, -1, 84, 84).clone()
    frame[:, :, 20:30, 40:50] = 7  # something for the codec to work on
    data = {
        "stamp": stamp,
        "obs": frame[:, :4].clone(),
        "reward": stamp.float(),
        "done": stamp % 50 == 0,
    }
    if frames:
        data["next"] = {"obs": frame[:, 1:].clone()}
    return TensorDict(data, batch_size=[count])


def torn_rows(data: Any) -> int:
    stamp = data["stamp"]
    frame = (stamp % 251).to(torch.uint8).view(-1, 1)
    whole = (
        (data["obs"][:, -1, 0, :5] == frame).all(1)
        & (data["reward"] == stamp.float())
        & (data["done"] == (stamp % 50 == 0))
    )
    if "next" in data:
        following = ((stamp + 1) % 251).to(torch.uint8).view(-1, 1)
        whole &= (data["next", "obs"][:, -1, 0, :5] == following).all(1)
    return int((~whole).sum())


def work(
    rb: Any, writer: int, batches: int, size: int, frames: bool, start: Any, times: Any
) -> None:
    pending = [batch(writer, i * size, size, frames=frames) for i in range(batches)]
    start.wait()
    spent = []
    for data in pending:
        began = time.perf_counter()
        rb.extend(data)
        spent.append(time.perf_counter() - began)
    if isinstance(rb.storage, ZarrStorage):
        rb.storage.close()
    times.put((writer, time.perf_counter(), spent))


def run(
    kind: str,
    writers: int,
    batches: int,
    size: int,
    workdir: Path,
    server: Any = None,
    *,
    frames: bool = False,
) -> dict[str, Any]:
    capacity = writers * batches * size + 4096  # no row is evicted: every one is counted
    path = workdir / f"{kind}-{writers}"
    if kind == "zarr_rb_s3":
        url = f"s3://{server.bucket}/writers-{writers}-{uuid.uuid4().hex[:8]}.zarr"
        options = server.storage_options()
        storage: Any = ZarrStorage(capacity, url, shared=True, storage_options=options)
    elif kind == "zarr_rb":
        storage = ZarrStorage(capacity, path / "buffer.zarr", shared=True)
    elif kind == STACKS_ON_DISK:
        stacks = Compression(frames=False)
        storage = ZarrStorage(capacity, path / "buffer.zarr", shared=True, compression=stacks)
    else:
        storage = LazyMemmapStorage(capacity, scratch_dir=path)
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(batch(99, 0, 1, frames=frames))  # a memmap is shared once it exists
    start, times = SPAWN.Barrier(writers + 1), SPAWN.Queue()
    processes = [
        SPAWN.Process(target=work, args=(rb, w, batches, size, frames, start, times))
        for w in range(writers)
    ]
    for process in processes:
        process.start()
    start.wait()
    began = time.perf_counter()
    results = [times.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    ended = max(result[1] for result in results)
    extends = [t for result in results for t in result[2]]
    if kind != "LazyMemmapStorage":
        storage.refresh()
    positions = torch.arange(len(storage))
    data = storage.get(positions)
    stamps = data["stamp"]
    ours = stamps[stamps // STRIDE < writers]
    expected = writers * batches * size
    out = {
        "writers": writers,
        "rows": expected,
        "rows_per_s": expected / (ended - began),
        "extend_ms_median": 1000 * statistics.median(extends),
        "len": len(storage) - 1,
        "rows_read_back": int(ours.numel()),
        "rows_lost": expected - int(ours.unique().numel()),
        "rows_torn": torn_rows(data),
        "index_not_position": int((data["index"] != positions).sum()),
    }
    if kind != "LazyMemmapStorage":
        storage.close()
    shutil.rmtree(path, ignore_errors=True)
    return out


def one_writer(batches: int, size: int, workdir: Path, *, frames: bool = False) -> float:
    """Median ms of one extend of a ZarrStorage with one writer (rows wait in RAM by block
    until it is full, unseen by other processes): the reference for a shared extend."""
    rb = TensorDictReplayBuffer(storage=ZarrStorage(batches * size, workdir / "one.zarr"))
    pending = [batch(0, i * size, size, frames=frames) for i in range(batches)]
    spent = []
    for data in pending:
        began = time.perf_counter()
        rb.extend(data)
        spent.append(time.perf_counter() - began)
    rb.storage.close()
    return 1000 * statistics.median(spent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--writers", default="1,2,4,8")
    parser.add_argument("--s3", action="store_true", help="zarr_rb on SeaweedFS too")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--frames", action="store_true", help="Atari-like rows; zarr_rb with stacks on disk too"
    )
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(dir=args.workdir, prefix="writers-"))
    results: dict[str, list[dict[str, Any]]] = {"zarr_rb": [], "LazyMemmapStorage": []}
    server = None
    if args.s3:
        from s3_server import start_server

        server = start_server(workdir / "server")
        results["zarr_rb_s3"] = []
    if args.frames:
        results[STACKS_ON_DISK] = []
    try:
        for writers in [int(n) for n in args.writers.split(",")]:
            for kind in results:
                results[kind].append(
                    run(
                        kind,
                        writers,
                        args.batches,
                        args.batch,
                        workdir,
                        server,
                        frames=args.frames,
                    )
                )
        single = one_writer(args.batches, args.batch, workdir, frames=args.frames)
    finally:
        if server is not None:
            from s3_server import stop_server

            stop_server(server)
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        "| storage | writers | rows/s | extend (median) | rows read back | lost | torn "
        "| index not position |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind, rows in results.items():
        for r in rows:
            print(
                f"| {kind} | {r['writers']} | {r['rows_per_s']:,.0f} | "
                f"{r['extend_ms_median']:.1f} ms | {r['rows_read_back']:,} of {r['rows']:,} | "
                f"{r['rows_lost']} | {r['rows_torn']} | {r['index_not_position']} |"
            )
    print(f"ZarrStorage, one writer (not shared), extend (median): {single:.1f} ms")
    if args.json is not None:
        figures = {"batch": args.batch, "batches": args.batches, "frames": args.frames, **results}
        args.json.write_text(json.dumps({**figures, "one_writer_extend_ms": single}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
