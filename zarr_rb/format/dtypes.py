"""The dtypes a store keeps: each torch dtype name and the dtype of the Zarr array that holds
it (bfloat16 as the bits of uint16). Tensors to and from NumPy are :mod:`zarr_rb.core.dtypes`.
"""

from __future__ import annotations

from zarr_rb.errors import UnsupportedDataError

# torch dtype name -> dtype of the Zarr array. Zarr v3 has no bfloat16, so its bits
# are kept as uint16 and the real dtype is recorded in the leaf spec.
STORED_DTYPES: dict[str, str] = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "bfloat16": "uint16",
}


def stored_dtype(dtype: str) -> str:
    """The Zarr dtype used to store a torch dtype name (``"bfloat16"`` -> ``"uint16"``)."""
    try:
        return STORED_DTYPES[dtype]
    except KeyError:
        supported = ", ".join(STORED_DTYPES)
        raise UnsupportedDataError(
            f"dtype {dtype!r} cannot be stored; supported dtypes: {supported}",
        ) from None
