"""Helpers for the data-kind tests: rows of every kind TorchRL buffers hold, and an exact
comparison of what two storages return (container types, keys, values and their types)."""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDict,
    is_leaf_nontensor,
    is_non_tensor,
    is_tensor_collection,
    lazy_stack,
)


def values(items: list[Any]) -> NonTensorStack:
    """One Python value per row, as TorchRL users build them."""
    return NonTensorStack(*[NonTensorData(item) for item in items])


def token_rows(lengths: list[int], *, seed: int = 0) -> LazyStackedTensorDict:
    """An LLM-style lazy stack: token ids of each row's own length, a reward, a prompt."""
    g = torch.Generator().manual_seed(seed)
    return lazy_stack(
        [
            TensorDict(
                {
                    "tokens": torch.randint(0, 50_000, (n,), generator=g, dtype=torch.int32),
                    "reward": torch.randn((), generator=g),
                    "prompt": NonTensorData(f"prompt {seed}-{i} ({n} tokens) ✓"),
                }
            )
            for i, n in enumerate(lengths)
        ]
    )


def describe(value: Any) -> tuple[Any, ...]:
    """A value down to its bits: dtype and shape of a tensor, type of a Python value."""
    if is_non_tensor(value):
        data = value.data
        if isinstance(data, float) and math.isnan(data):
            return ("value", "float", "nan")
        return ("value", type(data).__name__, data)
    if isinstance(value, torch.Tensor):
        if hasattr(value, "materialize"):
            value = value.materialize()
        flat = value.detach().contiguous()
        bits = flat.reshape(-1).view(torch.uint8).tolist()
        return ("tensor", str(flat.dtype), tuple(flat.shape), bits)
    raise AssertionError(f"unexpected leaf {type(value).__name__}")


def row_leaves(row: Any) -> dict[Any, tuple[Any, ...]]:
    keys = row.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)
    return {key: describe(row.get(key)) for key in keys}


def assert_same_rows(actual: Any, expected: Any) -> None:
    """``actual`` holds what ``expected`` holds, row by row and bit by bit, in a container of
    the same type (a TensorDict, a lazy stack, a tensor, a pytree)."""
    if isinstance(expected, (dict, list, tuple)):
        assert type(actual) is type(expected), (type(actual), type(expected))
        assert len(actual) == len(expected)
        pairs = actual.items() if isinstance(actual, dict) else enumerate(actual)
        for key, item in pairs:
            assert_same_rows(item, expected[key])
        return
    if not is_tensor_collection(expected):
        assert describe(actual) == describe(expected)
        return
    assert type(actual) is type(expected), (type(actual).__name__, type(expected).__name__)
    assert actual.batch_size == expected.batch_size
    if not expected.batch_size:
        assert row_leaves(actual) == row_leaves(expected)
    for i in range(expected.batch_size[0] if expected.batch_size else 0):
        assert row_leaves(actual[i]) == row_leaves(expected[i]), f"row {i} differs"
    keys = expected.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)
    for key in keys:  # the columns too: NonTensorStack for values, as TorchRL returns them
        assert _column_type(actual, key) is _column_type(expected, key), key


def _column_type(data: Any, key: Any) -> type:
    try:
        return type(data.get(key))
    except Exception as error:  # a lazy stack of rows of different lengths has no column
        return type(error)


def assert_same_samples(ours: Any, theirs: Any, seeds: Any = range(3)) -> None:
    """Seeded samples of two buffers hold the same rows."""
    for seed in seeds:
        ours.set_rng(torch.Generator().manual_seed(seed))
        theirs.set_rng(torch.Generator().manual_seed(seed))
        assert_same_rows(ours.sample(), theirs.sample())
