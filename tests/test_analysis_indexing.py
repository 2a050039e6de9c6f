"""Indexing the dask arrays and the xarray Dataset of a view gives what NumPy gives on the
materialized array: the same shape and the same values, for every form of index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import zarr_rb
from zarr_rb import Compression, ZarrStorage

ROWS = 13  # committed rows: several dask chunks of BLOCK rows, the last one partial
BLOCK = 4
ENVS = 3


def _one_dim(n: int) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3),
            "step": torch.arange(n, dtype=torch.int64) * 10,
            "next": {"reward": torch.arange(n, dtype=torch.float64).reshape(n, 1) / 4},
        },
        [n],
    )


def _two_dim(n: int) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.arange(n * ENVS * 4, dtype=torch.int32).reshape(n, ENVS, 4),
            "step": torch.arange(n * ENVS, dtype=torch.int16).reshape(n, ENVS),
        },
        [n, ENVS],
    )


@pytest.fixture(scope="module")
def one_dim(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("indexing") / "one.zarr"
    storage = ZarrStorage(16, path, compression=Compression(chunk_rows=2, block_rows=BLOCK))
    storage.set(torch.arange(ROWS), _one_dim(ROWS))
    storage.close()
    return path


@pytest.fixture(scope="module")
def two_dim(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("indexing") / "two.zarr"
    storage = ZarrStorage(
        16 * ENVS, path, ndim=2, compression=Compression(chunk_rows=2, block_rows=BLOCK)
    )
    storage.set(torch.arange(ROWS), _two_dim(ROWS))
    storage.close()
    return path


def _mask() -> np.ndarray:
    return np.arange(ROWS) % 3 == 1


# Each form as a function of nothing, so that arrays are made fresh per test id.
ROW_FORMS = {
    "int": lambda: 5,
    "first": lambda: 0,
    "last": lambda: ROWS - 1,
    "negative": lambda: -1,
    "most-negative": lambda: -ROWS,
    "np-int64": lambda: np.int64(7),
    "np-int32": lambda: np.int32(4),
    "slice": lambda: slice(2, 9),
    "slice-across-chunks": lambda: slice(3, 5),
    "empty-slice": lambda: slice(6, 6),
    "step": lambda: slice(1, None, 3),
    "negative-step": lambda: slice(None, None, -2),
    "list": lambda: [1, 8, 2],
    "list-repeats": lambda: [3, 3, 12, 0],
    "negative-list": lambda: [-1, -13],
    "int-array": lambda: np.array([11, 4, 4]),
    "mask": _mask,
    "ellipsis": lambda: Ellipsis,
    "int-ellipsis": lambda: (6, Ellipsis),
    "ellipsis-int": lambda: (Ellipsis, 0),
}
ONE_DIM_FORMS = {
    **ROW_FORMS,
    "int-int": lambda: (5, -1),
    "int-int-int": lambda: (-2, 1, 2),
    "int-slice": lambda: (3, slice(0, 1)),
    "slice-int": lambda: (slice(2, 11, 2), 0),
    "list-int": lambda: ([2, 9], 0),
    "mask-slice-int": lambda: (_mask(), slice(None), -1),
    "slice-slice-list": lambda: (slice(4, 8), slice(None), [2, 0]),
    "int-list": lambda: (0, [0, -1, 0]),
}
TWO_DIM_FORMS = {
    **ROW_FORMS,
    "time-env": lambda: (4, 2),
    "negative-time-env": lambda: (-1, -1),
    "time-env-element": lambda: (7, 0, 3),
    "slice-env": lambda: (slice(1, 12, 5), 1),
    "time-env-slice": lambda: (2, slice(1, 3)),
    "list-env": lambda: ([0, 12, 5], 2),
    "mask-env-slice": lambda: (_mask(), 0, slice(1, None)),
    "slice-list": lambda: (slice(None, 4), [2, 0]),
    "np-ints": lambda: (np.int64(9), np.int16(1)),
}


def _fits(index, ndim: int) -> bool:
    """Whether ``index`` addresses at most ``ndim`` dimensions (NumPy's rule)."""
    parts = index if isinstance(index, tuple) else (index,)
    return sum(part is not Ellipsis for part in parts) <= ndim


def _cases(forms: dict, ndims: dict) -> list:
    return [
        pytest.param(key, form, id=f"{name}-{key if isinstance(key, str) else '.'.join(key)}")
        for name, form in forms.items()
        for key, ndim in ndims.items()
        if _fits(form(), ndim)
    ]


def _check_dask(path: Path, key, index) -> None:
    array = zarr_rb.open(path).to_dask()[key]
    whole = np.asarray(array)
    expected = whole[index]
    picked = array[index]
    got = np.asarray(picked.compute())
    assert picked.shape == expected.shape  # what dask announces
    assert got.shape == expected.shape  # what it computes
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("key", "form"), _cases(ONE_DIM_FORMS, {"obs": 3, "step": 1, ("next", "reward"): 2})
)
def test_dask_indexing_of_a_one_dim_store_is_numpys(one_dim: Path, key, form) -> None:
    _check_dask(one_dim, key, form())


