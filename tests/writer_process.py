"""A writer process that extends a 64-row ring (blocks of 8 rows) by 1-23 rows and commits,
without pause, while the test samples 4-step slices of its 8-step episodes: every slice
returned must be 4 consecutive steps of one episode."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from zarr_rb import RowsNotCommittedError

RING = 64
EPISODE = 8

_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer
    from zarr_rb import Compression, ZarrStorage

    path, stop, shared, step = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    storage = ZarrStorage(64, path, compression=Compression(block_rows=8), shared=shared)
    rb = TensorDictReplayBuffer(storage=storage)
    g = torch.Generator().manual_seed(0)
    for _ in range(20_000):  # (a bound, should the test die without stopping it)
        if stop.exists():
            break
        n = int(torch.randint(1, 24, (), generator=g))
        t = torch.arange(step, step + n)
        rb.extend(TensorDict({"step": t, "episode": t // 8}, batch_size=[n]))
        rb.storage.flush()
        step += n
    rb.storage.close()
    """
)


def slices_beside_a_writer(
    path: Path, rb: Any, *, shared: bool, first_step: int
) -> tuple[int, int]:
    """Sample ``rb`` (4-step slices, batches of 32) while a writer process extends the store
    at ``path`` from step ``first_step`` on (``shared``: as one of its shared writers), until
    300 whole samples over 50 commits; returns how many came back whole and how many
    raised ``RowsNotCommittedError``."""
    stop = path.parent / f"{path.name}.stop"
    flags = [str(path), str(stop), "1" if shared else "0", str(first_step)]
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, *flags])
    whole, raised, generations = 0, 0, set()
    try:
        while whole < 300 or len(generations) < 50:
            assert writer.poll() is None, "the writer process stopped"
            try:
                batch = rb.sample()
            except RowsNotCommittedError:
                raised += 1
                continue
            steps = batch["step"].view(-1, 4)
            assert bool((steps[:, 1:] - steps[:, :-1] == 1).all()), steps.tolist()
            assert torch.equal(batch["episode"].view(-1, 4), steps // EPISODE), steps.tolist()
            whole += 1
            generations.add(rb.storage.store.committed.generation)
    finally:
        stop.touch()
        writer.wait(timeout=120)
    assert writer.returncode == 0
    return whole, raised
