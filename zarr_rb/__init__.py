"""zarr_rb: persistent, out-of-core replay-buffer storage for TorchRL on Zarr v3.

Examples:
    >>> import torch, zarr_rb
    >>> from tensordict import TensorDict
    >>> from torchrl.data import TensorDictReplayBuffer
    >>> rb = TensorDictReplayBuffer(storage=zarr_rb.ZarrStorage(1_000_000, "runs/pong.zarr"))
    >>> rb.extend(TensorDict({"obs": torch.zeros(8, 4, 84, 84, dtype=torch.uint8)}, [8]))
    tensor([0, 1, 2, 3, 4, 5, 6, 7])
    >>> rb.storage.flush()                          # committed: other processes see it
    >>> view = zarr_rb.open("runs/pong.zarr")       # read-only, for analysis
    >>> len(view)
    8

The public names are imported on first use (PEP 562): ``import zarr_rb`` and the
``zarr-rb`` command start without importing torch or TorchRL, which take seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zarr_rb.analysis import ReplayDataset, View, open
    from zarr_rb.api import Version, drop_version, load, save, versions
    from zarr_rb.engine.layout import Compression
    from zarr_rb.errors import (
        ChunkCorruptedError,
        EpisodeIndexError,
        FormatVersionError,
        LockedError,
        MissingDependencyError,
        NoEpisodeFlagsError,
        NoHistoryError,
        NoSavedBufferError,
        NotAnImageError,
        NotAStoreError,
        NotSupportedError,
        ReadOnlyError,
        RowIndexError,
        RowsNotCommittedError,
        SchemaMismatchError,
        StoreClosedError,
        StoreCorruptedError,
        StoreExistsError,
        StoreNotFoundError,
        StoreWriteError,
        UnknownKeyError,
        UnstackableError,
        UnsupportedDataError,
        VersionExistsError,
        VersionNotFoundError,
        ZarrRBError,
    )
    from zarr_rb.format.names import FORMAT_VERSION
    from zarr_rb.interop.dumps import import_torchrl
    from zarr_rb.interop.export import export_torchrl
    from zarr_rb.state import PickleNotAllowedError
    from zarr_rb.torchrl.columns import LazyColumn
    from zarr_rb.torchrl.storage import ZarrStorage
    from zarr_rb.verify import DamagedChunk, VerifyReport, verify

from zarr_rb._version import __version__

_ERRORS = (
    "ChunkCorruptedError",
    "EpisodeIndexError",
    "FormatVersionError",
    "LockedError",
    "MissingDependencyError",
    "NoEpisodeFlagsError",
    "NoHistoryError",
    "NoSavedBufferError",
    "NotAStoreError",
    "NotAnImageError",
    "NotSupportedError",
    "ReadOnlyError",
    "RowIndexError",
    "RowsNotCommittedError",
    "SchemaMismatchError",
    "StoreClosedError",
    "StoreCorruptedError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreWriteError",
    "UnknownKeyError",
    "UnstackableError",
    "UnsupportedDataError",
    "VersionExistsError",
    "VersionNotFoundError",
    "ZarrRBError",
)
_HOMES: dict[str, str] = {
    **dict.fromkeys(_ERRORS, "zarr_rb.errors"),
    "FORMAT_VERSION": "zarr_rb.format.names",
    "Compression": "zarr_rb.engine.layout",
    "DamagedChunk": "zarr_rb.verify",
    "LazyColumn": "zarr_rb.torchrl.columns",
    "PickleNotAllowedError": "zarr_rb.state",
    "ReplayDataset": "zarr_rb.analysis",
    "VerifyReport": "zarr_rb.verify",
    "View": "zarr_rb.analysis",
    "ZarrStorage": "zarr_rb.torchrl.storage",
    "export_torchrl": "zarr_rb.interop.export",
    "import_torchrl": "zarr_rb.interop.dumps",
    "Version": "zarr_rb.api",
    "drop_version": "zarr_rb.api",
    "load": "zarr_rb.api",
    "open": "zarr_rb.analysis",
    "save": "zarr_rb.api",
    "verify": "zarr_rb.verify",
    "versions": "zarr_rb.api",
}
"""The module each public name comes from."""

__all__ = [
    "FORMAT_VERSION",
    "ChunkCorruptedError",
    "Compression",
    "DamagedChunk",
    "EpisodeIndexError",
    "FormatVersionError",
    "LazyColumn",
    "LockedError",
    "MissingDependencyError",
    "NoEpisodeFlagsError",
    "NoHistoryError",
    "NoSavedBufferError",
    "NotAStoreError",
    "NotAnImageError",
    "NotSupportedError",
    "PickleNotAllowedError",
    "ReadOnlyError",
    "ReplayDataset",
    "RowIndexError",
    "RowsNotCommittedError",
    "SchemaMismatchError",
    "StoreClosedError",
    "StoreCorruptedError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreWriteError",
    "UnknownKeyError",
    "UnstackableError",
    "UnsupportedDataError",
    "VerifyReport",
    "Version",
    "VersionExistsError",
    "VersionNotFoundError",
    "View",
    "ZarrRBError",
    "ZarrStorage",
    "__version__",
    "drop_version",
    "export_torchrl",
    "import_torchrl",
    "load",
    "open",
    "save",
    "verify",
    "versions",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value
    # ``import zarr_rb`` used to import every submodule on the way; ``zarr_rb.errors`` and
    # the like keep working after it alone.
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package module: ``zarr_rb.verify`` stays the function when the submodule of the
    same name is imported (the import system then sets the package attribute to it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
