"""Torch dtypes as stored: names, and tensors to and from NumPy (bfloat16 as uint16 bits)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype of a stored dtype name, bfloat16 as ``ml_dtypes.bfloat16`` (which
    TensorStore depends on) for NumPy users, to view the stored bits as."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)  # type: ignore[no-any-return]
    return np.dtype(name)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor in its stored dtype (bfloat16 bits as uint16)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))
