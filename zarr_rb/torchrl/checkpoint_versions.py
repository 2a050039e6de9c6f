"""TorchRL's own checkpoints (``torchrl.checkpoint``) of a buffer on a :class:`ZarrStorage`:
a version of the store and a pointer to it, instead of a copy of its rows.

``Checkpoint(buffer=rb).save(path)`` stages each component in a directory beside ``path``
and has the buffer dump itself there (``rb.dumps``). When the storage's part of that dump
is inside such a stage, :func:`dump_as_version` keeps the rows as a version of the store
(metadata only: the record pins their map) and writes a small pointer file,
:data:`POINTER`, where TorchRL expected the rows. :func:`load_version` restores them from
it. Each version records, in a note of its own (:data:`NOTE`, in its state group), the
checkpoint's stage and destination; a version that neither names any longer is dropped at
the next checkpoint (:func:`drop_unnamed_checkpoints`), so that rotating checkpoints
rotates versions. See ``docs/design/checkpoint.md``.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
import zipfile
from pathlib import Path
from typing import Any

from zarr_rb._version import __version__
from zarr_rb.core.store import Store
from zarr_rb.errors import FormatVersionError, StoreCorruptedError, VersionNotFoundError
from zarr_rb.format.record import Saved
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.reads import StorageReads
from zarr_rb.torchrl.state_dict import copy_rows
from zarr_rb.util.io import load_json

POINTER = "zarr_rb_checkpoint.json"
"""The file a checkpoint holds in place of the rows: the store, the version's tag."""
NOTE = "torchrl_checkpoint.json"
"""The object, in a checkpoint version's state group, naming its stage and destination."""
TAG_PREFIX = "torchrl-checkpoint-"
"""Versions kept for TorchRL checkpoints are tagged with this and a random hex string."""
POINTER_FORMAT = 1


def dump_as_version(storage: StorageReads, path: Path, stage: Path, destination: Path) -> None:
    """Keep the storage's rows as a version of its store and point ``path`` at it (a
    checkpoint being staged in ``stage``, to be published at ``destination``)."""
    store = storage.store
    store.lifetime.ensure_on_disk()
    storage.flush()
    place = _place_of(storage)
    drop_unnamed_checkpoints(store, place)  # those rotated or deleted since the last one
    tag = TAG_PREFIX + uuid.uuid4().hex
    saved = Saved(slot=store.saves.take_slot(), length=len(storage), cursor=storage.cursor)
    note = {
        "host": _machine(),
        "store": place,
        "stage": str(stage),
        "destination": str(destination),
    }
    store.lifetime.check_hold()  # the group may be a newer writer's save
    with store.writing("recording a TorchRL checkpoint"):
        store.engine.location.write(f"{saved.group}/{NOTE}", json.dumps(note).encode())
    store.saves.publish(saved, tag=tag, last=False)
    path.mkdir(parents=True, exist_ok=True)
    pointer = {"format": POINTER_FORMAT, "store": storage.url, "tag": tag, "zarr_rb": __version__}
    if isinstance(storage.path, Path):
        # Also relative to where the pointer lands, so that a checkpoint directory moved
        # together with its store still finds it (an archive is read from a temporary copy:
        # the absolute path serves).
        pointer["store"] = str(storage.path)
        pointer["relative"] = os.path.relpath(storage.path, destination / path.relative_to(stage))
    (path / POINTER).write_text(json.dumps(pointer))


def load_version(storage: StorageReads, path: Path) -> None:
    """Put the rows of the version ``path``'s pointer names into ``storage``: on its own
    store, that version's rows at once (a version keeps them, whatever was written
    since); from another store, copied.

    Raises:
        VersionNotFoundError: the store no longer keeps that version, or is gone.
        FormatVersionError: the pointer was written by a newer zarr_rb.
        StoreCorruptedError: the pointer cannot be parsed.
    """
    tag, source = _read_pointer(path)
    same = (
        isinstance(storage.path, Path)
        and isinstance(source, Path)
        and source == storage.path.resolve()  # (the pointer's path is resolved: symlinks, '..')
    ) or str(source) == storage.url
    if same:
        if storage.store.is_shared:
            storage.store.refresh()
        saved = _version(storage.store, tag, path)
        storage.store.saves.check_saved(saved)
        storage.restore(length=saved.length, cursor=saved.cursor, save=saved)
        return
    try:
        other = type(storage)(path=source, ndim=storage.ndim, read_only=True)
    except FileNotFoundError as err:
        raise VersionNotFoundError(
            f"TorchRL checkpoint {str(path)!r} points at store {str(source)!r}, which is gone "
            f"({err}); a checkpoint of a ZarrStorage holds a pointer to the store's version "
            f"{tag!r}, not its rows",
        ) from None
    with other:
        saved = _version(other.store, tag, path)
        other.store.saves.use_save(saved)
        if other.schema is not None:
            copy_rows(other, storage, rows=other.rows_held)
    storage.restore(length=saved.length, cursor=saved.cursor)


