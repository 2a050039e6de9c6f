"""What a write of rows whose shape differs from the stored one says: the shapes that
differ, and what to do (a declaration of rows of different lengths only where that could
be what was meant)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from zarr_rb import SchemaMismatchError, ZarrStorage


def frames(n: int, stack: int, side: int = 8) -> TensorDict:
    return TensorDict({"obs": torch.ones(n, stack, side, side, dtype=torch.uint8)}, [n])


def refused(path: Path, later: TensorDict) -> str:
    """The message of the write of ``later`` after 4 stacks of 4 frames; nothing of it was
    written, as TorchRL's own storage writes nothing of it."""
    rb = TensorDictReplayBuffer(storage=ZarrStorage(16, path))
    twin = TensorDictReplayBuffer(storage=LazyTensorStorage(16))
    for buffer in (rb, twin):
        buffer.extend(frames(4, 4))
    with pytest.raises(RuntimeError):
        twin.extend(later)
    with pytest.raises(SchemaMismatchError) as raised:
        rb.extend(later)
    assert len(rb) == 4
    assert torch.equal(rb.storage.get(torch.arange(4))["obs"], frames(4, 4)["obs"])
    rb.storage.close()
    return str(raised.value)


def test_a_frame_stack_of_3_where_4_are_stored_is_a_shape_mismatch(tmp_path: Path) -> None:
    message = refused(tmp_path / "s.zarr", frames(4, 3))
    assert str(tmp_path / "s.zarr") in message
    assert "rows of 'obs' have shape [3, 8, 8]" in message
    assert "the store holds rows of shape [4, 8, 8]" in message
    assert "write rows of shape [4, 8, 8]" in message
    assert "or write these to a new store" in message
    # Rows of different lengths are a possible meaning only as a last resort.
    assert message.index("ragged=['obs']") > message.index("new store")


def test_frames_of_another_size_are_not_told_to_be_ragged(tmp_path: Path) -> None:
    message = refused(tmp_path / "s.zarr", frames(4, 4, side=9))
    assert "rows of 'obs' have shape [4, 9, 9]" in message
    assert "the store holds rows of shape [4, 8, 8]" in message
    assert "ragged" not in message  # no ragged leaf holds rows that differ past dimension 0
