"""Metadata files of a store, read with bounded parsers and checked before use: the root
record (is it a zarr_rb store, what does it hold) and each array's ``zarr.json``."""

from __future__ import annotations

from typing import Any

from zarr_rb._engine import LocalLocation, array_metadata_problem
from zarr_rb._format import ATTRS_KEY, StoreMeta, parse_store_meta
from zarr_rb._io import load_json
from zarr_rb.errors import NotAStoreError, SchemaMismatchError, StoreCorruptedError


def read_root(location: LocalLocation) -> dict[str, Any] | None:
    try:
        return location.read_root_metadata()
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise StoreCorruptedError(
            f"store {str(location.root)!r}: root zarr.json is not valid JSON "
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
    document: dict[str, Any], where: str, *, max_size: int | None, ndim: int | None
) -> StoreMeta:
    meta = parse_store_meta(document["attributes"], where=where)
    if max_size is not None and max_size != meta.max_size:
        raise SchemaMismatchError(
            f"{where} holds a buffer of max_size={meta.max_size}, got max_size={max_size}; "
            f"pass max_size={meta.max_size} (or None) to reopen it, or use another path",
        )
    if ndim is not None and ndim != meta.ndim:
        raise SchemaMismatchError(
            f"{where} holds a buffer with ndim={meta.ndim}, got ndim={ndim}",
        )
    return meta


def check_array_metadata(location: LocalLocation, path: str, shape: tuple[int, ...]) -> None:
    """Read an array's ``zarr.json`` with a bounded parser before TensorStore sees it,
    and check its shape against the schema (before anything is sized from it)."""
    where = f"store {str(location.root)!r}: array {path!r}"
    try:
        document = load_json((location.root / path / "zarr.json").read_bytes())
    except FileNotFoundError:
        raise StoreCorruptedError(f"{where} is missing (no zarr.json)") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise StoreCorruptedError(
            f"{where}: zarr.json is not valid JSON ({type(err).__name__})"
        ) from None
    problem = array_metadata_problem(document, list(shape))
    if problem is not None:
        raise StoreCorruptedError(f"{where}: {problem}")