def drop_unnamed_checkpoints(store: Store, place: str) -> list[str]:
    """Drop the checkpoint versions that no checkpoint names any longer: their stage is gone,
    and neither their destination nor anything beside it (a checkpoint renamed in its
    directory) holds a pointer to them: rotated, deleted, or never published.

    Kept whenever that cannot be told: versions made on another machine (their paths are
    not this machine's), versions made while the store was elsewhere (``place``: where it
    is now; a store moved or copied with its checkpoints), and versions whose checkpoint's
    directory is gone altogether (moved with it). Returns the tags dropped."""
    machine = _machine()
    dropped = []
    for tag, saved in sorted(store.meta.versions.items()):
        if not tag.startswith(TAG_PREFIX):
            continue
        note = _note(store, saved)
        if note is None or note.get("host") != machine or note.get("store") != place:
            continue
        stage, destination = Path(note["stage"]), Path(note["destination"])
        if stage.exists() or not destination.parent.is_dir():
            continue
        beside = (p for p in destination.parent.iterdir() if p not in (stage, destination))
        if _names(destination, tag) or any(_names(p, tag, unsure=False) for p in beside):
            continue
        try:
            store.saves.drop_version(tag)
        except VersionNotFoundError:
            continue  # another writer of a shared store dropped it first
        dropped.append(tag)
    return dropped


def kept_by_checkpoint(store: Store, tag: str, saved: Saved) -> bool:
    """Whether version ``tag`` was kept by a TorchRL checkpoint: its tag has the prefix
    and its state group holds the note (a user's ``zarr_rb.save(rb, tag=...)`` may use
    any tag, that prefix too)."""
    return tag.startswith(TAG_PREFIX) and _note(store, saved) is not None


def _version(store: Store, tag: str, path: Path) -> Saved:
    saved = store.meta.versions.get(tag)
    if saved is None:
        raise VersionNotFoundError(
            f"store {store.url!r} no longer keeps version {tag!r}, which TorchRL checkpoint "
            f"{str(path)!r} points at (dropped with zarr_rb.drop_version, or the store was "
            "emptied or replaced); a checkpoint of a ZarrStorage holds a pointer to a "
            "version of its store, not its rows",
        )
    return saved


def _read_pointer(path: Path) -> tuple[str, Path | str]:
    where = str(path / POINTER)
    try:
        pointer = load_json((path / POINTER).read_bytes())
        if not isinstance(pointer, dict):
            raise ValueError("not an object")
        version, tag, store = pointer["format"], pointer["tag"], pointer["store"]
        if not (isinstance(version, int) and isinstance(tag, str) and isinstance(store, str)):
            raise ValueError("format, tag or store of the wrong type")
    except (ValueError, KeyError, RecursionError) as err:
        raise StoreCorruptedError(f"TorchRL checkpoint pointer {where!r}: {err}") from None
    if version > POINTER_FORMAT:
        raise FormatVersionError(
            f"{where!r} was written by zarr_rb {pointer.get('zarr_rb', '?')} (pointer format "
            f"{version}); zarr_rb {__version__} reads format {POINTER_FORMAT} at most: "
            "upgrade zarr_rb",
        )
    if "://" in store:
        return tag, store
    relative = pointer.get("relative")
    if isinstance(relative, str) and (path / relative / "zarr.json").is_file():
        return tag, (path / relative).resolve()
    return tag, Path(store).resolve()


def _machine() -> str:
    """This machine: its host name and, where the system keeps one, its machine id (two
    machines of one host name, a container's name reused, are told apart)."""
    try:
        machine_id = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine_id = ""
    return f"{socket.gethostname()}/{machine_id}"


def _place_of(storage: StorageReads) -> str:
    """Where the store is: its resolved directory, or its URL."""
    if isinstance(storage.path, Path):
        return str(storage.path.resolve())
    return storage.url


def _note(store: Store, saved: Saved) -> dict[str, Any] | None:
    data = store.engine.location.read(f"{saved.group}/{NOTE}")
    if data is None:
        return None
    try:
        note = load_json(data)
    except (ValueError, RecursionError):
        return None
    fields = ("host", "store", "stage", "destination")
    if not isinstance(note, dict) or not all(isinstance(note.get(f), str) for f in fields):
        return None
    return note


def _names(path: Path, tag: str, *, unsure: bool = True) -> bool:
    """Whether the checkpoint at ``path`` (a directory TorchRL wrote, with its manifest, or
    an archive of one) holds a pointer to ``tag``. Anything else names nothing; a
    checkpoint that cannot be read counts as ``unsure`` (the destination itself: as naming
    it, nothing is dropped on doubt)."""
    try:
        if (path / compat.CHECKPOINT_MANIFEST).is_file():
            pointers = [p.read_bytes() for p in (path / "components").rglob(POINTER)]
        elif path.is_file() and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                names = [n for n in archive.namelist() if n.endswith(f"/{POINTER}")]
                pointers = [archive.read(n) for n in names]
        else:
            return False
    except (OSError, zipfile.BadZipFile):
        return unsure
    return any(tag.encode() in pointer for pointer in pointers)
