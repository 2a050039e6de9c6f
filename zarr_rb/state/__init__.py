"""Buffer state (sampler, writer, generator, transforms) to and from a store's state slots."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zarr_rb._engine import LocalLocation
from zarr_rb.errors import StoreCorruptedError
from zarr_rb.state._buffer import (
    PickleNotAllowedError,
    buffer_config,
    build_buffer,
    load_generator,
    load_transforms,
    save_generator,
    save_transforms,
)
from zarr_rb.state._components import adapter_for, adapter_named
from zarr_rb.state._node import StateNode

__all__ = ["PickleNotAllowedError", "load_buffer", "save_buffer"]


def save_buffer(rb: Any, location: LocalLocation, group: str) -> int:
    """Write everything but the data of ``rb`` into ``group``; returns bytes written.

    Every component is checked before anything is written, so an unsupported sampler or
    writer fails without touching the store.
    """
    config = buffer_config(rb)
    sampler, writer = rb.sampler, rb.writer
    sampler_adapter = adapter_for(sampler, role="sampler")
    writer_adapter = adapter_for(writer, role="writer")
    attrs: dict[str, Any] = {"buffer": config}
    location.create_group(group.rpartition("/")[0])
    root = StateNode(location, group, attrs)
    for role, obj, adapter in (
        ("sampler", sampler, sampler_adapter),
        ("writer", writer, writer_adapter),
    ):
        node = root.child(role)
        node.attrs["class"] = adapter.name
        node.attrs["config"] = adapter.config(obj)
        adapter.save(obj, node)
    save_generator(rb, root.child("generator"))
    save_transforms(rb, root.child("transforms"))
    root.wait()
    location.write_group_attributes(group, {"zarr_rb_state": attrs})
    return root.bytes_written


_MAX_SETTING = 2**24


def _check_sizes(config: Any, *, limit: int, what: str) -> None:
    """Every integer setting (batch sizes, slice lengths, capacities) within ``limit``:
    TorchRL sizes allocations from them, so a damaged or hostile one must not."""
    if isinstance(config, dict):
        for value in config.values():
            _check_sizes(value, limit=limit, what=what)
    elif isinstance(config, list):
        for value in config:
            _check_sizes(value, limit=limit, what=what)
    elif isinstance(config, int) and not 0 <= config <= limit:
        raise ValueError(f"{what} setting {config} is outside [0, {limit}]")


def load_buffer(
    location: LocalLocation,
    group: str,
    *,
    storage: Any,
    restore_storage: Callable[[], None],
    transform: Any = None,
    allow_pickle: bool = False,
) -> Any:
    """Rebuild the buffer saved in ``group`` around ``storage``.

    ``storage`` must look empty while the buffer is built (TorchRL's prioritized buffers
    would otherwise give every stored row a default priority, only for the saved ones to
    replace them); ``restore_storage`` then brings back its length and cursor, before the
    saved component state is loaded.
    """
    attrs = location.read_group_attributes(group).get("zarr_rb_state")
    if not isinstance(attrs, dict):
        raise StoreCorruptedError(
            f"store {str(location.root)!r}: the save record names group {group!r}, which "
            "holds no buffer state; open the data with ZarrStorage(path=...) and save again"
        )
    root = StateNode(location, group, attrs)
    components = {}
    for role in ("sampler", "writer"):
        node = root.child(role)
        adapter = adapter_named(node.attrs["class"], role=role)
        config = node.attrs["config"]
        capacity = config.get("max_capacity", 1)
        if not isinstance(capacity, int) or not 0 < capacity <= storage.max_size:
            raise ValueError(
                f"{role} max_capacity {capacity!r} is not within the storage's "
                f"max_size {storage.max_size}"
            )
        _check_sizes(config, limit=max(storage.max_size, _MAX_SETTING), what=role)
        components[role] = (adapter, node, adapter.build(config))
    transform = load_transforms(
        root.child("transforms"), transform=transform, allow_pickle=allow_pickle
    )
    _check_sizes(attrs["buffer"], limit=max(storage.max_size, _MAX_SETTING), what="buffer")
    if attrs["buffer"]["batch_size"] == 0:
        raise ValueError("buffer batch_size 0")
    rb = build_buffer(
        attrs["buffer"],
        storage=storage,
        sampler=components["sampler"][2],
        writer=components["writer"][2],
        transform=transform,
    )
    restore_storage()
    for role, (adapter, node, _) in components.items():
        adapter.load(getattr(rb, role), node)
    generator = load_generator(root.child("generator"))
    if generator is not None:
        rb.set_rng(generator)
    return rb
