"""The root record of a store, read with a bounded parser and checked before use: is it a
zarr_rb store, and what does it hold. (Arrays' ``zarr.json`` files are checked by
``Engine.check_array_metadata``.)"""

from __future__ import annotations

import math
from typing import Any

from zarr_rb.engine import Engine
from zarr_rb.errors import NotAStoreError, SchemaMismatchError, StoreCorruptedError
from zarr_rb.format.names import ATTRS_KEY
from zarr_rb.format.record import StoreMeta, parse_current_record


def read_root(engine: Engine, *, adopt: bool = False) -> dict[str, Any] | None:
    """The root record (see :meth:`Engine.read_root_metadata` for ``adopt``)."""
    try:
        return engine.read_root_metadata(adopt=adopt)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise StoreCorruptedError(
            f"store {engine.url!r}: root zarr.json is not valid JSON "
            f"({type(err).__name__}: {str(err)[:200]})"
        ) from None


def check_is_store(document: dict[str, Any], where: str) -> None:
    attributes = document.get("attributes")
    if not isinstance(attributes, dict) or ATTRS_KEY not in attributes:
        raise NotAStoreError(
            f"{where} is a Zarr hierarchy but not a zarr_rb store (no "
            f"{ATTRS_KEY!r} attribute on its root group); choose another path",
        )


def parse_meta(
    document: dict[str, Any],
    where: str,
    *,
    max_size: int | None,
    ndim: int | None,
    engine: Engine,
    adopt: bool = False,
) -> StoreMeta:
    meta = parse_record(document, where, engine=engine, adopt=adopt)
    return check_meta(meta, where, max_size=max_size, ndim=ndim)


def parse_record(
    document: dict[str, Any], where: str, *, engine: Engine, adopt: bool = False
) -> StoreMeta:
    """The record ``document`` (read from ``engine``), its run maps read from the pieces it
    names; read again (with ``adopt``, as it was read) when it moved on meanwhile (see
    :func:`parse_current_record`)."""

    def read_again() -> dict[str, Any] | None:
        again = read_root(engine, adopt=adopt)
        if again is not None:
            check_is_store(again, where)
        return again

    return parse_current_record(document, read_again, where=where, pieces=engine.location)


def capacity_of(meta: StoreMeta) -> int:
    """Elements the store holds: ``max_size`` rounded up to whole rows once the shape of a
    row is known."""
    if meta.schema is None:
        return meta.max_size
    return meta.schema.rows * math.prod(meta.schema.batch_shape[1:])


def check_meta(meta: StoreMeta, where: str, *, max_size: int | None, ndim: int | None) -> StoreMeta:
    """``meta``, if the store it describes has the ``max_size`` and ``ndim`` asked for (the
    size it was created with, or the capacity that size was rounded up to, as TorchRL's
    storages do for ``ndim > 1``)."""
    if max_size is not None and max_size not in (meta.max_size, capacity_of(meta)):
        raise SchemaMismatchError(
            f"{where} holds a buffer of max_size={meta.max_size}, got max_size={max_size}; "
            f"pass max_size={meta.max_size} (or None) to reopen it, or use another path",
        )
    if ndim is not None and ndim != meta.ndim:
        raise SchemaMismatchError(
            f"{where} holds a buffer with ndim={meta.ndim}, got ndim={ndim}",
        )
    return meta
