"""The on-disk layout of a zarr_rb store (format 1).

Pure data: names, attribute keys, key <-> array-path mapping, dtype mapping
and the JSON records kept in the root group's attributes. Nothing here does
I/O or imports torch, so the layout can be read and checked on its own.

Layout::

    store.zarr/               root group; attributes["zarr_rb"] = StoreMeta
      data/                   one array per leaf, shape [rows, *batch_dims[1:], *leaf_shape]
        observation
        next/observation      nested keys are nested groups

The root attributes are the commit point: they are replaced atomically, and only
after the rows they declare readable are on disk.
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from zarr_rb.errors import (
    FormatVersionError,
    KeyNameError,
    StoreCorruptedError,
    UnsupportedDataError,
)
from zarr_rb.format.pieces import MapPieceMissingError, PieceSource, parse_map
from zarr_rb.format.ring import SlotMap, invalid_metadata, parse_slot_map
from zarr_rb.format.runs import RunMap

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
STATE_GROUP = "state"
TENSOR_LEAF_NAME = "tensor"
"""Array name used under ``data/`` when the storage holds a bare tensor."""

Kind = Literal["tensordict", "tensorclass", "tensor", "pytree"]
KINDS: tuple[Kind, ...] = ("tensordict", "tensorclass", "tensor", "pytree")
_MAX_TREESPEC_CHARS = 2**20

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

_MAX_LEAVES = 10_000
_MAX_KEY_DEPTH = 32
_MAX_DIMS = 32


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


def stored_dtype(dtype: str) -> str:
    """The Zarr dtype used to store a torch dtype name (``"bfloat16"`` -> ``"uint16"``)."""
    try:
        return STORED_DTYPES[dtype]
    except KeyError:
        supported = ", ".join(STORED_DTYPES)
        raise UnsupportedDataError(
            f"dtype {dtype!r} cannot be stored; supported dtypes: {supported}",
        ) from None


Value = Literal["tensor", "ragged", "str", "bytes", "int", "float", "bool", "none", "lengths"]
"""What a leaf holds per row: a tensor of a fixed shape; a tensor whose first dimension differs
from row to row (``"ragged"``); one Python value of a type (``"str"``, ``"bytes"``, ``"int"``,
``"float"``, ``"bool"``, ``"none"``: ``NonTensorData`` entries); or the row lengths of a ragged
leaf (``"lengths"``, internal)."""
VALUES: tuple[Value, ...] = (
    "tensor",
    "ragged",
    "str",
    "bytes",
    "int",
    "float",
    "bool",
    "none",
    "lengths",
)
RAGGED_VALUES = ("ragged", "str", "bytes")
"""Leaves kept as rows of different lengths: values padded along their first element
dimension (an array that grows wider as longer rows come), and a lengths leaf."""
RAGGED_NOMINAL_LENGTH = 256
"""The row length of ragged leaves assumed where a row's size must be guessed (block sizes)."""
SCALAR_DTYPES = {"str": "uint8", "bytes": "uint8", "int": "int64", "float": "float64"}
SCALAR_DTYPES.update({"bool": "bool", "none": "uint8"})
"""The dtype each kind of non-tensor value is stored as (strings as their UTF-8 bytes)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeafSpec:
    """One array of the store: its key, its torch dtype, the shape of one element and what
    one row of it holds (:data:`Value`).

    ``shape`` excludes the storage's batch dimensions (``ndim`` of them) and, for ragged
    leaves, the dimension whose length varies from row to row (the first of the element).
    """

    key: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    value: Value = "tensor"

    @property
    def ragged(self) -> bool:
        return self.value in RAGGED_VALUES

    @property
    def lengths_key(self) -> tuple[str, ...]:
        """The key of this ragged leaf's lengths leaf (no data key starts with ``""``)."""
        return ("", *self.key)

    def lengths_leaf(self) -> LeafSpec:
        return LeafSpec(key=self.lengths_key, dtype="int64", shape=(), value="lengths")

    @property
    def stored_dtype(self) -> str:
        return stored_dtype(self.dtype)

    @property
    def path(self) -> str:
        if self.value == "lengths":
            return "/".join((LENGTHS_GROUP, *self.key[1:]))
        return array_path(self.key)

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.stored_dtype).itemsize)

    @property
    def element_nbytes(self) -> int:
        """Bytes of one element (of a ragged leaf: of a nominal row, for sizing blocks)."""
        nominal = RAGGED_NOMINAL_LENGTH if self.ragged else 1
        return self.itemsize * math.prod(self.shape) * nominal

    def to_json(self) -> dict[str, Any]:
        out = {"key": list(self.key), "dtype": self.dtype, "shape": list(self.shape)}
        if self.value != "tensor":
            out["value"] = self.value
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class Schema:
    """What the store holds: the data kind, its batch shape and its leaves."""

    kind: Kind
    batch_shape: tuple[int, ...]
    """Capacity along each of the ``ndim`` batch dimensions, e.g. ``(rows, n_envs)``."""
    leaves: tuple[LeafSpec, ...]
    tensorclass: str | None = None
    """``"module:qualname"`` of the tensorclass for ``kind == "tensorclass"``."""
    item_batch_shape: tuple[int, ...] = ()
    """Batch dimensions of one stored TensorDict beyond the storage's own ``ndim``."""
    treespec: str | None = None
    """For ``kind == "pytree"``: the structure (``torch.utils._pytree.treespec_dumps``); the
    leaves are in its order."""

    @property
    def rows(self) -> int:
        return self.batch_shape[0]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row (all leaves, all trailing batch dimensions)."""
        return self.elements_per_row * sum(leaf.element_nbytes for leaf in self.leaves)

    @property
    def elements_per_row(self) -> int:
        """Elements of one row (``n_envs`` with ``ndim=2``; TorchRL counts elements)."""
        return math.prod(self.batch_shape[1:])

    def with_leaves(self, leaves: Sequence[LeafSpec]) -> Schema:
        """This schema with ``leaves`` added (new keys), leaves kept in key order."""
        grown = tuple(sorted((*self.leaves, *leaves), key=lambda leaf: leaf.key))
        return dataclasses.replace(self, leaves=grown)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "batch_shape": list(self.batch_shape),
            "tensorclass": self.tensorclass,
            "item_batch_shape": list(self.item_batch_shape),
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "treespec": self.treespec,
        }


RECENT_TAKES = 64
"""Slots taken last that a shared record names (readers check their reads against them)."""
LAST_COMMITS = 64
"""Writers whose last commit a shared record names (:attr:`Ring.committed`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Ring:
    """How the writers of a shared store share the slots of its arrays (format 3).

    Each writer appends into a slot of its own, ``open``; the commit that publishes its
    rows maps their positions to them (:attr:`Commit.runs`). A slot is free when no run,
    no open slot and no kept save refers to it. ``capacity`` is the slots the arrays have.
    ``takes`` counts the slots taken so far, ``recent`` names the last of them: a reader
    that read rows of one of them under an older record reads again.

    ``legacy``: the record of a store shared under format 2 (blocks taken in ring order),
    converted to runs by the first writer that joins it.

    Where a writer that lost its hold may still write (a lease: see
    ``WriterHold.late_writes``), slots it could be writing are never taken again:
    ``retired`` are the open slots of writers taken for gone, and no slot below
    ``fresh_from`` that no run refers to is taken (the slots a store of one writer had
    when it became shared: that writer's, were it stalled).

    ``committed``: ``(writer, generation)`` of the last record each of the writers that
    published last published (at most :data:`LAST_COMMITS`, the newest last). A writer
    whose compare-and-swap was refused although it landed (its answer lost, the request
    retried) finds its own there, also under records other writers published since.
    """

    capacity: int = 0
    open: tuple[tuple[str, int], ...] = ()
    takes: int = 0
    recent: tuple[int, ...] = ()
    legacy: bool = False
    retired: tuple[int, ...] = ()
    fresh_from: int = 0
    committed: tuple[tuple[str, int], ...] = ()

    def slots_of(self, writer: str) -> list[int]:
        return [slot for who, slot in self.open if who == writer]

    def published_by(self, writer: str, generation: int) -> Ring:
        """This ring in a record of ``generation`` that ``writer`` publishes."""
        others = tuple((who, g) for who, g in self.committed if who != writer)
        committed = (*others, (writer, generation))[-LAST_COMMITS:]
        return dataclasses.replace(self, committed=committed)

    def names_commit(self, writer: str, generation: int) -> bool:
        """Whether ``writer``'s record of ``generation`` was published (this ring's record
        is it, or one published on top of it)."""
        return (writer, generation) in self.committed

    def taken_since(self, before: Ring) -> set[int] | None:
        """Slots taken since ``before`` (``None``: more than the record names)."""
        count = self.takes - before.takes
        if count > len(self.recent) or self.legacy or before.legacy:
            return None
        return set(self.recent[len(self.recent) - count :]) if count else set()

    def to_json(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "open": [[who, slot] for who, slot in self.open],
            "takes": self.takes,
            "recent": list(self.recent),
            **({"retired": list(self.retired)} if self.retired else {}),
            **({"fresh_from": self.fresh_from} if self.fresh_from else {}),
            **({"committed": [list(c) for c in self.committed]} if self.committed else {}),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectEra:
    """What readers of a store whose objects are created once need to keep their caches
    (:attr:`Commit.object_era`): a random ``token``, drawn anew by a single writer's first
    record (the writer before may have created objects after its last one), by a shared
    writer that finds a record without one, when an array was created again at a path, and
    when ``slots`` would grow past :data:`ERA_SLOTS`; and ``slots``, every slot whose
    objects were created since the token was drawn, in order, repeats kept (shared writers
    each add theirs by compare-and-swap of the record). A reader that read a record of the
    same token invalidates the cached objects of the slots added since; any other change
    revalidates every cached object."""

    token: str
    slots: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"token": self.token, "slots": list(self.slots)}


ERA_SLOTS = 1024
"""The most slots an :class:`ObjectEra` lists (the record stays small; readers then
revalidate their caches once, at the next token)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseFloor:
    """Where the writer of a store held by a lease (S3) may write: slots below ``floor``
    are never written again (a writer that held the store before may still write them
    late, see ``WriterHold.late_writes``).

    ``held``: a writer is writing slots at or past ``floor`` (it publishes this before its
    first write). A writer that closes cleanly publishes ``held=False`` after its last
    write: the next one starts its own slots at the same ``floor``. A writer that crashed
    or stalled leaves ``held=True``: the next one starts past every slot the record names.
    """

    floor: int = 0
    held: bool = True
    avoid: tuple[int, ...] = ()
    """State groups no save writes into: those a writer that held the store before may
    still write late (the group it would have saved into next, were it stalled)."""

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"floor": self.floor, "held": self.held}
        if self.avoid:
            record["avoid"] = list(self.avoid)
        return record


@dataclasses.dataclass(frozen=True, slots=True)
class Commit:
    """The committed state that readers and a reopening writer trust.

    Rows ``[0, length)`` are readable except those in ``holes`` (half-open
    ranges): rows whose previous content was withdrawn because they are being
    rewritten. ``generation`` grows by one with every published commit.
    """

    generation: int = 0
    length: int = 0
    cursor: int = 0
    holes: tuple[tuple[int, int], ...] = ()
    ring: Ring | None = None
    """The blocks of a store written by several writers (``None``: one writer)."""
    epoch: int = 0
    """Grows whenever rows that an earlier commit declared readable are written over (the
    ring wrapping, rows rewritten, the buffer emptied): the rows a save covered are the
    ones it saved for as long as the epoch it recorded stays (one writer)."""
    slots: SlotMap | None = None
    """Which slot of the data arrays holds each block of positions (``None``: block ``b``
    in slot ``b``, as in every store never written over)."""
    runs: RunMap | None = None
    """A shared store's map of positions to rows of the data arrays (format 3)."""
    history: RunMap | None = None
    """An archive's rows, every one an extend committed, in commit order: history index
    to row of the data arrays (``None``: the store keeps no archive)."""
    lease: LeaseFloor | None = None
    """The slots the writer on a lease owns (``None``: not recorded, as held at the
    capacity)."""
    object_era: ObjectEra | None = None
    """Set when the store's data objects are created once and never written over (its
    writers on S3, see ``docs/design/ring.md``, step 5): which slots had objects created
    since a reader's cache may last have been made whole. ``None``: objects may be written
    over; a cache revalidates them at every new commit."""

    def physical(self, rows: np.ndarray) -> np.ndarray:
        """The rows of the data arrays that hold positions ``rows`` in this commit."""
        if self.runs is not None:
            return self.runs.physical(rows)
        return rows if self.slots is None else self.slots.physical(rows)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "generation": self.generation,
            "length": self.length,
            "cursor": self.cursor,
            "holes": [list(h) for h in self.holes],
        }
        if self.epoch:
            record["epoch"] = self.epoch
        if self.ring is not None:
            record["ring"] = self.ring.to_json()
        if self.slots is not None:
            record["slots"] = self.slots.to_json()
        if self.runs is not None:
            record["runs"] = self.runs.to_json()
        if self.history is not None:
            record["history"] = self.history.to_json()
        if self.lease is not None:
            record["lease"] = self.lease.to_json()
        if self.object_era is not None:
            record["object_era"] = self.object_era.to_json()
        return record

    def slots_created_since(self, earlier: Commit) -> tuple[int, ...] | None:
        """The slots whose objects were created (anew) since the ``earlier`` commit: every
        other object it named holds what it held then, as long as it exists. ``None``:
        not known (objects may have been written over; revalidate every one)."""
        now, before = self.object_era, earlier.object_era
        if now is None or before is None or now.token != before.token:
            return None
        return now.slots[len(before.slots) :]

    def reads_alike(self, later: Commit, rows: np.ndarray, block_rows: int) -> bool:
        """Whether positions ``rows``, read through this commit of a shared store, read
        as the ``later`` commit has them: each in the same row of the arrays, none in a
        slot taken meanwhile (and written again since)."""
        if self.ring is None or later.ring is None or self.length > later.length:
            return False
        taken = later.ring.taken_since(self.ring)
        if taken is None:
            return False
        unique = np.unique(rows)
        physical = self.physical(unique)
        if not np.array_equal(physical, later.physical(unique)):
            return False
        if not taken:
            return True
        slots = np.unique(physical[physical >= 0] // block_rows)
        return not np.isin(slots, np.fromiter(taken, dtype=np.int64)).any()

    def serves_alike(self, other: Commit, rows: int) -> bool:
        """Whether positions ``[0, rows)`` are readable alike in both commits and read the
        same rows of the arrays (rows a record keeps are never written again)."""
        positions = np.arange(rows)
        return np.array_equal(
            self.readable(positions), other.readable(positions)
        ) and np.array_equal(self.physical(positions), other.physical(positions))

    def readable(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` is readable in this commit (no mask over every row)."""
        out: np.ndarray = rows < self.length
        for start, stop in self.holes:
            out &= (rows < start) | (rows >= stop)
        return out

    def readable_mask(self, rows: int) -> np.ndarray:
        """Boolean mask over ``rows`` rows: which rows this commit declares readable."""
        mask = np.zeros(rows, dtype=bool)
        mask[: self.length] = True
        for start, stop in self.holes:
            mask[start:stop] = False
        return mask


@dataclasses.dataclass(frozen=True, slots=True)
class Saved:
    """A :func:`zarr_rb.save`: where its buffer state lives and the rows it covered.

    Each save writes its buffer state (sampler, writer, transforms, generator) into a
    group of its own, ``state/<slot>``, written once (``slot`` counts the saves of the
    store; stores saved before format 3 alternated between ``state/0`` and ``state/1``).
    Publishing the record that names it is what makes a save take effect, so a crash
    mid-save leaves the previous save intact.

    A save of format 3 (``pinned``) also keeps the rows it covered: the slot map and the
    holes of the commit it was made at. Nothing written since changes them, for as long as
    a record names the save (the store's last save, or a kept version).
    """

    slot: int
    length: int
    cursor: int
    epoch: int = 0
    """The commit epoch the save was made at (see :attr:`Commit.epoch`)."""
    pinned: bool = False
    slots: SlotMap | None = None
    """The slot map of the rows it covered (``None``: block ``b`` in slot ``b``)."""
    holes: tuple[tuple[int, int], ...] = ()
    time: float = 0.0
    runs: RunMap | None = None
    """The runs of the rows it covered, in a store of several writers."""
    """When it was saved (seconds since the epoch)."""

    @property
    def group(self) -> str:
        return f"{STATE_GROUP}/{self.slot}"

    def commit(self, elements_per_row: int = 1) -> Commit:
        """The rows the save covered, as a commit declares them (``length`` counts
        elements: ``elements_per_row`` of them per row of a store of ``ndim > 1``)."""
        return Commit(
            length=-(-self.length // elements_per_row),
            cursor=self.cursor,
            holes=self.holes,
            epoch=self.epoch,
            slots=self.slots,
            runs=self.runs,
        )

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"slot": self.slot, "length": self.length, "cursor": self.cursor}
        if self.epoch:
            record["epoch"] = self.epoch
        if self.pinned:
            record["pinned"] = True
            record["holes"] = [list(hole) for hole in self.holes]
            record["time"] = self.time
            if self.slots is not None:
                record["slots"] = self.slots.to_json()
            if self.runs is not None:
                record["runs"] = self.runs.to_json()
        return record


@dataclasses.dataclass(frozen=True, slots=True)
class StoreMeta:
    """Everything kept in ``attributes["zarr_rb"]`` of the root group."""

    max_size: int
    ndim: int
    schema: Schema | None
    commit: Commit
    block_rows: int | None = None
    """Rows per write block (the shard height of large leaves); set with the schema."""
    saved: Saved | None = None
    format: int = FORMAT_VERSION
    compression: Mapping[str, Any] | None = None
    """The ``Compression`` settings the store was created with (``None`` in stores written
    before they were recorded)."""
    versions: Mapping[str, Saved] = dataclasses.field(default_factory=dict)
    """Saves kept by name (``zarr_rb.save(rb, tag=...)``), besides the last one."""

    def run_maps(self) -> list[RunMap]:
        """Every run map of the record (those kept in pieces name objects of their own)."""
        commit = self.commit
        saves = [self.saved, *self.versions.values()]
        maps = [commit.runs, commit.history, *(saved.runs for saved in saves if saved)]
        return [runs for runs in maps if runs is not None]

    def save_slots(self) -> set[int]:
        """The state groups the record's saves are in: the last one and the tagged ones."""
        saves = [self.saved, *self.versions.values()]
        return {saved.slot for saved in saves if saved is not None}

    def pinned(self) -> list[Saved]:
        """The saves whose rows the store keeps: the last one and the tagged ones."""
        saves = [self.saved, *self.versions.values()]
        return [saved for saved in saves if saved is not None and saved.pinned]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "max_size": self.max_size,
            "ndim": self.ndim,
            "block_rows": self.block_rows,
            "schema": None if self.schema is None else self.schema.to_json(),
            "commit": self.commit.to_json(),
            "saved": None if self.saved is None else self.saved.to_json(),
            "compression": None if self.compression is None else dict(self.compression),
            "versions": {tag: saved.to_json() for tag, saved in self.versions.items()},
        }


def mask_to_ranges(mask: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Half-open ranges of the ``True`` runs of a boolean mask (vectorised)."""
    padded = np.concatenate(([False], mask.astype(bool), [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return tuple((int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True))


def commit_from_mask(
    readable: np.ndarray,
    *,
    generation: int,
    cursor: int,
    length: int | None = None,
) -> Commit:
    """The commit record that declares exactly the ``True`` rows of ``readable``.

    ``length`` defaults to one past the last readable row; pass the current length to
    withdraw rows at the end as holes rather than shrinking the buffer.
    """
    true_rows = np.flatnonzero(readable)
    last = int(true_rows[-1]) + 1 if true_rows.size else 0
    length = last if length is None else max(length, last)
    if length > readable.size:  # rows past the mask: none of them readable
        readable = np.concatenate((readable, np.zeros(length - readable.size, dtype=bool)))
    holes = mask_to_ranges(~readable[:length])
    return Commit(generation=generation, length=length, cursor=cursor, holes=holes)


# --- parsing (untrusted JSON -> typed records) -------------------------------------------


def _expect(cond: bool, what: str, got: object) -> None:
    if not cond:
        raise StoreCorruptedError(f"invalid zarr_rb metadata: expected {what}, got {got!r}")


def _parse_int(value: object, what: str, *, lo: int = 0, hi: int = 2**62) -> int:
    _expect(
        isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi,
        f"{what} to be an integer in [{lo}, {hi}]",
        value,
    )
    assert isinstance(value, int)
    return value


def _parse_int_list(
    value: object, what: str, *, lo: int = 0, max_len: int = _MAX_DIMS
) -> tuple[int, ...]:
    _expect(isinstance(value, list) and len(value) <= max_len, f"{what} to be a list", value)
    assert isinstance(value, list)
    return tuple(_parse_int(v, f"{what} entries", lo=lo) for v in value)


def parse_commit(value: object, *, rows: int, pieces: PieceSource | None = None) -> Commit:
    _expect(isinstance(value, Mapping), "'commit' to be an object", value)
    assert isinstance(value, Mapping)
    length = _parse_int(value.get("length"), "commit length", hi=rows)
    holes_raw = value.get("holes", [])
    _expect(isinstance(holes_raw, list) and len(holes_raw) <= rows, "commit holes list", holes_raw)
    assert isinstance(holes_raw, list)
    holes = []
    for hole in holes_raw:
        bounds = _parse_int_list(hole, "commit hole", max_len=2)
        _expect(
            len(bounds) == 2 and 0 <= bounds[0] < bounds[1] <= length,
            f"a hole [start, stop) inside [0, {length})",
            hole,
        )
        holes.append((bounds[0], bounds[1]))
    return Commit(
        generation=_parse_int(value.get("generation"), "commit generation"),
        length=length,
        cursor=_parse_int(value.get("cursor", 0), "commit cursor", hi=max(rows - 1, 0)),
        holes=tuple(holes),
        ring=parse_ring(value.get("ring"), rows=rows),
        epoch=_parse_int(value.get("epoch", 0), "commit epoch"),
        slots=parse_slot_map(value.get("slots"), rows=rows),
        runs=parse_map(value.get("runs"), rows=rows, pieces=pieces),
        history=parse_history(value.get("history"), pieces=pieces),
        lease=parse_lease(value.get("lease"), rows=rows),
        object_era=_parse_object_era(value, rows=rows),
    )


_OBJECT_ERA_TOKEN = re.compile(r"[0-9a-f]{16,64}")


def _parse_object_era(value: Mapping[str, Any], *, rows: int) -> ObjectEra | None:
    """``Commit.object_era`` of a record."""
    era = value.get("object_era")
    if era is None:
        return None
    _expect(isinstance(era, Mapping), "object_era to be an object", era)
    assert isinstance(era, Mapping)
    token = era.get("token")
    _expect(
        isinstance(token, str) and _OBJECT_ERA_TOKEN.fullmatch(token) is not None,
        "object_era token to be hex digits",
        token,
    )
    assert isinstance(token, str)
    slots = _parse_int_list(era.get("slots", []), "object_era slots", max_len=ERA_SLOTS)
    _expect(
        all(slot < max_ring_capacity(rows) for slot in slots), "object_era slots in range", slots
    )
    return ObjectEra(token=token, slots=slots)


def parse_lease(value: object, *, rows: int) -> LeaseFloor | None:
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'lease' to be an object or null", value)
    assert isinstance(value, Mapping)
    held = value.get("held")
    _expect(isinstance(held, bool), "lease held to be true or false", held)
    floor = _parse_int(value.get("floor"), "lease floor", hi=max_ring_capacity(rows))
    avoid = _parse_int_list(value.get("avoid", []), "lease avoid", max_len=_MAX_AVOIDED)
    return LeaseFloor(floor=floor, held=bool(held), avoid=avoid)


_MAX_AVOIDED = 100_000
"""State groups a record may keep saves out of (one per writer that took the store over
from one that did not close cleanly)."""


HISTORY_BOUND = 2**48
"""More rows than any archive's history holds (a bound for parsing records)."""


def parse_history(value: object, *, pieces: PieceSource | None = None) -> RunMap | None:
    """An archive's history from the commit record (untrusted): runs from index 0 on, with
    no gap."""
    history = parse_map(value, rows=HISTORY_BOUND, pieces=pieces)
    if history is not None and history.holes(history.end):
        raise invalid_metadata("a history whose runs follow each other from index 0", value)
    return history


_WRITER_ID = re.compile(r"[0-9a-f]{8,64}")


def max_ring_capacity(rows: int) -> int:
    """The most slots a shared store's record may name for ``rows`` positions (a larger
    one is damaged): as many as a record of one writer may (``ring.max_slots``: a store
    that becomes shared keeps its slots), or more."""
    return 64 * rows + 2**24


def parse_ring(value: object, *, rows: int) -> Ring | None:
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'ring' to be an object or null", value)
    assert isinstance(value, Mapping)
    if "open" not in value:
        return Ring(legacy=True)  # format 2: blocks held in ring order, converted on join
    capacity = _parse_int(value.get("capacity"), "ring capacity", hi=max_ring_capacity(rows))
    open_raw = value.get("open")
    # (Each slot open once: a writer's own, and those a collection holds.)
    opened = _parse_writer_pairs(
        open_raw,
        "ring open list",
        "an open slot [writer id, slot]",
        "open slot",
        max_len=capacity,
        hi=max(capacity - 1, 0),
    )
    _expect(len({slot for _, slot in opened}) == len(opened), "each slot open once", open_raw)
    recent = _parse_int_list(value.get("recent", []), "ring recent", max_len=RECENT_TAKES)
    retired = _parse_int_list(value.get("retired", []), "ring retired", max_len=capacity)
    _expect(all(slot < capacity for slot in retired), "retired slots inside the capacity", retired)
    committed = _parse_writer_pairs(
        value.get("committed", []),
        "ring committed list",
        "a last commit [writer id, generation]",
        "last commit generation",
        max_len=LAST_COMMITS,
    )
    return Ring(
        capacity=capacity,
        open=tuple(opened),
        takes=_parse_int(value.get("takes", 0), "ring takes"),
        recent=tuple(recent),
        retired=retired,
        fresh_from=_parse_int(value.get("fresh_from", 0), "ring fresh_from", hi=capacity),
        committed=tuple(committed),
    )


def _parse_writer_pairs(
    raw: object, listed: str, each: str, number: str, *, max_len: int, hi: int = 2**62
) -> list[tuple[str, int]]:
    """A record's list of ``[writer id, integer]`` pairs (at most ``max_len``; integers up to
    ``hi``); ``listed``, ``each`` and ``number`` name the list, a pair and its integer in
    messages."""
    _expect(isinstance(raw, list) and len(raw) <= max_len, listed, raw)
    assert isinstance(raw, list)
    pairs = []
    for entry in raw:
        _expect(
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and _WRITER_ID.fullmatch(entry[0]) is not None,
            each,
            entry,
        )
        pairs.append((entry[0], _parse_int(entry[1], number, hi=hi)))
    return pairs


def parse_saved(
    value: object, *, max_size: int, rows: int, pieces: PieceSource | None = None
) -> Saved | None:
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'saved' to be an object or null", value)
    assert isinstance(value, Mapping)
    pinned = value.get("pinned", False)
    _expect(isinstance(pinned, bool), "'pinned' to be a boolean", pinned)
    length = _parse_int(value.get("length"), "saved length", hi=max_size)
    holes = []
    holes_raw = value.get("holes", [])
    _expect(isinstance(holes_raw, list) and len(holes_raw) <= rows, "saved holes", holes_raw)
    assert isinstance(holes_raw, list)
    for hole in holes_raw:
        bounds = _parse_int_list(hole, "saved hole", max_len=2)
        _expect(len(bounds) == 2 and 0 <= bounds[0] < bounds[1] <= rows, "a hole", hole)
        holes.append((bounds[0], bounds[1]))
    time = value.get("time", 0.0)
    _expect(isinstance(time, (int, float)) and not isinstance(time, bool), "a time", time)
    assert isinstance(time, (int, float))
    return Saved(
        slot=_parse_int(value.get("slot"), "saved slot"),
        length=length,
        cursor=_parse_int(value.get("cursor"), "saved cursor", hi=max_size),
        epoch=_parse_int(value.get("epoch", 0), "saved epoch"),
        pinned=pinned,
        slots=parse_slot_map(value.get("slots"), rows=rows),
        holes=tuple(holes),
        time=float(time),
        runs=parse_map(value.get("runs"), rows=rows, pieces=pieces),
    )


TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""What a version's tag may be: a name that reads well in a message and a file name."""


def parse_versions(
    value: object, *, max_size: int, rows: int, pieces: PieceSource | None = None
) -> dict[str, Saved]:
    if value is None:
        return {}
    _expect(isinstance(value, Mapping) and len(value) <= 10_000, "'versions' object", value)
    assert isinstance(value, Mapping)
    out = {}
    for tag, saved in value.items():
        _expect(isinstance(tag, str) and TAG.fullmatch(tag) is not None, "a version tag", tag)
        parsed = parse_saved(saved, max_size=max_size, rows=rows, pieces=pieces)
        _expect(parsed is not None, f"version {tag!r} to be a save", saved)
        assert parsed is not None
        out[tag] = parsed
    return out


_CODECS = ("zstd", "lz4", "none")


def parse_compression(value: object) -> dict[str, Any] | None:
    """The recorded compression settings, checked field by field (``None`` if absent)."""
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'compression' to be an object or null", value)
    assert isinstance(value, Mapping)
    codec = value.get("codec")
    _expect(codec in _CODECS, f"a codec among {_CODECS}", codec)
    block_rows = value.get("block_rows")
    return {
        "codec": codec,
        "level": _parse_int(value.get("level"), "compression level", lo=-(2**17), hi=22),
        "chunk_rows": _parse_int(value.get("chunk_rows"), "chunk_rows", lo=1, hi=2**31),
        "block_rows": None
        if block_rows is None
        else _parse_int(block_rows, "compression block_rows", lo=1, hi=2**31),
        "large_row_bytes": _parse_int(value.get("large_row_bytes"), "large_row_bytes"),
    }


def _parse_leaf(value: object, kind: Kind) -> LeafSpec:
    _expect(isinstance(value, Mapping), "a leaf object", value)
    assert isinstance(value, Mapping)
    key_raw = value.get("key")
    _expect(
        isinstance(key_raw, list) and all(isinstance(k, str) for k in key_raw), "a key", key_raw
    )
    assert isinstance(key_raw, list)
    dtype = value.get("dtype")
    _expect(
        isinstance(dtype, str) and dtype in STORED_DTYPES,
        f"a dtype among {sorted(STORED_DTYPES)}",
        dtype,
    )
    assert isinstance(dtype, str)
    shape = _parse_int_list(value.get("shape"), "leaf shape")
    _expect(math.prod(shape) <= 2**40, "a leaf shape of bounded size", shape)
    held = value.get("value", "tensor")
    _expect(held in VALUES, f"a leaf value among {VALUES}", held)
    assert held in VALUES
    expected_dtype = "int64" if held == "lengths" else SCALAR_DTYPES.get(held, dtype)
    _expect(dtype == expected_dtype, f"dtype {expected_dtype} for {held} leaves", dtype)
    _expect(held in ("tensor", "ragged") or not shape, "no element shape for values", shape)
    try:
        if held == "lengths":
            _expect(bool(key_raw) and key_raw[0] == "", "a lengths key starting with ''", key_raw)
            key = ("", *parse_key(key_raw[1:], kind=kind))
        else:
            key = parse_key(key_raw, kind=kind)
    except UnsupportedDataError as err:
        raise StoreCorruptedError(f"invalid zarr_rb metadata: {err}") from None
    return LeafSpec(key=key, dtype=dtype, shape=shape, value=held)


def parse_schema(value: object, *, ndim: int) -> Schema | None:
    if value is None:
        return None
    _expect(isinstance(value, Mapping), "'schema' to be an object or null", value)
    assert isinstance(value, Mapping)
    kind = value.get("kind")
    _expect(kind in KINDS, f"a kind among {KINDS}", kind)
    assert kind in KINDS
    batch_shape = _parse_int_list(value.get("batch_shape"), "batch_shape", lo=1)
    _expect(len(batch_shape) == ndim, f"batch_shape of length ndim={ndim}", batch_shape)
    leaves_raw = value.get("leaves")
    _expect(
        isinstance(leaves_raw, list) and 0 < len(leaves_raw) <= _MAX_LEAVES,
        "a non-empty list of leaves",
        leaves_raw,
    )
    assert isinstance(leaves_raw, list)
    leaves = tuple(_parse_leaf(leaf, kind) for leaf in leaves_raw)
    keys = [leaf.key for leaf in leaves]
    _expect(len(set(keys)) == len(keys), "unique leaf keys", keys)
    _expect(kind != "tensor" or len(leaves) == 1, "exactly one leaf for a tensor", keys)
    tensorclass = value.get("tensorclass")
    _expect(tensorclass is None or isinstance(tensorclass, str), "a tensorclass name", tensorclass)
    assert tensorclass is None or isinstance(tensorclass, str)
    treespec = value.get("treespec")
    _expect(
        (treespec is None) == (kind != "pytree")
        and (
            treespec is None or (isinstance(treespec, str) and len(treespec) <= _MAX_TREESPEC_CHARS)
        ),
        "a treespec string for pytree data (and only for it)",
        str(treespec)[:80],
    )
    assert treespec is None or isinstance(treespec, str)
    item_batch_shape = _parse_int_list(value.get("item_batch_shape", []), "item_batch_shape")
    for leaf in leaves:
        _expect(
            leaf.value == "tensor" or not item_batch_shape,
            "no item batch dimensions beside values or ragged leaves",
            item_batch_shape,
        )
        _expect(
            leaf.value != "tensor" or leaf.shape[: len(item_batch_shape)] == item_batch_shape,
            f"leaf {leaf.key!r} shape to start with item_batch_shape {item_batch_shape}",
            leaf.shape,
        )
    ragged = sorted(leaf.key for leaf in leaves if leaf.ragged)
    lengths = sorted(leaf.key[1:] for leaf in leaves if leaf.value == "lengths")
    _expect(ragged == lengths, "one lengths leaf for each ragged leaf", lengths)
    _expect(not ragged or len(batch_shape) == 1, "ragged leaves in a 1-D storage only", ragged)
    return Schema(
        kind=kind,
        batch_shape=batch_shape,
        leaves=leaves,
        tensorclass=tensorclass,
        item_batch_shape=item_batch_shape,
        treespec=treespec,
    )


RECORD_RETRIES = 20
"""Times a record whose pieces were replaced while it was read is read again."""


def parse_current_record(
    document: Mapping[str, Any],
    read_again: Callable[[], Mapping[str, Any] | None],
    *,
    where: str,
    pieces: PieceSource,
) -> StoreMeta:
    """The store record ``document`` (a root ``zarr.json`` known to be a store's), its run
    maps read from the pieces it names.

    A piece that is gone means the record moved on since it was read (the writer that
    replaced it deleted the pieces it no longer names): the record is read again
    (``read_again()``, which checks it is still a store's) and parsed anew.

    Raises:
        MapPieceMissingError: a piece the record as it is now names is missing (damage),
            or the record kept moving on over ``RECORD_RETRIES`` reads.
    """
    for _ in range(RECORD_RETRIES):
        try:
            return parse_store_meta(document["attributes"], where=where, pieces=pieces)
        except MapPieceMissingError:
            again = read_again()
            if again is None or again == document:
                raise  # not a record that moved on: a piece it names is gone
            document = again
    return parse_store_meta(document["attributes"], where=where, pieces=pieces)


def parse_store_meta(
    attributes: Mapping[str, Any], *, where: str, pieces: PieceSource | None = None
) -> StoreMeta:
    """Validate the root attributes of a store and return them as a :class:`StoreMeta`.

    ``pieces``: where the run maps that the record keeps in pieces are read from (the
    store's location); without it, a record that keeps one raises.

    Raises:
        NotAStoreError: handled by the caller; this function assumes the key exists.
        FormatVersionError: the store was written by a newer major format.
        StoreCorruptedError: any field is missing, of the wrong type or out of range.
    """
    value = attributes.get(ATTRS_KEY)
    try:
        _expect(isinstance(value, Mapping), f"attributes[{ATTRS_KEY!r}] to be an object", value)
        assert isinstance(value, Mapping)
        fmt = _parse_int(value.get("format"), "format version")
        if fmt > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where} was written in zarr_rb store format {fmt}; this zarr_rb reads "
                f"format {FORMAT_VERSION} and older. Upgrade zarr_rb to open it.",
            )
        _expect(fmt >= 1, "format version >= 1", fmt)
        max_size = _parse_int(value.get("max_size"), "max_size", lo=1)
        ndim = _parse_int(value.get("ndim"), "ndim", lo=1, hi=_MAX_DIMS)
        schema = parse_schema(value.get("schema"), ndim=ndim)
        if schema is not None:
            per_row = math.prod(schema.batch_shape[1:])
            _expect(
                schema.rows == -(-max_size // per_row),
                f"batch_shape {list(schema.batch_shape)} to hold max_size={max_size}",
                list(schema.batch_shape),
            )
        rows = schema.rows if schema is not None else max_size
        block_rows = value.get("block_rows")
        if block_rows is not None:
            block_rows = _parse_int(block_rows, "block_rows", lo=1)
        _expect(
            (schema is None) == (block_rows is None), "block_rows set with the schema", block_rows
        )
        commit = parse_commit(value.get("commit"), rows=rows, pieces=pieces)
        if commit.slots is not None:
            _expect(
                fmt >= 3 and commit.slots.block_rows == block_rows,
                f"a slot map (format 3) of blocks of {block_rows} rows",
                commit.slots.to_json(),
            )
        if commit.runs is not None:
            ring = commit.ring
            _expect(
                fmt >= 3 and ring is not None and commit.slots is None,
                "runs (format 3) in the record of a shared store",
                value.get("commit"),
            )
            assert ring is not None
            bound = ring.capacity * (block_rows or 1)
            _expect(
                not len(commit.runs)
                or int((commit.runs.firsts + commit.runs.counts).max()) <= bound,
                f"runs inside the {ring.capacity} slots of the arrays",
                commit.runs.to_json(),
            )
        if commit.history is not None:
            history = commit.history
            # Every row of the history is a row of the arrays, each once: within the slots
            # the record gives them (the arrays have at least those).
            slots = (
                commit.ring.capacity
                if commit.ring is not None and commit.ring.capacity
                else commit.slots.capacity
                if commit.slots is not None
                else -(-rows // (block_rows or 1))
            )
            bound = max(rows, slots * (block_rows or 1))
            _expect(
                history.end <= bound
                and (not len(history) or int((history.firsts + history.counts).max()) <= bound),
                f"a history of rows inside the {bound} rows of the arrays",
                history.to_json(),
            )
        saved = parse_saved(value.get("saved"), max_size=max_size, rows=rows, pieces=pieces)
        versions = parse_versions(
            value.get("versions"), max_size=max_size, rows=rows, pieces=pieces
        )
        compression = parse_compression(value.get("compression"))
    except MapPieceMissingError as err:
        raise MapPieceMissingError(f"{where}: {err}", key=err.key) from None
    except StoreCorruptedError as err:
        raise StoreCorruptedError(f"{where}: {err}") from None
    return StoreMeta(
        max_size=max_size,
        ndim=ndim,
        schema=schema,
        commit=commit,
        block_rows=block_rows,
        saved=saved,
        versions=versions,
        format=fmt,
        compression=compression,
    )


def preview_rows(rows: np.ndarray, limit: int = 8) -> str:
    """A short listing of row numbers for error messages: ``[3, 9, ...] (12 rows)``."""
    shown = ", ".join(str(int(r)) for r in rows[:limit])
    return f"[{shown}{', ...' if rows.size > limit else ''}] ({rows.size} rows)"


def describe_runs(runs: Sequence[tuple[int, int, str]] | Sequence[tuple[int, int]]) -> str:
    """``rows 6-7, 12-13`` for error messages (half-open ranges, shown inclusive)."""
    shown = ", ".join(f"{r[0]}-{r[1] - 1}" if r[1] - r[0] > 1 else f"{r[0]}" for r in runs[:8])
    more = f" and {len(runs) - 8} more ranges" if len(runs) > 8 else ""
    return f"rows {shown}{more}"


def leaves_by_key(leaves: Iterable[LeafSpec]) -> dict[tuple[str, ...], LeafSpec]:
    return {leaf.key: leaf for leaf in leaves}
