"""What the move of modules into packages must keep: imports of the old public paths,
saves of earlier versions that pickled zarr_rb's own classes under their old modules, and
a dump that replaces the previous one only once the storage flushed."""

from __future__ import annotations

import io
import pickle

from zarr_rb import ZarrStorage
from zarr_rb.state._objects import _Unpickler
from zarr_rb.torchrl.checkpointer import ZarrStorageCheckpointer


def test_the_old_import_paths_give_the_same_objects():
    import zarr_rb
    from zarr_rb.convert import buffer_like_dump, export_torchrl, import_torchrl
    from zarr_rb.storage import ZarrStorage as Old

    assert Old is ZarrStorage
    assert import_torchrl is zarr_rb.import_torchrl
    assert export_torchrl is zarr_rb.export_torchrl
    assert callable(buffer_like_dump)


def test_a_checkpointer_pickled_under_its_old_module_loads():
    data = pickle.dumps(ZarrStorageCheckpointer(), protocol=0)
    assert b"zarr_rb.torchrl.checkpointer" in data
    old = data.replace(b"zarr_rb.torchrl.checkpointer", b"zarr_rb._checkpointer")
    assert isinstance(_Unpickler(io.BytesIO(old)).load(), ZarrStorageCheckpointer)


def test_a_dump_that_cannot_flush_leaves_the_previous_dump(tmp_path, monkeypatch):
    import pytest
    import torch
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer

    from zarr_rb.torchrl.checkpointer import is_store_dir

    rb = TensorDictReplayBuffer(storage=ZarrStorage(16, tmp_path / "live.zarr"))
    rb.extend(TensorDict({"obs": torch.arange(4.0)}, [4]))
    rb.dumps(tmp_path / "dump")
    assert is_store_dir(tmp_path / "dump" / "storage")

    def full_disk(self) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ZarrStorage, "flush", full_disk)
    with pytest.raises(OSError):
        rb.dumps(tmp_path / "dump")
    assert is_store_dir(tmp_path / "dump" / "storage")  # the previous dump, whole
