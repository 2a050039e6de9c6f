"""What ``zarr-rb info`` says about a store: its rows, keys (with their chunking and how
well each compresses), holes, episodes, saved buffer state and who writes it now. All of
it read from the root record, JSON documents, object listings and small leaves: never from
a row of images.

A local store is read as files (:class:`~zarr_rb.analysis._files.LocalFiles`: neither
TensorStore nor torch is imported); any other through a :class:`View`
(:class:`ViewSource`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from zarr_rb.analysis._keys import dotted, public_key
from zarr_rb.analysis.episodes import Episodes, find_episodes, find_keys
from zarr_rb.errors import NoEpisodeFlagsError, StoreCorruptedError
from zarr_rb.format.commit import Commit, mask_to_ranges
from zarr_rb.format.names import FORMAT_VERSION, STATE_GROUP, array_path, frame_ids_path
from zarr_rb.format.record import StoreMeta
from zarr_rb.util.io import load_json
from zarr_rb.util.keys import Key

if TYPE_CHECKING:
    from zarr_rb.analysis.view import View

_KINDS = {"tensor": "tensor", "ragged": "ragged"}


class Source(Protocol):
    """Where a report reads a store from."""

    url: str
    meta: StoreMeta

    def read(self, key: str) -> bytes | None:
        """The object at ``key`` (``None`` if there is none)."""

    def sizes(self, prefix: str) -> Mapping[str, int]:
        """Bytes of each object under ``prefix``."""

    def holders(self) -> list[dict[str, Any]]:
        """The writers holding the store now."""

    def column(self, key: Key) -> np.ndarray:
        """The committed rows of a small leaf, holes as zeros."""


class ViewSource:
    """A store opened as a :class:`View` (any location; imports torch)."""

    def __init__(self, view: View) -> None:
        store = view.storage.store
        self._view = view
        self._location = store.engine.location
        self.url = view.url
        self.meta = dataclasses.replace(store.meta, commit=store.committed)

    def read(self, key: str) -> bytes | None:
        value: bytes | None = self._location.read(key)
        return value

    def sizes(self, prefix: str) -> Mapping[str, int]:
        sizes: Mapping[str, int] = self._location.list(prefix)
        return sizes

    def holders(self) -> list[dict[str, Any]]:
        holders: list[dict[str, Any]] = self._location.holders()
        return holders

    def column(self, key: Key) -> np.ndarray:
        return self._view.numpy(public_key(key))


@dataclasses.dataclass(frozen=True, slots=True)
class KeyReport:
    key: str
    dtype: str
    """The element dtype, or for Python values their type (``str``, ``int``, ...)."""
    shape: str
    """The element shape, ``*`` along the dimension whose length varies from row to row."""
    kind: str
    shard_rows: int | None
    """Rows per stored object (``None``: an object is a chunk)."""
    chunk_rows: int | None
    """Rows per compressed chunk (``None``: unreadable metadata)."""
    codec: str
    stored_bytes: int
    raw_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else math.inf


@dataclasses.dataclass(frozen=True, slots=True)
class StoreReport:
    url: str
    format_version: int
    shape: list[int]
    capacity: int
    cursor: int
    generation: int
    holes: list[tuple[int, int]]
    codec: str
    keys: list[KeyReport]
    episodes: str
    saved: str
    writers: list[dict[str, Any]]
    objects: str | None = None
    """How the data objects of a store on S3 are written (``None``: a local store)."""


def describe(
    source: Source, *, episode_key: Key | None = None, reward_key: Key | None = None
) -> StoreReport:
    """The report of the store ``source`` reads (episodes marked by ``episode_key``, their
    returns summed from ``reward_key``; ``None``: found as :func:`zarr_rb.open` does)."""
    meta = source.meta
    schema = meta.schema
    commit = meta.commit
    rows = commit.length if schema is not None else 0
    per_row = 1 if schema is None else schema.elements_per_row
    valid = commit.readable_mask(rows)
    compression = meta.compression or {}
    codec = compression.get("codec", "zstd")
    codec = codec if codec == "none" else f"{codec} {compression.get('level', 1)}"
    keys = []
    twins = {} if schema is None else {k: f.key for f in schema.frames for k in f.keys}
    for leaf in () if schema is None else schema.leaves:
        if leaf.value == "lengths":
            continue
        paths = [leaf.path, *([leaf.lengths_leaf().path] if leaf.ragged else [])]
        data_path = leaf.path
        if leaf.key in twins:
            # Stored as frames: the cells of the pair (counted with its first key) and its
            # frame ids.
            data_path = array_path(twins[leaf.key])
            cells = [data_path] if twins[leaf.key] == leaf.key else []
            paths = [*cells, frame_ids_path(leaf.key)]
        stored = sum(max(0, n) for path in paths for n in source.sizes(path + "/").values())
        document = _json(source.read(f"{data_path}/zarr.json"))
        shard_rows, chunk_rows = _chunking(document)
        kind = _KINDS.get(leaf.value, "values")
        shape = ("*" if leaf.ragged else None, *leaf.shape)
        keys.append(
            KeyReport(
                key=dotted(leaf.key),
                dtype=leaf.dtype if kind != "values" else leaf.value,
                shape="[" + ", ".join(str(n) for n in shape if n is not None) + "]",
                kind=kind,
                shard_rows=shard_rows,
                chunk_rows=chunk_rows,
                codec=_codec(document),
                stored_bytes=stored,
                raw_bytes=rows * per_row * leaf.element_nbytes if not leaf.ragged else 0,
            )
        )
    episodes = _episodes_line(source, valid, episode_key=episode_key, reward_key=reward_key)
    return StoreReport(
        url=source.url,
        format_version=FORMAT_VERSION,
        shape=[rows, *(() if schema is None else schema.batch_shape[1:])],
        capacity=meta.max_size if schema is None else schema.rows,
        cursor=commit.cursor,
        generation=commit.generation,
        holes=list(mask_to_ranges(~valid)),
        codec=codec,
        keys=keys,
        episodes=episodes,
        saved=_saved_line(source),
        writers=source.holders(),
        objects=_objects_line(source.url, commit),
    )


def _objects_line(url: str, commit: Commit) -> str | None:
    """How the last commit's writer wrote the data objects of a store on S3."""
    if not url.startswith("s3://"):
        return None
    if commit.object_era is not None:
        return (
            "created once, never written over (conditional PUTs): readers keep cached "
            "objects across commits"
        )
    return (
        "written over in place (a writer whose server did not refuse a second create, or "
        "no commit since by a writer that creates them once): readers revalidate cached "
        "objects"
    )


