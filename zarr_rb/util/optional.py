"""Optional dependencies, imported when first used and named, with the extra that installs
them, when missing (fsspec's way: never at ``import zarr_rb``)."""

from __future__ import annotations

import importlib
from typing import Any

from zarr_rb.errors import MissingDependencyError


def require(module: str, *, extra: str, what: str) -> Any:
    """Import ``module`` for ``what``, or raise :class:`MissingDependencyError` saying how to
    install the extra ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing = err.name or module
        raise MissingDependencyError(
            f"{what} needs {missing!r}, which is not installed: install zarr_rb's {extra!r} "
            f"extra, pip install -e '.[{extra}]' in a checkout of zarr_rb (it is not on PyPI)"
        ) from None
