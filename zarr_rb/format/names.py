"""The names of a store's layout: the format's version, the groups and the attribute key of
the record, what each part of a key may be, and the path of a key's array under ``data/``.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from zarr_rb.errors import KeyNameError, StoreCorruptedError, UnsupportedDataError

FORMAT_VERSION = 3
"""Format 2 added leaves of non-tensor values and rows of different lengths; format 3 the
slot map of the copy-on-write ring (``commit.slots``, see :mod:`zarr_rb.format.ring`). Stores
of formats 1 and 2 open unchanged; a store takes format 3 when it is first written over."""
FORMAT_NON_TENSOR = 2
"""The format that brought leaves of non-tensor values (a store taking one needs it)."""
ATTRS_KEY = "zarr_rb"
DATA_GROUP = "data"
LENGTHS_GROUP = "lengths"
"""Where the per-row lengths of ragged leaves live (``lengths/<key>``, int64)."""
FRAME_IDS_GROUP = "frame_ids"
"""Where the frame ids of leaves stored as frames live (``frame_ids/<key>``, int32)."""
FRAMES_FORMAT = 4
"""The format of a store with leaves stored as frames, each once per block
(``docs/design/frames-on-disk.md``); others keep :data:`FORMAT_VERSION`."""
STATE_GROUP = "state"
TENSOR_LEAF_NAME = "tensor"
"""Array name used under ``data/`` when the storage holds a bare tensor."""

Kind = Literal["tensordict", "tensorclass", "tensor", "pytree"]
KINDS: tuple[Kind, ...] = ("tensordict", "tensorclass", "tensor", "pytree")

_MAX_KEY_DEPTH = 32


def parse_key(key: Sequence[str], *, kind: Kind = "tensordict") -> tuple[str, ...]:
    """Validate a nested key and return it as a tuple.

    Each part becomes a Zarr node name, so it must be a non-empty string without
    ``/``, must not be ``.`` or ``..``, and must not start with ``__`` (reserved by
    the Zarr v3 specification).
    """
    key = tuple(key)
    if kind == "tensor":
        if key:
            raise StoreCorruptedError(f"expected an empty key for a tensor leaf, got {key!r}")
        return key
    if not key or len(key) > _MAX_KEY_DEPTH:
        raise UnsupportedDataError(
            f"expected a key of 1 to {_MAX_KEY_DEPTH} parts, got {key!r}",
        )
    for part in key:
        if not isinstance(part, str) or not part or "/" in part or "\x00" in part:
            raise UnsupportedDataError(
                f"key {key!r} cannot be stored: each part must be a non-empty string "
                "without '/' or NUL characters",
            )
        if part in (".", "..") or part.startswith("__"):
            raise UnsupportedDataError(
                f"key {key!r} cannot be stored: Zarr reserves the names '.', '..' and "
                "names starting with '__'; rename the entry",
            )
    return key


MAX_NAME_BYTES = 255
"""Longest name of a new key part, in UTF-8 bytes: a file name on Linux, macOS and Windows."""
MAX_KEY_BYTES = 512
"""Longest new key, its names joined by ``/``, in UTF-8 bytes: an S3 object key holds 1,024,
the store's prefix and the chunk's key included."""
_METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})
_TENSORSTORE_LOCK_SUFFIX = ".__lock"
_RECOMMENDED = "Zarr recommends names of letters, digits, '_', '-' and '.'"


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be one part of a new key (``None``: it can).

    Stricter than :func:`parse_key`, which reads the keys of existing stores: these rules
    keep a new name a node of its own for zarr-python, TensorStore, local filesystems and
    object stores alike.
    """
    if not isinstance(name, str) or not name:
        return "is empty or no string; Zarr nodes need a name"
    if "/" in name or "\\" in name:
        return "contains '/' or '\\', which Zarr and TensorStore read as a path separator"
    control = next((c for c in name if c < " " or "\x7f" <= c <= "\x9f"), None)
    if control is not None:
        return (
            f"contains the control character U+{ord(control):04X}, which file names and "
            "object-store listings do not keep"
        )
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (it holds a lone surrogate), which paths cannot encode"
    if set(name) == {"."}:
        return "is made of dots only, which Zarr reserves for relative paths"
    if name.startswith("__"):
        return "starts with '__', which the Zarr v3 specification reserves"
    if name in _METADATA_NAMES:
        return "is the name of a Zarr metadata document"
    if name.endswith(_TENSORSTORE_LOCK_SUFFIX):
        return f"ends with {_TENSORSTORE_LOCK_SUFFIX!r}, which TensorStore keeps for its lock files"
    if size > MAX_NAME_BYTES:
        return f"is {size} bytes long in UTF-8; a file name holds at most {MAX_NAME_BYTES}"
    return None