def _json(document: bytes | None) -> dict[str, Any]:
    try:
        value = load_json(document or b"{}")
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _chunking(document: dict[str, Any]) -> tuple[int | None, int | None]:
    """Rows per shard (``None`` without sharding) and per chunk, from an array's
    ``zarr.json``."""
    try:
        rows = int(document["chunk_grid"]["configuration"]["chunk_shape"][0])
        for codec in document.get("codecs", []):
            if codec.get("name") == "sharding_indexed":
                return rows, int(codec["configuration"]["chunk_shape"][0])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None, None
    return None, rows


def _codec(document: dict[str, Any]) -> str:
    """The compressor an array's ``zarr.json`` names (inside its sharding codec, if any):
    a large leaf the codec did not shrink is stored raw (``none``)."""
    try:
        codecs = document.get("codecs", [])
        for codec in codecs:
            if codec.get("name") == "sharding_indexed":
                codecs = codec["configuration"]["codecs"]
        names = [codec.get("name") for codec in codecs]
    except (AttributeError, KeyError, TypeError):
        return "?"
    if not names:
        return "?"
    if "zstd" in names:
        return "zstd"
    return "lz4" if "blosc" in names else "none"


def store_episodes(
    source: Source, *, episode_key: Key | None = None, reward_key: Key | None = None
) -> Episodes:
    """The episodes of the store ``source`` reads, found as :attr:`View.episodes` finds
    them (from small leaves only)."""
    meta = source.meta
    schema = meta.schema
    dtypes = {} if schema is None else {leaf.key: leaf.dtype for leaf in schema.leaves}
    keys = find_keys(dtypes, key=episode_key, reward_key=reward_key)
    rows = 0 if schema is None else meta.commit.length
    return find_episodes(
        source.column,
        keys,
        length=rows,
        capacity=meta.max_size if schema is None else schema.rows,
        cursor=meta.commit.cursor,
        valid=meta.commit.readable_mask(rows),
        envs=schema.batch_shape[1] if schema is not None and meta.ndim == 2 else None,
    )


def _episodes_line(
    source: Source, valid: np.ndarray, *, episode_key: Key | None, reward_key: Key | None
) -> str:
    if not valid.size:
        return "none (no rows)"
    try:
        episodes = store_episodes(source, episode_key=episode_key, reward_key=reward_key)
    except NoEpisodeFlagsError as err:
        return f"not found: {err}"
    complete = int(episodes.complete.sum())
    names = ", ".join(dotted(k) for k in (episodes.keys.traj, *episodes.keys.ends) if k)
    line = f"{len(episodes)} ({complete} complete), from {names}"
    if complete and episodes.keys.reward is not None:
        mean = float(episodes.returns[episodes.complete].mean())
        line += f"; mean return of complete episodes {mean:.3g}"
    return line


def _saved_line(source: Source) -> str:
    saved = source.meta.saved
    if saved is None:
        return "none (zarr_rb.save writes the buffer's sampler, writer and generator state)"
    group = f"{STATE_GROUP}/{saved.slot}"
    document = source.read(f"{group}/zarr.json")
    if document is None:
        return f"unreadable: no group {group!r}"
    try:
        attrs = load_json(document).get("attributes", {})
        state = attrs.get("zarr_rb_state", {})
        buffer = state.get("buffer", {})
        children = state.get("children", {})
    except (ValueError, RecursionError, AttributeError, StoreCorruptedError) as err:
        return f"unreadable: {group}/zarr.json: {err}"
    parts = [f"{buffer.get('class', '?')} of {saved.length} rows (cursor {saved.cursor})"]
    for role in ("sampler", "writer"):
        if isinstance(children.get(role), dict):
            parts.append(f"{role} {children[role].get('class', '?')}")
    transforms = children.get("transforms", {}).get("count", 0)
    if transforms:
        parts.append(f"{transforms} transform(s)")
    return ", ".join(parts)
