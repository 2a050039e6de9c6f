"""An LLM-style buffer (token ids of each row's own length, a prompt string, a reward, a
prioritized sampler) in a process that saves and is then killed while it goes on writing:
the store loads as the save left it, draws what the killed process would have drawn, and
the run resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from kinds import assert_same_rows, token_rows
from torchrl.data import TensorDictPrioritizedReplayBuffer

import zarr_rb

TESTS = Path(__file__).parent

TRAINER = textwrap.dedent(
    """
    import json, sys, time, torch
    import zarr_rb
    from kinds import token_rows
    from torchrl.data import TensorDictPrioritizedReplayBuffer

    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=zarr_rb.ZarrStorage(100_000, sys.argv[1]), batch_size=8
    )
    for step in range(6):  # generate, score, learn
        rb.extend(token_rows([5 + (step * 37 + i * 11) % 300 for i in range(16)], seed=step))
        sample = rb.sample()
        sample["td_error"] = sample["reward"].abs() + 0.1
        rb.update_tensordict_priority(sample)
    zarr_rb.save(rb)
    rb.set_rng(torch.Generator().manual_seed(11))
    drawn = rb.sample()
    print(json.dumps({"index": drawn["index"].tolist(), "length": len(rb)}), flush=True)
    step = 6
    while True:  # goes on writing, unsaved, until killed
        rb.extend(token_rows([1 + step % 700] * 16, seed=step))
        step += 1
        time.sleep(0.01)
    """
)


def test_an_llm_buffer_survives_a_kill_after_its_save_and_resumes(tmp_path):
    path = tmp_path / "grpo.zarr"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(path)],
        cwd=TESTS,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = trainer.stdout.readline()
        assert line, trainer.stderr.read()[-3000:]
        drawn = json.loads(line)
        time.sleep(1.0)  # it writes on, past the save
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=60)
    assert trainer.returncode == -signal.SIGKILL

    rb = zarr_rb.load(path)
    assert isinstance(rb, TensorDictPrioritizedReplayBuffer)
    assert len(rb) == drawn["length"] == 96
    saved = [token_rows([5 + (s * 37 + i * 11) % 300 for i in range(16)], seed=s) for s in range(6)]
    every = torch.arange(96)
    rows = rb.storage.get(every)
    for step, written in enumerate(saved):
        assert_same_rows(rows[step * 16 : (step + 1) * 16].exclude("index"), written)
    rb.set_rng(torch.Generator().manual_seed(11))
    sample = rb.sample()
    assert sample["index"].tolist() == drawn["index"]
    assert [row["prompt"] for row in sample.unbind(0)] == [
        rows[i]["prompt"] for i in drawn["index"]
    ]
    # Resume: new rows land after the saved ones, priorities keep updating.
    rb.extend(token_rows([3, 900, 40], seed=99))
    assert len(rb) == 99
    assert rb.storage.get(torch.tensor([97]))[0]["tokens"].shape == (900,)
    sample["td_error"] = torch.ones(8)
    rb.update_tensordict_priority(sample)
    zarr_rb.save(rb)
    again = zarr_rb.load(path, read_only=True)
    assert len(again) == 99
    assert again.storage.get(torch.tensor([98]))[0]["prompt"] == "prompt 99-2 (40 tokens) ✓"
