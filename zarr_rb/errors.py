"""Exception types raised by zarr_rb.

Every error derives from :class:`ZarrRBError` and from the builtin a caller
already catches (``FileExistsError``, ``ValueError``, ``PermissionError``, ...),
so ``except ValueError`` keeps working for code written against TorchRL's own
storages.
"""

from __future__ import annotations

__all__ = [
    "BucketNotFoundError",
    "ChunkCorruptedError",
    "CredentialsError",
    "EndpointUnreachableError",
    "EpisodeIndexError",
    "FencedError",
    "FormatVersionError",
    "InvalidLocationError",
    "KeyNameError",
    "LiveBufferError",
    "LockedError",
    "LocksUnsupportedError",
    "MissingDependencyError",
    "MixedWritersError",
    "NoEpisodeFlagsError",
    "NoSavedBufferError",
    "NotAStoreError",
    "NotAnImageError",
    "NotSupportedError",
    "ReadOnlyError",
    "ReadOnlyFilesystemError",
    "RowIndexError",
    "RowsNotCommittedError",
    "SaveOverwrittenError",
    "SchemaMismatchError",
    "ServerBusyError",
    "SlotsExhaustedError",
    "StateChangedError",
    "StoreClosedError",
    "StoreCorruptedError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreWriteError",
    "TorchRLVersionError",
    "UnknownKeyError",
    "UnstackableError",
    "UnsupportedDataError",
    "VersionExistsError",
    "VersionNotFoundError",
    "ZarrRBError",
]


class ZarrRBError(Exception):
    """Base class of every error raised by zarr_rb."""


class NotAStoreError(ZarrRBError, FileExistsError):
    """The path exists but does not hold a zarr_rb store."""


class StoreNotFoundError(ZarrRBError, FileNotFoundError):
    """No zarr_rb store at the path, and the mode asked for an existing one."""


class StoreExistsError(ZarrRBError, FileExistsError):
    """A store exists at the path and the mode (``"w-"``, ``existsok=False``) forbids reusing
    it."""


class NotSupportedError(ZarrRBError, NotImplementedError):
    """A TorchRL feature that ZarrStorage does not offer (yet); the message says what to do
    instead."""


class NoSavedBufferError(ZarrRBError, FileNotFoundError):
    """The store holds data but no buffer state saved by ``zarr_rb.save``."""


class StoreCorruptedError(ZarrRBError, ValueError):
    """The store's metadata cannot be parsed or contradicts itself."""


class FormatVersionError(ZarrRBError, ValueError):
    """The store was written with a format this version of zarr_rb cannot read."""


class TorchRLVersionError(ZarrRBError, ValueError):
    """The saved buffer names a TorchRL class, or a constructor argument of one, that the
    installed TorchRL does not have: another TorchRL release saved it.

    Attributes:
        component: the TorchRL class (``"SliceSampler"``).
        argument: the constructor argument (``None``: the class itself is missing).
        saved_version: the TorchRL release that saved the buffer (``None``: not recorded).
        installed_version: the installed TorchRL release.
    """

    def __init__(
        self,
        message: str,
        *,
        component: str,
        argument: str | None,
        saved_version: str | None,
        installed_version: str,
    ) -> None:
        super().__init__(message)
        self.component = component
        self.argument = argument
        self.saved_version = saved_version
        self.installed_version = installed_version


class StateChangedError(ZarrRBError, RuntimeError):
    """The saved buffer state was replaced by newer saves every time a load read it (a
    writer saving faster than the store can be read)."""


class SchemaMismatchError(ZarrRBError, ValueError):
    """Data written to a store does not match the keys, shapes or dtypes it holds."""


class UnsupportedDataError(ZarrRBError, TypeError):
    """Data of a kind, dtype or key name that a store cannot hold."""


class UnstackableError(UnsupportedDataError, RuntimeError):
    """The elements of a list written at once cannot be stacked into one batch (TorchRL's
    storages raise ``RuntimeError`` there too)."""


class StoreClosedError(ZarrRBError, ValueError):
    """A storage was used after :meth:`~zarr_rb.ZarrStorage.close` (``ValueError``, as I/O on
    a closed file)."""


class ReadOnlyError(ZarrRBError, PermissionError):
    """A write was attempted on a storage opened read-only."""


class RowIndexError(ZarrRBError, IndexError):
    """An index addresses rows outside the storage's capacity."""


class RowsNotCommittedError(ZarrRBError, IndexError):
    """A reader asked for rows that are not part of the last commit."""


