"""Buffer state (sampler, writer, generator, transforms) to and from a store's state slots."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zarr_rb._engine import LocalLocation
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
        raise FileNotFoundError(f"no buffer state in group {group!r} of {location.root}")
    root = StateNode(location, group, attrs)
    components = {}
    for role in ("sampler", "writer"):
        node = root.child(role)
        adapter = adapter_named(node.attrs["class"], role=role)
        components[role] = (adapter, node, adapter.build(node.attrs["config"]))
    transform = load_transforms(
        root.child("transforms"), transform=transform, allow_pickle=allow_pickle
    )
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