@pytest.mark.parametrize(("key", "form"), _cases(TWO_DIM_FORMS, {"obs": 3, "step": 2}))
def test_dask_indexing_of_a_two_dim_store_is_numpys(two_dim: Path, key, form) -> None:
    _check_dask(two_dim, key, form())


@pytest.mark.parametrize(
    ("path", "index"),
    [("one", (1, slice(None), [2, 0])), ("two", (3, slice(None), [1, 3, 1]))],
    ids=["one-dim", "two-dim"],
)
def test_an_integer_and_a_list_apart_follow_dasks_own_rule(
    one_dim: Path, two_dim: Path, path, index
) -> None:
    """Dask orders the dimensions of ``x[1, :, [2, 0]]`` unlike NumPy: the view's arrays give
    what dask gives on the materialized array."""
    import dask.array as da

    array = zarr_rb.open(one_dim if path == "one" else two_dim).to_dask()["obs"]
    expected = np.asarray(da.from_array(np.asarray(array), chunks=array.chunks)[index])
    got = np.asarray(array[index].compute())
    assert got.shape == expected.shape == array[index].shape
    np.testing.assert_array_equal(got, expected)


def test_the_materialized_arrays_hold_what_was_written(one_dim: Path, two_dim: Path) -> None:
    """The reference of the tests above is the data written, not only what dask reads."""
    arrays = zarr_rb.open(one_dim).to_dask()
    written = _one_dim(ROWS)
    for key in ("obs", "step", ("next", "reward")):
        np.testing.assert_array_equal(np.asarray(arrays[key]), written[key].numpy())
    arrays = zarr_rb.open(two_dim).to_dask()
    written = _two_dim(ROWS)
    for key in ("obs", "step"):
        np.testing.assert_array_equal(np.asarray(arrays[key]), written[key].numpy())


ISEL_ONE_DIM = {
    "int": ({"row": 5}, (5,)),
    "negative": ({"row": -1}, (-1,)),
    "np-int": ({"row": np.int64(12)}, (12,)),
    "slice": ({"row": slice(3, 10, 2)}, (slice(3, 10, 2),)),
    "list": ({"row": [4, 0, 4]}, ([4, 0, 4],)),
    "int-element": ({"row": 2, "obs_1": 2}, (2, slice(None), 2)),
    "list-element": ({"row": [1, 7], "obs_0": 1}, ([1, 7], 1)),
    "element-only": ({"obs_1": -1}, (slice(None), slice(None), -1)),
}
ISEL_TWO_DIM = {
    "time": ({"time": 3}, (3,)),
    "time-env": ({"time": -2, "env": 1}, (-2, 1)),
    "env": ({"env": 2}, (slice(None), 2)),
    "list-time-env": ({"time": [9, 1], "env": 0}, ([9, 1], 0)),
    "time-element": ({"time": 8, "obs_0": 3}, (8, slice(None), 3)),
}


def _check_isel(path: Path, selection: dict, index: tuple) -> None:
    dataset = zarr_rb.open(path).to_xarray()
    whole = np.asarray(zarr_rb.open(path).to_dask()["obs"])
    picked = dataset["obs"].isel(selection)
    expected = whole[index]
    assert picked.shape == expected.shape
    got = picked.values
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(("selection", "index"), ISEL_ONE_DIM.values(), ids=ISEL_ONE_DIM.keys())
def test_xarray_isel_of_a_one_dim_store_is_numpys(one_dim: Path, selection, index) -> None:
    _check_isel(one_dim, selection, index)


@pytest.mark.parametrize(("selection", "index"), ISEL_TWO_DIM.values(), ids=ISEL_TWO_DIM.keys())
def test_xarray_isel_of_a_two_dim_store_is_numpys(two_dim: Path, selection, index) -> None:
    _check_isel(two_dim, selection, index)


@pytest.mark.parametrize(
    "form",
    [form for form in ROW_FORMS.values() if not isinstance(form(), tuple)] + [lambda: True],
    ids=[*(name for name, form in ROW_FORMS.items() if not isinstance(form(), tuple)), "true"],
)
def test_view_numpy_picks_rows_as_numpy_does(one_dim: Path, form) -> None:
    view = zarr_rb.open(one_dim)
    whole = view.numpy("obs")
    np.testing.assert_array_equal(whole, _one_dim(ROWS)["obs"].numpy())
    got = view.numpy("obs", form())
    expected = whole[form()]
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("form", ONE_DIM_FORMS.values(), ids=ONE_DIM_FORMS.keys())
def test_the_rows_dask_reads_take_any_numpy_index(one_dim: Path, form) -> None:
    """Dask hands the reader slices and integers; any other NumPy index gives NumPy's answer
    too."""
    from zarr_rb.analysis.arrays import _Rows

    view = zarr_rb.open(one_dim)
    whole = view.numpy("obs")
    rows = _Rows(view, ("obs",), whole.shape, whole.dtype)
    got = rows[form()]
    expected = whole[form()]
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
