"""Reading one save's buffer state, whole, from a store whose writer may be saving again.

Saves alternate between two state slots, and a save is published by the root record naming
its slot, so a slot is rewritten two saves after the one that wrote it. A load that reads
slowly (an object store, a network filesystem, a busy host) could otherwise take a sum tree
from one save and a min tree from the next but one. So a load reads everything first, then
re-reads the root record: if it still names the same save (the same record, and the same
save identity in the slot, which tells apart two saves of equal length and cursor), what
was read is one save; otherwise it reads the newer save, a bounded number of times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zarr_rb.core.metadata import check_is_store, parse_record, read_root
from zarr_rb.engine import Engine
from zarr_rb.errors import (
    NoSavedBufferError,
    StateChangedError,
    StoreCorruptedError,
    ZarrRBError,
)
from zarr_rb.format.record import Saved
from zarr_rb.state._node import StateNode

LOAD_ATTEMPTS = 5
"""Reads of the saved state a load makes, each time a newer save replaced the one it read,
before it gives up."""

# What reading a slot that a save is rewriting can raise (an array recreated with another
# shape, a tensor record naming an array not written yet).
_TORN = (StoreCorruptedError, ValueError, KeyError, FileNotFoundError)


def read_one_save(
    engine: Engine, saved: Saved, *, refresh: Callable[[], Saved]
) -> tuple[Saved, StateNode]:
    """The state of one save, read whole: ``saved``'s, or a newer save's if one replaced it
    while it was read (then ``refresh`` has moved the storage to it and returned it).

    Raises:
        StateChangedError: every one of :data:`LOAD_ATTEMPTS` reads was replaced.
    """
    for _ in range(LOAD_ATTEMPTS):
        try:
            root = StateNode(engine, saved.group, _state_attrs(engine, saved.group))
            root.read_all()
        except _TORN as err:
            if _named(engine, saved):
                # Nothing replaced it: the state itself is damaged (a missing group too).
                if isinstance(err, ZarrRBError):
                    raise
                raise StoreCorruptedError(
                    f"store {engine.url!r}: the state of its save in group {saved.group!r} "
                    f"cannot be read ({err}); open the data with ZarrStorage(path=...) and "
                    "save again, or load an earlier version (zarr_rb.versions(path))"
                ) from None
        else:
            if _named(engine, saved) and _identity(engine, saved) == _save_of(root.attrs):
                return saved, root
        saved = refresh()
    raise StateChangedError(
        f"store {engine.url!r}: the buffer state was saved again each of the "
        f"{LOAD_ATTEMPTS} times it was read (a writer saving faster than the store is "
        "read). Load again, or while the writer pauses between saves",
    )


def _state_attrs(engine: Engine, group: str) -> dict[str, Any]:
    attrs = engine.read_group_attributes(group).get("zarr_rb_state")
    if not isinstance(attrs, dict):
        raise StoreCorruptedError(
            f"store {engine.url!r}: the save record names group {group!r}, which "
            "holds no buffer state; open the data with ZarrStorage(path=...) and save again"
        )
    return attrs


def _save_of(attrs: dict[str, Any]) -> Any:
    """The identity of the save that wrote a slot (``None`` in stores saved before saves
    had one)."""
    return attrs.get("save")


def _identity(engine: Engine, saved: Saved) -> Any:
    try:
        return _save_of(_state_attrs(engine, saved.group))
    except _TORN:
        return None


def _named(engine: Engine, saved: Saved) -> bool:
    """Whether the store's root record names ``saved`` now (as its last save or as a
    kept version): its state group is then the one it wrote."""
    where = f"store {engine.url!r}"
    document = read_root(engine)
    if document is None:
        raise StoreCorruptedError(f"{where}: its root zarr.json is gone")
    check_is_store(document, where)
    meta = parse_record(document, where, engine=engine)
    if meta.saved is None and not meta.versions:
        raise NoSavedBufferError(f"{where}: its saved buffer was removed while it was loaded")
    return saved in (meta.saved, *meta.versions.values())
