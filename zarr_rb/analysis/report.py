"""What ``zarr-rb info`` says about a store: its rows, keys (with their chunking and how
well each compresses), holes, episodes, saved buffer state and who writes it now. All of
it read from metadata, object listings and small leaves: never from a row of images."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from zarr_rb.analysis._keys import dotted, public_key
from zarr_rb.analysis.view import View
from zarr_rb.core.format import FORMAT_VERSION, STATE_GROUP
from zarr_rb.core.layout import leaf_layout
from zarr_rb.errors import NoEpisodeFlagsError


@dataclasses.dataclass(frozen=True, slots=True)
class KeyReport:
    key: str
    dtype: str
    shape: str
    kind: str
    chunking: str
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


def describe(view: View) -> StoreReport:
    store = view.storage._store
    schema = store.schema
    compression = store.compression
    codec = "none" if compression.codec == "none" else f"{compression.codec} {compression.level}"
    location = store.engine.location
    keys = []
    columns = view.schema
    for leaf in view._leaves():
        assert schema is not None
        layout = leaf_layout(
            leaf,
            batch_shape=schema.batch_shape,
            block_rows=store.meta.block_rows or 1,
            compression=compression,
        )
        if layout.shards is None:
            chunking = f"chunk {layout.chunks[0]}"
        else:
            chunking = f"shard {layout.shards[0]}, chunk {layout.chunks[0]}"
        paths = [leaf.path, *([leaf.lengths_leaf().path] if leaf.ragged else [])]
        stored = sum(max(0, n) for path in paths for n in location.list(path + "/").values())
        column = columns[public_key(leaf.key)]
        keys.append(
            KeyReport(
                key=dotted(leaf.key),
                dtype=str(column.dtype).removeprefix("torch."),
                shape="[" + ", ".join("*" if n is None else str(n) for n in column.shape) + "]",
                kind=column.kind,
                chunking=chunking,
                codec=_codec(location.read(f"{leaf.path}/zarr.json")),
                stored_bytes=stored,
                raw_bytes=len(view) * leaf.element_nbytes if not leaf.ragged else 0,
            )
        )
    return StoreReport(
        url=view.url,
        format_version=FORMAT_VERSION,
        shape=list(view.shape),
        capacity=view.capacity,
        cursor=view.cursor,
        generation=store.committed.generation,
        holes=view.holes,
        codec=codec,
        keys=keys,
        episodes=_episodes_line(view),
        saved=_saved_line(view),
        writers=location.holders(),
    )


def _codec(document: bytes | None) -> str:
    """The compressor an array's ``zarr.json`` names (inside its sharding codec, if any):
    a large leaf the codec did not shrink is stored raw (``none``)."""
    try:
        codecs = json.loads(document or b"{}").get("codecs", [])
        for codec in codecs:
            if codec.get("name") == "sharding_indexed":
                codecs = codec["configuration"]["codecs"]
        names = [codec.get("name") for codec in codecs]
    except (ValueError, AttributeError, KeyError, TypeError):
        return "?"
    if "zstd" in names:
        return "zstd"
    return "lz4" if "blosc" in names else "none"


def _episodes_line(view: View) -> str:
    if not len(view):
        return "none (no rows)"
    try:
        episodes = view._episode_index()
    except NoEpisodeFlagsError as err:
        return f"not found: {err}"
    complete = int(episodes.complete.sum())
    keys = ", ".join(dotted(k) for k in (episodes.keys.traj, *episodes.keys.ends) if k)
    line = f"{len(episodes)} ({complete} complete), from {keys}"
    if complete and episodes.keys.reward is not None:
        mean = float(episodes.returns[episodes.complete].mean())
        line += f"; mean return of complete episodes {mean:.3g}"
    return line


def _saved_line(view: View) -> str:
    store = view.storage._store
    saved = store.meta.saved
    if saved is None:
        return "none (zarr_rb.save writes the buffer's sampler, writer and generator state)"
    try:
        attrs = store.engine.read_group_attributes(f"{STATE_GROUP}/{saved.slot}")
    except (FileNotFoundError, ValueError) as err:
        return f"unreadable: {err}"
    state = attrs.get("zarr_rb_state", {})
    buffer = state.get("buffer", {})
    children = state.get("children", {})
    parts = [f"{buffer.get('class', '?')} of {saved.length} rows (cursor {saved.cursor})"]
    for role in ("sampler", "writer"):
        if isinstance(children.get(role), dict):
            parts.append(f"{role} {children[role].get('class', '?')}")
    transforms = children.get("transforms", {}).get("count", 0)
    if transforms:
        parts.append(f"{transforms} transform(s)")
    return ", ".join(parts)