def _fold(path: tuple[str, ...]) -> tuple[str, ...]:
    """A path as filesystems that ignore case and Unicode normalization compare it."""
    return tuple(
        unicodedata.normalize("NFD", unicodedata.normalize("NFD", p).casefold()) for p in path
    )


def check_new_keys(
    keys: Iterable[Sequence[str]], *, held: Iterable[tuple[str, ...]] = (), where: str = ""
) -> None:
    """Refuse new keys that cannot become arrays of their own next to the ``held`` ones.

    A new key must be made of allowed names (:func:`name_problem`), short enough for an
    object store, and must not share a node with another key: an array cannot also be a
    group of entries, and names that differ only in case or Unicode normalization are one
    directory on macOS and Windows (and in copies made there). Held keys are not checked
    against each other: a store written before a rule existed keeps working.

    Raises:
        KeyNameError: naming the first refused key, before anything is written.
    """
    leaves = {key for key in held if key and key[0]}  # lengths leaves mirror data keys
    groups: dict[tuple[str, ...], tuple[str, ...]] = {}  # group path -> a key under it
    nodes: dict[tuple[str, ...], tuple[str, ...]] = {}  # folded node path -> node path
    for key in (*leaves, *(tuple(key) for key in keys)):
        if key not in leaves:
            problem = _key_problem(key, leaves=leaves, groups=groups, nodes=nodes)
            if problem is not None:
                raise KeyNameError(
                    f"{where + ': ' if where else ''}key {key!r} cannot be stored: {problem}. "
                    f"Rename the entry ({_RECOMMENDED})",
                    key=key,
                )
            leaves.add(key)
        for depth in range(1, len(key) + 1):
            nodes.setdefault(_fold(key[:depth]), key[:depth])
            if depth < len(key):
                groups.setdefault(key[:depth], key)


def _key_problem(
    key: tuple[str, ...],
    *,
    leaves: set[tuple[str, ...]],
    groups: Mapping[tuple[str, ...], tuple[str, ...]],
    nodes: Mapping[tuple[str, ...], tuple[str, ...]],
) -> str | None:
    """Why the new ``key`` cannot be stored next to ``leaves`` (``None``: it can)."""
    for name in key:
        problem = name_problem(name)
        if problem is not None:
            return f"the name {name!r} {problem}"
    size = len("/".join(key).encode("utf-8"))
    if size > MAX_KEY_BYTES:
        return (
            f"it is {size} bytes long in UTF-8 with its names joined by '/', more than the "
            f"{MAX_KEY_BYTES} that leave room in an object key (1,024 bytes on S3) for the "
            "store's prefix and the chunk's name"
        )
    if key in groups:
        return f"the key {groups[key]!r} makes {key!r} a group, which cannot also be an array"
    for depth in range(1, len(key) + 1):
        path = key[:depth]
        if depth < len(key) and path in leaves:
            return f"the key {path!r} is an array, which cannot also be a group of entries"
        seen = nodes.get(_fold(path))
        if seen is not None and seen != path:
            return (
                f"the names {path[-1]!r} and {seen[-1]!r} (of {seen!r}) differ only in case or "
                "Unicode normalization, and name one directory on case-insensitive "
                "filesystems (macOS, Windows)"
            )
    return None


def array_path(key: tuple[str, ...]) -> str:
    """Path of a leaf's array relative to the store root."""
    if not key:
        return f"{DATA_GROUP}/{TENSOR_LEAF_NAME}"
    return "/".join((DATA_GROUP, *key))


def frame_ids_path(key: tuple[str, ...]) -> str:
    """Path of the frame ids of a leaf stored as frames (``frame_ids/<key>``)."""
    return FRAME_IDS_GROUP + array_path(key)[len(DATA_GROUP) :]
