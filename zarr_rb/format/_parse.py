"""The checks that parsing a record is made of (the record is untrusted JSON): a value as
expected, an integer in its bounds, a list of them; any other raises
:class:`~zarr_rb.errors.StoreCorruptedError`.
"""

from __future__ import annotations

from zarr_rb.errors import StoreCorruptedError

_MAX_DIMS = 32


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
