"""Bad input gets typed errors that name the store or key and say how to fix it."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import zarr_rb
from zarr_rb import (
    FormatVersionError,
    NotAStoreError,
    ReadOnlyError,
    RowIndexError,
    SchemaMismatchError,
    StoreCorruptedError,
    UnsupportedDataError,
    ZarrRBError,
    ZarrStorage,
)


def batch(n: int = 4, **overrides) -> TensorDict:
    data = {"obs": torch.zeros(n, 3), "reward": torch.zeros(n, 1)}
    data.update(overrides)
    return TensorDict(data, batch_size=[n])


@pytest.fixture
def filled(store_path):
    storage = ZarrStorage(20, store_path)
    storage.set(torch.arange(4), batch())
    yield storage
    storage.close()


def test_errors_derive_from_builtins():
    assert issubclass(NotAStoreError, FileExistsError)
    assert issubclass(SchemaMismatchError, ValueError)
    assert issubclass(ReadOnlyError, PermissionError)
    assert issubclass(RowIndexError, IndexError)
    for err in (NotAStoreError, SchemaMismatchError, ReadOnlyError, FormatVersionError):
        assert issubclass(err, ZarrRBError)


def test_path_that_is_a_file(tmp_path):
    path = tmp_path / "file.zarr"
    path.write_text("hello")
    with pytest.raises(NotAStoreError, match="is a file"):
        ZarrStorage(10, path)


def test_directory_with_other_content(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(NotAStoreError, match="non-empty directory"):
        ZarrStorage(10, tmp_path)


def test_plain_zarr_group_is_not_a_store(tmp_path):
    import zarr

    zarr.open_group(tmp_path / "plain.zarr", mode="w").attrs["x"] = 1
    with pytest.raises(NotAStoreError, match="not a zarr_rb store"):
        ZarrStorage(10, tmp_path / "plain.zarr")


def test_reopen_with_other_max_size(filled, store_path):
    filled.close()
    with pytest.raises(SchemaMismatchError, match="max_size=20"):
        ZarrStorage(30, store_path)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (batch(obs=torch.zeros(4, 3, dtype=torch.float64)), "dtype torch.float64"),
        # A rejected write adds none of its new keys either.
        (batch(obs=torch.zeros(4, 5), extra=torch.zeros(4)), r"expected \(4, 3\)"),
        (batch(obs=torch.zeros(4, 5)), r"expected \(4, 3\)"),
        (torch.zeros(4, 3), "holds tensordict data"),
    ],
)
def test_write_that_differs_from_schema(filled, data, match):
    with pytest.raises(SchemaMismatchError, match=match) as info:
        filled.set(torch.arange(4, 8), data)
    assert str(filled.path) in str(info.value)
    assert len(filled) == 4
    assert [leaf.key for leaf in filled.schema.leaves] == [("obs",), ("reward",)]


def test_index_out_of_range(filled):
    with pytest.raises(RowIndexError, match="out of range for 4 rows"):
        filled.get(torch.tensor([0, 9]))
    with pytest.raises(RowIndexError):
        filled.get(4)
    with pytest.raises(RowIndexError, match="write index out of range for 20 rows"):
        filled.set(torch.tensor([25]), batch(1))


def test_write_to_read_only(filled, store_path):
    filled.flush()
    reader = ZarrStorage(path=store_path, read_only=True)
    with pytest.raises(ReadOnlyError, match="read-only"):
        reader.set(torch.arange(2), batch(2))
    with pytest.raises(ReadOnlyError):
        reader._empty()


def test_read_only_needs_an_existing_store(tmp_path):
    with pytest.raises(FileNotFoundError):
        ZarrStorage(path=tmp_path / "missing.zarr", read_only=True)
    with pytest.raises(ValueError, match="mode='r' needs the path of an existing store"):
        ZarrStorage(10, read_only=True)


def _rewrite_attrs(store_path, mutate) -> None:
    meta_file = store_path / "zarr.json"
    document = json.loads(meta_file.read_text())
    mutate(document["attributes"]["zarr_rb"])
    meta_file.write_text(json.dumps(document))


def test_newer_format_version(filled, store_path):
    filled.close()
    newest = zarr_rb.FORMAT_VERSION + 1  # (format 4: stores with frames on disk)
    _rewrite_attrs(store_path, lambda a: a.update(format=newest + 1))
    with pytest.raises(FormatVersionError, match="Upgrade zarr_rb"):
        ZarrStorage(20, store_path)


def test_a_store_of_format_4_without_frames_is_damaged(filled, store_path):
    filled.close()
    _rewrite_attrs(store_path, lambda a: a.update(format=4))
    with pytest.raises(StoreCorruptedError, match="frames"):
        ZarrStorage(20, store_path)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda a: a.update(max_size="big"),
        lambda a: a["commit"].update(length=10**6),
        lambda a: a["commit"].update(holes=[[3, 1]]),
        lambda a: a["schema"]["leaves"][0].update(key=["..", "x"]),
        lambda a: a["schema"]["leaves"][0].update(dtype="complex64"),
        lambda a: a["schema"].update(batch_shape=[-1]),
    ],
)
def test_corrupted_metadata(filled, store_path, mutate):
    filled.close()
    _rewrite_attrs(store_path, mutate)
    with pytest.raises(StoreCorruptedError, match="invalid zarr_rb metadata"):
        ZarrStorage(20, store_path)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (TensorDict({"__x": torch.zeros(2)}, [2]), "reserves"),
        (torch.zeros(2, 2, dtype=torch.complex64), "complex64"),
        ({"obs": torch.zeros(2), "n": 3}, r"pytree leaf \('n',\) is a int"),
        (3, "expected a torch.Tensor"),
        (
            TensorDict(
                {
                    "obs": torch.zeros(2),
                    "obj": NonTensorStack(NonTensorData({"a": 1}), NonTensorData({"b": 2})),
                },
                [2],
            ),
            r"entry \('obj',\) holds a dict",
        ),
    ],
)
def test_unsupported_data(data, match):
    storage = ZarrStorage(10)
    with pytest.raises(UnsupportedDataError, match=match):
        storage.set(torch.arange(2), data)
    assert len(storage) == 0  # nothing was written, not even the keys that could be


def test_ndim_mismatch_on_reopen(filled, store_path):
    filled.close()
    with pytest.raises(SchemaMismatchError, match="ndim=1"):
        ZarrStorage(20, store_path, ndim=2)
