"""Buffer state (settings, sampler, writer, generator, transforms) to and from a store's
state slots."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from zarr_rb.engine import Engine
from zarr_rb.errors import UnsupportedDataError
from zarr_rb.format.record import Saved
from zarr_rb.state._arguments import versions
from zarr_rb.state._buffer import (
    buffer_arguments,
    buffer_settings,
    build_buffer,
    load_generator,
    save_generator,
)
from zarr_rb.state._components import adapter_for, adapter_named
from zarr_rb.state._node import StateNode
from zarr_rb.state._objects import (
    PickleNotAllowedError,
    load_code_objects,
    load_transforms,
    save_code_objects,
    save_transforms,
)
from zarr_rb.state._read import LOAD_ATTEMPTS, read_one_save
from zarr_rb.torchrl import compat
from zarr_rb.torchrl.guards import guard_sampler

__all__ = [
    "LOAD_ATTEMPTS",
    "PickleNotAllowedError",
    "check_savable",
    "load_buffer",
    "save_buffer",
]


def _components(rb: Any) -> dict[str, Any]:
    """The stateful components of a buffer, by role: its sampler and writer, and the
    prioritized sampler a ``sync=False`` prioritized buffer keeps beside its sampler."""
    components = {"sampler": rb.sampler, "writer": rb.writer}
    if compat.is_prioritized_buffer(rb) and not compat.get(rb, "_sync"):
        components["prioritized_sampler"] = compat.get(rb, "_prioritized_sampler")
    return components


def check_savable(rb: Any) -> None:
    """Raise :class:`~zarr_rb.errors.UnsupportedDataError` now if ``rb`` could not be saved
    (a buffer class or a component without an adapter, an argument that cannot be read
    back), before anything is written."""
    config, _ = buffer_settings(rb)
    _check_savable_sizes(rb, config, what="buffer")
    for role, obj in _components(rb).items():
        _check_savable_sizes(rb, adapter_for(obj, role=role).config(obj), what=role)


def _check_savable_sizes(rb: Any, config: Any, *, what: str) -> None:
    """The integer settings a load accepts (see :func:`_check_sizes`), checked at the save:
    a save that could not be loaded is refused before anything is written."""
    limit = max(int(getattr(rb.storage, "max_size", 0) or 0), _MAX_SETTING)
    try:
        _check_sizes(config, limit=limit, what=what)
    except ValueError as err:
        raise UnsupportedDataError(
            f"cannot save the buffer: {err} (a load accepts integer settings up to "
            f"{_MAX_SETTING}, or the storage's max_size)",
        ) from None


def save_buffer(rb: Any, engine: Engine, group: str) -> int:
    """Write everything but the data of ``rb`` into ``group``; returns bytes written.

    Every component is checked before anything is written, so an unsupported sampler or
    writer fails without touching the store.
    """
    config, objects = buffer_settings(rb)
    _check_savable_sizes(rb, config, what="buffer")
    components = {}
    for role, obj in _components(rb).items():
        adapter = adapter_for(obj, role=role)
        components[role] = (obj, adapter, adapter.config(obj))
        _check_savable_sizes(rb, components[role][2], what=role)
    # The save's identity: a load compares it before and after reading the slot, which a
    # save two saves later rewrites.
    attrs: dict[str, Any] = {"buffer": config, "versions": versions(), "save": uuid.uuid4().hex}
    engine.create_group(group.rpartition("/")[0])
    root = StateNode(engine, group, attrs)
    for role, (obj, adapter, component_config) in components.items():
        node = root.child(role)
        node.attrs["class"] = adapter.name
        node.attrs["config"] = component_config
        adapter.save(obj, node)
    save_generator(rb, root.child("generator"))
    save_transforms(compat.get(rb, "_transform"), root.child("transforms"))
    save_code_objects(objects, root.child("objects"))
    root.wait()
    engine.write_group_attributes(group, {"zarr_rb_state": attrs})
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
    elif isinstance(config, int) and not -limit <= config <= limit:
        # (negative settings allocate nothing: -1 often means "no limit")
        raise ValueError(f"{what} setting {config} is outside [-{limit}, {limit}]")


def load_buffer(
    engine: Engine,
    saved: Saved,
    *,
    storage: Any,
    restore_storage: Callable[[Saved], None],
    refresh: Callable[[], Saved],
    transform: Any = None,
    code_objects: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> Any:
    """Rebuild the buffer of save ``saved`` (or of a newer one) around ``storage``.

    The saved state is read whole before anything is built from it, and read again if a
    newer save replaced it meanwhile (see :mod:`zarr_rb.state._read`). ``storage`` must
    look empty while the buffer is built (TorchRL's prioritized buffers would otherwise
    give every stored row a default priority, only for the saved ones to replace them);
    ``restore_storage`` then brings back the length and cursor of the save that was read,
    before the saved component state is loaded.

    Args:
        refresh: move the storage to the store's latest commit and return its save record
            (when a newer save replaced ``saved``).
        code_objects: a custom ``collate_fn``, ``sample_unit`` or ``checkpointer`` to use
            instead of unpickling the saved one.

    Raises:
        StateChangedError: newer saves replaced the state each time it was read.
        TorchRLVersionError: the save names a TorchRL class or argument that the installed
            TorchRL does not have.
    """
    saved, root = read_one_save(engine, saved, refresh=refresh)
    attrs = root.attrs
    saved_version = attrs.get("versions", {}).get("torchrl")
    limit = max(storage.max_size, _MAX_SETTING)
    components = {}
    for role in attrs.get("children", {}):
        if role not in ("sampler", "writer", "prioritized_sampler"):
            continue
        node = root.child(role)
        adapter = adapter_named(node.attrs["class"], role=role, saved_version=saved_version)
        config = node.attrs["config"]
        capacity = config.get("max_capacity", 1)
        if not isinstance(capacity, int) or not 0 < capacity <= storage.max_size:
            raise ValueError(
                f"{role} max_capacity {capacity!r} is not within the storage's "
                f"max_size {storage.max_size}"
            )
        _check_sizes(config, limit=limit, what=role)
        components[role] = (adapter, node, adapter.build(config, saved_version=saved_version))
    transform = load_transforms(
        root.child("transforms"), transform=transform, allow_pickle=allow_pickle
    )
    objects = load_code_objects(
        root.child("objects"), given=code_objects or {}, allow_pickle=allow_pickle
    )
    _check_sizes(attrs["buffer"], limit=limit, what="buffer")
    _check_buffer_arguments(buffer_arguments(attrs["buffer"]))
    built = {role: obj for role, (_, _, obj) in components.items()}
    rb = build_buffer(
        attrs["buffer"],
        storage=storage,
        sampler=built["sampler"],
        writer=built["writer"],
        prioritized_sampler=built.get("prioritized_sampler"),
        transform=transform,
        objects=objects,
        saved_version=saved_version,
    )
    restore_storage(saved)
    current = _components(rb)
    for role, (adapter, node, _) in components.items():
        adapter.load(current[role], node)
        if role != "writer":
            guard_sampler(current[role], storage)
    generator = load_generator(root.child("generator"))
    if generator is not None:
        rb.set_rng(generator)
    return rb


def _check_buffer_arguments(arguments: dict[str, Any]) -> None:
    """Refuse saved buffer settings no buffer was built with: a batch size that is not a
    positive integer, a ``pin_memory`` that is not a flag (a damaged record; TorchRL would
    fail at the first sample, or try to pin memory on a GPU).

    Raises:
        ValueError: which setting, and its value.
    """
    batch_size = arguments.get("batch_size")
    if batch_size is not None and (
        not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0
    ):
        raise ValueError(f"buffer batch_size {batch_size!r} (a positive integer, or null)")
    pin_memory = arguments.get("pin_memory", False)
    if not isinstance(pin_memory, bool):
        raise ValueError(f"buffer pin_memory {pin_memory!r} (true or false)")