class ChunkCorruptedError(StoreCorruptedError):
    """Stored rows cannot be read back intact: a chunk fails its checksum, is truncated,
    empty or missing inside the committed range.

    Attributes:
        array: path of the array inside the store (``"data/obs"``).
        rows: ``(start, stop)`` row ranges of the damaged chunks.
    """

    def __init__(self, message: str, *, array: str, rows: list[tuple[int, int]]) -> None:
        super().__init__(message)
        self.array = array
        self.rows = rows


class StoreWriteError(ZarrRBError, OSError):
    """Writing to the store failed (a full disk, an I/O error). The store stays at its last
    commit; ``errno`` is that of the underlying failure."""


class LockedError(ZarrRBError, BlockingIOError):
    """Another writer holds the store.

    Attributes:
        holder: ``{"host": ..., "pid": ..., "since": ...}`` of the writer that holds it
            (as it recorded itself; empty if it could not be read).
    """

    def __init__(self, message: str, *, holder: dict[str, object]) -> None:
        super().__init__(message)
        self.holder = holder


class MixedWritersError(LockedError):
    """A single writer and shared writers (``shared=True``) tried to write one store."""


class LocksUnsupportedError(ZarrRBError, OSError):
    """The filesystem of a local store has no working file locks, which its writers need."""


class FencedError(LockedError):
    """This writer lost its hold on the store (its lease expired while it stalled, and
    another writer may have taken over): it writes nothing more. Reopen the store to
    write again; rows it had not committed are lost."""


class BucketNotFoundError(StoreNotFoundError):
    """The object-store bucket named in the store's URL does not exist."""


class CredentialsError(ZarrRBError, PermissionError):
    """The object store refused the credentials (wrong key or secret, or no right to
    the bucket)."""


class EndpointUnreachableError(ZarrRBError, ConnectionError):
    """The object store's endpoint did not answer in time (a wrong URL, a server down)."""


class ServerBusyError(ZarrRBError, ConnectionError):
    """An object store kept answering with server errors (5xx) after every retry."""


class InvalidLocationError(ZarrRBError, ValueError):
    """A store URL or ``storage_options`` that cannot name a location."""


class UnknownKeyError(ZarrRBError, KeyError):
    """A key the store does not hold; the message lists the keys it holds."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


class NoEpisodeFlagsError(ZarrRBError, LookupError):
    """The store holds no key that marks where episodes end; the message lists the keys
    looked for and how to name one."""


class EpisodeIndexError(ZarrRBError, IndexError):
    """An episode number outside the episodes the store holds."""


class NotAnImageError(ZarrRBError, ValueError):
    """A key whose rows are not images (``uint8`` ``[C, H, W]`` or ``[H, W]``)."""


class MissingDependencyError(ZarrRBError, ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""


class SaveOverwrittenError(ZarrRBError, LookupError):
    """The rows a save (or an in-place ``rb.dumps``) covered were written over since: the
    ring wrapped past them, rows were rewritten, or the buffer was emptied. Loading it would
    pair the saved state with other rows."""


class VersionNotFoundError(ZarrRBError, LookupError):
    """A version asked for (a tag, or the number of a save) that the store does not keep:
    never saved, dropped, or replaced by a later save. The message lists the versions it
    keeps."""


class NoHistoryError(ZarrRBError, LookupError):
    """A store's history was asked for (``history=True``), but the store keeps none: it was
    not written with ``archive=True``."""


class VersionExistsError(ZarrRBError, FileExistsError):
    """A save tagged with a name that a kept version of the store has already."""


class SlotsExhaustedError(ZarrRBError, OSError):
    """A store's record names as many slots as a record may (on S3, each writer that
    takes a store over reserves slots of its own past those before it): nothing more is
    written there. The message says how to go on in a new store."""


class LiveBufferError(ZarrRBError, RuntimeError):
    """A load in the process that has the buffer open for writing would move that live
    buffer back to an older state, dropping rows it committed since."""


class ReadOnlyFilesystemError(ReadOnlyError):
    """A writer was opened on a store whose filesystem is mounted read-only: it can be read
    (``read_only=True``) but not written there."""


class KeyNameError(UnsupportedDataError, ValueError):
    """A key whose name cannot name a Zarr node: Zarr, TensorStore or a filesystem reserves
    it, or it would share a node with another key of the store. The message says which
    rule and how to rename the entry.

    Attributes:
        key: the refused key, as a tuple of names.
    """

    def __init__(self, message: str, *, key: tuple[str, ...]) -> None:
        super().__init__(message)
        self.key = key
