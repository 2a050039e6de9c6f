"""zarr_rb: persistent, out-of-core replay-buffer storage for TorchRL on Zarr v3.

Examples:
    >>> from torchrl.data import TensorDictReplayBuffer
    >>> from zarr_rb import ZarrStorage
    >>> rb = TensorDictReplayBuffer(storage=ZarrStorage(1_000_000, "runs/pong.zarr"))
    >>> view = zarr_rb.open("runs/pong.zarr")   # read-only, for analysis
"""

from __future__ import annotations

from zarr_rb._lazy import LazyColumn
from zarr_rb.analysis import ReplayDataset, View, open
from zarr_rb.api import load, save
from zarr_rb.convert import export_torchrl, import_torchrl
from zarr_rb.core.format import FORMAT_VERSION
from zarr_rb.core.layout import Compression
from zarr_rb.errors import (
    ChunkCorruptedError,
    EpisodeIndexError,
    FormatVersionError,
    LockedError,
    MissingDependencyError,
    NoEpisodeFlagsError,
    NoSavedBufferError,
    NotAnImageError,
    NotAStoreError,
    NotSupportedError,
    ReadOnlyError,
    RowIndexError,
    RowsNotCommittedError,
    SchemaMismatchError,
    StoreCorruptedError,
    StoreExistsError,
    StoreNotFoundError,
    StoreWriteError,
    UnknownKeyError,
    UnstackableError,
    UnsupportedDataError,
    ZarrRBError,
)
from zarr_rb.state import PickleNotAllowedError
from zarr_rb.storage import ZarrStorage
from zarr_rb.verify import DamagedChunk, VerifyReport, verify

__version__ = "0.1.0"

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
    "StoreCorruptedError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreWriteError",
    "UnknownKeyError",
    "UnstackableError",
    "UnsupportedDataError",
    "VerifyReport",
    "View",
    "ZarrRBError",
    "ZarrStorage",
    "__version__",
    "export_torchrl",
    "import_torchrl",
    "load",
    "open",
    "save",
    "verify",
]
